"""The PyTorch/tinygrad API pieces of issue 27 item 5, each checked against PyTorch on the CPU (values and gradients):
Tensor.gradient (tinygrad's functional gradient), copysign, meshgrid, unfold (Tensor.unfold and im2col),
scatter_reduce, class-weighted nll_loss/cross_entropy, the pooling options (ceil_mode, count_include_pad,
divisor_override, return_indices) and max_unpool, einsum summing '...', data-dependent shapes (masked_select,
nonzero, unique, boolean-mask indexing, setitem with tensor indices), and the recurrent and transformer layers.

`compare` runs one function in both libraries on the same seeded inputs and compares every output and the gradient
of every float input (ourgrad's through Tensor.gradient, torch's through torch.autograd.grad).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as TF  # noqa: N812 (torch's usual spelling)

from ourgrad import Tensor, nn
from ourgrad.errors import AutogradError, ShapeError
from ourgrad.nn import functional as F


def _random(shape: tuple[int, ...], seed: int, low: float = -2.0, high: float = 2.0) -> np.ndarray:
  return np.random.default_rng(seed).uniform(low, high, size=shape).astype(np.float32)


def _outputs(value: Any) -> list[Any]:
  return list(value) if isinstance(value, (tuple, list)) else [value]


def compare(ours: Callable[..., Any], theirs: Callable[..., Any], arrays: list[np.ndarray], atol: float = 1e-5,
            grad: bool = True, seed: int = 7) -> None:
  """ours(*Tensors) against theirs(*torch tensors): every output (shape, values; integer outputs exactly) and, with
  `grad`, the gradient of sum(output0 * a random upstream) for every float input."""
  float_inputs = [array.dtype.kind == "f" for array in arrays]
  ours_in = [Tensor(a, requires_grad=grad and f) for a, f in zip(arrays, float_inputs)]
  theirs_in = [torch.tensor(a, requires_grad=grad and f) for a, f in zip(arrays, float_inputs)]
  ours_out, theirs_out = _outputs(ours(*ours_in)), _outputs(theirs(*theirs_in))
  assert len(ours_out) == len(theirs_out)
  for number, (mine, reference) in enumerate(zip(ours_out, theirs_out)):
    assert mine.shape == tuple(reference.shape), f"output {number}: {mine.shape} != {tuple(reference.shape)}"
    expected = reference.detach().numpy()
    if expected.dtype.kind == "f": np.testing.assert_allclose(mine.numpy(), expected, atol=atol, rtol=1e-5)
    else: np.testing.assert_array_equal(mine.numpy(), expected)
  if not grad: return
  upstream = _random(tuple(theirs_out[0].shape), seed)
  wanted = [(o, t) for o, t, f in zip(ours_in, theirs_in, float_inputs) if f]
  theirs_grads = torch.autograd.grad((theirs_out[0] * torch.tensor(upstream)).sum(), [t for _, t in wanted],
                                     allow_unused=True)
  ours_grads = (ours_out[0] * Tensor(upstream)).sum().gradient(*[o for o, _ in wanted], materialize_grads=True)
  for number, (mine, reference) in enumerate(zip(ours_grads, theirs_grads)):
    expected = np.zeros(mine.shape, np.float32) if reference is None else reference.numpy()
    np.testing.assert_allclose(mine.numpy(), expected, atol=atol * 10, rtol=1e-4, err_msg=f"gradient {number}")


# ================================================================ Tensor.gradient

def test_gradient_matches_autograd_grad_and_leaves_grad_alone() -> None:
  x, y = _random((3, 4), 0), _random((4, 2), 1)
  xo, yo = Tensor(x, requires_grad=True), Tensor(y, requires_grad=True)
  xt, yt = torch.tensor(x, requires_grad=True), torch.tensor(y, requires_grad=True)
  hidden_o, hidden_t = xo.matmul(yo), xt.matmul(yt)
  loss_o, loss_t = hidden_o.tanh().square().mean(), hidden_t.tanh().square().mean()
  dx, dy, dh = loss_o.gradient(xo, yo, hidden_o)  # leaves and an intermediate tensor
  ref = torch.autograd.grad(loss_t, [xt, yt, hidden_t], retain_graph=True)
  for mine, theirs in zip((dx, dy, dh), ref): np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=1e-6)
  assert xo.grad is None and yo.grad is None and not dx.requires_grad
  # the graph is kept: backward afterwards gives the same gradient in .grad
  loss_o.backward()
  np.testing.assert_allclose(xo.grad.numpy(), ref[0].numpy(), atol=1e-6)


def test_gradient_with_an_upstream_gradient_and_repeated_use() -> None:
  x = _random((2, 3), 2)
  xo, xt = Tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
  upstream = _random((2, 3), 3)
  out_o, out_t = xo * xo + xo.exp() * xo, xt * xt + xt.exp() * xt
  (mine,) = out_o.gradient(xo, gradient=Tensor(upstream))
  (theirs,) = torch.autograd.grad(out_t, [xt], grad_outputs=torch.tensor(upstream))
  np.testing.assert_allclose(mine.numpy(), theirs.numpy(), atol=1e-5)
  assert out_o.gradient(out_o, gradient=Tensor(upstream))[0].numpy().tolist() == upstream.tolist()


def test_gradient_errors_and_materialize() -> None:
  x, unused = Tensor([1.0, 2.0], requires_grad=True), Tensor([3.0], requires_grad=True)
  loss = (x * 2).sum()
  with pytest.raises(AutogradError, match="not reached"): loss.gradient(unused)
  with pytest.raises(RuntimeError): loss.gradient(Tensor([1.0]))  # AutogradError is a RuntimeError, as in tinygrad
  dx, dunused = loss.gradient(x, unused, materialize_grads=True)
  assert dx.tolist() == [2.0, 2.0] and dunused.tolist() == [0.0]
  with pytest.raises(AutogradError, match="scalar"): (x * 2).gradient(x)
  with pytest.raises(ShapeError): (x * 2).gradient(x, gradient=Tensor([1.0, 2.0, 3.0]))


def test_gradient_tinygrad_docstring_example() -> None:
  x, y = Tensor.eye(3, requires_grad=True), Tensor([[2.0, 0, -2.0]], requires_grad=True)
  dx, dy = y.matmul(x).sum().gradient(x, y)
  assert dx.tolist() == [[2.0, 2.0, 2.0], [0.0, 0.0, 0.0], [-2.0, -2.0, -2.0]] and dy.tolist() == [[1.0, 1.0, 1.0]]


# ================================================================ copysign, meshgrid

def test_copysign_values_signed_zeros_and_gradients() -> None:
  magnitudes = np.array([1.5, -2.0, 0.0, -0.0, 3.0, np.inf, -1.0, 0.5], np.float32)
  signs = np.array([-1.0, 0.0, -0.0, 2.0, -np.inf, -3.0, 1.0, -0.0], np.float32)
  compare(lambda a, b: a.copysign(b), lambda a, b: a.copysign(b), [magnitudes, signs])
  ours = Tensor(magnitudes).copysign(Tensor(signs)).numpy()
  np.testing.assert_array_equal(np.signbit(ours), np.signbit(np.copysign(magnitudes, signs)))
  compare(lambda a, b: a.copysign(b), lambda a, b: a.copysign(b), [_random((3, 1), 4), _random((1, 5), 5)])
  compare(lambda a: a.copysign(-1.0), lambda a: a.copysign(-1.0), [_random((4,), 6)])


def test_copysign_integers_promote() -> None:
  compare(lambda a, b: a.copysign(b), lambda a, b: a.copysign(b),
          [np.array([1, -2, 3, 0], np.int32), np.array([-1, 2, 0, -5], np.int32)], grad=False)


@pytest.mark.parametrize("indexing", ["ij", "xy"])
@pytest.mark.parametrize("shapes", [[(3,), (4,)], [(2,), (3,), (4,)], [(5,)], [(), (3,)], [(1,), (0,)]])
def test_meshgrid(indexing: str, shapes: list[tuple[int, ...]]) -> None:
  arrays = [_random(shape, 10 + number) for number, shape in enumerate(shapes)]
  compare(lambda *xs: Tensor.meshgrid(*xs, indexing=indexing), lambda *xs: torch.meshgrid(*xs, indexing=indexing),
          arrays, grad=bool(all(shape != (0,) for shape in shapes)))


def test_meshgrid_errors() -> None:
  with pytest.raises(ShapeError): Tensor.meshgrid(Tensor.ones(2, 2))
  with pytest.raises(ValueError): Tensor.meshgrid(Tensor.ones(2), indexing="ji")


# ================================================================ unfold

@pytest.mark.parametrize("shape, dim, size, step", [
  ((2, 8, 3), 1, 3, 2), ((9, 2), 0, 4, 4), ((4,), -1, 2, 1), ((5, 7), 1, 7, 1), ((5, 7), 1, 1, 3), ((3, 6), 1, 2, 5),
])
def test_tensor_unfold(shape: tuple[int, ...], dim: int, size: int, step: int) -> None:
  compare(lambda x: x.unfold(dim, size, step), lambda x: x.unfold(dim, size, step), [_random(shape, 20)])


def test_tensor_unfold_edges() -> None:
  compare(lambda x: x.unfold(0, 1, 1), lambda x: x.unfold(0, 1, 1), [np.array(3.0, np.float32)])
  with pytest.raises(ShapeError): Tensor.ones(3).unfold(0, 4, 1)
  with pytest.raises(ValueError): Tensor.ones(3).unfold(0, 2, 0)


@pytest.mark.parametrize("shape, kwargs", [
  ((2, 3, 7, 6), {"kernel_size": (2, 3), "dilation": (1, 2), "padding": 1, "stride": (2, 1)}),
  ((3, 5, 4), {"kernel_size": 2}),
  ((1, 2, 4, 4), {"kernel_size": 4}),
  ((2, 1, 5, 5), {"kernel_size": 3, "padding": 2, "stride": 3}),
])
def test_functional_unfold_im2col(shape: tuple[int, ...], kwargs: dict[str, Any]) -> None:
  compare(lambda x: F.unfold(x, **kwargs), lambda x: TF.unfold(x, **kwargs), [_random(shape, 21)])
  compare(lambda x: nn.Unfold(**kwargs)(x), lambda x: torch.nn.Unfold(**kwargs)(x), [_random(shape, 22)])


@pytest.mark.parametrize("output_size, kwargs", [
  ((7, 6), {"kernel_size": (2, 3), "dilation": (1, 2), "padding": 1, "stride": (2, 1)}),
  ((5, 4), {"kernel_size": 2}),
  ((5, 5), {"kernel_size": 3, "padding": 2, "stride": 3}),
  ((6, 6), {"kernel_size": 3, "stride": 1}),
])
@pytest.mark.parametrize("batched", [True, False])
def test_functional_fold_col2im(output_size: tuple[int, int], kwargs: dict[str, Any], batched: bool) -> None:
  columns = TF.unfold(torch.zeros(2, 3, *output_size), **kwargs)
  shape = tuple(columns.shape) if batched else tuple(columns.shape[1:])
  compare(lambda x: F.fold(x, output_size, **kwargs), lambda x: TF.fold(x, output_size, **kwargs),
          [_random(shape, 23)])
  compare(lambda x: nn.Fold(output_size, **kwargs)(x), lambda x: torch.nn.Fold(output_size, **kwargs)(x),
          [_random(shape, 24)])


def test_fold_shape_error() -> None:
  with pytest.raises(ShapeError, match="patch count"): F.fold(Tensor.ones(1, 4, 5), (3, 3), 2)


# ================================================================ scatter_reduce

@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_reduce(reduce: str, include_self: bool, dim: int) -> None:
  target_shape, index_shape = (3, 5), (2, 4)
  size = target_shape[dim]
  # repeated indices (several sources on one place) and places no index names
  index = np.random.default_rng(30).integers(0, size, index_shape)
  compare(lambda x, src: x.scatter_reduce(dim, Tensor(index), src, reduce, include_self=include_self),
          lambda x, src: x.scatter_reduce(dim, torch.tensor(index), src, reduce, include_self=include_self),
          [_random(target_shape, 31), _random(index_shape, 32)])
  # a src larger than the index (only its leading part is used); torch's backward refuses that shape, so values only
  compare(lambda x, src: x.scatter_reduce(dim, Tensor(index), src, reduce, include_self=include_self),
          lambda x, src: x.scatter_reduce(dim, torch.tensor(index), src, reduce, include_self=include_self),
          [_random(target_shape, 33), _random((3, 6), 34)], grad=False)


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_integers_and_negative_index(reduce: str, include_self: bool) -> None:
  rng = np.random.default_rng(33)
  target, src = rng.integers(-5, 5, (4, 3)).astype(np.int32), rng.integers(-5, 5, (4, 3)).astype(np.int32)
  index = rng.integers(-4, 4, (4, 3))
  positive = np.where(index < 0, index + 4, index)
  ours = Tensor(target).scatter_reduce(0, Tensor(index), Tensor(src), reduce, include_self=include_self)
  theirs = torch.tensor(target).scatter_reduce(0, torch.tensor(positive), torch.tensor(src), reduce,
                                               include_self=include_self)
  np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def test_scatter_reduce_ties_share_the_gradient() -> None:
  target, src = np.array([1.0, 5.0, 0.0], np.float32), np.array([5.0, 5.0, 2.0], np.float32)
  compare(lambda x, s: x.scatter_reduce(0, Tensor([1, 1, 2]), s, "amax"),
          lambda x, s: x.scatter_reduce(0, torch.tensor([1, 1, 2]), s, "amax"), [target, src])


def test_scatter_reduce_errors() -> None:
  with pytest.raises(ValueError, match="reduce"): Tensor.ones(3).scatter_reduce(0, Tensor([0]), Tensor([1.0]), "max")
  with pytest.raises(ShapeError): Tensor.ones(3).scatter_reduce(0, Tensor([[0]]), Tensor([1.0]), "sum")


# ================================================================ weighted losses

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_cross_entropy_class_weights(reduction: str, label_smoothing: float) -> None:
  rng = np.random.default_rng(40)
  target = rng.integers(0, 4, (5, 3))
  target[0, 0] = target[2, 1] = -100  # ignored samples
  weight = rng.uniform(0.1, 2.0, (4,)).astype(np.float32)
  compare(lambda x: x.cross_entropy(Tensor(target), reduction, label_smoothing, weight=Tensor(weight)),
          lambda x: TF.cross_entropy(x, torch.tensor(target), torch.tensor(weight), reduction=reduction,
                                     label_smoothing=label_smoothing), [_random((5, 4, 3), 41)])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_class_weights_probability_target(reduction: str) -> None:
  probs, weight = _random((6, 4), 42, 0.0, 1.0), _random((4,), 43, 0.1, 2.0)
  compare(lambda x: x.cross_entropy(Tensor(probs), reduction, 0.1, weight=Tensor(weight)),
          lambda x: TF.cross_entropy(x, torch.tensor(probs), torch.tensor(weight), reduction=reduction,
                                     label_smoothing=0.1), [_random((6, 4), 44)])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(6, 4), (4,), (2, 4, 3, 2)])
def test_nll_loss_class_weights_and_ignore_index(reduction: str, shape: tuple[int, ...]) -> None:
  target_shape = () if len(shape) == 1 else (shape[0], *shape[2:])
  target = np.random.default_rng(45).integers(0, 4, target_shape)
  weight = _random((4,), 46, 0.1, 2.0)
  compare(lambda x: x.nll_loss(Tensor(target), reduction, ignore_index=1, weight=Tensor(weight)),
          lambda x: TF.nll_loss(x, torch.tensor(target), torch.tensor(weight), ignore_index=1, reduction=reduction),
          [_random(shape, 47)])


def test_loss_modules_take_class_weights() -> None:
  weight = _random((4,), 48, 0.1, 2.0)
  target = np.random.default_rng(49).integers(0, 4, (6,))
  ours, theirs = nn.CrossEntropyLoss(weight=Tensor(weight)), torch.nn.CrossEntropyLoss(weight=torch.tensor(weight))
  assert list(ours.state_dict()) == list(theirs.state_dict()) == ["weight"]
  compare(lambda x: ours(x, Tensor(target)), lambda x: theirs(x, torch.tensor(target)), [_random((6, 4), 50)])
  compare(lambda x: nn.NLLLoss(weight=Tensor(weight))(x, Tensor(target)),
          lambda x: torch.nn.NLLLoss(weight=torch.tensor(weight))(x, torch.tensor(target)), [_random((6, 4), 51)])
  with pytest.raises(ShapeError, match="one value per class"): Tensor.ones(2, 4).cross_entropy(Tensor([0, 1]),
                                                                                              weight=Tensor.ones(3))


# ================================================================ pooling options, max_unpool

POOL_WINDOWS = [(3, 2, 1), (2, 2, 0), (3, 3, 1), (2, 1, 0), (4, 3, 2)]


@pytest.mark.parametrize("kernel, stride, padding", POOL_WINDOWS)
@pytest.mark.parametrize("ceil_mode", [False, True])
@pytest.mark.parametrize("count_include_pad", [True, False])
def test_avg_pool_options(kernel: int, stride: int, padding: int, ceil_mode: bool, count_include_pad: bool) -> None:
  options = {"ceil_mode": ceil_mode, "count_include_pad": count_include_pad}
  compare(lambda x: x.avg_pool2d(kernel, stride, padding, **options),
          lambda x: TF.avg_pool2d(x, kernel, stride, padding, **options), [_random((2, 3, 7, 6), 60)])
  compare(lambda x: F.avg_pool1d(x, kernel, stride, padding, **options),
          lambda x: TF.avg_pool1d(x, kernel, stride, padding, **options), [_random((2, 3, 9), 61)])
  compare(lambda x: nn.AvgPool2d(kernel, stride, padding, **options)(x),
          lambda x: torch.nn.AvgPool2d(kernel, stride, padding, **options)(x), [_random((3, 8, 5), 62)])


def test_avg_pool_divisor_override() -> None:
  compare(lambda x: x.avg_pool2d(3, 2, 1, divisor_override=5), lambda x: TF.avg_pool2d(x, 3, 2, 1,
                                                                                        divisor_override=5),
          [_random((1, 2, 9, 8), 63)])


@pytest.mark.parametrize("kernel, stride, padding", POOL_WINDOWS)
@pytest.mark.parametrize("ceil_mode", [False, True])
def test_max_pool_ceil_mode_and_indices(kernel: int, stride: int, padding: int, ceil_mode: bool) -> None:
  options = {"ceil_mode": ceil_mode, "return_indices": True}
  compare(lambda x: x.max_pool2d(kernel, stride, padding, **options),
          lambda x: TF.max_pool2d(x, kernel, stride, padding, **options), [_random((2, 3, 7, 6), 64)])
  compare(lambda x: F.max_pool1d(x, kernel, stride, padding, **options),
          lambda x: TF.max_pool1d(x, kernel, stride, padding, **options), [_random((2, 9), 65)])
  compare(lambda x: nn.MaxPool2d(kernel, stride, padding, ceil_mode=ceil_mode)(x),
          lambda x: torch.nn.MaxPool2d(kernel, stride, padding, ceil_mode=ceil_mode)(x), [_random((3, 8, 5), 66)])


def test_max_pool_indices_dilation_and_ties() -> None:
  compare(lambda x: x.max_pool2d(3, 2, 1, dilation=2, ceil_mode=True, return_indices=True),
          lambda x: TF.max_pool2d(x, 3, 2, 1, dilation=2, ceil_mode=True, return_indices=True),
          [_random((1, 2, 9, 8), 67)])
  # ties: the first maximum in the window's row-major order, as torch's CPU kernel
  plateau = np.array([[[[1.0, 1.0, 0.0], [1.0, 1.0, 2.0], [2.0, 0.0, 2.0]]]], np.float32)
  compare(lambda x: x.max_pool2d(2, 1, return_indices=True), lambda x: TF.max_pool2d(x, 2, 1, return_indices=True),
          [plateau], grad=False)


@pytest.mark.parametrize("output_size", [None, (7, 9)])
def test_max_unpool2d_round_trip(output_size: tuple[int, int] | None) -> None:
  _, indices = TF.max_pool2d(torch.tensor(_random((2, 3, 6, 8), 70)), 2, return_indices=True)
  compare(lambda v: v.max_unpool2d(Tensor(indices.numpy()), 2, output_size=output_size),
          lambda v: TF.max_unpool2d(v, indices, 2, output_size=output_size), [_random(tuple(indices.shape), 71)])
  compare(lambda v: nn.MaxUnpool2d(2)(v, Tensor(indices.numpy())), lambda v: torch.nn.MaxUnpool2d(2)(v, indices),
          [_random(tuple(indices.shape), 72)])


def test_max_pool_then_unpool_in_ourgrad() -> None:
  x = _random((1, 2, 5, 7), 73)
  def ours(t: Tensor) -> Tensor:
    values, indices = t.max_pool2d(3, 2, 1, return_indices=True)
    return values.max_unpool2d(indices, 3, 2, 1, output_size=t.shape)
  def theirs(t: torch.Tensor) -> torch.Tensor:
    values, indices = TF.max_pool2d(t, 3, 2, 1, return_indices=True)
    return TF.max_unpool2d(values, indices, 3, 2, 1, output_size=t.shape)
  compare(ours, theirs, [x])
  _, indices = TF.max_pool1d(torch.tensor(_random((2, 3, 8), 74)), 2, return_indices=True)
  compare(lambda v: F.max_unpool1d(v, Tensor(indices.numpy()), 2), lambda v: TF.max_unpool1d(v, indices, 2),
          [_random(tuple(indices.shape), 75)])


# ================================================================ einsum

@pytest.mark.parametrize("formula, shapes", [
  ("...i->", [(2, 3)]), ("i...,i...->", [(2, 3), (2, 3)]), ("...ij->j", [(2, 3, 4)]), ("b...i->bi", [(2, 3, 4, 5)]),
  ("...ij,...jk->...ik", [(2, 3, 4, 5), (2, 3, 5, 6)]), ("b...i->...bi", [(2, 3, 4, 5)]),
  ("...i,...j->...ij", [(2, 1, 3), (4, 5)]), ("...ij,jk->ik", [(2, 3, 4), (4, 5)]),
])
def test_einsum_ellipsis_kept_or_summed(formula: str, shapes: list[tuple[int, ...]]) -> None:
  compare(lambda *xs: Tensor.einsum(formula, *xs), lambda *xs: torch.einsum(formula, *xs),
          [_random(shape, 80 + number) for number, shape in enumerate(shapes)], atol=1e-4)


# ================================================================ data-dependent shapes

@pytest.mark.parametrize("shape", [(2, 3), (5,), (2, 3, 4), (0, 3), (1, 1)])
def test_nonzero_and_argwhere(shape: tuple[int, ...]) -> None:
  values = np.where(_random(shape, 90) > 0.5, _random(shape, 91), 0.0).astype(np.float32)
  compare(lambda x: x.nonzero(), lambda x: x.nonzero(), [values], grad=False)
  compare(lambda x: x.nonzero(as_tuple=True), lambda x: x.nonzero(as_tuple=True), [values], grad=False)
  compare(lambda x: x.argwhere(), lambda x: torch.argwhere(x), [values], grad=False)
  compare(lambda x: (x > 0).nonzero(), lambda x: (x > 0).nonzero(), [values], grad=False)


def test_nonzero_of_0d_and_all_zero() -> None:
  for value in (np.array(2.0, np.float32), np.array(0.0, np.float32), np.zeros((3, 2), np.float32)):
    compare(lambda x: x.nonzero(), lambda x: x.nonzero(), [value], grad=False)
    compare(lambda x: x.nonzero(as_tuple=True), lambda x: x.nonzero(as_tuple=True), [value], grad=False)


@pytest.mark.parametrize("shape, mask_shape", [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 4), (3, 1)), ((5,), (5,)),
                                               ((2, 3), (2, 3))])
def test_masked_select(shape: tuple[int, ...], mask_shape: tuple[int, ...]) -> None:
  mask = _random(mask_shape, 92) > 0
  compare(lambda x: x.masked_select(Tensor(mask)), lambda x: x.masked_select(torch.tensor(mask)),
          [_random(shape, 93)])
  nothing = np.zeros(mask_shape, bool)
  compare(lambda x: x.masked_select(Tensor(nothing)), lambda x: x.masked_select(torch.tensor(nothing)),
          [_random(shape, 94)])


@pytest.mark.parametrize("values", [
  np.array([3, 1, 2, 3, 1, 7], np.int32), np.array([[2.5, -1.0], [2.5, 0.0]], np.float32), np.array([4], np.int32),
  np.array([], np.float32), np.array([True, False, True]),
])
@pytest.mark.parametrize("return_inverse, return_counts", [(False, False), (True, False), (False, True), (True, True)])
def test_unique(values: np.ndarray, return_inverse: bool, return_counts: bool) -> None:
  compare(lambda x: x.unique(return_inverse=return_inverse, return_counts=return_counts),
          lambda x: torch.unique(x, sorted=True, return_inverse=return_inverse, return_counts=return_counts),
          [values], grad=False)


@pytest.mark.parametrize("dim", [0, 1])
def test_unique_along_a_dim(dim: int) -> None:
  rows = np.array([[1, 2, 1], [0, 5, 0], [1, 2, 1], [0, 5, 0]], np.int32)
  compare(lambda x: x.unique(dim=dim, return_inverse=True, return_counts=True),
          lambda x: torch.unique(x, dim=dim, return_inverse=True, return_counts=True), [rows], grad=False)


MASK_INDICES: list[Callable[[Any, np.ndarray], Any]] = [
  lambda lib, x: lib(x > 0),                          # a mask of the whole shape
  lambda lib, x: lib(x[..., 0] > 0),                  # leading dims
  lambda lib, x: (slice(None), lib(x[0, :, 0] > 0)),  # a middle dim
  lambda lib, x: (Ellipsis, lib(x[0, 0] > 0)),        # after an ellipsis
  lambda lib, x: (lib(x[:, 0, 0] > 0), 1),            # with an int
  lambda lib, x: lib(np.zeros(x.shape, bool)),        # nothing selected
]


@pytest.mark.parametrize("number", range(len(MASK_INDICES)))
def test_boolean_mask_getitem(number: int) -> None:
  x = _random((3, 4, 5), 95)
  compare(lambda t: t[MASK_INDICES[number](Tensor, x)], lambda t: t[MASK_INDICES[number](torch.tensor, x)], [x])


def test_boolean_mask_getitem_errors_and_lists() -> None:
  x = _random((3, 4), 96)
  with pytest.raises(IndexError, match="boolean mask"): Tensor(x)[Tensor(np.ones((4,), bool))]
  np.testing.assert_array_equal(Tensor(x)[[True, False, True]].numpy(), x[[True, False, True]])
  np.testing.assert_array_equal(Tensor(x)[np.array([False, True, True])].numpy(), x[np.array([False, True, True])])


SET_INPUT = _random((3, 4, 5), 97)
SELECTED_ABOVE_1 = int((SET_INPUT > 1).sum())
SET_CASES: list[tuple[Callable[[Any, np.ndarray], Any], Callable[[Any], Any]]] = [
  (lambda lib, x: lib(x > 0), lambda lib: 0.5),                                                  # mask, number
  (lambda lib, x: lib(x[..., 0] > 0), lambda lib: lib(np.arange(5, dtype=np.float32))),          # mask, one row
  (lambda lib, x: lib(x > 1), lambda lib: lib(np.arange(SELECTED_ABOVE_1, dtype=np.float32))),  # mask, per element
  (lambda lib, x: lib(np.array([2, 0])), lambda lib: -1.0),                                      # x[idx] = v
  (lambda lib, x: (lib(np.array([1, 0])), slice(1, None)),
   lambda lib: lib(np.arange(30, dtype=np.float32).reshape(2, 3, 5) * 0.5)),                     # x[idx, 1:] = v
  (lambda lib, x: (lib(np.array([2, 0, 1])), lib(np.array([0, 3, 3])), 4),
   lambda lib: lib(np.array([7.0, 8.0, 9.0], np.float32))),                                      # several tensors
  (lambda lib, x: (slice(None), lib(np.array([-1, 0]))), lambda lib: 5.0),                      # negative index
  (lambda lib, x: lib(np.array([1, 1])), lambda lib: lib(np.ones((2, 4, 5), np.float32) * 3)),  # repeated index
  (lambda lib, x: (lib(x[:, 0, 0] > 0), 1), lambda lib: 2.0),                                   # mask and an int
]


@pytest.mark.parametrize("number", range(len(SET_CASES)))
def test_setitem_with_tensor_indices_and_masks(number: int) -> None:
  make_index, make_value = SET_CASES[number]
  x = SET_INPUT
  ours, theirs = Tensor(x.copy()), torch.tensor(x.copy())
  ours[make_index(Tensor, x)] = make_value(Tensor)
  theirs[make_index(torch.tensor, x)] = make_value(torch.tensor)
  np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def test_setitem_with_an_index_out_of_range_raises() -> None:
  x = Tensor.zeros(3, 4).contiguous().realize()
  with pytest.raises(IndexError, match="out of range"): x[Tensor([0, 5])] = 1.0
  with pytest.raises(IndexError, match="out of range"): x[Tensor([1]), Tensor([-5])] = 1.0


def test_setitem_mask_over_a_realized_tensor_and_an_int_tensor() -> None:
  x = np.arange(12, dtype=np.int32).reshape(3, 4)
  ours, theirs = Tensor(x.copy()).realize(), torch.tensor(x.copy())
  ours[ours % 3 == 0] = -1
  theirs[theirs % 3 == 0] = -1
  ours[Tensor([0, 2]), Tensor([1, 3])] = Tensor([100, 200])
  theirs[torch.tensor([0, 2]), torch.tensor([1, 3])] = torch.tensor([100, 200], dtype=torch.int32)
  np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


# ================================================================ recurrent and transformer layers

def _copy_weights(ours: nn.Module, theirs: torch.nn.Module) -> None:
  """torch's state_dict into ours, after checking that the names (and their order) are the same."""
  assert list(ours.state_dict()) == list(theirs.state_dict())
  result = ours.load_state_dict({name: Tensor(value.detach().numpy()) for name, value in theirs.state_dict().items()})
  assert not result.missing_keys and not result.unexpected_keys


