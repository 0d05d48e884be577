"""Kernel counts of whole training steps on a GPU device, and the small reduces that share launches there.

On a GPU each launch costs a few microseconds even when it does almost nothing: the second kernel of a split reduce
(batchnorm statistics over their parts), a loss's sum, a bias gradient over a few rows. engine/packing.py packs such
small reduces (a thread per output, a short unrolled loop: codegen/packed.py) with the independent kernels of their
dependency height. The pins below (examples/mnist.py's CNN step and bench_jit.py's MLP step, scheduled for the
PYTHON device, a GPU renderer) keep a gain from silently regressing: a change that adds kernels must update them
knowingly. Packed results are checked against numpy and, through a BatchNorm, PyTorch.
"""
from __future__ import annotations

import importlib.util
import pathlib
from typing import Any, Iterator

import numpy as np
import pytest
import torch

import ourgrad.engine.packing as packing
from ourgrad import Tensor
from ourgrad.device import Device
from ourgrad.codegen.opt import split_reduce
from ourgrad.engine.schedule import create_schedule
from ourgrad.helpers import SPLIT_LAST_BLOCK, GlobalCounters
from ourgrad.nn import BatchNorm2d, Linear
from ourgrad.nn.losses import cross_entropy
from ourgrad.nn.optim import Adam
from ourgrad.nn.state import get_parameters
from ourgrad.ops import REDUCE_OPS, Ops
from ourgrad.runtime.ops_python import PythonRenderer

ROOT = pathlib.Path(__file__).resolve().parents[1]
rng = np.random.default_rng(12)


def _load_example(path: pathlib.Path, name: str) -> Any:
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _step_outputs(model: Any, x: Tensor, y: Tensor) -> list[Tensor]:
  """What one jitted training step realizes (bench_jit.ourgrad_step): the loss, Adam's updates, the running stats."""
  trainable = [tensor for tensor in get_parameters(model) if tensor.requires_grad]
  stats = [tensor for tensor in get_parameters(model) if not tensor.requires_grad]
  optimizer = Adam(trainable, lr=1e-3)
  with Tensor.train():
    optimizer.zero_grad()
    loss = cross_entropy(model(x), y)
    loss.backward()
    return [loss, *optimizer.schedule_step(), *stats]


def _launches(outputs: list[Tensor]) -> int:
  kernels = (Ops.STORE, Ops.SINK, Ops.PACK, Ops.SPLIT_REDUCE, Ops.RIDE_ALONG)
  return sum(item.ast.op in kernels for item in create_schedule([t.lazydata for t in outputs]))


def _one_kernel_splits() -> bool:
  """Whether the PYTHON device merges a split reduce's two kernels (its renderer has atomics: EMULATE=CUDA, and
  SPLIT_LAST_BLOCK is on)."""
  return Device["PYTHON"].renderer.has_block_atomics and bool(SPLIT_LAST_BLOCK.value)


def _latency_unknown() -> bool:
  """Whether the PYTHON device's renderer knows no memory latency (not EMULATE=CUDA): any host that moves 16 times a
  one-value reduce's bytes carries it then (engine/ride_along.py HOST_LATENCIES)."""
  return not Device["PYTHON"].renderer.latency_bytes


