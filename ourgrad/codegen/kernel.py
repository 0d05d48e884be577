"""Kernel: one kernel AST seen as a loop nest over a single shape, and the optimizations applied to it.

All buffers of the kernel (the output, the loads, the constants) are viewed in one shape, `full_shape`:
the output's view has size 1 on the reduced dimensions. Dimensions are laid out as

    [ global ... | local ... | reduce ... | upcast/unroll ... ]
      0            global_dims  first_reduce  first_upcast      shape_len

Global (and on GPUs, local) dimensions are loops or thread indices over the output; reduce dimensions are
loops inside; the last `upcasted` dimensions are unrolled into registers: "upcast" where the output has them
(several outputs per thread), "unroll" where they are reduced. Opts edit this layout by splitting a dimension
and moving the split part; every Opt is checked and leaves results unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

from ourgrad.helpers import DEBUG, prod
from ourgrad.ops import REDUCE_OPS, LazyOp, Ops, format_ast
from ourgrad.shape.shapetracker import ShapeTracker


class OptOps(Enum):
  UPCAST = auto()   # compute `amount` neighbouring outputs of an axis per thread, in registers
  UNROLL = auto()   # unroll `amount` iterations of a reduce axis
  LOCAL = auto()    # split a global axis into workgroup threads (GPU)
  # Not implemented yet (apply_opt refuses them with KernelOptError); named so searches and fuzzers can ask:
  GROUP = auto()    # split a reduce axis across threads, combining in shared memory (GPU)
  PADTO = auto()    # pad an axis up to a multiple of `amount` so other opts fit


@dataclass(frozen=True)
class Opt:
  op: OptOps
  axis: int
  amount: int

  def __repr__(self) -> str: return f"Opt({self.op.name}, {self.axis}, {self.amount})"


class KernelOptError(Exception):
  """An Opt that does not apply to this kernel."""


# more registers than this per thread spills on every device we target
MAX_UPCAST_LANES = 256


class Kernel:
  """Shape reasoning over all buffers of one AST, and the Opts that reshape its loop nest."""

  def __init__(self, ast: LazyOp, renderer: Any):
    if ast.op is not Ops.STORE: raise AssertionError(f"a kernel AST must be a STORE, not {ast.op}")
    self.ast, self.renderer = ast, renderer
    reduces = [node for node in ast.walk() if node.op in REDUCE_OPS]
    if len(reduces) > 1: raise AssertionError("a kernel holds at most one reduce")
    self.reduceop: LazyOp | None = reduces[0] if reduces else None
    # argument 0 is the output; loads and constants follow in AST order. Each has its view of the loop nest.
    self.leaves: list[LazyOp] = [ast] + ast.leaves()
    self.sts: list[ShapeTracker] = [leaf.arg.st for leaf in self.leaves]
    self.full_shape_at_start = self._full_shape()
    self.upcasted = 0
    self.local_dims = 0
    self.applied_opts: list[Opt] = []
    self._move_reduce_axes_last()
    self._drop_size_one_axes()
    self._merge_axes()

  # ---------------------------------------------------------------- shape bookkeeping

  def _full_shape(self) -> tuple[int, ...]:
    shapes = [st.shape for st in self.sts]
    return tuple(max(sizes) for sizes in zip(*shapes)) if shapes[0] else ()

  @property
  def full_shape(self) -> tuple[int, ...]: return self._full_shape()

  @property
  def output_shape(self) -> tuple[int, ...]: return self.sts[0].shape

  @property
  def shape_len(self) -> int: return len(self.sts[0].shape)

  @property
  def first_upcast(self) -> int: return self.shape_len - self.upcasted

  @property
  def first_reduce(self) -> int:
    """The first dimension (before the upcasts) that the output does not have."""
    for axis in range(self.first_upcast):
      if self.output_shape[axis] != self.full_shape[axis]: return axis
    return self.first_upcast

  @property
  def global_dims(self) -> int: return self.first_reduce - self.local_dims

  def is_reduce_axis(self, axis: int) -> bool:
    return self.output_shape[axis] != self.full_shape[axis]

  @property
  def upcast_axes(self) -> list[int]:
    return [axis for axis in range(self.first_upcast, self.shape_len) if not self.is_reduce_axis(axis)]

  @property
  def unroll_axes(self) -> list[int]:
    return [axis for axis in range(self.first_upcast, self.shape_len) if self.is_reduce_axis(axis)]

  def reshape_and_permute(self, new_shape_fn: Any, axes: list[int] | None) -> None:
    """Apply the same reshape (a function of each view's shape) and permute to every view."""
    new_sts = []
    for st in self.sts:
      if new_shape_fn is not None: st = st.reshape(tuple(new_shape_fn(st.shape)))
      if axes is not None: st = st.permute(tuple(axes))
      new_sts.append(st)
    self.sts = new_sts

  def _move_reduce_axes_last(self) -> None:
    reduce_axes = [axis for axis in range(self.shape_len) if self.is_reduce_axis(axis)]
    keep_axes = [axis for axis in range(self.shape_len) if axis not in reduce_axes]
    if reduce_axes: self.reshape_and_permute(None, keep_axes + reduce_axes)

  def _drop_size_one_axes(self) -> None:
    keep = [axis for axis, size in enumerate(self.full_shape) if size != 1]
    if len(keep) != self.shape_len:
      self.reshape_and_permute(lambda shape: [shape[axis] for axis in keep], None)

  def _merge_axes(self) -> None:
    """Merge neighbouring dimensions of one kind wherever every view walks them as one (fewer loops, simpler
    index math)."""
    axis = self.shape_len - 2
    while axis >= 0:
      if self._can_merge(axis):
        self.reshape_and_permute(lambda shape, a=axis: [*shape[:a], shape[a] * shape[a + 1], *shape[a + 2:]], None)
      axis -= 1

  def _can_merge(self, axis: int) -> bool:
    if self.is_reduce_axis(axis) != self.is_reduce_axis(axis + 1): return False
    for st in self.sts:
      strides = st.real_strides()
      outer, inner = strides[axis], strides[axis + 1]
      if outer is None or inner is None: return False
      if outer != inner * st.shape[axis + 1]: return False
      last = st.views[-1]
      if last.mask is not None and any(last.mask[a] != (0, last.shape[a]) for a in (axis, axis + 1)): return False
    return True

  # ---------------------------------------------------------------- opts

  def shift_to(self, axis: int, amount: int, insert_before: int | None = None) -> None:
    """Split `axis` into (size/amount, amount) and move the `amount` part so it sits just before the dimension
    that was at `insert_before` (default: after the last dimension)."""
    inner = axis + 1  # position of the `amount` part once the axis is split
    target = self.shape_len if insert_before is None else insert_before
    if inner <= target: target += 1  # positions after the split moved right by one
    order = [a for a in range(target) if a != inner] + [inner] + [a for a in range(target, self.shape_len + 1)
                                                                  if a != inner]
    self.reshape_and_permute(
      lambda shape: [*shape[:axis], shape[axis] // amount if shape[axis] != 1 else 1,
                     amount if shape[axis] != 1 else 1, *shape[axis + 1:]],
      order)

  def apply_opt(self, opt: Opt) -> None:
    """Apply one Opt, or raise KernelOptError (leaving the kernel unchanged) if it does not fit."""
    if opt.op is OptOps.UPCAST:
      axis = opt.axis
      if not 0 <= axis < self.first_reduce: raise KernelOptError(f"UPCAST needs an output axis, got {axis}")
    elif opt.op is OptOps.UNROLL:
      axis = self.first_reduce + opt.axis
      if not self.first_reduce <= axis < self.first_upcast:
        raise KernelOptError(f"UNROLL needs a reduce axis, got {opt.axis}")
    elif opt.op is OptOps.LOCAL:
      axis = opt.axis
      if not self.renderer.has_threads: raise KernelOptError("LOCAL needs a device with thread groups")
      if not 0 <= axis < self.global_dims: raise KernelOptError(f"LOCAL needs a global axis, got {axis}")
    else:
      raise KernelOptError(f"{opt.op.name} is not supported on {self.renderer.device}")
    size = self.full_shape[axis]
    amount = opt.amount if opt.amount != 0 else size
    if amount <= 1 or size % amount != 0: raise KernelOptError(f"{amount} does not divide axis {axis} of size {size}")
    if opt.op is OptOps.LOCAL:
      if self.local_threads() * amount > self.renderer.max_threads: raise KernelOptError("too many threads")
      # a new local axis goes in front of the existing ones: thread blocks are picked innermost axis first, and
      # the innermost local axis becomes the launch's x dimension (consecutive threads, coalesced memory)
      self.shift_to(axis, amount, insert_before=self.global_dims)
      self.local_dims += 1
    else:
      if self.upcast_lanes() * amount > MAX_UPCAST_LANES: raise KernelOptError("too many registers")
      self.shift_to(axis, amount)
      self.upcasted += 1
    self.applied_opts.append(opt)
    self._drop_finished_axis(axis)

  def local_threads(self) -> int:
    return prod(self.full_shape[self.global_dims:self.first_reduce])

  def _drop_finished_axis(self, axis: int) -> None:
    """An axis split entirely into an upcast or local leaves a size-1 axis behind: remove it."""
    if self.full_shape[axis] == 1:
      if axis < self.global_dims + self.local_dims and axis >= self.global_dims: self.local_dims -= 1
      keep = [a for a in range(self.shape_len) if a != axis]
      self.reshape_and_permute(lambda shape: [shape[a] for a in keep], None)

  def upcast_lanes(self) -> int:
    return prod(self.full_shape[self.first_upcast:])

  def hand_coded_optimizations(self) -> None:
    """A good default: register-tile matmul-like reduces (upcast the output axes that some input broadcasts,
    so each loaded value is reused from registers) and unroll the reduce a little; on GPUs, then group the
    innermost output axes into thread blocks."""
    self._register_tiling()
    if self.renderer.has_threads: self._pick_thread_blocks()

  def _pick_thread_blocks(self) -> None:
    """Give each block up to `threads_per_block` threads from the innermost global axes (the ones whose
    neighbouring elements are adjacent in memory, so a block's loads coalesce)."""
    budget = 128
    for axis in reversed(range(self.global_dims)):
      for amount in (128, 64, 32, 16, 8, 4, 2):
        if self.local_threads() * amount <= budget and self.full_shape[axis] % amount == 0:
          if self._try(Opt(OptOps.LOCAL, axis, amount)): break
      if self.local_threads() >= budget: break

  def _register_tiling(self) -> None:
    if self.reduceop is None:
      # elementwise: unroll 4 neighbouring outputs so the C compiler sees straight-line vectorizable code. Not on
      # GPUs: there neighbouring threads must touch neighbouring addresses for loads to coalesce.
      if self.renderer.has_threads: return
      last = self.first_reduce - 1
      if last >= 0 and self.full_shape[last] % 4 == 0 and self.full_shape[last] >= 16:
        self._try(Opt(OptOps.UPCAST, last, 4))
      return
    upcast_done: set[int] = set()
    for _ in range(2):
      for axis in reversed(range(self.first_reduce)):
        if axis in upcast_done: continue
        broadcast_by_some_input = any(st.real_strides()[axis] == 0 for st in self.sts[1:])
        if broadcast_by_some_input and self.full_shape[axis] % 4 == 0 and self.full_shape[axis] >= 8:
          if self._try(Opt(OptOps.UPCAST, axis, 4)):
            upcast_done.add(axis)
            break
    if self.first_upcast > self.first_reduce:
      last_reduce = self.first_upcast - 1 - self.first_reduce
      size = self.full_shape[self.first_upcast - 1]
      for amount in (4, 2):
        if size % amount == 0 and self._try(Opt(OptOps.UNROLL, last_reduce, amount)): break

  def _try(self, opt: Opt) -> bool:
    try:
      self.apply_opt(opt)
      return True
    except KernelOptError:
      return False

  # ---------------------------------------------------------------- naming and debugging

  @property
  def name(self) -> str:
    """E_ for elementwise, r_ for reduce kernels, then the loop sizes (upcast sizes at the end)."""
    prefix = "r" if self.reduceop is not None else "E"
    sizes = "_".join(str(size) for size in self.full_shape) or "1"
    return f"{prefix}_{sizes}"

  def colored_shape(self) -> str:
    from ourgrad.helpers import colored
    kinds = []
    for axis, size in enumerate(self.full_shape):
      if axis < self.global_dims: color = "blue"
      elif axis < self.first_reduce: color = "cyan"
      elif axis < self.first_upcast: color = "red"
      else: color = "magenta" if self.is_reduce_axis(axis) else "yellow"
      kinds.append(colored(str(size), color))
    return " ".join(kinds)

  def print_debug(self) -> None:
    if DEBUG >= 3:
      print(format_ast(self.ast))
      print(f"{self.name}: {self.colored_shape()} opts={self.applied_opts}")

