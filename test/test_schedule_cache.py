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
