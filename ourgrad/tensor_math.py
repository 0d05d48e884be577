"""Elementwise math for Tensor (ElementwiseMixin): broadcasting and type promotion, arithmetic and comparison
operators, bitwise and logical ops, unary math, activations and rounding.

Every binary op goes through `_broadcasted`, which turns a Python number into a tensor of the tensor's dtype
unless the number is of a higher kind (ourgrad/dtype.py `result_dtype`: bool tensor + int gives int32, where
PyTorch gives int64), promotes both operands to one dtype and broadcasts them to one shape. Float math on
integer and bool tensors promotes to the default float, as in PyTorch. Composite functions (tanh, gelu, erf,
floor, round, ...) are built from the primitives in ourgrad/function.py, so they fuse into one kernel with their
neighbours.

The methods become Tensor's through `class Tensor(..., ElementwiseMixin, ...)` in ourgrad/tensor.py; this module
does not import that one at load time (it imports this one), so methods that make a Tensor import the class
when called.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ourgrad import function as F
from ourgrad.dtype import DType, dtypes, least_upper_dtype, result_dtype
from ourgrad.errors import DeviceError, DTypeError, ShapeError
from ourgrad.lazy import LazyBuffer
from ourgrad.ops import Ops

if TYPE_CHECKING:
  from ourgrad.tensor import Tensor


def _broadcast_shape(*shapes: tuple[int, ...]) -> tuple[int, ...]:
  """The shape every input broadcasts to (numpy/PyTorch rules), or ShapeError naming the shapes."""
  ndim = max(len(shape) for shape in shapes)
  padded = [(1,) * (ndim - len(shape)) + shape for shape in shapes]
  result = []
  for sizes in zip(*padded):
    non_one = {size for size in sizes if size != 1}
    if len(non_one) > 1:
      raise ShapeError(f"shapes {' and '.join(str(shape) for shape in shapes)} cannot be broadcast together: "
                       f"sizes {sorted(non_one)} meet in one dimension")
    result.append(non_one.pop() if non_one else 1)
  return tuple(result)


class ElementwiseMixin:
  """Tensor's operators (+ - * / // % ** == < & | ^ ~ ...), unary math, activations and rounding."""
  __slots__ = ()

  # ---------------------------------------------------------------- elementwise plumbing

  def _to_tensor(self, other: Any) -> Tensor:
    from ourgrad.tensor import Tensor
    if isinstance(other, Tensor): return other
    if isinstance(other, (bool, int, float, np.generic)) and not isinstance(other, np.ndarray):
      value = other.item() if isinstance(other, np.generic) else other
      return Tensor(LazyBuffer.full(value, (), result_dtype(self.dtype, value), self.device))
    return Tensor(other, device=self.device)

  def _broadcasted(self, other: Any, reverse: bool = False) -> tuple[Tensor, Tensor]:
    """Both operands as tensors of one dtype (promoted) and one shape (broadcast)."""
    other_tensor = self._to_tensor(other)
    if other_tensor.device != self.device:
      raise DeviceError(f"tensors on different devices: {self.device} and {other_tensor.device}; move one with "
                        f".to({self.device!r})")
    x, y = (other_tensor, self) if reverse else (self, other_tensor)
    dtype = least_upper_dtype(x.dtype, y.dtype)
    shape = _broadcast_shape(x.shape, y.shape)
    return x.cast(dtype).expand(shape), y.cast(dtype).expand(shape)

  def _float_operand(self) -> Tensor:
    """Float math on ints and bools promotes to the default float, as in PyTorch."""
    return self if self.dtype.is_float else self.cast(dtypes.default_float)

  def _check_integer(self, name: str) -> None:
    if self.dtype.is_float:
      raise DTypeError(f"{name} is only defined for integer and bool tensors, got {self.dtype}")

  @staticmethod
  def _check_divisor(divisor: Any, dtype: DType, name: str) -> None:
    """Integer division by a Python zero raises here, as in PyTorch. Kernels cannot raise: an integer division by a
    zero inside a tensor divisor gives 0 (PyTorch raises on the CPU)."""
    if not dtype.is_float and isinstance(divisor, (int, np.integer)) and divisor == 0:
      raise ZeroDivisionError(f"integer {name} by zero ({dtype}); use a float tensor to get inf/nan")

  # ---------------------------------------------------------------- arithmetic

  def add(self, other: Any, reverse: bool = False) -> Tensor:
    """self + other (other + self if `reverse`), broadcast and type-promoted; bool + bool is logical or; no `alpha`
    argument."""
    x, y = self._broadcasted(other, reverse)
    if x.dtype == dtypes.bool: return x | y
    return F.Add.apply(x, y)

  def sub(self, other: Any, reverse: bool = False) -> Tensor:
    """self - other (other - self if `reverse`), broadcast and type-promoted; DTypeError for bool tensors."""
    x, y = self._broadcasted(other, reverse)
    if x.dtype == dtypes.bool: raise DTypeError("subtraction of bool tensors is not supported; use ^ or logical_xor")
    return F.Sub.apply(x, y)

  def mul(self, other: Any, reverse: bool = False) -> Tensor:
    """self * other, broadcast and type-promoted; bool * bool is logical and."""
    x, y = self._broadcasted(other, reverse)
    if x.dtype == dtypes.bool: return x & y
    return F.Mul.apply(x, y)

  def div(self, other: Any, reverse: bool = False, rounding_mode: str | None = None) -> Tensor:
    """True division (ints promote to float); rounding_mode "trunc" or "floor" as in torch.div."""
    x, y = self._broadcasted(other, reverse)
    if rounding_mode is not None and not reverse: self._check_divisor(other, x.dtype, "division")
    if rounding_mode == "floor": return x.floor_divide(y)
    if rounding_mode == "trunc":
      if not x.dtype.is_float: return F.IntDiv.apply(x, y, op=Ops.IDIV)
      return F.Div.apply(x, y).trunc()
    if rounding_mode is not None:
      raise ValueError(f"rounding_mode must be None, 'trunc' or 'floor', got {rounding_mode}")
    return F.Div.apply(x._float_operand(), y._float_operand())

  def floor_divide(self, other: Any, reverse: bool = False) -> Tensor:
    """a // b rounding toward minus infinity (PyTorch and Python semantics)."""
    x, y = self._broadcasted(other, reverse)
    if not reverse: self._check_divisor(other, x.dtype, "division")
    if x.dtype.is_float: return F.Div.apply(x, y).floor()
    if x.dtype == dtypes.bool: raise DTypeError("floor division of bool tensors is not supported")
    quotient = F.IntDiv.apply(x, y, op=Ops.IDIV)
    remainder = F.IntDiv.apply(x, y, op=Ops.MOD)
    # C truncates toward zero: step down where the remainder is non-zero and the signs differ
    if x.dtype.is_unsigned: return quotient
    adjust = (remainder != 0) & ((remainder < 0) != (y < 0))
    return adjust.where(quotient - 1, quotient)

  def remainder(self, other: Any, reverse: bool = False) -> Tensor:
    """a % b with the sign of b (PyTorch's remainder and Python's %)."""
    x, y = self._broadcasted(other, reverse)
    if not reverse: self._check_divisor(other, x.dtype, "modulo")
    if x.dtype.is_float: return x - (x / y).floor() * y
    if x.dtype == dtypes.bool: raise DTypeError("remainder of bool tensors is not supported")
    remainder = F.IntDiv.apply(x, y, op=Ops.MOD)
    if x.dtype.is_unsigned: return remainder
    adjust = (remainder != 0) & ((remainder < 0) != (y < 0))
    return adjust.where(remainder + y, remainder)

  def fmod(self, other: Any) -> Tensor:
    """Remainder with the sign of the dividend (C's fmod / torch.fmod)."""
    x, y = self._broadcasted(other)
    self._check_divisor(other, x.dtype, "modulo")
    if x.dtype.is_float: return x - (x / y).trunc() * y
    return F.IntDiv.apply(x, y, op=Ops.MOD)

  def pow(self, exponent: Any, reverse: bool = False) -> Tensor:
    """x ** y. Integer tensors to non-negative integer powers stay integers; otherwise float math with the
    sign of negative bases handled for integer exponents, as in PyTorch."""
    if not reverse and isinstance(exponent, int) and not self.dtype.is_float and exponent >= 0:
      result, base, power = self.ones_like(), self, exponent
      while power:  # square-and-multiply: exact for integers
        if power & 1: result = result * base
        base, power = base * base, power >> 1
      return result
    if not reverse and isinstance(exponent, (int, float)) and exponent in (0, 1, 2, 0.5, -1):
      x = self._float_operand() if exponent in (0.5, -1) or isinstance(exponent, float) else self
      if exponent == 0: return x.ones_like()
      if exponent == 1: return x
      if exponent == 2: return x * x
      if exponent == 0.5: return x.sqrt()
      return x.reciprocal()
    base, power = self._broadcasted(exponent, reverse)
    if not base.dtype.is_float: base, power = base._float_operand(), power._float_operand()
    magnitude = (power * base.abs().log()).exp()
    # a negative base with an odd integer power is negative; with a non-integer power it is NaN
    is_integer_power = power.floor() == power
    odd = is_integer_power & ((power.abs() % 2) == 1)
    signed = ((base < 0) & odd).where(-magnitude, magnitude)
    nan_case = (base < 0) & ~is_integer_power
    result = nan_case.where(math.nan, signed)
    return ((power == 0) | (base == 1)).where(1.0, result)

  def __add__(self, other: Any) -> Tensor: return self.add(other)
  def __radd__(self, other: Any) -> Tensor: return self.add(other, reverse=True)
  def __sub__(self, other: Any) -> Tensor: return self.sub(other)
  def __rsub__(self, other: Any) -> Tensor: return self.sub(other, reverse=True)
  def __mul__(self, other: Any) -> Tensor: return self.mul(other)
  def __rmul__(self, other: Any) -> Tensor: return self.mul(other, reverse=True)
  def __truediv__(self, other: Any) -> Tensor: return self.div(other)
  def __rtruediv__(self, other: Any) -> Tensor: return self.div(other, reverse=True)
  def __floordiv__(self, other: Any) -> Tensor: return self.floor_divide(other)
  def __rfloordiv__(self, other: Any) -> Tensor: return self.floor_divide(other, reverse=True)
  def __mod__(self, other: Any) -> Tensor: return self.remainder(other)
  def __rmod__(self, other: Any) -> Tensor: return self.remainder(other, reverse=True)
  def __pow__(self, other: Any) -> Tensor: return self.pow(other)
  def __rpow__(self, other: Any) -> Tensor: return self.pow(other, reverse=True)
  def __matmul__(self, other: Tensor) -> Tensor: return self.matmul(other)
  def __rmatmul__(self, other: Tensor) -> Tensor: return self._to_tensor(other).matmul(self)
  def __neg__(self) -> Tensor: return self.neg()
  def __abs__(self) -> Tensor: return self.abs()
  def __pos__(self) -> Tensor: return self

  def __iadd__(self, other: Any) -> Tensor: return self.assign(self + other)
  def __isub__(self, other: Any) -> Tensor: return self.assign(self - other)
  def __imul__(self, other: Any) -> Tensor: return self.assign(self * other)
  def __itruediv__(self, other: Any) -> Tensor: return self.assign(self / other)

  # ---------------------------------------------------------------- comparisons and logic

  def __lt__(self, other: Any) -> Tensor: return F.Less.apply(*self._broadcasted(other))
  def __gt__(self, other: Any) -> Tensor: return F.Less.apply(*self._broadcasted(other, reverse=True))
  def __ne__(self, other: Any) -> Tensor: return F.NotEqual.apply(*self._broadcasted(other))  # type: ignore[override]
  def __eq__(self, other: Any) -> Tensor: return (self != other).logical_not()  # type: ignore[override]
  # not `~(a > b)`: every comparison with NaN is False
  def __le__(self, other: Any) -> Tensor: return (self < other) | (self == other)
  def __ge__(self, other: Any) -> Tensor: return (self > other) | (self == other)

  def eq(self, other: Any) -> Tensor:
    """self == other elementwise, broadcast, as a bool tensor."""
    return self == other

  def ne(self, other: Any) -> Tensor:
    """self != other elementwise, broadcast, as a bool tensor."""
    return self != other

  def lt(self, other: Any) -> Tensor:
    """self < other elementwise, broadcast, as a bool tensor."""
    return self < other

  def gt(self, other: Any) -> Tensor:
    """self > other elementwise, broadcast, as a bool tensor."""
    return self > other

  def le(self, other: Any) -> Tensor:
    """self <= other elementwise, broadcast, as a bool tensor (False where either side is NaN)."""
    return self <= other

  def ge(self, other: Any) -> Tensor:
    """self >= other elementwise, broadcast, as a bool tensor (False where either side is NaN)."""
    return self >= other

  def _bitwise(self, other: Any, op: Ops, name: str, reverse: bool = False) -> Tensor:
    x, y = self._broadcasted(other, reverse)
    x._check_integer(name)
    return F.BitwiseOp.apply(x, y, op=op)

  def bitwise_and(self, other: Any) -> Tensor:
    """self & other elementwise for integer and bool tensors (DTypeError for floats)."""
    return self._bitwise(other, Ops.AND, "bitwise and (&)")

  def bitwise_or(self, other: Any) -> Tensor:
    """self | other elementwise for integer and bool tensors (DTypeError for floats)."""
    return self._bitwise(other, Ops.OR, "bitwise or (|)")

  def bitwise_xor(self, other: Any) -> Tensor:
    """self ^ other elementwise for integer and bool tensors (DTypeError for floats)."""
    return self._bitwise(other, Ops.XOR, "bitwise xor (^)")

  def bitwise_not(self) -> Tensor:
    """~self: every bit flipped for integers, logical not for bool (DTypeError for floats)."""
    self._check_integer("bitwise not (~)")
    if self.dtype == dtypes.bool: return self.logical_not()
    return self.bitwise_xor(-1 if not self.dtype.is_unsigned else self.dtype.max)

  def __and__(self, other: Any) -> Tensor: return self.bitwise_and(other)
  def __rand__(self, other: Any) -> Tensor: return self._bitwise(other, Ops.AND, "bitwise and (&)", reverse=True)
  def __or__(self, other: Any) -> Tensor: return self.bitwise_or(other)
  def __ror__(self, other: Any) -> Tensor: return self._bitwise(other, Ops.OR, "bitwise or (|)", reverse=True)
  def __xor__(self, other: Any) -> Tensor: return self.bitwise_xor(other)
  def __rxor__(self, other: Any) -> Tensor: return self._bitwise(other, Ops.XOR, "bitwise xor (^)", reverse=True)
  def __invert__(self) -> Tensor: return self.bitwise_not()

  def __lshift__(self, shift: Any) -> Tensor: return self._bitwise(shift, Ops.SHL, "left shift (<<)")
  def __rshift__(self, shift: Any) -> Tensor: return self._bitwise(shift, Ops.SHR, "right shift (>>)")

  def logical_not(self) -> Tensor:
    """A bool tensor, True where this one is zero (False)."""
    return F.NotEqual.apply(*self._broadcasted(True)) if self.dtype == dtypes.bool else (self == 0)

  def logical_and(self, other: Any) -> Tensor:
    """A bool tensor, True where both self and other are non-zero."""
    return self.bool() & self._to_tensor(other).bool()

  def logical_or(self, other: Any) -> Tensor:
    """A bool tensor, True where self or other is non-zero."""
    return self.bool() | self._to_tensor(other).bool()

  def logical_xor(self, other: Any) -> Tensor:
    """A bool tensor, True where exactly one of self and other is non-zero."""
    return self.bool() ^ self._to_tensor(other).bool()

  def where(self, x: Any, y: Any) -> Tensor:
    """self ? x : y, broadcasting all three (self is the condition)."""
    from ourgrad.tensor import Tensor
    cond = self if self.dtype == dtypes.bool else self != 0
    x_tensor, y_tensor = cond._to_tensor(x), cond._to_tensor(y)
    if isinstance(x, Tensor) and not isinstance(y, Tensor): y_tensor = x_tensor._to_tensor(y)
    if isinstance(y, Tensor) and not isinstance(x, Tensor): x_tensor = y_tensor._to_tensor(x)
    if not isinstance(x, Tensor) and not isinstance(y, Tensor):
      dtype = least_upper_dtype(dtypes.from_py(x), dtypes.from_py(y))
      x_tensor, y_tensor = x_tensor.cast(dtype), y_tensor.cast(dtype)
    x_tensor, y_tensor = x_tensor._broadcasted(y_tensor)
    shape = _broadcast_shape(cond.shape, x_tensor.shape)
    return F.Where.apply(cond.expand(shape), x_tensor.expand(shape), y_tensor.expand(shape))

  def maximum(self, other: Any) -> Tensor:
    """The larger of self and other elementwise, broadcast and type-promoted."""
    x, y = self._broadcasted(other)
    return F.Maximum.apply(x, y)

  def minimum(self, other: Any) -> Tensor:
    """The smaller of self and other elementwise, broadcast and type-promoted."""
    x, y = self._broadcasted(other)
    if x.dtype == dtypes.bool: return x & y
    if not x.dtype.is_float: return ~F.Maximum.apply(~x, ~y)  # ~ reverses integer order without overflow
    return -F.Maximum.apply(-x, -y)

  def clip(self, min_: Any = None, max_: Any = None) -> Tensor:
    """The values limited to [min_, max_] (one bound may be None); a value on a bound keeps its gradient, as in
    torch.clamp."""
    if min_ is None and max_ is None: raise ValueError("clip needs at least one of min and max")
    # where, not maximum/minimum: a value on a bound keeps its whole gradient, as in torch.clamp
    result = self
    if min_ is not None: result = (result < min_).where(min_, result)
    if max_ is not None: result = (result > max_).where(max_, result)
    return result

  def clamp(self, min: Any = None, max: Any = None) -> Tensor:  # noqa: A002
    """The same as clip (PyTorch's name)."""
    return self.clip(min, max)

  # ---------------------------------------------------------------- unary math

  def neg(self) -> Tensor:
    """-self; DTypeError for bool (use ~ or logical_not())."""
    if self.dtype == dtypes.bool: raise DTypeError("negation of a bool tensor; use ~ or logical_not()")
    return F.Neg.apply(self)

  def reciprocal(self) -> Tensor:
    """1 / self (integers and bools promote to the default float, as in PyTorch)."""
    return F.Reciprocal.apply(self._float_operand())

  def sqrt(self) -> Tensor:
    """The square root (integers and bools promote to the default float)."""
    return F.Sqrt.apply(self._float_operand())

  def rsqrt(self) -> Tensor:
    """1 / sqrt(self)."""
    return self.sqrt().reciprocal()

  def exp(self) -> Tensor:
    """e ** self (integers and bools promote to the default float)."""
    return F.Exp.apply(self._float_operand())

  def exp2(self) -> Tensor:
    """2 ** self, computed as exp(self * ln 2)."""
    return F.Exp.apply(self._float_operand() * math.log(2))

  def log(self) -> Tensor:
    """The natural logarithm (integers and bools promote to the default float)."""
    return F.Log.apply(self._float_operand())

  def log2(self) -> Tensor:
    """The base-2 logarithm, computed as log(self) / ln 2."""
    return self.log() / math.log(2)

  def log10(self) -> Tensor:
    """The base-10 logarithm, computed as log(self) / ln 10."""
    return self.log() / math.log(10)

  def log1p(self) -> Tensor:
    """log(1 + self), computed as written: less precise than torch.log1p for tiny self."""
    return (self._float_operand() + 1).log()

  def expm1(self) -> Tensor:
    """exp(self) - 1, computed as written: less precise than torch.expm1 for tiny self."""
    return self.exp() - 1

  def sin(self) -> Tensor:
    """The sine (integers and bools promote to the default float)."""
    return F.Sin.apply(self._float_operand())

  def cos(self) -> Tensor:
    """The cosine, computed as sin(pi/2 - self)."""
    return (math.pi / 2 - self._float_operand()).sin()

  def tan(self) -> Tensor:
    """The tangent, computed as sin(self) / cos(self)."""
    return self.sin() / self.cos()

  def square(self) -> Tensor:
    """self * self, in this tensor's dtype."""
    return self * self

  def abs(self) -> Tensor:
    """The absolute value, in this tensor's dtype (bool and unsigned tensors come back unchanged)."""
    if self.dtype == dtypes.bool or self.dtype.is_unsigned: return self
    return self.relu() + (-self).relu() if self.dtype.is_float else (self < 0).where(-self, self)

  def sign(self) -> Tensor:
    """-1, 0 or 1 by the sign of each element, in this tensor's dtype; NaN gives 0 (torch gives NaN)."""
    if self.dtype == dtypes.bool: return self
    zero = self.zeros_like()
    return (self < 0).where(-1, (self > 0).where(1, zero)).cast(self.dtype)

  def relu(self) -> Tensor:
    """max(self, 0), in this tensor's dtype (a bool tensor comes back unchanged)."""
    if self.dtype == dtypes.bool: return self
    return F.Relu.apply(self) if self.dtype.is_float else self.maximum(0)

  def sigmoid(self) -> Tensor:
    """1 / (1 + exp(-self)) (integers and bools promote to the default float)."""
    return F.Sigmoid.apply(self._float_operand())

  def tanh(self) -> Tensor:
    """The hyperbolic tangent, computed as 2 * sigmoid(2 * self) - 1."""
    return 2.0 * (2.0 * self._float_operand()).sigmoid() - 1.0

  def silu(self) -> Tensor:
    """self * sigmoid(self)."""
    return self * self.sigmoid()

  def swish(self) -> Tensor:
    """The same as silu."""
    return self.silu()

  def relu6(self) -> Tensor:
    """min(max(self, 0), 6)."""
    return self.relu().minimum(6)

  def hardsigmoid(self) -> Tensor:
    """clip(self / 6 + 0.5, 0, 1)."""
    return (self / 6 + 0.5).clip(0, 1)

  def hardswish(self) -> Tensor:
    """self * relu6(self + 3) / 6."""
    return self * (self + 3).relu6() / 6

  def hardtanh(self, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    """self clipped to [min_val, max_val]."""
    return self.clip(min_val, max_val)

  def mish(self) -> Tensor:
    """self * tanh(softplus(self))."""
    return self * self.softplus().tanh()

  def leaky_relu(self, negative_slope: float = 0.01) -> Tensor:
    """self where it is >= 0, else self * negative_slope."""
    return (self < 0).where(self * negative_slope, self)

  def elu(self, alpha: float = 1.0) -> Tensor:
    """self where it is positive, else alpha * (exp(self) - 1)."""
    return self.relu() - alpha * (1 - self.exp()).relu()

  def celu(self, alpha: float = 1.0) -> Tensor:
    """max(self, 0) + min(alpha * (exp(self / alpha) - 1), 0)."""
    return self.maximum(0) + (alpha * ((self / alpha).exp() - 1)).minimum(0)

  def selu(self) -> Tensor:
    """scale * elu(self, alpha) with PyTorch's constants alpha = 1.6733 and scale = 1.0507."""
    alpha, scale = 1.6732632423543772, 1.0507009873554805
    return scale * (self.relu() - alpha * (1 - self.exp()).relu())

  def softplus(self, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """log(1 + exp(beta*x)) / beta, linear above `threshold` (PyTorch's numerically safe form)."""
    scaled = self._float_operand() * beta
    safe = (scaled.minimum(threshold).exp() + 1).log() / beta
    return (scaled > threshold).where(self._float_operand(), safe)

  def gelu(self, approximate: str = "none") -> Tensor:
    """Gaussian error linear unit: exact (erf) by default, "tanh" for the approximation."""
    x = self._float_operand()
    if approximate == "tanh": return 0.5 * x * (1 + (math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)).tanh())
    return 0.5 * x * (1 + (x / math.sqrt(2)).erf())

  def erf(self) -> Tensor:
    """Error function (Abramowitz-Stegun 7.1.26 refined: max abs error ~1.5e-7)."""
    x = self._float_operand()
    t = 1.0 / (1.0 + 0.3275911 * x.abs())
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return x.sign() * (1.0 - poly * (-(x * x)).exp())

  def _round_toward_zero(self) -> Tensor:
    """Drop the fraction, keeping values too large for int64 (which are integers already) as they are."""
    truncated = self.cast(dtypes.int64).cast(self.dtype)
    # detached: rounding has a zero gradient everywhere, as in PyTorch
    return (self.abs() < 2.0 ** 52).where(truncated, self.detach())

  def trunc(self) -> Tensor:
    """Each value rounded toward zero, in this tensor's dtype (integers unchanged); the gradient is zero."""
    return self._round_toward_zero() if self.dtype.is_float else self

  def floor(self) -> Tensor:
    """Each value rounded down, in this tensor's dtype (integers unchanged); the gradient is zero."""
    if not self.dtype.is_float: return self
    truncated = self.trunc()
    return (truncated > self).where(truncated - 1, truncated)

  def ceil(self) -> Tensor:
    """Each value rounded up, in this tensor's dtype (integers unchanged); the gradient is zero."""
    if not self.dtype.is_float: return self
    truncated = self.trunc()
    return (truncated < self).where(truncated + 1, truncated)

  def round(self) -> Tensor:
    """Round half to even, as torch.round."""
    if not self.dtype.is_float: return self
    floor = self.floor()
    diff = self - floor
    floor_is_even = (floor / 2).floor() * 2 == floor
    up = (diff > 0.5) | ((diff == 0.5) & ~floor_is_even)
    return up.where(floor + 1, floor)

  def lerp(self, end: Tensor, weight: Any) -> Tensor:
    """self + (end - self) * weight: linear interpolation toward `end`."""
    return self + (end - self) * weight

  def isnan(self) -> Tensor:
    """A bool tensor, True where the value is NaN."""
    return self != self

  def isinf(self) -> Tensor:
    """A bool tensor, True where the value is +inf or -inf."""
    return (self == math.inf) | (self == -math.inf)

  def isfinite(self) -> Tensor:
    """A bool tensor, True where the value is neither NaN nor infinite."""
    return ~(self.isnan() | self.isinf())
