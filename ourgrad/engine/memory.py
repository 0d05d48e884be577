"""The memory planner: buffers whose lifetimes do not overlap run on the same memory.

A buffer's lifetime, inside one list of items (a schedule, or the items a JIT captured), runs from the first item
that touches it to the last. `plan_memory` walks the items in order; when a planned buffer's last use has passed,
its backing memory goes back to a free list, and a later buffer of the same device takes the smallest free one
that fits (else a new backing buffer of its exact size); sharing always starts at byte 0. Only buffers the caller
says are internal are planned: never one that is alive outside the items (an output, an input, model state,
anything a Python object still holds).
"""
from __future__ import annotations

import bisect
import sys
import sysconfig
from collections import Counter, defaultdict
from typing import Any, Callable, Sequence

from ourgrad.device import Buffer, Device
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
  starts: dict[int, list[Buffer]] = defaultdict(list)
  ends: dict[int, list[Buffer]] = defaultdict(list)
  for buffer, index in first_use.items(): starts[index].append(buffer)
  for buffer, index in last_use.items(): ends[index].append(buffer)
  free: dict[str, list[tuple[int, int, Buffer]]] = defaultdict(list)   # device -> sorted (nbytes, id, backing)
  assigned: dict[Buffer, Buffer] = {}
  for index in range(len(buffer_lists)):
    for buffer in starts.get(index, ()):
      needed = max(buffer.nbytes, 1)
      pool = free[buffer.device]
      position = bisect.bisect_left(pool, (needed, -1))
      if position < len(pool):
        backing = pool.pop(position)[2]
      else:
        backing = Buffer(buffer.device, needed, dtypes.uint8)
      assigned[buffer] = backing
    for buffer in ends.get(index, ()):
      backing = assigned[buffer]
      bisect.insort(free[buffer.device], (backing.nbytes, id(backing), backing))
  naive = sum(buffer.nbytes for buffer in assigned)
  planned = sum(backing.nbytes for backing in set(assigned.values()))
  for buffer, backing in assigned.items(): buffer.use_memory_of(backing)
  if DEBUG >= 1:
    print(f"memory planner ({label}): {len(assigned)} buffers in {len(set(assigned.values()))} backing buffers, "
          f"{fmt_size(planned)} planned vs {fmt_size(naive)} naive ({planned} vs {naive} bytes)")
  return assigned


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


def held_only_by_items(containers: Sequence[Sequence[Buffer]]) -> set[int]:
  """ids of the buffers that nothing but `containers` (every tuple or list of the items that holds buffers) holds:
  no LazyBuffer, no Tensor, no user variable. No one can read those after the items ran. CPython counts references
  exactly, so a buffer's count minus the slots of `containers` that hold it tells whether anything else does (the
  count's own references are measured once, on a probe). Empty where counts cannot tell: nothing is planned."""
  if _COUNTING_REFERENCES is None: return set()
  return {key for key, extra in _references_beyond_slots(containers).items() if extra == _COUNTING_REFERENCES}
