"""The longest serial chain of the GPU indexed accumulate (codegen/index_accumulate.py), modelled in numpy from its
plan, for the indices bench_scatter.py draws: the row loads one thread adds one after another (each waits on its
load), and the index reads of a long run's chunk scan. No GPU needed; the H200's plan by default.

    python extra/bench/scatter_chains.py            # uniform, Zipf 1.0 and 1.2, every token the same row

Before chunks (every row's owner adds its repeats): the chain is the hottest row's repeats. With chunks: a row
indexed at most LONG_RUN times still has one owner; the longer ones are added by their block, one after another,
each split over the plan's chunks of the index array (the chain is the busiest chunk's matches, plus its scan)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ourgrad.codegen import index_accumulate  # noqa: E402
from ourgrad.dtype import dtypes  # noqa: E402


class H200Facts:   # what plan_index_accumulate reads of the CUDA renderer on an H200
  has_threads, has_local, max_threads, multiprocessors, vector_width, warp_size = True, True, 1024, 132, 4, 32
  local_memory_bytes = 48 * 1024


def draw(kind: str, vocab: int, tokens: int) -> np.ndarray:
  """bench_scatter.py's indices (its seed): 'uniform', 'zipf:S', or 'one' (every token row 0)."""
  rng = np.random.default_rng(0)
  if kind == "one": return np.zeros(tokens, np.int32)
  if kind.startswith("zipf:"):
    weights = 1.0 / np.arange(1, vocab + 1) ** float(kind[5:])
    return rng.choice(vocab, tokens, p=weights / weights.sum()).astype(np.int32)
  return rng.integers(0, vocab, tokens).astype(np.int32)


def chains(index: np.ndarray, plan: index_accumulate.AccumulatePlan) -> dict[str, int]:
  """Serial row loads before chunks; with chunks: the longest block's serial row loads and chunk index reads."""
  repeats = np.bincount(index, minlength=plan.rows)
  block = (np.arange(plan.rows) % plan.row_stride) % plan.blocks[0]   # a block's row groups: b, b + B, b + 2B, ...
  long_rows = np.nonzero(repeats > plan.long_run)[0] if plan.chunks > 1 else np.array([], np.int64)
  cold = np.where(np.isin(np.arange(plan.rows), long_rows), 0, repeats)
  per_block_loads = np.zeros(block.max() + 1, np.int64)
  per_block_scans = np.zeros(block.max() + 1, np.int64)
  for row in long_rows:
    positions = np.nonzero(index == row)[0]
    busiest = np.bincount(positions // plan.chunk_length, minlength=plan.chunks).max()
    per_block_loads[block[row]] += busiest
    per_block_scans[block[row]] += plan.chunk_length
  np.maximum.at(per_block_loads, block, cold)   # a block's cold rows run before its long ones (phase 1, then 2)
  worst = int(np.argmax(per_block_loads + per_block_scans // 8))
  return {"before": int(repeats.max()), "loads": int(per_block_loads[worst]), "scan": int(per_block_scans[worst]),
          "long rows": len(long_rows)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--vocab", type=int, default=50304)
  parser.add_argument("--width", type=int, default=768)
  args = parser.parse_args()
  plan = index_accumulate.plan_index_accumulate(args.vocab, args.width, args.tokens, dtypes.float32, H200Facts())
  print(f"plan: {plan.chunks} chunks of {plan.chunk_length} indices, teams of {plan.chunk_team} threads, long run "
        f"> {plan.long_run} repeats; {plan.block_rows} rows a block")
  print(f"{'indices':<10} {'hottest row':>11} {'long rows':>9} {'chain: row loads':>16} {'+ index reads':>13}")
  for kind in ("uniform", "zipf:1.0", "zipf:1.2", "one"):
    result = chains(draw(kind, args.vocab, args.tokens), plan)
    print(f"{kind:<10} {result['before']:>11} {result['long rows']:>9} {result['loads']:>16} {result['scan']:>13}")


if __name__ == "__main__":
  main()
