"""Pin how many kernels the scheduler makes, and how many bytes they move, for graphs that should fuse.

Every check counts kernels two ways: `create_schedule` on one copy of the graph (what would run, nothing runs)
and `GlobalCounters.kernel_count` after realizing a second copy (what ran). `create_schedule` gives buffers to
the bases it schedules, so each copy is built fresh by a `build` function over already-realized inputs.
Every test also compares the computed values with numpy: a kernel count is only worth pinning if the fused
kernel is right. A count above the ideal that comes from a scheduler limitation is an `xfail(strict=True)`
test, so fixing the scheduler makes it fail loudly and the pin gets tightened.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import pytest
import torch

from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.device import Buffer
from ourgrad.dtype import dtypes
from ourgrad.engine.realize import compile_kernel
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.helpers import GlobalCounters
from ourgrad.ops import REDUCE_OPS
from ourgrad.runtime.ops_python import PythonRenderer
from ourgrad.tensor import Tensor

FLOAT32_BYTES = 4
Outputs = Tensor | Sequence[Tensor]


# ---------------------------------------------------------------- helpers

def rand(*shape: int, seed: int = 0) -> np.ndarray:
  """Standard-normal float32 data, the same for the same seed."""
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)

@pytest.fixture
def row_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
  """Row kernels on whatever the device: by default (ROW_KERNELS=-1) only CPUs form them, and CI also runs this file
  on the emulated GPU, where the same pins and results must hold once they are on."""
  monkeypatch.setenv("ROW_KERNELS", "1")



def as_list(outs: Outputs) -> list[Tensor]:
  return [outs] if isinstance(outs, Tensor) else list(outs)


def scheduled_kernels(build: Callable[[], Outputs]) -> int:
  """How many ScheduleItems a fresh copy of the graph gets (nothing runs)."""
  return len(create_schedule([tensor.lazydata for tensor in as_list(build())]))


def check_kernels(build: Callable[[], Outputs], expected: int) -> list[Tensor]:
  """Assert that scheduling one copy of the graph and realizing another both give `expected` kernels.

  Returns the realized outputs; GlobalCounters still hold the realize's counts (bytes, ops) afterwards."""
  assert scheduled_kernels(build) == expected, "create_schedule count"
  outs = as_list(build())
  GlobalCounters.reset()
  Tensor.realize_all(*outs)
  assert GlobalCounters.kernel_count == expected, "kernels launched by realize()"
  return outs


def assert_close(tensor: Tensor, expected: np.ndarray) -> None:
  np.testing.assert_allclose(tensor.numpy(), expected, rtol=1e-5, atol=1e-6)


def reduces_in(build: Callable[[], Outputs]) -> int:
  """How many reduce ops all the scheduled kernels of a fresh copy of the graph compute."""
  schedule = create_schedule([tensor.lazydata for tensor in as_list(build())])
  return sum(1 for item in schedule for node in item.ast.walk() if node.op in REDUCE_OPS)


# ---------------------------------------------------------------- fusion required by the issue

def test_elementwise_chain_is_one_kernel():
  a_np, b_np, c_np = rand(64, 32, seed=1), rand(64, 32, seed=2), rand(64, 32, seed=3)
  a, b, c = Tensor(a_np), Tensor(b_np), Tensor(c_np)
  (out,) = check_kernels(lambda: ((a + b) * c).exp(), 1)
  assert_close(out, np.exp((a_np + b_np) * c_np))


def test_multiply_then_sum_is_one_kernel():
  a_np, b_np = rand(48, 40, seed=1), rand(48, 40, seed=2)
  a, b = Tensor(a_np), Tensor(b_np)
  (out,) = check_kernels(lambda: (a * b).sum(axis=1), 1)
  assert_close(out, (a_np * b_np).sum(axis=1))


def test_sum_then_add_is_one_kernel():
  x_np = rand(30, 20)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: x.sum() + 1, 1)
  np.testing.assert_allclose(out.numpy(), x_np.sum() + 1, rtol=1e-5)


def test_matmul_is_one_kernel():
  a_np, b_np = rand(16, 32, seed=1), rand(32, 24, seed=2)
  a, b = Tensor(a_np), Tensor(b_np)
  (out,) = check_kernels(lambda: a @ b, 1)
  np.testing.assert_allclose(out.numpy(), a_np @ b_np, rtol=1e-4, atol=1e-5)


