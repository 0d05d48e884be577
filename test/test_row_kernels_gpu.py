"""Row kernels on GPUs (codegen/row_blocks.py): a block owns a row, partials meet through warp shuffles and local
memory, short rows stay in registers.

Each row kernel is lowered for a GPU renderer (CUDA's limits through the PYTHON device's `EMULATE=CUDA` mode, and the
PYTHON device's own: 128 threads, no warp shuffles, so the local-memory tree) and run in the PYTHON interpreter
against numpy/PyTorch on the CPU; the same kernel rendered as CUDA C must compile with NVRTC where it is installed.
The shapes cover the persistent rows (unrolled, float4), long rows (a loop, re-read per pass), ragged rows (units not
a multiple of the block) and rows over two axes. On a machine with an NVIDIA GPU the last tests run on CUDA.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import torch

from ourgrad import Tensor
from ourgrad.codegen.opt import split_reduce
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen import row_blocks, row_passes
from ourgrad.codegen.row_blocks import PERSISTENT_UNITS, row_block_threads, row_sharing
from ourgrad.codegen.uops import UOps, launch_dims
from ourgrad.engine.realize import run_schedule
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.helpers import GlobalCounters
from ourgrad.ops import Ops
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer

from helpers import ROW_NORMALIZATIONS, device_opens, nvrtc_compiler, run_on_python_checking_cuda


NVRTC = nvrtc_compiler()




@pytest.fixture(autouse=True)
def row_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setenv("ROW_KERNELS", "1")


GRAPHS: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
  **ROW_NORMALIZATIONS,
  "layernorm_of_two_axes": (lambda x: x.reshape(x.shape[0], 2, -1).layernorm(axis=(-2, -1)),
                            lambda t: torch.nn.functional.layer_norm(t.reshape(t.shape[0], 2, -1),
                                                                     (2, t.shape[1] // 2))),
}
# (rows, row length): ragged (10 float4 units in a warp), odd length (scalar units), persistent float4 rows, and a
# row long enough that CUDA's 1024 threads keep more than PERSISTENT_UNITS units each (the looping pass)
SHAPES = [(3, 40), (5, 37), (4, 2048), (2, 40960)]


@pytest.fixture(autouse=True)
def no_split_k(monkeypatch: pytest.MonkeyPatch) -> None:
  """These tests pin the row kernel itself, long rows included. On a GPU a reduce with few outputs and long rows
  (2 x 40960) is first split in two kernels by the lazy layer (split-K, test_split_reduce.py), which fills the SMs
  better than 2 blocks would; here the split is off so the long-row path of the row kernel is what runs."""
  # a device of one multiprocessor: no reduce leaves it idle, so none splits
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts(1, 2048))
RENDERERS = {"emulate_cuda": lambda: PythonRenderer("CUDA"), "python": lambda: PythonRenderer()}


def _row_item(out: Tensor) -> ScheduleItem:
  schedule = create_schedule([out.lazydata])
  run_schedule(schedule[:-1])   # inputs (copies) first
  item = schedule[-1]
  assert sum(1 for item in schedule if item.ast.op is not Ops.COPY) == 1, "one kernel"
  return item


def _run(kernel: Kernel, item: ScheduleItem) -> np.ndarray: return run_on_python_checking_cuda(kernel, item, NVRTC)


@pytest.mark.parametrize("renderer", sorted(RENDERERS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_block_row_kernel_matches_torch(name: str, shape: tuple[int, int], renderer: str):
  if name == "layernorm_of_two_axes" and shape[1] % 2: pytest.skip("two equal halves of the row")
  ours, theirs = GRAPHS[name]
  x_np = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32) * 3
  item = _row_item(ours(Tensor(x_np, device="PYTHON")))
  got = _run(Kernel(item.ast, RENDERERS[renderer]()), item)
  expected = theirs(torch.tensor(x_np)).numpy()
  np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=2e-5, atol=2e-5)


# (rows, row length) of kernels whose short rows share a block: float4 rows of 32 (MiniLM's attention softmax) and 384
# (its layernorm), a ragged row (10 float4 units over 8 threads), a row of odd length (scalar units), and rows of 32
# floats under a mask read per batch (softmax with a padding mask, as the attention's)
SHARED_ROW_SHAPES = [(64, 32), (16, 384), (32, 40), (32, 37)]


def _emulated_cuda(multiprocessors: int) -> PythonRenderer:
  renderer = PythonRenderer("CUDA")
  renderer.multiprocessors = multiprocessors
  return renderer


@pytest.mark.parametrize("shape", SHARED_ROW_SHAPES, ids=lambda shape: "x".join(map(str, shape)))
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_shared_block_rows_match_torch(name: str, shape: tuple[int, int]):
  """Rows of at most a warp's threads x PERSISTENT_UNITS units, many of them: several rows to a block, each row's
  partials combined by a shuffle within its part of the warp (no local memory, no barrier)."""
  if name == "layernorm_of_two_axes" and shape[1] % 2: pytest.skip("two equal halves of the row")
  ours, theirs = GRAPHS[name]
  x_np = np.random.default_rng(sum(shape) + 3).standard_normal(shape).astype(np.float32) * 3
  item = _row_item(ours(Tensor(x_np, device="PYTHON")))
  kernel = Kernel(item.ast, _emulated_cuda(2))
  uops = linearize(kernel)
  global_size, local_size = launch_dims(uops)
  assert global_size[0] < shape[0] and not any(uop.op in (UOps.BARRIER, UOps.DEFINE_LOCAL) for uop in uops)
  got = _run(kernel, item)
  expected = theirs(torch.tensor(x_np)).numpy()
  np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=2e-5, atol=2e-5)


def test_masked_attention_softmax_rows_share_blocks():
  """The attention's softmax over keys with a padding mask read per batch (batch, heads, queries, keys): rows of 32
  share blocks, the mask index follows each row's batch."""
  rng = np.random.default_rng(5)
  scores_np = rng.standard_normal((4, 2, 32, 32)).astype(np.float32)
  keep_np = rng.random((4, 1, 1, 32)) < 0.7
  keep_np[..., 0] = True   # every row keeps a key
  scores, keep = Tensor(scores_np, device="PYTHON"), Tensor(keep_np, device="PYTHON")
  item = _row_item(keep.where(scores, float("-inf")).softmax(-1))
  kernel = Kernel(item.ast, _emulated_cuda(2))
  assert launch_dims(linearize(kernel))[0][0] < 4 * 2 * 32
  got = _run(kernel, item)
  expected = torch.tensor(scores_np).masked_fill(~torch.tensor(keep_np), float("-inf")).softmax(-1).numpy()
  np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=2e-5, atol=2e-5)


