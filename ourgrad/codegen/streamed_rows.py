"""Streamed reduces on a CPU: a kernel of one float reduce whose large input is read exactly once (a matrix-vector
product: each weight serves one output; a sum over the rows of a matrix) runs as a row kernel there.

A register tile of the loop-nest heuristic (codegen/opt/cpu_tiles.py) pays off where an input is reused across
outputs: a matmul. Here nothing is reused but the short vector, and the tile keeps each output's sum a serial chain
of scalar adds the C compiler may not reorder, so it cannot vectorize the loads either (a Q4_1 matrix-vector product
decoded its nibbles one byte at a time). A CPU row kernel (codegen/row_linearizer.py) gives the row's reduce SIMD
lanes instead: an accumulator per lane, the lanes an `omp simd` loop over neighbouring elements, added up after the
row. The sum is then taken in lane order: lane j adds elements j, j + lanes, j + 2 lanes, ... of the innermost reduce
axis (in that order), and the lanes' totals are added 0, 1, ..., lanes - 1. Float results differ from the serial
order by rounding only.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from ourgrad.ops import LazyOp, MemBuffer, Ops
from ourgrad.shape.shapetracker import ShapeTracker

# A row this many SIMD vectors long, at least, is worth its lanes: shorter rows (a compute-heavy reduce of a few dozen
# elements per output, the MNIST step's batchnorm backward) do better with the heuristic's lanes over the outputs,
# where no horizontal sum ends each row.
STREAMED_ROW_VECTORS = 8


def cpu_streams_rows(renderer: Any, reduces: Sequence[LazyOp], leaves: Sequence[LazyOp], sts: Sequence[ShapeTracker],
                     reduce_axes: tuple[int, ...]) -> bool:
  """Whether a kernel (its reduces, its leaves (outputs first) and their views in the loop shape, whose `reduce_axes`
  are reduced) is a streamed reduce on a CPU renderer: one float SUM or MAX into one output, fixed sizes, rows of at
  least STREAMED_ROW_VECTORS SIMD vectors whose innermost axis splits into whole vectors, and some buffer input that
  varies along that axis with unit stride (vector loads) while no output axis of size > 1 reads it twice (stride 0)."""
  cpu_lanes = not renderer.has_threads and renderer.has_stack_arrays and getattr(renderer, "vector_bytes", 0) > 0
  outputs = [leaf for leaf in leaves if leaf.op is Ops.STORE]
  if not cpu_lanes or len(reduces) != 1 or len(outputs) != 1 or not reduce_axes: return False
  if reduces[0].op not in (Ops.SUM, Ops.MAX) or not reduces[0].dtype.is_float: return False
  if any(not isinstance(size, int) for st in sts for size in st.shape): return False
  lanes = max(renderer.vector_bytes // reduces[0].dtype.itemsize, 1)
  full_shape = [max(st.shape[axis] for st in sts) for axis in range(len(sts[0].shape))]
  row_length = math.prod(full_shape[axis] for axis in reduce_axes)
  if full_shape[reduce_axes[-1]] % lanes or row_length < STREAMED_ROW_VECTORS * lanes: return False
  shape = sts[0].shape
  output_axes = [axis for axis in range(len(shape)) if axis not in reduce_axes and shape[axis] > 1]
  for leaf, st in zip(leaves, sts):
    if leaf.op is not Ops.LOAD or not isinstance(leaf.arg, MemBuffer): continue
    strides = st.real_strides()
    if strides[reduce_axes[-1]] == 1 and all(strides[axis] not in (0, None) for axis in output_axes): return True
  return False


def streamed_row_axes(kernel: Any) -> tuple[int, ...] | None:
  """The row axes (its reduce axes, last in its loop shape) that make a Kernel with no opts yet a streamed row kernel,
  or None: the heuristic's first choice (Kernel.hand_coded_optimizations). Explicit opts and BEAM keep the loop nest,
  as do kernels whose loop nest another plan extends (`may_stream_rows`: a split reduce's last block)."""
  if not kernel.may_stream_rows or kernel.applied_opts: return None
  reduce_axes = tuple(range(kernel.first_reduce, kernel.shape_len))
  if not cpu_streams_rows(kernel.renderer, kernel.reduceops, kernel.leaves, kernel.sts, reduce_axes): return None
  return reduce_axes