def _check_layer(ours: nn.Module, theirs: torch.nn.Module, inputs: list[np.ndarray],
                 call: Callable[[Any, list[Any]], Any], atol: float = 1e-5) -> None:
  """ours and theirs (with torch's weights) on the same inputs: every output, and the gradients of every input and
  parameter for sum(first output * a random upstream)."""
  _copy_weights(ours, theirs)
  ours_in = [Tensor(a, requires_grad=True) for a in inputs]
  theirs_in = [torch.tensor(a, requires_grad=True) for a in inputs]
  ours_out, theirs_out = call(ours, ours_in), call(theirs, theirs_in)
  flat_ours = [t for item in _outputs(ours_out) for t in _outputs(item)]
  flat_theirs = [t for item in _outputs(theirs_out) for t in _outputs(item)]
  for mine, reference in zip(flat_ours, flat_theirs, strict=True):
    np.testing.assert_allclose(mine.numpy(), reference.detach().numpy(), atol=atol, rtol=1e-5)
  upstream = _random(tuple(flat_theirs[0].shape), 99)
  (flat_theirs[0] * torch.tensor(upstream)).sum().backward()
  (flat_ours[0] * Tensor(upstream)).sum().backward()
  for number, (mine, reference) in enumerate(zip(ours_in, theirs_in)):
    np.testing.assert_allclose(mine.grad.numpy(), reference.grad.numpy(), atol=atol, rtol=1e-4,
                               err_msg=f"input {number}")
  theirs_params = dict(theirs.named_parameters())
  for name, parameter in ours.named_parameters():
    np.testing.assert_allclose(parameter.grad.numpy(), theirs_params[name].grad.numpy(), atol=atol, rtol=1e-4,
                               err_msg=name)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("options", [
  {}, {"num_layers": 2}, {"bidirectional": True}, {"num_layers": 2, "bidirectional": True, "batch_first": True},
  {"bias": False, "batch_first": True},
])
def test_recurrent_layers(kind: str, options: dict[str, Any]) -> None:
  ours, theirs = getattr(nn, kind)(3, 4, **options), getattr(torch.nn, kind)(3, 4, **options)
  shape = (3, 3, 3)  # (L, N, I), or (N, L, I) with batch_first (short: each time step compiles its own kernels)
  _check_layer(ours, theirs, [_random(shape, 100)], lambda layer, xs: layer(xs[0]))


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_recurrent_layers_initial_state_and_unbatched(kind: str) -> None:
  options = {"num_layers": 2, "bidirectional": True}
  ours, theirs = getattr(nn, kind)(3, 4, **options), getattr(torch.nn, kind)(3, 4, **options)
  # two time steps (each compiles its own kernels): the second reads the first's state, in both directions
  inputs = [_random((2, 2, 3), 101), _random((4, 2, 4), 102)] + ([_random((4, 2, 4), 103)] if kind == "LSTM" else [])
  call = (lambda layer, xs: layer(xs[0], (xs[1], xs[2]))) if kind == "LSTM" else (lambda layer, xs: layer(*xs))
  _check_layer(ours, theirs, inputs, call)
  unbatched = [_random((2, 3), 104)]
  _check_layer(getattr(nn, kind)(3, 4), getattr(torch.nn, kind)(3, 4), unbatched, lambda layer, xs: layer(xs[0]))