def test_minilm_row_kernels_share_blocks_on_132_multiprocessors():
  """MiniLM at batch 64 x 32 tokens on an H100: the attention softmax (24576 rows of 32 floats) takes 4 threads a row
  and 32 rows a block (was a warp a row, 8 lanes working); the layernorm (2048 rows of 384) a warp a row, 4 rows a
  block (was 128 threads a row, one float4 each)."""
  assert row_sharing(24576, 8, 32, 132) == (4, 32)
  assert row_sharing(2048, 96, 32, 132) == (32, 4)
  assert row_sharing(8, 8192 // 4, 32, 132) == (0, 1)   # long rows: a block each
  assert row_sharing(64, 8, 32, 132) == (0, 1)   # few rows: a block each, more blocks than multiprocessors
  softmax = _cuda_uops(Tensor.empty(64 * 12 * 32, 32).softmax(-1))
  assert launch_dims(softmax) == ((768, 1, 1), (128, 1, 1))
  layernorm = _cuda_uops(Tensor.empty(2048, 384).layernorm())
  assert launch_dims(layernorm) == ((512, 1, 1), (128, 1, 1))
  assert not any(uop.op is UOps.BARRIER for uop in softmax + layernorm)


def test_cross_entropy_per_sample_on_the_emulated_gpu():
  x_np = np.random.default_rng(1).standard_normal((12, 100)).astype(np.float32)
  labels = np.random.default_rng(2).integers(0, 100, 12).astype(np.int32)
  out = Tensor(x_np, device="PYTHON").cross_entropy(Tensor(labels, device="PYTHON"), reduction="none")
  item = _row_item(out)
  got = _run(Kernel(item.ast, PythonRenderer("CUDA")), item)
  expected = torch.nn.functional.cross_entropy(torch.tensor(x_np), torch.tensor(labels).long(), reduction="none")
  np.testing.assert_allclose(got, expected.numpy(), rtol=1e-5, atol=1e-5)


def _cuda_uops(out: Tensor) -> list:
  item = create_schedule([out.lazydata])[-1]
  return linearize(Kernel(item.ast, CUDARenderer()))


def test_softmax_row_is_read_once_and_exp_computed_once():
  # 8192 floats a row: 256 threads of 8 float4s each, kept in registers across the max, the sum and the store
  rows, length = 8, 8192
  uops = _cuda_uops(Tensor.empty(rows, length).softmax(-1))
  threads = row_block_threads(length // 4, CUDARenderer.max_threads, CUDARenderer.warp_size)
  assert launch_dims(uops) == ((rows, 1, 1), (threads, 1, 1))
  per_thread = length // 4 // threads
  assert per_thread <= PERSISTENT_UNITS
  input_loads = [uop for uop in uops if uop.op is UOps.LOAD and uop.srcs[0].op is UOps.DEFINE_GLOBAL]
  assert len(input_loads) == per_thread and all(uop.arg == 4 for uop in input_loads), "each float4 loaded once"
  assert sum(1 for uop in uops if uop.op is UOps.ALU and uop.arg is Ops.EXP2) == per_thread * 4, "exp once each"
  stores = [uop for uop in uops if uop.op is UOps.STORE and uop.srcs[0].op is UOps.DEFINE_GLOBAL]
  assert len(stores) == per_thread and all(uop.arg == 4 for uop in stores), "float4 stores"
  assert not any(uop.op is UOps.RANGE for uop in uops), "no loop: the row is unrolled"
  assert sum(1 for uop in uops if uop.op is UOps.BARRIER) == 2, "one barrier per reduce"


@pytest.mark.parametrize("shape", [(3, 40), (2, 40960)], ids=lambda shape: "x".join(map(str, shape)))
def test_bfloat16_rows_load_and_store_vectors_on_the_emulated_gpu(shape: tuple[int, int]):
  """bf16 rows (an autocast loss's logits, read by its logsumexp and its softmax gradient): 8 elements a unit are one
  16-byte load (a uint4 of packed halves on CUDA) and the bf16 softmax one 16-byte store, the bytes of float32's
  float4s; GPT-2's bf16 cross-entropy row kernel read its 1.65 GB of logits 2 bytes a load at 1.9 TB/s on the H200
  (4 elements, 8 bytes, a unit: 1.9 TB/s too)."""
  from ourgrad.dtype import bfloat16_bits_to_float32, dtypes
  x_np = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32) * 3
  x = Tensor(x_np, device="PYTHON").cast(dtypes.bfloat16).realize()
  item = _row_item(x.float().softmax(-1).cast(dtypes.bfloat16))
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  uops = linearize(kernel)
  loads = [uop for uop in uops if uop.op is UOps.LOAD and uop.srcs[0].op is UOps.DEFINE_GLOBAL]
  stores = [uop for uop in uops if uop.op is UOps.STORE and uop.srcs[0].op is UOps.DEFINE_GLOBAL]
  assert loads and all(uop.arg == 8 for uop in loads + stores), ([uop.arg for uop in loads], [u.arg for u in stores])
  got = bfloat16_bits_to_float32(_run(kernel, item))   # the buffer's bits as stored
  rounded = torch.tensor(x_np).bfloat16().float()
  expected = torch.softmax(rounded, -1).bfloat16().float().numpy()
  np.testing.assert_allclose(got.reshape(shape), expected, rtol=2 ** -7, atol=1e-6)


def test_long_rows_loop_and_reread():
  uops = _cuda_uops(Tensor.empty(2, 40960).softmax(-1))   # 10 float4s a thread in blocks of 1024
  assert launch_dims(uops) == ((2, 1, 1), (CUDARenderer.max_threads, 1, 1))
  # the max and the sum of exp(x - max) share a pass (online: the sum rescaled as the running max grows)
  assert sum(1 for uop in uops if uop.op is UOps.RANGE) == 2, "a loop per pass: max and sum, store"
  rescales = [uop for uop in uops if uop.op is UOps.ACCUMULATE and uop.arg is Ops.MUL]
  # the running sum is rescaled once per unit: 4 units an iteration of the loop (2 iterations), the 2 left after it
  assert row_passes.LOOP_REGISTER_UNITS == 4 and len(rescales) == 4 + 2
  first_loop = next(index for index, uop in enumerate(uops) if uop.op is UOps.RANGE)
  loop_end = next(index for index, uop in enumerate(uops) if uop.op is UOps.ENDRANGE)
  loads = [uop for uop in uops[first_loop:loop_end] if uop.op is UOps.LOAD and uop.srcs[0].op is UOps.DEFINE_GLOBAL]
  assert [load.arg for load in loads] == [4] * 4, "an iteration's four float4 loads, under no IF"
  assert not any(uop.op is UOps.IF for uop in uops[first_loop:loop_end])
  # compiled for two resident blocks of 1024: the loop's unrolling may not cost one of them (the row's loads in flight)
  assert [uop.arg for uop in uops if uop.op is UOps.OCCUPANCY] == [2]


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "logsumexp"])
def test_streamed_rows_take_smaller_blocks_and_match_torch(name: str):
  # rows that loop even with 1024 threads, and rows enough to give each multiprocessor (one, here) a block of 256 for
  # each of its 8 slots: blocks of STREAMED_ROW_THREADS, 40 float4 units a thread, 4 an iteration of its loop
  renderer = PythonRenderer("CUDA")
  renderer.multiprocessors = 1
  ours, theirs = GRAPHS[name] if name in GRAPHS else (lambda x: x.logsumexp(-1), lambda t: t.logsumexp(-1))
  x_np = np.random.default_rng(8).standard_normal((8, 40960)).astype(np.float32) * 3
  item = _row_item(ours(Tensor(x_np, device="PYTHON")))
  kernel = Kernel(item.ast, renderer)
  assert launch_dims(linearize(Kernel(item.ast, renderer)))[1][0] == row_blocks.STREAMED_ROW_THREADS
  expected = theirs(torch.tensor(x_np)).numpy()
  np.testing.assert_allclose(_run(kernel, item).reshape(expected.shape), expected, rtol=2e-5, atol=2e-5)


