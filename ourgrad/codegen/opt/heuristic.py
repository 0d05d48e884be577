"""Hand-coded optimizations: a good default Opt list for a Kernel, without search.

CPUs (no thread blocks): register-tile matmul-like reduces (upcast the output axes some input broadcasts, so each
loaded value is reused from registers; the CLANG renderer writes the tile's columns as explicit SIMD vectors),
unroll the reduce a little, and unroll 4 neighbouring elementwise outputs so the C compiler sees straight-line
vectorizable code.

GPUs (thread blocks and local memory):
- a reduce whose input is contiguous along the reduce (a row reduction: sum, max, softmax, layernorm) gets a block
  per output with the reduce split across its threads by GROUP (neighbouring threads read neighbouring elements);
  a short row gets a warp;
- a reduce whose input is contiguous along an output axis (a column reduction) puts that output axis on LOCAL
  threads (coalesced) and, when that leaves too few blocks to fill the device, splits the reduce over GROUPTOP;
- float16/bfloat16 matmuls on a renderer with tensor cores (any operand layout: transposed, batched, read through
  several views, padded, or computed from loads; codegen/matmul_operands.py) get OptOps.TC (output axes padded to
  the tile first where they are ragged), then each warp several 16x8 tiles (UPCAST) and each block several warps
  (LOCAL); staged through local memory (SHARED) in the largest block tile of TC_STAGED_TILES (128x128 down to 64x64)
  whose grid fills the multiprocessors;
  on sm_90 (renderer.has_wgmma) large ones whose sizes divide a 128x256 (or 128x128) tile get OptOps.WGMMA instead;
  float32 ones too where TF32 is allowed (m16n8k8; wgmma where B is K-major), staged only and with at least
  TF32_MIN_BLOCKS blocks (else the float32 tiles below are faster);
- a float32 matmul (plain, transposed, batched, or with an operand computed from loads) whose sizes divide a block
  tile gets shared-memory tiles (SHARED): of at least 2^28 multiply-adds, the tile the grid model predicts fastest
  (codegen/opt/matmul_grid.py: rounds of blocks on the multiprocessors x a block's work at its tile's rate; tiles of
  8x12 outputs a thread among them, and the lazy layer may have split a long reduce across blocks by the same
  model); smaller ones the largest tile (128x128 down to 16x16) whose grid gives every multiprocessor a block; 4x4
  (8x8 for 128x128) outputs per thread, every operand staged through local memory, the reduce split over GROUP
  threads where the grid still has too few threads (split-K inside the block);
- a thin float32 matmul (an output axis of at most 16, a long reduce) splits the reduce over the block's threads;
- a small-window reduce (a pool: many outputs, a few neighbouring inputs each) gets its window unrolled and its
  threads along the output's contiguous axes (codegen/opt/window_tiles.py);
- other matmul-like reduces get register tiles, then thread blocks from the innermost output axes;
- elementwise kernels get thread blocks from the innermost output axes; where those would split a warp over short
  rows (24 columns: power-of-two parts of 8), 4 outputs per thread and threads along the columns, then the rows
  (window_tiles.elementwise_rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.dtype import dtypes
from ourgrad.codegen.opt.conv_tiles import ConvTileStrategy, TensorCoreConvStrategy, WeightGradientStrategy
from ourgrad.codegen.opt.plans import (Plan, RecognizerStrategy, Strategy, cpu_reduce, first_plan, gpu_local_reduce,
                                       memory_loads, register_plan)
from ourgrad.codegen.opt.shared_tile_plans import SharedTileStrategy, dense_matmul_axes
from ourgrad.codegen.opt.tensor_core_plans import TensorCoreStrategy, WgmmaStrategy
from ourgrad.codegen.opt.transpose_tiles import TransposeTileStrategy
from ourgrad.codegen.opt.cpu_tiles import cpu_matmul_tiles
from ourgrad.codegen.opt.window_tiles import ThreadWalkStrategy
from ourgrad.codegen.opt.coalesce import lane_axis, load_lane_axis
from ourgrad.helpers import VECTOR_GROUP_REDUCE, power_of_two_divisor, prod
from ourgrad.ops import BINARY_OPS, TERNARY_OPS, UNARY_OPS, LazyOp, MemBuffer, Ops
from ourgrad.shape.shapetracker import ShapeTracker

# threads per block the heuristics aim for on GPUs
BLOCK_THREADS = 256
# a GPU needs about this many blocks in flight to keep every multiprocessor busy (H100: 132 SMs x several blocks)
ENOUGH_BLOCKS = 1024
WARP_SIZE = 32
# reduces shorter than this stay loops inside one thread when there are enough outputs to fill the GPU
SHORT_REDUCE = 128
# an elementwise kernel's rows take float4 columns where a row is at least this many vectors: a warp's loads and
# stores then cover whole 128-byte lines (rows of 64 floats as much as rows of 128)
VECTOR_ROW_LANES = 8


# threads in flight per multiprocessor a reduce with few outputs aims for, splitting its reduce over more threads (a
# decode step's products and attention scores: a warp per row of 576 rows left the H200 with 4 warps per
# multiprocessor), and the reduce elements each such thread keeps at least
THREADS_IN_FLIGHT_PER_MULTIPROCESSOR = 1024
MIN_THREAD_LOOP = 4


def threads_in_flight_wanted(kernel: Kernel) -> int:
  """THREADS_IN_FLIGHT_PER_MULTIPROCESSOR times the device's multiprocessors (ENOUGH_BLOCKS warps where unknown)."""
  processors = getattr(kernel.renderer, "multiprocessors", 0)
  return processors * THREADS_IN_FLIGHT_PER_MULTIPROCESSOR if processors else ENOUGH_BLOCKS * WARP_SIZE


def hand_coded_optimizations(kernel: Kernel) -> None:
  """Apply the default Opts for the kernel's device in place: the plan of the first strategy of STRATEGIES that fits
  (kernel.plan records it)."""
  first_plan(STRATEGIES, kernel)


