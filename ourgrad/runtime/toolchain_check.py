"""Known-answer self-test of a CPU toolchain: tiny kernels in the shapes host compilers have miscompiled, run on
inputs whose answers Python computes, before a device's first kernel is compiled.

A C compiler bug gives wrong numbers with no error (gcc 12.2 at -O2 -fwrapv made `any`, `all` and `max` of
comparisons False on every x86 target without AVX-512), and which CPU CI happens to get decides whether the suite
sees it. So the CLANG device runs these kernels with the flags it will use (`ClangCompiler.flags_for` for each, so
per-kernel rules are tested too) and the -march it targets; the LLVM device runs the same patterns as LLVM IR.
On a wrong answer the device retries with its safe flags (no vectorizers) and warns; if that is still wrong it
refuses to compile (a CompileError naming the wrong answers). The verdict is cached on disk per (compiler,
version, flags, target), so a process pays a file read, and the first process for a toolchain one compile per group
of flags (~0.2 s with gcc; DISABLE_COMPILER_CACHE=1 runs it in every process).

Main pieces: `KnownAnswer` (one kernel, its inputs and expected outputs), `C_KNOWN_ANSWERS`, `LLVM_KNOWN_ANSWERS`,
`wrong_answers` (run a set through a build-and-load function), `run_with_safe_fallback` (the verdict) and
`verdict_for` (`cached_verdict` / `store_verdict`).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import math
import pathlib
from dataclasses import dataclass
from typing import Callable, Sequence

from ourgrad.device import write_atomic
from ourgrad.errors import DeviceError
from ourgrad.helpers import DISABLE_COMPILER_CACHE, cache_dir

# bumped when the kernels or their answers change: verdicts cached under an older set are not trusted
SELF_TEST_VERSION = 2

CTYPES = {"float": ctypes.c_float, "int": ctypes.c_int32, "bool": ctypes.c_bool, "long long": ctypes.c_int64}


@dataclass(frozen=True)
class KnownAnswer:
  """One kernel `name` in `source`; called with the output buffer first, then each input; `cases` are
  (inputs, expected output) pairs, the inputs as (C type, values), the output's C type in `output`."""
  name: str
  source: str
  output: str
  cases: tuple[tuple[tuple[tuple[str, tuple], ...], tuple], ...]
  pattern: str   # what it guards against, for the error message


def _any(values: Sequence[float]) -> bool: return any(value != 0 for value in values)


# ---------------------------------------------------------------- the C kernels (written as ClangRenderer writes them)

_PREAMBLE = "#include <math.h>\n#include <stdbool.h>\n"

_ANY_ROWS = _PREAMBLE + """void kat_any_rows(bool* restrict data0, const float* restrict data1) {
  for (int gidx0 = 0; gidx0 < 3; gidx0++) {
    unsigned char acc0 = ((unsigned char)0);
    int alu0 = (gidx0*4);
    float val0 = data1[alu0];
    acc0 = (((acc0)>(((unsigned char)((val0 != 0))))) ? (acc0) : (((unsigned char)((val0 != 0)))));
    float val1 = data1[(alu0+1)];
    acc0 = (((acc0)>(((unsigned char)((val1 != 0))))) ? (acc0) : (((unsigned char)((val1 != 0)))));
    float val2 = data1[(alu0+2)];
    acc0 = (((acc0)>(((unsigned char)((val2 != 0))))) ? (acc0) : (((unsigned char)((val2 != 0)))));
    float val3 = data1[(alu0+3)];
    acc0 = (((acc0)>(((unsigned char)((val3 != 0))))) ? (acc0) : (((unsigned char)((val3 != 0)))));
    data0[gidx0] = (acc0 != 0);
  }
}
"""

_ALL_POSITIVE = _PREAMBLE + """void kat_all_positive(bool* restrict data0, const float* restrict data1) {
  unsigned char acc0 = ((unsigned char)0);
  float val0 = data1[0];
  acc0 = (((acc0)>(((unsigned char)(((0.0f<val0)!=1))))) ? (acc0) : (((unsigned char)(((0.0f<val0)!=1)))));
  float val1 = data1[1];
  acc0 = (((acc0)>(((unsigned char)(((0.0f<val1)!=1))))) ? (acc0) : (((unsigned char)(((0.0f<val1)!=1)))));
  float val2 = data1[2];
  acc0 = (((acc0)>(((unsigned char)(((0.0f<val2)!=1))))) ? (acc0) : (((unsigned char)(((0.0f<val2)!=1)))));
  float val3 = data1[3];
  acc0 = (((acc0)>(((unsigned char)(((0.0f<val3)!=1))))) ? (acc0) : (((unsigned char)(((0.0f<val3)!=1)))));
  data0[0] = ((acc0 != 0)!=1);
}
"""

