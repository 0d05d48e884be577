"""Packed kernels: independent small kernels of different shapes in one launch (multi-tensor apply).

A packed AST is `PACK(segment_0, segment_1, ...)`. Each segment is an elementwise kernel AST (a STORE, or a SINK of
STOREs) whose views are all flat, shape (size_i,), or a small reduce (one STORE of one SUM or MAX, views as the
scheduler made them: engine/packing.py), and whose buffer numbers are the packed kernel's. The kernel walks one flat
index over total = size_0 + size_1 + ... (a reduce's size is its output count); segment i owns
[start_i, start_i + size_i):

- on a GPU, one thread per element (blocks of up to 128 threads): segment i is an IF block
  (start_i <= index < start_i + size_i) computing its values at index - start_i, so each thread runs the one
  segment it falls in. An elementwise segment whose outputs the renderer stores as vectors takes a vector of
  elements a thread instead (segment_lanes; its flat axis UPCAST: float4 loads and stores, 8 16-bit floats, 4-8x
  the bytes in flight per thread; the H200 ran the GPT-2 AdamW pack of scalar threads at 32-65% of DRAM
  bandwidth); the flat index then counts threads, segment i owning size_i / lanes_i of them;
- on a CPU, the segments' loops run one after another, with no branch per element. They are serial loops: the C
  renderer's parallel pragma collapses perfectly nested global loops, which loops side by side are not.

Each segment is lowered by the ordinary `Linearizer` (its own `Kernel`, buffers renumbered from 0) into a shared
UOp list. No opts of the whole kernel (locals): an opt would have to divide every segment; the vector lanes are each
segment's own (`segment_lanes`). A reduce segment's thread computes one output: its flat number split into the
output axes, a loop over the reduce axes with the innermost unrolled by up to PACKED_REDUCE_UNROLL (that many loads in
flight), then the store. engine/packing.py decides which kernels form a pack.
"""
from __future__ import annotations

import itertools
from typing import Any

from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.codegen.linearizer import INDEX_DTYPE, Linearizer, reduce_identity
from ourgrad.codegen.uops import AxisType, UOp, UOpBuilder, UOps
from ourgrad.dtype import dtypes
from ourgrad.helpers import DEBUG, prod
from ourgrad.ops import LazyOp, MemBuffer, Ops, format_ast
from ourgrad.shape.symbolic import Node, NumNode, Variable

# threads per block of a packed kernel on a GPU: one element per thread
PACKED_BLOCK_THREADS = 128
# a reduce segment's innermost reduce axis is unrolled by up to this much (a divisor of it)
PACKED_REDUCE_UNROLL = 8
# a GPU thread tests at most this many segments' bounds in a row; more segments are halved under IFs first
PACKED_FLAT_SEGMENTS = 4


