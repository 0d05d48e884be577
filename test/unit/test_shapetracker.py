"""Tests of View/ShapeTracker: random movement-op sequences checked element by element against numpy."""
import itertools
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ourgrad.errors import AxisError, ShapeError
from ourgrad.helpers import prod
from ourgrad.shape import ShapeTracker, View
from ourgrad.shape.symbolic import NumNode, Variable

PAD = -1  # numpy sentinel for padding (the buffer itself holds arange, all >= 0)
MAX_ELEMENTS = 300  # keep arrays small so brute-force checks stay fast


def divisors(value: int) -> list[int]:
  return [d for d in range(1, value + 1) if value % d == 0]


@st.composite
def shapes(draw) -> tuple[int, ...]:
  return tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))


@st.composite
def movement_op(draw, shape: tuple[int, ...]):
  """One valid (name, arg) movement op for an array of this shape."""
  ndim, size = len(shape), prod(shape)
  name = draw(st.sampled_from(["reshape", "permute", "expand", "pad", "shrink", "flip"]))
  if name == "reshape":
    if size == 0:
      return name, draw(st.sampled_from([(0,), (0, 3), (2, 0, 1), (1, 0)]))
    new_ndim = draw(st.integers(0 if size == 1 else 1, 4))
    new_shape, remaining = [], size
    for _ in range(max(new_ndim - 1, 0)):
      factor = draw(st.sampled_from(divisors(remaining)))
      new_shape.append(factor)
      remaining //= factor
    if new_ndim > 0: new_shape.append(remaining)
    return name, tuple(new_shape)
  if name == "permute": return name, tuple(draw(st.permutations(range(ndim))))
  if name == "expand": return name, tuple(draw(st.integers(0, 4)) if s == 1 else s for s in shape)
  if name == "pad": return name, tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in shape)
  if name == "shrink":
    arg = []
    for s in shape:
      start = draw(st.integers(0, s))
      arg.append((start, draw(st.integers(start, s))))
    return name, tuple(arg)
  return name, tuple(draw(st.booleans()) for _ in shape)


def apply_numpy(array: np.ndarray, name: str, arg) -> np.ndarray:
  if name == "reshape": return array.reshape(arg)
  if name == "permute": return array.transpose(arg)
  if name == "expand": return np.broadcast_to(array, arg)
  if name == "pad": return np.pad(array, arg, constant_values=PAD) if arg else array
  if name == "shrink": return array[tuple(slice(start, end) for start, end in arg)]
  return np.flip(array, axis=tuple(i for i, flag in enumerate(arg) if flag)) if any(arg) else array


def apply_tracker(tracker: ShapeTracker, name: str, arg) -> ShapeTracker:
  return getattr(tracker, name)(arg)


@st.composite
def op_sequences(draw, start_shape: tuple[int, ...], max_ops: int = 8) -> list:
  ops, shape = [], start_shape
  for _ in range(draw(st.integers(0, max_ops))):
    name, arg = draw(movement_op(shape))
    new_shape = apply_numpy(np.zeros(shape, dtype=np.int8), name, arg).shape
    if prod(new_shape) > MAX_ELEMENTS: continue
    ops.append((name, arg))
    shape = new_shape
  return ops


def check_against_numpy(tracker: ShapeTracker, expected: np.ndarray, buffer_size: int) -> None:
  """Every output element: tracker's (index, valid) must give the numpy element or padding."""
  assert tracker.shape == expected.shape
  index, valid = tracker.expr_idxs()
  flat_index, flat_valid = tracker.expr_node()
  max_valid_index = -1
  for position in itertools.product(*(range(s) for s in expected.shape)):
    values = {f"idx{dim}": value for dim, value in enumerate(position)}
    flat_values = {"idx": int(np.ravel_multi_index(position, expected.shape))} if expected.shape else {"idx": 0}
    want = int(expected[position])
    assert valid.min <= valid.evaluate(values) <= valid.max
    if want == PAD:
      assert valid.evaluate(values) == 0, f"{position} should be padding; valid={valid.render()}"
      assert flat_valid.evaluate(flat_values) == 0
    else:
      assert valid.evaluate(values) == 1, f"{position} should be valid; valid={valid.render()}"
      assert index.evaluate(values) == want, f"{position}: {index.render()} != {want}"
      assert flat_valid.evaluate(flat_values) == 1 and flat_index.evaluate(flat_values) == want
      assert 0 <= want < buffer_size
      max_valid_index = max(max_valid_index, want)
  assert tracker.real_size() >= max_valid_index + 1
  if max_valid_index == -1 and expected.size > 0 and len(tracker.views) == 1: assert tracker.real_size() == 0
  check_real_strides(tracker, expected)


