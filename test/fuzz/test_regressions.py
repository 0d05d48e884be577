"""Minimized repros of failures the fuzzers in test/fuzz found, as plain tests.

A bug that is still open is marked `xfail(strict=True)`: when it gets fixed the test passes, strict xfail turns
that into a failure, and whoever fixed it removes the mark, so the fix stays covered. All the bugs below are fixed.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fuzz_graphs import device_available  # noqa: E402

from ourgrad import Tensor  # noqa: E402


def test_assign_into_empty_buffer() -> None:
  x = Tensor(np.zeros((2, 0), dtype=np.float32))
  x.assign(x + 1)
  x.realize()
  assert x.numpy().shape == (2, 0)


def test_setitem_into_empty_buffer() -> None:
  x = Tensor(np.zeros((2, 0), dtype=np.float32))
  x[0] = 3.0
  x.realize()
  assert x.numpy().shape == (2, 0)


def test_assign_view_of_itself() -> None:
  x = Tensor(np.arange(4, dtype=np.float32))
  x.assign(x.flip(0))
  np.testing.assert_array_equal(x.numpy(), [3, 2, 1, 0])


def test_assign_broadcast_row_of_itself() -> None:
  x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
  x.assign(x[1])
  np.testing.assert_array_equal(x.numpy(), [[3, 4, 5], [3, 4, 5]])


# gcc 12.2 at -O2 (its loop vectorizer) miscompiles this C, which is what CLANG renders for the kernel below; the
# CLANG device now turns gcc 12's loop vectorizer off (runtime/ops_clang.py: FLAG_RULES)
# (Opt(UNROLL, 0, 2) on the reversed axis); -O0/-O1, or -O2 -fno-tree-loop-vectorize, give 615, -O3 gives 719:
#   void f(float* restrict out, const float* restrict s, const float* restrict x) {
#     float acc = 0.0f;
#     for (int i = 0; i < 3; i++) { int j = i * -2; float v = s[0];
#                                   acc = acc + (x[j + 5] + v); acc = acc + (x[j + 4] + v); }
#     out[0] = acc;
#   }   // x = {0, 1, 2, 3, 4, 5}, s = {100}: gives 921, want 615
def test_clang_unrolled_reduce_of_flipped_view_plus_scalar() -> None:
  x = Tensor(np.arange(6, dtype=np.float32), device="CLANG")
  scalar = Tensor(np.array(100, dtype=np.float32), device="CLANG")
  assert (x.flip(0) + scalar).sum().item() == 615


# fuzz_torch found it: one multi-output kernel stored b's new value (a constant) and read b's old value for a's
# update, b's buffer passed as two `restrict` pointers with no data dependency between the load and the store;
# gcc and LLVM stored first (engine/multi_output.py `_targets_clash` now keeps the two apart)
@pytest.mark.parametrize("device", ["CLANG", "LLVM", "PYTHON"])
def test_assign_does_not_overtake_another_outputs_read_of_the_old_contents(device: str) -> None:
  if not device_available(device): pytest.skip(f"{device} does not open here")
  a_np, b_np = np.array(-2.0, dtype=np.float32), np.array(0.5, dtype=np.float32)  # one element: no loop
  a, b = Tensor(a_np, device=device), Tensor(b_np, device=device).realize()
  a -= b
  b.assign(2.0)
  total = a + (b != 0)
  total.realize()
  np.testing.assert_array_equal(a.numpy(), a_np - b_np)
  np.testing.assert_array_equal(total.numpy(), a_np - b_np + 1)
  np.testing.assert_array_equal(b.numpy(), 2.0)


# fuzz_torch found it with the views branch's cycle breaking: a snapshot of `a` (read by a - min(a, 9) and, through
# the shared min, by the comparison) was placed in graph order after the assign's value, which then joined the
# snapshot's kernel and read the snapshot's buffer before the kernel wrote it (engine/multi_output.py `_may_join`)
def test_snapshot_read_through_a_shared_subgraph_is_not_computed_in_its_readers_kernel() -> None:
  a_np = np.array([-2.75, -1.75, 2.5], dtype=np.float32)
  smallest = np.minimum(a_np, 9)
  want_new = a_np - smallest
  a = Tensor(a_np).realize()
  m = a.minimum(Tensor(np.array([9], dtype=np.int64)))
  a -= m
  picked = (m <= a).where(0.5, a)
  try:
    got = picked.numpy()
  except RuntimeError as error:  # a scheduler without cycle breaking (issue 23 item 9) refuses this graph
    if "both before and after" not in str(error): raise
    pytest.skip("this scheduler does not break read/write cycles yet")
  np.testing.assert_array_equal(got, np.where(smallest <= want_new, 0.5, want_new))
  np.testing.assert_array_equal(a.numpy(), want_new)


# fuzz_torch found it: an in-place assign passed its target as two `restrict` pointers (the output, and an input
# for the in-place read); gcc 12's SLP vectorizer then read elements it had already overwritten (one wrong bool of
# 32 here). The kernel now reads an output through the output's own argument (engine/schedule.py buffer_index)
@pytest.mark.parametrize("device", ["CLANG", "LLVM", "PYTHON"])
def test_in_place_assign_reads_its_target_through_the_output_argument(device: str) -> None:
  if not device_available(device): pytest.skip(f"{device} does not open here")
  a_np = np.array([-1.25, 2.0, 1.0, -0.5, 1.75, 3.0, 2.0, 1.25, 2.75, -3.0, 3.0, -1.25, -0.5, 2.75, -0.75, 0.25, -3.0,
                   -2.25, 0.75, -2.5, 2.25, 1.25, 0.5, -2.75, 2.75, -2.75, 0.0, -3.0, 3.0, -0.75, -0.25, 0.5],
                  dtype=np.float32).reshape(4, 4, 2)
  s_np = np.array(0.4579910933971405, dtype=np.float32)
  a, s = Tensor(a_np, device=device), Tensor(s_np, device=device)
  a -= s
  below = (s > a).numpy()
  np.testing.assert_array_equal(below, s_np > a_np - s_np)
  np.testing.assert_array_equal(a.numpy(), a_np - s_np)
