"""Tensor-core operands staged through local memory (OptOps.TC with OptOps.SHARED): the linearizer's part.

Each reduce step the block's threads copy the A and B block tiles from global memory into local memory together
(COPY uops: 16 bytes per thread and copy where the alignment allows, neighbouring threads neighbouring pieces), and
each warp then loads its fragments from there with ldmatrix (LDMATRIX uops) instead of 16/32-bit global loads. The
tiles are double buffered: the copies of step r + 1 are asynchronous (cp.async on CUDA) and run while the warps
compute step r from the other stage:

    copy step 0 -> stage 0
    for r in steps:
      wait for my copies; BARRIER           (step r is in stage r % 2 for every thread)
      if r + 1 < steps: copy step r + 1 -> stage (r + 1) % 2   (asynchronous)
      ldmatrix fragments from stage r % 2; mma

One BARRIER per step is enough: a thread that starts writing stage (r + 2) % 2 = r % 2 (in step r + 1) has passed
the BARRIER of step r + 1, so every warp has finished reading it in step r.

A computed tile (TileLayout.computed: an operand that is an expression of loads, a fused bias say) is filled by
every thread evaluating its elements and storing them (synchronous loads), after the step's mma rather than before
it, so those loads wait while the tensor cores work; the same BARRIER orders them.

How a tile lies in local memory is Kernel.tensor_core_tiles (TileLayout); which lane points at which row for
ldmatrix follows the fragment maps of codegen/tensor_cores.py:
- A (m16 x k16, ldmatrix .x4): matrix j covers rows 8 (j % 2).., columns 8 (j // 2)..: a0a1, a2a3, a4a5, a6a7;
- B (k16 x n8, .x2): matrix j covers K 8 j..: b0b1, b2b3.
Stored K-contiguous (a row of the tile runs along K) the lanes point at M (N) rows; stored M (N)-contiguous at K
rows, and .trans transposes each 8x8 matrix as it loads.
"""
from __future__ import annotations

from ourgrad.codegen.tensor_core_layout import TileLayout
from ourgrad.codegen.tensor_cores import evaluate
from ourgrad.codegen.uops import AxisType, UOp, UOps
from ourgrad.ops import LazyOp
from ourgrad.shape.symbolic import Node, NumNode

# bytes one COPY moves at most (a 16-byte vector: uint4, cp.async .cg)
COPY_BYTES = 16


