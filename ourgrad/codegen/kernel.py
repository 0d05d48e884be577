"""Kernel: one kernel AST seen as a loop nest over a single shape, and the optimizations applied to it.

All buffers of the kernel (the output, the loads, the constants) are viewed in one shape, `full_shape`:
the output's view has size 1 on the reduced dimensions. Dimensions are laid out as

    [ global ... | local ... | group ... | reduce ... | upcast/unroll ... ]
      0            global_dims  first_reduce             first_upcast      shape_len
                                       first_reduce + group_dims

and `axis_types` names each dimension's kind (`AxisType`, from codegen/uops.py):
- GLOBAL: over outputs; a loop on CPUs, the block index on GPUs;
- LOCAL: over outputs; a thread index inside a block (GPU, opt LOCAL);
- GROUP: over the reduce; a thread index inside a block (GPU, opt GROUP/GROUPTOP): each thread reduces its slice,
  the partials meet in local memory (or warp shuffles) and are combined by a tree, one thread stores;
- REDUCE: over the reduce; a loop in each thread;
- UPCAST / UNROLL: the last `upcasted` dimensions, unrolled into registers: "upcast" where the output has them
  (several outputs per thread), "unroll" where they are reduced.
Opts edit this layout by splitting a dimension and moving the split part; every Opt is checked and leaves results
unchanged.

The API a search uses (codegen/opt/search.py): `Kernel.copy()` (an independent copy to try opts on),
`apply_opt(opt)` (applies or raises KernelOptError, leaving the kernel unchanged) and `legal_opts()` (every Opt that
applies to the kernel as it is now). `hand_coded_optimizations()` applies the default heuristic
(codegen/opt/heuristic.py). The Opt vocabulary itself (OptOps, Opt, describe_opt, KernelOptError) lives in
codegen/opts.py; it is imported from here too.
"""
from __future__ import annotations

import operator
from typing import Any

from ourgrad.codegen.opts import (TC_TILE_PADDING, TC_TILE_STAGES, WGMMA_DEEP, WGMMA_DEFAULT_N,  # noqa: F401
                                 WGMMA_DEFAULT_STAGES, WGMMA_SPECIALIZED, KernelOptError, Opt, OptOps, TileStages,
                                 describe_opt, describe_opts, shared_choice)
from ourgrad.codegen.shared_tiles import (SHARED_ASYNC, SHARED_ASYNC_MAX_STAGES, SHARED_REDUCE_INNER,  # noqa: F401
                                         SHARED_ROW_SKEW, SHARED_TILE_PADDING, SHARED_TWO_BLOCKS, SHARED_VECTOR_FILL,
                                         SKEW_ROWS, SharedStructure, SharedTileLayout, decode_shared_amount)
from ourgrad.codegen.matmul_operands import (is_plain_load, matmul_operands, operand_leaves,  # noqa: F401
                                            varying_axes)
from ourgrad.codegen.streamed_rows import streamed_row_axes
from ourgrad.codegen.tensor_core_layout import AppliedTensorCore, TileLayout, tensor_core_operands, tensor_core_tiles
from ourgrad.codegen.tensor_cores import WARP_LANES
from ourgrad.codegen.wgmma_tiles import WgmmaMatmul, WgmmaTile, plan_for_kernel
from ourgrad.codegen.uops import AxisType
from ourgrad.helpers import DEBUG, colored, prod
from ourgrad.ops import REDUCE_OPS, LazyOp, Ops, format_ast
from ourgrad.shape.shapetracker import ShapeTracker
from ourgrad.shape.symbolic import sym_max


# more registers than this per thread spills on every device we target
MAX_UPCAST_LANES = 256
# the amounts `legal_opts` tries for each axis (0 means the whole axis)
OPT_AMOUNTS = (0, 2, 3, 4, 8, 16, 32, 64, 128, 256)

# terminal colors of the axis kinds in kernel names (DEBUG=2)
AXIS_COLORS = {AxisType.GLOBAL: "blue", AxisType.LOCAL: "cyan", AxisType.GROUP: "green", AxisType.REDUCE: "red",
               AxisType.UPCAST: "yellow", AxisType.UNROLL: "magenta"}


def _kernel_stores(ast: LazyOp) -> list[LazyOp]:
  """The STOREs of a kernel AST (one, or several under a SINK), checked to share one output view."""
  if ast.op not in (Ops.STORE, Ops.SINK): raise AssertionError(f"a kernel AST must be a STORE or SINK, not {ast.op}")
  stores = ast.stores()
  if any(store.op is not Ops.STORE for store in stores): raise AssertionError("a SINK holds only STOREs")
  if len({store.arg.st for store in stores}) != 1: raise AssertionError("the outputs of a kernel share one view")
  if [store.arg.idx for store in stores] != list(range(len(stores))): raise AssertionError("outputs are data0..")
  return stores


def _sibling_reduces(ast: LazyOp, reduces: list[LazyOp]) -> bool:
  """Whether the kernel is several sibling reduces: a SINK whose outputs each hold at least one reduce (stored as it
  is or through elementwise work on several), none inside another (the scheduler groups reduces of one loop shape and
  axes that read a common input, engine/multi_output.py; a row kernel's reduces are one STORE). One loop computes
  them side by side, an accumulator each, so the shared input is loaded once; a reduce several outputs read is one
  node, computed once."""
  if ast.op is not Ops.SINK or len(reduces) < 2: return False
  if any(not any(node.op in REDUCE_OPS for node in store.walk()) for store in ast.srcs): return False
  if any(node.op in REDUCE_OPS for reduce in reduces for node in reduce.srcs[0].walk()): return False
  return len({(reduce.arg, reduce.op, reduce.dtype) for reduce in reduces}) == 1


