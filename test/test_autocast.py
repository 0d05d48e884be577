"""Mixed precision: which dtype each op runs in under ourgrad.autocast (against torch.autocast on the CPU where torch's
CPU and CUDA op lists agree, and against torch's documented CUDA lists where they differ), float32 master weights and
their gradients, nesting / enabled=False / threads / TinyJit, a small model's bf16 loss curve against torch's, and
GradScaler's skip-and-back-off against torch.amp.GradScaler. Module.to/.bfloat16/.float round-trips against torch."""
from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import ourgrad
from ourgrad import Tensor, TinyJit, dtypes, nn
from ourgrad.errors import DTypeError
from helpers import TORCH_DTYPES

rng = np.random.default_rng(0)
A = rng.standard_normal((4, 8)).astype(np.float32)
W = rng.standard_normal((3, 8)).astype(np.float32)
IMAGE = rng.standard_normal((1, 2, 5, 5)).astype(np.float32)
KERNEL = rng.standard_normal((3, 2, 3, 3)).astype(np.float32)
TARGET = np.array([0, 2, 1, 1])

# ops on which torch's CPU and CUDA autocast lists agree: (ourgrad, torch), both given float32 inputs
AGREED_OPS = {
  "matmul": (lambda: Tensor(A) @ Tensor(W).T, lambda: torch.tensor(A) @ torch.tensor(W).T),
  "linear": (lambda: Tensor(A).linear(Tensor(W)), lambda: TF.linear(torch.tensor(A), torch.tensor(W))),
  "bmm": (lambda: Tensor(A)[None].bmm(Tensor(W).T[None]),
          lambda: torch.bmm(torch.tensor(A)[None], torch.tensor(W).T[None])),
  "addmm": (lambda: Tensor.zeros(4, 3).addmm(Tensor(A), Tensor(W).T),
            lambda: torch.addmm(torch.zeros(4, 3), torch.tensor(A), torch.tensor(W).T)),
  "einsum": (lambda: Tensor.einsum("ij,kj->ik", Tensor(A), Tensor(W)),
             lambda: torch.einsum("ij,kj->ik", torch.tensor(A), torch.tensor(W))),
  "conv2d": (lambda: Tensor(IMAGE).conv2d(Tensor(KERNEL)),
             lambda: TF.conv2d(torch.tensor(IMAGE), torch.tensor(KERNEL))),
  "conv1d": (lambda: Tensor(IMAGE[:, :, 0]).conv1d(Tensor(KERNEL[:, :, 0])),
             lambda: TF.conv1d(torch.tensor(IMAGE[:, :, 0]), torch.tensor(KERNEL[:, :, 0]))),
  "conv_transpose2d": (lambda: Tensor(IMAGE).conv_transpose2d(Tensor(KERNEL).transpose(0, 1)),
                       lambda: TF.conv_transpose2d(torch.tensor(IMAGE), torch.tensor(KERNEL).transpose(0, 1))),
  "sdpa": (lambda: Tensor(A)[None].scaled_dot_product_attention(Tensor(A)[None], Tensor(A)[None]),
           lambda: TF.scaled_dot_product_attention(*[torch.tensor(A)[None]] * 3)),
  "cross_entropy": (lambda: Tensor(A).cast(dtypes.bfloat16).cross_entropy(Tensor(TARGET)),
                    lambda: TF.cross_entropy(torch.tensor(A).bfloat16(), torch.tensor(TARGET))),
  "nll_loss": (lambda: Tensor(A).cast(dtypes.bfloat16).nll_loss(Tensor(TARGET)),
               lambda: TF.nll_loss(torch.tensor(A).bfloat16(), torch.tensor(TARGET))),
  "mse_loss": (lambda: Tensor(A).cast(dtypes.bfloat16).mse_loss(Tensor(A).cast(dtypes.bfloat16)),
               lambda: TF.mse_loss(torch.tensor(A).bfloat16(), torch.tensor(A).bfloat16())),
  "bce_with_logits": (lambda: Tensor(A).cast(dtypes.bfloat16).binary_cross_entropy_with_logits(Tensor(A).sigmoid()),
                      lambda: TF.binary_cross_entropy_with_logits(torch.tensor(A).bfloat16(),
                                                                  torch.tensor(A).sigmoid())),
  "prod": (lambda: Tensor(A).cast(dtypes.bfloat16).prod(), lambda: torch.tensor(A).bfloat16().prod()),
  "relu": (lambda: Tensor(A).cast(dtypes.bfloat16).relu(), lambda: torch.tensor(A).bfloat16().relu()),
  "mean": (lambda: Tensor(A).cast(dtypes.bfloat16).mean(), lambda: torch.tensor(A).bfloat16().mean()),
  "gelu": (lambda: Tensor(A).cast(dtypes.bfloat16).gelu(), lambda: TF.gelu(torch.tensor(A).bfloat16())),
}

# torch's CUDA list runs these in float32 (torch.amp docs, "CUDA Ops that can autocast to float32"; rms_norm since
# torch 2.4); its CPU list leaves them in the input dtype, so the CPU cannot be the reference: a bfloat16 input must
# come out float32, with the values of the float32 op on the bfloat16-rounded input
FLOAT32_OPS = {
  "softmax": (lambda x: x.softmax(-1), lambda t: t.softmax(-1)),
  "log_softmax": (lambda x: x.log_softmax(-1), lambda t: t.log_softmax(-1)),
  "layernorm": (lambda x: x.layernorm(), lambda t: TF.layer_norm(t, t.shape[-1:])),
  "sum": (lambda x: x.sum(), lambda t: t.sum()),
  "cumsum": (lambda x: x.cumsum(1), lambda t: t.cumsum(1)),
  "exp": (lambda x: x.exp(), lambda t: t.exp()),
  "log": (lambda x: x.abs().log(), lambda t: t.abs().log()),
  "pow": (lambda x: x ** 2, lambda t: t ** 2),
  "rsqrt": (lambda x: x.abs().rsqrt(), lambda t: t.abs().rsqrt()),
  "rdiv": (lambda x: 1 / x, lambda t: 1 / t),
  "softplus": (lambda x: x.softplus(), lambda t: TF.softplus(t)),
  "LayerNorm": (lambda x: nn.LayerNorm(8)(x), lambda t: TF.layer_norm(t, (8,))),
  "RMSNorm": (lambda x: nn.RMSNorm(8, eps=1e-6)(x), lambda t: TF.rms_norm(t, (8,), eps=1e-6)),
  "GroupNorm": (lambda x: nn.GroupNorm(1, 4)(x.reshape(1, 4, 8)), lambda t: TF.group_norm(t.reshape(1, 4, 8), 1)),
  "BatchNorm": (lambda x: nn.BatchNorm1d(4)(x.reshape(1, 4, 8)),
                lambda t: TF.batch_norm(t.reshape(1, 4, 8), None, None, training=True)),
}