def check_real_strides(tracker: ShapeTracker, expected: np.ndarray) -> None:
  for dim, stride in enumerate(tracker.real_strides()):
    if stride is None: continue
    for position in itertools.product(*(range(s) for s in expected.shape)):
      if position[dim] + 1 >= expected.shape[dim]: continue
      following = position[:dim] + (position[dim] + 1,) + position[dim + 1:]
      if expected[position] == PAD or expected[following] == PAD: continue
      assert expected[following] - expected[position] == stride, f"dim {dim} real stride {stride}"
  assert tracker.unit_stride_axes() == [dim for dim, s in enumerate(tracker.real_strides()) if s == 1]


def check_masked_axes(tracker: ShapeTracker, expected: np.ndarray) -> None:
  """A dim the validity does not depend on must have padding constant along it."""
  for dim in range(tracker.ndim):
    if tracker.axis_is_masked(dim): continue
    padding = expected == PAD
    first = np.take(padding, [0], axis=dim) if expected.shape[dim] > 0 else padding
    assert (padding == first).all()


@settings(max_examples=250, deadline=None)
@given(st.data())
def test_random_movement_ops_match_numpy(data):
  start_shape = data.draw(shapes())
  ops = data.draw(op_sequences(start_shape))
  tracker, array = ShapeTracker.from_shape(start_shape), np.arange(prod(start_shape)).reshape(start_shape)
  for name, arg in ops:
    tracker, array = apply_tracker(tracker, name, arg), apply_numpy(array, name, arg)
    assert tracker.shape == array.shape
  check_against_numpy(tracker, array, prod(start_shape))
  check_against_numpy(tracker.simplify(), array, prod(start_shape))
  check_masked_axes(tracker, array)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_composition_matches_numpy(data):
  start_shape = data.draw(shapes())
  first_ops = data.draw(op_sequences(start_shape, 5))
  first, array = ShapeTracker.from_shape(start_shape), np.arange(prod(start_shape)).reshape(start_shape)
  for name, arg in first_ops:
    first, array = apply_tracker(first, name, arg), apply_numpy(array, name, arg)
  second = ShapeTracker.from_shape(first.shape)
  for name, arg in data.draw(op_sequences(first.shape, 5)):
    second, array = apply_tracker(second, name, arg), apply_numpy(array, name, arg)
  composed = first + second
  assert len(composed.views) <= len(first.views) + len(second.views)
  check_against_numpy(composed, array, prod(start_shape))
  unsimplified = ShapeTracker(first.views + second.views)
  check_against_numpy(unsimplified, array, prod(start_shape))


# ---------------------------------------------------------------- single-view cases

def one_view(tracker: ShapeTracker) -> bool:
  return len(tracker.views) == 1


def test_common_cases_stay_one_view():
  base = ShapeTracker.from_shape((2, 3, 4))
  assert base.contiguous
  assert one_view(base.reshape((6, 4))) and base.reshape((6, 4)).contiguous
  assert one_view(base.permute((2, 0, 1)))
  assert one_view(ShapeTracker.from_shape((2, 1, 4)).expand((2, 5, 4)))
  assert one_view(base.pad(((1, 1), (0, 2), (3, 0))))
  assert one_view(base.shrink(((0, 2), (1, 3), (1, 2))))
  assert one_view(base.flip((True, False, True)))
  sliced = ShapeTracker.from_shape((4, 5, 6)).shrink(((0, 4), (0, 5), (1, 4)))
  merged = sliced.reshape((20, 3))
  assert one_view(merged) and merged.views[0].strides == (6, 1) and merged.views[0].offset == 1
  assert one_view(base.permute((1, 0, 2)).reshape((3, 2, 2, 2)))  # splitting dims is always fine
  assert one_view(base.expand((2, 3, 4)).reshape((2, 3, 4, 1)))
  padded = ShapeTracker.from_shape((4, 3)).pad(((1, 1), (0, 0)))
  assert one_view(padded.reshape((18,)))  # mask on whole rows merges
  assert one_view(ShapeTracker.from_shape((2, 4)).pad(((0, 0), (2, 2))).reshape((2, 4, 2)))  # pads of whole pairs
  assert len(ShapeTracker.from_shape((2, 3)).pad(((0, 0), (0, 1))).reshape((2, 2, 2)).views) == 2  # mask not a box


def test_transpose_then_flatten_needs_two_views():
  tracker = ShapeTracker.from_shape((4, 4)).permute((1, 0)).reshape((16,))
  assert len(tracker.views) == 2
  index, valid = tracker.expr_idxs()
  for flat in range(16):
    assert index.evaluate({"idx0": flat}) == (flat % 4) * 4 + flat // 4
  assert valid == NumNode(1)


def test_simplify_merges_reshape_back():
  tracker = ShapeTracker.from_shape((4, 4)).permute((1, 0)).reshape((16,)).reshape((4, 4))
  assert one_view(tracker.simplify())
  assert tracker.simplify().views[0].strides == (1, 4)


def test_composition_with_contiguous():
  first = ShapeTracker.from_shape((3, 4)).permute((1, 0))
  assert (first + ShapeTracker.from_shape((4, 3))).views == first.views
  assert (ShapeTracker.from_shape((12,)) + first).views == first.views


