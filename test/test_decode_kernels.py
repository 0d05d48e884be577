"""The GPU defaults of a decode step's small kernels (codegen/opt/heuristic.py): lowered for CUDA's limits (PYTHON's
`EMULATE=CUDA` mode), run in the interpreter and compared with numpy, their launch shapes pinned; the CUDA source
is compiled with NVRTC where it loads.

- A thin product's rows plan (`ThinMatmulStrategy`): enough GROUP threads per row to keep the GPU's warps busy, and,
  where its narrow operand is recomputed on the loads (a batched decode step's SwiGLU silu(gate) * up before the down
  projection), 4 wide rows per thread so that each recomputed value serves 4 rows.
- A short reduce with few outputs (a decode step's attention scores: a 64-long dot product per head and cache slot)
  splits its reduce over a warp instead of leaving a few 2-thread blocks to loop over it.
"""
from __future__ import annotations

from typing import Any, Iterator

import math

import numpy as np
import pytest

from ourgrad import Tensor, dtypes
from ourgrad.device import Device
from ourgrad.dtype import round_to_bfloat16
from ourgrad.helpers import clear_caches
from ourgrad.nn.gguf import GGML_Q8_0, PackedTensor, quantize_q8_0
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.opt.cpu_tiles import cpu_tile_rows
from ourgrad.codegen.opt.heuristic import ThinMatmulPlan, hand_coded_optimizations
from ourgrad.codegen.opts import Opt, OptOps
from ourgrad.codegen.uops import UOps, launch_dims
from ourgrad.device import Buffer
from ourgrad.engine.realize import compile_kernel, run_schedule
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.ops import Ops
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer

from extra.models.llama import (Llama, LlamaConfig, cast_weights, inverse_rms_per_output, packed_argmax, rotate_pairs,
                                rope_inputs, softmax_weighted_sum)
from helpers import nvrtc_compiler, small_split_reduces
from test_gguf_packed import numpy_dequantize
from test_models import _tiny_weights, torch_llama_logits

NVRTC = nvrtc_compiler()


def _kernel_item(out: Tensor) -> ScheduleItem:
  """The last kernel of `out`'s schedule, the ones before it run (its inputs)."""
  schedule = create_schedule([out.lazydata])
  run_schedule(schedule[:-1])
  assert schedule[-1].ast.op is not Ops.COPY
  return schedule[-1]


def _emulated(item: ScheduleItem) -> tuple[Kernel, np.ndarray]:
  """The kernel with the CUDA defaults (lowered for the PYTHON device's CUDA emulation) and its output, its CUDA
  source compiled by NVRTC where available."""
  if NVRTC is not None:
    cuda = Kernel(item.ast, CUDARenderer())
    hand_coded_optimizations(cuda)
    NVRTC.compile(CUDARenderer().render(cuda.name, linearize(cuda)))
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  hand_coded_optimizations(kernel)
  runner = compile_kernel(kernel, "PYTHON")
  output = Buffer("PYTHON", item.outputs[0].size, item.outputs[0].dtype).allocate()
  runner((output,) + item.inputs)
  return kernel, output.numpy()


def _launch_threads(kernel: Kernel) -> int:
  global_size, local_size = launch_dims(linearize(kernel))
  return int(np.prod(global_size) * np.prod(local_size))


def _silu(x: np.ndarray) -> np.ndarray: return x / (1 + np.exp(-x))


@pytest.mark.parametrize("sequences, outputs, hidden", [(8, 40, 1024), (5, 24, 384), (8, 42, 256)],
                         ids=["8x40x1024", "5x24x384", "8x42x256_rows_not_a_multiple_of_4"])
