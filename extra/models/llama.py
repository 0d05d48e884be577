"""A LLaMA-style decoder (SmolLM2, LLaMA 2/3, TinyLlama ...) loaded from a llama.cpp GGUF file.

    model = Llama.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", max_context=1024)
    logits = model(Tensor([[1, 2, 3]], dtype=dtypes.int32), start=0)   # (1, vocab) for the last position

The model: token embedding, `n_layers` blocks of pre-norm (RMSNorm) grouped-query attention with rotary position
embeddings and a SwiGLU feed-forward, a final RMSNorm and the output projection (the embedding itself when the file
has no `output.weight`: tied embeddings).

RoPE layout. llama.cpp's converter permutes the rows of every Q and K projection so that each head's rotation pairs
are adjacent dims (2i, 2i+1), where Hugging Face checkpoints pair dim i with dim i + head_dim/2 ("rotate_half").
Weights read from GGUF are used as stored, so this file rotates interleaved pairs: for pair i of a head at position
p, angle = p * base^(-2i/head_dim), (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos). `rope_rows_to_halves` undoes the
permutation for comparisons with a rotate_half implementation.

KV cache. Each block keeps K and V for `max_context` positions in realized buffers (zeros at first). A prompt at
positions [start, start + L) writes its K and V there (a `where` over the cache with host-made write marks, each
slot taking its row by an indexed read, so no kernel depends on `start`) and attends to the first A cache slots
under a causal mask computed on the device from each row's position. The rotary angles, the marks, the placement
and the positions are small host-made inputs.

Prompts (`model(tokens, start, jit=...)`). With `jit=True` the prompt is padded to a multiple of PREFILL_BUCKET
tokens and A rounded up likewise: every prompt of a bucket, whatever its length and start, replays one TinyJit
capture (fixed-shape kernels, all optimized; a symbolic length would make the matmuls plain loop nests, docs/jit.md).
Without it the graph has the prompt's exact shape and is scheduled on each call.

Decoding (`model.decode(token, position)`). One token's step runs through a TinyJit: captured on its second call,
replayed (no graph building, scheduling or compiling) on every later one, whatever the position. With
`symbolic=True` (the default) the position is a bound Variable and attention reads only `cache[:, :position + 1]`;
with `symbolic=False` it reads the whole cache under the mask, so every kernel has a fixed shape (the optimizer
handles them all and a CUDA graph replays the step as one launch). On a GPU the norms' scales and the softmax are
recomputed inside the row kernels of the products that read them (`inverse_rms_per_output`, `softmax_weighted_sum`):
7 kernels per block (docs/models.md). `Llama(..., sequences=N)`: N conversations, a cache row each, prefilled one
at a time (`sequence=i`) and decoded together (a token and a position per sequence).
"""
from __future__ import annotations

import math
import os
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from ourgrad import Tensor, TinyJit, dtypes
from ourgrad.device import Device, PendingRead
from ourgrad.helpers import ELEMENT_REDUCES, INTEGER_PRODUCTS
from ourgrad.errors import ShapeError
from ourgrad.nn.gguf import INTEGER_PRODUCT_TYPES, PackedTensor, gguf_load
from ourgrad.shape import Variable
from ourgrad.shape.symbolic import Node

from extra.models.llama_rows import (ATTENTION_CHUNKS, inverse_rms_per_output, packed_argmax, row_layout,
                                     softmax_weighted_sum, split_softmax_weighted_sum)
from extra.models.shape_jits import ShapeJits


PREFILL_CAPTURES = 4  # prompt shapes whose jitted prefill is kept (each holds its kernels' buffers)
PREFILL_BUCKET = 64  # a jitted prefill pads the prompt to a multiple of this many tokens (one capture per bucket)
# an eager prefill realizes its residual stream after every this many blocks: the device runs them while Python builds
# the next ones (bench_eager.py's prefill row; Llama._prefill_graph)
PREFILL_REALIZE_EVERY = int(os.environ.get("PREFILL_REALIZE_EVERY", "2"))
# a decode step's graph realizes its residual stream after every this many blocks (0: never), as it is built: the
# blocks after the first then replay its cached schedule, so the step's eager first call and its capture each schedule
# one block, not all (SmolLM2 on the 2-core CPU: 2.2 -> 0.8 s of CPU before the first replay). The residual is stored
# between blocks anyway (the down projection's kernel adds it in its epilogue): the kernels are the same
DECODE_REALIZE_EVERY = int(os.environ.get("DECODE_REALIZE_EVERY", "1"))


@dataclass(frozen=True)
class LlamaConfig:
  dim: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  hidden_dim: int
  vocab_size: int
  norm_eps: float = 1e-5
  rope_theta: float = 10000.0
  context_length: int = 2048

  @property
  def head_dim(self) -> int: return self.dim // self.n_heads

  @staticmethod
  def from_gguf_metadata(metadata: dict[str, Any]) -> "LlamaConfig":
    arch = metadata.get("general.architecture", "llama")
    if arch != "llama": raise ValueError(f"general.architecture is {arch!r}: only 'llama' models are supported")

    def key(name: str, default: Any = None) -> Any:
      if f"llama.{name}" in metadata: return metadata[f"llama.{name}"]
      if default is None: raise ValueError(f"GGUF metadata lacks llama.{name}")
      return default
    n_heads = key("attention.head_count")
    return LlamaConfig(dim=key("embedding_length"), n_layers=key("block_count"), n_heads=n_heads,
                       n_kv_heads=key("attention.head_count_kv", n_heads), hidden_dim=key("feed_forward_length"),
                       vocab_size=key("vocab_size", len(metadata.get("tokenizer.ggml.tokens", [])) or None),
                       norm_eps=key("attention.layer_norm_rms_epsilon", 1e-5),
                       rope_theta=key("rope.freq_base", 10000.0), context_length=key("context_length", 2048))


WEIGHT_DTYPES = ("stored", "float32", "float16", "bfloat16")  # `Llama.from_gguf(dtype=...)`


def as_tensor(weight: Tensor | PackedTensor) -> Tensor:
  """A weight as a Tensor: a packed one as its lazy dequantization (fused into the kernels that read it)."""
  return weight.dequantize() if isinstance(weight, PackedTensor) else weight


def cast_weights(weights: dict[str, Tensor], dtype: Any) -> dict[str, Tensor]:
  """The state dict with every matrix (2-D and more) cast to `dtype` and 1-D tensors (norm weights) to float32,
  realized on their device: one pass, so a quantized file is dequantized once, straight to `dtype`."""
  cast = {name: as_tensor(tensor).cast(dtype if tensor.ndim >= 2 else dtypes.float32).contiguous()
          for name, tensor in weights.items()}
  Tensor.realize_all(*cast.values())
  return cast


