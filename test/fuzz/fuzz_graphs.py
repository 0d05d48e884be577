"""Fuzz whole graphs: random Tensor programs realized on every CPU device, against a numpy mirror.

Each case draws a random program of 3 to 10 ops with `graphgen.GraphGen` (read its docstring for the op set and
the tolerance model): elementwise unary and binary ops (comparisons, where, bitwise ops, // and % with Python floor
semantics, div(rounding_mode='trunc') and fmod with C's, never a zero divisor), casts between float32/int32/bool,
reductions (sum/max/min/mean over random axes, keepdim or not), matmul, and movement ops (reshape, permute,
expand, pad with zero or a value, shrink, flip, basic indexing with steps, integer-list indexing, cat) on random
small shapes (size-0 and size-1 dims included), with shared subgraphs. The same random choices drive numpy, which
computes the expected values in float64/int64. The program then runs on each device (CLANG always; OPENCL, LLVM and
PYTHON when `Device[name]` opens), and the output (plus one random intermediate node) must match: integers and
bools exactly, floats within the propagated error bound.

Bugs it found have minimized repros in test_regressions.py.

Under pytest, each device is its own test (fixed seeds and one random seed); the script checks every device on
every case. Run: `python test/fuzz/fuzz_graphs.py --iterations 2000 --seed N [--devices CLANG,PYTHON]`;
`--case I` replays one case and prints its program (a self-contained script).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fuzzing import Case, Check, main, random_seed, run_for_pytest  # noqa: E402
from graphgen import compare, random_graph  # noqa: E402

from ourgrad.device import Device  # noqa: E402
from ourgrad.errors import DeviceError  # noqa: E402

ALL_DEVICES = ["CLANG", "OPENCL", "LLVM", "PYTHON"]


def device_available(name: str) -> bool:
  try:
    Device[name]
  except DeviceError:
    return False
  return True


def make_check(devices: list[str]) -> Check:
  def check_case(case: Case) -> str:
    rng = case.rng
    gen, graph = random_graph(rng, 3, 10)
    live = [node for node in gen.nodes if node.kind != "input"]
    extra = rng.choice(live[:-1]) if len(live) > 1 else None
    graph.outputs = [graph.outputs[0]] + ([extra.index] if extra is not None else [])
    case.log(graph.program())
    for device in devices:
      case.log(f"# on device = {device!r}")
      namespace = graph.build(device)
      for index in graph.outputs:
        node = graph.nodes[index]
        compare(namespace[node.name].numpy(), node, f"{device} v{index}")
    return f"ok: {len(live)} ops"
  return check_case


# ---------------------------------------------------------------- pytest and command line

# cases per test: a CLANG kernel compiles in ~0.1-0.3 s and an OpenCL (PoCL) one in ~0.5-1 s (~2 CPU-s a program;
# test_ops.py covers OPENCL's op lowering in CI's later stage); LLVM and PYTHON are fast
ITERATIONS = {"CLANG": 40, "OPENCL": 4, "LLVM": 80, "PYTHON": 100}


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("seed", [0])
def test_graphs_fixed_seed(device: str, seed: int) -> None:
  if not device_available(device): pytest.skip(f"{device} does not open here")
  run_for_pytest("fuzz_graphs", make_check([device]), seed, ITERATIONS[device], f" --devices {device}")


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_graphs_random_seed(device: str) -> None:
  if not device_available(device): pytest.skip(f"{device} does not open here")
  run_for_pytest("fuzz_graphs", make_check([device]), random_seed(), ITERATIONS[device], f" --devices {device}")


if __name__ == "__main__":
  def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", default=",".join(ALL_DEVICES), help="comma-separated devices (unavailable skip)")

  def make_check_from_args(args: argparse.Namespace) -> Any:
    devices = [name for name in args.devices.upper().split(",") if device_available(name)]
    print(f"devices: {devices}")
    return make_check(devices)

  main("fuzz_graphs", make_check_from_args, 200, add_arguments)
