"""Run each matmul/conv workload of bench_matmul.py once on CUDA, for a profiler to look at (no timing here):

    METRICS=sm__warps_active.avg.pct_of_peak_sustained_active
    METRICS=$METRICS,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
    METRICS=$METRICS,dram__throughput.avg.pct_of_peak_sustained_elapsed
    ncu --metrics $METRICS -k regex:^r_ python extra/bench/ncu_matmul.py

The kernels keep the names DEBUG=2 prints, so ncu's rows can be matched with bench_matmul's table.
`--f32-variants TEXT`: instead, the float32 4096^3 matmul once with each of bench_matmul's VARIANTS opt lists whose
label contains TEXT (in VARIANTS' order; they share the kernel name, so ncu's rows follow that order).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ourgrad import Tensor, dtypes  # noqa: E402


def f32_variants(text: str) -> None:
  """The float32 4096^3 matmul with each matching variant's opts, once each; prints their labels in launch order."""
  sys.path.insert(0, str(Path(__file__).resolve().parent))
  from bench_matmul import VARIANTS, parse_opts
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.device import Buffer, Device
  from ourgrad.engine.realize import compile_kernel
  from ourgrad.engine.schedule import create_schedule
  rng = np.random.default_rng(0)
  a, b = (Tensor(rng.standard_normal((4096, 4096), dtype=np.float32), device="CUDA").realize() for _ in range(2))
  item = create_schedule([(a @ b).lazydata])[-1]
  output = Buffer("CUDA", item.outputs[0].size, item.outputs[0].dtype).allocate()
  for part, label, opts_text in VARIANTS:
    if part != "4096^3 f32" or text not in label: continue
    kernel = Kernel(item.ast, Device["CUDA"].renderer)
    for opt in parse_opts(opts_text, 1): kernel.apply_opt(opt)
    print(f"launch: {label}: {opts_text}", flush=True)
    compile_kernel(kernel, "CUDA")([output, *item.inputs], wait=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--f32-variants", default=None, help="only the float32 4096^3 variants whose label has this")
  args = parser.parse_args()
  if args.f32_variants is not None: return f32_variants(args.f32_variants)
  rng = np.random.default_rng(0)
  for dtype in (dtypes.float32, dtypes.float16):
    a = Tensor(rng.standard_normal((4096, 4096), dtype=np.float32), device="CUDA").cast(dtype).realize()
    b = Tensor(rng.standard_normal((4096, 4096), dtype=np.float32), device="CUDA").cast(dtype).realize()
    (a @ b).realize()
  images = Tensor(rng.standard_normal((64, 64, 56, 56), dtype=np.float32), device="CUDA").realize()
  weights = Tensor(rng.standard_normal((64, 64, 3, 3), dtype=np.float32), device="CUDA").realize()
  images.conv2d(weights, padding=1).realize()


if __name__ == "__main__":
  main()
