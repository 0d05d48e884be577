"""Which loops the CUDA renderer marks `#pragma unroll` (renderer/cuda.py short_reduce_loops), on hand-built UOps:
constant-trip REDUCE loops of 2..SHORT_LOOP_UNROLL iterations whose straight-line bodies, unrolled, stay within
SHORT_LOOP_UOPS."""
from ourgrad.codegen.uops import AxisType, UOp, UOps
from ourgrad.dtype import dtypes
from ourgrad.renderer.cuda import SHORT_LOOP_UNROLL, SHORT_LOOP_UOPS, short_reduce_loops


def _range(size: int | UOp, kind: AxisType = AxisType.REDUCE) -> UOp:
  zero = UOp(UOps.CONST, dtypes.int32, (), 0)
  end = size if isinstance(size, UOp) else UOp(UOps.CONST, dtypes.int32, (), size)
  return UOp(UOps.RANGE, dtypes.int32, (zero, end), ("r", kind))


def _loop(loop: UOp, body: list[UOp]) -> list[UOp]: return [loop, *body, UOp(UOps.ENDRANGE, None, (loop,))]


def _body(count: int) -> list[UOp]: return [UOp(UOps.CONST, dtypes.float32, (), float(n)) for n in range(count)]


def test_short_reduce_loops_choose_by_trip_count_kind_and_unrolled_size():
  short, long_trip, one = _range(4), _range(SHORT_LOOP_UNROLL + 1), _range(1)
  global_loop = _range(4, AxisType.GLOBAL)
  symbolic = _range(UOp(UOps.DEFINE_VAR, dtypes.int32, (), ("n", 1, 4)))
  uops = [*_loop(short, _body(3)), *_loop(long_trip, _body(3)), *_loop(one, _body(3)), *_loop(global_loop, _body(3)),
          *_loop(symbolic, _body(3))]
  assert short_reduce_loops(uops) == {id(short)}
  # unrolled, the body may hold SHORT_LOOP_UOPS UOps at most: the trip count times the body's length counts
  fits, too_big = _range(SHORT_LOOP_UNROLL), _range(SHORT_LOOP_UNROLL)
  per_trip = SHORT_LOOP_UOPS // SHORT_LOOP_UNROLL
  uops = [*_loop(fits, _body(per_trip)), *_loop(too_big, _body(per_trip + 1))]
  assert short_reduce_loops(uops) == {id(fits)}


def test_short_reduce_loops_skip_bodies_with_loops_or_barriers():
  outer, inner, fenced = _range(4), _range(4), _range(4)
  uops = [*_loop(outer, _loop(inner, _body(2))), *_loop(fenced, [*_body(2), UOp(UOps.BARRIER, None)])]
  assert short_reduce_loops(uops) == {id(inner)}   # the innermost loop still unrolls; its parent holds a loop
