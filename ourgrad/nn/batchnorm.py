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

The backward graph is a plain LazyBuffer graph (built with Tensor ops on tensors without gradients), so it stays lazy
and fuses; it is not itself differentiable (ourgrad has no double backward).
"""
from __future__ import annotations

import math

from ourgrad.dtype import dtypes
from ourgrad.function import Function
from ourgrad.lazy import LazyBuffer
from ourgrad.multi import MultiLazyBuffer
from ourgrad.tensor import Tensor

__all__ = ["batch_statistics", "BatchNormNormalize", "channel_reduce_axes", "channel_view", "stored_statistics"]


def channel_reduce_axes(ndim: int) -> tuple[int, ...]:
  """Every axis of an (N, C, ...) input of rank `ndim` but the channel axis 1."""
  return (0, *range(2, ndim))


def channel_view(t: Tensor, ndim: int) -> Tensor:
  """A per-channel (C,) tensor shaped (1, C, 1, ...) to broadcast against an (N, C, ...) input of rank `ndim`."""
  return t.reshape(1, t.shape[0], *([1] * (ndim - 2)))


def batch_statistics(x: Tensor) -> tuple[Tensor, Tensor]:
  """The per-channel mean and biased variance (each of shape (C,)) of an (N, C, ...) input, from the two shifted sums
  sum(x - s) and sum((x - s)^2) over all axes but 1 (one pass over x; see the module docstring). Half-precision
  input is summed in float32; the results have x's dtype. Differentiable (the shift's gradient cancels)."""
  axes = channel_reduce_axes(x.ndim)
  count = math.prod(x.shape[axis] for axis in axes)
  if isinstance(x.lazydata, MultiLazyBuffer) and x.lazydata.axis in axes:
    # sharded along a reduced axis, a view of one sample would cross shards: shift by the mean (a pass of its own)
    shift = x.mean(axes, keepdim=True)
  else:   # a view of x, not a copy: the first sample of each channel, broadcast over that channel
    shift = x.shrink(tuple((0, 1) if axis in axes else None for axis in range(x.ndim)))
  accumulate = dtypes.float32 if x.dtype.itemsize < 4 else x.dtype
  shifted = x.cast(accumulate) - shift.cast(accumulate)
  shifted_mean = shifted.sum(axes) / count
  # clamped at 0: rounding can leave E[d^2] a hair below E[d]^2 for a constant channel
  variance = (shifted.square().sum(axes) / count - shifted_mean.square()).maximum(0.0)
  mean = shift.reshape(x.shape[1]).cast(accumulate) + shifted_mean
  return mean.cast(x.dtype), variance.cast(x.dtype)


def stored_statistics(mean: Tensor, invstd: Tensor) -> tuple[Tensor, Tensor]:
  """mean and invstd (each (C,)) computed once into buffers, for every kernel that normalizes x to read.

  Recomputed in each kernel instead, they would come out of different fused graphs (inline from the sums in one
  kernel, from a realized variance in another; FMA contraction differs between kernels), and a max-pool after the
  batchnorm compares its backward's recomputed inputs with the forward's maxima for equality: a window whose
  recomputed values all miss the maximum divides 0 by 0. On a GPU one kernel stores both, with the running
  variance, from the second stages of the two sums (engine/multi_output.py: sibling reduces and elementwise work on
  them)."""
  return mean.contiguous(), invstd.contiguous()


class BatchNormNormalize(Function):
  """y = (x - mean) * invstd * weight + bias per channel (weight and bias optional, given together or not at all),
  where mean and invstd are x's batch statistics, passed in *detached*: the backward accounts for their dependence
  on x analytically (module docstring), so no gradient flows to them. Gradients go to x, weight and bias."""

  def forward(self, x: LazyBuffer, mean: LazyBuffer, invstd: LazyBuffer, weight: LazyBuffer | None = None,
              bias: LazyBuffer | None = None) -> LazyBuffer:
    self.x, self.mean, self.invstd, self.weight = Tensor(x), Tensor(mean), Tensor(invstd), weight
    ndim = len(x.shape)
    out = self._normalized()
    if weight is not None: out = out * channel_view(Tensor(weight), ndim)
    if bias is not None: out = out + channel_view(Tensor(bias), ndim)
    return out.lazydata

  def _normalized(self) -> Tensor:
    """xhat = (x - mean) * invstd, recomputed elementwise wherever it is read (it fuses, never stored)."""
    ndim = self.x.ndim
    return (self.x - channel_view(self.mean, ndim)) * channel_view(self.invstd, ndim)

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, ...]:
    grad, ndim = Tensor(grad_output), self.x.ndim
    axes = channel_reduce_axes(ndim)
    count = math.prod(self.x.shape[axis] for axis in axes)
    xhat = self._normalized()
    # the two independent sums over the same inputs: one kernel of sibling reduces on a GPU
    grad_sum, grad_xhat_sum = grad.sum(axes), (grad * xhat).sum(axes)
    grad_x = None
    if self.needs_input_grad[0]:
      centered = grad * count - channel_view(grad_sum, ndim) - xhat * channel_view(grad_xhat_sum, ndim)
      # invstd / count and the weight multiply the full-size tensor one after the other: their product would be a
      # (C,) value the scheduler stores in a kernel of its own (it joins the optimizer's (C,) updates, which
      # overwrite the weight it read, and is split out again: engine/multi_output.py `_split_cyclic_groups`)
      grad_x_tensor = centered * channel_view(self.invstd / count, ndim)
      if self.weight is not None: grad_x_tensor = grad_x_tensor * channel_view(Tensor(self.weight), ndim)
      grad_x = grad_x_tensor.lazydata
    grad_weight = grad_xhat_sum.lazydata if len(self.needs_input_grad) > 3 and self.needs_input_grad[3] else None
    grad_bias = grad_sum.lazydata if len(self.needs_input_grad) > 4 and self.needs_input_grad[4] else None
    return (grad_x, None, None, grad_weight, grad_bias)[:len(self.needs_input_grad)]
