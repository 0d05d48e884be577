"""Devices: copies between every pair of available devices, device selection, and the errors for absent or
mixed devices. Devices that cannot be opened here (no driver, no package) are skipped, so the same file runs on a
CPU-only CI machine and on a GPU machine."""
import itertools

import numpy as np
import pytest

from ourgrad import Device, Tensor, dtypes
from ourgrad.errors import DeviceError

CANDIDATES = ["CLANG", "LLVM", "OPENCL", "PYTHON", "CUDA"]


def _available() -> list[str]:
  names = []
  for name in CANDIDATES:
    try:
      Device[name]
      names.append(name)
    except DeviceError:
      pass
  return names


AVAILABLE = _available()


@pytest.mark.parametrize("source, target", list(itertools.permutations(AVAILABLE, 2)))
def test_copy_between_devices(source, target):
  values = np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 5.5
  moved = Tensor(values, device=source).to(target)
  assert moved.device == target
  np.testing.assert_array_equal(moved.numpy(), values)
  # a computed, non-contiguous tensor is copied with its values, not its layout
  computed = (Tensor(values, device=source).permute(2, 0, 1) * 2).to(target)
  np.testing.assert_array_equal(computed.numpy(), values.transpose(2, 0, 1) * 2)


@pytest.mark.parametrize("device", AVAILABLE)
def test_each_device_computes_a_fused_kernel(device):
  a = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
  x = Tensor(a, device=device)
  result = ((x @ x.T).relu() + 1).sum(axis=1)
  np.testing.assert_allclose(result.numpy(), (np.maximum(a @ a.T, 0) + 1).sum(axis=1), rtol=1e-4)


@pytest.mark.parametrize("device", AVAILABLE)
@pytest.mark.parametrize("dtype", [dtypes.int8, dtypes.uint8, dtypes.int64, dtypes.bool, dtypes.float16,
                                   dtypes.bfloat16, dtypes.float64])
def test_dtypes_round_trip_through_each_device(device, dtype):
  values = np.array([0, 1, 2, 100, 7], dtype=np.float32)
  if dtype == dtypes.bool: values = values.astype(bool)
  tensor = Tensor(values, dtype=dtype).to(device)
  np.testing.assert_array_equal((tensor + tensor).to("CLANG").numpy(), (Tensor(values, dtype=dtype) * 2).numpy()
                                if dtype != dtypes.bool else values)


def test_mixing_devices_names_both_and_the_fix():
  if len(AVAILABLE) < 2: pytest.skip("needs two devices")
  first, second = AVAILABLE[:2]
  with pytest.raises(DeviceError, match=rf"{first}.*{second}.*\.to\("):
    Tensor([1.0], device=first) + Tensor([1.0], device=second)


def test_unknown_device_lists_the_known_ones():
  with pytest.raises(DeviceError, match="unknown device 'NOPE'.*CLANG"):
    Tensor([1.0], device="NOPE")


def test_aliases_and_default():
  assert Device.canonicalize("cpu") == "CLANG"
  assert Device.canonicalize("gpu") == "OPENCL"
  assert Device.DEFAULT in AVAILABLE


def test_device_env_var_selects_the_default(monkeypatch):
  monkeypatch.setenv("DEVICE", "CLANG")
  assert Device.DEFAULT == "CLANG"
  assert Tensor([1.0]).device == "CLANG"


@pytest.mark.parametrize("device", AVAILABLE)
def test_buffer_reads_are_new_arrays_and_read_later_keeps_the_queued_value(device):
  """`Buffer.numpy` returns a new array each read (writing it changes neither the buffer nor the next read), and
  `Buffer.read_later` gives the contents as they were when it was called, even when later work (queued before the
  read is waited for) overwrites the buffer: the copy is ordered before that work."""
  values = np.arange(6, dtype=np.float32) - 2.5
  tensor = Tensor(values, device=device).contiguous().realize()
  buffer = tensor.lazydata.base.realized
  first = buffer.numpy()
  first[:] = 99
  np.testing.assert_array_equal(buffer.numpy(), values)
  np.testing.assert_array_equal(tensor.numpy(), values)
  pending = buffer.read_later()
  tensor.assign(tensor * 10).realize()   # queued after the read: overwrites the same buffer
  assert tensor.lazydata.base.realized is buffer
  np.testing.assert_array_equal(pending.numpy(), values)
  np.testing.assert_array_equal(pending.numpy(), values)   # read twice: the same values
  np.testing.assert_array_equal(buffer.numpy(), values * 10)


