"""The GPU heuristic's float32 shared-memory matmul tiles (codegen/opt/shared_tile_plans.py, SharedTileStrategy).

The block tile is sized so the grid gives every multiprocessor a block (the renderer's `multiprocessors`), and
every matmul of a Linear's forward and backward is staged: transposed operands (A^T B, A B^T), batched matmuls, and
operands computed from loads (the forward's bias and ReLU fused into the next matmul and into the weight gradient).

Each choice runs on the PYTHON device with CUDA's limits (EMULATE=CUDA's renderer) and must equal the plain kernel
(NOOPT) and PyTorch's float64 result; each is also rendered as CUDA C++ and compiled by NVRTC (sm_90) where it is
installed. With DEVICE=CUDA the kernels run on the GPU instead. The choice for the shapes of the MLP training step
(bench_jit.py) is pinned on an H100's 132 multiprocessors.
"""
from __future__ import annotations

import os
from typing import Callable

import numpy as np
import pytest
import torch

from ourgrad import Tensor
from ourgrad.codegen.kernel import (SHARED_ASYNC, SHARED_REDUCE_INNER, SHARED_ROW_SKEW, SHARED_TWO_BLOCKS,
                                   SHARED_VECTOR_FILL, Kernel, KernelOptError, Opt, OptOps)
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.opt.shared_tile_plans import SHARED_TILES
from ourgrad.codegen.shared_tiles import SharedStructure, decode_shared_amount
from ourgrad.codegen.uops import UOps
from ourgrad.device import Buffer
from ourgrad.engine.realize import compile_kernel, run_schedule
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer

from helpers import device_opens, nvrtc_compiler

DEVICE = "CUDA" if os.environ.get("DEVICE") == "CUDA" else "PYTHON"
if DEVICE == "CUDA" and not device_opens("CUDA"): pytest.skip("DEVICE=CUDA but no CUDA device", allow_module_level=True)
NVRTC = nvrtc_compiler()


def _renderer(multiprocessors: int) -> PythonRenderer | CUDARenderer:
  renderer = CUDARenderer() if DEVICE == "CUDA" else PythonRenderer("CUDA")
  renderer.multiprocessors = multiprocessors
  return renderer


def _item(build: Callable[..., Tensor], shapes: list[tuple[int, ...]], seed: int) -> tuple[ScheduleItem, list]:
  """The last kernel of `build(*inputs)` over seeded random inputs (the kernels before it run), and the inputs."""
  rng = np.random.default_rng(seed)
  values = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
  schedule = create_schedule([build(*(Tensor(v, device=DEVICE) for v in values)).lazydata])
  run_schedule(schedule[:-1])
  return schedule[-1], values


def _run(kernel: Kernel, item: ScheduleItem) -> np.ndarray:
  output = Buffer(DEVICE, item.outputs[0].size, item.outputs[0].dtype).allocate()
  compile_kernel(kernel, DEVICE)((output,) + item.inputs)
  return output.numpy().astype(np.float64)


def _compile_with_nvrtc(kernel: Kernel) -> None:
  if NVRTC is None: return
  cuda = Kernel(kernel.ast, CUDARenderer())
  for opt in kernel.applied_opts: cuda.apply_opt(opt)   # every opt that fits the emulation fits CUDA
  NVRTC.compile(CUDARenderer().render(cuda.name, linearize(cuda)))


def _check_results(kernel: Kernel, item: ScheduleItem, plain: np.ndarray, build: Callable[..., Tensor],
                   values: list) -> None:
  """The kernel's results equal the plain kernel's (NOOPT) and the same ops in PyTorch in float64; NVRTC compiles it."""
  got = _run(kernel, item)
  np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-5)
  reference = build(*(torch.from_numpy(v.astype(np.float64)) for v in values)).numpy()
  np.testing.assert_allclose(got.reshape(reference.shape), reference, rtol=1e-4, atol=1e-4)
  _compile_with_nvrtc(kernel)


def _block_tile(kernel: Kernel) -> tuple[int, ...]:
  """Outputs per block along each output axis that has threads or upcasts, outermost first."""
  kinds = kernel.axis_types
  per_axis: list[int] = []
  for axis, size in enumerate(kernel.full_shape):
    if kinds[axis].name in ("LOCAL", "UPCAST"): per_axis.append(size)
  return tuple(per_axis)


