"""BatchNorm statistics of the examples/mnist.py CNN step (batch 256) on a GPU, kernel by kernel, under several
choices of the split (codegen/opt/split_reduce.py) and the GROUP heuristic (codegen/opt/heuristic.py): which one
moves the most bytes per second.

    python extra/bench/bench_bnstats.py                       # every variant, device-timed launches (CUDA events)
    python extra/bench/bench_bnstats.py --variants default    # only the defaults
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        python extra/bench/bench_bnstats.py --iters 1 --warmup 0    # exact per-kernel times (launch order printed)

Workloads: per-channel sums over N, H, W of MNIST's two batchnorm inputs, (256, 16, 24, 24) and (256, 32, 8, 8):
the mean's sum, the variance's sum of squares around a mean, the backward's sum of a product of two full-size
tensors, and of the input with a 2x2 pool's gradient spread over its windows (H and W do not merge), three sums over
the same two inputs ("sums3": sibling reduces, one kernel, or three with the "apart" variant); then the
column sums of a batch's gradient (the MLP step's bias gradients). Each
variant's result is checked against numpy before it is timed. '%copy' is GB/s over the GB/s of an ourgrad copy
kernel of 2 x 64 MB timed the same way. The event-timed runs read inputs the previous launch left in the L2 (50 MB
on an H100; in the training step the convolution has just written them too); ncu flushes the caches before each
kernel (DRAM-cold times), and each event time includes a few microseconds of launch.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import pathlib
import statistics
import sys
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad

import ourgrad.codegen.opt.heuristic as heuristic  # noqa: E402
import ourgrad.engine.multi_output as multi_output  # noqa: E402
from ourgrad.codegen.opt import split_reduce  # noqa: E402
from ourgrad import Tensor  # noqa: E402
from ourgrad.engine import realize  # noqa: E402
from ourgrad.engine.realize import get_runner  # noqa: E402
from ourgrad.engine.schedule import create_schedule  # noqa: E402

SHAPES = ((256, 16, 24, 24), (256, 32, 8, 8))


def _wave(blocks: int) -> split_reduce.SplitFacts:
  """split_reduce's facts of a device whose wave is `blocks` blocks of 256 threads (2048 resident a multiprocessor),
  a launch never too dear: the split's parts aim at that many blocks."""
  return split_reduce.SplitFacts(max(blocks * 256 // 2048, 1), 2048, 0)

# name -> {(module, constant): value}; "default" changes nothing. "before" is the choice of main before this branch
# (2 GROUP axes of any divisor, no unroll, parts by the 1024-element minimum only).
VARIANTS: dict[str, dict[tuple[Any, str], Any]] = {
  "default": {},
  "before": {(heuristic, "GROUP_MAX_AXES"): 2, (heuristic, "GROUP_LOOP_UNROLL"): 1,
             (heuristic, "GROUP_POWERS_OF_TWO"): False, (split_reduce, "FACTS_OVERRIDE"): _wave(1 << 18)},
  "blocks512": {(split_reduce, "FACTS_OVERRIDE"): _wave(512)},
  "blocks2048": {(split_reduce, "FACTS_OVERRIDE"): _wave(2048)},
  "blocks4096": {(split_reduce, "FACTS_OVERRIDE"): _wave(4096)},
  "unroll1": {(heuristic, "GROUP_LOOP_UNROLL"): 1},
  "unroll8": {(heuristic, "GROUP_LOOP_UNROLL"): 8, (heuristic, "GROUP_SHORT_LOOP"): 64},
  "axes2": {(heuristic, "GROUP_MAX_AXES"): 2},
  "anydivisor": {(heuristic, "GROUP_POWERS_OF_TWO"): False},
  "threads128": {(heuristic, "BLOCK_THREADS"): 128},
  "threads512": {(heuristic, "BLOCK_THREADS"): 512, (split_reduce, "FACTS_OVERRIDE"): _wave(512)},
  "part4096": {(split_reduce, "MIN_PART_ROWS"): 4096},
  "lanes8": {(heuristic, "GROUP_COALESCED_LANES"): 8},
  "col8": {(heuristic, "COLUMN_LOCALS"): 8},
  "col16": {(heuristic, "COLUMN_LOCALS"): 16},
  # sibling reduces over a common input in kernels of their own (main before this branch): the "sums3" workload
  "apart": {(multi_output, "SIBLING_REDUCES"): False},
}
# column sums of a training step (the MLP's bias gradients over a batch of 512): few blocks of LOCAL x GROUPTOP
COLUMN_SHAPES = ((512, 512), (256, 512))


def workloads(shape: tuple[int, ...], rng: np.random.Generator,
              device: str) -> list[tuple[str, Callable[[], Tensor | list[Tensor]], np.ndarray, int]]:
  """(name, build, numpy reference, bytes read) per statistic of one batchnorm input shape."""
  x_np = rng.standard_normal(shape).astype(np.float32)
  g_np = rng.standard_normal(shape).astype(np.float32)
  pooled_shape = (shape[0], shape[1], shape[2] // 2, shape[3] // 2)
  p_np = rng.standard_normal(pooled_shape).astype(np.float32)
  mean_np = x_np.mean(axis=(0, 2, 3), keepdims=True)
  x, g = Tensor(x_np, device=device).realize(), Tensor(g_np, device=device).realize()
  p = Tensor(p_np, device=device).realize()
  mean = Tensor(mean_np, device=device).realize()
  axes = (0, 2, 3)
  # a 2x2 max-pool's gradient seen at full size (each pooled value over its window): H and W cannot merge, as in the
  # CNN step's batchnorm backward after a pool
  def spread(pooled: Tensor) -> Tensor:
    windows = pooled.reshape(*pooled_shape[:3], 1, pooled_shape[3], 1)
    return windows.expand(*pooled_shape[:3], 2, pooled_shape[3], 2).reshape(*shape)
  spread_np = np.repeat(np.repeat(p_np, 2, axis=2), 2, axis=3)
  return [
    ("sum", lambda: x.sum(axis=axes), x_np.sum(axis=axes), x_np.nbytes),
    ("sumsq", lambda: (x - mean).square().sum(axis=axes), np.square(x_np - mean_np).sum(axis=axes), x_np.nbytes),
    ("backward", lambda: (g * (x - mean)).sum(axis=axes), (g_np * (x_np - mean_np)).sum(axis=axes), 2 * x_np.nbytes),
    ("bwd-pool", lambda: (spread(p) * (x - mean)).sum(axis=axes), (spread_np * (x_np - mean_np)).sum(axis=axes),
     x_np.nbytes + p_np.nbytes),
    # three sums over the same two inputs, as a batchnorm backward's (the bias's, the weight's, the variance's):
    # sibling reduces, one kernel of three outputs (multi_output.py) unless the "apart" variant
    ("sums3", lambda: [g.sum(axis=axes), (g * x).sum(axis=axes), (g * x * x).sum(axis=axes)],
     np.concatenate([g_np.sum(axis=axes), (g_np * x_np).sum(axis=axes), (g_np * x_np * x_np).sum(axis=axes)]),
     2 * x_np.nbytes),
  ]


def column_workloads(shape: tuple[int, ...], rng: np.random.Generator,
                     device: str) -> list[tuple[str, Callable[[], Tensor], np.ndarray, int]]:
  """The column sum of a (batch, features) gradient: a bias's gradient."""
  g_np = rng.standard_normal(shape).astype(np.float32)
  g = Tensor(g_np, device=device).realize()
  return [("colsum", lambda: g.sum(axis=0), g_np.sum(axis=0), g_np.nbytes)]


def apply_variant(settings: dict[tuple[Any, str], Any]) -> dict[tuple[Any, str], Any]:
  """Set the variant's constants; returns the old values."""
  old = {(module, name): getattr(module, name) for module, name in settings}
  for (module, name), value in settings.items(): setattr(module, name, value)
  return old


def run_kernels(device: str, build: Callable[[], Tensor | list[Tensor]], iters: int, warmup: int,
                launches: list[str]) -> tuple[list[tuple[str, float, int]], np.ndarray]:
  """(name, median device seconds, block count) per kernel of `build()`'s schedule, and the result (the results of
  several outputs one after another)."""
  built = build()
  outputs = built if isinstance(built, list) else [built]
  schedule = create_schedule([output.lazydata for output in outputs])
  times: list[list[float]] = [[] for _ in schedule]
  runners = [get_runner(device, item.ast) for item in schedule]
  for item in schedule:
    for buffer in item.outputs: buffer.allocate()
  for round_number in range(iters + warmup):
    for index, (item, runner) in enumerate(zip(schedule, runners)):
      seconds = runner(item.bufs, wait=True) or 0.0
      if round_number >= warmup: times[index].append(seconds)
      launches.append(runner.name)
  # each output's realized buffer, read as it is (no kernel: the launch order stays the profiled one)
  result = np.concatenate([output.lazydata.base.realized.numpy().reshape(-1) for output in outputs])
  blocks = [int(np.prod(runner.global_size)) for runner in runners]
  return [(runner.name, statistics.median(t) if t else 0.0, b) for runner, t, b in zip(runners, times, blocks)], result


def copy_seconds(device: str, elements: int, iters: int, warmup: int, launches: list[str]) -> float:
  padded = Tensor(np.random.randn(elements // 1024, 1032).astype(np.float32), device=device).realize()
  source = padded[:, :1024]
  kernels, _ = run_kernels(device, lambda: source + 1.0, iters, warmup, launches)
  return sum(seconds for _, seconds, _ in kernels)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
  parser.add_argument("--batch", type=int, default=256, help="a smaller batch makes a smoke test (DEVICE=PYTHON)")
  args = parser.parse_args()
  os.environ["DEVICE"] = args.device
  driver = ctypes.CDLL("libcuda.so.1") if args.device == "CUDA" else None
  launches: list[str] = []
  Tensor([0.0], device=args.device).realize()   # a buffer copied in: the device (its context) is open for ncu
  if driver is not None: driver.cuProfilerStart()
  copy_elements = 1 << 24 if args.batch == 256 else 1 << 14
  copy_bw = 2 * copy_elements * 4 / copy_seconds(args.device, copy_elements, max(args.iters, 3), args.warmup, launches)
  print(f"copy bandwidth (ourgrad copy kernel, 2 x {copy_elements * 4 >> 20} MB): {copy_bw / 1e9:.0f} GB/s")
  print(f"{'shape':18s} {'stat':9s} {'variant':11s} {'total us':>9s} {'GB/s':>7s} {'%copy':>6s}  kernels (us, blocks)")
  rng = np.random.default_rng(0)
  shapes = [(args.batch, *shape[1:]) for shape in SHAPES] + \
    [shape if args.batch == 256 else (args.batch, *shape[1:]) for shape in COLUMN_SHAPES]
  for shape in shapes:
    for stat, build, reference, nbytes in (workloads(shape, rng, args.device) if len(shape) == 4 else
                                           column_workloads(shape, rng, args.device)):
      for variant in args.variants.split(","):
        old = apply_variant(VARIANTS[variant])
        realize._runner_cache.clear()   # the same AST gets the variant's opts, not the cached kernel
        try:
          kernels, result = run_kernels(args.device, build, args.iters, args.warmup, launches)
        finally:
          apply_variant(old)
        ok = np.allclose(result, reference.reshape(-1), rtol=1e-3, atol=1e-2 * np.sqrt(np.prod(shape) / shape[1]))
        total = sum(seconds for _, seconds, _ in kernels)
        detail = " ".join(f"{name}({seconds * 1e6:.1f},{blocks})" for name, seconds, blocks in kernels)
        print(f"{str(shape):18s} {stat:9s} {variant:11s} {total * 1e6:9.1f} {nbytes / total / 1e9:7.0f} "
              f"{nbytes / total / copy_bw:6.1%}  {detail}{'' if ok else '  WRONG RESULT'}", flush=True)
  if driver is not None: driver.cuProfilerStop()
  print("launch order (for ncu's rows):", " ".join(launches))


if __name__ == "__main__":
  main()
