"""Kernel packing (multi-tensor apply): independent small kernels of different shapes in one launch.

`pack_kernels(schedule)` runs after the scheduler has built and ordered its items. It merges kernels that are
- packable (`why_not_packable`): no gathered load, no symbolic size, and either elementwise with every view
  flattening to one dimension without a second view, or a *small reduce*: one SUM or MAX of at most
  PACK_REDUCE_MAX_LOOP elements per output (a thread loops over them) and PACK_REDUCE_MAX_ELEMENTS in all: the second
  kernel of a split reduce (batchnorm statistics over their parts), a loss's sum, a bias gradient over a few rows.
  On a GPU these are launches of a few microseconds each that do almost nothing; the sibling ones (a batchnorm's two
  backward sums, each layer's) share one launch;
- independent: no chain of dependencies between any two of them. Dependencies come from buffers, in run order: an
  item depends on the last earlier writer of each buffer it reads or writes, and an item that writes a buffer on
  every earlier reader since that buffer's last write (an assign runs after the reads of the old contents). Items of
  one *height* (the longest chain of items depending on it) never depend on each other, so packs are taken among the
  kernels of one height and device: an optimizer's updates are the last items (height 0) and pack; a kernel that
  reads another's output is a height above it and stays apart (Adam's step count, read by every update). The
  elementwise items that depend on no other item (roots) never depend on each other either, whatever their heights:
  where every packable kernel at a height is one (each layer's weight and bias casts under autocast), those heights'
  roots form one pack, which runs first (`_roots_together`);
- on a CPU, no bigger than CPU_PACK_MAX_ELEMENTS: packed segments are serial loops, a big kernel alone is parallel;
- within the caps: at most MAX_PACK_BUFFERS buffer arguments (CUDA passes at most 4 KB of them) and KERNEL_OPS_LIMIT
  ops per packed kernel, and 2^31 - 1 elements in all (the flat index is an int32); beyond them a new pack
  starts.
A pack becomes one ScheduleItem whose AST is PACK(segments) (codegen/packed.py): its outputs are the members'
outputs, its inputs their other buffers, each once. Merging kernels of one height keeps every dependency going from
a higher height to a lower one, so the packed items still have a run order: Kahn's algorithm over the packs, taking
the ready pack whose first member came first. DEBUG=3 prints each pack and why each other kernel was not packed.
"""
from __future__ import annotations

import heapq
from collections import defaultdict

from ourgrad.device import Buffer, Device
from ourgrad.engine.schedule_item import ScheduleItem
from ourgrad.helpers import DEBUG, KERNEL_OPS_LIMIT, MAX_PACK_BUFFERS, PACK_KERNELS, prod
from ourgrad.ops import ATTENTION_OPS, ELEMENTWISE_OPS, REDUCE_OPS, ConstBuffer, LazyOp, MemBuffer, Ops
from ourgrad.shape.shapetracker import ShapeTracker


def pack_kernels(schedule: list[ScheduleItem]) -> list[ScheduleItem]:
  """The schedule with independent packable kernels of one device merged into packed kernels (module docstring)."""
  if not PACK_KERNELS or len(schedule) < 2: return schedule
  reasons = {index: why_not_packable(item) for index, item in enumerate(schedule)}
  if sum(reason is None for reason in reasons.values()) < 2:
    if DEBUG >= 3: _print_reasons(schedule, reasons, [])
    return schedule
  predecessors = _dependencies(schedule)
  heights = _roots_together(schedule, reasons, predecessors, _heights(predecessors))
  packs = _choose_packs(schedule, reasons, heights)
  if DEBUG >= 3: _print_reasons(schedule, reasons, packs)
  if not any(len(pack) > 1 for pack in packs): return schedule
  return [_packed_item([schedule[index] for index in pack]) if len(pack) > 1 else schedule[pack[0]]
          for pack in _order_packs(packs, predecessors)]


