"""Fuzz kernel optimizations: random legal Opt sequences must not change a kernel's results.

Each case draws a random program with `graphgen` (reduce- and matmul-heavy), schedules its output and walks the
schedule. For every kernel it compiles the plain loop nest (no Opts, as NOOPT=1) and several optimized variants
of the same AST: the hand-coded heuristic and random sequences of UPCAST / UNROLL / LOCAL / GROUP / GROUPTOP /
PADTO with random axes and amounts (mostly divisors of the axis, sometimes not; PADTO pads an output axis to a
multiple); GROUP and LOCAL apply on devices with thread blocks and local memory (PYTHON, OPENCL). An
Opt that raises KernelOptError is skipped, and must leave the kernel exactly as it was (views, upcasts, locals,
applied opts). Each variant runs on the kernel's real inputs into a fresh output buffer and must match the plain
kernel: exactly for integers, bools and max-reductions, to 1e-5 of the magnitude for float sums (an UNROLL
reorders the additions). The plain kernel's output feeds the next kernels, and the final output is checked
against the numpy mirror too.

Half the cases build their graph with the GPU split-K thresholds scaled down (`small_split_reduces`), so the
partial-sum and reduce-over-parts kernels of few-output reduces are fuzzed too on the devices with thread blocks.

Bugs it found have minimized repros in test_regressions.py.

Devices: CLANG, and OPENCL and PYTHON (which have thread blocks, so LOCAL and GROUP apply) and LLVM when they open.
`DEVICE=PYTHON EMULATE=CUDA` fuzzes with CUDA's limits (1024 threads, warp shuffles), as CI does.
Run: `python test/fuzz/fuzz_opts.py --iterations 500 --seed N [--devices PYTHON]`; `--case I` replays one case.
"""
from __future__ import annotations

import argparse
import contextlib
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fuzz_graphs import ALL_DEVICES, device_available  # noqa: E402
from fuzzing import Case, Check, main, random_seed, run_for_pytest  # noqa: E402
from graphgen import compare, random_graph  # noqa: E402

from ourgrad.codegen.opt import split_reduce  # noqa: E402
from ourgrad.codegen.kernel import Kernel, KernelOptError, Opt, OptOps  # noqa: E402
from ourgrad.device import Buffer, Device  # noqa: E402
from ourgrad.engine.realize import compile_kernel, run_schedule  # noqa: E402
from ourgrad.engine.schedule import ScheduleItem, create_schedule  # noqa: E402
from ourgrad.ops import Ops  # noqa: E402

WEIGHTS = {"unary": 3, "binary": 4, "where": 1, "reduce": 5, "matmul": 3, "movement": 4}
OPT_KINDS = [OptOps.UPCAST] * 8 + [OptOps.UNROLL] * 6 + [OptOps.LOCAL] * 5 + [OptOps.GROUP] * 4 + \
  [OptOps.GROUPTOP] * 3 + [OptOps.PADTO] * 2


def kernel_state(kernel: Kernel) -> tuple:
  return (tuple(kernel.sts), kernel.upcasted, kernel.local_dims, kernel.group_dims, kernel.groups_outer,
          tuple(kernel.applied_opts), kernel.full_shape)


def random_opt(rng: random.Random, kernel: Kernel) -> Opt:
  """A random Opt, biased toward ones that fit: an axis of the right kind and an amount that divides it."""
  op = rng.choice(OPT_KINDS)
  if op in (OptOps.UNROLL, OptOps.GROUP, OptOps.GROUPTOP):
    reduce_axes = kernel.first_upcast - kernel.first_loop_reduce
    axis = rng.randrange(max(reduce_axes, 1)) if rng.random() < 0.9 else rng.randint(-1, 4)
    position = kernel.first_loop_reduce + axis
    size = kernel.full_shape[position] if 0 <= position < kernel.shape_len else 1
  else:
    axis = rng.randrange(max(kernel.first_reduce, 1)) if rng.random() < 0.9 else rng.randint(-1, 5)
    size = kernel.full_shape[axis] if 0 <= axis < kernel.shape_len else 1
  divisors = [amount for amount in range(2, min(size, 32) + 1) if size % amount == 0]
  if divisors and rng.random() < 0.75: amount = rng.choice(divisors + [0])  # 0 means the whole axis
  else: amount = rng.choice([0, 2, 3, 4, 5, 8, 16])
  return Opt(op, axis, amount)


def optimized_kernel(item: ScheduleItem, device: str, rng: random.Random | None) -> tuple[Kernel, list[str]]:
  """The item's kernel with the hand-coded opts (rng None) or a random Opt sequence; also the refused opts."""
  kernel = Kernel(item.ast, Device[device].renderer)
  refused: list[str] = []
  if rng is None:
    kernel.hand_coded_optimizations()
    return kernel, refused
  for _ in range(rng.randint(1, 6)):
    opt = random_opt(rng, kernel)
    before = kernel_state(kernel)
    try:
      kernel.apply_opt(opt)
    except KernelOptError:
      refused.append(repr(opt))
      assert kernel_state(kernel) == before, f"a refused {opt} changed the kernel: {before} -> {kernel_state(kernel)}"
  return kernel, refused


def run_kernel(kernel: Kernel, item: ScheduleItem, device: str, output: Buffer) -> np.ndarray:
  runner = compile_kernel(kernel, device)
  runner((output,) + item.inputs)
  return output.numpy()


