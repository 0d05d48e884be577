"""The fused (flash) attention kernel (Ops.ATTENTION, codegen/attention.py) against PyTorch's float64 SDPA.

The device is the PYTHON interpreter with CUDA's facts (`PythonRenderer("CUDA")`, as `DEVICE=PYTHON EMULATE=CUDA`),
whose attention emulator (runtime/attention_emulator.py) runs the kernel's plan; the CUDA source of every variant is
compiled with NVRTC where it loads. Forward and backward (the flash backward kernels, Ops.ATTENTION_DQ and
ATTENTION_DKDV, emulated by runtime/attention_backward_emulator.py; FUSED_ATTENTION_BACKWARD=0 the composite math
from the logsumexp) are checked for causal and not, odd lengths (L != S, not multiples of the tiles), float32 (TF32),
float16, bfloat16, strided q/k/v (GPT-2's views of one (B, T, 3, H, D) buffer), grouped-query attention; the cases
the kernel does not take keep the composite graph.
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
import sys

import numpy as np
import pytest
import torch

import ourgrad
from ourgrad import Tensor
from ourgrad.codegen.attention import Operand, plan_attention
from ourgrad.codegen.attention_render import render_attention
from ourgrad.dtype import dtypes
from ourgrad.engine.realize import run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.helpers import GlobalCounters, _float32_matmul_precision
from ourgrad.ops import Ops
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad import tensor_attention
from ourgrad.tensor_attention import fused_attention_refusal

from helpers import device_opens, emulated_gpu_tf32, nvrtc_compiler

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # extra/ lives at the repository root
from extra.models.gpt2 import GPT2, GPT2Config, load_torch_weights, make_torch_gpt2  # noqa: E402

DEVICE = "PYTHON"
TORCH_DTYPES = {dtypes.float32: torch.float32, dtypes.float16: torch.float16, dtypes.bfloat16: torch.bfloat16}
# relative (Frobenius) error allowed against float64: operands rounded to TF32 / float16 / bfloat16, P rounded too
TOLERANCES = {dtypes.float32: 3e-3, dtypes.float16: 3e-3, dtypes.bfloat16: 2e-2}


@pytest.fixture
def emulated_cuda(monkeypatch):
  """The PYTHON device as a CUDA GPU (the fused kernel emulated), TF32 allowed; fresh kernel and schedule caches."""
  monkeypatch.setenv("FUSED_ATTENTION", "1")   # the default: fused forward and backward, training too
  monkeypatch.delenv("FUSED_ATTENTION_BACKWARD", raising=False)
  with emulated_gpu_tf32(monkeypatch, "CUDA"): yield


def _random(*shape: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _relative_error(got: np.ndarray, want: torch.Tensor) -> float:
  want64 = want.detach().double().numpy()
  return float(np.linalg.norm(got.astype(np.float64) - want64) / np.linalg.norm(want64))


def _ourgrad_inputs(arrays: list[np.ndarray], dtype, requires_grad: bool = False) -> list[Tensor]:
  """Realized tensors of `dtype` (the values rounded to it) on the emulated GPU."""
  tensors = [Tensor(array, device=DEVICE).cast(dtype).realize() for array in arrays]
  for tensor in tensors: tensor.requires_grad = requires_grad
  return tensors


def _torch_inputs(tensors: list[Tensor]) -> list[torch.Tensor]:
  """float64 twins holding the same (rounded) values."""
  return [torch.tensor(t.cast(dtypes.float32).numpy(), dtype=torch.float64, requires_grad=True) for t in tensors]


def _attention_items(out: Tensor) -> list:
  """The fused attention items of the schedule that realizes `out` (run: scheduling gives the bases buffers)."""
  schedule = create_schedule([out.lazydata])
  run_schedule(schedule)
  return [item for item in schedule if any(node.op is Ops.ATTENTION for node in item.ast.walk())]


# ---------------------------------------------------------------- forward and backward against torch

@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.float16, dtypes.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length, source", [(64, 64), (70, 45), (33, 100)])
def test_forward_backward_against_torch(emulated_cuda, dtype, causal, length, source):
  _check_forward_backward(dtype, causal, length, source)


@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_wgmma_forward_backward_against_torch(monkeypatch, dtype, causal):
  """The PYTHON device as an H100 with ATTENTION_WGMMA=1: the forward's plan is the wgmma kernel's (emulated by its
  plan's arithmetic; its source runs in test_flash_attention_host.py), the backward the flash kernels (their wgmma
  plans; their source runs in test_flash_attention_backward.py)."""
  monkeypatch.setenv("FUSED_ATTENTION", "1")
  monkeypatch.setenv("ATTENTION_WGMMA", "1")
  monkeypatch.delenv("FUSED_ATTENTION_BACKWARD", raising=False)
  monkeypatch.delenv("ATTENTION_BLOCKS", raising=False)
  with emulated_gpu_tf32(monkeypatch, "CUDA_SM90"):
    plans = _check_forward_backward(dtype, causal, 70, 45)
  assert [plan.mma for plan in plans] == ["wgmma"]


@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("length, source, kv_heads", [(70, 45, 2), (33, 100, 1)])
def test_single_pass_forward_backward_against_torch(monkeypatch, dtype, causal, length, source, kv_heads):
  """ATTENTION_SINGLE_PASS=1 on the PYTHON device as an H100: the backward's delta kernel, the dK/dV kernel adding dQ
  into a float32 buffer (their plans' dq_accumulate) and dq's cast, against float64 torch (odd lengths, GQA)."""
  from ourgrad.codegen.attention_grad import AttentionGradKernel
  from ourgrad.device import Device
  monkeypatch.setenv("FUSED_ATTENTION", "1")
  monkeypatch.setenv("ATTENTION_SINGLE_PASS", "1")
  monkeypatch.delenv("FUSED_ATTENTION_BACKWARD", raising=False)
  with emulated_gpu_tf32(monkeypatch, "CUDA_SM90"):
    arrays = [_random(1, heads, rows, 64, seed=seed) for seed, heads, rows in ((7, 2, length), (8, kv_heads, source),
                                                                                 (9, kv_heads, source))]
    q, k, v = _ourgrad_inputs(arrays, dtype, requires_grad=True)
    grad = Tensor(_random(1, 2, length, 64, seed=10), device=DEVICE).cast(dtype).realize()
    q.scaled_dot_product_attention(k, v, is_causal=causal, enable_gqa=True).backward(grad)
    schedule = create_schedule([q.grad.lazydata, k.grad.lazydata, v.grad.lazydata])
    kernels = [AttentionGradKernel(item.ast, Device[DEVICE].renderer) for item in schedule
               if any(node.op in (Ops.ATTENTION_DQ, Ops.ATTENTION_DKDV) for node in item.ast.walk())]
    assert [kernel.plan.dq_accumulate for kernel in kernels] == [True, True]
    run_schedule(schedule)
    tq, tk, tv = _torch_inputs([q, k, v])
    want = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=True)
    want.backward(torch.tensor(grad.cast(dtypes.float32).numpy(), dtype=torch.float64))
    for got, twin in ((q, tq), (k, tk), (v, tv)):
      assert got.grad.dtype == dtype
      assert _relative_error(got.grad.cast(dtypes.float32).numpy(), twin.grad) < 2 * TOLERANCES[dtype]


def _check_forward_backward(dtype, causal: bool, length: int, source: int) -> list:
  """Forward and backward of a (2, 3, length, 64) attention against float64 torch; the forward kernels' plans."""
  from ourgrad.codegen.attention import AttentionKernel
  from ourgrad.device import Device
  batch, heads, head_dim = 2, 3, 64
  arrays = [_random(batch, heads, rows, head_dim, seed=seed) for seed, rows in ((1, length), (2, source), (3, source))]
  q, k, v = _ourgrad_inputs(arrays, dtype, requires_grad=True)
  out = q.scaled_dot_product_attention(k, v, is_causal=causal)
  items = _attention_items(out)
  assert len(items) == 1
  plans = [AttentionKernel(item.ast, Device[DEVICE].renderer).plan for item in items]
  grad_np = _random(batch, heads, length, head_dim, seed=4)
  (out.cast(dtypes.float32) * Tensor(grad_np, device=DEVICE)).sum().backward()
  tq, tk, tv = _torch_inputs([q, k, v])
  want = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
  (want * torch.tensor(grad_np, dtype=torch.float64)).sum().backward()
  assert out.dtype == dtype and out.shape == (batch, heads, length, head_dim)
  assert _relative_error(out.cast(dtypes.float32).numpy(), want) < TOLERANCES[dtype]
  for got, twin in ((q, tq), (k, tk), (v, tv)):
    assert got.grad.dtype == dtype
    assert _relative_error(got.grad.cast(dtypes.float32).numpy(), twin.grad) < 2 * TOLERANCES[dtype]
  return plans


@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.bfloat16])
def test_logsumexp_matches_torch(emulated_cuda, dtype):
  """The kernel's second output: the natural-log logsumexp of each query row, (B, H, L), float32 (with 16-bit
  operands its bytes follow the 16-bit O in the same buffer)."""
  from ourgrad.tensor_attention import split_attention_output
  batch, heads, length, source, head_dim = 1, 2, 50, 90, 64
  arrays = [_random(batch, heads, rows, head_dim, seed=seed) for seed, rows in ((5, length), (6, source), (7, source))]
  q, k, v = _ourgrad_inputs(arrays, dtype)
  flat = q.lazydata.attention(k.lazydata, v.lazydata, True, 0.125)
  _, lse = split_attention_output(flat, q.shape)
  got = Tensor(lse, device=DEVICE).numpy()
  assert got.dtype == np.float32
  q64, k64 = (torch.tensor(t.cast(dtypes.float32).numpy(), dtype=torch.float64) for t in (q, k))
  scores = (q64 @ k64.transpose(-1, -2) * 0.125).masked_fill(~torch.ones(length, source, dtype=torch.bool).tril(),
                                                             -math.inf)
  np.testing.assert_allclose(got, torch.logsumexp(scores, -1).numpy(), atol=2e-3 if dtype == dtypes.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.bfloat16])
