"""Transposing copies on the GPU (codegen/opt/transpose_tiles.py): each kernel timed alone and cold, under the current
hand-coded opts (`hand`: the register tile) and under the heuristic without transpose tiles (`before`), beside
PyTorch's `.t().contiguous()` / `.permute(...).contiguous()`.

Shapes: GPT-2's staged matmul operands (4096 x 768, 4096 x 2304, 4096 x 3072 and the tied embedding 50304 x 768,
each transposed), float16 4096 x 2304, and the attention's head permutes of (8, 512, 12, 64): (B, H, T, D) (rows of
D move whole: not a transpose, the plain default) and (B, H, D, T) (a transposed key per head).

Method: timing.cold_kernel_seconds (a CUDA graph of launches over sets of buffers larger than twice the L2: every
launch reads from DRAM). GB/s counts the bytes read plus written once each (2 x the tensor); %copy compares with an
ourgrad copy kernel of 2 x 256 MB timed the same way. Torch: launches back to back over as many source tensors as
the cold method uses (each read from DRAM), CUDA events. `sectors` is the coalescing model of the kernel's first
warp of a block in the middle of the grid (transpose_tiles.warp_sectors): the useful share of the 32-byte sectors
its load / store instructions touch, per instruction (the worst) and over all of them together. Each variant is
checked against the unoptimized kernel on random inputs ("ok" / "WRONG").
Run on a CUDA machine from the repository root: `python extra/bench/bench_transpose.py`. `--device PYTHON` with
EMULATE=CUDA checks the script without a GPU (use `--scale 64`: every first dimension divided by it).
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this checkout's ourgrad
sys.path.insert(0, str(Path(__file__).resolve().parent))   # timing.py and kernel_table.py

import ourgrad.codegen.opt.heuristic as heuristic  # noqa: E402
from ourgrad import Tensor, dtypes  # noqa: E402
from ourgrad.codegen.kernel import Kernel  # noqa: E402
from ourgrad.codegen.linearizer import linearize  # noqa: E402
from ourgrad.codegen.opt.search import outputs_match, random_fill, scratch_buffers  # noqa: E402
from ourgrad.codegen.opt.transpose_tiles import footprint_efficiency, warp_sectors  # noqa: E402
from ourgrad.codegen.uops import UOps  # noqa: E402
from ourgrad.device import Device  # noqa: E402
from ourgrad.engine.exec_item import ExecItem  # noqa: E402
from ourgrad.engine.realize import compile_kernel  # noqa: E402
from ourgrad.engine.schedule import create_schedule  # noqa: E402
from kernel_table import copy_bandwidth  # noqa: E402
from timing import cold_kernel_seconds, l2_cache_bytes  # noqa: E402

# (name, shape, permutation, dtype name)
CASES = [
  ("4096x768.T", (4096, 768), (1, 0), "float32"),
  ("4096x2304.T", (4096, 2304), (1, 0), "float32"),
  ("4096x3072.T", (4096, 3072), (1, 0), "float32"),
  ("50304x768.T", (50304, 768), (1, 0), "float32"),
  ("4096x2304.T f16", (4096, 2304), (1, 0), "float16"),
  ("BTHD->BHTD", (8, 512, 12, 64), (0, 2, 1, 3), "float32"),
  ("BTHD->BHDT", (8, 512, 12, 64), (0, 2, 3, 1), "float32"),
]


def hand(kernel: Kernel) -> None: kernel.hand_coded_optimizations()


def before(kernel: Kernel) -> None:
  """The heuristic as it was without transpose tiles."""
  original = heuristic.transpose_tiles
  heuristic.transpose_tiles = lambda kernel: False
  try: kernel.hand_coded_optimizations()
  finally: heuristic.transpose_tiles = original


VARIANTS: dict[str, Callable[[Kernel], None]] = {"hand": hand, "before": before}


def run_on_random_inputs(device: str, kernel: Kernel, seed: int = 0) -> list:
  buffers = scratch_buffers(kernel.ast, device)
  random_fill(buffers, seed)
  compile_kernel(kernel, device)(buffers, wait=True)
  return buffers


def sector_summary(kernel: Kernel) -> str:
  """Per-instruction (worst) and whole-warp sector efficiency of the loads, then the stores (a block in the middle
  of the grid)."""
  accesses = warp_sectors(linearize(kernel), block=0.5)
  parts = []
  for op in (UOps.LOAD, UOps.STORE):
    chosen = [access for access in accesses if access.op is op]
    worst = min((access.efficiency for access in chosen), default=1.0)
    parts.append(f"{worst:4.0%}/{footprint_efficiency(accesses, op):4.0%}")
  return " ".join(parts)


def torch_seconds_cold(shape: tuple[int, ...], permutation: tuple[int, ...], dtype_name: str,
                       cache_bytes: int) -> float | None:
  """Seconds of torch's permute(...).contiguous() per call, back to back over enough sources to defeat the L2."""
  try:
    import torch
    if not torch.cuda.is_available(): return None
  except ImportError:
    return None
  dtype = getattr(torch, dtype_name)
  nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
  sets = max(math.ceil(2 * cache_bytes / (2 * nbytes)), 1)
  sources = [torch.randn(shape, device="cuda").to(dtype) for _ in range(sets)]
  launches = sets * math.ceil(64 / sets)
  for source in sources: source.permute(permutation).contiguous()
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  results = []
  for _ in range(5):
    start.record()
    for index in range(launches): sources[index % sets].permute(permutation).contiguous()
    end.record()
    torch.cuda.synchronize()
    results.append(start.elapsed_time(end) / 1e3 / launches)
  return sorted(results)[len(results) // 2]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--scale", type=int, default=1, help="divide every first dimension by this (emulated checks)")
  parser.add_argument("--only", default="", help="cases whose name contains this text")
  args = parser.parse_args()
  device = args.device
  copy = copy_bandwidth(device, 1 << 26) if device == "CUDA" else 0.0
  print(f"transposing copies on {device}; copy bandwidth {copy / 1e9:.0f} GB/s (ourgrad copy kernel, 2 x 256 MB, "
        f"cold); L2 {l2_cache_bytes(device) >> 20} MB")
  print(f"{'case':17} {'variant':7} {'kernel':26} {'us':>8} {'MB':>7} {'GB/s':>6} {'%copy':>6} {'sectors ld/st':>19} "
        " check  opts")
  for name, shape, permutation, dtype_name in CASES:
    if args.only not in name: continue
    shape = (max(shape[0] // args.scale, 1),) + shape[1:]
    source = Tensor.empty(*shape, dtype=getattr(dtypes, dtype_name), device=device)
    (item,) = create_schedule([source.permute(permutation).contiguous().lazydata])
    megabytes = 2 * math.prod(shape) * getattr(dtypes, dtype_name).itemsize / 1e6
    reference = run_on_random_inputs(device, Kernel(item.ast, Device[device].renderer))
    for variant, apply in VARIANTS.items():
      kernel = Kernel(item.ast, Device[device].renderer)
      apply(kernel)
      runner = compile_kernel(kernel, device)
      seconds = cold_kernel_seconds(ExecItem(runner, scratch_buffers(item.ast, device), {}, device)).seconds
      correct = outputs_match(reference[0], run_on_random_inputs(device, kernel)[0])
      rate = megabytes / 1e3 / seconds
      percent = f"{rate * 1e9 / copy:6.1%}" if copy else "     -"
      opts = " ".join(f"{opt.op.name[:2]}{opt.axis},{opt.amount}" for opt in kernel.applied_opts)
      print(f"{name:17} {variant:7} {kernel.name:26} {seconds * 1e6:8.2f} {megabytes:7.1f} {rate:6.0f} {percent} "
            f"{sector_summary(kernel):>19}  {'ok   ' if correct else 'WRONG'}  {opts}", flush=True)
    torch_seconds = torch_seconds_cold(shape, permutation, dtype_name, l2_cache_bytes(device)) \
      if device == "CUDA" else None
    if torch_seconds is not None:
      rate = megabytes / 1e3 / torch_seconds
      percent = f"{rate * 1e9 / copy:6.1%}" if copy else "     -"
      print(f"{name:17} {'torch':7} {'permute().contiguous()':26} {torch_seconds * 1e6:8.2f} {megabytes:7.1f} "
            f"{rate:6.0f} {percent}", flush=True)


if __name__ == "__main__":
  main()