_INT_MAX_OF_COMPARES = _PREAMBLE + """void kat_int_max_ne(int* restrict data0, const int* restrict data1) {
  int acc0 = (-2147483647-1);
  int val0 = data1[0];
  acc0 = (((acc0)>(((int)((val0!=4))))) ? (acc0) : (((int)((val0!=4)))));
  int val1 = data1[1];
  acc0 = (((acc0)>(((int)((val1!=4))))) ? (acc0) : (((int)((val1!=4)))));
  int val2 = data1[2];
  acc0 = (((acc0)>(((int)((val2!=4))))) ? (acc0) : (((int)((val2!=4)))));
  int val3 = data1[3];
  acc0 = (((acc0)>(((int)((val3!=4))))) ? (acc0) : (((int)((val3!=4)))));
  data0[0] = acc0;
}
"""

_COUNT_COMPARES = _PREAMBLE + """void kat_count_lt(int* restrict data0, const float* restrict data1) {
  int acc0 = 0;
  for (int ridx0 = 0; ridx0 < 2; ridx0++) {
    int alu0 = (ridx0*4);
    float val0 = data1[alu0];
    acc0 = (acc0+((int)((val0<0.5f))));
    float val1 = data1[(alu0+1)];
    acc0 = (acc0+((int)((val1<0.5f))));
    float val2 = data1[(alu0+2)];
    acc0 = (acc0+((int)((val2<0.5f))));
    float val3 = data1[(alu0+3)];
    acc0 = (acc0+((int)((val3<0.5f))));
  }
  data0[0] = acc0;
}
"""

# gcc 12's loop vectorizer: an unrolled reduce over a reversed view plus a loop-invariant load (921 for 615)
_FLIPPED_REDUCE = _PREAMBLE + """void kat_flipped_sum(float* restrict data0, const float* restrict data1,
                     const float* restrict data2) {
  float acc0 = 0.0f;
  for (int ridx0 = 0; ridx0 < 3; ridx0++) {
    int alu0 = (ridx0*-2);
    float val0 = data1[0];
    acc0 = (acc0+(data2[(alu0+5)]+val0));
    acc0 = (acc0+(data2[(alu0+4)]+val0));
  }
  data0[0] = acc0;
}
"""

_NAN_MAX = _PREAMBLE + """void kat_nan_max(float* restrict data0, const float* restrict data1) {
  float acc0 = -INFINITY;
  for (int ridx0 = 0; ridx0 < 2; ridx0++) {
    float val0 = data1[(ridx0*4)];
    acc0 = ((((acc0)!=(acc0)) | ((acc0)>(val0))) ? (acc0) : (val0));
    float val1 = data1[((ridx0*4)+1)];
    acc0 = ((((acc0)!=(acc0)) | ((acc0)>(val1))) ? (acc0) : (val1));
    float val2 = data1[((ridx0*4)+2)];
    acc0 = ((((acc0)!=(acc0)) | ((acc0)>(val2))) ? (acc0) : (val2));
    float val3 = data1[((ridx0*4)+3)];
    acc0 = ((((acc0)!=(acc0)) | ((acc0)>(val3))) ? (acc0) : (val3));
  }
  data0[0] = acc0;
}
"""


# an elementwise kernel's innermost loop as an `omp simd` loop (renderer/cvector.py): the flag set with the loop
# vectorizer on and no -fwrapv; 37 lanes leave a tail at every SIMD width
_SIMD_SELECT = _PREAMBLE + """void kat_simd_select(float* restrict data0, const float* restrict data1) {
  #pragma omp simd
  for (int lidx0 = 0; lidx0 < 37; lidx0++) {
    float val0 = data1[lidx0];
    data0[lidx0] = ((((val0!=val0) | (val0>0.5f)) ? val0 : 0.5f)+((val0<0.0f) ? (val0*2.0f) : val0));
  }
}
"""


def _simd_select(value: float) -> float:
  kept = value if math.isnan(value) or value > 0.5 else 0.5
  return kept + (value * 2.0 if value < 0.0 else value)


def _nan_max(values: Sequence[float]) -> float:
  return math.nan if any(math.isnan(value) for value in values) else max(values)


_ROWS = ((0, 1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 2.5))
_EIGHT = (0.25, 3.0, -1.0, 0.5, 0.75, 0.0, 9.0, 0.4)
_WITH_NAN = (1.0, 2.0, math.nan, 0.5, 7.0, -3.0, 1.0, 2.0)
_SIMD_INPUT = tuple((k * 0.37) % 2.0 - 1.0 for k in range(34)) + (math.nan, math.inf, -math.inf)

