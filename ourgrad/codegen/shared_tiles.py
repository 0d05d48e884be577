"""The layout of SHARED tiles without tensor cores (a part of Kernel): which loads a block stages through local
memory and over which axes (`staged_loads`), how a tile's rows are numbered, padded and skewed, how many elements a
stage holds (halo tiles: codegen/halo_tiles.py), and the structure flags SHARED's amount carries (the SHARED_*
constants below; `decode_shared_amount` spells an amount out as a SharedStructure, which every printer of opts
uses). The Linearizer fills and reads the tiles (codegen/shared_tile_fill.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ourgrad.codegen.halo_tiles import HaloWindow, halo_window
from ourgrad.codegen.uops import AxisType
from ourgrad.helpers import prod
from ourgrad.ops import LazyOp, MemBuffer, Ops

if TYPE_CHECKING:
  from ourgrad.shape.shapetracker import ShapeTracker

# SHARED's amount without TC that pads each reduce element's row of a tile (16 bytes of float32: float4 reads stay
# aligned); the rows of a transposed fill then start in different banks
SHARED_TILE_PADDING = 4
# flags added to SHARED's amount without TC (the padding stays below SHARED_VECTOR_FILL), see Kernel.tile_flags:
# SHARED_VECTOR_FILL: a thread's 4 neighbouring tile elements (an operand contiguous along the tile's rows) stored as
# one float4 (one store, no bank conflicts) instead of 4 scalar stores;
# SHARED_TWO_BLOCKS: the kernel compiled for two resident blocks per multiprocessor (CUDA: __launch_bounds__'s
# minimum blocks, which caps the registers per thread), so one block's barrier waits hide behind the other's math;
# SHARED_ASYNC: the tiles filled by asynchronous copies (cp.async) in stages, no register prefetch; the amount's
# multiple of it is the stages less one (64: 2 stages, 128: 3, 192: 4)
# SHARED_ROW_SKEW: with padded rows, every group of SKEW_ROWS rows SKEW_ROWS elements further on (aligned), so the
# transposed fill of 16 reduce rows (4 float4s of an operand contiguous along the reduce, by 4 neighbouring threads)
# stores into 4 different bank groups (padding alone: rows 0 and 8 share one, a 2-way conflict)
# SHARED_REDUCE_INNER: the tile of an operand contiguous along the reduce (a@b's A) laid out with that reduce axis
# innermost, rows padded (not transposed): its fill is a straight copy (16-byte cp.async, float4 stores) and a thread
# reads 4 reduce elements of one row as a float4; conflict-free where a warp's threads take neighbouring rows (LOCAL
# before UPCAST along M: a thread's rows strided by the block's threads)
SHARED_VECTOR_FILL, SHARED_TWO_BLOCKS, SHARED_ASYNC, SHARED_ROW_SKEW, SHARED_REDUCE_INNER = 16, 32, 64, 256, 512
SHARED_ASYNC_MAX_STAGES, SKEW_ROWS = 4, 8


@dataclass(frozen=True)
class SharedStructure:
  """SHARED's amount without TC spelled out: the tiles' row padding and each structure flag (the SHARED_* constants
  above). `amount` packs it back into the int an Opt carries; `decode_shared_amount` unpacks one."""
  padding: int = 0
  vector_fill: bool = False
  two_blocks: bool = False
  async_stages: int = 0   # 0: register prefetch; 2..SHARED_ASYNC_MAX_STAGES: cp.async stages
  row_skew: bool = False
  reduce_inner: bool = False
  unknown: int = 0   # bits of an amount that no flag names (Kernel refuses such an amount)

  @property
  def amount(self) -> int:
    """The int SHARED's Opt carries for this structure."""
    flags = [(self.vector_fill, SHARED_VECTOR_FILL), (self.two_blocks, SHARED_TWO_BLOCKS),
             (self.row_skew, SHARED_ROW_SKEW), (self.reduce_inner, SHARED_REDUCE_INNER)]
    async_part = (self.async_stages - 1) * SHARED_ASYNC if self.async_stages else 0
    return self.padding + sum(value for present, value in flags if present) + async_part + self.unknown

  def __repr__(self) -> str: return f"SharedStructure({self.describe()})"   # a plan prints it (codegen/opt/plans.py)

  def describe(self) -> str:
    """"pad 4, VECTOR_FILL|TWO_BLOCKS|ROW_SKEW": the padding, then the flags by name, lowest bit first."""
    names = [name for present, name in [(self.vector_fill, "VECTOR_FILL"), (self.two_blocks, "TWO_BLOCKS"),
                                        (self.async_stages, f"ASYNC {self.async_stages} stages"),
                                        (self.row_skew, "ROW_SKEW"), (self.reduce_inner, "REDUCE_INNER"),
                                        (self.unknown, f"unknown {self.unknown}")] if present]
    return f"pad {self.padding}" + (f", {'|'.join(names)}" if names else "")