def _loop_tiles(kernel: Kernel) -> bool:
  """The generic loop-nest default every other strategy falls back to: GPU elementwise kernels 4 outputs per thread,
  register tiles and unrolled reduces, then (GPUs) thread blocks from the innermost output axes and GROUP threads for
  a reduce with too few outputs."""
  gpu, has_local = kernel.renderer.has_threads, getattr(kernel.renderer, "has_local", False)
  if gpu and kernel.reduceop is None: _elementwise_rows(kernel)
  _register_tiling(kernel)
  if gpu: _pick_thread_blocks(kernel)
  if gpu and has_local and kernel.reduceop is not None: _group_for_parallelism(kernel)
  return True


# an output axis this short (a classifier's 10 classes) makes a matmul thin: too few outputs for output tiles to fill
# the GPU, so threads split the reduce instead
THIN_SIDE = 16
THIN_BLOCKS_PER_MULTIPROCESSOR = 4
# a rows plan's wide rows per thread where the narrow axis is at least this long and the narrow operand is computed on
# its loads at a cost of at least THIN_RECOMPUTE_COST ops per element (transcendental ops weigh 4: a batched decode
# step's SwiGLU silu(gate) * up, recomputed for every row of the down projection): each value then serves this many
# rows. A plain load of it is cheaper than the threads the upcast takes away.
THIN_ROWS_PER_THREAD = 4
THIN_RECOMPUTE_COST = 4
# a rows plan with many rows (the `many` rule in ThinMatmulStrategy) reads its wide operand as vectors of at most this
# many elements a thread (its reduce axis unrolled by them before GROUP, as _unroll_vector_lanes does for a row
# reduction), where the threads left are still a power of two of at least half a warp. H200, 8 sequences' bf16 logits
# (49152 x 576): 39.4 -> 27.2 us; the few-row output and down projections were no faster (3.04 -> 3.37, 3.80 -> 3.84
# us), so they keep an element a thread (results/ck_s21/dec_gpu21_1.txt). 1: off
THIN_VECTOR_LANES = 8


@register_plan
@dataclass(frozen=True)
class ThinMatmulPlan(Plan):
  """A thin float32 matmul's split reduce (see ThinMatmulStrategy): `rows` (the wide operand contiguous along the
  reduce): `local` LOCAL threads along the wide output axis, the short axis UPCAST whole, `upcast` wide rows UPCAST
  in each thread and `group` GROUP threads over the reduce; else (columns): `local` neighbouring outputs on LOCAL
  threads and `group` GROUPTOP threads, the short axis left to the grid. `unroll`: the reduce loop left unrolled by it
  (0: not)."""
  rows: bool
  local: int
  group: int
  unroll: int = 0
  upcast: int = 1
  lanes: int = 1

  def apply(self, kernel: Kernel) -> bool:
    axes = dense_matmul_axes(kernel)
    if axes is None: return False
    sizes = kernel.full_shape
    narrow, wide = sorted(axes, key=lambda axis: sizes[axis])
    outputs = [Opt(OptOps.LOCAL, wide, self.local)]
    if self.rows: outputs += [Opt(OptOps.UPCAST, narrow, sizes[narrow]), Opt(OptOps.UPCAST, wide, self.upcast)]
    # an amount of 1 is no opt; the reduce split comes after the output axes' opts
    if not kernel.try_output_opts([opt for opt in outputs if opt.amount > 1]): return False
    if self.lanes > 1 and not kernel.try_opt(Opt(OptOps.UNROLL, 0, self.lanes)): return False
    reduce = OptOps.GROUP if self.rows else OptOps.GROUPTOP
    if self.group > 1 and not kernel.try_opt(Opt(reduce, 0, self.group)): return False
    return not self.unroll or kernel.try_opt(Opt(OptOps.UNROLL, 0, self.unroll))


