"""The kernels of the fused attention's backward lazy ops (Ops.ATTENTION_DQ, Ops.ATTENTION_DKDV): one launch each of
the flash backward kernels of codegen/attention_backward.py, on the buffers of a schedule item.

A kernel AST is STORE(ATTENTION_DQ(LOAD q, LOAD k, LOAD v, LOAD fwd, LOAD dO)) or STORE(ATTENTION_DKDV(LOAD q,
LOAD k, LOAD v, LOAD dO, LOAD fwd, LOAD dq_buffer)), arg (causal, scale, packed), each load one unmasked View of a
realized buffer whose last dim is contiguous (LazyBuffer.attention_grads). `fwd` is the forward's buffer in the
operands' dtype (Ops.ATTENTION: O laid out (B, L, H, D), then the bytes of the float32 natural-log LSE (B, H, L)): it
is both the backward's O and its LSE.

Each op writes ONE buffer in the operands' dtype: ATTENTION_DQ dq (B, H, L, D) contiguous, then delta = rowsum(dO * O)
(B, H, L) float32, its bytes in the buffer's tail (4 bytes from 2 16-bit elements; the lazy graph reads only dq, the
dK/dV kernel reads delta as float32); ATTENTION_DKDV dk then dv, each (B, Hk, S, D) contiguous. So each op has one
output and the gradients need no cast. Packed (arg[2]: q, k, v tile one base, as GPT-2's views of its c_attn output):
the dQ op's buffer is the base's elements then delta, dq stored through q's view of the base; the dK/dV op writes dk
and dv through k's and v's views into that same buffer (the scheduler gives both ops one buffer), which then holds
the base's whole gradient in the base's layout.

The kernels' parameters are fixed (KernelLaunch.arguments, each a whole buffer); a kernel here binds each parameter
to one of its schedule item's buffers from an element offset on (q, k, v read in place as views of one projection,
O and LSE of one buffer): CUDA through a wrapper __global__ calling the kernel rendered as a __device__ function,
PYTHON by the bindings in the emulator's program text (runtime/attention_backward_emulator.py).
"""
from __future__ import annotations

from dataclasses import replace
from math import prod
from typing import Any

from ourgrad.codegen.attention_backward import launches, render_dkdv_kernel, render_dq_kernel
from ourgrad.codegen.attention_backward_plan import (BLOCK_RESERVED_SHARED, DKDV_KERNEL, DQ_KERNEL,
                                                     WGMMA_MAX_HEAD_DIM, AttentionBackwardPlan, KernelLaunch,
                                                     contiguous_strides, default_blocks, single_pass_blocks)
from ourgrad.codegen.attention_wgmma import wgmma_refusal
from ourgrad.codegen.wgmma_tiles import ITEMSIZE
from ourgrad.helpers import DEBUG, env_var
from ourgrad.ops import LazyOp, MemBuffer, Ops, format_ast

# a launch parameter bound to a kernel argument: (parameter name, argument index, offset into that buffer in elements
# of the parameter's type)
Binding = tuple[str, int, int]
# each parameter's C type (codegen/attention_backward.py's typedefs)
PARAMETER_TYPES = {"q": "elem_t", "k": "elem_t", "v": "elem_t", "do": "elem_t", "o": "o_t", "lse": "float",
                   "delta": "float", "dq": "grad_t", "dk": "grad_t", "dv": "grad_t", "dq_accum": "float",
                   "dq_counts": "unsigned"}
# the lazy ops' sources in order, by the kernels' parameter names ("fwd": O and LSE; "dq_buffer": the DQ op's output)
SOURCES = {Ops.ATTENTION_DQ: ("q", "k", "v", "fwd", "do"),
           Ops.ATTENTION_DKDV: ("q", "k", "v", "do", "fwd", "dq_buffer")}
KERNELS = {Ops.ATTENTION_DQ: DQ_KERNEL, Ops.ATTENTION_DKDV: DKDV_KERNEL}
ATTENTION_BACKWARD_WGMMA = env_var("ATTENTION_BACKWARD_WGMMA", 1, "0: the fused attention backward of "
                                   "float16/bfloat16 on sm_90 runs on mma.sync instead of wgmma "
                                   "(codegen/attention_backward_wgmma.py)")
