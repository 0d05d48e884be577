"""The reduce decisions of the lazy layer (lazy_reduce.reduce_plan: a host CPU's packed sums, a device's split of a
reduce) are made once per distinct reduce and remembered, keyed by every fact they read: a repeated eager step
builds its reduces without deciding again, and the remembered plan is the one a fresh decision makes (the same
kernels, the same values), while a changed fact (device facts, a setting, the loads a value takes, a factor's
layout) decides again.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch

from ourgrad import Tensor, lazy_reduce
from ourgrad.codegen.opt import split_reduce
from ourgrad.device import Device
from ourgrad.engine.schedule import create_schedule
from ourgrad.ops import Ops
from ourgrad.runtime.ops_python import PythonRenderer

rng = np.random.default_rng(26)
# the H200's split facts (test_split_reduce.py's): small outputs of long rows split
H200_FACTS = split_reduce.SplitFacts(132, 2048, launch_bytes=7_200_000, latency_bytes=2_880_000)


@pytest.fixture
def decisions(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
  """Every decision reduce_plan makes (not finds remembered): (shape, axes, plan), the remembered ones forgotten."""
  made: list[tuple] = []
  decide = lazy_reduce._decide
  def recorded(lazy: Any, op: Ops, axes: tuple[int, ...], *args: Any) -> Any:
    plan = decide(lazy, op, axes, *args)
    made.append((lazy.shape, axes, plan))
    return plan
  monkeypatch.setattr(lazy_reduce, "_decide", recorded)
  lazy_reduce._PLANS.clear()
  return made


def _kernel_count(*tensors: Tensor) -> int:
  return sum(item.ast.op in (Ops.STORE, Ops.SPLIT_REDUCE) for item in create_schedule([t.lazydata for t in tensors]))


def _mlp_gradients(device: str, x: np.ndarray, weights: list[np.ndarray]) -> list[Tensor]:
  """The weight gradients of a 3-layer ReLU MLP's summed output, weights stored (out, in) as a Linear layer's (a fresh
  graph each call)."""
  params = [Tensor(w, device=device, requires_grad=True) for w in weights]
  out = Tensor(x, device=device)
  for i, w in enumerate(params):
    out = out @ w.T
    if i < len(params) - 1: out = out.relu()
  (out * out).sum().backward()
  return [w.grad for w in params]


def _torch_mlp_gradients(x: np.ndarray, weights: list[np.ndarray]) -> list[np.ndarray]:
  params = [torch.tensor(w, requires_grad=True) for w in weights]
  out = torch.tensor(x)
  for i, w in enumerate(params):
    out = out @ w.T
    if i < len(params) - 1: out = out.relu()
  (out * out).sum().backward()
  return [w.grad.numpy() for w in params]


def _conv_gradients(device: str, x: np.ndarray, w: np.ndarray) -> list[Tensor]:
  """A convolution's input and weight gradients (the CPU's gathered packing, a GPU's weight-gradient split)."""
  image, weight = Tensor(x, device=device, requires_grad=True), Tensor(w, device=device, requires_grad=True)
  (image.conv2d(weight).relu() * 0.5).sum().backward()
  return [image.grad, weight.grad]


def _torch_conv_gradients(x: np.ndarray, w: np.ndarray) -> list[np.ndarray]:
  image, weight = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
  (torch.nn.functional.conv2d(image, weight).relu() * 0.5).sum().backward()
  return [image.grad.numpy(), weight.grad.numpy()]


