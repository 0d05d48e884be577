"""Differential fuzzing against PyTorch: random ourgrad programs and the same programs in PyTorch (CPU).

Each case draws a random program with `torchprograms.TorchGen` (read its docstring for what the steps cover and
the semantics it keeps to): elementwise ops, promotions with Python scalars and 0-d tensors, reduces, movement,
indexing, in-place writes interleaved with lazy reads and realizes, and a backward pass. PyTorch runs it eagerly
(the reference), ourgrad runs it on the chosen device, and every `observe()` of the program must agree:

  shape    the shapes differ
  dtype    the dtypes differ
  value    the values differ: ints and bools exactly; floats bitwise (the sign of zero too, unless a sum, max, relu
           ... could give either) where the value is exact (no rounding anywhere in its history), else within
           2e-4 (float32) or 2e-2 (a float16 anywhere in its history) of its scale (the largest magnitude in its
           history); a gradient that is None in one library and not the other is a value mismatch too
  crash    ourgrad raised where PyTorch ran the step
  silent   PyTorch raised (a shape or in-place dtype error) and ourgrad ran the step without complaint

A failing program is minimized (steps dropped, inputs shrunk, while the same kind of mismatch persists) and printed
as two standalone scripts, ourgrad's and PyTorch's. Known bugs (KNOWN_BUGS, each with the finding it was filed
as) are tagged rather than failed under `--skip-known`; the pytest entry never skips them.

Run: `python test/fuzz/fuzz_torch.py --cases 500 --seed 1 [--device PYTHON] [--skip-known] [--keep-going] [--avoid ci]`;
`--case I` replays one case and prints its program. The summary counts programs by outcome; the exit code is 1
when any case failed. On a GPU machine: `DEVICE=CUDA python test/fuzz/fuzz_torch.py --cases 500 --seed 1`.
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fuzzing import Case, Check, main, run_for_pytest  # noqa: E402
from torchprograms import (AVOIDABLE, Observation, Outcome, Program, random_program, run_ourgrad,  # noqa: E402
                           run_torch)

from ourgrad.device import Device  # noqa: E402


class Mismatch(AssertionError):
  """ourgrad and PyTorch disagree on a program; `kind` is one of shape, dtype, value, crash, silent."""

  def __init__(self, kind: str, message: str):
    super().__init__(message)
    self.kind = kind


# ---------------------------------------------------------------- comparing what the two libraries did

def compare_observation(expected: Observation, got: Observation) -> Mismatch | None:
  """A mismatch of None-ness (a gradient), shape or dtype; values are compare_values' job."""
  label = expected.label
  if (expected.value is None) != (got.value is None):
    return Mismatch("value", f"{label}: PyTorch gives {_describe(expected)}, ourgrad {_describe(got)}")
  if expected.value is None or got.value is None: return None
  if expected.shape != got.shape:
    return Mismatch("shape", f"{label}: shape {got.shape}, PyTorch {expected.shape}")
  if expected.dtype != got.dtype:
    return Mismatch("dtype", f"{label}: dtype {got.dtype}, PyTorch {expected.dtype}")
  return None


def compare_values(label: str, expected: np.ndarray, got: np.ndarray, exact: bool, scale: float,
                   signed_zeros: bool = True, relative: float = 2e-4) -> str | None:
  """Why `got` is not `expected` (None when it is): see the module docstring for the tolerance."""
  if expected.dtype.kind != "f":
    bad = expected != got
  else:
    want, have = expected.astype(np.float64), got.astype(np.float64)
    both_nan = np.isnan(want) & np.isnan(have)
    if exact:
      bad = ~both_nan & (want != have)
      if signed_zeros: bad |= ~both_nan & (np.signbit(want) != np.signbit(have))
    else:
      tolerance = relative * scale
      with np.errstate(invalid="ignore"):
        bad = ~both_nan & ~(np.abs(want - have) <= tolerance) & ~(want == have)
  if not np.any(bad): return None
  where = tuple(int(i) for i in np.argwhere(bad)[0]) if bad.ndim else ()
  how = "bitwise" if exact or expected.dtype.kind != "f" else f"within {relative * scale:.3g}"
  return (f"{label}: {int(np.sum(bad))} of {bad.size} elements differ ({how}); first at {where}: ourgrad "
          f"{got[where]!r}, PyTorch {expected[where]!r}\n  ourgrad {np.array2string(got, threshold=24)}\n"
          f"  PyTorch {np.array2string(expected, threshold=24)}")


def _describe(observation: Observation) -> str:
  return "None" if observation.value is None else f"a {observation.dtype} tensor of shape {observation.shape}"


