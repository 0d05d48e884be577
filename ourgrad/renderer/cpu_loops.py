"""How a C kernel on the CPU runs its loops: the C library it declares (C_PREAMBLE), about how many UOps one run
executes (the loop trip counts), and the OpenMP choices ClangRenderer makes from them: which leading global loops
run on several threads (`parallel for`), and how an elementwise `omp simd` loop is marked."""
from __future__ import annotations

import math

from ourgrad.codegen.uops import AxisType, UOp, UOps


# What a C kernel needs of the C library, declared here instead of including <math.h>: parsing math.h's thousands of
# lines took ~11 ms of gcc 12's ~55 ms of CPU for a small kernel (one compile per kernel, on every first run; the
# assembly is the same). The compiler knows these functions as builtins (sqrtf becomes an instruction), the others
# are libm's; the constants are glibc's own definitions. ops_clang compiles with -Werror=implicit-function-declaration,
# so a kernel calling a function not declared here fails to build instead of getting an implicit `int` declaration.
C_MATH_FUNCTIONS = ("exp2", "log2", "sin", "sqrt")   # the names math_call is given (C_CODE_FOR_OP, cvector's sqrtf)
C_PREAMBLE = ("".join(f"float {name}f(float); double {name}(double);\n" for name in C_MATH_FUNCTIONS) +
              "#define INFINITY (__builtin_inff())\n#define NAN (__builtin_nanf(\"\"))\n#include <stdbool.h>\n")


def loop_trip_bound(loop: UOp) -> int:
  """Iterations of a RANGE: exact for constant bounds; a bound that is a kernel int argument (DEFINE_VAR, a
  symbolic size) counts as its largest value; any other expression as 1."""
  start, end = loop.srcs
  if end.op is UOps.CONST: return end.arg - start.arg
  return end.arg[2] if end.op is UOps.DEFINE_VAR else 1


def leading_global_loops(uops: list[UOp]) -> list[UOp]:
  """The global loops that open the kernel one directly inside the other (constants between them render inline)."""
  loops: list[UOp] = []
  for uop in uops[next((index for index, uop in enumerate(uops) if uop.op is UOps.RANGE), len(uops)):]:
    if uop.op is UOps.CONST: continue
    if uop.op is not UOps.RANGE or uop.arg[1] is not AxisType.GLOBAL: break
    loops.append(uop)
  return loops


def executed_uops(uops: list[UOp], lanes: int = 1) -> int:
  """About how many UOps (or SIMD instructions) one run of the kernel executes: each one times the trip counts of
  the loops around it (loop_trip_bound's), so that loops one after another add up instead of multiplying; a loop
  the renderer vectorizes (an UPCAST or UNROLL RANGE: a CPU row kernel's `omp simd` lanes) counts once per `lanes`."""
  total, trips = 0, [1]
  gates: list[bool] = []   # per open IF: whether its condition reads memory (its body then counted as run once)
  for uop in uops:
    if uop.op is UOps.ENDRANGE:
      trips.pop()
      continue
    if uop.op is UOps.ENDIF:
      if gates and gates.pop(): trips.pop()
      continue
    total += trips[-1]
    if uop.op is UOps.IF:
      # a gate on loaded data (a `where` assign's kept gate: a KV-cache write stores one slot of 520) may pass on
      # few iterations: its body is counted once, not once per iteration (2 threads on the H200 host: a parallel
      # region per cache write cost 2.4% of a SmolLM2 decode step)
      gates.append(_reads_memory(uop.srcs[0]))
      if gates[-1]: trips.append(1)
      continue
    if uop.op is UOps.RANGE:
      trip = loop_trip_bound(uop)
      trips.append(trips[-1] * (-(-trip // lanes) if uop.arg[1] in (AxisType.UPCAST, AxisType.UNROLL) else trip))
  return total


def _reads_memory(condition: UOp) -> bool:
  """Whether a value depends on a load (walked with an explicit stack: conditions are small trees)."""
  stack, seen = [condition], set()
  while stack:
    uop = stack.pop()
    if id(uop) in seen: continue
    seen.add(id(uop))
    if uop.op is UOps.LOAD: return True
    stack.extend(uop.srcs)
  return False


def parallel_loop_count(uops: list[UOp], simd_loop: UOp | None, lanes: int, min_work: int) -> int:
  """How many leading global loops run on several threads (0: none). The global loops come first: collapse the
  perfectly nested ones (up to the first statement between two of them: a gated store's condition,
  Linearizer._open_kept_gate) into one parallel loop when the kernel does enough work (executed_uops at `lanes` SIMD
  lanes, at least `min_work`) and that loop has at least two iterations to share (a one-row norm's kernel of 1x1
  global loops opened a parallel region for one thread: a sleeping thread's wake-up, ~20 us on a loaded 2-core VM,
  for a 1 us kernel). Each iteration writes its own outputs, so threads never share a store."""
  global_loops = leading_global_loops(uops)
  shared = math.prod(loop_trip_bound(loop) for loop in global_loops)
  if shared < 2 or executed_uops(uops, lanes) < min_work: return 0
  # an elementwise kernel's innermost loop (`simd_loop`) stays inside each thread's iteration as its `omp simd` loop;
  # a kernel of one loop shares it: `parallel for simd`
  return len(global_loops) - 1 if simd_loop is not None and len(global_loops) > 1 else len(global_loops)


def simd_loop_pragma(loop: UOp, simd_loop: UOp | None, lanes: int, pragma: str) -> str:
  """`pragma` (`omp simd`), with `simdlen(n)` for the elementwise loop `simd_loop` where it is too short for two
  vectors of `lanes` lanes: n the largest power of two, at least 8 lanes, that runs twice (20 columns at AVX-512: 8
  lanes; the CNN step's batchnorm-and-max-pool backward, 128x32x20x20 with 3 gathered operands, one core: 2.5 -> 1.6
  ms, AVX2 1.5)."""
  trip = loop_trip_bound(loop)
  if loop is not simd_loop or trip >= 2 * lanes or trip < 16: return pragma
  return f"{pragma} simdlen({1 << (trip // 2).bit_length() - 1})"


def parallel_pragma(loop_count: int, simd: bool) -> str:
  """The pragma before the first of `loop_count` collapsed parallel loops (`simd`: the only loop, also vectorized)."""
  return "#pragma omp parallel for" + (" simd" if simd else "") + (f" collapse({loop_count})" if loop_count > 1 else "")
