"""Per-kernel device times of one replayed TinyJit training step (the MLP and the examples/mnist.py CNN of
bench_jit.py), for finding which kernels keep a jitted step from its goal.

Run under Nsight Compute on a CUDA machine; only the replay between cuProfilerStart and cuProfilerStop is profiled:
  ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
      python extra/bench/profile_jit_step.py --model mlp
`--model cnn` profiles the CNN step; `--plain-sum-order --no-sibling-reduces` builds it as main did before the
canonical order of index sums and sibling reduces (a side-by-side baseline in one session). Without ncu the script
only runs the steps (a smoke test). The last line lists the megabytes each item reads and writes (each buffer once),
for its GB/s next to ncu's time.

ncu's times in the per-kernel table of bench_reduce.py --only-mnist (%copy, %same, roles), beside the cold CUDA-graph
times of extra/bench/timing.py: run under ncu with `--copies` (the copy kernels the table compares with launch once
each inside the profiled range, after the step) writing the CSV to a file, then again without ncu with `--table`:
  ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
      --log-file cnn.csv python extra/bench/profile_jit_step.py --model cnn --copies
  python extra/bench/profile_jit_step.py --model cnn --table cnn.csv
"""
from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_jit import MLP, load_mnist_example, ourgrad_step  # noqa: E402
from kernel_table import (LARGE_COPY_ELEMENTS, CopyReference, KernelKinds, KernelRow, MnistRoles,  # noqa: E402
                          copy_item, floor_seconds, ncu_kernel_seconds, print_table)
from timing import cold_kernel_seconds  # noqa: E402

import ourgrad.engine.multi_output as multi_output  # noqa: E402
import ourgrad.shape.symbolic as symbolic  # noqa: E402
from ourgrad import Device, Tensor, TinyJit  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--plain-sum-order", action="store_true",
                      help="index sums in the order their terms were added (symbolic.CANONICAL_SUM_ORDER off)")
  parser.add_argument("--no-sibling-reduces", action="store_true",
                      help="every reduce in a kernel of its own (multi_output.SIBLING_REDUCES off)")
  parser.add_argument("--no-combined-sibling-reduces", action="store_true",
                      help="a kernel's value combines one reduce, others stored first (batchnorm's forward second "
                           "stages as main built them before: multi_output.COMBINED_SIBLING_REDUCES off)")
  parser.add_argument("--copies", action="store_true",
                      help="after the step, inside the profiled range, launch once each the ourgrad copy kernels the "
                           "table compares with (one per power of two of the items' bytes, then 2 x 256 MB)")
  parser.add_argument("--table", metavar="FILE.csv",
                      help="print the per-kernel table with the times of this ncu CSV (a run with --copies under "
                           "ncu --csv --log-file) beside the cold times measured now")
  args = parser.parse_args()
  symbolic.CANONICAL_SUM_ORDER = not args.plain_sum_order
  multi_output.SIBLING_REDUCES = not args.no_sibling_reduces
  multi_output.COMBINED_SIBLING_REDUCES = not args.no_combined_sibling_reduces
  os.environ["DEVICE"] = args.device
  if args.model == "mlp": make_model, shape, batch = MLP, (784,), 512
  else:
    mnist = load_mnist_example()
    make_model, shape, batch = (lambda: mnist.ConvNet(mnist.MODELS["small"])), (1, 28, 28), 256
  rng = np.random.default_rng(0)
  x = Tensor(rng.standard_normal((batch, *shape)).astype(np.float32), device=args.device).realize()
  y = Tensor(rng.integers(0, 10, batch).astype(np.int32), device=args.device).realize()
  step = TinyJit(ourgrad_step(make_model())[0])
  for _ in range(4): step(x, y)
  Device[args.device].synchronize()
  items = step.captured.items
  copies = [copy_item(args.device, elements) for elements in copy_elements(items)] if args.copies else []
  driver = ctypes.CDLL("libcuda.so.1") if args.device == "CUDA" and not args.table else None
  if driver is not None: driver.cuProfilerStart()
  step(x, y)
  for copy in copies: copy.run()
  Device[args.device].synchronize()
  if driver is not None: driver.cuProfilerStop()
  if args.table:
    roles = MnistRoles(mnist.MODELS["small"], batch) if args.model == "cnn" else None
    print_ncu_table(args.device, items, pathlib.Path(args.table).read_text(), roles)
  if copies: print(f"{args.model}: {len(copies)} copy kernels after the step (--copies), float32 elements: "
                  f"{' '.join(str(count) for count in copy_elements(items))}")
  names = [getattr(item.runner, "name", type(item.runner).__name__) for item in items]
  print(f"{args.model}: {len(names)} captured items: {' '.join(names)}")
  # bytes each item moves (every buffer it touches, once): with ncu's times, its GB/s and % of copy bandwidth
  print(f"{args.model}: MB per item, launch order: " +
        " ".join(f"{name}:{sum({id(b): b.nbytes for b in item.bufs}.values()) / 1e6:.2f}"
                 for name, item in zip(names, step.captured.items)))


