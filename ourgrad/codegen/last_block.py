"""One-kernel split reduces: the partials' kernel sums its own partials in the last block to finish.

A split reduce (codegen/opt/split_reduce.py) is two kernels: the first sums `parts` pieces of the reduce axis into a
partials buffer P of (parts, outputs), the parts outermost; the second reduces P over the parts. On a device with
atomics (`Renderer.has_block_atomics`) the scheduler (engine/split_fusion.py) merges them into one kernel whose AST
is SPLIT_REDUCE(first STORE, second STORE), and `SplitReduceKernel` lowers it as the first kernel followed by:

    FENCE                                   this thread's partials are visible to every block
    BARRIER                                 ... for every thread of the block
    IF first thread: flag = ATOMIC_ADD(counter[group], 1)      group: the block's index without its part
    BARRIER; IF flag == parts - 1:          the block-uniform test: every other block of the group has finished
      FENCE                                 (the acquire side) then, for each output the block stored a partial of,
      out[o] = P[0, o] op P[1, o] op ... op P[parts - 1, o]    in that fixed order: deterministic; COHERENT_LOADs
                                            (past the SM's L1, which may hold a line another group's block read)
      IF first thread: counter[group] = 0   ready for the next launch

The blocks of a group (one per part) store the partials of the same outputs: that is what lets the group's last
block finish them alone. `finish_plan` checks it on the first kernel's UOps: the partials' index of every store is
`part * outputs + rest` with `rest` in [0, outputs) and neither `rest` nor the store's guard depending on the part's
block index (evaluated with numpy over every block and thread index). Where they do not (the parts merged with the
outputs into one block axis), one counter counts every block of the grid and the last of them finishes all outputs,
its threads taking them in turn (at most MAX_GRID_FINISH_VALUES partials). The counters are a buffer of int32 zeros,
one per group, that the kernel takes as its last argument (engine/realize.py allocates it once per compiled kernel).
The final sum loads every part's partial before adding them, so a thread waits one memory latency, not `parts`:
MAX_FINISH_PARTS bounds the loads in flight (registers).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import INDEX_DTYPE, linearize
from ourgrad.codegen.uops import AxisType, UOp, UOpBuilder, UOps
from ourgrad.dtype import dtypes
from ourgrad.ops import LazyOp, MemBuffer, Ops

# parts the last block sums at most: a thread holds one load of each part in flight (one register each)
MAX_FINISH_PARTS = 64
# block x thread indices the layout check evaluates at most (numpy arrays of this many int64s)
MAX_CHECKED_THREADS = 1 << 22
# partials one last block of the whole grid sums at most (a group's blocks storing different outputs: the parts
# merged with the outputs into one block axis): 32 KB, about a memory latency of one block's loads
MAX_GRID_FINISH_VALUES = 8192


def _c_divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Integer division as C does it (towards zero; index math may divide negative values)."""
  return np.abs(a) // np.abs(b) * np.sign(a) * np.sign(b)


def _c_modulo(a: np.ndarray, b: np.ndarray) -> np.ndarray: return a - b * _c_divide(a, b)


# integer index math the layout check evaluates, as the kernel computes it (anything else in a store's index or
# guard: no plan)
_INDEX_OPS = {Ops.ADD: np.add, Ops.MUL: np.multiply, Ops.IDIV: _c_divide, Ops.MOD: _c_modulo,
              Ops.CMPLT: np.less, Ops.CMPNE: np.not_equal, Ops.AND: np.logical_and, Ops.OR: np.logical_or,
              Ops.MAX: np.maximum}
# the reduce of the partials -> how two of them combine
_COMBINE = {Ops.SUM: Ops.ADD, Ops.MAX_REDUCE: Ops.MAX}


@dataclass(frozen=True)
class PartialStore:
  """A store of partials in the first kernel: its index, the conditions that guard it (enclosing IFs and its valid
  source) and how many neighbouring elements it writes (a vector store: several)."""
  index: UOp
  guards: tuple[UOp, ...]
  width: int


