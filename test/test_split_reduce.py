"""Split-K on GPUs: a reduce with few outputs and long rows (a convolution's weight gradient, batchnorm statistics)
runs as two kernels, partial sums over pieces of the reduce and then a reduce over the pieces
(codegen/opt/split_reduce.py, from the device's multiprocessors), so the first kernel has enough blocks to fill the
GPU: GPT-2's bias and LayerNorm gradients, batchnorm statistics, convolution weight gradients.

The PYTHON device has thread blocks and local memory (a GPU renderer), so the split applies there; CLANG keeps one
kernel. Results are checked against numpy and PyTorch, and every kernel of a split reduce, optimized for CUDA's
limits (`EMULATE=CUDA`'s renderer), against its plain (NOOPT) version on random inputs.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

from ourgrad import Tensor, lazy_reduce
from ourgrad.codegen.kernel import Kernel, OptOps
from ourgrad.codegen.last_block import SplitReduceKernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.opt import split_reduce
from ourgrad.codegen.opt.heuristic import register_tiles_pay_off, threads_in_flight_wanted
from ourgrad.engine.realize import compile_kernel, run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.device import Buffer, Device
from ourgrad.helpers import SPLIT_LAST_BLOCK, prod
from ourgrad.ops import Ops
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer
from helpers import nvrtc_compiler, skip_unless_device

rng = np.random.default_rng(10)


def _kernels(*tensors: Tensor) -> list:
  kernels = (Ops.STORE, Ops.SPLIT_REDUCE)
  return [item for item in create_schedule([t.lazydata for t in tensors]) if item.ast.op in kernels]


def _split_kernels(device: str = "PYTHON", dtype: type = np.float32) -> int:
  """Kernels of a float32 split reduce on `device`: one where it has atomics and SPLIT_LAST_BLOCK is on (the last
  block sums the partials: codegen/last_block.py), else two."""
  one_kernel = Device[device].renderer.has_block_atomics and SPLIT_LAST_BLOCK.value and dtype == np.float32
  return 1 if one_kernel else 2


@pytest.fixture
def two_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
  """Split reduces as two kernels on every device (the tests that look at each stage's kernel)."""
  monkeypatch.setenv("SPLIT_LAST_BLOCK", "0")


# ================================================================ when the split applies (kernel counts)

def test_batchnorm_statistics_split_in_two_kernels_on_a_gpu(two_kernels: None) -> None:
  """MNIST's second batchnorm: 32 channels of 256 x 8 x 8 values: 16 parts (of 16 images, 1024 values) per
  channel, then the parts."""
  x = Tensor.empty(256, 32, 8, 8, device="PYTHON")
  kernels = _kernels(x.sum(axis=(0, 2, 3)))
  assert len(kernels) == 2
  assert kernels[0].outputs[0].size == 16 * 32   # partial sums: 16 parts x 32 channels
  assert kernels[1].outputs[0].size == 32


def test_weight_gradient_splits_its_batch_on_a_gpu(two_kernels: None) -> None:
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


def test_split_partials_put_the_parts_outermost(two_kernels: None) -> None:
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
  # one kernel where the device has atomics and the partials' layout lets a last block finish them
  assert split in (2, _split_kernels()), f"{shape} over {axes} is split with the small thresholds"
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


# the H200's facts as its CUDA device reads them (bench_fewout_h200_s9.txt: a launch worth 7.2 MB; 0.6 us latency)
H200_FACTS = split_reduce.SplitFacts(132, 2048, 7_200_000, 2_880_000)


def _batchnorm_statistics_backward(device: str, shape: tuple[int, ...] = (256, 32, 8, 8)) -> Tensor:
  """The gradient of MNIST's second batchnorm (training statistics over N, H and W), then ReLU and a 2x2 max-pool:
  its backward sums dy and dy * x_hat per channel, each value read from six buffers (features, mean, rstd, the pooled
  output and the two gradients the max-pool backward picks from)."""
  features = Tensor.empty(*shape, device=device, requires_grad=True)
  mean = features.mean(axis=(0, 2, 3), keepdim=True)
  variance = ((features - mean) ** 2).mean(axis=(0, 2, 3), keepdim=True)
  normalized = ((features - mean) * (variance + 1e-5).rsqrt()).relu()
  (normalized.max_pool2d(2) * Tensor.empty(shape[0], shape[1], shape[2] // 2, shape[3] // 2, device=device)).sum() \
    .backward()
  return features.grad


def _split_plans(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], int, split_reduce.ReduceSplit | None]]:
  """Records each split decision the lazy layer asks for: (shape, loads per element, the plan)."""
  plans: list = []
  decide = lazy_reduce.plan_split
  def recorded(renderer, shape, axes, kind, itemsize, loads_per_element=1):  # noqa: ANN001, ANN202
    plan = decide(renderer, shape, axes, kind, itemsize, loads_per_element)
    # (the lazy layer passes the count as a function, asked only where the cheap checks leave a split open)
    plans.append((shape, loads_per_element() if callable(loads_per_element) else loads_per_element, plan))
    return plan
  monkeypatch.setattr(lazy_reduce, "plan_split", recorded)
  lazy_reduce._PLANS.clear()   # (remembered decisions would not ask it: lazy_reduce.reduce_plan)
  return plans


@pytest.mark.parametrize("facts", ["H200", "emulated CUDA"])
def test_batchnorm_statistics_backward_splits_with_cuda_facts(monkeypatch: pytest.MonkeyPatch, facts: str) -> None:
  """MNIST's bn2 statistics backward (32 channels of 256 x 8 x 8 values, six loads a value): one kernel is 32 blocks
  whose threads wait a memory latency per loop iteration (H200, session 9: 42 us, 1.5 GB/s a block, not its SM share
  of 32 GB/s); split in 16 parts it filled the GPU (4 us). The split's model counts the latencies
  (split_reduce.stream_cost), so it splits with the H200's facts and the emulated CUDA renderer's."""
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", H200_FACTS if facts == "H200" else
                      split_reduce.SplitFacts.of(PythonRenderer("CUDA")))
  plans = _split_plans(monkeypatch)
  _kernels(_batchnorm_statistics_backward("PYTHON"))
  # the backward's two sums per channel (dy and dy * x_hat, through the max-pool's choice): 4 and 6 loads a value
  backward = [(loads, plan) for shape, loads, plan in plans if shape == (256, 32, 8, 8) and loads >= 4]
  assert len(backward) >= 2 and all(plan is not None and plan.parts == 16 for _, plan in backward), plans


