"""Split-K on GPUs: a reduce with few outputs and long rows (a convolution's weight gradient, batchnorm statistics)
runs as two kernels, partial sums over pieces of the reduce and then a reduce over the pieces
(`LazyBuffer._gpu_split_parts`), so the first kernel has enough blocks to fill the GPU.

The PYTHON device has thread blocks and local memory (a GPU renderer), so the split applies there; CLANG keeps one
kernel. Results are checked against numpy and PyTorch, and every kernel of a split reduce, optimized for CUDA's
limits (`EMULATE=CUDA`'s renderer), against its plain (NOOPT) version on random inputs.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel
from ourgrad.engine.realize import compile_kernel, run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.device import Buffer
from ourgrad.ops import Ops
from ourgrad.runtime.ops_python import PythonRenderer
from helpers import skip_unless_device

rng = np.random.default_rng(10)


def _kernels(*tensors: Tensor) -> list:
  return [item for item in create_schedule([t.lazydata for t in tensors]) if item.ast.op is Ops.STORE]


# ================================================================ when the split applies (kernel counts)

def test_batchnorm_statistics_split_in_two_kernels_on_a_gpu() -> None:
  """MNIST's second batchnorm: 32 channels of 256 x 8 x 8 values: 16 parts (of 16 images, 1024 values) per
  channel, then the parts."""
  x = Tensor.empty(256, 32, 8, 8, device="PYTHON")
  kernels = _kernels(x.sum(axis=(0, 2, 3)))
  assert len(kernels) == 2
  assert kernels[0].outputs[0].size == 16 * 32   # partial sums: 16 parts x 32 channels
  assert kernels[1].outputs[0].size == 32


def test_weight_gradient_splits_its_batch_on_a_gpu() -> None:
  """MNIST's second convolution's weight gradient (12800 outputs of 16384 products, matmul-like): split over the
  batch into 32 parts (of 8 images, 512 products), then one kernel over the parts."""
  images = Tensor.empty(256, 16, 12, 12, device="PYTHON")
  weight = Tensor.empty(32, 16, 5, 5, device="PYTHON", requires_grad=True)
  (images.conv2d(weight) * Tensor.empty(256, 32, 8, 8, device="PYTHON")).sum().backward()
  kernels = _kernels(weight.grad)
  last = kernels[-1]
  assert last.outputs[0].size == 32 * 16 * 5 * 5
  partials = max(buffer.size for buffer in last.inputs)
  assert partials == 32 * 16 * 5 * 5 * 32, "the last kernel sums 32 partial results per weight"


def test_split_partials_put_the_parts_outermost() -> None:
  """The first kernel of a GPU split stores (parts, outputs...): a weight gradient's channels stay the innermost
  output axes, which the heuristic tiles (with the parts innermost, a warp's 32 threads each read another image:
  MNIST's conv2 weight gradient took 0.180 ms on the H100 instead of 0.061). The second kernel sums over axis 0."""
  images = Tensor.empty(256, 16, 12, 12, device="PYTHON")
  weight = Tensor.empty(32, 16, 5, 5, device="PYTHON", requires_grad=True)
  (images.conv2d(weight) * Tensor.empty(256, 32, 8, 8, device="PYTHON")).sum().backward()
  first, last = _kernels(weight.grad)[-2:]
  assert Kernel(first.ast, PythonRenderer("CUDA")).full_shape[:5] == (32, 32, 16, 5, 5)
  assert Kernel(last.ast, PythonRenderer("CUDA")).full_shape == (32 * 16 * 5 * 5, 32)   # outputs, then the parts
  assert Kernel(last.ast, PythonRenderer("CUDA")).first_reduce == 1
  x = Tensor.empty(256, 32, 8, 8, device="PYTHON")
  assert Kernel(_kernels(x.sum(axis=(0, 2, 3)))[0].ast, PythonRenderer("CUDA")).full_shape[:2] == (16, 32)


def test_many_outputs_or_short_rows_are_not_split() -> None:
  rows = Tensor.empty(8192, 8192, device="PYTHON")
  assert len(_kernels(rows.sum(axis=1))) == 1     # a block per row already fills the GPU
  assert len(_kernels(rows.sum(axis=0))) == 1
  assert len(_kernels(Tensor.empty(64, 32, 4, 4, device="PYTHON").sum(axis=(0, 2, 3)))) == 1   # 1024 per output


def test_clang_keeps_one_kernel() -> None:
  """No thread blocks: OpenMP over the outputs is the CPU's parallelism; only huge reduces split there."""
  x = Tensor.empty(256, 32, 8, 8, device="CLANG")
  assert len(_kernels(x.sum(axis=(0, 2, 3)))) == 1


# ================================================================ results

@pytest.mark.parametrize("shape, axes", [((9, 5, 7, 13), (0, 2, 3)), ((3, 40, 11), (0, 1)), ((2, 255), (1,)),
                                         ((77, 3, 1, 5), (0, 3))])
def test_split_sum_and_max_match_numpy(small_split: None, shape: tuple[int, ...], axes: tuple[int, ...]) -> None:
  data = rng.standard_normal(shape).astype(np.float32)
  x = Tensor(data, device="PYTHON")
  split = len(_kernels(x.sum(axis=axes)))
  assert split == 2, f"{shape} over {axes} is split with the small thresholds"
  np.testing.assert_allclose(x.sum(axis=axes).numpy(), data.sum(axis=axes), rtol=1e-5, atol=1e-4)
  np.testing.assert_array_equal(x.max(axis=axes).numpy(), data.max(axis=axes))


def test_split_weight_gradient_and_batchnorm_match_torch(small_split: None) -> None:
  images = rng.standard_normal((6, 3, 9, 9)).astype(np.float32)
  weights = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
  x, w = Tensor(images, device="PYTHON"), Tensor(weights, device="PYTHON", requires_grad=True)
  features = x.conv2d(w)
  mean = features.mean(axis=(0, 2, 3), keepdim=True)
  variance = ((features - mean) ** 2).mean(axis=(0, 2, 3), keepdim=True)
  ((features - mean) / (variance + 1e-5).sqrt()).relu().sum().backward()
  tx, tw = torch.tensor(images), torch.tensor(weights, requires_grad=True)
  tf = torch.nn.functional.conv2d(tx, tw)
  tmean = tf.mean(dim=(0, 2, 3), keepdim=True)
  tvariance = ((tf - tmean) ** 2).mean(dim=(0, 2, 3), keepdim=True)
  ((tf - tmean) / (tvariance + 1e-5).sqrt()).relu().sum().backward()
  np.testing.assert_allclose(mean.numpy(), tmean.detach().numpy(), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(variance.numpy(), tvariance.detach().numpy(), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-3, atol=1e-3)


def test_split_kernels_with_cuda_heuristics_match_plain(small_split: None, monkeypatch: pytest.MonkeyPatch) -> None:
  """Every kernel of split reduces (odd sizes), optimized by the heuristic under CUDA's limits, gives the plain
  kernel's results on random inputs. (Unpacked: on a GPU the small second kernels would share a packed launch,
  which takes no opts; test_step_kernels.py checks those.)"""
  monkeypatch.setenv("PACK_KERNELS", "0")
  data = rng.standard_normal((10, 6, 7, 11)).astype(np.float32)
  x = Tensor(data, device="PYTHON")
  outputs = [x.sum(axis=(0, 2, 3)), (x * x).sum(axis=(0, 2, 3)), x.max(axis=(0, 1, 3))]
  schedule = create_schedule([t.lazydata for t in outputs])
  # two kernels for each sum, the two sums' parts in one kernel (sibling reduces reading x); the max stays one (its
  # longest reduce axis, 11, has no divisor from 4 to 10 parts)
  assert [len(item.outputs) for item in schedule if item.ast.op in (Ops.STORE, Ops.SINK)] == [2, 1, 1, 1]
  for item in schedule:
    if item.ast.op not in (Ops.STORE, Ops.SINK):
      run_schedule([item])
      continue
    for buffer in item.outputs: buffer.allocate()
    results = []
    for optimize in (True, False):
      kernel = Kernel(item.ast, PythonRenderer("CUDA"))
      if optimize: kernel.hand_coded_optimizations()
      fresh = tuple(Buffer("PYTHON", output.size, output.dtype).allocate() for output in item.outputs)
      compile_kernel(kernel, "PYTHON")(fresh + item.inputs)
      results.append([buffer.numpy() for buffer in fresh])
    for optimized, plain in zip(*results): np.testing.assert_allclose(optimized, plain, rtol=1e-5, atol=1e-5)
    run_schedule([item])
  np.testing.assert_allclose(outputs[0].numpy(), data.sum(axis=(0, 2, 3)), rtol=1e-5, atol=1e-4)


def test_split_reduces_on_cuda_match_torch() -> None:
  """On a real GPU, with the real thresholds: MNIST's second batchnorm statistics and weight gradient."""
  skip_unless_device("CUDA")
  data = rng.standard_normal((256, 32, 8, 8)).astype(np.float32)
  x = Tensor(data, device="CUDA")
  assert len(_kernels(x.sum(axis=(0, 2, 3)))) == 2
  np.testing.assert_allclose(x.sum(axis=(0, 2, 3)).numpy(), data.sum(axis=(0, 2, 3)), rtol=1e-4, atol=1e-2)
  np.testing.assert_array_equal(x.max(axis=(0, 2, 3)).numpy(), data.max(axis=(0, 2, 3)))
  images = rng.standard_normal((256, 16, 12, 12)).astype(np.float32)
  weights = rng.standard_normal((32, 16, 5, 5)).astype(np.float32)
  upstream = rng.standard_normal((256, 32, 8, 8)).astype(np.float32)
  w = Tensor(weights, device="CUDA", requires_grad=True)
  (Tensor(images, device="CUDA").conv2d(w) * Tensor(upstream, device="CUDA")).sum().backward()
  tw = torch.tensor(weights, requires_grad=True)
  (torch.nn.functional.conv2d(torch.tensor(images), tw) * torch.tensor(upstream)).sum().backward()
  np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-3, atol=5e-2)  # sums of 16384 products


@pytest.mark.parametrize("shape, width", [((256, 16, 24, 24), 24), ((256, 32, 8, 8), 8), ((256, 16, 24, 26), 24)])
def test_partial_sums_read_neighbouring_elements_in_neighbouring_threads(shape: tuple[int, ...], width: int) -> None:
  """Batchnorm statistics of MNIST's layers (NCHW, summed over N, H and W; the last case a slice of each row, so H
  and W cannot merge into one axis and the GROUP threads span both): in the partial-sums kernel the launch's x
  thread index (the innermost thread axis: neighbouring lanes of a warp) walks the contiguous W axis, so a warp's
  loads coalesce."""
  x = Tensor.empty(*shape, device="PYTHON")[..., :width]
  first = _kernels(x.sum(axis=(0, 2, 3)))[0]
  kernel = Kernel(first.ast, PythonRenderer("CUDA"))
  kernel.hand_coded_optimizations()
  assert kernel.group_dims >= 1
  launch_x = kernel.thread_axes()[-1]
  assert kernel.sts[1].real_strides()[launch_x] == 1
  if width != shape[3]: assert kernel.group_dims == 2 and kernel.full_shape[launch_x] == width