def copy_elements(items: list) -> list[int]:
  """The float32 elements of each copy kernel the table compares with, in launch order: one per power of two of the
  items' bytes (CopyReference.bucket), then the large copy."""
  buckets = sorted({CopyReference.bucket(item.runner.byte_count) for item in items})
  return [bucket // 8 for bucket in buckets] + [LARGE_COPY_ELEMENTS]


def print_ncu_table(device: str, items: list, csv_text: str, roles: MnistRoles | None) -> None:
  """The per-kernel table with ncu's times (the first len(items) launches of the CSV are the step's, the rest its
  --copies in copy_elements' order) and each kernel's cold time measured now."""
  measured = ncu_kernel_seconds(csv_text)
  step_times, copy_times = measured[:len(items)], measured[len(items):]
  names = [item.runner.name for item in items]
  if [name for name, _ in step_times] != names:
    print(f"warning: the CSV's first {len(items)} kernels are not this step's ({len(measured)} in the CSV)")
  kinds = KernelKinds(device)
  kinds.update()
  step_kinds = [kinds.get(item.runner) for item in items]
  forward = roles.forward_flags(step_kinds) if roles is not None else [False] * len(items)
  elements = copy_elements(items)
  if len(copy_times) == len(elements):
    ncu_copy = {count: seconds for count, (_, seconds) in zip(elements, copy_times)}
    reference = CopyReference(device, LARGE_COPY_ELEMENTS, lambda _, count: 2 * count * 4 / ncu_copy[count],
                              with_torch=False)
    source = "ncu's times of the ourgrad copy kernels launched with --copies"
  else:
    reference = CopyReference(device)
    source = "cold times (the CSV has no --copies kernels)"
  cold: dict[tuple, float] = {}
  rows = []
  for item, (_, seconds), kind, is_forward in zip(items, step_times, step_kinds, forward):
    runner = item.runner
    key = (id(runner), tuple((buffer.size, buffer.dtype) for buffer in item.bufs))
    if key not in cold: cold[key] = cold_kernel_seconds(item).seconds
    role = roles.role(kind, is_forward) if roles is not None else ""
    rows.append(KernelRow(runner.name, runner.display_name, seconds, cold[key], runner.byte_count, runner.op_count,
                          KernelKinds.describe(kind), role))
  print(f"{len(rows)} kernels: ncu sum {sum(row.seconds for row in rows) * 1e3:.3f} ms, cold CUDA-graph sum "
        f"{sum(row.event_seconds or 0.0 for row in rows) * 1e3:.3f} ms; copy references: {source}")
  print(reference.describe())
  print(f"floor: a one-element kernel timed cold takes {floor_seconds(device) * 1e6:.2f} us")
  print_table(rows, reference, "ncu ms", "cold ms")


if __name__ == "__main__":
  main()