def test_matmul_bias_relu_is_one_kernel():
  a_np, b_np, bias_np = rand(16, 32, seed=1), rand(32, 24, seed=2), rand(24, seed=3)
  a, b, bias = Tensor(a_np), Tensor(b_np), Tensor(bias_np)
  (out,) = check_kernels(lambda: (a @ b + bias).relu(), 1)
  np.testing.assert_allclose(out.numpy(), np.maximum(a_np @ b_np + bias_np, 0), rtol=1e-4, atol=1e-5)


def _torch_gelu(values: np.ndarray) -> np.ndarray:
  return torch.nn.functional.gelu(torch.tensor(values, dtype=torch.float64)).numpy()


def test_matmul_bias_gelu_is_one_kernel_and_matches_the_unfused_path():
  a_np, b_np, bias_np = rand(16, 32, seed=1), rand(32, 24, seed=2), rand(24, seed=3)
  a, b, bias = Tensor(a_np), Tensor(b_np), Tensor(bias_np)
  (out,) = check_kernels(lambda: (a @ b + bias).gelu(), 1)
  unfused = (a @ b + bias).contiguous().realize().gelu()   # the epilogue in a kernel of its own
  np.testing.assert_allclose(out.numpy(), unfused.numpy(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out.numpy(), _torch_gelu(a_np.astype(np.float64) @ b_np + bias_np), rtol=1e-3, atol=1e-3)


def _fused_epilogue_item(a: Tensor, b: Tensor, bias: Tensor) -> ScheduleItem:
  """The one kernel of (a @ b + bias).gelu() on the PYTHON device, its inputs realized."""
  schedule = create_schedule([(a @ b + bias).gelu().lazydata])
  assert len(schedule) == 1   # matmul, bias and gelu in one kernel
  return schedule[0]


def _run_on_python(kernel: Kernel, item: ScheduleItem) -> np.ndarray:
  output = Buffer("PYTHON", item.outputs[0].size, item.outputs[0].dtype).allocate()
  compile_kernel(kernel, "PYTHON")((output,) + item.inputs)
  return output.numpy().astype(np.float64)


@pytest.mark.parametrize("opts", ["TC", "SHARED"])
def test_matmul_bias_gelu_keeps_its_epilogue_under_gpu_matmul_opts(opts: str):
  """On the emulated GPU (PYTHON with CUDA's limits) the fused epilogue survives tensor cores (float16 operands,
  float32 accumulation) and shared-memory tiles: the results equal the plain kernel's."""
  rng = np.random.default_rng(7)
  a_np, b_np, bias_np = (rng.standard_normal(shape).astype(np.float32) for shape in ((64, 48), (48, 32), (32,)))
  a, b, bias = (Tensor(values, device="PYTHON").realize() for values in (a_np, b_np, bias_np))
  if opts == "TC":
    a, b = (x.cast(dtypes.float16).realize().cast(dtypes.float32) for x in (a, b))
    applied = [Opt(OptOps.TC, 0, 0)]
  else:
    applied = [Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.LOCAL, 0, 4), Opt(OptOps.LOCAL, 1, 8),
               Opt(OptOps.UNROLL, 0, 4), Opt(OptOps.SHARED, 0, 0)]
  item = _fused_epilogue_item(a, b, bias)
  plain = _run_on_python(Kernel(item.ast, PythonRenderer("CUDA")), item)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  for opt in applied: kernel.apply_opt(opt)
  got = _run_on_python(kernel, item)
  np.testing.assert_allclose(got, plain, rtol=1e-4, atol=1e-4)
  a64 = a_np.astype(np.float16).astype(np.float64) if opts == "TC" else a_np.astype(np.float64)
  b64 = b_np.astype(np.float16).astype(np.float64) if opts == "TC" else b_np.astype(np.float64)
  np.testing.assert_allclose(got.reshape(64, 32), _torch_gelu(a64 @ b64 + bias_np), rtol=1e-3, atol=1e-3)


