"""Convolutions on GPUs: the hand-coded convolution choice (conv_tiles.shared_conv_tiles: an implicit GEMM with both
operands staged through local memory) gives the unoptimized kernel's results on the emulated GPU (`PythonRenderer
("CUDA")`: CUDA's limits, thread blocks, local memory and barriers interpreted), compiles with NVRTC, and is what the
examples/mnist.py step's convolutions get. Forward and backward results against PyTorch on CLANG are in
test_conv.py; the split-K weight gradient in test_split_reduce.py.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from ourgrad import Tensor, dtypes
from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.opt.conv_tiles import CONV_TILES, shared_conv_tiles
from ourgrad.codegen.shared_tiles import SharedStructure
from ourgrad.device import Buffer
from ourgrad.engine.realize import compile_kernel, function_name, run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.ops import LazyOp, Ops
from ourgrad.runtime.ops_python import PythonRenderer
from helpers import nvrtc_compiler, skip_unless_device

rng = np.random.default_rng(12)

# (input shape, weight shape, padding): small enough for the interpreter, large enough for a conv tile
CONVS = [
  ((2, 8, 8, 8), (64, 8, 3, 3), 1),       # the 56x56 benchmark conv's structure: 64 channels, 3x3, pad 1
  ((3, 16, 12, 12), (32, 16, 5, 5), 0),   # MNIST's conv2 forward, 3 images
  ((4, 8, 6, 14), (16, 8, 3, 3), (1, 2)),  # 6 rows (not a power of two), more padding on the columns
]


def _conv_ast(x_shape: tuple[int, ...], w_shape: tuple[int, ...], padding: object) -> tuple[LazyOp, list]:
  """The convolution's kernel AST on PYTHON with its inputs realized, and the schedule items before it."""
  x = Tensor(rng.standard_normal(x_shape).astype(np.float32), device="PYTHON")
  w = Tensor(rng.standard_normal(w_shape).astype(np.float32), device="PYTHON")
  schedule = create_schedule([x.conv2d(w, padding=padding).lazydata])
  run_schedule([item for item in schedule if item.ast.op is not Ops.STORE])
  item = next(item for item in schedule if item.ast.op is Ops.STORE)
  return item.ast, list(item.inputs)


def _run(kernel: Kernel, inputs: list, size: int) -> np.ndarray:
  out = Buffer("PYTHON", size, dtypes.float32).allocate()
  compile_kernel(kernel, "PYTHON")((out, *inputs))
  return out.numpy()


@pytest.mark.parametrize("x_shape, w_shape, padding", CONVS)
def test_conv_tiles_match_the_plain_kernel_on_the_emulated_gpu(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                                                               padding: object) -> None:
  ast, inputs = _conv_ast(x_shape, w_shape, padding)
  plain = Kernel(ast, PythonRenderer("CUDA"))
  tiled = Kernel(ast, PythonRenderer("CUDA"))
  tiled.hand_coded_optimizations()
  assert any(opt.op is OptOps.SHARED for opt in tiled.applied_opts), tiled.applied_opts
  size = int(np.prod(plain.output_shape))
  np.testing.assert_allclose(_run(tiled, inputs, size), _run(plain, inputs, size), rtol=1e-5, atol=1e-4)


# convs the tiles of CONV_TILES fit (each tile is tried on the first it fits): 64 channels, pad 1; MNIST conv2's
# forward shape (4 images of 8x8: 256 pixels); 16 channels of 12x12 pixels (MNIST's input gradient's shape)
TILE_CONVS = [((2, 16, 8, 8), (64, 16, 3, 3), 1), ((4, 16, 12, 12), (32, 16, 5, 5), 0),
              ((2, 32, 16, 16), (16, 32, 5, 5), 0)]


