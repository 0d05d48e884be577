"""The layers with parameters: Linear, convolutions, normalizations, Embedding, Dropout (all `Module`s).

The constructor creates the parameters, `forward(x)` applies the layer, and calling the layer calls forward.
Parameters and buffers are plain attributes with PyTorch's names (`weight`, `bias`, `running_mean`,
`running_var`, `num_batches_tracked`), so both `model.state_dict()` and the attribute walker
`get_state_dict(model)` (which also serves plain tinygrad-style classes) find them under the same keys as in a
PyTorch checkpoint.

Initialization follows PyTorch: Linear and convolution weights are kaiming_uniform(a=sqrt(5)), i.e. uniform in
+-1/sqrt(fan_in), and so are their biases; norm weights are ones and biases zeros; Embedding is normal(0, 1). The
random numbers come from Tensor.uniform / Tensor.normal, so Tensor.manual_seed makes them reproducible (the
values differ from PyTorch's, the distributions do not). Parameters have requires_grad=True; running statistics
have requires_grad=False.

Train/eval behaviour (BatchNorm, InstanceNorm with running stats, Dropout) follows the module's `training`
flag: what `model.train()` / `model.eval()` set, or, until one of them is called, the global `Tensor.training`
flag where it is set (`with Tensor.train(): ...`), else training mode, PyTorch's default (ourgrad/nn/module.py).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ourgrad.dtype import DType, dtypes
from ourgrad.helpers import make_tuple
from ourgrad.errors import DTypeError, ShapeError
from ourgrad.function import _mul
from ourgrad.lazy import LazyBuffer
from ourgrad.mixed_precision import CastPolicy, autocast_op
from ourgrad.multi import MultiLazyBuffer
from ourgrad.nn.batchnorm import BatchNormNormalize, batch_statistics, channel_view, stored_statistics
from ourgrad.nn.module import Module
from ourgrad.nn.optim import assign_lazy
from ourgrad.ops import ADD, RECIP, SQRT
from ourgrad.tensor import Tensor
from ourgrad.tensor_conv import conv_padding


IntOrTuple = int | Sequence[int]

__all__ = ["Linear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d",
           "BatchNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "LayerNorm", "GroupNorm", "InstanceNorm1d",
           "InstanceNorm2d", "RMSNorm", "Embedding", "Dropout"]


def _uniform_init(shape: tuple[int, ...], fan_in: int) -> Tensor:
  """uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)): PyTorch's kaiming_uniform(a=sqrt(5)) weight init, whose bound
  sqrt(6 / ((1 + 5) * fan_in)) simplifies to that, and also its bias init (0 bound for an empty fan_in)."""
  bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
  return Tensor.uniform(*shape, low=-bound, high=bound, requires_grad=True)


def _channel_affine(y: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
  """`y * weight + bias` per channel (either may be absent), for the normalizations over (N, C, ...) input."""
  if weight is not None: y = y * channel_view(weight, y.ndim)
  if bias is not None: y = y + channel_view(bias, y.ndim)
  return y


def _normalize_by_running_stats(x: Tensor, running_mean: Tensor, running_var: Tensor, eps: float) -> Tensor:
  """(x - running mean) / sqrt(running var + eps) per channel: evaluation mode of batch and instance norms."""
  inv_std = (running_var + eps).rsqrt()
  return (x - channel_view(running_mean, x.ndim)) * channel_view(inv_std, x.ndim)


def _init_channel_norm(norm: Module, num_features: int, eps: float, momentum: float | None, affine: bool,
                       track_running_stats: bool) -> None:
  """The settings and state batch and instance norms share, set in PyTorch's order (state_dict keys follow it):
  weight and bias when affine, running mean/var and the batch count when tracking running statistics."""
  norm.num_features, norm.eps, norm.momentum = num_features, eps, momentum
  norm.affine, norm.track_running_stats = affine, track_running_stats
  norm.weight = Tensor.ones(num_features, requires_grad=True) if affine else None
  norm.bias = Tensor.zeros(num_features, requires_grad=True) if affine else None
  if track_running_stats:
    norm.running_mean = Tensor.zeros(num_features, requires_grad=False)
    norm.running_var = Tensor.ones(num_features, requires_grad=False)
    norm.num_batches_tracked = Tensor.zeros(dtype=dtypes.int64, requires_grad=False)


def _moving_average(running: Tensor, batch: LazyBuffer | MultiLazyBuffer, factor: Tensor | float) -> None:
  """running = (1 - factor) * running + factor * batch, assigned (lazily); `factor` a number or a 0-d Tensor."""
  old = running.lazydata
  if isinstance(factor, Tensor):
    keep = (1.0 - factor).lazydata.cast(old.dtype).reshape((1,)).expand(old.shape)
    take = factor.lazydata.cast(old.dtype).reshape((1,)).expand(old.shape)
  else:
    keep, take = old.operand_like(1.0 - factor), old.operand_like(factor)
  assign_lazy(running, _mul(keep, old).elementwise(ADD, _mul(take, batch.cast(old.dtype))), old)


def _machine_epsilon(dtype: DType) -> float:
  """torch.finfo(dtype).eps: the gap between 1 and the next representable float."""
  if dtype == dtypes.bfloat16: return 2.0 ** -7
  return float(np.finfo(dtype.np).eps) if dtype.is_float else float(np.finfo(np.float32).eps)


# ---------------------------------------------------------------- linear and convolutions

class Linear(Module):
  """y = x @ weight.T + bias, weight (out_features, in_features), like torch.nn.Linear."""

  def __init__(self, in_features: int, out_features: int, bias: bool = True):
    self.in_features, self.out_features = in_features, out_features
    self.weight = _uniform_init((out_features, in_features), in_features)
    self.bias = _uniform_init((out_features,), in_features) if bias else None

  def extra_repr(self) -> str:
    return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

  def forward(self, x: Tensor) -> Tensor:
    if x.ndim == 0 or x.shape[-1] != self.in_features:
      raise ShapeError(f"Linear({self.in_features}, {self.out_features}) got input of shape {x.shape}; its last "
                       f"dim must be {self.in_features}")
    return x.linear(self.weight, self.bias)


class _ConvNd(Module):
  """Shared code of the convolutions over `dims` spatial dimensions: int-or-tuple arguments become tuples, and the
  weight (C_out, C_in/groups, *kernel), or (C_in, C_out/groups, *kernel) when `transposed`, is initialized (with
  the bias) from fan_in = weight_shape[1] * prod(kernel), PyTorch's rule for both kinds. `padding_mode` "zeros",
  "reflect", "replicate" or "circular" says what the padding holds (convolutions only, as in PyTorch)."""
  dims: int = 0
  transposed: bool = False

  def __init__(self, in_channels: int, out_channels: int, kernel_size: IntOrTuple, stride: IntOrTuple,
               padding: IntOrTuple | str, dilation: IntOrTuple, groups: int, bias: bool,
               padding_mode: str = "zeros"):
    if groups <= 0 or in_channels % groups or out_channels % groups:
      raise ValueError(f"groups={groups} must be positive and divide in_channels={in_channels} and "
                       f"out_channels={out_channels}")
    if padding_mode not in ("zeros", "reflect", "replicate", "circular"):
      raise ValueError(f"padding_mode must be 'zeros', 'reflect', 'replicate' or 'circular', got {padding_mode!r}")
    dims = self.dims
    self.in_channels, self.out_channels, self.groups = in_channels, out_channels, groups
    self.kernel_size, self.stride = make_tuple(kernel_size, dims), make_tuple(stride, dims)
    self.padding = padding if isinstance(padding, str) else make_tuple(padding, dims)
    self.dilation, self.padding_mode = make_tuple(dilation, dims), padding_mode
    channels = (in_channels, out_channels // groups) if self.transposed else (out_channels, in_channels // groups)
    weight_shape = (*channels, *self.kernel_size)
    fan_in = weight_shape[1] * math.prod(self.kernel_size)
    self.weight = _uniform_init(weight_shape, fan_in)
    self.bias = _uniform_init((out_channels,), fan_in) if bias else None

  def forward(self, x: Tensor) -> Tensor:
    padding = self.padding
    if self.padding_mode != "zeros":
      # pad with the mode first, then convolve without padding (PyTorch does the same)
      pairs = conv_padding(type(self).__name__, padding, self.kernel_size, self.stride, self.dilation)
      x = x.pad([None] * (x.ndim - self.dims) + pairs, mode=self.padding_mode)
      padding = 0
    return x._convolve(self.dims, self.weight, self.bias, self.stride, padding, self.dilation, self.groups)

  def extra_repr(self) -> str:
    return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}")


class Conv1d(_ConvNd):
  """1-D convolution like torch.nn.Conv1d: (N, C_in, L) -> (N, C_out, L_out), weight (C_out, C_in/groups, K)."""
  dims = 1

  def __init__(self, in_channels: int, out_channels: int, kernel_size: IntOrTuple, stride: IntOrTuple = 1,
               padding: IntOrTuple | str = 0, dilation: IntOrTuple = 1, groups: int = 1, bias: bool = True,
               padding_mode: str = "zeros"):
    super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode)


class Conv2d(_ConvNd):
  """2-D convolution like torch.nn.Conv2d: (N, C_in, H, W) -> (N, C_out, H_out, W_out), weight
  (C_out, C_in/groups, kH, kW). padding is an int, a pair, per side (left, right, top, bottom), "valid" or "same"."""
  dims = 2

  def __init__(self, in_channels: int, out_channels: int, kernel_size: IntOrTuple, stride: IntOrTuple = 1,
               padding: IntOrTuple | str = 0, dilation: IntOrTuple = 1, groups: int = 1, bias: bool = True,
               padding_mode: str = "zeros"):
    super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode)


class Conv3d(_ConvNd):
  """3-D convolution like torch.nn.Conv3d: (N, C_in, D, H, W) -> (N, C_out, D_out, H_out, W_out), weight
  (C_out, C_in/groups, kD, kH, kW)."""
  dims = 3

  def __init__(self, in_channels: int, out_channels: int, kernel_size: IntOrTuple, stride: IntOrTuple = 1,
               padding: IntOrTuple | str = 0, dilation: IntOrTuple = 1, groups: int = 1, bias: bool = True,
               padding_mode: str = "zeros"):
    super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode)


class _ConvTransposeNd(_ConvNd):
  """Shared code of the transposed convolutions (PyTorch's argument order: ..., output_padding, groups, bias,
  dilation), weight (C_in, C_out/groups, *kernel)."""
  transposed = True

  def __init__(self, in_channels: int, out_channels: int, kernel_size: IntOrTuple, stride: IntOrTuple = 1,
               padding: IntOrTuple = 0, output_padding: IntOrTuple = 0, groups: int = 1, bias: bool = True,
               dilation: IntOrTuple = 1):
    super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias)
    self.output_padding = make_tuple(output_padding, self.dims)

  def forward(self, x: Tensor) -> Tensor:
    return x._convolve_transposed(self.dims, self.weight, self.bias, self.stride, self.padding, self.output_padding,
                                  self.groups, self.dilation)


class ConvTranspose1d(_ConvTransposeNd):
  """Transposed 1-D convolution like torch.nn.ConvTranspose1d, weight (C_in, C_out/groups, K)."""
  dims = 1


class ConvTranspose2d(_ConvTransposeNd):
  """Transposed 2-D convolution like torch.nn.ConvTranspose2d (same argument order), weight
  (C_in, C_out/groups, kH, kW)."""
  dims = 2


class ConvTranspose3d(_ConvTransposeNd):
  """Transposed 3-D convolution like torch.nn.ConvTranspose3d, weight (C_in, C_out/groups, kD, kH, kW)."""
  dims = 3


# ---------------------------------------------------------------- normalization

class BatchNorm(Module):
  """Batch normalization over every axis but the channel axis 1, like torch.nn.BatchNorm1d/2d/3d (one class
  serves all ranks: (N, C), (N, C, L), (N, C, H, W), ...).

  While training (or when track_running_stats=False) it normalizes with the batch mean and the biased
  batch variance; in training it also moves the running stats towards the batch's (the running variance takes
  the unbiased variance, as in PyTorch) with `momentum`, or with a cumulative average (factor
  1/num_batches_tracked) when momentum is None. At evaluation it normalizes with the running stats.

  The running-stat updates are `assign`s, lazy like everything else: they are computed with the next realize
  that includes them (an optimizer step over the model's state, or reading them).

  With batch statistics, the mean and variance come from one pass over x and the backward from one pass over the
  output's gradient (nn/batchnorm.py: on a GPU each pass is one kernel of sibling reduces)."""

  def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
               track_running_stats: bool = True):
    _init_channel_norm(self, num_features, eps, momentum, affine, track_running_stats)

  def _update_running_stats(self, mean: Tensor, var: Tensor, count: int) -> None:
    # (the graph `num_batches_tracked + 1` builds, written without an Add Function, a tensor and assign's checks)
    tracked = self.num_batches_tracked.lazydata
    assign_lazy(self.num_batches_tracked, tracked.elementwise(ADD, tracked.operand_like(1)), tracked)
    factor: Tensor | float = self.momentum if self.momentum is not None else 1.0 / self.num_batches_tracked.float()
    # statistics are data, not part of the graph: built on lazy buffers, no autograd history is kept for them
    variance = var.lazydata
    _moving_average(self.running_mean, mean.lazydata, factor)
    _moving_average(self.running_var, _mul(variance, variance.operand_like(count / (count - 1))), factor)

  def extra_repr(self) -> str:
    return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, affine={self.affine}, "
            f"bias={self.affine}, track_running_stats={self.track_running_stats}")

  @autocast_op(CastPolicy.FLOAT32)  # batch statistics in float32 under autocast (cuDNN keeps them float32)
  def forward(self, x: Tensor) -> Tensor:
    if x.ndim < 2 or x.shape[1] != self.num_features:
      raise ShapeError(f"BatchNorm({self.num_features}) expects input (N, {self.num_features}, ...), got {x.shape}")
    if not self.training and self.track_running_stats:
      return _channel_affine(_normalize_by_running_stats(x, self.running_mean, self.running_var, self.eps),
                             self.weight, self.bias)
    count = x.numel() // self.num_features
    if self.training and count <= 1:
      raise ValueError(f"BatchNorm needs more than 1 value per channel when training, got input {x.shape}")
    # one statistics pass over x, and a backward of one pass too (nn/batchnorm.py says how and why)
    mean, var = batch_statistics(x.detach())
    if self.training and self.track_running_stats: self._update_running_stats(mean, var, count)
    variance = var.lazydata
    invstd = variance.elementwise(ADD, variance.operand_like(self.eps)).elementwise(SQRT).elementwise(RECIP)
    mean, invstd = stored_statistics(mean, Tensor(invstd))   # (var + eps).rsqrt(), without autograd
    affine = (self.weight, self.bias) if self.affine else ()
    return BatchNormNormalize.apply(x, mean, invstd, *affine)


