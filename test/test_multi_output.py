"""engine/multi_output.py: which realized bases share a kernel, and its switches (SIBLING_REDUCES,
COMBINED_SIBLING_REDUCES, MAX_KERNEL_OUTPUTS) read where the grouping runs. Results against numpy."""
from __future__ import annotations

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel
from ourgrad.device import Device
from ourgrad.engine import multi_output
from ourgrad.engine.realize import run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.ops import REDUCE_OPS, Ops

rng = np.random.default_rng(7)


def _output_counts(outputs: list[Tensor]) -> list[int]:
  """Outputs per kernel of the schedule that computes `outputs`; packs of small kernels (engine/packing.py, one
  launch of independent kernels) are left out: they are not multi-output kernels."""
  schedule = create_schedule([t.lazydata for t in outputs])
  counts = [len(item.outputs) for item in schedule if item.ast.op is not Ops.PACK]
  run_schedule(schedule)
  return counts


@pytest.mark.parametrize("siblings", [True, False])
def test_sibling_reduces_switch(siblings: bool, small_split: None, monkeypatch: pytest.MonkeyPatch) -> None:
  """Three sums over a common input share one kernel on a device with thread blocks, unless SIBLING_REDUCES is off;
  the values are numpy's either way."""
  monkeypatch.setattr(multi_output, "SIBLING_REDUCES", siblings)
  x_np, g_np = (rng.standard_normal((12, 5, 10, 8)).astype(np.float32) for _ in range(2))
  x, g = Tensor(x_np, device="PYTHON").realize(), Tensor(g_np, device="PYTHON").realize()
  outputs = [x.sum(axis=(0, 2, 3)), (x * g).sum(axis=(0, 2, 3)), (x * x).sum(axis=(0, 2, 3))]
  counts = _output_counts(outputs)
  assert (3 in counts) == siblings, counts
  for ours, theirs in zip(outputs, (x_np.sum(axis=(0, 2, 3)), (x_np * g_np).sum(axis=(0, 2, 3)),
                                    np.square(x_np).sum(axis=(0, 2, 3)))):
    np.testing.assert_allclose(ours.numpy(), theirs, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("cap", [16, 3])
def test_elementwise_outputs_share_kernels_up_to_the_cap(cap: int, monkeypatch: pytest.MonkeyPatch) -> None:
  """Seven elementwise results over one shape: kernels of at most MAX_KERNEL_OUTPUTS outputs, numpy's values."""
  monkeypatch.setattr(multi_output, "MAX_KERNEL_OUTPUTS", cap)
  monkeypatch.setenv("PACK_KERNELS", "0")   # the kernels of one shape would be packed into one launch
  a_np = rng.standard_normal((6, 10)).astype(np.float32)
  a = Tensor(a_np, device="PYTHON").realize()
  outputs = [a * (index + 2) + 1 for index in range(7)]
  counts = _output_counts(outputs)
  assert sorted(counts, reverse=True) == ([7] if cap >= 7 else [3, 3, 1])
  for index, output in enumerate(outputs):
    np.testing.assert_allclose(output.numpy(), a_np * (index + 2) + 1, rtol=1e-6)


def test_independent_outputs_keep_their_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
  """Elementwise results over one shape share a kernel only with results that read a common buffer: two from `a` and
  two from `b` make two kernels of two outputs, not one of four (one kernel of unrelated outputs saves only launches
  and holds all their loads in registers at once); numpy's values."""
  monkeypatch.setenv("PACK_KERNELS", "0")
  a_np, b_np = (rng.standard_normal((6, 10)).astype(np.float32) for _ in range(2))
  a, b = Tensor(a_np, device="PYTHON").realize(), Tensor(b_np, device="PYTHON").realize()
  outputs = [a * 2, b + 1, a - 3, b * b]
  assert sorted(_output_counts(outputs)) == [2, 2]
  for output, expected in zip(outputs, (a_np * 2, b_np + 1, a_np - 3, b_np * b_np)):
    np.testing.assert_allclose(output.numpy(), expected, rtol=1e-6)


# ================================================================ sibling reduces combined in one kernel's value

def _kernels(outputs: list[Tensor]) -> list:
  return [item for item in create_schedule([t.lazydata for t in outputs]) if item.ast.op in (Ops.STORE, Ops.SINK)]


def _reduce_count(item) -> int: return sum(node.op in REDUCE_OPS for node in item.ast.walk())


@pytest.mark.parametrize("combined", [True, False])
def test_outputs_combining_sibling_reduces_share_their_kernel(combined: bool,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
  """On a GPU device, an output computed from two sums over one loop (a variance from the sum and the sum of
  squares) and another from one of them are one kernel: both sums in one loop, the shared sum one node (computed
  once), the elementwise work after them. With COMBINED_SIBLING_REDUCES off, one sum is stored by a kernel of its
  own first, as before. numpy's values either way."""
  monkeypatch.setattr(multi_output, "COMBINED_SIBLING_REDUCES", combined)
  x_np = rng.standard_normal((6, 5, 7)).astype(np.float32)
  x = Tensor(x_np, device="PYTHON").realize()

  def build() -> list[Tensor]:
    # (a sum itself read by two kernels is stored once first: _choose_realizes; its mean read twice is recomputed)
    mean, squares = x.sum(axis=(0, 2)) / 42, x.square().sum(axis=(0, 2))
    return [squares / 42 - mean.square(), mean + 1]
  kernels = _kernels(build())
  if combined:
    assert len(kernels) == 1 and len(kernels[0].outputs) == 2 and _reduce_count(kernels[0]) == 2
  else:
    assert len(kernels) == 2 and sorted(_reduce_count(item) for item in kernels) == [1, 1]
  variance, mean_plus_one = build()
  np.testing.assert_allclose(variance.numpy(), x_np.var(axis=(0, 2)), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(mean_plus_one.numpy(), x_np.mean(axis=(0, 2)) + 1, rtol=1e-5, atol=1e-6)


def test_one_output_combining_sibling_reduces_is_a_sink_of_one_store() -> None:
  """A lone kernel whose value combines sibling reduces is a SINK of its one STORE (codegen tells it from a row
  kernel by that: Kernel.sibling_reduces), its sums side by side in one loop."""
  x_np = rng.standard_normal((8, 3, 5)).astype(np.float32)
  x = Tensor(x_np, device="PYTHON").realize()
  out = x.sum(axis=(0, 2)) * x.max(axis=(0, 2)) + x.square().sum(axis=(0, 2))   # the max is no sibling of a sum
  kernels = _kernels([out])
  combined = [item for item in kernels if _reduce_count(item) == 2]
  assert len(kernels) == 2 and len(combined) == 1 and combined[0].ast.op is Ops.SINK
  assert Kernel(combined[0].ast, Device["PYTHON"].renderer).sibling_reduces
  out = x.sum(axis=(0, 2)) * x.max(axis=(0, 2)) + x.square().sum(axis=(0, 2))
  expected = x_np.sum(axis=(0, 2)) * x_np.max(axis=(0, 2)) + np.square(x_np).sum(axis=(0, 2))
  np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_combined_sibling_reduces_stay_apart_on_a_cpu_in_matmuls_and_row_kernels() -> None:
  """Where sibling reduces do not share kernels (a CPU), where the reduces are matmuls (their operand tiles serve
  one reduce) and where they share rows (a row kernel: one STORE), nothing changes."""
  x_np = rng.standard_normal((6, 5, 7)).astype(np.float32)
  on_cpu = Tensor(x_np, device="CLANG").realize()
  on_cpu_kernels = _kernels([on_cpu.sum(axis=(0, 2)) * on_cpu.square().sum(axis=(0, 2))])
  assert len(on_cpu_kernels) == 2 and all(_reduce_count(item) == 1 for item in on_cpu_kernels)
  a, b, c = (Tensor(rng.standard_normal((16, 16)).astype(np.float32), device="PYTHON").realize() for _ in range(3))
  # a.T @ b and a.T @ c as sums over the leading axis (a matmul's own reduce is trailing: a row kernel's business)
  products = [(a[:, :, None] * other[:, None, :]).sum(axis=0) for other in (b, c)]
  assert all(_reduce_count(item) == 1 for item in _kernels([products[0] + products[1]]))
  rows = Tensor(rng.standard_normal((4, 32)).astype(np.float32), device="PYTHON").realize()
  row_kernels = _kernels([rows.sum(axis=1) + rows.square().sum(axis=1)])
  assert len(row_kernels) == 1 and row_kernels[0].ast.op is Ops.STORE
  assert not Kernel(row_kernels[0].ast, Device["PYTHON"].renderer).sibling_reduces


# ================================================================ groups without a run order

def test_a_group_on_a_cycle_is_split_and_other_groups_keep_their_kernels(small_split: None) -> None:
  """A (C,) result `scale` joins the (C,) update of a parameter `weight` (one iteration space), but a kernel reads both
  `scale` (so it runs after the group) and the old `weight` (so it runs before the group's assign): no run order.
  Only that group is split (scale leaves it); the sibling partial sums elsewhere in the graph stay one kernel (the
  fallback used to give up every multi-output kernel: 38 launches instead of 33 in the MNIST step). Values are
  numpy's."""
  x_np = rng.standard_normal((16, 4, 16, 16)).astype(np.float32)
  weight_np, p_np = rng.standard_normal(4).astype(np.float32), rng.standard_normal(4).astype(np.float32)
  x = Tensor(x_np, device="PYTHON").realize()
  weight, p = Tensor(weight_np, device="PYTHON").realize(), Tensor(p_np, device="PYTHON").realize()
  axes = (0, 2, 3)
  sums, squares = x.sum(axis=axes), (x * x).sum(axis=axes)
  scale = (p * 3).contiguous()
  scaled = (x * scale.reshape(1, 4, 1, 1) * weight.reshape(1, 4, 1, 1)).contiguous()   # reads scale and old weight
  gradient = scaled.sum(axis=axes).contiguous()
  updated = weight.assign(weight - 0.1 * gradient)
  schedule = create_schedule([t.lazydata for t in (sums, squares, scale, updated)])
  partial_sums = [item for item in schedule if item.inputs == (x.lazydata.base.realized,)]
  assert [len(item.outputs) for item in partial_sums] == [2]   # both statistics' partial sums: one kernel
  assert not any({id(scale.lazydata.base.realized), id(weight.lazydata.base.realized)} <= set(map(id, item.outputs))
                 for item in schedule)
  run_schedule(schedule)
  np.testing.assert_allclose(sums.numpy(), x_np.sum(axis=axes), rtol=1e-4, atol=1e-3)
  np.testing.assert_allclose(squares.numpy(), np.square(x_np).sum(axis=axes), rtol=1e-4, atol=1e-3)
  expected_gradient = (x_np * (p_np * 3).reshape(1, 4, 1, 1) * weight_np.reshape(1, 4, 1, 1)).sum(axis=axes)
  np.testing.assert_allclose(updated.numpy(), weight_np - 0.1 * expected_gradient, rtol=1e-4, atol=1e-3)


def test_layernorm_weight_and_bias_gradients_share_their_loop(small_split: None) -> None:
  """A LayerNorm's weight gradient (x and dy read whole beside per-token mean and rstd: a plain reduce, bound by its
  bytes, not a matmul's operand reuse) and its bias gradient (a sum of the same dy) are sibling reduces: their
  partial sums are one kernel of two outputs that reads dy once (GPT-2's step had a kernel of each, 25 + 13 MB on the
  H200). The gradients are torch's."""
  import torch
  x_np, dy_np = (rng.standard_normal((4, 21, 5)).astype(np.float32) for _ in range(2))
  weight_np, bias_np = rng.standard_normal(5).astype(np.float32), rng.standard_normal(5).astype(np.float32)
  x = Tensor(x_np, device="PYTHON").realize()
  weight = Tensor(weight_np, device="PYTHON", requires_grad=True)
  bias = Tensor(bias_np, device="PYTHON", requires_grad=True)
  ((x.layernorm(-1) * weight + bias) * Tensor(dy_np, device="PYTHON")).sum().backward()
  schedule = create_schedule([weight.grad.lazydata, bias.grad.lazydata])
  reduce_kernels = [item for item in schedule if item.ast.op is not Ops.PACK and _reduce_count(item)]
  # the first stage: partial sums, (parts, 5) values each of the two gradients (the rows' statistics are 84 values)
  partials = [[buffer.size for buffer in item.outputs] for item in reduce_kernels
              if all(buffer.size % 5 == 0 and buffer.size > 5 for buffer in item.outputs)]
  assert len(partials) == 1 and len(partials[0]) == 2, [[b.size for b in item.outputs] for item in reduce_kernels]
  run_schedule(schedule)
  tx, tweight, tbias = (torch.tensor(a, requires_grad=True) for a in (x_np, weight_np, bias_np))
  ((torch.nn.functional.layer_norm(tx, (5,)) * tweight + tbias) * torch.tensor(dy_np)).sum().backward()
  np.testing.assert_allclose(weight.grad.numpy(), tweight.grad.numpy(), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(bias.grad.numpy(), tbias.grad.numpy(), rtol=1e-4, atol=1e-4)
