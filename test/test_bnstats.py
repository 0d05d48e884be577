"""BatchNorm statistics on GPUs: the per-channel sums over N, H, W of a batchnorm's input (the mean's sum, the
variance's sum of squares, the backward's sums of products) and the choices that make them fast on a GPU: the split
into about a wave of blocks (codegen/opt/split_reduce.py `gpu_split_parts`), GROUP threads from up to three reduce
axes in powers of two (warp shuffles) with neighbouring lanes on neighbouring elements, and the short loop left in each
thread unrolled (codegen/opt/heuristic.py `_group_reduce`).

Every kernel optimized under CUDA's limits (`PythonRenderer("CUDA")`, interpreted by the PYTHON device) is checked
against its plain (NOOPT) version on random inputs, and BatchNorm2d's forward and backward against PyTorch.
"""
from __future__ import annotations

import contextlib
import pathlib
import random
import sys

import numpy as np
import pytest
import torch

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel, KernelOptError, Opt, OptOps
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.opt.heuristic import WARP_SIZE
from ourgrad.codegen.uops import UOps
from ourgrad.device import Buffer, Device
from ourgrad.engine import multi_output
from ourgrad.engine.realize import compile_kernel, run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.nn import BatchNorm2d
from ourgrad.nn.batchnorm import batch_statistics, stored_statistics
from ourgrad.ops import REDUCE_OPS, Ops
from ourgrad.runtime.ops_python import PythonRenderer
from helpers import skip_unless_device

rng = np.random.default_rng(11)


@pytest.fixture(autouse=True)
def _two_kernel_splits(monkeypatch: pytest.MonkeyPatch) -> None:
  """These tests look at each stage of a split reduce: two kernels even where the device has atomics (EMULATE=CUDA;
  test_last_block.py covers the one-kernel form)."""
  monkeypatch.setenv("SPLIT_LAST_BLOCK", "0")


def _kernel_items(*tensors: Tensor) -> list:
  return [item for item in create_schedule([t.lazydata for t in tensors]) if item.ast.op in (Ops.STORE, Ops.SINK)]


def _cuda_kernel(item) -> Kernel:
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  kernel.hand_coded_optimizations()
  return kernel


def _check_schedule_against_plain(outputs: list[Tensor]) -> list[Kernel]:
  """Run the schedule of `outputs`; each kernel, optimized for CUDA's limits, must give the plain kernel's values.
  Returns the optimized kernels."""
  optimized = []
  for item in create_schedule([t.lazydata for t in outputs]):
    if item.ast.op not in (Ops.STORE, Ops.SINK):
      run_schedule([item])
      continue
    for buffer in item.outputs: buffer.allocate()
    results = []
    for kernel in (_cuda_kernel(item), Kernel(item.ast, PythonRenderer("CUDA"))):
      fresh = tuple(Buffer("PYTHON", output.size, output.dtype).allocate() for output in item.outputs)
      compile_kernel(kernel, "PYTHON")(fresh + item.inputs)
      results.append([buffer.numpy() for buffer in fresh])
      if kernel.applied_opts: optimized.append(kernel)
    for optimized_values, plain_values in zip(*results):
      np.testing.assert_allclose(optimized_values, plain_values, rtol=1e-5, atol=1e-4)
    run_schedule([item])
  return optimized


# ================================================================ the choices, at MNIST's sizes (no kernel runs)

def test_first_batchnorm_is_split_into_about_a_wave_of_blocks() -> None:
  """MNIST's first batchnorm, 16 channels of 256 x 24 x 24: 64 parts of 4 images per channel (1024 blocks, one wave
  of 256-thread blocks on an H100), not 128 parts of 2 images (2 waves of blocks that mostly combine threads)."""
  x = Tensor.empty(256, 16, 24, 24, device="PYTHON")
  partials, total = _kernel_items(x.sum(axis=(0, 2, 3)))
  assert partials.outputs[0].size == 64 * 16
  assert total.outputs[0].size == 16


def test_second_batchnorm_keeps_parts_of_1024() -> None:
  x = Tensor.empty(256, 32, 8, 8, device="PYTHON")
  partials, _ = _kernel_items(x.sum(axis=(0, 2, 3)))
  assert partials.outputs[0].size == 16 * 32


