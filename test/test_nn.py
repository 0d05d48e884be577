"""ourgrad.nn layers, losses and attention against PyTorch on the CPU.

Each layer runs with the SAME parameters as the torch module (ourgrad's initialized values are copied into it),
and both the forward values and the gradients of the input and of every parameter are compared, in training and
evaluation mode where the layer cares (BatchNorm running statistics over several steps included). Losses and
scaled_dot_product_attention are compared with torch.nn.functional in every mode (reductions, label smoothing,
ignore_index, probability targets, masks). Initialization is checked statistically.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from ourgrad import Tensor, dtypes
from ourgrad import nn
from ourgrad.errors import DTypeError, ShapeError
from ourgrad.nn import attention, losses
from ourgrad.nn.batchnorm import batch_statistics

ATOL, RTOL = 1e-4, 1e-4


def _random(shape: tuple[int, ...], seed: int, scale: float = 1.0, shift: float = 0.0) -> np.ndarray:
  return (np.random.default_rng(seed).standard_normal(shape) * scale + shift).astype(np.float32)


def _close(ours: Tensor | None, theirs: torch.Tensor | None, what: str, atol: float = ATOL, rtol: float = RTOL) -> None:
  assert ours is not None and theirs is not None, f"{what}: ours {ours is not None}, torch {theirs is not None}"
  assert ours.shape == tuple(theirs.shape), f"{what}: shape {ours.shape} != torch {tuple(theirs.shape)}"
  np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), atol=atol, rtol=rtol, err_msg=what)


def _copy_params(layer: Any, module: torch.nn.Module, names: tuple[str, ...]) -> None:
  """Give the torch module ourgrad's (initialized) values, so both compute with the same numbers."""
  with torch.no_grad():
    for name in names:
      ours = getattr(layer, name)
      getattr(module, name).copy_(torch.tensor(ours.numpy()))


def _zero_grads(layer: Any, module: torch.nn.Module, names: tuple[str, ...]) -> None:
  for name in names: getattr(layer, name).grad = None
  module.zero_grad()


def _backward_and_realize(out: Tensor, ref: torch.Tensor, seed: int, *leaves: Tensor) -> None:
  """Backpropagate the same random upstream gradient through both (sum() would give zero gradients through
  normalizations), then realize the output and the leaves' gradients in ONE schedule: shared intermediates are
  computed once, which keeps the number of kernels (and compile time) of the file down."""
  upstream = _random(tuple(ref.shape), seed)
  (out * Tensor(upstream)).sum().backward()
  (ref * torch.tensor(upstream)).sum().backward()
  Tensor.realize_all(out, *(leaf.grad for leaf in leaves if leaf.grad is not None))


def _check_step(layer: Callable[[Tensor], Tensor], module: Callable[[torch.Tensor], torch.Tensor], x_np: np.ndarray,
                param_names: tuple[str, ...] = (), atol: float = ATOL, rtol: float = RTOL, seed: int = 7) -> None:
  """One forward and backward through both: compare the output, the input's gradient and every parameter's
  gradient."""
  x, tx = Tensor(x_np, requires_grad=True), torch.tensor(x_np, requires_grad=True)
  out, ref = layer(x), module(tx)
  _backward_and_realize(out, ref, seed, x, *(getattr(layer, name) for name in param_names))
  _close(out, ref, "forward", atol, rtol)
  _close(x.grad, tx.grad, "grad of input", atol, rtol)
  for name in param_names: _close(getattr(layer, name).grad, getattr(module, name).grad, f"grad of {name}", atol, rtol)


def _check_layer(layer: Any, module: torch.nn.Module, x_np: np.ndarray, param_names: tuple[str, ...],
                 atol: float = ATOL, rtol: float = RTOL) -> None:
  _copy_params(layer, module, param_names)
  _check_step(layer, module, x_np, param_names, atol, rtol)


@pytest.fixture(autouse=True)
def _seed_and_mode() -> Any:
  """Every test starts seeded and in evaluation mode, and leaves the global flags as it found them."""
  Tensor.manual_seed(0)
  training = Tensor.training
  Tensor.training = False
  yield
  Tensor.training = training


# ---------------------------------------------------------------- linear and convolutions

@pytest.mark.parametrize("bias", [True, False])
def test_linear(bias: bool) -> None:
  layer = nn.Linear(6, 5, bias=bias)
  module = torch.nn.Linear(6, 5, bias=bias)
  _check_layer(layer, module, _random((2, 3, 6), 0), ("weight", "bias") if bias else ("weight",))
  assert (layer.bias is None) == (not bias)


