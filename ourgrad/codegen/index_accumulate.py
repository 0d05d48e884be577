"""Indexed accumulate kernels: out[index[m], :] = start + the rows[m, :] whose index is that row (Ops.INDEX_ACCUMULATE).

The kernel AST is `STORE(INDEX_ACCUMULATE(start, index, rows))`: `start` (N, R), `index` (M,) int32 and `rows`
(M, R) are fused elementwise graphs over LOADs and CONSTs, each in its own shape (engine/schedule.py
`_schedule_index_accumulate`): an int64 index's cast and wrap of negative indices, or a gradient's last multiply, run
inside this kernel. They are computed element by element by the Linearizer's `compute` (`_SourceViews` gives it the
views); a plain row-major LOAD of float32 rows is read as float4 vectors where the width allows. The result is what
numpy's `np.add.at(out, index, rows)` gives on a copy of start: every row added in the order m = 0, 1, ..., repeated
indices summed, an index outside [0, N) ignored. It is deterministic by construction, with no atomics: each output
element has one owner thread, which adds its sources in ascending m.

- On a GPU (`renderer.runs_thread_blocks`: threads, local memory and barriers), block b of B owns the table rows r
  with r mod B = b (strided: the hot rows of text have neighbouring ids, a tokenizer numbers frequent tokens first,
  so each lands in a block of its own), and inside it row group g of G the rows with (r div B) mod G = g; a thread
  of the group owns `vectors_per_thread` vectors of those rows' features (strided by the feature threads, so a
  warp's accesses are contiguous). A thread writes its part of `start`, then the block reads the index array a
  *window* at a time, all its threads together: each thread reads `unroll` indices of the window (coalesced), keeps
  them in local memory, and marks the ones that fall in the block's rows (with warp shuffles, a warp's marks add up
  into one 32-bit mask: WARP_REDUCE of distinct bits). After a BARRIER the marks become an ordered list of hits
  (`_list_hits`), and every thread walks it, a batch of hits at a time, adding each that falls in its row group
  into its features (`_walk_hits`). So the index array is read once per block, not once per thread, and a block's
  threads share the work of reading it.
- The thread adds through a *carry* in local memory: the current value of the last row it added to and that row's
  number. A hit on the same row adds to the carry (a local read-modify-write); a hit on another row stores the
  carry back to the table and loads the new row's value. A row repeated k times in a row of the thread's hits costs
  one global read-modify-write instead of k dependent ones (each waiting on the previous store, from L2). The sums
  run in m order from the start value, so the result is np.add.at's bit for bit (for a 16-bit table on CUDA, whose
  local memory holds the carry as float32, a run is rounded once, where it is stored: PyTorch's float accumulation).
- On a CPU (loops), one thread writes `start`, then walks m = 0 .. M-1 and adds row m into row index[m] (a loop over
  R the C compiler vectorizes).

`IndexAccumulateKernel` offers what engine/realize.py reads of a Kernel (name, leaves, sts, applied_opts,
print_debug, colored_shape, linearize, op_count); no Opts apply (`plan_index_accumulate` sizes it from the device).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ourgrad.codegen.linearizer import INDEX_DTYPE, Linearizer
from ourgrad.codegen.uops import AxisType, UOp, UOpBuilder, UOps
from ourgrad.dtype import DType, dtypes
from ourgrad.helpers import DEBUG, env_var
from ourgrad.ops import LazyOp, MemBuffer, Ops, format_ast
from ourgrad.shape.symbolic import Variable

# GPU threads per multiprocessor the kernel aims for: enough blocks to write the table at bandwidth and to spread the
# hits, few enough that reading the index array once per block stays cheap (its cost grows with the block count)
THREADS_PER_PROCESSOR = 1024
ACCUMULATE_THREADS_PER_SM = env_var("ACCUMULATE_THREADS_PER_SM", 0, "GPU threads per multiprocessor of an indexed "
                                    "accumulate kernel (codegen/index_accumulate.py); 0: its default, 1024")
# threads per block, at most
BLOCK_THREADS = 256
# feature vectors one thread owns, at most (in vectors of the device's width where the width allows)
MAX_VECTORS_PER_THREAD = 4
# indices each thread reads per window (loads in flight)
WINDOW_UNROLL = 4
# source-row elements a thread loads together while it walks a window's hits (registers), at most
MAX_BATCH_ELEMENTS = 32
# batches of the walk over a window's hits that one test of the list's length skips
WALK_GROUP = 8


@dataclass(frozen=True)
class AccumulatePlan:
  """How a GPU indexed accumulate of `count` rows into a (rows, width) output is split over blocks and threads."""
  rows: int
  width: int
  count: int
  vector: int             # elements of one load/store (4: float4), 1: scalar
  vectors_per_thread: int
  feature_threads: int    # a block's threads along the features
  row_groups: int         # a block's threads along its rows (G)
  row_blocks: int         # blocks along the rows (B): block b owns the rows r with r mod B = b
  lanes: int              # indices one mask marks: the warp size where warps vote, else 1
  unroll: int             # indices each thread reads per window
  batch: int              # hits whose source rows one thread loads together

  @property
  def threads(self) -> int: return self.feature_threads * self.row_groups

  @property
  def block_features(self) -> int: return self.feature_threads * self.vectors_per_thread * self.vector

  @property
  def feature_blocks(self) -> int: return self.width // self.block_features

  @property
  def window(self) -> int: return self.threads * self.unroll

  @property
  def windows(self) -> int: return math.ceil(self.count / self.window)

  @property
  def row_slots(self) -> int:
    """Rows one row group owns, at most (rows b + B (g + G s) for s below this)."""
    return math.ceil(self.rows / (self.row_blocks * self.row_groups))

  @property
  def masks(self) -> int: return self.window // self.lanes

  @property
  def masks_per_thread(self) -> int:
    """Masks one thread counts and lists in the compaction (threads t < listing_threads: masks t m .. t m + m - 1)."""
    return math.ceil(self.masks / self.threads)

  @property
  def listing_threads(self) -> int: return math.ceil(self.masks / self.masks_per_thread)

  @property
  def local_elements(self) -> int:
    """int32/uint32 elements of local memory besides the carry: the window's indices, its masks, its hit list, the
    listing threads' counts and the hits' total, the carry rows."""
    return 2 * self.window + self.masks + self.listing_threads + 1 + self.threads


def plan_index_accumulate(rows: int, width: int, count: int, dtype: DType, renderer: Any) -> AccumulatePlan:
  """The GPU split of an indexed accumulate, from the device's facts (threads per block, multiprocessors, warp and
  vector width): see the module docstring."""
  vector = 4 if renderer.vector_width >= 4 and dtype == dtypes.float32 and width % 4 == 0 else 1
  vectors = width // vector
  block = min(renderer.max_threads, BLOCK_THREADS)
  feature_threads = max(divisor for divisor in range(1, min(vectors, block) + 1) if vectors % divisor == 0)
  per_thread = vectors // feature_threads
  vectors_per_thread = max(k for k in range(1, MAX_VECTORS_PER_THREAD + 1) if per_thread % k == 0)
  row_groups = max(1, block // feature_threads)
  warp = renderer.warp_size if 0 < renderer.warp_size <= 32 else 0   # the vote's masks are 32-bit
  if warp:   # blocks of whole warps where a smaller row-group count gives them
    whole = [groups for groups in range(row_groups, 0, -1) if (groups * feature_threads) % warp == 0]
    if whole: row_groups = whole[0]
  threads = feature_threads * row_groups
  lanes = warp if warp and threads % warp == 0 else 1
  per_processor = int(ACCUMULATE_THREADS_PER_SM.value) or THREADS_PER_PROCESSOR
  resident = max(1, renderer.multiprocessors) * max(1, per_processor // threads)
  row_blocks = max(1, min(math.ceil(rows / row_groups), resident))
  # registers: a batch holds its members' source rows at the thread's features
  elements = vectors_per_thread * vector
  batch = max(size for size in (1, 2, 4, 8) if size * elements <= MAX_BATCH_ELEMENTS)
  return AccumulatePlan(rows, width, count, vector, vectors_per_thread, feature_threads, row_groups, row_blocks,
                        lanes, WINDOW_UNROLL, batch)


def _fits_locally(plan: AccumulatePlan, dtype: DType, renderer: Any) -> bool:
  """Whether the plan's local memory (the carry: a block's features of one row per row group, and the window) fits
  the device's."""
  carry = plan.row_groups * plan.block_features * dtype.itemsize
  return carry + 4 * plan.local_elements <= renderer.local_memory_bytes


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
    plan = plan_index_accumulate(self.row_count, self.width, self.count, self.dtype, renderer) \
        if renderer.runs_thread_blocks else None
    # (a plan whose carry and window miss the device's local memory: the loops, in one thread; no GPU here has one)
    self.plan = plan if plan is not None and _fits_locally(plan, self.dtype, renderer) else None

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


  # ---------------------------------------------------------------- GPU: blocks reading windows of the index

  def threads(self, plan: AccumulatePlan) -> None:
    build = self.build
    row_block = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("gidx0", plan.row_blocks, 0, AxisType.GLOBAL))
    first_vector: UOp = self.index_const(0)   # the thread's first feature vector
    if plan.feature_blocks > 1:
      feature_block = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("gidx1", plan.feature_blocks, 1, AxisType.GLOBAL))
      first_vector = self.mul(feature_block, self.index_const(plan.block_features // plan.vector))
    feature_thread, row_group = self.index_const(0), self.index_const(0)
    if plan.feature_threads > 1:
      feature_thread = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("lidx0", plan.feature_threads, 0, AxisType.LOCAL))
    if plan.row_groups > 1:
      row_group = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("lidx1", plan.row_groups, 1, AxisType.LOCAL))
    first_vector = self.add(first_vector, feature_thread)
    # the thread's vectors are strided by the feature threads: a warp's accesses cover one contiguous span
    features = [self.mul(self.add(first_vector, self.index_const(j * plan.feature_threads)),
                         self.index_const(plan.vector)) for j in range(plan.vectors_per_thread)]
    thread = self.add(feature_thread, self.mul(row_group, self.index_const(plan.feature_threads)))
    self._write_start(plan, row_block, row_group, features)
    carry = _Carry(self, plan, thread, features)
    positions = build.add(UOps.DEFINE_LOCAL, dtypes.int32, (), ("window_rows", plan.window))
    masks = build.add(UOps.DEFINE_LOCAL, dtypes.uint32, (), ("window_masks", plan.masks))
    hits = build.add(UOps.DEFINE_LOCAL, dtypes.int32, (), ("window_hits", plan.window))
    # the listing threads' hit counts, then (at listing_threads) the window's total
    counts = build.add(UOps.DEFINE_LOCAL, dtypes.int32, (), ("hit_counts", plan.listing_threads + 1))
    window = self.loop("window", plan.windows)
    window_start = self.mul(window, self.index_const(plan.window))
    self._mark_window(plan, window_start, thread, row_block, positions, masks)
    build.add(UOps.BARRIER, None)
    self._list_hits(plan, thread, masks, hits, counts)
    self._walk_hits(plan, window_start, row_group, positions, hits, counts, carry)
    build.add(UOps.BARRIER, None)   # the next window's marks overwrite these
    build.end_range(window)
    carry.flush()

  def _write_start(self, plan: AccumulatePlan, row_block: UOp, row_group: UOp, features: list[UOp]) -> None:
    """out = start on the thread's rows (b + B (g + G s)) and features: the same thread adds their hits later."""
    build = self.build
    slot = self.loop("row", plan.row_slots)
    local_row = self.add(row_group, self.mul(slot, self.index_const(plan.row_groups)))
    row = self.add(row_block, self.mul(local_row, self.index_const(plan.row_blocks)))
    ragged = plan.row_slots * plan.row_groups * plan.row_blocks != plan.rows
    block = build.add(UOps.IF, None, (self.less(row, self.index_const(self.kernel.row_count)),)) if ragged else None
    for feature in features: self.write_start(row, feature, plan.vector)
    if block is not None: build.end_if(block)
    build.end_range(slot)

  def _unsigned(self, value: UOp) -> UOp: return self.build.add(UOps.CAST, dtypes.uint32, (value,))

  def _is(self, a: UOp, b: UOp) -> UOp:
    """a == b (as the ops have it: not a != b)."""
    build = self.build
    return build.alu(Ops.CMPNE, dtypes.bool, build.alu(Ops.CMPNE, dtypes.bool, a, b), build.const(True, dtypes.bool))

  def _mark_window(self, plan: AccumulatePlan, window_start: UOp, thread: UOp, row_block: UOp, positions: UOp,
                   masks: UOp) -> None:
    """Each thread reads `unroll` indices of the window (neighbouring threads, neighbouring positions), keeps them
    in local memory and marks those in the block's rows: a warp's marks as one mask (lane l's bit), else one mask
    per position."""
    build = self.build
    for step in range(plan.unroll):
      place = self.add(thread, self.index_const(step * plan.threads))
      position = self.add(window_start, place)
      valid = self.less(position, self.index_const(plan.count)) if plan.windows * plan.window != plan.count else None
      if valid is not None: position = build.alu(Ops.WHERE, INDEX_DTYPE, valid, position, self.index_const(0))
      target = self.index_at(position)
      build.add(UOps.STORE, None, (positions, place, target))
      inside = build.alu(Ops.CMPLT, dtypes.bool, self._unsigned(target),
                         build.const(self.kernel.row_count, dtypes.uint32))
      block = build.alu(Ops.MOD, INDEX_DTYPE, build.alu(Ops.WHERE, INDEX_DTYPE, inside, target, self.index_const(0)),
                        self.index_const(plan.row_blocks))
      ours = self.both(inside, self._is(block, row_block))
      if valid is not None: ours = self.both(ours, valid)
      if plan.lanes == 1:
        build.add(UOps.STORE, None, (masks, place, build.add(UOps.CAST, dtypes.uint32, (ours,))))
        continue
      lane = build.alu(Ops.MOD, INDEX_DTYPE, thread, self.index_const(plan.lanes))
      bit = build.alu(Ops.SHL, dtypes.uint32, build.const(1, dtypes.uint32), self._unsigned(lane))
      vote = build.alu(Ops.WHERE, dtypes.uint32, ours, bit, build.const(0, dtypes.uint32))
      mask = build.add(UOps.WARP_REDUCE, dtypes.uint32, (vote,), (Ops.ADD, plan.lanes, 1))   # distinct bits: an OR
      first_lane = build.add(UOps.IF, None, (self.less(lane, self.index_const(1)),))
      build.add(UOps.STORE, None, (masks, build.alu(Ops.IDIV, INDEX_DTYPE, place, self.index_const(plan.lanes)), mask))
      build.end_if(first_lane)

  def _popcount(self, plan: AccumulatePlan, mask: UOp) -> UOp:
    """The set bits of a uint32 mask (as an index), by halving sums (SWAR); a mask of one position is its count."""
    build = self.build
    if plan.lanes == 1: return build.add(UOps.CAST, INDEX_DTYPE, (mask,))

    def u(value: int) -> UOp: return build.const(value, dtypes.uint32)

    def op(alu: Ops, a: UOp, b: UOp) -> UOp: return build.alu(alu, dtypes.uint32, a, b)
    pairs = op(Ops.ADD, op(Ops.AND, mask, u(0x55555555)), op(Ops.AND, op(Ops.SHR, mask, u(1)), u(0x55555555)))
    nibbles = op(Ops.ADD, op(Ops.AND, pairs, u(0x33333333)), op(Ops.AND, op(Ops.SHR, pairs, u(2)), u(0x33333333)))
    octets = op(Ops.AND, op(Ops.ADD, nibbles, op(Ops.SHR, nibbles, u(4))), u(0x0F0F0F0F))
    return build.add(UOps.CAST, INDEX_DTYPE, (op(Ops.SHR, op(Ops.MUL, octets, u(0x01010101)), u(24)),))

  def _list_hits(self, plan: AccumulatePlan, thread: UOp, masks: UOp, hits: UOp, counts: UOp) -> None:
    """The window's marked places, in order, into `hits` (and their number after the counts): listing thread t
    counts the marks of its masks, adds the counts of the threads before it, and writes its places from there. So
    the walk reads only hits, `batch` at a time, however sparse the marks (a hot row's block: a few to a mask)."""
    build = self.build
    per_thread = plan.masks_per_thread
    own = [self.add(self.mul(thread, self.index_const(per_thread)), self.index_const(j)) for j in range(per_thread)]
    inside = [self.less(index, self.index_const(plan.masks)) for index in own]

    def own_masks() -> list[UOp]:   # (read again in each IF: a value of a closed scope is out of C's scope)
      return [build.alu(Ops.WHERE, dtypes.uint32, valid,
                        build.add(UOps.LOAD, dtypes.uint32, (masks, build.alu(Ops.WHERE, INDEX_DTYPE, valid, index,
                                                                              self.index_const(0)))),
                        build.const(0, dtypes.uint32)) for index, valid in zip(own, inside)]
    listing = build.add(UOps.IF, None, (self.less(thread, self.index_const(plan.listing_threads)),))
    counted = [self._popcount(plan, mask) for mask in own_masks()]
    count = counted[0]
    for more in counted[1:]: count = self.add(count, more)
    build.add(UOps.STORE, None, (counts, thread, count))
    build.end_if(listing)
    build.add(UOps.BARRIER, None)
    listing = build.add(UOps.IF, None, (self.less(thread, self.index_const(plan.listing_threads)),))
    count = build.add(UOps.LOAD, dtypes.int32, (counts, thread))
    place = build.add(UOps.DEFINE_ACC, INDEX_DTYPE, (), 0)
    before = self.loop("before", plan.listing_threads)
    earlier = build.alu(Ops.WHERE, INDEX_DTYPE, self.less(before, thread), build.add(UOps.LOAD, dtypes.int32,
                                                                                     (counts, before)),
                        self.index_const(0))
    build.add(UOps.ACCUMULATE, INDEX_DTYPE, (place, earlier), Ops.ADD)
    build.end_range(before)
    last = build.add(UOps.IF, None, (self._is(thread, self.index_const(plan.listing_threads - 1)),))
    build.add(UOps.STORE, None, (counts, self.index_const(plan.listing_threads), self.add(place, count)))
    build.end_if(last)
    for index, mask in zip(own, own_masks()):
      # (most masks are empty: a block owns a small part of the table)
      any_marks = build.add(UOps.IF, None, (build.alu(Ops.CMPNE, dtypes.bool, mask, build.const(0, dtypes.uint32)),))
      member = self.loop("member", plan.lanes) if plan.lanes > 1 else self.index_const(0)
      bit = build.alu(Ops.AND, dtypes.uint32, build.alu(Ops.SHR, dtypes.uint32, mask, self._unsigned(member)),
                      build.const(1, dtypes.uint32))
      marked = build.add(UOps.IF, None, (build.alu(Ops.CMPNE, dtypes.bool, bit, build.const(0, dtypes.uint32)),))
      build.add(UOps.STORE, None, (hits, place, self.add(self.mul(index, self.index_const(plan.lanes)), member)))
      build.add(UOps.ACCUMULATE, INDEX_DTYPE, (place, self.index_const(1)), Ops.ADD)
      build.end_if(marked)
      if plan.lanes > 1: build.end_range(member)
      build.end_if(any_marks)
    build.end_if(listing)
    build.add(UOps.BARRIER, None)

  def _walk_hits(self, plan: AccumulatePlan, window_start: UOp, row_group: UOp, positions: UOp, hits: UOp,
                 counts: UOp, carry: _Carry) -> None:
    """Every thread walks the window's hits in order, `plan.batch` at a time: their source rows of its row group
    are loaded together (several loads in flight: a hot row's hits would otherwise each wait for their load; a hit
    that is not the thread's, or past the list's end, reads the first hit's row instead, from cache), then added to
    the carry one after another, in order."""
    build = self.build
    total = build.add(UOps.LOAD, dtypes.int32, (counts, self.index_const(plan.listing_threads)))
    # batches in groups of WALK_GROUP, each group skipped whole past the list's end (a window's list is mostly short)
    groups = math.ceil(math.ceil(plan.window / plan.batch) / WALK_GROUP)
    group = self.loop("hitgroups", groups)
    group_start = self.mul(group, self.index_const(WALK_GROUP * plan.batch))
    group_listed = build.add(UOps.IF, None, (self.less(group_start, total),))
    batch = self.loop("hits", WALK_GROUP)
    batch_start = self.add(group_start, self.mul(batch, self.index_const(plan.batch)))
    listed = build.add(UOps.IF, None, (self.less(batch_start, total),))
    first_place = build.add(UOps.LOAD, dtypes.int32, (hits, self.index_const(0)))
    found = []
    for j in range(plan.batch):
      entry = self.add(batch_start, self.index_const(j))
      ours = self.less(entry, total)
      place = build.add(UOps.LOAD, dtypes.int32, (hits, build.alu(Ops.WHERE, INDEX_DTYPE, ours, entry,
                                                                  self.index_const(0))))
      target = build.add(UOps.LOAD, dtypes.int32, (positions, place))
      if plan.row_groups > 1:   # the row's group: (r div B) mod G
        local_row = build.alu(Ops.IDIV, INDEX_DTYPE, target, self.index_const(plan.row_blocks))
        owner = build.alu(Ops.MOD, INDEX_DTYPE, local_row, self.index_const(plan.row_groups))
        ours = self.both(ours, self._is(owner, row_group))
      source = self.add(window_start, build.alu(Ops.WHERE, INDEX_DTYPE, ours, place, first_place))
      found.append((ours, target, carry.source_values(source)))
    for ours, target, values in found:
      hit = build.add(UOps.IF, None, (ours,))
      carry.add(target, values)
      build.end_if(hit)
    build.end_if(listed)
    build.end_range(batch)
    build.end_if(group_listed)
    build.end_range(group)