def _operand_loads(kernel: Kernel) -> int:
  """Loads that vary along the reduce and along M or N (the operands, and what a fused operand computes from; a bias
  that varies along the reduce and at most a batch axis is read from global memory)."""
  k_axis = kernel.first_reduce
  return sum(1 for st, leaf in zip(kernel.sts[1:], kernel.leaves[1:])
             if leaf.op.name == "LOAD" and st.real_strides()[k_axis] != 0 and any(st.real_strides()[k_axis - 2:k_axis]))


# ---------------------------------------------------------------- layouts and fused operands against NOOPT

def _relu_bias_forward(x: Tensor, bias: Tensor, w: Tensor) -> Tensor:
  return (x + bias).relu() @ w.T   # a Linear after a Linear + ReLU: the bias and ReLU fuse into the A operand


def _relu_bias_weight_grad(g: Tensor, x: Tensor, bias: Tensor) -> Tensor:
  return g.T @ (x + bias).relu()   # a weight gradient: both operands transposed views, one computed


def _heads(qkv: Tensor, bias: Tensor, part: int) -> Tensor:
  """Q, K or V (batch, heads, tokens, head_dim) of a fused projection's output before its bias, plus the bias: the
  bias add fuses into the attention matmul's loads (MiniLM), a vector along the reduce per head."""
  return (qkv + bias.reshape(qkv.shape[2:]))[:, :, part].transpose(1, 2)


def _attention_scores(qkv: Tensor, bias: Tensor) -> Tensor:
  return _heads(qkv, bias, 0) @ _heads(qkv, bias, 1).transpose(-2, -1)


def _attention_values(probabilities: Tensor, qkv: Tensor, bias: Tensor) -> Tensor:
  return probabilities @ _heads(qkv, bias, 2)


