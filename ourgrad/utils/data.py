"""Batching, as torch.utils.data: `Dataset`, `TensorDataset` and `DataLoader` (batch_size, shuffle, drop_last).

    loader = DataLoader(TensorDataset(images, labels), batch_size=64, shuffle=True, drop_last=True)
    for x, y in loader: ...

A TensorDataset keeps its tensors' values on the host (read once, as numpy) and a DataLoader over it builds each
batch with one numpy gather and one copy to the device: no per-sample Tensor, no gather kernel. Any other dataset
(an object with `__len__` and `__getitem__`) is batched item by item through `collate_fn` (`default_collate`
stacks Tensors, numpy arrays and numbers into Tensors, tuple by tuple). Shuffling draws from ourgrad's generator
(`ourgrad.manual_seed`), so orders differ from PyTorch's for the same seed.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ourgrad.errors import ShapeError
from ourgrad.tensor import Tensor


class Dataset:
  """Base class of map-style datasets: subclasses define `__len__` and `__getitem__(index)`."""

  def __len__(self) -> int: raise NotImplementedError

  def __getitem__(self, index: int) -> Any: raise NotImplementedError


class TensorDataset(Dataset):
  """Samples are rows of the given tensors (or numpy arrays), which all have the same first dimension: item i is
  `(tensors[0][i], tensors[1][i], ...)`."""

  def __init__(self, *tensors: Tensor | np.ndarray):
    if not tensors: raise ValueError("TensorDataset needs at least one tensor")
    sizes = {tuple(tensor.shape)[0] if len(tensor.shape) else None for tensor in tensors}
    if len(sizes) != 1 or None in sizes:
      raise ShapeError(f"TensorDataset needs tensors with the same first dimension, got shapes "
                       f"{[tuple(tensor.shape) for tensor in tensors]}")
    self.tensors = tensors
    self._arrays: list[np.ndarray] | None = None

  def __len__(self) -> int: return tuple(self.tensors[0].shape)[0]

  def arrays(self) -> list[np.ndarray]:
    """The tensors' values on the host (read from the device the first time)."""
    if self._arrays is None:
      self._arrays = [tensor.numpy() if isinstance(tensor, Tensor) else np.asarray(tensor) for tensor in self.tensors]
    return self._arrays

  def batch(self, indices: np.ndarray) -> tuple[Tensor, ...]:
    """The samples at `indices`, one Tensor per dataset tensor (with its dtype and device)."""
    return tuple(Tensor(array[indices], dtype=getattr(tensor, "dtype", None), device=getattr(tensor, "device", None))
                 for tensor, array in zip(self.tensors, self.arrays()))

  def __getitem__(self, index: int) -> tuple[Tensor, ...]:
    return tuple(tensor[index] for tensor in self.batch(np.array([index])))


def default_collate(samples: Sequence[Any]) -> Any:
  """A batch from a list of samples: Tensors are stacked, numpy arrays and numbers become a Tensor, tuples and dicts
  are collated field by field."""
  first = samples[0]
  if isinstance(first, Tensor): return Tensor.stack(list(samples))
  if isinstance(first, (np.ndarray, np.generic, int, float, bool)):
    return Tensor(np.stack([np.asarray(sample) for sample in samples]))
  if isinstance(first, dict): return {key: default_collate([sample[key] for sample in samples]) for key in first}
  if isinstance(first, (tuple, list)): return type(first)(default_collate(list(field)) for field in zip(*samples))
  return list(samples)


class DataLoader:
  """Batches of a dataset, like torch.utils.data.DataLoader: `batch_size` samples at a time, in a new random order
  each epoch with `shuffle`, the last incomplete batch left out with `drop_last`. `len(loader)` is the number of
  batches. num_workers, pin_memory and the other process options are accepted and ignored."""

  def __init__(self, dataset: Dataset | Any, batch_size: int = 1, shuffle: bool = False, drop_last: bool = False,
               collate_fn: Callable[[list[Any]], Any] | None = None, **ignored: Any):
    if batch_size < 1: raise ValueError(f"DataLoader needs batch_size >= 1, got {batch_size}")
    self.dataset, self.batch_size, self.shuffle, self.drop_last = dataset, batch_size, shuffle, drop_last
    self.collate_fn = collate_fn

  def __len__(self) -> int:
    count = len(self.dataset)
    return count // self.batch_size if self.drop_last else math.ceil(count / self.batch_size)

  def _order(self) -> np.ndarray:
    count = len(self.dataset)
    return Tensor._rng.permutation(count) if self.shuffle else np.arange(count)

  def __iter__(self) -> Iterator[Any]:
    order = self._order()
    for batch in range(len(self)):
      indices = order[batch * self.batch_size:(batch + 1) * self.batch_size]
      if isinstance(self.dataset, TensorDataset) and self.collate_fn is None: yield self.dataset.batch(indices)
      else: yield (self.collate_fn or default_collate)([self.dataset[int(index)] for index in indices])


__all__ = ["Dataset", "TensorDataset", "DataLoader", "default_collate"]
