"""The flash-attention backward kernels (codegen/attention_backward.py): their numpy emulation
(runtime/attention_backward_emulator.py) and their CUDA source run on the CPU (attention_backward_host.py) against
torch's float64 autograd of scaled_dot_product_attention, and every rendered variant compiled by NVRTC (no GPU)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from attention_backward_host import host_compiler, run_on_host
from helpers import nvrtc_compiler

from ourgrad.codegen.attention_backward import launches
from ourgrad.codegen.attention_backward_plan import DKDV_KERNEL, DQ_KERNEL, AttentionBackwardPlan, contiguous_strides
from ourgrad.runtime.attention_backward_emulator import (STORAGE, AttentionBackwardProgram,
                                                         attention_backward_program_text, emulate_attention_backward,
                                                         emulate_attention_backward_buffers, from_float32,
                                                         is_attention_backward_program, to_float32)
from ourgrad.errors import DTypeError, ShapeError

# max |emulated - float64| relative to max |float64| per gradient, by operand dtype (TF32: 10 mantissa bits,
# bfloat16: 7; P and dS are rounded to the operand type before their products)
TOLERANCE = {"float32": 4e-3, "float16": 2e-3, "bfloat16": 1.5e-2}


def stored(values: torch.Tensor, dtype: str) -> np.ndarray:
  """float64 values rounded into the stored form of `dtype` (bfloat16 as uint16 bit patterns)."""
  return from_float32(values.to(torch.float32).numpy(), dtype)


def reference(plan: AttentionBackwardPlan, seed: int = 0):
  """Random q, k, v, dO in the plan's dtype, the forward's O and LSE, and torch's float64 gradients."""
  generator = torch.Generator().manual_seed(seed)
  q_shape = (plan.batch, plan.heads, plan.q_len, plan.head_dim)
  kv_shape = (plan.batch, plan.kv_heads, plan.kv_len, plan.head_dim)
  inputs = [torch.randn(shape, generator=generator, dtype=torch.float64) for shape in (q_shape, kv_shape, kv_shape)]
  q, k, v = (torch.from_numpy(to_float32(stored(tensor, plan.dtype), plan.dtype)).double().requires_grad_()
             for tensor in inputs)
  grad_out = torch.from_numpy(to_float32(stored(torch.randn(q_shape, generator=generator, dtype=torch.float64),
                                                plan.dtype), plan.dtype)).double()
  out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=plan.causal, scale=plan.scale,
                                                         enable_gqa=plan.kv_heads != plan.heads)
  out.backward(grad_out)
  keys = k.detach().repeat_interleave(plan.group, dim=1)
  scores = plan.scale * q.detach() @ keys.transpose(-1, -2)
  if plan.causal: scores = scores.masked_fill(torch.ones(plan.q_len, plan.kv_len).triu(1).bool(), -math.inf)
  lse = torch.logsumexp(scores, -1)
  operands = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "o": out.detach(), "do": grad_out}
  arrays = {name: stored(tensor, plan.dtype) for name, tensor in operands.items()}
  arrays["lse"] = lse.to(torch.float32).numpy()
  return arrays, (q.grad.numpy(), k.grad.numpy(), v.grad.numpy())


CASES = [  # batch, heads, kv_heads, q_len, kv_len, head_dim, causal
  (1, 2, 2, 64, 64, 64, False),
  (2, 2, 2, 100, 100, 64, True),      # not a tile multiple
  (1, 4, 2, 37, 90, 64, False),       # GQA, L != S
  (1, 4, 1, 90, 37, 32, True),        # GQA onto one kv head, L > S, causal
  (1, 2, 2, 50, 130, 128, True),      # L < S causal: keys past a query's index masked (top-left aligned)
]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=lambda case: "_".join(map(str, case)))
def test_emulation_matches_torch_float64(dtype: str, case: tuple):
  batch, heads, kv_heads, q_len, kv_len, head_dim, causal = case
  plan = AttentionBackwardPlan.contiguous(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, causal)
  arrays, expected = reference(plan)
  results = emulate_attention_backward(plan, **arrays)
  for name, result, want in zip(("dq", "dk", "dv"), results, expected):
    assert result.shape == want.shape, name
    error = np.abs(to_float32(result, dtype) - want).max() / np.abs(want).max()
    assert error < TOLERANCE[dtype], f"{name} {dtype} {case}: relative error {error:.2e}"


