"""UOps: the flat, typed, SSA-like program every renderer reads.

A kernel becomes a list of `UOp`s in execution order. Values are defined once (CONST, LOAD, ALU, CAST, ...);
RANGE/ENDRANGE open and close loops; DEFINE_ACC declares an accumulator that ACCUMULATE updates in place.
GPU kernels add thread indices (SPECIAL), block-shared memory (DEFINE_LOCAL, read and written with LOAD/STORE),
BARRIER (every thread of a block waits until all reach it; local memory written before is visible after),
IF/ENDIF (a block only the threads where the condition holds run) and WARP_REDUCE (a reduction across
neighbouring threads of a warp, without memory). `UOpBuilder` appends UOps with common-subexpression
elimination (per loop or `if` scope), constant folding, and load reuse: a scalar load of an element that a vector
load in scope already read becomes a GEP of that vector.

`AxisType` names the kind of each loop-nest axis; kernels, the linearizer, renderers and the launcher read it
from the SPECIAL and RANGE uops rather than from variable names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from ourgrad.dtype import DType, dtypes, is_additive_identity
from ourgrad.ops import Ops, exec_alu, is_identity_constant


class AxisType(Enum):
  """The kind of an axis of a kernel's loop nest (see codegen/kernel.py for the layout)."""
  GLOBAL = auto()   # over outputs: a loop on CPUs, the block index on GPUs
  LOCAL = auto()    # over outputs: a thread index inside a block (GPU)
  GROUP = auto()    # over a reduce: a thread index inside a block; partials are combined through local memory
  REDUCE = auto()   # over a reduce: a loop inside each thread
  UPCAST = auto()   # over outputs: unrolled into registers
  UNROLL = auto()   # over a reduce: unrolled into registers


# the axis kinds that become GPU thread indices inside a block
THREAD_AXES = frozenset({AxisType.LOCAL, AxisType.GROUP})


