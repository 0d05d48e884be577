"""Interleaved rows of GPU row kernels (codegen/row_blocks.py `_interleaved_rows`): where a kernel's largest loads
are strided along the row but contiguous across neighbouring rows (a decode step's P @ V: the cache read along the
slots for each head_dim output), neighbouring threads take neighbouring rows and a row's threads sit that many lanes
apart, so that a warp's load reads whole 32-byte sectors.

The attention of a decode step (extra/models/llama.py `softmax_weighted_sum` over `where(write, new rows, cache)`) is
lowered for CUDA's limits (PYTHON's `EMULATE=CUDA` mode: shuffles `interleave` lanes apart, each warp's partial
through local memory) and for the PYTHON device's own (no shuffles: not interleaved), run in the interpreter and
compared with numpy; the launch shapes and the shuffles' strides are pinned.
"""
from __future__ import annotations

import numpy as np
import pytest

from ourgrad import Tensor, dtypes
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.uops import UOps, launch_dims
from ourgrad.engine.realize import run_schedule
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.ops import Ops
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer

from extra.models.llama import softmax_weighted_sum
from helpers import nvrtc_compiler, run_on_python_checking_cuda

NVRTC = nvrtc_compiler()
RENDERERS = {"emulate_cuda": lambda: PythonRenderer("CUDA"), "python": lambda: PythonRenderer()}


@pytest.fixture(autouse=True)
def row_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setenv("ROW_KERNELS", "1")


def _kernel_item(out: Tensor) -> ScheduleItem:
  schedule = create_schedule([out.lazydata])
  run_schedule(schedule[:-1])   # inputs (copies) first
  assert sum(1 for item in schedule if item.ast.op is not Ops.COPY) == 1, "one kernel"
  return schedule[-1]


def _decode_attention(sequences: int, kv_heads: int, group: int, slots: int, head_dim: int,
                      device: str = "PYTHON") -> tuple[Tensor, np.ndarray]:
  """softmax(scores) @ values of a decode step, the values read from the KV cache (sequences, slots, 2 * kv_heads,
  head_dim) with this step's row in place where `write` marks it (llama.py `LlamaBlock.decode`), and numpy's."""
  rng = np.random.default_rng(sequences * 1000 + slots)
  cache_np = rng.standard_normal((sequences, slots, 2 * kv_heads, head_dim)).astype(np.float32)
  new_np = rng.standard_normal((sequences, 1, 2 * kv_heads, head_dim)).astype(np.float32)
  scores_np = rng.standard_normal((sequences, kv_heads, group, slots)).astype(np.float32) * 3
  write_np = np.zeros((sequences, slots, 1, 1), bool)
  write_np[np.arange(sequences), rng.integers(0, slots, sequences)] = True
  cache, new = Tensor(cache_np, device=device), Tensor(new_np, device=device)
  write, scores = Tensor(write_np, device=device), Tensor(scores_np, device=device)
  shape = (sequences, slots, kv_heads, head_dim)
  values = write.where(new[:, :, kv_heads:].expand(shape), cache[:, :, kv_heads:]).permute(0, 2, 1, 3)
  values_np = np.where(write_np, new_np, cache_np)[:, :, kv_heads:].transpose(0, 2, 1, 3).astype(np.float64)
  weights = np.exp(scores_np - scores_np.max(-1, keepdims=True))
  expected = (weights / weights.sum(-1, keepdims=True)) @ values_np   # (S, kv, group, head_dim)
  return softmax_weighted_sum(scores, values), expected


def _launch_and_shuffles(out: Tensor) -> tuple[tuple, list[tuple]]:
  item = create_schedule([out.lazydata])[-1]
  uops = linearize(Kernel(item.ast, CUDARenderer()))
  return launch_dims(uops), [uop.arg[1:] for uop in uops if uop.op is UOps.WARP_REDUCE]


@pytest.mark.parametrize("renderer", sorted(RENDERERS))
@pytest.mark.parametrize("shape", [(1, 3, 3, 40, 64), (2, 2, 2, 136, 16), (1, 1, 2, 12, 8), (8, 2, 3, 24, 16)],
                         ids=lambda shape: "x".join(map(str, shape)))
