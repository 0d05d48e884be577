"""Explicit SIMD vectors for the CPU register tiles (CLANG): neighbouring accumulators as one GCC vector.

The CPU matmul tile (codegen/opt/heuristic.py) leaves the C compiler straight-line code: one accumulator per
output, the columns of a row in consecutive accumulators, each updated with a column value that is a load at
consecutive addresses, times a value the whole row shares. gcc's basic-block (SLP) vectorizer is meant to pack
those into vector registers, but it gives up on whole tiles for incidental reasons: a fused epilogue whose selects
become branches (a ReLU's backward mask), the -fwrapv index rules, a cost-model threshold. A tile that is not
vectorized spills 256 accumulators and runs 20-50x slower (measured 4 GFLOP/s instead of 200 on one core).

`VectorPlan` finds, in the UOps, runs of `width` consecutive accumulators whose every update is the same
expression in each lane, where each leaf either is the same value in every lane (a broadcast) or a load from one
buffer at index i, i+1, ..., i+width-1 (an unaligned vector load) or i, i+s, ..., i+(width-1)*s (a vector built
from scalar loads: the strided operand of A.B^T). The renderer then declares one vector
accumulator for the run and emits one vector update in place of the lanes' scalar ones; code after the loop reads
lane j as `vacc[j]`. Each lane computes exactly what its scalar code did (same operations in the same order), so
results do not change. Anything else is left to the scalar path.
"""
from __future__ import annotations

from typing import Callable

from ourgrad.codegen.uops import AxisType, UOp, UOps
from ourgrad.dtype import dtypes
from ourgrad.ops import Ops

# the ops a lane expression may use, and how a vector operand of each is written (GCC vector extensions: the
# infix operators work lane by lane, and a scalar operand of + or * is broadcast)
VECTOR_INFIX = {Ops.ADD: "+", Ops.MUL: "*"}
VECTOR_OPS = frozenset({*VECTOR_INFIX, Ops.NEG, Ops.MAX, Ops.RECIP, Ops.WHERE, Ops.SQRT})
# ops on lanes of bools, held as int vector masks (-1 true, 0 false: what a vector compare gives): float compares
# and NOT (a backward pass's masks: ReLU's `x != 0`, max-pool's `x == max`)
MASK_COMPARES = {Ops.CMPNE: "!=", Ops.CMPLT: "<"}
MASK_LOGIC = {Ops.AND: "&", Ops.OR: "|"}
FLOAT_BITS_OF_ONE = "0x3f800000"   # 1.0f: a mask ANDed with it is 1.0f or 0.0f in each lane


def vector_typedefs(width: int) -> str:
  """The vector types and the NaN-propagating max for `width` float32 lanes (the scalar MAX's rule: NaN in `a`,
  or `a` larger, gives `a`), as bit selects so no lane branches."""
  name = f"float{width}v"
  return (f"typedef float {name} __attribute__((vector_size({4 * width})));\n"
          f"typedef float {name}_u __attribute__((vector_size({4 * width}), aligned(4)));\n"
          f"typedef int int{width}v __attribute__((vector_size({4 * width})));\n"
          f"static inline {name} vmax{width}({name} a, {name} b) {{\n"
          f"  int{width}v keep = (a != a) | (a > b);\n"
          f"  return ({name})((keep & (int{width}v)a) | (~keep & (int{width}v)b)); }}\n"
          # GCC's vector extensions have no sqrt: the lanes' sqrtf side by side, which its SLP vectorizer packs
          f"static inline {name} vsqrt{width}({name} a) {{\n"
          f"  return ({name}){{{', '.join(f'sqrtf(a[{lane}])' for lane in range(width))}}}; }}\n")