def test_gpt2_strided_views_read_in_place(emulated_cuda, dtype):
  """q, k, v as GPT-2 makes them: views of one (B, T, 3, H, D) buffer, read through their strides (no copies) by the
  forward and by both backward kernels; y transposed back to (B, T, H * D)."""
  from ourgrad.codegen.attention_grad import is_attention_grad
  batch, tokens, heads, head_dim = 2, 80, 2, 64
  qkv = _ourgrad_inputs([_random(batch, tokens, 3 * heads * head_dim, seed=8)], dtype, requires_grad=True)[0]
  qkv_np = qkv.cast(dtypes.float32).numpy()
  q, k, v = (qkv.reshape(batch, tokens, 3, heads, head_dim)[:, :, i].transpose(1, 2) for i in range(3))
  y = q.scaled_dot_product_attention(k, v, is_causal=True).transpose(1, 2).reshape(batch, tokens, heads * head_dim)
  items = _attention_items(y)
  assert len(items) == 1 and len(items[0].inputs) == 1   # one buffer holds q, k and v
  y = y.cast(dtypes.float32)
  y.sum().backward()
  schedule = create_schedule([qkv.grad.lazydata])
  run_schedule(list(schedule))   # (scheduling gave the bases buffers: their kernels must run)
  backward = [item for item in schedule if is_attention_grad(item.ast)]
  # dQ: qkv, the forward's buffer, dO; dK/dV: the same (and delta in the dQ buffer, which is its own output: the
  # gradients of q, k, v tile qkv, so both write one buffer, qkv's gradient, in its (B, T, 3 * H * D) layout)
  assert [len(item.inputs) for item in backward] == [3, 3]
  assert all(item.inputs[0] is items[0].inputs[0] for item in backward)
  assert backward[0].outputs[0] is backward[1].outputs[0] is schedule[-1].outputs[0]   # no concatenation after them
  tqkv = torch.tensor(qkv_np, dtype=torch.float64, requires_grad=True)
  tq, tk, tv = (tqkv.reshape(batch, tokens, 3, heads, head_dim)[:, :, i].transpose(1, 2) for i in range(3))
  want = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
  want = want.transpose(1, 2).reshape(batch, tokens, heads * head_dim)
  want.sum().backward()
  assert _relative_error(y.numpy(), want) < TOLERANCES[dtype]
  assert _relative_error(qkv.grad.cast(dtypes.float32).numpy(), tqkv.grad) < 2 * TOLERANCES[dtype]


