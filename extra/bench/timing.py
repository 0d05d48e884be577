"""Timing helpers the benchmarks share: PyTorch's side of a comparison and ourgrad's summed kernel times, each timed
the same way everywhere."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def torch_seconds(function: Callable[[], Any], iters: int, cuda: bool, warmup: int = 3) -> float:
  """Median seconds of `function` over `iters` runs after `warmup` runs: CUDA events on a GPU (device time of the
  work it launches), the host clock on the CPU."""
  import torch
  times = []
  for _ in range(iters + warmup):
    if cuda:
      start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      start.record()
      function()
      end.record()
      torch.cuda.synchronize()
      times.append(start.elapsed_time(end) / 1e3)
    else:
      began = time.perf_counter()
      function()
      times.append(time.perf_counter() - began)
  return statistics.median(times[warmup:])


def ourgrad_kernel_seconds(device: str, build: Callable[[], Any], iters: int, warmup: int = 3) -> tuple[float, int]:
  """Median summed kernel seconds (device-timed launches) of scheduling what `build()` returns (a Tensor or a list of
  them) over `iters` runs after `warmup`, and the schedule's kernel count. Each run builds the graph anew."""
  from ourgrad.engine.realize import get_runner
  from ourgrad.engine.schedule import create_schedule
  totals, count = [], 0
  for _ in range(iters + warmup):
    built = build()
    schedule = create_schedule([tensor.lazydata for tensor in (built if isinstance(built, (list, tuple)) else [built])])
    total = 0.0
    for item in schedule:
      for buffer in item.outputs: buffer.allocate()
      total += get_runner(device, item.ast)(item.bufs, wait=True) or 0.0
    totals.append(total)
    count = len(schedule)
  return statistics.median(totals[warmup:]), count


def back_to_back_seconds(launch: Callable[[], Any], synchronize: Callable[[], None], launches: int = 10,
                         batches: int = 5) -> float:
  """Seconds per call of `launch` when calls follow each other with the device kept busy: each batch synchronizes,
  queues `launches` calls and synchronizes again; the median over `batches` batches after one warm-up batch, divided
  by `launches`. Launches are asynchronous, so the host's launch cost hides behind the previous call's work and the
  figure is the device's time per call (how cuBLAS and Triton's do_bench time a kernel). A single call between two
  events also times the gap while the host launches into an idle device."""
  times = []
  for _ in range(batches + 1):
    synchronize()
    began = time.perf_counter()
    for _ in range(launches): launch()
    synchronize()
    times.append((time.perf_counter() - began) / launches)
  return statistics.median(times[1:])
