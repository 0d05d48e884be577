"""Convolutions over 1, 2 and 3 spatial dims against PyTorch on the CPU, forward and backward: the Tensor methods
(x.conv3d(w)), the functional names, the nn layers; per-side (asymmetric), per-dim, 'same'/'valid' and negative
(cropping) padding; transposed convolutions with stride, dilation, groups and output_padding; padding_mode; the
1-d and 3-d pools. (test_functional.py holds the wide conv2d/conv_transpose2d sweep.)"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from ourgrad import GlobalCounters, Tensor
from ourgrad import nn
from ourgrad.errors import ShapeError
from ourgrad.nn import functional as F

ATOL, RTOL = 1e-4, 1e-4


def _random(shape: tuple[int, ...], seed: int) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _check(ours: Callable[..., Tensor], theirs: Callable[..., torch.Tensor], *arrays: np.ndarray | None,
           atol: float = ATOL, rtol: float = RTOL) -> None:
  """Same inputs through both, compare outputs, backprop one random upstream gradient, compare every input's
  gradient (None inputs stay None)."""
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


# (dims, spatial size, kernel, stride, padding, dilation, groups)
CONV_CASES = [
  (1, (9,), (3,), 1, 0, 1, 1),
  (1, (10,), (4,), 2, 2, 1, 2),
  (1, (11,), (3,), 3, 1, 2, 1),
  (1, (8,), (3,), 1, "same", 2, 2),
  (3, (5, 6, 4), (3, 2, 3), 1, 1, 1, 1),
  (3, (6, 5, 7), (2, 3, 3), (2, 1, 2), (1, 0, 1), (1, 2, 1), 2),
  (3, (4, 5, 5), (3, 3, 3), 1, "same", 1, 1),
  (3, (5, 5, 5), (2, 2, 2), 2, "valid", 1, 4),
]


@pytest.mark.parametrize("dims,size,kernel,stride,padding,dilation,groups", CONV_CASES)
def test_conv_nd(dims: int, size: tuple[int, ...], kernel: tuple[int, ...], stride: Any, padding: Any, dilation: Any,
                 groups: int) -> None:
  args = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
  ours = {1: F.conv1d, 3: F.conv3d}[dims]
  theirs = {1: TF.conv1d, 3: TF.conv3d}[dims]
  _check(lambda x, w, b: ours(x, w, b, **args), lambda x, w, b: theirs(x, w, b, **args),
         _random((2, 4, *size), 0), _random((4, 4 // groups, *kernel), 1), _random((4,), 2))


def test_conv_method_form_and_unbatched() -> None:
  x, w = _random((3, 6, 7), 3), _random((2, 3, 3, 2), 4)
  _check(lambda x, w: x.conv2d(w, stride=2, padding=1), lambda x, w: TF.conv2d(x, w, stride=2, padding=1), x, w)
  x1, w1 = _random((3, 9), 5), _random((4, 3, 2), 6)
  _check(lambda x, w: x.conv1d(w), lambda x, w: TF.conv1d(x, w), x1, w1)


def _torch_padded_conv(dims: int, pads: list[tuple[int, int]]) -> Callable[..., torch.Tensor]:
  """torch's conv of x padded (or cropped, for negative amounts) per side with `pads` (before, after) per dim."""
  flat = [amount for before, after in reversed(pads) for amount in (before, after)]
  conv = {1: TF.conv1d, 2: TF.conv2d, 3: TF.conv3d}[dims]
  return lambda x, w, b: conv(TF.pad(x, flat), w, b)


@pytest.mark.parametrize("padding,pairs", [
  ((1, 0, 2, 1), [(2, 1), (1, 0)]),             # tinygrad's (left, right, top, bottom): last dim first
  (((0, 2), (3, 1)), [(0, 2), (3, 1)]),         # one (before, after) pair per dim, first dim first
  ((-1, 1, 0, -2), [(0, -2), (-1, 1)]),         # negative amounts crop
  (-1, [(-1, -1), (-1, -1)]),
])
def test_conv2d_per_side_and_negative_padding(padding: Any, pairs: list[tuple[int, int]]) -> None:
  _check(lambda x, w, b: x.conv2d(w, b, padding=padding), _torch_padded_conv(2, pairs),
         _random((2, 3, 7, 8), 7), _random((4, 3, 3, 2), 8), _random((4,), 9))


