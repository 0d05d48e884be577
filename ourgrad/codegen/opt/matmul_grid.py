"""The grid of a float32 matmul on a GPU: which shared-memory block tile and into how many parts its reduce is split
across blocks (split-K), from one cost model of the busiest multiprocessor's time.

A block tile is (threads along M, threads along N, float4 runs along M, along N): each thread computes 4 x runs_m by
4 x runs_n outputs, the block threads_m * 4 * runs_m by threads_n * 4 * runs_n (heuristic.SharedTile). A grid of B
blocks on P multiprocessors runs in ceil(B / P) rounds: on the H100 one 128x128 block keeps a multiprocessor as busy
as several do (2048x384x1536 in 48 blocks: 0.30 TFLOP/s per block; 4096^3 in 1024 blocks: 0.31 per multiprocessor),
so a round costs one block's multiply-adds at its tile's rate, however many blocks share the multiprocessor. Smaller
tiles reuse each staged value less (4x4 outputs per thread, not 8x8) and run slower (TILE_RATES, relative to
128x128's), but give more blocks; tiles of 3 runs along N (8x12 outputs a thread) fit grids like 2048x1152 into one
round of 128 blocks (128x144) where 128x128 takes two (144 blocks). Split-K (split_reduce.py's gpu_split_parts)
multiplies the blocks by the parts and divides each block's reduce; the partial results cost a write and a read
(SPLIT_SECONDS, SPLIT_BYTES_PER_SECOND: the consumer adds them, no kernel of their own).

`matmul_seconds` is the model; `split_k_parts` the parts the lazy layer splits a matmul's reduce into;
heuristic.SHARED_TILES and GRID_EXTRA_TILES the tiles heuristic._shared_tile_order ranks by it.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ourgrad.codegen.wgmma_copies import ATOM_BYTES, ROW_BYTES

# multiply-adds per second of one H100 multiprocessor running 128x128 tiles (40.5 TFLOP/s at 4096^3 on 132)
MULTIPROCESSOR_MACS = 40.5e12 / 2 / 132
SHARED_OUTPUTS = 4   # outputs of a float4 run
# (threads M, threads N, runs M, runs N) -> the tile's rate relative to 128x128's at 4096^3, with 8 warps or more
# resident on the multiprocessor. Fitted to the H100 run of bench_matmul.py --only minilm (midmm run 1: every tile on
# 2048x384x1536, 2048x1536x384, 2048x384x1152): 8x8 and 8x12 outputs a thread 0.9-0.97, 128x64 with 8x8 a thread
# (128 threads) 0.87-0.88, 64x128 4x8 0.78-0.80, 128x64 8x4 0.73-0.76, 64x64 4x4 0.65-0.72, 4x4 with 128 threads
# 0.60-0.62, 32x32 with GROUP 2 0.50; the smallest tiles below those
TILE_RATES = {
  (16, 16, 2, 2): 0.95, (16, 16, 1, 2): 0.78, (16, 16, 2, 1): 0.74, (16, 16, 1, 1): 0.68,
  (8, 16, 1, 1): 0.6, (16, 8, 1, 1): 0.6, (8, 8, 1, 1): 0.5, (4, 16, 1, 1): 0.4, (16, 4, 1, 1): 0.4,
  (4, 8, 1, 1): 0.35, (8, 4, 1, 1): 0.35, (4, 4, 1, 1): 0.3,
  # 8x8 outputs a thread with 128 threads (128x64, 64x128); 8x12 (3 runs along N: 128x192, 128x144, 128x96, 64x144);
  # 4x12 (32x192, 64x96)
  (16, 8, 2, 2): 0.88, (8, 16, 2, 2): 0.88,
  (16, 16, 2, 3): 0.95, (16, 12, 2, 3): 0.95, (16, 8, 2, 3): 0.83, (8, 12, 2, 3): 0.95, (8, 16, 1, 3): 0.55,
  (16, 8, 1, 3): 0.55,
}
# the tiles ranked with heuristic.SHARED_TILES by the model (MATMUL_GRID=1)
GRID_EXTRA_TILES = ((16, 8, 2, 2), (8, 16, 2, 2), (16, 16, 2, 3), (16, 12, 2, 3), (16, 8, 2, 3), (8, 12, 2, 3),
                    (8, 16, 1, 3), (16, 8, 1, 3))
# a multiprocessor with fewer threads resident (its blocks x their threads) runs at this share of the tile's rate
# (H100: a 128x144 block of 192 threads alone 0.62 of 128x128's rate, 128x64 of 128 threads alone 0.59)
FULL_THREADS = 256
FEW_THREADS_SHARE = 0.65
# a split reduce's cost beyond its blocks: the partial results written then read (they stay in L2) and a fixed part
SPLIT_SECONDS = 2e-6
SPLIT_BYTES_PER_SECOND = 3e12
# matmuls of fewer multiply-adds keep the rule measured on an MLP step's 512-sized matmuls (the largest tile whose
# grid gives every multiprocessor a block): launches and latency dominate them, not rounds of blocks
GRID_MIN_MACS = 1 << 28
# parts a matmul's reduce may be split into, the fewest reduce elements each part keeps (several tile steps), and
# the shortest reduce split at all (a long one: MiniLM's and SmolLM2's down projections, K = 1536; the 512-sized
# matmuls of an MLP step keep their measured tiles)
SPLIT_PARTS = (2, 3, 4, 6, 8)
SPLIT_MIN_PART = 256
SPLIT_MIN_K = 1024


def tile_block(tile: tuple[int, int, int, int]) -> tuple[int, int]:
  """(block M, block N) of a (threads M, threads N, runs M, runs N) tile."""
  threads_m, threads_n, runs_m, runs_n = tile
  return threads_m * SHARED_OUTPUTS * runs_m, threads_n * SHARED_OUTPUTS * runs_n


def matmul_seconds(tile: tuple[int, int, int, int], batch: int, m: int, n: int, k: int, processors: int,
                   parts: int = 1) -> float:
  """Predicted seconds of a float32 matmul (batch x M x N outputs, K long reduce) in `tile` blocks on `processors`
  multiprocessors, its reduce split into `parts` (each part a batch of blocks; the consumer adds the parts)."""
  block_m, block_n = tile_block(tile)
  blocks = batch * parts * (m // block_m) * (n // block_n)
  rounds = math.ceil(blocks / max(processors, 1))
  rate = TILE_RATES.get(tile, 0.25) * (1.0 if rounds * tile[0] * tile[1] >= FULL_THREADS else FEW_THREADS_SHARE)
  seconds = rounds * block_m * block_n * (k // parts) / (rate * MULTIPROCESSOR_MACS)
  if parts > 1: seconds += SPLIT_SECONDS + 2 * parts * batch * m * n * 4 / SPLIT_BYTES_PER_SECOND
  return seconds


def split_k_parts(batch: int, m: int, n: int, k: int, processors: int) -> int:
  """The parts (1: none) that minimize matmul_seconds over the tiles dividing M and N, each part at least
  SPLIT_MIN_PART of K. 1 where the processors are unknown (0), the matmul has under GRID_MIN_MACS multiply-adds or
  K is under SPLIT_MIN_K. Remembered: the lazy layer asks for every matmul it builds, each eager step again."""
  return _remembered_split_k_parts(batch, m, n, k, processors, _tunables())


def _tunables() -> tuple:
  """The module's thresholds the split choices read (in the remembered choices' keys: tests change them)."""
  return (GRID_MIN_MACS, SPLIT_MIN_K, SPLIT_MIN_PART, SPLIT_PARTS, WGMMA_SPLIT_MAX_FILL)


@functools.lru_cache(maxsize=1 << 12)
def _remembered_split_k_parts(batch: int, m: int, n: int, k: int, processors: int, tunables: tuple) -> int:
  if processors <= 0 or batch * m * n * k < GRID_MIN_MACS: return 1
  tiles = [tile for tile in TILE_RATES if m % tile_block(tile)[0] == 0 and n % tile_block(tile)[1] == 0]
  if not tiles: return 1
  if k < SPLIT_MIN_K: return 1
  options = [1] + [parts for parts in SPLIT_PARTS if k % parts == 0 and k // parts >= SPLIT_MIN_PART]

  def fastest(parts: int) -> float:
    return min(matmul_seconds(tile, batch, m, n, k, processors, parts) for tile in tiles)
  return min(options, key=fastest)


# ---------------------------------------------------------------- the grid of a WGMMA matmul (codegen/wgmma_tiles.py)
#
# A WGMMA block tile streams (block_m + block_n) x K operand bytes from L2 through shared memory into the tensor cores
# and does block_m x block_n x K multiply-adds: a multiprocessor runs it at the slower of its tensor cores' sustained
# rate and its operand feed over that tile's intensity (multiply-adds per byte). The feed is the limit the H200 shows
# (ncu of the GPT-2 step, probe_s11): 128x128 TF32 tiles (16 multiply-adds a byte) keep the tensor pipe ~50% busy,
# 128x256 ones (21.3 a byte) 60-70%. Blocks run in waves of multiprocessors x CTAs per multiprocessor; each tile also
# pays a fill (its first stages' latency) and an epilogue (its accumulators stored). A persistent CTA's next tile
# hides a little of that per wave; a second resident CTA would hide it all (unmeasured: not ranked). Split-K
# multiplies the tiles by the parts as the float32 path does (SPLIT_SECONDS, SPLIT_BYTES_PER_SECOND: float32 partials
# written, then read by the consumer).
# Fitted on the H200 (extra/bench/results/bench_wgmma_grid_h200_s11.txt: 147 unsplit and split grids of the GPT-2
# Linear shapes, TF32 and bfloat16, least squares of log time): feed 58 GB/s a multiprocessor (7.7 TB/s over 132),
# tensor cores at 65% of their dense peak, 5 us of fill, stores at 60 GB/s; predictions within 0.77-1.26x of the
# measured times; a persistent grid saved 0.7-0.8 us a wave (lm-head forward: 64 and 95 waves).

# dense multiply-adds per second of one H100/H200 multiprocessor, by operand bytes (989 TFLOP/s float16/bfloat16,
# 495 TF32, on 132), the share of it a WGMMA tile sustains, and the operand bytes per second its feed sustains
WGMMA_TENSOR_MACS = {2: 989e12 / 2 / 132, 4: 495e12 / 2 / 132}
WGMMA_TENSOR_SHARE = 0.65
WGMMA_FEED_BYTES_PER_SECOND = 58e9
# a tile's fixed costs: its pipeline's fill and its accumulators' stores per second; what a persistent CTA's next
# tile hides of them each wave
WGMMA_FILL_SECONDS = 5e-6
WGMMA_STORE_BYTES_PER_SECOND = 60e9
WGMMA_PERSISTENT_HIDDEN_SECONDS = 0.75e-6
# the candidates: rows per CTA (64 per consumer warpgroup), N tiles, CTAs per multiprocessor, one CTA per tile or a
# persistent grid, stages at most (more shared memory buys no speed past 6 on the H200). The tall tiles (192 and 256
# rows: 3 and 4 consumer warpgroups, WGMMA_TALL_BLOCK_MS) feed more multiply-adds a byte where N rules out 128 x 256
# (256 x 128 on the lm-head's N = 50304: 85 a byte against 128 x 192's 77; 192 x 192: 96), within the registers of
# 640 and 512 threads; ranked after the 128- and 64-row ones (those first where times tie). 2 CTAs per
# multiprocessor (unmeasured) are BEAM's and the benchmark's to try, not ranked here
WGMMA_TALL_BLOCK_MS = (256, 192)
WGMMA_BLOCK_MS = (128, 64) + WGMMA_TALL_BLOCK_MS
WGMMA_BLOCK_NS = (256, 192, 128, 64)
WGMMA_CTAS_PER_SM = (1,)
WGMMA_PERSISTENT = (False, True)
WGMMA_MOST_STAGES = 6


@dataclass(frozen=True)
class WgmmaGrid:
  """One WGMMA grid choice: the block tile, its shared-memory stages, CTAs per multiprocessor, a persistent grid
  (the multiprocessors x ctas_per_sm CTAs looping over tiles) or not, and the reduce's parts (1: no split-K)."""
  block_m: int
  block_n: int
  stages: int
  ctas_per_sm: int = 1
  persistent: bool = False
  parts: int = 1


