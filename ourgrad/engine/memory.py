"""The memory planner: buffers whose lifetimes do not overlap run on the same memory.

A buffer's lifetime, inside one list of items (a schedule, or the items a JIT captured), runs from the first item
that touches it to the last. `plan_memory` knows every lifetime before it assigns memory, so it places the largest
buffers first (greedy by size): each buffer goes into the first backing buffer of its device whose buffers so far all
live at other times (every earlier backing buffer is at least as large), else into a new one of its exact size;
sharing always starts at byte 0. Placed in run order instead (a free list taking the smallest free backing buffer that
fits), a training step's small early buffers would hold large backing buffers at the peak and later large ones need
new ones: GPT-2's step planned 2.2x its live bytes that way, ~1.15x greedy by size. Only buffers the caller says
are internal are planned: never one that is alive outside the items (an output, an input, model state, anything a
Python object still holds).
"""
from __future__ import annotations

import sys
import sysconfig
from sys import getrefcount
from collections import Counter, defaultdict
from typing import Any, Callable, Sequence

from ourgrad.device import Buffer, Device, new_buffer
from ourgrad.dtype import dtypes
from ourgrad.helpers import DEBUG, fmt_size


def plan_memory(buffer_lists: Sequence[Sequence[Buffer]], is_internal: Callable[[Buffer], bool],
                label: str = "schedule") -> dict[Buffer, Buffer]:
  """Give every internal buffer of `buffer_lists` (one list per item, in run order) a backing buffer
  shared with buffers whose lifetimes do not overlap. Returns {buffer: backing}. DEBUG=1 prints planned vs naive
  peak bytes."""
  first_use: dict[Buffer, int] = {}
  last_use: dict[Buffer, int] = {}
  for index, buffers in enumerate(buffer_lists):
    for buffer in buffers:
      if buffer not in first_use:
        if not is_internal(buffer) or not Device[buffer.device].allocator.shares_memory: continue
        first_use[buffer] = index
      last_use[buffer] = index
  if len(first_use) < 2: return {}
  backings: dict[str, list[Buffer]] = defaultdict(list)   # device -> backing buffers, largest first
  occupancy: dict[str, _Occupancy] = {}
  assigned: dict[Buffer, Buffer] = {}
  # largest first; ties in run order, so that a plan depends on the items only
  for buffer in sorted(first_use, key=lambda buffer: (-buffer.nbytes, first_use[buffer])):
    start, end = first_use[buffer], last_use[buffer]
    device_backings = backings[buffer.device]
    if buffer.device not in occupancy: occupancy[buffer.device] = _Occupancy(len(buffer_lists))
    slot = occupancy[buffer.device].place(start, end, len(device_backings))
    if slot == len(device_backings): device_backings.append(Buffer(buffer.device, max(buffer.nbytes, 1), dtypes.uint8))
    assigned[buffer] = device_backings[slot]
  naive = sum(buffer.nbytes for buffer in assigned)
  planned = sum(backing.nbytes for backing in set(assigned.values()))
  # every planned buffer lets its old memory go before any backing is allocated: a JIT re-plans buffers its capture
  # ran on (their contents are dead), and switching them one by one held the old and the new memory at once
  for buffer in assigned: buffer.release_memory()
  for buffer, backing in assigned.items(): buffer.use_memory_of(backing)
  if DEBUG >= 1:
    print(f"memory planner ({label}): {len(assigned)} buffers in {len(set(assigned.values()))} backing buffers, "
          f"{fmt_size(planned)} planned vs {fmt_size(naive)} naive ({planned} vs {naive} bytes)")
  return assigned


