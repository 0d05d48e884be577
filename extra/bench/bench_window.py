"""The memory-bound kernels around examples/mnist.py's max-pools, each timed alone and cold: the max-pool forward
(batchnorm's normalize and the ReLU fused before it), the backward's pick of each window's first maximum, and the
elementwise backward kernels that read the pools' results (each at both blocks), under the hand-coded opts beside
variants, to choose the small-window defaults (codegen/opt/window_tiles.py) from measurements.

Variants: `before` (the heuristic without window tiles: what main chose), `hand` (the current default), then window
tiles with each thread computing 2 or 4 outputs of an outer axis (`outer x2`, `outer x4`), with blocks of 256
threads (`256 threads`), with 2 neighbouring columns per thread (`columns x2`); the elementwise kernels also
`float4 rows` (float4 loads and stores along the columns, threads along the output's columns then rows, even where
a buffer is then also loaded as scalars) and `rows x1` (one output per thread, the same threads); `float2`
and `columns x2 float2` build the kernel for a renderer of float2 vectors (RENDERER_CHANGES), so the window's two
neighbouring columns are one 8-byte load.

Method: the step is scheduled (not run) on the device; each kernel runs on scratch buffers of random values timed by
timing.cold_kernel_seconds (a CUDA graph of many launches over sets of buffers larger than twice the L2: every launch
reads from DRAM). MB counts each buffer once; %copy compares with an ourgrad copy kernel of 2 x 256 MB timed the same
way. Each variant is checked against the unoptimized kernel on random inputs ("ok" / "WRONG").
Run on a CUDA machine from the repository root: `python extra/bench/bench_window.py` (`--only pool` for the pools,
`--variants hand,before`). `--device PYTHON` with EMULATE=CUDA checks the script without a GPU (slow: `--batch 4`).
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this checkout's ourgrad
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # timing.py and kernel_table.py

import ourgrad.codegen.opt.heuristic as heuristic  # noqa: E402
import ourgrad.codegen.opt.window_tiles as window_tiles  # noqa: E402
import ourgrad.engine.packing as packing  # noqa: E402
from ourgrad import Tensor  # noqa: E402
from ourgrad.codegen.kernel import Kernel, KernelOptError, Opt, OptOps  # noqa: E402
from ourgrad.codegen.opt.plans import strategies_left_out  # noqa: E402
from ourgrad.codegen.opt.search import buffer_specs, outputs_match, random_fill, scratch_buffers  # noqa: E402
from ourgrad.device import Device  # noqa: E402
from ourgrad.engine.exec_item import ExecItem  # noqa: E402
from ourgrad.engine.realize import compile_kernel  # noqa: E402
from ourgrad.engine.schedule import create_schedule  # noqa: E402
from ourgrad.ops import Ops  # noqa: E402
from kernel_table import copy_bandwidth  # noqa: E402
from timing import cold_kernel_seconds  # noqa: E402


@contextlib.contextmanager
def settings(**values: int) -> Iterator[None]:
  """window_tiles' module constants set to `values` for the block."""
  saved = {name: getattr(window_tiles, name) for name in values}
  for name, value in values.items(): setattr(window_tiles, name, value)
  try: yield
  finally:
    for name, value in saved.items(): setattr(window_tiles, name, value)


def hand(kernel: Kernel) -> None: kernel.hand_coded_optimizations()


def before(kernel: Kernel) -> None:
  """The heuristic as it was without window tiles and elementwise rows."""
  with strategies_left_out(heuristic.STRATEGIES, "window", "elementwise_rows"): kernel.hand_coded_optimizations()


def with_settings(**values: int) -> Callable[[Kernel], None]:
  def apply(kernel: Kernel) -> None:
    with settings(**values): kernel.hand_coded_optimizations()
  return apply


def columns_x2(kernel: Kernel) -> None:
  """Window unrolled, 2 neighbouring output columns per thread, then window_tiles' thread walk."""
  if not window_tiles.is_window_reduce(kernel): raise KernelOptError("not a window reduce")
  while kernel.first_upcast > kernel.first_loop_reduce: kernel.apply_opt(Opt(OptOps.UNROLL, 0, 0))
  _float_rows(kernel, 2)


