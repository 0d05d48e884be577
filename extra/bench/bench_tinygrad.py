"""tinygrad 0.14's side of the comparisons the issues ask for, timed the way our benchmarks time ourgrad and PyTorch:
the jitted MLP and MNIST CNN training steps (bench_jit.py's workloads) and the matmul/conv rows of bench_matmul.py,
with tinygrad's hand-coded kernels and, with `--beam 2`, its BEAM search (slow: minutes per kernel).

tinygrad is not a dependency: carry its wheel to the GPU machine and run
  pip install --no-deps --target /tmp/tg tinygrad-0.14.0-py3-none-any.whl
  PYTHONPATH=/tmp/tg DEV=CUDA python extra/bench/bench_tinygrad.py [--beam 2] [--only matmul]
(`DEV=PYTHON ... --scale 4` checks the script on a machine without a GPU).
Method: each figure is seconds per call with calls queued back to back between two synchronizations, median of 5
batches after a warm-up batch (extra/bench/timing.py's back_to_back_seconds, which the ourgrad and PyTorch columns
of bench_matmul.py use too). Training steps run under TinyJit with a new batch's buffers each call, as in bench_jit.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))   # timing.py, beside this script
from timing import back_to_back_seconds  # noqa: E402
from tinygrad import Device, Tensor, TinyJit, dtypes, nn  # noqa: E402
from tinygrad.helpers import Context  # noqa: E402

# (name, kind, sizes, dtype name): bench_matmul.py's CUDA rows
MATMUL_ROWS = [("matmul 4096^3 f32", "mm", (4096, 4096, 4096), "float32"),
               ("matmul 4096^3 f16", "mm", (4096, 4096, 4096), "float16"),
               ("matmul 4096^3 bf16", "mm", (4096, 4096, 4096), "bfloat16"),
               ("matmul 4097x4096 @ 4096x4095 f16", "mm", (4097, 4096, 4095), "float16"),
               ("conv 64x64x56x56 3x3 f32", "conv", (64, 64, 56, 56), "float32"),
               ("conv 64x64x56x56 3x3 f16", "conv", (64, 64, 56, 56), "float16")]


def synchronize() -> None: Device[Device.DEFAULT].synchronize()


def seconds_per_call(call: Callable[[], Any], launches: int) -> float:
  return back_to_back_seconds(call, synchronize, launches=launches)


def matmul_call(kind: str, sizes: tuple[int, ...], dtype_name: str, scale: int) -> tuple[Callable[[], Any], float]:
  """A jitted call computing one row's output (inputs realized once), and its floating-point operations."""
  rng = np.random.default_rng(0)
  dtype = getattr(dtypes, dtype_name)
  if kind == "mm":
    m, k, n = (max(size >> scale, 1) for size in sizes)
    a = Tensor(rng.standard_normal((m, k), dtype=np.float32)).cast(dtype).realize()
    b = Tensor(rng.standard_normal((k, n), dtype=np.float32)).cast(dtype).realize()
    work = 2.0 * m * n * k
    function = TinyJit(lambda: (a @ b).realize())
  else:
    batch, channels, height, width = sizes[0] >> scale or 1, sizes[1] >> scale or 1, sizes[2], sizes[3]
    x = Tensor(rng.standard_normal((batch, channels, height, width), dtype=np.float32)).cast(dtype).realize()
    w = Tensor(rng.standard_normal((channels, channels, 3, 3), dtype=np.float32)).cast(dtype).realize()
    work = 2.0 * batch * channels * height * width * channels * 9
    function = TinyJit(lambda: x.conv2d(w, padding=1).realize())
  return function, work


def mlp_step(batch: int) -> tuple[Callable[[Tensor, Tensor], Any], tuple[int, ...]]:
  layers = [nn.Linear(784, 512), nn.Linear(512, 512), nn.Linear(512, 10)]
  optimizer = nn.optim.Adam(nn.state.get_parameters(layers), lr=1e-3)

  def forward(x: Tensor) -> Tensor: return layers[2](layers[1](layers[0](x).relu()).relu())
  return training_step(forward, optimizer), (batch, 784)


