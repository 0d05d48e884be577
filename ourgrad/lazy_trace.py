"""The creation trace: the list of lazy bases made since the last schedule, in creation order, so that a realize
finds its graph's schedule (engine/schedule_cache.py) without walking the graph (issue 26).

Making a base with sources costs one append here (`record`: the base and its position, `LazyBuffer._trace_index`).
A realize whose outputs are bases of the trace describes the trace (`describe`) as four tuples: per base its op,
dtype, device and shape; per base its arg; per base its source count; per source a reference, in the bases' order:
a traced base's position and the view (2 items); for a realized buffer, `-1 - leaf` (`leaf`: the buffer's position
among the distinct buffers read, `Trace.leaves`), the view and the base's shape (3), and at the buffer's first read
also its device, size, dtype and type (7); for a constant that is only read, `_INLINE`, its value, dtype, device,
shape and the view (6; a constant base has no sources and is not traced: the scheduler writes its value into each
kernel reading it). A source that is an unrealized base made before the trace (a remembered constant graph such as
max pooling's window ranks, a value kept across a realize) is appended to the trace there and described in turn.
The bases' facts and the references to traced bases are gathered by C loops (map and zip over attrgetters): Python
runs only for odd args and for sources that are not traced bases (a constant's reference is remembered by the
LazyBuffer it is read through: `_INLINED`), so a repeated step's key costs a few C-speed
passes over its bases rather than a Python step per base (issue 26 asks O(1) per kernel; this is O(bases) at C speed:
the lists' order is the key, and nothing but looking at each base tells a new graph from a repeated one). C loops
also check that every base is at its position and unrealized (two threads appending or scheduling at once make the
trace inconsistent: that realize then walks its graph) and read each base's forced-realize flag (`Trace.forced`).
The description is of the bases as they are at the realize, as the walk's key is: the list holds every unrealized
base below the outputs, sources referenced by position, so equal descriptions mean the scheduler makes the same
decisions, as equal walk keys do.

The trace holds its bases (and through them their sources) until the next schedule takes it (`take`), which lets go
of it before the copy-on-write decisions of assigns; bases a schedule itself makes go to a trace it drops
(`invalidate`). `MAX_TRACED` bounds it for a long run of graph building without a realize (then it is dropped and
tainted until the next schedule).
"""
from __future__ import annotations

import math
from functools import partial
from itertools import chain, compress, count
from operator import attrgetter, is_, not_
from typing import TYPE_CHECKING, Any

from ourgrad.helpers import register_cache_clearer
from ourgrad.ops import Ops

if TYPE_CHECKING:
  from ourgrad.lazy import LazyBuffer

MAX_TRACED = 50_000   # bases in one trace; beyond it the trace is dropped (tainted) until the next schedule
_INLINE = "inline constant"
PLAIN_ARG_TYPES = (type(None), int, bool, str)
_CONST = Ops.CONST
_PLAIN_TYPES = frozenset(PLAIN_ARG_TYPES)
# (describe's C loops read these)
_position, _forced, _realized = attrgetter("_trace_index"), attrgetter("forced_realize"), attrgetter("realized")
_header, _arg = attrgetter("op", "dtype", "device", "shape"), attrgetter("arg")
_srcs, _base, _st = attrgetter("srcs"), attrgetter("_base"), attrgetter("st")
_is_none = partial(is_, None)
# a constant's reference by the LazyBuffer it is read through (the shared operand constants of lazy.py: the same
# objects every step). A constant and its view never change; whether it is forced into memory is read at each use.
# Bounded: cleared when full
_INLINED: dict[LazyBuffer, tuple] = {}
_INLINED_MAX = 4096
register_cache_clearer(_INLINED.clear)


class Trace:
  """The bases made since the last schedule, in creation order; after `describe`, its tokens and the distinct
  realized buffers they read."""
  __slots__ = ("bases", "tainted", "tokens", "forced", "leaves", "leaf_index")

  def __init__(self) -> None:
    self.bases: list[LazyBuffer] = []
    self.tainted = False
    self.tokens: tuple = ()                # the description (describe)
    self.forced: tuple[bool, ...] = ()     # each base's forced-realize flag (describe)
    self.leaves: list[Any] = []            # distinct realized Buffers read, in first-read order (describe)
    self.leaf_index: dict[int, int] = {}   # id(Buffer) -> position in leaves

  def position(self, base: LazyBuffer) -> int:
    """The position of `base` in this trace, -1 if it is not traced here."""
    index = base._trace_index
    return index if 0 <= index < len(self.bases) and self.bases[index] is base else -1


_trace: list[Trace | None] = [None]   # None: no base made since the last schedule