def test_plain_batchnorm_statistics_stay_one_kernel_with_h200_facts(monkeypatch: pytest.MonkeyPatch) -> None:
  """A plain sum of the same shape (one load a value: the compiler keeps ~16 iterations in flight) streams about its
  blocks' SM share: 4 us as one kernel on the H200, what two kernels would take with the launch."""
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", H200_FACTS)
  assert len(_kernels(Tensor.empty(256, 32, 8, 8, device="PYTHON").sum(axis=(0, 2, 3)))) == 1


@pytest.mark.parametrize("loads, parts", [(1, None), (2, 16), (6, 16), (16, 16)])
def test_more_loads_a_value_split_sooner(loads: int, parts: int | None) -> None:
  """gpu_split_parts for 32 outputs of 16,384 float32 values (ROWS) with the H200's facts: the loads each value takes
  decide the iterations a thread has in flight (LOADS_IN_FLIGHT / loads), so one kernel's latency-bound time."""
  assert split_reduce.gpu_split_parts(H200_FACTS, split_reduce.ReduceKind.ROWS, 32, 16384, 256, 4, loads) == parts


def test_classifier_bias_gradient_stays_one_kernel_with_h200_facts() -> None:
  """The MLP's last bias gradient (10 outputs over a batch of 512, 6 loads a value through the softmax backward): the
  heuristic lays it out as 5 blocks of 2 outputs x 128 threads (split_reduce.block_outputs), 4 iterations a thread,
  about what a split's first kernel would take; the second launch would not pay (H100: 3 us as one kernel)."""
  assert split_reduce.block_outputs(split_reduce.ReduceKind.COLUMNS, 10) == 2
  assert split_reduce.gpu_split_parts(H200_FACTS, split_reduce.ReduceKind.COLUMNS, 10, 512, 512, 4, 6) is None
  assert split_reduce.gpu_split_parts(H200_FACTS, split_reduce.ReduceKind.COLUMNS, 768, 4096, 4096, 4, 1) == 32