@pytest.mark.parametrize("kwargs", [dict(), dict(stride=2, padding=1, dilation=2, groups=2), dict(padding="same")])
def test_conv1d(kwargs: dict) -> None:
  layer = nn.Conv1d(4, 6, 3, **kwargs)
  module = torch.nn.Conv1d(4, 6, 3, **kwargs)
  _check_layer(layer, module, _random((2, 4, 9), 1), ("weight", "bias"))


@pytest.mark.filterwarnings("ignore:Using padding='same'")  # torch's note about its own implementation
@pytest.mark.parametrize("kwargs", [dict(), dict(stride=2, padding=1, groups=2, bias=False),
                                    dict(kernel_size=(2, 3), padding="same", dilation=(1, 2))])
def test_conv2d(kwargs: dict) -> None:
  kwargs = {"kernel_size": 3, **kwargs}
  layer = nn.Conv2d(4, 6, **kwargs)
  module = torch.nn.Conv2d(4, 6, **kwargs)
  names = ("weight", "bias") if kwargs.get("bias", True) else ("weight",)
  _check_layer(layer, module, _random((2, 4, 7, 8), 2), names)


@pytest.mark.parametrize("kwargs", [dict(), dict(stride=2, padding=1, output_padding=1, groups=2)])
def test_conv_transpose2d(kwargs: dict) -> None:
  layer = nn.ConvTranspose2d(4, 6, 3, **kwargs)
  module = torch.nn.ConvTranspose2d(4, 6, 3, **kwargs)
  assert layer.weight.shape == tuple(module.weight.shape)
  _check_layer(layer, module, _random((2, 4, 5, 5), 3), ("weight", "bias"))


# ---------------------------------------------------------------- normalization

BN_PARAMS = ("weight", "bias")


def _check_running_stats(layer: Any, module: torch.nn.Module) -> None:
  _close(layer.running_mean, module.running_mean, "running_mean", 1e-5, 1e-4)
  _close(layer.running_var, module.running_var, "running_var", 1e-5, 1e-4)
  assert layer.num_batches_tracked.item() == module.num_batches_tracked.item()
  assert layer.num_batches_tracked.dtype == dtypes.int64 and layer.num_batches_tracked.shape == ()


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm2d_train_then_eval(momentum: float | None) -> None:
  layer = nn.BatchNorm2d(3, momentum=momentum)
  module = torch.nn.BatchNorm2d(3, momentum=momentum)
  # non-trivial affine parameters, so the gradients of weight and bias are really checked
  layer.weight.assign(Tensor([0.5, 1.5, -1.0])).realize()
  layer.bias.assign(Tensor([0.1, -0.2, 0.3])).realize()
  _copy_params(layer, module, BN_PARAMS)
  module.train()
  with Tensor.train():
    for step in range(3):
      _zero_grads(layer, module, BN_PARAMS)
      _check_step(layer, module, _random((4, 3, 5, 5), 10 + step, scale=2.0, shift=1.0), BN_PARAMS, seed=step)
      _check_running_stats(layer, module)
  module.eval()
  _zero_grads(layer, module, BN_PARAMS)
  _check_step(layer, module, _random((2, 3, 5, 5), 20), BN_PARAMS)
  _check_running_stats(layer, module)  # evaluation leaves them alone


def test_batchnorm1d_2d_and_3d_input() -> None:
  for shape in [(8, 5), (4, 5, 7)]:
    layer, module = nn.BatchNorm1d(5), torch.nn.BatchNorm1d(5)
    with Tensor.train():
      for step in range(2): _check_step(layer, module, _random(shape, 30 + step, shift=0.5), BN_PARAMS)
    _check_running_stats(layer, module)


@pytest.mark.parametrize("affine,track", [(False, True), (True, False)])
def test_batchnorm_options(affine: bool, track: bool) -> None:
  layer = nn.BatchNorm2d(3, affine=affine, track_running_stats=track)
  module = torch.nn.BatchNorm2d(3, affine=affine, track_running_stats=track)
  names = BN_PARAMS if affine else ()
  assert (layer.weight is None) == (not affine) and hasattr(layer, "running_mean") == track
  with Tensor.train(): _check_step(layer, module, _random((2, 3, 4, 4), 40), names)
  module.eval()
  # without running stats, evaluation also normalizes with the batch statistics
  _check_step(layer, module, _random((2, 3, 4, 4), 41, shift=3.0), names)


def test_batchnorm_training_needs_more_than_one_value() -> None:
  with Tensor.train(), pytest.raises(ValueError):
    nn.BatchNorm1d(3)(Tensor.randn(1, 3))


def _torch_batchnorm(ndim: int, channels: int, **kwargs: Any) -> torch.nn.Module:
  """torch's BatchNorm1d/2d/3d for an input of rank `ndim`, in float64: the reference for float32 statistics."""
  module_class = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}
  return module_class[ndim](channels, **kwargs).double()


