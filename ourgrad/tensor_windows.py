"""Pooling windows: the zero-copy view that turns the last spatial dims of a tensor into (output position, window
offset) pairs, planned once per geometry as a list of movement ops, and applied to a tensor as one autograd node.

A window view is a chain of four to nine movement ops (pad, reshape, shrink, permute, expand) whose arguments depend
only on the input's shape and the pooling arguments. Every convolution and pooling of every training step asked for
the same chains: `window_moves` computes a chain once per geometry (remembered, bounded) and `apply_moves` replays it.
On a tensor, `MovedView` is the whole chain as one Function: its backward applies each move's adjoint in reverse
order (the gradients the movement Functions give one by one: pad <-> shrink, reshape back, the inverse permute, an
expand summed back), so the gradient graph is the same, built without a Function and a tensor per move.

Also here: the window ranks that max pooling's backward orders a window's elements by (`window_ranks`), a lazy
graph of constants remembered per geometry. This module never imports the Tensor class.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ourgrad.dtype import dtypes
from ourgrad.errors import ShapeError
from ourgrad.function import Function, _sum_to_shape
from ourgrad.helpers import inverse_permutation, register_cache_clearer
from ourgrad.lazy import LazyBuffer
from ourgrad.lazy_moves import Move, apply_moves
from ourgrad.shape.shapetracker import ShapeTracker

if TYPE_CHECKING:
  from ourgrad.tensor import Tensor

# a movement op and its argument, as the LazyBuffer and Tensor methods of that name take it; "sum_to" (only among a
# chain's adjoints) is the gradient of an expand: summed back to the argument's shape


class WindowMoves:
  """A chain of movement ops (`moves`) and the adjoints that take a gradient of its result back to its input's
  shape (`adjoints`, in the order they apply)."""
  __slots__ = ("moves", "adjoints", "_shape", "trackers", "adjoint_trackers", "sums")

  def __init__(self, shape: tuple[int, ...]):
    self.moves: list[Move] = []
    self.adjoints: list[Move] = []
    self._shape = shape   # the shape after the moves so far
    # a lazy input's tracker -> the tracker the moves compose it to (trackers are interned: the same every step)
    self.trackers: dict[ShapeTracker, ShapeTracker] = {}
    self.adjoint_trackers: dict[ShapeTracker, ShapeTracker] = {}   # (the same for the adjoints, without a sum)
    self.sums = False   # whether an adjoint sums (an expand's): then the adjoints are no view

  def pad(self, pairs: tuple[tuple[int, int], ...]) -> None:
    """Pad by the (before, after) pairs; a negative amount crops (a shrink first), as Tensor.pad does."""
    if any(before < 0 or after < 0 for before, after in pairs):
      self.shrink(tuple((max(0, -before), size - max(0, -after)) for (before, after), size in zip(pairs, self._shape)))
      pairs = tuple((max(0, before), max(0, after)) for before, after in pairs)
    if all(pair == (0, 0) for pair in pairs): return
    self._note("pad", pairs, "shrink", tuple((before, before + size) for size, (before, _) in zip(self._shape, pairs)),
               tuple(size + before + after for size, (before, after) in zip(self._shape, pairs)))

  def shrink(self, bounds: tuple[tuple[int, int], ...]) -> None:
    if all(bound == (0, size) for bound, size in zip(bounds, self._shape)): return
    self._note("shrink", bounds, "pad", tuple((start, size - end) for (start, end), size in zip(bounds, self._shape)),
               tuple(end - start for start, end in bounds))

  def reshape(self, shape: tuple[int, ...]) -> None:
    if shape != self._shape: self._note("reshape", shape, "reshape", self._shape, shape)

  def permute(self, order: tuple[int, ...]) -> None:
    if order == tuple(range(len(order))): return
    self._note("permute", order, "permute", inverse_permutation(order), tuple(self._shape[axis] for axis in order))

  def expand(self, shape: tuple[int, ...]) -> None:
    if shape != self._shape: self._note("expand", shape, "sum_to", self._shape, shape)

  def _note(self, name: str, arg: Any, adjoint: str, adjoint_arg: Any, shape: tuple[int, ...]) -> None:
    self.moves.append((name, arg))
    self.adjoints.insert(0, (adjoint, adjoint_arg))
    self.sums = self.sums or adjoint == "sum_to"
    self._shape = shape

  @property
  def shape(self) -> tuple[int, ...]: return self._shape


class MovedView(Function):
  """A chain of movement ops (a `WindowMoves`) as one autograd node: the forward applies its moves to the lazy
  buffer, the backward their adjoints to the gradient (the graph the movement Functions' backwards build)."""

  def forward(self, x: LazyBuffer, chain: WindowMoves) -> LazyBuffer:
    self.chain = chain
    return moved(x, chain)

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer:
    chain, grad = self.chain, grad_output
    if type(grad) is LazyBuffer and grad._const is None and not chain.sums:
      return _composed(grad, chain.adjoints, chain.adjoint_trackers)
    for name, arg in chain.adjoints: grad = _sum_to_shape(grad, arg) if name == "sum_to" else getattr(grad, name)(arg)
    return grad


def _composed(x: LazyBuffer, moves: list[Move], trackers: dict[ShapeTracker, ShapeTracker]) -> LazyBuffer:
  """`moves` (movement ops only) applied to x (no constant's storage) as one view through the tracker they compose
  x's to, remembered in `trackers` (x's tracker is interned: the same every step)."""
  st = trackers.get(x.st)
  if st is None:
    if len(trackers) >= _TRACKERS_PER_CHAIN: trackers.clear()
    st = trackers[x.st] = apply_moves(x, moves).st
  return x.view(st)


def moved(x: Tensor | LazyBuffer, chain: WindowMoves) -> Tensor | LazyBuffer:
  """x viewed through `chain`: a lazy buffer's movement ops, a single device tensor's one MovedView node, a sharded
  tensor's own movement ops."""
  if type(x) is LazyBuffer:
    if x._const is not None: return apply_moves(x, chain.moves)   # (a constant's storage tracks its views: _moved)
    return _composed(x, chain.moves, chain.trackers)   # one view through the composed tracker, not one per move
  if type(x._lazydata) is LazyBuffer and chain.moves: return MovedView.apply(x, chain=chain)
  return apply_moves(x, chain.moves)


_TRACKERS_PER_CHAIN = 16

# (input shape, window arguments) -> its WindowMoves: each convolution and pooling of a training step asks for the
# same few every step
_CHAINS: dict[tuple, WindowMoves] = {}
_CHAINS_MAX = 256
register_cache_clearer(_CHAINS.clear)


def _remembered(key: tuple, plan: Any, *args: Any) -> WindowMoves:
  """`plan(*args)`, remembered under `key` (a key that does not hash, a symbolic size's, is planned every time)."""
  try:
    chain = _CHAINS.get(key)
  except TypeError:
    return plan(*args)
  if chain is None:
    chain = plan(*args)
    if len(_CHAINS) >= _CHAINS_MAX: _CHAINS.pop(next(iter(_CHAINS)))   # oldest first
    _CHAINS[key] = chain
  return chain


def window_moves(shape: tuple[int, ...], kernel: tuple[int, ...], stride: tuple[int, ...],
                 dilation: tuple[int, ...], pads: tuple[tuple[int, int], ...] = ()) -> WindowMoves:
  """The chain that views an input of `shape` as its pooling windows (`_plan_windows`), after padding the last
  len(kernel) dims by `pads` ((before, after) pairs; a negative amount crops), remembered per geometry."""
  return _remembered((shape, kernel, stride, dilation, pads), _plan_windows, shape, kernel, stride, dilation, pads)


def pool_windows(x: Tensor | LazyBuffer, kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...],
                 pads: tuple[tuple[int, int], ...] = ()) -> Tensor | LazyBuffer:
  """Windows of the last len(kernel) dims of x (padded by `pads`, zeros), as a view: (..., i1, i2) ->
  (..., o1, o2, k1, k2) with result[..., a, b, p, q] = x[..., a*s1 + p*d1, b*s2 + q*d2] and
  o = floor((i - d*(k-1) - 1) / s) + 1 (i the padded size). Nothing is copied: a consumer (a conv's multiply-and-sum,
  a pool's max) reads x directly through the composed index expression."""
  return moved(x, window_moves(tuple(x.shape), kernel, stride, dilation, pads))