def decode_shared_amount(amount: int) -> SharedStructure:
  """SHARED's amount without TC as its padding and flags (the inverse of SharedStructure.amount)."""
  async_multiple = amount % SHARED_ROW_SKEW // SHARED_ASYNC   # the stages less one, in the bits under ROW_SKEW
  return SharedStructure(padding=amount % SHARED_VECTOR_FILL, vector_fill=bool(amount & SHARED_VECTOR_FILL),
                         two_blocks=bool(amount & SHARED_TWO_BLOCKS),
                         async_stages=async_multiple + 1 if async_multiple else 0,
                         row_skew=bool(amount & SHARED_ROW_SKEW), reduce_inner=bool(amount & SHARED_REDUCE_INNER),
                         unknown=amount - amount % (2 * SHARED_REDUCE_INNER))


class SharedTileLayout:
  """Kernel's SHARED tile layout (a mixin: Kernel supplies its views, axes and opts state)."""
  sts: list[ShapeTracker]
  leaves: list[LazyOp]
  shared_tiles: bool
  tensor_core: Any
  tile_padding: int
  tile_flags: int
  reduceop: LazyOp | None

  def staged_loads(self) -> list[tuple[int, list[int]]]:
    """With SHARED: (leaf number, tile axes) of each load the block's threads share (stride 0 along some LOCAL
    axis) while it varies along a reduce axis: its tile is every LOCAL, GROUP, UPCAST and UNROLL axis it varies
    along, laid out UNROLL outermost, the output's innermost UPCAST axis innermost, and the LOCAL, GROUP and other
    UPCAST axes in the output's order between (GROUP, a reduce axis, just outside the innermost): a thread reads its
    upcast values as float4s, and neighbouring threads neighbouring float4s (no bank conflicts), also where a
    thread's outputs are float4s strided by the block's threads. With GROUP each group thread's slice of the reduce
    step has its own part of the tile."""
    if not self.shared_tiles or self.reduceop is None: return []
    local_axes = list(range(self.global_dims, self.first_reduce))
    in_block = list(range(self.global_dims, self.first_loop_reduce)) + list(range(self.first_upcast, self.shape_len))
    reduce_axes = [axis for axis in range(self.first_reduce, self.shape_len) if self.is_reduce_axis(axis)]
    output_strides = self.sts[0].real_strides()
    # batch axes: outputs along which every load that varies along the reduce varies too
    reduce_loads = [self.sts[number].real_strides() for number, leaf in enumerate(self.leaves)
                    if leaf.op is Ops.LOAD and any(self.sts[number].real_strides()[axis] != 0 for axis in reduce_axes)]
    batch_axes = {axis for axis in range(self.first_reduce)
                  if reduce_loads and all(strides[axis] != 0 for strides in reduce_loads)}
    staged = []
    for number, leaf in enumerate(self.leaves):
      if leaf.op is not Ops.LOAD or not isinstance(leaf.arg, MemBuffer) or leaf.srcs: continue
      strides = self.sts[number].real_strides()
      shared = any(strides[axis] == 0 for axis in local_axes)
      if not shared or all(strides[axis] == 0 for axis in reduce_axes): continue
      # a load that varies along the reduce and no output axis but batch ones (a fused bias of the previous layer, or
      # one per head: the Q/K/V bias of attention) stays a global read (one cached address per warp): its tile of a
      # few elements would fill in a partial round, keeping the tiles single-staged
      output_axes = [axis for axis in list(range(self.first_reduce)) + self.upcast_axes if axis not in batch_axes]
      if self.tensor_core is None and all(strides[axis] == 0 for axis in output_axes): continue
      tile = [axis for axis in in_block if strides[axis] != 0]
      kinds = self.axis_types
      innermost = max((axis for axis in tile if kinds[axis] is AxisType.UPCAST),
                      key=lambda axis: -abs(output_strides[axis] or 0), default=None)

      # SHARED_REDUCE_INNER: an operand contiguous along an unrolled reduce axis keeps it innermost
      reduce_inner = next((axis for axis in tile if kinds[axis] is AxisType.UNROLL and strides[axis] == 1), None)
      if not self.tile_flags & SHARED_REDUCE_INNER or self.tensor_core is not None: reduce_inner = None

      def place(axis: int) -> tuple:
        if reduce_inner is not None: return (2, 0) if axis == reduce_inner else (1, -abs(output_strides[axis] or 0))
        if kinds[axis] is AxisType.UNROLL: return (0, 0)
        return (2, 0) if axis == innermost else (1, -abs(output_strides[axis] or 0))
      staged.append((number, sorted(tile, key=place)))
    return staged

  def staged_tile_bytes(self) -> int:
    """With SHARED (no TC): the bytes of one stage of every staged load's tile (its padding included)."""
    return sum(self.tile_elements(axes, leaf) * self.leaves[leaf].dtype.itemsize for leaf, axes in self.staged_loads())

  def halo_window(self, leaf: int, axes: list[int]) -> HaloWindow | None:
    """The halo layout of a staged tile whose axes overlap in memory (a convolution's input along its pixels and
    window taps: each element staged once), or None (codegen/halo_tiles.py)."""
    return halo_window(self, leaf, axes)

  def tile_row_axes(self, axes: list[int]) -> list[int]:
    """The axes whose indices number the rows of a staged tile (axes as staged_loads gives them), one row per
    combination: its leading UNROLL axes (a row is one reduce element's values: one input channel and window tap of a
    convolution), or with SHARED_REDUCE_INNER's layout every axis but the innermost reduce (a row is one output
    index's run of reduce elements)."""
    if self._rows_along_reduce(axes): return axes[:-1]
    rows = []
    for axis in axes:
      if self.axis_types[axis] is not AxisType.UNROLL: break
      rows.append(axis)
    return rows

  def _rows_along_reduce(self, axes: list[int]) -> bool:
    """SHARED_REDUCE_INNER's layout of a staged tile: the reduce axis innermost, after axes that are not reduces."""
    return (bool(self.tile_flags & SHARED_REDUCE_INNER) and len(axes) >= 2 and
            self.axis_types[axes[-1]] is AxisType.UNROLL and self.axis_types[axes[0]] is not AxisType.UNROLL)

  @property
  def async_tile_stages(self) -> int:
    """Stages of SHARED tiles filled by asynchronous copies (SHARED_ASYNC); 0: register prefetch or none."""
    return decode_shared_amount(self.tile_flags).async_stages

  @property
  def blocks_per_multiprocessor(self) -> int:
    """Resident blocks per multiprocessor the kernel is compiled for (SHARED_TWO_BLOCKS); 0: the compiler's
    choice."""
    return 2 if self.tile_flags & SHARED_TWO_BLOCKS else 0

  def tile_row_padding(self, axes: list[int]) -> int:
    """Elements after each row of a staged tile (tile_row_axes): SHARED's padding where the tile has rows and more
    than them, else 0."""
    row_axes = self.tile_row_axes(axes)
    if not self.tile_padding or not row_axes or len(row_axes) == len(axes): return 0
    return self.tile_padding

  def tile_row_skew(self, axes: list[int]) -> int:
    """Elements each group of SKEW_ROWS rows of a staged tile is shifted by (SHARED_ROW_SKEW, padded rows of reduce
    elements only)."""
    if not self.tile_flags & SHARED_ROW_SKEW or self._rows_along_reduce(axes): return 0
    return SKEW_ROWS if self.tile_row_padding(axes) else 0

  def tile_elements(self, axes: list[int], leaf: int | None = None) -> int:
    """One stage of a staged tile, in elements: its rows, each padded (tile_row_padding) and skewed in groups
    (tile_row_skew); staged load `leaf`'s halo tile where its axes overlap."""
    window = self.halo_window(leaf, axes) if leaf is not None else None
    if window is not None: return window.elements
    rows = prod(self.full_shape[axis] for axis in self.tile_row_axes(axes))
    skew = (rows - 1) // SKEW_ROWS * self.tile_row_skew(axes)
    return prod(self.full_shape[axis] for axis in axes) + rows * self.tile_row_padding(axes) + skew