@pytest.mark.usefixtures("row_kernels")
def test_softmax_is_one_kernel():
  # was 3 (max and sum of exp realized, then exp / sum): a row kernel runs both reduces and the store per row
  x_np = rand(32, 50)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: x.softmax(-1), 1)
  exps = np.exp(x_np - x_np.max(-1, keepdims=True))
  assert_close(out, exps / exps.sum(-1, keepdims=True))


def _log_softmax_np(x: np.ndarray) -> np.ndarray:
  shifted = x - x.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


ROW_KERNELS = {
  # name: (ourgrad, numpy): each was 2-3 kernels (every reduce read back per element realized first)
  "log_softmax": (lambda x: x.log_softmax(-1), _log_softmax_np),
  "layernorm": (lambda x: x.layernorm(), lambda x: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True)
                                                                                              + 1e-5)),
  "rmsnorm": (lambda x: x * (x.square().mean(-1, keepdim=True) + 1e-6).rsqrt(),
              lambda x: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)),
  "var": (lambda x: x.var(-1), lambda x: x.var(-1, ddof=1)),
  "std": (lambda x: x.std(-1), lambda x: x.std(-1, ddof=1)),
}


@pytest.mark.usefixtures("row_kernels")
@pytest.mark.parametrize("name", sorted(ROW_KERNELS))
def test_row_normalizations_are_one_kernel(name: str):
  ours, reference = ROW_KERNELS[name]
  x_np = rand(24, 40, seed=3)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: ours(x), 1)
  np.testing.assert_allclose(out.numpy(), reference(x_np.astype(np.float64)), rtol=1e-4, atol=1e-5)


def _cross_entropy_np(x: np.ndarray, labels: np.ndarray) -> np.ndarray:
  return -_log_softmax_np(x)[np.arange(len(labels)), labels]


@pytest.mark.usefixtures("row_kernels")
def test_cross_entropy_per_sample_is_one_kernel():
  x_np, labels = rand(16, 10, seed=4), np.random.default_rng(5).integers(0, 10, 16).astype(np.int32)
  x, target = Tensor(x_np), Tensor(labels)
  (out,) = check_kernels(lambda: x.cross_entropy(target, reduction="none"), 1)
  np.testing.assert_allclose(out.numpy(), _cross_entropy_np(x_np, labels), rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("row_kernels")
def test_cross_entropy_mean_is_one_kernel():
  # the per-sample losses, then their mean over the batch: final reduces of a row kernel (docs/fusion.md)
  x_np, labels = rand(16, 10, seed=6), np.random.default_rng(7).integers(0, 10, 16).astype(np.int32)
  x, target = Tensor(x_np), Tensor(labels)
  (out,) = check_kernels(lambda: x.cross_entropy(target), 1)
  np.testing.assert_allclose(out.numpy(), _cross_entropy_np(x_np, labels).mean(), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- movement ops are free

def test_movement_chain_on_a_realized_tensor_needs_no_kernel():
  x_np = rand(16, 8)
  x = Tensor(x_np)

  def build() -> Tensor:
    moved = x.reshape(8, 16).permute(1, 0).reshape(16, 8, 1).expand(16, 8, 3)
    return moved.pad(((1, 1), (0, 0), (0, 0))).shrink(((1, 17), (2, 6), (0, 3))).flip(0)

  out = check_kernels(build, 0)[0]
  assert out.lazydata.base.realized is x.lazydata.base.realized, "a view must stay a view of the input's buffer"
  moved_np = np.broadcast_to(x_np.reshape(8, 16).T.reshape(16, 8, 1), (16, 8, 3))
  expected = np.pad(moved_np, ((1, 1), (0, 0), (0, 0)))[1:17, 2:6, :][::-1]
  GlobalCounters.reset()
  assert_close(out, expected)
  assert GlobalCounters.kernel_count == 1, "reading a non-contiguous view back copies it once"


def test_contiguous_of_a_permuted_view_is_one_kernel():
  x_np = rand(12, 20)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: x.permute(1, 0).contiguous(), 1)
  assert out.lazydata.base.realized is not x.lazydata.base.realized
  assert_close(out, x_np.T)
  assert GlobalCounters.global_mem == 2 * x_np.size * FLOAT32_BYTES


def test_reading_a_plain_reshape_back_needs_no_kernel():
  x_np = rand(12, 20)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: x.reshape(20, 12), 0)
  GlobalCounters.reset()
  assert_close(out, x_np.reshape(20, 12))
  assert GlobalCounters.kernel_count == 0, "a reshape of a contiguous buffer is read as it is"


