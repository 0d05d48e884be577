"""LayerNorm as one autograd node (tensor_nn.LayerNormalize): values and gradients as PyTorch's layer_norm, and the
very graph the composed Tensor ops build (bitwise equal results, the same kernels), with the composed path kept for
what the node does not take (half precision, repeated axes)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ourgrad import Tensor, dtypes
from ourgrad import tensor_nn
from ourgrad.helpers import GlobalCounters
from ourgrad.nn import LayerNorm
from ourgrad.nn import functional as F

CASES = [((4, 6, 32), (-1,), True), ((3, 5, 7), (1, 2), True), ((8, 16), (-1,), False), ((2, 3, 9), (-1,), "bias")]


def _step(shape, axes, affine, composed: bool, monkeypatch) -> tuple[list[np.ndarray], int, type | None]:
  """(forward value and gradients, kernels run, the result's Function class) of a layernorm read by a loss, whose
  input x * 1.5 is also read by the loss directly (its gradient sums both)."""
  if composed: monkeypatch.setattr(tensor_nn, "_one_layernorm_node", lambda *args: False)
  rng = np.random.default_rng(0)
  x = Tensor(rng.standard_normal(shape).astype(np.float32) * 3 + 1, requires_grad=True)
  normalized = tuple(shape[axis] for axis in axes)
  weight = Tensor(rng.standard_normal(normalized).astype(np.float32), requires_grad=True) if affine is True else None
  bias = Tensor(rng.standard_normal(normalized).astype(np.float32), requires_grad=True) if affine else None
  scaled = x * 1.5
  y = scaled.layernorm(axes, 1e-5, weight, bias)
  node = type(y._ctx)
  grad = Tensor(rng.standard_normal(shape).astype(np.float32))
  GlobalCounters.reset()
  ((y * grad).sum() + scaled.sum()).backward()
  values = [y.numpy(), x.grad.numpy()] + [t.grad.numpy() for t in (weight, bias) if t is not None]
  monkeypatch.undo()
  return values, GlobalCounters.kernel_count, node


@pytest.mark.parametrize("shape, axes, affine", CASES)
def test_one_node_builds_the_composed_graph(shape, axes, affine, monkeypatch):
  fused, fused_kernels, node = _step(shape, axes, affine, False, monkeypatch)
  composed, composed_kernels, composed_node = _step(shape, axes, affine, True, monkeypatch)
  assert node is tensor_nn.LayerNormalize and composed_node is not tensor_nn.LayerNormalize
  for ours, theirs in zip(fused, composed): np.testing.assert_array_equal(ours, theirs)
  assert fused_kernels == composed_kernels


@pytest.mark.parametrize("shape, axes, affine", CASES)
def test_values_and_gradients_match_torch(shape, axes, affine, monkeypatch):
  values, _, _ = _step(shape, axes, affine, False, monkeypatch)
  rng = np.random.default_rng(0)
  x = torch.tensor(rng.standard_normal(shape).astype(np.float32) * 3 + 1, requires_grad=True)
  normalized = tuple(shape[axis] for axis in axes)
  weight = torch.tensor(rng.standard_normal(normalized).astype(np.float32), requires_grad=True) if affine is True \
      else None
  bias = torch.tensor(rng.standard_normal(normalized).astype(np.float32), requires_grad=True) if affine else None
  scaled = x * 1.5
  y = torch.nn.functional.layer_norm(scaled, normalized, weight, bias, 1e-5)
  ((y * torch.tensor(rng.standard_normal(shape).astype(np.float32))).sum() + scaled.sum()).backward()
  expected = [y.detach().numpy(), x.grad.numpy()] + [t.grad.numpy() for t in (weight, bias) if t is not None]
  for ours, theirs in zip(values, expected): np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def test_module_and_functional_forms_use_the_node_and_match_torch():
  rng = np.random.default_rng(1)
  values = rng.standard_normal((2, 5, 12)).astype(np.float32)
  layer = LayerNorm(12)
  layer.weight.assign(Tensor(rng.standard_normal(12).astype(np.float32))).realize()
  layer.bias.assign(Tensor(rng.standard_normal(12).astype(np.float32))).realize()
  ours = layer(Tensor(values))
  functional = F.layer_norm(Tensor(values), 12, layer.weight, layer.bias)
  assert type(ours._ctx) is tensor_nn.LayerNormalize
  theirs = torch.nn.functional.layer_norm(torch.tensor(values), (12,), torch.tensor(layer.weight.numpy()),
                                          torch.tensor(layer.bias.numpy()))
  np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(functional.numpy(), ours.numpy())


@pytest.mark.parametrize("case", ["half input", "half weight", "weight growing the result"])
def test_what_the_node_does_not_take_goes_the_composed_way(case):
  rng = np.random.default_rng(2)
  values = rng.standard_normal((3, 8)).astype(np.float32)
  weight_values = rng.standard_normal(8).astype(np.float32)
  x, weight = Tensor(values, requires_grad=True), Tensor(weight_values, requires_grad=True)
  if case == "half input": x = x.cast(dtypes.float16)
  if case == "half weight": weight = weight.cast(dtypes.float16)
  if case == "weight growing the result": weight = Tensor(np.stack([weight_values] * 2)[:, None], requires_grad=True)
  y = x.layernorm(-1, 1e-5, weight)
  assert type(y._ctx) is not tensor_nn.LayerNormalize
  reference = torch.nn.functional.layer_norm(torch.tensor(x.numpy().astype(np.float32)), (8,)) * \
      torch.tensor(weight.numpy().astype(np.float32))
  tolerance = 1e-2 if case != "weight growing the result" else 1e-5
  np.testing.assert_allclose(y.numpy().astype(np.float32), reference.numpy(), rtol=tolerance, atol=tolerance)


def test_repeated_axes_raise_as_before():
  with pytest.raises(Exception, match="repeat"):
    Tensor(np.zeros((2, 3), np.float32)).layernorm((1, -1))