@pytest.mark.parametrize("kind", ["LSTMCell", "GRUCell"])
@pytest.mark.parametrize("batched", [True, False])
def test_recurrent_cells(kind: str, batched: bool) -> None:
  ours, theirs = getattr(nn, kind)(3, 5), getattr(torch.nn, kind)(3, 5)
  x_shape, h_shape = ((4, 3), (4, 5)) if batched else ((3,), (5,))
  if kind == "LSTMCell":
    inputs = [_random(x_shape, 105), _random(h_shape, 106), _random(h_shape, 107)]
    _check_layer(ours, theirs, inputs, lambda cell, xs: cell(xs[0], (xs[1], xs[2])))
  else:
    _check_layer(ours, theirs, [_random(x_shape, 105), _random(h_shape, 106)], lambda cell, xs: cell(*xs))
  _check_layer(getattr(nn, kind)(3, 5), getattr(torch.nn, kind)(3, 5), [_random(x_shape, 108)],
               lambda cell, xs: cell(xs[0]))


def test_recurrent_shape_errors() -> None:
  with pytest.raises(ShapeError, match="input_size=3"): nn.LSTM(3, 4)(Tensor.ones(2, 5, 2))
  with pytest.raises(ShapeError, match="initial state"): nn.GRU(3, 4)(Tensor.ones(2, 5, 3), Tensor.ones(2, 5, 4))
  with pytest.raises(ShapeError): nn.LSTMCell(3, 4)(Tensor.ones(2, 4))


