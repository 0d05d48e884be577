"""Python per eager `examples/mnist.py` step (issue 26's CPU row): the example's own `train_step` (the batch uploaded
from numpy, normalize, forward, cross-entropy, accuracy, backward, Adam, one realize, the two `.item()` reads), run
eagerly on a host device with every compiled kernel a no-op, so what is measured is the Python of a step.

Printed: thread CPU time per step (time.thread_time: waiting for one of a shared machine's cores does not count), the
best of `--rounds` runs of `--steps` steps, and the bytecodes one step executes (sys.settrace's opcode events:
deterministic, comparable across runs of a loaded machine).

Run: `python extra/bench/bench_mnist_step.py` (CLANG, batch 256, the small model: the example's defaults).
"""
from __future__ import annotations

import argparse
import gc
import os
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_autograd import bytecodes  # noqa: E402
from bench_eager import host_kernels_disabled  # noqa: E402
from bench_jit import load_mnist_example  # noqa: E402

from ourgrad import Device, Tensor  # noqa: E402
from ourgrad.nn.optim import Adam  # noqa: E402
from ourgrad.nn.state import get_parameters  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default="CLANG")
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--model", default="small")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args()
  device = Device.canonicalize(args.device)
  os.environ["DEVICE"] = device
  mnist = load_mnist_example()
  model = mnist.ConvNet(mnist.MODELS[args.model])
  optimizer = Adam([tensor for tensor in get_parameters(model) if tensor.requires_grad], lr=2e-3)
  buffers = mnist.batchnorm_buffers(model)
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, (args.batch, 1, 28, 28), dtype=np.uint8)
  labels = rng.integers(0, 10, args.batch).astype(np.int32)

  def step() -> None:
    with Tensor.train(): mnist.train_step(model, optimizer, images, labels, buffers)
  for _ in range(3): step()   # compile, fill the schedule cache
  gc.collect()
  with host_kernels_disabled(True):
    best = float("inf")
    for _ in range(args.rounds):
      start = time.thread_time()
      for _ in range(args.steps): step()
      best = min(best, (time.thread_time() - start) / args.steps)
    counted = bytecodes(step)
  print(f"examples/mnist.py train_step on {device}, batch {args.batch}, model {args.model}, no-op kernels: "
        f"{best * 1e3:.3f} ms thread CPU per step (best of {args.rounds} x {args.steps}), {counted} bytecodes a step")


if __name__ == "__main__":
  main()