@dataclass(frozen=True)
class FinishPlan:
  """How the first kernel's last block finishes. Per group (`part` set): the block index of the part (a GLOBAL
  SPECIAL of `parts` blocks), the other block indices (their flat index numbers the group's counter) and the
  partials' stores, each finished by the thread that stored it. Grid-wide (`part` None): one counter for all
  `blocks`, and the last block's threads take every output in turn."""
  part: UOp | None
  groups: tuple[UOp, ...]
  stores: tuple[PartialStore, ...]
  parts: int
  outputs: int
  blocks: int   # blocks each counter counts

  @property
  def counters(self) -> int:
    """Groups of blocks: one counter each."""
    count = 1
    for special in self.groups: count *= special.arg[1]
    return count


def second_stage(second: LazyOp) -> tuple[Ops, int, int] | None:
  """(reduce op, parts, outputs) where `second` is the second kernel of a split reduce this module finishes: a
  float32 STORE of SUM or MAX over the first axis of one contiguous float32 buffer of (parts, outputs...) into a
  contiguous buffer of the outputs; None otherwise (a fused scale, a cast, a strided view keep two kernels)."""
  if second.op is not Ops.STORE or second.dtype != dtypes.float32 or not second.srcs: return None
  reduce = second.srcs[0]
  if reduce.op not in _COMBINE or len(reduce.srcs) != 1 or reduce.dtype != dtypes.float32: return None
  load = reduce.srcs[0]
  if load.op is not Ops.LOAD or load.srcs or not isinstance(load.arg, MemBuffer) or load.dtype != dtypes.float32:
    return None
  store_st, load_st = second.arg.st, load.arg.st
  if not (store_st.contiguous and load_st.contiguous) or tuple(reduce.arg) != (0,) or load_st.ndim < 1: return None
  parts, outputs = load_st.shape[0], load_st.size // max(load_st.shape[0], 1)
  if not isinstance(parts, int) or store_st.size != outputs or not 2 <= parts <= MAX_FINISH_PARTS: return None
  return reduce.op, parts, outputs


def _partial_stores(uops: list[UOp], buffer: UOp) -> list[PartialStore] | None:
  """Every store to `buffer` with its guards; None where one is inside a loop (not once per thread)."""
  stores, open_ifs, loops = [], [], 0
  for uop in uops:
    if uop.op is UOps.RANGE: loops += 1
    elif uop.op is UOps.ENDRANGE: loops -= 1
    elif uop.op is UOps.IF: open_ifs.append(uop.srcs[0])
    elif uop.op is UOps.ENDIF: open_ifs.pop()
    elif uop.op is UOps.STORE and uop.srcs[0] is buffer:
      if loops: return None
      width = uop.arg or 1
      valid = (uop.srcs[3],) if uop.arg is None and len(uop.srcs) > 3 else ()
      stores.append(PartialStore(uop.srcs[1], tuple(open_ifs) + valid, width))
  return stores


def _evaluate(root: UOp, specials: dict[int, np.ndarray]) -> np.ndarray | None:
  """`root`'s value at every block and thread index (each SPECIAL an axis of its own); None where it reads anything
  but SPECIALs, constants and integer index math."""
  values: dict[int, Any] = {}
  stack = [root]
  while stack:
    uop = stack[-1]
    if id(uop) in values:
      stack.pop()
      continue
    if uop.op is UOps.SPECIAL: values[id(uop)] = specials[id(uop)]
    elif uop.op is UOps.CONST: values[id(uop)] = np.asarray(uop.arg)
    elif uop.op is UOps.ALU and (uop.arg in _INDEX_OPS or uop.arg is Ops.WHERE):
      missing = [src for src in uop.srcs if id(src) not in values]
      if missing:
        stack.extend(missing)
        continue
      operands = [values[id(src)] for src in uop.srcs]
      values[id(uop)] = np.where(*operands) if uop.arg is Ops.WHERE else _INDEX_OPS[uop.arg](*operands)
    else: return None
    stack.pop()
  return values[id(root)]


