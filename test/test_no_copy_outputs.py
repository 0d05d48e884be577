"""No copy kernels around the fused attention's outputs, as general mechanisms:

- a TinyJit output that is one contiguous run of a buffer the capture writes (the fused attention's O beside its
  logsumexp, each gradient in the backward's one buffer, any slice of a leading axis) is returned as a view of that
  buffer, not copied (LazyBuffer.fixed_base_range);
- a lossless cast round trip x.cast(wider).cast(x.dtype) is x (lazy_value.py): folded in the lazy graph where x is
  a computation, dropped inside kernels where x is stored, and read in place by the attention ops (dO =
  g.cast(float32).cast(bfloat16) is g's memory);

with the reliability rules kept (docs/reliability.md): a value kept over a later in-place write, a lazy reader of an
earlier replay's output. Values against numpy and torch on the CPU; kernel counts pinned, no timings."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ourgrad import Device, Tensor, TinyJit
from ourgrad.dtype import dtypes
from ourgrad.engine.realize import run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.helpers import GlobalCounters
from ourgrad.ops import Ops

from helpers import emulated_gpu_tf32

DEVICE = "PYTHON"
TORCH_DTYPES = {dtypes.float16: torch.float16, dtypes.bfloat16: torch.bfloat16}


@pytest.fixture
def emulated_cuda(monkeypatch):
  """The PYTHON device as a CUDA GPU: the fused attention kernels and their backward run (emulated)."""
  monkeypatch.setenv("FUSED_ATTENTION", "1")
  monkeypatch.delenv("FUSED_ATTENTION_BACKWARD", raising=False)
  with emulated_gpu_tf32(monkeypatch, "CUDA"): yield


def _random(*shape: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _realized_cast_ops(lazy_outputs: list) -> list[Ops]:
  """The CAST nodes of the kernels that realize `lazy_outputs` (run)."""
  schedule = create_schedule(lazy_outputs)
  run_schedule(schedule)
  return [node.op for item in schedule for node in item.ast.walk() if node.op is Ops.CAST]


# ---------------------------------------------------------------- the attention step under TinyJit

@pytest.mark.parametrize("dtype, emulate, head_dim", [(dtypes.bfloat16, "CUDA", 16), (dtypes.float16, "CUDA", 16),
                                                      (dtypes.bfloat16, "CUDA_SM90", 64)])
def test_jitted_attention_step_is_its_three_kernels(monkeypatch, dtype, emulate, head_dim):
  """The benchmark's step (extra/bench/bench_attention.py): O returned as (B, L, H, D) and the three gradients of a
  float32 loss; each replay runs the forward, dQ and dK/dV kernels only (no copy of O or of the gradients out of
  the kernels' buffers, no cast round trip of dO), with torch's values. On sm_90 with D=64 the backward is the single
  pass (dq, dk and dv in one buffer)."""
  monkeypatch.setenv("FUSED_ATTENTION", "1")
  monkeypatch.delenv("FUSED_ATTENTION_BACKWARD", raising=False)
  with emulated_gpu_tf32(monkeypatch, emulate): _check_jitted_attention_step(dtype, head_dim)


def _check_jitted_attention_step(dtype, head_dim: int) -> None:
  batch, heads, length = 1, 2, 32
  arrays = [_random(batch, heads, length, head_dim, seed=seed) for seed in range(4)]
  q, k, v, g = (Tensor(array, device=DEVICE).cast(dtype).contiguous().realize() for array in arrays)
  for tensor in (q, k, v): tensor.requires_grad = True

  @TinyJit
  def step(q: Tensor, k: Tensor, v: Tensor, g: Tensor) -> list[Tensor]:
    for tensor in (q, k, v): tensor.grad = None
    out = q.scaled_dot_product_attention(k, v, is_causal=True)
    (out.cast(dtypes.float32) * g.cast(dtypes.float32)).sum().backward()
    return [tensor.realize() for tensor in (out.transpose(1, 2), q.grad, k.grad, v.grad)]

  for _ in range(2): step(q, k, v, g)   # eager, then the capture
  # a replay on another dO buffer: the backward kernels read the new one in place
  g = Tensor(_random(batch, heads, length, head_dim, seed=9), device=DEVICE).cast(dtype).contiguous().realize()
  GlobalCounters.reset()
  results = step(q, k, v, g)
  assert GlobalCounters.kernel_count == 3
  assert step.captured is not None and len(step.captured.items) == 3

  torch_inputs = [torch.tensor(t.cast(dtypes.float32).numpy(), dtype=torch.float64, requires_grad=True)
                  for t in (q, k, v)]
  want_out = torch.nn.functional.scaled_dot_product_attention(*torch_inputs, is_causal=True)
  want_out.backward(torch.tensor(g.cast(dtypes.float32).numpy(), dtype=torch.float64))
  wants = [want_out.detach().transpose(1, 2)] + [t.grad for t in torch_inputs]
  for name, got, want in zip(("O", "dq", "dk", "dv"), results, wants):
    assert got.shape == tuple(want.shape) and got.dtype == dtype, name
    error = np.abs(got.cast(dtypes.float32).numpy() - want.numpy()).max() / np.abs(want.numpy()).max()
    assert error < 2e-2, f"{name}: relative error {error:.2e}"


def test_attention_backward_reads_the_stored_gradient_in_place(emulated_cuda):
  """dO = g.cast(float32).cast(bfloat16) of a stored g is g's memory for the backward kernels: q, k, v's gradients
  are the two backward kernels alone (no kernel storing dO)."""
  q, k, v, g = (Tensor(_random(1, 2, 32, 16, seed=seed), device=DEVICE).cast(dtypes.bfloat16).realize()
                for seed in range(10, 14))
  for tensor in (q, k, v): tensor.requires_grad = True
  out = q.scaled_dot_product_attention(k, v, is_causal=True).realize()
  (out.cast(dtypes.float32) * g.cast(dtypes.float32)).sum().backward()
  GlobalCounters.reset()
  Tensor.realize_all(q.grad, k.grad, v.grad)
  assert GlobalCounters.kernel_count == 2


def test_gradient_read_in_place_keeps_its_value_over_a_later_write(emulated_cuda):
  """The backward op reading g's memory (instead of a copy of it) is one of g's lazy readers: a write into g before
  the gradients are realized leaves them computed from the old g (docs/reliability.md rule 1)."""
  arrays = [_random(1, 2, 32, 16, seed=seed) for seed in range(20, 24)]

  def gradients(write_between: bool) -> list[np.ndarray]:
    q, k, v, g = (Tensor(array, device=DEVICE).cast(dtypes.bfloat16).realize() for array in arrays)
    for tensor in (q, k, v): tensor.requires_grad = True
    out = q.scaled_dot_product_attention(k, v, is_causal=True)
    (out.cast(dtypes.float32) * g.cast(dtypes.float32)).sum().backward()
    if write_between: g.assign(g * 3).realize()
    Tensor.realize_all(q.grad, k.grad, v.grad)
    return [t.grad.cast(dtypes.float32).numpy() for t in (q, k, v)]

  for written, plain in zip(gradients(True), gradients(False)): np.testing.assert_array_equal(written, plain)


# ---------------------------------------------------------------- TinyJit outputs that are parts of one buffer

def test_jit_returns_parts_of_a_buffer_as_views():
  """Slices of a leading axis and a reshape of one come back as views of the kernel's buffer on every replay, with
  each call's values, and no kernel copies them."""
  @TinyJit
  def f(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    doubled = (x * 2).realize()
    return doubled[1:3], doubled[3:].reshape(2, 2, 4), doubled[0]

  for call in range(4):
    values = np.arange(5 * 8, dtype=np.float32).reshape(5, 8) + call
    GlobalCounters.reset()
    first, second, third = f(Tensor(values))
    if call >= 2: assert GlobalCounters.kernel_count == 1   # the multiply alone
    np.testing.assert_array_equal(first.numpy(), values[1:3] * 2)
    np.testing.assert_array_equal(second.numpy(), (values[3:] * 2).reshape(2, 2, 4))
    np.testing.assert_array_equal(third.numpy(), values[0] * 2)
  assert f.captured is not None and len(f.captured.items) == 1


def test_jit_still_copies_a_strided_output():
  """A transpose (not one run of its buffer) is made contiguous inside the capture, as before."""
  @TinyJit
  def f(x: Tensor) -> Tensor: return (x + 1).realize().T

  for call in range(3):
    values = np.arange(12, dtype=np.float32).reshape(3, 4) * (call + 1)
    out = f(Tensor(values))
    np.testing.assert_array_equal(out.numpy(), (values + 1).T)
  assert f.captured is not None and len(f.captured.items) == 2


def test_lazy_reader_of_a_returned_part_keeps_its_value_over_replays():
  """A lazy tensor built from an earlier call's output (a view of the capture's buffer) keeps the value it was built
  from when the next replay overwrites that buffer (the replay snapshots it first), as for whole outputs."""
  @TinyJit
  def f(x: Tensor) -> Tensor: return (x * 2).realize()[2:]

  values = [np.arange(6, dtype=np.float32) + 10 * call for call in range(4)]
  outputs = [f(Tensor(array)) for array in values[:3]]
  kept = outputs[2] + 0.5   # lazy: reads the replay's buffer
  f(Tensor(values[3]))
  np.testing.assert_array_equal(kept.numpy(), values[2][2:] * 2 + 0.5)


def test_lazy_reader_of_a_returned_part_of_state_keeps_its_value():
  """The same for a part of state the function writes in place (a cache slice): returned as a view of the state's
  buffer, and a lazy reader of an earlier call's part keeps that call's values when the next replay writes it."""
  state = Tensor.zeros(6).contiguous().realize()

  @TinyJit
  def f(x: Tensor) -> Tensor:
    state.assign(state + x)
    return state[2:]

  ones = np.ones(6, dtype=np.float32)
  outputs = [f(Tensor(ones)) for _ in range(3)]
  np.testing.assert_array_equal(outputs[-1].numpy(), np.full(4, 3.0))
  kept = outputs[-1] * 10   # lazy
  f(Tensor(ones))
  np.testing.assert_array_equal(kept.numpy(), np.full(4, 30.0))
  np.testing.assert_array_equal(state.numpy(), np.full(6, 4.0))


def test_returned_part_passed_back_in():
  """`x = f(x)` with x a part of the previous call's buffer: the replay reads the input's values, not its own."""
  @TinyJit
  def f(x: Tensor) -> Tensor: return Tensor.cat(x + 1, x).realize()[:4]

  x = Tensor(np.zeros(4, dtype=np.float32))
  for _ in range(5): x = f(x)
  np.testing.assert_array_equal(x.numpy(), np.full(4, 5, dtype=np.float32))


# ---------------------------------------------------------------- lossless cast round trips

@pytest.mark.parametrize("narrow, wide", [(dtypes.bfloat16, dtypes.float32), (dtypes.float16, dtypes.float32),
                                          (dtypes.int8, dtypes.int32), (dtypes.bool, dtypes.float32)])
def test_round_trip_of_a_computation_is_the_computation(narrow, wide):
  x = (Tensor(_random(4, 6, seed=30)) * 3).cast(narrow)
  assert x.cast(wide).cast(narrow).lazydata is x.lazydata
  # through views between the casts
  assert x.cast(wide).T.cast(narrow).lazydata.base is x.lazydata.base


def test_round_trip_rounding_a_fused_16bit_op_stays():
  """A 16-bit float op fused into a kernel is held in float registers (renderer/cstyle.py floats_in_registers): the
  round trip is where its value gets rounded to bfloat16, so it stays, and the float32 math after it reads the
  rounded product, as torch's bfloat16 multiply gives it."""
  a, b = (Tensor(_random(64, seed=seed)).cast(dtypes.bfloat16).realize() for seed in (31, 32))
  product = a * b
  rounded = product.cast(dtypes.float32).cast(dtypes.bfloat16)
  assert rounded.lazydata.base.op is Ops.CAST
  got = (rounded.cast(dtypes.float32) * 3.0).numpy()
  ta, tb = (torch.tensor(t.cast(dtypes.float32).numpy()).to(torch.bfloat16) for t in (a, b))
  np.testing.assert_array_equal(got, ((ta * tb).float() * 3.0).numpy())


def test_round_trips_that_lose_values_stay():
  x = Tensor(np.array([1.0001, 70000.0, -3.5], dtype=np.float32)) * 1.5
  narrowed = x.cast(dtypes.float16).cast(dtypes.float32)   # float16 cannot hold these: a real rounding
  assert narrowed.lazydata.base.op is Ops.CAST
  with np.errstate(over="ignore"):   # 70000 is past float16's largest value: inf, as the cast gives
    np.testing.assert_array_equal(narrowed.numpy(), (x.numpy().astype(np.float16)).astype(np.float32))
  y = Tensor(np.array([300, -7, 1000], dtype=np.int32)) + 1
  wrapped = y.cast(dtypes.int8).cast(dtypes.int32)
  np.testing.assert_array_equal(wrapped.numpy(), (y.numpy().astype(np.int8)).astype(np.int32))


def test_round_trip_of_a_stored_tensor_has_no_cast_in_its_kernel():
  """A stored x's round trip stays a value of its own (a new tensor), computed by a kernel with no cast in it, and
  it gives back every bit of x: NaN, infinities, -0.0, subnormals (against numpy's float16)."""
  bits = np.array([0x7E00, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x3C00, 0xBC01], dtype=np.uint16)
  x = Tensor(bits.view(np.float16)).realize()
  y = x.cast(dtypes.float32).cast(dtypes.float16)
  assert y.lazydata.base is not x.lazydata.base
  assert _realized_cast_ops([y.lazydata]) == []
  got = y.numpy().view(np.uint16)
  # a NaN stays a NaN; its payload is kept on the CPUs, while a GPU holds 16-bit floats in float32 registers and its
  # conversion back writes the canonical NaN (0x7FFF on CUDA, as PyTorch's x.float().half() there)
  nan = np.isnan(bits.view(np.float16))
  assert np.isnan(got.view(np.float16)[nan]).all()
  np.testing.assert_array_equal(got[~nan], bits[~nan])
  if Device.DEFAULT in ("CLANG", "LLVM"): np.testing.assert_array_equal(got, bits)


def test_round_trip_of_a_stored_tensor_keeps_its_value_over_a_write():
  """Rule 1 (docs/reliability.md): the round trip is a new tensor; writing x afterwards does not change it."""
  x = Tensor(np.array([1.0, 2.0, 3.0], dtype=np.float32)).cast(dtypes.bfloat16).realize()
  y = x.cast(dtypes.float32).cast(dtypes.bfloat16)
  x.assign(x + 1).realize()
  np.testing.assert_array_equal(y.numpy(), [1.0, 2.0, 3.0])
  np.testing.assert_array_equal(x.numpy(), [2.0, 3.0, 4.0])


# ---------------------------------------------------------------- reading a contiguous run: a view of the buffer

@pytest.mark.parametrize("device", ["CLANG", "PYTHON"])
def test_numpy_of_a_run_of_a_stored_buffer_runs_no_kernel(device):
  """numpy() of a slice of a leading axis of a realized tensor copies the run out of its buffer (device.BufferView),
  no kernel copying it first; a strided slice still takes its copy kernel."""
  values = np.arange(6 * 5, dtype=np.float32).reshape(6, 5)
  x = Tensor(values, device=device).realize()
  GlobalCounters.reset()
  np.testing.assert_array_equal(x[2:4].numpy(), values[2:4])
  np.testing.assert_array_equal(x[3].numpy(), values[3])
  np.testing.assert_array_equal(x.reshape(30)[7:19].numpy(), values.reshape(30)[7:19])
  assert GlobalCounters.kernel_count == 0
  np.testing.assert_array_equal(x[:, 1:3].numpy(), values[:, 1:3])
  assert GlobalCounters.kernel_count == 1


def test_numpy_of_a_run_of_a_computation_computes_only_the_run():
  """A slice of a base still to compute: its contiguous copy is the one kernel, computing only the elements read."""
  values = np.arange(40, dtype=np.float32).reshape(8, 5)
  x = Tensor(values).realize()
  GlobalCounters.reset()
  np.testing.assert_array_equal((x * 2)[1:3].numpy(), values[1:3] * 2)
  assert GlobalCounters.kernel_count == 1 and GlobalCounters.global_ops <= 2 * 5 * 2


def test_run_read_after_an_in_place_write_sees_it():
  """Rule 2 (docs/reliability.md): a view reads every earlier write to its base; read through a view of the memory
  it is the buffer's current contents. And a value made before the write keeps its own."""
  m = Tensor(np.arange(6, dtype=np.float32)).realize()
  view = m[1:4]
  before = m[1:4] * 1
  m += 10
  np.testing.assert_array_equal(view.numpy(), [11.0, 12.0, 13.0])
  np.testing.assert_array_equal(before.numpy(), [1.0, 2.0, 3.0])
  m[2:3] = Tensor([0.0])
  np.testing.assert_array_equal(view.numpy(), [11.0, 0.0, 13.0])


def test_numpy_of_attention_output_is_the_attention_kernel_alone(emulated_cuda):
  """O is the first run of the fused kernel's buffer (then the logsumexp): read with no copy kernel."""
  q, k, v = (Tensor(_random(1, 2, 32, 16, seed=seed), device=DEVICE).cast(dtypes.bfloat16).realize()
             for seed in range(40, 43))
  GlobalCounters.reset()
  heads_last = q.scaled_dot_product_attention(k, v, is_causal=True).transpose(1, 2)
  got = heads_last.numpy()
  assert GlobalCounters.kernel_count == 1
  twins = [torch.tensor(t.cast(dtypes.float32).numpy(), dtype=torch.float64) for t in (q, k, v)]
  want = torch.nn.functional.scaled_dot_product_attention(*twins, is_causal=True).transpose(1, 2).numpy()
  assert np.abs(got - want).max() / np.abs(want).max() < 2e-2