def float4_rows(kernel: Kernel) -> None:
  """Elementwise: 4 neighbouring columns per thread (float4 loads and stores), threads along the columns, then rows."""
  if kernel.reduceop is not None: raise KernelOptError("not elementwise")
  _float_rows(kernel, 4)


def rows_x1(kernel: Kernel) -> None:
  """Elementwise: one output per thread, threads along the columns, then rows (4x the threads of the default)."""
  if kernel.reduceop is not None: raise KernelOptError("not elementwise")
  plan = window_tiles.thread_axes(kernel)
  if not plan or not kernel.try_output_opts([Opt(OptOps.LOCAL, axis, amount) for axis, amount in plan]):
    raise KernelOptError(f"no thread plan for {kernel.full_shape}")


def _float_rows(kernel: Kernel, lanes: int) -> None:
  strides = kernel.sts[0].real_strides()
  columns = next(axis for axis in reversed(range(kernel.first_reduce)) if strides[axis] == 1)
  kernel.apply_opt(Opt(OptOps.UPCAST, columns, lanes))
  plan = window_tiles.thread_axes(kernel)
  if not plan or not kernel.try_output_opts([Opt(OptOps.LOCAL, axis, amount) for axis, amount in plan]):
    raise KernelOptError(f"no thread plan for {kernel.full_shape}")


# variants whose kernel is built for a copy of the device's renderer with these attributes: float2 loads (and stores)
# where an unrolled window axis or an upcast column pair has stride 1 (the linearizer's vector loads take the
# renderer's vector_width; CUDA renders any width)
RENDERER_CHANGES: dict[str, dict[str, int]] = {"float2": {"vector_width": 2}, "columns x2 float2": {"vector_width": 2}}

VARIANTS: dict[str, Callable[[Kernel], None]] = {
  "hand": hand,
  "before": before,
  "outer x2": with_settings(WINDOW_OUTER_UPCAST=2, WINDOW_THREADS_PER_PROCESSOR=0),
  "outer x4": with_settings(WINDOW_OUTER_UPCAST=4, WINDOW_THREADS_PER_PROCESSOR=0),
  "256 threads": with_settings(WINDOW_BLOCK_THREADS=256),
  "columns x2": columns_x2,
  "float4 rows": float4_rows,
  "rows x1": rows_x1,
  "float2": hand,
  "columns x2 float2": columns_x2,
}


def step_kernels(device: str, batch: int) -> list[tuple[str, object]]:
  """(role, AST) of the kernels this benchmark times, from one scheduled training step of the small CNN: window
  reduces (a pool forward reads a max, its backward picks the first maximum of each window) and the elementwise
  kernels whose output is a pool's input (the backward through the pool, the ReLU and the batchnorm's normalize)."""
  import mnist
  from ourgrad.nn.losses import cross_entropy
  from ourgrad.nn.optim import Adam
  from ourgrad.nn.state import get_parameters
  os.environ["DEVICE"] = device   # the model's parameters are made on the default device
  # a small batch's pools would join packed kernels (engine/packing.py): the kernels timed here stay alone, as at 256
  packing.PACK_REDUCE_MAX_LOOP = 0
  model = mnist.ConvNet(mnist.MODELS["small"])
  pool_inputs = {batch * 16 * 24 * 24: "pool1", batch * 32 * 8 * 8: "pool2"}
  x, y = Tensor.empty(batch, 1, 28, 28), Tensor.empty(batch, dtype="int32")
  optimizer = Adam([t for t in get_parameters(model) if t.requires_grad], lr=1e-3)
  with Tensor.train():
    optimizer.zero_grad()
    loss = cross_entropy(model(x), y)
    loss.backward()
    outputs = [loss, *optimizer.schedule_step()]
  found, seen = [], set()
  for item in create_schedule([t.lazydata for t in outputs]):
    if item.ast.op is not Ops.STORE or item.ast in seen: continue
    seen.add(item.ast)
    kernel = Kernel(item.ast, Device[device].renderer)
    size = item.outputs[0].size
    if window_tiles.is_window_reduce(kernel):
      pool = next(name for elements, name in pool_inputs.items() if size * 4 == elements)
      # the backward's window reduce (picking each window's first maximum: tensor_conv.py, _window_ranks) reads the
      # forward's maxima, a buffer of its own output's size
      backward = any(buffer.size == size for buffer in item.inputs)
      found.append((f"{pool} " + ("first max (bwd)" if backward else "max (forward)"), item.ast))
    elif kernel.reduceop is None and size in pool_inputs:
      found.append((f"{pool_inputs[size]} elementwise (backward)", item.ast))
  return found


