"""Operand staging (engine/operand_staging.py): on a device with WGMMA and TF32 allowed, the scheduler stores a
matmul's operands K-major (and its result without an epilogue) so that every matmul of a Linear layer's forward and
backward runs on the WGMMA plan.

The device is the PYTHON interpreter with an H100's facts (`PythonRenderer("CUDA_SM90")`, as `DEVICE=PYTHON
EMULATE=CUDA_SM90`), whose WGMMA emulator runs the staged kernels; WGMMA_MIN_WORK is lowered so that matmuls of a few
hundred rows qualify. Values and gradients are checked against PyTorch in float64 (a TF32-sized tolerance); on CLANG
and on a GPU without WGMMA the schedule is the one made without the rule.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ourgrad
from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel, OptOps
from ourgrad.codegen.opt import tensor_core_plans
from ourgrad.device import Device
from ourgrad.engine import operand_staging, schedule_cache
from ourgrad.engine import schedule as scheduler
from ourgrad.engine.realize import run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.helpers import _float32_matmul_precision
from ourgrad.ops import Ops
from ourgrad.runtime.ops_python import PythonRenderer

from helpers import device_opens, emulated_gpu_tf32

DEVICE = "PYTHON"
TOKENS, WIDTH, HIDDEN = 256, 128, 256


@pytest.fixture
def hopper(monkeypatch):
  """The PYTHON device as an H100 (wgmma), TF32 allowed, small matmuls taking WGMMA; fresh kernel and schedule
  caches, so that nothing made for the emulated GPU reaches later tests."""
  monkeypatch.setattr(tensor_core_plans, "WGMMA_MIN_WORK", 1)
  monkeypatch.setattr(operand_staging, "WGMMA_MIN_WORK", 1)
  with emulated_gpu_tf32(monkeypatch, "CUDA_SM90"): yield


def _random(*shape: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _matmul_opts(schedule, device: str = DEVICE) -> list[list[OptOps]]:
  """The heuristic's opts (their kinds) on `device` for each kernel of `schedule` with a matmul-shaped SUM of a MUL."""
  chosen = []
  for item in schedule:
    if item.ast.op is Ops.COPY: continue
    sums = [node for node in item.ast.walk() if node.op is Ops.SUM]
    if len(sums) != 1 or not any(node.op is Ops.MUL for node in sums[0].walk()): continue
    kernel = Kernel(item.ast, Device[device].renderer)
    if len(kernel.full_shape) < 3: continue   # a plain (row or column) reduce
    kernel.hand_coded_optimizations()
    chosen.append([opt.op for opt in kernel.applied_opts])
  return chosen


def _relative_error(got: np.ndarray, want: torch.Tensor) -> float:
  want64 = want.detach().double().numpy()
  return float(np.linalg.norm(got.astype(np.float64) - want64) / np.linalg.norm(want64))


def _linear_step(device: str, layernorm: bool, tokens: int = TOKENS, width: int = WIDTH, hidden: int = HIDDEN):
  """A GPT-2-like Linear (bias, GELU after it) forward and backward: the tensors and the torch twins."""
  x_np, w_np, b_np, r_np = (_random(tokens, width, seed=1), _random(hidden, width, seed=2) * 0.1,
                            _random(hidden, seed=3), _random(tokens, hidden, seed=4))
  x, w, b = (Tensor(v, device=device, requires_grad=True) for v in (x_np, w_np, b_np))
  r = Tensor(r_np, device=device)
  x_in = x.layernorm() if layernorm else x
  y = x_in @ w.T + b
  loss = (y.gelu(approximate="tanh") * r).sum()
  loss.backward()
  tx, tw, tb = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (x_np, w_np, b_np))
  tx_in = torch.nn.functional.layer_norm(tx, (width,), eps=1e-5) if layernorm else tx
  ty = tx_in @ tw.T + tb
  (torch.nn.functional.gelu(ty, approximate="tanh") * torch.tensor(r_np, dtype=torch.float64)).sum().backward()
  return (y, x.grad, w.grad, b.grad), (ty, tx.grad, tw.grad, tb.grad)