@pytest.mark.parametrize("options, masks", [
  ({}, "none"), ({}, "causal+padding"), ({"norm_first": True, "activation": "gelu", "batch_first": True}, "padding"),
  ({"norm_first": True}, "float"), ({"batch_first": True, "bias": False}, "causal+padding"),
])
def test_transformer_encoder_layer(options: dict[str, Any], masks: str) -> None:
  ours = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, **options)
  theirs = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, **options)
  theirs.eval()  # torch's training path and fast path give the same values at dropout 0; eval keeps it simple
  batch_first = options.get("batch_first", False)
  length, batch = 5, 3
  x = _random((batch, length, 8) if batch_first else (length, batch, 8), 110)
  padding = np.zeros((batch, length), bool)
  padding[0, -2:] = True
  attn_mask = {"none": None, "causal+padding": np.triu(np.ones((length, length), bool), 1),
               "padding": None, "float": _random((length, length), 111)}[masks]
  key_padding = padding if "padding" in masks else None

  def call(layer: Any, xs: list[Any]) -> Any:
    lib = Tensor if isinstance(layer, nn.Module) else torch.tensor
    return layer(xs[0], None if attn_mask is None else lib(attn_mask), None if key_padding is None else
                 lib(key_padding))
  _check_layer(ours, theirs, [x], call)