def test_emulation_reads_a_base2_lse():
  plan = AttentionBackwardPlan.contiguous(1, 2, 2, 40, 40, 32, "float32", True)
  arrays, expected = reference(plan)
  base2 = AttentionBackwardPlan(**{**plan.__dict__, "lse_log2": True})
  arrays["lse"] = arrays["lse"] * np.float32(1 / math.log(2))
  for result, want in zip(emulate_attention_backward(base2, **arrays), expected):
    assert np.abs(result - want).max() / np.abs(want).max() < TOLERANCE["float32"]


def test_plan_checks_its_arguments():
  with pytest.raises(DTypeError, match="float32, float16 or bfloat16"):
    AttentionBackwardPlan.contiguous(1, 2, 2, 8, 8, 64, "int8", False)
  with pytest.raises(ShapeError, match="multiple of 16"):
    AttentionBackwardPlan.contiguous(1, 2, 2, 8, 8, 40, "float16", False)
  with pytest.raises(ShapeError, match="kv heads"):
    AttentionBackwardPlan.contiguous(1, 6, 4, 8, 8, 64, "float16", False)
  plan = AttentionBackwardPlan.contiguous(1, 2, 2, 8, 8, 64, "float16", False)
  with pytest.raises(ShapeError, match="k has shape"):
    emulate_attention_backward(plan, *(np.zeros((1, 2, 8, 64), np.float16),) * 1, np.zeros((1, 2, 9, 64), np.float16),
                               *(np.zeros((1, 2, 8, 64), np.float16),) * 3, np.zeros((1, 2, 8), np.float32))


def test_warp_specialized_plan_round_trips_and_sizes():
  """The warp-specialized single pass's plan through pickle (as a cache stores it): equal, the same kernels; its
  dK/dV block is the consumers' warpgroups and a producer one, the consumers given 240 registers of the 168 a thread
  one block has (24 left to the producer)."""
  import pickle
  plan = AttentionBackwardPlan.contiguous(4, 12, 12, 4096, 4096, 64, "bfloat16", True, mma="wgmma",
                                          dq_accumulate=True, block_kv=128, stream_q=128, warp_specialized=True,
                                          dq_bulk_reduce=True, ring_stages=2)
  copy = pickle.loads(pickle.dumps(plan))
  assert copy == plan and [launch.source for launch in launches(copy)] == [launch.source for launch in launches(plan)]
  dq, dkdv = launches(plan)
  assert dkdv.block == (384, 1, 1) and plan.consumer_threads == 256 and plan.consumer_registers == 240
  assert 168 * 384 == 24 * 128 + 240 * 256
  assert dkdv.shared_bytes <= 227 * 1024 and plan.dq_swizzled
  with pytest.raises(ShapeError): AttentionBackwardPlan(**{**plan.__dict__, "dkdv_held": True})


def test_launch_sizes():
  plan = AttentionBackwardPlan.contiguous(4, 12, 4, 1000, 520, 64, "bfloat16", True)
  dq, dkdv = launches(plan)
  # (heads, tiles): every head's first tile (a causal block's longest) has a lower linear index than any second tile
  assert (dq.grid, dq.block) == ((48, 16, 1), (128, 1, 1))
  assert (dkdv.grid, dkdv.block) == ((16, 9, 1), (128, 1, 1))
  assert dq.arguments == ("q", "k", "v", "o", "do", "lse", "dq", "delta")
  assert dkdv.arguments == ("q", "k", "v", "do", "lse", "delta", "dk", "dv")
  assert plan.delta_elements == 4 * 12 * 1000


def _single_pass(**fields) -> AttentionBackwardPlan:
  return AttentionBackwardPlan.contiguous(2, 12, 12, 1000, 1000, 64, "bfloat16", True, mma="wgmma", dq_accumulate=True,
                                          block_kv=128, stream_q=128, warp_specialized=True, dq_bulk_reduce=True,
                                          **fields)


