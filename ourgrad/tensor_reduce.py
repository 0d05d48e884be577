"""Reductions and linear algebra for Tensor (ReduceMixin).

sum and max are the two reduce primitives (ourgrad/function.py); min, mean, var, std, any, all, argmax,
logsumexp, softmax and cumsum are built from them, and prod halves its axis in log2(n) multiply steps. Integers
and bools sum in int64 and float16/bfloat16 accumulate in float32, as in PyTorch. matmul is a broadcast
multiply and a sum over the inner dimension, which the kernel optimizer turns into one tiled kernel; triu and
tril are masks built from arange.

The methods become Tensor's through `class Tensor(..., ReduceMixin, ...)` in ourgrad/tensor.py; this module does
not import that one at load time (it imports this one), so methods that make a Tensor import the class when
called.
"""
from __future__ import annotations

import math
import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence

import numpy as np

from ourgrad import function as F
from ourgrad.dtype import DType, dtypes, least_upper_dtype, sum_dtype
from ourgrad.errors import AxisError, DeviceError, ShapeError
from ourgrad.helpers import normalize_axis, prod
from ourgrad.lazy import LazyBuffer
from ourgrad.mixed_precision import CastPolicy, autocast_op, store_low_precision
from ourgrad.ops import ADD, MAX_REDUCE, OR, SUM, WHERE
from ourgrad.tensor_math import _broadcast_shape


if TYPE_CHECKING:
  from ourgrad.tensor import Tensor


def accepts_dim(method: Callable[..., Any]) -> Callable[..., Any]:
  """Let a method that takes `axis` also take PyTorch's keyword `dim` (x.sum(dim=1) is x.sum(1))."""
  axis_position = list(inspect.signature(method).parameters).index("axis") - 1  # without self
  @functools.wraps(method)
  def with_dim(self: Any, *args: Any, dim: Any = None, **kwargs: Any) -> Any:
    if dim is not None:
      if len(args) > axis_position or "axis" in kwargs:
        raise TypeError(f"{method.__name__}() got both an axis and dim={dim}")
      kwargs["axis"] = dim
    return method(self, *args, **kwargs)
  with_dim.__doc__ = (method.__doc__ or "").rstrip() + " Takes PyTorch's `dim=` for `axis`."
  return with_dim


class ValuesIndices(NamedTuple):
  """max(dim=...) and min(dim=...) as in PyTorch: the values and the int64 indices of the first extreme elements."""
  values: Tensor
  indices: Tensor


def _with_indices(method: Callable[..., Any], arg_method: str) -> Callable[..., Any]:
  """max/min: values for an axis given positionally or as `axis` (tinygrad's form), (values, indices) for PyTorch's
  keyword `dim`, so code written for either library gets what it expects."""
  @functools.wraps(method)
  def values_or_pair(self: Any, *args: Any, dim: Any = None, **kwargs: Any) -> Any:
    if dim is None: return method(self, *args, **kwargs)
    if args or "axis" in kwargs: raise TypeError(f"{method.__name__}() got both an axis and dim={dim}")
    keepdim = kwargs.get("keepdim", False)
    indices = getattr(self, arg_method)(dim, True)
    if self.ndim == 0: return ValuesIndices(self, indices.reshape(()))
    # the values picked at the indices, so the gradient goes to that one element (torch's rule; amax splits ties)
    values = self.gather(self._axis(dim), indices)
    return ValuesIndices(values, indices) if keepdim else ValuesIndices(values.squeeze(dim), indices.squeeze(dim))
  return values_or_pair