def finish_plan(uops: list[UOp], parts: int, outputs: int) -> FinishPlan | None:
  """The plan that finishes the first kernel's partials (module docstring), or None where its layout does not allow
  it: the partials' block index is not one GLOBAL SPECIAL of `parts` blocks, or a group's blocks store different
  outputs."""
  buffer = next((uop for uop in uops if uop.op is UOps.DEFINE_GLOBAL and uop.arg[0] == 0), None)
  specials = [uop for uop in uops if uop.op is UOps.SPECIAL]
  if buffer is None or any(uop.op is UOps.DEFINE_VAR for uop in uops): return None
  stores = _partial_stores(uops, buffer)
  if not stores or int(np.prod([special.arg[1] for special in specials])) > MAX_CHECKED_THREADS: return None
  grids = {id(special): np.arange(special.arg[1]).reshape([-1 if axis == position else 1
                                                           for axis in range(len(specials))])
           for position, special in enumerate(specials)}
  candidates = [(position, special) for position, special in enumerate(specials)
                if special.arg[3] is AxisType.GLOBAL and special.arg[1] == parts]
  for position, part in candidates:
    if all(_store_fits(store, grids, part, position, outputs) for store in stores):
      groups = tuple(special for special in specials if special.arg[3] is AxisType.GLOBAL and special is not part)
      return FinishPlan(part, groups, tuple(stores), parts, outputs, parts)
  if parts * outputs > MAX_GRID_FINISH_VALUES: return None
  blocks = int(np.prod([special.arg[1] for special in specials if special.arg[3] is AxisType.GLOBAL]))
  return FinishPlan(None, (), tuple(stores), parts, outputs, blocks)


def _store_fits(store: PartialStore, grids: dict[int, np.ndarray], part: UOp, axis: int, outputs: int) -> bool:
  """Whether `store` writes `part * outputs + rest`, rest in [0, outputs) and, like its guard, the same for every
  part of a group."""
  index = _evaluate(store.index, grids)
  guards = [_evaluate(guard, grids) for guard in store.guards]
  if index is None or any(guard is None for guard in guards): return False
  shape = np.broadcast_shapes(*(np.shape(grid) for grid in grids.values()))
  valid = np.ones(shape, bool)
  for guard in guards: valid &= np.broadcast_to(np.asarray(guard, bool), shape)
  rest = np.broadcast_to(index - grids[id(part)] * outputs, shape)
  if not valid.any() or (rest[valid] < 0).any() or (rest[valid] + store.width > outputs).any(): return False
  first_valid, first_rest = np.take(valid, [0], axis), np.take(rest, [0], axis)
  return bool((valid == first_valid).all() and (np.where(valid, rest, 0) == np.where(first_valid, first_rest, 0)).all())


class _Cloner:
  """Index math re-added after the first kernel's scopes closed (a value defined inside an IF is out of scope
  after it): CONST and ALU uops rebuilt by the builder, SPECIALs (defined at the top) reused."""

  def __init__(self, builder: UOpBuilder):
    self.builder, self.copies = builder, {}

  def __call__(self, root: UOp) -> UOp:
    stack = [root]
    while stack:
      uop = stack[-1]
      if id(uop) in self.copies:
        stack.pop()
        continue
      if uop.op is UOps.SPECIAL: self.copies[id(uop)] = uop
      elif uop.op is UOps.CONST: self.copies[id(uop)] = self.builder.const(uop.arg, uop.dtype)
      else:
        missing = [src for src in uop.srcs if id(src) not in self.copies]
        if missing:
          stack.extend(missing)
          continue
        self.copies[id(uop)] = self.builder.alu(uop.arg, uop.dtype, *(self.copies[id(src)] for src in uop.srcs))
      stack.pop()
    return self.copies[id(root)]


