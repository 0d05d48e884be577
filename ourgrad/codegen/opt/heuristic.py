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

from ourgrad.codegen.kernel import (SHARED_ROW_SKEW, SHARED_TILE_PADDING, SHARED_TWO_BLOCKS, SHARED_VECTOR_FILL,
                                    WGMMA_SPECIALIZED, Kernel, KernelOptError, Opt, OptOps,
                                    tensor_core_operands)
from ourgrad.dtype import dtypes
from ourgrad.codegen.opt.cpu_tiles import buffer_loads as _loads, cpu_matmul_tiles
from ourgrad.codegen.opt.conv_tiles import shared_conv_tiles, tensor_core_conv_tiles, weight_gradient_tiles
from ourgrad.codegen.opt import matmul_grid
from ourgrad.codegen.opt.window_tiles import elementwise_rows, window_tiles
from ourgrad.helpers import DEBUG, MATMUL_GRID, power_of_two_divisor, prod
from ourgrad.ops import BINARY_OPS, TERNARY_OPS, UNARY_OPS, MemBuffer, Ops

# threads per block the heuristics aim for on GPUs
BLOCK_THREADS = 256
# a GPU needs about this many blocks in flight to keep every multiprocessor busy (H100: 132 SMs x several blocks)
ENOUGH_BLOCKS = 1024
WARP_SIZE = 32
# reduces shorter than this stay loops inside one thread when there are enough outputs to fill the GPU
SHORT_REDUCE = 128


def hand_coded_optimizations(kernel: Kernel) -> None:
  """Apply the default Opts for the kernel's device in place."""
  renderer = kernel.renderer
  gpu, has_local = renderer.has_threads, getattr(renderer, "has_local", False)
  if kernel.sibling_reduces:   # several reduces (batchnorm's backward sums): no matmul tiles, GROUP threads on GPUs
    _sibling_reduces(kernel, gpu, has_local)
    return
  if gpu and has_local and kernel.reduceop is not None and tensor_core_conv_tiles(kernel): return
  if gpu and kernel.reduceop is not None and _tensor_core_tiles(kernel): return
  if gpu and has_local and kernel.reduceop is not None and _shared_matmul_tiles(kernel): return
  if gpu and has_local and kernel.reduceop is not None and shared_conv_tiles(kernel): return
  if gpu and has_local and kernel.reduceop is not None and weight_gradient_tiles(kernel): return
  if gpu and has_local and kernel.reduceop is not None and _thin_matmul(kernel): return
  if gpu and kernel.reduceop is not None and window_tiles(kernel): return
  if gpu and has_local and kernel.reduceop is not None and not _gpu_tiles_pay_off(kernel):
    if _group_reduce(kernel): return
  if gpu and kernel.reduceop is None and elementwise_rows(kernel): return
  if gpu and kernel.reduceop is None: _elementwise_rows(kernel)
  if not gpu and kernel.reduceop is not None and cpu_matmul_tiles(kernel): return
  if not gpu and kernel.reduceop is not None and _cpu_vector_lanes(kernel): return
  _register_tiling(kernel)
  if gpu: _pick_thread_blocks(kernel)
  if gpu and has_local and kernel.reduceop is not None: _group_for_parallelism(kernel)


def _sibling_reduces(kernel: Kernel, gpu: bool, has_local: bool) -> None:
  """The defaults of a plain reduce, for a kernel of several sibling reduces (one loop, an accumulator each)."""
  if gpu and has_local and not _gpu_tiles_pay_off(kernel) and _group_reduce(kernel): return
  _register_tiling(kernel)
  if gpu: _pick_thread_blocks(kernel)
  if gpu and has_local: _group_for_parallelism(kernel)


# a warp's tile of tensor-core instructions (m tiles x n tiles) and a block's warps (along m x along n)
TC_WARP_TILES = (2, 4)
TC_BLOCK_WARPS = (2, 2)


# OptOps.WGMMA (CUDA sm_90): (block N tile, the opt's axis: shared-memory stages, plus kernel.WGMMA_SPECIALIZED or
# WGMMA_DEEP for those variants) in the order tried, and the least work (M N K) that
# takes it (a smaller matmul keeps mma.sync). The wide tile first only where it gives every multiprocessor a block.
# (H100 run: the warp-specialized 128 x 256 kernel 527-541 TFLOP/s at 4096^3, the cooperative one 455-492)
WGMMA_TILES = ((256, WGMMA_SPECIALIZED + 4), (128, WGMMA_SPECIALIZED + 6))
WGMMA_MIN_WORK = 512 ** 3


