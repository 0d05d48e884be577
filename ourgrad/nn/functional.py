"""Neural-network operations on Tensors: convolutions, pooling, layer normalization and dropout.

Everything here is composed from Tensor operations (movement ops, elementwise math and reduces), so the results
stay lazy, fuse into few kernels and get their gradients from the primitives' autograd. The centre of the module
is `_pool`, a zero-copy *pooling view* that turns the last spatial dims of a tensor into (output position,
window offset) pairs with only reshape/expand/shrink/pad/permute: a convolution is then a broadcast multiply with
the weight and one sum, which the scheduler fuses into a single reduce kernel (the bias add and an activation
after it fuse into the same kernel).

Semantics follow torch.nn.functional: NCHW layout, weights (out, in / groups, kh, kw) for conv2d and
(in, out / groups, kh, kw) for conv_transpose2d, int-or-pair arguments, floor ("ceil_mode=False") output sizes.
"""
from __future__ import annotations

import math
from numbers import Integral
from typing import Sequence

from ourgrad.errors import ShapeError
from ourgrad.tensor import Tensor

IntOrPair = int | Sequence[int]


def _tuple(value: IntOrPair, count: int, name: str) -> tuple[int, ...]:
  """`value` repeated `count` times if it is an int, else checked to hold `count` ints."""
  if isinstance(value, Integral): return (int(value),) * count
  values = tuple(int(v) for v in value)
  if len(values) == 1: return values * count
  if len(values) != count: raise ShapeError(f"{name} needs 1 or {count} values, got {tuple(value)}")
  return values


def _positive(values: tuple[int, ...], name: str) -> None:
  if any(v <= 0 for v in values): raise ValueError(f"{name} must be positive, got {values}")


