"""Small-window reduces on GPUs (codegen/opt/window_tiles.py): pools forward and backward take the window tiles (the
window unrolled, threads along the output's contiguous axes), give the unoptimized kernel's results on the emulated
GPU (`PythonRenderer("CUDA")`: CUDA's limits, thread indices interpreted) and PyTorch's gradients, compile with
NVRTC, and are what the examples/mnist.py step's max-pools get; other reduces are left alone.

The shapes here are small for the interpreter, so WINDOW_MIN_OUTPUTS is lowered (the `small_windows` fixture).
"""
from __future__ import annotations

import importlib.util
import pathlib
from typing import Any, Callable

import numpy as np
import pytest
import torch

import ourgrad.codegen.opt.window_tiles as window_tiles
import ourgrad.engine.packing as packing
from ourgrad import Tensor, dtypes
from ourgrad.codegen.kernel import Kernel, OptOps
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.uops import AxisType, UOps
from ourgrad.device import Buffer
from ourgrad.engine.realize import compile_kernel, function_name, run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.nn.losses import cross_entropy
from ourgrad.nn.optim import Adam
from ourgrad.nn.state import get_parameters
from ourgrad.ops import Ops
from ourgrad.runtime.ops_python import PythonRenderer
from helpers import nvrtc_compiler, skip_unless_device

ROOT = pathlib.Path(__file__).resolve().parents[1]
rng = np.random.default_rng(7)


@pytest.fixture
def small_windows(monkeypatch: pytest.MonkeyPatch) -> None:
  """Window tiles for the small shapes the interpreter runs in seconds; a reduce this small would otherwise join a
  packed kernel with its independent neighbours (engine/packing.py), which takes no opts."""
  monkeypatch.setattr(window_tiles, "WINDOW_MIN_OUTPUTS", 16)
  monkeypatch.setattr(packing, "PACK_REDUCE_MAX_LOOP", 0)


# (name, input shape, the pool as a function of a Tensor or a torch tensor): odd shapes, overlapping and padded
# windows, strides other than the kernel, a dilated window, a sum window
POOLS: list[tuple[str, tuple[int, ...], Callable[[Any], Any]]] = [
  ("2x2 after relu", (4, 8, 12, 12), lambda x: _pool_module(x).max_pool2d(x.relu(), 2)),
  ("3x3 stride 2 pad 1 ragged", (3, 5, 9, 11), lambda x: _pool_module(x).max_pool2d(x, 3, 2, 1)),
  ("3x2 stride (1, 2)", (2, 6, 10, 7), lambda x: _pool_module(x).max_pool2d(x, (3, 2), (1, 2))),
  ("2x2 dilation 2", (2, 4, 9, 10), lambda x: _pool_module(x).max_pool2d(x, 2, 2, 0, 2)),
  ("avg 2x2", (2, 6, 12, 10), lambda x: _pool_module(x).avg_pool2d(x, 2)),
  ("max 1d 3 stride 3", (3, 7, 33), lambda x: _pool_module(x).max_pool1d(x, 3)),
]


class _TensorPools:
  """Tensor's pools under torch.nn.functional's names and argument order."""

  @staticmethod
  def max_pool2d(x: Tensor, *args: Any) -> Tensor: return x.max_pool2d(*args)

  @staticmethod
  def max_pool1d(x: Tensor, *args: Any) -> Tensor: return x.max_pool1d(*args)

  @staticmethod
  def avg_pool2d(x: Tensor, *args: Any) -> Tensor: return x.avg_pool2d(*args)


def _pool_module(x: Any) -> Any:
  return _TensorPools if isinstance(x, Tensor) else torch.nn.functional


def _run(kernel: Kernel, inputs: list, size: int) -> np.ndarray:
  out = Buffer("PYTHON", size, dtypes.float32).allocate()
  compile_kernel(kernel, "PYTHON")((out, *inputs))
  return out.numpy()


