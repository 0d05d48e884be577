"""Row kernels on CPUs (codegen/row_linearizer.py): a thread per row, lanes at SIMD width, exp(x - max) computed once
and kept in a per-row array, exp2 as vectorizable arithmetic.

vector_exp2 is checked against numpy's exp2 over its whole range (NaN, infinities, overflow, gradual underflow) on the
CLANG device and in the PYTHON interpreter; the row kernels against PyTorch on rows with extreme values; the kernel
structure (lanes, kept values, no libm exp2f call) is pinned on the generated C.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.vector_exp2 import vector_exp2
from ourgrad.codegen.uops import AxisType, UOpBuilder, UOps
from ourgrad.device import Buffer, Device
from ourgrad.dtype import dtypes
from ourgrad.engine.realize import load_program
from ourgrad.engine.schedule import create_schedule
from ourgrad.renderer.cpu_loops import C_PREAMBLE
from ourgrad.renderer.cstyle import ClangRenderer

from helpers import ROW_NORMALIZATIONS


def _exp2_inputs() -> np.ndarray:
  rng = np.random.default_rng(0)
  special = [np.nan, np.inf, -np.inf, 0.0, 1.0, -1.0, 0.5, -0.5, 127.9, 127.99, 128.0, 129.0, -126.0, -125.5, -126.5,
             -140.3, -149.0, -150.0, -1e30, 1e30]
  return np.concatenate([np.linspace(-300, 300, 20001), rng.uniform(-30, 30, 20000), special]).astype(np.float32)


def _run_exp2(device: str, x: np.ndarray, simd: bool = False) -> np.ndarray:
  """out[i] = vector_exp2(in[i]): a loop on the CPU (with `simd`, an `omp simd` loop, vectorized at the SIMD width of
  CLANG_MARCH as in the row kernels: CI runs this file at -march=x86-64-v2 and -v3 too), a thread per element in the
  interpreter."""
  build, count = UOpBuilder(), len(x)
  out = build.add(UOps.DEFINE_GLOBAL, dtypes.float32, (), (0, True))
  source = build.add(UOps.DEFINE_GLOBAL, dtypes.float32, (), (1, False))
  threads = Device[device].renderer.has_threads
  if threads: index = build.add(UOps.SPECIAL, dtypes.int32, (), ("gidx0", count, 0, AxisType.GLOBAL))
  else:
    index = build.add(UOps.RANGE, dtypes.int32, (build.const(0, dtypes.int32), build.const(count, dtypes.int32)),
                      ("gidx0", AxisType.UNROLL if simd else AxisType.GLOBAL))
  value = build.add(UOps.LOAD, dtypes.float32, (source, index))
  build.add(UOps.STORE, None, (out, index, vector_exp2(build, value)))
  if not threads: build.end_range(index)
  program = load_program(device, "exp2_check", Device[device].renderer.render("exp2_check", build.uops))
  output, inputs = Buffer(device, count, dtypes.float32).allocate(), Buffer(device, count, dtypes.float32).allocate()
  inputs.copyin(memoryview(x.tobytes()))
  program(output.handle, inputs.handle, global_size=(count, 1, 1) if threads else (), wait=True)
  return output.numpy()


@pytest.mark.parametrize("device, simd", [("CLANG", False), ("CLANG", True), ("PYTHON", False)])
def test_vector_exp2_is_within_one_ulp_everywhere(device: str, simd: bool):
  x = _exp2_inputs()
  got = _run_exp2(device, x, simd)
  with np.errstate(over="ignore"):
    expected = np.exp2(x.astype(np.float64)).astype(np.float32)
  np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
  np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
  normal = np.isfinite(expected) & (expected >= np.finfo(np.float32).tiny)
  ulps = np.abs(got[normal].view(np.int32).astype(np.int64) - expected[normal].view(np.int32).astype(np.int64))
  assert ulps.max() <= 1
  subnormal = np.isfinite(expected) & ~normal
  np.testing.assert_allclose(got[subnormal], expected[subnormal], rtol=0, atol=2e-45)


def _c_source(out: Tensor) -> str:
  item = create_schedule([out.lazydata])[-1]
  kernel = Kernel(item.ast, ClangRenderer())
  return ClangRenderer().render(kernel.name, linearize(kernel))


def test_softmax_computes_exp_once_in_vector_lanes():
  source = _c_source(Tensor.empty(8, 4096).softmax(-1))
  assert "exp2f(" not in source.replace(C_PREAMBLE, ""), "exp2 is arithmetic the compiler vectorizes, not a libm call"
  assert source.count("#pragma omp simd") == 3, "max, sum of exp and store: one vector loop each"
  assert source.count("kept0[") == 3, "declared, written in the sum pass, read by the store pass"
  assert source.count("12582912.0f") == 2, "one exp2 (its rounding constant added and taken away once)"
  # the lanes' max stays a `?:` gcc vectorizes; the scalar bit-select helper kept softmax scalar (2x PyTorch's time)
  assert "fmax_nan" not in source and "fsel(" not in source


def test_kernels_without_lanes_keep_branch_free_selects():
  """The same renderer, right after a row kernel, still writes the bit-select max for a kernel without lanes (a
  flipped view keeps an elementwise kernel out of the `omp simd` loop)."""
  _c_source(Tensor.empty(8, 4096).softmax(-1))
  assert "fmax_nan(" in _c_source(Tensor.empty(8, 64).flip(-1).maximum(Tensor.empty(8, 64)))


def test_rows_with_integer_arithmetic_or_flipped_views_keep_one_lane():
  # lanes compile without -fwrapv (ops_clang): a kernel whose integer math could wrap keeps scalar passes
  floats, ints = Tensor.empty(8, 64), Tensor.empty(8, 64, dtype=dtypes.int32)
  assert "#pragma omp simd" in _c_source((floats * 3 - floats.max(-1, keepdim=True)).sum(-1))
  assert "#pragma omp simd" not in _c_source((ints * 3 - ints.max(-1, keepdim=True)).sum(-1))
  assert "#pragma omp simd" not in _c_source(Tensor.empty(8, 64).flip(-1).softmax(-1))


ROW_GRAPHS = {
  **{name: ROW_NORMALIZATIONS[name] for name in ("softmax", "log_softmax", "layernorm", "std")},
  "logsumexp": (lambda x: x.logsumexp(-1), lambda t: t.logsumexp(-1)),
}


@pytest.mark.parametrize("name", sorted(ROW_GRAPHS))
@pytest.mark.parametrize("shape", [(6, 64), (5, 48), (3, 100), (4, 7, 32)])
def test_cpu_row_kernels_match_torch_with_extreme_values(name: str, shape: tuple[int, ...]):
  ours, theirs = ROW_GRAPHS[name]
  x_np = np.random.default_rng(3).standard_normal(shape).astype(np.float32) * 30
  x_np.reshape(-1, shape[-1])[0, :3] = [-np.inf, 80.0, -200.0]   # a row with an exp of 0 and one of a large value
  x_np.reshape(-1, shape[-1])[1, 5] = np.inf
  x_np.reshape(-1, shape[-1])[2, 7] = np.nan
  x = Tensor(x_np, device="CLANG")
  assert len(create_schedule([ours(x).lazydata])) == 1
  with np.errstate(invalid="ignore"):
    np.testing.assert_allclose(ours(x).numpy(), theirs(torch.tensor(x_np)).numpy(), rtol=1e-5, atol=1e-5)
