"""The OPENCL device (alias GPU): OpenCL C built and launched with pyopencl.

`pip install 'ourgrad[opencl]'` brings pyopencl with PoCL, an OpenCL implementation on the CPU, so this
device works on any machine. On NVIDIA machines the driver's OpenCL library is used when registered
(OCL_ICD_VENDORS pointing at a folder with an .icd file naming libnvidia-opencl.so).
"""
from __future__ import annotations

import time
import warnings
from typing import Any

import numpy as np

from ourgrad.device import Compiled, Compiler, LRUAllocator
from ourgrad.errors import CompileError, DeviceError
from ourgrad.renderer.cstyle import OpenCLRenderer

try:
  import pyopencl as cl
except ImportError as error:  # the registry turns this into a DeviceError saying what to install
  raise ModuleNotFoundError(str(error), name="pyopencl") from error


def _pick_device() -> Any:
  """A GPU if there is one, else the first device (PoCL's CPU device)."""
  devices = [device for platform in cl.get_platforms() for device in platform.get_devices()]
  if not devices: raise DeviceError("no OpenCL device found: install pocl (pip install 'pyopencl[pocl]') or a driver")
  gpus = [device for device in devices if device.type & cl.device_type.GPU]
  return (gpus or devices)[0]


def _check_builds(context: Any, device: Any) -> None:
  """Open only a device that can build programs. PoCL's bundled LLVM fails every build on a CPU model it does not
  know ("unknown target CPU 'generic'", seen on virtual machines that hide the CPU generation); finding that out here
  makes the device unavailable, with the reason, instead of failing each kernel later."""
  try:
    cl.Program(context, "__kernel void probe(__global int* x) { x[0] = 1; }").build()
  except cl.Error as error:
    log_errors = [line.strip() for line in str(error).splitlines() if "error:" in line]
    reason = log_errors[-1] if log_errors else type(error).__name__
    raise DeviceError(f"the OpenCL device {device.name!r} cannot build programs here ({reason}); use another device "
                      f"(CLANG, LLVM) or an OpenCL driver that knows this CPU") from error


class OpenCLAllocator(LRUAllocator):
  def __init__(self, context: Any, queue: Any):
    super().__init__()
    self.context, self.queue = context, queue

  def _alloc(self, nbytes: int) -> Any:
    try:
      return cl.Buffer(self.context, cl.mem_flags.READ_WRITE, nbytes)
    except cl.MemoryError as error:
      raise MemoryError(str(error)) from error

  def _free(self, handle: Any, nbytes: int) -> None: handle.release()

  def copyin(self, dest: Any, src: memoryview) -> None:
    cl.enqueue_copy(self.queue, dest, np.frombuffer(src, dtype=np.uint8), is_blocking=True)

  def copyout(self, dest: memoryview, src: Any) -> None:
    cl.enqueue_copy(self.queue, np.frombuffer(dest, dtype=np.uint8), src, is_blocking=True)


# programs built from source in this process and not loaded yet, at most this many (a compile whose binary is never
# loaded, a BEAM candidate that lost, is dropped oldest first)
MAX_BUILT_PROGRAMS = 16


class OpenCLCompiler(Compiler):
  def __init__(self, context: Any, device: Any):
    self.context = context
    self.cache_key = f"opencl {device.platform.name} {device.name} {device.driver_version}"
    # {binary: the program built from source that gave it}: loading a binary this process just compiled takes that
    # program instead of building the binary again (PoCL: ~0.25 s a kernel, a fifth of a new kernel's cost)
    self.built: dict[bytes, Any] = {}

  def compile(self, source: str) -> bytes:
    program = cl.Program(self.context, source)
    try:
      with warnings.catch_warnings():  # some drivers print notes for every build; real failures raise below
        warnings.simplefilter("ignore", cl.CompilerWarning)
        program.build()
    except cl.RuntimeError as error:
      raise CompileError(f"OpenCL build failed for this kernel:\n{source}\n--- build log ---\n{error}") from None
    binary = program.get_info(cl.program_info.BINARIES)[0]
    if len(self.built) >= MAX_BUILT_PROGRAMS: del self.built[next(iter(self.built))]
    self.built[binary] = program
    return binary

  def built_program(self, binary: bytes, context: Any) -> Any:
    """The program built from source that gave `binary` in this process (handed over once), else None; only into
    its own context (OPENCL:1 shares OPENCL's compiler, not its context)."""
    return self.built.pop(binary, None) if context == self.context else None

  def disassemble(self, source: str) -> str:
    """The driver's program binary when it is text (NVIDIA's is PTX); PoCL and most others give an opaque one."""
    return describe_program_binary(self.compile_cached(source))


def describe_program_binary(binary: bytes) -> str:
  """An OpenCL program binary as text when it is text, else a one-line note of what it is."""
  try:
    text = binary.rstrip(b"\x00").decode()
  except UnicodeDecodeError:
    text = None
  if text is not None and all(char.isprintable() or char.isspace() for char in text): return text
  return (f"// DEBUG=6: this OpenCL driver's program binary is not text ({len(binary)} bytes, starting "
          f"{binary[:8]!r}); DEBUG=4 shows the source")


class OpenCLProgram:
  def __init__(self, device: "OpenCLDevice", name: str, binary: bytes):
    self.device, self.name = device, name
    self.program = device.compiler.built_program(binary, device.context)
    if self.program is None:   # from the disk cache (or compiled in another process): build the binary
      with warnings.catch_warnings():
        warnings.simplefilter("ignore", cl.CompilerWarning)
        self.program = cl.Program(device.context, [device.cl_device], [binary]).build()
    self.kernel = getattr(self.program, name)

  def __call__(self, *buffers: Any, global_size: tuple[int, ...] = (1, 1, 1), local_size: tuple[int, ...] = (1, 1, 1),
               wait: bool = False, vals: tuple[int, ...] = ()) -> float | None:
    # OpenCL counts work-items, not blocks: the global size is blocks * threads in each dimension
    work_items = tuple(blocks * threads for blocks, threads in zip(global_size, local_size))
    start = time.perf_counter()
    # vals: the symbolic Variables' values, int arguments after the buffers
    event = self.kernel(self.device.queue, work_items, tuple(local_size), *buffers, *[np.int32(v) for v in vals])
    if not wait: return None
    event.wait()
    return time.perf_counter() - start


class OpenCLDevice(Compiled):
  def __init__(self, name: str):
    self.cl_device = _pick_device()
    self.is_gpu = bool(self.cl_device.type & cl.device_type.GPU)
    self.context = cl.Context([self.cl_device])
    self.queue = cl.CommandQueue(self.context, self.cl_device)
    _check_builds(self.context, self.cl_device)
    renderer = OpenCLRenderer()
    renderer.max_threads = min(renderer.max_threads, self.cl_device.max_work_group_size)
    super().__init__(name, OpenCLAllocator(self.context, self.queue), renderer,
                     OpenCLCompiler(self.context, self.cl_device), lambda kernel_name, binary: OpenCLProgram(
                       self, kernel_name, binary))

  def synchronize(self) -> None: self.queue.finish()


def create_device(name: str) -> Compiled: return OpenCLDevice(name)
