"""Tests of ourgrad.nn.optim: every optimizer step by step against torch.optim (LAMB against numpy), the
learning rate as a buffer (changing it matches torch and compiles nothing), one schedule per step with the
parameters updated in place, and the constructor's errors."""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pytest
import torch

import ourgrad.engine.realize as engine_realize
from ourgrad.lazy import LazyBuffer
import ourgrad.engine.schedule_cache as engine_schedule  # Tensor.realize schedules through its cache
from ourgrad.errors import AutogradError
from ourgrad.helpers import GlobalCounters
from ourgrad.nn.optim import LAMB, SGD, Adam, AdamW, Optimizer
from ourgrad.tensor import Tensor

STEPS = 10
IN, HIDDEN, OUT, BATCH = 5, 7, 3, 6


def _initial_weights(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {"w1": (rng.standard_normal((IN, HIDDEN)) * 0.5).astype(np.float32),
          "b1": (rng.standard_normal((HIDDEN,)) * 0.1).astype(np.float32),
          "w2": (rng.standard_normal((HIDDEN, OUT)) * 0.5).astype(np.float32)}


def _batch(step: int) -> tuple[np.ndarray, np.ndarray]:
  """Inputs and one-hot targets of step `step` (a new batch every step)."""
  rng = np.random.default_rng(100 + step)
  x = rng.standard_normal((BATCH, IN)).astype(np.float32)
  labels = rng.integers(0, OUT, BATCH)
  return x, np.eye(OUT, dtype=np.float32)[labels]


def _loss(w1: Any, b1: Any, w2: Any, x: Any, target: Any) -> Any:
  """A tanh MLP with a cross-entropy loss plus a small quadratic term, written the same way for both libraries."""
  hidden = (x @ w1 + b1).tanh()
  logits = hidden @ w2
  log_probs = logits.log_softmax(-1) if isinstance(logits, Tensor) else torch.log_softmax(logits, -1)
  return -(log_probs * target).sum(-1).mean() + 0.01 * (hidden * hidden).mean()


class _Pair:
  """The same model in ourgrad and in torch, with optimizers built by `make_ours` / `make_torch`."""

  def __init__(self, make_ours: Callable[[list[Tensor]], Optimizer],
               make_torch: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
    weights = _initial_weights()
    self.ours = [Tensor(value, requires_grad=True) for value in weights.values()]
    self.theirs = [torch.tensor(value, requires_grad=True) for value in weights.values()]
    self.opt, self.torch_opt = make_ours(self.ours), make_torch(self.theirs)

  def step(self, step: int) -> None:
    x, target = _batch(step)
    self.opt.zero_grad()
    _loss(*self.ours, Tensor(x), Tensor(target)).backward()
    self.opt.step()
    self.torch_opt.zero_grad()
    _loss(*self.theirs, torch.tensor(x), torch.tensor(target)).backward()
    self.torch_opt.step()

  def check(self, step: int) -> None:
    for index, (ours, theirs) in enumerate(zip(self.ours, self.theirs)):
      np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), rtol=1e-5, atol=1e-5,
                                 err_msg=f"parameter {index} after step {step}")


TORCH_CASES: dict[str, tuple[Callable[[list[Tensor]], Optimizer], Callable[[list[torch.Tensor]], Any]]] = {
  "sgd": (lambda p: SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
  "sgd_momentum": (lambda p: SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
  "sgd_nesterov": (lambda p: SGD(p, lr=0.1, momentum=0.9, nesterov=True),
                   lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True)),
  "sgd_weight_decay": (lambda p: SGD(p, lr=0.1, weight_decay=0.05),
                       lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.05)),
  "sgd_all": (lambda p: SGD(p, lr=0.05, momentum=0.8, weight_decay=0.1, nesterov=True),
              lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, weight_decay=0.1, nesterov=True)),
  "adam": (lambda p: Adam(p, lr=0.01), lambda p: torch.optim.Adam(p, lr=0.01)),
  "adam_betas_eps": (lambda p: Adam(p, lr=0.02, betas=(0.8, 0.99), eps=1e-6),
                     lambda p: torch.optim.Adam(p, lr=0.02, betas=(0.8, 0.99), eps=1e-6)),
  "adam_weight_decay": (lambda p: Adam(p, lr=0.01, weight_decay=0.1),
                        lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1)),
  "adamw": (lambda p: AdamW(p, lr=0.01), lambda p: torch.optim.AdamW(p, lr=0.01)),
  "adamw_weight_decay": (lambda p: AdamW(p, lr=0.01, betas=(0.85, 0.995), weight_decay=0.3),
                         lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.85, 0.995), weight_decay=0.3)),
}


