"""The producer's copy addressing of the warpgroup-MMA matmul (codegen/wgmma_tiles.py): where each 16-byte piece of
an operand's tile of one K step comes from in global memory and lands in the 128-byte-swizzled shared-memory stage,
and which pieces each copying thread moves. The formulas evaluate on ints, numpy arrays (the emulator) and
wgmma_tiles.CExpr (the CUDA source) alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
  from ourgrad.codegen.wgmma_tiles import WgmmaMatmul


# one row of a swizzled tile: 128 bytes; 8 rows form one swizzle atom of 1024 bytes (aligned to 1024)
ROW_BYTES, ATOM_BYTES, PIECE_BYTES = 128, 1024, 16


def piece_fields(plan: WgmmaMatmul, piece, k_major: bool):
  """(column, row, chunk) of an operand tile's 16-byte piece `piece`: 8 pieces (one 128-byte row) to a row, then the
  rows (K-major: the tile's M or N rows; MN-major: block_k K rows), then the 64-element chunks along M or N (MN-major;
  K-major: 0). The copying threads take consecutive pieces: a warp reads 4 rows of 128 bytes."""
  column, rest = piece % 8, piece // 8
  if k_major: return column, rest, 0
  return column, rest % plan.block_k, rest // plan.block_k


def operand_piece(plan: WgmmaMatmul, k_major: bool, row_stride: int, base: int, column, row, chunk, step):
  """(element offset in the operand from the block's first row or column, byte offset in the stage) of the piece at
  (column, row, chunk) of K step `step` (piece_fields), the tile starting `base` bytes into the stage. K-major: row
  `row` (M or N) of the tile, its 128 bytes of K step `step`; MN-major: K row step * block_k + row, 64 elements of
  M or N from chunk * 64, the next 64 after block_k rows. Rows of 128 bytes, swizzled (piece ^= row in the atom)."""
  swizzle = (column ^ (row & 7)) << 4
  if k_major: return (row * row_stride + step * plan.block_k + column * plan.piece_elements,
                      base + row * ROW_BYTES + swizzle)
  return ((step * plan.block_k + row) * row_stride + (chunk * 8 + column) * plan.piece_elements,
          base + chunk * (plan.block_k * ROW_BYTES) + row * ROW_BYTES + swizzle)


def a_copy(plan: WgmmaMatmul, piece, step):
  """(element offset in A from the block's first row (column for K x M), byte offset in the stage) of A's 16-byte
  piece `piece` of K step `step` (operand_piece)."""
  return operand_piece(plan, plan.a_k_major, plan.a_row_stride, 0, *piece_fields(plan, piece, plan.a_k_major), step)


def b_copy(plan: WgmmaMatmul, piece, step):
  """(element offset in B from the block's first column (row for N x K), byte offset in the stage) of B's piece
  `piece`: as A's, after A's tile in the stage."""
  return operand_piece(plan, plan.b_k_major, plan.b_row_stride, plan.a_stage_bytes,
                       *piece_fields(plan, piece, plan.b_k_major), step)


def thread_copies(plan: WgmmaMatmul, operand: str, thread, threads: int, step):
  """The pieces of `operand` ("a" or "b") that copying thread `thread` of `threads` moves in K step `step` (pieces
  thread, thread + threads, ...), as (its first piece's (source, target), [(source, target) offsets of the others
  from it: constants]); None where they are no such constants (the pieces do not divide evenly among the threads, or
  an MN-major tile's block_k rows are no whole number of the threads' rows). Consecutive threads take consecutive
  pieces, so a thread's column and the row in the swizzle atom stay the same from one of its pieces to the next:
  the kernel adds constants to one address (no division per piece)."""
  k_major, row_stride, block = ((plan.a_k_major, plan.a_row_stride, plan.block_m) if operand == "a" else
                                (plan.b_k_major, plan.b_row_stride, plan.block_n))
  base = 0 if operand == "a" else plan.a_stage_bytes
  pieces, rows_per_pass = block * plan.block_k // plan.piece_elements, threads // 8
  if pieces % threads or rows_per_pass % 8 or (not k_major and plan.block_k % rows_per_pass): return None
  first = operand_piece(plan, k_major, row_stride, base, thread % 8, thread // 8, 0, step)
  origin = operand_piece(plan, k_major, row_stride, base, 0, 0, 0, 0)
  offsets = []
  for number in range(pieces // threads):
    rest = rows_per_pass * number
    row, chunk = (rest, 0) if k_major else (rest % plan.block_k, rest // plan.block_k)
    source, target = operand_piece(plan, k_major, row_stride, base, 0, row, chunk, 0)
    offsets.append((source - origin[0], target - origin[1]))
  return first, offsets