def _logsumexp_lazy(source: LazyBuffer, axes: tuple[int, ...]) -> LazyBuffer:
  """Tensor.logsumexp's formula for a float32/float64 input cut from the graph, on lazy buffers: the very graph the
  Tensor ops build, op for op, without a Function and a Tensor per op (LogSumExpGrad gives the gradient)."""
  peak = source.reduce(MAX_REDUCE, axes)
  infinite = F._equal(peak, peak.operand_like(math.inf)).elementwise(OR,
                                                                     F._equal(peak, peak.operand_like(-math.inf)))
  peak = infinite.elementwise(WHERE, peak.operand_like(0), peak)   # (peak.isinf().where(0, peak))
  shifted = F._sub(source, peak.expand(source.shape))
  return F._log(F._exp(shifted).reduce(SUM, axes)).elementwise(ADD, peak)


def _softmax_lazy(source: LazyBuffer, axes: tuple[int, ...]) -> LazyBuffer:
  """Tensor.softmax's formula for a float32/float64 input cut from the graph, on lazy buffers, op for op; SoftmaxGrad
  gives the gradient."""
  exps = F._exp(F._sub(source, source.reduce(MAX_REDUCE, axes).expand(source.shape)))
  return F._div(exps, exps.reduce(SUM, axes).expand(source.shape))


