"""The creation trace: the lazy bases made since the last schedule, in creation order, each described as it is made,
so that a realize finds its graph's schedule (engine/schedule_cache.py) without walking the graph (issue 26).

Making a base with sources appends it to the trace (its position: `LazyBuffer._trace_index`) and writes its tokens
(create_base writes them out; `reference` describes a base made before the trace). The tokens are a flat list,
one group per base, parsed unambiguously because every group and every reference starts with a token of its own
kind:
  - a base: its op (an `Ops`, equal to no other token), arg, dtype, device and shape, then one reference per source;
    its position is implied: the groups of `Trace.tokens` take the positions no `_EARLY` group names, in order;
  - a reference: a base of the trace by its position (an int) and the view; `NEW_LEAF`, the leaf's number, the view,
    the source base's shape and the realized buffer's device, size, dtype and type at the first read of a buffer,
    `LEAF`, its number, the view and the shape at each later one (leaves are numbered by first read, in the order
    the reads were written: equal tokens read equal buffers where and only where they share one); a constant's
    tuple (`INLINE`, its value, dtype, device and shape: made once with the constant, `LazyBuffer._inline`) and the
    view (a constant base has no sources and is not traced: the scheduler writes its value into each kernel reading
    it; one forced into memory after a traced base inlined it taints the trace, `force`);
  - `_FORCED` and a position: that base's `forced_realize` was set after its group was written (`force`);
  - in `Trace.early`, after the groups above: `_EARLY`, a position, then a base's group with its forced-realize flag
    after the shape: a source that is an unrealized base made before the trace (a remembered constant graph such as
    max pooling's window ranks, a value kept across a realize), appended to the trace when a traced base first reads
    it, and the bases like it that it reads in turn.

Everything a group holds stays true until the next schedule: a base's op, arg, dtype, device, shape and sources never
change outside a schedule, nor does whether a source is realized (only a schedule realizes bases and rewires
sources, and it takes the trace first: `take`, `invalidate`), and a later forced realize is noted. So the tokens at
a realize are what describing the bases then would give: equal tokens mean the scheduler makes the same decisions,
as equal walk keys do (schedule_cache._structure), and `describe` only copies them.

A trace belongs to the thread that started it (`owner`): a base made by another thread taints it (graphs two threads
build at once would interleave their tokens), and a realize on another thread does not use it: that realize walks
its graph. The trace holds its bases (and through them their sources) until the next schedule takes it, which lets
go of it before the copy-on-write decisions of assigns; bases a schedule itself makes go to a trace it drops
(`invalidate`). `MAX_TRACED` bounds it for a long run of graph building without a realize (then it is dropped and
tainted until the next schedule).
"""
from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any

from ourgrad.dtype import DType
from ourgrad.ops import CONST

if TYPE_CHECKING:
  from ourgrad.lazy import LazyBuffer

MAX_TRACED = 50_000   # bases in one trace; beyond it the trace is dropped (tainted) until the next schedule
LEAF = "leaf buffer"
NEW_LEAF = "first read of a leaf buffer"
INLINE = "inline constant"
_FORCED = "forced realize"
_EARLY = "base made before the trace"
PLAIN_ARG_TYPES = (type(None), int, bool, str)
# the arg types a key holds as they are when true, the test a base's arg and an inlined constant get (a float zero is
# not: 0.0 and -0.0 are equal, hashable_arg tells them apart; a false value of the others comes back from hashable_arg
# as it is; a DType compares and hashes by identity)
KEPT_ARG_TYPES = frozenset((*PLAIN_ARG_TYPES, float, DType))
get_ident = threading.get_ident


