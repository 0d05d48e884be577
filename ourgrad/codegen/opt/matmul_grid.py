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

import math

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
  K is under SPLIT_MIN_K."""
  if processors <= 0 or batch * m * n * k < GRID_MIN_MACS: return 1
  tiles = [tile for tile in TILE_RATES if m % tile_block(tile)[0] == 0 and n % tile_block(tile)[1] == 0]
  if not tiles: return 1
  if k < SPLIT_MIN_K: return 1
  options = [1] + [parts for parts in SPLIT_PARTS if k % parts == 0 and k // parts >= SPLIT_MIN_PART]

  def fastest(parts: int) -> float:
    return min(matmul_seconds(tile, batch, m, n, k, processors, parts) for tile in tiles)
  return min(options, key=fastest)
