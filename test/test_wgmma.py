"""Hopper warpgroup MMA (OptOps.WGMMA, codegen/wgmma_tiles.py): float16/bfloat16 matmuls with float32 accumulation.

Without a GPU the kernel runs on the PYTHON device's emulator (runtime/wgmma_emulator.py, `EMULATE=CUDA_SM90`), which
replays its copies into a shared-memory image and reads the operands back through its descriptors by the PTX ISA's
canonical layouts; results are checked against a float64 reference (numpy/PyTorch), with an error no worse than
PyTorch's matmul in the same dtype. Every kernel is compiled with NVRTC for sm_90a when NVRTC is installed (no
spills). With `DEVICE=CUDA` on an H100 the same matmuls run on the GPU (the tests marked cuda).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ourgrad import Tensor, dtypes
from ourgrad.codegen.kernel import WGMMA_DEEP, WGMMA_SPECIALIZED, Kernel, KernelOptError, Opt, OptOps
from ourgrad.codegen.opt import matmul_grid, tensor_core_plans
from ourgrad.codegen.opt.tensor_core_plans import WgmmaPlan
from ourgrad.codegen.wgmma_copies import a_copy, b_copy, thread_copies
from ourgrad.codegen.wgmma_tiles import (WARPGROUP_THREADS, WgmmaMatmul, accumulator_position, descriptor,
                                         paired_store_position, render_wgmma_matmul, swizzled)
from ourgrad.device import Buffer, Device
from ourgrad.dtype import bfloat16_bits_to_float32
from ourgrad.engine.realize import compile_kernel, run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer
from ourgrad.runtime.wgmma_emulator import emulate_wgmma_matmul, from_float, read_operand, to_float

from helpers import device_opens, nvrtc_compiler

NVRTC = nvrtc_compiler()
TORCH_DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
OURGRAD_DTYPE = {"float16": dtypes.float16, "bfloat16": dtypes.bfloat16}


# ================================================================ layout pieces

def test_swizzle_permutes_pieces_within_each_row_and_column_of_an_atom() -> None:
  """Within a 1024-byte atom the 128-byte swizzle sends the 16-byte piece p of row r to piece p ^ r: each row and
  each piece column then holds all 8 pieces once (no two rows of one column in one bank group)."""
  pieces = np.array([[swizzled(row * 128 + piece * 16) for piece in range(8)] for row in range(8)])
  assert (pieces // 128 == np.arange(8)[:, None]).all()   # rows stay rows
  for row in range(8): assert sorted((pieces[row] % 128) // 16) == list(range(8))
  for piece in range(8): assert sorted((pieces[:, piece] % 128) // 16) == list(range(8))
  assert swizzled(swizzled(3 * 128 + 5 * 16 + 6)) == 3 * 128 + 5 * 16 + 6


def test_descriptor_fields() -> None:
  """Start address, LBO and SBO in 16-byte units at bits 0, 16 and 32; the 128-byte swizzle (1) at bits 62-63."""
  value = descriptor(0x1F400, 8192, 1024)
  assert value & 0x3FFF == 0x1F400 >> 4 and (value >> 16) & 0x3FFF == 512 and (value >> 32) & 0x3FFF == 64
  assert value >> 62 == 1 and (value >> 49) & 7 == 0


def test_accumulator_positions_cover_the_tile_once() -> None:
  """The m64nNk16 float32 accumulator map: each of a warpgroup's 128 threads holds N/2 elements, every element of
  the 64 x N tile held once; warp w holds rows 16w..16w+15 (PTX ISA, wgmma D fragment figure)."""
  n = 256
  thread, element = np.arange(128)[:, None], np.arange(n // 2)[None, :]
  rows, columns = accumulator_position(thread, element)
  held = np.zeros((64, n), int)
  np.add.at(held, (rows, columns), 1)
  assert (held == 1).all()
  assert ((rows // 16) == thread // 32).all()
  assert accumulator_position(5, 0) == (1, 2) and accumulator_position(5, 2) == (9, 2) and \
    accumulator_position(5, 5) == (1, 11)


def test_k_major_operand_reads_back_through_its_descriptor() -> None:
  """A 64 x 64 K-major tile stored row by row in 128-byte swizzled rows reads back, k16 slice by k16 slice, through
  descriptors that move the start 32 bytes per slice (SBO 1024 between 8-row atoms)."""
  tile = np.arange(64 * 64, dtype=np.uint16).reshape(64, 64)
  shared = np.zeros(64 * 64, dtype=np.uint16)
  for row in range(64):
    for column in range(64): shared[swizzled(row * 128 + column * 2) // 2] = tile[row, column]
  for j in range(4):
    np.testing.assert_array_equal(read_operand(shared, descriptor(32 * j, 16, 1024), 64, True),
                                  tile[:, 16 * j:16 * j + 16])


# ================================================================ the emulated kernel against float64

def _bits(rng: np.random.Generator, count: int, dtype: str) -> np.ndarray:
  """Random operand elements as the kernel reads them: 16-bit patterns, or float32 bits (TF32)."""
  values = from_float(rng.standard_normal(count).astype(np.float32), dtype)
  return values.view(np.uint32) if dtype == "float32" else values


def _emulated_error(plan: WgmmaMatmul, seed: int = 0) -> tuple[float, float]:
  """(relative error of the emulated kernel, of PyTorch's matmul in the dtype) against float64."""
  rng = np.random.default_rng(seed)
  a, b = _bits(rng, plan.m * plan.k, plan.dtype), _bits(rng, plan.k * plan.n, plan.dtype)
  a64 = to_float(a, plan.dtype).astype(np.float64).reshape(plan.m, plan.k)
  b64 = to_float(b, plan.dtype).astype(np.float64).reshape(plan.k, plan.n)
  def stored(values: np.ndarray) -> np.ndarray:   # transposed operands, stored as the kernel's bits
    bits = from_float(values.astype(np.float32).reshape(-1), plan.dtype)
    return bits.view(np.uint32) if plan.dtype == "float32" else bits
  stored_b = stored(b64.T) if plan.b_k_major else b
  stored_a = a if plan.a_k_major else stored(a64.T)
  c = np.zeros(plan.m * plan.n, np.float32 if plan.out_dtype == "float32" else np.uint16)
  emulate_wgmma_matmul(plan, c, stored_a, stored_b)
  got = (c if plan.out_dtype == "float32" else to_float(c, plan.out_dtype)).reshape(plan.m, plan.n)
  reference = a64 @ b64
  torch_dtype = torch.float32 if plan.out_dtype == "float32" else TORCH_DTYPE[plan.dtype]
  torch_out = (torch.tensor(a64).to(TORCH_DTYPE[plan.dtype]).float() @ torch.tensor(b64).to(TORCH_DTYPE[plan.dtype])
               .float()).to(torch_dtype).double().numpy()
  def relative(x): return float(np.linalg.norm(x - reference) / np.linalg.norm(reference))
  return relative(got), relative(torch_out)


PLANS = {
  "f16_128x256_4stages": dict(dtype="float16"),
  "bf16_128x256_4stages": dict(dtype="bfloat16"),
  "f16_b_nxk": dict(dtype="float16", b_k_major=True),
  "bf16_128x128_5stages": dict(dtype="bfloat16", block_n=128, stages=5),
  "f16_64x64_3stages_f32out": dict(dtype="float16", block_m=64, block_n=64, stages=3, out_dtype="float32"),
  "f16_256x192_3stages": dict(dtype="float16", block_m=256, block_n=192, stages=3),
  "f16_specialized_128x256": dict(dtype="float16", specialized=True),
  "f16_deep_128x256": dict(dtype="float16", deep=True),
  "bf16_specialized_128x128_b_nxk": dict(dtype="bfloat16", block_n=128, stages=6, specialized=True, b_k_major=True),
  # A stored K x M (a weight gradient's g^T): transposed by the instruction as B is
  "bf16_a_kxm": dict(dtype="bfloat16", a_k_major=False),
  "f16_a_kxm_b_nxk_128x128": dict(dtype="float16", block_n=128, stages=5, a_k_major=False, b_k_major=True),
  "bf16_a_kxm_specialized_256x128": dict(dtype="bfloat16", block_m=256, block_n=128, stages=4, specialized=True,
                                         a_k_major=False),
  "f16_a_kxm_deep": dict(dtype="float16", deep=True, a_k_major=False),
  # grid variants (codegen/opt/matmul_grid.py's model picks among them): a 192-wide N tile, one consumer warpgroup
  # with 2 CTAs per multiprocessor, persistent CTAs looping over tiles (fewer CTAs than tiles: several each, their
  # stages counted across tiles), TF32
  "bf16_128x192_specialized": dict(dtype="bfloat16", block_n=192, stages=4, specialized=True),
  "f16_specialized_lag3": dict(dtype="float16", block_n=128, stages=5, specialized=True, copy_lag=3),
  # the copies arriving on their stage's barrier as they land (the emulator checks the layout; NVRTC the kernel)
  "bf16_async_arrive_persistent": dict(dtype="bfloat16", block_n=192, stages=5, specialized=True, persistent_ctas=5,
                                       async_arrive=True),
  "f16_single_stores": dict(dtype="float16", block_n=128, stages=5, specialized=True, paired_stores=False),
  "tf32_192x192_persistent": dict(dtype="float32", block_m=192, block_n=192, stages=4, specialized=True,
                                  persistent_ctas=5, b_k_major=True),
  "bf16_256x128_specialized": dict(dtype="bfloat16", block_m=256, block_n=128, stages=4, specialized=True),
  "f16_64x128_two_ctas": dict(dtype="float16", block_m=64, block_n=128, stages=4, specialized=True, ctas_per_sm=2),
  "bf16_persistent_5_ctas": dict(dtype="bfloat16", block_n=128, stages=3, specialized=True, persistent_ctas=5),
  "tf32_persistent_192": dict(dtype="float32", block_n=192, stages=5, specialized=True, persistent_ctas=7,
                              a_k_major=True, b_k_major=True),
  "tf32_64x128_persistent_two_ctas": dict(dtype="float32", block_m=64, block_n=128, stages=3, specialized=True,
                                          ctas_per_sm=2, persistent_ctas=4, b_k_major=True),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_emulated_kernel_matches_float64(name: str) -> None:
  """M, N over several CTA groups (a partial last group), K over more steps than stages."""
  options = PLANS[name]
  m, n = (3 * options.get("block_m", 128) * 3, 2 * options.get("block_n", 256))
  plan = WgmmaMatmul(m, n, 448, **options)
  error, torch_error = _emulated_error(plan)
  assert error <= 1.5 * torch_error + 1e-7, (error, torch_error)
  if NVRTC is not None:
    info = NVRTC.ptxas_info(render_wgmma_matmul(plan))
    assert "0 bytes spill stores" in info or "ptxas info" not in info, info   # some NVRTC builds log nothing here


COPY_PLANS = {
  "bf16_k_major": dict(dtype="bfloat16", block_n=192, stages=5, specialized=True, b_k_major=True),
  "bf16_mn_major": dict(dtype="bfloat16", block_n=192, stages=5, specialized=True, a_k_major=False),
  "f16_256x128_mn_major_a": dict(dtype="float16", block_m=256, block_n=128, stages=4, specialized=True,
                                 a_k_major=False),
  "f16_128x256_b_kxn": dict(dtype="float16", specialized=True),
  "tf32_192x192": dict(dtype="float32", block_m=192, block_n=192, stages=4, specialized=True, b_k_major=True),
  "bf16_64x64_cooperative": dict(dtype="bfloat16", block_m=64, block_n=64, stages=3),
  "f16_192x128_cooperative": dict(dtype="float16", block_m=192, block_n=128, stages=3, a_k_major=False),
}


@pytest.mark.parametrize("name", list(COPY_PLANS))
def test_thread_copies_are_the_pieces_of_each_thread(name: str) -> None:
  """Where the kernel copies from one address plus constants (thread_copies), thread t's i-th copy is piece
  t + threads * i of a_copy/b_copy (what the emulator checks against float64), in every K step; the specialized
  producer's 128 threads take that form for every tile, MN-major ones included (no division per piece)."""
  options = COPY_PLANS[name]
  plan = WgmmaMatmul(2 * options.get("block_m", 128), 2 * options.get("block_n", 256), 512, **options)
  threads = WARPGROUP_THREADS if plan.specialized else plan.threads
  looped = False
  for operand, copy, block in (("a", a_copy, plan.block_m), ("b", b_copy, plan.block_n)):
    split = thread_copies(plan, operand, 0, threads, 0)
    if split is None:
      assert not plan.specialized
      looped = True
      continue
    for step in (0, 3):
      for thread in range(threads):
        (source, target), offsets = thread_copies(plan, operand, thread, threads, step)
        got = [(source + source_offset, target + target_offset) for source_offset, target_offset in offsets]
        pieces = [thread + threads * number for number in range(len(offsets))]
        assert got == [copy(plan, piece, step) for piece in pieces]
    assert len(offsets) * threads == block * plan.block_k // plan.piece_elements
  source = render_wgmma_matmul(plan)
  assert ("for (int piece" in source) == looped
  if NVRTC is not None: NVRTC.compile(source)


def test_paired_stores_write_every_output_once() -> None:
  """The paired 16-bit epilogue as the kernel does it, lane by lane: for column blocks j, j + 1 (j even) and each row
  half, a lane packs its pairs `low` (block j) and `high` (j + 1), an odd lane sends `low` and an even one `high` to
  its neighbour (shuffle xor 1), and stores 4 outputs at paired_store_position: even (low, received), odd (received,
  high). Every output of the 64 x N tile is written once, with the accumulator that holds it, each 8-byte store
  aligned, and a quad of lanes writes 32 contiguous bytes of a row."""
  block_n = 192
  written = {}
  for thread in range(WARPGROUP_THREADS):
    partner = thread ^ 1
    for block in range(0, block_n // 2, 8):
      for element in (block, block + 2):
        low, high = (thread, element), (thread, element + 4)
        received = (partner, element) if thread % 2 == 0 else (partner, element + 4)   # the neighbour sent it
        row, column = paired_store_position(thread, element)
        assert column % 4 == 0
        pairs = (low, received) if thread % 2 == 0 else (received, high)
        for number, (owner, first) in enumerate(pairs):
          for half in (0, 1):
            assert (row, column + 2 * number + half) not in written
            written[(row, column + 2 * number + half)] = accumulator_position(owner, first + half)
  assert len(written) == 64 * block_n and all(position == held for position, held in written.items())
  quad = {paired_store_position(thread, 8)[1] for thread in range(4)}
  assert sorted(quad) == [16, 20, 24, 28]
  plan = WgmmaMatmul(256, 2 * block_n, 256, dtype="bfloat16", block_n=block_n, stages=5, specialized=True)
  source = render_wgmma_matmul(plan)
  assert plan.paired_stores and "__shfl_xor_sync" in source and "uint2" in source
  single = WgmmaMatmul(256, 2 * block_n, 256, dtype="bfloat16", block_n=block_n, stages=5, specialized=True,
                       paired_stores=False)
  assert "__shfl_xor_sync" not in render_wgmma_matmul(single) and single.name.endswith("_single")
  if NVRTC is not None:
    info = NVRTC.ptxas_info(source)
    assert "0 bytes spill stores" in info or "ptxas info" not in info, info


def test_producer_copy_lag() -> None:
  """The specialized producer waits for the copies of the step `copy_lag` behind the one it issued (default 1: each
  step's before the one after next) and marks that step's stage full; up to stages - 2 (the most that cannot
  deadlock), more is refused."""
  source = render_wgmma_matmul(WgmmaMatmul(256, 256, 512, block_n=128, stages=6, specialized=True))
  assert "cp.async.wait_group 1;" in source and "(counted - 1) % 6" in source
  lag4 = WgmmaMatmul(256, 256, 512, block_n=128, stages=6, specialized=True, copy_lag=4)
  assert "cp.async.wait_group 4;" in render_wgmma_matmul(lag4) and lag4.name.endswith("_lag4")
  with pytest.raises(ValueError): WgmmaMatmul(256, 256, 512, block_n=128, stages=6, specialized=True, copy_lag=5)
  if NVRTC is not None: NVRTC.compile(render_wgmma_matmul(lag4))


def test_exchanged_descriptor_strides_give_wrong_results() -> None:
  """The emulator is not blind to the layout: B's descriptor with LBO and SBO exchanged reads other elements."""
  error, _ = _emulated_error(WgmmaMatmul(128, 256, 128, b_lbo_sbo_swapped=True))
  assert error > 0.5


# ================================================================ OptOps.WGMMA on kernels

def _matmul_ast(a: Tensor, b: Tensor, device: str = "PYTHON"):
  schedule = create_schedule([(a @ b).lazydata])
  run_schedule(schedule[:-1])
  return schedule[-1]


def _operands(dtype: str, shape_a, shape_b, seed: int, device: str = "PYTHON") -> tuple[Tensor, Tensor]:
  rng = np.random.default_rng(seed)
  return tuple(Tensor(rng.standard_normal(shape).astype(np.float32), device=device).cast(OURGRAD_DTYPE[dtype])
               .realize() for shape in (shape_a, shape_b))


def _values(buffer: Buffer) -> np.ndarray:
  values = buffer.numpy()
  if buffer.dtype == dtypes.bfloat16: values = bfloat16_bits_to_float32(values)
  return values.astype(np.float64)


def _check(a: Tensor, b: Tensor, got: np.ndarray, dtype: str) -> None:
  a64, b64 = (torch.tensor(x.cast(dtypes.float32).numpy(), dtype=torch.float64) for x in (a, b))
  reference = (a64 @ b64).numpy().reshape(-1)
  torch_out = (a64.to(TORCH_DTYPE[dtype]) @ b64.to(TORCH_DTYPE[dtype])).double().numpy().reshape(-1)
  error = np.linalg.norm(got - reference) / np.linalg.norm(reference)
  torch_error = np.linalg.norm(torch_out - reference) / np.linalg.norm(reference)
  assert error <= 1.5 * torch_error + 1e-7, (error, torch_error)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("a_transposed,b_transposed", [(False, False), (False, True), (True, False)],
                         ids=["b_kxn", "b_nxk", "a_kxm"])
def test_wgmma_opt_matches_reference(dtype: str, a_transposed: bool, b_transposed: bool) -> None:
  """OptOps.WGMMA on the PYTHON device emulating an H100; the same kernel rendered for CUDA sm_90 compiles. A stored
  K x M and B K x N: a weight gradient g^T @ x."""
  a, b = _operands(dtype, (192, 256) if a_transposed else (256, 192), (384, 192) if b_transposed else (192, 384),
                   seed=1)
  if a_transposed: a = a.T
  if b_transposed: b = b.T
  item = _matmul_ast(a, b)
  kernel = Kernel(item.ast, PythonRenderer("CUDA_SM90"))
  kernel.apply_opt(Opt(OptOps.WGMMA, 3, 128))
  plan, arguments = kernel.wgmma
  assert (plan.m, plan.n, plan.k, plan.b_k_major, plan.a_k_major) == (256, 384, 192, b_transposed, not a_transposed)
  output = Buffer("PYTHON", item.outputs[0].size, item.outputs[0].dtype).allocate()
  runner = compile_kernel(kernel, "PYTHON")
  assert runner.global_size == plan.global_size and runner.local_size == (256, 1, 1)
  runner((output,) + item.inputs)
  _check(a, b, _values(output), dtype)
  if NVRTC is not None:
    cuda = Kernel(item.ast, CUDARenderer("sm_90"))
    cuda.apply_opt(Opt(OptOps.WGMMA, 3, 128))
    NVRTC.compile(CUDARenderer("sm_90").render_wgmma(cuda.name, *cuda.wgmma))


def test_heuristic_takes_wgmma_only_where_it_fits(monkeypatch) -> None:
  """Large multiples of the tile get WGMMA; a ragged matmul, one with an elementwise epilogue, a float32 one and any
  matmul on a renderer without wgmma keep their other opts (TC with PADTO for the ragged one)."""
  monkeypatch.setattr(tensor_core_plans, "WGMMA_MIN_WORK", 1)
  hopper = PythonRenderer("CUDA_SM90")
  def opts(a: Tensor, b: Tensor, renderer=hopper, epilogue=lambda x: x) -> list[Opt]:
    kernel = Kernel(create_schedule([epilogue(a @ b).lazydata])[-1].ast, renderer)
    kernel.hand_coded_optimizations()
    return kernel.applied_opts
  def modeled(m: int, n: int, k: int, out_itemsize: int = 2, processors: int = 132) -> list[Opt]:
    """The opt of the grid the model predicts fastest, computed here from the model's own functions."""
    grid = matmul_grid.fastest_wgmma_grid(1, m, n, k, 2, processors, hopper.dynamic_local_memory_bytes, out_itemsize)
    return [WgmmaPlan(grid.block_n, grid.stages, True, block_m=grid.block_m, ctas_per_sm=grid.ctas_per_sm,
                      persistent=grid.persistent).opt]
  a, b = Tensor.empty(256, 128, dtype=dtypes.float16), Tensor.empty(128, 512, dtype=dtypes.float16)
  assert opts(a, b) == modeled(256, 512, 128)
  monkeypatch.setattr(hopper, "multiprocessors", 4)   # the renderer's count (CUDA reads it from the GPU)
  assert opts(a, b) == modeled(256, 512, 128, processors=4)
  assert opts(a, Tensor.empty(128, 384, dtype=dtypes.float16)) == modeled(256, 384, 128, processors=4)
  assert opts(a, b, PythonRenderer("CUDA"))[0] == Opt(OptOps.TC, 0, 0)
  assert OptOps.WGMMA not in [opt.op for opt in opts(a, b, epilogue=lambda x: x.relu())]
  ragged = opts(Tensor.empty(250, 128, dtype=dtypes.float16), b)
  assert OptOps.WGMMA not in [opt.op for opt in ragged] and Opt(OptOps.TC, 0, 0) in ragged
  # float16 inputs widened in the kernel are still a float16 matmul (float32 output); float32 inputs are not
  assert opts(a.float(), b.float()) == modeled(256, 512, 128, out_itemsize=4, processors=4)
  f32 = opts(Tensor.empty(256, 128), Tensor.empty(128, 512))
  assert OptOps.WGMMA not in [opt.op for opt in f32]
  # without the multiprocessors' count, no model: the wide tile where its blocks fill them (with 0: always)
  monkeypatch.setattr(hopper, "multiprocessors", 0)
  assert opts(a, b) == [tensor_core_plans.WGMMA_TILES[0].opt]


def test_model_fills_the_machine_on_gpt2_shapes() -> None:
  """The grid model on an H200's 132 multiprocessors (TF32, K-major operands as staged): every choice fills at least
  one wave of CTAs, or runs in one wave whose CTAs each take a larger share of the work than a fuller grid would
  (the model's reason: fewer, larger tiles feed the tensor cores at a higher rate). The 4096 x 768 products take
  the 192-wide tile (128 CTAs: one wave, where 128 x 128 took 192 in two), 768 x 768 x 4096 and the lm-head's input
  gradient (K = 50304) split their reduce: the fastest of each row on the H200
  (extra/bench/results/bench_wgmma_grid_h200_s11.txt: 0.074 ms against 0.086 for 128 x 256 and 0.125 for 128 x 128;
  1.038 ms in 4 parts against 1.110 whole)."""
  shared = CUDARenderer.dynamic_local_memory_bytes
  for m, n, k in [(4096, 768, 768), (4096, 768, 3072), (768, 3072, 4096), (768, 768, 4096), (2304, 768, 4096),
                  (4096, 2304, 768), (4096, 768, 50304), (4096, 50304, 768), (50304, 768, 4096)]:
    grid = matmul_grid.fastest_wgmma_grid(1, m, n, k, 4, 132, shared, split=True)
    ctas = grid.parts * (m // grid.block_m) * (n // grid.block_n)
    waves = ctas / (132 * grid.ctas_per_sm)
    before = matmul_grid.WgmmaGrid(128, 128, 6)
    assert matmul_grid.wgmma_seconds(grid, 1, m, n, k, 4, 132) <= matmul_grid.wgmma_seconds(before, 1, m, n, k, 4, 132)
    # a partial last wave only where the waves are many (its idle share small) or the grid runs persistent
    assert waves >= 0.7 and (waves <= 1 or waves >= 3 or grid.persistent or waves % 1 >= 0.7), (m, n, k, grid, waves)
  assert matmul_grid.fastest_wgmma_grid(1, 4096, 768, 3072, 4, 132, shared).block_n == 192
  assert matmul_grid.fastest_wgmma_grid(1, 768, 768, 4096, 4, 132, shared, split=True).parts > 1
  assert matmul_grid.fastest_wgmma_grid(1, 4096, 768, 50304, 4, 132, shared, split=True).parts == 4


def test_model_ranks_tall_tiles_where_they_feed_more() -> None:
  """The 256- and 192-row tiles (4 and 3 consumer warpgroups) are ranked: where N = 50304 rules out 128 x 256, the
  lm-head forward takes 256 x 128 (85 multiply-adds a byte of operands against 128 x 192's 77) and its weight
  gradient 192 x 192 (96); where times tie, the 128-row tile stays first (4096^3: 128 x 256)."""
  shared = CUDARenderer.dynamic_local_memory_bytes
  for itemsize in (2, 4):
    lm_head = matmul_grid.fastest_wgmma_grid(1, 4096, 50304, 768, itemsize, 132, shared)
    assert (lm_head.block_m, lm_head.block_n, lm_head.persistent) == (256, 128, True)
    weight_gradient = matmul_grid.fastest_wgmma_grid(1, 50304, 768, 4096, itemsize, 132, shared)
    assert (weight_gradient.block_m, weight_gradient.block_n) == (192, 192)
    square = matmul_grid.fastest_wgmma_grid(1, 4096, 4096, 4096, itemsize, 132, shared)
    assert (square.block_m, square.block_n) == (128, 256)


def test_wgmma_refuses_other_opts() -> None:
  a, b = Tensor.empty(128, 64, dtype=dtypes.float16), Tensor.empty(64, 256, dtype=dtypes.float16)
  kernel = Kernel(create_schedule([(a @ b).lazydata])[-1].ast, PythonRenderer("CUDA_SM90"))
  with pytest.raises(KernelOptError): Kernel(kernel.ast, PythonRenderer("CUDA")).apply_opt(Opt(OptOps.WGMMA, 4, 256))
  with pytest.raises(KernelOptError): kernel.apply_opt(Opt(OptOps.WGMMA, 4, 192))   # 256 % 192
  with pytest.raises(KernelOptError): kernel.apply_opt(Opt(OptOps.WGMMA, 5, 256))   # 5 x 48 KB of shared memory
  kernel.apply_opt(Opt(OptOps.WGMMA, 4, 256))
  with pytest.raises(KernelOptError): kernel.apply_opt(Opt(OptOps.UPCAST, 0, 2))
  specialized = Kernel(kernel.ast, PythonRenderer("CUDA_SM90"))
  specialized.apply_opt(Opt(OptOps.WGMMA, WGMMA_SPECIALIZED + 3, 128))
  assert specialized.wgmma[0].specialized and specialized.wgmma[0].stages == 3 and specialized.wgmma[0].threads == 384
  deep = Kernel(kernel.ast, PythonRenderer("CUDA_SM90"))
  deep.apply_opt(Opt(OptOps.WGMMA, WGMMA_DEEP, 128))
  assert deep.wgmma[0].deep and deep.wgmma[0].stages == 4 and not deep.wgmma[0].specialized


BATCHES = {"batched": ((3, 128, 64), (3, 64, 256)), "shared_b": ((2, 128, 64), (64, 128))}


@pytest.mark.parametrize("name", list(BATCHES))
def test_batched_wgmma_matches_reference(name: str) -> None:
  """A batch axis becomes the grid's y: each entry's operands from its own offset (B shared: batch stride 0, in which
  case the batch merges into M)."""
  a, b = _operands("bfloat16", *BATCHES[name], seed=5)
  item = _matmul_ast(a, b)
  kernel = Kernel(item.ast, PythonRenderer("CUDA_SM90"))
  kernel.apply_opt(Opt(OptOps.WGMMA, 3, 128))
  plan = kernel.wgmma[0]
  assert (plan.batch, plan.m, plan.a_batch, plan.b_batch, plan.c_batch) == \
    ((3, 128, 128 * 64, 64 * 256, 128 * 256) if name == "batched" else (1, 256, 0, 0, 0))
  output = Buffer("PYTHON", item.outputs[0].size, item.outputs[0].dtype).allocate()
  compile_kernel(kernel, "PYTHON")((output,) + item.inputs)
  a64, b64 = (torch.tensor(x.cast(dtypes.float32).numpy(), dtype=torch.float64) for x in (a, b))
  reference = (a64 @ b64).numpy().reshape(-1)
  torch_out = (a64.bfloat16() @ b64.bfloat16()).double().numpy().reshape(-1)
  error, torch_error = (np.linalg.norm(x - reference) / np.linalg.norm(reference) for x in (_values(output), torch_out))
  assert error <= 1.5 * torch_error + 1e-7, (error, torch_error)
  if NVRTC is not None:
    cuda = Kernel(item.ast, CUDARenderer("sm_90"))
    cuda.apply_opt(Opt(OptOps.WGMMA, 3, 128))
    NVRTC.compile(CUDARenderer("sm_90").render_wgmma(cuda.name, *cuda.wgmma))


@pytest.mark.parametrize("widened", [False, True], ids=["float16_out", "float32_out"])
def test_tensor_matmul_takes_wgmma_end_to_end(monkeypatch, compiles, widened: bool) -> None:
  """Tensor @ Tensor on an emulated H100 goes through the heuristic's WGMMA (512^3: the smallest it takes); float16
  operands widened to float32 in the same kernel give the float32-output kernel."""
  from ourgrad.engine import realize
  monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer("CUDA_SM90"))
  realize._runner_cache.clear()
  a, b = _operands("float16", (512, 512), (512, 512), seed=4)
  result = (a.float() @ b.float() if widened else a @ b).realize()
  realize._runner_cache.clear()   # the kernels made for the emulated H100 stay out of later tests
  assert any("wgmma" in name for name in compiles), compiles
  assert result.dtype == (dtypes.float32 if widened else dtypes.float16)
  _check(a, b, result.cast(dtypes.float32).numpy().astype(np.float64).reshape(-1), "float16")


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_split_k_by_the_wgmma_model(monkeypatch, precision: str) -> None:
  """On an emulated H100 a matmul with few outputs and a long K splits by the WGMMA grid model (one 128 x 128 tile
  over K = 2048: the reduce in parts, each a CTA): bfloat16 factors (either layout), TF32 ones read along K, and TF32
  ones that need staging (g^T of a weight gradient: staged as (parts, M, K / parts)) run the split as one batched
  WGMMA kernel whose parts the consumer adds. Against PyTorch in float64."""
  from ourgrad.codegen.opt import split_reduce
  from ourgrad.engine import realize
  from ourgrad.helpers import set_float32_matmul_precision
  monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer("CUDA_SM90"))
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts(2, 2048))   # small outputs may split
  from ourgrad.engine import operand_staging
  for module in (tensor_core_plans, operand_staging): monkeypatch.setattr(module, "WGMMA_MIN_WORK", 1)
  realize._runner_cache.clear()
  set_float32_matmul_precision("high")
  try:
    rng = np.random.default_rng(7)
    dtype = dtypes.bfloat16 if precision == "bf16" else dtypes.float32
    a, b = (Tensor(rng.standard_normal((128, 2048)).astype(np.float32), device="PYTHON").cast(dtype).realize()
            for _ in range(2))
    a_t = a.T.contiguous().realize()
    cases = {"along_k": (lambda: a @ b.T, True), "staged": (lambda: a_t.T @ b.T, True)}
    for name, (build, splits) in cases.items():
      kernels = [Kernel(item.ast, Device["PYTHON"].renderer) for item in create_schedule([build().lazydata])
                 if item.ast.op is not None]
      for kernel in kernels: kernel.hand_coded_optimizations()
      plans = [kernel.wgmma[0] for kernel in kernels if kernel.wgmma is not None]
      assert len(plans) == 1, (name, [kernel.name for kernel in kernels])
      assert (plans[0].batch > 1) == splits, (name, plans[0])
      got = build().cast(dtypes.float32).numpy().astype(np.float64)
      a64, b64 = (torch.tensor(x.cast(dtypes.float32).numpy(), dtype=torch.float64) for x in (a, b))
      reference = (a64 @ b64.T).numpy()
      error = np.linalg.norm(got - reference) / np.linalg.norm(reference)
      assert error < (1e-2 if precision == "bf16" else 2e-3), (name, error)
  finally:
    set_float32_matmul_precision("highest")
    realize._runner_cache.clear()


# ================================================================ on an H100

CUDA = device_opens("CUDA") and getattr(Device["CUDA"].renderer, "has_wgmma", False)


@pytest.mark.skipif(not CUDA, reason="needs CUDA on an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sizes", [(1024, 512, 2048), (4096, 4096, 4096)], ids=["1024x512x2048", "4096"])
@pytest.mark.parametrize("a_transposed", [False, True], ids=["a_mxk", "a_kxm"])
def test_cuda_wgmma_matmul(dtype: str, sizes: tuple[int, int, int], a_transposed: bool) -> None:
  """On the GPU, against float64; A stored K x M (a weight gradient's g^T) is transposed by the instruction."""
  m, k, n = sizes
  a, b = _operands(dtype, (k, m) if a_transposed else (m, k), (k, n), seed=2, device="CUDA")
  if a_transposed: a = a.T
  item = _matmul_ast(a, b, "CUDA")
  kernel = Kernel(item.ast, Device["CUDA"].renderer)
  kernel.hand_coded_optimizations()
  assert kernel.wgmma is not None and kernel.wgmma[0].a_k_major != a_transposed, kernel.applied_opts
  output = Buffer("CUDA", item.outputs[0].size, item.outputs[0].dtype).allocate()
  compile_kernel(kernel, "CUDA")((output,) + item.inputs)
  _check(a, b, _values(output), dtype)