@pytest.mark.parametrize("case", list(TORCH_CASES))
def test_matches_torch_every_step(case: str) -> None:
  pair = _Pair(*TORCH_CASES[case])
  for step in range(STEPS):
    pair.step(step)
    pair.check(step)


@pytest.mark.parametrize("case", ["sgd_nesterov", "adam", "adamw_weight_decay"])
def test_changing_lr_matches_torch(case: str) -> None:
  pair = _Pair(*TORCH_CASES[case])
  for step, lr in enumerate([0.01, 0.01, 0.05, 0.002, 0.02, 0.02]):
    pair.opt.lr = lr
    for group in pair.torch_opt.param_groups: group["lr"] = lr
    assert pair.opt.lr == pytest.approx(lr)
    pair.step(step)
    pair.check(step)


@pytest.mark.parametrize("make", [lambda p: SGD(p, lr=0.1, momentum=0.9), lambda p: Adam(p), lambda p: AdamW(p),
                                  lambda p: LAMB(p, weight_decay=0.01)], ids=["sgd", "adam", "adamw", "lamb"])
def test_changing_lr_compiles_nothing(make: Callable[[list[Tensor]], Optimizer]) -> None:
  params = [Tensor(value, requires_grad=True) for value in _initial_weights().values()]
  opt = make(params)
  x, target = Tensor(_batch(0)[0]), Tensor(_batch(0)[1])

  def step() -> None:
    opt.zero_grad()
    _loss(*params, x, target).backward()
    opt.step()

  step()  # compiles the step's kernels
  compiled = len(engine_realize._runner_cache)
  for lr in (0.5, 0.0123):
    opt.lr = lr  # writes into lr_tensor's buffer: no kernel, nothing to compile
    step()
    assert len(engine_realize._runner_cache) == compiled, f"a step after setting lr={lr} compiled new kernels"
  assert opt.lr == pytest.approx(0.0123)


@pytest.mark.parametrize("make", [lambda p: SGD(p, lr=0.1), lambda p: SGD(p, lr=0.1, momentum=0.9, nesterov=True),
                                  lambda p: Adam(p, weight_decay=0.01), lambda p: AdamW(p), lambda p: LAMB(p)],
                         ids=["sgd", "sgd_nesterov", "adam", "adamw", "lamb"])