def test_bias_gradient_partials_layout_on_the_h200(two_kernels: None, monkeypatch: pytest.MonkeyPatch) -> None:
  """A 4096 x 768 column sum (GPT-2's Linear bias gradient) with the H200's 132 SMs: 32 parts, and the partials'
  kernel 768 blocks of 32 lanes (one output each) x 8 GROUPTOP threads, 196,608 threads looping 16 times. Session
  13 measured the alternatives cold on the H200 (extra/bench/sweep_fewout.py): this layout 4.4 us (67% of copy; the
  LayerNorm weight gradient 8.1 us, 74%), a float4 of outputs a lane 5.2-5.4 us (32 or 64 parts), 64 parts 4.6,
  blocks of 512 or 1024 threads 9-19 us; the loop unrolled whole changed nothing (nvcc unrolls it by 4)."""
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", H200_FACTS)
  first, second = _kernels(Tensor.empty(4096, 768, device="PYTHON").sum(axis=0))
  assert first.outputs[0].size == 32 * 768 and second.outputs[0].size == 768
  kernel = Kernel(first.ast, CUDARenderer())
  kernel.hand_coded_optimizations()
  assert [(opt.op, opt.amount) for opt in kernel.applied_opts] == [(OptOps.LOCAL, 32), (OptOps.GROUPTOP, 8)]
  blocks = prod(kernel.full_shape[:kernel.global_dims])
  assert (blocks, kernel.block_threads()) == (768, 256)
  assert blocks * kernel.block_threads() >= H200_FACTS.multiprocessors * 1024
  assert prod(kernel.full_shape[kernel.first_loop_reduce:kernel.first_upcast]) == 16, "iterations a thread"


def test_batchnorm_statistics_split_on_cuda() -> None:
  """On a real GPU, with the real facts (launch_bytes and latency_bytes from the driver): MNIST's second batchnorm
  statistics backward splits."""
  skip_unless_device("CUDA")
  grad = _batchnorm_statistics_backward("CUDA")
  partial_sums = [item for item in _kernels(grad) if item.outputs[0].size == 16 * 32]
  assert partial_sums, "the statistics backward's partial sums: 16 parts x 32 channels"


@pytest.mark.parametrize("shape, width", [((256, 16, 24, 24), 24), ((256, 32, 8, 8), 8), ((256, 16, 24, 26), 24)])
def test_partial_sums_read_neighbouring_elements_in_neighbouring_threads(two_kernels: None, shape: tuple[int, ...],
                                                                        width: int) -> None:
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


# ================================================================ few outputs, long reduces (split_reduce.py)

def _cuda_facts(monkeypatch: pytest.MonkeyPatch) -> split_reduce.SplitFacts:
  """Split as on CUDA (the emulated CUDA renderer's facts: 132 SMs of 2048 threads, its launch_bytes), whether or not
  this run emulates it."""
  facts = split_reduce.SplitFacts.of(PythonRenderer("CUDA"))
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", facts)
  return facts


def _layernorm_weight_gradient(device: str, batch: int = 8) -> Tensor:
  """sum over the tokens of x_hat * dy, x_hat from x and per-token statistics (GPT-2's LayerNorm weight gradient)."""
  x, dy = Tensor.empty(batch, 512, 768, device=device), Tensor.empty(batch, 512, 768, device=device)
  mean, rstd = Tensor.empty(batch, 512, 1, device=device), Tensor.empty(batch, 512, 1, device=device)
  return ((x - mean) * rstd * dy).sum(axis=(0, 1))


GPT2_FEW_OUTPUTS = {
  "bias 4096x768": lambda device: Tensor.empty(4096, 768, device=device).sum(axis=0),
  "bias 4096x3072": lambda device: Tensor.empty(4096, 3072, device=device).sum(axis=0),
  "(8,512,768) over (0,1)": lambda device: Tensor.empty(8, 512, 768, device=device).sum(axis=(0, 1)),
  "layernorm weight": _layernorm_weight_gradient,
  "layernorm weight, batch 2": lambda device: _layernorm_weight_gradient(device, 2),
  "batchnorm (256,32,28,28)": lambda device: Tensor.empty(256, 32, 28, 28, device=device).sum(axis=(0, 2, 3)),
}


@pytest.mark.parametrize("name", list(GPT2_FEW_OUTPUTS))
def test_gpt2_few_output_reduces_split_to_fill_the_gpu(two_kernels: None, monkeypatch: pytest.MonkeyPatch,
                                                      name: str) -> None:
  """GPT-2's bias and LayerNorm gradients (768 or 3072 outputs, each a sum over 4096 tokens) and batchnorm statistics:
  two kernels, the first (the partial sums) with at least a block per multiprocessor (one kernel gave 24 blocks to
  the 768 outputs: ~700 GB/s of the H200's ~4 TB/s), the second summing the parts into the outputs."""
  facts = _cuda_facts(monkeypatch)
  out = GPT2_FEW_OUTPUTS[name]("PYTHON")
  kernels = _kernels(out)
  assert len(kernels) == 2
  first = Kernel(kernels[0].ast, PythonRenderer("CUDA"))
  first.hand_coded_optimizations()
  assert prod(first.full_shape[:first.global_dims]) >= facts.multiprocessors, first.name
  assert not any(opt.op is OptOps.UPCAST for opt in first.applied_opts), "a plain reduce: no register tiles"
  assert kernels[1].outputs[0].size == out.numel()


