"""The grid of a float32 matmul on a GPU: which shared-memory block tile (heuristic.SHARED_TILES) and into how many
parts its reduce is split across blocks (split-K), from one cost model of the busiest multiprocessor's time.

A grid of B blocks on P multiprocessors runs in ceil(B / P) rounds: on the H100 one 128x128 block keeps a
multiprocessor as busy as several do (2048x384x1536 in 48 blocks: 0.30 TFLOP/s per block; 4096^3 in 1024 blocks:
0.31 per multiprocessor), so a round costs one block's multiply-adds at its tile's rate, however many blocks share
the multiprocessor. Smaller tiles reuse each staged value less (4x4 outputs per thread, not 8x8) and run slower
(TILE_RATES, relative to 128x128), but give more blocks: the model trades the two. Split-K (the lazy layer's
_gpu_split_parts) multiplies the blocks by the parts and divides each block's reduce; the partial results cost a
write and a read and a second kernel sums them (SPLIT_LAUNCH_SECONDS, SPLIT_BYTES_PER_SECOND).

`matmul_seconds` is the model; `split_k_parts` the parts the lazy layer splits a matmul's reduce into;
heuristic._shared_tile_order ranks the tiles by it.
"""
from __future__ import annotations

import math

# multiply-adds per second of one H100 multiprocessor running 128x128 tiles (40.5 TFLOP/s at 4096^3 on 132)
MULTIPROCESSOR_MACS = 40.5e12 / 2 / 132
# the rate of a block tile (block M x block N) relative to 128x128's. H100 4096^3 runs: 128x64 (8x4 outputs a thread)
# 30.6 TFLOP/s, 64x64 (4x4) 28.7, 128x128 40.5; the smaller tiles (4x4 outputs a thread, fewer threads) below those
TILE_RATES = {(128, 128): 1.0, (64, 128): 0.76, (128, 64): 0.76, (64, 64): 0.71, (32, 64): 0.6, (64, 32): 0.6,
              (32, 32): 0.5, (16, 64): 0.4, (64, 16): 0.4, (16, 32): 0.35, (32, 16): 0.35, (16, 16): 0.3}
# a split reduce's second kernel: its launch, and the partial results written then read (they stay in L2)
SPLIT_LAUNCH_SECONDS = 3e-6
SPLIT_BYTES_PER_SECOND = 3e12
# parts a matmul's reduce may be split into, and the fewest reduce elements each part keeps (several tile steps)
SPLIT_PARTS = (2, 3, 4, 6, 8)
SPLIT_MIN_PART = 256


def matmul_seconds(block: tuple[int, int], batch: int, m: int, n: int, k: int, processors: int,
                   parts: int = 1) -> float:
  """Predicted seconds of a float32 matmul (batch x M x N outputs, K long reduce) in `block` tiles on `processors`
  multiprocessors, its reduce split into `parts` (each part a batch of blocks, then a kernel summing the parts)."""
  blocks = batch * parts * (m // block[0]) * (n // block[1])
  rounds = math.ceil(blocks / max(processors, 1))
  seconds = rounds * block[0] * block[1] * (k // parts) / (TILE_RATES.get(block, 0.25) * MULTIPROCESSOR_MACS)
  if parts > 1: seconds += SPLIT_LAUNCH_SECONDS + 2 * parts * batch * m * n * 4 / SPLIT_BYTES_PER_SECOND
  return seconds


def split_k_parts(batch: int, m: int, n: int, k: int, processors: int) -> int:
  """The parts (1: none) that minimize matmul_seconds over the tiles dividing M and N, each part at least
  SPLIT_MIN_PART of K. 1 where the processors are unknown (0)."""
  if processors <= 0: return 1
  blocks = [block for block in TILE_RATES if m % block[0] == 0 and n % block[1] == 0]
  if not blocks: return 1
  options = [1] + [parts for parts in SPLIT_PARTS if k % parts == 0 and k // parts >= SPLIT_MIN_PART]

  def fastest(parts: int) -> float:
    return min(matmul_seconds(block, batch, m, n, k, processors, parts) for block in blocks)
  return min(options, key=fastest)
