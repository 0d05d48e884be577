"""Benchmark BEAM search: kernels chosen by the hand-coded heuristic vs by BEAM=2, the search's cost on a first run
and on a second run (served by the cache), beside numpy and PyTorch in the same run.

    python extra/bench/bench_beam.py                       # CUDA if present, else CLANG and LLVM; full sizes
    python extra/bench/bench_beam.py --devices CLANG LLVM  # pick devices
    python extra/bench/bench_beam.py --quick               # small sizes, a quick check that it all runs
    BEAM=2 DEBUG=2 python extra/bench/bench_beam.py --only matmul   # one workload; the search's rounds on stderr

Methodology
- Workloads: softmax and layernorm (no affine) over the last axis of an (N, N) float32 matrix, and an N×N×N float32
  matmul; N = 1024 (256 with --quick). Inputs are seeded numpy arrays, the same for every library.
- ourgrad runs in processes of its own, as a user would: a first process with BEAM=2 and an empty cache folder
  (OURGRAD_CACHE_DIR, a fresh temporary folder per device and workload, so earlier runs on this machine do not
  count) searches every kernel; a second BEAM=2 process on the same folder must find them all in the cache.
- "search s": BeamCounters.search_seconds of a process, the wall time spent choosing the Opts of all the
  workload's kernels (cache look-ups, compiling and timing candidates, verifying the winner); "kernels" counts them.
- "hand ms" and "BEAM ms" (second process): for each kernel of the workload, the hand-coded and the BEAM version
  are compiled and launched in turns, 10 times each, on the same scratch buffers, timed by the runtime (CUDA events
  on CUDA, the clock around the call on CPUs); each keeps its fastest launch, and the table sums over the kernels.
  Taking turns keeps the comparison fair on a busy machine, where load changes from second to second. Where BEAM
  kept the hand-coded Opts ("BEAM kept hand-coded" counts those kernels) the two are one program, timed once.
- "search phases s": where the first process's search seconds went, summed over its searches
  (SearchStats.phases): forking the compile pool, expanding candidates, compiling them (wall time; "CPU" is the
  compile time summed over the candidates, which the pool spreads over its workers), timing them on the device, the
  final duel with the hand-coded kernel, verifying the winner; "rounds/cand." counts rounds and candidates.
- "BEAM wall ms": the median wall time of a whole realize with BEAM's kernels (scheduling, launches, a device
  synchronize), comparable with numpy's and torch's wall times.
- numpy and torch: the median wall time of the whole expression (torch on the GPU when the device is CUDA and
  torch sees one, with torch.cuda.synchronize()).
- Every ourgrad result is checked against numpy before timing; a mismatch is reported in the "ok" column.
- Runs: at least 3, at most 20, stopped after ~1 s per measurement; warm-up runs first.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

torch: Any = None  # imported by the main process only (the ourgrad worker processes need not pay for it)


def load_torch() -> None:
  global torch
  try:
    import torch as torch_module
  except ImportError:  # torch is optional: its column stays empty
    return
  torch = torch_module

WORKLOAD_NAMES = ("softmax", "layernorm", "matmul")


def make_inputs(name: str, size: int) -> list[np.ndarray]:
  rng = np.random.default_rng(0)
  count = 2 if name == "matmul" else 1
  return [rng.standard_normal((size, size), dtype=np.float32) for _ in range(count)]


def numpy_fn(name: str) -> Callable[..., np.ndarray]:
  def softmax(x: np.ndarray) -> np.ndarray:
    exps = np.exp(x - x.max(-1, keepdims=True))
    return exps / exps.sum(-1, keepdims=True)

  def layernorm(x: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-5)

  return {"softmax": softmax, "layernorm": layernorm, "matmul": lambda a, b: a @ b}[name]


def ourgrad_fn(name: str) -> Callable[..., Any]:
  return {"softmax": lambda x: x.softmax(-1), "layernorm": lambda x: x.layernorm(-1, eps=1e-5),
          "matmul": lambda a, b: a @ b}[name]


def torch_fn(name: str) -> Callable[..., Any]:
  return {"softmax": lambda x: torch.softmax(x, -1),
          "layernorm": lambda x: torch.nn.functional.layer_norm(x, x.shape[-1:], eps=1e-5),
          "matmul": lambda a, b: a @ b}[name]


def median_time(run: Callable[[], Any], min_runs: int = 3, max_runs: int = 20, budget_s: float = 1.0,
                warmup: int = 1) -> float:
  """Median seconds of `run()` after warm-up."""
  for _ in range(warmup): run()
  samples: list[float] = []
  spent_start = time.perf_counter()
  while len(samples) < max_runs:
    start = time.perf_counter()
    run()
    samples.append(time.perf_counter() - start)
    if len(samples) >= min_runs and time.perf_counter() - spent_start > budget_s: break
  return statistics.median(samples)


# ---------------------------------------------------------------- one ourgrad process

def worker(name: str, size: int, compare: bool) -> dict[str, Any]:
  """Run one workload in this process (DEVICE, BEAM and OURGRAD_CACHE_DIR come from the environment); with
  `compare`, also time each kernel's hand-coded and BEAM versions in turns."""
  from ourgrad.codegen.opt.search import BeamCounters
  from ourgrad.device import Device
  from ourgrad.helpers import GlobalCounters
  from ourgrad.tensor import Tensor

  arrays = make_inputs(name, size)
  inputs = [Tensor(array) for array in arrays]
  function = ourgrad_fn(name)
  device = Device[Device.DEFAULT]
  GlobalCounters.reset()
  result = function(*inputs).numpy()  # schedules, searches (BEAM), compiles: the first run
  kernels = GlobalCounters.kernel_count
  ok = bool(np.allclose(result, numpy_fn(name)(*arrays), rtol=1e-3, atol=1e-3))
  search_s, searches, hits = BeamCounters.search_seconds, BeamCounters.searches, BeamCounters.cache_hits
  phases = {name: sum(stats.phases()[name] for stats in BeamCounters.stats) for name in PHASES}
  compile_cpu = sum(r.compile_cpu_s for stats in BeamCounters.stats for r in stats.rounds)
  rounds = sum(len(stats.rounds) - 1 for stats in BeamCounters.stats)
  candidates = sum(stats.candidates for stats in BeamCounters.stats)
  workers = max((stats.workers for stats in BeamCounters.stats), default=0)

  def realize() -> None:
    function(*inputs).realize()
    device.synchronize()

  wall_s = median_time(realize)
  hand_s, beam_s, kept = interleaved_kernel_times(function(*inputs)) if compare else (0.0, 0.0, 0)
  return {"ok": ok, "search_s": search_s, "searches": searches, "cache_hits": hits, "wall_s": wall_s,
          "kernels": kernels, "hand_s": hand_s, "beam_s": beam_s, "kept_hand": kept, "phases": phases,
          "compile_cpu_s": compile_cpu, "rounds": rounds, "candidates": candidates, "workers": workers}