CASES = {
  # name: (build, input shapes, multiprocessors, expected block tile)
  "a@b": (lambda a, b: a @ b, [(64, 32), (32, 64)], 4, 32 * 32),
  "a@bT": (lambda a, b: a @ b.T, [(64, 32), (64, 32)], 4, 32 * 32),
  "aT@b": (lambda a, b: a.T @ b, [(32, 64), (32, 64)], 4, 32 * 32),
  "aT@bT": (lambda a, b: a.T @ b.T, [(32, 64), (64, 32)], 2, 64 * 32),
  "batched": (lambda a, b: a @ b, [(3, 32, 16), (3, 16, 32)], 3, 32 * 32),
  "relu_bias_forward": (_relu_bias_forward, [(64, 48), (48,), (32, 48)], 4, 32 * 16),
  "relu_bias_weight_grad": (_relu_bias_weight_grad, [(32, 64), (32, 48), (48,)], 6, 32 * 16),
  "narrow_n": (lambda a, b: a @ b, [(64, 16), (16, 48)], 1, 64 * 16),
  "attention_scores_bias": (_attention_scores, [(2, 32, 3, 2, 32), (192,)], 4, 32 * 32),
  "attention_values_bias": (_attention_values, [(2, 2, 32, 32), (2, 32, 3, 2, 32), (192,)], 4, 32 * 32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_shared_tiles_match_noopt(case: str) -> None:
  """The heuristic stages every operand (both loads of a plain matmul, and the loads a fused operand reads) with
  the block tile that gives each multiprocessor a block; the results equal NOOPT and numpy's float64."""
  build, shapes, multiprocessors, block_outputs = CASES[case]
  item, values = _item(build, shapes, seed=len(case))
  plain = _run(Kernel(item.ast, _renderer(multiprocessors)), item)
  kernel = Kernel(item.ast, _renderer(multiprocessors))
  kernel.hand_coded_optimizations()
  assert kernel.shared_tiles, kernel.applied_opts
  assert len(kernel.staged_loads()) == _operand_loads(Kernel(item.ast, _renderer(multiprocessors)))
  assert np.prod(_block_tile(kernel)) == block_outputs, kernel.applied_opts
  _check_results(kernel, item, plain, build, values)


SPLIT_K_CASES = {
  "a@b": (lambda a, b: a @ b, [(32, 128), (128, 32)]),
  "aT@bT": (lambda a, b: a.T @ b.T, [(128, 32), (32, 128)]),
  "relu_bias_weight_grad": (_relu_bias_weight_grad, [(128, 32), (128, 32), (32,)]),
}


@pytest.mark.parametrize("case", list(SPLIT_K_CASES))
def test_split_k_tiles_match_noopt(case: str) -> None:
  """A grid with fewer threads than the device keeps busy splits each tile's reduce over GROUP threads: every thread
  of the block fills the tiles (each group thread's slice of the step has its part), the partials meet after the
  loop. Results equal NOOPT and PyTorch's float64."""
  build, shapes = SPLIT_K_CASES[case]
  item, values = _item(build, shapes, seed=len(case) + 7)
  plain = _run(Kernel(item.ast, _renderer(64)), item)
  kernel = Kernel(item.ast, _renderer(64))
  kernel.hand_coded_optimizations()
  assert kernel.shared_tiles and Opt(OptOps.GROUP, 0, 2) in kernel.applied_opts, kernel.applied_opts
  assert any(kernel.axis_types[axis].name == "GROUP" for axis in kernel.staged_loads()[0][1])
  _check_results(kernel, item, plain, build, values)


def test_padded_tile_rows() -> None:
  """SHARED 0 4: each reduce element's row of a tile is followed by 4 unused floats (float4 reads stay aligned), so
  the threads storing one float4 of an operand contiguous along the reduce (four rows) hit different banks."""
  item, values = _item(lambda a, b: a @ b, [(64, 64), (64, 64)], seed=9)
  plain = _run(Kernel(item.ast, _renderer(4)), item)
  for padding in (0, 4):
    kernel = Kernel(item.ast, _renderer(4))
    for opt in [Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.LOCAL, 0, 8), Opt(OptOps.LOCAL, 1, 8),
                Opt(OptOps.SHARED, 0, padding), Opt(OptOps.UNROLL, 0, 16)]:
      kernel.apply_opt(opt)
    sizes = [uop.arg[1] for uop in linearize(kernel) if uop.op is UOps.DEFINE_LOCAL]
    assert sizes == [2 * 16 * (32 + padding)] * 2   # two stages of 16 rows
    assert kernel.staged_tile_bytes() == 2 * 16 * (32 + padding) * 4
    np.testing.assert_allclose(_run(kernel, item), plain, rtol=1e-5, atol=1e-5)
    _compile_with_nvrtc(kernel)
  with pytest.raises(KernelOptError):
    Kernel(item.ast, _renderer(4)).apply_opt(Opt(OptOps.SHARED, 0, 8))


@pytest.mark.parametrize("layout", ["aT@b", "a@b"])
def test_padded_axis_with_staged_tiles(layout: str) -> None:
  """PADTO on N pads every view, the operand broadcast along N too (masked beyond N's size): its tile is filled at N
  index 0 of the block, not at the filling thread's own N (which, past the real size, loaded zeros for the whole
  block: wrong results on the H100 for a.T @ b with N 784 padded to 832)."""
  build = (lambda a, b: a.T @ b) if layout == "aT@b" else (lambda a, b: a @ b)
  item, values = _item(build, [(32, 64) if layout == "aT@b" else (64, 32), (32, 112)], seed=11)
  plain = _run(Kernel(item.ast, _renderer(4)), item)
  kernel = Kernel(item.ast, _renderer(4))
  for opt in [Opt(OptOps.PADTO, 1, 64), Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.LOCAL, 0, 8),
              Opt(OptOps.LOCAL, 1, 16), Opt(OptOps.SHARED, 0, 4), Opt(OptOps.UNROLL, 0, 16)]:
    kernel.apply_opt(opt)
  assert len(kernel.staged_loads()) == 2
  _check_results(kernel, item, plain, build, values)


def test_more_multiprocessors_pick_smaller_tiles() -> None:
  """The largest tile while the grid fills the device: 1 processor takes 128x128, 4 take 64x64, 16 take 32x32; where
  none fills the device, the tile with the most blocks."""
  item, _ = _item(lambda a, b: a @ b, [(128, 16), (16, 128)], seed=3)
  tiles = {}
  for multiprocessors in (1, 4, 16, 64, 1000):
    kernel = Kernel(item.ast, _renderer(multiprocessors))
    kernel.hand_coded_optimizations()
    tiles[multiprocessors] = int(np.prod(_block_tile(kernel)))
  assert tiles == {1: 128 * 128, 4: 64 * 64, 16: 32 * 32, 64: 16 * 16, 1000: 16 * 16}


def test_unknown_multiprocessors_keep_the_largest_tile() -> None:
  item, _ = _item(lambda a, b: a @ b, [(128, 16), (16, 128)], seed=4)
  kernel = Kernel(item.ast, _renderer(0))
  kernel.hand_coded_optimizations()
  assert int(np.prod(_block_tile(kernel))) == 128 * 128


