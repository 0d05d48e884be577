"""Parameter-free layers as Modules, with torch.nn's names: activations, Flatten, Identity, pooling, Upsample, losses.

They hold only their arguments and call the Tensor method of the same job in `forward`, so that
`nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(...))` reads as in
PyTorch. (In tinygrad style the methods are used directly: `x.relu()`, `x.max_pool2d(2)`.)
"""
from __future__ import annotations

from typing import Sequence

from ourgrad.nn.module import Module
from ourgrad.tensor import Tensor
from ourgrad.tensor_conv import fold_patches, unfold_patches

IntOrTuple = int | Sequence[int]

__all__ = ["ReLU", "ReLU6", "GELU", "SiLU", "Sigmoid", "Tanh", "LeakyReLU", "ELU", "Softplus", "Hardtanh",
           "Softmax", "LogSoftmax", "Flatten", "Identity", "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d",
           "AvgPool2d", "AvgPool3d", "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "Upsample",
           "CrossEntropyLoss", "NLLLoss", "MSELoss", "L1Loss", "BCELoss", "BCEWithLogitsLoss"]


class ReLU(Module):
  """max(x, 0), like torch.nn.ReLU."""

  def forward(self, x: Tensor) -> Tensor: return x.relu()


class ReLU6(Module):
  """min(max(x, 0), 6), like torch.nn.ReLU6."""

  def forward(self, x: Tensor) -> Tensor: return x.relu6()


class GELU(Module):
  """x * Phi(x), like torch.nn.GELU (approximate="none" or "tanh")."""

  def __init__(self, approximate: str = "none"): self.approximate = approximate

  def forward(self, x: Tensor) -> Tensor: return x.gelu(self.approximate)


class SiLU(Module):
  """x * sigmoid(x), like torch.nn.SiLU."""

  def forward(self, x: Tensor) -> Tensor: return x.silu()


class Sigmoid(Module):
  """1 / (1 + exp(-x)), like torch.nn.Sigmoid."""

  def forward(self, x: Tensor) -> Tensor: return x.sigmoid()


class Tanh(Module):
  """tanh(x), like torch.nn.Tanh."""

  def forward(self, x: Tensor) -> Tensor: return x.tanh()


class LeakyReLU(Module):
  """x if x > 0 else negative_slope * x, like torch.nn.LeakyReLU."""

  def __init__(self, negative_slope: float = 0.01): self.negative_slope = negative_slope

  def forward(self, x: Tensor) -> Tensor: return x.leaky_relu(self.negative_slope)


class ELU(Module):
  """x if x > 0 else alpha * (exp(x) - 1), like torch.nn.ELU."""

  def __init__(self, alpha: float = 1.0): self.alpha = alpha

  def forward(self, x: Tensor) -> Tensor: return x.elu(self.alpha)


class Softplus(Module):
  """log(1 + exp(beta * x)) / beta (linear above threshold), like torch.nn.Softplus."""

  def __init__(self, beta: float = 1.0, threshold: float = 20.0): self.beta, self.threshold = beta, threshold

  def forward(self, x: Tensor) -> Tensor: return x.softplus(self.beta, self.threshold)


class Hardtanh(Module):
  """x clipped to [min_val, max_val], like torch.nn.Hardtanh."""

  def __init__(self, min_val: float = -1.0, max_val: float = 1.0): self.min_val, self.max_val = min_val, max_val

  def forward(self, x: Tensor) -> Tensor: return x.hardtanh(self.min_val, self.max_val)


class Softmax(Module):
  """softmax over `dim`, like torch.nn.Softmax."""

  def __init__(self, dim: int = -1): self.dim = dim

  def forward(self, x: Tensor) -> Tensor: return x.softmax(self.dim)


class LogSoftmax(Module):
  """log_softmax over `dim`, like torch.nn.LogSoftmax."""

  def __init__(self, dim: int = -1): self.dim = dim

  def forward(self, x: Tensor) -> Tensor: return x.log_softmax(self.dim)


class Flatten(Module):
  """Merge dims start_dim..end_dim (default: all but the batch dim), like torch.nn.Flatten."""

  def __init__(self, start_dim: int = 1, end_dim: int = -1): self.start_dim, self.end_dim = start_dim, end_dim

  def forward(self, x: Tensor) -> Tensor: return x.flatten(self.start_dim, self.end_dim)


class Identity(Module):
  """Returns its input, like torch.nn.Identity (a placeholder in a Sequential)."""

  def forward(self, x: Tensor) -> Tensor: return x


