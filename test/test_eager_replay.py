"""A repeated small realize's short paths (issue 26): the schedule the last traced realize found, compared first; items
of a replayed schedule made without the dataclass's __init__; one replayed kernel launched without run_schedule's
loop. Each gives what the general path gives: values against numpy, the same kernel counts, nothing stale."""
import numpy as np

import ourgrad.engine.schedule_cache as schedule_cache
from ourgrad import Tensor, TinyJit, dtypes
from ourgrad.engine.schedule_item import ScheduleItem, replayed_item
from ourgrad.helpers import GlobalCounters, clear_caches


def test_the_last_traced_schedule_is_found_again_and_never_reused_for_another_graph():
  """Graphs alternated so that the last traced entry is right, then wrong (another constant, its sign, the dtype, the
  input's length, another leaf of the same length): every result against numpy; each repeat of the last graph is a
  traced hit."""
  rng = np.random.default_rng(20)
  values = {length: rng.standard_normal(length).astype(np.float32) for length in (5, 6)}
  leaves = {length: Tensor(value).realize() for length, value in values.items()}
  other = Tensor(values[5][::-1].copy()).realize()
  cases = [(5, 2.0, dtypes.float32, False), (5, 2.0, dtypes.float32, False), (5, 3.0, dtypes.float32, False),
           (5, 0.0, dtypes.float32, False), (5, -0.0, dtypes.float32, False), (5, 2.0, dtypes.int32, False),
           (6, 2.0, dtypes.float32, False), (5, 2.0, dtypes.float32, True), (5, 2.0, dtypes.float32, False)]
  for round_ in range(2):
    for length, constant, dtype, swapped in cases:
      x = other if swapped else leaves[length]
      x_values = values[5][::-1] if swapped else values[length]
      if dtype == dtypes.int32: x, x_values = x.cast(dtypes.int32).realize(), x_values.astype(np.int32)
      traced = schedule_cache.stats.traced_hits
      result = (1.0 / ((x.abs() + 1.5) * constant)).numpy()
      # (1 / -0.0 is -inf: the sign of a zero constant must reach the kernel)
      with np.errstate(divide="ignore"):
        expected = 1.0 / ((np.abs(x_values).astype(np.float32) + np.float32(1.5)) * np.float32(constant))
      np.testing.assert_allclose(result, expected, rtol=1e-6)
      if round_: assert schedule_cache.stats.traced_hits == traced + 1   # (the second round: every graph known)


def test_cleared_caches_drop_the_last_traced_schedule():
  x = Tensor(np.arange(3, dtype=np.float32)).realize()
  for _ in range(3): (x + 1).realize()
  assert schedule_cache._last_traced[0] is not None
  clear_caches()
  assert schedule_cache._last_traced[0] is None
  np.testing.assert_array_equal((x + 1).numpy(), np.arange(3, dtype=np.float32) + 1)


def test_the_last_traced_schedule_stays_the_most_recent_entry_under_eviction(monkeypatch):
  """More distinct graphs than the cache holds, realized in turn: the entry compared first is never one the cache
  dropped (a move to the end of a dropped key would fail), and every result is right."""
  monkeypatch.setattr(schedule_cache, "CACHE_SIZE", 3)
  x = Tensor(np.arange(4, dtype=np.float32)).realize()
  for step in range(12):
    constant = float(step % 5)
    np.testing.assert_array_equal((x * constant).numpy(), np.arange(4, dtype=np.float32) * constant)
    np.testing.assert_array_equal((x * constant).numpy(), np.arange(4, dtype=np.float32) * constant)
    last = schedule_cache._last_traced[0]
    assert last is not None and last.key in schedule_cache._traced and len(schedule_cache._traced) <= 3