@pytest.mark.parametrize("tile", CONV_TILES)
def test_every_conv_tile_matches_the_plain_kernel(tile: object) -> None:
  """Each tile of the list on the first of TILE_CONVS it fits, against the plain kernel and torch's result."""
  for x_shape, w_shape, padding in TILE_CONVS:
    ast, inputs = _conv_ast(x_shape, w_shape, padding)
    plain, tiled = Kernel(ast, PythonRenderer("CUDA")), Kernel(ast, PythonRenderer("CUDA"))
    if shared_conv_tiles(tiled, (tile,)): break
  else: raise AssertionError(f"{tile} fits none of {TILE_CONVS}")
  size = int(np.prod(plain.output_shape))
  ours = _run(tiled, inputs, size)
  np.testing.assert_allclose(ours, _run(plain, inputs, size), rtol=1e-5, atol=1e-4)
  x, w = (torch.tensor(buffer.numpy()) for buffer in inputs[:2])
  if x.numel() != int(np.prod(x_shape)): x, w = w, x
  expected = torch.nn.functional.conv2d(x.reshape(x_shape), w.reshape(w_shape), padding=padding)
  np.testing.assert_allclose(ours, expected.numpy().reshape(-1), rtol=1e-4, atol=1e-4)


def test_conv_tiles_leave_other_reduces_alone() -> None:
  """A plain matmul, a float16 conv (tensor cores) and a pooling-shaped reduce do not take the conv tile."""
  a, b = Tensor.empty(64, 64, device="PYTHON"), Tensor.empty(64, 64, device="PYTHON")
  half = Tensor.empty(2, 16, 8, 8, device="PYTHON", dtype="float16").conv2d(
    Tensor.empty(64, 16, 3, 3, device="PYTHON", dtype="float16"), padding=1)
  pooled = Tensor.empty(2, 16, 8, 8, device="PYTHON").avg_pool2d(2)
  for out in (a @ b, half, pooled):
    item = next(item for item in create_schedule([out.lazydata]) if item.ast.op is Ops.STORE)
    assert not shared_conv_tiles(Kernel(item.ast, PythonRenderer("CUDA")))


@pytest.mark.parametrize("x_shape, w_shape, padding", CONVS + [((64, 64, 56, 56), (64, 64, 3, 3), 1)])
def test_conv_tiles_compile_with_nvrtc(x_shape: tuple[int, ...], w_shape: tuple[int, ...], padding: object) -> None:
  compiler = nvrtc_compiler()
  if compiler is None: pytest.skip("no NVRTC here")
  from ourgrad.renderer.cuda import CUDARenderer
  x, w = Tensor.empty(*x_shape, device="PYTHON"), Tensor.empty(*w_shape, device="PYTHON")
  item = next(item for item in create_schedule([x.conv2d(w, padding=padding).lazydata]) if item.ast.op is Ops.STORE)
  kernel = Kernel(item.ast, CUDARenderer())
  kernel.hand_coded_optimizations()
  assert any(opt.op is OptOps.SHARED for opt in kernel.applied_opts)
  compiler.compile(CUDARenderer().render(function_name(kernel), linearize(kernel)))


@pytest.mark.parametrize("x_shape, w_shape, padding", CONVS + [((8, 64, 56, 56), (64, 64, 3, 3), 1)])
def test_convs_on_cuda_match_torch(x_shape: tuple[int, ...], w_shape: tuple[int, ...], padding: object) -> None:
  """On a real GPU: forward, input and weight gradients against PyTorch on the CPU."""
  skip_unless_device("CUDA")
  x_data = rng.standard_normal(x_shape).astype(np.float32)
  w_data = rng.standard_normal(w_shape).astype(np.float32)
  x = Tensor(x_data, device="CUDA", requires_grad=True)
  w = Tensor(w_data, device="CUDA", requires_grad=True)
  out = x.conv2d(w, padding=padding)
  (out * out).sum().backward()
  tx, tw = torch.tensor(x_data, requires_grad=True), torch.tensor(w_data, requires_grad=True)
  tout = torch.nn.functional.conv2d(tx, tw, padding=padding)
  (tout * tout).sum().backward()
  scale = float(np.abs(tout.detach().numpy()).max())
  np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-4, atol=1e-4 * scale)
  np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-3, atol=1e-3 * float(tx.grad.abs().max()))
  np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-3, atol=1e-3 * float(tw.grad.abs().max()))