class _MaxPoolNd(Module):
  dims = 0

  def __init__(self, kernel_size: IntOrTuple, stride: IntOrTuple | None = None, padding: IntOrTuple = 0,
               dilation: IntOrTuple = 1, return_indices: bool = False, ceil_mode: bool = False):
    self.kernel_size, self.stride, self.padding, self.dilation = kernel_size, stride, padding, dilation
    self.return_indices, self.ceil_mode = return_indices, ceil_mode

  def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
    if self.return_indices or self.ceil_mode:
      return x._max_pool_options(self.dims, self.kernel_size, self.stride, self.padding, self.dilation,
                                 self.ceil_mode, self.return_indices)
    return x._max_pool(self.dims, self.kernel_size, self.stride, self.padding, self.dilation)


class MaxPool1d(_MaxPoolNd):
  """Max pooling over the last dim, like torch.nn.MaxPool1d."""
  dims = 1


class MaxPool2d(_MaxPoolNd):
  """Max pooling over the last two dims, like torch.nn.MaxPool2d (return_indices gives (values, indices))."""
  dims = 2


class MaxPool3d(_MaxPoolNd):
  """Max pooling over the last three dims, like torch.nn.MaxPool3d."""
  dims = 3


class _AvgPoolNd(Module):
  dims = 0

  def __init__(self, kernel_size: IntOrTuple, stride: IntOrTuple | None = None, padding: IntOrTuple = 0,
               ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: int | None = None):
    self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
    self.ceil_mode, self.count_include_pad, self.divisor_override = ceil_mode, count_include_pad, divisor_override

  def forward(self, x: Tensor) -> Tensor:
    if self.ceil_mode or not self.count_include_pad or self.divisor_override is not None:
      return x._avg_pool_options(self.dims, self.kernel_size, self.stride, self.padding, self.ceil_mode,
                                 self.count_include_pad, self.divisor_override)
    return x._avg_pool(self.dims, self.kernel_size, self.stride, self.padding)


class AvgPool1d(_AvgPoolNd):
  """Average pooling over the last dim, like torch.nn.AvgPool1d."""
  dims = 1


class AvgPool2d(_AvgPoolNd):
  """Average pooling over the last two dims, like torch.nn.AvgPool2d."""
  dims = 2


class AvgPool3d(_AvgPoolNd):
  """Average pooling over the last three dims, like torch.nn.AvgPool3d."""
  dims = 3


__all__ += ["MaxUnpool1d", "MaxUnpool2d", "Unfold", "Fold"]


class _MaxUnpoolNd(Module):
  dims = 0

  def __init__(self, kernel_size: IntOrTuple, stride: IntOrTuple | None = None, padding: IntOrTuple = 0):
    self.kernel_size, self.stride, self.padding = kernel_size, stride, padding

  def forward(self, x: Tensor, indices: Tensor, output_size: Sequence[int] | None = None) -> Tensor:
    return x._max_unpool(self.dims, indices, self.kernel_size, self.stride, self.padding, output_size)


class MaxUnpool1d(_MaxUnpoolNd):
  """The inverse of MaxPool1d(return_indices=True), like torch.nn.MaxUnpool1d."""
  dims = 1


class MaxUnpool2d(_MaxUnpoolNd):
  """The inverse of MaxPool2d(return_indices=True), like torch.nn.MaxUnpool2d."""
  dims = 2


class Unfold(Module):
  """im2col, like torch.nn.Unfold: (N, C, H, W) -> (N, C * kH * kW, L) (nn.functional.unfold)."""

  def __init__(self, kernel_size: IntOrTuple, dilation: IntOrTuple = 1, padding: IntOrTuple = 0,
               stride: IntOrTuple = 1):
    self.kernel_size, self.dilation, self.padding, self.stride = kernel_size, dilation, padding, stride

  def forward(self, x: Tensor) -> Tensor:
    return unfold_patches(x, self.kernel_size, self.dilation, self.padding, self.stride)


class Fold(Module):
  """col2im, like torch.nn.Fold: (N, C * kH * kW, L) -> (N, C, *output_size) (nn.functional.fold)."""

  def __init__(self, output_size: IntOrTuple, kernel_size: IntOrTuple, dilation: IntOrTuple = 1,
               padding: IntOrTuple = 0, stride: IntOrTuple = 1):
    self.output_size, self.kernel_size = output_size, kernel_size
    self.dilation, self.padding, self.stride = dilation, padding, stride

  def forward(self, x: Tensor) -> Tensor:
    return fold_patches(x, self.output_size, self.kernel_size, self.dilation, self.padding, self.stride)


