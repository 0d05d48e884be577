"""A schedule cache keyed by the lazy graph's structure: a training step that builds the same graph every time (new
LazyBuffers, new buffers, the same ops, views and dtypes) is scheduled once.

`schedule(outs)` walks the unrealized bases behind `outs` (as the scheduler does) and writes down each base's op,
arg, dtype, device, shape and forced-realize flag, and each source as a reference: another base of the walk by its
position, a realized buffer by its position among the leaves (its device, size and dtype are in the key, its
identity is not), or a constant that is only read by its value, always with the view it is read through. Equal
keys mean the scheduler would make the same decisions and the same kernel ASTs; only the buffers differ. On a hit
the cached items are rebound to this graph's leaf buffers and to fresh buffers for what it realizes, and the bases
are marked realized as create_schedule does; each item keeps its lowering and ExecItem from one replay to the next
(schedule_item.LoweringMemo, engine/realize.py).

A realize whose outputs were made since the last schedule skips the walk: the creation trace (ourgrad/lazy_trace.py)
lists those bases in creation order, and its description (the same facts, written as each base was made) and the
outputs' positions in it are the key (`_traced`, each entry the walk's schedule in the trace's positions:
`_in_trace_terms`).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ourgrad import lazy_trace
from ourgrad.lazy_trace import PLAIN_ARG_TYPES, hashable_arg
from ourgrad.device import Buffer, Device, allocated_buffer, new_buffer
from ourgrad.engine import schedule as scheduler
from ourgrad.engine.schedule import ScheduleItem
from ourgrad.engine.memory import PoolMemory
from ourgrad.engine.schedule_item import LoweringMemo, ReplayedSchedule, replayed_item
from ourgrad.helpers import (ELEMENT_REDUCES, GRAPH, KERNEL_OPS_LIMIT, MAX_PACK_BUFFERS, PACK_KERNELS, RIDE_ALONG,
                             ROW_KERNELS, SPLIT_LAST_BLOCK, EnvSnapshot, env_var, register_cache_clearer, tf32_allowed)
from ourgrad.lazy import LazyBuffer
from ourgrad.ops import CONST, Ops

SCHEDULE_CACHE = env_var("SCHEDULE_CACHE", 1, "0: schedule every realize from scratch (no structural schedule cache)")
SCHEDULE_TRACE = env_var("SCHEDULE_TRACE", 1, "0: the schedule cache keys every realize by walking its graph, not "
                         "by the creation trace (ourgrad/lazy_trace.py)")
CACHE_SIZE = 64  # graphs remembered (least recently used dropped first)
# read at every realize: whether the cache is used (SCHEDULE_CACHE, GRAPH) and the trace (SCHEDULE_TRACE), then the
# settings the scheduler's decisions depend on, which may change at run time (part of the key)
_SETTINGS = EnvSnapshot(SCHEDULE_CACHE, SCHEDULE_TRACE, GRAPH, KERNEL_OPS_LIMIT, PACK_KERNELS, MAX_PACK_BUFFERS,
                        SPLIT_LAST_BLOCK, RIDE_ALONG, ROW_KERNELS, ELEMENT_REDUCES)


@dataclass
class CacheStats:
  hits: int = 0
  misses: int = 0
  traced_hits: int = 0   # hits found by the creation trace (no graph walk), counted in hits too


stats = CacheStats()

class _Key:
  """A graph's structural key with its hash computed once: the key is a large nested tuple, and a hit looks it up
  twice (get, then move_to_end with the stored key object, which compares by identity)."""
  __slots__ = ("tokens", "hash")

  def __init__(self, tokens: tuple, hash_value: int | None = None):
    self.tokens, self.hash = tokens, hash(tokens) if hash_value is None else hash_value

  def __hash__(self) -> int: return self.hash

  def __eq__(self, other: object) -> bool:
    return self is other or (isinstance(other, _Key) and self.hash == other.hash and self.tokens == other.tokens)


@dataclass
class CachedSchedule:
  """A schedule in terms of slots: indices into a replay's buffer pool, which holds this graph's leaf buffers (in
  walk order), then a fresh buffer for each base in `fresh`, then one for each `scratch` entry. Resolved to plain
  indices when recorded, so that a replay indexes one list per buffer."""
  asts: list[Any]
  output_slots: list[tuple[int, ...]]
  input_slots: list[tuple[int, ...]]
  # walked bases realized into a fresh buffer, in pool order: (base, the buffer's device, size and dtype)
  fresh: list[tuple[int, str, int, Any]]
  shared: list[tuple[int, int]]     # (walked base, slot) for an assign: it writes a leaf's or an earlier base's buffer
  cleared: list[int]                # walked bases whose sources create_schedule dropped
  # buffers of bases the scheduler made itself (staged matmul operands, snapshots): (device, size, dtype) each, a
  # fresh buffer at every replay
  scratch: list[tuple[str, int, Any]]
  # per item, its lowering (runner, Variables' values) once the first replay lowered it: later replays skip the
  # compiled-kernel cache (engine/realize.py lower_schedule_item)
  lowerings: list[LoweringMemo] = field(default_factory=list)
  assigns: list[int] = field(default_factory=list)   # walked bases that are ASSIGNs (copy-on-write at each replay)
  key: _Key | None = None           # the key it is stored under
  # per item (ast, output slots, input slots, lowering): what a replay builds each ScheduleItem from, in one tuple
  items: list[tuple[Any, tuple[int, ...], tuple[int, ...], LoweringMemo]] = field(init=False, repr=False)

  # whether a replay is one kernel on fresh buffers and leaves (no assign, no shared or scratch buffer): what
  # _launch_replay launches without a ScheduleItem
  one_kernel: bool = field(init=False, repr=False)
  memory: PoolMemory = field(init=False, repr=False)   # its pool's written slots and recorded memory plans
  # `fresh` and `scratch` as a replay makes their buffers: (walked base, or -1 for a scratch one, the device's
  # allocator, device, size, dtype) each, the allocator looked up once (device.new_buffer)
  new_buffers: tuple[tuple[int, Any, str, int, Any], ...] = field(init=False, repr=False)
  # how _launch_replay builds a one-kernel replay's buffers (_LaunchPlan), made at its first launch; None until then
  launch_plan: _LaunchPlan | None = field(init=False, repr=False, default=None)
  # where engine/realize.py keeps the items' launchers once all were lowered (ReplayedSchedule.launches)
  launches: list[Any] = field(init=False, repr=False, default_factory=lambda: [None])

  def __post_init__(self) -> None:
    if len(self.lowerings) != len(self.asts): self.lowerings = [LoweringMemo() for _ in self.asts]
    self.items = list(zip(self.asts, self.output_slots, self.input_slots, self.lowerings))
    self.memory = PoolMemory(self.output_slots, self.input_slots)
    self.one_kernel = len(self.asts) == 1 and self.asts[0].op is not Ops.COPY and not self.assigns and \
      not self.shared and not self.scratch
    self.new_buffers = tuple((index, Device[device].allocator, device, size, dtype)
                             for index, device, size, dtype in [*self.fresh, *((-1, *spec) for spec in self.scratch)])


_cache: OrderedDict[_Key, CachedSchedule] = OrderedDict()
# the same schedules keyed by creation traces (lazy_trace.py), in the trace's terms (_in_trace_terms)
_traced: OrderedDict[_Key, CachedSchedule] = OrderedDict()
# the entry of _traced that the last traced realize found or stored (checked first: _schedule)
_last_traced: list[CachedSchedule | None] = [None]
# clear_caches() drops the cached schedules too: they keep their kernels' runners and ExecItems (with the buffer handles
# their launchers were bound to), which would otherwise outlive the compiled-kernel cache they came from
register_cache_clearer(_cache.clear)
register_cache_clearer(_traced.clear)
register_cache_clearer(lambda: _last_traced.__setitem__(0, None))


def _structure(outs: Sequence[LazyBuffer]) -> tuple[tuple, list[LazyBuffer], list[Buffer]]:
  """(the graph's structural key, the unrealized bases in walk order, the distinct realized leaf buffers).

  One walk: the bases in lazy.walk_bases' order (sources before users), each one's tokens written when it is placed,
  when every unrealized base it reads has its position already (the graph has no cycles). The key is one flat tuple
  (a nested tuple per base cost a third more to build and hash), unambiguous because each base's tokens have a fixed
  layout: op, arg, dtype, device, shape, forced-realize flag, source count, then per source a reference: a walked
  base's position and the view; -1 - a leaf's position, the view and the leaf's shape (`reference_leaf`); or for a
  constant that is only read (not an output, not forced: the scheduler writes its value into each kernel reading it,
  whichever base object holds it) _INLINE, its value, dtype, device, shape and the view, without walking it as a base.
  Then the outputs' references, then each leaf's device, size, dtype and buffer type."""
  bases: list[LazyBuffer] = []
  position: dict[int, int] = {}
  leaves: list[Buffer] = []
  leaf_position: dict[int, int] = {}
  tokens: list[Any] = []
  append, extend, find = tokens.append, tokens.extend, position.get

  def reference_leaf(lazy: LazyBuffer, base: LazyBuffer) -> None:
    """A source whose base is realized: (-1 - the leaf's position, the view, the leaf's shape); a walked base's is
    (its position, the view): the sign of the first token tells which, so the key stays unambiguous."""
    buffer = base.realized
    leaf = leaf_position.get(id(buffer))
    if leaf is None:
      leaf = leaf_position[id(buffer)] = len(leaves)
      leaves.append(buffer)
    # the scheduler reads a realized base only as memory (its op no longer matters), and its size (copies)
    extend((-1 - leaf, lazy.st, base.shape))

  visited: set[int] = set()
  stack: list[tuple[LazyBuffer, bool]] = [(out if out._base is None else out._base, False) for out in reversed(outs)]
  roots = {id(base) for base, _ in stack}
  while stack:
    base, sources_done = stack.pop()
    if sources_done:
      position[id(base)] = len(bases)
      bases.append(base)
      arg = base.arg
      srcs = base.srcs
      # (most args are None, ints or nonzero floats: no call to hashable_arg)
      extend((base.op, arg if type(arg) in PLAIN_ARG_TYPES or (type(arg) is float and arg) else hashable_arg(arg),
              base.dtype, base.device, base.shape, base.forced_realize, len(srcs)))
      for src in srcs:
        src_base = src if src._base is None else src._base
        walked = find(id(src_base))
        if walked is not None:
          append(walked)
          append(src.st)
        elif src_base.realized is not None: reference_leaf(src, src_base)
        else:   # a constant only read (see the walk below): its value, dtype, device, shape and view, after _INLINE
          arg = src_base.arg
          extend((_INLINE, arg if type(arg) in PLAIN_ARG_TYPES or (type(arg) is float and arg) else hashable_arg(arg),
                  src_base.dtype, src_base.device, src_base.shape, src.st))
      continue
    if id(base) in visited or base.realized is not None: continue
    visited.add(id(base))
    stack.append((base, True))
    for src in reversed(base.srcs):
      src_base = src if src._base is None else src._base
      # a constant only read (not an output, not forced, never stored: the scheduler puts its value into every
      # kernel reading it) is written into its readers' references instead of being walked and placed as a base
      if src_base.op is CONST and src_base.realized is None and not src_base.forced_realize and not src_base.srcs \
          and id(src_base) not in roots:
        continue
      stack.append((src_base, False))
  append(len(outs))
  for out in outs:
    out_base = out if out._base is None else out._base
    walked = find(id(out_base))
    if walked is None: reference_leaf(out, out_base)
    else: extend((walked, out.st))
  append(len(leaves))
  for buffer in leaves: extend((buffer.device, buffer.size, buffer.dtype, type(buffer)))
  return tuple(tokens), bases, leaves


# the first token of an inline constant's reference (a walked base's is its position, a leaf's a negative int)
_INLINE = "inline constant"


# launch_one(lowering, buffers) -> bool: launch a replayed one-kernel schedule's kernel through its lowering on these
# buffers (outputs, then inputs), or refuse (False: then it is scheduled as usual and the caller runs it)
LaunchOne = Callable[[LoweringMemo, list[Buffer]], bool]


def schedule(outs: Sequence[LazyBuffer], launch_one: LaunchOne | None = None) -> list[ScheduleItem]:
  """create_schedule(outs), from the cache where a graph of the same structure was scheduled before: found by the
  creation trace of the graph (lazy_trace.py: no graph walk) where the whole graph was made since the last schedule,
  else by the graph walk (_structure). With `launch_one` (engine/realize.py's, passed by a realize that runs the
  schedule at once), a traced replay of one kernel is launched here and [] returned: no ScheduleItem is made."""
  if len(outs) == 1:   # (most realizes: no list made)
    if (outs[0]._base or outs[0]).realized is not None: return []
  else:
    pending = [out for out in outs if (out._base or out).realized is None]
    if not pending: return []   # nothing to compute: the trace goes on (no base changes)
    # an output realized already adds nothing to the schedule; left in, it is no base of the creation trace, which
    # made a realize of new work beside earlier results (a model realizing its state as it goes) walk its whole graph
    if len(pending) < len(outs): outs = pending
  try:
    return _schedule(outs, launch_one)
  finally:
    # the bases scheduling made (staged operands, snapshots) are no part of what the caller builds next
    lazy_trace.invalidate()


def _schedule(outs: Sequence[LazyBuffer], launch_one: LaunchOne | None) -> list[ScheduleItem]:
  # (the trace is this frame's alone: it holds every base made since the last schedule, and is let go of below before
  # the copy-on-write decisions, which must see only the readers someone else holds)
  # the scheduler's functions are looked up at each call, so tools that wrap them (benchmarks, tests) see misses
  # GRAPH=1 draws each graph as the scheduler walks it, so it schedules every realize from scratch
  settings = _SETTINGS.values()
  if not settings[0] or settings[2]: return scheduler.create_schedule(outs)
  trace = lazy_trace.take()
  tf32 = tf32_allowed()   # (TF32 allowed: matmul operands are staged for the WGMMA plan only then, operand_staging.py)
  trace_tokens = _trace_tokens(trace, outs, (settings, tf32)) if trace is not None and settings[1] else None
  trace_key: _Key | None = None
  if trace_tokens is not None:
    # the schedule the last traced realize found or stored first (a loop realizes one graph again and again): compared
    # in C, no hash and no lookup; equal tokens are equal keys, so it is the entry a lookup would find, and the most
    # recently used of _traced already (each lookup's hit and each insert becomes the last one)
    traced = _last_traced[0]
    if traced is None or traced.key.tokens != trace_tokens:
      # hashed by its length and outputs only (hashing every token calls each view's and dtype's Python __hash__;
      # the settings rarely differ): keys that share those are told apart by comparing their tokens and settings,
      # which a hit does once anyway
      trace_key = _Key(trace_tokens, hash((len(trace_tokens[0]), trace_tokens[1])))
      traced = _traced.get(trace_key)
      if traced is not None:
        _traced.move_to_end(traced.key)
        _last_traced[0] = traced
    if traced is not None:
      stats.hits += 1
      stats.traced_hits += 1
      bases, leaves = trace.bases, trace.leaves
      del trace
      if not traced.assigns:
        if launch_one is not None and traced.one_kernel and _launch_replay(traced, bases, leaves, launch_one): return []
        return _replay(traced, bases, leaves)
      assigns = [(assign, assign.srcs[1]._base or assign.srcs[1]) for assign in map(bases.__getitem__, traced.assigns)]
      items = _replay(traced, bases, leaves)
      del bases, leaves   # (see below)
      return scheduler.protect_and_pack(items, assigns)
  key, bases, leaves = _structure(outs)
  if not bases: return []
  key = _Key((key, settings, tf32))
  cached = _cache.get(key)
  if cached is not None:
    _cache.move_to_end(cached.key)
    stats.hits += 1
    # (before _replay drops sources)
    assigns = [(bases[index], bases[index].srcs[1].base) for index in cached.assigns] if cached.assigns else []
    items = _replay(cached, bases, leaves)
  else:
    stats.misses += 1
    items, assigns = scheduler.build_schedule(outs)
    items = [_with_canonical_ast(item) for item in items]
    cached = _record(items, bases, leaves)
    if cached is not None:
      cached.key = key
      _cache[key] = cached
      if len(_cache) > CACHE_SIZE: _cache.popitem(last=False)
  if trace_key is not None and cached is not None:
    traced = _in_trace_terms(cached, bases, leaves, trace)
    if traced is not None:
      traced.key = trace_key
      _traced[trace_key] = traced
      _last_traced[0] = traced
      if len(_traced) > CACHE_SIZE: _traced.popitem(last=False)   # (the least recently used: not the last one)
  # copy-on-write for lazy readers of an assigned buffer is decided on every call, hit or miss, and only after this
  # frame lets go of the walked graph (and of the trace, which holds every base made since the last schedule): only
  # readers someone else still holds may need the old contents
  del bases, leaves, trace
  return scheduler.protect_and_pack(items, assigns) if assigns else items


def _trace_tokens(trace: lazy_trace.Trace, outs: Sequence[LazyBuffer], settings: tuple) -> tuple | None:
  """The key tokens of realizing `outs` from the creation trace: the trace's description (lazy_trace.describe),
  each output's position there and view, and `settings` (what else the scheduler's decisions read); None when an
  output is not an unrealized base of the trace (a constant, made before it) or the trace is inconsistent."""
  references: list[Any] = []
  bases = trace.bases
  count = len(bases)
  if not count: return None
  for out in outs:
    base = out._base or out
    # (Trace.position without the call: a base of this trace is at its position; an index is -1 or a position, and
    # -1 reads the last base, which holds its own position: a trace's bases are appended at their positions by the
    # one thread that owns it, lazy_trace.py)
    index = base._trace_index
    if index >= count or bases[index] is not base or base.realized is not None: return None
    references += (index, out.st)
  tokens = lazy_trace.describe(trace)
  return None if tokens is None else (tokens, tuple(references), settings)


def _in_trace_terms(cached: CachedSchedule, bases: list[LazyBuffer], leaves: list[Buffer],
                    trace: lazy_trace.Trace) -> CachedSchedule | None:
  """`cached` (in the terms of the walk that found `bases` and `leaves`) with its bases as positions in `trace` and
  its slots in a pool of the trace's leaves (all it read, in first-read order), then the same fresh and scratch
  buffers; its items keep the same lowerings. None if a walked base or leaf is not in the trace."""
  position = [trace.position(base) for base in bases]
  leaf_position = [trace.leaf_index.get(buffer, -1) for buffer in leaves]
  if -1 in position or -1 in leaf_position: return None
  walk_leaves, trace_leaves = len(leaves), len(trace.leaves)

  def slot(walk_slot: int) -> int:
    return leaf_position[walk_slot] if walk_slot < walk_leaves else walk_slot - walk_leaves + trace_leaves
  return CachedSchedule(cached.asts, [tuple(map(slot, slots)) for slots in cached.output_slots],
                        [tuple(map(slot, slots)) for slots in cached.input_slots],
                        [(position[index], device, size, dtype) for index, device, size, dtype in cached.fresh],
                        [(position[index], slot(walk_slot)) for index, walk_slot in cached.shared],
                        [position[index] for index in cached.cleared], cached.scratch, cached.lowerings,
                        [position[index] for index in cached.assigns])


# One object for each distinct kernel AST seen here: the compiled-kernel cache (realize.get_runner) is keyed by ASTs,
# and a lookup with the very object that was stored skips comparing two equal trees node by node.
_canonical_asts: dict[Any, Any] = {}


def _with_canonical_ast(item: ScheduleItem) -> ScheduleItem:
  canonical = _canonical_asts.setdefault(item.ast, item.ast)
  if len(_canonical_asts) > 16 * CACHE_SIZE: _canonical_asts.clear()  # bounded: kernels outlive few graphs
  return item if canonical is item.ast else ScheduleItem(canonical, item.outputs, item.inputs)


def _record(items: list[ScheduleItem], bases: list[LazyBuffer], leaves: list[Buffer]) -> CachedSchedule | None:
  """The schedule in terms of slots (CachedSchedule); None if an item reads a buffer that is neither a leaf, a walked
  base's nor one an earlier item wrote (a window of a DISK file), which a replay could not rebuild. A buffer an item
  writes that no walked base owns (a base the scheduler made: a staged operand, a snapshot) is a scratch slot."""
  slot_of: dict[int, int] = {id(buffer): index for index, buffer in enumerate(leaves)}
  fresh: list[tuple[int, str, int, Any]] = []
  shared: list[tuple[int, int]] = []
  for index, base in enumerate(bases):
    if base.realized is None: continue
    slot = slot_of.get(id(base.realized))
    if slot is None:
      slot_of[id(base.realized)] = len(leaves) + len(fresh)
      fresh.append((index, base.realized.device, base.realized.size, base.realized.dtype))
    elif not scheduler.writes_into_a_source(base): return None
    else: shared.append((index, slot))
  scratch: list[tuple[str, int, Any]] = []
  outputs, inputs = [], []
  for item in items:
    try:
      inputs.append(tuple(slot_of[id(buffer)] for buffer in item.inputs))
    except KeyError:
      return None
    for buffer in item.outputs:
      if id(buffer) not in slot_of and isinstance(buffer, Buffer) and type(buffer) is Buffer:
        slot_of[id(buffer)] = len(leaves) + len(fresh) + len(scratch)
        scratch.append((buffer.device, buffer.size, buffer.dtype))
    try:
      outputs.append(tuple(slot_of[id(buffer)] for buffer in item.outputs))
    except KeyError:
      return None
  cleared = [index for index, base in enumerate(bases) if base.realized is not None and not base.srcs]
  assigns = [index for index, base in enumerate(bases) if base.op is Ops.ASSIGN]
  return CachedSchedule([item.ast for item in items], outputs, inputs, fresh, shared, cleared, scratch,
                        [LoweringMemo() for _ in items], assigns)


@dataclass(frozen=True)
class _LaunchPlan:
  """A one-kernel replay's buffers as _launch_replay builds them: where the kernel writes the fresh buffers in their
  order and reads only leaves (`direct`), the fresh buffers (CachedSchedule.new_buffers, allocated at once), then the
  leaves at `inputs`; else (outputs in another order) the pool _replay builds, indexed by the item's slots."""
  direct: bool
  inputs: tuple[int, ...]


