"""The tensor-core strategies of the GPU heuristic as typed plans (codegen/opt/plans.py): Hopper's warpgroup MMA
(`WgmmaPlan`: a large float16/bfloat16 matmul whose sizes are multiples of a tile becomes codegen/wgmma_tiles.py's
kernel) and mma.sync tiles (`TensorCorePlan`: OptOps.TC, warp and block tiles, staged through local memory or not),
float16/bfloat16 always and float32 through TF32 where the user allows it. Any operand layout the TC opt takes
(transposed, batched, several views, computed from loads: codegen/matmul_operands.py); ragged M/N padded first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ourgrad.codegen.kernel import Kernel, KernelOptError
from ourgrad.codegen.tensor_core_layout import tensor_core_operands
from ourgrad.codegen.opt import matmul_grid
from ourgrad.codegen.opt.plans import Plan, Strategy, gpu_reduce, register_plan
from ourgrad.codegen.opts import TC_TILE_STAGES, Opt, OptOps, TileStages
from ourgrad.codegen.wgmma_tiles import WgmmaTile
from ourgrad.helpers import DEBUG, prod
from ourgrad.ops import Ops


@register_plan
@dataclass(frozen=True)
class WgmmaPlan(Plan):
  """OptOps.WGMMA (CUDA sm_90): the block's N tile, the shared-memory stages, the kernel's kind (`specialized`: a
  producer warpgroup copies, the others compute; `deep`: the cooperative kernel copying stages - 1 steps ahead;
  neither: the cooperative kernel), the block's M tile (64 per consumer warpgroup), CTAs per multiprocessor and a
  persistent grid (see wgmma_tiles.WgmmaTile, the Opt's arg)."""
  block_n: int
  stages: int
  specialized: bool = False
  deep: bool = False
  block_m: int = 128
  ctas_per_sm: int = 1
  persistent: bool = False

  @property
  def tile(self) -> WgmmaTile:
    return WgmmaTile(self.block_n, self.stages, self.block_m, self.specialized, self.deep, self.ctas_per_sm,
                     self.persistent)

  @property
  def opt(self) -> Opt:
    """The Opt the Kernel applies: its arg is the plan's WgmmaTile."""
    return Opt(OptOps.WGMMA, 0, 0, self.tile)

  def apply(self, kernel: Kernel) -> bool: return kernel.try_opt(self.opt)


register_plan(WgmmaTile)   # the arg of the WGMMA Opts a BEAM result holds

# the plans without the grid model (the renderer's multiprocessors unknown): the wide tile first where it gives every
# multiprocessor a block. (H100 run: the warp-specialized 128 x 256 kernel 527-541 TFLOP/s at 4096^3, the cooperative
# one 455-492)
WGMMA_TILES = (WgmmaPlan(256, 4, specialized=True), WgmmaPlan(128, 6, specialized=True))
# the least work (M N K) that takes WGMMA (a smaller matmul keeps mma.sync)
WGMMA_MIN_WORK = 512 ** 3
# the smallest block tile along M and N of the plans operand staging (engine/operand_staging.py) stages operands for:
# M and N multiples of it, and the reuse at which a staging copy is amortized. The lazy layer's split-K of a TF32
# matmul read M/N-major (lazy_reduce.py) asks it too: such a split runs on WGMMA only where its operands are staged
WGMMA_STAGED_TILE = 128
# what BEAM may try beside the model's choice: the cooperative kernel in 4 and 2 stages, N tiles of 128 and 256; the
# specialized one 192 wide, persistent, and in 64-row tiles two CTAs to a multiprocessor
WGMMA_SEARCH = WGMMA_TILES + tuple(WgmmaPlan(block_n, stages) for block_n in (128, 256) for stages in (4, 2)) + (
  WgmmaPlan(192, 5, specialized=True), WgmmaPlan(256, 4, specialized=True, persistent=True),
  WgmmaPlan(192, 5, specialized=True, persistent=True), WgmmaPlan(128, 6, specialized=True, persistent=True),
  WgmmaPlan(128, 4, specialized=True, block_m=64, ctas_per_sm=2))
# the probe that reads a kernel's matmul (its sizes, dtypes) before the model ranks its grids: the smallest tile
WGMMA_PROBE = WgmmaTile(64, 3, 64)


class WgmmaStrategy(Strategy):
  """WGMMA where the renderer has it and the kernel is a large enough plain float16/bfloat16 (or TF32) matmul whose
  sizes are multiples of a tile (codegen/wgmma_tiles.plan_for_kernel); ragged ones keep TC with PADTO. The grid is
  the one codegen/opt/matmul_grid.py predicts fastest on the renderer's multiprocessors (block tile, stages, CTAs
  per multiprocessor, persistent or not); without their count, WGMMA_TILES' rule."""
  name = "wgmma"
  beam_ops = (OptOps.WGMMA,)

  def applies(self, kernel: Kernel) -> bool:
    return gpu_reduce(kernel) and getattr(kernel.renderer, "has_wgmma", False) and not kernel.applied_opts

  def choose(self, kernel: Kernel) -> tuple[Plan, Kernel] | None:
    if prod(kernel.full_shape) < WGMMA_MIN_WORK: return None
    processors = getattr(kernel.renderer, "multiprocessors", 0)
    plans = _modeled_plans(kernel, processors) if processors > 0 else _unmodeled_plans(kernel)
    for plan in plans:
      trial = kernel.copy()
      if plan.apply(trial): return plan, trial
    return None

  def beam_actions(self, kernel: Kernel) -> Iterator[Opt]:
    yield from (plan.opt for plan in WGMMA_SEARCH)   # a renderer without wgmma refuses them (Kernel._apply_wgmma)


def _unmodeled_plans(kernel: Kernel) -> tuple[WgmmaPlan, ...]:
  """WGMMA_TILES, the narrow tile first where the wide one's blocks would leave multiprocessors idle."""
  wide_blocks = prod(kernel.full_shape[:-1]) // (WGMMA_TILES[0].block_m * WGMMA_TILES[0].block_n)
  return WGMMA_TILES if wide_blocks >= kernel.renderer.multiprocessors else WGMMA_TILES[::-1]


def _modeled_plans(kernel: Kernel, processors: int) -> list[WgmmaPlan]:
  """The warp-specialized plans of every grid matmul_grid.wgmma_grids lists for the kernel's matmul, fastest first
  by matmul_grid.wgmma_seconds; none where the kernel is no WGMMA matmul (the probe tile does not apply)."""
  probe = kernel.copy()
  if not probe.try_opt(Opt(OptOps.WGMMA, 0, 0, WGMMA_PROBE)): return []
  matmul = probe.wgmma[0]
  shared_bytes = getattr(kernel.renderer, "dynamic_local_memory_bytes", 0)
  out_itemsize = 4 if matmul.out_dtype == "float32" else 2
  grids = matmul_grid.wgmma_grids(matmul.batch, matmul.m, matmul.n, matmul.k, matmul.itemsize, shared_bytes)
  grids.sort(key=lambda grid: matmul_grid.wgmma_seconds(grid, matmul.batch, matmul.m, matmul.n, matmul.k,
                                                        matmul.itemsize, processors, out_itemsize))
  return [WgmmaPlan(grid.block_n, grid.stages, specialized=True, block_m=grid.block_m, ctas_per_sm=grid.ctas_per_sm,
                    persistent=grid.persistent) for grid in grids]


@register_plan
@dataclass(frozen=True)
class TensorCoreTile:
  """A block tile of the tensor-core matmul: instruction tiles per warp along M and N (UPCAST) and warps per block
  along M and N (LOCAL); 1 where the kernel takes none."""
  warp_m: int
  warp_n: int
  warps_m: int
  warps_n: int

  def block(self, dims: tuple[int, int, int]) -> tuple[int, int]:
    """(M, N) elements of the block tile for an instruction of `dims` (m, n, k)."""
    return self.warp_m * self.warps_m * dims[0], self.warp_n * self.warps_n * dims[1]


@register_plan
@dataclass(frozen=True)
class TensorCorePlan(Plan):
  """OptOps.TC with the renderer's tensor core `choice` (its index in renderer.tensor_cores), the warp and block tile
  `tile`, and, where `staged`, the block's tiles staged through local memory (SHARED: cp.async copies or computed
  stores, ldmatrix fragments) in reduce steps of `k_steps` instructions over `stages` buffers. With `pad`, ragged M
  and N are padded first: to the block tile where staged, else to the instruction's tile."""
  choice: int
  tile: TensorCoreTile
  staged: bool = True
  pad: bool = True
  k_steps: int = 1
  stages: int = TC_TILE_STAGES

  def apply(self, kernel: Kernel) -> bool:
    if not _tiled_tensor_core(kernel, self.choice, self.tile, self.staged, self.pad): return False
    if not self.staged: return True
    if self.k_steps > 1 and not kernel.try_opt(Opt(OptOps.UNROLL, 0, self.k_steps)): return False
    return kernel.try_opt(_shared_stages_opt(self.stages))


def _shared_stages_opt(stages: int) -> Opt:
  """SHARED after TC: the tiles' stages."""
  return Opt(OptOps.SHARED, 0, 0, TileStages(stages))


# the unstaged kernel's warp tile (m tiles x n tiles; n is tried at 4 then 2) and a block's warps (along m x along n)
TC_WARP_TILES = (2, 4)
TC_BLOCK_WARPS = (2, 2)
# the staged tiles, largest first: 64x64 warp tiles in 2x2 warps (a 128x128 block tile with m16n8), then smaller
# blocks for matmuls whose grid of large ones leaves multiprocessors idle (a 768x768 weight gradient: 36 blocks of
# 128x128, 144 of 64x64) or whose M or N is 64 (an attention head)
TC_STAGED_TILES = (TensorCoreTile(4, 8, 2, 2), TensorCoreTile(4, 4, 2, 2),
                   TensorCoreTile(2, 8, 2, 2), TensorCoreTile(2, 4, 2, 2))
# K instructions per reduce step, largest first: 4 (64 elements, 72 KB of tiles in dynamic shared memory) measured
# 283 TFLOP/s on the H100 at 4096^3 float16, 2 (32, 38 KB) 276, 1 (16) 215
TC_STAGED_K_STEPS = (4, 2)
# TF32 (mma.sync m16n8k8) only pays in the staged kernel with enough blocks to fill the device. H100 run
# (bench_matmul --tf32, against the float32 shared tiles): grids of 16-28 blocks 1.2-2.3x slower, 20-32 blocks about
# 10% faster, 120-1024 blocks 1.5-3.3x faster; the unstaged kernel never won (4096^3: 38.9 TFLOP/s; a conv weight
# gradient 36 us instead of 22.5)
TF32_MIN_BLOCKS = 64


class TensorCoreStrategy(Strategy):
  """TC where the kernel is a matmul the renderer's tensor cores compute, per instruction the renderer has (TF32 only
  where allowed): the staged kernel in the largest block tile of TC_STAGED_TILES whose grid gives every
  multiprocessor (the renderer's count) a block, else the one with the most blocks, tiles that need no padding of M
  or N before those that do (TF32 only with TF32_MIN_BLOCKS blocks at least); else (not TF32) the unstaged kernel,
  ragged M/N padded to the instruction, each warp several tiles (UPCAST) and each block several warps (LOCAL)."""
  name = "tensor_cores"
  beam_ops = (OptOps.TC,)

  def applies(self, kernel: Kernel) -> bool: return gpu_reduce(kernel)

  def choose(self, kernel: Kernel) -> tuple[Plan, Kernel] | None:
    for choice, tc in enumerate(getattr(kernel.renderer, "tensor_cores", ())):
      if not tc.allowed(): continue   # TF32 only where the user allows it (float32 matmul precision "high")
      staged = _staged_plan(kernel, choice)
      if staged is not None: return staged
      if tc.is_tf32: continue   # the unstaged TF32 kernel was never faster than the float32 tiles (TF32_MIN_BLOCKS)
      unstaged = _unstaged_plan(kernel, choice)
      if unstaged is not None: return unstaged
    if DEBUG >= 3: _print_why_no_tensor_core(kernel)
    return None

  def beam_actions(self, kernel: Kernel) -> Iterator[Opt]:
    for choice, tc in enumerate(getattr(kernel.renderer, "tensor_cores", ())):
      if tc.allowed(): yield Opt(OptOps.TC, 0, choice)
    if kernel.tensor_core is not None: yield _shared_stages_opt(TC_TILE_STAGES)


def _staged_plan(kernel: Kernel, choice: int) -> tuple[TensorCorePlan, Kernel] | None:
  """The staged plan of instruction `choice` (see TensorCoreStrategy) and its kernel; None where no tile fits."""
  tc = kernel.renderer.tensor_cores[choice]
  processors = getattr(kernel.renderer, "multiprocessors", 0)
  for pad in (False, True):
    fitting = []
    for tile in TC_STAGED_TILES:
      trial = kernel.copy()
      plan = staged_tensor_core_plan(trial, choice, tile, pad)
      if plan is not None: fitting.append((plan, trial))
    if not fitting: continue
    blocks = [prod(trial.full_shape[:trial.global_dims]) for _, trial in fitting]
    best = next((number for number, count in enumerate(blocks) if count >= processors), None)
    if best is None: best = max(range(len(fitting)), key=lambda number: blocks[number])
    if tc.is_tf32 and blocks[best] < TF32_MIN_BLOCKS: return None
    return fitting[best]
  return None


def _unstaged_plan(kernel: Kernel, choice: int) -> tuple[TensorCorePlan, Kernel] | None:
  """TC of instruction `choice` (ragged M/N padded to its tile), then the warp tile (n first, 4 or 2 tiles; then m)
  and warps per block where the axes take them; None where TC does not apply."""
  trial = kernel.copy()
  if not _pad_for_tensor_core(trial, choice) or not trial.try_opt(Opt(OptOps.TC, 0, choice)): return None
  taken = {}
  for key, position, amounts in (("warp_n", 1, (TC_WARP_TILES[1], 2)), ("warp_m", 0, (TC_WARP_TILES[0],))):
    for amount in amounts:
      axis = _tensor_core_outer_axis(trial, position)
      if axis is not None and trial.try_opt(Opt(OptOps.UPCAST, axis, amount)):
        taken[key] = amount
        break
  for key, position, warps in (("warps_n", 1, TC_BLOCK_WARPS[1]), ("warps_m", 0, TC_BLOCK_WARPS[0])):
    axis = _tensor_core_outer_axis(trial, position)
    if axis is not None and trial.try_opt(Opt(OptOps.LOCAL, axis, warps)): taken[key] = warps
  tile = TensorCoreTile(taken.get("warp_m", 1), taken.get("warp_n", 1), taken.get("warps_m", 1),
                              taken.get("warps_n", 1))
  return TensorCorePlan(choice, tile, staged=False), trial


def _tiled_tensor_core(kernel: Kernel, choice: int, tile: TensorCoreTile, staged: bool, pad: bool) -> bool:
  """PADTO (with `pad`: to the block tile where `staged`, else to the instruction), TC, then `tile`'s warp tiles and
  warps (UPCAST n, UPCAST m, LOCAL n, LOCAL m; 1: none). False where one does not fit."""
  tc = kernel.renderer.tensor_cores[choice]
  if pad and not _pad_for_tensor_core(kernel, choice, tile.block(tc.dims) if staged else None): return False
  if not kernel.try_opt(Opt(OptOps.TC, 0, choice)): return False
  for op, position, amount in ((OptOps.UPCAST, 1, tile.warp_n), (OptOps.UPCAST, 0, tile.warp_m),
                               (OptOps.LOCAL, 1, tile.warps_n), (OptOps.LOCAL, 0, tile.warps_m)):
    if amount == 1: continue
    axis = _tensor_core_outer_axis(kernel, position)
    if axis is None or not kernel.try_opt(Opt(op, axis, amount)): return False
  return True


def staged_tensor_core_plan(kernel: Kernel, choice: int, tile: TensorCoreTile,
                            pad: bool = True) -> TensorCorePlan | None:
  """TC (instruction `choice`) with `tile`'s warp and block tiles, staged through local memory, in reduce steps of 4
  or 2 instructions where K allows (TC_STAGED_K_STEPS), else 1; with `pad`, ragged M and N padded to the block tile.
  Applied to `kernel` in place; its plan, or None where it does not fit (the kernel may then hold some opts: pass a
  copy)."""
  if not _tiled_tensor_core(kernel, choice, tile, True, pad): return None
  for steps in TC_STAGED_K_STEPS:
    with_unroll = kernel.copy()
    if with_unroll.try_opt(Opt(OptOps.UNROLL, 0, steps)) and with_unroll.try_opt(_shared_stages_opt(TC_TILE_STAGES)):
      kernel.__dict__.update(with_unroll.__dict__)
      return TensorCorePlan(choice, tile, pad=pad, k_steps=steps)
  return TensorCorePlan(choice, tile, pad=pad) if kernel.try_opt(_shared_stages_opt(TC_TILE_STAGES)) else None


def apply_staged_tensor_core(kernel: Kernel, choice: int, tile: TensorCoreTile, pad: bool = True) -> bool:
  """staged_tensor_core_plan, as a bool: for benchmarks and tests that compare tiles."""
  return staged_tensor_core_plan(kernel, choice, tile, pad) is not None


def _print_why_no_tensor_core(kernel: Kernel) -> None:
  """DEBUG=3: why a matmul-shaped kernel (a SUM of a MUL) stays off the tensor cores, per instruction the renderer
  has (the TC opt's refusal, or that no staged block tile fits, or TF32 not allowed)."""
  product = kernel.reduceop.srcs[0]
  if product.op is Ops.CAST: product = product.srcs[0]
  if kernel.reduceop.op is not Ops.SUM or product.op is not Ops.MUL: return
  for choice, tc in enumerate(getattr(kernel.renderer, "tensor_cores", ())):
    try:
      kernel.copy().apply_opt(Opt(OptOps.TC, 0, choice))
      reason = "no staged block tile fits (or too few blocks for TF32)" if tc.is_tf32 else "no tile fits"
    except KernelOptError as error:
      reason = str(error)
    print(f"{kernel.name}: no tensor cores ({tc}): {reason}")


def _pad_for_tensor_core(kernel: Kernel, choice: int, tiles: tuple[int, int] | None = None) -> bool:
  """PADTO the matmul's M and N axes up to the instruction's tile (or `tiles`) where they are ragged; False where
  the kernel is not a matmul the instruction computes (or K is ragged: a reduce axis is not padded)."""
  tc = kernel.renderer.tensor_cores[choice]
  try: a, b = tensor_core_operands(kernel.reduceop, tc)
  except KernelOptError: return False
  m_axes, n_axes, _ = kernel.matmul_axes(a, b)
  tiles = tiles or (tc.dims[0], tc.dims[1])
  for axes, instruction_tile, tile in ((m_axes, tc.dims[0], tiles[0]), (n_axes, tc.dims[1], tiles[1])):
    axis = kernel.tile_axis(axes, instruction_tile) if axes else None
    if axis is not None and kernel.full_shape[axis] % tile != 0 and not kernel.try_opt(Opt(OptOps.PADTO, axis, tile)):
      return False
  return True


def _tensor_core_outer_axis(kernel: Kernel, position: int) -> int | None:
  """After TC: the global axis left of the matmul's M (position 0) or N (position 1) outside the instruction."""
  applied = kernel.tensor_core
  axes = kernel.matmul_axes(applied.a, applied.b)[position]
  axes = [axis for axis in axes if axis < kernel.global_dims]
  return axes[-1] if axes else None
