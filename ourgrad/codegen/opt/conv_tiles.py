"""Hand-coded GPU choices for convolutions (called by heuristic.hand_coded_optimizations): a float32 convolution as
an implicit GEMM with both operands staged through local memory (shared_conv_tiles), a float16/bfloat16 one on
staged tensor cores (TensorCoreConvStrategy), and the partial-sums kernel of a split-K weight gradient
(weight_gradient_tiles). docs/codegen.md, "Convolutions on GPUs", has the figures behind each choice.
"""
from __future__ import annotations

from dataclasses import dataclass

from ourgrad.codegen.kernel import Kernel, KernelOptError, Opt, OptOps, matmul_operands
from ourgrad.codegen.opts import TileStages
from ourgrad.codegen.shared_tiles import SharedStructure
from ourgrad.dtype import DType, dtypes
from ourgrad.codegen.opt.plans import Plan, Strategy, gpu_local_reduce, register_plan
from ourgrad.helpers import power_of_two_divisor


@register_plan
@dataclass(frozen=True)
class ConvTile:
  """A block tile of a convolution staged through local memory (implicit GEMM): outputs per thread and threads per
  block along the pixel side (the output axes only the input window varies along: batch, rows, columns) and the
  channel side (the filter's output channels), and the reduce step (input channels per step). The repeats multiply a
  thread's outputs once more after the threads are placed: `channel_repeat` runs of `channel_upcast` channels a
  block's width apart, `pixel_repeat` pixels along the outermost pixel axis (the batch: several images)."""
  pixel_upcast: int
  pixel_threads: int
  channel_upcast: int
  channel_threads: int
  reduce_step: int
  pixel_repeat: int = 1
  channel_repeat: int = 1
  window_unrolled: bool = False   # the window's axes unrolled whole: the input tile is a halo tile, staged once for
  #                                 every tap (codegen/halo_tiles.py)
  padding: int = 0   # SHARED's amount: each row of a tile padded (Kernel.tile_row_padding)
  any_thread_split: bool = False   # a side's LOCAL threads take any divisor of an axis that divides the threads left
  #                                  (a 12-pixel row: 3 threads x 4 outputs), not only powers of two
  async_stages: int = 0   # the tiles filled by asynchronous copies (cp.async) in this many stages (SHARED_ASYNC); 0:
  #                         loads into registers (double buffered where they can be)
  reduce_groups: int = 0   # GROUP threads splitting the input channels (each its share of the steps, the partial
  #                          sums combined through local memory at the end): more warps for a small convolution

  @property
  def shared_structure(self) -> SharedStructure:
    """SHARED's choice: the rows' padding and the cp.async stages."""
    return SharedStructure(self.padding, async_stages=self.async_stages)


# largest first: 128 pixels (of 2 images) x 64 channels with 8x8 outputs per thread (4 FMAs per float read from the
# tiles), its window unrolled in steps of 2 channels (the input a halo tile staged once for every tap, the filter
# tile's rows padded: conv2d 64x64x56x56 3x3 f32 0.375 ms on the H100, cuDNN 0.376; steps of 4 0.405, of 8 0.460,
# unpadded 0.464; with halo_tiles' bank padding 0.362-0.367, cuDNN 0.374-0.380), then with the window's loops outside
# the step (0.435 ms); then halo tiles with 4x4 outputs per thread for MNIST's conv2 (bench_conv_kernels.py --only
# mnist, H100, session 7): its input gradient's 2 images x 4 rows x 12 pixels (3 threads a row) x 16 channels, the
# input channels split over 2 GROUP threads (37.9 us; 43.1 ungrouped, 4x4 pixels of 8 images 52.3, before 73.4), its
# forward's 256 pixels (4 images) x 16 channels (17.6-18.8 us; 64 pixels x 32 channels 26.9, before 32.6); then 64 x
# 64 with 4x4 without a halo (0.600 ms), then smaller channel or pixel sides
CONV_TILES = (ConvTile(4, 16, 4, 8, 2, pixel_repeat=2, channel_repeat=2, window_unrolled=True, padding=4),
              ConvTile(4, 16, 4, 8, 8, pixel_repeat=2, channel_repeat=2),
              ConvTile(4, 24, 4, 4, 2, window_unrolled=True, padding=4, any_thread_split=True, reduce_groups=2),
              ConvTile(4, 64, 4, 4, 2, window_unrolled=True, padding=4), ConvTile(4, 16, 4, 16, 8),
              ConvTile(4, 16, 4, 8, 8), ConvTile(4, 32, 4, 4, 8), ConvTile(4, 16, 4, 4, 8))


