"""torch.nn.functional's names for ourgrad's neural-network operations: `F.conv2d(x, w)`, `F.relu(x)`, ...

The implementations live in the tensor layer, as Tensor methods (ourgrad/tensor_conv.py: convolutions and
pooling; ourgrad/tensor_resize.py: interpolate; ourgrad/tensor_nn.py: normalization, dropout, losses, attention;
ourgrad/tensor_math.py and tensor_reduce.py: activations, softmax, linear). Each name here is that method taken
from the class, so `F.conv2d(x, w, b)` is `x.conv2d(w, b)`, with the same arguments, in PyTorch's order.
"""
from __future__ import annotations

from typing import Sequence

from ourgrad.tensor import Tensor
from ourgrad.tensor_conv import fold_patches, unfold_patches

__all__ = ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "avg_pool1d",
           "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d", "interpolate", "adaptive_avg_pool1d",
           "adaptive_avg_pool2d", "adaptive_avg_pool3d", "embedding", "layernorm",
           "dropout", "cross_entropy", "nll_loss", "mse_loss", "binary_cross_entropy",
           "binary_cross_entropy_with_logits", "scaled_dot_product_attention", "relu", "relu6", "gelu", "silu", "mish",
           "elu", "celu", "selu", "sigmoid", "tanh", "softplus", "leaky_relu", "hardtanh", "hardsigmoid", "hardswish",
           "softmax", "log_softmax", "linear", "pad", "layer_norm", "normalize"]

# convolutions and pooling
conv1d, conv2d, conv3d = Tensor.conv1d, Tensor.conv2d, Tensor.conv3d
conv_transpose1d, conv_transpose2d, conv_transpose3d = \
  Tensor.conv_transpose1d, Tensor.conv_transpose2d, Tensor.conv_transpose3d
avg_pool1d, avg_pool2d, avg_pool3d = Tensor.avg_pool1d, Tensor.avg_pool2d, Tensor.avg_pool3d
max_pool1d, max_pool2d, max_pool3d = Tensor.max_pool1d, Tensor.max_pool2d, Tensor.max_pool3d
max_unpool1d, max_unpool2d = Tensor.max_unpool1d, Tensor.max_unpool2d
__all__ += ["max_unpool1d", "max_unpool2d", "unfold", "fold"]

# resampling, padding, normalization, dropout
interpolate = Tensor.interpolate
adaptive_avg_pool1d, adaptive_avg_pool2d, adaptive_avg_pool3d = \
  Tensor.adaptive_avg_pool1d, Tensor.adaptive_avg_pool2d, Tensor.adaptive_avg_pool3d
layernorm = Tensor.layernorm


def dropout(input: Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> Tensor:  # noqa: A002
  """torch.nn.functional.dropout: drops while `training`, which defaults to True as in PyTorch (not to the global
  Tensor.training, as Tensor.dropout does); pass `training=self.training` inside a module."""
  return input.dropout(p, training)



# losses and attention
cross_entropy, nll_loss, mse_loss = Tensor.cross_entropy, Tensor.nll_loss, Tensor.mse_loss
binary_cross_entropy = Tensor.binary_cross_entropy
binary_cross_entropy_with_logits = Tensor.binary_cross_entropy_with_logits
scaled_dot_product_attention = Tensor.scaled_dot_product_attention

# activations and friends, torch.nn.functional spellings of Tensor methods
relu, relu6, gelu, silu, mish, elu, celu, selu = (Tensor.relu, Tensor.relu6, Tensor.gelu, Tensor.silu, Tensor.mish,
                                                 Tensor.elu, Tensor.celu, Tensor.selu)
sigmoid, tanh, softplus, leaky_relu, hardtanh = Tensor.sigmoid, Tensor.tanh, Tensor.softplus, Tensor.leaky_relu, \
  Tensor.hardtanh
hardsigmoid, hardswish = Tensor.hardsigmoid, Tensor.hardswish
softmax, log_softmax, linear = Tensor.softmax, Tensor.log_softmax, Tensor.linear


def pad(x: Tensor, pad: Sequence[int], mode: str = "constant", value: float | None = None) -> Tensor:
  """torch.nn.functional.pad: `pad` is (left, right, top, bottom, ...) from the last dim; mode "constant" (with
  `value`, default 0), "reflect", "replicate" or "circular"; negative amounts crop."""
  return x.pad(pad, 0.0 if value is None else value, mode=mode)


def layer_norm(x: Tensor, normalized_shape: int | Sequence[int], weight: Tensor | None = None,
               bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
  """torch.nn.functional.layer_norm: normalize over the last len(normalized_shape) dims, then scale and shift."""
  dims = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
  return x.layernorm(tuple(range(x.ndim - dims, x.ndim)), eps, weight, bias)


def normalize(x: Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12) -> Tensor:
  """torch.nn.functional.normalize: x / max(||x||_p over dim, eps)."""
  norm = x.abs().pow(p).sum(dim, keepdim=True).pow(1.0 / p) if p != 2.0 else x.square().sum(dim, keepdim=True).sqrt()
  return x / norm.maximum(eps)


def embedding(indices: Tensor, weight: Tensor) -> Tensor:
  """torch.nn.functional.embedding: the rows of `weight` at integer `indices` (any shape) -> (..., dim)."""
  return weight[indices]


def unfold(x: Tensor, kernel_size: int | Sequence[int], dilation: int | Sequence[int] = 1,
           padding: int | Sequence[int] = 0, stride: int | Sequence[int] = 1) -> Tensor:
  """torch.nn.functional.unfold (im2col): the sliding patches of (N, C, H, W) as columns (N, C * kH * kW, L).
  (Tensor.unfold(dim, size, step) is torch.Tensor.unfold, a different operation.)"""
  return unfold_patches(x, kernel_size, dilation, padding, stride)


def fold(x: Tensor, output_size: int | Sequence[int], kernel_size: int | Sequence[int],
         dilation: int | Sequence[int] = 1, padding: int | Sequence[int] = 0,
         stride: int | Sequence[int] = 1) -> Tensor:
  """torch.nn.functional.fold (col2im): columns (N, C * kH * kW, L) summed back into (N, C, *output_size), the
  adjoint of unfold (overlapping patches add up)."""
  return fold_patches(x, output_size, kernel_size, dilation, padding, stride)
