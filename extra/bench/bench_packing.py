"""Packed kernels (docs/fusion.md, multi-tensor kernels): one optimizer step over many parameters of different shapes.

For each optimizer and parameter set: ourgrad's kernels per step and their summed kernel time (median over `--iters`
steps after 3 warm-ups, each kernel timed as DEBUG=2 times it), with packing (PACK_KERNELS=1) and without
(PACK_KERNELS=0: one multi-output kernel per parameter); PyTorch's optimizer.step() time (CUDA events on a GPU,
host clock on a CPU) with its default multi-tensor (`foreach`) implementation and, on CUDA, `fused=True`, and its
kernel count on CUDA (torch.profiler).

Run: `python extra/bench/bench_packing.py [--device CUDA] [--iters 20]` (the default device by default).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ourgrad import Tensor  # noqa: E402
from timing import ourgrad_kernel_seconds, torch_seconds  # noqa: E402 (extra/bench/timing.py, beside this script)
from ourgrad.nn.optim import SGD, Adam, AdamW  # noqa: E402


def parameter_sets() -> dict[str, list[tuple[int, ...]]]:
  mixed = [(3, 4), (4,), (5, 6), (6,), (7, 3), (2, 2, 2), (9,), (4, 4), (1,), (8, 5)]
  transformer = []   # 8 blocks of a width-512 transformer: attention and MLP weights, biases, two norms each
  for _ in range(8):
    transformer += [(512, 1536), (1536,), (512, 512), (512,), (512, 2048), (2048,), (2048, 512), (512,)]
    transformer += [(512,), (512,), (512,), (512,)]
  return {"10 small, mixed shapes": mixed, "MLP 784-512-512-10": [(784, 512), (512,), (512, 512), (512,), (512, 10),
                                                                   (10,)],
          "transformer 8x512 (96 tensors)": transformer}


OPTIMIZERS: dict[str, tuple[Callable[[list[Any]], Any], Callable[..., Any]]] = {
  "Adam": (lambda ps: Adam(ps, lr=1e-3), lambda torch, ps, **kw: torch.optim.Adam(ps, lr=1e-3, **kw)),
  "AdamW": (lambda ps: AdamW(ps, lr=1e-3, weight_decay=0.01),
            lambda torch, ps, **kw: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, **kw)),
  "SGD momentum": (lambda ps: SGD(ps, lr=1e-2, momentum=0.9),
                   lambda torch, ps, **kw: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, **kw)),
}


def ourgrad_step(device: str, shapes: list[tuple[int, ...]], make: Callable[[list[Any]], Any], iters: int,
                 pack: bool) -> tuple[float, int]:
  """Median summed kernel seconds of one optimizer step, and its kernel count."""
  os.environ["PACK_KERNELS"] = "1" if pack else "0"
  rng = np.random.default_rng(0)
  params = [Tensor(rng.standard_normal(shape, dtype=np.float32), device=device, requires_grad=True)
            for shape in shapes]
  optimizer = make(params)
  for param in params: param.grad = Tensor(rng.standard_normal(param.shape, dtype=np.float32), device=device).realize()
  try:
    return ourgrad_kernel_seconds(device, optimizer.schedule_step, iters)
  finally:
    os.environ.pop("PACK_KERNELS", None)


def torch_step(shapes: list[tuple[int, ...]], make: Callable[..., Any], iters: int, cuda: bool,
               **options: Any) -> tuple[float, int | None]:
  """Median seconds of optimizer.step(), and its CUDA kernel count (None on a CPU)."""
  import torch
  device = "cuda" if cuda else "cpu"
  params = [torch.randn(shape, device=device, requires_grad=True) for shape in shapes]
  for param in params: param.grad = torch.randn_like(param)
  optimizer = make(torch, params, **options)
  seconds = torch_seconds(optimizer.step, iters, cuda)
  if not cuda: return seconds, None
  from torch.profiler import ProfilerActivity, profile
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    optimizer.step()
    torch.cuda.synchronize()
  return seconds, sum(1 for event in prof.events() if event.device_type.name == "CUDA")


def cell(count: int | None, seconds: float | None, width: int) -> str:
  """A kernel count right-aligned in `width` and milliseconds in 8 columns ('-' where unknown)."""
  shown_count = "-" if count is None else str(count)
  shown_ms = "-" if seconds is None else f"{seconds * 1e3:.3f}"
  return f"{shown_count:>{width}} {shown_ms:>8}"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default=None, help="ourgrad device (default: the default device)")
  parser.add_argument("--iters", type=int, default=20)
  args = parser.parse_args()
  from ourgrad.device import Device
  device = args.device or Device.DEFAULT
  cuda = device.upper().startswith("CUDA")
  print(f"device {device}")
  print(f"{'optimizer':<13} {'parameters':<32} {'packed k':>8} {'ms':>8} {'unpacked k':>10} {'ms':>8} "
        f"{'torch foreach k':>15} {'ms':>8} {'torch fused k':>13} {'ms':>8}")
  for optimizer_name, (ours, theirs) in OPTIMIZERS.items():
    for set_name, shapes in parameter_sets().items():
      packed_s, packed_k = ourgrad_step(device, shapes, ours, args.iters, pack=True)
      plain_s, plain_k = ourgrad_step(device, shapes, ours, args.iters, pack=False)
      foreach_s, foreach_k = torch_step(shapes, theirs, args.iters, cuda, foreach=True)
      fused = None
      if cuda:
        try:
          fused = torch_step(shapes, theirs, args.iters, cuda, fused=True)
        except (TypeError, RuntimeError):   # an optimizer this PyTorch has no fused kernel for
          fused = None

      fused_s, fused_k = fused if fused is not None else (None, None)
      print(f"{optimizer_name:<13} {set_name:<32} {cell(packed_k, packed_s, 8)} {cell(plain_k, plain_s, 10)} "
            f"{cell(foreach_k, foreach_s, 15)} {cell(fused_k, fused_s, 13)}")


if __name__ == "__main__":
  main()
