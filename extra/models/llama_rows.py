"""Row kernels of a decode step (extra/models/llama.py): graphs laid out so that the scheduler puts a normalization's
or a softmax's reduces in the loop shape of the product that reads them, one kernel where a plain form is several, and
the on-device argmax of a step's logits. Built for few rows (one query per sequence); a prefill's many rows keep the
plain forms (tiled matmuls).
"""
from __future__ import annotations

import math

from ourgrad import Tensor, dtypes
from ourgrad.helpers import env_var
from ourgrad.nn.gguf import PackedTensor


def inverse_rms_per_output(x: Tensor, outputs: int, eps: float, row_layout: tuple[int, ...] | None = None) -> Tensor:
  """inverse_rms(x) broadcast to (..., `outputs`), its mean of squares computed in the loop shape of a product
  x @ W.T with `outputs` columns ((rows, outputs, k), reduced over k): the product's kernel then holds both reduces
  over the same rows (a row kernel) and recomputes the scale beside each output, where a scale of shape (..., 1)
  is a kernel of its own. For one short row of x (a decode step); with many rows it would turn a tiled matmul into
  a row kernel. `row_layout`: the product's k in blocks (a packed weight's `PackedTensor.row_blocks`), so that both
  reduces share its loop shape and axes."""
  flat = x.reshape(-1, x.shape[-1])
  squares = flat.unsqueeze(-2).expand(flat.shape[0], outputs, flat.shape[1]).square()
  if row_layout is not None: squares = squares.reshape(flat.shape[0], outputs, *row_layout)
  return (squares.mean(tuple(range(2, squares.ndim))) + eps).rsqrt().reshape(*x.shape[:-1], outputs)


def softmax_weighted_sum(scores: Tensor, values: Tensor, valid: Tensor | None = None) -> Tensor:
  """softmax(scores) @ values for scores (..., m, n) and values (..., n, d), with the softmax's max and sum computed
  in the product's loop shape (..., m, d, n): the product's kernel holds all three reduces over the same rows (a
  row kernel: max, then the sums of e = exp(s - max) and of e * v), recomputing max and sum beside each of the d
  outputs, where a plain softmax is two kernels of its own before the product. For few rows (one query).
  `valid` (bool, broadcastable to (..., m, n)): the scores where it is False are -inf (left out), applied in the row
  kernel itself (on the scores it would be the scores kernel's output): a `valid` that is a mask of a bound Variable
  (the slots in use) lets the row kernel's rounds end there (codegen/bounded_loops.py `row_end`)."""
  rows = scores.unsqueeze(-2).expand(*scores.shape[:-1], values.shape[-1], scores.shape[-1])  # (..., m, d, n)
  if valid is not None: rows = valid.unsqueeze(-2).where(rows, -math.inf)
  exps = (rows - rows.max(-1, keepdim=True)).exp()
  weighted = (exps * values.transpose(-1, -2).unsqueeze(-3)).sum(-1)
  return (weighted / exps.sum(-1)).contiguous()   # stored by this kernel: a reader's kernel would refuse its reduces


# decode attention over the whole cache (fixed shapes) in this many chunks of slots (`split_softmax_weighted_sum`),
# where the scores are computed inside the row kernel (ELEMENT_REDUCES); 0: one row kernel over all slots
ATTENTION_CHUNKS = env_var("ATTENTION_CHUNKS", 0, "a GPU decode step's attention over the cache in this many chunks "
                           "of slots, each a block's scores and partial softmax x V, combined by a second small kernel "
                           "(with ELEMENT_REDUCES=1; extra/models/llama_rows.py split_softmax_weighted_sum); "
                           "0: unsplit")