def _plan_windows(shape: tuple[int, ...], kernel: tuple[int, ...], stride: tuple[int, ...],
                  dilation: tuple[int, ...], pads: tuple[tuple[int, int], ...]) -> WindowMoves:
  """The movement ops of `pool_windows`, computed from the shapes alone."""
  chain = WindowMoves(shape)
  spatial = len(kernel)
  batch = shape[:-spatial]
  if pads: chain.pad(((0, 0),) * len(batch) + pads)
  sizes = chain.shape[-spatial:]
  for k, d, i in zip(kernel, dilation, sizes):
    if d * (k - 1) + 1 > i:
      raise ShapeError(f"kernel {kernel} with dilation {dilation} is larger than the (padded) input {sizes} "
                       f"of shape {chain.shape}")
  outs = tuple((i - d * (k - 1) - 1) // s + 1 for i, k, s, d in zip(sizes, kernel, stride, dilation))
  keep = tuple((0, size) for size in batch)

  if all(k <= s for k, s in zip(kernel, stride)) and all(d == 1 for d in dilation):
    # Windows do not overlap: pad/crop each dim to o*s, split it into (o, s) and keep the first k of each s.
    chain.pad(((0, 0),) * len(batch) + tuple((0, o * s - i) for i, o, s in zip(sizes, outs, stride)))
    chain.reshape(batch + tuple(size for o, s in zip(outs, stride) for size in (o, s)))
    chain.shrink(keep + tuple(bound for o, k in zip(outs, kernel) for bound in ((0, o), (0, k))))
    chain.permute((*range(len(batch)), *(len(batch) + 2 * a for a in range(spatial)),
                   *(len(batch) + 2 * a + 1 for a in range(spatial))))
    return chain

  # Windows overlap (k > s) or are dilated. Along one dim of size i, tile x (expand a new axis, merge it) so
  # y[j] = x[j mod i], and reshape a prefix of y into rows of length L = i*f + d: row p, column c holds
  # x[(p*L + c) mod i] = x[(p*d + c) mod i], i.e. each row starts d elements (one dilation step) after the previous
  # one. Column c = a*s is then output position a, and for valid (a, p) the index a*s + p*d < i, so the mod never
  # wraps. f is the smallest whole number of tiles that makes a row long enough to hold the o*s columns we split
  # off. The index math of the composed view folds back to plain a*s + p*d (no div/mod in the kernel).
  rows = [i * max(0, math.ceil((o * s - d) / i)) + d for i, o, s, d in zip(sizes, outs, stride, dilation)]
  tiles = [math.ceil(k * row / i) for k, row, i in zip(kernel, rows, sizes)]
  chain.reshape(batch + tuple(size for i in sizes for size in (1, i)))
  chain.expand(batch + tuple(size for r, i in zip(tiles, sizes) for size in (r, i)))
  chain.reshape(batch + tuple(r * i for r, i in zip(tiles, sizes)))
  # rows of length L, one per kernel offset p: (k, L)
  chain.shrink(keep + tuple((0, k * row) for k, row in zip(kernel, rows)))
  chain.reshape(batch + tuple(size for k, row in zip(kernel, rows) for size in (k, row)))
  # the first o*s columns, split into (o, s); column 0 of each stride step is output position a: (k, o, s)
  chain.shrink(keep + tuple(bound for k, o, s in zip(kernel, outs, stride) for bound in ((0, k), (0, o * s))))
  chain.reshape(batch + tuple(size for k, o, s in zip(kernel, outs, stride) for size in (k, o, s)))
  chain.shrink(keep + tuple(bound for k, o in zip(kernel, outs) for bound in ((0, k), (0, o), (0, 1))))
  chain.reshape(batch + tuple(size for k, o in zip(kernel, outs) for size in (k, o)))
  # (..., k1, o1, k2, o2) -> (..., o1, o2, k1, k2): output positions first, window offsets last
  chain.permute((*range(len(batch)), *(len(batch) + 2 * a + 1 for a in range(spatial)),
                 *(len(batch) + 2 * a for a in range(spatial))))
  return chain


# ---------------------------------------------------------------- max pooling's window ranks

# (device, the input's batch dims and spatial shape, the windows' shape, the pooling arguments) -> the ranks
# `_build_window_ranks` made for them and the bases of that graph: a lazy graph of constants only (nothing loaded);
# every max pooling of every training step rebuilt the same twenty-odd constant ops (a tenth of the MNIST CNN step's
# graph building)
_WINDOW_RANKS: dict[tuple, tuple[LazyBuffer, tuple[LazyBuffer, ...]]] = {}
_WINDOW_RANKS_MAX = 64
register_cache_clearer(_WINDOW_RANKS.clear)


def window_ranks(x: Tensor, windows_shape: tuple[int, ...], pads: tuple[int, ...], kernel: tuple[int, ...],
                 stride: tuple[int, ...], dilation: tuple[int, ...]) -> Tensor:
  """`_build_window_ranks`, remembered per device and geometry while the graph it made stays lazy."""
  batch = x.ndim - len(kernel)
  key = (x.device, batch, x.shape[batch:], windows_shape, pads, kernel, stride, dilation)
  try:
    cached = _WINDOW_RANKS.get(key)
  except TypeError:   # an unhashable argument (a list): not remembered
    return _build_window_ranks(x, windows_shape, pads, kernel, stride, dilation)
  # a value is never stale (constants), but a schedule may have realized a base of it: that buffer's memory may have
  # been planned for reuse within its schedule, so only a graph with no realized base is read again
  if cached is not None and _still_lazy(cached[1]): return type(x)(cached[0])
  ranks = _build_window_ranks(x, windows_shape, pads, kernel, stride, dilation)
  if type(ranks.lazydata) is LazyBuffer:
    bases = _graph_bases(ranks.lazydata)
    if _still_lazy(bases):
      if len(_WINDOW_RANKS) >= _WINDOW_RANKS_MAX: _WINDOW_RANKS.pop(next(iter(_WINDOW_RANKS)))  # oldest first
      _WINDOW_RANKS[key] = (ranks.lazydata, bases)
  return ranks


def _graph_bases(lazy: LazyBuffer) -> tuple[LazyBuffer, ...]:
  """Every base of the graph behind `lazy`, each once."""
  stack, seen, bases = [lazy.base], {id(lazy.base)}, []
  while stack:
    base = stack.pop()
    bases.append(base)
    for src in base.srcs:
      if id(src.base) not in seen:
        seen.add(id(src.base))
        stack.append(src.base)
  return tuple(bases)


def _still_lazy(bases: tuple[LazyBuffer, ...]) -> bool:
  """Whether none of `bases` has a buffer or is to be realized (the graph is still only a description). (A loop over
  the graph's bases listed once: walking the graph again at every max pooling cost more than the rest of its
  forward's bookkeeping.)"""
  for base in bases:
    if base.realized is not None or base.forced_realize: return False
  return True


def _build_window_ranks(x: Tensor, windows_shape: tuple[int, ...], pads: tuple[int, ...], kernel: tuple[int, ...],
                        stride: tuple[int, ...], dilation: tuple[int, ...]) -> Tensor:
  """For the pooling windows (`windows_shape`, `pool_windows`' layout) of `x` padded by `pads`, a rank of each window
  element: K down to 1 in the window's row-major order (K elements), 0 where the element is padding. Built from
  constants padded into place and expanded before any arithmetic, so kernels compute it from their indices: nothing
  is loaded or realized. float32 (exact: K < 2**24), as the values beside it: an int32 key made CLANG's reduce of it
  several times slower."""
  Tensor = type(x)  # noqa: N806 (the concrete class; this module never imports it)
  spatial, batch = len(kernel), x.ndim - len(kernel)
  leading = (1,) * (len(windows_shape) - spatial)
  rank = Tensor.full(windows_shape, 1, dtypes.float32, device=x.device)
  for axis, size in enumerate(kernel):
    weight = math.prod(kernel[axis + 1:])   # offset i along `axis` counts (size - 1 - i) * weight
    for i in range(size - 1):
      one_hot = Tensor.full((1,) * spatial, (size - 1 - i) * weight, dtypes.float32, device=x.device)
      one_hot = one_hot.pad([(i, size - 1 - i) if a == axis else (0, 0) for a in range(spatial)])
      rank = rank + one_hot.reshape(leading + one_hot.shape).expand(windows_shape)
  inside = Tensor.full(x.shape[batch:], True, dtypes.bool, device=x.device).pad([(p, p) for p in pads])
  inside = pool_windows(inside.reshape((1,) * batch + inside.shape), kernel, stride, dilation).expand(windows_shape)
  return inside.where(rank, 0)
