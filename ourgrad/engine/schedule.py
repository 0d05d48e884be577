"""The scheduler: cut the lazy graph into kernels.

`create_schedule(outs)` walks the graph from the outputs and decides which bases get their own buffer
("are realized"): the outputs, copies, `contiguous()`/`realize()` requests, assign targets, reduces whose
result is used through anything but a plain reshape (as in `x - x.max()`) or by several users, and
graphs that a padded view cannot be pushed through. Every other base is fused into its users: an
elementwise op is inlined (recomputed) in each kernel that reads it, so a chain of elementwise ops, a
reduce, and elementwise ops after it become one kernel. Each realized base becomes one `ScheduleItem`
holding a kernel AST (`STORE(...)`) or a copy, in an order where every item runs after its inputs.

Decide, then build: `_choose_realizes` and `_settle_fusion_groups` settle every realization first, each with one
reason string (`Realizations`, printed at DEBUG=3 and listed in docs/fusion.md); only then is each kernel built,
once, by `_KernelBuilder`, which never changes the decision. The walk of each kernel's fused region that decides
what joins it (`walk_kernel`) and the run order of the items (`order_items`) are in engine/kernel_walk.py, which
the multi-output grouping reads too. Realized bases that one kernel writes together (multi-output and sibling-reduce
kernels) are grouped by engine/multi_output.py. Whether an intermediate read by several kernels is stored or
recomputed in each is engine/store_or_recompute.py's rule. Last, independent elementwise kernels of different shapes
are packed into single launches (engine/packing.py).
"""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import Sequence

from ourgrad import lazy_trace
from ourgrad.device import Buffer, Device
from ourgrad.dtype import DType, dtypes
from ourgrad.engine import graph_viz
from ourgrad.engine.kernel_walk import (Realizations, final_reduces, item_precedence, items_on_cycles, kernel_value,
                                        order_items, walk_kernel, write_version)
from ourgrad.engine.multi_output import group_outputs, sibling_limit
from ourgrad.engine.operand_staging import stage_matmul_operands
from ourgrad.engine.packing import pack_kernels
from ourgrad.engine.split_fusion import fuse_split_reduces
from ourgrad.engine.profile import host_phase
from ourgrad.engine.ride_along import carry_small_reduces
from ourgrad.engine.schedule_item import ScheduleItem
from ourgrad.engine.snapshot import protect_lazy_readers
from ourgrad.engine.store_or_recompute import _is_per_row_value, _reconsider_reduce_stores, _store_or_recompute
from ourgrad.helpers import DEBUG, GRAPH, KERNEL_OPS_LIMIT, prod
from ourgrad.lazy import LazyBuffer, walk_bases
from ourgrad.lazy_value import is_exact_node, is_lossless_round_trip
from ourgrad.ops import (ATTENTION_OPS, ELEMENTWISE_OPS, REDUCE_OPS, UNSAFE_PAD_OPS, ConstBuffer, LazyOp, MemBuffer,
                         Ops, is_identity_constant)
from ourgrad.shape.shapetracker import ShapeTracker
from ourgrad.shape.view import View

# Scheduling gives bases their buffers (base.realized) before the kernels that fill them run: another thread that
# scheduled in between would take them for computed. Tensor.realize holds this lock from create_schedule to the end
# of run_schedule, so one thread at a time schedules and runs (building lazy graphs needs no lock). Re-entrant:
# a realize can start another (a DISK copy, numpy() inside a custom op).
REALIZE_LOCK = threading.RLock()

# bases that always get their own buffer
ALWAYS_REALIZED_OPS = frozenset({Ops.EMPTY, Ops.COPY, Ops.CONTIGUOUS, Ops.ASSIGN, Ops.CUSTOM, Ops.INDEX_ACCUMULATE,
                                 *ATTENTION_OPS})


def create_schedule(outs: Sequence[LazyBuffer]) -> list[ScheduleItem]:
  """The kernels and copies that compute every base in `outs`, each after the items it depends on. Lazy readers
  of a buffer that an assign in it overwrites, and that outlive it, keep the old contents (engine/snapshot.py)."""
  # the creation trace (lazy_trace.py) holds every base made since the last schedule: let go of it, so that only
  # readers someone else holds look alive to the copy-on-write below; and of the one the bases made here start
  lazy_trace.invalidate()
  schedule, assigns = build_schedule(outs)
  # after build_schedule returned, the graph it fused is alive only where someone else holds it
  schedule = protect_and_pack(schedule, assigns) if assigns else schedule
  lazy_trace.invalidate()
  return schedule


def protect_and_pack(schedule: list[ScheduleItem], assigns: list[tuple[LazyBuffer, LazyBuffer]]) -> list[ScheduleItem]:
  """protect_lazy_readers (engine/snapshot.py), then the snapshot copies it added packed into launches: an optimizer
  step whose loss is still lazy snapshots every parameter, and those copies are independent of each other."""
  item_count = len(schedule)
  schedule = protect_lazy_readers(schedule, assigns)
  return pack_kernels(schedule) if len(schedule) > item_count else schedule


