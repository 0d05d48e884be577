"""The fused attention forward kernel's CUDA source run on the CPU (test/attention_forward_host.py) against PyTorch's
float64 SDPA: every tile configuration the plan takes (query rows per CTA, keys per tile, stages, ldmatrix or plain
fragment loads), float32 (TF32), float16 and bfloat16, causal and not, odd lengths, grouped-query attention, head
sizes 64 and 128, rows copied by cp.async or element by element; and the wgmma kernel (codegen/attention_wgmma.py,
16-bit: its swizzled tiles, descriptors and register fragments through the harness's wgmma). O is checked in the
operand type it is written in, and the float32 logsumexp after it."""
from __future__ import annotations

import dataclasses
import math
import subprocess

import numpy as np
import pytest
import torch

from attention_forward_host import evaluate_poly_exp2_on_host, run_forward_on_host
from ourgrad.codegen.attention import AttentionPlan, Operand, plan_attention
from ourgrad.dtype import bfloat16_bits_to_float32, dtypes, float32_to_bfloat16_bits
from ourgrad.renderer.cuda import CUDARenderer

from attention_backward_host import PRELUDE, host_binary, host_compiler, host_main

pytestmark = pytest.mark.skipif(host_compiler() is None, reason="no g++ to run the kernel on the host")

# relative (Frobenius) error of O allowed against float64: operands and P rounded to TF32 / float16 / bfloat16, O
# rounded to its type
TOLERANCES = {"float32": 3e-3, "float16": 3e-3, "bfloat16": 2e-2}
STORED = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


@pytest.fixture(autouse=True)
def _mma_sync_rule(monkeypatch):
  """The plans start from the mma.sync kernel's rule (the wgmma tests ask for theirs)."""
  monkeypatch.setenv("ATTENTION_WGMMA", "0")


def _stored(values: np.ndarray, dtype: str) -> np.ndarray:
  """float32 values as the kernel's buffer holds them (bfloat16: its bits)."""
  return float32_to_bfloat16_bits(values) if dtype == "bfloat16" else values.astype(STORED[dtype])


def _widened(elements: np.ndarray, dtype: str) -> np.ndarray:
  return bfloat16_bits_to_float32(elements) if dtype == "bfloat16" else elements.astype(np.float32)


def _contiguous(buffer: int, heads: int, rows: int, head_dim: int) -> Operand:
  return Operand(buffer, 0, (heads * rows * head_dim, rows * head_dim, head_dim, 1))


def _run(dtype: str, causal: bool, batch: int, heads: int, kv_heads: int, length: int, source: int, head_dim: int,
         seed: int, **blocks) -> tuple[AttentionPlan, float, float]:
  """The relative error of O and the max abs error of the logsumexp of the kernel on the host vs float64 torch."""
  rng = np.random.default_rng(seed)
  arrays = [rng.standard_normal((batch, count, rows, head_dim)).astype(np.float32)
            for count, rows in ((heads, length), (kv_heads, source), (kv_heads, source))]
  # key_growth g: key s scaled by 1 + g s, so a row's max keeps growing from tile to tile (the softmax's rescales)
  arrays[1] *= (1 + blocks.pop("key_growth", 0.0) * np.arange(source, dtype=np.float32))[:, None]
  stored = [_stored(array, dtype) for array in arrays]
  scale = blocks.pop("scale", 1 / math.sqrt(head_dim))
  # offset 1: each buffer starts one element before its operand (rows not 4-byte aligned: element loads and copies)
  offset = blocks.pop("offset", 0)
  buffers = [np.concatenate([np.zeros(offset, dtype=array.dtype), array.reshape(-1)]) for array in stored]
  operands = [dataclasses.replace(_contiguous(1 + index, count, rows, head_dim), offset=offset)
              for index, (count, rows) in enumerate(((heads, length), (kv_heads, source), (kv_heads, source)))]
  plan = plan_attention(*operands, ((batch, heads, length, head_dim), (batch, kv_heads, source, head_dim)),
                        getattr(dtypes, dtype), causal, scale, CUDARenderer("sm_90"))
  plan = dataclasses.replace(plan, **blocks)
  out = run_forward_on_host(plan, *buffers)
  o = _widened(out.view(STORED[dtype])[:plan.o_elements], dtype).reshape(batch, length, heads, head_dim)
  lse = out.view(np.float32)[plan.lse_offset:plan.lse_offset + batch * heads * length].reshape(batch, heads, length)
  q, k, v = (torch.tensor(_widened(array, dtype), dtype=torch.float64) for array in stored)
  k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
  scores = q @ k.transpose(-1, -2) * scale
  if causal: scores = scores.masked_fill(~torch.ones(length, source, dtype=torch.bool).tril(), -math.inf)
  want_o = (torch.softmax(scores, -1) @ v).transpose(1, 2).numpy()
  o_error = float(np.linalg.norm(o - want_o) / np.linalg.norm(want_o))
  return plan, o_error, float(np.abs(lse - torch.logsumexp(scores, -1).numpy()).max())


