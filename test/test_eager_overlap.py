"""Realizes that let the device work while Python builds the rest of a step (issue 26): a realize of new work beside
outputs realized before is found by the creation trace (no graph walk), an eager backward() of a large graph realizes
its loss first (OVERLAP_BACKWARD), and an eager Llama prefill realizes its residual stream every few blocks. Each
against numpy or the path without it, with its kernel counts."""
import numpy as np
import pytest

import ourgrad.engine.schedule_cache as schedule_cache
from ourgrad import GlobalCounters, Tensor, TinyJit
from ourgrad.nn import LayerNorm, Linear
from ourgrad.nn.losses import cross_entropy
from ourgrad.nn.optim import Adam
from ourgrad.nn.state import get_parameters


def test_new_work_realized_beside_realized_outputs_is_found_by_the_trace():
  """A model realizing its state as it goes (each block's output with the results so far): the realized outputs add
  nothing to the schedule, and the new work is found by its creation trace from the second block on."""
  rng = np.random.default_rng(0)
  weights = [rng.standard_normal(8).astype(np.float32) for _ in range(6)]
  x_values = rng.standard_normal(8).astype(np.float32)
  x, expected = Tensor(x_values).realize(), x_values
  done: list[Tensor] = []
  traced_before = schedule_cache.stats.traced_hits
  for weight in weights:
    x = (x * Tensor(weight) + 1).relu() + x
    expected = np.maximum(expected * weight + 1, 0) + expected
    Tensor.realize_all(x, *done)   # the earlier results are realized already
    done.append(x)
    np.testing.assert_allclose(x.numpy(), expected, rtol=1e-6)
  assert schedule_cache.stats.traced_hits - traced_before >= len(weights) - 2
  # realizing only what is realized already schedules nothing
  GlobalCounters.reset()
  Tensor.realize_all(*done)
  assert GlobalCounters.kernel_count == 0


class _Net:
  def __init__(self) -> None:
    self.layers = [Linear(12, 16), Linear(16, 16), Linear(16, 4)]
    self.norm = LayerNorm(16)

  def __call__(self, x: Tensor) -> Tensor:
    for layer in self.layers[:-1]: x = self.norm(layer(x).relu())
    return self.layers[-1](x)


def _training(seen: list[bool] | None = None):
  Tensor.manual_seed(5)
  model = _Net()
  optimizer = Adam(get_parameters(model), lr=0.01)

  def step(x: Tensor, y: Tensor) -> Tensor:
    with Tensor.train():
      optimizer.zero_grad()
      loss = cross_entropy(model(x), y)
      loss.backward()
      if seen is not None: seen.append(loss.lazydata.base.realized is not None)
      Tensor.realize_all(loss, *optimizer.schedule_step())
    return loss
  return model, step


def _batches(count: int) -> list[tuple[np.ndarray, np.ndarray]]:
  rng = np.random.default_rng(3)
  return [(rng.standard_normal((6, 12)).astype(np.float32), rng.integers(0, 4, 6).astype(np.int32))
          for _ in range(count)]


def test_backward_realizes_a_large_forward_first_with_identical_steps(monkeypatch):
  """OVERLAP_BACKWARD=n: an eager backward() whose pending graph holds at least n bases realizes the loss before
  building the backward graph. The same losses as steps without it, parameters to float32 rounding, and TinyJit's
  steps unchanged (it never splits its step: the same captured kernels and losses with either setting); the split
  costs at most 4 kernels a step here."""
  from ourgrad.engine import realize
  # (a host device runs each kernel as it is launched, where launching early gains nothing: CLANG here stands for a
  # device that queues its kernels, CUDA's behaviour)
  monkeypatch.setattr(realize, "queues_work", lambda device: True)
  batches = _batches(4)
  results: dict[str, tuple[list[bytes], list[bytes], list[int]]] = {}
  for setting in ("0", "1"):
    monkeypatch.setenv("OVERLAP_BACKWARD", setting)
    seen: list[bool] = []
    model, step = _training(seen)
    losses, kernels = [], []
    for images, labels in batches:
      GlobalCounters.reset()
      losses.append(step(Tensor(images).realize(), Tensor(labels).realize()).numpy().tobytes())
      kernels.append(GlobalCounters.kernel_count)
    assert seen == [setting == "1"] * len(batches)   # the loss was realized before the optimizer's realize
    results[setting] = (losses, [p.numpy().tobytes() for p in get_parameters(model)], kernels)
  # the same losses; the parameters agree to float32 rounding, not bit for bit: the backward's kernels fuse what the
  # split forward did not store (a layer norm's normalized values, recomputed), which rounds some sums differently
  # (the first step's loss bit for bit; later losses are computed from those parameters, so they agree to rounding)
  assert results["1"][0][0] == results["0"][0][0]
  np.testing.assert_allclose(np.frombuffer(b"".join(results["1"][0]), np.float32),
                             np.frombuffer(b"".join(results["0"][0]), np.float32), rtol=1e-5, atol=1e-6)
  for split, joint in zip(results["1"][1], results["0"][1]):
    np.testing.assert_allclose(np.frombuffer(split, np.float32), np.frombuffer(joint, np.float32), rtol=1e-5,
                               atol=1e-6)
  # (28 kernels a step joint, 32 split on CLANG: the backward recomputes the two layer norms' statistics' uses)
  assert all(split <= joint + 4 for split, joint in zip(results["1"][2], results["0"][2]))
  captured = {}
  for setting in ("0", "1"):
    monkeypatch.setenv("OVERLAP_BACKWARD", setting)
    model, plain = _training()
    jitted = TinyJit(plain)
    losses = [jitted(Tensor(images), Tensor(labels)).numpy().tobytes() for images, labels in batches]
    assert losses == results["0"][0]
    captured[setting] = len(jitted.captured.items)
  assert captured["0"] == captured["1"]


