"""The kernel walk: what the kernel computing one realized base fuses and loads, and the order items run in.

`walk_kernel(root, realizes)` walks the fused region of the kernel that computes `root`, in the order the scheduler's
`_KernelBuilder` builds it, and returns the first base that cannot join it with the reason (a second reduce, a reduce
inside a reduce, a reduce read out of its element order, a row kernel's output neither per element nor per row, the
value of an assign that reads its target through another view), and the `KernelPlan`: the realized bases the kernel
loads and its reduces. Row kernels (several reduces over the same rows: `ROW_KERNELS`, `MAX_ROW_FUSION_LENGTH`,
docs/fusion.md) are admitted here, and their element reduces (a short reduce read per element of the rows, staged
by a GPU block in local memory: `element_reduce_refusal`). `order_items` puts scheduled items in a run order: after
the items whose results they read, and before the assigns that overwrite what they read. The scheduler
(engine/schedule.py: settling the realizations, building each kernel) and the multi-output grouping
(engine/multi_output.py) both read this module, which imports neither of them.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from ourgrad.codegen.element_reduces import ELEMENT_ROW_BYTES
from ourgrad.codegen.opt.heuristic import reads_an_input_whole
from ourgrad.device import Device
from ourgrad.helpers import ELEMENT_REDUCES, ROW_KERNELS, prod
from ourgrad.lazy import LazyBuffer
from ourgrad.ops import ELEMENTWISE_OPS, REDUCE_OPS, Ops
from ourgrad.shape.shapetracker import ShapeTracker

Realizations = dict  # base id -> why that base gets its own buffer (one reason string from the decision)


@dataclass
class KernelPlan:
  """What the walk of one kernel's fused region found: the realized bases it loads (with the view, None for a gather
  table read at computed offsets), whether it holds a reduce, its reduces, and whether they make a row kernel."""
  loads: list[tuple[LazyBuffer, ShapeTracker | None]]
  has_reduce: bool
  reduces: int = 0   # reduce nodes met (a row kernel has several)
  # the distinct reduces computed here, in walk order: one, a row kernel's, or sibling reduces (`_is_sibling`)
  reduce_bases: list[LazyBuffer] = field(default_factory=list)
  row_kernel: bool = False   # the reduces share rows (`_RowKernel`): per element reads, or several per-row reduces
  # reduces of the row kernel's per-row results down to one value, after its rows (`final_reduces`)
  final_reduces: list[LazyBuffer] = field(default_factory=list)
  # reduces whose results the row kernel's reduces read per element of their rows (`element_reduce_refusal`)
  element_reduces: list[LazyBuffer] = field(default_factory=list)

def kernel_value(root: LazyBuffer) -> tuple[LazyBuffer, ShapeTracker] | None:
  """Where the kernel computing `root` starts its walk: the value it stores, or None for an item with no walk."""
  if root.op is Ops.COPY or root.size == 0 or root.op is Ops.CONST: return None
  if root.op in (Ops.CONTIGUOUS, Ops.ASSIGN): return root.srcs[0].base, root.srcs[0].st
  return root, ShapeTracker.from_shape(root.shape)


def reads_assign_target(node: LazyBuffer, target: LazyBuffer) -> bool:
  if node is target or (node.op is Ops.ASSIGN and node.srcs and node.srcs[1].base is target): return True
  return target.realized is not None and node.realized is target.realized


def walk_kernel(root: LazyBuffer, realizes: Realizations, sibling_limit: Callable[[str], int] | None = None
                ) -> tuple[tuple[LazyBuffer, str] | None, KernelPlan | None]:
  """The first base (in the builder's walk order) that the kernel computing `root` cannot fuse and why, else None;
  and the plan of the kernel (None for an item that is not a kernel walk). Up to `sibling_limit(device)` sibling
  reduces (`_is_sibling`: one loop shape, axes, op and dtype, each read in its own element order) may share a kernel
  that is not a row kernel, its output an elementwise function of them (engine/multi_output.py `sibling_limit`);
  without it, one."""
  start = kernel_value(root)
  if start is None: return None, None
  plan = KernelPlan([], False)
  finals = final_reduces(root, realizes)
  target = root.srcs[1].base if root.op is Ops.ASSIGN else None
  target_reads: list[tuple[ShapeTracker | None, bool]] = []   # (view, under a reduce) of each read of the target
  reduce_base: LazyBuffer | None = None
  rows = _RowKernel()
  one_reduce_kernel = False
  element_views: dict[int, ShapeTracker] = {}   # id of an element reduce -> the one view the rows read it through
  stack: list[tuple[LazyBuffer, ShapeTracker, bool, bool]] = [(start[0], start[1], False, False)]
  done: set[tuple[int, ShapeTracker]] = set()
  while stack:
    node, view, under_reduce, sources_done = stack.pop()
    if not sources_done: view = view.simplify()
    key = (id(node), view)
    if key in done: continue
    if sources_done or node.op is Ops.CONST:
      done.add(key)
      continue
    if node is not root and (node.realized is not None or id(node) in realizes):  # a load
      if target is not None and reads_assign_target(node, target): target_reads.append((view, under_reduce))
      plan.loads.append((node, view))
      done.add(key)
      continue
    stack.append((node, view, under_reduce, True))
    if any(node is final for final in finals):   # after the rows: its input is per row, read as it is
      plan.has_reduce, plan.reduces = True, plan.reduces + 1
      if not any(node is known for known in plan.final_reduces): plan.final_reduces.append(node)
      stack.append((node.srcs[0].base, node.srcs[0].st, False, False))
    elif node.op in REDUCE_OPS and root.op is Ops.INDEX_ACCUMULATE:
      return (node, "a reduce in a source of an indexed accumulate (whose kernel has no reduce loop)"), plan
    elif node.op in REDUCE_OPS and under_reduce and rows.loop_shape is not None and \
        element_views.get(id(node), view) == view and \
        element_reduce_refusal(node, view, rows.loop_shape, rows.axes) is None:
      # computed per element of the rows, beside the row kernel (its blocks stage the results in local memory)
      plan.has_reduce, plan.reduces = True, plan.reduces + 1
      element_views[id(node)] = view
      if not any(node is known for known in plan.element_reduces): plan.element_reduces.append(node)
      stack.append((node.srcs[0].base, node.srcs[0].st, True, False))
    elif node.op in REDUCE_OPS:
      plain_reshape = view.contiguous and view.size == node.size
      row_reason = rows.admit(node, view, under_reduce, plain_reshape) if not one_reduce_kernel else "closed"
      sibling = one_reduce_kernel and plain_reshape and not under_reduce and sibling_limit is not None and \
          _is_sibling(node, plan.reduce_bases[0]) and len(plan.reduce_bases) < sibling_limit(node.device)
      if row_reason is None:
        pass   # a reduce over the kernel's rows, kept in a register per row (several reduces in one kernel)
      elif sibling:
        pass   # beside the kernel's reduce in its loop, an accumulator each (codegen: Kernel.sibling_reduces)
      elif not (any(node is known for known in plan.reduce_bases) and plain_reshape) and node is not root:
        if reduce_base is not None:
          return (_refused_rows(node, plan.reduce_bases, realizes, root),
                  f"a second reduce, not sharing the kernel's rows: {row_reason}"), plan
        if under_reduce: return (node, f"a reduce inside another reduce's input: {row_reason}"), plan
        if not plain_reshape: return (node, f"a reduce read out of its own element order: {row_reason}"), plan
      if row_reason is not None:
        if rows.reduces and node not in rows.reduces: return (node, "a reduce over other rows than the kernel's"), plan
        one_reduce_kernel = True   # claimed as the kernel's one reduce: no row reduces join it
      reduce_base, plan.has_reduce, plan.reduces = reduce_base or node, True, plan.reduces + 1
      if not any(node is known for known in plan.reduce_bases): plan.reduce_bases.append(node)
      stack.append((node.srcs[0].base, node.srcs[0].st, True, False))
    elif node.op in ELEMENTWISE_OPS:
      stack.extend((src.base, src.st + view, under_reduce, False) for src in node.srcs)
    elif node.op is Ops.INDEX_ACCUMULATE:   # the root: each source's fused graph is walked in its own shape
      stack.extend((src.base, src.st, False, False) for src in node.srcs)
    elif node.op is Ops.GATHER:
      if target is not None and reads_assign_target(node.srcs[0].base, target): target_reads.append((None, False))
      plan.loads.append((node.srcs[0].base, None))
      stack.append((node.srcs[1].base, node.srcs[1].st + view, under_reduce, False))
  plan.row_kernel = rows.is_row_kernel or bool(finals) or bool(plan.element_reduces)
  if plan.element_reduces and (finals or target is not None):
    return (plan.element_reduces[0], "a reduce read per element of a row kernel's rows, in a kernel with final "
                                     "reduces or an assign"), plan
  if finals:
    if not rows.reduces:   # the reduce under the final one is no row reduce (the rows refused it): it goes first
      return (plan.reduce_bases[0], "a reduce under a reduce of its results, over rows no row kernel takes"), plan
    if target is not None: return (finals[0], "a reduce of per-row results in an assign's value"), plan
    return None, plan
  if len(plan.reduce_bases) > 1 and not plan.row_kernel and \
      any(reuses_an_operand(reduce, plan) for reduce in plan.reduce_bases):
    return (plan.reduce_bases[1], "a second reduce: a matmul's or convolution's operand tiles serve one reduce"), plan
  if rows.is_row_kernel and not rows.fits_output(root):
    first_fused = (rows.broadcast_reads + rows.reduces[1:])[0]
    return (first_fused, "a row kernel's output must be per element or per row of its reduces"), plan
  if target is None or not target_reads: return None, plan
  if rows.is_row_kernel:  # the hazard check below reasons in one reduce's loop shape, not a row kernel's
    first_fused = (rows.broadcast_reads + rows.reduces[1:])[0]
    return (first_fused, "an assign reading its own target keeps to one reduce"), plan
  return _assign_hazard(root, start[0], target_reads, reduce_base, realizes), plan


# A GPU row kernel may read, per element of its rows, the results of *element reduces*: short reduces over axes of
# their own (decode attention's scores, a 64-long dot product per cache slot, under the softmax x V row kernel). Its
# blocks compute them into local memory before the row passes (codegen/element_reduces.py). Only small ones: the
# results (all of them) at most this many elements, as a matrix-vector product's (a large one is a matmul, which
# tiles and tensor cores serve), each at most this long, and a block's row of them fits local memory
# (element_reduces.ELEMENT_ROW_BYTES).
MAX_ELEMENT_REDUCE_RESULTS = 1 << 17
MAX_ELEMENT_REDUCE_LENGTH = 256


def element_reduce_refusal(reduce: LazyBuffer, view: ShapeTracker, row_loop_shape: tuple[int, ...],
                           row_axes: tuple[int, ...] | None) -> str | None:
  """Why `reduce`, read through `view` (one view of its result in the row kernel's loop shape `row_loop_shape`) by a
  row reduce over `row_axes`, cannot be an element reduce of that row kernel, else None."""
  renderer = Device[reduce.device].renderer
  if not ELEMENT_REDUCES.value or not (renderer.has_threads and renderer.has_local):
    return "element reduces are off (ELEMENT_REDUCES) or need a GPU with local memory"
  loop_shape = reduce.srcs[0].shape
  if loop_shape == row_loop_shape and reduce.arg == row_axes: return "a reduce over the kernel's rows"
  if tuple(reduce.arg) != tuple(range(len(loop_shape) - len(reduce.arg), len(loop_shape))):
    return "it reduces axes other than the trailing ones"
  if len(view.views) != 1 or view.shape != row_loop_shape: return "read through more than one view"
  # a padded place reads 0, where the reduce of its (masked, zero) inputs may not be 0 (a sum of exp(0))
  if view.views[0].mask is not None: return "read through a pad"
  if reduce.size > MAX_ELEMENT_REDUCE_RESULTS or prod(loop_shape[axis] for axis in reduce.arg) > \
      MAX_ELEMENT_REDUCE_LENGTH: return "too large to compute per element of the rows"
  row_length = prod(row_loop_shape[axis] for axis in row_axes or ())
  if row_length * reduce.dtype.itemsize > min(ELEMENT_ROW_BYTES, renderer.local_memory_bytes // 2):
    return "its rows exceed local memory"
  return None


# A row kernel may end with *final reduces*: reduces of its rows' results down to one value (a loss's mean over the
# batch of each row's logsumexp), accumulated after each row. The rows are then a loop in one thread (CPU) or one
# block (GPU) instead of spread over cores or blocks: only for a loop shape of at most this many elements, where one
# launch less is worth more than the parallel rows (two kernels beyond it). A GPU's one block (256 threads, a few
# floats each per pass: codegen/row_blocks.py _linearize_final_rows) takes a few passes at most: a lower cap.
MAX_FINAL_REDUCE_ELEMENTS = 1 << 16
MAX_FINAL_REDUCE_ELEMENTS_GPU = 1 << 13


def final_reduces(root: LazyBuffer, realizes: Realizations) -> list[LazyBuffer]:
  """The final reduces of the kernel computing `root` (above): its value is one element, and reduces it computes
  (not through another reduce) reduce to one element each, at least one of them from reduces over rows (reduces
  in its fused input, each with a result of as many elements as the final reduce's input). Every such one-element
  reduce of an input of that many elements is a final reduce (a count of samples beside the sum of their losses).
  Whether the rows really join one row kernel is walk_kernel's decision (a refusal realizes a row reduce, and then
  nothing is nested any more)."""
  start = kernel_value(root)
  if start is None or start[0].size != 1 or root.size != 1: return []
  tops = _fused_reduces(start[0], realizes, root)
  per_row = {prod(inner.shape): inner for top in tops if top.size == 1
             for inner in _fused_reduces(top.srcs[0].base, realizes, root)}
  if len(per_row) != 1: return []
  rows, inner = next(iter(per_row.items()))
  loop_size = prod(inner.srcs[0].shape)
  renderer = Device[inner.device].renderer
  limit = min(MAX_FINAL_REDUCE_ELEMENTS, MAX_FINAL_REDUCE_ELEMENTS_GPU) if renderer.has_threads else \
      MAX_FINAL_REDUCE_ELEMENTS
  if rows < 2 or loop_size == rows or loop_size > limit or not row_kernels_enabled(inner.device) \
      or (renderer.has_threads and not renderer.has_local): return []   # a GPU loops over the rows in one block
  return [top for top in tops if top.size == 1 and prod(top.srcs[0].shape) == rows]


def _refused_rows(refused: LazyBuffer, outers: list[LazyBuffer], realizes: Realizations,
                  root: LazyBuffer) -> LazyBuffer:
  """What to realize when reduce `refused` cannot join the kernel of the reduces `outers` (a mean over rows of
  per-row values): the input of the outer reduce that computes `refused`, where that input is an elementwise
  function of `refused` and the reduces beside it and no larger than `refused`'s result (a loss per row:
  logsumexp - picked logit), so that those reduces stay one row kernel writing the per-row values instead of each
  being realized on its own; else `refused` itself."""
  for outer in outers:
    per_row = outer.srcs[0].base
    if per_row is root or per_row.op not in ELEMENTWISE_OPS or per_row.realized is not None or \
        id(per_row) in realizes or per_row.size > refused.size: continue
    if any(reduce is refused for reduce in _fused_reduces(per_row, realizes, root)): return per_row
  return refused


def _fused_reduces(start: LazyBuffer, realizes: Realizations, root: LazyBuffer) -> list[LazyBuffer]:
  """The reduces that the fused graph from `start` computes in the kernel of `root` (every other realized base is a
  load there), not looking inside them, in walk order."""
  found: list[LazyBuffer] = []
  stack, seen = [start], set()
  while stack:
    node = stack.pop()
    if id(node) in seen or (node is not root and (node.realized is not None or id(node) in realizes)): continue
    seen.add(id(node))
    if node.op in REDUCE_OPS: found.append(node)
    elif node.op in ELEMENTWISE_OPS: stack.extend(src.base for src in node.srcs)
  return found


def _is_sibling(reduce: LazyBuffer, first: LazyBuffer) -> bool:
  """Whether `reduce` may run in the loop of the kernel's first reduce `first`: the same input shape, axes, op and
  dtype (one accumulator each, combined alike), on one device."""
  return reduce.op is first.op and reduce.dtype == first.dtype and reduce.arg == first.arg and \
      reduce.srcs[0].shape == first.srcs[0].shape and reduce.device == first.device


def reuses_an_operand(reduce: LazyBuffer, plan: KernelPlan) -> bool:
  """Whether a load of the kernel varies along a reduced axis of `reduce` but is broadcast along an output axis: a
  matmul's or a convolution's operand, whose tiles (tensor cores, local memory) serve one reduce; q, k and v
  projections of one input stay three matmuls. Not where another load is read whole (heuristic.reads_an_input_whole):
  that reduce is bound by its bytes, a plain reduce (a LayerNorm weight gradient: x and dy beside per-token mean and
  rstd), and may share its loop with the bias gradient's sum of dy."""
  loop_shape = reduce.srcs[0].shape
  outputs = [axis for axis, size in enumerate(loop_shape) if axis not in reduce.arg and size != 1]
  strides = [view.real_strides() for _, view in plan.loads if view is not None and view.shape == loop_shape]
  if reads_an_input_whole(loop_shape, strides): return False
  return any(any(load[axis] == 0 for axis in outputs) and any(load[axis] != 0 for axis in reduce.arg)
             for load in strides)


# A row kernel (several reduces in one kernel, docs/fusion.md) on a CPU loops over a row once per reduce and once
# more for the store, in one thread: longer rows keep one-reduce kernels. A GPU block streams its row (the max and
# the sums relative to it in one pass, codegen/online_rows.py) at any length.
MAX_ROW_FUSION_LENGTH = 1 << 16


def row_length_fits(device: str, length: int) -> bool:
  """Whether a row of `length` elements may be a row kernel's row on `device` (MAX_ROW_FUSION_LENGTH on a CPU). A
  symbolic length (a Variable) never is: the row kernel's loops and kept-value arrays are sized when it is built."""
  if not isinstance(length, int): return False
  return length <= MAX_ROW_FUSION_LENGTH or Device[device].renderer.has_threads


def joins_rows(reduce: LazyBuffer) -> bool:
  """Whether `reduce` may be computed inside a row kernel (its trailing axes, rows a row kernel takes on its
  device): a kernel reading its result then recomputes it from its input, rather than loading it."""
  loop_shape = reduce.srcs[0].shape
  return row_kernels_enabled(reduce.device) and tuple(reduce.arg) == tuple(range(len(loop_shape) - len(reduce.arg),
                                                                                   len(loop_shape))) \
      and row_length_fits(reduce.device, prod(loop_shape[axis] for axis in reduce.arg))


def row_kernels_enabled(device: str) -> bool:
  """Whether reduces over the same rows may share a kernel on `device` (ROW_KERNELS). On a CPU a thread owns a row;
  on a GPU a block does (codegen/row_blocks.py), which needs local memory for the block's partials: a GPU
  without it keeps the grouped one-reduce kernels (one thread per long row would read uncoalesced memory)."""
  setting = int(ROW_KERNELS.value)
  if setting >= 0: return bool(setting)
  renderer = Device[device].renderer
  return not renderer.has_threads or renderer.has_local


class _RowKernel:
  """The rows a kernel's reduces share: every reduce reads the same input shape (the kernel's loop shape) and
  reduces the same axes, so one thread per row runs them one after another, each result in a register, and reads
  the row again for the next reduce and for the store. A reduce is admitted when it is read per element of the
  loop shape (broadcast back, as `x - x.max()`), inside another admitted reduce, or as the kernel's per-row result."""

  def __init__(self) -> None:
    self.loop_shape: tuple[int, ...] | None = None
    self.axes: tuple[int, ...] | None = None
    self.reduces: list[LazyBuffer] = []
    self.broadcast_reads: list[LazyBuffer] = []   # the reduces read back per element (what makes a row kernel)

  def admit(self, reduce: LazyBuffer, view: ShapeTracker, under_reduce: bool, plain_reshape: bool) -> str | None:
    """None when `reduce` joins the rows (recorded), else why not."""
    if not row_kernels_enabled(reduce.device):
      return f"row kernels are off on {reduce.device} (ROW_KERNELS, or a GPU without local memory)"
    loop_shape = reduce.srcs[0].shape
    if not row_length_fits(reduce.device, prod(loop_shape[axis] for axis in reduce.arg)):
      return f"its rows are longer than {MAX_ROW_FUSION_LENGTH}"
    if tuple(reduce.arg) != tuple(range(len(loop_shape) - len(reduce.arg), len(loop_shape))):
      # TODO: reduces over leading or interleaved axes (batchnorm's (0, 2, 3)) gave a wrong convolution weight
      # gradient in test_module's CNN; only the trailing axes (softmax, layernorm over the last axes) fuse for now
      return "it reduces axes other than the trailing ones"
    if self.loop_shape is not None and (loop_shape != self.loop_shape or reduce.arg != self.axes):
      return f"it reduces axes {reduce.arg} of {loop_shape}, the kernel {self.axes} of {self.loop_shape}"
    broadcast = view == ShapeTracker.from_shape(reduce.shape).expand(loop_shape).simplify()
    if not (broadcast or plain_reshape): return "read through a permute or pad, not broadcast back along its rows"
    if under_reduce and not broadcast: return "read inside another reduce, not broadcast back along its rows"
    self.loop_shape, self.axes = loop_shape, reduce.arg
    if reduce not in self.reduces: self.reduces.append(reduce)
    if broadcast or under_reduce: self.broadcast_reads.append(reduce)
    return None

  @property
  def is_row_kernel(self) -> bool: return bool(self.broadcast_reads) or len(self.reduces) > 1

  def fits_output(self, root: LazyBuffer) -> bool:
    """The store is per element of the loop shape, or per row (the size of a reduce's result)."""
    assert self.loop_shape is not None and self.axes is not None
    per_row = prod(size for axis, size in enumerate(self.loop_shape) if axis not in self.axes)
    value = root.srcs[0] if root.op in (Ops.CONTIGUOUS, Ops.ASSIGN) else root
    if root.op in (Ops.CONTIGUOUS, Ops.ASSIGN) and not value.st.contiguous: return False
    return value.shape == self.loop_shape or value.size == per_row


def _assign_hazard(root: LazyBuffer, value: LazyBuffer, target_reads: list[tuple[ShapeTracker | None, bool]],
                   reduce_base: LazyBuffer | None, realizes: Realizations) -> tuple[LazyBuffer, str] | None:
  """An assign that reads its own target through another view than the one it writes would read elements it has
  already overwritten: its value is computed in a kernel of its own first."""
  if value.realized is not None or id(value) in realizes: return None   # nothing left to split off (builder checks)

  def fit(st: ShapeTracker) -> ShapeTracker:   # the views outside the reduce, in the reduce's loop shape
    return st if reduce_base is None or st.shape == reduce_base.shape else st.reshape(reduce_base.shape)
  in_place = fit(ShapeTracker.from_shape(root.shape))
  for view, under_reduce in target_reads:
    if view is None or (view if under_reduce else fit(view)).simplify() != in_place:
      return value, "the value of an assign that reads its target through another view"
  return None

def order_items(scheduled: list[LazyBuffer], groups: dict[int, list[LazyBuffer]],
                reads: dict[int, list[LazyBuffer]]) -> list[LazyBuffer]:
  """A run order: every item after the items whose results it reads, and every assign after the items that
  still read the old contents of the buffer it overwrites. `scheduled` holds each item's first base (the id its
  group and reads are keyed by), in graph order, kept where free."""
  position = {id(base): index for index, base in enumerate(scheduled)}
  must_precede = item_precedence(scheduled, groups, reads)
  # Kahn's algorithm, always taking the earliest ready item in graph order
  waiting_on = {item: len(before) for item, before in must_precede.items()}
  followers: dict[int, list[int]] = defaultdict(list)
  for item, before in must_precede.items():
    for earlier in before: followers[earlier].append(item)
  ready = [position[item] for item, count in waiting_on.items() if count == 0]
  heapq.heapify(ready)
  ordered: list[LazyBuffer] = []
  while ready:
    base = scheduled[heapq.heappop(ready)]
    ordered.append(base)
    for follower in followers[id(base)]:
      waiting_on[follower] -= 1
      if waiting_on[follower] == 0: heapq.heappush(ready, position[follower])
  if len(ordered) != len(scheduled):
    raise RuntimeError("this graph reads a buffer both before and after an assign to it in one kernel; "
                       "realize the old value (e.g. .contiguous().realize()) before assigning")
  return ordered


def item_precedence(scheduled: list[LazyBuffer], groups: dict[int, list[LazyBuffer]],
                    reads: dict[int, list[LazyBuffer]]) -> dict[int, set[int]]:
  """For each item (the id of its first base), the items that must run before it (`order_items`' constraints)."""
  position = {id(base): index for index, base in enumerate(scheduled)}
  item_of = {id(member): id(base) for base in scheduled for member in groups[id(base)]}   # base id -> item id
  # id(Buffer) -> (item, version) of each assign overwriting it: several assigns to one buffer are successive
  # versions of it (a chain through their targets), each read only before the next one writes
  assign_writers: dict[int, list[tuple[int, int]]] = defaultdict(list)
  must_precede: dict[int, set[int]] = {id(base): set() for base in scheduled}   # item -> items that run before
  for base in scheduled:
    for member in groups[id(base)]:
      if member.op is not Ops.ASSIGN: continue
      assign_writers[id(member.realized)].append((id(base), write_version(member)))
      # an assign runs after the write it follows, though its value may not read it (two fills of one buffer)
      target_item = item_of.get(id(member.srcs[1].base)) if member.srcs else None
      if target_item is not None and target_item != id(base): must_precede[id(base)].add(target_item)
  for base in scheduled:
    for loaded in reads[id(base)]:
      loaded_item = item_of.get(id(loaded), id(loaded))
      if loaded_item in position and loaded_item != id(base): must_precede[id(base)].add(loaded_item)
      version = write_version(loaded)
      for writer, writer_version in assign_writers.get(id(loaded.realized), []):
        # a later write overwrites the value `loaded` holds: it runs after this read
        if writer_version > version and writer != loaded_item and writer != id(base): must_precede[writer].add(id(base))
  return must_precede


def write_version(base: LazyBuffer) -> int:
  """How many assigns of this schedule wrote a buffer before `base` holds it: 0 for a realized base or another
  op, n for the n-th of a chain of assigns (each one's target is the assign before it)."""
  version = 0
  while base.op is Ops.ASSIGN and base.srcs:
    version += 1
    base = base.srcs[1].base
  return version


def items_on_cycles(must_precede: dict[int, set[int]]) -> set[int]:
  """The items of `must_precede` (item -> items that must run before it) that lie on a cycle: the strongly connected
  components of two or more items (Kosaraju's two passes, with explicit stacks)."""
  finished: list[int] = []   # pass 1: every item after the items it waits on, transitively
  seen: set[int] = set()
  for start in must_precede:
    if start in seen: continue
    seen.add(start)
    stack = [(start, iter(must_precede[start]))]
    while stack:
      item, earlier_items = stack[-1]
      earlier = next((other for other in earlier_items if other not in seen), None)
      if earlier is None:
        stack.pop()
        finished.append(item)
        continue
      seen.add(earlier)
      stack.append((earlier, iter(must_precede.get(earlier, ()))))
  followers: dict[int, list[int]] = defaultdict(list)
  for item, before in must_precede.items():
    for earlier in before: followers[earlier].append(item)
  component_of: dict[int, int] = {}
  on_cycles: set[int] = set()
  for start in reversed(finished):   # pass 2: along the followers, the last finished first
    if start in component_of: continue
    component_of[start] = start
    component, stack = [start], [start]
    while stack:
      for follower in followers[stack.pop()]:
        if follower not in component_of:
          component_of[follower] = start
          component.append(follower)
          stack.append(follower)
    if len(component) > 1: on_cycles.update(component)
  return on_cycles
