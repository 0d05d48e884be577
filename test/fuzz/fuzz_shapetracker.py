"""Fuzz ShapeTracker: random chains of movement ops checked element by element against numpy.

Each case picks a random shape (0 to 5 dims, sizes 0 to 6, size-0 and size-1 dims included) and a chain of 1 to 16
movement ops: reshape to a random factorization (size-1 dims inserted anywhere), permute, expand (size-1 dims to
any size, 0 included), pad, shrink (empty windows included), flip, each applied both to a ShapeTracker and to
`np.arange(size)` (padding as the sentinel -1). Then, for the tracker, its `simplify()`, and its composition
from the chain cut at random points (`st1 + st2`, both `(st1 + st2) + st3` and `st1 + (st2 + st3)`, and the
unsimplified stack of views):
  - `expr_idxs()` (per-dim indices) and `expr_node()` (one flat index) evaluated for every element: valid exactly
    where numpy is not padding, and there the index equals numpy's element, inside the buffer;
  - the index and validity values lie inside the nodes' `min`/`max` bounds, for every element;
  - a few elements evaluated with `Node.evaluate` too (the vectorized evaluator must agree with it);
  - `real_size()` covers every valid index, `real_strides()` steps match numpy between neighbouring valid
    elements, a dim that `axis_is_masked` says is unmasked has padding constant along it;
  - `simplify()` and composition never add views.

Run: `python test/fuzz/fuzz_shapetracker.py --iterations 10000 --seed N`; `--case I` replays one case.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fuzzing import Case, evaluate_vectorized, main, random_factorization, random_seed, run_for_pytest  # noqa: E402

from ourgrad.helpers import prod  # noqa: E402
from ourgrad.shape import ShapeTracker  # noqa: E402
from ourgrad.shape.symbolic import Node  # noqa: E402

PAD = -1
MAX_ELEMENTS = 720
MovementOp = tuple[str, Any]


# ---------------------------------------------------------------- random movement ops

def random_shape(rng: random.Random) -> tuple[int, ...]:
  ndim = rng.choice([0, 1, 1, 2, 2, 3, 3, 4, 5])
  return tuple(0 if rng.random() < 0.02 else rng.choice([1, 1, 2, 3, 4, 5, 6]) for _ in range(ndim))


def random_op(rng: random.Random, shape: tuple[int, ...]) -> MovementOp:
  ndim = len(shape)
  name = rng.choice(["reshape", "reshape", "permute", "expand", "pad", "shrink", "flip"])
  if name == "reshape": return name, random_factorization(rng, prod(shape))
  if name == "permute":
    axes = list(range(ndim))
    rng.shuffle(axes)
    return name, tuple(axes)
  if name == "expand":
    if 1 not in shape:  # make a size-1 dim to expand next time
      axis = rng.randint(0, ndim)
      return "reshape", shape[:axis] + (1,) + shape[axis:]
    return name, tuple((rng.choice([1, 2, 3, 4, 4]) if rng.random() < 0.97 else 0) if size == 1 else size
                       for size in shape)
  if name == "pad": return name, tuple((rng.choice([0, 0, 1, 2, 3]), rng.choice([0, 0, 1, 2, 3])) for _ in shape)
  if name == "shrink":
    bounds = []
    for size in shape:
      if size == 0 or rng.random() < 0.02:  # an empty window now and then
        start = rng.randint(0, size)
        bounds.append((start, start))
        continue
      start = rng.randint(0, size - 1)
      bounds.append((start, rng.randint(start + 1, size)))
    return name, tuple(bounds)
  return name, tuple(rng.random() < 0.5 for _ in shape)


def apply_numpy(array: np.ndarray, op: MovementOp) -> np.ndarray:
  name, arg = op
  if name == "reshape": return array.reshape(arg)
  if name == "permute": return array.transpose(arg)
  if name == "expand": return np.broadcast_to(array, arg)
  if name == "pad": return np.pad(array, arg, constant_values=PAD) if arg else array
  if name == "shrink": return array[tuple(slice(start, end) for start, end in arg)]
  flipped = tuple(axis for axis, flag in enumerate(arg) if flag)
  return np.flip(array, axis=flipped) if flipped else array


def apply_ops(tracker: ShapeTracker, ops: list[MovementOp]) -> ShapeTracker:
  for name, arg in ops: tracker = getattr(tracker, name)(arg)
  return tracker


def random_chain(rng: random.Random, shape: tuple[int, ...]) -> list[MovementOp]:
  ops: list[MovementOp] = []
  array = np.zeros(shape, dtype=np.int8)
  for _ in range(rng.randint(1, 16)):
    for _attempt in range(10):
      op = random_op(rng, array.shape)
      result = apply_numpy(array, op)
      if result.size <= MAX_ELEMENTS: break
    else:
      continue
    ops.append(op)
    array = result
  return ops


# ---------------------------------------------------------------- checks

def _bounds_hold(node: Node, values: np.ndarray) -> bool:
  return values.size == 0 or (node.min <= values.min() and values.max() <= node.max)


def check_tracker(tracker: ShapeTracker, expected: np.ndarray, buffer_size: int, label: str,
                  rng: random.Random) -> None:
  """Every element of `tracker` against numpy's `expected` (arange of the buffer, PAD where padded)."""
  where = f"{label}: {tracker}"
  assert tracker.shape == expected.shape, f"{where}: shape {tracker.shape} != numpy {expected.shape}"
  index, valid = tracker.expr_idxs()
  flat_index, flat_valid = tracker.expr_node()
  if expected.size == 0:
    assert tracker.real_size() == 0, f"{where}: real_size of an empty view is {tracker.real_size()}"
    return
  positions = np.indices(expected.shape, dtype=np.int64)
  env = {f"idx{dim}": positions[dim] for dim in range(expected.ndim)}
  index_values = np.broadcast_to(evaluate_vectorized(index, env), expected.shape)
  valid_values = np.broadcast_to(evaluate_vectorized(valid, env), expected.shape)
  padding = expected == PAD
  assert _bounds_hold(index, index_values), f"{where}: index {index.render()} leaves [{index.min}, {index.max}]"
  assert _bounds_hold(valid, valid_values), f"{where}: valid {valid.render()} leaves [{valid.min}, {valid.max}]"
  assert set(np.unique(valid_values)) <= {0, 1}, f"{where}: valid {valid.render()} is not boolean"
  wrong_valid = np.argwhere((valid_values == 1) == padding)
  assert wrong_valid.size == 0, (f"{where}: validity wrong at {tuple(wrong_valid[0])}: valid={valid.render()}, numpy "
                                 f"{'pads' if padding[tuple(wrong_valid[0])] else 'has an element'} there")
  wrong_index = np.argwhere(~padding & (index_values != expected))
  assert wrong_index.size == 0, (f"{where}: index wrong at {tuple(wrong_index[0])}: {index.render()} gives "
                                 f"{index_values[tuple(wrong_index[0])]}, numpy {expected[tuple(wrong_index[0])]}")
  assert ((expected[~padding] >= 0) & (expected[~padding] < buffer_size)).all()
  # the flat form of the same expressions
  flat_env = {"idx": np.arange(expected.size, dtype=np.int64).reshape(expected.shape)}
  flat_index_values = np.broadcast_to(evaluate_vectorized(flat_index, flat_env), expected.shape)
  flat_valid_values = np.broadcast_to(evaluate_vectorized(flat_valid, flat_env), expected.shape)
  assert ((flat_valid_values == 1) == ~padding).all(), f"{where}: flat valid {flat_valid.render()} wrong"
  assert (flat_index_values[~padding] == expected[~padding]).all(), f"{where}: flat index {flat_index.render()} wrong"
  assert _bounds_hold(flat_index, flat_index_values), f"{where}: flat index leaves its bounds"
  # the vectorized evaluator must agree with Node.evaluate (the definition): spot-check a few elements
  for _ in range(3):
    position = tuple(rng.randrange(size) for size in expected.shape)
    values = {f"idx{dim}": value for dim, value in enumerate(position)}
    assert valid.evaluate(values) == valid_values[position], f"{where}: evaluate disagrees at {position}"
    if not padding[position]: assert index.evaluate(values) == expected[position], f"{where}: evaluate at {position}"
  # analysis helpers
  if (~padding).any():
    needed = int(expected[~padding].max()) + 1
    assert tracker.real_size() >= needed, f"{where}: real_size {tracker.real_size()} < {needed}"
  for dim, stride in enumerate(tracker.real_strides()):
    if stride is None or expected.shape[dim] < 2: continue
    lower = np.take(expected, range(expected.shape[dim] - 1), axis=dim)
    upper = np.take(expected, range(1, expected.shape[dim]), axis=dim)
    both = (lower != PAD) & (upper != PAD)
    assert ((upper - lower)[both] == stride).all(), f"{where}: real stride {stride} of dim {dim} is wrong"
  for dim in range(expected.ndim):
    if tracker.axis_is_masked(dim): continue
    assert (padding == np.take(padding, [0], axis=dim)).all(), f"{where}: dim {dim} is masked but says it is not"