def _bf16_rounded(array: np.ndarray) -> torch.Tensor:
  return torch.tensor(array).bfloat16().double()


# torch's own bfloat16 convolutions on the CPU differ by CPU model (without AVX-512 its conv_transpose2d rounds more
# than once: 2 bfloat16 ulps off the exact value), so the value reference of these is the float64 op on the
# bfloat16-rounded inputs, rounded once to bfloat16 (what autocast means); the dtype still comes from torch.autocast
EXACT_VALUES = {
  "conv2d": lambda: TF.conv2d(_bf16_rounded(IMAGE), _bf16_rounded(KERNEL)),
  "conv1d": lambda: TF.conv1d(_bf16_rounded(IMAGE[:, :, 0]), _bf16_rounded(KERNEL[:, :, 0])),
  "conv_transpose2d": lambda: TF.conv_transpose2d(_bf16_rounded(IMAGE), _bf16_rounded(KERNEL).transpose(0, 1)),
}


@pytest.mark.parametrize("name", list(AGREED_OPS))
def test_op_dtype_and_value_match_torch_cpu_autocast(name: str):
  ourgrad_op, torch_op = AGREED_OPS[name]
  with ourgrad.autocast(dtypes.bfloat16):
    ours = ourgrad_op()
  with torch.autocast("cpu", dtype=torch.bfloat16):
    theirs = torch_op()
  assert TORCH_DTYPES[ours.dtype] == theirs.dtype
  if name in EXACT_VALUES: theirs = EXACT_VALUES[name]().bfloat16()
  # both round a float32-accumulated result once to bfloat16: at most a bfloat16 ulp apart (2^-8 relative)
  np.testing.assert_allclose(ours.float().numpy(), theirs.float().numpy(), rtol=2 ** -7, atol=2e-2)


@pytest.mark.parametrize("name", list(FLOAT32_OPS))
def test_float32_ops_follow_torch_cuda_list(name: str):
  ourgrad_op, torch_op = FLOAT32_OPS[name]
  low = Tensor(A).cast(dtypes.bfloat16)
  with ourgrad.autocast(dtypes.bfloat16):
    ours = ourgrad_op(low)
  assert ours.dtype == dtypes.float32
  expected = torch_op(torch.tensor(A).bfloat16().float())
  np.testing.assert_allclose(ours.numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)


def test_float64_is_never_cast():
  x = Tensor(A.astype(np.float64))
  with ourgrad.autocast(dtypes.bfloat16):
    assert (x @ x.T).dtype == dtypes.float64 and x.softmax().dtype == dtypes.float64


def test_explicit_dtype_argument_opts_out():
  with ourgrad.autocast(dtypes.bfloat16):
    assert Tensor(A).cast(dtypes.bfloat16).sum(dtype=dtypes.bfloat16).dtype == dtypes.bfloat16


def test_master_weights_get_float32_gradients_equal_to_torch():
  x, w = Tensor(A, requires_grad=True), Tensor(W, requires_grad=True)
  with ourgrad.autocast(dtypes.bfloat16):
    loss = x.linear(w).softmax(-1).square().sum()
  loss.backward()
  tx, tw = torch.tensor(A, requires_grad=True), torch.tensor(W, requires_grad=True)
  with torch.autocast("cpu", dtype=torch.bfloat16):
    # torch's CPU list keeps softmax in bfloat16; cast up by hand to run the CUDA list's graph
    tloss = TF.linear(tx, tw).float().softmax(-1).square().sum()
  tloss.backward()
  assert x.grad.dtype == w.grad.dtype == dtypes.float32 and w.dtype == dtypes.float32
  np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=2e-2, atol=2e-3)
  np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=2e-2, atol=2e-3)


def test_nesting_enabled_false_and_decorator():
  x, w = Tensor(A), Tensor(W)
  assert not ourgrad.is_autocast_enabled()
  with ourgrad.autocast("cuda", dtype=dtypes.float16):
    assert x.linear(w).dtype == dtypes.float16
    with ourgrad.autocast(dtypes.bfloat16):
      assert x.linear(w).dtype == dtypes.bfloat16
      with ourgrad.autocast(enabled=False):
        assert x.linear(w).dtype == dtypes.float32 and not ourgrad.is_autocast_enabled()
      assert ourgrad.get_autocast_dtype() == dtypes.bfloat16
    assert x.linear(w).dtype == dtypes.float16
  assert x.linear(w).dtype == dtypes.float32

  @ourgrad.autocast("bfloat16")
  def forward() -> Tensor: return x.linear(w)
  assert forward().dtype == dtypes.bfloat16 and not ourgrad.is_autocast_enabled()
  with pytest.raises(DTypeError): ourgrad.autocast(dtypes.float32)


def test_autocast_is_per_thread():
  seen: list = []
  started, release = threading.Event(), threading.Event()

  def other_thread() -> None:
    started.set()
    release.wait(5)
    seen.append(Tensor(A).linear(Tensor(W)).dtype)

  thread = threading.Thread(target=other_thread)
  thread.start()
  started.wait(5)
  with ourgrad.autocast(dtypes.bfloat16):
    release.set()
    thread.join(10)
    assert Tensor(A).linear(Tensor(W)).dtype == dtypes.bfloat16
  assert seen == [dtypes.float32]


