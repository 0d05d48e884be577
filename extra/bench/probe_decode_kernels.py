"""What each kernel of a jitted SmolLM2 decode step costs inside a CUDA graph, as the replay runs it: for each kernel of
the first block (and those after the blocks), a graph of that one launch repeated `--repeats` times in a chain
(CUDA_DEPENDENT_LAUNCH's edges, as the step's graph), replayed and timed; microseconds a launch. Launched alone with
events, a kernel's time is mostly the launch's own cost; in a chain the kernels overlap their launches as in a step.
A chain re-reads one layer's weights, which stay in L2, where a step streams every layer's from memory: the sum over a
step's launches comes out below the step's own graph (H200, Q8_0, 2 blocks: 41 against 50 us).

    python extra/bench/probe_decode_kernels.py --weights q8_0 [--settings ELEMENT_REDUCES=0 ELEMENT_REDUCES=1]
                                               [--context 520] [--position 8] [--sequences 8]

Each setting (VAR=value[,VAR=value], an environment variable or module:CONSTANT of ourgrad such as
renderer.cuda:SHORT_LOOP_UNROLL, kept for the settings after it) builds the model afresh (random weights, 2 blocks)
in this one process. `--context`: the cache's slots (the kernels' fixed shapes); `--position`: the step's position,
which the kernels whose loops end at the slots in use (the `used` Variable) run to.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DEVICE", "CUDA")
from ourgrad.device import Device  # noqa: E402
from ourgrad.helpers import clear_caches  # noqa: E402
from ourgrad.engine.exec_item import CompiledRunner  # noqa: E402
from ourgrad.engine.jit import _graph_launch  # noqa: E402
from ourgrad.runtime.ops_cuda import CUDAGraph  # noqa: E402

from bench_pdl import time_graph  # noqa: E402
import profile_models  # noqa: E402


def probe(weights: str, repeats: int, setting: str, context: int = 520,
          position: int = 8, sequences: int = 1) -> None:
  for assignment in filter(None, setting.split(",")):
    name, value = assignment.split("=", 1)
    if ":" in name:   # module:CONSTANT, a module of ourgrad (codegen.element_reduces) read when kernels are lowered
      module, constant = name.split(":")
      setattr(importlib.import_module(f"ourgrad.{module}"), constant, int(value))
    else: os.environ[name] = value
  clear_caches()   # compiled kernels and schedules made under the settings before
  args = argparse.Namespace(weights=weights, device="CUDA", context=context, position=position, layers=2,
                            sequences=sequences, timed=0, host_breakdown=0)
  jit, _ = profile_models.decode_workload(args)
  assert jit.captured is not None
  items = [item for item in jit.captured.items if isinstance(item.runner, CompiledRunner)]
  launches = [_graph_launch(item) for item in items]
  names = [item.runner.name for item in items]
  device = Device["CUDA"]
  whole = time_graph(CUDAGraph(device, launches), 50)
  print(f"[{setting or 'default'}] {weights}, {sequences} sequence(s), {context} slots, position {position}: "
        f"{len(launches)} kernels (2 blocks), whole step graph {whole * 1e6:.1f} us")
  seen: set[str] = set()
  total = 0.0
  for name, launch in zip(names, launches):
    if name in seen: continue
    seen.add(name)
    seconds = time_graph(CUDAGraph(device, [launch] * repeats), 10) / repeats
    count = names.count(name)
    total += seconds * count
    print(f"  {name:<28} x{count}  {seconds * 1e6:6.2f} us a launch in a chain  grid {launch[1]} block {launch[2]}")
  print(f"  sum over the step's launches {total * 1e6:.1f} us (the step's graph {whole * 1e6:.1f})")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--weights", default="q8_0")
  parser.add_argument("--repeats", type=int, default=64)
  parser.add_argument("--settings", nargs="*", default=[""])
  parser.add_argument("--context", type=int, default=520)
  parser.add_argument("--position", type=int, default=8)
  parser.add_argument("--sequences", type=int, default=1, help="sequences decoded together (a batched step's kernels)")
  args = parser.parse_args()
  for setting in args.settings: probe(args.weights, args.repeats, setting, args.context, args.position, args.sequences)


if __name__ == "__main__":
  main()