def test_one_schedule_per_step_in_place(make: Callable[[list[Tensor]], Optimizer],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
  params = [Tensor(value, requires_grad=True) for value in _initial_weights().values()]
  opt = make(params)
  buffers = [param.lazydata.base.realized for param in params]
  schedules: list[int] = []
  original = engine_schedule.schedule

  def counting_create_schedule(*args: Any, **kwargs: Any) -> Any:
    schedule = original(*args, **kwargs)
    schedules.append(len(schedule))
    return schedule

  monkeypatch.setattr(engine_schedule, "schedule", counting_create_schedule)
  kernels_per_step: list[int] = []
  for step in range(4):
    x, target = _batch(step)
    opt.zero_grad()
    _loss(*params, Tensor(x), Tensor(target)).backward()  # lazy: forward and backward run inside step()
    schedules.clear()
    before = GlobalCounters.kernel_count
    opt.step()
    kernels_per_step.append(GlobalCounters.kernel_count - before)
    assert len(schedules) == 1, f"step {step} realized {len(schedules)} schedules, expected one"
    for index, (param, buffer) in enumerate(zip(params, buffers)):
      assert param.lazydata.base.realized is buffer, f"parameter {index} got a new buffer in step {step}"
  assert len(set(kernels_per_step)) == 1, f"kernels per step changed: {kernels_per_step}"


def test_state_buffers_updated_in_place() -> None:
  params = [Tensor(value, requires_grad=True) for value in _initial_weights().values()]
  opt = Adam(params)
  state = [*opt.m, *opt.v, opt.t, opt.lr_tensor]
  buffers = [tensor.lazydata.base.realized for tensor in state]
  for step in range(3):
    x, target = _batch(step)
    opt.zero_grad()
    _loss(*params, Tensor(x), Tensor(target)).backward()
    opt.step()
    opt.lr = 0.001 * (step + 2)
  assert all(tensor.lazydata.base.realized is buffer for tensor, buffer in zip(state, buffers))
  assert opt.t.item() == 3


# ---------------------------------------------------------------- LAMB against numpy

def _lamb_reference(params: list[np.ndarray], grads_per_step: list[list[np.ndarray]], lr: float,
                    betas: tuple[float, float], eps: float, weight_decay: float, adam: bool) -> list[list[np.ndarray]]:
  """LAMB in float64 numpy (the paper's update, tinygrad's semantics); the parameters after every step."""
  b1, b2 = betas
  params = [p.astype(np.float64) for p in params]
  m = [np.zeros_like(p) for p in params]
  v = [np.zeros_like(p) for p in params]
  history = []
  for t, grads in enumerate(grads_per_step, start=1):
    for i, g in enumerate(grads):
      m[i] = b1 * m[i] + (1 - b1) * g
      v[i] = b2 * v[i] + (1 - b2) * g * g
      update = (m[i] / (1 - b1 ** t)) / (np.sqrt(v[i] / (1 - b2 ** t)) + eps) + weight_decay * params[i]
      ratio = 1.0
      if not adam:
        weight_norm, update_norm = np.linalg.norm(params[i]), np.linalg.norm(update)
        ratio = weight_norm / update_norm if weight_norm > 0 and update_norm > 0 else 1.0
      params[i] = params[i] - lr * ratio * update
    history.append([p.copy() for p in params])
  return history


@pytest.mark.parametrize("kwargs", [{}, {"weight_decay": 0.1}, {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-4},
                                    {"adam": True}, {"adam": True, "weight_decay": 0.05}],
                         ids=["default", "weight_decay", "hyper", "adam", "adam_weight_decay"])
def test_lamb_matches_numpy(kwargs: dict[str, Any]) -> None:
  rng = np.random.default_rng(3)
  initial = [rng.standard_normal((4, 6)).astype(np.float32), rng.standard_normal((6,)).astype(np.float32),
             np.zeros((3, 2), dtype=np.float32)]  # a zero parameter: ||w|| = 0 gives a trust ratio of 1
  grads = [[rng.standard_normal(p.shape).astype(np.float32) for p in initial] for _ in range(STEPS)]
  grads[2][1][:] = 0.0  # a zero gradient at step 3 (m, v still move the update)
  settings = {"lr": 0.001, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.0, "adam": False, **kwargs}
  expected = _lamb_reference(initial, grads, **settings)
  params = [Tensor(p, requires_grad=True) for p in initial]
  opt = LAMB(params, **kwargs)
  for step in range(STEPS):
    for param, grad in zip(params, grads[step]): param.grad = Tensor(grad)
    opt.step()
    for index, (param, reference) in enumerate(zip(params, expected[step])):
      np.testing.assert_allclose(param.numpy(), reference, rtol=1e-5, atol=1e-6,
                                 err_msg=f"LAMB parameter {index} after step {step}")


def test_lamb_trust_ratio_is_one_for_zero_update() -> None:
  # zero gradients from the start: m = v = 0, the update is 0 and the trust ratio falls back to 1 (no NaN)
  param = Tensor(np.ones((2, 3), dtype=np.float32), requires_grad=True)
  opt = LAMB([param], lr=0.1)
  param.grad = Tensor(np.zeros((2, 3), dtype=np.float32))
  opt.step()
  np.testing.assert_array_equal(param.numpy(), np.ones((2, 3), dtype=np.float32))


# ---------------------------------------------------------------- API

def test_zero_grad_and_skipped_params() -> None:
  used, unused = Tensor([1.0, 2.0], requires_grad=True), Tensor([3.0], requires_grad=True)
  opt = SGD([used, unused], lr=0.5, momentum=0.9)
  (used * used).sum().backward()
  assert unused.grad is None
  opt.step()  # a parameter without a gradient is left alone, as in torch
  np.testing.assert_allclose(used.numpy(), [0.0, 0.0])
  np.testing.assert_allclose(unused.numpy(), [3.0])
  opt.zero_grad()
  assert used.grad is None and unused.grad is None
  opt.step()  # nothing to do
  np.testing.assert_allclose(used.numpy(), [0.0, 0.0])


def test_lr_property_reads_the_tensor() -> None:
  opt = Adam([Tensor([1.0], requires_grad=True)], lr=0.003)
  assert opt.lr == pytest.approx(0.003)
  assert opt.lr_tensor.numel() == 1
  opt.lr = 0.25
  assert opt.lr_tensor.item() == pytest.approx(0.25)


def test_step_builds_no_autograd_graph() -> None:
  param = Tensor([1.0, -2.0], requires_grad=True)
  opt = Adam([param], lr=0.1)
  (param * param).sum().backward()
  opt.step()
  assert param._ctx is None and param.requires_grad
  assert all(tensor._ctx is None for tensor in (*opt.m, *opt.v, opt.t))


def test_unrealized_parameter_is_given_a_buffer() -> None:
  param = Tensor.zeros(3, requires_grad=True)  # a constant, not a buffer: the optimizer realizes it once
  opt = SGD([param], lr=1.0)
  buffer = param.lazydata.base.realized
  assert buffer is not None
  (param - Tensor([1.0, 2.0, 3.0])).square().sum().backward()
  opt.step()
  np.testing.assert_allclose(param.numpy(), [2.0, 4.0, 6.0])
  assert param.lazydata.base.realized is buffer


def test_schedule_step_realizes_loss_with_the_update(monkeypatch: pytest.MonkeyPatch) -> None:
  weights = _initial_weights()
  params = [Tensor(value, requires_grad=True) for value in weights.values()]
  opt = SGD(params, lr=0.5, momentum=0.9)
  x, target = _batch(0)
  loss = _loss(*params, Tensor(x), Tensor(target))
  loss.backward()
  schedules: list[int] = []
  original = engine_schedule.schedule
  monkeypatch.setattr(engine_schedule, "schedule", lambda *args: schedules.append(1) or original(*args))
  Tensor.realize_all(loss, *opt.schedule_step())
  assert len(schedules) == 1
  expected = _loss(*[torch.tensor(value) for value in weights.values()], torch.tensor(x), torch.tensor(target))
  assert loss.item() == pytest.approx(expected.item(), rel=1e-6)  # the loss of the weights before the step
  assert not np.allclose(params[0].numpy(), weights["w1"])


def test_read_before_assign_in_one_schedule() -> None:
  """The scheduler runs a kernel reading a buffer's old value before the assign that overwrites it."""
  a = Tensor(np.array([1.0, 2.0], dtype=np.float32))
  b = a * 2  # reads a's current values
  a.assign(a + 1)
  Tensor.realize_all(a, b)  # `a` first in the outputs, yet b must still read the old values
  np.testing.assert_allclose(a.numpy(), [2.0, 3.0])
  np.testing.assert_allclose(b.numpy(), [2.0, 4.0])


@pytest.mark.parametrize("make", [SGD, Adam, AdamW, LAMB])
def test_params_without_requires_grad(make: type[Optimizer]) -> None:
  """requires_grad=False tensors (running statistics) are skipped, unset ones become parameters (tinygrad's rule);
  nothing left to optimize raises."""
  trained, frozen, unset = Tensor([1.0], requires_grad=True), Tensor([3.0], requires_grad=False), Tensor([2.0])
  opt = make([trained, frozen, unset])
  assert [id(p) for p in opt.params] == [id(trained), id(unset)]
  assert unset.requires_grad is True and frozen.requires_grad is False
  with pytest.raises(AutogradError, match="requires_grad=False"):
    make([Tensor([2.0], requires_grad=False)])


@pytest.mark.parametrize("make", [SGD, Adam, AdamW, LAMB])
def test_empty_params_raises(make: type[Optimizer]) -> None:
  with pytest.raises(AutogradError, match="empty parameter list"):
    make([])


@pytest.mark.parametrize("make", [lambda p: SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1, nesterov=True),
                                  lambda p: Adam(p, weight_decay=0.01), lambda p: AdamW(p, weight_decay=0.1)],
                         ids=["sgd_all", "adam", "adamw"])
