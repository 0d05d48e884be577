"""Fused attention for `Tensor.scaled_dot_product_attention` (tensor_nn.py): the decision and the autograd Function.

`fused_attention_refusal` decides, in one place, whether an SDPA call runs as one fused kernel (Ops.ATTENTION,
codegen/attention.py) or as today's composite graph; DEBUG>=3 prints "attention: fused" or "attention: composite
because ...". The fused kernel runs where the device's renderer has it (`has_fused_attention`: CUDA sm_80+, PYTHON
with EMULATE=CUDA), training included (FUSED_ATTENTION=1, the default, or 2; 0: never), for q (B, H, L, D)
or (B, L, D), k and v (B, Hk, S, D) with Hk dividing H (grouped-query attention), D a multiple of 16 up to 128,
float16/bfloat16, or float32 where TF32 is allowed (`set_float32_matmul_precision("high")`); no attn_mask tensor, no
dropout.

`FusedAttention` is its autograd Function: forward is the kernel (O in the operands' dtype, no cast after it, and
the float32 logsumexp of each query row kept for the backward).
Its backward is `fused_backward`: the flash backward kernels as two lazy ops (Ops.ATTENTION_DQ writes
dq and delta = rowsum(dO * O), Ops.ATTENTION_DKDV dk and dv; codegen/attention_grad.py), reading the operands as the
forward did and O and LSE from the forward's buffer, writing the gradients in the operands' dtype. Where
`fused_backward_refusal` says no (FUSED_ATTENTION_BACKWARD=0, or shared memory over the device's limit) it is
`attention_backward`: the composite math recomputed from the logsumexp, summed in float32: P = exp(S * scale - LSE),
dV = P^T dO, dP = dO V^T, dS = P * (dP - rowsum(dO * O)), dQ = dS K * scale, dK = dS^T Q * scale; with 16-bit operands
P and dS are rounded to the operand type before their products, as flash kernels do.

Where the fused kernel refuses and no operand needs a gradient (inference: a prefill, an evaluation), the composite
graph is built straight on lazy buffers (`composite_attention`, `composite_attention_refusal`): the same lazy ops the
Tensor methods build (the products, the scale, the mask, the softmax), without a Tensor, an autograd node and the
argument checks for each of its ~20 steps (a SmolLM2 prefill block's attention: ~17,700 -> ~8,000 bytecodes).
Grouped-query attention folds the query heads that share a key head into the rows of one product per key head
((..., Hk, group * L, D) @ (..., Hk, D, S)): each key is read once, where the Tensor path repeats k and v per head.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ourgrad.codegen.attention import OPERAND_DTYPES
from ourgrad.codegen.attention_backward_plan import AttentionBackwardPlan
from ourgrad.codegen.attention_grad import single_pass_backward
from ourgrad.device import Device
from ourgrad.dtype import DType, dtypes
from ourgrad import function as F
from ourgrad.function import Function, Matmul, _tensor_class
from ourgrad.function_movement import Permute, Reshape, Shrink
from ourgrad.helpers import DEBUG, FUSED_ATTENTION, FUSED_ATTENTION_BACKWARD, FUSED_ATTENTION_PACKED, tf32_allowed
from ourgrad.lazy import LazyBuffer
from ourgrad.lazy_views import place_through_view, tiles_one_base
from ourgrad.ops import Ops
from ourgrad.tensor_reduce import _softmax_lazy
from ourgrad.shape.symbolic import is_symbolic

if TYPE_CHECKING:
  from ourgrad.tensor import Tensor

# head sizes the kernel takes: whole mma k steps (16), registers for Q and O fragments up to 128
HEAD_DIM_MULTIPLE, MAX_HEAD_DIM = 16, 128


def fused_attention_refusal(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float,
                            enable_gqa: bool) -> str | None:
  """None when this scaled_dot_product_attention runs as the fused kernel, else why not (the module docstring)."""
  if not FUSED_ATTENTION: return "FUSED_ATTENTION=0"
  if not isinstance(q.device, str) or not q.device == k.device == v.device:
    return f"q, k, v on {q.device}, {k.device}, {v.device} (sharded or apart)"
  renderer = Device[q.device].renderer
  if not getattr(renderer, "has_fused_attention", False): return f"{q.device} has no fused attention kernel"
  if attn_mask is not None: return "an attn_mask tensor is given"
  if dropout_p > 0.0: return f"dropout_p={dropout_p}"
  if not q.ndim == k.ndim == v.ndim or q.ndim not in (3, 4): return f"q, k, v have {q.ndim}, {k.ndim}, {v.ndim} dims"
  if any(is_symbolic(size) for size in (*q.shape, *k.shape, *v.shape)): return "a symbolic size"
  if not q.dtype == k.dtype == v.dtype: return f"q, k, v are {q.dtype.name}, {k.dtype.name}, {v.dtype.name}"
  if q.dtype not in OPERAND_DTYPES: return f"{q.dtype.name} operands"
  if q.dtype == dtypes.float32 and not tf32_allowed(): return "float32 at matmul precision 'highest' (no TF32)"
  head_dim = q.shape[-1]
  if head_dim % HEAD_DIM_MULTIPLE or head_dim > MAX_HEAD_DIM or v.shape[-1] != head_dim:
    return f"head size {head_dim} (values {v.shape[-1]}): the kernel takes equal sizes, multiples of 16 up to 128"
  if q.shape[0] != k.shape[0] or k.shape[0] != v.shape[0]: return "batch sizes differ (broadcast)"
  if q.ndim == 4 and (q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1] or
                      (k.shape[1] != q.shape[1] and not enable_gqa)):
    return f"heads q {q.shape[1]}, k {k.shape[1]}, v {v.shape[1]}"
  if q.ndim == 3 and k.shape[0] != q.shape[0]: return "batch sizes differ"
  if 0 in (*q.shape, *k.shape): return "an empty operand"
  return None


def fused_attention(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float) -> Tensor:
  """The fused kernel's O for operands `fused_attention_refusal` accepted: (B, [H,] L, D) like q. Where q, k and v
  are views of one tensor that they tile (`packed_source`: GPT-2's split of its c_attn output), the Function takes
  that tensor, and the backward kernels write its gradient whole, in its layout (no concatenation of three)."""
  if q.ndim == 3: return fused_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), is_causal, scale).squeeze(1)
  source = packed_source(q, k, v)
  if source is not None:
    return PackedFusedAttention.apply(source, views=(q.lazydata, k.lazydata, v.lazydata), causal=is_causal,
                                      scale=scale)
  return FusedAttention.apply(q, k, v, causal=is_causal, scale=scale)


# the autograd Functions a view is made by (as q, k, v are made from a fused projection's output)
VIEW_FUNCTIONS = (Reshape, Permute, Shrink)


def packed_source(q: Tensor, k: Tensor, v: Tensor) -> Tensor | None:
  """The tensor that q, k and v (B, H, L, D) are views of (through reshapes, permutes and slices recorded by autograd)
  whose lazy value is the base they read and which they tile exactly (`lazy_views.tiles_one_base`), when it
  needs a gradient and the fused backward kernels will run; else None. The attention is then a Function of that
  tensor: `loss.gradient(q)` of a q used only by it finds no path (the gradients of leaves and of that tensor are
  whole)."""
  base = q.lazydata.base
  if not FUSED_ATTENTION_PACKED or not (k.lazydata.base is base and v.lazydata.base is base): return None
  sources = [_view_source(tensor, base) for tensor in (q, k, v)]
  if sources[0] is None or any(source is not sources[0] for source in sources) or not sources[0].requires_grad:
    return None
  if fused_backward_refusal(q.lazydata, k.lazydata) is not None: return None
  return sources[0] if tiles_one_base(q.lazydata, k.lazydata, v.lazydata) else None


def _view_source(tensor: Tensor, base: LazyBuffer) -> Tensor | None:
  """The tensor whose lazy value is `base` that `tensor` was made from by view Functions alone, else None."""
  while tensor.lazydata is not base:
    ctx = tensor._ctx
    if not isinstance(ctx, VIEW_FUNCTIONS): return None
    tensor = ctx.parents[0]
  return tensor


def explain_attention(refusal: str | None) -> None:
  if DEBUG >= 3: print("attention: fused" if refusal is None else f"attention: composite because {refusal}")


# ---------------------------------------------------------------- the composite graph on lazy buffers (no gradient)

def composite_attention_refusal(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float,
                                enable_gqa: bool) -> str | None:
  """None when this (unfused) scaled_dot_product_attention builds its graph on lazy buffers (`composite_attention`),
  else why not: an operand that needs a gradient (the Tensor ops record the autograd graph), dropout, operands on
  several devices or of another dtype than float32/float64 (half precision computes its softmax in float32 and
  stores the scores in their own dtype: the Tensor path's rules), symbolic or empty sizes, or leading dims that
  differ between q, k and v (broadcast batches), or a mask that would grow the scores."""
  Tensor = _tensor_class()   # noqa: N806 (the class)
  operands = (q, k, v) if attn_mask is None else (q, k, v, attn_mask)
  if not Tensor.no_grad and any(operand.requires_grad for operand in operands): return "an operand needs a gradient"
  if dropout_p > 0.0: return f"dropout_p={dropout_p}"
  lazies = [operand._lazydata for operand in operands]
  if any(type(lazy) is not LazyBuffer for lazy in lazies) or len({lazy.device for lazy in lazies}) != 1:
    return "operands on several devices"
  if not q.dtype == k.dtype == v.dtype or q.dtype not in (dtypes.float32, dtypes.float64):
    return f"q, k, v are {q.dtype.name}, {k.dtype.name}, {v.dtype.name}"
  if not all(type(size) is int and size > 0 for lazy in lazies for size in lazy.shape):
    return "a symbolic or empty size"
  if not q.ndim == k.ndim == v.ndim: return "q, k, v of different ranks"
  lead = q.ndim - (2 if q.ndim == 2 else 3)   # the dims before (heads,) L, D: equal in q, k and v
  if not q.shape[:lead] == k.shape[:lead] == v.shape[:lead] or k.shape[:-1] != v.shape[:-1]:
    return "leading dims of q, k, v differ (a broadcast batch)"
  if q.ndim > 2 and q.shape[-3] != k.shape[-3] and (not enable_gqa or q.shape[-3] % k.shape[-3]):
    return f"q's {q.shape[-3]} heads against k's {k.shape[-3]} (a broadcast, or no grouped-query attention)"
  if attn_mask is not None:
    if attn_mask.dtype != dtypes.bool and attn_mask.dtype != q.dtype: return f"a {attn_mask.dtype.name} attn_mask"
    scores = (*q.shape[:-1], k.shape[-2])
    if attn_mask.ndim > len(scores) or any(size not in (1, full) for size, full in
                                           zip(attn_mask.shape[::-1], scores[::-1])):
      return f"an attn_mask of shape {attn_mask.shape} for scores {scores}"
  return None


def composite_attention(q: LazyBuffer, k: LazyBuffer, v: LazyBuffer, mask: LazyBuffer | None, causal: bool,
                        scale: float) -> LazyBuffer:
  """softmax(q k^T * scale, masked) v for operands `composite_attention_refusal` accepted, q (..., [H,] L, D), k and
  v (..., [Hk,] S, D/Dv), as the lazy graph of the Tensor path: the product's graph (Matmul's), the scale, the mask
  (a bool `mask` keeps where True, a float one is added; `causal` keeps key j for query i where j <= i), the softmax
  (a bool or float mask: rows with no key left give 0, as `_masked_softmax`), the second product. The query heads
  sharing a key head are folded into its product's rows (module docstring)."""
  length, source = q.shape[-2], k.shape[-2]
  group = q.shape[-3] // k.shape[-3] if len(q.shape) > 2 else 1
  batch = k.shape[:-2]   # (..., Hk)
  rows = q if group == 1 else q.reshape((*batch, group * length, q.shape[-1]))
  rank = len(k.shape)
  swap = (*range(rank - 2), rank - 1, rank - 2)
  scores = _product(rows, k.permute(swap), (*batch, group * length, source, q.shape[-1]))
  scores = scores.elementwise(Ops.MUL, scores.operand_like(scale))
  # the mask and the softmax in the scores' shape per query head: (..., Hk, group, L, S) where heads are folded
  shape = (*batch, length, source) if group == 1 else (*batch, group, length, source)
  scores = scores.reshape(shape)
  if causal:
    Tensor = _tensor_class()   # noqa: N806 (the class)
    rows_at = Tensor.arange(length, device=q.device).reshape(length, 1)
    mask = (Tensor.arange(source, device=q.device).reshape(1, source) <= rows_at).lazydata
  if mask is not None:
    # the mask broadcast to the per-head scores (..., H, L, S), then viewed with the heads split as the rows are
    full = (*q.shape[:-1], source)
    mask = F._broadcast_to(mask, full).reshape(shape)
    if mask.dtype == dtypes.bool: scores = mask.elementwise(Ops.WHERE, scores, scores.operand_like(-math.inf))
    else: scores = scores.elementwise(Ops.ADD, mask)
  axis = len(shape) - 1
  weights = _softmax_lazy(scores, (axis,)) if mask is None or causal else _masked_softmax_lazy(scores, axis)
  weights = weights.reshape((*batch, group * length, source))
  out = _product(weights, v, (*batch, group * length, v.shape[-1], source))
  return out.reshape((*q.shape[:-1], v.shape[-1]))


def _product(x: LazyBuffer, y: LazyBuffer, shape: tuple[int, ...]) -> LazyBuffer:
  """x @ y of one dtype as Tensor.matmul builds it (Matmul's forward: the broadcast product summed over its last axis
  of `shape`), without the autograd node (`Function.apply` makes the instance the same way: no __init__)."""
  return Matmul.forward(object.__new__(Matmul), x, y, shape)


def _masked_softmax_lazy(scores: LazyBuffer, axis: int) -> LazyBuffer:
  """`_masked_softmax` (tensor_nn.py) on lazy buffers, the same values: the softmax over `axis`, a row whose every
  score is -inf (masked out) giving 0. Two maximums do what its two compare-and-selects do, one op each: the row's
  maximum at least the lowest float (a masked row's exps are then exp(-inf) = 0), its sum at least the smallest normal
  float (a masked row's 0 divides to 0). Any other row is unchanged: its maximum is one of its finite scores, and its
  sum at least the exp(0) = 1 of that maximum."""
  finfo = np.finfo(scores.dtype.name)   # (float32 or float64: composite_attention_refusal)
  peak = scores.reduce(Ops.MAX_REDUCE, (axis,))
  peak = peak.elementwise(Ops.MAX, peak.operand_like(float(finfo.min)))
  exps = F._exp(F._sub(scores, peak.expand(scores.shape)))
  total = exps.reduce(Ops.SUM, (axis,))
  total = total.elementwise(Ops.MAX, total.operand_like(float(finfo.tiny)))
  return F._div(exps, total.expand(scores.shape))


def split_attention_output(flat: LazyBuffer, shape: tuple[int, int, int, int]) -> tuple[LazyBuffer, LazyBuffer]:
  """(O as a (B, H, L, D) view in the operands' dtype, the float32 logsumexp as (B, H, L)) of an attention kernel's
  output buffer (O, then the logsumexp's bytes: LazyBuffer.attention)."""
  batch, heads, length, head_dim = shape
  o_elements, rows = batch * length * heads * head_dim, batch * heads * length
  out = flat.shrink(((0, o_elements),)).reshape((batch, length, heads, head_dim)).permute((0, 2, 1, 3))
  tail = flat.shrink(((o_elements, flat.shape[0]),))
  lse = tail if flat.dtype == dtypes.float32 else _float32_from_halves(tail, rows)
  return out, lse.reshape((batch, heads, length))


def _float32_from_halves(halves: LazyBuffer, count: int) -> LazyBuffer:
  """`count` float32 values whose bytes are the 2 * count 16-bit elements of `halves` (little-endian: the low half
  first), as (count,) float32; elementwise (a bitcast cannot change the element size)."""
  bits = halves.cast(dtypes.uint16, bitcast=True).cast(dtypes.uint32).reshape((count, 2))
  low, high = bits.shrink(((0, count), (0, 1))), bits.shrink(((0, count), (1, 2)))
  word = low.elementwise(Ops.OR, high.elementwise(Ops.SHL, high.const_like(16)))
  return word.cast(dtypes.float32, bitcast=True).reshape((count,))


class FusedAttention(Function):
  """softmax(q k^T * scale (+ causal mask)) v as one kernel (LazyBuffer.attention); backward: two flash backward
  kernels (`fused_backward`) where `fused_backward_refusal` allows, else attention_backward's composite math."""

  def forward(self, q: LazyBuffer, k: LazyBuffer, v: LazyBuffer, causal: bool, scale: float) -> LazyBuffer:
    self.q, self.k, self.v, self.causal, self.scale = q, k, v, causal, scale
    self.flat = q.attention(k, v, causal, scale)
    self.operands = self.flat.srcs   # q, k, v as its kernel reads them (in place, or made contiguous once)
    self.out, self.lse = split_attention_output(self.flat, q.shape)
    return self.out

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, ...]:
    refusal = fused_backward_refusal(self.q, self.k)
    if DEBUG >= 3: print("attention backward: fused" if refusal is None else f"attention backward: composite because "
                         f"{refusal}")
    if refusal is None:
      grads = fused_backward(self.operands, self.flat, grad_output, self.causal, self.scale)
      return tuple(grad if needed else None for grad, needed in zip(grads, self.needs_input_grad))
    Tensor = _tensor_class()   # noqa: N806 (the class)
    with Tensor.no_grad_context():
      wrap = [Tensor(value, device=self.device) for value in (self.q, self.k, self.v, self.out, self.lse, grad_output)]
      grads = attention_backward(*wrap, causal=self.causal, scale=self.scale)
    return tuple(grad.lazydata if needed else None for grad, needed in zip(grads, self.needs_input_grad))


