"""ourgrad.nn.functional against torch.nn.functional on the CPU: forward values and the gradients of every input
(x, weight, bias), plus error messages and the kernel counts that fusion promises."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from ourgrad import GlobalCounters, Tensor
from ourgrad.errors import ShapeError
from ourgrad.nn import functional as F

ATOL, RTOL = 1e-4, 1e-4


def _random(shape: tuple[int, ...], seed: int) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _check(ours: Callable[..., Tensor], theirs: Callable[..., torch.Tensor], *arrays: np.ndarray | None,
           atol: float = ATOL, rtol: float = RTOL) -> None:
  """Run both functions on the same inputs (None stays None, e.g. no bias), compare the outputs, then backprop a
  random upstream gradient (so no two outputs weigh the same) and compare the gradient of every input."""
  og = [None if a is None else Tensor(a, requires_grad=True) for a in arrays]
  tg = [None if a is None else torch.tensor(a, requires_grad=True) for a in arrays]
  out, ref = ours(*og), theirs(*tg)
  assert out.shape == tuple(ref.shape), f"shape {out.shape} != torch {tuple(ref.shape)}"
  np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), atol=atol, rtol=rtol)
  upstream = _random(tuple(ref.shape), seed=99)
  (out * Tensor(upstream)).sum().backward()
  (ref * torch.tensor(upstream)).sum().backward()
  for index, (o, t) in enumerate(zip(og, tg)):
    if o is None: continue
    assert o.grad is not None, f"input {index} got no gradient"
    np.testing.assert_allclose(o.grad.numpy(), t.grad.numpy(), atol=atol, rtol=rtol, err_msg=f"grad of input {index}")


# ---------------------------------------------------------------- conv2d

# (batch, C_in, C_out, (H, W), kernel, stride, padding, dilation, groups, bias)
CONV2D_CASES = [
  (1, 3, 4, (7, 7), (3, 3), 1, 0, 1, 1, True),
  (2, 3, 4, (7, 7), (3, 3), 1, 1, 1, 1, False),
  (2, 2, 3, (8, 9), (3, 3), 2, 1, 1, 1, False),
  (1, 2, 2, (9, 9), (3, 3), 1, 2, 2, 1, True),
  (2, 3, 2, (7, 8), (2, 3), 1, (1, 0), 1, 1, True),
  (1, 3, 2, (7, 8), (2, 3), (2, 1), (0, 1), (1, 2), 1, False),
  (2, 4, 6, (6, 6), (3, 3), 1, 1, 1, 2, True),
  (2, 4, 4, (6, 7), (3, 3), 2, 1, 1, 4, True),        # depthwise
  (1, 6, 3, (6, 6), (2, 2), 1, 0, 2, 3, False),
  (2, 2, 3, (6, 6), (1, 1), 2, 1, 1, 1, True),        # pointwise, strided, padding only reaches zeros
  (2, 2, 3, (8, 8), (2, 2), 2, 0, 1, 1, True),        # windows tile exactly (kernel == stride)
  (1, 2, 3, (9, 7), (2, 2), 3, 1, 1, 1, False),       # kernel < stride: gaps between windows
  (2, 2, 2, (5, 6), (1, 4), (1, 3), (0, 2), 1, 1, True),
  (1, 2, 2, (11, 11), (3, 3), 3, 2, 3, 2, True),
]


@pytest.mark.parametrize("batch,cin,cout,hw,kernel,stride,padding,dilation,groups,bias", CONV2D_CASES)
def test_conv2d(batch: int, cin: int, cout: int, hw: tuple[int, int], kernel: tuple[int, int], stride: Any,
                padding: Any, dilation: Any, groups: int, bias: bool) -> None:
  args = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
  _check(lambda x, w, b: F.conv2d(x, w, b, **args), lambda x, w, b: TF.conv2d(x, w, b, **args),
         _random((batch, cin, *hw), 0), _random((cout, cin // groups, *kernel), 1),
         _random((cout,), 2) if bias else None)


@pytest.mark.filterwarnings("ignore:Using padding='same'")  # torch's own note about even kernels
@pytest.mark.parametrize("padding,kernel,dilation", [("same", (3, 3), 1), ("same", (2, 4), 1), ("same", (3, 2), 2),
                                                     ("valid", (3, 2), 1)])
def test_conv2d_string_padding(padding: str, kernel: tuple[int, int], dilation: int) -> None:
  _check(lambda x, w: F.conv2d(x, w, padding=padding, dilation=dilation),
         lambda x, w: TF.conv2d(x, w, padding=padding, dilation=dilation),
         _random((2, 3, 7, 8), 0), _random((2, 3, *kernel), 1))


def test_conv2d_unbatched_and_method() -> None:
  _check(lambda x, w, b: x.conv2d(w, b, padding=1), lambda x, w, b: TF.conv2d(x, w, b, padding=1),
         _random((3, 5, 5), 0), _random((2, 3, 3, 3), 1), _random((2,), 2))


def test_conv2d_errors() -> None:
  x, w = Tensor.zeros(1, 4, 5, 5), Tensor.zeros(2, 4, 3, 3)
  with pytest.raises(ShapeError, match=r"\(4, 5\)"): F.conv2d(Tensor.zeros(4, 5), Tensor.zeros(2, 4, 3, 3))
  with pytest.raises(ShapeError, match=r"\(2, 4, 3\)"): F.conv2d(x, Tensor.zeros(2, 4, 3))
  with pytest.raises(ShapeError, match=r"\(1, 4, 5, 5\).*\(2, 3, 3, 3\)"): F.conv2d(x, Tensor.zeros(2, 3, 3, 3))
  with pytest.raises(ShapeError, match=r"groups=2"): F.conv2d(x, Tensor.zeros(3, 2, 3, 3), groups=2)
  with pytest.raises(ShapeError, match=r"larger"): F.conv2d(x, Tensor.zeros(2, 4, 6, 3))
  with pytest.raises(ShapeError, match=r"larger"): F.conv2d(x, Tensor.zeros(2, 4, 3, 3), dilation=3)
  with pytest.raises(ShapeError, match=r"bias"): F.conv2d(x, w, Tensor.zeros(3))
  with pytest.raises(ValueError, match=r"same"): F.conv2d(x, w, padding="same", stride=2)
  F.conv2d(x, Tensor.zeros(2, 4, 6, 3), padding=1)  # fits once padded


# ---------------------------------------------------------------- conv1d / conv_transpose2d

@pytest.mark.parametrize("stride,padding,dilation,groups,bias", [
  (2, 1, 1, 1, False), (3, 2, 2, 2, True), (1, "same", 2, 1, True)])
def test_conv1d(stride: int, padding: Any, dilation: int, groups: int, bias: bool) -> None:
  args = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
  _check(lambda x, w, b: F.conv1d(x, w, b, **args), lambda x, w, b: TF.conv1d(x, w, b, **args),
         _random((2, 4, 11), 0), _random((6, 4 // groups, 3), 1), _random((6,), 2) if bias else None)


# (C_in, C_out, kernel, stride, padding, output_padding, dilation, groups, bias)
@pytest.mark.parametrize("cin,cout,kernel,stride,padding,output_padding,dilation,groups,bias", [
  (3, 2, (3, 3), 1, 0, 0, 1, 1, True),
  (2, 3, (3, 3), 2, 1, 1, 1, 1, True),
  (2, 3, (4, 4), 2, 1, 0, 1, 1, False),           # the usual 2x upsampling layer
  (2, 2, (2, 3), (2, 3), (0, 1), (1, 2), 1, 1, True),
  (4, 6, (3, 3), 2, 1, 1, 1, 2, True),
  (2, 2, (3, 3), 2, 3, 0, 1, 1, True),            # padding larger than k-1 crops the output
])
def test_conv_transpose2d(cin: int, cout: int, kernel: tuple[int, int], stride: Any, padding: Any,
                          output_padding: Any, dilation: int, groups: int, bias: bool) -> None:
  args = dict(stride=stride, padding=padding, output_padding=output_padding, dilation=dilation, groups=groups)
  _check(lambda x, w, b: F.conv_transpose2d(x, w, b, **args), lambda x, w, b: TF.conv_transpose2d(x, w, b, **args),
         _random((2, cin, 5, 4), 0), _random((cin, cout // groups, *kernel), 1), _random((cout,), 2) if bias else None)


def test_conv_transpose2d_errors() -> None:
  x = Tensor.zeros(1, 4, 5, 5)
  with pytest.raises(ShapeError, match=r"\(3, 2, 3, 3\)"): F.conv_transpose2d(x, Tensor.zeros(3, 2, 3, 3))
  with pytest.raises(ShapeError, match=r"groups=3"): F.conv_transpose2d(x, Tensor.zeros(4, 2, 3, 3), groups=3)
  with pytest.raises(ValueError, match=r"output_padding"):
    F.conv_transpose2d(x, Tensor.zeros(4, 2, 3, 3), stride=2, output_padding=2)


# ---------------------------------------------------------------- pooling

# (kernel, stride, padding, dilation) -- dilation only applies to max_pool2d
POOL_CASES = [
  (2, None, 0, 1), (3, 2, 1, 1), ((2, 3), (1, 2), (1, 1), 1), (2, 3, 1, 1), (3, 1, 0, 2), (2, 2, 1, (2, 3)),
]


@pytest.mark.parametrize("kernel,stride,padding,dilation", POOL_CASES)
def test_max_pool2d(kernel: Any, stride: Any, padding: Any, dilation: Any) -> None:
  # a permutation of distinct values: no ties, so the gradient (to the one maximum) is unambiguous
  x = np.random.default_rng(3).permutation(2 * 3 * 9 * 10).reshape(2, 3, 9, 10).astype(np.float32) / 10
  _check(lambda t: F.max_pool2d(t, kernel, stride, padding, dilation),
         lambda t: TF.max_pool2d(t, kernel, stride, padding, dilation), x)


@pytest.mark.parametrize("kernel,stride,padding", [case[:3] for case in POOL_CASES if case[3] == 1])
def test_avg_pool2d(kernel: Any, stride: Any, padding: Any) -> None:
  _check(lambda t: F.avg_pool2d(t, kernel, stride, padding), lambda t: TF.avg_pool2d(t, kernel, stride, padding),
         _random((2, 3, 9, 10), 0))


def test_pool_unbatched_negative_and_methods() -> None:
  x = -np.abs(_random((3, 6, 7), 0)) - 1  # all negative: padding must not win the max
  _check(lambda t: t.max_pool2d(3, 2, 1), lambda t: TF.max_pool2d(t, 3, 2, 1), x)
  _check(lambda t: t.avg_pool2d((2, 3)), lambda t: TF.avg_pool2d(t, (2, 3)), x)


def test_pool_errors() -> None:
  with pytest.raises(ShapeError, match=r"\(6, 7\)"): F.max_pool2d(Tensor.zeros(6, 7), 2)
  with pytest.raises(ShapeError, match=r"larger"): F.avg_pool2d(Tensor.zeros(1, 1, 3, 3), 4)
  with pytest.raises(ShapeError, match=r"larger"): F.max_pool2d(Tensor.zeros(1, 1, 5, 5), 3, dilation=3)
  with pytest.raises(ValueError, match=r"half"): F.max_pool2d(Tensor.zeros(1, 1, 5, 5), 2, padding=2)


# ---------------------------------------------------------------- layernorm

@pytest.mark.parametrize("shape,axis", [((2, 3, 5), -1), ((2, 3, 5), (1, 2)), ((2, 3, 4, 5), (-3, -1)), ((3, 6), 0)])
def test_layernorm(shape: tuple[int, ...], axis: Any) -> None:
  axes = (axis,) if isinstance(axis, int) else axis

  def reference(t: torch.Tensor) -> torch.Tensor:
    # torch's layer_norm normalizes trailing dims only; general axes follow its definition (biased variance)
    mean = t.mean(axes, keepdim=True)
    return (t - mean) / torch.sqrt(t.var(axes, keepdim=True, correction=0) + 1e-5)

  x = _random(shape, 0) * 3 + 1
  _check(lambda t: F.layernorm(t, axis), reference, x)
  if axes == (-1,):  # the Tensor method against torch's own layer_norm
    _check(lambda t: t.layernorm(eps=1e-3), lambda t: TF.layer_norm(t, shape[-1:], eps=1e-3), x)


# ---------------------------------------------------------------- dropout

def test_dropout_not_training_is_identity() -> None:
  x = Tensor(_random((8, 8), 0))
  with Tensor.train(False):
    assert F.dropout(x, 0.5, training=False) is x
    assert x.dropout(0.9) is x
  assert x.dropout(0.9) is x  # Tensor.dropout follows Tensor.training, unset: no drop (tinygrad)
  assert (F.dropout(x, 0.9).numpy() == 0).any()  # F.dropout's training defaults to True (PyTorch)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_training(p: float) -> None:
  values = np.abs(_random((200, 100), 0)) + 0.5  # no zeros of its own
  x = Tensor(values, requires_grad=True)
  Tensor.manual_seed(1234)
  with Tensor.train():
    out = F.dropout(x, p)
  result = out.numpy()
  dropped = result == 0
  assert abs(dropped.mean() - p) < 0.02, f"dropped {dropped.mean():.3f} of the elements, expected {p}"
  np.testing.assert_allclose(result[~dropped], values[~dropped] / (1 - p), rtol=1e-6)
  out.sum().backward()
  assert x.grad is not None
  np.testing.assert_allclose(x.grad.numpy(), np.where(dropped, 0.0, 1 / (1 - p)), rtol=1e-6)
  # the same seed gives the same mask, another seed another
  Tensor.manual_seed(1234)
  with Tensor.train():
    np.testing.assert_array_equal(F.dropout(Tensor(values), p).numpy(), result)
    Tensor.manual_seed(4321)
    assert not np.array_equal(F.dropout(Tensor(values), p).numpy(), result)


def test_dropout_edges() -> None:
  x = Tensor(_random((4, 5), 0))
  with Tensor.train():
    np.testing.assert_array_equal(F.dropout(x, 1.0).numpy(), np.zeros((4, 5), np.float32))
    np.testing.assert_array_equal(F.dropout(x, 0.0).numpy(), x.numpy())
    for bad in (-0.1, 1.5):
      with pytest.raises(ValueError, match="dropout"): F.dropout(x, bad)
  with pytest.raises(ValueError): F.dropout(x, 2.0)  # checked even when not training, as torch does


# ---------------------------------------------------------------- kernel counts

def _kernels(tensor: Tensor) -> int:
  GlobalCounters.reset()
  tensor.realize()
  return GlobalCounters.kernel_count


def test_conv2d_bias_relu_is_one_kernel() -> None:
  x, w, b = Tensor(_random((2, 4, 9, 9), 0)).realize(), Tensor(_random((6, 2, 3, 3), 1)).realize(), \
    Tensor(_random((6,), 2)).realize()
  for args in (dict(padding=1), dict(stride=2, dilation=2), dict(padding="same"), dict(stride=(2, 1), padding=(0, 1))):
    assert _kernels(F.conv2d(x, w, b, groups=2, **args).relu()) == 1, args


def test_pool_and_layernorm_kernel_counts() -> None:
  """Reported, not asserted: pytest -s prints what pooling and layernorm take."""
  x = Tensor(_random((2, 4, 9, 9), 0)).realize()
  counts = {"max_pool2d(3, 2, 1)": _kernels(F.max_pool2d(x, 3, 2, 1)), "max_pool2d(2)": _kernels(F.max_pool2d(x, 2)),
            "avg_pool2d(3, 1, 1)": _kernels(F.avg_pool2d(x, 3, 1, 1)), "avg_pool2d(2)": _kernels(F.avg_pool2d(x, 2)),
            "layernorm(-1)": _kernels(F.layernorm(x, -1))}
  print("kernel counts:", counts)
  assert all(count >= 1 for count in counts.values())
