"""Typed plans (codegen/opt/plans.py): each strategy's plan computes what the unoptimized (NOOPT) kernel computes, on
random small shapes, layouts and dtypes, with the kernels lowered for CUDA and run on the PYTHON device's emulator
(`EMULATE=CUDA` limits: PythonRenderer("CUDA"), "CUDA_SM90" for WGMMA) and on CLANG, against a float64 reference;
every plan prints, goes through JSON and BEAM's cache, and replays to the same kernel source.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ourgrad import Tensor, dtypes
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.lowering import lower_kernel
from ourgrad.codegen.opt import beam_cache, search, tensor_core_plans
from ourgrad.codegen.opt.conv_tiles import (CONV_TILES, WEIGHT_GRADIENT_TILES, ConvTilePlan, TensorCoreConvPlan,
                                            WeightGradientPlan)
from ourgrad.codegen.opt.heuristic import STRATEGIES, ThinMatmulPlan
from ourgrad.codegen.opt.plans import OptsPlan, Plan, plan_from_json, plan_to_json, replay
from ourgrad.codegen.opt.shared_tile_plans import LARGE_TILE_STRUCTURE, SharedTilePlan
from ourgrad.codegen.opt.tensor_core_plans import TensorCorePlan, TensorCoreTile, WgmmaPlan
from ourgrad.codegen.opt.transpose_tiles import TransposeTile
from ourgrad.codegen.opt.window_tiles import ThreadWalkPlan
from ourgrad.codegen.opts import Opt, OptOps, TileStages
from ourgrad.codegen.shared_tiles import SharedStructure
from ourgrad.device import Buffer, Device
from ourgrad.dtype import DType, bfloat16_bits_to_float32
from ourgrad.engine.realize import compile_kernel, run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.helpers import _float32_matmul_precision, set_float32_matmul_precision
from ourgrad.runtime.ops_python import PythonRenderer

# (renderer kind, device that runs it, dtype, batch, M, K, N, A transposed, the plan class the heuristic must pick)
CASES = {
  "shared_tiles": ("CUDA", "PYTHON", dtypes.float32, (), 64, 32, 64, False, SharedTilePlan),
  "shared_tiles_batched_transposed": ("CUDA", "PYTHON", dtypes.float32, (3,), 32, 40, 48, True, SharedTilePlan),
  "tc_staged_ragged": ("CUDA", "PYTHON", dtypes.float16, (), 48, 32, 80, False, TensorCorePlan),
  "tc_staged_bfloat16_transposed": ("CUDA", "PYTHON", dtypes.bfloat16, (), 64, 48, 64, True, TensorCorePlan),
  "tc_unstaged_batched": ("CUDA", "PYTHON", dtypes.float16, (2,), 16, 32, 24, False, TensorCorePlan),
  "tf32_staged": ("CUDA", "PYTHON", dtypes.float32, (), 128, 32, 128, False, TensorCorePlan),
  "wgmma": ("CUDA_SM90", "PYTHON", dtypes.float16, (), 128, 64, 256, False, WgmmaPlan),
  "thin_rows": ("CUDA", "PYTHON", dtypes.float32, (), 64, 256, 10, False, ThinMatmulPlan),
  "thin_columns": ("CUDA", "PYTHON", dtypes.float32, (), 64, 256, 10, True, ThinMatmulPlan),
  "clang_matmul": ("CLANG", "CLANG", dtypes.float32, (), 24, 40, 32, True, OptsPlan),
}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
  """Each test its own cache folder (BEAM's sqlite file), WGMMA for small matmuls, and the default float32 matmul
  precision afterwards."""
  monkeypatch.setenv("OURGRAD_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(tensor_core_plans, "WGMMA_MIN_WORK", 1)
  monkeypatch.setattr(tensor_core_plans, "TF32_MIN_BLOCKS", 1)
  yield
  _float32_matmul_precision[0] = None


def _renderer(kind: str):
  return Device["CLANG"].renderer if kind == "CLANG" else PythonRenderer(kind)


def _case(name: str, seed: int = 0):
  """(schedule item of the matmul, the float64 reference, renderer, device, dtype, expected plan class)."""
  kind, device, dtype, batch, m, k, n, transposed, plan_class = CASES[name]
  if plan_class is TensorCorePlan and dtype == dtypes.float32: set_float32_matmul_precision("high")
  rng = np.random.default_rng(seed)
  a_values = rng.standard_normal((*batch, k, m) if transposed else (*batch, m, k)).astype(np.float32)
  b_values = rng.standard_normal((*batch, k, n)).astype(np.float32)
  a = Tensor(a_values, device=device).cast(dtype).realize()
  b = Tensor(b_values, device=device).cast(dtype).realize()
  schedule = create_schedule([((a.transpose(-1, -2) if transposed else a) @ b).lazydata])
  run_schedule(schedule[:-1])
  a64, b64 = (x.cast(dtypes.float32).numpy().astype(np.float64) for x in (a, b))
  reference = (np.swapaxes(a64, -1, -2) if transposed else a64) @ b64
  return schedule[-1], reference.reshape(-1), _renderer(kind), device, dtype, plan_class


def _run(kernel: Kernel, item, device: str) -> np.ndarray:
  output = Buffer(device, item.outputs[0].size, item.outputs[0].dtype).allocate()
  compile_kernel(kernel, device)((output,) + item.inputs)
  values = output.numpy()
  if output.dtype == dtypes.bfloat16: values = bfloat16_bits_to_float32(values)
  return values.astype(np.float64)


def _tolerance(dtype: DType, tf32: bool) -> float:
  return {dtypes.float16: 2e-2, dtypes.bfloat16: 1e-1}.get(dtype, 2e-2 if tf32 else 1e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_plan_matches_noopt_and_float64(name: str, monkeypatch) -> None:
  """The heuristic picks the case's plan class; its kernel and the plain (NOOPT) kernel both match float64."""
  item, reference, renderer, device, dtype, plan_class = _case(name)
  if device == "PYTHON": monkeypatch.setattr(Device["PYTHON"], "renderer", renderer)   # lowered as for that GPU
  plain, optimized = Kernel(item.ast, renderer), Kernel(item.ast, renderer)
  optimized.hand_coded_optimizations()
  assert isinstance(optimized.plan, plan_class), (name, optimized.plan)
  tolerance = _tolerance(dtype, plan_class is TensorCorePlan and dtype == dtypes.float32)
  scale = np.abs(reference).max()
  got, expected = _run(optimized, item, device), _run(plain, item, device)
  np.testing.assert_allclose(expected / scale, reference / scale, atol=tolerance)
  np.testing.assert_allclose(got / scale, reference / scale, atol=tolerance)


def _source(kernel: Kernel) -> str:
  return lower_kernel(kernel, kernel.renderer, "kernel").source


@pytest.mark.parametrize("name", list(CASES))
def test_plan_round_trips_through_the_beam_cache(name: str) -> None:
  """The heuristic's plan, stored by BEAM's cache and read back, is equal to it and replays on a fresh kernel to the
  same opts and byte-identical source."""
  item, _, renderer, device, _, plan_class = _case(name)
  optimized = Kernel(item.ast, renderer)
  optimized.hand_coded_optimizations()
  key = beam_cache.cache_key(item.ast, device, 2)
  beam_cache.cache_put(key, optimized.name, search.plan_of(optimized))
  cached = beam_cache.cache_get(key)
  assert cached == optimized.plan and isinstance(cached, plan_class)
  replayed = replay(cached, Kernel(item.ast, renderer))
  assert replayed.applied_opts == optimized.applied_opts
  assert _source(replayed) == _source(optimized)


PLANS: list[Plan] = [
  WgmmaPlan(256, 4, specialized=True), WgmmaPlan(128, 2, deep=True),
  TensorCorePlan(0, TensorCoreTile(4, 8, 2, 2), k_steps=4), TensorCorePlan(2, TensorCoreTile(2, 4, 1, 1), staged=False),
  SharedTilePlan(16, 8, 2, 4, 16, 1, LARGE_TILE_STRUCTURE), SharedTilePlan(4, 4, 1, 1, 8, group=2),
  ThinMatmulPlan(True, 8, 32, 4), ConvTilePlan(CONV_TILES[2]), TensorCoreConvPlan(1, batch_warps=False, k_steps=1),
  WeightGradientPlan(WEIGHT_GRADIENT_TILES[0]),
  OptsPlan("search", (Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.SHARED, 0, 4))),
  # the WGMMA grid fields, and a BEAM result holding a WGMMA Opt whose arg is a WgmmaTile
  WgmmaPlan(192, 5, specialized=True, block_m=64, ctas_per_sm=2, persistent=True),
  OptsPlan("search", (WgmmaPlan(128, 6, specialized=True, persistent=True).opt,)),
  # the thread walks of window_tiles.py (a pool's window, rows of float4 lanes) and a transposing copy's tile
  ThreadWalkPlan(2, (), ((3, 12), (2, 12))), ThreadWalkPlan(0, (2, 4), ((2, 6), (1, 24)), (0, 2)),
  TransposeTile(1, 0, 4, 4, 16, 16, out_pad=64),
  # a BEAM result holding SHARED's typed args
  OptsPlan("search", (Opt(OptOps.SHARED, 0, 0, LARGE_TILE_STRUCTURE), Opt(OptOps.SHARED, 0, 0, TileStages(3)))),
]