def same(got: np.ndarray, plain: np.ndarray, is_float: bool, inputs_scale: float) -> bool:
  """Equal for integers and bools; for floats within 1e-5 of the magnitudes involved (opts may contract a*b+c into
  an FMA or keep partial sums in another order)."""
  if not is_float: return bool(np.array_equal(got, plain))
  scale = max(float(np.max(np.abs(plain))) if plain.size else 0.0, inputs_scale)
  return bool(np.all(np.abs(got.astype(np.float64) - plain) <= 1e-5 * (1 + scale)))


@contextlib.contextmanager
def small_split_reduces(enabled: bool):
  """With `enabled`, the GPU split reduces (codegen/opt/split_reduce.py) scaled down to the fuzzer's small shapes (a
  device of 8 multiprocessors, parts of 2 elements), so reduces with few outputs are built as partial sums plus a
  reduce over the parts on GPU devices."""
  names = ("FACTS_OVERRIDE", "MIN_PART_ROWS", "MIN_PART_COLUMNS", "MIN_PART_MATMUL")
  saved = {name: getattr(split_reduce, name) for name in names}
  if enabled:
    for name, value in zip(names, (split_reduce.SplitFacts(8, 2048), 2, 2, 2)): setattr(split_reduce, name, value)
  try:
    yield
  finally:
    for name, value in saved.items(): setattr(split_reduce, name, value)


def make_check(devices: list[str], variants: int) -> Check:
  def check_case(case: Case) -> str:
    rng = case.rng
    gen, graph = random_graph(rng, 2, 8, WEIGHTS)
    case.log(graph.program())
    output_node = graph.nodes[graph.outputs[0]]
    counts = {"cases": 1, "kernels": 0, "variants": 0, "opts applied": 0, "opts refused": 0}
    split = rng.random() < 0.5
    case.log(f"split-K thresholds scaled down: {split}")
    for device in devices:
      with small_split_reduces(split): output = graph.build(device)[output_node.name]
      schedule = create_schedule([output.lazydata])
      for number, item in enumerate(schedule):
        if item.ast.op is not Ops.STORE:
          run_schedule([item])
          continue
        for buffer in item.outputs: buffer.allocate()
        counts["kernels"] += 1
        results: list[tuple[str, np.ndarray]] = []
        # the variants first: they write fresh buffers and read the inputs the plain kernel may overwrite (assign)
        for variant in range(variants):
          kernel, refused = optimized_kernel(item, device, None if variant == 0 else rng)
          counts["variants"] += 1
          counts["opts applied"] += len(kernel.applied_opts)
          counts["opts refused"] += len(refused)
          label = f"{device} kernel {number} {kernel.name} opts {kernel.applied_opts} (refused {refused})"
          case.log(label)
          fresh = Buffer(device, item.outputs[0].size, item.outputs[0].dtype).allocate()
          results.append((label, run_kernel(kernel, item, device, fresh)))
        plain = run_kernel(Kernel(item.ast, Device[device].renderer), item, device, item.outputs[0])
        inputs_scale = max([float(np.max(np.abs(buffer.numpy().astype(np.float64)))) for buffer in item.inputs
                            if buffer.size and buffer.dtype.is_float] + [0.0])
        for label, got in results:
          if not same(got, plain, item.outputs[0].dtype.is_float, inputs_scale):
            bad = np.argwhere(~np.isclose(got, plain, rtol=1e-5, atol=1e-5)).ravel()
            raise AssertionError(f"{label} differs from the plain kernel at flat index {bad[:8].tolist()}:\n"
                                 f"optimized {np.array2string(got, threshold=40)}\n"
                                 f"plain     {np.array2string(plain, threshold=40)}")
      compare(output.numpy(), output_node, f"{device} plain-kernel output v{output_node.index}")
    return counts
  return check_case


# ---------------------------------------------------------------- pytest and command line

# (cases, optimized variants per kernel: the hand-coded one plus random ones) per test; OPENCL's PoCL compiles
# ~1 s a kernel, so it runs few (the PYTHON device covers LOCAL and GROUP at length)
BUDGET = {"CLANG": (16, 3), "OPENCL": (2, 3), "LLVM": (40, 4), "PYTHON": (100, 4)}


@pytest.mark.parametrize("device", ALL_DEVICES)
@pytest.mark.parametrize("seed", [0])
def test_opts_fixed_seed(device: str, seed: int) -> None:
  if not device_available(device): pytest.skip(f"{device} does not open here")
  cases, variants = BUDGET[device]
  run_for_pytest("fuzz_opts", make_check([device], variants), seed, cases, f" --devices {device} --variants {variants}")


@pytest.mark.parametrize("device", ALL_DEVICES)
def test_opts_random_seed(device: str) -> None:
  if not device_available(device): pytest.skip(f"{device} does not open here")
  cases, variants = BUDGET[device]
  run_for_pytest("fuzz_opts", make_check([device], variants), random_seed(), cases,
                 f" --devices {device} --variants {variants}")


if __name__ == "__main__":
  def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", default=",".join(ALL_DEVICES), help="comma-separated devices (unavailable skip)")
    parser.add_argument("--variants", type=int, default=4, help="optimized variants per kernel (hand-coded first)")

  def make_check_from_args(args: argparse.Namespace) -> Any:
    devices = [name for name in args.devices.upper().split(",") if device_available(name)]
    print(f"devices: {devices}")
    return make_check(devices, args.variants)

  main("fuzz_opts", make_check_from_args, 200, add_arguments)