def _launch_plan(cached: CachedSchedule, leaf_count: int) -> _LaunchPlan:
  """The _LaunchPlan of a one-kernel schedule replayed on `leaf_count` leaves (every replay under its key has as many:
  the leaves are part of the key)."""
  _, output_slots, input_slots, _ = cached.items[0]
  direct = output_slots == tuple(range(leaf_count, leaf_count + len(cached.fresh))) and \
    all(slot < leaf_count for slot in input_slots)
  return _LaunchPlan(direct, input_slots)


def _launch_replay(cached: CachedSchedule, bases: list[LazyBuffer], leaves: list[Buffer],
                   launch_one: LaunchOne) -> bool:
  """Replay a one-kernel schedule (CachedSchedule.one_kernel) by launching its kernel on this graph's buffers, as
  _replay and run_schedule would (the same buffers given to the same bases, the same sources dropped), without a
  ScheduleItem or a pool; False where `launch_one` refuses (not lowered yet, a launch that prints or is timed, a JIT
  recording): nothing was launched, and _replay gives the bases other buffers."""
  plan = cached.launch_plan
  if plan is None: plan = cached.launch_plan = _launch_plan(cached, len(leaves))
  buffers = []
  append = buffers.append
  for index, allocator, device, size, dtype in cached.new_buffers:   # (one_kernel: fresh ones only)
    buffer = bases[index].realized = allocated_buffer(allocator, device, size, dtype)
    append(buffer)
  if plan.direct: buffers += map(leaves.__getitem__, plan.inputs)
  else:
    pool = leaves + buffers
    _, output_slots, input_slots, _ = cached.items[0]
    buffers = [*map(pool.__getitem__, output_slots), *map(pool.__getitem__, input_slots)]
  if not launch_one(cached.lowerings[0], buffers): return False
  for index in cached.cleared: bases[index].srcs = ()
  return True


def _replay(cached: CachedSchedule, bases: list[LazyBuffer], leaves: list[Buffer]) -> list[ScheduleItem]:
  pool = list(leaves)
  append = pool.append
  # the fresh buffers, then the scratch ones (no base: -1)
  for index, allocator, device, size, dtype in cached.new_buffers:
    buffer = new_buffer(allocator, device, size, dtype)
    if index >= 0: bases[index].realized = buffer
    append(buffer)
  # an assign writes a leaf's buffer, or the buffer of an earlier assign of this graph (a chain), a packed attention
  # dK/dV op the dQ op's: all in the pool
  if cached.shared:
    for index, slot in cached.shared: bases[index].realized = pool[slot]
  for index in cached.cleared: bases[index].srcs = ()
  take = pool.__getitem__
  # (a list comprehension: a generator would be resumed once per item)
  items = ReplayedSchedule([replayed_item(ast, tuple(map(take, outputs)), tuple(map(take, inputs)), lowering)
                            for ast, outputs, inputs, lowering in cached.items])
  items.pool, items.memory, items.launches = pool, cached.memory, cached.launches
  return items