@pytest.fixture
def on_python(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
  monkeypatch.setenv("DEVICE", "PYTHON")   # the models' parameters are made on the default device
  yield


class _MLP:
  """bench_jit.py's MLP: 784-512-512-10."""

  def __init__(self) -> None: self.layers = [Linear(784, 512), Linear(512, 512), Linear(512, 10)]

  def __call__(self, x: Tensor) -> Tensor:
    return self.layers[2](self.layers[1](self.layers[0](x).relu()).relu())


# ================================================================ pins

def test_mnist_cnn_step_kernel_count(on_python: None) -> None:
  """examples/mnist.py's CNN, batch 256: 29 launches (28 on the plain PYTHON device, which does not know its memory
  latency: the loss's count of samples rides in the logits' kernel there, engine/ride_along.py, a host too short on a
  GPU; 30 before codegen/opt/split_reduce.py's split reduces met the
  logsumexp cross-entropy: the loss's small kernels now share a packed launch; 31 before cross-entropy became logsumexp
  - the picked logit with its shift detached: the loss's max and sum of exps, each stored by a kernel of its own, are
  now computed inside the loss's and the gradient's row kernels; 33 before each batchnorm's forward second stages became
  one kernel of sibling reduces that also stores the mean, the inverse std and the running variance computed from them
  (engine/multi_output.py): one launch less per batchnorm; 39 before each batchnorm's statistics became one pass of
  sibling reduces forward and one backward (nn/batchnorm.py): each of its two batchnorms lost a partial-sums kernel and
  a second stage in backward, and in forward a partial-sums kernel (its mean and inverse std were then stored by one
  small launch, after the mean's second stage); 50 before small reduces were packed: the 7 small reduces and the step
  counter at the last-but-one dependency height share one; 44 before a GPU conv's input gradient read the output
  gradient through masked loads instead of a padded copy; 43 before three of each batchnorm backward's four partial sums
  over its input became one kernel of sibling reduces: the fourth needs the variance's gradient)."""
  mnist = _load_example(ROOT / "examples" / "mnist.py", "mnist_example_kernels")
  model = mnist.ConvNet(mnist.MODELS["small"])
  x, y = Tensor.empty(256, 1, 28, 28), Tensor.empty(256, dtype="int32")
  assert _launches(_step_outputs(model, x, y)) == (28 if _latency_unknown() else 29)


def _statistics_kernels(items: list, input_size: int) -> list:
  """The reduce kernels of `items` that read a buffer of `input_size` elements (a batchnorm's input or gradient)."""
  return [item for item in items if item.ast.op in (Ops.STORE, Ops.SINK)
          and any(buffer.size == input_size for buffer in item.inputs)
          and any(node.op in REDUCE_OPS for node in item.ast.walk())]


def test_batchnorm_statistics_are_one_kernel_forward_and_one_backward(on_python: None) -> None:
  """MNIST's first batchnorm in a training step (forward and backward in one schedule, as a jitted step runs them):
  its input is read by ONE statistics kernel in forward (the mean's and the variance's partial sums as sibling
  reduces) and its output's gradient by ONE in backward (the bias's and the weight's gradients). Before nn/batchnorm.py
  there were two of each (the variance's sum waited on the mean's, and in backward the mean path's sum on the
  variance path's), each with a second stage: 12 launches then, 7 before the forward's second stages became one
  kernel with the mean, the inverse std and the running variance computed from them, 6 now."""
  shape = (256, 16, 24, 24)
  x, upstream = Tensor.empty(*shape, requires_grad=True).realize(), Tensor.empty(*shape).realize()
  layer = BatchNorm2d(16)
  with Tensor.train():
    out = layer(x)
  (out * upstream).sum().backward()
  outputs = [out, layer.running_mean, layer.running_var, x.grad, layer.weight.grad, layer.bias.grad]
  items = create_schedule([tensor.lazydata for tensor in outputs])
  forward_stats, second_stage, backward_stats = _statistics_kernels(items, x.numel())
  assert len(forward_stats.outputs) == 2 and len(backward_stats.outputs) == 2
  assert upstream.lazydata.base.realized in backward_stats.inputs
  # the second stage reads x only for the statistics' shift (x[0, c, 0, 0]): both sums over the forward's parts
  assert set(map(id, second_stage.inputs)) == set(map(id, forward_stats.outputs)) | {id(x.lazydata.base.realized)}
  assert second_stage.ast.op is Ops.SINK and sum(node.op in REDUCE_OPS for node in second_stage.ast.walk()) == 2
  assert len(second_stage.outputs) == 3   # the mean and inverse std (stored_statistics) and the running variance
  # forward: the partial sums, their second stage, the running mean (from the stored mean); backward: the partial
  # sums, their second stages (one packed launch); the output and the input's gradient (one kernel: same shape)
  assert sum(item.ast.op in (Ops.STORE, Ops.SINK, Ops.PACK) for item in items) == 6


def test_mlp_step_kernel_count(on_python: None, monkeypatch: pytest.MonkeyPatch) -> None:
  """bench_jit.py's MLP, batch 512, its reduces split as on CUDA (split_reduce's facts of the emulated CUDA renderer,
  whether or not this run emulates it): 16 launches (15 on the plain PYTHON device, whose unknown memory latency lets
  the loss's count ride in a small kernel beside it, engine/ride_along.py; 17 with cross-entropy as logsumexp - the
  picked logit alone, its max and sum of exps inside the row kernels; with it, the loss's small kernels and the bias
  gradients' second stages share one packed launch). 18 launches before: the two 512-output bias gradients (1 MB
  summed over the batch: 16 blocks of 132 SMs) are split in 4 parts by codegen/opt/split_reduce.py (64 blocks), and
  the sums of their parts join the loss's packed launch: the count is unchanged (the third bias gradient, 10 outputs
  of 20 KB, saves less than a launch: not split). 19 before the loss's last small reduce shared the step counter's
  launch."""
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts.of(PythonRenderer("CUDA")))
  x, y = Tensor.empty(512, 784), Tensor.empty(512, dtype="int32")
  # with atomics (EMULATE=CUDA) the split bias gradient's second stages, packed into one launch without, are finished
  # by their partials' kernels' last blocks: as many launches
  assert _launches(_step_outputs(_MLP(), x, y)) == (15 if _latency_unknown() else 16)


# ================================================================ what packs

def test_small_reduces_of_different_shapes_share_one_launch_and_match_numpy() -> None:
  data = [rng.standard_normal(shape).astype(np.float32) for shape in ((16, 64), (32, 16), (3, 5, 4), (10,))]
  a, b, c, d = (Tensor(value, device="PYTHON").realize() for value in data)

  def build() -> list[Tensor]:
    return [a.sum(1), b.max(1), c.mean((0, 2)), d * 2 + 1, (b.T * 3).sum(0, keepdim=True), c.sum()]
  assert _launches(build()) == 1
  outs = build()
  GlobalCounters.reset()
  Tensor.realize_all(*outs)
  assert GlobalCounters.kernel_count == 1
  x_a, x_b, x_c, x_d = data
  for ours, theirs in zip(outs, [x_a.sum(1), x_b.max(1), x_c.mean((0, 2)), x_d * 2 + 1,
                                 (x_b.T * 3).sum(0, keepdims=True), x_c.sum()]):
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-5, atol=1e-5)


