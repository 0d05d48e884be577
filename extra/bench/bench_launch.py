"""Launch cost of a 1-element kernel on CUDA at each layer of the engine, beside PyTorch's `x.add_(1)`:
  ExecItem.run                  the fast path: the item calls its positional launcher with its buffers
  ExecItem.run, general path    what every launch cost before the fast path (and what a launch with DEBUG or PROFILE
                                set, a first launch, or one on new buffers costs now)
  bound launcher                the item's launcher alone (CUDAProgram.positional_launcher): its argument slots
                                checked against the buffers, then cuLaunchKernel with every argument bound
  CompiledRunner.__call__, CUDAProgram.__call__   the layers below the general path
  ..., driver call a no-op      the same with cuLaunchKernel replaced by a no-op: the Python part of each row

Method: rounds alternate between the rows; a round times `--launches` launches from the host (the "host" column:
the time until the last call returns, so the launch queue never fills: the device is synchronized before each
round, outside the timing) and then the same launches with the synchronization included ("with sync"). Medians
over `--rounds` rounds, in microseconds per launch.
`--diagnose` times the launch by bench_jit.py's method instead (the mean of 2000 launches, right after the device
opened) in several conditions, with percentiles of single launches.

Where the time goes (H100 host, host us per launch; run 1 / run 2 of this session, each one run): the bound launcher
(cuda-python's wrapper + libcuda's cuLaunchKernel) 4.36 / 3.98, of which Python 0.15 / 0.14; ExecItem.run's fast
path 5.99 / 5.57 (Python 1.33 / 0.88: the checks, the handle comparison, the counters); the general path 10.26 / 8.29
(Python 4.33 / 3.34); PyTorch x.add_(1) 8.89 / 7.42. The bound launch on a non-blocking, the legacy or the per-thread
default stream: 4.2-4.6, no gain. On the 2-core CPU without a GPU (driver call a no-op, min of 7 x 100k): main's
ExecItem.run 2.07, CompiledRunner.__call__ 1.90, CUDAProgram.__call__ 1.07; the fast path 0.53, its launcher 0.08;
cuda-python's wrapper over a stub libcuda whose cuLaunchKernel returns at once: 0.30.
bench_jit's method vs this one (run 2, `--diagnose`): the mean of 2000 launches right after the device opened 6.31
(PyTorch 10.28), the median of four means of 500 6.01; single launches p50/p90/p99/max 6.07/7.20/11.41/22.24 (no
stalls); with gc off 6.19, after PyTorch's launches 6.34; the NVRTC warm-up thread had finished. The methods agree;
their rows differ between commands of one run by the host's noise (bench_jit's row: 8.0 vs PyTorch 8.1 in run 1,
4.9 vs 8.8 with `--only launch` and 7.3 vs 9.2 in the full bench in run 2).
Measured on the H100 (one run): calling libcuda's cuLaunchKernel through ctypes with pre-bound ctypes arguments was
0.75-0.8 us slower per launch than cuda-python's wrapper at every layer (CUDAProgram 6.19 vs 5.37 us, ExecItem.run
8.21 vs 7.47, PyTorch 6.94), so the wrapper stays the launch path.
Run: `python extra/bench/bench_launch.py` on a CUDA machine.
"""
from __future__ import annotations

import argparse
import gc
import pathlib
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad, not an installed one
from ourgrad import Device, Tensor  # noqa: E402
from ourgrad.engine.exec_item import ExecItem  # noqa: E402
from ourgrad.engine.realize import lower_schedule  # noqa: E402
from ourgrad.engine.schedule import create_schedule  # noqa: E402
from ourgrad.runtime import ops_cuda  # noqa: E402


def per_launch_us(launch: Callable[[], None], sync: Callable[[], None], launches: int) -> tuple[float, float]:
  """(host us per launch, us per launch with the final synchronization) of one round."""
  sync()
  start = time.perf_counter()
  for _ in range(launches): launch()
  host = time.perf_counter() - start
  sync()
  return host / launches * 1e6, (time.perf_counter() - start) / launches * 1e6