def inverse_rms(x: Tensor, eps: float) -> Tensor:
  """1 / sqrt(mean(x^2) + eps) over the last axis (kept, size 1)."""
  return x.inverse_rms(-1, eps)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
  """x / sqrt(mean(x^2) + eps) * weight over the last axis."""
  return x * inverse_rms(x, eps) * weight



def rope_angles(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
  """cos and sin of the rotary angles (len(positions), head_dim // 2), float32, computed in float64 on the host."""
  inverse_frequencies = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  angles = np.outer(positions.astype(np.float64), inverse_frequencies)
  return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rope_rows_to_halves(weight: np.ndarray, heads: int) -> np.ndarray:
  """Undo llama.cpp's Q/K row permutation: rows of each head go from interleaved-pair order back to the
  rotate_half order of Hugging Face checkpoints (row 2i -> i, row 2i+1 -> i + head_dim/2)."""
  rows, columns = weight.shape
  head_dim = rows // heads
  return weight.reshape(heads, head_dim // 2, 2, columns).transpose(0, 2, 1, 3).reshape(rows, columns)


def rope_inputs(positions: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
  """(cos, signed sin), each (len(positions), head_dim): every angle twice (for both dims of its pair), the sine
  negative at the pair's first dim, so that `rotate_pairs` is two products and a sum."""
  cos, sin = rope_angles(positions, head_dim, theta)
  signs = np.tile(np.array([-1.0, 1.0], np.float32), head_dim // 2)
  return np.repeat(cos, 2, axis=1), np.repeat(sin, 2, axis=1) * signs


def rotate_pairs(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
  """RoPE on interleaved pairs of the last axis (head_dim): (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos), as
  x * cos + (x with each pair swapped) * signed_sin (`rope_inputs`). The swap is a view: it fuses into the consumer."""
  head_dim = x.shape[-1]
  swapped = x.reshape(*x.shape[:-1], head_dim // 2, 2).flip(-1).reshape(x.shape)
  return x * cos + swapped * signed_sin


# a GPU decode step's slots in use (the `used` Variable) are bound in steps of this many slots (Llama.used_granule)
USED_GRANULE = 32


class LlamaBlock:
  """One decoder block: attention (with its KV cache) and a SwiGLU feed-forward, each pre-normed and residual.

  For fewer, larger kernels the weights are rearranged once at construction (same math):
  - each RMSNorm weight is multiplied into the columns of the matrices it feeds, so a block computes
    (x @ W.T) * rsqrt(mean(x^2) + eps) and never stores the normalised x;
  - Q, K and V are one (dim + kv + kv, dim) matrix: one matmul, after which RoPE is elementwise (`rotate_pairs`);
  - K and V share one cache buffer (sequences, max_context, 2 * kv_heads, head_dim): one write per step, which also
    rotates K (decode: `_project`);
  - the gate and up projections are one (2 * hidden, dim) matrix: one matmul, split after it."""

  def __init__(self, config: LlamaConfig, weights: dict[str, Tensor], prefix: str, max_context: int,
               packed: bool = False, batch: int = 1):
    self.config = config
    attn_norm, ffn_norm = weights[f"{prefix}.attn_norm.weight"], weights[f"{prefix}.ffn_norm.weight"]
    wq, wk = weights[f"{prefix}.attn_q.weight"], weights[f"{prefix}.attn_k.weight"]
    projections = [wq, wk, weights[f"{prefix}.attn_v.weight"]]
    gate_up = [weights[f"{prefix}.ffn_gate.weight"], weights[f"{prefix}.ffn_up.weight"]]

    def merged(matrices: list[Any], norm: Tensor) -> Tensor | PackedTensor:
      """The matrices stacked by rows: realized in the weights' dtype with the norm weight folded into their
      columns, or (packed weights) their blocks stacked, the norm applied in the product's kernel (`_linear`)."""
      if packed and all(isinstance(m, PackedTensor) for m in matrices):
        try:
          return PackedTensor.cat(matrices)
        except ShapeError:
          pass  # mixed quantization types: stacked as float32 values
      if packed: return Tensor.cat([as_tensor(m) for m in matrices], dim=0).contiguous().realize()
      return (Tensor.cat(matrices, dim=0) * norm).cast(wq.dtype).contiguous().realize()
    self.w_qkv, self.w_gate_up = merged(projections, attn_norm), merged(gate_up, ffn_norm)
    self.wo, self.w_down = weights[f"{prefix}.attn_output.weight"], weights[f"{prefix}.ffn_down.weight"]
    # packed weights: the norm weights scale the stacked products' columns in their kernels (folded in above otherwise)
    self.attn_norm, self.ffn_norm = (attn_norm, ffn_norm) if packed else (None, None)
    cache_shape = (batch, max_context, 2 * config.n_kv_heads, config.head_dim)  # one row per sequence
    self.cache = Tensor.zeros(*cache_shape, device=wq.device).contiguous().realize()
    # (1, 1, heads + 2 kv_heads, 1): True at the V heads of the fused projection (RoPE leaves them as they are)
    value_heads = np.arange(config.n_heads + 2 * config.n_kv_heads) >= config.n_heads + config.n_kv_heads
    self.value_heads = Tensor(value_heads.reshape(1, 1, -1, 1), device=wq.device).realize()
    self.value_pairs = self.value_heads.reshape(1, 1, -1, 1, 1)   # (a prefill's RoPE in the pairs' shape)
    # decode: recompute the norms' scales and the softmax's max and sum beside each output of the kernels reading them
    # (`inverse_rms_per_output`, `softmax_weighted_sum`) where thread blocks run those rows side by side, their inputs
    # on chip, and a launch costs more than the repeated work (a GPU). A CPU thread would repeat it serially (the
    # softmax's exp 64 times over) to save a launch that costs about a function call: separate kernels there.
    self.recompute_rows = Device[wq.device].renderer.runs_thread_blocks

  @staticmethod
  def _linear(x: Tensor, weight: Tensor | PackedTensor, norm: Tensor | None = None, blocked: bool = False) -> Tensor:
    """x @ (weight * norm).T, the norm weight (packed weights) scaling the dequantized columns inside the product's
    kernel (on the input it would be a kernel of its own). A packed weight's dequantization is built afresh for each
    graph: a lazy tensor kept between calls would be stored as float32 by the first kernel that realizes it (a
    prefill) and then read as float32 by every later one. `blocked`: a packed weight's product block by block
    (`PackedTensor.linear`: its bytes read side by side), for the matrix-vector products of a decode step; a
    prefill's matrix product keeps the (n, k) values, which the scheduler stores once for the tiled matmul."""
    if blocked and isinstance(weight, PackedTensor):
      # a CPU: x quantized to 8-bit blocks and integer dot products per block, as llama.cpp (INTEGER_PRODUCTS)
      integer = weight.ggml_type in INTEGER_PRODUCT_TYPES and not Device[weight.device].renderer.runs_thread_blocks
      if norm is None and integer and INTEGER_PRODUCTS.value: return weight.integer_linear(x)
      return weight.linear(x, norm)
    return x.linear(as_tensor(weight) if norm is None else as_tensor(weight) * norm)

  def _inverse_rms(self, x: Tensor) -> Tensor: return inverse_rms(x, self.config.norm_eps)

  def _normed(self, x: Tensor, norm: Tensor | None) -> Tensor:
    """rms_norm(x) times the norm weight (packed weights; else it is folded into the matrix), stored: one row kernel
    for a CPU decode step, whose products then read each normalized value once per output row as a plain load (fused
    into a product the norm and its weight were two loads and two multiplies more per weight, in a kernel whose
    speed is its arithmetic)."""
    normed = x * self._inverse_rms(x)
    return (normed if norm is None else normed * norm).contiguous()

  def _project_prefill(self, x: Tensor, cos: Tensor, sin: Tensor, write: Tensor, placement: Tensor | int) -> Tensor:
    """q (1, heads, B, hd) of x (1, B, dim), rotated (cos and sin broadcast to the projection's pairs (1, B, heads +
    2 kv, hd / 2, 2)), after writing the rotated K and the V of its rows to the cache where `write` (1, max_context,
    1, 1), broadcast to the cache's shape, is True. `placement`: a host-made int32 (max_context,) index, cache slot p
    taking row placement[p] (p - start where written), an indexed read, so no kernel depends on the start position (a
    jitted prefill); or the start itself (an eager call, whose kernels are built for its prompt anyway): the rows
    padded to the cache's slots, a view.
    RoPE runs on all Q, K and V heads of the projection at once (V heads selected back unrotated by a constant
    mask): one kernel makes the rotated rows that the attention (Q) and the cache write (K, V) read. It runs in the
    pairs' shape, (x0, x1) -> (x0 cos - x1 sin, x1 cos + x0 sin) as x * cos + flip(x) * signed sin (`rope_inputs`'
    tables, `rotate_pairs`' formula, one view fewer)."""
    config = self.config
    batch, length, _ = x.shape
    heads, head_dim = config.n_heads, config.head_dim
    projected = self._linear(x, self.w_qkv, self.attn_norm) * self._inverse_rms(x)
    # RoPE in the pairs' shape (1, B, heads + 2 kv, hd / 2, 2) (cos and sin given in it): the swap is one flip
    pairs = projected.reshape(batch, length, heads + 2 * config.n_kv_heads, head_dim // 2, 2)
    rotated = self.value_pairs.where(pairs, pairs * cos + pairs.flip(-1) * sin).contiguous()
    rotated = rotated.reshape(batch, length, heads + 2 * config.n_kv_heads, head_dim)
    # each slot's row of the rotated projection, its K and V heads (those after the query's) in the cache's shape
    kv_heads = (heads, heads + 2 * config.n_kv_heads)
    if isinstance(placement, int):
      slots = self.cache.shape[1]
      rows = rotated.shrink(((0, 1), (0, length), kv_heads, (0, head_dim)))
      rows = rows.pad(((0, 0), (placement, slots - placement - length), (0, 0), (0, 0)))
    else:
      flat = rotated.reshape(length, -1)[placement]
      rows = flat.shrink(((0, flat.shape[0]), (heads * head_dim, flat.shape[1]))).reshape(1, *self.cache.shape[1:])
    self.cache.assign(write.where(rows, self.cache))
    # the query heads, heads first (1, heads, B, hd): plain views, a shrink and a permute
    return rotated.shrink(((0, 1), (0, length), (0, heads), (0, head_dim))).permute(0, 2, 1, 3)

  def _project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q (S, 1, heads, hd) rotated, the stored K and V projection (S, 1, 2 * kv_heads, hd), cos and sin (S, 1, 1,
    hd)) of one token per sequence x (S, 1, dim), cos/sin (S, hd). The new cache rows are made from them in the
    cache's shape (`_new_rows`)."""
    config = self.config
    batch, length, _ = x.shape
    heads, head_dim = config.n_heads, config.head_dim
    # stored (two kernels read it), as float32 (a bfloat16 product's values, widened): the rotations read it per slot
    # (K, V) and per score (q) as a plain load, where a cast would make q's rotation too costly to recompute
    if self.recompute_rows:
      product = self._linear(x, self.w_qkv, self.attn_norm, blocked=True)
      product = product * inverse_rms_per_output(x, product.shape[-1], config.norm_eps, row_layout(self.w_qkv))
    else:
      product = self._linear(self._normed(x, self.attn_norm), self.w_qkv, blocked=True)
    projected = product.cast(dtypes.float32).contiguous()
    projected = projected.reshape(batch, length, -1, head_dim)
    cos, sin = cos.reshape(batch, length, 1, head_dim), sin.reshape(batch, length, 1, head_dim)  # one row per sequence
    q = rotate_pairs(projected[:, :, :heads], cos, sin)
    return q, projected[:, :, heads:], cos, sin

  def _new_rows(self, projected: Tensor, cos: Tensor, sin: Tensor, heads: slice) -> Tensor:
    """The cache's `heads` (a slice of its 2 * kv_heads: K then V) as one token's projection `projected` (S, 1,
    2 * kv_heads, hd) makes them, computed in the cache's shape (broadcast over the slots): K rotated (RoPE), V as
    it is (`value_heads`, a constant mask, where the range holds both). RoPE on the stored projection broadcast over
    the slots, so the kernel reading the rows rotates K itself (rotating the (S, 1, kv, hd) K first and broadcasting
    the result would store it: an elementwise graph read once per slot is not recomputed)."""
    kv_heads = self.config.n_kv_heads
    shape = (*self.cache.shape[:2], len(range(2 * kv_heads)[heads]), self.cache.shape[3])
    new = projected[:, :, heads].expand(shape)
    if heads.start is not None and heads.start >= kv_heads: return new   # V heads only
    rotated = rotate_pairs(new, cos.expand(shape), sin.expand(shape))
    if heads.stop is not None and heads.stop <= kv_heads: return rotated   # K heads only
    return self.value_heads[:, :, self.config.n_heads:].where(new, rotated)

  def _feed_forward(self, x: Tensor, attended: Tensor) -> Tensor:
    """The residual after attention (`attended` (1, L, dim) before the output projection), then the SwiGLU half."""
    one_token = x.shape[1] == 1
    one_token_gpu = one_token and self.recompute_rows
    x = x + self._linear(attended, self.wo, blocked=one_token)
    # one token on a GPU: the norm's scale recomputed inside the product's kernel (the scaled product stored for the
    # down projection); one token on a CPU: the normalized row stored first (`_normed`); else one scale per row (a
    # kernel of its own), applied on the down projection's loads
    if one_token and not self.recompute_rows:
      product = self._linear(self._normed(x, self.ffn_norm), self.w_gate_up, blocked=True)
    else:
      product = self._linear(x, self.w_gate_up, self.ffn_norm, one_token)
    if one_token_gpu:
      scale = inverse_rms_per_output(x, product.shape[-1], self.config.norm_eps, row_layout(self.w_gate_up))
      product = (product * scale).contiguous()
    elif not one_token:
      product = product * self._inverse_rms(x)
    # the gate and up halves (two shrinks: chunk's generic steps cost more)
    half, whole = product.shape[-1] // 2, tuple((0, size) for size in product.shape[:-1])
    gate, up = product.shrink((*whole, (0, half))), product.shrink((*whole, (half, 2 * half)))
    hidden = gate.silu() * up
    # several rows: the SwiGLU product in a buffer of its own. Fused into the down projection's loads it was
    # recomputed (exp2, rsqrt) for every output column tile: 66% of the H100 prefill (707 us of a ~50 us matmul)
    # One token on a CPU: stored too. The scheduler fuses math on reduce results as a per-row value (free in a row
    # kernel), but here the down projection reads each element once per output row: exp2 and a division 576 times
    # over (a third of a CPU decode step's time, measured with Q4_1 weights). Several sequences on a GPU: stored too.
    # Recomputed for 8 sequences the down projection was 144 blocks of 4 rows each (ncu on the H200: 26.7 us, the
    # gate/up product beside it 10.1 us for twice the weights); stored, it is a plain thin product of 576 blocks and
    # the SwiGLU a small kernel of its own
    if x.shape[1] > 1 or x.shape[0] > 1 or not self.recompute_rows: hidden = hidden.contiguous()
    return x + self._linear(hidden, self.w_down, blocked=one_token)

  def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, write: Tensor, placement: Tensor | int, visible: Tensor,
               sequence: Tensor) -> Tensor:
    """x (1, B, dim) of a prompt padded to B tokens; cos/sin from `rope_inputs`, broadcast to the projection's pairs
    (1, B, heads + 2 kv, hd / 2, 2); `visible` (1, heads, B, A) bool: which of the first A cache slots each row
    attends to; `sequence` (1,) int32: the cache row of this prompt (`write` marks slots of that row only). `placement`:
    `_project_prefill`'s. Grouped-query attention (`enable_gqa`): without a gradient to record,
    scaled_dot_product_attention folds the query heads that share a KV head into the rows of one matmul per KV head,
    (1, kv, group * B, hd) @ (1, kv, hd, A), keys read once, and builds its graph on lazy buffers
    (tensor_attention.py)."""
    config = self.config
    batch, length, _ = x.shape
    kv_heads = config.n_kv_heads
    attended_slots = visible.shape[-1]
    q = self._project_prefill(x, cos, sin, write, placement)  # (1, heads, B, hd)
    # read after the write (one kernel writes the cache, none copies it); several sequences: the prompt's row, an
    # indexed read of a host-made index, so one capture serves every row
    cache = self.cache if self.cache.shape[0] == 1 else self.cache[sequence]
    # the K and V heads of the first A slots, heads first (1, kv, A, hd) each: plain views of the cache
    heads_first = cache.permute(0, 2, 1, 3)
    keys = heads_first.shrink(((0, 1), (0, kv_heads), (0, attended_slots), (0, config.head_dim)))
    values = heads_first.shrink(((0, 1), (kv_heads, 2 * kv_heads), (0, attended_slots), (0, config.head_dim)))
    attended = q.scaled_dot_product_attention(keys, values, attn_mask=visible, enable_gqa=True)  # (1, heads, B, hd)
    return self._feed_forward(x, attended.permute(0, 2, 1, 3).reshape(batch, length, config.dim))

  def decode(self, x: Tensor, cos: Tensor, sin: Tensor, write: Tensor, visible: int | Node,
             mask: Tensor | None, used: Node | None = None) -> Tensor:
    """One token of each sequence x (S, 1, dim): its K and V go to its cache row where `write` (S, max_context, 1, 1)
    is True, and it attends to the first `visible` cached positions (a bound Variable `position + 1`, or the whole
    cache with an additive `mask` (S, max_context) hiding each row's unwritten tail). `used` (a bound Variable, with
    the whole cache: at least every row's position + 1): the cache is read as shrunk to the slots in use and padded
    back, a fixed shape whose mask ends the products' reduce loops there (codegen/bounded_loops.py). Grouped-query
    attention by folding the query heads that share a KV head into one axis: the keys are read once per KV head."""
    config = self.config
    kv_heads, head_dim = config.n_kv_heads, config.head_dim
    group = config.n_heads // kv_heads
    q, projected, cos, sin = self._project(x, cos, sin)
    keys_heads, values_heads = slice(0, kv_heads), slice(kv_heads, 2 * kv_heads)
    if self.recompute_rows:
      # a GPU: attention reads the cache as this step's write leaves it, the new rows recomputed where `write` marks
      # them, so it does not wait for the write: nothing later in the step reads the cache, and the write kernels of
      # every block (independent, elementwise) share packed launches at the step's end (engine/packing.py), one kernel a
      # block less. The old cache is read before the assign (a lazy value keeps what it held when it was made)
      keys = write.where(self._new_rows(projected, cos, sin, keys_heads), self.cache[:, :, keys_heads])
      values = write.where(self._new_rows(projected, cos, sin, values_heads), self.cache[:, :, values_heads])
    self.cache.assign(write.where(self._new_rows(projected, cos, sin, slice(None)), self.cache))
    if not self.recompute_rows: keys, values = self.cache[:, :, keys_heads], self.cache[:, :, values_heads]
    # shrink, not indexing: Python slices cannot hold a symbolic bound
    sequences = x.shape[0]
    keys, values = keys.shrink((None, (0, visible), None, None)), values.shrink((None, (0, visible), None, None))
    # (S, kv, group, hd); a symbolic row length is no row kernel's: there (and on a CPU) the plain softmax, two kernels
    fused = isinstance(visible, int) and self.recompute_rows
    if used is not None and not fused:   # zeros past the slots in use (read as the mask's 0s, not loaded): the shape
      # stays fixed. (The GPU's fused path masks the scores instead: a pad of the cache-write's `where` would be stored)
      unused = (None, (0, self.cache.shape[1] - used), None, None)
      keys = keys.shrink((None, (0, used), None, None)).pad(unused)
      values = values.shrink((None, (0, used), None, None)).pad(unused)
    keys, values = keys.permute(0, 2, 3, 1), values.permute(0, 2, 1, 3)  # (S, kv, hd, visible), (S, kv, visible, hd)
    scores = q.reshape(sequences, kv_heads, group, head_dim) @ keys * (1.0 / math.sqrt(head_dim))  # (S, kv, g, vis)
    if mask is not None: scores = scores + mask.reshape(sequences, 1, 1, -1)
    chunks = int(ATTENTION_CHUNKS.value)
    if fused and ELEMENT_REDUCES.value and chunks > 1 and visible % chunks == 0:
      attended = split_softmax_weighted_sum(scores, values, chunks)
    elif fused:
      # the slots past those in use left out by a mask of the Variable (not by the host-made mask's values): the
      # softmax's terms there are then provably nothing, so the row kernel's rounds end at `used` (bounded_loops.py)
      inside = None if used is None else \
        Tensor.ones(used, dtype=dtypes.bool, device=scores.device).pad(((0, self.cache.shape[1] - used),))
      attended = softmax_weighted_sum(scores, values, inside)
    else: attended = scores.softmax(-1) @ values
    return self._feed_forward(x, attended.reshape(sequences, 1, config.dim))


class Llama:
  """The decoder with its KV caches; `model(tokens, start)` -> logits (1, vocab) of the last position, float32.
  `sequences` > 1: that many conversations share the weights, each with its own cache row, prefilled one at a time
  (`model(tokens, start, sequence=i)`) and decoded together (`decode` with a token and a position per sequence)."""

  def __init__(self, config: LlamaConfig, weights: dict[str, Tensor], max_context: int = 1024,
               symbolic: bool = True, packed: bool = False, sequences: int = 1):
    if sequences < 1: raise ValueError(f"sequences must be at least 1, got {sequences}")
    self.config, self.max_context, self.packed, self.sequences = config, max_context, packed, sequences
    self.embedding = weights["token_embd.weight"]  # a Tensor or a PackedTensor (embed() reads its rows)
    self.output = weights.get("output.weight", self.embedding)  # tied embeddings when the file has no head
    self.norm = weights["output_norm.weight"]
    self.blocks = [LlamaBlock(config, weights, f"blk.{n}", max_context, packed, sequences)
                   for n in range(config.n_layers)]
    self.device = self.embedding.device
    self.symbolic = symbolic
    self.position = Variable("position", 0, max_context - 1)
    # fixed shapes: the slots in use (every sequence's position + 1 at most), bound at each step so that attention's
    # loops end there (`LlamaBlock.decode`: a host's reduce loops, a GPU's row rounds, codegen/bounded_loops.py)
    self.used = Variable("used", 1, max_context)
    self.bounded_reads = not symbolic
    # a GPU's bound is rounded up to USED_GRANULE slots: a new value is a driver call per attention kernel of the
    # step's CUDA graph (GraphReplay.set_var_vals), so it changes every USED_GRANULE steps, not at every one; the
    # slots between the position and the bound are masked as before. A host's loops end at the position itself.
    self.used_granule = USED_GRANULE if self.blocks[0].recompute_rows else 1
    self.slots = Tensor(np.arange(max_context, dtype=np.int32), device=self.device).realize()  # cache slot numbers
    vocab = self.output.shape[0]
    self.countdown = Tensor(np.arange(vocab, 0, -1, dtype=np.int32), device=self.device).realize()  # vocab - index
    # every position's rope angles, gathered by the decode steps' positions on the device (`_step_graph`)
    cos, sin = rope_inputs(np.arange(max_context), config.head_dim, config.rope_theta)
    self.rope_cos, self.rope_sin = (Tensor(table, device=self.device).realize() for table in (cos, sin))
    self._decode_jit = TinyJit(self._step_graph)
    self._greedy_jit = TinyJit(self._greedy_graph)   # the same step ending in the argmax (`decode_greedy`)
    self._resident_jit = TinyJit(self._resident_graph)   # greedy steps fed back on the device (`generate_greedy`)
    self._resident: dict[str, Tensor] | None = None   # its state buffers, made on first use
    self._step_buffer: Tensor | None = None   # the decode step's host-made input (`_step_inputs`)
    self._step_host = np.zeros((sequences, 2), np.int32)   # its host side: each sequence's token and position
    self._step_bytes = memoryview(self._step_host).cast("B")   # the same memory as copyin takes it
    self._prefill_jits = ShapeJits(self._prefill_graph, PREFILL_CAPTURES)  # keyed by prefill_shape

  @staticmethod
  def from_gguf(path: str | os.PathLike, max_context: int = 1024, device: str | None = None,
                symbolic: bool = True, dtype: str = "stored", sequences: int = 1) -> tuple["Llama", dict[str, Any]]:
    """The model from a GGUF file and the file's metadata. `dtype` (one of WEIGHT_DTYPES) is how the weight
    matrices are kept on the device: "stored" as the file stores them (block-quantized tensors packed, dequantized
    inside the kernels that read them: `gguf_load(packed=True)`), or dequantized once to "float32", "float16" or
    "bfloat16" (`cast_weights`). Norm weights and activations are float32 either way. `sequences`: conversations
    decoded together (`Llama`)."""
    if dtype not in WEIGHT_DTYPES:
      raise ValueError(f"weight dtype {dtype!r} is not one of {', '.join(WEIGHT_DTYPES)}")
    packed = dtype == "stored"
    tensors, metadata = gguf_load(path, device or Device.DEFAULT, packed=packed)
    config = LlamaConfig.from_gguf_metadata(metadata)
    weights = tensors if packed else cast_weights(tensors, getattr(dtypes, dtype))
    return Llama(config, weights, min(max_context, config.context_length), symbolic, packed, sequences), metadata

  def embed(self, tokens: Tensor) -> Tensor:
    """The embedding rows of `tokens` (an int32 tensor) as float32: only those rows are read (and dequantized, when
    packed). Activations are float32 whatever the weights' dtype: bfloat16 rows would make the first block's norm and
    products bfloat16 math (its RMS summed in bfloat16, its QKV product rounded to it)."""
    if isinstance(self.embedding, PackedTensor): return self.embedding.take_rows(tokens).cast(dtypes.float32)
    return self.embedding[tokens].cast(dtypes.float32)

  def reset(self) -> None:
    """Forget the cached keys and values (a new conversation). Positions already written are masked anyway when
    a call starts before them, so this only matters to free the old values."""
    for block in self.blocks: block.cache.assign(Tensor.zeros_like(block.cache)).realize()

  def prefill_shape(self, start: int, length: int) -> tuple[int, int]:
    """(padded tokens B, attended cache slots A) of a jitted prefill of `length` tokens at `start`: both rounded up
    to a multiple of PREFILL_BUCKET (A at most the context), so that prompts of many lengths and starts share one
    capture (fixed-shape kernels that the optimizer handles), at the cost of at most PREFILL_BUCKET - 1 padded
    tokens."""
    def rounded(n: int) -> int: return -(-n // PREFILL_BUCKET) * PREFILL_BUCKET
    return rounded(length), min(rounded(start + length), self.max_context)

  def _position_inputs(self, start: int, length: int, padded: int, sequence: int = 0) -> dict[str, Tensor]:
    """Host-made inputs of a prompt of `length` tokens at [start, start + length), padded to `padded` rows: rope
    cos/sin of each row's position, the cache-write marks (in cache row `sequence` only), the row each cache slot
    takes (`placement`), each row's position (the causal mask is computed from it on the device), the index of the
    last real row and the cache row."""
    positions = np.arange(start, start + padded)
    cos, sin = rope_inputs(positions, self.config.head_dim, self.config.rope_theta)
    slots = np.arange(self.max_context)
    write = np.zeros((self.sequences, self.max_context, 1, 1), bool)
    write[sequence, :, 0, 0] = (slots >= start) & (slots < start + length)
    placement = np.clip(slots - start, 0, padded - 1).astype(np.int32)
    host = {"cos": cos, "sin": sin, "write": write, "placement": placement, "positions": positions.astype(np.int32),
            "last": np.array([length - 1], np.int32), "sequence": np.array([sequence], np.int32)}
    return {name: Tensor(value, device=self.device) for name, value in host.items()}

  def _eager_inputs(self, start: int, length: int, sequence: int) -> dict[str, Tensor | int]:
    """`_position_inputs` of an eager call as views of what the model holds, nothing made on the host or uploaded:
    its graph is built for this prompt's shape anyway, so the start may be a constant of its kernels. cos and sin are
    rows of the decode steps' rope tables (`rope_inputs` of every position: the same values), the write marks a True
    constant padded to the prompt's slots of cache row `sequence`, the positions, the last row's index and the cache
    row's views of the slot numbers (the last row and the cache row read by indexed reads, as a jitted call reads
    them: views there change the kernels' fusion, and the bits: the final norm fused with the last block's sums); the
    placement is the start, an int."""
    end = start + length
    cos, sin = (table.shrink(((start, end), (0, table.shape[1]))) for table in (self.rope_cos, self.rope_sin))
    marks = Tensor.ones(1, length, 1, 1, dtype=dtypes.bool, device=self.device)
    write = marks.pad(((sequence, self.sequences - sequence - 1), (start, self.max_context - end), (0, 0), (0, 0)))
    def slots(first: int, stop: int) -> Tensor: return self.slots.shrink(((first, stop),))
    return {"cos": cos, "sin": sin, "write": write, "placement": start, "positions": slots(start, end),
            "last": slots(length - 1, length), "sequence": slots(sequence, sequence + 1)}

  def __call__(self, tokens: Tensor | np.ndarray | list[list[int]], start: int, jit: bool = False,
               sequence: int = 0) -> Tensor:
    """The logits (1, vocab) of the last of `tokens` (1, L) fed at positions [start, start + L), K and V cached (in
    cache row `sequence`, of the constructor's `sequences`).
    The tokens are host data (a Tensor is read back): a jitted prefill pads them on the host, not in a kernel that
    would compile for every new length.

    `jit`: the prompt is padded to `prefill_shape`'s bucket and runs through the TinyJit kept for that shape (the
    last `PREFILL_CAPTURES` of them): the third prompt of a bucket, whatever its exact length and start, replays the
    captured kernels (no graph building, scheduling or compiling). Without it the graph has the prompt's exact
    shape and is scheduled each call."""
    ids = (tokens.numpy() if isinstance(tokens, Tensor) else np.asarray(tokens)).astype(np.int32)
    if ids.ndim != 2 or ids.shape[0] != 1:
      raise ShapeError(f"Llama runs one sequence at a time (tokens of shape (1, L)), got tokens of shape {ids.shape}")
    length = ids.shape[1]
    if not 0 <= sequence < self.sequences:
      raise ValueError(f"sequence {sequence} is not one of the model's {self.sequences} sequences")
    if start + length > self.max_context:
      raise ValueError(f"positions {start}..{start + length - 1} exceed the context of {self.max_context} tokens")
    padded, attended = self.prefill_shape(start, length) if jit else (length, start + length)
    tokens_t = Tensor(np.pad(ids, ((0, 0), (0, padded - length))), device=self.device)
    if not jit:
      logits = self._prefill_graph(tokens_t, **self._eager_inputs(start, length, sequence), attended=attended,
                                   realize_every=PREFILL_REALIZE_EVERY)
      Tensor.realize_all(logits, *(block.cache for block in self.blocks))
      return logits
    # the first call (eager) and the capture realize the residual every PREFILL_REALIZE_EVERY blocks as an eager call
    # does: the blocks after the first replay its cached schedule (a first prompt: ~1 s less CPU on the 2-core CPU)
    inputs = self._position_inputs(start, length, padded, sequence)
    return self._prefill_jits((padded, attended), tokens_t, *inputs.values(), attended,  # positional: the fast path
                              PREFILL_REALIZE_EVERY)

  def prefill_jit_for(self, start: int, length: int) -> TinyJit:
    """The TinyJit that `model(tokens, start, jit=True)` runs for a prompt of `length` tokens at `start` (profiling)."""
    return self._prefill_jits.jits[self.prefill_shape(start, length)]

  def _prefill_graph(self, tokens: Tensor, cos: Tensor, sin: Tensor, write: Tensor, placement: Tensor | int,
                     positions: Tensor, last: Tensor, sequence: Tensor, attended: int,
                     realize_every: int = 0) -> Tensor:
    """The logits (1, vocab) of row `last` of the (1, B) `tokens` at `positions` (B,), attending to the first
    `attended` slots of cache row `sequence`: slot j is visible to a row at position p when j <= p (the past and
    itself; padded rows see stale slots, harmlessly: their outputs are never read, and every row sees slot 0, so no
    row is all -inf). `realize_every` > 0 (eager calls): the residual stream, and with it the caches written so far,
    is realized after every that many blocks, so the device runs those blocks while Python builds the next ones (the
    residual is stored between blocks anyway: no fusion is lost; blocks of one shape replay one cached schedule)."""
    cos, sin, write, visible = self._block_inputs(cos, sin, write, positions, attended)
    x = self.embed(tokens)
    for index, block in enumerate(self.blocks):
      x = block(x, cos, sin, write, placement, visible, sequence)
      if realize_every > 0 and (index + 1) % realize_every == 0 and index + 1 < len(self.blocks): x.realize()
    return rms_norm(x[0][last], self.norm, self.config.norm_eps).linear(as_tensor(self.output))

  def _block_inputs(self, cos: Tensor, sin: Tensor, write: Tensor, positions: Tensor,
                    attended: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A prefill's inputs of every block (`LlamaBlock.__call__`): the rope tables and the write marks broadcast once
    to the shapes the blocks read them in (the projection's heads' pairs, the cache's K and V heads: the views each
    block's ops would make, without an Expand and a reshape per table in every block), and the visible slots,
    broadcast to the attention's scores per query head (1, heads, B, A)."""
    visible = self.slots.shrink(((0, attended),)).reshape(1, attended) <= positions.reshape(-1, 1)
    visible = visible.reshape(1, 1, *visible.shape).expand(1, self.config.n_heads, *visible.shape)
    heads, head_dim = self.config.n_heads + 2 * self.config.n_kv_heads, self.config.head_dim
    pairs = (cos.shape[0], heads, head_dim // 2, 2)   # (the projection's heads in RoPE's pairs: _project_prefill)
    cos, sin = (table.reshape(1, table.shape[0], 1, head_dim // 2, 2).expand(1, *pairs) for table in (cos, sin))
    return cos, sin, write.expand(*write.shape[:2], 2 * self.config.n_kv_heads, head_dim), visible

  def _step_graph(self, step: Tensor, position: Variable | None) -> Tensor:
    """`_decode_graph` of the host-made step (S, 2) int32: each sequence's token and position, one upload a step.
    `position`: the bound position (symbolic), the bound slots in use (`bounded_reads`), or None."""
    if self.bounded_reads: return self._decode_graph(step[:, :1], step[:, 1], None, position)
    return self._decode_graph(step[:, :1], step[:, 1], position)

  def _decode_graph(self, tokens: Tensor, positions: Tensor, position: Variable | None,
                    used: Variable | None = None) -> Tensor:
    """The logits (S, vocab) of one token per sequence `tokens` (S, 1) at `positions` (S,), both int32 on the
    device: symbolic (`position` a bound Variable, attention over the first position + 1 cache slots) or fixed-shape
    (`position` None, attention over the whole cache with an additive mask hiding each row's unwritten tail). The
    rope angles are gathered from tables and the cache-write marks and the mask compared here, inside the kernels
    that read them: a step's only host input is its tokens and positions (made on the host they were 5 copies and
    ~140 us of numpy a step on the 2-core CPU). Either way the cache write is the `where` of the write marks: a
    kernel of fixed shape that the optimizer handles (a symbolic write mask would make it a plain loop nest).
    `used` (fixed shapes, a bound Variable): the slots in use, where attention's loops end (`LlamaBlock.decode`)."""
    visible: int | Node = self.max_context if position is None else position + 1
    slots, at = self.slots.reshape(1, -1), positions.reshape(-1, 1)
    write = (slots == at).reshape(self.sequences, self.max_context, 1, 1)
    cos, sin = self.rope_cos[positions], self.rope_sin[positions]
    x = self.embed(tokens)
    # -inf past each row's position: one compare and a where, cheap enough to recompute in the kernels that read it
    # (`slots <= at` was a compare and a negation, and the scheduler stored the mask by a kernel of its own)
    mask = (at < slots).where(-math.inf, 0.0) if position is None else None
    for index, block in enumerate(self.blocks):
      x = block.decode(x, cos, sin, write, visible, mask, used)
      # blocks of one shape then replay the first one's cached schedule (engine/schedule_cache.py): a step's first
      # call and its capture schedule one block, not all of them (DECODE_REALIZE_EVERY)
      if DECODE_REALIZE_EVERY > 0 and (index + 1) % DECODE_REALIZE_EVERY == 0 and index + 1 < len(self.blocks):
        x.realize()
    # stored by the last down projection's kernel (its residual add in the epilogue, as in every block): read by the
    # final norm's row kernel, which would otherwise refuse the product's reduce and leave the add a kernel of its own
    x = x.contiguous()[:, -1, :]
    # a GPU, several sequences: the normalized rows stored too. Recomputed beside each logit, every warp re-read all
    # the sequences' x for its vocabulary row (18 KB a row at 8 sequences, 0.9 GB from cache a step: 138 us of a 1 ms
    # H200 step); stored, the product is a thin matmul whose threads each keep several rows' x loads in registers
    if not self.blocks[0].recompute_rows or x.shape[0] > 1:
      return LlamaBlock._linear(rms_norm(x, self.norm, self.config.norm_eps).contiguous(), self.output, blocked=True)
    # a GPU: the final norm's scale recomputed beside each logit (one kernel, not a norm kernel before the product)
    logits = LlamaBlock._linear(x * self.norm, self.output, blocked=True)
    return logits * inverse_rms_per_output(x, logits.shape[-1], self.config.norm_eps, row_layout(self.output))

  def _greedy_graph(self, step: Tensor, position: Variable | None) -> Tensor:
    """The greedy next token (S,) int32 of each sequence: `_step_graph`'s logits reduced to their argmax on the
    device, so a step reads back 4 bytes a sequence instead of its vocab-sized logits."""
    return self._argmax(self._step_graph(step, position))

  def _argmax(self, logits: Tensor) -> Tensor:
    """The first index of each row's max, (S,) int32 (`packed_argmax`)."""
    return packed_argmax(logits, self.countdown)

  def _resident_graph(self, used: Variable | None) -> Tensor:
    """One greedy step fed from and back to device buffers (`generate_greedy`): each sequence's token (S, 1) and
    position (S,) are read from the state (`_decode_graph`); the argmax becomes the next step's token, also kept in
    the history at the position it will be fed at, and the positions advance. No host input, nothing read back."""
    state = self._resident
    assert state is not None
    positions, slots = state["positions"], self.slots.reshape(1, -1)
    at = positions.reshape(-1, 1)
    logits = self._decode_graph(state["tokens"], positions, None, used)
    ids = self._argmax(logits).reshape(-1, 1)
    state["history"].assign((slots == at + 1).where(ids, state["history"]))
    state["tokens"].assign(ids)
    state["positions"].assign(positions + 1)
    return ids

  def generate_greedy(self, token: int | Sequence[int], position: int | Sequence[int], steps: int) -> list[list[int]]:
    """The next `steps` greedy tokens of each sequence after feeding `token` at `position` (ints for one sequence,
    a sequence of S ints for several), as lists of ids. The steps run back to back on the device (fixed shapes
    only): each one's argmax is the next one's token without a round trip through the host (`_resident_graph`, a
    TinyJit of no inputs), the host launches them without waiting, and the ids are read back once at the end.
    Stop tokens are not looked for: a caller that needs them asks for a few steps at a time."""
    positions = self._start_resident("generate_greedy", token, position, steps)
    for step in range(steps): self._resident_jit(self._resident_used(positions, step))
    assert self._resident is not None
    history = self._resident["history"].numpy()
    return [history[row, p + 1:p + 1 + steps].tolist() for row, p in enumerate(positions)]

  def stream_greedy(self, token: int | Sequence[int], position: int | Sequence[int],
                    steps: int) -> Iterator[list[int]]:
    """`generate_greedy`'s steps, each step's ids (one per sequence) given to the caller as it finishes, so that a
    caller can print them or stop at an end token. The host stays one step ahead: step N+1 is queued (its token fed
    back on the device) before step N's ids are read, and the read waits for step N's small copy alone
    (`Buffer.read_later`), so the device never waits for the host's round trip. A caller that stops after step N
    leaves step N+1 computed: its cache write lands past the caller's last position, where a later prompt's write
    replaces it and no step reads it before."""
    positions = self._start_resident("stream_greedy", token, position, steps)
    pending: deque[PendingRead] = deque()
    try:
      for step in range(steps):
        pending.append(self._resident_jit(self._resident_used(positions, step))._buffer().read_later())
        if len(pending) > 1: yield pending.popleft().numpy().tolist()
      while pending: yield pending.popleft().numpy().tolist()
    finally:
      while pending: pending.popleft().numpy()   # a caller that stopped early: its pinned copy slots go back

  def _resident_used(self, positions: list[int], step: int) -> Variable | None:
    """The slots in use at a fed-back run's `step` (`bounded_reads`): the positions advance by one a step, so the host
    knows them without reading the device."""
    return self._bind_used(max(positions) + step + 1, self._resident_jit) if self.bounded_reads else None

  def _bind_used(self, slots: int, jit: TinyJit | None = None) -> Variable:
    """`used` bound to at least `slots` slots (rounded up to `used_granule`, at most the cache). On the first call of
    `jit` (the step that runs it: eager, its next call captures) one slot more, the bound of its next call one position
    on: the capture then finds the first call's schedule in the schedule cache, whose key holds the bound value (with
    another value the capture schedules the whole step again: ~0.6 s of CPU for SmolLM2 on the 2-core CPU)."""
    if jit is not None and jit.call_count == 0: slots += 1
    return self.used.bind(min(-(-slots // self.used_granule) * self.used_granule, self.max_context))

  def _start_resident(self, caller: str, token: int | Sequence[int], position: int | Sequence[int],
                      steps: int) -> list[int]:
    """Check a fed-back run's arguments and load its tokens and positions into the resident state (made on first
    use); returns the positions."""
    if self.symbolic: raise ValueError(f"{caller} runs fixed-shape steps: construct the model symbolic=False")
    tokens = [token] if isinstance(token, int) else [int(t) for t in token]
    positions = [position] if isinstance(position, int) else [int(p) for p in position]
    if len(tokens) != self.sequences or len(positions) != self.sequences:
      raise ShapeError(f"{caller} takes a token and a position for each of the model's {self.sequences} "
                       f"sequences, got {len(tokens)} tokens and {len(positions)} positions")
    if steps < 1 or not all(0 <= p and p + steps <= self.max_context for p in positions):
      raise ValueError(f"{steps} steps from positions {positions} exceed the context of {self.max_context} tokens")
    if self._resident is None:   # the tokens, positions and ids of the steps
      host = {"tokens": np.zeros((self.sequences, 1), np.int32),
              "positions": np.zeros(self.sequences, np.int32),
              "history": np.zeros((self.sequences, self.max_context), np.int32)}
      self._resident = {name: Tensor(value, device=self.device).contiguous().realize() for name, value in host.items()}
    state = self._resident
    state["tokens"].assign(Tensor([[t] for t in tokens], dtype=dtypes.int32, device=self.device)).realize()
    state["positions"].assign(Tensor(positions, dtype=dtypes.int32, device=self.device)).realize()
    return positions

  def decode_greedy(self, token: int | Sequence[int], position: int | Sequence[int], jit: bool = True) -> list[int]:
    """The greedy next token of each sequence after feeding `token` at `position` (as `decode`, whose logits'
    argmax it is, taken on the device): for a caller that only needs ids (greedy generation, a benchmark)."""
    step = self._greedy_jit if jit else self._greedy_graph
    ids = step(*self._step_inputs(token, position, self._greedy_jit if jit else None))
    if not jit: Tensor.realize_all(ids, *(block.cache for block in self.blocks))
    return ids.numpy().tolist()

  def decode(self, token: int | Sequence[int], position: int | Sequence[int], jit: bool = True) -> Tensor:
    """The logits (S, vocab) after feeding one `token` at `position` to each of the S = `sequences` sequences (ints
    for one sequence, sequences of S ints for several; each token's K and V are cached at its position in its row).

    With `jit` the step runs through a TinyJit: the second call captures its kernels and every later one replays
    them, whatever the positions. `symbolic` (the constructor's) makes the position a bound Variable: attention
    reads only `cache[:, :position + 1]` (kernels compiled once for every position; several sequences must then be
    at one position). Without it attention reads the whole cache under a host-made mask per sequence: only
    fixed-shape kernels, which a CUDA graph replays as one launch."""
    step = self._decode_jit if jit else self._step_graph
    logits = step(*self._step_inputs(token, position, self._decode_jit if jit else None))
    if not jit: Tensor.realize_all(logits, *(block.cache for block in self.blocks))
    return logits

  def _step_inputs(self, token: int | Sequence[int], position: int | Sequence[int],
                   jit: TinyJit | None = None) -> tuple:
    """The arguments of a decode step's graph (`_step_graph`) for one `token` at `position` per sequence (checked):
    the (S, 2) int32 tokens and positions on the device, and the bound position (symbolic), the bound slots in use
    (`bounded_reads`, `_bind_used`: `jit` runs the step) or None."""
    tokens = [token] if isinstance(token, int) else [int(t) for t in token]
    positions = [position] if isinstance(position, int) else [int(p) for p in position]
    if len(tokens) != self.sequences or len(positions) != self.sequences:
      raise ShapeError(f"decode takes a token and a position for each of the model's {self.sequences} sequences, "
                       f"got {len(tokens)} tokens and {len(positions)} positions")
    if not all(0 <= p < self.max_context for p in positions):
      raise ValueError(f"positions {positions} exceed the context of {self.max_context} tokens")
    if self.symbolic and len(set(positions)) > 1:
      raise ValueError(f"a symbolic decode attends to one length for all sequences, got positions {positions}: "
                       "construct the model with symbolic=False for sequences at different positions")
    self._step_host[:, 0], self._step_host[:, 1] = tokens, positions
    bound = self.position.bind(positions[0]) if self.symbolic else \
      self._bind_used(max(positions) + 1, jit) if self.bounded_reads else None
    return self._upload_step(), bound

  def _upload_step(self) -> Tensor:
    """The step's host-made input (`_step_host`), copied into the same device buffer at every step: a captured
    step's CUDA graph then keeps its kernels' arguments (a new buffer would make the replay patch every kernel node
    that reads it, one driver call each)."""
    if self._step_buffer is None:
      self._step_buffer = Tensor(self._step_host.copy(), device=self.device).contiguous().realize()
      return self._step_buffer
    buffer = self._step_buffer.lazydata.realized
    assert buffer is not None
    buffer.copyin(self._step_bytes)
    return self._step_buffer