@pytest.mark.parametrize("build, plan_class", [
  (lambda: Tensor.empty(32, 8, 24, 24, device="PYTHON").max_pool2d(2), ThreadWalkPlan),
  (lambda: Tensor.empty(64, 24, 32, device="PYTHON")[:, :, :24] * 2 + 1, ThreadWalkPlan),
  (lambda: Tensor.empty(256, 512, device="PYTHON").T.contiguous(), TransposeTile),
], ids=["window", "elementwise_rows", "transpose"])
def test_thread_walk_and_transpose_plans_replay(build, plan_class) -> None:
  """A max-pool, an elementwise kernel over rows of 24 and a transposing copy get their typed plans (window_tiles.py,
  transpose_tiles.py); each plan, through BEAM's cache, replays to the same opts and source."""
  renderer = PythonRenderer("CUDA")
  item = create_schedule([build().lazydata])[-1]
  optimized = Kernel(item.ast, renderer)
  optimized.hand_coded_optimizations()
  assert isinstance(optimized.plan, plan_class), optimized.plan
  key = beam_cache.cache_key(item.ast, "PYTHON", 2)
  beam_cache.cache_put(key, optimized.name, search.plan_of(optimized))
  replayed = replay(beam_cache.cache_get(key), Kernel(item.ast, renderer))
  assert replayed.applied_opts == optimized.applied_opts and _source(replayed) == _source(optimized)