def test_transformer_encoder_stack_and_training_dropout() -> None:
  layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
  theirs_layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
  ours = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(8))
  theirs = torch.nn.TransformerEncoder(theirs_layer, 2, norm=torch.nn.LayerNorm(8), enable_nested_tensor=False)
  theirs.eval()
  _check_layer(ours, theirs, [_random((3, 4, 8), 112)], lambda model, xs: model(xs[0]))
  # dropout acts while training: the output changes, its shape does not
  dropping = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.5).train()
  x = Tensor(_random((4, 2, 8), 113))
  assert dropping(x).shape == (4, 2, 8)
  assert not np.allclose(dropping(x).numpy(), dropping.eval()(x).numpy())
  with pytest.raises(ValueError, match="activation"): nn.TransformerEncoderLayer(8, 2, activation="tanh")


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_masks_and_every_gradient(batch_first: bool, need_weights: bool) -> None:
  length, source, batch, embed = 4, 6, 2, 8
  ours, theirs = nn.MultiheadAttention(embed, 2, batch_first=batch_first), \
    torch.nn.MultiheadAttention(embed, 2, batch_first=batch_first)
  q_shape = (batch, length, embed) if batch_first else (length, batch, embed)
  kv_shape = (batch, source, embed) if batch_first else (source, batch, embed)
  attn_mask = np.triu(np.ones((length, source), bool), 3)
  padding = np.zeros((batch, source), bool)
  padding[1, -2:] = True

  def call(layer: Any, xs: list[Any]) -> Any:
    lib = Tensor if isinstance(layer, nn.Module) else torch.tensor
    out, weights = layer(*xs, key_padding_mask=lib(padding), need_weights=need_weights, attn_mask=lib(attn_mask))
    return (out, weights) if need_weights else out
  _check_layer(ours, theirs, [_random(q_shape, 120), _random(kv_shape, 121), _random(kv_shape, 122)], call)


