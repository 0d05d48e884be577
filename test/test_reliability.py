"""Reliability: lazy reads never see a later in-place write, bounded kernels, interrupted saves, threads.

Every expected value comes from numpy evaluated eagerly at the line where the lazy tensor was made.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from ourgrad import GlobalCounters, Tensor
from ourgrad.engine import schedule_cache
from ourgrad.engine.snapshot import SNAPSHOT_STATS
from ourgrad.nn.optim import SGD, Adam

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]


def _snapshots() -> int: return SNAPSHOT_STATS.snapshots


# ---------------------------------------------------------------- eager-consistent reads

class TestLazyReaderSeesOldValue:
  def test_assign(self):
    x = Tensor([1., 2., 3.]).realize()
    y = x * 2
    x.assign(x + 1).realize()
    np.testing.assert_allclose(y.numpy(), [2, 4, 6])
    np.testing.assert_allclose(x.numpy(), [2, 3, 4])

  def test_assign_value_read_after(self):
    x = Tensor([1., 2., 3.]).realize()
    value = x + 1
    x.assign(value * 10).realize()
    np.testing.assert_allclose(value.numpy(), [2, 3, 4])
    np.testing.assert_allclose(x.numpy(), [20, 30, 40])

  def test_setitem(self):
    x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)).realize()
    total, row = x.sum(), x[1] * 3
    x[1] = 100.0
    x.realize()
    assert total.item() == 15
    np.testing.assert_allclose(row.numpy(), [9, 12, 15])
    np.testing.assert_allclose(x.numpy(), [[0, 1, 2], [100, 100, 100]])

  def test_inplace_add(self):
    x = Tensor([1., 2., 3.]).realize()
    shifted = x[1:] + 0.5
    x += 1
    x *= 2
    x.realize()
    np.testing.assert_allclose(shifted.numpy(), [2.5, 3.5])
    np.testing.assert_allclose(x.numpy(), [4, 6, 8])

  def test_reader_of_reader(self):
    x = Tensor([1., 2., 3.]).realize()
    y = (x * 2).exp2().sum()
    x.assign(x * 0).realize()
    np.testing.assert_allclose(y.numpy(), np.exp2(np.array([2., 4., 6.])).sum(), rtol=1e-6)

  def test_two_writes_two_readers(self):
    x = Tensor([1., 2.]).realize()
    first = x + 0.25
    x.assign(x * 10).realize()
    second = x + 0.25
    x.assign(x * 10).realize()
    np.testing.assert_allclose(first.numpy(), [1.25, 2.25])
    np.testing.assert_allclose(second.numpy(), [10.25, 20.25])
    np.testing.assert_allclose(x.numpy(), [100, 200])

  def test_readers_through_views_and_copies(self):
    values = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = Tensor(values.copy()).realize()
    transposed = x.permute(1, 0) + 1
    padded = x.pad(((1, 0), (0, 2))).sum(axis=0)
    flipped_max = x.flip(1).max(axis=1)
    copied = (x * 3).to("PYTHON")
    x.assign(x * -1).realize()
    np.testing.assert_allclose(transposed.numpy(), values.T + 1)
    np.testing.assert_allclose(padded.numpy(), np.pad(values, ((1, 0), (0, 2))).sum(axis=0))
    np.testing.assert_allclose(flipped_max.numpy(), values[:, ::-1].max(axis=1))
    np.testing.assert_allclose(copied.numpy(), values * 3)
    np.testing.assert_allclose(x.numpy(), -values)

  def test_aliases_see_the_write(self):
    """A tensor holding the buffer itself (detach, a view) is an alias of it, as in PyTorch."""
    x = Tensor([1., 2., 3.]).realize()
    alias, view = x.detach(), x[0:2]
    x.assign(x + 1).realize()
    np.testing.assert_allclose(alias.numpy(), [2, 3, 4])
    np.testing.assert_allclose(view.numpy(), [2, 3])

  def test_no_reader_no_copy(self):
    x = Tensor([1., 2., 3.]).realize()
    before = _snapshots()
    GlobalCounters.reset()
    x.assign(x + 1).realize()
    assert GlobalCounters.kernel_count == 1 and _snapshots() == before

  def test_one_copy_kernel_per_protected_write(self):
    x = Tensor([1., 2., 3.]).realize()
    readers = [x * 2, x + 3, x.sum()]
    GlobalCounters.reset()
    x.assign(x + 1).realize()
    assert GlobalCounters.kernel_count == 2  # the snapshot copy and the assign
    np.testing.assert_allclose(readers[0].numpy(), [2, 4, 6])
    np.testing.assert_allclose(readers[1].numpy(), [4, 5, 6])
    assert readers[2].item() == 6

  def test_reader_realized_in_same_schedule(self):
    x = Tensor([1., 2., 3.]).realize()
    y = x * 2
    before = _snapshots()
    Tensor.realize_all(y, x.assign(x + 1))
    assert _snapshots() == before
    np.testing.assert_allclose(y.numpy(), [2, 4, 6])



def test_lazy_reader_when_the_schedule_comes_from_the_cache():
  """The second and later steps of a loop reuse the structural schedule cache; their lazy readers still need a
  snapshot (a cache hit once skipped it)."""
  start = np.array([1.0, 2.0, 3.0], dtype=np.float32)
  x = Tensor(start).realize()
  hits_before = schedule_cache.stats.hits
  for step in range(4):
    doubled = x * 2
    x.assign(x + 1).realize()
    np.testing.assert_allclose(doubled.numpy(), (start + step) * 2)
  assert schedule_cache.stats.hits > hits_before, "the loop's assigns were all scheduled from scratch"


@pytest.mark.parametrize("optimizer", [SGD, Adam])
def test_metric_before_optimizer_step(optimizer):
  rng = np.random.default_rng(0)
  weight_values = rng.standard_normal((4, 3)).astype(np.float32)
  inputs = rng.standard_normal((5, 4)).astype(np.float32)
  weight = Tensor(weight_values, requires_grad=True)
  opt = optimizer([weight], lr=0.1)
  out = Tensor(inputs) @ weight
  loss = out.square().mean()
  loss.backward()
  weight_norm = (weight * weight).sum()   # a metric of the weights, left lazy over the step
  grad_sum = weight.grad.sum()
  expected_grad = (2 / out.numel()) * inputs.T @ (inputs @ weight_values)
  opt.step()
  assert not np.allclose(weight.numpy(), weight_values)
  np.testing.assert_allclose(weight_norm.item(), (weight_values ** 2).sum(), rtol=1e-5)
  np.testing.assert_allclose(grad_sum.item(), expected_grad.sum(), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(loss.item(), ((inputs @ weight_values) ** 2).mean(), rtol=1e-5)


def test_random_interleaved_reads_and_writes():
  """Random lazy reads (elementwise, slices, reductions of one or two buffers) and in-place writes (assign,
  setitem, +=), realized in random order, against numpy evaluated eagerly at each line."""
  rng = np.random.default_rng(1234)
  arrays = [rng.standard_normal(6).astype(np.float32) for _ in range(3)]
  tensors = [Tensor(array.copy()).realize() for array in arrays]
  readers: list[tuple[Tensor, np.ndarray]] = []
  for _ in range(60):
    action = rng.integers(0, 6)
    i, j = rng.integers(0, len(tensors), 2)
    if action == 0:
      readers.append((tensors[i] * 2 + tensors[j], arrays[i] * 2 + arrays[j]))
    elif action == 1:
      readers.append((tensors[i][1:4].sum(), arrays[i][1:4].sum()))
    elif action == 2:
      value = float(rng.integers(-3, 4))
      tensors[i].assign(tensors[j] * 0.5 + value)
      arrays[i] = arrays[j] * 0.5 + value
    elif action == 3:
      start = int(rng.integers(0, 5))
      tensors[i][start:start + 2] = 7.0
      arrays[i] = arrays[i].copy()
      arrays[i][start:start + 2] = 7.0
    elif action == 4:
      tensors[i] += 1
      arrays[i] = arrays[i] + 1
    elif readers:
      tensor, expected = readers.pop(int(rng.integers(0, len(readers))))
      np.testing.assert_allclose(tensor.numpy(), expected, rtol=1e-5, atol=1e-5)
    if rng.random() < 0.3: tensors[int(rng.integers(0, len(tensors)))].realize()
  for tensor, expected in readers: np.testing.assert_allclose(tensor.numpy(), expected, rtol=1e-5, atol=1e-5)
  for tensor, expected in zip(tensors, arrays): np.testing.assert_allclose(tensor.numpy(), expected, rtol=1e-5)


# ---------------------------------------------------------------- interrupted saves

_SAVER = textwrap.dedent("""
  import sys
  import numpy as np
  from ourgrad import Tensor
  from ourgrad.nn.state import safe_save
  path, size = sys.argv[1], int(sys.argv[2])
  safe_save({"w": Tensor(np.full(size, 1.0, dtype=np.float32))}, path)
  print("saved", flush=True)
  big = {"w": Tensor(np.full(size, 2.0, dtype=np.float32))}
  while True: safe_save(big, path)