def _close_to_scale(ours: Tensor | None, theirs: torch.Tensor | None, what: str, tolerance: float) -> None:
  """|ours - theirs| <= tolerance * (1 + max |theirs|) everywhere: float32 against a float64 reference."""
  assert ours is not None and theirs is not None, f"{what}: ours {ours is not None}, torch {theirs is not None}"
  reference = theirs.detach().numpy()
  assert ours.shape == reference.shape, f"{what}: shape {ours.shape} != torch {reference.shape}"
  bound = tolerance * (1.0 + np.abs(reference).max())
  np.testing.assert_allclose(ours.numpy(), reference, rtol=0, atol=bound, err_msg=what)


# shapes with N * (spatial) = 2 values per channel, 1d/2d/3d ranks, and inputs whose mean is 10^4 times their spread
# (the one-pass statistics shift by a sample of each channel; unshifted, E[x^2] - E[x]^2 would lose every digit)
@pytest.mark.parametrize("shape,scale,shift,affine,track", [
  ((2, 3), 1.0, 0.0, True, True), ((1, 4, 2), 2.0, 5.0, True, True), ((2, 3, 1, 1), 1.0, -1.0, False, True),
  ((5, 4, 3, 2), 0.5, 0.3, True, False), ((3, 2, 2, 3, 2), 2.0, -1.0, True, True),
  ((8, 3, 6, 6), 0.1, 1e3, True, True), ((16, 2, 50), 0.1, -1e3, False, False)])
def test_batchnorm_one_pass_statistics_and_analytic_backward(shape: tuple[int, ...], scale: float, shift: float,
                                                              affine: bool, track: bool) -> None:
  """Three training steps (values, gradients of input, weight and bias, running stats) and one evaluation step,
  against torch in float64 on the same float32 data."""
  channels, ndim = shape[1], len(shape)
  layer = nn.BatchNorm(channels, affine=affine, track_running_stats=track)
  module = _torch_batchnorm(ndim, channels, affine=affine, track_running_stats=track)
  names = BN_PARAMS if affine else ()
  for index, name in enumerate(names):
    getattr(layer, name).assign(Tensor(_random((channels,), 70 + index))).realize()
  _copy_params(layer, module, names)
  for step in range(4):
    training = step < 3
    module.train(training)
    _zero_grads(layer, module, names)
    x_np = _random(shape, 80 + step, scale, shift)
    x, tx = Tensor(x_np, requires_grad=True), torch.tensor(x_np, dtype=torch.float64, requires_grad=True)
    with Tensor.train(training):
      out = layer(x)
    ref = module(tx)
    _backward_and_realize(out, ref, 90 + step, x, *(getattr(layer, name) for name in names))
    _close_to_scale(out, ref, f"step {step}: forward", 1e-3)
    _close_to_scale(x.grad, tx.grad, f"step {step}: grad of input", 1e-3)
    for name in names:
      _close_to_scale(getattr(layer, name).grad, getattr(module, name).grad, f"step {step}: grad of {name}", 1e-3)
    if track:
      _close_to_scale(layer.running_mean, module.running_mean, f"step {step}: running_mean", 1e-5)
      _close_to_scale(layer.running_var, module.running_var, f"step {step}: running_var", 1e-4)


@pytest.mark.parametrize("seed", range(3))
def test_batchnorm_max_pool_backward_after_a_realized_forward(seed: int) -> None:
  """conv -> batchnorm -> relu -> max-pool with the forward realized before the backward is built (reading the loss
  first): the pool's backward recomputes its input and compares it with the forward's maxima for equality, so the
  batchnorm must normalize with the same stored mean and inverse std in both (nn/batchnorm.py stored_statistics;
  recomputed from the sums in one kernel and from a realized variance in the other, a window could miss its maximum
  and divide 0 by 0)."""
  Tensor.manual_seed(seed)
  conv, layer = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
  module = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4))
  _copy_params(conv, module[0], ("weight", "bias"))
  x_np, upstream = _random((3, 1, 8, 8), 110 + seed), _random((3, 4, 4, 4), 120 + seed)
  with Tensor.train():
    out = layer(conv(Tensor(x_np))).relu().max_pool2d(2)
  loss = (out * Tensor(upstream)).sum()
  ref = torch.nn.functional.max_pool2d(module(torch.tensor(x_np)).relu(), 2)
  (ref * torch.tensor(upstream)).sum().backward()
  np.testing.assert_allclose(loss.numpy(), (ref * torch.tensor(upstream)).sum().item(), rtol=1e-4, atol=1e-4)
  loss.backward()
  _close(conv.weight.grad, module[0].weight.grad, "grad of the conv weight", 1e-4, 1e-3)
  for name in BN_PARAMS: _close(getattr(layer, name).grad, getattr(module[1], name).grad, f"grad of {name}", 1e-4, 1e-3)