ATTENTION_SINGLE_PASS = env_var("ATTENTION_SINGLE_PASS", 2, "the fused attention backward on wgmma (sm_90) in one "
                                "pass: delta from a kernel of its own, the dK/dV kernel adding dQ into a float32 "
                                "buffer (plan.dq_accumulate) and converting it; 2 (default; unset: where head_dim <= "
                                "64, measured there, larger heads keep the two kernels): that dK/dV kernel "
                                "warp-specialized, its dQ added by its producer's bulk reductions "
                                "(plan.warp_specialized, dq_bulk_reduce); 1: added by its consumers' red.global.add; "
                                "0: the dQ and dK/dV kernels")
# the largest head the single pass is chosen for where ATTENTION_SINGLE_PASS is unset: H200, causal B=4 H=12 T=4096
# D=64 bfloat16 (sweep_attention_backward_h200_s16.txt): 0.757 ms with its delta kernel against 0.385 + 0.541 for
# the two kernels; D = 128 not measured
SINGLE_PASS_HEAD_DIM = 64


def single_pass_mode(head_dim: int) -> int:
  """ATTENTION_SINGLE_PASS for a head of `head_dim` (0: the two kernels; unset: 2 up to SINGLE_PASS_HEAD_DIM)."""
  mode = int(ATTENTION_SINGLE_PASS)
  return 0 if ATTENTION_SINGLE_PASS.raw() is None and head_dim > SINGLE_PASS_HEAD_DIM else mode


def single_pass_backward(dtype: str, head_dim: int, has_wgmma: bool) -> bool:
  """Whether the fused attention backward of these operands runs in one pass (`single_pass_mode`; the plan's
  dq_accumulate): where its kernels run on wgmma (`AttentionBackwardPlan.with_device_mma`; the lazy graph refuses it
  for operands whose rows are not 16-byte aligned)."""
  return single_pass_mode(head_dim) > 0 and has_wgmma and bool(ATTENTION_BACKWARD_WGMMA) and \
      wgmma_refusal(dtype, head_dim, True) is None and head_dim <= WGMMA_MAX_HEAD_DIM


def is_attention_grad(ast: LazyOp) -> bool:
  """Whether a kernel AST is one of the fused attention backward's (STORE(ATTENTION_DQ | ATTENTION_DKDV))."""
  return ast.op is Ops.STORE and ast.srcs[0].op in KERNELS


def backward_plan(q_view: Any, k_view: Any, v_view: Any, do_view: Any, dtype: str, causal: bool, scale: float,
                  shared_per_sm: int, packed: bool = False, has_wgmma: bool = False,
                  single_pass: bool = False) -> AttentionBackwardPlan:
  """The plan for views (ShapeTracker Views) q, do (B, H, L, D) and k, v (B, Hk, S, D), their last dim contiguous,
  reading O (in the operands' dtype) and LSE (float32, after O's bytes) from the forward's buffer and writing the
  gradients contiguous in the operands' dtype, or (`packed`) through q, k and v's own strides. On a device with
  wgmma (`has_wgmma`: sm_90) its kernels run on warpgroup MMAs where the plan allows (`with_device_mma`);
  `single_pass` (the lazy graph chose it: `single_pass_backward`): in one pass (`single_pass_blocks`)."""
  batch, heads, length, head_dim = q_view.shape
  kv_heads, source = k_view.shape[1], k_view.shape[2]
  strides = [tuple(int(stride) for stride in view.strides[:3]) for view in (q_view, k_view, v_view, do_view)]
  q_like, kv_like = contiguous_strides(heads, length, head_dim), contiguous_strides(kv_heads, source, head_dim)
  grads = (strides[0], strides[1], strides[2]) if packed else (q_like, kv_like, kv_like)
  plan = AttentionBackwardPlan(
    batch, heads, kv_heads, length, source, head_dim, dtype, causal, scale, strides[0], strides[1], strides[2],
    (length * heads * head_dim, head_dim, heads * head_dim), strides[3], *grads,
    (heads * length, length, 1), lse_offset=batch * length * heads * head_dim * ITEMSIZE[dtype] // 4, o_dtype=dtype,
    shared_per_sm=shared_per_sm, **default_blocks(head_dim, dtype)).with_device_mma(
      has_wgmma and bool(ATTENTION_BACKWARD_WGMMA))
  if not single_pass: return plan
  if plan.mma != "wgmma": raise AssertionError(f"the single-pass attention backward needs wgmma kernels: {plan}")
  specialized = single_pass_mode(head_dim) >= 2
  return replace(plan, dq_accumulate=True, dkdv_held=False, wgmma_overlap=False, **single_pass_blocks(head_dim),
                 warp_specialized=specialized, dq_bulk_reduce=specialized)


