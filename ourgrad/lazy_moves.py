"""Fixed chains of movement ops on lazy buffers: `apply_moves` applies a chain move by move, `composed_view` as one
view through the tracker the moves compose the input's to, remembered per (tracker, chain): a layer's operands and
gradients go through the same few chains every step (a per-channel value broadcast, a product's operands lined up, a
gradient reshaped back), and a view per move was most of their cost. Below the Functions (function.py uses it) and
above lazy.py.
"""
from __future__ import annotations

from typing import Any

from ourgrad.helpers import register_cache_clearer
from ourgrad.lazy import LazyBuffer
from ourgrad.shape.shapetracker import ShapeTracker

# a movement op and its argument, as the LazyBuffer and Tensor methods of that name take it
Move = tuple[str, Any]
Lazy = Any   # a LazyBuffer, a MultiLazyBuffer or a Tensor (apply_moves only)


def apply_moves(x: Any, moves: list[Move]) -> Any:
  """`moves` applied to x in order (a lazy buffer, or a tensor through its own movement ops)."""
  for name, arg in moves: x = getattr(x, name)(arg)
  return x


# (a lazy input's tracker, a tuple of moves) -> the tracker they compose it to (`composed_view`)
_COMPOSED: dict[tuple, ShapeTracker] = {}
_COMPOSED_MAX = 1024


def composed_view(x: Lazy, moves: tuple[Move, ...]) -> Lazy:
  """`moves` (movement ops, hashable arguments) applied to x: on a single device's lazy buffer (no constant's
  storage) one view through the tracker they compose x's to, remembered per (tracker, moves); else move by move. For
  the few fixed chains a layer applies at every step (a per-channel value broadcast, a convolution's operands lined
  up), where a view per move was most of their cost."""
  if type(x) is not LazyBuffer or x._const is not None: return apply_moves(x, moves)
  key = (x.st, moves)
  st = _COMPOSED.get(key)
  if st is None:
    if len(_COMPOSED) >= _COMPOSED_MAX: _COMPOSED.clear()
    st = _COMPOSED[key] = apply_moves(x, moves).st
  return x.view(st)


register_cache_clearer(_COMPOSED.clear)