@pytest.mark.parametrize("size, padding, tiled_kernel", [(8, 1, "forward"), (12, 0, "input gradient")])
def test_conv_backward_kernels_match_the_plain_kernels_on_the_emulated_gpu(size: int, padding: int,
                                                                           tiled_kernel: str) -> None:
  """Every kernel of a stride-1 conv's forward and backward (the input gradient is a conv over the padded output
  gradient, the weight gradient a reduce over the batch and positions), optimized for CUDA, against its plain
  version on the same inputs; then the gradients against torch. `tiled_kernel` takes the conv tile at least."""
  x_data = rng.standard_normal((8, 16, size, size)).astype(np.float32)
  w_data = rng.standard_normal((32, 16, 3, 3)).astype(np.float32)
  x = Tensor(x_data, device="PYTHON", requires_grad=True)
  w = Tensor(w_data, device="PYTHON", requires_grad=True)
  out = x.conv2d(w, padding=padding)
  (out * out).sum().backward()
  tiled = 0
  for item in create_schedule([x.grad.lazydata, w.grad.lazydata]):
    if item.ast.op is not Ops.STORE:
      run_schedule([item])
      continue
    optimized, plain = Kernel(item.ast, PythonRenderer("CUDA")), Kernel(item.ast, PythonRenderer("CUDA"))
    optimized.hand_coded_optimizations()
    tiled += any(opt.op is OptOps.SHARED for opt in optimized.applied_opts)
    size = item.outputs[0].size
    np.testing.assert_allclose(_run(optimized, list(item.inputs), size), _run(plain, list(item.inputs), size),
                               rtol=1e-4, atol=1e-3)
    run_schedule([item])
  assert tiled >= 1, f"the {tiled_kernel} takes the conv tile"
  tx, tw = torch.tensor(x_data, requires_grad=True), torch.tensor(w_data, requires_grad=True)
  tout = torch.nn.functional.conv2d(tx, tw, padding=padding)
  (tout * tout).sum().backward()
  np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-3, atol=1e-2)
  np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-3, atol=1e-1)


def _mnist_conv_kernels(images: tuple[int, ...], weights: tuple[int, ...], input_gradient: bool) -> dict[str, str]:
  """{plain kernel name: the hand-coded kernel's name for CUDA} of a conv layer's forward and backward at MNIST's
  batch 256 (scheduled only: nothing runs)."""
  x = Tensor.empty(*images, device="PYTHON", requires_grad=input_gradient)
  w = Tensor.empty(*weights, device="PYTHON", requires_grad=True)
  out = x.conv2d(w)
  (out * Tensor.empty(*out.shape, device="PYTHON")).sum().backward()
  outputs = [out, w.grad] + ([x.grad] if input_gradient else [])
  names = {}
  for item in create_schedule([t.lazydata for t in outputs]):
    if item.ast.op is not Ops.STORE: continue
    kernel = Kernel(item.ast, PythonRenderer("CUDA"))
    plain = kernel.name
    kernel.hand_coded_optimizations()
    if kernel.reduceop is not None: names[plain] = kernel.name
  return names


def test_mnist_conv_kernel_choices() -> None:
  """The kernels examples/mnist.py's convolutions get on CUDA (batch 256), pinned: a change here is a change of the
  step's speed, to be measured (`python extra/bench/bench_conv_kernels.py`)."""
  assert _mnist_conv_kernels((256, 16, 12, 12), (32, 16, 5, 5), True) == {
    "r_256_32_8_8_16_5_5": "r_64_2_4_4_8_2_8_4_4_2_5_5",      # forward: halo tile, 256 pixels (4 images) x 16
    #                                                           channels, the window unrolled, 2 input channels a step
    "r_32_32_16_5_5_8_8_8": "r_32_2_4_4_4_5_4_8_2_5_4_8",     # weight gradient, 32 parts of 8 images: filter rows,
    #                                                           5 x 4 cin x 4 cout threads x 4 GROUP image rows
    "r_12800_32": "r_400_32_8_4",                             # the parts summed (32 rows of 32 GROUP threads a
    #                                                           block, decode branch's few-output rule, session 12)
    "r_256_16_12_12_32_5_5": "r_128_3_4_2_4_3_2_8_4_4_2_5_5",  # input gradient: halo tile over the unpadded
    #                                                           gradient, 4 rows x 12 pixels of 2 images x 16 channels,
    #                                                           the 32 output-gradient channels over 2 GROUP threads
  }
  assert _mnist_conv_kernels((256, 1, 28, 28), (16, 1, 5, 5), False) == {
    "r_256_16_24_24_5_5": "r_128_3_3_2_16_2_2_5_5_4_4",       # forward: one input channel, no conv tile
    "r_256_16_5_5_24_24": "r_256_2_4_5_8_3_3_5_2_8",          # weight gradient, 256 parts of 1 image: filter rows,
    #                                                           5 x 4 cout threads (2 cout each) x 8 GROUP image
    #                                                           rows, 8 columns unrolled (float4 loads)
    "r_400_256": "r_25_16_16_16",
  }