def test_batch_statistics_of_a_batch_sharded_input() -> None:
  """Sharded along the batch axis, one sample per channel would be a view across shards: the statistics shift by
  the mean instead (its own pass), and still match numpy."""
  x_np = _random((4, 3, 5, 5), 130, 0.1, 1e3)
  x = Tensor(x_np).shard(("CLANG:0", "CLANG:1"), axis=0)
  mean, var = batch_statistics(x)
  reference = x_np.astype(np.float64)
  np.testing.assert_allclose(mean.numpy(), reference.mean((0, 2, 3)), rtol=1e-6)
  np.testing.assert_allclose(var.numpy(), reference.var((0, 2, 3)), rtol=1e-3)


@pytest.mark.parametrize("input_grad,param_grad", [(True, False), (False, True)])
def test_batchnorm_gradients_of_some_inputs_only(input_grad: bool, param_grad: bool) -> None:
  layer, module = nn.BatchNorm2d(3), torch.nn.BatchNorm2d(3)
  for index, name in enumerate(BN_PARAMS):
    getattr(layer, name).assign(Tensor(_random((3,), 100 + index))).realize()
    getattr(layer, name).requires_grad = param_grad
  _copy_params(layer, module, BN_PARAMS)
  for name in BN_PARAMS: getattr(module, name).requires_grad_(param_grad)
  x_np = _random((4, 3, 3, 5), 102, 2.0, 1.0)
  x, tx = Tensor(x_np, requires_grad=input_grad), torch.tensor(x_np, requires_grad=input_grad)
  with Tensor.train():
    out = layer(x)
  ref = module(tx)
  leaves = [x] if input_grad else [getattr(layer, name) for name in BN_PARAMS]
  _backward_and_realize(out, ref, 103, *leaves)
  _close(out, ref, "forward")
  if input_grad: _close(x.grad, tx.grad, "grad of input")
  else: assert x.grad is None
  for name in BN_PARAMS:
    if param_grad: _close(getattr(layer, name).grad, getattr(module, name).grad, f"grad of {name}")
    else: assert getattr(layer, name).grad is None


@pytest.mark.parametrize("shape,affine,bias", [((6,), True, True), ((4, 6), True, True), ((6,), False, True),
                                               ((6,), True, False)])
def test_layernorm(shape: tuple[int, ...], affine: bool, bias: bool) -> None:
  layer = nn.LayerNorm(shape, elementwise_affine=affine, bias=bias)
  module = torch.nn.LayerNorm(shape, elementwise_affine=affine, bias=bias)
  names = tuple(n for n, present in (("weight", affine), ("bias", affine and bias)) if present)
  for name in names: getattr(layer, name).assign(Tensor(_random(getattr(layer, name).shape, 50))).realize()
  _check_layer(layer, module, _random((3, 4, 6), 51, scale=3.0, shift=1.0), names)


@pytest.mark.parametrize("groups,affine", [(2, True), (1, True), (6, False)])
def test_groupnorm(groups: int, affine: bool) -> None:
  layer = nn.GroupNorm(groups, 6, affine=affine)
  module = torch.nn.GroupNorm(groups, 6, affine=affine)
  names = BN_PARAMS if affine else ()
  for name in names: getattr(layer, name).assign(Tensor(_random((6,), 60))).realize()
  _check_layer(layer, module, _random((2, 6, 3, 4), 61, shift=1.0), names)


def test_instancenorm2d() -> None:
  layer, module = nn.InstanceNorm2d(3), torch.nn.InstanceNorm2d(3)
  assert layer.weight is None and not hasattr(layer, "running_mean")  # torch's defaults: no affine, no stats
  _check_step(layer, module, _random((2, 3, 4, 5), 70, shift=2.0))
  _check_step(layer, module, _random((3, 4, 5), 71))  # unbatched


def test_instancenorm2d_affine_running_stats() -> None:
  layer = nn.InstanceNorm2d(3, affine=True, track_running_stats=True)
  module = torch.nn.InstanceNorm2d(3, affine=True, track_running_stats=True)
  layer.weight.assign(Tensor([0.5, 1.5, -1.0])).realize()
  _copy_params(layer, module, BN_PARAMS)
  module.train()
  with Tensor.train():
    for step in range(2):
      _zero_grads(layer, module, BN_PARAMS)
      _check_step(layer, module, _random((2, 3, 4, 5), 72 + step, shift=1.0), BN_PARAMS)
  _check_running_stats(layer, module)
  module.eval()
  _zero_grads(layer, module, BN_PARAMS)
  _check_step(layer, module, _random((2, 3, 4, 5), 74), BN_PARAMS)


