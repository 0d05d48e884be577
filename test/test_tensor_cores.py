"""Tensor cores (OptOps.TC, the WMMA uop): mma.sync m16n8k16 with float16/bfloat16 inputs and float32 accumulation.

TC kernels run on the PYTHON device with CUDA's limits (`PythonRenderer("CUDA")`, as `DEVICE=PYTHON EMULATE=CUDA`),
whose interpreter gathers each warp's fragments with the PTX ISA's lane maps and multiplies in float32; they must
give the plain kernel's (NOOPT) results, with an error against a float64 reference no worse than PyTorch's matmul in
the same dtype. Every TC kernel is also rendered as CUDA C++ and compiled with NVRTC for sm_90 when it is installed.
The shared-memory tiles of float32 matmuls (OptOps.SHARED) are tested the same way at the end.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ourgrad import Tensor, dtypes
from ourgrad.codegen.kernel import Kernel, KernelOptError, Opt, OptOps
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.opt.search import candidate_opts
from ourgrad.codegen.shared_tiles import SharedStructure
from ourgrad.codegen.tensor_cores import (CUDA_TENSOR_CORES, FragmentMaps, a_position, b_position, c_position,
                                          evaluate)
from ourgrad.codegen.uops import UOps
from ourgrad.device import Buffer
from ourgrad.dtype import bfloat16_bits_to_float32
from ourgrad.engine.realize import compile_kernel, run_schedule
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.renderer.cstyle import ClangRenderer
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer

from helpers import device_opens, nvrtc_compiler

DEVICE = "PYTHON"
TC_CHOICE = {dtypes.float16: 0, dtypes.bfloat16: 1}
TORCH_DTYPE = {dtypes.float16: torch.float16, dtypes.bfloat16: torch.bfloat16}


NVRTC = nvrtc_compiler()


# ================================================================ the fragment maps against the PTX ISA's table

def test_fragment_maps_follow_the_ptx_isa() -> None:
  """The m16n8k16 .f16/.bf16 fragment layouts as the PTX ISA lists them, element by element, for every lane; and
  each map covers its matrix exactly once over a warp."""
  for lane in range(32):
    group_id, thread_in_group = lane >> 2, lane % 4
    for element in range(8):   # a0..a7: rows groupID (a0,a1,a4,a5) / groupID+8; cols +8 from a4 on
      row = group_id + (8 if element in (2, 3, 6, 7) else 0)
      column = thread_in_group * 2 + (element % 2) + (8 if element >= 4 else 0)
      assert tuple(evaluate(c, group_id, thread_in_group) for c in a_position(element)) == (row, column)
    for element in range(4):   # b0..b3: rows threadID_in_group*2 + (0,1), +8 for b2,b3; column groupID
      row = thread_in_group * 2 + (element % 2) + (8 if element >= 2 else 0)
      assert tuple(evaluate(c, group_id, thread_in_group) for c in b_position(element)) == (row, group_id)
    for element in range(4):   # c0..c3: rows groupID (c0,c1) / groupID+8; cols threadID_in_group*2 + (0,1)
      row, column = group_id + (8 if element >= 2 else 0), thread_in_group * 2 + (element % 2)
      assert tuple(evaluate(c, group_id, thread_in_group) for c in c_position(element)) == (row, column)
  for position_of, count, shape in ((a_position, 8, (16, 16)), (b_position, 4, (16, 8)), (c_position, 4, (16, 8))):
    held = np.zeros(shape, int)
    for lane in range(32):
      for element in range(count):
        held[tuple(evaluate(c, lane >> 2, lane % 4) for c in position_of(element))] += 1
    assert (held == 1).all()


# ================================================================ TC kernels against NOOPT and a float64 reference

def _operands(dtype, shape_a: tuple[int, ...], shape_b: tuple[int, ...], seed: int) -> tuple[Tensor, Tensor]:
  rng = np.random.default_rng(seed)
  tensors = []
  for shape in (shape_a, shape_b):
    values = rng.standard_normal(shape).astype(np.float32)
    tensors.append(Tensor(values, device=DEVICE).cast(dtype).realize())   # a kernel of its own: the matmul loads it
  return tensors[0], tensors[1]


def _matmul_item(a: Tensor, b: Tensor) -> ScheduleItem:
  schedule = create_schedule([(a @ b).lazydata])
  run_schedule(schedule[:-1])
  return schedule[-1]


def _run(kernel: Kernel, item: ScheduleItem) -> np.ndarray:
  if NVRTC is not None and kernel.tensor_core is not None:
    cuda = Kernel(kernel.ast, CUDARenderer())
    for opt in kernel.applied_opts: cuda.apply_opt(opt)   # every opt that fits the emulation fits CUDA
    NVRTC.compile(CUDARenderer().render(cuda.name, linearize(cuda)))
  output = Buffer(DEVICE, item.outputs[0].size, item.outputs[0].dtype).allocate()
  compile_kernel(kernel, DEVICE)((output,) + item.inputs)
  return _as_float64(output)


def _as_float64(output: Buffer) -> np.ndarray:
  """An output's values (a bfloat16 buffer reads back as its raw 16-bit patterns)."""
  values = output.numpy()
  if output.dtype == dtypes.bfloat16: values = bfloat16_bits_to_float32(values)
  return values.astype(np.float64)


