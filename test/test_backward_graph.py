"""What autograd builds: the backward walk (Tensor._backpropagate) passes gradients as lazy buffers, matmul is one
Function (function.Matmul) whose graphs are those of the Tensor ops it replaces, and a stride-1 convolution's
backward is built on lazy buffers. Gradients against PyTorch on the CPU; Matmul's against the Tensor ops' bit for
bit."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import ourgrad.function as F
from ourgrad import Tensor, nn
from ourgrad.errors import AutogradError
from helpers import helper_test_op


def _applied(monkeypatch: pytest.MonkeyPatch, run: Callable[[], Any]) -> list[str]:
  """The names of the Functions applied while `run` runs."""
  applied: list[str] = []
  original = F.Function.apply.__func__   # type: ignore[attr-defined]

  def counting_apply(cls: type, *tensors: Tensor, **kwargs: object) -> Tensor:
    applied.append(cls.__name__)
    return original(cls, *tensors, **kwargs)
  monkeypatch.setattr(F.Function, "apply", classmethod(counting_apply))
  try:
    run()
  finally:
    monkeypatch.undo()
  return applied


def _composed_matmul(x: Tensor, y: Tensor) -> Tensor:
  """x @ y from the Tensor ops matmul applied before function.Matmul (operands of 2 dims or more, one dtype)."""
  return (x.unsqueeze(-2) * y.transpose(-1, -2).unsqueeze(-3)).sum(-1)


MATMUL_SHAPES = [((3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)), ((2, 1, 3, 4), (5, 4, 6)), ((3, 4), (2, 4, 5)),
                 ((1, 4), (4, 1)), ((3, 1), (1, 5))]


@pytest.mark.parametrize("x_shape, y_shape", MATMUL_SHAPES)
def test_matmul_gradients_are_those_of_its_tensor_ops_bit_for_bit(x_shape: tuple[int, ...],
                                                                   y_shape: tuple[int, ...]) -> None:
  rng = np.random.default_rng(0)
  x_values, y_values = rng.standard_normal(x_shape).astype(np.float32), rng.standard_normal(y_shape).astype(np.float32)
  results = []
  for product in (Tensor.matmul, _composed_matmul):
    x, y = Tensor(x_values, requires_grad=True), Tensor(y_values, requires_grad=True)
    out = product(x, y)
    upstream = Tensor(rng.standard_normal(out.shape).astype(np.float32))
    (out * upstream).sum().backward()
    results.append((out.numpy(), x.grad.numpy(), y.grad.numpy()))
    rng = np.random.default_rng(0)   # the same upstream for the second product
    rng.standard_normal(x_shape), rng.standard_normal(y_shape)
  for ours, composed in zip(*results): np.testing.assert_array_equal(ours, composed)


@pytest.mark.parametrize("x_shape, y_shape", MATMUL_SHAPES + [((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,)),
                                                              ((2, 3, 4), (4, 5))])
def test_matmul_gradients_against_torch(x_shape: tuple[int, ...], y_shape: tuple[int, ...]) -> None:
  helper_test_op([x_shape, y_shape], torch.matmul, Tensor.matmul, atol=1e-5, grad_atol=1e-5)


@pytest.mark.parametrize("which", [0, 1])
def test_matmul_with_one_operand_requiring_grad(which: int) -> None:
  rng = np.random.default_rng(1)
  values = [rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32)]
  ours = [Tensor(value, requires_grad=number == which) for number, value in enumerate(values)]
  theirs = [torch.tensor(value, requires_grad=number == which) for number, value in enumerate(values)]
  (ours[0] @ ours[1]).exp().sum().backward()
  (theirs[0] @ theirs[1]).exp().sum().backward()
  assert ours[1 - which].grad is None
  np.testing.assert_allclose(ours[which].grad.numpy(), theirs[which].grad.numpy(), rtol=1e-5, atol=1e-5)


def test_a_linear_layer_records_one_function_and_its_backward_none(monkeypatch: pytest.MonkeyPatch) -> None:
  """Linear: one F.Linear (the weight's transpose, the Matmul, the bias's broadcast and add were four Functions, 13
  with matmul as Tensor ops); the backward applies no Function (gradients are built on lazy buffers, summed with lazy
  adds)."""
  layer = nn.Linear(6, 3)
  x = Tensor(np.random.default_rng(2).standard_normal((5, 6)).astype(np.float32), requires_grad=True)
  outputs: list[Tensor] = []
  assert _applied(monkeypatch, lambda: outputs.append(layer(x))) == ["Linear"]
  loss = (outputs[0] * outputs[0]).sum() + outputs[0].sum()   # the layer's output read by two Functions
  assert _applied(monkeypatch, loss.backward) == []
  reference = torch.nn.Linear(6, 3)
  with torch.no_grad():
    reference.weight.copy_(torch.tensor(layer.weight.numpy()))
    reference.bias.copy_(torch.tensor(layer.bias.numpy()))
  reference_x = torch.tensor(x.numpy(), requires_grad=True)
  reference_out = reference(reference_x)
  ((reference_out * reference_out).sum() + reference_out.sum()).backward()
  for ours, theirs in ((x, reference_x), (layer.weight, reference.weight), (layer.bias, reference.bias)):
    np.testing.assert_allclose(ours.grad.numpy(), theirs.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padding, dilation, groups", [(0, 1, 1), (2, 1, 1), ((1, 0, 2, 1), 1, 1),
                                                       ((-1, 1, 0, 0), 1, 1), (1, 2, 1), (1, 1, 2)])
def test_stride_one_conv_backward_builds_no_functions(monkeypatch: pytest.MonkeyPatch, padding: Any, dilation: int,
                                                      groups: int) -> None:
  """StrideOneConv's gradients (the input's as a transposed convolution, the weight's) are built on lazy buffers:
  its backward applies no Function. Gradients against torch, padding in tinygrad's per-side form (negative crops)
  given to torch as an explicit pad of the input."""
  rng = np.random.default_rng(3)
  x_values = rng.standard_normal((2, 4, 7, 6)).astype(np.float32)
  w_values = rng.standard_normal((6, 4 // groups, 3, 2)).astype(np.float32)
  x, w = Tensor(x_values, requires_grad=True), Tensor(w_values, requires_grad=True)
  out = x.conv2d(w, padding=padding, dilation=dilation, groups=groups)
  upstream = rng.standard_normal(out.shape).astype(np.float32)
  loss = (out * Tensor(upstream)).sum()
  assert _applied(monkeypatch, loss.backward) == []
  reference_x, reference_w = torch.tensor(x_values, requires_grad=True), torch.tensor(w_values, requires_grad=True)
  sides = (padding,) * 4 if isinstance(padding, int) else padding   # (left, right, top, bottom)
  padded = TF.pad(reference_x, sides)
  reference = TF.conv2d(padded, reference_w, dilation=dilation, groups=groups)
  (reference * torch.tensor(upstream)).sum().backward()
  np.testing.assert_allclose(out.numpy(), reference.detach().numpy(), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(x.grad.numpy(), reference_x.grad.numpy(), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(w.grad.numpy(), reference_w.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_gradients_of_a_tensor_read_several_times_add_up() -> None:
  """A leaf and an intermediate each read by three Functions (their gradients summed in the walk's order), with
  broadcasting (the sum to each operand's shape) and reductions."""
  rng = np.random.default_rng(4)
  values = [rng.standard_normal(shape).astype(np.float32) for shape in ((3, 1, 4), (5, 4), (4, 4))]

  def loss(x: Any, y: Any, w: Any) -> Any:
    h = x * y                     # (3, 5, 4), broadcast
    h2 = h.exp() + h * h + h @ w  # h read three times
    return h2.sum() + (x * 3).amax() + y.mean() * x.sum()   # x and y read again
  ours = [Tensor(value, requires_grad=True) for value in values]
  theirs = [torch.tensor(value, requires_grad=True) for value in values]
  loss(*ours).backward()
  loss(*theirs).backward()
  for mine, reference in zip(ours, theirs):
    np.testing.assert_allclose(mine.grad.numpy(), reference.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_backward_twice_accumulates_and_no_grad_records_nothing() -> None:
  x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3), requires_grad=True)
  for _ in range(2): (x * x).sum().backward()
  np.testing.assert_array_equal(x.grad.numpy(), 4 * np.arange(6, dtype=np.float32).reshape(2, 3))
  with Tensor.no_grad_context():
    out = (x @ x.T).sum()
  assert out._ctx is None and not out.requires_grad
  with pytest.raises(AutogradError):
    out.backward()


def test_gradient_of_an_intermediate_target_with_the_graph_kept() -> None:
  rng = np.random.default_rng(5)
  x_values, w_values = rng.standard_normal((3, 4)).astype(np.float32), rng.standard_normal((4, 2)).astype(np.float32)
  x, w = Tensor(x_values, requires_grad=True), Tensor(w_values, requires_grad=True)
  h = x @ w
  loss = (h.relu() * h).sum()
  grad_h, grad_w = loss.gradient(h, w)
  again, = loss.gradient(w)
  reference_x, reference_w = torch.tensor(x_values), torch.tensor(w_values, requires_grad=True)
  reference_h = reference_x @ reference_w
  reference_h.retain_grad()
  (reference_h.relu() * reference_h).sum().backward()
  np.testing.assert_allclose(grad_h.numpy(), reference_h.grad.numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(grad_w.numpy(), reference_w.grad.numpy(), rtol=1e-5, atol=1e-5)
  # (a graph of its own: kernels fused otherwise than with grad_h's, so equal up to rounding)
  np.testing.assert_allclose(again.numpy(), grad_w.numpy(), rtol=1e-6, atol=1e-6)
  assert x.grad is None and w.grad is None


def test_gradients_of_different_dtypes_for_one_tensor_add_up_promoted() -> None:
  """A float16 input normalized with float32 statistics (its gradient from BatchNormNormalize in float32) and read by
  a float16 product: the two gradients meet in different dtypes and are added as Tensor's + adds them (promoted)."""
  values = np.random.default_rng(6).standard_normal((2, 3, 4, 4)).astype(np.float16)
  x, reference_x = Tensor(values, requires_grad=True), torch.tensor(values, requires_grad=True)
  norm, reference_norm = nn.BatchNorm2d(3), torch.nn.BatchNorm2d(3)
  upstream = np.random.default_rng(7).standard_normal((2, 3, 4, 4)).astype(np.float32)
  with Tensor.train():
    ((norm(x).float() * Tensor(upstream)).sum() + (x * 2).float().sum()).backward()
  reference_out = reference_norm(reference_x.float())
  ((reference_out * torch.tensor(upstream)).sum() + (reference_x * 2).float().sum()).backward()
  np.testing.assert_allclose(x.grad.numpy().astype(np.float32), reference_x.grad.float().numpy(), rtol=1e-2,
                             atol=1e-2)


def _constants_built(run: Callable[[], Any]) -> int:
  """How many CONST bases are made while `run` runs."""
  from ourgrad import lazy
  from ourgrad.ops import Ops
  made = [0]
  original = lazy.LazyBuffer.create_base

  def counting(device: str, shape: Any, dtype: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    if op is Ops.CONST: made[0] += 1
    return original(device, shape, dtype, op, *args, **kwargs)
  lazy.LazyBuffer.create_base = staticmethod(counting)  # type: ignore[method-assign]
  try:
    run()
  finally:
    lazy.LazyBuffer.create_base = staticmethod(original)  # type: ignore[method-assign]
  return made[0]


def test_backward_reads_shared_constants_and_matches_torch() -> None:
  """relu's, where's, maximum's and sigmoid's backward read their 0s and 1s as shared operand constants (made once,
  for every later step): a second backward of the same graph makes only the seed gradient's constant. Gradients
  against PyTorch."""
  rng = np.random.default_rng(0)
  x_value, w_value, v_value = (rng.standard_normal((4, 6)).astype(np.float32) for _ in range(3))

  def ours() -> tuple[int, np.ndarray, np.ndarray]:
    x, w = Tensor(x_value, requires_grad=True), Tensor(w_value, requires_grad=True)
    product = x * w
    mixed = product.relu() + (product > 0.5).where(product, w) + product.maximum(w) + product.sigmoid()
    loss = (mixed * Tensor(v_value)).sum()   # (a gradient that is no constant: nothing folds)
    constants = _constants_built(loss.backward)
    return constants, x.grad.numpy(), w.grad.numpy()
  ours()   # the first backward makes the shared constants
  constants, grad_x, grad_w = ours()
  assert constants == 1, f"backward made {constants} constants, expected only the seed gradient's"
  x, w = torch.tensor(x_value, requires_grad=True), torch.tensor(w_value, requires_grad=True)
  product = x * w
  mixed = product.relu() + torch.where(product > 0.5, product, w) + torch.maximum(product, w) + product.sigmoid()
  (mixed * torch.tensor(v_value)).sum().backward()
  np.testing.assert_allclose(grad_x, x.grad.numpy(), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(grad_w, w.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_saved_values_are_checked_only_after_an_in_place_write(monkeypatch: pytest.MonkeyPatch) -> None:
  """The backward walk checks a Function's saved values for in-place writes only where a write came after it was
  applied (Storage.versions_made): none without writes, and a write to a saved value still raises."""
  import ourgrad.tensor as tensor_module
  checked: list[str] = []
  original = tensor_module._check_saved_values

  def counting(ctx: F.Function) -> None:
    checked.append(type(ctx).__name__)
    original(ctx)
  monkeypatch.setattr(tensor_module, "_check_saved_values", counting)
  x_value, w_value = np.arange(1.0, 7.0, dtype=np.float32), np.linspace(-1, 1, 6, dtype=np.float32)
  x, w = Tensor(x_value, requires_grad=True), Tensor(w_value).realize()
  (x * w).exp().sum().backward()
  assert checked == []
  # a write to another tensor after the product: the product is checked (and passes), the exp after it is not
  other = Tensor(np.zeros(6, np.float32)).realize()
  x.grad = None
  product = x * w
  other.assign(Tensor(np.ones(6, np.float32)))
  (product * x).sum().backward()
  assert checked == ["Mul"]
  np.testing.assert_allclose(x.grad.numpy(), 2 * x_value * w_value, rtol=1e-6)
  # a write to the saved factor itself raises, as PyTorch does
  product = x * w
  w.assign(Tensor(np.ones(6, np.float32)))
  with pytest.raises(AutogradError, match="modified by an inplace operation"):
    product.sum().backward()


def test_selects_on_equality_match_torch_with_ties_and_nans() -> None:
  """maximum's, pow's and max pooling's backward select on x == y as the select on x != y with its branches swapped
  (function._where_equal, one compare): ties split or pick as PyTorch does, and NaN compares unequal. Gradients
  against PyTorch."""
  x_value = np.array([1.0, 2.0, np.nan, -1.0, 3.0, 0.0], np.float32)
  y_value = np.array([1.0, 5.0, 2.0, np.nan, 3.0, 0.0], np.float32)
  x, y = Tensor(x_value, requires_grad=True), Tensor(y_value, requires_grad=True)
  x.maximum(y).sum().backward()
  tx, ty = torch.tensor(x_value, requires_grad=True), torch.tensor(y_value, requires_grad=True)
  torch.maximum(tx, ty).sum().backward()
  np.testing.assert_array_equal(x.grad.numpy(), tx.grad.numpy())
  np.testing.assert_array_equal(y.grad.numpy(), ty.grad.numpy())
  base, exponent = np.array([2.0, 0.0, 3.0, 0.5], np.float32), np.array([0.0, 0.0, 2.0, 1.0], np.float32)
  b = Tensor(base, requires_grad=True)
  (b ** Tensor(exponent)).sum().backward()
  tb = torch.tensor(base, requires_grad=True)
  (tb ** torch.tensor(exponent)).sum().backward()
  np.testing.assert_allclose(b.grad.numpy(), tb.grad.numpy(), rtol=1e-6)
  # pooling windows with tied maxima and a NaN: the gradient goes to the one element PyTorch picks
  image = np.array([[[[1.0, 1.0, 0.0, 2.0], [1.0, 0.5, 2.0, 2.0], [np.nan, 3.0, 4.0, 4.0], [3.0, np.nan, 4.0, 1.0]]]],
                   np.float32)
  grad_value = np.arange(1.0, 5.0, dtype=np.float32).reshape(1, 1, 2, 2)
  pooled = Tensor(image, requires_grad=True)
  (pooled.max_pool2d(2) * Tensor(grad_value)).sum().backward()
  reference = torch.tensor(image, requires_grad=True)
  (TF.max_pool2d(reference, 2) * torch.tensor(grad_value)).sum().backward()
  np.testing.assert_array_equal(pooled.grad.numpy(), reference.grad.numpy())


def test_max_pool_backward_bases(monkeypatch: pytest.MonkeyPatch) -> None:
  """A max pool's backward (function.MaxToOne) builds 8 bases: the NaN test, the negated rank and the select of the
  non-maxima, the key's compare and select, its max, and the gradient's compare and select (one compare a select on
  equality: `_where_equal`)."""
  from ourgrad.lazy import LazyBuffer
  x = Tensor(np.random.default_rng(0).standard_normal((1, 2, 4, 4)).astype(np.float32), requires_grad=True)
  pool = x.max_pool2d(2)._ctx
  while not isinstance(pool, F.MaxToOne): pool = pool.parents[0]._ctx   # (the reshapes after the max)
  made = [0]
  original = LazyBuffer.create_base

  def counting(*args: Any, **kwargs: Any) -> Any:
    made[0] += 1
    return original(*args, **kwargs)
  grad_output = Tensor(np.ones(pool.result.shape, np.float32)).lazydata
  pool.backward(grad_output)   # (the shared operand constants made)
  monkeypatch.setattr(LazyBuffer, "create_base", staticmethod(counting))
  pool.backward(grad_output)
  assert made[0] == 8
