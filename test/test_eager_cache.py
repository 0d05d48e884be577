"""The eager path's caches never hand back a stale schedule: a randomized sequence of realizes that change one thing
at a time (the input buffer, its contents, a constant, the dtype, the device, a 0-d scalar tensor) checked against
numpy at every step; and eager training steps bit-identical to TinyJit's on more models."""
import numpy as np
import pytest

import ourgrad.engine.schedule_cache as schedule_cache
from ourgrad import lazy_trace
from ourgrad import Device, Tensor, TinyJit, dtypes
from ourgrad.errors import DeviceError
from ourgrad.nn import LayerNorm, Linear
from ourgrad.nn.losses import cross_entropy
from ourgrad.nn.optim import SGD, Adam
from ourgrad.nn.state import get_parameters

NUMPY_DTYPES = {dtypes.float32: np.float32, dtypes.int32: np.int32}

# (ourgrad expression, numpy expression) of an input x and a constant c; each keeps c's effect visible in every dtype
EXPRESSIONS = [
  (lambda x, c: x * c + 1, lambda x, c: x * c + 1),
  (lambda x, c: (x + c).maximum(x * 2), lambda x, c: np.maximum(x + c, x * 2)),
  (lambda x, c: (x - c).sum(), lambda x, c: (x - c).sum()),
  (lambda x, c: (x * c)[1:].flip(0), lambda x, c: (x * c)[1:][::-1]),
]


def _reference(expression, x: np.ndarray, c, dtype) -> np.ndarray:
  return np.asarray(expression(x.astype(NUMPY_DTYPES[dtype]), NUMPY_DTYPES[dtype](c)))


def _second_device() -> str:
  """The default device's second instance (CLANG:1), or where the machine has one GPU only, another device that
  opens (a CUDA:1 would fail on cuDeviceGet): a change of device must never reuse a schedule."""
  for name in (f"{Device.DEFAULT}:1", "CLANG", "PYTHON"):
    if name == Device.DEFAULT: continue
    try:
      Device[name]
      return name
    except DeviceError:
      continue
  pytest.skip("no second device opens here")


def test_randomized_changes_never_reuse_a_stale_schedule():
  """Random realizes changing one thing at a time: the input's buffer, its contents, its length, the view it is read
  through (flipped), a constant, the dtype, the device, the expression, a 0-d scalar tensor for the constant,
  whether an intermediate (x + 1) is forced into memory after its readers were made, or whether the result is
  realized beside outputs realized already; every result against numpy."""
  rng = np.random.default_rng(26)
  devices = [Device.DEFAULT, _second_device()]
  hits_before, traced_before = schedule_cache.stats.hits, schedule_cache.stats.traced_hits
  inputs = {}   # (device, dtype, length) -> the realized input tensor now in use
  expression_index, constant, dtype, device = 0, 2, dtypes.float32, devices[0]
  length, flipped, forced = 7, False, False
  for _ in range(160):
    change = rng.choice(["none", "buffer", "contents", "constant", "dtype", "device", "expression", "scalar", "length",
                         "view", "force", "beside"])
    if change == "constant": constant = int(rng.choice([-3, 0, 1, 2, 5]))
    elif change == "dtype": dtype = dtypes.int32 if dtype == dtypes.float32 else dtypes.float32
    elif change == "device": device = devices[1] if device == devices[0] else devices[0]
    elif change == "expression": expression_index = int(rng.integers(len(EXPRESSIONS)))
    elif change == "length": length = 9 if length == 7 else 7
    elif change == "view": flipped = not flipped
    elif change == "force": forced = not forced
    key = (device, dtype, length)
    if key not in inputs or change == "buffer":   # a new buffer of new values
      inputs[key] = Tensor(rng.integers(-9, 9, length).astype(NUMPY_DTYPES[dtype]), device=device).realize()
    elif change == "contents":                     # the same buffer, written in place
      inputs[key].assign(Tensor(rng.integers(-9, 9, length).astype(NUMPY_DTYPES[dtype]), device=device)).realize()
    x = inputs[key].flip(0) if flipped else inputs[key]
    ours, theirs = EXPRESSIONS[expression_index]
    # "scalar": the constant as a 0-d tensor (a realized buffer), not a Python number folded into the kernel
    c = Tensor(constant, dtype=dtype, device=device).realize() if change == "scalar" else constant
    shifted = x + 1
    result = ours(shifted, c)
    if forced: shifted.contiguous()   # (after its readers were made: the realize must store it, not fuse it)
    assert result.device == device   # (a sum of int32 is int64, as in PyTorch: values are compared below)
    # "beside": realized together with outputs realized already (the input), which add nothing to the schedule
    if change == "beside": Tensor.realize_all(inputs[key], result, x)
    np.testing.assert_array_equal(result.numpy(), _reference(theirs, x.numpy() + 1, constant, dtype))
    if forced: assert shifted.lazydata.base.realized is not None
  assert schedule_cache.stats.hits - hits_before >= 20   # the cache was in play, not bypassed
  assert schedule_cache.stats.traced_hits - traced_before >= 20   # found by the creation trace (lazy_trace.py)