def test_replayed_items_are_schedule_items():
  item = ScheduleItem("ast", (1,), (2, 3))
  made = replayed_item("ast", (1,), (2, 3), None)
  assert type(made) is ScheduleItem and made == item and hash(made) == hash(item)
  assert (made.ast, made.outputs, made.inputs, made.lowering, made.bufs) == ("ast", (1,), (2, 3), None, (1, 2, 3))
  try:
    made.ast = "other"
  except AttributeError:
    pass
  else:
    raise AssertionError("a replayed item must stay frozen")


def test_one_replayed_kernel_counts_once_and_a_recording_jit_still_sees_it():
  """The single-kernel launch of run_schedule counts one kernel a realize; under TinyJit (which records the items it
  sees) the same realize is captured, and the replays give the values of new inputs."""
  x = Tensor(np.arange(5, dtype=np.float32)).realize()
  for _ in range(3): (x - 2).realize()
  before = GlobalCounters.kernel_count
  for _ in range(4): (x - 2).realize()
  assert GlobalCounters.kernel_count == before + 4

  @TinyJit
  def step(inputs: Tensor) -> Tensor: return (inputs - 2).realize()
  for value in range(4):
    inputs = Tensor(np.full(5, value, dtype=np.float32)).realize()
    np.testing.assert_array_equal(step(inputs).numpy(), np.full(5, value - 2, dtype=np.float32))
  assert len(step.captured.items) == 1


def test_a_replayed_kernel_launched_by_the_schedule_cache_makes_no_schedule_item(monkeypatch):
  """Tensor.realize of a one-kernel replay launches through realize.launch_one from the schedule cache: no
  ScheduleItem is made, one kernel is counted, and the result is the general path's (random inputs, new buffers and
  a constant changed between realizes; after each, the output's lazy base holds its buffer and its sources are
  dropped, as a replay leaves them)."""
  made = []
  monkeypatch.setattr(schedule_cache, "replayed_item", lambda *args: made.append(args) or replayed_item(*args))
  rng = np.random.default_rng(21)
  for step in range(8):
    values = rng.standard_normal(7).astype(np.float32)
    x = Tensor(values).realize()
    constant = 1.5 if step < 6 else -2.5
    before = GlobalCounters.kernel_count
    out = (x * constant + 1).realize()
    assert GlobalCounters.kernel_count == before + 1
    assert out.lazydata.base.realized is not None and out.lazydata.base.srcs == ()
    np.testing.assert_allclose(out.numpy(), values * np.float32(constant) + 1, rtol=1e-6, atol=1e-6)
  assert not made[2:]   # (the first realizes schedule and lower; later ones are launched without an item)


def test_launch_one_refuses_while_launches_print_or_a_jit_records(monkeypatch, capsys):
  """Where run_schedule's quiet path would not launch (DEBUG=2 prints each kernel; a recording TinyJit keeps each
  ExecItem), the schedule cache builds the item and run_schedule runs it as before."""
  from ourgrad.engine import realize
  x = Tensor(np.arange(6, dtype=np.float32)).realize()
  for _ in range(3): (x + 4).realize()
  launched = []
  original = realize.launch_one
  monkeypatch.setattr(realize, "launch_one", lambda memo, buffers: launched.append(original(memo, buffers)) or
                      launched[-1])
  (x + 4).realize()
  assert launched == [True]
  monkeypatch.setenv("DEBUG", "2")
  np.testing.assert_array_equal((x + 4).realize().numpy(), np.arange(6, dtype=np.float32) + 4)
  monkeypatch.delenv("DEBUG")
  assert "E_" in capsys.readouterr().out   # (the kernel's DEBUG=2 line: launched by run_schedule's general path)

  @TinyJit
  def step(inputs: Tensor) -> Tensor: return (inputs + 4).realize()
  for value in range(3):
    inputs = Tensor(np.full(6, value, dtype=np.float32)).realize()
    np.testing.assert_array_equal(step(inputs).numpy(), np.full(6, value + 4, dtype=np.float32))
  assert len(step.captured.items) == 1