@pytest.mark.parametrize("layernorm", [False, True], ids=["plain", "layernorm_input"])
def test_linear_forward_and_backward_all_take_wgmma(hopper, layernorm: bool) -> None:
  """Forward x @ W^T (+ bias, GELU), input gradient g @ W (W staged as W^T) and weight gradient g^T @ x (g^T and
  x^T staged): three WGMMA kernels, none on mma.sync; values and gradients as torch's in float64 within TF32."""
  ours, theirs = _linear_step(DEVICE, layernorm)
  schedule = create_schedule([tensor.lazydata for tensor in ours])
  opts = _matmul_opts(schedule)
  assert sorted(kinds == [OptOps.WGMMA] for kinds in opts) == [True] * 3, opts
  run_schedule(schedule)
  for got, want in zip(ours, theirs):
    assert _relative_error(got.numpy(), want) < 3e-3


@pytest.mark.parametrize("operand", ["cat_of_views", "scaled_sum"])
def test_expression_operand_is_staged(hopper, capsys, monkeypatch, operand: str) -> None:
  """An operand computed from loads, cheap enough that the recomputation rule leaves it fused: GPT-2's qkv gradient
  (a cat of gradients: an ADD of padded views) or a residual-style `q + 0.5 * k` (a LayerNorm or GELU output costs
  more and is stored by that rule before this one looks). Stored once in the layout WGMMA reads (the DEBUG=3 reason
  says so), then one WGMMA kernel; values as numpy's."""
  monkeypatch.setattr(operand_staging, "DEBUG", 3)
  monkeypatch.setattr(scheduler, "DEBUG", 3)
  parts = [_random(TOKENS, WIDTH, seed=seed) for seed in (5, 6)]
  q, k = (Tensor(part, device=DEVICE) for part in parts)
  if operand == "cat_of_views":
    # an add of two padded views (three: over the scheduler's recomputation limit, stored before this rule looks)
    left, left_np = q.cat(k, dim=1), np.concatenate(parts, axis=1).astype(np.float64)
  else:
    left, left_np = q + 0.5 * k, parts[0] + 0.5 * parts[1]
  w_np = _random(left_np.shape[1], WIDTH, seed=8)
  out = left @ Tensor(w_np, device=DEVICE)
  schedule = create_schedule([out.lazydata])
  printed = capsys.readouterr().out
  assert "staged K-major for WGMMA (an expression of loads)" in printed, printed
  assert _matmul_opts(schedule) == [[OptOps.WGMMA]]
  run_schedule(schedule)
  want = left_np.astype(np.float64) @ w_np
  assert _relative_error(out.numpy(), torch.tensor(want)) < 3e-3


def test_staged_schedule_is_cached_and_replayed(hopper) -> None:
  """The staged operands' buffers are scratch slots of the structural schedule cache: the same step built again
  hits the cache and gives the same values."""
  results = []
  for _ in range(2):
    ours, _ = _linear_step(DEVICE, layernorm=False)
    Tensor.realize_all(*ours)
    results.append([tensor.numpy() for tensor in ours])
  assert schedule_cache.stats.hits >= 1
  for first, second in zip(*results): np.testing.assert_array_equal(first, second)


def _kernel_count(device: str, staging: bool, monkeypatch) -> int:
  if not staging: monkeypatch.setattr(scheduler, "stage_matmul_operands", lambda bases, realizes: bases)
  ours, _ = _linear_step(device, layernorm=True)
  count = len(create_schedule([tensor.lazydata for tensor in ours]))
  monkeypatch.undo()
  return count


@pytest.mark.parametrize("renderer", ["CLANG", "CUDA_SM80", "NO_TF32"])
def test_schedule_unchanged_without_wgmma(renderer: str, monkeypatch) -> None:
  """On CLANG, on a GPU without wgmma (the PYTHON device as CUDA), and on an H100 without TF32 the rule stages
  nothing: the same number of kernels as without it."""
  ourgrad.set_float32_matmul_precision("high" if renderer != "NO_TF32" else "highest")
  try:
    device = "CLANG" if renderer == "CLANG" else DEVICE
    def patched() -> None:
      if renderer != "CLANG":
        monkeypatch.setattr(Device[DEVICE], "renderer", PythonRenderer("CUDA" if renderer == "CUDA_SM80" else
                                                                       "CUDA_SM90"))
      monkeypatch.setattr(operand_staging, "WGMMA_MIN_WORK", 1)
    patched()
    with_rule = _kernel_count(device, True, monkeypatch)
    patched()
    without_rule = _kernel_count(device, False, monkeypatch)
    assert with_rule == without_rule
  finally:
    _float32_matmul_precision[0] = None


