"""ExecItem.run's fast path: a kernel item takes its runner's launcher once and every launch passes the buffers it
holds then, by argument position. Checked against numpy on CLANG and LLVM (their ctypes function with each buffer's
remembered address), PYTHON (the program with its sizes bound) and, on a GPU, CUDA (CUDAProgram.positional_launcher):
counters stay exact, a swapped, reallocated or planned buffer is what the kernel reads or writes next, an item rebound
to other memory (the allocator's other buffers, as an eager step meets) never leaves the fast path, and DEBUG=2, the
profiler and a capturing JIT still see every launch. The CUDA launcher is also checked without a GPU, with a fake
driver, in test_cuda_launch.py."""
from __future__ import annotations

import copy

import numpy as np
import pytest

from ourgrad import GlobalCounters, Tensor, profile
from ourgrad.device import Buffer, HostAllocator
from ourgrad.dtype import dtypes
from ourgrad.engine.exec_item import CompiledRunner, CopyRunner, ExecItem, capture_into
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
def test_repeated_launches_take_the_fast_path_and_count_exactly(device, monkeypatch):
  skip_unless_device(device)
  a, b = fresh_values(0), fresh_values(1)
  item = lowered_add(device, a, b)
  general = count_general_launches(monkeypatch)
  GlobalCounters.reset()
  for _ in range(5): item.run()
  assert len(general) == 0 and item._launch is not None
  assert GlobalCounters.kernel_count == 5
  assert GlobalCounters.global_ops == 5 * item.runner.op_count
  assert GlobalCounters.global_mem == 5 * item.runner.byte_count
  np.testing.assert_allclose(output(item), a + b, rtol=1e-6)


@pytest.mark.parametrize("device", ["CLANG", "PYTHON", "CUDA"])
def test_an_item_rebound_to_other_memory_stays_on_the_fast_path(device, monkeypatch):
  """A replayed schedule's item is rebound to the next step's buffers, which the allocator may hand out from other
  memory each step (same-size buffers freed in another order): every launch is fast and reads its current buffers."""
  skip_unless_device(device)
  item = lowered_add(device, fresh_values(3), fresh_values(4))
  general = count_general_launches(monkeypatch)
  rng = np.random.default_rng(5)
  pool = [Buffer(device, 7, item.bufs[1].dtype).copyin(memoryview(fresh_values(10 + index))) for index in range(4)]
  outputs = [Buffer(device, 7, item.bufs[0].dtype) for _ in range(3)]
  for step in range(8):
    first, second = rng.choice(len(pool), 2, replace=False)
    item.bufs = [outputs[step % 3], pool[first], pool[second]]
    item.run()
    np.testing.assert_allclose(output(item), pool[first].numpy() + pool[second].numpy(), rtol=1e-6,
                               err_msg=f"step {step}")
  assert len(general) == 0


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
  for launch in range(3):
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


def test_the_general_path_keeps_the_launcher():
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


def test_a_new_runner_is_not_launched_through_the_old_launcher():
  a, b = fresh_values(0), fresh_values(1)
  item = lowered_add("CLANG", a, b)
  for _ in range(3): item.run()
  old_launcher = item._launch
  item.runner = copy.copy(item.runner)   # another runner (BEAM's pick of other opts would be one)
  calls: list[int] = []
  function = item.runner.host_function
  item.runner.host_function = lambda *pointers: calls.append(1) or function(*pointers)
  item.run()
  assert calls == [1] and item._launch is not old_launcher
  np.testing.assert_allclose(output(item), a + b, rtol=1e-6)


def test_a_copy_item_takes_the_general_path(monkeypatch):
  source = Tensor(fresh_values(6), device="CLANG").realize()
  destination = Buffer("PYTHON", 7, source.dtype)
  item = ExecItem(CopyRunner(source.lazydata.base.realized.nbytes), [destination, source.lazydata.base.realized],
                  device="PYTHON")
  for _ in range(2): item.run()
  assert item._launch is None
  np.testing.assert_array_equal(destination.numpy(), fresh_values(6))


def test_the_allocator_hands_cached_memory_out_in_a_stable_order():
  """Whichever order same-size buffers are freed in, the next allocations get the same memory in the same order: a
  repeated eager step's buffers land on the memory they had the step before."""
  allocator = HostAllocator()
  arrays = [allocator.alloc(64) for _ in range(5)]
  orders = []
  for seed in range(4):
    for index in np.random.default_rng(seed).permutation(5): allocator.free(arrays[index], 64)
    arrays = [allocator.alloc(64) for _ in range(5)]
    orders.append([id(array) for array in arrays])
  assert all(order == orders[0] for order in orders)


def test_a_host_buffer_takes_its_address_from_its_allocator():
  buffer = Buffer("CLANG", 16, dtypes.float32).allocate()
  assert buffer.host_pointer().value == buffer.handle.ctypes.data
  planned = Buffer("CLANG", 8, dtypes.float32)
  planned.use_memory_of(buffer)
  assert planned.host_pointer().value == buffer.handle.ctypes.data


def test_training_steps_launch_every_kernel_on_the_fast_path(monkeypatch):
  """A repeated eager training step on CLANG: after its first steps, every kernel launch is a fast one (the
  launchers do not depend on which memory the allocator hands out), and the losses match numpy's."""
  from ourgrad.engine import exec_item
  from ourgrad.nn import Linear
  monkeypatch.setenv("EAGER_CAPTURE", "0")   # every kernel through ExecItem.run (no graph of the replayed step)
  from ourgrad.nn.optim import SGD
  rng = np.random.default_rng(7)
  layer = Linear(6, 3)
  weight, bias = layer.weight.numpy().astype(np.float64), layer.bias.numpy().astype(np.float64)
  optimizer = SGD([layer.weight, layer.bias], lr=0.1)
  general: list[int] = []
  launches = GlobalCounters.kernel_count
  original = exec_item.ExecItem._run_general
  monkeypatch.setattr(exec_item.ExecItem, "_run_general",
                      lambda self, *args: general.append(1) or original(self, *args))
  for step in range(6):
    x = rng.standard_normal((4, 6)).astype(np.float32)
    if step == 2: general.clear()
    with Tensor.train():
      optimizer.zero_grad()
      loss = (layer(Tensor(x)) ** 2).mean()
      loss.backward()
      optimizer.step()
    out = x @ weight.T + bias
    np.testing.assert_allclose(loss.item(), (out ** 2).mean(), rtol=1e-4)
    grad_out = 2 * out / out.size
    weight, bias = weight - 0.1 * grad_out.T @ x, bias - 0.1 * grad_out.sum(0)
  assert not general and GlobalCounters.kernel_count - launches >= 6 * 3