class RecordedPlan:
  """What plan_memory decided for one list of items, by buffer ordinal (a buffer's position among the distinct
  buffers of the items, in first-use order): which buffers got which backing, and each backing's device and size.
  The decision depends only on the lifetimes, sizes and devices of the internal buffers, so a list of the same
  structure with the same internal ordinals (a replayed schedule) gets the same plan without planning again."""
  __slots__ = ("assigned", "backings", "naive", "label")

  def __init__(self, assigned: list[tuple[int, int]], backings: list[tuple[str, int, Any]], naive: int, label: str):
    self.assigned, self.backings, self.naive, self.label = assigned, backings, naive, label

  @staticmethod
  def of(ordinal: dict[int, int], assigned: dict[Buffer, Buffer], label: str) -> RecordedPlan:
    """The plan `assigned` (plan_memory's answer) in terms of `ordinal` (id(buffer) -> its ordinal)."""
    slot_of: dict[int, int] = {}
    backings: list[tuple[str, int, Any]] = []   # (device, bytes, the device's allocator) each
    pairs = []
    for buffer, backing in assigned.items():
      if id(backing) not in slot_of:
        slot_of[id(backing)] = len(backings)
        backings.append((backing.device, backing.size, Device[backing.device].allocator))
      pairs.append((ordinal[id(buffer)], slot_of[id(backing)]))
    return RecordedPlan(pairs, backings, sum(buffer.nbytes for buffer in assigned), label)

  def apply(self, buffers: Sequence[Buffer]) -> None:
    """Run the buffers (`buffers[ordinal]`) on fresh backing buffers as recorded, as plan_memory would."""
    uint8 = dtypes.uint8
    backings = [new_buffer(allocator, device, size, uint8) for device, size, allocator in self.backings]
    targets = [buffers[ordinal] for ordinal, _ in self.assigned]
    # (all first, as plan_memory does; a replay's targets hold no memory yet: no call for those)
    for buffer in targets:
      if buffer._handle is not None: buffer.release_memory()
    for buffer, (_, slot) in zip(targets, self.assigned): buffer.use_memory_of(backings[slot])
    if DEBUG >= 1:
      planned = sum(size for _, size, _ in self.backings)
      print(f"memory planner ({self.label}, replayed): {len(targets)} buffers in {len(backings)} backing buffers, "
            f"{fmt_size(planned)} planned vs {fmt_size(self.naive)} naive ({planned} vs {self.naive} bytes)")


class _Occupancy:
  """Which backing buffers (slots, numbered in creation order) are in use at each item: a segment tree over the
  items whose nodes hold bit masks of slots (bit j: slot j). `place` marks a slot busy over an item range, as `tag`s
  on the O(log n) nodes covering it; a node's `busy` is every slot busy anywhere under it. Finding one ORs the busy
  masks of the covering nodes with the tags of their ancestors, so each placement is O(log n)
  (scanning every slot's lifetimes per buffer made planning quadratic: 8.5 ms for a 976-buffer schedule)."""

  def __init__(self, items: int):
    self.leaves = 1 << max(items - 1, 0).bit_length()
    self.tag = [0] * (2 * self.leaves)    # slots busy over the whole range of the node
    self.busy = [0] * (2 * self.leaves)   # slots busy somewhere in the range of the node

  def _covering(self, start: int, end: int) -> list[int]:
    """The nodes whose ranges partition items start..end (inclusive)."""
    nodes, low, high = [], start + self.leaves, end + self.leaves + 1
    while low < high:
      if low & 1:
        nodes.append(low)
        low += 1
      if high & 1:
        high -= 1
        nodes.append(high)
      low, high = low >> 1, high >> 1
    return nodes

  def _ancestors(self, start: int, end: int) -> list[int]:
    """The nodes above the leaves of items `start` and `end`: every ancestor of a covering node is one of them."""
    nodes, low, high = [], (start + self.leaves) >> 1, (end + self.leaves) >> 1
    while low != high:
      nodes += (low, high)
      low, high = low >> 1, high >> 1
    while low:
      nodes.append(low)
      low >>= 1
    return nodes

  def place(self, start: int, end: int, slots: int) -> int:
    """Mark busy over items start..end the lowest-numbered of `slots` slots free over all of them (`slots`, a new
    one, where none is); returns its number."""
    covering, ancestors = self._covering(start, end), self._ancestors(start, end)
    busy = 0
    for node in covering: busy |= self.busy[node]
    for node in ancestors: busy |= self.tag[node]
    free = ~busy & ((1 << slots) - 1)
    slot = (free & -free).bit_length() - 1 if free else slots
    bit = 1 << slot
    for node in covering:
      self.tag[node] |= bit
      self.busy[node] |= bit
    for node in ancestors: self.busy[node] |= bit
    return slot


