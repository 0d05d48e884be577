"""Where one small realize's host time goes, measured without a profiler (issue 26): bench_eager's op1
(`(x + 1).realize()`, 1 element) and expr8 (8 elementwise ops on 2^20 floats, 2^10 on CPU devices) repeated, each
call split by the clock into: building the graph, scheduling it (schedule_cache.schedule: the creation trace's key,
the lookup, the replay), running it (realize.run_schedule: the launch) and dropping it (the last reference to the
result: its buffer goes back to the allocator). Where the schedule cache launches a one-kernel replay itself
(realize.launch_one, passed as Tensor.realize passes it), that launch is in "schedule". Beside them, the same call
through Tensor.realize whole (its lock, its reads of the settings), and the loop's mean time per call (wall; the
thread's CPU time on CPU devices).
Percentiles (p10, p50) over `--calls` calls, in microseconds; cProfile's per-call overhead would inflate the many small
functions of a realize.

On CPU devices every compiled kernel is replaced by a no-op (bench_eager.host_kernels_disabled): host time only.
Run: `python extra/bench/probe_realize_parts.py [--device CUDA] [--calls 20000]`; works on any tree with
schedule_cache.schedule and realize.run_schedule (for A/B runs beside main).
"""
from __future__ import annotations

import argparse
import gc
import pathlib
import sys
import time
from typing import Any, Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_eager import expr8, host_kernels_disabled  # noqa: E402

from ourgrad import Device, Tensor  # noqa: E402
from ourgrad.engine import realize as engine_realize  # noqa: E402
from ourgrad.engine import schedule_cache  # noqa: E402
from ourgrad.tensor import REALIZE_LOCK  # noqa: E402

PARTS = ("build", "schedule", "run", "drop", "realize()", "wall/call")


def measure(make: Callable[[], Tensor], calls: int, sync: Callable[[], None], host: bool) -> dict[str, list[int]]:
  """Nanoseconds of each part of `calls` realizes of `make()`, and of `calls` whole ones (Tensor.realize); `host`: the
  loop's mean by the thread's CPU time (a shared machine's other processes take the cores away)."""
  clock = time.perf_counter_ns
  times: dict[str, list[int]] = {part: [] for part in PARTS}
  # a tree whose schedule cache launches a one-kernel replay itself (realize.launch_one) is measured as Tensor.realize
  # calls it: its launch is then part of "schedule", and "run" is run_schedule's return
  launch_one = getattr(engine_realize, "launch_one", None)
  scheduled_by = (lambda outs: schedule_cache.schedule(outs, launch_one)) if launch_one is not None else \
      schedule_cache.schedule
  for _ in range(calls):
    start = clock()
    out = make()
    built = clock()
    with REALIZE_LOCK:
      schedule = scheduled_by([out.lazydata])
      scheduled = clock()
      engine_realize.run_schedule(schedule)
      ran = clock()
    del schedule, out
    dropped = clock()
    times["build"].append(built - start)
    times["schedule"].append(scheduled - built)
    times["run"].append(ran - scheduled)
    times["drop"].append(dropped - ran)
    out = make()
    start = clock()
    out.realize()
    times["realize()"].append(clock() - start)
    del out
  sync()
  loop_clock = time.thread_time_ns if host else clock
  start = loop_clock()
  for _ in range(calls): make().realize()
  sync()
  times["wall/call"].append((loop_clock() - start) // calls)
  return times


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default=Device.DEFAULT)
  parser.add_argument("--calls", type=int, default=20000)
  args = parser.parse_args()
  device = Device.canonicalize(args.device)
  x = Tensor([1.0], device=device).realize()
  y = Tensor.rand(1 << (20 if device == "CUDA" else 10), device=device).realize()
  workloads: dict[str, Callable[[], Any]] = {"op1": lambda: x + 1, "expr8": lambda: expr8(y, 1.25)}
  sync = Device[device].synchronize
  print(f"device: {device}, {args.calls} calls; us per call, p10 / p50")
  for name, make in workloads.items():
    for _ in range(5): make().realize()   # compiled, cached, captured
    sync()
    with host_kernels_disabled(device != "CUDA"):
      gc.disable()
      try:
        times = measure(make, args.calls, sync, device != "CUDA")
      finally:
        gc.enable()
    row = []
    for part in PARTS:
      values = sorted(times[part])
      row.append(f"{part} {values[len(values) // 10] / 1e3:.2f} / {values[len(values) // 2] / 1e3:.2f}")
    print(f"{name}: " + " | ".join(row))


if __name__ == "__main__":
  main()