def _one_linear_node(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
  """Whether `linear` builds its graph as one F.Linear node: x (at least 2-D), a 2-D weight and a (n,) bias, all
  float32 or float64 lazy buffers of one dtype and device, of concrete nonzero sizes that agree (otherwise the matmul
  path: casts, 1-D operands, broadcasting, its errors)."""
  mine, theirs = x._lazydata, weight._lazydata
  if type(mine) is not LazyBuffer or type(theirs) is not LazyBuffer: return False
  if mine.dtype not in (dtypes.float32, dtypes.float64) or theirs.dtype is not mine.dtype: return False
  if theirs.device != mine.device or len(mine.shape) < 2 or len(theirs.shape) != 2: return False
  for size in mine.shape + theirs.shape:   # (a loop, not all() over a generator: no generator frame per linear)
    if type(size) is not int or size <= 0: return False
  if mine.shape[-1] != theirs.shape[1]: return False
  if bias is None: return True
  extra = bias._lazydata
  return type(extra) is LazyBuffer and extra.dtype is mine.dtype and extra.device == mine.device and \
      extra.shape == (theirs.shape[0],)


@functools.lru_cache(maxsize=1 << 12, typed=True)
def _reduce_axes_of(ndim: int, axis: int | Sequence[int] | None) -> tuple[int, ...]:
  """ReduceMixin._reduce_axes for a tensor of `ndim` dims, remembered per (ndim, axis and its type): a model reduces
  over the same axes every step (errors are raised again each time: lru_cache keeps only results; a float axis is
  another key, so it never takes an int's answer)."""
  if axis is None: return tuple(range(ndim))
  axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
  normalized = tuple(normalize_axis(int(a), ndim) for a in axes)
  # a 0-d tensor takes axis 0 or -1 as PyTorch does (checked above) and has nothing to reduce over
  if ndim == 0: return ()
  if len(set(normalized)) != len(normalized): raise AxisError(f"axis {axis} repeats a dimension")
  return normalized


class ReduceMixin:
  """Tensor's reductions (sum, max, mean, var, argmax, softmax, cumsum, ...) and linear algebra (matmul, ...)."""
  __slots__ = ()

  # ---------------------------------------------------------------- reductions

  def _reduce_axes(self, axis: int | Sequence[int] | None) -> tuple[int, ...]:
    """`axis` (None: all) as a tuple of non-negative axes of this tensor; AxisError for one out of range or repeated."""
    ndim = len(self._lazydata.shape)
    try:
      return _reduce_axes_of(ndim, axis)
    except TypeError:   # an unhashable axis (a list): not remembered
      return _reduce_axes_of.__wrapped__(ndim, axis)

  def _reduce(self, function: type[F.Function], axis: int | Sequence[int] | None, keepdim: bool) -> Tensor:
    axes = self._reduce_axes(axis)
    if keepdim: return function.apply(self, axes=axes)
    # the reduced dims dropped by the Function itself (F.Sum's `shape`): no Reshape Function after it
    return function.apply(self, axes=axes, shape=tuple(size for a, size in enumerate(self.shape) if a not in axes))

  @autocast_op(CastPolicy.FLOAT32)
  @accepts_dim
  def sum(self, axis: int | Sequence[int] | None = None, keepdim: bool = False, dtype: DType | None = None) -> Tensor:
    """Sum over `axis` (all if None). Integers and bools sum in int64, as in PyTorch, unless `dtype` is given."""
    target = dtypes.as_dtype(dtype) if dtype is not None else sum_dtype(self.dtype)
    # half-precision floats accumulate in float32 and round once at the end
    accumulate = dtypes.float32 if target in (dtypes.float16, dtypes.bfloat16) else target
    return self.cast(accumulate)._reduce(F.Sum, axis, keepdim).cast(target)

  def max(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    """The largest value over `axis` (all if None); ShapeError for an empty axis. Given as `max(1)` or `max(axis=1)`
    (tinygrad) it returns the values; given as `max(dim=1)` (PyTorch) it returns (values, indices)."""
    if self.numel() == 0 and any(self.shape[a] == 0 for a in self._reduce_axes(axis)):
      raise ShapeError(f"max of an empty dimension of shape {self.shape} has no identity; give a non-empty axis")
    if self.dtype == dtypes.bool: return self.cast(dtypes.uint8)._reduce(F.Max, axis, keepdim).cast(dtypes.bool)
    return self._reduce(F.Max, axis, keepdim)

  def min(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    """The smallest value over `axis` (all if None); ShapeError for an empty axis. Given as `min(1)` or `min(axis=1)`
    (tinygrad) it returns the values; given as `min(dim=1)` (PyTorch) it returns (values, indices)."""
    if self.dtype == dtypes.bool: return ~((~self).max(axis, keepdim))
    if not self.dtype.is_float: return ~((~self).max(axis, keepdim))
    return -((-self).max(axis, keepdim))

  max = _with_indices(max, "argmax")  # type: ignore[assignment]
  min = _with_indices(min, "argmin")  # type: ignore[assignment]

  @accepts_dim
  def amax(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    """The same as max(axis, keepdim)."""
    return self.max(axis, keepdim)

  @accepts_dim
  def amin(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    """The same as min(axis, keepdim)."""
    return self.min(axis, keepdim)

  @autocast_op(CastPolicy.NATIVE)
  @accepts_dim
  def mean(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    """The mean over `axis` (all if None); integers and bools promote to the default float; NaN over an empty axis."""
    x = self._float_operand()
    count = prod(self.shape[a] for a in self._reduce_axes(axis))
    total = x.sum(axis, keepdim)
    return total / count if count else total * math.nan

  @autocast_op(CastPolicy.NATIVE)
  @accepts_dim
  def var(self, axis: int | Sequence[int] | None = None, keepdim: bool = False, correction: int = 1) -> Tensor:
    """The variance over `axis` (all if None) with `correction` (1: unbiased, as torch.var). As in PyTorch, the sum of
    squares is divided by max(0, n - correction): inf when there are no more elements than `correction` (NaN where
    the sum is 0, as for one element)."""
    x = self._float_operand()
    count = prod(self.shape[a] for a in self._reduce_axes(axis))
    # the mean is a constant for the gradient: its share, sum(x - mean) * d(mean), is zero, and leaving it out keeps
    # one infinite element from turning every gradient into NaN (torch's var_backward is 2 (x - mean) / (n - c))
    squares = (x - x.detach().mean(axis, keepdim=True)).square().sum(axis, keepdim)
    return squares / max(count - correction, 0)

  @autocast_op(CastPolicy.NATIVE)
  @accepts_dim
  def std(self, axis: int | Sequence[int] | None = None, keepdim: bool = False, correction: int = 1) -> Tensor:
    """The standard deviation: sqrt(var(axis, keepdim, correction)); its gradient is 0 where it is 0, as in torch."""
    return self.var(axis, keepdim, correction)._sqrt_flat_at_zero()

  def _sqrt_flat_at_zero(self) -> Tensor:
    """sqrt, with a zero gradient at 0 (where sqrt's own is infinite): the rule of torch's std and norm backward."""
    value = self.detach().sqrt()
    return self._with_derivative(value, (value == 0).where(0.0, 0.5 / value))

  @autocast_op(CastPolicy.FLOAT32)
  @accepts_dim
  def prod(self, axis: int | None = None, keepdim: bool = False) -> Tensor:
    """Product over one axis (or all), by halving the axis repeatedly: log2(n) fused multiply steps."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    target = sum_dtype(self.dtype) if not self.dtype.is_float else self.dtype
    if axis is None:
      result = self.flatten().cast(target).prod(0)
      return result.reshape((1,) * self.ndim) if keepdim else result
    dim = self._axis(axis)
    if self.ndim == 0: return self.cast(target)
    x = self.cast(target).transpose(dim, -1)
    while x.shape[-1] > 1:
      size = x.shape[-1]
      if size % 2: x = x.pad([None] * (x.ndim - 1) + [(0, 1)], value=1)
      halves = x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
      x = (halves[..., 0] * halves[..., 1]).contiguous()
    if x.shape[-1] == 0: x = Tensor.ones(*x.shape[:-1], 1, dtype=target, device=self.device)
    result = x.transpose(dim, -1)
    return result if keepdim else result.squeeze(dim)

  @accepts_dim
  def any(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    """A bool tensor, True where any value over `axis` (all if None) is non-zero."""
    # max has no identity for an empty axis; a sum has (zero), and keeps the reduced shape
    if self.numel() == 0: return self.bool().sum(axis, keepdim) != 0
    return self.bool().max(axis, keepdim)

  @accepts_dim
  def all(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    """A bool tensor, True where every value over `axis` (all if None) is non-zero."""
    return self.logical_not().any(axis, keepdim).logical_not()

  @accepts_dim
  def argmax(self, axis: int | None = None, keepdim: bool = False) -> Tensor:
    """Index of the first maximal element (flattened if axis is None), int64 as in PyTorch."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    if axis is None:
      result = self.flatten().argmax(0)
      return result.reshape((1,) * self.ndim) if keepdim else result
    dim = self._axis(axis)
    if self.ndim == 0: return Tensor.zeros((), dtype=dtypes.int64, device=self.device)
    size = self.shape[dim]
    if size == 0: raise ShapeError(f"argmax of an empty dimension {dim} of shape {self.shape}")
    # an index has no gradient: built from the values alone, no op records a Function for the backward (the accuracy
    # of a training step's logits)
    x = self.detach() if self.requires_grad else self
    is_max = x == x.max(dim, keepdim=True)
    if x.dtype.is_float:
      nan = x.isnan()
      is_max = is_max | (nan & nan.any(dim, keepdim=True))
    # the first maximal index has the largest (size - index)
    countdown = Tensor.arange(size, 0, -1, device=self.device).reshape((size,) + (1,) * (self.ndim - dim - 1))
    best = is_max.where(countdown, 0).max(dim, keepdim)
    return (size - best).cast(dtypes.int64)

  @accepts_dim
  def argmin(self, axis: int | None = None, keepdim: bool = False) -> Tensor:
    """Index of the first minimal element (flattened if axis is None), int64 as in PyTorch."""
    if self.dtype.is_float: return (-self).argmax(axis, keepdim)
    return (~self if self.dtype != dtypes.bool else self.logical_not()).argmax(axis, keepdim)

  @autocast_op(CastPolicy.FLOAT32)
  @accepts_dim
  def logsumexp(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    """log(sum(exp(self))) over `axis` (all if None), computed stably by subtracting the maximum first; -inf over an
    empty axis."""
    x = self._float_operand()
    # over an empty axis the sum of exps is 0: -inf, as in PyTorch (max has no identity there)
    if any(self.shape[a] == 0 for a in self._reduce_axes(axis)): return x.sum(axis, keepdim).log()
    # computed from x cut from the graph: the gradient is exp(x - result) * grad (F.LogSumExpGrad), an elementwise
    # kernel reading the saved result, with no reduce (the max is only a shift, and the sum's work is done)
    source = x.detach()
    if type(source._lazydata) is LazyBuffer and source.dtype in (dtypes.float32, dtypes.float64):
      total = type(self)(_logsumexp_lazy(source.lazydata, self._reduce_axes(axis)))   # (the formula below)
    else:
      peak = source.max(axis, keepdim=True)
      peak = peak.isinf().where(0, peak)  # all -inf (or an inf) would give nan through x - peak
      total = (source - peak).exp().sum(axis, keepdim=True).log() + peak
    if x.requires_grad: total = F.LogSumExpGrad.apply(x, total)
    return total if keepdim else total.reshape(tuple(s for a, s in enumerate(self.shape)
                                                     if a not in self._reduce_axes(axis)))

  @autocast_op(CastPolicy.FLOAT32)
  @accepts_dim
  def softmax(self, axis: int = -1) -> Tensor:
    """exp(self) normalized to sum to 1 along `axis` (the last by default); float16 and bfloat16 compute in float32."""
    x = self._float_operand()
    if x.numel() == 0: return x  # nothing to normalize (and max of an empty axis has no identity)
    if x.ndim == 0: return x.reshape(1).softmax(self._axis(axis)).reshape(())   # its own one-element axis (0, -1)
    # computed from x cut from the graph: the gradient reads the output y only (F.SoftmaxGrad), so the backward
    # neither keeps the exps from the forward nor recomputes the row max and sum
    source = x.detach()
    if x.dtype in (dtypes.float16, dtypes.bfloat16):
      # half precision computes in float32 and rounds once, as in PyTorch (rounding exps and sum too: 2 ulps off);
      # a computed input (attention's scores) is stored in its own dtype, not as the float32 the rows read
      store_low_precision(x.lazydata)
      source = source.float()
    if type(source._lazydata) is LazyBuffer:   # (the formula below, op for op, on lazy buffers)
      probs = type(self)(_softmax_lazy(source.lazydata, self._reduce_axes(axis)).cast(x.dtype))
    else:
      exps = (source - source.max(axis, keepdim=True)).exp()
      probs = (exps / exps.sum(axis, keepdim=True)).cast(x.dtype)
    return F.SoftmaxGrad.apply(x, probs, axis=self._axis(axis)) if x.requires_grad else probs

  @autocast_op(CastPolicy.FLOAT32)
  @accepts_dim
  def log_softmax(self, axis: int = -1) -> Tensor:
    """log(softmax(self, axis)), computed stably; float16 and bfloat16 compute in float32."""
    x = self._float_operand()
    if x.numel() == 0: return x  # nothing to normalize (and max of an empty axis has no identity)
    if x.dtype in (dtypes.float16, dtypes.bfloat16): return x.float().log_softmax(axis).cast(x.dtype)
    shifted = x - x.max(axis, keepdim=True).detach()   # a shift the result does not depend on (softmax)
    return shifted - shifted.exp().sum(axis, keepdim=True).log()

  def _cumsum_last(self) -> Tensor:
    """Inclusive cumulative sum over the last axis: out[i] = sum of x[j] for j <= i, as one masked-sum kernel
    (O(n^2) work per row: fine for the sizes cumsum meets in models)."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    size = self.shape[-1]
    if size == 0: return self.cast(sum_dtype(self.dtype))
    positions = Tensor.arange(size, device=self.device)
    keep = positions.reshape(size, 1) >= positions.reshape(1, size)  # row i keeps columns j <= i
    values = self.unsqueeze(-2).expand(self.shape[:-1] + (size, size))
    return keep.where(values, 0).sum(-1)

  @autocast_op(CastPolicy.FLOAT32)
  @accepts_dim
  def cumsum(self, axis: int = 0) -> Tensor:
    """The inclusive running sum along `axis` (0 by default; torch needs it); integers and bools sum in int64."""
    dim = self._axis(axis)
    if self.ndim == 0: return self.cast(sum_dtype(self.dtype))
    return self.transpose(dim, -1)._cumsum_last().transpose(dim, -1)

  @autocast_op(CastPolicy.FLOAT32)
  @accepts_dim
  def cumprod(self, axis: int = 0) -> Tensor:
    """The inclusive running product along `axis` (integers and bools multiply in int64): a masked product per
    position (O(n^2 log n) work per row), exact where values are 0 and with their gradient, as torch.cumprod."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    dim = self._axis(axis)
    target = sum_dtype(self.dtype) if not self.dtype.is_float else self.dtype
    if self.ndim == 0: return self.cast(target)
    x = self.cast(target).transpose(dim, -1)
    size = x.shape[-1]
    if size == 0: return self.cast(target)
    positions = Tensor.arange(size, device=self.device)
    keep = positions.reshape(size, 1) >= positions.reshape(1, size)  # row i keeps columns j <= i
    factors = keep.where(x.unsqueeze(-2).expand(x.shape[:-1] + (size, size)), 1)
    return factors.prod(-1).transpose(dim, -1)

  def _window_last(self) -> tuple[Tensor, Tensor]:
    """For the last axis of size n: the (..., n, n) view where row i holds x[0..n-1] and the mask of j <= i."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    size = self.shape[-1]
    positions = Tensor.arange(size, device=self.device)
    keep = positions.reshape(size, 1) >= positions.reshape(1, size)  # row i keeps columns j <= i
    return self.unsqueeze(-2).expand(self.shape[:-1] + (size, size)), keep

  def _cumulative_extreme(self, axis: int, largest: bool) -> ValuesIndices:
    """cummax/cummin: the running extreme and the index of its latest occurrence (NaN is the extreme once seen), as
    PyTorch; the values are gathered at the indices, so the gradient goes to that element."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    dim = self._axis(axis)
    if self.ndim == 0: return ValuesIndices(self, Tensor.zeros((), dtype=dtypes.int64, device=self.device))
    # nothing to scan: empty results, as in PyTorch
    if self.numel() == 0: return ValuesIndices(self, Tensor.zeros(self.shape, dtype=dtypes.int64, device=self.device))
    x = self.detach().transpose(dim, -1)
    key = x if largest else (-x if x.dtype.is_float else ~x)
    if key.dtype == dtypes.bool: key = key.cast(dtypes.int32)
    window, keep = key._window_last()
    lowest = -math.inf if key.dtype.is_float else key.dtype.min
    running = keep.where(window, lowest).max(-1, keepdim=True)  # (..., n, 1)
    matches = window == running
    if key.dtype.is_float: matches = matches | (window.isnan() & running.isnan())
    size = x.shape[-1]
    positions = Tensor.arange(size, device=self.device).reshape(1, size)
    indices = (keep & matches).where(positions, -1).max(-1).cast(dtypes.int64).transpose(dim, -1)
    return ValuesIndices(self.gather(dim, indices), indices)

  @accepts_dim
  def cummax(self, axis: int = 0) -> ValuesIndices:
    """(values, indices) of the running maximum along `axis`, as torch.cummax."""
    return self._cumulative_extreme(axis, largest=True)

  @accepts_dim
  def cummin(self, axis: int = 0) -> ValuesIndices:
    """(values, indices) of the running minimum along `axis`, as torch.cummin."""
    return self._cumulative_extreme(axis, largest=False)

  @accepts_dim
  def logcumsumexp(self, axis: int = 0) -> Tensor:
    """log of the running sum of exp along `axis`, computed stably against the running maximum (exact for rows
    spanning any range), as torch.logcumsumexp."""
    dim = self._axis(axis)
    if self.ndim == 0: return self._float_operand()
    x = self._float_operand().transpose(dim, -1)
    window, keep = x._window_last()
    peak = keep.where(window.detach(), -math.inf).max(-1, keepdim=True)
    peak = peak.isinf().where(0, peak)  # all -inf (or an inf) would give NaN through x - peak
    total = keep.where((window - peak).exp(), 0).sum(-1, keepdim=True).log() + peak
    return total.squeeze(-1).transpose(dim, -1)

  def diff(self, n: int = 1, dim: int = -1) -> Tensor:
    """The n-th forward difference along `dim`: x[i + 1] - x[i], applied n times (torch.diff without prepend)."""
    axis = self._axis(dim)
    x = self
    for _ in range(n):
      size = x.shape[axis]
      later = x.shrink([(1, size) if a == axis else None for a in range(x.ndim)])
      earlier = x.shrink([(0, max(size - 1, 0)) if a == axis else None for a in range(x.ndim)])
      x = later != earlier if x.dtype == dtypes.bool else later - earlier
    return x

  @accepts_dim
  def var_mean(self, axis: int | Sequence[int] | None = None, keepdim: bool = False,
               correction: int = 1) -> tuple[Tensor, Tensor]:
    """(var, mean) over `axis`, as torch.var_mean."""
    return self.var(axis, keepdim, correction), self.mean(axis, keepdim)

  @accepts_dim
  def std_mean(self, axis: int | Sequence[int] | None = None, keepdim: bool = False,
               correction: int = 1) -> tuple[Tensor, Tensor]:
    """(std, mean) over `axis`, as torch.std_mean."""
    return self.std(axis, keepdim, correction), self.mean(axis, keepdim)

  @autocast_op(CastPolicy.FLOAT32)
  @accepts_dim
  def norm(self, p: float = 2.0, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    """The vector p-norm over `axis` (all if None): (sum |x|^p)^(1/p); p = inf is the largest |x|."""
    magnitude = self._float_operand().abs()
    if p == math.inf: return magnitude.max(axis, keepdim)
    if p == 2: return magnitude.square().sum(axis, keepdim)._sqrt_flat_at_zero()
    if p == 1: return magnitude.sum(axis, keepdim)
    return (magnitude ** p).sum(axis, keepdim) ** (1 / p)

  # ---------------------------------------------------------------- linear algebra

  def trace(self) -> Tensor:
    """The sum of the main diagonal of a 2-D tensor."""
    if self.ndim != 2: raise ShapeError(f"trace takes a 2-D tensor, got shape {self.shape}")
    return self.diagonal().sum()

  def mm(self, other: Tensor) -> Tensor:
    """Matrix product of two 2-D tensors (torch.mm)."""
    if self.ndim != 2 or other.ndim != 2:
      raise ShapeError(f"mm takes two 2-D tensors, got shapes {self.shape} and {other.shape}; use matmul")
    return self.matmul(other)

  def bmm(self, other: Tensor) -> Tensor:
    """Batched matrix product of two 3-D tensors with the same batch size (torch.bmm)."""
    if self.ndim != 3 or other.ndim != 3 or self.shape[0] != other.shape[0]:
      raise ShapeError(f"bmm takes two 3-D tensors of one batch size, got shapes {self.shape} and {other.shape}")
    return self.matmul(other)

  @autocast_op(CastPolicy.LOWER)
  def baddbmm(self, batch1: Tensor, batch2: Tensor, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """beta * self + alpha * bmm(batch1, batch2) (torch.baddbmm)."""
    return beta * self + alpha * batch1.bmm(batch2)

  @autocast_op(CastPolicy.LOWER)
  def addmm(self, mat1: Tensor, mat2: Tensor, beta: float = 1.0, alpha: float = 1.0) -> Tensor:
    """beta * self + alpha * mm(mat1, mat2) (torch.addmm)."""
    return beta * self + alpha * mat1.mm(mat2)

  def dot(self, other: Tensor) -> Tensor:
    """The same as matmul (torch.dot takes only 1-D tensors)."""
    return self.matmul(other)

  @autocast_op(CastPolicy.LOWER)
  def matmul(self, other: Tensor) -> Tensor:
    """Matrix product with PyTorch's rules for 1-D operands and batch broadcasting: a broadcast multiply and
    a sum over the inner dimension, which the optimizer turns into one tiled kernel."""
    other = self._to_tensor(other)
    if self.ndim == 0 or other.ndim == 0:
      raise ShapeError(f"matmul needs tensors with at least 1 dimension, got shapes {self.shape} and {other.shape}")
    if self.device != other.device:
      raise DeviceError(f"matmul of tensors on {self.device} and {other.device}; move one with .to()")
    x = self.reshape(1, -1) if self.ndim == 1 else self
    y = other.reshape(-1, 1) if other.ndim == 1 else other
    if x.shape[-1] != y.shape[-2]:
      raise ShapeError(f"matmul inner dimensions differ: {self.shape} @ {other.shape} "
                       f"({x.shape[-1]} != {y.shape[-2]})")
    if x.ndim > 2 and other.ndim == 2:
      # (..., m, k) @ (k, n) is one (prod(...) * m, k) @ (k, n) product: one M axis, and in the backward one reduce axis
      # over all rows for the weight's gradient (not one per leading dim), which split-K and tensor cores expect
      return x.reshape(-1, x.shape[-1]).matmul(y).reshape(*x.shape[:-1], y.shape[-1])
    dtype = least_upper_dtype(x.dtype, y.dtype)
    accumulate = dtypes.float32 if dtype in (dtypes.float16, dtypes.bfloat16) else dtype
    if dtype == dtypes.bool: accumulate = dtypes.int32
    x, y = x.cast(accumulate), y.cast(accumulate)
    # x (..., m, 1, k) times y's transpose (..., 1, n, k), summed over k: one Function (its backward's graph as the
    # Tensor ops' would be, without their nine autograd nodes)
    x_rows = x.shape[:-1] + (1, x.shape[-1])
    y_columns = y.shape[:-2] + (1, y.shape[-1], y.shape[-2])
    result = F.Matmul.apply(x, y, shape=_broadcast_shape(x_rows, y_columns))
    result = result.cast(dtype) if dtype != dtypes.bool else (result != 0)
    if self.ndim == 1: result = result.squeeze(-2)
    if other.ndim == 1: result = result.squeeze(-1)
    return result

  @autocast_op(CastPolicy.LOWER)
  def linear(self, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias, with weight of shape (out_features, in_features) as in torch.nn.functional.linear."""
    if _one_linear_node(self, weight, bias):
      return F.Linear.apply(self, weight, *(() if bias is None else (bias,)))
    result = self.matmul(weight.T)
    return result + bias if bias is not None else result

  def outer(self, other: Tensor) -> Tensor:
    """The outer product, shape (self.numel(), other.numel()); unlike torch.outer, inputs of more than one dimension are
    flattened."""
    return self.reshape(-1, 1) * other.reshape(1, -1)

  def triu(self, diagonal: int = 0) -> Tensor:
    """The upper triangle of the last two dimensions (column - row >= diagonal); other elements are 0."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    rows = Tensor.arange(self.shape[-2], device=self.device).reshape(-1, 1)
    cols = Tensor.arange(self.shape[-1], device=self.device).reshape(1, -1)
    return (cols - rows >= diagonal).where(self, 0).cast(self.dtype)

  def tril(self, diagonal: int = 0) -> Tensor:
    """The lower triangle of the last two dimensions (column - row <= diagonal); other elements are 0."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    rows = Tensor.arange(self.shape[-2], device=self.device).reshape(-1, 1)
    cols = Tensor.arange(self.shape[-1], device=self.device).reshape(1, -1)
    return (cols - rows <= diagonal).where(self, 0).cast(self.dtype)
