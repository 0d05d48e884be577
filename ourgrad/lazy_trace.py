"""The creation trace: every lazy base made between two schedules, written down as it is made, so that a realize of
a graph built the same way as an earlier one finds that one's schedule without walking the graph
(engine/schedule_cache.py; issue 26).

A `Trace` holds, in creation order, the bases with sources made since the last schedule (`bases`; each base knows
its position, `LazyBuffer._trace_index`), and one flat list of tokens describing them: per base its op, arg, dtype,
device, shape and source count, then per source a reference: a traced base's position and the view; `_LEAF`, the
position of the source's realized buffer among the trace's distinct leaf buffers (`leaves`; its device, size, dtype,
type at its first read) and the view and the base's shape; or `_INLINE` and a constant's value, dtype, device, shape
and view (a constant base has no sources and is not traced: the scheduler writes its value into each kernel that
reads it). `_FORCED` and a position note a later `contiguous()` of a traced base.

The trace's tokens and the positions and views of a realize's outputs determine every decision the scheduler makes,
as the schedule cache's graph walk does, because the graph below the outputs is all in the trace as it is now:
- a source that is an unrealized base made before the trace started (a remembered constant graph, a graph kept
  across a realize) is written down, with the unrealized graph below it, when the first traced base reads it;
- whatever changes a base after it was made (the scheduler marking bases realized or dropping their sources, a
  snapshot redirecting a reader) calls `invalidate`, which ends the trace; `contiguous()`
  of a traced base adds a token, of a constant (which traced bases may have read inlined) taints the trace;
- a realize whose outputs are not all bases of the trace (or of a tainted one) walks its graph as before.
The trace holds its bases (and through them their sources) until the next schedule takes it (`take`); `MAX_TRACED`
bounds it for a long run of graph building without a realize (then it is dropped and tainted until then).
"""
from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, Any

from ourgrad.ops import Ops

if TYPE_CHECKING:
  from ourgrad.lazy import LazyBuffer

MAX_TRACED = 50_000   # bases in one trace; beyond it the trace is dropped (tainted) until the next schedule
_LEAF = "leaf buffer"
_INLINE = "inline constant"
_FORCED = "forced realize"
_PLAIN_ARG_TYPES = (type(None), int, bool, str)
_CONST = Ops.CONST


class Trace:
  """The bases made since the last schedule, and the tokens describing them (see the module docstring)."""
  __slots__ = ("thread", "bases", "tokens", "leaves", "leaf_index", "tainted")

  def __init__(self) -> None:
    self.thread = threading.get_ident()
    self.bases: list[LazyBuffer] = []
    self.tokens: list[Any] = []
    self.leaves: list[Any] = []            # distinct realized Buffers read by traced bases, in first-read order
    self.leaf_index: dict[int, int] = {}   # id(Buffer) -> position in leaves
    self.tainted = False

  def position(self, base: LazyBuffer) -> int:
    """The position of `base` in this trace, -1 if it is not traced here."""
    index = base._trace_index
    return index if 0 <= index < len(self.bases) and self.bases[index] is base else -1


# One trace for the process, not one per thread: a base's position (LazyBuffer._trace_index) is then unambiguous.
# It belongs to the thread that started it: a base another thread makes taints it (no lock on this path, which
# every op takes; graphs built by two threads at once walk their graphs when realized).
_trace: list[Trace | None] = [None]   # None: none started since the last schedule
_get_ident = threading.get_ident


def invalidate() -> None:
  """End the trace: bases may have changed after they were made (a schedule, a redirected reader)."""
  _trace[0] = None


def take() -> Trace | None:
  """The trace if it is untainted (else None); a new one starts with the next base made."""
  trace, _trace[0] = _trace[0], None
  if trace is None or trace.tainted or trace.thread != _get_ident(): return None
  return trace


def hashable_arg(arg: Any) -> Any:
  """`arg` as a key token: 0.0 and -0.0 apart (equal, and equal hashes, but different kernels); unhashable args by
  their repr."""
  if type(arg) in _PLAIN_ARG_TYPES: return arg
  if type(arg) is float: return (arg, math.copysign(1.0, arg)) if arg == 0 else arg
  try:
    hash(arg)
  except TypeError:
    return repr(arg)
  return arg