# PyTorch's names (classes of their own, so reprs and type names match): the rank only differs in the input
# shape, which BatchNorm reads from x
class BatchNorm1d(BatchNorm):
  """Batch normalization of (N, C) or (N, C, L) input, like torch.nn.BatchNorm1d (see BatchNorm)."""


class BatchNorm2d(BatchNorm):
  """Batch normalization of (N, C, H, W) input, like torch.nn.BatchNorm2d (see BatchNorm)."""


class BatchNorm3d(BatchNorm):
  """Batch normalization of (N, C, D, H, W) input, like torch.nn.BatchNorm3d (see BatchNorm)."""


class LayerNorm(Module):
  """Layer normalization over the last len(normalized_shape) axes, with an elementwise affine weight and bias of
  shape normalized_shape, like torch.nn.LayerNorm."""

  def __init__(self, normalized_shape: IntOrTuple, eps: float = 1e-5, elementwise_affine: bool = True,
               bias: bool = True):
    self.normalized_shape = make_tuple(normalized_shape, 1)
    self.eps, self.elementwise_affine = eps, elementwise_affine
    self.weight = Tensor.ones(*self.normalized_shape, requires_grad=True) if elementwise_affine else None
    self.bias = Tensor.zeros(*self.normalized_shape, requires_grad=True) if elementwise_affine and bias else None

  def extra_repr(self) -> str:
    return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"bias={self.bias is not None}")

  def forward(self, x: Tensor) -> Tensor:
    dims = len(self.normalized_shape)
    if x.shape[x.ndim - dims:] != self.normalized_shape or x.ndim < dims:
      raise ShapeError(f"LayerNorm{self.normalized_shape} expects input ending in {self.normalized_shape}, "
                       f"got {x.shape}")
    return x.layernorm(tuple(range(x.ndim - dims, x.ndim)), self.eps, self.weight, self.bias)