def record(base: LazyBuffer) -> None:
  """Append a new base with sources to the trace (every op made runs this)."""
  trace = _trace[0]
  if trace is None: trace = _trace[0] = Trace()
  bases = trace.bases
  if len(bases) >= MAX_TRACED or trace.tainted:
    trace.tainted, trace.bases = True, []   # (what it held is let go of)
    return
  base._trace_index = len(bases)
  bases.append(base)


def invalidate() -> None:
  """End the trace (the bases a schedule makes are no part of what is built next)."""
  _trace[0] = None


def take() -> Trace | None:
  """The trace (None if tainted or empty); the next base made starts a new one."""
  trace, _trace[0] = _trace[0], None
  return None if trace is None or trace.tainted else trace


def hashable_arg(arg: Any) -> Any:
  """`arg` as a key token: 0.0 and -0.0 apart (equal, and equal hashes, but different kernels); unhashable args by
  their repr."""
  if type(arg) in PLAIN_ARG_TYPES: return arg
  if type(arg) is float: return (arg, math.copysign(1.0, arg)) if arg == 0 else arg
  try:
    hash(arg)
  except TypeError:
    return repr(arg)
  return arg


def describe(trace: Trace) -> bool:
  """Write `trace.tokens`, `forced`, `leaves` and `leaf_index` (the module docstring); False if the trace is
  inconsistent (a base not at its position, or realized: graphs two threads built and scheduled at once).

  The facts of every base and of every source read through a traced base are gathered by C loops (map, zip over
  attrgetters), with no Python step per base: Python runs only for an arg that is not a plain value and for a source
  that is not a traced base (a realized buffer, a constant, a base made before the trace, which is appended and
  described in the next round, its position the one its first reader gives it)."""
  bases = trace.bases
  positions = dict(zip(map(id, bases), range(len(bases))))   # id(base) -> position
  headers: list[tuple] = []
  args: list[Any] = []
  counts: list[int] = []
  references: list[tuple] = []
  leaves: list[Any] = []
  leaf_index: dict[int, int] = {}
  done = 0
  while done < len(bases):   # (a round per generation of bases made before the trace)
    chunk = bases[done:]
    done = len(bases)
    headers += map(_header, chunk)
    chunk_args = list(map(_arg, chunk))
    for index in compress(count(), map(not_, map(_PLAIN_TYPES.__contains__, map(type, chunk_args)))):
      arg = chunk_args[index]
      # (a nonzero float is its own token; 0.0 and -0.0, tuples and other types go through hashable_arg)
      if not (type(arg) is float and arg): chunk_args[index] = hashable_arg(arg)
    args += chunk_args
    chunk_srcs = list(map(_srcs, chunk))
    counts += map(len, chunk_srcs)
    flat = list(chain.from_iterable(chunk_srcs))
    # a source's traced position: its own (a base) or else its base's (a view); None: not a traced base
    found = list(map(positions.get, map(id, flat), map(positions.get, map(id, map(_base, flat)))))
    chunk_references = list(zip(found, map(_st, flat)))
    for index in compress(count(), map(_is_none, found)):
      src = flat[index]
      source = src._base or src   # (a view's base, or the base itself; LazyBuffers are always true)
      buffer = source.realized
      if buffer is not None:
        leaf = leaf_index.get(id(buffer))
        if leaf is None:
          leaf = leaf_index[id(buffer)] = len(leaves)
          leaves.append(buffer)
          chunk_references[index] = (-1 - leaf, src.st, source.shape, buffer.device, buffer.size, buffer.dtype,
                                     type(buffer))
        else: chunk_references[index] = (-1 - leaf, src.st, source.shape)
      elif (inline := _INLINED.get(src)) is not None and not source.forced_realize:
        chunk_references[index] = inline
      elif source.op is _CONST and not source.srcs and not source.forced_realize:   # a constant only read
        value = source.arg
        inline = chunk_references[index] = (_INLINE, value if type(value) in PLAIN_ARG_TYPES or
                                            (type(value) is float and value) else hashable_arg(value), source.dtype,
                                            source.device, source.shape, src.st)
        if len(_INLINED) >= _INLINED_MAX: _INLINED.clear()
        _INLINED[src] = inline
      else:   # a lazy base made before the trace (or a constant forced into memory): described in the next round
        position = positions.get(id(source))   # (appended by an earlier source of this round)
        if position is None:
          position = source._trace_index = positions[id(source)] = len(bases)
          bases.append(source)
        chunk_references[index] = (position, src.st)
    references += chunk_references
  # every base at its position and unrealized (a base another thread appended meanwhile is not at its position, one
  # its schedule realized is not unrealized)
  total = len(bases)
  if list(map(_position, bases)) != list(range(total)) or list(map(_realized, bases)).count(None) != total:
    return False
  trace.tokens = (tuple(headers), tuple(args), tuple(counts), tuple(references))
  trace.forced, trace.leaves, trace.leaf_index = tuple(map(_forced, bases)), leaves, leaf_index
  return True
