"""What autograd and the optimizer step cost in an eager training step (issue 26): per phase of the step, the lazy
nodes built (bases, views) and the thread CPU time, on the bench_eager workloads (mlp, cnn, gpt2).

Phases of a step (ourgrad_step in bench_jit.py, split apart):
  forward   zero_grad and the model's forward + loss (graph building)
  backward  loss.backward()
  optimizer optimizer.schedule_step() (the update expressions, unrealized)
  realize   Tensor.realize_all of the loss, the updates and the statistics
Times are thread CPU time (time.thread_time: waiting for one of a shared machine's cores does not count), the best of
3 runs of `--calls` steps, with every compiled host kernel a no-op. Counts come from a separate counted step.

Run: `python extra/bench/bench_autograd.py --device CLANG --only mlp,cnn`.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_eager import host_kernels_disabled  # noqa: E402
from bench_jit import MLP, load_mnist_example  # noqa: E402

from ourgrad import Device, Tensor  # noqa: E402
from ourgrad import lazy as lazy_module  # noqa: E402
from ourgrad.nn.losses import cross_entropy  # noqa: E402
from ourgrad.nn.optim import Adam  # noqa: E402
from ourgrad.nn.state import get_parameters  # noqa: E402

PHASES = ("forward", "backward", "optimizer", "realize")


class PhasedStep:
  """An Adam training step of `model` on (x, y) whose phases (PHASES) can be run and timed one by one."""

  def __init__(self, model: Any, x: Tensor, y: Tensor):
    self.model, self.x, self.y = model, x, y
    self.trainable = [tensor for tensor in get_parameters(model) if tensor.requires_grad]
    self.stats = [tensor for tensor in get_parameters(model) if not tensor.requires_grad]
    self.optimizer = Adam(self.trainable, lr=1e-3)
    self.loss: Tensor | None = None
    self.updates: list[Tensor] = []

  def run(self, phase: str) -> None:
    with Tensor.train():
      if phase == "forward":
        self.optimizer.zero_grad()
        self.loss = cross_entropy(self.model(self.x), self.y)
      elif phase == "backward": self.loss.backward()
      elif phase == "optimizer": self.updates = self.optimizer.schedule_step()
      else: Tensor.realize_all(self.loss, *self.updates, *self.stats)

  def step(self) -> None:
    for phase in PHASES: self.run(phase)


def count_nodes(step: PhasedStep) -> dict[str, tuple[int, int]]:
  """(bases, views) built in each phase of one step."""
  counts = {"base": 0, "view": 0}
  init_base, init_view = lazy_module._init_base, lazy_module._init_view

  def counted_base(*args: Any) -> None:
    counts["base"] += 1
    init_base(*args)

  def counted_view(*args: Any) -> None:
    counts["view"] += 1
    init_view(*args)
  result = {}
  lazy_module._init_base, lazy_module._init_view = counted_base, counted_view
  try:
    for phase in PHASES:
      counts["base"] = counts["view"] = 0
      step.run(phase)
      result[phase] = (counts["base"], counts["view"])
  finally:
    lazy_module._init_base, lazy_module._init_view = init_base, init_view
  return result


def phase_times(step: PhasedStep, calls: int, sync: Callable[[], None]) -> dict[str, float]:
  """Thread CPU seconds per call of each phase: the best of 3 runs of `calls` steps."""
  best = dict.fromkeys(PHASES, float("inf"))
  for _ in range(3):
    spent = dict.fromkeys(PHASES, 0.0)
    for _ in range(calls):
      for phase in PHASES:
        start = time.thread_time()
        step.run(phase)
        spent[phase] += time.thread_time() - start
      sync()
    for phase in PHASES: best[phase] = min(best[phase], spent[phase] / calls)
  return best


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default=Device.DEFAULT)
  parser.add_argument("--only", default="mlp,cnn")
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--calls", type=int, default=20)
  args = parser.parse_args()
  device = Device.canonicalize(args.device)
  os.environ["DEVICE"] = device
  mnist = load_mnist_example()
  models = {"mlp": (MLP, (784,)), "cnn": (lambda: mnist.ConvNet(mnist.MODELS["small"]), (1, 28, 28))}
  sync = Device[device].synchronize
  print(f"device: {device}, batch {args.batch}")
  for name in args.only.split(","):
    make_model, shape = models[name]
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((args.batch, *shape)).astype(np.float32), device=device).realize()
    y = Tensor(rng.integers(0, 10, args.batch).astype(np.int32), device=device).realize()
    step = PhasedStep(make_model(), x, y)
    for _ in range(3): step.step()   # compile, fill the schedule cache
    sync()
    counts = count_nodes(step)
    with host_kernels_disabled(device != "CUDA"):
      times = phase_times(step, args.calls, sync)
    print(f"## {name}")
    print("| phase     | bases | views | thread CPU us |")
    for phase in PHASES:
      print(f"| {phase:9} | {counts[phase][0]:5} | {counts[phase][1]:5} | {times[phase] * 1e6:13.1f} |")


if __name__ == "__main__":
  main()