class ThinMatmulStrategy(Strategy):
  """A float32 matmul (see dense_matmul_axes) with an output axis of at most THIN_SIDE and a long reduce (a
  classifier's forward, 512x10, and its weight gradient, 10x512, each with K = the batch): enough blocks for every
  multiprocessor, the reduce split over the block's threads. Where the wide operand is contiguous along the reduce
  (rows), a warp of GROUP threads reads each row together and each thread computes every output of the short axis
  (UPCAST: one load of the row reused); where it is contiguous along the wide output axis (columns), 32 neighbouring
  outputs on LOCAL threads (coalesced) and GROUPTOP over the reduce, the short axis left to the grid. The reduce loop
  left is unrolled by 4 where it divides."""
  name = "thin_matmul"

  def applies(self, kernel: Kernel) -> bool: return gpu_local_reduce(kernel)

  def choose(self, kernel: Kernel) -> tuple[Plan, Kernel] | None:
    axes = dense_matmul_axes(kernel)
    if axes is None: return None
    sizes, k_axis = kernel.full_shape, kernel.first_reduce
    narrow, wide = sorted(axes, key=lambda axis: sizes[axis])
    if sizes[narrow] > THIN_SIDE or sizes[k_axis] < 4 * WARP_SIZE: return None
    wide_loads = [st for st in memory_loads(kernel) if st.real_strides()[wide] != 0 and st.real_strides()[k_axis] != 0]
    rows = all(st.real_strides()[k_axis] == 1 for st in wide_loads)
    upcast, lanes = 1, 1
    if rows:
      recomputed = _cost_broadcast_along(kernel, wide) >= THIN_RECOMPUTE_COST
      # rows so many that a warp per THIN_ROWS_PER_THREAD of them still fills the device (a batched decode step's
      # vocabulary logits, 49152 rows): each load of the narrow operand (every sequence's x, re-read per row from
      # cache otherwise: 18 KB a row at 8 sequences) serves that many rows from registers
      many = prod(sizes[:min(axes)]) * sizes[wide] // THIN_ROWS_PER_THREAD * WARP_SIZE >= \
        threads_in_flight_wanted(kernel)
      upcast = THIN_ROWS_PER_THREAD if (recomputed or many) and sizes[narrow] >= THIN_ROWS_PER_THREAD else 1
      if sizes[wide] % upcast: upcast = 1
      lanes = _thin_row_lanes(kernel, wide_loads, sizes[k_axis]) if many and upcast > 1 else 1
      group = power_of_two_divisor(sizes[k_axis] // lanes, WARP_SIZE)
      local = power_of_two_divisor(sizes[wide] // upcast, BLOCK_THREADS // 2 // group)
      # a warp per row while that leaves 4 blocks per multiprocessor (H100, 512x10 outputs: a row per block 0.010 ms,
      # 2 rows 0.013)
      processors, batch = getattr(kernel.renderer, "multiprocessors", 0), prod(sizes[:min(axes)])
      rows_of = batch * sizes[wide] // upcast
      while local > 1 and rows_of // local < THIN_BLOCKS_PER_MULTIPROCESSOR * processors: local //= 2
      # few rows (a batched decode step's 576 x 8 outputs: a warp each left 4 warps per H200 multiprocessor, its down
      # projection at 20 GB/s): more GROUP threads per row
      group = _more_group_threads(sizes[k_axis] // lanes, group, rows_of * group, threads_in_flight_wanted(kernel),
                                  BLOCK_THREADS // local, max(1, MIN_THREAD_LOOP // lanes))
    else:
      local = power_of_two_divisor(sizes[wide], WARP_SIZE)
      group = power_of_two_divisor(sizes[k_axis] // 2, BLOCK_THREADS // local)
    loop = sizes[k_axis] // lanes // group
    for unroll in ((4, 0) if loop % 4 == 0 and loop > 4 else (0,)):
      plan, trial = ThinMatmulPlan(rows, local, group, unroll, upcast, lanes), kernel.copy()
      if plan.apply(trial): return plan, trial
    return None


def _thin_row_lanes(kernel: Kernel, wide_loads: list[ShapeTracker], k: int) -> int:
  """The vector a thread of a thin rows plan reads of its wide operand (THIN_VECTOR_LANES at most, the renderer's
  vector of that operand's dtype): the widest that divides the reduce and leaves a power-of-two group of at least
  half a warp (combined by shuffles). 1: one element a thread."""
  dtypes_of = {id(st): leaf.dtype for st, leaf in zip(kernel.sts, kernel.leaves)}
  widest = min((kernel.renderer.vector_lanes(dtypes_of[id(st)]) for st in wide_loads), default=0)
  lanes = min(THIN_VECTOR_LANES, widest)
  while lanes > 1 and (k % lanes or power_of_two_divisor(k // lanes, WARP_SIZE) < WARP_SIZE // 2): lanes //= 2
  return max(lanes, 1)


def _cost_broadcast_along(kernel: Kernel, axis: int) -> int:
  """The ops per element of the kernel's values that depend only on loads broadcast along `axis` (the same for every
  index of it: the narrow operand of a thin product, with the elementwise work fused into its loads), transcendental
  ops weighing 4."""
  broadcast = {id(leaf): st.real_strides()[axis] == 0 for st, leaf in zip(kernel.sts, kernel.leaves)}
  # the values computed, not the addresses of gathered loads (an embedding row's offset from its token)
  values, stack = set(), [kernel.ast]
  while stack:
    node = stack.pop()
    if id(node) in values: continue
    values.add(id(node))
    if node.op is not Ops.LOAD: stack.extend(node.srcs)
  only_broadcast: dict[int, bool] = {}
  cost = 0
  for node in (node for node in kernel.ast.walk() if id(node) in values):
    if node.op is Ops.LOAD: only_broadcast[id(node)] = broadcast.get(id(node), False)
    elif node.op is Ops.CONST: only_broadcast[id(node)] = True
    elif node.op in UNARY_OPS | BINARY_OPS | TERNARY_OPS:
      only_broadcast[id(node)] = all(only_broadcast.get(id(src), False) for src in node.srcs)
      if only_broadcast[id(node)] and node.op is not Ops.CAST:
        cost += 4 if node.op in (Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.SQRT, Ops.RECIP) else 1
  return cost


def _more_group_threads(reduce_size: int, group: int, threads: int, threads_wanted: int, group_limit: int,
                        min_loop: int = MIN_THREAD_LOOP) -> int:
  """GROUP threads per output: `group` doubled while the kernel has fewer than `threads_wanted` threads (`threads` at
  `group`), the doubled group divides the reduce, stays within `group_limit` and leaves each thread at least
  `min_loop` elements (vectors, where the reduce was unrolled by them): more warps in flight to hide the loads'
  latency."""
  while threads < threads_wanted and group * 2 <= group_limit and reduce_size % (group * 2) == 0 and \
      reduce_size // (group * 2) >= min_loop:
    group, threads = group * 2, threads * 2
  return group


# an operand reused across fewer outputs than this is no reason for register tiles (a thread's tile: 4x4 outputs)
MIN_TILE_REUSE = 16


def reads_an_input_whole(shape: Sequence[int], input_strides: Sequence[Sequence[int | None]]) -> bool:
  """Whether some input (its `input_strides` over `shape`; 0: broadcast) varies along every axis of size above one:
  a reduce reading it is bound by its bytes, as a plain reduce is, whatever the other inputs' reuse (a LayerNorm
  weight gradient reads x and dy whole beside per-token statistics)."""
  sized = [axis for axis in range(len(shape)) if shape[axis] != 1]
  return any(all(strides[axis] != 0 for axis in sized) for strides in input_strides)


def register_tiles_pay_off(shape: Sequence[int], reduce_axes: Sequence[int],
                           input_strides: Sequence[Sequence[int | None]], gathers: bool = False) -> bool:
  """Whether register tiles of outputs pay off on a GPU for a reduce over `reduce_axes` of `shape` whose inputs have
  `input_strides` (0: broadcast along that axis; None: not affine): some input is reused across at least
  MIN_TILE_REUSE outputs while it varies along the reduce, and no input is read whole (no broadcast axis).

  A reduce that reads an input whole is bound by its bytes, as a plain reduce is, whatever the others' reuse: a
  LayerNorm weight gradient reads x and dy whole and reuses the per-token mean and rstd (3 blocks of register tiles
  on an H200, 89 GB/s). An operand reused a few times (learned positions added across a batch of 8) is no matmul
  either. A vector that varies only along the reduce (no output axis) counts where the kernel's other reads are
  small (a count of tokens per vocabulary entry: each loaded token serves a tile of outputs), not beside `gathers`
  (loads at a per-element offset, an embedding's rows: LayerNorm's row sums over wte[tokens] + wpe with its weight
  vector were 2 blocks of tiles). The lazy layer's split asks this of a product, the heuristic of a kernel."""
  sized = [axis for axis in range(len(shape)) if shape[axis] != 1]
  outputs = [axis for axis in sized if axis not in reduce_axes]
  reduces = [axis for axis in sized if axis in reduce_axes]
  if reads_an_input_whole(shape, input_strides): return False
  for strides in input_strides:
    if prod(shape[axis] for axis in outputs if strides[axis] == 0) < MIN_TILE_REUSE: continue
    if not any(strides[axis] != 0 for axis in reduces): continue
    if not gathers or any(strides[axis] != 0 for axis in outputs): return True
  return False


def _gpu_tiles_pay_off(kernel: Kernel) -> bool:
  """register_tiles_pay_off for this kernel's loads (a GPU's choice; CPUs ask cpu_tiles.matmul_like)."""
  loads = [(st, leaf) for st, leaf in zip(kernel.sts[1:], kernel.leaves[1:]) if isinstance(leaf.arg, MemBuffer)]
  return register_tiles_pay_off(kernel.full_shape, range(kernel.first_reduce, kernel.shape_len),
                                [_load_strides(kernel, st, leaf) for st, leaf in loads],
                                gathers=any(leaf.srcs for _, leaf in loads))


def _load_strides(kernel: Kernel, st: ShapeTracker, leaf: LazyOp) -> list[int | None]:
  """A load's strides along the kernel's axes; a gathered load's (an embedding's rows) are unknown (None) wherever its
  indices vary: its view says where in a row it reads, the indices which row, one per token. Taken as broadcast
  there, wte[tokens] + wpe looked like 16 reuses of wpe across a batch of 16: LayerNorm's row sums over it were 8
  blocks of 4x4 register tiles (GPT-2's bf16 step, 16 x 1024 tokens: 0.19 ms, 9% of the H200's DRAM bandwidth)."""
  strides: list[int | None] = list(st.real_strides())
  for source in leaf.srcs:
    for node in source.walk():
      if node.op is not Ops.LOAD or not isinstance(node.arg, MemBuffer): continue
      index_strides = kernel.sts[kernel.leaf_number(node)].real_strides()
      strides = [None if index_stride != 0 else stride for stride, index_stride in zip(strides, index_strides)]
  return strides


def _contiguous_axis(kernel: Kernel) -> int | None:
  """The dimension along which the biggest input is contiguous (stride 1), if any."""
  loads = memory_loads(kernel)
  if not loads: return None
  st = max(loads, key=lambda view: prod(size for size, stride in zip(view.shape, view.real_strides()) if stride != 0))
  strides = st.real_strides()
  for axis in reversed(range(kernel.shape_len)):
    if strides[axis] == 1 and kernel.full_shape[axis] > 1: return axis
  return None


def _largest_divisor_at_most(size: int, limit: int) -> int:
  """A power of two where one fits well (warp shuffles need them), else the largest divisor <= limit."""
  power = power_of_two_divisor(size, limit)
  best = max(amount for amount in range(1, min(size, limit) + 1) if size % amount == 0)
  return power if power * 2 > best else best


# the GROUP threads of a reduce may come from up to this many reduce loop axes: a batchnorm statistic over an 8x8 image
# takes 8 x 8 threads from the image and 4 more from the images of its part (a block of 256, not 64)
GROUP_MAX_AXES = 3
# after GROUP, a short reduce loop left in each thread (at most GROUP_SHORT_LOOP trips: batchnorm statistics split
# into parts of a few images) has its innermost axis unrolled by up to GROUP_LOOP_UNROLL, so each thread has that
# many independent loads in flight instead of one per trip; long loops (a row of 8192) are left to the compiler
GROUP_LOOP_UNROLL = 4
GROUP_SHORT_LOOP = 16
# a column reduction's LOCAL threads along its contiguous output axis (a warp reads that many neighbours)
COLUMN_LOCALS = WARP_SIZE
# a plain reduce's GROUP prefers powers of two (see _group_amounts) where the innermost axis keeps at least
# min(GROUP_COALESCED_LANES, what any divisor would give) neighbouring lanes on neighbouring elements
GROUP_POWERS_OF_TWO = True
GROUP_COALESCED_LANES = WARP_SIZE


def _group_reduce_axes(kernel: Kernel, budget: int, max_axes: int = 2, powers_of_two: bool = False) -> None:
  """GROUP threads taken from the reduce loop axes, innermost first (neighbouring threads read neighbouring
  elements), until the block has `budget` group threads or `max_axes` axes were used (see _group_amounts). See
  _coalesced_group_plans for the order in which they are applied (the first plan that applies whole; none: the
  kernel stays as it was)."""
  for plan in _coalesced_group_plans(kernel, _group_amounts(kernel, budget, max_axes, powers_of_two)):
    start = kernel._state()
    if all(kernel.try_opt(Opt(OptOps.GROUP, relative, amount)) for relative, amount in plan): return
    kernel._restore(start)


def _group_amounts(kernel: Kernel, budget: int, max_axes: int, powers_of_two: bool) -> list[int]:
  """Threads per reduce loop axis, innermost axis first: the innermost gets the most (all of it, up to the budget),
  each next axis out what is left, while at least 2 are left and at most `max_axes` axes are used. With
  `powers_of_two`, powers of two where they give at least half the threads (the group is then combined by warp
  shuffles, not a tree of barriers) and the innermost axis keeps a warp's worth (or as many as otherwise) of
  neighbouring threads: a 576-long image row takes 64 threads and 4 images of the part take 4 more, rather than 192
  threads alone."""
  loop_sizes = [kernel.full_shape[axis] for axis in range(kernel.first_upcast - 1, kernel.first_loop_reduce - 1, -1)]

  def greedy(divisor: Callable[[int, int], int]) -> list[int]:
    amounts: list[int] = []
    for size in loop_sizes[:max_axes]:
      amount = divisor(size, budget // prod(amounts))
      if amount < 2: break
      amounts.append(amount)
      if prod(amounts) * 2 > budget: break
    return amounts
  any_divisor = greedy(_largest_divisor_at_most)
  if not powers_of_two: return any_divisor
  powers = greedy(power_of_two_divisor)
  if not powers or not any_divisor: return powers or any_divisor
  # ... and where the innermost axis keeps as many neighbouring threads (up to a warp) reading neighbouring elements
  coalesced = powers[0] >= min(GROUP_COALESCED_LANES, any_divisor[0])
  return powers if coalesced and prod(powers) * 2 >= prod(any_divisor) else any_divisor


def _coalesced_group_plans(kernel: Kernel, amounts: list[int]) -> list[list[tuple[int, int]]]:
  """GROUP opts (relative reduce axis, amount) taking `amounts` threads from the innermost reduce loop axes
  (innermost first, see _group_amounts), each plan in the order to apply it: every axis, then fewer (the innermost
  ones; where the block cannot take them all). The outermost GROUP goes first: each GROUP becomes the innermost
  thread dimension (the launch's x), and the innermost memory axis must be the one that varies fastest across a
  warp's threads, or a warp's loads (batchnorm statistics over a 24x24 image, say) are a row apart instead of
  neighbours."""
  loop_count = kernel.first_upcast - kernel.first_loop_reduce
  plans = []
  for used in range(len(amounts), 0, -1):
    plan, removed = [], 0
    for depth in reversed(range(used)):   # outermost of the used axes first
      relative = loop_count - 1 - depth - removed
      plan.append((relative, amounts[depth]))
      # a GROUP taking the whole axis removes it from the loops: the axes inside it move one place left
      if amounts[depth] == kernel.full_shape[kernel.first_loop_reduce + loop_count - 1 - depth]: removed += 1
    plans.append(plan)
  return plans


def _unroll_group_loop(kernel: Kernel) -> None:
  """UNROLL the innermost reduce loop a GROUP reduce has left by up to GROUP_LOOP_UNROLL (a divisor of it), where
  the loops left are short (GROUP_SHORT_LOOP)."""
  loops = kernel.first_upcast - kernel.first_loop_reduce
  if loops < 1 or kernel.first_upcast < kernel.shape_len: return   # no loop left, or already upcast/unrolled
  if prod(kernel.full_shape[kernel.first_loop_reduce:kernel.first_upcast]) > GROUP_SHORT_LOOP: return
  size = kernel.full_shape[kernel.first_upcast - 1]
  amount = max((amount for amount in range(2, GROUP_LOOP_UNROLL + 1) if size % amount == 0), default=0)
  if amount: kernel.try_opt(Opt(OptOps.UNROLL, loops - 1, amount))


def _row_group_budget(kernel: Kernel, loop_total: int, outputs: int, lanes: int) -> int:
  """GROUP threads per output of a row reduction with `loop_total` elements (vectors of `lanes`) a row: a block of
  BLOCK_THREADS for long rows, a warp for short ones, more where the outputs are few (a decode step's 576-row output
  projection), each thread keeping at least MIN_THREAD_LOOP elements (one vector)."""
  budget = BLOCK_THREADS if loop_total >= 4 * BLOCK_THREADS else WARP_SIZE
  return _more_group_threads(loop_total, budget, outputs * budget, threads_in_flight_wanted(kernel), BLOCK_THREADS,
                             max(1, MIN_THREAD_LOOP // lanes))


# a row reduction whose biggest load is narrower than this (bytes an element: Q8_0's int8 quants, Q4's nibble pairs)
# is unrolled by a vector a thread before its threads are grouped: see _unroll_vector_lanes. 16-bit weights stay one
# element a thread: on the H200 the bf16 decode step was 2.5% slower with theirs as vectors (fed back on the device
# 1763 against 1809 tok/s, same call), the Q8_0 step 5.6% faster with its quants as vectors and aligned
NARROW_LOAD_BYTES = 2


def _unroll_vector_lanes(kernel: Kernel, accept: Callable[[int], bool]) -> int:
  """UNROLL the innermost reduce loop axis by the vector width (Renderer.vector_lanes: 16 bytes) of the biggest
  load where that load is narrow (NARROW_LOAD_BYTES) and contiguous along it, so that each thread reads one vector
  an iteration and the GROUP threads then stride over whole vectors. A decode step's Q8_0 matrix-vector products
  (576 outputs, k 576-1536: few rows, each a few KB) read one byte a thread (32 bytes a warp instruction) and the
  block's f16 scale beside each; as vectors, 4 quants a load (an aligned uchar4 where the blocks are kept without
  their scales, PackedTensor.quants_apart; else 4 byte loads in flight together) share one load of the scale.
  `accept(width)`: whether the kernel so unrolled takes the threads wanted (else the next narrower vector is
  tried). Returns the amount unrolled (1: the kernel untouched)."""
  axis = kernel.first_upcast - 1
  if not VECTOR_GROUP_REDUCE.value or axis < kernel.first_loop_reduce or kernel.upcasted: return 1
  loads = [(st, leaf) for st, leaf in zip(kernel.sts[1:], kernel.leaves[1:]) if isinstance(leaf.arg, MemBuffer)]
  if not loads: return 1
  st, leaf = max(loads, key=lambda load: prod(size for size, stride in zip(load[0].shape, load[0].real_strides())
                                              if stride != 0) * load[1].dtype.itemsize)
  lanes = kernel.renderer.vector_lanes(leaf.dtype) if hasattr(kernel.renderer, "vector_lanes") else 0
  if leaf.dtype.itemsize >= NARROW_LOAD_BYTES or st.real_strides()[axis] != 1: return 1
  # the widths the linearizer loads as one vector (its _vector_widths), widest first
  for width in (lanes, getattr(kernel.renderer, "vector_width", 0)):
    if width < 2 or kernel.full_shape[axis] % width: continue
    start = kernel._state()
    if kernel.try_opt(Opt(OptOps.UNROLL, axis - kernel.first_reduce, width)) and accept(width): return width
    kernel._restore(start)
  return 1


def _group_reduce(kernel: Kernel) -> bool:
  """GROUP-based defaults for reduces that are not matmul-like. False (kernel untouched) where they do not apply."""
  if kernel.first_upcast <= kernel.first_reduce: return False
  # the lanes go where most loads are contiguous, in pieces too (coalesce.py: a cat of permuted views)
  contiguous = lane_axis(memory_loads(kernel), kernel.first_reduce, COLUMN_LOCALS, _contiguous_axis(kernel))
  outputs = prod(kernel.full_shape[:kernel.first_reduce])
  reduce_total = prod(kernel.full_shape[kernel.first_reduce:kernel.first_upcast])
  # a short reduce (a pooling window) is cheaper as a loop in each thread than as threads that must meet, unless the
  # outputs are too few to keep the GPU busy
  if reduce_total < SHORT_REDUCE and outputs >= ENOUGH_BLOCKS and not _short_reduce_few_outputs(kernel): return False
  if contiguous is None or contiguous >= kernel.first_reduce:
    # row reduction (or no stride-1 input): the block's threads stride over the row together (coalesced). A narrow
    # load's vectors first (the threads then count vectors, each at least one), only where the group is then a
    # power of two of at least half a warp (combined by shuffles): 576 bfloat16s as 72 vectors of 8 would take 24
    # threads and a tree of 5 barriers, so they stay one element a thread
    def shuffled_group(lanes: int) -> bool:
      threads = prod(_group_amounts(kernel, _row_group_budget(kernel, reduce_total // lanes, outputs, lanes),
                                    GROUP_MAX_AXES, GROUP_POWERS_OF_TWO))
      return threads >= WARP_SIZE // 2 and threads & (threads - 1) == 0
    lanes = _unroll_vector_lanes(kernel, shuffled_group)
    budget = _row_group_budget(kernel, reduce_total // lanes, outputs, lanes)
    reduce_axes = kernel.first_upcast - kernel.first_loop_reduce
    _group_reduce_axes(kernel, budget, GROUP_MAX_AXES, GROUP_POWERS_OF_TWO)
    if kernel.group_dims:
      _upcast_shared_axis(kernel)
      _upcast_recomputed_rows(kernel)
      _fill_row_blocks(kernel)
    # a reduce over several axes (N, H, W of batchnorm statistics) is left a short loop per thread: unrolled. A row
    # reduction (one axis) keeps its loop (the row kernels' choice)
    if kernel.group_dims and reduce_axes > 1: _unroll_group_loop(kernel)
    return kernel.group_dims > 0
  # column reduction: neighbouring threads take neighbouring outputs; split the reduce when blocks are few
  locals_ = power_of_two_divisor(kernel.full_shape[contiguous], COLUMN_LOCALS)
  if locals_ < 2 or not kernel.try_opt(Opt(OptOps.LOCAL, contiguous, locals_)): return False
  blocks = outputs // locals_
  first_reduce_size = kernel.full_shape[kernel.first_reduce]
  if blocks < ENOUGH_BLOCKS:
    group = _largest_divisor_at_most(first_reduce_size, BLOCK_THREADS // locals_)
    if group >= 2: kernel.try_opt(Opt(OptOps.GROUPTOP, 0, group))
  return True


# a grouped row reduction's short output axis along which its biggest input is broadcast (grouped-query attention's
# query heads sharing a KV head: a decode step's scores) is upcast whole up to this size, so that each element
# loaded serves every index of it (the keys read once per KV head, not once per query head)
SHARED_AXIS_UPCAST = 4


def _upcast_shared_axis(kernel: Kernel) -> None:
  """UPCAST whole the first output axis of at most SHARED_AXIS_UPCAST along which the biggest input is broadcast."""
  loads = memory_loads(kernel)
  if not loads: return
  biggest = max(loads, key=lambda view: prod(size for size, stride in zip(view.shape, view.real_strides()) if stride))
  strides = biggest.real_strides()
  for axis in range(kernel.global_dims):
    size = kernel.full_shape[axis]
    if 1 < size <= SHARED_AXIS_UPCAST and strides[axis] == 0 and kernel.try_opt(Opt(OptOps.UPCAST, axis, size)): return


def _upcast_recomputed_rows(kernel: Kernel) -> None:
  """A grouped row reduction whose operand broadcast along its (one) output axis is computed on its loads at a cost
  of at least THIN_RECOMPUTE_COST ops per element (one token's SwiGLU silu(gate) * up, recomputed by every row of
  the down projection: each of its 576 blocks read the 3072 gate/up values and took 1536 exp2s): THIN_ROWS_PER_THREAD
  rows UPCAST in each thread, each recomputed value serving them all, where the blocks left still cover every
  multiprocessor. As ThinMatmulStrategy does for several tokens."""
  if kernel.global_dims != 1 or kernel.upcast_axes: return
  size, processors = kernel.full_shape[0], getattr(kernel.renderer, "multiprocessors", 0)
  if size % THIN_ROWS_PER_THREAD or size // THIN_ROWS_PER_THREAD < processors: return
  if _cost_broadcast_along(kernel, 0) >= THIN_RECOMPUTE_COST:
    kernel.try_opt(Opt(OptOps.UPCAST, 0, THIN_ROWS_PER_THREAD))


# a grouped row reduction's block takes LOCAL rows up to this many threads (a warp a row: a decode step's 12480 scores
# of 8 sequences ran as 32-thread blocks, 30 us on the H200), while every multiprocessor keeps 2 blocks
ROW_BLOCK_THREADS = 128


def _fill_row_blocks(kernel: Kernel) -> None:
  """LOCAL rows (innermost output axes first) into a grouped row reduction's blocks up to ROW_BLOCK_THREADS threads,
  leaving at least 2 blocks per multiprocessor."""
  blocks_wanted = 2 * getattr(kernel.renderer, "multiprocessors", 0)
  for axis in reversed(range(kernel.global_dims)):
    for amount in (8, 4, 2):
      blocks = prod(kernel.full_shape[:kernel.global_dims]) // amount
      if kernel.block_threads() * amount <= ROW_BLOCK_THREADS and kernel.full_shape[axis] % amount == 0 and \
          blocks >= blocks_wanted and kernel.try_opt(Opt(OptOps.LOCAL, axis, amount)): break
    if kernel.block_threads() * 2 > ROW_BLOCK_THREADS: return


def _short_reduce_few_outputs(kernel: Kernel) -> bool:
  """Whether the kernel's reduce is at least a warp's elements but shorter than SHORT_REDUCE and its outputs, a thread
  each, too few to fill the GPU (threads_in_flight_wanted; a decode step's attention scores: 4680 dot products of 64
  on 2-thread blocks, 37440 at 8 sequences): its threads split the reduce instead, and register tiles, which take
  outputs away from the threads, do not pay off."""
  outputs = prod(kernel.full_shape[:kernel.first_reduce])
  reduce_total = prod(kernel.full_shape[kernel.first_reduce:kernel.first_upcast])
  return WARP_SIZE <= reduce_total < SHORT_REDUCE and outputs < threads_in_flight_wanted(kernel)


def _group_for_parallelism(kernel: Kernel) -> None:
  """A matmul-like reduce with few threads (few outputs, long reduces: a convolution's weight gradient) splits its
  reduce over GROUP threads too, so the GPU has enough threads in flight."""
  threads = prod(kernel.full_shape[:kernel.first_reduce])
  reduce_total = prod(kernel.full_shape[kernel.first_loop_reduce:kernel.first_upcast])
  if threads >= ENOUGH_BLOCKS * BLOCK_THREADS // 2 or reduce_total < 64: return
  budget = min(kernel.renderer.max_threads // max(kernel.block_threads(), 1), BLOCK_THREADS, reduce_total // 16)
  if budget >= 2: _group_reduce_axes(kernel, budget)


# A CPU reduce with at least this many ALU ops per reduced element is compute-bound: its accumulators go in vector
# lanes even where some operands must be gathered (see _cpu_vector_lanes)
CPU_HEAVY_REDUCE_OPS = 10


def _cpu_vector_lanes(kernel: Kernel) -> bool:
  """A compute-heavy, not matmul-shaped CPU reduce (the MNIST step's batchnorm backward: ~30 ops per element through
  ReLU and max-pool masks) gets one SIMD register of outputs along one axis, so the renderer computes the whole
  element expression in vector lanes (renderer/cvector.py): lanes along the axis that the most loads broadcast
  (per-channel values stay scalars), the reduce unrolled by 2. Kept only where the renderer's VectorPlan takes every
  accumulator (checked on the linearized kernel); else the kernel is left as it was. One core, that kernel: 4.6 ms
  instead of 6.6 with 4x4 scalar accumulators."""
  vector_bytes = getattr(kernel.renderer, "vector_bytes", 0)
  if not vector_bytes or not hasattr(kernel.renderer, "vector_plan") or kernel.reduceop.dtype != dtypes.float32:
    return False
  if sum(node.op in UNARY_OPS | BINARY_OPS | TERNARY_OPS for node in kernel.ast.walk()) < CPU_HEAVY_REDUCE_OPS:
    return False
  lanes, loads = vector_bytes // 4, memory_loads(kernel)
  axes = [axis for axis in range(kernel.first_reduce) if kernel.full_shape[axis] % lanes == 0]
  axes.sort(key=lambda axis: -sum(st.real_strides()[axis] == 0 for st in loads))
  for axis in axes:
    start = kernel._state()
    if kernel.try_opt(Opt(OptOps.UPCAST, axis, lanes)):
      last_reduce = kernel.first_upcast - 1 - kernel.first_reduce
      if kernel.first_upcast > kernel.first_reduce and kernel.full_shape[kernel.first_upcast - 1] % 2 == 0:
        kernel.try_opt(Opt(OptOps.UNROLL, last_reduce, 2))
      if _vector_plan_takes_all(kernel): return True
    kernel._restore(start)
  return False


def _vector_plan_takes_all(kernel: Kernel) -> bool:
  """Whether the renderer writes every accumulator of the kernel as a lane of an explicit vector."""
  from ourgrad.codegen.linearizer import linearize  # the linearizer builds on Kernel, as this module does
  from ourgrad.codegen.uops import UOps
  uops = linearize(kernel)
  plan = kernel.renderer.vector_plan(uops)
  return bool(plan) and all(id(uop) in plan.lane_of for uop in uops if uop.op is UOps.DEFINE_ACC)


def _elementwise_rows(kernel: Kernel) -> None:
  """GPU elementwise: each thread takes 4 outputs, so it has 4 loads in flight: along the contiguous axis as one
  float4 load and store where the renderer has vector loads (a flat kernel too: GELU over a whole activation, its
  transcendentals included; one float a thread left the H200's DRAM at 42%), else along an outer axis (every
  scalar load instruction of a warp stays coalesced). A flat kernel only where its stores are vectors too (a dtype
  of the renderer's vector_dtypes): scalar stores 4 elements a lane apart write a quarter of each sector per
  instruction."""
  if kernel.first_reduce < 1: return
  if kernel.first_reduce == 1 and any(store.dtype not in kernel.renderer.vector_dtypes for store in kernel.stores):
    return
  contiguous = _contiguous_axis(kernel)
  if contiguous is None: contiguous = _pieces_axis(kernel)
  for width in _vector_widths(kernel):
    if contiguous is not None and contiguous < kernel.first_reduce and \
        kernel.full_shape[contiguous] % (width * VECTOR_ROW_LANES) == 0 and \
        kernel.try_opt(Opt(OptOps.UPCAST, contiguous, width)):
      return
  for axis in range(kernel.first_reduce):
    if axis != contiguous and kernel.full_shape[axis] % 4 == 0 and kernel.full_shape[axis] >= 16:
      kernel.try_opt(Opt(OptOps.UPCAST, axis, 4))
      return


def _vector_widths(kernel: Kernel) -> list[int]:
  """The vector widths an elementwise kernel's columns may take, widest first: the most elements any of its buffers
  moves in one vector access (8 where all are 16-bit floats: 16 bytes a lane), then the float32 width."""
  renderer = kernel.renderer
  if getattr(renderer, "vector_width", 0) < 2: return []
  # (the kernel's leaves begin with its stores)
  widest = max((renderer.vector_lanes(leaf.dtype) for leaf in kernel.leaves if isinstance(leaf.arg, MemBuffer)),
               default=0)
  return sorted({widest, renderer.vector_width} - {0}, reverse=True)


def _pieces_axis(kernel: Kernel) -> int | None:
  """The output axis the biggest input reads in contiguous pieces of a warp's lanes though with no one stride (GPT-2's
  heads merged back into rows: runs of 64 along the 768 channels), None if none (coalesce.load_lane_axis)."""
  loads = memory_loads(kernel)
  if not loads: return None
  biggest = max(loads, key=lambda view: prod(size for size, stride in zip(view.shape, view.real_strides()) if stride))
  return load_lane_axis(biggest, kernel.first_reduce, WARP_SIZE)


def _pick_thread_blocks(kernel: Kernel) -> None:
  """Give each block up to 128 threads from the innermost global axes (the ones whose neighbouring elements are
  adjacent in memory, so a block's loads coalesce)."""
  budget = 128
  for axis in reversed(range(kernel.global_dims)):
    for amount in (128, 64, 32, 16, 8, 4, 2):
      if kernel.local_threads() * amount <= budget and kernel.full_shape[axis] % amount == 0:
        if kernel.try_opt(Opt(OptOps.LOCAL, axis, amount)): break
    if kernel.local_threads() >= budget: break


def _cpu_simd_elementwise(kernel: Kernel) -> bool:
  """Whether the renderer vectorizes this elementwise kernel's innermost loop itself (CLANG's `omp simd` loop,
  renderer/cvector.elementwise_simd_loop): float buffers only, no flipped or masked (padded) view, whose index math
  has negative constants. Unrolled outputs would make that loop's loads strided."""
  if not getattr(kernel.renderer, "vector_loop_pragma", ""): return False
  if any(not leaf.dtype.is_float for leaf in kernel.leaves if isinstance(leaf.arg, MemBuffer)): return False
  # a constant's padded view (max-pool's window ranks) is index arithmetic, not a load: only buffers count
  buffer_sts = [leaf.arg.st for leaf in kernel.leaves if isinstance(leaf.arg, MemBuffer)]
  if any(view.mask is not None or not isinstance(view.offset, int) or view.offset < 0 for st in buffer_sts
         for view in st.views): return False
  return not any(stride is not None and stride < 0 for st in buffer_sts for stride in st.real_strides())


def _threads_fill_device(kernel: Kernel, upcast: int) -> bool:
  """Whether the kernel's output threads, `upcast` times fewer, still number threads_in_flight_wanted."""
  return prod(kernel.full_shape[:kernel.first_reduce]) // upcast >= threads_in_flight_wanted(kernel)


def _register_tiling(kernel: Kernel) -> None:
  """CPUs: unroll 4 neighbouring elementwise outputs; reduces: register tiles (UPCAST 4 of up to two output axes some
  input broadcasts), then the innermost reduce axis unrolled. On a GPU a reduce whose tiles do not pay off (an input
  read whole: bound by its bytes, _gpu_tiles_pay_off) takes a tile only where its threads still fill the device:
  GPT-2's position-embedding gradient ((512, 768) sums of 8, the per-token statistics broadcast along the 768) as 4x4
  tiles was 24,576 threads, 9% occupancy on the H200 (ncu, session 13: 28 us for 39 MB, 30% of the DRAM bandwidth)."""
  if kernel.reduceop is None:
    # elementwise: unroll 4 neighbouring outputs so the C compiler sees straight-line vectorizable code. Not on
    # GPUs: there neighbouring threads must touch neighbouring addresses for loads to coalesce; not where the C
    # compiler vectorizes the innermost loop itself.
    if kernel.renderer.has_threads or _cpu_simd_elementwise(kernel): return
    last = kernel.first_reduce - 1
    if last >= 0 and kernel.full_shape[last] % 4 == 0 and kernel.full_shape[last] >= 16:
      kernel.try_opt(Opt(OptOps.UPCAST, last, 4))
    return
  upcast_done: set[int] = set()
  threads_bound = kernel.renderer.has_threads and not _gpu_tiles_pay_off(kernel)
  for _ in range(2):
    for axis in reversed(range(kernel.first_reduce)):
      if axis in upcast_done: continue
      if threads_bound and not _threads_fill_device(kernel, 4): break
      broadcast_by_some_input = any(st.real_strides()[axis] == 0 for st in kernel.sts[1:])
      if broadcast_by_some_input and kernel.full_shape[axis] % 4 == 0 and kernel.full_shape[axis] >= 8:
        if kernel.try_opt(Opt(OptOps.UPCAST, axis, 4)):
          upcast_done.add(axis)
          break
  if kernel.first_upcast > kernel.first_reduce:
    last_reduce = kernel.first_upcast - 1 - kernel.first_reduce
    size = kernel.full_shape[kernel.first_upcast - 1]
    for amount in (4, 2):
      if size % amount == 0 and kernel.try_opt(Opt(OptOps.UNROLL, last_reduce, amount)): break


# the plain reduce's GROUP threads, and the generic loop-nest default every other strategy falls back to
GROUP_REDUCE = RecognizerStrategy("group_reduce", lambda kernel: gpu_local_reduce(kernel) and
                                  (not _gpu_tiles_pay_off(kernel) or _short_reduce_few_outputs(kernel)),
                                  lambda kernel: _group_reduce(kernel))
LOOP_TILES = RecognizerStrategy("loop_tiles", lambda kernel: True, _loop_tiles)


class SiblingReducesStrategy(Strategy):
  """A kernel of several sibling reduces (batchnorm's backward sums: one loop, an accumulator each) takes no matmul or
  window tiles: the plain reduce's strategies only, the first whose plan fits (GROUP_REDUCE, then LOOP_TILES)."""
  name = "sibling_reduces"

  def applies(self, kernel: Kernel) -> bool: return bool(kernel.sibling_reduces)

  def choose(self, kernel: Kernel) -> tuple[Plan, Kernel] | None:
    for strategy in (GROUP_REDUCE, LOOP_TILES):
      chosen = strategy.choose(kernel) if strategy.applies(kernel) else None
      if chosen is not None: return chosen
    return None


# The heuristic's strategies in the order tried (the first whose plan fits wins); BEAM's action space asks the same
# ones for the Opt kinds they own (search.py). A benchmark compares with a strategy switched off by
# plans.strategies_left_out.
STRATEGIES: list[Strategy] = [
  # several reduces (batchnorm's backward sums): no matmul tiles, GROUP threads on GPUs
  SiblingReducesStrategy(),
  TensorCoreConvStrategy(),
  WgmmaStrategy(),
  TensorCoreStrategy(),
  SharedTileStrategy(),
  ConvTileStrategy(),
  WeightGradientStrategy(),
  ThinMatmulStrategy(),
  ThreadWalkStrategy(window=True),
  GROUP_REDUCE,
  TransposeTileStrategy(),
  ThreadWalkStrategy(window=False),
  RecognizerStrategy("cpu_matmul", cpu_reduce, lambda kernel: cpu_matmul_tiles(kernel)),
  RecognizerStrategy("cpu_vector_lanes", cpu_reduce, lambda kernel: _cpu_vector_lanes(kernel)),
  LOOP_TILES,
]
