"""A training step leaves no reference cycles: every tensor, Function and lazy buffer it makes is freed by reference
count when the step's graph goes, so no device buffer waits for the cyclic collector (whatever its threshold,
GC_THRESHOLD), and a jitted step's capture peaks no higher than the eager step (test_memory_planner).

Each case runs a few warm-up steps, then collects with gc.DEBUG_SAVEALL on: every object a collection would have freed
(all cyclic garbage the measured steps made, and what it held) stays in gc.garbage to be inspected."""
from __future__ import annotations

import gc
from typing import Any, Callable

import numpy as np
import pytest

import ourgrad
from ourgrad import Tensor, TinyJit, dtypes, nn
from ourgrad.helpers import clear_caches
from ourgrad.nn.optim import SGD, Adam, AdamW


class SmallConvNet:
  """conv -> batchnorm -> relu -> max-pool -> linear: the layers of examples/mnist.py, small."""

  def __init__(self) -> None:
    self.conv = nn.Conv2d(1, 4, 3, padding=1)
    self.norm = nn.BatchNorm2d(4)
    self.head = nn.Linear(4 * 4 * 4, 10)

  def __call__(self, x: Tensor) -> Tensor:
    x = self.norm(self.conv(x)).relu().max_pool2d(2)
    return self.head(x.flatten(1))


def _cyclic_garbage_of(run: Callable[[], Any], steps: int = 3, warmup: int = 2) -> list[Any]:
  """The objects that were only reachable through reference cycles after `steps` calls of `run` (after `warmup`
  calls). The caches start empty: a compile that evicts an earlier test's kernel (a full kernel cache) drops a
  program whose ctypes library is a cycle of its own, garbage of the cache's bound, not of the step."""
  clear_caches()
  for _ in range(warmup): run()
  gc.collect()
  gc.set_debug(gc.DEBUG_SAVEALL)
  try:
    for _ in range(steps): run()
    gc.collect()
    return list(gc.garbage)
  finally:
    gc.set_debug(0)
    gc.garbage.clear()


def _describe(garbage: list[Any]) -> str:
  names = [getattr(item, "__qualname__", type(item).__name__) for item in garbage]
  return f"{len(garbage)} objects in cycles: {sorted(set(names))[:20]}"


def _training_step(optimizer_class: type, jit: bool = False, autocast: bool = False) -> Callable[[], Any]:
  Tensor.manual_seed(0)
  model = SmallConvNet()
  parameters = nn.state.get_parameters(model)
  trainable = [tensor for tensor in parameters if tensor.requires_grad]
  statistics = [tensor for tensor in parameters if not tensor.requires_grad]
  optimizer = optimizer_class(trainable, lr=1e-3)
  data = np.random.default_rng(0)
  x = Tensor(data.standard_normal((4, 1, 8, 8)).astype(np.float32)).realize()
  y = Tensor(data.integers(0, 10, 4).astype(np.int32)).realize()

  def step(x: Tensor, y: Tensor) -> Tensor:
    with Tensor.train():
      optimizer.zero_grad()
      if autocast:
        with ourgrad.autocast(dtypes.bfloat16): loss = model(x).cross_entropy(y)
      else:
        loss = model(x).cross_entropy(y)
      loss.backward()
      Tensor.realize_all(loss, *optimizer.schedule_step(), *statistics)
    return loss
  stepper = TinyJit(step) if jit else step
  return lambda: stepper(x, y).item()


@pytest.mark.parametrize("optimizer_class", [Adam, AdamW, SGD])
def test_eager_training_step_makes_no_cycles(optimizer_class: type) -> None:
  garbage = _cyclic_garbage_of(_training_step(optimizer_class))
  assert not garbage, _describe(garbage)


@pytest.mark.parametrize("autocast", [False, True])
def test_jitted_step_capture_and_replays_make_no_cycles(autocast: bool) -> None:
  """The capture (the first calls) and the replays: a result rebuilt from a template once went through a closure that
  called itself (function -> cell -> function), a cycle that kept the step's outputs (the loss's buffer) alive."""
  garbage = _cyclic_garbage_of(_training_step(Adam, jit=True, autocast=autocast), steps=5, warmup=0)
  assert not garbage, _describe(garbage)


def test_jit_result_with_several_outputs_makes_no_cycles() -> None:
  @TinyJit
  def f(x: Tensor) -> dict[str, Any]:
    return {"pair": ((x + 1).realize(), (x * 2).realize()), "none": None}
  x = Tensor.arange(8).float().realize()

  def run() -> None:
    result = f(x)
    np.testing.assert_allclose(result["pair"][1].numpy(), np.arange(8) * 2)
  garbage = _cyclic_garbage_of(run, steps=3)
  assert not garbage, _describe(garbage)
