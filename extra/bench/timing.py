"""Timing helpers the benchmarks share: PyTorch's side of a comparison, timed the same way everywhere."""
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
