"""Stacked rows of GPU row kernels (codegen/row_blocks.py `_stacked_rows`): rows that share a broadcast operand
(a batched matrix-vector product's weights, grouped-query attention's values) computed by one thread group side by
side, the shared loads read once for all of them.

The kernels of a batch-decode step (extra/models/llama.py: the RMS-normed product `inverse_rms_per_output`, the
attention `softmax_weighted_sum`) are lowered for CUDA's limits (PYTHON's `EMULATE=CUDA` mode) and for the PYTHON
device's own (no warp shuffles: the partials meet in local memory, one array per stacked row), run in the interpreter
and compared with numpy; the UOps pin that each weight unit is loaded once per thread, not once per sequence.
"""
from __future__ import annotations

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.uops import UOps, launch_dims
from ourgrad.engine.realize import run_schedule
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.ops import Ops
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer

from extra.models.llama import inverse_rms_per_output, softmax_weighted_sum
from helpers import nvrtc_compiler, run_on_python_checking_cuda

NVRTC = nvrtc_compiler()
RENDERERS = {"emulate_cuda": lambda: PythonRenderer("CUDA"), "python": lambda: PythonRenderer()}
EPS = 1e-5


@pytest.fixture(autouse=True)
def row_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setenv("ROW_KERNELS", "1")


def _kernel_item(out: Tensor) -> ScheduleItem:
  schedule = create_schedule([out.lazydata])
  run_schedule(schedule[:-1])   # inputs (copies) first
  assert sum(1 for item in schedule if item.ast.op is not Ops.COPY) == 1, "one kernel"
  return schedule[-1]


def _run(kernel: Kernel, item: ScheduleItem) -> np.ndarray: return run_on_python_checking_cuda(kernel, item, NVRTC)


def _normed_product(sequences: int, outputs: int, length: int) -> tuple[Tensor, np.ndarray, np.ndarray]:
  """(x @ W.T) * rsqrt(mean(x^2) + eps) as the decode step builds it (the scale recomputed beside each output),
  and its numpy reference."""
  rng = np.random.default_rng(sequences * 1000 + outputs)
  x_np = rng.standard_normal((sequences, length)).astype(np.float32)
  w_np = rng.standard_normal((outputs, length)).astype(np.float32)
  x, w = Tensor(x_np, device="PYTHON"), Tensor(w_np, device="PYTHON")
  out = x.linear(w) * inverse_rms_per_output(x, outputs, EPS)
  expected = (x_np @ w_np.T) / np.sqrt((x_np.astype(np.float64) ** 2).mean(-1, keepdims=True) + EPS)
  return out, expected.astype(np.float32), w_np


def _global_loads(uops: list, argument: int) -> list:
  return [uop for uop in uops if uop.op is UOps.LOAD and uop.srcs[0].op is UOps.DEFINE_GLOBAL
          and uop.srcs[0].arg[0] == argument]


@pytest.mark.parametrize("renderer", sorted(RENDERERS))
@pytest.mark.parametrize("shape", [(8, 40, 96), (4, 24, 100), (3, 16, 64), (16, 8, 48)],
                         ids=lambda shape: "x".join(map(str, shape)))
def test_batched_normed_product_matches_numpy(shape: tuple[int, int, int], renderer: str):
  """Sequences x outputs x length: float4 rows, a ragged row (25 units over 32 threads), an odd batch (3: every
  sequence stacked), a batch of 16 (stacked by 8, two groups)."""
  out, expected, _ = _normed_product(*shape)
  item = _kernel_item(out)
  got = _run(Kernel(item.ast, RENDERERS[renderer]()), item)
  np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=3e-5, atol=3e-5)


