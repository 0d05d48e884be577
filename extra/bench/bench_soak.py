"""Soak test: train the examples/mnist.py model for many steps and watch memory and step time stay flat.

Every `--every` steps (default 200) it prints: device memory in use (bytes of live ourgrad buffers, from
GlobalCounters.mem_used) and held for reuse by the allocator, the process's resident host memory (RSS), the mean
step time over the window, the number of compiled kernels kept in memory, and the copy-on-write snapshots made
(engine/snapshot.py: none expected, the training step realizes everything it reads). After warm-up every column
but the step count should stay flat: a growing one is a leak.

MNIST comes from ourgrad.nn.datasets (the local cache, then the mirrors); with --synthetic, or when it cannot be
had, random images and labels of MNIST's shapes stand in (the numbers to watch do not depend on the data).

Run: `python extra/bench/bench_soak.py [--steps 2000] [--every 200] [--batch-size 64] [--model small] [--synthetic]
[--no-jit]`
(`--device` or DEVICE=... picks the device; on CUDA the same script measures GPU memory).
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)  # the checkout's ourgrad and examples, from any folder

from examples.mnist import MODELS, ConvNet, batchnorm_buffers, make_jit_train_step, train_step  # noqa: E402
from ourgrad import Device, GlobalCounters, Tensor  # noqa: E402
from ourgrad.engine import realize as realize_module  # noqa: E402
from ourgrad.engine.snapshot import SNAPSHOT_STATS  # noqa: E402
from ourgrad.nn.optim import Adam  # noqa: E402
from ourgrad.nn.state import get_parameters  # noqa: E402


def host_rss_bytes() -> int:
  """The resident set size of this process now (Linux /proc), else its peak (getrusage)."""
  try:
    with open("/proc/self/statm") as statm: return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except OSError:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def load_data(synthetic: bool) -> tuple[np.ndarray, np.ndarray, str]:
  if not synthetic:
    try:
      from ourgrad.nn.datasets import mnist
      x_train, y_train, _, _ = (tensor.numpy() for tensor in mnist())
      return x_train, y_train, "MNIST"
    except Exception as error:  # noqa: BLE001 - any failure to get the data falls back to synthetic data
      print(f"MNIST not available ({type(error).__name__}: {str(error).splitlines()[0][:80]}); synthetic data")
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (8192, 1, 28, 28), dtype=np.uint8)
  return images, rng.integers(0, 10, 8192).astype(np.int32), "synthetic"


def main() -> None:
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--steps", type=int, default=2000)
  parser.add_argument("--every", type=int, default=200, help="print a row every this many steps")
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--model", choices=sorted(MODELS), default="small")
  parser.add_argument("--synthetic", action="store_true", help="random data instead of MNIST")
  parser.add_argument("--device", default=None)
  parser.add_argument("--no-jit", action="store_true", help="run each step eagerly instead of replaying a TinyJit")
  args = parser.parse_args()
  if args.device: os.environ["DEVICE"] = args.device
  images, labels, source = load_data(args.synthetic)
  device = Device.DEFAULT
  Tensor.manual_seed(0)
  model = ConvNet(MODELS[args.model])
  optimizer = Adam([p for p in get_parameters(model) if p.requires_grad], lr=1e-3)
  buffers = batchnorm_buffers(model)
  allocator = Device[device].allocator
  jit_step = None if args.no_jit else make_jit_train_step(model, optimizer, buffers)
  print(f"{args.model} model on {device}, {source} data, batch {args.batch_size}, {args.steps} steps "
        f"({'eager' if jit_step is None else 'TinyJit'}); "
        f"load average {os.getloadavg()[0]:.2f} at start")
  print(f"{'step':>6} {'loss':>7} {'dev MB in use':>13} {'dev MB cached':>13} {'host RSS MB':>11} "
        f"{'ms/step':>8} {'kernels kept':>12} {'snapshots':>9}")
  rng = np.random.default_rng(1)
  window_start, last_printed = time.perf_counter(), 0
  with Tensor.train():
    for step in range(1, args.steps + 1):
      batch = rng.integers(0, len(images), args.batch_size)
      if jit_step is not None: loss, _ = jit_step(images[batch], labels[batch])
      else: loss, _ = train_step(model, optimizer, images[batch], labels[batch], buffers)
      if step % args.every == 0 or step == 1:
        elapsed = time.perf_counter() - window_start
        steps_in_window, last_printed = step - last_printed, step
        gc.collect()  # what is still held after a collection is what leaks
        print(f"{step:>6} {loss:7.3f} {GlobalCounters.mem_used / 1e6:13.2f} {allocator.cached_bytes() / 1e6:13.2f} "
              f"{host_rss_bytes() / 1e6:11.1f} {elapsed / steps_in_window * 1e3:8.1f} "
              f"{len(realize_module._runner_cache):>12} {SNAPSHOT_STATS.snapshots:>9}", flush=True)
        window_start = time.perf_counter()  # the row's own cost (gc, printing) is not a step's
  print(f"load average {os.getloadavg()[0]:.2f} at the end (step 1 includes generating and compiling every kernel)")


if __name__ == "__main__":
  main()
