"""ShapeTracker: the full record of movement ops applied to a buffer, as a stack of Views.

`views[0]` indexes the real buffer; each later view indexes a *virtual contiguous buffer* shaped like the
previous view. Evaluation runs from the last view backwards: the last view turns output indices into a flat
offset, which is unraveled row-major into the previous view's indices, and so on. Validity is the AND of every
view's mask test. Movement ops edit only the last view, and push a new view only when one cannot express the
result (e.g. reshaping a transposed view). `simplify` folds views back together whenever that is exact.

Main type: `ShapeTracker`.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

from ourgrad.errors import AxisError, ShapeError
from ourgrad.helpers import prod
from ourgrad.shape.symbolic import (AndNode, LtNode, MulNode, Node, NumNode, SumNode, Variable, bound_vars,
                                    is_symbolic, sym_and, sym_max)
from ourgrad.shape.view import View, sint


def index_variable(name: str, size: sint) -> Node:
  """The loop index of a dim: Variable(name, 0, size-1), NumNode(0) when the dim has one (or no) element. A
  symbolic size gives a Variable over its largest range."""
  upper = sym_max(size)
  return Variable(name, 0, upper - 1) if upper > 1 else NumNode(0)


def _concrete(value: sint) -> int | None:
  """The value of an int, or of a Node whose Variables are all bound; None for an unbound symbolic value."""
  if not is_symbolic(value): return int(value)
  try:
    return value.evaluate({})
  except KeyError:
    return None


def _unravel(shape: tuple[int, ...], flat: Node) -> list[Node]:
  """Row-major indices into shape of a flat index node (outermost dim without a mod: flat is in range)."""
  if 0 in shape: return [NumNode(0)] * len(shape)  # no elements: any index will do
  indices: list[Node] = []
  block = 1
  for dim in range(len(shape) - 1, -1, -1):
    size = shape[dim]
    if size == 1: indices.append(NumNode(0))
    else:
      digit = flat // block
      indices.append(digit if dim == 0 else digit % size)
    block *= size
  indices.reverse()
  return indices


def _linear_coefficients(node: Node) -> tuple[dict[str, int], int] | None:
  """node as ({variable name: coefficient}, constant) when it is exactly linear in Variables, else None."""
  coefficients: dict[str, int] = {}
  constant = 0
  for term in (node.nodes if isinstance(node, SumNode) else (node,)):
    if isinstance(term, NumNode): constant += term.b
    elif isinstance(term, Variable): coefficients[term.expr] = coefficients.get(term.expr, 0) + 1
    elif isinstance(term, MulNode) and isinstance(term.a, Variable):
      coefficients[term.a.expr] = coefficients.get(term.a.expr, 0) + term.b
    else: return None
  return coefficients, constant


def _variable_bounds(valid: Node) -> dict[str, tuple[float, float]] | None:
  """A validity node that is an AND of single-variable bounds, as {name: (low, high)} meaning low <= v < high.

  Returns None when the node has any other shape; {"": (0, 0)} when it is constant 0 (never valid)."""
  bounds: dict[str, tuple[float, float]] = {}
  for condition in (valid.nodes if isinstance(valid, AndNode) else (valid,)):
    if isinstance(condition, NumNode):
      if condition.b == 0: return {"": (0, 0)}
      continue
    if not isinstance(condition, LtNode) or not isinstance(condition.b, int): return None
    low, high = bounds.get(_condition_var(condition) or "", (-math.inf, math.inf))
    if isinstance(condition.a, Variable): high = min(high, condition.b)  # v < b
    elif isinstance(condition.a, MulNode) and isinstance(condition.a.a, Variable) and condition.a.b == -1:
      low = max(low, 1 - condition.b)  # -v < b  <=>  v >= 1 - b
    else: return None
    bounds[_condition_var(condition) or ""] = (low, high)
  return bounds


def _condition_var(condition: LtNode) -> str | None:
  if isinstance(condition.a, Variable): return condition.a.expr
  if isinstance(condition.a, MulNode) and isinstance(condition.a.a, Variable): return condition.a.a.expr
  return None


# Views are immutable and merging is a pure function of them; training steps build the same graphs every step, so
# the (symbolic, relatively slow) merge is computed once per pair of views.
@functools.lru_cache(maxsize=1 << 14)
def _merge_views(first: View, second: View) -> View | None:
  """One View equivalent to `second` applied to the contiguous output of `first`, or None."""
  if second.size == 0: return View.create(second.shape)
  if second.never_valid: return second if second.shape else None
  if first.contiguous: return second  # first is the identity on its buffer
  if second.contiguous and second.size == first.size:  # a contiguous view can also be a prefix (shrink from 0)
    reshaped = first.reshape(second.shape)
    if reshaped is not None: return reshaped
  if first.mask is None and all(stride == 0 for stride in first.strides):
    # first reads one element everywhere (a broadcast constant): so does the composition, under second's mask
    return View.create(second.shape, (0,) * len(second.shape), first.offset, second.mask)
  expanded = _expand_of(first, second)
  if expanded is not None: return expanded
  if any(is_symbolic(size) for size in first.shape + second.shape + second.strides + first.strides): return None
  # general case: compute the composed index symbolically on second's valid region (variables restricted to its
  # mask; outside it the element is invalid anyway) and accept it only if it is linear with box-shaped validity
  dim_ranges = second.mask if second.mask is not None else tuple((0, size) for size in second.shape)
  names = [f"_v{dim}" for dim in range(len(second.shape))]
  idxs: list[Node] = [Variable(name, start, end - 1) if size != 1 else NumNode(0)
                      for name, (start, end), size in zip(names, dim_ranges, second.shape)]
  digits = _unravel(first.shape, second.expr_idxs(idxs))
  linear = _linear_coefficients(first.expr_idxs(digits))
  bounds = _variable_bounds(first.expr_valid(digits))
  if linear is None or bounds is None: return None
  if "" in bounds:
    return View.create(second.shape, mask=((0, 0),) * len(second.shape)) if second.shape else None
  coefficients, offset = linear
  strides = [coefficients.get(name, 0) for name in names]
  mask = None
  if second.mask is not None or bounds:
    mask = []
    for name, (start, end) in zip(names, dim_ranges):
      low, high = bounds.get(name, (start, end))
      mask.append((max(start, int(max(low, start))), min(end, int(min(high, end)))))
  merged = View.create(second.shape, strides, offset, mask)
  if merged.never_valid and not second.shape: return None
  return merged


def _expand_of(first: View, second: View) -> View | None:
  """`second` as one view when it walks the contiguous output of `first` dim by dim (size-1 dims added, dropped or
  broadcast; no mask, no offset): each walked dim takes first's stride, so no index arithmetic is needed (which
  also holds for symbolic sizes)."""
  if second.mask is not None or second.offset != 0 or first.never_valid: return None
  # a size-1 dim of first that is masked off cannot be dropped or broadcast
  if first.mask is not None and any(size == 1 and dim_mask != (0, 1)
                                    for size, dim_mask in zip(first.shape, first.mask)): return None
  contiguous = View.create(first.shape).strides
  walked = [dim for dim, size in enumerate(first.shape) if size != 1]
  strides: list = []
  mask: list = []
  position = 0
  for size, stride in zip(second.shape, second.strides):
    if stride == 0:  # a broadcast or size-1 dim of second
      strides.append(0)
      mask.append((0, size))
      continue
    if position >= len(walked): return None
    dim = walked[position]
    if first.shape[dim] != size or contiguous[dim] != stride: return None
    strides.append(first.strides[dim])
    mask.append(first.mask[dim] if first.mask is not None else (0, size))
    position += 1
  if position != len(walked): return None
  return View.create(second.shape, strides, first.offset, mask if first.mask is not None else None)


@dataclass(frozen=True)
class ShapeTracker:
  """A stack of Views describing how output indices map to a buffer; see the module docstring."""
  views: tuple[View, ...]

  # hashed by every schedule-cache key and kernel AST; the movement ops and from_shape hand out interned trackers
  # (remembered, bounded), so a training step hashes the same objects every step: the hash is computed once
  @functools.cached_property
  def _hash(self) -> int: return hash(self.views)

  def __hash__(self) -> int: return self._hash

  def __getstate__(self) -> dict:
    # the cached hash and strides stay behind: a Variable's name hashes differently in another process (as View's)
    return {key: value for key, value in self.__dict__.items() if key not in ("_hash", "_real_strides", "_moves")}

  @staticmethod
  def from_shape(shape: Sequence[int]) -> ShapeTracker:
    """The identity tracker of a contiguous buffer of this shape."""
    return _identity_tracker(shape if type(shape) is tuple else tuple(shape))   # (every new lazy base asks)

  # shape and contiguous are asked of the same (interned) trackers at every op built: plain attributes after the first
  @functools.cached_property
  def shape(self) -> tuple[int, ...]: return self.views[-1].shape

  @property
  def size(self) -> int: return prod(self.shape)

  @property
  def ndim(self) -> int: return len(self.shape)

  @functools.cached_property
  def contiguous(self) -> bool:
    """True when the tracker is the identity on its buffer (one contiguous view)."""
    return len(self.views) == 1 and self.views[0].contiguous

  def _with_last(self, view: View) -> ShapeTracker:
    return ShapeTracker(self.views[:-1] + (view,))

  # ---------------------------------------------------------------- movement ops

  # reshape, permute, expand, pad and shrink are pure functions of (the views, the argument), and a training step
  # makes the same ones every step: each is remembered (bounded), like the views themselves (view.py). The three that
  # every broadcast and matmul makes are also remembered on the tracker itself (`_moves`, keyed by the argument): a
  # dict read, where the shared cache hashes the tracker through a Python __hash__ call
  @functools.cached_property
  def _moves(self) -> dict[tuple, ShapeTracker]: return {}

  def _remember(self, key: tuple, moved: ShapeTracker) -> ShapeTracker:
    moves = self._moves
    if len(moves) >= _MOVES_PER_TRACKER: moves.clear()   # (bounded: a tracker moved ever new ways starts over)
    moves[key] = moved
    return moved

  def reshape(self, new_shape: Sequence[int]) -> ShapeTracker:
    """Same elements in a new shape (same element count); pushes a second view when one cannot express it."""
    key = (_RESHAPE, new_shape if type(new_shape) is tuple else tuple(new_shape))
    moved = self._moves.get(key)
    return moved if moved is not None else self._remember(key, _reshape_tracker(self, key[1]))

  def permute(self, axes: Sequence[int]) -> ShapeTracker:
    """Reorder dims: output dim k is input dim axes[k]."""
    key = (_PERMUTE, axes if type(axes) is tuple else tuple(axes))
    moved = self._moves.get(key)
    return moved if moved is not None else self._remember(key, _permute_tracker(self, key[1]))

  def expand(self, new_shape: Sequence[int]) -> ShapeTracker:
    """Broadcast size-1 dims to new sizes."""
    key = (_EXPAND, new_shape if type(new_shape) is tuple else tuple(new_shape))
    moved = self._moves.get(key)
    return moved if moved is not None else self._remember(key, _expand_tracker(self, key[1]))

  def _reshape(self, new_shape: tuple[sint, ...]) -> ShapeTracker:
    if any(not isinstance(size, (int, Node)) or (not is_symbolic(size) and size < 0) for size in new_shape):
      raise ShapeError(f"cannot reshape {self.shape} to {new_shape}: sizes must be non-negative ints or Variables")
    if prod(new_shape) != self.size:
      raise ShapeError(f"cannot reshape {self.shape} ({self.size} elements) to {new_shape} "
                       f"({prod(new_shape)} elements): element counts differ")
    reshaped = self.views[-1].reshape(new_shape)
    if reshaped is not None: return self._with_last(reshaped)
    return ShapeTracker(self.views + (View.create(new_shape),))

  def _permute(self, axes: tuple[int, ...]) -> ShapeTracker:
    if sorted(axes) != list(range(self.ndim)):
      raise AxisError(f"permute axes {axes} are not a permutation of range({self.ndim}) for shape {self.shape}")
    return self._with_last(self.views[-1].permute(axes))

  def _expand(self, new_shape: tuple[sint, ...]) -> ShapeTracker:
    if len(new_shape) != self.ndim or any(old != new and old != 1 for old, new in zip(self.shape, new_shape)) \
        or any(not isinstance(size, (int, Node)) or (not is_symbolic(size) and size < 0) for size in new_shape):
      raise ShapeError(f"cannot expand {self.shape} to {new_shape}: only size-1 dims can change")
    return self._with_last(self.views[-1].expand(new_shape))

  def pad(self, arg: Sequence[tuple[int, int]]) -> ShapeTracker:
    """Add (before, after) zero-reading elements around each dim."""
    return _pad_tracker(self, tuple(tuple(pads) for pads in arg))

  def _pad(self, arg: tuple[tuple[sint, sint], ...]) -> ShapeTracker:
    arg = tuple((_as_sint(before), _as_sint(after)) for before, after in arg)
    if len(arg) != self.ndim or any(_known_negative(before) or _known_negative(after) for before, after in arg):
      raise ShapeError(f"bad pad {arg} for shape {self.shape}: need one non-negative (before, after) per dim")
    return self._with_last(self.views[-1].pad(arg))

  def shrink(self, arg: Sequence[tuple[int, int]]) -> ShapeTracker:
    """Keep the [start, end) window of each dim."""
    return _shrink_tracker(self, tuple(tuple(window) for window in arg))

  def _shrink(self, arg: tuple[tuple[sint, sint], ...]) -> ShapeTracker:
    arg = tuple((_as_sint(start), _as_sint(end)) for start, end in arg)
    if len(arg) != self.ndim or any(not valid_window(start, end, size) for (start, end), size in zip(arg, self.shape)):
      raise ShapeError(f"bad shrink {arg} for shape {self.shape}: need 0 <= start <= end <= size per dim")
    return self._with_last(self.views[-1].shrink(arg))

  def flip(self, axes_mask: Sequence[bool]) -> ShapeTracker:
    """Reverse the dims where axes_mask is True."""
    axes_mask = tuple(bool(flag) for flag in axes_mask)
    if len(axes_mask) != self.ndim:
      raise ShapeError(f"flip mask {axes_mask} needs one entry per dim of shape {self.shape}")
    return self._with_last(self.views[-1].flip(axes_mask))

  def __add__(self, other: ShapeTracker) -> ShapeTracker:
    """Composition: `other` views the contiguous output of `self`."""
    # the common case in fused graphs: `other` is the identity on self's output
    if len(other.views) == 1 and other.views[0].contiguous and other.shape == self.shape: return self
    return ShapeTracker(self.views + other.views).simplify()

  def simplify(self) -> ShapeTracker:
    """Merge the last two views into one while that is exactly equivalent."""
    if len(self.views) == 1: return self
    views = self.views
    while len(views) >= 2:
      merged = _merge_views(views[-2], views[-1])
      if merged is None: break
      views = views[:-2] + (merged,)
    return ShapeTracker(views)

  # ---------------------------------------------------------------- index expressions

  def default_idxs(self) -> list[Node]:
    """One index node per output dim: Variable(f"idx{i}", 0, size-1), NumNode(0) for size-1 (or 0) dims."""
    return [index_variable(f"idx{dim}", size) for dim, size in enumerate(self.shape)]

  def expr_idxs(self, idxs: Sequence[Node] | None = None) -> tuple[Node, Node]:
    """(index into views[0]'s buffer, validity) for per-dim output index nodes."""
    idxs = self.default_idxs() if idxs is None else list(idxs)
    if len(idxs) != self.ndim: raise ShapeError(f"{len(idxs)} index nodes for shape {self.shape}")
    last = self.views[-1]
    index, valid = last.expr_idxs(idxs), last.expr_valid(idxs)
    for view in reversed(self.views[:-1]):
      digits = _unravel(view.shape, index)
      valid = sym_and([valid, view.expr_valid(digits)])
      index = view.expr_idxs(digits)
    return index, valid

  def expr_node(self, idx: Node | None = None) -> tuple[Node, Node]:
    """(index, validity) from one flat row-major output index node (default Variable("idx", 0, size-1))."""
    if idx is None: idx = index_variable("idx", self.size)
    return self.expr_idxs(_unravel(self.shape, idx))

  # ---------------------------------------------------------------- analysis

  def real_strides(self) -> tuple[int | None, ...]:
    """Per output dim, the stride in the real buffer when the index is exactly dim_idx*stride + (terms without
    dim_idx), else None (None is always safe)."""
    return self._real_strides

  # a pure function of the (immutable, interned) views, asked of the same trackers at every eager step (the CPU's
  # packing decisions while the graph is built): the symbolic walk over several views runs once per tracker
  @functools.cached_property
  def _real_strides(self) -> tuple[int | None, ...]:
    if len(self.views) == 1: return tuple(0 if size == 1 else stride for size, stride in zip(self.shape, self.strides))
    idxs = self.default_idxs()
    index, _ = self.expr_idxs(idxs)
    terms = index.nodes if isinstance(index, SumNode) else (index,)
    strides: list[int | None] = []
    for idx in idxs:
      if not isinstance(idx, Variable):
        strides.append(0)
        continue
      uses = [term for term in terms if idx in term.vars()]
      if not uses: strides.append(0)
      elif len(uses) == 1 and uses[0] == idx: strides.append(1)
      elif len(uses) == 1 and isinstance(uses[0], MulNode) and uses[0].a == idx: strides.append(uses[0].b)
      else: strides.append(None)
    return tuple(strides)

  @property
  def strides(self) -> tuple[int, ...]:
    """Strides of the last view (meaningful on the real buffer only when there is one view)."""
    return self.views[-1].strides

  def unit_stride_axes(self) -> list[int]:
    """Output dims whose real stride is 1."""
    return [dim for dim, stride in enumerate(self.real_strides()) if stride == 1]

  def real_size(self) -> int:
    """An upper bound of (largest buffer index touched by a valid element) + 1; 0 when nothing is valid."""
    if self.size == 0: return 0
    if self.symbolic: return self.unbind()[0]._real_size_at_max()
    last = self.views[-1]
    if last.never_valid: return 0
    # restrict the index variables to the last view's mask: elements outside it never touch the buffer
    ranges = last.mask if last.mask is not None else tuple((0, size) for size in self.shape)
    idxs = [Variable(f"idx{dim}", start, end - 1) if end - start > 1 else NumNode(start)
            for dim, (start, end) in enumerate(ranges)]
    index, valid = self.expr_idxs(idxs)
    if isinstance(valid, NumNode) and valid.b == 0: return 0
    return max(index.max + 1, 0)

  # ---------------------------------------------------------------- symbolic shapes

  @functools.cached_property
  def symbolic(self) -> bool:
    """True when a size, stride, offset or mask bound holds a Variable (computed once: the engine asks per kernel
    launch)."""
    return any(view.symbolic for view in self.views)

  def var_vals(self) -> dict[str, int]:
    """{name: value} of the bound Variables in the views."""
    return bound_vars(_view_values(self))

  def unbind(self) -> tuple[ShapeTracker, dict[str, int]]:
    """(the same tracker with every bound Variable replaced by the unbound one, {name: value})."""
    values = self.var_vals()
    if not values: return self, values
    mapping = {var: var.unbind()[0] for value in _view_values(self) if is_symbolic(value)
               for var in value.vars() if var.val is not None}
    return ShapeTracker(tuple(_substitute_view(view, mapping) for view in self.views)), values

  def _real_size_at_max(self) -> int:
    """real_size with every symbolic value taken at its largest (for an unbound tracker): an allocation bound."""
    values = {var.expr: var.max for value in _view_values(self) if is_symbolic(value) for var in value.vars()}
    concrete = ShapeTracker(tuple(_substitute_view(view, {Variable(name, *_range_of(self, name)): NumNode(top)
                                                          for name, top in values.items()}) for view in self.views))
    return concrete.real_size()

  def axis_is_masked(self, axis: int) -> bool:
    """Whether the validity expression depends on output dim `axis`."""
    if not -self.ndim <= axis < self.ndim: raise AxisError(f"axis {axis} out of range for shape {self.shape}")
    axis %= self.ndim
    idxs = self.default_idxs()
    _, valid = self.expr_idxs(idxs)
    return isinstance(idxs[axis], Variable) and idxs[axis] in valid.vars()


def _as_sint(value: sint) -> sint:
  return value if is_symbolic(value) else int(value)


def _known_negative(value: sint) -> bool:
  return value.max < 0 if is_symbolic(value) else value < 0


def valid_window(start: sint, end: sint, size: sint) -> bool:
  """0 <= start <= end <= size, checked with the bound values where the window is symbolic (unbound: its ranges)."""
  if type(start) is int and type(end) is int and type(size) is int: return 0 <= start <= end <= size
  values = [_concrete(value) for value in (start, end, size)]
  if all(value is not None for value in values): return 0 <= values[0] <= values[1] <= values[2]  # type: ignore
  lows = [value.min if is_symbolic(value) else value for value in (start, end, size)]
  highs = [sym_max(value) for value in (start, end, size)]
  return lows[0] >= 0 and highs[0] <= highs[1] and lows[1] <= highs[2]


def _view_values(st: ShapeTracker) -> list[sint]:
  """Every size, stride, offset and mask bound of the tracker's views."""
  values: list[sint] = []
  for view in st.views:
    values.extend(view.shape)
    values.extend(view.strides)
    values.append(view.offset)
    if view.mask is not None: values.extend(bound for dim_mask in view.mask for bound in dim_mask)
  return values


def _range_of(st: ShapeTracker, name: str) -> tuple[int, int]:
  for value in _view_values(st):
    if is_symbolic(value):
      for var in value.vars():
        if var.expr == name: return var.min, var.max
  raise KeyError(name)


def _substitute_view(view: View, mapping: dict[Variable, Node]) -> View:
  def sub(value: sint) -> sint:
    if not is_symbolic(value): return value
    result = value.substitute(mapping)
    return result.b if isinstance(result, NumNode) else result
  mask = tuple((sub(start), sub(end)) for start, end in view.mask) if view.mask is not None else None
  return View.create(tuple(sub(size) for size in view.shape), tuple(sub(stride) for stride in view.strides),
                     sub(view.offset), mask)


# shape -> the identity tracker of that shape, one instance per shape: every new lazy base asks (LazyBuffer.create_base
# reads the dict itself). A plain dict read costs a fraction of an lru_cache call; bounded by clearing when full
IDENTITY_TRACKERS: dict[tuple[sint, ...], ShapeTracker] = {}
_IDENTITY_TRACKERS_MAX = 1 << 14


def _identity_tracker(shape: tuple[sint, ...]) -> ShapeTracker:
  tracker = IDENTITY_TRACKERS.get(shape)
  if tracker is None:
    tracker = ShapeTracker((View.create(shape),))
    if len(IDENTITY_TRACKERS) >= _IDENTITY_TRACKERS_MAX: IDENTITY_TRACKERS.clear()
    IDENTITY_TRACKERS[shape] = tracker
  return tracker


# the keys of ShapeTracker._moves (with the argument) and its bound per tracker
_RESHAPE, _PERMUTE, _EXPAND = "reshape", "permute", "expand"
_MOVES_PER_TRACKER = 64

_reshape_tracker = functools.lru_cache(maxsize=1 << 14)(ShapeTracker._reshape)
_permute_tracker = functools.lru_cache(maxsize=1 << 14)(ShapeTracker._permute)
_expand_tracker = functools.lru_cache(maxsize=1 << 14)(ShapeTracker._expand)
_pad_tracker = functools.lru_cache(maxsize=1 << 14)(ShapeTracker._pad)
_shrink_tracker = functools.lru_cache(maxsize=1 << 14)(ShapeTracker._shrink)
