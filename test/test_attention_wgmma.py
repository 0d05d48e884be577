"""The fused attention forward on warpgroup MMA (codegen/attention_wgmma.py, plan mma="wgmma"): its shared-memory
layout and descriptors against numpy (read back through runtime/wgmma_emulator.py's PTX-ISA model of what the tensor
cores read), the plan's rule, the CUDA source compiled by NVRTC for sm_90a (no spills), and the forward on the PYTHON
device emulating an H100 against PyTorch float64. The kernel's source itself runs on the CPU in
test/test_flash_attention_host.py; on an sm_90 GPU the CUDA tests of test/test_flash_attention.py run it with
ATTENTION_WGMMA=1.
"""
from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

from ourgrad import Tensor
from ourgrad.codegen import attention_wgmma
from ourgrad.codegen.attention import AttentionKernel, Operand, blocks_text, is_attention, plan_attention
from ourgrad.codegen.attention_render import render_attention
from ourgrad.codegen.attention_wgmma import (key_slice_start, key_strides, staged_offset, value_slice_start,
                                             value_strides)
from ourgrad.codegen.wgmma_tiles import descriptor
from ourgrad.device import Device
from ourgrad.dtype import dtypes
from ourgrad.engine.realize import run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.errors import ShapeError
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.wgmma_emulator import read_operand

from helpers import device_opens, emulated_gpu_tf32, nvrtc_compiler

NVRTC = nvrtc_compiler()


def _staged_tile(tile: np.ndarray) -> np.ndarray:
  """A (rows, D) tile of 16-bit words written into a shared image by staged_offset, 16-byte piece by piece."""
  rows, head_dim = tile.shape
  shared = np.zeros(rows * head_dim, dtype=np.uint16)
  row, column = np.meshgrid(np.arange(rows), np.arange(0, head_dim, 8), indexing="ij")
  target = staged_offset(rows, row.reshape(-1), column.reshape(-1)) // 2
  shared[target[:, None] + np.arange(8)] = tile[row.reshape(-1)[:, None], column.reshape(-1)[:, None] + np.arange(8)]
  return shared