@pytest.mark.parametrize("name, shape, pool", POOLS, ids=[pool[0] for pool in POOLS])
def test_pools_match_the_plain_kernels_and_torch(small_windows: None, name: str, shape: tuple[int, ...],
                                                 pool: Callable[[Any], Any]) -> None:
  """Every kernel of the pool's forward and backward, optimized for CUDA, against its plain version on the same
  inputs (the forward's window reduce and the backward's tie count take the window tiles); then the output and
  the input gradient against torch."""
  x_data = rng.standard_normal(shape).astype(np.float32)
  x = Tensor(x_data, device="PYTHON", requires_grad=True)
  out = pool(x)
  upstream = rng.standard_normal(out.shape).astype(np.float32)
  (out * Tensor(upstream, device="PYTHON")).sum().backward()
  tiled = rows = 0
  for item in create_schedule([out.lazydata, x.grad.lazydata]):
    if item.ast.op is not Ops.STORE:
      run_schedule([item])
      continue
    optimized, plain = Kernel(item.ast, PythonRenderer("CUDA")), Kernel(item.ast, PythonRenderer("CUDA"))
    optimized.hand_coded_optimizations()
    tiled += window_tiles.is_window_reduce(plain)
    rows += window_tiles.elementwise_rows(Kernel(item.ast, PythonRenderer("CUDA")))
    size = item.outputs[0].size
    np.testing.assert_allclose(_run(optimized, list(item.inputs), size), _run(plain, list(item.inputs), size),
                               rtol=1e-6, atol=1e-6)
    run_schedule([item])
  # a 2d max-pool's backward counts each window's ties in a window reduce of its own (a 1d pool's count fuses into the
  # gradient's elementwise kernel; an average pool's backward is elementwise)
  expected = 1 if name.startswith(("avg", "max 1d")) else 2
  assert tiled >= expected, "the forward (and the backward's tie count) take the window tiles"
  if name == "2x2 after relu": assert rows >= 1, "the gradient's elementwise kernel (rows of 12) takes the rows"
  tx = torch.tensor(x_data, requires_grad=True)
  tout = pool(tx)
  tout.backward(torch.tensor(upstream))
  np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-5)


def _window_kernel(shape: tuple[int, ...], pool: Callable[[Tensor], Tensor]) -> Kernel:
  """The CUDA kernel (renderer only: nothing runs) of a pool's forward reduce, with the hand-coded opts."""
  item = next(item for item in create_schedule([pool(Tensor.empty(*shape, device="PYTHON")).lazydata])
              if item.ast.op is Ops.STORE)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  kernel.hand_coded_optimizations()
  return kernel


def test_threads_walk_the_output_contiguously() -> None:
  """MNIST's first pool forward (batch 256, behind a per-channel affine and a ReLU, as its batchnorm): one output per
  thread, the window unrolled (no loop), a block of the 12 x 12 outputs of one image's channel with the launch's x
  along the output's columns; the second pool's 4 x 4 outputs of 8 channels. Without the per-channel values the
  rows of every image and channel merge into one axis: 12 columns x 16 rows."""
  def affine_relu_pool(x: Tensor) -> Tensor:
    return (x * Tensor.empty(1, x.shape[1], 1, 1, device="PYTHON")).relu().max_pool2d()
  for shape, pool, block in (((256, 16, 24, 24), affine_relu_pool, (12, 12)), ((256, 32, 8, 8), affine_relu_pool,
                                                                                 (8, 4, 4)),
                             ((256, 16, 24, 24), lambda x: x.relu().max_pool2d(), (16, 12))):
    kernel = _window_kernel(shape, pool)
    assert [opt.op for opt in kernel.applied_opts][:2] == [OptOps.UNROLL, OptOps.UNROLL]
    assert kernel.upcast_axes == [] and kernel.first_loop_reduce == kernel.first_upcast   # no upcast, no loop
    assert kernel.full_shape[kernel.global_dims:kernel.first_reduce] == block
    uops = linearize(kernel)
    assert not any(uop.op is UOps.RANGE for uop in uops)
    x_dimension = next(uop.arg for uop in uops if uop.op is UOps.SPECIAL and uop.arg[3] is AxisType.LOCAL and
                       uop.arg[2] == 0)
    assert x_dimension[1] == block[-1], "the launch's x walks the output's columns"


def test_other_reduces_are_left_alone() -> None:
  """A matmul, a convolution, a short row sum, a pool with few outputs and a column sum keep the other defaults."""
  cases = [
    Tensor.empty(64, 64, device="PYTHON") @ Tensor.empty(64, 64, device="PYTHON"),
    Tensor.empty(64, 8, 12, 12, device="PYTHON").conv2d(Tensor.empty(16, 8, 3, 3, device="PYTHON")),
    Tensor.empty(4096, 16, device="PYTHON").sum(axis=1),   # a short row: contiguous along the reduce
    Tensor.empty(2, 4, 8, 8, device="PYTHON").max_pool2d(),   # 128 outputs: too few
    Tensor.empty(32, 12800, device="PYTHON").sum(axis=0),   # a column sum (a split reduce's second stage)
  ]
  for out in cases:
    item = next(item for item in create_schedule([out.lazydata]) if item.ast.op is Ops.STORE)
    assert not window_tiles.window_tiles(Kernel(item.ast, PythonRenderer("CUDA")))