def test_batched_product_reads_each_weight_once():
  """8 sequences against W (960, 576) as a decode step's QKV product: a warp per output row takes the 8 sequences
  side by side, so each thread loads its float4s of W once (not once per sequence) and the grid has a row group per
  output, not per (sequence, output)."""
  out, _, _ = _normed_product(8, 960, 576)
  item = create_schedule([out.lazydata])[-1]
  kernel = Kernel(item.ast, CUDARenderer())
  uops = linearize(kernel)
  weight = next(leaf.arg.idx for leaf in kernel.leaves if leaf.op is Ops.LOAD and leaf.arg.st.shape[-1] == 576
                and leaf.arg.st.real_strides()[0] == 0)
  per_thread = 576 // 4 // 32 + 1   # 4.5 float4 units over a warp: 5, the last under a guard
  weight_loads = _global_loads(uops, weight)
  assert all(uop.arg == 4 for uop in weight_loads), "float4 weight loads"
  # the guarded last unit's loads too are issued up front (gated), once for all 8 sequences
  assert len(weight_loads) == per_thread
  global_size, local_size = launch_dims(uops)
  assert global_size[0] * local_size[0] == 960 * 32, "a warp per output row for all 8 sequences"


@pytest.mark.parametrize("renderer", sorted(RENDERERS))
def test_grouped_query_attention_shares_values(renderer: str):
  """softmax(scores) @ values of a decode step (sequences, kv heads, group, 1, slots) with values (sequences, kv
  heads, slots, head_dim): the query heads of a group read their values once (stacked along the group)."""
  rng = np.random.default_rng(3)
  sequences, kv_heads, group, slots, head_dim = 2, 2, 3, 24, 8
  scores_np = rng.standard_normal((sequences, kv_heads, group, 1, slots)).astype(np.float32)
  values_np = rng.standard_normal((sequences, kv_heads, 1, slots, head_dim)).astype(np.float32)
  scores, values = Tensor(scores_np, device="PYTHON"), Tensor(values_np, device="PYTHON")
  item = _kernel_item(softmax_weighted_sum(scores, values))
  kernel = Kernel(item.ast, RENDERERS[renderer]())
  got = _run(kernel, item)
  weights = np.exp(scores_np - scores_np.max(-1, keepdims=True))
  expected = (weights / weights.sum(-1, keepdims=True)) @ values_np
  np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=2e-5, atol=2e-5)
  cuda_uops = linearize(Kernel(item.ast, CUDARenderer()))
  global_size, local_size = launch_dims(cuda_uops)
  assert global_size[0] * local_size[0] < sequences * kv_heads * group * head_dim * 32, "rows of a group stacked"


def test_small_shared_operand_is_not_stacked():
  """One sequence against W: x is broadcast over the outputs but W, which varies, dominates the bytes: the rows stay
  a (row group) each, the parallelism kept."""
  out, _, _ = _normed_product(1, 960, 576)
  item = create_schedule([out.lazydata])[-1]
  global_size, local_size = launch_dims(linearize(Kernel(item.ast, CUDARenderer())))
  assert global_size[0] * local_size[0] == 960 * 32


def test_stacking_keeps_rows_that_share_blocks():
  """One sequence's attention (SmolLM2: 3 KV heads x 3 query heads x 64 outputs over 520 slots) on 132
  multiprocessors: not stacked. Stacking the group's 3 rows would leave 192 rows, too few to share blocks (a block
  each, a barrier per reduce and stacked row); the values (strided along the slots, contiguous along head_dim) make
  the rows interleaved instead: 8 neighbouring outputs a block, a warp's lanes side by side along head_dim
  (test_interleaved_rows.py). At 8 sequences the rows are stacked by the group's 3 query heads (the values read
  once for the three) and interleaved along head_dim."""
  def launch(sequences: int) -> tuple:
    scores, values = Tensor.empty(sequences, 3, 3, 1, 520), Tensor.empty(sequences, 3, 1, 520, 64)
    item = create_schedule([softmax_weighted_sum(scores, values).lazydata])[-1]
    return launch_dims(linearize(Kernel(item.ast, CUDARenderer())))   # its 132 multiprocessors (an H100's)
  assert launch(1) == ((72, 1, 1), (256, 1, 1))   # 576 rows, 8 a block, a warp of threads each
  # 8 x 3 x 64 stacked row groups of 3, interleaved too: 8 neighbouring outputs a block, a warp of threads each
  assert launch(8) == ((192, 1, 1), (256, 1, 1))


