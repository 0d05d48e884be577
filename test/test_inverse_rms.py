"""Tensor.inverse_rms (an RMS norm's scale, tensor_nn.py): without a gradient to record its graph is built on lazy
buffers (`_inverse_rms_lazy`): the same six ops as the Tensor ops, so the values are theirs bit for bit; with one, the
Tensor ops and their gradient. Against numpy and torch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ourgrad import Tensor
from ourgrad.lazy import LazyBuffer
from ourgrad.nn import RMSNorm
from ourgrad.ops import Ops

RNG = np.random.default_rng(11)


def _composed(x: Tensor, axes: int | tuple[int, ...], eps: float) -> Tensor:
  """The Tensor ops the method stands for (an RMS norm's scale as models wrote it)."""
  return (x.square().mean(axes, keepdim=True) + eps).rsqrt()


@pytest.mark.parametrize("shape, axes, dtype", [((3, 5, 16), -1, np.float32), ((2, 3, 4, 6), (1, 3), np.float32),
                                                ((4, 9), 0, np.float64)])
def test_inverse_rms_is_the_composed_graph_bit_for_bit(shape, axes, dtype):
  values = RNG.standard_normal(shape).astype(dtype)
  got = Tensor(values).inverse_rms(axes, 1e-5)
  assert not got.requires_grad
  reduced = tuple(a % len(shape) for a in ((axes,) if isinstance(axes, int) else axes))
  expected = 1 / np.sqrt((values.astype(np.float64) ** 2).mean(reduced, keepdims=True) + 1e-5)
  np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6 if dtype == np.float32 else 1e-12)
  assert got.numpy().tobytes() == _composed(Tensor(values), axes, 1e-5).numpy().tobytes()


def test_inverse_rms_without_a_gradient_makes_six_bases(monkeypatch):
  """The square, the sum, the division by the count (a product), + eps, the square root and the reciprocal (and the
  scalars' constants, shared once made)."""
  made: list[object] = []
  create = LazyBuffer.create_base
  monkeypatch.setattr(LazyBuffer, "create_base", staticmethod(lambda *args, **kwargs: made.append(args[3]) or
                                                                create(*args, **kwargs)))
  x = Tensor(RNG.standard_normal((4, 8)).astype(np.float32)).realize()
  made.clear()
  x.inverse_rms(-1, 1e-6)
  computed = [op for op in made if op is not Ops.CONST]
  assert computed == [Ops.MUL, Ops.SUM, Ops.MUL, Ops.ADD, Ops.SQRT, Ops.RECIP], made


def test_inverse_rms_gradient_and_rmsnorm_match_torch():
  """With a gradient to record: the Tensor ops' graph, its gradient torch's; nn.RMSNorm (which uses it) torch's."""
  values = RNG.standard_normal((3, 10)).astype(np.float32)
  x = Tensor(values, requires_grad=True)
  scale = x.inverse_rms(-1, 1e-5)
  (scale * Tensor(np.arange(3, dtype=np.float32).reshape(3, 1))).sum().backward()
  theirs = torch.tensor(values, requires_grad=True)
  torch_scale = torch.rsqrt(theirs.pow(2).mean(-1, keepdim=True) + 1e-5)
  (torch_scale * torch.arange(3, dtype=torch.float32).reshape(3, 1)).sum().backward()
  np.testing.assert_allclose(scale.numpy(), torch_scale.detach().numpy(), rtol=1e-6)
  np.testing.assert_allclose(x.grad.numpy(), theirs.grad.numpy(), rtol=1e-5, atol=1e-7)
  norm = RMSNorm(10, eps=1e-5)
  reference = torch.nn.RMSNorm(10, eps=1e-5)
  np.testing.assert_allclose(norm(Tensor(values)).numpy(), reference(torch.from_numpy(values)).detach().numpy(),
                             rtol=1e-6, atol=1e-6)