def test_update_graph_costs_no_functions_per_parameter(make: Callable[[list[Tensor]], Optimizer],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
  """A step runs without autograd: every update, and what is computed once per step (the step count, the bias
  corrections), is built on lazy buffers: no Tensor op, no Function."""
  import ourgrad.function as F
  applied: list[str] = []
  original = F.Function.apply.__func__   # type: ignore[attr-defined]

  def counting_apply(cls: type, *tensors: Tensor, **kwargs: Any) -> Tensor:
    applied.append(cls.__name__)
    return original(cls, *tensors, **kwargs)

  functions_per_step = []
  for count in (1, 4):
    params = [Tensor(np.full((3, 2), float(index + 1), dtype=np.float32), requires_grad=True) for index in range(count)]
    opt = make(params)
    for param in params: param.grad = Tensor(np.ones((3, 2), dtype=np.float32))
    applied.clear()
    monkeypatch.setattr(F.Function, "apply", classmethod(counting_apply))
    updated = opt.schedule_step()
    monkeypatch.undo()
    Tensor.realize_all(*updated)
    functions_per_step.append(len(applied))
  assert functions_per_step == [0, 0], functions_per_step


@pytest.mark.parametrize("case", ["sgd_all", "adam_weight_decay", "adamw_weight_decay"])
def test_float64_parameters_match_torch(case: str) -> None:
  """float64 parameters (float32 optimizer state, as the constructor makes it): updates cast where the dtypes meet."""
  make_ours, make_torch = TORCH_CASES[case]
  weights = {name: value.astype(np.float64) for name, value in _initial_weights().items()}
  ours = [Tensor(value, requires_grad=True) for value in weights.values()]
  theirs = [torch.tensor(value, requires_grad=True) for value in weights.values()]
  opt, torch_opt = make_ours(ours), make_torch(theirs)
  for step in range(4):
    x, target = (array.astype(np.float64) for array in _batch(step))
    opt.zero_grad()
    _loss(*ours, Tensor(x), Tensor(target)).backward()
    opt.step()
    torch_opt.zero_grad()
    _loss(*theirs, torch.tensor(x), torch.tensor(target)).backward()
    torch_opt.step()
    for index, (mine, reference) in enumerate(zip(ours, theirs)):
      assert mine.dtype == Tensor(weights["w1"]).dtype
      np.testing.assert_allclose(mine.numpy(), reference.detach().numpy(), rtol=1e-5, atol=1e-5,
                                 err_msg=f"parameter {index} after step {step}")


def test_numpy_scalar_hyper_parameters_match_torch() -> None:
  """betas, momentum and weight decay given as numpy scalars (as read from a config array) work as Python floats."""
  pair = _Pair(lambda p: Adam(p, lr=0.01, betas=(np.float32(0.8), np.float32(0.99)), weight_decay=np.float32(0.1)),
               lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), weight_decay=0.1))
  momentum = _Pair(lambda p: SGD(p, lr=0.1, momentum=np.float32(0.9), weight_decay=np.float16(0.5)),
                   lambda p: torch.optim.SGD(p, lr=0.1, momentum=float(np.float32(0.9)), weight_decay=0.5))
  for step in range(3):
    for each in (pair, momentum):
      each.step(step)
      each.check(step)


