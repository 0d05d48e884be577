"""What a reply costs before it streams (extra/models/llama.py, generate.py, examples/llm.py): a decode step's first
call and its capture schedule one block, not all of them, and the capture finds the first call's schedule cached;
a reply's first decode step runs before its first token is shown; the replies stay the full forward's (PyTorch) and
llm.py prints exactly the tokens `generate` gives."""
from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import sys
from typing import Any

import numpy as np
import pytest

from ourgrad import Tensor, dtypes
from ourgrad.engine import schedule as scheduler
from ourgrad.engine import schedule_cache

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # extra/ lives at the repository root
from extra.models import llama  # noqa: E402
from extra.models.generate import ChatModel, Sampler  # noqa: E402
from test_models import TINY, _no_cuda_render_check, _tiny_weights, torch_llama_logits  # noqa: E402,F401

# (block 0 reads the embedding and the last one feeds the logits: their schedules differ from the middle blocks', so
# only from 4 blocks on does a block replay another's)
FOUR_LAYERS = dataclasses.replace(TINY, n_layers=4)
pytestmark = pytest.mark.usefixtures("_no_cuda_render_check")   # (test_models.py's)


def _model(weights: dict[str, np.ndarray], config: Any = FOUR_LAYERS, max_context: int = 19) -> llama.Llama:
  """A fixed-shape model (llm.py's kind) of an unusual cache size, whose graphs no other test's schedules match."""
  return llama.Llama(config, {name: Tensor(value) for name, value in weights.items()}, max_context=max_context,
                     symbolic=False)


def _greedy_reference(weights: dict[str, np.ndarray], config: Any, tokens: list[int], count: int) -> list[int]:
  history, picked = list(tokens), []
  for _ in range(count):
    picked.append(int(torch_llama_logits(weights, config, history)[-1].argmax()))
    history.append(picked[-1])
  return picked


def _decode_steps(model: llama.Llama, tokens: list[int]) -> tuple[np.ndarray, int]:
  """(the logits of a 3-token prompt and of each later token fed by jitted decode steps, the captured kernels)."""
  got = [model(Tensor([tokens[:3]], dtype=dtypes.int32), 0).numpy()[0]]
  got += [model.decode(tokens[position], position).numpy()[0] for position in range(3, len(tokens))]
  assert model._decode_jit.captured is not None
  return np.stack(got), len(model._decode_jit.captured.items)


def test_decode_realized_per_block_keeps_kernels_and_logits(monkeypatch) -> None:
  """DECODE_REALIZE_EVERY = 1 (the residual realized after each block as the step's graph is built) captures as many
  kernels as one realize of the whole step, and the same logits bit for bit: the residual is stored between blocks
  either way. Both are the full forward's (PyTorch)."""
  weights = _tiny_weights(FOUR_LAYERS, seed=21)
  tokens = [4, 9, 31, 2, 17, 40, 1]
  runs = {}
  for every in (0, 1):
    monkeypatch.setattr(llama, "DECODE_REALIZE_EVERY", every)
    runs[every] = _decode_steps(_model(weights), tokens)
  assert runs[0][1] == runs[1][1]
  np.testing.assert_array_equal(runs[0][0], runs[1][0])
  np.testing.assert_allclose(runs[1][0], torch_llama_logits(weights, FOUR_LAYERS, tokens)[2:], rtol=1e-4, atol=1e-4)


def test_jitted_prefill_realized_every_two_blocks_keeps_kernels_and_logits(monkeypatch) -> None:
  """A jitted prefill's first call and capture realize the residual every PREFILL_REALIZE_EVERY blocks (as the eager
  prefill does): the capture holds as many kernels as with one realize, and every call's logits are the same bit for
  bit, and the full forward's (PyTorch)."""
  weights = _tiny_weights(FOUR_LAYERS, seed=31)
  prompts = [[4, 9, 31], [2, 17, 40, 1], [7, 3]]
  runs = {}
  for every in (0, 2):
    monkeypatch.setattr(llama, "PREFILL_REALIZE_EVERY", every)
    model = _model(weights, max_context=23)
    logits = [model(Tensor([prompt], dtype=dtypes.int32), 0, jit=True).numpy()[0] for prompt in prompts]
    jit = model.prefill_jit_for(0, 3)
    assert jit.captured is not None
    runs[every] = (np.stack(logits), len(jit.captured.items))
  assert runs[0][1] == runs[2][1]
  np.testing.assert_array_equal(runs[0][0], runs[2][0])
  expected = np.stack([torch_llama_logits(weights, FOUR_LAYERS, prompt)[-1] for prompt in prompts])
  np.testing.assert_allclose(runs[2][0], expected, rtol=1e-4, atol=1e-4)


