"""One strided, offset, optionally masked window onto a flat buffer.

A `View` maps per-dimension indices (i0, i1, ...) to the buffer element `offset + sum(i_k * strides[k])`; where
`mask` is set, only indices with `mask[k][0] <= i_k < mask[k][1]` in every dimension are valid (the others read
as 0, which is how padding is expressed). Movement ops (reshape, permute, expand, pad, shrink, flip) return new
Views and never touch data; `reshape` returns None when a single View cannot express the result.

Main types/functions: `View`, `strides_for_shape`, `merge_dims`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from ourgrad.errors import ShapeError
from ourgrad.helpers import prod
from ourgrad.shape.symbolic import Node, NumNode, is_symbolic, sym_and, sym_sum

Mask = tuple[tuple[int, int], ...]
# a size, stride, offset or mask bound: an int, or a Node for a symbolic shape (a bound Variable: docs/jit.md)
sint = int | Node


def _canonical_int(value: sint) -> sint:
  """ints and constant Nodes as int; other Nodes (symbolic sizes) as they are."""
  return value if is_symbolic(value) else int(value)


def _known_le(a: sint, b: sint) -> bool:
  """True when a <= b for every value of their variables (decided from the bounds of a - b)."""
  if not is_symbolic(a) and not is_symbolic(b): return int(a) <= int(b)
  difference = sym_sum([a, -b if isinstance(b, Node) else -int(b)])
  return difference.max <= 0


def strides_for_shape(shape: Sequence[sint]) -> tuple[sint, ...]:
  """Contiguous row-major strides for shape, with 0 for size-1 dims (a dim inside a symbolic one has a symbolic
  stride)."""
  strides: list[int] = []
  running = 1
  for size in reversed(shape):
    strides.append(0 if size == 1 else running)
    running *= size
  return tuple(reversed(strides))


def merge_dims(shape: Sequence[int], strides: Sequence[int],
               mask: Mask | None = None) -> tuple[tuple[int, int, int], ...]:
  """Group adjacent dims that index like one dim: returns (merged size, stride, real stride) per run.

  Two neighbours merge when outer_stride == inner_stride * inner_size (and, with a mask, the inner dim is fully
  valid). real_stride is the stride of the run's innermost non-zero-stride dim (0 for broadcast runs)."""
  runs: list[list[int]] = []
  for dim, (size, stride) in enumerate(zip(shape, strides)):
    if size == 1: continue
    inner_full = mask is None or mask[dim] == (0, size)
    if runs and inner_full and runs[-1][1] == stride * size:
      runs[-1][0] *= size
      runs[-1][1] = stride
      if stride != 0: runs[-1][2] = stride
    else:
      runs.append([size, stride, stride])
  return tuple((size, stride, real) for size, stride, real in runs)


def _merge_group(sizes: list[int], strides: list[int],
                 masks: list[tuple[int, int]]) -> tuple[int, int, int, int] | None:
  """Express several adjacent dims as one dim on their valid region.

  Returns (stride, mask start, mask end, offset correction) or None. Valid only if the valid box is one
  contiguous flat range: leading dims pinned to one index, then one partial dim, then fully valid dims. Pinned
  dims' strides do not matter (their index is constant on the valid region), the rest must nest exactly."""
  count = len(sizes)
  blocks = [prod(sizes[i + 1:]) for i in range(count)]
  first_free = next((i for i, (start, end) in enumerate(masks) if end - start != 1), count)
  if any(masks[i] != (0, sizes[i]) for i in range(first_free + 1, count)): return None
  stride = strides[-1] if first_free < count else 0
  if any(strides[i] != stride * blocks[i] for i in range(first_free, count)): return None
  flat_start = sum(masks[i][0] * blocks[i] for i in range(min(first_free + 1, count)))
  if first_free < count: flat_end = flat_start + (masks[first_free][1] - masks[first_free][0]) * blocks[first_free]
  else: flat_end = flat_start + 1  # every dim pinned: a single valid element
  correction = sum(masks[i][0] * (strides[i] - blocks[i] * stride) for i in range(first_free))
  return stride, flat_start, flat_end, correction