def append_finish(uops: list[UOp], plan: FinishPlan, combine: Ops, out_index: int, counter_index: int) -> list[UOp]:
  """`uops` (the first kernel) followed by the last block's finish (module docstring): it writes the outputs to
  buffer `out_index` and counts blocks in buffer `counter_index`."""
  builder = UOpBuilder()
  index_dtype = INDEX_DTYPE
  out = builder.add(UOps.DEFINE_GLOBAL, dtypes.float32, (), (out_index, True))
  counter = builder.add(UOps.DEFINE_GLOBAL, dtypes.int32, (), (counter_index, True))
  partials = next(uop for uop in uops if uop.op is UOps.DEFINE_GLOBAL and uop.arg[0] == 0)
  threads = [uop for uop in uops if uop.op is UOps.SPECIAL and uop.arg[3] is not AxisType.GLOBAL]
  builder.add(UOps.FENCE, None)
  builder.add(UOps.BARRIER, None)
  flag = builder.add(UOps.DEFINE_LOCAL, dtypes.int32, (), ("finish_flag", 1))
  zero, one = builder.const(0, index_dtype), builder.const(1, index_dtype)
  thread_sum = zero
  for special in threads: thread_sum = builder.alu(Ops.ADD, index_dtype, thread_sum, special)
  first_thread = builder.alu(Ops.CMPLT, dtypes.bool, thread_sum, one)
  group = zero
  for special in plan.groups:
    group = builder.alu(Ops.ADD, index_dtype, builder.alu(Ops.MUL, index_dtype, group,
                                                          builder.const(special.arg[1], index_dtype)), special)
  opened = builder.add(UOps.IF, None, (first_thread,))
  before = builder.add(UOps.ATOMIC_ADD, dtypes.int32, (counter, group, one))
  builder.add(UOps.STORE, None, (flag, zero, before))
  builder.end_if(opened)
  builder.add(UOps.BARRIER, None)
  finished = builder.add(UOps.LOAD, dtypes.int32, (flag, zero))
  last = builder.alu(Ops.CMPLT, dtypes.bool, builder.const(plan.blocks - 2, index_dtype), finished)
  last_block = builder.add(UOps.IF, None, (last,))
  builder.add(UOps.FENCE, None)
  if plan.part is None: _finish_grid(builder, threads, plan, combine, partials, out)
  else:
    # a cloner per store: what one clones inside its IF is out of scope for the next
    for store in plan.stores: _finish_store(builder, _Cloner(builder), store, plan, combine, partials, out)
  reset = builder.add(UOps.IF, None, (first_thread,))
  builder.add(UOps.STORE, None, (counter, group, zero))
  builder.end_if(reset)
  builder.end_if(last_block)
  defines = [uop for uop in uops if uop.op is UOps.DEFINE_GLOBAL] + [out, counter]
  # the kernel's arguments in order (renderers take them as the DEFINE_GLOBALs come)
  defines.sort(key=lambda uop: uop.arg[0])
  body = [uop for uop in uops if uop.op is not UOps.DEFINE_GLOBAL]
  return defines + body + [uop for uop in builder.uops if uop.op is not UOps.DEFINE_GLOBAL]


def _sum_parts(builder: UOpBuilder, output: UOp, plan: FinishPlan, combine: Ops, partials: UOp, out: UOp) -> None:
  """out[output] = every part's partial of it, loaded first, then combined in part order."""
  loads = [builder.add(UOps.COHERENT_LOAD, dtypes.float32, (partials, builder.alu(
    Ops.ADD, INDEX_DTYPE, output, builder.const(part * plan.outputs, INDEX_DTYPE)))) for part in range(plan.parts)]
  total = loads[0]
  for value in loads[1:]: total = builder.alu(combine, dtypes.float32, total, value)
  builder.add(UOps.STORE, None, (out, output, total))


