"""A schedule cache keyed by the lazy graph's structure: a training step that builds the same graph every time (new
LazyBuffers, new buffers, the same ops, views and dtypes) is scheduled once.

The key is no walk of the graph: each base got its structural key when it was made (ourgrad/lazy_structure.py: its
op, arg, dtype, device, shape and forced-realize flag, each source as the key of the unrealized base it reads or as a
realized leaf buffer numbered by first occurrence, always with the view it is read through), so the key of a realize
is the outputs' keys and views, and its leaves are their leaf buffers. Equal keys mean the same computation from
leaves of the same devices, sizes and dtypes; only the buffers differ. A miss walks the graph once to schedule it and
records, for each base the schedule realizes, a path to it: from an output or from an earlier such base, through
source indices (most are a few steps: a kernel's output reached from a kernel that reads it). On a hit those paths
find this graph's bases (a constant cost per kernel), the cached items are rebound to its leaves and to fresh
buffers, and the bases are marked realized as create_schedule does.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from ourgrad.device import Buffer
from ourgrad.engine import schedule as scheduler
from ourgrad.engine.schedule import ScheduleItem
from ourgrad.helpers import GRAPH, KERNEL_OPS_LIMIT, MAX_PACK_BUFFERS, PACK_KERNELS, env_var, tf32_allowed
from ourgrad.lazy import LazyBuffer
from ourgrad.lazy_structure import StructureKey, forget_readers_of, intern, sources_token
from ourgrad.ops import Ops

SCHEDULE_CACHE = env_var("SCHEDULE_CACHE", 1, "0: schedule every realize from scratch (no structural schedule cache)")
CACHE_SIZE = 64  # graphs remembered (least recently used dropped first)


@dataclass
class CacheStats:
  hits: int = 0
  misses: int = 0
  walks: int = 0    # graph walks (one per miss; a hit walks nothing)


stats = CacheStats()

# a buffer slot of a cached item: ("leaf", index into the leaves) or ("base", index into the found bases)
Slot = tuple[str, int]
# where a base the schedule realizes is: from an earlier found base (anchor >= 0) or from output -1 - anchor, through
# these source indices; and the op it must have there
Path = tuple[int, tuple[int, ...], Ops]
# the lookup key: the outputs' structure and the settings the scheduler's decisions depend on (they may change at run
# time)
Key = tuple[StructureKey, int, int, int, bool]


@dataclass
class CachedSchedule:
  asts: list[Any]
  output_slots: list[tuple[Slot, ...]]
  input_slots: list[tuple[Slot, ...]]
  paths: list[Path]                         # one per base the schedule realizes (found bases, in this order)
  realized: list[tuple[int, Slot | None]]   # found base -> the buffer it shares (an assign) or None (a fresh one)
  cleared: list[int]                        # found bases whose sources create_schedule dropped
  assigns: list[int] = field(default_factory=list)  # the found assigns in the order the scheduler ran them
  # buffers of bases the scheduler made itself (staged matmul operands, snapshots): (device, size, dtype) each, a
  # fresh buffer at every replay ("scratch" slots)
  scratch: list[tuple[str, int, Any]] = field(default_factory=list)


_cache: OrderedDict[Key, CachedSchedule] = OrderedDict()


def schedule(outs: Sequence[LazyBuffer]) -> list[ScheduleItem]:
  """create_schedule(outs), from the cache where a graph of the same structure was scheduled before."""
  # the scheduler's functions are looked up at each call, so tools that wrap them (benchmarks, tests) see misses
  # GRAPH=1 draws each graph as the scheduler walks it, so it schedules every realize from scratch
  if not SCHEDULE_CACHE or GRAPH: return scheduler.create_schedule(outs)
  if all((out if out._base is None else out._base).realized is not None for out in outs): return []
  key, leaves = _graph_key(outs)
  cached = _cache.get(key)
  found = _find(cached, outs) if cached is not None else None
  hit = found is not None
  if cached is not None and found is not None:
    _cache.move_to_end(key)
    stats.hits += 1
    # in the order they run (protect_lazy_readers counts the writes to a buffer), before _replay drops the sources
    assigns = [(found[index], found[index].srcs[1].base) for index in cached.assigns]
    items = _replay(cached, found, leaves)
  else:
    stats.misses += 1
    walked, parents = _walk(outs)
    items, assigns = scheduler.build_schedule(outs)
    items = [_with_canonical_ast(item) for item in items]
    found = [base for base in walked if base.realized is not None]
    entry = _record(items, found, parents, leaves)
    number = {id(base): index for index, base in enumerate(found)}
    if entry is not None and all(id(base) in number for base, _ in assigns):
      entry.assigns = [number[id(base)] for base, _ in assigns]
      _cache[key] = entry
      if len(_cache) > CACHE_SIZE: _cache.popitem(last=False)
    del walked, parents, number
  # copy-on-write for lazy readers of an assigned buffer is decided on every call, hit or miss, and only after this
  # frame lets go of the walked graph: only readers someone else still holds may need the old contents
  del leaves
  if hit:
    # the bases built on what this hit realized key it as a leaf now. After its sources were dropped, so that only the
    # readers someone still holds are left to visit (a miss did this as the scheduler gave each base its buffer)
    for base in found: forget_readers_of(base)
  del found
  return scheduler.protect_and_pack(items, assigns) if assigns else items


def _graph_key(outs: Sequence[LazyBuffer]) -> tuple[Key, tuple]:
  """(the lookup key of realizing `outs`, the leaf buffers they read): no walk, the outputs' bases hold their keys."""
  tokens, leaves = sources_token(outs)
  # (TF32 allowed: matmul operands are staged for the WGMMA plan only then, engine/operand_staging.py)
  settings = (int(KERNEL_OPS_LIMIT), int(PACK_KERNELS), int(MAX_PACK_BUFFERS), tf32_allowed())
  return (intern(("outputs", tokens)), *settings), leaves


