"""Programmatic dependent launch on CUDA: microseconds a kernel of a CUDA graph of N dependent kernels, each chain
replayed as one graph per CUDA_DEPENDENT_LAUNCH mode (0 plain edges, 1 launched as the blocks of the kernel before
exit, 2 CUDARenderer.early_launches' rule, 3 every kernel as soon as the blocks of the one before have started, 4 the
rule with short_only: only after a kernel that takes at most a launch's time),
all graphs built in one process from the same captured kernels.

    python extra/bench/bench_pdl.py [--kernels 200] [--modes 0,1,2,3,4] [--explain]
    python extra/bench/bench_pdl.py --decode bfloat16 --only none   (SmolLM2 decode, random weights: tokens/s a mode)

Chains: `tiny` (one block each), `wave` (one wave of small blocks), `waves` (4 million elements: many waves),
`matmul+tiny` (a 512x512x512 float32 matmul, compute-bound, then a one-block kernel on its result, alternating: do
early-launched kernels waiting beside a running one slow it?), `matmul+wide` (the same with an elementwise kernel of
512 blocks after each matmul: many waiting blocks beside it).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("DEVICE", "CUDA")
from ourgrad import Tensor, TinyJit  # noqa: E402
from ourgrad.device import Device  # noqa: E402
from ourgrad.engine.jit import GraphReplay, _graph_launch  # noqa: E402
from ourgrad.runtime.ops_cuda import CUDAGraph  # noqa: E402


def chain(step: Callable[[Tensor], Tensor], count: int) -> Callable[[Tensor], Tensor]:
  """A function of `count` dependent kernels: each realizes `step` of the one before's result."""
  def run(x: Tensor) -> Tensor:
    for _ in range(count): x = step(x).realize()
    return x
  return run


def matmul_then_tiny(weights: Tensor, count: int) -> Callable[[Tensor], Tensor]:
  """`count` times: a matmul, then a one-element kernel on its result that scales the next matmul's input."""
  def run(x: Tensor) -> Tensor:
    for _ in range(count):
      product = (x @ weights).realize()
      scale = (product[0:1, 0:1] * 1e-3 + 1).realize()
      x = product * scale   # fused into the next matmul's loads
    return x.realize()
  return run


def matmul_then_wide(weights: Tensor, count: int) -> Callable[[Tensor], Tensor]:
  """`count` times: a matmul, then an elementwise kernel over its result (512 blocks) that the next matmul reads."""
  def run(x: Tensor) -> Tensor:
    for _ in range(count): x = ((x @ weights).realize() * 0.5 + 0.25).realize()
    return x
  return run


def time_graph(graph: CUDAGraph, replays: int) -> float:
  device = Device["CUDA"]
  graph.launch()
  device.synchronize()
  times = []
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(replays): graph.launch()
    device.synchronize()
    times.append((time.perf_counter() - start) / replays)
  return statistics.median(times)


def bench(name: str, function: Callable[[Tensor], Tensor], x: Tensor, modes: list[int], explain: bool) -> None:
  jit = TinyJit(function)
  for _ in range(3): jit(x)
  assert jit.captured is not None
  launches = [_graph_launch(item) for item in jit.captured.items]
  device = Device["CUDA"]
  results = []
  for mode in modes:
    graph = CUDAGraph(device, launches, mode)
    if explain and mode == 2: print(graph.describe(launches))
    seconds = time_graph(graph, 20)
    results.append(f"mode {mode} {seconds * 1e6 / len(launches):6.2f} us/kernel ({seconds * 1e3:.3f} ms)")
  print(f"{name:<12} {len(launches):>4} kernels: " + " | ".join(results))


def bench_decode(weights: str, modes: list[int], steps: int, explain: bool) -> None:
  """SmolLM2 decode (profile_models.py's random-weight model, `weights` as its --weights): the captured step's graph
  rebuilt per mode; tokens/s with the logits read on the host each step, and of the graph replays alone."""
  sys.path.insert(0, str(Path(__file__).resolve().parent))
  import profile_models
  args = argparse.Namespace(weights=weights, device="CUDA", context=520, layers=0, sequences=1, timed=0)
  jit, call = profile_models.decode_workload(args)
  captured = jit.captured
  assert captured is not None
  launches = [_graph_launch(item) for item in captured.items]
  device = Device["CUDA"]
  for mode in modes:
    graph = CUDAGraph(device, launches, mode)
    if mode in (2, 4): print(graph.describe(launches) if explain else graph.describe(launches).splitlines()[0])
    captured.replay_runner = GraphReplay(captured.items, graph)
    host = []
    for _ in range(3):
      call()
      start = time.perf_counter()
      for _ in range(steps): call()
      host.append((time.perf_counter() - start) / steps)
    replay = time_graph(graph, steps)
    print(f"decode {weights} mode {mode}: {1 / statistics.median(host):7.1f} tok/s (logits to the host each step), "
          f"graph alone {replay * 1e3:.3f} ms = {replay * 1e6 / len(launches):.2f} us/kernel ({len(launches)} kernels)")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernels", type=int, default=200)
  parser.add_argument("--modes", default="0,1,2,3,4")
  parser.add_argument("--only", default="", help="comma-separated chain names")
  parser.add_argument("--explain", action="store_true", help="print mode 2's decision for each kernel")
  parser.add_argument("--decode", default="", help="also SmolLM2 decode with these weights (bfloat16, q8_0, ...)")
  parser.add_argument("--steps", type=int, default=64, help="decode steps timed (median of 3)")
  args = parser.parse_args()
  modes = [int(mode) for mode in args.modes.split(",")]
  count = args.kernels
  weights = Tensor.rand(512, 512).realize() * (1 / 512)
  chains = {
    "tiny": (chain(lambda x: x * 0.999 + 0.5, count), Tensor.rand(256).realize()),
    "wave": (chain(lambda x: x * 0.999 + 0.5, count), Tensor.rand(132 * 4 * 128).realize()),
    "waves": (chain(lambda x: x * 0.999 + 0.5, count // 4), Tensor.rand(1 << 22).realize()),
    "matmul+tiny": (matmul_then_tiny(weights.realize(), count // 4), Tensor.rand(512, 512).realize()),
    "matmul+wide": (matmul_then_wide(weights.realize(), count // 4), Tensor.rand(512, 512).realize()),
  }
  only = [name for name in args.only.split(",") if name]
  for name, (function, x) in chains.items():
    if not only or name in only: bench(name, function, x, modes, args.explain)
  for weights in filter(None, args.decode.split(",")): bench_decode(weights, modes, args.steps, args.explain)


if __name__ == "__main__":
  main()