def test_batched_swiglu_down_projection(sequences: int, outputs: int, hidden: int) -> None:
  """x + (silu(gate) * up) @ W.T as a batched decode step built it (the gate/up product x @ W_gu.T stored by its
  kernel, SwiGLU recomputed on the down projection's loads) against numpy: 4 rows of W a thread where they divide, a
  thread block of GROUP threads per row group."""
  rng = np.random.default_rng(sequences * 100 + outputs)
  x_np = rng.standard_normal((sequences, 1, outputs)).astype(np.float32)
  w_gate_up_np = (rng.standard_normal((2 * hidden, outputs)) / np.sqrt(outputs)).astype(np.float32)
  w_np = (rng.standard_normal((outputs, hidden)) / np.sqrt(hidden)).astype(np.float32)
  x, w = Tensor(x_np, device="PYTHON"), Tensor(w_np, device="PYTHON").cast(dtypes.bfloat16).contiguous().realize()
  gate, up = x.linear(Tensor(w_gate_up_np, device="PYTHON")).contiguous().chunk(2, dim=-1)
  kernel, got = _emulated(_kernel_item(x + (gate.silu() * up).linear(w)))
  w_rounded = w.cast(dtypes.float32).numpy()
  product_np = x_np.astype(np.float64) @ w_gate_up_np.T.astype(np.float64)
  hidden_np = _silu(product_np[..., :hidden]) * product_np[..., hidden:]
  expected = x_np + hidden_np @ w_rounded.T.astype(np.float64)
  np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-4, atol=1e-4)
  assert isinstance(kernel.plan, ThinMatmulPlan) and kernel.plan.rows, kernel.plan
  rows_per_thread = 4 if outputs % 4 == 0 else 1
  assert kernel.plan.upcast == rows_per_thread
  # few rows (a thread each would leave the GPU idle): GROUP threads doubled from a warp while each keeps >= 4 elements
  assert kernel.plan.group == min(256, 1 << (hidden // 4).bit_length() - 1), kernel.plan
  assert _launch_threads(kernel) == outputs // rows_per_thread * kernel.plan.group


@pytest.mark.parametrize("residual", ["none", "embedding_rows"])
def test_plain_thin_product_keeps_a_row_per_thread(residual: str) -> None:
  """A batched product whose narrow operand is a plain load (the attention output before the output projection): no
  rows upcast (it would only take threads away), more GROUP threads than a warp where the reduce is long enough.
  The first block's residual, embedding rows gathered by token, is no recomputed operand (its offsets are addresses)."""
  x = Tensor.empty(8, 1, 576, device="PYTHON")
  w = Tensor.empty(576, 576, dtype=dtypes.bfloat16, device="PYTHON")
  out = x.linear(w)
  if residual == "embedding_rows":
    table = Tensor.empty(100, 576, dtype=dtypes.bfloat16, device="PYTHON")
    out = table[Tensor.empty(8, 1, dtype=dtypes.int32, device="PYTHON")].cast(dtypes.float32) + out
  item = create_schedule([out.lazydata])[-1]
  kernel = Kernel(item.ast, CUDARenderer())
  hand_coded_optimizations(kernel)
  assert isinstance(kernel.plan, ThinMatmulPlan) and kernel.plan.upcast == 1 and kernel.plan.group == 64, kernel.plan


def test_many_row_thin_product_takes_rows_a_thread() -> None:
  """A batched product with rows enough to fill the GPU at a warp per 4 of them (a batched decode step's vocabulary
  logits: 49152 rows of 576 against 8 sequences' normalized x): 4 rows a thread, so that each load of the 8 rows of x
  serves 4 weight rows from registers (a warp a row re-read all of x per row from cache: 138 us of the H200's batched
  step); a few hundred rows keep a row a thread (above). The plan only, on CUDA's renderer: values in the test below."""
  x = Tensor.empty(8, 576, device="PYTHON")
  w = Tensor.empty(49152, 576, dtype=dtypes.bfloat16, device="PYTHON")
  item = create_schedule([x.linear(w).lazydata])[-1]
  kernel = Kernel(item.ast, CUDARenderer())
  hand_coded_optimizations(kernel)
  assert isinstance(kernel.plan, ThinMatmulPlan) and kernel.plan.rows and kernel.plan.upcast == 4, kernel.plan
  # the weight rows read as vectors of 4 bfloat16s a thread (8 would leave 72 vectors a row: 8 threads, no warp half)
  assert kernel.plan.lanes == 4 and kernel.plan.group == 16, kernel.plan


def test_many_row_thin_product_values() -> None:
  """The 4-rows-a-thread plan, its weight rows read as vectors of 8 (forced on a small product: its rows counted as
  many) against numpy."""
  from ourgrad.codegen.opt import heuristic
  rng = np.random.default_rng(3)
  x_np, w_np = rng.standard_normal((8, 1, 256)).astype(np.float32), rng.standard_normal((64, 256)).astype(np.float32)
  w = Tensor(w_np, device="PYTHON").cast(dtypes.bfloat16).contiguous().realize()
  wanted = heuristic.threads_in_flight_wanted
  heuristic.threads_in_flight_wanted = lambda kernel: 1   # any row count is many
  try:
    kernel, got = _emulated(_kernel_item(Tensor(x_np, device="PYTHON").linear(w)))
  finally:
    heuristic.threads_in_flight_wanted = wanted
  assert isinstance(kernel.plan, ThinMatmulPlan) and kernel.plan.upcast == 4 and kernel.plan.lanes == 8, kernel.plan
  expected = x_np.astype(np.float64) @ w.cast(dtypes.float32).numpy().T.astype(np.float64)
  np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("sequences, slots", [(1, 24), (2, 40)])
def test_decode_scores_split_the_head_dim(sequences: int, slots: int) -> None:
  """q (rotated on its loads) . K over every cache slot, plus the mask, as a fixed-shape decode step builds it
  (3 KV heads x 3 query heads, head_dim 64) against numpy: a warp per KV head and slot, each lane a piece of the
  head dim, the group's query heads side by side in each thread."""
  rng = np.random.default_rng(slots)
  kv_heads, group, head_dim = 3, 3, 64
  cache_np = rng.standard_normal((sequences, slots, 2 * kv_heads, head_dim)).astype(np.float32)
  projected_np = rng.standard_normal((sequences, 1, kv_heads * group + 2 * kv_heads, head_dim)).astype(np.float32)
  mask_np = np.where(rng.random((sequences, slots)) < 0.8, 0.0, -np.inf).astype(np.float32)
  cos_np, sin_np = rope_inputs(np.arange(3, 3 + sequences), head_dim, 10000.0)
  cache, projected = Tensor(cache_np, device="PYTHON"), Tensor(projected_np, device="PYTHON")
  cos = Tensor(cos_np.reshape(sequences, 1, 1, head_dim), device="PYTHON")
  sin = Tensor(sin_np.reshape(sequences, 1, 1, head_dim), device="PYTHON")
  q = rotate_pairs(projected[:, :, :kv_heads * group], cos, sin)
  keys = cache[:, :, :kv_heads].permute(0, 2, 3, 1)
  scores = q.reshape(sequences, kv_heads, group, head_dim) @ keys * (1.0 / 8)
  scores = scores + Tensor(mask_np, device="PYTHON").reshape(sequences, 1, 1, -1)
  kernel, got = _emulated(_kernel_item(scores.contiguous()))
  # numpy: the same interleaved-pair rotation (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)
  q_np = projected_np[:, 0, :kv_heads * group].astype(np.float64)
  swapped = q_np.reshape(sequences, -1, head_dim // 2, 2)[..., ::-1].reshape(q_np.shape)
  rotated = q_np * cos_np[:, None] + swapped * sin_np[:, None]
  keys_np = cache_np[:, :, :kv_heads].astype(np.float64)   # (S, slots, kv, hd)
  expected = np.einsum("skgd,snkd->skgn", rotated.reshape(sequences, kv_heads, group, head_dim), keys_np) / 8
  expected = expected + mask_np[:, None, None, :]
  np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)
  assert [opt.op.name for opt in kernel.applied_opts] == ["GROUP", "UPCAST"], kernel.applied_opts
  # a warp per (KV head, slot), its lanes along the head dim, the 3 query heads of the group upcast: keys read once
  assert _launch_threads(kernel) == sequences * kv_heads * slots * 32


def test_q8_0_row_product_reads_its_quants_as_vectors(emulated_cuda) -> None:
  """A decode step's Q8_0 product with its input's RMS recomputed beside each output (a row kernel, as the QKV and
  gate/up products) loads each thread's 4 neighbouring quants as one 4-byte vector: on a GPU the blocks are kept
  without their f16 scale (PackedTensor.quants_apart), so each block's 32 quants start at a multiple of 32 (in the
  stored 34-byte blocks 4 quants started at an even address only: two 2-byte vectors). Against numpy's
  dequantization of the stored blocks."""
  rng = np.random.default_rng(4)
  rows, k, eps = 96, 128, 1e-5
  w_np, x_np = rng.standard_normal((rows, k)).astype(np.float32), rng.standard_normal((1, 1, k)).astype(np.float32)
  blocks = quantize_q8_0(w_np)
  packed = PackedTensor.from_blocks(GGML_Q8_0, Tensor(blocks, device="PYTHON"), w_np.shape)
  x = Tensor(x_np, device="PYTHON")
  out = packed.linear(x) * inverse_rms_per_output(x, rows, eps, packed.row_blocks)
  kernel, got = _emulated(_kernel_item(out))
  values = numpy_dequantize(GGML_Q8_0, blocks).reshape(rows, k)
  expected = values @ x_np[0, 0] / np.sqrt(np.mean(x_np[0, 0] ** 2) + eps)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  uops = linearize(kernel)
  byte_loads = [uop.arg for uop in uops if uop.op is UOps.LOAD and uop.dtype == dtypes.uint8]
  assert byte_loads and set(byte_loads) == {4}, byte_loads
  assert packed.blocks.shape == (rows * k // 32, 32)


@pytest.mark.parametrize("kind", ["bfloat16", "q8_0"])
def test_one_token_down_projection_shares_each_silu(kind: str) -> None:
  """x + (silu(gate) * up) @ W.T for one token, the SwiGLU recomputed on the down projection's loads (as a decode
  step on a GPU builds it), against numpy: 4 rows of W a thread, so that each silu serves 4 outputs and the gate/up
  values are read by 576 / 4 blocks, not 576 (the residual read as one float4 before the loop)."""
  rng = np.random.default_rng(6)
  dim, hidden = 576, 256
  x_np = rng.standard_normal((1, 1, dim)).astype(np.float32)
  w_gate_up_np = (rng.standard_normal((2 * hidden, dim)) / np.sqrt(dim)).astype(np.float32)
  w_np = (rng.standard_normal((dim, hidden)) / np.sqrt(hidden)).astype(np.float32)
  x = Tensor(x_np, device="PYTHON")
  gate, up = x.linear(Tensor(w_gate_up_np, device="PYTHON")).contiguous().chunk(2, dim=-1)
  if kind == "q8_0":
    blocks = quantize_q8_0(w_np)
    out = x + PackedTensor.from_blocks(GGML_Q8_0, Tensor(blocks, device="PYTHON"), w_np.shape).linear(gate.silu() * up)
    w_values = numpy_dequantize(GGML_Q8_0, blocks).reshape(w_np.shape)
  else:
    w = Tensor(w_np, device="PYTHON").cast(dtypes.bfloat16).contiguous().realize()
    out, w_values = x + (gate.silu() * up).linear(w), w.cast(dtypes.float32).numpy()
  kernel, got = _emulated(_kernel_item(out))
  product_np = x_np.astype(np.float64) @ w_gate_up_np.T.astype(np.float64)
  expected = x_np + (_silu(product_np[..., :hidden]) * product_np[..., hidden:]) @ w_values.T.astype(np.float64)
  np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-4, atol=1e-4)
  assert Opt(OptOps.UPCAST, 0, 4) in kernel.applied_opts, kernel.applied_opts
  assert launch_dims(linearize(kernel))[0] == (dim // 4, 1, 1)
  # once per element of the thread's vector (the unrolled reduce lanes), serving its 4 rows
  unrolled = math.prod(kernel.full_shape[axis] for axis in kernel.unroll_axes)
  assert sum(1 for uop in linearize(kernel) if uop.op is UOps.ALU and uop.arg is Ops.EXP2) == unrolled


@pytest.mark.parametrize("k", [576, 1536])
def test_output_projection_reads_its_residual_first(k: int) -> None:
  """x + a @ W.T as a decode step's output and down projections build it (one token, bfloat16 W (576, k)) against
  numpy: the residual x is read before the reduce loop (in flight while the products run, not a memory round trip
  after the threads' combine) and the warps' totals meet in one BARRIER, each thread adding them up (no tree). The
  bf16 weights are read one element a thread (heuristic.py NARROW_LOAD_BYTES: as vectors the H200's step was
  slower)."""
  rng = np.random.default_rng(k)
  x_np, a_np = rng.standard_normal((1, 1, 576)).astype(np.float32), rng.standard_normal((1, 1, k)).astype(np.float32)
  w_np = (rng.standard_normal((576, k)) / np.sqrt(k)).astype(np.float32)
  x, a = Tensor(x_np, device="PYTHON"), Tensor(a_np, device="PYTHON")
  w = Tensor(w_np, device="PYTHON").cast(dtypes.bfloat16).contiguous().realize()
  kernel, got = _emulated(_kernel_item(x + a.linear(w)))
  expected = x_np + a_np.astype(np.float64) @ w.cast(dtypes.float32).numpy().T.astype(np.float64)
  np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)
  uops = linearize(kernel)
  residual = next(leaf.arg.idx for leaf, st in zip(kernel.leaves, kernel.sts) if leaf.op is Ops.LOAD
                  and all(stride == 0 for stride in st.real_strides()[kernel.first_reduce:]))   # not along the reduce
  first_loop = next(position for position, uop in enumerate(uops) if uop.op is UOps.RANGE)
  residual_loads = [position for position, uop in enumerate(uops) if uop.op is UOps.LOAD
                    and uop.srcs[0].op is UOps.DEFINE_GLOBAL and uop.srcs[0].arg[0] == residual]
  assert residual_loads and all(position < first_loop for position in residual_loads), (residual_loads, first_loop)
  assert sum(1 for uop in uops if uop.op is UOps.BARRIER) == 1
  weight = next(leaf.arg.idx for leaf in kernel.leaves if leaf.op is Ops.LOAD and leaf.dtype == dtypes.bfloat16)
  weight_loads = [uop for uop in uops if uop.op is UOps.LOAD and uop.srcs[0].op is UOps.DEFINE_GLOBAL
                  and uop.srcs[0].arg[0] == weight]
  assert weight_loads and all(uop.arg is None for uop in weight_loads), weight_loads


# A decode-shaped model small enough for the interpreter whose kernels take the plans above: head_dim 64 (the scores'
# 64-long reduce), hidden 256 (a thin down projection: k >= 4 warps), dim 128 (a multiple of 4 rows and of Q8_0's 32)
DECODE = LlamaConfig(dim=128, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=256, vocab_size=64, norm_eps=1e-5,
                     rope_theta=10000.0, context_length=16)


def _decode_weights(seed: int) -> dict[str, np.ndarray]:
  """Random weights (test_models._tiny_weights) with norm weights that are powers of two: folded into the matrices
  before a cast to bfloat16 they round exactly as the matrices alone, so one rounded float32 reference serves."""
  weights = _tiny_weights(DECODE, seed)
  rng = np.random.default_rng(seed + 1)
  for name in weights:
    if name.endswith("norm.weight"): weights[name] = rng.choice([0.5, 1.0, 2.0], weights[name].shape).astype(np.float32)
  return weights


def _stored_as(weights: dict[str, np.ndarray], kind: str, device: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """(the model's weights kept as `kind` on `device`, the float32 values they hold: the reference's weights)."""
  if kind == "bfloat16":
    values = {name: round_to_bfloat16(value) if value.ndim == 2 else value for name, value in weights.items()}
    tensors = cast_weights({name: Tensor(value, device=device) for name, value in weights.items()}, dtypes.bfloat16)
    return tensors, values
  if kind == "q8_0":
    blocks = {name: quantize_q8_0(value) for name, value in weights.items() if value.ndim == 2}
    values = {name: numpy_dequantize(GGML_Q8_0, blocks[name]).reshape(value.shape) if name in blocks else value
              for name, value in weights.items()}
    tensors = {name: PackedTensor.from_blocks(GGML_Q8_0, Tensor(blocks[name], device=device), value.shape)
               if name in blocks else Tensor(value, device=device) for name, value in weights.items()}
    return tensors, values
  return {name: Tensor(value, device=device) for name, value in weights.items()}, weights


@pytest.fixture
def emulated_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
  """The PYTHON device lowering as for CUDA (EMULATE=CUDA), float32 matmuls in full precision, fresh caches."""
  from ourgrad.engine import realize, schedule_cache
  monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer("CUDA"))
  monkeypatch.delenv("CHECK_CUDA_RENDER", raising=False)   # symbolic-free here, but the row kernels skip its opts
  realize._runner_cache.clear()
  schedule_cache._cache.clear()
  yield
  realize._runner_cache.clear()
  schedule_cache._cache.clear()


# (device, kernels per block, kernels outside the blocks) of a fixed-shape decode step: lowered for CUDA (thread blocks:
# the norms' scales and the softmax recomputed in the row kernels that read them, test_models; with ELEMENT_REDUCES=1
# attention's scores an element reduce of the softmax x V row kernel, codegen/element_reduces.py, one kernel less;
# with ATTENTION_CHUNKS=4 as well that row kernel is over 4 pieces of the cache's 16 slots, and a second small kernel
# combines the pieces (llama.py split_softmax_weighted_sum; pieces past a sequence's position are all masked);
# several sequences: the SwiGLU product
# stored, one kernel more; the blocks' cache writes one packed kernel after the logits) and on a CPU (the normalized
# row and the SwiGLU product stored before the products that read them: extra/models/llama.py)
DECODE_DEVICES = {"emulated_cuda": ("PYTHON", 6, 2), "emulated_cuda_element_reduces": ("PYTHON", 5, 2),
                  "emulated_cuda_split_attention": ("PYTHON", 6, 2), "clang": ("CLANG", 12, 2)}


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "q8_0"])
@pytest.mark.parametrize("sequences", [1, 8])
@pytest.mark.parametrize("target", ["emulated_cuda", "emulated_cuda_element_reduces", "emulated_cuda_split_attention",
                                    pytest.param("clang", marks=pytest.mark.slow)])  # clang: ~20 s