class GroupNorm(Module):
  """Group normalization like torch.nn.GroupNorm: the channels of (N, C, ...) are split into num_groups groups,
  each normalized over its channels and all spatial positions; the affine weight and bias are per channel."""

  def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True):
    if num_groups <= 0 or num_channels % num_groups:
      raise ValueError(f"GroupNorm: num_groups={num_groups} must be positive and divide num_channels={num_channels}")
    self.num_groups, self.num_channels, self.eps, self.affine = num_groups, num_channels, eps, affine
    self.weight = Tensor.ones(num_channels, requires_grad=True) if affine else None
    self.bias = Tensor.zeros(num_channels, requires_grad=True) if affine else None

  def forward(self, x: Tensor) -> Tensor:
    if x.ndim < 2 or x.shape[1] != self.num_channels:
      raise ShapeError(f"GroupNorm({self.num_groups}, {self.num_channels}) expects input "
                       f"(N, {self.num_channels}, ...), got {x.shape}")
    grouped = x.reshape(x.shape[0], self.num_groups, -1)
    return _channel_affine(grouped.layernorm(-1, self.eps).reshape(x.shape), self.weight, self.bias)


class _InstanceNorm(Module):
  """Instance normalization: each (sample, channel) is normalized over its spatial axes, like
  torch.nn.InstanceNorm1d/2d (affine=False and track_running_stats=False by default, as there). Unbatched input
  (C, ...) is accepted too. With track_running_stats, training updates the running stats with the batch average
  of the per-instance statistics (unbiased variance) and evaluation normalizes with them."""
  spatial_dims: int = 0

  def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = False,
               track_running_stats: bool = False):
    _init_channel_norm(self, num_features, eps, momentum, affine, track_running_stats)

  def forward(self, x: Tensor) -> Tensor:
    name = type(self).__name__
    if x.ndim == self.spatial_dims + 1: return self(x.unsqueeze(0)).squeeze(0)
    if x.ndim != self.spatial_dims + 2 or x.shape[1] != self.num_features:
      raise ShapeError(f"{name}({self.num_features}) expects input (N, {self.num_features}, "
                       f"{self.spatial_dims} spatial dims), got {x.shape}")
    axes = tuple(range(2, x.ndim))
    if self.training or not self.track_running_stats:
      count = math.prod(x.shape[2:])
      if self.training and count <= 1:
        raise ValueError(f"{name} needs more than 1 spatial element when training, got input {x.shape}")
      y = x.layernorm(axes, self.eps)
      if self.training and self.track_running_stats:
        detached = x.detach()
        mean = detached.mean(axes)
        var = (detached - mean.reshape(*mean.shape, *([1] * len(axes)))).square().sum(axes) / (count - 1)
        # PyTorch's instance norm neither counts batches nor averages cumulatively: momentum None means 0.1
        factor = self.momentum if self.momentum is not None else 0.1
        self.running_mean.assign((1.0 - factor) * self.running_mean + factor * mean.mean(0))
        self.running_var.assign((1.0 - factor) * self.running_var + factor * var.mean(0))
    else:
      y = _normalize_by_running_stats(x, self.running_mean, self.running_var, self.eps)
    return _channel_affine(y, self.weight, self.bias)