def test_conv1d_and_conv3d_per_side_padding() -> None:
  _check(lambda x, w, b: x.conv1d(w, b, padding=(2, -1)), _torch_padded_conv(1, [(2, -1)]),
         _random((2, 3, 9), 10), _random((2, 3, 3), 11), _random((2,), 12))
  pads = (1, 0, 0, 2, -1, 1)  # (w_left, w_right, h_top, h_bottom, d_front, d_back)
  _check(lambda x, w, b: x.conv3d(w, b, padding=pads), _torch_padded_conv(3, [(-1, 1), (0, 2), (1, 0)]),
         _random((1, 2, 5, 4, 4), 13), _random((3, 2, 2, 3, 2), 14), _random((3,), 15))


# (dims, spatial size, kernel, stride, padding, output_padding, groups, dilation)
TRANSPOSE_CASES = [
  (1, (7,), (3,), 1, 0, 0, 1, 1),
  (1, (6,), (4,), 2, 1, 1, 2, 1),
  (1, (5,), (3,), 3, 2, 2, 1, 2),
  (2, (4, 5), (3, 2), (2, 3), (1, 0), (1, 2), 2, 1),
  (2, (4, 4), (3, 3), 2, 1, 0, 1, (2, 1)),
  (3, (3, 4, 3), (2, 3, 2), 2, (0, 1, 0), (1, 0, 1), 1, 1),
  (3, (3, 3, 4), (3, 2, 2), (1, 2, 2), 1, 0, 2, (1, 1, 2)),
]