C_KNOWN_ANSWERS = (
  KnownAnswer("kat_any_rows", _ANY_ROWS, "bool", (
    ((("float", sum(_ROWS, ())),), tuple(_any(row) for row in _ROWS)),
    ((("float", (0, 1, 0, 0) * 3),), (True, True, True)),
  ), "any(-1): unsigned char max of comparisons"),
  KnownAnswer("kat_all_positive", _ALL_POSITIVE, "bool", (
    ((("float", (1.0, 2.0, 3.0, 5.0)),), (True,)),
    ((("float", (1.0, -2.0, 3.0, 5.0)),), (False,)),
  ), "all(): unsigned char max of negated comparisons"),
  KnownAnswer("kat_int_max_ne", _INT_MAX_OF_COMPARES, "int", (
    ((("int", (4, 1, 4, 3)),), (1,)),
    ((("int", (4, 4, 4, 4)),), (0,)),
  ), "(x != 4).int().max(): int max of comparisons"),
  KnownAnswer("kat_count_lt", _COUNT_COMPARES, "int", (
    ((("float", _EIGHT),), (sum(value < 0.5 for value in _EIGHT),)),
  ), "(x < 0.5).sum(): int sum of comparisons"),
  KnownAnswer("kat_flipped_sum", _FLIPPED_REDUCE, "float", (
    ((("float", (100.0,)), ("float", (0.0, 1.0, 2.0, 3.0, 4.0, 5.0))), (sum(100.0 + v for v in range(6)),)),
  ), "(x.flip(0) + s).sum(): unrolled reduce over a reversed view"),
  KnownAnswer("kat_nan_max", _NAN_MAX, "float", (
    ((("float", _WITH_NAN),), (_nan_max(_WITH_NAN),)),
    ((("float", _EIGHT),), (_nan_max(_EIGHT),)),
  ), "max(): float max that keeps NaN"),
  KnownAnswer("kat_simd_select", _SIMD_SELECT, "float", (
    ((("float", _SIMD_INPUT),), tuple(_simd_select(value) for value in _SIMD_INPUT)),
  ), "maximum/where in an `omp simd` loop with a tail"),
)


# ---------------------------------------------------------------- LLVM IR (as LLVMRenderer writes the same patterns)

_LLVM_ANY_ROWS = """define void @kat_any_rows(ptr noalias %data0, ptr noalias %data1) {
entry:
  br label %loop
loop:
  %row = phi i32 [ 0, %entry ], [ %next, %loop ]
  %base = mul i32 %row, 4
""" + "".join(f"""  %i{k} = add i32 %base, {k}
  %p{k} = getelementptr inbounds float, ptr %data1, i32 %i{k}
  %v{k} = load float, ptr %p{k}
  %c{k} = fcmp une float %v{k}, 0.0
  %u{k} = zext i1 %c{k} to i8
  %g{k} = icmp ugt i8 %a{k}, %u{k}
  %a{k + 1} = select i1 %g{k}, i8 %a{k}, i8 %u{k}
""" for k in range(4)).replace("%a0", "0") + """  %any = icmp ne i8 %a4, 0
  %out = getelementptr inbounds i8, ptr %data0, i32 %row
  %byte = zext i1 %any to i8
  store i8 %byte, ptr %out
  %next = add i32 %row, 1
  %done = icmp eq i32 %next, 3
  br i1 %done, label %exit, label %loop
exit:
  ret void
}
"""

_LLVM_INT_MAX = """define void @kat_int_max_ne(ptr noalias %data0, ptr noalias %data1) {
entry:
""" + "".join(f"""  %p{k} = getelementptr inbounds i32, ptr %data1, i32 {k}
  %v{k} = load i32, ptr %p{k}
  %c{k} = icmp ne i32 %v{k}, 4
  %u{k} = zext i1 %c{k} to i32
  %g{k} = icmp sgt i32 %a{k}, %u{k}
  %a{k + 1} = select i1 %g{k}, i32 %a{k}, i32 %u{k}
""" for k in range(4)).replace("%a0", "-2147483648") + """  store i32 %a4, ptr %data0
  ret void
}
"""

LLVM_KNOWN_ANSWERS = (
  KnownAnswer("kat_any_rows", _LLVM_ANY_ROWS, "bool", C_KNOWN_ANSWERS[0].cases, C_KNOWN_ANSWERS[0].pattern),
  KnownAnswer("kat_int_max_ne", _LLVM_INT_MAX, "int", C_KNOWN_ANSWERS[2].cases, C_KNOWN_ANSWERS[2].pattern),
)


# ---------------------------------------------------------------- running them

def _same(value: float | int | bool, want: float | int | bool) -> bool:
  if isinstance(want, float) and math.isnan(want): return math.isnan(value)
  if isinstance(want, float): return math.isclose(value, want, rel_tol=1e-6, abs_tol=1e-6)
  return value == want