@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.bfloat16])
def test_grouped_query_attention(emulated_cuda, dtype):
  batch, heads, kv_heads, length, head_dim = 1, 4, 2, 40, 64
  arrays = [_random(batch, h, length, head_dim, seed=s) for s, h in ((9, heads), (10, kv_heads), (11, kv_heads))]
  q, k, v = _ourgrad_inputs(arrays, dtype, requires_grad=True)
  out = q.scaled_dot_product_attention(k, v, is_causal=True, enable_gqa=True)
  assert len(_attention_items(out)) == 1
  out.cast(dtypes.float32).sum().backward()
  tq, tk, tv = _torch_inputs([q, k, v])
  want = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
  want.sum().backward()
  assert _relative_error(out.cast(dtypes.float32).numpy(), want) < TOLERANCES[dtype]
  for got, twin in ((q, tq), (k, tk), (v, tv)):
    assert _relative_error(got.grad.cast(dtypes.float32).numpy(), twin.grad) < 2 * TOLERANCES[dtype]


def test_head_dim_128_and_three_dims(emulated_cuda):
  """D = 128 (a narrower key tile for TF32), and q, k, v without a head axis (B, L, D)."""
  arrays = [_random(3, rows, 128, seed=seed) for seed, rows in ((12, 20), (13, 36), (14, 36))]
  q, k, v = _ourgrad_inputs(arrays, dtypes.float32)
  out = q.scaled_dot_product_attention(k, v, scale=0.3)
  assert len(_attention_items(out)) == 1
  want = torch.nn.functional.scaled_dot_product_attention(*_torch_inputs([q, k, v]), scale=0.3)
  assert _relative_error(out.numpy(), want) < TOLERANCES[dtypes.float32]


def test_gpt2_loss_and_gradients(emulated_cuda, monkeypatch):
  """A GPT-2 block (head size 64, TF32) whose attention is the fused kernel: loss and every gradient against the
  PyTorch twin in float64."""
  monkeypatch.setenv("DEVICE", DEVICE)   # the model's parameters too
  fused_backwards: list[bool] = []
  refusal = tensor_attention.fused_backward_refusal
  monkeypatch.setattr(tensor_attention, "fused_backward_refusal",
                      lambda q, k: fused_backwards.append(refusal(q, k) is None) or refusal(q, k))
  config = GPT2Config(n_layer=1, n_head=2, n_embd=128, vocab_size=64, block_size=20)
  torch_model = make_torch_gpt2(config).double()
  model = GPT2(config)
  load_torch_weights(model, torch_model)
  rng = np.random.default_rng(27)
  tokens, targets = (rng.integers(0, 64, (1, 20)).astype(np.int32) for _ in range(2))
  with Tensor.train():
    loss = model(Tensor(tokens, device=DEVICE), Tensor(targets, device=DEVICE))[1]
    loss.backward()
  want = torch_model(torch.from_numpy(tokens).long(), torch.from_numpy(targets).long())[1]
  want.backward()
  assert loss.item() == pytest.approx(want.item(), rel=1e-4)
  # its backward ran as the flash backward kernels (asked when q, k, v were packed at the forward, and at the backward)
  assert fused_backwards == [True, True]
  theirs = dict(torch_model.named_parameters())
  for name, param in model.named_parameters():
    assert _relative_error(param.grad.numpy(), theirs[name].grad) < 5e-3, name


# ---------------------------------------------------------------- kernel counts

def test_forward_is_one_kernel(emulated_cuda):
  arrays = [_random(2, 2, 64, 64, seed=seed) for seed in (15, 16, 17)]
  q, k, v = _ourgrad_inputs(arrays, dtypes.float32)
  GlobalCounters.reset()
  q.scaled_dot_product_attention(k, v, is_causal=True).realize()
  assert GlobalCounters.kernel_count == 1


@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16])
def test_16bit_forward_is_one_kernel(emulated_cuda, dtype):
  """O is written in the operands' dtype beside the float32 logsumexp: no cast kernel after it."""
  q, k, v = _ourgrad_inputs([_random(1, 2, 64, 64, seed=seed) for seed in (18, 19, 20)], dtype)
  GlobalCounters.reset()
  out = q.scaled_dot_product_attention(k, v).realize()
  assert GlobalCounters.kernel_count == 1 and out.dtype == dtype


# ---------------------------------------------------------------- the composite graph where the kernel does not run

