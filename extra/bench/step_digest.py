"""A digest of the parameters after a few eager Adam training steps (examples/mnist.py's CNN with batchnorm and max
pooling, an MLP), to check that a change to autograd or the optimizers leaves every bit of the training the same.

It imports the ourgrad that Python finds first (PYTHONPATH), and examples/mnist.py from the current directory, so
one copy of this script checks two trees:
  python extra/bench/step_digest.py
  (cd ../base && PYTHONPATH=$PWD python /path/to/this/tree/extra/bench/step_digest.py)
Printed per model: the sha256 of every parameter's bytes after each step (its first 16 hex digits) and the losses.
The same digests mean bitwise the same training on that device (run a tree twice to see that the device itself is
deterministic).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import pathlib
from typing import Any

import numpy as np

from ourgrad import Device, Tensor
from ourgrad.nn import Linear
from ourgrad.nn.losses import cross_entropy
from ourgrad.nn.optim import Adam
from ourgrad.nn.state import get_parameters


class MLP:
  """784-64-64-10 with ReLU (bench_jit's MLP, narrower)."""

  def __init__(self) -> None: self.layers = [Linear(784, 64), Linear(64, 64), Linear(64, 10)]

  def __call__(self, x: Tensor) -> Tensor:
    for layer in self.layers[:-1]: x = layer(x).relu()
    return self.layers[-1](x)


def digests(model: Any, shape: tuple[int, ...], batch: int, steps: int) -> tuple[list[str], list[float]]:
  """The parameters' digest and the loss after each of `steps` Adam steps on fixed random data."""
  rng = np.random.default_rng(0)
  x = Tensor(rng.standard_normal((batch, *shape)).astype(np.float32)).realize()
  y = Tensor(rng.integers(0, 10, batch).astype(np.int32)).realize()
  params = get_parameters(model)
  optimizer = Adam([tensor for tensor in params if tensor.requires_grad], lr=1e-3)
  found, losses = [], []
  with Tensor.train():
    for _ in range(steps):
      optimizer.zero_grad()
      loss = cross_entropy(model(x), y)
      loss.backward()
      Tensor.realize_all(loss, *optimizer.schedule_step(), *[t for t in params if not t.requires_grad])
      digest = hashlib.sha256()
      for tensor in params: digest.update(tensor.numpy().tobytes())
      found.append(digest.hexdigest()[:16])
      losses.append(float(loss.item()))
  return found, losses


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--batch", type=int, default=32)
  args = parser.parse_args()
  spec = importlib.util.spec_from_file_location("mnist_example", pathlib.Path("examples") / "mnist.py")
  mnist = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mnist)
  print(f"device {Device.DEFAULT}, ourgrad from {pathlib.Path(__import__('ourgrad').__file__).parent}")
  for name, make, shape in (("cnn", lambda: mnist.ConvNet(mnist.MODELS["small"]), (1, 28, 28)),
                            ("mlp", MLP, (784,))):
    Tensor.manual_seed(0)
    found, losses = digests(make(), shape, args.batch, args.steps)
    print(f"{name}: {' '.join(found)} losses {' '.join(f'{loss:.9g}' for loss in losses)}")


if __name__ == "__main__":
  main()
