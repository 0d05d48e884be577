"""The movement Functions (views of a tensor: reshape, permute, expand, pad, shrink, flip, a view through an in-place
write) and the indexed reads (rows gathered, picked or accumulated by an index), each an autograd Function as in
`function.py`, whose base class and lazy helpers they use.
"""
from __future__ import annotations

from typing import Any

from ourgrad.dtype import dtypes
from ourgrad.function import Function, _sum_to_shape, _where
from ourgrad.helpers import inverse_permutation
from ourgrad.lazy import LazyBuffer
from ourgrad.lazy_views import place_through_view


# ---------------------------------------------------------------- movement

class Reshape(Function):
  def forward(self, x: LazyBuffer, shape: tuple[int, ...]) -> LazyBuffer:
    self.input_shape = x.shape
    return x.reshape(shape)

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer: return grad_output.reshape(self.input_shape)


class Permute(Function):
  def forward(self, x: LazyBuffer, order: tuple[int, ...]) -> LazyBuffer:
    self.order = order
    return x.permute(order)

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer: return grad_output.permute(inverse_permutation(self.order))


class Expand(Function):
  """x broadcast to `shape`; x may have fewer dims (size-1 dims are put in front first, as numpy broadcasts): one
  Function for the reshape and the expand of a broadcast operand."""

  def forward(self, x: LazyBuffer, shape: tuple[int, ...]) -> LazyBuffer:
    self.input_shape = x.shape
    # (reshaped only when dims are added: a sharded input's reshape maps whole shapes onto its shards)
    if len(shape) != len(x.shape): x = x.reshape((1,) * (len(shape) - len(x.shape)) + x.shape)
    return x.expand(shape)

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer: return _sum_to_shape(grad_output, self.input_shape)


class Pad(Function):
  def forward(self, x: LazyBuffer, arg: tuple[tuple[int, int], ...]) -> LazyBuffer:
    self.narrow = tuple((before, size + before) for size, (before, _) in zip(x.shape, arg))
    return x.pad(arg)

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer: return grad_output.shrink(self.narrow)


class Shrink(Function):
  def forward(self, x: LazyBuffer, arg: tuple[tuple[int, int], ...]) -> LazyBuffer:
    self.widen = tuple((start, size - end) for size, (start, end) in zip(x.shape, arg))
    return x.shrink(arg)

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer: return grad_output.pad(self.widen)


class Flip(Function):
  def forward(self, x: LazyBuffer, axes_mask: tuple[bool, ...]) -> LazyBuffer:
    self.axes_mask = axes_mask
    return x.flip(axes_mask)

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer: return grad_output.flip(self.axes_mask)


class WriteThroughView(Function):
  """A tensor after an in-place write through a view of it (`v = h[0:2]; v += x`): the elements the view covers take
  the gradient path of the view's new value, the others keep the tensor's own. forward(h, v, st) gives h's value
  (written already); `st` is the view's ShapeTracker over h's base."""

  def forward(self, h: LazyBuffer, v: LazyBuffer, st: Any) -> LazyBuffer:
    self.st, self.base_shape = st, h.base.shape
    placed = place_through_view(v.const_like(0), st, self.base_shape)
    self.inside = placed[1].reshape(h.shape) if placed is not None else h.const_like(False, dtypes.bool)
    return h

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, LazyBuffer | None]:
    grad_h = _where(self.inside, grad_output.const_like(0), grad_output) if self.needs_input_grad[0] else None
    grad_v = None
    if self.needs_input_grad[1]:
      flat = grad_output.reshape(self.base_shape)
      grad_v = flat.base.view(flat.st + self.st) if not flat.is_base else flat.view(self.st)
    return grad_h, grad_v


class ViewOf(Function):
  """A view of a tensor through `st` (a ShapeTracker over the tensor's base, one strided lattice of it), as a
  Function of the tensor: a view made before a write through another view of the same tensor, rebuilt on the
  tensor's new gradient path. Backward puts the gradient back in place (zeros elsewhere)."""

  def forward(self, h: LazyBuffer, st: Any) -> LazyBuffer:
    self.st, self.base_shape, self.input_shape = st, h.base.shape, h.shape
    view = h.base.view(st)
    place_through_view(view.const_like(0), st, self.base_shape)   # ShapeError now for a view that is no lattice
    return view

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer:
    placed = place_through_view(grad_output, self.st, self.base_shape)
    if placed is None: return LazyBuffer.full(0, self.input_shape, grad_output.dtype, grad_output.device)
    return placed[0].reshape(self.input_shape)


# ---------------------------------------------------------------- indexed reads

class GatherRows(Function):
  """Rows of a (N, R) table picked by an (M,) int32 index -> (M, R), reading only those rows (LazyBuffer.gather_rows);
  an index outside [0, N) gives zeros.

  The gradient is an indexed accumulate of the M output rows into a zero table (LazyBuffer.accumulate_rows): one
  kernel, M x R additions, repeated indices summed in order, no one-hot over the table."""

  def forward(self, table: LazyBuffer, index: LazyBuffer) -> LazyBuffer:
    self.index, self.table_shape = index, table.shape
    return table.gather_rows(index)

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, None]:
    if not self.needs_input_grad[0]: return None, None
    zeros = LazyBuffer.full(0, self.table_shape, grad_output.dtype, grad_output.device)
    return zeros.accumulate_rows(self.index, grad_output), None


class PickPerRow(Function):
  """One element of each row of an (R, C) x -> (R,): x[r, flat_index[r] - r * C], read by an indexed load each
  (LazyBuffer.gather_rows over x flattened to (R * C, 1); `flat_index` (R,) int32, -1 where nothing is picked: 0).
  The gradient is where(one_hot, grad, 0) (`one_hot` (R, C) bool, the picked positions): elementwise, it fuses
  into the kernel of x's other gradient terms (cross-entropy's softmax - one_hot)."""

  def forward(self, x: LazyBuffer, flat_index: LazyBuffer, one_hot: LazyBuffer) -> LazyBuffer:
    self.one_hot = one_hot
    rows, classes = x.shape
    return x.reshape((rows * classes, 1)).gather_rows(flat_index).reshape((rows,))

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer, None, None]:
    spread = grad_output.reshape((grad_output.shape[0], 1)).expand(self.one_hot.shape)
    return _where(self.one_hot, spread, spread.operand_like(0)), None, None


class AccumulateRows(Function):
  """A (N, R) start with the (M, R) rows added at the rows an (M,) int32 index names, in order (repeated indices
  summed, an index outside [0, N) ignored): LazyBuffer.accumulate_rows. The gradient of the start is the output's;
  that of the rows is the output's gradient gathered at the index (zero where the index is outside)."""

  def forward(self, start: LazyBuffer, index: LazyBuffer, rows: LazyBuffer) -> LazyBuffer:
    self.index = index
    return start.accumulate_rows(index, rows)

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, None, LazyBuffer | None]:
    grad_rows = grad_output.gather_rows(self.index) if self.needs_input_grad[2] else None
    return (grad_output if self.needs_input_grad[0] else None), None, grad_rows