def python_only_rows(item: ExecItem, rounds: int, launches: int) -> dict[str, float]:
  """Median host us per launch of each layer with cuLaunchKernel replaced by a no-op: the Python part alone (a copy
  of `item` binds its launcher while the no-op is in place, so that launcher calls the no-op too)."""
  def no_op_launch(*args: object) -> tuple:
    return (ops_cuda.CUDA_SUCCESS,)
  real_launch = ops_cuda.driver.cuLaunchKernel
  ops_cuda.driver.cuLaunchKernel = no_op_launch
  try:
    copy = ExecItem(item.runner, item.bufs, device=item.device)
    for _ in range(2): copy.run()
    runner, program = copy.runner, copy.runner.program
    handles = [buffer.handle for buffer in copy.bufs]
    paths: dict[str, Callable[[], None]] = {
      "ExecItem.run": copy.run, "ExecItem.run, general path": lambda: copy._run_general(False),
      "bound launcher": lambda: copy._launch(copy.bufs), "CompiledRunner.__call__": lambda: runner(copy.bufs),
      "CUDAProgram.__call__": lambda: program(*handles, global_size=runner.global_size, local_size=runner.local_size)}
    results: dict[str, list[float]] = {name: [] for name in paths}
    for round_index in range(rounds + 1):
      for name, launch in paths.items():
        timing = per_launch_us(launch, lambda: None, launches)[0]
        if round_index: results[name].append(timing)
  finally:
    ops_cuda.driver.cuLaunchKernel = real_launch
  return {f"{name}, driver call a no-op": statistics.median(timings) for name, timings in results.items()}


def mean_us(launch: Callable[[], None], sync: Callable[[], None], launches: int = 2000) -> float:
  """bench_jit.py's method: the mean over `launches` launches after 10, synchronized at the end."""
  for _ in range(10): launch()
  sync()
  start = time.perf_counter()
  for _ in range(launches): launch()
  sync()
  return (time.perf_counter() - start) / launches * 1e6


def percentiles_us(launch: Callable[[], None], sync: Callable[[], None], launches: int = 2000) -> str:
  """p50/p90/p99/max of the host time of each of `launches` launches (each timed on its own)."""
  sync()
  times = []
  for _ in range(launches):
    start = time.perf_counter()
    launch()
    times.append((time.perf_counter() - start) * 1e6)
  sync()
  times.sort()
  return " / ".join(f"{times[int(q * (len(times) - 1))]:.2f}" for q in (0.5, 0.9, 0.99, 1.0))