class VectorPlan:
  """Which accumulators of a kernel become lanes of vector accumulators, and the vector updates replacing theirs."""

  def __init__(self, uops: list[UOp], width: int):
    self.width, self.type = width, f"float{width}v"
    self.lane_of: dict[int, tuple[str, int]] = {}          # id(DEFINE_ACC) -> (vector name, lane)
    self.updates: dict[int, tuple[str, list[UOp]]] = {}     # id(lane 0's ACCUMULATE) -> (vector, lane values)
    self.skipped: set[int] = set()                          # ids of the other lanes' ACCUMULATEs
    if width < 2: return
    # where each UOp is rendered: a vector update is written at lane 0's ACCUMULATE, so the lane-by-lane masks it
    # reads must come before that (another lane's mask may be computed after it)
    self.position = {id(uop): index for index, uop in enumerate(uops)}
    accumulators = [uop for uop in uops if uop.op is UOps.DEFINE_ACC]
    updates, scopes = _updates_and_scopes(uops)
    for start in range(0, len(accumulators) - width + 1, width):
      run = accumulators[start:start + width]
      if self._take_run(run, [updates.get(id(acc), []) for acc in run], scopes):
        name = f"vacc{len(self.lane_of) // width}"
        for lane, acc in enumerate(run): self.lane_of[id(acc)] = (name, lane)
        lanes = [updates[id(acc)] for acc in run]
        for position, lead in enumerate(lanes[0]):
          self.updates[id(lead)] = (name, [lane_updates[position].srcs[1] for lane_updates in lanes])
          self.skipped.update(id(lane_updates[position]) for lane_updates in lanes[1:])

  def __bool__(self) -> bool: return bool(self.lane_of)

  def _take_run(self, run: list[UOp], lanes: list[list[UOp]], scopes: dict[int, int]) -> bool:
    """A run of accumulators is taken when all are float32 sums (or all maxima) from one start value, each updated
    the same number of times in the same loops, and each update's lane values form one vector expression."""
    if any(acc.dtype != dtypes.float32 or acc.arg != run[0].arg for acc in run): return False
    if not lanes[0] or any(len(updates) != len(lanes[0]) for updates in lanes): return False
    combine = lanes[0][0].arg
    for position in range(len(lanes[0])):
      group = [updates[position] for updates in lanes]
      if any(update.arg is not combine or update.arg not in (Ops.ADD, Ops.MAX) or
             scopes[id(update)] != scopes[id(group[0])] for update in group): return False
      if not self._vectorizable([update.srcs[1] for update in group], self.position[id(group[0])]): return False
    return True

  def _vectorizable(self, values: list[UOp], written_at: int) -> bool:
    """Whether a lane group has one vector expression that can be written at position `written_at` (lane 0's
    ACCUMULATE): every lane's mask of a masked load already computed there."""
    stack = [values]
    while stack:
      lanes = stack.pop()
      first = lanes[0]
      if _uniform(lanes): continue
      if _lane_load(lanes) is not None:
        valids = _lane_valids(lanes)
        if valids is None or _uniform(valids) or \
           all(self.position.get(id(valid), written_at) < written_at for valid in valids): continue
        return False
      if not _lane_op(first): return False
      if any(uop.op is not first.op or uop.arg is not first.arg or len(uop.srcs) != len(first.srcs) for uop in lanes):
        return False
      stack.extend([uop.srcs[position] for uop in lanes] for position in range(len(first.srcs)))
    return True

  def accumulator(self, acc: UOp, start: str) -> str:
    """The declaration of a vector accumulator (at its lane 0), every lane starting at `start`."""
    name, _ = self.lane_of[id(acc)]
    return f"{self.type} {name} = {{{', '.join([start] * self.width)}}};"

  def update(self, accumulate: UOp, ref: Callable[[UOp], str]) -> str:
    """The vector update replacing lane 0's ACCUMULATE (and the other lanes' ones at the same position)."""
    name, values = self.updates[id(accumulate)]
    # a max keeps the scalar rule lane by lane: the accumulator wins when it is NaN or larger (vmaxN)
    if accumulate.arg is Ops.MAX: return f"{name} = vmax{self.width}({name}, {self._expression(values, ref, True)});"
    return f"{name} += {self._expression(values, ref)};"

  def _expression(self, lanes: list[UOp], ref: Callable[[UOp], str], vector: bool = False) -> str:
    """The C expression of a lane group. A uniform group is the lane 0 scalar (broadcast where `vector`: an
    operand of the max helper); a consecutive load is one unaligned vector load from lane 0's address."""
    if _uniform(lanes) and lanes[0].dtype == dtypes.bool:   # a bool the same in every lane: its mask, -1 or 0
      return f"((int{self.width}v){{0}} - (int)({ref(lanes[0])}))"
    if _uniform(lanes):
      # x - 0 broadcasts x and keeps the sign of a zero (x + 0 would turn -0 into +0)
      return f"(({ref(lanes[0])}) - ({self.type}){{0}})" if vector else ref(lanes[0])
    load = _lane_load(lanes)
    if load is not None:
      buffer, base, offset, step = load
      start = f"{ref(base)}+{offset}" if base is not None else str(offset)
      valids = _lane_valids(lanes)
      zero = f"({self.type}){{0}}"
      if step == 1 and (valids is None or _uniform(valids)):
        # one validity for every lane (a reduce loop's bound): the vector is loaded only where it holds
        loaded = f"(*(const {self.type}_u*)({ref(buffer)}+({start})))"
        return loaded if valids is None else f"(({ref(valids[0])}) ? {loaded} : {zero})"
      # lanes a fixed stride apart (a transposed operand), or masked lane by lane: the vector is built from scalar
      # loads, once per update, each masked one read only where it is valid (0 elsewhere, as its scalar load)
      elements = [f"{ref(buffer)}[{start}+{lane * step}]" for lane in range(self.width)]
      if valids is not None:
        elements = [f"(({ref(valid)}) ? {element} : 0.0f)" for valid, element in zip(valids, elements)]
      return f"(({self.type}){{{', '.join(elements)}}})"
    first = lanes[0]
    operands = [[uop.srcs[position] for uop in lanes] for position in range(len(first.srcs))]
    if first.op is UOps.ALU and first.arg in VECTOR_INFIX:   # a scalar operand of + or * is broadcast by C itself
      left, right = (self._expression(operand, ref) for operand in operands)
      return f"({left}{VECTOR_INFIX[first.arg]}{right})"
    if first.op is UOps.CAST and first.srcs[0].dtype == first.dtype: return self._expression(operands[0], ref, vector)
    vectors = [self._expression(operand, ref, True) for operand in operands]
    if first.op is UOps.CAST: return f"(({self.type})(({vectors[0]}) & {FLOAT_BITS_OF_ONE}))"   # mask -> 1.0f / 0.0f
    if first.arg is Ops.NEG: return f"(~{vectors[0]})" if first.dtype == dtypes.bool else f"(-{vectors[0]})"
    if first.arg in MASK_COMPARES: return f"({vectors[0]} {MASK_COMPARES[first.arg]} {vectors[1]})"
    if first.arg in MASK_LOGIC: return f"({vectors[0]} {MASK_LOGIC[first.arg]} {vectors[1]})"
    if first.arg is Ops.RECIP: return f"(1.0f/{vectors[0]})"
    if first.arg is Ops.SQRT: return f"vsqrt{self.width}({vectors[0]})"
    if first.arg is Ops.MAX: return f"vmax{self.width}({vectors[0]}, {vectors[1]})"
    if first.arg is Ops.WHERE:
      mask, if_true, if_false = vectors
      mask_type = f"int{self.width}v"
      return f"(({self.type})((({mask}) & ({mask_type}){if_true}) | (~({mask}) & ({mask_type}){if_false})))"
    raise NotImplementedError(f"no vector form of {first.op} {first.arg}")   # _lane_op lets no other op through