# the packing "height" of the kernels that depend on no other kernel of the schedule (_roots_together)
ROOTS = -1
# the flat index of a packed kernel is an int32, as every kernel's index is
MAX_PACK_ELEMENTS = 2**31 - 1
# A CPU runs a packed kernel's segments as serial loops, while a kernel of its own this big is spread over the cores
# (the C renderer's OpenMP loop): on a CPU such a kernel stays alone. Its launch costs little next to its run time.
CPU_PACK_MAX_ELEMENTS = 1 << 16


def why_not_packable(item: ScheduleItem) -> str | None:
  """None when `item` may join a packed kernel, else why not."""
  if item.ast.op not in (Ops.STORE, Ops.SINK): return f"a {item.ast.op.name}, not a kernel"
  device = item.outputs[0].device
  if item.outputs[0].size > CPU_PACK_MAX_ELEMENTS and not Device[device].renderer.has_threads:
    return f"over {CPU_PACK_MAX_ELEMENTS} elements on {device}, which runs it on several cores alone"
  nodes = item.ast.walk()
  if any(node.op is Ops.LOAD and node.srcs for node in nodes): return "it has a gathered load"
  if any(node.op is Ops.INDEX_ACCUMULATE for node in nodes): return "an indexed accumulate (a kernel of its own)"
  if any(node.op in ATTENTION_OPS for node in nodes): return "a fused attention (a kernel of its own)"
  if any(isinstance(node.arg, (MemBuffer, ConstBuffer)) and node.arg.st.symbolic for node in nodes):
    return "a view with a symbolic size"
  reduces = [node for node in nodes if node.op in REDUCE_OPS]
  if reduces: return _why_not_packable_reduce(item, reduces)
  for node in nodes:
    if isinstance(node.arg, (MemBuffer, ConstBuffer)):
      st = node.arg.st
      if len(_flat(st).views) != len(st.views): return f"a view of shape {st.shape} that does not flatten"
  return None


# a reduce joins a pack where each output sums at most this many elements (its thread loops over them, unrolled by
# PACKED_REDUCE_UNROLL: a few dependent steps) and all its outputs at most PACK_REDUCE_MAX_ELEMENTS
PACK_REDUCE_MAX_LOOP = 64
PACK_REDUCE_MAX_ELEMENTS = 1 << 20


def _why_not_packable_reduce(item: ScheduleItem, reduces: list[LazyOp]) -> str | None:
  """None where a kernel with a reduce is a small reduce that may join a pack (module docstring), else why not."""
  if len(reduces) > 1 or item.ast.op is not Ops.STORE: return "it has a reduce (packed only: one, one output)"
  if not Device[item.outputs[0].device].renderer.has_threads: return "it has a reduce (packed only on GPUs)"
  reduce = reduces[0]
  input_shape = next((node.arg.st.shape for node in reduce.walk() if isinstance(node.arg, MemBuffer)), None)
  if input_shape is None: return "it has a reduce of no buffer"
  reduced_shape = tuple(1 if axis in reduce.arg else size for axis, size in enumerate(input_shape))
  if item.ast.arg.st.shape != reduced_shape:   # the reduce's result is expanded again (a row's sum used per element)
    return "it has a reduce whose result is read along the reduced axes"
  loop = prod(input_shape[axis] for axis in reduce.arg)
  if loop > PACK_REDUCE_MAX_LOOP: return f"it has a reduce of {loop} elements per output (packed: at most " \
                                         f"{PACK_REDUCE_MAX_LOOP})"
  if loop * item.outputs[0].size > PACK_REDUCE_MAX_ELEMENTS: return "it has a reduce of too many elements to pack"
  return None


def _flat(st: ShapeTracker) -> ShapeTracker: return st.reshape((st.size,))


