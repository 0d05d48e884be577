"""The structural schedule cache: a graph of the same structure is scheduled once, with identical results."""
import numpy as np

import ourgrad.engine.schedule_cache as schedule_cache
from ourgrad import Tensor
from test_jit import _make_training


def test_same_structure_hits_and_computes_new_values():
  before = schedule_cache.stats.hits
  for step in range(4):
    a, b = Tensor.randn(8, 8), Tensor.randn(8, 8)
    out = ((a @ b).relu() - (a * 2).sum(1, keepdim=True)).numpy()
    an, bn = a.numpy(), b.numpy()
    np.testing.assert_allclose(out, np.maximum(an @ bn, 0) - (an * 2).sum(1, keepdims=True), rtol=1e-5, atol=1e-5)
  assert schedule_cache.stats.hits - before >= 3


def test_different_constant_or_shape_misses():
  schedule_cache._cache.clear()  # what earlier tests in this process scheduled must not count as seen
  x = Tensor.randn(16).realize()
  (x * 3.0 + 1).realize()
  misses = schedule_cache.stats.misses
  np.testing.assert_allclose((x * 5.0 + 1).numpy(), x.numpy() * 5.0 + 1, rtol=1e-6, atol=1e-6)
  assert schedule_cache.stats.misses == misses + 1
  y = Tensor.randn(17).realize()
  np.testing.assert_allclose((y * 3.0 + 1).numpy(), y.numpy() * 3.0 + 1, rtol=1e-6, atol=1e-6)
  assert schedule_cache.stats.misses == misses + 2


def test_training_steps_identical_with_and_without_cache(monkeypatch):
  rng = np.random.default_rng(1)
  batches = [(rng.standard_normal((8, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(6)]
  results = {}
  for setting in ("0", "1"):
    monkeypatch.setenv("SCHEDULE_CACHE", setting)
    model, step = _make_training(3)
    hits = schedule_cache.stats.hits
    losses = [step(Tensor(images), Tensor(labels)).numpy().tobytes() for images, labels in batches]
    results[setting] = (losses, [model.fc.weight.numpy().tobytes(), model.bn.running_var.numpy().tobytes()])
    if setting == "1": assert schedule_cache.stats.hits - hits >= 3
  assert results["0"] == results["1"]


def _kernel_count(make_outputs) -> int:
  """How many items the scheduler makes for the graph `make_outputs()` builds (its outputs, not realized)."""
  from ourgrad.engine.schedule import create_schedule
  return len(create_schedule([out.lazydata for out in make_outputs()]))


def test_replayed_diamond_and_shared_leaves_match_numpy_with_unchanged_kernel_counts():
  """A base read by users at different depths (a diamond), two outputs, one leaf read through two views: the walk
  places each base once, a replay rebinds each output to a fresh buffer and each leaf to this step's buffer."""
  rng = np.random.default_rng(3)
  schedule_cache._cache.clear()

  def graph(x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    shared = (x * 2 + w).contiguous()               # one base, read by both outputs and by itself twice
    return (shared * shared + x.T).sum(0), (shared.exp2() - w.T).max(1)
  x0, w0 = (Tensor(rng.standard_normal((6, 6)).astype(np.float32)) for _ in range(2))
  kernels = _kernel_count(lambda: graph(x0, w0))
  hits = schedule_cache.stats.hits
  outputs = []
  for _ in range(4):
    xn, wn = rng.standard_normal((6, 6)).astype(np.float32), rng.standard_normal((6, 6)).astype(np.float32)
    first, second = graph(Tensor(xn), Tensor(wn))
    Tensor.realize(first, second)
    shared = xn * 2 + wn
    np.testing.assert_allclose(first.numpy(), (shared * shared + xn.T).sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(second.numpy(), (np.exp2(shared) - wn.T).max(1), rtol=1e-5, atol=1e-5)
    outputs.append(first.lazydata.base.realized)
  assert schedule_cache.stats.hits - hits == 3
  assert len({id(buffer) for buffer in outputs}) == 4   # a fresh output buffer each step, never a stale one
  assert _kernel_count(lambda: graph(x0, w0)) == kernels


def test_replayed_assign_chain_writes_the_leaf_each_step():
  """Two assigns to one buffer in one realize (the second writes the buffer of the first: a chain of shared slots),
  replayed with new values each step, against numpy."""
  rng = np.random.default_rng(4)
  schedule_cache._cache.clear()
  hits = schedule_cache.stats.hits
  for _ in range(4):
    start, add = rng.standard_normal(5).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    x = Tensor(start).realize()
    x.assign(x + Tensor(add))
    x.assign(x * 3)
    np.testing.assert_allclose(x.numpy(), (start + add) * 3, rtol=1e-6, atol=1e-6)
  assert schedule_cache.stats.hits - hits >= 3
