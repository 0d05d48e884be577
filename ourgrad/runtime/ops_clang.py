"""The CLANG device (alias CPU): C source -> shared object with the system C compiler -> ctypes call.

Kernels run synchronously on the calling thread. The compiler is `CC` if set, else clang, else gcc; the target is
`-march=$CLANG_MARCH` (default native). The flags come from FLAG_RULES (per compiler family and version, each entry
the workaround of a known miscompile), and a known-answer self-test (runtime/toolchain_check.py) checks them before
the first kernel compiles (docs/backends.md, the C compiler's flags). Each kernel is compiled to an object file and
linked without the C runtime's libraries, whose symbols resolve when it loads (runtime/host_link.py).
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import platform
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

from ourgrad.device import Compiled, Compiler, HostAllocator, HostProgram, host_l2_cache_bytes
from ourgrad.errors import CompileError, DeviceError
from ourgrad.helpers import CC, CLANG_MARCH, COMPILE_TIMEOUT, cache_dir
from ourgrad.renderer.cstyle import INDEX_MATH_ONLY, ClangRenderer
from ourgrad.runtime import toolchain_check
from ourgrad.runtime.host_calls import CALLER_NAME, HostCallGraph, caller_source
from ourgrad.runtime.host_link import RUNTIME_LINK_FLAGS, RUNTIME_SOURCE, KernelLinker, ensure_c_runtime, load_library
from ourgrad.runtime.openmp import configure_wait_policy

# -fopenmp: large kernels run their outer loops on all cores (OMP_NUM_THREADS limits the threads)
# Idle OpenMP threads spin briefly where the machine has an idle core, else sleep (runtime/openmp.py). Set before the
# first kernel loads the OpenMP runtime; the user's own setting wins.
configure_wait_policy()
# -fwrapv: signed integer overflow wraps around (two's complement), as the UOp contract and PyTorch's CPU kernels do.
# -fno-trapping-math: no kernel reads the floating-point exception flags (clang's default too). With gcc's default a
# select whose arm may raise one (`x != x ? x : poly(x) * 2**n`, the row kernels' exp2) is a branch, which the
# vectorizer cannot if-convert without AVX-512's masked instructions: softmax's exp ran scalar at -march=x86-64-v3.
# Results do not change (no value-changing transformation such as reassociation is allowed by it).
# -Werror=implicit-function-declaration: kernels declare the C library functions they call (cstyle.C_PREAMBLE, not
# math.h); one missing there fails the build instead of being called through an implicit `int f()` declaration.
BASE_FLAGS = ["-shared", "-fPIC", "-O2", "-fno-math-errno", "-fno-trapping-math", "-fwrapv", "-fopenmp",
              "-Werror=implicit-function-declaration"]
LINK_FLAGS = ["-lm"]   # after the source: the linker resolves libm's symbols for the objects before it
# what the self-test falls back to when the chosen flags compute a wrong answer: no vectorizer at all (the explicit
# GCC vectors of renderer/cvector.py and `omp simd` loops still vectorize what they name)
SAFE_FLAGS = ["-fno-tree-loop-vectorize", "-fno-tree-slp-vectorize"]


# kernels of at least this many lines of C compile at -O1 (see ClangCompiler.flags_for)
LARGE_KERNEL_LINES = 2500
# bumped when ClangCompiler.flags_for changes which flags a source gets (2: `omp simd` kernels, 3: `parallel for simd`,
# 4: the FLAG_RULES table, -fno-tree-slp-vectorize for gcc 12's integer reduces, the safe flags, 5: -fno-trapping-math,
# 6: no VNNI for gcc 12's integer reduces, 7: -Werror=implicit-function-declaration)
FLAGS_FOR_VERSION = 7
# bumped when the shared objects' build changes (2: linked alone, their C runtime symbols resolved at load)
BUILD_VERSION = 2


def find_c_compiler() -> str:
  for candidate in ([CC.value] if CC.value else []) + ["clang", "gcc", "cc"]:
    path = shutil.which(candidate)
    if path: return path
  raise DeviceError("the CLANG device needs a C compiler: install clang or gcc, or set CC=/path/to/compiler")


# ---------------------------------------------------------------- which flags, per compiler and version

def has_simd_loop(source: str) -> bool:
  """An `omp simd` loop (the lanes of a CPU row kernel, or an elementwise kernel's innermost loop)."""
  return "#pragma omp simd" in source or "#pragma omp parallel for simd" in source


# an accumulator of an integer or bool type, declared as CStyleLanguage declares DEFINE_ACC ("acc" names)
_INTEGER_ACCUMULATOR = re.compile(r"^\s*(?:(?:unsigned|signed) )?(?:char|short|int|long|long long|bool) acc\d+ = ",
                                  re.MULTILINE)


def has_integer_reduce(source: str) -> bool:
  """A reduce into an integer or bool accumulator: any/all, an int max or sum, argmax."""
  return _INTEGER_ACCUMULATOR.search(source) is not None


@dataclass(frozen=True)
class FlagRule:
  """Flags that compilers of one family ("gcc", "clang" or "any") and major versions `first`..`last` (both included)
  give the kernels `applies` picks (None: every kernel). `optional` flags are given only where the compiler accepts
  them (an unknown -m flag is an error)."""
  family: str
  first: int
  last: int
  flags: tuple[str, ...]
  applies: Callable[[str], bool] | None = None
  optional: bool = False


# Every known miscompile of correct kernels, and the flags that avoid it. The known-answer self-test
# (runtime/toolchain_check.py) runs each pattern with the flags chosen here; where a version not listed here gets one
# wrong it falls back to SAFE_FLAGS and warns. gcc 13+ and clang: no miscompile of ours known (the self-test guards).
FLAG_RULES: tuple[FlagRule, ...] = (
  # gcc <= 12's loop vectorizer at -O2 miscompiles a reduce over a reversed (flipped) view that reads a
  # loop-invariant value: `(x.flip(0) + s).sum()` over arange(6) with s=100 gives 921 instead of 615 (gcc 12.2;
  # test/fuzz/test_regressions.py has the kernel; gcc 13 is right). An `omp simd` loop needs the loop vectorizer and
  # never splits a flipped reduce into lanes (renderer/cvector.py keeps such kernels scalar), so it keeps it.
  FlagRule("gcc", 0, 12, ("-fno-tree-loop-vectorize",), applies=lambda source: not has_simd_loop(source)),
  # gcc <= 12's basic-block (SLP) vectorizer with -fwrapv packs an unrolled min/max reduce of comparisons converted
  # to a signed or char type (`acc = acc > (unsigned char)(x != 4) ? ...`: any, all, `.int().max()`, equal with NaN)
  # as a vector of -1/0 masks and takes their signed max: 0 for "true" on every x86 target without AVX-512 (gcc 12.2
  # at -march=x86-64, -v2, -v3, haswell, znver3; AVX-512's mask registers happen to be right). Only integer reduces
  # lose SLP; float kernels, where it packs the upcast lanes, keep it.
  FlagRule("gcc", 0, 12, ("-fno-tree-slp-vectorize",), applies=has_integer_reduce),
  # gcc 12.2's loop vectorizer with VNNI (-march=native on AVX-512 VNNI / AVX-VNNI CPUs) takes an integer sum of
  # `(int)(signed char)u8 * (int)s8` (a bitcast uint8 byte times an int8: a Q8_0 block's quants, read from the packed
  # bytes, times an 8-bit activation) as an unsigned-by-signed `vpdpbusd` dot product: the byte's sign is lost (a
  # 32-element sum gave 39651 instead of 23523). Without the VNNI extensions it uses vpmaddwd, which is right.
  FlagRule("gcc", 0, 12, ("-mno-avx512vnni", "-mno-avxvnni"), applies=has_integer_reduce, optional=True),
  # gcc 13 with -march=native on CPUs with AVX512-FP16 (Sapphire Rapids) can emit masked `vmovsh` forms that its own
  # assembler rejects; float16 kernels then fail to build. Turning the extension off avoids it where the flag exists.
  FlagRule("any", 0, 999, ("-mno-avx512fp16",), optional=True),
)


@dataclass(frozen=True)
class CompilerIdentity:
  """Which C compiler this is, from its predefined macros: family ("gcc" or "clang"), version, and the macros of
  the target it compiles for at the chosen -march (the CPU features: what the SIMD width and cache key follow)."""
  family: str
  major: int
  version: str
  target_macros: str

  @property
  def vector_bytes(self) -> int:
    """The SIMD register width (bytes) the compiler targets: 64 with AVX-512, 32 with AVX/AVX2, else 16."""
    if "#define __AVX512F__ " in self.target_macros: return 64
    if "#define __AVX2__ " in self.target_macros or "#define __AVX__ " in self.target_macros: return 32
    return 16

  @property
  def vector_registers(self) -> int:
    """How many SIMD registers the target has: 32 with AVX-512 (EVEX encodings) or on AArch64, else 16."""
    if "#define __AVX512F__ " in self.target_macros or "#define __aarch64__ " in self.target_macros: return 32
    return 16


def identify_compiler(compiler: str, march: str) -> CompilerIdentity:
  """Ask the compiler for its predefined macros at -march=`march`; a DeviceError if it rejects that target."""
  probe = subprocess.run([compiler, f"-march={march}", "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                         text=True)
  if probe.returncode != 0:
    raise DeviceError(f"{os.path.basename(compiler)} rejects CLANG_MARCH={march!r} (-march={march}): "
                      f"{probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else 'no message'}. Use a "
                      f"target it knows (native, x86-64-v2, x86-64-v3, x86-64-v4, znver3, ...)")
  macros = dict(line.split(" ", 2)[1:] for line in probe.stdout.splitlines() if line.count(" ") >= 2)
  if "__clang__" in macros:
    family, major = "clang", int(macros.get("__clang_major__", 0))
    version = f"{major}.{macros.get('__clang_minor__', 0)}.{macros.get('__clang_patchlevel__', 0)}"
  else:
    family, major = "gcc", int(macros.get("__GNUC__", 0))
    version = f"{major}.{macros.get('__GNUC_MINOR__', 0)}.{macros.get('__GNUC_PATCHLEVEL__', 0)}"
  return CompilerIdentity(family, major, version, "\n".join(sorted(probe.stdout.splitlines())))


# a CPU feature as the compilers predefine it for the target: `#define __AVX512F__ 1` (the -march's own names,
# `__znver3`, `__tune_znver3__`, `__k8`, are lower case; sizes such as __BIGGEST_ALIGNMENT__ have other values)
_FEATURE_MACRO = re.compile(r"^#define __([A-Z][A-Z0-9_]*?)__ 1$", re.MULTILINE)


def target_features(identity: CompilerIdentity) -> set[str]:
  """The CPU features code built for this target may use, in /proc/cpuinfo's spelling ("avx512f", "sse4_2")."""
  return {name.lower() for name in _FEATURE_MACRO.findall(identity.target_macros)}


def features_host_lacks(compiler: str, march: str, identity: CompilerIdentity) -> list[str]:
  """The CPU features the target `march` (its `identity`) uses and this CPU (-march=native) lacks: code built for it
  dies of SIGILL here. Empty for native, and where the compiler cannot say what native is."""
  if march == "native": return []
  try:
    host = identify_compiler(compiler, "native")
  except DeviceError:   # no -march=native for this compiler and architecture: nothing to compare with
    return []
  return sorted(target_features(identity) - target_features(host))


def rules_for(identity: CompilerIdentity) -> list[FlagRule]:
  """The FLAG_RULES entries for this compiler's family and version."""
  return [rule for rule in FLAG_RULES
          if rule.family in ("any", identity.family) and rule.first <= identity.major <= rule.last]


def accepted_flags(compiler: str, flags: list[str]) -> list[str]:
  """The flags this compiler accepts (an unknown -m flag is an error for gcc and clang)."""
  accepted = []
  for flag in flags:
    probe = subprocess.run([compiler, flag, "-x", "c", "-c", "-o", os.devnull, "-"], input="int x;", text=True,
                           capture_output=True)
    if probe.returncode == 0: accepted.append(flag)
  return accepted


_WARNED: set[str] = set()   # toolchains whose fallback to the safe flags was already reported in this process


class ClangCompiler(Compiler):
  """C source -> shared object with the host C compiler, at the -march CLANG_MARCH names, with the flags FLAG_RULES
  picks for this compiler's version, checked by the known-answer self-test before the first kernel compiles."""
  concurrent_compiles = True  # each compile is a subprocess in a folder of its own

  def __init__(self) -> None:
    self.compiler = find_c_compiler()
    self.march = CLANG_MARCH.value or "native"
    self.identity = identify_compiler(self.compiler, self.march)
    toolchain_check.refuse_target_host_cannot_run(f"CLANG_MARCH={self.march!r}", "CLANG_MARCH",
                                                  features_host_lacks(self.compiler, self.march, self.identity))
    self.rules = [rule for rule in rules_for(self.identity)
                  if not rule.optional or accepted_flags(self.compiler, list(rule.flags)) == list(rule.flags)]
    # the flags every kernel gets; flags_for adds and removes per kernel
    self.flags = BASE_FLAGS + [f"-march={self.march}"]
    self.linker = KernelLinker(self.compiler)
    self.safe = False              # True after the self-test found a wrong answer that SAFE_FLAGS corrected
    self._verified = False
    self._verify_lock = threading.Lock()
    self._caller: Callable[..., None] | None = None   # TinyJit's replay dispatcher (kernel_caller), built on first use
    self._caller_lock = threading.Lock()

  @property
  def vector_bytes(self) -> int: return self.identity.vector_bytes

  @property
  def vector_registers(self) -> int: return self.identity.vector_registers

  @property
  def toolchain_key(self) -> str:
    """What the binaries depend on: the compiler and its version, the flags, and the target's macros (with
    -march=native, the CPU's features: a cache shared by two machines never hands one the other's binaries)."""
    target = hashlib.sha256(self.identity.target_macros.encode()).hexdigest()[:16]
    rules = "; ".join(" ".join(rule.flags) for rule in self.rules)
    return (f"{self.identity.family} {self.identity.version} {self.compiler} {platform.machine()} "
            f"{' '.join(self.flags)} rules [{rules}] safe {int(self.safe)} target {target} "
            f"flags_for {FLAGS_FOR_VERSION} {self.linker.key} build {BUILD_VERSION}")

  @property
  def cache_key(self) -> str:  # type: ignore[override]
    self.verify()   # the flags the key names are the ones the self-test passed
    return f"clang {self.toolchain_key}"

  def flags_for(self, source: str) -> list[str]:
    """The flags for one kernel: the FLAG_RULES that apply to it, no -fwrapv where integers only index, the loop
    vectorizer for `omp simd` lanes, -O1 instead of -O2 for a big one. gcc -O2's time grows faster than linearly
    with a function's size (a 3,400-line kernel: 18 s at -O2, 2.6 s at -O1); the scheduler keeps fused kernels under
    KERNEL_OPS_LIMIT ops, but upcasting and unrolling can still multiply a kernel's code."""
    flags = list(self.flags)
    for rule in self.rules:
      if rule.applies is None or rule.applies(source): flags += [flag for flag in rule.flags if flag not in flags]
    if self.safe: flags += [flag for flag in SAFE_FLAGS if flag not in flags]
    # integer math only on indices (the renderer marks such kernels): the wrap rule is not needed (see
    # cstyle.INDEX_MATH_ONLY) and costs the matmul tiles their vectorization
    if source.startswith(INDEX_MATH_ONLY): flags.remove("-fwrapv")
    # A loop marked `omp simd` (the lanes of a CPU row kernel, codegen/row_linearizer.py, or an elementwise kernel's
    # innermost loop) needs no -fwrapv: with wrapping int indices gcc cannot prove `base + lane` contiguous and
    # gathers. Such a kernel has no integer arithmetic but its index math, which never overflows
    # (RowLinearizer._cpu_lanes checks; a row's gathered offset after its loops comes from a clamped index).
    if has_simd_loop(source) and "-fwrapv" in flags: flags.remove("-fwrapv")
    if source.count("\n") < LARGE_KERNEL_LINES: return flags
    return ["-O1" if flag == "-O2" else flag for flag in flags]

  # ---------------------------------------------------------------- the known-answer self-test

  def verify(self) -> None:
    """Run the known-answer self-test once per process (its verdict cached on disk per toolchain_key): on a wrong
    answer switch to SAFE_FLAGS and warn once; if those are wrong too, raise a CompileError."""
    if self._verified: return
    with self._verify_lock:
      if self._verified: return
      key = self.toolchain_key
      verdict, wrong = toolchain_check.verdict_for(key, self._run_self_test)
      if verdict == "broken":
        raise CompileError(f"{self._describe()} computes wrong answers on ourgrad's known-answer self-test even with "
                           f"the safe flags ({' '.join(SAFE_FLAGS)}):\n  " + "\n  ".join(wrong) +
                           "\nUse another compiler (CC=clang or CC=gcc-13), or another target (CLANG_MARCH).")
      if verdict == "safe":
        self.safe = True
        if key not in _WARNED:
          _WARNED.add(key)
          warnings.warn(f"{self._describe()} miscompiled ourgrad's known-answer self-test with its usual flags:\n  " +
                        "\n  ".join(wrong) + f"\nCLANG kernels compile with {' '.join(SAFE_FLAGS)} (slower, right). "
                        f"Please report this compiler version (docs/backends.md, the C compiler's flags).",
                        RuntimeWarning, stacklevel=3)
      self._verified = True

  def _describe(self) -> str:
    return f"{os.path.basename(self.compiler)} {self.identity.version} (-march={self.march})"

  def _run_self_test(self) -> tuple[str, list[str]]:
    """The verdict ("ok", "safe" or "broken") and the wrong answers of the usual flags."""
    return toolchain_check.run_with_safe_fallback(toolchain_check.C_KNOWN_ANSWERS, self._load_known_answers,
                                                  lambda safe: setattr(self, "safe", safe))

  def _load_known_answers(self, known_answers: Sequence[toolchain_check.KnownAnswer]) -> dict[str, Callable]:
    """Compile the self-test kernels (one shared object per set of flags) and load them: {name: function}."""
    by_flags: dict[tuple[str, ...], list[str]] = {}
    for known in known_answers: by_flags.setdefault(tuple(self.flags_for(known.source)), []).append(known.source)
    functions = {}
    for flags, sources in by_flags.items():
      program = ClangProgram(None, self._build("\n".join(sources), list(flags)), self.load_runtime)
      functions.update({known.name: getattr(program.library, known.name) for known in known_answers
                        if known.source in sources})
    return functions

  def compile(self, source: str) -> bytes:
    self.verify()
    return self._build(source, self.flags_for(source))

  def _build(self, source: str, flags: list[str]) -> bytes:
    """The shared object of `source` compiled with `flags`: an object file (`-c`), linked alone (host_link.py)."""
    compile_flags = [flag for flag in flags if flag != "-shared"]
    with tempfile.TemporaryDirectory(prefix="ourgrad_") as folder:
      source_path, object_path = os.path.join(folder, "kernel.c"), os.path.join(folder, "kernel.o")
      library_path = os.path.join(folder, "kernel.so")
      with open(source_path, "w") as source_file: source_file.write(source)
      self._run(source, [self.compiler, *compile_flags, "-c", source_path, "-o", object_path])
      self._run(source, self.linker.command(object_path, library_path))
      with open(library_path, "rb") as library_file: return library_file.read()

  def _run(self, source: str, command: list[str]) -> None:
    """Run one step of the build of `source` (the compiler or the linker), within COMPILE_TIMEOUT."""
    timeout = float(COMPILE_TIMEOUT.value) or None
    # a session of its own, so that a timeout ends the compiler driver and the compiler proper (cc1) it started
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
      _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      os.killpg(process.pid, signal.SIGKILL)
      process.communicate()
      raise CompileError(f"compiling kernel {kernel_name(source)} ({len(source.splitlines())} lines of C) took "
                         f"more than COMPILE_TIMEOUT={timeout:g} s; raise COMPILE_TIMEOUT, or lower "
                         f"KERNEL_OPS_LIMIT to split big fused kernels") from None
    if process.returncode != 0:
      raise CompileError(f"{os.path.basename(command[0])} failed on this kernel:\n{source}\n--- compiler log ---\n"
                         f"{stderr}")

  def kernel_caller(self) -> Callable[..., None]:
    """The dispatcher that calls a table of kernels in turn (runtime/host_calls.py): compiled once per toolchain (from
    the disk cache after that), loaded once per process."""
    if self._caller is None:
      with self._caller_lock:
        if self._caller is None:
          program = ClangProgram(CALLER_NAME, self.compile_cached(caller_source()), self.load_runtime)
          self._caller = program.function
    return self._caller

  # ---------------------------------------------------------------- the C runtime library (host_link.py)

  def load_runtime(self) -> None:
    """Load the C runtime library the kernels' libm and OpenMP symbols resolve from, once per process (from the
    disk cache where an earlier process linked it)."""
    ensure_c_runtime(self.toolchain_key, lambda: _RuntimeLibrary(self).compile_cached(RUNTIME_SOURCE))

  def _link_runtime(self) -> bytes:
    """The C runtime library: linked by the driver, with every kernel's flags and libraries, all recorded needed."""
    with tempfile.TemporaryDirectory(prefix="ourgrad_") as folder:
      source_path, library_path = os.path.join(folder, "runtime.c"), os.path.join(folder, "runtime.so")
      with open(source_path, "w") as source_file: source_file.write(RUNTIME_SOURCE)
      self._run(RUNTIME_SOURCE, [self.compiler, *self.flags, *RUNTIME_LINK_FLAGS, source_path, "-o", library_path,
                                 *LINK_FLAGS])
      with open(library_path, "rb") as library_file: return library_file.read()

  def disassemble(self, source: str) -> str:
    """The compiler's assembly (`-S`) of the kernel, built with the same flags as the shared object."""
    self.verify()
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


class _RuntimeLibrary(Compiler):
  """The C runtime library's entry in the disk compile cache, keyed by the toolchain (not through ClangCompiler's
  cache_key, which runs the self-test: whose kernels need this library loaded)."""

  def __init__(self, compiler: ClangCompiler):
    self.compiler = compiler

  @property
  def cache_key(self) -> str:  # type: ignore[override]
    return f"clang c-runtime {self.compiler.toolchain_key}"

  def cache_path(self, source: str) -> pathlib.Path:
    """Beside the self-test's verdicts, not among the kernels (whose entries the size bound prunes)."""
    digest = hashlib.sha256(f"{self.cache_key}\n{source}".encode()).hexdigest()
    return cache_dir() / "toolchain" / f"c_runtime_{digest[:32]}.so"

  def compile(self, source: str) -> bytes: return self.compiler._link_runtime()


class ClangProgram(HostProgram):
  """A compiled kernel: load the shared object from its bytes and call the named function. `load_runtime` loads
  the libraries its undefined symbols come from first (ClangCompiler.load_runtime; None: a shared object linked
  with them, as the driver links one)."""

  def __init__(self, name: str | None, library: bytes, load_runtime: Callable[[], None] | None = None):
    self.name = name
    if load_runtime is not None: load_runtime()
    self.library = load_library(library, f"CLANG kernel {name}")
    self.function = getattr(self.library, name) if name is not None else None


def create_device(name: str) -> Compiled:
  compiler = ClangCompiler()
  renderer = ClangRenderer()
  # the width of the target's SIMD registers (CLANG_MARCH's, not necessarily this CPU's): the CPU matmul tiles,
  # row-kernel lanes and explicit vectors are sized by it
  renderer.vector_bytes = compiler.vector_bytes
  renderer.vector_registers = compiler.vector_registers   # the matmul tile's rows (codegen/opt/cpu_tiles.py)
  renderer.l2_cache_bytes = host_l2_cache_bytes()   # the matmul tiles' cache blocks (codegen/opt/heuristic.py)
  allocator = HostAllocator()
  device = Compiled(name, allocator, renderer, compiler,
                    lambda kernel, library: ClangProgram(kernel, library, compiler.load_runtime))
  # TinyJit's replays call the captured kernels from one C function (runtime/host_calls.py), not one ctypes call each
  device.replay_graph = lambda launches: HostCallGraph(launches, compiler.kernel_caller(),
                                                       lambda handle: allocator.pointer(handle).value)
  return device
