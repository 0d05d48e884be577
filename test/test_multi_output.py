"""engine/multi_output.py: which realized bases share a kernel, and its switches (SIBLING_REDUCES,
MAX_KERNEL_OUTPUTS) read where the grouping runs. Results against numpy."""
from __future__ import annotations

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.engine import multi_output
from ourgrad.engine.realize import run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.ops import Ops

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