def compare_outcomes(program: Program, reference: Outcome, ours: Outcome) -> Mismatch | None:
  """The first disagreement of ourgrad's run with PyTorch's, or None."""
  if ours.error_step is not None:
    error = ours.error
    first = str(error).splitlines()[0] if str(error) else ""
    return Mismatch("crash", f"step {ours.error_step}: {program.steps[ours.error_step].og}\n  ourgrad raised "
                             f"{type(error).__name__}: {first}")
  if ours.silent_steps:
    index = ours.silent_steps[0]
    return Mismatch("silent", f"step {index}: {program.steps[index].og}\n  PyTorch raises on it "
                              f"({program.steps[index].pt}); ourgrad ran it without an error")
  observe_steps = [step for step in program.steps if step.kind == "observe"]
  for step, expected, got in zip(observe_steps, reference.observations, ours.observations):
    found = compare_observation(expected, got)
    if found is not None: return found
    if expected.value is None or got.value is None: continue
    problem = compare_values(expected.label, expected.value, got.value, step.exact, step.scale, step.signed_zeros,
                             step.tolerance)
    if problem is not None: return Mismatch("value", problem)
  return None


def check_program(program: Program) -> Mismatch | None:
  """Run the program on both libraries; the first mismatch, or None. ValueError when PyTorch itself fails (the
  program is not valid: only during minimization)."""
  reference = run_torch(program)
  if reference.error_step is not None or reference.silent_steps:
    raise ValueError(f"PyTorch fails at step {reference.error_step}: {reference.error!r}")
  return compare_outcomes(program, reference, run_ourgrad(program))


# ---------------------------------------------------------------- minimizing a failing program

