"""Graph building remembered across eager steps gives what building it afresh gives (PyTorch on the CPU as the
reference): max pooling's window ranks (a lazy graph of constants, tensor_conv._window_ranks) are built once per
device and geometry, read again by later steps, and never read once a schedule realized a base of them."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as TF

from ourgrad import Tensor
from ourgrad import tensor_conv
from ourgrad.helpers import clear_caches
from ourgrad.lazy import LazyBuffer


def _pool_step(values: np.ndarray, upstream: np.ndarray, x: Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
  """max_pool2d (kernel 2, stride 2, padding 1) forward and input gradient of `values` (in `x` when given)."""
  x = Tensor(values, requires_grad=True) if x is None else x
  out = x.max_pool2d(kernel_size=2, stride=2, padding=1)
  (out * Tensor(upstream)).sum().backward()
  return out.numpy(), x.grad.numpy()


def _torch_pool_step(values: np.ndarray, upstream: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  x = torch.tensor(values, requires_grad=True)
  out = TF.max_pool2d(x, kernel_size=2, stride=2, padding=1)
  (out * torch.tensor(upstream)).sum().backward()
  return out.detach().numpy(), x.grad.numpy()


def _cached_ranks() -> list[LazyBuffer]: return list(tensor_conv._WINDOW_RANKS.values())


def test_max_pool_ranks_are_remembered_and_stay_right_across_steps():
  clear_caches()
  rng = np.random.default_rng(0)
  shape, out_shape = (2, 3, 7, 6), (2, 3, 4, 4)
  # ties (rounded values) make the ranks decide which element gets the gradient
  first = np.round(rng.standard_normal(shape), 1).astype(np.float32)
  upstream = rng.standard_normal(out_shape).astype(np.float32)
  for ours, theirs in zip(_pool_step(first, upstream), _torch_pool_step(first, upstream)):
    np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-6)
  assert len(_cached_ranks()) == 1
  remembered = _cached_ranks()[0]
  # the same geometry again, other values (ties, a NaN) in a tensor whose memory is then written in place
  second = np.round(rng.standard_normal(shape), 0).astype(np.float32)
  second[0, 0, 3, 3] = np.nan
  x = Tensor(first, requires_grad=True)
  x.assign(Tensor(second))
  ours = _pool_step(second, upstream, x)
  assert _cached_ranks() == [remembered]   # read again, not rebuilt
  for mine, theirs in zip(ours, _torch_pool_step(second, upstream)):
    np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-6)


def test_max_pool_ranks_are_rebuilt_once_a_base_of_them_was_realized():
  clear_caches()
  rng = np.random.default_rng(1)
  values = np.round(rng.standard_normal((1, 2, 6, 6)), 1).astype(np.float32)
  upstream = rng.standard_normal((1, 2, 4, 4)).astype(np.float32)
  _pool_step(values, upstream)
  (remembered,) = _cached_ranks()
  Tensor(remembered).realize()   # its memory now belongs to that schedule: never read through the cache again
  ours = _pool_step(values, upstream)
  assert _cached_ranks() != [remembered]
  for mine, theirs in zip(ours, _torch_pool_step(values, upstream)):
    np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-6)


def test_max_pool_ranks_are_kept_per_geometry():
  clear_caches()
  rng = np.random.default_rng(2)
  for shape in ((1, 1, 6, 6), (1, 1, 8, 6), (2, 1, 6, 6)):
    values = rng.standard_normal(shape).astype(np.float32)
    x = Tensor(values, requires_grad=True)
    out = x.max_pool2d(kernel_size=2, stride=2, padding=1)
    out.sum().backward()
    theirs_x = torch.tensor(values, requires_grad=True)
    TF.max_pool2d(theirs_x, kernel_size=2, stride=2, padding=1).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), theirs_x.grad.numpy(), rtol=1e-6, atol=1e-6)
  assert len(_cached_ranks()) == 3
