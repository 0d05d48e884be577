"""A/B of a change to the generated C of SmolLM2's CPU decode step, in one process, on a shared machine.

On a CPU that other jobs share, two runs of a decode step minutes apart differ by more than most kernel changes
(other processes' memory traffic changes how long the weights take to stream in). This script captures the jitted
decode step of the installed SmolLM2 GGUF (stored Q4_1/Q8_0 weights, 520 cache slots) once, makes variant B of every
captured kernel by regex replacements on its C source (`--replace PATTERN REPLACEMENT`, Python `re.sub`,
repeatable) or a Python file's `edit(source) -> source` (`--edit-module`), compiles B, and replays the whole step
alternately with A's and B's functions (A B, B A, ...), so both see the same machine. It prints the median thread CPU
time of each (or wall time with `--wall`, for OMP_NUM_THREADS > 1) and the median of the per-round ratios B / A,
and whether B's logits equal A's bit for bit.

    OMP_NUM_THREADS=1 PYTHONPATH=. python extra/bench/cpu_decode_ab.py \\
        --replace '__builtin_prefetch\\([^;]*\\);' '' --rounds 40
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import re
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
from ourgrad import Device  # noqa: E402

from extra.models.generate import smollm2_path  # noqa: E402
from extra.models.llama import Llama  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from profile_models import random_weight_llama  # noqa: E402


def host_calls(items: list[Any]) -> list[tuple[Any, list[Any]]]:
  """Each captured kernel's ctypes function and its arguments (buffer addresses, then its Variables' values): the
  step called from Python one kernel at a time, whichever way TinyJit replays it."""
  return [(item.runner.program.function, [buffer.host_pointer() for buffer in item.bufs] +
           [item.var_vals[name] for name in item.runner.var_names]) for item in items]


def variant_functions(items: list[Any], calls: list[tuple[Any, list[Any]]],
                      edit: Callable[[str], str]) -> tuple[list[Any], int]:
  """The kernel functions with each kernel's source edited by `edit` and compiled (an unchanged source keeps its
  function), and how many launches changed."""
  device = Device["CLANG"]
  compiled: dict[str, Any] = {}
  functions, changed = [], 0
  for item, (function, _) in zip(items, calls):
    source = edit(item.runner.source)
    if source == item.runner.source:
      functions.append(function)
      continue
    if source not in compiled:
      compiled[source] = device.program(item.runner.name, device.compiler.compile_cached(source)).function
    functions.append(compiled[source])
    changed += 1
  return functions, changed


def load_edit(path: str) -> Callable[[str], str]:
  """The `edit(source) -> source` function of the Python file at `path`."""
  spec = importlib.util.spec_from_file_location("cpu_decode_edit", path)
  assert spec is not None and spec.loader is not None, f"cannot load {path}"
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.edit


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--replace", nargs=2, action="append", default=[], metavar=("PATTERN", "REPLACEMENT"),
                      help="a regex replacement applied to every kernel's C source for variant B")
  parser.add_argument("--edit-module", help="a Python file defining edit(source) -> source, applied after --replace")
  parser.add_argument("--rounds", type=int, default=30, help="A/B pairs of whole-step replays")
  parser.add_argument("--wall", action="store_true", help="wall time (perf_counter) instead of this thread's CPU time")
  parser.add_argument("--position", type=int, default=12, help="the decode position the step is captured at")
  parser.add_argument("--weights", default="stored", choices=("stored", "q8_0"),
                      help="the installed GGUF's stored weights, or random Q8_0 weights (profile_models.py's)")
  args = parser.parse_args()

  module_edit = load_edit(args.edit_module) if args.edit_module else None

  def edit(source: str) -> str:
    for pattern, replacement in args.replace: source = re.sub(pattern, replacement, source)
    return module_edit(source) if module_edit is not None else source
  if args.weights == "stored":
    model, _ = Llama.from_gguf(smollm2_path(), 520, "CLANG", symbolic=False, dtype="stored")
  else:
    model = random_weight_llama(argparse.Namespace(device="CLANG", layers=0, weights="q8_0", context=520,
                                                   sequences=1))
  for position in range(args.position - 3, args.position + 1): model.decode([5], [position]).numpy()
  items = model._decode_jit.captured.items
  calls = host_calls(items)
  functions = {"A": [function for function, _ in calls]}
  functions["B"], changed = variant_functions(items, calls, edit)
  print(f"variant B: {changed} of {len(items)} launches changed")
  logits = items[-1].bufs[0]

  def run(name: str) -> float:
    clock = time.perf_counter if args.wall else time.thread_time
    started = clock()
    for function, (_, arguments) in zip(functions[name], calls): function(*arguments)
    return clock() - started
  outputs = {}
  for name in "AB":
    run(name)
    outputs[name] = logits.numpy().copy()
  print(f"B's logits equal A's bit for bit: {np.array_equal(outputs['A'], outputs['B'])} "
        f"(max |B - A| {float(np.abs(outputs['A'] - outputs['B']).max()):.3g})")
  times: dict[str, list[float]] = {"A": [], "B": []}
  for round_number in range(args.rounds):
    for name in ("AB" if round_number % 2 == 0 else "BA"): times[name].append(run(name))
  unit = "wall" if args.wall else "thread CPU"
  for name in "AB":
    print(f"{name}: {unit} median {statistics.median(times[name]) * 1e3:.2f} ms, min {min(times[name]) * 1e3:.2f} ms")
  ratios = [b / a for a, b in zip(times["A"], times["B"])]
  print(f"B / A per round: median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
  main()
