"""Float masks on the CPU (CLANG): a compare cast to float (the backward of ReLU, max-pool and max) renders as the
jump-free bit select `fbool`, and gives PyTorch's gradients on data of random signs, ties, NaN and sizes that do not
divide the upcast widths. gcc made `(float)(a != b)` a conditional jump, which such data mispredicts half the time
(the MNIST step's batchnorm backward ran 3-5x slower)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.device import Device
from ourgrad.engine.schedule import create_schedule
from ourgrad.ops import Ops

DEVICE = "CLANG"


def _sources(tensor: Tensor) -> list[str]:
  """The C source of every kernel computing `tensor`, with the default opts (the graph is consumed: pass a fresh
  expression)."""
  sources = []
  for item in create_schedule([tensor.lazydata]):
    if item.ast.op is Ops.COPY: continue
    kernel = Kernel(item.ast, Device[DEVICE].renderer)
    kernel.hand_coded_optimizations()
    sources.append(Device[DEVICE].renderer.render("k", linearize(kernel)))
  return sources


def _signed(shape: tuple[int, ...], seed: int) -> np.ndarray:
  """Normal values with zeros, ties and a NaN: masks of every kind see both outcomes."""
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  flat = x.reshape(-1)
  flat[::7] = 0.0
  ties = np.arange(1, flat.size - 1, 11)
  flat[ties] = flat[ties + 1]   # equal neighbours: ties in max and max-pool
  flat[5] = np.nan
  return x


def _grad(function, x: np.ndarray, upstream: np.ndarray) -> np.ndarray:
  tensor = Tensor(x, device=DEVICE, requires_grad=True)
  function(tensor).backward(Tensor(upstream, device=DEVICE))
  return tensor.grad.numpy()


def _torch_grad(function, x: np.ndarray, upstream: np.ndarray) -> np.ndarray:
  tensor = torch.tensor(x, requires_grad=True)
  function(tensor).backward(torch.tensor(upstream))
  return tensor.grad.numpy()


@pytest.mark.parametrize("shape", [(37, 19), (64, 32)])
def test_compare_cast_to_float_renders_as_bit_select(shape: tuple[int, ...]):
  """The masks of NaN, infinities and signed zeros are numpy's (a compare with NaN is false, != is true)."""
  x_np, y_np = _signed(shape, seed=7), _signed(shape, seed=8)
  x_np.reshape(-1)[:4], y_np.reshape(-1)[:4] = [np.inf, -np.inf, -0.0, 3.0], [np.nan, -np.inf, 0.0, np.inf]

  # a flipped view keeps the elementwise kernel out of the `omp simd` loop (whose selects gcc vectorizes as masks)
  def masks(x: Tensor, y: Tensor) -> Tensor:
    return ((x.flip(-1).relu() != 0).float() * y + (x.flip(-1) < y).float()).contiguous()
  (source,) = _sources(masks(Tensor.empty(*shape, device=DEVICE), Tensor.empty(*shape, device=DEVICE)))
  body = source.split("void k(")[1]
  assert "fbool(" in body and "(float)(" not in body and "static inline float fbool(bool c)" in source
  result = masks(Tensor(x_np, device=DEVICE), Tensor(y_np, device=DEVICE)).numpy()
  flipped = x_np[..., ::-1]
  with np.errstate(invalid="ignore"):
    expected = (np.maximum(flipped, 0) != 0).astype(np.float32) * y_np + (flipped < y_np).astype(np.float32)
  np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("shape", [(4, 3, 10, 10), (3, 5, 9, 7), (2, 16, 24, 24)])
def test_relu_and_max_pool_backward_match_torch(shape: tuple[int, ...]):
  x = _signed(shape, seed=sum(shape))
  x[np.isnan(x)] = 0.75  # a NaN in a pooling window: PyTorch and ourgrad route its gradient differently
  pooled = (shape[0], shape[1], shape[2] // 2, shape[3] // 2)
  upstream = np.random.default_rng(1).standard_normal(pooled).astype(np.float32)
  ours = _grad(lambda t: (t * 1.5 - 0.25).relu().max_pool2d(), x, upstream)
  theirs = _torch_grad(lambda t: torch.nn.functional.max_pool2d((t * 1.5 - 0.25).relu(), 2), x, upstream)
  # a tie in a pooling window: PyTorch routes the gradient to one position, ourgrad splits it among the equal ones;
  # both give the window the same total
  window_totals = [grad[..., :pooled[2] * 2, :pooled[3] * 2].reshape(*pooled[:2], pooled[2], 2, pooled[3], 2)
                   .sum(axis=(3, 5)) for grad in (ours, theirs)]
  np.testing.assert_allclose(*window_totals, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(33, 17), (8, 64), (5, 3, 7)])
def test_maximum_and_where_masks_match_torch(shape: tuple[int, ...]):
  x, y = _signed(shape, seed=3), _signed(shape, seed=4)[::-1].copy()
  upstream = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
  x[np.isnan(x)] = 0.5  # NaN gradients of maximum differ between libraries; NaN is covered by the relu test
  y[np.isnan(y)] = -0.5
  other = Tensor(y, device=DEVICE)
  ours = _grad(lambda t: t.maximum(other) + (t > 0).where(t * 2, t * 0.5), x, upstream)
  theirs = _torch_grad(lambda t: torch.maximum(t, torch.tensor(y)) + torch.where(t > 0, t * 2, t * 0.5), x, upstream)
  # an exact tie of x and y: PyTorch gives each side half the gradient, as ourgrad does
  np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