@pytest.mark.parametrize("rows, columns, taken", [(24, 24, True), (24, 22, False), (8, 256, False)])
def test_elementwise_rows_only_for_short_rows_of_whole_vectors(rows: int, columns: int, taken: bool) -> None:
  """An elementwise kernel over rows that do not merge (a slice of wider rows) takes float4 columns and threads along
  the columns, then rows, where the rows are a multiple of 4 floats but shorter than a warp of float4s; rows of 128
  and more keep the plain default's float4 columns, ragged rows its scalar code. Its results are the plain
  kernel's on the emulated GPU."""
  data = rng.standard_normal((64, rows, columns + 8)).astype(np.float32)
  source = Tensor(data, device="PYTHON")
  (item,) = [item for item in create_schedule([(source[:, :, :columns] * 2.0 + 1.0).lazydata])
             if item.ast.op is Ops.STORE]
  run_schedule([item for item in create_schedule([source.lazydata]) if item.ast.op is not Ops.STORE])
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  assert kernel.full_shape[-1] == columns   # the batch and the rows merge; the sliced columns cannot
  assert window_tiles.elementwise_rows(kernel) == taken
  if not taken: return
  assert kernel.sts[0].real_strides()[kernel.upcast_axes[0]] == 1, "4 neighbouring columns per thread"
  assert any(uop.op is UOps.LOAD and uop.arg == 4 for uop in linearize(kernel)), "float4 loads"
  size = item.outputs[0].size
  np.testing.assert_allclose(_run(kernel, list(item.inputs), size),
                             _run(Kernel(item.ast, PythonRenderer("CUDA")), list(item.inputs), size))
  np.testing.assert_allclose(_run(kernel, list(item.inputs), size), (data[:, :, :columns] * 2 + 1).reshape(-1))


def _mnist_step_window_kernels() -> list[Kernel]:
  """The kernels of examples/mnist.py's CNN training step (batch 256, scheduled only) that are window reduces or take
  elementwise rows, with the hand-coded opts for CUDA."""
  spec = importlib.util.spec_from_file_location("mnist_example_windows", ROOT / "examples" / "mnist.py")
  mnist = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mnist)
  model = mnist.ConvNet(mnist.MODELS["small"])
  x, y = Tensor.empty(256, 1, 28, 28, device="PYTHON"), Tensor.empty(256, dtype="int32", device="PYTHON")
  optimizer = Adam([t for t in get_parameters(model) if t.requires_grad], lr=1e-3)
  with Tensor.train():
    optimizer.zero_grad()
    loss = cross_entropy(model(x), y)
    loss.backward()
    outputs = [loss, *optimizer.schedule_step()]
  kernels = []
  for item in create_schedule([t.lazydata for t in outputs]):
    if item.ast.op not in (Ops.STORE, Ops.SINK): continue
    kernel = Kernel(item.ast, PythonRenderer("CUDA"))
    if not window_tiles.is_window_reduce(kernel) and not window_tiles.elementwise_rows(kernel.copy()): continue
    kernel.hand_coded_optimizations()
    kernels.append(kernel)
  return kernels


@pytest.fixture
def mnist_windows(monkeypatch: pytest.MonkeyPatch) -> list[Kernel]:
  monkeypatch.setenv("DEVICE", "PYTHON")   # the model's parameters are made on the default device
  if not _STEP_WINDOWS: _STEP_WINDOWS.extend(_mnist_step_window_kernels())   # scheduled once per session
  return _STEP_WINDOWS


_STEP_WINDOWS: list[Kernel] = []


