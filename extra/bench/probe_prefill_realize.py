"""What one more realize costs the eager SmolLM2 prefill's host (issue 26): the prefill realizes its residual stream
every PREFILL_REALIZE_EVERY blocks (extra/models/llama.py) so that the device runs those blocks while Python builds
the next ones; each realize beyond the last one is host work that a single realize does not do. This times the host
side of a prefill (Python per call, as bench_eager.py: no wait for the device inside the timed calls; CPU devices: the
thread's CPU time with every compiled kernel a no-op) for K = 0 (one realize) and each K asked, alternated in rounds,
and splits it into bench_eager's phases (cProfile, one profiled round per K). The cost of one more realize is
(host(K) - host(0)) / (the realizes K adds).

Run: `python extra/bench/probe_prefill_realize.py [--device CUDA] [--every 1,2] [--rounds 3] [--calls 5]`; a CPU check:
`--device CLANG --layers 4 --length 32`.
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_eager import PHASES, host_kernels_disabled, phase_seconds  # noqa: E402
from bench_models import SMOLLM2_135M, random_llama_weights  # noqa: E402

import extra.models.llama as llama  # noqa: E402
from ourgrad import Device, Tensor, set_float32_matmul_precision  # noqa: E402


def realizes(layers: int, every: int) -> int:
  """The realizes of one prefill realizing every `every` blocks (0: once at the end)."""
  return 1 + (0 if every <= 0 else (layers - 1) // every)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default=Device.DEFAULT)
  parser.add_argument("--length", type=int, default=0, help="prompt tokens (default: 512 on CUDA, 32 elsewhere)")
  parser.add_argument("--layers", type=int, default=0, help="fewer blocks than SmolLM2's 30")
  parser.add_argument("--every", default="1,2", help="comma-separated K to compare with one realize (K = 0)")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--calls", type=int, default=5, help="prefills per round")
  args = parser.parse_args()
  device = Device.canonicalize(args.device)
  cuda = device == "CUDA"
  length = args.length or (512 if cuda else 32)
  set_float32_matmul_precision("highest")
  config = dataclasses.replace(SMOLLM2_135M, n_layers=args.layers) if args.layers else SMOLLM2_135M
  weights = {name: Tensor(value, device=device) for name, value in random_llama_weights(config).items()}
  Tensor.realize_all(*weights.values())
  model = llama.Llama(config, weights, length + 8, symbolic=False)
  prompt = np.random.default_rng(0).integers(100, config.vocab_size, (1, length)).astype(np.int32)
  sync = Device[device].synchronize
  settings = [0, *(int(value) for value in args.every.split(","))]
  # a CPU device shares its machine: the thread's CPU time; a GPU's host is timed by the wall clock (no wait inside)
  clock = time.perf_counter if cuda else time.thread_time

  def calls(every: int, count: int) -> None:
    llama.PREFILL_REALIZE_EVERY = every
    for _ in range(count): model(prompt, 0)

  for every in settings: calls(every, 3)   # compile, fill the schedule cache, capture
  sync()
  host: dict[int, list[float]] = {every: [] for every in settings}
  phases: dict[int, dict[str, float]] = {}
  with host_kernels_disabled(not cuda):
    for _ in range(args.rounds):
      for every in settings:
        sync()
        start = clock()
        calls(every, args.calls)
        host[every].append((clock() - start) / args.calls)
    for every in settings:
      sync()
      profile = cProfile.Profile()
      start = time.perf_counter()
      profile.enable()
      calls(every, args.calls)
      profile.disable()
      phases[every] = {phase: seconds / args.calls for phase, seconds in
                       phase_seconds(profile, time.perf_counter() - start).items()}
    sync()
  print(f"eager prefill of {length} tokens, {config.n_layers} blocks on {device}: host ms a call "
        f"({'wall clock, no wait' if cuda else 'thread CPU time, kernels no-ops'}), medians of {args.rounds} rounds")
  base = statistics.median(host[0])
  for every in settings:
    value = statistics.median(host[every])
    extra = realizes(config.n_layers, every) - 1
    per = f", {(value - base) / extra * 1e6:7.1f} us per added realize" if extra else ""
    print(f"  every {every}: {realizes(config.n_layers, every):3d} realizes {value * 1e3:8.2f} ms{per}")
  print("profiled us a call per phase (cProfile inflates each; compare rows):")
  print("| phase    | " + " | ".join(f"every {every:<3d}" for every in settings) + " |")
  print("| -------- | " + " | ".join("---------" for _ in settings) + " |")
  for phase in PHASES:
    print(f"| {phase:<8} | " + " | ".join(f"{phases[every][phase] * 1e6:9.0f}" for every in settings) + " |")


if __name__ == "__main__":
  main()