def test_a_replays_internal_slots_are_the_buffers_only_its_items_hold(monkeypatch):
  """memory.PoolMemory.internal_slots (reference counts of the written slots of a replay's pool) against
  held_only_by_items over every item's buffers and the pool: the same buffers, whether the user keeps an intermediate
  or not, at every replay of a three-kernel chain."""
  from ourgrad.engine import realize
  from ourgrad.engine.memory import held_only_by_items
  from ourgrad.engine.schedule_item import ReplayedSchedule
  seen: list[tuple[set, set]] = []
  original = realize.plan_schedule_memory

  def check(schedule):
    if type(schedule) is ReplayedSchedule and len(schedule) == schedule.memory.items:
      pool = schedule.pool
      by_slots = {id(pool[slot]) for slot in schedule.memory.internal_slots(pool)}
      containers = [c for item in schedule for c in (item.outputs, item.inputs)] + [pool]
      held = held_only_by_items(containers)
      by_count = {id(b) for item in schedule for b in item.outputs if id(b) in held and b._handle is None}
      seen.append((by_slots, by_count))
    original(schedule)
  monkeypatch.setattr(realize, "plan_schedule_memory", check)
  rng = np.random.default_rng(22)

  def build(x: Tensor, keep: bool) -> tuple[Tensor, Tensor | None]:
    first = (x * 2).contiguous()
    second = (first.exp2() + x).contiguous()
    return second.sum(axis=1) * 3, (first if keep else None)
  for keep in (False, False, True, False, True, False):
    x = Tensor(rng.standard_normal((8, 8)).astype(np.float32)).realize()
    out, kept = build(x, keep)
    out.realize()
    expected = (np.exp2(x.numpy() * 2) + x.numpy()).sum(axis=1) * 3
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5)
    del kept
  assert len(seen) >= 3 and all(by_slots == by_count for by_slots, by_count in seen)
  assert len({len(by_slots) for by_slots, _ in seen}) == 2   # (a kept intermediate is one internal buffer less)


def test_a_replayed_kernel_with_two_outputs_launches_from_the_cache_and_gives_both():
  """Two results of one input realized together are one kernel with two outputs: its replay launches from the schedule
  cache (no ScheduleItem) on two fresh buffers, in the bases' order, and both results match numpy as inputs change."""
  from ourgrad.engine import realize
  made = []
  original = schedule_cache.replayed_item
  schedule_cache.replayed_item = lambda *args: made.append(args) or original(*args)
  try:
    rng = np.random.default_rng(23)
    for step in range(5):
      values = rng.standard_normal(9).astype(np.float32)
      x = Tensor(values).realize()
      a, b = x + 1, x * 2
      before = GlobalCounters.kernel_count
      Tensor.realize_all(a, b)
      assert GlobalCounters.kernel_count == before + 1
      np.testing.assert_allclose(a.numpy(), values + 1, rtol=1e-6)
      np.testing.assert_allclose(b.numpy(), values * 2, rtol=1e-6)
  finally:
    schedule_cache.replayed_item = original
  assert not made[2:] and realize.launch_one is not None


def test_a_one_kernel_replay_whose_outputs_are_not_its_fresh_buffers_in_order_launches_on_the_slots():
  """_launch_replay's general way (outputs in another order than the fresh buffers): the kernel gets its buffers by
  its slots, each base the buffer of its fresh position, the cleared bases lose their sources."""
  from ourgrad.device import Buffer

  class Base:
    realized, srcs = None, ("a source",)
  leaves = [Buffer("CLANG", 3, dtypes.float32), Buffer("CLANG", 5, dtypes.float32)]
  bases = [Base(), Base()]
  from ourgrad.ops import LazyOp, Ops
  ast = LazyOp(Ops.SINK, (), None)
  cached = schedule_cache.CachedSchedule([ast], [(3, 2)], [(1, 0)], [(0, "CLANG", 4, dtypes.float32),
                                         (1, "CLANG", 2, dtypes.int32)], [], [1], [])
  assert cached.one_kernel
  launched = []
  assert schedule_cache._launch_replay(cached, bases, leaves, lambda memo, buffers: launched.append(buffers) or True)
  assert cached.launch_plan is not None and not cached.launch_plan.direct
  assert launched == [[bases[1].realized, bases[0].realized, leaves[1], leaves[0]]]
  assert (bases[0].realized.size, bases[1].realized.dtype) == (4, dtypes.int32)
  assert all(buffer.is_allocated for buffer in launched[0][:2])
  assert bases[0].srcs == ("a source",) and bases[1].srcs == ()
  # refused: nothing cleared, and _replay gives the bases other buffers
  bases = [Base(), Base()]
  assert not schedule_cache._launch_replay(cached, bases, leaves, lambda memo, buffers: False)
  assert bases[1].srcs == ("a source",)