@pytest.mark.parametrize("case, reason", [
  ("mask", "attn_mask"), ("dropout", "dropout_p"), ("head_dim", "head size 40"), ("highest", "no TF32"),
  ("broadcast", "batch sizes differ")])
def test_refusals_keep_the_composite_graph(emulated_cuda, case, reason):
  head_dim = 40 if case == "head_dim" else 64
  q, k, v = (Tensor(_random(2, 2, 16, head_dim, seed=seed), device=DEVICE) for seed in (21, 22, 23))
  if case == "broadcast": k, v = k[:1], v[:1]
  mask = Tensor(np.tril(np.ones((16, 16), dtype=bool)), device=DEVICE) if case == "mask" else None
  dropout = 0.1 if case == "dropout" else 0.0
  if case == "highest": ourgrad.set_float32_matmul_precision("highest")
  refusal = fused_attention_refusal(q, k, v, mask, dropout, False)
  assert refusal is not None and reason in refusal
  out = q.scaled_dot_product_attention(k, v, attn_mask=mask, dropout_p=dropout)
  assert not _attention_items(out)
  if dropout == 0.0:
    torch_mask = None if mask is None else torch.tensor(mask.numpy())
    want = torch.nn.functional.scaled_dot_product_attention(*(torch.tensor(t.numpy()) for t in (q, k, v)),
                                                            attn_mask=torch_mask)
    np.testing.assert_allclose(out.numpy(), want.numpy(), atol=1e-5)


def test_training_uses_the_fused_kernels_by_default(emulated_cuda, monkeypatch):
  """FUSED_ATTENTION=1 (the default) fuses the forward of training too, and FUSED_ATTENTION_BACKWARD=1 (the default)
  runs its backward as the two flash backward kernels; FUSED_ATTENTION_BACKWARD=0 keeps the composite backward math."""
  q, k, v = (Tensor(_random(1, 2, 16, 64, seed=seed), device=DEVICE, requires_grad=True) for seed in (36, 37, 38))
  assert fused_attention_refusal(q, k, v, None, 0.0, False) is None
  assert _backward_attention_ops(q, k, v, causal=True) == [Ops.ATTENTION_DQ, Ops.ATTENTION_DKDV]
  monkeypatch.setenv("FUSED_ATTENTION_BACKWARD", "0")
  assert _backward_attention_ops(q, k, v, causal=True) == []


def _backward_attention_ops(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> list[Ops]:
  """The fused attention backward ops of the schedule of q, k and v's gradients (the forward run first)."""
  for tensor in (q, k, v): tensor.grad = None
  out = q.scaled_dot_product_attention(k, v, is_causal=causal)
  assert len(_attention_items(out)) == 1
  out.sum().backward()
  schedule = create_schedule([t.grad.lazydata for t in (q, k, v)])
  return [node.op for item in schedule for node in item.ast.walk() if node.op in (Ops.ATTENTION_DQ, Ops.ATTENTION_DKDV)]


@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.bfloat16])
def test_training_step_attention_is_three_kernels(emulated_cuda, dtype):
  """A training step's attention: the forward kernel, then the dQ and the dK/dV kernels; each gradient is a view of
  their outputs in the operands' dtype (no cast, none of the composite backward's (B, H, L, S) matmuls; bfloat16 O's
  cast is not needed when only gradients are realized)."""
  q, k, v = _ourgrad_inputs([_random(2, 2, 64, 64, seed=seed) for seed in (39, 40, 41)], dtype, True)
  grad = Tensor(_random(2, 2, 64, 64, seed=42), device=DEVICE).cast(dtype).realize()
  GlobalCounters.reset()
  q.scaled_dot_product_attention(k, v, is_causal=True).backward(grad)
  Tensor.realize(q.grad, k.grad, v.grad)
  assert GlobalCounters.kernel_count == 3
  assert q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype


def _gpt2_step_kernels(layers: int) -> int:
  """Kernels of a GPT-2's training step (loss and every gradient; scheduled, not run) on the emulated GPU, at sizes
  where its matmuls take the WGMMA plan (their operands staged in plain buffers)."""
  config = GPT2Config(n_layer=layers, n_head=12, n_embd=768, vocab_size=512, block_size=512)
  model = GPT2(config)
  tokens, targets = (np.random.default_rng(seed).integers(0, 512, (8, 512)).astype(np.int32) for seed in (50, 51))
  with Tensor.train():
    loss = model(Tensor(tokens, device=DEVICE), Tensor(targets, device=DEVICE))[1]
    loss.backward()
    return len(create_schedule([t.lazydata for t in [loss] + [param.grad for param in model.parameters()]]))


def test_gpt2_step_writes_the_qkv_gradient_in_place(monkeypatch):
  """GPT-2's q, k, v are views of one c_attn output: the backward kernels write its gradient whole (packed), so a
  step on an sm_90 GPU (WGMMA matmuls, which read plain operands) has one kernel less a layer than with q, k, v's
  gradients concatenated after them."""
  monkeypatch.setenv("FUSED_ATTENTION", "1")
  monkeypatch.delenv("FUSED_ATTENTION_BACKWARD", raising=False)
  monkeypatch.setenv("DEVICE", DEVICE)   # the model's parameters too
  with emulated_gpu_tf32(monkeypatch, "CUDA_SM90"):
    packed = {layers: _gpt2_step_kernels(layers) for layers in (1, 2)}
    monkeypatch.setenv("FUSED_ATTENTION_PACKED", "0")
    concatenated = {layers: _gpt2_step_kernels(layers) for layers in (1, 2)}
  assert {layers: concatenated[layers] - packed[layers] for layers in (1, 2)} == {1: 1, 2: 2}


