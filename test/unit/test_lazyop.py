"""LazyOp.renumbered: a kernel AST with its buffer numbers mapped (what merging two schedule items into one kernel
needs: engine/ride_along.py, engine/split_fusion.py). Checked on a hand-built AST: every MemBuffer gets the mapped
number, everything else (ops, constants, views, dtypes, a node read twice) stays as it was."""
from __future__ import annotations

from ourgrad.dtype import dtypes
from ourgrad.ops import ConstBuffer, LazyOp, MemBuffer, Ops
from ourgrad.shape.shapetracker import ShapeTracker

F32 = dtypes.float32


def _load(index: int, st: ShapeTracker) -> LazyOp: return LazyOp(Ops.LOAD, (), MemBuffer(index, F32, st), F32)


def test_renumbered_maps_every_buffer_and_keeps_the_rest() -> None:
  st, row = ShapeTracker.from_shape((4, 8)), ShapeTracker.from_shape((4, 1))
  shared = _load(2, st)   # read twice: one node in the result too
  total = LazyOp(Ops.SUM, (LazyOp(Ops.MUL, (_load(1, st), shared), None, F32),), (1,), F32)
  scaled = LazyOp(Ops.ADD, (total, LazyOp(Ops.CONST, (), ConstBuffer(0.5, F32, row), F32)), None, F32)
  ast = LazyOp(Ops.STORE, (LazyOp(Ops.ADD, (scaled, LazyOp(Ops.SUM, (shared,), (1,), F32)), None, F32),),
               MemBuffer(0, F32, row), F32)
  mapping = {0: 3, 1: 0, 2: 5}
  renumbered = ast.renumbered(mapping.__getitem__)
  before, after = ast.walk(), renumbered.walk()
  assert len(before) == len(after)
  for old, new in zip(before, after):
    assert (old.op, old.dtype, len(old.srcs)) == (new.op, new.dtype, len(new.srcs))
    if isinstance(old.arg, MemBuffer): assert new.arg == MemBuffer(mapping[old.arg.idx], old.arg.dtype, old.arg.st)
    else: assert new.arg == old.arg
  assert renumbered.renumbered({3: 0, 0: 1, 5: 2}.__getitem__) == ast   # the inverse map gives the same AST back
  assert ast.renumbered(lambda index: index) == ast
