"""Indexed accumulate kernels: out[index[m], :] = start + the rows[m, :] whose index is that row (Ops.INDEX_ACCUMULATE).

The kernel AST is `STORE(INDEX_ACCUMULATE(start, index, rows))`: `start` (N, R), `index` (M,) int32 and `rows`
(M, R) are fused elementwise graphs over LOADs and CONSTs, each in its own shape (engine/schedule.py
`_schedule_index_accumulate`): an int64 index's cast and wrap of negative indices, or a gradient's last multiply, run
inside this kernel. They are computed element by element by the Linearizer's `compute` (`_SourceViews` gives it the
views); a plain row-major LOAD of float32 rows is read as float4 vectors where the width allows. The result is what
numpy's `np.add.at(out, index, rows)` gives on a copy of start: every row added in the order m = 0, 1, ..., repeated
indices summed, an index outside [0, N) ignored. It is deterministic by construction, with no atomics: each output
element has one owner, which adds its sources in ascending m (or, for a long run on a GPU, its fixed chunks' sums
in chunk order).

- On a GPU (`renderer.has_threads`), a thread owns `rows_per_thread` output rows and `features_per_thread` features
  of them (float4 pieces strided by the block's feature threads). Its rows are strided, g, g + G, g + 2G, ... (g its
  row group, G the row groups of the grid, `AccumulatePlan.row_stride`), not consecutive: the indices of real text
  repeat a few rows many times, and those rows have neighbouring ids (a tokenizer numbers its tokens by frequency, a
  Zipf draw by rank), so consecutive owners would put the few hot rows in one thread, which adds all their repeats
  one after another; strided, each hot row has an owner of its own. A block's row groups are b, b + B, ... (B blocks
  along the rows), so hot neighbouring rows are also in different blocks. It writes its part of `start`, then
  scans the index array and, for each index that falls in its rows, adds that source row's features into its output
  with a read-modify-write of its own elements. With warp shuffles the scan votes a warp's 32 indices at a time
  (`_voting_scan`: groups that miss the block's rows are skipped whole); without, every thread reads every index
  (`_scan`). The threads are about `THREADS_PER_PROCESSOR` per multiprocessor of the device; the floating-point work
  is the M x R additions that must be done, not an N x M x R one-hot.
- A long run on a GPU (a row indexed more than LONG_RUN times, with the vote and local memory): the block counts its
  rows' repeats first (`_count_rows`, whose vote also lists the groups that hit the block: the scan walks that
  list instead of voting again), the scan leaves the long rows out, and the whole block adds them afterwards,
  split over fixed chunks of the index array (`_add_long_runs`): out = start + P0 + P1 + ..., P_c the chunk's rows
  summed in index order. Deterministic, but np.add.at's order only for the rows that are not long.
- On a CPU (loops), one thread writes `start`, then walks m = 0 .. M-1 and adds row m into row index[m] (a loop over
  R the C compiler vectorizes).

`IndexAccumulateKernel` offers what engine/realize.py reads of a Kernel (name, leaves, sts, applied_opts,
print_debug, colored_shape, linearize, op_count); no Opts apply (`plan_index_accumulate` sizes it from the device).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ourgrad.codegen.linearizer import INDEX_DTYPE, Linearizer
from ourgrad.codegen.uops import AxisType, UOp, UOpBuilder, UOps
from ourgrad.dtype import DType, dtypes
from ourgrad.helpers import DEBUG, env_var
from ourgrad.ops import LazyOp, MemBuffer, Ops, format_ast
from ourgrad.shape.symbolic import Variable

# GPU threads per multiprocessor the kernel aims for: enough to stream the start's stores at bandwidth, few enough that
# every thread's scan of the whole index array stays cheap (the scan's cost grows with the thread count)
THREADS_PER_PROCESSOR = 512
ACCUMULATE_THREADS_PER_SM = env_var("ACCUMULATE_THREADS_PER_SM", 0, "GPU threads per multiprocessor of an indexed "
                                    "accumulate kernel (codegen/index_accumulate.py); 0: its default, 512")
# threads per block
BLOCK_THREADS = 128
# features one thread owns, at most (in vectors of the device's width where the width allows)
MAX_VECTORS_PER_THREAD = 4
# a row indexed more often than this is a long run: its block adds it in chunks of the index array, side by side
# (`AccumulatePlan.chunks`), instead of its owner thread adding every repeat one after another
LONG_RUN = 64
ACCUMULATE_LONG_RUN = env_var("ACCUMULATE_LONG_RUN", 0, "repeats above which an indexed accumulate's row is added in "
                              "chunks by its block (codegen/index_accumulate.py); 0: its default, 64")
# vectors of a row one thread adds in a chunk, at most (registers: an accumulator per element)
MAX_CHUNK_VECTORS = 16


@dataclass(frozen=True)
class AccumulatePlan:
  """How a GPU indexed accumulate of `count` rows into a (rows, width) output is split over threads."""
  rows: int
  width: int
  count: int
  vector: int               # elements of one load/store (4: float4), 1: scalar
  features_per_thread: int  # a multiple of `vector` dividing `width`
  feature_threads: int      # a block's threads along the features (dividing the feature groups)
  row_threads: int          # a block's threads along the row groups
  rows_per_thread: int
  scan_unroll: int          # index loads in flight in the scan without a vote (dividing `count`)
  warp: int = 0             # lanes of the warp vote that skips indices outside the block's rows (0: no vote)
  long_run: int = 0         # repeats above which a row is added in chunks (0: never)
  chunks: int = 1           # the index array's chunks a long run is split into, one team of threads each
  chunk_team: int = 0       # a chunk's threads, covering the block's features (block threads = chunks * team)

  @property
  def feature_groups(self) -> int: return self.width // self.features_per_thread

  @property
  def row_groups(self) -> int: return math.ceil(self.rows / self.rows_per_thread)

  @property
  def blocks(self) -> tuple[int, int]:
    """Blocks along the row groups (x) and along the feature groups (y)."""
    return math.ceil(self.row_groups / self.row_threads), self.feature_groups // self.feature_threads

  @property
  def row_stride(self) -> int:
    """G, the row groups of the grid: row group g owns rows g, g + G, g + 2G, ... (fewer than rows_per_thread at the
    end of the table)."""
    return self.blocks[0] * self.row_threads

  @property
  def block_rows(self) -> int: return self.row_threads * self.rows_per_thread

  @property
  def groups(self) -> int:
    """The warp-sized groups of the index array the vote reads."""
    return math.ceil(self.count / self.warp) if self.warp else 0

  @property
  def block_features(self) -> int: return self.feature_threads * self.features_per_thread

  @property
  def chunk_length(self) -> int: return math.ceil(self.count / self.chunks)

  @property
  def chunk_vectors(self) -> int:
    """Vectors of a long row one thread of a chunk's team adds (strided by the team)."""
    return self.block_features // (self.chunk_team * self.vector)

  @property
  def ragged(self) -> bool:
    """Whether some thread owns fewer than rows_per_thread rows (the table ends before its last stride)."""
    return self.row_stride * self.rows_per_thread != self.rows