def test_constants_of_either_zero_sign_are_different_schedules():
  x = Tensor([-0.0, 0.0, 1.0]).realize()
  for _ in range(2):
    np.testing.assert_array_equal(np.signbit((x * 0.0).numpy()), np.signbit(np.array([-0.0, 0.0, 1.0]) * 0.0))
    np.testing.assert_array_equal(np.signbit((x * -0.0).numpy()), np.signbit(np.array([-0.0, 0.0, 1.0]) * -0.0))


def test_a_leaf_of_another_dtype_or_size_read_the_same_way_is_another_schedule():
  """Only the leaf differs (its dtype behind a cast to one dtype; its size behind one view): the key has each leaf's
  dtype and size, the walk's and the creation trace's alike."""
  rng = np.random.default_rng(7)
  for index in rng.permutation(np.repeat(np.arange(4), 3)):
    np_dtype = (np.float32, np.float16)[index % 2]
    values = (np.arange(12 if index >= 2 else 6) * 1.5).astype(np_dtype)
    x = Tensor(values).realize()
    np.testing.assert_array_equal((x[:6].cast(dtypes.int32) + 1).numpy(), values[:6].astype(np.int32) + 1)


def _shared(a: Tensor, b: Tensor, combine):
  """`combine` of two computed values, each one base that every use reads (not a leaf)"""
  return combine(a * 2, b * 3)