def test_tiles_are_listed_largest_first() -> None:
  areas = [tile.block[0] * tile.block[1] for tile in SHARED_TILES]
  assert areas == sorted(areas, reverse=True)


# ---------------------------------------------------------------- the choice for the MLP step's shapes (no run)

def _scheduled(build: Callable[..., Tensor], shapes: list[tuple[int, ...]]) -> ScheduleItem:
  inputs = [Tensor.empty(*shape, device="PYTHON") for shape in shapes]
  return create_schedule([build(*inputs).lazydata])[-1]


MLP_SHAPES = {
  # the kernels of bench_jit.py's MLP step (784-512-512-10, batch 512): name -> (build, shapes, block tile, reduce
  # step, GROUP threads splitting the reduce)
  "forward_784": (lambda x, w: x @ w.T, [(512, 784), (512, 784)], (32, 32), 8, 2),
  "forward_relu_512": (_relu_bias_forward, [(512, 512), (512,), (512, 512)], (32, 32), 16, 2),
  "input_grad_512": (lambda g, w: g @ w, [(512, 512), (512, 512)], (32, 32), 16, 2),
  "weight_grad_512": (_relu_bias_weight_grad, [(512, 512), (512, 512), (512,)], (32, 32), 16, 2),
  "weight_grad_784": (lambda g, x: g.T @ x, [(512, 512), (512, 784)], (64, 16), 16, 2),
  "square_4096": (lambda a, b: a @ b, [(4096, 4096), (4096, 4096)], (128, 128), 16, 1),
}


@pytest.mark.parametrize("name", list(MLP_SHAPES))
def test_mlp_step_matmuls_pick_filling_tiles(name: str) -> None:
  """On 132 multiprocessors (H100) the 512-sized matmuls of the MLP step take 32x32 tiles (256 blocks, not the 16
  of 128x128) with the reduce split over 2 GROUP threads (K = 784: in steps of 8), the 512x784 weight gradient 64x16
  (392 blocks; 784 = 16 x 49); 4096^3 keeps 128x128 in steps of 16, no split (H100 figures in heuristic.py)."""
  build, shapes, tile, step, group = MLP_SHAPES[name]
  kernel = Kernel(_scheduled(build, shapes).ast, CUDARenderer())
  kernel.hand_coded_optimizations()
  assert kernel.shared_tiles, kernel.applied_opts
  assert Opt(OptOps.UNROLL, 0, step) in kernel.applied_opts
  # every tile's rows padded by 4 floats (their transposed fills store into different banks); the 128x128 tile also
  # skews them, stores B's float4s whole and asks for two blocks per multiprocessor
  flags = SHARED_ROW_SKEW + SHARED_TWO_BLOCKS + SHARED_VECTOR_FILL if tile == (128, 128) else 0
  assert Opt(OptOps.SHARED, 0, 0, decode_shared_amount(4 + flags)) in kernel.applied_opts
  assert [opt.amount for opt in kernel.applied_opts if opt.op is OptOps.GROUP] == ([group] if group > 1 else [])
  # the opts: float4 upcasts along M and N, threads along M and N, then the second float4 runs along N and M
  threads = [opt.amount for opt in kernel.applied_opts if opt.op is OptOps.LOCAL]
  upcasts = [opt.amount for opt in kernel.applied_opts if opt.op is OptOps.UPCAST]
  runs = (upcasts[3], upcasts[2]) if len(upcasts) == 4 else (1, 1)
  assert upcasts[:2] == [4, 4] and (threads[0] * 4 * runs[0], threads[1] * 4 * runs[1]) == tile
  # double buffered: one barrier before the loop (step 0's tiles) and one per step; the fused bias is no tile
  uops = linearize(kernel)
  assert sum(uop.op is UOps.BARRIER for uop in uops) == 2
  assert len(kernel.staged_loads()) == 2


# ---------------------------------------------------------------- thin matmuls (a classifier's 10 outputs)

THIN_CASES = {
  # name: (build, input shapes, multiprocessors, the opt that splits the reduce over threads)
  "rows": (_relu_bias_forward, [(64, 256), (256,), (10, 256)], 16, OptOps.GROUP),
  "columns": (_relu_bias_weight_grad, [(256, 10), (256, 64), (64,)], 16, OptOps.GROUPTOP),
  "columns_plain": (lambda g, x: g.T @ x, [(256, 6), (256, 96)], 8, OptOps.GROUPTOP),
}