class PackedFusedAttention(FusedAttention):
  """FusedAttention of q, k, v that tile one tensor x (`packed_source`), as a Function of x: its backward is x's
  gradient, the buffer the two backward kernels write dq, dk and dv into through q, k and v's views."""

  def forward(self, x: LazyBuffer, views: tuple[LazyBuffer, LazyBuffer, LazyBuffer], causal: bool,  # type: ignore
              scale: float) -> LazyBuffer:
    self.source_shape = x.shape
    return super().forward(*views, causal, scale)

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer:  # type: ignore[override]
    if fused_backward_refusal(self.q, self.k) is None and tiles_one_base(*self.operands):
      q = self.operands[0]
      single_pass = single_pass_backward(q.dtype.name, q.shape[3], getattr(Device[q.device].renderer, "has_wgmma",
                                                                           False))
      packed, _ = q.attention_grads(self.operands[1], self.operands[2], self.flat, grad_output, self.causal,
                                    self.scale, packed=True, single_pass=single_pass)
      return packed.shrink(((0, math.prod(self.source_shape)),)).reshape(self.source_shape)
    # the kernels refused since the forward (FUSED_ATTENTION_BACKWARD changed): each gradient placed where its view
    # lies in x, zeros elsewhere, summed
    self.needs_input_grad = [True, True, True]
    grads = super().backward(grad_output)
    total = None
    for grad, view in zip(grads, (self.q, self.k, self.v)):
      placed = place_through_view(grad, view.st, self.source_shape)[0]
      total = placed if total is None else total.elementwise(Ops.ADD, placed)
    return total