class UOps(Enum):
  DEFINE_GLOBAL = auto()   # a kernel argument (buffer pointer); arg = (index, is_output)
  DEFINE_VAR = auto()      # an int kernel argument after the buffers: a symbolic Variable's value; arg = (name, min,
  #                          max); the DEFINE_VARs come right after the DEFINE_GLOBALs, in argument order
  SPECIAL = auto()         # a GPU index; arg = (name, size, launch dimension, AxisType.GLOBAL for a block index
  #                          or AxisType.LOCAL for a thread index inside the block)
  RANGE = auto()           # opens a loop; srcs = (start, end) consts; arg = (loop variable name, AxisType)
  ENDRANGE = auto()        # closes the loop opened by srcs[0]
  CONST = auto()           # a literal
  LOAD = auto()            # srcs = (buffer, index[, valid]); reads 0 where valid is false. arg = None, or a vector
  #                          width n: n neighbouring elements from an index that is a multiple of n (float4 loads)
  STORE = auto()           # srcs = (buffer, index, value[, valid]); with arg = a vector width n: srcs = (buffer,
  #                          index, value 0, ..., value n-1), stored to n neighbouring elements (index a multiple of n)
  ALU = auto()             # arg = the Ops member
  CAST = auto()            # value conversion to dtype
  BITCAST = auto()         # reinterpret the bits as dtype
  DEFINE_ACC = auto()      # an accumulator variable; arg = its start value
  ACCUMULATE = auto()      # srcs = (acc, value); arg = Ops.ADD, Ops.MAX or Ops.MUL (a rescale): acc = op(acc, value)
  GEP = auto()             # srcs = (vector LOAD,); arg = the element taken from it
  DEFINE_LOCAL = auto()    # block-shared memory of `dtype`; arg = (name, element count). LOAD/STORE take it as buffer
  BARRIER = auto()         # all threads of the block wait here; local memory stored before is visible after
  IF = auto()              # srcs = (condition,): the uops up to the matching ENDIF run only where it holds
  ENDIF = auto()           # closes the IF in srcs[0]
  WARP_REDUCE = auto()     # srcs = (value,); arg = (Ops.ADD or Ops.MAX, width, stride): op over the `width`
  #                          threads of a warp whose ids differ by multiples of `stride` in the bits xor reaches
  #                          (width*stride <= warp size, both powers of two); every thread gets the result
  WMMA = auto()            # a warp's tensor-core instruction D = A @ B + C (codegen/tensor_cores.py): srcs = this
  #                          lane's A fragment values, then its B fragment values (in dtype_in), then its C fragment's
  #                          DEFINE_ACCs, which it updates in place with D (as ACCUMULATE does); arg = ((m, n, k),
  #                          dtype_in name, dtype_out name). Every lane of each warp runs it together (no IF around it)
  COPY = auto()            # global -> local memory, the bits as stored: srcs = (local, local index, buffer, index[,
  #                          valid]); arg = (width, asynchronous): `width` neighbouring elements (both indices multiples
  #                          of it), zeros where valid is false. Asynchronous (cp.async on CUDA): the data is visible
  #                          only after the next ASYNC_WAIT and BARRIER
  ASYNC_WAIT = auto()      # arg = n: the thread's asynchronous COPYs are complete except the last n commit groups
  #                          (the copies since the previous ASYNC_WAIT are one group); a BARRIER follows
  OCCUPANCY = auto()       # arg = n: the kernel is compiled for n resident blocks per multiprocessor (CUDA:
  #                          __launch_bounds__'s minimum blocks, which caps its registers per thread); no code
  LDMATRIX = auto()        # a warp's fragment load from local memory (ldmatrix.m8n8.b16): srcs = (local, index of the
  #                          row this lane points at); arg = (count, transposed); count 8x8 matrices, matrix j's rows
  #                          from lanes 8j..8j+7 (8 neighbouring elements each); lane l gets elements 2j, 2j+1 of the
  #                          result (GEP) from matrix j: row l // 4, columns 2 (l % 4) + (0, 1); transposed: rows
  #                          2 (l % 4) + (0, 1), column l // 4. Every lane of each warp runs it together
  ATOMIC_ADD = auto()      # srcs = (buffer, index, value): an int32 add to global memory that no other thread's add
  #                          interleaves with; the result is the element before this thread's add
  COHERENT_LOAD = auto()   # srcs = (buffer, index): a scalar global load past the block's own cache (CUDA's __ldcg),
  #                          so it reads what other blocks stored before their FENCE; the last-block finish's loads
  FENCE = auto()           # this thread's global stores so far are visible to every block before its later ones
  #                          (CUDA's __threadfence): the last-block handshake of a one-kernel split reduce
  DOT_LANES = auto()       # float32 SIMD lanes a row's byte dot products add into (CPU C only), 0 at the start
  BYTE_DOT_ADD = auto()    # lanes += (SIMD int32 partial sums of sum over `count` lanes l of ((u[l] >> shift) & mask) *
  #                          s[l], summed over pairs (u, s)) times a float factor: srcs = (DOT_LANES, factor, then
  #                          (u buffer, u index, s buffer, s index) per pair), u uint8 and s int8 at consecutive
  #                          addresses (u int8 where shift is SIGNED_BYTES); arg = (count, ((shift, mask), ...)); each
  #                          masked byte <= 127 (CPU C only: the renderer's byte_dot_products, codegen/integer_rows.py)
  LANES_TOTAL = auto()     # the float sum of a DOT_LANES' lanes; srcs = (DOT_LANES,)


# a BYTE_DOT_ADD pair's shift where its first operand is int8 bytes too (signed x signed; the mask unused)
SIGNED_BYTES = -1


@dataclass(eq=False)
class UOp:
  """One instruction. Identity-compared: equal computations are merged by the builder, not by __eq__."""
  op: UOps
  dtype: DType | None
  srcs: tuple[UOp, ...] = ()
  arg: Any = None
  uses: int = field(default=0, compare=False)

  def __repr__(self) -> str:
    return f"UOp({self.op.name}, {self.dtype}, {len(self.srcs)} srcs, arg={format_arg(self.arg)})"


def format_arg(arg: Any) -> str:
  """A UOp argument as DEBUG=5 prints it: enum members by name (ADD, GLOBAL), tuples without quotes."""
  if isinstance(arg, Enum): return arg.name
  if isinstance(arg, tuple): return "(" + ", ".join(format_arg(item) for item in arg) + ")"
  return str(arg)


def format_uops(uops: list[UOp]) -> str:
  """One line per UOp: its position, op, dtype, the positions of its sources, and its argument (DEBUG=5)."""
  position = {id(uop): index for index, uop in enumerate(uops)}
  lines = []
  for index, uop in enumerate(uops):
    srcs = [position.get(id(src), "?") for src in uop.srcs]
    lines.append(f"{index:4d} {uop.op.name:<14} {str(uop.dtype):<16} {str(srcs):<16} {format_arg(uop.arg)}")
  return "\n".join(lines)