MLP_WEIGHTS = [rng.standard_normal(shape).astype(np.float32) * 0.1 for shape in ((64, 96), (64, 64), (10, 64))]
MLP_INPUT = rng.standard_normal((128, 96)).astype(np.float32)
CONV_INPUT = rng.standard_normal((8, 3, 12, 12)).astype(np.float32)
CONV_WEIGHT = rng.standard_normal((16, 3, 3, 3)).astype(np.float32) * 0.2
CASES: dict[str, tuple[Callable[[str], list[Tensor]], Callable[[], list[np.ndarray]]]] = {
  "mlp": (lambda device: _mlp_gradients(device, MLP_INPUT, MLP_WEIGHTS),
          lambda: _torch_mlp_gradients(MLP_INPUT, MLP_WEIGHTS)),
  "conv": (lambda device: _conv_gradients(device, CONV_INPUT, CONV_WEIGHT),
           lambda: _torch_conv_gradients(CONV_INPUT, CONV_WEIGHT)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("device", ["CLANG", "PYTHON"])
def test_a_repeated_step_decides_once(decisions: list[tuple], monkeypatch: pytest.MonkeyPatch, case: str,
                                      device: str) -> None:
  """The same step built again: the first build decides every reduce, later ones none; a later one schedules the
  kernels a fresh decision schedules and gives the first's values, equal to PyTorch's. (create_schedule gives
  buffers to what it schedules without running it: the counted copies are not the realized ones.)"""
  if device == "PYTHON": monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts(2, 2048))
  build, reference = CASES[case]
  first = build(device)
  decided = len(decisions)
  assert decided > 0
  remembered_kernels = _kernel_count(*build(device))
  again = build(device)
  assert len(decisions) == decided, decisions[decided:]
  lazy_reduce._PLANS.clear()
  assert _kernel_count(*build(device)) == remembered_kernels
  for a, b, want in zip(first, again, reference()):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_allclose(a.numpy(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("device", ["CLANG", "PYTHON"])
def test_remembered_plans_are_the_fresh_decisions(monkeypatch: pytest.MonkeyPatch, case: str, device: str) -> None:
  """Every reduce of a step built from remembered plans gets the plan that a fresh decision makes."""
  if device == "PYTHON": monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts(2, 2048))
  lazy_reduce._PLANS.clear()
  build = CASES[case][0]
  build(device)   # remembers
  compared: list[tuple] = []
  remembered_plan = lazy_reduce.reduce_plan
  def checked(lazy: Any, op: Ops, axes: tuple[int, ...], out_shape: tuple[int, ...], split: bool) -> Any:
    plan = remembered_plan(lazy, op, axes, out_shape, split)
    renderer = Device[lazy.device].renderer
    fresh = lazy_reduce._decide(lazy, op, axes, out_shape, split, renderer, lambda: lazy_reduce._count_loads(lazy))
    compared.append((lazy.shape, axes, plan, fresh))
    return plan
  monkeypatch.setattr("ourgrad.lazy.reduce_plan", checked)
  build(device)
  assert compared and all(plan == fresh for _, _, plan, fresh in compared), compared
  if device == "CLANG" and Device["CLANG"].renderer.l2_cache_bytes:
    assert any(plan is not None for _, _, plan, _ in compared), "the CPU packs some of these sums"


def test_a_changed_device_fact_decides_again(decisions: list[tuple], monkeypatch: pytest.MonkeyPatch) -> None:
  """A host CPU without a known L2 packs nothing: a remembered packed plan is not reused once the fact changes."""
  renderer = Device["CLANG"].renderer
  if not getattr(renderer, "l2_cache_bytes", 0): pytest.skip("this CPU's runtime reports no L2 size")
  packed = _kernel_count(*_mlp_gradients("CLANG", MLP_INPUT, MLP_WEIGHTS))
  decided = len(decisions)
  monkeypatch.setattr(renderer, "l2_cache_bytes", 0)
  plain = _kernel_count(*_mlp_gradients("CLANG", MLP_INPUT, MLP_WEIGHTS))
  assert len(decisions) > decided and all(plan is None for _, _, plan in decisions[decided:])
  assert plain < packed, "the packed copies are kernels of their own"


def test_split_facts_and_loads_are_part_of_the_decision(decisions: list[tuple],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
  """test_split_reduce's batchnorm statistics shape with the H200's facts: a plain sum (one load a value) stays one
  kernel and a product of six buffers splits, in either order and again after both are remembered; with facts of a
  device so small that the plain sum fills it, neither splits."""
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", H200_FACTS)
  buffers = [Tensor.empty(256, 32, 8, 8, device="PYTHON") for _ in range(6)]
  def product() -> Tensor:
    value = buffers[0]
    for other in buffers[1:]: value = value * other
    return value
  decided = []
  for _ in range(2):
    assert _kernel_count(buffers[0].sum(axis=(0, 2, 3))) == 1
    assert _kernel_count(product().sum(axis=(0, 2, 3))) == 2
    decided.append(len(decisions))
  # the two sums of the same shape decided in the first round only (a GPU split's stages decide nothing)
  assert decided == [2, 2] and [plan is None for _, _, plan in decisions] == [True, False], decisions
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts(1, 32))
  assert _kernel_count(product().sum(axis=(0, 2, 3))) == 1
  assert len(decisions) == 3


def test_a_product_stored_is_decided_apart(decisions: list[tuple], monkeypatch: pytest.MonkeyPatch) -> None:
  """A matmul's product forced to memory is read, not multiplied again by a split (_matmul_dims): whether the
  product is stored is part of the key, so the split plan of the lazy product is not reused for it."""
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts(2, 2048))
  monkeypatch.setattr(PythonRenderer, "has_wgmma", False, raising=False)
  a, b = Tensor.empty(64, 1, 512, device="PYTHON"), Tensor.empty(1, 64, 512, device="PYTHON")
  lazy_product = (a * b).lazydata
  stored = (a * b).contiguous().lazydata
  lazy_reduce.reduce_plan(lazy_product, Ops.SUM, (2,), (64, 64, 1), True)
  lazy_reduce.reduce_plan(stored, Ops.SUM, (2,), (64, 64, 1), True)
  assert len(decisions) == 2


def test_a_gpu_split_k_is_decided_once_per_device_facts(decisions: list[tuple],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
  """A weight gradient's split-K on a GPU (SplitMatmul: 256 x 256 outputs, K = 4096) on 132 multiprocessors: decided
  by the first build only, the same kernels after; on 8 multiprocessors (another device) decided again."""
  renderer = Device["PYTHON"].renderer
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts(2, 2048))
  monkeypatch.setattr(renderer, "has_wgmma", False, raising=False)
  monkeypatch.setattr(renderer, "multiprocessors", 132)
  def weight_gradient() -> Tensor:
    tokens, features = Tensor.empty(4096, 256, device="PYTHON"), Tensor.empty(4096, 256, device="PYTHON")
    return (tokens.reshape(4096, 256, 1) * features.reshape(4096, 1, 256)).sum(0)
  kernels = _kernel_count(weight_gradient())
  plans = [plan for _, _, plan in decisions]
  assert any(isinstance(plan, lazy_reduce.SplitMatmul) for plan in plans), plans
  decided = len(decisions)
  assert _kernel_count(weight_gradient()) == kernels and len(decisions) == decided
  monkeypatch.setattr(renderer, "multiprocessors", 8)
  weight_gradient()
  assert len(decisions) > decided


def _reference_loads(lazy: Any) -> set[int]:
  """The ids of the bases an elementwise expression loads, by plain recursion (the definition _fused_loads walks)."""
  base = lazy.base
  if base.realized is None and not base.forced_realize and base.op in lazy_reduce.ELEMENTWISE_OPS:
    return set().union(*(_reference_loads(src) for src in base.srcs))
  return set() if base.op is Ops.CONST else {id(base)}


def test_fused_loads_are_the_bases_an_expression_reads() -> None:
  """lazy_reduce._fused_loads (what a GPU split's model counts) against a recursive reference on random elementwise
  graphs over realized leaves, a forced base, a reduce and constants, shared subexpressions included; with a limit it
  stops at that many loads, all of them loads."""
  for _ in range(20):
    leaves = [Tensor(rng.standard_normal((4, 6)).astype(np.float32)).realize() for _ in range(5)]
    forced = (leaves[0] * 2).contiguous()
    values = [*leaves, forced, leaves[1].sum(1, keepdim=True).expand(4, 6), Tensor.full((4, 6), 0.5)]
    for _ in range(12):   # each new value reads two earlier ones (reused: a graph, not a tree)
      a, b = (values[int(index)] for index in rng.integers(0, len(values), 2))
      values.append([a + b, a * b, (a - b).relu(), a.maximum(b), (a * 1.5).exp2(), a.where(a > b, b)][rng.integers(6)])
    lazy = values[-1].lazydata
    expected = _reference_loads(lazy)
    assert {id(base) for base in lazy_reduce._fused_loads(lazy)} == expected
    for limit in (1, 2, 3):
      limited = {id(base) for base in lazy_reduce._fused_loads(lazy, limit)}
      assert len(limited) == min(limit, len(expected)) and limited <= expected
    Tensor.realize_all(*values)   # (values against numpy are the suites' business: this realizes what was built)
