"""The creation trace's tokens, written as each base is made (ourgrad/lazy_trace.py): a realize only copies them, and
they describe the graph as it is then. Checked against the graph walk's key (schedule_cache._structure, written at the
realize by another implementation) on random programs, and end to end against numpy where a base is forced into
memory, a constant forced, a leaf read twice, a value kept from before the trace, or a second thread builds."""
import sys
import threading
from typing import Any, Callable

import numpy as np
import pytest

import ourgrad.engine.schedule_cache as schedule_cache
from extra.bench.bench_autograd import bytecodes
from ourgrad import Tensor, lazy_trace


def _tokens(build: Callable[[], Tensor]) -> tuple[tuple, Tensor]:
  """The description of a fresh trace holding what `build` makes, and what it returned."""
  lazy_trace.invalidate()
  out = build()
  trace = lazy_trace._trace[0]
  assert trace is not None
  tokens = lazy_trace.describe(trace)
  assert tokens is not None
  return tokens, out


def _leaves(count: int, rng: np.random.Generator) -> list[Tensor]:
  return [Tensor(rng.standard_normal(6).astype(np.float32)).realize() for _ in range(count)]


def test_a_leaf_read_twice_and_two_leaves_read_once_each_are_different_tokens():
  """Leaves are numbered by first read: x * x and x * y differ, whichever buffers; the same wiring over other buffers
  of the same kind is the same tokens (also for a leaf read inside a value made before the trace)."""
  rng = np.random.default_rng(3)
  x, y, z, w = _leaves(4, rng)
  same, _ = _tokens(lambda: x * x)
  assert _tokens(lambda: y * y)[0] == same
  assert _tokens(lambda: x * y)[0] != same and _tokens(lambda: x * y)[0] == _tokens(lambda: z * w)[0]
  assert _tokens(lambda: x * y + y)[0] != _tokens(lambda: x * y + x)[0]   # (a later read names its leaf)
  kept_x, kept_z = x + 1, z + 1   # made before the traces below: described as they are first read
  read_again, _ = _tokens(lambda: kept_x * x)
  assert _tokens(lambda: kept_z * z)[0] == read_again and _tokens(lambda: kept_z * w)[0] != read_again
  np.testing.assert_allclose((kept_z * w).numpy(), (z.numpy() + 1) * w.numpy(), rtol=1e-6)


def test_describe_costs_the_same_for_any_trace_size():
  """A realize's description is a copy of tokens written at creation: no Python work per base (was ~124 bytecodes
  a base, 9-13% of every eager row's time on the H200)."""
  if sys.version_info[:2] != (3, 11): pytest.skip("bytecode counts are pinned on Python 3.11")
  x = Tensor(np.ones(4, np.float32)).realize()
  counts = []
  for length in (2, 40):
    lazy_trace.invalidate()
    out = x
    for _ in range(length): out = out * 1.5 + 1
    trace = lazy_trace._trace[0]
    counts.append(bytecodes(lambda: lazy_trace.describe(trace)))
  assert counts[0] == counts[1] <= 30, counts   # (with the lambda's own)


def test_a_base_forced_after_its_readers_were_made_is_another_schedule():
  """contiguous() of an intermediate after its readers were made (its group was written unforced): noted in the
  trace, so the realize neither reuses the schedule that fused it nor gives it to the next graph without it."""
  rng = np.random.default_rng(5)
  x, y = _leaves(2, rng)
  for force in (False, True, False, True):
    shared = x * 2
    result = (shared + y).exp2() * shared
    if force: shared.contiguous()
    np.testing.assert_allclose(result.numpy(), np.exp2(x.numpy() * 2 + y.numpy()) * x.numpy() * 2, rtol=1e-5)
    assert (shared.lazydata.base.realized is not None) == force
  plain, _ = _tokens(lambda: x * 2 + y)
  forced, _ = _tokens(lambda: (x * 2 + y, (x * 2).contiguous())[0])
  assert plain != forced


def test_a_constant_forced_into_memory_after_it_was_inlined_taints_the_trace():
  """A traced base read a constant as a value (inlined in its tokens); forcing that constant into memory afterwards
  (as a collective's realized_pointer may) drops the trace: the realize walks its graph."""
  x = _leaves(1, np.random.default_rng(6))[0]
  lazy_trace.invalidate()
  constant = Tensor.full((6,), 2.5)
  result = x * constant
  lazy_trace.force(constant.lazydata.base)
  trace = lazy_trace._trace[0]
  assert trace is not None and trace.tainted
  np.testing.assert_allclose(result.numpy(), x.numpy() * np.float32(2.5), rtol=1e-6)
  assert constant.lazydata.base.realized is not None