@host_phase("schedule", lambda outs: f"schedule {len(outs)} outputs")
def build_schedule(outs: Sequence[LazyBuffer]) -> tuple[list[ScheduleItem], list[tuple[LazyBuffer, LazyBuffer]]]:
  """The schedule, and (assign base, target base) for every assign it runs. Readers outside the schedule are not
  protected yet: callers pass the assigns to protect_lazy_readers once they let go of the graph."""
  bases = walk_bases(outs)
  if not bases: return [], []
  realizes = _choose_realizes(bases, outs)
  bases = stage_matmul_operands(bases, realizes)   # matmul operands in the layout WGMMA reads (operand_staging.py)
  _reconsider_reduce_stores(bases, realizes)
  _settle_fusion_groups(bases, realizes)
  if DEBUG >= 3: _print_realize_reasons(bases, realizes)
  lazy_graph = graph_viz.capture_lazy_graph(outs) if GRAPH else None   # before scheduling cuts the sources
  items: dict[int, ScheduleItem] = {}
  reads: dict[int, list[LazyBuffer]] = {}   # base id -> the realized bases its item loads
  for base in bases:
    if id(base) in realizes: _give_buffer(base)
  if any(base.op is Ops.ASSIGN for base in bases): bases = _order_reads_before_writes(bases, realizes)
  groups = {id(group[0]): group for group in group_outputs(bases, realizes)}   # an empty base has no kernel
  for leader, group in groups.items():
    items[leader], reads[leader] = _schedule_base(group[0], realizes) if len(group) == 1 else \
        _schedule_group(group, realizes)
  ordered = order_items([base for base in bases if id(base) in items], groups, reads)
  schedule = [items[id(base)] for base in ordered]
  schedule = fuse_split_reduces(schedule)   # a split reduce's two kernels in one where the device has atomics
  schedule = pack_kernels(schedule)   # independent elementwise kernels of different shapes: one launch (packing.py)
  schedule = carry_small_reduces(schedule)   # a one-value reduce in the first block of a kernel beside it
  assigns = [(base, base.srcs[1].base) for leader in ordered for base in groups[id(leader)] if base.op is Ops.ASSIGN]
  for group in groups.values():  # the graph behind a realized base is no longer needed: let it be freed
    for base in group: base.srcs = ()
  if DEBUG >= 3: print(f"scheduled {len(schedule)} items for {len(bases)} lazy bases")
  if lazy_graph is not None: graph_viz.write_graphs(lazy_graph, schedule)
  return schedule, assigns


def writes_into_a_source(base: LazyBuffer) -> bool:
  """Whether `base` writes into the buffer of one of its sources instead of a fresh one (by its op and arg alone: the
  schedule cache asks after the sources are dropped): an assign (its target), a packed attention dK/dV op (the dQ
  op's buffer, beside dq: LazyBuffer.attention_grads), a single-pass one (beside the float32 dq it adds into)."""
  return base.op is Ops.ASSIGN or (base.op is Ops.ATTENTION_DKDV and (base.arg[2] or base.arg[3]))


def _give_buffer(base: LazyBuffer) -> None:
  if base.realized is not None: return
  if base.op is Ops.ASSIGN:
    base.realized = base.srcs[1].base.realized  # an assign writes into its target's memory
  elif writes_into_a_source(base):   # a packed or single-pass dK/dV op: the dQ op's buffer (given first: its source)
    _give_buffer(base.srcs[5].base)
    base.realized = base.srcs[5].base.realized
  else:
    base.realized = Buffer(base.device, base.size, base.dtype)


def _choose_realizes(bases: list[LazyBuffer], outs: Sequence[LazyBuffer]) -> Realizations:
  """The bases that get their own buffer before any kernel is built (by id), each with the reason: the rules that
  need no kernel walk. `_settle_fusion_groups` adds those that come out of walking each kernel's fused region."""
  realizes: Realizations = {id(out.base): "an output of this realize" for out in outs if out.base.realized is None}
  users: dict[int, set[int]] = defaultdict(set)   # base id -> ids of the distinct bases that read it
  for base in bases:
    if base.op in ALWAYS_REALIZED_OPS: realizes.setdefault(id(base), f"a {base.op.name} always has its own buffer")
    if base.forced_realize: realizes.setdefault(id(base), "realize()/contiguous() asked for it")
    for src in base.srcs:
      users[id(src.base)].add(id(base))
      if base.op is Ops.COPY: realizes.setdefault(id(src.base), "the source of a device copy")
      if base.op is Ops.ASSIGN and src is base.srcs[1]: realizes.setdefault(id(src.base), "the target of an assign")
      if base.op in ATTENTION_OPS:   # its kernel reads each operand through its strides (codegen/attention.py)
        realizes.setdefault(id(src.base), "an operand of a fused attention (read in place)")
      if base.op is Ops.GATHER and src is base.srcs[0]:  # loaded at computed offsets
        realizes.setdefault(id(src.base), "the table of a gather (read at computed offsets)")
      if any(view.mask is not None for view in src.st.views) and _has_unsafe_pad_op(src.base):
        realizes.setdefault(id(src.base), "read through a pad, and computes an op with f(0) != 0")
      if _recomputation_is_costly(src, realizes):
        stored = _narrower_source(src.base)
        realizes.setdefault(id(stored), f"recomputation: read {src.st.size // max(src.base.size, 1)}x per element "
                                        f"and costs >= {RECOMPUTE_COST_LIMIT} ops per element"
                                        + (f" (stored as {stored.dtype.name}, before the cast to "
                                           f"{src.base.dtype.name})" if stored is not src.base else ""))
  by_id = {id(base): base for base in bases}

  def kernel_of(base_id: int) -> int:
    """The base whose kernel `base_id` fuses into, following single-user elementwise chains forward."""
    while (base_id not in realizes and len(users[base_id]) == 1 and by_id[base_id].op in ELEMENTWISE_OPS):
      base_id = next(iter(users[base_id]))
    return base_id

  for base in bases:
    # a reduce read by users that end up in different kernels would be recomputed by each: compute it once
    if base.op in REDUCE_OPS and len(users[id(base)]) > 1:
      if len({kernel_of(user) for user in users[id(base)]}) > 1:
        realizes.setdefault(id(base), "a reduce read by several kernels: computed once, not once per kernel")
    elif base.op in REDUCE_OPS and id(base) not in realizes:
      # the same through a chain of single-reader casts (autocast's weight gradient: a SUM cast to bf16 and back to
      # float32, which the optimizer's m, v and update kernels read): store the chain's end once
      end = id(base)
      while len(users[end]) == 1:
        reader = next(iter(users[end]))
        if reader in realizes or by_id[reader].op is not Ops.CAST: break   # row kernels fuse other chains on purpose
        end = reader
      if end != id(base) and end not in realizes and len({kernel_of(user) for user in users[end]}) > 1:
        stored = _narrower_source(by_id[end])
        realizes.setdefault(id(stored), "a cast of a reduce read by several kernels: the reduce computed once, not "
                                        "once per kernel")
  _store_or_recompute(bases, realizes, users, kernel_of, by_id)
  if KERNEL_OPS_LIMIT.value > 0: _bound_kernel_sizes(bases, realizes, int(KERNEL_OPS_LIMIT.value))
  return realizes