def fused_backward_refusal(q: LazyBuffer, k: LazyBuffer) -> str | None:
  """None when the backward of a fused attention of these operands runs as the flash backward kernels, else why not
  (FUSED_ATTENTION_BACKWARD=0, or their shared memory is over the device's limit)."""
  if not FUSED_ATTENTION_BACKWARD: return "FUSED_ATTENTION_BACKWARD=0"
  batch, heads, length, head_dim = q.shape
  plan = AttentionBackwardPlan.contiguous(batch, heads, k.shape[1], length, k.shape[2], head_dim, q.dtype.name, False)
  limit = Device[q.device].renderer.dynamic_local_memory_bytes
  if not plan.fits(limit): return f"its kernels need {plan.dkdv_shared_bytes} B of shared memory, over {limit}"
  return None


def fused_backward(operands: tuple[LazyBuffer, ...], flat: LazyBuffer, grad_output: LazyBuffer, causal: bool,
                   scale: float) -> tuple[LazyBuffer, LazyBuffer, LazyBuffer]:
  """(dq, dk, dv) of the fused attention of `operands` (q, k, v as the forward's kernel read them) whose forward
  wrote `flat` (Ops.ATTENTION), in the operands' dtype: views of the dQ and dK/dV kernels' outputs
  (LazyBuffer.attention_grads)."""
  q, k, v = operands
  batch, heads, length, head_dim = q.shape
  single_pass = single_pass_backward(q.dtype.name, head_dim, getattr(Device[q.device].renderer, "has_wgmma", False))
  dq_buffer, dkdv_buffer = q.attention_grads(k, v, flat, grad_output, causal, scale, single_pass=single_pass)
  kv_shape = k.shape
  q_elements, kv_elements = batch * heads * length * head_dim, math.prod(kv_shape)
  if dkdv_buffer.arg[3]:   # the single pass: dq, dk, dv at the start of one buffer
    return (dkdv_buffer.shrink(((0, q_elements),)).reshape(q.shape),
            dkdv_buffer.shrink(((q_elements, q_elements + kv_elements),)).reshape(kv_shape),
            dkdv_buffer.shrink(((q_elements + kv_elements, q_elements + 2 * kv_elements),)).reshape(kv_shape))
  return (dq_buffer.shrink(((0, q_elements),)).reshape(q.shape),
          dkdv_buffer.shrink(((0, kv_elements),)).reshape(kv_shape),
          dkdv_buffer.shrink(((kv_elements, 2 * kv_elements),)).reshape(kv_shape))


