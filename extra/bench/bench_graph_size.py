"""How scheduling and realizing scale with the size of the lazy graph.

(a) an elementwise chain of N ops (x = x * 1.0001 + 0.0001 ..., alternating) on a small tensor, realized once: it
    fuses into ONE kernel of N ops, so this measures graph building, the scheduler, codegen (Kernel, linearizer,
    renderer) and the device compiler. Past KERNEL_OPS_LIMIT ops the scheduler splits the chain into pieces
    (identical here, so one compile);
(a') the same chain with a different constant in every op: split into kernels of KERNEL_OPS_LIMIT ops (default
    1024), none alike, so every piece is generated and compiled;
(b) a network of N layers, each `x = (x @ w_i + b_i).relu()` with 16x16 weights, forward only, realized every 10
    layers or once at the end: N kernels (a layer's matmul reduce cannot fuse into the next one), all with the same
    AST, so after a warm-up this measures the scheduler on long chains of kernels and the per-kernel overhead.

Columns are seconds: building the lazy graph, `create_schedule` (summed over every realize), codegen, the device
compiler, and the whole realize (schedule + codegen + compile + run), plus the same per op / per layer, so linear
growth shows as a flat per-N column. Each row runs in its own process with a time limit (--timeout); a
RecursionError or any other error is reported in the table instead of a time.

Run: `python extra/bench/bench_graph_size.py [--device CLANG] [--chain 1000,2000] [--distinct 1000,2000]
[--layers 100,300] [--timeout 300]`.
Kernels compile into a fresh temporary cache folder unless --keep-cache is given (so the compiler's time counts).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

# run from any folder, the checkout's ourgrad (not an installed one) is measured
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# ---------------------------------------------------------------- one row, in a child process

def run_row(kind: str, count: int, every: int, device_name: str | None) -> dict[str, Any]:
  from ourgrad import Device, GlobalCounters, Tensor
  from ourgrad.engine import realize as realize_module
  from ourgrad.engine import schedule as schedule_module
  device = Device.canonicalize(device_name) if device_name else Device.DEFAULT
  spent = {"schedule": 0.0, "codegen+compile": 0.0, "compile": 0.0}

  def timed(function: Any, key: str) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
      start = time.perf_counter()
      try:
        return function(*args, **kwargs)
      finally:
        spent[key] += time.perf_counter() - start
    return wrapper
  # the schedule cache looks build_schedule up at call time and get_runner calls compile_kernel by its global name
  schedule_module.build_schedule = timed(schedule_module.build_schedule, "schedule")
  realize_module.compile_kernel = timed(realize_module.compile_kernel, "codegen+compile")
  compiler = Device[device].compiler
  compiler.compile = timed(compiler.compile, "compile")  # type: ignore[method-assign]

  rng = np.random.default_rng(0)
  if kind in ("chain", "distinct"):
    values = rng.standard_normal((4, 16)).astype(np.float32)
    # "distinct": every op has its own constant, so no two pieces of a split chain are the same kernel
    scale = 1e-7 if kind == "distinct" else 0.0

    def build() -> Tensor:
      x = Tensor(values, device=device)
      for step in range(count): x = x * (1.0001 + step * scale) if step % 2 == 0 else x + (0.0001 + step * scale)
      return x
  else:
    weights = [Tensor(rng.standard_normal((16, 16)).astype(np.float32) * 0.25, device=device) for _ in range(count)]
    biases = [Tensor(rng.standard_normal((16,)).astype(np.float32) * 0.1, device=device) for _ in range(count)]
    inputs = rng.standard_normal((8, 16)).astype(np.float32)

    def build() -> Tensor:
      x = Tensor(inputs, device=device)
      for layer, (weight, bias) in enumerate(zip(weights, biases)):
        x = (x @ weight + bias).relu()
        if every and (layer + 1) % every == 0: x.realize()
      return x
    # warm-up on a few layers: compile the distinct layer kernels, so the row measures scheduling and launches
    saved = weights, biases
    weights, biases = weights[:20], biases[:20]
    build().realize()
    weights, biases = saved
    for key in spent: spent[key] = 0.0

  GlobalCounters.reset()
  try:
    start = time.perf_counter()
    tensor = build()
    built = time.perf_counter()
    tensor.realize()
    done = time.perf_counter()
    finite = bool(np.all(np.isfinite(tensor.numpy())))
  except RecursionError as error:
    return {"error": f"RecursionError: {str(error)[:70]}"}
  except Exception as error:  # noqa: BLE001 - report it in the table
    return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:70] if str(error) else ''}"}
  if not finite: return {"error": "non-finite result"}
  # with intermediate realizes, they happen while building: count building and realizing together
  build_seconds, realize_seconds = (built - start, done - built) if not every else (float("nan"), done - start)
  return {"device": device, "build": build_seconds, "realize": realize_seconds, "schedule": spent["schedule"],
          "compile": spent["compile"], "codegen": spent["codegen+compile"] - spent["compile"],
          "kernels": GlobalCounters.kernel_count}


# ---------------------------------------------------------------- the table, in the parent process

def run_row_in_child(kind: str, count: int, every: int, args: argparse.Namespace) -> dict[str, Any]:
  command = [sys.executable, __file__, "--row", f"{kind}:{count}:{every}"] + (["--device", args.device]
                                                                             if args.device else [])
  # a session of its own, so a timeout can kill the compiler the child is waiting on too
  child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
  try:
    out, err = child.communicate(timeout=args.timeout)
  except subprocess.TimeoutExpired:
    os.killpg(child.pid, signal.SIGKILL)
    child.communicate()
    return {"error": f"timeout: not done after {args.timeout:.0f} s"}
  lines = [line for line in out.splitlines() if line.startswith("{")]
  if child.returncode != 0 or not lines:
    last = (err.strip().splitlines() or ["no output"])[-1]
    return {"error": f"child failed (exit {child.returncode}): {last[:80]}"}
  return json.loads(lines[-1])


def seconds(value: float, width: int) -> str:
  return f"{'(incl.)':>{width}}" if value != value else f"{value:{width}.3f}"


def main() -> None:
  parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
  parser.add_argument("--device", default=None, help="device (default: ourgrad's default)")
  parser.add_argument("--chain", default="1000,2000,5000,10000,20000,50000", help="chain lengths N for (a)")
  parser.add_argument("--distinct", default="1000,5000,20000,50000", help="chain lengths N for (a')")
  parser.add_argument("--layers", default="100,300,1000", help="layer counts N for (b)")
  parser.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per row")
  parser.add_argument("--keep-cache", action="store_true", help="use the normal compile cache (default: a fresh one)")
  parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # kind:N:every, run by the parent
  args = parser.parse_args()
  if args.row is not None:
    kind, count, every = args.row.split(":")
    print(json.dumps(run_row(kind, int(count), int(every), args.device)))
    return
  if not args.keep_cache: os.environ["OURGRAD_CACHE_DIR"] = tempfile.mkdtemp(prefix="ourgrad_bench_cache_")
  print(f"Python {sys.version.split()[0]}, recursion limit {sys.getrecursionlimit()}, device "
        f"{args.device or 'default'}, {args.timeout:.0f} s allowed per row")

  print("\n(a) elementwise chain of N ops on a (4, 16) float32 tensor, realized once")
  print(f"{'N':>7} {'build s':>8} {'schedule s':>10} {'codegen s':>9} {'compile s':>9} {'realize s':>9} "
        f"{'sched us/op':>11} {'realize us/op':>13}")
  for count in [int(n) for n in args.chain.split(",") if n]:
    row = run_row_in_child("chain", count, 0, args)
    if "error" in row:
      print(f"{count:>7} {row['error']}")
      continue
    print(f"{count:>7} {row['build']:8.3f} {row['schedule']:10.3f} {row['codegen']:9.3f} {row['compile']:9.3f} "
          f"{row['realize']:9.3f} {row['schedule'] / count * 1e6:11.1f} {row['realize'] / count * 1e6:13.1f}")

  print("\n(a') the same chain with a different constant in every op (no two kernels of a split chain alike)")
  print(f"{'N':>7} {'build s':>8} {'schedule s':>10} {'codegen s':>9} {'compile s':>9} {'realize s':>9} "
        f"{'kernels':>7} {'realize us/op':>13}")
  for count in [int(n) for n in args.distinct.split(",") if n]:
    row = run_row_in_child("distinct", count, 0, args)
    if "error" in row:
      print(f"{count:>7} {row['error']}")
      continue
    print(f"{count:>7} {row['build']:8.3f} {row['schedule']:10.3f} {row['codegen']:9.3f} {row['compile']:9.3f} "
          f"{row['realize']:9.3f} {row['kernels']:>7} {row['realize'] / count * 1e6:13.1f}")

  print("\n(b) N layers x = (x @ w_i + b_i).relu(), x (8, 16), w_i (16, 16), forward only (after a warm-up)")
  print(f"{'N':>7} {'realize':>11} {'build s':>8} {'schedule s':>10} {'realize s':>9} {'sched ms/layer':>14} "
        f"{'realize ms/layer':>16} {'kernels':>7}")
  for count in [int(n) for n in args.layers.split(",") if n]:
    for every in (10, 0):
      label = "every 10" if every else "once at end"
      row = run_row_in_child("layers", count, every, args)
      if "error" in row:
        print(f"{count:>7} {label:>11} {row['error']}")
        continue
      print(f"{count:>7} {label:>11} {seconds(row['build'], 8)} {row['schedule']:10.3f} {row['realize']:9.3f} "
            f"{row['schedule'] / count * 1e3:14.2f} {row['realize'] / count * 1e3:16.2f} {row['kernels']:>7}")


if __name__ == "__main__":
  main()