def test_contiguous_of_a_plain_reshape_is_free():
  x_np = rand(12, 20)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: x.reshape(20, 12).contiguous(), 0)
  assert out.lazydata.base.realized is x.lazydata.base.realized
  assert_close(out, x_np.reshape(20, 12))


def test_realizing_twice_runs_nothing_the_second_time():
  x_np = rand(10)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: (x * 2).exp(), 1)
  GlobalCounters.reset()
  out.realize()
  assert GlobalCounters.kernel_count == 0
  assert_close(out, np.exp(x_np * 2))


# ---------------------------------------------------------------- reduces

@pytest.mark.usefixtures("row_kernels")
def test_reduce_broadcast_back_is_one_kernel():
  # was 2: the mean is a row reduce (one row of all elements) read back per element in the same kernel
  x_np = rand(24, 16)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: x - x.mean(), 1)
  assert_close(out, x_np - x_np.mean())


def test_reduce_read_through_a_permute_is_two_kernels():
  x_np = rand(24, 16)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: x.T - x.mean(1), 2)
  assert_close(out, x_np.T - x_np.mean(1))


def test_reduce_broadcast_back_runs_in_dependency_order():
  x = Tensor(rand(24, 16))
  first, second = create_schedule([(x.T - x.mean(1)).lazydata])
  assert first.outputs[0] in second.inputs


def test_two_reduces_of_one_shape_added_are_two_kernels():
  # one reduce fuses with the add, the other is realized first: a kernel holds one reduce
  x_np = rand(32, 32)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: x.sum(0) + x.sum(1), 2)
  assert_close(out, x_np.sum(0) + x_np.sum(1))


@pytest.mark.usefixtures("row_kernels")
def test_two_reduces_broadcast_to_an_outer_sum_are_two_kernels():
  # was 3: the row sums join the output kernel as a row reduce; the column sums reduce other axes, so are realized
  x_np = rand(16, 16)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: x.sum(0, keepdim=True) + x.sum(1, keepdim=True), 2)
  assert_close(out, x_np.sum(0, keepdims=True) + x_np.sum(1, keepdims=True))


def test_reduce_with_two_outputs_is_computed_once():
  x_np = rand(20, 10)
  x = Tensor(x_np)

  def build() -> list[Tensor]:
    total = x.sum(1)
    return [total * 2, total + 1]

  assert reduces_in(build) == 1
  # the reduce, then one kernel writing both outputs (was 3: one elementwise kernel per output)
  doubled, shifted = check_kernels(build, 2)
  assert_close(doubled, x_np.sum(1) * 2)
  assert_close(shifted, x_np.sum(1) + 1)


def test_reduce_read_twice_by_one_kernel_is_computed_once():
  x_np = rand(20, 10)
  x = Tensor(x_np)

  def build() -> Tensor:
    total = x.sum(1)
    return total * 2 + total

  assert reduces_in(build) == 1
  assert scheduled_kernels(build) <= 2  # 1 once test_reduce_read_by_two_ops_of_one_kernel_fuses passes
  assert_close(build(), x_np.sum(1) * 3)


def test_reduce_read_by_two_ops_of_one_kernel_fuses():
  x_np = rand(20, 10)
  x = Tensor(x_np)

  def build() -> Tensor:
    total = x.sum(1)
    return total * 2 + total

  (out,) = check_kernels(build, 1)
  assert_close(out, x_np.sum(1) * 3)


def test_reduce_read_twice_by_one_kernel_fuses():
  x_np = rand(20, 10)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: x.sum(1).square(), 1)
  assert_close(out, x_np.sum(1) ** 2)


@pytest.mark.usefixtures("row_kernels")
def test_debug_3_says_why_each_realized_reduce_is_not_fused(monkeypatch, capsys):
  # decide, then build: every realized base carries one reason from the decision, printed at DEBUG=3
  x = Tensor(rand(16, 16))
  monkeypatch.setenv("DEBUG", "3")
  create_schedule([(x.sum(0, keepdim=True) + x.sum(1, keepdim=True)).lazydata])
  reasons = [line for line in capsys.readouterr().out.splitlines() if line.startswith("realize ")]
  assert len(reasons) == 2, reasons
  assert any(line.startswith("realize SUM") and "(1, 16)" in line and "second reduce" in line for line in reasons)
  assert any("an output of this realize" in line for line in reasons)


