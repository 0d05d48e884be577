"""Movement, joining and splitting for Tensor (MovementMixin); indexing is tensor_indexing.py's, gather and scatter
tensor_scatter.py's.

Movement ops (reshape, permute, expand, pad, shrink, flip and the compositions of them: squeeze, flatten,
repeat, ...) change how a tensor's elements are addressed, never the elements: each is a free view on the same
LazyBuffer. `cat` pads each input into place and adds them, so a join fuses into the consumer.

The methods become Tensor's through `class Tensor(MovementMixin, ...)` in ourgrad/tensor.py; this module does not
import that one at load time (it imports this one), so methods that make a Tensor import the class when called.
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ourgrad import function_movement as FM
from ourgrad.dtype import dtypes, least_upper_dtype
from ourgrad.errors import AxisError, DeviceError, DTypeError, ShapeError
from ourgrad.function import _broadcast_to, view_without_gradient
from ourgrad.helpers import normalize_axis, prod
from ourgrad.lazy import LazyBuffer
from ourgrad.shape.shapetracker import valid_window
from ourgrad.shape.symbolic import is_symbolic, sym_infer
from ourgrad.tensor_resize import PAD_MODES, pad_with_mode

if TYPE_CHECKING:
  from ourgrad.tensor import Scalar, Tensor


class MovementMixin:
  """Tensor's views (reshape, permute, expand, pad, shrink, flip, ...), indexing, and cat/stack/split/chunk."""
  __slots__ = ()

  # ---------------------------------------------------------------- movement

  def _axis(self, axis: int) -> int: return normalize_axis(axis, self.ndim)

  def reshape(self, *shape: int | Sequence[int]) -> Tensor:
    """A view with a new shape; one size may be -1 (inferred)."""
    new_shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
    current = self._lazydata.shape   # (Tensor.shape without the property call: reshapes are frequent ops)
    for size in new_shape:   # (a loop, not all() over a generator: no generator frame per op)
      if type(size) is not int or size < 0:   # -1, numpy ints, symbolic sizes, errors
        new_shape = self._resolve_reshape(new_shape)
        break
    else:
      if new_shape == current: return self  # the common no-op (expand and the reduces reshape to the same shape)
    if prod(new_shape) != prod(current):
      raise ShapeError(f"cannot reshape {current} ({prod(current)} elements) to {new_shape} "
                       f"({prod(new_shape)} elements)")
    if new_shape == current: return self
    # (no gradient needed: the view without a Function, as Reshape's forward makes it)
    viewed = view_without_gradient(self, LazyBuffer.reshape, new_shape)
    return viewed if viewed is not None else FM.Reshape.apply(self, shape=new_shape)

  def _resolve_reshape(self, new_shape: tuple) -> tuple:
    """A reshape's sizes checked, with -1 inferred and numpy ints made ints (symbolic sizes kept)."""
    if sum(1 for size in new_shape if size == -1) > 1: raise ShapeError(f"reshape to {new_shape}: at most one -1")
    if any(not is_symbolic(size) and (not isinstance(size, (int, np.integer)) or size < -1) for size in new_shape):
      raise ShapeError(f"reshape to {new_shape}: sizes must be integers >= -1")
    if -1 in new_shape:
      known = prod(size for size in new_shape if size != -1)
      if known == 0 or self.numel() % known != 0:
        raise ShapeError(f"cannot reshape {self.shape} ({self.numel()} elements) to {new_shape}")
      new_shape = tuple(self.numel() // known if size == -1 else size for size in new_shape)
    return tuple(size if is_symbolic(size) else int(size) for size in new_shape)

  def view(self, *shape: int | Sequence[int]) -> Tensor:
    """The same as reshape: a lazy view, so unlike torch.view it also works on non-contiguous tensors."""
    return self.reshape(*shape)

  def permute(self, *order: int | Sequence[int]) -> Tensor:
    """A view with the dimensions in the order `order` (a permutation of all of them)."""
    axes = tuple(order[0]) if len(order) == 1 and isinstance(order[0], (tuple, list)) else tuple(order)
    if len(axes) != self.ndim:
      raise AxisError(f"permute of a tensor with {self.ndim} dimensions got {len(axes)} axes: {axes}")
    axes = tuple(self._axis(axis) for axis in axes)
    if sorted(axes) != list(range(self.ndim)): raise AxisError(f"permute axes {axes} are not a permutation")
    if axes == tuple(range(self.ndim)): return self
    viewed = view_without_gradient(self, LazyBuffer.permute, axes)   # (as Permute's forward makes it)
    return viewed if viewed is not None else FM.Permute.apply(self, order=axes)

  def expand(self, *shape: int | Sequence[int]) -> Tensor:
    """Broadcast size-1 dimensions to `shape` (-1 keeps a size); no data is copied."""
    new_shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
    if new_shape == self.shape: return self  # broadcasting already-equal shapes (most binary ops): nothing to do
    # the sizes' types are in the key: 4, 4.0 and True equal and hash alike, and one must not answer for another
    key = (self.shape, new_shape, tuple(map(type, new_shape)))
    try:
      padded, final = _expand_plan(*key)
    except TypeError:   # an unhashable size: not remembered
      padded, final = _expand_plan.__wrapped__(*key)
    if final == padded: return self.reshape(padded)
    viewed = view_without_gradient(self, _broadcast_to, final)   # (no gradient needed: Expand's forward, no Function)
    return viewed if viewed is not None else FM.Expand.apply(self, shape=final)

  def broadcast_to(self, shape: Sequence[int]) -> Tensor:
    """A view of this tensor broadcast to `shape` (the same as expand)."""
    return self.expand(tuple(shape))

  def transpose(self, dim0: int = -2, dim1: int = -1) -> Tensor:
    """A view with dimensions `dim0` and `dim1` swapped (the last two by default; torch needs both)."""
    order = list(range(self.ndim))
    dim0, dim1 = self._axis(dim0), self._axis(dim1)
    order[dim0], order[dim1] = order[dim1], order[dim0]
    return self.permute(order)

  @property
  def T(self) -> Tensor:  # noqa: N802
    """All dimensions reversed (the matrix transpose for 2-D tensors)."""
    return self.permute(tuple(reversed(range(self.ndim))))

  def flip(self, *dims: int | Sequence[int]) -> Tensor:
    """The elements in reverse order along each of `dims`, as a view (torch.flip copies)."""
    axes = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else tuple(dims)
    axes = {self._axis(axis) for axis in axes}
    return FM.Flip.apply(self, axes_mask=tuple(axis in axes for axis in range(self.ndim)))

  def shrink(self, arg: Sequence[tuple[int, int] | None]) -> Tensor:
    """Keep [start, end) of each dimension (None keeps all)."""
    if len(arg) != self.ndim: raise ShapeError(f"shrink of shape {self.shape} needs {self.ndim} ranges, got {arg}")
    bounds = tuple((0, size) if bound is None else tuple(bound) for bound, size in zip(arg, self.shape))
    for (start, end), size in zip(bounds, self.shape):
      if not valid_window(start, end, size): raise ShapeError(f"shrink {bounds} is outside shape {self.shape}")
    if all(bound == (0, size) for bound, size in zip(bounds, self.shape)): return self
    viewed = view_without_gradient(self, LazyBuffer.shrink, bounds)   # (as Shrink's forward makes it)
    return viewed if viewed is not None else FM.Shrink.apply(self, arg=bounds)

  def pad(self, padding: Sequence[int] | Sequence[tuple[int, int] | None], value: Scalar = 0.0,
          mode: str = "constant") -> Tensor:
    """Pad with `value`, or with PyTorch's border `mode` ("constant", "reflect", "replicate", "circular"; see
    ourgrad/tensor_resize.py). `padding` is PyTorch's flat form (last dim first: (left, right, top, bottom, ...))
    or one (before, after) pair (or None) per dimension. Negative amounts crop. tinygrad's `x.pad(p, "reflect")`
    (the mode second) works too."""
    if isinstance(value, str): mode, value = value, 0.0
    if mode == "constant" and len(padding) == self.ndim and (plain := _plain_pairs(padding)) is not None:
      # (the common form, a pooling's or a convolution's: one pair of non-negative ints or None per dim, no crop and
      # no symbolic amount to check: the general path below comes to the same, through a dozen generator frames)
      return self if plain is _NO_PADDING else _constant_padded(self, plain, value)
    if mode not in PAD_MODES: raise ValueError(f"pad mode must be one of {PAD_MODES}, got {mode!r}")
    if all(isinstance(amount, (int, np.integer)) for amount in padding):
      if len(padding) % 2 or len(padding) // 2 > self.ndim:
        raise ShapeError(f"pad {tuple(padding)} needs an even count of at most {2 * self.ndim} values")
      pairs = [(0, 0)] * self.ndim
      for index in range(len(padding) // 2): pairs[self.ndim - 1 - index] = (padding[2 * index], padding[2 * index + 1])
    else:
      if len(padding) != self.ndim: raise ShapeError(f"pad of shape {self.shape} needs {self.ndim} pairs: {padding}")
      pairs = [(0, 0) if pair is None else tuple(pair) for pair in padding]
    # a symbolic amount (a bound Variable expression) only grows: its value is checked against 0 when bound
    pairs = [tuple(_symbolic_pad_amount(amount) for amount in pair) for pair in pairs]
    crops = any(not is_symbolic(v) and v < 0 for pair in pairs for v in pair)
    grow = tuple(tuple(v if is_symbolic(v) else max(v, 0) for v in pair) for pair in pairs)
    if mode in ("reflect", "replicate"):
      # as PyTorch: the border is read from the whole input, then the negative amounts crop (reflect (2, -3) of
      # [a, b, c, d] is [c, b, a]); circular crops first, as PyTorch's circular pad does
      grown = pad_with_mode(self, grow, mode) if any(pair != (0, 0) for pair in grow) else self
      if not crops: return grown
      return grown.shrink([(-min(before, 0), size + min(after, 0)) if min(before, after) < 0 else None
                           for (before, after), size in _concrete_pairs(pairs, grown.shape)])
    crop = [(-min(before, 0), size + min(after, 0)) for (before, after), size in _concrete_pairs(pairs, self.shape)]
    x = self.shrink(crop) if crops else self
    if all(pair == (0, 0) for pair in grow): return x
    if mode != "constant": return pad_with_mode(x, grow, mode)
    return _constant_padded(x, grow, value)

  def squeeze(self, dim: int | None = None) -> Tensor:
    """A view without dimension `dim` if its size is 1 (else unchanged); dim=None drops every size-1 dimension."""
    if dim is None: return self.reshape(tuple(size for size in self.shape if size != 1))
    axis = self._axis(dim)  # AxisError for a dim out of range, 0-d tensors included (they take 0 and -1)
    if self.ndim == 0: return self
    if self.shape[axis] != 1: return self
    return self.reshape(self.shape[:axis] + self.shape[axis + 1:])

  def unsqueeze(self, dim: int) -> Tensor:
    """A view with a new dimension of size 1 at `dim` (negative counts from the end of the result)."""
    axis = normalize_axis(dim, self.ndim + 1)
    return self.reshape(self.shape[:axis] + (1,) + self.shape[axis:])

  def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    """A view with dimensions `start_dim` to `end_dim` merged into one; a 0-d tensor becomes shape (1,)."""
    if self.ndim == 0: return self.reshape(1)
    start, end = self._axis(start_dim), self._axis(end_dim)
    return self.reshape(self.shape[:start] + (prod(self.shape[start:end + 1]),) + self.shape[end + 1:])

  def unflatten(self, dim: int, sizes: Sequence[int]) -> Tensor:
    """A view with dimension `dim` split into `sizes` (one of them may be -1)."""
    axis = self._axis(dim)
    return self.reshape(self.shape[:axis] + tuple(sizes) + self.shape[axis + 1:])

  def repeat(self, *repeats: int | Sequence[int]) -> Tensor:
    """Tile the tensor `repeats[i]` times along dimension i (torch.Tensor.repeat)."""
    counts = tuple(repeats[0]) if len(repeats) == 1 and isinstance(repeats[0], (tuple, list)) else tuple(repeats)
    if len(counts) < self.ndim:
      raise ShapeError(f"repeat needs at least {self.ndim} counts for shape {self.shape}, got {counts}")
    base_shape = (1,) * (len(counts) - self.ndim) + self.shape
    x = self.reshape(base_shape)
    interleaved = tuple(size for pair in zip((1,) * len(counts), base_shape) for size in pair)
    expanded = tuple(size for pair in zip(counts, base_shape) for size in pair)
    return x.reshape(interleaved).expand(expanded).reshape(tuple(c * s for c, s in zip(counts, base_shape)))

  def repeat_interleave(self, repeats: int, dim: int | None = None) -> Tensor:
    """Each element repeated `repeats` times along `dim` (flattened first if None), as torch.repeat_interleave with
    an int count."""
    if not isinstance(repeats, (int, np.integer)) or repeats < 0:
      raise ValueError(f"repeat_interleave takes a non-negative int count, got {repeats!r}")
    x = self.flatten() if dim is None else self
    axis = 0 if dim is None else x._axis(dim)
    spread = x.unsqueeze(axis + 1).expand(x.shape[:axis + 1] + (int(repeats),) + x.shape[axis + 1:])
    return spread.reshape(x.shape[:axis] + (x.shape[axis] * int(repeats),) + x.shape[axis + 1:])

  def narrow(self, dim: int, start: int, length: int) -> Tensor:
    """The view of `length` elements of `dim` from `start` (negative counts from the end), as torch.narrow."""
    axis = self._axis(dim)
    size = self.shape[axis]
    begin = start + size if start < 0 else start
    if not 0 <= begin <= size or length < 0 or begin + length > size:
      raise ShapeError(f"narrow of dim {axis} (size {size}) from {start} for {length} elements is out of range")
    return self.shrink([(begin, begin + length) if a == axis else None for a in range(self.ndim)])

  def movedim(self, source: int | Sequence[int], destination: int | Sequence[int]) -> Tensor:
    """A view with the dimensions `source` moved to positions `destination` (the others keep their order)."""
    sources = [self._axis(a) for a in ((source,) if isinstance(source, int) else source)]
    destinations = [self._axis(a) for a in ((destination,) if isinstance(destination, int) else destination)]
    if len(sources) != len(destinations):
      raise AxisError(f"movedim needs as many destinations as sources, got {sources} and {destinations}")
    rest = iter(a for a in range(self.ndim) if a not in sources)
    placed = dict(zip(destinations, sources))
    return self.permute([placed[position] if position in placed else next(rest) for position in range(self.ndim)])

  def moveaxis(self, source: int | Sequence[int], destination: int | Sequence[int]) -> Tensor:
    """The same as movedim."""
    return self.movedim(source, destination)

  def swapaxes(self, axis0: int, axis1: int) -> Tensor:
    """The same as transpose(axis0, axis1)."""
    return self.transpose(axis0, axis1)

  def expand_as(self, other: Tensor) -> Tensor:
    """expand(other.shape)."""
    return self.expand(other.shape)

  def view_as(self, other: Tensor) -> Tensor:
    """reshape(other.shape)."""
    return self.reshape(other.shape)

  def reshape_as(self, other: Tensor) -> Tensor:
    """reshape(other.shape)."""
    return self.reshape(other.shape)

  def roll(self, shifts: int | Sequence[int], dims: int | Sequence[int] | None = None) -> Tensor:
    """Elements shifted by `shifts` along `dims`, wrapping around (flattened and restored if dims is None), as
    torch.roll: two views joined with cat."""
    if dims is None: return self.flatten().roll(shifts, 0).reshape(self.shape)
    shift_list = [shifts] if isinstance(shifts, int) else list(shifts)
    dim_list = [dims] if isinstance(dims, int) else list(dims)
    if len(shift_list) != len(dim_list):
      raise ValueError(f"roll needs one shift per dim, got shifts {shifts} and dims {dims}")
    x = self
    for shift, dim in zip(shift_list, dim_list):
      axis = x._axis(dim)
      size = x.shape[axis]
      if size == 0 or shift % size == 0: continue
      split = size - shift % size  # the last (shift mod size) elements come first
      head, tail = x.split([split, size - split], axis)
      x = tail.cat(head, dim=axis)
    return x

  def diagonal(self, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Tensor:
    """The diagonal of dims `dim1` and `dim2` (above it for offset > 0) as the last dimension, as torch.diagonal;
    a view: a flattened stride of size + 1 over the square part."""
    axis1, axis2 = self._axis(dim1), self._axis(dim2)
    if axis1 == axis2: raise AxisError(f"diagonal needs two different dims, got {dim1} and {dim2}")
    rest = [a for a in range(self.ndim) if a not in (axis1, axis2)]
    x = self.permute(rest + [axis1, axis2])
    rows, cols = x.shape[-2], x.shape[-1]
    if offset >= 0: x = x.shrink([None] * (x.ndim - 1) + [(min(offset, cols), cols)])
    else: x = x.shrink([None] * (x.ndim - 2) + [(min(-offset, rows), rows), None])
    length = max(min(x.shape[-2], x.shape[-1]), 0)
    x = x.shrink([None] * (x.ndim - 2) + [(0, length), (0, length)])
    batch = x.shape[:-2]
    if length == 0: return x.reshape(batch + (0,))
    flat = x.reshape(batch + (length * length,)).pad([None] * len(batch) + [(0, length)])
    return flat.reshape(batch + (length, length + 1)).shrink([None] * len(batch) + [None, (0, 1)]).reshape(
      batch + (length,))

  def diag(self, diagonal: int = 0) -> Tensor:
    """For a 1-D tensor, the square matrix with it on the `diagonal`; for a 2-D one, that diagonal (torch.diag)."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    if self.ndim == 2: return self.diagonal(diagonal)
    if self.ndim != 1: raise ShapeError(f"diag takes a 1-D or 2-D tensor, got shape {self.shape}")
    size = self.shape[0] + abs(diagonal)
    rows = Tensor.arange(size, device=self.device).reshape(size, 1)
    cols = Tensor.arange(size, device=self.device).reshape(1, size)
    # the value on column c is self[c - diagonal] above the main diagonal and self[c] below it
    values = self.pad([(diagonal, 0) if diagonal >= 0 else (0, -diagonal)]).reshape(1, size)
    return (cols - rows == diagonal).where(values, 0).cast(self.dtype)

  def one_hot(self, num_classes: int = -1) -> Tensor:
    """An int64 tensor with a new last dimension of `num_classes` holding 1 at each value's class, as
    torch.nn.functional.one_hot; -1 reads the number of classes from the data (max + 1: a realize)."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    if self.dtype.is_float or self.dtype == dtypes.bool:
      raise DTypeError(f"one_hot needs an integer tensor of class indices, got {self.dtype}")
    if num_classes == -1: num_classes = int(self.max().item()) + 1 if self.numel() else 0
    classes = Tensor.arange(num_classes, device=self.device)
    return (self.unsqueeze(-1) == classes).cast(dtypes.int64)

  def _stride_axis(self, axis: int, step: int) -> Tensor:
    """Every `step`-th element along `axis`, starting at the first."""
    size = self.shape[axis]
    kept = math.ceil(size / step)
    padded = self.pad([(0, kept * step - size) if a == axis else None for a in range(self.ndim)])
    split = padded.reshape(self.shape[:axis] + (kept, step) + self.shape[axis + 1:])
    picked = split.shrink([(0, 1) if a == axis + 1 else None for a in range(split.ndim)])
    return picked.reshape(self.shape[:axis] + (kept,) + self.shape[axis + 1:])

  # ---------------------------------------------------------------- joining and splitting

  def cat(self: Tensor | Sequence[Tensor], *tensors: Tensor | int, dim: int = 0) -> Tensor:
    """Join tensors along `dim` (pad each into place and add: one fused kernel). Every spelling works:
    `Tensor.cat([a, b], dim)`, `Tensor.cat([a, b], dim=1)`, `Tensor.cat(a, b, dim=1)` and `a.cat(b, c, dim=1)`."""
    joined, dim = _joined_tensors("cat", self, tensors, dim)
    first = joined[0]
    axis = first._axis(dim)
    for tensor in joined[1:]:
      if tensor.ndim != first.ndim or any(a != axis and s != t for a, (s, t) in enumerate(zip(first.shape,
                                                                                            tensor.shape))):
        raise ShapeError(f"cat along dim {axis} needs equal other sizes, got {first.shape} and {tensor.shape}")
      if tensor.device != first.device:
        raise DeviceError(f"cat of tensors on {first.device} and {tensor.device}; move them with .to()")
    dtype = least_upper_dtype(*(tensor.dtype for tensor in joined))
    total = sum(tensor.shape[axis] for tensor in joined)
    result, offset = None, 0
    # floats pad with -0.0, which adds to any value exactly (+0.0 would turn a -0.0 into +0.0)
    pad_value = -0.0 if dtype.is_float else 0
    for tensor in joined:
      pads = [(offset, total - offset - tensor.shape[axis]) if a == axis else None for a in range(first.ndim)]
      piece = tensor.cast(dtype if dtype != dtypes.bool else dtypes.uint8).pad(pads, value=pad_value)
      result = piece if result is None else result + piece
      offset += tensor.shape[axis]
    assert result is not None
    return result.cast(dtype)

  def cat_with(self, *others: Tensor, dim: int = 0) -> Tensor:
    """Tensor.cat([self, *others], dim): this tensor joined with `others` along `dim`."""
    return self.cat(*others, dim=dim)

  def stack(self: Tensor | Sequence[Tensor], *tensors: Tensor | int, dim: int = 0) -> Tensor:
    """Tensors of one shape joined along a new dimension `dim`; spelled like cat: `Tensor.stack([a, b], dim)`,
    `Tensor.stack(a, b, dim=1)` or `a.stack(b, dim=1)`."""
    joined, dim = _joined_tensors("stack", self, tensors, dim)
    for tensor in joined[1:]:
      if tensor.shape != joined[0].shape:
        raise ShapeError(f"stack needs tensors of one shape, got {joined[0].shape} and {tensor.shape}")
    axis = normalize_axis(dim, joined[0].ndim + 1)
    return joined[0].unsqueeze(axis).cat(*[tensor.unsqueeze(axis) for tensor in joined[1:]], dim=axis)

  @staticmethod
  def meshgrid(*tensors: Tensor | Sequence[Tensor], indexing: str = "ij") -> tuple[Tensor, ...]:
    """Coordinate grids from 1-D (or 0-d) tensors, as torch.meshgrid: with indexing "ij" output k varies along dim
    k; with "xy" the first two dims are swapped (Cartesian, as numpy's default). Each output is an expanded view."""
    inputs = list(tensors[0]) if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)) else list(tensors)
    if indexing not in ("ij", "xy"): raise ValueError(f"meshgrid indexing must be 'ij' or 'xy', got {indexing!r}")
    if not inputs: raise ValueError("meshgrid needs at least one tensor")
    for tensor in inputs:
      if tensor.ndim > 1: raise ShapeError(f"meshgrid takes 0-d or 1-d tensors, got shape {tensor.shape}")
    flat = [tensor.reshape(-1) for tensor in inputs]
    swap = indexing == "xy" and len(flat) >= 2
    order = [1, 0, *range(2, len(flat))] if swap else list(range(len(flat)))
    shape = tuple(flat[k].shape[0] for k in order)
    grids = []
    for number, tensor in enumerate(flat):
      position = order.index(number)
      view = [-1 if axis == position else 1 for axis in range(len(flat))]
      grids.append(tensor.reshape(view).expand(shape))
    return tuple(grids)

  def split(self, split_size: int | Sequence[int], dim: int = 0) -> tuple[Tensor, ...]:
    """Views of consecutive pieces along `dim`: `split_size` long each (the last may be shorter), or one per size in a
    list that adds up to the dimension."""
    axis = self._axis(dim)
    size = self.shape[axis]
    if isinstance(split_size, int):
      if split_size <= 0: raise ValueError(f"split size must be positive, got {split_size}")
      sizes = [min(split_size, size - start) for start in range(0, size, split_size)] or [0]
    else:
      sizes = list(split_size)
      if sum(sizes) != size: raise ShapeError(f"split sizes {sizes} do not add up to dim {axis} of size {size}")
    pieces, start = [], 0
    for piece_size in sizes:
      pieces.append(self.shrink([(start, start + piece_size) if a == axis else None for a in range(self.ndim)]))
      start += piece_size
    return tuple(pieces)

  def chunk(self, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
    """`chunks` views of equal size along `dim` (the last may be smaller, and fewer come back from a short dimension),
    as torch.chunk."""
    if chunks <= 0: raise ValueError(f"chunk count must be positive, got {chunks}")
    size = self.shape[self._axis(dim)]
    return self.split(max(math.ceil(size / chunks), 1), dim)


def _joined_tensors(name: str, first: Any, rest: tuple[Any, ...], dim: int) -> tuple[list[Tensor], int]:
  """The tensors and the dim of a cat/stack call in any spelling: a sequence of tensors (then an optional positional
  dim), or tensors as separate arguments."""
  if isinstance(first, (list, tuple)):
    if len(rest) > 1 or (rest and not isinstance(rest[0], (int, np.integer))):
      raise TypeError(f"{name}(tensors, dim): after a sequence of tensors only the dim may follow, got {rest}")
    tensors, dim = list(first), int(rest[0]) if rest else dim
  else:
    tensors = [first, *rest]
  if not tensors: raise ValueError(f"{name} needs at least one tensor")
  for tensor in tensors:
    if not hasattr(tensor, "lazydata"):
      raise TypeError(f"{name} joins Tensors, got {type(tensor).__name__}; pass the dim as dim=")
  return tensors, dim


_NO_PADDING = ()   # _plain_pairs' answer when every pair is (0, 0)
_ZERO_PAIR = (0, 0)


def _plain_pairs(padding: Sequence[Any]) -> tuple[tuple[int, int], ...] | None:
  """`padding` as (before, after) pairs when each item is None or a pair of non-negative Python ints (_NO_PADDING
  when all are zero); None for any other form (flat ints, crops, numpy or symbolic amounts), which `pad` reads in
  full."""
  pairs, grows = [], False
  for pair in padding:
    if pair is None or pair == _ZERO_PAIR:   # (no padding: the general path treats a pair of zeros of any type so)
      pairs.append(_ZERO_PAIR)
      continue
    if type(pair) is not tuple and type(pair) is not list or len(pair) != 2: return None
    before, after = pair
    if type(before) is not int or type(after) is not int or before < 0 or after < 0: return None
    if before or after: grows = True
    pairs.append((before, after))
  return tuple(pairs) if grows else _NO_PADDING


def _constant_padded(x: Tensor, grow: tuple[tuple[Any, Any], ...], value: Scalar) -> Tensor:
  """x padded by the non-negative `grow` pairs with `value`."""
  padded = FM.Pad.apply(x, arg=grow)
  # -0.0 == 0 in Python, but a float tensor padded with -0.0 keeps that sign (cat relies on it)
  if value == 0 and not (x.dtype.is_float and math.copysign(1.0, value) < 0): return padded
  inside = FM.Pad.apply(type(x).ones(*x.shape, dtype=dtypes.bool, device=x.device), arg=grow)
  return inside.where(padded, value)


def _symbolic_pad_amount(amount: Any) -> Any:
  """A pad amount as given; a symbolic one must not be negative (for its bound value, or its whole range)."""
  if not is_symbolic(amount): return amount
  lowest = amount.min if amount.vars()[0].val is None else sym_infer(amount, {})
  if lowest < 0: raise ShapeError(f"pad by the symbolic amount {amount.render()} = {lowest}: it must not be negative")
  return amount


def _concrete_pairs(pairs: list, shape: tuple) -> list:
  """(pair, size) per dim, a symbolic pair or size read as 0-crop (it never crops)."""
  return [((0, 0), 0) if any(is_symbolic(v) for v in (*pair, size)) else (pair, size)
          for pair, size in zip(pairs, shape)]


@functools.lru_cache(maxsize=1 << 12)
def _expand_plan(shape: tuple[int, ...], new_shape: tuple[int, ...],
                 types: tuple[type, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(`shape` with leading 1s to the length of `new_shape`, the shape it expands to: -1 keeps a size), or ShapeError.
  Remembered per sizes and their `types` (a training step expands the same shapes every step; errors are raised
  again each time)."""
  if len(new_shape) < len(shape):
    raise ShapeError(f"cannot expand shape {shape} to {new_shape}: fewer dimensions")
  for size in new_shape:   # (before the trackers, whose remembered answers would take 4.0 for 4)
    if not isinstance(size, (int, np.integer)) and not is_symbolic(size):
      raise ShapeError(f"cannot expand shape {shape} to {new_shape}: sizes must be integers")
  padded = (1,) * (len(new_shape) - len(shape)) + shape
  # numpy ints (sizes read from an array's shape) as Python ints: the trackers take ints or symbolic sizes
  final = tuple(old if new == -1 else int(new) if isinstance(new, np.integer) else new
                for old, new in zip(padded, new_shape))
  for old, new in zip(padded, final):
    if old != new and old != 1: raise ShapeError(f"cannot expand shape {shape} to {new_shape}")
  return padded, final