def test_packed_gradients_of_grouped_heads_match_torch(emulated_cuda):
  """q, k, v of a (B, 3, H, T, D)-style buffer with grouped-query heads (H query heads, then Hk key and Hk value
  heads): packed gradients, in the buffer's own layout, against torch float64."""
  batch, heads, kv_heads, length, head_dim = 2, 4, 2, 40, 32
  flat = _ourgrad_inputs([_random(batch, heads + 2 * kv_heads, length, head_dim, seed=52)], dtypes.bfloat16, True)[0]
  q, k, v = flat[:, :heads], flat[:, heads:heads + kv_heads], flat[:, heads + kv_heads:]
  assert tensor_attention.packed_source(q, k, v) is flat
  q.scaled_dot_product_attention(k, v, is_causal=True, enable_gqa=True).cast(dtypes.float32).sum().backward()
  twin = _torch_inputs([flat])[0]
  tq, tk, tv = twin[:, :heads], twin[:, heads:heads + kv_heads], twin[:, heads + kv_heads:]
  torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True).sum().backward()
  assert _relative_error(flat.grad.cast(dtypes.float32).numpy(), twin.grad) < 2 * TOLERANCES[dtypes.bfloat16]


def test_packed_gradients_replayed_by_the_schedule_cache(emulated_cuda):
  """The same packed step twice on new values: the second realize replays the cached schedule (the dK/dV op's buffer
  rebound to the dQ op's fresh one) and its gradient is still right."""
  import ourgrad.engine.schedule_cache as schedule_cache
  batch, heads, length, head_dim = 1, 2, 24, 32
  for seed in (54, 55):
    qkv = _ourgrad_inputs([_random(batch, length, 3 * heads * head_dim, seed=seed)], dtypes.float32, True)[0]
    q, k, v = (t.reshape(batch, length, heads, head_dim).transpose(1, 2) for t in qkv.split(heads * head_dim, dim=2))
    q.scaled_dot_product_attention(k, v, is_causal=True).sum().backward()
    hits = schedule_cache.stats.hits
    grad = qkv.grad.numpy()
    twin = _torch_inputs([qkv])[0]
    tq, tk, tv = (t.reshape(batch, length, heads, head_dim).transpose(1, 2)
                  for t in twin.split(heads * head_dim, dim=2))
    torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True).sum().backward()
    assert _relative_error(grad, twin.grad) < 2 * TOLERANCES[dtypes.float32]
  assert schedule_cache.stats.hits > hits   # the second gradient came from the cached schedule


def test_single_pass_packed_qkv_gradient(monkeypatch):
  """ATTENTION_SINGLE_PASS=1 with q, k, v views of one (B, T, 3 C) tensor on the emulated H100: the dK/dV kernel
  writes dq (converted from its float32 sums), dk and dv through the views into the base's gradient, odd length."""
  monkeypatch.setenv("FUSED_ATTENTION", "1")
  monkeypatch.setenv("ATTENTION_SINGLE_PASS", "1")
  monkeypatch.delenv("FUSED_ATTENTION_BACKWARD", raising=False)
  with emulated_gpu_tf32(monkeypatch, "CUDA_SM90"):
    batch, length, heads, head_dim = 2, 75, 2, 64
    qkv = _ourgrad_inputs([_random(batch, length, 3 * heads * head_dim, seed=57)], dtypes.bfloat16, True)[0]
    q, k, v = (t.reshape(batch, length, heads, head_dim).transpose(1, 2) for t in qkv.split(heads * head_dim, dim=2))
    out = q.scaled_dot_product_attention(k, v, is_causal=True)
    assert type(out._ctx).__name__ == "PackedFusedAttention"
    out.cast(dtypes.float32).sum().backward()
    assert qkv.grad.lazydata.base.op is Ops.ATTENTION_DKDV and qkv.grad.lazydata.base.arg[2:] == (True, True)
    twin = _torch_inputs([qkv])[0]
    tq, tk, tv = (t.reshape(batch, length, heads, head_dim).transpose(1, 2)
                  for t in twin.split(heads * head_dim, dim=2))
    torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True).sum().backward()
    assert _relative_error(qkv.grad.cast(dtypes.float32).numpy(), twin.grad) < 2 * TOLERANCES[dtypes.bfloat16]


def test_single_pass_replayed_by_the_schedule_cache(monkeypatch):
  """The single-pass step twice on new values: the second realize replays the cached schedule (the dK/dV op's buffer
  rebound to the delta kernel's fresh one, whose float32 dq it zeroes again) and its gradients are still right."""
  import ourgrad.engine.schedule_cache as schedule_cache
  monkeypatch.setenv("FUSED_ATTENTION", "1")
  monkeypatch.setenv("ATTENTION_SINGLE_PASS", "1")
  monkeypatch.delenv("FUSED_ATTENTION_BACKWARD", raising=False)
  with emulated_gpu_tf32(monkeypatch, "CUDA_SM90"):
    hits = schedule_cache.stats.hits
    for seed in (60, 63):
      q, k, v = _ourgrad_inputs([_random(1, 2, 40, 64, seed=seed + i) for i in range(3)], dtypes.bfloat16, True)
      q.scaled_dot_product_attention(k, v, is_causal=True).cast(dtypes.float32).sum().backward()
      grads = [t.grad.cast(dtypes.float32).numpy() for t in (q, k, v)]
      tq, tk, tv = _torch_inputs([q, k, v])
      torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True).sum().backward()
      for grad, twin in zip(grads, (tq, tk, tv)):
        assert _relative_error(grad, twin.grad) < 2 * TOLERANCES[dtypes.bfloat16]
  assert schedule_cache.stats.hits > hits   # the second step's gradients came from the cached schedule