def _wgmma_tiles(kernel: Kernel) -> bool:
  """WGMMA where the renderer has it and the kernel is a large enough plain float16/bfloat16 matmul whose sizes are
  multiples of a tile (codegen/wgmma_tiles.plan_for_kernel); ragged ones keep TC with PADTO."""
  if not getattr(kernel.renderer, "has_wgmma", False) or kernel.applied_opts: return False
  if prod(kernel.full_shape) < WGMMA_MIN_WORK: return False
  wide_blocks = prod(kernel.full_shape[:-1]) // (128 * WGMMA_TILES[0][0])
  # the wide tile where its blocks still fill every multiprocessor (the renderer's count: CUDA reads it from the GPU)
  tiles = WGMMA_TILES if wide_blocks >= kernel.renderer.multiprocessors else WGMMA_TILES[::-1]
  return any(kernel.try_opt(Opt(OptOps.WGMMA, stages, block_n)) for block_n, stages in tiles)


def _tensor_core_tiles(kernel: Kernel) -> bool:
  """WGMMA where it applies (sm_90). Else TC where the kernel is a float16/bfloat16 matmul and the renderer has tensor
  cores (ragged M/N padded first), then warp tiles and warps per block. False (the kernel untouched) where neither
  applies."""
  if _wgmma_tiles(kernel): return True
  for choice, tc in enumerate(getattr(kernel.renderer, "tensor_cores", ())):
    if not tc.allowed(): continue   # TF32 only where the user allows it (float32 matmul precision "high")
    if _staged_tensor_core_tiles(kernel, choice): return True
    if tc.is_tf32: continue   # the unstaged TF32 kernel was never faster than the float32 tiles (TF32_MIN_BLOCKS)
    trial = kernel.copy()
    if not _pad_for_tensor_core(trial, choice) or not trial.try_opt(Opt(OptOps.TC, 0, choice)): continue
    kernel.__dict__.update(trial.__dict__)
    break
  else:
    if DEBUG >= 3: _print_why_no_tensor_core(kernel)
    return False
  for position, amounts in ((1, (TC_WARP_TILES[1], 2)), (0, (TC_WARP_TILES[0],))):   # n first, then m
    for amount in amounts:
      axis = _tensor_core_outer_axis(kernel, position)
      if axis is not None and kernel.try_opt(Opt(OptOps.UPCAST, axis, amount)): break
  for position, warps in ((1, TC_BLOCK_WARPS[1]), (0, TC_BLOCK_WARPS[0])):
    axis = _tensor_core_outer_axis(kernel, position)
    if axis is not None: kernel.try_opt(Opt(OptOps.LOCAL, axis, warps))
  return True


def _print_why_no_tensor_core(kernel: Kernel) -> None:
  """DEBUG=3: why a matmul-shaped kernel (a SUM of a MUL) stays off the tensor cores, per instruction the renderer
  has (the TC opt's refusal, or that no staged block tile fits, or TF32 not allowed)."""
  product = kernel.reduceop.srcs[0]
  if product.op is Ops.CAST: product = product.srcs[0]
  if kernel.reduceop.op is not Ops.SUM or product.op is not Ops.MUL: return
  for choice, tc in enumerate(getattr(kernel.renderer, "tensor_cores", ())):
    try:
      kernel.copy().apply_opt(Opt(OptOps.TC, 0, choice))
      reason = "no staged block tile fits (or too few blocks for TF32)" if tc.is_tf32 else "no tile fits"
    except KernelOptError as error:
      reason = str(error)
    print(f"{kernel.name}: no tensor cores ({tc}): {reason}")


@dataclass(frozen=True)
class StagedTensorCoreTile:
  """A block tile of the staged tensor-core matmul (TC + SHARED): instruction tiles per warp along M and N (UPCAST)
  and warps per block along M and N (LOCAL)."""
  warp_m: int
  warp_n: int
  warps_m: int
  warps_n: int

  def block(self, dims: tuple[int, int, int]) -> tuple[int, int]:
    """(M, N) elements of the block tile for an instruction of `dims` (m, n, k)."""
    return self.warp_m * self.warps_m * dims[0], self.warp_n * self.warps_n * dims[1]


