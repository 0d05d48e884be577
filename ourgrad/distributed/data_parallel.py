"""Data-parallel training over several devices of one process: one replica of the model per device, each batch cut
along axis 0, gradients allreduced in buckets, the optimizer stepped on every replica.

    dp = DataParallel(make_model, ("CLANG:0", "CLANG:1"), lambda params: Adam(params, lr=1e-3))
    loss = dp.step(lambda model, x, y: cross_entropy(model(x), y), images, labels)
    dp.save("model.safetensors")   # replica 0's weights, written by rank 0 only

Each replica's loss is the mean over its piece of the batch, weighted by piece size / batch size before its
backward, so the summed gradients are exactly the whole-batch gradient (uneven pieces included). Gradients are
allreduced in buckets: gradients of one dtype are flattened and concatenated, last layers first (the order the
backward produces them), up to `bucket_bytes` per bucket, so many small gradients cost a few large collectives.
Everything stays lazy until the end of `step`, which realizes the losses, the allreduces and every replica's update
in one schedule: a bucket's allreduce depends only on its own gradients, so the scheduler may run it while other
gradients are still computed (on CUDA, NCCL realizes a bucket's inputs when it is reached instead). Buffers without
gradients (BatchNorm's running statistics) are copied from replica 0 to the others after each step, as PyTorch
DDP's broadcast_buffers does.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from ourgrad.distributed.collectives import allreduce, even_split_sizes
from ourgrad.lazy import LazyBuffer
from ourgrad.multi import canonical_devices
from ourgrad.nn.state import get_state_dict, safe_save
from ourgrad.tensor import Tensor

DEFAULT_BUCKET_BYTES = 25 << 20  # PyTorch DDP's default bucket size


def grad_buckets(params: Sequence[Tensor], bucket_bytes: int) -> list[list[int]]:
  """Indices of `params` grouped into buckets of one dtype and at most `bucket_bytes` (a larger tensor gets a bucket
  of its own), last parameters first."""
  buckets: list[list[int]] = []
  current: list[int] = []
  current_bytes = 0
  for index in reversed(range(len(params))):
    nbytes = params[index].numel() * params[index].dtype.itemsize
    fits = current and current_bytes + nbytes <= bucket_bytes and params[current[0]].dtype == params[index].dtype
    if current and not fits:
      buckets.append(current)
      current, current_bytes = [], 0
    current.append(index)
    current_bytes += nbytes
  if current: buckets.append(current)
  return buckets


def allreduce_gradients(replica_params: Sequence[Sequence[Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                        reduce_buckets: Callable[[list[LazyBuffer]], list[LazyBuffer]] = allreduce) -> None:
  """Replace every replica's gradients by their sum over replicas (replica_params[r][i]: parameter i of replica r),
  one `reduce_buckets` call (default: allreduce over this process's devices) per bucket. Parameters without a
  gradient on every replica are left alone."""
  first = replica_params[0]
  with_grad = [i for i in range(len(first)) if all(params[i].grad is not None for params in replica_params)]
  for bucket in grad_buckets([first[i] for i in with_grad], bucket_bytes):
    indices = [with_grad[position] for position in bucket]
    flats = [Tensor.cat(*[params[i].grad.reshape(-1) for i in indices]) if len(indices) > 1
             else params[indices[0]].grad.reshape(-1) for params in replica_params]
    summed = reduce_buckets([flat.lazydata for flat in flats])
    for params, flat in zip(replica_params, summed):
      flat_tensor, start = Tensor(flat), 0
      for i in indices:
        count = params[i].numel()
        params[i].grad = flat_tensor[start:start + count].reshape(params[i].shape)
        start += count


def allreduce_gradients_across_processes(params: Sequence[Tensor], group: Any,
                                        bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
  """One process per GPU (ourgrad.distributed.launch): sum this process's gradients with every other process's, in
  buckets, through `group` (a nccl_collectives.ProcessGroup). Every process must call it with the same parameters in
  the same order. Divide the loss by WORLD_SIZE (or the gradients after) for a mean over all processes' batches."""
  allreduce_gradients([params], bucket_bytes, lambda flats: [group.allreduce(flats[0])])


class DataParallel:
  """Replicas of one model on `devices`, trained together on batches cut along axis 0 (see the module docstring).

  `make_model()` builds a model (called once per device; replica 0's initial values are copied to the others);
  `make_optimizer(params)` builds an optimizer over one replica's trainable parameters."""

  def __init__(self, make_model: Callable[[], Any], devices: Sequence[str] | int,
               make_optimizer: Callable[[list[Tensor]], Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES):
    self.devices = canonical_devices(devices)
    self.bucket_bytes = bucket_bytes
    self.replicas = [make_model() for _ in self.devices]
    source = get_state_dict(self.replicas[0])
    for replica, device in zip(self.replicas, self.devices):
      for name, tensor in get_state_dict(replica).items():
        # a buffer of its own on each device (the optimizer writes parameters in place)
        tensor.lazydata = source[name].detach().to(device).clone().lazydata
    Tensor.realize_all(*[t for replica in self.replicas for t in get_state_dict(replica).values()])
    self.params = [[t for t in get_state_dict(replica).values() if t.requires_grad is not False]
                   for replica in self.replicas]
    for params in self.params:
      for param in params: param.requires_grad = True
    self.buffers = [[t for t in get_state_dict(replica).values() if t.requires_grad is False]
                    for replica in self.replicas]
    self.optimizers = [make_optimizer(params) for params in self.params]

  @property
  def model(self) -> Any:
    """Replica 0 (on the first device): the one to evaluate and save."""
    return self.replicas[0]

  def split(self, batch: Any) -> list[Tensor]:
    """`batch` (a Tensor or numpy array) cut along axis 0 into one piece per device, each moved there."""
    batch = batch if isinstance(batch, Tensor) else Tensor(batch)
    pieces, start = [], 0
    for device, size in zip(self.devices, even_split_sizes(batch.shape[0], len(self.devices))):
      pieces.append(batch[start:start + size].to(device))
      start += size
    return pieces

  def step(self, loss_fn: Callable[..., Tensor], *batch: Any) -> Tensor:
    """One training step on the whole batch: `loss_fn(replica, *pieces)` (a mean over the piece) on each device,
    backward, bucketed gradient allreduce, every optimizer's step. Returns the whole batch's mean loss (realized,
    on the first device)."""
    total = (batch[0] if isinstance(batch[0], Tensor) else Tensor(batch[0])).shape[0]
    pieces_per_input = [self.split(tensor) for tensor in batch]
    losses = []
    for index, (replica, optimizer) in enumerate(zip(self.replicas, self.optimizers)):
      pieces = [pieces[index] for pieces in pieces_per_input]
      optimizer.zero_grad()
      with Tensor.train():
        loss = loss_fn(replica, *pieces) * (pieces[0].shape[0] / total)
        loss.backward()
      losses.append(loss.detach())
    allreduce_gradients(self.params, self.bucket_bytes)
    total_loss = losses[0]
    for loss in losses[1:]: total_loss = total_loss + loss.to(self.devices[0])
    updates = [tensor for optimizer in self.optimizers for tensor in optimizer.schedule_step()]
    Tensor.realize_all(total_loss, *updates, *[t for buffers in self.buffers for t in buffers])
    self.sync_buffers()
    return total_loss

  def sync_buffers(self) -> None:
    """Copy replica 0's buffers (tensors without gradients: BatchNorm statistics) to the other replicas."""
    copies = [target.assign(source.to(target.device)) for buffers in self.buffers[1:]
              for source, target in zip(self.buffers[0], buffers)]
    if copies: Tensor.realize_all(*copies)

  def state_dict(self) -> dict[str, Tensor]:
    """Replica 0's state (the replicas are equal after every step)."""
    return get_state_dict(self.model)

  def save(self, path: str) -> bool:
    """Write replica 0's state to `path` (safetensors) from rank 0 only; whether this process wrote it."""
    if int(os.environ.get("RANK", "0")) != 0: return False
    safe_save(self.state_dict(), path)
    return True
