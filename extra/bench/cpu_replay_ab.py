"""A/B of how a captured CPU decode step is replayed, in one process: the loop of ctypes calls (ItemReplay, what
TinyJit did on CLANG before runtime/host_calls.py) against the capture's own replay (the dispatcher's one C call).

Both replay the same captured kernels (SmolLM2's greedy decode step, fixed shapes, 520 slots: the installed GGUF's
stored weights with `--weights stored`, else random Q8_0 weights as profile_models.py makes them), alternately
(A B, B A, ...), each with its Variable update (the slots in use change every step): the medians of this thread's CPU
time and of wall time per step, the median of the per-round ratios B / A, and whether their logits are bit-identical.

    OMP_NUM_THREADS=2 PYTHONPATH=. python extra/bench/cpu_replay_ab.py --rounds 40
"""
from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from ourgrad.engine.jit import ItemReplay  # noqa: E402

from extra.models.generate import smollm2_path  # noqa: E402
from extra.models.llama import Llama  # noqa: E402
from profile_models import random_weight_llama  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--weights", default="q8_0", choices=("q8_0", "stored"))
  parser.add_argument("--rounds", type=int, default=30, help="A/B pairs of whole-step replays")
  parser.add_argument("--layers", type=int, default=0, help="fewer layers (random weights); 0: the model's")
  args = parser.parse_args()
  if args.weights == "stored":
    model, _ = Llama.from_gguf(smollm2_path(), 520, "CLANG", symbolic=False, dtype="stored")
  else:
    model = random_weight_llama(argparse.Namespace(device="CLANG", layers=args.layers, weights="q8_0", context=520,
                                                   sequences=1))
  for position in range(8, 12): model.decode_greedy([5], [position])   # eager, capture, replays
  captured = model._greedy_jit.captured
  assert captured is not None
  replays = {"A": ItemReplay(captured.items), "B": captured.replay_runner}
  print(f"{len(captured.items)} kernels; A: {type(replays['A']).__name__}, B: {type(replays['B']).__name__} "
        f"({type(getattr(replays['B'], 'graph', None)).__name__}); OMP_NUM_THREADS="
        f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, load average {os.getloadavg()[0]:.2f}")
  logits_item = max(captured.items, key=lambda item: item.bufs[0].nbytes)   # the vocabulary's logits
  outputs = {}
  for name, replay in replays.items():
    replay.set_var_vals({"used": 13})
    replay.run()
    outputs[name] = logits_item.bufs[0].numpy().copy()
  print(f"B's logits equal A's bit for bit: {np.array_equal(outputs['A'], outputs['B'])}")
  cpu: dict[str, list[float]] = {"A": [], "B": []}
  wall: dict[str, list[float]] = {"A": [], "B": []}
  for round_number in range(args.rounds):
    for name in ("AB" if round_number % 2 == 0 else "BA"):
      replay = replays[name]
      started_cpu, started_wall = time.thread_time(), time.perf_counter()
      replay.set_var_vals({"used": 13 + round_number % 50})
      replay.run()
      cpu[name].append(time.thread_time() - started_cpu)
      wall[name].append(time.perf_counter() - started_wall)
  for label, times in (("thread CPU", cpu), ("wall", wall)):
    ratios = [b / a for a, b in zip(times["A"], times["B"])]
    print(f"{label}: A median {statistics.median(times['A']) * 1e3:.3f} ms (min {min(times['A']) * 1e3:.3f}), "
          f"B median {statistics.median(times['B']) * 1e3:.3f} ms (min {min(times['B']) * 1e3:.3f}); "
          f"B / A per round: median {statistics.median(ratios):.3f}")
  print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
  main()