def shared_conv_tiles(kernel: Kernel, tiles: tuple[ConvTile, ...] = CONV_TILES) -> bool:
  """A float32 convolution (a reduce over input channels and the window of a SUM of input window x filter, every
  output axis along one operand only) as an implicit GEMM: the first of `tiles` that divides the sizes, its output
  tile UPCAST and LOCAL from the innermost axes of each side (pixels innermost: the launch's x), both operands staged
  through local memory (SHARED; the window's loads keep their padding masks) and the first reduce axis (the input
  channels) unrolled by the step. False (the kernel untouched) where no tile fits."""
  sides = _conv_sides(kernel) if not kernel.applied_opts else None
  if sides is None: return False
  pixel_axes, channel_axes = sides
  for tile in tiles:
    trial = kernel.copy()
    pixel_plan = _side_plan(trial, pixel_axes, tile.pixel_upcast, tile.pixel_threads, tile.any_thread_split)
    channel_plan = _side_plan(trial, channel_axes, tile.channel_upcast, tile.channel_threads, tile.any_thread_split)
    if not pixel_plan or not channel_plan: continue
    plan = pixel_plan + channel_plan
    # the UPCASTs, then the pixel side's LOCALs (the first LOCAL applied is the innermost thread axis, the launch's
    # x), then the channel side's
    upcasts = [opt for opt in plan if opt.op is OptOps.UPCAST]
    locals_ = sorted((opt for opt in plan if opt.op is OptOps.LOCAL), key=lambda opt: opt.axis not in pixel_axes)
    repeats = _repeat_plan(trial, plan, pixel_axes, tile)
    if repeats is None: continue
    groups = [Opt(OptOps.GROUP, 0, tile.reduce_groups)] if tile.reduce_groups else []
    if trial.try_output_opts(upcasts + locals_ + repeats) and all(trial.try_opt(opt) for opt in groups) and \
        trial.try_opt(Opt(OptOps.SHARED, 0, 0, tile.shared_structure)) and _unroll_reduce(trial, tile):
      kernel.__dict__.update(trial.__dict__)
      return True
  return False


def _unroll_reduce(kernel: Kernel, tile: ConvTile) -> bool:
  """UNROLL the input channels by the tile's step and, with `window_unrolled`, every reduce loop after them (the
  window) whole, the channel steps staying the one loop; False (the kernel part-way changed: apply on a copy) where
  that does not apply."""
  loops = kernel.first_upcast - kernel.first_loop_reduce
  if not kernel.try_opt(Opt(OptOps.UNROLL, 0, tile.reduce_step)): return False
  if not tile.window_unrolled: return True
  if kernel.first_upcast - kernel.first_loop_reduce != loops: return False   # no channel loop left to stage along
  for _ in range(loops - 1):
    if not kernel.try_opt(Opt(OptOps.UNROLL, 1, kernel.full_shape[kernel.first_loop_reduce + 1])): return False
  return True


def _conv_sides(kernel: Kernel, dtype_in: DType = dtypes.float32,
                dtype_out: DType = dtypes.float32) -> tuple[list[int], list[int]] | None:
  """(pixel axes, channel axes) of a convolution-shaped reduce of `dtype_in` loads into `dtype_out`, or None: both
  MUL operands are loads, the reduce has at least two axes (channels and window), every output axis is along
  exactly one operand, and the side with the output's innermost (stride 1) axis is the pixel side."""
  if kernel.first_reduce < 2 or (kernel.first_reduce < 3 and not kernel.applied_opts): return None
  try: a, b = matmul_operands(kernel.reduceop, dtype_in, dtype_out, "conv tiles")
  except KernelOptError: return None
  m_axes, n_axes, k_axes = kernel.matmul_axes(a, b)
  if len(k_axes) < 2 or len(m_axes) + len(n_axes) != kernel.first_reduce or not m_axes or not n_axes: return None
  output_strides = kernel.sts[0].real_strides()
  innermost = next((axis for axis in reversed(range(kernel.first_reduce)) if output_strides[axis] == 1), None)
  if innermost is None: return None
  return (m_axes, n_axes) if innermost in m_axes else (n_axes, m_axes)


