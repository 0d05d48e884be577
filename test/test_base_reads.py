"""What part of its base's memory a view reads (lazy.py): `LazyBuffer.reads_whole_base` (the base itself or a reshape
of all of it) and `LazyBuffer.fixed_base_range` (one contiguous run with no Variable in it), the two predicates the
JIT's outputs, Tensor.numpy(), write-through views and the scheduler share. Checked against numpy: the run a
predicate names, read from the base's flat values, is the view's values."""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.shape import Variable

_DATA = np.arange(4 * 6 * 5, dtype=np.float32).reshape(4, 6, 5)

# name -> (our view, numpy's view)
_VIEWS: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[np.ndarray], np.ndarray]]] = {
  "base": (lambda x: x, lambda a: a),
  "reshape": (lambda x: x.reshape(24, 5), lambda a: a.reshape(24, 5)),
  "flatten": (lambda x: x.reshape(-1), lambda a: a.reshape(-1)),
  "leading_slice": (lambda x: x[1:3], lambda a: a[1:3]),
  "one_row": (lambda x: x[2], lambda a: a[2]),
  "rows_of_a_reshape": (lambda x: x.reshape(24, 5)[3:9], lambda a: a.reshape(24, 5)[3:9]),
  "part_of_one_row": (lambda x: x[1:2, 2:4], lambda a: a[1:2, 2:4]),
  "inner_slice": (lambda x: x[:, 1:3], lambda a: a[:, 1:3]),
  "permute": (lambda x: x.permute(2, 0, 1), lambda a: a.transpose(2, 0, 1)),
  "flip": (lambda x: x.flip(0), lambda a: a[::-1]),
  "steps": (lambda x: x[::2], lambda a: a[::2]),
  "expand": (lambda x: x[:, :1].expand(4, 3, 5), lambda a: np.broadcast_to(a[:, :1], (4, 3, 5))),
  "pad": (lambda x: x.pad(((1, 0), None, None)), lambda a: np.pad(a, ((1, 0), (0, 0), (0, 0)))),
}

# the views that read one contiguous run of the base, and those that read all of it
_RUNS = {"base", "reshape", "flatten", "leading_slice", "one_row", "rows_of_a_reshape", "part_of_one_row"}
_WHOLE = {"base", "reshape", "flatten"}


@pytest.mark.parametrize("name", list(_VIEWS))
def test_predicates_match_numpy(name: str) -> None:
  ours, theirs = _VIEWS[name]
  base = Tensor(_DATA.copy()).realize()
  view = ours(base)
  expected = theirs(_DATA)
  np.testing.assert_array_equal(view.numpy(), expected)
  lazy, flat = view.lazydata, _DATA.reshape(-1)
  assert lazy.base is base.lazydata
  assert lazy.reads_whole_base == (name in _WHOLE)
  run = lazy.fixed_base_range()
  assert (run is not None) == (name in _RUNS)
  if lazy.reads_whole_base: assert run == (0, flat.size)
  if run is not None:
    start, count = run
    assert type(start) is int and type(count) is int
    np.testing.assert_array_equal(flat[start:start + count], expected.reshape(-1))


def test_symbolic_view_has_no_fixed_run() -> None:
  """A slice whose length is a bound Variable is one contiguous run, but not the same one for every value."""
  base = Tensor(_DATA.copy()).realize()
  n = Variable("n", 1, 4)
  view = base.shrink(((0, n.bind(2)), None, None))
  assert view.lazydata.base_range() is not None
  assert view.lazydata.fixed_base_range() is None
  assert not view.lazydata.reads_whole_base
