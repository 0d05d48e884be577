"""What compiling costs a BEAM search of the 1024^3 float32 matmul for CUDA, measured on any machine (no GPU):
the candidates are the search's own, rendered for sm_90 and compiled with NVRTC; only the device timings are fake.

    python extra/bench/beam_compile_cost.py                      # search replay: one row per round
    python extra/bench/beam_compile_cost.py --workers 1 2 16     # the same replay with each pool size
    python extra/bench/beam_compile_cost.py --budget 0           # without the time budget (every round runs)
    python extra/bench/beam_compile_cost.py --split              # seconds per step of one compile, round by round

Methodology
- The kernel is the matmul's schedule item with the CUDA renderer (sm_90, 132 multiprocessors: the H100's); the
  compiler is the CUDA device's (NVRTC to CUBIN). beam_search runs as on the GPU (width 2, its pool of forked
  workers, BEAM_TIME_BUDGET from --budget), with search.Device replaced by a stand-in whose programs return a
  fake time: each added Opt makes a kernel 10% faster, +-25% by a hash of its Opts, so the search keeps finding
  gains and runs its rounds (the worst case for compile cost; the H100's real search follows other timings).
- Columns: the round's candidates, the wall seconds of compiling them, the CPU seconds (the candidates' own
  compile times summed: over the wall seconds it is the pool's parallelism), the slowest candidate's compile.
- --split: for the winner's Opts up to each round (a candidate of that round's size), seconds of lowering
  (linearize), rendering and NVRTC, compiled alone.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def matmul_kernel(size: int) -> Any:
  from ourgrad import Tensor
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.engine.schedule import create_schedule
  from ourgrad.ops import Ops
  from ourgrad.renderer.cuda import CUDARenderer
  a, b = Tensor.empty(size, size), Tensor.empty(size, size)
  item = [item for item in create_schedule([(a @ b).lazydata]) if item.ast.op is Ops.STORE][-1]
  return Kernel(item.ast, CUDARenderer("sm_90"))


def fake_time(program: Any, handles: Any, candidate: Any, cutoff: float, warmup: bool = False) -> float:
  spread = int(hashlib.sha256(repr(candidate.opts).encode()).hexdigest()[:8], 16) / 2**32
  return 1e-4 * 0.9 ** len(candidate.opts) * (0.75 + 0.5 * spread)


def replay(size: int, workers: int) -> tuple[Any, Any]:
  """One search with fake timings: its SearchStats and the kernel it returned."""
  from ourgrad.codegen.opt import search
  from ourgrad.runtime.ops_cuda import CUDACompiler
  search.Device = {"CUDA": SimpleNamespace(compiler=CUDACompiler("sm_90"), program=lambda name, binary: None)}
  search.time_program = fake_time
  kernel = matmul_kernel(size)
  stats = search.SearchStats(kernel.name)
  winner = search.beam_search(kernel, [SimpleNamespace(handle=None, device="CUDA")], 2, device="CUDA",
                              workers=workers, stats=stats)
  return stats, winner


def compile_split(kernel: Any, opts: tuple) -> tuple[float, float, float]:
  """Seconds of linearize, render and NVRTC for one candidate."""
  from ourgrad.codegen.linearizer import linearize
  from ourgrad.codegen.opt import search
  from ourgrad.runtime.ops_cuda import CUDACompiler
  candidate = search.apply_opts(kernel, opts)
  if candidate.wgmma is not None: return (0.0, 0.0, 0.0)
  started = time.perf_counter()
  uops = linearize(candidate)
  linearized = time.perf_counter()
  source = candidate.renderer.render(candidate.name, uops)
  rendered = time.perf_counter()
  CUDACompiler("sm_90").compile(source)
  return linearized - started, rendered - linearized, time.perf_counter() - rendered


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--size", type=int, default=1024)
  parser.add_argument("--workers", type=int, nargs="*", default=[0], help="pool sizes (0: one per CPU core)")
  parser.add_argument("--budget", help="BEAM_TIME_BUDGET for the replay (default: the GPU default)")
  parser.add_argument("--split", action="store_true", help="linearize/render/NVRTC seconds of one candidate per round")
  args = parser.parse_args()
  from ourgrad.codegen.opt import search
  if args.budget is not None: os.environ["BEAM_TIME_BUDGET"] = args.budget
  print(f"# BEAM=2 compile cost, {args.size}^3 f32 matmul for CUDA sm_90 (NVRTC), fake timings; "
        f"{os.cpu_count()} CPU cores; BEAM_TIME_BUDGET={os.environ.get('BEAM_TIME_BUDGET', '-1 (GPU: 8 s)')}")
  print("| workers | round | candidates | dropped | compile wall s | compile CPU s | best ms "
        "| linearize/render/nvrtc s |")
  print("| --- | --- | --- | --- | --- | --- | --- | --- |")
  for workers in args.workers:
    stats, winner = replay(args.size, workers)
    kernel = matmul_kernel(args.size)
    hand = tuple(search.hand_coded(kernel).applied_opts)
    start = len(hand) if tuple(winner.applied_opts[:len(hand)]) == hand else 0
    for number, round_stats in enumerate(stats.rounds):
      split = ""
      if args.split:   # the winner's Opts up to this round: a candidate of the round's size
        opts = tuple(winner.applied_opts[:start + number])
        split = "/".join(f"{seconds:.2f}" for seconds in compile_split(kernel, opts))
      print(f"| {stats.workers} | {number} | {round_stats.candidates} | {round_stats.failed} | "
            f"{round_stats.compile_s:.2f} | {round_stats.compile_cpu_s:.2f} | {round_stats.best_s * 1e3:.4f} | "
            f"{split} |")
    print(f"| {stats.workers} | all | {stats.candidates} | | {stats.phases()['compile']:.2f} | "
          f"{sum(r.compile_cpu_s for r in stats.rounds):.2f} | {stats.best_s * 1e3:.4f} | total {stats.total_s:.2f} s"
          f"{', budget hit' if stats.out_of_time else ''} |", flush=True)


if __name__ == "__main__":
  main()
