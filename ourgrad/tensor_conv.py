"""Convolutions and pooling for Tensor (ConvMixin): conv1d/2d/3d, conv_transpose1d/2d/3d, avg/max pooling.

Everything is composed from Tensor operations (movement ops, elementwise math and reduces), so the results stay
lazy, fuse into few kernels and get their gradients from the primitives' autograd. The centre of the module is
`pool_windows` (tensor_windows.py), a zero-copy *pooling view* that turns the last spatial dims of a tensor into
(output position, window offset) pairs with only reshape/expand/shrink/pad/permute, planned once per geometry and
differentiated as one node: a convolution is then a broadcast multiply with the
weight and one sum, which the scheduler fuses into a single reduce kernel (the bias add and an activation after
it fuse into the same kernel). One implementation serves every number of spatial dims.
A stride-1 convolution is one autograd node (`StrideOneConv`) whose backward is two convolution-shaped reduces (the
input gradient as a transposed convolution, the weight gradient), forward and backward built on lazy buffers by the
same helpers (`_conv_sum`, `_product_sum`); other strides differentiate through the view (`MovedView`).

Semantics follow torch.nn.functional: channels-first layout (N, C, *spatial), weights (C_out, C_in / groups, *k)
for convolutions and (C_in, C_out / groups, *k) for transposed ones, int-or-tuple arguments, floor
("ceil_mode=False") output sizes. Convolution padding also takes tinygrad's per-side form and negative amounts.

This module sits below ourgrad/nn (nn/functional.py re-exports these methods) and never imports it, nor the
Tensor class: the methods only call other Tensor methods on `self` and on their tensor arguments.
"""
from __future__ import annotations

import functools
import math
from numbers import Integral
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from ourgrad.device import Device
from ourgrad.dtype import dtypes, operands_dtype
from ourgrad.errors import ShapeError
from ourgrad.function import Function, MaxToOne, _mul
from ourgrad.helpers import normalize_axis
from ourgrad.lazy import LazyBuffer
from ourgrad.mixed_precision import CastPolicy, autocast_op
from ourgrad.ops import SUM
from ourgrad.lazy_moves import composed_view
from ourgrad.tensor_windows import pool_windows, window_ranks


if TYPE_CHECKING:
  from ourgrad.tensor import Tensor

T = TypeVar("T")
IntOrTuple = int | Sequence[int]
Padding = int | Sequence[int] | Sequence[tuple[int, int]] | str


def _tuple(value: IntOrTuple, count: int, name: str) -> tuple[int, ...]:
  """`value` repeated `count` times if it is an int (or a 1-sequence), else checked to hold `count` ints."""
  if isinstance(value, Integral): return (int(value),) * count
  values = tuple(int(v) for v in value)
  if len(values) == 1: return values * count
  if len(values) != count: raise ShapeError(f"{name} needs 1 or {count} values, got {tuple(value)}")
  return values


def _positive(values: tuple[int, ...], name: str) -> None:
  if any(v <= 0 for v in values): raise ValueError(f"{name} must be positive, got {values}")


def _remembered(function: Callable[..., T]) -> Callable[..., T]:
  """`function`, a pure function of shapes and arguments that plans a convolution's or a pooling's movement ops,
  remembered per arguments (bounded): every step of a training run asks for the same few plans, and their tuple
  arithmetic (a generator frame per tuple) cost more than the ops they plan. Arguments that do not hash (a list of
  pads) are planned at each call."""
  cached = functools.lru_cache(maxsize=512)(function)

  @functools.wraps(function)
  def plan(*args: Any) -> T:
    try:
      return cached(*args)
    except TypeError:   # (an unhashable argument; a TypeError of the function itself is raised again here)
      return function(*args)
  return plan