def _check_against_reference(a: Tensor, b: Tensor, dtype, got: np.ndarray, plain: np.ndarray) -> None:
  """Within the plain kernel's tolerance, and a relative error against float64 no worse than PyTorch's."""
  a64, b64 = (torch.tensor(x.cast(dtypes.float32).numpy(), dtype=torch.float64) for x in (a, b))
  reference = (a64 @ b64).numpy().reshape(-1)
  torch_out = (a64.to(TORCH_DTYPE[dtype]) @ b64.to(TORCH_DTYPE[dtype])).to(torch.float64).numpy().reshape(-1)
  tolerance = 2e-2 if dtype == dtypes.float16 else 1e-1
  np.testing.assert_allclose(got, plain, rtol=tolerance, atol=tolerance)
  error = np.linalg.norm(got - reference) / np.linalg.norm(reference)
  torch_error = np.linalg.norm(torch_out - reference) / np.linalg.norm(reference)
  assert error <= 1.5 * torch_error + 1e-7, (error, torch_error)


SHAPES = {"16x8x16": ((16, 16), (16, 8)), "32x32x32": ((32, 32), (32, 32)), "64x48x32": ((64, 32), (32, 48)),
          "batched": ((3, 32, 16), (3, 16, 16))}


@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_tc_matches_noopt(dtype, shape: str) -> None:
  a, b = _operands(dtype, *SHAPES[shape], seed=len(shape))
  item = _matmul_item(a, b)
  plain = _run(Kernel(item.ast, PythonRenderer("CUDA")), item)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  kernel.apply_opt(Opt(OptOps.TC, 0, TC_CHOICE[dtype]))
  assert kernel.full_shape[-3:] == (16, 8, 16) and kernel.block_threads() == 32
  _check_against_reference(a, b, dtype, _run(kernel, item), plain)


@pytest.mark.parametrize("opts", [[Opt(OptOps.UPCAST, 0, 2), Opt(OptOps.UPCAST, 1, 2)],
                                  [Opt(OptOps.LOCAL, 1, 2), Opt(OptOps.UNROLL, 0, 2)],
                                  [Opt(OptOps.UPCAST, 1, 3), Opt(OptOps.LOCAL, 0, 2)]], ids=["tiles", "warps", "odd"])