def _lane_op(first: UOp) -> bool:
  """Whether lanes of this op (the others checked equal to it) have a vector form: float32 arithmetic of VECTOR_OPS,
  a bool mask (or float32) cast to float32, a compare of float32 lanes, or NOT of masks."""
  # an identity cast (a fresh base of an in-place write: lazy.py LazyBuffer.write) is its operand
  if first.op is UOps.CAST: return first.dtype == dtypes.float32 and first.srcs[0].dtype in (dtypes.bool, first.dtype)
  if first.op is not UOps.ALU: return False
  if first.dtype == dtypes.float32: return first.arg in VECTOR_OPS
  if first.dtype != dtypes.bool: return False
  if first.arg in (Ops.NEG, Ops.AND, Ops.OR): return True
  # masks compare as their -1/0 ints: != is right for them, < is not (true would be the smaller)
  if first.arg is Ops.CMPNE and all(src.dtype == dtypes.bool for src in first.srcs): return True
  return first.arg in MASK_COMPARES and all(src.dtype == dtypes.float32 for src in first.srcs)


def _updates_and_scopes(uops: list[UOp]) -> tuple[dict[int, list[UOp]], dict[int, int]]:
  """Each accumulator's ACCUMULATEs in order, and the innermost open loop (its id; 0 outside loops) of each."""
  updates: dict[int, list[UOp]] = {}
  scopes: dict[int, int] = {}
  open_loops: list[int] = [0]
  for uop in uops:
    if uop.op is UOps.RANGE: open_loops.append(id(uop))
    elif uop.op is UOps.ENDRANGE: open_loops.pop()
    elif uop.op is UOps.ACCUMULATE:
      updates.setdefault(id(uop.srcs[0]), []).append(uop)
      scopes[id(uop)] = open_loops[-1]
  return updates, scopes


def _uniform(lanes: list[UOp]) -> bool:
  """The same value in every lane: one UOp (the builder merges equal ones), or equal constants."""
  first = lanes[0]
  if all(uop is first for uop in lanes): return True
  return first.op is UOps.CONST and all(uop.op is UOps.CONST and uop.arg == first.arg and uop.dtype == first.dtype
                                        for uop in lanes)


