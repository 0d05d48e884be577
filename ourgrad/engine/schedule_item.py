"""ScheduleItem: one unit of a schedule, a kernel or a copy, with the buffers it writes and reads.

The scheduler (engine/schedule.py) builds them, kernel packing (engine/packing.py) merges them, the copy-on-write
snapshots (engine/snapshot.py) insert them, and engine/realize.py runs them. It lives below all of these so that each
imports it at the top.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ourgrad.device import Buffer
from ourgrad.ops import LazyOp


class ReplayedSchedule(list):
  """The items of a replayed cached schedule (engine/schedule_cache.py `_replay`), a list of ScheduleItems like any
  schedule, with the pool they were built from (`pool`: the distinct buffers by slot: the graph's leaves, then the
  fresh buffers, then the scratch ones) and `memory`, the cached schedule's facts about that pool (memory.PoolMemory:
  which slots the items write, how many item slots hold each, the memory plans recorded by slot), so that planning a
  replay's memory (engine/realize.py) reads the pool by slot instead of scanning the items. `launches`: the cached
  schedule's one-element list where engine/realize.py keeps its items' launchers once all were lowered (launch_all)."""
  __slots__ = ("pool", "memory", "launches")


class LoweringMemo:
  """What lowering an item's AST gave (engine/realize.py: the runner, the bound Variables' values, whether it needs
  block counters), kept by the schedule cache for the items it replays, so that a repeated realize lowers each kernel
  once. Valid while the compiled-kernel cache it came from is the same object and has dropped nothing since
  (`source`, `generation`): a cleared cache (a test, a new setting) lowers again. `idle`: the ExecItem the last
  replay ran, rebound to the next replay's buffers (its launcher stays bound while the allocator hands back the same
  memory), held without buffers between runs. `launch`: the runner's launcher (CompiledRunner.launcher) for a kernel
with no bound Variables and no block counters: a quiet replay calls it with the item's buffers, no ExecItem at all
(engine/realize.py run_schedule). `capture`: on a schedule's first item, its capture state
  (engine/capture.py: how often it was replayed, its device graph)."""
  __slots__ = ("runner", "var_vals", "block_counters", "source", "generation", "idle", "launch", "capture")

  def __init__(self) -> None:
    self.runner: Any = None   # None: not lowered yet
    self.var_vals: dict[str, int] = {}
    self.block_counters = False
    self.source: Any = None
    self.generation = -1
    self.idle: list[Any] = []   # at most one ExecItem; a list, so that taking it (pop) is one atomic step
    self.launch: Any = None     # None: launched through an ExecItem (a copy, symbolic sizes, block counters)
    self.capture: Any = None


@dataclass(frozen=True)
class ScheduleItem:
  """One kernel (ast is a STORE, a SINK of STOREs or a PACK) or one copy (ast is a COPY) and the buffers it writes
  and reads; `lowering`: where a replayed schedule keeps its lowering (None: lowered from the AST)."""
  ast: LazyOp
  outputs: tuple[Buffer, ...]
  inputs: tuple[Buffer, ...]
  lowering: LoweringMemo | None = field(default=None, compare=False, repr=False)

  @property
  def bufs(self) -> tuple[Buffer, ...]: return self.outputs + self.inputs


_new_object, _set_attribute = object.__new__, object.__setattr__


def replayed_item(ast: LazyOp, outputs: tuple[Buffer, ...], inputs: tuple[Buffer, ...],
                  lowering: LoweringMemo | None) -> ScheduleItem:
  """ScheduleItem(ast, outputs, inputs, lowering), made with one C call for its fields: the frozen dataclass's
  __init__ sets each field through object.__setattr__ (a lookup and a call per field), and a replayed schedule
  (engine/schedule_cache.py) makes one item per kernel at every realize. The same object: equal, equally hashed."""
  item = _new_object(ScheduleItem)
  _set_attribute(item, "__dict__", {"ast": ast, "outputs": outputs, "inputs": inputs, "lowering": lowering})
  return item
