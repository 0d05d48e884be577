"""A replayed kernel's launch on CUDA through cuda-python's cuLaunchKernel wrapper against libcuda's cuLaunchKernel
called through ctypes with every argument a ctypes object made once (runtime/ops_cuda.py LAUNCH_THROUGH_CTYPES), in
one process, rounds alternated (issue 26):
  launcher   a 1-element kernel's PositionalLaunch called with its two buffers (`--launches` launches a round, host
             time until the last call returns; the device is synchronized between rounds, outside the timing)
  op1        bench_eager's `(x + 1).realize()` whole (its replayed item's launcher switched between the two)
and PyTorch's `x.add_(1)` beside them. Medians over `--rounds` rounds, microseconds per call.
Measured (H200 host, session 20's second checkpoint, 7 rounds): launcher 4.52 us cuda-python, 4.59 ctypes; op1 26.46
against 26.83; PyTorch x.add_(1) 5.84: the ctypes call is no faster (as on the H100 before), so it stays off.
Run: `python extra/bench/probe_launch.py` on a CUDA machine.
"""
from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from ourgrad import Device, Tensor  # noqa: E402
from ourgrad.engine import schedule_cache  # noqa: E402
from ourgrad.runtime import ops_cuda  # noqa: E402


def per_call_us(call: Callable[[], Any], count: int, sync: Callable[[], None]) -> float:
  sync()
  start = time.perf_counter()
  for _ in range(count): call()
  seconds = time.perf_counter() - start
  sync()
  return seconds / count * 1e6


def replayed_launchers() -> list[Any]:
  """The PositionalLaunch of every replayed item the schedule cache keeps."""
  entries = [*schedule_cache._cache.values(), *schedule_cache._traced.values()]
  return [memo.launch for entry in entries for memo in entry.lowerings
          if isinstance(memo.launch, ops_cuda.PositionalLaunch)]


def use_ctypes(on: bool) -> None:
  """Switch every launcher made from now on, and the replayed items' ones (their arrays made again), to ctypes."""
  ops_cuda.LAUNCH_THROUGH_CTYPES[0] = on
  for launcher in replayed_launchers(): launcher.call_driver = None


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--launches", type=int, default=2000)
  parser.add_argument("--rounds", type=int, default=9)
  parser.add_argument("--no-torch", action="store_true")
  args = parser.parse_args()
  device = Device["CUDA"]
  sync = device.synchronize
  x = Tensor([1.0], device="CUDA").realize()
  for _ in range(5): (x + 1).realize()
  out = (x + 1).realize()
  runner = schedule_cache._last_traced[0].lowerings[0].runner   # (x + 1's kernel: it writes out, reads x)
  buffers = [out.lazydata.base.realized, x.lazydata.base.realized]
  launchers = {}
  modes = [(False, "cuda-python"), (True, "ctypes")]
  for mode in (False, True):
    ops_cuda.LAUNCH_THROUGH_CTYPES[0] = mode
    launchers[mode] = runner.program.positional_launcher(runner.global_size, runner.local_size)
  try:   # (a ctypes launch that fails is reported, and the other rows still measured)
    launchers[True](buffers)
    sync()
  except Exception as error:
    print(f"the ctypes launch failed: {type(error).__name__}: {error}")
    modes.pop()
  rows: dict[str, list[float]] = {}
  gc.disable()
  for _ in range(args.rounds):
    for mode, name in modes:
      launcher = launchers[mode]
      rows.setdefault(f"launcher {name}", []).append(per_call_us(lambda: launcher(buffers), args.launches, sync))
      use_ctypes(mode)
      rows.setdefault(f"op1 {name}", []).append(per_call_us(lambda: (x + 1).realize(), args.launches // 2, sync))
  use_ctypes(False)
  if not args.no_torch:
    import torch
    one = torch.ones(1, device="cuda")
    for _ in range(args.rounds):
      rows.setdefault("torch x.add_(1)", []).append(per_call_us(lambda: one.add_(1), args.launches,
                                                                 torch.cuda.synchronize))
  gc.enable()
  results = []
  for mode, _ in modes:   # (each way's values: x is 1, so every launch of x + 1 gives 2)
    use_ctypes(mode)
    results.append((x + 1).numpy().tolist())
  use_ctypes(False)
  print(f"launch probe: {args.rounds} rounds x {args.launches} calls, median us per call (op1 results {results})")
  for name, values in rows.items():
    print(f"  {name:<24} {statistics.median(values):7.2f}  (min {min(values):.2f})")


if __name__ == "__main__":
  main()