def plan_index_accumulate(rows: int, width: int, count: int, dtype: DType, renderer: Any) -> AccumulatePlan:
  """The GPU split of an indexed accumulate, from the device's facts (threads per block, multiprocessors, vector
  width): see the module docstring."""
  vector = 4 if renderer.vector_width >= 4 and dtype == dtypes.float32 and width % 4 == 0 else 1
  per_thread = max(vector * k for k in range(1, MAX_VECTORS_PER_THREAD + 1) if width % (vector * k) == 0)
  groups = width // per_thread
  block = min(renderer.max_threads, BLOCK_THREADS)
  feature_threads = max(divisor for divisor in range(1, min(groups, block) + 1) if groups % divisor == 0)
  per_processor = int(ACCUMULATE_THREADS_PER_SM.value) or THREADS_PER_PROCESSOR
  target_threads = max(renderer.multiprocessors, 1) * per_processor
  rows_per_thread = min(rows, max(1, math.ceil(rows * groups / target_threads)))
  row_threads = max(1, min(block // feature_threads, math.ceil(rows / rows_per_thread)))
  scan_unroll = max(unroll for unroll in (1, 2, 4, 8) if count % unroll == 0)
  # the vote needs whole warps of shuffling lanes (a 32-bit mask: warps of at most 32)
  whole_warps = 0 < renderer.warp_size <= 32 and (feature_threads * row_threads) % renderer.warp_size == 0
  warp = renderer.warp_size if whole_warps else 0
  plan = AccumulatePlan(rows, width, count, vector, per_thread, feature_threads, row_threads, rows_per_thread,
                        scan_unroll, warp)
  return _with_chunks(plan, dtype, renderer)


def _with_chunks(plan: AccumulatePlan, dtype: DType, renderer: Any) -> AccumulatePlan:
  """`plan` with long runs split into chunks where the device allows: with the warp vote and local memory for a
  count per block row and a partial row per chunk. The block's threads form `chunks` teams of `chunk_team`: the
  feature threads in k teams of feature_threads / k (each thread adding k times its features), per row thread."""
  long_run = int(ACCUMULATE_LONG_RUN.value) or LONG_RUN
  if not plan.warp or not getattr(renderer, "has_local", False) or plan.count <= long_run: return plan
  vectors = plan.features_per_thread // plan.vector
  for k in range(min(plan.feature_threads, MAX_CHUNK_VECTORS // vectors), 0, -1):
    chunks = k * plan.row_threads
    # the partial rows, a count per block row, and the list of the voted groups (index and mask, and its length)
    local_bytes = chunks * plan.block_features * dtype.itemsize + plan.block_rows * 4 + 8 * plan.groups + 4
    if plan.feature_threads % k == 0 and chunks >= 2 and local_bytes <= renderer.local_memory_bytes:
      return replace(plan, long_run=long_run, chunks=chunks, chunk_team=plan.feature_threads // k)
  return plan


def is_index_accumulate(ast: LazyOp) -> bool:
  """Whether a kernel AST is an indexed accumulate's (STORE(INDEX_ACCUMULATE(...)))."""
  return ast.op is Ops.STORE and ast.srcs[0].op is Ops.INDEX_ACCUMULATE


class _SourceViews:
  """What the Linearizer reads of a Kernel to compute the sources' graphs at given indices: their leaves and views
  (no opts, so no vector loads or tiles)."""

  def __init__(self, leaves: list[LazyOp]):
    self.leaves, self.sts = leaves, [leaf.arg.st for leaf in leaves]
    self.renderer = type("NoVectors", (), {"vector_width": 0})()
    self.reduceop = None


class IndexAccumulateKernel:
  """The kernel of one indexed accumulate AST (module docstring)."""

  def __init__(self, ast: LazyOp, renderer: Any):
    if not is_index_accumulate(ast): raise AssertionError(f"not an indexed accumulate's AST: {ast.op}")
    self.ast, self.renderer = ast, renderer
    self.start, self.index, self.rows = ast.srcs[0].srcs
    self.dtype: DType = ast.arg.dtype
    self.row_count, self.width = ast.arg.st.shape
    self.count = self.index.leaves()[0].arg.st.shape[0]
    unique: dict[int, LazyOp] = {}
    for value in (self.start, self.index, self.rows):
      for leaf in value.leaves(): unique.setdefault(id(leaf), leaf)
    self.source_leaves = list(unique.values())
    self.leaves: list[LazyOp] = [ast, *self.source_leaves]
    self.sts = [leaf.arg.st for leaf in self.leaves]
    self.applied_opts: list[Any] = []
    self.plan = plan_index_accumulate(self.row_count, self.width, self.count, self.dtype, renderer) \
        if renderer.has_threads else None

  @property
  def name(self) -> str: return f"A_{self.row_count}_{self.width}_{self.count}"

  def colored_shape(self) -> str: return f"{self.row_count} {self.width} {self.count}"

  def print_debug(self) -> None:
    if DEBUG >= 3:
      print(format_ast(self.ast))
      print(f"{self.name}: {self.count} rows accumulated into ({self.row_count}, {self.width}); plan {self.plan}")

  def op_count(self, uops: list[UOp]) -> int:
    """Arithmetic ops of one launch: one addition per source element (the index compares are integer work)."""
    return self.count * self.width

  # ---------------------------------------------------------------- lowering

  def linearize(self) -> list[UOp]:
    build = UOpBuilder()
    buffers = {0: build.add(UOps.DEFINE_GLOBAL, self.dtype, (), (0, True))}
    for leaf in sorted((leaf for leaf in self.source_leaves if isinstance(leaf.arg, MemBuffer)),
                       key=lambda leaf: leaf.arg.idx):
      if leaf.arg.idx not in buffers:
        buffers[leaf.arg.idx] = build.add(UOps.DEFINE_GLOBAL, leaf.dtype, (), (leaf.arg.idx, False))
    lower = _Lowering(build, buffers, self)
    if self.plan is not None: lower.threads(self.plan)
    else: lower.loops()
    return build.uops


def _plain_rows(value: LazyOp) -> bool:
  """Whether a source is a LOAD of a row-major buffer as it is (read by flat index, in vectors)."""
  return value.op is Ops.LOAD and not value.srcs and value.arg.st.contiguous


class _Lowering:
  """Appends the UOps of one indexed accumulate kernel to `build`."""

  def __init__(self, build: UOpBuilder, buffers: dict[int, UOp], kernel: IndexAccumulateKernel):
    self.build, self.buffers, self.kernel = build, buffers, kernel
    self.out = buffers[0]
    self.views = Linearizer(_SourceViews(kernel.source_leaves))   # type: ignore[arg-type]
    self.views.builder, self.views.buffers = build, buffers
    self.coordinates = 0

  def index_const(self, value: int) -> UOp: return self.build.const(value, INDEX_DTYPE)

  def add(self, a: UOp, b: UOp) -> UOp: return self.build.alu(Ops.ADD, INDEX_DTYPE, a, b)

  def mul(self, a: UOp, b: UOp) -> UOp: return self.build.alu(Ops.MUL, INDEX_DTYPE, a, b)

  def less(self, a: UOp, b: UOp) -> UOp: return self.build.alu(Ops.CMPLT, dtypes.bool, a, b)

  def both(self, a: UOp, b: UOp) -> UOp: return self.build.alu(Ops.AND, dtypes.bool, a, b)

  def loop(self, name: str, end: int) -> UOp:
    # REDUCE: a serial loop in each thread (never a parallel one: its iterations write the same places)
    bounds = (self.index_const(0), self.index_const(end))
    return self.build.add(UOps.RANGE, INDEX_DTYPE, bounds, (name, AxisType.REDUCE))

  def value_at(self, root: LazyOp, coordinates: list[tuple[UOp, int]]) -> UOp:
    """A source's graph computed at one element: `coordinates` are (index UOp, size) per axis of its shape."""
    idxs = []
    for uop, size in coordinates:
      name = f"at{self.coordinates}"
      self.coordinates += 1
      self.views.loop_vars[name] = uop
      idxs.append(Variable(name, 0, size - 1))
    return self.views.compute(root, idxs, None)

  def row_values(self, root: LazyOp, row: UOp, row_count: int, feature: UOp, width: int) -> list[UOp]:
    """`width` neighbouring features of a (rows, R) source from (row, feature)."""
    kernel = self.kernel
    if _plain_rows(root):
      flat = self.add(self.mul(row, self.index_const(kernel.width)), feature)
      return self.load_buffer(self.buffers[root.arg.idx], root.dtype, flat, width)
    return [self.value_at(root, [(row, row_count), (self.add(feature, self.index_const(lane)), kernel.width)])
            for lane in range(width)]

  def load_buffer(self, buffer: UOp, dtype: DType, index: UOp, width: int) -> list[UOp]:
    if width == 1: return [self.build.add(UOps.LOAD, dtype, (buffer, index))]
    vector = self.build.add(UOps.LOAD, dtype, (buffer, index), width)
    return [self.build.add(UOps.GEP, dtype, (vector,), lane) for lane in range(width)]

  def store(self, index: UOp, values: list[UOp]) -> None:
    if len(values) == 1: self.build.add(UOps.STORE, None, (self.out, index, values[0]))
    else: self.build.add(UOps.STORE, None, (self.out, index, *values), len(values))

  def write_start(self, row: UOp, feature: UOp, width: int) -> None:
    """out[row, feature ...] = start[row, feature ...] for `width` neighbouring features."""
    kernel = self.kernel
    values = self.row_values(kernel.start, row, kernel.row_count, feature, width)
    self.store(self.add(self.mul(row, self.index_const(kernel.width)), feature), values)

  def accumulate(self, target: UOp, source: UOp, feature: UOp, width: int) -> None:
    """out[target, feature ...] += rows[source, feature ...] for `width` neighbouring features."""
    kernel = self.kernel
    out_index = self.add(self.mul(target, self.index_const(kernel.width)), feature)
    current = self.load_buffer(self.out, kernel.dtype, out_index, width)
    added = self.row_values(kernel.rows, source, kernel.count, feature, width)
    self.store(out_index, [self.build.alu(Ops.ADD, kernel.dtype, a, b) for a, b in zip(current, added)])

  def index_at(self, source: UOp) -> UOp:
    return self.value_at(self.kernel.index, [(source, self.kernel.count)])

  # ---------------------------------------------------------------- CPU: loops

  def loops(self) -> None:
    kernel, build = self.kernel, self.build
    row = self.loop("row", kernel.row_count)
    feature = self.loop("feat", kernel.width)
    self.write_start(row, feature, 1)
    build.end_range(feature)
    build.end_range(row)
    source = self.loop("src", kernel.count)
    target = self.index_at(source)
    block = build.add(UOps.IF, None, (self.both(self.less(self.index_const(-1), target),
                                                self.less(target, self.index_const(kernel.row_count))),))
    feature = self.loop("col", kernel.width)
    self.accumulate(target, source, feature, 1)
    build.end_range(feature)
    build.end_if(block)
    build.end_range(source)

  # ---------------------------------------------------------------- GPU: threads

  def threads(self, plan: AccumulatePlan) -> None:
    build = self.build
    blocks_x, blocks_y = plan.blocks
    row_block = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("gidx0", blocks_x, 0, AxisType.GLOBAL))
    feature_group: UOp = self.index_const(0)   # in vectors
    if blocks_y > 1:
      feature_block = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("gidx1", blocks_y, 1, AxisType.GLOBAL))
      vectors_per_block = plan.feature_threads * plan.features_per_thread // plan.vector
      feature_group = self.mul(feature_block, self.index_const(vectors_per_block))
    if plan.feature_threads > 1:
      thread = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("lidx0", plan.feature_threads, 0, AxisType.LOCAL))
      feature_group = self.add(feature_group, thread)
    # the block's row groups are interleaved with the other blocks' (b, b + B, b + 2B, ...; B blocks along the rows):
    # neighbouring hot rows (rows g and g + 1) land in different blocks, whose long runs (_add_long_runs) run side by
    # side instead of one after another
    row_group = row_block
    if plan.row_threads > 1:
      row_thread = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("lidx1", plan.row_threads, 1, AxisType.LOCAL))
      row_group = self.add(row_group, self.mul(row_thread, self.index_const(blocks_x)))
    # a thread's features are `vector` wide pieces strided by the block's feature threads: neighbouring threads
    # touch neighbouring pieces, so each load and store instruction of a warp covers one contiguous span
    first_feature = self.mul(feature_group, self.index_const(plan.vector))
    self._write_start(plan, row_group, first_feature)
    if plan.warp:
      feature_thread = thread if plan.feature_threads > 1 else self.index_const(0)
      local_row_group = row_thread if plan.row_threads > 1 else self.index_const(0)
      lane = self.add(feature_thread, self.mul(local_row_group, self.index_const(plan.feature_threads)))
      lane = build.alu(Ops.MOD, INDEX_DTYPE, lane, self.index_const(plan.warp))
      counts, voted_groups = None, None
      if plan.chunks > 1:
        counts, voted_groups = self._count_rows(plan, lane, row_block, row_group, feature_thread, local_row_group)
      self._voting_scan(plan, lane, row_block, row_group, first_feature, counts, voted_groups)
      if counts is not None:
        block_feature = self.mul(feature_group, self.index_const(plan.vector))
        block_feature = self.add(block_feature, self.mul(feature_thread, self.index_const(-plan.vector)))
        self._add_long_runs(plan, counts, row_block, block_feature, feature_thread, local_row_group)
    else:
      self._scan(plan, row_group, first_feature)

  @staticmethod
  def _feature_offsets(plan: AccumulatePlan) -> range:
    """The offsets of a thread's vectors from its first feature (strided by the block's feature threads)."""
    stride = plan.feature_threads * plan.vector
    return range(0, stride * (plan.features_per_thread // plan.vector), stride)

  def _write_start(self, plan: AccumulatePlan, row_group: UOp, first_feature: UOp) -> None:
    build = self.build
    slot = self.loop("row", plan.rows_per_thread)
    row = self.add(row_group, self.mul(slot, self.index_const(plan.row_stride)))
    in_table = self.less(row, self.index_const(self.kernel.row_count))
    block = build.add(UOps.IF, None, (in_table,)) if plan.ragged else None
    for offset in self._feature_offsets(plan):
      self.write_start(row, self.add(first_feature, self.index_const(offset)), plan.vector)
    if block is not None: build.end_if(block)
    build.end_range(slot)

  def _unsigned(self, value: UOp) -> UOp: return self.build.add(UOps.CAST, dtypes.uint32, (value,))

  def _row_group_of(self, plan: AccumulatePlan, target: UOp) -> tuple[UOp, UOp]:
    """(whether index `target` is a row of the table, 0 <= target < rows as one unsigned compare, the row group that
    owns it: target mod G, 0 for an index outside)."""
    inside = self.build.alu(Ops.CMPLT, dtypes.bool, self._unsigned(target),
                            self.build.const(self.kernel.row_count, dtypes.uint32))
    row = self.build.alu(Ops.WHERE, INDEX_DTYPE, inside, target, self.index_const(0))
    return inside, self.build.alu(Ops.MOD, INDEX_DTYPE, row, self.index_const(plan.row_stride))

  def _add_if_mine(self, plan: AccumulatePlan, source: UOp, target: UOp, row_group: UOp, first_feature: UOp) -> None:
    """If index `target` is one of this thread's rows (in the table, and in its row group), add source row `source`
    into it."""
    block = self.build.add(UOps.IF, None, (self._is_mine(plan, target, row_group),))
    for offset in self._feature_offsets(plan):
      self.accumulate(target, source, self.add(first_feature, self.index_const(offset)), plan.vector)
    self.build.end_if(block)

  def _open_voted_group(self, plan: AccumulatePlan, lane: UOp, row_block: UOp) -> tuple[UOp, UOp, UOp, UOp]:
    """Opens the loop over the index array a warp's worth at a time and the IF that skips a group none of whose
    indices falls in the block's rows: lane l reads index c * warp + l and votes whether its row group is one of
    the block's; the votes add up (WARP_REDUCE) to a mask every lane holds. Returns (the loop, the IF, the group's
    first position, the mask); the caller closes the IF, then the loop."""
    build = self.build
    lane_bit = build.alu(Ops.SHL, dtypes.uint32, build.const(1, dtypes.uint32), self._unsigned(lane))
    group = self.loop("grp", math.ceil(plan.count / plan.warp))
    group_start = self.mul(group, self.index_const(plan.warp))
    position = self.add(group_start, lane)
    inside_count = None
    if plan.count % plan.warp:   # the last group is short: lanes past the end read index 0 and do not vote
      inside_count = self.less(position, self.index_const(plan.count))
      position = build.alu(Ops.WHERE, INDEX_DTYPE, inside_count, position, self.index_const(0))
    inside, target_group = self._row_group_of(plan, self.index_at(position))
    votes = self.both(inside, self._is_blocks(plan, target_group, row_block))
    if inside_count is not None: votes = self.both(votes, inside_count)
    vote = build.alu(Ops.WHERE, dtypes.uint32, votes, lane_bit, build.const(0, dtypes.uint32))
    mask = build.add(UOps.WARP_REDUCE, dtypes.uint32, (vote,), (Ops.ADD, plan.warp, 1))
    any_vote = build.add(UOps.IF, None, (build.alu(Ops.CMPNE, dtypes.bool, mask, build.const(0, dtypes.uint32)),))
    return group, any_vote, group_start, mask

  def _voting_scan(self, plan: AccumulatePlan, lane: UOp, row_block: UOp, row_group: UOp,
                   first_feature: UOp, counts: UOp | None, voted_groups: tuple[UOp, UOp] | None) -> None:
    """The scan, a warp's worth of indices at a time (`_open_voted_group`): most groups hit no row of the block (a
    block owns a small part of the table) and are skipped whole; for the others, the voted indices are read again
    in order and added where they fall in the thread's own rows, except the long runs (`counts`: the block's
    repeats of each row; `_add_long_runs` adds those). The order of the additions is unchanged. With
    `voted_groups` (the list `_count_rows` made) the groups come from it instead of a second vote."""
    build = self.build
    if voted_groups is None: group, any_vote, group_start, mask = self._open_voted_group(plan, lane, row_block)
    else: group, any_vote, group_start, mask = self._open_listed_group(plan, *voted_groups)
    # members whose row this thread already added in this group (a sum of distinct bits: ADD is the OR)
    done = build.add(UOps.DEFINE_ACC, dtypes.uint32, (), 0)
    member = self.loop("voted", plan.warp)
    fresh = self.both(self._bit_set(mask, member), self.less(self._bit(done, member), self._one()))
    voted = build.add(UOps.IF, None, (fresh,))
    target = self.index_at(self.add(group_start, member))
    mine = build.add(UOps.IF, None, (self._is_mine(plan, target, row_group),))
    short = None
    if counts is not None:   # (inside `mine`: the target is one of the block's rows, its count slot exists)
      repeats = build.add(UOps.LOAD, dtypes.int32, (counts, self._block_slot(plan, target)))
      short = build.add(UOps.IF, None, (self.less(repeats, self.index_const(plan.long_run + 1)),))
    # the members from this one on: a run's rows are found among them (an earlier one would have started the run)
    later = build.alu(Ops.AND, dtypes.uint32, mask, build.alu(Ops.SHL, dtypes.uint32, build.const(0xFFFFFFFF,
                                                                                                  dtypes.uint32),
                                                              self._unsigned(member)))
    self._add_run(plan, later, done, group_start, target, first_feature)
    if short is not None: build.end_if(short)
    build.end_if(mine)
    build.end_if(voted)
    build.end_range(member)
    build.end_if(any_vote)
    build.end_range(group)

  # ---------------------------------------------------------------- GPU: long runs in chunks

  def _open_listed_group(self, plan: AccumulatePlan, groups: UOp, masks: UOp) -> tuple[UOp, UOp, UOp, UOp]:
    """As `_open_voted_group`, the groups read from the list `_count_rows` made: (the loop over its entries, the IF
    of an entry within its length, the group's first position, its mask)."""
    build = self.build
    length = build.add(UOps.LOAD, dtypes.int32, (groups, self.index_const(plan.groups)))
    entry = self.loop("listed", plan.groups)
    listed = build.add(UOps.IF, None, (self.less(entry, length),))
    group_start = self.mul(build.add(UOps.LOAD, dtypes.int32, (groups, entry)), self.index_const(plan.warp))
    return entry, listed, group_start, build.add(UOps.LOAD, dtypes.uint32, (masks, entry))

  def _is_blocks(self, plan: AccumulatePlan, row_group: UOp, row_block: UOp) -> UOp:
    """Whether row group `row_group` is one of block `row_block`'s (row_group mod B == row_block)."""
    blocks_x = plan.blocks[0]
    if blocks_x == 1: return self.build.const(True, dtypes.bool)
    block = self.build.alu(Ops.MOD, INDEX_DTYPE, row_group, self.index_const(blocks_x))
    return self.build.alu(Ops.CMPNE, dtypes.bool, self.build.alu(Ops.CMPNE, dtypes.bool, block, row_block),
                          self.build.const(True, dtypes.bool))

  def _block_slot(self, plan: AccumulatePlan, row: UOp) -> UOp:
    """The place of one of the block's rows among its `block_rows` (its row group's thread in the block + slot *
    row_threads), the index of its count."""
    build = self.build
    group = build.alu(Ops.MOD, INDEX_DTYPE, row, self.index_const(plan.row_stride))
    local_group = build.alu(Ops.IDIV, INDEX_DTYPE, group, self.index_const(plan.blocks[0]))
    slot = build.alu(Ops.IDIV, INDEX_DTYPE, row, self.index_const(plan.row_stride))
    return self.add(local_group, self.mul(slot, self.index_const(plan.row_threads)))

  def _count_rows(self, plan: AccumulatePlan, lane: UOp, row_block: UOp, row_group: UOp,
                  feature_thread: UOp, local_row_group: UOp) -> tuple[UOp, tuple[UOp, UOp]]:
    """How often each of the block's rows is indexed, in local memory (an int32 per block row): each row group's
    first feature thread counts its own rows' members of the voted groups (one writer per count, no atomics). The
    block's first thread lists the voted groups (their index and mask; the length after them): every warp votes the
    same, and the scan then walks the list instead of voting again. A BARRIER follows: every thread of the block
    reads the counts and the list, and `_add_long_runs` reads the start rows other threads wrote. Returns (the
    counts, (the listed groups, their masks))."""
    build = self.build
    counts = build.add(UOps.DEFINE_LOCAL, dtypes.int32, (), ("row_counts", plan.block_rows))
    listed = build.add(UOps.DEFINE_LOCAL, dtypes.int32, (), ("voted_groups", plan.groups + 1))
    masks = build.add(UOps.DEFINE_LOCAL, dtypes.uint32, (), ("voted_masks", plan.groups))
    first_thread = self.less(self.add(feature_thread, local_row_group), self.index_const(1))
    lister = build.add(UOps.IF, None, (first_thread,))
    build.add(UOps.STORE, None, (listed, self.index_const(plan.groups), self.index_const(0)))
    build.end_if(lister)
    counter = build.add(UOps.IF, None, (self.less(feature_thread, self.index_const(1)),))
    slot = self.loop("cslot", plan.rows_per_thread)
    build.add(UOps.STORE, None, (counts, self.add(local_row_group, self.mul(slot, self.index_const(plan.row_threads))),
                                 self.index_const(0)))
    build.end_range(slot)
    build.end_if(counter)
    group, any_vote, group_start, mask = self._open_voted_group(plan, lane, row_block)
    lister = build.add(UOps.IF, None, (first_thread,))
    length = build.add(UOps.LOAD, dtypes.int32, (listed, self.index_const(plan.groups)))
    build.add(UOps.STORE, None, (listed, length, group))
    build.add(UOps.STORE, None, (masks, length, mask))
    build.add(UOps.STORE, None, (listed, self.index_const(plan.groups), self.add(length, self.index_const(1))))
    build.end_if(lister)
    member = self.loop("counted", plan.warp)
    voted = build.add(UOps.IF, None, (self._bit_set(mask, member),))
    target = self.index_at(self.add(group_start, member))
    mine = self.both(self._is_mine(plan, target, row_group), self.less(feature_thread, self.index_const(1)))
    owner = build.add(UOps.IF, None, (mine,))
    place = self._block_slot(plan, target)
    repeats = build.add(UOps.LOAD, dtypes.int32, (counts, place))
    build.add(UOps.STORE, None, (counts, place, self.add(repeats, self.index_const(1))))
    build.end_if(owner)
    build.end_if(voted)
    build.end_range(member)
    build.end_if(any_vote)
    build.end_range(group)
    build.add(UOps.BARRIER, None)
    return counts, (listed, masks)

  def _add_long_runs(self, plan: AccumulatePlan, counts: UOp, row_block: UOp, block_feature: UOp,
                     feature_thread: UOp, local_row_group: UOp) -> None:
    """The block's rows indexed more than `long_run` times, one after another, by all its threads: `chunks` teams
    of `chunk_team` threads; team c sums, in index order and in registers, the rows of its chunk of the index array
    (positions [c * L, (c + 1) * L), L = chunk_length) whose index is the row, from -0.0; the partial rows meet in
    local memory, and team 0 adds them to the start row in team order: start + P0 + P1 + ... (deterministic, and
    np.add.at's order only where one chunk holds every repeat). Every thread reaches the BARRIERs (the loop over
    the block's rows is the same for all; only the work inside is conditional)."""
    kernel, build = self.kernel, self.build
    per_team = plan.feature_threads // plan.chunk_team
    team = self.add(build.alu(Ops.IDIV, INDEX_DTYPE, feature_thread, self.index_const(plan.chunk_team)),
                    self.mul(local_row_group, self.index_const(per_team)))
    piece = build.alu(Ops.MOD, INDEX_DTYPE, feature_thread, self.index_const(plan.chunk_team))
    stride = plan.chunk_team * plan.vector
    # features within the block's span, and in the table
    spans = [self.add(self.mul(piece, self.index_const(plan.vector)), self.index_const(stride * j))
             for j in range(plan.chunk_vectors)]
    partials = build.add(UOps.DEFINE_LOCAL, kernel.dtype, (), ("chunk_rows", plan.chunks * plan.block_features))
    identity = -0.0 if kernel.dtype.is_float else 0
    slot = self.loop("lslot", plan.block_rows)
    local_group = build.alu(Ops.MOD, INDEX_DTYPE, slot, self.index_const(plan.row_threads))
    row = self.add(self.add(row_block, self.mul(local_group, self.index_const(plan.blocks[0]))),
                   self.mul(build.alu(Ops.IDIV, INDEX_DTYPE, slot, self.index_const(plan.row_threads)),
                            self.index_const(plan.row_stride)))
    long = self.less(self.index_const(plan.long_run), build.add(UOps.LOAD, dtypes.int32, (counts, slot)))
    adding = build.add(UOps.IF, None, (long,))
    sums = [[build.add(UOps.DEFINE_ACC, kernel.dtype, (), identity) for _ in range(plan.vector)] for _ in spans]
    # `unroll` indices read together (loads in flight), then their matches added in position order
    unroll = max(width for width in (1, 2, 4, 8) if plan.chunk_length % width == 0)
    step = self.loop("chunk", plan.chunk_length // unroll)
    first = self.add(self.mul(team, self.index_const(plan.chunk_length)), self.mul(step, self.index_const(unroll)))
    candidates = []
    for offset in range(unroll):
      position = self.add(first, self.index_const(offset))
      inside = self.less(position, self.index_const(plan.count))
      source = build.alu(Ops.WHERE, INDEX_DTYPE, inside, position, self.index_const(0))
      same = build.alu(Ops.CMPNE, dtypes.bool, build.alu(Ops.CMPNE, dtypes.bool, self.index_at(source), row),
                       build.const(True, dtypes.bool))
      candidates.append((source, self.both(inside, same)))
    for source, matches in candidates:
      match = build.add(UOps.IF, None, (matches,))
      for lanes, span in zip(sums, spans):
        values = self.row_values(kernel.rows, source, kernel.count, self.add(block_feature, span), plan.vector)
        for lane, value in zip(lanes, values): build.add(UOps.ACCUMULATE, kernel.dtype, (lane, value), Ops.ADD)
      build.end_if(match)
    build.end_range(step)
    team_base = self.mul(team, self.index_const(plan.block_features))
    for lanes, span in zip(sums, spans):
      for offset, lane in enumerate(lanes):
        build.add(UOps.STORE, None, (partials, self.add(self.add(team_base, span), self.index_const(offset)), lane))
    build.end_if(adding)
    build.add(UOps.BARRIER, None)
    combining = build.add(UOps.IF, None, (self.both(long, self.less(team, self.index_const(1))),))
    for span in spans:
      out_index = self.add(self.mul(row, self.index_const(kernel.width)), self.add(block_feature, span))
      total = self.load_buffer(self.out, kernel.dtype, out_index, plan.vector)
      for chunk in range(plan.chunks):
        place = self.add(span, self.index_const(chunk * plan.block_features))
        total = [build.alu(Ops.ADD, kernel.dtype, value,
                           build.add(UOps.LOAD, kernel.dtype, (partials, self.add(place, self.index_const(offset)))))
                 for offset, value in enumerate(total)]
      self.store(out_index, total)
    build.end_if(combining)
    build.add(UOps.BARRIER, None)
    build.end_range(slot)

  def _one(self) -> UOp: return self.build.const(1, dtypes.uint32)

  def _bit(self, mask: UOp, position: UOp) -> UOp:
    """Bit `position` of a uint32 mask (0 or 1)."""
    build = self.build
    return build.alu(Ops.AND, dtypes.uint32, build.alu(Ops.SHR, dtypes.uint32, mask, self._unsigned(position)),
                     self._one())

  def _bit_set(self, mask: UOp, position: UOp) -> UOp:
    return self.build.alu(Ops.CMPNE, dtypes.bool, self._bit(mask, position), self.build.const(0, dtypes.uint32))

  def _add_run(self, plan: AccumulatePlan, mask: UOp, done: UOp, group_start: UOp, target: UOp,
               first_feature: UOp) -> None:
    """Add every member in `mask` whose index is `target` (the first of them is the current one) into the
    thread's part of that output row with one read-modify-write: the row's current value and the members' rows are
    summed in registers in member order (from -0.0, which adds nothing, bit for bit), so the result is the sequential
    sum's, and a row repeated in a group costs one round trip to memory instead of one per repeat. Marks the members
    in `done`."""
    kernel, build = self.kernel, self.build
    identity = -0.0 if kernel.dtype.is_float else 0
    features = [self.add(first_feature, self.index_const(offset)) for offset in self._feature_offsets(plan)]
    out_indices = [self.add(self.mul(target, self.index_const(kernel.width)), feature) for feature in features]
    sums = []
    for out_index in out_indices:
      current = self.load_buffer(self.out, kernel.dtype, out_index, plan.vector)
      lanes = [build.add(UOps.DEFINE_ACC, kernel.dtype, (), identity) for _ in current]
      for lane, value in zip(lanes, current): build.add(UOps.ACCUMULATE, kernel.dtype, (lane, value), Ops.ADD)
      sums.append(lanes)
    other = self.loop("run", plan.warp)
    candidate = build.add(UOps.IF, None, (self._bit_set(mask, other),))   # voted: its index is read (a member)
    source = self.add(group_start, other)
    same = build.alu(Ops.CMPNE, dtypes.bool, build.alu(Ops.CMPNE, dtypes.bool, self.index_at(source), target),
                     build.const(True, dtypes.bool))
    match = build.add(UOps.IF, None, (same,))
    build.add(UOps.ACCUMULATE, dtypes.uint32, (done, build.alu(Ops.SHL, dtypes.uint32, self._one(),
                                                                self._unsigned(other))), Ops.ADD)
    for lanes, feature in zip(sums, features):
      values = self.row_values(kernel.rows, source, kernel.count, feature, plan.vector)
      for lane, value in zip(lanes, values): build.add(UOps.ACCUMULATE, kernel.dtype, (lane, value), Ops.ADD)
    build.end_if(match)
    build.end_if(candidate)
    build.end_range(other)
    for lanes, out_index in zip(sums, out_indices): self.store(out_index, lanes)

  def _is_mine(self, plan: AccumulatePlan, target: UOp, row_group: UOp) -> UOp:
    """Whether index `target` is one of this thread's rows: in the table, and in its row group."""
    inside, group = self._row_group_of(plan, target)
    offset = self._unsigned(self.add(group, self.mul(row_group, self.index_const(-1))))
    return self.both(inside, self.build.alu(Ops.CMPLT, dtypes.bool, offset, self._one()))

  def _scan(self, plan: AccumulatePlan, row_group: UOp, first_feature: UOp) -> None:
    """The scan without a vote: every thread reads every index (scan_unroll loads in flight) and adds the rows that
    fall in its own rows."""
    build = self.build
    step = self.loop("src", plan.count // plan.scan_unroll)
    first = self.mul(step, self.index_const(plan.scan_unroll))
    sources = [self.add(first, self.index_const(lane)) for lane in range(plan.scan_unroll)]
    targets = [self.index_at(source) for source in sources]   # loaded together: several loads in flight
    for source, target in zip(sources, targets):
      self._add_if_mine(plan, source, target, row_group, first_feature)
    build.end_range(step)