def test_packed_gradient_when_the_kernels_are_refused_at_the_backward(emulated_cuda, monkeypatch):
  """Packed at the forward, FUSED_ATTENTION_BACKWARD=0 by the backward: the composite gradients, placed into the
  tensor q, k, v tile, against torch float64."""
  batch, heads, length, head_dim = 1, 2, 30, 32
  qkv = _ourgrad_inputs([_random(batch, length, 3 * heads * head_dim, seed=53)], dtypes.float32, True)[0]
  q, k, v = (t.reshape(batch, length, heads, head_dim).transpose(1, 2) for t in qkv.split(heads * head_dim, dim=2))
  out = q.scaled_dot_product_attention(k, v, is_causal=True)
  assert type(out._ctx).__name__ == "PackedFusedAttention"
  monkeypatch.setenv("FUSED_ATTENTION_BACKWARD", "0")
  out.sum().backward()
  twin = _torch_inputs([qkv])[0]
  tq, tk, tv = (t.reshape(batch, length, heads, head_dim).transpose(1, 2) for t in twin.split(heads * head_dim, dim=2))
  torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True).sum().backward()
  assert _relative_error(qkv.grad.numpy(), twin.grad) < 2 * TOLERANCES[dtypes.float32]


def test_composite_backward_still_matches(emulated_cuda, monkeypatch):
  """FUSED_ATTENTION_BACKWARD=0: the fused forward with the composite backward (the A/B of the flash kernels)."""
  monkeypatch.setenv("FUSED_ATTENTION_BACKWARD", "0")
  arrays = [_random(1, 2, rows, 64, seed=seed) for seed, rows in ((43, 50), (44, 70), (45, 70))]
  q, k, v = _ourgrad_inputs(arrays, dtypes.bfloat16, requires_grad=True)
  q.scaled_dot_product_attention(k, v, is_causal=True).cast(dtypes.float32).sum().backward()
  tq, tk, tv = _torch_inputs([q, k, v])
  torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True).sum().backward()
  for got, twin in ((q, tq), (k, tk), (v, tv)):
    assert _relative_error(got.grad.cast(dtypes.float32).numpy(), twin.grad) < 2 * TOLERANCES[dtypes.bfloat16]


def test_devices_without_the_kernel_keep_the_composite_graph():
  """Plain PYTHON (no EMULATE) and CLANG have no fused attention: sdpa builds today's graph."""
  q, k, v = (Tensor(_random(1, 2, 16, 64, seed=seed), device=DEVICE) for seed in (24, 25, 26))
  assert "no fused attention" in fused_attention_refusal(q, k, v, None, 0.0, False)
  assert not _attention_items(q.scaled_dot_product_attention(k, v, is_causal=True))


# ---------------------------------------------------------------- the CUDA source compiles (NVRTC, no GPU needed)

@pytest.mark.skipif(nvrtc_compiler() is None, reason="NVRTC does not load here")
@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.float16, dtypes.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
# (head size, rows 16-byte aligned): cp.async copies at D = 64, element-by-element copies at D = 128 (fewer compiles)
@pytest.mark.parametrize("head_dim, aligned", [(64, True), (128, False)])
def test_cuda_source_compiles(monkeypatch, dtype, causal, head_dim, aligned):
  monkeypatch.setenv("ATTENTION_WGMMA", "0")   # the mma.sync kernel's variants (test_attention_wgmma.py: wgmma's)
  length, source, heads = 100, 77, 4
  row = 3 * heads * head_dim
  # one (B, T, 3, H, D) buffer (aligned: cp.async copies) or rows with an odd offset (element by element)
  operands = [Operand(1, head_dim * part + (0 if aligned else 1), (length * row, head_dim, row, 1))
              for part in range(3)]
  plan = plan_attention(*operands, ((2, heads, length, head_dim), (2, heads // 2, source, head_dim)), dtype,
                        causal, 0.125, CUDARenderer("sm_90"))
  assert plan.vector_copies == aligned and plan.shared_bytes <= CUDARenderer.dynamic_local_memory_bytes
  assert plan.ldmatrix   # (ATTENTION_LDMATRIX=1, the default)
  # with ldmatrix of the K (16-bit: and V) fragments and with plain loads; the rule's tiles and the sweep's others
  others = [dataclasses.replace(plan, ldmatrix=False), dataclasses.replace(plan, block_m=128, block_n=128),
            dataclasses.replace(plan, block_m=64, block_n=32, stages=3),
            dataclasses.replace(plan, block_m=128, block_n=64, warp_tiles=2),
            dataclasses.replace(plan, block_m=128, block_n=64, min_ctas=2)]
  # the rule's plan in every case; each other variant in the half of the cases where dtype, causal, head size and the
  # variant's number add to an even number: still every variant with every dtype both causal and not, and with every
  # dtype at both head sizes (each compile is ~0.6 CPU-s of NVRTC)
  parity = [dtypes.float32, dtypes.float16, dtypes.bfloat16].index(dtype) + causal + (head_dim == 128)
  for variant in [plan] + [other for number, other in enumerate(others) if (parity + number) % 2 == 0]:
    nvrtc_compiler().compile(render_attention(variant, "attention", {"out": 0, "q": 1, "k": 1, "v": 1}))


@pytest.mark.skipif(nvrtc_compiler() is None, reason="NVRTC does not load here")
@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.bfloat16, dtypes.float16])
@pytest.mark.parametrize("case", ["gpt2", "gqa_d128"])
def test_backward_cuda_sources_compile(emulated_cuda, dtype, case):
  """The CUDA source of the dQ and dK/dV kernels of a training step (wrapper kernels binding the schedule item's
  buffers, the dependent-launch prologue of sm_90), as the CUDA device would build them from the same ASTs: GPT-2's
  strided q/k/v of one buffer, causal; GQA at D = 128 with contiguous operands, not causal."""
  from ourgrad.codegen.attention_grad import AttentionGradKernel, is_attention_grad
  from ourgrad.codegen.lowering import lower_kernel
  if case == "gpt2":
    qkv = _ourgrad_inputs([_random(2, 40, 3 * 2 * 64, seed=46)], dtype, requires_grad=True)[0]
    q, k, v = (qkv.reshape(2, 40, 3, 2, 64)[:, :, i].transpose(1, 2) for i in range(3))
    leaves, causal, gqa = [qkv], True, False
  else:
    arrays = [_random(1, h, 24, 128, seed=seed) for seed, h in ((47, 4), (48, 2), (49, 2))]
    leaves, causal, gqa = _ourgrad_inputs(arrays, dtype, requires_grad=True), False, True
    q, k, v = leaves
  out = q.scaled_dot_product_attention(k, v, is_causal=causal, enable_gqa=gqa)
  run_schedule(create_schedule([out.lazydata]))
  out.cast(dtypes.float32).sum().backward()
  items = [item for item in create_schedule([t.grad.lazydata for t in leaves]) if is_attention_grad(item.ast)]
  assert len(items) == 2
  renderer = CUDARenderer("sm_90")
  for item in items:
    kernel = AttentionGradKernel(item.ast, renderer)
    # 16-bit operands on sm_90: the wgmma kernels (codegen/attention_backward_wgmma.py)
    assert kernel.plan.mma == ("mma_sync" if dtype == dtypes.float32 else "wgmma")
    source = lower_kernel(kernel, renderer, kernel.name).source
    assert source.count('extern "C" __global__') == 1
    nvrtc_compiler().compile(source)