def _nodes_built(run: Callable[[], Any]) -> tuple[int, int]:
  """(bases, views) of lazy buffers made while `run` runs."""
  made = [0, 0]
  create_base, view = LazyBuffer.create_base, LazyBuffer.view

  def counted_base(*args: Any, **kwargs: Any) -> LazyBuffer:
    made[0] += 1
    return create_base(*args, **kwargs)

  def counted_view(self: LazyBuffer, st: Any) -> LazyBuffer:
    out = view(self, st)
    if out._base is not None: made[1] += 1   # (a new view; the identity view is the base itself)
    return out
  LazyBuffer.create_base, LazyBuffer.view = staticmethod(counted_base), counted_view  # type: ignore[method-assign]
  try:
    run()
  finally:
    LazyBuffer.create_base, LazyBuffer.view = staticmethod(create_base), view  # type: ignore[method-assign]
  return made[0], made[1]


# the lazy ops of one parameter's update: its formula's operations and the assigns, nothing else
UPDATE_BASES = {"sgd": 3, "sgd_all": 10, "adam": 17, "adam_weight_decay": 19, "adamw_weight_decay": 18}


@pytest.mark.parametrize("case", list(UPDATE_BASES))
def test_a_parameter_of_a_known_shape_costs_its_formula_and_no_view(case: str) -> None:
  """One more parameter of a shape the step has seen costs the bases of its update formula and no view: the
  constants it reads are shared operand constants (made once, for every step) and the per-step values (learning
  rate, bias corrections) have one broadcast view per shape and step."""
  make = {"sgd": lambda p: SGD(p, lr=0.1), "adam": lambda p: Adam(p, lr=0.01), **{
    name: TORCH_CASES[name][0] for name in ("sgd_all", "adam_weight_decay", "adamw_weight_decay")}}[case]
  per_step = []
  for count in (1, 4):
    params = [Tensor(np.full((3, 2), float(index + 1), dtype=np.float32), requires_grad=True) for index in range(count)]
    opt = make(params)
    for step in range(2):   # (the second step: the shared constants exist)
      for param in params: param.grad = Tensor(np.ones((3, 2), dtype=np.float32))
      updated: list[Tensor] = []
      made = _nodes_built(lambda: updated.extend(opt.schedule_step()))
      Tensor.realize_all(*updated)
    per_step.append(made)
  assert ((per_step[1][0] - per_step[0][0]) / 3, (per_step[1][1] - per_step[0][1]) / 3) == (UPDATE_BASES[case], 0)