@pytest.mark.parametrize("shape", [(256, 16, 24, 24), (256, 32, 8, 8)])
def test_partial_sums_use_full_power_of_two_blocks_with_coalesced_lanes(shape: tuple[int, ...]) -> None:
  """256 GROUP threads (a power of two: warp shuffles combine them), taken from the image and the images of the
  part (8 x 8 x 4 for an 8x8 image: not 64 threads with a 16-trip loop each), the launch's x along the contiguous
  axis, and the loop left in each thread unrolled."""
  x = Tensor.empty(*shape, device="PYTHON")
  g = Tensor.empty(*shape, device="PYTHON")
  for statistic in (x.sum(axis=(0, 2, 3)), (x * g).sum(axis=(0, 2, 3))):
    kernel = _cuda_kernel(_kernel_items(statistic)[0])
    assert kernel.group_threads() == 256
    assert kernel.group_threads() % WARP_SIZE == 0 and kernel.group_threads() & (kernel.group_threads() - 1) == 0
    launch_x = kernel.thread_axes()[-1]
    assert kernel.sts[1].real_strides()[launch_x] == 1
    assert kernel.first_upcast == kernel.first_loop_reduce or kernel.unroll_axes, "the loop left is unrolled"


def test_unmergeable_image_rows_keep_a_whole_row_on_neighbouring_lanes() -> None:
  """24 of 26 columns (the rows cannot merge): 8 lanes of a power of two would read 32 bytes apart in rows; the
  24 columns stay whole on the launch's x (see test_split_reduce's coalescing test)."""
  x = Tensor.empty(256, 16, 24, 26, device="PYTHON")[..., :24]
  kernel = _cuda_kernel(_kernel_items(x.sum(axis=(0, 2, 3)))[0])
  assert kernel.full_shape[kernel.thread_axes()[-1]] == 24


def test_a_long_row_keeps_its_loop() -> None:
  """Rows of 8192 (a softmax's sum): 256 threads, each a 32-trip loop the compiler pipelines; no unroll added."""
  kernel = _cuda_kernel(_kernel_items(Tensor.empty(64, 8192, device="PYTHON").sum(axis=1))[0])
  assert kernel.group_threads() == 256 and not kernel.unroll_axes


# ================================================================ results

@pytest.mark.parametrize("shape", [(16, 4, 8, 8), (4, 2, 24, 24), (6, 3, 12, 10)])
def test_statistics_kernels_match_plain_and_numpy(shape: tuple[int, ...]) -> None:
  """Sums, sums of squares around the mean and sums of products, each one kernel of 3-axis GROUP threads and an
  unrolled loop under CUDA's limits, equal the plain kernels and numpy."""
  x_np, g_np = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
  x, g = Tensor(x_np, device="PYTHON"), Tensor(g_np, device="PYTHON")
  mean = x.mean(axis=(0, 2, 3), keepdim=True).realize()
  outputs = [x.sum(axis=(0, 2, 3)), (x - mean).square().sum(axis=(0, 2, 3)), (g * (x - mean)).sum(axis=(0, 2, 3))]
  kernels = _check_schedule_against_plain(outputs)
  assert kernels and all(kernel.group_dims >= 1 for kernel in kernels)
  mean_np = x_np.mean(axis=(0, 2, 3), keepdims=True)
  for ours, theirs in zip(outputs, [x_np.sum(axis=(0, 2, 3)), np.square(x_np - mean_np).sum(axis=(0, 2, 3)),
                                    (g_np * (x_np - mean_np)).sum(axis=(0, 2, 3))]):
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-4, atol=1e-3)


def test_unmergeable_rows_match_plain(small_split: None) -> None:
  data = rng.standard_normal((8, 3, 12, 14)).astype(np.float32)
  x = Tensor(data, device="PYTHON")[..., :12]
  outputs = [x.sum(axis=(0, 2, 3)), (x * x).sum(axis=(0, 2, 3))]
  _check_schedule_against_plain(outputs)
  np.testing.assert_allclose(outputs[0].numpy(), data[..., :12].sum(axis=(0, 2, 3)), rtol=1e-4, atol=1e-3)