""")


def test_killed_save_keeps_previous_checkpoint(tmp_path):
  from ourgrad.nn.state import safe_load
  path, size = tmp_path / "model.safetensors", 8 << 20   # 32 MB: each save takes a while to write and fsync
  script = tmp_path / "saver.py"
  script.write_text(_SAVER)
  env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
  for _attempt in range(5):
    path.unlink(missing_ok=True)
    for leftover in tmp_path.glob("model.safetensors.tmp*"): leftover.unlink()
    child = subprocess.Popen([sys.executable, str(script), str(path), str(size)], stdout=subprocess.PIPE, env=env)
    assert child.stdout is not None and child.stdout.readline().strip() == b"saved"
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("model.safetensors.tmp*")) and time.monotonic() < deadline: time.sleep(0.0005)
    child.send_signal(signal.SIGKILL)
    child.wait()
    # the temporary file survives only if the kill landed before the rename: the save was interrupted
    if list(tmp_path.glob("model.safetensors.tmp*")): break
  else:
    pytest.skip("the kill never landed inside a save (the machine is too fast or too loaded to catch one)")
  # the file is the last complete checkpoint (the first one, or a finished save of the second), never a part
  values = safe_load(path)["w"].numpy()
  assert values.shape == (size,) and values[0] in (1.0, 2.0)
  np.testing.assert_array_equal(values, np.full(size, values[0], dtype=np.float32))


# ---------------------------------------------------------------- bounded kernels

def _chain(values: np.ndarray, count: int) -> tuple[Tensor, np.ndarray]:
  tensor, expected = Tensor(values), values.copy()
  for step in range(count):
    if step % 2 == 0: tensor, expected = tensor * 1.001, expected * np.float32(1.001)
    else: tensor, expected = tensor + 0.01, expected + np.float32(0.01)
  return tensor, expected


class TestBoundedKernels:
  def test_long_chain_is_split(self, monkeypatch):
    monkeypatch.setenv("KERNEL_OPS_LIMIT", "100")
    tensor, expected = _chain(np.linspace(-1, 1, 12, dtype=np.float32), 250)
    GlobalCounters.reset()
    tensor.realize()
    assert GlobalCounters.kernel_count == 3   # ops 1-100, 101-200, 201-250
    np.testing.assert_allclose(tensor.numpy(), expected, rtol=1e-5)

  def test_default_limit_splits_a_huge_chain(self, monkeypatch):
    monkeypatch.delenv("KERNEL_OPS_LIMIT", raising=False)
    tensor, expected = _chain(np.linspace(-1, 1, 8, dtype=np.float32), 2100)
    GlobalCounters.reset()
    tensor.realize()
    assert GlobalCounters.kernel_count == 3   # 1024 + 1024 + 52 ops
    np.testing.assert_allclose(tensor.numpy(), expected, rtol=1e-4)

  def test_no_limit_is_one_kernel(self, monkeypatch):
    monkeypatch.setenv("KERNEL_OPS_LIMIT", "0")
    tensor, expected = _chain(np.linspace(-1, 1, 12, dtype=np.float32), 250)
    GlobalCounters.reset()
    tensor.realize()
    assert GlobalCounters.kernel_count == 1
    np.testing.assert_allclose(tensor.numpy(), expected, rtol=1e-5)

  def test_shared_subgraphs_count_once(self, monkeypatch):
    """x = 0.5x + sin(0.1x) reads x twice per step: counted per path it would pass any limit after ~10 steps;
    counted once per distinct op it is 4 ops a step."""
    monkeypatch.setenv("KERNEL_OPS_LIMIT", "200")
    values = np.linspace(-2, 2, 8, dtype=np.float32)
    tensor, expected = Tensor(values), values.copy()
    for _ in range(40): tensor, expected = tensor * 0.5 + (tensor * 0.1).sin(), expected * 0.5 + np.sin(expected * 0.1)
    GlobalCounters.reset()
    tensor.realize()
    assert GlobalCounters.kernel_count == 1   # 160 ops
    np.testing.assert_allclose(tensor.numpy(), expected, rtol=1e-4, atol=1e-6)

  def test_split_inside_a_reduce(self, monkeypatch):
    monkeypatch.setenv("KERNEL_OPS_LIMIT", "64")
    values = np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6)
    tensor, expected = _chain(values, 150)
    total = tensor.sum(axis=1)
    GlobalCounters.reset()
    total.realize()
    assert GlobalCounters.kernel_count == 3
    np.testing.assert_allclose(total.numpy(), expected.sum(axis=1), rtol=1e-5)

  def test_compile_timeout_names_the_kernel(self, monkeypatch):
    from ourgrad import Device
    from ourgrad.errors import CompileError
    if Device.DEFAULT != "CLANG": pytest.skip("the compile timeout is the CLANG compiler's")
    monkeypatch.setenv("COMPILE_TIMEOUT", "0.0001")
    monkeypatch.setenv("NOOPT", "1")
    monkeypatch.setenv("DISABLE_COMPILER_CACHE", "1")
    unique = float(np.random.default_rng().integers(1, 1 << 20))   # a kernel no earlier test compiled
    with pytest.raises(CompileError, match=r"compiling kernel E_\w+ .* COMPILE_TIMEOUT"):
      (Tensor(np.ones(7, dtype=np.float32)).exp2() * unique).realize()


# ---------------------------------------------------------------- threads

def _train(steps: int, loader_batches: list[np.ndarray] | None = None) -> list[float]:
  """A small regression trained with SGD; with `loader_batches`, a worker thread meanwhile builds, realizes and
  copies tensors from them (a data loader) and checks each against numpy."""
  import threading
  rng = np.random.default_rng(7)
  inputs, targets = rng.standard_normal((16, 8)).astype(np.float32), rng.standard_normal((16, 1)).astype(np.float32)
  weight = Tensor(rng.standard_normal((8, 1)).astype(np.float32) * 0.1, requires_grad=True)
  opt = SGD([weight], lr=0.05, momentum=0.9)
  failures: list[BaseException] = []

  def load() -> None:
    try:
      for batch in loader_batches or []:
        tensor = Tensor(batch)
        normalized = ((tensor - tensor.mean()) / (tensor.std() + 1e-5)).realize()
        copied = normalized.to("PYTHON").numpy()
        expected = (batch - batch.mean()) / (batch.std(ddof=1) + 1e-5)
        np.testing.assert_allclose(copied, expected, rtol=1e-4, atol=1e-4)
    except BaseException as error:  # noqa: BLE001 - re-raised in the main thread
      failures.append(error)

  worker = threading.Thread(target=load)
  worker.start()
  losses = []
  for _ in range(steps):
    loss = ((Tensor(inputs) @ weight - Tensor(targets)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    Tensor.realize_all(loss, *opt.schedule_step())
    losses.append(loss.item())
  worker.join()
  if failures: raise failures[0]
  return losses


def test_data_loader_thread_beside_training():
  rng = np.random.default_rng(3)
  batches = [rng.standard_normal((int(rng.integers(2, 40)), 5)).astype(np.float32) for _ in range(40)]
  alone = _train(30)
  with_loader = _train(30, batches)
  np.testing.assert_allclose(with_loader, alone, rtol=1e-6)
  assert alone[-1] < alone[0]


def test_threads_building_readers_of_one_weight():
  """Several threads build lazy readers of one buffer and realize them while the main thread assigns to it: each
  reader gives the value of the buffer when the reader was built."""
  import threading
  x = Tensor(np.zeros(64, dtype=np.float32)).realize()
  failures: list[BaseException] = []
  lock = threading.Lock()   # orders "read the current step" with "build the reader" against the writer
  step = [0]

  def reader() -> None:
    try:
      for _ in range(30):
        with lock:
          expected, lazy = float(step[0]), x * 2.0
        lazy = lazy + 0.5
        assert lazy.numpy()[0] == 2 * expected + 0.5
    except BaseException as error:  # noqa: BLE001 - re-raised below
      failures.append(error)

  threads = [threading.Thread(target=reader) for _ in range(3)]
  for thread in threads: thread.start()
  for _ in range(40):
    with lock:
      x.assign(x + 1).realize()
      step[0] += 1
    time.sleep(0.001)
  for thread in threads: thread.join()
  if failures: raise failures[0]
  assert x.numpy()[0] == 40


# ---------------------------------------------------------------- bounded caches (long runs)

def test_runner_cache_is_bounded(monkeypatch):
  from ourgrad.engine import realize as realize_module
  monkeypatch.setenv("RUNNER_CACHE_SIZE", "2")
  values = np.arange(5, dtype=np.float32)
  for scale in (3.0, 5.0, 7.0, 11.0):   # four different kernels
    np.testing.assert_allclose((Tensor(values) * scale + 1).numpy(), values * scale + 1)
  assert len(realize_module._runner_cache) == 2


def test_disk_compile_cache_is_bounded(tmp_path, monkeypatch):
  """The on-disk compile cache keeps at most COMPILE_CACHE_BYTES: past it, the least recently used binaries go."""
  from ourgrad import device as device_module
  from ourgrad.device import Device, prune_compile_cache
  monkeypatch.setenv("OURGRAD_CACHE_DIR", str(tmp_path))
  compiler = Device["CLANG"].compiler
  sources = [f'void k{number}(float* out) {{ out[0] = {number}.0f; }}' for number in range(4)]
  for age, source in enumerate(sources):  # oldest first: distinct mtimes make the order certain
    compiler.compile_cached(source)
    os.utime(compiler.cache_path(source), (1000 + age, 1000 + age))
  sizes = [compiler.cache_path(source).stat().st_size for source in sources]
  compiler.load_cached(sources[0])  # used again: now the most recent
  deleted = prune_compile_cache(sizes[0] + sizes[3] + 1)
  assert deleted == sizes[1] + sizes[2]
  assert [compiler.cache_path(source).exists() for source in sources] == [True, False, False, True]
  # the bound is also applied by writes themselves (a bound of 0: at each write; test_compile_cache_bound.py)
  monkeypatch.setattr(device_module, "PRUNE_EVERY_WRITES", 1)
  monkeypatch.setenv("COMPILE_CACHE_BYTES", "0")
  compiler.compile_cached("void k9(float* out) { out[0] = 9.0f; }")
  assert not list((tmp_path / "compile").glob("*/*"))


def test_allocator_cache_is_bounded(monkeypatch):
  from ourgrad import Device
  allocator = Device[Device.DEFAULT].allocator
  if not hasattr(allocator, "cached_total"): pytest.skip("the default device's allocator keeps no cache")
  monkeypatch.setenv("ALLOCATOR_CACHE_BYTES", str(4096))
  allocator.free_cache()
  for size in (100, 200, 300, 2000):   # freed at once: 400 + 800 + 1200 bytes are kept, 8000 would pass the bound
    (Tensor(np.ones(size, dtype=np.float32)) + 1).numpy()
  assert 0 < allocator.cached_bytes() <= 4096


@pytest.mark.parametrize("device_memory, setting, kept", [
  (16 << 30, None, True),        # default: a quarter of 16 GiB keeps a 3 GiB buffer
  (4 << 30, None, False),        # at least 2 GiB: a quarter of 4 GiB is 1 GiB, the bound is 2 GiB
  (0, None, False),              # a device that does not say: 2 GiB
  (16 << 30, str(2 << 30), False),   # an explicit bound wins
  (0, "-1", True)])              # no bound
def test_allocator_cache_bound_follows_the_device_memory(monkeypatch, device_memory, setting, kept):
  from ourgrad.device import LRUAllocator

  class FakeAllocator(LRUAllocator):
    freed: list = []
    def _alloc(self, nbytes): return object()
    def _free(self, handle, nbytes): self.freed.append(nbytes)
    def device_memory_bytes(self): return device_memory

  if setting is None: monkeypatch.delenv("ALLOCATOR_CACHE_BYTES", raising=False)
  else: monkeypatch.setenv("ALLOCATOR_CACHE_BYTES", setting)
  allocator = FakeAllocator()
  allocator.free(allocator.alloc(3 << 30), 3 << 30)
  assert (allocator.cached_bytes() == 3 << 30) is kept and (allocator.freed == []) is kept


def test_clear_caches():
  from ourgrad import Device
  from ourgrad.engine import realize as realize_module
  from ourgrad.helpers import clear_caches
  (Tensor(np.ones(9, dtype=np.float32)) * 13).numpy()
  clear_caches()
  assert len(realize_module._runner_cache) == 0 and Device[Device.DEFAULT].allocator.cached_bytes() == 0
  np.testing.assert_allclose((Tensor(np.ones(9, dtype=np.float32)) * 13).numpy(), np.full(9, 13.0))