def test_tc_with_more_opts_matches_noopt(opts: list[Opt]) -> None:
  """Several mma tiles per warp (UPCAST), several warps per block (LOCAL), an unrolled K step."""
  a, b = _operands(dtypes.float16, (64, 32), (32, 48), seed=3)
  item = _matmul_item(a, b)
  plain = _run(Kernel(item.ast, PythonRenderer("CUDA")), item)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  kernel.apply_opt(Opt(OptOps.TC, 0, 0))
  for opt in opts: kernel.apply_opt(opt)
  assert kernel.full_shape[-3:] == (16, 8, 16)
  _check_against_reference(a, b, dtypes.float16, _run(kernel, item), plain)


@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("shapes", [((64, 32), (32, 48)), ((40, 32), (32, 20)), ((2, 32, 16), (2, 16, 64))],
                         ids=["tiles", "ragged", "batched"])
def test_heuristic_picks_tc(dtype, shapes) -> None:
  """The GPU heuristic applies TC to float16/bfloat16 matmuls (padding ragged M/N first)."""
  a, b = _operands(dtype, *shapes, seed=5)
  item = _matmul_item(a, b)
  plain = _run(Kernel(item.ast, PythonRenderer("CUDA")), item)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  kernel.hand_coded_optimizations()
  assert Opt(OptOps.TC, 0, TC_CHOICE[dtype]) in kernel.applied_opts
  _check_against_reference(a, b, dtype, _run(kernel, item), plain)


@pytest.mark.parametrize("layout", ["a@b", "a@bT", "aT@b"])
def test_operand_layouts(layout: str) -> None:
  """Fragment elements 2j, 2j+1 are K neighbours: one 2-wide load where the operand is contiguous along K (A of a
  row-major a, B of a transposed b), scalar loads otherwise; every layout gives the plain kernel's results."""
  a, b = _operands(dtypes.float16, (32, 32), (32, 32), seed=4)
  left, right = {"a@b": (a, b), "a@bT": (a, b.T), "aT@b": (a.T, b)}[layout]
  item = _matmul_item(left, right)
  plain = _run(Kernel(item.ast, PythonRenderer("CUDA")), item)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  kernel.apply_opt(Opt(OptOps.TC, 0, 0))
  paired = sum(uop.op is UOps.LOAD and uop.arg == 2 for uop in linearize(kernel))
  # per mma: A has 4 pairs, B 2; a.T and a row-major b are contiguous along M and N, not K
  assert paired == {"a@b": 4, "a@bT": 6, "aT@b": 0}[layout]
  _check_against_reference(left, right, dtypes.float16, _run(kernel, item), plain)


def test_heuristic_tc_on_a_float16_convolution() -> None:
  """A padded 3x3 convolution in matmul form: K is the input channels (the filter's 3-wide axes are not a multiple
  of 16), M/N the output positions and channels; the masked (padded) input view is loaded element by element."""
  rng = np.random.default_rng(11)
  x_values, w_values = rng.standard_normal((2, 16, 8, 8)), rng.standard_normal((16, 16, 3, 3))
  x, w = (Tensor(values.astype(np.float32), device=DEVICE).cast(dtypes.float16).realize()
          for values in (x_values, w_values))
  schedule = create_schedule([x.conv2d(w, padding=1).lazydata])
  run_schedule(schedule[:-1])
  item = schedule[-1]
  plain = _run(Kernel(item.ast, PythonRenderer("CUDA")), item)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  kernel.hand_coded_optimizations()
  assert Opt(OptOps.TC, 0, 0) in kernel.applied_opts
  got = _run(kernel, item)
  np.testing.assert_allclose(got, plain, rtol=2e-2, atol=2e-2)
  x64, w64 = (torch.tensor(values.astype(np.float16).astype(np.float64)) for values in (x_values, w_values))
  reference = torch.nn.functional.conv2d(x64, w64, padding=1).numpy().reshape(-1)
  assert np.linalg.norm(got - reference) / np.linalg.norm(reference) < 1e-3   # float16 output rounding: ~3e-4


