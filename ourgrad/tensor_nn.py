"""Neural-network operations as Tensor methods (NNMixin): normalization, dropout, losses and attention.

Every method is composed from Tensor ops, so it stays lazy, fuses with the layer before it and gets its gradient
from the primitives; layernorm builds that same graph as one autograd node (LayerNormalize: a dozen Functions fewer
per LayerNorm, forward and backward, in an eager step). NNMixin also brings in the convolutions and pooling
(ourgrad/tensor_conv.py, ConvMixin), resampling and padding modes (ourgrad/tensor_resize.py, ResizeMixin) and einsum
(ourgrad/tensor_einsum.py, EinsumMixin), so `class Tensor(..., NNMixin)` gets all of them.

Losses: class-index targets never use a gather: `target.unsqueeze(-1) == arange(C)` makes a one-hot mask that
`where` + `sum` turn into one fused reduce, and log-probabilities come from the max-shifted (numerically stable)
`log_softmax`. Layout conventions follow PyTorch: `cross_entropy` and `nll_loss` take the class dimension at
axis 1 for batched input ((N, C) or (N, C, d1, ...)) and at axis 0 for a single unbatched sample (C,);
`sparse_categorical_crossentropy` (tinygrad's name) takes it last.

Attention: softmax(q @ k^T * scale + mask) @ v, a matmul reduce, a fused masked softmax and a second matmul; where the
device runs it, one fused (flash) kernel instead (tensor_attention.py decides, codegen/attention.py).

This module sits below ourgrad/nn (whose functional.py, losses.py and attention.py re-export these methods) and
never imports it, nor the Tensor class: new tensors come from `type(self)`'s constructors.
"""
from __future__ import annotations

import math
from numbers import Integral
from typing import TYPE_CHECKING, Sequence

from ourgrad import function as F
from ourgrad import function_movement as FM
from ourgrad.dtype import dtypes, least_upper_dtype
from ourgrad.errors import DTypeError, ShapeError
from ourgrad.helpers import prod
from ourgrad.tensor_conv import ConvMixin
from ourgrad.tensor_einsum import EinsumMixin
from ourgrad.tensor_resize import ResizeMixin
from ourgrad.tensor_attention import (composite_attention, composite_attention_refusal, explain_attention,
                                     fused_attention, fused_attention_refusal)
from ourgrad.mixed_precision import CastPolicy, autocast_op
from ourgrad.ops import ADD, AND, CMPLT, CMPNE, NEG, RECIP, SQRT, SUM


if TYPE_CHECKING:
  from ourgrad.lazy import LazyBuffer
  from ourgrad.multi import MultiLazyBuffer
  from ourgrad.tensor import Tensor

REDUCTIONS = ("none", "mean", "sum")


def _reduce(loss: Tensor, reduction: str) -> Tensor:
  """Apply a torch-style `reduction` ("none", "mean" or "sum") to per-element losses."""
  if reduction == "none": return loss
  if reduction == "mean": return loss.mean()
  if reduction == "sum": return loss.sum()
  raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _check_reduction(reduction: str) -> None:
  if reduction not in REDUCTIONS: raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _class_last(x: Tensor) -> Tensor:
  """Move the PyTorch class axis (1 for batched input, 0 for an unbatched (C,) sample) to the end."""
  if x.ndim == 0: raise ShapeError("a loss over classes needs input with at least 1 dimension (the classes), got ()")
  if x.ndim <= 2: return x
  return x.permute(0, *range(2, x.ndim), 1)


def _check_index_target(scores: Tensor, target: Tensor, what: str) -> None:
  """`scores` has the classes last; the index target must have its shape without the class axis."""
  if target.dtype.is_float or target.dtype == dtypes.bool:
    raise DTypeError(f"{what}: class-index targets must be integers, got {target.dtype}")
  if target.shape != scores.shape[:-1]:
    raise ShapeError(f"{what}: target of shape {target.shape} does not match input of shape {scores.shape} "
                     f"(classes last); the target needs the input's shape without the class dimension")


