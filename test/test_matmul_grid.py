"""The float32 matmul grid on GPUs (codegen/opt/matmul_grid.py, MATMUL_GRID=1): the block tile and the split of the
reduce across blocks (split-K) from one cost model of the busiest multiprocessor's time.

The split matmuls run on the PYTHON device with a GPU's thread blocks and local memory (its heuristic then stages
the partial products in SHARED tiles) and must equal PyTorch's float64 result; the kernels are also rendered as CUDA
C++ and compiled by NVRTC (sm_90) where it is installed. The choices for MiniLM's and SmolLM2's medium matmuls are
pinned on an H100's 132 multiprocessors (bench_matmul.py rows of the same shapes).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import torch

from ourgrad import Device, Tensor
from ourgrad.codegen.opt import split_reduce
from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.opt import matmul_grid
from ourgrad.codegen.opt.shared_tile_plans import SharedTile, apply_shared_tile
from ourgrad.codegen.opt.matmul_grid import TILE_RATES, GRID_EXTRA_TILES, matmul_seconds, split_k_parts, tile_block
from ourgrad.device import Buffer
from ourgrad.engine.realize import compile_kernel
from ourgrad.runtime.ops_python import PythonRenderer
from ourgrad.engine.realize import run_schedule
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.renderer.cuda import CUDARenderer

from helpers import nvrtc_compiler

NVRTC = nvrtc_compiler()
H100 = 132


@pytest.fixture
def matmul_grid_on(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setenv("MATMUL_GRID", "1")


@pytest.fixture
def small_matmul_split(monkeypatch: pytest.MonkeyPatch, matmul_grid_on: None) -> None:
  """The PYTHON device with an H100's multiprocessors, and split-K allowed on small shapes (fast to interpret): at
  least 256 outputs (a wave of 16 blocks x 16 outputs a thread, split_reduce.leaves_device_idle). A 32x32 output
  over K = 4096 is 4 blocks of 16x16: in 8 parts 32."""
  monkeypatch.setattr(Device["PYTHON"].renderer, "multiprocessors", H100)
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts(2, 2048))   # a wave of 16 blocks
  monkeypatch.setattr(matmul_grid, "GRID_MIN_MACS", 0)


def _kernels(out: Tensor) -> list[ScheduleItem]:
  return [item for item in create_schedule([out.lazydata]) if item.ast.op.name != "COPY"]


# ---------------------------------------------------------------- the model

def test_model_keeps_the_large_square_in_whole_tiles() -> None:
  """4096^3: 1024 blocks of 128x128 fill 132 multiprocessors 7.8 times over; no smaller tile and no split is
  predicted faster (bench_matmul: 40.5 TFLOP/s, 3.4 ms; the model says 3.5)."""
  seconds = {tile: matmul_seconds(tile, 1, 4096, 4096, 4096, H100) for tile in TILE_RATES
             if 4096 % tile_block(tile)[1] == 0}
  assert tile_block(min(seconds, key=lambda tile: seconds[tile])) == (128, 128)
  assert 3.0e-3 < seconds[(16, 16, 2, 2)] < 4.0e-3
  assert split_k_parts(1, 4096, 4096, 4096, H100) == 1


def test_model_splits_a_long_reduce_with_few_blocks() -> None:
  """MiniLM's feed-forward down projection, 2048x1536 @ 1536x384: 48 blocks of 128x128 (the H100 ran them at 167 us
  a launch, the model says 164); split, the grid fills the multiprocessors in one round."""
  assert abs(matmul_seconds((16, 16, 2, 2), 1, 2048, 384, 1536, H100) - 167e-6) < 10e-6
  parts = split_k_parts(1, 2048, 384, 1536, H100)
  assert parts > 1 and 2048 * 384 * parts // (128 * 192) <= H100   # one round of blocks
  assert split_k_parts(1, 2048, 384, 1536, 0) == 1   # unknown multiprocessors: no split


# ---------------------------------------------------------------- tiles of 3 float4 runs along N

@pytest.mark.parametrize("shape", GRID_EXTRA_TILES, ids=lambda shape: "x".join(map(str, tile_block(shape))))
def test_wide_run_tiles_match_numpy(shape: tuple[int, int, int, int]) -> None:
  """Each tile of 3 runs along N (8x12 or 4x12 outputs a thread, 96 to 256 threads, some not a power of two) on the
  emulated GPU: a Linear's forward over two blocks along M equals numpy's float64 product."""
  block_m, block_n = tile_block(shape)
  m, k, n = 2 * block_m, 48, block_n
  rng = np.random.default_rng(block_m + block_n)
  a_np, b_np = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((n, k)).astype(np.float32)
  schedule = create_schedule([(Tensor(a_np, device="PYTHON") @ Tensor(b_np, device="PYTHON").T).lazydata])
  run_schedule(schedule[:-1])
  item = schedule[-1]
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  assert apply_shared_tile(kernel, SharedTile(*shape, (16,)), 16)
  output = Buffer("PYTHON", item.outputs[0].size, item.outputs[0].dtype).allocate()
  compile_kernel(kernel, "PYTHON")((output,) + item.inputs)
  expected = a_np.astype(np.float64) @ b_np.T.astype(np.float64)
  np.testing.assert_allclose(output.numpy().reshape(m, n), expected, rtol=1e-4, atol=1e-4)
  if NVRTC is not None:
    cuda = Kernel(item.ast, CUDARenderer())
    for opt in kernel.applied_opts: cuda.apply_opt(opt)
    NVRTC.compile(CUDARenderer().render(cuda.name, linearize(cuda)))


# ---------------------------------------------------------------- split-K matmuls against torch

SPLIT_CASES: dict[str, tuple[Callable[..., Tensor], Callable[..., torch.Tensor], list[tuple[int, ...]]]] = {
  # a Linear's forward (weight stored out x in), its bias added after the sum of the parts
  "linear": (lambda x, w, b: x @ w.T + b, lambda x, w, b: x @ w.T + b, [(32, 4096), (32, 4096), (32,)]),
  # a plain matmul over batch and token axes
  "batched_tokens": (lambda x, w, b: (x @ w + b).relu(), lambda x, w, b: (x @ w + b).relu(),
                     [(2, 16, 4096), (4096, 32), (32,)]),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_split_k_matmul_matches_torch(case: str, small_matmul_split: None) -> None:
  """A matmul with few output blocks and a long reduce is split into parts: a kernel of partial products (the parts
  a batch axis of its grid, SHARED tiles), then one summing them; the result equals PyTorch's float64."""
  ours, theirs, shapes = SPLIT_CASES[case]
  rng = np.random.default_rng(len(case))
  values = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
  kernels = _kernels(ours(*(Tensor.empty(*shape, device="PYTHON") for shape in shapes)))
  assert len(kernels) == 2, [item.ast for item in kernels]
  partials = Kernel(kernels[0].ast, Device["PYTHON"].renderer)
  partials.hand_coded_optimizations()
  assert partials.shared_tiles and partials.full_shape[0] == 8, partials.applied_opts   # 8 parts of 512
  got = ours(*(Tensor(value, device="PYTHON") for value in values)).numpy().astype(np.float64)
  expected = theirs(*(torch.from_numpy(value.astype(np.float64)) for value in values)).numpy()
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
  if NVRTC is not None:
    for item in kernels:
      kernel = Kernel(item.ast, CUDARenderer())
      kernel.hand_coded_optimizations()
      NVRTC.compile(CUDARenderer().render(kernel.name, linearize(kernel)))