def test_a_wrong_fragment_map_fails() -> None:
  """The interpreter keeps the true B map (from the instruction table, by the WMMA's arg) while the linearizer loads
  B with C's map (rows from the lane's group, columns from its quad) through a TensorCore whose maps lie: the results
  must differ from the plain kernel's (the emulation checks the mapping, not only agrees with itself)."""
  a, b = _operands(dtypes.float16, (16, 16), (16, 8), seed=9)
  item = _matmul_item(a, b)
  plain = _run(Kernel(item.ast, PythonRenderer("CUDA")), item)
  renderer, true = PythonRenderer("CUDA"), CUDA_TENSOR_CORES[0]
  renderer.tensor_cores = (dataclasses.replace(true, maps=FragmentMaps(true.maps.a, true.maps.c, true.maps.c)),)
  kernel = Kernel(item.ast, renderer)
  kernel.apply_opt(Opt(OptOps.TC, 0, 0))
  output = Buffer(DEVICE, item.outputs[0].size, item.outputs[0].dtype).allocate()
  compile_kernel(kernel, DEVICE)((output,) + item.inputs)
  assert not np.allclose(_as_float64(output), plain, rtol=2e-2, atol=2e-2)


# ================================================================ rendering

def test_cuda_renders_mma_sync() -> None:
  a, b = _operands(dtypes.bfloat16, (32, 32), (32, 32), seed=1)
  kernel = Kernel(_matmul_item(a, b).ast, CUDARenderer())
  kernel.apply_opt(Opt(OptOps.TC, 0, 1))
  uops = linearize(kernel)
  assert sum(uop.op is UOps.WMMA for uop in uops) == 1
  source = CUDARenderer().render(kernel.name, uops)
  assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in source
  # the fragments are loaded as the 16-bit patterns the mma packs, not widened to float and narrowed back
  assert "unsigned short val0 = data" in source and "bf16_to_float(data" not in source
  if NVRTC is not None: NVRTC.compile(source)


# ================================================================ legality

def _fp16_matmul_kernel(renderer, shape_a=(32, 32), shape_b=(32, 32), dtype=dtypes.float16) -> Kernel:
  a, b = _operands(dtype, shape_a, shape_b, seed=2)
  return Kernel(_matmul_item(a, b).ast, renderer)


@pytest.mark.parametrize("case", ["float32", "bad_k", "bad_n", "clang", "python_without_emulate", "wrong_choice",
                                  "bf16_choice_on_halves", "not_first", "axis"])
def test_illegal_tc_raises(case: str) -> None:
  renderer, opt = PythonRenderer("CUDA"), Opt(OptOps.TC, 0, 0)
  shapes, dtype, before = ((32, 32), (32, 32)), dtypes.float16, []
  if case == "float32": dtype = dtypes.float32
  if case == "bad_k": shapes = ((32, 24), (24, 32))
  if case == "bad_n": shapes = ((32, 32), (32, 12))
  if case == "clang": renderer = ClangRenderer()
  if case == "python_without_emulate": renderer = PythonRenderer()
  if case == "wrong_choice": opt = Opt(OptOps.TC, 0, 2)
  if case == "bf16_choice_on_halves": opt = Opt(OptOps.TC, 0, 1)
  if case == "not_first": before = [Opt(OptOps.UPCAST, 0, 2)]
  if case == "axis": opt = Opt(OptOps.TC, 1, 0)
  kernel = _fp16_matmul_kernel(renderer, *shapes, dtype=dtype)
  for applied in before: kernel.apply_opt(applied)
  shape = kernel.full_shape
  with pytest.raises(KernelOptError): kernel.apply_opt(opt)
  assert kernel.full_shape == shape and kernel.tensor_core is None


def test_group_after_tc_raises() -> None:
  kernel = _fp16_matmul_kernel(PythonRenderer("CUDA"), (32, 64), (64, 32))
  kernel.apply_opt(Opt(OptOps.TC, 0, 0))
  with pytest.raises(KernelOptError): kernel.apply_opt(Opt(OptOps.GROUP, 0, 2))


