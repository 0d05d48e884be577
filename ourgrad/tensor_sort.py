"""Ordering for Tensor (SortMixin): sort, argsort, topk, order statistics (kthvalue, median, quantile), sampling
by order (multinomial) and the selections whose size depends on the data (nonzero, masked_select, unique).

There is no sort primitive: an element's place in sorted order is its rank, the number of elements of its row that
come before it (smaller, or equal and earlier, so the sort is stable), computed with one broadcast comparison of the
row against itself and a sum. Values and indices are then picked out by rank with a masked sum, as integer-tensor
indexing is. That is O(n^2) work and memory per row of n: fine for the rows sort meets in models (a vocabulary of
50k is 2.5e9 comparisons: use it on candidates, not whole vocabularies). NaN sorts above every number, as in
PyTorch. Gradients flow to the values through the masked sums.

nonzero, masked_select and unique have a result whose shape depends on the values, so they realize their input (as
PyTorch's eager mode and tinygrad do) and find the positions on the host; masked_select then picks the values with a
lazy, differentiable gather. Inside a TinyJit function they raise (the size would be frozen into every replay).

The methods become Tensor's through `class Tensor(..., SortMixin, ...)` in ourgrad/tensor.py; this module does not
import that one at load time (it imports this one), so methods that make a Tensor import the class when called.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

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
  """Tensor's sort, argsort, topk, multinomial, kthvalue, median and quantile."""
  __slots__ = ()

  def _ranks_last(self, descending: bool) -> Tensor:
    """Each element's position in the stable sorted order of its row along the last axis (int32)."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
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
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
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
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
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

  # ---------------------------------------------------------------- order statistics

  def _order_statistic(self, k: int, dim: int, keepdim: bool, nan_wins: bool = False) -> tuple[Tensor, Tensor]:
    """(values, indices) of the k-th smallest element (0-based) along `dim` (NaN sorts last); with `nan_wins`, a row
    holding NaN gives its first NaN, as torch.median does."""
    if self.ndim == 0:
      self._axis(dim)
      return self.sort(dim)
    axis = self._axis(dim)
    values, indices = self.sort(axis)
    position = values.zeros_like().cast(dtypes.int32).shrink(
      [(0, 1) if a == axis else None for a in range(self.ndim)]) + k
    if nan_wins and self.dtype.is_float:  # NaN sorts last: the first NaN sits at n - (number of NaN)
      nan_count = self.isnan().cast(dtypes.int32).sum(axis, keepdim=True, dtype=dtypes.int32)
      position = (nan_count > 0).where(self.shape[axis] - nan_count, position)
    picked_values, picked_indices = values.gather(axis, position), indices.gather(axis, position)
    if keepdim: return picked_values, picked_indices
    return picked_values.squeeze(axis), picked_indices.squeeze(axis)

  def kthvalue(self, k: int, dim: int = -1, keepdim: bool = False) -> tuple[Tensor, Tensor]:
    """(values, indices) of the k-th smallest element (1-based) along `dim`, as torch.kthvalue."""
    size = self.shape[self._axis(dim)] if self.ndim else 1
    if not 1 <= k <= size: raise ShapeError(f"kthvalue k={k} is out of range for a dimension of size {size}")
    return self._order_statistic(k - 1, dim, keepdim)

  def median(self, dim: int | None = None, keepdim: bool = False) -> Any:
    """The lower median (the ((n - 1) // 2)-th smallest; NaN if the values hold one), as torch.median: one value for
    dim=None, (values, indices) along a dim."""
    if dim is None:
      flat = self.flatten()
      return flat._order_statistic((flat.shape[0] - 1) // 2, 0, False, nan_wins=True)[0]
    size = self.shape[self._axis(dim)] if self.ndim else 1
    return self._order_statistic((size - 1) // 2, dim, keepdim, nan_wins=True)

  def quantile(self, q: float, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """The q-th quantile (0 <= q <= 1) with linear interpolation between the two nearest ranks, as torch.quantile;
    NaN where the values hold one."""
    if not 0 <= q <= 1: raise ValueError(f"quantile q must be in [0, 1], got {q}")
    x = self.flatten() if dim is None else self
    axis = 0 if dim is None else x._axis(dim)
    size = x.shape[axis]
    rank = q * (size - 1)
    below, above = math.floor(rank), math.ceil(rank)
    values = x.sort(axis)[0]
    low = values.shrink([(below, below + 1) if a == axis else None for a in range(x.ndim)])
    high = values.shrink([(above, above + 1) if a == axis else None for a in range(x.ndim)])
    result = low + (high - low) * (rank - below)
    if x.dtype.is_float: result = x.isnan().any(axis, keepdim=True).where(math.nan, result)
    if dim is None: return result.reshape((1,) * self.ndim) if keepdim else result.reshape(())
    return result if keepdim else result.squeeze(axis)

  # ---------------------------------------------------------------- data-dependent shapes (realize the input)

  def nonzero(self, as_tuple: bool = False) -> Tensor | tuple[Tensor, ...]:
    """The indices of the non-zero (True) elements in row-major order, as torch.nonzero: an int64 (count, ndim)
    tensor, or with `as_tuple` one int64 (count,) tensor per dim (what x[mask] indexes with). Realizes self."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    values = self.numpy()
    if self.ndim == 0:  # PyTorch: one (or no) hit with no coordinates
      count = int(bool(values))
      if as_tuple: return (Tensor.zeros(count, dtype=dtypes.int64, device=self.device),)
      return Tensor.zeros(count, 0, dtype=dtypes.int64, device=self.device)
    coordinates = np.nonzero(values)
    if as_tuple: return tuple(Tensor(c.astype(np.int64), device=self.device) for c in coordinates)
    return Tensor(np.stack(coordinates, axis=1).astype(np.int64).reshape(-1, self.ndim), device=self.device)

  def argwhere(self) -> Tensor:
    """The same as nonzero(): an int64 (count, ndim) tensor of the non-zero elements' indices."""
    return self.nonzero()

  def masked_select(self, mask: Tensor) -> Tensor:
    """The elements where `mask` (bool, broadcast with self) is True, as a 1-D tensor in row-major order, as
    torch.masked_select. Realizes the mask; the values are a lazy gather, so gradients flow back to self."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    if mask.dtype != dtypes.bool: raise DTypeError(f"masked_select needs a bool mask, got {mask.dtype}")
    x, mask = self._broadcasted_pair(mask)
    positions = np.flatnonzero(mask.numpy()).astype(np.int32)
    return x.reshape(-1)[Tensor(positions, device=self.device)]

  def _broadcasted_pair(self, other: Tensor) -> tuple[Tensor, Tensor]:
    """self and `other` expanded to their broadcast shape, each keeping its dtype."""
    shape = tuple(np.broadcast_shapes(self.shape, other.shape))
    return self.expand(shape), other.expand(shape)

  def unique(self, sorted: bool = True, return_inverse: bool = False, return_counts: bool = False,  # noqa: A002
             dim: int | None = None) -> Tensor | tuple[Tensor, ...]:
    """The distinct values (or distinct slices along `dim`) in ascending order, as torch.unique, with the index of
    each element's value among them (`return_inverse`, the input's shape; (size of dim,) with `dim`) and how often
    each occurs (`return_counts`), both int64. Always sorted (`sorted=False` is accepted, as PyTorch's CPU kernel
    may sort anyway). Realizes self; not differentiable."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    values = self.numpy()
    axis = None if dim is None else self._axis(dim)
    found = np.unique(values, return_inverse=True, return_counts=True, axis=axis)
    unique_values, inverse, counts = found
    inverse = inverse.reshape(self.shape if axis is None else (-1,)).astype(np.int64)
    results = [Tensor(unique_values, dtype=self.dtype, device=self.device)]
    if return_inverse: results.append(Tensor(inverse, device=self.device))
    if return_counts: results.append(Tensor(counts.astype(np.int64), device=self.device))
    return results[0] if len(results) == 1 else tuple(results)
