"""What autograd and the optimizer step cost in an eager training step (issue 26): per phase of the step, the lazy
nodes built (bases, views) and the thread CPU time, on bench_eager's workloads mlp, cnn and gpt2.

Phases of a step (ourgrad_step in bench_jit.py, split apart):
  forward   zero_grad and the model's forward + loss (graph building)
  backward  loss.backward()
  optimizer optimizer.schedule_step() (the update expressions, unrealized)
  realize   Tensor.realize_all of the loss, the updates and the statistics
Python calls: cProfile's count of function calls in one step's phase; bytecodes: the bytecode instructions the
phase's Python frames executed (sys.settrace's opcode events). Both are deterministic: compare runs by them on a
loaded machine. Times are thread CPU time (time.thread_time: waiting for one of a shared machine's cores does not
count), the best of 3 runs of `--calls` steps, with every compiled host kernel a no-op. Counts come from separate
counted steps.

Run: `python extra/bench/bench_autograd.py --device CLANG --only mlp,cnn`.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pathlib
import pstats
import sys
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_eager import gpt2_model_and_batch, host_kernels_disabled  # noqa: E402
from bench_jit import MLP, load_mnist_example  # noqa: E402

from ourgrad import Device, Tensor  # noqa: E402
from ourgrad.lazy import LazyBuffer  # noqa: E402
from ourgrad.nn.losses import cross_entropy  # noqa: E402
from ourgrad.nn.optim import Adam  # noqa: E402
from ourgrad.nn.state import get_parameters  # noqa: E402

PHASES = ("forward", "backward", "optimizer", "realize")


class PhasedStep:
  """A training step whose phases (PHASES) can be run and timed one by one: `loss()` builds the forward and the loss,
  then backward, every optimizer's schedule_step, and one realize of the loss, the updates and `stats`."""

  def __init__(self, loss: Callable[[], Tensor], optimizers: list[Any], stats: list[Tensor]):
    self.make_loss, self.optimizers, self.stats = loss, optimizers, stats
    self.loss: Tensor | None = None
    self.updates: list[Tensor] = []

  @staticmethod
  def classifier(model: Any, x: Tensor, y: Tensor) -> PhasedStep:
    """An Adam step of an image classifier `model` on (x, y) with a cross-entropy loss (bench_jit's ourgrad_step)."""
    trainable = [tensor for tensor in get_parameters(model) if tensor.requires_grad]
    stats = [tensor for tensor in get_parameters(model) if not tensor.requires_grad]
    return PhasedStep(lambda: cross_entropy(model(x), y), [Adam(trainable, lr=1e-3)], stats)

  def run(self, phase: str) -> None:
    with Tensor.train():
      if phase == "forward":
        for optimizer in self.optimizers: optimizer.zero_grad()
        self.loss = self.make_loss()
      elif phase == "backward": self.loss.backward()
      elif phase == "optimizer":
        self.updates = [tensor for optimizer in self.optimizers for tensor in optimizer.schedule_step()]
      else: Tensor.realize_all(self.loss, *self.updates, *self.stats)

  def step(self) -> None:
    for phase in PHASES: self.run(phase)


def gpt2_step(device: str) -> PhasedStep:
  """bench_eager's gpt2 workload: 2 layers of GPT-2 small, batch 8 x 512 on CUDA, the tiny config elsewhere."""
  from extra.models.gpt2 import configure_optimizers
  model, inputs, targets = gpt2_model_and_batch(device)
  return PhasedStep(lambda: model(inputs, targets)[1], configure_optimizers(model), [])


def count_nodes(step: PhasedStep) -> dict[str, tuple[int, int]]:
  """(bases, views) built in each phase of one step."""
  counts = {"base": 0, "view": 0}
  create_base, view = LazyBuffer.create_base, LazyBuffer.view

  def counted_base(*args: Any, **kwargs: Any) -> LazyBuffer:
    counts["base"] += 1
    return create_base(*args, **kwargs)

  def counted_view(self: LazyBuffer, st: Any) -> LazyBuffer:
    out = view(self, st)
    if out._base is not None: counts["view"] += 1   # (a new view; the identity view is the base itself)
    return out
  result = {}
  LazyBuffer.create_base, LazyBuffer.view = staticmethod(counted_base), counted_view  # type: ignore[method-assign]
  try:
    for phase in PHASES:
      counts["base"] = counts["view"] = 0
      step.run(phase)
      result[phase] = (counts["base"], counts["view"])
  finally:
    LazyBuffer.create_base, LazyBuffer.view = staticmethod(create_base), view  # type: ignore[method-assign]
  return result


def count_calls(step: PhasedStep) -> dict[str, int]:
  """Python function calls (cProfile's count, builtins included) in each phase of one step: a measure of the Python
  work that a loaded machine does not move."""
  result = {}
  for phase in PHASES:
    profile = cProfile.Profile()
    profile.enable()
    step.run(phase)
    profile.disable()
    result[phase] = pstats.Stats(profile).total_calls   # type: ignore[attr-defined]
  return result


def bytecodes(call: Callable[[], Any], counted: Callable[[Any], bool] | None = None) -> int:
  """Bytecode instructions Python frames execute in `call()` (C code counts nothing); with `counted`, only those
  where `counted(frame)` holds (the frame at the instruction about to run: `f_code`, `f_lasti`)."""
  count = [0]

  def local(frame: Any, event: str, arg: Any) -> Any:
    if event == "opcode" and (counted is None or counted(frame)): count[0] += 1
    return local

  def start(frame: Any, event: str, arg: Any) -> Any:
    frame.f_trace_opcodes = True
    return local
  previous = sys.gettrace()   # a debugger's or coverage's tracer comes back afterwards
  sys.settrace(start)
  try:
    call()
  finally:
    sys.settrace(previous)
  return count[0]


def count_bytecodes(step: PhasedStep) -> dict[str, int]:
  """Bytecode instructions executed by Python frames in each phase of one step (C code counts nothing)."""
  return {phase: bytecodes(lambda phase=phase: step.run(phase)) for phase in PHASES}


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
    if name == "gpt2": step = gpt2_step(device)
    else:
      make_model, shape = models[name]
      rng = np.random.default_rng(0)
      x = Tensor(rng.standard_normal((args.batch, *shape)).astype(np.float32), device=device).realize()
      y = Tensor(rng.integers(0, 10, args.batch).astype(np.int32), device=device).realize()
      step = PhasedStep.classifier(make_model(), x, y)
    for _ in range(3): step.step()   # compile, fill the schedule cache
    sync()
    counts, calls, bytecodes = count_nodes(step), count_calls(step), count_bytecodes(step)
    with host_kernels_disabled(device != "CUDA"):
      times = phase_times(step, args.calls, sync)
    print(f"## {name}")
    print("| phase     | bases | views | Python calls | bytecodes | thread CPU us |")
    for phase in PHASES:
      print(f"| {phase:9} | {counts[phase][0]:5} | {counts[phase][1]:5} | {calls[phase]:12} | {bytecodes[phase]:9} | "
            f"{times[phase] * 1e6:13.1f} |")
    bases, views = (sum(count[kind] for count in counts.values()) for kind in (0, 1))
    print(f"| total     | {bases:5} | {views:5} | {sum(calls.values()):12} | {sum(bytecodes.values()):9} | "
          f"{sum(times.values()) * 1e6:13.1f} |")


if __name__ == "__main__":
  main()
