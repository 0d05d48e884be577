"""The attention backward kernels (codegen/attention_backward.py) emulated with numpy, for the PYTHON device and CI.

`emulate_attention_backward` computes dq, dk, dv from logical (B, H, T, D) arrays with the kernels' arithmetic:
operands rounded where the tensor cores round them (float32 to TF32 as cvt.rna does; float16/bfloat16 as they are),
S = Q K^T and dP = dO V^T in float32, P = exp2(S scale log2(e) - LSE log2(e)) masked, delta = rowsum(dO O) in
float32, dS = P (dP - delta), P and dS rounded to the operand type as the kernels round them (in registers) for
their products, then dV = P^T dO, dK = scale dS^T Q (summed over the query heads of a kv head), dQ = scale dS K,
stored to nearest even. Summation order differs from the hardware's in the last bits.

Per launch, as the PYTHON device runs them: `emulate_dq_kernel` writes dq and the delta scratch buffer,
`emulate_dkdv_kernel` reads that delta and writes dk and dv, each through the plan's strides on flat buffers (a wrong
stride reads wrong elements here as on the GPU). `AttentionBackwardProgram` is such a launch as a PYTHON program
(its "source" is the plan as JSON, `attention_backward_program_text`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Callable

import numpy as np

from ourgrad.codegen.attention_backward import launches
from ourgrad.codegen.attention_backward_plan import DKDV_KERNEL, DQ_KERNEL, LOG2E, AttentionBackwardPlan, Strides
from ourgrad.codegen.tensor_cores import tf32_round
from ourgrad.dtype import bfloat16_bits_to_float32, float32_to_bfloat16_bits, round_to_bfloat16
from ourgrad.errors import ShapeError

# the numpy type holding one stored element of each dtype (bfloat16 as its bits)
STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


def to_float32(values: np.ndarray, dtype: str) -> np.ndarray:
  """Stored elements as float32: float16 values or bfloat16 bit patterns (uint16) widened; float32 as is."""
  if dtype == "bfloat16": return bfloat16_bits_to_float32(values)
  return np.asarray(values).astype(np.float32)


def from_float32(values: np.ndarray, dtype: str) -> np.ndarray:
  """float32 values stored in `dtype` (to nearest even): float16 values, bfloat16 bit patterns, or float32."""
  if dtype == "bfloat16": return float32_to_bfloat16_bits(values)
  return values.astype(np.float16 if dtype == "float16" else np.float32)


def _operand(values: np.ndarray, dtype: str) -> np.ndarray:
  """A product's operand as the tensor cores read it: float32 rounded to TF32; 16-bit values are exact already."""
  return tf32_round(values) if dtype == "float32" else values


def _staged(values: np.ndarray, dtype: str) -> np.ndarray:
  """float32 P or dS as the kernels round it to the operand type (in registers) and multiply it."""
  if dtype == "float16": return values.astype(np.float16).astype(np.float32)
  if dtype == "bfloat16": return round_to_bfloat16(values)
  return tf32_round(values)


