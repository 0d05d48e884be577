"""The CUDA device: CUDA C++ -> CUBIN with NVRTC, launched through the driver API (cuda-python's bindings).

Kernels are compiled for the GPU's own architecture (sm_XX from its compute capability) straight to CUBIN, so
the driver loads machine code and never has to JIT PTX from a newer NVRTC. Memory comes from plain cuMemAlloc;
launches and copies-in are asynchronous on one stream, and the host waits only when it needs data (copyout) or a
timing. Copies of at most 64 KiB go straight from and to the caller's pageable memory (in: the driver stages the
bytes before it returns, without waiting for the stream; out: one call that waits for the stream and copies); larger
ones go through a ring of pinned staging memory (runtime/staging.py). The calls of a replayed step's host path
(small copies, graph launch, stream wait) go through ctypes (DirectCalls). Every driver call is checked: an error
names the call.
`pip install 'ourgrad[cuda]'` brings cuda-python and NVRTC; a driver must be installed.
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
import threading
from typing import Any, Callable

import numpy as np

from ourgrad.device import Compiled, Compiler, Device, LRUAllocator
from ourgrad.errors import CompileError, DeviceError
from ourgrad.helpers import CUDA_DEPENDENT_LAUNCH, CUDA_PTX, DEBUG, env_var
from ourgrad.renderer import GpuFacts
from ourgrad.renderer.cuda import DYNAMIC_SHARED_SYMBOL, CUDARenderer, GridFootprint
from ourgrad.runtime.staging import StagingRing

try:
  from cuda.bindings import driver, nvrtc
except ImportError as error:  # the registry turns this into a DeviceError saying what to install
  raise ModuleNotFoundError(str(error), name="cuda.bindings") from error


CUDA_SUCCESS = driver.CUresult.CUDA_SUCCESS
# a kernel launch inside a CUDA graph costs ~1-2 us on an H100/H200; times the bandwidth: the renderer's launch_bytes
LAUNCH_SECONDS = 1.5e-6
# a load waits ~0.6 us for HBM under load (H100/H200); times the bandwidth: the renderer's latency_bytes
MEMORY_LATENCY_SECONDS = 0.6e-6
# host-to-device copies up to this size go from pageable memory without waiting for the stream (CUDA's documented
# behaviour for async copies from pageable memory: the bytes are staged by the driver before the call returns);
# larger ones go through the pinned staging buffer, at full bandwidth
SMALL_COPY_BYTES = 64 << 10


def pointer_arguments(values: list[int]) -> tuple[Any, Any]:
  """A launch's kernelParams for buffer pointers: (the array of the pointer values, the array of each value's
  address: what cuLaunchKernel takes). Both must stay alive as long as a launch may use them."""
  arguments = (ctypes.c_uint64 * max(len(values), 1))(*values)
  base, size = ctypes.addressof(arguments), ctypes.sizeof(ctypes.c_uint64)
  pointers = (ctypes.c_void_p * max(len(values), 1))(*[base + index * size for index in range(len(values))])
  return arguments, pointers


def check(result: tuple, call: str) -> Any:
  """Unpack a cuda-python result tuple, raising DeviceError naming the call if it failed."""
  status, *values = result
  if isinstance(status, driver.CUresult) and status != driver.CUresult.CUDA_SUCCESS:
    _, name = driver.cuGetErrorName(status)
    _, text = driver.cuGetErrorString(status)
    raise DeviceError(f"{call} failed: {name.decode() if name else status} ({text.decode() if text else ''})")
  if isinstance(status, nvrtc.nvrtcResult) and status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
    raise DeviceError(f"{call} failed: {nvrtc.nvrtcGetErrorString(status)[1].decode()}")
  if not values: return None
  return values[0] if len(values) == 1 else tuple(values)


# pinned host memory each CUDA device stages its copies through (runtime/staging.py): copies larger than a quarter
# of it go in chunks, so a model's weights need none of their own size
STAGING_BYTES = 16 << 20


class CUDAFences:
  """CUDA events as a staging ring's fences (runtime/staging.py Fences), recorded on the device's stream and reused:
  an event is created once and recorded again after it was released."""

  def __init__(self, device: CUDADevice):
    self.device = device
    self.free: list[Any] = []

  def record(self) -> Any:
    # timing disabled: the cheapest event to record and query
    event = self.free.pop() if self.free else check(
      driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING), "cuEventCreate")
    check(driver.cuEventRecord(event, self.device.stream), "cuEventRecord")
    return event

  def done(self, fence: Any) -> bool:
    (status,) = driver.cuEventQuery(fence)
    if status == driver.CUresult.CUDA_ERROR_NOT_READY: return False
    check((status,), "cuEventQuery")
    return True

  def wait(self, fence: Any) -> None: check(driver.cuEventSynchronize(fence), "cuEventSynchronize")

  def release(self, fence: Any) -> None: self.free.append(fence)


class CUDAAllocator(LRUAllocator):
  """Device memory with cuMemAlloc. Copies go through a ring of pinned host memory (runtime/staging.py): a copy-in
  copies the host bytes into the ring and queues the transfer on the device's stream, without waiting for the
  device; a copy-out queues its transfer behind all earlier work and waits for it."""

  def __init__(self, device: CUDADevice):
    super().__init__()
    self.device = device
    self.ring: StagingRing | None = None   # made at the first copy
    self.memory_bytes: int | None = None   # the device's, asked once (device_memory_bytes)
    self.fences = CUDAFences(device)   # events of the staging ring's transfers and of copyout_later, reused
    self.read_slots: dict[int, list[Any]] = {}   # copyout_later's free pinned slots by size

  def _alloc(self, nbytes: int) -> Any:
    self.device.make_current()
    status, pointer = driver.cuMemAlloc(nbytes)
    if status == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY: raise MemoryError(f"cuMemAlloc of {nbytes} bytes")
    check((status,), "cuMemAlloc")
    return pointer

  def _free(self, handle: Any, nbytes: int) -> None: check(driver.cuMemFree(handle), "cuMemFree")

  views_memory = True
  def offset_handle(self, handle: Any, offset: int, nbytes: int) -> Any: return driver.CUdeviceptr(int(handle) + offset)

  def device_memory_bytes(self) -> int:
    if self.memory_bytes is None: self.memory_bytes = int(check(driver.cuDeviceTotalMem(self.device.cu_device),
                                                                "cuDeviceTotalMem"))
    return self.memory_bytes

  def staging_ring(self) -> StagingRing:
    if self.ring is None:
      self.device.make_current()
      address = int(check(driver.cuMemHostAlloc(STAGING_BYTES, 0), "cuMemHostAlloc"))
      self.ring = StagingRing(address, STAGING_BYTES, self.fences)
    return self.ring

  copyout_waits = True   # copyout queues its copy behind the stream's work and waits for it

  def copyin(self, dest: Any, src: memoryview) -> None:
    if src.nbytes <= SMALL_COPY_BYTES:
      # straight from the caller's (pageable) memory: the driver takes the bytes into its own staging before it
      # returns and orders the copy on the stream, so the host does not wait for the work queued before it (a
      # jitted step's per-call inputs upload while the previous step still runs); one driver call, no event
      self.device.direct.copy_in(int(dest), _host_address(src), src.nbytes)
      return
    stream, base = self.device.stream, int(dest)

    def transfer(staged: int, offset: int, nbytes: int) -> None:
      check(driver.cuMemcpyHtoDAsync(base + offset, staged, nbytes, stream), "cuMemcpyHtoDAsync")
    self.staging_ring().copy_in(_host_address(src), src.nbytes, transfer)

  def copyout_later(self, src: Any, nbytes: int) -> Callable[[memoryview], None]:
    """The copy into a pinned slot of its own (reused once read) and an event behind it: the reader waits for the
    event, not for the stream, so kernels queued after the copy keep running (Buffer.read_later)."""
    size = max(256, 1 << (nbytes - 1).bit_length())   # slots by power-of-two size, so a few serve every read
    free = self.read_slots.setdefault(size, [])
    slot = free.pop() if free else check(driver.cuMemHostAlloc(size, 0), "cuMemHostAlloc")
    check(driver.cuMemcpyDtoHAsync(slot, src, nbytes, self.device.stream), "cuMemcpyDtoHAsync")
    event = self.fences.record()

    def finish(dest: memoryview) -> None:
      self.fences.wait(event)
      ctypes.memmove(_host_address(dest), slot, nbytes)
      free.append(slot)
      self.fences.release(event)
    return finish

  def copyout(self, dest: memoryview, src: Any) -> None:
    if dest.nbytes <= SMALL_COPY_BYTES:
      # into the caller's (pageable) memory: such a copy returns once it is done, after the stream's earlier work, so
      # one driver call is the wait and the copy (no staging buffer, no second copy on the host)
      self.device.direct.copy_out(_host_address(dest), int(src), dest.nbytes)
      return
    stream, base = self.device.stream, int(src)

    def transfer(staged: int, offset: int, nbytes: int) -> None:
      check(driver.cuMemcpyDtoHAsync(staged, base + offset, nbytes, stream), "cuMemcpyDtoHAsync")
    self.staging_ring().copy_out(_host_address(dest), dest.nbytes, transfer)


def _host_address(view: memoryview) -> int:
  """The address of a contiguous host buffer. Not through `(ctypes.c_char * nbytes).from_buffer`: that makes an
  array class per size, and a dropped class is cyclic garbage (an eager step's uploads left some each step). A
  writable buffer's first byte as one c_char (no class made) costs a quarter of numpy's `.ctypes.data`."""
  if not view.readonly and view.nbytes: return ctypes.addressof(ctypes.c_char.from_buffer(view))
  return np.frombuffer(view, dtype=np.uint8).ctypes.data


class DirectCalls:
  """The driver calls of a replayed step's host path (a small copy in, the graph launch, the wait, a small copy out)
  made through ctypes on the driver library: cuda-python's wrappers cost ~2 us a call on the H200's host (argument
  objects, a result enum built per call; an idle-stream wait 2.0 us against 1.2 through ctypes), which a token-on-the-
  host decode step pays several times. A failure is raised as `check` raises it, naming the call."""

  def __init__(self, stream: int):
    library = ctypes.CDLL("libcuda.so.1")
    pointer, size = ctypes.c_void_p, ctypes.c_size_t
    self.stream = pointer(stream)
    self._htod = self._function(library.cuMemcpyHtoDAsync_v2, [ctypes.c_uint64, pointer, size, pointer])
    self._dtoh = self._function(library.cuMemcpyDtoHAsync_v2, [pointer, ctypes.c_uint64, size, pointer])
    self._sync = self._function(library.cuStreamSynchronize, [pointer])
    self._graph_launch = self._function(library.cuGraphLaunch, [pointer, pointer])

  @staticmethod
  def _function(function: Any, argtypes: list[Any]) -> Any:
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function

  @staticmethod
  def _raise(status: int, call: str) -> None: check((driver.CUresult(status),), call)

  def copy_in(self, dest: int, src: int, nbytes: int) -> None:
    status = self._htod(dest, src, nbytes, self.stream)
    if status: self._raise(status, "cuMemcpyHtoDAsync")

  def copy_out(self, dest: int, src: int, nbytes: int) -> None:
    status = self._dtoh(dest, src, nbytes, self.stream)
    if status: self._raise(status, "cuMemcpyDtoHAsync")

  def synchronize(self) -> None:
    status = self._sync(self.stream)
    if status: self._raise(status, "cuStreamSynchronize")

  def graph_launch(self, graph_exec: Any) -> None:
    status = self._graph_launch(int(graph_exec), self.stream)
    if status: self._raise(status, "cuGraphLaunch")


# NVRTC's --minimal (12.4 and newer) leaves out of its builtin header what generated kernels never use: textures
# and surfaces, device-side runtime calls and launches, the runtime API's types. Parsing that header is a fixed
# part of every compile; without those parts a small kernel compiles about 15% faster.
NVRTC_MINIMAL_SINCE = (12, 4)
# a kernel compiled once when the device opens: the first compile of a process also loads and initializes NVRTC's
# builtins (tens of ms), which this moves off the first real kernel's path
WARM_UP_SOURCE = 'extern "C" __global__ void ourgrad_warm_up(float* out) { out[threadIdx.x] = 0.0f; }\n'


# a kernel whose source contains this uses sm_90a-only instructions (codegen/wgmma_tiles.py writes it in such kernels)
SM_90A_ONLY = "wgmma."

# warm-up threads that may still run: a fork (BEAM's workers) waits for them first, so that no child starts with
# NVRTC's internal state held by a thread the fork did not copy
_WARM_UPS: list[threading.Thread] = []


def _finish_warm_ups() -> None:
  for thread in _WARM_UPS: thread.join()
  _WARM_UPS.clear()


if hasattr(os, "register_at_fork"): os.register_at_fork(before=_finish_warm_ups)


class CUDACompiler(Compiler):
  """CUDA C++ -> CUBIN for one architecture with NVRTC, or only to PTX (`ptx=True`; the CUDA device's choice is
  CUDA_PTX), which the driver compiles to machine code when cuModuleLoadData loads it. A PTX compiler used in a forked
  child (BEAM's workers, which compile candidates in parallel for the parent to load) compiles CUBIN: the parent
  then loads machine code at once instead of having the driver compile each candidate in turn. The options and the
  output are part of the disk cache's key, beside the architecture and NVRTC's version, so a binary is only reused by
  the compiler that would have produced it."""
  # NVRTC compiles distinct programs in several threads at once and releases the GIL meanwhile: 8 small kernels on
  # 2 busy CPU cores took 0.70 s in 2 threads vs 0.93 s one at a time
  concurrent_compiles = True

  def __init__(self, arch: str, ptx: bool = False):
    self.arch = arch
    self.emit_ptx = ptx
    self._owner_pid = os.getpid()  # PTX only in this process (see the class docstring)
    version = check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    self.options = [b"-default-device", b"--std=c++17"] + ([b"--minimal"] if version >= NVRTC_MINIMAL_SINCE else [])
    self.cache_key = f"cuda {arch} nvrtc {version} {b' '.join(self.options).decode()}{' ptx' if self.emit_ptx else ''}"
    self._warm_up: threading.Thread | None = None

  def __getstate__(self) -> dict:
    return {key: value for key, value in self.__dict__.items() if key != "_warm_up"}  # a thread does not pickle

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state, _warm_up=None)

  def warm_up(self) -> None:
    """Compile a trivial kernel on a background thread (NVRTC releases the GIL while it compiles), so that the
    process's first real compile does not also pay NVRTC's one-time initialization."""
    if self._warm_up is not None: return
    def compile_quietly() -> None:
      try:
        self.compile(WARM_UP_SOURCE)
      except Exception:  # a broken NVRTC reports itself at the first real compile, with the kernel's source
        pass
    self._warm_up = threading.Thread(target=compile_quietly, name="ourgrad-nvrtc-warm-up", daemon=True)
    _WARM_UPS.append(self._warm_up)
    self._warm_up.start()

  def target(self, source: str) -> str:
    """The architecture `source` is compiled for: the GPU's own, or on sm_90 its architecture-specific variant sm_90a
    when the kernel uses instructions only that target has (wgmma: warpgroup MMA, setmaxnreg)."""
    if self.arch == "sm_90" and SM_90A_ONLY in source: return "sm_90a"
    return self.arch

  def _nvrtc_program(self, source: str, arch: str) -> Any:
    """An NVRTC program of `source` compiled for `arch` (sm_XX gives CUBIN, compute_XX only PTX)."""
    program = check(nvrtc.nvrtcCreateProgram(source.encode(), b"kernel.cu", 0, [], []), "nvrtcCreateProgram")
    options = [f"--gpu-architecture={arch}".encode(), *self.options]
    status = nvrtc.nvrtcCompileProgram(program, len(options), options)[0]
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
      log_size = check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
      log = b" " * log_size
      check(nvrtc.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog")
      check(nvrtc.nvrtcDestroyProgram(program), "nvrtcDestroyProgram")
      compiler_log = log.rstrip(b"\x00").decode(errors="replace")
      raise CompileError(f"NVRTC failed on this kernel:\n{source}\n--- compiler log ---\n{compiler_log}")
    return program

  def check_compiles(self, source: str, arch: str) -> None:
    """Compile `source` for `arch` with this compiler's options and keep nothing: CompileError (source and log) if
    NVRTC rejects it. For sm_XX ptxas runs inside the compile, so inline PTX is assembled and checked too
    (runtime/nvrtc_check.py compiles many kernels at once this way)."""
    check(nvrtc.nvrtcDestroyProgram(self._nvrtc_program(source, arch)), "nvrtcDestroyProgram")

  def compile(self, source: str) -> bytes:
    # the PTX text ends with its NUL byte: cuModuleLoadData takes it as a C string
    if self.emit_ptx and os.getpid() == self._owner_pid: return (self.ptx(source) + "\0").encode()
    program = self._nvrtc_program(source, self.target(source))
    size = check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
    cubin = b" " * size
    check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
    check(nvrtc.nvrtcDestroyProgram(program), "nvrtcDestroyProgram")
    return cubin

  def ptx(self, source: str) -> str:
    """The PTX of the kernel for this GPU's virtual architecture (compute_XX), from NVRTC."""
    program = self._nvrtc_program(source, self.target(source).replace("sm_", "compute_"))
    size = check(nvrtc.nvrtcGetPTXSize(program), "nvrtcGetPTXSize")
    ptx = b" " * size
    check(nvrtc.nvrtcGetPTX(program, ptx), "nvrtcGetPTX")
    check(nvrtc.nvrtcDestroyProgram(program), "nvrtcDestroyProgram")
    return ptx.rstrip(b"\x00").decode()

  def ptxas_info(self, source: str) -> str:
    """ptxas's resource report for the kernel (registers, spill stores and loads, shared memory), from NVRTC."""
    program = check(nvrtc.nvrtcCreateProgram(source.encode(), b"kernel.cu", 0, [], []), "nvrtcCreateProgram")
    options = [f"--gpu-architecture={self.target(source)}".encode(), b"-default-device", b"--std=c++17",
               b"--ptxas-options=-v"]
    status = nvrtc.nvrtcCompileProgram(program, len(options), options)[0]
    log = b" " * check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
    check(nvrtc.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog")
    check(nvrtc.nvrtcDestroyProgram(program), "nvrtcDestroyProgram")
    if status != nvrtc.nvrtcResult.NVRTC_SUCCESS: raise CompileError(f"NVRTC failed:\n{log.decode(errors='replace')}")
    return log.rstrip(b"\x00").decode(errors="replace")

  def sass(self, source: str) -> str:
    """The SASS (machine code) of the compiled CUBIN, from cuobjdump or nvdisasm when one is on PATH."""
    if self.emit_ptx: return "// SASS: with CUDA_PTX=1 the driver makes the machine code when it loads the PTX"
    tool = shutil.which("cuobjdump") or shutil.which("nvdisasm")
    if tool is None: return "// SASS: neither cuobjdump nor nvdisasm is on PATH (install the CUDA toolkit)"
    with tempfile.TemporaryDirectory(prefix="ourgrad_") as folder:
      cubin_path = os.path.join(folder, "kernel.cubin")
      with open(cubin_path, "wb") as cubin_file: cubin_file.write(self.compile_cached(source))
      arguments = ["-sass", cubin_path] if os.path.basename(tool) == "cuobjdump" else [cubin_path]
      result = subprocess.run([tool, *arguments], capture_output=True, text=True)
    return result.stdout if result.returncode == 0 else f"// {tool} failed:\n{result.stderr}"

  def disassemble(self, source: str) -> str:
    """PTX from NVRTC, then SASS where the CUDA toolkit's disassembler is installed."""
    return f"{self.ptx(source)}\n{self.sass(source)}"


class CUDAProgram:
  """A loaded kernel. Launches are asynchronous; `wait=True` times the launch with CUDA events.

  cuLaunchKernel takes an array of pointers to the argument values and copies the values when it is called, so a
  program keeps one such pair of arrays and rewrites the values at each launch (under a lock: two threads launching
  one kernel must not interleave their values) instead of building ctypes objects per launch."""

  def __init__(self, device: CUDADevice, name: str, cubin: bytes):
    self.device, self.name = device, name
    device.make_current()
    self.module = check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
    self.function = check(driver.cuModuleGetFunction(self.module, name.encode()), f"cuModuleGetFunction({name})")
    self.shared_bytes = self._dynamic_shared_bytes()
    self._lock = threading.Lock()
    self._arguments: Any = None   # (ctypes.c_uint64 * n): the buffer pointers of the launch being made
    self._pointers: Any = None    # (ctypes.c_void_p * n): the address of each of those values (kernelParams)
    self._params_address = 0
    self._resident_blocks: dict[int, int] = {}   # threads a block -> blocks a multiprocessor holds (resident_blocks)

  def _dynamic_shared_bytes(self) -> int:
    """The dynamic shared memory the kernel declares (CUDARenderer: `ourgrad_dynamic_shared_bytes`, where its tiles
    exceed the 48 KB of static shared memory), allowed on the function once; 0 for every other kernel."""
    status, pointer, _ = driver.cuModuleGetGlobal(self.module, DYNAMIC_SHARED_SYMBOL.encode())
    if status != driver.CUresult.CUDA_SUCCESS: return 0
    value = ctypes.c_uint32(0)
    check(driver.cuMemcpyDtoH(ctypes.addressof(value), pointer, 4), "cuMemcpyDtoH")
    attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    check(driver.cuFuncSetAttribute(self.function, attribute, value.value), "cuFuncSetAttribute")
    # all of the unified L1/shared memory as shared memory, so that as many CTAs as the kernel's launch bounds ask
    # for are resident (a WGMMA kernel of 2 CTAs per multiprocessor, ~100 KB each); a hint the driver may override
    carveout = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    check(driver.cuFuncSetAttribute(self.function, carveout, 100), "cuFuncSetAttribute")
    return value.value

  def resident_blocks(self, threads: int) -> int:
    """Blocks of `threads` threads one multiprocessor holds at once (the driver's occupancy: registers, shared
    memory, threads and block slots of this kernel on this GPU), asked once per block size."""
    if threads not in self._resident_blocks:
      self._resident_blocks[threads] = check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        self.function, threads, self.shared_bytes), "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    return self._resident_blocks[threads]

  def _argument_arrays(self, count: int) -> Any:
    """The argument values array for `count` buffer pointers, made on the first launch (and again if a launch passes
    another count)."""
    arguments, pointers = pointer_arguments([0] * count)
    self._arguments, self._pointers, self._params_address = arguments, pointers, ctypes.addressof(pointers)
    return arguments

  def __call__(self, *buffers: Any, global_size: tuple[int, ...] = (1, 1, 1), local_size: tuple[int, ...] = (1, 1, 1),
               wait: bool = False, vals: tuple[int, ...] = ()) -> float | None:
    if wait or vals: return self._launch_general(buffers, global_size, local_size, wait, vals)
    with self._lock:
      arguments = self._arguments
      if arguments is None or len(buffers) != len(self._pointers) or not buffers:
        arguments = self._argument_arrays(len(buffers))
      for index, buffer in enumerate(buffers): arguments[index] = int(buffer)
      (status,) = driver.cuLaunchKernel(self.function, *global_size, *local_size, self.shared_bytes,
                                        self.device.stream, self._params_address, 0)
    if status != CUDA_SUCCESS: check((status,), f"cuLaunchKernel({self.name})")
    return None

  def bind(self, handles: list[Any], global_size: tuple[int, ...], local_size: tuple[int, ...],
           stream: Any = None) -> Callable[[], None]:
    """A launcher of this kernel on these buffer handles with these sizes, with nothing left to compute per launch
    (ExecItem.run's fast path): its own argument arrays, filled once, so it needs no lock; the driver call's
    arguments are bound in a functools.partial. The caller makes a new one when a handle changes. `stream`: the
    device's stream unless given (extra/bench/bench_launch.py compares streams)."""
    arguments, pointers = pointer_arguments([int(handle) for handle in handles])
    call_driver = functools.partial(driver.cuLaunchKernel, self.function, *global_size, *local_size, self.shared_bytes,
                                    self.device.stream if stream is None else stream, ctypes.addressof(pointers), 0)
    name = self.name

    def launch() -> None:
      (status,) = call_driver()
      if status is not CUDA_SUCCESS: check((status,), f"cuLaunchKernel({name})")
    launch.argument_arrays = (arguments, pointers)  # type: ignore[attr-defined]  # alive as long as the launcher
    return launch

  def positional_launcher(self, global_size: tuple[int, ...], local_size: tuple[int, ...]) -> PositionalLaunch:
    """A launcher of this kernel with these sizes that takes the buffers at each call (ExecItem.run's fast path)."""
    return PositionalLaunch(self, global_size, local_size)

  def _launch_general(self, buffers: tuple, global_size: tuple[int, ...], local_size: tuple[int, ...], wait: bool,
                      vals: tuple[int, ...]) -> float | None:
    """A launch with int arguments (vals: the symbolic Variables' values, after the buffer pointers) or a timed one."""
    pointers = [ctypes.c_uint64(int(buffer)) for buffer in buffers] + [ctypes.c_int32(value) for value in vals]
    params = (ctypes.c_void_p * len(pointers))(*[ctypes.addressof(pointer) for pointer in pointers])
    stream = self.device.stream
    if wait: check(driver.cuEventRecord(self.device.start_event, stream), "cuEventRecord")
    check(driver.cuLaunchKernel(self.function, *global_size, *local_size, self.shared_bytes, stream,
                                ctypes.addressof(params), 0), f"cuLaunchKernel({self.name})")
    if not wait: return None
    check(driver.cuEventRecord(self.device.end_event, stream), "cuEventRecord")
    check(driver.cuEventSynchronize(self.device.end_event), "cuEventSynchronize")
    milliseconds = check(driver.cuEventElapsedTime(self.device.start_event, self.device.end_event),
                         "cuEventElapsedTime")
    return milliseconds / 1e3


CUDA_LAUNCH_TRAMPOLINE = env_var("CUDA_LAUNCH_TRAMPOLINE", 1, "1: the CUDA device's bound launches (a replayed eager "
                                 "kernel's) call cuLaunchKernel from a small C function compiled once by the CLANG "
                                 "device's compiler, one ctypes call of one pointer (~0.6 us less a launch than "
                                 "cuda-python's wrapper on an H200's host); 0, or no C compiler: cuda-python's wrapper")

# the driver call of a bound launch made from C: the launch's arguments in one struct, read by one C function, so that
# Python makes one ctypes call of one argument (cuda-python's wrapper converts eleven arguments and builds a result
# enum at every call; ctypes with eleven declared arguments was slower still, extra/bench/probe_launch_calls.py)
LAUNCH_TRAMPOLINE_SOURCE = """/* ourgrad: a bound CUDA launch (runtime/ops_cuda.py PositionalLaunch) */
typedef int (*og_driver_launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                                void **, void **);
typedef struct { og_driver_launch launch; void *function; unsigned size[7]; void *stream; void **params; } og_launch;
int og_launch_kernel(const og_launch *l) {
  return l->launch(l->function, l->size[0], l->size[1], l->size[2], l->size[3], l->size[4], l->size[5], l->size[6],
                   l->stream, l->params, 0);
}
"""


class LaunchRecord(ctypes.Structure):
  """The C struct `og_launch`: the driver's cuLaunchKernel, the kernel, its grid, block and dynamic shared memory,
  the stream, its kernelParams."""
  _fields_ = [("launch", ctypes.c_void_p), ("function", ctypes.c_void_p), ("size", ctypes.c_uint * 7),
              ("stream", ctypes.c_void_p), ("params", ctypes.c_void_p)]


# [(the trampoline's ctypes function, libcuda's cuLaunchKernel address)] once compiled, [None] where it cannot be
_trampoline: list[tuple[Any, int] | None] = []
_trampoline_lock = threading.Lock()


def launch_trampoline() -> tuple[Any, int] | None:
  """(og_launch_kernel as a ctypes function of one pointer, the address of libcuda's cuLaunchKernel), compiled once a
  process by the CLANG device's compiler (from its disk cache after the first time on a machine); None where
  CUDA_LAUNCH_TRAMPOLINE=0 or there is no C compiler (then cuda-python's wrapper launches)."""
  if not CUDA_LAUNCH_TRAMPOLINE: return None
  if not _trampoline:
    with _trampoline_lock:
      if not _trampoline:
        try:
          clang = Device["CLANG"]
          function = clang.program("og_launch_kernel", clang.compiler.compile_cached(LAUNCH_TRAMPOLINE_SOURCE)).function
          function.argtypes, function.restype = [ctypes.c_void_p], ctypes.c_int
          address = ctypes.cast(ctypes.CDLL("libcuda.so.1").cuLaunchKernel, ctypes.c_void_p).value
          _trampoline.append((function, address))
        except Exception as error:  # (any failure, a compiler's or a loader's: cuda-python's wrapper always works)
          if DEBUG >= 1: print(f"CUDA launches through cuda-python: no launch trampoline ({error})")
          _trampoline.append(None)
  return _trampoline[0]


class PositionalLaunch:
  """One ExecItem's launches of a kernel: `launch(buffers)` passes each buffer's memory in its argument position. The
  argument arrays are its own (no lock) and persist from launch to launch; a slot is rewritten only where its
  buffer's handle is another object than at the last launch (the allocator hands the same handle objects back), so a
  repeated launch creates no Python object but the driver call's result. The driver copies the values at the call,
  so a slot may change again right after it."""
  __slots__ = ("program", "global_size", "local_size", "handles", "arguments", "pointers", "call_driver", "record")

  def __init__(self, program: CUDAProgram, global_size: tuple[int, ...], local_size: tuple[int, ...]):
    self.program, self.global_size, self.local_size = program, global_size, local_size
    self.handles: list[Any] = []   # the handle each slot holds (kept alive: compared by identity)
    self.arguments: Any = None
    self.pointers: Any = None
    # the driver call bound to the arrays: it returns the status, an int from the trampoline (0: success), a tuple
    # from cuda-python's wrapper (always true: checked by _check)
    self.call_driver: Callable[[], Any] | None = None
    self.record: LaunchRecord | None = None   # the trampoline's arguments (alive as long as the launcher)

  def _make_arrays(self, count: int) -> None:
    """Argument arrays for `count` buffers and the driver call bound to them (at the first launch)."""
    self.arguments, self.pointers = pointer_arguments([0] * count)
    self.handles = [None] * count
    program = self.program
    trampoline = launch_trampoline()
    if trampoline is not None:
      function, driver_launch = trampoline
      self.record = LaunchRecord(driver_launch, int(program.function),
                                 (ctypes.c_uint * 7)(*self.global_size, *self.local_size, program.shared_bytes),
                                 int(program.device.stream), ctypes.addressof(self.pointers))
      self.call_driver = functools.partial(function, ctypes.addressof(self.record))
      return
    self.call_driver = functools.partial(driver.cuLaunchKernel, program.function, *self.global_size,
                                         *self.local_size, program.shared_bytes, program.device.stream,
                                         ctypes.addressof(self.pointers), 0)

  def _check(self, status: Any) -> None:
    """Raise the driver's error of a launch whose status is not a plain 0 (cuda-python's tuple of its result)."""
    if type(status) is tuple: status = status[0]
    if status == CUDA_SUCCESS: return
    check((status if isinstance(status, driver.CUresult) else driver.CUresult(status),),
          f"cuLaunchKernel({self.program.name})")

  def __call__(self, buffers: list[Any]) -> None:
    if len(self.handles) != len(buffers) or self.call_driver is None: self._make_arrays(len(buffers))
    handles, arguments = self.handles, self.arguments
    for index, buffer in enumerate(buffers):
      handle = buffer._handle
      if handle is None: handle = buffer.allocate()._handle
      if handle is not handles[index]:
        arguments[index] = int(handle)
        handles[index] = handle
    status = self.call_driver()
    if status: self._check(status)


def programmatic_edge(early: bool) -> Any:
  """A graph edge after which the next kernel may launch before the previous one has completed (it waits for it in
  DEPENDENT_LAUNCH_PROLOGUE): once every block of the previous one has exited (or triggered with
  griddepcontrol.launch_dependents, which no kernel does), or, `early`, once every one of them has started (the
  launch-order port: a trigger at each block's start, without one in the kernel's source)."""
  edge = driver.CUgraphEdgeData()
  edge.type = driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
  edge.from_port = driver.CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER if early else \
    driver.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
  return edge


def launch_footprint(launch: tuple) -> GridFootprint:
  """A graph launch's blocks, the blocks of its size one multiprocessor holds (1 where the program cannot say) and,
  where the launch carries them (a 6th entry), its ops and bytes."""
  program, global_size, local_size = launch[:3]
  threads = local_size[0] * local_size[1] * local_size[2]
  resident = program.resident_blocks(threads) if hasattr(program, "resident_blocks") else 1
  op_count, byte_count = launch[5] if len(launch) > 5 else (0, 0)
  return GridFootprint(global_size[0] * global_size[1] * global_size[2], max(int(resident), 1), op_count, byte_count)


def launch_edges(renderer: Any, footprints: list[GridFootprint], mode: int) -> list[str]:
  """How each kernel of a graph's chain follows the one before (CUDA_DEPENDENT_LAUNCH's `mode`): "plain" (after it
  completed; always so without the dependent-launch prologue), "exit" (as its blocks exit) or "start" (as soon as
  all of its blocks have started); the first kernel's entry is "first"."""
  if not getattr(renderer, "dependent_launch", False) or mode <= 0: kinds = ["plain"] * len(footprints)
  elif mode == 1: kinds = ["exit"] * len(footprints)
  elif mode in (2, 4):
    kinds = ["start" if early else "exit" for early in renderer.early_launches(footprints, short_only=mode == 4)]
  else: kinds = ["start"] * len(footprints)
  return ["first"] + kinds[1:] if kinds else kinds


class CUDAGraph:
  """Kernels replayed by the JIT as one CUDA graph: one kernel node per launch, each depending on the one before (they
  ran in that order on one stream), instantiated once. Where the renderer writes the dependent-launch prologue
  (sm_90, renderer/cuda.py DEPENDENT_LAUNCH_PROLOGUE) and CUDA_DEPENDENT_LAUNCH is on, the edges are programmatic: a
  kernel is launched before the one before it has completed, and waits in its prologue for it to finish, so the
  launch latency hides behind the previous kernel's run. By default (mode 1) each is launched as the blocks of the one
  before exit; modes 2 and 4 launch those CUDARenderer.early_launches picks as soon as every block of the one before
  has started (the footprints come from the capture's launch sizes; a later size of a symbolic kernel changes only the
  timing), mode 3 all of them. H200 (extra/bench/bench_pdl.py): a graph's own cost is ~0.6 us a kernel on the exits,
  ~0.56 launched early, while an early-launched kernel's resident blocks slow the kernel they wait beside (MLP step
  0.114 -> 0.218 ms in mode 2), so the exits are the default.
  Each node's parameter struct and its argument array stay alive for the graph's life: `set_argument` writes one
  pointer into that array and marks the node, and `launch` hands each marked node's struct to the driver
  (cuGraphExecKernelNodeSetParams: no re-instantiation, nothing rebuilt) before one cuGraphLaunch."""

  def __init__(self, device: CUDADevice, launches: list[tuple], mode: int | None = None):
    """`launches`: (program, global size, local size, buffer handles, int arguments[, (ops, bytes)]) each; `mode`:
    CUDA_DEPENDENT_LAUNCH's value unless given (a benchmark builds one chain several ways)."""
    self.device = device
    device.make_current()
    self.graph = check(driver.cuGraphCreate(0), "cuGraphCreate")
    self.nodes: list[Any] = []
    self.node_params: list[Any] = []
    self.arguments: list[Any] = []   # per node: the kernel's pointer arguments (the memory kernelParams points into)
    self.keep_alive: list[Any] = []  # per node: the array of pointers to those arguments
    self.changed: set[int] = set()   # nodes whose arguments changed since the last launch
    renderer = getattr(device, "renderer", None)
    self.footprints = [launch_footprint(launch) for launch in launches]
    self.edges = launch_edges(renderer, self.footprints, int(CUDA_DEPENDENT_LAUNCH) if mode is None else mode)
    previous: list[Any] = []
    for launch, edge_kind in zip(launches, self.edges):
      program, global_size, local_size, handles, values = launch[:5]
      # one 8-byte slot per argument: a buffer's device pointer, or a symbolic Variable's value (the kernel's `int`
      # reads the slot's low 4 bytes: little-endian)
      words = [int(handle) for handle in handles] + [value & 0xFFFFFFFF for value in values]
      arguments = (ctypes.c_uint64 * max(len(words), 1))(*words)
      pointers = (ctypes.c_void_p * max(len(words), 1))(
        *[ctypes.addressof(arguments) + index * ctypes.sizeof(ctypes.c_uint64) for index in range(len(words))])
      params = driver.CUDA_KERNEL_NODE_PARAMS()
      params.func = program.function
      params.gridDimX, params.gridDimY, params.gridDimZ = global_size
      params.blockDimX, params.blockDimY, params.blockDimZ = local_size
      params.sharedMemBytes = program.shared_bytes
      params.kernelParams = ctypes.addressof(pointers)
      params.extra = 0
      if edge_kind in ("exit", "start"):
        node = check(driver.cuGraphAddKernelNode(self.graph, [], 0, params), "cuGraphAddKernelNode")
        check(driver.cuGraphAddDependencies(self.graph, previous, [node], [programmatic_edge(edge_kind == "start")], 1),
              "cuGraphAddDependencies")
      else:
        node = check(driver.cuGraphAddKernelNode(self.graph, previous, len(previous), params), "cuGraphAddKernelNode")
      previous = [node]
      self.nodes.append(node)
      self.node_params.append(params)
      self.arguments.append(arguments)
      self.keep_alive.append(pointers)
    self.graph_exec = check(driver.cuGraphInstantiate(self.graph, 0), "cuGraphInstantiate")
    # DEBUG=1 only: at DEBUG>=2 the JIT replays kernel by kernel, without a graph, to time each. Each kernel's line
    # where the rule decided (modes 2 and 4), else the counts
    if DEBUG >= 1: print(self.describe(launches, per_kernel=len(set(self.edges[1:])) > 1))

  def describe(self, launches: list, per_kernel: bool = True) -> str:
    """The counts of each edge kind, then (`per_kernel`) each kernel's dependent-launch decision: its name, blocks,
    resident blocks a multiprocessor, share of a wave and edge from the kernel before."""
    counts = {kind: self.edges.count(kind) for kind in dict.fromkeys(self.edges)}
    summary = f"CUDA graph: {len(self.edges)} kernels, edges " + ", ".join(f"{kind} {n}" for kind, n in counts.items())
    if not per_kernel: return summary
    multiprocessors = getattr(getattr(self.device, "renderer", None), "multiprocessors", 0) or 1
    lines = [f"  {getattr(launch[0], 'name', '?'):<40} blocks {footprint.blocks:>6} resident/SM "
             f"{footprint.resident_per_multiprocessor:>3} wave {footprint.waves(multiprocessors):6.3f} {edge}"
             for launch, footprint, edge in zip(launches, self.footprints, self.edges)]
    return "\n".join([summary, *lines])

  def set_argument(self, index: int, position: int, handle: Any) -> None:
    """Kernel `index` gets the buffer `handle` (or, after the buffers, the int value) as its argument `position`
    from the next launch on."""
    self.arguments[index][position] = int(handle) & 0xFFFFFFFFFFFFFFFF
    self.changed.add(index)

  def set_launch_size(self, index: int, global_size: tuple[int, ...], local_size: tuple[int, ...]) -> None:
    """Kernel `index` runs with this grid and block from the next launch on (sizes that follow a Variable)."""
    params = self.node_params[index]
    params.gridDimX, params.gridDimY, params.gridDimZ = global_size
    params.blockDimX, params.blockDimY, params.blockDimZ = local_size
    self.changed.add(index)

  def launch(self) -> None:
    if self.changed:
      # the driver copies the argument values at this call, so the arrays may change again right after
      for index in self.changed:
        check(driver.cuGraphExecKernelNodeSetParams(self.graph_exec, self.nodes[index], self.node_params[index]),
              "cuGraphExecKernelNodeSetParams")
      self.changed.clear()
    self.device.direct.graph_launch(self.graph_exec)

  def __del__(self) -> None:
    try:
      driver.cuGraphExecDestroy(self.graph_exec)
      driver.cuGraphDestroy(self.graph)
    except Exception:  # interpreter shutdown: the bindings may be gone already
      pass


class CUDADevice(Compiled):
  def __init__(self, name: str):
    check(driver.cuInit(0), "cuInit")
    ordinal = int(name.split(":")[1]) if ":" in name else 0  # "CUDA:1" is GPU 1 with its own context and stream
    self.cu_device = check(driver.cuDeviceGet(ordinal), "cuDeviceGet")
    self.context = check(driver.cuDevicePrimaryCtxRetain(self.cu_device), "cuDevicePrimaryCtxRetain")
    self.make_current()
    major = check(driver.cuDeviceGetAttribute(
      driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.cu_device), "cuDeviceGetAttribute")
    minor = check(driver.cuDeviceGetAttribute(
      driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.cu_device), "cuDeviceGetAttribute")
    self.arch = f"sm_{major}{minor}"
    facts = self._gpu_facts()
    self.stream = check(driver.cuStreamCreate(0), "cuStreamCreate")
    self.direct = DirectCalls(int(self.stream))
    self.start_event = check(driver.cuEventCreate(0), "cuEventCreate")
    self.end_event = check(driver.cuEventCreate(0), "cuEventCreate")
    renderer = CUDARenderer(self.arch)
    renderer.set_gpu_facts(facts)   # the heuristics size grids, split reduces and tiles by this GPU's own
    renderer.launch_bytes = int(LAUNCH_SECONDS * self._memory_bandwidth())
    renderer.latency_bytes = int(MEMORY_LATENCY_SECONDS * self._memory_bandwidth())
    renderer.launch_ops = int(LAUNCH_SECONDS * self._float32_ops_per_second(facts.multiprocessors))
    super().__init__(name, CUDAAllocator(self), renderer, CUDACompiler(self.arch, ptx=bool(CUDA_PTX)),
                     lambda kernel_name, cubin: CUDAProgram(self, kernel_name, cubin))
    # what TinyJit replays captured kernels with (ourgrad/engine/jit.py)
    self.graph = lambda launches: CUDAGraph(self, launches)
    self.compiler.warm_up()

  def _gpu_facts(self) -> GpuFacts:
    """The GPU's facts the heuristics ask (renderer/__init__.py GpuFacts), from the driver."""
    attribute = driver.CUdevice_attribute

    def read(name: str) -> int:
      return check(driver.cuDeviceGetAttribute(getattr(attribute, name), self.cu_device), "cuDeviceGetAttribute")
    return GpuFacts(read("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT"),
                    read("CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR"),
                    read("CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR"),
                    read("CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"))

  def _float32_ops_per_second(self, multiprocessors: int) -> float:
    """Peak float32 ops a second from the driver's clock: an FMA (2 ops) a lane a cycle, 128 lanes a multiprocessor
    (sm_86 and newer; sm_80's have 64)."""
    clock_khz = check(driver.cuDeviceGetAttribute(driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE,
                                                  self.cu_device), "cuDeviceGetAttribute")
    lanes = 64 if self.arch == "sm_80" else 128
    return 2.0 * lanes * multiprocessors * clock_khz * 1e3

  def _memory_bandwidth(self) -> float:
    """Peak DRAM bytes per second from the driver: memory clock (kHz) x bus width (bits), double data rate."""
    attribute = driver.CUdevice_attribute
    clock_khz = check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, self.cu_device),
                      "cuDeviceGetAttribute")
    bus_bits = check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH,
                                                 self.cu_device), "cuDeviceGetAttribute")
    return 2.0 * clock_khz * 1e3 * bus_bits / 8

  def make_current(self) -> None: check(driver.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")

  @property
  def stream_handle(self) -> int:
    """The address of the stream kernels run on (a cudaStream_t for NCCL, which must queue behind them)."""
    return int(self.stream)

  def synchronize(self) -> None: self.direct.synchronize()


def create_device(name: str) -> Compiled: return CUDADevice(name)