def _row_kernel_axes(reduces: list[LazyOp], store_st: ShapeTracker, has_finals: bool) -> tuple[int, ...] | None:
  """The reduced axes of a row kernel, else None. A row kernel holds several reduces over the same axes of one loop
  shape, or one reduce whose result is read back per element (softmax's `x - x.max()`) or by final reduces: one
  thread owns a row and runs each reduce's loop over it in turn, then the store (per element, or once per row) or
  the final reduces' step."""
  if not reduces: return None
  axes = reduces[0].arg
  if any(reduce.arg != axes for reduce in reduces): raise AssertionError("a row kernel's reduces share their axes")
  per_element = any(store_st.shape[axis] != 1 for axis in axes)
  return tuple(axes) if len(reduces) > 1 or per_element or has_finals else None


def _final_reduces(reduces: list[LazyOp], rank: int) -> list[LazyOp]:
  """The reduces over every axis in a kernel whose other reduces reduce fewer (the rows): a row kernel's final
  reduces. Kernels of one reduce, of sibling reduces or of a row kernel's reduces share one set of axes: none."""
  if len({reduce.arg for reduce in reduces}) < 2: return []
  return [reduce for reduce in reduces if len(reduce.arg) == rank]


def _element_reduces(reduces: list[LazyOp]) -> list[LazyOp]:
  """The reduces inside another reduce's input over none of its axes: a row kernel's element reduces, read per
  element of its rows (engine/kernel_walk.py element_reduce_refusal; lowered by codegen/element_reduces.py)."""
  inner: list[LazyOp] = []
  for reduce in reduces:
    for node in reduce.srcs[0].walk():
      if node.op in REDUCE_OPS and not set(node.arg) & set(reduce.arg) and not any(node is known for known in inner):
        inner.append(node)
  return inner