def wgmma_stages(block_m: int, block_n: int, ctas_per_sm: int, shared_bytes: int) -> int:
  """The most stages (up to WGMMA_MOST_STAGES) of a block_m x block_n tile (128-byte rows of K: the same bytes for
  every operand dtype) whose shared memory, ctas_per_sm times, fits `shared_bytes` (the multiprocessor's, less a
  kilobyte each CTA reserves); 0 where fewer than 3 fit."""
  stage_bytes = (block_m + block_n) * ROW_BYTES
  per_cta = shared_bytes // ctas_per_sm - ATOM_BYTES * ctas_per_sm
  stages = min(WGMMA_MOST_STAGES, per_cta // (stage_bytes + 16))   # + the specialized kernel's two mbarriers
  return stages if stages >= 3 else 0


def wgmma_seconds(grid: WgmmaGrid, batch: int, m: int, n: int, k: int, itemsize: int, processors: int,
                  out_itemsize: int = 4) -> float:
  """Predicted seconds of a WGMMA matmul (batch x M x N outputs of `out_itemsize` bytes, K long, operands of
  `itemsize` bytes) in `grid` on `processors` multiprocessors (see the comment above)."""
  tiles = batch * grid.parts * (m // grid.block_m) * (n // grid.block_n)
  part_k = k // grid.parts
  macs = grid.block_m * grid.block_n * part_k
  main = max(macs / (WGMMA_TENSOR_MACS[itemsize] * WGMMA_TENSOR_SHARE),
             (grid.block_m + grid.block_n) * part_k * itemsize / WGMMA_FEED_BYTES_PER_SECOND)
  stored = grid.block_m * grid.block_n * (4 if grid.parts > 1 else out_itemsize)
  overhead = WGMMA_FILL_SECONDS + stored / WGMMA_STORE_BYTES_PER_SECOND
  slots = max(processors, 1) * grid.ctas_per_sm
  waves = math.ceil(tiles / slots)
  # a second resident CTA runs while one fills or stores: only the last shows
  if grid.ctas_per_sm > 1: seconds = waves * grid.ctas_per_sm * main + overhead
  else: seconds = waves * (main + overhead) - (waves - 1) * WGMMA_PERSISTENT_HIDDEN_SECONDS * grid.persistent
  if grid.parts > 1: seconds += SPLIT_SECONDS + 2 * grid.parts * batch * m * n * 4 / SPLIT_BYTES_PER_SECOND
  return seconds


def wgmma_grids(batch: int, m: int, n: int, k: int, itemsize: int, shared_bytes: int, split: bool = False,
                block_ms: tuple[int, ...] = WGMMA_BLOCK_MS) -> list[WgmmaGrid]:
  """Every grid the WGMMA kernel can run for the matmul, in order of preference where times tie (larger tiles, one
  CTA per multiprocessor, not persistent, no split first); with `split`, also each split of K into SPLIT_PARTS that
  keeps whole 128-byte steps of at least SPLIT_MIN_PART elements; `block_ms`: the rows per CTA tried."""
  from ourgrad.codegen.wgmma_tiles import WgmmaMatmul   # the kernel's own checks (registers) decide what is valid
  block_k = ROW_BYTES // itemsize
  options = [1] + [parts for parts in SPLIT_PARTS if split and k % (parts * block_k) == 0 and
                   k // parts >= SPLIT_MIN_PART]
  grids = []
  for parts in options:
    for block_m in block_ms:
      for block_n in WGMMA_BLOCK_NS:
        if m % block_m or n % block_n: continue
        for ctas in WGMMA_CTAS_PER_SM:
          stages = wgmma_stages(block_m, block_n, ctas, shared_bytes)
          if not stages: continue
          try: WgmmaMatmul(block_m, block_n, block_k, dtype="float32" if itemsize == 4 else "float16",
                           block_m=block_m, block_n=block_n, stages=stages, specialized=True, ctas_per_sm=ctas,
                           a_k_major=True, b_k_major=True)
          except ValueError: continue
          grids += [WgmmaGrid(block_m, block_n, stages, ctas, persistent, parts) for persistent in WGMMA_PERSISTENT]
  return grids


def fastest_wgmma_grid(batch: int, m: int, n: int, k: int, itemsize: int, processors: int, shared_bytes: int,
                       out_itemsize: int = 4, split: bool = False) -> WgmmaGrid | None:
  """The grid of wgmma_grids with the least wgmma_seconds (the first where they tie); None where none fits."""
  grids = wgmma_grids(batch, m, n, k, itemsize, shared_bytes, split)
  if not grids: return None
  return min(grids, key=lambda grid: wgmma_seconds(grid, batch, m, n, k, itemsize, processors, out_itemsize))


# split-K gives idle multiprocessors work: where the fastest unsplit grid already fills its waves to this share, a
# split can win only by its tile's feed (a larger tile over more waves), which the model over-rates beside the
# partial sums' traffic. H200: the TF32 lm-head input gradient (4096 x 768, K = 50304: 128 tiles of 128 x 192 on
# 132) 0.867 ms whole, 1.010 split in 4 of 128 x 256 (predicted 4% faster); the weight gradients whose grids fill
# 55-82% of a wave gain (768 x 768, K = 4096: 0.069 -> 0.048 ms with the staging copies; extra/bench/results)
WGMMA_SPLIT_MAX_FILL = 0.9


def wave_fill(grid: WgmmaGrid, batch: int, m: int, n: int, processors: int) -> float:
  """The share of its waves' CTA slots (processors x CTAs per multiprocessor) that `grid`'s tiles occupy."""
  tiles = batch * grid.parts * (m // grid.block_m) * (n // grid.block_n)
  slots = max(processors, 1) * grid.ctas_per_sm
  return tiles / (math.ceil(tiles / slots) * slots)


def wgmma_split_parts(batch: int, m: int, n: int, k: int, itemsize: int, processors: int, shared_bytes: int) -> int:
  """The parts (1: none) of K that fastest_wgmma_grid picks for the matmul; 1 where the processors are unknown, K is
  under SPLIT_MIN_K, or the fastest unsplit grid fills its waves to WGMMA_SPLIT_MAX_FILL. Remembered: the lazy layer
  asks for every matmul it builds, each eager step again (an eager GPT-2 step validated ~700 WgmmaMatmul candidates
  in wgmma_grids, ~4 ms of its graph building on the H200)."""
  return _remembered_wgmma_split_parts(batch, m, n, k, itemsize, processors, shared_bytes, _tunables())


@functools.lru_cache(maxsize=1 << 12)
def _remembered_wgmma_split_parts(batch: int, m: int, n: int, k: int, itemsize: int, processors: int,
                                  shared_bytes: int, tunables: tuple) -> int:
  if processors <= 0 or k < SPLIT_MIN_K: return 1
  whole = fastest_wgmma_grid(batch, m, n, k, itemsize, processors, shared_bytes)
  if whole is not None and wave_fill(whole, batch, m, n, processors) >= WGMMA_SPLIT_MAX_FILL: return 1
  grid = fastest_wgmma_grid(batch, m, n, k, itemsize, processors, shared_bytes, split=True)
  return grid.parts if grid is not None else 1
