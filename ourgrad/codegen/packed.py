"""Packed kernels: independent elementwise kernels of different shapes in one launch (multi-tensor apply).

A packed AST is `PACK(segment_0, segment_1, ...)`. Each segment is an elementwise kernel AST (a STORE, or a SINK of
STOREs) whose views are all flat, shape (size_i,), and whose buffer numbers are the packed kernel's. The kernel
walks one flat index over total = size_0 + size_1 + ...; segment i owns [start_i, start_i + size_i):

- on a GPU, one thread per element (blocks of up to 128 threads): segment i is an IF block
  (start_i <= index < start_i + size_i) computing its values at index - start_i, so each thread runs the one
  segment it falls in;
- on a CPU, the segments' loops run one after another, with no branch per element. They are serial loops: the C
  renderer's parallel pragma collapses perfectly nested global loops, which loops side by side are not.

Each segment is lowered by the ordinary `Linearizer` (its own `Kernel`, buffers renumbered from 0) into a shared
UOp list. No opts (upcast, float4, locals): these kernels stream memory, and an opt would have to divide every
segment. engine/packing.py decides which kernels form a pack.
"""
from __future__ import annotations

from typing import Any

from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import INDEX_DTYPE, Linearizer
from ourgrad.codegen.uops import AxisType, UOp, UOpBuilder, UOps
from ourgrad.dtype import dtypes
from ourgrad.helpers import DEBUG
from ourgrad.ops import LazyOp, MemBuffer, Ops, format_ast
from ourgrad.shape.symbolic import Node, Variable

# threads per block of a packed kernel on a GPU: one element per thread
PACKED_BLOCK_THREADS = 128


class PackedKernel:
  """A PACK AST as a list of segment Kernels, each with the map from its own buffer numbers to the packed kernel's.
  Offers what realize.py reads of a Kernel: name, leaves, sts, applied_opts, print_debug, colored_shape."""

  def __init__(self, ast: LazyOp, renderer: Any):
    if ast.op is not Ops.PACK: raise AssertionError(f"a packed kernel's AST is a PACK, not {ast.op}")
    self.ast, self.renderer = ast, renderer
    self.segments: list[tuple[Kernel, dict[int, int]]] = [_segment_kernel(segment, renderer) for segment in ast.srcs]
    self.sizes: list[int] = [segment.stores()[0].arg.st.size for segment in ast.srcs]
    # every leaf with its flat view and its packed buffer number (realize.estimate_cost counts bytes from them)
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
    total = sum(self.sizes)
    threads = min(PACKED_BLOCK_THREADS, total)
    blocks = -(-total // threads)
    flat = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("gidx0", blocks, 0, AxisType.GLOBAL))
    if threads > 1:
      thread = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("lidx0", threads, 0, AxisType.LOCAL))
      flat = build.alu(Ops.ADD, INDEX_DTYPE, build.alu(Ops.MUL, INDEX_DTYPE, flat, build.const(threads, INDEX_DTYPE)),
                       thread)
    start = 0
    for number, ((kernel, buffer_of), size) in enumerate(zip(self.segments, self.sizes)):
      end = start + size
      inside = build.alu(Ops.CMPLT, dtypes.bool, flat, build.const(end, INDEX_DTYPE))
      if start > 0:
        after_start = build.alu(Ops.CMPLT, dtypes.bool, build.const(start - 1, INDEX_DTYPE), flat)
        inside = build.alu(Ops.AND, dtypes.bool, after_start, inside)
      first = len(build.uops)
      block = build.add(UOps.IF, None, (inside,))
      index = build.alu(Ops.ADD, INDEX_DTYPE, flat, build.const(-start, INDEX_DTYPE)) if kernel.shape_len else None
      _lower_segment(build, kernel, buffer_of, defines, f"pidx{number}", index)
      build.end_if(block)
      self.segment_spans.append((first, len(build.uops)))
      start = end

  def _linearize_loops(self, build: UOpBuilder, defines: dict[int, UOp]) -> None:
    for number, ((kernel, buffer_of), size) in enumerate(zip(self.segments, self.sizes)):
      name, first = f"pidx{number}", len(build.uops)
      if kernel.shape_len == 0:   # one element: no loop
        _lower_segment(build, kernel, buffer_of, defines, name, None)
      else:
        loop = build.add(UOps.RANGE, INDEX_DTYPE, (build.const(0, INDEX_DTYPE), build.const(size, INDEX_DTYPE)),
                         (name, AxisType.REDUCE))   # REDUCE: a plain serial loop (see the module docstring)
        _lower_segment(build, kernel, buffer_of, defines, name, loop)
        build.end_range(loop)
      self.segment_spans.append((first, len(build.uops)))

  def op_count(self, uops: list[UOp]) -> int:
    """Arithmetic ops of one launch: each segment's ALUs once per element of that segment (a GPU thread runs only
    its own segment's IF block). `uops` is what `linearize` returned."""
    count = 0
    for (first, end), size in zip(self.segment_spans, self.sizes):
      count += size * sum(uop.op is UOps.ALU and uop.dtype not in (None, INDEX_DTYPE, dtypes.bool)
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
  linearizer._store_outputs(idxs, None)


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
  return Kernel(rebuilt[id(segment)], renderer), {own: packed for packed, own in order.items()}