class InstanceNorm1d(_InstanceNorm):
  """Instance normalization of (N, C, L) (or (C, L)) input, like torch.nn.InstanceNorm1d."""
  spatial_dims = 1


class InstanceNorm2d(_InstanceNorm):
  """Instance normalization of (N, C, H, W) (or (C, H, W)) input, like torch.nn.InstanceNorm2d."""
  spatial_dims = 2


class RMSNorm(Module):
  """Root-mean-square normalization over the last len(normalized_shape) axes with an elementwise weight:
  y = x / sqrt(mean(x^2) + eps) * weight, like torch.nn.RMSNorm (and tinygrad's RMSNorm(dim, eps)).

  eps defaults to 1e-6 (tinygrad's and LLaMA's value); eps=None takes PyTorch's default, the machine epsilon
  of the input dtype (torch.finfo(x.dtype).eps)."""

  def __init__(self, normalized_shape: IntOrTuple, eps: float | None = 1e-6, elementwise_affine: bool = True):
    self.normalized_shape = make_tuple(normalized_shape, 1)
    self.eps, self.elementwise_affine = eps, elementwise_affine
    self.weight = Tensor.ones(*self.normalized_shape, requires_grad=True) if elementwise_affine else None

  @autocast_op(CastPolicy.FLOAT32)  # torch's autocast lists rms_norm with the float32 ops
  def forward(self, x: Tensor) -> Tensor:
    dims = len(self.normalized_shape)
    if x.ndim < dims or x.shape[x.ndim - dims:] != self.normalized_shape:
      raise ShapeError(f"RMSNorm{self.normalized_shape} expects input ending in {self.normalized_shape}, "
                       f"got {x.shape}")
    eps = self.eps if self.eps is not None else _machine_epsilon(x.dtype)
    y = x * x.inverse_rms(tuple(range(x.ndim - dims, x.ndim)), eps)
    return y * self.weight if self.weight is not None else y