def _walk(outs: Sequence[LazyBuffer]) -> tuple[list[LazyBuffer], dict[int, tuple[LazyBuffer | None, int]]]:
  """(the unrealized bases behind `outs` in the order first met, for each (by id) the base it was first met from
  (None: an output) and its source index there (the output's index))."""
  stats.walks += 1
  order: list[LazyBuffer] = []
  parents: dict[int, tuple[LazyBuffer | None, int]] = {}
  stack: list[tuple[LazyBuffer, LazyBuffer | None, int]] = \
      [(out if out._base is None else out._base, None, index) for index, out in reversed(list(enumerate(outs)))]
  while stack:
    base, parent, index = stack.pop()
    if id(base) in parents or base.realized is not None: continue
    parents[id(base)] = (parent, index)
    order.append(base)
    for src_index in range(len(base.srcs) - 1, -1, -1):
      src = base.srcs[src_index]
      stack.append((src if src._base is None else src._base, base, src_index))
  return order, parents


def _paths(found: list[LazyBuffer], parents: dict[int, tuple[LazyBuffer | None, int]]) -> list[Path] | None:
  """Each found base's path from the nearest found base above it on the walk's tree, or from an output. `found` is in
  the walk's order, so each anchor comes before the bases reached from it."""
  number = {id(base): index for index, base in enumerate(found)}
  paths: list[Path] = []
  for base in found:
    steps: list[int] = []
    node: LazyBuffer | None = base
    while True:
      parent, index = parents[id(node)]
      if parent is None:
        anchor = -1 - index
        break
      steps.append(index)
      if id(parent) in number:
        anchor = number[id(parent)]
        break
      node = parent
    if anchor >= 0 and anchor >= len(paths): return None   # (cannot happen: the walk meets an anchor first)
    paths.append((anchor, tuple(reversed(steps)), base.op))
  return paths


def _find(cached: CachedSchedule, outs: Sequence[LazyBuffer]) -> list[LazyBuffer] | None:
  """The bases of this graph that the cached schedule realizes, by its paths; None where a path does not lead to an
  unrealized base of the recorded op (a key made stale by a change it was not told of: scheduled afresh)."""
  found: list[LazyBuffer] = []
  for anchor, steps, op in cached.paths:
    node = outs[-1 - anchor] if anchor < 0 else found[anchor]
    node = node if node._base is None else node._base
    for step in steps:
      srcs = node.srcs
      if step >= len(srcs): return None
      node = srcs[step] if srcs[step]._base is None else srcs[step]._base
    if node.realized is not None or node.op is not op: return None
    found.append(node)
  # a key describes the tree, not which of its unrealized bases are one object: bases the schedule realizes as
  # different buffers must be different bases here too (one base given two buffers would lose one of them)
  if len({id(base) for base in found}) != len(found): return None
  return found


