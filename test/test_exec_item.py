"""ExecItem.run's fast path: a kernel launched twice on the same buffer handles gets a bound launcher, and later
launches only call it and count. Checked against numpy on CLANG and LLVM (their ctypes function with bound
pointers), PYTHON (the program with bound arguments) and, on a GPU, CUDA (CUDAProgram.bind): counters stay exact,
swapping, reallocating or moving a buffer onto planned memory invalidates the launcher, and DEBUG=2, the profiler
and a capturing JIT still see every launch. The CUDA launcher is also checked without a GPU, with a fake driver, in
test_cuda_launch.py."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from ourgrad import GlobalCounters, Tensor, profile
from ourgrad.device import Buffer
from ourgrad.engine.exec_item import CompiledRunner, ExecItem, capture_into
from ourgrad.engine.profile import profiler
from ourgrad.engine.realize import lower_schedule
from ourgrad.engine.schedule import create_schedule
from helpers import skip_unless_device

DEVICES = ["CLANG", "LLVM", "PYTHON", "CUDA"]   # CUDA skips without a GPU


def lowered_add(device: str, values: np.ndarray, other: np.ndarray) -> ExecItem:
  """The one ExecItem of `a + b` on realized inputs (its output buffer first), not run yet."""
  a, b = Tensor(values, device=device).realize(), Tensor(other, device=device).realize()
  (item,) = lower_schedule(create_schedule([(a + b).lazydata]))
  assert isinstance(item.runner, CompiledRunner)
  return item


def output(item: ExecItem) -> np.ndarray: return item.bufs[0].numpy().copy()


def count_general_launches(monkeypatch) -> list[int]:
  """A list that gets one entry per launch through CompiledRunner.__call__ (the general path)."""
  calls: list[int] = []
  original = CompiledRunner.__call__

  def counting(self, *args, **kwargs):
    calls.append(1)
    return original(self, *args, **kwargs)
  monkeypatch.setattr(CompiledRunner, "__call__", counting)
  return calls


def fresh_values(seed: int, size: int = 7) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(size).astype(np.float32)


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch):
  # the fast path runs only while DEBUG < 2 and PROFILE is off: start from neither set
  monkeypatch.delenv("DEBUG", raising=False)
  monkeypatch.delenv("PROFILE", raising=False)


@pytest.mark.parametrize("device", DEVICES)
def test_repeated_launches_bind_once_and_count_exactly(device, monkeypatch):
  skip_unless_device(device)
  a, b = fresh_values(0), fresh_values(1)
  item = lowered_add(device, a, b)
  item.runner._launchers.clear()   # earlier tests' launches of this kernel may have met these very handles
  general = count_general_launches(monkeypatch)
  GlobalCounters.reset()
  for _ in range(5): item.run()
  # one general launch (the kernel meets the handles), then four through the launcher bound on the second
  assert len(general) == 1 and item._launch is not None
  assert GlobalCounters.kernel_count == 5
  assert GlobalCounters.global_ops == 5 * item.runner.op_count
  assert GlobalCounters.global_mem == 5 * item.runner.byte_count
  np.testing.assert_allclose(output(item), a + b, rtol=1e-6)


def test_an_item_run_once_binds_nothing():
  item = lowered_add("CLANG", fresh_values(0), fresh_values(1))
  item.runner._launchers.clear()
  item.run()
  assert item._launch is None


@pytest.mark.parametrize("device", ["CLANG", "PYTHON", "CUDA"])
def test_a_new_item_on_handles_the_kernel_met_launches_bound(device, monkeypatch):
  """An eager loop lowers a new ExecItem at every step, on memory the allocator hands back: the kernel's launcher
  bound to those handles serves the new item from its first launch."""
  skip_unless_device(device)
  a, b = fresh_values(3), fresh_values(4)
  first = lowered_add(device, a, b)
  first.runner._launchers.clear()
  first.run()
  general = count_general_launches(monkeypatch)
  GlobalCounters.reset()
  for _ in range(3):   # as each eager step would: a new item, the same runner and buffers
    ExecItem(first.runner, list(first.bufs), device=first.device).run()
  assert len(general) == 0 and GlobalCounters.kernel_count == 3
  np.testing.assert_allclose(output(first), a + b, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_a_swapped_input_buffer_is_read_after_binding(device):
  skip_unless_device(device)
  a, b, c = fresh_values(0), fresh_values(1), fresh_values(2)
  item = lowered_add(device, a, b)
  for _ in range(3): item.run()
  assert item._launch is not None
  slot_of_a = next(slot for slot in (1, 2) if np.array_equal(item.bufs[slot].numpy(), a))
  replacement = Buffer(device, c.size, item.bufs[slot_of_a].dtype).copyin(memoryview(c))
  item.bufs[slot_of_a] = replacement   # what TinyJit does with a new input
  for launch in range(3):      # general, general (binds again), fast
    item.run()
    np.testing.assert_allclose(output(item), c + b, rtol=1e-6, err_msg=f"launch {launch} after the swap")


@pytest.mark.parametrize("device", DEVICES)
def test_a_reallocated_output_buffer_is_written_after_binding(device):
  skip_unless_device(device)
  a, b = fresh_values(0), fresh_values(1)
  item = lowered_add(device, a, b)
  for _ in range(3): item.run()
  output_buffer = item.bufs[0]
  # the buffer gets other memory: a freshly allocated one in its place (its old memory stays with the old object)
  item.bufs[0] = Buffer(device, output_buffer.size, output_buffer.dtype)
  item.run()
  np.testing.assert_allclose(output(item), a + b, rtol=1e-6)
  assert not np.allclose(output(item), 0)


@pytest.mark.parametrize("device", ["CLANG", "PYTHON", "CUDA"])
def test_a_buffer_moved_onto_planned_memory_is_written_there(device):
  skip_unless_device(device)
  a, b = fresh_values(0), fresh_values(1)
  item = lowered_add(device, a, b)
  for _ in range(3): item.run()
  output_buffer = item.bufs[0]
  backing = Buffer(device, output_buffer.size * 2, output_buffer.dtype).allocate()
  output_buffer.use_memory_of(backing)   # the memory planner's move: same Buffer object, another handle
  item.run()
  np.testing.assert_allclose(backing.numpy()[:output_buffer.size], a + b, rtol=1e-6)


def test_debug_2_prints_each_launch_after_binding(monkeypatch, capsys):
  item = lowered_add("CLANG", fresh_values(0), fresh_values(1))
  for _ in range(3): item.run()
  assert item._launch is not None
  capsys.readouterr()
  monkeypatch.setenv("DEBUG", "2")
  item.run()
  item.run()
  printed = [line for line in capsys.readouterr().out.splitlines() if item.runner.name in line]
  assert len(printed) == 2


@pytest.mark.parametrize("debug", ["0", "1"])
def test_debug_0_and_1_keep_the_fast_path(debug, monkeypatch):
  item = lowered_add("CLANG", fresh_values(0), fresh_values(1))
  for _ in range(3): item.run()
  monkeypatch.setenv("DEBUG", debug)
  general = count_general_launches(monkeypatch)
  for _ in range(3): item.run()
  assert not general


def test_the_general_path_does_not_rebind_a_bound_item():
  item = lowered_add("CLANG", fresh_values(0), fresh_values(1))
  for _ in range(3): item.run()
  launcher = item._launch
  for _ in range(3): item._run_general(False)
  assert item._launch is launcher


def test_the_profiler_records_launches_after_binding():
  item = lowered_add("CLANG", fresh_values(0), fresh_values(1))
  for _ in range(3): item.run()
  assert item._launch is not None
  with profile(None) as trace:
    for _ in range(4): item.run()
  assert [event["name"] for event in trace.kernel_events()] == [item.runner.name] * 4


def test_profile_env_takes_the_timed_path(monkeypatch):
  item = lowered_add("CLANG", fresh_values(0), fresh_values(1))
  for _ in range(3): item.run()
  monkeypatch.setattr(profiler, "recorded_for_env", profiler.recorded_for_env)   # no trace file written at exit
  monkeypatch.setenv("PROFILE", "1")
  assert item.run() is not None   # device seconds: the launch was timed


def test_a_capturing_jit_records_fast_launches():
  item = lowered_add("CLANG", fresh_values(0), fresh_values(1))
  for _ in range(3): item.run()
  recorded: list[ExecItem] = []
  with capture_into(recorded):
    item.run()
    item.run()
  assert recorded == [item, item]


def test_a_new_runner_is_not_launched_through_the_old_launcher(monkeypatch):
  a, b = fresh_values(0), fresh_values(1)
  item = lowered_add("CLANG", a, b)
  for _ in range(3): item.run()
  item.runner = copy.copy(item.runner)   # another runner (BEAM's pick of other opts would be one)
  general = count_general_launches(monkeypatch)
  item.run()
  assert len(general) == 1
  np.testing.assert_allclose(output(item), a + b, rtol=1e-6)
