"""Fusion beyond one output and one reduce per kernel (docs/fusion.md), checked against numpy and PyTorch.

Each test pins a kernel count (scheduled and launched) and compares the values on random inputs with an independent
reference. The tests run on the default device; `DEVICE=PYTHON EMULATE=CUDA` runs the same kernels lowered as for a
GPU in the numpy interpreter, where the sizes shrink (`SMALL`) to keep the interpreter quick.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import pytest
import torch

import ourgrad.engine.kernel_walk as kernel_walk
import ourgrad.engine.packing as scheduler_packing
from ourgrad import TinyJit
from ourgrad.device import Device
from ourgrad.engine.schedule import create_schedule
from ourgrad.helpers import GlobalCounters
from ourgrad.nn.optim import SGD, Adam, AdamW
from ourgrad.tensor import Tensor

from helpers import ROW_NORMALIZATIONS, torch_layernorm

SMALL = Device.DEFAULT == "PYTHON"   # the interpreter runs every thread in numpy: keep the emulated runs small
PARAM_SHAPES = [(3, 4), (4,), (5, 6), (6,), (7, 3), (2, 2, 2), (9,), (4, 4), (1,), (8, 5)]

@pytest.fixture
def row_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
  """Row kernels on whatever the device: by default (ROW_KERNELS=-1) only CPUs form them, and CI also runs this file
  on the emulated GPU, where the same pins and results must hold once they are on."""
  monkeypatch.setenv("ROW_KERNELS", "1")



def rand(*shape: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def kernels_of(outs: Sequence[Tensor]) -> int:
  return len(create_schedule([out.lazydata for out in outs]))


def realize_counting(outs: Sequence[Tensor]) -> int:
  GlobalCounters.reset()
  Tensor.realize_all(*outs)
  return GlobalCounters.kernel_count


# ---------------------------------------------------------------- multi-output kernels

def test_independent_outputs_over_one_shape_are_one_kernel():
  a_np, b_np = rand(16, 24, seed=1), rand(16, 24, seed=2)
  a, b = Tensor(a_np), Tensor(b_np)

  def build() -> list[Tensor]: return [a + b, a * b, (a - b).exp()]

  assert kernels_of(build()) == 1
  outs = build()
  assert realize_counting(outs) == 1
  for out, expected in zip(outs, [a_np + b_np, a_np * b_np, np.exp(a_np - b_np)]):
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_outputs_of_different_shapes_are_one_multi_output_kernel_only_when_packed(monkeypatch: pytest.MonkeyPatch):
  a_np = rand(8, 8)
  a = Tensor(a_np)

  def build() -> list[Tensor]: return [a + 1, a.reshape(64) * 2 + a.reshape(64)[::-1]]

  monkeypatch.setenv("PACK_KERNELS", "0")
  assert kernels_of(build()) == 2   # a multi-output kernel shares one iteration space
  monkeypatch.setenv("PACK_KERNELS", "1")
  outs = build()
  assert realize_counting(outs) == 1   # packed: one launch over 64 + 64 elements
  np.testing.assert_allclose(outs[0].numpy(), a_np + 1, rtol=1e-6)
  np.testing.assert_allclose(outs[1].numpy(), a_np.reshape(64) * 2 + a_np.reshape(64)[::-1], rtol=1e-6)


def test_an_assign_read_in_place_by_another_output_is_computed_once_in_one_kernel():
  x_np, y_np = rand(32, seed=3), rand(32, seed=4)
  x, y = Tensor(x_np), Tensor(y_np)
  x.assign(x * 2 + 1)
  y.assign(x * y)   # reads the new x in place: the same kernel computes it
  assert realize_counting([x, y]) == 1
  np.testing.assert_allclose(x.numpy(), x_np * 2 + 1, rtol=1e-6)
  np.testing.assert_allclose(y.numpy(), (x_np * 2 + 1) * y_np, rtol=1e-6)


def test_an_assign_read_through_another_view_is_not_fused_and_stays_correct():
  x_np, y_np = rand(32, seed=5), rand(32, seed=6)
  x, y = Tensor(x_np), Tensor(y_np)
  x.assign(x + 1)
  y.assign(x.flip(0) * y)   # reads other threads' new x: x must be complete first
  assert realize_counting([x, y]) == 2
  np.testing.assert_allclose(y.numpy(), (x_np + 1)[::-1] * y_np, rtol=1e-6)


def test_an_old_value_read_through_another_view_keeps_the_overwrite_apart():
  x_np, y_np = rand(32, seed=7), rand(32, seed=8)
  x, y = Tensor(x_np), Tensor(y_np)
  y.assign(x.flip(0) + y)   # reads the old x, reversed
  x.assign(x * 3)           # overwrites x: it may not share a kernel with that read
  assert realize_counting([x, y]) == 2
  np.testing.assert_allclose(y.numpy(), x_np[::-1] + y_np, rtol=1e-6)
  np.testing.assert_allclose(x.numpy(), x_np * 3, rtol=1e-6)


# ---------------------------------------------------------------- optimizer steps

def _parameters(seed: int) -> list[np.ndarray]:
  return [rand(*shape, seed=seed + index) for index, shape in enumerate(PARAM_SHAPES)]


def _step_ours(make: Callable[[list[Tensor]], object], steps: int) -> tuple[list[np.ndarray], list[int]]:
  """The parameters after `steps` steps with random gradients, and the kernels each step launched."""
  params = [Tensor(value, requires_grad=True) for value in _parameters(0)]
  optimizer = make(params)
  counts = []
  for step in range(steps):
    for index, param in enumerate(params): param.grad = Tensor(rand(*param.shape, seed=1000 * step + index))
    Tensor.realize_all(*[param.grad for param in params])
    counts.append(realize_counting(optimizer.schedule_step()))   # type: ignore[attr-defined]
  return [param.numpy() for param in params], counts


def _step_torch(make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], steps: int) -> list[np.ndarray]:
  params = [torch.tensor(value, requires_grad=True) for value in _parameters(0)]
  optimizer = make(params)
  for step in range(steps):
    for index, param in enumerate(params): param.grad = torch.tensor(rand(*param.shape, seed=1000 * step + index))
    optimizer.step()
  return [param.detach().numpy() for param in params]


OPTIMIZERS = {
  # name: (ours, torch's, kernels per step). Every parameter's update is packed into one launch (engine/packing.py);
  # Adam's step count and bias corrections are a kernel before it, since every update reads them
  "adam": (lambda ps: Adam(ps, lr=0.01), lambda ps: torch.optim.Adam(ps, lr=0.01), 2),
  "adam_l2": (lambda ps: Adam(ps, lr=0.01, weight_decay=0.1),
              lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1), 2),
  "adamw": (lambda ps: AdamW(ps, lr=0.01, weight_decay=0.1),
            lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1), 2),
  "sgd": (lambda ps: SGD(ps, lr=0.05), lambda ps: torch.optim.SGD(ps, lr=0.05), 1),
  "sgd_weight_decay": (lambda ps: SGD(ps, lr=0.05, weight_decay=0.01),
                       lambda ps: torch.optim.SGD(ps, lr=0.05, weight_decay=0.01), 1),
  "sgd_momentum": (lambda ps: SGD(ps, lr=0.05, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), 1),
  "sgd_momentum_weight_decay": (lambda ps: SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
                                lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01), 1),
  "sgd_nesterov": (lambda ps: SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
                   lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True), 1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_step_over_ten_parameters_is_at_most_two_kernels_and_matches_torch(name: str):
  ours, theirs, kernels_per_step = OPTIMIZERS[name]
  steps = 2 if SMALL else 3
  got, counts = _step_ours(ours, steps)
  assert counts == [kernels_per_step] * steps
  for value, expected in zip(got, _step_torch(theirs, steps)):
    np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)


def _loss_ours(params: list[Tensor], targets: list[np.ndarray]) -> Tensor:
  """A loss over every parameter, as a training loop builds one: sum((p - target)^2) + sum(p)."""
  total: Tensor | None = None
  for param, target in zip(params, targets):
    term = ((param - Tensor(target)) ** 2).sum() + param.sum()
    total = term if total is None else total + term
  assert total is not None
  return total


def _loss_torch(params: list[torch.Tensor], targets: list[np.ndarray]) -> torch.Tensor:
  return sum(((param - torch.tensor(target)) ** 2).sum() + param.sum() for param, target in zip(params, targets))


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_step_after_backward_with_a_lazy_loss_is_two_kernels_and_matches_torch(name: str):
  """Stepped as users step: loss.backward(), the gradients realized, opt.step(), and the loss read after the step.
  The lazy loss reads every parameter the step overwrites, so each is snapshotted first (engine/snapshot.py); the
  snapshot copies are packed into one launch (with Adam's step count), the updates into another."""
  ours, theirs, _ = OPTIMIZERS[name]
  params = [Tensor(value, requires_grad=True) for value in _parameters(0)]
  torch_params = [torch.tensor(value, requires_grad=True) for value in _parameters(0)]
  optimizer, torch_optimizer = ours(params), theirs(torch_params)
  for step in range(2 if SMALL else 3):
    targets = [rand(*param.shape, seed=500 + 10 * step + index) for index, param in enumerate(params)]
    optimizer.zero_grad()   # type: ignore[attr-defined]
    loss = _loss_ours(params, targets)
    loss.backward()
    Tensor.realize_all(*[param.grad for param in params])
    GlobalCounters.reset()
    optimizer.step()   # type: ignore[attr-defined]
    assert GlobalCounters.kernel_count <= 2, f"step {step} ran {GlobalCounters.kernel_count} kernels"
    torch_optimizer.zero_grad()
    torch_loss = _loss_torch(torch_params, targets)
    torch_loss.backward()
    torch_optimizer.step()
    # the loss read after the step is the loss of the parameters before it, as in PyTorch
    np.testing.assert_allclose(loss.numpy(), torch_loss.detach().numpy(), rtol=1e-5)
    for value, expected in zip(params, torch_params):
      np.testing.assert_allclose(value.numpy(), expected.detach().numpy(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- packed kernels (engine/packing.py)

def test_independent_kernels_of_different_shapes_pack_and_a_dependent_one_stays_apart():
  a_np, b_np, c_np = rand(6, 5, seed=1), rand(3, 10, seed=2), rand(7, seed=3)
  a, b, c = Tensor(a_np), Tensor(b_np), Tensor(c_np)
  doubled = (a * 2).contiguous()   # read by `shifted`: a kernel of its own before the pack
  shifted = doubled.reshape(3, 10) + b
  scaled = c * 3 + 1               # independent of both: packs with `shifted`
  assert kernels_of([doubled, shifted, scaled]) == 2
  doubled = (a * 2).contiguous()
  shifted, scaled = doubled.reshape(3, 10) + b, c * 3 + 1
  assert realize_counting([doubled, shifted, scaled]) == 2
  np.testing.assert_allclose(doubled.numpy(), a_np * 2, rtol=1e-6)
  np.testing.assert_allclose(shifted.numpy(), (a_np * 2).reshape(3, 10) + b_np, rtol=1e-6)
  np.testing.assert_allclose(scaled.numpy(), c_np * 3 + 1, rtol=1e-6)


def test_a_read_of_the_old_value_does_not_share_a_pack_with_the_assign_overwriting_it():
  w_np, other_np = rand(4, 6, seed=1), rand(5, seed=2)
  w, other = Tensor(w_np).realize(), Tensor(other_np)
  old_doubled = w.reshape(24) * 2   # reads w before the assign below overwrites it
  w.assign(w + 1)
  other_out = other - 1             # independent: packs with one of them
  assert realize_counting([old_doubled, w, other_out]) == 2
  np.testing.assert_allclose(old_doubled.numpy(), w_np.reshape(24) * 2, rtol=1e-6)
  np.testing.assert_allclose(w.numpy(), w_np + 1, rtol=1e-6)
  np.testing.assert_allclose(other_out.numpy(), other_np - 1, rtol=1e-6)


def test_packs_split_at_the_buffer_cap(monkeypatch: pytest.MonkeyPatch):
  inputs = [rand(index + 2, seed=index) for index in range(10)]

  def build() -> list[Tensor]: return [Tensor(value) * (index + 2) for index, value in enumerate(inputs)]

  assert kernels_of(build()) == 1   # 10 outputs and 10 inputs: within the default cap
  monkeypatch.setenv("MAX_PACK_BUFFERS", "6")   # 3 kernels of 2 buffers each per pack
  outs = build()
  assert realize_counting(outs) == 4
  for index, (out, value) in enumerate(zip(outs, inputs)):
    np.testing.assert_allclose(out.numpy(), value * (index + 2), rtol=1e-6)


def test_a_cpu_keeps_kernels_it_would_run_on_several_cores_out_of_packs():
  big_np, small_np = rand(scheduler_packing.CPU_PACK_MAX_ELEMENTS + 8, seed=1), rand(7, seed=2)
  big, small = Tensor(big_np), Tensor(small_np)
  packs_any_size = Device[Device.DEFAULT].renderer.has_threads   # a GPU packs it; a CPU's packs are serial loops
  outs = [big * 2, small + 1]
  assert realize_counting(outs) == (1 if packs_any_size else 2)
  np.testing.assert_allclose(outs[0].numpy(), big_np * 2, rtol=1e-6)
  np.testing.assert_allclose(outs[1].numpy(), small_np + 1, rtol=1e-6)


def test_a_small_reduce_is_packed_only_on_a_gpu():
  """On a GPU a small reduce (a thread per output looping over a few elements: engine/packing.py) shares the launch
  of an independent elementwise kernel; a CPU keeps reduces apart."""
  a_np, b_np = rand(4, 8, seed=1), rand(5, seed=2)
  a, b = Tensor(a_np), Tensor(b_np)
  gpu = Device[Device.DEFAULT].renderer.has_threads
  assert kernels_of([a.sum(1), b * 2]) == (1 if gpu else 2)
  outs = [a.sum(1), b * 2]
  assert realize_counting(outs) == (1 if gpu else 2)
  np.testing.assert_allclose(outs[0].numpy(), a_np.sum(1), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(outs[1].numpy(), b_np * 2, rtol=1e-6)


def test_debug_3_names_each_pack_and_why_other_kernels_stay_alone(monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]):
  a, b, c = Tensor(rand(4, 8, seed=1)), Tensor(rand(5, seed=2)), Tensor(rand(3, 3, seed=3))
  monkeypatch.setenv("DEBUG", "3")
  kernels_of([a.sum(1), b * 2, c + 1])
  printed = capsys.readouterr().out
  if Device[Device.DEFAULT].renderer.has_threads:
    assert "pack 3 independent small kernels (output sizes [4, 5, 9]) into one launch" in printed
  else:
    assert "pack 2 independent elementwise kernels (output sizes [5, 9]) into one launch" in printed
    assert "not packed: kernel writing 4 elements: it has a reduce" in printed


def test_jitted_adam_step_replays_its_two_kernels_and_matches_torch():
  params = [Tensor(value, requires_grad=True) for value in _parameters(0)]
  optimizer = Adam(params, lr=0.01)

  @TinyJit
  def step(*grads: Tensor) -> Tensor:
    for param, grad in zip(params, grads): param.grad = grad
    doubled = grads[0] * 2   # independent of the updates: joins their pack
    Tensor.realize_all(doubled, *optimizer.schedule_step())
    return doubled

  steps = 3
  for number in range(steps):
    grads = [Tensor(rand(*param.shape, seed=1000 * number + index)).realize() for index, param in enumerate(params)]
    GlobalCounters.reset()
    step(*grads)
    assert GlobalCounters.kernel_count == 2
  assert len(step.captured.items) == 2   # the step count's kernel and the packed update of all ten parameters
  for value, expected in zip([param.numpy() for param in params],
                             _step_torch(lambda ps: torch.optim.Adam(ps, lr=0.01), steps)):
    np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- several reduces in one kernel (row kernels)

ROW_GRAPHS = {
  # name: (ourgrad, torch)
  **ROW_NORMALIZATIONS,
  "softmax_of_3d": (lambda x: x.reshape(2, -1, x.shape[-1]).softmax(-1),
                    lambda t: t.reshape(2, -1, t.shape[-1]).softmax(-1)),
  "layernorm_affine_relu": (lambda x: (x.layernorm() * 0.5 + 0.25).relu(),
                            lambda t: (torch_layernorm(t) * 0.5 + 0.25).relu()),
  "whole_tensor_centered": (lambda x: x - x.mean(), lambda t: t - t.mean()),
}
ROW_SHAPES = [(4, 6), (6, 33)] if SMALL else [(4, 6), (64, 100), (34, 257)]


@pytest.mark.usefixtures("row_kernels")
@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("name", sorted(ROW_GRAPHS))
def test_row_kernel_matches_torch(name: str, shape: tuple[int, int]):
  ours, theirs = ROW_GRAPHS[name]
  x_np = rand(*shape, seed=sum(shape)) * 3
  x = Tensor(x_np)
  assert kernels_of([ours(x)]) == 1
  np.testing.assert_allclose(ours(x).numpy(), theirs(torch.tensor(x_np)).numpy(), rtol=2e-5, atol=2e-5)


# ---------------------------------------------------------------- a row kernel with final reduces (cross-entropy)

def _class_targets(shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Class indices (N,) or (N, d...) for logits of `shape` (classes on axis 1), and probabilities of `shape`."""
  rng = np.random.default_rng(seed)
  classes = shape[1]
  indices = rng.integers(0, classes, (shape[0],) + shape[2:]).astype(np.int32)
  probabilities = rng.random(shape).astype(np.float32)
  return indices, probabilities / probabilities.sum(1, keepdims=True)


def _with_ignored(indices: np.ndarray) -> np.ndarray:
  ignored = indices.copy()
  ignored.reshape(-1)[::3] = -100   # every third sample skipped: the mean divides by the others
  return ignored


LOSSES = {
  # name: (ourgrad, torch), each called with (logits, class indices, probabilities)
  "indices": (lambda x, i, p: x.cross_entropy(i), lambda x, i, p: torch.nn.functional.cross_entropy(x, i)),
  "indices_ignored": (lambda x, i, p: x.cross_entropy(Tensor(_with_ignored(i.numpy()))),
                      lambda x, i, p: torch.nn.functional.cross_entropy(x, torch.tensor(_with_ignored(i.numpy())))),
  "indices_smoothed": (lambda x, i, p: x.cross_entropy(i, label_smoothing=0.1),
                       lambda x, i, p: torch.nn.functional.cross_entropy(x, i, label_smoothing=0.1)),
  "probabilities": (lambda x, i, p: x.cross_entropy(p), lambda x, i, p: torch.nn.functional.cross_entropy(x, p)),
  "probabilities_smoothed": (lambda x, i, p: x.cross_entropy(p, label_smoothing=0.2),
                             lambda x, i, p: torch.nn.functional.cross_entropy(x, p, label_smoothing=0.2)),
  "nll_of_log_softmax": (lambda x, i, p: x.log_softmax(1).nll_loss(i),
                         lambda x, i, p: torch.nn.functional.nll_loss(x.log_softmax(1), i)),
}
LOSS_SHAPES = [(32, 10), (6, 33), (4, 5, 3)] + ([] if SMALL else [(64, 100)])


@pytest.mark.parametrize("shape", LOSS_SHAPES, ids=str)
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_cross_entropy_mean_is_one_kernel_and_matches_torch(name: str, shape: tuple[int, ...]):
  """The rows' logsumexp and target terms, then the mean over the batch, in one kernel (a row kernel with final
  reduces, docs/fusion.md); the gradient against torch too."""
  if name == "nll_of_log_softmax" and len(shape) > 2:
    pytest.skip("log_softmax over a middle axis: row kernels take trailing axes only (kernel_walk._RowKernel)")
  ours, theirs = LOSSES[name]
  x_np = rand(*shape, seed=sum(shape)) * 3
  indices, probabilities = _class_targets(shape, seed=len(shape))
  x, i, p = Tensor(x_np, requires_grad=True), Tensor(indices), Tensor(probabilities)
  assert kernels_of([ours(x, i, p)]) == 1
  loss = ours(x, i, p)
  assert realize_counting([loss]) == 1
  x_torch = torch.tensor(x_np, requires_grad=True)
  expected = theirs(x_torch, torch.tensor(indices).long(), torch.tensor(probabilities))
  np.testing.assert_allclose(loss.numpy(), expected.detach().numpy(), rtol=2e-5, atol=2e-5)
  loss.backward()
  expected.backward()
  np.testing.assert_allclose(x.grad.numpy(), x_torch.grad.numpy(), rtol=2e-5, atol=2e-6)


def test_sparse_categorical_crossentropy_is_one_kernel():
  x_np = rand(16, 12, seed=4)
  indices, _ = _class_targets((16, 12), seed=5)
  loss = Tensor(x_np).sparse_categorical_crossentropy(Tensor(indices))
  assert realize_counting([loss]) == 1
  expected = torch.nn.functional.cross_entropy(torch.tensor(x_np), torch.tensor(indices).long())
  np.testing.assert_allclose(loss.numpy(), expected.numpy(), rtol=2e-5)


def test_final_reduces_of_other_row_reductions_and_where_they_stay_apart():
  x_np = rand(8, 6, seed=8)
  x = Tensor(x_np)
  assert realize_counting([out := x.sum(1).max()]) == 1   # a final MAX of the rows' sums
  np.testing.assert_allclose(out.numpy(), x_np.sum(1).max(), rtol=1e-5)
  assert realize_counting([out := x.std(1).mean()]) == 1
  np.testing.assert_allclose(out.numpy(), x_np.std(1, ddof=1).mean(), rtol=1e-5)
  # the inner reduce is over the leading axis: no row kernel; with atomics its last block finishes the sum
  one_kernel = Device[x.device].renderer.has_block_atomics
  assert realize_counting([out := x.sum(0).sum()]) == (1 if one_kernel else 2)
  np.testing.assert_allclose(out.numpy(), x_np.sum(), rtol=1e-5)
  row_sums = x.sum(1)
  outs = [row_sums, row_sums.max()]   # the rows' sums are an output: the final reduce reads them from memory
  assert realize_counting(outs) == (1 if one_kernel else 2)   # with atomics: the row sums' kernel's last block
  np.testing.assert_allclose(outs[1].numpy(), x_np.sum(1).max(), rtol=1e-5)


def test_a_loss_over_a_loop_beyond_the_final_reduce_limit_is_two_kernels(monkeypatch: pytest.MonkeyPatch):
  """One thread (CPU) or one block (GPU) runs the rows of a kernel with final reduces: beyond the limit the rows keep
  their parallel kernel and the mean is a second one."""
  monkeypatch.setattr(kernel_walk, "MAX_FINAL_REDUCE_ELEMENTS", 64)
  x_np = rand(8, 10, seed=6)
  indices, _ = _class_targets((8, 10), seed=7)
  loss = Tensor(x_np).cross_entropy(Tensor(indices))
  assert realize_counting([loss]) == 2
  expected = torch.nn.functional.cross_entropy(torch.tensor(x_np), torch.tensor(indices).long())
  np.testing.assert_allclose(loss.numpy(), expected.numpy(), rtol=2e-5)


def test_rows_longer_than_the_limit_fall_back_to_one_reduce_kernels(monkeypatch):
  """On a CPU (a thread loops over its row once per reduce); a GPU block streams a row of any length (the max and
  the sum of exps in one pass, codegen/online_rows.py): one kernel there."""
  monkeypatch.setattr(kernel_walk, "MAX_ROW_FUSION_LENGTH", 8)
  x_np = rand(6, 16, seed=9)
  x = Tensor(x_np)
  assert kernels_of([x.softmax(-1)]) == (1 if Device[x.device].renderer.has_threads else 3)
  np.testing.assert_allclose(x.softmax(-1).numpy(), torch.tensor(x_np).softmax(-1).numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("row_kernels")
def test_row_kernel_with_several_outputs_of_its_rows():
  # a tensor and its statistics: the normalized rows (per element) and the row sums (per row) are two kernels
  x_np = rand(8, 12, seed=10)
  x = Tensor(x_np)
  outs = [x.softmax(-1), x.sum(-1)]
  assert realize_counting(outs) == 2
  np.testing.assert_allclose(outs[0].numpy(), torch.tensor(x_np).softmax(-1).numpy(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(outs[1].numpy(), x_np.sum(-1), rtol=1e-5, atol=1e-5)


def test_softmax_backward_matches_torch():
  x_np, g_np = rand(8, 20, seed=11), rand(8, 20, seed=12)
  x = Tensor(x_np, requires_grad=True)
  (x.softmax(-1) * Tensor(g_np)).sum().backward()
  t = torch.tensor(x_np, requires_grad=True)
  (t.softmax(-1) * torch.tensor(g_np)).sum().backward()
  assert x.grad is not None and t.grad is not None
  np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_conv_batchnorm_pool_gradients_match_torch():
  # a reduce over leading and interleaved axes (batchnorm's (0, 2, 3)) in a CNN's backward: row kernels fuse only
  # reduces over trailing axes (a wrong weight gradient came out of the interleaved case, docs/fusion.md)
  torch.manual_seed(0)
  conv = torch.nn.Conv2d(1, 4, 3, padding=1)
  x_np = rand(3, 1, 8, 8, seed=13)
  t = torch.tensor(x_np)
  weight = torch.tensor(conv.weight.detach().numpy(), requires_grad=True)
  out_t = torch.nn.functional.conv2d(t, weight, conv.bias.detach(), padding=1)
  out_t = torch.nn.functional.max_pool2d(torch.nn.functional.batch_norm(out_t, None, None, training=True), 2)
  out_t.sum().backward()
  w = Tensor(conv.weight.detach().numpy(), requires_grad=True)
  out = Tensor(x_np).conv2d(w, Tensor(conv.bias.detach().numpy()), padding=1)
  mean = out.mean((0, 2, 3), keepdim=True)
  normalized = (out - mean) * ((out - mean).square().mean((0, 2, 3), keepdim=True) + 1e-5).rsqrt()
  normalized.max_pool2d(2).sum().backward()
  assert w.grad is not None and weight.grad is not None
  np.testing.assert_allclose(w.grad.numpy(), weight.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_row_kernels_default_to_devices_with_rows_owned_by_a_thread_or_a_block(monkeypatch: pytest.MonkeyPatch):
  """By default a CPU fuses softmax into one row kernel (a thread per row) and so does a GPU-style device with local
  memory (PYTHON, CUDA: a block per row, codegen/row_blocks.py); ROW_KERNELS forces either way."""
  from ourgrad.engine.kernel_walk import row_kernels_enabled
  monkeypatch.delenv("ROW_KERNELS", raising=False)
  assert row_kernels_enabled("CLANG") and row_kernels_enabled("PYTHON")
  x_np = np.random.default_rng(11).standard_normal((8, 24)).astype(np.float32)
  assert kernels_of([Tensor(x_np, device="CLANG").softmax(-1)]) == 1
  assert kernels_of([Tensor(x_np, device="PYTHON").softmax(-1)]) == 1
  monkeypatch.setenv("ROW_KERNELS", "0")
  assert kernels_of([Tensor(x_np, device="CLANG").softmax(-1)]) == 3
  assert kernels_of([Tensor(x_np, device="PYTHON").softmax(-1)]) == 3


def test_grouping_that_would_order_an_assign_in_a_cycle_is_dropped():
  """Found by fuzz_schedule (seed 1, case 16): `a` reads v's old contents, so it must run before the assign into v;
  `b` reads the result of that assign. Packing `a` and `b` (same shape) into one kernel has no run order."""
  rng = np.random.default_rng(16)
  first, second = rng.integers(-9, 9, (4, 5)).astype(np.int32), rng.integers(-9, 9, (4, 5)).astype(np.int32)
  row = rng.integers(-9, 9, 4).astype(np.int32)
  target, rows, v = Tensor(first), Tensor(second), Tensor(row)
  target.assign(rows).realize()
  a = Tensor(rows.lazydata)
  a[-3, :4] = v                        # reads v's old contents
  whole = Tensor(v.lazydata)
  whole[:] = v[0].contiguous()         # overwrites v
  b = Tensor(target.lazydata)
  b[1, 1:] = whole.abs()               # reads v's new contents
  Tensor.realize_all(a, whole, b)
  expected_a, expected_v, expected_b = second.copy(), np.full(4, row[0]), second.copy()
  expected_a[-3, :4] = row
  expected_b[1, 1:] = np.abs(expected_v)
  np.testing.assert_array_equal(a.numpy(), expected_a)
  np.testing.assert_array_equal(whole.numpy(), expected_v)
  np.testing.assert_array_equal(b.numpy(), expected_b)


def test_assign_of_a_reduce_of_its_own_target_broadcast_back():
  """Found by fuzz_schedule (seed 0, case 26): x.assign(x.sum()) broadcasts a reduce of the target back over it; as
  a row kernel the assign's hazard check failed with a ShapeError."""
  values = np.array([True, False, False])
  x = Tensor(values)
  x.assign(x.sum())
  joined = Tensor.cat([x, Tensor(np.array([False]))], dim=0)
  np.testing.assert_array_equal(joined.numpy(), np.append(np.full(3, values.sum() != 0), False))
