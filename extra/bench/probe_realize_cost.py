"""A realize's fixed cost against the size of its graph (issue 26): chains of N blocks, each one kernel of a few
elementwise ops (`((x * w + b).relu() * 0.5).contiguous()`, ~4 lazy bases), realized again and again; the host time
of building the graph, of scheduling it (a schedule-cache hit found by the creation trace; with --cold, the scheduler
from scratch: SCHEDULE_CACHE=0) and of running it (lowering, memory plan, launches or the captured graph), medians of
repeated realizes. The intercept of the fit is what one realize costs whatever its size; the slope, per kernel.

Run: `python extra/bench/probe_realize_cost.py [--device CUDA] [--blocks 1,4,16,64] [--cold]`. On CPU devices every
compiled kernel is replaced by a no-op while timing (bench_eager.host_kernels_disabled), and the clock is the
thread's CPU time: host time only.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time
from typing import Callable

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_eager import host_kernels_disabled  # noqa: E402

from ourgrad import Device, Tensor  # noqa: E402
from ourgrad.engine import realize as engine_realize  # noqa: E402
from ourgrad.engine import schedule_cache  # noqa: E402


def build(x: Tensor, weights: list[tuple[Tensor, Tensor]]) -> Tensor:
  for w, b in weights: x = ((x * w + b).relu() * 0.5).contiguous()
  return x


def phases_us(x: Tensor, weights: list[tuple[Tensor, Tensor]], calls: int, clock: Callable[[], float]) \
    -> tuple[float, float, float]:
  """Median host us of (graph building, scheduling, running) one realize of the chain."""
  built, scheduled, ran = [], [], []
  for _ in range(calls):
    start = clock()
    out = build(x, weights)
    made = clock()
    schedule = schedule_cache.schedule([out.lazydata])
    done = clock()
    engine_realize.run_schedule(schedule)
    end = clock()
    built.append(made - start)
    scheduled.append(done - made)
    ran.append(end - done)
  return tuple(statistics.median(values) * 1e6 for values in (built, scheduled, ran))  # type: ignore[return-value]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default=Device.DEFAULT)
  parser.add_argument("--blocks", default="1,4,16,64")
  parser.add_argument("--calls", type=int, default=200)
  parser.add_argument("--cold", action="store_true", help="schedule every realize from scratch (SCHEDULE_CACHE=0)")
  args = parser.parse_args()
  device = Device.canonicalize(args.device)
  if args.cold: os.environ["SCHEDULE_CACHE"] = "0"
  rng = np.random.default_rng(0)
  width = 4096
  x = Tensor(rng.standard_normal(width).astype(np.float32), device=device).realize()
  sync = Device[device].synchronize
  sizes = [int(n) for n in args.blocks.split(",")]
  # a CPU device shares its machine: the thread's CPU time, which waiting for a core does not count; a GPU's host is
  # timed by the wall clock (a call that waits for the device counts)
  clock = time.perf_counter if device == "CUDA" else time.thread_time
  rows = []
  for blocks in sizes:
    weights = [(Tensor(rng.standard_normal(width).astype(np.float32), device=device).realize(),
                Tensor(rng.standard_normal(width).astype(np.float32), device=device).realize()) for _ in range(blocks)]
    for _ in range(4): build(x, weights).realize()   # compile, cache, capture
    sync()
    with host_kernels_disabled(device != "CUDA"):
      rows.append((blocks, *phases_us(x, weights, args.calls, clock)))
    sync()
  print(f"realize cost on {device} ({'cold: SCHEDULE_CACHE=0' if args.cold else 'warm: schedule-cache hits'}), "
        f"host us ({'wall clock' if device == 'CUDA' else 'thread CPU time'}), medians of {args.calls}")
  print("| kernels | graph | schedule | run | realize (schedule + run) | realize per kernel |")
  print("| ------- | ----- | -------- | --- | ------------------------ | ------------------ |")
  for blocks, graph, schedule, run in rows:
    print(f"| {blocks:7d} | {graph:7.1f} | {schedule:8.1f} | {run:7.1f} | {schedule + run:24.1f} | "
          f"{(schedule + run) / blocks:18.2f} |")
  if len(rows) >= 2:
    kernels = np.array([row[0] for row in rows], np.float64)
    cost = np.array([row[2] + row[3] for row in rows], np.float64)
    slope, intercept = np.polyfit(kernels, cost, 1)
    print(f"fit: a realize costs {intercept:.1f} us + {slope:.2f} us a kernel (schedule + run)")


if __name__ == "__main__":
  main()
