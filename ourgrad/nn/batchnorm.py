"""Batch normalization with batch statistics (training, or no running stats): one statistics pass forward, one back.

The channel axis is 1 and every other axis is reduced (`channel_reduce_axes`), so one pair of functions serves
(N, C), (N, C, L), (N, C, H, W) and (N, C, D, H, W) input.

Forward, `batch_statistics`: the per-channel mean and biased variance come from two sums over the same input,
sum(x - s) and sum((x - s)^2), with s one sample of the channel (x[0, c, 0, ...]). Neither sum needs the other, so
on a GPU the scheduler runs them as *sibling reduces* of one kernel (engine/multi_output.py) that reads x
once; the textbook mean-then-variance needs the mean before the second pass can start (two kernels, x read twice).
The shift keeps E[(x-s)^2] - E[x-s]^2 from cancelling catastrophically when |mean| >> std: s lies within the
channel's spread of values, so both terms are of the order of the variance. `stored_statistics` then writes mean and
invstd once, for every kernel that normalizes x to read (forward and backward must agree bit for bit: see there).

Backward, `BatchNormNormalize`: an autograd node for y = (x - mean) * invstd * weight + bias whose mean and invstd
are batch statistics of x. Its backward is PyTorch's batch_norm_backward formula, with xhat = (x - mean) * invstd,
g the output's gradient and N the count per channel:
    dbias = sum(g),  dweight = sum(g * xhat),  dx = weight * invstd / N * (N * g - sum(g) - xhat * sum(g * xhat))
The two sums read the same inputs and are independent: again one kernel of sibling reduces, and dx is elementwise
(it fuses into the kernel that consumes it). Autograd through mean and variance would instead need the variance
path's sum before the mean path's (d mean depends on d var): two reduce kernels in sequence.

The statistics, the normalization and the backward are built on lazy buffers directly (LazyBuffer or
MultiLazyBuffer methods, the lazy helpers of function.py), not through Tensor methods: none of them needs autograd (the
statistics are of a detached x, the normalization is this Function's own forward, and ourgrad has no double
backward), and a Tensor op's Function per operation was ~40% of the Functions of an eager CNN step. The graphs are
those the Tensor formulas built, operation for operation, so they fuse as before.
"""
from __future__ import annotations

import functools
import math

from ourgrad.dtype import dtypes, least_upper_dtype
from ourgrad.function import Function, _div, _mul, _sub
from ourgrad.lazy import LazyBuffer
from ourgrad.multi import MultiLazyBuffer
from ourgrad.ops import ADD, MAX, SUM
from ourgrad.tensor import Tensor
from ourgrad.lazy_moves import composed_view


Lazy = LazyBuffer | MultiLazyBuffer

__all__ = ["batch_statistics", "BatchNormNormalize", "channel_reduce_axes", "channel_sum", "channel_view",
           "per_channel", "stored_statistics"]


def channel_reduce_axes(ndim: int) -> tuple[int, ...]:
  """Every axis of an (N, C, ...) input of rank `ndim` but the channel axis 1."""
  return (0, *range(2, ndim))


@functools.lru_cache(maxsize=256)
def _channel_counts(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int, tuple[tuple[int, int], ...]]:
  """For an (N, C, ...) input's `shape`: the reduced axes, the count of values per channel, and the bounds of the
  first sample of each channel (the shift's shrink). Remembered: every batchnorm of every step asks."""
  axes = channel_reduce_axes(len(shape))
  return (axes, math.prod(shape[axis] for axis in axes),
          tuple((0, 1) if axis in axes else (0, size) for axis, size in enumerate(shape)))


def channel_view(t: Tensor, ndim: int) -> Tensor:
  """A per-channel (C,) tensor shaped (1, C, 1, ...) to broadcast against an (N, C, ...) input of rank `ndim`."""
  return t.reshape(1, t.shape[0], *([1] * (ndim - 2)))


def per_channel(values: Lazy, shape: tuple[int, ...]) -> Lazy:
  """A per-channel (C,) lazy value broadcast to an (N, C, ...) input's `shape` (one composed view)."""
  return composed_view(values, (("reshape", (1, shape[1], *([1] * (len(shape) - 2)))), ("expand", shape)))


def channel_sum(x: Lazy) -> Lazy:
  """The per-channel (C,) sum of an (N, C, ...) lazy value over every axis but 1."""
  return x.reduce(SUM, channel_reduce_axes(len(x.shape))).reshape((x.shape[1],))


