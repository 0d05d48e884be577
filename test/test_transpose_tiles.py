"""Transposing elementwise kernels on GPUs (codegen/opt/transpose_tiles.py): a register tile per thread, vectors
along the input's contiguous axis for the loads and along the output's for the stores.

The kernels are optimized for CUDA's limits (the PYTHON device's EMULATE=CUDA renderer) and run on the PYTHON
interpreter against numpy; the same opts rendered as CUDA C are pinned (vector widths) and compiled with NVRTC
where it is installed. The sector counts come from the lowered index expressions (transpose_tiles.warp_sectors).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from ourgrad import Tensor, dtypes
from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.opt.transpose_tiles import (SECTOR_BYTES, footprint_efficiency, plan_for, warp_sectors,
                                                 warp_split)
from ourgrad.codegen.uops import UOps
from ourgrad.device import Buffer
from ourgrad.engine.realize import compile_kernel, run_schedule
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer

from helpers import nvrtc_compiler

rng = np.random.default_rng(11)
NVRTC = nvrtc_compiler()


def _gelu_tanh(h: np.ndarray) -> np.ndarray:
  return 0.5 * h * (1 + np.tanh(0.7978845608 * (h + 0.044715 * h ** 3)))


def _case(name: str, device: str | None = "PYTHON") -> tuple[Tensor, np.ndarray]:
  """A transposing expression on `device` (None: the default) and its numpy reference."""
  def array(*shape: int, dtype: type = np.float32) -> np.ndarray: return rng.standard_normal(shape).astype(dtype)
  def tensor(values: np.ndarray) -> Tensor: return Tensor(values, device=device)
  if name == "square_2d":
    x = array(64, 96)
    return tensor(x).T.contiguous(), x.T
  if name == "odd_2d":   # neither side a multiple of the 64 x 64 block tile, nor of 4
    x = array(45, 70)
    return tensor(x).T.contiguous(), x.T
  if name == "float16_2d":
    x = array(48, 64, dtype=np.float16)
    return tensor(x).T.contiguous(), x.T
  if name == "batched_3d":
    x = array(3, 40, 24)
    return tensor(x).permute(0, 2, 1).contiguous(), x.transpose(0, 2, 1)
  if name == "heads_to_keys_4d":   # (B, T, H, D) -> (B, H, D, T): a transposed key per head
    x = array(2, 32, 3, 16)
    return tensor(x).permute(0, 2, 3, 1).contiguous(), x.transpose(0, 2, 3, 1)
  if name == "merged_heads_transposed":   # (B, H, T, D) heads merged back into rows, then transposed: two views
    y = array(2, 3, 16, 8)
    merged = y.transpose(0, 2, 1, 3).reshape(32, 24)
    return tensor(y).permute(0, 2, 1, 3).reshape(32, 24).T.contiguous(), merged.T
  if name == "gelu_times_grad":   # an expression stored transposed
    h, g = array(32, 48), array(32, 48)
    out = (tensor(h).gelu(approximate="tanh") * tensor(g)).T.contiguous()
    return out, (_gelu_tanh(h) * g).T
  if name == "mixed_layouts":   # one input transposed, one already in the output's layout
    a, b = array(40, 64), array(64, 40)
    return (tensor(a).T * 2 + tensor(b)).contiguous(), a.T * 2 + b
  raise KeyError(name)


CASES = ["square_2d", "odd_2d", "float16_2d", "batched_3d", "heads_to_keys_4d", "merged_heads_transposed",
         "gelu_times_grad", "mixed_layouts"]


def _last_item(tensor: Tensor) -> ScheduleItem:
  schedule = create_schedule([tensor.lazydata])
  run_schedule(schedule[:-1])
  return schedule[-1]


def _run(kernel: Kernel, item: ScheduleItem) -> np.ndarray:
  runner = compile_kernel(kernel, "PYTHON")
  output = Buffer("PYTHON", item.outputs[0].size, item.outputs[0].dtype).allocate()
  runner((output,) + item.inputs)
  return output.numpy()


@pytest.mark.parametrize("name", CASES)
def test_transpose_tiles_match_numpy_on_emulated_cuda(name: str) -> None:
  result, expected = _case(name)
  item = _last_item(result)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  assert plan_for(kernel) is not None, f"{name}: not taken for a transpose"
  kernel.hand_coded_optimizations()
  upcasts = [opt for opt in kernel.applied_opts if opt.op is OptOps.UPCAST]
  assert len(upcasts) == 2, kernel.applied_opts   # a tile along both axes
  got = _run(kernel, item).reshape(expected.shape)
  tolerance = 1e-2 if expected.dtype == np.float16 else 1e-5
  np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)
  if NVRTC is not None:
    cuda = Kernel(item.ast, CUDARenderer())
    cuda.hand_coded_optimizations()
    NVRTC.compile(CUDARenderer().render(cuda.name, linearize(cuda)))


@pytest.mark.parametrize("name", CASES)
def test_transposes_match_numpy_on_default_device(name: str) -> None:
  """The same expressions through the Tensor API on the default device (CLANG in CI: the plan is GPU-only)."""
  result, expected = _case(name, None)
  got = result.numpy()
  tolerance = 1e-2 if expected.dtype == np.float16 else 1e-5
  np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)


def _cuda_kernel(build: Callable[[], Tensor]) -> Kernel:
  item = create_schedule([build().lazydata])[-1]
  return Kernel(item.ast, CUDARenderer())


def test_pinned_2d_transpose_cuda_source() -> None:
  """x.T.contiguous() of 4096 x 2304 float32 on CUDA: 16 x 16 threads of 4 x 4 elements, four float4 loads along the
  input's rows and four float4 stores along the output's."""
  kernel = _cuda_kernel(lambda: Tensor.empty(4096, 2304, device="PYTHON").T.contiguous())
  kernel.hand_coded_optimizations()
  assert kernel.applied_opts == [Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.LOCAL, 1, 16),
                                 Opt(OptOps.LOCAL, 0, 16)]
  source = CUDARenderer().render(kernel.name, linearize(kernel))
  assert source.count("*((const float4*)(data1+") == 4
  assert source.count("*((float4*)(data0+") == 4
  assert "data1[" not in source and "data0[" not in source   # no scalar access left
  if NVRTC is not None: NVRTC.compile(source)


def test_warp_sectors_before_and_after() -> None:
  """The coalescing model for x.T.contiguous() of 4096 x 2304 float32: the previous default (a float4 load down the
  input's rows per lane, lanes along the output's rows: 32 rows apart) touches 32 sectors for 512 bytes per load
  instruction; the tile 16 sectors (every sector whole) for each load and store."""
  build = lambda: Tensor.empty(4096, 2304, device="PYTHON").T.contiguous()   # noqa: E731
  before = _cuda_kernel(build)
  for opt in (Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.LOCAL, 1, 128)): before.apply_opt(opt)
  accesses = warp_sectors(linearize(before))
  loads = [access for access in accesses if access.op is UOps.LOAD]
  stores = [access for access in accesses if access.op is UOps.STORE]
  assert [(access.lane_bytes, access.sectors) for access in loads] == [(16, 32)]
  assert [(access.lane_bytes, access.sectors) for access in stores] == [(4, 4)] * 4
  after = _cuda_kernel(build)
  after.hand_coded_optimizations()
  accesses = warp_sectors(linearize(after))
  assert len(accesses) == 8
  assert all(access.lane_bytes == 16 and access.sectors == 32 * 16 // SECTOR_BYTES for access in accesses)
  assert footprint_efficiency(accesses, UOps.LOAD) == footprint_efficiency(accesses, UOps.STORE) == 1.0


def test_warp_split_covers_sectors() -> None:
  """float32 tiles (16 bytes a lane each way): any split with two lanes or more a side is whole sectors, the longer
  stores win; float16 tiles (8 bytes) need four lanes a side."""
  assert warp_split(16, 16) == 16
  assert warp_split(8, 8) == 8


@pytest.mark.parametrize("build", [
  lambda: (Tensor.empty(64, 96, device="PYTHON") + 1).contiguous(),                             # no transpose
  lambda: Tensor.empty(8, 64, 12, 64, device="PYTHON").permute(0, 2, 1, 3).contiguous(),       # rows move whole
  lambda: Tensor.empty(4096, 3, device="PYTHON").T.contiguous(),                                # under a sector
  lambda: Tensor.empty(64, 96, device="PYTHON").T.sum(axis=1),                                  # a reduce
], ids=["elementwise", "head_permute", "narrow", "reduce"])
def test_not_a_transpose_keeps_the_default(build: Callable[[], Tensor]) -> None:
  assert plan_for(_cuda_kernel(build)) is None


def test_half_dtype_plan() -> None:
  """float16: the split keeps 4 lanes along the input so a warp's 8-byte runs fill 32-byte sectors."""
  kernel = _cuda_kernel(lambda: Tensor.empty(2048, 1024, dtype=dtypes.float16, device="PYTHON").T.contiguous())
  plan = plan_for(kernel)
  assert plan is not None and (plan.out_lanes, plan.in_lanes) == (8, 32)