# ---------------------------------------------------------------- fusion groups

def _settle_fusion_groups(bases: list[LazyBuffer], realizes: Realizations) -> None:
  """Walk the fused region of every kernel (each realized base) as `_KernelBuilder` will, and realize what cannot
  join it: a second reduce, a reduce inside a reduce, a reduce read out of its element order, the value of an
  assign that reads its target elsewhere. Realizing one base only shrinks the regions of kernels already walked
  (it becomes a load there), so each refusal re-walks just the kernel that refused and the new one."""
  pending = [base for base in bases if id(base) in realizes]
  while pending:
    root = pending.pop()
    refused, _ = walk_kernel(root, realizes, sibling_limit)
    if refused is None: continue
    base, reason = refused
    realizes[id(base)] = reason
    pending.extend([root, base])


# ---------------------------------------------------------------- reads before writes

def _order_reads_before_writes(bases: list[LazyBuffer], realizes: Realizations) -> list[LazyBuffer]:
  """`bases`, changed where its kernels have no run order: a kernel that reads a buffer's old contents must run
  before an assign overwrites it, and one that reads the new contents after it. Two parameters whose updates
  each read the other's old value (`(x * w).sum()`, an optimizer step) would wait on each other. Each such cycle
  is broken here, so users never order realizes by hand:
  - an assign on a cycle gets its value computed in a kernel of its own first (it reads the old contents of
    everything it needs before any write), and then only copies it in;
  - where that is not enough (a kernel reads both the old and the new contents of a buffer), the old contents it
    reads are snapshotted: a copy kernel before the assign, which the kernel reads instead.
  Returns the bases, snapshots included, in graph order; `realizes` and buffers are updated."""
  for _ in range(4 * len(bases) + 8):   # each round realizes a value or adds a snapshot: it ends
    cycle = _items_on_cycles(bases, realizes)
    if not cycle: return bases
    values = [base.srcs[0].base for base in cycle if base.op is Ops.ASSIGN]
    values = [value for value in values if value.realized is None and id(value) not in realizes and
              value.op is not Ops.CONST]
    for value in values: realizes[id(value)] = "the value of an assign that must read before other writes (a cycle)"
    if not values: bases = _snapshot_old_read(bases, realizes, cycle)
    _settle_fusion_groups(bases, realizes)
    for base in bases:
      if id(base) in realizes: _give_buffer(base)
  return bases   # order_items says what is left


def _item_reads(base: LazyBuffer, realizes: Realizations) -> list[LazyBuffer]:
  """The realized bases the item computing `base` reads (as the kernel builder will load them)."""
  if base.op is Ops.COPY: return [base.srcs[0].base]
  _, plan = walk_kernel(base, realizes, sibling_limit)
  return [loaded for loaded, _ in plan.loads] if plan is not None else []


def _items_on_cycles(bases: list[LazyBuffer], realizes: Realizations) -> list[LazyBuffer]:
  """The realized bases whose items lie on a cycle of run-order constraints (one item per base, as before
  grouping: grouping splits its own cycles, engine/multi_output.py)."""
  scheduled = [base for base in bases if id(base) in realizes]
  groups = {id(base): [base] for base in scheduled}
  reads = {id(base): _item_reads(base, realizes) for base in scheduled}
  on_cycles = items_on_cycles(item_precedence(scheduled, groups, reads))
  return [base for base in scheduled if id(base) in on_cycles]


def _snapshot_old_read(bases: list[LazyBuffer], realizes: Realizations,
                       cycle: list[LazyBuffer]) -> list[LazyBuffer]:
  """One kernel of `cycle` that reads a buffer's contents from before a write on the cycle reads a copy of them
  instead (a CONTIGUOUS base made before the write). Returns the bases with the copy."""
  writers: dict[int, list[LazyBuffer]] = defaultdict(list)   # id(Buffer) -> assigns on the cycle writing it
  for base in cycle:
    if base.op is Ops.ASSIGN: writers[id(base.realized)].append(base)
  for reader in cycle:
    for loaded in _item_reads(reader, realizes):
      later = [writer for writer in writers.get(id(loaded.realized), [])
               if writer is not reader and write_version(writer) > write_version(loaded)]
      if not later: continue
      copy = LazyBuffer.create_base(loaded.device, loaded.shape, loaded.dtype, Ops.CONTIGUOUS, None, (loaded,))
      if not _redirect_reads(reader, loaded, copy, realizes): continue
      realizes[id(copy)] = "a snapshot: a kernel reads this buffer both before and after an assign to it"
      _give_buffer(copy)
      # right after what it copies: the redirected reads may sit in fused graphs that other kernels, earlier in
      # graph order than `reader`, share
      at = next((index + 1 for index, base in enumerate(bases) if base is loaded), 0)
      return bases[:at] + [copy] + bases[at:]
  raise RuntimeError("this graph reads a buffer both before and after an assign to it, and no snapshot breaks "
                     "the cycle; please report it")


