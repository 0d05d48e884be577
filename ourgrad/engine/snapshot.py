"""Copy-on-write before an in-place write: lazy readers keep the value they were built from.

The rule (docs/reliability.md): a lazy tensor's value is what eager evaluation would have given at the line that made
it. An assign (`x.assign(v)`, `x[i] = v`, `x += v`, an optimizer step) overwrites a buffer in place, so a reader of
that buffer that is still lazy when the assign runs would otherwise see the new contents:

    x = Tensor([1., 2., 3.]).realize(); y = x * 2; x.assign(x + 1).realize(); y.numpy()   # [2, 4, 6], not [4, 6, 8]

Inside one schedule the scheduler already orders every kernel that reads the old contents before the assign. This
module handles the readers outside it: after a schedule is built, for every assign in it, it looks up the live bases
that read the assign's target (each LazyBuffer keeps weak references to its readers, see LazyBuffer.live_readers).
A reader that is still unrealized gets the old contents from a snapshot: one copy kernel, placed just before the
assign, writes the target's buffer into a new buffer, and the reader's sources are redirected to it. With no such
reader (the usual case: nothing lazy survives the schedule) nothing is copied and the schedule is unchanged.

Tensors that hold the target itself or a view of it (`a = x.detach()`, `x[0:2]`) are aliases of the buffer, as in
PyTorch: they are not redirected and read the new contents.
"""
from __future__ import annotations

from dataclasses import dataclass

from ourgrad.device import Buffer
from ourgrad.engine.schedule_item import ScheduleItem
from ourgrad.lazy import LazyBuffer
from ourgrad.ops import LazyOp, MemBuffer, Ops
from ourgrad.shape.shapetracker import ShapeTracker


@dataclass
class SnapshotStats:
  """How often an assign had lazy readers to protect (a test and the soak benchmark read it)."""
  snapshots: int = 0         # copy kernels added
  readers_redirected: int = 0


SNAPSHOT_STATS = SnapshotStats()


def stale_readers(assign: LazyBuffer, target: LazyBuffer) -> list[LazyBuffer]:
  """The live, unrealized bases other than `assign` that read `target` (the buffer `assign` overwrites)."""
  readers = []
  for reader in target.live_readers():
    if reader is assign or reader.realized is not None: continue
    if any(src.base is target for src in _value_srcs(reader)): readers.append(reader)
  return readers


def _value_srcs(reader: LazyBuffer) -> tuple[LazyBuffer, ...]:
  """The sources `reader` reads values from: an assign's target (srcs[1]) is where it writes, not a value."""
  return reader.srcs[:1] if reader.op is Ops.ASSIGN else reader.srcs


def snapshot_item(source: Buffer, snapshot: Buffer, shape: tuple[int, ...]) -> ScheduleItem:
  """A kernel copying `source` into `snapshot` element for element."""
  st = ShapeTracker.from_shape(shape)
  load = LazyOp(Ops.LOAD, (), MemBuffer(1, source.dtype, st), source.dtype)
  store = LazyOp(Ops.STORE, (load,), MemBuffer(0, source.dtype, st), source.dtype)
  return ScheduleItem(store, (snapshot,), (source,))


def redirect_reader(reader: LazyBuffer, target: LazyBuffer, snapshot: LazyBuffer) -> None:
  """Make `reader` read `snapshot` (through the same views) wherever it read `target`'s values."""
  value_count = len(_value_srcs(reader))
  reader.srcs = tuple(snapshot.view(src.st) if index < value_count and src.base is target else src
                      for index, src in enumerate(reader.srcs))
  snapshot._add_reader(reader)


def protect_lazy_readers(schedule: list[ScheduleItem],
                         assigns: list[tuple[LazyBuffer, LazyBuffer]]) -> list[ScheduleItem]:
  """`schedule` with a snapshot copy before each assign whose target still has lazy readers, those readers
  redirected to the snapshot. `assigns` holds (assign base, target base) for every assign the schedule runs; call
  this after the scheduler dropped its own references, so that only readers someone else still holds are alive."""
  writes_seen: dict[int, int] = {}   # id(Buffer) -> assigns to it met so far (a chain writes one buffer in turn)
  for assign, target in assigns:
    buffer = assign.realized
    if buffer is None: continue
    nth = writes_seen[id(buffer)] = writes_seen.get(id(buffer), 0) + 1
    readers = stale_readers(assign, target)
    if not readers or target.realized is not buffer: continue
    position = _nth_writer(schedule, buffer, nth)
    if position is None: continue  # an empty assign runs no kernel: nothing is overwritten
    snapshot = LazyBuffer.from_buffer(Buffer(target.device, target.size, target.dtype), target.shape)
    assert snapshot.realized is not None
    schedule.insert(position, snapshot_item(buffer, snapshot.realized, target.shape))
    for reader in readers: redirect_reader(reader, target, snapshot)
    SNAPSHOT_STATS.snapshots += 1
    SNAPSHOT_STATS.readers_redirected += len(readers)
  return schedule


def _nth_writer(schedule: list[ScheduleItem], buffer: Buffer, nth: int) -> int | None:
  """The index of the `nth` item of `schedule` that writes `buffer` (assigns run in the order `assigns` lists them)."""
  found = None
  for index, item in enumerate(schedule):
    if any(out is buffer for out in item.outputs):
      found, nth = index, nth - 1
      if nth == 0: break
  return found   # the last writer where one kernel holds several assigns to the buffer
