"""Small-window reduces on GPUs: many outputs, each reducing a few neighbouring inputs of one window (a max-pool's or
an average pool's 2x2 or 3x3 window, the tie count of a max-pool's backward), often behind a fused elementwise
producer (batchnorm's normalize and a ReLU before the pool).

Such a kernel is bound by memory: it reads each input once and does a few operations per element. What makes it
fast is that a warp's loads land on neighbouring addresses and that the GPU has enough threads in flight. The
generic loop-nest default (heuristic._register_tiling, then _pick_thread_blocks) gets neither: it upcasts the output
axes that some input broadcasts (the spatial axes, which the per-channel batchnorm values broadcast) and then takes
thread blocks from the innermost axes whose sizes are powers of two, which in MNIST's pools are the batch and the
channels: threadIdx.x walked the channels, so a warp's loads were 576 floats apart (H100, the first pool forward
and backward: 21-23% of copy bandwidth, 288 blocks of 128 threads).

`window_plan(kernel)` (the heuristic's "window" strategy, a ThreadWalkStrategy) instead:
- unrolls the window (every reduce axis, whole): no loop, the window's loads all in flight at once;
- puts a block's threads along the output axis the output is contiguous on, then the next axes outward while the
  output stays contiguous over them, each taken whole while it fits (WINDOW_BLOCK_THREADS): a warp then stores 32
  consecutive outputs and loads the consecutive input rows of their windows (MNIST's first pool: 12 x 12 outputs of
  an image's channel per block);
- leaves one output per thread: on the H100, 2 or 4 outputs of the batch per thread (WINDOW_OUTER_UPCAST, off), blocks
  of 256 threads, 2 neighbouring columns per thread or float2 loads of the window's column pair were no faster
  (extra/bench/bench_window.py; docs/codegen.md has the table: the first pool 17.9 -> 5.6 us forward, 19.6 -> 6.5 us
  for the backward's tie count, 71-72% of copy bandwidth).

`elementwise_rows_plan(kernel)` (its "elementwise_rows" strategy) gives the elementwise kernels around a pool (its
backward over rows of 24) the same thread walk with float4 columns. Both plans are a ThreadWalkPlan.
"""
from __future__ import annotations

from dataclasses import dataclass

from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.codegen.opt.plans import Plan, Strategy, gpu_elementwise, gpu_reduce, register_plan
from ourgrad.helpers import power_of_two_divisor, prod
from ourgrad.ops import MemBuffer

WARP_LANES = 32   # threads of a warp: rows with a power-of-two part this long already coalesce
# a window of at most this many elements is unrolled whole in each thread (a 5x5 pool: 25)
WINDOW_MAX_ELEMENTS = 32
# fewer outputs than this leave the kernel to the plain reduce defaults (GROUP threads per output)
WINDOW_MIN_OUTPUTS = 8192
# threads per block: output axes are taken whole up to twice this, a partial axis only up to this
WINDOW_BLOCK_THREADS = 128
# outputs of an outer axis per thread (0: one output per thread, the measured default), applied only where every
# multiprocessor keeps WINDOW_THREADS_PER_PROCESSOR threads after it (enough in flight to hide DRAM latency)
WINDOW_OUTER_UPCAST = 0
WINDOW_THREADS_PER_PROCESSOR = 1024