class Kernel(SharedTileLayout):
  """Shape reasoning over all buffers of one AST, and the Opts that reshape its loop nest."""

  # the heuristic may make a streamed reduce a CPU row kernel (codegen/streamed_rows.py); not a kernel whose loop nest
  # another plan extends (a split reduce's last block)
  may_stream_rows = True

  def __init__(self, ast: LazyOp, renderer: Any):
    self.ast, self.renderer = ast, renderer
    self.stores: list[LazyOp] = _kernel_stores(ast)
    # every reduce, sources first (a reduce inside another's input comes before it)
    self.reduceops: list[LazyOp] = [node for node in ast.walk() if node.op in REDUCE_OPS]
    self.reduceop: LazyOp | None = self.reduceops[0] if self.reduceops else None
    # the outputs come first (arguments 0 .. len(stores)-1, all in one view of the loop nest); loads and constants
    # follow in AST order. Each has its view of the loop nest.
    self.leaves: list[LazyOp] = self.stores + ast.leaves()
    self.sts: list[ShapeTracker] = [leaf.arg.st for leaf in self.leaves]
    self.full_shape_at_start = self._full_shape()
    self.upcasted = 0
    self.local_dims = 0
    self.group_dims = 0
    # GROUPTOP's threads are the outer thread dimensions (neighbouring threads take neighbouring outputs, so a column
    # reduction coalesces); GROUP's the innermost (neighbouring threads take neighbouring reduce elements)
    self.groups_outer = False
    self.applied_opts: list[Opt] = []
    # the plan of the strategy that chose the opts (codegen/opt/plans.py), where one did: printed, saved by BEAM
    self.plan: Any = None
    # after OptOps.TC: the instruction and its A and B operands (the LOADs under the reduce's MUL); the last three
    # dimensions are then the instruction's m, n, k (see _apply_tensor_core)
    self.tensor_core: AppliedTensorCore | None = None
    self.shared_tiles = False   # OptOps.SHARED (see staged_loads)
    self.tile_stages = TC_TILE_STAGES   # with TC: the SHARED tiles' stages (OptOps.SHARED's amount, 0: the default)
    # after OptOps.WGMMA: the kernel's plan (codegen/wgmma_tiles.py) and its A, B, C argument positions; the loop
    # nest is then not linearized (engine/realize.py renders the plan)
    self.wgmma: tuple[WgmmaMatmul, dict[str, int]] | None = None
    self.tile_padding = 0   # without TC: SHARED's amount below SHARED_VECTOR_FILL (see tile_row_padding)
    self.tile_flags = 0   # without TC: SHARED's amount from SHARED_VECTOR_FILL up (see the SHARED_* flags)
    # sibling reduces (one per output, same axes, op and dtype) share the loop nest, an accumulator each
    self.sibling_reduces = _sibling_reduces(ast, self.reduceops)
    # a row kernel's final reduces: of its per-row results down to one value, over every axis (the scheduler's
    # kernel_walk.final_reduces); its other reduces run over the rows
    self.final_reduces: list[LazyOp] = _final_reduces(self.reduceops, len(self.stores[0].arg.st.shape))
    # a row kernel's element reduces: over trailing axes of their own (`element_axes`), read per element of its rows
    self.element_reduces: list[LazyOp] = [] if self.final_reduces or len(self.reduceops) < 2 else \
        _element_reduces(self.reduceops)
    self.element_axes: tuple[int, ...] = tuple(sorted({axis for reduce in self.element_reduces for axis in reduce.arg}))
    self.row_axes: tuple[int, ...] | None = None if self.sibling_reduces else \
      _row_kernel_axes([reduce for reduce in self.reduceops if reduce not in self.final_reduces
                        and not any(reduce is inner for inner in self.element_reduces)],
                       self.stores[0].arg.st, bool(self.final_reduces or self.element_reduces))
    if self.row_axes is not None: return   # a row kernel loops in its reduces' input shape as it is
    self._move_reduce_axes_last()
    self._drop_size_one_axes()
    self._merge_axes()

  def copy(self) -> Kernel:
    """An independent copy (same AST and renderer) on which opts can be tried without touching this one."""
    new = Kernel.__new__(Kernel)
    new.__dict__.update(self.__dict__)
    new.sts, new.applied_opts = list(self.sts), list(self.applied_opts)
    return new

  # ---------------------------------------------------------------- shape bookkeeping

  def _full_shape(self) -> tuple[int, ...]:
    # memoized on the views themselves (ShapeTrackers are frozen; every Opt puts new ones in self.sts): lowering a
    # large kernel asks for it ~80,000 times, and recomputing it was 60% of linearize (BEAM's compile cost)
    cached = self.__dict__.get("_full_shape_memo")
    # map(is_): the identity test in C (a generator here was a third of this function's time)
    if cached is not None and len(cached[0]) == len(self.sts) and all(map(operator.is_, cached[0], self.sts)):
      return cached[1]
    shapes = [st.shape for st in self.sts]
    # key=sym_max: a symbolic size (a Node) compares by its largest value; `>` on a Node builds a node, not a bool
    full_shape = tuple(max(sizes, key=sym_max) for sizes in zip(*shapes)) if shapes[0] else ()
    self._full_shape_memo = (tuple(self.sts), full_shape)
    return full_shape

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
    output_shape, full_shape = self.output_shape, self.full_shape   # once, not per axis: asked ~30 times a kernel
    for axis in range(self.first_upcast):
      if output_shape[axis] != full_shape[axis]: return axis
    return self.first_upcast

  @property
  def global_dims(self) -> int: return self.first_reduce - self.local_dims

  @property
  def first_loop_reduce(self) -> int:
    """The first reduce dimension that is a loop (after the group dimensions)."""
    return self.first_reduce + self.group_dims

  @property
  def axis_types(self) -> list[AxisType]:
    """The kind of each dimension of `full_shape` (see the module docstring)."""
    return self._axis_types(self.first_reduce)

  def _axis_types(self, first_reduce: int) -> list[AxisType]:
    kinds = []
    for axis in range(self.shape_len):
      if axis < first_reduce - self.local_dims: kinds.append(AxisType.GLOBAL)
      elif axis < first_reduce: kinds.append(AxisType.LOCAL)
      elif axis < first_reduce + self.group_dims: kinds.append(AxisType.GROUP)
      elif axis < self.first_upcast: kinds.append(AxisType.REDUCE)
      else: kinds.append(AxisType.UNROLL if self.is_reduce_axis(axis) else AxisType.UPCAST)
    return kinds

  def axes_of(self, kind: AxisType) -> list[int]:
    return [axis for axis, axis_kind in enumerate(self.axis_types) if axis_kind is kind]

  def is_reduce_axis(self, axis: int) -> bool:
    return self.output_shape[axis] != self.full_shape[axis]

  @property
  def upcast_axes(self) -> list[int]: return self.axes_of(AxisType.UPCAST)

  @property
  def unroll_axes(self) -> list[int]: return self.axes_of(AxisType.UNROLL)

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

  def shift_to(self, axis: int, amount: int, insert_before: int | None = None, top: bool = False) -> None:
    """Split `axis` into (size/amount, amount) — or (amount, size/amount) when `top` — and move the `amount` part
    so it sits just before the dimension that was at `insert_before` (default: after the last dimension)."""
    moved = axis if top else axis + 1  # position of the `amount` part once the axis is split
    target = self.shape_len if insert_before is None else insert_before
    if axis < target: target += 1  # positions after the split moved right by one
    order = [a for a in range(target) if a != moved] + [moved] + [a for a in range(target, self.shape_len + 1)
                                                                  if a != moved]

    def split(shape: tuple[int, ...]) -> list[int]:
      if shape[axis] == 1: return [*shape[:axis], 1, 1, *shape[axis + 1:]]  # a view reduced away on this axis
      parts = [amount, shape[axis] // amount] if top else [shape[axis] // amount, amount]
      return [*shape[:axis], *parts, *shape[axis + 1:]]
    self.reshape_and_permute(split, order)

  def _state(self) -> tuple:
    return (list(self.sts), self.upcasted, self.local_dims, self.group_dims, self.groups_outer, list(self.applied_opts),
            self.tensor_core, self.shared_tiles, self.tile_stages, self.wgmma, self.tile_padding,
            self.tile_flags)

  def _restore(self, state: tuple) -> None:
    (self.sts, self.upcasted, self.local_dims, self.group_dims, self.groups_outer, self.applied_opts,
     self.tensor_core, self.shared_tiles, self.tile_stages, self.wgmma, self.tile_padding,
     self.tile_flags) = state

  def apply_opt(self, opt: Opt) -> None:
    """Apply one Opt, or raise KernelOptError (leaving the kernel unchanged) if it does not fit."""
    if self.row_axes is not None: raise KernelOptError("a row kernel (several reduces) takes no opts yet")
    state = self._state()
    try:
      self._apply(opt)
      self._check_limits()
    except KernelOptError:
      self._restore(state)
      raise
    self.applied_opts.append(opt)

  def _axis_of(self, opt: Opt) -> int:
    """The dimension an Opt splits, checking it has the kind the Opt needs."""
    renderer = self.renderer
    if self.wgmma is not None: raise KernelOptError(f"{opt.op.name} after WGMMA (its kernel takes no other opt)")
    if opt.op in (OptOps.WGMMA, OptOps.TC, OptOps.SHARED) and self.sibling_reduces:
      raise KernelOptError(f"{opt.op.name} tiles one matmul-like reduce, the kernel has {len(self.reduceops)}")
    if opt.op is OptOps.WGMMA: return 0
    if opt.op is OptOps.TC:
      if opt.axis != 0: raise KernelOptError(f"TC takes axis 0 (it finds the matmul's axes), got {opt.axis}")
      return 0
    if self.tensor_core is not None and opt.op in (OptOps.GROUP, OptOps.GROUPTOP):
      raise KernelOptError(f"{opt.op.name} does not combine with tensor cores (a warp owns each tile's reduce)")
    if opt.op is OptOps.SHARED:
      # with tensor cores the tiles' stages (TileStages); without, their structure (SharedStructure: the rows' padding,
      # float4 fills, two blocks, cp.async stages, skewed rows, reduce-inner rows); see opts.shared_choice
      choice = shared_choice(opt, self.tensor_core is not None)
      if self.tensor_core is not None and (opt.axis != 0 or not isinstance(choice, TileStages) or
                                           choice.stages not in (2, 3, 4)):
        raise KernelOptError(f"SHARED with TC takes axis 0 and 2, 3 or 4 stages, got {opt}")
      paddings = (0, SHARED_TILE_PADDING)
      if self.tensor_core is None and (opt.axis != 0 or not isinstance(choice, SharedStructure) or
                                       choice.padding not in paddings or
                                       choice.async_stages > SHARED_ASYNC_MAX_STAGES or choice.unknown):
        raise KernelOptError(f"SHARED takes axis 0 and a SharedStructure: a padding in {paddings}, "
                             f"cp.async stages up to {SHARED_ASYNC_MAX_STAGES}, got {opt}")
      return 0
    if self.shared_tiles and (opt.op is OptOps.GROUPTOP or (opt.op is OptOps.GROUP and self.tensor_core is not None)):
      raise KernelOptError(f"{opt.op.name} does not combine with SHARED (GROUP does, without TC)")
    if opt.op is OptOps.UPCAST:
      if not 0 <= opt.axis < self.first_reduce: raise KernelOptError(f"UPCAST needs an output axis, got {opt.axis}")
      return opt.axis
    if opt.op in (OptOps.UNROLL, OptOps.GROUP, OptOps.GROUPTOP):
      axis = self.first_loop_reduce + opt.axis
      if not (opt.axis >= 0 and axis < self.first_upcast):
        raise KernelOptError(f"{opt.op.name} needs a reduce loop axis, got {opt.axis}")
      if opt.op is not OptOps.UNROLL and not getattr(renderer, "has_local", False):
        raise KernelOptError(f"{opt.op.name} needs a device with local memory, {renderer.device} has none")
      return axis
    if opt.op is OptOps.PADTO:
      if not 0 <= opt.axis < self.first_upcast or self.is_reduce_axis(opt.axis):
        # a padded reduce would add whatever the reduce's input is at the padding (exp(0) = 1), not 0
        raise KernelOptError(f"PADTO needs a global or local output axis, got {opt.axis}")
      return opt.axis
    if opt.op is OptOps.BLOCK:
      if renderer.has_threads: raise KernelOptError(f"BLOCK is a CPU loop order, not for {renderer.device}")
      if not 0 <= opt.axis < self.global_dims: raise KernelOptError(f"BLOCK needs a global axis, got {opt.axis}")
      return opt.axis
    if opt.op is OptOps.LOCAL:
      if not renderer.has_threads:
        raise KernelOptError(f"LOCAL needs a device with thread blocks, not {renderer.device}")
      if not 0 <= opt.axis < self.global_dims: raise KernelOptError(f"LOCAL needs a global axis, got {opt.axis}")
      return opt.axis
    raise KernelOptError(f"{opt.op.name} is not supported on {renderer.device}")

  def _apply(self, opt: Opt) -> None:
    axis = self._axis_of(opt)
    size = self.full_shape[axis]
    if opt.op is OptOps.PADTO:
      self._pad_to(axis, size, opt.amount)
      return
    if opt.op is OptOps.TC:
      self._apply_tensor_core(opt.amount)
      return
    if opt.op is OptOps.WGMMA:
      self._apply_wgmma(opt)
      return
    if opt.op is OptOps.SHARED:
      choice = shared_choice(opt, self.tensor_core is not None)
      if isinstance(choice, SharedStructure):
        # the structure's flags packed as the tile code reads them (shared_tiles.py SHARED_*)
        self.tile_padding, self.tile_flags = choice.padding, choice.amount - choice.padding
      self._apply_shared_tiles(choice.stages if isinstance(choice, TileStages) else TC_TILE_STAGES)
      return
    amount = opt.amount if opt.amount != 0 else size
    if amount <= 1 or size % amount != 0:
      raise KernelOptError(f"{opt.op.name}: {amount} does not divide axis {axis} of size {size}")
    if opt.op is OptOps.LOCAL:
      # a new local axis goes in front of the existing ones: thread blocks are picked innermost axis first, and
      # the innermost local axis becomes the launch's x dimension (consecutive threads, coalesced memory)
      self.shift_to(axis, amount, insert_before=self.global_dims)
      self.local_dims += 1
    elif opt.op is OptOps.BLOCK:
      self._apply_cache_block(axis, amount)
    elif opt.op in (OptOps.GROUP, OptOps.GROUPTOP):
      top = opt.op is OptOps.GROUPTOP
      if self.group_dims and top != self.groups_outer: raise KernelOptError("GROUP and GROUPTOP do not mix")
      self.groups_outer = top
      self.shift_to(axis, amount, insert_before=self.first_loop_reduce, top=opt.op is OptOps.GROUPTOP)
      self.group_dims += 1
    else:
      # with tensor cores the instruction's m, n, k stay the last three dimensions: new upcasts go before them
      self.shift_to(axis, amount, insert_before=self.shape_len - 3 if self.tensor_core is not None else None)
      self.upcasted += 1
    self._drop_finished_axes(split_reduce=opt.op in (OptOps.UNROLL, OptOps.GROUP, OptOps.GROUPTOP))

  def _pad_to(self, axis: int, size: int, amount: int) -> None:
    """Pad every view of `axis` up to a multiple of `amount` (masked: loads give 0, stores beyond `size` are
    skipped). Refused where nothing changes or where more than half the padded axis would be padding."""
    if amount < 2: raise KernelOptError(f"PADTO needs a multiple of at least 2, got {amount}")
    padded = -(-size // amount) * amount
    if padded == size: raise KernelOptError(f"PADTO: axis {axis} of size {size} is already a multiple "
                                                          f"of {amount}")
    if padded > 2 * size: raise KernelOptError(f"PADTO: padding axis {axis} from {size} to {padded} wastes over half")
    padding = tuple((0, padded - size) if number == axis else (0, 0) for number in range(self.shape_len))
    self.sts = [self._pad_view(st, axis, padded, padding) for st in self.sts]

  def _pad_view(self, st: ShapeTracker, axis: int, padded: int, padding: tuple[tuple[int, int], ...]) -> ShapeTracker:
    """One view padded along `axis`. On the CPU a view that broadcasts along it (stride 0, unmasked there) is
    broadcast further instead: its address never depends on the axis, so its loads stay in bounds without a mask
    (what they read at the padding only reaches outputs that are not stored). A matmul's other operand then stays
    unmasked vector loads (the AVX2 register tile pads its rows, _cpu_matmul_tiles). GPUs keep the mask: their
    operand staging reads the padding from the masks (codegen/matmul_operands.py)."""
    last = st.views[-1]
    broadcast = last.strides[axis] == 0 and (last.mask is None or last.mask[axis] == (0, last.shape[axis]))
    if self.renderer.has_threads or not broadcast: return st.pad(padding)
    window = tuple((0, 1) if number == axis else (0, size) for number, size in enumerate(st.shape))
    return st.shrink(window).expand(tuple(padded if number == axis else size for number, size in enumerate(st.shape)))
  def _apply_wgmma(self, opt: Opt) -> None:
    """WGMMA: the whole kernel becomes one wgmma matmul plan (codegen/wgmma_tiles.py), if the renderer has wgmma and
    the kernel is a plain matmul that fits it (see wgmma_tiles.plan_for_kernel)."""
    if not getattr(self.renderer, "has_wgmma", False):
      raise KernelOptError(f"WGMMA: {self.renderer.device} has no warpgroup MMA (CUDA sm_90)")
    if self.applied_opts: raise KernelOptError(f"WGMMA is the only opt of its kernel, after {self.applied_opts}")
    tile = opt.arg
    if tile is None:   # the older form: N tile, stages and kind in the amount and axis
      tile = WgmmaTile(opt.amount or WGMMA_DEFAULT_N, opt.axis % WGMMA_SPECIALIZED or WGMMA_DEFAULT_STAGES,
                       specialized=bool(opt.axis & WGMMA_SPECIALIZED), deep=bool(opt.axis & WGMMA_DEEP))
    if not isinstance(tile, WgmmaTile): raise KernelOptError(f"WGMMA takes a WgmmaTile as its arg, got {tile!r}")
    try:
      self.wgmma = plan_for_kernel(self, tile)
    except ValueError as error:
      raise KernelOptError(f"WGMMA: {error}") from None

  def _apply_tensor_core(self, choice: int) -> None:
    """TC: split the matmul's output axes M (A varies, B does not) and N (the other way round) and its reduce axis K
    (both vary) into (size/m, m), (size/n, n), (size/k, k) and move the m, n, k parts to the end, where the
    linearizer maps them onto a warp's fragments (codegen/tensor_cores.py). Only as the first opt (after PADTO)."""
    tensor_cores = getattr(self.renderer, "tensor_cores", ())
    if not tensor_cores: raise KernelOptError(f"TC: {self.renderer.device} declares no tensor cores")
    if not 0 <= choice < len(tensor_cores):
      raise KernelOptError(f"TC {choice}: {self.renderer.device} has tensor cores 0..{len(tensor_cores) - 1}")
    if any(opt.op is not OptOps.PADTO for opt in self.applied_opts):
      raise KernelOptError(f"TC must come first (PADTO aside), after {self.applied_opts}")
    tc = tensor_cores[choice]
    if not tc.allowed():
      raise KernelOptError(f"TC {tc}: float32 matmuls use TF32 tensor cores only where the user allows it "
                           f"(ourgrad.set_float32_matmul_precision('high') or TF32=1)")
    a, b = tensor_core_operands(self.reduceop, tc)
    m_axes, n_axes, k_axes = self.matmul_axes(a, b)
    if not (m_axes and n_axes and k_axes):
      raise KernelOptError(f"TC: no M/N/K axes in {self.full_shape} (M {m_axes}, N {n_axes}, K {k_axes})")
    axes = tuple(self.tile_axis(candidates, tile) for candidates, tile in zip((m_axes, n_axes, k_axes), tc.dims))
    for axis, tile, name in zip(axes, tc.dims, "MNK"):
      if self.full_shape[axis] % tile != 0:
        raise KernelOptError(f"TC {tc}: {name} axis {axis} of size {self.full_shape[axis]} in {self.full_shape} is "
                             f"not a multiple of {tile} (PADTO an output axis first)")
    for axis, tile in zip(axes, tc.dims): self.shift_to(axis, tile)   # each split keeps the other axes' positions
    self.upcasted += 3
    self.tensor_core = AppliedTensorCore(tc, a, b)
    self._drop_finished_axes()

  def tile_axis(self, candidates: list[int], tile: int) -> int:
    """Of the M (N, K) candidates, the innermost whose size is a multiple of the tile, else the innermost (a
    convolution's K: the input channels rather than the 3-wide filter column)."""
    return next((axis for axis in reversed(candidates) if self.full_shape[axis] % tile == 0), candidates[-1])

  def matmul_axes(self, a: LazyOp, b: LazyOp) -> tuple[list[int], list[int], list[int]]:
    """(M, N, K) candidates before the upcasts: output axes only `a` varies along, output axes only `b` varies
    along, reduce axes both vary along."""
    a_varies, b_varies = self.operand_varies(a), self.operand_varies(b)
    outputs, reduces = range(self.first_reduce), range(self.first_loop_reduce, self.first_upcast)
    m_axes = [axis for axis in outputs if a_varies[axis] and not b_varies[axis]]
    n_axes = [axis for axis in outputs if b_varies[axis] and not a_varies[axis]]
    k_axes = [axis for axis in reduces if a_varies[axis] and b_varies[axis]]
    return m_axes, n_axes, k_axes

  def _apply_shared_tiles(self, stages: int) -> None:
    """SHARED: a flag the linearizer reads (Linearizer._stage_shared_tiles); the tiles follow the final shape."""
    if not getattr(self.renderer, "has_local", False):
      raise KernelOptError(f"SHARED needs a device with local memory, {self.renderer.device} has none")
    if self.shared_tiles: raise KernelOptError("SHARED is already applied")
    # GROUP threads split the reduce (split-K inside the block): each stages its slice of every step's tiles
    if self.group_dims and (self.groups_outer or self.tensor_core is not None):
      raise KernelOptError("SHARED combines with GROUP (without TC), not with GROUPTOP")
    self.shared_tiles, self.tile_stages = True, stages
    if self.tensor_core is not None:
      self.tensor_core_tiles()   # raises where an operand's tile does not fit ldmatrix
      return
    if not self.staged_loads():
      raise KernelOptError(f"SHARED: no load of {self.name} is shared by the block's threads along a reduce")

  def tensor_core_tiles(self) -> tuple[TileLayout, TileLayout]:
    """With TC and SHARED: the local-memory layouts of the A and B tiles (codegen/tensor_core_layout.py)."""
    return tensor_core_tiles(self)

  def operand_varies(self, operand: LazyOp) -> tuple[bool, ...]:
    """Per loop axis: whether a matmul operand (a load or an expression of loads) varies along it: the element one
    of its leaves reads, or (outside the axes PADTO padded) whether it is valid (codegen/matmul_operands.py)."""
    _, output_valid_varies = varying_axes(self.sts[0])   # the axes PADTO padded: ignored (see the module)
    varies = [False] * self.shape_len
    for leaf in operand_leaves(operand):
      index_varies, valid_varies = varying_axes(self.sts[self.leaf_number(leaf)])
      for axis in range(self.shape_len):
        varies[axis] |= index_varies[axis] or (valid_varies[axis] and not output_valid_varies[axis])
    return tuple(varies)

  def leaf_number(self, leaf: LazyOp) -> int:
    """The position of a leaf (by identity: equal loads of one buffer may be different leaves) in `leaves`."""
    return next(number for number, candidate in enumerate(self.leaves) if candidate is leaf)

  def _apply_cache_block(self, axis: int, amount: int) -> None:
    """BLOCK: the outer part (size/amount) of a global axis becomes loop 0. Only a reorder when the axis is already
    outermost and whole (amount == size): refused there, it would change nothing."""
    size = self.full_shape[axis]
    if amount == size or axis == 0: raise KernelOptError(f"BLOCK {amount} of axis {axis} leaves the loop order as is")
    self.shift_to(axis, size // amount, insert_before=0, top=True)

  def _check_limits(self) -> None:
    """Registers, threads per block and local memory per block within what the device allows."""
    if self.upcast_lanes() > MAX_UPCAST_LANES:
      raise KernelOptError(f"{self.upcast_lanes()} upcast lanes is more than {MAX_UPCAST_LANES} registers")
    if self.block_threads() > self.renderer.max_threads:
      raise KernelOptError(f"{self.block_threads()} threads per block is more than {self.renderer.device}'s "
                           f"{self.renderer.max_threads}")
    if self.shared_tiles and self.tensor_core is not None: self.tensor_core_tiles()   # still fits after this opt
    local_bytes = self.local_memory_bytes()
    limit = getattr(self.renderer, "local_memory_bytes", 0)
    # staged tensor-core tiles may use dynamic shared memory beyond the static limit (CUDA)
    if self.shared_tiles and (self.tensor_core is not None or self.async_tile_stages):
      limit = getattr(self.renderer, "dynamic_local_memory_bytes", limit)
    if local_bytes > limit and (self.group_dims or self.shared_tiles):
      raise KernelOptError(f"{local_bytes} bytes of local memory per block is more than {self.renderer.device}'s "
                           f"{limit}")

  def local_threads(self) -> int:
    """Threads per block along the LOCAL axes (outputs)."""
    return prod(self.full_shape[self.global_dims:self.first_reduce])

  def group_threads(self) -> int:
    """Threads per block along the GROUP axes (each output's reduce split across them)."""
    return prod(self.full_shape[self.first_reduce:self.first_loop_reduce])

  def block_threads(self) -> int:
    return self.local_threads() * self.group_threads() * (WARP_LANES if self.tensor_core is not None else 1)

  def thread_axes(self) -> list[int]:
    """The LOCAL and GROUP dimensions in thread-id order, outermost first (the last one is the launch's x)."""
    local_axes = list(range(self.global_dims, self.first_reduce))
    group_axes = list(range(self.first_reduce, self.first_loop_reduce))
    return group_axes + local_axes if self.groups_outer else local_axes + group_axes

  def output_lanes(self) -> int:
    return prod(self.full_shape[axis] for axis in self.upcast_axes)

  def local_memory_bytes(self) -> int:
    """The block's local memory: the SHARED tiles and the GROUP partials (group_partial_bytes)."""
    if self.shared_tiles and self.tensor_core is not None:
      return sum(tile.stage_size * tile.stages * self.tensor_core.tc.dtype_in.itemsize
                 for tile in self.tensor_core_tiles())
    tiles = self.staged_tile_bytes() * max(self.async_tile_stages, 1) if self.shared_tiles else 0
    return tiles + self.group_partial_bytes()

  def group_partial_bytes(self) -> int:
    """Local memory the GROUP partials take, as the linearizer allocates it: after the warp shuffle
    (group_shuffle) combines `width` threads of a group, one partial per output lane, reduce, output thread and
    what is left of the group; none where the shuffle leaves one partial per output."""
    if not self.group_dims or self.reduceop is None: return 0
    width, _ = self.group_shuffle()
    slots = self.group_threads() // width
    if slots == 1: return 0
    return len(self.reduceops) * self.output_lanes() * self.local_threads() * slots * self.reduceop.dtype.itemsize

  def group_shuffle(self) -> tuple[int, int]:
    """(width, stride): a warp shuffle combines `width` of each output's GROUP threads, their thread ids `stride`
    apart (width 1: no shuffle); the linearizer's choice, read here for local memory. Group threads are consecutive
    ids when the GROUP axes are the innermost thread axes (stride 1), and `local threads` apart when they are the
    outer ones (GROUPTOP); with powers of two, xor partners then stay in the same output's group, inside one warp.
    The block must fill whole warps (or be one partial warp). A group of consecutive ids that is a multiple of the
    warp (not a power of two) shuffles whole warps."""
    warp_size, group_count = getattr(self.renderer, "warp_size", 0), self.group_threads()
    stride = self.local_threads() if self.groups_outer else 1
    block_threads = self.block_threads()
    if warp_size < 2 or stride & (stride - 1): return 1, 1
    if group_count & (group_count - 1):
      # not a power of two, but whole warps of consecutive ids (192 threads over an image row: 6 warps): each warp
      # is inside one output's group, so it shuffles; the tree then combines one partial per warp
      return (warp_size, 1) if stride == 1 and group_count % warp_size == 0 else (1, 1)
    if block_threads % warp_size != 0 and block_threads > warp_size: return 1, 1
    return max(min(group_count, warp_size // stride), 1), stride

  def _drop_finished_axes(self, split_reduce: bool = False) -> None:
    """An axis split entirely into an upcast, local or group leaves a size-1 axis behind: remove it (and count
    the kinds again). `split_reduce`: the split axis was a reduce loop (UNROLL, GROUP): its size-1 remainder is a
    reduce axis although the output has it too, and where it was the first one, the reduce starts there (else the
    last LOCAL axis would be counted a GLOBAL one)."""
    first_reduce = self.first_reduce
    if split_reduce:
      remainders = [axis for axis in range(self.first_upcast) if self.full_shape[axis] == 1]
      first_reduce = min([first_reduce, *remainders])
    kinds = self._axis_types(first_reduce)
    keep = [axis for axis, size in enumerate(self.full_shape) if size != 1]
    if len(keep) == self.shape_len: return
    self.reshape_and_permute(lambda shape: [shape[axis] for axis in keep], None)
    kept = [kinds[axis] for axis in keep]
    self.local_dims = kept.count(AxisType.LOCAL)
    self.group_dims = kept.count(AxisType.GROUP)
    self.upcasted = kept.count(AxisType.UPCAST) + kept.count(AxisType.UNROLL)

  def upcast_lanes(self) -> int:
    """Registers per thread the upcast and unroll axes take; a tensor-core tile counts its A, B and C fragments, and
    a SHARED kernel its outputs and one reduce step's operand values (they are read from the tiles as used)."""
    if self.tensor_core is None and self.shared_tiles:
      upcasts = self.upcast_axes
      operands = sum(prod(self.full_shape[axis] for axis in upcasts if self.sts[leaf].real_strides()[axis] != 0)
                     for leaf, _ in self.staged_loads())
      return prod(self.full_shape[axis] for axis in upcasts) + operands
    if self.tensor_core is None: return prod(self.full_shape[self.first_upcast:])
    tc, sizes = self.tensor_core.tc, self.full_shape
    applied = self.tensor_core
    tiles = [axis for axis in self.upcast_axes if axis < self.shape_len - 3]
    a_varies = self.operand_varies(applied.a)
    # the accumulators of every tile, and the fragments of one K step (A per M tile, B per N tile)
    m_tiles = prod(sizes[axis] for axis in tiles if a_varies[axis])
    n_tiles = prod(sizes[axis] for axis in tiles if not a_varies[axis])
    return prod(sizes[axis] for axis in tiles) * tc.c_elements + m_tiles * tc.a_elements + n_tiles * tc.b_elements

  def legal_opts(self) -> list[Opt]:
    """Every Opt (over OPT_AMOUNTS) that applies to this kernel as it is now, each checked on a copy."""
    candidates: list[Opt] = []
    reduce_loops = self.first_upcast - self.first_loop_reduce
    for op in OptOps:
      if op is OptOps.TC:
        candidates += [Opt(op, 0, choice) for choice in range(len(getattr(self.renderer, "tensor_cores", ())))]
        continue
      if op is OptOps.SHARED:
        # with TC its stages; without, plain and padded rows and the 128x128 float32 tile's structure
        # (shared_tile_plans.py LARGE_TILE_STRUCTURE: padded and skewed rows, float4 fills, two blocks per
        # multiprocessor)
        structured = SharedStructure(SHARED_TILE_PADDING, vector_fill=True, two_blocks=True, row_skew=True)
        choices = [TileStages(2), TileStages(4), TileStages(3)] if self.tensor_core is not None else \
          [SharedStructure(), SharedStructure(SHARED_TILE_PADDING), structured]
        candidates += [Opt(op, 0, 0, choice) for choice in choices]
        continue
      axis_count = reduce_loops if op in (OptOps.UNROLL, OptOps.GROUP, OptOps.GROUPTOP) else self.first_reduce
      candidates += [Opt(op, axis, amount) for axis in range(axis_count) for amount in OPT_AMOUNTS]
    legal, seen_shapes = [], set()
    for opt in candidates:
      trial = self.copy()
      try: trial.apply_opt(opt)
      except KernelOptError: continue
      # amount 0 and the axis size give the same kernel: keep one
      layout = (opt.op, opt.axis, trial.full_shape)
      if layout in seen_shapes: continue
      seen_shapes.add(layout)
      legal.append(opt)
    return legal

  def hand_coded_optimizations(self) -> None:
    """Apply the default heuristic for this device (codegen/opt/heuristic.py)."""
    from ourgrad.codegen.opt.heuristic import hand_coded_optimizations  # the heuristic module builds on Kernel
    if self.row_axes is not None: return
    self.row_axes = streamed_row_axes(self)   # a matrix-vector product's sum in SIMD lanes on a CPU
    if self.row_axes is None: hand_coded_optimizations(self)

  def try_opt(self, opt: Opt) -> bool:
    """Apply `opt` if it fits; True when it did."""
    try:
      self.apply_opt(opt)
      return True
    except KernelOptError:
      return False

  def try_output_opts(self, opts: list[Opt]) -> bool:
    """Apply output-axis opts (LOCAL, UPCAST) whose axes number the kernel's axes as they were before the first one,
    in order: an opt that uses its axis up drops it, and the axes after it move down by one. False where one does not
    fit (the kernel then holds the opts before it: apply on a copy)."""
    current = list(range(self.first_reduce))
    for opt in opts:
      axis, before = current[opt.axis], self.shape_len
      if not self.try_opt(Opt(opt.op, axis, opt.amount)): return False
      if self.shape_len == before: current = [a - 1 if a > axis else a for a in current]
    return True

  # ---------------------------------------------------------------- naming and debugging

  @property
  def name(self) -> str:
    """E_ for elementwise, r_ for reduce kernels, then the loop sizes in layout order (upcast sizes at the end)."""
    prefix = "r" if self.reduceop is not None else "E"
    sizes = "_".join(str(size) for size in self.full_shape) or "1"
    if self.wgmma is not None:
      plan = self.wgmma[0]
      sizes += f"_wgmma{plan.block_m}x{plan.block_n}{'_ws' if plan.specialized else ''}{'_deep' if plan.deep else ''}"
      sizes += (f"_c{plan.ctas_per_sm}" if plan.ctas_per_sm > 1 else "") + ("_p" if plan.persistent_ctas else "")
    return f"{prefix}_{sizes}"

  def colored_shape(self) -> str:
    """The loop sizes, each colored by its axis kind (blue global, cyan local, green group, red reduce, yellow
    upcast, magenta unroll)."""
    return " ".join(colored(str(size), AXIS_COLORS[kind]) for size, kind in zip(self.full_shape, self.axis_types))

  def print_debug(self) -> None:
    if DEBUG >= 3:
      print(format_ast(self.ast))
      print(f"{self.name}: {self.colored_shape()} opts=[{describe_opts(self.applied_opts)}]" +
            (f" plan={self.plan!r}" if self.plan is not None else ""))