def cnn_step(batch: int) -> tuple[Callable[[Tensor, Tensor], Any], tuple[int, ...]]:
  """examples/mnist.py's default ("small") model: conv5(16) bn relu pool, conv5(32) bn relu pool, Linear(512, 10)."""
  conv1, bn1 = nn.Conv2d(1, 16, 5, bias=False), nn.BatchNorm(16)
  conv2, bn2 = nn.Conv2d(16, 32, 5, bias=False), nn.BatchNorm(32)
  head = nn.Linear(512, 10)
  optimizer = nn.optim.Adam(nn.state.get_parameters([conv1, bn1, conv2, bn2, head]), lr=1e-3)

  def forward(x: Tensor) -> Tensor:
    x = bn1(conv1(x)).relu().max_pool2d(2)
    x = bn2(conv2(x)).relu().max_pool2d(2)
    return head(x.flatten(1))
  return training_step(forward, optimizer), (batch, 1, 28, 28)


def training_step(forward: Callable[[Tensor], Tensor], optimizer: Any) -> Callable[[Tensor, Tensor], Any]:
  @TinyJit
  def step(x: Tensor, y: Tensor) -> Tensor:
    with Context(TRAINING=1):
      optimizer.zero_grad()
      loss = forward(x).sparse_categorical_crossentropy(y)
      loss.backward()
      return loss.realize(*optimizer.schedule_step())
  return step


def step_seconds(make: Callable[[int], tuple[Callable, tuple[int, ...]]], batch: int, launches: int) -> float:
  step, shape = make(batch)
  rng = np.random.default_rng(0)
  batches = [(Tensor(rng.standard_normal(shape, dtype=np.float32)).realize(),
              Tensor(rng.integers(0, 10, shape[0]).astype(np.int32)).realize()) for _ in range(4)]
  calls = iter(range(10**9))

  def one_step() -> None:
    x, y = batches[next(calls) % len(batches)]
    step(x, y)
  return seconds_per_call(one_step, launches)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--beam", type=int, default=0, help="tinygrad's BEAM width for the matmul/conv rows (0: off)")
  parser.add_argument("--only", default="", help="run only the rows whose name contains this")
  parser.add_argument("--launches", type=int, default=10)
  parser.add_argument("--scale", type=int, default=0, help="divide batch/matrix sides by 2**scale (a quick check)")
  args = parser.parse_args()
  print(f"tinygrad 0.14 on {Device.DEFAULT}; seconds per call back to back (median of 5 batches of {args.launches})")
  print(f"| {'workload':<44} | tinygrad | unit |")
  print(f"| {'-' * 44} | --- | --- |")
  steps = [("MLP step 784-512-512-10, Adam, batch 512, TinyJit", mlp_step, 512),
           ("MNIST CNN step (small), Adam, batch 256, TinyJit", cnn_step, 256)]
  for name, make, batch in steps:
    if args.only not in name: continue
    seconds = step_seconds(make, max(batch >> args.scale, 2), args.launches)
    print(f"| {name:<44} | {seconds * 1e3:.3f} | ms |", flush=True)
  for name, kind, sizes, dtype_name in MATMUL_ROWS:
    if args.only not in name: continue
    for beam in sorted({0, args.beam}):
      with Context(BEAM=beam):
        call, work = matmul_call(kind, sizes, dtype_name, args.scale)
        seconds = seconds_per_call(call, args.launches)
      label = f"{name}{', BEAM=' + str(beam) if beam else ''}"
      print(f"| {label:<44} | {seconds * 1e3:.3f} ms = {work / seconds / 1e12:.1f} | TFLOP/s |", flush=True)


if __name__ == "__main__":
  main()