def test_decode_first_call_schedules_one_block_and_capture_reuses_it(monkeypatch) -> None:
  """A decode step's first call (eager) builds the schedule of fewer kernels than the step runs (the blocks after the
  first replay its cached schedule), and its capture, one position on, builds none: the first call bound `used` to
  the slots the capture needs, so the schedule cache's key (which holds the bound value) is the same."""
  built: list[int] = []
  original = scheduler.build_schedule

  def counting(outs: Any) -> Any:
    items, assigns = original(outs)
    built.append(len(items))
    return items, assigns
  monkeypatch.setattr(scheduler, "build_schedule", counting)
  weights = _tiny_weights(FOUR_LAYERS, seed=23)
  model = _model(weights, max_context=21)
  model(Tensor([[4, 9, 31]], dtype=dtypes.int32), 0).numpy()
  built.clear()
  model.decode_greedy(7, 3)
  first_call = sum(built)
  built.clear()
  model.decode_greedy(8, 4)   # the capture
  assert model._greedy_jit.captured is not None
  assert built == [], built
  assert 0 < first_call < len(model._greedy_jit.captured.items), (first_call, len(model._greedy_jit.captured.items))
  # the same for the steps fed back on the device (`stream_greedy`, llm.py's greedy replies)
  misses = schedule_cache.stats.misses
  list(model.stream_greedy(5, 5, 4))
  assert model._resident_jit.captured is not None and built and schedule_cache.stats.misses - misses == len(built)
  first_stream = list(built)
  built.clear()
  list(model.stream_greedy(6, 9, 3))   # replays
  assert built == [] and sum(first_stream) < len(model._resident_jit.captured.items), first_stream


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy_streamed", "sampled"])
def test_first_token_shows_before_the_first_decode_step(temperature: float) -> None:
  """`ChatModel.generate` yields the reply's first token before it runs the first decode step (a process's first
  reply captures the step between its first and second tokens, so the first output comes early); the tokens are
  those of the full forward (greedy) or of the eager steps with the same seed (sampled: the sampler draws in the
  same order)."""
  weights = _tiny_weights(FOUR_LAYERS, seed=27)
  prompt = [3, 14, 15, 9, 26]
  chat = ChatModel(_model(weights), _NoTokenizer(), {}, stepped_prompt_tokens=0)
  replies = chat.generate(prompt, Sampler(temperature, seed=5), 5)
  first = next(replies)
  assert chat.model._resident_jit.captured is None and chat.model._decode_jit.call_count == 0   # no step ran yet
  got = [first] + list(replies)
  if temperature == 0:
    assert got == _greedy_reference(weights, FOUR_LAYERS, prompt, 5)
  else:
    eager = ChatModel(_model(weights), _NoTokenizer(), {}, jit=False, stepped_prompt_tokens=0)
    assert got == list(eager.generate(prompt, Sampler(temperature, seed=5), 5))
  assert chat.position == len(prompt) + 4 and chat.pending == [got[-1]]


class _NoTokenizer:
  """What ChatModel reads of a tokenizer when only `generate` (token ids in and out) is used: its vocabulary."""
  vocab: dict[str, int] = {}


class _LetterTokenizer:
  """A stand-in tokenizer: one token per character of the text (its code modulo the vocabulary), each token
  decoded as `<id>` (so printed text shows the ids)."""
  vocab: dict[str, int] = {}

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def encode(self, text: str) -> list[int]: return [ord(char) % self.vocab_size for char in text]

  def decode_bytes(self, ids: list[int]) -> bytes: return "".join(f"<{token}>" for token in ids).encode()


def _llm_example() -> Any:
  spec = importlib.util.spec_from_file_location("example_llm_stream", ROOT / "examples" / "llm.py")
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def test_llm_prints_the_greedy_tokens_of_the_full_forward(capsys: pytest.CaptureFixture[str]) -> None:
  """examples/llm.py's `stream` on a small model prints exactly the greedy tokens of the full forward (PyTorch), in a
  process's first reply (the step captured before the first token) and in a fresh second one (replayed)."""
  llm = _llm_example()
  weights = _tiny_weights(FOUR_LAYERS, seed=29)
  tokenizer = _LetterTokenizer(FOUR_LAYERS.vocab_size)
  chat = ChatModel(_model(weights, max_context=22), tokenizer, {}, stepped_prompt_tokens=0)
  for text in ("hi!", "sea"):
    stats = llm.stream(chat, text, Sampler(temperature=0), 6, fresh=True, first_reply=text == "hi!")
    expected = _greedy_reference(weights, FOUR_LAYERS, tokenizer.encode(text), 6)
    assert capsys.readouterr().out == "".join(f"<{token}>" for token in expected) + "\n"
    assert stats.tokens == 6
