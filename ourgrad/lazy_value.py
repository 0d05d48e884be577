"""Casts that change no value: a lossless round trip (x.cast(wider).cast(x.dtype)) and an identity cast.

`x.cast(float32).cast(bfloat16)` of a bfloat16 x gives back every value of x, bit for bit: float32 holds each
bfloat16 value exactly (`dtype.can_cast_safely`), and rounding an exact value back is the identity. Where x is a
computation (no stored memory), LazyBuffer.cast folds the pair to x, as it folds `x * 1`; except where kernels hold x
with more precision than its dtype (`is_exact`: a fused 16-bit float op), where the pair is where x gets rounded.
Where x is a stored tensor the pair stays a value of its own (a later in-place write to x must not change it,
docs/reliability.md), and so does the identity cast that autograd wraps a gradient naming stored memory in
(tensor.py `_own_value`); the scheduler then drops the casts inside kernels (engine/schedule.py), and a kernel that
reads its operands as whole buffers (the fused attention ops) reads x's memory through `value_source` instead of a
copy of it. Reading x there is a read like any kernel's: the op is one of x's lazy readers, so a write to x before it
runs snapshots the old contents first (engine/snapshot.py).

Nothing here imports lazy.py (which imports this): the functions take LazyBuffers and read their fields.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ourgrad.dtype import DType, can_cast_safely
from ourgrad.ops import ELEMENTWISE_OPS, REDUCE_OPS, LazyOp, Ops

if TYPE_CHECKING:
  from ourgrad.lazy import LazyBuffer


# ops whose result a kernel computes: fused, a 16-bit float one is kept in float registers, not rounded to its dtype
_COMPUTED_OPS = (ELEMENTWISE_OPS | REDUCE_OPS) - {Ops.CAST, Ops.BITCAST}


def _kept_wider(dtype: DType) -> bool:
  """Whether kernels may hold values of `dtype` with more precision than it has: C-like renderers compute 16-bit
  floats in float registers and round only at a cast or a store (renderer/cstyle.py `floats_in_registers`)."""
  return dtype.is_float and dtype.itemsize == 2


def is_exact(buffer: LazyBuffer) -> bool:
  """Whether every kernel sees `buffer`'s values exactly as its dtype holds them: so a round trip through a wider
  dtype, which rounds to that dtype at its end, changes nothing. Not so for a 16-bit float op's result fused into a
  kernel (`_kept_wider`); a cast's result (rounded by it), stored memory and a constant are exact."""
  base = buffer.base
  return not _kept_wider(buffer.dtype) or base.realized is not None or base.op not in _COMPUTED_OPS


def is_exact_node(node: LazyOp) -> bool:
  """`is_exact` for a node of a kernel's AST: a load, a constant, a cast's result, or any value of another dtype."""
  return not _kept_wider(node.dtype) or node.op not in _COMPUTED_OPS


def is_lossless_round_trip(narrow: DType, wide: DType) -> bool:
  """Whether a cast from `narrow` to `wide` and back gives every `narrow` value (NaN, infinities, -0.0) back."""
  return narrow != wide and can_cast_safely(narrow, wide)


def _cast_source(buffer: LazyBuffer) -> LazyBuffer | None:
  """The value a cast base computes from (seen through `buffer`'s view), when `buffer` reads an unrealized CAST
  base; else None."""
  base = buffer.base
  if base.realized is not None or base.op is not Ops.CAST or not base.srcs: return None
  source = base.srcs[0]
  return source if buffer.is_base else source.base.view((source.st + buffer.st).simplify())


def round_trip_source(buffer: LazyBuffer, dtype: DType) -> LazyBuffer | None:
  """x where `buffer.cast(dtype)` is x.cast(wider).cast(x.dtype) with the wider dtype holding every x (so the pair
  is x itself), seen through the views between; else None."""
  if buffer.dtype == dtype or not is_lossless_round_trip(dtype, buffer.dtype): return None
  source = _cast_source(buffer)
  return source if source is not None and source.dtype == dtype else None


def value_source(buffer: LazyBuffer) -> LazyBuffer:
  """`buffer`, or the buffer it has every value of, bit for bit, through identity casts and lossless round trips
  (the module docstring): what a kernel reading whole operands reads instead of a copy of the same values."""
  while True:
    source = _cast_source(buffer)
    if source is None: return buffer
    if source.dtype != buffer.dtype:   # a widening or narrowing cast: only the second half of a round trip
      source = round_trip_source(source, buffer.dtype)
      if source is None: return buffer
    buffer = source
