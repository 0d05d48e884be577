"""TinyJit with symbolic Variables: an LLM-style decode loop (a 4-layer toy transformer with a KV cache) whose
position is a bound Variable compiles each kernel once, not once per position, and replays without recapture.

The reference is the same model run eagerly with the position as a plain int (every position its own kernels), and
numpy for the small jitted function. extra/bench/bench_jit.py loads ToyDecoder from here for its decode row."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ourgrad import Tensor, TinyJit
from ourgrad.errors import JitError
from ourgrad.shape import Variable


class ToyDecoder:
  """A pre-norm-free toy transformer decoder: per layer single-token attention over a KV cache, then a ReLU MLP.
  `step(x, pos)` takes the token's embedding (1, dim) and the position (an int or a bound Variable), writes this
  token's key and value into row `pos` of each layer's cache and returns the (1, dim) output."""

  def __init__(self, layers: int = 4, dim: int = 16, heads: int = 2, max_len: int = 100, seed: int = 0):
    rng = np.random.default_rng(seed)
    self.dim, self.heads, self.head_dim, self.max_len = dim, heads, dim // heads, max_len

    def weight(rows: int, cols: int) -> Tensor:
      return Tensor((rng.standard_normal((rows, cols)) / math.sqrt(rows)).astype(np.float32))

    self.layers = [{name: weight(dim, dim) for name in ("wq", "wk", "wv", "wo")} | {"w1": weight(dim, 2 * dim),
                   "w2": weight(2 * dim, dim)} for _ in range(layers)]
    self.key_caches = [Tensor.zeros(max_len, dim).contiguous().realize() for _ in range(layers)]
    self.value_caches = [Tensor.zeros(max_len, dim).contiguous().realize() for _ in range(layers)]

  def _write(self, cache: Tensor, row: Tensor, pos) -> None:
    """cache[pos] = row, as a whole-buffer assign: the row padded to the cache's length (zeros elsewhere) is added
    to a cache whose row `pos` is still zero."""
    cache.assign(cache + row.pad(((pos, self.max_len - 1 - pos), None))).realize()

  def step(self, x: Tensor, pos) -> Tensor:
    heads, head_dim = self.heads, self.head_dim
    for layer, key_cache, value_cache in zip(self.layers, self.key_caches, self.value_caches):
      q, k, v = x @ layer["wq"], x @ layer["wk"], x @ layer["wv"]
      self._write(key_cache, k, pos)
      self._write(value_cache, v, pos)
      keys = key_cache.shrink(((0, pos + 1), None)).reshape(pos + 1, heads, head_dim).permute(1, 0, 2)
      values = value_cache.shrink(((0, pos + 1), None)).reshape(pos + 1, heads, head_dim).permute(1, 0, 2)
      scores = (q.reshape(heads, 1, head_dim) @ keys.transpose(1, 2)) * (1 / math.sqrt(head_dim))
      attended = (scores.softmax(-1) @ values).reshape(1, self.dim)
      x = x + attended @ layer["wo"]
      x = x + (x @ layer["w1"]).relu() @ layer["w2"]
    return x


@pytest.fixture(autouse=True)
def _no_cuda_render_check(monkeypatch):
  """CHECK_CUDA_RENDER (test/conftest.py) applies the hand-coded optimizations, which symbolic kernels skip; their
  CUDA rendering is checked here by test_symbolic_shapes.py::test_cuda_source_compiles_with_nvrtc instead."""
  monkeypatch.delenv("CHECK_CUDA_RENDER", raising=False)



def _tokens(count: int, dim: int) -> np.ndarray:
  return np.random.default_rng(1).standard_normal((count, dim)).astype(np.float32)


def test_jit_replays_new_variable_values(compiles):
  data = np.random.default_rng(2).standard_normal((64, 8)).astype(np.float32)
  weights = Tensor(data)

  @TinyJit
  def window_dot(x: Tensor, n) -> Tensor:
    return (weights.shrink(((0, n), None)) * x).sum(1) + 1

  n = Variable("n", 1, 64)
  for value in range(1, 21):
    x = np.random.default_rng(value).standard_normal(8).astype(np.float32)
    out = window_dot(Tensor(x), n.bind(value))
    assert out.shape == (n.bind(value),)
    np.testing.assert_allclose(out.numpy(), (data[:value] * x).sum(1) + 1, rtol=1e-5, atol=1e-5)
  assert window_dot.call_count == 20 and window_dot.captured is not None
  assert len(compiles) == 1, compiles


def test_jit_input_with_symbolic_shape(compiles):
  data = np.random.default_rng(3).standard_normal((32, 4)).astype(np.float32)
  source = Tensor(data)

  @TinyJit
  def double_sum(x: Tensor) -> Tensor:
    return (x * 2).sum(0)

  n = Variable("n", 1, 32)
  for value in (3, 9, 4, 30):
    window = source.shrink(((0, n.bind(value)), None)).contiguous().realize()
    np.testing.assert_allclose(double_sum(window).numpy(), (data[:value] * 2).sum(0), rtol=1e-5, atol=1e-5)
  assert double_sum.captured is not None
  # the contiguous copies compile once, the jitted sum once: no kernel per value
  assert len(compiles) == 2, compiles


def test_jit_rejects_another_variable_range():
  weights = Tensor(np.ones((16, 2), np.float32))

  @TinyJit
  def window_sum(n) -> Tensor: return weights.shrink(((0, n), None)).sum(0) * 1

  for value in (2, 3): window_sum(Variable("n", 1, 16).bind(value))
  with pytest.raises(JitError): window_sum(Variable("n", 1, 8).bind(2))


def numpy_decode(model: ToyDecoder, tokens: np.ndarray) -> list[np.ndarray]:
  """The same decoder in numpy (weights read from the model before it runs): the independent reference."""
  weights = [{name: tensor.numpy() for name, tensor in layer.items()} for layer in model.layers]
  key_caches = [np.zeros((model.max_len, model.dim), np.float32) for _ in weights]
  value_caches = [np.zeros((model.max_len, model.dim), np.float32) for _ in weights]
  heads, head_dim, outputs = model.heads, model.head_dim, []
  for pos, token in enumerate(tokens):
    x = token[None, :]
    for layer, key_cache, value_cache in zip(weights, key_caches, value_caches):
      q = x @ layer["wq"]
      key_cache[pos], value_cache[pos] = (x @ layer["wk"])[0], (x @ layer["wv"])[0]
      keys = key_cache[:pos + 1].reshape(pos + 1, heads, head_dim).transpose(1, 0, 2)
      values = value_cache[:pos + 1].reshape(pos + 1, heads, head_dim).transpose(1, 0, 2)
      scores = q.reshape(heads, 1, head_dim) @ keys.transpose(0, 2, 1) / math.sqrt(head_dim)
      scores = np.exp(scores - scores.max(-1, keepdims=True))
      attended = ((scores / scores.sum(-1, keepdims=True)) @ values).reshape(1, model.dim)
      x = x + attended @ layer["wo"]
      x = x + np.maximum(x @ layer["w1"], 0) @ layer["w2"]
    outputs.append(x)
  return outputs


def test_toy_transformer_decode_compiles_once(compiles):
  positions = 100
  model = ToyDecoder(max_len=positions, seed=7)
  tokens = _tokens(positions, model.dim)
  expected = numpy_decode(model, tokens)
  decode = TinyJit(model.step)
  pos_var = Variable("pos", 0, positions - 1)
  outputs = []
  for pos in range(positions):
    outputs.append(decode(Tensor(tokens[pos:pos + 1]), pos_var.bind(pos)).numpy())
    if pos == 0: compiles_on_first_call = len(compiles)
  assert decode.captured is not None
  # every kernel compiled on the first call (position 0); positions 1..99 (capture, replays) compiled nothing
  assert compiles_on_first_call > 0 and len(compiles) == compiles_on_first_call, compiles
  for pos in range(positions): np.testing.assert_allclose(outputs[pos], expected[pos], rtol=1e-4, atol=1e-4)


def test_symbolic_decode_matches_non_symbolic_eager(compiles):
  """The same steps eagerly with the position as a plain int (its own kernels at each position) give the same
  outputs; those position-dependent kernels compile again at every position, the symbolic ones do not."""
  positions = 4
  symbolic, plain = ToyDecoder(max_len=16, seed=8), ToyDecoder(max_len=16, seed=8)
  tokens = _tokens(positions, symbolic.dim)
  pos_var = Variable("pos", 0, 15)
  for pos in range(positions):
    token = tokens[pos:pos + 1]
    before = len(compiles)
    got = symbolic.step(Tensor(token), pos_var.bind(pos)).numpy()
    symbolic_compiles = len(compiles) - before
    before = len(compiles)
    want = plain.step(Tensor(token), pos).numpy()
    plain_compiles = len(compiles) - before
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if pos >= 2: assert symbolic_compiles == 0 and plain_compiles > 0, (symbolic_compiles, plain_compiles)
