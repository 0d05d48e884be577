"""Python per eager `examples/mnist.py` step (issue 26's CPU row): the example's own `train_step` (the batch uploaded
from numpy, normalize, forward, cross-entropy, accuracy, backward, Adam, one realize, the two `.item()` reads), run
eagerly on a host device with every compiled kernel a no-op, so what is measured is the Python of a step.

Printed: thread CPU time per step (time.thread_time: waiting for one of a shared machine's cores does not count), the
best of `--rounds` runs of `--steps` steps, and the bytecodes one step executes (sys.settrace's opcode events:
deterministic, comparable across runs of a loaded machine).

With `--parts`, also the bytecodes of each line of `train_step` (the upload, zero_grad, the forward, the loss, the
accuracy, backward, the optimizer's updates with the realize, the two reads): each opcode counted for the line the
step was on when it ran (deterministic: compare a change's parts with the base tree's).

Run: `python extra/bench/bench_mnist_step.py` (CLANG, batch 256, the small model: the example's defaults).
"""
from __future__ import annotations

import argparse
import collections
import gc
import inspect
import os
import pathlib
import sys
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_autograd import bytecodes  # noqa: E402
from bench_eager import host_kernels_disabled  # noqa: E402
from bench_jit import load_mnist_example  # noqa: E402

from ourgrad import Device, Tensor  # noqa: E402
from ourgrad.nn.optim import Adam  # noqa: E402
from ourgrad.nn.state import get_parameters  # noqa: E402


def bytecodes_by_line(call: Callable[[], Any], function: Callable[..., Any]) -> dict[int, int]:
  """Bytecodes `call()` executes, by the line of `function` (a function it calls once) that was running: each opcode
  counts for the line `function`'s frame was last seen on (before its first line: key 0)."""
  code, counts, line = function.__code__, collections.Counter(), [0]

  def note(frame: Any) -> bool:
    if frame.f_code is code: line[0] = frame.f_lineno
    counts[line[0]] += 1
    return True
  bytecodes(call, note)
  return dict(counts)


def print_parts(counts: dict[int, int], function: Callable[..., Any]) -> None:
  """The per-line counts of `bytecodes_by_line` with each line's source."""
  lines, first = inspect.getsourcelines(function)
  print("| bytecodes | line of train_step |")
  for number, count in sorted(counts.items()):
    text = lines[number - first].strip() if number >= first else "(before the step's first line)"
    print(f"| {count:9} | {text[:100]} |")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default="CLANG")
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--model", default="small")
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--parts", action="store_true", help="also the bytecodes of each line of train_step")
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
    parts = bytecodes_by_line(step, mnist.train_step) if args.parts else None
  print(f"examples/mnist.py train_step on {device}, batch {args.batch}, model {args.model}, no-op kernels: "
        f"{best * 1e3:.3f} ms thread CPU per step (best of {args.rounds} x {args.steps}), {counted} bytecodes a step")
  if parts is not None: print_parts(parts, mnist.train_step)


if __name__ == "__main__":
  main()