def _blocks(kernel: Kernel) -> int:
  return int(np.prod(kernel.full_shape[:kernel.global_dims]))


@pytest.mark.parametrize("case", list(THIN_CASES))
def test_thin_matmuls_split_the_reduce_and_match_noopt(case: str) -> None:
  """An output axis of at most 16 (THIN_SIDE) and a long reduce: threads split the reduce (GROUP where the operands
  are contiguous along it, GROUPTOP with 32 neighbouring outputs on LOCAL threads where they are contiguous along
  the wide output axis) and the grid still gives every multiprocessor a block."""
  build, shapes, multiprocessors, split = THIN_CASES[case]
  item, values = _item(build, shapes, seed=len(case) + 40)
  plain = _run(Kernel(item.ast, _renderer(multiprocessors)), item)
  kernel = Kernel(item.ast, _renderer(multiprocessors))
  kernel.hand_coded_optimizations()
  assert not kernel.shared_tiles and any(opt.op is split for opt in kernel.applied_opts), kernel.applied_opts
  assert _blocks(kernel) >= multiprocessors
  _check_results(kernel, item, plain, build, values)


def test_mlp_classifier_matmuls_fill_the_gpu() -> None:
  """The MLP step's 512x512 @ (10x512)^T forward: a row of 128 GROUP threads per block (threads_in_flight_wanted: 512
  rows of a warp left the GPU short of warps), the 10 outputs upcast (512 blocks, was 10); its 10x512 weight gradient:
  32 outputs x 8 GROUPTOP threads per block (160 blocks, was 10)."""
  forward = Kernel(_scheduled(_relu_bias_forward, [(512, 512), (512,), (10, 512)]).ast, CUDARenderer())
  forward.hand_coded_optimizations()
  assert forward.applied_opts == [Opt(OptOps.UPCAST, 1, 10), Opt(OptOps.GROUP, 0, 128)]
  assert _blocks(forward) == 512
  weight_grad = Kernel(_scheduled(_relu_bias_weight_grad, [(512, 10), (512, 512), (512,)]).ast, CUDARenderer())
  weight_grad.hand_coded_optimizations()
  assert weight_grad.applied_opts == [Opt(OptOps.LOCAL, 1, 32), Opt(OptOps.GROUPTOP, 0, 8), Opt(OptOps.UNROLL, 0, 4)]
  assert _blocks(weight_grad) == 160


# ---------------------------------------------------------------- the tile's structure flags (SHARED's amount)

def _structure_tile(m_axis: int) -> list[Opt]:
  """A 64x64 block tile (8x8 threads, 2x2 float4 runs each: the 4096^3 tile's structure at a quarter of the
  threads) of the matmul whose M axis is `m_axis` (N the next)."""
  m, n = m_axis, m_axis + 1
  return [Opt(OptOps.UPCAST, m, 4), Opt(OptOps.UPCAST, n, 4), Opt(OptOps.LOCAL, m, 8), Opt(OptOps.LOCAL, n, 8),
          Opt(OptOps.UPCAST, n, 2), Opt(OptOps.UPCAST, m, 2)]
STRUCTURES = {
  # name: (SHARED's amount, reduce step, expected (float4 tile stores, COPYs of 16 bytes, of 4 bytes, launch bounds'
  # blocks) per kernel)
  "vector_fill": (4 + SHARED_VECTOR_FILL, 16, (True, 0, 0, 0)),
  "two_blocks": (4 + SHARED_TWO_BLOCKS, 16, (False, 0, 0, 2)),
  "vector_fill_two_blocks": (4 + SHARED_VECTOR_FILL + SHARED_TWO_BLOCKS, 8, (True, 0, 0, 2)),
  "async_2_stages": (4 + SHARED_ASYNC, 16, (False, True, True, 0)),
  "async_3_stages_two_blocks": (4 + 2 * SHARED_ASYNC + SHARED_TWO_BLOCKS, 8, (False, True, True, 2)),
  "async_4_stages_unpadded": (3 * SHARED_ASYNC, 8, (False, True, True, 0)),
  "row_skew_vector_fill": (4 + SHARED_ROW_SKEW + SHARED_VECTOR_FILL, 16, (True, 0, 0, 0)),
  "row_skew_async_two_blocks": (4 + SHARED_ROW_SKEW + SHARED_ASYNC + SHARED_TWO_BLOCKS, 16, (False, True, True, 2)),
}
STRUCTURE_LAYOUTS = {
  "a@b": (lambda a, b: a @ b, [(64, 64), (64, 64)]),
  "aT@bT": (lambda a, b: a.T @ b.T, [(64, 64), (64, 64)]),
  "batched": (lambda a, b: a @ b, [(2, 64, 32), (2, 32, 64)]),
}