def _side_plan(kernel: Kernel, axes: list[int], upcast: int, threads: int, any_split: bool = False) -> list[Opt]:
  """UPCAST `upcast` on the innermost axis of `axes` it divides, then LOCAL threads from the innermost axes (the
  largest power of two each has left, or with `any_split` the largest divisor of its size that divides the threads
  left) until the side has `threads`; [] where the side cannot take them all."""
  sizes = {axis: kernel.full_shape[axis] for axis in axes}
  upcast_axis = next((axis for axis in reversed(axes) if sizes[axis] % upcast == 0), None)
  if upcast_axis is None: return []
  sizes[upcast_axis] //= upcast
  plan, left = [Opt(OptOps.UPCAST, upcast_axis, upcast)], threads
  for axis in reversed(axes):
    amount = _thread_split(sizes[axis], left) if any_split else power_of_two_divisor(sizes[axis], left)
    if amount >= 2:
      plan.append(Opt(OptOps.LOCAL, axis, amount))
      left //= amount
    if left == 1: return plan
  return []


def _thread_split(size: int, threads: int) -> int:
  """The largest divisor of `size` that divides `threads` (1 if none but 1)."""
  return max(amount for amount in range(1, min(size, threads) + 1) if size % amount == 0 and threads % amount == 0)


@register_plan
@dataclass(frozen=True)
class TensorCoreConvPlan(Plan):
  """A float16/bfloat16 convolution on tensor cores with both tiles staged (TC + SHARED: the reduce loops walked as
  one flat loop of steps): the renderer's tensor core `choice`, then 4 mma tiles along the channels x 2 along the
  pixels per warp, 2 warps along each and, with `batch_warps`, 2 images per block (8 warps: 128 pixels x 64
  channels); the input channels in steps of `k_steps` instructions (2: 32 channels; 1: one)."""
  choice: int
  batch_warps: bool = True
  k_steps: int = 2

  def apply(self, kernel: Kernel) -> bool:
    if not self.apply_outputs(kernel): return False
    if self.k_steps > 1 and not kernel.try_opt(Opt(OptOps.UNROLL, 0, self.k_steps)): return False
    return kernel.try_opt(Opt(OptOps.SHARED, 0, 0, TileStages()))

  def apply_outputs(self, kernel: Kernel) -> bool:
    """TC and the output opts (warp tiles, warps, images per block): the plan before its reduce step and SHARED."""
    tensor_cores = getattr(kernel.renderer, "tensor_cores", ())
    if not 0 <= self.choice < len(tensor_cores): return False
    tc = tensor_cores[self.choice]
    sides = _conv_sides(kernel, tc.dtype_in, tc.dtype_out) if not kernel.applied_opts else None
    if sides is None: return False
    before = kernel.copy()
    if not kernel.try_opt(Opt(OptOps.TC, 0, self.choice)): return False
    # the sides again after TC split them (the instruction's m/n parts are UPCASTs now): the pixels are the side of
    # the operand (A or B) that had them before
    applied = kernel.tensor_core
    pixels_on_a = sides[0] == before.matmul_axes(applied.a, applied.b)[0]
    m_axes, n_axes, _ = kernel.matmul_axes(applied.a, applied.b)
    pixel_axes, channel_axes = (m_axes, n_axes) if pixels_on_a else (n_axes, m_axes)
    if not pixel_axes or not channel_axes: return False
    pixel, channel = pixel_axes[-1], channel_axes[-1]
    batch = next((axis for axis in pixel_axes if axis != pixel), None)
    if self.batch_warps and batch is None: return False
    plan = [Opt(OptOps.UPCAST, channel, 4), Opt(OptOps.UPCAST, pixel, 2), Opt(OptOps.LOCAL, channel, 2),
            Opt(OptOps.LOCAL, pixel, 2)] + ([Opt(OptOps.LOCAL, batch, 2)] if self.batch_warps else [])
    return kernel.try_output_opts(plan)


