"""Lower a row kernel (Kernel.row_axes: several reduces over the same rows, then the store) to UOps.

A row kernel runs its reduces one after another over each row (sources first: softmax's max, then the sum of
exp(x - max)), each result kept on chip for the next reduce and for the store (per element of the row, as softmax,
or once per row, as var). Who owns a row depends on the device:

- CPU (no thread blocks): one iteration of the global loops owns a row and loops over it once per reduce and once
  more for the store. The loops are split into lanes at SIMD width (an inner `omp simd` loop, an accumulator array
  per reduce) so that the C compiler vectorizes them; a transcendental value both a reduce and the store need
  (softmax's exp(x - max)) is computed once and kept in a per-row stack array; exp2 is plain arithmetic
  (vector_exp2), which vectorizes where libm's exp2f would be a call per element.
- GPU (thread blocks and local memory): a block owns a row (or a group of a block's threads does), the threads'
  partials combined through warp shuffles and local memory: codegen/row_blocks.py, whose BlockRowLinearizer builds
  on this module's RowLinearizer. A GPU without local memory takes the CPU's path, a thread per row (_row_threads).
"""
from __future__ import annotations

import math

from ourgrad.codegen.element_reduces import unflatten
from ourgrad.codegen.integer_rows import integer_terms, lower_integer_terms
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import INDEX_DTYPE, Linearizer, _post_order, reduce_identity
from ourgrad.codegen.uops import AxisType, UOp, UOps
from ourgrad.codegen.vector_exp2 import vector_exp2
from ourgrad.dtype import DType, dtypes
from ourgrad.ops import LazyOp, MemBuffer, Ops
from ourgrad.shape.symbolic import Node, NumNode, Variable

# A CPU row kernel keeps its transcendental per-element values (exp) for the store pass in stack arrays of at most
# this many bytes a row (per thread; they stay in L1/L2).
MAX_KEPT_BYTES = 64 * 1024
TRANSCENDENTAL_OPS = frozenset({Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.SQRT})
# ops whose integer results never wrap around (CPU lanes compile without -fwrapv); a right shift only drops bits (the
# nibbles of a Q4 block)
_NO_WRAP_OPS = frozenset({Ops.LOAD, Ops.CONST, Ops.CAST, Ops.BITCAST, Ops.STORE, Ops.SINK, Ops.MAX, Ops.CMPLT,
                          Ops.CMPNE, Ops.WHERE, Ops.AND, Ops.OR, Ops.XOR, Ops.SHR})