def test_a_base_made_on_another_thread_taints_the_trace_and_a_realize_there_walks():
  """A trace belongs to the thread that started it: a base another thread makes drops it, and a realize on another
  thread does not use it (that realize walks its graph); values against numpy."""
  x = _leaves(1, np.random.default_rng(8))[0]
  lazy_trace.invalidate()
  mine = x * 3
  other: list[Tensor] = []
  thread = threading.Thread(target=lambda: other.append(x + 4))
  thread.start()
  thread.join()
  trace = lazy_trace._trace[0]
  assert trace is not None and trace.tainted and mine.lazydata.base._trace_index >= 0
  np.testing.assert_allclose(other[0].numpy(), x.numpy() + 4, rtol=1e-6)
  np.testing.assert_allclose(mine.numpy(), x.numpy() * 3, rtol=1e-6)
  lazy_trace.invalidate()
  built = x * 5 + 1
  assert lazy_trace._trace[0] is not None and not lazy_trace._trace[0].tainted
  before = schedule_cache.stats.traced_hits
  results: list[np.ndarray] = []
  thread = threading.Thread(target=lambda: results.append(built.numpy()))
  thread.start()
  thread.join()
  assert schedule_cache.stats.traced_hits == before
  np.testing.assert_allclose(results[0], x.numpy() * 5 + 1, rtol=1e-6)


# ---------------------------------------------------------------- random programs against the graph walk's key

def _random_program(rng: np.random.Generator, length: int) -> list[tuple]:
  """Steps over a pool of values (leaves first): (kind, operand indices, a parameter)."""
  steps: list[tuple] = []
  for step in range(length):
    pool = 3 + step   # (leaves a, b, the value kept from before the trace, then one value per step)
    kind = str(rng.choice(["add", "mul", "sub", "flip", "const", "exp2", "force", "sum"]))
    steps.append((kind, int(rng.integers(pool)), int(rng.integers(pool)), float(rng.choice([0.5, 2.0, -0.0, 0.0]))))
  return steps


def _run(program: list[tuple], a: Tensor, b: Tensor, kept: Tensor) -> list[Tensor]:
  values = [a, b, kept]
  for kind, left, right, parameter in program:
    x, y = values[left], values[right]
    if kind == "add": out = x + y
    elif kind == "mul": out = x * y
    elif kind == "sub": out = x - y.flip(0)
    elif kind == "flip": out = x.flip(0) * 1.5
    elif kind == "const": out = x * parameter
    elif kind == "exp2": out = x.exp2()
    elif kind == "sum": out = x.sum().reshape(1).expand(6) + y
    else:
      out = x * 2
      if not out.lazydata.base.realized: out.contiguous()
    values.append(out)
  return values[3:]


def test_equal_tokens_are_equal_graph_walk_keys_on_random_programs():
  """Random programs over leaves (sometimes one buffer passed twice), constants of either zero sign, views, forced
  bases and a value made before the trace: where two traces' tokens are equal, the graph walk's keys of their last
  values are equal too (the walk describes the graph at the realize, by another implementation); one program over
  other buffers gives the same tokens."""
  rng = np.random.default_rng(21)
  seen: dict[Any, Any] = {}
  for round_ in range(60):
    program = _random_program(rng, int(rng.integers(1, 5)))
    a, b = _leaves(2, rng)
    b = a if round_ % 3 == 0 else b
    kept = (b * 3).exp2()   # lazy, made before the trace
    tokens, values = _tokens(lambda: _run(program, a, b, kept))
    outs = [value.lazydata for value in values[-2:]]
    walk = schedule_cache._structure(outs)[0]
    references = [(out.base._trace_index, out.st) for out in outs]
    key = (tokens, tuple(references))
    assert seen.setdefault(key, walk) == walk
    c, d = _leaves(2, rng)
    d = c if round_ % 3 == 0 else d
    other_kept = (d * 3).exp2()
    assert _tokens(lambda: _run(program, c, d, other_kept))[0] == tokens
  lazy_trace.invalidate()


def test_a_base_made_before_the_trace_is_described_once_where_first_read():
  """A lazy value kept across realizes is appended to the trace at its first read (its group among the early ones)
  and referenced by position after; the same step again is a traced hit, values against numpy."""
  x = _leaves(1, np.random.default_rng(9))[0]
  lazy_trace.invalidate()
  kept = (x * 2 + 1).exp2()   # (positions 0, 1, 2 of its trace: not the ones it gets in the traces below)
  for _ in range(3):
    lazy_trace.invalidate()
    result = kept * x + kept
    trace = lazy_trace._trace[0]
    assert trace is not None and trace.position(kept.lazydata.base) == 1   # (after the product reading it first)
    assert lazy_trace.describe(trace).count(lazy_trace._EARLY) == 3   # kept, its + 1 and x * 2, once each
    before = schedule_cache.stats.traced_hits
    np.testing.assert_allclose(result.numpy(), np.exp2(x.numpy() * 2 + 1) * (x.numpy() + 1), rtol=1e-5)
  assert schedule_cache.stats.traced_hits == before + 1


def test_a_tool_calling_create_schedule_ends_the_trace():
  """The tokens take a source of the trace for an unrealized base: only a schedule realizes bases, and every schedule
  (the cache's, or create_schedule called directly, as tools do) ends the trace first, so a base it gave a buffer is
  read as a leaf afterwards."""
  from ourgrad.engine.schedule import create_schedule
  x = _leaves(1, np.random.default_rng(10))[0]
  lazy_trace.invalidate()
  made = x * 2
  create_schedule([made.lazydata])   # (a buffer given, not run)
  assert made.lazydata.base.realized is not None
  reader = made + 1
  trace = lazy_trace._trace[0]
  assert trace is not None and trace.position(made.lazydata.base) < 0 and trace.position(reader.lazydata.base) == 0
  assert lazy_trace.describe(trace).count(lazy_trace.NEW_LEAF) == 1
  lazy_trace.invalidate()
