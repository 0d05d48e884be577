"""One fused attention forward (ourgrad, causal, bf16 by default) between cuProfilerStart and cuProfilerStop, for
`ncu --profile-from-start off`: warmed up first, so only the measured launch is profiled. B, H, T, D and the dtype
from the command line; the ATTENTION_* settings from the environment.

    ncu --clock-control none --profile-from-start off -k regex:attn_ --section WarpStateStats \\
        python extra/bench/ncu_attention_forward.py --batch 4 --length 4096
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
from ourgrad import Device, Tensor, TinyJit, dtypes  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--length", type=int, default=4096)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--dtype", default="bfloat16")
  args = parser.parse_args()
  os.environ["FUSED_ATTENTION"] = "1"
  from cuda.bindings import driver
  rng = np.random.default_rng(0)
  shape = (args.batch, args.heads, args.length, args.head_dim)
  q, k, v = (Tensor(rng.standard_normal(shape).astype(np.float32), device="CUDA").cast(getattr(dtypes, args.dtype))
             .contiguous().realize() for _ in range(3))

  @TinyJit
  def step(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return q.scaled_dot_product_attention(k, v, is_causal=True).realize()
  for _ in range(3): step(q, k, v)
  Device["CUDA"].synchronize()
  driver.cuProfilerStart()
  step(q, k, v)
  Device["CUDA"].synchronize()
  driver.cuProfilerStop()
  print("profiled one forward", shape, args.dtype)


if __name__ == "__main__":
  main()
