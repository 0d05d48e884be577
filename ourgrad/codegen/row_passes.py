"""The passes of a GPU row kernel's block over its row (codegen/row_blocks.py): which units each thread takes,
in what order, and which loads a loop iteration issues together."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

from ourgrad.codegen.bounded_loops import round_guard
from ourgrad.codegen.uops import AxisType, UOps
from ourgrad.ops import REDUCE_OPS, LazyOp, Ops
from ourgrad.shape.symbolic import Node, NumNode, Variable

if TYPE_CHECKING:
  from ourgrad.codegen.row_blocks import BlockRowLinearizer

# A GPU thread whose row loops takes this many units' worth of registers (float4s) an iteration, loaded together
LOOP_REGISTER_UNITS = 4


def register_units(units: int, width: int) -> int:
  """`units` units of `width` elements counted as the float4s of registers they take once loaded (PERSISTENT_UNITS,
  the row layouts): a unit of 8 16-bit floats widens to two."""
  return units * max(1, width // 4)


class RowPasses:
  """The passes of a block over its row: thread t takes units t, t + T, ... (a unit: `width` neighbouring elements).
  Persistent: the thread's units are unrolled (constant iteration numbers), so every pass emits the same loads and
  the builder reuses them: the row is read once. Otherwise a loop over the thread's units, re-read at each pass, that
  takes `loop_units` units an iteration (their loads issued together: a 16-byte load a thread in flight left a
  vocabulary row at half the copy rate) with no guard; the iterations left over (fewer than `loop_units`, and the one
  past the row's end when the row's units are not a multiple of T, under an IF) follow, unrolled.
  `end` (a Node of bound Variables, codegen/bounded_loops.py `row_end`): the row's elements from `end` on add nothing
  to its reduces, so a persistent row's round (the T threads' units of one iteration) that may start at or past it
  runs under an IF that is the same for every thread of the block. A looping row keeps its whole loop (a row that
  long is split over kernels first: no decode row loops)."""

  def __init__(self, linearizer: BlockRowLinearizer, idxs: list[Node], thread: Node, threads: int, units: int,
               width: int, persistent: bool, end: Node | None = None):
    self.linearizer, self.idxs, self.thread, self.threads = linearizer, idxs, thread, threads
    self.units, self.width, self.persistent = units, width, persistent
    self.end = end if persistent else None
    self.per_thread = math.ceil(units / threads)
    # units an iteration of the loop: their loaded values live together (LOOP_REGISTER_UNITS float4s of registers)
    self.loop_units = max(1, LOOP_REGISTER_UNITS // register_units(1, width))

  def run(self, name: str, element: Callable[[list[Node]], None] | None, store: bool = False,
          each_unit: Callable[[list[list[Node]]], None] | None = None, reads: list[LazyOp] | None = None,
          unguarded: bool = False) -> None:
    """One pass: `element(indices)` for each element of this thread's units, or (store) every output's store, or
    `each_unit(indices of each element)` once per unit. `reads`: the values the pass computes, whose loads a loop
    iteration issues for all its units first (the computations then reuse them). `unguarded`: no IF around the unit
    past the row's end for some threads: its loads are gated instead (`load_gate`: the IF's own condition, so the
    computation under the IF later reuses them). A prefetch (`_prefetch_row`) thus has the ragged unit's loads in
    flight with the others: under its IF, after the first reduce's combine, they were a round trip to memory of their
    own (every stacked row's in turn: 4 of them in the logits kernel of 4 stacked rows)."""
    linearizer = self.linearizer
    first_unrolled = 0
    if not self.persistent:
      full = self.units // self.threads   # iterations where every thread's unit is inside the row
      steps = full // self.loop_units
      if steps:
        loop = linearizer._open_loop(name, steps, AxisType.REDUCE)
        step = Variable(name, 0, steps - 1)
        iterations = [step * self.loop_units + offset for offset in range(self.loop_units)]
        loads = _loads_under(reads or [])
        for iteration in iterations:
          lanes = [linearizer.unit_idxs(self.idxs, iteration * self.threads + self.thread, self.width, lane)
                   for lane in range(self.width)]
          for load in loads: linearizer._lane_values(load, lanes, self.width)
        for iteration in iterations: self._unit(iteration, False, element, store, each_unit)
        linearizer.builder.end_range(loop)
      first_unrolled = steps * self.loop_units
    for number in range(first_unrolled, self.per_thread):
      ragged = self.units % self.threads != 0 and number == self.per_thread - 1
      # a round the row may end before stays out of an unguarded pass (its loads could lie past the end)
      if self._may_end_before(number) and unguarded: continue
      bound = round_guard(linearizer, number * self.threads * self.width, self.end)   # (the block's threads alike)
      self._unit(NumNode(number), ragged, element, store, each_unit, guarded=not unguarded)
      if bound is not None: linearizer.builder.end_if(bound)

  def _may_end_before(self, number: int) -> bool:
    """Whether the row may end (`end`) before unrolled round `number` starts."""
    return self.end is not None and number * self.threads * self.width >= self.end.min

  def _unit(self, iteration: Node, ragged: bool, element: Callable[[list[Node]], None] | None, store: bool,
            each_unit: Callable[[list[list[Node]]], None] | None, guarded: bool = True) -> None:
    """The thread's unit of an iteration (where it may lie past the row's end: its loads gated, under an IF unless
    not `guarded`)."""
    linearizer = self.linearizer
    build = linearizer.builder
    unit = iteration * self.threads + self.thread
    inside = linearizer.node_to_uop(unit < self.units) if ragged else None
    guard = build.add(UOps.IF, None, (inside,)) if inside is not None and guarded else None
    linearizer.load_gate = inside
    lanes = [linearizer.unit_idxs(self.idxs, unit, self.width, lane) for lane in range(self.width)]
    if store: linearizer.store_unit(lanes, self.width)
    elif each_unit is not None: each_unit(lanes)
    else:
      assert element is not None
      for lane, element_idxs in enumerate(lanes):
        linearizer.vector_unit = (lanes[0], self.width, lane) if self.width > 1 else None
        element(element_idxs)
      linearizer.vector_unit = None
    linearizer.load_gate = None
    if guard is not None: build.end_if(guard)


def _loads_under(roots: list[LazyOp]) -> list[LazyOp]:
  """The LOADs the values `roots` compute read (not those under a reduce: its value is known), each once."""
  found: dict[int, LazyOp] = {}
  stack = list(roots)
  while stack:
    node = stack.pop()
    if node.op is Ops.LOAD: found.setdefault(id(node), node)
    elif node.op not in REDUCE_OPS: stack.extend(node.srcs)
  return list(found.values())
