"""What building one lazy op costs (issue 26, "cheap graph building"): Tensor method -> Function -> LazyBuffer -> view.

Each row times one Tensor call in a loop (nothing is realized: only the graph is built), as microseconds per op, the
best of several runs of `--calls` calls, in thread CPU time. Operands are realized tensors made once, so a row is the
cost of the call alone; with requires_grad (`--grad`) the autograd bookkeeping a training step's forward pays is
included.
`--profile NAME` prints a cProfile table (own time, calls per op) of one row. `--steps mlp,cnn` splits an eager
training step (bench_eager's MLP and examples/mnist.py CNN, Adam, batch 64) into its phases, in thread CPU time per
step: the forward graph, backward(), the optimizer's graph, and the realize (kernels replaced by no-ops on CPU
devices, as bench_eager's Python time).

Run: `python extra/bench/bench_graph_ops.py` (CLANG by default: no kernel is compiled or run), `--only add,sum`.
Alternate two checkouts in one shell for ratios (the machine is shared): PYTHONPATH=<checkout> selects the library
(without it, this checkout's).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pathlib
import pstats
import sys
import time
from typing import Any, Callable

import numpy as np

os.environ.setdefault("DEVICE", "CLANG")
# the library: PYTHONPATH's where it is set (one copy of this script measures any checkout), else this checkout's
if not os.environ.get("PYTHONPATH"): sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))   # bench_jit's models, bench_eager's no-op kernels
from ourgrad import Device, Tensor, dtypes  # noqa: E402


def operands(grad: bool) -> dict[str, Any]:
  """The realized inputs the rows read."""
  rng = np.random.default_rng(0)
  def make(*shape: int) -> Tensor:
    return Tensor(rng.standard_normal(shape).astype(np.float32), requires_grad=grad or None).realize()
  return {"a": make(64, 128), "b": make(64, 128), "row": make(128), "col": make(64, 1), "w": make(128, 32),
          "x4": make(8, 16, 8, 8)}


def rows(t: dict[str, Any]) -> dict[str, Callable[[], Any]]:
  """name -> the call a row times."""
  a, b, row, col, w, x4 = t["a"], t["b"], t["row"], t["col"], t["w"], t["x4"]
  return {
    "add": lambda: a + b,
    "mul": lambda: a * b,
    "add_const": lambda: a + 1.5,
    "rsub_const": lambda: 1.0 - a,
    "add_bcast_row": lambda: a + row,
    "mul_bcast_col": lambda: a * col,
    "relu": lambda: a.relu(),
    "exp": lambda: a.exp(),
    "cast": lambda: a.cast(dtypes.float16),
    "reshape": lambda: a.reshape(128, 64),
    "permute": lambda: x4.permute(0, 2, 3, 1),
    "transpose": lambda: a.T,
    "expand": lambda: col.expand(64, 128),
    "getitem": lambda: a[1:5],
    "sum": lambda: a.sum(axis=1),
    "mean": lambda: a.mean(),
    "matmul": lambda: a @ w,
    "view_chain": lambda: a.reshape(8, 8, 128).permute(1, 0, 2).reshape(64, 128),
  }


def per_op_seconds(call: Callable[[], Any], calls: int, repeats: int = 7) -> float:
  """The best of `repeats` runs, in thread CPU time (other processes on a shared machine barely move it)."""
  best = float("inf")
  for _ in range(repeats):
    start = time.thread_time()
    for _ in range(calls): call()
    best = min(best, (time.thread_time() - start) / calls)
  return best


def step_phases(name: str, steps: int = 20, rounds: int = 3) -> dict[str, float]:
  """Thread CPU seconds per step of each phase of an eager training step (the best round of `steps` steps)."""
  from bench_eager import host_kernels_disabled
  from bench_jit import MLP, load_mnist_example
  from ourgrad.nn.losses import cross_entropy
  from ourgrad.nn.optim import Adam
  from ourgrad.nn.state import get_parameters
  if name == "mlp": model, shape = MLP(), (784,)
  else:
    mnist = load_mnist_example()
    model, shape = mnist.ConvNet(mnist.MODELS["small"]), (1, 28, 28)
  parameters = get_parameters(model)
  optimizer = Adam([tensor for tensor in parameters if tensor.requires_grad], lr=1e-3)
  stats = [tensor for tensor in parameters if not tensor.requires_grad]
  rng = np.random.default_rng(0)
  x = Tensor(rng.standard_normal((64, *shape)).astype(np.float32)).realize()
  y = Tensor(rng.integers(0, 10, 64).astype(np.int32)).realize()
  phases = ("forward", "backward", "optimizer", "realize")

  def step(spent: dict[str, float]) -> None:
    with Tensor.train():
      start = time.thread_time()
      optimizer.zero_grad()
      loss = cross_entropy(model(x), y)
      forward = time.thread_time()
      loss.backward()
      backward = time.thread_time()
      updated = optimizer.schedule_step()
      scheduled = time.thread_time()
      Tensor.realize_all(loss, *updated, *stats)
      done = time.thread_time()
    for phase, seconds in zip(phases, (forward - start, backward - forward, scheduled - backward, done - scheduled)):
      spent[phase] += seconds
  for _ in range(3): step(dict.fromkeys(phases, 0.0))   # compile, fill the caches
  best: dict[str, float] = {}
  with host_kernels_disabled(Device.DEFAULT != "CUDA"):
    for _ in range(rounds):
      spent = dict.fromkeys(phases, 0.0)
      for _ in range(steps): step(spent)
      if not best or sum(spent.values()) < sum(best.values()): best = spent
  return {phase: seconds / steps for phase, seconds in best.items()}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", default="", help="comma-separated rows (default: all)")
  parser.add_argument("--calls", type=int, default=2000)
  parser.add_argument("--grad", action="store_true", help="operands require grad (a training step's forward)")
  parser.add_argument("--profile", default="", help="print a cProfile table of this row")
  parser.add_argument("--steps", default="", help="comma-separated training steps (mlp, cnn) split into phases")
  args = parser.parse_args()
  if args.steps:
    print("| step | forward us | backward us | optimizer us | realize us | total us |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.steps.split(","):
      phases = step_phases(name)
      print(f"| {name} | " + " | ".join(f"{seconds * 1e6:.0f}" for seconds in phases.values())
            + f" | {sum(phases.values()) * 1e6:.0f} |")
    return
  table = rows(operands(args.grad))
  names = args.only.split(",") if args.only else list(table)
  for name in names: table[name]()   # warm the caches a repeated step finds warm
  print(f"| op | us per op (grad={args.grad}) |\n| --- | --- |")
  total = 0.0
  for name in names:
    seconds = per_op_seconds(table[name], args.calls)
    total += seconds
    print(f"| {name} | {seconds * 1e6:.2f} |")
  print(f"| total | {total * 1e6:.2f} |")
  if args.profile:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.calls): table[args.profile]()
    profile.disable()
    stats = pstats.Stats(profile)
    print(f"\n{args.profile}: own us per op, calls per op")
    items = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:25]  # type: ignore[attr-defined]
    for (filename, line, function), (_, calls, tottime, _, _) in items:
      where = f"{os.path.basename(filename)}:{line}({function})"
      print(f"  {tottime / args.calls * 1e6:7.2f} {calls / args.calls:6.1f}  {where}")


if __name__ == "__main__":
  main()
