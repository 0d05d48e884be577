"""Per-kernel device times of one replayed TinyJit training step (the MLP and the examples/mnist.py CNN of
bench_jit.py), for finding which kernels keep a jitted step from its goal.

Run under Nsight Compute on a CUDA machine; only the replay between cuProfilerStart and cuProfilerStop is profiled:
  ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
      python extra/bench/profile_jit_step.py --model mlp
`--model cnn` profiles the CNN step; `--plain-sum-order --no-sibling-reduces` builds it as main did before the
canonical order of index sums and sibling reduces (a side-by-side baseline in one session). Without ncu the script
only runs the steps (a smoke test). The last line lists the megabytes each item reads and writes (each buffer once),
for its GB/s next to ncu's time.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_jit import MLP, load_mnist_example, ourgrad_step  # noqa: E402

import ourgrad.engine.multi_output as multi_output  # noqa: E402
import ourgrad.shape.symbolic as symbolic  # noqa: E402
from ourgrad import Device, Tensor, TinyJit  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--plain-sum-order", action="store_true",
                      help="index sums in the order their terms were added (symbolic.CANONICAL_SUM_ORDER off)")
  parser.add_argument("--no-sibling-reduces", action="store_true",
                      help="every reduce in a kernel of its own (multi_output.SIBLING_REDUCES off)")
  args = parser.parse_args()
  symbolic.CANONICAL_SUM_ORDER = not args.plain_sum_order
  multi_output.SIBLING_REDUCES = not args.no_sibling_reduces
  os.environ["DEVICE"] = args.device
  if args.model == "mlp": make_model, shape, batch = MLP, (784,), 512
  else:
    mnist = load_mnist_example()
    make_model, shape, batch = (lambda: mnist.ConvNet(mnist.MODELS["small"])), (1, 28, 28), 256
  rng = np.random.default_rng(0)
  x = Tensor(rng.standard_normal((batch, *shape)).astype(np.float32), device=args.device).realize()
  y = Tensor(rng.integers(0, 10, batch).astype(np.int32), device=args.device).realize()
  step = TinyJit(ourgrad_step(make_model())[0])
  for _ in range(4): step(x, y)
  Device[args.device].synchronize()
  driver = ctypes.CDLL("libcuda.so.1") if args.device == "CUDA" else None
  if driver is not None: driver.cuProfilerStart()
  step(x, y)
  Device[args.device].synchronize()
  if driver is not None: driver.cuProfilerStop()
  names = [getattr(item.runner, "name", type(item.runner).__name__) for item in step.captured.items]
  print(f"{args.model}: {len(names)} captured items: {' '.join(names)}")
  # bytes each item moves (every buffer it touches, once): with ncu's times, its GB/s and % of copy bandwidth
  print(f"{args.model}: MB per item, launch order: " +
        " ".join(f"{name}:{sum({id(b): b.nbytes for b in item.bufs}.values()) / 1e6:.2f}"
                 for name, item in zip(names, step.captured.items)))


if __name__ == "__main__":
  main()
