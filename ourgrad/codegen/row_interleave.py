"""Interleaved rows of a GPU row kernel (codegen/row_blocks.py): neighbouring threads take neighbouring rows and
each row's threads sit `interleave` lanes apart, for kernels whose largest loads are strided along the row but
contiguous across the rows. Grouped-query decode attention's P @ V (extra/models/llama.py `softmax_weighted_sum`)
reads the cache (slots, heads, head_dim) along the slots for each head_dim output: with a warp a row its lanes were
4 slots (6 KB) apart, each load reading 4 bytes of a 32-byte sector; with 8 rows side by side a load reads whole
sectors. The rows' partials meet by shuffles `interleave` lanes apart, then through local memory across warps."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ourgrad.codegen.uops import UOp, UOps
from ourgrad.helpers import ROW_INTERLEAVE
from ourgrad.ops import LazyOp, MemBuffer, Ops
from ourgrad.shape.symbolic import Node

if TYPE_CHECKING:
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.codegen.row_blocks import BlockRowLinearizer

# the bytes a GPU's memory transaction moves (an L1/L2 sector): rows are interleaved until a warp's load of a strided
# operand reads whole sectors
SECTOR_BYTES = 32


def footprint(load: LazyOp, shape: tuple[int, ...]) -> int:
  """Bytes of the elements a load reads over the whole loop shape (the axes it is broadcast along not counted)."""
  strides = load.arg.st.real_strides()
  return math.prod(size for size, stride in zip(shape, strides) if stride != 0) * load.dtype.itemsize


def interleaved_rows(kernel: Kernel, row_dims: list[int], rows: int) -> int:
  """How many neighbouring rows (along the last row axis `row_dims[-1]`) a block runs on neighbouring threads, else
  1: enough that a warp's load of the strided operand covers a sector, where the loads strided along the row but
  contiguous across the rows outweigh the loads contiguous along the row that differ across the rows (interleaving
  scatters those). Only on devices with warp shuffles; ROW_INTERLEAVE=0 turns it off."""
  warp_size, row_axes = kernel.renderer.warp_size, kernel.row_axes or ()
  if not ROW_INTERLEAVE.value or warp_size < 2 or not row_dims or not row_axes: return 1
  shape, inner, across_rows = kernel.full_shape, row_axes[-1], row_dims[-1]
  strided_bytes, contiguous_bytes, itemsizes = 0, 0, []
  for leaf in kernel.leaves:
    if leaf.op is not Ops.LOAD or not isinstance(leaf.arg, MemBuffer) or leaf.srcs: continue
    if any(leaf.arg.st.shape[axis] != 1 for axis in kernel.element_axes): continue   # an element reduce's load
    strides = leaf.arg.st.real_strides()
    if strides[inner] not in (0, 1, None) and strides[across_rows] == 1:
      strided_bytes += footprint(leaf, shape)
      itemsizes.append(leaf.dtype.itemsize)
    elif strides[inner] == 1 and strides[across_rows] != 0: contiguous_bytes += footprint(leaf, shape)
  if strided_bytes <= contiguous_bytes: return 1
  interleave = min(SECTOR_BYTES // min(itemsizes), warp_size)
  return interleave if interleave >= 2 and shape[across_rows] % interleave == 0 and rows % interleave == 0 else 1


def interleaved_combine(linearizer: BlockRowLinearizer, partial: UOp, op: Ops, thread: Node, threads: int, number: int,
                        place: Node, interleave: int) -> UOp:
  """Every thread's partial of its row combined, held by every thread of the row afterwards (`thread` of `threads`:
  the thread's place in its row; `place`: the row's among the block's `interleave` rows). A warp holds
  warp_size / interleave threads of each of its rows: a shuffle `interleave` lanes apart combines them; each warp's
  result goes to local memory (a slot per warp and row), which every thread of the row combines after a BARRIER."""
  build, dtype = linearizer.builder, partial.dtype
  in_warp = min(threads, linearizer.kernel.renderer.warp_size // interleave)
  reduced = build.add(UOps.WARP_REDUCE, dtype, (partial,), (op, in_warp, interleave))
  warps = threads // in_warp
  if warps == 1: return reduced
  local = build.add(UOps.DEFINE_LOCAL, dtype, (), (f"row{number}", warps * interleave))
  writer = build.add(UOps.IF, None, (linearizer.node_to_uop(thread % in_warp < 1),))
  build.add(UOps.STORE, None, (local, linearizer.node_to_uop(thread // in_warp * interleave + place), reduced))
  build.end_if(writer)
  build.add(UOps.BARRIER, None)
  total = build.add(UOps.LOAD, dtype, (local, linearizer.node_to_uop(place)))
  for warp in range(1, warps):
    slot = linearizer.node_to_uop(place + warp * interleave)
    total = build.alu(op, dtype, total, build.add(UOps.LOAD, dtype, (local, slot)))
  return total