# ---------------------------------------------------------------- long chains and constants

def _alternating_chain(x: Tensor, length: int) -> Tensor:
  for step in range(length): x = x + 1.0 if step % 2 == 0 else x * 0.5
  return x


def _alternating_chain_np(x: np.ndarray, length: int) -> np.ndarray:
  for step in range(length): x = x + np.float32(1.0) if step % 2 == 0 else x * np.float32(0.5)
  return x


def test_chain_of_200_elementwise_ops_is_one_kernel():
  x_np = rand(100)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: _alternating_chain(x, 200), 1)
  assert_close(out, _alternating_chain_np(x_np, 200))


def test_chain_of_1000_elementwise_ops_is_one_kernel():
  x_np = rand(100)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: _alternating_chain(x, 1000), 1)
  assert_close(out, _alternating_chain_np(x_np, 1000))


def test_realizing_ones_is_one_kernel_of_one_element():
  (out,) = check_kernels(lambda: Tensor.ones(4), 1)
  # the constant is stored once and viewed (expanded) as the shape: 4 bytes written, none read
  assert GlobalCounters.global_mem == FLOAT32_BYTES
  np.testing.assert_array_equal(out.numpy(), np.ones(4, np.float32))


def test_constant_only_graph_folds_to_one_constant():
  def build() -> Tensor: return Tensor.ones(4) * 3 + Tensor.full((4,), 2.0)

  assert build().lazydata.const_value() == 5.0, "constant arithmetic folds while the graph is built"
  (out,) = check_kernels(build, 1)
  assert GlobalCounters.global_ops == 0
  np.testing.assert_array_equal(out.numpy(), np.full(4, 5.0, np.float32))


def test_constant_operand_fuses_into_the_kernel():
  x_np = rand(8, 8)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: x * Tensor.full((8, 8), 3.0) + Tensor.ones(8, 8), 1)
  assert GlobalCounters.global_mem == 2 * x_np.size * FLOAT32_BYTES, "constants are not loaded from memory"
  assert_close(out, x_np * 3 + 1)


def test_several_outputs_in_one_realize():
  a_np, b_np = rand(8, 8, seed=1), rand(8, 8, seed=2)
  a, b = Tensor(a_np), Tensor(b_np)
  # one kernel writes both (was 2 kernels before multi-output kernels)
  total, product = check_kernels(lambda: [a + b, a * b], 1)
  assert_close(total, a_np + b_np)
  assert_close(product, a_np * b_np)


# ---------------------------------------------------------------- padding

PADDING = ((1, 2), (3, 0))


def test_pad_of_exp_realizes_exp_first_and_stays_correct():
  # exp(0) = 1: fusing exp after the pad would put ones where the pad must put zeros
  x_np = rand(6, 5)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: x.exp().pad(PADDING).contiguous(), 2)
  assert_close(out, np.pad(np.exp(x_np), PADDING))
  assert_close(x.exp().pad(PADDING) + 1, np.pad(np.exp(x_np), PADDING) + 1)


def test_pad_of_exp_with_a_value_stays_correct():
  x_np = rand(6, 5)
  x = Tensor(x_np)
  assert_close(x.exp().pad(PADDING, value=3.0), np.pad(np.exp(x_np), PADDING, constant_values=3.0))


def test_exp_after_pad_stays_correct():
  x_np = rand(6, 5)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: x.pad(PADDING).exp(), 1)
  assert_close(out, np.exp(np.pad(x_np, PADDING)))


def test_pad_of_add_fuses_into_one_kernel():
  # x + y is 0 where both are 0: the pad can be pushed through the add
  a_np, b_np = rand(6, 5, seed=1), rand(6, 5, seed=2)
  a, b = Tensor(a_np), Tensor(b_np)
  (out,) = check_kernels(lambda: (a + b).pad(PADDING).contiguous(), 1)
  assert_close(out, np.pad(a_np + b_np, PADDING))
  (out,) = check_kernels(lambda: (a + b).pad(PADDING) * 2 + 1, 1)
  assert_close(out, np.pad(a_np + b_np, PADDING) * 2 + 1)


