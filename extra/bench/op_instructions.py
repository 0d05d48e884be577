"""Machine instructions one lazy op's creation costs (issue 26's graph phase), counted by valgrind (cachegrind,
no cache simulation): deterministic where times on a shared machine are not, and unlike bytecode counts it sees
what C does for the bytecodes (an object made, a property read through map, a call with *args re-entering the
interpreter).

Each workload runs `--calls` and 11 x `--calls` times in two processes under valgrind; the difference over the
extra calls is the cost of one (process start and imports cancel). The cyclic collector is off and the hash seed
fixed. ~1 minute a workload.

Also whole eager steps (`cnn_step`, `mlp_step`: bench_autograd's step at batch 16, every host kernel a no-op).

Run: `python extra/bench/op_instructions.py --only mul,add1,cnn_step` (beside main: `--tree ../main`).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

# workload -> the expression timed (x: a stored one-element float tensor; a, b: computed ones; c: 1024 computed)
WORKLOADS = {
  "none": "None",
  "add1": "x + 1",
  "add1_realize": "(x + 1).realize()",   # minus add1: op1's realize (a one-kernel schedule-cache replay)
  "mul": "a * b",
  "expr8": "((((a * 1.25 + 1.5).exp2() - 0.25).sqrt() * a).relu() + 1.25).log2()",
  "expr8_1024": "((((c * 1.25 + 1.5).exp2() - 0.25).sqrt() * c).relu() + 1.25).log2()",
  "reshape": "a.reshape(1, 1)",
  "sum": "a.sum()",
}

# whole eager steps (bench_autograd's PhasedStep, batch 16, host kernels replaced by no-ops: the Python of a step)
STEPS = {"cnn_step": "cnn", "mlp_step": "mlp"}

_STEP_CHILD = """
import gc, sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {root!r} + "/extra/bench")
import numpy as np
from ourgrad import Tensor
from bench_autograd import PhasedStep
from bench_eager import host_kernels_disabled
from bench_jit import MLP, load_mnist_example
if {model!r} == "cnn":
  mnist = load_mnist_example()
  model, shape = mnist.ConvNet(mnist.MODELS["small"]), (16, 1, 28, 28)
else:
  model, shape = MLP(), (16, 784)
x = Tensor(np.random.default_rng(0).random(shape, np.float32), device="CLANG").realize()
y = Tensor(np.arange(16, dtype=np.int32) % 10, device="CLANG").realize()
step = PhasedStep.classifier(model, x, y)
for _ in range(3): step.step()   # (compiled first: host_kernels_disabled replaces the compiled kernels)
with host_kernels_disabled(True):
  step.step()
  gc.disable()
  for _ in range({calls}): step.step()
"""

_CHILD = """
import gc, sys
sys.path.insert(0, {root!r})
import numpy as np
from ourgrad import Tensor
from ourgrad import lazy_trace
x = Tensor(np.ones(1, np.float32), device="CLANG").realize()
a, b = x * 2, x * 3
c = Tensor(np.ones(1024, np.float32), device="CLANG").realize() * 2
build = lambda: {expression}
gc.disable()
for call in range({calls}):
  build()
  if call % 500 == 0: lazy_trace.invalidate()   # (the creation trace keeps what it traced alive)
"""


def instructions(root: pathlib.Path, expression: str, calls: int) -> int:
  """Instructions executed by a process running `expression` `calls` times (valgrind's I refs)."""
  if expression in STEPS.values(): script = _STEP_CHILD.format(root=str(root), model=expression, calls=calls)
  else: script = _CHILD.format(root=str(root), expression=expression, calls=calls)
  env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(root)}
  run = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                        sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
  return int(re.search(r"I\s+refs:\s+([\d,]+)", run.stderr).group(1).replace(",", ""))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", default="none,add1,mul")
  parser.add_argument("--calls", type=int, default=2000)
  parser.add_argument("--steps", type=int, default=2, help="steps of cnn_step / mlp_step (and 11 x as many)")
  parser.add_argument("--tree", default=str(ROOT), help="the checkout whose ourgrad is counted")
  args = parser.parse_args()
  root = pathlib.Path(args.tree).resolve()
  for name in args.only.split(","):
    what, calls = (STEPS[name], args.steps) if name in STEPS else (WORKLOADS[name], args.calls)
    few, many = (instructions(root, what, count) for count in (calls, 11 * calls))
    print(f"{name:8s} {(many - few) / (10 * calls):11.0f} instructions a call ({what}; {root})")


if __name__ == "__main__":
  main()