class Trace:
  """The bases made since the last schedule, in creation order, with their tokens and the distinct realized buffers
  they read."""
  __slots__ = ("bases", "owner", "tokens", "early", "leaves", "leaf_index")

  def __init__(self) -> None:
    self.bases: list[LazyBuffer] = []
    self.owner: int | None = get_ident()   # the thread building it; None: tainted (bases made now are not traced)
    self.tokens: list[Any] = []            # the groups of the bases made since the trace started (module docstring)
    self.early: list[Any] = []             # the groups of bases made before it, appended as they were first read
    self.leaves: list[Any] = []            # distinct realized Buffers read, by leaf number
    self.leaf_index: dict[Any, int] = {}   # Buffer -> leaf number

  def position(self, base: LazyBuffer) -> int:
    """The position of `base` in this trace, -1 if it is not traced here."""
    index = base._trace_index
    return index if 0 <= index < len(self.bases) and self.bases[index] is base else -1

  @property
  def tainted(self) -> bool: return self.owner is None

  def taint(self) -> None:
    """Drop what the trace holds; no base is traced until the next schedule starts a new trace."""
    self.owner, self.bases, self.tokens, self.early, self.leaves, self.leaf_index = None, [], [], [], [], {}


_trace: list[Trace | None] = [None]   # None: no base made since the last schedule


def arg_token(arg: Any) -> Any:
  """A base's arg as its token (hashable_arg, without the call for most args)."""
  return arg if arg is None or (type(arg) in KEPT_ARG_TYPES and arg) else hashable_arg(arg)


def reference(trace: Trace, src: LazyBuffer, source: LazyBuffer) -> None:
  """Write the reference to `src` (whose base `source` is an unrealized base made before the trace, or a constant
  forced into memory: create_base writes the other references out) of the base whose group `trace.tokens` ends
  with, and the groups of the bases it appends."""
  early = _write_reference(trace.tokens, trace, src, source)
  if early is not None: _describe_early(trace, early)


def _write_reference(tokens: list[Any], trace: Trace, src: LazyBuffer, source: LazyBuffer) -> LazyBuffer | None:
  """Append the reference to `src` (base `source`) to `tokens`; returns `source` where it is an unrealized base made
  before the trace that this appended to it (its `_EARLY` group is still to be written), else None."""
  bases = trace.bases
  index = source._trace_index
  if 0 <= index < len(bases) and bases[index] is source:   # a base of this trace (never realized: docstring)
    tokens += (index, src.st)
    return None
  buffer = source.realized
  if buffer is not None:
    leaf = trace.leaf_index.get(buffer)   # (Buffers compare and hash by identity)
    if leaf is None:
      leaf = trace.leaf_index[buffer] = len(trace.leaf_index)
      trace.leaves.append(buffer)
      tokens += (NEW_LEAF, leaf, src.st, source.shape, buffer.device, buffer.size, buffer.dtype, type(buffer))
    else:
      tokens += (LEAF, leaf, src.st, source.shape)
    return None
  if source.op is CONST and not source.srcs and not source.forced_realize:   # a constant only read
    tokens += (source._inline, src.st)
    return None
  index = source._trace_index = len(bases)   # made before the trace (or a constant forced into memory)
  bases.append(source)
  tokens += (index, src.st)
  return source


def _describe_early(trace: Trace, first: LazyBuffer) -> None:
  """Write the `_EARLY` groups of `first` (just appended to the trace) and of the bases made before the trace that
  it reads and that are not in it yet (appended in turn): a loop over what is due, no recursion."""
  early, due = trace.early, [first]
  while due:
    base = due.pop()
    early += (_EARLY, base._trace_index, base.op, arg_token(base.arg), base.dtype, base.device, base.shape,
              base.forced_realize)
    for src in base.srcs:
      more = _write_reference(early, trace, src, src._base or src)
      if more is not None: due.append(more)


def force(base: LazyBuffer) -> None:
  """Set `base.forced_realize` (contiguous(), a realize of a view), noted in the open trace where the base's group
  was written without it. A constant read as a value by bases already described (not traced, unrealized) taints
  the trace: their tokens inlined it."""
  if base.forced_realize: return
  base.forced_realize = True
  trace = _trace[0]
  if trace is None or trace.owner is None: return
  position = trace.position(base)
  if trace.owner != get_ident(): trace.taint()
  elif position >= 0: trace.tokens += (_FORCED, position)
  elif base.realized is None and base.op is CONST: trace.taint()


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
  """The trace's tokens (the module docstring: written as its bases were made), then its `_EARLY` groups, as one
  tuple; None where the trace belongs to another thread (its graph is walked)."""
  if trace.owner != get_ident(): return None
  early = trace.early
  return tuple(trace.tokens + early) if early else tuple(trace.tokens)
