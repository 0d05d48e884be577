"""Fusion benchmark (docs/fusion.md): row kernels (softmax, layernorm) against PyTorch, and kernel counts of whole
training steps.

Part 1, kernel time: softmax and layernorm on float32 rows (CUDA: 8192 x 8192, 8192 x 32768, 65536 x 1024). Each
ourgrad figure is the median over `--iters` runs (after 3 warm-ups) of the summed kernel times of the scheduled items
(what DEBUG=2 prints), with their kernel count: the row kernel (one kernel, codegen/row_linearizer.py) and, beside
it, the unfused schedule (ROW_KERNELS=0). PyTorch eager (and torch.compile on CUDA) is timed over the same runs (CUDA
events on a GPU, wall clock on the CPU). GB/s counts the input read once and the output written once; `max err` is
the largest difference between ourgrad's and PyTorch's results.
Part 2, kernel counts: one training step of an MLP (784-512-512-10, Adam) and of examples/mnist.py's small ConvNet
(Adam), ourgrad's launched kernels (after a warm-up step) against PyTorch eager's (torch.profiler: CUDA kernels on a
GPU; on the CPU, the aten ops that do work, which is only a rough stand-in).

Run: `python extra/bench/bench_fusion.py` on a CUDA machine (the coordinator's run; prints the CUDA rows), or
`python extra/bench/bench_fusion.py --device CLANG` here (softmax and layernorm 4096 x 4096 on the CPU).
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
from ourgrad.helpers import GlobalCounters  # noqa: E402
from ourgrad.nn import Linear  # noqa: E402
from ourgrad.nn.optim import Adam  # noqa: E402




def _torch_layernorm(x: Any) -> Any:
  import torch
  return torch.nn.functional.layer_norm(x, x.shape[-1:])


def row_workloads(cuda: bool) -> list[tuple[str, tuple[int, int]]]:
  if not cuda: return [("softmax", (4096, 4096)), ("layernorm", (4096, 4096))]
  return [(name, shape) for shape in ((8192, 8192), (8192, 32768), (65536, 1024)) for name in ("softmax", "layernorm")]


def _unfused_seconds(device: str, build: Callable[[], Tensor], iters: int) -> tuple[float, int]:
  """ourgrad_kernel_seconds with row kernels off (ROW_KERNELS=0: each reduce read back per element realized first)."""
  previous = os.environ.get("ROW_KERNELS")
  os.environ["ROW_KERNELS"] = "0"
  try: return ourgrad_kernel_seconds(device, build, iters)
  finally:
    if previous is None: del os.environ["ROW_KERNELS"]
    else: os.environ["ROW_KERNELS"] = previous


def row_table(device: str, iters: int) -> None:
  """One line per workload: ourgrad's row kernel (kernels, ms, GB/s), ourgrad without row kernels, PyTorch eager and
  (CUDA) torch.compile, and the largest difference between ourgrad's and PyTorch's results."""
  import torch
  cuda = device.upper().startswith("CUDA")
  torch_device = "cuda" if cuda else "cpu"
  print(f"{'workload':<24} {'kernels':>7} {'ourgrad ms':>10} {'GB/s':>7} {'unfused ms':>10} {'(kernels)':>9} "
        f"{'torch ms':>9} {'GB/s':>7} {'compile ms':>10} {'GB/s':>7} {'ours/torch':>10} {'ours/compile':>12} "
        f"{'max err':>8}")
  for name, shape in row_workloads(cuda):
    x_np = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    x = Tensor(x_np, device=device).realize()
    ours = (lambda: x.softmax(-1)) if name == "softmax" else (lambda: x.layernorm(-1))
    seconds, kernels = ourgrad_kernel_seconds(device, ours, iters)
    unfused_s, unfused_kernels = _unfused_seconds(device, ours, iters)
    t = torch.tensor(x_np, device=torch_device)
    torch_fn = (lambda: t.softmax(-1)) if name == "softmax" else (lambda: _torch_layernorm(t))
    error = float(np.abs(ours().numpy() - torch_fn().cpu().numpy()).max())
    torch_s = torch_seconds(torch_fn, iters, cuda)
    compiled_s = None
    if cuda:
      compiled = torch.compile(torch_fn)
      compiled_s = torch_seconds(compiled, iters, cuda)
    moved = 2 * x_np.nbytes

    def gbs(value: float | None) -> str: return f"{moved / value / 1e9:7.1f}" if value else f"{'-':>7}"
    compiled_text = f"{compiled_s * 1e3:10.3f}" if compiled_s else f"{'-':>10}"
    versus_compile = f"{seconds / compiled_s:12.2f}" if compiled_s else f"{'-':>12}"
    print(f"{name + ' ' + 'x'.join(map(str, shape)):<24} {kernels:>7} {seconds * 1e3:10.3f} {gbs(seconds)} "
          f"{unfused_s * 1e3:10.3f} {unfused_kernels:>9} {torch_s * 1e3:9.3f} {gbs(torch_s)} {compiled_text} "
          f"{gbs(compiled_s)} {seconds / torch_s:10.2f} {versus_compile} {error:8.1e}", flush=True)


# ---------------------------------------------------------------- kernel counts of training steps

def ourgrad_mlp_step_kernels(device: str) -> int:
  rng = np.random.default_rng(0)
  layers = [Linear(784, 512), Linear(512, 512), Linear(512, 10)]
  params = [tensor for layer in layers for tensor in (layer.weight, layer.bias)]
  optimizer = Adam(params, lr=1e-3)
  count = 0
  for _ in range(2):   # the second step: nothing left to initialize
    x = Tensor(rng.standard_normal((64, 784), dtype=np.float32), device=device)
    y = Tensor(rng.integers(0, 10, 64).astype(np.int32), device=device)
    Tensor.training = True
    optimizer.zero_grad()
    hidden = x
    for index, layer in enumerate(layers):
      hidden = layer(hidden)
      if index < len(layers) - 1: hidden = hidden.relu()
    loss = hidden.sparse_categorical_crossentropy(y)
    loss.backward()
    GlobalCounters.reset()
    Tensor.realize_all(loss, *optimizer.schedule_step())
    count = GlobalCounters.kernel_count
  return count


def ourgrad_cnn_step_kernels() -> int:
  sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
  import mnist  # examples/mnist.py
  rng = np.random.default_rng(0)
  model = mnist.ConvNet(mnist.MODELS["small"])
  optimizer = Adam(mnist.get_parameters(model), lr=1e-3)
  buffers = mnist.batchnorm_buffers(model)
  count = 0
  Tensor.training = True
  for _ in range(2):
    images = rng.integers(0, 255, (64, 1, 28, 28)).astype(np.uint8)
    labels = rng.integers(0, 10, 64).astype(np.int32)
    GlobalCounters.reset()
    mnist.train_step(model, optimizer, images, labels, buffers)
    count = GlobalCounters.kernel_count
  return count


def torch_step_kernels(cnn: bool, cuda: bool) -> int:
  import torch
  from torch.profiler import ProfilerActivity, profile
  device = "cuda" if cuda else "cpu"
  if cnn:
    model = torch.nn.Sequential(
      torch.nn.Conv2d(1, 16, 5, bias=False), torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
      torch.nn.Conv2d(16, 32, 5, bias=False), torch.nn.BatchNorm2d(32), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
      torch.nn.Flatten(), torch.nn.Linear(512, 10)).to(device)
    x = torch.randn(64, 1, 28, 28, device=device)
  else:
    model = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(device)
    x = torch.randn(64, 784, device=device)
  y = torch.randint(0, 10, (64,), device=device)
  optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)   # default (foreach) implementation

  def step() -> None:
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
  step()
  activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
  with profile(activities=activities) as prof:
    step()
    if cuda: torch.cuda.synchronize()
  if cuda: return sum(1 for event in prof.events() if event.device_type.name == "CUDA")
  # CPU: leaf aten ops (those that call no other op), a stand-in for kernels
  events = prof.events()
  parents = {id(event.cpu_parent) for event in events if event.cpu_parent is not None}
  return sum(1 for event in events if event.name.startswith("aten::") and id(event) not in parents)


def count_table(device: str) -> None:
  cuda = device.upper().startswith("CUDA")
  torch_label = "torch eager CUDA kernels" if cuda else "torch eager leaf aten ops (CPU)"
  print(f"\n{'training step':<34} {'ourgrad kernels':>15} {torch_label:>32}")
  mlp = ourgrad_mlp_step_kernels(device)
  print(f"{'MLP 784-512-512-10, Adam, batch 64':<34} {mlp:>15} {torch_step_kernels(False, cuda):>32}")
  cnn = ourgrad_cnn_step_kernels()
  print(f"{'MNIST ConvNet small, Adam, batch 64':<34} {cnn:>15} {torch_step_kernels(True, cuda):>32}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default=None, help="ourgrad device (default: the default device)")
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--no-counts", action="store_true", help="skip the training-step kernel counts")
  args = parser.parse_args()
  from ourgrad.device import Device
  device = args.device or Device.DEFAULT
  print(f"device {device}")
  row_table(device, args.iters)
  if not args.no_counts: count_table(device)


if __name__ == "__main__":
  main()