# uops that are never merged with an earlier identical one: they have effects or open/close scopes
_NOT_CACHED = frozenset({UOps.RANGE, UOps.ENDRANGE, UOps.STORE, UOps.DEFINE_ACC, UOps.ACCUMULATE, UOps.SPECIAL,
                         UOps.DEFINE_LOCAL, UOps.BARRIER, UOps.IF, UOps.ENDIF, UOps.WMMA, UOps.COPY,
                         UOps.ASYNC_WAIT, UOps.LDMATRIX, UOps.OCCUPANCY, UOps.ATOMIC_ADD, UOps.FENCE,
                         UOps.COHERENT_LOAD, UOps.DOT_LANES, UOps.BYTE_DOT_ADD})
# uops that open a scope: values defined inside are not reused after its end
_SCOPE_OPENERS = frozenset({UOps.RANGE, UOps.IF})


class UOpBuilder:
  """Appends UOps in order with CSE and constant folding. Values defined inside a loop are only reused
  inside it (a later use outside would be out of the C scope that declared it)."""

  def __init__(self) -> None:
    self.uops: list[UOp] = []
    self._cache: dict[tuple, UOp] = {}
    self._scopes: list[list[tuple]] = [[]]
    # (buffer, index base, constant offset) of each element a vector load in scope read -> (that load, its element)
    self._vector_lanes: dict[tuple, tuple[UOp, int]] = {}
    # id(DEFINE_ACC) -> the cache keys of the uops that read it: an ACCUMULATE changes it, so they are not reused after
    self._accumulator_readers: dict[int, list[tuple]] = {}

  def add(self, op: UOps, dtype: DType | None, srcs: tuple[UOp, ...] = (), arg: Any = None) -> UOp:
    if op is UOps.ALU:
      folded = self._fold(dtype, srcs, arg)
      if folded is not None: return folded
    if op is UOps.LOAD and arg is None and _reusable_load(dtype, srcs):
      lane = self._vector_lanes.get(_lane_key(srcs))
      if lane is not None and lane[0].dtype == dtype:
        self._drop_if_unused(srcs[1])   # the index was computed for this load alone
        return self.add(UOps.GEP, dtype, (lane[0],), lane[1])
    key = (op, dtype, tuple(id(src) for src in srcs), _hashable(arg))
    # local memory changes between barriers: a load from it is never the same value as an earlier identical load
    cacheable = op not in _NOT_CACHED and not (op is UOps.LOAD and srcs[0].op is UOps.DEFINE_LOCAL)
    if cacheable and key in self._cache: return self._cache[key]
    if op is UOps.ACCUMULATE or op is UOps.WMMA: self._forget_readers(srcs)
    uop = UOp(op, dtype, srcs, arg)
    for src in srcs: src.uses += 1
    self.uops.append(uop)
    if op in _SCOPE_OPENERS: self._scopes.append([])
    if cacheable:
      # constants and kernel arguments are visible everywhere: keep them in the outermost scope
      scope = self._scopes[0] if op in (UOps.CONST, UOps.DEFINE_GLOBAL, UOps.DEFINE_VAR) else self._scopes[-1]
      self._cache[key] = uop
      scope.append(key)
      for src in srcs:
        if src.op is UOps.DEFINE_ACC: self._accumulator_readers.setdefault(id(src), []).append(key)
    if op is UOps.LOAD and isinstance(arg, int) and _reusable_load(dtype, srcs): self._register_lanes(uop)
    return uop

  def _forget_readers(self, srcs: tuple[UOp, ...]) -> None:
    """An accumulator among `srcs` is about to change: a value computed from it before (a running max's negation,
    an online sum's test for zero) is not that value after, so a later identical request builds a new uop."""
    for src in srcs:
      if src.op is not UOps.DEFINE_ACC: continue
      for key in self._accumulator_readers.pop(id(src), ()): self._cache.pop(key, None)

  def _drop_if_unused(self, uop: UOp) -> None:
    """Take back the last uop added where nothing reads it (an ALU computed for a load that was not emitted)."""
    if uop.uses or not self.uops or self.uops[-1] is not uop or uop.op is not UOps.ALU: return
    self.uops.pop()
    for src in uop.srcs: src.uses -= 1
    self._cache.pop((uop.op, uop.dtype, tuple(id(src) for src in uop.srcs), _hashable(uop.arg)), None)

  def _register_lanes(self, vector: UOp) -> None:
    """Remember the address of each element of a vector load for the rest of its scope: a later scalar load of one
    of them (an upcast row read at every tap: conv_tiles' weight gradients) takes the element instead of loading
    again (L1 traffic, and a load instruction per element)."""
    buffer, base, offset = _address(vector.srcs)
    for element in range(vector.arg):
      key = ("lane", buffer, base, offset + element)   # beside the CSE keys in the scope lists: never equal to one
      if key in self._vector_lanes: continue   # an earlier vector has it
      self._vector_lanes[key] = (vector, element)
      self._scopes[-1].append(key)

  def end_range(self, range_uop: UOp) -> None:
    self._close_scope(UOps.ENDRANGE, range_uop)

  def end_if(self, if_uop: UOp) -> None:
    self._close_scope(UOps.ENDIF, if_uop)

  def _close_scope(self, op: UOps, opener: UOp) -> None:
    self.uops.append(UOp(op, None, (opener,)))
    for key in self._scopes.pop():
      self._cache.pop(key, None)
      self._vector_lanes.pop(key, None)

  def const(self, value: Any, dtype: DType) -> UOp:
    return self.add(UOps.CONST, dtype, (), value)

  def alu(self, op: Ops, dtype: DType, *srcs: UOp) -> UOp:
    return self.add(UOps.ALU, dtype, srcs, op)

  def _fold(self, dtype: DType | None, srcs: tuple[UOp, ...], op: Ops) -> UOp | None:
    """Constant folding and the identities that index math produces (x+0, x*1, x*0 on ints; a float x+0.0 only
    with -0.0, dtype.is_additive_identity)."""
    assert dtype is not None
    if all(src.op is UOps.CONST for src in srcs):
      return self.const(exec_alu(op, dtype, tuple(src.arg for src in srcs)), dtype)
    if len(srcs) == 2 and srcs[1].op is UOps.CONST:
      value = srcs[1].arg
      if (is_identity_constant(op, value, dtype) or (op is Ops.IDIV and value == 1)) and srcs[0].dtype == dtype:
        return srcs[0]
      if op is Ops.MUL and value == 0 and not dtype.is_float: return self.const(0, dtype)
    if (len(srcs) == 2 and srcs[0].op is UOps.CONST and op is Ops.ADD and is_additive_identity(srcs[0].arg, dtype)
        and srcs[1].dtype == dtype):
      return srcs[1]
    if op is Ops.WHERE and srcs[0].op is UOps.CONST: return srcs[1] if srcs[0].arg else srcs[2]
    if op is Ops.AND and dtype == dtypes.bool:
      if any(src.op is UOps.CONST and not src.arg for src in srcs): return self.const(False, dtype)
      if srcs[0].op is UOps.CONST: return srcs[1]
      if srcs[1].op is UOps.CONST: return srcs[0]
    return None