def test_backward_is_split_only_for_a_large_graph_on_a_device_that_queues_its_kernels(monkeypatch):
  from ourgrad.engine import realize
  monkeypatch.delenv("OVERLAP_BACKWARD", raising=False)
  assert not realize.queues_work("CLANG") and not realize.queues_work("PYTHON")   # host devices: never split
  images, labels = _batches(1)[0]
  for queues, bound, split in ((False, "1", False), (True, None, False), (True, "1", True)):
    monkeypatch.setattr(realize, "queues_work", lambda device, queues=queues: queues)
    if bound is None: monkeypatch.delenv("OVERLAP_BACKWARD", raising=False)
    else: monkeypatch.setenv("OVERLAP_BACKWARD", bound)
    seen: list[bool] = []
    _, step = _training(seen)
    step(Tensor(images).realize(), Tensor(labels).realize())
    # (off by default: a loop of steps lost more host time than the device gained, docs/jit.md)
    assert seen == [split], (queues, bound)


@pytest.mark.parametrize("every", [1, 2])
def test_llama_prefill_realized_every_few_blocks_is_identical(every):
  """An eager prefill that realizes its residual stream every `every` blocks: the same logits and caches, bit for bit,
  as one realize at the end, and the same kernels (the residual is stored between blocks either way)."""
  import extra.models.llama as llama
  config = llama.LlamaConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=48, vocab_size=40,
                             norm_eps=1e-5, rope_theta=10000.0, context_length=16)
  rng = np.random.default_rng(1)
  kv = config.n_kv_heads * config.head_dim
  shapes = {"token_embd.weight": (config.vocab_size, config.dim), "output_norm.weight": (config.dim,)}
  for n in range(config.n_layers):
    shapes.update({f"blk.{n}.attn_norm.weight": (config.dim,), f"blk.{n}.ffn_norm.weight": (config.dim,),
                   f"blk.{n}.attn_q.weight": (config.dim, config.dim), f"blk.{n}.attn_k.weight": (kv, config.dim),
                   f"blk.{n}.attn_v.weight": (kv, config.dim), f"blk.{n}.attn_output.weight": (config.dim, config.dim),
                   f"blk.{n}.ffn_gate.weight": (config.hidden_dim, config.dim),
                   f"blk.{n}.ffn_up.weight": (config.hidden_dim, config.dim),
                   f"blk.{n}.ffn_down.weight": (config.dim, config.hidden_dim)})
  weights = {name: (rng.standard_normal(shape) / 4).astype(np.float32) for name, shape in shapes.items()}
  prompt = rng.integers(0, config.vocab_size, (1, 6)).astype(np.int32)
  outcome = {}
  for setting in (0, every):
    model = llama.Llama(config, {name: Tensor(value) for name, value in weights.items()}, max_context=16)
    before = llama.PREFILL_REALIZE_EVERY
    llama.PREFILL_REALIZE_EVERY = setting
    try:
      model(prompt, 0).numpy()
      GlobalCounters.reset()
      logits = model(prompt[:, :4], 6).numpy()
      outcome[setting] = (logits.tobytes(), [block.cache.numpy().tobytes() for block in model.blocks],
                          GlobalCounters.kernel_count)
    finally:
      llama.PREFILL_REALIZE_EVERY = before
  assert outcome[every] == outcome[0]


def test_pending_counts_the_bases_made_since_the_last_schedule():
  from ourgrad import lazy_trace
  x = Tensor(np.arange(4, dtype=np.float32)).realize()
  assert lazy_trace.pending() == 0
  y = (x + 1) * 2
  assert lazy_trace.pending() == 2   # (the constants are no traced bases)
  y = y.exp2()
  assert lazy_trace.pending() == 3
  np.testing.assert_allclose(y.numpy(), np.exp2((np.arange(4) + 1) * 2), rtol=1e-6)
  assert lazy_trace.pending() == 0
