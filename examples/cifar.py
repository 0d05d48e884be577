"""Train a small ResNet on CIFAR-10 (32x32 colour images, 10 classes) with SGD + Nesterov momentum.

    python examples/cifar.py --data ~/cifar-10-batches-bin            # 10 epochs on the 50000 training images
    python examples/cifar.py --data DIR --epochs 1 --limit 5000        # a short run
    python examples/cifar.py --width 16 --blocks 1                     # a smaller net

The data is the standard binary version (data_batch_1.bin .. data_batch_5.bin, test_batch.bin: records of one
label byte and 3072 pixel bytes), found by ourgrad.nn.datasets.cifar10_arrays (--data, $OURGRAD_CIFAR10, or
~/.cache/ourgrad/cifar10; it prints the download command when absent: no package registry ships CIFAR-10).
Training images are augmented on the host: zero-pad 4 pixels, crop a random 32x32 window, flip half of them.

The net: a 3x3 conv stem, then three stages of residual blocks (two 3x3 conv + batchnorm, identity shortcut; the
first block of stages 2 and 3 halves the resolution with a stride-2 conv and a strided 1x1 conv shortcut) at
`width`, 2x and 4x channels, global average pooling and a linear classifier.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from ourgrad import Tensor, dtypes
from ourgrad.nn import BatchNorm2d, Conv2d, Linear
from ourgrad.nn.datasets import cifar10_arrays
from ourgrad.nn.losses import cross_entropy
from ourgrad.nn.optim import SGD
from ourgrad.nn.state import get_parameters

try:
  from tqdm import tqdm
except ImportError:  # optional
  tqdm = None

CIFAR_MEAN = np.array([0.4914, 0.4822, 0.4465], np.float32).reshape(1, 3, 1, 1)
CIFAR_STD = np.array([0.2470, 0.2435, 0.2616], np.float32).reshape(1, 3, 1, 1)


def augment(images: np.ndarray, rng: np.random.Generator, pad: int = 4) -> np.ndarray:
  """Random crop (of the image zero-padded by `pad` on each side) and random horizontal flip, per image."""
  count, _, height, width = images.shape
  padded = np.pad(images, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
  tops, lefts = rng.integers(0, 2 * pad + 1, count), rng.integers(0, 2 * pad + 1, count)
  rows = tops[:, None] + np.arange(height)[None]  # (N, H)
  columns = lefts[:, None] + np.arange(width)[None]  # (N, W)
  flip = rng.random(count) < 0.5
  columns = np.where(flip[:, None], columns[:, ::-1], columns)
  batch = np.arange(count)[:, None, None, None]
  channels = np.arange(images.shape[1])[None, :, None, None]
  return padded[batch, channels, rows[:, None, :, None], columns[:, None, None, :]]


class ResidualBlock:
  def __init__(self, channels_in: int, channels_out: int, stride: int):
    self.conv1 = Conv2d(channels_in, channels_out, 3, stride=stride, padding=1, bias=False)
    self.bn1 = BatchNorm2d(channels_out)
    self.conv2 = Conv2d(channels_out, channels_out, 3, padding=1, bias=False)
    self.bn2 = BatchNorm2d(channels_out)
    self.shortcut = None
    if stride != 1 or channels_in != channels_out:
      self.shortcut = (Conv2d(channels_in, channels_out, 1, stride=stride, bias=False), BatchNorm2d(channels_out))

  def __call__(self, x: Tensor) -> Tensor:
    out = self.bn1(self.conv1(x)).relu()
    out = self.bn2(self.conv2(out))
    skip = x if self.shortcut is None else self.shortcut[1](self.shortcut[0](x))
    return (out + skip).relu()


class ResNet:
  def __init__(self, width: int = 32, blocks_per_stage: int = 2, classes: int = 10):
    self.stem = Conv2d(3, width, 3, padding=1, bias=False)
    self.stem_bn = BatchNorm2d(width)
    self.blocks: list[ResidualBlock] = []
    channels = width
    for stage, multiplier in enumerate((1, 2, 4)):
      for block in range(blocks_per_stage):
        stride = 2 if stage > 0 and block == 0 else 1
        self.blocks.append(ResidualBlock(channels, width * multiplier, stride))
        channels = width * multiplier
    self.head = Linear(channels, classes)

  def __call__(self, x: Tensor) -> Tensor:
    x = self.stem_bn(self.stem(x)).relu()
    for block in self.blocks: x = block(x)
    return self.head(x.mean((2, 3)))


def normalize(images: np.ndarray) -> Tensor:
  return (Tensor(images).cast(dtypes.float32) / 255.0 - Tensor(CIFAR_MEAN)) / Tensor(CIFAR_STD)


def evaluate(model: ResNet, images: np.ndarray, labels: np.ndarray, batch_size: int = 500) -> float:
  correct = 0
  with Tensor.train(False), Tensor.no_grad_context():
    for start in range(0, len(images), batch_size):
      logits = model(normalize(images[start:start + batch_size]))
      correct += int((logits.argmax(axis=1).numpy() == labels[start:start + batch_size]).sum())
  return correct / len(images)


def train(args: argparse.Namespace) -> tuple[float, list[float]]:
  """Train; returns the final test accuracy and the mean loss of each epoch."""
  Tensor.manual_seed(args.seed)
  x_train, y_train, x_test, y_test = cifar10_arrays(args.data)
  if args.limit: x_train, y_train = x_train[:args.limit], y_train[:args.limit]
  if args.eval_limit: x_test, y_test = x_test[:args.eval_limit], y_test[:args.eval_limit]
  batch_size = min(args.batch_size, len(x_train))
  steps = len(x_train) // batch_size
  model = ResNet(args.width, args.blocks)
  parameters = [p for p in get_parameters(model) if p.requires_grad]
  buffers = [p for p in get_parameters(model) if not p.requires_grad]
  optimizer = SGD(parameters, lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
  print(f"{sum(p.numel() for p in parameters):,} parameters; {len(x_train)} training images, batch {batch_size}")
  accuracy, epoch_losses = float("nan"), []
  for epoch in range(args.epochs):
    rng = np.random.default_rng([args.seed, epoch])
    order = rng.permutation(len(x_train))
    started, losses = time.perf_counter(), []
    progress = tqdm(range(steps), desc=f"epoch {epoch + 1}/{args.epochs}", unit="step") if tqdm else range(steps)
    with Tensor.train():
      for step in progress:
        batch = order[step * batch_size:(step + 1) * batch_size]
        x, y = normalize(augment(x_train[batch], rng)), Tensor(y_train[batch])
        optimizer.zero_grad()
        loss = cross_entropy(model(x), y)
        loss.backward()
        Tensor.realize_all(loss, *optimizer.schedule_step(), *buffers)
        losses.append(loss.item())
        if tqdm: progress.set_postfix(loss=f"{losses[-1]:.3f}")
    epoch_losses.append(float(np.mean(losses)))
    accuracy = evaluate(model, x_test, y_test)
    print(f"epoch {epoch + 1}: loss {epoch_losses[-1]:.3f}, test accuracy {accuracy:.2%} "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
  return accuracy, epoch_losses


def main(argv: list[str] | None = None) -> tuple[float, list[float]]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data", metavar="DIR", help="folder with the CIFAR-10 binary batches")
  parser.add_argument("--epochs", type=int, default=10)
  parser.add_argument("--batch-size", type=int, default=128)
  parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
  parser.add_argument("--width", type=int, default=32, help="channels of the first stage")
  parser.add_argument("--blocks", type=int, default=2, help="residual blocks per stage")
  parser.add_argument("--limit", type=int, metavar="N", help="train on the first N training images only")
  parser.add_argument("--eval-limit", type=int, metavar="N", help="evaluate on the first N test images only")
  parser.add_argument("--seed", type=int, default=0)
  return train(parser.parse_args(argv))


if __name__ == "__main__":
  main()
