"""The grid of a float32 matmul on a GPU: which shared-memory block tile and into how many parts its reduce is split
across blocks (split-K), from one cost model of the busiest multiprocessor's time.

A block tile is (threads along M, threads along N, float4 runs along M, along N): each thread computes 4 x runs_m by
4 x runs_n outputs, the block threads_m * 4 * runs_m by threads_n * 4 * runs_n (heuristic.SharedTile). A grid of B
blocks on P multiprocessors runs in ceil(B / P) rounds: on the H100 one 128x128 block keeps a multiprocessor as busy
as several do (2048x384x1536 in 48 blocks: 0.30 TFLOP/s per block; 4096^3 in 1024 blocks: 0.31 per multiprocessor),
so a round costs one block's multiply-adds at its tile's rate, however many blocks share the multiprocessor. Smaller
tiles reuse each staged value less (4x4 outputs per thread, not 8x8) and run slower (TILE_RATES, relative to
128x128's), but give more blocks; tiles of 3 runs along N (8x12 outputs a thread) fit grids like 2048x1152 into one
round of 128 blocks (128x144) where 128x128 takes two (144 blocks). Split-K (the lazy layer's _gpu_split_parts)
multiplies the blocks by the parts and divides each block's reduce; the partial results cost a write and a read
(SPLIT_SECONDS, SPLIT_BYTES_PER_SECOND: the consumer adds them, no kernel of their own).

`matmul_seconds` is the model; `split_k_parts` the parts the lazy layer splits a matmul's reduce into; GRID_TILES the
tiles heuristic._shared_tile_order ranks by it (MATMUL_GRID=1).
"""
from __future__ import annotations

import math

# multiply-adds per second of one H100 multiprocessor running 128x128 tiles (40.5 TFLOP/s at 4096^3 on 132)
MULTIPROCESSOR_MACS = 40.5e12 / 2 / 132
SHARED_OUTPUTS = 4   # outputs of a float4 run
# (threads M, threads N, runs M, runs N) -> the tile's rate relative to 128x128's. H100 4096^3 runs: 128x64 (8x4
# outputs a thread) 30.6 TFLOP/s, 64x64 (4x4) 28.7, 128x128 40.5; the smaller tiles (4x4 outputs a thread, fewer
# threads) below those
TILE_RATES = {
  (16, 16, 2, 2): 1.0, (16, 16, 1, 2): 0.76, (16, 16, 2, 1): 0.76, (16, 16, 1, 1): 0.71,
  (8, 16, 1, 1): 0.6, (16, 8, 1, 1): 0.6, (8, 8, 1, 1): 0.5, (4, 16, 1, 1): 0.4, (16, 4, 1, 1): 0.4,
  (4, 8, 1, 1): 0.35, (8, 4, 1, 1): 0.35, (4, 4, 1, 1): 0.3,
  # 8x12 outputs a thread (3 runs along N): 128x192, 128x144, 128x96, 64x144; 4x12: 32x192, 64x96
  (16, 16, 2, 3): 1.0, (16, 12, 2, 3): 1.0, (16, 8, 2, 3): 0.9, (8, 12, 2, 3): 0.8, (8, 16, 1, 3): 0.7,
  (16, 8, 1, 3): 0.7,
}
# the tiles of 3 runs along N, ranked with heuristic.SHARED_TILES by the model (MATMUL_GRID=1)
WIDE_RUN_TILES = ((16, 16, 2, 3), (16, 12, 2, 3), (16, 8, 2, 3), (8, 12, 2, 3), (8, 16, 1, 3), (16, 8, 1, 3))
# a split reduce's cost beyond its blocks: the partial results written then read (they stay in L2) and a fixed part
SPLIT_SECONDS = 2e-6
SPLIT_BYTES_PER_SECOND = 3e12
# parts a matmul's reduce may be split into, and the fewest reduce elements each part keeps (several tile steps)
SPLIT_PARTS = (2, 3, 4, 6, 8)
SPLIT_MIN_PART = 256


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
  seconds = rounds * block_m * block_n * (k // parts) / (TILE_RATES.get(tile, 0.25) * MULTIPROCESSOR_MACS)
  if parts > 1: seconds += SPLIT_SECONDS + 2 * parts * batch * m * n * 4 / SPLIT_BYTES_PER_SECOND
  return seconds


def split_k_parts(batch: int, m: int, n: int, k: int, processors: int) -> int:
  """The parts (1: none) that minimize matmul_seconds over the tiles dividing M and N, each part at least
  SPLIT_MIN_PART of K. 1 where the processors are unknown (0)."""
  if processors <= 0: return 1
  tiles = [tile for tile in TILE_RATES if m % tile_block(tile)[0] == 0 and n % tile_block(tile)[1] == 0]
  if not tiles: return 1
  options = [1] + [parts for parts in SPLIT_PARTS if k % parts == 0 and k // parts >= SPLIT_MIN_PART]

  def fastest(parts: int) -> float:
    return min(matmul_seconds(tile, batch, m, n, k, processors, parts) for tile in tiles)
  return min(options, key=fastest)