def test_decode_matches_float32_reference(kind: str, sequences: int, target: str, request,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
  """Jitted fixed-shape decode steps of `sequences` conversations, lowered for CUDA (the kernels above, the row
  kernels of the norms and the softmax) or for the CPU, give each sequence's logits of torch's float32 forward over
  the weights' stored values (bfloat16-rounded, or Q8_0 dequantized by numpy), in a pinned number of kernels. The
  CPU's products are the float ones here: its integer products round x to 8 bits first, which this float32
  reference does not (test_gguf_packed checks them against a reference rounding x the same way)."""
  monkeypatch.setenv("INTEGER_PRODUCTS", "0")
  device, per_block, outside = DECODE_DEVICES[target]
  if target.startswith("emulated_cuda"): request.getfixturevalue("emulated_cuda")
  if target in ("emulated_cuda_element_reduces", "emulated_cuda_split_attention"):
    monkeypatch.setenv("ELEMENT_REDUCES", "1")
    if target == "emulated_cuda_split_attention": monkeypatch.setenv("ATTENTION_CHUNKS", "4")
    clear_caches()   # schedules made without element reduces (the same graphs, earlier tests)
  if target.startswith("emulated_cuda") and sequences > 1:
    # the SwiGLU product stored in each block, the final norm's rows before the logits (Llama._decode_graph)
    per_block, outside = per_block + 1, outside + 1
  weights = _decode_weights(seed=11)
  tensors, values = _stored_as(weights, kind, device)
  model = Llama(DECODE, tensors, max_context=DECODE.context_length, symbolic=False, packed=kind == "q8_0",
                sequences=sequences)
  rng = np.random.default_rng(sequences)
  prompts = [rng.integers(0, DECODE.vocab_size, 2 + row % 3).tolist() for row in range(sequences)]
  for row, prompt in enumerate(prompts): model(Tensor([prompt], dtype=dtypes.int32, device=device), 0, sequence=row)
  steps = 3
  fed = [rng.integers(0, DECODE.vocab_size, steps).tolist() for _ in range(sequences)]
  got = [model.decode([fed[row][step] for row in range(sequences)], [len(p) + step for p in prompts]).numpy()
         for step in range(steps)]
  for row, prompt in enumerate(prompts):
    expected = torch_llama_logits(values, DECODE, prompt + fed[row])[len(prompt):]
    np.testing.assert_allclose(np.stack([logits[row] for logits in got]), expected, rtol=2e-4, atol=2e-4)
  assert model._decode_jit.captured is not None
  if device == "CLANG" and kind == "q8_0" and sequences > 1 and sequences % cpu_tile_rows(_clang_registers()):
    # a register tile of fewer rows than the sequences' (AVX2: 6 rows, 16 registers; AVX-512 holds 8): each Q8_0
    # product reads its activation rows from a transposed copy stored first (E_128_8), one kernel before each of a
    # block's 5 products and the logits'
    per_block, outside = per_block + 5, outside + 1
  assert len(model._decode_jit.captured.items) == per_block * DECODE.n_layers + outside


def _clang_registers() -> int:
  return Device["CLANG"].renderer.vector_registers


@pytest.mark.parametrize("sequences", [1, 3])
def test_fused_decode_matches_the_unfused_path(sequences: int, emulated_cuda) -> None:
  """The GPU decode step (the norms' scales and the softmax recomputed in the row kernels that read them, attention
  reading this step's K and V rows recomputed from the projection, the blocks' cache writes one packed kernel after
  the logits) against the same model's unfused step (`recompute_rows` off in every block: the normalized rows, the
  softmax and each block's cache write kernels of their own, attention reading the written cache): the same logits
  and caches at every step, and only the last kernel writes the caches."""
  weights = _decode_weights(seed=7)
  models = []
  for fused in (True, False):
    tensors, _ = _stored_as(weights, "float32", "PYTHON")
    model = Llama(DECODE, tensors, max_context=DECODE.context_length, symbolic=False, sequences=sequences)
    for block in model.blocks: block.recompute_rows = fused
    models.append(model)
  rng = np.random.default_rng(2)
  prompts = [rng.integers(0, DECODE.vocab_size, 2 + row).tolist() for row in range(sequences)]
  for model in models:
    for row, prompt in enumerate(prompts): model(Tensor([prompt], dtype=dtypes.int32, device="PYTHON"), 0, sequence=row)
  for step in range(3):
    tokens, positions = rng.integers(0, DECODE.vocab_size, sequences).tolist(), [len(p) + step for p in prompts]
    fused_logits, unfused_logits = (model.decode(tokens, positions).numpy() for model in models)
    np.testing.assert_allclose(fused_logits, unfused_logits, rtol=1e-4, atol=1e-4)
    for fused_block, unfused_block in zip(*(model.blocks for model in models)):
      np.testing.assert_allclose(fused_block.cache.numpy(), unfused_block.cache.numpy(), rtol=1e-5, atol=1e-5)
  captured = models[0]._decode_jit.captured
  assert captured is not None
  caches = {id(block.cache.lazydata.realized) for block in models[0].blocks}
  writers = [position for position, item in enumerate(captured.items)
             if caches & {id(buffer) for buffer in item.bufs[:item.outputs]}]
  assert writers == [len(captured.items) - 1], writers


@pytest.mark.parametrize("target", ["emulated_cuda", "clang"])
def test_masked_assign_is_a_gated_store(target: str, request) -> None:
  """cache.assign(write.where(new, cache)) (a decode step's KV-cache write: one slot of each sequence's row) against
  numpy: the kernel stores under the write mask (linearizer.kept_where) and never loads the cache it writes, where
  it read and rewrote every slot."""
  device = "PYTHON" if target == "emulated_cuda" else "CLANG"
  if target == "emulated_cuda": request.getfixturevalue("emulated_cuda")
  rng = np.random.default_rng(5)
  cache_np = rng.standard_normal((3, 12, 4, 8)).astype(np.float32)
  new_np = rng.standard_normal((3, 1, 4, 8)).astype(np.float32)
  write_np = np.zeros((3, 12, 1, 1), bool)
  write_np[[0, 1, 2], [2, 7, 11]] = True
  cache = Tensor(cache_np, device=device).contiguous().realize()
  write, new = Tensor(write_np, device=device), Tensor(new_np, device=device)
  cache.assign(write.where((new * 2 + 1).expand(cache.shape), cache))
  schedule = create_schedule([cache.lazydata])
  kernel = Kernel(schedule[-1].ast, Device[device].renderer)
  hand_coded_optimizations(kernel)
  uops = linearize(kernel)
  output = next(uop for uop in uops if uop.op is UOps.DEFINE_GLOBAL and uop.arg[1])
  assert not [uop for uop in uops if uop.op is UOps.LOAD and uop.srcs[0] is output], "the cache is not read"
  # each store under an IF on the write mark, the new value computed inside it
  stores = [position for position, uop in enumerate(uops) if uop.op is UOps.STORE and uop.srcs[0] is output]
  open_ifs = [sum((uop.op is UOps.IF) - (uop.op is UOps.ENDIF) for uop in uops[:position]) for position in stores]
  assert stores and all(uops[position - 1].op is not UOps.IF for position in stores) and all(open_ifs), \
    "stores under an IF"
  if target == "clang":   # loops: the IF on a row's mark opens between the row's loop and its elements' loops
    first_if = next(position for position, uop in enumerate(uops) if uop.op is UOps.IF)
    ranges = [position for position, uop in enumerate(uops) if uop.op is UOps.RANGE]
    assert ranges[0] < first_if < ranges[-1], "the mark tested once a row"
  if NVRTC is not None:
    cuda = Kernel(schedule[-1].ast, CUDARenderer())
    hand_coded_optimizations(cuda)
    NVRTC.compile(CUDARenderer().render(cuda.name, linearize(cuda)))
  run_schedule(schedule)
  got = cache.numpy()
  expected = np.where(write_np, new_np * 2 + 1, cache_np)
  np.testing.assert_array_equal(got, expected)


def _argmax_rows(length: int) -> np.ndarray:
  """Rows whose argmax needs the packed key's every part: a tie of the max (the first index wins), a row of negative
  values only (the flipped magnitude bits), a max of +0.0 beside -0.0 and negatives."""
  rng = np.random.default_rng(length)
  rows = rng.standard_normal((3, length)).astype(np.float32)
  rows[0, [length // 3, length - 5]] = rows[0].max() + 1.0
  rows[1] = -np.abs(rows[1]) - 1.0
  rows[1, length // 2] = -0.5
  rows[2] = -np.abs(rows[2])
  rows[2, [7, length - 1]] = -0.0
  rows[2, length // 4] = 0.0
  return rows


@pytest.mark.parametrize("target", ["emulated_cuda", "clang"])
def test_packed_argmax_is_one_reduce(target: str, request, monkeypatch: pytest.MonkeyPatch) -> None:
  """The greedy step's argmax (extra/models/llama.py `packed_argmax`: one max over 64-bit (value, countdown) keys)
  against numpy's first-index argmax: one reduce, so a long row lowered for CUDA is one split reduce (two kernels,
  where the max and then the first index reaching it were two split reduces: four) and one kernel on a CPU. Its
  CUDA source compiles with NVRTC where it loads (64-bit shuffles and the int64 identity)."""
  device = "PYTHON" if target == "emulated_cuda" else "CLANG"
  if target == "emulated_cuda":
    request.getfixturevalue("emulated_cuda")
    small_split_reduces(monkeypatch)
  length = 4096
  rows = _argmax_rows(length)
  countdown = Tensor(np.arange(length, 0, -1, dtype=np.int32), device=device).realize()
  ids = packed_argmax(Tensor(rows, device=device).realize(), countdown)
  schedule = create_schedule([ids.lazydata])
  assert len(schedule) == (2 if target == "emulated_cuda" else 1), [item.ast.op for item in schedule]
  if NVRTC is not None and target == "emulated_cuda":
    for item in schedule:
      kernel = Kernel(item.ast, CUDARenderer("sm_90"))
      hand_coded_optimizations(kernel)
      NVRTC.compile(CUDARenderer("sm_90").render(kernel.name, linearize(kernel)))
  run_schedule(schedule)
  expected = rows.argmax(-1)
  expected[2] = length // 4   # numpy's == takes -0.0 for +0.0 (its first -0.0 at 7); the key orders -0.0 below +0.0
  np.testing.assert_array_equal(ids.numpy(), expected)


def test_short_reduce_loop_is_unrolled_for_cuda(emulated_cuda) -> None:
  """A one-token Q8_0 down projection of SmolLM2's shapes (576 x 1536, SwiGLU on its loads) keeps a 3-iteration reduce
  loop after its GROUP and UNROLL opts: rendered for CUDA it carries `#pragma unroll` (renderer/cuda.py
  short_reduce_loops; nvcc left it rolled, its loads issued one round trip at a time), a long loop does not."""
  from ourgrad.renderer.cuda import SHORT_LOOP_UNROLL, short_reduce_loops
  dim, hidden = 576, 1536
  x = Tensor.empty(1, 1, dim, device="PYTHON")
  gate, up = Tensor.empty(1, 1, 2 * hidden, device="PYTHON").chunk(2, dim=-1)
  blocks = Tensor(quantize_q8_0(np.ones((dim, hidden), np.float32)), device="PYTHON")
  out = x + PackedTensor.from_blocks(GGML_Q8_0, blocks, (dim, hidden)).linear(gate.silu() * up)
  renderer = CUDARenderer("sm_90")
  kernel = Kernel(create_schedule([out.lazydata])[-1].ast, renderer)
  hand_coded_optimizations(kernel)
  uops = linearize(kernel)
  loops = [uop for uop in uops if uop.op is UOps.RANGE]
  assert loops and all(loop.srcs[1].arg - loop.srcs[0].arg <= SHORT_LOOP_UNROLL for loop in loops), loops
  assert short_reduce_loops(uops) == {id(loop) for loop in loops}
  source = renderer.render(kernel.name, uops)
  assert source.count("#pragma unroll\n") == len(loops), source
  if NVRTC is not None: NVRTC.compile(source)
  # a row of 4096 summed by one thread block: its loop is long, left to the compiler
  total = Kernel(create_schedule([Tensor.empty(4096, device="PYTHON").sum().lazydata])[-1].ast, renderer)
  hand_coded_optimizations(total)
  total_uops = linearize(total)
  long_loops = [uop for uop in total_uops
                if uop.op is UOps.RANGE and uop.srcs[1].arg - uop.srcs[0].arg > SHORT_LOOP_UNROLL]
  assert long_loops and not short_reduce_loops(total_uops) & {id(loop) for loop in long_loops}


def test_softmax_weighted_sum_combines_both_sums_at_one_barrier(emulated_cuda) -> None:
  """softmax(scores) @ V of a decode step (3 KV heads x 3 query heads, head_dim 64, V a strided view of the cache) as
  one row kernel lowered for CUDA, against numpy: the max is combined across the block's warps first, then the sum of
  exp and the sum of exp * v, which read only the max, together: 2 BARRIERs where a reduce each took 3."""
  rng = np.random.default_rng(9)
  kv_heads, group, slots, head_dim = 3, 3, 128, 64
  scores_np = rng.standard_normal((1, kv_heads, group, slots)).astype(np.float32) * 3
  cache_np = rng.standard_normal((1, slots, 2 * kv_heads, head_dim)).astype(np.float32)
  scores = Tensor(scores_np, device="PYTHON")
  values = Tensor(cache_np, device="PYTHON")[:, :, kv_heads:].permute(0, 2, 1, 3)   # (1, kv, slots, hd)
  kernel, got = _emulated(_kernel_item(softmax_weighted_sum(scores, values)))
  weights = np.exp(scores_np - scores_np.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  expected = np.einsum("skgn,snkd->skgd", weights.astype(np.float64), cache_np[:, :, kv_heads:].astype(np.float64))
  np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)
  barriers = [uop for uop in linearize(Kernel(kernel.ast, CUDARenderer("sm_90"))) if uop.op is UOps.BARRIER]
  assert len(barriers) == 2, len(barriers)
