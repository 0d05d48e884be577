"""Sweep the first kernel of a split column reduce (a Linear bias gradient, a LayerNorm weight gradient: few outputs,
a long reduce across the contiguous axis) over its layout: parts of the reduce (P), GROUPTOP threads along a part
(G), outputs per thread as a vector (V: UPCAST of the contiguous output axis) and the per-thread loop unrolled (U).
Each row: the cold time of that first kernel (timing.cold_kernel_seconds: every launch reads from DRAM), its GB/s
and %copy, and the library's own choice (both kernels) for comparison. Used to fit split_reduce.py's rule on a GPU;
`--device PYTHON --tokens 256` checks the script anywhere.
The "step form" workloads split as the GPT-2 step's reduces are split: dy of (batch, sequence, width) summed over
(0, 1), its longest reduce axis (the sequence) cut into parts, so a part is a piece of every sequence of the batch
and a block's GROUP threads read rows a sequence apart; the plain ones cut the tokens into contiguous parts. The
"weight+bias" workloads are the LayerNorm weight gradient and the bias gradient (sum of the same dy) as one kernel of
sibling reduces (engine/multi_output.py), as the step runs them.
Run: `python extra/bench/sweep_fewout.py` (about 30 s on an H200); `--only NAME,...` (substrings of the workload
names) and `--layouts P:G:V:U,...` choose fewer.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ourgrad import Tensor  # noqa: E402
from ourgrad.codegen.kernel import Kernel, Opt, OptOps  # noqa: E402
from ourgrad.codegen.opt import split_reduce  # noqa: E402
from ourgrad.device import Device  # noqa: E402
from ourgrad.engine.exec_item import ExecItem  # noqa: E402
from ourgrad.engine.realize import compile_kernel  # noqa: E402
from ourgrad.engine.schedule import create_schedule  # noqa: E402
from kernel_table import CopyReference  # noqa: E402
from timing import cold_kernel_seconds, cold_schedule_seconds  # noqa: E402

# (parts, group threads, vector outputs, unroll); the first is the heuristic's layout for 4096 x 768
LAYOUTS = [(32, 8, 1, 1), (32, 8, 1, 16), (32, 8, 4, 1), (32, 32, 4, 1), (64, 8, 1, 1), (64, 8, 1, 8),
           (64, 8, 2, 1), (64, 8, 2, 8), (64, 8, 4, 1), (64, 8, 4, 8), (64, 16, 4, 1), (128, 8, 4, 1), (128, 8, 2, 1),
           (256, 4, 4, 1)]
# parts whose second kernel (the sum over the parts, alone: in a training step it shares a packed launch) is timed
SECOND_PARTS = (32, 64, 128)


def _bias(inputs: list[Tensor], parts: int) -> Tensor:
  x = inputs[0]
  return x.reshape(parts, x.shape[0] // parts, x.shape[1]).sum(1)


def _layernorm_weight(inputs: list[Tensor], parts: int) -> Tensor:
  x, mean, rstd, dy = inputs
  value = (x - mean) * rstd * dy
  return value.reshape(parts, x.shape[0] // parts, x.shape[1]).sum(1)


# sequences in the batch of the step form (GPT-2's 8 x 512)
STEP_BATCH = 8


def _step_parts(value: Tensor, parts: int) -> Tensor:
  """(tokens, width) as (batch, sequence, width) summed over (0, 1), the sequence in `parts` parts (parts first)."""
  width = value.shape[-1]
  sequence = value.shape[0] // STEP_BATCH
  split = value.reshape(STEP_BATCH, parts, sequence // parts, width).permute(1, 0, 2, 3)
  return split.sum((1, 2))


def _bias_step(inputs: list[Tensor], parts: int) -> Tensor: return _step_parts(inputs[0], parts)


def _layernorm_weight_and_bias(inputs: list[Tensor], parts: int) -> list[Tensor]:
  x, mean, rstd, dy = inputs
  return [_layernorm_weight(inputs, parts), dy.reshape(parts, x.shape[0] // parts, x.shape[1]).sum(1)]


def _layernorm_weight_and_bias_step(inputs: list[Tensor], parts: int) -> list[Tensor]:
  x, mean, rstd, dy = inputs
  return [_step_parts((x - mean) * rstd * dy, parts), _step_parts(dy, parts)]


Built = Tensor | list[Tensor]


def workloads(tokens: int) -> list[tuple[str, list[tuple[int, ...]], Callable[[list[Tensor], int], Built]]]:
  layernorm = [(tokens, 768), (tokens, 1), (tokens, 1), (tokens, 768)]
  return [("bias 768", [(tokens, 768)], _bias),
          ("bias 768 step form", [(tokens, 768)], _bias_step),
          ("layernorm weight 768", layernorm, _layernorm_weight),
          ("layernorm weight+bias 768", layernorm, _layernorm_weight_and_bias),
          ("layernorm weight+bias 768 step form", layernorm, _layernorm_weight_and_bias_step),
          ("bias 3072", [(tokens, 3072)], _bias),
          ("bias 3072 step form", [(tokens, 3072)], _bias_step)]


def _flat(built: Built) -> list[Tensor]:
  """The library's choice of `built` (parts 1): each output as a vector."""
  return [tensor.reshape(-1) for tensor in (built if isinstance(built, list) else [built])]


