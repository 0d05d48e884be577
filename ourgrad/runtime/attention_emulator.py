"""The fused attention kernel (codegen/attention.py) emulated with numpy, for the PYTHON device and CI.

It reads q, k and v from their buffers through the plan's offsets and strides (a wrong stride reads wrong elements
here as on the GPU) and follows the kernel's arithmetic tile by tile: operands rounded as the tensor cores take them
(float32 to TF32 as cvt.rna does; float16/bfloat16 as they are), S = Q K^T in float32, scaled by scale * log2(e),
the masks, the running max and sum per row with exp2 (the reference max moved as the kernel's warps vote,
rescale_slack), P rounded to the operand type, O += P V, then O / sum and the logsumexp, stored in the kernel's
layout. Every query row goes through every key tile: a causal tile the kernel skips
is all masked for the rows it would serve, which leaves max, sum and O as they were (rescale 1, P 0), so the results
are the kernel's. Summation order inside one mma may differ from the hardware's in the last bits.
"""
from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from ourgrad.codegen.attention import AttentionPlan, Operand
from ourgrad.codegen.tensor_cores import tf32_round
from ourgrad.dtype import bfloat16_bits_to_float32, float32_to_bfloat16_bits, round_to_bfloat16

ATTENTION_PROGRAM_FORMAT = "ourgrad-python-attention-v1"


def _read_operand(buffer: np.ndarray, operand: Operand, shape: tuple[int, int, int, int], dtype: str) -> np.ndarray:
  """The (B, heads, rows, D) operand as float32, read through its offset and strides from a raw byte buffer."""
  if dtype == "float32": elements = buffer.view(np.float32)
  elif dtype == "float16": elements = buffer.view(np.float16)
  else: elements = buffer.view(np.uint16)
  strided = np.lib.stride_tricks.as_strided(elements[operand.offset:], shape,
                                            tuple(stride * elements.itemsize for stride in operand.strides))
  values = np.array(strided)
  return bfloat16_bits_to_float32(values) if dtype == "bfloat16" else values.astype(np.float32)


def _operand_rounding(values: np.ndarray, dtype: str) -> np.ndarray:
  """float32 values as the mma reads them: TF32 for float32, else the operand type's rounding."""
  if dtype == "float32": return tf32_round(values)
  if dtype == "float16": return values.astype(np.float16).astype(np.float32)
  return round_to_bfloat16(values).astype(np.float32)


def emulate_attention(plan: AttentionPlan, out: np.ndarray, q_buffer: np.ndarray, k_buffer: np.ndarray,
                      v_buffer: np.ndarray) -> None:
  """Run the kernel of `plan` on raw byte buffers: `out` gets O in the operand type (rounded to nearest even) and
  then the float32 logsumexp's bytes; q/k/v are read through the plan's offsets and strides."""
  q = _operand_rounding(_read_operand(q_buffer, plan.q, (plan.batch, plan.heads, plan.length, plan.head_dim),
                                      plan.dtype), plan.dtype)
  kv_shape = (plan.batch, plan.kv_heads, plan.source, plan.head_dim)
  k = _operand_rounding(_read_operand(k_buffer, plan.k, kv_shape, plan.dtype), plan.dtype)
  v = _operand_rounding(_read_operand(v_buffer, plan.v, kv_shape, plan.dtype), plan.dtype)
  k, v = np.repeat(k, plan.group, axis=1), np.repeat(v, plan.group, axis=1)   # query head h reads kv head h // group
  scale_log2 = np.float32(plan.scale * 1.4426950408889634)
  rows = np.arange(plan.length)[:, None]
  shape = (plan.batch, plan.heads, plan.length)
  row_max = np.full(shape, -np.inf, dtype=np.float32)
  row_sum = np.zeros(shape, dtype=np.float32)
  outputs = np.zeros((*shape, plan.head_dim), dtype=np.float32)
  for first in range(0, plan.source, plan.block_n):
    keys = np.arange(first, first + plan.block_n)[None, :]
    k_tile = np.zeros((plan.batch, plan.heads, plan.block_n, plan.head_dim), dtype=np.float32)
    v_tile = np.zeros_like(k_tile)
    inside = min(plan.block_n, plan.source - first)
    k_tile[:, :, :inside], v_tile[:, :, :inside] = k[:, :, first:first + inside], v[:, :, first:first + inside]
    scores = np.matmul(q, k_tile.swapaxes(-1, -2), dtype=np.float32) * scale_log2
    masked = keys >= plan.source
    if plan.causal: masked = masked | (keys > rows)
    scores = np.where(masked, np.float32(-np.inf), scores)
    new_max = _moved_max(plan, row_max, scores.max(axis=-1))
    reference = np.where(new_max == -np.inf, np.float32(0), new_max)
    rescale = np.exp2(row_max - reference)
    weights = np.exp2(scores - reference[..., None])
    row_sum = row_sum * rescale + weights.sum(axis=-1, dtype=np.float32)
    row_max = new_max
    outputs = outputs * rescale[..., None] + np.matmul(_operand_rounding(weights, plan.dtype), v_tile,
                                                       dtype=np.float32)
  result = (outputs / row_sum[..., None]).astype(np.float32).transpose(0, 2, 1, 3).reshape(-1)  # O as (B, L, H, D)
  if plan.dtype == "float32": out.view(np.float32)[:plan.o_elements] = result
  elif plan.dtype == "float16": out.view(np.float16)[:plan.o_elements] = result.astype(np.float16)
  else: out.view(np.uint16)[:plan.o_elements] = float32_to_bfloat16_bits(result)
  lse = (row_max + np.log2(row_sum)) * np.float32(0.6931471805599453)
  out.view(np.float32)[plan.lse_offset:plan.lse_offset + lse.size] = lse.astype(np.float32).reshape(-1)