def test_small_transposed_input_keeps_the_default() -> None:
  """A per-row vector read across the output (LayerNorm's statistics, contiguous along the rows) is no transpose:
  the big inputs share the output's layout."""
  def build() -> Tensor:
    x, stats = Tensor.empty(4096, 768, device="PYTHON"), Tensor.empty(4096, 1, device="PYTHON")
    return (x * stats).contiguous()
  assert plan_for(_cuda_kernel(build)) is None


def test_merged_heads_transpose_loads_float4() -> None:
  """y (B, H, T, D) with its heads merged back into rows, transposed (attention's output as a staged matmul operand):
  two views, no single stride along the 768 axis, yet each thread's 4 elements along it are neighbours (within a
  head's D): four float4 loads, proven from the index expressions."""
  def build() -> Tensor:
    return Tensor.empty(8, 12, 512, 64, device="PYTHON").permute(0, 2, 1, 3).reshape(4096, 768).T.contiguous()
  kernel = _cuda_kernel(build)
  kernel.hand_coded_optimizations()
  source = CUDARenderer().render(kernel.name, linearize(kernel))
  assert source.count("*((const float4*)(data1+") == 4 and source.count("*((float4*)(data0+") == 4
  if NVRTC is not None: NVRTC.compile(source)


def test_symbolic_size_keeps_the_default() -> None:
  """A transpose with a symbolic (Variable) size: no tile (PADTO and the block's divisions need numbers)."""
  from ourgrad.shape.symbolic import Variable
  rows = Variable("rows", 1, 64).bind(32)
  kernel = _cuda_kernel(lambda: Tensor.empty(64, 48, device="PYTHON").shrink(((0, rows), None)).T.contiguous())
  assert plan_for(kernel) is None
