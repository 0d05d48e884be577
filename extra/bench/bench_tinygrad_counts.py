"""Kernels per training step in tinygrad, for the same two steps bench_fusion.py counts for ourgrad and PyTorch:
an MLP 784-512-512-10 and examples/mnist.py's small ConvNet, batch 64, Adam, the second step counted.

tinygrad is not a dependency: install its wheel first (`pip install --no-deps tinygrad-0.14.0-py3-none-any.whl`),
then run `DEV=CUDA python extra/bench/bench_tinygrad_counts.py` on a GPU machine (or with DEV=CPU here).
The ConvNet's input is float data here; ourgrad's examples/mnist.py step also converts uint8 images (one kernel more).
"""
from __future__ import annotations

import numpy as np
from tinygrad import GlobalCounters, Tensor, nn
from tinygrad.helpers import Context


def _step_kernels(forward, params: list, batch: tuple[int, ...]) -> int:
  """Kernels launched by the second training step (forward, backward and Adam update realized together)."""
  optimizer = nn.optim.Adam(params, lr=1e-3)
  rng = np.random.default_rng(0)
  count = 0
  with Context(TRAINING=1):
    for _ in range(2):
      x = Tensor(rng.standard_normal(batch, dtype=np.float32)).realize()
      y = Tensor(rng.integers(0, 10, batch[0]).astype(np.int32)).realize()
      optimizer.zero_grad()
      loss = forward(x).sparse_categorical_crossentropy(y)
      loss.backward()
      GlobalCounters.reset()
      Tensor.realize(loss, *optimizer.schedule_step())
      count = GlobalCounters.kernel_count
  return count


def mlp_kernels() -> int:
  layers = [nn.Linear(784, 512), nn.Linear(512, 512), nn.Linear(512, 10)]

  def forward(x: Tensor) -> Tensor:
    return layers[2](layers[1](layers[0](x).relu()).relu())
  return _step_kernels(forward, nn.state.get_parameters(layers), (64, 784))


def convnet_kernels() -> int:
  batchnorm = getattr(nn, "BatchNorm", None) or getattr(nn, "BatchNorm2d")
  conv1, bn1 = nn.Conv2d(1, 16, 5, bias=False), batchnorm(16)
  conv2, bn2 = nn.Conv2d(16, 32, 5, bias=False), batchnorm(32)
  head = nn.Linear(512, 10)

  def forward(x: Tensor) -> Tensor:
    x = bn1(conv1(x)).relu().max_pool2d(2)
    x = bn2(conv2(x)).relu().max_pool2d(2)
    return head(x.flatten(1))
  return _step_kernels(forward, nn.state.get_parameters([conv1, bn1, conv2, bn2, head]), (64, 1, 28, 28))


if __name__ == "__main__":
  from tinygrad import Device
  print(f"tinygrad on {Device.DEFAULT}")
  print(f"{'training step':<36} {'tinygrad kernels':>16}")
  print(f"{'MLP 784-512-512-10, Adam, batch 64':<36} {mlp_kernels():>16}")
  print(f"{'MNIST ConvNet small, Adam, batch 64':<36} {convnet_kernels():>16}")
