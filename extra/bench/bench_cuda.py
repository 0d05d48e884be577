"""CUDA benchmark: the fused elementwise chain against the device's copy bandwidth, matmul, and launch overhead,
each beside PyTorch on the same GPU in the same run.

Method: inputs are realized first; each measurement is the median of `--iters` runs after 3 warm-up runs.
Kernel times come from CUDA events (the same `DEBUG=2` timing the engine uses); end-to-end times include Python
scheduling and launch and synchronize before stopping the clock. PyTorch is timed with torch.cuda events.
Run: `python extra/bench/bench_cuda.py` on a machine with an NVIDIA GPU.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ourgrad import Device, GlobalCounters, Tensor
from ourgrad.engine.realize import get_runner
from ourgrad.engine.schedule import create_schedule


def kernel_seconds(build, iters: int) -> tuple[float, int, int]:
  """Median device time of the kernels that realize `build()`, with the kernel count and bytes moved."""
  times = []
  for _ in range(iters + 3):
    out = build()
    schedule = create_schedule([out.lazydata])
    total, kernels, moved = 0.0, 0, 0
    for item in schedule:
      for buffer in item.outputs: buffer.allocate()
      runner = get_runner("CUDA", item.ast)
      total += runner(item.bufs, wait=True)
      kernels, moved = kernels + 1, moved + runner.byte_count
    times.append(total)
  return statistics.median(times[3:]), kernels, moved


def torch_seconds(function, iters: int) -> float:
  import torch
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  times = []
  for _ in range(iters + 3):
    start.record()
    function()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3)
  return statistics.median(times[3:])


def wall_seconds(function, iters: int) -> float:
  times = []
  for _ in range(iters + 3):
    start = time.perf_counter()
    function()
    times.append(time.perf_counter() - start)
  return statistics.median(times[3:])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--elements", type=int, default=1 << 26)
  parser.add_argument("--matmul", type=int, default=4096)
  args = parser.parse_args()
  import torch
  device = Device["CUDA"]
  print(f"device: {torch.cuda.get_device_name()}  (ourgrad compiles for {device.arch})")
  rows = []

  count = args.elements
  host = [np.random.randn(count).astype(np.float32) for _ in range(3)]
  a, b, c = (Tensor(array, device="CUDA") for array in host)
  ta, tb, tc = (torch.tensor(array, device="cuda") for array in host)
  chain_s, chain_kernels, chain_bytes = kernel_seconds(lambda: ((a + b) * c).exp(), args.iters)
  torch_chain_s = torch_seconds(lambda: ((ta + tb) * tc).exp(), args.iters)
  scratch = torch.empty_like(ta)
  copy_s = torch_seconds(lambda: scratch.copy_(ta), args.iters)
  copy_gbs = 2 * count * 4 / copy_s / 1e9
  rows.append(("elementwise ((a+b)*c).exp()", chain_kernels, chain_bytes / chain_s / 1e9, torch_chain_s / chain_s,
               f"{chain_bytes / chain_s / 1e9 / copy_gbs * 100:.0f}% of copy bandwidth ({copy_gbs:.0f} GB/s)"))

  size = args.matmul
  x_host, y_host = np.random.randn(size, size).astype(np.float32), np.random.randn(size, size).astype(np.float32)
  x, y = Tensor(x_host, device="CUDA"), Tensor(y_host, device="CUDA")
  tx, ty = torch.tensor(x_host, device="cuda"), torch.tensor(y_host, device="cuda")
  torch.backends.cuda.matmul.allow_tf32 = False
  matmul_s, matmul_kernels, _ = kernel_seconds(lambda: x @ y, max(args.iters // 4, 3))
  torch_matmul_s = torch_seconds(lambda: tx @ ty, max(args.iters // 4, 3))
  flops = 2 * size ** 3
  rows.append((f"matmul {size}^3 float32 (no TF32)", matmul_kernels, flops / matmul_s / 1e12, torch_matmul_s / matmul_s,
               f"TFLOP/s; PyTorch {flops / torch_matmul_s / 1e12:.1f} TFLOP/s"))

  one = Tensor(np.ones(1, np.float32), device="CUDA")
  item = create_schedule([(one + 1).lazydata])[0]
  item.outputs[0].allocate()
  runner = get_runner("CUDA", item.ast)
  launches = 1000

  def launch_many() -> None:
    for _ in range(launches): runner(item.bufs)
    device.synchronize()

  launch_us = wall_seconds(launch_many, 5) / launches * 1e6
  t_one = torch.ones(1, device="cuda")

  def torch_launch_many() -> None:
    for _ in range(launches): t_one.add_(1)
    torch.cuda.synchronize()

  torch_launch_us = wall_seconds(torch_launch_many, 5) / launches * 1e6
  realize_us = wall_seconds(lambda: (one + 1).realize() and device.synchronize(), args.iters) * 1e6
  rows.append(("launch of a 1-element kernel", 1, launch_us, torch_launch_us / launch_us,
               f"us per launch; PyTorch {torch_launch_us:.1f} us; full realize() {realize_us:.0f} us"))

  print(f"{'benchmark':<36} {'kernels':>7} {'ourgrad':>10} {'speed vs torch':>15}  note")
  for name, kernels, value, ratio, note in rows:
    print(f"{name:<36} {kernels:>7} {value:>10.2f} {ratio:>14.2f}x  {note}")
  GlobalCounters.reset()


if __name__ == "__main__":
  main()