def test_per_row_output_is_stored_by_one_thread():
  uops = _cuda_uops(Tensor.empty(16, 512).var(-1))
  stores = [uop for uop in uops if uop.op is UOps.STORE and uop.srcs[0].op is UOps.DEFINE_GLOBAL]
  assert len(stores) == 1
  opened = [uop for uop in uops[:uops.index(stores[0])] if uop.op is UOps.IF]
  closed = [uop.srcs[0] for uop in uops[:uops.index(stores[0])] if uop.op is UOps.ENDIF]
  assert [uop for uop in opened if uop not in closed], "the store is inside an IF (thread 0)"


@pytest.mark.skipif(not device_opens("CUDA"), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("shape", [(64, 8192), (8, 32768), (1024, 1024), (7, 1000), (3, 50000), (24576, 32),
                                   (2048, 384), (4096, 37)])
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_row_kernels_on_cuda(name: str, shape: tuple[int, int]):
  if name == "layernorm_of_two_axes" and shape[1] % 2: pytest.skip("two equal halves of the row")
  ours, theirs = GRAPHS[name]
  x_np = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
  x = Tensor(x_np, device="CUDA").realize()
  GlobalCounters.reset()
  out = ours(x).realize()
  assert GlobalCounters.kernel_count == 1
  np.testing.assert_allclose(out.numpy(), theirs(torch.tensor(x_np)).numpy(), rtol=1e-4, atol=1e-4)
