"""Scaled dot-product attention, with torch.nn.functional.scaled_dot_product_attention semantics.

softmax(q @ k^T * scale + mask) @ v, composed from Tensor ops (a matmul reduce, a fused masked softmax, a
second matmul reduce), so it stays lazy and differentiable like everything else.
"""
from __future__ import annotations

import math

from ourgrad.dtype import dtypes
from ourgrad.errors import DTypeError, ShapeError
from ourgrad.tensor import Tensor


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


def scaled_dot_product_attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> Tensor:
  """softmax(q @ k^T * scale + mask) @ v for q (..., L, E), k (..., S, E), v (..., S, Ev) -> (..., L, Ev).

  - `attn_mask` broadcasts to (..., L, S): a bool mask keeps the positions that are True, a float mask is added
    to the scores. Query rows with every position masked out give 0, as in PyTorch.
  - `is_causal` keeps key j for query i when j <= i (the top-left aligned lower triangle of (L, S), as in
    PyTorch); it cannot be combined with `attn_mask`.
  - `scale` defaults to 1 / sqrt(E).
  - `dropout_p` > 0 drops attention weights with that probability and scales the rest by 1 / (1 - p) whenever it
    is given, as PyTorch's functional form does (pass 0.0 at evaluation); it is independent of Tensor.training.
  - `enable_gqa` lets k and v have fewer heads (axis -3) than q, each shared by q.heads / kv.heads query heads."""
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
      raise ShapeError(f"enable_gqa needs the query heads ({q.shape[-3]}) to be a multiple of the key/value heads "
                       f"({k.shape[-3]}, {v.shape[-3]})")
    k, v = _repeat_heads(k, q.shape[-3] // k.shape[-3]), _repeat_heads(v, q.shape[-3] // v.shape[-3])

  length, source = q.shape[-2], k.shape[-2]
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
  scores = q.matmul(k.transpose(-2, -1)) * scale
  if is_causal:
    rows = Tensor.arange(length, device=q.device).reshape(length, 1)
    keep = Tensor.arange(source, device=q.device).reshape(1, source) <= rows
    scores = keep.where(scores, -math.inf)
  if attn_mask is not None:
    if attn_mask.dtype == dtypes.bool: scores = attn_mask.where(scores, -math.inf)
    elif attn_mask.dtype.is_float: scores = scores + attn_mask
    else: raise DTypeError(f"attn_mask must be bool (True = attend) or float (added), got {attn_mask.dtype}")
  # only an explicit mask can empty a whole row (a causal row always keeps its first key)
  weights = _masked_softmax(scores) if attn_mask is not None else scores.softmax(-1)
  if dropout_p > 0.0:
    weights = (Tensor.rand(*weights.shape, device=weights.device) >= dropout_p).where(weights / (1.0 - dropout_p), 0)
  return weights.matmul(v)
