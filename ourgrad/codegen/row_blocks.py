"""Lower a row kernel (codegen/row_linearizer.py) to UOps on a GPU with thread blocks and local memory.

A block owns a row (short rows of a kernel with many rows: a group of up to a warp's threads owns a row, several rows
to a block, see row_sharing). Thread t of T takes the row's elements in units of `width` neighbours (float4 where the
loads allow it), units t, t + T, t + 2T, ... (neighbouring threads read neighbouring addresses). Each reduce
accumulates a partial per thread, then the block combines them: a warp shuffle where the device has one, each warp's
total through local memory and a BARRIER, after which every thread sums the warps' totals itself (so every thread
holds the result, no second broadcast); without shuffles a tree in local memory, read back by all threads. When a
thread's share of the row is small (PERSISTENT_UNITS), its units are unrolled: every pass over the row is
straight-line code over the same loads, which the builder merges, so the row is read from memory once and stays in
registers (a persistent reduction; exp(x - max) is computed once too). Longer rows loop, re-reading the row (from L2)
at each pass.
"""
from __future__ import annotations

import math
from typing import Callable

from ourgrad.codegen.bounded_loops import row_end
from ourgrad.codegen.element_reduces import (ELEMENT_ROW_BYTES, ElementStage, is_element_leaf, shared_across_rows,
                                             staged_bytes, stacked_rows, unflatten)
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import INDEX_DTYPE, _post_order, reduce_identity
from ourgrad.codegen.online_rows import RowPass, ShiftTerms, group_row_passes
from ourgrad.codegen.row_interleave import footprint, interleaved_combine, interleaved_rows
from ourgrad.codegen.row_linearizer import RowLinearizer, accumulate_op
from ourgrad.codegen.row_passes import RowPasses, register_units
from ourgrad.codegen.shared_tile_fill import multiple_of
from ourgrad.codegen.uops import AxisType, UOp, UOps
from ourgrad.helpers import STACK_MANY_ROWS
from ourgrad.dtype import dtypes
from ourgrad.ops import LazyOp, MemBuffer, Ops
from ourgrad.shape.shapetracker import ShapeTracker
from ourgrad.shape.symbolic import Node, NumNode, Variable

# A GPU thread keeps at most this many units (float4s, or scalars) of its row in registers: 8 float4s = 32 floats,
# enough for 8192-float rows with 256 threads and 32768-float rows with 1024, without spilling. A unit of 8 16-bit
# floats (16 bytes) counts as two (register_units).
PERSISTENT_UNITS = 8
# the block of a streamed row (one that loops at any block size) where the kernel has rows enough (_row_layout)
STREAMED_ROW_THREADS = 256
# The smallest block a row gets when the row has that many units: enough threads in flight per SM for short rows.
MIN_ROW_THREADS = 128


# Short rows in a kernel of many rows share a block (see row_sharing): each row gets the fewest threads (a power of two,
# at most a warp) that leave each thread at most SHARED_ROW_UNITS units, and the block holds SHARED_ROW_BLOCK threads.
# (MiniLM, batch 64 x 32 tokens: softmax rows of 32 floats had a warp of which 8 lanes worked, 24576 blocks; layernorm
# rows of 384 floats a block of 128 threads, one float4 each.)
SHARED_ROW_UNITS = 2
# Rows that share a broadcast operand and are computed by one thread group side by side (_stacked_rows): their
# accumulators and their own loads stay in registers at once.
MAX_STACKED_ROWS = 8
SHARED_ROW_BLOCK = 128
# the threads of the one block of a row kernel with final reduces (_linearize_final_rows)
FINAL_ROWS_BLOCK = 256