@pytest.mark.parametrize("dims,size,kernel,stride,padding,output_padding,groups,dilation", TRANSPOSE_CASES)
def test_conv_transpose_nd(dims: int, size: tuple[int, ...], kernel: tuple[int, ...], stride: Any, padding: Any,
                           output_padding: Any, groups: int, dilation: Any) -> None:
  ours = {1: Tensor.conv_transpose1d, 2: Tensor.conv_transpose2d, 3: Tensor.conv_transpose3d}[dims]
  theirs = {1: TF.conv_transpose1d, 2: TF.conv_transpose2d, 3: TF.conv_transpose3d}[dims]
  args = (stride, padding, output_padding, groups, dilation)  # PyTorch's positional order
  _check(lambda x, w, b: ours(x, w, b, *args), lambda x, w, b: theirs(x, w, b, *args),
         _random((2, 4, *size), 16), _random((4, 6 // groups, *kernel), 17), _random((6,), 18))


def _copy_into(layer: nn.Module, module: torch.nn.Module) -> None:
  module.load_state_dict({name: torch.tensor(value.numpy()) for name, value in layer.state_dict().items()})


def _check_layer(layer: nn.Module, module: torch.nn.Module, x: np.ndarray) -> None:
  _copy_into(layer, module)
  xt, xo = torch.tensor(x, requires_grad=True), Tensor(x, requires_grad=True)
  out, ref = layer(xo), module(xt)
  np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), atol=ATOL, rtol=RTOL)
  upstream = _random(tuple(ref.shape), 19)
  (out * Tensor(upstream)).sum().backward()
  (ref * torch.tensor(upstream)).sum().backward()
  np.testing.assert_allclose(xo.grad.numpy(), xt.grad.numpy(), atol=ATOL, rtol=RTOL)
  np.testing.assert_allclose(layer.weight.grad.numpy(), module.weight.grad.numpy(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("make", [
  lambda m: m.Conv3d(2, 4, (2, 3, 2), stride=(1, 2, 1), padding=1, groups=2),
  lambda m: m.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1),
  lambda m: m.ConvTranspose3d(2, 2, 2, stride=2),
  lambda m: m.Conv1d(3, 2, 3, padding=2, padding_mode="reflect"),
  lambda m: m.Conv2d(3, 2, 3, padding=(1, 2), padding_mode="circular"),
  lambda m: m.Conv2d(3, 2, (3, 2), padding="same", padding_mode="replicate"),
])
def test_layers(make: Callable[[Any], Any]) -> None:
  layer, module = make(nn), make(torch.nn)
  assert layer.weight.shape == tuple(module.weight.shape) and list(layer.state_dict()) == list(module.state_dict())
  dims = layer.weight.ndim - 2
  x = _random((2, layer.in_channels, *(5,) * dims), 20)
  _check_layer(layer, module, x)


@pytest.mark.parametrize("dims,kernel,stride,padding,dilation", [(1, 3, 2, 1, 1), (1, 2, None, 0, 2),
                                                                 (3, 2, None, 0, 1), (3, (3, 2, 2), 1, 1, (1, 2, 1))])
def test_pool_1d_3d(dims: int, kernel: Any, stride: Any, padding: int, dilation: Any) -> None:
  x = _random((2, 3, *(7,) * dims), 21)
  ours_max, theirs_max = {1: (F.max_pool1d, TF.max_pool1d), 3: (F.max_pool3d, TF.max_pool3d)}[dims]
  _check(lambda x: ours_max(x, kernel, stride, padding, dilation), lambda x: theirs_max(x, kernel, stride, padding,
                                                                                        dilation), x)
  ours_avg, theirs_avg = {1: (F.avg_pool1d, TF.avg_pool1d), 3: (F.avg_pool3d, TF.avg_pool3d)}[dims]
  _check(lambda x: ours_avg(x, kernel, stride, padding), lambda x: theirs_avg(x, kernel, stride, padding), x)


def test_conv_errors() -> None:
  x = Tensor.zeros(1, 2, 5, 5)
  with pytest.raises(ShapeError, match="padding"): x.conv2d(Tensor.zeros(2, 2, 3, 3), padding=(1, 2, 3))
  with pytest.raises(ShapeError, match="larger than the input"): x.conv2d(Tensor.zeros(2, 2, 3, 3), padding=-2)
  with pytest.raises(ValueError, match="stride 1"): x.conv2d(Tensor.zeros(2, 2, 3, 3), stride=2, padding="same")
  with pytest.raises(ShapeError, match="5-D weight"): x.unsqueeze(0).conv3d(Tensor.zeros(2, 2, 3, 3))
  with pytest.raises(ShapeError, match="conv1d expects"): x.conv1d(Tensor.zeros(2, 2, 3))
  with pytest.raises(ValueError, match="output_padding"):
    x[:, :, 0].conv_transpose1d(Tensor.zeros(2, 2, 3), stride=2, output_padding=2)
  with pytest.raises(ValueError, match="padding_mode"): nn.Conv2d(2, 2, 3, padding_mode="mirror")


def _kernels(tensor: Tensor) -> int:
  GlobalCounters.reset()
  tensor.realize()
  return GlobalCounters.kernel_count


def test_kernel_counts() -> None:
  """Every convolution, whatever its padding, stays one fused reduce kernel (bias and activation included)."""
  x3, w3 = Tensor(_random((1, 2, 5, 5, 5), 0)).realize(), Tensor(_random((4, 2, 2, 3, 2), 1)).realize()
  b = Tensor(_random((4,), 2)).realize()
  assert _kernels(x3.conv3d(w3, b, stride=(1, 2, 1), padding=(1, 0, -1, 1, 0, 2)).relu()) == 1
  x1, w1 = Tensor(_random((2, 4, 9), 3)).realize(), Tensor(_random((4, 2, 3), 4)).realize()
  assert _kernels(x1.conv1d(w1, b, padding=(2, -1), groups=2, dilation=2).relu()) == 1
  wt = Tensor(_random((4, 2, 3), 5)).realize()
  assert _kernels(x1.conv_transpose1d(wt, stride=2, padding=1, output_padding=1)) == 1
  x2, wt2 = Tensor(_random((1, 4, 4, 5), 6)).realize(), Tensor(_random((4, 3, 3, 3), 7)).realize()
  assert _kernels(x2.conv_transpose2d(wt2, stride=2, dilation=2)) == 1


@pytest.mark.parametrize("dims,shape,output_size", [
  (2, (2, 3, 7, 9), (3, 4)), (2, (3, 8, 8), 4), (2, (1, 2, 5, 6), (None, 4)), (1, (2, 3, 10), 4),
  (3, (1, 2, 5, 4, 6), (2, 3, 4))])
def test_adaptive_avg_pool(dims: int, shape: tuple[int, ...], output_size: Any) -> None:
  ours = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}[dims]
  theirs = {1: TF.adaptive_avg_pool1d, 2: TF.adaptive_avg_pool2d, 3: TF.adaptive_avg_pool3d}[dims]
  _check(lambda x: ours(x, output_size), lambda x: theirs(x, output_size), _random(shape, 22))


def test_functional_embedding() -> None:
  weight, indices = _random((6, 3), 23), np.array([[1, 5], [5, 0]])
  _check(lambda w: F.embedding(Tensor(indices), w), lambda w: TF.embedding(torch.tensor(indices), w), weight)


# stride-1 convolutions take StrideOneConv (backward: a transposed conv for the input, one reduce for the weight)
STRIDE_ONE_CASES = [
  (2, (9, 9), (3, 3), 1, 1, 1), (2, (10, 7), (3, 2), (1, 0), 1, 2), (2, (9, 9), (3, 3), "same", 2, 1),
  (2, (8, 8), (3, 3), (-1, 2, 1, 0), 1, 1), (1, (11,), (4,), 2, 1, 2), (3, (5, 4, 6), (3, 2, 3), 1, 1, 1),
]


@pytest.mark.parametrize("dims,size,kernel,padding,dilation,groups", STRIDE_ONE_CASES)
def test_stride_one_gradients(dims: int, size: tuple[int, ...], kernel: tuple[int, ...], padding: Any,
                              dilation: int, groups: int) -> None:
  """The stride-1 backward (transposed convolution for the input, one reduce for the weight) matches PyTorch for
  padding (symmetric, per dim, 'same', per side with cropping), dilation and groups, in 1, 2 and 3 dims."""
  ours, theirs = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[dims], {1: TF.conv1d, 2: TF.conv2d, 3: TF.conv3d}[dims]
  if isinstance(padding, tuple) and len(padding) == 4:   # per side, last dim first: torch pads first, then convolves
    _check(lambda x, w: ours(x, w, padding=padding, dilation=dilation, groups=groups),
           lambda x, w: theirs(TF.pad(x, padding), w, dilation=dilation, groups=groups),
           _random((2, 4, *size), 10), _random((6, 4 // groups, *kernel), 11))
    return
  _check(lambda x, w, b: ours(x, w, b, padding=padding, dilation=dilation, groups=groups),
         lambda x, w, b: theirs(x, w, b, padding=padding, dilation=dilation, groups=groups),
         _random((2, 4, *size), 10), _random((6, 4 // groups, *kernel), 11), _random((6,), 12))


def test_stride_one_backward_kernels() -> None:
  """The backward of a stride-1 conv stores no per-window gradient: the padded output gradient (one copy, on the CPU;
  GPUs read the realized gradient through masked loads instead), the input gradient and the weight gradient are one
  kernel each, and no buffer is bigger than the padded gradient."""
  x = Tensor(_random((2, 4, 12, 12), 13), requires_grad=True)
  w = Tensor(_random((6, 4, 3, 3), 14), requires_grad=True)
  out = x.conv2d(w, padding=1)
  out.realize()
  out.backward(Tensor(_random(out.shape, 15)).realize())
  from ourgrad.engine.schedule import create_schedule
  schedule = create_schedule([x.grad.lazydata, w.grad.lazydata])
  from ourgrad.tensor_conv import store_padded_gradient
  assert len(schedule) == (3 if store_padded_gradient(x.device) else 2)
  padded_gradient = 2 * 6 * 16 * 16   # the output gradient (12x12) padded by 2 on each side
  assert max(buffer.size for item in schedule for buffer in item.outputs) <= padded_gradient
  assert x.grad.shape == x.shape and w.grad.shape == w.shape
