"""The LLVM device: UOps -> LLVM IR text (renderer/llvmir.py) -> object code for this CPU with llvmlite -> MCJIT
-> ctypes call.

Kernels are optimized at O2 (loop and SLP vectorization on) for LLVM_CPU with LLVM_FEATURES (default: the host CPU
with all its features, like `-march=native`), after a known-answer self-test of that target (toolchain_check.py), and
run synchronously: large ones on all cores through libgomp (OMP_NUM_THREADS limits the
threads, as on CLANG), the rest on the calling thread. Memory is host memory (numpy), as on CLANG.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import tempfile
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import llvmlite.binding as llvm

from ourgrad.device import Compiled, Compiler, HostAllocator, HostProgram, host_l2_cache_bytes
from ourgrad.errors import CompileError, DeviceError
from ourgrad.helpers import LLVM_CPU, LLVM_FEATURES
from ourgrad.renderer.llvmir import LLVMRenderer
from ourgrad.runtime import toolchain_check
from ourgrad.runtime.openmp import configure_wait_policy

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
# too); without it every kernel runs on the calling thread. Idle threads wait as on CLANG (runtime/openmp.py: the
# process has one libgomp, and it reads this when it loads; the user's own setting wins)
configure_wait_policy()
_LIBGOMP_LOADED = load_library("gomp")

# llvmlite objects are not thread-safe: one compilation at a time (BEAM may compile from several threads)
_LLVM_LOCK = threading.Lock()
_WARNED: set[str] = set()   # toolchains whose fallback to no vectorizers was already reported in this process


@dataclass(frozen=True)
class TargetChoice:
  """The CPU and features the LLVM device compiles for: LLVM_CPU (native: the host's name and all its features)
  with LLVM_FEATURES applied after them."""
  cpu: str
  features: str

  @staticmethod
  def native() -> "TargetChoice":
    """This CPU with all its features (what LLVM_CPU=native gives without LLVM_FEATURES)."""
    return TargetChoice(llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten())

  @staticmethod
  def from_env() -> "TargetChoice":
    cpu = LLVM_CPU.value or "native"
    own = llvm.get_host_cpu_features().flatten() if cpu == "native" else ""
    extra = LLVM_FEATURES.value.strip()
    return TargetChoice(llvm.get_host_cpu_name() if cpu == "native" else cpu, ",".join(f for f in (own, extra) if f))

  def target_machine(self) -> llvm.TargetMachine:
    """A target machine for this CPU and these features. MCJIT takes ownership of one, so each engine gets its own."""
    target = llvm.Target.from_triple(llvm.get_process_triple())
    # jitdefault: the code model for code placed anywhere in the address space, far from libm
    return target.create_target_machine(cpu=self.cpu, features=self.features, opt=2, reloc="default",
                                        codemodel="jitdefault")


def checked_target_machine(choice: TargetChoice) -> llvm.TargetMachine:
  """choice.target_machine(), or a DeviceError when LLVM does not know the CPU or a feature (it would only print a
  warning on stderr and compile for a generic CPU)."""
  with tempfile.TemporaryFile() as captured:
    saved = os.dup(2)
    try:
      os.dup2(captured.fileno(), 2)
      machine = choice.target_machine()
    finally:
      os.dup2(saved, 2)
      os.close(saved)
    captured.seek(0)
    complaint = captured.read().decode(errors="replace").strip()
  if "not a recognized" in complaint:
    raise DeviceError(f"LLVM rejects LLVM_CPU={choice.cpu!r} / LLVM_FEATURES={LLVM_FEATURES.value!r}: "
                      f"{complaint.splitlines()[0]}. Use a CPU it knows (native, x86-64-v2, x86-64-v3, znver3, ...)")
  return machine


# a 64-byte vector add in a function that allows 512-bit registers: the widest register it compiles to is the widest
# the target has (zmm: AVX-512, ymm: AVX/AVX2, else 16-byte SSE/NEON)
_WIDTH_PROBE = """define void @width_probe(ptr %out, ptr %a, ptr %b) #0 {
  %x = load <16 x float>, ptr %a
  %y = load <16 x float>, ptr %b
  %z = fadd <16 x float> %x, %y
  store <16 x float> %z, ptr %out
  ret void
}
attributes #0 = { "min-legal-vector-width"="512" }
"""


def target_vector_bytes(machine: llvm.TargetMachine) -> int:
  """The SIMD register width (bytes) of the target: 64 with AVX-512, 32 with AVX/AVX2, else 16 (SSE, NEON)."""
  module = llvm.parse_assembly(_WIDTH_PROBE)
  module.triple = machine.triple
  assembly = machine.emit_assembly(module)
  if "%zmm" in assembly: return 64
  if "%ymm" in assembly: return 32
  return 16


# the x86 feature that first gives each SIMD register width the width probe sees (zmm: AVX-512F, ymm: AVX)
_WIDTH_FEATURES = {64: "avx512f", 32: "avx"}


def features_host_lacks(choice: TargetChoice, vector_bytes: int) -> list[str]:
  """CPU features the target uses and this CPU lacks (code built for it dies of SIGILL here): those LLVM_FEATURES
  turns on ("+avx512f"), and the one giving the target's SIMD width where it is wider than this CPU's (llvmlite
  cannot list a named CPU's features; its widest registers are what the vectorizers use first). Empty for native."""
  native = TargetChoice.native()
  if choice == native: return []
  host = llvm.get_host_cpu_features()
  missing = {feature[1:] for feature in choice.features.split(",")
             if feature.startswith("+") and feature[1:] in host and not host[feature[1:]]}
  host_machine = native.target_machine()
  with _LLVM_LOCK: host_bytes = target_vector_bytes(host_machine)
  if vector_bytes > host_bytes: missing.add(_WIDTH_FEATURES.get(vector_bytes, f"{vector_bytes}-byte vectors"))
  return sorted(missing)


class LLVMCompiler(Compiler):
  """LLVM IR text -> verified, O2-optimized module -> object file bytes for the target (LLVM_CPU, LLVM_FEATURES),
  checked by the known-answer self-test (runtime/toolchain_check.py) before the first kernel compiles: on a wrong
  answer the vectorizers go off (and a warning says so); if still wrong, a CompileError."""

  def __init__(self) -> None:
    self.target = TargetChoice.from_env()
    self.target_machine = checked_target_machine(self.target)
    with _LLVM_LOCK: self.vector_bytes = target_vector_bytes(self.target_machine)
    setting = f"LLVM_CPU={self.target.cpu!r}" + (f" with LLVM_FEATURES={LLVM_FEATURES.value!r}"
                                                 if LLVM_FEATURES.value else "")
    toolchain_check.refuse_target_host_cannot_run(setting, "LLVM_CPU",
                                                  features_host_lacks(self.target, self.vector_bytes))
    self.safe = False   # True after the self-test: the loop and SLP vectorizers off
    self._verified = False
    self._verify_lock = threading.Lock()

  @property
  def toolchain_key(self) -> str:
    """What the object code depends on: the LLVM version, the triple, the CPU and its features (native: this host's,
    so a cache shared by two machines never hands one the other's code)."""
    version = ".".join(map(str, llvm.llvm_version_info))
    return (f"llvm {version} {llvm.get_process_triple()} {self.target.cpu} {self.target.features} O2 "
            f"safe {int(self.safe)}")

  @property
  def cache_key(self) -> str:  # type: ignore[override]
    self.verify()
    return self.toolchain_key

  def verify(self) -> None:
    """The known-answer self-test, once per process (its verdict cached on disk per toolchain_key)."""
    if self._verified: return
    with self._verify_lock:
      if self._verified: return
      key = self.toolchain_key
      verdict, wrong = toolchain_check.verdict_for(key, self._run_self_test)
      describe = f"LLVM {'.'.join(map(str, llvm.llvm_version_info))} (cpu {self.target.cpu})"
      if verdict == "broken":
        raise CompileError(f"{describe} computes wrong answers on ourgrad's known-answer self-test even with its "
                           f"vectorizers off:\n  " + "\n  ".join(wrong) + "\nTry another LLVM_CPU or llvmlite.")
      if verdict == "safe":
        self.safe = True
        if key not in _WARNED:
          _WARNED.add(key)
          warnings.warn(f"{describe} miscompiled ourgrad's known-answer self-test:\n  " + "\n  ".join(wrong) +
                        "\nLLVM kernels compile with the loop and SLP vectorizers off (slower, right).",
                        RuntimeWarning, stacklevel=3)
      self._verified = True

  def _run_self_test(self) -> tuple[str, list[str]]:
    return toolchain_check.run_with_safe_fallback(toolchain_check.LLVM_KNOWN_ANSWERS, self._load_known_answers,
                                                  lambda safe: setattr(self, "safe", safe))

  def _load_known_answers(self, known_answers: Sequence[toolchain_check.KnownAnswer]) -> dict[str, Callable]:
    """Compile the self-test kernels as one module, load it: {name: function taking the buffers' addresses}."""
    binary = self._build("\n".join(known.source for known in known_answers))
    programs = [LLVMProgram(known.name, binary) for known in known_answers]
    # each callable keeps its program (and so the MCJIT engine holding the code) alive
    return {program.name: (lambda *args, program=program: program.function(*args)) for program in programs}

  def optimized_module(self, source: str) -> llvm.ModuleRef:
    """Parse and verify the IR, then run the O2 pipeline for the target (call with _LLVM_LOCK held)."""
    try:
      module = llvm.parse_assembly(source)
      module.verify()
    except RuntimeError as error:
      raise CompileError(f"LLVM rejected this kernel:\n{source}\n--- LLVM message ---\n{error}") from None
    module.triple = self.target_machine.triple
    module.data_layout = str(self.target_machine.target_data)
    options = llvm.create_pipeline_tuning_options(speed_level=2)
    options.loop_vectorization = not self.safe
    options.slp_vectorization = not self.safe
    options.loop_unrolling = True
    pass_builder = llvm.create_pass_builder(self.target_machine, options)
    pass_builder.getModulePassManager().run(module, pass_builder)
    return module

  def compile(self, source: str) -> bytes:
    self.verify()
    return self._build(source)

  def _build(self, source: str) -> bytes:
    with _LLVM_LOCK:
      module = self.optimized_module(source)
      return bytes(self.target_machine.emit_object(module))

  def disassemble(self, source: str) -> str:
    """The target's assembly of a kernel, as compile() would build it (what DEBUG=6 prints)."""
    self.verify()
    with _LLVM_LOCK: return self.target_machine.emit_assembly(self.optimized_module(source))


class LLVMProgram(HostProgram):
  """A compiled kernel: load the object code into its own MCJIT engine (kept alive with the program) and call the
  named function through ctypes with the buffers' addresses."""

  def __init__(self, name: str, binary: bytes):
    self.name = name
    with _LLVM_LOCK:
      self.engine = llvm.create_mcjit_compiler(llvm.parse_assembly(""), TargetChoice.from_env().target_machine())
      self.engine.add_object_file(llvm.ObjectFileRef.from_data(binary))
      self.engine.finalize_object()
      address = self.engine.get_function_address(name)
    if not address: raise DeviceError(f"LLVM: the compiled object has no function {name!r}")
    # no argtypes: the kernel takes one pointer per buffer, passed as c_void_p
    self.function = ctypes.CFUNCTYPE(None)(address)



def create_device(name: str) -> Compiled:
  renderer = LLVMRenderer(parallel=_LIBGOMP_LOADED)
  compiler = LLVMCompiler()
  # the target's width (LLVM_CPU's, not necessarily this CPU's): the CPU matmul heuristic sizes its register tiles by
  # it; left at SSE's 16 bytes, an AVX-512 CPU got 8x4 tiles (1024^3 float32 on 2 cores: 50 ms, against 8.9 ms with
  # 16x16)
  renderer.vector_bytes = compiler.vector_bytes
  # AVX-512's EVEX encodings and AArch64 have 32 SIMD registers, SSE and AVX2 16: the matmul tile's rows
  renderer.vector_registers = 32 if compiler.vector_bytes == 64 or "aarch64" in compiler.target_machine.triple else 16
  renderer.l2_cache_bytes = host_l2_cache_bytes()   # the matmul tiles' cache blocks (codegen/opt/heuristic.py)
  return Compiled(name, HostAllocator(), renderer, compiler, LLVMProgram)