# the staged tiles, largest first: 64x64 warp tiles in 2x2 warps (a 128x128 block tile with m16n8), then smaller
# blocks for matmuls whose grid of large ones leaves multiprocessors idle (a 768x768 weight gradient: 36 blocks of
# 128x128, 144 of 64x64) or whose M or N is 64 (an attention head)
TC_STAGED_TILES = (StagedTensorCoreTile(4, 8, 2, 2), StagedTensorCoreTile(4, 4, 2, 2),
                   StagedTensorCoreTile(2, 8, 2, 2), StagedTensorCoreTile(2, 4, 2, 2))
# K instructions per reduce step, largest first: 4 (64 elements, 72 KB of tiles in dynamic shared memory) measured
# 283 TFLOP/s on the H100 at 4096^3 float16, 2 (32, 38 KB) 276, 1 (16) 215
TC_STAGED_K_STEPS = (4, 2)
# TF32 (mma.sync m16n8k8) only pays in the staged kernel with enough blocks to fill the device. H100 run
# (bench_matmul --tf32, against the float32 shared tiles): grids of 16-28 blocks 1.2-2.3x slower, 20-32 blocks about
# 10% faster, 120-1024 blocks 1.5-3.3x faster; the unstaged kernel never won (4096^3: 38.9 TFLOP/s; a conv weight
# gradient 36 us instead of 22.5)
TF32_MIN_BLOCKS = 64


def _staged_tensor_core_tiles(kernel: Kernel, choice: int) -> bool:
  """TC with the block tile staged through local memory (see apply_staged_tensor_core): the largest tile of
  TC_STAGED_TILES whose grid gives every multiprocessor (the renderer's count) a block, else the one with the most
  blocks; tiles that need no padding of M or N before those that do. TF32 only with TF32_MIN_BLOCKS blocks at least.
  False (the kernel untouched) where none fits."""
  tc = kernel.renderer.tensor_cores[choice]
  processors = getattr(kernel.renderer, "multiprocessors", 0)
  for pad in (False, True):
    fitting = []
    for tile in TC_STAGED_TILES:
      trial = kernel.copy()
      if apply_staged_tensor_core(trial, choice, tile, pad): fitting.append(trial)
    if not fitting: continue
    blocks = [prod(trial.full_shape[:trial.global_dims]) for trial in fitting]
    best = next((number for number, count in enumerate(blocks) if count >= processors), None)
    if best is None: best = max(range(len(fitting)), key=lambda number: blocks[number])
    if tc.is_tf32 and blocks[best] < TF32_MIN_BLOCKS: return False
    kernel.__dict__.update(fitting[best].__dict__)
    return True
  return False


def apply_staged_tensor_core(kernel: Kernel, choice: int, tile: StagedTensorCoreTile, pad: bool = True) -> bool:
  """TC (instruction `choice`) with `tile`'s warp and block tiles, staged through local memory (SHARED: cp.async
  copies or computed stores, ldmatrix fragments), in reduce steps of 4 or 2 instructions where K allows; with `pad`,
  ragged M and N padded to the block tile. Any operand layout the TC opt takes (transposed, batched, several views,
  computed from loads). False where it does not fit (the kernel may then hold some opts: pass a copy)."""
  tc = kernel.renderer.tensor_cores[choice]
  block = tile.block(tc.dims)
  if pad and not _pad_for_tensor_core(kernel, choice, block): return False
  if not kernel.try_opt(Opt(OptOps.TC, 0, choice)): return False
  for op, position, amount in ((OptOps.UPCAST, 1, tile.warp_n), (OptOps.UPCAST, 0, tile.warp_m),
                               (OptOps.LOCAL, 1, tile.warps_n), (OptOps.LOCAL, 0, tile.warps_m)):
    if amount == 1: continue
    axis = _tensor_core_outer_axis(kernel, position)
    if axis is None or not kernel.try_opt(Opt(op, axis, amount)): return False
  for steps in TC_STAGED_K_STEPS:
    with_unroll = kernel.copy()
    if with_unroll.try_opt(Opt(OptOps.UNROLL, 0, steps)) and with_unroll.try_opt(Opt(OptOps.SHARED, 0, 0)):
      kernel.__dict__.update(with_unroll.__dict__)
      return True
  return kernel.try_opt(Opt(OptOps.SHARED, 0, 0))