def test_instancenorm1d() -> None:
  _check_step(nn.InstanceNorm1d(3), torch.nn.InstanceNorm1d(3), _random((2, 3, 6), 75, shift=1.0))


@pytest.mark.parametrize("shape,eps", [((6,), 1e-6), ((4, 6), 1e-5), ((6,), None)])
def test_rmsnorm(shape: tuple[int, ...], eps: float | None) -> None:
  layer, module = nn.RMSNorm(shape, eps=eps), torch.nn.RMSNorm(shape, eps=eps)
  layer.weight.assign(Tensor(_random(shape, 80))).realize()
  _check_layer(layer, module, _random((3, 4, 6), 81), ("weight",))


def test_rmsnorm_without_affine_and_default_eps() -> None:
  assert nn.RMSNorm(6).eps == 1e-6
  layer = nn.RMSNorm(6, elementwise_affine=False)
  assert layer.weight is None
  _check_step(layer, torch.nn.RMSNorm(6, eps=1e-6, elementwise_affine=False), _random((2, 6), 82))


# ---------------------------------------------------------------- embedding and dropout

def test_embedding() -> None:
  layer, module = nn.Embedding(10, 4), torch.nn.Embedding(10, 4)
  _copy_params(layer, module, ("weight",))
  indices = np.array([[1, 3, 3, 9], [0, 3, 7, 1]])  # repeated indices accumulate their gradients
  out, ref = layer(Tensor(indices)), module(torch.tensor(indices))
  _backward_and_realize(out, ref, 90, layer.weight)
  _close(out, ref, "forward")
  _close(layer.weight.grad, module.weight.grad, "grad of weight")
  with pytest.raises(DTypeError): layer(Tensor([1.0, 2.0]))


def test_dropout() -> None:
  layer = nn.Dropout(0.25)
  x = Tensor.ones(200, 100)
  np.testing.assert_array_equal(layer(x).numpy(), 1.0)  # evaluation: identity
  with Tensor.train(): values = layer(x).numpy()
  kept = values != 0
  assert abs(kept.mean() - 0.75) < 0.02
  np.testing.assert_allclose(values[kept], 1 / 0.75, rtol=1e-6)
  with pytest.raises(ValueError): nn.Dropout(1.5)


# ---------------------------------------------------------------- initialization

def _check_uniform(weight: Tensor, bound: float) -> None:
  values = weight.numpy()
  assert np.abs(values).max() <= bound + 1e-7
  # uniform(-b, b): std b/sqrt(3) and mean 0, and the extremes get close to the bound (for enough samples)
  if values.size >= 1000:
    assert abs(values.std() - bound / math.sqrt(3)) < 0.03 * bound and abs(values.mean()) < 0.05 * bound
    assert np.abs(values).max() > 0.95 * bound


def test_linear_and_conv_init() -> None:
  linear = nn.Linear(64, 128)
  _check_uniform(linear.weight, 1 / math.sqrt(64))
  _check_uniform(linear.bias, 1 / math.sqrt(64))
  conv = nn.Conv2d(8, 64, 3, groups=2)  # fan_in = 8/2 * 3*3 = 36
  assert conv.weight.shape == (64, 4, 3, 3)
  _check_uniform(conv.weight, 1 / 6)
  _check_uniform(conv.bias, 1 / 6)
  conv1 = nn.Conv1d(8, 64, 5)
  _check_uniform(conv1.weight, 1 / math.sqrt(40))
  transpose = nn.ConvTranspose2d(64, 16, 3)  # PyTorch takes fan_in from weight dim 1: 16 * 3*3 = 144
  assert transpose.weight.shape == (64, 16, 3, 3)
  _check_uniform(transpose.weight, 1 / 12)
  _check_uniform(transpose.bias, 1 / 12)
  for tensor in (linear.weight, linear.bias, conv.weight, transpose.weight):
    assert tensor.requires_grad is True and tensor.dtype == dtypes.float32


def test_init_is_seeded() -> None:
  Tensor.manual_seed(3)
  first = nn.Linear(4, 4).weight.numpy()
  Tensor.manual_seed(3)
  np.testing.assert_array_equal(nn.Linear(4, 4).weight.numpy(), first)


