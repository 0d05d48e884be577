"""Views and the writes through them: the storage versions of a base, placing a write through a view, and whether
a view reads its base in place.

A LazyBuffer (lazy.py) is a value and never changes; an in-place write makes the next version of the written base,
the head of the `Storage` all versions of that base share (LazyBuffer.write, docs/reliability.md). A write through a
view (`x[1:3] = y`, a transposed slice) lands in the base's memory at the places the view reads: `place_through_view`
moves the written values there (a base-shaped value and a mask). The fused attention ops read q, k and v in place
where they tile one base (`tiles_one_base`). Everything here only reads LazyBuffer's attributes and calls its methods:
this module does not import lazy.py (lazy.py imports it).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ourgrad.dtype import dtypes
from ourgrad.errors import ShapeError
from ourgrad.helpers import prod
from ourgrad.ops import CONST
from ourgrad.shape.symbolic import is_symbolic

if TYPE_CHECKING:
  from ourgrad.lazy import LazyBuffer
  from ourgrad.shape.shapetracker import ShapeTracker


class Storage:
  """The memory that successive versions of a base stand for, as a PyTorch storage: `head` is its newest version (a
  base of `shape`), None for a constant not written yet. Every version links here, not to the next one,
  so versions no tensor holds are freed however many writes follow."""
  __slots__ = ("shape", "head", "__weakref__")
  # new versions made so far, by every storage: a value that was current when this count was n is still current
  # while it is n (the only way a buffer goes stale is `become`); the backward walk skips its saved-value checks so
  versions_made = 0

  def __init__(self, shape: tuple[int, ...]):
    self.shape, self.head = shape, None

  def become(self, version: LazyBuffer) -> None:
    """Make `version` (a base) the newest."""
    version._storage, self.head = self, version
    Storage.versions_made += 1

  @staticmethod
  def of_constant(lazy: LazyBuffer) -> LazyBuffer:
    """`lazy` (a fresh LazyBuffer.full) marked as the whole of a new storage, written to on first use."""
    lazy._const = (Storage(lazy.shape), None)
    return lazy


def place_through_view(value: LazyBuffer, st: ShapeTracker,
                       base_shape: tuple[int, ...]) -> tuple[LazyBuffer, LazyBuffer] | None:
  """(value placed where `st` reads the base from, as a base-shaped view with zeros elsewhere; the bool mask of
  those places) for a write through the view `st`; None when the view has no elements. The view must be one strided
  lattice of the base (slices with steps, transposes, reshapes, squeezes, flips: what indexing makes); an expanded
  view (several elements on one memory place), a padded one or a reshape of a transposed slice raises ShapeError."""
  if 0 in st.shape: return None
  simple = st.simplify()
  view = simple.views[-1]
  if len(simple.views) != 1 or view.mask is not None or any(is_symbolic(x) for x in (*view.shape, *view.strides)):
    raise ShapeError(f"cannot write through this view of shape {st.shape} (padded, or a reshape of a non-contiguous "
                     f"view): write into the base tensor, or into a .contiguous() copy")
  if any(stride == 0 and size > 1 for size, stride in zip(view.shape, view.strides)):
    raise ShapeError(f"cannot write through an expanded view of shape {st.shape}: more than one element of it refers "
                     f"to a single memory location (as in PyTorch); write into the tensor it was expanded from")
  axes = [axis for axis, size in enumerate(view.shape) if size != 1]
  offset = view.offset + sum((view.shape[axis] - 1) * view.strides[axis] for axis in axes if view.strides[axis] < 0)
  flipped = tuple(view.strides[axis] < 0 for axis in axes)
  axes.sort(key=lambda axis: -abs(view.strides[axis]))   # outermost (largest stride) first
  sizes = [view.shape[axis] for axis in axes]
  strides = [abs(view.strides[axis]) for axis in axes]
  extent = 1   # the places the axes from here inward span
  for position in range(len(axes) - 1, -1, -1):
    if position < len(axes) - 1 and strides[position] < extent:
      raise ShapeError(f"cannot write through this view of shape {st.shape}: its elements interleave in memory")
    extent += (sizes[position] - 1) * strides[position]
  kept = [axis for axis, length in enumerate(view.shape) if length != 1]   # the axes in the view's order
  order = tuple(kept.index(axis) for axis in axes)

  def place(lazy: LazyBuffer) -> LazyBuffer:
    """`lazy` (the view's shape) moved to where the view reads: squeezed, flipped and permuted to positive strides
    from the outermost in, then each axis spread `stride` places apart (padding between), then shifted by the
    offset into the base's flat memory."""
    flat = lazy.reshape(tuple(view.shape[axis] for axis in kept)).flip(flipped).permute(order)
    flat, block = flat.reshape((*sizes, 1)), 1
    for position in range(len(axes) - 1, -1, -1):
      flat = _fit_last(flat, strides[position], block)
      block = sizes[position] * strides[position]
      flat = flat.reshape((*sizes[:position], block))
    flat = _fit_last(flat.reshape((block,)).pad(((offset, 0),)), prod(base_shape), offset + block)
    return flat.reshape(base_shape)
  inside = type(value).full(True, st.shape, dtypes.bool, value.device)   # (LazyBuffer.full: lazy.py is not imported)
  return place(value), place(inside)


def _fit_last(lazy: LazyBuffer, length: int, current: int) -> LazyBuffer:
  """`lazy` with its last axis (of `current` places) padded or cut to `length` (what is cut is padding)."""
  if current < length: return lazy.pad(((0, 0),) * (len(lazy.shape) - 1) + ((0, length - current),))
  if current > length: return lazy.shrink(tuple((0, size) for size in lazy.shape[:-1]) + ((0, length),))
  return lazy


def tiles_one_base(q: LazyBuffer, k: LazyBuffer, v: LazyBuffer) -> bool:
  """Whether attention operands q (B, H, L, D), k and v (B, Hk, L, D) are in-place views of one base that together
  hold each of its elements once: the same strides, k's heads right after q's and v's after k's (offsets 0,
  H * head stride, (H + Hk) * head stride), and the (B, H + 2 Hk, L, D) view they form a permutation of a contiguous
  layout of the whole base. A fused projection's output split into q, k and v ((B, T, 3, H, D) as GPT-2's c_attn,
  or (B, 3, H, T, D)) is such a base: the gradients of q, k, v stored through the same views are its gradient."""
  operands = (q, k, v)
  if not all(reads_in_place_by_rows(x) for x in operands) or not q.base is k.base is v.base: return False
  if q.shape[2] != k.shape[2] or k.shape != v.shape: return False
  views = [x.st.views[0] for x in operands]
  (batch, heads, length, head_dim), kv_heads = q.shape, k.shape[1]
  head_stride = views[0].strides[1]
  if any(view.strides != views[0].strides for view in views): return False
  if tuple(view.offset for view in views) != (0, heads * head_stride, (heads + kv_heads) * head_stride): return False
  sizes = (batch, heads + 2 * kv_heads, length, head_dim)
  covered = 1   # the dims by stride, each must start where the smaller ones end
  for size, stride in sorted(((size, stride) for size, stride in zip(sizes, views[0].strides) if size > 1),
                             key=lambda pair: pair[1]):
    if stride != covered: return False
    covered *= size
  return covered == q.base.size


def reads_in_place_by_rows(operand: LazyBuffer) -> bool:
  """`reads_in_place`, the last dim contiguous and the first element 16-byte aligned (the attention backward
  kernels copy rows with 16-byte cp.async where the strides allow)."""
  if not reads_in_place(operand): return False
  view = operand.st.views[0]
  return view.strides[-1] == 1 and view.offset % (16 // operand.dtype.itemsize) == 0


def reads_in_place(operand: LazyBuffer) -> bool:
  """Whether a kernel can read `operand` through its view as it is: one unmasked View over a base that gets a buffer
  of its own (not a constant, which has none)."""
  views = operand.st.views
  return len(views) == 1 and views[0].mask is None and operand.base.op is not CONST and not operand.st.symbolic
