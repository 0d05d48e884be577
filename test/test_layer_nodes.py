"""LayerNorm and Linear as one autograd node each (tensor_nn.LayerNormalize, function.Linear): values and gradients as
PyTorch's, and the very graph the composed Tensor ops build (bitwise equal results, the same kernels; a GPT-2 training
run bitwise equal), with the composed path kept for what a node does not take (half precision, other shapes)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ourgrad import Tensor, dtypes
from ourgrad import tensor_nn, tensor_reduce
from ourgrad import function as autograd_functions
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


LINEAR_CASES = [((4, 6, 32), 24, True), ((5, 16), 8, False), ((2, 3, 4, 8), 1, True)]


def _linear_step(shape, outputs, with_bias, composed: bool, monkeypatch) -> tuple[list[np.ndarray], int, type | None]:
  """(value and gradients, kernels run, the result's Function class) of x.linear(weight, bias) read by a loss, with x
  (= input * 1.5) also read by the loss directly."""
  if composed: monkeypatch.setattr(tensor_reduce, "_one_linear_node", lambda *args: False)
  rng = np.random.default_rng(3)
  x = Tensor(rng.standard_normal(shape).astype(np.float32), requires_grad=True)
  weight = Tensor(rng.standard_normal((outputs, shape[-1])).astype(np.float32), requires_grad=True)
  bias = Tensor(rng.standard_normal(outputs).astype(np.float32), requires_grad=True) if with_bias else None
  scaled = x * 1.5
  y = scaled.linear(weight, bias)
  node = type(y._ctx)
  grad = Tensor(rng.standard_normal(y.shape).astype(np.float32))
  GlobalCounters.reset()
  ((y * grad).sum() + scaled.sum()).backward()
  values = [y.numpy(), x.grad.numpy(), weight.grad.numpy()] + ([bias.grad.numpy()] if with_bias else [])
  monkeypatch.undo()
  return values, GlobalCounters.kernel_count, node


@pytest.mark.parametrize("shape, outputs, with_bias", LINEAR_CASES)
def test_linear_node_builds_the_composed_graph_and_matches_torch(shape, outputs, with_bias, monkeypatch):
  fused, fused_kernels, node = _linear_step(shape, outputs, with_bias, False, monkeypatch)
  composed, composed_kernels, composed_node = _linear_step(shape, outputs, with_bias, True, monkeypatch)
  assert node is autograd_functions.Linear and composed_node is not autograd_functions.Linear
  for ours, theirs in zip(fused, composed): np.testing.assert_array_equal(ours, theirs)
  assert fused_kernels == composed_kernels
  rng = np.random.default_rng(3)
  x = torch.tensor(rng.standard_normal(shape).astype(np.float32), requires_grad=True)
  weight = torch.tensor(rng.standard_normal((outputs, shape[-1])).astype(np.float32), requires_grad=True)
  bias = torch.tensor(rng.standard_normal(outputs).astype(np.float32), requires_grad=True) if with_bias else None
  scaled = x * 1.5
  y = torch.nn.functional.linear(scaled, weight, bias)
  ((y * torch.tensor(rng.standard_normal(y.shape).astype(np.float32))).sum() + scaled.sum()).backward()
  expected = [y.detach().numpy(), x.grad.numpy(), weight.grad.numpy()] + ([bias.grad.numpy()] if with_bias else [])
  for ours, theirs in zip(fused, expected): np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["1-d input", "half weight", "bias of another shape", "inner sizes differ"])
def test_what_the_linear_node_does_not_take_goes_the_matmul_way(case):
  rng = np.random.default_rng(4)
  x = Tensor(rng.standard_normal((8,) if case == "1-d input" else (3, 8)).astype(np.float32))
  weight = Tensor(rng.standard_normal((5, 8)).astype(np.float32))
  bias = Tensor(rng.standard_normal((3, 5) if case == "bias of another shape" else 5).astype(np.float32))
  if case == "half weight": weight = weight.cast(dtypes.float16)
  if case == "inner sizes differ":
    with pytest.raises(Exception, match="inner dimensions"): x.linear(Tensor(np.zeros((5, 7), np.float32)))
    return
  y = x.linear(weight, bias)
  assert type(y._ctx) is not autograd_functions.Linear
  reference = x.numpy() @ weight.numpy().astype(np.float32).T + bias.numpy()
  np.testing.assert_allclose(y.numpy().astype(np.float32), reference, rtol=1e-2, atol=1e-2)


def test_gpt2_training_is_bitwise_the_composed_graphs(monkeypatch):
  """Three AdamW steps of a tiny GPT-2 (residuals read by a LayerNorm and an add: their gradients summed in the order
  the composed graph summed them) give the same losses and parameters, bit for bit, with and without the nodes."""
  from extra.models.gpt2 import GPT2, GPT2Config, configure_optimizers, training_step

  def run() -> tuple[list[float], list[np.ndarray]]:
    Tensor.manual_seed(0)
    model = GPT2(GPT2Config(block_size=32, vocab_size=128, n_layer=2, n_head=2, n_embd=32))
    step = training_step(model, configure_optimizers(model))
    tokens = np.random.default_rng(0).integers(0, 128, (2, 17)).astype(np.int32)
    inputs, targets = Tensor(tokens[:, :-1].copy()).realize(), Tensor(tokens[:, 1:].copy()).realize()
    losses = [step(inputs, targets).item() for _ in range(3)]
    return losses, [parameter.numpy() for parameter in model.parameters()]
  losses, parameters = run()
  monkeypatch.setattr(tensor_nn, "_one_layernorm_node", lambda *args: False)
  monkeypatch.setattr(tensor_reduce, "_one_linear_node", lambda *args: False)
  composed_losses, composed_parameters = run()
  assert losses == composed_losses
  for ours, theirs in zip(parameters, composed_parameters): np.testing.assert_array_equal(ours, theirs)


def test_tanh_gelu_built_on_lazy_buffers_is_the_composed_graph_and_torch(monkeypatch):
  from ourgrad.lazy import LazyBuffer
  values = np.linspace(-6, 6, 97, dtype=np.float32).reshape(1, 97)

  def run() -> tuple[np.ndarray, np.ndarray]:
    x = Tensor(values, requires_grad=True)
    y = (x * 1.0).gelu(approximate="tanh")
    (y * Tensor(values + 2)).sum().backward()
    return y.numpy(), x.grad.numpy()
  lazy_value, lazy_grad = run()
  # the composed path: gelu's Tensor ops, taken where the input is no single-device lazy buffer
  import ourgrad.tensor_activation as activation
  monkeypatch.setattr(activation, "LazyBuffer", type("NotALazyBuffer", (), {}))
  composed_value, composed_grad = run()
  monkeypatch.undo()
  assert LazyBuffer is activation.LazyBuffer
  np.testing.assert_array_equal(lazy_value, composed_value)
  np.testing.assert_array_equal(lazy_grad, composed_grad)
  x = torch.tensor(values, requires_grad=True)
  y = torch.nn.functional.gelu(x, approximate="tanh")
  (y * torch.tensor(values + 2)).sum().backward()
  np.testing.assert_allclose(lazy_value, y.detach().numpy(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lazy_grad, x.grad.numpy(), rtol=1e-4, atol=1e-5)
