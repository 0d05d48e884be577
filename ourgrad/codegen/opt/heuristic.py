"""Hand-coded optimizations: a good default Opt list for a Kernel, without search.

CPUs (no thread blocks): register-tile matmul-like reduces (upcast the output axes some input broadcasts, so each
loaded value is reused from registers), unroll the reduce a little, and unroll 4 neighbouring elementwise outputs
so the C compiler sees straight-line vectorizable code.

GPUs (thread blocks and local memory):
- a reduce whose input is contiguous along the reduce (a row reduction: sum, max, softmax, layernorm) gets a block
  per output with the reduce split across its threads by GROUP (neighbouring threads read neighbouring elements);
  a short row gets a warp;
- a reduce whose input is contiguous along an output axis (a column reduction) puts that output axis on LOCAL
  threads (coalesced) and, when that leaves too few blocks to fill the device, splits the reduce over GROUPTOP;
- matmul-like reduces get register tiles, then thread blocks from the innermost output axes;
- elementwise kernels get thread blocks from the innermost output axes.
"""
from __future__ import annotations

from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.helpers import prod
from ourgrad.ops import MemBuffer

# threads per block the heuristics aim for on GPUs
BLOCK_THREADS = 256
# a GPU needs about this many blocks in flight to keep every multiprocessor busy (H100: 132 SMs x several blocks)
ENOUGH_BLOCKS = 1024
WARP_SIZE = 32


def hand_coded_optimizations(kernel: Kernel) -> None:
  """Apply the default Opts for the kernel's device in place."""
  renderer = kernel.renderer
  if renderer.has_threads and getattr(renderer, "has_local", False) and kernel.reduceop is not None:
    if _group_reduce(kernel): return
  _register_tiling(kernel)
  if renderer.has_threads: _pick_thread_blocks(kernel)


def _contiguous_axis(kernel: Kernel) -> int | None:
  """The dimension along which the biggest input is contiguous (stride 1), if any."""
  loads = [st for st, leaf in zip(kernel.sts[1:], kernel.leaves[1:]) if isinstance(leaf.arg, MemBuffer)]
  if not loads: return None
  st = max(loads, key=lambda view: prod(size for size, stride in zip(view.shape, view.real_strides()) if stride != 0))
  strides = st.real_strides()
  for axis in reversed(range(kernel.shape_len)):
    if strides[axis] == 1 and kernel.full_shape[axis] > 1: return axis
  return None


def _divisor_at_most(size: int, limit: int) -> int:
  """The largest power of two dividing `size` that is at most `limit` (1 if none)."""
  amount = 1
  while amount * 2 <= limit and size % (amount * 2) == 0: amount *= 2
  return amount


def _group_reduce(kernel: Kernel) -> bool:
  """GROUP-based defaults for reduces that are not matmul-like. False (kernel untouched) where they do not apply."""
  loads = [st for st, leaf in zip(kernel.sts[1:], kernel.leaves[1:]) if isinstance(leaf.arg, MemBuffer)]
  if any(st.real_strides()[axis] == 0 for st in loads for axis in range(kernel.first_reduce)):
    return False  # some input is broadcast along an output axis: matmul-like, register tiling fits better
  if kernel.first_upcast <= kernel.first_reduce: return False
  contiguous = _contiguous_axis(kernel)
  outputs = prod(kernel.full_shape[:kernel.first_reduce])
  last_reduce = kernel.first_upcast - 1
  reduce_size = kernel.full_shape[last_reduce]
  if contiguous is not None and contiguous >= kernel.first_reduce:
    # row reduction: the block's threads stride over the row together (coalesced)
    threads = _divisor_at_most(reduce_size, BLOCK_THREADS if reduce_size >= 4 * BLOCK_THREADS else WARP_SIZE)
    if threads < 2: return False
    return kernel.try_opt(Opt(OptOps.GROUP, last_reduce - kernel.first_reduce, threads))
  if contiguous is not None and contiguous < kernel.first_reduce:
    # column reduction: neighbouring threads take neighbouring outputs; split the reduce when blocks are few
    locals_ = _divisor_at_most(kernel.full_shape[contiguous], WARP_SIZE)
    if locals_ < 2 or not kernel.try_opt(Opt(OptOps.LOCAL, contiguous, locals_)): return False
    blocks = outputs // locals_
    first_reduce_size = kernel.full_shape[kernel.first_reduce]
    if blocks < ENOUGH_BLOCKS:
      group = _divisor_at_most(first_reduce_size, BLOCK_THREADS // locals_)
      if group >= 2: kernel.try_opt(Opt(OptOps.GROUPTOP, 0, group))
    return True
  return False


def _pick_thread_blocks(kernel: Kernel) -> None:
  """Give each block up to 128 threads from the innermost global axes (the ones whose neighbouring elements are
  adjacent in memory, so a block's loads coalesce)."""
  budget = 128
  for axis in reversed(range(kernel.global_dims)):
    for amount in (128, 64, 32, 16, 8, 4, 2):
      if kernel.local_threads() * amount <= budget and kernel.full_shape[axis] % amount == 0:
        if kernel.try_opt(Opt(OptOps.LOCAL, axis, amount)): break
    if kernel.local_threads() >= budget: break


def _register_tiling(kernel: Kernel) -> None:
  if kernel.reduceop is None:
    # elementwise: unroll 4 neighbouring outputs so the C compiler sees straight-line vectorizable code. Not on
    # GPUs: there neighbouring threads must touch neighbouring addresses for loads to coalesce.
    if kernel.renderer.has_threads: return
    last = kernel.first_reduce - 1
    if last >= 0 and kernel.full_shape[last] % 4 == 0 and kernel.full_shape[last] >= 16:
      kernel.try_opt(Opt(OptOps.UPCAST, last, 4))
    return
  upcast_done: set[int] = set()
  for _ in range(2):
    for axis in reversed(range(kernel.first_reduce)):
      if axis in upcast_done: continue
      broadcast_by_some_input = any(st.real_strides()[axis] == 0 for st in kernel.sts[1:])
      if broadcast_by_some_input and kernel.full_shape[axis] % 4 == 0 and kernel.full_shape[axis] >= 8:
        if kernel.try_opt(Opt(OptOps.UPCAST, axis, 4)):
          upcast_done.add(axis)
          break
  if kernel.first_upcast > kernel.first_reduce:
    last_reduce = kernel.first_upcast - 1 - kernel.first_reduce
    size = kernel.full_shape[kernel.first_upcast - 1]
    for amount in (4, 2):
      if size % amount == 0 and kernel.try_opt(Opt(OptOps.UNROLL, last_reduce, amount)): break