def test_decode_attention_matches_numpy(shape: tuple[int, int, int, int, int], renderer: str) -> None:
  """Sequences x kv heads x group x slots x head_dim: 8 threads a row over two warps (each warp's partial through
  local memory), 32 threads a row over 8 warps with a ragged last unit (34 float4s), a row of 3 units on one warp,
  8 sequences (the group's 3 query heads stacked in each thread, interleaved along head_dim)."""
  out, expected = _decode_attention(*shape)
  item = _kernel_item(out)
  got = run_on_python_checking_cuda(Kernel(item.ast, RENDERERS[renderer]()), item, NVRTC)
  np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=2e-5, atol=2e-5)


def test_decode_attention_lanes_run_along_head_dim() -> None:
  """SmolLM2's decode attention (3 KV heads x 3 query heads x 64 outputs over 520 slots): 8 neighbouring outputs a
  block (8 floats: one 32-byte sector of each cache slot a warp's load reads), 32 threads a row, 4 of them in each
  warp, 8 lanes apart; the 576 rows were a warp each, its lanes 4 slots (6 KB) apart."""
  out, _ = _decode_attention(1, 3, 3, 520, 64, device="CPU")
  (global_size, local_size), shuffles = _launch_and_shuffles(out)
  assert (global_size, local_size) == ((3 * 3 * 64 // 8, 1, 1), (8 * 32, 1, 1))
  assert shuffles == [(4, 8)] * 3   # max, weighted sum, sum: 4 lanes of a row in a warp, 8 apart


def test_stacked_rows_interleave_too() -> None:
  """8 sequences: the group's 3 query heads stacked in each thread (the values read once for them), 8 neighbouring
  head_dim outputs a block."""
  out, _ = _decode_attention(8, 3, 3, 520, 64, device="CPU")
  (global_size, local_size), shuffles = _launch_and_shuffles(out)
  assert (global_size, local_size) == ((8 * 3 * 64 // 8, 1, 1), (8 * 32, 1, 1))
  assert shuffles and all(arg == (4, 8) for arg in shuffles)


def test_bfloat16_values_interleave_a_sector_of_rows() -> None:
  """Values of 2 bytes (a head a query, nothing stacked): 16 neighbouring outputs fill a sector."""
  scores, values = Tensor.empty(1, 4, 1, 256), Tensor.empty(1, 4, 256, 64, dtype=dtypes.bfloat16)
  (global_size, local_size), shuffles = _launch_and_shuffles(softmax_weighted_sum(scores, values))
  assert global_size[0] * 16 == 4 * 64 and local_size[0] % 32 == 0
  assert shuffles and all(stride == 16 for _, stride in shuffles)


def test_rows_read_along_their_length_are_not_interleaved() -> None:
  """A softmax over the last axis reads its rows contiguously: rows keep their own warps (shuffles 1 lane apart)."""
  _, shuffles = _launch_and_shuffles(Tensor.empty(64, 300).softmax(-1))
  assert shuffles and all(stride == 1 for _, stride in shuffles)


@pytest.mark.parametrize("sequences", [1, 8])
def test_persistent_rows_issue_every_load_before_the_first_barrier(sequences: int) -> None:
  """The values P @ V reads after the softmax's max are loaded before the max's block combine (a BARRIER, across
  which the compiler does not move loads): all of a thread's reads are in flight at once, those of every stacked row
  too (8 sequences). Only the ragged last unit (under an IF) is read where it is used."""
  out, _ = _decode_attention(sequences, 3, 3, 520, 64, device="CPU")
  uops = linearize(Kernel(create_schedule([out.lazydata])[-1].ast, CUDARenderer()))
  barrier = next(position for position, uop in enumerate(uops) if uop.op is UOps.BARRIER)
  depth, late = 0, []
  for position, uop in enumerate(uops):
    depth += (uop.op is UOps.IF) - (uop.op is UOps.ENDIF)
    if uop.op is UOps.LOAD and uop.srcs[0].op is UOps.DEFINE_GLOBAL and depth == 0 and position > barrier:
      late.append(uop)
  assert late == [], late
  assert sum(1 for uop in uops[:barrier] if uop.op is UOps.LOAD and uop.srcs[0].op is UOps.DEFINE_GLOBAL) > 16 * 2
