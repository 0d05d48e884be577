"""How a large reduce is built as more than one lazy op: the device's split of a reduce into partial results and
their sum (GPU split-K, a CPU's reduce blocks), and the CPU's packed matmul (its streamed operand copied into column
tiles first). LazyBuffer.reduce asks here; everything is made of LazyBuffer ops, so nothing here runs a kernel.

These are decisions that need the device's facts (its renderer: multiprocessors, L2, vector registers); they read
the graph only around the reduced value (its sources' views). Each is made in two steps: `reduce_plan` decides (a
typed plan: PackedMatmul, PackedGathered, SplitMatmul, SplitReduce, or None) and `build_reduce` builds the plan's
lazy ops. An eager loop builds the same reduces at every step, so the decisions are remembered, keyed by every fact
they read (`_plan_key`: the reduce, its view, its base's sources' views and dtypes, the device's facts and the
settings; the loads a value takes, the one fact that walks the graph, only where a decision asked for it): a
repeated step pays a key per reduce, not the decisions (3-9 us a reduce before, most of a GPU backward's graph
building).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Union

from ourgrad.codegen.opt.cpu_tiles import (cpu_gathered_pack, cpu_gathered_reduce_parts, cpu_pack_columns,
                                          cpu_reduce_parts)
from ourgrad.codegen.opt import split_reduce, tensor_core_plans
from ourgrad.codegen.opt.heuristic import register_tiles_pay_off
from ourgrad.codegen.opt.matmul_grid import split_k_parts, wgmma_split_parts
from ourgrad.codegen.opt.split_reduce import ReduceKind, ReduceSplit, SplitFacts, leaves_device_idle, plan_split
from ourgrad.device import Device
from ourgrad.dtype import dtypes
from ourgrad.helpers import MATMUL_GRID, prod, register_cache_clearer, tf32_allowed
from ourgrad.ops import ADD, CAST, CONST, ELEMENTWISE_OPS, MUL, SUM, Ops
from ourgrad.shape.symbolic import is_symbolic
from ourgrad.shape.shapetracker import ShapeTracker
from ourgrad.shape.view import strides_for_shape

if TYPE_CHECKING:
  from ourgrad.lazy import LazyBuffer

# a split matmul with many outputs (MATMUL_GRID) sums at most this many parts by elementwise adds in its consumer
MATMUL_SUM_PARTS = 8
# a matmul-like split whose parts are single slices of the split axis (MNIST's conv1 weight gradient: 256 parts, one
# image each) also splits its second-longest reduce axis (the image rows) into this many row parts, where they divide
# it: more blocks for a kernel that has one per image (1: no row split)
GPU_SPLIT_ROW_PARTS = 1


# ---------------------------------------------------------------- plans: what a reduce is built as


@dataclass(frozen=True)
class PackedMatmul:
  """A float32 matmul on a host CPU read with its streamed operand packed in column tiles of `tile` columns
  (cpu_packed_matmul)."""
  tile: int


@dataclass(frozen=True)
class PackedGathered:
  """A product summed on a host CPU with factor `factor` read from a copy whose axis `column` is innermost, its
  reduce axis number `reduce_axis` (of the reduce's axes) summed in `parts` parts (cpu_packed_gathered)."""
  factor: int
  column: int
  reduce_axis: int
  parts: int


@dataclass(frozen=True)
class SplitMatmul:
  """A float32 matmul on a GPU summed over its reduce axis in `parts` partial products (_split_matmul)."""
  parts: int


@dataclass(frozen=True)
class SplitReduce:
  """A reduce in two stages (split_reduce.ReduceSplit); `grid`: the CPU matmul's reduce blocks, whose partials are
  added elementwise (_sum_parts) rather than reduced."""
  split: ReduceSplit
  grid: bool


ReducePlan = Union[PackedMatmul, PackedGathered, SplitMatmul, SplitReduce]

# the remembered decisions: _plan_key -> a plan, None, or _NEEDS_LOADS (the decision asked how many buffers a value
# loads: then (key, loads) -> a plan or None). Bounded: cleared when full
_PLANS: dict[Any, Any] = {}
_PLANS_MAX = 4096
_NEEDS_LOADS = "needs the loads a value takes"
_MISSING = object()
register_cache_clearer(_PLANS.clear)


@dataclass
class PlanStats:
  """How often reduce_plan decided (made the decisions) and how often it found them remembered."""
  decided: int = 0
  remembered: int = 0


plan_stats = PlanStats()


def reduce_plan(lazy: LazyBuffer, op: Ops, axes: tuple[int, ...], out_shape: tuple[int, ...],
                split: bool) -> ReducePlan | None:
  """How LazyBuffer.reduce builds `op` of `lazy` over `axes` (sorted, none of size 1; `out_shape` the kept shape):
  None for one plain reduce. `split`: a split may be planned (False for the stages of a split). Remembered: see the
  module docstring."""
  if lazy.device.startswith("DISK"): return None
  renderer = Device[lazy.device].renderer
  # unsplit, only a host CPU's packing is left to decide (the stages of a GPU split: no key to build)
  if not split and not getattr(renderer, "l2_cache_bytes", 0): return None
  key = _plan_key(lazy, op, axes, split, renderer)
  if key is None: return _decide(lazy, op, axes, out_shape, split, renderer, lambda: _count_loads(lazy))
  plan = _PLANS.get(key, _MISSING)
  if plan is _NEEDS_LOADS:
    key = (key, _count_loads(lazy))
    plan = _PLANS.get(key, _MISSING)
    if plan is not _MISSING:
      plan_stats.remembered += 1
      return plan
    plan_stats.decided += 1
    return _remember(key, _decide(lazy, op, axes, out_shape, split, renderer, key[1]))
  if plan is not _MISSING:
    plan_stats.remembered += 1
    return plan
  plan_stats.decided += 1
  asked: list[int] = []
  def loads() -> int:
    asked.append(_count_loads(lazy))
    return asked[-1]
  plan = _decide(lazy, op, axes, out_shape, split, renderer, loads)
  # a decision that asked for the loads asks for them wherever its key is met again (the key holds every other fact)
  if asked:
    _remember(key, _NEEDS_LOADS)
    key = (key, asked[0])
  return _remember(key, plan)


def _remember(key: Any, plan: Any) -> Any:
  if len(_PLANS) >= _PLANS_MAX: _PLANS.clear()
  _PLANS[key] = plan
  return plan


def _plan_key(lazy: LazyBuffer, op: Ops, axes: tuple[int, ...], split: bool, renderer: Any) -> tuple | None:
  """Every fact the decisions read (_decide and the functions it calls), the loads a value takes aside; None where the
  view holds a Variable (not remembered). Built at every reduce, so it reads plain attributes only."""
  if lazy.st.symbolic: return None   # (a remembered attribute of the interned tracker: no loop over the sizes)
  base = lazy._base or lazy
  # a product's factors are read (where the reduced value is the product or a plain view of it: lazy.st and
  # base.shape below tell which), and on a GPU the matmul settings (only a product is split as a matmul)
  if base.op is MUL:
    sources: Any = tuple(map(_factor_facts, base.srcs))
    settings = (MATMUL_GRID.value, tf32_allowed()) if renderer.runs_thread_blocks else None
  else: sources, settings = len(base.srcs), None
  return (op, axes, split, lazy.device, lazy.dtype, lazy.st, base.shape, base.op, base.realized is not None,
          base.forced_realize, sources, settings, _device_facts(renderer))


def _factor_facts(factor: LazyBuffer) -> tuple:
  """What the decisions read of a product's factor: its view and dtype, its base's op and shape (a packed copy's
  bytes), and the dtype a cast widens from."""
  base = factor._base
  if base is None: base = factor
  widened_from = base.srcs[0].dtype if base.op is CAST and base.srcs else None
  return (factor.st, factor.dtype, base.op, base.shape, widened_from)


def _device_facts(renderer: Any) -> tuple:
  """The device facts and module settings the decisions read (tests change them at run time)."""
  if not renderer.runs_thread_blocks:
    return (id(renderer), getattr(renderer, "l2_cache_bytes", 0), getattr(renderer, "vector_bytes", 0),
            getattr(renderer, "vector_registers", 0))
  return (id(renderer), True, split_reduce.FACTS_OVERRIDE, getattr(renderer, "multiprocessors", 0),
          getattr(renderer, "threads_per_multiprocessor", 0), getattr(renderer, "launch_bytes", 0),
          getattr(renderer, "latency_bytes", 0), getattr(renderer, "has_wgmma", False),
          getattr(renderer, "dynamic_local_memory_bytes", 0), tensor_core_plans.WGMMA_MIN_WORK,
          tensor_core_plans.WGMMA_STAGED_TILE, MATMUL_SUM_PARTS)


def _decide(lazy: LazyBuffer, op: Ops, axes: tuple[int, ...], out_shape: tuple[int, ...], split: bool,
            renderer: Any, loads: int | Callable[[], int]) -> ReducePlan | None:
  """The decisions themselves: a host CPU's packed sum first, then the device's split (`split` only)."""
  if op is SUM and getattr(renderer, "l2_cache_bytes", 0):   # (only a host CPU's runtime tells it the L2 size)
    dims = _dense_matmul_dims(lazy, axes)
    if dims is not None:
      tile = _packed_matmul_tile(lazy, dims, renderer)
      if tile: return PackedMatmul(tile)
    else:
      gathered = _packed_gathered_plan(lazy, axes, renderer)
      if gathered is not None: return gathered
  if not split: return None
  return _split_plan(lazy, axes, out_shape, renderer, loads)


def build_reduce(lazy: LazyBuffer, op: Ops, axes: tuple[int, ...], out_shape: tuple[int, ...],
                 plan: ReducePlan) -> LazyBuffer:
  """The lazy ops `plan` (reduce_plan's) builds for `op` of `lazy` over `axes`, viewed as `out_shape`."""
  if isinstance(plan, SplitReduce): return _build_split(lazy, op, axes, out_shape, plan)
  if isinstance(plan, PackedGathered): return cpu_packed_gathered(lazy, axes, plan)
  if isinstance(plan, PackedMatmul): return cpu_packed_matmul(lazy, plan.tile)
  return _split_matmul(lazy, axes[0], plan.parts, out_shape)


def _count_loads(lazy: LazyBuffer) -> int:
  """The buffers a value of `lazy` loads (_fused_loads), counted up to one past split_reduce.LOADS_IN_FLIGHT: the
  split model reads any larger count as that one (a thread then keeps one iteration in flight)."""
  return len(_fused_loads(lazy, split_reduce.LOADS_IN_FLIGHT + 1))


# ---------------------------------------------------------------- splits


def _split_plan(lazy: LazyBuffer, axes: tuple[int, ...], out_shape: tuple[int, ...], renderer: Any,
                loads: int | Callable[[], int]) -> ReducePlan | None:
  """A reduce of many elements into few outputs runs as two: first into `parts` partial results per output,
  then over the parts. One output per thread would leave a GPU (or the CPU's other cores) idle; the partial
  results give each output `parts` threads of work. The decision is the device's (codegen/opt/split_reduce.py
  plan_split, from its multiprocessors and resident threads). None where nothing splits."""
  if prod(out_shape) == 0 or any(is_symbolic(size) for size in lazy.shape): return None
  gpu = renderer if renderer.runs_thread_blocks else None
  # a float32 matmul with many outputs splits its K by the grid model; its few parts are added elementwise
  if gpu is not None and (grid_parts := _matmul_split_parts(lazy, gpu, axes, out_shape)) is not None:
    return SplitMatmul(grid_parts)
  grid_parts = _cpu_matmul_split_parts(lazy, axes, renderer) if gpu is None else None
  if grid_parts is not None:
    return SplitReduce(ReduceSplit(max(axes, key=lambda a: lazy.shape[a]), grid_parts, True), True)
  # the loads a value takes bound a GPU thread's loads in flight (only GPUs ask, and only where a split is still open
  # after the cheap checks: the walk costs eager time). A CPU's plan reads neither the loads nor the kind
  kind = _reduce_kind(lazy, axes) if gpu is not None else ReduceKind.ROWS
  plan = plan_split(renderer, lazy.shape, axes, kind, lazy.dtype.itemsize, loads if gpu is not None else 1)
  return SplitReduce(plan, False) if plan is not None else None


def _build_split(lazy: LazyBuffer, op: Ops, axes: tuple[int, ...], out_shape: tuple[int, ...],
                 plan: SplitReduce) -> LazyBuffer:
  """The two stages of a split reduce (_split_plan's SplitReduce)."""
  axis, parts = plan.split.axis, plan.split.parts
  size = lazy.shape[axis]
  split = lazy.reshape(lazy.shape[:axis] + (parts, size // parts) + lazy.shape[axis + 1:])
  # after the split, `axis` holds the parts and axis+1 the elements within a part
  inner_axes = tuple(a + 1 if a >= axis else a for a in axes)
  parts_axes = (axis,)
  if plan.split.parts_outermost and not plan.grid:
    split, inner_axes, parts_axes = _split_rows(lazy, split, axes, axis, inner_axes)
  if plan.split.parts_outermost and parts_axes != tuple(range(len(parts_axes))):
    split, inner_axes = _parts_outermost(split, parts_axes, inner_axes)
  # a GPU plan's stages are sized to fill the device: neither splits again (a CPU's may, for a huge full sum)
  again = not plan.split.parts_outermost
  partials = split.reduce(op, inner_axes, split=again)
  if plan.grid: return _sum_parts(partials).reshape(out_shape)
  parts_reduced = tuple(range(len(parts_axes))) if plan.split.parts_outermost else (axis,)
  return partials.reduce(op, parts_reduced, split=again).reshape(out_shape)


def _reduce_kind(lazy: LazyBuffer, axes: tuple[int, ...]) -> ReduceKind:
  """How a GPU kernel lays this reduce's outputs on threads (split_reduce.ReduceKind): MATMUL where matmul-like,
  ROWS where the innermost axis in memory (stride 1 in this view; the last axis of a base) is reduced, else
  COLUMNS."""
  if _matmul_like_reduce(lazy, axes): return ReduceKind.MATMUL
  strides = lazy.st.real_strides() if not lazy.is_base else strides_for_shape(lazy.shape)
  innermost = next((a for a in reversed(range(len(lazy.shape))) if strides[a] == 1 and lazy.shape[a] != 1), None)
  return ReduceKind.COLUMNS if innermost is not None and innermost not in axes else ReduceKind.ROWS


def _split_rows(lazy: LazyBuffer, split: LazyBuffer, axes: tuple[int, ...], axis: int,
                inner_axes: tuple[int, ...]) -> tuple[LazyBuffer, tuple[int, ...], tuple[int, ...]]:
  """A GPU split's second parts axis (GPU_SPLIT_ROW_PARTS): where the parts of `axis` are single slices of it and
  the reduce is matmul-like, the second-longest reduce axis (the image rows) split into row parts too. Returns the
  input, its reduce axes and its parts axes (numbered in the returned input); unchanged where nothing splits."""
  row_parts = GPU_SPLIT_ROW_PARTS
  others = [a for a in axes if a != axis]
  if row_parts < 2 or split.shape[axis + 1] != 1 or not others or not _matmul_like_reduce(lazy, axes):
    return split, inner_axes, (axis,)
  row = max(others, key=lambda a: lazy.shape[a])
  if lazy.shape[row] % row_parts: return split, inner_axes, (axis,)
  at = row + 1 if row > axis else row   # the row axis in `split`'s numbering
  split = split.reshape(split.shape[:at] + (row_parts, split.shape[at] // row_parts) + split.shape[at + 1:])
  # `at` holds the row parts now (an output of the first kernel), at+1 the rows within a part (reduced)
  inner_axes = tuple(a + 1 if a >= at else a for a in inner_axes)
  return split, inner_axes, (axis + 1 if axis > at else axis, at)


def _matmul_split_parts(lazy: LazyBuffer, renderer: Any, axes: tuple[int, ...],
                        out_shape: tuple[int, ...]) -> int | None:
  """Split-K across blocks for a float32 matmul with many outputs on a GPU (`renderer`, MATMUL_GRID; see
  _matmul_dims: its reduce axis anywhere, a weight gradient's token axis first as autograd builds it): the parts that
  the grid model predicts fastest, at most MATMUL_SUM_PARTS (matmul_grid.wgmma_split_parts where WGMMA runs it,
  else matmul_grid.split_k_parts: the 2048x1536 @ 1536x384 of MiniLM's feed-forward, 48 blocks of 128x128 on 132
  multiprocessors, 96 with the reduce in 2 parts). None: no split (a matmul with few outputs splits by
  split_reduce.plan_split)."""
  if not MATMUL_GRID.value or not _matmul_like_reduce(lazy, axes): return None
  if leaves_device_idle(SplitFacts.of(renderer), ReduceKind.MATMUL, prod(out_shape)): return None
  dims = _matmul_dims(lazy, axes)
  if dims is None: return None
  batch, m, n, k = dims
  processors = getattr(renderer, "multiprocessors", 0)
  wgmma_itemsize = _wgmma_split_itemsize(lazy, axes[0], dims) if getattr(renderer, "has_wgmma", False) else None
  if wgmma_itemsize == 0: return None   # WGMMA runs it whole (its split could not: see _wgmma_split_itemsize)
  if wgmma_itemsize is not None:
    parts = wgmma_split_parts(batch, m, n, k, wgmma_itemsize, processors, renderer.dynamic_local_memory_bytes)
  else: parts = split_k_parts(1, batch * m, n, k, processors)   # (the shared tiles' grid counts the batch in M)
  return parts if 1 < parts <= MATMUL_SUM_PARTS else None


def _wgmma_split_itemsize(lazy: LazyBuffer, axis: int, dims: tuple[int, int, int, int]) -> int | None:
  """On a device with WGMMA, for this float32 matmul summed over `axis` (_matmul_dims `dims`): the operand bytes
  the WGMMA grid model splits it by (matmul_grid.wgmma_split_parts): 2 where both factors widen float16/bfloat16
  data (the instruction reads either layout), 4 where both are float32 and TF32 is allowed (it cannot transpose:
  factors not read along K are staged K-major by engine/operand_staging.py, a split's as (parts, M, K / parts),
  where M and N are multiples of its WGMMA_STAGED_TILE and the work at least WGMMA_MIN_WORK); 0 where WGMMA takes
  it only unsplit (float32 factors staging does not take); None where WGMMA does not take it (sizes off its 64
  tile, float32 without TF32)."""
  batch, m, n, k = dims
  if m % 64 or n % 64: return None
  factors = lazy.base.srcs
  low = [src.base.srcs[0].dtype for src in factors if src.base.op is Ops.CAST and src.base.srcs]
  if len(low) == 2 and low[0] == low[1] and low[0] in (dtypes.float16, dtypes.bfloat16): return 2
  if not all(src.dtype == dtypes.float32 for src in factors) or not tf32_allowed(): return None
  if all(len(src.st.views) == 1 and src.st.views[-1].strides[axis] == 1 for src in factors): return 4   # along K
  staged_tile = tensor_core_plans.WGMMA_STAGED_TILE
  if m % staged_tile or n % staged_tile or batch * m * n * k < tensor_core_plans.WGMMA_MIN_WORK: return 0
  return 4


def _cpu_matmul_split_parts(lazy: LazyBuffer, axes: tuple[int, ...], renderer: Any) -> int | None:
  """Reduce blocks for a float32 matmul on a CPU (`renderer`; cpu_tiles.cpu_reduce_parts): where the operand
  streamed along N (read one row of it a reduce step) has rows so far apart in memory that its panel leaves the L2,
  the reduce goes in parts of a length that stays. None: no split."""
  if _dense_matmul_dims(lazy, axes) is None: return None
  streamed = next(src for src in lazy.base.srcs if src.st.views[-1].strides[-2] != 0)
  stride = streamed.st.views[-1].strides[-1]
  if not isinstance(stride, int): return None
  l2_bytes = getattr(renderer, "l2_cache_bytes", 0)
  parts = cpu_reduce_parts(lazy.shape[-1], abs(stride) * lazy.dtype.itemsize, l2_bytes)
  return parts if parts > 1 else None


# ---------------------------------------------------------------- a host CPU's packed sums


def _packed_matmul_tile(lazy: LazyBuffer, dims: tuple[int, int, int], renderer: Any) -> int:
  """The column tile of a float32 matmul (`dims`: _dense_matmul_dims) on a host CPU (`renderer`) whose streamed
  operand B (one matrix, varying along N and K only) is read from a packed copy (cpu_tiles.cpu_pack_columns); 0:
  not packed."""
  rows, columns, _ = dims
  streamed, _ = _streamed_first(lazy)
  if any(stride != 0 for stride in streamed.st.views[-1].strides[:-2]): return 0
  # an operand widened on load (autocast's bfloat16) would be packed at float32: twice the bytes the product reads
  if streamed.base.op is Ops.CAST: return 0
  column_stride, reduce_stride = streamed.st.views[-1].strides[-2:]
  if not isinstance(column_stride, int) or not isinstance(reduce_stride, int): return 0
  return cpu_pack_columns(rows, columns, column_stride, reduce_stride * lazy.dtype.itemsize, renderer.vector_bytes,
                          renderer.vector_registers, lazy.dtype.itemsize) or 0


def _streamed_first(lazy: LazyBuffer) -> list[LazyBuffer]:
  """A dense matmul's factors (_dense_matmul_dims): the one streamed along N first, then the other."""
  return sorted(lazy.base.srcs, key=lambda src: src.st.views[-1].strides[-2] == 0)


def cpu_packed_matmul(lazy: LazyBuffer, tile: int) -> LazyBuffer:
  """The float32 matmul `lazy` (_dense_matmul_dims) with its streamed operand read from a copy packed in column tiles
  of `tile` columns (_packed_matmul_tile): B's column tiles one after another, each tile's panel contiguous in reduce
  order. The product is summed over (..., M, N/T, T, K) and viewed back as (..., M, N, 1)."""
  streamed, other = _streamed_first(lazy)
  *lead, reduce_length = lazy.shape
  columns = lead[-1]
  matrix = streamed.shrink(tuple((0, 1) for _ in lead[:-1]) + ((0, columns), (0, reduce_length)))
  packed = matrix.reshape((columns // tile, tile, reduce_length)).permute((0, 2, 1)).contiguous()
  tiled = (*lead[:-1], columns // tile, tile, reduce_length)
  packed_view = packed.permute((0, 2, 1)).reshape((1,) * (len(lead) - 1) + tiled[-3:]).expand(tiled)
  product = other.reshape(tiled).elementwise(MUL, packed_view)
  return product.reduce(SUM, (len(tiled) - 1,)).reshape(lazy.shape[:-1] + (1,))


def _packed_gathered_plan(lazy: LazyBuffer, axes: tuple[int, ...], renderer: Any) -> PackedGathered | None:
  """A float32 product (not a plain matmul: a convolution, its input or weight gradient) summed on a host CPU
  (`renderer`) whose register tile would gather its column vectors from scalar loads: which factor is read from a
  copy with the tile's columns innermost (cpu_tiles.cpu_gathered_pack), and the reduce axis summed in parts whose
  operands stay in the L2 (cpu_tiles.cpu_gathered_reduce_parts). None: not packed."""
  if lazy.dtype != dtypes.float32 or any(is_symbolic(s) for s in lazy.shape): return None
  base = lazy.base
  if not (lazy.is_base or (lazy.st.contiguous and base.shape == lazy.shape)) or len(base.srcs) != 2: return None
  if base.op is not MUL: return None
  # a factor widened on load (autocast's bfloat16) would be packed at float32: twice the bytes the product reads
  packable = [len(src.st.views) == 1 and not (src.base.op is Ops.CAST and src.base.srcs[0].dtype.itemsize < 4)
              for src in base.srcs]
  if not any(packable): return None
  choice = cpu_gathered_pack(lazy.shape, axes, [src.st.real_strides() for src in base.srcs], packable,
                             renderer.vector_bytes, lazy.dtype.itemsize)
  if choice is None: return None
  factor, column = choice
  # the packed copy's bytes replace the factor's base's (_packed_along: the values the factor varies along)
  sizes = [src.base.size for src in base.srcs]
  strides = base.srcs[factor].st.real_strides()
  sizes[factor] = prod(size for size, stride in zip(lazy.shape, strides) if stride != 0)
  operand_bytes = sum(sizes) * lazy.dtype.itemsize
  output_bytes = prod(lazy.shape) // prod(lazy.shape[axis] for axis in axes) * lazy.dtype.itemsize
  which, parts = cpu_gathered_reduce_parts([lazy.shape[axis] for axis in axes], operand_bytes, output_bytes,
                                           renderer.l2_cache_bytes)
  return PackedGathered(factor, column, which, parts)


def cpu_packed_gathered(lazy: LazyBuffer, axes: tuple[int, ...], plan: PackedGathered) -> LazyBuffer:
  """The product `lazy` summed over `axes` with factor `plan.factor` read from a copy that has axis `plan.column`
  innermost (_packed_gathered_plan), in `plan.parts` parts of reduce axis `plan.reduce_axis` where more than one."""
  srcs = list(lazy.base.srcs)
  srcs[plan.factor] = _packed_along(srcs[plan.factor], plan.column)
  product = srcs[0].elementwise(MUL, srcs[1])
  if plan.parts == 1: return product.reduce(SUM, axes)
  outer = axes[plan.reduce_axis]
  split = product.reshape(lazy.shape[:outer] + (plan.parts, lazy.shape[outer] // plan.parts) + lazy.shape[outer + 1:])
  inner_axes = tuple(axis + 1 if axis >= outer else axis for axis in axes)
  # the parts outermost: every output tile of a part reads that part's operands from the L2
  split, inner_axes = _parts_outermost(split, (outer,), inner_axes)
  partials = split.reduce(SUM, inner_axes, split=False)
  out_shape = tuple(1 if axis in axes else size for axis, size in enumerate(lazy.shape))
  return partials.reduce(SUM, (0,), split=False).reshape(out_shape)


def _packed_along(operand: LazyBuffer, column: int) -> LazyBuffer:
  """`operand` (one View, expanded along some axes) read from a contiguous copy of the values it varies along, laid
  out with axis `column` innermost (cpu_packed_gathered), then viewed and expanded back to its shape."""
  strides = operand.st.real_strides()
  varying = [axis for axis, stride in enumerate(strides) if stride != 0]
  values = operand.shrink(tuple((0, size) if axis in varying else (0, 1) for axis, size in enumerate(operand.shape)))
  values = values.reshape(tuple(operand.shape[axis] for axis in varying))
  order = tuple(place for place, axis in enumerate(varying) if axis != column) + (varying.index(column),)
  packed = values.permute(order).contiguous()
  unpacked = packed.permute(tuple(order.index(place) for place in range(len(order))))
  kept = tuple(size if axis in varying else 1 for axis, size in enumerate(operand.shape))
  return unpacked.reshape(kept).expand(operand.shape)


def _matmul_dims(lazy: LazyBuffer, axes: tuple[int, ...]) -> tuple[int, int, int, int] | None:
  """(batch, M, N, K) of a float32 product summed over one axis (K) at any position: every other axis varied along
  by both factors (batch), by one only (that factor's own axes: M those of the factor whose own axis comes first,
  N the other's), both varying along K; None for any other reduce."""
  if lazy.dtype != dtypes.float32 or len(axes) != 1: return None
  base = lazy.base
  if not (lazy.is_base or (lazy.st.contiguous and base.shape == lazy.shape)) or len(base.srcs) != 2: return None
  # a product stored (or to be) is read, not multiplied again by a split (_split_matmul)
  if base.op is not MUL or base.realized is not None or base.forced_realize: return None
  strides = [src.st.views[-1].strides for src in base.srcs]
  if any(factor[axes[0]] == 0 for factor in strides): return None
  sizes = {"batch": 1, 0: 1, 1: 1}
  first = None   # the factor whose own axis comes first
  for axis, size in enumerate(lazy.shape):
    if axis in axes or size == 1: continue
    varies = [factor[axis] != 0 for factor in strides]
    if not any(varies): return None
    kind = "batch" if all(varies) else varies.index(True)
    if first is None and kind != "batch": first = kind
    sizes[kind] *= size
  if first is None or sizes[0] == 1 or sizes[1] == 1: return None
  return sizes["batch"], sizes[first], sizes[1 - first], lazy.shape[axes[0]]


def _split_matmul(lazy: LazyBuffer, axis: int, parts: int, out_shape: tuple[int, ...]) -> LazyBuffer:
  """The matmul `lazy` summed over `axis` (_matmul_dims) as `parts` partial products summed by _sum_parts
  (`_split_product` of its factors)."""
  left, right = lazy.base.srcs
  return _split_product(left, right, axis, parts, out_shape)


def _split_product(left: LazyBuffer, right: LazyBuffer, axis: int, parts: int,
                   out_shape: tuple[int, ...]) -> LazyBuffer:
  """left * right (views of a matmul's factors, of one shape) summed over `axis` as `parts` partial products summed by
  _sum_parts: each factor viewed with K as (parts, K / parts) and the parts axis moved after the product's leading
  batch axes, then multiplied, so the partial products are one plain product, batched over the parts (operand
  staging, engine/operand_staging.py, reads it as such: a factor it stages K-major is one (parts, M, K / parts)
  copy)."""
  shape = left.shape
  split_shape = shape[:axis] + (parts, shape[axis] // parts) + shape[axis + 1:]
  # after the batch axes both factors vary along (in a stored factor they then merge with the parts: no copy), before
  # the output axes the kernel tiles (a weight gradient's channels, as without the split)
  strides = [factor.st.views[-1].strides for factor in (left, right)]
  place = 0
  while place < axis and (shape[place] == 1 or all(factor[place] != 0 for factor in strides)): place += 1
  order = (*range(place), axis, *(a for a in range(place, len(split_shape)) if a != axis))
  left, right = (factor.reshape(split_shape).permute(order) for factor in (left, right))
  partials = left.elementwise(MUL, right).reduce(SUM, (axis + 1,), split=False)
  return _sum_parts(partials.permute((place, *(a for a in range(len(split_shape)) if a != place)))).reshape(out_shape)


def reduce_product(x: LazyBuffer, y: LazyBuffer, axis: int) -> LazyBuffer:
  """(x * y) summed over `axis`, kept as size 1: a matmul's product (Matmul's forward; x and y views of its factors, of
  one shape, dtype and device), as LazyBuffer.reduce of the product builds it. Where reduce_plan has remembered its
  decision for that product (every repeated eager step) it is applied here, from the key made once: a split
  (SplitMatmul) is built from x and y, so the whole product, which the split only reads the factors of, is never made
  (made, it was a base, a traced op and a plan key thrown away); no split is the product's plain reduce."""
  plan = _remembered_product_plan(x, y, axis)
  if plan is _MISSING: return x.elementwise(MUL, y).reduce(SUM, (axis,))   # (decided and remembered there)
  plan_stats.remembered += 1
  out_shape = x.shape[:axis] + (1,) + x.shape[axis + 1:]
  if plan is not None: return _split_product(x, y, axis, plan.parts, out_shape)
  product = x.elementwise(MUL, y)
  return product.create_base(product.device, out_shape, product.dtype, SUM, (axis,), (product,))


def _remembered_product_plan(x: LazyBuffer, y: LazyBuffer, axis: int) -> Any:
  """What reduce_plan remembered for the SUM over `axis` of the product base x * y would make (its _plan_key, built
  from x and y: the product's identity view of their shape, op MUL, unrealized): a SplitMatmul or None (no split), else
  _MISSING (a product elementwise would fold or reduce would not plan, a CPU, a decision not made yet, another plan)."""
  # (a sharded product's MultiLazyBuffers, device a tuple, apply the reduce per shard; a disk buffer never computes)
  if type(x.device) is not str or x.device.startswith("DISK"): return _MISSING
  renderer = Device[x.device].renderer
  if not renderer.runs_thread_blocks: return _MISSING   # (a host CPU's plans read more than the key: packing)
  shape = x.shape
  if y.shape != shape or y.dtype is not x.dtype or y.device != x.device or shape[axis] == 1: return _MISSING
  if (x._base or x).op is CONST or (y._base or y).op is CONST: return _MISSING
  for size in shape:   # (_plan_key: a Variable's view is not remembered; an empty reduce is a constant)
    if type(size) is not int or size == 0: return _MISSING
  key = (SUM, (axis,), True, x.device, x.dtype, ShapeTracker.from_shape(shape), shape, MUL, False, False,
         (_factor_facts(x), _factor_facts(y)), (MATMUL_GRID.value, tf32_allowed()), _device_facts(renderer))
  plan = _PLANS.get(key, _MISSING)
  return plan if plan is None or isinstance(plan, SplitMatmul) else _MISSING


def _dense_matmul_dims(lazy: LazyBuffer, axes: tuple[int, ...]) -> tuple[int, int, int] | None:
  """(M, N, K) of a float32 product (..., M, N, K) summed over K (the last axis), one factor varying along M and
  not N, the other along N and not M (batch axes counted in M); None for any other reduce."""
  if lazy.dtype != dtypes.float32 or len(lazy.shape) < 3 or axes != (len(lazy.shape) - 1,): return None
  base = lazy.base
  if not (lazy.is_base or (lazy.st.contiguous and base.shape == lazy.shape)) or len(base.srcs) != 2: return None
  if base.op is not MUL: return None
  sides = set()
  for src in base.srcs:
    strides = src.st.views[-1].strides
    if strides[-1] == 0: return None
    sides.add((strides[-3] != 0, strides[-2] != 0))
  if sides != {(True, False), (False, True)}: return None
  return prod(lazy.shape[:-2]), lazy.shape[-2], lazy.shape[-1]


# a pure function of the product's shape, reduce axes and operand strides, asked of the same products at every eager
# step (twice per reduce a GPU builds: the grid split, then the reduce's kind): remembered, bounded
_tiles_pay_off = functools.lru_cache(maxsize=1 << 12)(register_tiles_pay_off)


def _matmul_like_reduce(lazy: LazyBuffer, axes: tuple[int, ...]) -> bool:
  """The reduced value is a product whose register tiles pay off on a GPU (heuristic.register_tiles_pay_off: a
  factor is a matrix operand reused across outputs, none is read whole): a matmul or a convolution's weight
  gradient, not a LayerNorm's weight gradient."""
  base = lazy.base
  # the axes of the base's sources are this buffer's axes only where this is the base or a plain view of it
  if not (lazy.is_base or (lazy.st.contiguous and base.shape == lazy.shape)) or base.op is not MUL: return False
  strides = tuple(src.st.views[-1].strides for src in base.srcs)
  try:
    return _tiles_pay_off(lazy.shape, axes, strides)
  except TypeError:   # an unhashable size: not remembered
    return register_tiles_pay_off(lazy.shape, axes, strides)


def _parts_outermost(split: LazyBuffer, parts_axes: tuple[int, ...],
                     inner_axes: tuple[int, ...]) -> tuple[LazyBuffer, tuple[int, ...]]:
  """A split reduce's input with its parts axes moved first (in order), and the reduce axes renumbered. The first
  kernel's outputs are then (parts, outputs...): the output axes a GPU kernel tiles into registers and thread blocks
  (a weight gradient's channels) stay the innermost ones, as without the split. With the parts innermost (a weight
  gradient's batch comes after its channels and window offsets), the heuristic made the 32 parts a warp's threads,
  each reading another image: MNIST's conv2 weight gradient took 0.180 ms on the H100 instead of 0.061."""
  order = (*parts_axes, *(a for a in range(len(split.shape)) if a not in parts_axes))
  moved = tuple(order.index(a) for a in inner_axes)
  return split.permute(order), moved


def _sum_parts(partials: LazyBuffer) -> LazyBuffer:
  """A split matmul's partial results (parts first) summed by elementwise adds of one part each: they fuse into the
  consumer (the bias and residual adds, a LayerNorm's row kernel), where a reduce over the parts would be a kernel of
  its own. The first axis is left with size 1."""
  rest = tuple((0, size) for size in partials.shape[1:])   # (each piece's other axes whole: made once)
  total = partials.shrink(((0, 1), *rest))
  for part in range(1, partials.shape[0]):
    total = total.elementwise(ADD, partials.shrink(((part, part + 1), *rest)))
  return total


def _fused_loads(lazy: LazyBuffer, limit: int | None = None) -> set[LazyBuffer]:
  """The buffers an elementwise expression reads (the bases it reaches through elementwise ops that are not realized
  or forced to be; constants are not loads): what a reduce of it loads for each element (split_reduce's model). With
  `limit`, the walk stops once it has found that many."""
  # (LazyBuffers hash by identity and are always true: sets of the objects themselves, `_base or` for .base)
  loads: set[LazyBuffer] = set()
  seen: set[LazyBuffer] = set()
  stack = [lazy._base or lazy]
  pop, push, mark = stack.pop, stack.append, seen.add
  while stack:
    base = pop()
    if base in seen: continue
    mark(base)
    if base.realized is None and not base.forced_realize and base.op in ELEMENTWISE_OPS:
      for src in base.srcs: push(src._base or src)
    elif base.op is not CONST:
      loads.add(base)
      if limit is not None and len(loads) >= limit: break
  return loads