@pytest.mark.parametrize("layout", list(STRUCTURE_LAYOUTS))
@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_tile_structures_match_noopt(structure: str, layout: str) -> None:
  """The float32 tile's structure flags (kernel.py SHARED_VECTOR_FILL, SHARED_TWO_BLOCKS, SHARED_ASYNC): float4
  stores of an operand contiguous along the tile's rows, the launch bounds' second block, and cp.async copies in 2-4
  stages (16 bytes where the operand's float4 is one of the tile, else element by element) instead of the register
  prefetch. Each equals NOOPT and PyTorch's float64 on the emulated GPU, and compiles with NVRTC."""
  amount, step, (vector_stores, copies_16, copies_4, blocks) = STRUCTURES[structure]
  build, shapes = STRUCTURE_LAYOUTS[layout]
  item, values = _item(build, shapes, seed=len(structure) + len(layout))
  plain = _run(Kernel(item.ast, _renderer(4)), item)
  kernel = Kernel(item.ast, _renderer(4))
  tile = _structure_tile(len(shapes[0]) - 2)
  for opt in tile + [Opt(OptOps.SHARED, 0, amount), Opt(OptOps.UNROLL, 0, step)]: kernel.apply_opt(opt)
  uops = linearize(kernel)
  tile_stores = [uop for uop in uops if uop.op is UOps.STORE and uop.srcs[0].op is UOps.DEFINE_LOCAL]
  copies = [uop.arg[0] for uop in uops if uop.op is UOps.COPY]
  # an operand contiguous along N (a@b's B) or along M (aT@bT's A) fills its tile in float4s
  assert any(uop.arg == 4 for uop in tile_stores) == vector_stores
  assert (4 in copies) == bool(copies_16) and (1 in copies) == bool(copies_4)
  # padded rows (16 floats each, 4 of padding), groups of 8 rows 8 further on with the skew: 16*(64+4) + 8 a stage
  stages = max(kernel.async_tile_stages, 2)
  skew = 8 if amount & SHARED_ROW_SKEW and step == 16 else 0
  row = 64 + (4 if amount % SHARED_VECTOR_FILL else 0)
  assert [uop.arg[1] for uop in uops if uop.op is UOps.DEFINE_LOCAL] == [stages * (step * row + skew)] * 2
  assert [uop.arg for uop in uops if uop.op is UOps.OCCUPANCY] == ([blocks] if blocks else [])
  if copies: assert not tile_stores and sum(uop.op is UOps.BARRIER for uop in uops) == 1   # one per step
  _check_results(kernel, item, plain, build, values)
  if blocks: assert f"__launch_bounds__({kernel.block_threads()}, {blocks})" in CUDARenderer().render(kernel.name, uops)


@pytest.mark.parametrize("amount", [4 + SHARED_ROW_SKEW + SHARED_VECTOR_FILL + SHARED_TWO_BLOCKS,
                                    4 + SHARED_ROW_SKEW + SHARED_ASYNC + SHARED_TWO_BLOCKS])
def test_warp_tiles_match_noopt(amount: int) -> None:
  """The block's threads split twice along M and N (LOCAL 0 4, LOCAL 1 2, LOCAL 0 2, LOCAL 1 4: consecutive thread
  ids a 2-D patch of the block tile, as bench_matmul's F32_WARP_* warps), with the tile structure flags: equal to
  NOOPT and numpy's float64."""
  item, values = _item(lambda a, b: a @ b, [(64, 64), (64, 64)], seed=amount)
  plain = _run(Kernel(item.ast, _renderer(4)), item)
  kernel = Kernel(item.ast, _renderer(4))
  for opt in [Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.LOCAL, 0, 4), Opt(OptOps.LOCAL, 1, 2),
              Opt(OptOps.LOCAL, 0, 2), Opt(OptOps.LOCAL, 1, 4), Opt(OptOps.UPCAST, 1, 2), Opt(OptOps.UPCAST, 0, 2),
              Opt(OptOps.SHARED, 0, amount), Opt(OptOps.UNROLL, 0, 16)]:
    kernel.apply_opt(opt)
  assert kernel.local_dims == 4
  got = _run(kernel, item)
  np.testing.assert_allclose(got, plain, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got.reshape(64, 64), values[0].astype(np.float64) @ values[1], rtol=1e-4, atol=1e-4)
  _compile_with_nvrtc(kernel)


