"""Transposing copies on GPUs: elementwise kernels whose output is contiguous along one axis while an input is
contiguous along another (`x.T.contiguous()`, a K-major matmul operand staged before the matmul, a (B, T, H, D) ->
(B, H, D, T) permute, or an expression such as gelu'(h) * g stored transposed).

Memory moves in 32-byte sectors: a warp's load or store instruction costs one transaction per distinct sector its
32 lanes touch. The plain elementwise default (heuristic._elementwise_rows, then _pick_thread_blocks) puts a warp's
lanes along the output's contiguous axis with a float4 store each, which is ideal for the stores, but then each lane's
load sits a whole input row away from its neighbour's: 32 sectors per load instruction for 128 useful bytes (an
eighth of each sector used; the H200 ran `x.T.contiguous()` of 4096 x 2304 float32 at ~1.2 TB/s, copy bandwidth 4.2).

`transpose_tiles(kernel)` gives each thread a register tile of TILE_SIDE x TILE_SIDE elements, upcast along both
axes: the linearizer reads each input column of the tile as one vector along the input's contiguous axis and writes
each output row as one vector along the output's, so both sides move 16-byte vectors (float32). A warp's lanes are
split between the two axes (`warp_split`) so that both its loads and its stores cover whole sectors: 16 lanes
along the output axis x 2 along the input axis for float32 (loads: 16 runs of 32 bytes, stores: 2 runs of 256
bytes, 16 sectors for 512 bytes each way, the fewest there can be; 8 x 4 for 16-bit types, whose elements move one
by one). The block takes more lanes along the input axis, up to BLOCK_THREADS (float32: a 64 x 64 tile). No local
memory and no barrier: the tile is transposed in registers.

An axis whose size the tile does not divide is padded to the block's extent along it (PADTO: masked loads and
stores at the edge); where that would pad more than half of it, or an axis is shorter than a sector, the kernel is
left to the plain default. `TransposeTile` is the plan (which axes, upcasts, lanes and paddings), `plan_for` finds
it, `TransposeTileStrategy` is the heuristic's strategy (`transpose_tiles` applies it in place); `warp_sectors`
counts the sectors each load and store of lowered UOps touches in one warp (the coalescing model behind the lane
split, read from the real index expressions).
"""
from __future__ import annotations

from dataclasses import dataclass

from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.codegen.opt.plans import Plan, Strategy, gpu_elementwise, register_plan
from ourgrad.codegen.uops import UOp, UOps
from ourgrad.dtype import dtypes
from ourgrad.helpers import power_of_two_divisor, prod
from ourgrad.ops import MemBuffer, exec_alu
from ourgrad.shape.shapetracker import ShapeTracker
from ourgrad.shape.symbolic import NumNode

# a thread's tile: this many elements along each of the two axes (float4 loads and float4 stores for float32)
TILE_SIDE = 4
# the unit DRAM and L2 move: a warp instruction costs one transaction per distinct 32-byte sector it touches
SECTOR_BYTES = 32
# lanes of a warp (the coalescing model's unit; renderers without shuffles report warp_size 0)
WARP_LANES = 32
# threads per block: the warp's split, grown along the input's contiguous axis
BLOCK_THREADS = 256


@register_plan
@dataclass(frozen=True)
class TransposeTile(Plan):
  """How a transposing elementwise kernel is tiled: its output's contiguous axis and an input's, the elements of each
  a thread holds (upcast), the threads of a block along each (lanes; the output axis's lanes are the launch's x), and
  the multiple each axis is padded to first (1: none)."""
  out_axis: int
  in_axis: int
  out_upcast: int
  in_upcast: int
  out_lanes: int
  in_lanes: int
  out_pad: int = 1
  in_pad: int = 1

  def pads(self) -> list[Opt]:
    """The PADTO opts (they keep every axis's number)."""
    return [Opt(OptOps.PADTO, axis, multiple) for axis, multiple in ((self.out_axis, self.out_pad),
                                                                      (self.in_axis, self.in_pad)) if multiple > 1]

  def apply(self, kernel: Kernel) -> bool:
    """The paddings, then the upcasts and threads."""
    return all(kernel.try_opt(pad) for pad in self.pads()) and kernel.try_output_opts(self.output_opts())

  def output_opts(self) -> list[Opt]:
    """Both upcasts, then the output axis's threads before the input axis's (the LOCAL applied first becomes the
    launch's x: consecutive lanes), numbered as the kernel's axes are before the first (Kernel.try_output_opts)."""
    return [Opt(OptOps.UPCAST, self.in_axis, self.in_upcast), Opt(OptOps.UPCAST, self.out_axis, self.out_upcast),
            Opt(OptOps.LOCAL, self.out_axis, self.out_lanes), Opt(OptOps.LOCAL, self.in_axis, self.in_lanes)]