def run_known_answer(function: Callable, known: KnownAnswer) -> list[str]:
  """Call a loaded kernel on each case; a description of each wrong answer (empty: all right)."""
  wrong = []
  for inputs, expected in known.cases:
    output = (CTYPES[known.output] * len(expected))()
    arrays = [(CTYPES[ctype] * len(values))(*values) for ctype, values in inputs]
    function(ctypes.cast(output, ctypes.c_void_p), *(ctypes.cast(array, ctypes.c_void_p) for array in arrays))
    got = list(output)
    if not all(_same(value, want) for value, want in zip(got, expected)):
      wrong.append(f"{known.name} ({known.pattern}): got {got}, want {list(expected)} for inputs "
                   f"{[list(values) for _, values in inputs]}")
  return wrong


def wrong_answers(known_answers: Sequence[KnownAnswer], load: Callable[[Sequence[KnownAnswer]], dict[str, Callable]]
                  ) -> list[str]:
  """Build the kernels with `load` (kernels -> {name: callable}) and run every case; the wrong answers."""
  functions = load(known_answers)
  return [line for known in known_answers for line in run_known_answer(functions[known.name], known)]


def run_with_safe_fallback(known_answers: Sequence[KnownAnswer],
                           load: Callable[[Sequence[KnownAnswer]], dict[str, Callable]],
                           set_safe: Callable[[bool], None]) -> tuple[str, list[str]]:
  """The verdict ("ok", "safe" or "broken") and the wrong answers of the usual flags: the kernels run as built
  usually; if any answer is wrong, once more with the compiler's safe flags (`set_safe(True)`, undone after)."""
  wrong = wrong_answers(known_answers, load)
  if not wrong: return "ok", []
  set_safe(True)
  try:
    still_wrong = wrong_answers(known_answers, load)
  finally:
    set_safe(False)
  return ("broken", still_wrong) if still_wrong else ("safe", wrong)


def refuse_target_host_cannot_run(setting: str, variable: str, missing: list[str]) -> None:
  """A DeviceError naming the target (`setting`, e.g. "CLANG_MARCH='x86-64-v4'"), the CPU features this CPU lacks
  and the variable to change, where `missing` is not empty. Checked when the compiler is made, before this
  self-test, the first code built for the target, runs: an illegal instruction (SIGILL) kills the process with no
  Python error (a crashed pytest worker), and a verdict cached on another machine would let the kernels run."""
  if not missing: return
  raise DeviceError(f"{setting} builds code for CPU features this CPU lacks ({', '.join(missing)}): it would die of "
                    f"SIGILL (illegal instruction). Use a target this CPU runs ({variable}=native, or a lower level "
                    f"such as x86-64-v3), or a CPU with these features")


# ---------------------------------------------------------------- the cached verdict

VERDICTS = ("ok", "safe", "broken")   # right as chosen; right only with the safe flags; wrong even then


def _verdict_path(toolchain_key: str) -> pathlib.Path:
  digest = hashlib.sha256(f"self-test v{SELF_TEST_VERSION}\n{toolchain_key}".encode()).hexdigest()
  return cache_dir() / "toolchain" / f"{digest[:32]}.json"


def cached_verdict(toolchain_key: str) -> tuple[str, list[str]] | None:
  """The verdict stored for this toolchain and the wrong answers it saw, or None (never tested, unreadable, or the
  cache is off)."""
  if DISABLE_COMPILER_CACHE: return None
  try:
    record = json.loads(_verdict_path(toolchain_key).read_text())
  except (OSError, ValueError):
    return None
  if not isinstance(record, dict) or record.get("verdict") not in VERDICTS: return None
  return record["verdict"], list(record.get("wrong", []))


def store_verdict(toolchain_key: str, verdict: str, wrong: list[str]) -> None:
  """Remember a verdict (best effort: an unwritable cache folder only costs the test again next process)."""
  if DISABLE_COMPILER_CACHE: return
  record = {"verdict": verdict, "wrong": wrong, "toolchain": toolchain_key}
  try:
    write_atomic(_verdict_path(toolchain_key), json.dumps(record, indent=1).encode(), durable=False)
  except OSError:
    pass


def verdict_for(toolchain_key: str, run_self_test: Callable[[], tuple[str, list[str]]]) -> tuple[str, list[str]]:
  """The verdict of this toolchain and its wrong answers: the stored one, else `run_self_test()`'s, then stored."""
  cached = cached_verdict(toolchain_key)
  if cached is not None: return cached
  verdict, wrong = run_self_test()
  store_verdict(toolchain_key, verdict, wrong)
  return verdict, wrong