def check_case(case: Case) -> str:
  rng = case.rng
  start = random_shape(rng)
  ops = random_chain(rng, start)
  case.log(f"start shape {start}\nops {ops}")
  base = np.arange(prod(start), dtype=np.int64).reshape(start)
  expected = base
  for op in ops: expected = apply_numpy(expected, op)
  size = prod(start)
  tracker = apply_ops(ShapeTracker.from_shape(start), ops)
  check_tracker(tracker, expected, size, "tracker", rng)
  simplified = tracker.simplify()
  assert len(simplified.views) <= len(tracker.views), f"simplify added views: {tracker} -> {simplified}"
  check_tracker(simplified, expected, size, "simplify()", rng)
  # composition: the chain cut in three, composed both ways and left unsimplified
  cut1, cut2 = sorted(rng.randint(0, len(ops)) for _ in range(2))
  first = apply_ops(ShapeTracker.from_shape(start), ops[:cut1])
  second = apply_ops(ShapeTracker.from_shape(first.shape), ops[cut1:cut2])
  third = apply_ops(ShapeTracker.from_shape(second.shape), ops[cut2:])
  case.log(f"cuts at {cut1}, {cut2}")
  left = (first + second) + third
  right = first + (second + third)
  for label, composed in [("(st1+st2)+st3", left), ("st1+(st2+st3)", right),
                          ("unsimplified stack", ShapeTracker(first.views + second.views + third.views))]:
    check_tracker(composed, expected, size, label, rng)
  assert len(left.views) <= len(first.views) + len(second.views) + len(third.views)
  return f"ok: {len(tracker.views)} view(s)" if expected.size else "ok: empty"


# ---------------------------------------------------------------- pytest and command line

ITERATIONS = 700


@pytest.mark.parametrize("seed", [0, 1])
def test_shapetracker_fixed_seed(seed: int) -> None:
  run_for_pytest("fuzz_shapetracker", check_case, seed, ITERATIONS)


def test_shapetracker_random_seed() -> None:
  run_for_pytest("fuzz_shapetracker", check_case, random_seed(), ITERATIONS)


if __name__ == "__main__":
  def make_check(args: argparse.Namespace) -> Any: return check_case
  main("fuzz_shapetracker", make_check, 1000)