class TensorCoreConvStrategy(Strategy):
  """The staged tensor-core convolution (TensorCoreConvPlan) with the first tensor core whose dtypes the convolution
  has, 2 images per block where the pixels have a batch axis that takes it, else one; steps of 32 input channels where
  they divide. conv2d 64x64x56x56 3x3 f16 on the H100: 0.134 ms; the unstaged TC kernel 0.407."""
  name = "tensor_core_conv"

  def applies(self, kernel: Kernel) -> bool: return gpu_local_reduce(kernel) and not kernel.applied_opts

  def choose(self, kernel: Kernel) -> tuple[Plan, Kernel] | None:
    for choice, tc in enumerate(getattr(kernel.renderer, "tensor_cores", ())):
      if _conv_sides(kernel, tc.dtype_in, tc.dtype_out) is None: continue
      for batch_warps in (True, False):
        trial = kernel.copy()
        if not TensorCoreConvPlan(choice, batch_warps).apply_outputs(trial): continue
        k_steps = 2 if trial.try_opt(Opt(OptOps.UNROLL, 0, 2)) else 1   # steps of 32 input channels where they divide
        if trial.try_opt(Opt(OptOps.SHARED, 0, 0, TileStages())):
          return TensorCoreConvPlan(choice, batch_warps, k_steps), trial
    return None


# the window's innermost axis (a filter row) is upcast whole up to this size
WINDOW_UPCAST_MAX = 8


@register_plan
@dataclass(frozen=True)
class WeightGradientTile:
  """The threads of a split-K weight gradient's partial-sums kernel. A thread sums a whole filter row (the window's
  innermost axis, UPCAST: one input value serves every tap of the row it falls in) x `cout_upcast` output channels;
  a block's LOCAL threads take up to `cin_threads` input channels (more window axes first, where a power of two
  divides them) and `cout_threads` output channels. `row_group` GROUP threads (a power of two dividing it) split the
  image rows (the reduce's second-innermost axis: neighbouring lanes read neighbouring rows, and the partials meet by
  warp shuffles); `column_group` GROUP threads (a power of two dividing it) split the image columns (the innermost
  reduce axis) too; `column_unroll` unrolls the image columns (0: whole, 1: not at all). Without `row_group`, a block
  of fewer than `small_block` threads GROUPs the columns whole instead of unrolling them.
  `filter_rows_local`: the filter's rows (the window axis outside the filter row) are LOCAL threads whole, so a block
  loads each gradient value once for every row instead of one block per row loading it again."""
  cout_upcast: int = 4
  cin_threads: int = 16
  cout_threads: int = 8
  row_group: int = 0
  column_group: int = 0
  column_unroll: int = 4
  small_block: int = 64
  filter_rows_local: bool = False


# tried in order; the first whose opts apply is taken. H100, the MNIST step's weight gradients at batch 256 (partial
# sums alone, bench_conv_kernels.py --wgrad, run 1 of session 6): conv2 (32 parts of 8 images) 44.7 -> 19.6 us with
# the first (a block: 5 filter rows x 4 cin x 4 cout x 4 image-row lanes, the image row's 8 columns unrolled: 12 input
# values serve 8 x 5 taps; GROUP rows 4 without the filter rows as threads 23.1 us, GROUP rows 8 33.1 us); conv1
# (256 parts of 1 image, 24x24: the first's unrolled row takes too many registers) 20.5 -> 14.6 us with the second (5
# filter rows x 4 cout x 2 image rows x 8 columns; rows 8 and 8 columns unrolled 15.8 us); the last is the tile before
# (filter rows per thread, LOCAL cin 16 x cout 8, columns unrolled by 4, or GROUPed where the block is small)
# Session 7 (bench_conv_kernels.py --wgrad, warm L2; ncu, cold): conv1 takes the second: 2 output channels a thread
# (44 registers) x 5 filter rows x 4 cout threads, 8 GROUP image-row lanes, the columns unrolled by 8 (the 12 input
# values and 2 x 8 gradient values of a step are float4 loads for 80 FMAs, where the third's 5 + 4 scalar loads
# serve 20): 17.3 -> 10.7 us under ncu, 10.6 in the jitted step (runs 2-3); 4 output channels a thread 11.4 us
WEIGHT_GRADIENT_TILES = (
  WeightGradientTile(cin_threads=4, cout_threads=4, row_group=4, column_unroll=0, filter_rows_local=True),
  WeightGradientTile(cout_upcast=2, cout_threads=4, row_group=8, column_unroll=8, filter_rows_local=True),
  WeightGradientTile(cout_threads=4, row_group=2, column_group=8, column_unroll=1, filter_rows_local=True),
  WeightGradientTile(),
)


