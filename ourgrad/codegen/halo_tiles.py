"""Halo tiles: the layout of a SHARED tile (no TC) whose axes overlap in memory, as a convolution's input does along
its output pixels and its window taps (pixel p and tap k read element p + k). Staged as plain axes, the tile would
hold each input element once per tap; a halo tile holds it once.

The tile's axes are split in two. The window axes (the ones with the smallest strides, while each next stride falls
inside the span the previous ones cover) fold into one contiguous range of the buffer: element r of the range is the
buffer's element base + r, and a lane reads it at r = sum(stride * index) over the window axes. The other (outer)
axes stay ordinary axes of the tile, outermost first. The range of each outer index is filled once per reduce step;
the load's mask (a convolution's padding) is applied when a lane reads the tile, not when it is filled: one tile
element serves valid and masked lanes alike.

Kernel.staged_loads picks the tiles; this module lays out those whose axes overlap (HaloWindow) and fills them
(HaloTileFill, a part of the Linearizer); the Linearizer reads them (_halo_tile_load).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ourgrad.codegen.uops import UOp, UOps
from ourgrad.ops import LazyOp
from ourgrad.shape.shapetracker import ShapeTracker
from ourgrad.shape.symbolic import MulNode, Node, NumNode, SumNode, Variable, sym_and, sym_sum

if TYPE_CHECKING:
  from ourgrad.codegen.kernel import Kernel

# a halo range is padded to a multiple of this (float4 reads from the tile stay aligned from one outer row to the next)
RANGE_ALIGNMENT = 4
# how a range is padded past RANGE_ALIGNMENT (_padded_span): "rounds": further, up to ROUND_PADDING_MAX times the
# span, so that the tile fills in whole rounds of the block's threads (no partial last round: the condition for
# double buffering without WRAP_LAST_ROUND); "banks": only so that neighbouring rows start an odd number of float4s
# apart (lanes reading the same offset of several rows, e.g. 8 images of MNIST conv2's input gradient 128 floats
# apart, hit different banks), the last round wrapped or guarded; bench_conv_kernels.py compares them
SPAN_PADDING = "banks"
ROUND_PADDING_MAX = 1.5
# a kernel with a halo tile fills the last, partial round of each of its tiles (more than one round) by wrapping
# back: a thread past the tile's end loads and stores the unit it filled in the round before once more (the same
# value to the same place, by the same thread) instead of idling behind an `if`, so its tiles are double buffered
# (register prefetch, Linearizer._tiles_double_buffered: its stores come after the math, outside any `if`) whatever
# their sizes, e.g. MNIST conv2's filter tile of 32 channels x 2 x 25 taps = 1600 elements on 128 threads
WRAP_LAST_ROUND = True


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


def wraps_last_round(kernel: Kernel) -> bool:
  """Whether the kernel's tile fills wrap their last partial round around (WRAP_LAST_ROUND: a kernel with a halo
  tile)."""
  return WRAP_LAST_ROUND and any(kernel.halo_window(leaf, axes) is not None for leaf, axes in kernel.staged_loads())


def wraps_back(units: int, threads: int) -> bool:
  """Whether a tile of `units` fill units has a last round the threads wrap back from (see WRAP_LAST_ROUND)."""
  return units % threads != 0 and units > threads


def last_round_unit(unit: Node, units: int, first: int, threads: int, wrap: bool) -> tuple[Node, Node | None]:
  """(the fill unit a thread takes in the round starting at `first`, the condition it fills under or None): in the
  last, partial round of a tile of `units`, a thread past the end takes its unit of the round before (`wrap`, more
  than one round: unit // units is 1 exactly for those threads) or sits the round out."""
  if first + threads <= units: return unit, None
  if wrap and wraps_back(units, threads): return unit - unit // units * threads, None
  return unit, unit < units


def _padded_span(kernel: Kernel, span: int, rows: int) -> int:
  """The range's length: `span` up to a multiple of RANGE_ALIGNMENT, and further as SPAN_PADDING says (with
  "rounds", or a tile of one partial round, which no fill wraps: at most ROUND_PADDING_MAX times span so that `rows`
  ranges fill in whole rounds of the block's threads)."""
  aligned = -(-span // RANGE_ALIGNMENT) * RANGE_ALIGNMENT
  threads = kernel.local_threads() * kernel.group_threads()
  if SPAN_PADDING == "banks" and rows * aligned > threads:
    odd = rows == 1 or aligned // RANGE_ALIGNMENT % 2 == 1
    return aligned if odd else aligned + RANGE_ALIGNMENT
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


class HaloTileFill:
  """The Linearizer's code for halo tiles: the fill at each reduce step, and the load masks its reads apply (the
  attributes and helpers used here are the Linearizer's)."""
  kernel: Kernel
  builder: Any
  buffers: dict[int, UOp]
  leaf_index: dict[int, int]
  tile_windows: dict[int, HaloWindow]
  halo_valid: dict

  def node_to_uop(self, node: Node) -> UOp: raise NotImplementedError
  def _index_nodes(self, leaf_number: int, idxs: list[Node]) -> tuple[Node, Node]: raise NotImplementedError

  def _stage_halo_tile(self, node: LazyOp, local: UOp, axis_idxs: list[Node], thread: Node, offset: Node,
                       defer: bool, copy: bool = False) -> list[tuple[UOp, Node, tuple[UOp, ...]]]:
    """Fill a halo tile (see codegen/halo_tiles.py): unit u of the tile is element u % span of row u // span's
    range, the buffer's element at the row's range start plus that; loaded where it lies in the buffer (the load's
    mask is applied when the tile is read). Element by element, neighbouring threads neighbouring elements. `copy`:
    asynchronous COPYs (zero-filled outside the buffer), the last round guarded."""
    kernel, build = self.kernel, self.builder
    window, leaf = self.tile_windows[id(local)], self.leaf_index[id(node)]
    threads = kernel.local_threads() * kernel.group_threads()
    window_vars = [Variable(f"halo{axis}", 0, kernel.full_shape[axis] - 1) for axis in window.window]
    # the buffer's valid elements end before this: the first view is the one on the buffer itself
    limit = ShapeTracker(kernel.sts[leaf].views[:1]).real_size()
    deferred: list[tuple[UOp, Node, tuple[UOp, ...]]] = []   # (tile, address, values), as _stage_shared_tiles
    wrap = wraps_last_round(kernel)
    for first in range(0, window.elements, threads):
      unit, condition = last_round_unit(thread + first, window.elements, first, threads, wrap and not copy)
      guard = None if condition is None else build.add(UOps.IF, None, (self.node_to_uop(condition),))
      idxs = list(axis_idxs) + [NumNode(0)] * (kernel.shape_len - len(axis_idxs))
      for axis in range(kernel.global_dims, kernel.first_loop_reduce): idxs[axis] = NumNode(0)
      row, inner = unit // window.span, 1
      for axis in reversed(window.outer):
        idxs[axis] = (row // inner) % kernel.full_shape[axis]
        inner *= kernel.full_shape[axis]
      for axis, var in zip(window.window, window_vars): idxs[axis] = var
      # a step given as an expression (a later step's fill: step + 1 or step + stages - 1) stands in as a variable
      # while the window's terms are taken off the index (the expression would mix into them), then goes back in
      step_axis = kernel.first_loop_reduce
      step = idxs[step_axis] if step_axis < kernel.first_upcast else None
      stand_in = None
      if step is not None and not isinstance(step, (Variable, NumNode)):
        stand_in = Variable("halo_step", 0, kernel.full_shape[step_axis] - 1)
        idxs[step_axis] = stand_in
      index_node, _ = self._index_nodes(leaf, idxs)
      element = without_window(index_node, window_vars) + unit % window.span
      if stand_in is not None: element = element.substitute({stand_in: step})
      in_buffer = sym_and([element >= 0, element < limit])
      srcs = (self.buffers[node.arg.idx], self.node_to_uop(element))
      if copy:   # the tile element, zero where it lies outside the buffer (never read unmasked there)
        valid = () if isinstance(in_buffer, NumNode) and in_buffer.b else (self.node_to_uop(in_buffer),)
        build.add(UOps.COPY, None, (local, self.node_to_uop(offset + unit)) + srcs + valid, (1, True))
        if guard is not None: build.end_if(guard)
        continue
      if isinstance(in_buffer, NumNode) and not in_buffer.b:   # never in the buffer: never read unmasked
        value = build.const(0.0 if node.dtype.is_float else 0, node.dtype)
      elif isinstance(in_buffer, NumNode): value = build.add(UOps.LOAD, node.dtype, srcs)
      else: value = build.add(UOps.LOAD, node.dtype, srcs + (self.node_to_uop(in_buffer),))
      if defer: deferred.append((local, offset + unit, (value,)))
      else: build.add(UOps.STORE, None, (local, self.node_to_uop(offset + unit), value))
      if guard is not None: build.end_if(guard)
    return deferred

  def _halo_valid(self, leaf: int, idxs: list[Node]) -> Node:
    """The load's mask at `idxs`, computed once per combination of the indices of the axes it depends on (the
    axes its index moves along or its views mask): many lanes of one step share it (a convolution's channels)."""
    if leaf not in self.halo_valid:
      st = self.kernel.sts[leaf]
      default_idxs = st.default_idxs()
      masked = st.expr_idxs(default_idxs)[1].vars()
      self.halo_valid[leaf] = [axis for axis, (idx, stride) in enumerate(zip(default_idxs, st.real_strides()))
                               if stride != 0 or idx in masked]
    key = (leaf,) + tuple(idxs[axis].render() for axis in self.halo_valid[leaf])
    if key not in self.halo_valid: self.halo_valid[key] = self._index_nodes(leaf, idxs)[1]
    return self.halo_valid[key]
