"""Lower an optimized Kernel to a flat list of UOps.

The loop nest is: global loops (or GPU thread indices), accumulators, reduce loops with the unrolled reduce
lanes inside, then (with GROUP axes) the partials of a block's threads are combined, then the upcast outputs are
computed and stored. Upcast and unroll axes never
become loops: each combination of their indices (a "lane") is generated as straight-line code with the
index fixed to a constant, which is what puts the tile in registers. Buffer indices come from each view's
ShapeTracker as symbolic expressions, simplified, then turned into integer UOps.

GROUP axes (GPU) are thread indices inside a block that split the reduce: each thread accumulates its slice, then
the partials of one output are combined without a serial loop: a warp shuffle (WARP_REDUCE) where the device has
one, and a tree in local memory (pairs combined in parallel, a BARRIER after each step) for what is left; thread 0
of the group computes the rest of the kernel and stores (an IF block).
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Iterable, Sequence

from ourgrad.codegen.bounded_loops import bounded_reduce_end, without_implied
from ourgrad.codegen.halo_tiles import HaloTileFill, HaloWindow
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.matmul_operands import is_plain_load
from ourgrad.codegen.shared_tile_fill import SharedTileFill, multiple_of, zero_of
from ourgrad.codegen.vector_access import VectorAccess, kept_where
from ourgrad.codegen.tensor_core_tiles import TensorCoreTiles
from ourgrad.codegen.tensor_cores import WARP_LANES, evaluate
from ourgrad.codegen.uops import AxisType, UOp, UOpBuilder, UOps
from ourgrad.dtype import DType, dtypes
from ourgrad.ops import LazyOp, MemBuffer, Ops
from ourgrad.shape.shapetracker import ShapeTracker
from ourgrad.shape.symbolic import (AndNode, DivNode, LtNode, ModNode, MulNode, Node, NumNode, ProdNode, SumNode,
                                    Variable, is_symbolic, sym_max)

INDEX_DTYPE = dtypes.int32


def reduce_identity(op: Ops, dtype: DType) -> float | int | bool:
  """The start value of an accumulator."""
  if op is Ops.SUM: return False if dtype == dtypes.bool else (0.0 if dtype.is_float else 0)
  if dtype.is_float: return -math.inf
  return dtype.min



# a GROUP reduce's epilogue loads are issued before its reduce loop (_prefetch_epilogue) for at most this many output
# lanes a thread (each holds a register through the loop)
PREFETCHED_EPILOGUE_LANES = 4


class Linearizer(VectorAccess, TensorCoreTiles, HaloTileFill, SharedTileFill):
  """Builds the UOps of one kernel. `linearize(kernel)` is the entry point."""

  def __init__(self, kernel: Kernel):
    self.kernel = kernel
    self.builder = UOpBuilder()
    self.loop_vars: dict[str, UOp] = {}
    self.buffers: dict[int, UOp] = {}
    self.leaf_index = {id(leaf): index for index, leaf in enumerate(kernel.leaves)}
    # a condition every plain global load also takes while set (a GPU row kernel's unit that lies past its row's end
    # for some threads: row_passes.RowPasses._unit): such a load reads no memory where it is false
    self.load_gate: UOp | None = None
    self.tiles: dict[int, tuple[UOp, list[int]]] = {}   # loads staged in local memory (OptOps.SHARED)
    self.tile_vectors: dict[tuple, UOp] = {}   # float4 reads of the tiles in this reduce step
    self.tile_offsets: dict[int, Node] = {}   # the stage being read, by id of the local memory (double buffered)
    self.tile_windows: dict[int, HaloWindow] = {}   # the halo tiles' layouts, by id of the local memory
    self.tile_layouts: dict[tuple[int, ...], tuple[list[int], list[int], int, int]] = {}   # see _tile_address
    # a halo tile's load: the axes its mask depends on (by leaf number), and the mask by the indices of those axes
    self.halo_valid: dict = {}
    self.fragment_loads: dict[tuple, UOp] = {}   # LDMATRIX of the tensor-core tiles in this reduce step
    self.hoisted_gate: UOp | None = None   # the IF of a gated store's condition, opened among the loops
    self.implied_valid: frozenset[Node] = frozenset()   # mask conditions a bounded reduce loop's end implies

  # ---------------------------------------------------------------- symbolic index math -> UOps

  def node_to_uop(self, node: Node) -> UOp:
    build = self.builder
    if isinstance(node, NumNode): return build.const(node.b, INDEX_DTYPE)
    if isinstance(node, Variable): return self.loop_vars[node.expr]
    if isinstance(node, MulNode): return build.alu(Ops.MUL, INDEX_DTYPE, self.node_to_uop(node.a), self._int(node.b))
    if isinstance(node, ProdNode):  # a symbolic stride or size times another node
      return build.alu(Ops.MUL, INDEX_DTYPE, self.node_to_uop(node.a), self.node_to_uop(node.b))
    if isinstance(node, (DivNode, ModNode)): return self._floor_div_mod(node)
    if isinstance(node, SumNode):
      terms = sorted(node.nodes, key=lambda term: isinstance(term, NumNode))  # constant last: reads "x+1"
      total = self.node_to_uop(terms[0])
      for term in terms[1:]: total = build.alu(Ops.ADD, INDEX_DTYPE, total, self.node_to_uop(term))
      return total
    if isinstance(node, LtNode):
      right = self._int(node.b) if isinstance(node.b, int) else self.node_to_uop(node.b)
      return build.alu(Ops.CMPLT, dtypes.bool, self.node_to_uop(node.a), right)
    if isinstance(node, AndNode):
      result = self.node_to_uop(node.nodes[0])
      for term in node.nodes[1:]: result = build.alu(Ops.AND, dtypes.bool, result, self.node_to_uop(term))
      return result
    raise NotImplementedError(f"cannot lower symbolic node {type(node).__name__}")

  def _int(self, value: int) -> UOp: return self.builder.const(value, INDEX_DTYPE)

  def _floor_div_mod(self, node: DivNode | ModNode) -> UOp:
    """Symbolic // and % are floor operations; every backend's integer / and % truncate toward zero. They agree
    for non-negative numerators, so a numerator that can be negative is first shifted up by a multiple of the
    divisor: floor(a/b) = (a + k*b)/b - k and a mod b = (a + k*b) % b, with k*b >= -min(a)."""
    build, divisor = self.builder, node.b
    numerator = self.node_to_uop(node.a)
    shift = -(node.a.min // divisor) if node.a.min < 0 else 0   # k = ceil(-min(a) / b)
    if shift: numerator = build.alu(Ops.ADD, INDEX_DTYPE, numerator, self._int(shift * divisor))
    op = Ops.IDIV if isinstance(node, DivNode) else Ops.MOD
    result = build.alu(op, INDEX_DTYPE, numerator, self._int(divisor))
    if shift and op is Ops.IDIV: result = build.alu(Ops.ADD, INDEX_DTYPE, result, self._int(-shift))
    return result

  # ---------------------------------------------------------------- the loop nest

  def linearize(self) -> list[UOp]:
    kernel, build = self.kernel, self.builder
    # kernel arguments in argument order: the runtime passes the buffers in that order
    memory_leaves = {leaf.arg.idx: leaf for leaf in kernel.leaves if isinstance(leaf.arg, MemBuffer)}
    # an output may be loaded too (an assign's target read in place, through the output's argument): it is written
    written = {leaf.arg.idx for leaf in kernel.leaves if isinstance(leaf.arg, MemBuffer) and leaf.op is Ops.STORE}
    for idx, leaf in sorted(memory_leaves.items()):
      self.buffers[idx] = build.add(UOps.DEFINE_GLOBAL, leaf.dtype, (), (idx, idx in written))
    self._define_vars()
    if kernel.tensor_core is not None: return self._linearize_tensor_core()
    shape = kernel.full_shape
    axis_idxs: list[Node] = []
    global_loops = []
    gate_depth = None
    if kernel.renderer.has_threads:
      renderer = kernel.renderer
      axis_idxs += self._thread_indices(shape[:kernel.global_dims], "gidx", AxisType.GLOBAL, renderer.global_max)
      thread_axes = kernel.thread_axes()
      thread_idxs = self._thread_indices([shape[axis] for axis in thread_axes], "lidx", AxisType.LOCAL,
                                         renderer.local_max)
      axis_idxs += [thread_idxs[thread_axes.index(axis)]
                    for axis in range(kernel.global_dims, kernel.first_loop_reduce)]
    else:
      gate_depth = self._kept_gate_depth()
      for axis in range(kernel.first_reduce):
        axis_idxs.append(_loop_index(f"gidx{axis}", shape[axis]))
        global_loops.append(self._open_loop(f"gidx{axis}", shape[axis], AxisType.GLOBAL))
        if axis + 1 == gate_depth: self.hoisted_gate = self._open_kept_gate(axis_idxs)
    for axis in range(kernel.first_loop_reduce, kernel.first_upcast):
      axis_idxs.append(_loop_index(f"ridx{axis}", shape[axis]))

    upcast_axes, unroll_axes = kernel.upcast_axes, kernel.unroll_axes
    output_lanes = list(itertools.product(*[range(shape[axis]) for axis in upcast_axes]))
    # (reduce number, *output lane) -> the accumulator: one reduce, or sibling reduces (Kernel.sibling_reduces) that
    # share the loop, their common loads merged by the builder
    accumulators: dict[tuple[int, ...], UOp] = {}
    if kernel.reduceop is not None:
      reduce = kernel.reduceop
      accumulate_op = Ops.ADD if reduce.op is Ops.SUM else Ops.MAX
      for number in range(len(kernel.reduceops)):
        for lane in output_lanes:
          accumulators[(number, *lane)] = build.add(UOps.DEFINE_ACC, reduce.dtype, (),
                                                    reduce_identity(reduce.op, reduce.dtype))
      async_stages = self._async_tile_stages()
      pipelined = not async_stages and self._tiles_double_buffered()
      tiles = self._define_shared_tiles(async_stages or (2 if pipelined else 1))
      if tiles and kernel.blocks_per_multiprocessor:
        build.add(UOps.OCCUPANCY, None, (), kernel.blocks_per_multiprocessor)
      if pipelined:   # step 0 into stage 0 before the loop (see _tiles_double_buffered)
        first_idxs = list(axis_idxs)
        first_idxs[kernel.first_loop_reduce] = NumNode(0)
        for local, address, values in self._stage_shared_tiles(tiles, first_idxs, {}, defer=True):
          self._store_tile(local, address, values)
        build.add(UOps.BARRIER, None)
      if async_stages: self._copy_first_tile_steps(tiles, axis_idxs, async_stages)
      if kernel.group_dims and not tiles and len(output_lanes) <= PREFETCHED_EPILOGUE_LANES:
        self._prefetch_epilogue(axis_idxs, output_lanes)
      loop_axes = range(kernel.first_loop_reduce, kernel.first_upcast)
      # a SUM of terms that a Variable-bounded mask zeroes ends where the mask does (codegen/bounded_loops.py); a
      # host loop nest only: GPU threads would each run their own count (divergent loops, left to the full loop)
      bounded = len(loop_axes) == 1 and not tiles and not kernel.group_dims and not kernel.renderer.has_threads
      bound = self._bounded_end(axis_idxs, output_lanes) if bounded else None
      end, self.implied_valid = bound if bound is not None else (None, frozenset())
      reduce_loops = [self._open_loop(f"ridx{axis}", shape[axis], AxisType.REDUCE, end) for axis in loop_axes]
      next_tiles = []
      if async_stages: self._copy_next_tile_step(tiles, axis_idxs, async_stages)
      elif pipelined:   # load step r + 1 now (wrapping to 0 at the end: in bounds, never read), store it after the math
        step, steps = axis_idxs[kernel.first_loop_reduce], shape[kernel.first_loop_reduce]
        next_idxs = list(axis_idxs)
        next_idxs[kernel.first_loop_reduce] = (step + 1) % steps
        sizes = {id(local): local.arg[1] // 2 for local, _ in tiles.values()}
        next_tiles = self._stage_shared_tiles(tiles, next_idxs, {key: (step + 1) % 2 * size
                                                                 for key, size in sizes.items()}, defer=True)
        self.tile_offsets = {key: step % 2 * size for key, size in sizes.items()}
        self.tiles = tiles
      else: self._stage_shared_tiles(tiles, axis_idxs, {})
      for unroll_lane in itertools.product(*[range(shape[axis]) for axis in unroll_axes]):
        for lane in output_lanes:
          idxs = self._fill_lanes(axis_idxs, upcast_axes, lane, unroll_axes, unroll_lane)
          for number, sibling in enumerate(kernel.reduceops):
            value = self.compute(sibling.srcs[0], idxs, None)
            build.add(UOps.ACCUMULATE, reduce.dtype, (accumulators[(number, *lane)], value), accumulate_op)
      for local, address, values in next_tiles: self._store_tile(local, address, values)
      # every thread is done with the tiles before the next step's stores (double buffered: and has stored them;
      # asynchronous copies: the next step's wait and BARRIER come before its copies)
      if tiles and not async_stages: build.add(UOps.BARRIER, None)
      # a load the kernel's epilogue shares with the reduce reads global memory there
      self.tiles, self.tile_offsets = {}, {}
      for loop in reversed(reduce_loops): build.end_range(loop)
      self.implied_valid = frozenset()

    combined: dict[tuple[int, ...], UOp] = dict(accumulators)
    store_if = None
    if kernel.group_dims:
      combined, group_index = self._combine_groups(accumulators, axis_idxs, accumulate_op)
      # one thread per group finishes the kernel: the others hold partial or duplicate results
      store_if = build.add(UOps.IF, None, (build.alu(Ops.CMPLT, dtypes.bool, group_index, self._int(1)),))
    # float4 stores where every output allows them along one axis; else _store_outputs lane by lane
    vector_store = self._vector_store_axis()
    pending: dict[tuple[int, ...], list[UOp]] = {}  # each output's values at the lanes of one vector store
    for lane in output_lanes:
      zero_unrolls = (0,) * len(unroll_axes)
      idxs = self._fill_lanes(axis_idxs, upcast_axes, lane, unroll_axes, zero_unrolls)
      # id(reduce) -> its value at this lane
      reduced = {id(sibling): combined[(number, *lane)] for number, sibling in enumerate(kernel.reduceops)
                 if (number, *lane) in combined}
      if vector_store is not None:
        pending[lane] = [self.compute(store.srcs[0], idxs, reduced) for store in kernel.stores]
        self._emit_vector_store(pending, lane, idxs, *vector_store, upcast_axes)
        continue
      self._store_outputs(idxs, reduced)
    if store_if is not None: build.end_if(store_if)
    for depth in reversed(range(len(global_loops))):
      if self.hoisted_gate is not None and depth + 1 == gate_depth: build.end_if(self.hoisted_gate)
      build.end_range(global_loops[depth])
    return build.uops

  def _kept_gate_depth(self) -> int | None:
    """How many outer loops a CPU kernel's gated store (`kept_where`) needs opened before its condition can be
    tested: the condition is then tested once there and the inner loops run only where it holds (a KV cache's new
    row: the cache's other 519 of 520 rows skipped whole, where testing each element cost as much as copying it:
    SmolLM2's decode, 41 -> ~1 us a layer on one core). None where the condition varies along the innermost global
    axis (nothing to skip) or the kernel is not one elementwise gated store."""
    kernel = self.kernel
    if kernel.reduceop is not None or len(kernel.stores) != 1 or kernel.first_reduce < 2: return None
    kept = kept_where(kernel, 0)
    if kept is None: return None
    views = {id(leaf): st for leaf, st in zip(kernel.leaves, kernel.sts)}
    for depth in range(1, kernel.first_reduce):
      if not _varies_along(kept[0], range(depth, kernel.shape_len), views): return depth
    return None

  def _open_kept_gate(self, axis_idxs: list[Node]) -> UOp:
    """The IF on the gated store's condition, computed from the loops opened so far (it does not vary along the
    others: _kept_gate_depth); _store_kept then tests only the store's own validity."""
    kept = kept_where(self.kernel, 0)
    assert kept is not None
    idxs = list(axis_idxs) + [NumNode(0)] * (self.kernel.shape_len - len(axis_idxs))
    return self.builder.add(UOps.IF, None, (self.compute(kept[0], idxs, None),))

  # ---------------------------------------------------------------- tensor cores (OptOps.TC)

  def _linearize_tensor_core(self) -> list[UOp]:
    """The loop nest of a TC kernel: block indices, then thread indices with the warp's lane innermost (x, 32
    threads), per upcast tile four float accumulators (the C fragment), the reduce loops with one WMMA per tile and
    unroll lane (its A and B fragments loaded at the positions tensor_cores.py maps to this lane), then each tile's
    four outputs stored at the C fragment's positions. The last three dimensions are the instruction's m, n, k."""
    kernel, build, shape = self.kernel, self.builder, self.kernel.full_shape
    renderer, applied = kernel.renderer, kernel.tensor_core
    tc = applied.tc
    axis_idxs = self._thread_indices(shape[:kernel.global_dims], "gidx", AxisType.GLOBAL, renderer.global_max)
    local_axes = kernel.thread_axes()   # LOCAL axes only: TC refuses GROUP
    thread_idxs = self._thread_indices([shape[axis] for axis in local_axes] + [WARP_LANES], "lidx", AxisType.LOCAL,
                                       renderer.local_max)
    axis_idxs += thread_idxs[:-1]
    lane = thread_idxs[-1]
    group, quad = lane // 4, lane % 4
    loop_axes = range(kernel.first_loop_reduce, kernel.first_upcast)
    # staged tiles copy one step ahead: several reduce loops (a convolution's channels and window) become one flat
    # loop of steps, each loop's index taken from it (TensorCoreTiles._step_idxs)
    flat_steps = kernel.shared_tiles and len(loop_axes) > 1
    steps = math.prod(shape[axis] for axis in loop_axes) if kernel.shared_tiles else shape[kernel.first_loop_reduce]
    flat_step = Variable(f"ridx{kernel.first_loop_reduce}", 0, steps - 1) if flat_steps else None
    for axis in loop_axes:
      axis_idxs.append(Variable(f"ridx{axis}", 0, shape[axis] - 1) if not flat_steps else NumNode(0))
    if flat_steps: axis_idxs = self._step_idxs(axis_idxs, flat_step)
    m_axis, n_axis, k_axis = kernel.shape_len - 3, kernel.shape_len - 2, kernel.shape_len - 1
    upcast_axes = [axis for axis in kernel.upcast_axes if axis < m_axis]
    unroll_axes = [axis for axis in kernel.unroll_axes if axis < m_axis]
    tiles = list(itertools.product(*[range(shape[axis]) for axis in upcast_axes]))
    accumulators = {tile: [build.add(UOps.DEFINE_ACC, tc.dtype_out, (), 0.0) for _ in range(tc.c_elements)]
                    for tile in tiles}
    staged = self._define_tensor_core_tiles() if kernel.shared_tiles else []
    stages = kernel.tile_stages
    if staged:   # the first stages - 1 steps' tiles, one commit group each (see codegen/tensor_core_tiles.py)
      thread = self._flat_index(axis_idxs, range(kernel.global_dims, kernel.first_reduce)) * WARP_LANES + lane
      for first_step in range(stages - 1):   # always stages - 1 groups (empty past the last step): the waits count
        if first_step: build.add(UOps.ASYNC_WAIT, None, (), stages)   # commits the group, waits for none
        if first_step < steps:
          self._copy_tensor_core_tiles(staged, axis_idxs, thread, NumNode(first_step), NumNode(first_step))
    if flat_steps: reduce_loops = [self._open_loop(f"ridx{kernel.first_loop_reduce}", steps, AxisType.REDUCE)]
    else: reduce_loops = [self._open_loop(f"ridx{axis}", shape[axis], AxisType.REDUCE) for axis in loop_axes]
    if staged:
      step = flat_step if flat_steps else axis_idxs[kernel.first_loop_reduce]
      stage = step % stages
      build.add(UOps.ASYNC_WAIT, None, (), stages - 2)   # this step's group has landed (the newer ones may not)
      build.add(UOps.BARRIER, None)
      # copied tiles go out now (asynchronous); computed ones after this step's mma (_prefetch_tiles)
      self._prefetch_tiles([tile for tile in staged if not tile[1].computed], axis_idxs, thread, step, steps)
      self.fragment_loads = {}
    for unroll_lane in itertools.product(*[range(shape[axis]) for axis in unroll_axes]):
      for tile in tiles:
        idxs = self._fill_lanes(axis_idxs, upcast_axes, tile, unroll_axes, unroll_lane)
        if staged:
          a_values = self._tile_fragment(staged[0], True, idxs, lane, stage)
          b_values = self._tile_fragment(staged[1], False, idxs, lane, stage)
        else:
          a_values = self._fragment_values(applied.a, idxs, (m_axis, k_axis), tc.a_position, tc.a_elements, group,
                                           quad)
          b_values = self._fragment_values(applied.b, idxs, (k_axis, n_axis), tc.b_position, tc.b_elements, group,
                                           quad)
        build.add(UOps.WMMA, tc.dtype_out, tuple(a_values + b_values + accumulators[tile]), tc.arg)
    if staged:
      # a computed tile's loads are synchronous: issued after the mma, they wait while the tensor cores work
      self._prefetch_tiles([tile for tile in staged if tile[1].computed], axis_idxs, thread, step, steps)
    for loop in reversed(reduce_loops): build.end_range(loop)
    zero_unrolls = (0,) * len(unroll_axes)
    for tile in tiles:
      for element, accumulator in enumerate(accumulators[tile]):
        idxs = self._fill_lanes(axis_idxs, upcast_axes, tile, unroll_axes, zero_unrolls)
        row, column = tc.c_position(element)
        idxs[m_axis], idxs[n_axis] = evaluate(row, group, quad), evaluate(column, group, quad)
        self._store_outputs(idxs, accumulator)
    return build.uops

  def _fragment_values(self, operand: LazyOp, idxs: list[Node], axes: tuple[int, int], position_of: Callable,
                       count: int, group: Node, quad: Node) -> list[UOp]:
    """An operand's fragment: element i at (row, column) = position_of(i) of the instruction's matrix, indices
    along `axes` (the other tile axis is one the operand does not vary along: 0). Elements 2j and 2j+1 are K
    neighbours (the PTX layouts pair them in one register); where the operand is contiguous along K they are one
    aligned 2-wide load (where the instruction pairs them: not TF32's)."""
    element_idxs = []
    for element in range(count):
      fragment_idxs = list(idxs)
      for axis, coordinate in zip(axes, position_of(element)): fragment_idxs[axis] = evaluate(coordinate, group, quad)
      element_idxs.append(fragment_idxs)
    k_axis = self.kernel.shape_len - 1
    values = []
    for element, (low, high) in enumerate(zip(element_idxs[::2], element_idxs[1::2])):
      pair = self._fragment_pair(operand, low, k_axis) if _k_neighbours(position_of, axes, k_axis, element) else None
      values += pair if pair is not None else [self.compute(operand, low, None), self.compute(operand, high, None)]
    return values

  def _fragment_pair(self, operand: LazyOp, idxs: list[Node], k_axis: int) -> list[UOp] | None:
    """Two K-neighbouring elements as one 2-wide LOAD (and its GEPs), or None where the operand is not a load of one
    unmasked view contiguous along K or the first index is not provably even."""
    if not is_plain_load(operand): return None   # an expression of loads: computed element by element
    leaf = self.kernel.leaf_number(operand)
    st = self.kernel.sts[leaf]
    if len(st.views) != 1 or st.views[0].mask is not None or st.real_strides()[k_axis] != 1: return None
    index_node, _ = self._index_nodes(leaf, idxs)
    if not multiple_of(index_node, 2): return None
    vector = self.builder.add(UOps.LOAD, operand.dtype, (self.buffers[operand.arg.idx], self.node_to_uop(index_node)),
                              2)
    return [self.builder.add(UOps.GEP, operand.dtype, (vector,), element) for element in range(2)]

  def _store_outputs(self, idxs: list[Node], reduce_value: UOp | dict[int, UOp] | None) -> None:
    """Store every output of the kernel at one lane. All values are computed before the first store: an output may
    overwrite (in place) a buffer that another output's value still loads (an optimizer's m and its parameter). An
    output that keeps its own element where a condition is false (`kept_where`) is a store gated by it (the only
    output: its value computed under the condition too, `_store_kept`)."""
    build, stores = self.builder, self.kernel.stores
    if len(stores) == 1 and (kept := kept_where(self.kernel, 0)) is not None:
      self._store_kept(idxs, reduce_value, *kept)
      return
    values, gates = [], []
    for number, store in enumerate(stores):
      kept = kept_where(self.kernel, number)
      value = store.srcs[0] if kept is None else kept[1]
      values.append(self.compute(value, idxs, reduce_value))
      gates.append(None if kept is None else self.compute(kept[0], idxs, reduce_value))
    for number, (store, value, gate) in enumerate(zip(stores, values, gates)):
      index, valid = self._index(number, idxs)   # leaf `number` is output `number` (stores lead kernel.leaves)
      if gate is not None: valid = gate if valid is None else build.alu(Ops.AND, dtypes.bool, valid, gate)
      srcs = (self.buffers[store.arg.idx], index, value) + ((valid,) if valid is not None else ())
      build.add(UOps.STORE, None, srcs)

  def _store_kept(self, idxs: list[Node], reduce_value: UOp | dict[int, UOp] | None, condition: LazyOp,
                  value: LazyOp) -> None:
    """The one output's store of where(condition, value, its own element) at one lane (kept_where): the value is
    computed and stored inside an IF on the condition, so where it is false nothing is loaded or written."""
    build = self.builder
    index, valid = self._index(0, idxs)
    gate = valid if self.hoisted_gate is not None else self.compute(condition, idxs, reduce_value)
    if valid is not None and gate is not valid: gate = build.alu(Ops.AND, dtypes.bool, valid, gate)
    opened = build.add(UOps.IF, None, (gate,)) if gate is not None else None
    build.add(UOps.STORE, None, (self.buffers[self.kernel.stores[0].arg.idx], index,
                                 self.compute(value, idxs, reduce_value)))
    if opened is not None: build.end_if(opened)

  def _flat_index(self, axis_idxs: list[Node], axes: range) -> Node:
    """The row-major flat index over `axes` (the last one varying fastest), as thread ids are numbered."""
    flat: Node = NumNode(0)
    for axis in axes: flat = flat * self.kernel.full_shape[axis] + axis_idxs[axis]
    return flat

  def _prefetch_epilogue(self, axis_idxs: list[Node], output_lanes: list[tuple[int, ...]]) -> None:
    """The plain loads of the outputs' values outside the reduce (a residual added to a matrix-vector product), at
    each output lane, before the reduce loop: read while the reduce runs, where after the GROUP threads' combine
    (BARRIERs) they were a memory round trip at the kernel's end. The store reuses them (the builder merges equal
    loads); a load's view is size 1 along the reduced axes, so its index is the same inside and outside the loop."""
    kernel = self.kernel
    reduces = {id(reduce) for reduce in kernel.reduceops}
    leaves = {id(node): node for store in kernel.stores for node in _post_order(store.srcs[0], reduces)
              if node.op is Ops.LOAD and isinstance(node.arg, MemBuffer) and not node.srcs}
    zeros = (0,) * len(kernel.unroll_axes)
    for lane in output_lanes:
      idxs = self._fill_lanes(axis_idxs, kernel.upcast_axes, lane, kernel.unroll_axes, zeros)
      for leaf in leaves.values(): self.compute(leaf, idxs, None)

  def _combine_groups(self, accumulators: dict[tuple[int, ...], UOp], axis_idxs: list[Node],
                      op: Ops) -> tuple[dict[tuple[int, ...], UOp], UOp]:
    """Combine the per-thread partials of each output across the GROUP threads; returns the combined values (valid
    in thread 0 of each group) and the uop of the thread's index inside its group."""
    kernel, build = self.kernel, self.builder
    dtype = kernel.reduceop.dtype
    local_count, group_count = kernel.local_threads(), kernel.group_threads()
    local_index = self.node_to_uop(self._flat_index(axis_idxs, range(kernel.global_dims, kernel.first_reduce)))
    group_index = self.node_to_uop(self._flat_index(axis_idxs, range(kernel.first_reduce, kernel.first_loop_reduce)))
    values = dict(accumulators)
    width, stride = kernel.group_shuffle()
    if width > 1:
      values = {lane: build.add(UOps.WARP_REDUCE, dtype, (value,), (op, width, stride))
                for lane, value in values.items()}
    slots = group_count // width  # partials per output left after the shuffle, one per warp-run of the group
    if slots == 1: return values, group_index
    lanes = list(values)
    local = build.add(UOps.DEFINE_LOCAL, dtype, (), ("temp0", len(lanes) * local_count * slots))

    def address(lane_number: int, slot: UOp) -> UOp:
      output = build.alu(Ops.ADD, INDEX_DTYPE, local_index, self._int(lane_number * local_count))
      row = build.alu(Ops.MUL, INDEX_DTYPE, output, self._int(slots))
      return build.alu(Ops.ADD, INDEX_DTYPE, row, slot)

    slot = group_index if width == 1 else build.alu(Ops.IDIV, INDEX_DTYPE, group_index, self._int(width))
    writer = None
    if width > 1:  # one thread per warp-run writes its run's total
      position_in_run = build.alu(Ops.MOD, INDEX_DTYPE, group_index, self._int(width))
      writer = build.add(UOps.IF, None, (build.alu(Ops.CMPLT, dtypes.bool, position_in_run, self._int(1)),))
    for number, lane in enumerate(lanes): build.add(UOps.STORE, None, (local, address(number, slot), values[lane]))
    if writer is not None: build.end_if(writer)
    build.add(UOps.BARRIER, None)
    if width > 1 and slots <= width:
      # a warp total per warp-run (a few): every thread combines them itself, one BARRIER in all where a tree takes
      # one per halving (a decode step's output projections: 8 warps, 3 barriers less)
      combined = {}
      for number, lane in enumerate(lanes):
        total = build.add(UOps.LOAD, dtype, (local, address(number, self._int(0))))
        for part in range(1, slots):
          total = build.alu(op, dtype, total, build.add(UOps.LOAD, dtype, (local, address(number, self._int(part)))))
        combined[lane] = total
      return combined, group_index
    # a tree: while `count` partials are left, the first count//2 threads each combine a pair, in parallel
    count = slots
    while count > 1:
      half = (count + 1) // 2
      step = build.add(UOps.IF, None, (build.alu(Ops.CMPLT, dtypes.bool, group_index, self._int(count // 2)),))
      for number, _ in enumerate(lanes):
        mine = build.add(UOps.LOAD, dtype, (local, address(number, group_index)))
        other = build.add(UOps.LOAD, dtype, (local, address(number, build.alu(Ops.ADD, INDEX_DTYPE, group_index,
                                                                             self._int(half)))))
        build.add(UOps.STORE, None, (local, address(number, group_index), build.alu(op, dtype, mine, other)))
      build.end_if(step)
      build.add(UOps.BARRIER, None)
      count = half
    combined = {lane: build.add(UOps.LOAD, dtype, (local, address(number, self._int(0))))
                for number, lane in enumerate(lanes)}
    return combined, group_index

  def _thread_indices(self, sizes: Sequence[int], prefix: str, kind: AxisType, limits: Sequence[int]) -> list[Node]:
    """Index nodes for axes that become GPU block or thread indices. Up to three axes map to the launch's
    dimensions, the innermost axis on x; otherwise (more axes, or a size over a dimension's limit) all
    axes share one x index and are recovered with div/mod."""
    if not sizes: return []
    innermost_first = list(reversed(sizes))
    if len(sizes) <= len(limits) and all(sym_max(size) <= limit for size, limit in zip(innermost_first, limits)):
      nodes: list[Node] = []
      for axis, size in enumerate(sizes):
        name = f"{prefix}{axis}"
        arg = (name, size, len(sizes) - 1 - axis, kind)
        self.loop_vars[name] = self.builder.add(UOps.SPECIAL, INDEX_DTYPE, (), arg)
        nodes.append(_loop_index(name, size))
      return nodes
    total = 1
    for size in sizes: total *= size
    name = f"{prefix}0"
    self.loop_vars[name] = self.builder.add(UOps.SPECIAL, INDEX_DTYPE, (), (name, total, 0, kind))
    flat = _loop_index(name, total)
    nodes, inner = [], 1
    for size in reversed(sizes):
      nodes.append((flat // inner) % size)
      inner *= size
    return list(reversed(nodes))

  def _define_vars(self) -> None:
    """One DEFINE_VAR per symbolic Variable in the kernel's views (sorted by name: the launch passes the values in
    this order); index math and loop bounds then read the Variable as that kernel argument."""
    variables: dict[str, Variable] = {}
    for st in self.kernel.sts:
      for view in st.views:
        values = [*view.shape, *view.strides, view.offset, *(bound for dim in (view.mask or ()) for bound in dim)]
        for value in values:
          if is_symbolic(value): variables.update((var.expr, var) for var in value.vars())
    for name in sorted(variables):
      var = variables[name]
      self.loop_vars[name] = self.builder.add(UOps.DEFINE_VAR, INDEX_DTYPE, (), (name, var.min, var.max))

  def _bounded_end(self, axis_idxs: list[Node],
                   output_lanes: list[tuple[int, ...]]) -> tuple[UOp, frozenset[Node]] | None:
    """The end of the kernel's one reduce loop where bounded_loops.py finds one (over every output and unroll lane)."""
    kernel, axis = self.kernel, self.kernel.first_loop_reduce
    size = kernel.full_shape[axis]
    if is_symbolic(size): return None
    unroll_lanes = list(itertools.product(*[range(kernel.full_shape[a]) for a in kernel.unroll_axes]))
    lanes = [self._fill_lanes(axis_idxs, kernel.upcast_axes, lane, kernel.unroll_axes, unroll)
             for lane in output_lanes for unroll in unroll_lanes]
    return bounded_reduce_end(self, axis, size, lanes)

  def _open_loop(self, name: str, size: int | Node, kind: AxisType, end: UOp | None = None) -> UOp:
    """A loop over [0, size), or [0, end) where `end` (a UOp at most size) is given."""
    if end is None: end = self.node_to_uop(size) if is_symbolic(size) else self._int(size)
    loop = self.builder.add(UOps.RANGE, INDEX_DTYPE, (self._int(0), end), (name, kind))
    self.loop_vars[name] = loop
    return loop

  def _fill_lanes(self, axis_idxs: list[Node], upcast_axes: list[int], lane: Sequence[int],
                  unroll_axes: list[int], unroll_lane: Sequence[int]) -> list[Node]:
    """Per-axis indices: loop variables, with the upcast/unroll axes fixed to this lane's constants."""
    idxs = list(axis_idxs) + [NumNode(0)] * (self.kernel.shape_len - len(axis_idxs))
    for axis, value in zip(upcast_axes, lane): idxs[axis] = NumNode(value)
    for axis, value in zip(unroll_axes, unroll_lane): idxs[axis] = NumNode(value)
    return idxs

  def _index_nodes(self, leaf_number: int, idxs: list[Node]) -> tuple[Node, Node]:
    st = self.kernel.sts[leaf_number]
    # a view has size 1 where the full shape is reduced away: index 0 there
    own_idxs = [idx if st.shape[axis] != 1 else NumNode(0) for axis, idx in enumerate(idxs)]
    return st.expr_idxs(own_idxs)

  def _index(self, leaf_number: int, idxs: list[Node]) -> tuple[UOp, UOp | None]:
    """(index, valid) uops of a leaf's view; valid is None where always true."""
    index_node, valid_node = self._index_nodes(leaf_number, idxs)
    if self.implied_valid: valid_node = without_implied(valid_node, self.implied_valid)
    valid = None if (isinstance(valid_node, NumNode) and valid_node.b == 1) else valid_node
    if isinstance(valid_node, NumNode) and valid_node.b == 0: index_node = NumNode(0)
    return self.node_to_uop(index_node), (self.node_to_uop(valid) if valid is not None else None)

  # ---------------------------------------------------------------- the AST -> UOps

  def compute(self, root: LazyOp, idxs: list[Node], reduce_value: UOp | dict[int, UOp] | None) -> UOp:
    """UOps computing `root` at one lane; the kernel's reduce node stands for `reduce_value` (with sibling reduces, a
    map id(reduce) -> its value)."""
    build, values = self.builder, {}
    known = self._known_reduces(reduce_value)
    for node in _post_order(root, stops=set(known)):
      if id(node) in known:
        values[id(node)] = known[id(node)]
      elif node.op is Ops.LOAD:
        values[id(node)] = self._load(node, idxs, tuple(values[id(src)] for src in node.srcs))
      elif node.op is Ops.CONST:
        values[id(node)] = self._const(node, idxs)
      elif node.op is Ops.CAST:
        values[id(node)] = build.add(UOps.CAST, node.dtype, (values[id(node.srcs[0])],))
      elif node.op is Ops.BITCAST:
        values[id(node)] = build.add(UOps.BITCAST, node.dtype, (values[id(node.srcs[0])],))
      elif node.op is Ops.MULACC:
        a, b, c = (values[id(src)] for src in node.srcs)
        values[id(node)] = build.alu(Ops.ADD, node.dtype, build.alu(Ops.MUL, node.dtype, a, b), c)
      else:
        values[id(node)] = self._alu(node.op, node.dtype, tuple(values[id(src)] for src in node.srcs))
    return values[id(root)]

  def _alu(self, op: Ops, dtype: DType, srcs: tuple[UOp, ...]) -> UOp:
    """One ALU node of the AST (a subclass may lower an op to several, as the CPU row kernels' exp2)."""
    return self.builder.alu(op, dtype, *srcs)

  def _known_reduces(self, reduce_value: UOp | dict[int, UOp] | None) -> dict[int, UOp]:
    """id(reduce node) -> the UOp holding its result, for the reduces `compute` does not descend into: the kernel's
    reduce's value, or already that map (sibling reduces)."""
    if isinstance(reduce_value, dict): return reduce_value
    return {id(self.kernel.reduceop): reduce_value} if reduce_value is not None else {}

  def _load(self, node: LazyOp, idxs: list[Node], gathered: tuple[UOp, ...] = ()) -> UOp:
    if id(node) in self.tiles:   # staged in local memory (OptOps.SHARED)
      local, axes = self.tiles[id(node)]
      return self._tile_load(node, local, axes, idxs)
    return self._global_load(node, idxs, gathered)

  def _global_load(self, node: LazyOp, idxs: list[Node], gathered: tuple[UOp, ...] = ()) -> UOp:
    if not gathered:  # a gathered load's address depends on loaded data: never one vector access
      vector_element = self._vector_load(node, idxs)
      if vector_element is not None: return vector_element
    index, valid = self._index(self.leaf_index[id(node)], idxs)
    if gathered:  # a gathered LOAD: (element offset, validity) computed from other loads (see ops.LazyOp)
      offset, in_range = gathered
      index = self.builder.alu(Ops.ADD, INDEX_DTYPE, index, offset)
      valid = in_range if valid is None else self.builder.alu(Ops.AND, dtypes.bool, valid, in_range)
    if valid is not None and valid.op is UOps.CONST and not valid.arg:
      return self.builder.const(zero_of(node.dtype), node.dtype)
    gate = self.load_gate
    if gate is not None and not gathered:
      valid = gate if valid is None else self.builder.alu(Ops.AND, dtypes.bool, valid, gate)
    srcs = (self.buffers[node.arg.idx], index) + ((valid,) if valid is not None else ())
    return self.builder.add(UOps.LOAD, node.dtype, srcs)

  def _const(self, node: LazyOp, idxs: list[Node]) -> UOp:
    value = self.builder.const(node.arg.val, node.dtype)
    _, valid = self._index(self.leaf_index[id(node)], idxs)
    if valid is None: return value
    return self.builder.alu(Ops.WHERE, node.dtype, valid, value, self.builder.const(zero_of(node.dtype), node.dtype))


def _varies_along(node: LazyOp, axes: Iterable[int], views: dict[int, ShapeTracker]) -> bool:
  """Whether `node`'s value may change along any of `axes`: some load or constant under it (its ShapeTracker in
  `views`, by id) is not broadcast there (one view, size 1 or stride 0, unmasked along the axis)."""
  for leaf in node.walk():
    if leaf.op not in (Ops.LOAD, Ops.CONST): continue
    st = views[id(leaf)]
    if len(st.views) != 1: return True
    view = st.views[0]
    for axis in axes:
      if not (view.shape[axis] == 1 or view.strides[axis] == 0): return True
      if view.mask is not None and tuple(view.mask[axis]) != (0, view.shape[axis]): return True
  return False


def _loop_index(name: str, size: int | Node) -> Variable:
  """The index Variable of a loop or thread axis over [0, size); a symbolic size gives its largest range."""
  return Variable(name, 0, sym_max(size) - 1)


def _post_order(root: LazyOp, stops: set[int]) -> list[LazyOp]:
  """Nodes under `root`, sources first, not descending below the nodes whose ids are in `stops`. Iterative: fused
  chains can be long."""
  order, seen = [], set()
  stack: list[tuple[LazyOp, bool]] = [(root, False)]
  while stack:
    node, expanded = stack.pop()
    if expanded:
      order.append(node)
      continue
    if id(node) in seen: continue
    seen.add(id(node))
    stack.append((node, True))
    if id(node) not in stops: stack.extend((src, False) for src in reversed(node.srcs))
  return order


def linearize(kernel: Kernel) -> list[UOp]:
  if kernel.row_axes is not None:
    # imported here: the row linearizers build on Linearizer, so their modules import this one
    from ourgrad.codegen.row_blocks import BlockRowLinearizer
    from ourgrad.codegen.row_linearizer import RowLinearizer
    # a block per row where the GPU has local memory for the block's partials; else a thread (a CPU loop) per row
    if kernel.renderer.has_threads and kernel.renderer.has_local: return BlockRowLinearizer(kernel).linearize()
    return RowLinearizer(kernel).linearize()
  return Linearizer(kernel).linearize()


def _k_neighbours(position_of: Callable, axes: tuple[int, int], k_axis: int, pair: int) -> bool:
  """Whether fragment elements 2 pair and 2 pair + 1 lie next to each other along K (m16n8k16: yes; TF32: no)."""
  low, high = position_of(2 * pair), position_of(2 * pair + 1)
  return all(high_coordinate == (low_coordinate[0] + (axis == k_axis), *low_coordinate[1:])
             for axis, low_coordinate, high_coordinate in zip(axes, low, high))