def is_window_reduce(kernel: Kernel) -> bool:
  """Whether the kernel is a small-window reduce this module tiles: a GPU kernel with one reduce, no opts yet, a
  window of at most WINDOW_MAX_ELEMENTS, at least WINDOW_MIN_OUTPUTS outputs, an output contiguous along some output
  axis, and every input that varies along the window varying along every output axis too (a window that slides with
  the output; an input broadcast along an output axis while it varies along the reduce is a matmul or convolution
  operand: register tiles pay off there, not here) with its window inside the span of the outputs (a column sum of a
  few rows, the second stage of a split reduce, strides the reduce across the outputs' whole extent: the column
  defaults of heuristic._group_reduce fit it)."""
  renderer = kernel.renderer
  if not renderer.has_threads or kernel.reduceop is None or len(kernel.reduceops) != 1 or kernel.applied_opts:
    return False
  first_reduce, shape = kernel.first_reduce, kernel.full_shape
  if prod(shape[first_reduce:]) > WINDOW_MAX_ELEMENTS or prod(shape[:first_reduce]) < WINDOW_MIN_OUTPUTS: return False
  if _contiguous_output_axis(kernel) is None: return False
  windowed = 0
  for st, leaf in zip(kernel.sts[1:], kernel.leaves[1:]):
    if not isinstance(leaf.arg, MemBuffer): continue
    strides = st.real_strides()
    if all(strides[axis] == 0 for axis in range(first_reduce, kernel.shape_len)): continue   # per output: fine
    if any(strides[axis] == 0 and shape[axis] > 1 for axis in range(first_reduce)): return False
    if not _window_inside_outputs(strides, first_reduce): return False
    windowed += 1
  return windowed > 0


def _window_inside_outputs(strides: tuple, first_reduce: int) -> bool:
  """Whether an input's steps along the window (the reduce axes) are shorter than its largest step along the
  outputs: a pool's window lies inside one image's plane, while a column reduction's reduce steps over every output."""
  output_steps = [abs(stride) for stride in strides[:first_reduce] if isinstance(stride, int)]
  window_steps = [abs(stride) for stride in strides[first_reduce:] if isinstance(stride, int)]
  return bool(output_steps) and all(step < max(output_steps) for step in window_steps)


def _contiguous_output_axis(kernel: Kernel) -> int | None:
  """The output axis (global, not yet split into threads or upcast) along which the single, unmasked output walks
  its smallest step: stride 1, or the length of an upcast along it (an elementwise kernel's float4 columns); None
  where the output has no such axis."""
  if len(kernel.stores) != 1: return None
  st = kernel.sts[0]
  if len(st.views) != 1 or st.views[0].mask is not None: return None
  strides = st.real_strides()
  steps = [(strides[axis], axis) for axis in range(kernel.global_dims)
           if isinstance(strides[axis], int) and strides[axis] > 0 and kernel.full_shape[axis] > 1]
  if not steps: return None
  step, axis = min(steps, key=lambda pair: (pair[0], -pair[1]))
  lanes = prod(kernel.full_shape[upcast] for upcast in kernel.upcast_axes if strides[upcast] != 0)
  return axis if step in (1, lanes) else None


def thread_axes(kernel: Kernel) -> list[tuple[int, int]]:
  """(output axis, threads) pairs for a window reduce's block, innermost first: from the output's contiguous axis
  outward while the output's strides nest (the next axis out starts where this one ends), each axis whole while the
  block stays within 2 x WINDOW_BLOCK_THREADS (and the renderer's limit), until the block has WINDOW_BLOCK_THREADS;
  an axis that does not fit whole gives part of itself (_partial_threads) and ends the walk (the axes beyond it are
  no longer contiguous with the block)."""
  contiguous = _contiguous_output_axis(kernel)
  if contiguous is None: return []
  limit = min(2 * WINDOW_BLOCK_THREADS, kernel.renderer.max_threads)
  strides, shape = kernel.sts[0].real_strides(), kernel.full_shape
  plan: list[tuple[int, int]] = []
  threads, axis = 1, contiguous
  while axis >= 0 and threads < WINDOW_BLOCK_THREADS:
    size = shape[axis]
    if size > 1 and threads * size <= limit:
      plan.append((axis, size))
      threads *= size
    elif size > 1:
      amount = _partial_threads(size, threads, limit)
      if amount >= 2: plan.append((axis, amount))
      break
    # the next axis out continues the block's outputs only where the output's strides nest
    if axis > 0 and strides[axis - 1] != strides[axis] * size and size > 1: break
    axis -= 1
  return plan