def _redirect_reads(root: LazyBuffer, old: LazyBuffer, copy: LazyBuffer, realizes: Realizations) -> bool:
  """Make the kernel computing `root` read `copy` (through the same views) wherever its fused region reads `old`'s
  values (an assign's target is where it writes, not a read). Returns whether it read `old` at all."""
  found, stack, seen = False, [root], set()
  while stack:
    node = stack.pop()
    if id(node) in seen: continue
    seen.add(id(node))
    value_count = 1 if node.op in (Ops.ASSIGN, Ops.CONTIGUOUS) else len(node.srcs)
    new_srcs = list(node.srcs)
    for index, src in enumerate(node.srcs[:value_count]):
      if src.base is old:
        new_srcs[index], found = copy.view(src.st), True
      elif src.base.realized is None and id(src.base) not in realizes:
        stack.append(src.base)
    node.srcs = tuple(new_srcs)
  return found


def _print_realize_reasons(bases: list[LazyBuffer], realizes: Realizations) -> None:
  """DEBUG=3: for each realized base, why it is not fused into its consumers."""
  for base in bases:
    if id(base) in realizes: print(f"realize {base.op.name:<10} {str(base.shape):<20} {realizes[id(base)]}")


# ---------------------------------------------------------------- bounded kernels

FUSABLE_OPS = ELEMENTWISE_OPS | REDUCE_OPS


def _fused_srcs(base: LazyBuffer, realizes: Realizations) -> list[LazyBuffer]:
  """The distinct source bases that would be computed inside `base`'s kernel."""
  srcs: dict[int, LazyBuffer] = {}
  for src in base.srcs:
    src_base = src.base
    if src_base.realized is None and id(src_base) not in realizes and src_base.op in FUSABLE_OPS:
      srcs[id(src_base)] = src_base
  return list(srcs.values())


def _count_fused_ops(base: LazyBuffer, realizes: Realizations, limit: int) -> int:
  """The number of distinct ops `base`'s kernel computes (each shared sub-graph once), counting up to limit+1."""
  stack, seen = [base], {id(base)}
  while stack and len(seen) <= limit:
    for src in _fused_srcs(stack.pop(), realizes):
      if id(src) not in seen:
        seen.add(id(src))
        stack.append(src)
  return len(seen)


def _bound_kernel_sizes(bases: list[LazyBuffer], realizes: Realizations, limit: int) -> None:
  """Realize intermediates so that no kernel fuses more than `limit` ops. A C compiler's time grows faster than
  linearly with a function's size (gcc -O2 on one basic block of 20,000 float ops: minutes), so one huge fused
  kernel stalls the first call; kernels of at most `limit` ops keep compile time linear in the graph's size.

  `bases` is in graph order (sources first). A base's size is 1 + its fused sources' sizes: an upper bound (a
  shared sub-graph counts once per path), made exact by a bounded walk when it passes the limit. While it is over
  the limit, the largest fused source is realized: its kernel is at most `limit` ops and it becomes a load here."""
  sizes: dict[int, int] = {}
  for base in bases:
    if base.realized is not None or base.op not in FUSABLE_OPS: continue
    srcs = _fused_srcs(base, realizes)
    size = 1 + sum(sizes.get(id(src), 1) for src in srcs)
    if size > limit: size = _count_fused_ops(base, realizes, limit)
    while size > limit and srcs:
      largest = max(srcs, key=lambda src: sizes.get(id(src), 1))
      realizes.setdefault(id(largest), f"KERNEL_OPS_LIMIT: its consumer's kernel passed {limit} ops")
      srcs = _fused_srcs(base, realizes)
      size = _count_fused_ops(base, realizes, limit)
    sizes[id(base)] = size


# An elementwise graph read through a view that visits each element several times (a broadcast into a matmul, the
# windows of a convolution's weight gradient) would be recomputed at every visit if fused. Up to this cost per
# element (transcendental ops weigh 4, others 1) recomputing is cheaper than a round trip through memory. Only the
# ops computed per element of the graph count: an op it reads through a broadcast (the reciprocal of a scalar count,
# a per-row statistic) has one value per many elements.
RECOMPUTE_COST_LIMIT = 4
REGISTER_ROW_VISITS = 8   # codegen/row_blocks.py MAX_STACKED_ROWS; the heuristic's upcasts of a thin product
TRANSCENDENTAL_OPS = frozenset({Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.SQRT, Ops.RECIP})


def _recomputation_is_costly(src: LazyBuffer, realizes: Realizations) -> bool:
  """Whether the view `src` reads its (unrealized, elementwise) base's elements at least twice each on average,
  and the base's fused graph costs too much to compute again at every read: the ops computed per element of `base`,
  those reached without crossing a broadcast (RECOMPUTE_COST_LIMIT)."""
  base = src.base
  if base.realized is not None or base.op not in ELEMENTWISE_OPS or src.st.size < 2 * base.size: return False
  # read at most REGISTER_ROW_VISITS times (a thin product's rows: a batched decode step's sequences), each element
  # is computed once per register tile (the codegen upcasts or stacks those rows): nothing to save by storing it
  if src.st.size <= REGISTER_ROW_VISITS * base.size: return False
  if _is_per_row_value(base): return False
  cost, stack, seen = 0, [base], set()
  while stack and cost < RECOMPUTE_COST_LIMIT:
    node = stack.pop()
    # a base that will be stored (realize()/contiguous(), or chosen already) is loaded, not recomputed
    stored = node.realized is not None or node.forced_realize or (node is not base and id(node) in realizes)
    if id(node) in seen or stored or node.op not in ELEMENTWISE_OPS: continue
    seen.add(id(node))
    cost += 4 if node.op in TRANSCENDENTAL_OPS else 1
    stack.extend(read.base for read in node.srcs if not _broadcasts(read))
  return cost >= RECOMPUTE_COST_LIMIT