def test_many_rows_are_stacked():
  """One sequence against a vocabulary's W (49152, 576) as a decode step's logits: the rows are so many (a warp each:
  ~6 times the H100's resident threads) that 4 neighbouring rows are one warp's, side by side, every row's units
  loaded before the first reduce (all of the warp's loads in flight at once), the norm's sum of squares once."""
  out, _, _ = _normed_product(1, 49152, 576)
  item = create_schedule([out.lazydata])[-1]
  kernel = Kernel(item.ast, CUDARenderer())
  uops = linearize(kernel)
  global_size, local_size = launch_dims(uops)
  assert global_size[0] * local_size[0] == 49152 * 32 // 4, "4 rows a warp"
  first_shuffle = next(position for position, uop in enumerate(uops) if uop.op is UOps.WARP_REDUCE)
  weight = next(leaf.arg.idx for leaf in kernel.leaves if leaf.op is Ops.LOAD and leaf.arg.st.shape[-1] == 576
                and leaf.arg.st.real_strides()[-1] == 1 and leaf.arg.st.real_strides()[-2] != 0)
  before = [uop for uop in _global_loads(uops, weight)[:16]]
  assert all(uops.index(uop) < first_shuffle for uop in before), "each row's 4 whole units loaded up front"


@pytest.mark.parametrize("sequences, rows, multiprocessors", [(1, 960, 0), (1, 3072, 0), (1, 1024, 2), (8, 960, 0)],
                         ids=["qkv", "gate_up", "stacked_by_8", "batch8"])
def test_every_load_is_issued_before_the_first_combine(sequences: int, rows: int, multiprocessors: int):
  """Normed products whose rows of 576 floats are 4.5 float4 units a lane: the fifth unit, past the row's end for
  half the lanes, is computed under an IF, but its loads (gated by the IF's condition) come before the first shuffle
  with all the others, for every stacked row: inside the IF, after the first reduce's combine, they were a round
  trip to memory more per row (ncu on the H200: a stall point per stacked row in the logits kernel). Stacked as the
  logits are, on a GPU of 2 multiprocessors where 1024 rows fill it several times over (8 rows a warp)."""
  out, _, _ = _normed_product(sequences, rows, 576)
  item = create_schedule([out.lazydata])[-1]
  renderer = CUDARenderer()
  if multiprocessors: renderer.multiprocessors = multiprocessors
  uops = linearize(Kernel(item.ast, renderer))
  if multiprocessors:
    global_size, local_size = launch_dims(uops)
    assert global_size[0] * local_size[0] == rows * 32 // 8, "8 rows a warp"
  first_combine = next(position for position, uop in enumerate(uops) if uop.op is UOps.WARP_REDUCE)
  loads = [position for position, uop in enumerate(uops) if uop.op is UOps.LOAD and
           uop.srcs[0].op is UOps.DEFINE_GLOBAL]
  assert loads and max(loads) < first_combine
  gated = [uop for uop in uops if uop.op is UOps.LOAD and uop.srcs[0].op is UOps.DEFINE_GLOBAL and len(uop.srcs) > 2]
  assert gated, "the ragged unit's loads are gated"


@pytest.mark.parametrize("renderer", sorted(RENDERERS))
def test_many_stacked_rows_match_numpy(renderer: str):
  """The same stacking on a GPU of 2 multiprocessors (1024 rows of 96: 16 threads a row, 4 times its resident
  threads: stacked by 4), against numpy; with PYTHON's own limits (no resident-thread count) they stay unstacked."""
  out, expected, _ = _normed_product(1, 1024, 96)
  item = _kernel_item(out)
  kernel_renderer = RENDERERS[renderer]()
  kernel_renderer.multiprocessors = 2
  kernel = Kernel(item.ast, kernel_renderer)
  got = _run(kernel, item)
  np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=3e-5, atol=3e-5)
  if renderer == "emulate_cuda":
    global_size, local_size = launch_dims(linearize(kernel))
    assert global_size[0] * local_size[0] == 1024 * 16 // 4
