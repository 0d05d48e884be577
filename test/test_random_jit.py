"""The device random generator (ourgrad/tensor_random.py): Threefry-2x32 against its published known-answer vectors
and a numpy implementation, on every renderer; rand/randn/dropout inside TinyJit: distribution statistics on 1e5
samples, new numbers on every replay, reproducible with Tensor.manual_seed; eager rand still numpy's."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import skip_unless_device
from ourgrad import Tensor, TinyJit, dtypes
from ourgrad.tensor_random import threefry2x32

# Random123's kat_vectors for threefry2x32 with 20 rounds: (counter, key, result)
KNOWN_ANSWERS = [((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6b200159, 0x99ba4efe)),
                 ((0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff), (0x1cb996fc, 0xbb002be7)),
                 ((0x243f6a88, 0x85a308d3), (0x13198a2e, 0x03707344), (0xc4923a9c, 0x483df7a0))]


def numpy_threefry2x32(key: tuple[np.ndarray, np.ndarray], counter: tuple[np.ndarray, np.ndarray]) -> tuple:
  """Threefry-2x32-20 written from the Random123 description, in numpy uint64 arithmetic masked to 32 bits."""
  mask = np.uint64(0xFFFFFFFF)
  k0, k1 = (np.asarray(word, dtype=np.uint64) for word in key)
  ks = (k0, k1, k0 ^ k1 ^ np.uint64(0x1BD11BDA))
  x0 = (np.asarray(counter[0], dtype=np.uint64) + ks[0]) & mask
  x1 = (np.asarray(counter[1], dtype=np.uint64) + ks[1]) & mask
  rotations = [13, 15, 26, 6, 17, 29, 16, 24]
  for round_index in range(20):
    r = np.uint64(rotations[round_index % 8])
    x0 = (x0 + x1) & mask
    x1 = (((x1 << r) | (x1 >> (np.uint64(32) - r))) & mask) ^ x0
    if round_index % 4 == 3:
      injection = round_index // 4 + 1
      x0 = (x0 + ks[injection % 3]) & mask
      x1 = (x1 + ks[(injection + 1) % 3] + np.uint64(injection)) & mask
  return x0.astype(np.uint32), x1.astype(np.uint32)


@pytest.mark.parametrize("device", ["CLANG", "LLVM", "PYTHON"])
def test_threefry_known_answers_and_numpy_reference(device):
  skip_unless_device(device)
  counters = np.array([answer[0] for answer in KNOWN_ANSWERS], dtype=np.uint32)
  keys = np.array([answer[1] for answer in KNOWN_ANSWERS], dtype=np.uint32)
  rng = np.random.default_rng(7)
  counters = np.concatenate([counters, rng.integers(0, 2**32, (61, 2), dtype=np.uint32)])
  keys = np.concatenate([keys, rng.integers(0, 2**32, (61, 2), dtype=np.uint32)])

  def tensor(column: np.ndarray) -> Tensor: return Tensor(column, dtype=dtypes.uint32, device=device)
  y0, y1 = threefry2x32((tensor(keys[:, 0]), tensor(keys[:, 1])), (tensor(counters[:, 0]), tensor(counters[:, 1])))
  y0, y1 = y0.numpy(), y1.numpy()
  assert [(int(a), int(b)) for a, b in zip(y0[:3], y1[:3])] == [answer[2] for answer in KNOWN_ANSWERS]
  ref0, ref1 = numpy_threefry2x32((keys[:, 0], keys[:, 1]), (counters[:, 0], counters[:, 1]))
  np.testing.assert_array_equal(y0, ref0)
  np.testing.assert_array_equal(y1, ref1)


def test_threefry_of_constants_folds_to_the_same_bits():
  """Keys and counters that are constants (no buffer): the graph folds or renders uint32 constants above 2**31."""
  (counter, key, expected), = KNOWN_ANSWERS[1:2]
  full = [Tensor.full((4,), word, dtype=dtypes.uint32) for word in (*key, *counter)]
  y0, y1 = threefry2x32((full[0], full[1]), (full[2], full[3]))
  assert y0.tolist() == [expected[0]] * 4 and y1.tolist() == [expected[1]] * 4


def _draws(fn, calls: int, *args) -> list[np.ndarray]:
  jitted = TinyJit(fn)
  return [np.concatenate([np.ravel(out.numpy()) for out in jitted(*args)]) for _ in range(calls)]


def test_rand_and_randn_inside_jit_statistics():
  Tensor.manual_seed(1)
  x = Tensor.zeros(1).contiguous().realize()
  jitted = TinyJit(lambda x: ((Tensor.rand(100_000) + x).realize(), (Tensor.randn(100_000) + x).realize()))
  for _ in range(4):
    uniform, normal = (out.numpy() for out in jitted(x))
    assert 0.0 <= uniform.min() and uniform.max() < 1.0
    # 5 standard errors: mean sd 1/sqrt(12n) ~ 0.0009; variance of uniform 1/12
    assert abs(uniform.mean() - 0.5) < 0.005 and abs(uniform.var() - 1 / 12) < 0.002
    counts, _ = np.histogram(uniform, bins=20, range=(0.0, 1.0))
    expected = len(uniform) / 20
    assert ((counts - expected) ** 2 / expected).sum() < 60  # chi-square, 19 degrees of freedom (p < 1e-5 beyond)
    assert abs(normal.mean()) < 0.02 and abs(normal.var() - 1.0) < 0.03
    assert abs(np.mean(np.abs(normal) < 1.0) - 0.6827) < 0.01 and abs(np.mean(np.abs(normal) < 2.0) - 0.9545) < 0.006
    assert abs(np.corrcoef(uniform[:-1], uniform[1:])[0, 1]) < 0.02  # neighbours independent
  assert jitted.captured is not None


def test_each_replay_draws_new_numbers_and_manual_seed_reproduces():
  x = Tensor.zeros(1).contiguous().realize()

  def f(x): return ((Tensor.rand(256) + x).realize(), (Tensor.randn(2, 64) + x).realize())
  Tensor.manual_seed(5)
  first = _draws(f, 6, x)
  for earlier, later in zip(first, first[1:]):
    assert not np.array_equal(earlier, later)
    assert abs(np.corrcoef(earlier[:256], later[:256])[0, 1]) < 0.3  # replays are not shifted copies either
  Tensor.manual_seed(5)
  assert all(np.array_equal(a, b) for a, b in zip(first, _draws(f, 6, x)))
  Tensor.manual_seed(6)
  assert not any(np.array_equal(a, b) for a, b in zip(first, _draws(f, 6, x)))


def test_manual_seed_reaches_an_existing_capture():
  x = Tensor.zeros(8).contiguous().realize()
  jitted = TinyJit(lambda x: (Tensor.rand(8) + x).realize())
  for _ in range(3): jitted(x)
  Tensor.manual_seed(11)
  values = [jitted(x).numpy() for _ in range(3)]
  Tensor.manual_seed(11)
  assert all(np.array_equal(a, jitted(x).numpy()) for a in values)


def test_randint_uniform_normal_inside_jit():
  Tensor.manual_seed(2)
  x = Tensor.zeros(1).contiguous().realize()

  def f(x):
    return ((Tensor.randint(3, 9, size=(20_000,)) + x).realize(), (Tensor.uniform(20_000, low=-2.0, high=3.0) + x)
            .realize(), (Tensor.normal(20_000, mean=4.0, std=0.5) + x).realize())
  jitted = TinyJit(f)
  for _ in range(3):
    ints, uniform, normal = (out.numpy() for out in jitted(x))
    assert set(np.unique(ints).tolist()) == set(range(3, 9))
    assert -2.0 <= uniform.min() and uniform.max() < 3.0 and abs(uniform.mean() - 0.5) < 0.05
    assert abs(normal.mean() - 4.0) < 0.02 and abs(normal.std() - 0.5) < 0.02


def test_jitted_dropout_step_trains_with_fresh_masks():
  """A jitted training step with dropout: each replay zeroes about p of the activations, a different set each time,
  scales the kept ones by 1/(1-p), and the weights still move (the gradient flows through the kept ones)."""
  from ourgrad.nn import Linear
  from ourgrad.nn.optim import SGD
  Tensor.manual_seed(3)
  layer = Linear(32, 64)
  optimizer = SGD([layer.weight, layer.bias], lr=0.01)

  @TinyJit
  def step(x):
    with Tensor.train():
      optimizer.zero_grad()
      before = layer(x)
      after = before.dropout(0.25)
      loss = after.square().mean()
      loss.backward()
      Tensor.realize_all(before, after, loss, *optimizer.schedule_step())
    return before, after
  x = Tensor.randn(16, 32).realize()
  masks, weights = [], [layer.weight.numpy()]
  for _ in range(5):
    before, after = (out.numpy() for out in step(x))
    kept = after != 0
    assert abs(1.0 - kept.mean() - 0.25) < 0.06
    np.testing.assert_allclose(after[kept], before[kept] / 0.75, rtol=1e-5, atol=1e-6)
    masks.append(kept)
    weights.append(layer.weight.numpy())
  assert len({mask.tobytes() for mask in masks}) == 5
  assert all(not np.array_equal(a, b) for a, b in zip(weights, weights[1:]))
  assert step.captured is not None


def test_eager_rand_still_uses_numpy():
  Tensor.manual_seed(3)
  np.testing.assert_array_equal(Tensor.rand(5).numpy(), np.random.default_rng(3).random(5, dtype=np.float32))