def split_softmax_weighted_sum(scores: Tensor, values: Tensor, chunks: int) -> Tensor:
  """softmax(scores) @ values as `softmax_weighted_sum`, for scores (..., m, n) and values (..., n, d), with the n
  slots split into `chunks` pieces (a divisor of n), as flash-decoding does: each piece's rows (..., m, chunk, d)
  reduce over n / chunks slots only (its max, sum of exp and weighted sum: one row kernel whose blocks each read a
  piece of the cache, not all of it), storing the piece's normalized weighted sum and its log-sum-exp; then the
  pieces are combined by their softmax weights (`softmax_weighted_sum` over the pieces' log-sum-exps). A piece
  whose scores are all -inf (the cache's unwritten tail under the mask) has log-sum-exp -inf and weight 0."""
  *lead, m, n = scores.shape
  d, length = values.shape[-1], n // chunks
  # one more column holds each piece's log-sum-exp beside its d outputs; 8 (whole 32-byte rows) keep the rows of a
  # piece a multiple of 8, so that blocks share a piece's staged scores (d + 1 = 65 left 3 rows a block)
  extra = 8
  pieces = scores.reshape(*lead, m, chunks, length)
  rows = pieces.unsqueeze(-2).expand(*lead, m, chunks, d + extra, length)            # (..., m, chunks, d + 8, length)
  # the values widened to d + 8 columns by a view (the extra columns repeat the first ones; their sums are not read):
  # a pad would make the scheduler store the values (a masked read of the cache-write's `where`)
  wide = values.unsqueeze(-2).expand(*values.shape[:-1], 2, d).reshape(*values.shape[:-1], 2 * d)[..., :d + extra]
  wide = wide.reshape(*lead, 1, chunks, length, d + extra)
  # the shift is the max, but finite where a piece is all -inf: exp(-inf - shift) = 0 there, never NaN
  shift = rows.max(-1, keepdim=True).maximum(-3.0e38)
  exps = (rows - shift).exp()
  weighted = (exps * wide.transpose(-1, -2)).sum(-1)
  shift = shift.squeeze(-1)
  lse = shift + exps.sum(-1).log()
  # weighted / sum as weighted * exp(shift - lse): the sum read once (the scheduler keeps each reduce to one reader);
  # lse.maximum(shift): a sum of 0 (an all -inf piece, weighted 0) divides by 1
  last = Tensor.arange(d + extra, device=scores.device) == d
  parts = last.where(lse, weighted * (shift - lse.maximum(shift)).exp()).contiguous()  # (..., m, chunks, d + 8)
  return softmax_weighted_sum(parts[..., d].unsqueeze(-2), parts[..., :d]).reshape(*lead, m, d)


def row_layout(weight: Tensor | PackedTensor) -> tuple[int, ...] | None:
  """How a decode step's product with `weight` lays out k (`LlamaBlock._linear(blocked=True)`): a packed weight's
  blocks (`PackedTensor.row_blocks`), else None (one axis)."""
  return weight.row_blocks if isinstance(weight, PackedTensor) else None

def ordered_bits(x: Tensor) -> Tensor:
  """float32 values as int32 whose signed order is the floats' order (NaN aside): a negative float's magnitude bits
  flipped, so that a more negative float is a smaller integer. -0.0 is -1, just below +0.0's 0."""
  bits = x.cast(dtypes.float32).bitcast(dtypes.int32)
  return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def packed_argmax(logits: Tensor, countdown: Tensor) -> Tensor:
  """The first index of each row's max of `logits` (..., n), int32, as one max reduce over a 64-bit key per element:
  the value's `ordered_bits` in the high half, `countdown` (n,) (n - index, a realized table: an arange would be a
  kernel of its own in every step) in the low half, so the largest key is the largest value at its first index. A
  max, then a max of the indices reaching it, were two reduces each read of the whole row (two split reduces on a GPU,
  four kernels for a vocabulary; this is two). NaN logits are not looked for, as Tensor.argmax does."""
  length = logits.shape[-1]
  key = ordered_bits(logits).cast(dtypes.int64) * (1 << 32) + countdown.reshape(length).cast(dtypes.int64)
  best = key.max(-1)
  low = best - (best >> 32) * (1 << 32)   # the countdown: the key's low 32 bits (its high half is floor(key / 2^32))
  return (length - low).cast(dtypes.int32)
