"""ScheduleItem: one unit of a schedule, a kernel or a copy, with the buffers it writes and reads.

The scheduler (engine/schedule.py) builds them, kernel packing (engine/packing.py) merges them, the copy-on-write
snapshots (engine/snapshot.py) insert them, and engine/realize.py runs them. It lives below all of these so that each
imports it at the top.
"""
from __future__ import annotations

from dataclasses import dataclass

from ourgrad.device import Buffer
from ourgrad.ops import LazyOp


@dataclass(frozen=True)
class ScheduleItem:
  """One kernel (ast is a STORE, a SINK of STOREs or a PACK) or one copy (ast is a COPY) and the buffers it writes
  and reads."""
  ast: LazyOp
  outputs: tuple[Buffer, ...]
  inputs: tuple[Buffer, ...]

  @property
  def bufs(self) -> tuple[Buffer, ...]: return self.outputs + self.inputs