def test_pooling_modules_return_indices_and_divisor() -> None:
  compare(lambda x: nn.MaxPool2d(3, 2, 1, return_indices=True, ceil_mode=True)(x),
          lambda x: torch.nn.MaxPool2d(3, 2, 1, return_indices=True, ceil_mode=True)(x), [_random((2, 3, 7, 6), 123)])
  compare(lambda x: nn.MaxPool1d(2, return_indices=True)(x), lambda x: torch.nn.MaxPool1d(2, return_indices=True)(x),
          [_random((2, 3, 7), 124)])
  compare(lambda x: nn.AvgPool2d(3, 2, 1, divisor_override=4)(x),
          lambda x: torch.nn.AvgPool2d(3, 2, 1, divisor_override=4)(x), [_random((2, 3, 7, 6), 125)])
  _, indices = TF.max_pool1d(torch.tensor(_random((2, 3, 8), 126)), 2, return_indices=True)
  compare(lambda v: nn.MaxUnpool1d(2)(v, Tensor(indices.numpy())), lambda v: torch.nn.MaxUnpool1d(2)(v, indices),
          [_random(tuple(indices.shape), 127)])


def test_tinygrad_pooling_spellings() -> None:
  """tinygrad's extras: avg pooling with `dilation` (checked against torch's avg of a dilated window through
  unfold), and max_unpool2d with its default kernel of 2."""
  x = _random((2, 3, 9, 8), 128)
  def theirs(t: torch.Tensor) -> torch.Tensor:  # the mean of each dilated 3x3 window, padding 1, stride 2
    columns = TF.unfold(t, 3, dilation=2, padding=1, stride=2)
    return columns.reshape(2, 3, 9, -1).mean(2).reshape(2, 3, 4, 3)
  compare(lambda t: t.avg_pool2d(3, 2, 1, dilation=2), theirs, [x])
  values, indices = Tensor(x).max_pool2d(return_indices=True)
  torch_values, torch_indices = TF.max_pool2d(torch.tensor(x), 2, return_indices=True)
  np.testing.assert_array_equal(values.max_unpool2d(indices).numpy(),
                                TF.max_unpool2d(torch_values, torch_indices, 2).numpy())


@pytest.mark.parametrize("kind", ["LSTMCell", "GRUCell"])
def test_recurrent_steps_do_not_fuse_earlier_steps(kind: str) -> None:
  """A loop over a cell: each kernel reads a bounded number of buffers, however many steps came before (before the
  state was made contiguous, the cell-state chain of every earlier step fused into each later matmul)."""
  from ourgrad.engine.schedule import create_schedule
  cell = getattr(nn, kind)(4, 6)
  xs = Tensor(_random((10, 2, 4), 130))
  state: Any = None
  for step in range(10):
    state = cell(xs[step], state)
  h = state[0] if kind == "LSTMCell" else state
  widest = max(len(item.inputs) for item in create_schedule([h.lazydata]))
  assert widest <= 8, f"a kernel of the 10-step loop reads {widest} buffers"