def _index_nll(log_probs: Tensor, target: Tensor, reduction: str, ignore_index: int,
               label_smoothing: float, normalizer: Tensor | None = None) -> Tensor:
  """Negative log-likelihood of class indices, classes on the last axis of `log_probs`.

  With label smoothing e the per-sample loss is (1-e) * -log p[target] + e * mean_c(-log p[c]), as in PyTorch.
  Samples whose target is `ignore_index` contribute 0, and "mean" divides by the number of the other samples
  (0/0 = nan when all are ignored, as in PyTorch). With `normalizer` (each row's logsumexp, keepdim), `log_probs`
  holds the logits and log p = logits - normalizer: the picked logit and the logits' mean are reduces of the logits
  alone, independent of the normalizer's max and sum, so a row kernel computes all of them in one pass over the row
  (codegen/row_linearizer.py), and the gradient is (softmax - one_hot) * grad with no reduce of its own."""
  _check_reduction(reduction)
  classes = log_probs.shape[-1]
  one_hot = _one_hot(target, classes)
  if normalizer is not None and log_probs.ndim == 2 and log_probs.numel() < 2 ** 31:
    loss = normalizer.squeeze(-1) - _picked_logits(log_probs, target, one_hot)
  else:
    loss = -one_hot.where(log_probs, 0).sum(-1)
    if normalizer is not None: loss = loss + normalizer.squeeze(-1)
  if label_smoothing:
    smooth = -log_probs.mean(-1) + (normalizer.squeeze(-1) if normalizer is not None else 0)
    loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
  targets = target.lazydata
  keep = type(target)(targets.elementwise(CMPNE, targets.operand_like(ignore_index)))
  loss = keep.where(loss, 0)
  if reduction == "mean": return loss.sum() / keep.sum().cast(loss.dtype)
  return _reduce(loss, reduction)


def _one_hot(target: Tensor, classes: int) -> Tensor:
  """(*target.shape, classes) bool, True at each sample's target class. Built on lazy buffers, as the other masks of
  integer targets below: they carry no gradient, and a Tensor op's Function per operation was most of an eager
  cross-entropy's graph building."""
  targets, shape = _wide_targets(target), (*target.shape, classes)
  class_range = type(target).arange(classes, device=target.device, dtype=targets.dtype).lazydata
  class_range = class_range.reshape((*([1] * target.ndim), classes)).expand(shape)
  return type(target)(F._equal(targets.reshape((*target.shape, 1)).expand(shape), class_range))


def _wide_targets(target: Tensor) -> LazyBuffer | MultiLazyBuffer:
  """The integer targets' lazy buffer in a dtype that holds any class count (int32 at least, as `target == arange`
  promoted it)."""
  return target.lazydata.cast(least_upper_dtype(target.dtype, dtypes.default_int))


def _logits_nll(scores: Tensor, target: Tensor, reduction: str, ignore_index: int, label_smoothing: float) -> Tensor:
  """Cross-entropy of logits (classes last) against class indices: float32 logits as logsumexp - the picked logit
  (_index_nll's `normalizer`), other dtypes through log_softmax (half precision rounds its log-probabilities, as
  PyTorch does)."""
  if scores.dtype == dtypes.float32 and scores.numel():
    return _index_nll(scores, target, reduction, ignore_index, label_smoothing, scores.logsumexp(-1, keepdim=True))
  return _index_nll(scores.log_softmax(-1), target, reduction, ignore_index, label_smoothing)


def _picked_logits(logits: Tensor, target: Tensor, one_hot: Tensor) -> Tensor:
  """logits[r, target[r]] of (R, C) logits (0 where the target is outside [0, C): an ignored sample), one indexed
  load a row instead of a one-hot sum over the row (a second pass over a vocabulary-wide row); the gradient is
  where(one_hot, grad, 0), which fuses into the logits' other gradient terms (FM.PickPerRow)."""
  Tensor = type(logits)  # noqa: N806 (the concrete class; mixins never import it)
  rows, classes = logits.shape
  targets = _wide_targets(target)   # (integers: no gradient, so lazy buffers, as _one_hot)
  in_range = F._not(targets.elementwise(CMPLT, targets.operand_like(0)))   # target >= 0 (integers have no NaN)
  in_range = in_range.elementwise(AND, targets.elementwise(CMPLT, targets.operand_like(classes)))
  # the target clamped before the offset is computed: row * C + target never wraps (R * C < 2**31), whatever the
  # target's value (a CPU row kernel computes it without -fwrapv, RowLinearizer._lane_nodes)
  column = F._where(in_range, targets, targets.operand_like(0)).cast(dtypes.int32)
  row_starts = Tensor.arange(rows, device=logits.device, dtype=dtypes.int32).lazydata
  flat = F._mul(row_starts, row_starts.operand_like(classes)).elementwise(ADD, column)
  flat_index = F._where(in_range, flat, flat.operand_like(-1))
  return FM.PickPerRow.apply(logits, Tensor(flat_index), one_hot.detach())


