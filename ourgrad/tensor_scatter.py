"""Gather and scatter for Tensor (ScatterMixin): gather, scatter, scatter_add, scatter_reduce, index_add.

A gather reads each output element at a computed place (`_flat_places`, then the row lookup `_take_rows` of
tensor_movement.py: a load at computed offsets). A sum scatter (`scatter_add`, `index_add`, `scatter_reduce` with sum
or mean) is one indexed-accumulate kernel (`_add_rows_at`: Ops.INDEX_ACCUMULATE, deterministic, no one-hot); the
other reductions compare every source position with every target (`_scatter_hits`) and reduce over the hits.

The methods become Tensor's through `class Tensor(ScatterMixin, ...)` in ourgrad/tensor.py; this module does not
import that one (it imports this one): methods that make a Tensor use `type(self)`.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ourgrad.dtype import dtypes
from ourgrad.errors import DeviceError, ShapeError
from ourgrad.helpers import prod

if TYPE_CHECKING:
  from ourgrad.tensor import Scalar, Tensor


class ScatterMixin:
  """Tensor's gather, scatter, scatter_add, scatter_reduce and index_add."""
  __slots__ = ()

  def gather(self, dim: int, index: Tensor) -> Tensor:
    """out[i][j] = self[i][index[i][j]] along `dim` (torch.gather); reads only the picked elements. An index
    outside [-n, n) for the size n of `dim` reads 0."""
    axis = self._axis(dim)
    if index.ndim != self.ndim:
      raise ShapeError(f"gather index must have {self.ndim} dims like the input {self.shape}, got {index.shape}")
    if index.dtype.is_float or index.dtype == dtypes.bool:
      raise IndexError(f"gather index must hold integers, got {index.dtype}")
    for a, (size, index_size) in enumerate(zip(self.shape, index.shape)):
      if a != axis and index_size > size:
        raise ShapeError(f"gather index shape {index.shape} exceeds input shape {self.shape} in dim {a}")
    if index.device != self.device:
      raise DeviceError(f"the gather index is on {index.device}, the input on {self.device}; move one with .to()")
    return self.reshape(-1, 1)._take_rows(self._flat_places(axis, index)).reshape(index.shape)

  def _flat_places(self, axis: int, index: Tensor) -> Tensor:
    """For each element of `index`, the flat address in this tensor of the place it names: its own coordinates,
    `index` along `axis` (negative counting from the end). An index outside [-n, n) along `axis` gives the address
    one past the last element (a gather reads 0 there, an indexed accumulate adds nothing)."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    size = self.shape[axis]
    picked = index.cast(dtypes.int32)
    picked = (picked < 0).where(picked + size, picked)
    strides = [prod(self.shape[a + 1:]) for a in range(self.ndim)]
    flat = picked * strides[axis]
    for a in range(self.ndim):
      if a == axis or index.shape[a] == 1: continue
      shape = [-1 if b == a else 1 for b in range(self.ndim)]
      flat = flat + Tensor.arange(index.shape[a], device=self.device).reshape(shape) * strides[a]
    return ((picked >= 0) & (picked < size)).where(flat, self.numel())

  def _scatter_hits(self, dim: int, index: Tensor, src: Tensor, name: str = "scatter") -> tuple[Tensor, Tensor]:
    """With `dim` moved last: a bool one-hot (..., k, n), True where source position k along `dim` targets position
    n, and the sources (..., k, 1) in this tensor's dtype. Shapes checked as torch.scatter checks them (errors name
    the op `name`)."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    axis = self._axis(dim)
    self._check_scatter(name, dim, index, src)
    src = src.shrink([(0, size) for size in index.shape])
    size = self.shape[axis]
    index_last = index.transpose(axis, -1).unsqueeze(-1)  # (..., k, 1)
    index_last = (index_last < 0).where(index_last + size, index_last)
    hits = index_last == Tensor.arange(size, device=self.device)  # (..., k, n)
    return hits, src.cast(self.dtype).transpose(axis, -1).unsqueeze(-1)

  def _scattered_back(self, dim: int, per_target: Tensor, fill: Scalar = 0) -> Tensor:
    """A (..., n) result of the one-hot layout (`dim` last) back in this tensor's shape: the index may be smaller than
    it in the other dims (`fill` there)."""
    axis = self._axis(dim)
    grow = [(0, target - have) for target, have in zip(self.transpose(axis, -1).shape, per_target.shape)]
    return per_target.pad(grow, value=fill).transpose(axis, -1)

  def _check_scatter(self, name: str, dim: int, index: Tensor, src: Tensor) -> None:
    """The shape and dtype rules torch's scatter functions check: index and src of this tensor's rank, an integer
    index no larger than src anywhere nor than this tensor outside `dim`."""
    axis = self._axis(dim)
    if index.ndim != self.ndim or src.ndim != self.ndim:
      raise ShapeError(f"{name} needs index and src with {self.ndim} dims like the input {self.shape}, got "
                       f"{index.shape} and {src.shape}")
    if index.dtype.is_float or index.dtype == dtypes.bool:
      raise IndexError(f"{name} index must hold integers, got {index.dtype}")
    if any(i > s for i, s in zip(index.shape, src.shape)) or \
       any(i > t for a, (i, t) in enumerate(zip(index.shape, self.shape)) if a != axis):
      raise ShapeError(f"{name} index shape {index.shape} exceeds src {src.shape} or input {self.shape}")

  def scatter_add(self, dim: int, index: Tensor, src: Tensor) -> Tensor:
    """self with src[i][j] added at [index[i][j]][j] (for dim 0; likewise for other dims), as torch.scatter_add.
    Every element of `index` names one place of self (its own coordinates, `index` along `dim`); the sources are
    added there in order, repeated places summed, by one indexed-accumulate kernel (no one-hot). An index outside
    [-n, n) adds nothing."""
    axis = self._axis(dim)
    self._check_scatter("scatter_add", dim, index, src)
    if index.device != self.device or src.device != self.device:
      raise DeviceError(f"scatter_add: the input is on {self.device}, the index on {index.device}, src on "
                        f"{src.device}; move them with .to()")
    if index.numel() == 0: return self
    src = src.shrink([(0, size) for size in index.shape])
    added = self.reshape(-1)._add_rows_at(self._flat_places(axis, index), src.cast(self.dtype).reshape(-1))
    return added.reshape(self.shape)

  def scatter(self, dim: int, index: Tensor, src: Tensor | float | int, reduce: str | None = None) -> Tensor:
    """self with src (a tensor, or one number) written at `index` along `dim`, as torch.scatter. Where an index
    repeats, the last source along `dim` is kept (what PyTorch's CPU loop leaves; its docs leave it unspecified).
    reduce="add" adds every source, reduce="multiply" multiplies self by every source, as torch.scatter's."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    source = src if isinstance(src, Tensor) else Tensor.full(index.shape, src, self.dtype, device=self.device)
    if reduce == "add": return self.scatter_add(dim, index, source)
    if reduce not in (None, "multiply"):
      raise ValueError(f"scatter reduce must be None, 'add' or 'multiply', got {reduce!r}")
    hits, values = self._scatter_hits(dim, index, source)
    if reduce == "multiply":
      factors = hits.where(values, 1).cast(self.dtype).prod(-2)
      return self * self._scattered_back(dim, factors, fill=1)
    # the last source hitting each target: its position k + 1 is the largest among the hits
    order = Tensor.arange(1, hits.shape[-2] + 1, device=self.device).reshape(hits.shape[-2], 1)
    last = hits.where(order, 0).max(-2, keepdim=True)
    chosen = hits & (order == last)
    placed = chosen.where(values, 0).sum(-2, dtype=self.dtype if self.dtype != dtypes.bool else dtypes.int32)
    written = self._scattered_back(dim, hits.any(-2))
    return written.where(self._scattered_back(dim, placed).cast(self.dtype), self)

  def scatter_reduce(self, dim: int, index: Tensor, src: Tensor, reduce: str, include_self: bool = True) -> Tensor:
    """self with the values of `src` reduced into the places `index` names along `dim`, as torch.scatter_reduce:
    `reduce` is "sum", "prod", "mean", "amax" or "amin"; with `include_self` the present value takes part in the
    reduction, otherwise only the sources do (places no index names keep their value either way). Each place
    reduces over a one-hot of the sources that land on it (one fused reduce, no scatter op), so every source takes
    part, repeated indices included, and the gradients are the reduce's own (amax/amin share them among ties);
    "sum" and "mean" are indexed accumulates instead (scatter_add, no one-hot)."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    identities = {"sum": 0.0, "mean": 0.0, "prod": 1.0, "amax": -math.inf, "amin": math.inf}
    if reduce not in identities:
      raise ValueError(f"scatter_reduce reduce must be one of {sorted(identities)}, got {reduce!r}")
    if reduce in ("sum", "mean") and self.dtype != dtypes.bool:
      self._check_scatter("scatter_reduce", dim, index, src)
      return self._scatter_sum(dim, index, src, reduce, include_self)
    hits, values = self._scatter_sources(dim, index, src)  # (..., k, n) each, the target axis last
    axis = self._axis(dim)
    if include_self:  # the present value as one more source, landing on its own place
      own = self.transpose(axis, -1).unsqueeze(-2)
      hits = Tensor.ones(*own.shape, dtype=dtypes.bool, device=self.device).cat(hits, dim=-2)
      values = own.cat(values.expand(*values.shape[:-1], own.shape[-1]), dim=-2)
    identity = identities[reduce]
    if not self.dtype.is_float and math.isinf(identity):
      identity = self.dtype.min if reduce == "amax" else self.dtype.max
    picked = hits.where(values, Tensor.full((), identity, self.dtype, device=self.device))
    if reduce in ("sum", "mean"): reduced = picked.sum(-2, dtype=self.dtype if self.dtype != dtypes.bool else None)
    elif reduce == "prod": reduced = picked.prod(-2)
    else: reduced = picked.max(-2) if reduce == "amax" else picked.min(-2)
    count = hits.sum(-2)
    if reduce == "mean":
      mean = reduced / count.maximum(1).cast(reduced.dtype)
      # integer means round down, as torch's floor division of the sum by the count
      reduced = mean if self.dtype.is_float else reduced.div(count.maximum(1), rounding_mode="floor")
    written = (count > 0).transpose(axis, -1)
    return written.where(reduced.cast(self.dtype).transpose(axis, -1), self)

  def _scatter_sum(self, dim: int, index: Tensor, src: Tensor, reduce: str, include_self: bool) -> Tensor:
    """scatter_reduce's "sum" and "mean": indexed accumulates (scatter_add) of the sources and of their count, no
    one-hot. Places no index names keep their value."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    zeros = Tensor.zeros(*self.shape, dtype=self.dtype, device=self.device)
    total = (self if include_self else zeros).scatter_add(dim, index, src.cast(self.dtype))
    ones = Tensor.ones(*index.shape, dtype=dtypes.int32, device=self.device)
    count = Tensor.zeros(*self.shape, dtype=dtypes.int32, device=self.device).scatter_add(dim, index, ones)
    reduced = total
    if reduce == "mean":
      divisor = (count + 1 if include_self else count.maximum(1))
      # integer means round down, as torch's floor division of the sum by the count
      reduced = total / divisor.cast(total.dtype) if self.dtype.is_float else total.div(divisor, rounding_mode="floor")
    return (count > 0).where(reduced.cast(self.dtype), self)

  def _scatter_sources(self, dim: int, index: Tensor, src: Tensor) -> tuple[Tensor, Tensor]:
    """For scatter_reduce: with `dim` moved last, a bool (..., k, n) of which of the k sources along `dim` lands on
    each of the n places, and the sources' values (..., k, 1), both widened to this tensor's other sizes (the index
    may be smaller than it there: the extra places receive nothing)."""
    axis = self._axis(dim)
    hits, values = self._scatter_hits(dim, index, src, "scatter_reduce")
    grow = [(0, target - have) for target, have in zip(self.transpose(axis, -1).shape[:-1], hits.shape[:-2])]
    return hits.pad(grow + [None, None]), values.pad(grow + [None, None])

  def index_add(self, dim: int, index: Tensor, source: Tensor, alpha: float = 1.0) -> Tensor:
    """self with source's slices along `dim` added at the positions of the 1-D `index` (torch.index_add), in order,
    repeated positions summed: one indexed-accumulate kernel over the slices (no one-hot). An index outside [-n, n)
    adds nothing."""
    axis = self._axis(dim)
    if index.ndim != 1: raise ShapeError(f"index_add takes a 1-D index, got shape {index.shape}")
    if index.dtype.is_float or index.dtype == dtypes.bool:
      raise IndexError(f"index_add index must hold integers, got {index.dtype}")
    expected = self.shape[:axis] + (index.shape[0],) + self.shape[axis + 1:]
    if source.ndim != self.ndim or source.shape != expected:
      raise ShapeError(f"index_add of source {source.shape} into {self.shape} along dim {axis} with {index.shape[0]} "
                       f"indices: the source must be {expected}")
    values = source.cast(self.dtype)
    if alpha != 1.0: values = (values * alpha).cast(self.dtype)
    added = self.movedim(axis, 0)._add_rows_at(index, values.movedim(axis, 0))
    return added.movedim(0, axis)