def test_attention_sized_products_are_left_alone(hopper) -> None:
  """Per-head products with a 64-wide side (the head size, under the 128 tile) stage nothing: the schedule of
  softmax(q k^T) v is the one made without the rule."""
  q, k, v = (Tensor(_random(2, 256, 64, seed=seed), device=DEVICE) for seed in (9, 10, 11))
  out = (q @ k.transpose(1, 2) * 0.125).softmax() @ v
  bases = []
  original = scheduler.stage_matmul_operands

  def recording(graph_bases, realizes):
    staged = original(graph_bases, realizes)
    bases.append(len(staged) - len(graph_bases))
    return staged
  scheduler.stage_matmul_operands = recording
  try:
    create_schedule([out.lazydata])
  finally:
    scheduler.stage_matmul_operands = original
  assert bases == [0]


@pytest.mark.parametrize("low_dtype", [None, "bfloat16"], ids=["tf32", "autocast_bf16"])
def test_gpt2_step_gradients_on_emulated_hopper(hopper, monkeypatch, low_dtype: str | None) -> None:
  """A 1-layer GPT-2 (width 128, 128 tokens: every Linear matmul a multiple of the tile) forward and backward with
  staged operands, in float32 with TF32 or under bf16 autocast: every Linear's three matmuls and the tied
  embedding's take WGMMA, and the loss and every gradient match PyTorch's in float64 within TF32's (bf16's) error."""
  from ourgrad import autocast
  from extra.models.gpt2 import GPT2, GPT2Config, load_torch_weights, make_torch_gpt2
  if low_dtype is not None: ourgrad.set_float32_matmul_precision("highest")
  monkeypatch.setenv("DEVICE", DEVICE)   # the model's parameters are made on the default device
  config = GPT2Config(n_layer=1, n_head=2, n_embd=128, vocab_size=256, block_size=128)
  torch_model = make_torch_gpt2(config)
  model = GPT2(config)
  load_torch_weights(model, torch_model)
  torch_model = torch_model.double()
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (1, 129)).astype(np.int32)
  with Tensor.train():
    with autocast(low_dtype or "bfloat16", enabled=low_dtype is not None):
      loss = model(Tensor(tokens[:, :-1].copy(), device=DEVICE), Tensor(tokens[:, 1:].copy(), device=DEVICE))[1]
    loss.backward()
  params = dict(model.named_parameters())
  schedule = create_schedule([loss.lazydata] + [param.grad.lazydata for param in params.values()])
  wgmma = sum(kinds == [OptOps.WGMMA] for kinds in _matmul_opts(schedule))
  assert wgmma >= 4 * 3 + 2, wgmma   # c_attn, attn.c_proj, c_fc, mlp.c_proj: 3 each; logits and their input grad
  run_schedule(schedule)
  torch_tokens = torch.tensor(tokens, dtype=torch.long)
  torch_loss = torch_model(torch_tokens[:, :-1], torch_tokens[:, 1:])[1]
  torch_loss.backward()
  loss_tolerance, gradient_tolerance = (1e-3, 5e-3) if low_dtype is None else (1e-2, 5e-2)
  assert abs(loss.item() - torch_loss.item()) < loss_tolerance * abs(torch_loss.item())
  for name, param in dict(torch_model.named_parameters()).items():
    assert _relative_error(params[name].grad.numpy(), param.grad) < gradient_tolerance, name


def test_staged_weight_is_read_before_the_optimizer_writes_it(hopper) -> None:
  """In one schedule with the SGD update of W: the input gradient reads W through its staged copy (W^T), which must
  copy W before the update overwrites it. The input gradient and the updated W equal torch's."""
  from ourgrad.nn.optim import SGD
  x_np, w_np, r_np = _random(TOKENS, WIDTH, seed=14), _random(HIDDEN, WIDTH, seed=15), _random(TOKENS, HIDDEN, seed=16)
  x = Tensor(x_np, device=DEVICE, requires_grad=True)
  w = Tensor(w_np, device=DEVICE, requires_grad=True)
  optimizer = SGD([w], lr=0.5)
  with Tensor.train():
    loss = ((x @ w.T) * Tensor(r_np, device=DEVICE)).sum()
    loss.backward()
    Tensor.realize_all(loss, x.grad, *optimizer.schedule_step())
  tx = torch.tensor(x_np, dtype=torch.float64, requires_grad=True)
  tw = torch.tensor(w_np, dtype=torch.float64, requires_grad=True)
  ((tx @ tw.T) * torch.tensor(r_np, dtype=torch.float64)).sum().backward()
  assert _relative_error(x.grad.numpy(), tx.grad) < 3e-3
  assert _relative_error(w.numpy(), tw.detach() - 0.5 * tw.grad) < 3e-3