def test_dq_conversion_loads_before_it_stores():
  """The single pass's conversion of a completed Q tile (dq_count_helpers' convert_tile) reads every sum it converts
  before its first store (a store before a load would keep that load waiting for it: an L2 round trip a piece, the
  H200 profile's kernel tail, ck_s17/attnbwd5_1.txt), and stores packed pairs where dq's strides allow."""
  source = next(launch.source for launch in launches(_single_pass()) if launch.name == DKDV_KERNEL)
  convert = source[source.index("auto convert_tile"):source.index("};", source.index("auto convert_tile"))]
  assert convert.count("__ldcg(") == 1 and convert.index("__ldcg(") < convert.index("*(uint2*)out = ")
  assert "float4 sum[PIECES];" in convert and "(BQ * (D / 4) + 256 - 1) / 256" in convert
  plan = _single_pass()
  odd = AttentionBackwardPlan(**{**plan.__dict__, "dq_strides": (12 * 1000 * 65, 1000 * 65, 65)})   # unaligned rows
  source = next(launch.source for launch in launches(odd) if launch.name == DKDV_KERNEL)
  assert "*(uint2*)out" not in source and "out[3] = grad_from_float(sum[n].w);" in source


def test_dkdv_stores_pairs_where_strides_allow():
  """dK and dV stored two neighbouring columns a store where their strides are even, an element a store else."""
  plan = _single_pass()
  source = next(launch.source for launch in launches(plan) if launch.name == DKDV_KERNEL)
  assert "*(unsigned*)&dk[" in source and "*(unsigned*)&dv[" in source
  assert "grad_from_float(SCALE * dk_acc" not in source
  # (the store comes before the wait for the last bulk reductions)
  assert source.index("*(unsigned*)&dk[") < source.index("mbarrier_wait(dq_done, 0);")
  odd = AttentionBackwardPlan(**{**plan.__dict__, "dk_strides": (12 * 1000 * 65, 1000 * 65, 65)})
  source = next(launch.source for launch in launches(odd) if launch.name == DKDV_KERNEL)
  assert "*(unsigned*)&dk[" not in source and "grad_from_float(SCALE * dk_acc[t][c])" in source
  float32 = AttentionBackwardPlan(**{**plan.__dict__, "grad_float32": True})
  source = next(launch.source for launch in launches(float32) if launch.name == DKDV_KERNEL)
  assert "*(float2*)&dk[" in source and "*(float4*)out = sum[n];" in source
  compiler = nvrtc_compiler()
  if compiler is not None:
    for variant in (odd, float32):
      for launch in launches(variant): assert compiler.compile(launch.source)


VARIANTS = [(dtype, head_dim, causal, kv_heads, "mma_sync") for dtype in ("float32", "float16", "bfloat16")
            for head_dim, causal, kv_heads in ((64, True, 12), (128, False, 4))]
VARIANTS += [("bfloat16", 64, True, 12, "wgmma"), ("float16", 128, False, 4, "wgmma"),
             ("bfloat16", 64, True, 4, "overlap"), ("bfloat16", 64, True, 4, "single_pass"),
             ("bfloat16", 64, True, 12, "single_pass_bulk"), ("bfloat16", 64, True, 4, "warp_specialized"),
             ("bfloat16", 64, True, 4, "warp_specialized_dkdv")]