def row_sharing(rows: int, units: int, warp_size: int, multiprocessors: int) -> tuple[int, int]:
  """(threads per row, rows per block) of a GPU row kernel with `rows` rows of `units` units each. A row of at most a
  warp's threads x PERSISTENT_UNITS units shares its block with other rows when the kernel has rows enough to give
  every multiprocessor a block twice over (`multiprocessors` 0: unknown, rows are shared whenever they divide): its
  threads are a power of two up to a warp (their partials meet by a shuffle inside the warp: no local memory, no
  barrier), the rows per block a power of two dividing `rows`. (0, 1) where rows are not shared (a block per row,
  row_block_threads)."""
  if warp_size < 2 or units > warp_size * PERSISTENT_UNITS: return 0, 1
  threads = min(1 << (math.ceil(units / SHARED_ROW_UNITS) - 1).bit_length(), warp_size)
  per_block = max(SHARED_ROW_BLOCK // threads, 1)
  while per_block > 1 and (rows % per_block or rows // per_block < 2 * multiprocessors): per_block //= 2
  return (threads, per_block) if per_block > 1 else (0, 1)


def row_block_threads(units: int, max_threads: int, warp_size: int) -> int:
  """Threads of the block owning a row of `units` units: a power of two, enough that each thread keeps at most
  PERSISTENT_UNITS units (when the block limit allows), at least a warp, at most the device's block size."""
  wanted = max(math.ceil(units / PERSISTENT_UNITS), min(MIN_ROW_THREADS, units), warp_size, 1)
  return min(1 << (wanted - 1).bit_length(), max_threads)


class BlockRowLinearizer(RowLinearizer):
  """Builds the UOps of a row kernel on a GPU with local memory: a block (or a group of a block's threads) per row."""

  def __init__(self, kernel: Kernel):
    super().__init__(kernel)
    # while a GPU pass computes one element of a unit: (the unit's first element's indices, width, lane), which
    # _vector_load uses to read the unit as one vector
    self.vector_unit: tuple[list[Node], int, int] | None = None
    # a GPU block's element reduces, computed into local memory before the row passes (codegen/element_reduces.py)
    self.element_stage: ElementStage | None = None

  def linearize(self) -> list[UOp]:
    self._define_buffers()
    self._define_vars()   # the Variables of masks' bounds (a cache read up to the slots in use)
    return self._linearize_block_rows()

  def compute(self, root: LazyOp, idxs: list[Node], reduce_value: UOp | dict[int, UOp] | None) -> UOp:
    stage = self.element_stage
    if stage is None: return super().compute(root, idxs, reduce_value)
    # the element reduces this value reads (not those under a reduce whose value is known: the store's)
    reached = {id(node) for node in _post_order(root, set(self._known_reduces(reduce_value)))}
    reads = [reduce for reduce in self.kernel.element_reduces if id(reduce) in reached]
    if not reads: return super().compute(root, idxs, reduce_value)
    saved = self.reduce_values   # the element reduces at this element: read back from the block's staged row
    self.reduce_values = {**saved, **{id(reduce): stage.value(reduce, idxs) for reduce in reads}}
    try:
      return super().compute(root, idxs, reduce_value)
    finally:
      self.reduce_values = saved

  def _linearize_block_rows(self) -> list[UOp]:
    kernel, build, shape = self.kernel, self.builder, self.kernel.full_shape
    row_axes = list(kernel.row_axes or ())
    row_dims = [axis for axis in range(len(shape)) if axis not in row_axes and axis not in kernel.element_axes]
    rows, length = math.prod(shape[axis] for axis in row_dims), math.prod(shape[axis] for axis in row_axes)
    width = self._row_vector_width()
    units = length // width
    if kernel.final_reduces: return self._linearize_final_rows(rows, row_dims, units, width)
    stack_axis, stack = self._stacked_rows(row_dims)
    # element reduces: a staged row for each stacked row they differ along, within the local memory of one row's
    if kernel.element_reduces and staged_bytes(kernel, stack_axis, stack) > staged_bytes(kernel, None, 1) and \
        staged_bytes(kernel, stack_axis, stack) > ELEMENT_ROW_BYTES: stack_axis, stack = None, 1
    held = register_units(units, width)   # the layouts count a row in float4s of registers
    threads, per_block = self._row_layout(rows // stack, held)
    # stacked rows keep their units in registers, and do not cost rows that share blocks (a warp's shuffles each) a
    # block of their own (fewer rows: a barrier per reduce and stacked row)
    if stack > 1 and (math.ceil(held / threads) > PERSISTENT_UNITS or
                      (per_block == 1 and self._row_layout(rows, held)[1] > 1)):
      stack_axis, stack = None, 1
      threads, per_block = self._row_layout(rows, held)
    rows //= stack
    # stacked rows interleave along another row axis (the stacked one's rows are a thread's, side by side)
    interleave = interleaved_rows(kernel, row_dims, rows) if stack_axis is None or stack_axis != row_dims[-1] else 1
    if interleave > 1:   # a block of `interleave` rows, at least a warp of threads, at most the device's block
      threads = max(min(threads, kernel.renderer.max_threads // interleave), kernel.renderer.warp_size // interleave)
      per_block = interleave
    if kernel.element_reduces and interleave == 1 and per_block > 1:
      # rows sharing a block share its staged element reduces (a piece of decode attention's scores, a dot product
      # each): as many neighbouring rows as a block holds, so that fewer blocks compute the same scores again
      across, limit = shape[row_dims[-1]], kernel.renderer.max_threads // threads
      per_block = max(count for count in range(per_block, min(across, limit) + 1)
                      if across % count == 0 and rows % count == 0) if per_block <= min(across, limit) else per_block
    if kernel.element_reduces and not shared_across_rows(self, row_dims, per_block):
      interleave, per_block = 1, 1   # a block a row: its own staged row
      threads = row_block_threads(register_units(units, width), kernel.renderer.max_threads, kernel.renderer.warp_size)
    blocks, block_threads = rows // per_block, threads * per_block
    self.loop_vars["gidx0"] = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("gidx0", blocks, 0, AxisType.GLOBAL))
    self.loop_vars["lidx0"] = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("lidx0", block_threads, 0, AxisType.LOCAL))
    block, block_thread = Variable("gidx0", 0, blocks - 1), Variable("lidx0", 0, block_threads - 1)
    # rows sharing a block: neighbouring groups of `threads` threads take neighbouring rows; interleaved rows:
    # neighbouring threads take neighbouring rows, the threads of a row `interleave` apart
    row: Node = block if per_block == 1 else block * per_block + block_thread // threads
    thread: Node = block_thread if per_block == 1 else block_thread % threads
    if interleave > 1: row, thread = block * per_block + block_thread % interleave, block_thread // interleave
    lanes = (block_thread % interleave, interleave) if interleave > 1 else None
    idxs: list[Node] = [NumNode(0)] * len(shape)
    sizes = [shape[axis] // (stack if axis == stack_axis else 1) for axis in row_dims]
    for axis, node in zip(row_dims, unflatten(row, sizes)): idxs[axis] = node
    per_thread = math.ceil(register_units(units, width) / threads)
    # rows whose reduces gain nothing past a Variable bound stop there (codegen/bounded_loops.py `row_end`)
    end = row_end(kernel)
    passes = RowPasses(self, idxs, thread, threads, units, width, persistent=per_thread <= PERSISTENT_UNITS, end=end)
    # a persistent row's loads are issued first, before the element reduces' staging too (softmax @ V's values do not
    # depend on the staged scores: after the staging's BARRIER they were a round trip to memory of their own)
    if passes.persistent and stack_axis is None: self._prefetch_row(passes)
    if kernel.element_reduces:   # staged for the block's first row, which every row of the block reads
      first_row = [NumNode(0)] * len(shape)
      for axis, node in zip(row_dims, unflatten(block * per_block, sizes)): first_row[axis] = node
      self.element_stage = ElementStage(self, stacked_rows(first_row, stack_axis, stack, kernel), block_thread,
                                        block_threads, end)
    if stack_axis is not None:
      return self._linearize_stacked_rows(idxs, stack_axis, stack, thread, threads, units, width, lanes, end)
    resident = getattr(kernel.renderer, "threads_per_multiprocessor", 0) // block_threads
    if not passes.persistent and resident > 1:
      # a streamed row's loads in flight come from its resident blocks: the compiler's unrolling of the loop must not
      # take the registers of one of them (GPT-2's vocabulary softmax: 24 -> 38 registers, 2 -> 1 block of 1024)
      build.add(UOps.OCCUPANCY, None, (), resident)
    self._run_row_reduces(passes, lambda accumulator, reduce, number: self._block_combine(
      accumulator, accumulate_op(reduce), thread, threads, number, lanes),
      lambda items: self._combine_level([(accumulator, accumulate_op(reduce), number)
                                         for accumulator, reduce, number in items], thread, threads, lanes))
    if self._per_element():
      passes.run("sidx", None, store=True)
      return build.uops
    first_thread = build.add(UOps.IF, None, (self.node_to_uop(thread < 1),))   # a per-row output: thread 0 stores
    self._store_outputs(idxs, None)
    build.end_if(first_thread)
    return build.uops

  def _prefetch_row(self, passes: RowPasses) -> None:
    """Every plain load of the row reduces' inputs at each of the thread's persistent units (a ragged last one's
    gated by its IF's condition, RowPasses.run's `unguarded`), before the first reduce:
    the passes after it reuse them (the builder merges equal loads), so all of the row's reads are in flight at once.
    Emitted in the pass that first reads them, a later pass's loads (softmax @ V's values, after the max) would wait
    for the block combine before them: a BARRIER, across which the compiler does not move loads."""
    reduces = {id(reduce) for reduce in self.kernel.reduceops}
    leaves = {id(node): node for reduce in self._row_reduces() for node in _post_order(reduce.srcs[0], reduces)
              if node.op is Ops.LOAD and isinstance(node.arg, MemBuffer) and not node.srcs}
    passes.run("prefetch", lambda idxs: [self.compute(leaf, idxs, None) for leaf in leaves.values()], unguarded=True)

  def _row_layout(self, rows: int, units: int) -> tuple[int, int]:
    """(threads per row, rows per block) of `rows` rows of `units` units on this GPU (row_sharing, else a block)."""
    renderer = self.kernel.renderer
    threads, per_block = row_sharing(rows, units, renderer.warp_size, getattr(renderer, "multiprocessors", 0))
    if per_block == 1: threads = row_block_threads(units, renderer.max_threads, renderer.warp_size)
    # a row that loops even with the largest block is streamed: with rows enough to fill every multiprocessor with
    # blocks of STREAMED_ROW_THREADS, smaller blocks, several resident at once, whose passes and block combines (no
    # load in flight) do not coincide; one block of 1024 a row left GPT-2's bf16 cross-entropy row at 55% of copy
    resident = getattr(renderer, "threads_per_multiprocessor", 0) // STREAMED_ROW_THREADS
    if per_block == 1 and math.ceil(units / threads) > PERSISTENT_UNITS and threads > STREAMED_ROW_THREADS and \
        resident > 1 and rows >= resident * max(1, getattr(renderer, "multiprocessors", 0)):
      threads = STREAMED_ROW_THREADS
    return threads, per_block

  def _stacked_rows(self, row_dims: list[int]) -> tuple[int | None, int]:
    """(axis, rows) of the rows one thread group computes side by side (`_linearize_stacked_rows`), else (None, 1):
    along a row axis over which the kernel's largest operand is broadcast (a matrix-vector product's weights against
    a few sequences, x (S, k) @ W.T: W is the same for every sequence; grouped-query attention's values for the
    query heads of a group), at most MAX_STACKED_ROWS (a divisor of the axis). Only where the broadcast loads hold
    more bytes than the kernel's other loads: a small operand (x against W's rows) is re-read from cache anyway, and
    stacking would only take parallelism away. Rows with per-element outputs (softmax) are not stacked: each row's
    store pass is its own."""
    kernel = self.kernel
    if self._per_element() or not kernel.renderer.has_local: return None, 1
    shape = kernel.full_shape
    loads = [leaf for leaf in kernel.leaves if leaf.op is Ops.LOAD]
    best: tuple[float, int | None, int] = (0.0, None, 1)
    for axis in row_dims:
      stack = max(count for count in range(1, MAX_STACKED_ROWS + 1) if shape[axis] % count == 0)
      if stack < 2: continue
      broadcast = [not leaf.srcs and _broadcast_along(leaf.arg.st, axis) for leaf in loads]
      shared = sum(footprint(leaf, shape) for leaf, flag in zip(loads, broadcast) if flag)
      others = sum(footprint(leaf, shape) for leaf, flag in zip(loads, broadcast) if not flag)
      saved = shared * (stack - 1) / stack
      if shared > others and saved > best[0]: best = (saved, axis, stack)
    return best[1:] if best[1] is not None else self._stacked_many_rows(row_dims, loads)

  def _stacked_many_rows(self, row_dims: list[int], loads: list[LazyOp]) -> tuple[int | None, int]:
    """(axis, rows) where a kernel's rows are so many that their thread groups fill the GPU several times over (a
    vocabulary's logits, 49152 rows x a warp: ~6 waves of the H200's resident threads) and some load is broadcast
    along the innermost row axis (x and its norm's weight): a thread group computes that many rows side by side,
    as many (a power of two, at most MAX_STACKED_ROWS) as still leave every resident thread of every multiprocessor
    a row's share. Each wave of such a kernel was a round trip to memory with a few hundred bytes in flight a warp;
    stacked, each warp has its rows' loads in flight at once, and what the rows share (x times the norm's weight,
    the norm's sum of squares) is computed once for them. Else (None, 1). (Stacking further, while each warp
    scheduler keeps a warp, was slower on the H200: 4 rows a warp of the bf16 gate/up product 1.91 -> 2.18 us, a
    4096 x 11008 Q8_0 product's 8 rows of 4096 23.4 -> 28.2 us.)"""
    kernel, shape = self.kernel, self.kernel.full_shape
    renderer = kernel.renderer
    capacity = getattr(renderer, "threads_per_multiprocessor", 0) * getattr(renderer, "multiprocessors", 0)
    axis = row_dims[-1] if row_dims else None
    if not STACK_MANY_ROWS.value or not capacity or axis is None: return None, 1
    if not any(not leaf.srcs and _broadcast_along(leaf.arg.st, axis) for leaf in loads): return None, 1
    rows = math.prod(shape[dim] for dim in row_dims)
    length = math.prod(shape[dim] for dim in kernel.row_axes or ())
    width = self._row_vector_width()
    threads, _ = self._row_layout(rows, register_units(length // width, width))
    stack = 1
    while stack * 2 <= MAX_STACKED_ROWS and shape[axis] % (stack * 2) == 0 and \
        rows // (stack * 2) * threads >= capacity:
      stack *= 2
    return (axis, stack) if stack > 1 else (None, 1)

  def _linearize_stacked_rows(self, idxs: list[Node], axis: int, stack: int, thread: Node, threads: int, units: int,
                              width: int, lanes: tuple[Node, int] | None = None, end: Node | None = None) -> list[UOp]:
    """Rows `stack` apart along `axis` (`_stacked_rows`), computed by one thread group one after another in
    straight-line code: their units persistent in registers, the loads they share (a broadcast weight row) are the
    same UOps, which the builder merges, so the shared operand is read once for all of them (a batched
    matrix-vector product reads its weights once, not once per sequence). A reduce that does not vary along `axis`
    (softmax's max and sum beside a weighted sum over several outputs) is computed for the first row only. The
    outputs are stored after every row's reduces (all values computed first, as `_store_outputs` does)."""
    build = self.builder
    reduces = self._row_reduces()
    independent = [reduce for reduce in reduces if not self._varies_along(reduce, axis)]
    shared: dict[int, UOp] = {}
    stacked: list[tuple[list[Node], dict[int, UOp]]] = []
    every_idxs = [[*idxs[:axis], idxs[axis] * stack + sub, *idxs[axis + 1:]] for sub in range(stack)]
    for sub_idxs in every_idxs: self._prefetch_row(RowPasses(self, sub_idxs, thread, threads, units, width, True, end))
    for sub, sub_idxs in enumerate(every_idxs):
      self.reduce_values = dict(shared)
      if self.element_stage is not None: self.element_stage.select(sub)
      passes = RowPasses(self, sub_idxs, thread, threads, units, width, persistent=True, end=end)
      offset = sub * len(reduces)   # each row's local memory (a block's partials) of its own
      self._run_row_reduces(passes, lambda accumulator, reduce, number: self._block_combine(
        accumulator, accumulate_op(reduce), thread, threads, number + offset, lanes))
      if sub == 0: shared = {id(reduce): self.reduce_values[id(reduce)] for reduce in independent}
      stacked.append((sub_idxs, dict(self.reduce_values)))
    first_thread = build.add(UOps.IF, None, (self.node_to_uop(thread < 1),))   # per-row outputs: thread 0 stores
    for sub_idxs, values in stacked:
      self.reduce_values = values
      self._store_outputs(sub_idxs, None)
    build.end_if(first_thread)
    return build.uops

  def _varies_along(self, root: LazyOp, axis: int) -> bool:
    """Whether `root`'s value may differ along `axis`: a leaf under it (gathered loads' offsets included) is not
    broadcast along it."""
    return any(node.op in (Ops.LOAD, Ops.CONST) and not _broadcast_along(node.arg.st, axis) for node in root.walk())

  def _run_row_reduces(self, passes: RowPasses, combine: Callable[[UOp, LazyOp, int], UOp],
                       combine_level: Callable[[list[tuple[UOp, LazyOp, int]]], list[UOp]] | None = None) -> None:
    """Each row reduce of a GPU row kernel: a per-thread accumulator over a pass of the row, then the value
    `combine(accumulator, reduce, number)` gives the rest of the kernel (a later reduce may read it). A persistent row
    (in registers) takes a pass per reduce, the loads shared; a looping row groups its reduces into as few passes as
    their dependencies allow (codegen/online_rows.py: a max and the sums of exp2 relative to it in one pass).
    `combine_level`: a persistent row's reduces that read none of each other (softmax @ V's sum of exp and sum of
    exp * v, both after the max) are combined together, one BARRIER for all (`_combine_level`)."""
    build = self.builder
    reduces = self._row_reduces()
    numbers = {id(reduce): number for number, reduce in enumerate(reduces)}
    reduces = [reduce for reduce in reduces if id(reduce) not in self.reduce_values]   # stacked rows: shared ones
    if passes.persistent and combine_level is not None:
      level: list[tuple[UOp, LazyOp, int]] = []
      for reduce in reduces:
        if any(node is other for _, other, _ in level for node in reduce.srcs[0].walk()):
          self._finish_level(level, combine_level)
          level = []
        accumulator = build.add(UOps.DEFINE_ACC, reduce.dtype, (), reduce_identity(reduce.op, reduce.dtype))

        def accumulate_one(element_idxs: list[Node], reduce: LazyOp = reduce, accumulator: UOp = accumulator) -> None:
          value = self.compute(reduce.srcs[0], element_idxs, None)
          build.add(UOps.ACCUMULATE, reduce.dtype, (accumulator, value), accumulate_op(reduce))
        passes.run(f"ridx{numbers[id(reduce)]}", accumulate_one, reads=[reduce.srcs[0]])
        level.append((accumulator, reduce, numbers[id(reduce)]))
      self._finish_level(level, combine_level)
      return
    groups = [RowPass([reduce]) for reduce in reduces] if passes.persistent else group_row_passes(reduces)
    for group in groups:
      accumulators = {id(reduce): build.add(UOps.DEFINE_ACC, reduce.dtype, (), reduce_identity(reduce.op, reduce.dtype))
                      for reduce in group.reduces}
      name = f"ridx{numbers[id(group.reduces[0])]}"
      if len(group.reduces) == 1:
        reduce, accumulator = group.reduces[0], accumulators[id(group.reduces[0])]

        def accumulate(element_idxs: list[Node], reduce: LazyOp = reduce, accumulator: UOp = accumulator) -> None:
          value = self.compute(reduce.srcs[0], element_idxs, None)
          build.add(UOps.ACCUMULATE, reduce.dtype, (accumulator, value), accumulate_op(reduce))
        passes.run(name, accumulate, reads=[reduce.srcs[0]])
      else:
        passes.run(name, None, each_unit=lambda lanes, group=group: self._accumulate_unit(group, accumulators, lanes,
                                                                                      passes.width, passes.idxs),
                   reads=[reduce.srcs[0] for reduce in group.reduces])
      for reduce in group.reduces:   # the maxes first: the online sums are rescaled to the block's max
        if id(reduce) not in group.online:
          self.reduce_values[id(reduce)] = combine(accumulators[id(reduce)], reduce, numbers[id(reduce)])
      for reduce in group.reduces:
        if id(reduce) not in group.online: continue
        peak, terms = group.online[id(reduce)]
        factor = self._rescale(terms, peak, accumulators[id(peak)], self.reduce_values[id(peak)],
                               accumulators[id(reduce)], passes.idxs)
        partial = build.alu(Ops.MUL, reduce.dtype, accumulators[id(reduce)], factor)
        self.reduce_values[id(reduce)] = combine(partial, reduce, numbers[id(reduce)])

  def _finish_level(self, level: list[tuple[UOp, LazyOp, int]],
                    combine_level: Callable[[list[tuple[UOp, LazyOp, int]]], list[UOp]]) -> None:
    """The values of a level of independent reduces (accumulated: (accumulator, reduce, number) each), combined."""
    for (_, reduce, _), value in zip(level, combine_level(level)): self.reduce_values[id(reduce)] = value

  def _combine_level(self, items: list[tuple[UOp, Ops, int]], thread: Node, threads: int,
                     lanes: tuple[Node, int] | None) -> list[UOp]:
    """`_block_combine` of several partials ((partial, op, number) each) that read none of each other: each one's
    shuffles and local-memory write first, then one BARRIER, then each one's reads, where one at a time was a
    BARRIER each. Combines without local memory (a row inside a warp) are `_block_combine`'s."""
    build, warp_size = self.builder, self.kernel.renderer.warp_size
    if lanes is not None:   # interleaved rows (codegen/row_interleave.py): a row's threads `interleave` lanes apart
      place, interleave = lanes
      in_warp = min(threads, warp_size // interleave)
      index, places = thread // in_warp * interleave + place, [place + warp * interleave for warp in
                                                               range(threads // in_warp)]
    elif warp_size >= 2 and threads % warp_size == 0:
      in_warp, interleave = warp_size, 1
      index, places = thread // warp_size, [NumNode(warp) for warp in range(threads // warp_size)]
    else: in_warp, interleave, places = 0, 1, []
    if len(items) == 1 or len(places) < 2:
      return [self._block_combine(partial, op, thread, threads, number, lanes) for partial, op, number in items]
    reduced = [build.add(UOps.WARP_REDUCE, partial.dtype, (partial,), (op, in_warp, interleave))
               for partial, op, _ in items]
    memories = [build.add(UOps.DEFINE_LOCAL, partial.dtype, (), (f"row{number}", len(places) * interleave))
                for partial, _, number in items]
    writer = build.add(UOps.IF, None, (self.node_to_uop(thread % in_warp < 1),))
    for memory, value in zip(memories, reduced): build.add(UOps.STORE, None, (memory, self.node_to_uop(index), value))
    build.end_if(writer)
    build.add(UOps.BARRIER, None)
    totals = []
    for memory, (partial, op, _) in zip(memories, items):
      total = build.add(UOps.LOAD, partial.dtype, (memory, self.node_to_uop(places[0])))
      for slot in places[1:]:
        other = build.add(UOps.LOAD, partial.dtype, (memory, self.node_to_uop(slot)))
        total = build.alu(op, partial.dtype, total, other)
      totals.append(total)
    return totals

  def _lane_values(self, node: LazyOp, lanes: list[list[Node]], width: int) -> list[UOp]:
    """`node` at each element of a unit (`lanes`: each element's indices; vector loads where they apply)."""
    values = []
    for lane, element_idxs in enumerate(lanes):
      self.vector_unit = (lanes[0], width, lane) if width > 1 else None
      values.append(self.compute(node, element_idxs, None))
    self.vector_unit = None
    return values

  def _accumulate_unit(self, group: RowPass, accumulators: dict[int, UOp], lanes: list[list[Node]], width: int,
                       idxs: list[Node]) -> None:
    """One unit of a pass computing several reduces: each plain reduce adds the unit's elements; each running max
    takes the unit's max, and each online sum is first rescaled from the old running max to the new one, then adds
    its terms computed relative to the new max. The running maxes are updated last (the rescale reads them)."""
    build = self.builder
    peaks = group.peaks()
    followed = {id(peak) for peak in peaks}
    for reduce in group.reduces:
      if id(reduce) in group.online or id(reduce) in followed: continue
      for value in self._lane_values(reduce.srcs[0], lanes, width):
        build.add(UOps.ACCUMULATE, reduce.dtype, (accumulators[id(reduce)], value), accumulate_op(reduce))
    unit_peaks, new_peaks = {}, {}
    for peak in peaks:
      values = self._lane_values(peak.srcs[0], lanes, width)
      unit_peak = values[0]
      for value in values[1:]: unit_peak = build.alu(Ops.MAX, peak.dtype, unit_peak, value)
      unit_peaks[id(peak)] = unit_peak
      new_peaks[id(peak)] = build.alu(Ops.MAX, peak.dtype, accumulators[id(peak)], unit_peak)
    for reduce in group.reduces:
      if id(reduce) not in group.online: continue
      peak, terms = group.online[id(reduce)]
      accumulator = accumulators[id(reduce)]
      factor = self._rescale(terms, peak, accumulators[id(peak)], new_peaks[id(peak)], accumulator, idxs)
      build.add(UOps.ACCUMULATE, reduce.dtype, (accumulator, factor), Ops.MUL)
      self.reduce_values[id(peak)] = new_peaks[id(peak)]
      # while the running max is -inf every x seen is -inf: each adds 0 (exp2(-inf - -inf) would be nan)
      seen_finite = build.alu(Ops.CMPNE, dtypes.bool, new_peaks[id(peak)], build.const(-math.inf, peak.dtype))
      for value in self._lane_values(reduce.srcs[0], lanes, width):
        value = build.alu(Ops.WHERE, reduce.dtype, seen_finite, value, build.const(0.0, reduce.dtype))
        build.add(UOps.ACCUMULATE, reduce.dtype, (accumulator, value), Ops.ADD)
      del self.reduce_values[id(peak)]
    for peak in peaks:
      build.add(UOps.ACCUMULATE, peak.dtype, (accumulators[id(peak)], unit_peaks[id(peak)]), Ops.MAX)

  def _rescale(self, terms: ShiftTerms, peak: LazyOp, old: UOp, new: UOp, total: UOp, idxs: list[Node]) -> UOp:
    """exp2(P(new) - P(old)), P the max's part of the exponent (`terms`): the factor that turns the sum `total`
    relative to the max `old` into one relative to `new`; 1 where they are equal (both -inf too, where P(new) - P(old)
    is nan) and where the sum is 0 (no terms yet: logsumexp's shift where(isinf(max), 0, max) is 0 for a running max
    of -inf, and exp2(-P(new)) can overflow for a very negative new max, 0 * inf = nan)."""
    build, dtype = self.builder, peak.dtype
    difference: UOp | None = None
    known = self.reduce_values.get(id(peak))   # the block's max, once combined: put back afterwards
    for coefficient, term in terms:
      self.reduce_values[id(peak)] = new
      at_new = self.compute(term, idxs, None)
      self.reduce_values[id(peak)] = old
      at_old = self.compute(term, idxs, None)
      step = build.alu(Ops.ADD, dtype, at_new, build.alu(Ops.NEG, dtype, at_old))
      part = build.alu(Ops.MUL, dtype, step, build.const(coefficient, dtype))
      difference = part if difference is None else build.alu(Ops.ADD, dtype, difference, part)
    if known is None: del self.reduce_values[id(peak)]
    else: self.reduce_values[id(peak)] = known
    assert difference is not None
    factor = self._alu(Ops.EXP2, dtype, (difference,))
    moved = build.alu(Ops.AND, dtypes.bool, build.alu(Ops.CMPNE, dtypes.bool, old, new),
                      build.alu(Ops.CMPNE, dtypes.bool, total, build.const(0.0, dtype)))
    return build.alu(Ops.WHERE, dtype, moved, factor, build.const(1.0, dtype))

  def _linearize_final_rows(self, rows: int, row_dims: list[int], units: int, width: int) -> list[UOp]:
    """A row kernel with final reduces on a GPU: one block. Its threads are groups of `threads` (a power of two, at
    most a warp) that each own a row at a time, as rows sharing a block do (row_sharing); group g takes rows g,
    g + G, g + 2G, ... (G groups, G a divisor of the rows, at most FINAL_ROWS_BLOCK threads in all), runs the rows'
    reduces and adds the row's value of each final reduce to its accumulator (every thread of the group holds the
    same). After the rows the block combines the groups' accumulators (a group's first thread gives its own, the
    others the identity) and thread 0 stores. A small loss over a batch (the launch it saves is worth more than the
    rows a single block cannot spread over the device: kernel_walk.MAX_FINAL_REDUCE_ELEMENTS)."""
    kernel, build, shape = self.kernel, self.builder, self.kernel.full_shape
    warp_size = max(kernel.renderer.warp_size, 1)
    threads = min(1 << (math.ceil(units / SHARED_ROW_UNITS) - 1).bit_length(), warp_size)
    groups = max(count for count in range(1, max(FINAL_ROWS_BLOCK // threads, 1) + 1) if rows % count == 0)
    block_threads = threads * groups
    self.loop_vars["gidx0"] = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("gidx0", 1, 0, AxisType.GLOBAL))
    self.loop_vars["lidx0"] = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("lidx0", block_threads, 0, AxisType.LOCAL))
    block_thread = Variable("lidx0", 0, block_threads - 1)
    thread, group = block_thread % threads, block_thread // threads
    finals = [build.add(UOps.DEFINE_ACC, final.dtype, (), reduce_identity(final.op, final.dtype))
              for final in kernel.final_reduces]
    row_loop = self._open_loop("fidx", rows // groups, AxisType.REDUCE)
    row = Variable("fidx", 0, rows // groups - 1) * groups + group
    idxs: list[Node] = [NumNode(0)] * len(shape)
    for axis, node in zip(row_dims, unflatten(row, [shape[axis] for axis in row_dims])): idxs[axis] = node
    per_thread = math.ceil(register_units(units, width) / threads)
    passes = RowPasses(self, idxs, thread, threads, units, width, persistent=per_thread <= PERSISTENT_UNITS)
    # a group of one thread holds its row's reduce; larger groups combine by warp shuffles (no local memory)
    self._run_row_reduces(passes, lambda accumulator, reduce, number: accumulator if threads == 1 else
                          self._block_combine(accumulator, accumulate_op(reduce), thread, threads, number))
    self._accumulate_finals(finals, idxs)
    build.end_range(row_loop)
    first_of_group = self.node_to_uop(thread < 1)
    for number, (final, accumulator) in enumerate(zip(kernel.final_reduces, finals)):
      identity = build.const(reduce_identity(final.op, final.dtype), final.dtype)
      partial = build.alu(Ops.WHERE, final.dtype, first_of_group, accumulator, identity)
      self.reduce_values[id(final)] = self._block_combine(partial, accumulate_op(final), block_thread, block_threads,
                                                          len(kernel.reduceops) + number)
    first_thread = build.add(UOps.IF, None, (self.node_to_uop(block_thread < 1),))
    self._store_outputs([NumNode(0)] * len(shape), None)
    build.end_if(first_thread)
    return build.uops

  def _row_vector_width(self) -> int:
    """The elements of a vector unit where the renderer has vectors: the narrowest vector (Renderer.vector_lanes)
    of the buffers read or written along the row in a dtype it loads as vectors (float32: 4; float16/bfloat16 on
    CUDA: 8, 16 bytes, where no float32 buffer runs along the row: the bf16 logits of an autocast loss), where the
    innermost row axis splits into whole units; else 1. Each load and store then checks its own view (contiguous
    along that axis, aligned) before reading a vector."""
    kernel = self.kernel
    if getattr(kernel.renderer, "vector_width", 0) < 2: return 1
    innermost = (kernel.row_axes or ())[-1]
    buffers = [(leaf.dtype, kernel.sts[self.leaf_index[id(leaf)]]) for leaf in kernel.leaves
               if isinstance(leaf.arg, MemBuffer) and not is_element_leaf(kernel, leaf)]
    buffers += [(store.dtype, kernel.sts[number]) for number, store in enumerate(kernel.stores)]
    lanes = [kernel.renderer.vector_lanes(dtype) for dtype, st in buffers if st.real_strides()[innermost] != 0]
    width = min((lane for lane in lanes if lane >= 2), default=1)
    return width if kernel.full_shape[innermost] % width == 0 else 1

  def unit_idxs(self, idxs: list[Node], unit: Node, width: int, lane: int) -> list[Node]:
    """The indices of element `lane` of a unit: the unit's position in the row (row axes, the last fastest), its
    innermost index written as `width * (...) + lane` so that a vector's first index is provably aligned."""
    kernel = self.kernel
    row_axes = list(kernel.row_axes or ())
    sizes = [kernel.full_shape[axis] for axis in row_axes]
    sizes[-1] //= width
    element_idxs = list(idxs)
    for axis, node in zip(row_axes, unflatten(unit, sizes)): element_idxs[axis] = node
    element_idxs[row_axes[-1]] = element_idxs[row_axes[-1]] * width + lane
    return element_idxs

  def _vector_load(self, node: LazyOp, idxs: list[Node]) -> UOp | None:
    """One element of a unit's vector load: the view is one unmasked view of a vector dtype (Renderer.vector_dtypes),
    contiguous along the innermost row axis, and the unit's first element is provably aligned (to the unit's width,
    else to a narrower power of two: the unit is then that many narrower vectors). The lanes share the LOAD (the
    builder merges it)."""
    if self.vector_unit is None: return None
    first, width, lane = self.vector_unit
    if node.dtype not in self.kernel.renderer.vector_dtypes: return None
    leaf = self.leaf_index[id(node)]
    st = self.kernel.sts[leaf]
    innermost = (self.kernel.row_axes or ())[-1]
    if len(st.views) != 1 or st.views[0].mask is not None or st.real_strides()[innermost] != 1: return None
    index_node, _ = self._index_nodes(leaf, first)
    # where the unit's first element is aligned only to a narrower vector (Q8_0's quants: blocks of 34 bytes, 2 of
    # them the scale, so 4 quants start at an even address only), the unit is read as several of those
    part = width
    while part >= 2 and not multiple_of(index_node, part): part //= 2
    if part < 2: return None
    index_node = index_node + (lane // part) * part
    gate = (self.load_gate,) if self.load_gate is not None else ()
    vector = self.builder.add(UOps.LOAD, node.dtype, (self.buffers[node.arg.idx], self.node_to_uop(index_node), *gate),
                              part)
    return self.builder.add(UOps.GEP, node.dtype, (vector,), lane % part)

  def store_unit(self, lanes: list[list[Node]], width: int) -> None:
    """Store every output at the `width` elements of one unit (indices per lane). All values are computed before
    the first store (an output may overwrite a buffer another output still loads); an output whose view is one
    unmasked view of a vector dtype contiguous along the innermost row axis, with an aligned first element, is stored
    as one vector, the others element by element."""
    build, stores = self.builder, self.kernel.stores
    values = []
    for lane, element_idxs in enumerate(lanes):
      self.vector_unit = (lanes[0], width, lane) if width > 1 else None
      values.append([self.compute(store.srcs[0], element_idxs, None) for store in stores])
    self.vector_unit = None
    innermost = (self.kernel.row_axes or ())[-1]
    for number, store in enumerate(stores):
      st = self.kernel.sts[number]
      index_node, _ = self._index_nodes(number, lanes[0])
      if width > 1 and store.dtype in self.kernel.renderer.vector_dtypes and len(st.views) == 1 and \
          st.views[0].mask is None and st.real_strides()[innermost] == 1 and multiple_of(index_node, width):
        lane_values = tuple(values[lane][number] for lane in range(width))
        build.add(UOps.STORE, None, (self.buffers[store.arg.idx], self.node_to_uop(index_node)) + lane_values, width)
        continue
      for lane, element_idxs in enumerate(lanes):
        index, valid = self._index(number, element_idxs)
        srcs = (self.buffers[store.arg.idx], index, values[lane][number]) + ((valid,) if valid is not None else ())
        build.add(UOps.STORE, None, srcs)

  def _block_combine(self, partial: UOp, op: Ops, thread: Node, threads: int, number: int,
                     lanes: tuple[Node, int] | None = None) -> UOp:
    """The combination of every thread's partial, held by every thread of the block afterwards. `lanes`: (the
    row's place among the block's interleaved rows, their count), each row's threads that many lanes apart
    (codegen/row_interleave.py)."""
    build, warp_size = self.builder, self.kernel.renderer.warp_size
    dtype = partial.dtype
    # a row one thread holds whole: its partial is the row's (the tree below would have the block's rows, one thread
    # each, store to one local element: a split decode attention's short pieces of 4 slots, 2 rows a block)
    if threads == 1: return partial
    if lanes is not None: return interleaved_combine(self, partial, op, thread, threads, number, *lanes)
    if 2 <= threads < warp_size and threads & (threads - 1) == 0:   # a row of a block's rows: part of a warp
      return build.add(UOps.WARP_REDUCE, dtype, (partial,), (op, threads, 1))
    if warp_size >= 2 and threads % warp_size == 0:
      reduced = build.add(UOps.WARP_REDUCE, dtype, (partial,), (op, warp_size, 1))
      warps = threads // warp_size
      if warps == 1: return reduced
      local = build.add(UOps.DEFINE_LOCAL, dtype, (), (f"row{number}", warps))
      writer = build.add(UOps.IF, None, (self.node_to_uop(thread % warp_size < 1),))
      build.add(UOps.STORE, None, (local, self.node_to_uop(thread // warp_size), reduced))
      build.end_if(writer)
      build.add(UOps.BARRIER, None)
      total = build.add(UOps.LOAD, dtype, (local, self._int(0)))
      for warp in range(1, warps):
        total = build.alu(op, dtype, total, build.add(UOps.LOAD, dtype, (local, self._int(warp))))
      return total
    # no shuffles: a tree in local memory (pairs combined in parallel, a BARRIER after each step), read by all
    local = build.add(UOps.DEFINE_LOCAL, dtype, (), (f"row{number}", threads))
    thread_uop = self.node_to_uop(thread)
    build.add(UOps.STORE, None, (local, thread_uop, partial))
    build.add(UOps.BARRIER, None)
    count = threads
    while count > 1:
      half = (count + 1) // 2
      step = build.add(UOps.IF, None, (self.node_to_uop(thread < count // 2),))
      other = build.alu(Ops.ADD, INDEX_DTYPE, thread_uop, self._int(half))
      combined = build.alu(op, dtype, build.add(UOps.LOAD, dtype, (local, thread_uop)),
                           build.add(UOps.LOAD, dtype, (local, other)))
      build.add(UOps.STORE, None, (local, thread_uop, combined))
      build.end_if(step)
      build.add(UOps.BARRIER, None)
      count = half
    return build.add(UOps.LOAD, dtype, (local, self._int(0)))


def _broadcast_along(st: ShapeTracker, axis: int) -> bool:
  """Whether a view reads the same element (or the same padding) at every index of `axis`."""
  if len(st.views) != 1: return False
  view = st.views[0]
  return (view.shape[axis] == 1 or view.strides[axis] == 0) and \
      (view.mask is None or tuple(view.mask[axis]) == (0, view.shape[axis]))
