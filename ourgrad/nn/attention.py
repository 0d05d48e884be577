"""Scaled dot-product attention with torch.nn.functional's name: the Tensor method of ourgrad/tensor_nn.py, so
`attention.scaled_dot_product_attention(q, k, v)` is `q.scaled_dot_product_attention(k, v)`.
"""
from __future__ import annotations

from ourgrad.tensor import Tensor

__all__ = ["scaled_dot_product_attention"]

scaled_dot_product_attention = Tensor.scaled_dot_product_attention