@pytest.mark.skipif(nvrtc_compiler() is None, reason="cuda-python's NVRTC is not installed here")
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("mode", ["1", "2"])
def test_single_pass_cuda_sources_compile(monkeypatch, packed, mode):
  """The single pass's two kernels as the CUDA device builds them (wrappers binding the float32 dq, delta and the
  counts in the schedule item's one buffer), compiled by NVRTC for sm_90; mode 2: the dK/dV kernel
  warp-specialized (a producer warpgroup: 384 threads)."""
  from ourgrad.codegen.attention_grad import AttentionGradKernel, is_attention_grad
  from ourgrad.codegen.lowering import lower_kernel
  monkeypatch.setenv("FUSED_ATTENTION", "1")
  monkeypatch.setenv("ATTENTION_SINGLE_PASS", mode)
  monkeypatch.delenv("FUSED_ATTENTION_BACKWARD", raising=False)
  with emulated_gpu_tf32(monkeypatch, "CUDA_SM90"):
    if packed:
      leaves = _ourgrad_inputs([_random(2, 40, 3 * 2 * 64, seed=46)], dtypes.bfloat16, requires_grad=True)
      q, k, v = (leaves[0].reshape(2, 40, 3, 2, 64)[:, :, i].transpose(1, 2) for i in range(3))
    else:
      leaves = _ourgrad_inputs([_random(1, 2, 24, 128, seed=seed) for seed in (47, 48, 49)], dtypes.bfloat16, True)
      q, k, v = leaves
    q.scaled_dot_product_attention(k, v, is_causal=True).cast(dtypes.float32).sum().backward()
    items = [item for item in create_schedule([t.grad.lazydata for t in leaves]) if is_attention_grad(item.ast)]
  renderer = CUDARenderer("sm_90")
  kernels = [AttentionGradKernel(item.ast, renderer) for item in items]
  assert [kernel.plan.dq_accumulate for kernel in kernels] == [True, True]
  assert [kernel.plan.warp_specialized for kernel in kernels] == [mode == "2"] * 2
  for kernel in kernels: nvrtc_compiler().compile(lower_kernel(kernel, renderer, kernel.name).source)


# ---------------------------------------------------------------- on a real GPU (skipped without one)

@pytest.mark.skipif(not device_opens("CUDA"), reason="no CUDA device here")
@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.float16, dtypes.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_device_against_torch(dtype, causal, head_dim, monkeypatch):
  """The CUDA kernel itself (sm_80+; 16-bit on sm_90: the wgmma forward and backward, whose tiles differ at D = 64 and
  128), odd lengths and GQA, forward and backward, against float64."""
  monkeypatch.setenv("FUSED_ATTENTION", "2")
  ourgrad.set_float32_matmul_precision("high")
  try:
    batch, heads, kv_heads, length, source = 2, 4, 2, 300, 200
    arrays = [_random(batch, h, rows, head_dim, seed=s)
              for s, h, rows in ((30, heads, length), (31, kv_heads, source), (32, kv_heads, source))]
    q, k, v = (Tensor(array, device="CUDA").cast(dtype).realize() for array in arrays)
    for tensor in (q, k, v): tensor.requires_grad = True
    out = q.scaled_dot_product_attention(k, v, is_causal=causal, enable_gqa=True)
    out.cast(dtypes.float32).sum().backward()
    tq, tk, tv = _torch_inputs([q, k, v])
    want = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, enable_gqa=True)
    want.sum().backward()
    assert _relative_error(out.cast(dtypes.float32).numpy(), want) < TOLERANCES[dtype]
    for got, twin in ((q, tq), (k, tk), (v, tv)):
      assert _relative_error(got.grad.cast(dtypes.float32).numpy(), twin.grad) < 2 * TOLERANCES[dtype]
  finally:
    _float32_matmul_precision[0] = None