class Upsample(Module):
  """Resize the spatial dims with `Tensor.interpolate`, like torch.nn.Upsample."""

  def __init__(self, size: IntOrTuple | None = None, scale_factor: float | Sequence[float] | None = None,
               mode: str = "nearest", align_corners: bool | None = None):
    self.size, self.scale_factor, self.mode, self.align_corners = size, scale_factor, mode, align_corners

  def forward(self, x: Tensor) -> Tensor:
    return x.interpolate(self.size, self.scale_factor, self.mode, self.align_corners)


class _AdaptiveAvgPoolNd(Module):
  dims = 0

  def __init__(self, output_size: IntOrTuple): self.output_size = output_size

  def forward(self, x: Tensor) -> Tensor: return x._adaptive_avg_pool(self.dims, self.output_size)


class AdaptiveAvgPool1d(_AdaptiveAvgPoolNd):
  """Average pooling of the last dim to `output_size` bins, like torch.nn.AdaptiveAvgPool1d."""
  dims = 1


class AdaptiveAvgPool2d(_AdaptiveAvgPoolNd):
  """Average pooling of the last two dims to `output_size` bins, like torch.nn.AdaptiveAvgPool2d."""
  dims = 2


class AdaptiveAvgPool3d(_AdaptiveAvgPoolNd):
  """Average pooling of the last three dims to `output_size` bins, like torch.nn.AdaptiveAvgPool3d."""
  dims = 3


# ---------------------------------------------------------------- losses as modules: criterion(input, target)

class CrossEntropyLoss(Module):
  """Tensor.cross_entropy as a module, like torch.nn.CrossEntropyLoss; the class `weight` is a buffer (in the
  state dict, as in PyTorch). Give it by keyword: the positional order is ourgrad's older one."""

  def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
               weight: Tensor | None = None):
    self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing
    self.register_buffer("weight", weight)

  def forward(self, logits: Tensor, target: Tensor) -> Tensor:
    if self.weight is None: return logits.cross_entropy(target, self.reduction, self.label_smoothing, self.ignore_index)
    return logits.cross_entropy(target, self.reduction, self.label_smoothing, self.ignore_index, weight=self.weight)


class NLLLoss(Module):
  """Tensor.nll_loss as a module, like torch.nn.NLLLoss; the class `weight` is a buffer (give it by keyword)."""

  def __init__(self, ignore_index: int = -100, reduction: str = "mean", weight: Tensor | None = None):
    self.ignore_index, self.reduction = ignore_index, reduction
    self.register_buffer("weight", weight)

  def forward(self, log_probs: Tensor, target: Tensor) -> Tensor:
    if self.weight is None: return log_probs.nll_loss(target, self.reduction, self.ignore_index)
    return log_probs.nll_loss(target, self.reduction, self.ignore_index, weight=self.weight)


class MSELoss(Module):
  """Tensor.mse_loss as a module, like torch.nn.MSELoss."""

  def __init__(self, reduction: str = "mean"): self.reduction = reduction

  def forward(self, pred: Tensor, target: Tensor) -> Tensor: return pred.mse_loss(target, self.reduction)


class L1Loss(Module):
  """|pred - target| with a reduction ("mean", "sum", "none"), like torch.nn.L1Loss."""

  def __init__(self, reduction: str = "mean"):
    if reduction not in ("none", "mean", "sum"): raise ValueError(f"reduction must be none/mean/sum, got {reduction!r}")
    self.reduction = reduction

  def forward(self, pred: Tensor, target: Tensor) -> Tensor:
    loss = (pred - target).abs()
    return loss if self.reduction == "none" else loss.mean() if self.reduction == "mean" else loss.sum()


class BCELoss(Module):
  """Tensor.binary_cross_entropy as a module, like torch.nn.BCELoss (no weights)."""

  def __init__(self, reduction: str = "mean"): self.reduction = reduction

  def forward(self, probs: Tensor, target: Tensor) -> Tensor: return probs.binary_cross_entropy(target, self.reduction)


class BCEWithLogitsLoss(Module):
  """Tensor.binary_cross_entropy_with_logits as a module, like torch.nn.BCEWithLogitsLoss; pos_weight is kept as
  a buffer."""

  def __init__(self, reduction: str = "mean", pos_weight: Tensor | None = None):
    self.reduction = reduction
    self.register_buffer("pos_weight", pos_weight)

  def forward(self, logits: Tensor, target: Tensor) -> Tensor:
    return logits.binary_cross_entropy_with_logits(target, self.reduction, self.pos_weight)
