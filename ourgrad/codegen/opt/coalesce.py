"""Which output axis a GPU reduce's neighbouring threads take, where no input is contiguous along a whole axis.

The heuristic puts a warp's lanes on the axis its biggest input reads with stride 1 (heuristic._contiguous_axis).
Some inputs are contiguous only in pieces of an axis: GPT-2's c_attn bias gradient sums over the tokens the q, k and
v gradients concatenated along the channels, each read through the attention's head permute, (B, H, T, D) ->
(B, T, 3 H D). Along the 2304 channels no source has one stride (the channel index is q/k/v, head, then D, each
source masked to its third), so the reduce was laid out as a row reduce: a warp per output, its lanes a token apart
(64 floats: every lane's load in a 32-byte sector of its own, 1/8 of each sector used; 905 GB/s on the H200).
Split into pieces of a warp, the channel axis is stride 1 in every source (32 neighbouring D of one head): the
warp's lanes take 32 neighbouring channels and each load instruction reads 4 whole sectors, as for a contiguous
(4096, 2304) input.
"""
from __future__ import annotations

from collections.abc import Sequence

from ourgrad.helpers import power_of_two_divisor, prod
from ourgrad.shape.shapetracker import ShapeTracker

# a piece shorter than this many elements leaves a 32-byte sector of float32s partly unread: not worth the lanes
MIN_PIECE = 8


def piece_strides(view: ShapeTracker, axis: int, piece: int) -> tuple[int | None, ...]:
  """The real strides of `view` with `axis` split into (size // piece, piece): the piece is axis + 1."""
  shape = view.shape
  split = shape[:axis] + (shape[axis] // piece, piece) + shape[axis + 1:]
  return view.reshape(split).real_strides()


def contiguous_in_pieces(loads: Sequence[ShapeTracker], axis: int, lanes: int) -> bool:
  """Whether each load that varies along `axis` reads its pieces of `lanes` (the largest power of two dividing the
  axis, up to `lanes`; at least MIN_PIECE) with stride 1, though not the whole axis with one stride."""
  size = loads[0].shape[axis] if loads else 0
  piece = power_of_two_divisor(size, lanes)
  if piece < MIN_PIECE: return False
  varying = [view for view in loads if view.real_strides()[axis] != 0]
  return bool(varying) and all(piece_strides(view, axis, piece)[axis + 1] == 1 for view in varying)


def load_lane_axis(view: ShapeTracker, output_axes: int, lanes: int) -> int | None:
  """The axis along which one load wants a warp's lanes: its innermost stride-1 axis, else the innermost of the first
  `output_axes` axes it reads in contiguous pieces of `lanes` elements (contiguous_in_pieces), else None."""
  strides = view.real_strides()
  whole = next((axis for axis in reversed(range(len(strides))) if strides[axis] == 1 and view.shape[axis] > 1), None)
  if whole is not None: return whole
  return next((axis for axis in reversed(range(output_axes)) if contiguous_in_pieces([view], axis, lanes)), None)


def _elements(view: ShapeTracker) -> int:
  """Elements a load reads (its axes of stride 0 broadcast, not read)."""
  return prod(size for size, stride in zip(view.shape, view.real_strides()) if stride != 0)


def lane_axis(loads: Sequence[ShapeTracker], output_axes: int, lanes: int, biggest: int | None) -> int | None:
  """The axis a reduce's neighbouring threads take: the one along which the most loaded elements are contiguous
  (load_lane_axis of each load, weighted by the elements it reads), where that is more than `biggest` (the axis the
  biggest load is contiguous along) gets. GPT-2's c_attn bias gradient reads the q and k gradients in pieces of D
  along the channels and the v gradient (stored (B, H, D, T) by its matmul) along the tokens: the channels get the
  lanes (2 of 3 sources coalesced; each v lane then walks its own tokens, a sector every 8 iterations), not the
  tokens (1 of 3, every q and k lane a sector of its own)."""
  weights: dict[int, int] = {}
  for view in loads:
    axis = load_lane_axis(view, output_axes, lanes)
    if axis is not None: weights[axis] = weights.get(axis, 0) + _elements(view)
  if not weights: return biggest
  best = max(weights, key=lambda axis: weights[axis])
  return best if weights[best] > weights.get(biggest, 0) else biggest  # type: ignore[arg-type]
