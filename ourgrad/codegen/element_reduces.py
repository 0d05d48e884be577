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
head_dim outputs read the same scores: `shared_across_rows`); stacked rows (a thread's rows along another axis) stage
a row each where the element reduces vary along it (`stacked_rows`); otherwise a block owns one row. Lanes of a warp
compute an element together (`ElementStage`).

Off by default (ELEMENT_REDUCES, helpers.py): on the H200 the fused decode attention was slower than the scores
kernel and the row kernel apart, each block reading its head's whole key cache from L2 (docs/fusion.md). With rows
that end at the slots in use (`end`, codegen/bounded_loops.py `row_end`) it is 2.57 us against 1.50 + 1.39, the
whole step no faster (session 20): still off.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ourgrad.codegen.bounded_loops import round_guard
from ourgrad.codegen.linearizer import reduce_identity
from ourgrad.codegen.uops import UOp, UOps
from ourgrad.ops import LazyOp, Ops
from ourgrad.shape.symbolic import Node, NumNode, sym_and

# the elements of an element reduce's own axes one lane takes: a 64-long dot product is 8 lanes of 8 (a warp's load
# reads 4 key rows' 32 contiguous bytes each; the lanes combine in 3 shuffles)
LANE_ELEMENTS = 8
# local memory a block's staged rows may take (a row of 4096 float32 scores; several stacked rows at most this in all)
ELEMENT_ROW_BYTES = 16 * 1024

if TYPE_CHECKING:
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.codegen.row_blocks import BlockRowLinearizer


def is_element_leaf(kernel: Kernel, leaf: LazyOp) -> bool:
  """Whether `leaf` is read by an element reduce (its view spans the element reduces' own axes): not a row's load."""
  return any(leaf.arg.st.shape[axis] != 1 for axis in kernel.element_axes)


def element_lanes(kernel: Kernel, block_threads: int) -> int:
  """Neighbouring threads that compute one element together (`ElementStage`): a power of two up to a warp (and the
  block), dividing every element reduce's length, about LANE_ELEMENTS elements a lane; 1 without warp shuffles."""
  warp_size = getattr(kernel.renderer, "warp_size", 0)
  if warp_size < 2: return 1
  shape = kernel.full_shape
  lengths = [math.prod(shape[axis] for axis in reduce.arg) for reduce in kernel.element_reduces]
  lanes = 1
  while lanes * 2 <= min(warp_size, block_threads) and all(length % (lanes * 2) == 0 and length // (lanes * 2) >=
                                                             LANE_ELEMENTS for length in lengths):
    lanes *= 2
  return lanes


def unflatten(flat: Node, sizes: list[int]) -> list[Node]:
  """Per-axis indices of a row-major flat index over `sizes` (the last varying fastest)."""
  if len(sizes) == 1: return [flat]
  indices, inner = [], 1
  for size in reversed(sizes):
    indices.append((flat // inner) % size)
    inner *= size
  return list(reversed(indices))


def varies_along(reduce: LazyOp, axis: int) -> bool:
  """Whether element reduce `reduce`'s value may differ along row axis `axis`: a leaf under it is not broadcast along
  it (the view the kernel indexes, its last, has a stride there or a mask; the views under it are then indexed alike
  at every index of the axis, a RoPE pair swap's flip included)."""
  for node in reduce.walk():
    if node.op not in (Ops.LOAD, Ops.CONST): continue
    view = node.arg.st.views[-1]
    if view.shape[axis] != 1 and (view.strides[axis] != 0 or
                                  (view.mask is not None and tuple(view.mask[axis]) != (0, view.shape[axis]))):
      return True
  return False


def shared_across_rows(linearizer: BlockRowLinearizer, row_dims: list[int], per_block: int) -> bool:
  """Whether the `per_block` neighbouring rows of a block (along the last row axis, where they stay inside it) read
  the same element reduce values, so that one staged row serves them all."""
  kernel = linearizer.kernel
  if per_block == 1: return True
  last = row_dims[-1] if row_dims else None
  if last is None or kernel.full_shape[last] % per_block != 0: return False
  return not any(varies_along(reduce, last) for reduce in kernel.element_reduces)


def staged_bytes(kernel: Kernel, axis: int | None, stack: int) -> int:
  """Local memory the staged rows of a block take with `stack` rows stacked along `axis` (`stacked_rows`)."""
  length = math.prod(kernel.full_shape[row_axis] for row_axis in kernel.row_axes or ())
  rows = stack if axis is not None and any(varies_along(reduce, axis) for reduce in kernel.element_reduces) else 1
  return rows * length * sum(reduce.dtype.itemsize for reduce in kernel.element_reduces)


def stacked_rows(first_row: list[Node], axis: int | None, stack: int, kernel: Kernel) -> list[list[Node]]:
  """The rows a block stages: its first row, or with stacked rows (`stack` rows along `axis` in each thread) the
  first row's `stack` rows where the element reduces vary along `axis` (one staged row each)."""
  if axis is None or not any(varies_along(reduce, axis) for reduce in kernel.element_reduces): return [first_row]
  return [[index * stack + sub if number == axis else index for number, index in enumerate(first_row)]
          for sub in range(stack)]


class ElementStage:
  """The element reduces of one block's row, computed into local memory (one array per reduce, a row long). Where
  the device has warp shuffles, `lanes` neighbouring threads compute one element together (lane j takes the
  reduce's elements j, j + lanes, ...: neighbouring threads read neighbouring addresses of the element's input, a
  cache slot's key row) and combine by shuffles; the block's `block_threads / lanes` groups take the row's elements
  g, g + G, ... (unrolled, so that all of a thread's loads are in flight at once). `end` (codegen/bounded_loops.py
  `row_end`): the row's elements from `end` on are not read (the row passes stop there), so a step of the G groups
  that may start at or past it runs under an IF, the same for every thread (the lanes' shuffles stay whole)."""

  def __init__(self, linearizer: BlockRowLinearizer, staged_rows: list[list[Node]], block_thread: Node,
               block_threads: int, end: Node | None = None):
    self.linearizer = linearizer
    kernel = linearizer.kernel
    self.row_axes = list(kernel.row_axes or ())
    self.sizes = [kernel.full_shape[axis] for axis in self.row_axes]
    self.length = math.prod(self.sizes)
    self.slot = 0   # the staged row the rows computed now read (`select`)
    self.locals: dict[int, UOp] = {}
    build = linearizer.builder
    for number, reduce in enumerate(kernel.element_reduces):
      self.locals[id(reduce)] = build.add(UOps.DEFINE_LOCAL, reduce.dtype, (),
                                          (f"element{number}", self.length * len(staged_rows)))
    lanes = element_lanes(kernel, block_threads)
    groups = block_threads // lanes
    group, lane = (block_thread // lanes, block_thread % lanes) if lanes > 1 else (block_thread, NumNode(0))
    iterations = math.ceil(self.length / groups)
    for slot, row_idxs in enumerate(staged_rows):
      for step in range(iterations):
        element = group + step * groups
        step_guard = round_guard(linearizer, step * groups, end)
        ragged = (step + 1) * groups > self.length
        # past the row's end (the last step) a group computes an element again (every lane of a warp takes part in
        # its shuffles) and does not store it
        idxs = linearizer.unit_idxs(row_idxs, element % self.length if ragged else element, 1, 0)
        for reduce in kernel.element_reduces:
          # each element's shuffles right after its loads: all partials first (then all shuffles) was slower on the
          # H200 (the fused decode attention 15.3 -> 17.1 us launched alone)
          value = self._reduce(reduce, idxs, lane, lanes)
          # the group's first lane stores the element (inside the row)
          writes = sym_and(([lane < 1] if lanes > 1 else []) + ([element < self.length] if ragged else []))
          writer = build.add(UOps.IF, None, (linearizer.node_to_uop(writes),)) if writes != NumNode(1) else None
          position = linearizer.node_to_uop(element + slot * self.length)
          build.add(UOps.STORE, None, (self.locals[id(reduce)], position, value))
          if writer is not None: build.end_if(writer)
        if step_guard is not None: build.end_if(step_guard)
    self.slots = len(staged_rows)
    build.add(UOps.BARRIER, None)

  def select(self, row: int) -> None:
    """The block's stacked row `row` (of `stacked_rows`) is computed next: it reads its own staged row, if any."""
    self.slot = row if self.slots > 1 else 0

  def _reduce(self, reduce: LazyOp, idxs: list[Node], lane: Node, lanes: int) -> UOp:
    """`reduce` at one element of the row (`idxs`): this lane's share of its own axes (its elements lane, lane +
    lanes, ..., unrolled) accumulated in a register, then the lanes' partials combined by shuffles (every lane holds
    the result)."""
    linearizer, build = self.linearizer, self.linearizer.builder
    shape = linearizer.kernel.full_shape
    sizes = [shape[axis] for axis in reduce.arg]
    accumulator = build.add(UOps.DEFINE_ACC, reduce.dtype, (), reduce_identity(reduce.op, reduce.dtype))
    operation = Ops.ADD if reduce.op is Ops.SUM else Ops.MAX
    values = []
    for step in range(math.prod(sizes) // lanes):
      element_idxs = list(idxs)
      for axis, index in zip(reduce.arg, unflatten(lane + step * lanes, sizes)): element_idxs[axis] = index
      values.append(linearizer.compute(reduce.srcs[0], element_idxs, None))
    for value in values: build.add(UOps.ACCUMULATE, reduce.dtype, (accumulator, value), operation)
    if lanes == 1: return accumulator
    return build.add(UOps.WARP_REDUCE, reduce.dtype, (accumulator,), (operation, lanes, 1))

  def value(self, reduce: LazyOp, idxs: list[Node]) -> UOp:
    """Element reduce `reduce` at the row element `idxs` points at, read back from local memory."""
    position: Node = NumNode(self.slot)
    for axis, size in zip(self.row_axes, self.sizes): position = position * size + idxs[axis]
    return self.linearizer.builder.add(UOps.LOAD, reduce.dtype,
                                       (self.locals[id(reduce)], self.linearizer.node_to_uop(position)))

