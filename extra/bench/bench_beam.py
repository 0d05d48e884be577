"""Benchmark BEAM search: kernels chosen by the hand-coded heuristic vs by BEAM=2, the search's cost on a first run
and on a second run (served by the cache), beside numpy and PyTorch in the same run.

    python extra/bench/bench_beam.py                       # CUDA if present, else CLANG and LLVM; full sizes
    python extra/bench/bench_beam.py --devices CLANG LLVM  # pick devices
    python extra/bench/bench_beam.py --quick               # small sizes, a quick check that it all runs

Methodology
- Workloads: softmax and layernorm (no affine) over the last axis of an (N, N) float32 matrix, and an N×N×N float32
  matmul; N = 1024 (256 with --quick). Inputs are seeded numpy arrays, the same for every library.
- Each ourgrad measurement runs in its own process, so that what a user sees is what is measured: a process with
  BEAM=0 (hand-coded), a process with BEAM=2 and an empty cache folder (the search runs), then a second BEAM=2
  process on the same cache folder (no search: every kernel comes from the cache). OURGRAD_CACHE_DIR is a fresh
  temporary folder per device, so earlier runs on this machine do not count.
- "search s": BeamCounters.search_seconds of the process, i.e. the wall time spent choosing the Opts of all the
  workload's kernels (cache look-ups, compiling and timing candidates, verifying the winner); "kernels" counts them.
- "hand ms" and "BEAM ms": the sum of the workload's kernel times for one realize (the runtime's timing of each
  launch, as DEBUG=2 prints it), median over runs; "BEAM wall ms": the median wall time of a whole realize with
  BEAM's kernels (scheduling, launches, a device synchronize), comparable with numpy's and torch's wall times.
- numpy and torch: the median wall time of the whole expression (torch on the GPU when the device is CUDA and
  torch sees one, with torch.cuda.synchronize()).
- Every ourgrad result is checked against numpy before timing; a mismatch is reported in the "ok" column.
- Runs: at least 3, at most 20, stopped after ~1 s per measurement; warm-up runs first.
"""
from __future__ import annotations

import argparse
import contextlib
import io
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

def worker(name: str, size: int) -> dict[str, Any]:
  """Run one workload in this process (DEVICE, BEAM and OURGRAD_CACHE_DIR come from the environment)."""
  from ourgrad.codegen.opt.search import BeamCounters
  from ourgrad.device import Device
  from ourgrad.helpers import GlobalCounters
  from ourgrad.tensor import Tensor

  arrays = make_inputs(name, size)
  inputs = [Tensor(array) for array in arrays]
  function = ourgrad_fn(name)
  device = Device[Device.DEFAULT]
  result = function(*inputs).numpy()  # schedules, searches (BEAM), compiles: the first run
  ok = bool(np.allclose(result, numpy_fn(name)(*arrays), rtol=1e-3, atol=1e-3))
  search_s, searches, hits = BeamCounters.search_seconds, BeamCounters.searches, BeamCounters.cache_hits

  def realize() -> None:
    function(*inputs).realize()
    device.synchronize()

  wall_s = median_time(realize)
  kernel_times: list[float] = []
  os.environ["DEBUG"] = "2"  # launches are timed on the device (and printed: thrown away)
  with contextlib.redirect_stdout(io.StringIO()):
    realize()
    for _ in range(5):
      GlobalCounters.reset()
      realize()
      kernel_times.append(GlobalCounters.time_sum_s)
      kernels = GlobalCounters.kernel_count
  return {"ok": ok, "search_s": search_s, "searches": searches, "cache_hits": hits, "wall_s": wall_s,
          "kernel_s": statistics.median(kernel_times), "kernels": kernels}


def run_worker(device: str, name: str, size: int, beam: int, cache_dir: str) -> dict[str, Any]:
  env = {**os.environ, "DEVICE": device, "BEAM": str(beam), "OURGRAD_CACHE_DIR": cache_dir, "DEBUG": "0"}
  env.pop("IGNORE_BEAM_CACHE", None)
  done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", name, "--size", str(size)],
                        env=env, capture_output=True, text=True, cwd=REPO_ROOT)
  if done.returncode != 0:
    raise RuntimeError(f"{device} {name} BEAM={beam} failed:\n{done.stderr[-3000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


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

HEADER = ("| device | workload | kernels | hand ms | BEAM ms | hand/BEAM | search s (1st run) | search s (2nd run) "
          "| BEAM wall ms | numpy ms | torch ms | ok |")


def row(device: str, name: str, size: int) -> str:
  with tempfile.TemporaryDirectory(prefix=f"bench_beam_{device}_") as cache_dir:
    hand = run_worker(device, name, size, 0, os.path.join(cache_dir, "hand"))
    first = run_worker(device, name, size, 2, os.path.join(cache_dir, "beam"))
    second = run_worker(device, name, size, 2, os.path.join(cache_dir, "beam"))
  on_gpu = device == "CUDA" and torch is not None and torch.cuda.is_available()
  numpy_s, torch_s = bench_numpy(name, size), bench_torch(name, size, on_gpu)
  workload = f"{name} {size}^3" if name == "matmul" else f"{name} {size}^2"
  ok = hand["ok"] and first["ok"] and second["ok"] and second["searches"] == 0
  torch_text = f"{torch_s * 1e3:.3f}" if torch_s is not None else "-"
  return (f"| {device} | {workload} | {first['kernels']} | {hand['kernel_s'] * 1e3:.3f} | "
          f"{second['kernel_s'] * 1e3:.3f} | {hand['kernel_s'] / second['kernel_s']:.2f}x | "
          f"{first['search_s']:.1f} ({first['searches']} searched) | "
          f"{second['search_s']:.2f} ({second['cache_hits']} cached) | {second['wall_s'] * 1e3:.3f} | "
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
  parser.add_argument("--workloads", nargs="*", default=list(WORKLOAD_NAMES), choices=WORKLOAD_NAMES)
  parser.add_argument("--quick", action="store_true", help="N=256 instead of 1024")
  parser.add_argument("--size", type=int, help="N (overrides --quick)")
  parser.add_argument("--worker", help=argparse.SUPPRESS)
  args = parser.parse_args()
  size = args.size or (256 if args.quick else 1024)
  if args.worker:
    print(json.dumps(worker(args.worker, size)))
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
