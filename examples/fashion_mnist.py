"""Train a CNN on Fashion-MNIST (10 kinds of clothing, 28x28 grey images) with Adam.

    python examples/fashion_mnist.py                        # 5 epochs on the 60000 training images, the learning
                                                            # rate decaying (cosine), jitted step: 90.72% test
                                                            # accuracy (86.8, 88.3, 89.4, 89.9 after epochs 1-4;
                                                            # 17 min on a busy 2-core CPU)
    python examples/fashion_mnist.py --epochs 2             # fewer epochs: less accuracy
    python examples/fashion_mnist.py --limit 12000 --epochs 1   # a shorter run on the first 12000 images
    python examples/fashion_mnist.py --data /path/to/folder     # the four IDX files (plain or .gz)

The data: `--data`, else ourgrad.nn.datasets' search (OURGRAD_FASHION_MNIST, the cache, Debian's
/usr/share/datasets/fashion-mnist from `apt-get install dataset-fashion-mnist`, the public mirror). The net: two conv
blocks (a 3x3 convolution, batchnorm, ReLU, 2x2 max-pool), dropout, a hidden linear layer; minibatches are drawn in
numpy, the whole step (forward, backward, Adam) is one realize, run through TinyJit: after two calls each step
replays the captured kernels, and dropout draws a new mask on every replay from the device generator (JIT=0 runs
every step eagerly, with numpy's generator).
"""
from __future__ import annotations

import argparse
import math
import time
from typing import Callable

import numpy as np

from ourgrad import Tensor, TinyJit, dtypes
from ourgrad.nn import BatchNorm2d, Conv2d, Dropout, Linear
from ourgrad.nn.datasets import mnist
from ourgrad.nn.losses import cross_entropy
from ourgrad.nn.optim import Adam
from ourgrad.nn.state import get_parameters

try:
  from tqdm import tqdm
except ImportError:  # optional: without it, a line every tenth of an epoch
  tqdm = None

FASHION_MEAN, FASHION_STD = 0.2860, 0.3530  # of the training pixels scaled to [0, 1]
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")


class FashionNet:
  """28 -conv3-> 26 -pool-> 13 -conv3-> 11 -pool-> 5: 64*5*5 features -> 128 -> 10 (about 2.6 MFLOP per image)."""

  def __init__(self) -> None:
    def block(cin: int, cout: int) -> list[Callable[[Tensor], Tensor]]:
      return [Conv2d(cin, cout, 3, bias=False), BatchNorm2d(cout), Tensor.relu]
    self.layers: list[Callable[[Tensor], Tensor]] = [
      *block(1, 32), Tensor.max_pool2d, *block(32, 64), Tensor.max_pool2d,
      lambda x: x.flatten(1), Dropout(0.25), Linear(64 * 5 * 5, 128), Tensor.relu, Linear(128, 10)]

  def __call__(self, x: Tensor) -> Tensor:
    for layer in self.layers: x = layer(x)
    return x


def normalize(images: Tensor) -> Tensor:
  return (images.cast(dtypes.float32) / 255.0 - FASHION_MEAN) / FASHION_STD


def evaluate(model: FashionNet, images: np.ndarray, labels: np.ndarray, batch_size: int = 1000) -> float:
  correct = 0
  with Tensor.train(False), Tensor.no_grad_context():
    for start in range(0, len(images), batch_size):
      logits = model(normalize(Tensor(images[start:start + batch_size])))
      correct += int((logits.argmax(axis=1).numpy() == labels[start:start + batch_size]).sum())
  return correct / len(images)


def make_train_step(model: FashionNet, optimizer: Adam, buffers: list[Tensor]) -> Callable[[Tensor, Tensor], Tensor]:
  """One Adam step on a minibatch as a TinyJit (forward with dropout, backward, update, batchnorm statistics); it
  returns the loss, backed by the JIT's own buffer: read it (`.item()`) before the next step overwrites it."""
  @TinyJit
  def step(images: Tensor, labels: Tensor) -> Tensor:
    with Tensor.train():
      optimizer.zero_grad()
      loss = cross_entropy(model(normalize(images)), labels)
      loss.backward()
      Tensor.realize_all(loss, *optimizer.schedule_step(), *buffers)
    return loss
  return step


def train(args: argparse.Namespace) -> float:
  """Train for args.epochs and return the test accuracy after the last one."""
  Tensor.manual_seed(args.seed)
  x_train, y_train, x_test, y_test = (t.numpy() for t in mnist(args.data, fashion=True))
  if args.limit: x_train, y_train = x_train[:args.limit], y_train[:args.limit]
  if args.eval_limit: x_test, y_test = x_test[:args.eval_limit], y_test[:args.eval_limit]
  batch_size = min(args.batch_size, len(x_train))
  steps = len(x_train) // batch_size
  model = FashionNet()
  parameters = [p for p in get_parameters(model) if p.requires_grad]
  buffers = [p for p in get_parameters(model) if not p.requires_grad]  # batchnorm running statistics
  optimizer = Adam(parameters, lr=args.lr)
  train_step = make_train_step(model, optimizer, buffers)
  print(f"{sum(p.numel() for p in parameters):,} parameters; {len(x_train)} training images, batch {batch_size}")
  accuracy = float("nan")
  for epoch in range(args.epochs):
    # cosine decay over the run, one value per epoch: Adam's lr is a tensor, so changing it compiles nothing
    if not args.constant_lr: optimizer.lr = args.lr * 0.5 * (1 + math.cos(math.pi * epoch / args.epochs))
    order = np.random.default_rng([args.seed, epoch]).permutation(len(x_train))
    started = time.perf_counter()
    progress = tqdm(range(steps), desc=f"epoch {epoch + 1}/{args.epochs}", unit="step") if tqdm else range(steps)
    for step in progress:
      batch = order[step * batch_size:(step + 1) * batch_size]
      loss = train_step(Tensor(x_train[batch]), Tensor(y_train[batch]))
      if tqdm: progress.set_postfix(loss=f"{loss.item():.3f}")
      elif step % max(steps // 10, 1) == 0: print(f"  step {step}/{steps}: loss {loss.item():.3f}", flush=True)
    accuracy = evaluate(model, x_test, y_test)
    print(f"epoch {epoch + 1}: test accuracy {accuracy:.2%} ({time.perf_counter() - started:.0f} s)", flush=True)
  return accuracy


def main(argv: list[str] | None = None) -> float:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--epochs", type=int, default=5)
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate of the first epoch")
  parser.add_argument("--constant-lr", action="store_true", help="keep --lr for every epoch (default: cosine decay)")
  parser.add_argument("--limit", type=int, metavar="N", help="train on the first N training images only")
  parser.add_argument("--eval-limit", type=int, metavar="N", help="evaluate on the first N test images only")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--data", metavar="DIR", help="folder with the Fashion-MNIST IDX files")
  return train(parser.parse_args(argv))


if __name__ == "__main__":
  main()