@dataclass(frozen=True)
class SharedTile:
  """A float32 shared-memory matmul block tile: threads along M and along N, outputs per thread along each as `runs`
  float4 runs (SHARED_OUTPUTS each) strided by the block's threads (neighbouring threads read neighbouring float4s
  of the tiles), and the reduce steps it takes, preferred first."""
  threads_m: int
  threads_n: int
  runs_m: int
  runs_n: int
  steps: tuple[int, ...]
  # SHARED's flags beside the row padding (kernel.py SHARED_*: float4 tile stores, two blocks per multiprocessor,
  # cp.async stages, skewed rows)
  flags: int = 0
  # blocks per multiprocessor the grid must give for this tile to count as filling the device (_shared_tile_order)
  min_blocks_per_processor: int = 1

  @property
  def block(self) -> tuple[int, int]: return matmul_grid.tile_block(self.shape)

  @property
  def shape(self) -> tuple[int, int, int, int]:
    """(threads M, threads N, runs M, runs N): the tile's key in matmul_grid."""
    return (self.threads_m, self.threads_n, self.runs_m, self.runs_n)


SHARED_OUTPUTS = matmul_grid.SHARED_OUTPUTS   # outputs of a float4 run
# the 128x128 tiles' structure (kernel.py SHARED_*): two blocks per multiprocessor (launch bounds), the transposed
# fill's rows skewed, float4 stores of B. H100 at 4096^3 (bench_matmul variants, two runs): 16x16 threads of 8x8
# 43.6 TFLOP/s (3.151-3.155 ms; 128 registers, 24% warps active, 85K bank conflicts; padded rows alone 40.4-40.7,
# 145 registers, 12.5% warps active, 17.7M conflicts), two blocks alone 43.2, skew alone 41.0, cp.async in 2-3
# stages 37.5-41.8, warps of 8x4 threads 43.1, A's tile k-innermost 40.7; 16x8 threads of 8x16 (4 float4 runs along
# N, 227 registers: 8 warps per SM) 45.7 (3.009 ms; steps of 8 45.3, one block per SM 38.3), 8x16 threads of 16x8
# 40.8, 128x256 of 16x16 threads of 8x16 37.6. The 8x16 tile is measured on 1024 blocks only: it takes grids of at
# least 4 blocks per multiprocessor, smaller ones the 8x8 tile (MiniLM's 2048x384 @ 384x1536, 192 blocks: 0.126 ms)
LARGE_TILE_FLAGS = SHARED_ROW_SKEW + SHARED_TWO_BLOCKS + SHARED_VECTOR_FILL
# block tiles, largest first. 128x128 (8x8 outputs per thread) in steps of 16 measured 40.5 TFLOP/s on the H100 at
# 4096^3 with padded rows (unpadded 38.7-39.2, steps of 8 36.6), 64x64 (4x4) in steps of 8 28.5. The smaller ones
# (fewer threads, 4x4 outputs each) are for matmuls too small to give every multiprocessor a block of a larger tile
# (512x512: 16 blocks of 128x128, 0.061 ms; 32x32 tiles with GROUP 2: 0.020 ms). 64x64 in steps of 16 beat steps of 8
# on all seven MiniLM/SmolLM2 shapes of the H100 runs (2048x384x1536: 0.114 vs 0.144 ms; 512x576x960: 0.032 vs 0.046)
SHARED_TILES = (SharedTile(16, 8, 2, 4, (16, 8), LARGE_TILE_FLAGS, min_blocks_per_processor=4),
                SharedTile(16, 16, 2, 2, (16, 8), LARGE_TILE_FLAGS), SharedTile(16, 16, 1, 2, (16, 8)),
                SharedTile(16, 16, 2, 1, (16, 8)),
                SharedTile(16, 16, 1, 1, (16, 8)), SharedTile(8, 16, 1, 1, (16, 8)), SharedTile(16, 8, 1, 1, (16, 8)),
                SharedTile(8, 8, 1, 1, (16, 8)), SharedTile(4, 16, 1, 1, (16, 8)), SharedTile(16, 4, 1, 1, (16, 8)),
                SharedTile(4, 8, 1, 1, (16, 8)), SharedTile(8, 4, 1, 1, (16, 8)), SharedTile(4, 4, 1, 1, (16, 8)))


