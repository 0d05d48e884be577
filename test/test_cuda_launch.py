"""CUDAProgram's launch path without a GPU: the driver calls are replaced by fakes, and the fake cuLaunchKernel reads
the kernel parameters the way the driver does (kernelParams is an array of pointers, one per argument, each to the
argument's value), so the test checks what a kernel would receive. Skips where cuda-python is not installed; the
launches on a real GPU are covered by the CUDA runs of test_ops/test_jit."""
from __future__ import annotations

import ctypes
import threading
import time
from collections import Counter

import pytest

ops_cuda = pytest.importorskip("ourgrad.runtime.ops_cuda", exc_type=ImportError)
driver = ops_cuda.driver
SUCCESS = driver.CUresult.CUDA_SUCCESS


class FakeDevice:
  stream = "the stream"
  start_event = end_event = "event"

  def make_current(self) -> None: pass


class LaunchRecorder:
  """A cuLaunchKernel that records (grid, block, argument values) of each launch; `int_arguments` of the arguments
  (the last ones) are read as int32, the others as 64-bit pointers."""

  def __init__(self, count: int, int_arguments: int = 0, delay_s: float = 0.0, status=SUCCESS, shared: int = 0):
    self.count, self.int_arguments, self.delay_s, self.status = count, int_arguments, delay_s, status
    self.shared = shared
    self.launches: list[tuple] = []

  def __call__(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
    assert function == "function" and stream == FakeDevice.stream and shared == self.shared
    if self.delay_s: time.sleep(self.delay_s)  # another thread may run here (the driver releases the GIL too)
    pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
    values = []
    for index in range(self.count):
      kind = ctypes.c_int32 if index >= self.count - self.int_arguments else ctypes.c_uint64
      values.append(kind.from_address(pointers[index]).value)
    self.launches.append(((gx, gy, gz), (bx, by, bz), tuple(values)))
    return (self.status,)


@pytest.fixture
def program(monkeypatch):
  monkeypatch.setattr(driver, "cuModuleLoadData", lambda cubin: (SUCCESS, "module"))
  monkeypatch.setattr(driver, "cuModuleGetFunction", lambda module, name: (SUCCESS, "function"))
  # no dynamic shared memory symbol in the module: the kernel launches with 0 bytes of it
  monkeypatch.setattr(driver, "cuModuleGetGlobal", lambda module, name: (driver.CUresult.CUDA_ERROR_NOT_FOUND, 0, 0))
  # (bound launches through cuda-python's wrapper, which the tests replace: not through the C trampoline, which calls
  # libcuda itself; tested below with a recording driver function)
  monkeypatch.setattr(ops_cuda, "launch_trampoline", lambda: None)
  return ops_cuda.CUDAProgram(FakeDevice(), "E_4", b"cubin")


def pointers(*values: int) -> list:
  return [driver.CUdeviceptr(value) for value in values]


def test_each_launch_passes_its_own_buffers(program, monkeypatch):
  recorder = LaunchRecorder(count=3)
  monkeypatch.setattr(driver, "cuLaunchKernel", recorder)
  program(*pointers(0x1000, 0x2000, 0x3000), global_size=(4, 2, 1), local_size=(32, 1, 1))
  program(*pointers(0x7000, 0x8000, 0x9000), global_size=(1, 1, 1), local_size=(64, 2, 1))
  assert recorder.launches == [((4, 2, 1), (32, 1, 1), (0x1000, 0x2000, 0x3000)),
                               ((1, 1, 1), (64, 2, 1), (0x7000, 0x8000, 0x9000))]


def test_another_argument_count_rebuilds_the_arrays(program, monkeypatch):
  monkeypatch.setattr(driver, "cuLaunchKernel", LaunchRecorder(count=2))
  program(*pointers(1, 2))
  recorder = LaunchRecorder(count=4)
  monkeypatch.setattr(driver, "cuLaunchKernel", recorder)
  program(*pointers(5, 6, 7, 8))
  assert recorder.launches[0][2] == (5, 6, 7, 8)


def test_symbolic_values_follow_the_buffers_as_int32(program, monkeypatch):
  recorder = LaunchRecorder(count=4, int_arguments=2)
  monkeypatch.setattr(driver, "cuLaunchKernel", recorder)
  program(*pointers(0xA000, 0xB000), global_size=(3, 1, 1), vals=(17, 2**31 - 1))
  assert recorder.launches == [((3, 1, 1), (1, 1, 1), (0xA000, 0xB000, 17, 2**31 - 1))]


def test_threads_launching_one_kernel_do_not_mix_arguments(program, monkeypatch):
  recorder = LaunchRecorder(count=2, delay_s=1e-4)
  monkeypatch.setattr(driver, "cuLaunchKernel", recorder)

  def launch_many(first: int) -> None:
    for _ in range(50): program(*pointers(first, first + 1))
  threads = [threading.Thread(target=launch_many, args=(base,)) for base in (0x100, 0x900)]
  for thread in threads: thread.start()
  for thread in threads: thread.join()
  # each launch got the values of the thread that made it: 50 of each pair, none mixed or taken from the other
  assert Counter(launch[2] for launch in recorder.launches) == {(0x100, 0x101): 50, (0x900, 0x901): 50}


def test_failed_launch_names_the_kernel(program, monkeypatch):
  failure = driver.CUresult.CUDA_ERROR_INVALID_VALUE
  monkeypatch.setattr(driver, "cuLaunchKernel", LaunchRecorder(count=1, status=failure))
  monkeypatch.setattr(driver, "cuGetErrorName", lambda status: (SUCCESS, b"CUDA_ERROR_INVALID_VALUE"))
  monkeypatch.setattr(driver, "cuGetErrorString", lambda status: (SUCCESS, b"invalid argument"))
  with pytest.raises(ops_cuda.DeviceError, match=r"cuLaunchKernel\(E_4\).*CUDA_ERROR_INVALID_VALUE"):
    program(*pointers(0x10))


def test_fast_launch_passes_the_dynamic_shared_memory(program, monkeypatch):
  """A kernel whose tiles exceed 48 KB (staged tensor cores) declares dynamic shared memory: the plain launch path
  must pass that size too (a merge once dropped it to 0, which the driver rejects or which corrupts the tiles)."""
  program.shared_bytes = 73728
  recorder = LaunchRecorder(count=2, shared=73728)
  monkeypatch.setattr(driver, "cuLaunchKernel", recorder)
  program(*pointers(0x1000, 0x2000), global_size=(4, 1, 1), local_size=(128, 1, 1))
  assert recorder.launches == [((4, 1, 1), (128, 1, 1), (0x1000, 0x2000))]


def test_a_bound_launcher_passes_its_buffers_sizes_and_shared_memory(program, monkeypatch):
  program.shared_bytes = 4096
  recorder = LaunchRecorder(count=2, shared=4096)
  monkeypatch.setattr(driver, "cuLaunchKernel", recorder)
  first = program.bind(pointers(0x1000, 0x2000), (8, 1, 1), (256, 1, 1))
  second = program.bind(pointers(0x5000, 0x6000), (2, 3, 1), (32, 4, 1))
  first()
  second()
  first()   # each launcher has its own argument arrays: binding another does not change them
  assert recorder.launches == [((8, 1, 1), (256, 1, 1), (0x1000, 0x2000)), ((2, 3, 1), (32, 4, 1), (0x5000, 0x6000)),
                               ((8, 1, 1), (256, 1, 1), (0x1000, 0x2000))]


def test_a_failed_bound_launch_names_the_kernel(program, monkeypatch):
  failure = driver.CUresult.CUDA_ERROR_INVALID_VALUE
  monkeypatch.setattr(driver, "cuLaunchKernel", LaunchRecorder(count=1, status=failure))
  monkeypatch.setattr(driver, "cuGetErrorName", lambda status: (SUCCESS, b"CUDA_ERROR_INVALID_VALUE"))
  monkeypatch.setattr(driver, "cuGetErrorString", lambda status: (SUCCESS, b"invalid argument"))
  launch = program.bind(pointers(0x10), (1, 1, 1), (1, 1, 1))
  with pytest.raises(ops_cuda.DeviceError, match=r"cuLaunchKernel\(E_4\).*CUDA_ERROR_INVALID_VALUE"):
    launch()


def test_exec_item_fast_path_launches_the_current_buffers(program, monkeypatch):
  """ExecItem.run on a CUDA kernel: it takes one positional launcher (its own argument arrays) for all its launches,
  and a buffer swapped in (TinyJit's new input) or moved onto other memory is what the kernel gets next."""
  from ourgrad import GlobalCounters, dtypes
  from ourgrad.device import Buffer
  from ourgrad.engine.exec_item import CompiledRunner, ExecItem
  monkeypatch.delenv("DEBUG", raising=False)
  monkeypatch.delenv("PROFILE", raising=False)
  recorder = LaunchRecorder(count=2)
  monkeypatch.setattr(driver, "cuLaunchKernel", recorder)
  binds: list[int] = []
  original_bind = program.positional_launcher
  monkeypatch.setattr(program, "positional_launcher", lambda *args: binds.append(1) or original_bind(*args))
  buffers = [Buffer("CUDA", 4, dtypes.float32) for _ in range(3)]
  for buffer, address in zip(buffers, (0x1000, 0x2000, 0x3000)): buffer._handle = driver.CUdeviceptr(address)
  runner = CompiledRunner("E_4", "E_4", "", program, (4, 1, 1), (32, 1, 1), op_count=4, byte_count=48)
  item = ExecItem(runner, buffers[:2], device="CUDA")
  GlobalCounters.reset()
  for _ in range(4): item.run()
  item.bufs[1] = buffers[2]
  for _ in range(3): item.run()
  buffers[0]._handle = driver.CUdeviceptr(0x9000)   # the output moved (the memory planner's use_memory_of)
  item.run()
  arguments = [launch[2] for launch in recorder.launches]
  assert arguments == [(0x1000, 0x2000)] * 4 + [(0x1000, 0x3000)] * 3 + [(0x9000, 0x3000)]
  assert len(binds) == 1 and GlobalCounters.kernel_count == 8 and GlobalCounters.global_mem == 8 * 48
  for buffer in buffers: buffer._handle = None   # fake handles: nothing to free


def test_a_launcher_bound_to_another_stream_launches_there(program, monkeypatch):
  streams: list = []
  monkeypatch.setattr(driver, "cuLaunchKernel", lambda *args: streams.append(args[8]) or (SUCCESS,))
  program.bind(pointers(0x10), (1, 1, 1), (1, 1, 1))()
  program.bind(pointers(0x10), (1, 1, 1), (1, 1, 1), stream="another stream")()
  assert streams == [FakeDevice.stream, "another stream"]


def test_a_positional_launch_rewrites_only_the_slots_whose_buffer_changed(program, monkeypatch):
  recorder = LaunchRecorder(count=3)
  monkeypatch.setattr(driver, "cuLaunchKernel", recorder)

  class Handle:
    """A device pointer that counts its conversions to int (one per slot rewrite)."""
    def __init__(self, address: int): self.address, self.conversions = address, 0
    def __int__(self) -> int:
      self.conversions += 1
      return self.address

  class FakeBuffer:
    def __init__(self, handle: Handle): self._handle = handle

  a, b, c, d = (Handle(address) for address in (0x100, 0x200, 0x300, 0x400))
  launch = program.positional_launcher((2, 1, 1), (32, 1, 1))
  for _ in range(3): launch([FakeBuffer(a), FakeBuffer(b), FakeBuffer(c)])   # new Buffer objects, the same memory
  launch([FakeBuffer(a), FakeBuffer(d), FakeBuffer(c)])
  assert [values for _, _, values in recorder.launches] == [(0x100, 0x200, 0x300)] * 3 + [(0x100, 0x400, 0x300)]
  assert recorder.launches[0][:2] == ((2, 1, 1), (32, 1, 1))
  assert (a.conversions, b.conversions, c.conversions, d.conversions) == (1, 1, 1, 1)


def test_a_positional_launch_allocates_a_buffer_without_memory_and_rebinds_only_then(program, monkeypatch):
  """The launcher compares the buffers' handles with the last launch's as one list: a buffer with no memory yet is
  allocated (once) and its slot written; equal handles on new buffer objects write nothing."""
  recorder = LaunchRecorder(count=2)
  monkeypatch.setattr(driver, "cuLaunchKernel", recorder)
  allocations = []

  class FakeBuffer:
    def __init__(self, handle): self._handle = handle

    def allocate(self):
      allocations.append(self)
      self._handle = driver.CUdeviceptr(0x900)
      return self
  source = driver.CUdeviceptr(0x500)
  launch = program.positional_launcher((1, 1, 1), (4, 1, 1))
  fresh = FakeBuffer(None)
  launch([fresh, FakeBuffer(source)])
  launch([FakeBuffer(fresh._handle), FakeBuffer(source)])
  assert len(allocations) == 1
  assert [values for _, _, values in recorder.launches] == [(0x900, 0x500)] * 2


def test_a_bound_launch_through_the_c_trampoline_gives_the_driver_the_launch(program, monkeypatch):
  """The trampoline (LAUNCH_TRAMPOLINE_SOURCE, compiled by the CLANG device's compiler) calls the driver's function
  with the kernel, grid, block, dynamic shared memory, stream and kernelParams of the bound launch, and no `extra`: a
  recording driver function (a ctypes callback) reads them as the driver would. A nonzero status raises, naming the
  kernel and the driver's error."""
  from ourgrad import Device
  from ourgrad.errors import DeviceError
  try:
    clang = Device["CLANG"]
  except DeviceError:
    pytest.skip("no C compiler")
  source = ops_cuda.LAUNCH_TRAMPOLINE_SOURCE
  function = clang.program("og_launch_kernel", clang.compiler.compile_cached(source)).function
  function.argtypes, function.restype = [ctypes.c_void_p], ctypes.c_int
  seen, status = [], [0]

  def record(kernel, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
    pointers = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
    values = tuple(ctypes.c_uint64.from_address(pointers[index]).value for index in range(2))
    seen.append((kernel, (gx, gy, gz), (bx, by, bz), shared, stream, values, extra))
    return status[0]
  signature = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7, *[ctypes.c_void_p] * 3)
  callback = signature(record)
  monkeypatch.setattr(ops_cuda, "launch_trampoline", lambda: (function, ctypes.cast(callback, ctypes.c_void_p).value))

  class IntStreamDevice(FakeDevice):
    stream = 0x5700
  program.function, program.device, program.shared_bytes = 0xF00, IntStreamDevice(), 96

  class FakeBuffer:
    def __init__(self, handle): self._handle = handle
  launch = program.positional_launcher((3, 2, 1), (64, 1, 1))
  launch([FakeBuffer(driver.CUdeviceptr(0x100)), FakeBuffer(driver.CUdeviceptr(0x200))])
  launch([FakeBuffer(driver.CUdeviceptr(0x100)), FakeBuffer(driver.CUdeviceptr(0x300))])
  assert seen == [(0xF00, (3, 2, 1), (64, 1, 1), 96, 0x5700, (0x100, 0x200), None),
                  (0xF00, (3, 2, 1), (64, 1, 1), 96, 0x5700, (0x100, 0x300), None)]
  status[0] = int(driver.CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)
  names = {status[0]: (b"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", b"too many resources requested for launch")}
  monkeypatch.setattr(driver, "cuGetErrorName", lambda error: (SUCCESS, names[int(error)][0]))
  monkeypatch.setattr(driver, "cuGetErrorString", lambda error: (SUCCESS, names[int(error)][1]))
  with pytest.raises(DeviceError, match=r"cuLaunchKernel\(E_4\).*CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES"):
    launch([FakeBuffer(driver.CUdeviceptr(0x100)), FakeBuffer(driver.CUdeviceptr(0x300))])
