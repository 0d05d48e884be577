"""The float32 shared-memory matmul strategy of the GPU heuristic as a typed plan (codegen/opt/plans.py): a float32
matmul (plain, transposed, batched, or with an operand computed from loads: `dense_matmul_axes`) whose sizes divide a
block tile gets the tile's threads, float4 runs of outputs per thread, every operand staged through local memory
(OptOps.SHARED, its structure spelled out as a SharedStructure) and the reduce in steps, split over GROUP threads
where the grid has too few (`SharedTilePlan`). The tile is chosen by the grid model (codegen/opt/matmul_grid.py) or,
for small matmuls, as the largest whose grid gives every multiprocessor a block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.opt import matmul_grid
from ourgrad.codegen.opt.plans import Plan, Strategy, gpu_local_reduce, memory_loads, register_plan
from ourgrad.codegen.opts import Opt, OptOps
from ourgrad.codegen.shared_tiles import SHARED_TILE_PADDING, SharedStructure
from ourgrad.dtype import dtypes
from ourgrad.helpers import MATMUL_GRID, prod
from ourgrad.ops import Ops

register_plan(SharedStructure)
# the tiles' structure unless a tile says otherwise: each reduce element's row padded (SHARED_TILE_PADDING): the
# transposed fill of an operand contiguous along the reduce then stores into different banks (4096^3: 40.5 TFLOP/s,
# unpadded 38.7; 512^3 in 32x32 tiles: 0.021 ms, unpadded 0.029)
PADDED_ROWS = SharedStructure(padding=SHARED_TILE_PADDING)


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
  # the tiles' row padding and structure flags (shared_tiles.py SHARED_*: float4 tile stores, two blocks per
  # multiprocessor, cp.async stages, skewed rows)
  structure: SharedStructure = PADDED_ROWS
  # blocks per multiprocessor the grid must give for this tile to count as filling the device (_shared_tile_order)
  min_blocks_per_processor: int = 1

  @property
  def block(self) -> tuple[int, int]: return matmul_grid.tile_block(self.shape)

  @property
  def shape(self) -> tuple[int, int, int, int]:
    """(threads M, threads N, runs M, runs N): the tile's key in matmul_grid."""
    return (self.threads_m, self.threads_n, self.runs_m, self.runs_n)

  def plan(self, step: int, group: int = 1) -> SharedTilePlan:
    """This tile in reduce steps of `step`, the reduce split over `group` GROUP threads (1: none)."""
    return SharedTilePlan(self.threads_m, self.threads_n, self.runs_m, self.runs_n, step, group, self.structure)


@register_plan
@dataclass(frozen=True)
class SharedTilePlan(Plan):
  """A float32 SHARED block tile chosen for one matmul: threads along M and N, float4 runs of SHARED_OUTPUTS outputs
  per thread along each, the reduce step (UNROLL), GROUP threads over the reduce (1: none) and the tiles' structure
  (row padding, flags: SHARED's amount spelled out)."""
  threads_m: int
  threads_n: int
  runs_m: int
  runs_n: int
  step: int
  group: int = 1
  structure: SharedStructure = PADDED_ROWS

  def apply(self, kernel: Kernel) -> bool:
    axes = dense_matmul_axes(kernel)
    return axes is not None and _apply_shared_tile(kernel, axes[0], axes[1], self)