@pytest.mark.parametrize("plan", PLANS, ids=repr)
def test_plan_json_round_trip_and_repr(plan: Plan) -> None:
  """plan -> JSON text -> plan is the same plan; its repr names its class and fields (no packed amounts)."""
  assert plan_from_json(json.loads(json.dumps(plan_to_json(plan)))) == plan
  assert repr(plan).startswith(type(plan).__name__ + "(")


def test_readable_reprs() -> None:
  assert repr(WgmmaPlan(256, 4, specialized=True)) == ("WgmmaPlan(block_n=256, stages=4, specialized=True, deep=False, "
                                                       "block_m=128, ctas_per_sm=1, persistent=False)")
  assert "SharedStructure(pad 4, VECTOR_FILL|TWO_BLOCKS|ROW_SKEW)" in repr(PLANS[4])


def test_bad_plan_json_is_refused_and_old_cache_entries_read() -> None:
  """Data that names no plan is a ValueError (the cache then reads it as not cached); an entry of the format before
  plans (a list of Opts) reads as their OptsPlan."""
  for data in ({"type": "NoSuchPlan"}, {"type": "WgmmaPlan", "block_n": 128, "wrong": 1}, [1, 2], 3):
    with pytest.raises(ValueError): plan_from_json(data)
  with beam_cache._connect() as connection:
    connection.execute("INSERT INTO beam VALUES (?, ?, ?)", ("old", "r_8_8", json.dumps([["UPCAST", 0, 4]])))
    connection.execute("INSERT INTO beam VALUES (?, ?, ?)", ("bad", "r_8_8", json.dumps({"type": "NoSuchPlan"})))
  assert beam_cache.cache_get("old") == OptsPlan("search", (Opt(OptOps.UPCAST, 0, 4),))
  assert beam_cache.cache_get("bad") is None


