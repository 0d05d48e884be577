"""Run examples/mnist.py training steps on CUDA for a profiler to look at the step's reduces (no timing here): the
convolution weight gradients and batchnorm statistics (split-K: a partial-sum kernel and a kernel over the parts).
Only the last step is profiled (cuProfilerStart/Stop around it; the first steps compile every kernel):

    METRICS=sm__warps_active.avg.pct_of_peak_sustained_active              # achieved occupancy
    METRICS=$METRICS,dram__throughput.avg.pct_of_peak_sustained_elapsed    # DRAM throughput, % of peak
    METRICS=$METRICS,sm__throughput.avg.pct_of_peak_sustained_elapsed      # SM throughput, % of peak
    METRICS=$METRICS,gpu__time_duration.sum,launch__grid_size,launch__block_size,dram__bytes.sum
    ncu --profile-from-start off --metrics $METRICS -k regex:^r_ --csv python extra/bench/ncu_reduce.py

The kernels keep the names DEBUG=2 prints, so ncu's rows can be matched with `bench_reduce.py --only-mnist`.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
os.environ.setdefault("DEVICE", "CUDA")  # before ourgrad picks its default device
from ourgrad import Tensor  # noqa: E402
from ourgrad.device import Device  # noqa: E402
from ourgrad.nn.optim import Adam  # noqa: E402
from ourgrad.nn.state import get_parameters  # noqa: E402
import mnist  # noqa: E402


def main() -> None:
  from cuda.bindings import driver  # cuProfilerStart/Stop: ncu --profile-from-start off records what lies between
  rng = np.random.default_rng(0)
  model = mnist.ConvNet(mnist.MODELS["small"])
  optimizer = Adam([p for p in get_parameters(model) if p.requires_grad], lr=2e-3)
  buffers = mnist.batchnorm_buffers(model)
  images = rng.integers(0, 255, (256, 1, 28, 28)).astype(np.uint8)
  labels = rng.integers(0, 10, 256).astype(np.int32)
  with Tensor.train():
    for _ in range(2): mnist.train_step(model, optimizer, images, labels, buffers)  # compile everything
    Device[Device.DEFAULT].synchronize()
    driver.cuProfilerStart()
    mnist.train_step(model, optimizer, images, labels, buffers)
    Device[Device.DEFAULT].synchronize()
    driver.cuProfilerStop()
  print("profiled one mnist training step")


if __name__ == "__main__":
  main()
