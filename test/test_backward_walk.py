"""The backward walk itself (Tensor._backpropagate, _toposort): gradients through shared intermediates and leaves,
a gradient that folds to a realized tensor's memory, and what an in-place write after backward() leaves of it;
PyTorch on the CPU as the reference."""
from __future__ import annotations

import numpy as np
import torch

from ourgrad import Tensor


def test_gradient_that_is_a_realized_tensor_keeps_its_value_after_a_write() -> None:
  """d(w + x)/dw with a given upstream gradient g is g itself, a realized tensor's memory: the walk gives it a value of
  its own (the edge loop's short way to _own_value), so a later in-place write to g does not change w.grad."""
  g = Tensor(np.array([1.0, 2.0, 3.0], np.float32)).realize()
  w = Tensor(np.ones(3, np.float32), requires_grad=True)
  (w + Tensor(np.zeros(3, np.float32))).backward(g)
  assert w.grad.lazydata.base is not g.lazydata.base
  g.assign(Tensor(np.full(3, 9.0, np.float32))).realize()
  np.testing.assert_array_equal(w.grad.numpy(), [1.0, 2.0, 3.0])


def test_shared_intermediates_and_leaves_sum_their_gradients_like_torch() -> None:
  """An intermediate read by three Functions and a leaf read at two depths: the walk reaches every Function after all
  its consumers and sums each tensor's gradients (leaves with None among a Function's inputs' Functions)."""
  rng = np.random.default_rng(0)
  a_values, b_values = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((3,)).astype(np.float32)
  constant = rng.standard_normal((4, 3)).astype(np.float32)

  def run(a, b, c, exp, relu):   # noqa: ANN001, ANN202 (ourgrad and torch alike)
    hidden = a * b + c
    shared = relu(hidden)
    out = (shared * shared).sum() + (shared * b).sum() + exp(shared).mean() + (a * hidden).sum()
    out.backward()
    return out

  a, b = Tensor(a_values, requires_grad=True), Tensor(b_values, requires_grad=True)
  ours = run(a, b, Tensor(constant), Tensor.exp, Tensor.relu)
  ta, tb = torch.tensor(a_values, requires_grad=True), torch.tensor(b_values, requires_grad=True)
  theirs = run(ta, tb, torch.tensor(constant), torch.exp, torch.relu)
  np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), rtol=1e-5)
  np.testing.assert_allclose(a.grad.numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(b.grad.numpy(), tb.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_toposort_lists_each_function_once_after_its_inputs() -> None:
  x = Tensor(np.ones((2, 2), np.float32), requires_grad=True)
  y = x * 2
  z = (y + y) * y + x
  order = z._toposort()
  assert len(order) == len(set(order)) == 4   # Mul, Add, Mul, Add: x's leaf contributes no Function
  position = {ctx: index for index, ctx in enumerate(order)}
  for ctx in order:
    for parent_ctx in ctx.parent_ctxs:
      if parent_ctx is not None: assert position[parent_ctx] < position[ctx]