SHARED_OUTPUTS = matmul_grid.SHARED_OUTPUTS   # outputs of a float4 run
# the 128x128 tiles' structure (kernel.py SHARED_*): two blocks per multiprocessor (launch bounds), the transposed
# fill's rows skewed, float4 stores of B. H100 at 4096^3 (bench_matmul variants, two runs): 16x16 threads of 8x8
# 43.6 TFLOP/s (3.151-3.155 ms; 128 registers, 24% warps active, 85K bank conflicts; padded rows alone 40.4-40.7,
# 145 registers, 12.5% warps active, 17.7M conflicts), two blocks alone 43.2, skew alone 41.0, cp.async in 2-3
# stages 37.5-41.8, warps of 8x4 threads 43.1, A's tile k-innermost 40.7; 16x8 threads of 8x16 (4 float4 runs along
# N, 227 registers: 8 warps per SM) 45.7 (3.009 ms; steps of 8 45.3, one block per SM 38.3), 8x16 threads of 16x8
# 40.8, 128x256 of 16x16 threads of 8x16 37.6. The 8x16 tile is measured on 1024 blocks only: it takes grids of at
# least 4 blocks per multiprocessor, smaller ones the 8x8 tile (MiniLM's 2048x384 @ 384x1536, 192 blocks: 0.126 ms)
LARGE_TILE_STRUCTURE = SharedStructure(padding=SHARED_TILE_PADDING, vector_fill=True, two_blocks=True, row_skew=True)
# block tiles, largest first. 128x128 (8x8 outputs per thread) in steps of 16 measured 40.5 TFLOP/s on the H100 at
# 4096^3 with padded rows (unpadded 38.7-39.2, steps of 8 36.6), 64x64 (4x4) in steps of 8 28.5. The smaller ones
# (fewer threads, 4x4 outputs each) are for matmuls too small to give every multiprocessor a block of a larger tile
# (512x512: 16 blocks of 128x128, 0.061 ms; 32x32 tiles with GROUP 2: 0.020 ms). 64x64 in steps of 16 beat steps of 8
# on all seven MiniLM/SmolLM2 shapes of the H100 runs (2048x384x1536: 0.114 vs 0.144 ms; 512x576x960: 0.032 vs 0.046)
SHARED_TILES = (SharedTile(16, 8, 2, 4, (16, 8), LARGE_TILE_STRUCTURE, min_blocks_per_processor=4),
                SharedTile(16, 16, 2, 2, (16, 8), LARGE_TILE_STRUCTURE), SharedTile(16, 16, 1, 2, (16, 8)),
                SharedTile(16, 16, 2, 1, (16, 8)),
                SharedTile(16, 16, 1, 1, (16, 8)), SharedTile(8, 16, 1, 1, (16, 8)), SharedTile(16, 8, 1, 1, (16, 8)),
                SharedTile(8, 8, 1, 1, (16, 8)), SharedTile(4, 16, 1, 1, (16, 8)), SharedTile(16, 4, 1, 1, (16, 8)),
                SharedTile(4, 8, 1, 1, (16, 8)), SharedTile(8, 4, 1, 1, (16, 8)), SharedTile(4, 4, 1, 1, (16, 8)))


def dense_matmul_axes(kernel: Kernel) -> tuple[int, int] | None:
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
  for st in memory_loads(kernel):
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


class SharedTileStrategy(Strategy):
  """A float32 matmul (see dense_matmul_axes: plain, transposed, batched, or with an operand computed from loads)
  whose sizes divide a block tile of SHARED_TILES: the tile's threads per block along M and N, each SHARED_OUTPUTS x
  SHARED_OUTPUTS outputs per float4 run (runs `block / runs` apart along M and N), every operand staged through
  local memory (SHARED) in reduce steps of 16 or 8. The tile is the largest that still gives each multiprocessor a
  block (_shared_tile_order), each with its reduce split over threads where that helps (in a shorter step where it
  needs one), then not."""
  name = "shared_tiles"
  beam_ops = (OptOps.SHARED,)

  def applies(self, kernel: Kernel) -> bool: return gpu_local_reduce(kernel)

  def choose(self, kernel: Kernel) -> tuple[Plan, Kernel] | None:
    axes = dense_matmul_axes(kernel)
    if axes is None: return None
    m_axis, n_axis = axes
    m, n, k = kernel.full_shape[m_axis], kernel.full_shape[n_axis], kernel.full_shape[-1]
    order = _shared_tile_order(kernel, m, n, k)
    split = [(tile, tile.plan(step, _split_k_threads(kernel, tile, m, n, k, step))) for tile, step in order]
    attempts = [pair for pair in split if pair[1].group > 1] + [(tile, tile.plan(step)) for tile, step in order]
    tiles = [tile for tile, _ in order]
    attempts.sort(key=lambda pair: tiles.index(pair[0]))   # stable: tile by tile
    for _, plan in attempts:
      trial = kernel.copy()
      if _apply_shared_tile(trial, m_axis, n_axis, plan): return plan, trial
    return None

  def beam_actions(self, kernel: Kernel) -> Iterator[Opt]:
    """SHARED of every structure a tile of SHARED_TILES has (and none: plain rows), before TC (after it, the tensor
    core strategy lists SHARED's stages)."""
    if kernel.tensor_core is not None: return
    structures = [SharedStructure()] + [tile.structure for tile in SHARED_TILES]
    yield from (Opt(OptOps.SHARED, 0, 0, structure) for structure in dict.fromkeys(structures))