def _moved_max(plan: AttentionPlan, row_max: np.ndarray, tile_max: np.ndarray) -> np.ndarray:
  """The rows' reference max after a tile: the running max, or with plan.rescale_slack (the kernel's lazy softmax)
  the running max only in the warps (plan.warp_rows rows each) where some row's tile max passes its reference by more
  than the slack, the old reference elsewhere."""
  moved = np.maximum(row_max, tile_max)
  if not plan.rescale_slack: return moved
  passes = tile_max > row_max + np.float32(plan.rescale_slack)
  rows = passes.shape[-1]
  padded = np.concatenate([passes, np.zeros((*passes.shape[:-1], -rows % plan.warp_rows), dtype=bool)], axis=-1)
  votes = padded.reshape(*passes.shape[:-1], -1, plan.warp_rows).any(axis=-1)
  return np.where(np.repeat(votes, plan.warp_rows, axis=-1)[..., :rows], moved, row_max)


# ---------------------------------------------------------------- the PYTHON device's attention program

def attention_program_text(name: str, plan: AttentionPlan, arguments: dict[str, int]) -> str:
  """The PYTHON device's "source" of a fused attention kernel: its plan and argument positions as JSON."""
  return json.dumps({"format": ATTENTION_PROGRAM_FORMAT, "name": name, "plan": dataclasses.asdict(plan),
                     "arguments": arguments}) + "\n"


def is_attention_program(binary: bytes) -> bool:
  return binary.startswith(b'{"format": "' + ATTENTION_PROGRAM_FORMAT.encode())


def _plan_from_json(document: dict) -> AttentionPlan:
  fields = dict(document)
  for role in ("q", "k", "v"):
    operand = fields[role]
    fields[role] = Operand(operand["argument"], operand["offset"], tuple(operand["strides"]))
  return AttentionPlan(**fields)


class AttentionProgram:
  """A fused attention kernel on the PYTHON device: emulate_attention on its buffers (raw byte arrays)."""

  def __init__(self, name: str, binary: bytes):
    document = json.loads(binary.decode())
    self.name, self.plan, self.arguments = name, _plan_from_json(document["plan"]), document["arguments"]

  def __call__(self, *buffers: np.ndarray, global_size: tuple[int, ...] = (1, 1, 1),
               local_size: tuple[int, ...] = (1, 1, 1), wait: bool = False, vals: tuple[int, ...] = ()) -> float | None:
    start = time.perf_counter()
    if tuple(global_size) != self.plan.global_size or tuple(local_size) != self.plan.local_size:
      raise ValueError(f"{self.name} launched as {global_size}x{local_size}, its plan needs "
                       f"{self.plan.global_size}x{self.plan.local_size}")
    with np.errstate(all="ignore"):
      emulate_attention(self.plan, buffers[self.arguments["out"]],
                        *(buffers[self.arguments[role]] for role in ("q", "k", "v")))
    return time.perf_counter() - start if wait else None