# graphs of one size that differ only in which sources each op reads: the same leaf twice or two leaves, a computed
# value shared or made twice, a view of a leaf or of a computed value, the order of a non-commuting op's sources.
# The schedule cache's key is one flat token list: a wrong reference anywhere would hand back another graph's schedule
WIRINGS = [
  (lambda a, b: a - b, lambda a, b: a - b),
  (lambda a, b: b - a, lambda a, b: b - a),
  (lambda a, b: a - a.flip(0), lambda a, b: a - a[::-1]),
  (lambda a, b: a - b.flip(0), lambda a, b: a - b[::-1]),
  (lambda a, b: (a * 2) - (a * 2).flip(0), lambda a, b: a * 2 - (a * 2)[::-1]),
  (lambda a, b: (a * 2) - (b * 2).flip(0), lambda a, b: a * 2 - (b * 2)[::-1]),
  (lambda a, b: (a - b) * (b - a), lambda a, b: (a - b) * (b - a)),
  (lambda a, b: (a - b) * (a - b), lambda a, b: (a - b) * (a - b)),   # two bases of a - b, not one shared
  (lambda a, b: _shared(a, b, lambda x, y: (x - y) * (y - x)), lambda a, b: (a * 2 - b * 3) * (b * 3 - a * 2)),
  (lambda a, b: _shared(a, b, lambda x, y: (x - y) * (x - y)), lambda a, b: (a * 2 - b * 3) ** 2),
  (lambda a, b: (a - b) * (a - b).flip(0), lambda a, b: (a - b) * (a - b)[::-1]),
  (lambda a, b: a.maximum(b) - b, lambda a, b: np.maximum(a, b) - b),
  (lambda a, b: b.maximum(a) - a, lambda a, b: np.maximum(b, a) - a),
  # constants, written into their readers' references in the key (schedule_cache._INLINE): one read twice or two of
  # one value, different values or views, a constant that is also an output, one forced into memory
  (lambda a, b: _shared_constant(a, b, 2.0, 2.0), lambda a, b: a * 2 + b * 2),
  (lambda a, b: _shared_constant(a, b, 2.0, 3.0), lambda a, b: a * 2 + b * 3),
  (lambda a, b: (a * 2 + b * 2, Tensor.full((5,), 2.0))[0], lambda a, b: a * 2 + b * 2),
  (lambda a, b: _constant_output(a, 2.0), lambda a, b: a * 2 + 2),
  (lambda a, b: a * Tensor.full((5,), 2.0).contiguous() + b, lambda a, b: a * 2 + b),
  (lambda a, b: a * Tensor.full((1,), 2.0).contiguous() + b, lambda a, b: a * 2 + b),
  (lambda a, b: a * Tensor.full((5,), 2.0)[::-1] + b, lambda a, b: a * 2 + b),
]


def _shared_constant(a: Tensor, b: Tensor, left: float, right: float) -> Tensor:
  """a * c1 + b * c2 with c1 and c2 one constant tensor when their values agree, two otherwise."""
  c1 = Tensor.full((5,), left)
  c2 = c1 if left == right else Tensor.full((5,), right)
  return a * c1 + b * c2


def _constant_output(a: Tensor, value: float) -> Tensor:
  """a * c + c with the constant c realized in the same schedule as the result (an output and a source at once)."""
  c = Tensor.full((5,), value)
  result = a * c + c
  Tensor.realize_all(result, c)
  np.testing.assert_array_equal(c.numpy(), np.full(5, value, np.float32))
  return result


def test_graphs_differing_only_in_their_sources_never_share_a_schedule():
  rng = np.random.default_rng(11)
  hits_before = schedule_cache.stats.hits
  for index in rng.permutation(np.repeat(np.arange(len(WIRINGS)), 4)):   # each wiring 4 times, in a random order
    a_values, b_values = rng.standard_normal(5).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    a, b = Tensor(a_values).realize(), Tensor(b_values).realize()
    ours, theirs = WIRINGS[index]
    # (rtol: a GPU's float32 exp/log differ from numpy's in the last bits; a stale schedule is off by far more)
    np.testing.assert_allclose(ours(a, b).numpy(), theirs(a_values, b_values), rtol=1e-5)
  assert schedule_cache.stats.hits - hits_before >= 20


class _MLP:
  def __init__(self, norm: bool):
    self.layers = [Linear(12, 16), Linear(16, 16), Linear(16, 4)]
    self.norm = LayerNorm(16) if norm else None

  def __call__(self, x: Tensor) -> Tensor:
    for layer in self.layers[:-1]:
      x = layer(x).relu()
      if self.norm is not None: x = self.norm(x)
    return self.layers[-1](x)


def _training(norm: bool, optimizer_name: str):
  Tensor.manual_seed(5)
  model = _MLP(norm)
  parameters = get_parameters(model)
  optimizer = Adam(parameters, lr=0.01) if optimizer_name == "adam" else SGD(parameters, lr=0.05, momentum=0.9,
                                                                             nesterov=True, weight_decay=1e-3)

  def step(x: Tensor, y: Tensor) -> Tensor:
    with Tensor.train():
      optimizer.zero_grad()
      loss = cross_entropy(model(x), y)
      loss.backward()
      Tensor.realize_all(loss, *optimizer.schedule_step())
    return loss
  return model, step


