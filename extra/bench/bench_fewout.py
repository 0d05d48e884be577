"""Few-output, long reductions: GPT-2's bias and LayerNorm gradients and batchnorm statistics against the copy
bandwidth and PyTorch, split (codegen/opt/split_reduce.py's decision from the device's facts) and unsplit.

Rows: Linear bias gradients (4096 x 768 and 4096 x 3072 summed over the tokens), a sum of (8, 512, 768) over batch
and tokens, a LayerNorm weight gradient (sum over the tokens of (x - mean) * rstd * dy, the statistics per token) and
batchnorm statistics of (256, 32, 28, 28) over (0, 2, 3). Each row: the bytes moved (inputs read once, the outputs
written once), ourgrad's summed cold kernel time (timing.cold_kernel_seconds: CUDA-graph replays on scratch buffers
that defeat the L2), GB/s, '%copy' (against the large-copy bandwidth), '%same' (against an ourgrad copy kernel
moving the same bytes, timed the same way: a kernel of a few MB is bound partly by latency, and so is that copy),
the kernels launched with each one's time, the same reduce forced into one kernel ('1 kernel': the split turned
off, what ran before), and PyTorch eager back to back.
Run: `python extra/bench/bench_fewout.py` on a machine with an NVIDIA GPU (`--device PYTHON --scale 4 --no-torch`
checks the script anywhere).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # timing.py and kernel_table.py, beside this script
from ourgrad import Tensor  # noqa: E402
from ourgrad.codegen.opt import split_reduce  # noqa: E402
from ourgrad.device import Device  # noqa: E402
from ourgrad.renderer import ASSUMED_THREAD_BLOCK_GPU  # noqa: E402
from timing import back_to_back_seconds, cold_schedule_seconds, torch_seconds  # noqa: E402
from kernel_table import CopyReference  # noqa: E402


def _layernorm_weight_gradient(x: Any, mean: Any, rstd: Any, dy: Any) -> Any:
  if isinstance(x, Tensor): return ((x - mean) * rstd * dy).sum(axis=(0, 1))
  return ((x - mean) * rstd * dy).sum(dim=(0, 1))


def _sum(axes: tuple[int, ...]) -> Callable[[Any], Any]:
  return lambda x: x.sum(axis=axes) if isinstance(x, Tensor) else x.sum(dim=axes)


def workloads(scale: int) -> list[tuple[str, list[tuple[int, ...]], Callable[..., Any]]]:
  """(name, input shapes, function of the inputs (ourgrad and torch alike)). `scale` halves the tokens (and the
  batchnorm batch) that many times."""
  tokens, batch = 4096 >> scale, 8 >> min(scale, 3)
  sequence = tokens // batch
  return [
    ("bias grad 4096x768", [(tokens, 768)], _sum((0,))),
    ("bias grad 4096x3072", [(tokens, 3072)], _sum((0,))),
    ("sum (8,512,768) (0,1)", [(batch, sequence, 768)], _sum((0, 1))),
    ("layernorm weight grad", [(batch, sequence, 768), (batch, sequence, 1), (batch, sequence, 1),
                               (batch, sequence, 768)], _layernorm_weight_gradient),
    ("batchnorm (256,32,28,28)", [(256 >> scale, 32, 28, 28)], _sum((0, 2, 3))),
  ]


def _unsplit_seconds(device: str, build: Callable[[], Tensor], replays: int) -> tuple[float, list[tuple[str, float]]]:
  """The reduce as one kernel: split_reduce's facts of a device with one multiprocessor (nothing leaves it idle), and
  no CPU split either (batchnorm statistics' 200704 values per channel would take it)."""
  saved = split_reduce.FACTS_OVERRIDE, split_reduce.CPU_SPLIT_MIN_ELEMENTS
  split_reduce.FACTS_OVERRIDE = split_reduce.SplitFacts(1, ASSUMED_THREAD_BLOCK_GPU.threads_per_multiprocessor)
  split_reduce.CPU_SPLIT_MIN_ELEMENTS = 1 << 62
  try:
    return cold_schedule_seconds(device, build(), replays)
  finally:
    split_reduce.FACTS_OVERRIDE, split_reduce.CPU_SPLIT_MIN_ELEMENTS = saved


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--replays", type=int, default=10, help="CUDA graph replays per cold kernel time (median)")
  parser.add_argument("--scale", type=int, default=0, help="halve the tokens this many times (for a quick check)")
  parser.add_argument("--no-torch", action="store_true", help="skip PyTorch")
  args = parser.parse_args()
  cuda = args.device.upper().startswith("CUDA")
  torch = None
  if not args.no_torch:
    import torch
    if cuda: print(f"device: {torch.cuda.get_device_name()}")
  facts = split_reduce.SplitFacts.of(Device[args.device].renderer)
  print(f"split facts: {facts.multiprocessors} multiprocessors x {facts.threads_per_multiprocessor} threads (a wave "
        f"of {facts.wave_blocks} blocks of {split_reduce.BLOCK_THREADS}), a launch worth "
        f"{facts.launch_bytes / 1e6:.1f} MB, a memory latency worth {facts.latency_bytes / 1e6:.1f} MB")
  reference = CopyReference(args.device, (1 << 26) >> 2 * args.scale, with_torch=torch is not None and cuda)
  print(reference.describe())
  print(f"{'workload':<26} {'bytes':>7} {'ourgrad':>8} {'GB/s':>6} {'%copy':>6} {'%same':>6} {'kernels':>7} "
        f"{'1 kernel':>8} {'GB/s':>6} {'torch':>8} {'GB/s':>6}   (ms; ourgrad cold; torch back to back)")
  rng = np.random.default_rng(0)
  for name, shapes, function in workloads(args.scale):
    host = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
    inputs = [Tensor(array, device=args.device).realize() for array in host]
    outputs = function(*inputs).numel()
    moved = sum(array.nbytes for array in host) + outputs * 4
    ours, kernels = cold_schedule_seconds(args.device, function(*inputs), args.replays)
    unsplit, _ = _unsplit_seconds(args.device, lambda: function(*inputs), args.replays)
    theirs = None
    if torch is not None:
      torch_inputs = [torch.tensor(array, device="cuda" if cuda else "cpu") for array in host]
      call = lambda: function(*torch_inputs)  # noqa: E731
      theirs = back_to_back_seconds(call, torch.cuda.synchronize, launches=args.iters) if cuda else \
          torch_seconds(call, args.iters, False)

    def ms(value: float | None) -> str: return f"{value * 1e3:8.4f}" if value is not None else f"{'-':>8}"

    def gbs(value: float | None) -> str: return f"{moved / value / 1e9:6.0f}" if value else f"{'-':>6}"
    print(f"{name:<26} {moved / 1e6:6.1f}M {ms(ours)} {gbs(ours)} {moved / ours / reference.peak * 100:5.0f}% "
          f"{moved / ours / reference.same(moved) * 100:5.0f}% {len(kernels):7d} {ms(unsplit)} {gbs(unsplit)} "
          f"{ms(theirs)} {gbs(theirs)}   [{', '.join(f'{k} {s * 1e3:.4f}' for k, s in kernels)}]")


if __name__ == "__main__":
  main()