def _pooled_size(size: int, kernel: int, stride: int, pad: int, dilation: int, ceil_mode: bool) -> int:
  """The output length of a pooling window along one dim, as PyTorch computes it: floor or, with `ceil_mode`, ceil
  of the window count, less the last window when it would start in the right padding."""
  span = size + 2 * pad - dilation * (kernel - 1) - 1
  if not ceil_mode: return span // stride + 1
  count = -(-span // stride) + 1
  return count - 1 if (count - 1) * stride >= size + pad else count


def _ceil_extra(sizes: Sequence[int], outs: Sequence[int], kernel: Sequence[int], strides: Sequence[int],
                pads: Sequence[int], dilations: Sequence[int]) -> list[int]:
  """How far past the symmetric padding each dim must be padded on the right for `outs` windows (ceil_mode)."""
  return [max(0, (o - 1) * s + d * (k - 1) + 1 - (i + 2 * p))
          for i, o, k, s, p, d in zip(sizes, outs, kernel, strides, pads, dilations)]


def unfold_patches(x: Tensor, kernel_size: IntOrTuple, dilation: IntOrTuple = 1, padding: IntOrTuple = 0,
                   stride: IntOrTuple = 1) -> Tensor:
  """im2col, torch.nn.functional.unfold: the sliding kH x kW patches of (N, C, H, W) (or (C, H, W)) as columns,
  (N, C * kH * kW, L) with L the number of patches, channel-major within a column as in PyTorch. A view (the
  pooling view) and one reshape: nothing is computed until it is used."""
  _check_rank(x, "unfold", (3, 4))
  kernel, strides = _tuple(kernel_size, 2, "kernel_size"), _tuple(stride, 2, "stride")
  dilations, pads = _tuple(dilation, 2, "dilation"), _tuple(padding, 2, "padding")
  _positive(kernel, "unfold kernel_size")
  _positive(strides, "unfold stride")
  _positive(dilations, "unfold dilation")
  if any(p < 0 for p in pads): raise ValueError(f"unfold padding must be >= 0, got {pads}")
  padded = x.pad([None] * (x.ndim - 2) + [(p, p) for p in pads])
  windows = pool_windows(padded, kernel, strides, dilations)  # (..., C, oH, oW, kH, kW)
  lead = x.ndim - 3
  channels, (out_h, out_w) = x.shape[-3], windows.shape[-4:-2]
  columns = windows.permute(*range(lead + 1), lead + 3, lead + 4, lead + 1, lead + 2)
  return columns.reshape(*x.shape[:-3], channels * kernel[0] * kernel[1], out_h * out_w)


def _check_rank(x: Tensor, name: str, ranks: tuple[int, ...]) -> None:
  if x.ndim not in ranks:
    expected = " or ".join(f"{r}-D" for r in ranks)
    raise ShapeError(f"{name} expects a {expected} input, got shape {x.shape}")


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


def conv_padding(name: str, padding: Padding, kernel: tuple[int, ...], strides: tuple[int, ...],
                 dilations: tuple[int, ...]) -> list[tuple[int, int]]:
  """(before, after) amounts per spatial dim from a convolution's `padding` argument:
  - an int, or one int per dim (PyTorch): the same amount on both sides;
  - 2 ints per dim, last dim first ((left, right, top, bottom), tinygrad's and F.pad's order): per side;
  - one (before, after) pair per dim, first dim first;
  - "valid" (none) or "same" (stride 1 only; the output keeps the input's size, an odd total goes after).
  Negative amounts crop the input."""
  dims = len(kernel)
  if isinstance(padding, str):
    if padding == "valid": return [(0, 0)] * dims
    if padding != "same": raise ValueError(f"{name}: padding must be ints, 'valid' or 'same', got {padding!r}")
    if any(s != 1 for s in strides): raise ValueError(f"{name}: padding='same' needs stride 1, got stride {strides}")
    totals = [d * (k - 1) for k, d in zip(kernel, dilations)]
    return [(total // 2, total - total // 2) for total in totals]
  if isinstance(padding, Integral): return [(int(padding), int(padding))] * dims
  amounts = list(padding)
  if len(amounts) == dims and all(isinstance(a, (tuple, list)) and len(a) == 2 for a in amounts):
    return [(int(before), int(after)) for before, after in amounts]
  if all(isinstance(a, Integral) for a in amounts):
    if len(amounts) == 1: return [(int(amounts[0]), int(amounts[0]))] * dims
    if len(amounts) == dims and dims != 1: return [(int(a), int(a)) for a in amounts]
    if len(amounts) == 2 * dims:
      return [(int(amounts[2 * (dims - 1 - a)]), int(amounts[2 * (dims - 1 - a) + 1])) for a in range(dims)]
  raise ShapeError(f"{name}: padding {padding!r} needs an int, {dims} ints (one per dim), {2 * dims} ints (per "
                   f"side, last dim first) or {dims} (before, after) pairs")


@_remembered
def _conv_arguments(name: str, stride: IntOrTuple, padding: Padding, dilation: IntOrTuple,
                    kernel: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...], tuple[int, ...]]:
  """A convolution's strides, (before, after) pads per spatial dim and dilations, checked, from its arguments."""
  dims = len(kernel)
  strides, dilations = _tuple(stride, dims, "stride"), _tuple(dilation, dims, "dilation")
  _positive(strides, f"{name} stride")
  _positive(dilations, f"{name} dilation")
  return strides, tuple(conv_padding(name, padding, kernel, strides, dilations)), dilations


def _conv(x: Tensor, weight: Tensor, bias: Tensor | None, strides: tuple[int, ...], pads: list[tuple[int, int]],
          dilations: tuple[int, ...], groups: int, name: str) -> Tensor:
  """Convolution of a batched (N, C, *spatial) x with explicit (before, after) padding per spatial dim."""
  kernel = weight.shape[2:]
  padded = tuple(size + before + after for size, (before, after) in zip(x.shape[2:], pads))
  if any(d * (k - 1) + 1 > size for k, d, size in zip(kernel, dilations, padded)):
    raise ShapeError(f"{name}: kernel of weight {weight.shape} with dilation {dilations} is larger than the input "
                     f"{x.shape} padded by {pads} to {padded}")
  if all(s == 1 for s in strides) and isinstance(x.lazydata, LazyBuffer) and isinstance(weight.lazydata, LazyBuffer):
    out = StrideOneConv.apply(x, weight, pads=pads, dilations=dilations, groups=groups)
  else:
    out = _conv_sum(x, weight, strides, pads, dilations, groups)
  dims = len(kernel)
  return out if bias is None else out + bias.reshape(1, weight.shape[0], *([1] * dims))


def _conv_windows(x: Tensor | LazyBuffer, kernel: tuple[int, ...], strides: tuple[int, ...],
                  pads: Sequence[tuple[int, int]], dilations: tuple[int, ...]) -> Tensor | LazyBuffer:
  """The pooling view (N, C, *out, *kernel) of x (a Tensor or a lazy buffer, as `pool_windows`) padded by `pads` (a
  negative amount crops): what a convolution multiplies by its weight."""
  return pool_windows(x, kernel, strides, dilations, tuple(tuple(pair) for pair in pads))


def _conv_sum(x: Tensor | LazyBuffer, weight: Tensor | LazyBuffer, strides: tuple[int, ...],
              pads: Sequence[tuple[int, int]], dilations: tuple[int, ...], groups: int,
              windows: Tensor | LazyBuffer | None = None) -> Tensor | LazyBuffer:
  """The convolution as one multiply-and-sum over a pooling view of the padded x (no bias); `windows`: that view,
  made already (`_conv_windows`). Tensors (differentiated through the view) or lazy buffers (StrideOneConv's
  backward), as `pool_windows`."""
  if windows is None: windows = _conv_windows(x, tuple(weight.shape[2:]), strides, pads, dilations)   # a view of x
  grouped, order, lined_up, weight_shape, axes, out_shape = _conv_sum_plan(tuple(weight.shape), tuple(windows.shape),
                                                                           groups)
  windows = composed_view(windows, (("reshape", grouped), ("permute", order), ("reshape", lined_up)))
  return _product_sum(windows, weight.reshape(weight_shape), axes).reshape(out_shape)


@_remembered
def _conv_sum_plan(weight_shape: tuple[int, ...], windows_shape: tuple[int, ...], groups: int) -> tuple:
  """`_conv_sum`'s shapes: the windows (N, C, *out, *kernel) regrouped, permuted and lined up with the weight
  reshaped, the reduced axes and the output shape."""
  batch, dims = windows_shape[0], len(weight_shape) - 2
  out_channels, group_channels, kernel = weight_shape[0], weight_shape[1], weight_shape[2:]
  outs = windows_shape[2:2 + dims]
  # (N, groups, 1, *out, C/groups, *kernel) * (1, groups, C_out/groups, 1..., C/groups, *kernel), summed over the
  # last 1 + dims axes: the reduce axes come last, so the product is never stored and the sum is one kernel.
  return ((batch, groups, group_channels, *outs, *kernel),
          (0, 1, *range(3, 3 + dims), 2, *range(3 + dims, 3 + 2 * dims)),
          (batch, groups, 1, *outs, group_channels, *kernel),
          (1, groups, out_channels // groups, *([1] * dims), group_channels, *kernel),
          tuple(range(-1 - dims, 0)), (batch, out_channels, *outs))


def _product_sum(a: Tensor | LazyBuffer, b: Tensor | LazyBuffer, axes: tuple[int, ...]) -> Tensor | LazyBuffer:
  """(a * b).sum(axes), a and b of one rank broadcast against each other: for tensors Tensor's ops, for lazy buffers
  the graph those ops build (promotion, the broadcast, the product, the sum over the positive axes in float32 for
  half-precision operands, the reduced axes dropped, the cast back), without a Function per operation."""
  if not isinstance(a, LazyBuffer) or not isinstance(b, LazyBuffer): return (a * b).sum(axes)
  if a.dtype != b.dtype:
    dtype = operands_dtype([a.dtype, b.dtype])
    a, b = a.cast(dtype), b.cast(dtype)
  shape, reduce_axes, kept = _product_sum_plan(a.shape, b.shape, axes)
  product = _mul(a.expand(shape), b.expand(shape))
  accumulate = dtypes.float32 if product.dtype in (dtypes.float16, dtypes.bfloat16) else product.dtype
  return product.cast(accumulate).reduce(SUM, reduce_axes).reshape(kept).cast(product.dtype)


@_remembered
def _product_sum_plan(a_shape: tuple[int, ...], b_shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple:
  """`_product_sum`'s shapes: the broadcast shape, the reduced axes (positive) and the shape kept."""
  shape = tuple(size_a if size_b == 1 else size_b for size_a, size_b in zip(a_shape, b_shape))
  reduce_axes = tuple(normalize_axis(axis, len(shape)) for axis in axes)
  return shape, reduce_axes, tuple(size for axis, size in enumerate(shape) if axis not in reduce_axes)


def _weight_gradient(windows: Tensor | LazyBuffer, grad: Tensor | LazyBuffer, kernel: tuple[int, ...],
                     groups: int) -> Tensor | LazyBuffer:
  """d(stride-1 conv)/d(weight): sum over the batch and output positions of the `windows` of x (the forward's
  `_conv_windows`, (N, C, *out, *kernel)) times the output gradient; (C_out, C_in / groups, *kernel). One reduce
  kernel, as the forward."""
  windows_shape, grad_shape, order, axes, out_shape = _weight_gradient_plan(tuple(windows.shape), tuple(grad.shape),
                                                                            kernel, groups)
  # the reduce axes (batch, output positions) moved last, so the sum is one kernel with no stored product; the
  # operands are permuted, not the product, so the reduce reads its MUL base directly and the lazy layer sees a
  # matmul-like reduce (split-K on GPUs, lazy_reduce._matmul_like_reduce)
  product_sum = _product_sum(composed_view(windows, (("reshape", windows_shape), ("permute", order))),
                             composed_view(grad, (("reshape", grad_shape), ("permute", order))), axes)
  return product_sum.reshape(out_shape)


@_remembered
def _weight_gradient_plan(windows_shape: tuple[int, ...], grad_shape: tuple[int, ...], kernel: tuple[int, ...],
                          groups: int) -> tuple:
  """`_weight_gradient`'s shapes: the windows and the gradient regrouped, the order that puts the reduced axes last,
  the reduced axes and the weight's shape."""
  batch, channels, dims = windows_shape[0], windows_shape[1], len(kernel)
  out_channels, outs = grad_shape[1], grad_shape[2:]
  group_channels, per_group = channels // groups, out_channels // groups
  return ((batch, groups, 1, group_channels, *outs, *kernel), (batch, groups, per_group, 1, *outs, *([1] * dims)),
          (1, 2, 3, *range(4 + dims, 4 + 2 * dims), 0, *range(4, 4 + dims)), tuple(range(-1 - dims, 0)),
          (out_channels, group_channels, *kernel))


def _input_gradient(grad: Tensor | LazyBuffer, weight: Tensor | LazyBuffer, input_shape: tuple[int, ...],
                    pads: Sequence[tuple[int, int]], dilations: tuple[int, ...], groups: int) -> Tensor | LazyBuffer:
  """d(stride-1 conv)/d(input): the transposed convolution of the output gradient (a convolution with the flipped,
  regrouped weight, padded by dilation*(k-1) on each side), then the input's padding taken back off. One reduce
  kernel shaped like the forward, instead of every window's gradient stored and summed back (col2im)."""
  dims = len(weight.shape) - 2
  transposed_pads, crop, uncrop = _input_gradient_plan(tuple(weight.shape), tuple(input_shape), tuple(grad.shape),
                                                       tuple(pads), dilations)
  flipped = _transposed_weight(weight, groups)
  # the gradient is stored once, so that the convolution does not recompute its producer (a batchnorm backward) for
  # every tap of the window; on the CPU padded (a copy the size of the padded gradient: the convolution then reads it
  # without a bounds check per element, which keeps its register tile vectorizable), on GPUs as it is (the
  # convolution's loads are masked at the padding)
  if store_padded_gradient(grad.device): grad = grad.pad(transposed_pads).contiguous()
  else: grad = grad.contiguous().pad(transposed_pads)
  grad_padded = _conv_sum(grad, flipped, (1,) * dims, ((0, 0),) * dims, dilations, groups)
  # the input's padding taken back off (and the part a negative padding cropped put back as zeros)
  return grad_padded.shrink(crop).pad(uncrop)


@_remembered
def _input_gradient_plan(weight_shape: tuple[int, ...], input_shape: tuple[int, ...], grad_shape: tuple[int, ...],
                         pads: tuple[tuple[int, int], ...], dilations: tuple[int, ...]) -> tuple:
  """`_input_gradient`'s movement arguments: the output gradient's padding for the transposed convolution, then the
  crop of the input's padding and the zeros put back where a negative padding cropped the input."""
  kernel = weight_shape[2:]
  padded = [size + before + after for size, (before, after) in zip(input_shape[2:], pads)]
  # rows of the padded input past the last window get no gradient: pad the transposed conv's output up to them
  used = [out + d * (k - 1) for out, k, d in zip(grad_shape[2:], kernel, dilations)]
  transposed_pads = ((0, 0), (0, 0), *((d * (k - 1), d * (k - 1) + size - reach)
                                       for k, d, size, reach in zip(kernel, dilations, padded, used)))
  # (the transposed convolution's output is the padded input's shape)
  crop = ((0, input_shape[0]), (0, input_shape[1]),
          *((max(0, before), size - max(0, after)) for (before, after), size in zip(pads, padded)))
  uncrop = ((0, 0), (0, 0), *((max(0, -before), max(0, -after)) for before, after in pads))
  return transposed_pads, crop, uncrop


def store_padded_gradient(device: str) -> bool:
  """Whether a stride-1 conv's input gradient stores its output gradient padded (on the CPU, see _input_gradient) or
  unpadded (on GPUs, where the convolution's loads are masked at the padding anyway: MNIST's conv2 writes and reads
  2 MB instead of 8.4 MB, and the weight gradient reads the stored gradient too)."""
  return not Device[device].renderer.runs_thread_blocks


def _transposed_weight(weight: Tensor | LazyBuffer, groups: int) -> Tensor | LazyBuffer:
  """A weight (A, B, *k) of `groups` groups (A/groups rows each) -> (groups*B, A/groups, *k), flipped in space: the
  conv weight of the transposed convolution, which maps a conv's output back onto its input."""
  first, per_group, kernel = weight.shape[0], weight.shape[1], tuple(weight.shape[2:])
  dims = len(kernel)
  w = weight.reshape((groups, first // groups, per_group, *kernel)).permute((0, 2, 1, *range(3, 3 + dims)))
  # (a lazy buffer's flip takes a mask of the axes, a tensor's the axes)
  w = w.flip(tuple(axis >= 3 for axis in range(3 + dims))) if isinstance(w, LazyBuffer) else w.flip(*range(3, 3 + dims))
  return w.reshape((groups * per_group, first // groups, *kernel))


class StrideOneConv(Function):
  """A stride-1 convolution (no bias) whose backward is two convolution-shaped reduces: the weight gradient and
  the input gradient as a transposed convolution. The autograd of the pooling view would instead store the
  gradient of every window (C_in * prod(kernel) values per output position) and sum the overlaps back, which
  on the CPU cost more than the forward and the weight gradient together."""

  def forward(self, x: LazyBuffer, weight: LazyBuffer, pads: list[tuple[int, int]] = (),
              dilations: tuple[int, ...] = (), groups: int = 1) -> LazyBuffer:
    self.x, self.weight, self.pads, self.dilations, self.groups = x, weight, pads, dilations, groups
    dims = len(weight.shape) - 2
    # built on the lazy buffers (no Function per operation: this Function's own backward is the gradient). The
    # convolutions that reach here are autocast policy ops, whose inner ops follow no policy: the graph is the one
    # Tensor's ops build
    windows = _conv_windows(x, tuple(weight.shape[2:]), (1,) * dims, pads, dilations)
    # the weight gradient multiplies the same view: kept (a view of x, which is kept anyway), not built again
    self.windows = windows
    return _conv_sum(x, weight, (1,) * dims, pads, dilations, groups, windows)

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, LazyBuffer | None]:
    # built on the lazy buffers (the graphs Tensor's ops would build, without a Function and a tensor per operation):
    # nothing here needs autograd, and like every backward it follows no autocast policy (PyTorch's backward ops
    # run in the dtypes of their forward)
    grad_x = _input_gradient(grad_output, self.weight, self.x.shape, self.pads, self.dilations, self.groups) \
      if self.needs_input_grad[0] else None
    grad_w = _weight_gradient(self.windows, grad_output, tuple(self.weight.shape[2:]), self.groups) \
      if self.needs_input_grad[1] else None
    return grad_x, grad_w


def _spread(x: Tensor, strides: tuple[int, ...]) -> Tensor:
  """(N, C, *sizes) with stride - 1 zeros between neighbours along each spatial dim: (N, C, *((i-1)*s + 1))."""
  batch, sizes = x.shape[:2], x.shape[2:]
  x = x.reshape(*batch, *(size for i in sizes for size in (i, 1)))
  x = x.pad([None, None, *(pair for s in strides for pair in (None, (0, s - 1)))])
  x = x.reshape(*batch, *(i * s for i, s in zip(sizes, strides)))
  return x.shrink([None, None, *((0, (i - 1) * s + 1) for i, s in zip(sizes, strides))])


def fold_patches(x: Tensor, output_size: IntOrTuple, kernel_size: IntOrTuple, dilation: IntOrTuple = 1,
                 padding: IntOrTuple = 0, stride: IntOrTuple = 1) -> Tensor:
  """col2im, torch.nn.functional.fold: columns (N, C * kH * kW, L) (or unbatched) summed back into an (N, C, H, W)
  image of `output_size`, overlapping patches adding up; the adjoint of unfold_patches. Each of the kH * kW kernel
  offsets is its columns spread by the stride and padded into place, and the pieces are added: one fused kernel."""
  _check_rank(x, "fold", (2, 3))
  sizes, kernel = _tuple(output_size, 2, "output_size"), _tuple(kernel_size, 2, "kernel_size")
  dilations, pads = _tuple(dilation, 2, "dilation"), _tuple(padding, 2, "padding")
  strides = _tuple(stride, 2, "stride")
  _positive(kernel, "fold kernel_size")
  _positive(strides, "fold stride")
  _positive(dilations, "fold dilation")
  batched = x if x.ndim == 3 else x.unsqueeze(0)
  outs = [(i + 2 * p - d * (k - 1) - 1) // s + 1 for i, k, s, p, d in zip(sizes, kernel, strides, pads, dilations)]
  patch = kernel[0] * kernel[1]
  if batched.shape[1] % patch or batched.shape[2] != outs[0] * outs[1] or min(outs) <= 0:
    raise ShapeError(f"fold of {x.shape} into {sizes} with kernel {kernel}: needs C * {patch} rows and "
                     f"{max(outs[0], 0) * max(outs[1], 0)} columns (the patch count)")
  channels = batched.shape[1] // patch
  columns = batched.reshape(batched.shape[0], channels, kernel[0], kernel[1], outs[0], outs[1])
  padded_sizes = [i + 2 * p for i, p in zip(sizes, pads)]
  image = None
  for row in range(kernel[0]):
    for col in range(kernel[1]):
      piece = _spread(columns[:, :, row, col], strides)
      starts = (row * dilations[0], col * dilations[1])
      piece = piece.pad([None, None, *((start, full - start - size) for start, full, size
                                       in zip(starts, padded_sizes, piece.shape[2:]))])
      image = piece if image is None else image + piece
  assert image is not None
  image = image.shrink([None, None, *((p, p + i) for p, i in zip(pads, sizes))])
  return image if x.ndim == 3 else image.squeeze(0)


@_remembered
def _pool_arguments(name: str, dims: int, kernel_size: IntOrTuple, stride: IntOrTuple | None, padding: IntOrTuple,
                    dilation: IntOrTuple) -> tuple[tuple[int, ...], ...]:
  """A pooling's kernel, strides, pads and dilations per spatial dim, checked, from its arguments."""
  kernel = _tuple(kernel_size, dims, "kernel_size")
  # an empty stride (torch's default `stride=[]`) also means "stride = kernel_size"
  strides = kernel if stride is None or (not isinstance(stride, Integral) and len(stride) == 0) \
    else _tuple(stride, dims, "stride")
  pads, dilations = _tuple(padding, dims, "padding"), _tuple(dilation, dims, "dilation")
  _positive(kernel, f"{name} kernel_size")
  _positive(strides, f"{name} stride")
  _positive(dilations, f"{name} dilation")
  # as in PyTorch: a window must never lie entirely in the padding
  if any(not 0 <= p <= k // 2 for p, k in zip(pads, kernel)):
    raise ValueError(f"{name}: padding {pads} must be >= 0 and at most half of kernel_size {kernel}")
  return kernel, strides, pads, dilations


class ConvMixin:
  """Tensor methods for convolutions and pooling over 1, 2 or 3 spatial dimensions."""
  __slots__ = ()

  # ---------------------------------------------------------------- convolutions

  def _convolve(self: Tensor, dims: int, weight: Tensor, bias: Tensor | None, stride: IntOrTuple, padding: Padding,
                dilation: IntOrTuple, groups: int) -> Tensor:
    name = f"conv{dims}d"
    _check_rank(self, name, (dims + 1, dims + 2))
    if weight.ndim != dims + 2:
      raise ShapeError(f"{name} expects a {dims + 2}-D weight (C_out, C_in/groups, {dims} kernel sizes), got "
                       f"{weight.shape}")
    if self.ndim == dims + 1:  # unbatched input
      return self.unsqueeze(0)._convolve(dims, weight, bias, stride, padding, dilation, groups).squeeze(0)
    _check_conv(name, self, weight, bias, weight.shape[1] * groups, weight.shape[0], groups)
    strides, pads, dilations = _conv_arguments(name, stride, padding, dilation, weight.shape[2:])
    return _conv(self, weight, bias, strides, pads, dilations, groups, name)

  @autocast_op(CastPolicy.LOWER)
  def conv1d(self: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntOrTuple = 1,
             padding: Padding = 0, dilation: IntOrTuple = 1, groups: int = 1) -> Tensor:
    """1-D convolution (cross-correlation) like torch.nn.functional.conv1d: input (N, C_in, L) or (C_in, L), weight
    (C_out, C_in / groups, K), bias (C_out,). padding: an int, (left, right), "valid" or "same"; negative crops."""
    return self._convolve(1, weight, bias, stride, padding, dilation, groups)

  @autocast_op(CastPolicy.LOWER)
  def conv2d(self: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntOrTuple = 1,
             padding: Padding = 0, dilation: IntOrTuple = 1, groups: int = 1) -> Tensor:
    """2-D convolution (cross-correlation) like torch.nn.functional.conv2d.

    Input (N, C_in, H, W) or unbatched (C_in, H, W), weight (C_out, C_in / groups, kH, kW), bias (C_out,).
    stride and dilation are ints or (h, w) pairs. padding is an int, an (h, w) pair, per side (left, right, top,
    bottom) as in tinygrad, ((top, bottom), (left, right)), "valid" or "same" (stride 1; an odd total goes to the
    bottom/right, as in PyTorch); negative amounts crop.
    Returns (N, C_out, H_out, W_out) with H_out = floor((H + top + bottom - dilation*(kH-1) - 1) / stride) + 1."""
    return self._convolve(2, weight, bias, stride, padding, dilation, groups)

  @autocast_op(CastPolicy.LOWER)
  def conv3d(self: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntOrTuple = 1,
             padding: Padding = 0, dilation: IntOrTuple = 1, groups: int = 1) -> Tensor:
    """3-D convolution like torch.nn.functional.conv3d: input (N, C_in, D, H, W) or (C_in, D, H, W), weight
    (C_out, C_in / groups, kD, kH, kW). padding as for conv2d, with 3 dims (6 per-side values, last dim first)."""
    return self._convolve(3, weight, bias, stride, padding, dilation, groups)

  def _convolve_transposed(self: Tensor, dims: int, weight: Tensor, bias: Tensor | None, stride: IntOrTuple,
                           padding: IntOrTuple, output_padding: IntOrTuple, groups: int,
                           dilation: IntOrTuple) -> Tensor:
    name = f"conv_transpose{dims}d"
    _check_rank(self, name, (dims + 1, dims + 2))
    if weight.ndim != dims + 2:
      raise ShapeError(f"{name} expects a {dims + 2}-D weight (C_in, C_out/groups, {dims} kernel sizes), got "
                       f"{weight.shape}")
    if self.ndim == dims + 1:
      unbatched = self.unsqueeze(0)
      return unbatched._convolve_transposed(dims, weight, bias, stride, padding, output_padding, groups,
                                            dilation).squeeze(0)
    in_channels, per_group, kernel = weight.shape[0], weight.shape[1], weight.shape[2:]
    _check_conv(name, self, weight, bias, in_channels, per_group * groups, groups)
    strides, dilations = _tuple(stride, dims, "stride"), _tuple(dilation, dims, "dilation")
    pads, extras = _tuple(padding, dims, "padding"), _tuple(output_padding, dims, "output_padding")
    _positive(strides, f"{name} stride")
    _positive(dilations, f"{name} dilation")
    if any(p < 0 for p in pads): raise ValueError(f"{name}: padding must be >= 0, got {pads}")
    if any(not 0 <= e < max(s, d) for e, s, d in zip(extras, strides, dilations)):
      raise ValueError(f"{name}: output_padding {extras} must be >= 0 and smaller than stride {strides} or "
                       f"dilation {dilations}")
    # (C_in, C_out/g, *k) -> (g, C_in/g, C_out/g, *k) -> (C_out, C_in/g, *k), flipped in space: the transposed
    # convolution is the convolution of the spread-out input with this kernel
    w = _transposed_weight(weight, groups)
    x = _spread(self, strides) if any(s > 1 for s in strides) else self
    # padding beyond dilation*(k-1) crops the spread input (negative pad)
    conv_pads = [(d * (k - 1) - p, d * (k - 1) - p + e) for k, d, p, e in zip(kernel, dilations, pads, extras)]
    return _conv(x, w, bias, (1,) * dims, conv_pads, dilations, groups, name)

  @autocast_op(CastPolicy.LOWER)
  def conv_transpose1d(self: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntOrTuple = 1,
                       padding: IntOrTuple = 0, output_padding: IntOrTuple = 0, groups: int = 1,
                       dilation: IntOrTuple = 1) -> Tensor:
    """Transposed 1-D convolution like torch.nn.functional.conv_transpose1d (same argument order): input
    (N, C_in, L), weight (C_in, C_out / groups, K); L_out = (L-1)*stride - 2*padding + dilation*(K-1) +
    output_padding + 1."""
    return self._convolve_transposed(1, weight, bias, stride, padding, output_padding, groups, dilation)

  @autocast_op(CastPolicy.LOWER)
  def conv_transpose2d(self: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntOrTuple = 1,
                       padding: IntOrTuple = 0, output_padding: IntOrTuple = 0, groups: int = 1,
                       dilation: IntOrTuple = 1) -> Tensor:
    """Transposed 2-D convolution (the gradient of conv2d w.r.t. its input), like
    torch.nn.functional.conv_transpose2d (same argument order): input (N, C_in, H, W), weight
    (C_in, C_out / groups, kH, kW), bias (C_out,); H_out = (H-1)*stride - 2*padding + dilation*(kH-1) +
    output_padding + 1. Computed as a conv2d of the input spread out by the stride, with the flipped kernel."""
    return self._convolve_transposed(2, weight, bias, stride, padding, output_padding, groups, dilation)

  @autocast_op(CastPolicy.LOWER)
  def conv_transpose3d(self: Tensor, weight: Tensor, bias: Tensor | None = None, stride: IntOrTuple = 1,
                       padding: IntOrTuple = 0, output_padding: IntOrTuple = 0, groups: int = 1,
                       dilation: IntOrTuple = 1) -> Tensor:
    """Transposed 3-D convolution like torch.nn.functional.conv_transpose3d: input (N, C_in, D, H, W), weight
    (C_in, C_out / groups, kD, kH, kW)."""
    return self._convolve_transposed(3, weight, bias, stride, padding, output_padding, groups, dilation)

  # ---------------------------------------------------------------- pooling

  def _pool_args(self: Tensor, name: str, dims: int, kernel_size: IntOrTuple, stride: IntOrTuple | None,
                 padding: IntOrTuple, dilation: IntOrTuple) -> tuple[tuple[int, ...], ...]:
    _check_rank(self, name, (dims + 1, dims + 2))
    return _pool_arguments(name, dims, kernel_size, stride, padding, dilation)

  def _avg_pool(self: Tensor, dims: int, kernel_size: IntOrTuple, stride: IntOrTuple | None,
                padding: IntOrTuple) -> Tensor:
    kernel, strides, pads, _ = self._pool_args(f"avg_pool{dims}d", dims, kernel_size, stride, padding, 1)
    padded = self.pad([None] * (self.ndim - dims) + [(p, p) for p in pads])
    return pool_windows(padded, kernel, strides, (1,) * dims).mean(tuple(range(-dims, 0)))

  def _max_pool(self: Tensor, dims: int, kernel_size: IntOrTuple, stride: IntOrTuple | None, padding: IntOrTuple,
                dilation: IntOrTuple) -> Tensor:
    kernel, strides, pads, dilations = self._pool_args(f"max_pool{dims}d", dims, kernel_size, stride, padding,
                                                       dilation)
    padded = self.pad([None] * (self.ndim - dims) + [(p, p) for p in pads], value=self.dtype.min)
    windows = pool_windows(padded, kernel, strides, dilations)
    axes = tuple(range(windows.ndim - dims, windows.ndim))
    if not self.requires_grad or type(self).no_grad: return windows.max(axes)
    # the gradient goes to one maximum per window, as in PyTorch: ranks order the window's elements
    ranks = window_ranks(self, windows.shape, pads, kernel, strides, dilations)
    return MaxToOne.apply(windows, ranks, axes=axes).reshape(windows.shape[:-dims])

  def _avg_pool_options(self: Tensor, dims: int, kernel_size: IntOrTuple, stride: IntOrTuple | None,
                        padding: IntOrTuple, ceil_mode: bool, count_include_pad: bool,
                        divisor_override: int | None, dilation: IntOrTuple = 1) -> Tensor:
    """Average pooling with PyTorch's options (the plain case goes through _avg_pool): the window sums divided by
    `divisor_override`, or by how many places of each window count: the input and the zero padding with
    `count_include_pad`, the input alone without it; never the extra right padding that ceil_mode adds. (tinygrad's
    `dilation` spreads the window as max pooling's does.)"""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    kernel, strides, pads, dilations = self._pool_args(f"avg_pool{dims}d", dims, kernel_size, stride, padding,
                                                       dilation)
    if divisor_override is not None and divisor_override <= 0:
      raise ValueError(f"avg_pool{dims}d divisor_override must be positive, got {divisor_override}")
    sizes = self.shape[-dims:]
    outs = [_pooled_size(i, k, s, p, d, ceil_mode) for i, k, s, p, d in zip(sizes, kernel, strides, pads, dilations)]
    extra = _ceil_extra(sizes, outs, kernel, strides, pads, dilations)
    lead = [None] * (self.ndim - dims)
    padded = self.pad(lead + [(p, p + e) for p, e in zip(pads, extra)])
    window_axes = tuple(range(-dims, 0))
    total = pool_windows(padded, kernel, strides, dilations).sum(window_axes)
    if divisor_override is not None: return total / divisor_override
    counted = Tensor.ones(*sizes, device=self.device).pad([(p, p) for p in pads], value=float(count_include_pad))
    counts = pool_windows(counted.pad([(0, e) for e in extra]), kernel, strides, dilations).sum(window_axes)
    return total / counts

  def _max_pool_options(self: Tensor, dims: int, kernel_size: IntOrTuple, stride: IntOrTuple | None,
                        padding: IntOrTuple, dilation: IntOrTuple, ceil_mode: bool,
                        return_indices: bool) -> Tensor | tuple[Tensor, Tensor]:
    """Max pooling with PyTorch's options (the plain case goes through _max_pool). With `return_indices`, also the
    position of each maximum in its (N, C) plane, flattened (int64, as max_unpool takes it): the first maximum in
    the window's row-major order, as PyTorch's CPU kernel picks it."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    kernel, strides, pads, dilations = self._pool_args(f"max_pool{dims}d", dims, kernel_size, stride, padding,
                                                       dilation)
    sizes = self.shape[-dims:]
    outs = [_pooled_size(i, k, s, p, d, ceil_mode) for i, k, s, p, d in zip(sizes, kernel, strides, pads, dilations)]
    extra = _ceil_extra(sizes, outs, kernel, strides, pads, dilations)
    sides = [(p, p + e) for p, e in zip(pads, extra)]
    padded = self.pad([None] * (self.ndim - dims) + sides, value=self.dtype.min)
    windows = pool_windows(padded, kernel, strides, dilations)
    values = windows.max(tuple(range(-dims, 0)))
    if not return_indices: return values
    plane = math.prod(sizes)
    # each place's flat position in its plane, the padding past every real one so that it never wins a tie
    positions = Tensor.arange(plane, device=self.device).reshape(*sizes).pad(sides, value=plane)
    position_windows = pool_windows(positions, kernel, strides, dilations).flatten(-dims)
    is_max = windows.detach().flatten(-dims) == values.detach().unsqueeze(-1)
    indices = is_max.where(position_windows, plane).min(-1)
    return values, indices.cast(dtypes.int64)

  def _max_unpool(self: Tensor, dims: int, indices: Tensor, kernel_size: IntOrTuple, stride: IntOrTuple | None,
                  padding: IntOrTuple, output_size: Sequence[int] | None, dilation: IntOrTuple = 1) -> Tensor:
    """The inverse of max pooling: each value written at its flat position `indices` (max_pool's return_indices)
    of an output plane of zeros, like torch.nn.functional.max_unpool{1,2}d. A one-hot over the output positions and
    a sum (no scatter op). Where an index repeats (overlapping pooling windows) the values are equal and one is
    written, while each of them gets the whole gradient of its place, as PyTorch's gather-shaped backward gives."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    _check_rank(self, f"max_unpool{dims}d", (dims + 1, dims + 2))
    kernel = _tuple(kernel_size, dims, "kernel_size")
    strides = kernel if stride is None else _tuple(stride, dims, "stride")
    pads, dilations = _tuple(padding, dims, "padding"), _tuple(dilation, dims, "dilation")
    if indices.shape != self.shape:
      raise ShapeError(f"max_unpool{dims}d indices of shape {indices.shape} must match the input's {self.shape}")
    if indices.dtype.is_float or indices.dtype == dtypes.bool:
      raise IndexError(f"max_unpool{dims}d indices must hold integers, got {indices.dtype}")
    sizes = self.shape[-dims:]
    outs = tuple((i - 1) * s - 2 * p + d * (k - 1) + 1
                 for i, s, p, k, d in zip(sizes, strides, pads, kernel, dilations))
    if output_size is not None: outs = tuple(int(size) for size in tuple(output_size)[-dims:])
    plane = math.prod(outs)
    hits = indices.flatten(-dims).unsqueeze(-1) == Tensor.arange(plane, device=self.device)  # (..., L, plane)
    sources = self.flatten(-dims).unsqueeze(-1)
    summed = hits.where(sources, 0).sum(-2, dtype=self.dtype)  # the value, and a gradient of 1 for every source
    # a repeated place holds the sum of equal values: keep the sum's gradient, take the value of one of them
    largest = hits.where(sources, self.dtype.min).max(-2)
    values = (hits.sum(-2) > 1).where(summed + (largest - summed).detach(), summed)
    return values.reshape(*self.shape[:-dims], *outs)

  def avg_pool1d(self: Tensor, kernel_size: IntOrTuple = 2, stride: IntOrTuple | None = None,
                 padding: IntOrTuple = 0, ceil_mode: bool = False, count_include_pad: bool = True,
                 divisor_override: int | None = None, dilation: IntOrTuple = 1) -> Tensor:
    """Average over kernel_size windows of the last dim of (N, C, L) or (C, L), like
    torch.nn.functional.avg_pool1d (see avg_pool2d)."""
    if ceil_mode or not count_include_pad or divisor_override is not None or dilation != 1:
      return self._avg_pool_options(1, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
                                    dilation)
    return self._avg_pool(1, kernel_size, stride, padding)

  def avg_pool2d(self: Tensor, kernel_size: IntOrTuple = 2, stride: IntOrTuple | None = None,
                 padding: IntOrTuple = 0, ceil_mode: bool = False, count_include_pad: bool = True,
                 divisor_override: int | None = None, dilation: IntOrTuple = 1) -> Tensor:
    """Average over kernel_size windows of the last two dims of (N, C, H, W) or (C, H, W), like
    torch.nn.functional.avg_pool2d: stride defaults to kernel_size; zero padding counts in the average unless
    count_include_pad=False; ceil_mode rounds the output size up (a window may hang over the right edge, and only
    its places inside the padded input count); divisor_override replaces the count. `dilation` (tinygrad's, not
    PyTorch's) spreads the window as in max_pool2d."""
    if ceil_mode or not count_include_pad or divisor_override is not None or dilation != 1:
      return self._avg_pool_options(2, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
                                    dilation)
    return self._avg_pool(2, kernel_size, stride, padding)

  def avg_pool3d(self: Tensor, kernel_size: IntOrTuple = 2, stride: IntOrTuple | None = None,
                 padding: IntOrTuple = 0, ceil_mode: bool = False, count_include_pad: bool = True,
                 divisor_override: int | None = None, dilation: IntOrTuple = 1) -> Tensor:
    """Average over kernel_size windows of the last three dims, like torch.nn.functional.avg_pool3d."""
    if ceil_mode or not count_include_pad or divisor_override is not None or dilation != 1:
      return self._avg_pool_options(3, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override,
                                    dilation)
    return self._avg_pool(3, kernel_size, stride, padding)

  def max_pool1d(self: Tensor, kernel_size: IntOrTuple = 2, stride: IntOrTuple | None = None,
                 padding: IntOrTuple = 0, dilation: IntOrTuple = 1, ceil_mode: bool = False,
                 return_indices: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Maximum over (dilated) kernel_size windows of the last dim, like torch.nn.functional.max_pool1d (see
    max_pool2d)."""
    if ceil_mode or return_indices:
      return self._max_pool_options(1, kernel_size, stride, padding, dilation, ceil_mode, return_indices)
    return self._max_pool(1, kernel_size, stride, padding, dilation)

  def max_pool2d(self: Tensor, kernel_size: IntOrTuple = 2, stride: IntOrTuple | None = None,
                 padding: IntOrTuple = 0, dilation: IntOrTuple = 1, ceil_mode: bool = False,
                 return_indices: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Maximum over (dilated) kernel_size windows of the last two dims of (N, C, H, W) or (C, H, W), like
    torch.nn.functional.max_pool2d: stride defaults to kernel_size, padding counts as -inf (never the max);
    ceil_mode rounds the output size up; return_indices also gives each maximum's flat position in its plane
    (for max_unpool2d)."""
    if ceil_mode or return_indices:
      return self._max_pool_options(2, kernel_size, stride, padding, dilation, ceil_mode, return_indices)
    return self._max_pool(2, kernel_size, stride, padding, dilation)

  def max_pool3d(self: Tensor, kernel_size: IntOrTuple = 2, stride: IntOrTuple | None = None,
                 padding: IntOrTuple = 0, dilation: IntOrTuple = 1, ceil_mode: bool = False,
                 return_indices: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Maximum over (dilated) kernel_size windows of the last three dims, like torch.nn.functional.max_pool3d."""
    if ceil_mode or return_indices:
      return self._max_pool_options(3, kernel_size, stride, padding, dilation, ceil_mode, return_indices)
    return self._max_pool(3, kernel_size, stride, padding, dilation)

  def max_unpool1d(self: Tensor, indices: Tensor, kernel_size: IntOrTuple = 2, stride: IntOrTuple | None = None,
                   padding: IntOrTuple = 0, output_size: Sequence[int] | None = None,
                   dilation: IntOrTuple = 1) -> Tensor:
    """The inverse of max_pool1d(return_indices=True), like torch.nn.functional.max_unpool1d (see max_unpool2d)."""
    return self._max_unpool(1, indices, kernel_size, stride, padding, output_size, dilation)

  def max_unpool2d(self: Tensor, indices: Tensor, kernel_size: IntOrTuple = 2, stride: IntOrTuple | None = None,
                   padding: IntOrTuple = 0, output_size: Sequence[int] | None = None,
                   dilation: IntOrTuple = 1) -> Tensor:
    """The inverse of max_pool2d(return_indices=True), like torch.nn.functional.max_unpool2d: zeros of size
    (H - 1) * stride - 2 * padding + dilation * (kernel_size - 1) + 1 (or `output_size`) with each value at its
    index. kernel_size defaults to 2 and `dilation` is accepted by keyword, as in tinygrad."""
    return self._max_unpool(2, indices, kernel_size, stride, padding, output_size, dilation)

  def unfold(self: Tensor, dimension: int, size: int, step: int) -> Tensor:
    """Every `size`-long slice of `dimension`, `step` apart, as torch.Tensor.unfold: that dim becomes the count of
    slices and a new last dim of `size` holds each slice. A view (no copy). (torch.nn.functional.unfold, im2col,
    is nn.functional.unfold.)"""
    if self.ndim == 0:  # PyTorch treats a 0-d tensor as one element along dim 0
      if size != 1 or step <= 0:
        raise ShapeError(f"unfold of a 0-d tensor needs size 1 and step >= 1, got {size} and {step}")
      return self.reshape(1)
    axis = normalize_axis(dimension, self.ndim)
    if step <= 0: raise ValueError(f"unfold step must be positive, got {step}")
    if not 0 < size <= self.shape[axis]:
      raise ShapeError(f"unfold size {size} must be in [1, {self.shape[axis]}] (dim {axis} of shape {self.shape})")
    windows = pool_windows(self.movedim(axis, -1), (size,), (step,), (1,))  # (..., count, size)
    return windows.movedim(-2, axis)
