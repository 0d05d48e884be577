"""TinyJit MLP and MNIST CNN training steps on CUDA, each timed over 5 x 50 replays (medians; synchronize around each
50): the quick A/B of a setting on the two steps bench_jit.py measures (e.g. SPLIT_LAST_BLOCK=0 vs 1).

    python extra/bench/jit_steps_probe.py
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DEVICE", "CUDA")
import numpy as np  # noqa: E402
import bench_jit  # noqa: E402
from ourgrad import Tensor, TinyJit  # noqa: E402
from ourgrad.device import Device  # noqa: E402


def time_step(name: str, make_model, shape: tuple[int, ...], batch: int) -> None:
  rng = np.random.default_rng(0)
  x = Tensor(rng.standard_normal((batch, *shape)).astype(np.float32)).realize()
  y = Tensor(rng.integers(0, 10, batch).astype(np.int32)).realize()
  step = TinyJit(bench_jit.ourgrad_step(make_model())[0])
  for _ in range(5): step(x, y)
  Device[Device.DEFAULT].synchronize()
  times = []
  for _ in range(5):
    start = time.perf_counter()
    for _ in range(50): step(x, y)
    Device[Device.DEFAULT].synchronize()
    times.append((time.perf_counter() - start) / 50)
  keys = ("SPLIT_LAST_BLOCK", "CUDA_DEPENDENT_LAUNCH", "RIDE_ALONG")
  settings = " ".join(f"{key}={os.environ[key]}" for key in keys if key in os.environ)
  edges = getattr(getattr(step.captured.replay_runner, "graph", None), "edges", [])   # CUDAGraph's dependent launches
  counts = ", ".join(f"{kind} {edges.count(kind)}" for kind in dict.fromkeys(edges))
  print(f"{name} [{settings or 'defaults'}]: {np.median(times) * 1e3:.4f} ms ({len(step.captured.items)} kernels"
        f"{'; edges ' + counts if counts else ''})")


if __name__ == "__main__":
  mnist = bench_jit.load_mnist_example()
  time_step("MLP step", bench_jit.MLP, (784,), 512)
  time_step("MNIST CNN step", lambda: mnist.ConvNet(mnist.MODELS["small"]), (1, 28, 28), 256)