def test_beam_sees_tc() -> None:
  """TC is among the legal opts and BEAM's candidates, once per matching tensor core."""
  kernel = _fp16_matmul_kernel(PythonRenderer("CUDA"))
  assert Opt(OptOps.TC, 0, 0) in kernel.legal_opts() and Opt(OptOps.TC, 0, 1) not in kernel.legal_opts()
  assert [opt for opt, _ in candidate_opts(kernel) if opt.op is OptOps.TC] == [Opt(OptOps.TC, 0, 0)]
  assert CUDARenderer.tensor_cores == CUDA_TENSOR_CORES


# ================================================================ shared-memory tiles (OptOps.SHARED)

SHARED_CASES = {
  "register_tile": [Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.LOCAL, 0, 4),
                    Opt(OptOps.LOCAL, 1, 8), Opt(OptOps.UNROLL, 0, 4), Opt(OptOps.SHARED, 0, 0)],
  "partial_rounds": [Opt(OptOps.LOCAL, 1, 8), Opt(OptOps.LOCAL, 0, 2), Opt(OptOps.SHARED, 0, 0),
                     Opt(OptOps.UNROLL, 0, 3)],
  "one_operand_shared": [Opt(OptOps.LOCAL, 1, 16), Opt(OptOps.UNROLL, 0, 2), Opt(OptOps.SHARED, 0, 0)],
  "padded": [Opt(OptOps.PADTO, 0, 32), Opt(OptOps.LOCAL, 0, 8), Opt(OptOps.LOCAL, 1, 4), Opt(OptOps.SHARED, 0, 0)],
}


@pytest.mark.parametrize("case", list(SHARED_CASES))
def test_shared_tiles_match_noopt(case: str) -> None:
  """Each reduce step the block loads the operands its threads share into local memory (cooperatively), waits at
  a barrier, computes from local memory and waits again; the interpreter flags a missing barrier as a race."""
  rng = np.random.default_rng(len(case))
  m = 40 if case == "padded" else 64
  a_values, b_values = rng.standard_normal((m, 48)).astype(np.float32), rng.standard_normal((48, 32)).astype(np.float32)
  item = _matmul_item(Tensor(a_values, device=DEVICE), Tensor(b_values, device=DEVICE))
  plain = _run(Kernel(item.ast, PythonRenderer("CUDA")), item)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  for opt in SHARED_CASES[case]: kernel.apply_opt(opt)
  assert len(kernel.staged_loads()) == (1 if case == "one_operand_shared" else 2)
  uops = linearize(kernel)
  assert sum(uop.op is UOps.BARRIER for uop in uops) == 2 and any(uop.op is UOps.DEFINE_LOCAL for uop in uops)
  # tiles contiguous along an innermost axis of a multiple of 4 are filled with float4 loads (not A's 2-wide K
  # unroll in one_operand_shared, not through the padded view)
  vector_fills = sum(uop.op is UOps.STORE and uop.srcs[0].op is UOps.DEFINE_LOCAL and uop.srcs[2].op is UOps.GEP
                     for uop in uops)
  assert (vector_fills > 0) == (case in ("register_tile", "partial_rounds"))
  got = _run(kernel, item)
  np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got.reshape(m, 32), a_values.astype(np.float64) @ b_values, rtol=1e-4, atol=1e-4)
  if NVRTC is not None:
    cuda = Kernel(item.ast, CUDARenderer())
    for opt in kernel.applied_opts: cuda.apply_opt(opt)
    source = CUDARenderer().render(cuda.name, linearize(cuda))
    assert "float tile0[" in source and "__syncthreads();" in source
    # aligned for its float4 reads where the threads read 4 upcast values at once
    assert ("__shared__ __align__(16) float tile0" in source) == (case == "register_tile")
    NVRTC.compile(source)