def _adam_by_tensor_ops(params: list[Tensor], grads: list[np.ndarray], state: dict[str, Any], lr: float,
                        betas: tuple[float, float], eps: float, weight_decay: float, decoupled: bool) -> None:
  """One Adam/AdamW step written with Tensor ops, the operations of the formula in the order the optimizer's lazy
  update builds them (the reference its values must equal bit for bit)."""
  b1, b2 = betas
  state["t"].assign(state["t"] + 1.0)
  correction1 = 1.0 - (state["t"] * math.log(b1)).exp()
  correction2 = 1.0 - (state["t"] * math.log(b2)).exp()
  minus_step_size = -(state["lr"] / correction1)
  inverse_sqrt_correction2 = correction2.sqrt().reciprocal()
  written = [state["t"]]
  for index, (param, grad) in enumerate(zip(params, grads)):
    g, weights = Tensor(grad), param
    if weight_decay and not decoupled: g = g + weights * weight_decay
    if weight_decay and decoupled: weights = weights * (1.0 - state["lr"] * weight_decay)
    m, v = state["m"][index], state["v"][index]
    m.assign(m * b1 + g * (1.0 - b1))
    v.assign(v * b2 + g * g * (1.0 - b2))
    step = minus_step_size * m / (v.sqrt() * inverse_sqrt_correction2 + eps)
    written += [m, v, param.assign(weights + step)]
  Tensor.realize_all(*written)   # one schedule, as the optimizer's step: the same kernels


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
def test_adam_equals_its_tensor_formula_bit_for_bit(decoupled: bool) -> None:
  """The lazy update (per-step math and per-parameter formula built without Tensors) gives the values of the formula
  written with Tensor ops, bit for bit, over several steps (parameters, moments)."""
  rng = np.random.default_rng(3)
  shapes = [(5, 7), (7,), (5, 7)]
  initial = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
  lr, betas, eps, weight_decay = 0.01, (0.8, 0.99), 1e-6, 0.1
  ours = [Tensor(value, requires_grad=True) for value in initial]
  reference = [Tensor(value.copy()) for value in initial]
  opt = (AdamW if decoupled else Adam)(ours, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
  state = {"t": Tensor(np.array(0.0, dtype=np.float32)), "lr": Tensor(np.array(lr, dtype=np.float32)).realize(),
           "m": [Tensor(np.zeros(shape, np.float32)) for shape in shapes],
           "v": [Tensor(np.zeros(shape, np.float32)) for shape in shapes]}
  for step in range(4):
    grads = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    for param, grad in zip(ours, grads): param.grad = Tensor(grad)
    opt.step()
    _adam_by_tensor_ops(reference, grads, state, lr, betas, eps, weight_decay, decoupled)
    for index in range(len(shapes)):
      np.testing.assert_array_equal(ours[index].numpy(), reference[index].numpy(), err_msg=f"param {index}, {step}")
      np.testing.assert_array_equal(opt.m[index].numpy(), state["m"][index].numpy())
      np.testing.assert_array_equal(opt.v[index].numpy(), state["v"][index].numpy())