def test_autocast_state_survives_an_exception():
  with pytest.raises(ValueError), ourgrad.autocast(dtypes.bfloat16):
    raise ValueError("inside")
  assert not ourgrad.is_autocast_enabled()


def test_tinyjit_under_autocast_replays_and_recaptures_on_another_state():
  w = Tensor(W).realize()

  @TinyJit
  def forward(x: Tensor) -> Tensor: return x.linear(w).realize()

  expected = torch.tensor(A).bfloat16() @ torch.tensor(W).bfloat16().T
  with ourgrad.autocast(dtypes.bfloat16):
    for _ in range(3):
      out = forward(Tensor(A).realize())
      assert out.dtype == dtypes.bfloat16
      np.testing.assert_allclose(out.float().numpy(), expected.float().numpy(), rtol=2 ** -7, atol=1e-2)
  assert forward(Tensor(A).realize()).dtype == dtypes.float32  # captured under bf16: captured anew


def _mlp_weights() -> list[np.ndarray]:
  weights = np.random.default_rng(1)
  return [(weights.standard_normal((32, 16)) / 4).astype(np.float32), np.zeros(32, np.float32),
          (weights.standard_normal((4, 32)) / 6).astype(np.float32), np.zeros(4, np.float32)]


def _ourgrad_curve(inputs: np.ndarray, labels: np.ndarray, steps: int) -> np.ndarray:
  first, second = nn.Linear(16, 32), nn.Linear(32, 4)
  params = [first.weight, first.bias, second.weight, second.bias]
  for param, value in zip(params, _mlp_weights()): param.assign(Tensor(value)).realize()
  optimizer = ourgrad.optim.AdamW(params, lr=3e-2)
  losses = []
  for _ in range(steps):
    optimizer.zero_grad()
    with ourgrad.autocast(dtypes.bfloat16):
      loss = second(first(Tensor(inputs)).relu()).cross_entropy(Tensor(labels))
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
  return np.array(losses)


def _torch_curve(inputs: np.ndarray, labels: np.ndarray, steps: int, low: bool) -> np.ndarray:
  first, second = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)
  params = [first.weight, first.bias, second.weight, second.bias]
  for param, value in zip(params, _mlp_weights()): param.data = torch.tensor(value)
  optimizer = torch.optim.AdamW(params, lr=3e-2)
  losses = []
  for _ in range(steps):
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=low):
      loss = TF.cross_entropy(second(torch.relu(first(torch.tensor(inputs)))), torch.tensor(labels))
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
  return np.array(losses)


def test_bf16_training_follows_torch_autocast_loss_curve():
  data = np.random.default_rng(0)
  inputs, labels = data.standard_normal((64, 16)).astype(np.float32), data.integers(0, 4, 64)
  steps = 30
  ours = _ourgrad_curve(inputs, labels, steps)
  torch_bf16 = _torch_curve(inputs, labels, steps, low=True)
  torch_fp32 = _torch_curve(inputs, labels, steps, low=False)
  # the tolerance is bfloat16's own noise: how far torch's bf16 curve strays from its float32 one. ourgrad and torch
  # round at the same points (linear outputs, relu in bf16; cross_entropy in float32), differing only in summation
  # order, so ourgrad must stay well inside that noise (measured: 0.16 of it); a cast in the wrong place (a float32
  # linear, a bfloat16 loss) moves the curve by the whole noise or more
  noise = np.abs(torch_bf16 - torch_fp32).max()
  assert ours[-1] < 0.1 * ours[0]  # it trains
  assert np.abs(ours - torch_bf16).max() < 0.5 * noise, (ours, torch_bf16, noise)


def _scaler_run(inf_at_step: int, steps: int, growth_interval: int) -> tuple[list, list]:
  """(ourgrad, torch) lists of (scale, weights) after each step of float16-autocast SGD with a GradScaler."""
  weight = (np.random.default_rng(2).standard_normal((4, 3)) / 2).astype(np.float32)
  layer, torch_layer = nn.Linear(3, 4, bias=False), torch.nn.Linear(3, 4, bias=False)
  layer.weight.assign(Tensor(weight)).realize()
  torch_layer.weight.data = torch.tensor(weight)
  optimizer, torch_optimizer = ourgrad.optim.SGD([layer.weight], lr=0.1), torch.optim.SGD([torch_layer.weight], lr=0.1)
  scaler = ourgrad.amp.GradScaler(init_scale=1024.0, growth_interval=growth_interval)
  torch_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=growth_interval)
  ours, theirs = [], []
  for step in range(steps):
    inputs = np.random.default_rng(3 + step).standard_normal((5, 3)).astype(np.float32)
    if step == inf_at_step: inputs[0, 0] = np.inf
    optimizer.zero_grad()
    with ourgrad.autocast(dtypes.float16):
      loss = layer(Tensor(inputs)).float().square().mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    ours.append((scaler.get_scale(), layer.weight.numpy().copy()))
    torch_optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
      torch_loss = torch_layer(torch.tensor(inputs)).float().square().mean()
    torch_scaler.scale(torch_loss).backward()
    torch_scaler.step(torch_optimizer)
    torch_scaler.update()
    theirs.append((torch_scaler.get_scale(), torch_layer.weight.detach().numpy().copy()))
  return ours, theirs


def test_grad_scaler_skips_inf_step_and_backs_off_like_torch():
  ours, theirs = _scaler_run(inf_at_step=1, steps=5, growth_interval=2)
  assert [scale for scale, _ in ours] == [scale for scale, _ in theirs]
  np.testing.assert_array_equal(ours[1][1], ours[0][1])  # the inf step left the weights alone
  for (_, weight), (_, torch_weight) in zip(ours, theirs):
    np.testing.assert_allclose(weight, torch_weight, rtol=1e-3, atol=1e-4)