def _lane_load(lanes: list[UOp]) -> tuple[UOp, UOp | None, int, int] | None:
  """(buffer, base, offset, step) where lane j loads float32 element base+offset+j*step of one buffer (step 1:
  neighbouring elements, one vector load), each unmasked or masked (`_lane_valids`); else None."""
  first = lanes[0]
  if first.dtype != dtypes.float32 or any(uop.op is not UOps.LOAD or uop.arg is not None or
                                         len(uop.srcs) != len(first.srcs) or len(uop.srcs) not in (2, 3) or
                                         uop.srcs[0] is not first.srcs[0] for uop in lanes):
    return None
  base, offset = _base_and_offset(first.srcs[1])
  second_base, second_offset = _base_and_offset(lanes[1].srcs[1])
  step = second_offset - offset
  if second_base is not base or step == 0: return None
  for lane, uop in enumerate(lanes[2:], start=2):
    if _base_and_offset(uop.srcs[1]) != (base, offset + lane * step): return None
  return first.srcs[0], base, offset, step


def _lane_valids(lanes: list[UOp]) -> list[UOp] | None:
  """Each lane's validity where `_lane_load`'s loads are masked (a load outside its mask reads 0), else None."""
  return [uop.srcs[2] for uop in lanes] if len(lanes[0].srcs) == 3 else None


def _base_and_offset(index: UOp) -> tuple[UOp | None, int]:
  """An index as (base UOp, constant offset): x + c gives (x, c), a constant c gives (None, c), else (x, 0)."""
  if index.op is UOps.CONST: return None, index.arg
  if index.op is UOps.ALU and index.arg is Ops.ADD and len(index.srcs) == 2:
    left, right = index.srcs
    if right.op is UOps.CONST: return left, right.arg
    if left.op is UOps.CONST: return right, left.arg
  return index, 0


# what an elementwise kernel's innermost loop may not contain for `omp simd`: accumulators, local memory, branches,
# barriers, symbolic sizes (kept to the plain loop nest)
_NOT_SIMD = frozenset({UOps.DEFINE_ACC, UOps.DEFINE_LOCAL, UOps.IF, UOps.BARRIER, UOps.DEFINE_VAR})


def through_first_loop_nest(uops: list[UOp]) -> list[UOp]:
  """The kernel's UOps up to the end of its first top-level loop nest: what follows runs once after it (a one-value
  reduce riding along, codegen/ride_along.py), outside the nest's `omp` loops."""
  first = next((index for index, uop in enumerate(uops) if uop.op is UOps.RANGE), None)
  if first is None: return uops
  end = next((index for index, uop in enumerate(uops) if uop.op is UOps.ENDRANGE and uop.srcs[0] is uops[first]),
             len(uops) - 1)
  return uops[:end + 1]


def elementwise_simd_loop(uops: list[UOp]) -> UOp | None:
  """The innermost loop of a CPU elementwise kernel, for the C compiler to vectorize (`omp simd`: neighbouring
  outputs side by side, loads along a contiguous axis as vector loads); None where the kernel is not one.

  An elementwise kernel's iterations are independent (each writes its own output), so `omp simd` is always
  correct; the caller also requires integer math to be index math only (the kernel compiles without -fwrapv).
  A negative index constant (a flipped view, or padding) keeps the kernel scalar: gcc 12's loop vectorizer
  miscompiles some loops over flipped views (ops_clang.FLAG_RULES). A one-value reduce riding after the loop nest
  (codegen/ride_along.py: no loop over outputs) does not count; a second nest over outputs (a packed kernel's
  segments) keeps the kernel scalar."""
  nest = through_first_loop_nest(uops)
  after = uops[len(nest):]
  if any(uop.op is UOps.RANGE and uop.arg[1] is AxisType.GLOBAL for uop in after): return None
  if any(uop.op in _NOT_SIMD for uop in nest): return None
  ranges = [uop for uop in nest if uop.op is UOps.RANGE]
  if not ranges or any(uop.arg[1] is not AxisType.GLOBAL for uop in ranges): return None
  # perfectly nested: every loop opens before the first one closes
  first_end = next((index for index, uop in enumerate(nest) if uop.op is UOps.ENDRANGE), len(nest))
  if any(uop.op is UOps.RANGE for uop in nest[first_end:]): return None
  if any(uop.op is UOps.CONST and uop.dtype == dtypes.int32 and uop.arg < 0 for uop in uops): return None
  return ranges[-1]