def test_real_strides_and_unit_axes():
  tracker = ShapeTracker.from_shape((3, 4)).permute((1, 0))
  assert tracker.real_strides() == (1, 4)
  assert tracker.unit_stride_axes() == [0]
  two_views = ShapeTracker.from_shape((4, 4)).permute((1, 0)).reshape((16,))
  assert two_views.real_strides() == (None,)
  assert ShapeTracker.from_shape((3, 1)).expand((3, 5)).real_strides() == (1, 0)


def test_real_strides_remembered_per_tracker():
  # eager steps ask the same (interned) trackers again: the multi-view walk runs once, and what it remembers stays
  # out of the pickled state (like the cached hash) while the answer still matches numpy's strides
  tracker = ShapeTracker.from_shape((4, 4)).permute((1, 0)).reshape((2, 8)).pad(((0, 0), (1, 0)))
  expected = np.pad(np.arange(16).reshape(4, 4).T.reshape(2, 8), ((0, 0), (1, 0)), constant_values=PAD)
  assert len(tracker.views) == 2
  first = tracker.real_strides()
  assert first[0] is not None
  assert tracker.real_strides() is first
  check_real_strides(tracker, expected)
  restored = pickle.loads(pickle.dumps(tracker))
  assert "_real_strides" not in restored.__dict__ and restored.real_strides() == first


def test_masked_axes_and_real_size():
  padded = ShapeTracker.from_shape((3, 4)).pad(((0, 0), (1, 1)))
  assert not padded.axis_is_masked(0) and padded.axis_is_masked(1)
  assert padded.real_size() == 12
  assert ShapeTracker.from_shape((3, 4)).shrink(((0, 1), (0, 2))).real_size() == 2
  assert ShapeTracker.from_shape((0, 4)).real_size() == 0


def test_zero_size_and_scalar():
  empty = ShapeTracker.from_shape((0, 3)).reshape((3, 0))
  assert empty.shape == (3, 0) and empty.size == 0 and one_view(empty)
  scalar = ShapeTracker.from_shape(())
  assert scalar.shape == () and scalar.size == 1 and scalar.contiguous
  index, valid = scalar.reshape((1, 1)).expand((2, 3)).expr_idxs()
  assert index == NumNode(0) and valid == NumNode(1)


def test_view_create_canonical():
  view = View.create((1, 3), (7, 1), 0, ((0, 1), (0, 3)))
  assert view.strides == (0, 1) and view.mask is None and view.contiguous
  empty = View.create((2, 3), (3, 1), 5, ((0, 2), (2, 2)))
  assert empty.mask == ((0, 0), (0, 0)) and empty.strides == (0, 0) and empty.offset == 0
  assert View.create((2, 3)).strides == (3, 1)


def test_expr_idxs_with_custom_indices():
  tracker = ShapeTracker.from_shape((8, 4)).permute((1, 0))
  gidx, lidx = Variable("gidx0", 0, 3), Variable("lidx0", 0, 7)
  index, valid = tracker.expr_idxs([gidx, lidx])
  assert index == gidx + lidx * 4  # sums keep first-seen term order
  assert valid == NumNode(1)


# ---------------------------------------------------------------- errors

def test_reshape_mismatch_raises_shape_error():
  with pytest.raises(ShapeError) as info:
    ShapeTracker.from_shape((2, 3)).reshape((4, 2))
  assert "(2, 3)" in str(info.value) and "(4, 2)" in str(info.value)
  assert "6" in str(info.value) and "8" in str(info.value)


def test_bad_permute_raises_axis_error():
  with pytest.raises(AxisError): ShapeTracker.from_shape((2, 3)).permute((0, 0))
  with pytest.raises(AxisError): ShapeTracker.from_shape((2, 3)).permute((0,))
  with pytest.raises(IndexError): ShapeTracker.from_shape((2, 3)).permute((0, 2))


def test_bad_expand_pad_shrink_flip():
  tracker = ShapeTracker.from_shape((2, 1))
  with pytest.raises(ShapeError): tracker.expand((3, 1))
  with pytest.raises(ShapeError): tracker.expand((2, 4, 1))
  with pytest.raises(ShapeError): tracker.pad(((0, -1), (0, 0)))
  with pytest.raises(ShapeError): tracker.pad(((0, 1),))
  with pytest.raises(ShapeError): tracker.shrink(((0, 3), (0, 1)))
  with pytest.raises(ShapeError): tracker.shrink(((1, 0), (0, 1)))
  with pytest.raises(ShapeError): tracker.flip((True,))
  with pytest.raises(ValueError): tracker.reshape((3,))


def test_merge_dims():
  from ourgrad.shape import merge_dims
  assert merge_dims((2, 3, 4), (12, 4, 1)) == ((24, 1, 1),)
  assert merge_dims((2, 3, 4), (1, 8, 2)) == ((2, 1, 1), (12, 2, 2))
  assert merge_dims((4, 3), (3, 1), ((1, 3), (0, 3))) == ((12, 1, 1),)