def test_no_split_without_matmul_grid(monkeypatch: pytest.MonkeyPatch, small_matmul_split: None) -> None:
  monkeypatch.setenv("MATMUL_GRID", "0")
  a, b = Tensor.empty(32, 4096, device="PYTHON"), Tensor.empty(32, 4096, device="PYTHON")
  assert len(_kernels(a @ b.T)) == 1


def test_split_schedule_runs(small_matmul_split: None) -> None:
  """The partial products and their sum run in order from the schedule (run_schedule), as the JIT captures them."""
  rng = np.random.default_rng(3)
  a_np, b_np = rng.standard_normal((32, 4096)).astype(np.float32), rng.standard_normal((4096, 32)).astype(np.float32)
  out = Tensor(a_np, device="PYTHON") @ Tensor(b_np, device="PYTHON")
  schedule = create_schedule([out.lazydata])
  assert sum(1 for item in schedule if item.ast.op.name != "COPY") == 2
  run_schedule(schedule)
  np.testing.assert_allclose(out.numpy(), a_np.astype(np.float64) @ b_np, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the choices for MiniLM's and SmolLM2's matmuls

def _linear_kernels(m: int, k: int, n: int) -> list[Kernel]:
  """The kernels of x @ w.T (x: m x k, w: n x k) scheduled for an H100 (split-K decided by the lazy layer on the
  CUDA renderer's 132 multiprocessors), each with the heuristic's opts."""
  x, w = Tensor.empty(m, k, device="PYTHON"), Tensor.empty(n, k, device="PYTHON")
  kernels = []
  for item in _kernels(x @ w.T):
    kernel = Kernel(item.ast, CUDARenderer())
    kernel.hand_coded_optimizations()
    kernels.append(kernel)
  return kernels


def _tile(kernel: Kernel) -> tuple[int, int]:
  """(block M, block N) of a SHARED matmul kernel: its M and N axes' LOCAL and UPCAST sizes multiplied."""
  threads = [opt.amount for opt in kernel.applied_opts if opt.op is OptOps.LOCAL]
  upcasts = [opt.amount for opt in kernel.applied_opts if opt.op is OptOps.UPCAST]
  runs = (upcasts[3], upcasts[2]) if len(upcasts) == 4 else (upcasts[2], 1) if len(upcasts) == 3 else (1, 1)
  if len(upcasts) == 3 and kernel.applied_opts[-3] == Opt(OptOps.UPCAST, 1, upcasts[2]): runs = (1, upcasts[2])
  return threads[0] * 4 * runs[0], threads[1] * 4 * runs[1]


MEDIUM_CHOICES = {
  # name: (m, k, n), kernels, the matmul kernel's block tile
  "minilm_ffn_down": ((2048, 1536, 384), 2, (128, 192)),
  "minilm_qkv": ((2048, 384, 1152), 1, (128, 192)),
  "minilm_ffn_up": ((2048, 384, 1536), 1, (128, 192)),
}


@pytest.mark.parametrize("name", list(MEDIUM_CHOICES))
def test_medium_matmul_choices_on_an_h100(name: str, monkeypatch: pytest.MonkeyPatch, matmul_grid_on: None) -> None:
  monkeypatch.setattr(Device["PYTHON"].renderer, "multiprocessors", H100)
  (m, k, n), count, tile = MEDIUM_CHOICES[name]
  kernels = _linear_kernels(m, k, n)
  assert len(kernels) == count
  assert kernels[0].shared_tiles and _tile(kernels[0]) == tile, kernels[0].applied_opts


# MiniLM's matmuls at 1/16 of the tokens and 1/8 of the reduce, on 132/16 multiprocessors: the model's choice is the
# same as at full size on 132 (blocks and the reduce scale together), small enough for the interpreter
SCALED_MINILM = {"ffn_down": (2048, 1536, 384), "qkv": (2048, 384, 1152), "ffn_up": (2048, 384, 1536)}


@pytest.mark.parametrize("name", list(SCALED_MINILM))
def test_scaled_minilm_choice_matches_numpy(name: str, monkeypatch: pytest.MonkeyPatch, matmul_grid_on: None) -> None:
  """The tile (and split) chosen for a MiniLM matmul, scaled down, equals the full-size choice; its kernels, run on
  the emulated GPU in schedule order, equal numpy's float64 product."""
  m, k, n = SCALED_MINILM[name]
  monkeypatch.setattr(Device["PYTHON"].renderer, "multiprocessors", H100)   # the lazy layer's split
  full = _linear_kernels(m, k, n)
  renderer = PythonRenderer("CUDA")
  renderer.multiprocessors = H100 // 16
  monkeypatch.setattr(Device["PYTHON"].renderer, "multiprocessors", H100 // 16)
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts(2, 2048))   # a wave of 16 blocks
  monkeypatch.setattr(matmul_grid, "SPLIT_MIN_PART", matmul_grid.SPLIT_MIN_PART // 8)
  monkeypatch.setattr(matmul_grid, "SPLIT_MIN_K", matmul_grid.SPLIT_MIN_K // 8)
  monkeypatch.setattr(matmul_grid, "GRID_MIN_MACS", matmul_grid.GRID_MIN_MACS // 128)
  small_m, small_k = m // 16, k // 8
  rng = np.random.default_rng(len(name))
  a_np = rng.standard_normal((small_m, small_k)).astype(np.float32)
  b_np = rng.standard_normal((n, small_k)).astype(np.float32)
  schedule = create_schedule([(Tensor(a_np, device="PYTHON") @ Tensor(b_np, device="PYTHON").T).lazydata])
  items = [item for item in schedule if item.ast.op.name != "COPY"]
  run_schedule([item for item in schedule if item.ast.op.name == "COPY"])
  kernels = []
  for item in items:
    kernel = Kernel(item.ast, renderer)
    kernel.hand_coded_optimizations()
    for buffer in item.outputs: buffer.allocate()
    compile_kernel(kernel, "PYTHON")(item.bufs)
    kernels.append(kernel)
  assert len(kernels) == len(full) and _tile(kernels[0]) == _tile(full[0]), kernels[0].applied_opts
  got = items[-1].outputs[0].numpy().reshape(small_m, n)
  np.testing.assert_allclose(got, a_np.astype(np.float64) @ b_np.T.astype(np.float64), rtol=1e-4, atol=1e-4)