def _broadcasts(view: LazyBuffer) -> bool:
  """Whether `view` reads each element of its base at least twice on average (an expand of a scalar or a row)."""
  return view.st.size >= 2 * view.base.size


def _narrower_source(base: LazyBuffer) -> LazyBuffer:
  """What to store of a costly `base`: the source of a widening float cast (bfloat16 -> float32: autocast's matmul
  operands) when that source is itself computed here, else `base`. The narrow values are half the bytes, the cast is
  one op in each reader, and a matmul reading a cast load stays tensor-core shaped."""
  if base.op is not Ops.CAST: return base
  source = base.srcs[0]
  widening = source.dtype.is_float and base.dtype.is_float and source.dtype.itemsize < base.dtype.itemsize
  # the source may be a plain reshape of its base (a (B, T, C) activation read as (B*T, C)): the base holds its values
  reshaped = source.reads_whole_base
  stored = source.base
  if not widening or not reshaped or stored.realized is not None or stored.op not in ELEMENTWISE_OPS: return base
  return stored


def _has_unsafe_pad_op(base: LazyBuffer) -> bool:
  """Whether the fused graph computing `base` (up to realized bases and reduces) holds an op with f(0) != 0."""
  stack, seen = [base], set()
  while stack:
    node = stack.pop()
    if id(node) in seen or node.realized is not None or node.op not in ELEMENTWISE_OPS: continue
    seen.add(id(node))
    if node.op in UNSAFE_PAD_OPS: return True
    stack.extend(src.base for src in node.srcs)
  return False


def _schedule_base(base: LazyBuffer, realizes: Realizations) -> tuple[ScheduleItem, list[LazyBuffer]]:
  """The ScheduleItem computing one realized base, and the realized bases it reads."""
  assert base.realized is not None
  if base.op is Ops.COPY:
    source = base.srcs[0].base
    source_buffer = source.realized
    assert source_buffer is not None
    span = base.srcs[0].base_range()
    if span is not None and span != (0, source.size):
      # a view of a DISK file that is one contiguous byte range of it (LazyBuffer.copy_to_device copies such views
      # as they are): the copy reads a buffer view of just that range, not the whole file
      first, count = span
      source_buffer = Device[source.device].buffer_view(source_buffer, first * source.dtype.itemsize, count,
                                                        source.dtype)
    item = ScheduleItem(LazyOp(Ops.COPY, (), base.realized.nbytes, base.dtype), (base.realized,), (source_buffer,))
    return item, [source]
  if base.op is Ops.INDEX_ACCUMULATE: return _schedule_index_accumulate(base, realizes)
  if base.op in ATTENTION_OPS: return _schedule_attention(base, realizes)
  builder = _KernelBuilder(base, realizes, outputs=(base.realized,))
  if base.op in (Ops.CONTIGUOUS, Ops.ASSIGN):
    value = builder.build(base.srcs[0].base, base.srcs[0].st)
  else:
    value = builder.build_root()
  out_st = builder.fit_to_reduce(ShapeTracker.from_shape(base.shape))
  value = builder.reshape_post_reduce(value)
  if base.op is Ops.ASSIGN: builder.check_assign_hazard(value, base.srcs[0].base)
  store = LazyOp(Ops.STORE, (value,), MemBuffer(0, base.dtype, out_st), base.dtype)
  if len(builder.reduces) > 1 and not _is_row_kernel(base, realizes):
    # sibling reduces (walk_kernel) are a SINK of stores, as a multi-output kernel of them is: codegen tells them
    # from a row kernel's reduces, which one STORE holds (Kernel.sibling_reduces)
    store = LazyOp(Ops.SINK, (store,), None, base.dtype)
  return ScheduleItem(store, (base.realized,), tuple(builder.inputs)), builder.loaded_bases


def _schedule_index_accumulate(base: LazyBuffer, realizes: Realizations) -> tuple[ScheduleItem, list[LazyBuffer]]:
  """The kernel of an indexed accumulate: STORE(INDEX_ACCUMULATE(start, index, rows)), each source's fused
  elementwise graph in its own shape (walk_kernel realized any reduce under them); codegen/index_accumulate.py."""
  assert base.realized is not None
  builder = _KernelBuilder(base, realizes, outputs=(base.realized,))
  values = tuple(builder.build(src.base, src.st) for src in base.srcs)
  value = LazyOp(Ops.INDEX_ACCUMULATE, values, None, base.dtype)
  store = LazyOp(Ops.STORE, (value,), MemBuffer(0, base.dtype, ShapeTracker.from_shape(base.shape)), base.dtype)
  return ScheduleItem(store, (base.realized,), tuple(builder.inputs)), builder.loaded_bases


def _schedule_attention(base: LazyBuffer, realizes: Realizations) -> tuple[ScheduleItem, list[LazyBuffer]]:
  """The kernel of a fused attention or of its backward: STORE(OP(LOAD ...)), e.g. STORE(ATTENTION(LOAD q, LOAD k,
  LOAD v)), each operand realized and read through its view (codegen/attention.py, codegen/attention_grad.py)."""
  assert base.realized is not None
  builder = _KernelBuilder(base, realizes, outputs=(base.realized,))
  loads = tuple(builder.build(src.base, src.st) for src in base.srcs)
  value = LazyOp(base.op, loads, base.arg, base.dtype)
  store = LazyOp(Ops.STORE, (value,), MemBuffer(0, base.dtype, ShapeTracker.from_shape(base.shape)), base.dtype)
  return ScheduleItem(store, (base.realized,), tuple(builder.inputs)), builder.loaded_bases