def weight_gradient_tiles(kernel: Kernel, tiles: tuple[WeightGradientTile, ...] = WEIGHT_GRADIENT_TILES) -> bool:
  """The partial-sums kernel of a split-K convolution weight gradient (outputs: parts, output channels, input
  channels, window; the parts along both operands of the product) with the first of `tiles` that applies. False (the
  kernel untouched) where the kernel is not one or no tile applies."""
  sides = _weight_gradient_sides(kernel) if not kernel.applied_opts else None
  if sides is None: return False
  window_axes, channel, row = sides
  for tile in tiles:
    trial = kernel.copy()
    if _apply_weight_gradient_tile(trial, tile, window_axes, channel, row):
      kernel.__dict__.update(trial.__dict__)
      return True
  return False


def _weight_gradient_sides(kernel: Kernel) -> tuple[list[int], int, int] | None:
  """(window-side axes, the output-channel axis a cout tile of 4 divides, the filter row axis) of a float32 split-K
  weight gradient's partial-sums kernel, or None: a product of two loads with an output axis (the parts) along both,
  the output's innermost axis (stride 1) a filter row of 2..WINDOW_UPCAST_MAX taps."""
  if kernel.reduceop.dtype != dtypes.float32: return None
  try: a, b = matmul_operands(kernel.reduceop, dtypes.float32, dtypes.float32, "weight gradient")
  except KernelOptError: return None
  m_axes, n_axes, _ = kernel.matmul_axes(a, b)
  if not m_axes or not n_axes or len(m_axes) + len(n_axes) == kernel.first_reduce: return None   # no parts axis
  output_strides = kernel.sts[0].real_strides()
  row = kernel.first_reduce - 1
  if output_strides[row] != 1 or not 2 <= kernel.full_shape[row] <= WINDOW_UPCAST_MAX: return None
  window_axes, channel_axes = (m_axes, n_axes) if row in m_axes else (n_axes, m_axes)
  channel = next((axis for axis in reversed(channel_axes) if kernel.full_shape[axis] % 4 == 0), None)
  return None if channel is None else (window_axes, channel, row)


def _apply_weight_gradient_tile(kernel: Kernel, tile: WeightGradientTile, window_axes: list[int], channel: int,
                                row: int) -> bool:
  """Apply `tile` (see WeightGradientTile); False where an opt does not fit (the kernel part-way changed: apply on a
  copy)."""
  sizes = list(kernel.full_shape)
  if sizes[channel] % tile.cout_upcast: return False
  plan = [Opt(OptOps.UPCAST, row, sizes[row]), Opt(OptOps.UPCAST, channel, tile.cout_upcast)]
  sizes[channel] //= tile.cout_upcast
  threads = 1
  filter_rows = row - 1 if tile.filter_rows_local and row - 1 in window_axes else None
  if tile.filter_rows_local and filter_rows is None: return False
  for axis, limit in [(axis, tile.cin_threads) for axis in reversed(window_axes) if axis != row] + \
                     [(channel, tile.cout_threads)]:
    amount = sizes[axis] if axis == filter_rows else power_of_two_divisor(sizes[axis], limit)
    if amount < 2: continue
    plan.append(Opt(OptOps.LOCAL, axis, amount))
    sizes[axis] //= amount
    threads *= amount
  if not kernel.try_output_opts(plan): return False
  loops = kernel.first_upcast - kernel.first_loop_reduce
  columns = loops - 1
  if tile.row_group:
    if loops < 2: return False
    rows = kernel.full_shape[kernel.first_loop_reduce + loops - 2]
    amount = power_of_two_divisor(rows, tile.row_group)
    if amount < 2 or not kernel.try_opt(Opt(OptOps.GROUP, loops - 2, amount)): return False
    columns = kernel.first_upcast - kernel.first_loop_reduce - 1
    if tile.column_group:
      amount = power_of_two_divisor(kernel.full_shape[kernel.first_loop_reduce + columns], tile.column_group)
      if amount < 2 or not kernel.try_opt(Opt(OptOps.GROUP, columns, amount)): return False
    return tile.column_unroll == 1 or kernel.try_opt(Opt(OptOps.UNROLL, columns, tile.column_unroll))
  if threads < tile.small_block: kernel.try_opt(Opt(OptOps.GROUP, columns, 0))
  else: kernel.try_opt(Opt(OptOps.UNROLL, columns, tile.column_unroll))
  return True