def test_layernorm_backward_kernels_multiply_by_the_stored_rsqrt(monkeypatch: pytest.MonkeyPatch) -> None:
  """GPT-2's LayerNorm (8 x 512 x 768), forward and backward: only the row kernel computing the per-token rsqrt holds
  a reciprocal; the kernels of the backward (the weight and bias gradients' partial sums, the input gradient) read
  it and multiply. Tensor.rsqrt's gradient comes from its result (function.Rsqrt): as 1 / sqrt, the backward read
  sqrt(var + eps) and divided by it per element, 3 us more for the LayerNorm gradients' partial sums on the H200."""
  _cuda_facts(monkeypatch)
  x = Tensor.empty(8, 512, 768, device="PYTHON", requires_grad=True)
  weight, bias = Tensor.empty(768, device="PYTHON", requires_grad=True), Tensor.empty(768, device="PYTHON",
                                                                                      requires_grad=True)
  y = x.layernorm(-1) * weight + bias
  (y * Tensor.empty(8, 512, 768, device="PYTHON")).sum().backward()
  schedule = create_schedule([y.lazydata, weight.grad.lazydata, bias.grad.lazydata, x.grad.lazydata])
  kernels = [item for item in schedule if item.ast.op in (Ops.STORE, Ops.SINK)]
  dividing = [[buffer.size for buffer in item.outputs] for item in kernels
              if any(node.op is Ops.RECIP for node in item.ast.walk())]
  assert dividing == [[4096]], dividing


def test_gpt2_few_output_kernels_compile_with_nvrtc(monkeypatch: pytest.MonkeyPatch) -> None:
  """Every kernel of the split GPT-2 reduces, optimized for CUDA, compiles with NVRTC for sm_90 (skips without it),
  the LayerNorm weight and bias gradients' partial sums as one kernel of sibling reduces included."""
  compiler = nvrtc_compiler()
  if compiler is None: pytest.skip("no NVRTC here")
  _cuda_facts(monkeypatch)
  x, dy = Tensor.empty(8, 512, 768, device="PYTHON"), Tensor.empty(8, 512, 768, device="PYTHON")
  mean, rstd = Tensor.empty(8, 512, 1, device="PYTHON"), Tensor.empty(8, 512, 1, device="PYTHON")
  siblings = [((x - mean) * rstd * dy).sum(axis=(0, 1)), dy.sum(axis=(0, 1))]
  builds = [[build("PYTHON")] for build in GPT2_FEW_OUTPUTS.values()] + [siblings]
  def kernels(outputs: list[Tensor]) -> list:   # a kernel of several outputs is a SINK of their stores
    return [item for item in create_schedule([t.lazydata for t in outputs]) if item.ast.op in (Ops.STORE, Ops.SINK,
                                                                                                   Ops.SPLIT_REDUCE)]
  assert any(len(item.outputs) == 2 for item in kernels(siblings)), "the partial sums: one kernel, two outputs"
  for outputs in builds:
    for item in kernels(outputs):
      one_kernel = item.ast.op is Ops.SPLIT_REDUCE   # on an emulated CUDA (atomics): codegen/last_block.py
      kernel = (SplitReduceKernel if one_kernel else Kernel)(item.ast, CUDARenderer())
      kernel.hand_coded_optimizations()
      compiler.compile(CUDARenderer().render(kernel.name, kernel.linearize() if one_kernel else linearize(kernel)))


@pytest.mark.parametrize("name", list(GPT2_FEW_OUTPUTS))
def test_gpt2_few_output_reduces_on_clang_as_before(name: str) -> None:
  """CPUs split only huge reduces, for their cores (split_reduce.cpu_split_parts, unchanged): GPT-2's sums over
  4096 tokens stay one kernel; batchnorm statistics (200704 values per channel) split in two."""
  assert len(_kernels(GPT2_FEW_OUTPUTS[name]("CLANG"))) == (2 if name.startswith("batchnorm") else 1)