HOPPER = device_opens("CUDA") and getattr(Device["CUDA"].renderer, "has_wgmma", False)


@pytest.mark.skipif(not HOPPER, reason="needs CUDA on an sm_90 GPU (H100/H200)")
def test_cuda_linear_forward_and_backward() -> None:
  """On the GPU, a GPT-2-sized Linear (4096 tokens, 768 -> 3072) with TF32: its three matmuls take WGMMA at the
  default WGMMA_MIN_WORK, values and gradients as torch's in float64 within TF32's error."""
  ourgrad.set_float32_matmul_precision("high")
  try:
    ours, theirs = _linear_step("CUDA", layernorm=True, tokens=4096, width=768, hidden=3072)
    schedule = create_schedule([tensor.lazydata for tensor in ours])
    assert sorted(kinds == [OptOps.WGMMA] for kinds in _matmul_opts(schedule, "CUDA")) == [True] * 3
    run_schedule(schedule)
    for got, want in zip(ours, theirs):
      assert _relative_error(got.numpy(), want) < 3e-3
  finally:
    _float32_matmul_precision[0] = None


def test_convolution_windows_are_not_staged(hopper, monkeypatch) -> None:
  """A 3x3 convolution's weight gradient is matmul-shaped, but its input operand is a window view (im2col: each
  element read 9 times); staging would copy it 9 times over, so the schedule is the one made without the rule."""
  def conv_step_items() -> int:
    x = Tensor(_random(2, 128, 16, 16, seed=17), device=DEVICE, requires_grad=True)
    w = Tensor(_random(128, 128, 3, 3, seed=18), device=DEVICE, requires_grad=True)
    out = x.conv2d(w, padding=1).relu()
    out.sum().backward()
    return len(create_schedule([out.lazydata, x.grad.lazydata, w.grad.lazydata]))
  with_rule = conv_step_items()
  monkeypatch.setattr(scheduler, "stage_matmul_operands", lambda bases, realizes: bases)
  assert with_rule == conv_step_items()


@pytest.mark.parametrize("layernorm", [False, True], ids=["plain", "layernorm_input"])
def test_autocast_linear_all_take_wgmma_without_tf32(hopper, layernorm: bool) -> None:
  """Under bf16 autocast (float32 kept at full precision: no TF32) a Linear's three matmuls (bias and GELU after
  the forward, the input and weight gradients) all take the 16-bit WGMMA plan: the operands' bf16 values are staged
  where they are expressions (the weight's cast) and read in either layout; values as torch's in float64 within
  bfloat16's error."""
  from ourgrad import autocast, dtypes
  ourgrad.set_float32_matmul_precision("highest")
  x_np, w_np, b_np, r_np = (_random(TOKENS, WIDTH, seed=21), _random(HIDDEN, WIDTH, seed=22) * 0.1,
                            _random(HIDDEN, seed=23), _random(TOKENS, HIDDEN, seed=24))
  x, w, b = (Tensor(v, device=DEVICE, requires_grad=True) for v in (x_np, w_np, b_np))
  with autocast(dtypes.bfloat16):
    y = (x.layernorm() if layernorm else x).linear(w, b).gelu(approximate="tanh")
  (y.float() * Tensor(r_np, device=DEVICE)).sum().backward()
  ours = (y, x.grad, w.grad, b.grad)
  schedule = create_schedule([tensor.lazydata for tensor in ours])
  assert sorted(kinds == [OptOps.WGMMA] for kinds in _matmul_opts(schedule)) == [True] * 3, _matmul_opts(schedule)
  # the forward's and the input gradient's results are narrowed to bf16 by their readers: stored in bf16 (half the
  # bytes of their float32 sums); the weight gradient (a float32 parameter's, read transposed) in float32
  stored = sorted(item.outputs[0].dtype.name for item in schedule if item.ast.op is Ops.STORE and
                  len(Kernel(item.ast, Device[DEVICE].renderer).full_shape) >= 3)
  assert stored == ["bfloat16", "bfloat16", "float32"], stored
  run_schedule(schedule)
  tx, tw, tb = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (x_np, w_np, b_np))
  tx_in = torch.nn.functional.layer_norm(tx, (WIDTH,), eps=1e-5) if layernorm else tx
  ty = torch.nn.functional.gelu(tx_in @ tw.T + tb, approximate="tanh")
  (ty * torch.tensor(r_np, dtype=torch.float64)).sum().backward()
  for got, want in zip(ours, (ty, tx.grad, tw.grad, tb.grad)):
    assert _relative_error(got.float().numpy(), want) < 3e-2