def test_norm_and_embedding_init() -> None:
  bn = nn.BatchNorm2d(5)
  np.testing.assert_array_equal(bn.weight.numpy(), 1)
  np.testing.assert_array_equal(bn.bias.numpy(), 0)
  np.testing.assert_array_equal(bn.running_mean.numpy(), 0)
  np.testing.assert_array_equal(bn.running_var.numpy(), 1)
  assert bn.weight.requires_grad and bn.bias.requires_grad
  assert not bn.running_mean.requires_grad and not bn.running_var.requires_grad
  assert not bn.num_batches_tracked.requires_grad
  for layer in (nn.LayerNorm(5), nn.GroupNorm(1, 5), nn.InstanceNorm2d(5, affine=True)):
    np.testing.assert_array_equal(layer.weight.numpy(), 1)
    np.testing.assert_array_equal(layer.bias.numpy(), 0)
  np.testing.assert_array_equal(nn.RMSNorm(5).weight.numpy(), 1)
  weight = nn.Embedding(1000, 64).weight.numpy()
  assert abs(weight.mean()) < 0.02 and abs(weight.std() - 1) < 0.02


def test_parameters_are_attributes() -> None:
  """A state-dict walker over attributes finds the parameters under PyTorch's names."""
  pairs = [(nn.Linear(3, 2), torch.nn.Linear(3, 2)), (nn.Conv2d(2, 4, 3), torch.nn.Conv2d(2, 4, 3)),
           (nn.BatchNorm2d(3), torch.nn.BatchNorm2d(3)), (nn.LayerNorm(3), torch.nn.LayerNorm(3)),
           (nn.GroupNorm(1, 3), torch.nn.GroupNorm(1, 3)), (nn.Embedding(5, 3), torch.nn.Embedding(5, 3)),
           (nn.RMSNorm(3), torch.nn.RMSNorm(3))]
  for layer, module in pairs:
    ours = {name: value for name, value in vars(layer).items() if isinstance(value, Tensor)}
    theirs = module.state_dict()
    assert set(ours) == set(theirs), type(layer).__name__
    for name, value in ours.items(): assert value.shape == tuple(theirs[name].shape), (type(layer).__name__, name)


def test_layer_shape_errors() -> None:
  with pytest.raises(ShapeError): nn.Linear(3, 2)(Tensor.randn(2, 4))
  with pytest.raises(ShapeError): nn.BatchNorm2d(3)(Tensor.randn(2, 4, 5, 5))
  with pytest.raises(ShapeError): nn.LayerNorm(4)(Tensor.randn(2, 3))
  with pytest.raises(ShapeError): nn.GroupNorm(2, 4)(Tensor.randn(2, 3, 5))
  with pytest.raises(ValueError): nn.GroupNorm(3, 4)
  with pytest.raises(ValueError): nn.Conv2d(3, 4, 3, groups=2)


# ---------------------------------------------------------------- losses

def _check_loss(ours: Callable[..., Tensor], theirs: Callable[..., torch.Tensor], x_np: np.ndarray,
                *others: np.ndarray, atol: float = 1e-5, rtol: float = 1e-4) -> None:
  """Compare a loss and the gradient of its first argument (the others are targets, no gradient)."""
  x, tx = Tensor(x_np, requires_grad=True), torch.tensor(x_np, requires_grad=True)
  out, ref = ours(x, *(Tensor(o) for o in others)), theirs(tx, *(torch.tensor(o) for o in others))
  _backward_and_realize(out, ref, 5, x)
  _close(out, ref, "loss", atol, rtol)
  _close(x.grad, tx.grad, "grad of input", atol, rtol)


TARGETS = np.array([0, 4, 2, -100, 1, 4])
TARGETS_NO_IGNORE = np.array([0, 4, 2, 3, 1, 4])


# every reduction with label smoothing (which exercises all terms), and the plain loss once
@pytest.mark.parametrize("reduction,label_smoothing", [("mean", 0.0), ("mean", 0.2), ("sum", 0.2), ("none", 0.2)])
def test_cross_entropy_indices(reduction: str, label_smoothing: float) -> None:
  def check(ignore_index: int, target: np.ndarray) -> None:
    _check_loss(lambda x, t: losses.cross_entropy(x, t, reduction, label_smoothing, ignore_index),
                lambda x, t: TF.cross_entropy(x, t, reduction=reduction, label_smoothing=label_smoothing,
                                              ignore_index=ignore_index),
                _random((6, 5), 100, scale=3.0), target)
  check(-100, TARGETS)        # one sample ignored (default ignore_index)
  check(2, TARGETS_NO_IGNORE)   # a class index used as ignore_index


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_spatial_and_unbatched(reduction: str) -> None:
  target = np.random.default_rng(0).integers(0, 4, (2, 3, 5))
  target[0, 1, 2] = -100
  _check_loss(lambda x, t: losses.cross_entropy(x, t, reduction, 0.1),
              lambda x, t: TF.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1),
              _random((2, 4, 3, 5), 101), target)
  _check_loss(lambda x, t: losses.cross_entropy(x, t, reduction),
              lambda x, t: TF.cross_entropy(x, t, reduction=reduction), _random((4,), 102), np.array(3))