@pytest.mark.parametrize("device", AVAILABLE)
@pytest.mark.parametrize("count", [3, 16384, 16385, 100_000], ids=["tiny", "64KiB", "64KiB+4", "large"])
def test_copies_in_and_out_on_both_sides_of_the_small_copy_size(device, count):
  """Copies in and out of up to 64 KiB take CUDA's pageable path (no staging buffer), larger ones the pinned staging
  buffer: both give the bytes back, also from a read-only source and into a buffer written by a queued kernel."""
  values = np.random.default_rng(count).standard_normal(count).astype(np.float32)
  source = values.copy()
  source.flags.writeable = False   # a read-only host buffer: its address is taken another way
  tensor = Tensor(source, device=device).realize()
  np.testing.assert_array_equal(tensor.numpy(), values)
  np.testing.assert_array_equal((tensor * 2).numpy(), values * 2)   # read right after the kernel was queued


@pytest.mark.skipif("OPENCL" not in AVAILABLE, reason="needs an OpenCL device")
def test_opencl_loads_the_program_it_just_built_instead_of_building_its_binary_again(tmp_path, monkeypatch):
  """A kernel compiled in this process is loaded from the program its source built (PoCL: building the binary again
  cost ~0.25 s a kernel); a binary from the disk cache is built as before; both compute the same. A program is
  handed over once, and never into another device's context."""
  monkeypatch.setenv("OURGRAD_CACHE_DIR", str(tmp_path))
  from ourgrad.runtime import ops_opencl
  device = Device["OPENCL"]
  source = "__kernel void twice(__global float* out, __global const float* x) { int i = get_global_id(0); " \
           f"out[i] = x[i] * 2.0f + {len(str(tmp_path))}.0f; }}"
  binary = device.compiler.compile(source)
  built = device.compiler.built[binary]
  fresh = ops_opencl.OpenCLProgram(device, "twice", binary)
  assert fresh.program is built and binary not in device.compiler.built
  again = ops_opencl.OpenCLProgram(device, "twice", binary)   # as from the disk cache: built from the binary
  assert again.program is not built
  values = np.arange(8, dtype=np.float32)
  for program in (fresh, again):
    x, out = Tensor(values, device="OPENCL").realize(), Tensor.zeros(8, device="OPENCL").contiguous().realize()
    program(out.lazydata.base.realized.handle, x.lazydata.base.realized.handle, global_size=(8, 1, 1), wait=True)
    np.testing.assert_array_equal(out.numpy(), values * 2 + len(str(tmp_path)))
  device.compiler.compile(source)
  assert device.compiler.built_program(binary, object()) is None, "another context never gets it"


@pytest.mark.parametrize("device", AVAILABLE)
def test_buffers_made_in_one_step_hold_memory_as_allocated_ones(device):
  """device.allocated_buffer and new_buffer (the schedule cache's replays) against Buffer(...).allocate(): the same
  fields, the bytes counted in use while held and given back to the allocator's cache when dropped (the same memory
  handed out next), a host buffer's remembered address; a buffer run on another's memory takes its address."""
  from ourgrad.device import Buffer, allocated_buffer, new_buffer
  from ourgrad.helpers import GlobalCounters
  allocator = Device[device].allocator
  plain = Buffer(device, 6, dtypes.float32).allocate()
  in_use = GlobalCounters.mem_used
  made = allocated_buffer(allocator, device, 6, dtypes.float32)
  assert GlobalCounters.mem_used == in_use + 24
  assert (made.device, made.size, made.dtype, made.nbytes, made.is_allocated) == (device, 6, dtypes.float32, 24, True)
  if plain._pointer is not None: assert made._pointer is not None and made._pointer.value == made.host_pointer().value
  made.copyin(memoryview(np.arange(6, dtype=np.float32)).cast("B"))
  np.testing.assert_array_equal(made.numpy(), np.arange(6, dtype=np.float32))
  handle = made._handle
  del made
  assert GlobalCounters.mem_used == in_use
  if hasattr(allocator, "cache"): assert any(kept is handle for kept in allocator.cache.get(24, []))
  lazy = new_buffer(allocator, device, 2, dtypes.int32)
  assert not lazy.is_allocated and GlobalCounters.mem_used == in_use
  lazy.copyin(memoryview(np.array([3, -4], dtype=np.int32)).cast("B"))
  np.testing.assert_array_equal(lazy.numpy(), [3, -4])
  assert GlobalCounters.mem_used == in_use + 8
  del lazy
  assert GlobalCounters.mem_used == in_use
  if allocator.shares_memory:
    planned = Buffer(device, 4, dtypes.float32)
    planned.use_memory_of(plain)
    if plain._pointer is not None: assert planned._pointer is plain._pointer
    planned.copyin(memoryview(np.full(4, 7, dtype=np.float32)).cast("B"))
    np.testing.assert_array_equal(plain.numpy()[:4], np.full(4, 7, dtype=np.float32))