# (block_m, block_n, stages, ldmatrix, warp_tiles): the rule's tiles, larger and smaller ones, three stages, two m
# tiles of 16 rows per warp
CONFIGS = [(64, 64, 2, False, 1), (64, 64, 2, True, 1), (128, 64, 2, True, 1), (128, 32, 3, True, 1),
           (64, 128, 2, True, 1), (128, 64, 2, True, 2), (64, 32, 2, False, 2)]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", CONFIGS,
                         ids=lambda c: "m{}_n{}_s{}_{}_w{}".format(*c[:3], "ldm" if c[3] else "lds", c[4]))
def test_forward_kernel_on_host(dtype, causal, config):
  block_m, block_n, stages, ldmatrix, warp_tiles = config
  # odd lengths (neither a multiple of the tiles), L != S, grouped-query heads
  plan, o_error, lse_error = _run(dtype, causal, 1, 2, 1, 83 if causal else 70, 83 if causal else 131, 64, seed=1,
                                  block_m=block_m, block_n=block_n, stages=stages, ldmatrix=ldmatrix,
                                  warp_tiles=warp_tiles)
  assert plan.vector_copies
  assert o_error < TOLERANCES[dtype], (plan, o_error)
  assert lse_error < 2e-2, (plan, lse_error)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_dim_128_on_host(dtype):
  _, o_error, lse_error = _run(dtype, True, 1, 1, 1, 45, 45, 128, seed=2)
  assert o_error < TOLERANCES[dtype] and lse_error < 2e-2


def test_negative_scale_is_not_folded():
  """A negative scale reverses the order of S: the kernel scales S before its max instead of folding the scale into
  exp2 (AttentionPlan.folded_scale)."""
  plan, o_error, lse_error = _run("bfloat16", False, 1, 1, 1, 40, 50, 64, seed=3, scale=-0.125)
  assert not plan.folded_scale and o_error < TOLERANCES["bfloat16"] and lse_error < 2e-2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_unaligned_rows_on_host(dtype):
  """Operands one element past an aligned start: Q's pairs and K/V's rows are read element by element."""
  plan, o_error, lse_error = _run(dtype, True, 1, 2, 2, 37, 37, 64, seed=4, offset=1)
  assert not plan.vector_copies and o_error < TOLERANCES[dtype] and lse_error < 2e-2