def _split_range(start: int, end: int, sizes: list[int]) -> list[tuple[int, int]] | None:
  """The flat range [start, end) of a dim split row-major into sizes, as a box of per-dim ranges, or None."""
  total = prod(sizes)
  if start == 0 and end == total: return [(0, size) for size in sizes]
  for dim, size in enumerate(sizes):
    inner = prod(sizes[dim + 1:])
    outer = size * inner
    if start % inner != 0 or end % inner != 0 or start // outer != (end - 1) // outer: continue
    # dims before `dim` are pinned to start's digits, `dim` takes a sub-range, dims after it are full
    digits = [(start // prod(sizes[i + 1:])) % sizes[i] for i in range(dim)]
    box = [(digit, digit + 1) for digit in digits]
    box.append(((start // inner) % size, ((end - 1) // inner) % size + 1))
    box.extend((0, inner_size) for inner_size in sizes[dim + 1:])
    return box
  return None


def _canonical_mask_dim(start: sint, end: sint, size: sint) -> tuple[sint, sint]:
  """A mask range clipped to [0, size] (symbolic bounds are kept where the clip cannot be decided)."""
  start, end = _canonical_int(start), _canonical_int(end)
  if _known_le(start, 0): start = 0
  if _known_le(size, end): end = size
  return start, end


@dataclass(frozen=True)
class View:
  """A strided window: shape, strides (elements), offset, optional validity mask; build with `View.create`."""
  shape: tuple[int, ...]
  strides: tuple[int, ...]
  offset: int
  mask: Mask | None
  contiguous: bool

  @staticmethod
  def create(shape: Sequence[int], strides: Sequence[int] | None = None, offset: int = 0,
             mask: Sequence[tuple[int, int]] | None = None) -> View:
    """Canonical View: size-1 dims get stride 0, an all-covering mask becomes None, a mask that is empty in any dim
    becomes the 'nothing valid' form (all dims (0, 0), strides 0, offset 0); strides=None means contiguous.
    Memoized: a View is a pure function of these arguments, and a training step builds the same views every step."""
    return _create_view(tuple(shape), None if strides is None else tuple(strides), offset,
                        None if mask is None else tuple(tuple(dim_mask) for dim_mask in mask))

  # hashed often (schedule-cache and kernel-cache keys hold views): the hash of the fields is computed once
  @functools.cached_property
  def _hash(self) -> int: return hash((self.shape, self.strides, self.offset, self.mask, self.contiguous))

  def __hash__(self) -> int: return self._hash

  def __getstate__(self) -> dict:
    # the cached hash stays behind: a Variable's name hashes differently in another process
    return {key: value for key, value in self.__dict__.items() if key != "_hash"}

  @functools.cached_property
  def symbolic(self) -> bool:
    """True when a size, stride, offset or mask bound holds a Variable."""
    values = (*self.shape, *self.strides, self.offset, *(bound for dim in (self.mask or ()) for bound in dim))
    return any(is_symbolic(value) for value in values)

  @staticmethod
  def _create(shape: Sequence[int], strides: Sequence[int] | None = None, offset: int = 0,
              mask: Sequence[tuple[int, int]] | None = None) -> View:
    shape = tuple(_canonical_int(size) for size in shape)
    if any(not is_symbolic(size) and size < 0 for size in shape):
      raise ShapeError(f"negative dimension in shape {shape}")
    strides = strides_for_shape(shape) if strides is None else tuple(_canonical_int(stride) for stride in strides)
    if len(strides) != len(shape): raise ShapeError(f"strides {strides} do not match shape {shape}")
    if 0 in shape: return View(shape, strides_for_shape(shape), 0, None, True)  # nothing to index
    strides = tuple(0 if size == 1 else stride for size, stride in zip(shape, strides))
    canonical_mask: Mask | None = None
    if mask is not None:
      canonical_mask = tuple(_canonical_mask_dim(start, end, size) for (start, end), size in zip(mask, shape))
      if any(not is_symbolic(start) and not is_symbolic(end) and start >= end for start, end in canonical_mask):
        return View(shape, (0,) * len(shape), 0, ((0, 0),) * len(shape), False)
      if all(start == 0 and end == size for (start, end), size in zip(canonical_mask, shape)): canonical_mask = None
    contiguous = offset == 0 and canonical_mask is None and strides == strides_for_shape(shape)
    return View(shape, strides, _canonical_int(offset), canonical_mask, contiguous)

  @property
  def size(self) -> int:
    return prod(self.shape)


  @property
  def never_valid(self) -> bool:
    """True when no element is valid (the canonical empty mask)."""
    return self.mask is not None and len(self.mask) > 0 and self.mask[0] == (0, 0)

  def _full_mask(self) -> Mask:
    return self.mask if self.mask is not None else tuple((0, size) for size in self.shape)

  # ---------------------------------------------------------------- movement

  def reshape(self, new_shape: Sequence[int]) -> View | None:
    """Same elements in a new shape, or None when a single View cannot express it (memoized, like create)."""
    return _reshape_view(self, tuple(new_shape))

  def _reshape(self, new_shape: tuple[int, ...]) -> View | None:
    new_shape = tuple(_canonical_int(size) for size in new_shape)
    if new_shape == self.shape: return self
    if any(is_symbolic(size) for size in self.shape + new_shape): return self._reshape_symbolic(new_shape)
    if prod(new_shape) != self.size:
      raise ShapeError(f"cannot reshape {self.shape} ({self.size} elements) to {new_shape} "
                       f"({prod(new_shape)} elements)")
    if self.size == 0 or self.contiguous: return View.create(new_shape)
    if self.never_valid:
      # a 0-d view has no dim to carry the empty mask, so it needs a second view
      return View.create(new_shape, mask=((0, 0),) * len(new_shape)) if new_shape else None
    old_dims = [(size, stride, dim_mask) for size, stride, dim_mask in zip(self.shape, self.strides, self._full_mask())
                if size != 1]
    new_sizes = [size for size in new_shape if size != 1]
    new_strides: list[int] = []
    new_masks: list[tuple[int, int]] = []
    offset = self.offset
    old_pos = new_pos = 0
    # walk both shapes, cutting them into the smallest groups whose element counts agree
    while old_pos < len(old_dims):
      old_end, new_end = old_pos + 1, new_pos + 1
      old_count, new_count = old_dims[old_pos][0], new_sizes[new_pos]
      while old_count != new_count:
        if old_count < new_count:
          old_count *= old_dims[old_end][0]
          old_end += 1
        else:
          new_count *= new_sizes[new_end]
          new_end += 1
      group = old_dims[old_pos:old_end]
      merged = _merge_group([d[0] for d in group], [d[1] for d in group], [d[2] for d in group])
      if merged is None: return None
      stride, flat_start, flat_end, correction = merged
      group_sizes = new_sizes[new_pos:new_end]
      box = _split_range(flat_start, flat_end, group_sizes)
      if box is None: return None
      new_strides.extend(stride * prod(group_sizes[i + 1:]) for i in range(len(group_sizes)))
      new_masks.extend(box)
      offset += correction
      old_pos, new_pos = old_end, new_end
    strides_iter, masks_iter = iter(new_strides), iter(new_masks)
    full_strides = [0 if size == 1 else next(strides_iter) for size in new_shape]
    full_mask = [(0, 1) if size == 1 else next(masks_iter) for size in new_shape]
    return View.create(new_shape, full_strides, offset, full_mask if self.mask is not None else None)

  def _reshape_symbolic(self, new_shape: tuple[sint, ...]) -> View | None:
    """Reshape with symbolic sizes: any reshape of a contiguous view, otherwise only adding or removing size-1
    dims (the other dims keep their strides and masks); None (a second view) for anything else."""
    if self.contiguous: return View.create(new_shape)
    if self.mask is None and all(stride == 0 for stride in self.strides):  # one element broadcast: any shape
      return View.create(new_shape, (0,) * len(new_shape), self.offset)
    if self.mask is None:
      merged = self._merge_runs(new_shape)
      if merged is not None: return merged
    if [size for size in self.shape if size != 1] != [size for size in new_shape if size != 1]: return None
    kept = iter([(stride, dim_mask) for size, stride, dim_mask in zip(self.shape, self.strides, self._full_mask())
                 if size != 1])
    strides, mask = [], []
    for size in new_shape:
      stride, dim_mask = next(kept) if size != 1 else (0, (0, 1))
      strides.append(stride)
      mask.append(dim_mask)
    return View.create(new_shape, strides, self.offset, mask if self.mask is not None else None)

  def _merge_runs(self, new_shape: tuple[sint, ...]) -> View | None:
    """An unmasked view reshaped so that each new dim is a run of neighbouring old dims whose strides nest
    (outer stride == inner stride * inner size, compared structurally), or None."""
    old = [(size, stride) for size, stride in zip(self.shape, self.strides) if size != 1]
    strides: list[sint] = []
    position = 0
    for size in new_shape:
      if size == 1:
        strides.append(0)
        continue
      if position >= len(old): return None
      run_size, run_stride = old[position]
      position += 1
      while run_size != size and position < len(old):
        inner_size, inner_stride = old[position]
        if run_stride != inner_stride * inner_size: return None
        run_size, run_stride = run_size * inner_size, inner_stride
        position += 1
      if run_size != size: return None
      strides.append(run_stride)
    return View.create(new_shape, strides, self.offset) if position == len(old) else None

  def permute(self, axes: Sequence[int]) -> View:
    """Reorder dims: output dim k is input dim axes[k]."""
    mask = tuple(self.mask[axis] for axis in axes) if self.mask is not None else None
    return View.create(tuple(self.shape[a] for a in axes), tuple(self.strides[a] for a in axes), self.offset, mask)

  def expand(self, new_shape: Sequence[int]) -> View:
    """Broadcast size-1 dims to new sizes (stride 0)."""
    new_shape = tuple(_canonical_int(size) for size in new_shape)
    if new_shape == self.shape: return self
    mask = None
    if self.mask is not None:
      mask = tuple(dim_mask if old == new else ((0, new) if dim_mask != (0, 0) else (0, 0))
                   for dim_mask, old, new in zip(self.mask, self.shape, new_shape))
    strides = tuple(stride if old == new else 0 for stride, old, new in zip(self.strides, self.shape, new_shape))
    return View.create(new_shape, strides, self.offset, mask)

  def pad(self, arg: Sequence[tuple[int, int]]) -> View:
    """Add (before, after) invalid elements around each dim."""
    if all(before == 0 and after == 0 for before, after in arg): return self
    new_shape = tuple(size + before + after for size, (before, after) in zip(self.shape, arg))
    mask = tuple((start + before, end + before) for (start, end), (before, _) in zip(self._full_mask(), arg))
    offset = self.offset - sum(before * stride for (before, _), stride in zip(arg, self.strides))
    return View.create(new_shape, self.strides, offset, mask)

  def shrink(self, arg: Sequence[tuple[int, int]]) -> View:
    """Keep the [start, end) window of each dim."""
    if all(start == 0 and end == size for (start, end), size in zip(arg, self.shape)): return self
    new_shape = tuple(end - start for start, end in arg)
    mask = None
    if self.mask is not None:
      mask = tuple(_canonical_mask_dim(mask_start - start, mask_end - start, end - start)
                   for (mask_start, mask_end), (start, end) in zip(self.mask, arg))
      if self.never_valid: mask = ((0, 0),) * len(new_shape)
    offset = self.offset + sum(start * stride for (start, _), stride in zip(arg, self.strides))
    return View.create(new_shape, self.strides, offset, mask)

  def flip(self, axes_mask: Sequence[bool]) -> View:
    """Reverse the dims where axes_mask is True."""
    if not any(axes_mask): return self
    offset = self.offset + sum((size - 1) * stride for size, stride, flip in zip(self.shape, self.strides, axes_mask)
                               if flip)
    strides = tuple(-stride if flip else stride for stride, flip in zip(self.strides, axes_mask))
    mask = None
    if self.mask is not None:
      mask = tuple((size - end, size - start) if flip else (start, end)
                   for (start, end), size, flip in zip(self.mask, self.shape, axes_mask))
    return View.create(self.shape, strides, offset, mask)

  # ---------------------------------------------------------------- index expressions

  def expr_idxs(self, idxs: Sequence[Node]) -> Node:
    """Element index into the viewed buffer for per-dim index nodes."""
    terms: list[Node | int] = [self.offset]
    terms.extend(idx * stride for idx, size, stride in zip(idxs, self.shape, self.strides) if stride != 0 and size != 1)
    return sym_sum(terms)

  def expr_valid(self, idxs: Sequence[Node]) -> Node:
    """Boolean node: 1 where the indices are inside the mask (NumNode(1) without a mask)."""
    if self.mask is None: return NumNode(1)
    if self.never_valid: return NumNode(0)
    conditions: list[Node] = []
    for idx, (start, end), size in zip(idxs, self.mask, self.shape):
      if not _known_le(start, 0): conditions.append(idx.ge(start))
      if not _known_le(size, end): conditions.append(idx.lt(end))
    return sym_and(conditions)


# bounded: long runs with ever new shapes must not keep every view (errors are not cached: they raise again)
_create_view = functools.lru_cache(maxsize=1 << 16)(View._create)
_reshape_view = functools.lru_cache(maxsize=1 << 16)(View._reshape)
