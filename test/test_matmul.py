"""CPU matmul tiling (CLANG; LLVM too for the register tile): the register tile the heuristic picks (rows x one
SIMD register of columns) and the BLOCK cache-blocking opt give the same results as numpy, for tile-multiple, ragged
and batched sizes."""
from typing import Callable

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel, KernelOptError, Opt, OptOps
from ourgrad.codegen.opt.cpu_tiles import cpu_tile_shape
from ourgrad.device import Buffer, Device
from ourgrad.engine.realize import compile_kernel, run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.helpers import CLANG_MARCH, LLVM_CPU, LLVM_FEATURES
from helpers import skip_unless_device

DEVICE = "CLANG"


def _matmul_item(a: np.ndarray, b: np.ndarray, device: str = DEVICE):
  out = Tensor(a, device=device) @ Tensor(b, device=device)
  schedule = create_schedule([out.lazydata])
  run_schedule(schedule[:-1])
  return schedule[-1]


def _run(item, opts: list[Opt] | None, device: str = DEVICE) -> tuple[np.ndarray, Kernel]:
  kernel = Kernel(item.ast, Device[device].renderer)
  if opts is None: kernel.hand_coded_optimizations()
  else:
    for opt in opts: kernel.apply_opt(opt)
  output = Buffer(device, item.outputs[0].size, item.outputs[0].dtype).allocate()
  compile_kernel(kernel, device)((output,) + item.inputs)
  return output.numpy(), kernel