# (block_m, block_n, stages, min_ctas, overlap, q_shared) of the wgmma kernel: the rule's two warpgroups, one
# warpgroup, three, narrow key tiles over three stages; P V in flight during the next tile's S and softmax; Q staged
# in shared memory
WGMMA_CONFIGS = [(128, 128, 2, 1, False, False), (64, 128, 2, 3, False, False), (192, 64, 2, 1, False, False),
                 (128, 32, 3, 1, False, False), (128, 128, 3, 1, True, False), (64, 16, 4, 4, True, False),
                 (128, 64, 2, 1, False, True), (192, 32, 3, 1, True, True)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", WGMMA_CONFIGS, ids=lambda c: "m{}_n{}_s{}_c{}_o{:d}_q{:d}".format(*c))
def test_wgmma_forward_kernel_on_host(dtype, causal, config):
  block_m, block_n, stages, min_ctas, overlap, q_shared = config
  plan, o_error, lse_error = _run(dtype, causal, 1, 2, 1, 83 if causal else 70, 83 if causal else 131, 64, seed=5,
                                  mma="wgmma", block_m=block_m, block_n=block_n, stages=stages, min_ctas=min_ctas,
                                  overlap=overlap, q_shared=q_shared)
  assert o_error < TOLERANCES[dtype], (plan, o_error)
  assert lse_error < 2e-2, (plan, lse_error)


# (block_m, block_n, stages, overlap, pingpong) of the wgmma kernel with a producer warpgroup: two consumer warpgroups
# over a two-stage ring, one over three, three consumers with P V in flight over two stages, narrow tiles over four;
# two and three consumers taking turns
PRODUCER_CONFIGS = [(128, 128, 2, False, False), (64, 64, 3, False, False), (192, 32, 2, True, False),
                    (128, 16, 4, True, False), (128, 64, 2, True, True), (192, 16, 3, True, True),
                    (192, 96, 4, True, True)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("exp_poly", [1, 3])
def test_polynomial_exp2_on_host(dtype, exp_poly):
  """plan.exp_poly: every (1: all, 3: every third) 8 keys' exp2 by the cubic of POLY_EXP2_HELPER; the causal mask's
  -inf scores among them (clamped: P under 1e-37), against float64."""
  plan, o_error, lse_error = _run(dtype, True, 1, 2, 1, 83, 83, 64, seed=9, mma="wgmma", block_m=128, block_n=64,
                                  stages=2, overlap=True, producer=True, pingpong=True, min_ctas=1, exp_poly=exp_poly)
  assert o_error < TOLERANCES[dtype], (plan, o_error)
  assert lse_error < 2e-2, (plan, lse_error)


def test_polynomial_exp2_against_numpy():
  """The cubic itself on the host over [-130, 0] (whole numbers, halves, the clamp): relative error under 1e-4 of
  2^x down to 2^-126, and x = -inf gives at most 2^-126."""
  points = np.concatenate([np.linspace(-130, 0, 20001, dtype=np.float32), [-np.inf, -0.5, 0.5, -125.5]])
  got = evaluate_poly_exp2_on_host(points.astype(np.float32))
  inside = points >= -125
  want = np.exp2(points[inside].astype(np.float64))
  assert np.abs(got[inside] / want - 1).max() < 1e-4
  assert (got[~inside] >= 0).all() and (got[~inside] <= 2.0 ** -125).all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", PRODUCER_CONFIGS, ids=lambda c: "m{}_n{}_s{}_o{:d}_p{:d}".format(*c))
def test_wgmma_producer_forward_kernel_on_host(dtype, causal, config):
  """plan.producer: the consumers read the tiles a producer warpgroup copies through the mbarrier ring; odd lengths,
  L != S, grouped-query heads, more tiles than stages (the ring's reuse and its phases); with pingpong the turns'
  named barriers (a wrong count of arrivals hangs or races here as on the GPU)."""
  block_m, block_n, stages, overlap, pingpong = config
  plan, o_error, lse_error = _run(dtype, causal, 1, 2, 1, 83 if causal else 70, 83 if causal else 131, 64, seed=8,
                                  mma="wgmma", block_m=block_m, block_n=block_n, stages=stages, overlap=overlap,
                                  producer=True, min_ctas=1, pingpong=pingpong)
  assert plan.threads == block_m * 2 + 128
  assert o_error < TOLERANCES[dtype], (plan, o_error)
  assert lse_error < 2e-2, (plan, lse_error)


def test_wgmma_rule_and_head_dim_128_on_host(monkeypatch):
  """ATTENTION_WGMMA=1 (the default): the rule's wgmma plan for D = 128 (two 64-column chunks per staged row: K's
  slices 4.. and V's second 64 columns through the descriptors' strides), grouped heads, a length past the CTA's
  rows."""
  monkeypatch.setenv("ATTENTION_WGMMA", "1")
  monkeypatch.delenv("ATTENTION_BLOCKS", raising=False)
  plan, o_error, lse_error = _run("bfloat16", True, 1, 2, 1, 150, 150, 128, seed=6)
  assert plan.mma == "wgmma" and plan.block_m == 64 and plan.query_blocks == 3
  assert o_error < TOLERANCES["bfloat16"] and lse_error < 2e-2
  _, o_error, lse_error = _run("float16", False, 1, 2, 2, 150, 90, 128, seed=7, q_shared=True, stages=3, overlap=True)
  assert o_error < TOLERANCES["float16"] and lse_error < 2e-2


# (mma, block_m, block_n, stages, overlap, producer, pingpong): the mma.sync kernel, the one-warpgroup wgmma kernel
# with P V in flight, three consumers of a producer warpgroup taking turns
LAZY_RESCALE_CONFIGS = [("mma_sync", 64, 32, 2, False, False, False), ("wgmma", 64, 16, 4, True, False, False),
                        ("wgmma", 192, 16, 3, True, True, True)]


@pytest.mark.parametrize("slack", [0.0, 8.0])
@pytest.mark.parametrize("config", LAZY_RESCALE_CONFIGS, ids=lambda c: "{}_m{}_n{}_s{}".format(*c[:4]))
def test_lazy_rescale_on_host(slack, config):
  """plan.rescale_slack: keys whose scores grow along the sequence (a row's max passes the reference by more than the
  slack tile after tile, so the rescale runs in some warps and not in others, and P reaches 2^slack), causal over
  two batches of two heads (the longest-first order of the CTAs across heads), against float64; slack 0: the eager
  softmax (with the chained max and sum; slack 8 with their trees)."""
  mma, block_m, block_n, stages, overlap, producer, pingpong = config
  plan, o_error, lse_error = _run("bfloat16", True, 2, 2, 1, 200, 200, 64, seed=10, key_growth=0.05, mma=mma,
                                  block_m=block_m, block_n=block_n, stages=stages, overlap=overlap, producer=producer,
                                  pingpong=pingpong, min_ctas=1, rescale_slack=slack, tree_reduce=slack > 0)
  assert plan.rescale_slack == slack and plan.query_blocks > 1 and plan.tree_reduce == (slack > 0)
  assert o_error < TOLERANCES["bfloat16"], (plan, o_error)
  assert lse_error < 2e-2, (plan, lse_error)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", [(192, 32, 3, True, True), (128, 64, 2, False, False)],
                         ids=lambda c: "m{}_n{}_s{}_o{:d}_p{:d}".format(*c))
def test_wgmma_producer_with_q_in_shared_memory_on_host(causal, config):
  """plan.producer with q_shared: each consumer warpgroup stages its own 64 query rows (rows past L as zeros) and
  reads S's A operand through a descriptor; three consumers taking turns, two without overlap; odd lengths."""
  block_m, block_n, stages, overlap, pingpong = config
  plan, o_error, lse_error = _run("bfloat16", causal, 2, 2, 1, 83 if causal else 70, 83 if causal else 131, 64,
                                  seed=11, mma="wgmma", block_m=block_m, block_n=block_n, stages=stages,
                                  overlap=overlap, producer=True, min_ctas=1, pingpong=pingpong, q_shared=True)
  assert plan.q_shared and plan.threads == block_m * 2 + 128
  assert o_error < TOLERANCES["bfloat16"], (plan, o_error)
  assert lse_error < 2e-2, (plan, lse_error)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("config", [(192, 32, 3, True, True), (128, 64, 2, False, False)],
                         ids=lambda c: "m{}_n{}_s{}_o{:d}_p{:d}".format(*c))
def test_persistent_producer_on_host(causal, config):
  """plan.persistent: a grid of 3 CTAs (multiprocessors=3) walks 12 query blocks (two batches of two heads, 3 blocks
  each) in the snake order, the ring's count and phases running on across a CTA's items (a stage left unreleased or
  a phase off by one hangs here as on the GPU), the next item's Q staged by each consumer warpgroup."""
  block_m, block_n, stages, overlap, pingpong = config
  plan, o_error, lse_error = _run("bfloat16", causal, 2, 2, 1, 2 * block_m + 11, 2 * block_m + 11, 64, seed=12,
                                  mma="wgmma", block_m=block_m, block_n=block_n, stages=stages, overlap=overlap,
                                  producer=True, min_ctas=1, pingpong=pingpong, q_shared=True, persistent=True,
                                  multiprocessors=3)
  assert plan.global_size == (3, 1, 1) and plan.items == 12
  assert o_error < TOLERANCES["bfloat16"], (plan, o_error)
  assert lse_error < 2e-2, (plan, lse_error)


# ---------------------------------------------------------------- the harness itself (attention_backward_host)

BARRIER_KERNEL = r"""
float exchange[64];
void kernel(float* out, bool skip) {
  exchange[threadIdx.x] = (float)(threadIdx.x + 1);
  if (!(skip && threadIdx.x == 0)) __syncthreads();   // skip: thread 0 never arrives, the others wait forever
  out[blockIdx.x * 64 + threadIdx.x] = exchange[(threadIdx.x + 1) % 64] + 100.0f * blockIdx.x;
}
"""


def _run_barrier_kernel(tmp_path, skip: bool) -> subprocess.CompletedProcess:
  source = PRELUDE + BARRIER_KERNEL + host_main(f"kernel((float*)buffers[0], {str(skip).lower()})", 64, (2, 1, 1))
  path = tmp_path / "out.bin"
  np.zeros(128, np.float32).tofile(path)
  result = subprocess.run([host_binary(source), str(path)], capture_output=True, text=True)
  result.out = np.fromfile(path, np.float32)
  return result


def test_host_threads_meet_at_barriers(tmp_path):
  """Each fiber reads its neighbour's value written before __syncthreads, in both blocks of the grid."""
  result = _run_barrier_kernel(tmp_path, skip=False)
  assert result.returncode == 0, result.stderr
  want = (np.arange(64) + 1) % 64 + 1
  np.testing.assert_array_equal(result.out, np.concatenate([want, want + 100]).astype(np.float32))


def test_host_hang_is_reported(tmp_path):
  """A barrier some thread never reaches hangs on the GPU: the harness stops with a message instead of waiting."""
  result = _run_barrier_kernel(tmp_path, skip=True)
  assert result.returncode == 3 and "63 threads wait" in result.stderr


def test_host_binary_compiles_a_source_once(monkeypatch, tmp_path):
  """host_binary's disk cache: the same source twice is one g++ run, another source a second one."""
  monkeypatch.setenv("OURGRAD_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv("DISABLE_COMPILER_CACHE", raising=False)
  compiles = []
  original = subprocess.run
  monkeypatch.setattr(subprocess, "run", lambda args, **kw: compiles.append(args[0]) or original(args, **kw))
  source = PRELUDE + "int main() { return 0; }\n"
  first = host_binary(source)
  assert host_binary(source) == first and len(compiles) == 1
  assert host_binary(source + "// another\n") != first and len(compiles) == 2
