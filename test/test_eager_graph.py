"""Graph building remembered across eager steps gives what building it afresh gives (PyTorch on the CPU as the
reference): max pooling's window ranks (a lazy graph of constants, tensor_windows.window_ranks) are built once per
device and geometry, read again by later steps, and never read once a schedule realized a base of them."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from ourgrad import Tensor
from ourgrad import tensor_windows
from ourgrad.errors import AutogradError
from ourgrad.helpers import clear_caches
from ourgrad.lazy import LazyBuffer


def _pool_step(values: np.ndarray, upstream: np.ndarray, x: Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
  """max_pool2d (kernel 2, stride 2, padding 1) forward and input gradient of `values` (in `x` when given)."""
  x = Tensor(values, requires_grad=True) if x is None else x
  out = x.max_pool2d(kernel_size=2, stride=2, padding=1)
  (out * Tensor(upstream)).sum().backward()
  return out.numpy(), x.grad.numpy()


def _torch_pool_step(values: np.ndarray, upstream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  x = torch.tensor(values, requires_grad=True)
  out = TF.max_pool2d(x, kernel_size=2, stride=2, padding=1)
  (out * torch.tensor(upstream)).sum().backward()
  return out.detach().numpy(), x.grad.numpy()


def _cached_ranks() -> list[LazyBuffer]: return [ranks for ranks, _ in tensor_windows._WINDOW_RANKS.values()]


def test_max_pool_ranks_are_remembered_and_stay_right_across_steps():
  clear_caches()
  rng = np.random.default_rng(0)
  shape, out_shape = (2, 3, 7, 6), (2, 3, 4, 4)
  # ties (rounded values) make the ranks decide which element gets the gradient
  first = np.round(rng.standard_normal(shape), 1).astype(np.float32)
  upstream = rng.standard_normal(out_shape).astype(np.float32)
  for ours, theirs in zip(_pool_step(first, upstream), _torch_pool_step(first, upstream)):
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
  assert len(_cached_ranks()) == 1
  remembered = _cached_ranks()[0]
  # the same geometry again, other values (ties, a NaN) in a tensor whose memory is then written in place
  second = np.round(rng.standard_normal(shape), 0).astype(np.float32)
  second[0, 0, 3, 3] = np.nan
  x = Tensor(first, requires_grad=True)
  x.assign(Tensor(second))
  ours = _pool_step(second, upstream, x)
  assert _cached_ranks() == [remembered]   # read again, not rebuilt
  for mine, theirs in zip(ours, _torch_pool_step(second, upstream)):
    np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-6)


def test_max_pool_ranks_are_rebuilt_once_a_base_of_them_was_realized():
  clear_caches()
  rng = np.random.default_rng(1)
  values = np.round(rng.standard_normal((1, 2, 6, 6)), 1).astype(np.float32)
  upstream = rng.standard_normal((1, 2, 4, 4)).astype(np.float32)
  _pool_step(values, upstream)
  (remembered,) = _cached_ranks()
  Tensor(remembered).realize()   # its memory now belongs to that schedule: never read through the cache again
  ours = _pool_step(values, upstream)
  assert _cached_ranks() != [remembered]
  for mine, theirs in zip(ours, _torch_pool_step(values, upstream)):
    np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-6)


def test_max_pool_ranks_are_kept_per_geometry():
  clear_caches()
  rng = np.random.default_rng(2)
  for shape in ((1, 1, 6, 6), (1, 1, 8, 6), (2, 1, 6, 6)):
    values = rng.standard_normal(shape).astype(np.float32)
    x = Tensor(values, requires_grad=True)
    out = x.max_pool2d(kernel_size=2, stride=2, padding=1)
    out.sum().backward()
    theirs_x = torch.tensor(values, requires_grad=True)
    TF.max_pool2d(theirs_x, kernel_size=2, stride=2, padding=1).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), theirs_x.grad.numpy(), rtol=1e-6, atol=1e-6)
  assert len(_cached_ranks()) == 3


def test_stride_one_conv_weight_gradient_reads_the_forward_windows():
  # the backward multiplies the forward's pooling view of x (StrideOneConv keeps it) instead of building it again:
  # gradients as PyTorch's, with groups, dilation and uneven padding
  rng = np.random.default_rng(3)
  values, weights = rng.standard_normal((2, 4, 9, 8)).astype(np.float32), rng.standard_normal((6, 2, 3, 2))
  weights = weights.astype(np.float32)
  upstream = rng.standard_normal((2, 6, 9, 9)).astype(np.float32)
  x, w = Tensor(values, requires_grad=True), Tensor(weights, requires_grad=True)
  out = x.conv2d(w, padding=(2, 1), dilation=(2, 1), groups=2)
  assert type(out._ctx).__name__ == "StrideOneConv" and out._ctx.windows.base is x.lazydata.base
  (out * Tensor(upstream)).sum().backward()
  theirs_x, theirs_w = torch.tensor(values, requires_grad=True), torch.tensor(weights, requires_grad=True)
  theirs = TF.conv2d(theirs_x, theirs_w, padding=(2, 1), dilation=(2, 1), groups=2)
  (theirs * torch.tensor(upstream)).sum().backward()
  np.testing.assert_allclose(out.numpy(), theirs.detach().numpy(), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(x.grad.numpy(), theirs_x.grad.numpy(), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(w.grad.numpy(), theirs_w.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_stride_one_conv_backward_after_writing_its_input_raises():
  x = Tensor(np.ones((1, 1, 5, 5), np.float32), requires_grad=True)
  w = Tensor(np.ones((1, 1, 3, 3), np.float32), requires_grad=True)
  hidden = x * 2
  out = hidden.conv2d(w)
  hidden.assign(Tensor(np.zeros((1, 1, 5, 5), np.float32)))   # the windows the backward would read are stale now
  with pytest.raises(AutogradError):
    out.sum().backward()


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_cross_entropy_of_class_indices_builds_no_log_softmax(monkeypatch: pytest.MonkeyPatch,
                                                              label_smoothing: float) -> None:
  """Index targets without class weights go through logsumexp minus the picked logit: the log_softmax graph that
  cross_entropy once built first for every target kind (and dropped unread) is not built at all."""
  rng = np.random.default_rng(0)
  logits, target = rng.standard_normal((6, 5)).astype(np.float32), rng.integers(0, 5, 6)
  def no_log_softmax(*args, **kwargs): raise AssertionError("log_softmax built")
  monkeypatch.setattr(Tensor, "log_softmax", no_log_softmax)
  x = Tensor(logits, requires_grad=True)
  loss = x.cross_entropy(Tensor(target.astype(np.int32)), label_smoothing=label_smoothing)
  loss.backward()
  reference = torch.tensor(logits, requires_grad=True)
  expected = TF.cross_entropy(reference, torch.tensor(target), label_smoothing=label_smoothing)
  expected.backward()
  np.testing.assert_allclose(loss.numpy(), expected.detach().numpy(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(x.grad.numpy(), reference.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("target_dtype", [np.int64, np.uint8, np.int16])
def test_cross_entropy_target_masks_in_any_integer_dtype(target_dtype: type) -> None:
  """The masks of the integer targets (one-hot, picked positions, ignored samples) are built on lazy buffers in a
  dtype that holds the class count: 300 classes with uint8 targets too; ignore_index samples are skipped."""
  rng = np.random.default_rng(1)
  classes = 300 if target_dtype is not np.uint8 else 256
  logits = rng.standard_normal((5, classes)).astype(np.float32)
  target = rng.integers(0, classes, 5).astype(target_dtype)
  target[2] = 7
  x = Tensor(logits, requires_grad=True)
  loss = x.cross_entropy(Tensor(target), ignore_index=7)
  loss.backward()
  reference = torch.tensor(logits, requires_grad=True)
  expected = TF.cross_entropy(reference, torch.tensor(target.astype(np.int64)), ignore_index=7)
  expected.backward()
  np.testing.assert_allclose(loss.numpy(), expected.detach().numpy(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(x.grad.numpy(), reference.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_batchnorm_training_builds_its_graphs_without_functions(monkeypatch: pytest.MonkeyPatch) -> None:
  """BatchNorm in training: the statistics, running-stat updates, normalization and backward are built on lazy
  buffers; the forward applies only its own Function (69 Functions for a forward and backward before; then 4, with
  the batch count's increment and the two stored statistics), the backward none. Values and gradients against torch."""
  import ourgrad.function as F
  from ourgrad import nn
  rng = np.random.default_rng(2)
  values, upstream = rng.standard_normal((3, 4, 5, 5)).astype(np.float32), rng.standard_normal((3, 4, 5, 5))
  applied: list[str] = []
  original = F.Function.apply.__func__   # type: ignore[attr-defined]

  def counting_apply(cls: type, *tensors: Tensor, **kwargs: object) -> Tensor:
    applied.append(cls.__name__)
    return original(cls, *tensors, **kwargs)

  norm, x = nn.BatchNorm2d(4), Tensor(values, requires_grad=True)
  with Tensor.train():
    monkeypatch.setattr(F.Function, "apply", classmethod(counting_apply))
    out = norm(x)
    monkeypatch.undo()
    loss = (out * Tensor(upstream.astype(np.float32))).sum()
    monkeypatch.setattr(F.Function, "apply", classmethod(counting_apply))
    forward_functions = list(applied)
    applied.clear()
    loss.backward()
    monkeypatch.undo()
  assert forward_functions == ["BatchNormNormalize"], forward_functions
  assert applied == [], applied
  reference_norm, reference_x = torch.nn.BatchNorm2d(4), torch.tensor(values, requires_grad=True)
  reference = reference_norm(reference_x)
  (reference * torch.tensor(upstream, dtype=torch.float32)).sum().backward()
  np.testing.assert_allclose(out.numpy(), reference.detach().numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(x.grad.numpy(), reference_x.grad.numpy(), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(norm.weight.grad.numpy(), reference_norm.weight.grad.numpy(), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(norm.running_var.numpy(), reference_norm.running_var.numpy(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(norm.running_mean.numpy(), reference_norm.running_mean.numpy(), rtol=1e-5, atol=1e-6)
  assert norm.num_batches_tracked.numpy() == reference_norm.num_batches_tracked.numpy() == 1