def interleaved_kernel_times(graph: Any, rounds: int = 10) -> tuple[float, float, int]:
  """Sum over the graph's kernels of (hand-coded, BEAM) kernel time, and how many kernels BEAM left as the
  hand-coded one. Each kernel's two versions run in turns on the same scratch buffers and each keeps its fastest
  launch: on a busy machine both see the same load. Where BEAM chose the hand-coded Opts the two are one program,
  timed once for both (timing it twice would only measure the machine's noise)."""
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.codegen.opt import search
  from ourgrad.device import Device
  from ourgrad.engine.realize import compile_kernel
  from ourgrad.engine.schedule import create_schedule
  from ourgrad.ops import Ops

  hand_total = beam_total = 0.0
  kept = 0
  for item in create_schedule([graph.lazydata]):
    if item.ast.op is not Ops.STORE: continue
    device = item.outputs[0].device
    plain = Kernel(item.ast, Device[device].renderer)
    kernels = (search.hand_coded(plain), search.beam_optimize(plain, device, int(os.environ["BEAM"])))
    same = kernels[0].applied_opts == kernels[1].applied_opts
    kept += same
    runners = [compile_kernel(kernel, device) for kernel in kernels[:1 if same else 2]]
    buffers = tuple(search.scratch_buffers(item.ast, device))
    search.random_fill(buffers, seed=0)
    best = [float("inf")] * len(runners)
    for _ in range(rounds):
      for index, runner in enumerate(runners): best[index] = min(best[index], runner(buffers, wait=True))
    hand_total, beam_total = hand_total + best[0], beam_total + best[-1]
  return hand_total, beam_total, kept


def run_worker(device: str, name: str, size: int, cache_dir: str, compare: bool) -> dict[str, Any]:
  # DEBUG from this process's environment reaches the first (searching) process; its prints go to stderr here
  debug = os.environ.get("DEBUG", "0") if not compare else "0"
  env = {**os.environ, "DEVICE": device, "BEAM": "2", "OURGRAD_CACHE_DIR": cache_dir, "DEBUG": debug}
  env.pop("IGNORE_BEAM_CACHE", None)
  command = [sys.executable, os.path.abspath(__file__), "--worker", name, "--size", str(size)]
  done = subprocess.run(command + (["--compare"] if compare else []), env=env, capture_output=True, text=True,
                        cwd=REPO_ROOT)
  if done.returncode != 0:
    raise RuntimeError(f"{device} {name} BEAM=2 failed:\n{done.stderr[-3000:]}")
  lines = done.stdout.strip().splitlines()
  if debug != "0": print("\n".join(line for line in lines[:-1] if "BEAM" in line), file=sys.stderr, flush=True)
  return json.loads(lines[-1])