# ---------------------------------------------------------------- embedding and dropout

class Embedding(Module):
  """A lookup table like torch.nn.Embedding: integer indices of any shape (...) -> (..., embedding_dim) rows of
  weight (num_embeddings, embedding_dim), initialized normal(0, 1). The lookup is integer-tensor indexing, which
  reads only the picked rows; the gradient scatter-adds them back (repeated indices summed, in index order) in one
  indexed-accumulate kernel: the table written once and each gradient row added once, no pass over the table per
  index (docs/codegen.md, "Indexed accumulate")."""

  def __init__(self, num_embeddings: int, embedding_dim: int):
    self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
    self.weight = Tensor.normal(num_embeddings, embedding_dim, mean=0.0, std=1.0, requires_grad=True)

  def extra_repr(self) -> str: return f"{self.num_embeddings}, {self.embedding_dim}"

  def forward(self, idx: Tensor) -> Tensor:
    if idx.dtype.is_float or idx.dtype == dtypes.bool:
      raise DTypeError(f"Embedding indices must be integers, got {idx.dtype}")
    return self.weight[idx]


class Dropout(Module):
  """Zero each element with probability p and scale the rest by 1/(1-p) while training, like
  torch.nn.Dropout (identity at evaluation)."""

  def __init__(self, p: float = 0.5):
    if not 0.0 <= p <= 1.0: raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    self.p = p

  def extra_repr(self) -> str: return f"p={self.p}, inplace=False"

  def forward(self, x: Tensor) -> Tensor: return x.dropout(self.p, self.training)
