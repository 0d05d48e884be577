"""Run each matmul/conv workload of bench_matmul.py once on CUDA, for a profiler to look at (no timing here):

    METRICS=sm__warps_active.avg.pct_of_peak_sustained_active
    METRICS=$METRICS,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
    METRICS=$METRICS,dram__throughput.avg.pct_of_peak_sustained_elapsed
    ncu --metrics $METRICS -k regex:^r_ python extra/bench/ncu_matmul.py

The kernels keep the names DEBUG=2 prints, so ncu's rows can be matched with bench_matmul's table.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ourgrad import Tensor, dtypes  # noqa: E402


def main() -> None:
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