def ldmatrix_row(lane: Node, operand_is_a: bool) -> tuple[Node, Node]:
  """(M or N, K) of the first element of the 8x8 matrix row that `lane` points ldmatrix at, in a 16x16 A fragment
  (.x4: matrix j = lane // 8 covers M 8 (j % 2).., K 8 (j // 2)..) or two neighbouring 16x8 B fragments (.x4:
  matrix j covers N 8 (j // 2).., K 8 (j % 2)..: b0b1, b2b3 of the first, then of the second; with one B fragment,
  .x2 reads only lanes 0..15). Row r = lane % 8 of a matrix is M (N) r of it where the tile's rows run along K, and
  K r where they run along M (N) (`transposed`, added by the caller)."""
  if operand_is_a: return (lane // 8) % 2 * 8, lane // 16 * 8
  return lane // 16 * 8, (lane // 8) % 2 * 8


class TensorCoreTiles:
  """The staged-TC half of the Linearizer (mixed into it): tile definitions, cooperative copies, fragment loads."""

  def _define_tensor_core_tiles(self) -> list[tuple[UOp, TileLayout, LazyOp]]:
    """A DEFINE_LOCAL per operand (all stages): (local memory, layout, operand) for A and B."""
    kernel = self.kernel
    applied = kernel.tensor_core
    tiles = []
    for name, operand, layout in zip(("tile_a", "tile_b"), (applied.a, applied.b), kernel.tensor_core_tiles()):
      local = self.builder.add(UOps.DEFINE_LOCAL, operand.dtype, (), (name, layout.stage_size * layout.stages))
      tiles.append((local, layout, operand))
    return tiles

  def _tile_offset(self, layout: TileLayout, idxs: list[Node]) -> Node:
    """The element of a tile (one stage) at the per-axis indices `idxs`: row * (row length + padding) + column."""
    sizes = self.kernel.full_shape
    row: Node = NumNode(0)
    for axis in layout.axes[:-layout.row_axes]: row = row * sizes[axis] + idxs[axis]
    column: Node = NumNode(0)
    for axis in layout.axes[-layout.row_axes:]: column = column * sizes[axis] + idxs[axis]
    return row * (layout.row_length + layout.padding) + column

  def _aligned_width(self, operand: LazyOp, innermost: int) -> int:
    """The widest piece (up to 16 bytes) whose first global index is always a multiple of it: the view's offset
    and every stride but the innermost tile axis's are (the innermost axis splits into whole pieces)."""
    kernel = self.kernel
    leaf = kernel.leaf_number(operand)
    strides = kernel.sts[leaf].real_strides()
    offset, _ = self._index_nodes(leaf, [NumNode(0)] * kernel.shape_len)
    if strides[innermost] != 1: return 1   # not contiguous along the tile's rows (a conv filter along its channels)
    width = COPY_BYTES // operand.dtype.itemsize
    while width > 1:
      strides_fit = all(stride is not None and stride % width == 0 for axis, stride in enumerate(strides)
                        if axis != innermost)
      if strides_fit and isinstance(offset, NumNode) and offset.b % width == 0 and \
          kernel.full_shape[innermost] % width == 0: return width
      width //= 2
    return 1

  def _piece_idxs(self, layout: TileLayout, axis_idxs: list[Node], piece: Node, width: int, step: Node) -> list[Node]:
    """Per-axis indices of the first element of tile piece `piece` (`width` elements along a row) at reduce step
    `step`; in-block axes outside the tile (the operand does not vary along them) at 0."""
    kernel = self.kernel
    idxs = list(axis_idxs) + [NumNode(0)] * (kernel.shape_len - len(axis_idxs))
    for axis in list(range(kernel.global_dims, kernel.first_reduce)) + list(range(kernel.first_upcast,
                                                                                  kernel.shape_len)):
      idxs[axis] = NumNode(0)
    idxs = self._step_idxs(idxs, step)
    pieces_per_row = layout.row_length // width
    row, column = piece // pieces_per_row, piece % pieces_per_row * width
    for axes, flat in ((layout.axes[:-layout.row_axes], row), (layout.axes[-layout.row_axes:], column)):
      inner = 1
      for axis in reversed(axes):
        idxs[axis] = (flat // inner) % kernel.full_shape[axis]
        inner *= kernel.full_shape[axis]
    return idxs

  def _step_idxs(self, idxs: list[Node], step: Node) -> list[Node]:
    """`idxs` with the reduce loop axes at reduce step `step`: the loop index itself where there is one loop, else
    the flat step split over the loops (the last varying fastest), as _linearize_tensor_core walks them."""
    kernel, idxs = self.kernel, list(idxs)
    loops = range(kernel.first_loop_reduce, kernel.first_upcast)
    if len(loops) == 1:
      idxs[kernel.first_loop_reduce] = step
      return idxs
    inner = 1
    for axis in reversed(loops):
      idxs[axis] = (step // inner) % kernel.full_shape[axis]
      inner *= kernel.full_shape[axis]
    return idxs

  def _uniformly_valid(self, operand: LazyOp, idxs: list[Node], innermost: int, width: int) -> bool:
    """Whether a piece's elements are all valid or all padding. A piece is `width` neighbouring elements of the
    buffer from an aligned index, so in the view that addresses the buffer (views[0]) it runs along the dimension of
    stride 1: uniform where only that view is masked, its mask starts and ends on piece boundaries along that
    dimension, and its other strides and offset keep pieces aligned there. Otherwise: each element's validity is the
    same symbolic expression as the first one's."""
    leaf = self.kernel.leaf_number(operand)
    views = self.kernel.sts[leaf].views
    base = views[0]
    if all(view.mask is None for view in views[1:]):
      if base.mask is None: return True
      along = [dim for dim, stride in enumerate(base.strides) if stride == 1]
      aligned = base.offset % width == 0 and all(stride % width == 0 for dim, stride in enumerate(base.strides)
                                                 if dim not in along)
      if aligned and all(base.shape[dim] % width == 0 and base.mask[dim][0] % width == 0 and
                         base.mask[dim][1] % width == 0 for dim in along): return True
    first = self._index_nodes(leaf, idxs)[1].render()
    for element in range(1, width):
      shifted = list(idxs)
      shifted[innermost] = idxs[innermost] + element
      if self._index_nodes(leaf, shifted)[1].render() != first: return False
    return True

  def _prefetch_tiles(self, tiles: list[tuple[UOp, TileLayout, LazyOp]], axis_idxs: list[Node], thread: Node,
                      step: Node, steps: int) -> None:
    """In reduce step `step`: `tiles` of step + stages - 1 into their stage, where there is such a step."""
    if not tiles: return
    stages = self.kernel.tile_stages
    ahead = step + (stages - 1)
    prefetch = self.builder.add(UOps.IF, None, (self.node_to_uop(step < steps - (stages - 1)),))
    self._copy_tensor_core_tiles(tiles, axis_idxs, thread, ahead, ahead % stages)
    self.builder.end_if(prefetch)

  def _copy_tensor_core_tiles(self, tiles: list[tuple[UOp, TileLayout, LazyOp]], axis_idxs: list[Node],
                              thread: Node, step: Node, stage: Node) -> None:
    """Every thread of the block copies its share of both tiles of reduce step `step` into stage `stage`: piece
    p (of `width` elements along a row) by thread p mod the block's threads. A piece is as wide as the alignment
    allows and its elements are all valid or all padding (a ragged edge inside a piece: element by element)."""
    kernel, build = self.kernel, self.builder
    threads = kernel.block_threads()
    for local, layout, operand in tiles:
      if layout.computed:
        self._compute_tile(local, layout, operand, axis_idxs, thread, step, stage)
        continue
      innermost = layout.axes[-1]
      width = self._aligned_width(operand, innermost)
      while width > 1 and not all(
          self._uniformly_valid(operand, self._piece_idxs(layout, axis_idxs, thread + first, width, step), innermost,
                                width) for first in range(0, layout.rows * layout.row_length // width, threads)):
        width //= 2
      total = layout.rows * layout.row_length // width
      for first in range(0, total, threads):
        piece = thread + first
        guard = None
        if first + threads > total:   # the last round: only the threads with a piece left
          guard = build.add(UOps.IF, None, (self.node_to_uop(piece < total),))
        idxs = self._piece_idxs(layout, axis_idxs, piece, width, step)
        index, valid = self._index(kernel.leaf_number(operand), idxs)
        local_index = self.node_to_uop(stage * layout.stage_size + self._tile_offset(layout, idxs))
        srcs = (local, local_index, self.buffers[operand.arg.idx], index) + ((valid,) if valid is not None else ())
        build.add(UOps.COPY, None, srcs, (width, True))
        if guard is not None: build.end_if(guard)

  def _compute_tile(self, local: UOp, layout: TileLayout, operand: LazyOp, axis_idxs: list[Node], thread: Node,
                    step: Node, stage: Node) -> None:
    """Every thread of the block computes its share of an expression operand's tile (element p by thread p mod the
    block's threads, neighbouring threads along a row: their loads coalesce where the operand's loads run along K)
    and stores the values into stage `stage`, as a buffer of the operand's dtype holds them (ldmatrix reads them so),
    synchronously: the BARRIER of the step that reads them orders it."""
    build, threads = self.builder, self.kernel.block_threads()
    total = layout.rows * layout.row_length
    for first in range(0, total, threads):
      element = thread + first
      guard = build.add(UOps.IF, None, (self.node_to_uop(element < total),)) if first + threads > total else None
      idxs = self._piece_idxs(layout, axis_idxs, element, 1, step)
      value = self.compute(operand, idxs, None)
      local_index = self.node_to_uop(stage * layout.stage_size + self._tile_offset(layout, idxs))
      build.add(UOps.STORE, None, (local, local_index, value))
      if guard is not None: build.end_if(guard)

  def _tile_fragment(self, tile: tuple[UOp, TileLayout, LazyOp], operand_is_a: bool, idxs: list[Node], lane: Node,
                     stage: Node) -> list[UOp]:
    """A lane's A (8 elements) or B (4 elements) fragment of the instruction at `idxs`, by one LDMATRIX from the
    tile (the same fragment is loaded once per step: later tiles reuse it). TF32 fragments (32-bit elements, which
    ldmatrix's .trans cannot transpose) are loaded element by element (_tile_fragment_elements)."""
    local, layout, _ = tile
    if self.kernel.tensor_core.tc.is_tf32:
      if layout.transposed: return self._tile_fragment_elements(tile, operand_is_a, idxs, lane, stage)
      return self._tf32_ldmatrix_fragment(tile, operand_is_a, idxs, lane, stage)
    kernel = self.kernel
    m_or_n_axis = kernel.shape_len - 3 if operand_is_a else kernel.shape_len - 2
    k_axis = kernel.shape_len - 1
    count, first_element = 4, 0
    pair_axis = None if operand_is_a else self._b_pair_axis(layout)
    fragment_idxs = list(idxs)
    if pair_axis is not None:   # one .x4 for this N tile and its neighbour: the even one's address, its half
      tile_number = idxs[pair_axis].b
      fragment_idxs[pair_axis], first_element = NumNode(tile_number - tile_number % 2), 4 * (tile_number % 2)
    elif not operand_is_a: count = 2
    m_or_n, k = ldmatrix_row(lane, operand_is_a)
    if count == 2: m_or_n = NumNode(0)   # .x2: lanes 16..31 point where lanes 0..15 do (unused)
    # a lane points at one row of 8 tile elements: along K (M/N rows), or along M/N (K rows) when transposed
    if layout.transposed: k = k + lane % 8
    else: m_or_n = m_or_n + lane % 8
    fragment_idxs[m_or_n_axis], fragment_idxs[k_axis] = m_or_n, k
    address = stage * layout.stage_size + self._tile_offset(layout, fragment_idxs)
    key = (id(local), address.render())
    if key not in self.fragment_loads:
      self.fragment_loads[key] = self.builder.add(UOps.LDMATRIX, tile[2].dtype, (local, self.node_to_uop(address)),
                                                  (count, layout.transposed))
    matrix = self.fragment_loads[key]
    elements = range(first_element, first_element + (8 if operand_is_a else 4))
    return [self.builder.add(UOps.GEP, tile[2].dtype, (matrix,), element) for element in elements]

  def _tf32_ldmatrix_fragment(self, tile: tuple[UOp, TileLayout, LazyOp], operand_is_a: bool, idxs: list[Node],
                              lane: Node, stage: Node) -> list[UOp]:
    """A lane's TF32 fragment from a K-contiguous tile by one ldmatrix (.x4 for A, .x2 for B): an 8x8 matrix of
    16-bit elements is 8 rows of 4 floats, so lane l gets the float at row l // 4, column l % 4 of each matrix, which
    is (group, quad) of the fragment maps. A (16 x 8): matrices at M 0 / 8, K 0 / 4 in a0..a3's order (lanes 8j..8j+7
    point at matrix j's rows: M 8 (j % 2) + l % 8, K 4 (j // 2)); B (8 x 8, rows along N): K 0 and 4 for b0, b1."""
    local, layout, operand = tile
    kernel = self.kernel
    m_or_n_axis = kernel.shape_len - 3 if operand_is_a else kernel.shape_len - 2
    k_axis = kernel.shape_len - 1
    fragment_idxs = list(idxs)
    if operand_is_a: fragment_idxs[m_or_n_axis], fragment_idxs[k_axis] = (lane // 8) % 2 * 8 + lane % 8, lane // 16 * 4
    else: fragment_idxs[m_or_n_axis], fragment_idxs[k_axis] = lane % 8, (lane // 8) % 2 * 4
    count = 4 if operand_is_a else 2
    address = stage * layout.stage_size + self._tile_offset(layout, fragment_idxs)
    key = (id(local), address.render())
    if key not in self.fragment_loads:
      self.fragment_loads[key] = self.builder.add(UOps.LDMATRIX, operand.dtype, (local, self.node_to_uop(address)),
                                                  (count, False))
    matrix = self.fragment_loads[key]
    return [self.builder.add(UOps.GEP, operand.dtype, (matrix,), element) for element in range(count)]

  def _tile_fragment_elements(self, tile: tuple[UOp, TileLayout, LazyOp], operand_is_a: bool, idxs: list[Node],
                              lane: Node, stage: Node) -> list[UOp]:
    """A lane's fragment as one local-memory LOAD per element, at the positions the instruction's fragment maps give
    (each loaded once per step: later tiles reuse it)."""
    local, layout, operand = tile
    kernel, tc = self.kernel, self.kernel.tensor_core.tc
    m_or_n_axis = kernel.shape_len - 3 if operand_is_a else kernel.shape_len - 2
    k_axis = kernel.shape_len - 1
    group, quad = lane // 4, lane % 4
    count = tc.a_elements if operand_is_a else tc.b_elements
    values = []
    for element in range(count):
      if operand_is_a: m_or_n, k = tc.a_position(element)
      else: k, m_or_n = tc.b_position(element)
      fragment_idxs = list(idxs)
      fragment_idxs[m_or_n_axis], fragment_idxs[k_axis] = evaluate(m_or_n, group, quad), evaluate(k, group, quad)
      address = stage * layout.stage_size + self._tile_offset(layout, fragment_idxs)
      key = (id(local), address.render())
      if key not in self.fragment_loads:
        self.fragment_loads[key] = self.builder.add(UOps.LOAD, operand.dtype, (local, self.node_to_uop(address)))
      values.append(self.fragment_loads[key])
    return values

  def _b_pair_axis(self, layout: TileLayout) -> int | None:
    """The UPCAST axis of B's N tiles right outside the instruction's n in the tile (tile t + 1 is 8 along N from
    tile t), when it pairs them (even size): one ldmatrix .x4 then loads two B fragments."""
    kernel = self.kernel
    position = layout.axes.index(kernel.shape_len - 2)
    if position == 0: return None
    axis = layout.axes[position - 1]
    if kernel.axis_types[axis] is not AxisType.UPCAST or kernel.full_shape[axis] % 2: return None
    return axis