def _is_row_kernel(base: LazyBuffer, realizes: Realizations) -> bool:
  _, plan = walk_kernel(base, realizes, sibling_limit)
  return plan is not None and plan.row_kernel


def _schedule_group(group: list[LazyBuffer], realizes: Realizations) -> tuple[ScheduleItem, list[LazyBuffer]]:
  """One kernel writing every base of `group` (elementwise, one shape): a SINK of one STORE per base, output i in
  argument i. A member read in place by a later member is that member's value, not a load (group_outputs)."""
  builder = _KernelBuilder(group[0], realizes, output_count=len(group),
                           outputs=tuple(base.realized for base in group))
  stores = []
  for number, base in enumerate(group):
    assert base.realized is not None
    builder.root = base
    value = builder.build(*kernel_value(base))   # group_outputs took only bases with a kernel walk
    builder.member_values[id(base)] = value
    # sibling reduces (elementwise work on them after them, if any): every output is stored in the reduces' shape
    out_st = builder.fit_to_reduce(ShapeTracker.from_shape(base.shape))
    stores.append(LazyOp(Ops.STORE, (builder.reshape_post_reduce(value),), MemBuffer(number, base.dtype, out_st),
                         base.dtype))
  outputs = tuple(base.realized for base in group)
  return ScheduleItem(LazyOp(Ops.SINK, tuple(stores), None, group[0].dtype), outputs, tuple(builder.inputs)), \
      builder.loaded_bases


def _identity_operand(op: Ops, srcs: tuple[LazyOp, ...], dtype: DType) -> LazyOp | None:
  """The operand of `x * 1` or `x + (-0.0)` (0 for integers) in a kernel's AST, which computes x; likewise x of an
  identity cast and of a lossless round trip x.cast(wider).cast(x.dtype) (lazy_value.py). lazy.py keeps these ops as
  bases where x is a stored tensor (the result is a new tensor, which a later write into x must not change:
  engine/snapshot.py protects it as a reader); inside a kernel they are x itself."""
  if op is Ops.CAST and len(srcs) == 1:   # (not where the cast is what rounds a value held wider: is_exact_node)
    inner = srcs[0]
    if inner.dtype == dtype: return inner if is_exact_node(inner) else None
    if inner.op is Ops.CAST and inner.srcs[0].dtype == dtype and is_lossless_round_trip(dtype, inner.dtype) and \
        is_exact_node(inner.srcs[0]):
      return inner.srcs[0]
    return None
  if op not in (Ops.MUL, Ops.ADD) or len(srcs) != 2: return None
  for operand, other in ((srcs[0], srcs[1]), (srcs[1], srcs[0])):
    if other.op is not Ops.CONST or operand.dtype != dtype or other.dtype != dtype: continue
    if any(view.mask is not None for view in other.arg.st.views): continue   # 0 in its padded places
    if is_identity_constant(op, other.arg.val, dtype): return operand
  return None