TC_CONV_OPTS = {   # float16 conv (batch, cout, pixels | cin, kh, kw) with tensor cores, both tiles staged
  "hand warps": [(OptOps.TC, 0, 0), (OptOps.UPCAST, 1, 4), (OptOps.UPCAST, 2, 2), (OptOps.LOCAL, 1, 2),
                 (OptOps.SHARED, 0, 0)],
  "cin steps of 32": [(OptOps.TC, 0, 0), (OptOps.UPCAST, 1, 4), (OptOps.UPCAST, 2, 2), (OptOps.LOCAL, 1, 2),
                      (OptOps.UNROLL, 0, 2), (OptOps.SHARED, 0, 0)],
  "2 images per block": [(OptOps.TC, 0, 0), (OptOps.UPCAST, 1, 4), (OptOps.LOCAL, 1, 2), (OptOps.LOCAL, 0, 2),
                         (OptOps.SHARED, 0, 0)],
}


def _float16_conv_item() -> Any:
  """The conv kernel's ScheduleItem of a float16 2x32x8x8 input and 64 3x3 filters, padding 1, on the PYTHON device
  (the kernels before it run)."""
  x = Tensor(rng.standard_normal((2, 32, 8, 8)).astype(np.float16), device="PYTHON")
  w = Tensor(rng.standard_normal((64, 32, 3, 3)).astype(np.float16), device="PYTHON")
  schedule = create_schedule([x.conv2d(w, padding=1).lazydata])
  run_schedule([item for item in schedule if item.ast.op is not Ops.STORE])
  return next(item for item in schedule if item.ast.op is Ops.STORE)


def _assert_same_float16_results(item: Any, plain: Kernel, staged: Kernel) -> None:
  """Both kernels of `item` run on the emulated GPU give the same float16 outputs (within float16 rounding)."""
  results = []
  for kernel in (plain, staged):
    out = Buffer("PYTHON", item.outputs[0].size, dtypes.float16).allocate()
    compile_kernel(kernel, "PYTHON")((out, *item.inputs))
    results.append(out.numpy().astype(np.float32))
  np.testing.assert_allclose(results[1], results[0], rtol=2e-3, atol=2e-2)


@pytest.mark.parametrize("name", sorted(TC_CONV_OPTS))
def test_staged_tensor_core_conv_matches_the_plain_kernel(name: str) -> None:
  """TC + SHARED on a float16 conv: its three reduce loops (channel steps, window rows, window columns) walked as
  one flat loop of staged steps; the window tile's copies masked at the padding, the filter's element by element
  (not contiguous along the channels). Against the plain kernel on the emulated GPU, and NVRTC compiles it."""
  from ourgrad.codegen.kernel import Opt
  item = _float16_conv_item()
  plain, staged = Kernel(item.ast, PythonRenderer("CUDA")), Kernel(item.ast, PythonRenderer("CUDA"))
  for op, axis, amount in TC_CONV_OPTS[name]: staged.apply_opt(Opt(op, axis, amount))
  assert staged.first_upcast - staged.first_loop_reduce >= 2 and staged.shared_tiles   # several loops, one flat
  _assert_same_float16_results(item, plain, staged)
  compiler = nvrtc_compiler()
  if compiler is None: return
  from ourgrad.renderer.cuda import CUDARenderer
  cuda = Kernel(item.ast, CUDARenderer())
  for op, axis, amount in TC_CONV_OPTS[name]: cuda.apply_opt(Opt(op, axis, amount))
  compiler.compile(CUDARenderer().render(function_name(cuda), linearize(cuda)))


def test_float16_conv_takes_staged_tensor_cores_by_default() -> None:
  """The hand-coded float16 conv (conv_tiles.TensorCoreConvStrategy): TC + SHARED, 8 warps (2 images) per block, on
  the emulated GPU against the plain kernel."""
  item = _float16_conv_item()
  plain, staged = Kernel(item.ast, PythonRenderer("CUDA")), Kernel(item.ast, PythonRenderer("CUDA"))
  staged.hand_coded_optimizations()
  assert staged.tensor_core is not None and staged.shared_tiles and staged.block_threads() == 256
  _assert_same_float16_results(item, plain, staged)