def test_reduces_saving_less_than_a_launch_stay_one_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
  """A full sum of 4096 floats (16 KB, one block) would gain less from all the multiprocessors than a second launch
  costs; 768 rows of 4096 (a block per row) already fill the GPU."""
  _cuda_facts(monkeypatch)
  assert len(_kernels(Tensor.empty(4096, device="PYTHON").sum())) == 1
  assert len(_kernels(Tensor.empty(768, 4096, device="PYTHON").sum(axis=1))) == 1


# a reduce axis leading, trailing, in the middle, interleaved with an output axis, batchnorm-style, everything
EVERY_AXIS_POSITION = [((91, 6), (0,)), ((5, 91), (1,)), ((4, 45, 3), (1,)), ((3, 35, 5), (0, 1)),
                       ((5, 3, 7, 9), (0, 2, 3)), ((16, 9), (0, 1))]


@pytest.mark.parametrize("shape, axes", EVERY_AXIS_POSITION)
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_split_reduces_over_every_axis_position_match_numpy(small_split: None, shape: tuple[int, ...],
                                                          axes: tuple[int, ...], dtype: type) -> None:
  """Each reduce is split (two kernels at the scaled-down thresholds; a full reduce's two stages may share one row
  kernel, the scheduler's choice for a reduce of a reduce into one output) and its sum, max and (float32) mean equal
  numpy's: integers exactly."""
  data = rng.integers(-50, 50, shape).astype(dtype) if dtype == np.int32 else rng.standard_normal(shape).astype(dtype)
  x = Tensor(data, device="PYTHON")
  if len(axes) < len(shape):
    kernels = _split_kernels("PYTHON", dtype)
    assert len(_kernels(x.sum(axis=axes))) == kernels, f"{shape} over {axes} is split with the small thresholds"
    assert len(_kernels(x.max(axis=axes))) == kernels
  assert x.sum(axis=axes).lazydata.base.srcs[0].base.op is Ops.SUM, "the sum reads the partial sums"
  if dtype == np.int32:
    np.testing.assert_array_equal(x.sum(axis=axes).numpy(), data.sum(axis=axes))
  else:
    np.testing.assert_allclose(x.sum(axis=axes).numpy(), data.sum(axis=axes), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(x.mean(axis=axes).numpy(), data.mean(axis=axes), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(x.max(axis=axes).numpy(), data.max(axis=axes))


def test_split_layernorm_gradients_match_torch(small_split: None) -> None:
  """A LayerNorm's weight and bias gradients (sums over batch and tokens: split) and its input gradient, against
  torch."""
  x_data = rng.standard_normal((4, 21, 6)).astype(np.float32)
  upstream = rng.standard_normal((4, 21, 6)).astype(np.float32)
  weight_data, bias_data = rng.standard_normal(6).astype(np.float32), rng.standard_normal(6).astype(np.float32)
  x = Tensor(x_data, device="PYTHON", requires_grad=True)
  weight = Tensor(weight_data, device="PYTHON", requires_grad=True)
  bias = Tensor(bias_data, device="PYTHON", requires_grad=True)
  ((x.layernorm(-1) * weight + bias) * Tensor(upstream, device="PYTHON")).sum().backward()
  tx, tweight, tbias = (torch.tensor(a, requires_grad=True) for a in (x_data, weight_data, bias_data))
  ((torch.nn.functional.layer_norm(tx, (6,)) * tweight + tbias) * torch.tensor(upstream)).sum().backward()
  for ours, theirs in ((weight, tweight), (bias, tbias), (x, tx)):
    np.testing.assert_allclose(ours.grad.numpy(), theirs.grad.numpy(), rtol=1e-4, atol=1e-4)


# ================================================================ register tiles or a plain reduce

@pytest.mark.parametrize("strides, gathers, expected", [
  ([(8, 0, 1), (0, 1, 8)], False, True),             # a matmul (M, N, K): each operand reused across the other side
  ([(6, 1, 0), (6, 1, 0), (1, 0, 0)], False, False),   # x and dy read whole beside a per-token statistic: memory-bound
  ([(0, 0, 1), (1, 0, 0)], False, True),             # a vector reused by every output, the others small (a count)
  ([(0, 0, 1), (0, 0, 0)], True, False),             # the same vector beside gathered rows: the gathers dominate
  ([(0, 4, 1)], False, False),                        # reused across a batch of 2 only (positions added per image)
])
def test_register_tiles_pay_off(strides: list, gathers: bool, expected: bool) -> None:
  """heuristic.register_tiles_pay_off over a (2, 16, 4) or (M, N, K) = (16, 16, 8) product summed over its last axis
  (the split's MATMUL kind and the GPU heuristic's register tiles both ask it)."""
  shape = (16, 16, 8) if len(strides) == 2 and not gathers and strides[0][0] == 8 else (2, 16, 4)
  assert register_tiles_pay_off(shape, (2,), strides, gathers) is expected


def test_short_reduce_read_whole_keeps_a_thread_per_output() -> None:
  """GPT-2's position-embedding gradient: (512, 768) sums over a batch of 8 of a value read whole beside per-token
  statistics (broadcast along the 768). Register tiles do not pay off (heuristic.register_tiles_pay_off), and 4 x 4
  of them left the H200 24,576 threads (9% occupancy, half the copy bandwidth); the kernel keeps a thread per output
  (at least heuristic.threads_in_flight_wanted), and its sums equal numpy's with CUDA's heuristics."""
  x_data, statistic, dy_data = (rng.standard_normal(shape).astype(np.float32)
                                for shape in ((8, 512, 768), (8, 512, 1), (8, 512, 768)))
  x, s, dy = (Tensor(data, device="PYTHON") for data in (x_data, statistic, dy_data))
  [item] = _kernels(((x - s) * dy).sum(axis=0))
  kernel = Kernel(item.ast, CUDARenderer())
  kernel.hand_coded_optimizations()
  assert not any(opt.op is OptOps.UPCAST for opt in kernel.applied_opts), kernel.applied_opts
  threads = prod(kernel.full_shape[:kernel.global_dims]) * kernel.block_threads()
  assert threads == 512 * 768 >= threads_in_flight_wanted(kernel)
  small = Tensor(x_data[:, :8, :64], device="PYTHON"), Tensor(statistic[:, :8], device="PYTHON"), \
      Tensor(dy_data[:, :8, :64], device="PYTHON")
  [small_item] = _kernels(((small[0] - small[1]) * small[2]).sum(axis=0))
  for buffer in small_item.outputs: buffer.allocate()
  optimized = Kernel(small_item.ast, PythonRenderer("CUDA"))
  optimized.hand_coded_optimizations()
  output = Buffer("PYTHON", small_item.outputs[0].size, small_item.outputs[0].dtype).allocate()
  compile_kernel(optimized, "PYTHON")((output,) + small_item.inputs)
  expected = ((x_data[:, :8, :64] - statistic[:, :8]) * dy_data[:, :8, :64]).sum(axis=0)
  np.testing.assert_allclose(output.numpy().reshape(8, 64), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("batch", [8, 16])
def test_row_sums_of_gathered_embeddings_get_group_threads(batch: int) -> None:
  """Row sums of token embeddings plus learned positions (GPT-2's first LayerNorm mean, 4096 rows of 768): the
  rows are gathered (a load at a per-element offset: a row per token, read whole), so the GPU heuristic gives each
  row GROUP threads, not register tiles over a few blocks (2 on the H200 at 96 GB/s), whatever the batch that reuses
  the positions (16 of them: 8 blocks of tiles at 9% of the DRAM bandwidth); the sums against numpy, with CUDA's
  heuristics and as the plain kernel."""
  rng_local = np.random.default_rng(3)
  tokens = rng_local.integers(-50, 50, (batch, 16)).astype(np.int32)   # negative indices count from the end
  table, positions = (rng_local.standard_normal(shape).astype(np.float32) for shape in ((50, 256), (16, 256)))
  rows = Tensor(table, device="PYTHON")[Tensor(tokens, device="PYTHON")] + Tensor(positions, device="PYTHON")
  [item] = _kernels(rows.sum(axis=-1))
  results = []
  for optimize in (True, False):
    kernel = Kernel(item.ast, PythonRenderer("CUDA"))
    if optimize:
      kernel.hand_coded_optimizations()
      # a block per row, its threads over the row (was: 4x4 rows a thread, 2 blocks)
      assert kernel.group_dims >= 1 and not any(opt.op is OptOps.UPCAST for opt in kernel.applied_opts), \
          kernel.applied_opts
    fresh = Buffer("PYTHON", item.outputs[0].size, item.outputs[0].dtype).allocate()
    compile_kernel(kernel, "PYTHON")((fresh,) + item.inputs)
    results.append(fresh.numpy().reshape(batch, 16))
  expected = (table[tokens] + positions).sum(axis=-1)
  for result in results: np.testing.assert_allclose(result, expected, rtol=1e-4, atol=1e-4)