def _operands(shape_a: tuple[int, ...], shape_b: tuple[int, ...], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  return rng.standard_normal(shape_a).astype(np.float32), rng.standard_normal(shape_b).astype(np.float32)


def _expected_tile(m: int, n: int | None = None, device: str = DEVICE) -> tuple[int, int]:
  """The register tile the heuristic gives an (m, n) float32 output where m divides by its rows: the rows, and its
  columns (or one SIMD register of them) where they divide n (n None: a multiple of the tile's columns)."""
  renderer = Device[device].renderer
  vector_bytes = renderer.vector_bytes
  rows, columns = cpu_tile_shape(vector_bytes, vector_registers=renderer.vector_registers)
  return rows, (columns if n is None or n % columns == 0 else vector_bytes // 4)


@pytest.mark.parametrize("device", ["CLANG", "LLVM"])
@pytest.mark.parametrize("m,k,n", [(64, 48, 32), (32, 8, 16), (40, 40, 64)])
def test_register_tile_matches_numpy(m: int, k: int, n: int, device: str):
  skip_unless_device(device)
  a, b = _operands((m, k), (k, n))
  result, kernel = _run(_matmul_item(a, b, device), None, device)
  rows, lanes = _expected_tile(m, n, device)
  if m % rows == 0 and n % lanes == 0:
    # the tile: rows first, then the contiguous columns (the fastest-varying upcast)
    assert [kernel.full_shape[axis] for axis in kernel.upcast_axes] == [rows, lanes]
  np.testing.assert_allclose(result.reshape(m, n), a @ b, rtol=1e-4, atol=1e-4)


def test_llvm_and_clang_see_the_same_simd_width():
  """LLVM reads the width from llvmlite's host CPU features, CLANG from the compiler's -march=native macros: two
  independent readings of one CPU. LLVM once left it at SSE's 16 bytes, so its matmul tile was 8x4 on an AVX-512
  machine (1024^3: 50 ms, against 8.9 ms with CLANG's 16x16). Both must target this CPU (CLANG_MARCH, LLVM_CPU)."""
  skip_unless_device("LLVM")
  if (CLANG_MARCH.value, LLVM_CPU.value, LLVM_FEATURES.value) != ("native", "native", ""):
    pytest.skip("CLANG_MARCH / LLVM_CPU / LLVM_FEATURES pick another target than this CPU")
  assert Device["LLVM"].renderer.vector_bytes == Device["CLANG"].renderer.vector_bytes


@pytest.mark.parametrize("m,k,n", [(33, 17, 45), (7, 129, 5), (1, 64, 31)])
def test_ragged_matches_numpy(m: int, k: int, n: int):
  a, b = _operands((m, k), (k, n), seed=1)
  result, _ = _run(_matmul_item(a, b), None)
  np.testing.assert_allclose(result.reshape(m, n), a @ b, rtol=1e-4, atol=1e-4)


def test_batched_matches_numpy():
  a, b = _operands((3, 16, 24), (3, 24, 32), seed=2)
  result, kernel = _run(_matmul_item(a, b), None)
  assert kernel.upcast_axes, "a batched matmul gets the register tile too"
  np.testing.assert_allclose(result.reshape(3, 16, 32), a @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", [2, 4])
def test_cache_block_matches_numpy(block: int):
  a, b = _operands((32, 40), (40, 128), seed=3)
  item = _matmul_item(a, b)
  opts = [Opt(OptOps.UPCAST, 0, 8), Opt(OptOps.UPCAST, 1, 16), Opt(OptOps.BLOCK, 1, block)]
  result, kernel = _run(item, opts)
  # the column tiles' outer part is now the outermost loop: (128/16)/block of them
  assert kernel.full_shape[0] == 128 // 16 // block and kernel.global_dims == 3
  np.testing.assert_allclose(result.reshape(32, 128), a @ b, rtol=1e-4, atol=1e-4)


def test_cache_block_is_searched_and_refused_where_void():
  a, b = _operands((32, 16), (16, 64), seed=4)
  kernel = Kernel(_matmul_item(a, b).ast, Device[DEVICE].renderer)
  assert any(opt.op is OptOps.BLOCK for opt in kernel.legal_opts())
  with pytest.raises(KernelOptError): kernel.apply_opt(Opt(OptOps.BLOCK, 0, 2))  # axis 0 is already outermost


@pytest.mark.parametrize("device", ["LLVM", "PYTHON"])
def test_other_cpu_devices_take_the_tile(device: str):
  skip_unless_device(device)
  """Devices without threads share the CPU heuristic; a renderer that names no SIMD width gets 16 bytes."""
  a, b = _operands((16, 24), (24, 32), seed=5)
  result = (Tensor(a, device=device) @ Tensor(b, device=device)).numpy()
  np.testing.assert_allclose(result, a @ b, rtol=1e-4, atol=1e-4)


def _rendered_source(tensor: Tensor) -> str:
  """The C source of the kernel computing `tensor` with the default opts (scheduling consumes the tensor's graph:
  realize a fresh copy of the expression, not this one)."""
  from ourgrad.codegen.linearizer import linearize
  item = create_schedule([tensor.lazydata])[-1]
  kernel = Kernel(item.ast, Device[DEVICE].renderer)
  kernel.hand_coded_optimizations()
  return Device[DEVICE].renderer.render("k", linearize(kernel))


def test_wrap_rule_dropped_only_where_integers_just_index():
  """A float matmul's integers are all index math: its kernel is marked and built without -fwrapv (so gcc can
  vectorize the tile); a kernel with integer data, or a cast between int and float, keeps the wrap rule."""
  from ourgrad.renderer.cstyle import INDEX_MATH_ONLY
  compiler = Device[DEVICE].compiler
  a, b = _operands((16, 24), (24, 32), seed=6)
  float_matmul = _rendered_source(Tensor(a, device=DEVICE) @ Tensor(b, device=DEVICE))
  assert float_matmul.startswith(INDEX_MATH_ONLY) and "-fwrapv" not in compiler.flags_for(float_matmul)
  ints = Tensor(np.arange(12, dtype=np.int32).reshape(3, 4), device=DEVICE)
  for tensor in (ints * 7 + 1, (ints * 3).float(), Tensor(a, device=DEVICE).int() * 5):
    source = _rendered_source(tensor)
    assert not source.startswith(INDEX_MATH_ONLY) and "-fwrapv" in compiler.flags_for(source)


@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("m,k,n", [(48, 40, 64), (33, 17, 45)])
def test_transposed_layouts_match_numpy(layout: str, m: int, k: int, n: int):
  """Every transpose layout an MLP's backward makes (A.B, A^T.B, A.B^T) gives numpy's result with the default opts."""
  a, b = _operands((m, k) if layout[0] == "n" else (k, m), (k, n) if layout[1] == "n" else (n, k), seed=7)
  left, right = Tensor(a, device=DEVICE), Tensor(b, device=DEVICE)
  left, right = (left if layout[0] == "n" else left.T), (right if layout[1] == "n" else right.T)
  expected = (a if layout[0] == "n" else a.T) @ (b if layout[1] == "n" else b.T)
  np.testing.assert_allclose((left @ right).numpy(), expected, rtol=1e-4, atol=1e-4)


def test_tile_takes_a_whole_rows_axis():
  """M equal to the tile's rows: the rows axis is upcast whole (it leaves its place), and the columns still get
  one SIMD register (a convolution's input gradient with as many channels as the tile has rows is this case)."""
  rows, lanes = _expected_tile(16)
  a, b = _operands((rows, 40), (40, 4 * lanes), seed=8)
  result, kernel = _run(_matmul_item(a, b), None)
  assert [kernel.full_shape[axis] for axis in kernel.upcast_axes] == [rows, lanes]
  np.testing.assert_allclose(result.reshape(rows, 4 * lanes), a @ b, rtol=1e-4, atol=1e-4)


def _noopt(tensor: Tensor) -> np.ndarray:
  """The plain loop nest's (NOOPT) result of the kernel computing `tensor` (its inputs realized first)."""
  schedule = create_schedule([tensor.lazydata])
  run_schedule(schedule[:-1])
  return _run(schedule[-1], [])[0]


@pytest.mark.parametrize("layout", ["nn", "tn", "nt"])
def test_tiles_render_as_explicit_vectors(layout: str):
  """The register tile of every transpose layout is rendered with explicit SIMD vectors (renderer/cvector.py),
  also with a fused epilogue (bias, ReLU) and a fused prologue on the column operand (a ReLU: the vector max), and
  gives the plain loop nest's (NOOPT) result."""
  rows, lanes = _expected_tile(64)
  m, k, n = 2 * rows, 24, 3 * lanes
  rng = np.random.default_rng(9)
  a = rng.standard_normal((m, k) if layout[0] == "n" else (k, m)).astype(np.float32)
  b = rng.standard_normal((k, n) if layout[1] == "n" else (n, k)).astype(np.float32)
  bias = rng.standard_normal((n,)).astype(np.float32)

  def operands() -> tuple[Tensor, Tensor]:
    left, right = Tensor(a, device=DEVICE), Tensor(b, device=DEVICE)
    return (left if layout[0] == "n" else left.T), (right if layout[1] == "n" else right.T)

  def epilogue() -> Tensor:
    left, right = operands()
    return (left @ right + Tensor(bias, device=DEVICE)).relu()

  def prologue() -> Tensor:
    left, right = operands()
    return left @ right.relu()

  for make in (epilogue, prologue):
    assert "vacc0 +=" in _rendered_source(make())
    np.testing.assert_allclose(make().numpy(), _noopt(make()).reshape(m, n), rtol=1e-5, atol=1e-5)


def test_vector_max_keeps_nan():
  """A NaN in the column operand of a vectorized max (ReLU) propagates as the scalar max does: NaN wins."""
  rows, lanes = _expected_tile(64)
  a, b = _operands((rows, 8), (8, 2 * lanes), seed=10)
  b[3, 5] = np.nan
  result = (Tensor(a, device=DEVICE) @ Tensor(b, device=DEVICE).relu()).numpy()
  expected = a @ np.where(np.isnan(b), np.nan, np.maximum(b, 0))
  np.testing.assert_array_equal(np.isnan(result), np.isnan(expected))
  np.testing.assert_allclose(result, expected, rtol=1e-4, atol=1e-4)


def test_scalar_selects_are_branch_free_and_keep_nan():
  """A Linear layer's fused GELU (erf: max and sign selects) and ReLU epilogue on the A.B^T tile render their float
  max/where as jump-free bit selects (fmax_nan, fsel) and match PyTorch, NaN rows and columns included (NaN wins
  in max from either side), and the plain loop nest (NOOPT)."""
  import torch
  rows, lanes = _expected_tile(64)
  m, k, n = 2 * rows, 24, 2 * lanes
  rng = np.random.default_rng(12)
  x, weight = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
  bias, floor = rng.standard_normal((n,)).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
  x[3, 2], weight[5, 0], floor[7, 9] = np.nan, np.nan, np.nan

  def linear() -> Tensor:
    return Tensor(x, device=DEVICE) @ Tensor(weight, device=DEVICE).T + Tensor(bias, device=DEVICE)
  torch_linear = torch.from_numpy(x) @ torch.from_numpy(weight).T + torch.from_numpy(bias)
  torch_floor = torch.from_numpy(floor)
  cases = [(lambda: linear().gelu(), torch.nn.functional.gelu(torch_linear)),
           (lambda: linear().relu(), torch.relu(torch_linear)),
           (lambda: linear().maximum(Tensor(floor, device=DEVICE)), torch.maximum(torch_linear, torch_floor))]
  for make, expected in cases:
    source = _rendered_source(make())
    assert "fmax_nan(" in source and "? (" not in source.split("void k(")[1]
    result = make().numpy()
    assert np.isnan(result).any()
    np.testing.assert_array_equal(np.isnan(result), np.isnan(expected.numpy()))
    np.testing.assert_allclose(result, expected.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result, _noopt(make()).reshape(m, n), rtol=1e-5, atol=1e-5)


def test_vectors_off_gives_scalar_tiles(monkeypatch):
  """CPU_VECTORS=0 renders the same tile as scalar C (the compiler's own vectorizer) with the same result."""
  a, b = _operands((32, 16), (16, 48), seed=11)
  monkeypatch.setenv("CPU_VECTORS", "0")
  assert "vacc" not in _rendered_source(Tensor(a, device=DEVICE) @ Tensor(b, device=DEVICE))
  np.testing.assert_allclose((Tensor(a, device=DEVICE) @ Tensor(b, device=DEVICE)).numpy(), a @ b, rtol=1e-4,
                             atol=1e-4)


def _conv_weight_gradient(x: np.ndarray, weight: np.ndarray, grad: np.ndarray) -> Callable[[], Tensor]:
  """A function making conv2d(x, weight)'s weight gradient for the upstream gradient `grad` (a new graph each call)."""
  def weight_gradient() -> Tensor:
    w = Tensor(weight, device=DEVICE, requires_grad=True)
    Tensor(x, device=DEVICE).conv2d(w).backward(Tensor(grad, device=DEVICE))
    return w.grad
  return weight_gradient


def _hand_coded_last_kernel(result: Tensor) -> Kernel:
  """The last kernel of `result`'s schedule (the ones before it run) with the hand-coded opts applied."""
  schedule = create_schedule([result.lazydata])
  run_schedule(schedule[:-1])
  kernel = Kernel(schedule[-1].ast, Device[DEVICE].renderer)
  kernel.hand_coded_optimizations()
  return kernel


def test_tile_falls_back_to_a_pair_that_divides():
  """A conv weight gradient: the first axes pair (columns along the 3-wide kernel, contiguous) does not divide the
  tile, so the next pair (output x input channels, a strided column operand) takes it; same result as NOOPT."""
  rows, lanes = _expected_tile(64)
  rng = np.random.default_rng(12)
  x = rng.standard_normal((2, lanes, 10, 10)).astype(np.float32)
  weight = rng.standard_normal((rows, lanes, 3, 3)).astype(np.float32)
  grad = rng.standard_normal((2, rows, 8, 8)).astype(np.float32)

  weight_gradient = _conv_weight_gradient(x, weight, grad)
  kernel = _hand_coded_last_kernel(weight_gradient())
  assert sorted(kernel.full_shape[axis] for axis in kernel.upcast_axes) == sorted([rows, lanes])
  np.testing.assert_allclose(weight_gradient().numpy(), _noopt(weight_gradient()).reshape(weight.shape), rtol=1e-4,
                             atol=1e-4)


@pytest.mark.parametrize("kernel_size,batch", [(5, 3), (3, 2)])
def test_short_rows_axis_is_taken_whole(kernel_size: int, batch: int):
  """MNIST's first conv weight gradient (1 input channel, 5x5 taps, a channel count of one SIMD register): no axes pair
  divides the tile, so the tile is the kernel width whole (5 or 3 rows) x the channels as columns (a strided
  operand); same result as PyTorch and as NOOPT."""
  import torch
  _, lanes = _expected_tile(64)
  rng = np.random.default_rng(13)
  x = rng.standard_normal((batch, 1, 13, 11)).astype(np.float32)
  weight = rng.standard_normal((lanes, 1, kernel_size, kernel_size)).astype(np.float32)
  grad = rng.standard_normal((batch, lanes, 13 - kernel_size + 1, 11 - kernel_size + 1)).astype(np.float32)

  weight_gradient = _conv_weight_gradient(x, weight, grad)
  kernel = _hand_coded_last_kernel(weight_gradient())
  assert [kernel.full_shape[axis] for axis in kernel.upcast_axes][:2] == [kernel_size, lanes]
  assert "vacc0 +=" in _rendered_source(weight_gradient())
  torch_weight = torch.tensor(weight, requires_grad=True)
  torch.nn.functional.conv2d(torch.tensor(x), torch_weight).backward(torch.tensor(grad))
  np.testing.assert_allclose(weight_gradient().numpy(), torch_weight.grad.numpy(), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(weight_gradient().numpy(), _noopt(weight_gradient()).reshape(weight.shape), rtol=1e-4,
                             atol=1e-4)


def _reduce_axes(ast) -> list[tuple[int, ...]]:
  """The axes of every reduce in a kernel AST."""
  from ourgrad.ops import REDUCE_OPS
  found, stack = [], [ast]
  while stack:
    node = stack.pop()
    if node.op in REDUCE_OPS: found.append(tuple(node.arg))
    stack.extend(node.srcs)
  return found


def test_batched_input_times_matrix_is_one_product():
  """(B, T, K) @ (K, N) is one (B*T, K) @ (K, N) product: the weight's gradient is one reduce over all B*T rows (one
  K axis, which split-K and tensor cores take), not a reduce over the two axes B and T. Values as numpy's."""
  rng = np.random.default_rng(0)
  x_np, w_np = rng.standard_normal((3, 5, 4)).astype(np.float32), rng.standard_normal((4, 6)).astype(np.float32)
  x, w = Tensor(x_np), Tensor(w_np, requires_grad=True)
  out = x @ w
  assert out.shape == (3, 5, 6)
  np.testing.assert_allclose(out.numpy(), x_np @ w_np, rtol=1e-5, atol=1e-5)
  (x @ w).sum().backward()
  schedule = create_schedule([w.grad.lazydata])
  weight_reduces = [axes for item in schedule for axes in _reduce_axes(item.ast)]
  run_schedule(schedule)
  assert weight_reduces and all(len(axes) == 1 for axes in weight_reduces), weight_reduces
  np.testing.assert_allclose(w.grad.numpy(), x_np.reshape(-1, 4).T @ np.ones((15, 6), np.float32), rtol=1e-5, atol=1e-5)


def test_cache_block_follows_the_l2(monkeypatch):
  """The hand-coded tile adds the cache block (BLOCK) where the column tiles' panels of B overflow the renderer's L2,
  sized so one block's panels fill half of it; not where B fits, nor where one panel alone fills it. Same result as
  numpy either way."""
  rows, columns = _expected_tile(64)
  k, tiles = 64, 8
  a, b = _operands((2 * rows, k), (k, tiles * columns), seed=14)
  panel = k * columns * 4
  renderer = Device[DEVICE].renderer
  for l2_bytes, block in ((panel * tiles, None), (4 * panel, 2), (panel, None)):
    monkeypatch.setattr(renderer, "l2_cache_bytes", l2_bytes, raising=False)
    result, kernel = _run(_matmul_item(a, b), None)
    blocks = [opt for opt in kernel.applied_opts if opt.op is OptOps.BLOCK]
    assert [opt.amount for opt in blocks] == ([] if block is None else [block])
    np.testing.assert_allclose(result.reshape(2 * rows, tiles * columns), a @ b, rtol=1e-4, atol=1e-4)