def test_benchmark_conv_kernel_choices() -> None:
  """conv2d 64x64x56x56 3x3 pad 1 (issue 12's rows) on CUDA, pinned. H100 (bench_conv_kernels.py): float32 8x8
  outputs per thread with the window unrolled inside the staged step in steps of 2 channels (the input a halo tile,
  the filter's rows padded) 0.375 ms, cuDNN 0.376 (window loops outside the step 0.435, the 4x4 tile 0.600, no tile
  1.001); float16 staged tensor cores 0.134 ms (unstaged 0.407)."""
  from ourgrad.renderer.cuda import CUDARenderer
  U, L, R, S = OptOps.UPCAST, OptOps.LOCAL, OptOps.UNROLL, OptOps.SHARED
  kernels = {}
  for dtype in (dtypes.float32, dtypes.float16):
    x = Tensor.empty(64, 64, 56, 56, dtype=dtype, device="PYTHON")
    w = Tensor.empty(64, 64, 3, 3, dtype=dtype, device="PYTHON")
    item = next(item for item in create_schedule([x.conv2d(w, padding=1).lazydata]) if item.ast.op is Ops.STORE)
    kernel = Kernel(item.ast, CUDARenderer())
    kernel.hand_coded_optimizations()
    kernels[dtype.name] = kernel
  names = {name: kernel.name for name, kernel in kernels.items()}
  assert names == {"float32": "r_32_49_8_16_32_4_4_2_2_2_3_3", "float16": "r_32_49_2_2_2_2_3_3_4_2_2_16_8_16"}
  assert kernels["float32"].applied_opts == [Opt(U, 2, 4), Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 8), Opt(U, 1, 2),
                                             Opt(U, 0, 2), Opt(S, 0, 0, SharedStructure(4)), Opt(R, 0, 2), Opt(R, 1, 3),
                                             Opt(R, 1, 3)]


@pytest.mark.parametrize("channels, size, kernel_size", [(4, 9, 3), (1, 10, 5)])
def test_split_weight_gradient_tiles_match_the_plain_kernel(monkeypatch: pytest.MonkeyPatch, channels: int,
                                                            size: int, kernel_size: int) -> None:
  """conv_tiles.weight_gradient_tiles on the split-K weight gradient (thresholds scaled down so a small conv splits):
  a filter row per thread, the filter's rows as LOCAL threads and GROUP lanes over the image rows (and columns, where
  the unrolled row would take too many registers); every kernel against its plain version on the emulated GPU, the
  gradient against torch. Each WeightGradientTile alone: test_weight_gradient_tiles.py."""
  from helpers import small_split_reduces
  small_split_reduces(monkeypatch)
  x_data = rng.standard_normal((8, channels, size, size)).astype(np.float32)
  w_data = rng.standard_normal((8, channels, kernel_size, kernel_size)).astype(np.float32)
  x, w = Tensor(x_data, device="PYTHON"), Tensor(w_data, device="PYTHON", requires_grad=True)
  out = x.conv2d(w)
  upstream = rng.standard_normal(out.shape).astype(np.float32)   # a stored gradient, as a batchnorm backward gives
  (out * Tensor(upstream, device="PYTHON")).sum().backward()
  tiled = 0
  for item in create_schedule([w.grad.lazydata]):
    if item.ast.op is not Ops.STORE:
      run_schedule([item])
      continue
    optimized, plain = Kernel(item.ast, PythonRenderer("CUDA")), Kernel(item.ast, PythonRenderer("CUDA"))
    optimized.hand_coded_optimizations()
    tiled += optimized.applied_opts[:1] == [Opt(OptOps.UPCAST, optimized.applied_opts[0].axis, kernel_size)]
    size_out = item.outputs[0].size
    np.testing.assert_allclose(_run(optimized, list(item.inputs), size_out), _run(plain, list(item.inputs), size_out),
                               rtol=1e-4, atol=1e-3)
    run_schedule([item])
  assert tiled == 1, "the partial-sums kernel takes the filter-row tile"
  tw = torch.tensor(w_data, requires_grad=True)
  tout = torch.nn.functional.conv2d(torch.tensor(x_data), tw)
  (tout * torch.tensor(upstream)).sum().backward()
  np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-3, atol=1e-2)
