"""LazyBuffer: a node of the lazy graph that Tensor operations build.

A LazyBuffer is either a *base*, which owns an operation (`op`, `srcs`, `arg`) and can be realized
into a device `Buffer`, or a *view*: a ShapeTracker over a base. Movement ops only make views, so they
cost nothing; elementwise and reduce ops make bases. Constants fold at construction (`x*1`, `x+0`,
constant-constant arithmetic) so the graph stays small. Nothing runs here: the scheduler
(ourgrad/engine/schedule.py) turns the graph into kernels when a value is needed.

A LazyBuffer is a value and never changes. An in-place write (`write`) makes the next version of the written base
(an ASSIGN into its memory, or a new lazy base), the head of the `Storage` all versions of that base share; a
Tensor names memory and reads the newest version (`current`), so views see every write (docs/reliability.md).
"""
from __future__ import annotations

import functools
import math
import threading
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ourgrad.device import Buffer, Device
from ourgrad.dtype import DType, dtypes, truncate
from ourgrad.errors import DeviceError, DTypeError, ShapeError
from ourgrad import lazy_trace
from ourgrad.lazy_reduce import build_reduce, reduce_plan
from ourgrad.lazy_value import is_exact, round_trip_source, value_source
from ourgrad.lazy_views import Storage, place_through_view, reads_in_place, reads_in_place_by_rows, tiles_one_base
from ourgrad.helpers import prod, register_cache_clearer
from ourgrad.ops import (
  ADD, ASSIGN, BITCAST, CAST, COMPARISON_OPS, CONST, CONTIGUOUS, GATHER, MUL, NEG, Ops, PYTHON_ALU, RECIP, REDUCE_OPS,
  SUM, WHERE, exec_alu, is_identity_constant)
from ourgrad.shape.shapetracker import IDENTITY_TRACKERS, ShapeTracker
from ourgrad.shape.symbolic import NumNode, Variable, is_symbolic
from ourgrad.shape.view import View, strides_for_shape

_READERS_LOCK = threading.Lock()

_BOOL = dtypes.bool
_PLAIN_SCALARS = (bool, int, float)   # constant values compared directly (a symbolic one goes to _fold_constants)

# the value a reduce starts from, and what reducing an empty axis gives
REDUCE_IDENTITY = {Ops.SUM: 0, Ops.MAX_REDUCE: -math.inf}


# (dtype, value's type, value, sign) -> truncate(dtype, value). Every step makes the same constants again (learning
# rates, betas, the 0s and 1s of gradients) and truncate's exact rounding costs microseconds. The type and the sign
# are in the key because 1 == 1.0 == True and 0.0 == -0.0 would otherwise share an entry.
_TRUNCATED: dict[tuple, Any] = {}
_TRUNCATED_MAX = 4096


def _truncated(dtype: DType, value: Any) -> Any:
  """truncate(dtype, value), remembered for hashable scalars."""
  kind = type(value)
  try:
    if kind is float: key = (dtype, kind, value, math.copysign(1.0, value))   # (the common case: no isinstance)
    else: key = (dtype, kind, value, math.copysign(1.0, value) if isinstance(value, np.floating) else 0)
    cached = _TRUNCATED.get(key)
  except TypeError:  # not a hashable scalar (a symbolic value): not remembered
    return truncate(dtype, value)
  if cached is None:
    cached = truncate(dtype, value)
    if len(_TRUNCATED) < _TRUNCATED_MAX: _TRUNCATED[key] = cached
  return cached


# uploaded host constants (LazyBuffer.from_host_constant): (device, dtype, shape, numpy dtype, bytes) -> a realized
# base, bounded in count and in size (device memory held for the process)
_HOST_CONSTANTS: dict[tuple, LazyBuffer] = {}
_HOST_CONSTANTS_MAX = 64
_HOST_CONSTANT_MAX_ELEMENTS = 1 << 16


# LazyBuffer.operand_constant's shared constants: (value, value's type, dtype, device, shape), for a zero (value, sign,
# value's type, dtype, device, shape) -> a view of a CONST base. Bounded: cleared when full (a long run with ever new
# shapes starts over rather than keeping them all)
_OPERAND_CONSTANTS: dict[tuple, LazyBuffer] = {}
_OPERAND_CONSTANTS_MAX = 4096
register_cache_clearer(_OPERAND_CONSTANTS.clear)


def _forget_host_constants() -> None:
  """clear_caches' part: the uploads dropped, and the memory they free given back to the devices (the allocators'
  own clearer ran before this one: their reuse caches would keep it)."""
  _HOST_CONSTANTS.clear()
  Device.free_allocator_caches()


register_cache_clearer(_forget_host_constants)