def emulate_attention_backward(plan: AttentionBackwardPlan, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                               o: np.ndarray | None, do: np.ndarray, lse: np.ndarray, delta: np.ndarray | None = None
                               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """dq, dk, dv as the two kernels of `plan` compute them. q, o, do: (batch, heads, q_len, head_dim), k, v:
  (batch, kv_heads, kv_len, head_dim) in the stored form of plan.dtype (float32, float16, or bfloat16 bit patterns as
  uint16; o in plan.stored_o_dtype); lse: float32 (batch, heads, q_len); delta: rowsum(dO * O) as the dQ kernel wrote
  it (float32, (batch, heads, q_len)), else computed from o. Returns dq (as q), dk and dv (as k) in the stored form of
  plan.grad_dtype."""
  p = plan
  _check_shapes(p, q=q, k=k, v=v, do=do, lse=lse, **({} if o is None else {"o": o}))
  q32, k32, v32, do32 = (to_float32(array, p.dtype) for array in (q, k, v, do))
  if delta is None:
    if o is None: raise ShapeError("attention backward emulation needs o or delta")
    delta = (do32 * to_float32(o, p.stored_o_dtype)).sum(-1, dtype=np.float32)
  lse2 = np.asarray(lse, np.float32) * np.float32(1.0 if p.lse_log2 else LOG2E)
  rows, columns = np.arange(p.q_len)[:, None], np.arange(p.kv_len)[None, :]
  keep = columns <= rows if p.causal else np.ones((p.q_len, p.kv_len), dtype=bool)
  dq = np.zeros(q32.shape, np.float32)
  dk, dv = np.zeros(k32.shape, np.float32), np.zeros(v32.shape, np.float32)
  for batch in range(p.batch):
    for head in range(p.heads):
      kv_head = head // p.group
      query, key, value = q32[batch, head], k32[batch, kv_head], v32[batch, kv_head]
      grad_out = do32[batch, head]
      scores = _operand(query, p.dtype) @ _operand(key, p.dtype).T
      exponent = scores * np.float32(p.scale * LOG2E) - lse2[batch, head][:, None]
      prob = np.where(keep, np.exp2(exponent), np.float32(0)).astype(np.float32)
      dprob = _operand(grad_out, p.dtype) @ _operand(value, p.dtype).T
      dscores = (prob * (dprob - delta[batch, head][:, None])).astype(np.float32)
      staged_ds = _staged(dscores, p.dtype)
      dq[batch, head] = staged_ds @ _operand(key, p.dtype)
      dv[batch, kv_head] += _staged(prob, p.dtype).T @ _operand(grad_out, p.dtype)
      dk[batch, kv_head] += staged_ds.T @ _operand(query, p.dtype)
  scale = np.float32(p.scale)
  return from_float32(dq * scale, p.grad_dtype), from_float32(dk * scale, p.grad_dtype), from_float32(dv, p.grad_dtype)


def _check_shapes(plan: AttentionBackwardPlan, **arrays: np.ndarray) -> None:
  """Raise ShapeError naming the first operand whose shape is not the plan's."""
  q_shape = (plan.batch, plan.heads, plan.q_len, plan.head_dim)
  kv_shape = (plan.batch, plan.kv_heads, plan.kv_len, plan.head_dim)
  expected = {"q": q_shape, "o": q_shape, "do": q_shape, "k": kv_shape, "v": kv_shape, "lse": q_shape[:3]}
  for name, array in arrays.items():
    if tuple(array.shape) != expected[name]:
      raise ShapeError(f"attention backward: {name} has shape {tuple(array.shape)}, the plan needs {expected[name]}")


# ---------------------------------------------------------------- the launches on flat buffers

def _strided(buffer: np.ndarray, strides: Strides, shape: tuple[int, ...], offset: int = 0) -> np.ndarray:
  """The view of a flat buffer with `shape` whose leading dims have these element strides (the last one 1)."""
  element_strides = (*strides, 1) if len(shape) > len(strides) else strides
  return np.lib.stride_tricks.as_strided(buffer[offset:], shape,
                                         tuple(stride * buffer.itemsize for stride in element_strides))


def _views(plan: AttentionBackwardPlan, buffers: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """The logical views of the buffers the plan's launches name (those present), through the plan's strides."""
  p = plan
  q_shape = (p.batch, p.heads, p.q_len, p.head_dim)
  kv_shape = (p.batch, p.kv_heads, p.kv_len, p.head_dim)
  shapes = {"q": q_shape, "o": q_shape, "do": q_shape, "dq": q_shape, "k": kv_shape, "v": kv_shape, "dk": kv_shape,
            "dv": kv_shape}
  views = {name: _strided(buffers[name], getattr(p, f"{name}_strides"), shape)
           for name, shape in shapes.items() if name in buffers}
  views["lse"] = _strided(buffers["lse"], p.lse_strides, q_shape[:3], p.lse_offset)
  views["delta"] = buffers["delta"][:p.delta_elements].reshape(q_shape[:3])
  if "dq_accum" in buffers: views["dq_accum"] = buffers["dq_accum"][:math.prod(q_shape)].reshape(q_shape)
  return views


def emulate_dq_kernel(plan: AttentionBackwardPlan, buffers: dict[str, np.ndarray]) -> None:
  """The dQ launch on flat buffers (by its argument names, typed as STORAGE says; lse and delta float32): writes dq
  and delta in place (the single pass, plan.dq_accumulate: delta, and dq_accum zeroed)."""
  views = _views(plan, buffers)
  grad_out, out = to_float32(views["do"], plan.dtype), to_float32(views["o"], plan.stored_o_dtype)
  views["delta"][...] = (grad_out * out).sum(-1, dtype=np.float32)
  if plan.dq_accumulate:   # (the dK/dV kernel's counts zeroed too)
    views["dq_accum"][...] = 0
    buffers["dq_counts"][:plan.count_elements] = 0
    return
  views["dq"][...] = emulate_attention_backward(plan, views["q"], views["k"], views["v"], None, views["do"],
                                                views["lse"], views["delta"])[0]


def emulate_dkdv_kernel(plan: AttentionBackwardPlan, buffers: dict[str, np.ndarray]) -> None:
  """The dK/dV launch on flat buffers: reads the delta the dQ launch wrote, writes dk and dv in place (the single
  pass: dQ's float32 sums into dq_accum, and dq)."""
  views = _views(plan, buffers)
  dq, views["dk"][...], views["dv"][...] = emulate_attention_backward(
    plan, views["q"], views["k"], views["v"], None, views["do"], views["lse"], views["delta"])
  if plan.dq_accumulate: views["dq"][...], views["dq_accum"][...] = dq, to_float32(dq, plan.grad_dtype)


EMULATORS: dict[str, Callable[[AttentionBackwardPlan, dict[str, np.ndarray]], None]] = {
  DQ_KERNEL: emulate_dq_kernel, DKDV_KERNEL: emulate_dkdv_kernel}


def emulate_attention_backward_buffers(plan: AttentionBackwardPlan, buffers: dict[str, np.ndarray]) -> None:
  """Both launches of `plan` in order on flat buffers named as KernelLaunch.arguments names them."""
  for kernel in (DQ_KERNEL, DKDV_KERNEL): EMULATORS[kernel](plan, buffers)


# ---------------------------------------------------------------- the PYTHON device's program

ATTENTION_BACKWARD_PROGRAM_FORMAT = "ourgrad-python-attention-backward-v1"


# a launch parameter bound to a kernel argument: (parameter name, argument index, element offset into that buffer)
Binding = tuple[str, int, int]


def attention_backward_program_text(name: str, plan: AttentionBackwardPlan, kernel: str,
                                    bindings: list[Binding] | None = None) -> str:
  """The PYTHON device's "source" of one launch (`kernel`: DQ_KERNEL or DKDV_KERNEL): its plan as JSON. Its buffers
  come in the order of that launch's KernelLaunch.arguments, or, with `bindings`, each parameter is the named
  argument from an element offset on (codegen/attention_grad.py: the lazy ops' kernels)."""
  return json.dumps({"format": ATTENTION_BACKWARD_PROGRAM_FORMAT, "name": name, "kernel": kernel,
                     "plan": dataclasses.asdict(plan), "bindings": bindings}) + "\n"


def is_attention_backward_program(binary: bytes) -> bool:
  return binary.startswith(b'{"format": "' + ATTENTION_BACKWARD_PROGRAM_FORMAT.encode())


class AttentionBackwardProgram:
  """One attention backward launch on the PYTHON device: its emulator on the launch's buffers (raw byte arrays)."""

  def __init__(self, name: str, binary: bytes):
    document = json.loads(binary.decode())
    fields = {key: tuple(value) if isinstance(value, list) else value for key, value in document["plan"].items()}
    self.name, self.kernel, self.plan = name, document["kernel"], AttentionBackwardPlan(**fields)
    self.bindings: list[Binding] | None = document.get("bindings")
    self.launch = next(launch for launch in launches(self.plan) if launch.name == self.kernel)

  def __call__(self, *buffers: np.ndarray, global_size: tuple[int, ...] = (1, 1, 1),
               local_size: tuple[int, ...] = (1, 1, 1), wait: bool = False, vals: tuple[int, ...] = ()) -> float | None:
    start = time.perf_counter()
    if tuple(global_size) != self.launch.grid or tuple(local_size) != self.launch.block:
      raise ValueError(f"{self.name} launched as {global_size}x{local_size}, its plan needs "
                       f"{self.launch.grid}x{self.launch.block}")
    element, grad = STORAGE[self.plan.dtype], STORAGE[self.plan.grad_dtype]
    types = {"o": STORAGE[self.plan.stored_o_dtype], "lse": np.float32, "delta": np.float32, "dq": grad, "dk": grad,
             "dv": grad, "dq_accum": np.float32, "dq_counts": np.uint32}
    bindings = self.bindings or [(name, index, 0) for index, name in enumerate(self.launch.arguments)]
    typed = {name: buffers[index].view(types.get(name, element))[offset:] for name, index, offset in bindings}
    EMULATORS[self.kernel](self.plan, typed)
    return time.perf_counter() - start if wait else None