def renderer_for(device: str, variant: str) -> object:
  """The device's renderer, or a copy with RENDERER_CHANGES[variant]."""
  renderer = Device[device].renderer
  if variant not in RENDERER_CHANGES: return renderer
  changed = copy.copy(renderer)
  for name, value in RENDERER_CHANGES[variant].items(): setattr(changed, name, value)
  return changed


def run_on_random_inputs(device: str, kernel: Kernel, seed: int = 0) -> list:
  """The kernel's buffers after one launch on seeded random inputs (search.random_fill, outputs too: places a kernel
  does not store keep the same values in every run)."""
  buffers = scratch_buffers(kernel.ast, device)
  random_fill(buffers, seed)
  compile_kernel(kernel, device)(buffers, wait=True)
  return buffers


def time_variant(device: str, ast: object, name: str, reference: list) -> tuple[str, str, float, bool]:
  """(kernel name, opts, cold seconds, matches the plain kernel's `reference` buffers) of one variant."""
  kernel = Kernel(ast, renderer_for(device, name))
  VARIANTS[name](kernel)
  runner = compile_kernel(kernel, device)
  item = ExecItem(runner, scratch_buffers(ast, device), {}, device)
  seconds = cold_kernel_seconds(item).seconds
  results = run_on_random_inputs(device, kernel)
  stored = sorted({node.arg.idx for node in ast.walk() if node.op is Ops.STORE})
  correct = all(outputs_match(reference[idx], results[idx]) for idx in stored)
  opts = " ".join(f"{opt.op.name[:2]}{opt.axis},{opt.amount}" for opt in kernel.applied_opts)
  return kernel.name, opts, seconds, correct


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--only", default="", help="roles containing this text (pool1, tie, elementwise, ...)")
  parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
  args = parser.parse_args()
  kernels = [(role, ast) for role, ast in step_kernels(args.device, args.batch) if args.only in role]
  copy = copy_bandwidth(args.device, 1 << 26) if args.device == "CUDA" else 0.0
  print(f"{len(kernels)} kernels of the MNIST step (batch {args.batch}) on {args.device}; copy bandwidth "
        f"{copy / 1e9:.0f} GB/s (ourgrad copy kernel, 2 x 256 MB, cold)")
  print(f"{'role':34} {'variant':17} {'kernel':28} {'us':>7} {'MB':>6} {'GB/s':>6} {'%copy':>6}  check  opts")
  for role, ast in kernels:
    megabytes = sum(elements * dtype.itemsize for elements, dtype in buffer_specs(ast)) / 1e6
    reference = run_on_random_inputs(args.device, Kernel(ast, Device[args.device].renderer))   # unoptimized
    timed: dict[tuple, str] = {}   # the opts of each variant timed for this kernel: a variant giving the same is not
    for name in args.variants.split(","):
      try:
        trial = Kernel(ast, renderer_for(args.device, name))
        VARIANTS[name](trial)
      except KernelOptError as error:
        print(f"{role:34} {name:17} does not apply: {error}")
        continue
      key = (tuple(trial.applied_opts), tuple(sorted(RENDERER_CHANGES.get(name, {}).items())))
      if key in timed:
        print(f"{role:34} {name:17} same kernel as {timed[key]}")
        continue
      timed[key] = name
      kernel_name, opts, seconds, correct = time_variant(args.device, ast, name, reference)
      rate = megabytes / 1e3 / seconds
      percent = f"{rate * 1e9 / copy:6.1%}" if copy else "     -"
      print(f"{role:34} {name:17} {kernel_name:28} {seconds * 1e6:7.2f} {megabytes:6.2f} {rate:6.0f} {percent} "
            f" {'ok   ' if correct else 'WRONG'}  {opts}", flush=True)


if __name__ == "__main__":
  main()