def record(base: LazyBuffer) -> None:
  """Write down a new base with sources in the trace (its position in `base._trace_index`). A source that is an
  unrealized base made before the trace started (a remembered constant graph, a graph kept across a realize) is
  written down first, with the unrealized graph below it, as it is now. (Every op made runs this: one loop, no calls
  on the common path.)"""
  trace = _trace[0]
  if trace is None: trace = _trace[0] = Trace()
  if trace.tainted: return
  bases, tokens = trace.bases, trace.tokens
  count = len(bases)
  if count >= MAX_TRACED or trace.thread != _get_ident():
    _drop(trace)
    return
  start, leaves = len(tokens), len(trace.leaves)
  arg, srcs = base.arg, base.srcs
  tokens.extend((base.op, arg if type(arg) in _PLAIN_ARG_TYPES or (type(arg) is float and arg) else hashable_arg(arg),
                 base.dtype, base.device, base.shape, len(srcs)))
  for src in srcs:
    src_base = src if src._base is None else src._base
    index = src_base._trace_index
    if 0 <= index < count and bases[index] is src_base:
      tokens.extend((index, src.st))
      continue
    buffer = src_base.realized
    if buffer is not None:
      leaf = trace.leaf_index.get(id(buffer))
      if leaf is None:
        leaf = trace.leaf_index[id(buffer)] = len(trace.leaves)
        trace.leaves.append(buffer)
        tokens.extend((_LEAF, leaf, src.st, src_base.shape, buffer.device, buffer.size, buffer.dtype, type(buffer)))
      else:
        tokens.extend((_LEAF, leaf, src.st, src_base.shape))
    elif src_base.op is _CONST and not src_base.srcs and not src_base.forced_realize:   # a constant only read
      arg = src_base.arg
      tokens.extend((_INLINE, arg if type(arg) in _PLAIN_ARG_TYPES or (type(arg) is float and arg) else
                     hashable_arg(arg), src_base.dtype, src_base.device, src_base.shape, src.st))
    else:   # a lazy base made before the trace: written in first, then this base again from its start
      del tokens[start:]
      for buffer in trace.leaves[leaves:]: del trace.leaf_index[id(buffer)]
      del trace.leaves[leaves:]
      _import(trace, src_base)
      record(base)
      return
  base._trace_index = count
  bases.append(base)


def _inlined(base: LazyBuffer) -> bool:
  """Whether `base` is a constant only read: its value is written into its readers' tokens (the scheduler writes it
  into each kernel reading it), it is not traced."""
  return base.op is _CONST and not base.srcs and not base.forced_realize


def _import(trace: Trace, root: LazyBuffer) -> None:
  """Write down `root`, an unrealized base not in the trace, and every unrealized base below it not in the trace yet,
  sources before users (explicit stack), each with a token for its forced-realize flag where set."""
  stack: list[tuple[LazyBuffer, bool]] = [(root, False)]
  while stack:
    base, sources_done = stack.pop()
    if trace.position(base) >= 0 or trace.tainted: continue
    if sources_done:
      record(base)
      if base.forced_realize and not trace.tainted: trace.tokens.extend((_FORCED, base._trace_index))
      continue
    stack.append((base, True))
    for src in base.srcs:
      src_base = src if src._base is None else src._base
      if src_base.realized is None and trace.position(src_base) < 0 and not _inlined(src_base):
        stack.append((src_base, False))


def note_forced(base: LazyBuffer) -> None:
  """`base` must now be realized even where it could be fused (contiguous()): a token for a traced base. A constant
  that traced bases may read inlined changes meaning: the trace is tainted."""
  trace = _trace[0]
  if trace is None or trace.tainted or base.realized is not None: return
  index = trace.position(base)
  if trace.thread != _get_ident(): _drop(trace)
  elif index >= 0: trace.tokens.extend((_FORCED, index))
  elif _inlined(base): _drop(trace)
  # (any other base is not traced: a traced base reading it imported it, and will import it again)


def _drop(trace: Trace) -> None:
  """Taint `trace` and let go of what it holds."""
  trace.tainted = True
  trace.bases, trace.tokens, trace.leaves, trace.leaf_index = [], [], [], {}
