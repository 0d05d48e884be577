"""The local-memory tiles of a tensor-core kernel staged through shared memory (OptOps.TC, then OptOps.SHARED): which
instruction and operands TC applied (AppliedTensorCore) and how each operand's block tile lies in local memory
(TileLayout, `tensor_core_tiles`). Kernel applies the opts (codegen/kernel.py); the linearizer fills and reads the
tiles (codegen/tensor_core_tiles.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ourgrad.codegen.matmul_operands import is_plain_load, matmul_operands, operand_leaves
from ourgrad.codegen.opts import TC_TILE_PADDING, KernelOptError
from ourgrad.codegen.tensor_cores import TensorCore
from ourgrad.helpers import prod
from ourgrad.ops import LazyOp

if TYPE_CHECKING:
  from ourgrad.codegen.kernel import Kernel


@dataclass(frozen=True)
class AppliedTensorCore:
  """OptOps.TC on a kernel: the instruction, and the A (m x k) and B (k x n) operands it reads (LOADs of the AST)."""
  tc: TensorCore
  a: LazyOp
  b: LazyOp


def tensor_core_operands(reduceop: LazyOp | None, tc: TensorCore) -> tuple[LazyOp, LazyOp]:
  """The two operands a matmul-shaped reduce multiplies, when the instruction `tc` computes it: loads, or elementwise
  expressions of loads evaluated per fragment element (see codegen/matmul_operands.py)."""
  return matmul_operands(reduceop, tc.dtype_in, tc.dtype_out, f"TC {tc}", computed=True)


@dataclass(frozen=True)
class TileLayout:
  """A tensor-core operand's block tile in local memory (OptOps.SHARED after TC). The tile holds the operand at
  every index of its tile axes (the in-block axes it varies along) for one reduce step, in the operand's own memory
  order (`axes`, outermost first): the last `row_axes` axes are contiguous in global memory and form a row of
  `row_length` elements, copied in 16-byte pieces; each row is followed by `padding` unused elements so that the
  8 rows one ldmatrix matrix reads fall in different banks. `transposed`: a row runs along M (N) rather than K, so
  the fragments are loaded with ldmatrix .trans. `stages` copies of the tile (double buffering).

  An operand whose view has no plain stride inside the block (a load through several views) is laid out K-contiguous
  (rows along K, the instruction's k innermost) and copied element by element through its index math. `computed`:
  the operand is an expression of loads (a fused bias, a sum of padded loads), so each element is computed and stored
  (converted to the operand's dtype as a buffer holds it) rather than copied from one buffer."""
  axes: tuple[int, ...]
  row_axes: int
  row_length: int
  rows: int
  padding: int
  transposed: bool
  stages: int
  computed: bool = False

  @property
  def stage_size(self) -> int: return self.rows * (self.row_length + self.padding)


def tensor_core_tiles(kernel: Kernel) -> tuple[TileLayout, TileLayout]:
  """With TC and SHARED: the local-memory layouts of the A and B tiles (see TileLayout). Raises KernelOptError
  where they do not fit the staged path: a reduce loop at least, and tile rows of whole 8-element pieces. A load
  with plain non-negative strides inside the block, innermost along the instruction's K or M (N) axis, is laid out
  in its memory order (contiguous: 16-byte copies; else element by element, as a convolution's filter along its
  input channels); any other operand K-contiguous, through its index math (_index_math_tile).
  Several reduce loops (a convolution's channels and window) are walked as one flat loop of steps."""
  applied = kernel.tensor_core
  assert applied is not None
  if kernel.first_upcast == kernel.first_loop_reduce:
    raise KernelOptError(f"SHARED with TC needs a reduce loop to stage along, {kernel.name} has none (an UNROLL took "
                         f"all of it)")
  m_axis, n_axis, k_axis = kernel.shape_len - 3, kernel.shape_len - 2, kernel.shape_len - 1
  return (_tensor_core_tile(kernel, applied.a, m_axis, k_axis), _tensor_core_tile(kernel, applied.b, n_axis, k_axis))


def _tensor_core_tile(kernel: Kernel, operand: LazyOp, row_axis: int, k_axis: int) -> TileLayout:
  in_block = list(range(kernel.global_dims, kernel.first_reduce)) + list(range(kernel.first_upcast, kernel.shape_len))
  strides = _layout_strides(kernel, operand, in_block)
  if strides is None: return _index_math_tile(kernel, operand, in_block, k_axis)
  axes = sorted((axis for axis in in_block if strides[axis] != 0), key=lambda axis: -strides[axis])
  innermost = axes[-1]
  # innermost along another tile axis (an M tile's upcast): no 16-byte rows along the instruction's axes
  if innermost not in (row_axis, k_axis): return _index_math_tile(kernel, operand, in_block, k_axis)
  transposed = innermost != k_axis
  # the row: the innermost axes while they stay contiguous and along the same matrix direction (K, or M/N)
  row_axes, row_length = 1, kernel.full_shape[innermost]
  for outer, inner in zip(reversed(axes[:-1]), reversed(axes[1:])):
    if strides[outer] != strides[inner] * kernel.full_shape[inner]: break
    if kernel.is_reduce_axis(outer) == transposed: break
    row_axes, row_length = row_axes + 1, row_length * kernel.full_shape[outer]
  computed = not is_plain_load(operand)
  if row_length % 8 and computed: return _index_math_tile(kernel, operand, in_block, k_axis)
  if row_length % 8: raise KernelOptError(f"SHARED with TC: tile rows of {row_length} elements (ldmatrix reads 8)")
  rows = prod(kernel.full_shape[axis] for axis in axes) // row_length
  # a K-contiguous TF32 tile: rows of 144 bytes put ldmatrix's 8 rows of 16 bytes (lane (group, quad) reading row
  # group, float quad) in distinct banks; 8 floats of padding (160-byte rows) would put two rows in each
  tf32_rows = kernel.tensor_core is not None and kernel.tensor_core.tc.is_tf32 and not transposed
  padding = TC_TILE_PADDING // 2 if tf32_rows else TC_TILE_PADDING
  return TileLayout(tuple(axes), row_axes, row_length, rows, padding, transposed, kernel.tile_stages, computed)


def _layout_strides(kernel: Kernel, operand: LazyOp, in_block: list[int]) -> tuple[int, ...] | None:
  """The strides that order an operand's tile: a load's own; for an expression of loads, those of one of its loads
  that varies along every in-block axis the expression does (q of `q + bias`), so that neighbouring threads of the
  fill read neighbouring memory. None where no such load has plain non-negative strides inside the block (or a
  load's validity varies along an axis its index does not: a padded broadcast)."""
  varies = kernel.operand_varies(operand)
  wanted = {axis for axis in in_block if varies[axis]}
  leaves = [operand] if is_plain_load(operand) else [leaf for leaf in operand_leaves(operand) if is_plain_load(leaf)]
  for leaf in leaves:
    strides = kernel.sts[kernel.leaf_number(leaf)].real_strides()
    if any(strides[axis] is None or strides[axis] < 0 for axis in in_block): continue
    if {axis for axis in in_block if strides[axis] != 0} == wanted: return strides
  return None


def _index_math_tile(kernel: Kernel, operand: LazyOp, in_block: list[int], k_axis: int) -> TileLayout:
  """The tile of an operand without plain strides inside the block (an expression of loads, a load through several
  views, a flipped view): the in-block axes it varies along, output axes first, then the reduce axes as one row
  (the instruction's k innermost, so ldmatrix reads 8 K-neighbours), filled element by element through the
  kernel's index math."""
  varies = kernel.operand_varies(operand)
  axes = [axis for axis in in_block if varies[axis] and not kernel.is_reduce_axis(axis)]
  row = [axis for axis in in_block if varies[axis] and kernel.is_reduce_axis(axis) and axis != k_axis] + [k_axis]
  row_length = prod(kernel.full_shape[axis] for axis in row)
  if row_length % 8: raise KernelOptError(f"SHARED with TC: tile rows of {row_length} elements (ldmatrix reads 8)")
  rows = prod(kernel.full_shape[axis] for axis in axes)
  computed = not is_plain_load(operand)
  tf32 = kernel.tensor_core is not None and kernel.tensor_core.tc.is_tf32
  padding = TC_TILE_PADDING // 2 if tf32 else TC_TILE_PADDING   # 4-byte elements: see _tensor_core_tile
  return TileLayout(tuple(axes + row), len(row), row_length, rows, padding, False, kernel.tile_stages, computed)