def test_grad_scaler_unscale_once_and_state_dict():
  layer = nn.Linear(3, 2)
  optimizer = ourgrad.optim.SGD(layer.parameters(), lr=0.1)
  scaler = ourgrad.amp.GradScaler(init_scale=8.0)
  scaler.scale(layer(Tensor(A[:, :3])).sum()).backward()
  scaled_grad = layer.weight.grad.numpy()
  scaler.unscale_(optimizer)
  np.testing.assert_allclose(layer.weight.grad.numpy(), scaled_grad / 8.0, rtol=1e-6)
  with pytest.raises(RuntimeError, match="already been called"): scaler.unscale_(optimizer)
  scaler.step(optimizer)
  scaler.update()
  restored = ourgrad.amp.GradScaler()
  restored.load_state_dict(scaler.state_dict())
  assert restored.get_scale() == 8.0 and restored.state_dict() == scaler.state_dict()
  disabled = ourgrad.amp.GradScaler(enabled=False)
  loss = Tensor(2.0)
  assert disabled.scale(loss) is loss and disabled.get_scale() == 1.0


def test_module_to_low_precision_round_trip_matches_torch():
  model = nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 3))
  torch_model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3))
  torch_model.load_state_dict({name: torch.tensor(value.numpy()) for name, value in model.state_dict().items()})
  for low, torch_low in ((dtypes.bfloat16, torch.bfloat16), (dtypes.float16, torch.float16)):
    model.to(low)
    torch_model.to(torch_low)
    for ours, theirs in zip(model.parameters(), torch_model.parameters()):
      assert ours.dtype == low
      np.testing.assert_array_equal(ours.float().numpy(), theirs.float().detach().numpy())
    model.float()
    torch_model.float()
    for ours, theirs in zip(model.parameters(), torch_model.parameters()):
      assert ours.dtype == dtypes.float32
      np.testing.assert_array_equal(ours.numpy(), theirs.detach().numpy())
  assert model.bfloat16() is model and model.half() is model


def test_optimizer_over_low_precision_params_raises():
  model = nn.Linear(4, 2).bfloat16()
  with pytest.raises(DTypeError, match="float32 master weights"): ourgrad.optim.AdamW(model.parameters())


def test_optimizer_step_inside_autocast_stays_float32():
  layer = nn.Linear(8, 3)
  optimizer = ourgrad.optim.AdamW(layer.parameters(), lr=1e-2)
  with ourgrad.autocast(dtypes.bfloat16):
    layer(Tensor(A)).float().sum().backward()
    optimizer.step()
  assert all(param.dtype == dtypes.float32 for param in layer.parameters())


def _matmul_operand_loads(schedule: list) -> list[list]:
  """Per matmul in `schedule` (a SUM of a MUL of two broadcast loads, through casts), the dtype of each load and
  whether it is cast at most once (the shape tensor cores match: codegen/kernel.py matmul_operands)."""
  from ourgrad.ops import Ops

  def through_casts(op: Any) -> tuple[Any, int]:
    casts = 0
    while op.op is Ops.CAST: op, casts = op.srcs[0], casts + 1
    return op, casts

  found = []
  for item in schedule:
    for op in item.ast.walk():
      if op.op is not Ops.SUM: continue
      product, _ = through_casts(op.srcs[0])
      if product.op is not Ops.MUL: continue
      operands = [through_casts(src) for src in product.srcs]
      if all(load.op is Ops.LOAD and 0 in load.arg.st.views[-1].strides for load, _ in operands):
        found.append([(load.dtype, casts <= 1) for load, casts in operands])
  return found


def test_matmuls_under_autocast_load_stored_low_precision_operands():
  # every product of a block (2 forward, 2 input-gradient, 2 weight-gradient matmuls) loads bfloat16 buffers, what
  # tensor cores take, not float32 ones or a recomputed prologue: the norm and gelu before a linear and the gradients
  # reaching it are stored in bfloat16, as torch's autocast kernels store them
  from ourgrad.engine.schedule import create_schedule
  norm, first, second = nn.LayerNorm(64), nn.Linear(64, 128), nn.Linear(128, 64)
  params = [*norm.parameters(), *first.parameters(), *second.parameters()]
  x = Tensor(rng.standard_normal((2, 32, 64)).astype(np.float32)).realize()  # (batch, tokens, width): read as (64, 64)
  for param in params: param.realize()
  with ourgrad.autocast(dtypes.bfloat16):
    loss = (x + second(first(norm(x)).gelu(approximate="tanh"))).square().mean()
  loss.backward()
  products = _matmul_operand_loads(create_schedule([loss.lazydata, *[param.grad.lazydata for param in params]]))
  assert len(products) == 6 and all(operand == (dtypes.bfloat16, True) for loads in products for operand in loads), \
    products


def test_product_of_a_computed_low_precision_view_loads_it_stored():
  # a bfloat16 product read through a permute (attention's output going into c_proj): its base is stored in bfloat16
  # and the next product loads it, instead of loading the float32 sum and casting it twice in its prologue
  from ourgrad.engine.schedule import create_schedule
  layer = nn.Linear(64, 64)
  a, b = [Tensor(rng.standard_normal((64, 64)).astype(np.float32)).realize() for _ in range(2)]
  for param in layer.parameters(): param.realize()
  with ourgrad.autocast(dtypes.bfloat16):
    out = layer((a @ b).T)
  products = _matmul_operand_loads(create_schedule([out.lazydata]))
  assert len(products) == 2 and all(operand == (dtypes.bfloat16, True) for loads in products for operand in loads), \
    products