def test_batchnorm2d_forward_and_backward_match_torch(small_split: None, monkeypatch: pytest.MonkeyPatch) -> None:
  """Training-mode BatchNorm2d, its statistics split (small thresholds): the output, the input's, weight's and bias's
  gradients and the running stats equal PyTorch's."""
  monkeypatch.setenv("DEVICE", "PYTHON")   # the layer's parameters and state are made on the default device
  data = rng.standard_normal((8, 4, 10, 10)).astype(np.float32)
  upstream = rng.standard_normal((8, 4, 10, 10)).astype(np.float32)
  ours = BatchNorm2d(4)
  assert ours.weight.device == "PYTHON"
  x = Tensor(data, device="PYTHON", requires_grad=True)
  ours.weight = Tensor(np.linspace(0.5, 1.5, 4, dtype=np.float32), device="PYTHON", requires_grad=True)
  ours.bias = Tensor(np.linspace(-0.2, 0.3, 4, dtype=np.float32), device="PYTHON", requires_grad=True)
  with Tensor.train():
    out = ours(x)
    (out * Tensor(upstream, device="PYTHON")).sum().backward()
  theirs = torch.nn.BatchNorm2d(4)
  with torch.no_grad():
    theirs.weight.copy_(torch.linspace(0.5, 1.5, 4))
    theirs.bias.copy_(torch.linspace(-0.2, 0.3, 4))
  tx = torch.tensor(data, requires_grad=True)
  tout = theirs(tx)
  (tout * torch.tensor(upstream)).sum().backward()
  np.testing.assert_allclose(out.numpy(), tout.detach().numpy(), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-3, atol=1e-3)
  np.testing.assert_allclose(ours.weight.grad.numpy(), theirs.weight.grad.numpy(), rtol=1e-3, atol=1e-3)
  np.testing.assert_allclose(ours.bias.grad.numpy(), theirs.bias.grad.numpy(), rtol=1e-3, atol=1e-3)
  np.testing.assert_allclose(ours.running_mean.numpy(), theirs.running_mean.numpy(), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(ours.running_var.numpy(), theirs.running_var.numpy(), rtol=1e-4, atol=1e-5)


def test_a_group_of_whole_warps_not_a_power_of_two_shuffles_each_warp() -> None:
  """224 GROUP threads (a 1344-long row: 7 warps): each warp combines its lanes by shuffles, the 7 warp totals by a
  tree in local memory; the sums equal the plain kernel's and numpy's, the max is exact."""
  data = rng.standard_normal((6, 1344)).astype(np.float32)
  x = Tensor(data, device="PYTHON")
  outputs = [x.sum(axis=1), x.max(axis=1)]
  kernels = _check_schedule_against_plain(outputs)
  assert [kernel.group_threads() for kernel in kernels] == [224, 224]
  uops = linearize(kernels[0])
  assert [uop.arg[1:] for uop in uops if uop.op is UOps.WARP_REDUCE] == [(32, 1)]
  assert next(uop.arg[1] for uop in uops if uop.op is UOps.DEFINE_LOCAL) == 7
  np.testing.assert_allclose(outputs[0].numpy(), data.sum(axis=1), rtol=1e-5, atol=1e-4)
  np.testing.assert_array_equal(outputs[1].numpy(), data.max(axis=1))


# ================================================================ one load of the input per element

def _bn_relu_pool_backward(x: Tensor, upstream: Tensor, bn: BatchNorm2d) -> list[Tensor]:
  """MNIST's conv block after the convolution (batchnorm -> relu -> 2x2 max-pool), trained: x's, weight's and bias's
  gradients. The pool's backward reads x through its windows' view, the batchnorm's through x's own view."""
  with Tensor.train():
    (bn(x).relu().max_pool2d() * upstream).sum().backward()
  return [x.grad, bn.weight.grad, bn.bias.grad]


def _global_loads(kernel: Kernel, buffer_number: int) -> int:
  """Elements of the buffer the kernel's LOADs read: a vector LOAD (float4: its arg is the width) counts its width."""
  return sum(uop.arg if isinstance(uop.arg, int) else 1 for uop in linearize(kernel)
             if uop.op is UOps.LOAD and uop.srcs[0].op is UOps.DEFINE_GLOBAL and uop.srcs[0].arg[0] == buffer_number)


def _reads_one_value_per_channel(kernel: Kernel, leaf_number: int, shape: tuple[int, ...]) -> bool:
  """Whether the leaf's view of an (N, C, H, W) input moves only along the channel axis (possibly split by the
  kernel's opts): every stride a multiple of H * W below C * H * W."""
  plane = shape[2] * shape[3]
  strides = [stride for stride in kernel.sts[leaf_number].real_strides() if stride != 0]
  return bool(strides) and all(stride % plane == 0 and stride < shape[1] * plane for stride in strides)


def _lanes_reading(kernel: Kernel, leaf_number: int) -> int:
  """Upcast and unrolled lanes along which the leaf's address changes: its loads when each element is loaded once."""
  strides = kernel.sts[leaf_number].real_strides()
  lanes = [kernel.full_shape[axis] for axis in range(kernel.first_upcast, kernel.shape_len) if strides[axis] != 0]
  return int(np.prod(lanes)) if lanes else 1


@pytest.mark.parametrize("shape", [(256, 16, 24, 24), (256, 32, 8, 8)])
def test_batchnorm_backward_loads_its_input_once(shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
  """The first batchnorm's backward recomputes the normalization and the ReLU, and the pool's backward compares
  them with the pooled maxima: two views of x whose index sums only differ in the order of their terms. Sums have
  one canonical order (shape/symbolic.py), so every kernel reading x loads each element of it once per lane
  (was twice: 16.5 MB instead of 9.4 MB for the (256, 16, 24, 24) one)."""
  monkeypatch.setenv("DEVICE", "PYTHON")
  x = Tensor.empty(*shape, device="PYTHON", requires_grad=True).realize()
  upstream = Tensor.empty(shape[0], shape[1], shape[2] // 2, shape[3] // 2, device="PYTHON").realize()
  grads = _bn_relu_pool_backward(x, upstream, BatchNorm2d(shape[1]))
  readers, two_views = 0, 0
  for item in _kernel_items(*grads):
    numbers = [number for number, buffer in enumerate(item.bufs) if buffer is x.lazydata.base.realized]
    if not numbers: continue
    kernel = _cuda_kernel(item)
    views = [index for index, leaf in enumerate(kernel.leaves) if leaf.op is Ops.LOAD and leaf.arg.idx == numbers[0]]
    # the statistics' shift (x[0, c, 0, 0], nn/batchnorm.py) is one load per thread, the same for all its lanes
    shifts = [view for view in views if _reads_one_value_per_channel(kernel, view, shape)]
    # the statistics' second stage (mean and inverse std, engine/multi_output.py) reads x only for the shift
    elements = max((_lanes_reading(kernel, view) for view in views if view not in shifts), default=0)
    distinct_shifts = {kernel.sts[view].real_strides(): view for view in shifts}.values()   # loaded once each
    shift_loads = sum(_lanes_reading(kernel, view) for view in distinct_shifts)
    assert _global_loads(kernel, numbers[0]) == elements + shift_loads, kernel.name
    readers, two_views = readers + (elements > 0), two_views + (len(views) - len(shifts) >= 2)
  assert readers >= 3, "the statistics, the backward's sums and the input's gradient all read x"
  assert two_views >= 2, "the backward's sums and the input's gradient read x through two views"


def test_batchnorm_relu_pool_backward_matches_plain_and_torch(small_split: None,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
  """The same block on random data: each kernel (CUDA's limits) equals its plain version, the gradients PyTorch's."""
  monkeypatch.setenv("DEVICE", "PYTHON")
  data = rng.standard_normal((8, 4, 12, 12)).astype(np.float32)
  upstream = rng.standard_normal((8, 4, 6, 6)).astype(np.float32)
  x = Tensor(data, device="PYTHON", requires_grad=True)
  grads = _bn_relu_pool_backward(x, Tensor(upstream, device="PYTHON"), BatchNorm2d(4))
  _check_schedule_against_plain(grads)
  tx = torch.tensor(data, requires_grad=True)
  theirs = torch.nn.BatchNorm2d(4)
  (torch.nn.functional.max_pool2d(theirs(tx).relu(), 2) * torch.tensor(upstream)).sum().backward()
  for ours, reference in zip(grads, (tx.grad, theirs.weight.grad, theirs.bias.grad)):
    np.testing.assert_allclose(ours.numpy(), reference.numpy(), rtol=1e-3, atol=1e-3)


# ================================================================ sibling reduces: several sums in one pass

def _sibling_items(schedule: list) -> list:
  return [item for item in schedule if item.ast.op is Ops.SINK and Kernel(item.ast, PythonRenderer("CUDA")).reduceops]


@pytest.mark.parametrize("shape", [(256, 16, 24, 24), (256, 32, 8, 8)])
def test_batchnorm_backward_sums_share_one_pass(shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
  """The forward's partial sums over x (of x - s and of its square, nn/batchnorm.py) are one kernel of two outputs,
  and so are the backward's (the bias's sum of the gradient, the weight's of the gradient times the normalized x, from
  which the input's gradient follows elementwise), x loaded once for both (test_batchnorm_backward_loads_its_input_once
  counts the loads). Autograd through the mean and the variance needed four sums in backward, one after the three
  others, and the forward's variance waited on the mean."""
  monkeypatch.setenv("DEVICE", "PYTHON")
  x = Tensor.empty(*shape, device="PYTHON", requires_grad=True).realize()
  upstream = Tensor.empty(shape[0], shape[1], shape[2] // 2, shape[3] // 2, device="PYTHON").realize()
  schedule = _kernel_items(*_bn_relu_pool_backward(x, upstream, BatchNorm2d(shape[1])))
  parts_shape = next(item.outputs[0].size for item in _sibling_items(schedule))
  partial_sums = [item for item in schedule if item.outputs[0].size == parts_shape
                  and any(buffer is x.lazydata.base.realized for buffer in item.inputs)]
  assert sorted(len(item.outputs) for item in partial_sums) == [2, 2]
  for item in _sibling_items(schedule):
    kernel = _cuda_kernel(item)
    assert kernel.sibling_reduces and len(kernel.reduceops) == 2
    if item in partial_sums: assert kernel.group_threads() >= WARP_SIZE
  # the forward's second stage: both sums over the parts, and the mean and inverse std stored from them
  second_stage = [item for item in _sibling_items(schedule) if item not in partial_sums]
  assert [len(item.outputs) for item in second_stage] == [2]


def test_sibling_reduces_match_plain_numpy_and_the_cpu_loop(small_split: None) -> None:
  """Sums over x of x, x*g and x*x (GROUP threads and upcasts under CUDA's limits) equal the plain kernel and numpy;
  the same AST linearized for a device without threads (the CPU's loop nest, here CLANG) gives the same values."""
  x_np, g_np = (rng.standard_normal((12, 5, 10, 8)).astype(np.float32) for _ in range(2))
  x, g = Tensor(x_np, device="PYTHON"), Tensor(g_np, device="PYTHON")
  outputs = [x.sum(axis=(0, 2, 3)), (x * g).sum(axis=(0, 2, 3)), (x * x).sum(axis=(0, 2, 3))]
  schedule = create_schedule([t.lazydata for t in outputs])
  siblings = _sibling_items(schedule)
  assert [len(item.outputs) for item in siblings] == [3]
  for item in schedule:
    if item in siblings:   # on the CPU's loop nest: each input copied to CLANG, each output compared
      for buffer in item.outputs: buffer.allocate()
      inputs = tuple(Buffer("CLANG", b.size, b.dtype).allocate().copyin(memoryview(b.numpy())) for b in item.inputs)
      cpu_outputs = tuple(Buffer("CLANG", b.size, b.dtype).allocate() for b in item.outputs)
      kernel = Kernel(item.ast, Device["CLANG"].renderer)
      kernel.hand_coded_optimizations()
      compile_kernel(kernel, "CLANG")(cpu_outputs + inputs)
      run_schedule([item])
      for cpu, ours in zip(cpu_outputs, item.outputs):
        np.testing.assert_allclose(cpu.numpy(), ours.numpy(), rtol=1e-5, atol=1e-4)   # another order of the adds
    else: run_schedule([item])
  for ours, theirs in zip(outputs, (x_np.sum(axis=(0, 2, 3)), (x_np * g_np).sum(axis=(0, 2, 3)),
                                    np.square(x_np).sum(axis=(0, 2, 3)))):
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-4, atol=1e-3)
  x2, g2 = Tensor(x_np, device="PYTHON"), Tensor(g_np, device="PYTHON")
  kernels = _check_schedule_against_plain([x2.sum(axis=(0, 2, 3)), (x2 * g2).sum(axis=(0, 2, 3)),
                                           (x2 * x2).sum(axis=(0, 2, 3))])
  assert any(kernel.sibling_reduces and kernel.group_dims for kernel in kernels)


def test_combined_sibling_reduces_on_the_cpu_loop_match_numpy() -> None:
  """A kernel whose outputs combine sibling sums (a variance from the sum and the sum of squares, a mean), built for
  a GPU, linearized for a device without threads (CLANG's loop nest, its hand-coded opts) gives numpy's values."""
  x_np = rng.standard_normal((12, 5, 10, 8)).astype(np.float32)
  x = Tensor(x_np, device="PYTHON").realize()
  mean = x.sum(axis=(0, 2, 3)) / 960
  schedule = create_schedule([t.lazydata for t in ((x * x).sum(axis=(0, 2, 3)) / 960 - mean.square(), mean + 1)])
  [item] = [item for item in schedule if item.ast.op is Ops.SINK]
  kernel = Kernel(item.ast, Device["CLANG"].renderer)
  kernel.hand_coded_optimizations()
  assert kernel.sibling_reduces and len(kernel.reduceops) == 2
  inputs = tuple(Buffer("CLANG", b.size, b.dtype).allocate().copyin(memoryview(x_np.reshape(-1))) for b in item.inputs)
  outputs = tuple(Buffer("CLANG", b.size, b.dtype).allocate() for b in item.outputs)
  compile_kernel(kernel, "CLANG")(outputs + inputs)
  np.testing.assert_allclose(outputs[0].numpy(), x_np.var(axis=(0, 2, 3)), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(outputs[1].numpy(), x_np.mean(axis=(0, 2, 3)) + 1, rtol=1e-5, atol=1e-6)


def test_only_independent_reduces_over_a_common_input_share_a_kernel(small_split: None) -> None:
  """A variance's sum needs the mean's (through another kernel): apart. Sums of two unrelated tensors: apart (one
  loop gains nothing). A max beside a sum, or a sum over other axes: apart (one op and one set of axes per kernel).
  On the CPU nothing is grouped."""
  x, y = Tensor.empty(12, 5, 10, 8, device="PYTHON"), Tensor.empty(12, 5, 10, 8, device="PYTHON")
  mean = x.mean(axis=(0, 2, 3), keepdim=True)
  for outputs in ([(x - mean).square().sum(axis=(0, 2, 3))],   # both sums' parts read x; the second needs the first
                  [x.sum(axis=(0, 2, 3)), y.sum(axis=(0, 2, 3))],
                  [x.sum(axis=(0, 2, 3)), x.max(axis=(0, 2, 3))],
                  [x.sum(axis=(0, 2, 3)), (x * x).sum(axis=(0, 1, 3))]):
    assert not _sibling_items(create_schedule([t.lazydata for t in outputs]))
  cpu = Tensor.empty(12, 5, 10, 8, device="CLANG")
  assert all(item.ast.op is not Ops.SINK for item in create_schedule([cpu.sum(axis=(0, 2, 3)).lazydata,
                                                                     (cpu * cpu).sum(axis=(0, 2, 3)).lazydata]))


@pytest.mark.parametrize("shape, axes, combined", [((12, 5, 10, 8), (0, 2, 3), False), ((16, 24), (1,), False),
                                                    ((4, 6, 7, 9), (0, 2, 3), False), ((12, 5, 10, 8), (0, 2, 3), True),
                                                    ((4, 6, 7, 9), (0, 2, 3), True)])
def test_random_opts_on_sibling_reduces_match_plain(shape: tuple[int, ...], axes: tuple[int, ...], combined: bool,
                                                    small_split: None) -> None:
  """The opt fuzzer's random Opt sequences (UPCAST, UNROLL, LOCAL, GROUP, GROUPTOP, PADTO; test/fuzz/fuzz_opts.py,
  whose graphs have one output and so no sibling reduces) applied to kernels of three sibling sums under CUDA's
  limits, or (combined) of three sums whose two outputs are elementwise work on several of them (a variance-like
  output and a mean's): every output equals the plain kernel's."""
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "fuzz"))
  try: from fuzz_opts import random_opt
  finally: sys.path.pop(0)
  x, g = (Tensor(rng.standard_normal(shape).astype(np.float32), device="PYTHON") for _ in range(2))
  if combined:
    mean = x.sum(axis=axes) / 7
    sums = ((x * x).sum(axis=axes) / 7 - mean.square() + (x * g).sum(axis=axes), mean * 2)
  else:
    sums = (x.sum(axis=axes), (x * g).sum(axis=axes), (x * x + g).sum(axis=axes))
  schedule = create_schedule([t.lazydata for t in sums])
  siblings = _sibling_items(schedule)
  assert siblings
  if combined: assert any(len(Kernel(item.ast, PythonRenderer("CUDA")).reduceops) == 3 for item in siblings)
  choices = random.Random(7)
  for item in schedule:
    if item not in siblings:
      run_schedule([item])
      continue
    for buffer in item.outputs: buffer.allocate()
    results = []
    for trial in range(13):
      kernel = Kernel(item.ast, PythonRenderer("CUDA"))
      for _ in range(choices.randint(1, 6) if trial else 0):   # trial 0: the plain kernel
        with contextlib.suppress(KernelOptError): kernel.apply_opt(random_opt(choices, kernel))
      fresh = tuple(Buffer("PYTHON", output.size, output.dtype).allocate() for output in item.outputs)
      compile_kernel(kernel, "PYTHON")(fresh + item.inputs)
      results.append(([buffer.numpy() for buffer in fresh], kernel.applied_opts))
    assert sum(bool(opts) for _, opts in results) >= 6, "most random sequences apply some opt"
    for values, opts in results[1:]:
      for got, plain in zip(values, results[0][0]):
        np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-4, err_msg=str(opts))
    run_schedule([item])


def test_matmuls_of_one_input_stay_apart_and_sibling_kernels_refuse_matmul_tiles(small_split: None) -> None:
  """q, k and v projections of one input are three matmuls (each keeps its tensor-core or shared-memory tiles), not
  sibling reduces; TC and SHARED, which tile one matmul-like reduce, refuse a kernel of siblings (KernelOptError)."""
  x = Tensor.empty(128, 384, device="PYTHON")
  projections = [x @ Tensor.empty(384, 384, device="PYTHON") for _ in range(3)]
  assert [len(item.outputs) for item in create_schedule([t.lazydata for t in projections])] == [1, 1, 1]
  a, b = Tensor.empty(12, 5, 10, 8, device="PYTHON"), Tensor.empty(12, 5, 10, 8, device="PYTHON")
  siblings = _sibling_items(create_schedule([a.sum(axis=(0, 2, 3)).lazydata, (a * b).sum(axis=(0, 2, 3)).lazydata]))
  for opt in (Opt(OptOps.TC, 0, 0), Opt(OptOps.SHARED, 0, 0)):
    with pytest.raises(KernelOptError, match="one matmul-like reduce"):
      Kernel(siblings[0].ast, PythonRenderer("CUDA")).apply_opt(opt)


@pytest.mark.parametrize("shape", [(256, 16, 24, 24), (256, 32, 8, 8)])
def test_batchnorm_block_backward_on_cuda_matches_torch(shape: tuple[int, ...],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
  """On a real GPU, MNIST's sizes and thresholds: batchnorm -> ReLU -> max-pool's gradients (the sibling-reduce
  kernel of the backward's sums among them) equal PyTorch's."""
  skip_unless_device("CUDA")
  monkeypatch.setenv("DEVICE", "CUDA")
  data = rng.standard_normal(shape).astype(np.float32)
  upstream = rng.standard_normal((shape[0], shape[1], shape[2] // 2, shape[3] // 2)).astype(np.float32)
  x = Tensor(data, device="CUDA", requires_grad=True)
  grads = _bn_relu_pool_backward(x, Tensor(upstream, device="CUDA"), BatchNorm2d(shape[1]))
  tx = torch.tensor(data, requires_grad=True)
  theirs = torch.nn.BatchNorm2d(shape[1])
  (torch.nn.functional.max_pool2d(theirs(tx).relu(), 2) * torch.tensor(upstream)).sum().backward()
  for ours, reference in zip(grads, (tx.grad, theirs.weight.grad, theirs.bias.grad)):
    np.testing.assert_allclose(ours.numpy(), reference.numpy(), rtol=1e-3, atol=2e-2)   # sums of ~150,000 values


# ================================================================ the forward's second stage: one kernel from both sums

def _batchnorm_forward(data: np.ndarray) -> tuple[list[Tensor], BatchNorm2d]:
  layer = BatchNorm2d(data.shape[1])
  x = Tensor(data, device="PYTHON")
  with Tensor.train():
    out = layer(x)
  return [out, layer.running_mean, layer.running_var], layer


def test_batchnorm_forward_second_stage_is_one_kernel_bit_identical_and_matches_torch(
    small_split: None, monkeypatch: pytest.MonkeyPatch) -> None:
  """The forward's second stage sums both partial sums over the parts and stores the mean, the inverse std and the
  running variance from them: one kernel of sibling reduces (engine/multi_output.py), each of its kernels equal to
  its plain version under CUDA's limits. The results are bit for bit those of the schedule that stores the mean's sum
  first (COMBINED_SIBLING_REDUCES off: the same sums, one more launch), and PyTorch's."""
  monkeypatch.setenv("DEVICE", "PYTHON")   # the layer's parameters and state are made on the default device
  data = (rng.standard_normal((8, 4, 10, 10)) * 3 + 20).astype(np.float32)
  results, launches = {}, {}
  for combined in (True, False):
    monkeypatch.setattr(multi_output, "COMBINED_SIBLING_REDUCES", combined)
    outputs, _ = _batchnorm_forward(data)
    schedule = create_schedule([t.lazydata for t in outputs])   # scheduling gives the buffers: a graph of its own
    launches[combined] = sum(item.ast.op in (Ops.STORE, Ops.SINK, Ops.PACK) for item in schedule)
    both_sums = [item for item in _sibling_items(schedule) if all(out.size == 4 for out in item.outputs)
                 and sum(node.op in REDUCE_OPS for node in item.ast.walk()) == 2]
    assert len(both_sums) == combined
    outputs, _ = _batchnorm_forward(data)
    _check_schedule_against_plain(outputs)
    results[combined] = [t.numpy() for t in outputs]
  assert launches[True] == launches[False] - 1
  for ours, before in zip(results[True], results[False]): np.testing.assert_array_equal(ours, before)
  theirs = torch.nn.BatchNorm2d(4)
  expected = theirs(torch.tensor(data)).detach().numpy()
  np.testing.assert_allclose(results[True][0], expected, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(results[True][1], theirs.running_mean.numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(results[True][2], theirs.running_var.numpy(), rtol=1e-5, atol=1e-5)


def test_batch_statistics_in_float64_from_one_second_stage_match_torch(small_split: None) -> None:
  """mean and inverse std in float64 (a mean far from 0: the shifted sums keep the digits), stored by one kernel."""
  data = rng.standard_normal((6, 3, 8, 8)) * 0.1 + 1e3
  x = Tensor(data, device="PYTHON")
  mean, variance = batch_statistics(x)
  mean, invstd = stored_statistics(mean, (variance + 1e-5).rsqrt())
  schedule = create_schedule([mean.lazydata, invstd.lazydata])
  assert [len(item.outputs) for item in _sibling_items(schedule)] == [2, 2]   # the partial sums, the second stage
  run_schedule(schedule)
  reference = torch.tensor(data)
  expected_var, expected_mean = torch.var_mean(reference, dim=(0, 2, 3), unbiased=False)
  np.testing.assert_allclose(mean.numpy(), expected_mean.numpy(), rtol=1e-12)
  np.testing.assert_allclose(invstd.numpy(), (expected_var + 1e-5).rsqrt().numpy(), rtol=1e-9)


@pytest.mark.parametrize("seed", range(2))
def test_max_pool_backward_after_a_realized_forward_on_the_gpu_path(seed: int, small_split: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
  """batchnorm -> relu -> max-pool, the forward realized before the backward is built, on the GPU path: the pool's
  backward recomputes its input and compares it with the forward's maxima for equality, so forward and backward
  must normalize with the same stored mean and inverse std (nn/batchnorm.py stored_statistics; recomputed through
  different fused graphs, FMA contraction differing, a window could miss its maximum: 0 / 0). The interpreter
  rounds alike in every kernel, so the check is on the buffers: the backward reads the mean and inverse std that the
  forward's second stage stored and never the partial sums they came from. The gradients are PyTorch's."""
  monkeypatch.setenv("DEVICE", "PYTHON")
  seeded = np.random.default_rng(40 + seed)
  data = (seeded.standard_normal((4, 3, 8, 8)) * 2 + 1).astype(np.float32)
  upstream = seeded.standard_normal((4, 3, 4, 4)).astype(np.float32)
  layer = BatchNorm2d(3)
  x = Tensor(data, device="PYTHON", requires_grad=True)
  with Tensor.train():
    loss = (layer(x).relu().max_pool2d(2) * Tensor(upstream, device="PYTHON")).sum()
  forward = create_schedule([loss.lazydata])   # the forward runs in a schedule of its own
  second_stage = next(item for item in _sibling_items(forward) if all(out.size == 3 for out in item.outputs))
  partial_sums = {id(buffer) for buffer in second_stage.inputs if buffer.size > 3 and buffer.size != x.numel()}
  run_schedule(forward)
  forward_value = loss.numpy()
  loss.backward()
  backward = create_schedule([t.lazydata for t in (x.grad, layer.weight.grad, layer.bias.grad)])
  stored = {id(buffer) for buffer in second_stage.outputs}
  assert any(stored <= {id(buffer) for buffer in item.inputs} for item in backward)
  assert not any(id(buffer) in partial_sums for item in backward for buffer in item.inputs)
  run_schedule(backward)
  tx = torch.tensor(data, requires_grad=True)
  theirs = torch.nn.BatchNorm2d(3)
  reference = (torch.nn.functional.max_pool2d(theirs(tx).relu(), 2) * torch.tensor(upstream)).sum()
  reference.backward()
  np.testing.assert_allclose(forward_value, reference.item(), rtol=1e-4, atol=1e-4)
  for ours, expected in zip((x.grad, layer.weight.grad, layer.bias.grad), (tx.grad, theirs.weight.grad,
                                                                          theirs.bias.grad)):
    assert np.isfinite(ours.numpy()).all()
    np.testing.assert_allclose(ours.numpy(), expected.numpy(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("shape", [(256, 16, 24, 24), (256, 32, 8, 8)])
def test_batchnorm_forward_on_cuda_matches_torch(shape: tuple[int, ...], monkeypatch: pytest.MonkeyPatch) -> None:
  """On a real GPU, MNIST's sizes and thresholds: the training forward (partial sums, then one kernel of both second
  stages storing the mean, inverse std and running variance) gives PyTorch's output and running statistics."""
  skip_unless_device("CUDA")
  monkeypatch.setenv("DEVICE", "CUDA")
  data = (rng.standard_normal(shape) * 2 + 3).astype(np.float32)
  layer = BatchNorm2d(shape[1])
  with Tensor.train():
    out = layer(Tensor(data, device="CUDA"))
  Tensor.realize_all(out, layer.running_mean, layer.running_var)
  theirs = torch.nn.BatchNorm2d(shape[1])
  expected = theirs(torch.tensor(data)).detach().numpy()
  np.testing.assert_allclose(out.numpy(), expected, rtol=1e-3, atol=1e-3)
  np.testing.assert_allclose(layer.running_mean.numpy(), theirs.running_mean.numpy(), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(layer.running_var.numpy(), theirs.running_var.numpy(), rtol=1e-4, atol=1e-4)