class _KernelBuilder:
  """Builds the AST of the kernel that computes `root`, inlining every base that is not realized."""

  def __init__(self, root: LazyBuffer, realizes: Realizations, output_count: int = 1,
               outputs: tuple[Buffer | None, ...] = ()):
    self.root, self.realizes = root, realizes
    self.output_count = output_count   # arguments 0 .. output_count-1 are the outputs, inputs follow
    self.outputs = outputs
    self.member_values: dict[int, LazyOp] = {}   # id of an output base already built in this kernel -> its value
    self.inputs: list[Buffer] = []
    self.loaded_bases: list[LazyBuffer] = []
    self.reduces: dict[int, LazyOp] = {}   # id(reduce base) -> its node; several in a row kernel
    self.reduce_shape: tuple[int, ...] | None = None   # the reduces' output shape, if the kernel has a reduce
    self.loop_shape: tuple[int, ...] | None = None     # the reduces' input shape: the kernel loops in it
    self.cache: dict[tuple[int, ShapeTracker], LazyOp] = {}
    self.reduce_base: LazyBuffer | None = None
    # reduces of a row kernel's per-row results to one value (kernel_walk.final_reduces): they reduce every axis of
    # the loop shape, after its rows
    self.final_ids: set[int] = {id(final) for final in final_reduces(root, realizes)} if output_count == 1 else set()
    # element reduces (kernel_walk.element_reduce_refusal): built in the row loop shape plus their own axes at the end
    self._element_ids: set[int] | None = None
    self.element_axes = 0   # how many axes the element reduces add after the row loop shape (0: none)

  def buffer_index(self, buffer: Buffer) -> int:
    """Kernel argument number of an input buffer (0 is the output). An input that is also an output (an assign's
    target read in place) is read through the output's argument: one buffer passed as two `restrict` pointers, one
    written, lets the compiler reorder the accesses (gcc 12's SLP vectorizer then reads elements already written)."""
    for index, output in enumerate(self.outputs):
      if output is buffer: return index
    for index, known in enumerate(self.inputs):
      if known is buffer: return index + self.output_count
    self.inputs.append(buffer)
    return len(self.inputs) - 1 + self.output_count

  def build(self, base: LazyBuffer, st: ShapeTracker) -> LazyOp:
    """The AST reading `base` through `st` (st maps kernel coordinates to base coordinates).

    An explicit-stack walk (fused chains can be thousands of ops deep): each (base, view) pair is visited once to
    push its sources, and once more to build its node from theirs."""
    stack: list[tuple[LazyBuffer, ShapeTracker, bool, bool]] = [(base, st, False, False)]
    while stack:
      node, view, under_reduce, sources_done = stack.pop()
      if not sources_done: view = view.simplify()
      key = (id(node), view)
      if key in self.cache: continue
      if sources_done:
        self.cache[key] = self._node(node, view)
        continue
      leaf = self._leaf(node, view)
      if leaf is not None:
        self.cache[key] = leaf
        continue
      stack.append((node, view, under_reduce, True))
      if node.op in REDUCE_OPS and under_reduce and id(node) in self.element_ids():
        stack.append((node.srcs[0].base, node.srcs[0].st + self._element_view(node, view), True, False))
      elif node.op in REDUCE_OPS:
        self._claim_reduce(node, view, under_reduce)
        stack.append((node.srcs[0].base, node.srcs[0].st, True, False))
      elif node.op in ELEMENTWISE_OPS:
        stack.extend((src.base, src.st + view, under_reduce, False) for src in node.srcs)
      elif node.op is Ops.GATHER:  # only the index is computed here; the table is a realized buffer
        index = node.srcs[1]
        stack.append((index.base, index.st + view, under_reduce, False))
      else:
        raise AssertionError(f"cannot fuse a {node.op} base")
    return self.cache[(id(base), st.simplify())]

  def element_ids(self) -> set[int]:
    """The ids of the kernel's element reduces (walked once, when a reduce is first met inside another)."""
    if self._element_ids is None:
      renderer = Device[self.root.device].renderer
      if not (renderer.has_threads and renderer.has_local):   # element reduces need local memory (kernel_walk)
        self._element_ids = set()
        return self._element_ids
      _, plan = walk_kernel(self.root, self.realizes, sibling_limit)
      self._element_ids = {id(reduce) for reduce in plan.element_reduces} if plan is not None else set()
    return self._element_ids

  def _element_view(self, reduce: LazyBuffer, view: ShapeTracker) -> ShapeTracker:
    """The view of element reduce `reduce`'s input in the row loop shape followed by its reduced axes, from `view`
    (one view of its result in the row loop shape): its reduced axes are its input's trailing ones, so an element
    of the result at flat position r covers the input's positions r * length .. r * length + length - 1."""
    outer = view.views[0]
    inner_shape = tuple(reduce.srcs[0].shape[axis] for axis in reduce.arg)
    length = prod(inner_shape)
    inner_strides = ShapeTracker.from_shape(inner_shape).views[0].strides
    mask = None if outer.mask is None else tuple(outer.mask) + tuple((0, size) for size in inner_shape)
    self.element_axes = len(inner_shape)
    return ShapeTracker((View.create(outer.shape + inner_shape, tuple(stride * length for stride in outer.strides)
                                     + inner_strides, outer.offset * length, mask),))

  def _leaf(self, base: LazyBuffer, st: ShapeTracker) -> LazyOp | None:
    """A LOAD of a realized base or a CONST; None for a base this kernel computes."""
    if id(base) in self.member_values and st == ShapeTracker.from_shape(base.shape).simplify():
      return self.member_values[id(base)]   # an output of this kernel read in place: its value
    if base.realized is not None and base is not self.root:
      self.loaded_bases.append(base)
      return LazyOp(Ops.LOAD, (), MemBuffer(self.buffer_index(base.realized), base.dtype, st), base.dtype)
    if base.op is Ops.CONST:
      return LazyOp(Ops.CONST, (), ConstBuffer(base.arg, base.dtype, st), base.dtype)
    return None

  def _claim_reduce(self, base: LazyBuffer, st: ShapeTracker, under_reduce: bool) -> None:
    """Record the kernel's loop shape: a reduce's input shape. `walk_kernel` decided that every reduce met here
    fuses (one reduce read in its own order, or row reduces over one loop shape and axes, docs/fusion.md)."""
    if id(base) in self.final_ids: return   # after the rows, over all of them: not the rows' loop shape
    if self.reduce_base is None:
      self.reduce_base, self.reduce_shape, self.loop_shape = base, base.shape, base.srcs[0].shape
    elif base.srcs[0].shape != self.loop_shape or base.arg != self.reduce_base.arg:
      raise AssertionError(f"_settle_fusion_groups let a {base.op} over other rows {base.shape} into a kernel")

  def _node(self, base: LazyBuffer, st: ShapeTracker) -> LazyOp:
    """The AST node of a fused base, from its sources' nodes (already in the cache)."""
    if base.op in REDUCE_OPS:
      if id(base) in self.reduces: return self.reduces[id(base)]  # read twice (through other views): one node
      src = base.srcs[0]
      if self._element_ids and id(base) in self._element_ids:   # over the axes after the row loop shape
        reduce_input = self.cache[(id(src.base), (src.st + self._element_view(base, st)).simplify())]
        rank = len(st.shape)
        axes = tuple(range(rank, rank + len(base.arg)))
        self.reduces[id(base)] = LazyOp(base.op, (reduce_input,), axes, base.dtype)
        return self.reduces[id(base)]
      reduce_input = self.cache[(id(src.base), src.st.simplify())]
      self.reduces[id(base)] = LazyOp(base.op, (reduce_input,), base.arg, base.dtype)
      return self.reduces[id(base)]
    if base.op is Ops.GATHER: return self._gather(base, st)
    srcs = tuple(self.cache[(id(src.base), (src.st + st).simplify())] for src in base.srcs)
    identity_operand = _identity_operand(base.op, srcs, base.dtype)
    if identity_operand is not None: return identity_operand
    arg = base.arg if base.op not in (Ops.CAST, Ops.BITCAST) else base.dtype
    return LazyOp(base.op, srcs, arg, base.dtype)

  def _gather(self, base: LazyBuffer, st: ShapeTracker) -> LazyOp:
    """A gathered LOAD: row `index` of the (rows, width) table at the column the view gives, where
    offset = index * width (index clamped to 0 when outside [0, rows), where valid is false and the load reads 0)."""
    table, index_src = base.srcs
    rows, width = table.shape
    index = self.cache[(id(index_src.base), (index_src.st + st).simplify())]
    flat = ShapeTracker.from_shape(()).reshape((1,) * len(st.shape)).expand(st.shape)

    def const(value: int) -> LazyOp: return LazyOp(Ops.CONST, (), ConstBuffer(value, index.dtype, flat), index.dtype)
    valid = LazyOp(Ops.AND, (LazyOp(Ops.CMPLT, (const(-1), index), None, dtypes.bool),
                             LazyOp(Ops.CMPLT, (index, const(rows)), None, dtypes.bool)), None, dtypes.bool)
    safe_index = LazyOp(Ops.WHERE, (valid, index, const(0)), None, index.dtype)
    offset = LazyOp(Ops.MUL, (safe_index, const(width)), None, index.dtype)
    # the column: the table seen as (rows of the gather output, width) with row stride 0
    column = (ShapeTracker.from_shape((1, width)).expand(base.shape) + st).simplify()
    self.loaded_bases.append(table.base)
    buffer = MemBuffer(self.buffer_index(table.base.realized), base.dtype, column)
    return LazyOp(Ops.LOAD, (offset, valid), buffer, base.dtype)

  def build_root(self) -> LazyOp:
    identity = ShapeTracker.from_shape(self.root.shape)
    if self.root.op is Ops.CONST:  # a constant the user asked to realize
      return LazyOp(Ops.CONST, (), ConstBuffer(self.root.arg, self.root.dtype, identity), self.root.dtype)
    return self.build(self.root, identity)

  # After building, the nodes outside the reduce still see the kernel in the output shape; the kernel loops
  # in the reduce's shape, so their views are reshaped to it.
  def fit_to_reduce(self, st: ShapeTracker) -> ShapeTracker:
    # a row kernel's per-element views are in the loop shape already (softmax stores per element)
    if self.reduce_shape is None or st.shape in (self.reduce_shape, self.loop_shape): return self._widen(st)
    if self.final_ids and st.size != prod(self.reduce_shape):   # a final reduce's one value
      return st.reshape((1,) * len(self.reduce_shape))
    return self._widen(st.reshape(self.reduce_shape))

  def _widen(self, st: ShapeTracker) -> ShapeTracker:
    """`st` with the element reduces' axes after it, size 1 (unchanged without element reduces)."""
    return st.reshape(st.shape + (1,) * self.element_axes) if self.element_axes else st

  def reshape_post_reduce(self, node: LazyOp) -> LazyOp:
    if self.reduce_shape is None: return node
    reduce_nodes = {id(node) for reduce_id, reduce in self.reduces.items() if reduce_id not in self.final_ids
                    for node in reduce.walk()}
    final_nodes = {id(self.reduces[reduce_id]) for reduce_id in self.final_ids if reduce_id in self.reduces}
    # element reduces' inputs are in the row loop shape and their own axes already; every other view gets those
    # axes as size 1 (one loop shape for the kernel)
    element_nodes = {id(node) for reduce_id in (self._element_ids or ()) if reduce_id in self.reduces
                     for node in self.reduces[reduce_id].srcs[0].walk()}
    rebuilt: dict[int, LazyOp] = {}
    for current in node.walk():
      if id(current) in element_nodes or (id(current) in reduce_nodes and not self.element_axes):
        rebuilt[id(current)] = current   # the reduce and what it reads keep the reduce's input shape
        continue
      if id(current) in reduce_nodes:
        if current.op in (Ops.LOAD, Ops.CONST):
          arg = current.arg
          new_arg = type(arg)(arg.idx if isinstance(arg, MemBuffer) else arg.val, arg.dtype, self._widen(arg.st))
          rebuilt[id(current)] = LazyOp(current.op, tuple(rebuilt[id(src)] for src in current.srcs), new_arg,
                                        current.dtype)
        else:
          rebuilt[id(current)] = LazyOp(current.op, tuple(rebuilt[id(src)] for src in current.srcs), current.arg,
                                        current.dtype)
        continue
      if id(current) in final_nodes:   # a final reduce reduces every axis of the rows' result shape
        axes = tuple(range(len(self.reduce_shape)))
        rebuilt[id(current)] = LazyOp(current.op, (rebuilt[id(current.srcs[0])],), axes, current.dtype)
        continue
      if current.op in (Ops.LOAD, Ops.CONST):
        arg = current.arg
        new_arg = type(arg)(arg.idx if isinstance(arg, MemBuffer) else arg.val, arg.dtype, self.fit_to_reduce(arg.st))
        srcs = tuple(rebuilt[id(src)] for src in current.srcs)  # a gathered LOAD keeps its offset and validity
        rebuilt[id(current)] = LazyOp(current.op, srcs, new_arg, current.dtype)
      else:
        rebuilt[id(current)] = LazyOp(current.op, tuple(rebuilt[id(src)] for src in current.srcs), current.arg,
                                      current.dtype)
    return rebuilt[id(node)]

  def argument(self, index: int) -> Buffer | None:
    """The buffer of kernel argument `index` (the outputs first, then the inputs)."""
    if index < self.output_count: return self.outputs[index] if index < len(self.outputs) else None
    return self.inputs[index - self.output_count]

  def check_assign_hazard(self, value: LazyOp, value_base: LazyBuffer) -> None:
    """An assign reading its own target through another view would read places it already overwrote."""
    target = self.root.realized
    in_place = self.fit_to_reduce(ShapeTracker.from_shape(self.root.shape))
    for leaf in value.leaves():
      if leaf.op is Ops.LOAD and self.argument(leaf.arg.idx) is target and leaf.arg.st.simplify() != in_place:
        if value_base.realized is not None: raise AssertionError("assign hazard on a realized value")
        raise AssertionError("_settle_fusion_groups missed an assign hazard")