class _Carry:
  """A thread's running row in local memory: the number of the last table row it added to (-1: none yet) and that
  row's current value at the thread's features. Adding a source row to the same table row changes only the carry;
  to another row, the carry is stored to the table first and the new row's value loaded (module docstring)."""

  def __init__(self, lower: _Lowering, plan: AccumulatePlan, thread: UOp, features: list[UOp]):
    self.lower, self.plan, self.features = lower, plan, features
    build, dtype = lower.build, lower.kernel.dtype
    self.elements = len(features) * plan.vector
    self.row = build.add(UOps.DEFINE_LOCAL, dtypes.int32, (), ("carry_rows", plan.threads))
    self.values = build.add(UOps.DEFINE_LOCAL, dtype, (), ("carry_values", plan.threads * self.elements))
    self.thread = thread
    # element e of thread t at e * threads + t: neighbouring threads, neighbouring banks
    self.places = [lower.add(thread, lower.index_const(element * plan.threads)) for element in range(self.elements)]
    build.add(UOps.STORE, None, (self.row, thread, lower.index_const(-1)))

  def _row_index(self, row: UOp, feature: UOp) -> UOp:
    return self.lower.add(self.lower.mul(row, self.lower.index_const(self.lower.kernel.width)), feature)

  def _store_back(self, row: UOp) -> None:
    """table[row] = the carry (at the thread's features)."""
    lower, build, vector = self.lower, self.lower.build, self.plan.vector
    values = [build.add(UOps.LOAD, lower.kernel.dtype, (self.values, place)) for place in self.places]
    for j, feature in enumerate(self.features):
      lower.store(self._row_index(row, feature), values[j * vector:(j + 1) * vector])

  def source_values(self, source: UOp) -> list[UOp]:
    """rows[source] at the thread's features."""
    lower, kernel = self.lower, self.lower.kernel
    return [value for feature in self.features
            for value in lower.row_values(kernel.rows, source, kernel.count, feature, self.plan.vector)]

  def add(self, target: UOp, added: list[UOp]) -> None:
    """carry (switched to row `target` first) += `added` (rows[source] at the thread's features)."""
    lower, build, kernel = self.lower, self.lower.build, self.lower.kernel
    current = build.add(UOps.LOAD, dtypes.int32, (self.row, self.thread))
    other = build.add(UOps.IF, None, (build.alu(Ops.CMPNE, dtypes.bool, current, target),))
    held = build.add(UOps.IF, None, (lower.less(lower.index_const(-1), current),))
    self._store_back(current)
    build.end_if(held)
    loaded = [value for feature in self.features for value in
              lower.load_buffer(lower.out, kernel.dtype, self._row_index(target, feature), self.plan.vector)]
    for place, value in zip(self.places, loaded): build.add(UOps.STORE, None, (self.values, place, value))
    build.add(UOps.STORE, None, (self.row, self.thread, target))
    build.end_if(other)
    for place, value in zip(self.places, added):
      total = build.alu(Ops.ADD, kernel.dtype, build.add(UOps.LOAD, kernel.dtype, (self.values, place)), value)
      build.add(UOps.STORE, None, (self.values, place, total))

  def flush(self) -> None:
    """Stores the last carry back to the table."""
    build = self.lower.build
    current = build.add(UOps.LOAD, dtypes.int32, (self.row, self.thread))
    held = build.add(UOps.IF, None, (self.lower.less(self.lower.index_const(-1), current),))
    self._store_back(current)
    build.end_if(held)