@pytest.mark.parametrize("n", [128, 64], ids=["8x8", "4x4"])
def test_heuristic_picks_shared_for_float32_matmuls(n: int) -> None:
  """A float32 matmul that divides the 128x128 block tile gets SHARED from the GPU heuristic with 8x8 outputs per
  thread (two float4 runs 64 apart along M and N), one that divides 64x64 4x4, both in reduce steps of 16 (64x64 in
  steps of 16 beat steps of 8 on the H100 at every MiniLM/SmolLM2 shape measured); 16x16 threads, the tiles double
  buffered (4 steps: the prefetch wraps to step 0 after the last). One that does not keeps the register tiles."""
  rng = np.random.default_rng(13)
  a_values, b_values = (rng.standard_normal(shape).astype(np.float32) for shape in ((128, 64), (64, n)))
  item = _matmul_item(Tensor(a_values, device=DEVICE), Tensor(b_values, device=DEVICE))
  renderer = PythonRenderer("CUDA")
  # the largest tile whose blocks fill the device (test_shared_matmul.py): 128x128 fills one processor, and 64x64
  # two (128x64 would leave one idle)
  renderer.multiprocessors = 1 if n == 128 else 2
  kernel = Kernel(item.ast, renderer)
  kernel.hand_coded_optimizations()
  per_thread = 8 if n == 128 else 4
  # registers: the outputs, and one reduce step's A and B values
  assert kernel.shared_tiles and kernel.block_threads() == 256
  assert kernel.upcast_lanes() == per_thread * per_thread + 2 * per_thread
  uops = linearize(kernel)
  tile_reads = [uop for uop in uops if uop.op is UOps.LOAD and uop.srcs[0].op is UOps.DEFINE_LOCAL]
  step = 16   # the reduce step
  assert all(uop.arg == 4 for uop in tile_reads)   # float4s
  assert len(tile_reads) == step * 2 * per_thread // 4
  # double buffered: two stages per tile and one barrier per step (plus one after step 0's stores); a 4x4 tile's 16
  # rows of 64 floats are 256 float4s, one for each of the 256 threads (a whole round)
  stages = 2
  # each tile's rows (one per reduce element) are padded by 4 floats (SHARED 0 4); the 128x128 tile's rows 8..15 are
  # 8 floats further on (SHARED_ROW_SKEW, shared_tile_plans.py LARGE_TILE_STRUCTURE)
  padding, skew = 4, (8 if per_thread == 8 else 0)
  tile_sizes = [uop.arg[1] for uop in uops if uop.op is UOps.DEFINE_LOCAL]
  assert tile_sizes == [stages * (step * (16 * per_thread + padding) + skew)] * 2
  assert sum(uop.op is UOps.BARRIER for uop in uops) == 2
  np.testing.assert_allclose(_run(kernel, item).reshape(128, n), a_values.astype(np.float64) @ b_values,
                             rtol=1e-4, atol=1e-4)
  ragged = Kernel(_matmul_item(Tensor(a_values[:100], device=DEVICE), Tensor(b_values, device=DEVICE)).ast,
                  PythonRenderer("CUDA"))
  ragged.hand_coded_optimizations()
  assert not ragged.shared_tiles


def test_shared_tiles_with_an_epilogue_load() -> None:
  """x @ x + x: the epilogue's load of x reads global memory, not the last reduce step's tile."""
  values = np.random.default_rng(12).standard_normal((16, 16)).astype(np.float32)
  x = Tensor(values, device=DEVICE)
  schedule = create_schedule([(x @ x + x).lazydata])
  run_schedule(schedule[:-1])
  item = schedule[-1]
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  for opt in [Opt(OptOps.LOCAL, 0, 4), Opt(OptOps.LOCAL, 1, 4), Opt(OptOps.UNROLL, 0, 4), Opt(OptOps.SHARED, 0, 0)]:
    kernel.apply_opt(opt)
  np.testing.assert_allclose(_run(kernel, item).reshape(16, 16), values.astype(np.float64) @ values + values,
                             rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["clang", "no_threads_share", "after_grouptop", "twice", "with_tc", "too_big"])
