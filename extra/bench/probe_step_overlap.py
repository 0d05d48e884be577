"""Where an eager GPT-2 training step's wall time goes, with and without OVERLAP_BACKWARD (issue 26): the host time
to build the forward, the backward and the optimizer's graph and to realize, the wait for the device after the last
realize, and a loop of steps timed as bench_eager.py times it, beside the same step under TinyJit. OVERLAP_BACKWARD is
read at each backward(), so both settings run in one process, alternated.

Run: `python extra/bench/probe_step_overlap.py [--device CUDA] [--steps 5,20] [--rounds 3]`.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_eager import gpt2_model_and_batch  # noqa: E402

from extra.models.gpt2 import configure_optimizers  # noqa: E402
from ourgrad import Device, Tensor, TinyJit  # noqa: E402
from ourgrad.engine import realize as engine_realize  # noqa: E402
from ourgrad.engine import schedule_cache  # noqa: E402


def make_step(model: Any, optimizers: list[Any], marks: list[float] | None = None) -> Any:
  """extra/models/gpt2.training_step with host clock marks (forward built, backward built, optimizer built)."""
  def step(tokens: Tensor, targets: Tensor) -> Tensor:
    with Tensor.train():
      for optimizer in optimizers: optimizer.zero_grad()
      loss = model(tokens, targets)[1]
      if marks is not None: marks.append(time.perf_counter())
      loss.backward()
      if marks is not None: marks.append(time.perf_counter())
      updates = [tensor for optimizer in optimizers for tensor in optimizer.schedule_step()]
      if marks is not None: marks.append(time.perf_counter())
      Tensor.realize_all(loss, *updates)
    return loss
  return step


def one_step_split(step: Any, marks: list[float], inputs: Tensor, targets: Tensor, sync: Any) -> list[float]:
  """ms of one step from an idle device: forward graph, backward graph (with the loss's realize when it overlaps),
  optimizer graph, the last realize, then the wait for the device."""
  sync()
  marks.clear()
  start = time.perf_counter()
  step(inputs, targets)
  returned = time.perf_counter()
  sync()
  done = time.perf_counter()
  points = [start, *marks, returned, done]
  return [(b - a) * 1e3 for a, b in zip(points, points[1:])]


def loop_ms(step: Any, inputs: Tensor, targets: Tensor, sync: Any, calls: int) -> float:
  sync()
  start = time.perf_counter()
  for _ in range(calls): step(inputs, targets)
  sync()
  return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--steps", default="5,20", help="loop lengths timed (steps, synchronized at the end only)")
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  device = Device.canonicalize(args.device)
  os.environ["DEVICE"] = device
  sync = Device[device].synchronize
  model, inputs, targets = gpt2_model_and_batch(device)
  optimizers = configure_optimizers(model)
  marks: list[float] = []
  step = make_step(model, optimizers, marks)
  # "overlap": every backward on a device that queues its kernels realizes its loss first (the mechanism, whatever
  # the default bound says of this graph); "default": the library's setting
  settings = {"joint": "0", "overlap": "1", "default": os.environ.get("OVERLAP_BACKWARD", "")}
  def use(setting: str) -> None:
    if setting: os.environ["OVERLAP_BACKWARD"] = setting
    else: os.environ.pop("OVERLAP_BACKWARD", None)
  for setting in settings.values():   # compile both schedules, fill the caches, capture
    use(setting)
    for _ in range(4): step(inputs, targets)
  loops = [int(n) for n in args.steps.split(",")]
  splits: dict[str, list[list[float]]] = {name: [] for name in settings}
  walls: dict[tuple[str, int], list[float]] = {(name, n): [] for name in settings for n in loops}
  realizes: dict[str, int] = {}
  for _ in range(args.rounds):
    for name, setting in settings.items():
      use(setting)
      before = schedule_cache.stats.hits + schedule_cache.stats.misses
      splits[name].append(one_step_split(step, marks, inputs, targets, sync))
      realizes[name] = schedule_cache.stats.hits + schedule_cache.stats.misses - before
      for n in loops: walls[(name, n)].append(loop_ms(step, inputs, targets, sync, n))
  use(settings["default"])
  jitted = TinyJit(make_step(model, optimizers))
  for _ in range(3): jitted(inputs, targets)
  jit = min(loop_ms(jitted, inputs, targets, sync, max(loops)) for _ in range(args.rounds))
  print(f"GPT-2 step on {device}, medians of {args.rounds} rounds (ms); TinyJit {jit:.2f} ms a step; the device "
        f"queues its kernels: {engine_realize.queues_work(device)}")
  for name in settings:
    parts = [statistics.median(values) for values in zip(*splits[name])]
    print(f"  {name:8s} ({realizes[name]} schedules a step) one step from idle: forward graph {parts[0]:.2f}, "
          f"backward {parts[1]:.2f}, optimizer graph "
          f"{parts[2]:.2f}, last realize {parts[3]:.2f}, device wait {parts[4]:.2f}; total {sum(parts):.2f}")
    print("           loops: " + ", ".join(f"{n} steps {statistics.median(walls[(name, n)]):.2f} ms a step "
                                         f"({statistics.median(walls[(name, n)]) / jit:.2f}x TinyJit)" for n in loops))


if __name__ == "__main__":
  main()