def test_gpt2_autocast_step_linears_take_wgmma(hopper, monkeypatch) -> None:
  """The plans of a 1-layer GPT-2 training step under bf16 autocast (extra/bench/gpt2_matmul_plans.py --autocast):
  the three matmuls of each of the four Linears and the tied embedding's logits and input gradient (14) all take
  WGMMA without TF32; only the per-head attention products (a 64-wide side) keep mma.sync."""
  from extra.bench.gpt2_matmul_plans import step_outputs
  monkeypatch.setenv("DEVICE", DEVICE)
  ourgrad.set_float32_matmul_precision("highest")
  outs = step_outputs(1, 128, 128, 2, 1, 256, low_dtype="bfloat16")
  opts = _matmul_opts(create_schedule([tensor.lazydata for tensor in outs]))
  assert sum(kinds == [OptOps.WGMMA] for kinds in opts) >= 4 * 3 + 2, opts


def test_autocast_bias_add_before_gelu_is_recomputed_not_stored(hopper) -> None:
  """An MLP block under bf16 autocast: WGMMA stores the c_fc product without its bias (no epilogue), so h = mm + b
  is recomputed by its two readers (GELU forward, GELU's gradient) from the stored product instead of being stored
  by a kernel of its own (before: a full write and read of the hidden activation per layer, 0.07 ms of GPT-2's bf16
  step at 16 x 1024 on the H200). The hidden-sized buffers stored: the product, the GELU output (c_proj's operand),
  c_proj's input gradient and GELU's gradient (five with the bias add). Values as torch's in float64 within
  bfloat16's error."""
  from ourgrad import autocast, dtypes
  ourgrad.set_float32_matmul_precision("highest")
  x_np, w1_np, b1_np, w2_np, b2_np = (_random(TOKENS, WIDTH, seed=31), _random(HIDDEN, WIDTH, seed=32) * 0.1,
                                      _random(HIDDEN, seed=33), _random(WIDTH, HIDDEN, seed=34) * 0.1,
                                      _random(WIDTH, seed=35))
  x, w1, b1, w2, b2 = (Tensor(v, device=DEVICE, requires_grad=True) for v in (x_np, w1_np, b1_np, w2_np, b2_np))
  with autocast(dtypes.bfloat16):
    y = x.layernorm().linear(w1, b1).gelu(approximate="tanh").linear(w2, b2)
  y.float().square().sum().backward()
  ours = (y, x.grad, w1.grad, b1.grad, w2.grad, b2.grad)
  schedule = create_schedule([tensor.lazydata for tensor in ours])
  hidden_stores = [buffer.dtype.name for item in schedule for buffer in item.outputs if buffer.size == TOKENS * HIDDEN]
  assert hidden_stores == ["bfloat16"] * 4, hidden_stores
  run_schedule(schedule)
  tensors = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (x_np, w1_np, b1_np, w2_np, b2_np)]
  tx, tw1, tb1, tw2, tb2 = tensors
  hidden = torch.nn.functional.gelu(torch.nn.functional.layer_norm(tx, (WIDTH,), eps=1e-5) @ tw1.T + tb1,
                                    approximate="tanh")
  ty = hidden @ tw2.T + tb2
  ty.square().sum().backward()
  for got, want in zip(ours, (ty, *(tensor.grad for tensor in tensors))):
    assert _relative_error(got.float().numpy(), want) < 3e-2
