"""Checking that CUDA kernels compile, many kernels per NVRTC program: CHECK_CUDA_RENDER=1's check (test/conftest.py),
which compiles every kernel a test suite makes for CUDA on a machine without a GPU.

An NVRTC program pays a fixed cost whatever it holds: the front end's start with its builtin header, then ptxas's
start. On CI's 2-core EPYC a small kernel alone costs ~65 ms of CPU, of which ~50 ms is that fixed part; each further
kernel in the same program adds ~14 ms (session 19: 50 kernels of test_ops.py, 3.3 CPU-s as 50 programs, 0.7 as one).
A check needs no binary, so the kernels waiting to be checked are compiled together, one program per target
architecture (wgmma kernels build for sm_90a). Each kernel goes in a namespace of its own with its C linkage dropped
(two kernels may share a name, and several define the same dynamic shared memory symbol) and the macros it defines
undefined after it. The program is CUBIN, not only PTX: ptxas then assembles the kernels' inline PTX (wgmma, cp.async,
griddepcontrol...), which the front end passes through unread. The combined programs are compiled for the fastest
compile NVRTC offers (--Ofast-compile=max, FAST_COMPILE): the verdict is what the check keeps, not the binary, and
ptxas still assembles every instruction and lays out every kernel (too much static shared memory is still rejected).

When a program fails, each of its kernels is compiled alone, as the device would compile it (its own options): the
ones NVRTC rejects are the error, each with its name, source and log. A kernel that compiles alone passes even where
the combined program did not (the combination and its options are the check's own doing). Checked sources are
marked in the disk compile cache, so pytest-xdist's workers (and a later run sharing OURGRAD_CACHE_DIR) skip what
another already checked.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass

from ourgrad.device import Compiler
from ourgrad.errors import CompileError
from ourgrad.runtime.ops_cuda import CUDACompiler, check, nvrtc

# kernels per program at most: a failed program compiles each of its kernels again, alone; this bounds that
MAX_KERNELS_PER_PROGRAM = 64
_MACRO = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)", re.MULTILINE)
_C_LINKAGE = 'extern "C" '
_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include\b", re.MULTILINE)
# NVRTC's --Ofast-compile=max (12.8 and newer): the front end and ptxas spend little on optimizing. 355 kernels of
# test_schedule, test_tensor_cores and test_conv in 6 programs: 10.5 CPU-s as the device compiles them, 7.5 with it
# (PTX alone 7.0, but without ptxas neither inline PTX nor shared memory sizes are checked); bogus inline PTX, an
# asm operand of the wrong register type and 80 KB of static shared memory are rejected with it as without it.
FAST_COMPILE = [b"--Ofast-compile=max"]
FAST_COMPILE_SINCE = (12, 8)


@dataclass(frozen=True)
class PendingKernel:
  name: str      # the kernel's function name
  source: str    # its CUDA C++, as the CUDA device would compile it
  made_by: str   # what built it (a test's id), named beside it when NVRTC rejects it


class _CheckMarks(Compiler):
  """The disk cache's record of sources already checked: an empty entry under a key of its own (a check's combined
  binary is no kernel's binary, so nothing is stored under the compiler's own key)."""

  def __init__(self, compiler: CUDACompiler):
    self.cache_key = f"{compiler.cache_key} checked"


def combined_source(kernels: list[PendingKernel]) -> str:
  """One translation unit of `kernels`, each in its own namespace, without C linkage, its macros undefined after it."""
  parts = []
  for index, kernel in enumerate(kernels):
    body = kernel.source.replace(_C_LINKAGE, "")
    undefines = "".join(f"#undef {macro}\n" for macro in dict.fromkeys(_MACRO.findall(kernel.source)))
    parts.append(f"namespace ourgrad_check_{index} {{\n{body}\n}}\n{undefines}")
  return "".join(parts)


def _described(kernel: PendingKernel) -> str:
  return f"{kernel.name} (built by {kernel.made_by})" if kernel.made_by else kernel.name


def _fast_compiler(compiler: CUDACompiler) -> CUDACompiler:
  """`compiler` with FAST_COMPILE added to its options where this NVRTC has it (else `compiler` itself)."""
  if check(nvrtc.nvrtcVersion(), "nvrtcVersion") < FAST_COMPILE_SINCE: return compiler
  fast = copy.copy(compiler)
  fast.options = [*compiler.options, *FAST_COMPILE]
  return fast


class NvrtcCheck:
  """Kernels added with `add` wait; `flush` compiles them (few NVRTC programs) and raises CompileError naming each
  kernel NVRTC rejects."""

  def __init__(self, compiler: CUDACompiler):
    self.compiler = compiler
    self._fast = _fast_compiler(compiler)   # compiles the combined programs
    self._marks = _CheckMarks(compiler)
    self._checked: set[str] = set()            # sources checked by this process
    self._pending: dict[str, PendingKernel] = {}  # by source: a kernel made twice is compiled once
    self.programs = 0   # NVRTC programs compiled (batches and lone kernels): for tests and reports

  def add(self, name: str, source: str, made_by: str = "") -> None:
    if source in self._checked or source in self._pending: return
    self._pending[source] = PendingKernel(name, source, made_by)

  def pending(self) -> list[PendingKernel]:
    return list(self._pending.values())

  def flush(self) -> None:
    """Compile every waiting kernel that no process checked before; CompileError names those NVRTC rejects."""
    waiting = [kernel for kernel in self._pending.values() if not self._already_checked(kernel.source)]
    self._pending.clear()
    rejected: list[tuple[PendingKernel, CompileError]] = []
    for batch in self._batches(waiting):
      rejected += self._compile_batch(batch)
    rejected_sources = {kernel.source for kernel, _ in rejected}
    for kernel in waiting:
      if kernel.source not in rejected_sources: self._mark_checked(kernel.source)
    if rejected:
      names = ", ".join(_described(kernel) for kernel, _ in rejected)
      details = "\n\n".join(f"--- kernel {_described(kernel)} ---\n{error}" for kernel, error in rejected)
      raise CompileError(f"CHECK_CUDA_RENDER: NVRTC rejects {len(rejected)} CUDA kernel(s): {names}\n{details}")

  def _already_checked(self, source: str) -> bool:
    if source in self._checked: return True
    # another process checked it, or compiled it for a CUDA device (the compiler's own entry)
    if self._marks.load_cached(source) is not None or self.compiler.load_cached(source) is not None:
      self._checked.add(source)
      return True
    return False

  def _mark_checked(self, source: str) -> None:
    self._checked.add(source)
    self._marks.store_cached(source, b"")

  def _batches(self, kernels: list[PendingKernel]) -> list[list[PendingKernel]]:
    """Kernels grouped by target architecture, at most MAX_KERNELS_PER_PROGRAM a group; a source with an #include
    goes alone (its header cannot go inside a namespace)."""
    groups: dict[str, list[PendingKernel]] = {}
    alone: list[list[PendingKernel]] = []
    for kernel in kernels:
      if _INCLUDE.search(kernel.source): alone.append([kernel])
      else: groups.setdefault(self.compiler.target(kernel.source), []).append(kernel)
    return alone + [group[start:start + MAX_KERNELS_PER_PROGRAM] for group in groups.values()
                    for start in range(0, len(group), MAX_KERNELS_PER_PROGRAM)]

  def _compile_batch(self, batch: list[PendingKernel]) -> list[tuple[PendingKernel, CompileError]]:
    """The kernels of `batch` NVRTC rejects, each with its error (source and log), compiled alone with the device's
    own options after the combined program (fast-compile options) failed."""
    self.programs += 1
    try:
      source = combined_source(batch) if len(batch) > 1 else batch[0].source
      self._fast.check_compiles(source, self.compiler.target(batch[0].source))
      return []
    except CompileError:
      pass  # name the culprits: each kernel alone, as the device compiles it
    rejected = []
    for kernel in batch:
      self.programs += 1
      try:
        self.compiler.check_compiles(kernel.source, self.compiler.target(kernel.source))
      except CompileError as error:
        rejected.append((kernel, error))
    return rejected