def _autocast_training_losses(jit: bool, steps: int = 4) -> list[float]:
  """Losses of `steps` AdamW steps of a small MLP whose forward runs under bf16 autocast, eagerly or in a TinyJit."""
  Tensor.manual_seed(0)
  first, second = nn.Linear(16, 32), nn.Linear(32, 4)
  optimizer = ourgrad.optim.AdamW([*first.parameters(), *second.parameters()], lr=1e-2)
  data = np.random.default_rng(4)
  inputs = Tensor(data.standard_normal((8, 16)).astype(np.float32)).realize()
  labels = Tensor(data.integers(0, 4, 8)).realize()

  def step(x: Tensor, y: Tensor) -> Tensor:
    optimizer.zero_grad()
    with ourgrad.autocast(dtypes.bfloat16):
      loss = second(first(x).relu()).cross_entropy(y)
    loss.backward()
    Tensor.realize_all(loss, *optimizer.schedule_step())
    return loss

  run = TinyJit(step) if jit else step
  return [run(inputs, labels).item() for _ in range(steps)]


def test_autocast_training_step_under_tinyjit_equals_eager():
  # the capture and the replays run the kernels the eager steps run: the same bf16 rounding, bit for bit
  assert _autocast_training_losses(jit=True) == _autocast_training_losses(jit=False)


def _square_buffers(schedule: list, size: int) -> list:
  """The dtypes of the buffers of `size` elements that `schedule` stores (an attention's T x T, or the logits)."""
  return [buffer.dtype for item in schedule for buffer in item.outputs if buffer.size == size]