def _finish_grid(builder: UOpBuilder, threads: list[UOp], plan: FinishPlan, combine: Ops, partials: UOp,
                 out: UOp) -> None:
  """The last block of the grid finishes every output: thread t takes outputs t, t + T, ... (T its threads)."""
  thread, block_threads = builder.const(0, INDEX_DTYPE), 1
  for special in threads:
    thread = builder.alu(Ops.ADD, INDEX_DTYPE, builder.alu(Ops.MUL, INDEX_DTYPE, thread,
                                                           builder.const(special.arg[1], INDEX_DTYPE)), special)
    block_threads *= special.arg[1]
  rounds = builder.add(UOps.RANGE, INDEX_DTYPE, (builder.const(0, INDEX_DTYPE),
                                                 builder.const(-(-plan.outputs // block_threads), INDEX_DTYPE)),
                       ("finish_round", AxisType.REDUCE))
  output = builder.alu(Ops.ADD, INDEX_DTYPE, builder.alu(Ops.MUL, INDEX_DTYPE, rounds,
                                                         builder.const(block_threads, INDEX_DTYPE)), thread)
  inside = builder.add(UOps.IF, None, (builder.alu(Ops.CMPLT, dtypes.bool, output,
                                                   builder.const(plan.outputs, INDEX_DTYPE)),))
  _sum_parts(builder, output, plan, combine, partials, out)
  builder.end_if(inside)
  builder.end_range(rounds)


def _finish_store(builder: UOpBuilder, clone: _Cloner, store: PartialStore, plan: FinishPlan, combine: Ops,
                  partials: UOp, out: UOp) -> None:
  """The outputs one partials store of a thread wrote: every part's partial loaded, then combined in part order."""
  index_dtype = INDEX_DTYPE
  guard = None
  for condition in store.guards:
    copied = clone(condition)
    guard = copied if guard is None else builder.alu(Ops.AND, dtypes.bool, guard, copied)
  opened = builder.add(UOps.IF, None, (guard,)) if guard is not None else None
  part_offset = builder.alu(Ops.MUL, index_dtype, plan.part, builder.const(plan.outputs, index_dtype))
  rest = builder.alu(Ops.ADD, index_dtype, clone(store.index),
                     builder.alu(Ops.MUL, index_dtype, part_offset, builder.const(-1, index_dtype)))
  for element in range(store.width):
    _sum_parts(builder, builder.alu(Ops.ADD, index_dtype, rest, builder.const(element, index_dtype)), plan, combine,
               partials, out)
  if opened is not None: builder.end_if(opened)


class SplitReduceKernel(Kernel):
  """A SPLIT_REDUCE AST's kernel: the first kernel's Kernel (its opts apply as usual) whose linearize appends the
  last block's finish. Buffers: 0 the partials, 1 the outputs, then the first kernel's inputs, then the counters."""
  may_stream_rows = False   # the finish extends the first kernel's loop nest

  def __init__(self, ast: LazyOp, renderer: Any):
    if ast.op is not Ops.SPLIT_REDUCE:
      raise AssertionError(f"a split reduce kernel's AST is SPLIT_REDUCE, not {ast.op}")
    first, second = ast.srcs
    super().__init__(first, renderer)
    self.split_ast = ast   # `ast` is the first STORE, as the Kernel's opts see it
    stage = second_stage(second)
    if stage is None: raise AssertionError("SPLIT_REDUCE's second store is not a reduce over the parts")
    self.combine, self.parts, self.outputs = _COMBINE[stage[0]], stage[1], stage[2]
    self.buffer_count = 1 + len({leaf.arg.idx for leaf in first.walk() if isinstance(leaf.arg, MemBuffer)})

  @property
  def name(self) -> str: return f"{super().name}_last"

  def last_block_plan(self) -> FinishPlan | None:
    """The finish plan of this kernel as its opts lay it out (None: it cannot finish in one kernel; a WGMMA plan is
    rendered whole, without UOps to append to)."""
    if self.wgmma is not None: return None
    return finish_plan(linearize(self), self.parts, self.outputs)

  def linearize(self) -> list[UOp]:
    if self.wgmma is not None: raise AssertionError(f"{self.name}: a WGMMA plan has no UOps to finish")
    uops = linearize(self)
    plan = finish_plan(uops, self.parts, self.outputs)
    if plan is None: raise AssertionError(f"{self.name}: its blocks do not store each part's partials of one group")
    return append_finish(uops, plan, self.combine, 1, self.buffer_count)
