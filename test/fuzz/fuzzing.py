"""Shared machinery of the fuzzers in test/fuzz: seeds, per-case random generators, the pytest and CLI runners.

A fuzz run is (seed, iterations). Case `i` of seed `s` draws every random choice from `case_rng(s, i)`, a
`random.Random` seeded with the string f"{s}:{i}" (string seeds are hashed with SHA-512, so they are the same on
every machine and Python version). Cases do not depend on each other, so

    python test/fuzz/fuzz_x.py --seed S --iterations N     runs cases 0..N-1 of seed S, exactly as pytest did
    python test/fuzz/fuzz_x.py --seed S --case I           replays the one failing case I, printing what it built

Under pytest each fuzzer runs a few fixed seeds plus one random seed; set FUZZ_SEED=S to choose that seed, and
FUZZ_SCALE=K to run K times each test's number of cases (CI's budget is the default, 1). The
seed is printed in the test output and is part of every failure message, with the command that replays it.
"""
from __future__ import annotations

import argparse
import os
import functools
import random
import subprocess
import sys
import time
import traceback
from collections import Counter
from typing import Any, Callable

import numpy as np

from ourgrad.shape.symbolic import AndNode, DivNode, LtNode, ModNode, MulNode, Node, NumNode, SumNode, Variable

# a check returns a short outcome label ("ok", "ok: empty", ...) or a dict of counts, which the runners add up
Check = Callable[["Case"], "str | dict[str, int]"]


class Case:
  """One fuzz case: its random generator and a log of what it built (printed when the case fails)."""

  def __init__(self, fuzzer: str, seed: int, index: int, replay_args: str = ""):
    self.fuzzer, self.seed, self.index, self.replay_args = fuzzer, seed, index, replay_args
    self.rng = case_rng(seed, index)
    self.notes: list[str] = []

  def log(self, text: str) -> None:
    self.notes.append(text)

  @property
  def replay(self) -> str:
    return f"python test/fuzz/{self.fuzzer}.py --seed {self.seed} --case {self.index}{self.replay_args}"


class FuzzFailure(AssertionError):
  """A fuzz case failed; the message names the seed, the case, the replay command and what the case built.
  With --keep-going, `outcomes` holds the counts of every outcome of the run."""
  outcomes: Counter[str] = Counter()


def case_rng(seed: int, index: int) -> random.Random:
  return random.Random(f"{seed}:{index}")


def random_seed() -> int:
  """FUZZ_SEED from the environment, else a fresh random seed."""
  value = os.environ.get("FUZZ_SEED", "")
  return int(value) if value else random.randrange(2**32)