def _references_beyond_slots(containers: Sequence[Sequence[Any]]) -> dict[int, int]:
  """id -> (reference count - slots of `containers` holding it) for every object in `containers`."""
  slots = Counter(id(value) for values in containers for value in values)
  extra: dict[int, int] = {}
  for values in containers:
    for value in values: extra[id(value)] = sys.getrefcount(value) - slots[id(value)]
  return extra


def _calibrate() -> int | None:
  """What `_references_beyond_slots` reports for an object that nothing but its one slot holds: the references of
  the counting itself (its loop variable, getrefcount's argument), which differ between interpreter versions. None
  where reference counts do not tell who holds an object (free-threaded builds, other interpreters)."""
  if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"): return None
  probe = [object()]
  return _references_beyond_slots([probe])[id(probe[0])]


_COUNTING_REFERENCES = _calibrate()


class PoolMemory:
  """What planning the memory of a replayed cached schedule needs to know of its pool of distinct buffers
  (schedule_item.ReplayedSchedule), taken once per cached schedule: every replay builds its items from a pool of the
  same layout by the same slots. `written`: the slots some item writes, ascending (the only ones the planner may
  share); `holders`: per written slot, the item slots holding it plus one (the pool); `plans`: the memory plans
  recorded for this schedule (RecordedPlan, numbered by slot), by the tuple of slots they share."""
  __slots__ = ("items", "written", "holders", "plans")

  def __init__(self, output_slots: Sequence[Sequence[int]], input_slots: Sequence[Sequence[int]]):
    self.items = len(output_slots)
    counts = Counter(slot for slots in (*output_slots, *input_slots) for slot in slots)
    self.written = sorted({slot for slots in output_slots for slot in slots})
    self.holders = [counts[slot] + 1 for slot in self.written]
    self.plans: dict[tuple[int, ...], RecordedPlan] = {}

  def internal_slots(self, pool: Sequence[Buffer]) -> tuple[int, ...] | None:
    """The written slots whose buffer nothing but the items and the pool holds (no LazyBuffer, no Tensor, no user
    variable: no one can read it after the items ran) and that has no memory yet: what planning may share, as
    held_only_by_items tells for any schedule, from the written slots' reference counts alone. None where reference
    counts cannot tell."""
    if _POOL_COUNTING is None: return None
    return self._unheld(pool, _POOL_COUNTING)

  def _unheld(self, pool: Sequence[Buffer], counting: int) -> tuple[int, ...]:
    # (a list comprehension: a generator would be resumed once per slot)
    return tuple([slot for slot, holders in zip(self.written, self.holders)
                  if getrefcount(pool[slot]) - holders == counting and pool[slot]._handle is None])


class _Unallocated:
  _handle = None


def _calibrate_pool() -> int | None:
  """What PoolMemory._unheld's count gives for a buffer that nothing but its item slot and the pool hold (its own
  references: getrefcount's argument), found by asking it of a probe; None where reference counts do not tell."""
  if _COUNTING_REFERENCES is None: return None
  pool = [_Unallocated()]
  item = (pool[0],)   # (the probe held by one item slot and the pool, as a replay's internal buffer is)
  memory = PoolMemory([(0,)], [])
  found = [counting for counting in range(-2, 8) if memory._unheld(pool, counting) == (0,)]
  del item
  return found[0] if len(found) == 1 else None


def held_only_by_items(containers: Sequence[Sequence[Buffer]]) -> set[int]:
  """ids of the buffers that nothing but `containers` (every tuple or list of the items that holds buffers) holds:
  no LazyBuffer, no Tensor, no user variable. No one can read those after the items ran. CPython counts references
  exactly, so a buffer's count minus the slots of `containers` that hold it tells whether anything else does (the
  count's own references are measured once, on a probe). Empty where counts cannot tell: nothing is planned."""
  if _COUNTING_REFERENCES is None: return set()
  return {key for key, extra in _references_beyond_slots(containers).items() if extra == _COUNTING_REFERENCES}


_POOL_COUNTING = _calibrate_pool()