@pytest.mark.parametrize("reduction,label_smoothing", [("mean", 0.0), ("mean", 0.3), ("sum", 0.3), ("none", 0.3)])
def test_cross_entropy_probabilities(reduction: str, label_smoothing: float) -> None:
  probs = np.random.default_rng(1).dirichlet(np.ones(5), size=(3, 2)).astype(np.float32).transpose(0, 2, 1)
  _check_loss(lambda x, t: losses.cross_entropy(x, t, reduction, label_smoothing),
              lambda x, t: TF.cross_entropy(x, t, reduction=reduction, label_smoothing=label_smoothing),
              _random((3, 5, 2), 103, scale=2.0), np.ascontiguousarray(probs))


def test_cross_entropy_is_stable_and_all_ignored_is_nan() -> None:
  logits = np.array([[1000.0, 0.0, -1000.0], [0.0, 0.0, 0.0]], dtype=np.float32)
  _check_loss(losses.cross_entropy, TF.cross_entropy, logits, np.array([1, 2]))
  assert math.isnan(losses.cross_entropy(Tensor(logits), Tensor([-100, -100])).item())


def test_cross_entropy_errors() -> None:
  with pytest.raises(ShapeError): losses.cross_entropy(Tensor.randn(4, 3), Tensor([0, 1, 2]))
  with pytest.raises(ShapeError): losses.cross_entropy(Tensor.randn(4, 3), Tensor.rand(4, 2))
  with pytest.raises(ValueError): losses.cross_entropy(Tensor.randn(4, 3), Tensor([0, 1, 2, 0]), reduction="avg")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nll_loss(reduction: str) -> None:
  log_probs = torch.log_softmax(torch.tensor(_random((6, 5), 110)), 1).numpy()
  _check_loss(lambda x, t: losses.nll_loss(x, t, reduction), lambda x, t: TF.nll_loss(x, t, reduction=reduction),
              log_probs, TARGETS)
  _check_loss(lambda x, t: losses.nll_loss(x, t, reduction, ignore_index=4),
              lambda x, t: TF.nll_loss(x, t, reduction=reduction, ignore_index=4), log_probs, TARGETS_NO_IGNORE)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_sparse_categorical_crossentropy(label_smoothing: float) -> None:
  """tinygrad's name: classes on the last axis, ignore_index -1 by default."""
  target = np.array([[0, 4, -1], [2, 2, 1]])
  _check_loss(lambda x, t: losses.sparse_categorical_crossentropy(x, t, label_smoothing=label_smoothing),
              lambda x, t: TF.cross_entropy(x.permute(0, 2, 1), t, ignore_index=-1, label_smoothing=label_smoothing),
              _random((2, 3, 5), 120), target)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_binary_cross_entropy(reduction: str) -> None:
  rng = np.random.default_rng(130)
  probs = rng.uniform(0.05, 0.95, (4, 3)).astype(np.float32)
  target = rng.uniform(0, 1, (4, 3)).astype(np.float32)
  _check_loss(lambda x, t: losses.binary_cross_entropy(x, t, reduction),
              lambda x, t: TF.binary_cross_entropy(x, t, reduction=reduction), probs, target)
  # log(0) is clamped to -100, as in PyTorch
  edge = Tensor([0.0, 1.0], requires_grad=True)
  loss = losses.binary_cross_entropy(edge, Tensor([1.0, 0.0]), "none")
  np.testing.assert_allclose(loss.numpy(), [100, 100])
  loss.sum().backward()
  assert np.isfinite(edge.grad.numpy()).all()  # no nan from the clamped log


@pytest.mark.parametrize("reduction,pos_weight", [("mean", False), ("sum", False), ("none", False), ("mean", True),
                                                  ("none", True)])
def test_binary_cross_entropy_with_logits(reduction: str, pos_weight: bool) -> None:
  logits = _random((4, 3), 140, scale=3.0)
  logits[0] = [200.0, -200.0, 0.0]  # large logits: the stable form neither overflows nor loses the gradient
  target = np.random.default_rng(141).uniform(0, 1, (4, 3)).astype(np.float32)
  weights = np.array([0.5, 2.0, 3.0], dtype=np.float32)
  if pos_weight:
    _check_loss(lambda x, t, w: losses.binary_cross_entropy_with_logits(x, t, reduction, pos_weight=w),
                lambda x, t, w: TF.binary_cross_entropy_with_logits(x, t, reduction=reduction, pos_weight=w),
                logits, target, weights)
  else:
    _check_loss(lambda x, t: losses.binary_cross_entropy_with_logits(x, t, reduction),
                lambda x, t: TF.binary_cross_entropy_with_logits(x, t, reduction=reduction), logits, target)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss(reduction: str) -> None:
  _check_loss(lambda x, t: losses.mse_loss(x, t, reduction), lambda x, t: TF.mse_loss(x, t, reduction=reduction),
              _random((3, 4), 150), _random((3, 4), 151))
  with pytest.raises(ShapeError): losses.mse_loss(Tensor.randn(3, 1), Tensor.randn(3))


