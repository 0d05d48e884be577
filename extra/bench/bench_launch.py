"""Launch cost of a 1-element kernel on CUDA, the two launch paths of CUDAProgram side by side: libcuda's
cuLaunchKernel through ctypes with bound arguments (the default) and cuda-python's wrapper (the fallback), plus
PyTorch's `x.add_(1)`.

Method: rounds alternate between the paths; a round times `--launches` launches from the host (the "host" column:
the time until the last call returns, so the launch queue never fills: the device is synchronized before each
round, outside the timing) and then the same launches with the synchronization included ("with sync"). Medians
over `--rounds` rounds, in microseconds per launch. The layers are timed apart too: ExecItem.run (the engine's
one launch place), CompiledRunner.__call__, and CUDAProgram.__call__ alone.
Run: `python extra/bench/bench_launch.py` on a CUDA machine.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from typing import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad, not an installed one
from ourgrad import Device, Tensor  # noqa: E402
from ourgrad.engine.realize import lower_schedule  # noqa: E402
from ourgrad.engine.schedule import create_schedule  # noqa: E402


def per_launch_us(launch: Callable[[], None], sync: Callable[[], None], launches: int) -> tuple[float, float]:
  """(host us per launch, us per launch with the final synchronization) of one round."""
  sync()
  start = time.perf_counter()
  for _ in range(launches): launch()
  host = time.perf_counter() - start
  sync()
  return host / launches * 1e6, (time.perf_counter() - start) / launches * 1e6


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--launches", type=int, default=500)
  parser.add_argument("--rounds", type=int, default=21)
  args = parser.parse_args()
  device = Device["CUDA"]
  x = Tensor([1.0], device="CUDA").realize()
  (item,) = lower_schedule(create_schedule([(x + 1).lazydata]))
  runner, program = item.runner, item.runner.program
  handles = [buffer.handle for buffer in item.bufs]
  raw_handles = getattr(program, "_raw_handles", None)
  print(f"ctypes launch available: {raw_handles is not None}")

  def use_ctypes(on: bool) -> None: program._raw_handles = raw_handles if on else None
  paths: dict[str, tuple[Callable[[], None], Callable[[bool], None] | None]] = {
    "ExecItem.run, ctypes": (item.run, lambda: use_ctypes(True)),
    "ExecItem.run, cuda-python wrapper": (item.run, lambda: use_ctypes(False)),
    "CompiledRunner.__call__, ctypes": (lambda: runner(item.bufs), lambda: use_ctypes(True)),
    "CompiledRunner.__call__, cuda-python wrapper": (lambda: runner(item.bufs), lambda: use_ctypes(False)),
    "CUDAProgram.__call__, ctypes": (lambda: program(*handles, global_size=runner.global_size,
                                                     local_size=runner.local_size), lambda: use_ctypes(True)),
    "CUDAProgram.__call__, cuda-python wrapper": (lambda: program(*handles, global_size=runner.global_size,
                                                                  local_size=runner.local_size),
                                                  lambda: use_ctypes(False)),
  }
  try:
    import torch
    tensor = torch.ones(1, device="cuda")
    paths["PyTorch x.add_(1)"] = (lambda: tensor.add_(1), None)
    torch_sync: Callable[[], None] = torch.cuda.synchronize
  except Exception as error:  # no CUDA torch: the ourgrad rows alone
    print(f"(no PyTorch row: {type(error).__name__}: {error})")
    torch_sync = device.synchronize
  results: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
  for round_index in range(args.rounds + 1):
    for name, (launch, setup) in paths.items():
      if setup is not None: setup()
      sync = torch_sync if name.startswith("PyTorch") else device.synchronize
      timing = per_launch_us(launch, sync, args.launches)
      if round_index: results[name].append(timing)   # round 0 warms up
  use_ctypes(True)
  width = max(len(name) for name in paths)
  print(f"| {'launch of a 1-element kernel'.ljust(width)} | host us | with sync us |")
  print(f"| {'-' * width} | --- | --- |")
  for name, timings in results.items():
    host = statistics.median(timing[0] for timing in timings)
    synced = statistics.median(timing[1] for timing in timings)
    print(f"| {name.ljust(width)} | {host:.2f} | {synced:.2f} |")


if __name__ == "__main__":
  main()