@pytest.mark.parametrize("norm,optimizer_name", [(False, "adam"), (True, "sgd")])
def test_eager_steps_bit_identical_to_tinyjit(norm, optimizer_name):
  rng = np.random.default_rng(3)
  batches = [(rng.standard_normal((6, 12)).astype(np.float32), rng.integers(0, 4, 6).astype(np.int32))
             for _ in range(5)]
  eager_model, eager_step = _training(norm, optimizer_name)
  jit_model, plain_step = _training(norm, optimizer_name)
  jit_step = TinyJit(plain_step)
  for images, labels in batches:
    assert eager_step(Tensor(images), Tensor(labels)).numpy().tobytes() == \
        jit_step(Tensor(images), Tensor(labels)).numpy().tobytes()
  assert jit_step.captured is not None
  for eager, jitted in zip(get_parameters(eager_model), get_parameters(jit_model)):
    assert eager.numpy().tobytes() == jitted.numpy().tobytes()


def test_replayed_items_rebind_buffers_under_random_lifetimes():
  """A replayed schedule keeps each kernel's lowering and the ExecItem its last replay ran (schedule_item.LoweringMemo),
  rebound to each replay's buffers. Random steps keep or drop earlier results (so the allocator hands back the same
  memory or other memory), change the input buffer or write it in place, clear the compiled kernels, or run the same
  graph under a capturing TinyJit; every result against numpy, and the kept results must keep their values."""
  from ourgrad.engine import realize
  rng = np.random.default_rng(2026)
  hits_before = schedule_cache.stats.hits
  values = rng.standard_normal(9).astype(np.float32)
  x = Tensor(values).realize()
  kept: list[tuple[Tensor, np.ndarray]] = []

  def expression(t: Tensor, c: float) -> Tensor: return ((t * c + 1.5).exp2() - 0.25).relu() * t + c

  def reference(v: np.ndarray, c: float) -> np.ndarray:
    return np.maximum(np.exp2(v * np.float32(c) + np.float32(1.5)) - np.float32(0.25), 0) * v + np.float32(c)

  jitted = TinyJit(lambda t: expression(t, 0.5).realize())
  for _ in range(80):
    change = rng.choice(["none", "keep", "drop", "buffer", "contents", "clear", "jit"])
    if change == "keep": kept.append((expression(x, 0.5).realize(), reference(values, 0.5)))
    elif change == "drop": kept = kept[len(kept) // 2:]
    elif change == "buffer":
      values = rng.standard_normal(9).astype(np.float32)
      x = Tensor(values).realize()
    elif change == "contents":
      values = rng.standard_normal(9).astype(np.float32)
      x.assign(Tensor(values)).realize()
    elif change == "clear": realize._runner_cache.clear()   # the kept lowerings must not outlive the kernels
    elif change == "jit":
      np.testing.assert_allclose(jitted(Tensor(values)).numpy(), reference(values, 0.5), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(expression(x, 0.5).numpy(), reference(values, 0.5), rtol=1e-5, atol=1e-6)
    for result, expected in kept: np.testing.assert_allclose(result.numpy(), expected, rtol=1e-5, atol=1e-6)
  assert schedule_cache.stats.hits - hits_before >= 40


def test_a_cleared_kernel_cache_is_not_bypassed_by_a_replayed_schedule():
  from ourgrad.engine import realize
  x = Tensor(np.arange(4, dtype=np.float32)).realize()
  for _ in range(3): (x * 3 + 1).realize()   # cached, replayed, its lowering kept
  realize._runner_cache.clear()
  np.testing.assert_array_equal((x * 3 + 1).numpy(), np.arange(4, dtype=np.float32) * 3 + 1)
  assert len(realize._runner_cache) >= 1   # lowered (and compiled) again through the kernel cache


def test_replayed_kernels_launch_without_exec_items_and_count_the_same(monkeypatch, capsys):
  """A quiet replay calls each lowered kernel's launcher with the item's buffers (no ExecItem made); it counts kernels,
  ops and bytes as ExecItem.run does, gives numpy's values on new and reused buffers, and DEBUG=2 still launches
  through an ExecItem (a printed line per kernel)."""
  from ourgrad.engine import exec_item, realize
  from ourgrad.helpers import GlobalCounters
  made = [0]
  original_init = exec_item.ExecItem.__init__

  def counting_init(self, *args, **kwargs):
    made[0] += 1
    original_init(self, *args, **kwargs)
  monkeypatch.setattr(exec_item.ExecItem, "__init__", counting_init)
  values = np.linspace(-2, 2, 7, dtype=np.float32)
  x = Tensor(values).realize()
  kept = []
  for step in range(6):
    counted = (GlobalCounters.kernel_count, GlobalCounters.global_ops, GlobalCounters.global_mem)
    made[0] = 0
    result = (x * 3 + 1).realize()
    if step % 2: kept.append((result, values * 3 + 1))   # some results kept: the next one runs on other memory
    launched = (GlobalCounters.kernel_count - counted[0], GlobalCounters.global_ops - counted[1],
                GlobalCounters.global_mem - counted[2])
    if step == 1: first_replay = launched
    if step >= 2:
      assert made[0] == 0 and launched == first_replay
    np.testing.assert_allclose(result.numpy(), values * 3 + 1, rtol=1e-6)
  for result, expected in kept: np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6)
  capsys.readouterr()
  monkeypatch.setenv("DEBUG", "2")
  np.testing.assert_allclose((x * 3 + 1).numpy(), values * 3 + 1, rtol=1e-6)
  assert realize.quiet_launches() is False and "***" in capsys.readouterr().out


# ---------------------------------------------------------------- the creation trace (ourgrad/lazy_trace.py)

def test_graphs_changed_between_building_and_realizing_never_reuse_a_traced_schedule():
  """A schedule found by the creation trace (no graph walk) is the one the graph needs as it is when realized: random
  steps build the same graph, and between building and realizing it realize a part of it, force a part into memory
  (contiguous() after its readers were made), overwrite its leaf in place (its lazy readers keep the old values),
  read a lazy value kept from an earlier step (made before the trace started) or a remembered lazy graph of
  constants, or swap the leaf for a new buffer; every result against numpy."""
  rng = np.random.default_rng(15)
  a_values, b_values = rng.standard_normal(6).astype(np.float32), rng.standard_normal(6).astype(np.float32)
  a, b = Tensor(a_values).realize(), Tensor(b_values).realize()
  constants = Tensor.full((3,), 1.5).pad(((0, 3),)) + Tensor.full((6,), 0.5)   # never realized: kept lazy
  constants_values = np.array([2, 2, 2, 0.5, 0.5, 0.5], np.float32)
  kept, kept_values = None, None
  traced_before = schedule_cache.stats.traced_hits
  for _ in range(160):
    event = rng.choice(["none", "none", "part", "force", "assign", "kept", "constants", "leaf", "keep"])
    if event == "leaf":
      a_values = rng.standard_normal(6).astype(np.float32)
      a = Tensor(a_values).realize()
    scale = float(rng.choice([1.5, 2.0]))
    shared, shared_values = a * scale, a_values * np.float32(scale)
    if event == "kept" and kept is not None: shared, shared_values = shared + kept, shared_values + kept_values
    result = (shared - b).maximum(shared * 0.5) + shared.sum()
    expected = np.maximum(shared_values - b_values, shared_values * np.float32(0.5)) + shared_values.sum()
    if event == "constants": result, expected = result * constants, expected * constants_values
    if event == "part": shared.realize()
    elif event == "force": shared.contiguous()
    elif event == "assign":
      a_values = rng.standard_normal(6).astype(np.float32)
      a.assign(Tensor(a_values)).realize()
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-5, atol=1e-6)
    if event == "force": assert shared.lazydata.base.realized is not None   # in memory as asked, not fused
    if event == "keep": kept, kept_values = a * 3 + b, a_values * np.float32(3) + b_values
  assert schedule_cache.stats.traced_hits - traced_before >= 40   # the trace was in play, not bypassed