def _dependencies(schedule: list[ScheduleItem]) -> list[set[int]]:
  """For each item (by position), the earlier items it must run after, from the buffers they share."""
  last_writer: dict[int, int] = {}                       # id(Buffer) -> position of its last writer
  readers: dict[int, list[int]] = defaultdict(list)      # id(Buffer) -> positions that read it since that write
  predecessors: list[set[int]] = []
  for position, item in enumerate(schedule):
    before: set[int] = set()
    for buffer in item.inputs:
      if id(buffer) in last_writer: before.add(last_writer[id(buffer)])
    for buffer in item.outputs:
      if id(buffer) in last_writer: before.add(last_writer[id(buffer)])
      before.update(readers[id(buffer)])
    before.discard(position)
    predecessors.append(before)
    for buffer in item.inputs: readers[id(buffer)].append(position)
    for buffer in item.outputs:
      last_writer[id(buffer)] = position
      readers[id(buffer)] = []
  return predecessors


def _heights(predecessors: list[set[int]]) -> list[int]:
  """For each item, the longest chain of items that depend on it (0: nothing later depends on it)."""
  heights = [0] * len(predecessors)
  for position in reversed(range(len(predecessors))):   # every dependent comes later in run order
    for earlier in predecessors[position]: heights[earlier] = max(heights[earlier], heights[position] + 1)
  return heights


def _roots_together(schedule: list[ScheduleItem], reasons: dict[int, str | None], predecessors: list[set[int]],
                    heights: list[int]) -> list[int]:
  """`heights` with ROOTS for the packable elementwise kernels that depend on no other (every layer's weight and bias
  casts to bf16 under autocast, each layer's at its own heights) where every packable kernel at their height is one:
  those pack together whatever their heights, in one launch instead of one per height, and their pack runs first,
  before every kernel reading them. A root beside other kernels at its height stays in their pack (moved, it would
  save no launch: Adam's step-count powers pack with the parameter updates); a small reduce keeps its place (it packs
  with its siblings, or rides along in a kernel beside it: engine/ride_along.py)."""
  def is_root(position: int) -> bool:
    return not predecessors[position] and not any(node.op in REDUCE_OPS for node in schedule[position].ast.walk())
  members: dict[tuple[str, int], list[int]] = defaultdict(list)
  for position, item in enumerate(schedule):
    if reasons[position] is None: members[(item.outputs[0].device, heights[position])].append(position)
  moving = [group for group in members.values() if all(is_root(member) for member in group)]
  if len(moving) < 2: return heights   # one launch either way
  roots = {position for group in moving for position in group}
  return [ROOTS if position in roots else height for position, height in enumerate(heights)]


def _choose_packs(schedule: list[ScheduleItem], reasons: dict[int, str | None], heights: list[int]) -> list[list[int]]:
  """Every item's position in exactly one pack (a pack of one is an item left as it is), in run order."""
  packs: list[list[int]] = []
  # (device, height) -> the open pack there: (positions, buffer ids, op count, elements)
  open_packs: dict[tuple[str, int], tuple[list[int], set[int], int, int]] = {}
  for position, item in enumerate(schedule):
    if reasons[position] is not None:
      packs.append([position])
      continue
    key = (item.outputs[0].device, heights[position])
    buffers = {id(buffer) for buffer in item.bufs}
    ops, elements = _op_count(item.ast), item.outputs[0].size
    current = open_packs.get(key)
    if current is not None:
      pack, pack_buffers, pack_ops, pack_elements = current
      if len(pack_buffers | buffers) <= int(MAX_PACK_BUFFERS.value) and _within_ops_limit(pack_ops + ops) \
          and pack_elements + elements <= MAX_PACK_ELEMENTS:
        pack.append(position)
        open_packs[key] = (pack, pack_buffers | buffers, pack_ops + ops, pack_elements + elements)
        continue
      reasons[position] = f"the pack at its height {heights[position]} was full (MAX_PACK_BUFFERS, KERNEL_OPS_LIMIT)"
    packs.append([position])
    open_packs[key] = (packs[-1], buffers, ops, elements)
  for pack in packs:
    if len(pack) > 1:
      reasons[pack[0]] = None   # it started a pack when the previous one was full: packed all the same
    elif reasons[pack[0]] is None:
      reasons[pack[0]] = f"no other packable kernel on its device at dependency height {heights[pack[0]]}"
  return packs


def _within_ops_limit(ops: int) -> bool: return KERNEL_OPS_LIMIT.value <= 0 or ops <= int(KERNEL_OPS_LIMIT.value)