# ---------------------------------------------------------------- assign and aliasing

def test_assign_writes_into_the_same_buffer_in_one_kernel():
  w_np, g_np = rand(16, 8, seed=1), rand(16, 8, seed=2)
  w, g = Tensor(w_np), Tensor(g_np)
  buffer = w.lazydata.base.realized
  GlobalCounters.reset()
  w.assign(w - 0.1 * g).realize()
  assert GlobalCounters.kernel_count == 1
  assert GlobalCounters.global_mem == 3 * w_np.size * FLOAT32_BYTES, "read w and g, write w"
  assert w.lazydata.base.realized is buffer
  assert_close(w, w_np - np.float32(0.1) * g_np)


def test_assign_schedule_writes_into_the_target():
  w, g = Tensor(rand(4, 4, seed=1)), Tensor(rand(4, 4, seed=2))
  buffer = w.lazydata.base.realized
  (item,) = create_schedule([w.assign(w - g).lazydata])
  assert item.outputs[0] is buffer


@pytest.mark.parametrize("write, read", [(slice(1, None), slice(None, -1)), (slice(None, -1), slice(1, None)),
                                         (slice(None, None, 2), slice(1, None, 2))])
def test_setitem_from_an_overlapping_view_matches_numpy(write: slice, read: slice):
  x_np = np.arange(10, dtype=np.float32)
  x = Tensor(x_np.copy())
  buffer = x.lazydata.base.realized
  GlobalCounters.reset()
  x[write] = x[read]
  x.realize()
  # the value is copied out first: writing in place while reading shifted places would read overwritten values
  assert GlobalCounters.kernel_count == 2
  assert x.lazydata.base.realized is buffer
  x_np[write] = x_np[read]
  np.testing.assert_array_equal(x.numpy(), x_np)


# ---------------------------------------------------------------- bytes moved

@pytest.mark.parametrize("size", [1, 1000, 12345])
def test_fused_elementwise_chain_moves_three_reads_and_one_write(size: int):
  a_np, b_np, c_np = rand(size, seed=1), rand(size, seed=2), rand(size, seed=3)
  a, b, c = Tensor(a_np), Tensor(b_np), Tensor(c_np)
  (out,) = check_kernels(lambda: ((a + b) * c).exp(), 1)
  assert GlobalCounters.global_mem == 4 * size * FLOAT32_BYTES
  assert_close(out, np.exp((a_np + b_np) * c_np))


@pytest.mark.parametrize("rows, cols", [(37, 53), (64, 256)])
def test_broadcast_input_is_counted_at_its_own_size(rows: int, cols: int):
  x_np, bias_np = rand(rows, cols, seed=1), rand(cols, seed=2)
  x, bias = Tensor(x_np), Tensor(bias_np)
  (out,) = check_kernels(lambda: x + bias, 1)
  assert GlobalCounters.global_mem == (2 * rows * cols + cols) * FLOAT32_BYTES
  assert_close(out, x_np + bias_np)


@pytest.mark.parametrize("rows, cols", [(37, 53), (64, 256)])
def test_sum_reads_the_input_and_writes_one_value_per_row(rows: int, cols: int):
  x_np = rand(rows, cols)
  x = Tensor(x_np)
  (out,) = check_kernels(lambda: x.sum(axis=1), 1)
  assert GlobalCounters.global_mem == (rows * cols + rows) * FLOAT32_BYTES
  np.testing.assert_allclose(out.numpy(), x_np.sum(axis=1), rtol=1e-5, atol=1e-5)


def test_matmul_reads_each_input_once():
  a_np, b_np = rand(16, 32, seed=1), rand(32, 24, seed=2)
  a, b = Tensor(a_np), Tensor(b_np)
  (out,) = check_kernels(lambda: a @ b, 1)
  assert GlobalCounters.global_mem == (16 * 32 + 32 * 24 + 16 * 24) * FLOAT32_BYTES
  np.testing.assert_allclose(out.numpy(), a_np @ b_np, rtol=1e-4, atol=1e-5)