def _check_class_weight(weight: Tensor, classes: int, what: str) -> None:
  if weight.shape != (classes,):
    raise ShapeError(f"{what}: weight must hold one value per class, shape ({classes},), got {weight.shape}")


def _weighted_index_nll(log_probs: Tensor, target: Tensor, weight: Tensor, reduction: str, ignore_index: int,
                        label_smoothing: float) -> Tensor:
  """_index_nll with a weight per class (classes last), PyTorch's rules: each sample's loss is scaled by the
  weight of its target class, and "mean" divides by the sum of those weights over the samples not ignored. With
  label smoothing e the loss is (1-e) * that + e/C * the weighted sum of -log p over the classes, normalized the
  same way."""
  _check_reduction(reduction)
  classes = log_probs.shape[-1]
  _check_class_weight(weight, classes, "nll_loss/cross_entropy")
  one_hot = target.unsqueeze(-1) == type(log_probs).arange(classes, device=log_probs.device)
  keep = target != ignore_index
  target_weight = keep.where(one_hot.where(weight, 0).sum(-1), 0)
  loss = -one_hot.where(log_probs, 0).sum(-1) * target_weight
  if label_smoothing:
    smooth = keep.where(-(log_probs * weight).sum(-1), 0)
    loss = (1.0 - label_smoothing) * loss + (label_smoothing / classes) * smooth
  if reduction == "mean": return loss.sum() / target_weight.sum()
  return _reduce(loss, reduction)


def _check_same_shape(a: Tensor, b: Tensor, what: str) -> None:
  # PyTorch only warns on broadcasting here, and it is nearly always a bug ((N, 1) vs (N,)), so refuse it
  if a.shape != b.shape: raise ShapeError(f"{what}: input of shape {a.shape} and target of shape {b.shape} differ")


def _clamped_log(x: Tensor) -> Tensor:
  """max(log(x), -100), PyTorch's clamp in binary_cross_entropy. The log only ever sees positive values (x <= 0
  is replaced by 1 inside and by -100 outside), so the gradient at x = 0 is 0, never the nan of 0 * (1/0)."""
  positive = x > 0
  return positive.where(positive.where(x, 1.0).log().maximum(-100.0), -100.0)


def _repeat_heads(x: Tensor, repeats: int) -> Tensor:
  """(..., H, S, E) -> (..., H * repeats, S, E) with each head repeated `repeats` times in a row (GQA)."""
  if repeats == 1: return x
  expanded = x.unsqueeze(-3).expand(*x.shape[:-2], repeats, *x.shape[-2:])
  return expanded.reshape(*x.shape[:-3], x.shape[-3] * repeats, *x.shape[-2:])


def _masked_softmax(scores: Tensor) -> Tensor:
  """softmax over the last axis that gives 0 (not nan) for a row masked out entirely (all -inf), as PyTorch's
  sdpa does: the row maximum is then -inf, so it is replaced by 0, and the empty sum by 1."""
  peak = scores.max(-1, keepdim=True)
  peak = (peak == -math.inf).where(0.0, peak)
  exps = (scores - peak).exp()
  total = exps.sum(-1, keepdim=True)
  return exps / (total == 0).where(1.0, total)


def _one_layernorm_node(x: Tensor, operands: list[Tensor]) -> bool:
  """Whether `layernorm` builds its graph as one LayerNormalize node: x a float32 or float64 lazy buffer (half
  precision sums in float32 and rounds: the composed path) with nonzero normalized axes, and the affine operands of
  its dtype and device, shaped to broadcast against it without growing it."""
  from ourgrad.lazy import LazyBuffer
  lazy = x._lazydata
  if type(lazy) is not LazyBuffer or lazy.dtype not in (dtypes.float32, dtypes.float64) or 0 in lazy.shape:
    return False
  if not all(type(size) is int for size in lazy.shape): return False
  for operand in operands:
    theirs = operand._lazydata
    if type(theirs) is not LazyBuffer or theirs.dtype is not lazy.dtype or theirs.device != lazy.device: return False
    if len(theirs.shape) > len(lazy.shape): return False
    if any(mine != size and size != 1 for mine, size in zip(lazy.shape[::-1], theirs.shape[::-1])): return False
  return True


