"""One-value reduces riding in the first block of a kernel beside them (engine/ride_along.py, codegen/ride_along.py):
values against numpy and PyTorch, which pairs merge and which stay apart, on the default device and on the PYTHON
device (a GPU renderer: under `DEVICE=PYTHON EMULATE=CUDA` CUDA's limits and warp shuffles)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ourgrad import Tensor
from ourgrad.codegen.opt import split_reduce
from ourgrad.device import Device
from ourgrad.engine import ride_along
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.helpers import GlobalCounters
from ourgrad.ops import Ops

DEVICES = [None, "PYTHON"]


@pytest.fixture(autouse=True)
def no_split_k(monkeypatch: pytest.MonkeyPatch) -> None:
  """Reduces stay one kernel each (a device of one multiprocessor is never idle: codegen/opt/split_reduce.py), so the
  one-value reduces are one-block kernels whatever the emulated GPU; and hosts of a few hundred KB carry riders here
  (on a GPU a host moves at least HOST_LATENCIES memory latencies' worth:
  test_a_short_host_on_a_gpu_carries_nothing)."""
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts(1, 2048, 0))
  monkeypatch.setattr(ride_along, "HOST_LATENCIES", 0)


def test_a_short_host_on_a_gpu_carries_nothing(monkeypatch: pytest.MonkeyPatch):
  """A host of 512 KB on a device whose memory latency is worth 1.6 MB (CUDA's default) would wait at its end for the
  rider's chain of latencies: the sum keeps its own kernel."""
  monkeypatch.setattr(ride_along, "HOST_LATENCIES", 4)
  monkeypatch.setattr(Device["PYTHON"].renderer, "latency_bytes", 1600 << 10)
  items = _kernels(create_schedule([Tensor(_data(1024), device="PYTHON").sum().lazydata,
                                    (Tensor(_data(256, 256), device="PYTHON") * 2).lazydata]))
  assert len(items) == 2


def _kernels(items: list[ScheduleItem]) -> list[ScheduleItem]:
  return [item for item in items if item.ast.op is not Ops.COPY]


def _data(*shape: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_an_independent_sum_rides_in_the_elementwise_kernel(device: str | None):
  small, large = _data(1024), _data(256, 256, seed=1)
  def build() -> tuple[Tensor, Tensor]: return Tensor(small, device=device).sum(), Tensor(large, device=device) * 2 + 1
  items = _kernels(create_schedule([tensor.lazydata for tensor in build()]))
  assert len(items) == 1 and items[0].ast.op is Ops.RIDE_ALONG
  total, doubled = build()
  GlobalCounters.reset()
  Tensor.realize(total, doubled)
  assert GlobalCounters.kernel_count == 1
  np.testing.assert_allclose(total.numpy(), small.sum(dtype=np.float64), rtol=1e-5)
  np.testing.assert_allclose(doubled.numpy(), large * 2 + 1, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_a_short_uneven_sum_rides_on_one_thread(device: str | None):
  """1000 elements do not split over a block of 2^k threads: one thread of the first block sums them."""
  small, large = _data(1000), _data(256, 256, seed=1)
  total, doubled = Tensor(small, device=device).max(), Tensor(large, device=device).exp()
  Tensor.realize(total, doubled)
  np.testing.assert_allclose(total.numpy(), small.max())
  np.testing.assert_allclose(doubled.numpy(), np.exp(large), rtol=1e-5)
  assert len(_kernels(create_schedule([Tensor(small, device=device).max().lazydata,
                                       (Tensor(large, device=device).exp()).lazydata]))) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_a_sum_of_the_kernels_output_stays_apart(device: str | None):
  """The sum reads what the larger kernel writes: it runs after it, in a kernel of its own."""
  large = _data(256, 256)
  doubled = (Tensor(large, device=device) * 2).contiguous()
  total = doubled[:8].sum()
  items = _kernels(create_schedule([doubled.lazydata, total.lazydata]))
  assert len(items) == 2 and not any(item.ast.op is Ops.RIDE_ALONG for item in items)


def test_a_host_moving_too_few_bytes_carries_nothing():
  small = _data(4096)
  items = _kernels(create_schedule([Tensor(small).sum().lazydata, (Tensor(_data(64, seed=1)) + 1).lazydata]))
  assert len(items) == 2


def test_riding_off(monkeypatch: pytest.MonkeyPatch):
  monkeypatch.setenv("RIDE_ALONG", "0")
  items = _kernels(create_schedule([Tensor(_data(1024)).sum().lazydata, (Tensor(_data(256, 256)) * 2).lazydata]))
  assert len(items) == 2


# (rows, classes): rows that split evenly over a GPU block's threads (the riders GROUPed), GPT-2's vocabulary and an
# odd one
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(128, 50304), (64, 1001)])
def test_cross_entropy_in_two_kernels_matches_torch(shape: tuple[int, int], device: str | None):
  """Cross-entropy's loss and gradient in one schedule: 2 kernels (the count rides in the logsumexp rows, the mean in
  the gradient's kernel), values and gradients as PyTorch's, ignored samples included."""
  rng = np.random.default_rng(3)
  logits = rng.standard_normal(shape).astype(np.float32) * 3
  target = rng.integers(0, shape[1], shape[0]).astype(np.int32)
  target[::7] = -100
  x = Tensor(logits, device=device, requires_grad=True).realize()
  labels = Tensor(target, device=device).realize()
  loss = x.cross_entropy(labels)
  loss.backward()
  assert x.grad is not None
  GlobalCounters.reset()
  Tensor.realize(loss, x.grad)
  assert GlobalCounters.kernel_count == 2
  t = torch.tensor(logits, requires_grad=True)
  expected = torch.nn.functional.cross_entropy(t, torch.tensor(target, dtype=torch.long))
  expected.backward()
  assert t.grad is not None
  np.testing.assert_allclose(loss.numpy(), expected.item(), rtol=1e-5)
  np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), rtol=1e-4, atol=float(t.grad.abs().max()) * 1e-5)
