"""Transformer blocks with torch.nn's names and state-dict keys: TransformerEncoderLayer and TransformerEncoder.

A layer is self-attention (ourgrad/nn/attention.py's MultiheadAttention) and a two-layer feed-forward network, each
with a residual connection and a LayerNorm, after the block (PyTorch's default) or before it (`norm_first`). The
submodules carry PyTorch's names (self_attn, linear1, linear2, norm1, norm2), so a torch state_dict loads.
"""
from __future__ import annotations

from typing import Callable

from ourgrad.nn.attention import MultiheadAttention
from ourgrad.nn.layers import Dropout, LayerNorm, Linear
from ourgrad.nn.module import Module, ModuleList
from ourgrad.tensor import Tensor

__all__ = ["TransformerEncoderLayer", "TransformerEncoder"]

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {"relu": Tensor.relu, "gelu": Tensor.gelu}


class TransformerEncoderLayer(Module):
  """Self-attention and a feed-forward block, like torch.nn.TransformerEncoderLayer(d_model, nhead,
  dim_feedforward=2048, dropout=0.1, activation="relu", layer_norm_eps=1e-5, batch_first=False, norm_first=False,
  bias=True). `activation` is "relu", "gelu" (exact) or a function of a Tensor. forward(src, src_mask=None,
  src_key_padding_mask=None, is_causal=False): masks as MultiheadAttention takes them (bool True = do not attend,
  float = added). Dropout acts while the module is training."""

  def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
               activation: str | Callable[[Tensor], Tensor] = "relu", layer_norm_eps: float = 1e-5,
               batch_first: bool = False, norm_first: bool = False, bias: bool = True):
    if isinstance(activation, str) and activation not in _ACTIVATIONS:
      raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)} or a function, got {activation!r}")
    self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias, batch_first=batch_first)
    self.linear1 = Linear(d_model, dim_feedforward, bias=bias)
    self.dropout = Dropout(dropout)
    self.linear2 = Linear(dim_feedforward, d_model, bias=bias)
    self.norm_first = norm_first
    self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
    self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias)
    self.dropout1, self.dropout2 = Dropout(dropout), Dropout(dropout)
    self.activation = _ACTIVATIONS[activation] if isinstance(activation, str) else activation
    self.batch_first = batch_first

  def _self_attention(self, x: Tensor, mask: Tensor | None, padding: Tensor | None, is_causal: bool) -> Tensor:
    out, _ = self.self_attn(x, x, x, key_padding_mask=padding, need_weights=False, attn_mask=mask,
                            is_causal=is_causal)
    return self.dropout1(out)

  def _feed_forward(self, x: Tensor) -> Tensor:
    return self.dropout2(self.linear2(self.dropout(self.activation(self.linear1(x)))))

  def forward(self, src: Tensor, src_mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
              is_causal: bool = False) -> Tensor:
    x = src
    if self.norm_first:
      x = x + self._self_attention(self.norm1(x), src_mask, src_key_padding_mask, is_causal)
      return x + self._feed_forward(self.norm2(x))
    x = self.norm1(x + self._self_attention(x, src_mask, src_key_padding_mask, is_causal))
    return self.norm2(x + self._feed_forward(x))


class TransformerEncoder(Module):
  """A stack of `num_layers` copies of `encoder_layer` (each starting with its weights, as PyTorch deep-copies it)
  and an optional final `norm`, like torch.nn.TransformerEncoder; state-dict keys layers.{i}.... and norm....
  forward(src, mask=None, src_key_padding_mask=None, is_causal=False)."""

  def __init__(self, encoder_layer: TransformerEncoderLayer, num_layers: int, norm: Module | None = None):
    self.layers = ModuleList([encoder_layer] + [_copy_of(encoder_layer) for _ in range(num_layers - 1)])
    self.num_layers, self.norm = num_layers, norm

  def forward(self, src: Tensor, mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
              is_causal: bool = False) -> Tensor:
    x = src
    for layer in self.layers: x = layer(x, mask, src_key_padding_mask, is_causal)
    return x if self.norm is None else self.norm(x)


def _copy_of(layer: TransformerEncoderLayer) -> TransformerEncoderLayer:
  """A new layer of the same settings holding copies of `layer`'s weights (copy.deepcopy cannot copy lazy tensors)."""
  attention = layer.self_attn
  copy = TransformerEncoderLayer(attention.embed_dim, attention.num_heads, layer.linear1.out_features,
                                 layer.dropout.p, layer.activation, layer.norm1.eps, layer.batch_first,
                                 layer.norm_first, layer.linear1.bias is not None)
  copy.load_state_dict({name: Tensor(value.numpy(), requires_grad=value.requires_grad)
                        for name, value in layer.state_dict().items()})
  return copy