VARIANT_FIELDS = {"overlap": {"mma": "wgmma", "wgmma_overlap": True},
                  "single_pass": {"mma": "wgmma", "dq_accumulate": True, "stream_q": 128, "dq_reduce_width": 4},
                  "single_pass_bulk": {"mma": "wgmma", "dq_accumulate": True, "block_kv": 128, "stream_q": 128,
                                       "dq_bulk_reduce": True},
                  "warp_specialized": {"mma": "wgmma", "dq_accumulate": True, "block_kv": 128, "stream_q": 128,
                                       "dq_reduce_width": 4, "warp_specialized": True},
                  "warp_specialized_dkdv": {"mma": "wgmma", "block_kv": 128, "stream_q": 128, "dkdv_held": False,
                                            "warp_specialized": True}}


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda variant: "_".join(map(str, variant)))
def test_kernels_compile_with_nvrtc(variant: tuple):
  compiler = nvrtc_compiler()
  if compiler is None: pytest.skip("cuda-python's NVRTC is not installed here")
  dtype, head_dim, causal, kv_heads, mma = variant
  fields = VARIANT_FIELDS.get(mma, {"mma": mma})
  plan = AttentionBackwardPlan.contiguous(2, 12, kv_heads, 1000, 1000, head_dim, dtype, causal, **fields)
  # q/o/do/dq read in place from a (B, L, H, D) projection
  strided = contiguous_strides(12, 1000, head_dim)
  projection = (1000 * 12 * head_dim, head_dim, 12 * head_dim)
  plan = AttentionBackwardPlan(**{**plan.__dict__, "q_strides": projection, "o_strides": projection,
                                  "do_strides": strided, "dq_strides": projection})
  def one_block(launch) -> str:   # the warp-specialized dK/dV kernel: one block a multiprocessor, always
    return ", 1" if plan.warp_specialized and launch.name != DQ_KERNEL else ""
  unbounded = launches(plan)
  for launch in unbounded:
    assert f'extern "C" __global__ void __launch_bounds__({launch.block[0]}{one_block(launch)}) {launch.name}(' \
        in launch.source
  # with the H100/H200's 228 KB of shared memory a multiprocessor: as many blocks as fit in it and in the register
  # file at the registers the accumulators need. The source is the one above but for that launch-bounds line, so
  # NVRTC compiles only this one (the GPU's)
  plan = AttentionBackwardPlan(**{**plan.__dict__, "shared_per_sm": 228 * 1024})
  for launch, registers, other in zip(launches(plan), (plan.dq_registers, plan.dkdv_registers), unbounded):
    resident = min(228 * 1024 // (launch.shared_bytes + 1024), 65536 // (launch.block[0] * registers))
    bounds = f"__launch_bounds__({launch.block[0]}{f', {resident}' if resident > 1 else one_block(launch)})"
    assert f'extern "C" __global__ void {bounds} {launch.name}(' in launch.source
    differing = set(launch.source.splitlines()) ^ set(other.source.splitlines())
    assert all("__launch_bounds__" in line for line in differing), differing
    assert compiler.compile(launch.source)


HOST_CASES = [  # dtype, (batch, heads, kv_heads, q_len, kv_len, head_dim, causal), layout of q, o, dq, k
  ("float32", (1, 2, 1, 70, 45, 32, True), "contiguous"),
  ("float32", (1, 1, 1, 70, 75, 64, True), "contiguous"),    # 256-byte rows: 32-row streamed tiles (default_blocks)
  ("bfloat16", (1, 2, 2, 45, 70, 64, False), "projected"),   # q, o, dq as (B, L, H, D); o float32 before LSE
  ("float16", (1, 2, 1, 40, 40, 128, True), "contiguous"),
  ("float16", (1, 2, 1, 33, 20, 16, False), "padded"),       # k, o rows D + 1 apart: no 16-byte loads
  ("bfloat16", (1, 2, 1, 70, 70, 64, True), "held"),         # A fragments of Q, dO, K, V held in registers
  ("float32", (1, 1, 1, 40, 50, 32, False), "held"),
  ("bfloat16", (1, 2, 1, 60, 50, 32, True), "unheld"),      # the dQ kernel's Q and dO fragments from shared memory
  ("float16", (1, 2, 1, 70, 60, 32, True), "split"),         # owned and streamed tiles of other sizes
  ("bfloat16", (1, 2, 1, 150, 140, 16, True), "wide"),       # blocks of 8 warps (128 rows)
  ("bfloat16", (1, 4, 2, 45, 70, 64, True), "grad32"),       # dq, dk, dv stored in float32 (Ops.ATTENTION_DQ/DKDV)
  ("bfloat16", (1, 2, 1, 192, 192, 32, True), "contiguous"),  # interior tiles below the diagonal: no mask tests
  ("float32", (1, 1, 1, 128, 128, 32, True), "contiguous"),
  ("float32", (1, 2, 1, 40, 40, 48, True), "contiguous"),    # 12 16-byte chunks of an O row over 8 threads (delta)
]


@pytest.mark.skipif(host_compiler() is None, reason="no g++ to run the kernels' source on the host")
@pytest.mark.parametrize("dtype,case,layout", HOST_CASES, ids=lambda value: str(value))
def test_kernel_source_run_on_host_matches_torch(dtype: str, case: tuple, layout: str):
  """The CUDA source itself (index math, masks, barriers, fragment loads) run by attention_backward_host."""
  _check_on_host(dtype, case, layout, {})


# the wgmma kernels (codegen/attention_backward_wgmma.py): (dtype, case, layout, plan fields)
WGMMA_HOST_CASES = [
  ("bfloat16", (1, 2, 2, 83, 83, 64, True), "contiguous", {}),              # odd lengths, causal
  ("bfloat16", (1, 2, 2, 83, 83, 64, True), "contiguous", {"dkdv_held": True}),   # K, V A fragments in registers
  ("float16", (1, 4, 2, 100, 90, 64, True), "projected", {"dq_held": False}),   # Q, dO A by descriptor
  ("float16", (1, 4, 2, 70, 131, 64, False), "contiguous", {}),             # GQA, L < S
  ("bfloat16", (1, 4, 1, 150, 97, 64, True), "projected", {}),   # GQA onto one kv head, L > S; q, o, dq strided
  ("bfloat16", (1, 2, 1, 90, 90, 128, True), "grad32", {}),                 # D = 128: two 64-column chunks a row
  ("float16", (1, 2, 2, 140, 130, 64, True), "contiguous",                  # two warpgroups, 32- and 128-row streams
   {"block_q": 128, "block_kv": 128, "stream_q": 32, "stream_kv": 128}),
  ("bfloat16", (1, 2, 1, 140, 150, 128, False), "contiguous", {"block_kv": 128, "dkdv_held": True}),
  ("bfloat16", (1, 1, 1, 256, 256, 64, True), "contiguous", {"stream_q": 128, "stream_kv": 16}),   # unmasked tiles
  ("bfloat16", (1, 4, 2, 150, 150, 64, True), "contiguous", {"wgmma_overlap": True}),   # 3 stages, products overlapped
  ("float16", (1, 2, 1, 200, 70, 64, False), "grad32", {"wgmma_overlap": True, "stream_q": 32, "stream_kv": 32}),
  # the single pass: dQ added into a float32 buffer by the dK/dV kernel (odd lengths, GQA, two warpgroups, D = 128)
  ("bfloat16", (1, 2, 2, 83, 83, 64, True), "contiguous", {"dq_accumulate": True, "stream_q": 128}),
  ("float16", (1, 4, 2, 70, 131, 64, False), "projected", {"dq_accumulate": True, "stream_q": 64}),
  ("bfloat16", (1, 4, 1, 150, 97, 64, True), "contiguous", {"dq_accumulate": True, "block_kv": 128, "stream_q": 128}),
  ("float16", (1, 2, 1, 300, 290, 64, True), "contiguous", {"dq_accumulate": True, "block_kv": 128, "stream_q": 256}),
  ("bfloat16", (1, 2, 1, 90, 90, 128, True), "contiguous", {"dq_accumulate": True, "stream_q": 64}),
  ("bfloat16", (1, 4, 2, 83, 83, 64, True), "contiguous", {"dq_accumulate": True, "stream_q": 128,
                                                            "dq_reduce_width": 4}),
  ("bfloat16", (1, 4, 2, 150, 150, 64, True), "projected", {"dq_accumulate": True, "block_kv": 128, "stream_q": 128,
                                                            "dq_bulk_reduce": True}),   # TMA bulk reductions
  ("float16", (1, 2, 1, 90, 70, 128, False), "contiguous", {"dq_accumulate": True, "stream_q": 64,
                                                           "dq_bulk_reduce": True}),
  # warp-specialized: a producer warpgroup filling a ring of stages counted by mbarriers (2 and 3 stages, GQA); the
  # 300-row cases keep three 128-row streams (the ring's phases wrap) on 2 heads over 1 kv head (cheap on the host)
  ("bfloat16", (1, 2, 1, 300, 300, 64, True), "contiguous", {"dq_accumulate": True, "block_kv": 128,
                                                             "stream_q": 128, "dq_reduce_width": 4,
                                                             "warp_specialized": True}),
  ("float16", (1, 4, 1, 150, 97, 64, True), "projected", {"dq_accumulate": True, "block_kv": 128, "stream_q": 128,
                                                          "warp_specialized": True, "ring_stages": 3}),
  ("bfloat16", (1, 2, 2, 83, 90, 64, False), "contiguous", {"dq_accumulate": True, "stream_q": 64,
                                                            "warp_specialized": True}),
  # the two kernels' dK/dV kernel warp-specialized (two consumer warpgroups that never meet; one)
  ("bfloat16", (1, 2, 1, 300, 290, 64, True), "contiguous", {"block_kv": 128, "stream_q": 128,
                                                             "warp_specialized": True}),
  ("float16", (1, 2, 1, 90, 70, 128, False), "projected", {"stream_q": 64, "warp_specialized": True}),
  # and its dQ staged, added by the producer's writer thread (bulk reductions)
  ("bfloat16", (1, 2, 1, 300, 290, 64, True), "projected", {"dq_accumulate": True, "block_kv": 128, "stream_q": 128,
                                                            "warp_specialized": True, "dq_bulk_reduce": True}),
  ("float16", (1, 2, 1, 90, 70, 128, False), "contiguous", {"dq_accumulate": True, "stream_q": 64,
                                                           "warp_specialized": True, "dq_bulk_reduce": True}),
]


@pytest.mark.skipif(host_compiler() is None, reason="no g++ to run the kernels' source on the host")
@pytest.mark.parametrize("dtype,case,layout,fields", WGMMA_HOST_CASES, ids=lambda value: str(value))
def test_wgmma_kernel_source_run_on_host_matches_torch(dtype: str, case: tuple, layout: str, fields: dict):
  """The wgmma kernels' CUDA source (swizzled stage tiles, descriptors, register A fragments) through the harness's
  wgmma (the PTX ISA's operand layouts) against torch's float64 gradients."""
  _check_on_host(dtype, case, layout, {"mma": "wgmma", **fields})


def _check_on_host(dtype: str, case: tuple, layout: str, fields: dict) -> None:
  """Both kernels of the plan of `case` (its fields replaced by `layout`'s and `fields`) run on the host, against
  the emulator and torch's float64 gradients."""
  batch, heads, kv_heads, q_len, kv_len, head_dim, causal = case
  plan = AttentionBackwardPlan.contiguous(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, causal, **fields)
  arrays, expected = reference(plan)
  projected = layout == "projected"
  if layout == "held": plan = AttentionBackwardPlan(**{**plan.__dict__, "dq_held": True, "dkdv_held": True})
  if layout == "unheld": plan = AttentionBackwardPlan(**{**plan.__dict__, "dq_held": False})
  if layout == "grad32": plan = AttentionBackwardPlan(**{**plan.__dict__, "grad_float32": True})
  if layout == "wide":
    plan = AttentionBackwardPlan(**{**plan.__dict__, "block_q": 128, "block_kv": 128, "stream_q": 64, "stream_kv": 64})
  if layout == "split":
    plan = AttentionBackwardPlan(**{**plan.__dict__, "block_q": 32, "stream_kv": 16, "block_kv": 32, "stream_q": 48})
  if projected:
    projection = (q_len * heads * head_dim, head_dim, heads * head_dim)
    plan = AttentionBackwardPlan(**{**plan.__dict__, "q_strides": projection, "o_strides": projection,
                                    "dq_strides": projection})
    for name in ("q", "o"): arrays[name] = arrays[name].transpose(0, 2, 1, 3)
  if layout == "padded":   # k and o rows D + 1 apart: element loads of k's tiles and of O (delta)
    for name, heads_of in (("k", kv_heads), ("o", heads)):
      padded = np.zeros((*arrays[name].shape[:3], head_dim + 1), arrays[name].dtype)
      padded[..., :head_dim] = arrays[name]
      arrays[name] = padded
      rows = arrays[name].shape[2]
      plan = AttentionBackwardPlan(**{**plan.__dict__, f"{name}_strides": (heads_of * rows * (head_dim + 1),
                                                                          rows * (head_dim + 1), head_dim + 1)})
    assert plan.vector_width == plan.o_vector_width == 1
  buffers = {name: array.reshape(-1) for name, array in arrays.items()}
  if projected:   # O in float32, LSE after it in one buffer, as the fused forward writes them
    plan = AttentionBackwardPlan(**{**plan.__dict__, "lse_offset": buffers["o"].size, "o_dtype": "float32"})
    buffers["o"] = to_float32(buffers["o"], dtype)
    buffers["lse"] = buffers["o"] = np.concatenate([buffers["o"], buffers["lse"]])
  grad_type = STORAGE[plan.grad_dtype]
  buffers.update(dq=np.zeros(buffers["q"].size, grad_type), dk=np.zeros(buffers["v"].size, grad_type),
                 dv=np.zeros(buffers["v"].size, grad_type), delta=np.zeros(plan.delta_elements, np.float32))
  if plan.dq_accumulate:   # the single pass's float32 dQ, (B, H, L, D) whatever dq's layout, and counts: stale
    buffers["dq_accum"] = np.full(batch * heads * q_len * head_dim, 7.0, np.float32)   # values zeroed first
    buffers["dq_counts"] = np.full(plan.count_elements, 5, np.uint32)
  state = run_on_host(plan, buffers)
  if plan.dq_swizzled:   # the emulator writes dq_accum's columns in order: column c of row r is stored at c ^ 8 (r % 8)
    rows, columns = np.arange(q_len)[:, None], np.arange(head_dim)[None, :]
    stored = state["dq_accum"].reshape(batch, heads, q_len, head_dim)
    state["dq_accum"] = stored[:, :, rows, columns ^ ((rows & 7) << 3)].reshape(-1)
  emulated = {name: array.copy() for name, array in buffers.items()}
  emulate_attention_backward_buffers(plan, emulated)
  for name in ("dq", "dk", "dv", "delta") + (("dq_accum",) if plan.dq_accumulate else ()):
    # (the PYTHON device's emulation writes the same buffers)
    kind = "float32" if name in ("delta", "dq_accum") else plan.grad_dtype
    difference = np.abs(to_float32(emulated[name], kind) - to_float32(state[name], kind)).max()
    assert difference <= 1e-2 * np.abs(to_float32(state[name], kind)).max(), name
  dq = state["dq"].reshape((batch, q_len, heads, head_dim) if projected else (batch, heads, q_len, head_dim))
  results = (dq.transpose(0, 2, 1, 3) if projected else dq, state["dk"].reshape(expected[1].shape),
             state["dv"].reshape(expected[2].shape))
  kinds = (plan.grad_dtype,) * 3
  if plan.dq_accumulate:   # the single pass: its float32 sums too
    results, kinds = (*results, state["dq_accum"].reshape(expected[0].shape)), (*kinds, "float32")
    expected = (*expected, expected[0])
  for name, result, want, kind in zip(("dq", "dk", "dv", "dq_accum"), results, expected, kinds):
    error = np.abs(to_float32(result, kind) - want).max() / np.abs(want).max()
    assert error < TOLERANCE[dtype], f"{name} {dtype} {case}: relative error {error:.2e}"


def test_device_mma_choice(monkeypatch):
  """with_device_mma: wgmma for 16-bit operands with D a multiple of 64 and 16-byte aligned rows on a wgmma device;
  float32, other head sizes, unaligned rows and other devices keep mma.sync; ATTENTION_BACKWARD_WGMMA=0 opts out."""
  plan = AttentionBackwardPlan.contiguous(2, 12, 4, 1000, 1000, 64, "bfloat16", True)
  assert plan.mma == "mma_sync" and plan.with_device_mma(False) == plan
  chosen = plan.with_device_mma(True)
  assert (chosen.mma, chosen.block_q, chosen.block_kv) == ("wgmma", 64, 64)
  assert (chosen.dq_stream, chosen.dkdv_stream, chosen.dq_held, chosen.dkdv_held) == (32, 128, True, False)
  assert launches(chosen)[0].grid == launches(plan)[0].grid and launches(chosen)[1].block == launches(plan)[1].block
  for other in (AttentionBackwardPlan.contiguous(1, 2, 2, 64, 64, 64, "float32", True),
                AttentionBackwardPlan.contiguous(1, 2, 2, 64, 64, 32, "float16", True),
                AttentionBackwardPlan.contiguous(1, 2, 2, 64, 64, 192, "bfloat16", True),
                AttentionBackwardPlan(**{**plan.__dict__, "k_strides": (64 * 1000 * 5, 1000 * 65, 65)})):
    assert other.with_device_mma(True).mma == "mma_sync"
  with pytest.raises(ShapeError, match="wgmma attention backward refuses float32"):
    AttentionBackwardPlan.contiguous(1, 2, 2, 64, 64, 64, "float32", True, mma="wgmma")
  with pytest.raises(ShapeError, match="whole warpgroups"):
    AttentionBackwardPlan.contiguous(1, 2, 2, 64, 64, 64, "bfloat16", True, mma="wgmma", block_kv=32)
  from ourgrad.codegen.attention_grad import backward_plan
  from ourgrad.shape.view import View
  q_view = View.create((2, 12, 1000, 64))
  k_view = View.create((2, 4, 1000, 64))
  monkeypatch.setenv("ATTENTION_BACKWARD_WGMMA", "1")
  assert backward_plan(q_view, k_view, k_view, q_view, "bfloat16", True, 0.125, 0, has_wgmma=True).mma == "wgmma"
  monkeypatch.setenv("ATTENTION_BACKWARD_WGMMA", "0")
  assert backward_plan(q_view, k_view, k_view, q_view, "bfloat16", True, 0.125, 0, has_wgmma=True).mma == "mma_sync"


@pytest.mark.parametrize("fields", [{}, {"mma": "wgmma", "dq_accumulate": True, "dq_reduce_width": 4}],
                         ids=["two_kernels", "single_pass"])
def test_python_programs_run_the_launches_on_raw_buffers(fields):
  """The PYTHON device's programs, one per launch, on raw byte buffers in launch argument order; the plan (the
  single pass's fields too) read back from the program text."""
  plan = AttentionBackwardPlan.contiguous(2, 4, 2, 50, 37, 32 if not fields else 64, "bfloat16", True, **fields)
  arrays, expected = reference(plan)
  raw = {name: array.reshape(-1).view(np.uint8).copy() for name, array in arrays.items()}
  raw.update(dq=np.zeros_like(raw["q"]), dk=np.zeros_like(raw["k"]), dv=np.zeros_like(raw["v"]),
             delta=np.zeros(plan.delta_elements * 4, np.uint8), dq_accum=np.zeros(raw["q"].size * 2, np.uint8),
             dq_counts=np.zeros(plan.count_elements * 4, np.uint8))
  for kernel, launch in zip((DQ_KERNEL, DKDV_KERNEL), launches(plan)):
    binary = attention_backward_program_text(launch.name, plan, kernel).encode()
    assert is_attention_backward_program(binary)
    program = AttentionBackwardProgram(launch.name, binary)
    assert program.plan == plan
    program(*(raw[name] for name in launch.arguments), global_size=launch.grid, local_size=launch.block)
    with pytest.raises(ValueError, match="launched as"):
      program(*(raw[name] for name in launch.arguments), global_size=(1, 1, 1), local_size=launch.block)
  for name, want in zip(("dq", "dk", "dv"), expected):
    result = to_float32(raw[name].view(STORAGE["bfloat16"]), "bfloat16").reshape(want.shape)
    assert np.abs(result - want).max() / np.abs(want).max() < TOLERANCE["bfloat16"], name