def _strided_rows_tile(m_axis: int) -> list[Opt]:
  """A 64x64 block tile whose threads take neighbouring rows (LOCAL before UPCAST along M: a thread's 8 rows 8 apart)
  and 2 float4 runs along N: the layout SHARED_REDUCE_INNER reads without bank conflicts."""
  m, n = m_axis, m_axis   # M's 64 all go to the block: its axis is dropped, N's takes its number
  return [Opt(OptOps.LOCAL, m, 8), Opt(OptOps.UPCAST, m, 8), Opt(OptOps.UPCAST, n, 4), Opt(OptOps.LOCAL, n, 8),
          Opt(OptOps.UPCAST, n, 2)]


@pytest.mark.parametrize("layout", list(STRUCTURE_LAYOUTS))
@pytest.mark.parametrize("flags", [0, SHARED_VECTOR_FILL, SHARED_ASYNC + SHARED_TWO_BLOCKS, 2 * SHARED_ASYNC])
def test_reduce_inner_tiles_match_noopt(flags: int, layout: str) -> None:
  """SHARED_REDUCE_INNER: an operand contiguous along the reduce (a@b's A, aT@bT's B) keeps the reduce axis innermost
  in its tile (rows of 16 + 4 padding, not transposed): 16-byte copies or float4 stores fill it, float4s of 4 reduce
  elements are read from it. Equal to NOOPT and PyTorch's float64 with each fill (prefetch, float4 stores, cp.async)."""
  build, shapes = STRUCTURE_LAYOUTS[layout]
  item, values = _item(build, shapes, seed=flags + len(layout))
  plain = _run(Kernel(item.ast, _renderer(4)), item)
  kernel = Kernel(item.ast, _renderer(4))
  amount = 4 + SHARED_REDUCE_INNER + flags
  for opt in _strided_rows_tile(len(shapes[0]) - 2) + [Opt(OptOps.SHARED, 0, amount), Opt(OptOps.UNROLL, 0, 16)]:
    kernel.apply_opt(opt)
  inner = [axes for _, axes in kernel.staged_loads() if kernel.axis_types[axes[-1]].name == "UNROLL"]
  assert len(inner) == 1
  uops = linearize(kernel)
  # asynchronous stages where the reduce has that many steps (batched: K = 32, 2 steps), else the register prefetch's 2
  copying = kernel.async_tile_stages <= shapes[1][-2] // 16
  stages = max(kernel.async_tile_stages, 2) if copying else 2
  # the reduce-inner tile: 64 rows of 16 + 4; the other: 16 reduce rows of 64 + 4
  assert sorted(uop.arg[1] for uop in uops if uop.op is UOps.DEFINE_LOCAL) == [stages * 16 * 68, stages * 64 * 20]
  # the reduce-inner tile in 16-byte copies (aT@bT's A, contiguous along M but its rows 8 apart per thread: 4-byte)
  copied = {(uop.srcs[0].arg[0], uop.arg[0]) for uop in uops if uop.op is UOps.COPY}
  inner_tile = next(uop.arg[0] for uop in uops if uop.op is UOps.DEFINE_LOCAL and uop.arg[1] == stages * 64 * 20)
  if flags & SHARED_ASYNC and copying: assert (inner_tile, 4) in copied and (inner_tile, 1) not in copied
  _check_results(kernel, item, plain, build, values)


@pytest.mark.parametrize("amount", [8, 2 * SHARED_REDUCE_INNER, 4 + 2, 12 + SHARED_ASYNC])
def test_bad_structure_amounts_raise(amount: int) -> None:
  """SHARED's amount without TC: a padding of 0 or 4 plus the flags; unknown bits and other paddings are refused."""
  item, _ = _item(lambda a, b: a @ b, [(64, 64), (64, 64)], seed=1)
  kernel = Kernel(item.ast, _renderer(4))
  for opt in _structure_tile(0): kernel.apply_opt(opt)
  with pytest.raises(KernelOptError, match="SHARED takes axis 0"): kernel.apply_opt(Opt(OptOps.SHARED, 0, amount))