def test_mnist_pools_take_the_window_tiles(mnist_windows: list[Kernel]) -> None:
  """The step's four max-pool kernels (forward and the backward's tie count, each of two blocks), each with its
  window unrolled and at least 128 threads per block along the output's columns and rows; and its two elementwise
  kernels through the pools' backward (rows of 24 and 8), each with 4 neighbouring columns per thread and the
  batchnorm's input, which they read plainly (the ReLU's input) and through the pool's window, loaded once: one
  float4 per thread, the window's view taking its elements from it (the UOp builder's load reuse, codegen/uops.py)."""
  pools = [kernel for kernel in mnist_windows if kernel.reduceop is not None]
  elementwise = [kernel for kernel in mnist_windows if kernel.reduceop is None]
  assert len(pools) == 4 and len(elementwise) == 2
  for kernel in pools:
    assert kernel.reduceop.op in (Ops.MAX_REDUCE, Ops.SUM)
    assert kernel.local_threads() >= window_tiles.WINDOW_BLOCK_THREADS
    assert kernel.first_loop_reduce == kernel.first_upcast   # the window unrolled: no reduce loop
  for kernel in elementwise:
    assert [kernel.full_shape[axis] for axis in kernel.upcast_axes] == [4]
    assert kernel.sts[0].real_strides()[kernel.upcast_axes[0]] == 1, "4 neighbouring columns per thread"
    assert kernel.local_threads() >= window_tiles.WINDOW_BLOCK_THREADS
    largest = max(range(1, len(kernel.leaves)), key=lambda leaf: kernel.leaves[leaf].arg.st.real_size()
                  if hasattr(kernel.leaves[leaf].arg, "st") else 0)
    buffer = kernel.leaves[largest].arg.idx
    views = [leaf for leaf in kernel.leaves if getattr(leaf.arg, "idx", None) == buffer]
    assert len(views) >= 2, "the input is read through two views"
    loads = [uop for uop in linearize(kernel) if uop.op is UOps.LOAD and uop.srcs[0].op is UOps.DEFINE_GLOBAL
             and uop.srcs[0].arg[0] == buffer]
    assert [uop.arg for uop in loads] == [4], "one float4 load of the input, no scalar loads beside it"


def test_mnist_pools_compile_with_nvrtc(mnist_windows: list[Kernel]) -> None:
  compiler = nvrtc_compiler()
  if compiler is None: pytest.skip("no NVRTC here")
  from ourgrad.renderer.cuda import CUDARenderer
  for kernel in mnist_windows:
    cuda_kernel = Kernel(kernel.ast, CUDARenderer())
    cuda_kernel.hand_coded_optimizations()
    assert cuda_kernel.applied_opts == kernel.applied_opts
    compiler.compile(CUDARenderer().render(function_name(cuda_kernel), linearize(cuda_kernel)))


@pytest.mark.parametrize("shape", [(256, 16, 24, 24), (64, 32, 8, 8), (8, 3, 31, 29)])
def test_pools_on_cuda_match_torch(shape: tuple[int, ...]) -> None:
  """On a real GPU: a batchnorm-like affine, relu and a 2x2 max-pool (MNIST's block), forward and input gradient,
  against PyTorch on the CPU."""
  skip_unless_device("CUDA")
  x_data = rng.standard_normal(shape).astype(np.float32)
  scale = rng.standard_normal((1, shape[1], 1, 1)).astype(np.float32)
  upstream_shape = (shape[0], shape[1], shape[2] // 2, shape[3] // 2)
  upstream = rng.standard_normal(upstream_shape).astype(np.float32)
  x = Tensor(x_data, device="CUDA", requires_grad=True)
  out = (x * Tensor(scale, device="CUDA") + 0.5).relu().max_pool2d()
  (out * Tensor(upstream, device="CUDA")).sum().backward()
  tx = torch.tensor(x_data, requires_grad=True)
  tout = torch.nn.functional.max_pool2d((tx * torch.tensor(scale) + 0.5).relu(), 2)
  tout.backward(torch.tensor(upstream))
  np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_bench_window_runs_on_the_emulated_gpu() -> None:
  """extra/bench/bench_window.py on the PYTHON device (a small batch, the second pool only): every variant that
  applies prints its row and matches the unoptimized kernel."""
  import os
  import subprocess
  import sys
  environment = {**os.environ, "DEVICE": "PYTHON", "EMULATE": "CUDA"}
  environment.pop("CHECK_CUDA_RENDER", None)   # the script's own kernels are the subject
  result = subprocess.run([sys.executable, str(ROOT / "extra" / "bench" / "bench_window.py"), "--device", "PYTHON",
                           "--batch", "16", "--only", "pool2 max", "--variants", "hand,before,columns x2 float2"],
                          capture_output=True, text=True, env=environment, cwd=ROOT, timeout=600)
  assert result.returncode == 0, result.stderr
  rows = [line for line in result.stdout.splitlines() if line.startswith("pool2 max")]
  assert len(rows) == 3 and all(" ok " in row for row in rows), result.stdout