def test_costly_graph_read_many_times_is_computed_once():
  """exp/sqrt chain broadcast into a matmul-like reduce: realized once (2 kernels) instead of recomputed 64 times;
  a cheap one (x + 1) stays fused (1 kernel)."""
  x_np, w_np = rand(32, 16), rand(16, 64, seed=1)
  x, w = Tensor(x_np), Tensor(w_np)
  [costly] = check_kernels(lambda: (x.exp() * 2 + 1).sqrt() @ w, 2)
  np.testing.assert_allclose(costly.numpy(), np.sqrt(np.exp(x_np) * 2 + 1) @ w_np, rtol=1e-5, atol=1e-4)
  [cheap] = check_kernels(lambda: (x + 1) @ w, 1)
  np.testing.assert_allclose(cheap.numpy(), (x_np + 1) @ w_np, rtol=1e-5, atol=1e-4)


def test_work_on_a_broadcast_scalar_is_not_counted_per_element():
  """Cross-entropy's per-row gradient scale where(keep, 1 / count, 0), read once per column of an (R, C) consumer:
  its reciprocal is of one value (the count, a reduce) broadcast to every row, so only the compare and the where
  are per row and the scale fuses into the consumer; the count is stored (1 value), not the R scales. The same per
  row values through exp and sqrt are still stored (R values) rather than recomputed per element."""
  rows, classes = 48, 64
  x_np, values_np = rand(rows, classes), rand(rows, seed=1)
  target_np = np.random.default_rng(2).integers(-1, classes, rows).astype(np.int32)
  x, target, values = Tensor(x_np), Tensor(target_np), Tensor(values_np)
  keep_np = target_np != -1
  scale_np = np.where(keep_np, 1 / keep_np.sum(), 0).astype(np.float32)

  def scaled(per_row: Callable[[Tensor], Tensor]) -> Tensor:
    keep = target != -1
    count = keep.sum().cast(dtypes.float32)
    return x * per_row(keep.where(1 / count, 0)).reshape(rows, 1)

  def stored_sizes(out: Tensor) -> list[int]:
    return sorted(buffer.size for item in create_schedule([out.lazydata]) for buffer in item.outputs)

  assert stored_sizes(scaled(lambda scale: scale)) == [1, rows * classes]
  [cheap] = check_kernels(lambda: scaled(lambda scale: scale), 2)
  np.testing.assert_allclose(cheap.numpy(), x_np * scale_np[:, None], rtol=1e-6)
  costly_row = lambda scale: (values.exp() * 2 + scale).sqrt()  # noqa: E731
  assert stored_sizes(scaled(costly_row)) == [rows, rows * classes]
  [costly] = check_kernels(lambda: scaled(costly_row), 2)
  np.testing.assert_allclose(costly.numpy(), x_np * np.sqrt(np.exp(values_np) * 2 + scale_np)[:, None], rtol=1e-5)


def test_cross_entropy_backward_stores_no_per_row_scale():
  """Cross-entropy forward and backward over rows long enough that the per-row logsumexp is stored: the stored
  results are the count of kept targets, the loss, the logsumexp and the gradient; the gradient's per-row scale
  where(keep, 1 / count, 0) is computed inside the backward's kernel (it was an (R,) kernel of its own)."""
  rows, classes = 512, 1000
  x_np = rand(rows, classes)
  target_np = np.random.default_rng(3).integers(0, classes, rows)
  target_np[::7] = -100   # ignored samples: the mean divides by the others
  target = Tensor(target_np.astype(np.int32))

  def loss_and_gradient() -> tuple[Tensor, Tensor]:
    x = Tensor(x_np, requires_grad=True)
    loss = x.cross_entropy(target)
    loss.backward()
    assert x.grad is not None
    return loss, x.grad

  schedule = create_schedule([out.lazydata for out in loss_and_gradient()])
  assert sorted(buffer.size for item in schedule for buffer in item.outputs) == [1, 1, rows, rows * classes]
  loss, gradient = loss_and_gradient()
  x_torch = torch.tensor(x_np, requires_grad=True)
  expected = torch.nn.functional.cross_entropy(x_torch, torch.tensor(target_np))
  expected.backward()
  np.testing.assert_allclose(loss.numpy(), expected.item(), rtol=1e-5)
  np.testing.assert_allclose(gradient.numpy(), x_torch.grad.numpy(), rtol=1e-4, atol=1e-7)