def test_a_long_reduce_keeps_its_own_kernel() -> None:
  """Over PACK_REDUCE_MAX_LOOP elements per output a reduce wants GROUP threads, not one serial thread."""
  a = Tensor.empty(4, packing.PACK_REDUCE_MAX_LOOP + 1, device="PYTHON")
  b = Tensor.empty(4, packing.PACK_REDUCE_MAX_LOOP, device="PYTHON")
  assert _launches([a.sum(1), b.sum(1)]) == 2
  assert _launches([b.sum(1), (b * 2).sum(1)]) == 1


def test_a_reduce_reading_another_packed_reduce_stays_apart() -> None:
  data = rng.standard_normal((8, 6)).astype(np.float32)
  a = Tensor(data, device="PYTHON").realize()

  def build() -> list[Tensor]:
    row_sums = a.sum(1)
    return [row_sums, row_sums.sum()]   # the total reads row_sums: a dependency height above it, never in its pack
  # with atomics the last block of the row sums' kernel adds them up (codegen/last_block.py)
  assert _launches(build()) == (1 if _one_kernel_splits() else 2)
  np.testing.assert_allclose(build()[1].numpy(), data.sum(), rtol=1e-5)


def test_batchnorm_backward_second_stages_share_a_launch_and_match_torch(small_split: None,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
  """The weight's and the bias's gradients of a batchnorm are split reduces; their second kernels (independent,
  one dependency height) run in one launch, and every gradient equals PyTorch's."""
  data = rng.standard_normal((8, 4, 6, 6)).astype(np.float32)
  upstream = rng.standard_normal((8, 4, 6, 6)).astype(np.float32)
  weight_np, bias_np = np.linspace(0.5, 1.5, 4, dtype=np.float32), np.linspace(-0.2, 0.3, 4, dtype=np.float32)

  def build() -> list[Tensor]:
    x = Tensor(data, device="PYTHON", requires_grad=True)
    weight = Tensor(weight_np, device="PYTHON", requires_grad=True)
    bias = Tensor(bias_np, device="PYTHON", requires_grad=True)
    mean = x.mean(axis=(0, 2, 3), keepdim=True)
    variance = (x - mean).square().mean(axis=(0, 2, 3), keepdim=True)
    out = (x - mean) * (variance + 1e-5).rsqrt() * weight.reshape(1, 4, 1, 1) + bias.reshape(1, 4, 1, 1)
    (out * Tensor(upstream, device="PYTHON")).sum().backward()
    return [x.grad, weight.grad, bias.grad]

  def gradients(pack: bool) -> tuple[list[np.ndarray], int]:
    monkeypatch.setenv("PACK_KERNELS", "1" if pack else "0")
    launches = _launches(build())   # scheduling alone marks the buffers: the values come from a graph of their own
    return [gradient.numpy() for gradient in build()], launches
  packed, packed_launches = gradients(True)
  plain, plain_launches = gradients(False)
  assert packed_launches < plain_launches
  tx = torch.tensor(data, requires_grad=True)
  tw, tb = torch.tensor(weight_np, requires_grad=True), torch.tensor(bias_np, requires_grad=True)
  tout = torch.nn.functional.batch_norm(tx, None, None, tw, tb, training=True, eps=1e-5)
  (tout * torch.tensor(upstream)).sum().backward()
  for ours, unpacked, theirs in zip(packed, plain, (tx.grad, tw.grad, tb.grad)):
    np.testing.assert_allclose(ours, unpacked, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-3, atol=1e-3)


def test_a_reduce_read_again_per_element_is_not_packed() -> None:
  """A kernel that reduces a row and then uses the sum for every element of it (RMSNorm's input gradient) writes more
  values than it has outputs of its reduce: it keeps its own kernel and its values."""
  x_np, w_np = rng.standard_normal((3, 4, 6)).astype(np.float32), rng.standard_normal(6).astype(np.float32)
  upstream = rng.standard_normal((3, 4, 6)).astype(np.float32)
  x, w = Tensor(x_np, device="PYTHON", requires_grad=True), Tensor(w_np, device="PYTHON", requires_grad=True)
  ((x * (x.square().mean(-1, keepdim=True) + 1e-6).rsqrt()) * w * Tensor(upstream, device="PYTHON")).sum().backward()
  tx, tw = torch.tensor(x_np, requires_grad=True), torch.tensor(w_np, requires_grad=True)
  ((tx * torch.rsqrt(tx.square().mean(-1, keepdim=True) + 1e-6)) * tw * torch.tensor(upstream)).sum().backward()
  np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=1e-4, atol=1e-5)