@pytest.mark.parametrize("block_n, head_dim", [(128, 64), (64, 128), (32, 64), (16, 192)])
def test_staged_tiles_read_back_through_the_descriptors(block_n, head_dim):
  """Every element lands once; K's K-major descriptor of slice j reads keys x D[16 j:16 j + 16] and V's MN-major one
  (transposed) reads D x keys[16 j:16 j + 16]: what S = Q K^T and O = P V need as B."""
  tile = np.random.default_rng(0).integers(1, 60000, (block_n, head_dim)).astype(np.uint16)
  shared = _staged_tile(tile)
  assert sorted(shared.tolist()) == sorted(tile.reshape(-1).tolist())
  for j in range(head_dim // 16):
    got = read_operand(shared, descriptor(key_slice_start(block_n, j), *key_strides()), block_n, k_major=True)
    np.testing.assert_array_equal(got, tile[:, 16 * j:16 * j + 16])
  for j in range(block_n // 16):
    got = read_operand(shared, descriptor(value_slice_start(j), *value_strides(block_n)), head_dim, k_major=False)
    np.testing.assert_array_equal(got, tile[16 * j:16 * j + 16].T)


def test_shifted_descriptor_is_the_descriptor_of_the_shifted_address():
  """attention_wgmma.shifted_descriptor (a tile's descriptor plus offset / 16) gives the descriptor
  wgmma_tiles.descriptor builds of the operand's own address, for every 16-byte offset of a tile in shared memory."""
  from ourgrad.codegen.attention_wgmma import shifted_descriptor
  assert shifted_descriptor("k_stage", 96, 16, 1024) == \
      "(wgmma_descriptor(k_stage, 16, 1024) + (unsigned long long)((96) >> 4))"
  for address in (0, 1024, 0x1c000, 0x37000):
    for offset in range(0, 0x7000, 16 * 37):
      assert descriptor(address, 16, 1024) + (offset >> 4) == descriptor(address + offset, 16, 1024)


def _plan(dtype, head_dim: int = 64, renderer=None, offset: int = 0, length: int = 1024, batch: int = 4):
  heads = 12
  operand = Operand(1, offset, (heads * length * head_dim, length * head_dim, head_dim, 1))
  shape = (batch, heads, length, head_dim)
  return plan_attention(operand, operand, operand, (shape, shape), dtype, True, 0.125,
                        renderer or CUDARenderer("sm_90"))


def test_rule_picks_wgmma_for_16_bit_operands_on_sm90(monkeypatch):
  """ATTENTION_WGMMA=1 (the default): float16/bfloat16 with D a multiple of 64 and aligned rows on sm_90 take the wgmma
  kernel (one warpgroup a CTA, 3 CTAs a multiprocessor at D = 64, 2 at D = 128 by their registers); float32, D = 32,
  unaligned rows and sm_80 keep mma.sync; ATTENTION_WGMMA=0 too."""
  monkeypatch.delenv("ATTENTION_BLOCKS", raising=False)
  monkeypatch.setenv("ATTENTION_WGMMA", "1")
  for dtype, head_dim, ctas in ((dtypes.bfloat16, 64, 3), (dtypes.float16, 64, 3), (dtypes.bfloat16, 128, 2)):
    plan = _plan(dtype, head_dim)
    assert (plan.mma, plan.block_m, plan.threads, plan.min_ctas) == ("wgmma", 64, 128, ctas), (dtype, head_dim)
    assert plan.shared_bytes == plan.stages * 2 * plan.block_n * head_dim * 2 + 1024
  assert _plan(dtypes.float32).mma == "mma_sync"
  assert _plan(dtypes.bfloat16, 32).mma == "mma_sync"
  assert _plan(dtypes.bfloat16, offset=1).mma == "mma_sync"
  assert _plan(dtypes.bfloat16, renderer=CUDARenderer("sm_80")).mma == "mma_sync"
  assert attention_wgmma.wgmma_refusal("float32", 64, True) is not None
  monkeypatch.setenv("ATTENTION_WGMMA", "0")
  assert _plan(dtypes.bfloat16).mma == "mma_sync"


def test_producer_rule_by_registers_and_waves(monkeypatch):
  """ATTENTION_PRODUCER=1 (the default): three consumer warpgroups at their setmaxnreg share (160), Q in shared memory,
  take the most keys a tile that share fits (D = 64: 128) where the grid has PRODUCER_LEAST_WAVES CTAs a
  multiprocessor (T = 4096; not T = 1024's 288 CTAs on 132); D = 128 fits 80, under PRODUCER_LEAST_KEYS, and keeps
  the one-warpgroup rule."""
  monkeypatch.delenv("ATTENTION_BLOCKS", raising=False)
  monkeypatch.setenv("ATTENTION_WGMMA", "1")
  monkeypatch.setenv("ATTENTION_PRODUCER", "1")
  plan = _plan(dtypes.bfloat16, length=4096)
  assert blocks_text(plan) == "192,128,4,1,1,1,1,1,160,1" and plan.threads == 512 and plan.q_shared
  assert attention_wgmma.producer_registers(plan) == 32
  assert blocks_text(_plan(dtypes.bfloat16, length=1024)) == "64,128,2,1,3"
  assert blocks_text(_plan(dtypes.bfloat16, 128, length=4096)) == "64,64,2,1,2"


def test_producer_rule_needs_rings_of_key_tiles(monkeypatch):
  """A grid with enough CTAs (B=16 T=1024: 1152 on 132 multiprocessors) still keeps the one-warpgroup rule where a
  causal CTA streams about 5 key tiles (about one ring of 4 stages: H200 0.140 ms against 0.113); T=4096 streams
  ~16 of 128 and takes the producer kernel."""
  monkeypatch.delenv("ATTENTION_BLOCKS", raising=False)
  monkeypatch.setenv("ATTENTION_WGMMA", "1")
  monkeypatch.setenv("ATTENTION_PRODUCER", "1")
  assert blocks_text(_plan(dtypes.bfloat16, length=1024, batch=16)) == "64,128,2,1,3"
  assert blocks_text(_plan(dtypes.bfloat16, length=4096, batch=16)) == "192,128,4,1,1,1,1,1,160,1"
  long = _plan(dtypes.bfloat16, length=4096)
  assert attention_wgmma.mean_key_tiles(long) == 16.5 and attention_wgmma.PRODUCER_LEAST_RINGS * 4 <= 16.5


def test_producer_plan_round_trips_through_the_python_program(monkeypatch):
  """The PYTHON device's attention program (runtime/attention_emulator.py: the plan as JSON, what the compile cache
  stores) gives back the producer plan's every field."""
  from ourgrad.runtime.attention_emulator import AttentionProgram, attention_program_text
  monkeypatch.setenv("ATTENTION_WGMMA", "1")
  monkeypatch.setenv("ATTENTION_BLOCKS", "192,96,4,1,1,1,0,1,160,1,4")
  plan = _plan(dtypes.bfloat16)
  assert (plan.producer, plan.pingpong, plan.consumer_registers, plan.exp_poly) == (True, True, 160, 4)
  program = AttentionProgram("attention", attention_program_text("attention", plan, {"out": 0, "q": 1, "k": 1,
                                                                                       "v": 1}).encode())
  assert program.plan == plan


def test_blocks_override_keeps_whole_warpgroups(monkeypatch):
  monkeypatch.setenv("ATTENTION_WGMMA", "1")
  monkeypatch.setenv("ATTENTION_BLOCKS", "64,128,2,1,3")
  plan = _plan(dtypes.bfloat16)
  assert (plan.mma, plan.block_m, plan.block_n, plan.min_ctas) == ("wgmma", 64, 128, 3)
  monkeypatch.setenv("ATTENTION_BLOCKS", "128,64,3,1,2,1")
  assert _plan(dtypes.bfloat16).overlap
  monkeypatch.setenv("ATTENTION_BLOCKS", "128,64,3,1,2,1,1")
  assert _plan(dtypes.bfloat16).q_shared
  monkeypatch.setenv("ATTENTION_WGMMA", "0")
  monkeypatch.setenv("ATTENTION_BLOCKS", "128,64,3,1,2,0,1")
  with pytest.raises(ShapeError, match="Q in shared memory"): _plan(dtypes.bfloat16)
  monkeypatch.setenv("ATTENTION_WGMMA", "1")
  monkeypatch.setenv("ATTENTION_BLOCKS", "128,128,2,1,1,1,0,1")
  plan = _plan(dtypes.bfloat16)
  # the producer keeps 32 of 168: 128 x 136 registers to the 256 consumers, 168 + 64 each (in granules of 8)
  assert (plan.producer, plan.overlap, plan.threads, plan.consumer_registers) == (True, True, 384, 232)
  assert blocks_text(plan) == "128,128,2,1,1,1,0,1,232"
  monkeypatch.setenv("ATTENTION_BLOCKS", "128,128,2,1,1,0,0,1,200")
  assert _plan(dtypes.bfloat16).consumer_registers == 200
  monkeypatch.setenv("ATTENTION_BLOCKS", "64,128,2,1,1,0,0,1")
  assert _plan(dtypes.bfloat16).consumer_registers == 0   # 255 a thread at launch: nothing to take
  monkeypatch.setenv("ATTENTION_BLOCKS", "192,64,2,1,1,1,0,1,0,1")
  plan = _plan(dtypes.bfloat16)
  assert (plan.pingpong, plan.threads, plan.consumer_registers) == (True, 512, 160)
  assert blocks_text(plan) == "192,64,2,1,1,1,0,1,160,1"
  # three consumers at 160 leave the producer 32 (setmaxnreg.dec), at 176 none
  monkeypatch.setenv("ATTENTION_BLOCKS", "192,96,4,1,1,1,0,1,160")
  assert attention_wgmma.producer_registers(_plan(dtypes.bfloat16)) == 32
  for blocks in ("48,64,2", "128,64,2,2", "192,96,4,1,1,1,0,1,176", "128,64,2,1,1,1", "128,64,2,1,1,0,0,1,0,0,0,1",
                 "128,64,2,1,1,0,0,0,200", "128,64,2,1,1,0,0,1,0,1", "64,64,2,1,1,1,0,1,0,1"):
    monkeypatch.setenv("ATTENTION_BLOCKS", blocks)
    with pytest.raises(ShapeError, match="wgmma|overlap|producer|ping-pong"): _plan(dtypes.bfloat16)


@pytest.mark.skipif(NVRTC is None, reason="NVRTC does not load here")
@pytest.mark.parametrize("dtype", [dtypes.bfloat16, dtypes.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_cuda_source_compiles_for_sm90a_without_spills(monkeypatch, dtype, causal, head_dim):
  """GPT-2's q, k, v of one (B, T, 3, H, D) buffer, odd lengths; the rule's tiles and the sweep's others."""
  monkeypatch.setenv("ATTENTION_WGMMA", "1")
  monkeypatch.delenv("ATTENTION_BLOCKS", raising=False)
  length, source, heads = 100, 77, 4
  row = 3 * heads * head_dim
  operands = [Operand(1, head_dim * part, (length * row, head_dim, row, 1)) for part in range(3)]
  plan = plan_attention(*operands, ((2, heads, length, head_dim), (2, heads // 2, source, head_dim)), dtype, causal,
                        0.125, CUDARenderer("sm_90"))
  assert plan.mma == "wgmma"
  variants = [plan, dataclasses.replace(plan, block_m=128, min_ctas=1),
              dataclasses.replace(plan, block_n=32, stages=3),
              dataclasses.replace(plan, block_n=64, stages=3, min_ctas=2 if head_dim == 64 else 1, overlap=True),
              dataclasses.replace(plan, stages=3, overlap=True, q_shared=True, min_ctas=2),
              # a producer warpgroup: the consumers at their setmaxnreg share (232 for two at D = 64 and 128)
              dataclasses.replace(plan, block_m=128, min_ctas=1, producer=True, consumer_registers=232),
              dataclasses.replace(plan, block_m=128, min_ctas=1, producer=True, overlap=True, consumer_registers=232),
              dataclasses.replace(plan, block_m=128, min_ctas=1, producer=True, overlap=True, consumer_registers=232,
                                  pingpong=True, exp_poly=4),
              # the eager softmax (no vote, a rescale every tile) beside the rule's lazy one
              dataclasses.replace(plan, block_m=128, min_ctas=1, producer=True, overlap=True, consumer_registers=232,
                                  pingpong=True, rescale_slack=0.0),
              # Q staged in shared memory by each consumer warpgroup
              dataclasses.replace(plan, block_m=128, min_ctas=1, producer=True, overlap=True, consumer_registers=232,
                                  pingpong=True, q_shared=True),
              # a persistent grid walking the query blocks
              dataclasses.replace(plan, block_m=128, min_ctas=1, producer=True, overlap=True, consumer_registers=232,
                                  pingpong=True, q_shared=True, persistent=True)]
  assert plan.rescale_slack > 0
  for variant in variants:
    source_text = render_attention(variant, "attention", {"out": 0, "q": 1, "k": 1, "v": 1})
    assert "wgmma.mma_async" in source_text and NVRTC.target(source_text) == "sm_90a"
    info = NVRTC.ptxas_info(source_text)
    assert re.search(r" 0 bytes spill stores", info), info
    assert "serialized" not in info, info   # ptxas keeps the wgmmas asynchronous


def _strided_forward_errors(device: str, dtype, causal: bool) -> tuple[float, float]:
  """The fused forward on `device` of q, k, v strided views of one (B, T, Hq + 2 Hk, D) buffer (grouped-query heads,
  an odd length), its plan asserted to be the wgmma kernel's: (relative error of O, max abs error of the logsumexp)
  against float64 PyTorch."""
  from ourgrad.tensor_attention import split_attention_output
  batch, heads, kv_heads, length, head_dim = 2, 4, 2, 300, 64
  spans = ((0, heads), (heads, heads + kv_heads), (heads + kv_heads, heads + 2 * kv_heads))
  packed = np.random.default_rng(7).standard_normal((batch, length, heads + 2 * kv_heads, head_dim))
  flat = Tensor(packed.astype(np.float32), device=device).cast(dtype).realize()
  q, k, v = (flat[:, :, first:last].transpose(1, 2) for first, last in spans)
  lazy = q.lazydata.attention(k.lazydata, v.lazydata, causal, head_dim ** -0.5)
  schedule = create_schedule([lazy])
  run_schedule(list(schedule))   # (scheduling gave the buffers: their kernels must run)
  items = [item for item in schedule if is_attention(item.ast)]
  assert len(items) == 1 and AttentionKernel(items[0].ast, Device[device].renderer).plan.mma == "wgmma"
  out, lse = split_attention_output(lazy, q.shape)
  got_o, got_lse = Tensor(out, device=device).cast(dtypes.float32).numpy(), Tensor(lse, device=device).numpy()
  twin = torch.tensor(flat.cast(dtypes.float32).numpy(), dtype=torch.float64)
  tq, tk, tv = (twin[:, :, first:last].transpose(1, 2) for first, last in spans)
  tk, tv = tk.repeat_interleave(heads // kv_heads, 1), tv.repeat_interleave(heads // kv_heads, 1)
  scores = tq @ tk.transpose(-1, -2) * head_dim ** -0.5
  if causal: scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), -float("inf"))
  want = (torch.softmax(scores, -1) @ tv).numpy()
  return (float(np.linalg.norm(got_o - want) / np.linalg.norm(want)),
          float(np.abs(got_lse - torch.logsumexp(scores, -1).numpy()).max()))


@pytest.mark.parametrize("dtype", [dtypes.bfloat16, dtypes.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_emulated_h100_forward_takes_the_wgmma_plan(monkeypatch, dtype, causal):
  """DEVICE=PYTHON EMULATE=CUDA_SM90 ATTENTION_WGMMA=1: the fused forward's plan is the wgmma kernel's and its output
  matches float64 PyTorch (the emulator runs the plan's arithmetic; the kernel's layouts run in the host harness)."""
  monkeypatch.setenv("FUSED_ATTENTION", "1")
  monkeypatch.setenv("ATTENTION_WGMMA", "1")
  monkeypatch.delenv("ATTENTION_BLOCKS", raising=False)
  with emulated_gpu_tf32(monkeypatch, "CUDA_SM90"):
    o_error, lse_error = _strided_forward_errors("PYTHON", dtype, causal)
  assert o_error < 2e-2 and lse_error < 2e-2


def test_emulated_h100_forward_with_a_producer_plan(monkeypatch):
  """DEVICE=PYTHON EMULATE=CUDA_SM90 with ATTENTION_BLOCKS asking for three consumers and a producer: the plan
  reaches the emulator through the program's JSON and its output matches float64 PyTorch."""
  monkeypatch.setenv("FUSED_ATTENTION", "1")
  monkeypatch.setenv("ATTENTION_WGMMA", "1")
  monkeypatch.setenv("ATTENTION_BLOCKS", "192,96,4,1,1,1,0,1,160,1")
  with emulated_gpu_tf32(monkeypatch, "CUDA_SM90"):
    o_error, lse_error = _strided_forward_errors("PYTHON", dtypes.bfloat16, True)
  assert o_error < 2e-2 and lse_error < 2e-2


@pytest.mark.skipif(not device_opens("CUDA"), reason="no CUDA device here")
@pytest.mark.parametrize("dtype", [dtypes.bfloat16, dtypes.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blocks", ["", "64,128,2,1,3", "128,64,3", "128,64,3,1,2,1", "64,64,3,1,4,1",
                                    "128,128,3,1,1,1,1", "128,128,2,1,1,0,0,1", "128,128,2,1,1,1,0,1",
                                    "64,64,3,1,2,1,0,1", "192,32,2,1,1,1,0,1", "128,128,2,1,1,1,0,1,0,1",
                                    "192,96,4,1,1,1,0,1,160,1", "128,128,2,1,1,1,0,1,0,1,3"])
def test_cuda_wgmma_forward_against_torch(monkeypatch, dtype, causal, blocks):
  """On an sm_90 GPU: the wgmma kernel (the rule's tiles, others, overlapped, with a producer warpgroup) against
  float64."""
  if not getattr(Device["CUDA"].renderer, "has_wgmma", False): pytest.skip("not an sm_90 GPU")
  monkeypatch.setenv("FUSED_ATTENTION", "2")
  monkeypatch.setenv("ATTENTION_WGMMA", "1")
  if blocks: monkeypatch.setenv("ATTENTION_BLOCKS", blocks)
  else: monkeypatch.delenv("ATTENTION_BLOCKS", raising=False)
  o_error, lse_error = _strided_forward_errors("CUDA", dtype, causal)
  assert o_error < 2e-2 and lse_error < 2e-2


@pytest.mark.parametrize("warp_tiles", [1, 2])
def test_emulator_moves_the_reference_as_the_warps_vote(warp_tiles):
  """runtime/attention_emulator.py with rescale_slack: keys growing along the sequence (the rescale runs in some warps
  and not others); O and the logsumexp at slack 8 and 0 both match float64, and differ from each other (P taken
  against a stale reference, rounded to bfloat16 at another scale), so the vote's path was taken."""
  from ourgrad.dtype import bfloat16_bits_to_float32, float32_to_bfloat16_bits
  from ourgrad.runtime.attention_emulator import emulate_attention
  batch, heads, length, head_dim = 1, 2, 200, 64
  rng = np.random.default_rng(3)
  arrays = [rng.standard_normal((batch, heads, length, head_dim)).astype(np.float32) for _ in range(3)]
  arrays[1] *= (1 + 0.05 * np.arange(length, dtype=np.float32))[:, None]
  stored = [float32_to_bfloat16_bits(array) for array in arrays]
  operand = Operand(1, 0, (heads * length * head_dim, length * head_dim, head_dim, 1))
  shape = (batch, heads, length, head_dim)
  base = plan_attention(operand, operand, operand, (shape, shape), dtypes.bfloat16, True, head_dim ** -0.5,
                        CUDARenderer("sm_80"))
  twin = [torch.tensor(bfloat16_bits_to_float32(array), dtype=torch.float64) for array in stored]
  scores = twin[0] @ twin[1].transpose(-1, -2) * head_dim ** -0.5
  scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), -float("inf"))
  want_o, want_lse = (torch.softmax(scores, -1) @ twin[2]).transpose(1, 2).numpy(), torch.logsumexp(scores, -1).numpy()
  results = []
  for slack in (8.0, 0.0):
    plan = dataclasses.replace(base, block_m=64, block_n=32, warp_tiles=warp_tiles, rescale_slack=slack)
    out = np.zeros(plan.output_elements * 2, dtype=np.uint8)
    emulate_attention(plan, out, *(array.view(np.uint8) for array in stored))
    o = bfloat16_bits_to_float32(out.view(np.uint16)[:plan.o_elements]).reshape(batch, length, heads, head_dim)
    lse = out.view(np.float32)[plan.lse_offset:plan.lse_offset + batch * heads * length].reshape(batch, heads, length)
    assert np.linalg.norm(o - want_o) / np.linalg.norm(want_o) < 2e-2 and np.abs(lse - want_lse).max() < 2e-2
    results.append(o)
  assert not np.array_equal(results[0], results[1])
