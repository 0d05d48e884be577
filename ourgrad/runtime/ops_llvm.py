"""The LLVM device: UOps -> LLVM IR text (renderer/llvmir.py) -> object code for this CPU with llvmlite -> MCJIT
-> ctypes call.

Kernels are optimized at O2 (loop and SLP vectorization on) for the host CPU with all its features, like
`-march=native`, and run synchronously: large ones on all cores through libgomp (OMP_NUM_THREADS limits the
threads, as on CLANG), the rest on the calling thread. Memory is host memory (numpy), as on CLANG.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

import llvmlite.binding as llvm

from ourgrad.device import Compiled, Compiler, HostAllocator, HostProgram
from ourgrad.errors import CompileError, DeviceError
from ourgrad.renderer.llvmir import LLVMRenderer

llvm.initialize_native_target()
llvm.initialize_native_asmprinter()
llvm.initialize_native_asmparser()


def load_library(name: str) -> bool:
  """Make a shared library's symbols visible to JIT-compiled code; False if it cannot be found or loaded."""
  path = ctypes.util.find_library(name)
  if path is None: return False
  try:
    llvm.load_library_permanently(path)
  except RuntimeError:
    return False
  return True


# the math intrinsics (llvm.exp2, llvm.sin, ...) become calls to libm's exp2f, sinf, ...: the JIT finds them here
load_library("m")
# large kernels run their outer loop on all cores through libgomp (GCC's OpenMP runtime, which CLANG's kernels use
# too); without it every kernel runs on the calling thread. Idle threads sleep rather than spin, as on CLANG (the
# process has one libgomp, and it reads this when it loads; the user's own setting wins)
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
_LIBGOMP_LOADED = load_library("gomp")

# llvmlite objects are not thread-safe: one compilation at a time (BEAM may compile from several threads)
_LLVM_LOCK = threading.Lock()


def host_target_machine() -> llvm.TargetMachine:
  """A target machine for this CPU with all its features. MCJIT takes ownership of one, so each engine gets its own."""
  target = llvm.Target.from_triple(llvm.get_process_triple())
  # jitdefault: the code model for code placed anywhere in the address space, far from libm
  return target.create_target_machine(cpu=llvm.get_host_cpu_name(), features=llvm.get_host_cpu_features().flatten(),
                                      opt=2, reloc="default", codemodel="jitdefault")


def host_vector_bytes() -> int:
  """The SIMD register width (bytes) of the CPU the target machine compiles for, from its features (as CLANG reads
  it from -march=native's macros): 64 with AVX-512, 32 with AVX/AVX2, else 16 (SSE, NEON)."""
  features = llvm.get_host_cpu_features()
  if features.get("avx512f"): return 64
  if features.get("avx2") or features.get("avx"): return 32
  return 16


class LLVMCompiler(Compiler):
  """LLVM IR text -> verified, O2-optimized module -> object file bytes for the host CPU."""

  def __init__(self) -> None:
    self.target_machine = host_target_machine()
    version = ".".join(map(str, llvm.llvm_version_info))
    # native CPU name and features make the code specific to this machine: part of the cache key
    self.cache_key = (f"llvm {version} {llvm.get_process_triple()} {llvm.get_host_cpu_name()} "
                      f"{llvm.get_host_cpu_features().flatten()} O2")

  def optimized_module(self, source: str) -> llvm.ModuleRef:
    """Parse and verify the IR, then run the O2 pipeline for this CPU (call with _LLVM_LOCK held)."""
    try:
      module = llvm.parse_assembly(source)
      module.verify()
    except RuntimeError as error:
      raise CompileError(f"LLVM rejected this kernel:\n{source}\n--- LLVM message ---\n{error}") from None
    module.triple = self.target_machine.triple
    module.data_layout = str(self.target_machine.target_data)
    options = llvm.create_pipeline_tuning_options(speed_level=2)
    options.loop_vectorization = True
    options.slp_vectorization = True
    options.loop_unrolling = True
    pass_builder = llvm.create_pass_builder(self.target_machine, options)
    pass_builder.getModulePassManager().run(module, pass_builder)
    return module

  def compile(self, source: str) -> bytes:
    with _LLVM_LOCK:
      module = self.optimized_module(source)
      return bytes(self.target_machine.emit_object(module))

  def disassemble(self, source: str) -> str:
    """The host assembly of a kernel, as compile() would build it (what DEBUG=6 prints)."""
    with _LLVM_LOCK: return self.target_machine.emit_assembly(self.optimized_module(source))


class LLVMProgram(HostProgram):
  """A compiled kernel: load the object code into its own MCJIT engine (kept alive with the program) and call the
  named function through ctypes with the buffers' addresses."""

  def __init__(self, name: str, binary: bytes):
    self.name = name
    with _LLVM_LOCK:
      self.engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), host_target_machine())
      self.engine.add_object_file(llvm.ObjectFileRef.from_data(binary))
      self.engine.finalize_object()
      address = self.engine.get_function_address(name)
    if not address: raise DeviceError(f"LLVM: the compiled object has no function {name!r}")
    # no argtypes: the kernel takes one pointer per buffer, passed as c_void_p
    self.function = ctypes.CFUNCTYPE(None)(address)



def create_device(name: str) -> Compiled:
  renderer = LLVMRenderer(parallel=_LIBGOMP_LOADED)
  # the CPU matmul heuristic sizes its register tiles by it; left at SSE's 16 bytes, an AVX-512 CPU got 8x4 tiles
  # (1024^3 float32 on 2 cores: 50 ms, against 8.9 ms with 16x16)
  renderer.vector_bytes = host_vector_bytes()
  return Compiled(name, HostAllocator(), renderer, LLVMCompiler(), LLVMProgram)