def contiguous_global_axis(strides: tuple[int | None, ...], shape: tuple[int, ...], global_dims: int) -> int | None:
  """The global axis (size above 1) along which a view with these strides steps by one element; None if none."""
  for axis in range(global_dims):
    if strides[axis] == 1 and shape[axis] > 1: return axis
  return None


def unit_step_axis(st: ShapeTracker, shape: tuple[int, ...], global_dims: int) -> int | None:
  """The global axis along which a view steps by one element: its real stride is 1, or (a view whose index is not
  affine in the axis, a reshape of a permuted view: y's heads merged back into rows, then transposed) its first
  TILE_SIDE positions from the origin are neighbouring elements; None if none."""
  strides = st.real_strides()
  found = contiguous_global_axis(strides, shape, global_dims)
  if found is not None or len(st.views) == 1: return found
  for axis in range(global_dims):
    if strides[axis] is not None or not isinstance(shape[axis], int) or shape[axis] < TILE_SIDE: continue
    points = [st.expr_idxs([NumNode(step if number == axis else 0) for number in range(len(shape))])[0]
              for step in range(TILE_SIDE)]
    if all(isinstance(point, NumNode) and point.b == points[0].b + step for step, point in enumerate(points)):
      return axis
  return None


def transposed_axes(kernel: Kernel) -> tuple[int, int] | None:
  """(the output's contiguous axis, an input's other contiguous axis) of an unoptimized elementwise kernel whose
  largest input (by the bytes it reads) is contiguous along an axis the output is not; None where it is not (a small
  input read across the output, LayerNorm's per-token statistics, asks for no tile). Several stores must share their
  contiguous axis."""
  if kernel.reduceop is not None or kernel.applied_opts or kernel.row_axes is not None: return None
  shape, global_dims = kernel.full_shape, kernel.global_dims
  if not all(isinstance(size, int) for size in shape): return None   # a symbolic size: the tile cannot pad to it
  store_count = len(kernel.stores)
  out_axes = {unit_step_axis(st, shape, global_dims) for st in kernel.sts[:store_count]}
  if len(out_axes) != 1 or None in out_axes: return None
  out_axis = out_axes.pop()
  reads: list[tuple[int, int | None]] = []   # (bytes read, contiguous axis) of each input buffer
  for st, leaf in zip(kernel.sts[store_count:], kernel.leaves[store_count:]):
    if not isinstance(leaf.arg, MemBuffer): continue
    strides = st.real_strides()
    read = prod(size for size, stride in zip(shape, strides) if stride != 0) * leaf.dtype.itemsize
    reads.append((read, unit_step_axis(st, shape, global_dims)))
  if not reads: return None
  largest = max(read for read, _ in reads)
  transposed = [axis for read, axis in reads if read == largest and axis is not None and axis != out_axis]
  return (out_axis, transposed[0]) if transposed else None