def test_one_registry_orders_the_heuristic_and_lists_beams_owned_actions() -> None:
  """STRATEGIES is the heuristic's order (the matmul strategies before the generic loop tiles, which come last and
  take any kernel), and BEAM's actions for TC, SHARED and WGMMA are the ones the strategies list."""
  names = [strategy.name for strategy in STRATEGIES]
  assert names.index("wgmma") < names.index("tensor_cores") < names.index("shared_tiles") < names.index("loop_tiles")
  assert names[-1] == "loop_tiles" and len(set(names)) == len(names)
  item, *_ = _case("wgmma")
  kernel = Kernel(item.ast, PythonRenderer("CUDA_SM90"))
  actions = list(search._all_actions(kernel))
  assert [opt for opt in actions if opt.op is OptOps.WGMMA] == [plan.opt for plan in tensor_core_plans.WGMMA_SEARCH]
  assert WgmmaPlan(256, 4, specialized=True).opt in actions
  shared = {opt.arg for opt in actions if opt.op is OptOps.SHARED}
  assert shared == {SharedStructure(), SharedStructure(padding=4), LARGE_TILE_STRUCTURE}


@pytest.mark.parametrize("dtype, channels, plan_class", [(dtypes.float32, 8, ConvTilePlan),
                                                          (dtypes.float16, 32, TensorCoreConvPlan)])
def test_conv_plan_matches_noopt_and_torch_and_replays(monkeypatch, dtype: DType, channels: int, plan_class) -> None:
  """A convolution (64 channels, 3x3, pad 1) takes its plan on the emulated GPU (float32: a ConvTilePlan, float16:
  the staged tensor-core conv); it matches the plain kernel and torch in float64, and replays from BEAM's cache to
  the same source."""
  monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer("CUDA"))
  rng = np.random.default_rng(3)
  x_values, w_values = rng.standard_normal((2, channels, 8, 8)), rng.standard_normal((64, channels, 3, 3))
  x = Tensor(x_values.astype(np.float32), device="PYTHON").cast(dtype).realize()
  w = Tensor(w_values.astype(np.float32), device="PYTHON").cast(dtype).realize()
  schedule = create_schedule([x.conv2d(w, padding=1).lazydata])
  run_schedule(schedule[:-1])
  item = schedule[-1]
  plain, tiled = Kernel(item.ast, PythonRenderer("CUDA")), Kernel(item.ast, PythonRenderer("CUDA"))
  tiled.hand_coded_optimizations()
  assert isinstance(tiled.plan, plan_class), tiled.plan
  reference = torch.nn.functional.conv2d(torch.from_numpy(x.numpy().astype(np.float64)),
                                         torch.from_numpy(w.numpy().astype(np.float64)), padding=1).numpy()
  scale, tolerance = np.abs(reference).max(), 1e-5 if dtype == dtypes.float32 else 2e-3
  for kernel in (plain, tiled):
    np.testing.assert_allclose(_run(kernel, item, "PYTHON") / scale, reference.reshape(-1) / scale, atol=tolerance)
  key = beam_cache.cache_key(item.ast, "PYTHON", 2)
  beam_cache.cache_put(key, tiled.name, tiled.plan)
  assert _source(replay(beam_cache.cache_get(key), Kernel(item.ast, PythonRenderer("CUDA")))) == _source(tiled)
