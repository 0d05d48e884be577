"""Benchmark a few core ops on ourgrad's default device against numpy and PyTorch (CPU) on the same inputs.

    python extra/bench/bench_ops.py            # full sizes
    python extra/bench/bench_ops.py --quick    # small sizes, a few seconds

Methodology
- Workloads: (a) the fused elementwise chain exp((a + b) * c) over 4M float32 elements, (b) softmax over the last
  axis of a (4096, 1024) float32 matrix, (c) a 1024x1024x1024 float32 matmul.
- Every library gets the same float32 numpy inputs (torch wraps them with torch.from_numpy, no copy).
- ourgrad: the inputs are realized once. Each run builds a fresh lazy graph over them, which is not timed, then
  times `.realize()`: scheduling, the compiled-kernel cache lookup and the kernel launches. Warm-up runs come
  first, so the one-time code generation and compilation are excluded.
- numpy and torch: each run times the whole expression, temporaries included.
- A run count between --min-runs and --max-runs, stopped once --budget seconds have gone into a workload and
  library; the median is reported. The clock is time.perf_counter.
- Bytes: GlobalCounters.global_mem of one ourgrad realize (bytes read + written by its kernels, intermediates that
  went through memory included). The same byte count is used for numpy and torch, so the GB/s columns compare
  times on one scale rather than each library's own traffic.
- GFLOP/s (matmul only): 2*M*N*K / time, the same count for every library.
- "/ numpy" and "/ torch": ourgrad's median time divided by theirs; above 1 means ourgrad is slower.
- ourgrad's result is checked against numpy's before timing.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ourgrad.device import Device
from ourgrad.helpers import GlobalCounters
from ourgrad.tensor import Tensor

try:
  import torch
except ImportError:  # torch is optional: its rows are left out
  torch = None


@dataclass
class Workload:
  """One benchmark: numpy inputs and the same computation written for each library."""
  name: str
  inputs: list[np.ndarray]
  ourgrad: Callable[..., Tensor]
  numpy: Callable[..., np.ndarray]
  torch: Callable[..., Any]
  flops: int | None = None  # reported as GFLOP/s when set


@dataclass
class Result:
  library: str
  median_s: float
  runs: int
  kernels: int | None = None


@dataclass
class Timing:
  min_runs: int
  max_runs: int
  budget_s: float
  warmup: int


# ---------------------------------------------------------------- workloads

def _np_softmax(x: np.ndarray) -> np.ndarray:
  exps = np.exp(x - x.max(-1, keepdims=True))
  return exps / exps.sum(-1, keepdims=True)


def make_workloads(quick: bool, rng: np.random.Generator) -> list[Workload]:
  elements = 256 * 1024 if quick else 4 * 1024 * 1024
  rows, cols = (512, 256) if quick else (4096, 1024)
  size = 256 if quick else 1024

  def rand(*shape: int) -> np.ndarray: return rng.standard_normal(shape, dtype=np.float32)

  return [
    Workload(f"exp((a+b)*c) {elements // 1024}K", [rand(elements), rand(elements), rand(elements)],
             ourgrad=lambda a, b, c: ((a + b) * c).exp(), numpy=lambda a, b, c: np.exp((a + b) * c),
             torch=lambda a, b, c: torch.exp((a + b) * c)),
    Workload(f"softmax ({rows}, {cols})", [rand(rows, cols)],
             ourgrad=lambda x: x.softmax(-1), numpy=_np_softmax, torch=lambda x: torch.softmax(x, -1)),
    Workload(f"matmul {size}^3", [rand(size, size), rand(size, size)],
             ourgrad=lambda a, b: a @ b, numpy=lambda a, b: a @ b, torch=lambda a, b: a @ b,
             flops=2 * size ** 3),
  ]


# ---------------------------------------------------------------- timing

def median_time(run: Callable[[], None], setup: Callable[[], Any], timing: Timing) -> tuple[float, int]:
  """Median seconds of `run(setup())` (setup is not timed) after warm-up, and how many runs were timed."""
  for _ in range(timing.warmup): run(setup())
  samples: list[float] = []
  spent_start = time.perf_counter()
  while len(samples) < timing.max_runs:
    prepared = setup()
    start = time.perf_counter()
    run(prepared)
    samples.append(time.perf_counter() - start)
    if len(samples) >= timing.min_runs and time.perf_counter() - spent_start > timing.budget_s: break
  return statistics.median(samples), len(samples)


def bench_ourgrad(workload: Workload, timing: Timing) -> tuple[Result, int, int]:
  """ourgrad's timing, plus the bytes and ops one realize moves, read from GlobalCounters."""
  inputs = [Tensor(array) for array in workload.inputs]  # realized: Tensor(np.ndarray) copies to the device now
  result = workload.ourgrad(*inputs)
  np.testing.assert_allclose(result.numpy(), workload.numpy(*workload.inputs), rtol=1e-3, atol=1e-4)
  GlobalCounters.reset()
  workload.ourgrad(*inputs).realize()
  kernels, bytes_moved, ops = GlobalCounters.kernel_count, GlobalCounters.global_mem, GlobalCounters.global_ops
  median_s, runs = median_time(lambda graph: graph.realize(), lambda: workload.ourgrad(*inputs), timing)
  return Result("ourgrad", median_s, runs, kernels), bytes_moved, ops