def _dense_matmul_axes(kernel: Kernel) -> tuple[int, int] | None:
  """(M axis, N axis) of a float32 matmul-shaped reduce not yet optimized: a SUM over one reduce axis (the last),
  the last two output axes M and N (batch axes before them), and every load that varies along the reduce varying
  along exactly one of M and N (an operand, possibly computed from loads: a fused ReLU or bias of the forward, or a
  transposed view), at least one along each. None where the kernel is not one."""
  reduce = kernel.reduceop
  if reduce is None or reduce.op is not Ops.SUM or reduce.dtype != dtypes.float32 or len(kernel.reduceops) != 1:
    return None
  if kernel.applied_opts or kernel.first_reduce < 2 or kernel.shape_len != kernel.first_reduce + 1: return None
  m_axis, n_axis, k_axis = kernel.first_reduce - 2, kernel.first_reduce - 1, kernel.first_reduce
  sides = set()
  for st in _loads(kernel):
    strides = st.real_strides()
    if strides[k_axis] == 0: continue
    varies = tuple(strides[axis] != 0 for axis in (m_axis, n_axis))   # None (not a plain stride) varies
    if varies == (True, True): return None   # neither operand: read by every thread of the block
    # (False, False): a vector along the reduce, per batch or not (the Q/K/V bias fused into the attention matmuls),
    # read by the whole block from global memory (Kernel.staged_loads)
    sides.add(varies)
  return (m_axis, n_axis) if {(True, False), (False, True)} <= sides else None


