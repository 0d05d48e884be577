"""Special functions for Tensor (SpecialMixin): inverse trigonometry (atan, asin, acos, atan2), logit, xlogy,
hypot, erfc, frac, copysign, angle conversions, the NaN-aware comparisons (fmax, fmin, isclose, signbit, ...) and the
NaN-skipping sums.

There is no ATAN primitive. atan halves its argument twice with atan(x) = 2 atan(x / (1 + sqrt(1 + x^2))), which
brings |x| <= 1 down to |t| <= tan(pi/16) ~ 0.2, where 12 terms of the Taylor series are exact to float64's
precision; |x| > 1 goes through atan(x) = +-pi/2 - atan(1/x). asin, acos and atan2 are built on it. Each function
computes its value without a graph and attaches its exact derivative (Tensor._with_derivative in tensor_math.py),
so gradients are right at the special points (asin at +-1 is inf, as in PyTorch).

The methods become Tensor's through `class Tensor(..., SpecialMixin, ...)` in ourgrad/tensor.py.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ourgrad.dtype import dtypes
from ourgrad.tensor_math import _with_derivatives
from ourgrad.mixed_precision import CastPolicy, autocast_op

if TYPE_CHECKING:
  from ourgrad.tensor import Tensor

_ATAN_TERMS = 12


def _atan_small(t: Tensor) -> Tensor:
  """atan for |t| <= 0.2 by its Taylor series, evaluated Horner-style in t^2."""
  square = t * t
  series = t.zeros_like() + (-1) ** (_ATAN_TERMS - 1) / (2 * _ATAN_TERMS - 1)
  for term in range(_ATAN_TERMS - 2, -1, -1): series = series * square + (-1) ** term / (2 * term + 1)
  return series * t


def _atan_value(x: Tensor) -> Tensor:
  """atan of a graph-free tensor: +-pi/2 - atan(1/x) outside [-1, 1], two argument halvings inside."""
  large = x.abs() > 1
  inside = large.where(x.reciprocal(), x)
  for _ in range(2): inside = inside / ((inside * inside + 1).sqrt() + 1)
  small = _atan_small(inside) * 4
  return large.where((x > 0).where(x.full_like(math.pi / 2), -math.pi / 2) - small, small)


class SpecialMixin:
  """Tensor's atan, asin, acos, atan2, logit, xlogy, hypot, erfc, frac, deg2rad/rad2deg, nansum/nanmean."""
  __slots__ = ()

  def atan(self) -> Tensor:
    """The arctangent; gradient 1 / (1 + x^2)."""
    x = self._float_operand()
    value = x.detach()
    return x._with_derivative(_atan_value(value), (value * value + 1).reciprocal())

  @autocast_op(CastPolicy.FLOAT32)
  def asin(self) -> Tensor:
    """The arcsine, NaN outside [-1, 1]: atan(x / sqrt(1 - x^2)); gradient 1 / sqrt(1 - x^2)."""
    x = self._float_operand()
    value = x.detach()
    root = (1 - value * value).sqrt()
    result = (root == 0).where((value > 0).where(value.full_like(math.pi / 2), -math.pi / 2), _atan_value(value / root))
    return x._with_derivative((root != root).where(math.nan, result), root.reciprocal())

  @autocast_op(CastPolicy.FLOAT32)
  def acos(self) -> Tensor:
    """The arccosine, NaN outside [-1, 1]: pi/2 - asin(x); gradient -1 / sqrt(1 - x^2)."""
    x = self._float_operand()
    value = x.detach()
    return x._with_derivative(math.pi / 2 - value.asin(), -(1 - value * value).rsqrt())

  def arctan(self) -> Tensor:
    """The same as atan."""
    return self.atan()

  def arcsin(self) -> Tensor:
    """The same as asin."""
    return self.asin()

  def arccos(self) -> Tensor:
    """The same as acos."""
    return self.acos()

  def atan2(self, other: Any) -> Tensor:
    """The angle of the point (other, self) in (-pi, pi], as C's atan2 (signed zeros and infinities included);
    gradients other / (x^2 + y^2) for self and -self / (x^2 + y^2) for other."""
    y, x = self._broadcasted(other)
    y, x = y._float_operand(), x._float_operand()
    # float16 and bfloat16 compute in float32 and round once (PyTorch's opmath); the result keeps their dtype
    compute = dtypes.float32 if y.dtype in (dtypes.float16, dtypes.bfloat16) else y.dtype
    y_value, x_value = y.detach().cast(compute), x.detach().cast(compute)
    y_negative = (y_value < 0) | (y_value.reciprocal() < 0)  # the reciprocal tells -0.0 from 0.0
    x_negative = (x_value < 0) | (x_value.reciprocal() < 0)
    # constants as tensors of the operands' dtype: a where of two Python floats would be float32
    half_turn = y_negative.where(y_value.full_like(-math.pi), math.pi)
    both_infinite = y_value.isinf() & x_value.isinf()
    # the ratio is 0/0 or inf/inf at these points; the quadrant rule below gives the angle
    ratio = both_infinite.where((y_negative != x_negative).where(y_value.full_like(-1.0), 1.0), y_value / x_value)
    base = _atan_value(ratio)
    angle = x_negative.where(base + half_turn, base)
    zero_over_zero = (y_value == 0) & (x_value == 0)
    angle = zero_over_zero.where(x_negative.where(half_turn, y_value), angle)
    squares = x_value * x_value + y_value * y_value
    at_origin = squares == 0  # PyTorch's gradients are 0 at (0, 0)
    return _with_derivatives(angle.cast(y.dtype), (y, at_origin.where(0.0, x_value / squares)),
                             (x, at_origin.where(0.0, -y_value / squares)))

  def arctan2(self, other: Any) -> Tensor:
    """The same as atan2."""
    return self.atan2(other)

  def hypot(self, other: Any) -> Tensor:
    """sqrt(self^2 + other^2), inf if either is infinite (even with a NaN), as C's hypot."""
    x, y = self._broadcasted(other)
    x, y = x._float_operand(), y._float_operand()
    x_value, y_value = x.detach(), y.detach()
    value = (x_value * x_value + y_value * y_value).sqrt()
    value = (x_value.isinf() | y_value.isinf()).where(math.inf, value)
    return _with_derivatives(value, (x, x_value / value), (y, y_value / value))

  def logit(self, eps: float | None = None) -> Tensor:
    """log(p / (1 - p)), with p clamped to [eps, 1 - eps] when eps is given (then the gradient is 0 outside)."""
    x = self._float_operand()
    value = x.detach()
    p = value.clamp(eps, 1 - eps) if eps is not None else value
    derivative = (p * (1 - p)).abs().reciprocal()  # p (1 - p) >= 0 in the domain; abs makes -0.0 give +inf
    # outside the clamp the gradient is 0; without one it is NaN outside [0, 1], as in PyTorch
    if eps is not None: derivative = ((value < eps) | (value > 1 - eps)).where(0.0, derivative)
    else: derivative = ((value < 0) | (value > 1)).where(math.nan, derivative)
    return x._with_derivative((p / (1 - p)).log(), derivative)

  def xlogy(self, other: Any) -> Tensor:
    """self * log(other), 0 where self is 0 (unless other is NaN), as torch.xlogy."""
    x, y = self._broadcasted(other)
    x, y = x._float_operand(), y._float_operand()
    x_value, y_value = x.detach(), y.detach()
    log_y = y_value.log()
    silent = (x_value == 0) & ~y_value.isnan()
    value = silent.where(0.0, x_value * log_y)
    # PyTorch's gradient for self: log(other), but 0 where self is 0 and other <= 0
    return _with_derivatives(value, (x, ((x_value == 0) & (y_value <= 0)).where(0.0, log_y)),
                             (y, x_value / y_value))

  def erfc(self) -> Tensor:
    """1 - erf(self); gradient -2/sqrt(pi) exp(-x^2). (Absolute accuracy 1.5e-7: not the relative accuracy of C's
    erfc in the far tail.)"""
    return 1 - self.erf()

  def frac(self) -> Tensor:
    """self - trunc(self): the fraction with the sign of self; gradient 1."""
    return self - self.trunc()

  def deg2rad(self) -> Tensor:
    """Degrees to radians."""
    return self._float_operand() * (math.pi / 180)

  def rad2deg(self) -> Tensor:
    """Radians to degrees."""
    return self._float_operand() * (180 / math.pi)

  def logaddexp2(self, other: Any) -> Tensor:
    """log2(2^self + 2^other), computed stably through logaddexp."""
    x, y = self._broadcasted(other)
    return (x._float_operand() * math.log(2)).logaddexp(y._float_operand() * math.log(2)) / math.log(2)

  def fmax(self, other: Any) -> Tensor:
    """The larger of self and other, ignoring a NaN on one side (NaN only where both are), as torch.fmax."""
    x, y = self._broadcasted(other)
    if not x.dtype.is_float: return x.maximum(y)
    return x.isnan().where(y, y.isnan().where(x, x.maximum(y)))

  def fmin(self, other: Any) -> Tensor:
    """The smaller of self and other, ignoring a NaN on one side (NaN only where both are), as torch.fmin."""
    x, y = self._broadcasted(other)
    if not x.dtype.is_float: return x.minimum(y)
    return x.isnan().where(y, y.isnan().where(x, x.minimum(y)))

  def signbit(self) -> Tensor:
    """True where the sign bit is set: negative values, -0.0 and -inf."""
    if not self.dtype.is_float: return self < 0
    return (self < 0) | ((self == 0) & (self.reciprocal() < 0))

  def copysign(self, other: Any) -> Tensor:
    """|self| with the sign of `other` (its sign bit, so -0.0 counts as negative), as torch.copysign; integers and
    bools promote to the default float. The gradient is sign(self) * sign(result) for self (0 where self is 0, as
    in PyTorch) and 0 for other."""
    x, y = self._broadcasted(other)
    x, y = x._float_operand(), y._float_operand()
    x_value = x.detach()
    magnitude = x_value.abs()
    value = y.detach().signbit().where(-magnitude, magnitude)
    return _with_derivatives(value, (x, (x_value == 0).where(0.0, value / x_value)), (y, value.zeros_like()))

  def isposinf(self) -> Tensor:
    """True where the value is +inf."""
    return self == math.inf if self.dtype.is_float else self != self

  def isneginf(self) -> Tensor:
    """True where the value is -inf."""
    return self == -math.inf if self.dtype.is_float else self != self

  def isclose(self, other: Any, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False) -> Tensor:
    """|self - other| <= atol + rtol * |other| elementwise (equal infinities are close), as torch.isclose."""
    x, y = self._broadcasted(other)
    close = (x == y) | ((x - y).abs() <= atol + rtol * y.abs())
    if x.dtype.is_float: close = close & ((x == y) | (x.isfinite() & y.isfinite()))  # inf is close only to itself
    return close | (x.isnan() & y.isnan()) if equal_nan and x.dtype.is_float else close

  def allclose(self, other: Any, rtol: float = 1e-5, atol: float = 1e-8, equal_nan: bool = False) -> bool:
    """True if every element isclose (a realize)."""
    return bool(self.isclose(other, rtol, atol, equal_nan).all().item())

  def equal(self, other: Any) -> bool:
    """True if the shapes match and every element is equal (a realize), as torch.equal."""
    other_tensor = self._to_tensor(other)
    return self.shape == other_tensor.shape and bool((self == other_tensor).all().item())

  def count_nonzero(self, dim: Any = None) -> Tensor:
    """The number of non-zero elements over `dim` (all if None), int64."""
    return (self != 0).sum(dim, dtype=dtypes.int64)

  def nansum(self, axis: Any = None, keepdim: bool = False) -> Tensor:
    """sum, with NaN counted as 0."""
    return self.isnan().where(0, self).sum(axis, keepdim) if self.dtype.is_float else self.sum(axis, keepdim)

  def nanmean(self, axis: Any = None, keepdim: bool = False) -> Tensor:
    """mean of the values that are not NaN (NaN where all are)."""
    if not self.dtype.is_float: return self.mean(axis, keepdim)
    present = ~self.isnan()
    return self.nansum(axis, keepdim) / present.sum(axis, keepdim)