def bench_numpy(workload: Workload, timing: Timing) -> Result:
  median_s, runs = median_time(lambda _: workload.numpy(*workload.inputs), lambda: None, timing)
  return Result("numpy", median_s, runs)


def bench_torch(workload: Workload, timing: Timing) -> Result | None:
  if torch is None: return None
  inputs = [torch.from_numpy(array) for array in workload.inputs]
  with torch.no_grad():
    median_s, runs = median_time(lambda _: workload.torch(*inputs), lambda: None, timing)
  return Result("torch", median_s, runs)


# ---------------------------------------------------------------- report

COLUMNS = f"{'benchmark':<24} {'library':<8} {'median ms':>10} {'runs':>5} {'GB/s':>8} {'GFLOP/s':>8} " \
          f"{'kernels':>7} {'/ numpy':>8} {'/ torch':>8}"


def format_row(name: str, result: Result, bytes_moved: int, flops: int | None, ratios: dict[str, float]) -> str:
  gb_per_s = bytes_moved / result.median_s / 1e9
  gflops = f"{flops / result.median_s / 1e9:8.1f}" if flops else f"{'-':>8}"
  kernels = f"{result.kernels:>7}" if result.kernels is not None else f"{'-':>7}"
  ratio_cells = " ".join(f"{ratios[key]:8.2f}" if key in ratios else f"{'-':>8}" for key in ("numpy", "torch"))
  return f"{name:<24} {result.library:<8} {result.median_s * 1e3:10.3f} {result.runs:>5} {gb_per_s:8.2f} " \
         f"{gflops} {kernels} {ratio_cells}"


def run_workload(workload: Workload, timing: Timing) -> list[str]:
  ours, bytes_moved, _ = bench_ourgrad(workload, timing)
  others = [result for result in (bench_numpy(workload, timing), bench_torch(workload, timing)) if result]
  ratios = {other.library: ours.median_s / other.median_s for other in others}
  rows = [format_row(workload.name, ours, bytes_moved, workload.flops, ratios)]
  rows += [format_row("", other, bytes_moved, workload.flops, {}) for other in others]
  return rows


def describe_setup() -> str:
  torch_text = f"torch {torch.__version__} ({torch.get_num_threads()} threads)" if torch else "torch not installed"
  threads = os.environ.get("OMP_NUM_THREADS", "all")
  load = f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "?"
  return f"ourgrad on {Device.DEFAULT} (OpenMP threads: {threads}); numpy {np.__version__}; {torch_text}; " \
         f"{os.cpu_count()} CPUs, load average {load} (other processes skew the times)"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="small sizes for a fast check")
  parser.add_argument("--min-runs", type=int, default=5, help="timed runs at least")
  parser.add_argument("--max-runs", type=int, default=50, help="timed runs at most")
  parser.add_argument("--budget", type=float, default=3.0, help="seconds per workload and library, roughly")
  parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (compile, caches)")
  args = parser.parse_args()
  timing = Timing(args.min_runs, args.max_runs, args.budget, args.warmup)
  print(describe_setup())
  print(COLUMNS)
  print("-" * len(COLUMNS))
  for workload in make_workloads(args.quick, np.random.default_rng(0)):
    for row in run_workload(workload, timing): print(row, flush=True)


if __name__ == "__main__":
  main()