def _repeat_plan(kernel: Kernel, plan: list[Opt], pixel_axes: list[int], tile: ConvTile) -> list[Opt] | None:
  """The repeat UPCASTs of `tile` after `plan` (original axes): the channel repeat on the channel side's UPCAST axis,
  the pixel repeat on the outermost pixel axis other than the pixel UPCAST axis; None where a size does not divide."""
  sizes = list(kernel.full_shape)
  for opt in plan: sizes[opt.axis] //= opt.amount
  repeats = []
  if tile.channel_repeat > 1:
    channel_upcast = next(opt.axis for opt in plan if opt.op is OptOps.UPCAST and opt.axis not in pixel_axes)
    if sizes[channel_upcast] % tile.channel_repeat: return None
    repeats.append(Opt(OptOps.UPCAST, channel_upcast, tile.channel_repeat))
  if tile.pixel_repeat > 1:
    pixel_upcast = next(opt.axis for opt in plan if opt.op is OptOps.UPCAST and opt.axis in pixel_axes)
    outer = next((axis for axis in pixel_axes if axis != pixel_upcast), None)
    if outer is None or sizes[outer] % tile.pixel_repeat: return None
    repeats.append(Opt(OptOps.UPCAST, outer, tile.pixel_repeat))
  return repeats


@register_plan
@dataclass(frozen=True)
class ConvTilePlan(Plan):
  """A float32 convolution as an implicit GEMM in one block tile (shared_conv_tiles with `tile` alone)."""
  tile: ConvTile

  def apply(self, kernel: Kernel) -> bool: return shared_conv_tiles(kernel, (self.tile,))


class ConvTileStrategy(Strategy):
  """shared_conv_tiles: the first tile of CONV_TILES that fits the convolution."""
  name = "shared_conv"

  def applies(self, kernel: Kernel) -> bool: return gpu_local_reduce(kernel)

  def choose(self, kernel: Kernel) -> tuple[Plan, Kernel] | None:
    if kernel.applied_opts or _conv_sides(kernel) is None: return None
    for tile in CONV_TILES:
      trial = kernel.copy()
      if shared_conv_tiles(trial, (tile,)): return ConvTilePlan(tile), trial
    return None


@register_plan
@dataclass(frozen=True)
class WeightGradientPlan(Plan):
  """The partial-sums kernel of a split-K convolution weight gradient in one tile (weight_gradient_tiles with `tile`
  alone)."""
  tile: WeightGradientTile

  def apply(self, kernel: Kernel) -> bool: return weight_gradient_tiles(kernel, (self.tile,))


class WeightGradientStrategy(Strategy):
  """weight_gradient_tiles: the first tile of WEIGHT_GRADIENT_TILES that applies."""
  name = "weight_gradient"

  def applies(self, kernel: Kernel) -> bool: return gpu_local_reduce(kernel)

  def choose(self, kernel: Kernel) -> tuple[Plan, Kernel] | None:
    if kernel.applied_opts or _weight_gradient_sides(kernel) is None: return None
    for tile in WEIGHT_GRADIENT_TILES:
      trial = kernel.copy()
      if weight_gradient_tiles(trial, (tile,)): return WeightGradientPlan(tile), trial
    return None
