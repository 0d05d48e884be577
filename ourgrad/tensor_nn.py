"""Neural-network operations as Tensor methods (NNMixin), for PyTorch's `x.conv2d(w)`-style calls.

Each method is one line that calls the function doing the work: ourgrad/nn/functional.py (conv2d, pooling,
layernorm, dropout), ourgrad/nn/losses.py (cross entropy and the other losses) and ourgrad/nn/attention.py
(scaled dot-product attention). Those modules import Tensor, so they are imported when a method is called.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from ourgrad.tensor import Tensor


class NNMixin:
  """Tensor methods that hand over to ourgrad.nn: conv2d, pooling, layernorm, dropout, losses, attention."""
  __slots__ = ()

  def conv2d(self, weight: Tensor, bias: Tensor | None = None, stride: int | tuple[int, int] = 1,
             padding: int | tuple[int, int] = 0, dilation: int | tuple[int, int] = 1, groups: int = 1) -> Tensor:
    """2-D convolution, torch.nn.functional.conv2d semantics (input NCHW, weight (out, in/groups, kh, kw))."""
    from ourgrad.nn import functional
    return functional.conv2d(self, weight, bias, stride, padding, dilation, groups)

  def avg_pool2d(self, kernel_size: int | tuple[int, int] = 2, stride: int | tuple[int, int] | None = None,
                 padding: int | tuple[int, int] = 0) -> Tensor:
    """2-D average pooling of an (N, C, H, W) or (C, H, W) tensor, torch.nn.functional.avg_pool2d with its defaults
    (count_include_pad=True, ceil_mode=False)."""
    from ourgrad.nn import functional
    return functional.avg_pool2d(self, kernel_size, stride, padding)

  def max_pool2d(self, kernel_size: int | tuple[int, int] = 2, stride: int | tuple[int, int] | None = None,
                 padding: int | tuple[int, int] = 0, dilation: int | tuple[int, int] = 1) -> Tensor:
    """2-D max pooling of an (N, C, H, W) or (C, H, W) tensor, torch.nn.functional.max_pool2d without return_indices or
    ceil_mode."""
    from ourgrad.nn import functional
    return functional.max_pool2d(self, kernel_size, stride, padding, dilation)

  def layernorm(self, axis: int | tuple[int, ...] = -1, eps: float = 1e-5) -> Tensor:
    """Normalize over `axis` to zero mean and unit variance (no affine part; see nn.LayerNorm)."""
    from ourgrad.nn import functional
    return functional.layernorm(self, axis, eps)

  def dropout(self, p: float = 0.5) -> Tensor:
    """Zero each element with probability p and scale the rest by 1/(1-p), only while Tensor.training."""
    from ourgrad.nn import functional
    return functional.dropout(self, p)

  def cross_entropy(self, target: Tensor, reduction: str = "mean", label_smoothing: float = 0.0,
                    ignore_index: int = -100) -> Tensor:
    """Cross entropy of these logits (classes on axis 1, or 0 if 1-D) against class indices or probabilities,
    like torch.nn.functional.cross_entropy (see ourgrad/nn/losses.py)."""
    from ourgrad.nn import losses
    return losses.cross_entropy(self, target, reduction, label_smoothing, ignore_index)

  def sparse_categorical_crossentropy(self, target: Tensor, ignore_index: int = -1, label_smoothing: float = 0.0,
                                      reduction: str = "mean") -> Tensor:
    """tinygrad's cross entropy of these logits (classes on the LAST axis) against integer class indices."""
    from ourgrad.nn import losses
    return losses.sparse_categorical_crossentropy(self, target, ignore_index, label_smoothing, reduction)

  def nll_loss(self, target: Tensor, reduction: str = "mean", ignore_index: int = -100) -> Tensor:
    """Negative log-likelihood of these log-probabilities at the class indices `target`."""
    from ourgrad.nn import losses
    return losses.nll_loss(self, target, reduction, ignore_index)

  def binary_cross_entropy(self, target: Tensor, reduction: str = "mean") -> Tensor:
    """Binary cross entropy of these probabilities against `target`."""
    from ourgrad.nn import losses
    return losses.binary_cross_entropy(self, target, reduction)

  def binary_cross_entropy_with_logits(self, target: Tensor, reduction: str = "mean",
                                       pos_weight: Tensor | None = None) -> Tensor:
    """Binary cross entropy of sigmoid(self) against `target`, computed stably from the logits."""
    from ourgrad.nn import losses
    return losses.binary_cross_entropy_with_logits(self, target, reduction, pos_weight)

  def mse_loss(self, target: Tensor, reduction: str = "mean") -> Tensor:
    """Mean (or summed, or per-element) squared error against `target`."""
    from ourgrad.nn import losses
    return losses.mse_loss(self, target, reduction)

  def scaled_dot_product_attention(self, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                   enable_gqa: bool = False) -> Tensor:
    """Attention with this tensor as the query, like torch.nn.functional.scaled_dot_product_attention."""
    from ourgrad.nn import attention
    return attention.scaled_dot_product_attention(self, key, value, attn_mask, dropout_p, is_causal, scale,
                                                  enable_gqa)