def test_square_4096_choice_is_pinned() -> None:
  """The hand-coded float32 4096^3 kernel (H100 figures in shared_tile_plans.py): 16x8 threads of 8x16
  outputs (2x4 float4 runs), padded and skewed tile rows, B's float4 stores, launch bounds for two blocks per
  multiprocessor, reduce steps of 16 double buffered by register prefetch."""
  kernel = Kernel(_scheduled(lambda a, b: a @ b, [(4096, 4096), (4096, 4096)]).ast, CUDARenderer())
  kernel.hand_coded_optimizations()
  assert kernel.applied_opts == [Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.LOCAL, 0, 16),
                                 Opt(OptOps.LOCAL, 1, 8), Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.UPCAST, 0, 2),
                                 Opt(OptOps.SHARED, 0, 0, SharedStructure(4, vector_fill=True, two_blocks=True,
                                                                          row_skew=True)), Opt(OptOps.UNROLL, 0, 16)]
  uops = linearize(kernel)
  source = CUDARenderer().render(kernel.name, uops)
  assert source.startswith(f'extern "C" __global__ void __launch_bounds__(128, 2) {kernel.name}(')
  assert not any(uop.op is UOps.COPY for uop in uops)   # register prefetch (cp.async measured slower)
  # 128 threads fill each 16x128 tile in 4 float4s: B's stored whole, A's transposed element by element
  tile_stores = [uop.arg for uop in uops if uop.op is UOps.STORE and uop.srcs[0].op is UOps.DEFINE_LOCAL]
  assert sorted(tile_stores, key=str) == sorted([4] * 8 + [None] * 32, key=str)   # before the loop and in it


def test_grids_of_few_blocks_keep_the_256_thread_tile() -> None:
  """The 8x16-per-thread tile (128 threads) needs 4 blocks per multiprocessor; MiniLM's 2048x384 @ 384x1536 (192
  blocks of 128x128 on 132) keeps 16x16 threads (the grid model's 128x192 tile, codegen/opt/matmul_grid.py)."""
  kernel = Kernel(_scheduled(lambda a, b: a @ b.T, [(2048, 384), (1536, 384)]).ast, CUDARenderer())
  kernel.hand_coded_optimizations()
  assert [opt.amount for opt in kernel.applied_opts if opt.op is OptOps.LOCAL] == [16, 16]
  assert kernel.blocks_per_multiprocessor == 0   # no launch bounds for two blocks of 128 threads


@pytest.mark.parametrize("case", ["a@b", "aT@bT"])
def test_thread_8x16_tile_matches_noopt(case: str) -> None:
  """The 8x16-per-thread 128x128 tile where the grid has 4 blocks per multiprocessor (256x256 on 1): equal to NOOPT
  and PyTorch's float64 on the emulated GPU, compiled by NVRTC."""
  build = (lambda a, b: a @ b) if case == "a@b" else (lambda a, b: a.T @ b.T)
  item, values = _item(build, [(256, 32), (32, 256)] if case == "a@b" else [(32, 256), (256, 32)], seed=5)
  plain = _run(Kernel(item.ast, _renderer(1)), item)
  kernel = Kernel(item.ast, _renderer(1))
  kernel.hand_coded_optimizations()
  assert [opt.amount for opt in kernel.applied_opts if opt.op is OptOps.LOCAL] == [16, 8], kernel.applied_opts
  _check_results(kernel, item, plain, build, values)


LARGE_TILE_CASES = {
  "a@b": (lambda a, b: a @ b, [(128, 32), (32, 128)]),
  "aT@bT": (lambda a, b: a.T @ b.T, [(32, 128), (128, 32)]),
  "relu_bias_forward": (_relu_bias_forward, [(128, 32), (32,), (128, 32)]),
  "batched": (lambda a, b: a @ b, [(2, 128, 32), (2, 32, 128)]),
}


@pytest.mark.parametrize("case", list(LARGE_TILE_CASES))
def test_large_tile_choice_matches_noopt(case: str) -> None:
  """The heuristic's 128x128 tile with its structure flags (LARGE_TILE_STRUCTURE) on one multiprocessor: plain,
  transposed, fused and batched operands equal NOOPT and PyTorch's float64."""
  build, shapes = LARGE_TILE_CASES[case]
  item, values = _item(build, shapes, seed=len(case) + 60)
  plain = _run(Kernel(item.ast, _renderer(1)), item)
  kernel = Kernel(item.ast, _renderer(1))
  kernel.hand_coded_optimizations()
  assert np.prod(_block_tile(kernel)) == 128 * 128
  assert Opt(OptOps.SHARED, 0, 0, decode_shared_amount(308)) in kernel.applied_opts
  _check_results(kernel, item, plain, build, values)