def test_attention_products_under_autocast_load_bf16_and_store_the_square_in_bf16(monkeypatch):
  # torch's autocast: the attention's products in bfloat16 forward AND backward (dV = P^T dO, dP = dO V^T,
  # dQ = dS K, dK = dS^T Q), softmax in float32 rounding once; every T x T tensor in memory is bfloat16: the scores,
  # the probabilities (the softmax's backward reads them, not float32 exps), dP and dS. The values are torch's.
  # The composite graph's rules (on a GPU with the fused kernel, sdpa would be one kernel: test_flash_attention.py)
  monkeypatch.setenv("FUSED_ATTENTION", "0")
  from ourgrad.engine.schedule import create_schedule
  batch, heads, length, width = 2, 2, 24, 32   # T x T (2304 values) unlike any other tensor's size
  data = np.random.default_rng(5)
  x_value = data.standard_normal((batch, length, width)).astype(np.float32)
  weight_value = (data.standard_normal((3 * width, width)) / 4).astype(np.float32)

  def step() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(out, loss, the input's gradient, the weight's gradient), lazy."""
    layer = nn.Linear(width, 3 * width, bias=False)
    layer.weight.assign(Tensor(weight_value)).realize()
    x = Tensor(x_value, requires_grad=True).realize()
    with ourgrad.autocast(dtypes.bfloat16):
      q, k, v = (t.reshape(batch, length, heads, width // heads).transpose(1, 2) for t in layer(x).split(width, dim=2))
      out = q.scaled_dot_product_attention(k, v, is_causal=True)
    loss = out.float().square().sum()
    loss.backward()
    return out, loss, x.grad, layer.weight.grad

  _, loss, x_grad, weight_grad = step()
  schedule = create_schedule([loss.lazydata, x_grad.lazydata, weight_grad.lazydata])   # not run: read, then dropped
  products = _matmul_operand_loads(schedule)
  # 1 projection + 2 attention products forward, 4 attention products + 2 projection gradients backward (the loss's
  # kernel may compute P @ V again inside its sum)
  assert len(products) >= 9 and all(operand == (dtypes.bfloat16, True) for loads in products for operand in loads), \
    products
  assert _square_buffers(schedule, batch * heads * length * length) == [dtypes.bfloat16] * 4

  out, _, x_grad, weight_grad = step()
  torch_x = torch.tensor(x_value, requires_grad=True)
  torch_weight = torch.tensor(weight_value, requires_grad=True)
  with torch.autocast("cpu", dtype=torch.bfloat16):
    tq, tk, tv = (t.reshape(batch, length, heads, width // heads).transpose(1, 2)
                  for t in TF.linear(torch_x, torch_weight).split(width, dim=2))
    torch_out = TF.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
  torch_out.float().square().sum().backward()
  np.testing.assert_allclose(out.float().numpy(), torch_out.float().detach().numpy(), rtol=2e-2, atol=2e-2)
  for ours, theirs in ((x_grad, torch_x.grad), (weight_grad, torch_weight.grad)):
    scale = np.abs(theirs.numpy()).max()
    np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=0, atol=3e-2 * scale)


@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.bfloat16])
def test_softmax_gradient_from_its_output_matches_torch(dtype: Any):
  # softmax's backward is y * (g - sum(g * y)) from the saved output (torch's formula); bfloat16 computes in float32
  data = np.random.default_rng(6)
  x_value, g_value = data.standard_normal((2, 3, 40)).astype(np.float32) * 3, data.standard_normal((2, 3, 40))
  x = Tensor(x_value).cast(dtype).detach().requires_grad_()
  torch_x = torch.tensor(x_value).to(TORCH_DTYPES[dtype]).requires_grad_()
  for axis in (-1, 1):
    out = x.softmax(axis)
    (out * Tensor(g_value.astype(np.float32)).cast(dtype)).sum().backward()
    torch_out = torch_x.softmax(axis)
    (torch_out * torch.tensor(g_value.astype(np.float32)).to(TORCH_DTYPES[dtype])).sum().backward()
    tolerance = 1e-5 if dtype == dtypes.float32 else 2 ** -7
    assert out.dtype == dtype and x.grad.dtype == dtype
    np.testing.assert_allclose(out.float().numpy(), torch_out.float().detach().numpy(), rtol=tolerance, atol=1e-6)
    np.testing.assert_allclose(x.grad.float().numpy(), torch_x.grad.float().numpy(), rtol=tolerance,
                               atol=4 * tolerance)
    x.grad, torch_x.grad = None, None


def test_loss_reads_the_bf16_logits_it_is_given():
  # the logits of a bf16 linear reach cross_entropy (a float32-list op) stored in bfloat16 and are widened in the
  # loss's kernels (its pick of the target logit reads the bfloat16 table): no float32 copy of the logits is stored
  from ourgrad.engine.schedule import create_schedule
  data = np.random.default_rng(7)
  rows, width, classes = 32, 16, 96
  x_value = data.standard_normal((rows, width)).astype(np.float32)
  weight_value = data.standard_normal((classes, width)).astype(np.float32) / 4
  labels = data.integers(0, classes, rows)

  def step() -> tuple[Tensor, Tensor]:
    weight = Tensor(weight_value, requires_grad=True).realize()
    with ourgrad.autocast(dtypes.bfloat16):
      loss = Tensor(x_value).linear(weight).sparse_categorical_crossentropy(Tensor(labels))
    loss.backward()
    return loss, weight.grad

  loss, weight_grad = step()
  schedule = create_schedule([loss.lazydata, weight_grad.lazydata])   # not run: read, then dropped
  assert _square_buffers(schedule, rows * classes) == [dtypes.bfloat16] * 2  # the logits and their gradient
  loss, weight_grad = step()
  torch_weight = torch.tensor(weight_value, requires_grad=True)
  with torch.autocast("cpu", dtype=torch.bfloat16):
    torch_loss = TF.cross_entropy(TF.linear(torch.tensor(x_value), torch_weight), torch.tensor(labels))
  torch_loss.backward()
  np.testing.assert_allclose(loss.item(), torch_loss.item(), rtol=1e-2)
  np.testing.assert_allclose(weight_grad.numpy(), torch_weight.grad.numpy(), rtol=0,
                             atol=2e-2 * np.abs(torch_weight.grad.numpy()).max())


def test_gpt2_step_under_autocast_moves_far_fewer_bytes_than_float32():
  # one GPT-2 training step (1 block, batch 4 x 256, width 128, vocabulary 1024), from its schedule alone: under bf16
  # autocast every product loads bfloat16 operands, no float32 T x T or logits-sized buffer is stored, and the
  # kernels move at most 0.7x the float32 step's bytes (0.62x; 0.93x when the scores, exps, logits and gradients
  # reaching products were stored in float32)
  import sys
  from pathlib import Path
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # extra/ lives at the repository root
  from extra.bench.autocast_audit import leaf_bytes, matmul_operands, step_schedule
  from extra.models.gpt2 import GPT2Config
  batch, length, vocab, heads = 4, 256, 1024, 4
  config = GPT2Config(n_layer=1, n_head=heads, n_embd=128, vocab_size=vocab, block_size=length)
  moved = {}
  for low in (None, dtypes.bfloat16):
    schedule = step_schedule(config, batch, length, low)
    moved[low] = sum(leaf_bytes(item.ast) for item in schedule)
  products = [product for item in schedule for product in matmul_operands(item.ast)]
  assert products and all(product[:2] == ("bfloat16", "bfloat16") for product in products), products
  assert set(_square_buffers(schedule, batch * heads * length * length)) == {dtypes.bfloat16}
  assert set(_square_buffers(schedule, batch * length * vocab)) == {dtypes.bfloat16}
  assert moved[dtypes.bfloat16] <= 0.7 * moved[None], moved


def test_weight_gradient_under_autocast_is_computed_once_for_adamw():
  """The weight gradient of an autocast Linear is a SUM cast to bf16 and back to float32 (its float32 .grad), which
  AdamW's moment and update kernels all read: the SUM runs in one kernel, not once per reader (it did in two). The
  updated weight equals torch's AdamW step on torch's autocast gradient."""
  from ourgrad.engine.realize import run_schedule
  from ourgrad.engine.schedule import create_schedule
  from ourgrad.nn.optim import AdamW
  from ourgrad.ops import Ops
  x_np, w_np = rng.standard_normal((64, 128)).astype(np.float32), rng.standard_normal((256, 128)).astype(np.float32)
  lin = nn.Linear(128, 256, bias=False)
  lin.weight = Tensor(w_np, requires_grad=True)
  optimizer = AdamW([lin.weight], lr=0.01)
  with Tensor.train():
    optimizer.zero_grad()
    with ourgrad.autocast(dtypes.bfloat16): y = lin(Tensor(x_np))
    y.float().square().mean().backward()
    updates = optimizer.schedule_step()
    schedule = create_schedule([tensor.lazydata for tensor in updates])
    products = [item for item in schedule if item.ast.op is not Ops.COPY and any(
      node.op is Ops.SUM and any(inner.op is Ops.MUL for inner in node.walk()) for node in item.ast.walk())]
    assert len(products) == 2, len(products)   # the forward and the weight gradient
    run_schedule(schedule)
  tw = torch.tensor(w_np, requires_grad=True)
  torch_optimizer = torch.optim.AdamW([tw], lr=0.01)
  with torch.autocast("cpu", dtype=torch.bfloat16): ty = TF.linear(torch.tensor(x_np), tw)
  ty.float().square().mean().backward()
  torch_optimizer.step()
  np.testing.assert_allclose(lin.weight.numpy(), tw.detach().numpy(), atol=2e-3, rtol=0)


def test_gpt2_step_under_autocast_on_hopper_casts_and_stores(monkeypatch):
  """The schedule of a 2-layer GPT-2 training step under bf16 autocast on an emulated H100 (WGMMA: its products store
  their results plainly, no epilogue), pinned with the reasons:
  - 17 casts: each float32 weight and bias to bf16 once per step, not once per use (a Linear's weight feeds its
    forward product and its input gradient's product from the one bf16 buffer; the tied wte feeds the logits and
    their input gradient): 4 Linears x (weight, bias) x 2 layers + wte, every one a segment of a packed launch (they
    depend on nothing: engine/packing.py's roots). No activation or gradient is cast by a kernel of its own at this
    size (their casts fuse into the kernels that compute them);
  - 4 hidden-sized (4 x width) bf16 buffers per layer: c_fc's product, GELU's output (c_proj's operand), c_proj's
    input gradient and GELU's gradient. The bias add between c_fc's product and GELU is recomputed by GELU and by
    GELU's gradient (5 a layer before: it was stored by a kernel of its own, a full write and read of the activation);
  - bytes moved: 48.3 MB with the warp-specialized single-pass attention backward (ATTENTION_SINGLE_PASS=2, the
    default on sm_90 at D <= 64: dQ added into a float32 accumulator, 0.39 MB more a layer here), 47.5 MB with the
    two-kernel backward (48.9 MB with the bias add stored, before session 14)."""
  import sys
  from pathlib import Path
  from ourgrad.codegen.opt import tensor_core_plans
  from ourgrad.engine import operand_staging
  from ourgrad.ops import Ops
  from helpers import emulated_gpu_tf32
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # extra/ lives at the repository root
  from extra.bench.autocast_audit import leaf_bytes, step_schedule
  from extra.models.gpt2 import GPT2Config
  monkeypatch.setattr(tensor_core_plans, "WGMMA_MIN_WORK", 1)
  monkeypatch.setattr(operand_staging, "WGMMA_MIN_WORK", 1)
  batch, length, width, layers, vocab = 2, 128, 128, 2, 320
  with emulated_gpu_tf32(monkeypatch, "CUDA_SM90"):
    ourgrad.set_float32_matmul_precision("highest")   # autocast's products need no TF32
    monkeypatch.setenv("DEVICE", "PYTHON")
    config = GPT2Config(n_layer=layers, n_head=2, n_embd=width, vocab_size=vocab, block_size=length)
    schedule = [item for item in step_schedule(config, batch, length, dtypes.bfloat16) if item.ast.op is not Ops.COPY]
  assert {item.outputs[0].device for item in schedule} == {"PYTHON"}
  kernels = [segment for item in schedule for segment in (item.ast.srcs if item.ast.op is Ops.PACK else (item.ast,))]
  casts = [kernel for kernel in kernels if {node.op for node in kernel.walk()} <= {Ops.STORE, Ops.CAST, Ops.LOAD}
           and kernel.srcs[0].dtype == dtypes.bfloat16 and kernel.srcs[0].srcs[0].dtype == dtypes.float32]
  assert len(casts) == 4 * 2 * layers + 1, casts
  # all in packed launches (engine/packing.py's roots): no cast launched alone
  assert not any(item.ast.op is Ops.STORE and item.ast in casts for item in schedule)
  hidden = [buffer.dtype for item in schedule for buffer in item.outputs if buffer.size == batch * length * 4 * width]
  assert hidden == [dtypes.bfloat16] * 4 * layers, hidden
  assert sum(leaf_bytes(item.ast) for item in schedule) <= 48.3e6


def test_weight_casts_under_autocast_share_a_packed_kernel(monkeypatch):
  """The casts of float32 weights and biases to bf16 depend on nothing else in the step, each layer's at its own
  dependency height: they share one packed kernel at its start (engine/packing.py's roots) instead of a launch per
  layer (GPT-2's bf16 step launched 84 cast kernels of ~10 us each on the H200; 563 launches a step -> 468). Where a
  layer's casts are not alone at their height (here the third layer's, beside another kernel that packs with them)
  they stay in that pack: no cast is launched alone. On the emulated CUDA device (16-bit segments 4 elements a
  thread: uint2 loads and stores) the loss and gradients are torch's CPU autocast ones."""
  from collections import Counter
  from ourgrad.engine.realize import run_schedule
  from ourgrad.engine.schedule import create_schedule
  from ourgrad.ops import Ops
  from helpers import emulated_gpu_tf32
  with emulated_gpu_tf32(monkeypatch, "CUDA"):
    ourgrad.set_float32_matmul_precision("highest")
    widths = (64, 128, 128, 128, 32)
    data = np.random.default_rng(9)
    values = [((data.standard_normal((fan_out, fan_in)) / 8).astype(np.float32),
               data.standard_normal(fan_out).astype(np.float32)) for fan_in, fan_out in zip(widths, widths[1:])]
    x_value = data.standard_normal((16, widths[0])).astype(np.float32)
    params = [Tensor(value, device="PYTHON", requires_grad=True) for pair in values for value in pair]
    h = Tensor(x_value, device="PYTHON")
    with ourgrad.autocast(dtypes.bfloat16):
      for weight, bias in zip(params[0::2], params[1::2]): h = h.linear(weight, bias).relu()
    loss = h.float().square().mean()
    loss.backward()
    schedule = create_schedule([loss.lazydata, *[param.grad.lazydata for param in params]])
    cast_sizes = sorted([16 * widths[0], *(value.size for pair in values for value in pair)])
    packed = sorted(buffer.size for item in schedule if item.ast.op is Ops.PACK for buffer in item.outputs
                    if buffer.dtype == dtypes.bfloat16)
    assert not Counter(cast_sizes) - Counter(packed), packed   # every cast in a pack
    assert not any(item.ast.op is Ops.STORE and {node.op for node in item.ast.walk()} <= {Ops.STORE, Ops.CAST, Ops.LOAD}
                   for item in schedule), "a cast launched alone"
    # the first, second and last layers' casts (and the input's) in the first kernel; the third layer's beside the
    # kernel that packs with them at their height
    assert schedule[0].ast.op is Ops.PACK and len(schedule[0].outputs) == 7, schedule[0].outputs
    run_schedule(schedule)
  torch_params = [torch.tensor(value, requires_grad=True) for pair in values for value in pair]
  torch_h = torch.tensor(x_value)
  with torch.autocast("cpu", dtype=torch.bfloat16):
    for weight, bias in zip(torch_params[0::2], torch_params[1::2]): torch_h = TF.linear(torch_h, weight, bias).relu()
  torch_loss = torch_h.float().square().mean()
  torch_loss.backward()
  np.testing.assert_allclose(loss.numpy(), torch_loss.item(), rtol=2e-2)
  for param, torch_param in zip(params, torch_params):
    # relative to the whole gradient: bf16 gradients through 4 ReLU layers, rounded where torch rounds them in
    # another order (the first layer's weight: 9%; the same graph on the plain PYTHON device is bit for bit ours)
    error = np.linalg.norm(param.grad.numpy() - torch_param.grad.numpy()) / np.linalg.norm(torch_param.grad.numpy())
    assert error < 0.12, error


@pytest.mark.parametrize("dtype", [dtypes.bfloat16, dtypes.float16])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_16bit_gelu_computes_in_float32_as_torch(dtype, approximate: str) -> None:
  """GELU of a 16-bit tensor computes in float32 and rounds once (PyTorch's opmath), its value and its gradient: in
  bf16 arithmetic the tanh form's constants (sqrt(2/pi) as 0.796875) and its rounded tanh put it up to an ulp off
  torch's."""
  data = np.random.default_rng(25)
  x_value = (data.standard_normal(4096) * 3).astype(np.float32)
  grad_value = data.standard_normal(4096).astype(np.float32)
  x = Tensor(x_value).cast(dtype).realize().requires_grad_()
  value = x.gelu(approximate=approximate)
  (value.float() * Tensor(grad_value)).sum().backward()
  torch_x = torch.tensor(x_value).to(TORCH_DTYPES[dtype]).requires_grad_()
  torch_value = TF.gelu(torch_x, approximate=approximate)
  (torch_value.float() * torch.tensor(grad_value)).sum().backward()
  assert value.dtype == dtype and x.grad.dtype == dtype
  ulp = 2.0 ** (-7 if dtype == dtypes.bfloat16 else -10)
  for got, expected in ((value, torch_value), (x.grad, torch_x.grad)):
    got_np, expected_np = got.float().numpy(), expected.detach().float().numpy()
    # one rounding of nearly the same float32 value (ourgrad's tanh is 2 sigmoid(2x) - 1, its erf a polynomial): equal
    # but where the float32 results straddle a rounding edge, or cancel in 1 + tanh far below zero
    np.testing.assert_allclose(got_np, expected_np, rtol=ulp, atol=1e-5)
    assert np.mean(got_np == expected_np) > 0.9, np.mean(got_np == expected_np)


def test_weight_cast_pack_stores_16_bytes_a_thread_on_cuda(monkeypatch) -> None:
  """Packed float32 -> bf16 weight casts (the autocast step's first kernel) take 8 elements a thread on CUDA: two
  float4 loads and one 16-byte store of pairs rounded by cvt.rn.bf16x2 (4 elements a thread, 8-byte stores, before;
  scalar 2-byte stores when the stores' width and the segment's disagreed); the values are torch's bf16 casts."""
  from ourgrad.codegen.lowering import build_kernel, lower_kernel
  from ourgrad.engine.realize import run_schedule
  from ourgrad.engine.schedule import create_schedule
  from ourgrad.ops import Ops
  from ourgrad.renderer.cuda import CUDARenderer
  from helpers import emulated_gpu_tf32
  data = np.random.default_rng(11)
  values = [data.standard_normal(shape).astype(np.float32) for shape in ((64, 96), (96,), (32, 64))]
  with emulated_gpu_tf32(monkeypatch, "CUDA"):
    casts = [Tensor(value, device="PYTHON").cast(dtypes.bfloat16) for value in values]
    schedule = create_schedule([cast.lazydata for cast in casts])
    [pack] = [item for item in schedule if item.ast.op is Ops.PACK]
    renderer = CUDARenderer("sm_90")
    source = lower_kernel(build_kernel(pack.ast, renderer), renderer, "pack").source
    assert source.count("*((uint4*)(data") == 3 and "] = float_to_bf16(" not in source, source
    assert source.count("float4 vec") == 6, source
    run_schedule(schedule)
    for cast, value in zip(casts, values):
      expected = torch.tensor(value).bfloat16().float().numpy()
      np.testing.assert_array_equal(cast.float().numpy(), expected)


def test_cross_entropy_gradient_loads_the_class_range_as_vectors_on_cuda(monkeypatch) -> None:
  """The bf16 cross-entropy gradient compares each class with an uploaded int32 range: on CUDA the range loads as
  int4 vectors beside the logits' 16-byte vectors (scalar loads 8 classes a lane apart were 8 L1 requests per vector
  of logits), and the gradient is torch's autocast one."""
  from ourgrad.codegen.lowering import build_kernel, lower_kernel
  from ourgrad.engine.realize import run_schedule
  from ourgrad.engine.schedule import create_schedule
  from ourgrad.ops import Ops
  from ourgrad.renderer.cuda import CUDARenderer
  from helpers import emulated_gpu_tf32
  data = np.random.default_rng(13)
  x_value, w_value = (data.standard_normal(shape).astype(np.float32) for shape in ((64, 32), (256, 32)))
  target_value = data.integers(0, 256, 64).astype(np.int32)
  with emulated_gpu_tf32(monkeypatch, "CUDA"):
    x = Tensor(x_value, device="PYTHON", requires_grad=True)
    w = Tensor(w_value, device="PYTHON")
    with ourgrad.autocast(dtypes.bfloat16):
      loss = x.linear(w).sparse_categorical_crossentropy(Tensor(target_value, device="PYTHON"))
    loss.backward()
    renderer = CUDARenderer("sm_90")
    schedule = create_schedule([x.grad.lazydata])
    sources = [lower_kernel(build_kernel(item.ast, renderer), renderer, "kernel").source
               for item in schedule if item.ast.op is not Ops.COPY]
    assert any("int4 vec" in source and "uint4 vec" in source for source in sources)
    run_schedule(schedule)
    got = x.grad.numpy()
  torch_x = torch.tensor(x_value, requires_grad=True)
  with torch.autocast("cpu", dtype=torch.bfloat16):
    torch_logits = TF.linear(torch_x, torch.tensor(w_value))
  TF.cross_entropy(torch_logits.float(), torch.tensor(target_value).long()).backward()
  np.testing.assert_allclose(got, torch_x.grad.numpy(), rtol=2e-2, atol=2e-3)