def apply_shared_tile(kernel: Kernel, tile: SharedTile, step: int, group: int = 1) -> bool:
  """One block tile with reduce steps of `step` and `group` GROUP threads on a float32 matmul not yet optimized (see
  dense_matmul_axes), as the heuristic applies its choice: for benchmarks and tests that compare tiles. False where
  it does not fit (the kernel may then hold some of its opts: pass a copy)."""
  return tile.plan(step, group).apply(kernel)


# a multiprocessor hides the latency of the staged matmul's loads with about this share of the threads it keeps
# resident (a quarter: 16 warps of sm_80/sm_90's 64)
LATENCY_HIDING_SHARE = 4
# GROUP threads a SHARED tile may split its reduce over (split-K inside the block), and the block's threads after it.
# H100, 512^3 in 32x32 tiles: GROUP 2 0.020-0.022 ms, GROUP 4 0.021-0.024, none 0.024-0.027; 512x784 weight gradient
# in 64x16 tiles: 0.027, 0.033, 0.030
SPLIT_K_THREADS = (2,)
SPLIT_K_MAX_BLOCK = 256


def _split_k_threads(kernel: Kernel, tile: SharedTile, m: int, n: int, k: int, step: int) -> int:
  """GROUP threads for the reduce of a SHARED tile whose grid has fewer threads than the device's multiprocessors
  can keep busy (512x512 in 32x32 tiles: 256 blocks of 64 threads on 132 SMs): the fewest of SPLIT_K_THREADS that
  reach 1 / LATENCY_HIDING_SHARE of the resident threads per multiprocessor, else the most that fit; each must leave
  whole reduce steps, at least two. 1: no split."""
  blocks = prod(kernel.full_shape[:kernel.first_reduce - 2]) * (m // tile.block[0]) * (n // tile.block[1])
  block_threads = tile.threads_m * tile.threads_n
  renderer = kernel.renderer
  wanted = getattr(renderer, "multiprocessors", 0) * getattr(renderer, "threads_per_multiprocessor", 0) // \
    LATENCY_HIDING_SHARE
  fitting = [group for group in SPLIT_K_THREADS if k % (group * step) == 0 and k // (group * step) >= 2 and
             block_threads * group <= SPLIT_K_MAX_BLOCK]
  if not fitting or blocks * block_threads >= wanted: return 1
  return next((group for group in fitting if blocks * block_threads * group >= wanted), fitting[-1])


def _apply_shared_tile(kernel: Kernel, m_axis: int, n_axis: int, tile: SharedTilePlan) -> bool:
  """The opts of one block tile, in the order the 128x128 tile was measured with: float4 upcasts along M then N,
  threads along M then N, the second runs along N then M, `group` GROUP threads over the reduce (neighbouring
  threads, neighbouring elements of each step), SHARED, the reduce step. The output opts name M's and N's axes as
  numbered before the first (Kernel.try_output_opts follows N's number as M's global part runs out)."""
  plan = [Opt(OptOps.UPCAST, m_axis, SHARED_OUTPUTS), Opt(OptOps.UPCAST, n_axis, SHARED_OUTPUTS),
          Opt(OptOps.LOCAL, m_axis, tile.threads_m), Opt(OptOps.LOCAL, n_axis, tile.threads_n)]
  plan += [Opt(OptOps.UPCAST, n_axis, tile.runs_n)] if tile.runs_n > 1 else []
  plan += [Opt(OptOps.UPCAST, m_axis, tile.runs_m)] if tile.runs_m > 1 else []
  if not kernel.try_output_opts(plan): return False
  if tile.group > 1 and not kernel.try_opt(Opt(OptOps.GROUP, 0, tile.group)): return False
  # SHARED before the unroll: with the tiles staged, an unrolled step holds only its operand values in registers
  return (kernel.try_opt(Opt(OptOps.SHARED, 0, 0, tile.structure)) and
          kernel.try_opt(Opt(OptOps.UNROLL, 0, tile.step)))