def run_cases(fuzzer: str, check: Check, seed: int, iterations: int, start: int = 0,
              keep_going: bool = False, verbose: bool = False, replay_args: str = "") -> Counter[str]:
  """Run cases start..start+iterations-1 of `seed`; raise FuzzFailure on the first failure (or, with keep_going,
  print every failure and raise once at the end). Returns the count of each outcome label."""
  outcomes: Counter[str] = Counter()
  failures: list[str] = []
  for index in range(start, start + iterations):
    case = Case(fuzzer, seed, index, replay_args)
    try:
      outcome = check(case)
      if isinstance(outcome, str): outcomes[outcome] += 1
      else: outcomes.update(outcome)
    except Exception as error:  # noqa: BLE001 - any exception in a case is a finding
      message = _failure_message(case, error)
      if not keep_going: raise FuzzFailure(message) from error
      print(message, file=sys.stderr)
      failures.append(f"case {index}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
      kind = getattr(error, "kind", None)  # a fuzzer's failures may say which kind they are (fuzz_torch)
      outcomes[f"FAILED: {kind}" if kind else "FAILED"] += 1
    if verbose: print("\n".join(case.notes))
  if failures:
    failure = FuzzFailure(f"{fuzzer}: {len(failures)} of {iterations} cases of seed {seed} failed:\n"
                          + "\n".join(failures))
    failure.outcomes = outcomes
    raise failure
  return outcomes


def _failure_message(case: Case, error: Exception) -> str:
  notes = "\n".join(case.notes)
  trace = "".join(traceback.format_exception(type(error), error, error.__traceback__, limit=-4))
  return (f"{case.fuzzer}: seed {case.seed} case {case.index} failed (FUZZ_SEED={case.seed} reruns the seed)\n"
          f"replay: {case.replay}\n--- the case ---\n{notes}\n--- error ---\n{trace}")


def scaled_iterations(iterations: int) -> int:
  """A test's number of cases times FUZZ_SCALE (default 1: CI's budget), at least one."""
  return max(1, round(iterations * float(os.environ.get("FUZZ_SCALE", "") or 1)))


def run_for_pytest(fuzzer: str, check: Check, seed: int, iterations: int, replay_args: str = "") -> Counter[str]:
  """The pytest entry point: print the seed first (pytest shows it with the failure), then run. `replay_args` are
  the command-line options that make the script run exactly this test's cases (e.g. " --devices PYTHON").
  `iterations` is CI's budget, scaled by FUZZ_SCALE."""
  iterations = scaled_iterations(iterations)
  print(f"{fuzzer}: seed {seed}, {iterations} cases; replay: python test/fuzz/{fuzzer}.py --seed {seed} "
        f"--iterations {iterations}{replay_args} (or FUZZ_SEED={seed} for the random-seed tests)")
  outcomes = run_cases(fuzzer, check, seed, iterations, replay_args=replay_args)
  print(f"{fuzzer}: seed {seed}: {dict(outcomes)}")
  return outcomes


def main(fuzzer: str, make_check: Callable[[argparse.Namespace], Check], default_iterations: int,
         add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> None:
  """Command line of a fuzzer: --seed, --iterations, --case, --keep-going, --verbose, plus its own options."""
  parser = argparse.ArgumentParser(description=f"{fuzzer}: see the module docstring")
  parser.add_argument("--seed", type=int, default=None, help="seed (default: FUZZ_SEED or random)")
  parser.add_argument("--iterations", "--cases", type=int, default=default_iterations, help="number of cases")
  parser.add_argument("--case", type=int, default=None, help="replay only this case of the seed (prints it)")
  parser.add_argument("--keep-going", action="store_true", help="report every failing case, not only the first")
  parser.add_argument("--verbose", action="store_true", help="print what every case built")
  if add_arguments is not None: add_arguments(parser)
  args = parser.parse_args()
  seed = args.seed if args.seed is not None else random_seed()
  check = make_check(args)
  start, iterations = (args.case, 1) if args.case is not None else (0, args.iterations)
  print(f"{fuzzer}: seed {seed}, cases {start}..{start + iterations - 1}")
  began = time.perf_counter()
  try:
    outcomes = run_cases(fuzzer, check, seed, iterations, start, args.keep_going, args.verbose or args.case is not None)
  except FuzzFailure as failure:
    print(failure, file=sys.stderr)
    print(f"{fuzzer}: {iterations} cases in {time.perf_counter() - began:.1f} s: {dict(failure.outcomes)}")
    sys.exit(1)
  print(f"{fuzzer}: {iterations} cases in {time.perf_counter() - began:.1f} s: {dict(outcomes)}")


def evaluate_vectorized(node: Node, env: dict[str, Any]) -> Any:
  """A symbolic Node evaluated on numpy arrays of variable values (floor division and modulo, like `evaluate`).

  Equivalent to calling `node.evaluate` per element, but one numpy operation per node: fast enough to check every
  element of a view."""
  if isinstance(node, NumNode): return np.int64(node.b)
  if isinstance(node, Variable): return np.asarray(env[node.expr], dtype=np.int64)
  if isinstance(node, MulNode): return evaluate_vectorized(node.a, env) * node.b
  if isinstance(node, DivNode): return evaluate_vectorized(node.a, env) // node.b
  if isinstance(node, ModNode): return evaluate_vectorized(node.a, env) % node.b
  if isinstance(node, SumNode):
    total: Any = np.int64(0)
    for term in node.nodes: total = total + evaluate_vectorized(term, env)
    return total
  if isinstance(node, LtNode):
    bound = evaluate_vectorized(node.b, env) if not isinstance(node.b, int) else node.b
    return (evaluate_vectorized(node.a, env) < bound).astype(np.int64)
  if isinstance(node, AndNode):
    result: Any = np.int64(1)
    for operand in node.nodes: result = result * (evaluate_vectorized(operand, env) != 0)
    return np.asarray(result, dtype=np.int64)
  raise TypeError(f"unknown node type {type(node).__name__}")


def prime_factors(value: int) -> list[int]:
  factors, divisor = [], 2
  while value > 1:
    while value % divisor == 0:
      factors.append(divisor)
      value //= divisor
    divisor += 1
  return factors


def random_shrink_bounds(rng: random.Random, shape: tuple[int, ...]) -> list[tuple[int, int]]:
  """A random (start, end) per dim of `shape` for a shrink: non-empty where the dim is, anywhere inside it."""
  bounds = []
  for size in shape:
    start = rng.randint(0, max(size - 1, 0))
    bounds.append((start, rng.randint(min(start + 1, size), size)))
  return bounds


def random_factorization(rng: random.Random, size: int, max_ndim: int = 8) -> tuple[int, ...]:
  """A random shape with `size` elements and at most max_ndim dims, size-1 dims sprinkled in (a 0 somewhere when
  size is 0)."""
  if size == 0:
    shape = [rng.choice([1, 2, 3]) for _ in range(rng.randint(0, min(3, max_ndim - 1)))]
    shape.insert(rng.randint(0, len(shape)), 0)
  else:
    factors = prime_factors(size)
    rng.shuffle(factors)
    ndim = rng.randint(1, min(len(factors) + 1, max_ndim)) if factors else 0
    shape = [1] * ndim
    for factor in factors: shape[rng.randrange(ndim)] *= factor
  for _ in range(rng.choice([0, 0, 0, 1, 2])):
    if len(shape) < max_ndim: shape.insert(rng.randint(0, len(shape)), 1)
  return tuple(shape)


@functools.lru_cache(maxsize=None)
def c_compiler_is_gcc(major: int) -> bool:
  """Whether the CLANG device compiles with gcc of this major version (False when it has no compiler)."""
  from ourgrad.errors import DeviceError
  try:
    from ourgrad.runtime.ops_clang import find_c_compiler
    compiler = find_c_compiler()
  except DeviceError:
    return False
  banner = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.lower()
  version = subprocess.run([compiler, "-dumpversion"], capture_output=True, text=True).stdout.strip()
  return "clang" not in banner and version.split(".")[0] == str(major)
