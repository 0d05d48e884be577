"""Split-K convolution weight gradients on GPUs (conv_tiles.weight_gradient_tiles): every WeightGradientTile gives
the unoptimized kernel's partial sums on the emulated GPU (`PythonRenderer("CUDA")`), the whole gradient matches
PyTorch in float64, the tiles compile with NVRTC at MNIST's sizes, and on a CUDA device the MNIST step's weight
gradients match PyTorch (skipped without one). The kernels MNIST's step gets are pinned in test_conv_gpu.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ourgrad.lazy_reduce as lazy_reduce
from ourgrad import Tensor, dtypes
from ourgrad.codegen.kernel import Kernel, OptOps
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.opt.conv_tiles import WEIGHT_GRADIENT_TILES, WeightGradientTile, weight_gradient_tiles
from ourgrad.device import Buffer
from ourgrad.engine.realize import compile_kernel, function_name, run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.ops import Ops
from ourgrad.runtime.ops_python import PythonRenderer
from helpers import nvrtc_compiler, skip_unless_device, small_split_reduces


@pytest.fixture(autouse=True)
def _two_kernel_splits(monkeypatch: pytest.MonkeyPatch) -> None:
  """These tests look at a split weight gradient's partial-sums kernel alone: two kernels even where the device has
  atomics (EMULATE=CUDA; test_last_block.py covers the one-kernel form)."""
  monkeypatch.setenv("SPLIT_LAST_BLOCK", "0")


rng = np.random.default_rng(10)

# the default tiles and the shapes the benchmark compared them with (extra/bench/bench_conv_kernels.py --wgrad)
TILES = tuple(dict.fromkeys(WEIGHT_GRADIENT_TILES + (
  WeightGradientTile(),
  WeightGradientTile(cin_threads=4, row_group=8, column_unroll=0),
  WeightGradientTile(cin_threads=4, row_group=8, column_unroll=4),
  WeightGradientTile(cout_upcast=2, cin_threads=2, cout_threads=8, row_group=8, column_unroll=0),
  WeightGradientTile(cin_threads=2, cout_threads=4, row_group=8, column_unroll=0, filter_rows_local=True),
  WeightGradientTile(cout_threads=4, row_group=8, column_unroll=8, filter_rows_local=True),
)))


def _small_split(monkeypatch: pytest.MonkeyPatch) -> None:
  """Split-K thresholds scaled down so that a conv small enough for the interpreter splits its weight gradient."""
  small_split_reduces(monkeypatch)


def _weight_gradient(x: Tensor, w: Tensor, upstream: Tensor) -> Tensor:
  out = x.conv2d(w)
  (out * upstream).sum().backward()
  return w.grad


def _torch_weight_gradient(x: np.ndarray, w: np.ndarray, upstream: np.ndarray) -> np.ndarray:
  """The reference in float64."""
  tw = torch.tensor(w.astype(np.float64), requires_grad=True)
  out = torch.nn.functional.conv2d(torch.tensor(x.astype(np.float64)), tw)
  (out * torch.tensor(upstream.astype(np.float64))).sum().backward()
  return tw.grad.numpy()


def _run(kernel: Kernel, item: object) -> np.ndarray:
  out = Buffer("PYTHON", item.outputs[0].size, dtypes.float32).allocate()
  compile_kernel(kernel, "PYTHON")((out, *item.inputs))
  return out.numpy()


@pytest.mark.parametrize("tile", TILES, ids=repr)
@pytest.mark.parametrize("channels, size, kernel_size", [(4, 10, 3), (1, 12, 5)])
def test_weight_gradient_tile_matches_the_plain_kernel(monkeypatch: pytest.MonkeyPatch, tile: WeightGradientTile,
                                                       channels: int, size: int, kernel_size: int) -> None:
  """The partial-sums kernel with `tile` against its plain version on the emulated GPU (where the tile applies:
  each shape takes at least the default tile), and the gradient (parts summed) against PyTorch in float64."""
  _small_split(monkeypatch)
  x_data = rng.standard_normal((8, channels, size, size)).astype(np.float32)
  w_data = rng.standard_normal((8, channels, kernel_size, kernel_size)).astype(np.float32)
  out_size = size - kernel_size + 1
  upstream = rng.standard_normal((8, 8, out_size, out_size)).astype(np.float32)
  x, w = Tensor(x_data, device="PYTHON"), Tensor(w_data, device="PYTHON", requires_grad=True)
  grad = _weight_gradient(x, w, Tensor(upstream, device="PYTHON"))
  applied = 0
  for item in create_schedule([grad.lazydata]):
    if item.ast.op is Ops.STORE:
      tiled, plain = Kernel(item.ast, PythonRenderer("CUDA")), Kernel(item.ast, PythonRenderer("CUDA"))
      if weight_gradient_tiles(tiled, (tile,)):
        applied += 1
        assert tiled.applied_opts[0].op is OptOps.UPCAST and tiled.applied_opts[0].amount == kernel_size   # a row
        if tile.row_group: assert any(opt.op is OptOps.GROUP for opt in tiled.applied_opts)
        np.testing.assert_allclose(_run(tiled, item), _run(plain, item), rtol=1e-4, atol=1e-4)
    run_schedule([item])
  if tile == WeightGradientTile(): assert applied == 1, "the default tile applies to every split weight gradient"
  np.testing.assert_allclose(grad.numpy(), _torch_weight_gradient(x_data, w_data, upstream), rtol=1e-4, atol=1e-4)


def _mnist_partials_asts() -> list:
  """The partial-sums kernels of MNIST's two weight gradients at batch 256 (scheduled only: nothing runs)."""
  asts = []
  for images, weights in (((256, 1, 28, 28), (16, 1, 5, 5)), ((256, 16, 12, 12), (32, 16, 5, 5))):
    x = Tensor.empty(*images, device="PYTHON")
    w = Tensor.empty(*weights, device="PYTHON", requires_grad=True)
    grad = _weight_gradient(x, w, Tensor.empty(*x.conv2d(w).shape, device="PYTHON"))
    items = [item for item in create_schedule([grad.lazydata]) if item.ast.op is Ops.STORE]
    asts.append(items[0].ast)
  return asts