def test_traced_wirings_and_eager_steps_use_the_trace():
  """The graphs of test_graphs_differing_only_in_their_sources_never_share_a_schedule and an eager training step
  are found by their creation trace from the second time on (what the checks above and below test through)."""
  # the trace holds every base made since the last schedule, so lazy work a test before this one left unrealized
  # would be part of the first wiring's first key (a miss there, then a hit from its third realize): start clean
  lazy_trace.invalidate()
  a, b = Tensor(np.ones(5, np.float32)).realize(), Tensor(np.ones(5, np.float32)).realize()
  for ours, _ in WIRINGS:
    ours(a, b).realize()
    before = schedule_cache.stats.traced_hits
    ours(a, b).realize()
    assert schedule_cache.stats.traced_hits == before + 1
  # a remembered lazy graph of constants, made before the trace started (as max pooling's window ranks): appended to
  # the trace when a traced base reads it (the first realize still had it in its own trace, at another position)
  constants = Tensor.full((3,), 1.5).pad(((0, 3),)) + Tensor.full((6,), 0.5)
  x = Tensor(np.ones(6, np.float32)).realize()
  for _ in range(2): (x * constants).realize()
  before = schedule_cache.stats.traced_hits
  np.testing.assert_array_equal((x * constants).numpy(), [2, 2, 2, 0.5, 0.5, 0.5])
  assert schedule_cache.stats.traced_hits == before + 1
  _, step = _training(True, "adam")
  x, y = Tensor(np.ones((6, 12), np.float32)).realize(), Tensor(np.zeros(6, np.int32)).realize()
  for _ in range(2): step(x, y)
  before = schedule_cache.stats.traced_hits
  for _ in range(3): step(x, y)
  assert schedule_cache.stats.traced_hits - before == 3


