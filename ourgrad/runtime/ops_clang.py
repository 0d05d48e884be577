"""The CLANG device (alias CPU): C source -> shared object with the system C compiler -> ctypes call.

Kernels run synchronously on the calling thread. The compiler is `CC` if set, else clang, else gcc.
"""
from __future__ import annotations

import ctypes
import os
import platform
import re
import signal
import shutil
import subprocess
import tempfile


from ourgrad.device import Compiled, Compiler, HostAllocator, HostProgram
from ourgrad.errors import CompileError, DeviceError
from ourgrad.helpers import CC, COMPILE_TIMEOUT
from ourgrad.renderer.cstyle import INDEX_MATH_ONLY, ClangRenderer

# -fopenmp: large kernels run their outer loops on all cores (OMP_NUM_THREADS limits the threads)
# Idle OpenMP threads sleep instead of spinning: on a busy machine a spinning thread steals the core that the
# thread it waits for needs (measured: a 256K-element kernel took 25-30 ms spinning, 4.5 ms passive, under load).
# Set before the first kernel loads the OpenMP runtime; the user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
# -fwrapv: signed integer overflow wraps around (two's complement), as the UOp contract and PyTorch's CPU kernels do
COMPILE_FLAGS = ["-shared", "-fPIC", "-O2", "-march=native", "-fno-math-errno", "-fwrapv", "-fopenmp", "-lm"]


# kernels of at least this many lines of C compile at -O1 (see ClangCompiler.flags_for)
LARGE_KERNEL_LINES = 2500
# bumped when ClangCompiler.flags_for changes which flags a source gets (2: `omp simd` kernels, 3: `parallel for simd`)
FLAGS_FOR_VERSION = 3


def find_c_compiler() -> str:
  for candidate in ([CC.value] if CC.value else []) + ["clang", "gcc", "cc"]:
    path = shutil.which(candidate)
    if path: return path
  raise DeviceError("the CLANG device needs a C compiler: install clang or gcc, or set CC=/path/to/compiler")


# gcc 13 with -march=native on CPUs with AVX512-FP16 (Sapphire Rapids) can emit masked `vmovsh` forms that its own
# assembler rejects; float16 kernels then fail to build. Turning the extension off avoids it where the flag exists.
OPTIONAL_FLAGS = ["-mno-avx512fp16"]


def accepted_flags(compiler: str, flags: list[str]) -> list[str]:
  """The flags this compiler accepts (an unknown -m flag is an error for gcc and clang)."""
  accepted = []
  for flag in flags:
    probe = subprocess.run([compiler, flag, "-x", "c", "-c", "-o", os.devnull, "-"], input="int x;", text=True,
                           capture_output=True)
    if probe.returncode == 0: accepted.append(flag)
  return accepted


def known_bug_flags(compiler: str) -> list[str]:
  """Flags that avoid known miscompilations of correct kernels by this compiler version.

  gcc 12's loop vectorizer at -O2 miscompiles a reduce over a reversed (flipped) view that reads a loop-invariant
  value: `(x.flip(0) + s).sum()` over arange(6) with s=100 gives 921 instead of 615 (test/fuzz/test_regressions.py
  has the kernel). gcc 13 is correct. SLP vectorization, which packs our upcast lanes, is not involved and stays on."""
  version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
  major = subprocess.run([compiler, "-dumpversion"], capture_output=True, text=True).stdout.strip().split(".")[0]
  if "clang" not in version and major == "12": return ["-fno-tree-loop-vectorize"]
  return []