class LazyBuffer:
  """A base (an op to compute) or a view (a ShapeTracker over a base). Built by the class methods (create_base and
  the ones made on it) and `view`, never by calling the class: they set the slots themselves, one frame per op."""
  # slots, not a __dict__: a training step makes thousands of LazyBuffers, and each dict is one more object to
  # allocate and for the cyclic garbage collector to visit (a view sets only the first six)
  __slots__ = ("device", "st", "dtype", "shape", "_base", "_const", "op", "arg", "srcs", "realized", "forced_realize",
               "_readers", "_readers_limit", "_storage", "_trace_index", "_inline", "__weakref__")

  # ---------------------------------------------------------------- construction

  @staticmethod
  def create_base(device: str, shape: tuple[int, ...], dtype: DType, op: Ops, arg: Any = None,
                  srcs: tuple[LazyBuffer, ...] = ()) -> LazyBuffer:
    """A new base computing `op` (with `arg`) over `srcs`, of `shape` and `dtype`: the node every op builds."""
    # every op built runs this: its slots set here, in one frame (no __init__, no helpers)
    base = _new_lazy_buffer(LazyBuffer)
    # (ShapeTracker.from_shape's interned tracker, read without a call where it is made already: a plain subscript,
    # as a try costs nothing until it catches a new shape or a shape given as a list)
    try:
      st = IDENTITY_TRACKERS[shape]
    except (KeyError, TypeError):
      st = ShapeTracker.from_shape(shape)
    base.device, base.st, base.dtype = device, st, dtype
    base.shape = st.shape   # (a remembered attribute of the interned tracker after its first read)
    # a constant (LazyBuffer.full: Tensor.zeros, a folded `x * 0`) is a broadcast scalar, not memory: the storage a
    # tensor holding it stands for, and this buffer's view of it (None: the whole), so that writes to the tensor or
    # through its views reach every view (Storage.of_constant)
    base._base = base._const = None
    base.op, base.arg, base.srcs = op, arg, srcs
    base.realized = None          # set when the scheduler gives this base a buffer
    base.forced_realize = False   # realize even if it could be fused (contiguous(), realize())
    # weak references to the bases that read this one: an in-place write to this base's buffer finds the lazy readers
    # that must still see the old contents (engine/snapshot.py). Made here, so that noting a reader is one append
    # without a lock (see _prune_readers)
    base._readers = []
    base._readers_limit = 16   # (the length at which the list is pruned next: _prune_readers)
    # the memory this base is a version of, once an in-place write made a newer one (`write`): tensors holding this
    # base or a view of it read its newest version (`current`), computed readers keep this one
    base._storage = None
    if not srcs:
      base._trace_index = -1   # its position in the creation trace (lazy_trace.py), -1: not traced
      # a constant's tokens where a traced base reads it as a value (the scheduler writes it into the kernel)
      if op is CONST: base._inline = (lazy_trace.INLINE, lazy_trace.arg_token(arg), dtype, device, base.shape)
      return base
    # the readers of the sources and the creation trace with the base's tokens (lazy_trace.py), written out here
    # rather than in helpers (_add_reader): every op built runs this, and each call of a helper costs more than its
    # work. No lock (an uncontended lock cost more than the rest of this): see _prune_readers
    # (`src._base or src`: a LazyBuffer is always true, and this is one step shorter than the conditional)
    reference = weakref.ref(base)
    trace = _TRACE[0]
    if trace is None: trace = _TRACE[0] = _new_trace()   # (the first base after a schedule: op1's every call)
    if trace.owner == _get_ident() and (position := len(traced := trace.bases)) < lazy_trace.MAX_TRACED:
      # (a trace of this thread, not full)
      base._trace_index = position
      traced.append(base)
      tokens = trace.tokens
      # (lazy_trace.arg_token written out: most args are None or a nonzero number)
      tokens += (op, arg if arg is None or (type(arg) in _KEPT_ARG_TYPES and arg) else lazy_trace.hashable_arg(arg),
                 dtype, device, base.shape)
      for src in srcs:
        source = src._base or src
        # most sources are bases of this trace: their position (an index -1 reads this base, the last one). Their
        # reader lists are not pruned here: a base of the trace gains readers only until the next schedule
        # (MAX_TRACED at most); readers noted later, through the paths below, prune it
        index = source._trace_index
        if index < position and traced[index] is source:
          source._readers.append(reference)
          tokens += (index, src.st)
          continue
        if source.op is not CONST:   # (a constant is never written in place: see _add_reader)
          (readers := source._readers).append(reference)
          if len(readers) > source._readers_limit: _prune_readers(source)
          # a realized source: a leaf, by its number (a new one at its first read in this trace)
          buffer = source.realized
          if buffer is not None:
            leaf = (leaf_index := trace.leaf_index).get(buffer)   # (Buffers compare and hash by identity)
            if leaf is None:
              leaf = leaf_index[buffer] = len(leaf_index)
              trace.leaves.append(buffer)
              tokens += (_NEW_LEAF, leaf, src.st, source.shape, buffer.device, buffer.size, buffer.dtype, type(buffer))
            else:
              tokens += (_LEAF, leaf, src.st, source.shape)
            continue
        elif source.realized is None and not source.forced_realize:   # a constant only read: its value's tokens
          tokens += (source._inline, src.st)
          continue
        lazy_trace.reference(trace, src, source)   # a base made before the trace (or a constant forced)
      return base
    for src in srcs:
      source = src._base or src
      if source.op is not CONST:
        (readers := source._readers).append(reference)
        if len(readers) > source._readers_limit: _prune_readers(source)
    # not traced: the trace belongs to another thread or is full, and is dropped (tainted) until the next schedule
    base._trace_index = -1
    if trace.owner is not None: trace.taint()
    return base

  @staticmethod
  def from_buffer(buffer: Buffer, shape: tuple[int, ...]) -> LazyBuffer:
    """A realized base around an existing device buffer."""
    lazy = LazyBuffer.create_base(buffer.device, shape, buffer.dtype, Ops.EMPTY)
    lazy.realized = buffer
    return lazy

  @staticmethod
  def from_numpy(array: np.ndarray, dtype: DType, device: str) -> LazyBuffer:
    """Copy host data into a new device buffer (bfloat16 arrives as its uint16 bit pattern)."""
    data = np.ascontiguousarray(array)
    buffer = Buffer(device, data.size, dtype)
    if data.size: buffer.copyin(memoryview(data.reshape(-1)).cast("B"))
    return LazyBuffer.from_buffer(buffer, tuple(array.shape))

  @staticmethod
  def from_host_constant(array: np.ndarray, dtype: DType, device: str) -> LazyBuffer:
    """The values of a small host-computed array (Tensor.arange), uploaded once per (values, dtype, device) and read
    through a new lazy identity op at each call: a one-hot target or a causal mask of an eager step makes the same
    range every step, and each upload cost a buffer and a host-to-device copy. The op fuses into its readers, and it
    is a base of its own, so an in-place write to the result never reaches the shared memory."""
    data = np.ascontiguousarray(array)
    if data.size > _HOST_CONSTANT_MAX_ELEMENTS or device.startswith("DISK"):
      return LazyBuffer.from_numpy(data, dtype, device)
    key = (device, dtype, data.shape, data.dtype.str, data.tobytes())
    uploaded = _HOST_CONSTANTS.get(key)
    if uploaded is None:
      uploaded = LazyBuffer.from_numpy(data, dtype, device)
      if len(_HOST_CONSTANTS) >= _HOST_CONSTANTS_MAX: _HOST_CONSTANTS.pop(next(iter(_HOST_CONSTANTS)))  # oldest first
      _HOST_CONSTANTS[key] = uploaded
    return LazyBuffer.create_base(device, uploaded.shape, dtype, CAST, dtype, (uploaded,))

  @staticmethod
  def empty(shape: tuple[int, ...], dtype: DType, device: str) -> LazyBuffer:
    return LazyBuffer.from_buffer(Buffer(device, prod(shape), dtype), shape)

  @staticmethod
  def full(value: Any, shape: tuple[int, ...], dtype: DType, device: str) -> LazyBuffer:
    """A constant: one scalar CONST base viewed (reshape + expand) as `shape`; no memory is used."""
    # the memory a tensor holding it stands for: written on first write (Storage.of_constant)
    return Storage.of_constant(_constant(value, shape, dtype, device))

  @staticmethod
  def operand_constant(value: Any, shape: tuple[int, ...], dtype: DType, device: str) -> LazyBuffer:
    """`value` broadcast to `shape` as an operand of an op being built (the 1.5 of `x + 1.5`, relu's 0, a gradient's
    scale): equal to `full`'s, but one shared LazyBuffer per (value, dtype, device, shape), made once. Such a
    constant is only read by the op built from it, never held by a tensor the user can write to, so it needs no
    storage of its own (`full` tags one per call), and a constant is never written in place."""
    kind = type(value)
    try:
      if value:   # (most operands: a non-zero value, whose sign its value tells)
        key: tuple = (value, kind, dtype, device, shape)
      else:   # 0.0 and -0.0 are equal but different constants (the key one longer: never equal to the one above)
        sign = math.copysign(1.0, value) if kind is float or isinstance(value, np.floating) else 0
        key = (value, sign, kind, dtype, device, shape)
      shared = _OPERAND_CONSTANTS.get(key)
    except (TypeError, ValueError):   # a value or size that does not hash (or an array's truth value): not shared
      return _constant(value, shape, dtype, device)
    if shared is not None: return shared
    shared = _constant(value, shape, dtype, device)
    # (one element or none, the view is contiguous: shared too, since `contiguous()` copies a constant rather than
    # marking its base)
    if value != value: return shared   # NaN: never equal to its key
    if len(_OPERAND_CONSTANTS) >= _OPERAND_CONSTANTS_MAX: _OPERAND_CONSTANTS.clear()
    _OPERAND_CONSTANTS[key] = shared
    return shared

  def const_like(self, value: Any, dtype: DType | None = None) -> LazyBuffer:
    """`value` in this buffer's shape (and device; in `dtype` or this dtype), as a tensor of its own (`full`)."""
    return LazyBuffer.full(value, self.shape, dtype or self.dtype, self.device)

  def operand_like(self, value: Any, dtype: DType | None = None) -> LazyBuffer:
    """`value` in this buffer's shape as an operand of an op being built (`operand_constant`), not a result."""
    return LazyBuffer.operand_constant(value, self.shape, dtype or self.dtype, self.device)

  # ---------------------------------------------------------------- properties

  @property
  def base(self) -> LazyBuffer: return self._base if self._base is not None else self

  @property
  def is_base(self) -> bool: return self._base is None

  @property
  def reads_whole_base(self) -> bool:
    """Whether this buffer reads all of its base's memory as it lies, row-major from element 0: the base itself or a
    contiguous view of all of it (a reshape). Then the base's buffer holds exactly this buffer's values."""
    return self._base is None or (self.st.contiguous and self.size == self._base.size)

  @property
  def size(self) -> int: return prod(self.shape)

  @property
  def is_realized(self) -> bool: return self.base.realized is not None

  def const_value(self) -> Any | None:
    """The constant this buffer holds everywhere, or None if it is not an unpadded constant."""
    base = self._base if self._base is not None else self
    if base.op is not CONST or base.realized is not None: return None
    for view in self.st.views:
      if view.mask is not None: return None
    return base.arg

  def __repr__(self) -> str:
    if self.is_base: return f"<LB {self.device} {self.shape} {self.dtype} op={self.op} realized={self.is_realized}>"
    return f"<LB view {self.shape} of {self.base!r}>"

  # ---------------------------------------------------------------- readers (for copy-on-write before an assign)

  def _add_reader(self, reader: LazyBuffer) -> None:
    """Note `reader` among the readers of this buffer's base (create_base writes the same out for its sources). A
    constant keeps none: it is never written in place (a write to one makes a new base: `_write_constant`), and a
    shared constant (`operand_constant`) would collect every step's readers."""
    base = self._base if self._base is not None else self
    if base.op is CONST: return
    base._readers.append(weakref.ref(reader))
    if len(base._readers) > base._readers_limit: _prune_readers(base)

  def live_readers(self) -> Iterator[LazyBuffer]:
    """The bases built from this one that are still alive (each at most once)."""
    seen: set[int] = set()
    for ref in tuple(self._readers or ()):   # (a copy: another thread may prune it in place meanwhile)
      reader = ref()
      if reader is not None and id(reader) not in seen:
        seen.add(id(reader))
        yield reader

  # ---------------------------------------------------------------- views

  def view(self, st: ShapeTracker) -> LazyBuffer:
    """This buffer's base seen through `st` (the identity view of a base is the base itself)."""
    base = self._base or self
    # a base's tracker is the identity (contiguous): any contiguous view of all of it is the base
    if st is base.st or (st.contiguous and st.shape == base.shape): return base
    view = _new_lazy_buffer(LazyBuffer)   # (a view has only these six slots: set here, no __init__ frame)
    view.device, view.st, view.dtype, view.shape = self.device, st, self.dtype, st.shape
    view._base, view._const = base, None
    return view

  # reshape, permute and expand (every broadcast and matmul makes them): the view itself where this is no constant
  # tensor's storage (_moved's common case, one frame less)
  def reshape(self, shape: tuple[int, ...]) -> LazyBuffer:
    if shape == self.shape: return self
    return self.view(self.st.reshape(shape)) if self._const is None else self._moved(ShapeTracker.reshape, shape)

  def permute(self, axes: tuple[int, ...]) -> LazyBuffer:
    if axes == tuple(range(len(self.shape))): return self
    return self.view(self.st.permute(axes)) if self._const is None else self._moved(ShapeTracker.permute, axes)

  def expand(self, shape: tuple[int, ...]) -> LazyBuffer:
    if shape == self.shape: return self
    return self.view(self.st.expand(shape)) if self._const is None else self._moved(ShapeTracker.expand, shape)

  # pad and shrink: loops rather than all() over a generator (a frame resumed per dimension; convolutions and pooling
  # make them every step); nothing to pad or cut is this buffer itself
  def pad(self, arg: tuple[tuple[int, int], ...]) -> LazyBuffer:
    for pads in arg:
      if pads != (0, 0): return self._moved(ShapeTracker.pad, arg)
    return self

  def shrink(self, arg: tuple[tuple[int, int], ...]) -> LazyBuffer:
    for bounds, size in zip(arg, self.shape):
      if bounds != (0, size): return self._moved(ShapeTracker.shrink, arg)
    return self

  def flip(self, axes_mask: tuple[bool, ...]) -> LazyBuffer:
    return self if not any(axes_mask) else self._moved(ShapeTracker.flip, axes_mask)

  def _moved(self, move: Callable[[ShapeTracker, Any], ShapeTracker], arg: Any) -> LazyBuffer:
    """The view `move(tracker, arg)` makes of this buffer (a ShapeTracker movement method and its argument: no
    closure made per op); a view of a constant tensor's storage stays one (Storage)."""
    out = self.view(move(self.st, arg))
    if self._const is not None and out is not self:
      storage, st = self._const
      out._const = (storage, move(st if st is not None else ShapeTracker.from_shape(storage.shape), arg))
    return out

  # ---------------------------------------------------------------- compute

  def elementwise(self, op: Ops, other: LazyBuffer | None = None, third: LazyBuffer | None = None, *, arg: Any = None,
                  dtype: DType | None = None) -> LazyBuffer:
    """`op` applied elementwise to self and the other sources (same shape); folds constants where it can."""
    # the common cases written out (no tuple of sources to loop over, no folding checks unless a source is a
    # constant): a binary op or a unary op of a computed value. They decide as the general path below; an operand on
    # another device or of another shape, or a binary op with an arg, takes that path (which raises where it must)
    mine = self._base or self
    if other is None:
      if mine.op is not CONST:   # (nothing to fold)
        if op is not NEG: return LazyBuffer.create_base(self.device, self.shape, dtype or self.dtype, op, arg, (self,))
        if arg is None and dtype is None and self.dtype.is_float:
          # -x as x * -1 (why: the general path below), built as its binary fast path builds it (a -1 never folds)
          minus_one = LazyBuffer.operand_constant(-1, self.shape, self.dtype, self.device)
          return LazyBuffer.create_base(self.device, self.shape, self.dtype, MUL, None, (self, minus_one))
    elif third is None and arg is None and other.shape == self.shape and other.device == self.device:
      theirs = other._base or other
      out_dtype = dtype or (_BOOL if op in COMPARISON_OPS else other.dtype)
      if mine.op is CONST or theirs.op is CONST:
        value = theirs.arg if theirs.op is CONST else mine.arg
        if (mine.op is CONST and theirs.op is CONST) or ((op is ADD or op is MUL) and (
            type(value) not in _PLAIN_SCALARS or value == 0 or (op is MUL and value == 1))):
          folded = self._fold_constants(op, (self, other), out_dtype)
          if folded is not None: return folded
      return LazyBuffer.create_base(self.device, self.shape, out_dtype, op, None, (self, other))
    elif op is WHERE and third is not None and arg is None and other.shape == self.shape == third.shape and \
        other.device == self.device and third.device == self.device and \
        (mine.op is not CONST or (other._base or other).op is not CONST or (third._base or third).op is not CONST):
      # a select (every backward's masks): only three constants fold (the general path's rule for WHERE)
      return LazyBuffer.create_base(self.device, self.shape, dtype or third.dtype, WHERE, None, (self, other, third))
    others = () if other is None else (other,) if third is None else (other, third)
    srcs = (self, *others)
    for src in others:
      if src.device != self.device:
        raise DeviceError(f"{op.name} got tensors on different devices: {self.device} and {src.device}; "
                          f"move one with .to({self.device!r})")
      if src.shape != self.shape: raise AssertionError(f"elementwise shapes differ: {self.shape} vs {src.shape}")
    out_dtype = dtype or (dtypes.bool if op in COMPARISON_OPS else srcs[-1].dtype)
    if op is NEG and self.dtype.is_float and \
        ((self if self._base is None else self._base).op is not CONST or self.const_value() is None):
      # -x as x * -1: a pad pushed through NEG would give -(0) = -0.0 in the padding, where a padded constant -1
      # gives 0 * 0 = +0.0 as PyTorch pads (and -(+0.0) is still -0.0 inside)
      return self.elementwise(MUL, self.operand_like(-1, self.dtype))
    # only constants fold, and with a non-constant operand only in x + 0, x * 1 and an integer x * 0
    # (_fold_constants): most ops (x * y, x + 1, max(x, 0)) build their base without a _fold_constants call
    constants, value = 0, None
    for src in srcs:
      source = src if src._base is None else src._base
      if source.op is CONST: constants, value = constants + 1, source.arg
    if constants and (constants == len(srcs) or ((op is ADD or op is MUL) and (
        type(value) not in _PLAIN_SCALARS or value == 0 or (op is MUL and value == 1)))):
      folded = self._fold_constants(op, srcs, out_dtype)
      if folded is not None: return folded
    return LazyBuffer.create_base(self.device, self.shape, out_dtype, op, arg, srcs)

  def _fold_constants(self, op: Ops, srcs: tuple[LazyBuffer, ...], out_dtype: DType) -> LazyBuffer | None:
    """The folded result of `op` over `srcs` where one of them is a constant base (elementwise checks), or None."""
    if len(srcs) == 2:   # (most folds: one constant operand; the other source's value without a const_value call)
      left, right = srcs
      values = [left.const_value() if (left if left._base is None else left._base).op is CONST else None,
                right.const_value() if (right if right._base is None else right._base).op is CONST else None]
    else:
      values = [src.const_value() for src in srcs]
    if None not in values and op is not CAST and op is not BITCAST:
      if op is RECIP and out_dtype.is_int: exec_alu(op, out_dtype, tuple(values))   # (raises)
      # rounded to the dtype by const_like, which remembers the rounding of each value (exec_alu's costs ~1 us)
      return self.const_like(PYTHON_ALU[op](*values), out_dtype)
    # (only x + 0, x * 1 and integer x * 0 fold below)
    if (op is ADD or op is MUL) and len(srcs) == 2 and srcs[0].dtype == srcs[1].dtype == out_dtype:
      left, right = srcs
      # x+0 and x*1 are x; x*0 is 0 only where there is no NaN to keep (integers and bools). For floats only -0.0 is
      # the additive identity: (-0.0) + (+0.0) is +0.0, so x + (+0.0) stays an add. A result is a new tensor,
      # never x's own memory: folded only where x is still lazy (x * 1 of a stored x would alias it, and a later
      # x.assign(...) would change the result too)
      left_value, right_value = values
      if right_value is not None and is_identity_constant(op, right_value, out_dtype) and _is_lazy(left): return left
      if left_value is not None and is_identity_constant(op, left_value, out_dtype) and _is_lazy(right): return right
      if op is MUL and not out_dtype.is_float and 0 in (left_value, right_value):
        return self.const_like(0, out_dtype)
    return None

  def cast(self, dtype: DType, bitcast: bool = False) -> LazyBuffer:
    if dtype == self.dtype: return self
    if bitcast and dtype.itemsize != self.dtype.itemsize:
      raise DTypeError(f"bitcast needs dtypes of one size: {self.dtype} is {self.dtype.itemsize} bytes, "
                       f"{dtype} is {dtype.itemsize}")
    # a constant casts to a constant (const_value asked only of a constant's views: most casts are of computed values)
    base_op = (self if self._base is None else self._base).op
    if not bitcast and base_op is CONST:
      value = self.const_value()
      if value is not None: return self.const_like(_truncated(dtype, value), dtype)
    if not bitcast and base_op is CAST:
      # x.cast(wider).cast(x.dtype) is x, folded where x is a computation (as x * 1 is; lazy_value.py)
      source = round_trip_source(self, dtype)
      if source is not None and _is_lazy(source) and is_exact(source): return source
    return LazyBuffer.create_base(self.device, self.shape, dtype, BITCAST if bitcast else CAST, dtype, (self,))

  def reduce(self, op: Ops, axes: tuple[int, ...], split: bool = True) -> LazyBuffer:
    """Reduce over `axes`; the result keeps them as size-1 dimensions. `split`: the device may run it as two
    kernels (lazy_reduce.reduce_plan, a remembered decision); False for the stages of such a split (sized to fill the
    device already)."""
    if op not in REDUCE_OPS: raise AssertionError(f"{op} is not a reduce op")
    shape = self.shape
    # (one loop, no generator expression: every reduce built runs this)
    kept, reduced, empty = list(shape), [], False
    for axis in sorted(axes):
      size = shape[axis]
      if size != 1:
        reduced.append(axis)
        kept[axis] = 1
        if size == 0: empty = True
    if not reduced: return self
    axes, out_shape = tuple(reduced), tuple(kept)
    if empty: return LazyBuffer.full(REDUCE_IDENTITY[op], out_shape, self.dtype, self.device)
    # (const_value asked only of a constant's views: most reduces are of computed values)
    value = self.const_value() if (self._base or self).op is CONST else None
    if value is not None and not (op is SUM and any(is_symbolic(self.shape[axis]) for axis in axes)):
      count = prod(self.shape[axis] for axis in axes)
      return LazyBuffer.full(value * count if op is SUM else value, out_shape, self.dtype, self.device)
    # a host CPU's packed sum, or the device's split into stages (lazy_reduce.py)
    if (op is SUM or split) and (plan := reduce_plan(self, op, axes, out_shape, split)) is not None:
      return build_reduce(self, op, axes, out_shape, plan)
    return LazyBuffer.create_base(self.device, out_shape, self.dtype, op, axes, (self,))

  def contiguous(self) -> LazyBuffer:
    """A buffer holding these values in row-major order (realized as its own kernel if it is a view)."""
    # a base, or a plain reshape of one, already is row-major data: realize the base, no copy. Not an unrealized
    # constant's base, which may be shared by many readers (`operand_constant`: one element is a contiguous view)
    base = self.base
    if self.reads_whole_base and (base.op is not CONST or base.realized is not None):
      lazy_trace.force(base)   # (noted in the creation trace: the base's tokens were written without it)
      return self
    return LazyBuffer.create_base(self.device, self.shape, self.dtype, CONTIGUOUS, None, (self,))

  def clone(self) -> LazyBuffer:
    """A copy in a buffer of its own (unlike contiguous(), never the same memory as this buffer)."""
    return LazyBuffer.create_base(self.device, self.shape, self.dtype, CONTIGUOUS, None, (self,))

  def copy_to_device(self, device: str) -> LazyBuffer:
    device = Device.canonicalize(device)
    if device == self.device: return self
    value = self.const_value()
    if value is not None: return LazyBuffer.full(value, self.shape, self.dtype, device)
    if self.device.startswith("DISK:"): return self._copy_from_disk(device)
    source = self.contiguous()
    return LazyBuffer.create_base(device, self.shape, self.dtype, Ops.COPY, None, (source,))

  # ---------------------------------------------------------------- copies out of DISK (memory-mapped files)

  def base_range(self) -> tuple[int, int] | None:
    """(first element, element count) of the base's memory that this buffer reads in row-major order, when that is
    one contiguous run (the base itself, a reshape, a shrink of the leading axis, ...); None otherwise."""
    if self.is_base: return 0, self.size
    st = self.st.simplify()
    view = st.views[-1]
    if len(st.views) != 1 or view.mask is not None: return None
    if self.size == 0: return 0, 0
    return (view.offset, self.size) if view.strides == strides_for_shape(view.shape) else None

  def fixed_base_range(self) -> tuple[int, int] | None:
    """`base_range` when neither this view nor its base's shape holds a Variable: the same run of the buffer whatever
    the Variables are bound to, that a caller may name as memory (a stored view read in place, a JIT output)."""
    if self.st.symbolic or any(is_symbolic(size) for size in self.base.shape): return None
    run = self.base_range()
    return run if run is not None and type(run[0]) is int and type(run[1]) is int else None

  def _copy_from_disk(self, device: str) -> LazyBuffer:
    """This DISK buffer (a window of a file) or view of one, copied to `device`. DISK runs no kernels, so a view is
    never made contiguous on DISK: a view that is one contiguous run of the base (`base_range`) is copied as that
    byte range of the file (the scheduler cuts the source buffer to it), and any other view (permute, flip, steps,
    pad, expand) copies the smallest run of the file that covers every element it reads, then applies the view on
    `device`. Computing on DISK first (`disk + 1`, a cast) raises DeviceError here."""
    base = self.base
    if base.realized is None and base.op is not Ops.COPY:
      raise DeviceError(f"DISK tensors can only be copied to another device: use .to({device!r}) before computing "
                        f"with them (got {base.op.name if base.op else 'an op'} on {self.device})")
    span = self.base_range()
    if span is not None:
      source = base if span == (0, base.size) else self
      return LazyBuffer.create_base(device, self.shape, self.dtype, Ops.COPY, None, (source,))
    low, high = self._covered_range()
    if low >= high: return LazyBuffer.full(0, self.shape, self.dtype, device)  # no valid element: all padding
    covering = base if (low, high) == (0, base.size) else base.reshape((base.size,)).shrink(((low, high),))
    chunk = LazyBuffer.create_base(device, (high - low,), self.dtype, Ops.COPY, None, (covering,))
    # views[0] indexes the base from its element 0; the chunk holds the base from element `low` on
    first = self.st.views[0]
    shifted = View.create(first.shape, first.strides, first.offset - low, first.mask)
    return chunk.view(ShapeTracker((shifted,) + self.st.views[1:]))

  def _covered_range(self) -> tuple[int, int]:
    """[low, high): base elements that the valid elements of this view can read (a superset where the index math
    is not exact); an empty range when no element is valid."""
    last = self.st.views[-1]
    if self.size == 0 or last.never_valid: return 0, 0
    ranges = last.mask if last.mask is not None else tuple((0, size) for size in self.shape)
    idxs = [Variable(f"idx{dim}", start, end - 1) if end - start > 1 else NumNode(start)
            for dim, (start, end) in enumerate(ranges)]
    index, valid = self.st.expr_idxs(idxs)
    if isinstance(valid, NumNode) and valid.b == 0: return 0, 0
    return max(index.min, 0), min(index.max + 1, self.base.size)

  def gather_rows(self, index: LazyBuffer) -> LazyBuffer:
    """Rows of this (N, R) table picked by the (M,) int32 `index` -> (M, R); an index outside [0, N) gives a row
    of zeros. The kernel reads only the picked rows (the table is realized, row-major, and loaded at computed
    offsets), not the whole table."""
    if len(self.shape) != 2 or len(index.shape) != 1 or index.dtype != dtypes.int32:
      raise AssertionError(f"gather_rows needs a (N, R) table and an (M,) int32 index, got {self.shape}, "
                           f"{index.shape} {index.dtype}")
    if index.device != self.device:
      raise DeviceError(f"gather_rows: the index is on {index.device}, the table on {self.device}")
    rows, width = self.shape
    base = self.base
    if base.op is CAST and base.realized is None and self.reads_whole_base and \
       base.srcs[0].dtype.is_float and base.dtype.is_float and base.srcs[0].dtype.itemsize < base.dtype.itemsize:
      # a widening float cast is exact, so it commutes with the pick: the narrow values are the table (bfloat16
      # logits under autocast: stored as they are, not copied into a float32 table) and the picked rows are widened
      return base.srcs[0].reshape(self.shape).gather_rows(index).cast(self.dtype)
    table = self.contiguous()  # row-major memory of its own: the kernel computes addresses into it
    spread = index.reshape((index.shape[0], 1)).expand((index.shape[0], width))
    return LazyBuffer.create_base(self.device, (index.shape[0], width), self.dtype, GATHER, rows, (table, spread))

  def accumulate_rows(self, index: LazyBuffer, rows: LazyBuffer) -> LazyBuffer:
    """This (N, R) buffer with rows[m] of the (M, R) `rows` added to row index[m] of it, for m = 0, 1, ... in
    order (the (M,) int32 `index`; repeated indices are summed, an index outside [0, N) adds nothing). One kernel of
    its own that never forms an (M, N) one-hot (codegen/index_accumulate.py); elementwise work on its sources (an
    index's cast, a constant start) is fused into it."""
    if len(self.shape) != 2 or len(index.shape) != 1 or index.dtype != dtypes.int32 or \
       rows.shape != (index.shape[0], self.shape[1]) or rows.dtype != self.dtype:
      raise AssertionError(f"accumulate_rows needs a (N, R) start, an (M,) int32 index and (M, R) rows of its dtype, "
                           f"got {self.shape} {self.dtype}, {index.shape} {index.dtype}, {rows.shape} {rows.dtype}")
    if index.device != self.device or rows.device != self.device:
      raise DeviceError(f"accumulate_rows: start on {self.device}, index on {index.device}, rows on {rows.device}")
    if any(is_symbolic(size) for size in self.shape + index.shape):
      raise ShapeError(f"an indexed add (a scatter_add, index_add or a lookup's gradient) needs concrete sizes, got "
                       f"a ({', '.join(str(size) for size in self.shape)}) table and {index.shape[0]} indices: a "
                       f"symbolic size (a Variable) is not supported here")
    if index.shape[0] == 0 or self.size == 0: return self
    return LazyBuffer.create_base(self.device, self.shape, self.dtype, Ops.INDEX_ACCUMULATE, None, (self, index, rows))

  def attention(self, key: LazyBuffer, value: LazyBuffer, causal: bool, scale: float) -> LazyBuffer:
    """Fused attention of this (B, H, L, D) query with (B, Hk, S, D) keys and values (H a multiple of Hk): one
    buffer of this dtype: O laid out (B, L, H, D), then the bytes of the float32 natural-log logsumexp of each query
    row, (B, H, L) (codegen/attention.py). Each operand (or the stored buffer it has every value of: lazy_value.py)
    is read in place through its strides where its view is one unmasked View of a buffer; else made contiguous
    first. The caller (tensor_attention.py) checks the shapes."""
    operands = tuple(operand if reads_in_place(operand) else operand.contiguous()
                     for operand in map(value_source, (self, key, value)))
    batch, heads, length, head_dim = self.shape
    lse_elements = batch * heads * length * 4 // self.dtype.itemsize   # float32 values in this dtype's elements
    return LazyBuffer.create_base(self.device, (batch * length * heads * head_dim + lse_elements,), self.dtype,
                                  Ops.ATTENTION, (causal, float(scale)), operands)

  def attention_grads(self, key: LazyBuffer, value: LazyBuffer, forward: LazyBuffer, grad_out: LazyBuffer,
                      causal: bool, scale: float, packed: bool = False,
                      single_pass: bool = False) -> tuple[LazyBuffer, LazyBuffer]:
    """The fused attention backward of this (B, H, L, D) query with (B, Hk, S, D) keys and values, `forward` the
    Ops.ATTENTION buffer their forward wrote (O and LSE) and `grad_out` dO (B, H, L, D) in the operands' dtype: two
    kernels (codegen/attention_grad.py). Returns (one buffer of this dtype: dq (B, H, L, D) contiguous, then the
    bytes of the float32 delta (B, H, L); one buffer of this dtype: dk then dv, each (B, Hk, S, D) contiguous).
    Operands (or the stored buffers they have every value of: lazy_value.py, dO = g.cast(float32).cast(bfloat16) is
    g) are read in place where their view allows it (`reads_in_place`, the last dim contiguous, a 16-byte aligned
    start), else made contiguous.
    `packed` (q, k, v tile one base: `tiles_one_base`): both ops write ONE buffer, the base's elements then delta's
    bytes, dq, dk and dv stored through q, k and v's views (the gradient of the base, in its own layout: no
    concatenation); the dK/dV op writes into the dQ op's buffer (engine/schedule.py gives them one) and is returned
    twice.
    `single_pass` (the caller asks where the device runs it: codegen/attention_grad.single_pass_backward): the dQ op
    computes delta and zeroes a float32 dQ and its counts, the dK/dV op adds dQ into it and writes dq, dk and dv, both
    in ONE buffer of this dtype (the dK/dV op's, returned twice): the gradients (dq, dk, dv contiguous, or packed: the
    base's elements), then the float32 dQ (B, H, L, D), delta, and the uint32 counts. Refused (two kernels) where an
    operand's rows are not 16-byte aligned (the wgmma kernels' copies)."""
    if packed and not tiles_one_base(self, key, value): raise AssertionError("packed gradients need tiled operands")
    q, k, v, do = (operand if reads_in_place_by_rows(operand) else operand.contiguous()
                   for operand in map(value_source, (self, key, value, grad_out)))
    batch, heads, length, head_dim = self.shape
    kv_elements = batch * key.shape[1] * key.shape[2] * head_dim
    delta_elements = batch * heads * length * 4 // self.dtype.itemsize   # float32 values in this dtype's elements
    width = 16 // self.dtype.itemsize
    single_pass = single_pass and all(stride % width == 0 for operand in (q, k, v, do)
                                      for stride in operand.st.views[0].strides[:3])
    arg = (causal, float(scale), packed, single_pass)
    if single_pass:   # (the float32 dQ starts 16-byte aligned: head_dim is a multiple of 64 here)
      q_elements = batch * heads * length * head_dim
      gradients = self.base.size if packed else q_elements + 2 * kv_elements
      counts = batch * heads * -(-length // 16)   # codegen/attention_backward_plan.DQ_COUNT_ROWS
      size = gradients + (q_elements + counts) * 4 // self.dtype.itemsize + delta_elements
      dq = LazyBuffer.create_base(self.device, (size,), self.dtype, Ops.ATTENTION_DQ, arg, (q, k, v, forward, do))
      dkdv = LazyBuffer.create_base(self.device, (size,), self.dtype, Ops.ATTENTION_DKDV, arg,
                                    (q, k, v, do, forward, dq))
      return dkdv, dkdv
    dq_elements = self.base.size if packed else batch * heads * length * head_dim
    dq = LazyBuffer.create_base(self.device, (dq_elements + delta_elements,), self.dtype, Ops.ATTENTION_DQ, arg,
                                (q, k, v, forward, do))
    dkdv_shape = dq.shape if packed else (2 * kv_elements,)
    dkdv = LazyBuffer.create_base(self.device, dkdv_shape, self.dtype, Ops.ATTENTION_DKDV, arg,
                                  (q, k, v, do, forward, dq))
    return (dkdv if packed else dq), dkdv

  # ---------------------------------------------------------------- in-place writes (versions of a storage)

  @property
  def stale(self) -> bool:
    """Whether an in-place write made a newer version of this buffer's base (a tensor holding it reads `current`)."""
    base = self._base if self._base is not None else self
    storage = base._storage
    return (storage is not None and storage.head is not base) or \
        (self._const is not None and self._const[0].head is not None)

  def current(self) -> LazyBuffer:
    """This buffer as its storage is now: the same view over the newest version of its base, after every in-place
    write made so far (PyTorch's views share memory)."""
    if self._const is not None and self._const[0].head is not None:
      head, st = self._const[0].head, self._const[1]
      return head if st is None else head.view(st)
    base = self.base
    if base._storage is None or base._storage.head is base: return self
    return base._storage.head if self is base else base._storage.head.view(self.st)

  def write(self, value: LazyBuffer) -> LazyBuffer:
    """Write `value` (this buffer's shape and dtype) into the elements this buffer views, in place; returns this
    buffer's view of the written storage. Its base gets a newer version (`current`): an ASSIGN into the same memory
    when the base is memory (realized, or an earlier assign), else the new values as a lazy base of their own.
    A view writes through: the base's new version keeps its other elements (`place_through_view`). A constant
    (`Tensor.zeros`, `full`) is memory only once written (`_write_constant`). docs/reliability.md has the rules."""
    # (the base and reads_whole_base written out: an optimizer step writes three buffers a parameter)
    base = self if self._base is None else self._base
    if base.op is CONST: return self._write_constant(value)
    whole = self._base is None or self.reads_whole_base
    if whole:
      full = value if value.shape == base.shape else value.reshape(base.shape)
    else:
      placed = place_through_view(value, self.st, base.shape)
      if placed is None: return self   # an empty view: nothing is written
      full = placed[1].elementwise(WHERE, placed[0], base)
    if base.op is ASSIGN or base.realized is not None:
      new = base.assign(full)
    elif full.is_base and not whole:
      new = full   # the merge made above: a base no one else holds
    else:   # a base of its own (an identity cast fuses into its readers), so later writes change no other tensor
      new = LazyBuffer.create_base(self.device, base.shape, self.dtype, CAST, self.dtype, (full,))
    if base._storage is None: base._storage = Storage(base.shape)
    base._storage.become(new)
    return new if self is base else new.view(self.st)

  def _write_constant(self, value: LazyBuffer) -> LazyBuffer:
    """`write` into a constant: the storage a tensor holding it stands for (LazyBuffer.full tags every constant it
    makes: Tensor.zeros, a folded `x * 0`) gets its first version, the constant with `value` written in (a lazy base
    of its own); every view of the tensor reads it from now on. An untagged constant is replaced by `value`."""
    if self._const is None: return value
    storage, st = self._const
    constant = LazyBuffer.full(self.base.arg, storage.shape, self.dtype, self.device)
    if st is None or (st.contiguous and self.size == prod(storage.shape)):
      new = LazyBuffer.create_base(self.device, storage.shape, self.dtype, CAST, self.dtype,
                                   (value.reshape(storage.shape),))
    else:
      placed = place_through_view(value, st, storage.shape)
      if placed is None: return self
      new = placed[1].elementwise(WHERE, placed[0], constant)
      if not new.is_base:   # the merge folded (a constant into a constant): a base of its own, as above
        new = LazyBuffer.create_base(self.device, storage.shape, self.dtype, CAST, self.dtype, (new,))
    storage.become(new)
    return new if st is None else new.view(st)

  def assign(self, value: LazyBuffer) -> LazyBuffer:
    """Write `value` into this (realized, contiguous) buffer's memory when scheduled."""
    # a value that is just another view of this very buffer (x.assign(x.flip(0))) would be overwritten while the
    # kernel still reads it: copy it out first
    if (value if value._base is None else value._base) is (self if self._base is None else self._base) and \
        value.st != self.st:
      value = value.clone()
    return LazyBuffer.create_base(self.device, self.shape, self.dtype, ASSIGN, None, (value, self))


_new_lazy_buffer = object.__new__
_TRACE = lazy_trace._trace   # (the one-item list holding the open trace: read at every base made)
_get_ident, _new_trace = lazy_trace.get_ident, lazy_trace.Trace
_KEPT_ARG_TYPES = lazy_trace.KEPT_ARG_TYPES
_LEAF, _NEW_LEAF = lazy_trace.LEAF, lazy_trace.NEW_LEAF


def _prune_readers(base: LazyBuffer) -> None:
  """Drop the dead references among `base`'s readers, whenever the list doubled since the last pruning (amortized
  O(1) per reader). Readers are noted without a lock, from any thread: a base's list is made with it and never
  replaced, and an append is atomic. Pruning takes _READERS_LOCK (one at a time) and rewrites in place only the
  entries it read (one slice assignment: those appended meanwhile stay); live_readers iterates over a copy."""
  with _READERS_LOCK:
    readers = base._readers
    count = len(readers)
    if count <= base._readers_limit: return   # (another thread pruned it just now)
    alive = [ref for ref in readers[:count] if ref() is not None]
    readers[:count] = alive   # (one step: references appended after the first `count` stay)
    base._readers_limit = 2 * len(alive) + 16   # (pruned again once it doubled: amortized O(1) per reader)


def _constant(value: Any, shape: tuple[int, ...], dtype: DType, device: str) -> LazyBuffer:
  """`value` in `dtype` as a scalar CONST base viewed as `shape` by one remembered tracker (no memory is used)."""
  return LazyBuffer.create_base(device, (), dtype, CONST, _truncated(dtype, value)).view(_broadcast_scalar(shape))


@functools.lru_cache(maxsize=1 << 12)
def _broadcast_scalar(shape: tuple[int, ...]) -> ShapeTracker:
  """The tracker of a scalar broadcast to `shape` (LazyBuffer.full's view), remembered: made for every constant."""
  return ShapeTracker.from_shape(()).reshape((1,) * len(shape)).expand(shape)


def _is_lazy(buffer: LazyBuffer) -> bool:
  """Whether `buffer` is still a computation (its base not stored, not a constant): returning it as the result of
  another op shares no memory with a tensor the user holds."""
  return buffer.base.realized is None and buffer.base.op is not CONST


def walk_bases(outs: Sequence[LazyBuffer]) -> list[LazyBuffer]:
  """Every unrealized base reachable from `outs`, sources before users (explicit stack, no recursion)."""
  order: list[LazyBuffer] = []
  visited: set[int] = set()
  stack: list[tuple[LazyBuffer, bool]] = [(out.base, False) for out in reversed(outs)]
  while stack:
    base, children_done = stack.pop()
    if children_done:
      order.append(base)
      continue
    if id(base) in visited or base.realized is not None: continue
    visited.add(id(base))
    stack.append((base, True))
    for src in reversed(base.srcs):  # (src.base without the property call: this walk runs at every realize)
      stack.append((src if src._base is None else src._base, False))
  return order