class RowLinearizer(Linearizer):
  """Builds the UOps of a row kernel with a thread (a CPU's loop iteration) per row; the parts every row kernel
  shares. On GPUs with local memory BlockRowLinearizer (codegen/row_blocks.py) gives a block a row instead."""

  def __init__(self, kernel: Kernel):
    super().__init__(kernel)
    self.reduce_values: dict[int, UOp] = {}
    self.kept_values: dict[int, UOp] = {}   # id(node) -> its value read back from a kept-value array (CPU)

  def _define_buffers(self) -> None:
    """A DEFINE_GLOBAL for each buffer the kernel reads or writes, in argument order."""
    kernel, build = self.kernel, self.builder
    memory_leaves = {leaf.arg.idx: leaf for leaf in kernel.leaves if isinstance(leaf.arg, MemBuffer)}
    # an output may be loaded too (an assign's target read in place, through the output's argument): it is written
    written = {leaf.arg.idx for leaf in kernel.leaves if isinstance(leaf.arg, MemBuffer) and leaf.op is Ops.STORE}
    for idx, leaf in sorted(memory_leaves.items()):
      self.buffers[idx] = build.add(UOps.DEFINE_GLOBAL, leaf.dtype, (), (idx, idx in written))

  def linearize(self) -> list[UOp]:
    """A thread (a CPU's loop iteration, or a GPU thread without local memory) per row."""
    kernel, build = self.kernel, self.builder
    assert kernel.row_axes is not None
    self._define_buffers()
    self._define_vars()
    shape = kernel.full_shape
    row_dims = [axis for axis in range(len(shape)) if axis not in kernel.row_axes]
    idxs: list[Node] = [NumNode(0)] * len(shape)
    row_loops = []
    # final reduces (Kernel.final_reduces): the rows are a loop in one thread, each row's result accumulated
    finals = [build.add(UOps.DEFINE_ACC, final.dtype, (), reduce_identity(final.op, final.dtype))
              for final in kernel.final_reduces]
    if kernel.renderer.has_threads:
      if finals: raise AssertionError("final reduces need a CPU or a GPU with local memory (kernel_walk)")
      for axis, node in zip(row_dims, self._row_threads([shape[axis] for axis in row_dims])): idxs[axis] = node
    else:
      for axis in row_dims:
        idxs[axis] = Variable(f"gidx{axis}", 0, shape[axis] - 1)
        row_loops.append(self._open_loop(f"gidx{axis}", shape[axis], AxisType.REDUCE if finals else AxisType.GLOBAL))
    lanes = self._cpu_lanes()
    kept = self._kept_values()
    scratch = {id(node): build.add(UOps.DEFINE_LOCAL, node.dtype, (), (f"kept{number}", self._row_length()))
               for number, (node, _) in enumerate(kept)}
    for number, reduce in enumerate(self._row_reduces()):
      # (a CPU's thread per row: on a GPU without local memory the rows stay float loops)
      cpu_row = not kernel.renderer.has_threads and not any(keeper is reduce for _, keeper in kept)
      split = integer_terms(kernel, reduce) if cpu_row else None
      if split is not None:   # a quantized product: integer sums per block, then a float sum of the blocks
        self.reduce_values[id(reduce)] = lower_integer_terms(self, idxs, reduce, split, number)
        continue
      accumulators = _Accumulators(self, reduce, number, lanes)
      loops = self._open_row_loops(idxs, f"ridx{number}_", lanes)
      for node, keeper in kept:   # computed once here, read back by the store pass
        if keeper is reduce:
          build.add(UOps.STORE, None, (scratch[id(node)], self._row_position(idxs), self.compute(node, idxs, None)))
      accumulators.add(self.compute(reduce.srcs[0], idxs, None), loops[-1])
      self._close_row_loops(idxs, loops)
      self.reduce_values[id(reduce)] = accumulators.combined()
    if finals:
      self._accumulate_finals(finals, idxs)
      for loop in reversed(row_loops): build.end_range(loop)
      self._store_outputs([NumNode(0)] * len(shape), None)
      return build.uops
    if not self._per_element():
      self._store_outputs(idxs, None)
    else:
      loops = self._open_row_loops(idxs, "sidx", lanes)
      position = self._row_position(idxs)
      self.kept_values = {node_id: build.add(UOps.LOAD, local.dtype, (local, position))
                          for node_id, local in scratch.items()}
      self._store_outputs(idxs, None)
      self.kept_values = {}
      self._close_row_loops(idxs, loops)
    for loop in reversed(row_loops): build.end_range(loop)
    return build.uops

  def _alu(self, op: Ops, dtype: DType, srcs: tuple[UOp, ...]) -> UOp:
    # a CPU's libm exp2f is a call per element, which the C compiler cannot vectorize: arithmetic it can
    if op is Ops.EXP2 and dtype == dtypes.float32 and not self.kernel.renderer.has_threads:
      return vector_exp2(self.builder, srcs[0])
    return super()._alu(op, dtype, srcs)

  def _row_reduces(self) -> list[LazyOp]:
    """The reduces over each row (sources first), not the final reduces over the rows' results nor the element
    reduces their rows read."""
    kernel = self.kernel
    return [reduce for reduce in kernel.reduceops if reduce not in kernel.final_reduces
            and not any(reduce is inner for inner in kernel.element_reduces)]

  def _accumulate_finals(self, accumulators: list[UOp], idxs: list[Node]) -> None:
    """Add this row's value of each final reduce's input (computed from the row's reduces) to its accumulator; the
    accumulator stands for the final reduce in the store after the rows."""
    build = self.builder
    for final, accumulator in zip(self.kernel.final_reduces, accumulators):
      value = self.compute(final.srcs[0], idxs, None)
      build.add(UOps.ACCUMULATE, final.dtype, (accumulator, value), accumulate_op(final))
      self.reduce_values[id(final)] = accumulator

  def _per_element(self) -> bool:
    """Whether the outputs are per element of the rows (softmax), not once per row (var)."""
    return any(self.kernel.sts[0].shape[axis] != 1 for axis in self.kernel.row_axes or ())

  # ---------------------------------------------------------------- CPU: a thread per row

  def _cpu_lanes(self) -> int:
    """Neighbouring elements of a row computed side by side, each reduce with an accumulator per lane, so that the C
    compiler can vectorize the passes (a float sum in one accumulator is a serial chain it may not reorder): the
    SIMD width in elements where the innermost row axis splits into whole vectors, else 1."""
    kernel = self.kernel
    vector_bytes = getattr(kernel.renderer, "vector_bytes", 0)
    if kernel.renderer.has_threads or not vector_bytes or not kernel.renderer.has_stack_arrays: return 1
    # lanes compile without -fwrapv and with the loop vectorizer (ops_clang.ClangCompiler.flags_for): one lane where
    # integer arithmetic may wrap, or a flipped view (a negative stride: gcc 12's loop vectorizer miscompiles those)
    if any(stride is not None and stride < 0 for st in kernel.sts for stride in st.real_strides()): return 1
    if any(not node.dtype.is_float and node.dtype != dtypes.bool and node.op not in _NO_WRAP_OPS
           and not _counts_without_wrapping(node, kernel.final_reduces) for node in self._lane_nodes()): return 1
    itemsize = max((reduce.dtype.itemsize for reduce in self._row_reduces()), default=4)
    innermost = kernel.full_shape[(kernel.row_axes or ())[-1]]
    lanes = max(vector_bytes // itemsize, 1)
    while lanes > 1 and innermost % lanes: lanes //= 2
    return lanes

  def _lane_nodes(self) -> list[LazyOp]:
    """The nodes computed inside the row loops (each row reduce's input; the stores' values where the output is per
    element), where lanes apply. A per-row value computed once after the loops (a gathered element's offset,
    cross-entropy's target logit: tensor_nn._picked_logits clamps the index first, so it never wraps) is not."""
    kernel = self.kernel
    stops = {id(reduce) for reduce in kernel.reduceops}
    roots = [reduce.srcs[0] for reduce in kernel.reduceops]
    if self._per_element(): roots += [store.srcs[0] for store in kernel.stores]
    found: dict[int, LazyOp] = {}
    for root in roots:
      for node in _post_order(root, stops):
        if id(node) not in stops: found[id(node)] = node
    return list(found.values())

  def _row_length(self) -> int: return math.prod(self.kernel.full_shape[axis] for axis in self.kernel.row_axes or ())

  def _kept_values(self) -> list[tuple[LazyOp, LazyOp]]:
    """(node, reduce) pairs: a transcendental per-element value (softmax's exp(x - max)) that both a reduce's input
    and the store compute, kept in a per-row array (the CPU's stack: private to the thread, in L1/L2) by that
    reduce's pass and read back by the store pass instead of being computed again. Only on renderers with stack
    arrays, for rows that fit MAX_KEPT_BYTES."""
    kernel = self.kernel
    if not getattr(kernel.renderer, "has_stack_arrays", False) or not self._per_element(): return []
    reduces = {id(reduce) for reduce in kernel.reduceops}
    stored = {id(node) for store in kernel.stores for node in _post_order(store.srcs[0], reduces)}
    kept: dict[int, tuple[LazyOp, LazyOp]] = {}
    for reduce in kernel.reduceops:   # sources first: a value is kept by the last reduce that computes it
      for node in _post_order(reduce.srcs[0], reduces):
        if node.op in TRANSCENDENTAL_OPS and id(node) in stored: kept[id(node)] = (node, reduce)
    if sum(node.dtype.itemsize for node, _ in kept.values()) * self._row_length() > MAX_KEPT_BYTES: return []
    return list(kept.values())

  def _known_reduces(self, reduce_value: UOp | dict[int, UOp] | None) -> dict[int, UOp]:
    return {**self.reduce_values, **self.kept_values}

  def _vector_load(self, node: LazyOp, idxs: list[Node]) -> UOp | None:
    return None   # a thread's row loads element by element (the CPU's lanes are loops the compiler vectorizes)

  def _row_position(self, idxs: list[Node]) -> UOp:
    """The element's position in its row (row-major over the row axes), the index into a kept-value array."""
    position: Node = NumNode(0)
    for axis in self.kernel.row_axes or (): position = position * self.kernel.full_shape[axis] + idxs[axis]
    return self.node_to_uop(position)

  def _open_row_loops(self, idxs: list[Node], prefix: str, lanes: int = 1) -> list[UOp]:
    """A loop over each reduced axis (a loop in the thread, never a GLOBAL loop the CPU renderer parallelizes). With
    `lanes`, the innermost axis is two loops: over groups of `lanes` elements, and over the lanes of a group (a loop
    of a constant trip count the C compiler vectorizes, each lane's accumulator an element of an array)."""
    loops = []
    row_axes = self.kernel.row_axes or ()
    for axis in row_axes:
      size = self.kernel.full_shape[axis] // (lanes if axis == row_axes[-1] else 1)
      idxs[axis] = Variable(f"{prefix}{axis}", 0, size - 1)
      loops.append(self._open_loop(f"{prefix}{axis}", size, AxisType.REDUCE))
    if lanes > 1:
      name = f"{prefix}lane"
      loops.append(self._open_loop(name, lanes, AxisType.UNROLL))   # a vector loop (renderer.vector_loop_pragma)
      idxs[row_axes[-1]] = idxs[row_axes[-1]] * lanes + Variable(name, 0, lanes - 1)
    return loops

  def _close_row_loops(self, idxs: list[Node], loops: list[UOp]) -> None:
    for loop in reversed(loops): self.builder.end_range(loop)
    for axis in self.kernel.row_axes or (): idxs[axis] = NumNode(0)

  def _row_threads(self, sizes: list[int]) -> list[Node]:
    """Index nodes of the row axes on a GPU without local memory: blocks of up to 128 threads, one row per thread."""
    total = math.prod(sizes)
    threads = next((count for count in (128, 64, 32) if total % count == 0), 1)
    build = self.builder
    self.loop_vars["gidx0"] = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("gidx0", total // threads, 0, AxisType.GLOBAL))
    flat: Node = Variable("gidx0", 0, total // threads - 1)
    if threads > 1:
      self.loop_vars["lidx0"] = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("lidx0", threads, 0, AxisType.LOCAL))
      flat = flat * threads + Variable("lidx0", 0, threads - 1)
    return unflatten(flat, sizes)


class _Accumulators:
  """A reduce's accumulator on a CPU: one register (DEFINE_ACC), or with lanes an array of one per lane (each lane
  of the vectorized inner loop adds into its own element; combined in lane order after the loops)."""

  def __init__(self, linearizer: RowLinearizer, reduce: LazyOp, number: int, lanes: int):
    self.linearizer, self.build, self.reduce, self.lanes = linearizer, linearizer.builder, reduce, lanes
    self.op, identity = accumulate_op(reduce), reduce_identity(reduce.op, reduce.dtype)
    if lanes == 1:
      self.storage = self.build.add(UOps.DEFINE_ACC, reduce.dtype, (), identity)
      return
    self.storage = self.build.add(UOps.DEFINE_LOCAL, reduce.dtype, (), (f"lane_acc{number}", lanes))
    for lane in range(lanes):
      self.build.add(UOps.STORE, None, (self.storage, linearizer._int(lane), self.build.const(identity, reduce.dtype)))

  def add(self, value: UOp, lane: UOp) -> None:
    """Accumulate `value`; with lanes, into the element of `lane` (the innermost loop)."""
    build, dtype = self.build, self.reduce.dtype
    if self.lanes == 1:
      build.add(UOps.ACCUMULATE, dtype, (self.storage, value), self.op)
      return
    running = build.add(UOps.LOAD, dtype, (self.storage, lane))
    build.add(UOps.STORE, None, (self.storage, lane, build.alu(self.op, dtype, running, value)))

  def combined(self) -> UOp:
    if self.lanes == 1: return self.storage
    build, dtype = self.build, self.reduce.dtype
    total = build.add(UOps.LOAD, dtype, (self.storage, self.linearizer._int(0)))
    for lane in range(1, self.lanes):
      total = build.alu(self.op, dtype, total, build.add(UOps.LOAD, dtype, (self.storage, self.linearizer._int(lane))))
    return total


def accumulate_op(reduce: LazyOp) -> Ops: return Ops.ADD if reduce.op is Ops.SUM else Ops.MAX


def _counts_without_wrapping(node: LazyOp, finals: list[LazyOp]) -> bool:
  """Whether `node` is a final reduce's 64-bit sum of values of at most 32 bits (cross-entropy's count of samples not
  ignored): over at most kernel_walk.MAX_FINAL_REDUCE_ELEMENTS (2^16) rows it stays below 2^48, far from wrapping."""
  if node.op is not Ops.SUM or node.dtype.itemsize != 8 or not any(node is final for final in finals): return False
  value = node.srcs[0]
  return value.op is Ops.CAST and value.srcs[0].dtype.itemsize <= 4

