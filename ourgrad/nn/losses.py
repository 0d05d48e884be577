"""Loss functions on Tensors, with torch.nn.functional names and semantics.

Every loss is composed from Tensor ops, so it stays lazy, fuses with the layer before it and gets its gradient
from the primitives. Class-index targets never use a gather: `target.unsqueeze(-1) == Tensor.arange(C)` makes a
one-hot mask that `where` + `sum` turn into one fused reduce, and log-probabilities come from the max-shifted
(numerically stable) `log_softmax`.

Layout conventions follow PyTorch: `cross_entropy` and `nll_loss` take the class dimension at axis 1 for
batched input ((N, C) or (N, C, d1, ...)) and at axis 0 for a single unbatched sample (C,);
`sparse_categorical_crossentropy` (tinygrad's name) takes it last.
"""
from __future__ import annotations

from ourgrad.dtype import dtypes
from ourgrad.errors import DTypeError, ShapeError
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
               label_smoothing: float) -> Tensor:
  """Negative log-likelihood of class indices, classes on the last axis of `log_probs`.

  With label smoothing e the per-sample loss is (1-e) * -log p[target] + e * mean_c(-log p[c]), as in PyTorch.
  Samples whose target is `ignore_index` contribute 0, and "mean" divides by the number of the other samples
  (0/0 = nan when all are ignored, as in PyTorch)."""
  _check_reduction(reduction)
  classes = log_probs.shape[-1]
  one_hot = target.unsqueeze(-1) == Tensor.arange(classes, device=log_probs.device)
  loss = -one_hot.where(log_probs, 0).sum(-1)
  if label_smoothing:
    loss = (1.0 - label_smoothing) * loss - label_smoothing * log_probs.mean(-1)
  keep = target != ignore_index
  loss = keep.where(loss, 0)
  if reduction == "mean": return loss.sum() / keep.sum().cast(loss.dtype)
  return _reduce(loss, reduction)


def nll_loss(log_probs: Tensor, target: Tensor, reduction: str = "mean", ignore_index: int = -100) -> Tensor:
  """torch.nn.functional.nll_loss: -log_probs[target] per sample, classes on axis 1 ((N, C, ...)) or 0 ((C,))."""
  scores = _class_last(log_probs)
  _check_index_target(scores, target, "nll_loss")
  return _index_nll(scores, target, reduction, ignore_index, 0.0)


def cross_entropy(logits: Tensor, target: Tensor, reduction: str = "mean", label_smoothing: float = 0.0,
                  ignore_index: int = -100) -> Tensor:
  """torch.nn.functional.cross_entropy: log_softmax over the class axis (1, or 0 for unbatched (C,) input) and
  the negative log-likelihood of `target`.

  `target` is either integer class indices (the input's shape without the class axis; `ignore_index` samples
  are skipped) or float class probabilities of the input's shape (smoothed towards uniform by
  `label_smoothing`; "mean" then divides by the number of samples)."""
  if not 0.0 <= label_smoothing <= 1.0: raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
  scores = _class_last(logits)
  log_probs = scores.log_softmax(-1)
  if not target.dtype.is_float:
    _check_index_target(scores, target, "cross_entropy")
    return _index_nll(log_probs, target, reduction, ignore_index, label_smoothing)
  if target.shape != logits.shape:
    raise ShapeError(f"cross_entropy: a probability target must have the input's shape {logits.shape}, "
                     f"got {target.shape}")
  _check_reduction(reduction)
  probs = _class_last(target)
  if label_smoothing: probs = probs * (1.0 - label_smoothing) + label_smoothing / scores.shape[-1]
  return _reduce(-(probs * log_probs).sum(-1), reduction)


def sparse_categorical_crossentropy(logits: Tensor, target: Tensor, ignore_index: int = -1,
                                    label_smoothing: float = 0.0, reduction: str = "mean") -> Tensor:
  """tinygrad's `sparse_categorical_crossentropy`: cross entropy of integer class indices with the classes on
  the LAST axis of `logits` (any number of leading axes); samples equal to `ignore_index` are skipped."""
  if not 0.0 <= label_smoothing <= 1.0: raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
  if logits.ndim == 0: raise ShapeError("sparse_categorical_crossentropy needs logits with a class axis, got ()")
  _check_index_target(logits, target, "sparse_categorical_crossentropy")
  return _index_nll(logits.log_softmax(-1), target, reduction, ignore_index, label_smoothing)


def _check_same_shape(a: Tensor, b: Tensor, what: str) -> None:
  # PyTorch only warns on broadcasting here, and it is nearly always a bug ((N, 1) vs (N,)), so refuse it
  if a.shape != b.shape: raise ShapeError(f"{what}: input of shape {a.shape} and target of shape {b.shape} differ")


def _clamped_log(x: Tensor) -> Tensor:
  """max(log(x), -100), PyTorch's clamp in binary_cross_entropy. The log only ever sees positive values (x <= 0
  is replaced by 1 inside and by -100 outside), so the gradient at x = 0 is 0, never the nan of 0 * (1/0)."""
  positive = x > 0
  return positive.where(positive.where(x, 1.0).log().maximum(-100.0), -100.0)


def binary_cross_entropy(probs: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
  """torch.nn.functional.binary_cross_entropy: -(t log p + (1-t) log(1-p)), each log clamped to >= -100 as in
  PyTorch so that p = 0 or 1 gives a finite loss. Where the clamp is active the gradient is 0 (PyTorch's
  hand-written backward gives +-1e12 at exactly p = 0 or 1 instead)."""
  _check_same_shape(probs, target, "binary_cross_entropy")
  _check_reduction(reduction)
  probs, target = probs._float_operand(), target._float_operand()
  log_p, log_not_p = _clamped_log(probs), _clamped_log(1.0 - probs)
  return _reduce(-(target * log_p + (1.0 - target) * log_not_p), reduction)


def binary_cross_entropy_with_logits(logits: Tensor, target: Tensor, reduction: str = "mean",
                                     pos_weight: Tensor | None = None) -> Tensor:
  """torch.nn.functional.binary_cross_entropy_with_logits: binary cross entropy of sigmoid(logits), computed
  without the sigmoid so large |logits| neither overflow nor lose the gradient.

  With w = 1 + (pos_weight - 1) * t the loss is (1 - t) * x + w * log(1 + exp(-x)), and
  log(1 + exp(-x)) = max(-x, 0) + log(1 + exp(-|x|)) never exponentiates a positive number."""
  _check_same_shape(logits, target, "binary_cross_entropy_with_logits")
  _check_reduction(reduction)
  x, target = logits._float_operand(), target._float_operand()
  # relu(-x) and -|x| written with one `where` so that x = 0 takes the x >= 0 side in both: the gradient there is
  # then sigmoid(0) - 1 = -0.5 exactly (separate relu/abs subgradients at 0 would give 0)
  negative = x < 0
  softplus_neg = negative.where(-x, 0.0) + negative.where(x, -x).exp().log1p()
  weight = 1.0 if pos_weight is None else 1.0 + (pos_weight - 1.0) * target
  return _reduce((1.0 - target) * x + weight * softplus_neg, reduction)


def mse_loss(pred: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
  """torch.nn.functional.mse_loss: (pred - target)^2."""
  _check_same_shape(pred, target, "mse_loss")
  _check_reduction(reduction)
  return _reduce((pred - target).square(), reduction)