class LayerNormalize(F.Function):
  """y = (x - mean) * rsqrt(var + eps) [* weight] [+ bias] over `axes` as one autograd node, x given twice (the
  gradient of its direct path goes to the first, that of its path through the mean to the second; `affine`: which of
  weight and bias follow). Forward and backward build, op for op, the lazy graphs that the
  composed Tensor ops (a mean, a subtraction, a square, a mean, an add, an rsqrt, a product, the affine product and
  sum, and the broadcasts between them) and the backward walk through their ~12 Functions built, so the kernels are
  the same; one node instead of a dozen costs a GPT-2 eager step a fraction of its graph building and autograd."""

  def forward(self, x: LazyBuffer, _x: LazyBuffer, *affine_operands: LazyBuffer, axes: tuple[int, ...], eps: float,
              affine: tuple[bool, bool]) -> LazyBuffer:
    operands = list(affine_operands)
    weight = operands.pop(0) if affine[0] else None
    bias = operands.pop(0) if affine[1] else None
    shape = x.shape
    self.axes, self.count = axes, prod(shape[axis] for axis in axes)
    self.weight_shape = None if weight is None else weight.shape
    self.bias_shape = None if bias is None else bias.shape
    mean = _mean_of(x, axes, self.count)
    self.centered = F._sub(x, mean.expand(shape))
    variance = _mean_of(F._mul(self.centered, self.centered), axes, self.count)
    # Rsqrt's forward on var + eps (a Python scalar made at the reduced shape, as Tensor's + makes it)
    self.rstd = variance.elementwise(ADD, variance.operand_like(eps)).elementwise(SQRT).elementwise(RECIP)
    self.normalized = F._mul(self.centered, self.rstd.expand(shape))
    out = self.normalized
    self.weight = None if weight is None else F._broadcast_to(weight, shape)
    if self.weight is not None: out = F._mul(out, self.weight)
    return out if bias is None else out.elementwise(ADD, F._broadcast_to(bias, shape))

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, ...]:
    shape = self.centered.shape
    needs = list(self.needs_input_grad)
    grads: list[LazyBuffer | None] = [None, None]
    # the affine inputs' gradients, as Mul and Add with their Expand backward give them
    grad = grad_output
    if self.weight is not None:
      needed = needs[len(grads)]
      grads.append(F._sum_to_shape(F._mul(self.normalized, grad), self.weight_shape) if needed else None)
      grad = F._mul(self.weight, grad)
    if self.bias_shape is not None:
      grads.append(F._sum_to_shape(grad_output, self.bias_shape) if needs[len(grads)] else None)
    if not needs[0]: return tuple(grads)
    # normalized = centered * rstd: the rstd branch back through Rsqrt, the + eps, the mean and the square
    reduced = self.rstd.shape
    grad_centered = F._mul(self.rstd.expand(shape), grad)
    grad_rstd = F._sum_to_shape(F._mul(self.centered, grad), reduced)
    result = self.rstd
    grad_variance = F._scale(F._mul(grad_rstd, F._mul(result, F._mul(result, result))), -0.5)
    grad_squares = _mean_backward(grad_variance, shape, self.count)
    # the square's two factors, each added to the gradient of `centered` in the order the walk reached them (the
    # composed walk built their equal products twice: one base read twice here, the same values)
    square_factor = F._mul(self.centered, grad_squares)
    grad_centered = grad_centered.elementwise(ADD, square_factor).elementwise(ADD, square_factor)
    # centered = x - mean: x directly, then through the mean
    grad_mean = F._sum_to_shape(grad_centered.elementwise(NEG), reduced)
    grads[0], grads[1] = grad_centered, _mean_backward(grad_mean, shape, self.count)
    return tuple(grads)


def _mean_of(x: LazyBuffer, axes: tuple[int, ...], count: int) -> LazyBuffer:
  """Tensor.mean(axes, keepdim=True)'s graph on a float lazy buffer: the sum, divided by the count."""
  total = x.reduce(SUM, axes)
  return F._div(total, total.operand_like(count))