def warp_split(out_bytes: int, in_bytes: int, warp: int = WARP_LANES) -> int:
  """Lanes of a warp along the output axis (the rest along the input axis) for threads that store `out_bytes` and
  load `in_bytes` contiguous bytes each: the split whose load and store instructions touch the fewest sectors in
  all, then the longer store runs."""
  def sectors(out_lanes: int) -> int:
    in_lanes = warp // out_lanes
    store_sectors = in_lanes * -(-out_lanes * out_bytes // SECTOR_BYTES)
    load_sectors = out_lanes * -(-in_lanes * in_bytes // SECTOR_BYTES)
    return store_sectors + load_sectors
  splits = [1 << power for power in range(warp.bit_length()) if (1 << power) <= warp]
  return min(splits, key=lambda out_lanes: (sectors(out_lanes), -out_lanes))


def _axis_tiling(size: int, upcast: int, lanes_wanted: int, lanes_needed: int) -> tuple[int, int] | None:
  """(lanes, padded multiple) along one axis: the most lanes up to `lanes_wanted` whose tile divides `size`, at least
  `lanes_needed` (a warp's share); else `size` padded to the wanted tile, where that pads at most half of it."""
  if size % upcast == 0:
    lanes = power_of_two_divisor(size // upcast, lanes_wanted)
    if lanes >= lanes_needed: return lanes, 1
  multiple = upcast * lanes_wanted
  if -(-size // multiple) * multiple > 2 * size: return None
  return lanes_wanted, multiple


def plan_for(kernel: Kernel) -> TransposeTile | None:
  """The register-tile plan of a transposing elementwise GPU kernel (module docstring), or None where the kernel is
  not one, an axis is shorter than a sector of its buffer, or the tile would need more padding than PADTO allows."""
  renderer = kernel.renderer
  if not renderer.has_threads: return None
  axes = transposed_axes(kernel)
  if axes is None: return None
  out_axis, in_axis = axes
  shape = kernel.full_shape
  buffer_dtypes = {leaf.dtype for leaf in kernel.leaves if isinstance(leaf.arg, MemBuffer)}
  itemsize = max(dtype.itemsize for dtype in buffer_dtypes)
  if min(shape[out_axis], shape[in_axis]) * itemsize < SECTOR_BYTES: return None
  warp = renderer.warp_size or WARP_LANES
  threads = min(BLOCK_THREADS, renderer.max_threads)
  # what a lane moves per instruction: the linearizer makes float4 vectors of float32 only; other dtypes load and
  # store element by element, and a warp instruction then covers a lane's single element
  vectors = buffer_dtypes == {dtypes.float32} and getattr(renderer, "vector_width", 0) >= TILE_SIDE
  lane_bytes = TILE_SIDE * itemsize if vectors else itemsize
  out_lanes = warp_split(lane_bytes, lane_bytes, warp)
  out_tiling = _axis_tiling(shape[out_axis], TILE_SIDE, out_lanes, out_lanes)
  in_tiling = _axis_tiling(shape[in_axis], TILE_SIDE, max(threads // out_lanes, 1), max(warp // out_lanes, 1))
  if out_tiling is None or in_tiling is None: return None
  return TransposeTile(out_axis, in_axis, TILE_SIDE, TILE_SIDE, out_tiling[0], in_tiling[0], out_tiling[1],
                       in_tiling[1])


class TransposeTileStrategy(Strategy):
  """A GPU elementwise kernel that transposes (module docstring): the register-tile plan `plan_for` finds."""
  name = "transpose_tiles"

  def applies(self, kernel: Kernel) -> bool: return gpu_elementwise(kernel)

  def choose(self, kernel: Kernel) -> tuple[Plan, Kernel] | None:
    plan = plan_for(kernel)
    if plan is None: return None
    trial = kernel.copy()
    return (plan, trial) if plan.apply(trial) else None   # an opt may not apply (a renderer limit)


def transpose_tiles(kernel: Kernel) -> bool:
  """Apply the register-tile plan in place where `plan_for` finds one; False (the kernel untouched) where it finds
  none or an opt does not apply."""
  chosen = TransposeTileStrategy().choose(kernel)
  if chosen is not None: kernel.__dict__.update(chosen[1].__dict__)
  return chosen is not None


@dataclass(frozen=True)
class WarpAccess:
  """One global load or store instruction of a warp: its buffer, the bytes each lane moves, the lanes that move them
  (not masked off) and the distinct sectors (numbered from the buffer's start) they touch."""
  op: UOps
  buffer: int
  lane_bytes: int
  lanes: int
  touched: frozenset[int]

  @property
  def sectors(self) -> int: return len(self.touched)

  @property
  def efficiency(self) -> float:
    """Useful bytes over the bytes of the sectors touched (1.0: every sector used whole)."""
    return self.lanes * self.lane_bytes / (self.sectors * SECTOR_BYTES) if self.touched else 1.0


def warp_sectors(uops: list[UOp], warp: int = WARP_LANES, block: float = 0.0) -> list[WarpAccess]:
  """The global LOADs and STOREs of lowered UOps as the first warp of one block runs them (loops at their first
  iteration), each with the distinct SECTOR_BYTES sectors its lanes touch, from the index expressions themselves.
  `block` places the block along each block index (0: block 0; 0.5: the middle one, inside a cat's later parts).
  Lanes walk the thread indices x fastest; lanes whose access is masked off touch nothing. Accesses whose index
  depends on a loaded value (a gather) are left out."""
  local_sizes = sorted((uop.arg[2], uop.arg[1]) for uop in uops if uop.op is UOps.SPECIAL and uop.arg[0][0] == "l")
  values: dict[int, list[int]] = {}
  accesses: list[WarpAccess] = []
  for uop in uops:
    if uop.op is UOps.SPECIAL:
      block_index = int(uop.arg[1] * block) if isinstance(uop.arg[1], int) else 0
      values[id(uop)] = [_thread_index(lane, uop.arg[2], local_sizes) if uop.arg[0][0] == "l" else block_index
                         for lane in range(warp)]
    elif uop.op is UOps.CONST and isinstance(uop.arg, (int, bool)):
      values[id(uop)] = [uop.arg] * warp
    elif uop.op is UOps.RANGE and id(uop.srcs[0]) in values:
      values[id(uop)] = values[id(uop.srcs[0])]
    elif uop.op is UOps.ALU and uop.dtype is not None and not uop.dtype.is_float and \
        all(id(src) in values for src in uop.srcs):
      values[id(uop)] = [exec_alu(uop.arg, uop.dtype, tuple(values[id(src)][lane] for src in uop.srcs))
                         for lane in range(warp)]
    elif uop.op in (UOps.LOAD, UOps.STORE) and uop.srcs[0].op is UOps.DEFINE_GLOBAL:
      access = _access(uop, values, warp)
      if access is not None: accesses.append(access)
  return accesses


def _thread_index(lane: int, dimension: int, local_sizes: list[tuple[int, int]]) -> int:
  """The thread index along launch `dimension` of `lane` (x varies fastest)."""
  for launch_dimension, size in local_sizes:
    if launch_dimension == dimension: return lane % size
    lane //= size
  return 0


def _access(uop: UOp, values: dict[int, list[int]], warp: int) -> WarpAccess | None:
  if id(uop.srcs[1]) not in values: return None
  width = uop.arg if isinstance(uop.arg, int) else 1
  # a gate is the last source of a LOAD (buffer, index, valid) or a scalar STORE (buffer, index, value, valid)
  has_valid = len(uop.srcs) == 3 if uop.op is UOps.LOAD else (width == 1 and len(uop.srcs) == 4)
  valid = values.get(id(uop.srcs[-1])) if has_valid else [True] * warp
  if valid is None: return None
  element_bytes = uop.srcs[0].dtype.itemsize
  lane_bytes = width * element_bytes
  lanes = [lane for lane in range(warp) if valid[lane]]
  touched = frozenset((values[id(uop.srcs[1])][lane] * element_bytes + offset) // SECTOR_BYTES
                      for lane in lanes for offset in (0, lane_bytes - 1))
  return WarpAccess(uop.op, uop.srcs[0].arg[0], lane_bytes, len(lanes), touched)



def footprint_efficiency(accesses: list[WarpAccess], op: UOps) -> float:
  """Useful bytes over the bytes of the distinct sectors all of a warp's `op` instructions touch together (what
  reaches DRAM once the L1 cache merges a thread's neighbouring accesses)."""
  chosen = [access for access in accesses if access.op is op]
  touched = {(access.buffer, sector) for access in chosen for sector in access.touched}
  useful = sum(access.lanes * access.lane_bytes for access in chosen)
  return useful / (len(touched) * SECTOR_BYTES) if touched else 1.0
