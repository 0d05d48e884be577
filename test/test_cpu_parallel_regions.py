"""Which CPU kernels open an OpenMP parallel region, and the gated store's condition tested once per row
(linearizer._kept_gate_depth): a decode step launches ~700 small kernels, and each parallel region wakes a sleeping
thread (OMP_WAIT_POLICY=passive), so a kernel that cannot share work must not open one. Results against numpy on
CLANG and LLVM."""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.uops import AxisType, UOp, UOps
from ourgrad.device import Device
from ourgrad.dtype import dtypes
from ourgrad.engine.realize import run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.ops import Ops
from ourgrad.renderer.cpu_loops import executed_uops, leading_global_loops
from ourgrad.runtime.openmp import SPIN_COUNT, configure_wait_policy, openmp_runtime_loaded, wait_policy


def _source(tensor: Tensor, device: str = "CLANG") -> str:
  """The C source of the last kernel computing `tensor`, with the default opts (consumes the graph)."""
  item = [item for item in create_schedule([tensor.lazydata]) if item.ast.op is not Ops.COPY][-1]
  kernel = Kernel(item.ast, Device[device].renderer)
  kernel.hand_coded_optimizations()
  return Device[device].renderer.render("k", linearize(kernel))


def _range(size: int, kind: AxisType = AxisType.GLOBAL) -> UOp:
  zero, end = UOp(UOps.CONST, dtypes.int32, (), 0), UOp(UOps.CONST, dtypes.int32, (), size)
  return UOp(UOps.RANGE, dtypes.int32, (zero, end), ("i", kind))


def test_executed_uops_add_loops_one_after_another():
  """Two loops of 100 one after the other inside a loop of 10 run ~2,000 uops' worth, not 10 * 100 * 100."""
  outer, first, second = _range(10), _range(100, AxisType.REDUCE), _range(100, AxisType.REDUCE)
  body = UOp(UOps.CONST, dtypes.float32, (), 1.0)
  uops = [outer, first, body, UOp(UOps.ENDRANGE, None, (first,)), second, body, body,
          UOp(UOps.ENDRANGE, None, (second,)), UOp(UOps.ENDRANGE, None, (outer,))]
  assert executed_uops(uops) == 1 + 10 * 2 + 1000 * 3
  assert leading_global_loops(uops) == [outer]
  lane = _range(16, AxisType.UNROLL)   # a row kernel's `omp simd` lanes: one vector instruction per 8 lanes
  assert executed_uops([outer, lane, body, UOp(UOps.ENDRANGE, None, (lane,)), UOp(UOps.ENDRANGE, None, (outer,))],
                       lanes=8) == 1 + 10 + 10 * 2


def test_one_row_reduce_opens_no_parallel_region():
  """A norm's sum over one row of 20,000 (one output: nothing to share) runs on the calling thread alone."""
  x = np.random.default_rng(0).standard_normal((1, 20000)).astype(np.float32)
  source = _source((Tensor.empty(1, 20000) * Tensor.empty(1, 20000)).sum(axis=1))
  assert "omp parallel" not in source
  np.testing.assert_allclose((Tensor(x) * Tensor(x)).sum(axis=1).numpy(), (x.astype(np.float64) ** 2).sum(axis=1),
                             rtol=1e-5)


def test_many_rows_still_parallel():
  source = _source((Tensor.empty(512, 2048) * 2).sum(axis=1))
  assert "#pragma omp parallel for" in source


@pytest.mark.parametrize("device", ["CLANG", "LLVM"])
@pytest.mark.parametrize("shape", [(3, 13, 5, 7), (37, 3, 16)])
def test_gated_store_tests_its_row_mark_once(device: str, shape: tuple[int, ...]):
  """cache.assign(mark.where(new, cache)) with a mark per row (a KV cache's new slot): tested between the row loops
  and the element loops (on CLANG not collapsed past the test: the kernel compiles), and the result is numpy's."""
  rng = np.random.default_rng(sum(shape))
  rows = shape[:len(shape) - 2]
  cache_np = rng.standard_normal(shape).astype(np.float32)
  new_np = rng.standard_normal(rows + (1,) + shape[-1:]).astype(np.float32)
  mark_np = rng.random(rows + (shape[-2], 1)) < 0.3   # a mark per row of the last axis
  cache = Tensor(cache_np, device=device).contiguous().realize()
  mark, new = Tensor(mark_np, device=device), Tensor(new_np, device=device)
  cache.assign(mark.where((new * 2 + 1).expand(shape), cache)).realize()
  np.testing.assert_array_equal(cache.numpy(), np.where(mark_np, new_np * 2 + 1, cache_np))


