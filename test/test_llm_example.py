"""examples/llm.py's reporting on a stand-in chat model (no weights): every generated token is counted, the first
apart (time to first token) from the rest (decode tokens/s), and a batch answers each prompt in a fresh conversation."""
from __future__ import annotations

import importlib.util
import pathlib
import re
import sys
from typing import Any, Iterator

import pytest

from extra.models.generate import Sampler

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _llm_example() -> Any:
  spec = importlib.util.spec_from_file_location("example_llm", ROOT / "examples" / "llm.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclass looks its module up there
  spec.loader.exec_module(module)
  return module


class FakeChat:
  """What examples/llm.py uses of ChatModel: the conversation position, pending tokens, the count of generated tokens,
  and continue_stream. Each reply is `pieces`; a piece "" stands for a token held back (mid-character)."""

  def __init__(self, pieces: list[str]):
    self.pieces, self.position, self.pending, self.generated, self.texts = pieces, 5, [1], 0, []

  def continue_stream(self, text: str, sampler: Sampler, max_tokens: int) -> Iterator[str]:
    self.texts.append((text, self.position, list(self.pending)))
    for piece in self.pieces[:max_tokens]:
      self.generated += 1
      if piece: yield piece


def test_stream_counts_every_token(capsys: pytest.CaptureFixture[str]) -> None:
  llm = _llm_example()
  chat = FakeChat(["The", " capital", "", " is", " Paris", "."])
  stats = llm.stream(chat, "prompt", Sampler(temperature=0), 32, fresh=True, first_reply=True)
  assert stats.tokens == 6  # the held-back token counts too
  assert stats.first_token_s >= 0 and stats.decode_s >= 0
  assert chat.texts == [("prompt", 0, [])]  # fresh: a new conversation
  out = capsys.readouterr()
  assert out.out == "The capital is Paris.\n"
  assert "[6 tokens; first after" in out.err and "then 5 in" in out.err and "first output" in out.err
  assert "; steady " in out.err   # the median pace between tokens, beside the rate that counts every one
  # the first output's time counts from before ourgrad's import (the module's start), beside the process's CPU time
  assert re.search(r"\[first output \d+\.\d s after start, \d+\.\d s of CPU\]", out.err), out.err


def test_batch_answers_each_prompt_fresh(capsys: pytest.CaptureFixture[str]) -> None:
  llm = _llm_example()
  chat = FakeChat(["Yes", "."])
  llm.batch(chat, ["one?", "two?"], "system text", Sampler(temperature=0), 8)
  assert len(chat.texts) == 2 and all(position == 0 and pending == [] for _, position, pending in chat.texts)
  assert "one?" in chat.texts[0][0] and "two?" in chat.texts[1][0] and "system text" in chat.texts[1][0]
  out = capsys.readouterr()
  assert out.out.count("Yes.") == 2 and "[2/2] two?" in out.out
  assert "[batch of 2 prompts: 4 tokens;" in out.err


def test_prompts_context_fits_the_longest_reply() -> None:
  """--prompt without --max-context: the cache holds the longest prompt and its reply, rounded up to a power of two
  (at least 64); a fixed-shape decode step attends over all of it."""
  llm = _llm_example()
  assert llm.prompts_context([38], 32) == 128 and llm.prompts_context([38, 12], 256) == 512
  assert llm.prompts_context([10], 5) == 64 and llm.prompts_context([64], 64) == 128