def test_the_trace_keeps_no_base_alive_past_a_realize():
  """Bases made and dropped before a realize are freed by it (the trace held them until then): their lazy readers
  must not look alive to the copy-on-write of a later assign."""
  import weakref
  a = Tensor(np.ones(4, np.float32)).realize()
  dropped = a * 5
  reference = weakref.ref(dropped.lazydata)
  del dropped
  (a + 1).realize()
  assert reference() is None


def test_a_dropped_reader_costs_no_snapshot_though_the_trace_held_it(monkeypatch):
  """The trace holds every base made since the last schedule; the schedule lets go of it before the copy-on-write
  decisions of an assign, so a lazy reader the user dropped does not look alive there (it would cost a snapshot
  copy); and a training step launches the kernels it launches with no trace at all."""
  from ourgrad import lazy_trace
  from ourgrad.helpers import GlobalCounters
  w = Tensor(np.ones(8, np.float32)).realize()
  dropped = w * 2
  del dropped
  GlobalCounters.reset()
  w.assign(w + 1).realize()
  assert GlobalCounters.kernel_count == 1
  np.testing.assert_array_equal(w.numpy(), np.full(8, 2, np.float32))

  def kernels_per_step() -> list[int]:
    _, step = _training(False, "adam")
    x, y = Tensor(np.ones((6, 12), np.float32)).realize(), Tensor(np.zeros(6, np.int32)).realize()
    counts = []
    for _ in range(3):
      GlobalCounters.reset()
      step(x, y)
      counts.append(GlobalCounters.kernel_count)
    return counts
  traced = kernels_per_step()
  monkeypatch.setattr(lazy_trace, "MAX_TRACED", 0)   # nothing traced: every realize walks its graph
  assert traced == kernels_per_step()