def layout_kernel(device: str, built: Tensor, layout: tuple[int, int, int, int]) -> tuple[Any, Any] | None:
  """The partials' schedule item and its kernel with `layout`'s opts (None where an opt does not apply)."""
  _, group, vector, unroll = layout
  items = create_schedule([tensor.lazydata for tensor in (built if isinstance(built, list) else [built])])
  if len(items) != 1: return None
  kernel = Kernel(items[0].ast, Device[device].renderer)
  opts = [Opt(OptOps.UPCAST, 1, vector)] if vector > 1 else []
  opts += [Opt(OptOps.LOCAL, 1, 32)]
  if group > 1: opts.append(Opt(OptOps.GROUPTOP, 0, group))
  if unroll > 1: opts.append(Opt(OptOps.UNROLL, 0, unroll))
  for opt in opts:
    if not kernel.try_opt(opt): return None
  return items[0], kernel


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--replays", type=int, default=5)
  parser.add_argument("--only", default="", help="workloads whose names contain one of these (comma-separated)")
  parser.add_argument("--layouts", default="", help="P:G:V:U layouts to time (comma-separated; default: LAYOUTS)")
  args = parser.parse_args()
  layouts = [tuple(int(n) for n in text.split(":")) for text in args.layouts.split(",")] if args.layouts else LAYOUTS
  wanted = [name for name in args.only.split(",") if name]
  reference = CopyReference(args.device, with_torch=False) if args.device.upper().startswith("CUDA") else \
      CopyReference(args.device, 1 << 16, with_torch=False)
  print(reference.describe())
  rng = np.random.default_rng(0)
  for name, shapes, function in workloads(args.tokens):
    if wanted and not any(part in name for part in wanted): continue
    inputs = [Tensor(rng.standard_normal(shape, dtype=np.float32), device=args.device).realize() for shape in shapes]
    moved = sum(int(np.prod(shape)) * 4 for shape in shapes)
    full = _flat(function(inputs, 1))
    ours, kernels = cold_schedule_seconds(args.device, full, args.replays)
    print(f"{name}: {moved / 1e6:.1f} MB; the library's choice {ours * 1e6:.1f} us "
          f"({moved / ours / reference.peak * 100:.0f}% copy) [{', '.join(f'{k} {s * 1e6:.1f}' for k, s in kernels)}]")
    saved = split_reduce.FACTS_OVERRIDE
    split_reduce.FACTS_OVERRIDE = split_reduce.SplitFacts(1, 2048)   # the partials' reduce is not split again
    try:
      for layout in layouts:
        if args.tokens % (layout[0] * layout[1] * layout[3]): continue
        if "step form" in name and (args.tokens // STEP_BATCH) % layout[0]: continue
        built = layout_kernel(args.device, function(inputs, layout[0]), layout)
        if built is None:
          print(f"  P {layout[0]:4d} G {layout[1]} V {layout[2]} U {layout[3]:2d}: does not apply")
          continue
        item, kernel = built
        for buffer in item.outputs: buffer.allocate()
        runner = compile_kernel(kernel, args.device)
        exec_item = ExecItem(runner, list(item.outputs) + list(item.inputs), {}, args.device)
        seconds = cold_kernel_seconds(exec_item, args.replays, own_buffers_when_large=True).seconds
        blocks = np.prod(runner.global_size) if runner.global_size else 1
        print(f"  P {layout[0]:4d} G {layout[1]} V {layout[2]} U {layout[3]:2d}: {seconds * 1e6:6.1f} us "
              f"{moved / seconds / 1e9:6.0f} GB/s {moved / seconds / reference.peak * 100:4.0f}% copy  "
              f"{runner.name} grid {blocks} x {np.prod(runner.local_size or [1])}")
      for parts in SECOND_PARTS:
        partials = Tensor(rng.standard_normal((parts, shapes[0][1]), dtype=np.float32), device=args.device).realize()
        seconds, kernels = cold_schedule_seconds(args.device, partials.sum(axis=0), args.replays)
        print(f"  second kernel over {parts:3d} parts: {seconds * 1e6:6.1f} us ({', '.join(k for k, _ in kernels)})")
    finally:
      split_reduce.FACTS_OVERRIDE = saved


if __name__ == "__main__":
  main()