@pytest.mark.skipif(not device_opens("CUDA"), reason="no CUDA device here")
@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mode", ["1", "2"])
def test_cuda_single_pass_against_torch(dtype, causal, head_dim, mode, monkeypatch):
  """The single-pass backward (ATTENTION_SINGLE_PASS=1, 2: warp-specialized; sm_90 only, else the two kernels) on
  the CUDA device: odd lengths and GQA against float64, as test_cuda_device_against_torch."""
  monkeypatch.setenv("ATTENTION_SINGLE_PASS", mode)
  test_cuda_device_against_torch(dtype, causal, head_dim, monkeypatch)


@pytest.mark.skipif(not device_opens("CUDA"), reason="no CUDA device here")
@pytest.mark.parametrize("mode", ["1", "2"])
def test_cuda_single_pass_packed_qkv_gradient(mode, monkeypatch):
  """The single-pass backward of GPT-2's packed q, k, v views on the CUDA device (bfloat16, odd length)."""
  monkeypatch.setenv("ATTENTION_SINGLE_PASS", mode)
  test_cuda_packed_qkv_gradient_against_torch(dtypes.bfloat16, monkeypatch)


@pytest.mark.skipif(not device_opens("CUDA"), reason="no CUDA device here")
@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.bfloat16])
def test_cuda_packed_qkv_gradient_against_torch(dtype, monkeypatch):
  """GPT-2's q, k, v views of one (B, T, 3 C) tensor on the CUDA device: its gradient written whole by the two
  backward kernels (packed), odd length, against float64."""
  monkeypatch.setenv("FUSED_ATTENTION", "2")
  ourgrad.set_float32_matmul_precision("high")
  try:
    batch, length, heads, head_dim = 2, 300, 4, 64
    qkv = Tensor(_random(batch, length, 3 * heads * head_dim, seed=56), device="CUDA").cast(dtype).realize()
    qkv.requires_grad = True
    q, k, v = (t.reshape(batch, length, heads, head_dim).transpose(1, 2) for t in qkv.split(heads * head_dim, dim=2))
    out = q.scaled_dot_product_attention(k, v, is_causal=True)
    assert type(out._ctx).__name__ == "PackedFusedAttention"
    out.cast(dtypes.float32).sum().backward()
    twin = _torch_inputs([qkv])[0]
    tq, tk, tv = (t.reshape(batch, length, heads, head_dim).transpose(1, 2)
                  for t in twin.split(heads * head_dim, dim=2))
    torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True).sum().backward()
    assert _relative_error(qkv.grad.cast(dtypes.float32).numpy(), twin.grad) < 2 * TOLERANCES[dtype]
  finally:
    _float32_matmul_precision[0] = None


# ---------------------------------------------------------------- the decision, printed

def test_decision_is_printed_at_debug_3(emulated_cuda, monkeypatch, capsys):
  q, k, v = (Tensor(_random(1, 2, 16, 64, seed=seed), device=DEVICE) for seed in (33, 34, 35))
  monkeypatch.setenv("DEBUG", "3")
  q.scaled_dot_product_attention(k, v, is_causal=True)
  q.scaled_dot_product_attention(k, v, dropout_p=0.5)
  printed = capsys.readouterr().out
  assert "attention: fused" in printed and "attention: composite because dropout_p=0.5" in printed


# ---------------------------------------------------------------- the plan's tile rule and its override

def _rule_plan(dtype, head_dim: int, batch: int = 4, heads: int = 12, length: int = 1024):
  operand = Operand(1, 0, (heads * length * head_dim, length * head_dim, head_dim, 1))
  shape = (batch, heads, length, head_dim)
  return plan_attention(operand, operand, operand, (shape, shape), dtype, True, 0.125, CUDARenderer("sm_90"))


def test_tile_rule(monkeypatch):
  """64 query rows a CTA; the key tile is the largest whose fragments fit the register budget and whose stages fit a
  third of the shared memory."""
  monkeypatch.delenv("ATTENTION_BLOCKS", raising=False)
  monkeypatch.setenv("ATTENTION_WGMMA", "0")   # the mma.sync kernel's rule (test_attention_wgmma.py: wgmma's)
  from ourgrad.codegen.attention import FRAGMENT_REGISTERS
  renderer = CUDARenderer("sm_90")
  for dtype, head_dim, want in ((dtypes.bfloat16, 64, (64, 128)), (dtypes.bfloat16, 128, (64, 64)),
                                (dtypes.float32, 64, (64, 64)), (dtypes.float32, 128, (64, 32))):
    plan = _rule_plan(dtype, head_dim)
    assert (plan.block_m, plan.block_n) == want, (dtype, head_dim)
    assert plan.fragment_registers <= FRAGMENT_REGISTERS
    assert plan.shared_bytes <= renderer.dynamic_local_memory_bytes // 3


def test_blocks_override(monkeypatch):
  monkeypatch.setenv("ATTENTION_WGMMA", "0")
  monkeypatch.setenv("ATTENTION_BLOCKS", "128,32,3,2")
  plan = _rule_plan(dtypes.bfloat16, 64)
  assert (plan.block_m, plan.block_n, plan.stages, plan.warp_tiles, plan.warps) == (128, 32, 3, 2, 4)
  monkeypatch.setenv("ATTENTION_BLOCKS", "128,64,2,1,2")
  plan = _rule_plan(dtypes.bfloat16, 64)
  assert (plan.warps, plan.min_ctas) == (8, 2)
  assert "__launch_bounds__(256, 2)" in render_attention(plan)
  monkeypatch.setenv("ATTENTION_BLOCKS", "48,64,2,2")   # 48 rows are not whole warps of 2 m tiles
  with pytest.raises(ValueError, match="ATTENTION_BLOCKS"): _rule_plan(dtypes.bfloat16, 64)