def _op_count(ast: LazyOp) -> int: return sum(node.op in ELEMENTWISE_OPS for node in ast.walk())


def _order_packs(packs: list[list[int]], predecessors: list[set[int]]) -> list[list[int]]:
  """The packs in a run order: each after the packs holding its members' predecessors, the earliest ready first."""
  pack_of = {position: number for number, pack in enumerate(packs) for position in pack}
  waiting_on = [0] * len(packs)
  followers: dict[int, set[int]] = defaultdict(set)
  for number, pack in enumerate(packs):
    before = {pack_of[earlier] for position in pack for earlier in predecessors[position]} - {number}
    waiting_on[number] = len(before)
    for earlier in before: followers[earlier].add(number)
  ready = [(packs[number][0], number) for number in range(len(packs)) if waiting_on[number] == 0]
  heapq.heapify(ready)
  ordered: list[list[int]] = []
  while ready:
    _, number = heapq.heappop(ready)
    ordered.append(packs[number])
    for follower in followers[number]:
      waiting_on[follower] -= 1
      if waiting_on[follower] == 0: heapq.heappush(ready, (packs[follower][0], follower))
  if len(ordered) != len(packs): raise AssertionError("packing kernels of one height left no run order")
  return ordered


def _packed_item(members: list[ScheduleItem]) -> ScheduleItem:
  """One ScheduleItem running `members` as the segments of a PACK AST. Outputs are numbered first (every member's, in
  order), then inputs, each buffer once; an input that is also an output (an assign reading its target in place)
  is read through the output's argument."""
  outputs: list[Buffer] = [buffer for member in members for buffer in member.outputs]
  number_of: dict[int, int] = {id(buffer): number for number, buffer in enumerate(outputs)}
  inputs: list[Buffer] = []
  for member in members:
    for buffer in member.inputs:
      if id(buffer) not in number_of:
        number_of[id(buffer)] = len(outputs) + len(inputs)
        inputs.append(buffer)
  segments = tuple(_flat_segment(member, number_of) for member in members)
  return ScheduleItem(LazyOp(Ops.PACK, segments, None, members[0].ast.dtype), tuple(outputs), tuple(inputs))


def _flat_segment(member: ScheduleItem, number_of: dict[int, int]) -> LazyOp:
  """The member's AST with its buffer numbers replaced by the packed kernel's and, for an elementwise kernel, every
  view flattened (a reduce keeps its views: codegen/packed.py walks its outputs by their flat number)."""
  own_buffers = member.bufs
  nodes = member.ast.walk()
  flat = _flat if not any(node.op in REDUCE_OPS for node in nodes) else (lambda st: st)
  rebuilt: dict[int, LazyOp] = {}
  for node in nodes:
    arg = node.arg
    if isinstance(arg, MemBuffer): arg = MemBuffer(number_of[id(own_buffers[arg.idx])], arg.dtype, flat(arg.st))
    elif isinstance(arg, ConstBuffer): arg = ConstBuffer(arg.val, arg.dtype, flat(arg.st))
    rebuilt[id(node)] = LazyOp(node.op, tuple(rebuilt[id(src)] for src in node.srcs), arg, node.dtype)
  return rebuilt[id(member.ast)]


def _print_reasons(schedule: list[ScheduleItem], reasons: dict[int, str | None], packs: list[list[int]]) -> None:
  """DEBUG=3: each pack, and why each other kernel runs on its own."""
  for pack in packs:
    if len(pack) > 1:
      sizes = [schedule[position].outputs[0].size for position in pack]
      kinds = "elementwise" if not any(schedule[position].ast.op is Ops.STORE and any(
        node.op in REDUCE_OPS for node in schedule[position].ast.walk()) for position in pack) else "small"
      print(f"pack {len(pack)} independent {kinds} kernels (output sizes {sizes}) into one launch")
  for position, reason in reasons.items():
    if reason is not None and schedule[position].ast.op is not Ops.COPY:
      print(f"not packed: kernel writing {schedule[position].outputs[0].size} elements: {reason}")