def _reusable_load(dtype: DType | None, srcs: tuple[UOp, ...]) -> bool:
  """A float32 load of a kernel argument without a validity source: the loads whose elements a vector load and a
  scalar load read alike. Local memory changes between barriers; a 16-bit pair is a tensor-core fragment's raw bits
  (CUDARenderer.raw_fragment_loads), not a value to take an element of."""
  return dtype == dtypes.float32 and len(srcs) == 2 and srcs[0].op is UOps.DEFINE_GLOBAL


def _address(srcs: tuple[UOp, ...]) -> tuple[int, int, int]:
  """A load's address as (buffer, base, constant offset): the index is `base + constant` (the linearizer puts a
  sum's constant last) or the base alone; a constant index has base 0."""
  buffer, index = srcs[0], srcs[1]
  if index.op is UOps.CONST: return id(buffer), 0, index.arg
  if index.op is UOps.ALU and index.arg is Ops.ADD and index.srcs[1].op is UOps.CONST:
    return id(buffer), id(index.srcs[0]), index.srcs[1].arg
  return id(buffer), id(index), 0


def _lane_key(srcs: tuple[UOp, ...]) -> tuple:
  """The key a scalar load looks its element up by (see UOpBuilder._register_lanes)."""
  return ("lane", *_address(srcs))


def _hashable(arg: Any) -> Any:
  """Constants keyed by type too, so 1 (int) and 1.0 and True are different; NaN equal to itself; a float's sign
  too, so -0.0 and 0.0 (equal in Python) stay two constants."""
  if isinstance(arg, float) and math.isnan(arg): return ("nan",)
  if isinstance(arg, float): return (float, arg, math.copysign(1.0, arg))
  if isinstance(arg, tuple): return tuple(_hashable(item) for item in arg)
  return (type(arg), arg)


def launch_dims(uops: list[UOp]) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(blocks, threads per block) along x, y, z from a kernel's SPECIAL uops; CPU kernels launch once."""
  blocks, threads = [1, 1, 1], [1, 1, 1]
  for uop in uops:
    if uop.op is UOps.SPECIAL:
      _, size, dimension, kind = uop.arg
      (blocks if kind is AxisType.GLOBAL else threads)[dimension] = size
  return tuple(blocks), tuple(threads)