def diagnose(item: ExecItem, device: Any) -> None:
  """Why bench_jit's launch row (a mean right after the device opened) differs from this bench's medians: the same
  launches timed by bench_jit's method in several conditions (see `--diagnose`)."""
  rows: list[tuple[str, str]] = []
  sync = device.synchronize
  warm_up_alive = any(thread.is_alive() for thread in ops_cuda._WARM_UPS)
  rows.append((f"ExecItem.run, mean of 2000, right after the device opened (NVRTC warm-up thread alive: "
               f"{warm_up_alive})", f"{mean_us(item.run, sync):.2f}"))
  rows.append(("ExecItem.run, p50 / p90 / p99 / max of single launches", percentiles_us(item.run, sync)))
  ops_cuda._finish_warm_ups()
  rows.append(("ExecItem.run, mean of 2000, warm-up thread joined", f"{mean_us(item.run, sync):.2f}"))
  rows.append(("bound launcher, mean of 2000", f"{mean_us(lambda: item._launch(item.bufs), sync):.2f}"))
  gc.disable()
  rows.append(("ExecItem.run, mean of 2000, gc disabled", f"{mean_us(item.run, sync):.2f}"))
  gc.enable()
  rows.append(("ExecItem.run, mean of 500 (4 times, median)",
               f"{statistics.median(mean_us(item.run, sync, 500) for _ in range(4)):.2f}"))
  try:
    import torch
    tensor = torch.ones(1, device="cuda")
    rows.append(("PyTorch x.add_(1), mean of 2000", f"{mean_us(lambda: tensor.add_(1), torch.cuda.synchronize):.2f}"))
    rows.append(("PyTorch x.add_(1), p50 / p90 / p99 / max",
                 percentiles_us(lambda: tensor.add_(1), torch.cuda.synchronize)))
    rows.append(("ExecItem.run, mean of 2000, after PyTorch's launches", f"{mean_us(item.run, sync):.2f}"))
    rows.append(("ExecItem.run, p50 / p90 / p99 / max, after PyTorch's", percentiles_us(item.run, sync)))
  except Exception as error:  # no CUDA torch
    rows.append(("PyTorch", f"{type(error).__name__}: {error}"))
  width = max(len(label) for label, _ in rows)
  print(f"| {'1-element kernel, bench_jit method'.ljust(width)} | us per launch |\n| {'-' * width} | --- |")
  for label, value in rows: print(f"| {label.ljust(width)} | {value} |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--launches", type=int, default=500)
  parser.add_argument("--rounds", type=int, default=21)
  parser.add_argument("--diagnose", action="store_true",
                      help="only bench_jit's method (mean of 2000 launches) in several conditions, right after the "
                           "device opened, with percentiles of single launches")
  args = parser.parse_args()
  device = Device["CUDA"]
  x = Tensor([1.0], device="CUDA").realize()
  (item,) = lower_schedule(create_schedule([(x + 1).lazydata]))
  if args.diagnose:
    diagnose(item, device)
    return
  for _ in range(2): item.run()   # the item takes its launcher at its first launch
  runner, program, launcher = item.runner, item.runner.program, item._launch
  assert launcher is not None, "the ExecItem did not bind a launcher (is DEBUG or PROFILE set?)"
  handles = [buffer.handle for buffer in item.bufs]
  paths: dict[str, Callable[[], None]] = {
    "ExecItem.run": item.run,
    "ExecItem.run, general path": lambda: item._run_general(False),   # a launch before the fast path existed
    "bound launcher": lambda: launcher(item.bufs),
    "CompiledRunner.__call__": lambda: runner(item.bufs),
    "CUDAProgram.__call__": lambda: program(*handles, global_size=runner.global_size, local_size=runner.local_size),
  }
  # experiments: the same bound launch on other streams (ourgrad's is a blocking stream made with cuStreamCreate(0))
  non_blocking = ops_cuda.check(ops_cuda.driver.cuStreamCreate(ops_cuda.driver.CUstream_flags.CU_STREAM_NON_BLOCKING),
                                "cuStreamCreate")
  for label, stream in (("non-blocking stream", non_blocking), ("legacy default stream", ops_cuda.driver.CUstream(0)),
                        ("per-thread default stream", ops_cuda.driver.CUstream(ops_cuda.driver.CU_STREAM_PER_THREAD))):
    paths[f"experiment: bound launcher, {label}"] = program.bind(handles, runner.global_size, runner.local_size, stream)
  try:
    import torch
    tensor = torch.ones(1, device="cuda")
    paths["PyTorch x.add_(1)"] = lambda: tensor.add_(1)
    torch_sync: Callable[[], None] = torch.cuda.synchronize
  except Exception as error:  # no CUDA torch: the ourgrad rows alone
    print(f"(no PyTorch row: {type(error).__name__}: {error})")
    torch_sync = device.synchronize
  def context_sync() -> None: ops_cuda.check(ops_cuda.driver.cuCtxSynchronize(), "cuCtxSynchronize")
  results: dict[str, list[tuple[float, float]]] = {name: [] for name in paths}
  for round_index in range(args.rounds + 1):
    for name, launch in paths.items():
      sync = torch_sync if name.startswith("PyTorch") else context_sync if name.startswith("experiment") else \
        device.synchronize
      timing = per_launch_us(launch, sync, args.launches)
      if round_index: results[name].append(timing)   # round 0 warms up
  width = max(len("launch of a 1-element kernel"), *(len(name) for name in paths), 50)
  print(f"| {'launch of a 1-element kernel'.ljust(width)} | host us | with sync us |")
  print(f"| {'-' * width} | --- | --- |")
  for name, timings in results.items():
    host = statistics.median(timing[0] for timing in timings)
    synced = statistics.median(timing[1] for timing in timings)
    print(f"| {name.ljust(width)} | {host:.2f} | {synced:.2f} |")
  for name, host in python_only_rows(item, args.rounds, args.launches).items():
    print(f"| {name.ljust(width)} | {host:.2f} | - |")


if __name__ == "__main__":
  main()