def _marked_cache_write(slots: int, heads: int, dim: int, seed: int, slot: int):
  """A decode step's cache write (a slot index compared with a position, then the row's values times 3) on random
  values: the cache tensor, its values before, the row, the schedule and its write kernel with the CLANG heuristics."""
  rng = np.random.default_rng(seed)
  cache_np = rng.standard_normal((slots, heads, dim)).astype(np.float32)
  row_np = rng.standard_normal((1, heads, dim)).astype(np.float32)
  cache = Tensor(cache_np).contiguous().realize()
  slot_ids, position = Tensor(np.arange(slots, dtype=np.int32)), Tensor(np.array([0, slot], np.int32))
  mark = (slot_ids == position[1]).reshape(slots, 1, 1)
  cache.assign(mark.where(Tensor(row_np).expand(slots, heads, dim) * 3, cache))
  schedule = create_schedule([cache.lazydata])
  item = [item for item in schedule if item.ast.op is not Ops.COPY][-1]
  kernel = Kernel(item.ast, Device["CLANG"].renderer)
  kernel.hand_coded_optimizations()
  return cache, cache_np, row_np, schedule, kernel


def test_kv_cache_write_skips_unmarked_rows():
  """The decode step's form (a slot index compared with a position, then the row's values): the IF on the slot opens
  right inside the slot loop, every other loop inside it, and the parallel loop is the slot loop alone."""
  cache, cache_np, row_np, schedule, kernel = _marked_cache_write(40, 6, 16, seed=3, slot=17)
  uops = linearize(kernel)
  ranges = [position for position, uop in enumerate(uops) if uop.op is UOps.RANGE]
  first_if = next(position for position, uop in enumerate(uops) if uop.op is UOps.IF)
  assert ranges[0] < first_if < ranges[1], "the slot's mark tested once a slot"
  source = Device["CLANG"].renderer.render("k", uops)
  assert "collapse" not in source
  run_schedule(schedule)
  expected = cache_np.copy()
  expected[17] = row_np[0] * 3
  np.testing.assert_array_equal(cache.numpy(), expected)


def test_wait_policy_spins_only_with_an_idle_core(monkeypatch):
  """A short spin where a core is idle (load average under cores - 0.5), sleeping otherwise; a user's setting wins."""
  assert wait_policy(0.3, 2) == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
  assert wait_policy(1.5, 2) == {"OMP_WAIT_POLICY": "passive"}
  assert wait_policy(6.0, 8) == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
  for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"): monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("GOMP_SPINCOUNT", "7")
  configure_wait_policy()
  assert os.environ["GOMP_SPINCOUNT"] == "7" and "OMP_WAIT_POLICY" not in os.environ


def test_wait_policy_warns_where_libgomp_is_loaded_already(monkeypatch, tmp_path):
  """libgomp reads its environment once, when it loads: a policy set after another library loaded it (PyTorch's
  bundled libgomp) does not apply, and configure_wait_policy says so; with no libgomp mapped it sets it silently."""
  for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"): monkeypatch.delenv(name, raising=False)
  loaded, absent = tmp_path / "loaded", tmp_path / "absent"
  loaded.write_text("7f00-7f01 r-xp 0 08:01 1 /opt/torch/lib/libgomp-a34b3233.so.1\n")
  absent.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libc.so.6\n")
  assert openmp_runtime_loaded(str(loaded)) and not openmp_runtime_loaded(str(absent))
  assert not openmp_runtime_loaded(str(tmp_path / "missing"))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    configure_wait_policy(str(absent))
  assert "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
  for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"): monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("OMP_NUM_THREADS", "2")
  with pytest.warns(RuntimeWarning, match="libgomp"): configure_wait_policy(str(loaded))
  for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"): monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("OMP_NUM_THREADS", "1")   # one thread a team: nothing waits, no warning
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    configure_wait_policy(str(loaded))


def test_kv_cache_write_opens_no_parallel_region():
  """A decode step's cache write (520 slots of 6 x 64 floats, one slot marked): the work under the loaded mark's gate
  counts once, not once per slot, so the kernel runs on the calling thread (a parallel region per block's write cost
  2.4% of a 2-thread SmolLM2 decode step); the same elementwise work ungated stays parallel. Results are numpy's."""
  slots, heads, dim = 520, 6, 64
  cache, cache_np, row_np, schedule, kernel = _marked_cache_write(slots, heads, dim, seed=5, slot=300)
  assert "omp parallel" not in Device["CLANG"].renderer.render("k", linearize(kernel))
  run_schedule(schedule)
  expected = cache_np.copy()
  expected[300] = row_np[0] * 3
  np.testing.assert_array_equal(cache.numpy(), expected)
  assert "omp parallel" in _source(Tensor.empty(slots, heads, dim) * 3 + Tensor.empty(slots, heads, dim))