def native_vector_bytes(compiler: str) -> int:
  """The SIMD register width (bytes) that `compiler -march=native` targets, from its predefined macros."""
  probe = subprocess.run([compiler, "-march=native", "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                         text=True)
  if "__AVX512F__" in probe.stdout: return 64
  if "__AVX2__" in probe.stdout or "__AVX__" in probe.stdout: return 32
  return 16


class ClangCompiler(Compiler):
  def __init__(self) -> None:
    self.compiler = find_c_compiler()
    self.flags = COMPILE_FLAGS[:-1] + accepted_flags(self.compiler, OPTIONAL_FLAGS) + known_bug_flags(self.compiler)
    # -march=native makes the binary specific to this CPU: it is part of the cache key, and so is the version of the
    # per-kernel flag rules (flags_for), which pick flags from the source: a binary built under older rules is stale
    self.cache_key = (f"clang {self.compiler} {platform.machine()} {platform.processor()} {' '.join(self.flags)} "
                      f"flags_for {FLAGS_FOR_VERSION}")

  def flags_for(self, source: str) -> list[str]:
    """The flags for one kernel: no -fwrapv where integers only index, the loop vectorizer for `omp simd` lanes, -O1
    instead of -O2 for a big one. gcc -O2's time grows faster than linearly with a function's size (a 3,400-line
    kernel: 18 s at -O2, 2.6 s at -O1); the scheduler keeps fused kernels under KERNEL_OPS_LIMIT ops, but upcasting
    and unrolling can still multiply a kernel's code."""
    flags = self.flags
    # integer math only on indices (the renderer marks such kernels): the wrap rule is not needed (see
    # cstyle.INDEX_MATH_ONLY) and costs the matmul tiles their vectorization
    if source.startswith(INDEX_MATH_ONLY): flags = [flag for flag in flags if flag != "-fwrapv"]
    # A loop marked `omp simd` (the lanes of a CPU row kernel, codegen/row_linearizer.py) needs the loop vectorizer,
    # which known_bug_flags may have turned off for gcc 12 (its miscompile is of a reduce over a flipped view, which a
    # row kernel never splits into lanes), and no -fwrapv: with wrapping int indices gcc cannot prove `base + lane`
    # contiguous and gathers. Such a kernel has no integer arithmetic but its index math, which never overflows
    # (RowLinearizer._cpu_lanes checks).
    if "#pragma omp simd" in source or "#pragma omp parallel for simd" in source:
      flags = [flag for flag in flags if flag not in ("-fno-tree-loop-vectorize", "-fwrapv")]
    if source.count("\n") < LARGE_KERNEL_LINES: return flags
    return ["-O1" if flag == "-O2" else flag for flag in flags]

  def compile(self, source: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="ourgrad_") as folder:
      source_path, library_path = os.path.join(folder, "kernel.c"), os.path.join(folder, "kernel.so")
      with open(source_path, "w") as source_file: source_file.write(source)
      timeout = float(COMPILE_TIMEOUT.value) or None
      # a session of its own, so that a timeout ends the compiler driver and the compiler proper (cc1) it started
      process = subprocess.Popen([self.compiler, *self.flags_for(source), source_path, "-o", library_path,
                                  COMPILE_FLAGS[-1]],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
      try:
        _, stderr = process.communicate(timeout=timeout)
      except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise CompileError(f"compiling kernel {kernel_name(source)} ({len(source.splitlines())} lines of C) took "
                           f"more than COMPILE_TIMEOUT={timeout:g} s; raise COMPILE_TIMEOUT, or lower "
                           f"KERNEL_OPS_LIMIT to split big fused kernels") from None
      if process.returncode != 0:
        raise CompileError(f"{os.path.basename(self.compiler)} failed on this kernel:\n{source}\n--- compiler log ---\n"
                           f"{stderr}")
      with open(library_path, "rb") as library_file: return library_file.read()

  def disassemble(self, source: str) -> str:
    """The compiler's assembly (`-S`) of the kernel, built with the same flags as the shared object."""
    flags = [flag for flag in self.flags_for(source) if flag != "-shared"]
    with tempfile.TemporaryDirectory(prefix="ourgrad_") as folder:
      source_path = os.path.join(folder, "kernel.c")
      with open(source_path, "w") as source_file: source_file.write(source)
      result = subprocess.run([self.compiler, *flags, "-S", source_path, "-o", "-"], capture_output=True, text=True)
    if result.returncode != 0: return f"; {os.path.basename(self.compiler)} -S failed:\n{result.stderr}"
    return result.stdout


def kernel_name(source: str) -> str:
  """The name of the kernel function a rendered C source defines (the last one: helpers come first)."""
  names = re.findall(r"^void (\w+)\(", source, flags=re.MULTILINE)
  return names[-1] if names else "<unnamed>"


class ClangProgram(HostProgram):
  """A compiled kernel: load the shared object from its bytes and call the named function."""

  def __init__(self, name: str, library: bytes):
    self.name = name
    with tempfile.NamedTemporaryFile(suffix=".so", delete=False) as library_file:
      library_file.write(library)
      path = library_file.name
    try:
      self.library = ctypes.CDLL(path)
    finally:
      os.unlink(path)
    self.function = getattr(self.library, name)



def create_device(name: str) -> Compiled:
  compiler = ClangCompiler()
  renderer = ClangRenderer()
  renderer.vector_bytes = native_vector_bytes(compiler.compiler)
  return Compiled(name, HostAllocator(), renderer, compiler, ClangProgram)