def test_graphs_built_by_two_threads_at_once_are_right():
  """Graphs two threads build at once: a trace belongs to the thread that started it, a base the other makes drops it
  (the realize walks its graph), and a realize on the other thread does not use it (test_trace_tokens.py)."""
  import threading
  errors: list[BaseException] = []

  def work(seed: int) -> None:
    try:
      rng = np.random.default_rng(seed)
      for _ in range(30):
        values = rng.standard_normal(5).astype(np.float32)
        x = Tensor(values).realize()
        scale = float(rng.integers(1, 4))
        expected = (values * np.float32(scale) + 1) * values
        np.testing.assert_allclose(((x * scale + 1) * x).numpy(), expected, rtol=1e-5, atol=1e-6)
    except BaseException as error:   # noqa: BLE001 (re-raised in the main thread)
      errors.append(error)
  threads = [threading.Thread(target=work, args=(seed,)) for seed in (1, 2)]
  for thread in threads: thread.start()
  for thread in threads: thread.join()
  assert not errors, errors


def test_a_trace_past_its_bound_is_dropped_and_the_realize_walks(monkeypatch):
  """A long run of graph building without a realize: past MAX_TRACED bases the trace lets go of them (and stays
  empty until the next schedule); that realize walks its graph, the next is traced again."""
  from ourgrad import lazy_trace
  monkeypatch.setattr(lazy_trace, "MAX_TRACED", 8)
  x = Tensor(np.arange(4, dtype=np.float32)).realize()
  for _ in range(2):
    result = x
    for _ in range(12): result = result * 1.5 + 1
    trace = lazy_trace._trace[0]
    assert trace is not None and trace.tainted and not trace.bases
    expected = np.arange(4, dtype=np.float32)
    for _ in range(12): expected = expected * np.float32(1.5) + np.float32(1)
    np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6)
  before = schedule_cache.stats.traced_hits
  for _ in range(3): (x * 2 + 1).realize()
  assert schedule_cache.stats.traced_hits == before + 2


def test_a_dropped_reader_of_a_jit_output_costs_no_snapshot_at_the_next_replay():
  """A replay protects lazy readers of the outputs it overwrites (a snapshot copy); one the user dropped, which only
  the creation trace still held, is not one of them: the replay launches its one kernel. A kept reader keeps its
  values through the snapshot."""
  from ourgrad.helpers import GlobalCounters
  jitted = TinyJit(lambda t: (t * 2).realize())
  x = Tensor(np.ones(4, np.float32)).realize()
  for _ in range(3): out = jitted(x)   # captured, then replayed
  dropped = out * 3
  del dropped
  GlobalCounters.reset()
  out = jitted(x)
  assert GlobalCounters.kernel_count == 1
  kept = out + 1
  GlobalCounters.reset()
  jitted(x)
  assert GlobalCounters.kernel_count == 2   # the replay and the snapshot
  np.testing.assert_array_equal(kept.numpy(), np.full(4, 3, np.float32))


def test_a_changed_scheduler_setting_is_another_traced_schedule(monkeypatch):
  """The settings the scheduler's decisions read (here KERNEL_OPS_LIMIT, which splits a long elementwise chain into
  several kernels) are part of the traced key: the same graph built again under another value is scheduled for that
  value, and a hit under the first value again gives the first schedule. Values and kernel counts each time."""
  from ourgrad.helpers import GlobalCounters
  values = np.linspace(0.1, 1.0, 16, dtype=np.float32)
  x = Tensor(values).realize()

  def chain(t: Tensor) -> Tensor:
    for step in range(12): t = t * 1.01 + step
    return t
  expected = values.copy()
  for step in range(12): expected = expected * np.float32(1.01) + np.float32(step)
  kernels = {}
  for limit in ("0", "8", "0", "8", "0"):
    monkeypatch.setenv("KERNEL_OPS_LIMIT", limit)
    before = GlobalCounters.kernel_count
    np.testing.assert_allclose(chain(x).numpy(), expected, rtol=1e-5)
    kernels.setdefault(limit, set()).add(GlobalCounters.kernel_count - before)
  assert len(kernels["0"]) == 1 and len(kernels["8"]) == 1 and kernels["0"] != kernels["8"]