@pytest.mark.parametrize("tile", TILES, ids=repr)
def test_weight_gradient_tiles_compile_with_nvrtc(tile: WeightGradientTile) -> None:
  """Each tile on MNIST's weight gradients (batch 256), rendered for CUDA and compiled by NVRTC (skipped without
  it)."""
  compiler = nvrtc_compiler()
  if compiler is None: pytest.skip("no NVRTC here")
  from ourgrad.renderer.cuda import CUDARenderer
  renderer = CUDARenderer("sm_90")
  for ast in _mnist_partials_asts():
    kernel = Kernel(ast, renderer)
    if weight_gradient_tiles(kernel, (tile,)):
      compiler.compile(renderer.render(function_name(kernel), linearize(kernel)))


@pytest.mark.parametrize("images, weights", [((256, 1, 28, 28), (16, 1, 5, 5)), ((256, 16, 12, 12), (32, 16, 5, 5))])
def test_mnist_weight_gradients_on_cuda_match_torch(images: tuple[int, ...], weights: tuple[int, ...]) -> None:
  """MNIST's weight gradients at batch 256 on a CUDA device (hand-coded kernels) against PyTorch in float64."""
  skip_unless_device("CUDA")
  x_data = rng.standard_normal(images).astype(np.float32)
  w_data = rng.standard_normal(weights).astype(np.float32)
  out_size = images[2] - weights[2] + 1
  upstream = rng.standard_normal((images[0], weights[0], out_size, out_size)).astype(np.float32)
  x, w = Tensor(x_data, device="CUDA"), Tensor(w_data, device="CUDA", requires_grad=True)
  grad = _weight_gradient(x, w, Tensor(upstream, device="CUDA"))
  np.testing.assert_allclose(grad.numpy(), _torch_weight_gradient(x_data, w_data, upstream), rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("row_parts", [2, 4])
def test_weight_gradient_split_across_image_rows_matches_torch(monkeypatch: pytest.MonkeyPatch,
                                                               row_parts: int) -> None:
  """lazy_reduce.GPU_SPLIT_ROW_PARTS: with one image per part, the image rows split into row parts too (the partial
  sums have images x row parts per output); the partial-sums kernel with the hand-coded tile gives its plain kernel's
  results on the emulated GPU, and the gradient matches PyTorch in float64."""
  _small_split(monkeypatch)
  monkeypatch.setattr(lazy_reduce, "GPU_SPLIT_ROW_PARTS", row_parts)
  x_data = rng.standard_normal((8, 1, 12, 12)).astype(np.float32)
  w_data = rng.standard_normal((8, 1, 5, 5)).astype(np.float32)
  upstream = rng.standard_normal((8, 8, 8, 8)).astype(np.float32)
  x, w = Tensor(x_data, device="PYTHON"), Tensor(w_data, device="PYTHON", requires_grad=True)
  grad = _weight_gradient(x, w, Tensor(upstream, device="PYTHON"))
  schedule = create_schedule([grad.lazydata])
  partials = next(item for item in schedule if item.ast.op is Ops.STORE)
  assert partials.outputs[0].size == 8 * row_parts * w_data.size
  run_schedule(schedule[:schedule.index(partials)])
  tiled, plain = Kernel(partials.ast, PythonRenderer("CUDA")), Kernel(partials.ast, PythonRenderer("CUDA"))
  assert weight_gradient_tiles(tiled)
  np.testing.assert_allclose(_run(tiled, partials), _run(plain, partials), rtol=1e-4, atol=1e-4)
  run_schedule(schedule[schedule.index(partials):])
  np.testing.assert_allclose(grad.numpy(), _torch_weight_gradient(x_data, w_data, upstream), rtol=1e-4, atol=1e-4)