def _partial_threads(size: int, threads: int, limit: int) -> int:
  """Threads from an axis of `size` that does not fit the block whole, beside `threads` already taken: the smallest
  divisor (a power of two where one fits) that brings the block to WINDOW_BLOCK_THREADS, else the largest within
  `limit`; 1 where none."""
  fitting = [amount for amount in range(2, limit // threads + 1) if size % amount == 0]
  powers = [amount for amount in fitting if amount & (amount - 1) == 0]
  for candidates in (powers, fitting):
    reaching = [amount for amount in candidates if threads * amount >= WINDOW_BLOCK_THREADS]
    if reaching: return reaching[0]
  return max(powers or fitting, default=1)


@register_plan
@dataclass(frozen=True)
class ThreadWalkPlan(Plan):
  """A block's threads walking the output from its contiguous axis outward (window_tiles, elementwise_rows): `unrolled`
  reduce axes unrolled whole first (a window; 0: none), `lanes` an UPCAST (axis, amount) of neighbouring outputs per
  thread (elementwise rows; (): none), `threads` the LOCAL (axis, threads) pairs innermost first, numbered as the
  kernel was before the first (Kernel.try_output_opts), and `outer` an UPCAST (axis, amount) of an outer axis after
  them ((): none)."""
  unrolled: int = 0
  lanes: tuple[int, ...] = ()
  threads: tuple[tuple[int, int], ...] = ()
  outer: tuple[int, ...] = ()

  def apply(self, kernel: Kernel) -> bool:
    before = [Opt(OptOps.UNROLL, 0, 0)] * self.unrolled + ([Opt(OptOps.UPCAST, *self.lanes)] if self.lanes else [])
    if not all(kernel.try_opt(opt) for opt in before): return False
    if not kernel.try_output_opts([Opt(OptOps.LOCAL, axis, amount) for axis, amount in self.threads]): return False
    return not self.outer or kernel.try_opt(Opt(OptOps.UPCAST, *self.outer))


class ThreadWalkStrategy(Strategy):
  """The thread walk of this module (ThreadWalkPlan) for a small-window reduce (`window`: window_plan) or for an
  elementwise kernel over short rows (elementwise_rows_plan): one strategy, two places in the heuristic's order."""

  def __init__(self, window: bool):
    self.window, self.name = window, "window" if window else "elementwise_rows"

  def applies(self, kernel: Kernel) -> bool: return gpu_reduce(kernel) if self.window else gpu_elementwise(kernel)

  def choose(self, kernel: Kernel) -> tuple[Plan, Kernel] | None:
    return window_plan(kernel) if self.window else elementwise_rows_plan(kernel)


def window_plan(kernel: Kernel) -> tuple[ThreadWalkPlan, Kernel] | None:
  """The small-window plan (module docstring) and its kernel where `is_window_reduce` and the opts apply; None
  (the kernel untouched) otherwise."""
  if not is_window_reduce(kernel): return None
  trial = kernel.copy()
  # the window unrolled whole, innermost reduce axis last (the fastest lanes walk neighbouring elements)
  unrolled = 0
  while trial.first_upcast > trial.first_loop_reduce:
    if not trial.try_opt(Opt(OptOps.UNROLL, 0, 0)): return None
    unrolled += 1
  threads = thread_axes(trial)
  if not threads: return None
  # LOCAL axes numbered as the kernel was before the first (try_output_opts); applied innermost first, the first
  # becoming the launch's x
  if not trial.try_output_opts([Opt(OptOps.LOCAL, axis, amount) for axis, amount in threads]): return None
  return ThreadWalkPlan(unrolled, (), tuple(threads), _outer_upcast(trial)), trial


def window_tiles(kernel: Kernel) -> bool:
  """Apply the small-window defaults (window_plan) in place; False (the kernel untouched) where they do not apply."""
  chosen = window_plan(kernel)
  if chosen is not None: kernel.__dict__.update(chosen[1].__dict__)
  return chosen is not None


def _outer_upcast(kernel: Kernel) -> tuple[int, ...]:
  """UPCAST the outermost global axis that WINDOW_OUTER_UPCAST divides, where every multiprocessor still keeps
  WINDOW_THREADS_PER_PROCESSOR threads after it (a thread then computes outputs a whole image or channel apart: each
  of its loads stays coalesced across the warp). The (axis, amount) applied; () where none."""
  amount = WINDOW_OUTER_UPCAST
  processors = getattr(kernel.renderer, "multiprocessors", 0)
  if amount < 2 or processors <= 0: return ()
  threads = prod(kernel.full_shape[:kernel.first_reduce])
  if threads // amount < processors * WINDOW_THREADS_PER_PROCESSOR: return ()
  for axis in range(kernel.global_dims):
    if kernel.full_shape[axis] % amount == 0 and kernel.try_opt(Opt(OptOps.UPCAST, axis, amount)): return axis, amount
  return ()


# ---------------------------------------------------------------- the elementwise kernels around a pool

def elementwise_rows_plan(kernel: Kernel) -> tuple[ThreadWalkPlan, Kernel] | None:
  """A GPU elementwise kernel whose output rows have a power-of-two part shorter than a warp (a pool's backward over
  24 x 24 images: 8). The plain default (heuristic._elementwise_rows) takes float4 columns only from rows of 128
  floats and otherwise gives each thread 4 outputs of an outer axis with blocks from power-of-two parts of the
  inner axes, so a warp read 8 columns x 4 rows, 32 bytes each. Here each thread takes `vector_width` outputs, and
  the block's threads walk the output's columns, then its rows and planes (thread_axes), so a warp's accesses are
  one contiguous run:
  - neighbouring columns (float4 loads and a float4 store) where the rows are whole vectors. A buffer also read
    through a view that is not a vector (the pool's backward reads its input as the ReLU's input and through the
    pool's window) takes those elements from the vector where the index is the same (the UOp builder's load
    reuse, codegen/uops.py); H100, MNIST's pool backward over 24 x 24 images: 11.4 us instead of 12.6 with 4 images
    per thread (bench_window.py, run 1, before that reuse);
  - else outputs of an outer axis (an image apart: each scalar load stays coalesced across the warp).
  None (the kernel untouched) where it does not apply."""
  renderer, width = kernel.renderer, getattr(kernel.renderer, "vector_width", 0)
  if not renderer.has_threads or kernel.reduceop is not None or kernel.applied_opts or width < 2: return None
  if prod(kernel.full_shape) < WINDOW_MIN_OUTPUTS: return None
  columns = _contiguous_output_axis(kernel)
  if columns is None or kernel.sts[0].real_strides()[columns] != 1: return None
  size = kernel.full_shape[columns]
  # rows whose power-of-two part is a warp or more keep the plain default: its blocks already give each warp 32
  # neighbouring columns (transformer rows of 64, rows of 128 and more as float4 columns)
  if power_of_two_divisor(size, WARP_LANES) >= WARP_LANES: return None
  lanes_axis = columns if size % width == 0 else _outer_axis(kernel, columns, width)
  if lanes_axis is None: return None
  trial = kernel.copy()
  if not trial.try_opt(Opt(OptOps.UPCAST, lanes_axis, width)): return None
  threads = thread_axes(trial)
  if prod(amount for _, amount in threads) < WINDOW_BLOCK_THREADS // 2: return None
  if not trial.try_output_opts([Opt(OptOps.LOCAL, axis, amount) for axis, amount in threads]): return None
  return ThreadWalkPlan(0, (lanes_axis, width), tuple(threads)), trial


def elementwise_rows(kernel: Kernel) -> bool:
  """Apply elementwise_rows_plan in place; False (the kernel untouched) where it does not apply."""
  chosen = elementwise_rows_plan(kernel)
  if chosen is not None: kernel.__dict__.update(chosen[1].__dict__)
  return chosen is not None


def _outer_axis(kernel: Kernel, columns: int, amount: int) -> int | None:
  """The outermost output axis other than `columns` that `amount` divides, where it leaves at least 4 (an image or a
  plane apart: the thread walk starts at the columns)."""
  return next((axis for axis in range(kernel.global_dims) if axis != columns and
               kernel.full_shape[axis] % amount == 0 and kernel.full_shape[axis] >= 4 * amount), None)
