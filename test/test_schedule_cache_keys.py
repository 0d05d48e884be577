"""The schedule cache's keys are made as the graph is built (ourgrad/lazy_structure.py): a repeated realize finds
its schedule without walking the graph, and a key is never stale: leaves shared or distinct, intermediates realized,
forced or redirected after their readers were built all schedule anew, with values checked against numpy."""
import numpy as np

import ourgrad.engine.schedule_cache as schedule_cache
from ourgrad import Tensor
from ourgrad.nn import Linear
from ourgrad.nn.optim import Adam
from ourgrad.nn.state import get_parameters


def _walks_and_hits() -> tuple[int, int]:
  return schedule_cache.stats.walks, schedule_cache.stats.hits


def test_repeated_expression_walks_no_graph():
  rng = np.random.default_rng(0)
  results = []
  for _ in range(5):
    data = rng.standard_normal((4, 6)).astype(np.float32)
    x = Tensor(data).realize()
    walks, hits = _walks_and_hits()
    out = ((x * 2 + 1).exp().sum(1) - x.max(1)).realize()
    results.append((schedule_cache.stats.walks - walks, schedule_cache.stats.hits - hits))
    np.testing.assert_allclose(out.numpy(), np.exp(data * 2 + 1).sum(1) - data.max(1), rtol=1e-5)
  assert results[-3:] == [(0, 1)] * 3   # after the first: hits, and not one walk of the graph


def test_training_step_walks_no_graph():
  rng = np.random.default_rng(1)
  model = [Linear(12, 16), Linear(16, 3)]
  optimizer = Adam(get_parameters(model), lr=1e-2)
  training = Tensor.training   # restored after: None (never set) and False mean different things to a Module
  Tensor.training = True
  try:
    walks = []
    for _ in range(5):
      x = Tensor(rng.standard_normal((8, 12)).astype(np.float32))
      before = schedule_cache.stats.walks
      optimizer.zero_grad()
      loss = model[1](model[0](x).relu()).square().mean()
      loss.backward()
      optimizer.step()
      walks.append(schedule_cache.stats.walks - before)
  finally:
    Tensor.training = training
  assert walks[-2:] == [0, 0]


def test_shared_and_distinct_leaves_are_different_keys():
  rng = np.random.default_rng(2)
  a, b = (Tensor(rng.standard_normal(5).astype(np.float32)).realize() for _ in range(2))
  for _ in range(2):
    np.testing.assert_allclose((a * 3 + a).numpy(), a.numpy() * 4, rtol=1e-6)
    np.testing.assert_allclose((a * 3 + b).numpy(), a.numpy() * 3 + b.numpy(), rtol=1e-6)
    np.testing.assert_allclose((b * 3 + a).numpy(), b.numpy() * 3 + a.numpy(), rtol=1e-6)


def test_intermediate_realized_after_its_reader_was_built():
  rng = np.random.default_rng(3)
  for _ in range(3):   # the same structure each time: a stale key would hit the schedule of the lazy graph
    data = rng.standard_normal(6).astype(np.float32)
    x = Tensor(data).realize()
    middle = (x + 1) * 2
    out = middle.exp()
    np.testing.assert_allclose(out.numpy(), np.exp((data + 1) * 2), rtol=1e-5)
    middle2 = (x + 1) * 2
    out2 = middle2.exp()
    middle2.realize()   # after out2 was built on it: out2 reads it as memory now
    np.testing.assert_allclose(out2.numpy(), np.exp((data + 1) * 2), rtol=1e-5)
    np.testing.assert_allclose(middle2.numpy(), (data + 1) * 2, rtol=1e-6)


def test_contiguous_after_reader_was_built():
  rng = np.random.default_rng(4)
  for _ in range(3):
    data = rng.standard_normal((3, 4)).astype(np.float32)
    x = Tensor(data).realize()
    middle = x * 3
    out = middle.sum(0)
    middle.contiguous()   # forced after `out` was built on it
    np.testing.assert_allclose(out.numpy(), (data * 3).sum(0), rtol=1e-5)
    assert middle.lazydata.base.realized is not None   # the forced base got its buffer on the replay too


def test_randomized_realize_orders_match_numpy():
  """Build a small graph, realize a random subset of its nodes in a random order, several times over with one
  structure: every value matches numpy, whatever the cache replays."""
  rng = np.random.default_rng(5)
  for _ in range(30):
    data = rng.standard_normal((4, 4)).astype(np.float32)
    x = Tensor(data).realize()
    nodes = {"a": x + 1}
    nodes["b"] = nodes["a"] * nodes["a"]
    nodes["c"] = nodes["b"].sum(1, keepdim=True)
    nodes["d"] = nodes["b"] - nodes["c"]
    reference = {"a": data + 1}
    reference["b"] = reference["a"] ** 2
    reference["c"] = reference["b"].sum(1, keepdims=True)
    reference["d"] = reference["b"] - reference["c"]
    for name in rng.permutation(list(nodes))[:int(rng.integers(1, 5))]:
      np.testing.assert_allclose(nodes[name].numpy(), reference[name], rtol=1e-5, atol=1e-5)
