"""Element reduces of a GPU row kernel: short reduces whose results the row reduces read per element of their rows,
computed by the kernel's own blocks into local memory before the row passes (a "staged reduce").

Decode attention is the example: softmax(scores) @ V is a row kernel over the cache slots (max, sum of exp, sum of
exp * v: extra/models/llama.py `softmax_weighted_sum`), and each element of its rows is a score, itself a 64-long
dot product q . k of the slot's key. Realized, the scores are a kernel of their own before the row kernel. As an
element reduce (engine/kernel_walk.py `element_reduce_refusal`), the scheduler builds the row kernel's AST with the
score's reduce inside (its input in the row loop shape followed by its own axes, `Kernel.element_axes`), and here the
block first computes the scores of its row into local memory, then a BARRIER, then the row passes read them from
there (`ElementStage.value`).

A block's rows share one staged row when the element reduces do not vary across them (the rows of the weighted sum's
head_dim outputs read the same scores: `shared_across_rows`); otherwise a block owns one row. Thread t of T computes
the elements t, t + T, ... of the staged row, each a loop over the reduce's own axes.
"""
from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

from ourgrad.codegen.linearizer import reduce_identity
from ourgrad.codegen.uops import AxisType, UOp, UOps
from ourgrad.ops import LazyOp, Ops
from ourgrad.shape.symbolic import Node, NumNode, Variable

# a thread's elements of the staged row are unrolled up to this many (else a loop), and an element's own reduce up to
# this length (a decode head_dim of 64; else a loop): straight-line code whose loads are all in flight at once
UNROLLED_ELEMENTS = 4
UNROLLED_LENGTH = 64

if TYPE_CHECKING:
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.codegen.row_linearizer import RowLinearizer


def is_element_leaf(kernel: Kernel, leaf: LazyOp) -> bool:
  """Whether `leaf` is read by an element reduce (its view spans the element reduces' own axes): not a row's load."""
  return any(leaf.arg.st.shape[axis] != 1 for axis in kernel.element_axes)


def varies_along(linearizer: RowLinearizer, reduce: LazyOp, axis: int) -> bool:
  """Whether element reduce `reduce`'s value may differ along row axis `axis` (a leaf under it is not broadcast)."""
  return linearizer._varies_along(reduce, axis)


def shared_across_rows(linearizer: RowLinearizer, row_dims: list[int], per_block: int) -> bool:
  """Whether the `per_block` neighbouring rows of a block (along the last row axis, where they stay inside it) read
  the same element reduce values, so that one staged row serves them all."""
  kernel = linearizer.kernel
  if per_block == 1: return True
  last = row_dims[-1] if row_dims else None
  if last is None or kernel.full_shape[last] % per_block != 0: return False
  return not any(varies_along(linearizer, reduce, last) for reduce in kernel.element_reduces)


class ElementStage:
  """The element reduces of one block's row, computed into local memory (one array per reduce, a row long)."""

  def __init__(self, linearizer: RowLinearizer, row_idxs: list[Node], block_thread: Node, block_threads: int):
    self.linearizer = linearizer
    kernel = linearizer.kernel
    self.row_axes = list(kernel.row_axes or ())
    self.sizes = [kernel.full_shape[axis] for axis in self.row_axes]
    self.length = math.prod(self.sizes)
    self.locals: dict[int, UOp] = {}
    build = linearizer.builder
    for number, reduce in enumerate(kernel.element_reduces):
      self.locals[id(reduce)] = build.add(UOps.DEFINE_LOCAL, reduce.dtype, (), (f"element{number}", self.length))
    iterations = math.ceil(self.length / block_threads)
    # a few elements a thread: unrolled, so that all their loads are in flight at once; more: a loop
    unrolled = iterations <= UNROLLED_ELEMENTS
    loop = linearizer._open_loop("eidx", iterations, AxisType.REDUCE) if not unrolled else None
    steps: list[Node] = [Variable("eidx", 0, iterations - 1)] if loop is not None else \
        [NumNode(step) for step in range(iterations)]
    for step in steps:
      element = step * block_threads + block_thread
      ragged = (step.max + 1) * block_threads > self.length
      guard = build.add(UOps.IF, None, (linearizer.node_to_uop(element < self.length),)) if ragged else None
      idxs = linearizer.unit_idxs(row_idxs, element, 1, 0)   # the element's place in the row
      for number, reduce in enumerate(kernel.element_reduces):
        value = self._reduce(reduce, idxs, number)
        build.add(UOps.STORE, None, (self.locals[id(reduce)], linearizer.node_to_uop(element), value))
      if guard is not None: build.end_if(guard)
    if loop is not None: build.end_range(loop)
    build.add(UOps.BARRIER, None)

  def _reduce(self, reduce: LazyOp, idxs: list[Node], number: int) -> UOp:
    """`reduce` at one element of the row (`idxs`), accumulated in a register: its own axes unrolled when short
    (their loads in flight together), else a loop."""
    linearizer, build = self.linearizer, self.linearizer.builder
    shape = linearizer.kernel.full_shape
    sizes = [shape[axis] for axis in reduce.arg]
    accumulator = build.add(UOps.DEFINE_ACC, reduce.dtype, (), reduce_identity(reduce.op, reduce.dtype))
    operation = Ops.ADD if reduce.op is Ops.SUM else Ops.MAX
    if math.prod(sizes) <= UNROLLED_LENGTH:
      positions = [[NumNode(index) for index in combination] for combination in itertools.product(*map(range, sizes))]
      values = []
      for position in positions:
        element_idxs = list(idxs)
        for axis, index in zip(reduce.arg, position): element_idxs[axis] = index
        values.append(linearizer.compute(reduce.srcs[0], element_idxs, None))
      for value in values: build.add(UOps.ACCUMULATE, reduce.dtype, (accumulator, value), operation)
      return accumulator
    loops, element_idxs = [], list(idxs)
    for axis in reduce.arg:
      name = f"e{number}idx{axis}"
      loops.append(linearizer._open_loop(name, shape[axis], AxisType.REDUCE))
      element_idxs[axis] = Variable(name, 0, shape[axis] - 1)
    value = linearizer.compute(reduce.srcs[0], element_idxs, None)
    build.add(UOps.ACCUMULATE, reduce.dtype, (accumulator, value), operation)
    for loop in reversed(loops): build.end_range(loop)
    return accumulator

  def value(self, reduce: LazyOp, idxs: list[Node]) -> UOp:
    """Element reduce `reduce` at the row element `idxs` points at, read back from local memory."""
    position: Node = NumNode(0)
    for axis, size in zip(self.row_axes, self.sizes): position = position * size + idxs[axis]
    return self.linearizer.builder.add(UOps.LOAD, reduce.dtype,
                                       (self.locals[id(reduce)], self.linearizer.node_to_uop(position)))

