"""Halo tiles: the layout of a SHARED tile (no TC) whose axes overlap in memory, as a convolution's input does along
its output pixels and its window taps (pixel p and tap k read element p + k). Staged as plain axes, the tile would
hold each input element once per tap; a halo tile holds it once.

The tile's axes are split in two. The window axes (the ones with the smallest strides, while each next stride falls
inside the span the previous ones cover) fold into one contiguous range of the buffer: element r of the range is the
buffer's element base + r, and a lane reads it at r = sum(stride * index) over the window axes. The other (outer)
axes stay ordinary axes of the tile, outermost first. The range of each outer index is filled once per reduce step;
the load's mask (a convolution's padding) is applied when a lane reads the tile, not when it is filled: one tile
element serves valid and masked lanes alike.

Kernel.staged_loads picks the tiles; this module only lays out those whose axes overlap (HaloWindow); the linearizer
fills and reads them (Linearizer._stage_shared_tiles, _tile_load).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ourgrad.shape.symbolic import MulNode, Node, NumNode, SumNode, Variable, sym_sum

if TYPE_CHECKING:
  from ourgrad.codegen.kernel import Kernel

# a halo range is padded to a multiple of this (float4 reads from the tile stay aligned from one outer row to the next)
RANGE_ALIGNMENT = 4
# the range is padded further, up to this factor, so that the tile fills in whole rounds of the block's threads (the
# condition for the register-prefetch double buffering, see Linearizer._tiles_double_buffered)
ROUND_PADDING_MAX = 1.5


@dataclass(frozen=True)
class HaloWindow:
  """A staged tile with overlapping axes: `window` (tile axes folded into one range of `span` elements, each read
  at stride `strides`) and `outer` (the other tile axes, outermost first). One stage holds `elements`."""
  window: tuple[int, ...]
  strides: tuple[int, ...]
  span: int
  outer: tuple[int, ...]
  elements: int


def halo_window(kernel: Kernel, leaf: int, axes: list[int]) -> HaloWindow | None:
  """The halo layout of staged load `leaf`'s tile (`axes` as Kernel.staged_loads orders them), or None where its
  axes do not overlap (the ordinary layout then), a stride is not a plain positive number, or TC is applied."""
  if kernel.tensor_core is not None or len(axes) < 2: return None
  strides = kernel.sts[leaf].real_strides()
  if any(strides[axis] is None or strides[axis] <= 0 for axis in axes): return None
  window: list[int] = []
  span = 1
  for axis in sorted(axes, key=lambda axis: strides[axis]):
    if window and strides[axis] > span: break   # a gap after the range: an outer axis, as every larger stride
    window.append(axis)
    span += (kernel.full_shape[axis] - 1) * strides[axis]
  if len(window) < 2 or span >= math.prod(kernel.full_shape[axis] for axis in window): return None
  outer = tuple(axis for axis in axes if axis not in window)
  rows = math.prod(kernel.full_shape[axis] for axis in outer)
  return HaloWindow(tuple(window), tuple(strides[axis] for axis in window), _padded_span(kernel, span, rows), outer,
                    rows * _padded_span(kernel, span, rows))


def _padded_span(kernel: Kernel, span: int, rows: int) -> int:
  """The range's length: `span` up to a multiple of RANGE_ALIGNMENT, and further (at most ROUND_PADDING_MAX times
  span) so that `rows` ranges fill in whole rounds of the block's threads."""
  aligned = -(-span // RANGE_ALIGNMENT) * RANGE_ALIGNMENT
  threads = kernel.local_threads() * kernel.group_threads()
  step = math.lcm(RANGE_ALIGNMENT, threads // math.gcd(threads, rows))
  whole_rounds = -(-span // step) * step
  return whole_rounds if whole_rounds <= span * ROUND_PADDING_MAX else aligned


def window_offset(window: HaloWindow, idxs: list[Node]) -> Node:
  """The position in the range that a lane with indices `idxs` reads."""
  return sym_sum([idxs[axis] * stride for axis, stride in zip(window.window, window.strides)])


def outer_row(kernel: Kernel, window: HaloWindow, idxs: list[Node]) -> Node:
  """The row (outer axes, mixed radix) of a lane with indices `idxs`."""
  row: Node = NumNode(0)
  for axis in window.outer: row = row * kernel.full_shape[axis] + idxs[axis]
  return row


def without_window(index: Node, window_vars: list[Variable]) -> Node:
  """A load's index expression with its window axes' terms dropped: the buffer element at range position 0. The
  index holds each window variable in one term of its own (var or var * stride, see ShapeTracker.real_strides)."""
  terms = index.nodes if isinstance(index, SumNode) else [index]
  kept = []
  for term in terms:
    used = [var for var in window_vars if var in term.vars()]
    if not used:
      kept.append(term)
      continue
    if not (term in window_vars or (isinstance(term, MulNode) and term.a in window_vars)):
      raise ValueError(f"halo tile: the index term {term.render()} is not a window axis times its stride")
  return sym_sum(kept)


def split_constant(address: Node) -> tuple[Node, int]:
  """(the address without its constant term, that constant)."""
  if isinstance(address, NumNode): return NumNode(0), address.b
  if not isinstance(address, SumNode): return address, 0
  constant = sum(term.b for term in address.nodes if isinstance(term, NumNode))
  return sym_sum([term for term in address.nodes if not isinstance(term, NumNode)]), constant
