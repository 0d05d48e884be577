"""Attention: scaled_dot_product_attention with torch.nn.functional's name (the Tensor method of
ourgrad/tensor_nn.py, so `attention.scaled_dot_product_attention(q, k, v)` is `q.scaled_dot_product_attention(k, v)`),
and the MultiheadAttention module.
"""
from __future__ import annotations

import math

from ourgrad.dtype import DType, dtypes
from ourgrad.errors import DTypeError, ShapeError
from ourgrad.nn.layers import Linear
from ourgrad.nn.module import Module
from ourgrad.tensor import Tensor

__all__ = ["scaled_dot_product_attention", "MultiheadAttention"]

scaled_dot_product_attention = Tensor.scaled_dot_product_attention


class MultiheadAttention(Module):
  """Multi-head attention like torch.nn.MultiheadAttention (same parameters and state-dict keys:
  in_proj_weight (3E, E), in_proj_bias (3E,), out_proj.weight, out_proj.bias), for kdim = vdim = embed_dim.

  forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None, average_attn_weights=True,
  is_causal=False) -> (output, weights or None). Inputs are (L, N, E) (or (N, L, E) with batch_first) or unbatched
  (L, E). As in PyTorch's module (and unlike scaled_dot_product_attention), a bool mask marks with True the
  positions NOT to attend; a float mask is added. attn_mask is (L, S) or (N * num_heads, L, S), key_padding_mask
  (N, S). Attention dropout acts while the module is training."""

  def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
               batch_first: bool = False):
    if num_heads <= 0 or embed_dim % num_heads:
      raise ValueError(f"embed_dim={embed_dim} must be divisible by num_heads={num_heads}")
    self.embed_dim, self.num_heads, self.dropout, self.batch_first = embed_dim, num_heads, dropout, batch_first
    bound = math.sqrt(6.0 / (4 * embed_dim))  # xavier_uniform of a (3E, E) matrix, PyTorch's init
    self.in_proj_weight = Tensor.uniform(3 * embed_dim, embed_dim, low=-bound, high=bound, requires_grad=True)
    self.in_proj_bias = Tensor.zeros(3 * embed_dim, requires_grad=True) if bias else None
    self.out_proj = Linear(embed_dim, embed_dim, bias=bias)
    if bias: self.out_proj.bias = Tensor.zeros(embed_dim, requires_grad=True)

  def _additive(self, mask: Tensor | None, dtype: DType) -> Tensor | None:
    """A mask as something to add to the scores: True (bool) -> -inf, a float mask as it is."""
    if mask is None: return None
    if mask.dtype == dtypes.bool: return mask.where(-math.inf, 0.0).cast(dtype)
    if not mask.dtype.is_float: raise DTypeError(f"attention masks must be bool or float, got {mask.dtype}")
    return mask

  def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
              need_weights: bool = True, attn_mask: Tensor | None = None, average_attn_weights: bool = True,
              is_causal: bool = False) -> tuple[Tensor, Tensor | None]:
    unbatched = query.ndim == 2
    if unbatched: query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
    elif self.batch_first: query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    if query.ndim != 3 or query.shape[-1] != self.embed_dim or key.shape[-1] != self.embed_dim \
        or value.shape[-1] != self.embed_dim or key.shape[:2] != value.shape[:2]:
      raise ShapeError(f"MultiheadAttention({self.embed_dim}, {self.num_heads}) got query {query.shape}, key "
                       f"{key.shape}, value {value.shape} (sequence-first, embed_dim last)")
    length, batch, embed = query.shape
    source, heads = key.shape[0], self.num_heads
    if is_causal and attn_mask is None:
      attn_mask = Tensor.ones(length, source, dtype=dtypes.bool, device=query.device).triu(1)
    size = embed // heads
    bias = self.in_proj_bias
    projected = [x.linear(self.in_proj_weight[i * embed:(i + 1) * embed],
                          None if bias is None else bias[i * embed:(i + 1) * embed])
                 for i, x in enumerate((query, key, value))]
    # (T, N, E) -> (N, heads, T, size)
    q, k, v = (x.reshape(x.shape[0], batch, heads, size).permute(1, 2, 0, 3) for x in projected)
    scores = q.matmul(k.transpose(-2, -1)) * (1.0 / math.sqrt(size))
    mask = self._additive(attn_mask, scores.dtype)
    if mask is not None: scores = scores + (mask.reshape(batch, heads, length, source) if mask.ndim == 3 else mask)
    padding = self._additive(key_padding_mask, scores.dtype)
    if padding is not None: scores = scores + padding.reshape(batch, 1, 1, source)
    weights = scores.softmax(-1)
    dropped = weights.dropout(self.dropout, self.training) if self.dropout > 0 else weights
    out = dropped.matmul(v).permute(2, 0, 1, 3).reshape(length, batch, embed)
    out = self.out_proj(out)
    if unbatched: out = out.squeeze(1)
    elif self.batch_first: out = out.transpose(0, 1)
    if not need_weights: return out, None
    weights = weights.mean(1) if average_attn_weights else weights
    return out, weights.squeeze(0) if unbatched else weights