# ---------------------------------------------------------------- numpy and torch in this process

def bench_numpy(name: str, size: int) -> float:
  arrays, function = make_inputs(name, size), numpy_fn(name)
  return median_time(lambda: function(*arrays))


def bench_torch(name: str, size: int, on_gpu: bool) -> float | None:
  if torch is None: return None
  tensors = [torch.from_numpy(array) for array in make_inputs(name, size)]
  if on_gpu: tensors = [tensor.cuda() for tensor in tensors]
  function = torch_fn(name)

  def run() -> None:
    function(*tensors)
    if on_gpu: torch.cuda.synchronize()

  with torch.no_grad():
    return median_time(run)


# ---------------------------------------------------------------- the table

PHASES = ("pool", "expand", "compile", "time", "duel", "verify")
HEADER = ("| device | workload | kernels | hand ms | BEAM ms | hand/BEAM | BEAM kept hand-coded | search s (1st run) "
          "| search s (2nd run) | rounds/cand. | " + " | ".join(f"{phase} s" for phase in PHASES) +
          " | compile CPU s (workers) | BEAM wall ms | numpy ms | torch ms | ok |")


def row(device: str, name: str, size: int) -> str:
  with tempfile.TemporaryDirectory(prefix=f"bench_beam_{device}_") as cache_dir:
    first = run_worker(device, name, size, cache_dir, compare=False)
    second = run_worker(device, name, size, cache_dir, compare=True)
  on_gpu = device == "CUDA" and torch is not None and torch.cuda.is_available()
  numpy_s, torch_s = bench_numpy(name, size), bench_torch(name, size, on_gpu)
  workload = f"{name} {size}^3" if name == "matmul" else f"{name} {size}^2"
  ok = first["ok"] and second["ok"] and second["searches"] == 0
  torch_text = f"{torch_s * 1e3:.3f}" if torch_s is not None else "-"
  return (f"| {device} | {workload} | {first['kernels']} | {second['hand_s'] * 1e3:.3f} | "
          f"{second['beam_s'] * 1e3:.3f} | {second['hand_s'] / second['beam_s']:.2f}x | "
          f"{second['kept_hand']}/{first['kernels']} | "
          f"{first['search_s']:.1f} ({first['searches']} searched, "
          f"{first['search_s'] / max(first['searches'], 1):.1f} s each) | "
          f"{second['search_s']:.2f} ({second['cache_hits']} cached) | {first['rounds']}/{first['candidates']} | "
          + "".join(f"{first['phases'][phase]:.2f} | " for phase in PHASES) +
          f"{first['compile_cpu_s']:.1f} ({first['workers']}) | {second['wall_s'] * 1e3:.3f} | "
          f"{numpy_s * 1e3:.3f} | {torch_text} | {'yes' if ok else 'NO'} |")


def default_devices() -> list[str]:
  from ourgrad.device import Device
  from ourgrad.errors import DeviceError
  try:
    Device["CUDA"]
    return ["CUDA"]
  except DeviceError:
    return ["CLANG", "LLVM"]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", nargs="*", help="devices to benchmark (default: CUDA if present, else CLANG LLVM)")
  parser.add_argument("--workloads", "--only", nargs="*", default=list(WORKLOAD_NAMES), choices=WORKLOAD_NAMES,
                      help="workloads to run (default: all)")
  parser.add_argument("--quick", action="store_true", help="N=256 instead of 1024")
  parser.add_argument("--size", type=int, help="N (overrides --quick)")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  parser.add_argument("--compare", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  size = args.size or (256 if args.quick else 1024)
  if args.worker:
    print(json.dumps(worker(args.worker, size, args.compare)))
    return
  load_torch()
  devices = args.devices or default_devices()
  print(f"# BEAM=2 vs hand-coded, N={size}, float32; {os.cpu_count()} CPU cores; torch "
        f"{torch.__version__ if torch is not None else 'absent'}")
  print(HEADER)
  print("|" + " --- |" * (HEADER.count("|") - 1))
  for device in devices:
    for name in args.workloads:
      print(row(device, name, size), flush=True)


if __name__ == "__main__":
  main()
