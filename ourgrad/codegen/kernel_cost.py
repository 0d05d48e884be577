"""What one launch of a lowered kernel costs: (arithmetic ops, bytes moved), as DEBUG=2's GFLOP/s and GB/s and
GlobalCounters count them. Each kernel kind (codegen/lowering.py `KINDS`) names the function that costs it.
"""
from __future__ import annotations

from typing import Any

from ourgrad.codegen.linearizer import INDEX_DTYPE
from ourgrad.codegen.uops import UOp, UOps, launch_dims
from ourgrad.dtype import dtypes
from ourgrad.helpers import prod
from ourgrad.ops import Ops
from ourgrad.renderer.cpu_loops import loop_trip_bound
from ourgrad.shape.symbolic import sym_max


def loop_ops(uops: list[UOp]) -> int:
  """Arithmetic ops of one launch of a loop nest: its ALUs weighted by the loops around them and the threads."""
  blocks, threads = launch_dims(uops)
  op_count, multiplier, multipliers = 0, prod(sym_max(size) for size in blocks + threads), []
  for uop in uops:
    if uop.op is UOps.FENCE: break   # a split reduce's finish: its adds are counted by split_reduce_cost
    if uop.op is UOps.RANGE:
      multipliers.append(multiplier)
      multiplier *= loop_trip_bound(uop)
    elif uop.op is UOps.ENDRANGE:
      multiplier = multipliers.pop()
    elif uop.op in (UOps.ALU, UOps.ACCUMULATE) and uop.dtype is not None and uop.dtype != INDEX_DTYPE:
      op_count += multiplier
  return op_count


def bytes_moved(kernel: Any) -> int:
  """Bytes one launch moves: each buffer's bytes counted once over the elements its view can touch (twice for one
  both read and written). Padding (OptOps.PADTO) adds masked elements that are never read or stored, so each view
  counts at most the elements of the kernel's view before its opts (`leaf.arg.st`)."""
  byte_count = 0
  seen: set[tuple[int, Ops]] = set()   # an output read in place (an assign's target) is read and written
  for leaf, st in zip(kernel.leaves, kernel.sts):
    if leaf.op not in (Ops.LOAD, Ops.STORE) or (leaf.arg.idx, leaf.op) in seen: continue
    seen.add((leaf.arg.idx, leaf.op))
    unpadded = leaf.arg.st
    # a symbolic size counts at its largest
    elements = min(prod(sym_max(size) for size in st.shape), prod(sym_max(size) for size in unpadded.shape))
    # a gathered load (srcs: a computed offset) reads at most one table element per element of its view
    touched = min(st.real_size(), unpadded.real_size(), elements) if leaf.op is Ops.LOAD and not leaf.srcs else elements
    byte_count += touched * leaf.dtype.itemsize
  return byte_count


def loop_nest_cost(kernel: Any, uops: list[UOp]) -> tuple[int, int]:
  """A linearized Kernel's cost: its loop nest's ops and its buffers' bytes."""
  return loop_ops(uops), bytes_moved(kernel)


def own_ops_cost(kernel: Any, uops: list[UOp]) -> tuple[int, int]:
  """The cost of a kernel that counts its own ops (a packed kernel, an indexed accumulate): `kernel.op_count`."""
  return kernel.op_count(uops), bytes_moved(kernel)


def split_reduce_cost(kernel: Any, uops: list[UOp]) -> tuple[int, int]:
  """A one-kernel split reduce's cost: its loop nest, and the last blocks combining the parts and storing the
  outputs."""
  op_count, byte_count = loop_nest_cost(kernel, uops)
  return op_count + (kernel.parts - 1) * kernel.outputs, byte_count + kernel.outputs * dtypes.float32.itemsize


def ride_along_cost(kernel: Any, uops: list[UOp]) -> tuple[int, int]:
  """A kernel carrying a one-value reduce (codegen/ride_along.py): the host's and the rider's loop nests (both in the
  UOps), the host's buffers and the rider's bytes."""
  op_count, byte_count = loop_nest_cost(kernel, uops)
  return op_count, byte_count + kernel.rider_bytes()


def wgmma_cost(kernel: Any, plan: Any) -> tuple[int, int]:
  """A kernel with OptOps.WGMMA (its plan: codegen/wgmma_tiles.py): a multiply and an add per element of the loop
  nest; every operand and the output moved once."""
  op_count = 2 * plan.m * plan.n * plan.k
  byte_count = sum(leaf.arg.st.real_size() * leaf.dtype.itemsize for leaf in kernel.leaves)
  return op_count, byte_count