# ---------------------------------------------------------------- attention

def _check_attention(shapes: tuple[tuple[int, ...], ...], mask: np.ndarray | None = None, **kwargs: Any) -> None:
  """sdpa against torch's: the output and the gradients of q, k and v."""
  arrays = [_random(shape, 160 + number) for number, shape in enumerate(shapes)]
  ours = [Tensor(a, requires_grad=True) for a in arrays]
  theirs = [torch.tensor(a, requires_grad=True) for a in arrays]
  out = attention.scaled_dot_product_attention(*ours, attn_mask=None if mask is None else Tensor(mask), **kwargs)
  ref = TF.scaled_dot_product_attention(*theirs, attn_mask=None if mask is None else torch.tensor(mask), **kwargs)
  _backward_and_realize(out, ref, 170, *ours)
  _close(out, ref, "attention")
  for name, o, t in zip("qkv", ours, theirs): _close(o.grad, t.grad, f"grad of {name}")


QKV = ((2, 3, 4, 8), (2, 3, 6, 8), (2, 3, 6, 5))


def test_sdpa_plain_and_scale() -> None:
  _check_attention(QKV)
  _check_attention(((4, 8), (6, 8), (6, 8)), scale=0.3)  # no batch dims


def test_sdpa_causal() -> None:
  _check_attention(((2, 3, 5, 8),) * 3, is_causal=True)
  _check_attention(QKV, is_causal=True)  # L != S: the top-left aligned triangle, as in PyTorch


def test_sdpa_bool_mask() -> None:
  mask = np.random.default_rng(0).random((2, 1, 4, 6)) < 0.7
  mask[:, :, :, 0] = True
  _check_attention(QKV, mask)
  mask[1, 0, 2, :] = False  # a query that may attend to nothing gives 0, as in PyTorch
  _check_attention(QKV, mask)


def test_sdpa_float_mask() -> None:
  mask = _random((4, 6), 180)
  mask[1, 3] = -math.inf
  _check_attention(QKV, mask)


def test_sdpa_gqa() -> None:
  _check_attention(((1, 4, 3, 8), (1, 2, 5, 8), (1, 2, 5, 8)), enable_gqa=True)


def test_sdpa_dropout_and_errors() -> None:
  q = Tensor.randn(1, 2, 64, 8)
  v = Tensor.ones(1, 2, 64, 8)
  out = attention.scaled_dot_product_attention(q, q, v, dropout_p=0.5).numpy()
  # each output is (sum of the kept weights) / (1 - p): 1 on average, but not 1 everywhere
  assert abs(out.mean() - 1) < 0.1 and out.std() > 0.05
  with pytest.raises(ValueError): attention.scaled_dot_product_attention(q, q, q, Tensor.ones(64, 64), is_causal=True)
  with pytest.raises(ShapeError): attention.scaled_dot_product_attention(q, Tensor.randn(1, 2, 64, 4), q)


# ---------------------------------------------------------------- Tensor methods

def test_tensor_methods() -> None:
  logits, target = Tensor(_random((4, 3), 190)), Tensor([0, 2, 1, 2])
  np.testing.assert_allclose(logits.cross_entropy(target).numpy(), losses.cross_entropy(logits, target).numpy())
  np.testing.assert_allclose(logits.sparse_categorical_crossentropy(target).numpy(),
                             losses.sparse_categorical_crossentropy(logits, target).numpy())
  log_probs = logits.log_softmax(-1)
  np.testing.assert_allclose(log_probs.nll_loss(target).numpy(), losses.nll_loss(log_probs, target).numpy())
  probs, labels = logits.sigmoid(), Tensor(_random((4, 3), 191) > 0).float()
  np.testing.assert_allclose(probs.binary_cross_entropy(labels).numpy(),
                             losses.binary_cross_entropy(probs, labels).numpy())
  np.testing.assert_allclose(logits.binary_cross_entropy_with_logits(labels).numpy(),
                             losses.binary_cross_entropy_with_logits(logits, labels).numpy())
  np.testing.assert_allclose(logits.mse_loss(labels).numpy(), losses.mse_loss(logits, labels).numpy())
  q = Tensor(_random((2, 4, 8), 192))
  np.testing.assert_allclose(q.scaled_dot_product_attention(q, q, is_causal=True).numpy(),
                             attention.scaled_dot_product_attention(q, q, q, is_causal=True).numpy())