def _shared_tile_order(kernel: Kernel, m: int, n: int, k: int) -> list[tuple[SharedTile, int]]:
  """(tile, reduce step) pairs that divide the matmul (and leave a reduce loop: an unroll that takes the whole reduce
  axis leaves the kernel no loop to stage in), best first. With MATMUL_GRID (the default) and at least GRID_MIN_MACS
  multiply-adds: by the time matmul_grid.matmul_seconds predicts on the renderer's multiprocessors (rounds of blocks
  x a block's work at its tile's rate; the tiles of GRID_EXTRA_TILES too; the larger tile first where they tie).
  Else the largest block tile whose grid gives every multiprocessor a block, then the rest by grid size, most blocks
  first (when none fills the device, more blocks use more of it). Unknown multiprocessors (`renderer.multiprocessors`
  0): the largest tile first."""
  batch = prod(kernel.full_shape[:kernel.first_reduce - 2])
  fitting = [(tile, step) for tile in SHARED_TILES for step in tile.steps
             if m % tile.block[0] == 0 and n % tile.block[1] == 0 and k % step == 0 and k > step]
  processors = getattr(kernel.renderer, "multiprocessors", 0)
  blocks = lambda pair: batch * (m // pair[0].block[0]) * (n // pair[0].block[1])   # noqa: E731
  # a tile measured only on large grids (min_blocks_per_processor: the 8x16-per-thread 128x128) comes first where its
  # grid gives every multiprocessor that many blocks, and is left out elsewhere (the grid model has no rate for it)
  large = [pair for pair in fitting if pair[0].min_blocks_per_processor > 1]
  first = [pair for pair in large if blocks(pair) >= processors * pair[0].min_blocks_per_processor]
  fitting = [pair for pair in fitting if pair[0].min_blocks_per_processor <= 1]
  if MATMUL_GRID.value and processors > 0 and batch * m * n * k >= matmul_grid.GRID_MIN_MACS:
    extra = [SharedTile(*shape, (16, 8)) for shape in matmul_grid.GRID_EXTRA_TILES]
    fitting += [(tile, step) for tile in extra for step in tile.steps
                if m % tile.block[0] == 0 and n % tile.block[1] == 0 and k % step == 0 and k > step]
    return first + sorted(fitting, key=lambda pair: matmul_grid.matmul_seconds(pair[0].shape, batch, m, n, k,
                                                                                processors))
  filling = [pair for pair in fitting if blocks(pair) >= processors]
  rest = sorted((pair for pair in fitting if pair not in filling), key=lambda pair: -blocks(pair))
  return first + filling + rest


def _shared_matmul_tiles(kernel: Kernel) -> bool:
  """A float32 matmul (see _dense_matmul_axes: plain, transposed, batched, or with an operand computed from loads)
  whose sizes divide a block tile of SHARED_TILES: the tile's threads per block along M and N, each SHARED_OUTPUTS x
  SHARED_OUTPUTS outputs per float4 run (runs `block / runs` apart along M and N), every operand staged through
  local memory (SHARED) in reduce steps of 16 or 8. The tile is the largest that still gives each multiprocessor a
  block (_shared_tile_order). False (the kernel untouched) where none fits."""
  axes = _dense_matmul_axes(kernel)
  if axes is None: return False
  m_axis, n_axis = axes
  m, n, k = kernel.full_shape[m_axis], kernel.full_shape[n_axis], kernel.full_shape[-1]
  order = _shared_tile_order(kernel, m, n, k)
  # each tile with its reduce split over threads where that helps (in a shorter step where it needs one), then not
  attempts = [(tile, step, _split_k_threads(kernel, tile, m, n, k, step)) for tile, step in order]
  attempts = [attempt for attempt in attempts if attempt[2] > 1] + [(tile, step, 1) for tile, step in order]
  attempts.sort(key=lambda attempt: [pair[0] for pair in order].index(attempt[0]))   # stable: tile by tile
  for tile, step, group in attempts:
    trial = kernel.copy()
    if _apply_shared_tile(trial, m_axis, n_axis, tile, step, group):
      kernel.__dict__.update(trial.__dict__)
      return True
  return False


def apply_shared_tile(kernel: Kernel, tile: SharedTile, step: int, group: int = 1) -> bool:
  """One block tile with reduce steps of `step` and `group` GROUP threads on a float32 matmul not yet optimized (see
  _dense_matmul_axes), as the heuristic applies its choice: for benchmarks and tests that compare tiles. False where
  it does not fit (the kernel may then hold some of its opts: pass a copy)."""
  axes = _dense_matmul_axes(kernel)
  return axes is not None and _apply_shared_tile(kernel, axes[0], axes[1], tile, step, group)


# a multiprocessor hides the latency of the staged matmul's loads with about this many threads (16 warps)
THREADS_PER_MULTIPROCESSOR = 512
# GROUP threads a SHARED tile may split its reduce over (split-K inside the block), and the block's threads after it.
# H100, 512^3 in 32x32 tiles: GROUP 2 0.020-0.022 ms, GROUP 4 0.021-0.024, none 0.024-0.027; 512x784 weight gradient
# in 64x16 tiles: 0.027, 0.033, 0.030
SPLIT_K_THREADS = (2,)
SPLIT_K_MAX_BLOCK = 256


def _split_k_threads(kernel: Kernel, tile: SharedTile, m: int, n: int, k: int, step: int) -> int:
  """GROUP threads for the reduce of a SHARED tile whose grid has fewer threads than the device's multiprocessors
  can keep busy (512x512 in 32x32 tiles: 256 blocks of 64 threads on 132 SMs): the fewest of SPLIT_K_THREADS that
  reach THREADS_PER_MULTIPROCESSOR per multiprocessor, else the most that fit; each must leave whole reduce steps,
  at least two. 1: no split."""
  blocks = prod(kernel.full_shape[:kernel.first_reduce - 2]) * (m // tile.block[0]) * (n // tile.block[1])
  block_threads = tile.threads_m * tile.threads_n
  wanted = getattr(kernel.renderer, "multiprocessors", 0) * THREADS_PER_MULTIPROCESSOR
  fitting = [group for group in SPLIT_K_THREADS if k % (group * step) == 0 and k // (group * step) >= 2 and
             block_threads * group <= SPLIT_K_MAX_BLOCK]
  if not fitting or blocks * block_threads >= wanted: return 1
  return next((group for group in fitting if blocks * block_threads * group >= wanted), fitting[-1])


def _apply_shared_tile(kernel: Kernel, m_axis: int, n_axis: int, tile: SharedTile, step: int, group: int = 1) -> bool:
  """The opts of one block tile, in the order the 128x128 tile was measured with: float4 upcasts along M then N,
  threads along M then N, the second runs along N then M, `group` GROUP threads over the reduce (neighbouring
  threads, neighbouring elements of each step), SHARED, the reduce step. The output opts name M's and N's axes as
  numbered before the first (Kernel.try_output_opts follows N's number as M's global part runs out)."""
  plan = [Opt(OptOps.UPCAST, m_axis, SHARED_OUTPUTS), Opt(OptOps.UPCAST, n_axis, SHARED_OUTPUTS),
          Opt(OptOps.LOCAL, m_axis, tile.threads_m), Opt(OptOps.LOCAL, n_axis, tile.threads_n)]
  plan += [Opt(OptOps.UPCAST, n_axis, tile.runs_n)] if tile.runs_n > 1 else []
  plan += [Opt(OptOps.UPCAST, m_axis, tile.runs_m)] if tile.runs_m > 1 else []
  if not kernel.try_output_opts(plan): return False
  if group > 1 and not kernel.try_opt(Opt(OptOps.GROUP, 0, group)): return False
  # SHARED before the unroll: with the tiles staged, an unrolled step holds only its operand values in registers
  # the tiles' rows padded (SHARED_TILE_PADDING): the transposed fill of an operand contiguous along the reduce then
  # stores into different banks (4096^3: 40.5 TFLOP/s, unpadded 38.7; 512^3 in 32x32 tiles: 0.021 ms, unpadded 0.029)
  return (kernel.try_opt(Opt(OptOps.SHARED, 0, SHARED_TILE_PADDING + tile.flags)) and
          kernel.try_opt(Opt(OptOps.UNROLL, 0, step)))


# an output axis this short (a classifier's 10 classes) makes a matmul thin: too few outputs for output tiles to fill
# the GPU, so threads split the reduce instead
THIN_SIDE = 16
THIN_BLOCKS_PER_MULTIPROCESSOR = 4


def _thin_matmul(kernel: Kernel) -> bool:
  """A float32 matmul (see _dense_matmul_axes) with an output axis of at most THIN_SIDE and a long reduce (a
  classifier's forward, 512x10, and its weight gradient, 10x512, each with K = the batch): enough blocks for every
  multiprocessor, the reduce split over the block's threads. Where the wide operand is contiguous along the reduce
  (rows), a warp of GROUP threads reads each row together and each thread computes every output of the short axis
  (UPCAST: one load of the row reused); where it is contiguous along the wide output axis (columns), 32 neighbouring
  outputs on LOCAL threads (coalesced) and GROUPTOP over the reduce, the short axis left to the grid. False (the
  kernel untouched) where the matmul is not thin."""
  axes = _dense_matmul_axes(kernel)
  if axes is None: return False
  sizes, k_axis = kernel.full_shape, kernel.first_reduce
  narrow, wide = sorted(axes, key=lambda axis: sizes[axis])
  if sizes[narrow] > THIN_SIDE or sizes[k_axis] < 4 * WARP_SIZE: return False
  wide_loads = [st for st in _loads(kernel) if st.real_strides()[wide] != 0 and st.real_strides()[k_axis] != 0]
  rows = all(st.real_strides()[k_axis] == 1 for st in wide_loads)
  processors = getattr(kernel.renderer, "multiprocessors", 0)
  batch = prod(sizes[:min(axes)])
  trial = kernel.copy()
  if rows:
    group = power_of_two_divisor(sizes[k_axis], WARP_SIZE)
    local = power_of_two_divisor(sizes[wide], BLOCK_THREADS // 2 // group)
    # a warp per row while that leaves 4 blocks per multiprocessor (H100, 512x10 outputs: a row per block 0.010 ms,
    # 2 rows 0.013)
    while local > 1 and batch * sizes[wide] // local < THIN_BLOCKS_PER_MULTIPROCESSOR * processors: local //= 2
    outputs, reduce = [Opt(OptOps.LOCAL, wide, local), Opt(OptOps.UPCAST, narrow, sizes[narrow])], OptOps.GROUP
  else:
    local = power_of_two_divisor(sizes[wide], WARP_SIZE)
    group = power_of_two_divisor(sizes[k_axis] // 2, BLOCK_THREADS // local)
    outputs, reduce = [Opt(OptOps.LOCAL, wide, local)], OptOps.GROUPTOP
  # an amount of 1 is no opt; the reduce split comes after the output axes' opts
  if not trial.try_output_opts([opt for opt in outputs if opt.amount > 1]): return False
  if group > 1 and not trial.try_opt(Opt(reduce, 0, group)): return False
  loop = kernel.full_shape[k_axis] // group
  if loop % 4 == 0 and loop > 4: trial.try_opt(Opt(OptOps.UNROLL, 0, 4))
  kernel.__dict__.update(trial.__dict__)
  return True


def _pad_for_tensor_core(kernel: Kernel, choice: int, tiles: tuple[int, int] | None = None) -> bool:
  """PADTO the matmul's M and N axes up to the instruction's tile (or `tiles`) where they are ragged; False where
  the kernel is not a matmul the instruction computes (or K is ragged: a reduce axis is not padded)."""
  tc = kernel.renderer.tensor_cores[choice]
  try: a, b = tensor_core_operands(kernel.reduceop, tc)
  except KernelOptError: return False
  m_axes, n_axes, _ = kernel.matmul_axes(a, b)
  tiles = tiles or (tc.dims[0], tc.dims[1])
  for axes, instruction_tile, tile in ((m_axes, tc.dims[0], tiles[0]), (n_axes, tc.dims[1], tiles[1])):
    axis = kernel.tile_axis(axes, instruction_tile) if axes else None
    if axis is not None and kernel.full_shape[axis] % tile != 0 and not kernel.try_opt(Opt(OptOps.PADTO, axis, tile)):
      return False
  return True


def _tensor_core_outer_axis(kernel: Kernel, position: int) -> int | None:
  """After TC: the global axis left of the matmul's M (position 0) or N (position 1) outside the instruction."""
  applied = kernel.tensor_core
  axes = kernel.matmul_axes(applied.a, applied.b)[position]
  axes = [axis for axis in axes if axis < kernel.global_dims]
  return axes[-1] if axes else None


# an operand reused across fewer outputs than this is no reason for register tiles (a thread's tile: 4x4 outputs)
MIN_TILE_REUSE = 16


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
  if any(all(strides[axis] != 0 for axis in sized) for strides in input_strides): return False
  for strides in input_strides:
    if prod(shape[axis] for axis in outputs if strides[axis] == 0) < MIN_TILE_REUSE: continue
    if not any(strides[axis] != 0 for axis in reduces): continue
    if not gathers or any(strides[axis] != 0 for axis in outputs): return True
  return False


def _gpu_tiles_pay_off(kernel: Kernel) -> bool:
  """register_tiles_pay_off for this kernel's loads (a GPU's choice; CPUs ask cpu_tiles.matmul_like)."""
  loads = [(st, leaf) for st, leaf in zip(kernel.sts[1:], kernel.leaves[1:]) if isinstance(leaf.arg, MemBuffer)]
  return register_tiles_pay_off(kernel.full_shape, range(kernel.first_reduce, kernel.shape_len),
                                [st.real_strides() for st, _ in loads], gathers=any(leaf.srcs for _, leaf in loads))


def _contiguous_axis(kernel: Kernel) -> int | None:
  """The dimension along which the biggest input is contiguous (stride 1), if any."""
  loads = _loads(kernel)
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


def _group_reduce(kernel: Kernel) -> bool:
  """GROUP-based defaults for reduces that are not matmul-like. False (kernel untouched) where they do not apply."""
  if kernel.first_upcast <= kernel.first_reduce: return False
  contiguous = _contiguous_axis(kernel)
  outputs = prod(kernel.full_shape[:kernel.first_reduce])
  reduce_total = prod(kernel.full_shape[kernel.first_reduce:kernel.first_upcast])
  # a short reduce (a pooling window) is cheaper as a loop in each thread than as threads that must meet
  if reduce_total < SHORT_REDUCE and outputs >= ENOUGH_BLOCKS: return False
  if contiguous is None or contiguous >= kernel.first_reduce:
    # row reduction (or no stride-1 input): the block's threads stride over the row together (coalesced); a warp
    # for short rows
    budget = BLOCK_THREADS if reduce_total >= 4 * BLOCK_THREADS else WARP_SIZE
    reduce_axes = kernel.first_upcast - kernel.first_loop_reduce
    _group_reduce_axes(kernel, budget, GROUP_MAX_AXES, GROUP_POWERS_OF_TWO)
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
  lanes, loads = vector_bytes // 4, _loads(kernel)
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
  """GPU elementwise over several axes: each thread takes 4 outputs, so it has 4 loads in flight: along the
  contiguous axis as one float4 load and store where the renderer has vector loads, else along an outer axis (every
  scalar load instruction of a warp stays coalesced)."""
  if kernel.first_reduce < 2: return
  contiguous = _contiguous_axis(kernel)
  width = getattr(kernel.renderer, "vector_width", 0)
  if width and contiguous is not None and contiguous < kernel.first_reduce and \
      kernel.full_shape[contiguous] % (width * 32) == 0 and kernel.try_opt(Opt(OptOps.UPCAST, contiguous, width)):
    return
  for axis in range(kernel.first_reduce):
    if axis != contiguous and kernel.full_shape[axis] % 4 == 0 and kernel.full_shape[axis] >= 16:
      kernel.try_opt(Opt(OptOps.UPCAST, axis, 4))
      return


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


def _register_tiling(kernel: Kernel) -> None:
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
  for _ in range(2):
    for axis in reversed(range(kernel.first_reduce)):
      if axis in upcast_done: continue
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