def _pool(x: Tensor, kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...]) -> Tensor:
  """Windows of the last len(kernel) dims of x, as a view: (..., i1, i2) -> (..., o1, o2, k1, k2) with
  result[..., a, b, p, q] = x[..., a*s1 + p*d1, b*s2 + q*d2] and o = floor((i - d*(k-1) - 1) / s) + 1.

  Nothing is copied: the window is built from movement ops only, so a consumer (a conv's multiply-and-sum, a
  pool's max) reads x directly through the composed index expression. The caller pads x beforehand."""
  spatial = len(kernel)
  batch, sizes = x.shape[:-spatial], x.shape[-spatial:]
  for k, d, i in zip(kernel, dilation, sizes):
    if d * (k - 1) + 1 > i:
      raise ShapeError(f"kernel {kernel} with dilation {dilation} is larger than the (padded) input {sizes} "
                       f"of shape {x.shape}")
  outs = tuple((i - d * (k - 1) - 1) // s + 1 for i, k, s, d in zip(sizes, kernel, stride, dilation))
  keep = [None] * len(batch)

  if all(k <= s for k, s in zip(kernel, stride)) and all(d == 1 for d in dilation):
    # Windows do not overlap: pad/crop each dim to o*s, split it into (o, s) and keep the first k of each s.
    x = x.pad(keep + [(0, o * s - i) for i, o, s in zip(sizes, outs, stride)])
    x = x.reshape(batch + tuple(size for o, s in zip(outs, stride) for size in (o, s)))
    x = x.shrink(keep + [bound for k in kernel for bound in (None, (0, k))])
    order = [*range(len(batch)), *(len(batch) + 2 * a for a in range(spatial)),
             *(len(batch) + 2 * a + 1 for a in range(spatial))]
    return x.permute(order)

  # Windows overlap (k > s) or are dilated. Along one dim of size i, tile x (expand a new axis, merge it) so
  # y[j] = x[j mod i], and reshape a prefix of y into rows of length L = i*f + d: row p, column c holds
  # x[(p*L + c) mod i] = x[(p*d + c) mod i], i.e. each row starts d elements (one dilation step) after the previous
  # one. Column c = a*s is then output position a, and for valid (a, p) the index a*s + p*d < i, so the mod never
  # wraps. f is the smallest whole number of tiles that makes a row long enough to hold the o*s columns we split
  # off. The index math of the composed view folds back to plain a*s + p*d (no div/mod in the kernel).
  rows = [i * max(0, math.ceil((o * s - d) / i)) + d for i, o, s, d in zip(sizes, outs, stride, dilation)]
  tiles = [math.ceil(k * row / i) for k, row, i in zip(kernel, rows, sizes)]
  x = x.reshape(batch + tuple(size for i in sizes for size in (1, i)))
  x = x.expand(batch + tuple(size for r, i in zip(tiles, sizes) for size in (r, i)))
  x = x.reshape(batch + tuple(r * i for r, i in zip(tiles, sizes)))
  # rows of length L, one per kernel offset p: (k, L)
  x = x.shrink(keep + [(0, k * row) for k, row in zip(kernel, rows)])
  x = x.reshape(batch + tuple(size for k, row in zip(kernel, rows) for size in (k, row)))
  # the first o*s columns, split into (o, s); column 0 of each stride step is output position a: (k, o, s)
  x = x.shrink(keep + [bound for k, o, s in zip(kernel, outs, stride) for bound in ((0, k), (0, o * s))])
  x = x.reshape(batch + tuple(size for k, o, s in zip(kernel, outs, stride) for size in (k, o, s)))
  x = x.shrink(keep + [bound for k, o in zip(kernel, outs) for bound in ((0, k), (0, o), (0, 1))])
  x = x.reshape(batch + tuple(size for k, o in zip(kernel, outs) for size in (k, o)))
  # (..., k1, o1, k2, o2) -> (..., o1, o2, k1, k2): output positions first, window offsets last
  order = [*range(len(batch)), *(len(batch) + 2 * a + 1 for a in range(spatial)),
           *(len(batch) + 2 * a for a in range(spatial))]
  return x.permute(order)


def _check_rank(x: Tensor, name: str, ranks: tuple[int, ...]) -> None:
  if x.ndim not in ranks:
    expected = " or ".join(f"{r}-D" for r in ranks)
    raise ShapeError(f"{name} expects a {expected} input, got shape {x.shape}")


def _conv2d(x: Tensor, weight: Tensor, bias: Tensor | None, stride: tuple[int, int],
            pads: list[tuple[int, int]], dilation: tuple[int, int], groups: int) -> Tensor:
  """conv2d of a 4-D x with explicit (before, after) padding per spatial dim (negative pads crop)."""
  batch = x.shape[0]
  out_channels, group_channels, kh, kw = weight.shape
  padded = tuple(size + before + after for size, (before, after) in zip(x.shape[2:], pads))
  if any(d * (k - 1) + 1 > size for k, d, size in zip((kh, kw), dilation, padded)):
    raise ShapeError(f"conv2d kernel of weight {weight.shape} with dilation {dilation} is larger than the input "
                     f"{x.shape} padded by {pads} to {padded}")
  x = x.pad([None, None, *pads])
  windows = _pool(x, (kh, kw), stride, dilation)   # (N, C, oh, ow, kh, kw), a view of x
  oh, ow = windows.shape[2:4]
  per_group = out_channels // groups
  # (N, groups, 1, oh, ow, C/groups, kh, kw) * (1, groups, C_out/groups, 1, 1, C/groups, kh, kw), summed over the
  # last three dims: the reduce dims come last, so the product is never stored and the sum is one kernel.
  windows = windows.reshape(batch, groups, group_channels, oh, ow, kh, kw).permute(0, 1, 3, 4, 2, 5, 6)
  windows = windows.reshape(batch, groups, 1, oh, ow, group_channels, kh, kw)
  kernel = weight.reshape(1, groups, per_group, 1, 1, group_channels, kh, kw)
  out = (windows * kernel).sum((-3, -2, -1)).reshape(batch, out_channels, oh, ow)
  return out if bias is None else out + bias.reshape(1, out_channels, 1, 1)


def _check_conv(name: str, x: Tensor, weight: Tensor, bias: Tensor | None, in_channels: int, out_channels: int,
                groups: int) -> None:
  """Channel and group checks shared by the convolutions; `in_channels`/`out_channels` are what the weight says."""
  if not isinstance(groups, int) or groups <= 0:
    raise ValueError(f"{name}: groups must be a positive int, got {groups}")
  if x.shape[1] != in_channels:
    raise ShapeError(f"{name}: input of shape {x.shape} has {x.shape[1]} channels but weight of shape {weight.shape} "
                     f"with groups={groups} expects {in_channels}")
  if in_channels % groups or out_channels % groups:
    raise ShapeError(f"{name}: groups={groups} must divide the input channels ({in_channels}) and output channels "
                     f"({out_channels}); weight shape {weight.shape}")
  if bias is not None and bias.shape != (out_channels,):
    raise ShapeError(f"{name}: bias of shape {bias.shape} does not match {out_channels} output channels "
                     f"(weight shape {weight.shape})")


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntOrPair = 1,
           padding: IntOrPair | str = 0, dilation: IntOrPair = 1, groups: int = 1) -> Tensor:
  """2-D convolution (cross-correlation) like torch.nn.functional.conv2d.

  x is (N, C_in, H, W) (or unbatched (C_in, H, W)), weight (C_out, C_in / groups, kH, kW), bias (C_out,).
  stride, padding and dilation are ints or (h, w) pairs; padding may also be "valid" (none) or "same" (output
  as large as the input, stride 1 only; an odd total goes to the bottom/right, as in PyTorch).
  Returns (N, C_out, H_out, W_out) with H_out = floor((H + 2*pad - dilation*(kH-1) - 1) / stride) + 1."""
  _check_rank(x, "conv2d", (3, 4))
  if weight.ndim != 4: raise ShapeError(f"conv2d expects a 4-D weight (C_out, C_in/groups, kH, kW), got {weight.shape}")
  if x.ndim == 3: return conv2d(x.unsqueeze(0), weight, bias, stride, padding, dilation, groups).squeeze(0)
  _check_conv("conv2d", x, weight, bias, weight.shape[1] * groups, weight.shape[0], groups)
  strides, dilations = _tuple(stride, 2, "stride"), _tuple(dilation, 2, "dilation")
  _positive(strides, "conv2d stride")
  _positive(dilations, "conv2d dilation")
  kernel = weight.shape[2:]
  if isinstance(padding, str):
    if padding == "valid": pads = [(0, 0), (0, 0)]
    elif padding == "same":
      if strides != (1, 1): raise ValueError(f"conv2d padding='same' needs stride 1, got stride {strides}")
      totals = [d * (k - 1) for k, d in zip(kernel, dilations)]
      pads = [(total // 2, total - total // 2) for total in totals]
    else: raise ValueError(f"conv2d padding must be an int, a pair, 'valid' or 'same', got {padding!r}")
  else:
    amounts = _tuple(padding, 2, "padding")
    if any(p < 0 for p in amounts): raise ValueError(f"conv2d padding must be >= 0, got {amounts}")
    pads = [(p, p) for p in amounts]
  return _conv2d(x, weight, bias, strides, pads, dilations, groups)


def conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: int | Sequence[int] = 1,
           padding: int | Sequence[int] | str = 0, dilation: int | Sequence[int] = 1, groups: int = 1) -> Tensor:
  """1-D convolution like torch.nn.functional.conv1d: x (N, C_in, L) (or (C_in, L)), weight (C_out, C_in / groups,
  K). Computed as conv2d over a height-1 image, so it fuses the same way."""
  _check_rank(x, "conv1d", (2, 3))
  if weight.ndim != 3: raise ShapeError(f"conv1d expects a 3-D weight (C_out, C_in/groups, K), got {weight.shape}")
  if x.ndim == 2: return conv1d(x.unsqueeze(0), weight, bias, stride, padding, dilation, groups).squeeze(0)
  pad2 = padding if isinstance(padding, str) else (0, _tuple(padding, 1, "padding")[0])
  out = conv2d(x.unsqueeze(2), weight.unsqueeze(2), bias, (1, _tuple(stride, 1, "stride")[0]), pad2,
               (1, _tuple(dilation, 1, "dilation")[0]), groups)
  return out.squeeze(2)


def conv_transpose2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntOrPair = 1,
                     padding: IntOrPair = 0, output_padding: IntOrPair = 0, dilation: IntOrPair = 1,
                     groups: int = 1) -> Tensor:
  """Transposed 2-D convolution (the gradient of conv2d w.r.t. its input), like
  torch.nn.functional.conv_transpose2d: x (N, C_in, H, W), weight (C_in, C_out / groups, kH, kW), bias (C_out,).
  H_out = (H - 1)*stride - 2*padding + dilation*(kH - 1) + output_padding + 1.

  Implemented as a conv2d: spread the input out with stride-1 zeros between elements, pad each side by
  dilation*(k-1) - padding (plus output_padding after), and correlate with the spatially flipped kernel whose
  in/out channel axes are swapped within each group."""
  _check_rank(x, "conv_transpose2d", (3, 4))
  if weight.ndim != 4:
    raise ShapeError(f"conv_transpose2d expects a 4-D weight (C_in, C_out/groups, kH, kW), got {weight.shape}")
  if x.ndim == 3:
    return conv_transpose2d(x.unsqueeze(0), weight, bias, stride, padding, output_padding, dilation, groups).squeeze(0)
  in_channels, per_group, kh, kw = weight.shape
  _check_conv("conv_transpose2d", x, weight, bias, in_channels, per_group * groups, groups)
  strides, dilations = _tuple(stride, 2, "stride"), _tuple(dilation, 2, "dilation")
  pads, extras = _tuple(padding, 2, "padding"), _tuple(output_padding, 2, "output_padding")
  _positive(strides, "conv_transpose2d stride")
  _positive(dilations, "conv_transpose2d dilation")
  if any(p < 0 for p in pads): raise ValueError(f"conv_transpose2d padding must be >= 0, got {pads}")
  if any(not 0 <= e < max(s, d) for e, s, d in zip(extras, strides, dilations)):
    raise ValueError(f"conv_transpose2d output_padding {extras} must be >= 0 and smaller than stride {strides} "
                     f"or dilation {dilations}")
  # (C_in, C_out/g, kh, kw) -> (g, C_in/g, C_out/g, kh, kw) -> (C_out, C_in/g, kh, kw), flipped in space
  w = weight.reshape(groups, in_channels // groups, per_group, kh, kw).transpose(1, 2).flip(3, 4)
  w = w.reshape(groups * per_group, in_channels // groups, kh, kw)
  if any(s > 1 for s in strides):
    # zeros between input elements: (H, W) -> (H, 1, W, 1) -> pad to (H, s, W, s) -> (H*s, W*s) -> crop the tail
    n, c, h, wd = x.shape
    x = x.reshape(n, c, h, 1, wd, 1).pad([None, None, None, (0, strides[0] - 1), None, (0, strides[1] - 1)])
    x = x.reshape(n, c, h * strides[0], wd * strides[1])
    x = x.shrink([None, None, (0, (h - 1) * strides[0] + 1), (0, (wd - 1) * strides[1] + 1)])
  # padding beyond dilation*(k-1) crops the spread input (negative pad)
  conv_pads = [(d * (k - 1) - p, d * (k - 1) - p + e) for k, d, p, e in zip((kh, kw), dilations, pads, extras)]
  return _conv2d(x, w, bias, (1, 1), conv_pads, dilations, groups)


def _pool_args(name: str, x: Tensor, kernel_size: IntOrPair, stride: IntOrPair | None, padding: IntOrPair,
               dilation: IntOrPair) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
  _check_rank(x, name, (3, 4))
  kernel = _tuple(kernel_size, 2, "kernel_size")
  # an empty stride (torch's default `stride=[]`) also means "stride = kernel_size"
  strides = kernel if stride is None or (not isinstance(stride, int) and len(stride) == 0) \
    else _tuple(stride, 2, "stride")
  pads, dilations = _tuple(padding, 2, "padding"), _tuple(dilation, 2, "dilation")
  _positive(kernel, f"{name} kernel_size")
  _positive(strides, f"{name} stride")
  _positive(dilations, f"{name} dilation")
  # as in PyTorch: a window must never lie entirely in the padding
  if any(not 0 <= p <= k // 2 for p, k in zip(pads, kernel)):
    raise ValueError(f"{name}: padding {pads} must be >= 0 and at most half of kernel_size {kernel}")
  return kernel, strides, pads, dilations


def avg_pool2d(x: Tensor, kernel_size: IntOrPair = 2, stride: IntOrPair | None = None,
               padding: IntOrPair = 0) -> Tensor:
  """Average over kernel_size windows of the last two dims of x ((N, C, H, W) or (C, H, W)), like
  torch.nn.functional.avg_pool2d with its defaults: stride defaults to kernel_size, zero padding counts in the
  average (count_include_pad=True), output sizes round down (ceil_mode=False)."""
  kernel, strides, pads, _ = _pool_args("avg_pool2d", x, kernel_size, stride, padding, 1)
  padded = x.pad([None] * (x.ndim - 2) + [(p, p) for p in pads])
  return _pool(padded, kernel, strides, (1, 1)).mean((-2, -1))


def max_pool2d(x: Tensor, kernel_size: IntOrPair = 2, stride: IntOrPair | None = None, padding: IntOrPair = 0,
               dilation: IntOrPair = 1) -> Tensor:
  """Maximum over (dilated) kernel_size windows of the last two dims of x ((N, C, H, W) or (C, H, W)), like
  torch.nn.functional.max_pool2d: stride defaults to kernel_size, padding counts as -inf (never the max)."""
  kernel, strides, pads, dilations = _pool_args("max_pool2d", x, kernel_size, stride, padding, dilation)
  padded = x.pad([None] * (x.ndim - 2) + [(p, p) for p in pads], value=x.dtype.min)
  return _pool(padded, kernel, strides, dilations).max((-2, -1))


def layernorm(x: Tensor, axis: int | Sequence[int] = -1, eps: float = 1e-5) -> Tensor:
  """(x - mean) / sqrt(var + eps) over `axis` (an int or a tuple of axes), with the biased variance as in
  torch.nn.functional.layer_norm; no affine weight or bias (nn.LayerNorm adds those)."""
  axes = (int(axis),) if isinstance(axis, Integral) else tuple(axis)
  centered = x - x.mean(axes, keepdim=True)
  return centered * (centered.square().mean(axes, keepdim=True) + eps).rsqrt()


def dropout(x: Tensor, p: float = 0.5, training: bool | None = None) -> Tensor:
  """While training, zero each element with probability p and scale the others by 1 / (1 - p), so the
  expectation is unchanged; otherwise return x. `training` defaults to Tensor.training. The mask comes from
  Tensor.rand, so Tensor.manual_seed makes it reproducible."""
  if not 0.0 <= p <= 1.0: raise ValueError(f"dropout probability must be in [0, 1], got {p}")
  if not (Tensor.training if training is None else training) or p == 0.0: return x
  keep = Tensor.rand(*x.shape, device=x.device) >= p
  # p == 1 keeps nothing (rand < 1 always), and must not scale by 1/0
  return keep.where(x * (1.0 / (1.0 - p)) if p < 1.0 else x, 0)
