"""The schedule cache's key of a repeated eager step, timed alone: lazy_trace.describe (the creation trace's
description) and schedule_cache._structure (the graph walk) on the very trace and outputs of a training step's
realize, each called many times, the fastest call (a shared machine's noise only ever adds; since session 22 describe
only copies the tokens written as the bases were made). Compare key
schemes by these times, not by bytecode counts: under Python 3.11's specializing interpreter a loop of attribute
loads and calls beats map() over attrgetters (session 17 measured a C-loop describe with a third of the bytecodes at
2x the time).

Run: `python extra/bench/probe_trace_key.py --only mlp,cnn` (CLANG, batch 64).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Any, Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_eager  # noqa: E402
from ourgrad import lazy_trace  # noqa: E402
from ourgrad.engine import schedule_cache  # noqa: E402


def best_us(call: Callable[[], Any], calls: int) -> float:
  """The fastest of `calls` calls, in microseconds (single calls: on a loaded machine the least disturbed one)."""
  best = float("inf")
  for _ in range(calls):
    start = time.perf_counter()
    call()
    best = min(best, time.perf_counter() - start)
  return best * 1e6


def probe(name: str, make: Callable[[str, int], Callable[[], Any]], device: str, batch: int, calls: int) -> None:
  step = make(device, batch)
  for _ in range(3): step()
  caught: dict[str, Any] = {}
  trace_key = schedule_cache._trace_tokens

  def catching(trace: lazy_trace.Trace, outs: Any, settings: tuple) -> Any:
    if "bases" not in caught:
      caught["bases"], caught["outs"] = list(trace.bases), list(outs)
      # (timed before the realize goes on: the bases are unrealized and the walk sees the graph as it is)
      # (describe copies the tokens written as the bases were made, session 22: it changes nothing it reads)
      caught["describe"] = best_us(lambda: lazy_trace.describe(trace), calls)
      caught["walk"] = best_us(lambda: schedule_cache._structure(caught["outs"]), calls)
    return trace_key(trace, outs, settings)
  schedule_cache._trace_tokens = catching
  try:
    step()
  finally:
    schedule_cache._trace_tokens = trace_key
  print(f"{name}: {len(caught['bases'])} traced bases, {len(caught['outs'])} outputs | describe "
        f"{caught['describe']:.1f} us | graph walk (_structure) {caught['walk']:.1f} us")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default="CLANG")
  parser.add_argument("--only", default="mlp,cnn")
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--calls", type=int, default=60)
  args = parser.parse_args()
  mnist = bench_eager.load_mnist_example()
  workloads = {"mlp": bench_eager.training_step(bench_eager.MLP, (784,)),
               "cnn": bench_eager.training_step(lambda: mnist.ConvNet(mnist.MODELS["small"]), (1, 28, 28)),
               "gpt2": bench_eager.gpt2_step(False)}
  for name in args.only.split(","): probe(name, workloads[name], args.device, args.batch, args.calls)


if __name__ == "__main__":
  main()