class AttentionGradKernel:
  """The kernel of one fused attention backward AST (module docstring): its plan, launch and parameter bindings."""

  def __init__(self, ast: LazyOp, renderer: Any):
    if not is_attention_grad(ast): raise AssertionError(f"not an attention backward's AST: {ast.op}")
    self.ast, self.renderer = ast, renderer
    op = ast.srcs[0]
    loads = op.srcs
    if any(load.op is not Ops.LOAD or not isinstance(load.arg, MemBuffer) or len(load.arg.st.views) != 1 or
           load.arg.st.views[0].mask is not None for load in loads):
      raise AssertionError("attention backward sources must be unmasked loads of realized buffers (engine/schedule.py)")
    self.leaves: list[LazyOp] = [ast, *loads]
    self.sts = [leaf.arg.st for leaf in self.leaves]
    self.applied_opts: list[Any] = []
    causal, scale, packed, single_pass = op.arg
    load_of = dict(zip(SOURCES[op.op], loads))
    views = {name: load.arg.st.views[0] for name, load in load_of.items()}
    shared_per_sm = renderer.dynamic_local_memory_bytes + BLOCK_RESERVED_SHARED
    self.plan = backward_plan(views["q"], views["k"], views["v"], views["do"], load_of["q"].dtype.name, causal,
                              scale, shared_per_sm, packed, getattr(renderer, "has_wgmma", False), single_pass)
    self.kernel = KERNELS[op.op]
    self.launch: KernelLaunch = next(launch for launch in launches(self.plan) if launch.name == self.kernel)
    p = self.plan
    q_elements, kv_elements = p.batch * p.heads * p.q_len * p.head_dim, p.batch * p.kv_heads * p.kv_len * p.head_dim
    place = {name: (load.arg.idx, int(views[name].offset)) for name, load in load_of.items()}
    fwd_index, fwd_offset = place["fwd"]
    # the LSE parameter is a float pointer: the view's offset in float32 elements
    place.update(o=place["fwd"], lse=(fwd_index, fwd_offset * p.itemsize // 4), dq=(0, 0), dk=(0, 0),
                 dv=(0, kv_elements))
    gradient_elements = q_elements
    if packed:   # each gradient where its operand lies in the base; delta after the base's elements
      place.update(dq=(0, place["q"][1]), dk=(0, place["k"][1]), dv=(0, place["v"][1]))
      gradient_elements = prod(ast.arg.st.shape) - p.delta_elements * 4 // p.itemsize
    # delta after the gradients, in float32 elements (their count is even: head_dim is a multiple of 16)
    delta = gradient_elements * p.itemsize // 4
    place["delta"] = (0, delta) if op.op is Ops.ATTENTION_DQ else (place["dq_buffer"][0], delta)
    if single_pass:   # one buffer: the gradients, then (float32 / uint32 elements) dQ's sums, delta, the counts
      shared = 0 if op.op is Ops.ATTENTION_DQ else place["dq_buffer"][0]
      if not packed: place.update(dq=(0, 0), dk=(0, q_elements), dv=(0, q_elements + kv_elements))
      gradients = prod(ast.arg.st.shape) - (q_elements + p.count_elements) * 4 // p.itemsize - \
          p.delta_elements * 4 // p.itemsize
      sums = gradients * p.itemsize // 4
      place.update(dq_accum=(shared, sums), delta=(shared, sums + q_elements),
                   dq_counts=(shared, sums + q_elements + p.delta_elements))
    self.bindings: list[Binding] = [(name, *place[name]) for name in self.launch.arguments]
    # (a packed dK/dV op reads delta from its own output buffer: argument 0)
    self.arguments = len({0} | {load.arg.idx for load in loads})

  @property
  def name(self) -> str:
    p = self.plan
    return f"{self.kernel.replace('attention_backward', 'attn_bwd')}_{p.batch}_{p.heads}_{p.q_len}_{p.kv_len}_" \
           f"{p.head_dim}{'_causal' if p.causal else ''}"

  def colored_shape(self) -> str:
    p = self.plan
    return f"{p.batch} {p.heads} {p.q_len} {p.kv_len} {p.head_dim}"

  def print_debug(self) -> None:
    if DEBUG >= 3:
      print(format_ast(self.ast))
      print(f"{self.name}: fused attention backward, plan {self.plan}")

  def op_count(self) -> int:
    """Multiply-adds of the products it computes (dQ kernel: S, dP, dQ; dK/dV kernel: S, dP, dV, dK; each 2 ops),
    halved by a causal mask."""
    p = self.plan
    products = 3 if self.kernel == DQ_KERNEL else 4
    if p.dq_accumulate: products = 0 if self.kernel == DQ_KERNEL else 5   # the single pass
    full = 2 * products * p.batch * p.heads * p.q_len * p.kv_len * p.head_dim
    return full // 2 if p.causal else full

  def byte_count(self) -> int:
    """Its operands read once (dQ kernel: also O, in the dtype the forward stored it in; dK/dV kernel: Q and dO once
    per block of keys, counted once) and its gradients written once."""
    p = self.plan
    q_side, kv_side = p.batch * p.heads * p.q_len * p.head_dim, p.batch * p.kv_heads * p.kv_len * p.head_dim
    if p.dq_accumulate:   # the single pass: delta's kernel reads dO and O and zeroes the float32 dQ, which the dK/dV
      # kernel adds into once a block of keys (counted once)
      if self.kernel == DQ_KERNEL: return q_side * (p.itemsize + ITEMSIZE[p.stored_o_dtype] + 4)
      return (2 * q_side + 4 * kv_side) * p.itemsize + 4 * q_side
    if self.kernel == DQ_KERNEL: return (3 * q_side + 2 * kv_side) * p.itemsize + q_side * ITEMSIZE[p.stored_o_dtype]
    return (2 * q_side + 4 * kv_side) * p.itemsize


def render_attention_grad_cuda(name: str, kernel: AttentionGradKernel) -> str:
  """CUDA source of `kernel`: the backward kernel as a __device__ function and the __global__ `name` taking the
  schedule item's buffers in argument order, binding each parameter to a buffer and element offset."""
  plan, launch = kernel.plan, kernel.launch
  registers = plan.dq_registers if kernel.kernel == DQ_KERNEL else plan.dkdv_registers
  render = render_dq_kernel if kernel.kernel == DQ_KERNEL else render_dkdv_kernel
  body = render(plan, device_function=True)
  parameters = [f"{'' if index == 0 else 'const '}void* __restrict__ data{index}" for index in range(kernel.arguments)]
  # (a C-style cast may drop const: the output is written through `data0` alone)
  bound = [f"({PARAMETER_TYPES[name]}*)data{index} + {offset}" for name, index, offset in kernel.bindings]
  bounds = plan.launch_bounds(launch.block[0], launch.shared_bytes, registers,
                              plan.warp_specialized and kernel.kernel == DKDV_KERNEL)
  return (f'{body}\nextern "C" __global__ void {bounds} '
          f"{name}({', '.join(parameters)}) {{\n  {kernel.kernel}_body({', '.join(bound)});\n}}\n")