def minimize(program: Program, kind: str, budget_s: float = 60.0) -> Program:
  """Drop steps and shrink inputs while a mismatch of `kind` persists (at most `budget_s` seconds)."""
  deadline = time.perf_counter() + budget_s

  def still_fails(candidate: Program) -> bool:
    if time.perf_counter() > deadline: return False
    try:
      found = check_program(candidate)
    except ValueError:
      return False
    return found is not None and found.kind == kind

  steps = list(program.steps)
  chunk = max(1, len(steps) // 2)
  while chunk >= 1:
    start = 0
    while start < len(steps):
      candidate = replace(program, steps=steps[:start] + steps[start + chunk:])
      if still_fails(candidate): steps = candidate.steps
      else: start += chunk
    chunk //= 2
  program = replace(program, steps=steps)
  program = _shrink_inputs(program, still_fails)
  return _drop_unused_inputs(program)


def _shrink_inputs(program: Program, still_fails: Callable[[Program], bool]) -> Program:
  for index in range(len(program.inputs)):
    for axis in range(program.inputs[index].ndim):
      for size in (1, 2, program.inputs[index].shape[axis] - 1):
        array = program.inputs[index]
        if not 0 < size < array.shape[axis]: continue
        inputs = list(program.inputs)
        inputs[index] = np.ascontiguousarray(np.take(array, range(size), axis=axis))
        candidate = replace(program, inputs=inputs)
        if still_fails(candidate):
          program = candidate
          break
  return program


def _drop_unused_inputs(program: Program) -> Program:
  """Renumber `inputs[i]` so the reproducer lists only the arrays its steps read."""
  used = sorted({int(found) for step in program.steps for found in re.findall(r"inputs\[(\d+)\]", step.og + step.pt)})
  renumber = {old: new for new, old in enumerate(used)}

  def rewrite(code: str) -> str:
    return re.sub(r"inputs\[(\d+)\]", lambda match: f"inputs[{renumber[int(match.group(1))]}]", code)
  steps = [replace(step, og=rewrite(step.og), pt=rewrite(step.pt)) for step in program.steps]
  return replace(program, inputs=[program.inputs[old] for old in used], steps=steps)


def reproducer(program: Program, mismatch: Mismatch) -> str:
  return (f"--- mismatch ({mismatch.kind}) ---\n{mismatch}\n--- ourgrad ---\n{program.source('ourgrad')}\n"
          f"--- PyTorch ---\n{program.source('torch')}")


# ---------------------------------------------------------------- known bugs

@dataclass(frozen=True)
class KnownBug:
  """A bug filed in /work/briefs/fuzz_findings.md and not fixed yet: the mismatch kind and a pattern that the
  minimized reproducer (the mismatch message plus ourgrad's script) matches."""
  name: str
  kind: str
  pattern: str

  def matches(self, mismatch: Mismatch, program: Program) -> bool:
    text = f"{mismatch}\n{program.source('ourgrad')}"
    return mismatch.kind == self.kind and re.search(self.pattern, text, re.DOTALL) is not None


# a view taken before a write to its base (the base followed by a movement op, then the base written)
_VIEW_THEN_WRITE = (r"\n(v\d+) = (v\d+)(\[|\.shrink|\.reshape|\.permute|\.transpose|\.expand|\.squeeze|\.unsqueeze"
                    r"|\.detach|\.flip|\.pad|\.int\(|\.float\(|\.half\(|\.long\(|\.bool\(|\.cast\().*"
                    r"\n\2( [-+*]?= |\.assign\(|\[)")

# a view written to (the view made by a movement op, then written)
_WRITE_TO_VIEW = (r"\n(v\d+) = (v\d+)(\[|\.shrink|\.reshape|\.permute|\.transpose|\.expand|\.squeeze|\.unsqueeze"
                  r"|\.detach|\.contiguous\(|\.int\(|\.float\(|\.half\(|\.long\(|\.bool\(|\.cast\().*"
                  r"\n\1( [-+*]?= |\.assign\(|\[)")

KNOWN_BUGS: list[KnownBug] = [
  KnownBug("stale-view", "value", _VIEW_THEN_WRITE),
  KnownBug("inplace-cast", "silent", r"step \d+: v\d+ [-+*]= "),
  KnownBug("view-write", "value", _WRITE_TO_VIEW),
  KnownBug("zero-d-promotion", "dtype", r"reshape\(\(\)\)|\.sum\(|\.amax\(|\.amin\(|\.max\(|\.min\(|\[-?\d+\]"),
  KnownBug("constant-write", "value", r"Tensor\.(full|zeros|ones)\(.*( [-+*]?= |\.assign\(|\] = )"),
  KnownBug("float-mod-multiple", "value", r" % "),
  KnownBug("negative-zero-rounding", "value", r"ourgrad np\.float\d+\(-?0\.0\), PyTorch np\.float\d+\(-?0\.0\).*"
           r"(\.(ceil|trunc|round)\(\)| // )"),
]


def known_bug(mismatch: Mismatch, program: Program) -> KnownBug | None:
  return next((bug for bug in KNOWN_BUGS if bug.matches(mismatch, program)), None)


# ---------------------------------------------------------------- the check, pytest and the command line

def make_check(device: str, skip_known: bool = False, minimize_s: float = 60.0, grad: bool = True,
               avoid: frozenset[str] = frozenset()) -> Check:
  def check_case(case: Case) -> str:
    gen, program = random_program(case.rng, device, grad=grad, avoid=avoid)
    case.log(program.source("ourgrad"))
    mismatch = check_program(program)
    if mismatch is None: return "ok"
    if minimize_s > 0: program = minimize(program, mismatch.kind, minimize_s)
    final = check_program(program) or mismatch
    bug = known_bug(final, program)
    if skip_known and bug is not None:
      print(f"case {case.index}: known bug {bug.name}", file=sys.stderr)
      return f"known: {bug.name}"
    case.notes.clear()
    raise Mismatch(final.kind, reproducer(program, final))
  return check_case


def default_device() -> str:
  return Device.DEFAULT


# CI budget: programs per test run (CLANG compiles each kernel with the C compiler, ~0.3 CPU-s a program; PYTHON
# interprets); FUZZ_SCALE=3 runs 150 a seed, as CI did before session 18
CASES = {"CLANG": 50, "PYTHON": 80}
# constructs of bugs still open (torchprograms.AVOIDABLE; the bugs are in KNOWN_BUGS): CI does not generate them,
# so that it fails on new bugs only. Add a name while its bug is open, take it out when the bug is fixed. Every bug
# of KNOWN_BUGS is fixed on main (d8e276f): CI generates everything.
CI_AVOID: frozenset[str] = frozenset()


@pytest.mark.parametrize("seed", [0, 1])
def test_torch_differential(seed: int) -> None:
  device = default_device()
  run_for_pytest("fuzz_torch", make_check(device, avoid=CI_AVOID), seed, CASES.get(device, 30),
                 f" --device {device} --avoid ci")


if __name__ == "__main__":
  def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="ourgrad device (default: DEVICE or the default device)")
    parser.add_argument("--skip-known", action="store_true", help="tag mismatches of known bugs instead of failing")
    parser.add_argument("--minimize-s", type=float, default=60.0, help="seconds to minimize a failure (0: off)")
    parser.add_argument("--no-grad", action="store_true", help="no requires_grad leaves and no backward")
    parser.add_argument("--avoid", default="", help="comma-separated constructs of known bugs not to generate "
                        f"({', '.join(AVOIDABLE)}; 'ci' stands for CI_AVOID)")

  def make_check_from_args(args: argparse.Namespace) -> Any:
    device = args.device or default_device()
    print(f"device: {device}")
    names = {name for name in args.avoid.split(",") if name}
    avoid = frozenset(names - {"ci"}) | (CI_AVOID if "ci" in names else frozenset())
    unknown = avoid - set(AVOIDABLE)
    if unknown: raise SystemExit(f"unknown --avoid names {sorted(unknown)}; known: {', '.join(AVOIDABLE)}")
    return make_check(device, args.skip_known, args.minimize_s, not args.no_grad, avoid)

  main("fuzz_torch", make_check_from_args, 200, add_arguments)
