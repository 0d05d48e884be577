"""Ordering for Tensor (SortMixin): sort, argsort, topk, and sampling by order (multinomial).

There is no sort primitive: an element's place in sorted order is its rank, the number of elements of its row that
come before it (smaller, or equal and earlier, so the sort is stable), computed with one broadcast comparison of the
row against itself and a sum. Values and indices are then picked out by rank with a masked sum, as integer-tensor
indexing is. That is O(n^2) work and memory per row of n: fine for the rows sort meets in models (a vocabulary of
50k is 2.5e9 comparisons: use it on candidates, not whole vocabularies). NaN sorts above every number, as in
PyTorch. Gradients flow to the values through the masked sums.

The methods become Tensor's through `class Tensor(..., SortMixin, ...)` in ourgrad/tensor.py; this module does not
import that one at load time (it imports this one), so methods that make a Tensor import the class when called.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ourgrad.dtype import dtypes
from ourgrad.errors import DTypeError, ShapeError

if TYPE_CHECKING:
  from ourgrad.tensor import Tensor


def _before(a: Tensor, b: Tensor, descending: bool) -> Tensor:
  """True where a sorts strictly before b: smaller (larger if descending), NaN counting as the largest value."""
  first, second = (b, a) if descending else (a, b)
  if not first.dtype.is_float: return first < second
  return (first < second) | (~first.isnan() & second.isnan())


def _same(a: Tensor, b: Tensor) -> Tensor:
  """True where a and b are equal for sorting (NaN equals NaN)."""
  return (a == b) | (a.isnan() & b.isnan()) if a.dtype.is_float else a == b


class SortMixin:
  """Tensor's sort, argsort, topk and multinomial."""
  __slots__ = ()

  def _ranks_last(self, descending: bool) -> Tensor:
    """Each element's position in the stable sorted order of its row along the last axis (int32)."""
    from ourgrad.tensor import Tensor
    size = self.shape[-1]
    x = self.detach() if self.dtype != dtypes.bool else self.cast(dtypes.int32)
    mine, others = x.unsqueeze(-1), x.unsqueeze(-2)            # (..., n, 1) against (..., 1, n)
    positions = Tensor.arange(size, device=self.device)
    earlier = positions.reshape(1, size) < positions.reshape(size, 1)  # [i, j]: j comes before i
    goes_before = _before(others, mine, descending) | (_same(others, mine) & earlier)
    return goes_before.cast(dtypes.int32).sum(-1, dtype=dtypes.int32)

  def sort(self, dim: int = -1, descending: bool = False, stable: bool = True) -> tuple[Tensor, Tensor]:
    """(values, indices) sorted along `dim`, ascending unless `descending`; always stable (equal values keep their
    order; `stable` is accepted for PyTorch's signature). Indices are int64, as in PyTorch."""
    from ourgrad.tensor import Tensor
    if self.ndim == 0:
      self._axis(dim)
      return self, Tensor.zeros((), dtype=dtypes.int64, device=self.device)
    axis = self._axis(dim)
    x = self.transpose(axis, -1)
    size = x.shape[-1]
    ranks = x._ranks_last(descending)
    # [..., i, k]: element i goes to place k
    placed = ranks.unsqueeze(-1) == Tensor.arange(size, device=self.device).reshape(1, size)
    values_in = x if x.dtype != dtypes.bool else x.cast(dtypes.int32)
    values = placed.where(values_in.unsqueeze(-1), 0).sum(-2, dtype=values_in.dtype).cast(self.dtype)
    positions = Tensor.arange(size, device=self.device).reshape(size, 1)
    indices = placed.where(positions, 0).sum(-2, dtype=dtypes.int64)
    return values.transpose(axis, -1), indices.transpose(axis, -1)

  def argsort(self, dim: int = -1, descending: bool = False, stable: bool = True) -> Tensor:
    """The int64 indices that sort the tensor along `dim` (stable)."""
    return self.sort(dim, descending, stable)[1]

  def topk(self, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> tuple[Tensor, Tensor]:  # noqa: A002
    """(values, indices) of the k largest (smallest if not `largest`) elements along `dim`, in sorted order; among
    equal values the earlier index comes first (PyTorch leaves that order unspecified)."""
    axis = self._axis(dim)
    size = self.shape[axis] if self.ndim else 1
    if not 0 <= k <= size: raise ShapeError(f"topk k={k} is out of range for dim {axis} of size {size}")
    values, indices = self.sort(dim, descending=largest)
    if self.ndim == 0: return values, indices
    keep = [(0, k) if a == axis else None for a in range(self.ndim)]
    return values.shrink(keep), indices.shrink(keep)

  def multinomial(self, num_samples: int = 1, replacement: bool = False) -> Tensor:
    """int64 indices drawn from the rows of this tensor of non-negative weights (1-D or 2-D), as torch.multinomial.
    With replacement: inverse-CDF sampling of one uniform number per draw. Without: the exponential race (each index
    draws -log(u) / weight and the smallest win), so each draw excludes earlier ones and zero weights never win."""
    from ourgrad.tensor import Tensor
    if self.ndim not in (1, 2): raise ShapeError(f"multinomial takes a 1-D or 2-D tensor, got shape {self.shape}")
    if not self.dtype.is_float: raise DTypeError(f"multinomial needs float weights, got {self.dtype}")
    weights = self if self.ndim == 2 else self.unsqueeze(0)
    rows, size = weights.shape
    if not replacement and num_samples > size:
      raise ShapeError(f"multinomial without replacement cannot draw {num_samples} samples from {size} categories")
    if num_samples <= 0: raise ValueError(f"multinomial needs num_samples > 0, got {num_samples}")
    weights = weights.detach().float()
    if replacement:
      cdf = weights.cumsum(1)
      cdf = cdf / cdf[:, -1:]
      draws = Tensor.rand(rows, num_samples, 1, device=self.device)
      # the index is the number of CDF entries at or below the draw (a draw of 0 skips zero-weight prefixes)
      below = (cdf.unsqueeze(1) <= draws).cast(dtypes.int32).sum(-1, dtype=dtypes.int32)
      samples = below.minimum(size - 1).cast(dtypes.int64)
    else:
      uniform = Tensor.rand(rows, size, device=self.device)
      arrival = -(1 - uniform).log() / weights  # 1 - u is in (0, 1]: no log(0)
      arrival = (weights > 0).where(arrival, math.inf)
      samples = arrival.topk(num_samples, dim=1, largest=False)[1]
    return samples if self.ndim == 2 else samples.squeeze(0)