class PackedKernel:
  """A PACK AST as a list of segment Kernels, each with the map from its own buffer numbers to the packed kernel's.
  Offers what realize.py reads of a Kernel: name, leaves, sts, applied_opts, print_debug, colored_shape."""

  def __init__(self, ast: LazyOp, renderer: Any):
    if ast.op is not Ops.PACK: raise AssertionError(f"a packed kernel's AST is a PACK, not {ast.op}")
    self.ast, self.renderer = ast, renderer
    self.segments: list[tuple[Kernel, dict[int, int]]] = [_segment_kernel(segment, renderer) for segment in ast.srcs]
    self.sizes: list[int] = [segment.stores()[0].arg.st.size for segment in ast.srcs]
    # elements per thread of each segment on a GPU (1, or the vector width: its flat axis upcast)
    self.lanes: list[int] = [segment_lanes(kernel, size) for (kernel, _), size in zip(self.segments, self.sizes)]
    # every leaf with its flat view and its packed buffer number (codegen/kernel_cost.py counts bytes from them)
    self.leaves: list[LazyOp] = [leaf for segment in ast.srcs for leaf in segment.stores() + segment.leaves()]
    self.sts = [leaf.arg.st for leaf in self.leaves]
    self.applied_opts: list[Any] = []
    self.segment_spans: list[tuple[int, int]] = []   # after linearize: each segment's [first, end) in the UOps

  @property
  def name(self) -> str: return f"P_{len(self.sizes)}_{sum(self.sizes)}"

  def colored_shape(self) -> str: return " ".join(str(size) for size in self.sizes)

  def print_debug(self) -> None:
    if DEBUG >= 3:
      print(format_ast(self.ast))
      print(f"{self.name}: {len(self.sizes)} segments of {self.colored_shape()} elements")

  def linearize(self) -> list[UOp]:
    """The UOps of the whole packed kernel (see the module docstring)."""
    build = UOpBuilder()
    self.segment_spans = []
    dtype_of = {leaf.arg.idx: leaf.dtype for leaf in self.leaves if isinstance(leaf.arg, MemBuffer)}
    written = {leaf.arg.idx for leaf in self.leaves if leaf.op is Ops.STORE}
    defines = {idx: build.add(UOps.DEFINE_GLOBAL, dtype_of[idx], (), (idx, idx in written)) for idx in sorted(dtype_of)}
    if self.renderer.has_threads:
      self._linearize_threads(build, defines)
    else:
      self._linearize_loops(build, defines)
    return build.uops

  def _linearize_threads(self, build: UOpBuilder, defines: dict[int, UOp]) -> None:
    thread_counts = [size // lanes for size, lanes in zip(self.sizes, self.lanes)]
    total = sum(thread_counts)
    threads = min(PACKED_BLOCK_THREADS, total)
    blocks = -(-total // threads)
    flat = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("gidx0", blocks, 0, AxisType.GLOBAL))
    if threads > 1:
      thread = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("lidx0", threads, 0, AxisType.LOCAL))
      flat = build.alu(Ops.ADD, INDEX_DTYPE, build.alu(Ops.MUL, INDEX_DTYPE, flat, build.const(threads, INDEX_DTYPE)),
                       thread)
    starts = list(itertools.accumulate(thread_counts, initial=0))
    self._segment_tree(build, defines, flat, starts, 0, len(self.segments))

  def _segment_tree(self, build: UOpBuilder, defines: dict[int, UOp], flat: UOp, starts: list[int], first: int,
                    last: int) -> None:
    """Segments first..last-1, their threads numbered from starts[first] to starts[last]: up to PACKED_FLAT_SEGMENTS,
    an IF block each over its threads; more, the two halves each under an IF (flat below the middle segment's start,
    or not), so a thread tests about 2 log2(segments) bounds on its way to its own segment, not every segment's
    (GPT-2's 64 weight casts in one pack: 64 tests a thread, ~256 instructions for 4 elements, left the H200's DRAM
    at 30%). The segment blocks stay in segment order, each one contiguous span of UOps."""
    if last - first <= PACKED_FLAT_SEGMENTS:
      for number in range(first, last):
        self._segment_block(build, defines, flat, number, starts[number], starts[number + 1])
      return
    middle = (first + last) // 2
    below_middle = build.alu(Ops.CMPLT, dtypes.bool, flat, build.const(starts[middle], INDEX_DTYPE))
    from_middle = build.alu(Ops.CMPLT, dtypes.bool, build.const(starts[middle] - 1, INDEX_DTYPE), flat)
    for low, high, inside in ((first, middle, below_middle), (middle, last, from_middle)):
      half = build.add(UOps.IF, None, (inside,))
      self._segment_tree(build, defines, flat, starts, low, high)
      build.end_if(half)

  def _segment_block(self, build: UOpBuilder, defines: dict[int, UOp], flat: UOp, number: int, start: int,
                     end: int) -> None:
    """Segment `number`'s IF block over its threads [start, end) (the bounds also keep the last block's spare threads
    out), computing its values at flat - start."""
    kernel, buffer_of = self.segments[number]
    inside = build.alu(Ops.CMPLT, dtypes.bool, flat, build.const(end, INDEX_DTYPE))
    if start > 0:
      after_start = build.alu(Ops.CMPLT, dtypes.bool, build.const(start - 1, INDEX_DTYPE), flat)
      inside = build.alu(Ops.AND, dtypes.bool, after_start, inside)
    first = len(build.uops)
    block = build.add(UOps.IF, None, (inside,))
    index = build.alu(Ops.ADD, INDEX_DTYPE, flat, build.const(-start, INDEX_DTYPE)) if kernel.shape_len else None
    lower = _lower_reduce_segment if kernel.reduceop is not None else _lower_segment
    lower(build, kernel, buffer_of, defines, f"pidx{number}", index)
    build.end_if(block)
    self.segment_spans.append((first, len(build.uops)))

  def _linearize_loops(self, build: UOpBuilder, defines: dict[int, UOp]) -> None:
    for number, ((kernel, buffer_of), size) in enumerate(zip(self.segments, self.sizes)):
      name, first = f"pidx{number}", len(build.uops)
      lower = _lower_reduce_segment if kernel.reduceop is not None else _lower_segment
      if kernel.shape_len == 0:   # one element: no loop
        lower(build, kernel, buffer_of, defines, name, None)
      else:
        loop = build.add(UOps.RANGE, INDEX_DTYPE, (build.const(0, INDEX_DTYPE), build.const(size, INDEX_DTYPE)),
                         (name, AxisType.REDUCE))   # REDUCE: a plain serial loop (see the module docstring)
        lower(build, kernel, buffer_of, defines, name, loop)
        build.end_range(loop)
      self.segment_spans.append((first, len(build.uops)))

  def op_count(self, uops: list[UOp]) -> int:
    """Arithmetic ops of one launch: each segment's ALUs once per element of that segment (a GPU thread runs only
    its own segment's IF block; a reduce segment's loop body once per loop trip). `uops` is what `linearize`
    returned."""
    count = 0
    threads = self.sizes if not self.renderer.has_threads else \
      [size // lanes for size, lanes in zip(self.sizes, self.lanes)]
    for (kernel, _), (first, end), size in zip(self.segments, self.segment_spans, threads):
      trips = prod(kernel.full_shape[kernel.first_reduce:kernel.first_upcast]) if kernel.reduceop is not None else 1
      count += size * trips * sum(uop.op is UOps.ALU and uop.dtype not in (None, INDEX_DTYPE, dtypes.bool)
                                  for uop in uops[first:end])
    return count


def _lower_segment(build: UOpBuilder, kernel: Kernel, buffer_of: dict[int, int], defines: dict[int, UOp], name: str,
                   index: UOp | None) -> None:
  """Append the loads, math and stores of one segment at flat element `index` (None: a one-element segment)."""
  linearizer = Linearizer(kernel)
  linearizer.builder = build
  linearizer.buffers = {own: defines[packed] for own, packed in buffer_of.items()}
  idxs: list[Node] = []
  if index is not None and kernel.shape_len:
    linearizer.loop_vars[name] = index
    idxs = [Variable(name, 0, kernel.full_shape[0] - 1)]
  if not kernel.upcast_axes:
    linearizer._store_outputs(idxs, None)
    return
  # a vector segment (segment_lanes): its lanes computed, then each output's vector stored
  axis = kernel.upcast_axes[0]
  vector_store = linearizer._vector_store_axis()
  pending: dict[tuple[int, ...], list[UOp]] = {}
  for lane in range(kernel.full_shape[axis]):
    lane_idxs = idxs + [NumNode(lane)]
    if vector_store is None:
      linearizer._store_outputs(lane_idxs, None)
      continue
    pending[(lane,)] = [linearizer.compute(store.srcs[0], lane_idxs, None) for store in kernel.stores]
    linearizer._emit_vector_store(pending, (lane,), lane_idxs, *vector_store, [axis])


def _lower_reduce_segment(build: UOpBuilder, kernel: Kernel, buffer_of: dict[int, int], defines: dict[int, UOp],
                          name: str, index: UOp | None) -> None:
  """Append one output of a reduce segment at flat output number `index` (None: a one-output segment): the reduce
  loops (the innermost unrolled, see _segment_kernel) into an accumulator, then the store."""
  linearizer = Linearizer(kernel)
  linearizer.builder = build
  linearizer.buffers = {own: defines[packed] for own, packed in buffer_of.items()}
  shape, outputs = kernel.full_shape, prod(kernel.full_shape[:kernel.first_reduce])
  idxs: list[Node] = []
  if index is not None and kernel.first_reduce:
    linearizer.loop_vars[name] = index
    flat: Node = Variable(name, 0, outputs - 1)
    stride = outputs
    for axis in range(kernel.first_reduce):   # row-major: the last output axis varies fastest
      stride //= shape[axis]
      idxs.append((flat // stride) % shape[axis])
  else:
    idxs = [NumNode(0) for _ in range(kernel.first_reduce)]
  reduce = kernel.reduceop
  accumulate_op = Ops.ADD if reduce.op is Ops.SUM else Ops.MAX
  accumulator = build.add(UOps.DEFINE_ACC, reduce.dtype, (), reduce_identity(reduce.op, reduce.dtype))
  loops = []
  for axis in range(kernel.first_reduce, kernel.first_upcast):
    loop_name = f"{name}r{axis}"
    idxs.append(Variable(loop_name, 0, shape[axis] - 1))
    loops.append(linearizer._open_loop(loop_name, shape[axis], AxisType.REDUCE))
  unrolled = range(kernel.first_upcast, kernel.shape_len)
  for lane in itertools.product(*[range(shape[axis]) for axis in unrolled]):
    value = linearizer.compute(reduce.srcs[0], idxs + [NumNode(value) for value in lane], None)
    build.add(UOps.ACCUMULATE, reduce.dtype, (accumulator, value), accumulate_op)
  for loop in reversed(loops): build.end_range(loop)
  # the output's views are size 1 along the reduce axes: index 0 there
  linearizer._store_outputs(idxs[:kernel.first_reduce] + [NumNode(0)] * (kernel.shape_len - kernel.first_reduce),
                            accumulator)


def segment_lanes(kernel: Kernel, size: int) -> int:
  """Elements per GPU thread of a segment: for a flat elementwise segment whose outputs the renderer stores as vectors
  (vector_dtypes), the widest vector any of its buffers takes (Renderer.vector_lanes: 8 where a bfloat16 weight cast
  stores 16 bytes a thread from two float4 loads), else the float32 width, that divides it into several vectors (its
  flat axis is then upcast by it, in place); else 1."""
  renderer = kernel.renderer
  if not renderer.has_threads or getattr(renderer, "vector_width", 0) < 2 or kernel.reduceop is not None or \
      kernel.shape_len != 1 or any(store.dtype not in renderer.vector_dtypes for store in kernel.stores):
    return 1
  buffers = [leaf for leaf in kernel.leaves if isinstance(leaf.arg, MemBuffer)]
  widest = max(renderer.vector_lanes(buffer.dtype) for buffer in buffers)
  for width in sorted({widest, renderer.vector_width}, reverse=True):
    # (one vector alone: the upcast would take the whole axis, leaving no thread axis)
    if width >= 2 and size % width == 0 and size != width:
      kernel.apply_opt(Opt(OptOps.UPCAST, 0, width))
      return width
  return 1


def _segment_kernel(segment: LazyOp, renderer: Any) -> tuple[Kernel, dict[int, int]]:
  """The Kernel of one segment with its buffers renumbered as a kernel of its own (outputs 0.., then inputs), and
  the map from those numbers back to the packed kernel's."""
  order: dict[int, int] = {}
  for leaf in segment.stores() + segment.leaves():
    if isinstance(leaf.arg, MemBuffer): order.setdefault(leaf.arg.idx, len(order))
  rebuilt: dict[int, LazyOp] = {}
  for node in segment.walk():
    arg = node.arg
    if isinstance(arg, MemBuffer): arg = MemBuffer(order[arg.idx], arg.dtype, arg.st)
    rebuilt[id(node)] = LazyOp(node.op, tuple(rebuilt[id(src)] for src in node.srcs), arg, node.dtype)
  kernel = Kernel(rebuilt[id(segment)], renderer)
  if kernel.reduceop is not None and kernel.first_upcast > kernel.first_reduce:
    size = kernel.full_shape[kernel.first_upcast - 1]
    amount = max(amount for amount in range(1, min(size, PACKED_REDUCE_UNROLL) + 1) if size % amount == 0)
    if amount > 1: kernel.apply_opt(Opt(OptOps.UNROLL, kernel.first_upcast - 1 - kernel.first_reduce, amount))
  return kernel, {own: packed for packed, own in order.items()}