def test_illegal_shared_raises(case: str) -> None:
  renderer = ClangRenderer() if case == "clang" else PythonRenderer("CUDA")
  dtype = dtypes.float16 if case == "with_tc" else dtypes.float32
  shapes = ((128, 256), (256, 128)) if case == "too_big" else ((32, 64), (64, 32))
  kernel = _fp16_matmul_kernel(renderer, *shapes, dtype=dtype)
  before = {"after_grouptop": [Opt(OptOps.LOCAL, 0, 2), Opt(OptOps.GROUPTOP, 0, 4)],   # GROUP does combine
            "twice": [Opt(OptOps.LOCAL, 0, 2), Opt(OptOps.SHARED, 0, 0)],
            "with_tc": [Opt(OptOps.TC, 0, 0), Opt(OptOps.UNROLL, 0, 4)],
            "too_big": [Opt(OptOps.LOCAL, 0, 64), Opt(OptOps.LOCAL, 1, 16), Opt(OptOps.SHARED, 0, 0),
                        Opt(OptOps.UNROLL, 0, 128)]}.get(case, [])
  for opt in before: kernel.apply_opt(opt)
  shape = kernel.full_shape
  with pytest.raises(KernelOptError):
    # with_tc: staged tensor-core tiles need one reduce loop (the unroll took all of K); too_big: 40 KB of tiles
    # fit in CUDA's 48 KB; two rows per thread make A's tile 64 KB
    kernel.apply_opt(Opt(OptOps.UPCAST, 0, 2) if case == "too_big" else Opt(OptOps.SHARED, 0, 0))
  assert kernel.full_shape == shape


def test_beam_sees_shared() -> None:
  kernel = _fp16_matmul_kernel(PythonRenderer("CUDA"), dtype=dtypes.float32)
  plain_rows = Opt(OptOps.SHARED, 0, 0, SharedStructure())
  assert plain_rows not in kernel.legal_opts()   # no LOCAL axis yet: no thread shares a load
  kernel.apply_opt(Opt(OptOps.LOCAL, 0, 4))
  assert plain_rows in kernel.legal_opts()
  assert plain_rows in [opt for opt, _ in candidate_opts(kernel)]


# ================================================================ on a real GPU (skipped without one)



@pytest.mark.skipif(not device_opens("CUDA"), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("shapes", [((64, 32), (32, 48)), ((100, 64), (64, 72)), ((3, 128, 64), (3, 64, 256))],
                         ids=["tiles", "ragged", "batched"])
def test_tc_on_cuda(dtype, shapes) -> None:
  """The hand-coded kernel (TC) on the GPU: the mma's real fragment layout, checked against float64 like the
  emulated tests."""
  from ourgrad.device import Device
  rng = np.random.default_rng(21)
  a, b = (Tensor(rng.standard_normal(shape).astype(np.float32), device="CUDA").cast(dtype).realize()
          for shape in shapes)
  schedule = create_schedule([(a @ b).lazydata])
  run_schedule(schedule[:-1])
  item = schedule[-1]
  kernel = Kernel(item.ast, Device["CUDA"].renderer)
  kernel.hand_coded_optimizations()
  assert Opt(OptOps.TC, 0, TC_CHOICE[dtype]) in kernel.applied_opts
  output = Buffer("CUDA", item.outputs[0].size, item.outputs[0].dtype).allocate()
  compile_kernel(kernel, "CUDA")((output,) + item.inputs)
  plain = Buffer("CUDA", item.outputs[0].size, item.outputs[0].dtype).allocate()
  compile_kernel(Kernel(item.ast, Device["CUDA"].renderer), "CUDA")((plain,) + item.inputs)
  _check_against_reference(a, b, dtype, _as_float64(output), _as_float64(plain))