# One object for each distinct kernel AST seen here: the compiled-kernel cache (realize.get_runner) is keyed by ASTs,
# and a lookup with the very object that was stored skips comparing two equal trees node by node.
_canonical_asts: dict[Any, Any] = {}


def _with_canonical_ast(item: ScheduleItem) -> ScheduleItem:
  canonical = _canonical_asts.setdefault(item.ast, item.ast)
  if len(_canonical_asts) > 16 * CACHE_SIZE: _canonical_asts.clear()  # bounded: kernels outlive few graphs
  return item if canonical is item.ast else ScheduleItem(canonical, item.outputs, item.inputs)


def _record(items: list[ScheduleItem], found: list[LazyBuffer], parents: dict[int, tuple[LazyBuffer | None, int]],
            leaves: tuple) -> CachedSchedule | None:
  """The schedule in terms of slots (`found`: the bases it realized, in walk order); None if an item reads a buffer
  that is neither a leaf, a found base's nor one an earlier item wrote (a window of a DISK file), which a replay could
  not rebuild. A buffer an item writes that no found base owns (a base the scheduler made: a staged matmul operand, a
  snapshot) is a scratch slot."""
  paths = _paths(found, parents)
  if paths is None: return None
  slot_of: dict[int, Slot] = {id(buffer): ("leaf", index) for index, buffer in enumerate(leaves)}
  # fresh buffers first: an assign shares a leaf's buffer or that of a non-assign base of this graph (its target)
  for index, base in enumerate(found):
    if base.op is not Ops.ASSIGN and id(base.realized) in slot_of: return None
    if base.op is not Ops.ASSIGN: slot_of[id(base.realized)] = ("base", index)
  realized: list[tuple[int, Slot | None]] = []
  for index, base in enumerate(found):
    if base.op is not Ops.ASSIGN: realized.append((index, None))
    elif id(base.realized) in slot_of: realized.append((index, slot_of[id(base.realized)]))
    else: return None
  scratch: list[tuple[str, int, Any]] = []
  outputs, inputs = [], []
  for item in items:   # in order: an item may read the scratch buffer an earlier one wrote
    try:
      inputs.append(tuple(slot_of[id(buffer)] for buffer in item.inputs))
    except KeyError:
      return None
    for buffer in item.outputs:
      if id(buffer) not in slot_of and type(buffer) is Buffer:
        slot_of[id(buffer)] = ("scratch", len(scratch))
        scratch.append((buffer.device, buffer.size, buffer.dtype))
    try:
      outputs.append(tuple(slot_of[id(buffer)] for buffer in item.outputs))
    except KeyError:
      return None
  cleared = [index for index, base in enumerate(found) if not base.srcs]
  return CachedSchedule([item.ast for item in items], outputs, inputs, paths, realized, cleared, scratch=scratch)


def _replay(cached: CachedSchedule, found: list[LazyBuffer], leaves: tuple) -> list[ScheduleItem]:
  fresh: dict[int, Buffer] = {}
  for index, shared in cached.realized:
    if shared is None:
      base = found[index]
      fresh[index] = base.realized = Buffer(base.device, base.size, base.dtype)
  for index, shared in cached.realized:   # an assign writes a leaf's buffer, or its target's of this graph
    if shared is not None: found[index].realized = leaves[shared[1]] if shared[0] == "leaf" else fresh[shared[1]]

  scratch = [Buffer(device, size, dtype) for device, size, dtype in cached.scratch]

  def buffer(slot: Slot) -> Buffer:
    if slot[0] == "scratch": return scratch[slot[1]]
    return leaves[slot[1]] if slot[0] == "leaf" else fresh[slot[1]]
  items = [ScheduleItem(ast, tuple(buffer(slot) for slot in outputs), tuple(buffer(slot) for slot in inputs))
           for ast, outputs, inputs in zip(cached.asts, cached.output_slots, cached.input_slots)]
  for index in cached.cleared: found[index].srcs = ()
  return items