def test_a_replayed_schedule_launched_whole_counts_as_item_by_item(monkeypatch):
  """A replayed multi-kernel schedule whose kernels were all lowered launches through realize.launch_all (launchers
  and totals kept per cached schedule): the same kernel, op and byte counts as the first, item-by-item replay, and
  the values of new inputs; a cleared compiled-kernel cache (a new generation) lowers again and launches whole again."""
  from ourgrad.engine import realize
  monkeypatch.setenv("EAGER_CAPTURE", "0")
  whole = []
  original = realize.launch_all
  monkeypatch.setattr(realize, "launch_all", lambda schedule, generation: whole.append(original(schedule, generation))
                      or whole[-1])
  rng = np.random.default_rng(24)

  def step() -> tuple[tuple[int, int, int], np.ndarray, np.ndarray]:
    values = rng.standard_normal((6, 6)).astype(np.float32)
    x = Tensor(values).realize()
    out = ((x * 2).contiguous().exp2() + x).contiguous().sum(axis=1)
    counts = (GlobalCounters.kernel_count, GlobalCounters.global_ops, GlobalCounters.global_mem)
    out.realize()
    return tuple(now - then for now, then in zip((GlobalCounters.kernel_count, GlobalCounters.global_ops,
                                                   GlobalCounters.global_mem), counts)), out.numpy(), values
  counted = []
  for round_ in range(2):
    for _ in range(4):
      counts, result, values = step()
      counted.append(counts)
      np.testing.assert_allclose(result, (np.exp2(values * 2) + values).sum(axis=1), rtol=1e-5)
    if round_ == 0: clear_caches()
  assert len(set(counted)) == 1 and counted[0][0] == 3
  assert whole.count(True) >= 4 and False in whole   # (the first replays after each lowering go item by item)


def test_a_replayed_schedule_with_a_copy_is_launched_item_by_item_and_checked_once(monkeypatch):
  """A replayed schedule holding a copy (to another device) never launches whole: launch_all refuses, remembers that
  for the cached schedule (no check of every item at each realize), and the values are right at every replay."""
  from ourgrad.engine import realize
  from ourgrad.engine.schedule_item import ReplayedSchedule
  monkeypatch.setenv("EAGER_CAPTURE", "0")
  answers, kept = [], []
  original = realize.launch_all

  def watch(schedule: ReplayedSchedule, generation: int) -> bool:
    answers.append(original(schedule, generation))
    kept.append(schedule.launches[0])
    return answers[-1]
  monkeypatch.setattr(realize, "launch_all", watch)
  rng = np.random.default_rng(25)
  for _ in range(5):
    values = rng.standard_normal(6).astype(np.float32)
    x = Tensor(values, device="CLANG").realize()
    out = ((x * 2).contiguous().to("PYTHON") + 1).contiguous() * 3
    np.testing.assert_allclose(out.numpy(), (values * 2 + 1) * 3, rtol=1e-6)
  assert answers and not any(answers)
  assert kept[-1] is not None and kept[-1][2] is None   # (the refusal remembered)