def attention_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor, causal: bool,
                       scale: float) -> tuple[Tensor, Tensor, Tensor]:
  """(dq, dk, dv) of the fused attention, in the operands' dtypes: q (B, H, L, D), k and v (B, Hk, S, D), out the
  forward's O (in their dtype, (B, H, L, D)), lse its natural-log logsumexp (float32, (B, H, L)), grad_out dO like O.
  The composite math in float32 (module docstring): the fallback of `fused_backward`."""
  batch, heads, length, _ = q.shape
  kv_heads, source = k.shape[1], k.shape[2]
  group = heads // kv_heads
  q32, k32, v32 = (x.cast(dtypes.float32) for x in (q, k, v))
  if group > 1: k32, v32 = _repeat_kv(k32, group), _repeat_kv(v32, group)
  grad32, out = grad_out.cast(dtypes.float32), out.cast(dtypes.float32)
  scores = q32.matmul(k32.transpose(-2, -1)) * scale
  if causal:
    rows = type(q).arange(length, device=q.device).reshape(length, 1)
    keep = type(q).arange(source, device=q.device).reshape(1, source) <= rows
    scores = keep.where(scores, -float("inf"))
  # P and dS are stored (in the operand type), as the composite graph's softmax output is: each feeds two products,
  # which then read plain buffers on tensor cores instead of recomputing them inside their loops
  weights = _operand((scores - lse.unsqueeze(-1)).exp(), q.dtype)
  grad_v = weights.transpose(-2, -1).matmul(grad32)
  grad_weights = grad32.matmul(v32.transpose(-2, -1))
  row_dot = (grad32 * out).sum(-1, keepdim=True)
  grad_scores = _operand(weights * (grad_weights - row_dot), q.dtype)
  grad_q = grad_scores.matmul(k32) * scale
  grad_k = grad_scores.transpose(-2, -1).matmul(q32) * scale
  if group > 1: grad_k, grad_v = _sum_groups(grad_k, group), _sum_groups(grad_v, group)
  return grad_q.cast(q.dtype), grad_k.cast(k.dtype), grad_v.cast(v.dtype)


def _operand(x: Tensor, dtype: DType) -> Tensor:
  """A (B, H, L, S) float32 matmul operand stored in a buffer of its own in the operand type (16-bit: rounded as flash
  kernels round P and dS; the products read 16-bit values on 16-bit tensor cores and sum in float32)."""
  return x.contiguous() if dtype == dtypes.float32 else x.cast(dtype).contiguous().cast(dtypes.float32)


def _repeat_kv(x: Tensor, group: int) -> Tensor:
  """(B, Hk, S, D) -> (B, Hk * group, S, D), query head h reading kv head h // group."""
  batch, kv_heads, source, head_dim = x.shape
  return x.unsqueeze(2).expand(batch, kv_heads, group, source, head_dim).reshape(batch, kv_heads * group, source,
                                                                                head_dim)


def _sum_groups(x: Tensor, group: int) -> Tensor:
  """(B, Hk * group, S, D) -> (B, Hk, S, D): the gradients of the query heads sharing each kv head, summed."""
  batch, heads, source, head_dim = x.shape
  return x.reshape(batch, heads // group, group, source, head_dim).sum(2)

