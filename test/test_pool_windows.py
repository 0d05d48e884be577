"""Pooling windows planned once per geometry and differentiated as one node (ourgrad/tensor_windows.py): values and
gradients against PyTorch on the CPU, the gradient bit for bit the one the movement ops' own Functions give, and the
number of Functions a max pooling applies."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import ourgrad.function as F
from ourgrad import Tensor
from ourgrad.lazy_moves import apply_moves
from ourgrad.tensor_windows import MovedView, window_moves


def _grads(make: object, values: np.ndarray, upstream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  x = Tensor(values, requires_grad=True)
  out = make(x)
  (out * Tensor(upstream)).sum().backward()
  return out.numpy(), x.grad.numpy()


@pytest.mark.parametrize("kernel, stride, dilation, padding, size", [
  (2, 2, 1, 0, (7, 6)),    # windows apart, an odd size cropped (a negative pad in the chain)
  (3, 2, 1, 1, (7, 6)),    # overlapping windows (a tiling expand in the chain), padded
  (2, 1, 2, 0, (6, 5)),    # dilated
])
def test_max_pool_values_and_gradients_match_torch(kernel: int, stride: int, dilation: int, padding: int,
                                                   size: tuple[int, int]) -> None:
  rng = np.random.default_rng(0)
  values = np.round(rng.standard_normal((2, 3, *size)), 1).astype(np.float32)   # ties: the ranks pick
  def pool(x: Tensor) -> Tensor: return x.max_pool2d(kernel, stride, padding, dilation)
  reference = torch.tensor(values, requires_grad=True)
  expected = TF.max_pool2d(reference, kernel, stride, padding, dilation)
  upstream = rng.standard_normal(tuple(expected.shape)).astype(np.float32)
  (expected * torch.tensor(upstream)).sum().backward()
  out, grad = _grads(pool, values, upstream)
  np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(grad, reference.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_strided_conv_avg_pool_and_unfold_gradients_match_torch() -> None:
  """The other users of the windows on tensors: a stride-2 convolution (differentiated through the view), average
  pooling and Tensor.unfold."""
  rng = np.random.default_rng(1)
  values, weights = rng.standard_normal((2, 2, 7, 7)).astype(np.float32), rng.standard_normal((3, 2, 3, 3))
  weights = weights.astype(np.float32)
  cases = [(lambda x: x.conv2d(Tensor(weights), stride=2, padding=1),
            lambda x: TF.conv2d(x, torch.tensor(weights), stride=2, padding=1)),
           (lambda x: x.avg_pool2d(3, 2), lambda x: TF.avg_pool2d(x, 3, 2)),
           (lambda x: x.unfold(3, 3, 2), lambda x: x.unfold(3, 3, 2))]
  for ours, theirs in cases:
    reference = torch.tensor(values, requires_grad=True)
    expected = theirs(reference)
    upstream = rng.standard_normal(tuple(expected.shape)).astype(np.float32)
    (expected * torch.tensor(upstream)).sum().backward()
    out, grad = _grads(ours, values, upstream)
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad, reference.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel, stride, dilation, pads", [((3, 2), (2, 2), (1, 1), ((1, 1), (0, -1))),
                                                            ((2, 2), (2, 2), (1, 1), ((0, 0), (0, 0)))])
def test_moved_view_gradient_is_the_movement_functions_gradient(kernel: tuple[int, ...], stride: tuple[int, ...],
                                                                dilation: tuple[int, ...],
                                                                pads: tuple[tuple[int, int], ...]) -> None:
  """One MovedView node gives bit for bit the gradient that the chain's moves give as Tensor ops (a Function each):
  pad and shrink, reshape, permute and a tiling expand summed back."""
  rng = np.random.default_rng(2)
  values = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
  chain = window_moves(values.shape, kernel, stride, dilation, pads)
  names = [name for name, _ in chain.moves]
  assert len(chain.moves) >= 3 and ("expand" in names) == (kernel[0] > stride[0])
  upstream = None
  grads = []
  for view in (lambda x: MovedView.apply(x, chain=chain), lambda x: apply_moves(x, chain.moves)):
    x = Tensor(values, requires_grad=True)
    out = view(x)
    if upstream is None: upstream = rng.standard_normal(out.shape).astype(np.float32)
    (out * Tensor(upstream)).sum().backward()
    grads.append(x.grad.numpy())
  np.testing.assert_array_equal(grads[0], grads[1])


def test_max_pool_applies_one_function_for_its_windows(monkeypatch: pytest.MonkeyPatch) -> None:
  """max_pool2d's window view is one MovedView (a pad, reshape, shrink and permute Function each before), and the
  chain is planned once per geometry."""
  applied: list[str] = []
  original = F.Function.apply.__func__   # type: ignore[attr-defined]

  def counting_apply(cls: type, *tensors: Tensor, **kwargs: object) -> Tensor:
    applied.append(cls.__name__)
    return original(cls, *tensors, **kwargs)
  x = Tensor(np.ones((2, 3, 7, 6), np.float32), requires_grad=True)
  x.max_pool2d(2)   # (the window ranks of this geometry built and remembered: their graph applies Functions of its own)
  monkeypatch.setattr(F.Function, "apply", classmethod(counting_apply))
  x.max_pool2d(2)
  monkeypatch.undo()
  assert applied == ["MovedView", "MaxToOne", "Reshape"], applied
  assert window_moves((2, 3, 7, 6), (2, 2), (2, 2), (1, 1)) is window_moves((2, 3, 7, 6), (2, 2), (2, 2), (1, 1))


def test_a_lazy_input_is_viewed_once_through_the_composed_tracker() -> None:
  """On a lazy buffer (a base, or a view of one) the chain is one view whose tracker the moves compose to, remembered
  per input tracker; a constant's storage goes move by move (it tracks its views)."""
  from ourgrad.tensor_windows import moved
  base = Tensor(np.arange(2 * 3 * 7 * 6, dtype=np.float32).reshape(2, 3, 7, 6)).lazydata
  chain = window_moves((2, 3, 6, 7), (3, 2), (2, 2), (1, 1), ((1, 1), (0, -1)))
  for lazy in (base.permute((0, 1, 3, 2)), base.reshape((2, 3, 6, 7))):
    viewed = moved(lazy, chain)
    assert viewed.st == apply_moves(lazy, chain.moves).st and viewed.base is base
    assert moved(lazy, chain).st is viewed.st
  constant = Tensor.full((2, 3, 6, 7), 2.0).lazydata
  expected = Tensor(apply_moves(constant, chain.moves)).numpy()
  np.testing.assert_array_equal(Tensor(moved(constant, chain)).numpy(), expected)