def batch_statistics(x: Tensor) -> tuple[Tensor, Tensor]:
  """The per-channel mean and biased variance (each of shape (C,)) of an (N, C, ...) input, from the two shifted sums
  sum(x - s) and sum((x - s)^2) over all axes but 1 (one pass over x; see the module docstring). Half-precision
  input is summed in float32; the results have x's dtype. Not differentiable: pass a detached x (the backward of
  BatchNormNormalize accounts for the statistics)."""
  axes, count, first_sample = _channel_counts(x.shape)
  lazy = x.lazydata
  if isinstance(lazy, MultiLazyBuffer) and lazy.axis in axes:
    # sharded along a reduced axis, a view of one sample would cross shards: shift by the mean (a pass of its own)
    shift = x.detach().mean(axes, keepdim=True).lazydata
  else:   # a view of x, not a copy: the first sample of each channel, broadcast over that channel
    shift = lazy.shrink(first_sample)
  accumulate = dtypes.float32 if x.dtype.itemsize < 4 else x.dtype
  shifted = _sub(lazy.cast(accumulate), shift.cast(accumulate).expand(x.shape))
  shifted_sum = channel_sum(shifted)
  shifted_mean = _div(shifted_sum, shifted_sum.operand_like(count))
  # clamped at 0: rounding can leave E[d^2] a hair below E[d]^2 for a constant channel
  squares_sum = channel_sum(_mul(shifted, shifted))
  variance = _sub(_div(squares_sum, squares_sum.operand_like(count)), _mul(shifted_mean, shifted_mean))
  variance = variance.elementwise(MAX, variance.operand_like(0.0))
  mean = shift.reshape((x.shape[1],)).cast(accumulate).elementwise(ADD, shifted_mean)
  return Tensor(mean.cast(x.dtype)), Tensor(variance.cast(x.dtype))


def stored_statistics(mean: Tensor, invstd: Tensor) -> tuple[Tensor, Tensor]:
  """mean and invstd (each (C,)) computed once into buffers, for every kernel that normalizes x to read.

  Recomputed in each kernel instead, they would come out of different fused graphs (inline from the sums in one
  kernel, from a realized variance in another; FMA contraction differs between kernels), and a max-pool after the
  batchnorm compares its backward's recomputed inputs with the forward's maxima for equality: a window whose
  recomputed values all miss the maximum divides 0 by 0. On a GPU one kernel stores both, with the running
  variance, from the second stages of the two sums (engine/multi_output.py: sibling reduces and elementwise work on
  them)."""
  # (Contiguous's graph on the lazy buffers: the statistics are detached, no Function is needed)
  return Tensor(mean.lazydata.contiguous()), Tensor(invstd.lazydata.contiguous())


class BatchNormNormalize(Function):
  """y = (x - mean) * invstd * weight + bias per channel (weight and bias optional, given together or not at all),
  where mean and invstd are x's batch statistics, passed in *detached*: the backward accounts for their dependence
  on x analytically (module docstring), so no gradient flows to them. Gradients go to x, weight and bias."""

  def forward(self, x: LazyBuffer, mean: LazyBuffer, invstd: LazyBuffer, weight: LazyBuffer | None = None,
              bias: LazyBuffer | None = None) -> LazyBuffer:
    # one dtype for all (the Tensor ops' promotion; a no-op when they agree, as under autocast's float32 policy, which
    # is checked first: a promotion of five dtypes per batchnorm per step was most of this forward's own cost)
    dtype = x.dtype
    if not (mean.dtype is dtype and invstd.dtype is dtype and (weight is None or weight.dtype is dtype) and
            (bias is None or bias.dtype is dtype)):
      dtype = least_upper_dtype(*(operand.dtype for operand in (x, mean, invstd, weight, bias) if operand is not None))
      x, mean, invstd = x.cast(dtype), mean.cast(dtype), invstd.cast(dtype)
      weight, bias = (None if operand is None else operand.cast(dtype) for operand in (weight, bias))
    self.x, self.mean, self.invstd, self.weight = x, mean, invstd, weight
    # xhat, read again by the backward: the same lazy bases (it fuses into each kernel reading it, never stored)
    out = self.xhat = self._normalized()
    if weight is not None: out = _mul(out, per_channel(weight, x.shape))
    if bias is not None: out = out.elementwise(ADD, per_channel(bias, x.shape))
    return out

  def _normalized(self) -> Lazy:
    """xhat = (x - mean) * invstd, recomputed elementwise wherever it is read (it fuses, never stored)."""
    shape = self.x.shape
    return _mul(_sub(self.x, per_channel(self.mean, shape)), per_channel(self.invstd, shape))

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, ...]:
    grad, shape = grad_output, self.x.shape
    count = _channel_counts(shape)[1]
    xhat = self.xhat
    # the two independent sums over the same inputs: one kernel of sibling reduces on a GPU
    grad_sum, grad_xhat_sum = channel_sum(grad), channel_sum(_mul(grad, xhat))
    grad_x = None
    if self.needs_input_grad[0]:
      centered = _sub(_sub(_mul(grad, grad.operand_like(count)), per_channel(grad_sum, shape)),
                      _mul(xhat, per_channel(grad_xhat_sum, shape)))
      # invstd / count and the weight multiply the full-size tensor one after the other: their product would be a
      # (C,) value the scheduler stores in a kernel of its own (it joins the optimizer's (C,) updates, which
      # overwrite the weight it read, and is split out again: engine/multi_output.py `_split_cyclic_groups`)
      grad_x = _mul(centered, per_channel(_div(self.invstd, self.invstd.operand_like(count)), shape))
      if self.weight is not None: grad_x = _mul(grad_x, per_channel(self.weight, shape))
    grad_weight = grad_xhat_sum if len(self.needs_input_grad) > 3 and self.needs_input_grad[3] else None
    grad_bias = grad_sum if len(self.needs_input_grad) > 4 and self.needs_input_grad[4] else None
    return (grad_x, None, None, grad_weight, grad_bias)[:len(self.needs_input_grad)]