def _mean_backward(grad: LazyBuffer, shape: tuple[int, ...], count: int) -> LazyBuffer:
  """The gradient of x (of `shape`) from that of its mean (`_mean_of`): Div's backward, then Sum's."""
  return F._div(grad, grad.operand_like(count)).expand(shape)


class NNMixin(ConvMixin, ResizeMixin, EinsumMixin):
  """Tensor methods for neural networks: layernorm, dropout, losses, attention (and, through the base mixins,
  convolutions, pooling, interpolate, padding modes, einsum)."""
  __slots__ = ()

  # ---------------------------------------------------------------- normalization and dropout

  @autocast_op(CastPolicy.FLOAT32)
  def layernorm(self: Tensor, axis: int | Sequence[int] = -1, eps: float = 1e-5, weight: Tensor | None = None,
                bias: Tensor | None = None) -> Tensor:
    """(x - mean) / sqrt(var + eps) over `axis` (an int or a tuple of axes), with the biased variance as in
    torch.nn.functional.layer_norm, then times `weight` and plus `bias` if given (each broadcast against x, as
    nn.LayerNorm's affine parameters of the normalized shape)."""
    axes = (int(axis),) if isinstance(axis, Integral) else tuple(axis)
    operands = [operand for operand in (weight, bias) if operand is not None]
    normalized_axes = tuple(sorted({self._axis(axis) for axis in axes}))
    if len(normalized_axes) == len(axes) and _one_layernorm_node(self, operands):
      # x twice: the gradients of its two paths (direct, through the mean) reach the backward walk one after the other,
      # as the composed graph's Sub and mean gave them, so a tensor that others read too sums them in the same order
      return LayerNormalize.apply(self, self, *operands, axes=normalized_axes, eps=eps,
                                  affine=(weight is not None, bias is not None))
    centered = self - self.mean(axes, keepdim=True)
    normalized = centered * (centered.square().mean(axes, keepdim=True) + eps).rsqrt()
    if weight is not None: normalized = normalized * weight
    return normalized if bias is None else normalized + bias

  def dropout(self: Tensor, p: float = 0.5, training: bool | None = None) -> Tensor:
    """While training, zero each element with probability p and scale the others by 1 / (1 - p), so the
    expectation is unchanged; otherwise return the tensor. `training` defaults to the global Tensor.training
    (nn.Dropout passes its module's mode). The mask comes from rand, so manual_seed makes it reproducible."""
    if not 0.0 <= p <= 1.0: raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not (type(self).training if training is None else training) or p == 0.0: return self
    keep = type(self).rand(*self.shape, device=self.device) >= p
    # p == 1 keeps nothing (rand < 1 always), and must not scale by 1/0
    return keep.where(self * (1.0 / (1.0 - p)) if p < 1.0 else self, 0)

  # ---------------------------------------------------------------- losses

  @autocast_op(CastPolicy.FLOAT32)
  def nll_loss(self: Tensor, target: Tensor, reduction: str = "mean", ignore_index: int = -100,
               weight: Tensor | None = None) -> Tensor:
    """Negative log-likelihood of these log-probabilities at the class indices `target`, like
    torch.nn.functional.nll_loss (classes on axis 1 ((N, C, ...)) or 0 ((C,))). `weight` (C,) scales each
    sample by its class's weight, and "mean" then divides by the sum of the weights used, as in PyTorch."""
    scores = _class_last(self)
    _check_index_target(scores, target, "nll_loss")
    if weight is not None: return _weighted_index_nll(scores, target, weight, reduction, ignore_index, 0.0)
    return _index_nll(scores, target, reduction, ignore_index, 0.0)

  @autocast_op(CastPolicy.FLOAT32)
  def cross_entropy(self: Tensor, target: Tensor, reduction: str = "mean", label_smoothing: float = 0.0,
                    ignore_index: int = -100, weight: Tensor | None = None) -> Tensor:
    """Cross entropy of these logits like torch.nn.functional.cross_entropy: log_softmax over the class axis (1,
    or 0 for unbatched (C,) input) and the negative log-likelihood of `target`.

    `target` is either integer class indices (the input's shape without the class axis; `ignore_index` samples
    are skipped) or float class probabilities of the input's shape (smoothed towards uniform by
    `label_smoothing`; "mean" then divides by the number of samples). `weight` (C,) weighs each class as in
    PyTorch: index targets divide "mean" by the sum of the weights of the targets used; probability targets
    scale each class's term and divide "mean" by the number of samples."""
    if not 0.0 <= label_smoothing <= 1.0:
      raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    scores = _class_last(self)
    # (log_softmax only where it is read: the common case, index targets without weights, never builds its graph)
    if not target.dtype.is_float:
      _check_index_target(scores, target, "cross_entropy")
      if weight is None: return _logits_nll(scores, target, reduction, ignore_index, label_smoothing)
      return _weighted_index_nll(scores.log_softmax(-1), target, weight, reduction, ignore_index, label_smoothing)
    if target.shape != self.shape:
      raise ShapeError(f"cross_entropy: a probability target must have the input's shape {self.shape}, "
                       f"got {target.shape}")
    _check_reduction(reduction)
    probs = _class_last(target)
    if label_smoothing: probs = probs * (1.0 - label_smoothing) + label_smoothing / scores.shape[-1]
    if weight is not None:
      _check_class_weight(weight, scores.shape[-1], "cross_entropy")
      probs = probs * weight
    return _reduce(-(probs * scores.log_softmax(-1)).sum(-1), reduction)

  @autocast_op(CastPolicy.FLOAT32)
  def sparse_categorical_crossentropy(self: Tensor, target: Tensor, ignore_index: int = -1,
                                      label_smoothing: float = 0.0, reduction: str = "mean") -> Tensor:
    """tinygrad's cross entropy of these logits (classes on the LAST axis, any number of leading axes) against
    integer class indices; samples equal to `ignore_index` are skipped."""
    if not 0.0 <= label_smoothing <= 1.0:
      raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if self.ndim == 0: raise ShapeError("sparse_categorical_crossentropy needs logits with a class axis, got ()")
    _check_index_target(self, target, "sparse_categorical_crossentropy")
    return _logits_nll(self, target, reduction, ignore_index, label_smoothing)

  @autocast_op(CastPolicy.FLOAT32)
  def binary_cross_entropy(self: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """Binary cross entropy of these probabilities, like torch.nn.functional.binary_cross_entropy:
    -(t log p + (1-t) log(1-p)), each log clamped to >= -100 as in PyTorch so that p = 0 or 1 gives a finite
    loss. Where the clamp is active the gradient is 0 (PyTorch's hand-written backward gives +-1e12 at exactly
    p = 0 or 1 instead)."""
    _check_same_shape(self, target, "binary_cross_entropy")
    _check_reduction(reduction)
    probs, target = self._float_operand(), target._float_operand()
    log_p, log_not_p = _clamped_log(probs), _clamped_log(1.0 - probs)
    return _reduce(-(target * log_p + (1.0 - target) * log_not_p), reduction)

  @autocast_op(CastPolicy.FLOAT32)
  def binary_cross_entropy_with_logits(self: Tensor, target: Tensor, reduction: str = "mean",
                                       pos_weight: Tensor | None = None) -> Tensor:
    """Binary cross entropy of sigmoid(self) against `target`, like
    torch.nn.functional.binary_cross_entropy_with_logits, computed without the sigmoid so large |logits| neither
    overflow nor lose the gradient: with w = 1 + (pos_weight - 1) * t the loss is
    (1 - t) * x + w * log(1 + exp(-x)), and log(1 + exp(-x)) = max(-x, 0) + log(1 + exp(-|x|))."""
    _check_same_shape(self, target, "binary_cross_entropy_with_logits")
    _check_reduction(reduction)
    x, target = self._float_operand(), target._float_operand()
    # relu(-x) and -|x| written with one `where` so that x = 0 takes the x >= 0 side in both: the gradient there
    # is then sigmoid(0) - 1 = -0.5 exactly (separate relu/abs subgradients at 0 would give 0)
    negative = x < 0
    softplus_neg = negative.where(-x, 0.0) + negative.where(x, -x).exp().log1p()
    weight = 1.0 if pos_weight is None else 1.0 + (pos_weight - 1.0) * target
    return _reduce((1.0 - target) * x + weight * softplus_neg, reduction)

  @autocast_op(CastPolicy.FLOAT32)
  def mse_loss(self: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """Mean (or summed, or per-element) squared error against `target`, like torch.nn.functional.mse_loss."""
    _check_same_shape(self, target, "mse_loss")
    _check_reduction(reduction)
    return _reduce((self - target).square(), reduction)

  # ---------------------------------------------------------------- attention

  @autocast_op(CastPolicy.LOWER)
  def scaled_dot_product_attention(self: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                   enable_gqa: bool = False) -> Tensor:
    """softmax(q @ k^T * scale + mask) @ v with this tensor as the query q (..., L, E), k (..., S, E),
    v (..., S, Ev) -> (..., L, Ev), like torch.nn.functional.scaled_dot_product_attention.

    - `attn_mask` broadcasts to (..., L, S): a bool mask keeps the positions that are True, a float mask is added
      to the scores. Query rows with every position masked out give 0, as in PyTorch.
    - `is_causal` keeps key j for query i when j <= i (the top-left aligned lower triangle of (L, S), as in
      PyTorch); it cannot be combined with `attn_mask`.
    - `scale` defaults to 1 / sqrt(E).
    - `dropout_p` > 0 drops attention weights with that probability and scales the rest by 1 / (1 - p) whenever
      it is given, as PyTorch's functional form does (pass 0.0 at evaluation); independent of Tensor.training.
    - `enable_gqa` lets k and v have fewer heads (axis -3) than q, each shared by q.heads / kv.heads query heads."""
    q, k, v = self, key, value
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
      raise ShapeError(f"scaled_dot_product_attention needs q, k, v with at least 2 dims, got {q.shape}, {k.shape}, "
                       f"{v.shape}")
    if q.shape[-1] != k.shape[-1]:
      raise ShapeError(f"q {q.shape} and k {k.shape} must have the same embedding size (last dim)")
    if k.shape[-2] != v.shape[-2]:
      raise ShapeError(f"k {k.shape} and v {v.shape} must have the same sequence length (dim -2)")
    if is_causal and attn_mask is not None:
      raise ValueError("scaled_dot_product_attention: pass either attn_mask or is_causal=True, not both")
    if not 0.0 <= dropout_p < 1.0: raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if enable_gqa and q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
      if q.shape[-3] % k.shape[-3] or k.shape[-3] != v.shape[-3]:
        raise ShapeError(f"enable_gqa needs the query heads ({q.shape[-3]}) to be a multiple of the key/value "
                         f"heads ({k.shape[-3]}, {v.shape[-3]})")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # one kernel where the device has it (tensor_attention.py decides, and says why not at DEBUG>=3)
    refusal = fused_attention_refusal(q, k, v, attn_mask, dropout_p, enable_gqa)
    explain_attention(refusal)
    if refusal is None: return fused_attention(q, k, v, is_causal, scale)
    if composite_attention_refusal(q, k, v, attn_mask, dropout_p, enable_gqa) is None:
      # no gradient to record: the graph below built straight on lazy buffers, one step per op (tensor_attention.py)
      lazy = composite_attention(q.lazydata, k.lazydata, v.lazydata, None if attn_mask is None else attn_mask.lazydata,
                                 is_causal, scale)
      unknown = not type(q).no_grad and any(x.requires_grad is None for x in (q, k, v))
      return type(q)(lazy, requires_grad=None if unknown else False)
    if enable_gqa and q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
      k, v = _repeat_heads(k, q.shape[-3] // k.shape[-3]), _repeat_heads(v, q.shape[-3] // v.shape[-3])

    length, source = q.shape[-2], k.shape[-2]
    scores = q.matmul(k.transpose(-2, -1)) * scale
    if is_causal:
      rows = type(q).arange(length, device=q.device).reshape(length, 1)
      keep = type(q).arange(source, device=q.device).reshape(1, source) <= rows
      scores = keep.where(scores, -math.inf)
    if attn_mask is not None:
      if attn_mask.dtype == dtypes.bool: scores = attn_mask.where(scores, -math.inf)
      elif attn_mask.dtype.is_float: scores = scores + attn_mask
      else: raise DTypeError(f"attn_mask must be bool (True = attend) or float (added), got {attn_mask.dtype}")
    # only an explicit mask can empty a whole row (a causal row always keeps its first key)
    weights = _masked_softmax(scores) if attn_mask is not None else scores.softmax(-1)
    if dropout_p > 0.0:
      dropped = type(q).rand(*weights.shape, device=weights.device) >= dropout_p
      weights = dropped.where(weights / (1.0 - dropout_p), 0)
    return weights.matmul(v)
