"""Indexing for Tensor (IndexingMixin): `t[index]` and `t[index] = value`.

Indexing with ints, slices, None and ... is a chain of views (`_basic_index_steps`, or `_plain_view_index` in one
step); indexing with one integer tensor (and `gather`, and so Embedding) reads only the rows it needs (`_take_rows`:
a load at computed offsets; an index outside [-n, n) reads zeros); several integer tensors are a masked sum (one
kernel). Indexed adds (`scatter_add`, `index_add`, and the gradient of a row lookup) are one indexed-accumulate kernel
(`_add_rows_at`: Ops.INDEX_ACCUMULATE, no one-hot). `__setitem__` runs the view chain backwards and writes through
`assign`.

The methods become Tensor's through `class Tensor(..., IndexingMixin, ...)` in ourgrad/tensor.py; this module does
not import that one (it imports this one), so methods that make a Tensor take the class from `self`.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ourgrad import function_movement as FM
from ourgrad.dtype import dtypes
from ourgrad.errors import DeviceError, IndexOutOfRangeError, ShapeError
from ourgrad.helpers import prod
from ourgrad.lazy import LazyBuffer
from ourgrad.ops import Ops
from ourgrad.tensor_math import _broadcast_shape

if TYPE_CHECKING:
  from ourgrad.tensor import Scalar, Tensor


class IndexingMixin:
  """Tensor's `__getitem__` and `__setitem__`, with the row reads and indexed adds they (and gather, scatter_add,
  index_add, Embedding) are built on."""

  def _index_tensor(self, item: Any) -> Tensor:
    """A list, tuple or array used as one index, as an integer tensor; the list may hold Tensors (`x[[i, 1], :]`)."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    if isinstance(item, Tensor): return item
    if isinstance(item, (list, tuple)) and any(isinstance(part, (Tensor, list, tuple)) for part in item):
      return Tensor.stack([self._index_tensor(part) for part in item]) if item else Tensor(item, device=self.device)
    return Tensor(item, device=self.device)

  def _normalize_index(self, index: Any) -> list[Any]:
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    # PyTorch's (and old numpy's) rule: a list shorter than 32 holding a sequence, tensor, slice, None or ... is a
    # tuple of indices (x[[[0]]] is x[[0]], x[[[0, 1], [1, 2]]] is x[[0, 1], [1, 2]])
    if isinstance(index, list) and len(index) < 32 and any(
        isinstance(item, (list, tuple, np.ndarray, Tensor, slice)) or item is None or item is Ellipsis
        for item in index):
      index = tuple(index)
    items = list(index) if isinstance(index, tuple) else [index]
    # a list, tuple or array inside the index is an integer-tensor index, as in PyTorch (x[i, (1, 2, 3)])
    items = [self._index_tensor(item) if isinstance(item, (list, tuple, np.ndarray)) else item for item in items]
    ellipsis_count = sum(1 for item in items if item is Ellipsis)
    if ellipsis_count > 1: raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(1 for item in items if item is not None and item is not Ellipsis)
    if used > self.ndim:
      raise IndexOutOfRangeError(f"too many indices for a tensor of shape {self.shape}: {used} given")
    if ellipsis_count:
      # by identity: list.index would compare Tensors with == (elementwise)
      position = next(number for number, item in enumerate(items) if item is Ellipsis)
      items[position:position + 1] = [slice(None)] * (self.ndim - used)
      return items
    return items + [slice(None)] * (self.ndim - used)  # unindexed trailing dims are kept whole

  def _basic_index_steps(self, items: list[Any]) -> tuple[list[tuple[Any, Any]], list[tuple[int, Tensor]]]:
    """The view steps of basic indexing as (forward, inverse) pairs of functions on Tensors, plus the integer
    tensor indices left for advanced indexing (with the dimension each applies to after the steps). The
    inverses let __setitem__ put a value back where getitem would have read it."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    steps: list[tuple[Any, Any]] = []
    tensor_dims: list[tuple[int, Tensor]] = []
    shape, dim = list(self.shape), 0
    for item_number, item in enumerate(items):
      if item is None:
        steps.append((lambda t, d=dim: t.unsqueeze(d), lambda t, d=dim: t.squeeze(d)))
        shape.insert(dim, 1)
        dim += 1
      elif isinstance(item, Tensor):
        if item.dtype.is_float: raise IndexError(f"tensors used as indices must be integers, got {item.dtype}")
        if item.dtype == dtypes.bool:
          raise IndexError("boolean mask indexing gives a data-dependent shape; use Tensor.where instead")
        tensor_dims.append((dim, item))
        dim += 1
      elif isinstance(item, (bool, np.bool_)):
        raise IndexError("a Python bool is not a valid index")
      elif isinstance(item, (int, np.integer)):
        size = shape[dim]
        position = int(item) + size if item < 0 else int(item)
        if not 0 <= position < size:
          # name the dimension of the indexed tensor, not of the partly indexed view `dim` counts in
          source_dim = sum(1 for earlier in items[:item_number] if earlier is not None)
          raise IndexOutOfRangeError(f"index {item} is out of range for dimension {source_dim} with size {size} "
                                     f"(tensor shape {self.shape})")
        steps.append(_narrow_step(dim, position, position + 1, size))
        steps.append((lambda t, d=dim: t.squeeze(d), lambda t, d=dim: t.unsqueeze(d)))
        shape.pop(dim)
        tensor_dims = [(d - 1 if d > dim else d, t) for d, t in tensor_dims]
      elif isinstance(item, slice):
        size = shape[dim]
        start, stop, step = item.indices(size)
        if step > 0:
          low, high = start, max(stop, start)
        else:
          low, high = stop + 1, max(start + 1, stop + 1)  # a negative step walks high-1 down to low
        steps.append(_narrow_step(dim, low, high, size))
        if step < 0: steps.append((lambda t, d=dim: t.flip(d), lambda t, d=dim: t.flip(d)))
        length = high - low
        if abs(step) > 1 and length > 0:
          steps.append(_stride_step(dim, abs(step), length))
          length = math.ceil(length / abs(step))
        shape[dim] = length
        dim += 1
      else:
        raise IndexError(f"cannot index a tensor with {type(item).__name__}; use ints, slices, None, ... or tensors")
    return steps, tensor_dims

  def __getitem__(self, index: Any) -> Tensor:
    """Basic indexing (ints, slices with steps, None, Ellipsis) as views, integer-Tensor indexing, and boolean
    masks (x[mask]: realizes the mask, as its count of True sets the result's size)."""
    plain = self._plain_view_index(index)
    if plain is not None: return plain
    # one integer tensor: the rows it picks (what the general path below comes to, without parsing the index: every
    # embedding lookup and KV-cache placement of a model's forward)
    if type(index) is type(self) and self.ndim and not index.dtype.is_float and index.dtype != dtypes.bool:
      return self._take_rows(index)
    index = self._bool_masks_as_indices(index)
    steps, tensor_dims = self._basic_index_steps(self._normalize_index(index))
    x = self
    for forward, _ in steps: x = forward(x)
    return x._index_with_tensors(tensor_dims) if tensor_dims else x

  def _plain_view_index(self, index: Any) -> Tensor | None:
    """self[index] for an index of ints, unit-step slices, None and at most one ... over concrete sizes: one shrink
    and one reshape, where the general path builds a view step per indexed dim (a model's cache and head slicing ran
    it ~8 times a layer). None for any other index, and for an int out of range (the general path raises then)."""
    items = index if type(index) is tuple else (index,)
    shape = self.shape
    if not all(type(item) in _PLAIN_INDEX_TYPES for item in items) or not all(type(size) is int for size in shape):
      return None
    ellipses = [number for number, item in enumerate(items) if item is Ellipsis]
    used = sum(1 for item in items if item is not None and item is not Ellipsis)
    if len(ellipses) > 1 or used > len(shape): return None   # the general path's errors
    if ellipses: items = items[:ellipses[0]] + (slice(None),) * (len(shape) - used) + items[ellipses[0] + 1:]
    bounds: list[tuple[int, int]] = []
    new_shape: list[int] = []
    for item in items:
      if item is None:
        new_shape.append(1)
        continue
      size = shape[len(bounds)]
      if type(item) is int:
        position = item + size if item < 0 else item
        if not 0 <= position < size: return None
        bounds.append((position, position + 1))   # and no dim in the result
        continue
      if item.step is not None and item.step != 1: return None
      start, stop, _ = item.indices(size)
      bounds.append((start, max(start, stop)))
      new_shape.append(max(start, stop) - start)
    new_shape.extend(shape[len(bounds):])
    bounds.extend((0, size) for size in shape[len(bounds):])
    return self.shrink(bounds).reshape(tuple(new_shape))

  def _take_rows(self, index: Tensor) -> Tensor:
    """self[index] along dim 0 for an integer tensor `index` of any shape -> index.shape + self.shape[1:], reading
    only the picked rows. Negative indices count from the end; an index outside [-n, n) gives a row of zeros."""
    if index.device != self.device:
      raise DeviceError(f"the index is on {index.device}, the indexed tensor on {self.device}; move one with .to()")
    rows, rest = self.shape[0], self.shape[1:]
    flat_index = index.reshape(-1).cast(dtypes.int32)
    lazy = flat_index.lazydata
    if type(lazy) is LazyBuffer:   # (the same ops on lazy buffers: an index needs no autograd node)
      negative = lazy.elementwise(Ops.CMPLT, lazy.operand_like(0))
      flat_index = type(self)(negative.elementwise(Ops.WHERE, lazy.elementwise(Ops.ADD, lazy.operand_like(rows)), lazy))
    else:
      flat_index = (flat_index < 0).where(flat_index + rows, flat_index)
    picked = FM.GatherRows.apply(self.reshape(rows, prod(rest)), flat_index.detach())
    return picked.reshape(*index.shape, *rest)

  def _add_rows_at(self, index: Tensor, rows: Tensor) -> Tensor:
    """self with rows[m] added to self[index[m]] along dim 0, for m = 0, 1, ... in order: `index` holds M integers
    (any shape, flattened), `rows` is (M, *self.shape[1:]). Repeated indices are summed; negative ones count from the
    end; one outside [-n, n) adds nothing (as a gather there reads 0). One indexed-accumulate kernel
    (LazyBuffer.accumulate_rows), never a one-hot; differentiable in self and rows."""
    if index.device != self.device or rows.device != self.device:
      raise DeviceError(f"indexed add: the tensor is on {self.device}, the index on {index.device}, the values on "
                        f"{rows.device}; move them with .to()")
    size, rest = self.shape[0], self.shape[1:]
    flat_index = index.reshape(-1).cast(dtypes.int32)
    flat_index = (flat_index < 0).where(flat_index + size, flat_index)
    count = flat_index.shape[0]
    if rows.shape != (count, *rest):
      raise ShapeError(f"indexed add of values {rows.shape} into {self.shape} at {count} indices: the values must be "
                       f"{(count, *rest)}")
    # bools accumulate as integers (a place any True reaches becomes True)
    dtype = dtypes.int32 if self.dtype == dtypes.bool else self.dtype
    start = self.cast(dtype).reshape(size, prod(rest))
    added = FM.AccumulateRows.apply(start, flat_index.detach(), rows.cast(dtype).reshape(count, prod(rest)))
    added = added.reshape(self.shape)
    return added != 0 if self.dtype == dtypes.bool else added

  def _index_with_tensors(self, tensor_dims: list[tuple[int, Tensor]]) -> Tensor:
    """Advanced (integer tensor) indexing, numpy rules: the broadcast index shape replaces the indexed dims,
    in place if they were adjacent, else at the front. One index tensor reads only the rows it picks
    (`_take_rows`); several are computed as a masked sum (one kernel)."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    if len(tensor_dims) == 1:
      dim, index = tensor_dims[0]
      rest = [axis for axis in range(self.ndim) if axis != dim]
      picked = self.permute([dim] + rest)._take_rows(index)  # (index..., rest...)
      batch = index.ndim
      # the index dims go where the indexed dim was
      return picked.permute(list(range(batch, batch + dim)) + list(range(batch)) +
                            list(range(batch + dim, batch + len(rest))))
    dims = [dim for dim, _ in tensor_dims]
    index_shape = _broadcast_shape(*(index.shape for _, index in tensor_dims))
    rest = [axis for axis in range(self.ndim) if axis not in dims]
    x = self.permute(rest + dims)  # (rest..., indexed...)
    sizes = [self.shape[dim] for dim in dims]
    batch = len(index_shape)
    picked = None
    for number, (dim, index) in enumerate(tensor_dims):
      size = self.shape[dim]
      index = index.cast(dtypes.int32).expand(index_shape)
      index = (index < 0).where(index + size, index)
      positions = Tensor.arange(size, device=self.device)
      shape = (1,) * len(index_shape) + tuple(size if n == number else 1 for n in range(len(dims)))
      one_hot = index.reshape(index_shape + (1,) * len(dims)) == positions.reshape(shape)
      picked = one_hot if picked is None else (picked & one_hot)
    assert picked is not None
    values = x.reshape(tuple(x.shape[:len(rest)]) + (1,) * batch + tuple(sizes))
    chosen = picked.where(values, 0) if self.dtype != dtypes.bool else picked.where(values.cast(dtypes.int32), 0)
    summed = chosen.sum(axis=tuple(range(len(rest) + batch, len(rest) + batch + len(dims))), dtype=chosen.dtype)
    result = summed.cast(self.dtype)
    # As in PyTorch, a 0-d index selects like an int (its dim is gone before the placement rule applies): the other
    # index dims, adjacent once the 0-d ones are gone, take the broadcast dims where they were; else they go first
    selected = [dim for dim, index in tensor_dims if index.ndim == 0]
    placed = [dim - sum(1 for zero in selected if zero < dim) for dim, index in tensor_dims if index.ndim > 0]
    adjacent = bool(placed) and placed == list(range(placed[0], placed[0] + len(placed)))
    position = placed[0] if adjacent else 0
    order = list(range(position)) + list(range(len(rest), len(rest) + batch)) + list(range(position, len(rest)))
    return result.permute(order)

  def __setitem__(self, index: Any, value: Tensor | Scalar) -> None:
    """`t[index] = value` for basic indices (ints, slices, None, ...). The value is put back into place by
    the inverse view steps and merged with `where`: one fused elementwise kernel writing this tensor's buffer.
    Integer-tensor indices and boolean masks go through `_setitem_advanced`."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    if self._setitem_by_mask(index, value): return
    index = self._bool_masks_as_indices(index)
    steps, tensor_dims = self._basic_index_steps(self._normalize_index(index))
    if tensor_dims: return self._setitem_advanced(index, value)
    selected = self
    for forward, _ in steps: selected = forward(selected)
    value = value if isinstance(value, Tensor) else Tensor(value, device=self.device, dtype=self.dtype)
    if value.device != self.device:
      raise DeviceError(f"cannot assign a tensor on {value.device} into one on {self.device}; use .to()")
    value = value.cast(self.dtype).expand(selected.shape)
    inside = Tensor.full(selected.shape, True, dtypes.bool, device=self.device)
    for _, inverse in reversed(steps): value, inside = inverse(value), inverse(inside)
    # `self`, not detached: the elements not written keep their gradient path (Tensor.assign adopts the graph)
    self.assign(inside.where(value, self))

  def _bool_masks_as_indices(self, index: Any) -> Any:
    """The index with each boolean mask (a bool Tensor, numpy array or list) replaced by the integer tensors of its
    True positions, one per dim it covers (numpy's rule: a k-dim mask indexes k dims). Realizes the masks."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    items = list(index) if isinstance(index, tuple) else [index]
    masks = [_as_bool_mask(item, Tensor, self.device) for item in items]
    if all(mask is None for mask in masks): return index
    consumed = [mask.ndim if mask is not None else 0 if item is None or item is Ellipsis else 1
                for item, mask in zip(items, masks)]
    converted: list[Any] = []
    dim = 0
    for position, (item, mask) in enumerate(zip(items, masks)):
      if item is Ellipsis: dim = self.ndim - sum(consumed[position + 1:])
      if mask is None:
        converted.append(item)
      else:
        if mask.ndim == 0: raise IndexError("a 0-d boolean mask is not supported as an index; use where")
        covered = self.shape[dim:dim + mask.ndim]
        if mask.shape != covered:
          raise IndexError(f"boolean mask of shape {mask.shape} does not match the dims it indexes, {covered} at dim "
                           f"{dim} of a tensor of shape {self.shape}")
        converted.extend(mask.nonzero(as_tuple=True))
      dim += consumed[position]
    return tuple(converted)

  def _setitem_by_mask(self, index: Any, value: Any) -> bool:
    """`t[mask] = value` with a bool mask over the leading dims and a value that broadcasts to the rest (a number,
    or one row): a lazy `where`, no realize. False (nothing done) for any other index."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    mask = _as_bool_mask(index, Tensor, self.device)
    if mask is None or mask.ndim == 0 or mask.shape != self.shape[:mask.ndim]: return False
    value = value if isinstance(value, Tensor) else Tensor(value, device=self.device, dtype=self.dtype)
    rest = self.shape[mask.ndim:]
    if value.ndim > len(rest) or any(v not in (1, r) for v, r in zip(value.shape[::-1], rest[::-1])): return False
    if value.device != self.device:
      raise DeviceError(f"cannot assign a tensor on {value.device} into one on {self.device}; use .to()")
    spread = mask.reshape(mask.shape + (1,) * len(rest))
    self.assign(spread.where(value.cast(self.dtype), self.detach()))
    return True

  def _setitem_advanced(self, index: Any, value: Tensor | Scalar) -> None:
    """`t[index] = value` where the index holds integer tensors (boolean masks already turned into them). The flat
    address of every selected element comes from indexing an arange the same way, realized (as PyTorch's eager
    index_put_ reads its indices); on the host each place then learns which source writes it, the last one where
    an index repeats (as numpy's and PyTorch's CPU assignment). The new values are a lazy gather of the sources and a
    where with the old ones, written through assign like basic setitem: O(numel), no one-hot."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    # 1 + the flat address of each selected element; an index out of range reads 0 (see _take_rows)
    places = (Tensor.arange(self.numel(), device=self.device) + 1).reshape(self.shape)[index]
    value = value if isinstance(value, Tensor) else Tensor(value, device=self.device, dtype=self.dtype)
    if value.device != self.device:
      raise DeviceError(f"cannot assign a tensor on {value.device} into one on {self.device}; use .to()")
    sources = value.cast(self.dtype).expand(places.shape).reshape(-1, 1)
    if places.numel() == 0: return
    addresses = places.numpy().reshape(-1).astype(np.int64) - 1
    if (addresses < 0).any():
      raise IndexOutOfRangeError(f"an index tensor in t[index] = value is out of range for shape {self.shape}")
    source_of_place = np.full(self.numel(), -1, dtype=np.int32)
    source_of_place[addresses] = np.arange(addresses.size, dtype=np.int32)  # numpy assigns in order: the last wins
    picked = sources._take_rows(Tensor(np.maximum(source_of_place, 0), device=self.device)).reshape(self.shape)
    written = Tensor(source_of_place >= 0, device=self.device).reshape(self.shape)
    self.assign(written.where(picked, self.detach()))


def _as_bool_mask(item: Any, tensor_class: Any, device: Any) -> Any:
  """`item` as a bool Tensor if it is a boolean mask (a bool Tensor, numpy bool array, or list of bools), else None."""
  if isinstance(item, tensor_class): return item if item.dtype == dtypes.bool else None
  if isinstance(item, np.ndarray): return tensor_class(item, device=device) if item.dtype == np.bool_ else None
  if isinstance(item, list) and item and all(isinstance(part, (bool, np.bool_)) for part in item):
    return tensor_class(item, device=device)
  return None


# the index items `IndexingMixin._plain_view_index` takes (exact types: a bool is no int index)
_PLAIN_INDEX_TYPES = (int, slice, type(None), type(Ellipsis))


def _narrow_step(dim: int, start: int, end: int, size: int) -> tuple[Any, Any]:
  """Keep [start, end) of `dim`; the inverse pads back to `size`."""
  def forward(t: Tensor) -> Tensor: return t.shrink([(start, end) if a == dim else None for a in range(t.ndim)])
  def inverse(t: Tensor) -> Tensor: return t.pad([(start, size - end) if a == dim else None for a in range(t.ndim)])
  return forward, inverse


def _stride_step(dim: int, step: int, length: int) -> tuple[Any, Any]:
  """Keep every `step`-th element of `dim` (of size `length`); the inverse spreads them back out with zeros."""
  def forward(t: Tensor) -> Tensor: return t._stride_axis(dim, step)

  def inverse(t: Tensor) -> Tensor:
    kept = t.shape[dim]
    spread = t.unsqueeze(dim + 1).pad([(0, step - 1) if a == dim + 1 else None for a in range(t.ndim + 1)])
    flat = spread.reshape(t.shape[:dim] + (kept * step,) + t.shape[dim + 1:])
    return flat.shrink([(0, length) if a == dim else None for a in range(t.ndim)])
  return forward, inverse
