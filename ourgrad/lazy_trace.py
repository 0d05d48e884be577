"""The creation trace: the list of lazy bases made since the last schedule, in creation order, so that a realize
finds its graph's schedule (engine/schedule_cache.py) without walking the graph (issue 26).

Making a base with sources costs one append here (`record`: the base and its position, `LazyBuffer._trace_index`).
A realize whose outputs are bases of the trace describes the trace in one pass over that list (`describe`): per base
its op, arg, dtype, device, shape, forced-realize flag and source count, then per source a reference: `_LEAF`, the
position of the source's realized buffer among the distinct buffers read (`Trace.leaves`; its device, size, dtype
and type at its first read), the view and the base's shape; `_INLINE` and a constant's value, dtype, device, shape
and view (a constant base has no sources and is not traced: the scheduler writes its value into each kernel reading
it); or a traced base's position and the view. A source that is an unrealized base made before the trace (a
remembered constant graph such as max pooling's window ranks, a value kept across a realize) is appended to the
trace there and described in turn. The description is of the bases as they are at the realize, as the walk's key
is: the list holds every unrealized base below the outputs, sources referenced by position, so equal descriptions
mean the scheduler makes the same decisions, as equal walk keys do. Each base's position is checked in the pass
(two threads appending at once make the trace inconsistent: that realize then walks its graph).

The trace holds its bases (and through them their sources) until the next schedule takes it (`take`), which lets go
of it before the copy-on-write decisions of assigns; bases a schedule itself makes go to a trace it drops
(`invalidate`). `MAX_TRACED` bounds it for a long run of graph building without a realize (then it is dropped and
tainted until the next schedule).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ourgrad.ops import CONST

if TYPE_CHECKING:
  from ourgrad.lazy import LazyBuffer

MAX_TRACED = 50_000   # bases in one trace; beyond it the trace is dropped (tainted) until the next schedule
_LEAF = "leaf buffer"
_INLINE = "inline constant"
PLAIN_ARG_TYPES = (type(None), int, bool, str)
# the arg types a key holds as they are when true, the test describe makes of a base's arg and of an inlined constant
# (a float zero is not: 0.0 and -0.0 are equal, hashable_arg tells them apart; a false value of the others comes back
# from hashable_arg as it is)
_PLAIN_TYPES = frozenset((*PLAIN_ARG_TYPES, float))


class Trace:
  """The bases made since the last schedule, in creation order; after `describe`, its tokens and the distinct
  realized buffers they read."""
  __slots__ = ("bases", "tainted", "tokens", "leaves", "leaf_index")

  def __init__(self) -> None:
    self.bases: list[LazyBuffer] = []
    self.tainted = False
    self.tokens: tuple = ()
    self.leaves: list[Any] = []            # distinct realized Buffers read, in first-read order (describe)
    self.leaf_index: dict[Any, int] = {}   # Buffer -> position in leaves

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


def pending() -> int:
  """How many bases were made since the last schedule (MAX_TRACED once the trace overflowed): the size of the graph
  that a realize now would schedule, at most."""
  trace = _trace[0]
  if trace is None: return 0
  return MAX_TRACED if trace.tainted else len(trace.bases)


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


def describe(trace: Trace) -> tuple | None:
  """The trace's tokens (the module docstring), also kept as `trace.tokens` with `leaves` and `leaf_index`; None if
  the trace is inconsistent (a base not at its position: graphs two threads built at once). One loop over the list,
  which grows as bases made before the trace are appended."""
  bases = trace.bases
  tokens: list[Any] = []
  extend = tokens.extend
  leaves: list[Any] = []
  leaf_index: dict[Any, int] = {}
  count = len(bases)   # (grows as bases made before the trace are appended: the loop reaches them too)
  plain = _PLAIN_TYPES
  for position, base in enumerate(bases):
    if base._trace_index != position: return None
    arg, srcs = base.arg, base.srcs
    # (most args are None or a nonzero int or float: no call to hashable_arg)
    extend((base.op, arg if arg is None or (type(arg) in plain and arg) else hashable_arg(arg), base.dtype,
            base.device, base.shape, base.forced_realize, len(srcs)))
    for src in srcs:
      src_base = src._base or src   # (a view's base; a base is its own: LazyBuffers are always true)
      index = src_base._trace_index
      # most sources are bases of this trace, which are never realized (only a schedule realizes bases, and it takes
      # the trace first): tested first, the realized check only confirms it. An index is -1 (not traced) or a
      # position, of this trace or an earlier one: -1 reads the last base, which holds its own position (>= 0, the
      # check above, met there or still to come), so it never passes for a base that is not at that position
      if index < count and bases[index] is src_base and src_base.realized is None:
        extend((index, src.st))
        continue
      buffer = src_base.realized
      if buffer is not None:
        leaf = leaf_index.get(buffer)   # (Buffers compare and hash by identity)
        if leaf is None:
          leaf = leaf_index[buffer] = len(leaves)
          leaves.append(buffer)
          extend((_LEAF, leaf, src.st, src_base.shape, buffer.device, buffer.size, buffer.dtype, type(buffer)))
        else:
          extend((_LEAF, leaf, src.st, src_base.shape))
        continue
      if index < 0 or index >= count or bases[index] is not src_base:
        if src_base.op is CONST and not src_base.srcs and not src_base.forced_realize:   # a constant only read
          value = src_base.arg
          # (most values are nonzero numbers; a false one goes through hashable_arg, which keeps None, 0 and False
          # as they are and tells 0.0 from -0.0)
          extend((_INLINE, value if type(value) in plain and value else hashable_arg(value), src_base.dtype,
                  src_base.device, src_base.shape, src.st))
          continue
        # a lazy base made before the trace (or a constant forced into memory): described after the ones listed
        index = src_base._trace_index = count
        bases.append(src_base)
        count += 1
      extend((index, src.st))
  trace.tokens, trace.leaves, trace.leaf_index = (described := tuple(tokens)), leaves, leaf_index
  return described
