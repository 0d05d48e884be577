"""Streamed reduces on the CPU (codegen/streamed_rows.py): a matrix-vector product, packed (Q4_1, Q8_0: dequantized
in registers) or float32, and a long row sum run as row kernels whose sums are SIMD lanes, matching numpy; a product
that reuses its weights (several rows of x) keeps the loop nest's register tiles; and a kernel split over OpenMP's
threads gives the bytes it gives on one thread (each output is computed by one thread, in the same order)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

from ourgrad import Device, GlobalCounters, Tensor, dtypes
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.streamed_rows import STREAMED_ROW_VECTORS
from ourgrad.engine.realize import run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.nn.gguf import GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, PackedTensor
from ourgrad.ops import Ops

from test_gguf_packed import BLOCK, numpy_dequantize, random_blocks

RENDERER = Device[Device.DEFAULT].renderer
pytestmark = pytest.mark.skipif(RENDERER.has_threads or not RENDERER.has_stack_arrays,
                                reason="streamed rows are a CPU renderer's (C loops with stack arrays)")


def _sources(tensor: Tensor) -> list[str]:
  """The C source of every kernel computing `tensor` with the default heuristic (consumes the graph)."""
  sources = []
  for item in create_schedule([tensor.lazydata]):
    if item.ast.op is Ops.COPY: continue
    kernel = Kernel(item.ast, RENDERER)
    kernel.hand_coded_optimizations()
    sources.append(RENDERER.render("k", linearize(kernel)))
  return sources


def _in_lanes(source: str) -> bool:
  """A row kernel whose reduce runs in SIMD lanes: an accumulator array and an `omp simd` loop over the lanes."""
  return "lane_acc0[" in source and "#pragma omp simd" in source


@pytest.mark.parametrize("ggml_type", [GGML_Q4_1, GGML_Q8_0], ids=["Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 37])
def test_packed_matvec_in_lanes_matches_numpy(ggml_type: int, rows: int) -> None:
  """One row of x times a packed matrix of an odd row count, block by block (a decode step's form, with a norm
  weight on the columns): one kernel reading the packed bytes, its sum in lanes, numpy's dequantization's product."""
  columns = 8 * BLOCK[ggml_type][0]
  rng = np.random.default_rng(rows + ggml_type)
  raw = random_blocks(ggml_type, rows * columns // BLOCK[ggml_type][0], rng)
  packed = PackedTensor.from_blocks(ggml_type, Tensor(raw), (rows, columns))
  x_np = rng.standard_normal((1, 1, columns)).astype(np.float32)
  scale_np = rng.uniform(0.5, 1.5, columns).astype(np.float32)
  x, scale = Tensor(x_np).realize(), Tensor(scale_np).realize()
  assert _in_lanes(_sources(packed.linear(x, scale))[-1])
  GlobalCounters.reset()
  out = packed.linear(x, scale).realize()
  # fewer bytes than the float32 matrix and the three vectors would be
  assert GlobalCounters.kernel_count == 1 and GlobalCounters.global_mem < (rows * columns + 2 * columns + rows) * 4
  expected = x_np @ (numpy_dequantize(ggml_type, raw).reshape(rows, columns) * scale_np).T
  np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("rows, columns", [(33, 576), (7, 1000)])
def test_float_matvec_in_lanes_matches_numpy(rows: int, columns: int) -> None:
  """A float32 matrix-vector product (odd rows; 1000 columns: lanes of what divides them) and its max reduce."""
  rng = np.random.default_rng(rows)
  w_np, x_np = rng.standard_normal((rows, columns)).astype(np.float32), rng.standard_normal(columns).astype(np.float32)
  w, x = Tensor(w_np).realize(), Tensor(x_np).realize()
  sources = _sources(w @ x)
  lanes = RENDERER.vector_bytes // 4
  assert _in_lanes(sources[-1]) == (columns % lanes == 0)
  np.testing.assert_allclose((w @ x).numpy(), w_np @ x_np, rtol=1e-5, atol=1e-4)
  np.testing.assert_array_equal((w * x).max(1).numpy(), (w_np * x_np).max(1))


def test_row_sum_in_lanes_and_short_rows_not() -> None:
  """A sum over long contiguous rows is streamed; rows shorter than STREAMED_ROW_VECTORS vectors of the target's SIMD
  width are not (48 floats had been short at AVX-512's 16 lanes but 12 vectors at x86-64-v2's 4)."""
  rng = np.random.default_rng(3)
  lanes = max(Device[Device.DEFAULT].renderer.vector_bytes // 4, 1)
  long_np = rng.standard_normal((5, 4096)).astype(np.float32)
  short_np = rng.standard_normal((64, (STREAMED_ROW_VECTORS - 1) * lanes)).astype(np.float32)
  assert _in_lanes(_sources(Tensor(long_np).sum(1))[-1])
  assert not _in_lanes(_sources(Tensor(short_np).sum(1))[-1])
  np.testing.assert_allclose(Tensor(long_np).sum(1).numpy(), long_np.sum(1, dtype=np.float64), rtol=1e-5, atol=1e-3)


def test_reused_weights_keep_register_tiles() -> None:
  """Eight rows of x read every weight eight times (a batched decode step, a matmul): no streamed row kernel."""
  rng = np.random.default_rng(4)
  w_np, x_np = rng.standard_normal((40, 256)).astype(np.float32), rng.standard_normal((8, 256)).astype(np.float32)
  w, x = Tensor(w_np).realize(), Tensor(x_np).realize()
  assert not _in_lanes(_sources(x @ w.T)[-1])
  np.testing.assert_allclose((x @ w.T).numpy(), x_np @ w_np.T, rtol=1e-5, atol=1e-4)


THREADED_SCRIPT = """
import numpy as np, sys
from ourgrad import Tensor
rng = np.random.default_rng(0)
w, x = rng.standard_normal((3072, 576)).astype(np.float32), rng.standard_normal(576).astype(np.float32)
a = rng.standard_normal(1 << 20).astype(np.float32)
product = (Tensor(w) @ Tensor(x)).numpy()
elementwise = (Tensor(a).exp() * 3 + 1).numpy()
sys.stdout.buffer.write(product.tobytes() + elementwise.tobytes())
"""


def test_threads_give_the_single_thread_bytes() -> None:
  """A matrix-vector product and an elementwise kernel, each large enough to run its outer loop on OpenMP's
  threads, give the same bytes with OMP_NUM_THREADS=1 and 2: a thread owns whole outputs (rows), and a row's sum
  runs in the same lane order whichever thread computes it."""
  def run(threads: int) -> bytes:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return subprocess.run([sys.executable, "-c", THREADED_SCRIPT], env=env, capture_output=True, check=True).stdout
  one, two = run(1), run(2)
  assert len(one) == 4 * (3072 + (1 << 20)) and one == two


@pytest.mark.parametrize("ggml_type", [GGML_Q4_1, GGML_Q4_0, GGML_Q8_0], ids=["Q4_1", "Q4_0", "Q8_0"])
def test_integer_product_kernel_sums_blocks_as_integers(ggml_type: int) -> None:
  """The product's row kernel takes each block's products as an int32 sum (no float lanes) and reads the packed
  bytes and the int8 activation: fewer bytes than the float32 product's vector and matrix. A Q4 block's nibbles
  times the int8 activation is one byte dot product (UOps.BYTE_DOT_ADD: SIMD byte multiply-adds, the low and the
  high nibbles each a pair, both in one helper call reading the block's bytes once: one 256-bit multiply-add with
  AVX2, into float lanes totalled once a row); Q8_0's signed x signed bytes one pair widened to 16 bits."""
  rows, columns = 64, 576
  rng = np.random.default_rng(3)
  raw = random_blocks(ggml_type, rows * columns // 32, rng)
  packed = PackedTensor.from_blocks(ggml_type, Tensor(raw), (rows, columns))
  x = Tensor(rng.standard_normal((1, columns)).astype(np.float32)).realize()
  source = _sources(packed.integer_linear(x))[-1]
  assert "lane_acc0[" not in source
  body = _kernel_body(source)
  assert "og_lanes_total(lanes0)" in body and "#pragma omp simd" not in body
  if ggml_type == GGML_Q8_0: assert body.count("og_dot_add_s8(") == 1 and "og_dot_add(" not in body
  else:   # both nibbles' pairs in one call, the bytes loaded once (og_dot_add_split)
    assert body.count("og_dot_add_split(") == 1 and "og_dot_add(" not in body and "og_dot_add2(" not in body


@pytest.mark.parametrize("ggml_type", [GGML_Q4_1, GGML_Q4_0], ids=["Q4_1", "Q4_0"])
def test_split_nibble_pairs_give_the_pairwise_helpers_bits(ggml_type: int) -> None:
  """og_dot_add_split (a Q4 block's bytes loaded once, one mask) gives the bits of og_dot_add2 (each nibble pair
  loaded and masked apart) for the same kernel: both fill the same int32 lanes, so the float sums are the same."""
  rows, columns = 37, 288
  rng = np.random.default_rng(11 + ggml_type)
  packed = PackedTensor.from_blocks(ggml_type, Tensor(random_blocks(ggml_type, rows * columns // 32, rng)),
                                    (rows, columns))
  output = packed.integer_linear(Tensor(rng.standard_normal((1, columns)).astype(np.float32)))
  schedule = [item for item in create_schedule([output.lazydata]) if item.outputs]
  run_schedule(schedule[:-1])
  item = schedule[-1]
  kernel = Kernel(item.ast, RENDERER)
  kernel.hand_coded_optimizations()
  source = RENDERER.render("k", linearize(kernel))
  pairwise = re.sub(r"og_dot_add_split\((og_dot_start\(\)), ([^,]+), (\d+), (\d+), (\d+), ([^,]+), (\d+)\)",
                    r"og_dot_add2(\1, \2, \3, \5, \6, \2, \4, \5, \6 + \7, \7)", source)
  assert source.count("og_dot_add_split(og_dot_start()") == 1 and "og_dot_add_split(" not in _kernel_body(pairwise)
  device = Device[Device.DEFAULT]
  outputs = []
  for variant in (source, pairwise):
    for buffer in item.bufs: buffer.allocate()
    device.program("k", device.compiler.compile_cached(variant)).function(
      *[buffer.host_pointer() for buffer in item.bufs])
    outputs.append(item.bufs[0].numpy().tobytes())
  assert outputs[0] == outputs[1]


@pytest.mark.parametrize("ggml_type", [GGML_Q4_1, GGML_Q8_0], ids=["Q4_1", "Q8_0"])
def test_byte_dot_helpers_prefetch_the_packed_weights(ggml_type: int) -> None:
  """Every byte dot helper, in every -march branch of renderer/cbytedot.py, prefetches its first operand ahead
  (og_prefetch), and the product's kernel passes the packed weight's bytes there (the stream a matrix-vector product
  reads once from memory), the int8 activation (cached: every row reads it) second."""
  rows, columns = 64, 576
  rng = np.random.default_rng(5)
  packed = PackedTensor.from_blocks(ggml_type, Tensor(random_blocks(ggml_type, rows * columns // 32, rng)),
                                    (rows, columns))
  x = Tensor(rng.standard_normal((1, columns)).astype(np.float32)).realize()
  source = _sources(packed.integer_linear(x))[-1]
  helpers = re.findall(r"og_dot_sums (og_dot_add\w*)\(og_dot_sums sums, const (?:un)?signed char\* (\w+),[^{]*\{\n"
                       r"(.*)\n", source)
  assert sorted({name for name, _, _ in helpers}) == ["og_dot_add", "og_dot_add2", "og_dot_add_s8", "og_dot_add_split"]
  # og_dot_add and og_dot_add_s8 in the AVX2, SSSE3 and plain branches; og_dot_add2 and og_dot_add_split in AVX2's,
  # and elsewhere as two og_dot_add calls (whose first one prefetches the same block)
  assert len(helpers) == 10
  assert all(line.strip() in (f"og_prefetch({first});", f"return og_dot_add(og_dot_add(sums, {first}, shift0, mask0, "
                              "s0, count), u1, shift1, mask1, s1, count);", f"return og_dot_add(og_dot_add(sums, "
                              f"{first}, shift0, mask, s, count), {first}, shift1, mask, s + count, count);")
             for _, first, line in helpers)
  body = _kernel_body(source)
  weights = re.search(r"const unsigned char\* restrict (data\d+)", body).group(1)
  activation = re.search(r"const signed char\* restrict (data\d+)", body).group(1)
  call = re.search(r"og_dot_add(?:2|_s8|_split)\(og_dot_start\(\), (?:\(const signed char\*\)\()?(data\d+)[^,]*, (.*)",
                   body)
  assert call.group(1) == weights and activation in call.group(2)


@pytest.mark.parametrize("ggml_type", [GGML_Q4_1, GGML_Q4_0, GGML_Q8_0], ids=["Q4_1", "Q4_0", "Q8_0"])
def test_integer_product_reads_scales_from_its_blocks(ggml_type: int, monkeypatch: pytest.MonkeyPatch) -> None:
  """On a CPU the integer product's kernel reads each block's f16 scales from the stored block (one 2-byte load
  each, og_load_u16, widened in the kernel) instead of the decoded float32 scales: it takes no float buffer but the
  activation's scales, and its outputs are the bits of the product computed from the decoded scales."""
  rows, columns = 64, 576
  rng = np.random.default_rng(9)
  raw = random_blocks(ggml_type, rows * columns // 32, rng)
  x_np = rng.standard_normal((1, columns)).astype(np.float32)
  packed = PackedTensor.from_blocks(ggml_type, Tensor(raw), (rows, columns))
  body = _kernel_body(_sources(packed.integer_linear(Tensor(x_np).realize()))[-1])
  assert body.count("og_load_u16(") == (2 if ggml_type == GGML_Q4_1 else 1) and "<<" not in body
  parameters = body[:body.index(")")]
  assert parameters.count("const float* restrict") == (1 if ggml_type == GGML_Q8_0 else 2)   # d_x (Q4: its sums)
  from_blocks = packed.integer_linear(Tensor(x_np)).numpy()
  outputs, blocks = rows, columns // 32
  monkeypatch.setattr(PackedTensor, "_product_scales", lambda self, lanes: [
    self.scales.cast(dtypes.float32).reshape(1, outputs, blocks, -1)[..., index:index + 1]
    for index in range(self.scales.shape[1])])
  np.testing.assert_array_equal(from_blocks, packed.integer_linear(Tensor(x_np)).numpy())


def test_little_endian_byte_pairs_load_as_one() -> None:
  """A uint16 assembled from two neighbouring bytes of a buffer, low | (high << 8), renders as one 2-byte load
  (og_load_u16) and gives numpy's little-endian values; other byte pairs (not neighbours, or big-endian) stay
  assembled and right too."""
  raw = np.random.default_rng(4).integers(0, 256, (64, 4)).astype(np.uint8)
  blocks = Tensor(raw).realize()

  def assembled(low: int, high: int) -> Tensor:
    return blocks[:, low].cast(dtypes.uint16) | (blocks[:, high].cast(dtypes.uint16) << 8)
  for low, high, merged in ((0, 1, True), (2, 3, True), (1, 0, False), (0, 2, False)):
    value = assembled(low, high)
    assert ("og_load_u16(" in _kernel_body(_sources(assembled(low, high))[-1])) == merged
    expected = raw[:, low].astype(np.uint16) | (raw[:, high].astype(np.uint16) << 8)
    np.testing.assert_array_equal(value.numpy(), expected)


def _kernel_body(source: str) -> str:
  """The kernel function of a rendered source (after its helpers)."""
  return source[source.index("void k("):]


def _nibble_product(packed: Tensor, activation: Tensor, shift: int, scales: Tensor) -> Tensor:
  """sum over (blocks, 16 lanes) of ((packed >> shift) & 15) * activation * scale per block, as an integer product's
  terms: (rows, blocks, 16) uint8 times (blocks, 16) int8 and a float per (row, block)."""
  nibbles = (packed >> shift) & 15 if shift else packed & 15
  terms = (nibbles.cast(dtypes.int32) * activation.cast(dtypes.int32)).cast(dtypes.float32) * scales
  return terms.sum((1, 2))


def test_byte_dot_products_extremes_match_numpy() -> None:
  """Byte dot products at the limits of their bytes: nibbles 15 times int8 -128 and 127 in every lane (the largest
  pairwise 16-bit sums of `pmaddubsw`), both nibbles of a byte in one sum (two pairs in one call), int8 x int8 with
  -128 x -128, odd row counts, 48 lanes a block (three 128-bit loads; 32 + 16 lanes with AVX2), against numpy's
  int64; a full-range uint8 (255 x -128 pairs would saturate 16 bits) is not taken as one and stays exact too."""
  rng = np.random.default_rng(9)
  packed_np = np.full((7, 5, 48), 0xFF, np.uint8)
  packed_np[3] = rng.integers(0, 256, (5, 48), dtype=np.uint8)
  activation_np = np.where(rng.random((5, 48)) < 0.5, -128, 127).astype(np.int8)
  scales_np = rng.uniform(0.5, 2, (7, 5, 1)).astype(np.float32)
  for shift in (0, 4):
    packed, activation, scales = Tensor(packed_np), Tensor(activation_np), Tensor(scales_np)
    source = _sources(_nibble_product(packed, activation, shift, scales))[-1]
    assert "og_dot_add(" in _kernel_body(source)
    nibbles = ((packed_np >> shift) & 15).astype(np.int64)
    expected = ((nibbles * activation_np).astype(np.float64) * scales_np).sum((1, 2))
    got = _nibble_product(Tensor(packed_np), Tensor(activation_np), shift, Tensor(scales_np)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-6)
  # both nibbles of each byte in one term (a Q4 block's two pairs), times two halves of the activation: one load of
  # the bytes (`og_dot_add_split`, 48 lanes a half: a 32-byte and a 16-byte step), or, where the high nibble's mask
  # differs (3 bits), each pair masked apart (`og_dot_add2`)
  halves_np = np.where(rng.random((5, 2, 48)) < 0.5, -128, 127).astype(np.int8)
  for high_mask, helper in ((15, "og_dot_add_split("), (7, "og_dot_add2(")):
    def both_nibbles(packed: Tensor, halves: Tensor) -> Tensor:
      low, high = (packed & 15).cast(dtypes.int32), ((packed >> 4) & high_mask).cast(dtypes.int32)
      products = low * halves[:, 0].cast(dtypes.int32) + high * halves[:, 1].cast(dtypes.int32)
      return (products.cast(dtypes.float32) * Tensor(scales_np)).sum((1, 2))
    body = _kernel_body(_sources(both_nibbles(Tensor(packed_np), Tensor(halves_np)))[-1])
    assert body.count(helper) == 1 and "og_dot_add(" not in body
    nibbles = [(packed_np & 15).astype(np.int64), ((packed_np >> 4) & high_mask).astype(np.int64)]
    products = nibbles[0] * halves_np[:, 0] + nibbles[1] * halves_np[:, 1]
    expected = (products.astype(np.float64) * scales_np).sum((1, 2))
    np.testing.assert_allclose(both_nibbles(Tensor(packed_np), Tensor(halves_np)).numpy(), expected, rtol=1e-6)
  signed_np = packed_np.view(np.int8)   # -1 and, in row 3, every int8; -128 x -128 included
  signed_np[5, :, :8] = -128
  signed = Tensor(signed_np).cast(dtypes.int32) * Tensor(activation_np).cast(dtypes.int32)
  source = _sources((signed.cast(dtypes.float32) * Tensor(scales_np)).sum((1, 2)))[-1]
  assert "og_dot_add_s8(" in _kernel_body(source)
  signed = Tensor(signed_np).cast(dtypes.int32) * Tensor(activation_np).cast(dtypes.int32)
  expected = ((signed_np.astype(np.int64) * activation_np).astype(np.float64) * scales_np).sum((1, 2))
  np.testing.assert_allclose((signed.cast(dtypes.float32) * Tensor(scales_np)).sum((1, 2)).numpy(), expected, rtol=1e-6)
  full = (Tensor(packed_np).cast(dtypes.int32) * Tensor(activation_np).cast(dtypes.int32)).cast(dtypes.float32)
  source = _sources((full * Tensor(scales_np)).sum((1, 2)))[-1]
  assert "og_dot_add(" not in source and "int acc1 = 0;" in source
  full = (Tensor(packed_np).cast(dtypes.int32) * Tensor(activation_np).cast(dtypes.int32)).cast(dtypes.float32)
  expected = ((packed_np.astype(np.int64) * activation_np).astype(np.float64) * scales_np).sum((1, 2))
  np.testing.assert_allclose((full * Tensor(scales_np)).sum((1, 2)).numpy(), expected, rtol=1e-6)


def test_integer_terms_refuse_sums_that_could_wrap() -> None:
  """A float sum of cast int32 products of full-range int32 values is not split (its block sums could overflow an
  int32): it stays a float row kernel, matching numpy."""
  rng = np.random.default_rng(4)
  a_np = rng.integers(-2 ** 20, 2 ** 20, (8, 512)).astype(np.int32)
  b_np = rng.integers(-2 ** 20, 2 ** 20, (512,)).astype(np.int32)
  a, b = Tensor(a_np), Tensor(b_np)
  product = ((a * b).cast(dtypes.float32).reshape(8, 16, 32) * Tensor.ones(1, 16, 1)).sum((1, 2))
  assert "int acc" not in _sources(product)[-1]
  product = ((a * b).cast(dtypes.float32).reshape(8, 16, 32) * Tensor.ones(1, 16, 1)).sum((1, 2))
  products = (a_np.astype(np.int64) * b_np).astype(np.int32).astype(np.float64)   # wraps as int32, as ourgrad
  np.testing.assert_allclose(product.numpy(), products.sum(1), atol=np.abs(products).sum(1).max() * 1e-6)


def test_integer_terms_of_any_product() -> None:
  """The split is not the GGUF formats': a uint8 image's rows (W = 64 values) times a float weight per row, summed
  over (H, W), takes an exact int32 sum per row and one float multiply-add per row; it matches numpy's float64."""
  rng = np.random.default_rng(6)
  images_np = rng.integers(0, 256, (5, 16, 64)).astype(np.uint8)
  weights_np = rng.uniform(-1, 1, (1, 16, 1)).astype(np.float32)
  images, weights = Tensor(images_np), Tensor(weights_np)
  source = _sources((images.cast(dtypes.float32) * weights).sum((1, 2)))[-1]
  assert "int acc1 = 0;" in source and "#pragma omp simd" in source
  expected = (images_np.astype(np.float64) * weights_np).sum((1, 2))
  np.testing.assert_allclose((images.cast(dtypes.float32) * weights).sum((1, 2)).numpy(), expected, rtol=1e-6)
