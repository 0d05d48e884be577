"""Elementwise math for Tensor (ElementwiseMixin): broadcasting and type promotion, arithmetic and comparison
operators, bitwise and logical ops, unary math and rounding (activations: tensor_activation.py).

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

import functools
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ourgrad import function as F
from ourgrad import function_movement as FM
from ourgrad.function import _lazydata, view_without_gradient
from ourgrad.dtype import DType, dtypes, least_upper_dtype, operands_dtype, result_dtype
from ourgrad.errors import DeviceError, DTypeError, ShapeError
from ourgrad.lazy import LazyBuffer
from ourgrad.ops import Ops
from ourgrad.mixed_precision import CastPolicy, autocast_op

if TYPE_CHECKING:
  from ourgrad.tensor import Tensor


_PY_SCALARS = (bool, int, float)
_new_tensor = _new_function = object.__new__
_BOOL = dtypes.bool


def _broadcast_shape(*shapes: tuple[int, ...]) -> tuple[int, ...]:
  """The shape every input broadcasts to (numpy/PyTorch rules), or ShapeError naming the shapes."""
  if all(shape == shapes[0] for shape in shapes[1:]): return shapes[0]  # the common case, without the walk below
  try:
    return _broadcast_shape_of(shapes)
  except TypeError:   # an unhashable size: not remembered
    return _broadcast_shape_of.__wrapped__(shapes)


@functools.lru_cache(maxsize=1 << 12)
def _broadcast_shape_of(shapes: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
  """_broadcast_shape of differing shapes, remembered: a training step broadcasts the same pairs every step (errors
  are raised again each time: lru_cache keeps only results)."""
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


def _pow_sign(base: Tensor, power: Tensor) -> Tensor:
  """The sign of base ** power by C's pow rules: -1 for a negative base (-0 included) to an odd integer power, NaN
  for a finite negative base to a non-integer power, else 1."""
  negative = (base < 0) | (base.reciprocal() < 0)  # the reciprocal tells -0.0 from 0.0
  is_integer_power = power.floor() == power
  odd = is_integer_power & ((power.abs() % 2) == 1)
  undefined = (base < 0) & ~is_integer_power & ~base.isinf()
  return (negative & odd).where(-1.0, undefined.where(math.nan, 1.0)).cast(base.dtype)


def _float_fmod(x: Tensor, y: Tensor) -> Tensor:
  """C's fmod for floats: x - trunc(x / y) * y, and x itself for a finite x over an infinite y. Exact (as C's fmod,
  which PyTorch uses) for floats narrower than 64 bits: computed in float64, where trunc(x / y) is the true quotient's
  and the product and the difference are exact for quotients below 2**29 (1.0 % 0.1 is 0.099999987, not -1.5e-08).
  float64 operands compute in float64, exact while x / y does not round across an integer."""
  wide = dtypes.float64 if x.dtype.itemsize < 8 else x.dtype
  a, b = x.cast(wide), y.cast(wide)
  remainder = a - (a / b).trunc() * b
  # kernels compute a / b as a * (1 / b): at an exact integer quotient (x % x) it can round to just below or above
  # it, and trunc is one off. C's remainder has the sign of a and is smaller than |b|: step it back there
  toward_a, size = (a < 0).where(-1.0, 1.0).cast(wide), b.abs()
  remainder = ((remainder * toward_a >= 0) & (remainder.abs() >= size)).where(remainder - toward_a * size, remainder)
  remainder = (remainder * toward_a < 0).where(remainder + toward_a * size, remainder)
  remainder = remainder._zero_signed_like(a)   # a zero takes the sign of x, as in C
  return (b.isinf() & a.isfinite()).where(a, remainder).cast(x.dtype)


def _sign_differs(remainder: Tensor, divisor: Tensor) -> Tensor:
  """Where a non-zero C remainder and the divisor differ in sign: Python's % adds the divisor there, // steps down."""
  return (remainder != 0) & ((remainder < 0) != (divisor < 0))


def _float_floor_quotient(x: Tensor, y: Tensor) -> Tensor:
  """PyTorch's x // y for floats (c10's div_floor_floating): floor of the true quotient, from the exact remainder
  (1.0 // 0.1 is 9, as in Python and numpy, though 1.0 / 0.1 rounds to 10). x / y where y is 0; -1 or a zero for a
  finite x over an infinite y; NaN for an infinite x; zero results carry the sign of x / y."""
  # in float64, where (a - remainder) / b is the exact integer for quotients below 2**29 (x / y is x * (1 / y) in
  # kernels: 1e10 / 3 in float32 would round twice); rounded once to x's dtype at the end
  wide = dtypes.float64 if x.dtype.itemsize < 8 else x.dtype
  a, b = x.cast(wide), y.cast(wide)
  remainder = _float_fmod(a, b)
  quotient = (a - remainder) / b
  quotient = _sign_differs(remainder, b).where(quotient - 1, quotient)
  floored = quotient.floor()
  # (a - remainder) / b is an integer up to rounding: round it to the nearest one
  floored = (quotient - floored > 0.5).where(floored + 1, floored)
  exact = a / b
  result = floored._zero_signed_like(exact)   # a zero quotient takes the sign of a / b
  return (b == 0).where(exact, result).cast(x.dtype)


def _integer_pow(base: Tensor, power: Tensor) -> Tensor:
  """base ** power for integer tensors of one dtype and shape, as PyTorch computes it: exact, wrapping on overflow,
  by square-and-multiply over every bit of the exponent's dtype; a negative power gives 1 for base 1, +-1 for base -1
  (by the power's parity) and 0 otherwise."""
  non_negative = power if power.dtype.is_unsigned else (power < 0).where(0, power)
  result, square, remaining = base.ones_like(), base, non_negative
  for _ in range(power.dtype.bits if power.dtype.is_unsigned else power.dtype.bits - 1):
    result = ((remaining & 1) != 0).where(result * square, result)
    square, remaining = square * square, remaining >> 1
  if power.dtype.is_unsigned: return result
  odd = (power & 1) != 0
  reciprocal = (base == 1).where(1, (base == -1).where(odd.where(-1, 1), 0)).cast(base.dtype)
  return (power < 0).where(reciprocal, result)


def _tensors_dtype(*tensors: Tensor) -> DType:
  """The dtype an op over these tensors computes in, as PyTorch's result_type: a 0-d tensor widens the others only
  with a higher category (float16 tensor + 0-d float32 tensor is float16)."""
  return operands_dtype([t.dtype for t in tensors if t.ndim > 0], [t.dtype for t in tensors if t.ndim == 0])


def _with_derivatives(value: Tensor, *inputs_and_derivatives: tuple[Tensor, Tensor]) -> Tensor:
  """`value` (computed from the inputs, detached) whose gradient for each input is its derivative (a tensor of the
  value's shape) times the upstream gradient; the value itself when no input requires a gradient."""
  if not any(tensor.requires_grad for tensor, _ in inputs_and_derivatives): return value
  derivatives = [derivative.cast(value.dtype).expand(value.shape) for _, derivative in inputs_and_derivatives]
  inputs = [tensor.expand(value.shape) for tensor, _ in inputs_and_derivatives]
  return F.WithDerivatives.apply(value, *derivatives, *inputs)


class ElementwiseMixin:
  """Tensor's operators (+ - * / // % ** == < & | ^ ~ ...), unary math and rounding."""
  __slots__ = ()

  # ---------------------------------------------------------------- elementwise plumbing

  def _to_tensor(self, other: Any) -> Tensor:
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    if isinstance(other, Tensor): return other
    if isinstance(other, (bool, int, float, np.generic)) and not isinstance(other, np.ndarray):
      value = other.item() if isinstance(other, np.generic) else other
      return Tensor(LazyBuffer.full(value, (), result_dtype(self.dtype, value), self.device))
    return Tensor(other, device=self.device)

  def _broadcasted(self, other: Any, reverse: bool = False) -> tuple[Tensor, Tensor]:
    """Both operands as tensors of one dtype (promoted) and one shape (broadcast)."""
    mine = self._lazydata
    if type(other) is type(self) and type(mine) is LazyBuffer:
      theirs = other._lazydata
      # two tensors of one shape, dtype and device (most binary ops of a model): nothing to promote or broadcast
      if type(theirs) is LazyBuffer and theirs.dtype is mine.dtype and theirs.device == mine.device:
        x, y = (other, self) if reverse else (self, other)
        if theirs.shape == mine.shape: return x, y
        # one dtype and device, shapes to broadcast (a bias, a per-row statistic): expand's graph without its checks
        shape = _broadcast_shape(x.shape, y.shape)
        return x._broadcast_to(shape), y._broadcast_to(shape)
    if type(other) in _PY_SCALARS and type(mine) is LazyBuffer:
      # a Python scalar (x * 0.9, the learning rates and betas of every step): the constant is made at the tensor's
      # shape at once. The general path below builds the same lazy graph through a Tensor reshape and expand
      # (a float tensor keeps its dtype with any scalar: result_dtype's answer, without its calls)
      dtype = mine.dtype if mine.dtype.is_float else result_dtype(mine.dtype, other)
      x = self if dtype is mine.dtype else self.cast(dtype)
      # (Tensor(lazy)'s slots set here: a constant, which needs no gradient, on x's device)
      constant = _new_tensor(type(self))
      constant._lazydata = LazyBuffer.operand_constant(other, mine.shape, dtype, mine.device)
      constant.requires_grad = constant.grad = constant._ctx = None
      return (constant, x) if reverse else (x, constant)
    other_tensor = self._to_tensor(other)
    if other_tensor.device != self.device:
      raise DeviceError(f"tensors on different devices: {self.device} and {other_tensor.device}; move one with "
                        f".to({self.device!r})")
    x, y = (other_tensor, self) if reverse else (self, other_tensor)
    dtype = x.dtype if x.dtype == y.dtype else _tensors_dtype(x, y)
    shape = _broadcast_shape(x.shape, y.shape)
    return x.cast(dtype).expand(shape), y.cast(dtype).expand(shape)

  def _direct_operation(self, function: type[F.Function], other: Any, reverse: bool) -> Tensor | None:
    """`function` of this float tensor, which needs no gradient, and a Python scalar or a tensor of its shape, dtype
    and device that needs none either (inference: `x + 1`, `x * 0.5`, a residual add), built on lazy buffers as
    Function.apply builds it from `_broadcasted`'s operands (a scalar shared at this tensor's shape and dtype, as a
    float tensor keeps its dtype with any scalar). No Function is kept, so its bookkeeping, the scalar's Tensor and
    the broadcast's checks are left out. None where the general path must decide (another shape or dtype, a
    multi-device or non-float tensor, an operand that needs a gradient)."""
    # (decided on the tensors' own buffers, whose shape, dtype and device every newer version shares: the newest
    # versions are read only for an op that is built here)
    mine = self._lazydata
    if type(mine) is not LazyBuffer or not mine.dtype.is_float: return None
    if type(other) in _PY_SCALARS:
      theirs = LazyBuffer.operand_constant(other, mine.shape, mine.dtype, mine.device)
      # (Function.apply's rule: the scalar's requires_grad is None, so the result's is None unless gradients are off
      # or it is no float)
      requires = None
    elif type(other) is type(self) and not (other_needs := other.requires_grad):
      theirs = other._lazydata
      if type(theirs) is not LazyBuffer or theirs.dtype is not mine.dtype or theirs.shape != mine.shape or \
          theirs.device != mine.device: return None
      theirs = _lazydata(other)
      requires = None if other_needs is None or self.requires_grad is None else False
    else: return None
    lazy = _lazydata(self)
    ctx = _new_function(function)
    output = ctx.forward(theirs, lazy) if reverse else ctx.forward(lazy, theirs)
    result = _new_tensor(type(self))
    result._lazydata, result.grad, result._ctx = output, None, None
    result.requires_grad = False if type(self).no_grad or not output.dtype.is_float else requires
    return result

  def _broadcast_to(self, shape: tuple[int, ...]) -> Tensor:
    """This tensor broadcast to `shape`, a shape _broadcast_shape gave for it: the Functions expand(shape) applies
    (a Reshape where only leading dims are added, else an Expand), without expand's checks of the shape."""
    if self.shape == shape: return self
    padded = (1,) * (len(shape) - len(self.shape)) + self.shape
    if padded == shape:
      viewed = view_without_gradient(self, LazyBuffer.reshape, padded)   # (no gradient needed: no Function)
      return viewed if viewed is not None else FM.Reshape.apply(self, shape=padded)
    viewed = view_without_gradient(self, F._broadcast_to, shape)   # (Expand's forward)
    return viewed if viewed is not None else FM.Expand.apply(self, shape=shape)

  def _float_operand(self) -> Tensor:
    """Float math on ints and bools promotes to the default float, as in PyTorch."""
    return self if self._lazydata.dtype.is_float else self.cast(dtypes.default_float)   # (no dtype property call)

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
    if not self.requires_grad and (result := self._direct_operation(F.Add, other, reverse)) is not None: return result
    x, y = self._broadcasted(other, reverse)
    if x._lazydata.dtype is _BOOL: return x | y   # (Tensor.dtype without the property call: every op)
    return F.Add.apply(x, y)

  def sub(self, other: Any, reverse: bool = False) -> Tensor:
    """self - other (other - self if `reverse`), broadcast and type-promoted; DTypeError for bool tensors."""
    if not reverse and (type(other) is float or type(other) is int) and self._lazydata.dtype is not _BOOL:
      # x - c is x + (-c), the very graph Sub builds (an ADD of the negated constant, folded), without making c first
      # and folding its negation: exact for floats, and for integers modulo the dtype's range as the fold is
      return self.add(-other)
    x, y = self._broadcasted(other, reverse)
    if x._lazydata.dtype is _BOOL:
      raise DTypeError("subtraction of bool tensors is not supported; use ^ or logical_xor")
    return F.Sub.apply(x, y)

  def mul(self, other: Any, reverse: bool = False) -> Tensor:
    """self * other, broadcast and type-promoted; bool * bool is logical and."""
    if not self.requires_grad and (result := self._direct_operation(F.Mul, other, reverse)) is not None: return result
    x, y = self._broadcasted(other, reverse)
    if x._lazydata.dtype is _BOOL: return x & y
    return F.Mul.apply(x, y)

  def div(self, other: Any, reverse: bool = False, rounding_mode: str | None = None) -> Tensor:
    """True division (ints promote to float); rounding_mode "trunc" or "floor" as in torch.div."""
    if rounding_mode is None and not self.requires_grad and \
        (result := self._direct_operation(F.Div, other, reverse)) is not None: return result
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
    if x.dtype.is_float: return _float_floor_quotient(x.detach(), y.detach())
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
    if x.dtype.is_float:
      x_value, y_value = x.detach(), y.detach()
      truncated = _float_fmod(x_value, y_value)
      value = _sign_differs(truncated, y_value).where(truncated + y_value, truncated)
      # torch's gradients: 1 for x, -(x // y) for y
      return _with_derivatives(value, (x, x_value.ones_like()), (y, -_float_floor_quotient(x_value, y_value)))
    if x.dtype == dtypes.bool: raise DTypeError("remainder of bool tensors is not supported")
    remainder = F.IntDiv.apply(x, y, op=Ops.MOD)
    if x.dtype.is_unsigned: return remainder
    adjust = (remainder != 0) & ((remainder < 0) != (y < 0))
    return adjust.where(remainder + y, remainder)

  def fmod(self, other: Any) -> Tensor:
    """Remainder with the sign of the dividend (C's fmod / torch.fmod)."""
    x, y = self._broadcasted(other)
    self._check_divisor(other, x.dtype, "modulo")
    if x.dtype.is_float:
      x_value, y_value = x.detach(), y.detach()
      # torch's gradients: 1 for x, -trunc(x / y) for y
      return _with_derivatives(_float_fmod(x_value, y_value), (x, x_value.ones_like()),
                               (y, -(x_value / y_value).trunc()))
    return F.IntDiv.apply(x, y, op=Ops.MOD)

  @autocast_op(CastPolicy.FLOAT32)
  def pow(self, exponent: Any, reverse: bool = False) -> Tensor:
    """x ** y. Integers to integer powers stay integers, as in PyTorch (exact, wrapping on overflow; a negative Python
    int power of an integer tensor raises DTypeError, a negative tensor power gives 0 except for bases 1 and -1);
    an integer to a float power is a float. Floats follow C's pow (a negative base to an odd integer power is
    negative, to a non-integer one NaN; x ** 0 and 1 ** y are 1) and PyTorch's gradients at every special point
    (function.Pow; docs/gradients.md)."""
    if not reverse and isinstance(exponent, int) and not self.dtype.is_float and exponent < 0:
      raise DTypeError(f"an integer tensor ({self.dtype}) to a negative integer power ({exponent}) is not an integer "
                       f"(PyTorch refuses it too); cast to float first: x.float() ** {exponent}")
    if not reverse and isinstance(exponent, int) and not self.dtype.is_float and exponent >= 0:
      base = self.cast(result_dtype(self.dtype, exponent))   # bool ** 2 is an int, as in PyTorch
      result, power = base.ones_like(), exponent
      while power:  # square-and-multiply: exact for integers
        if power & 1: result = result * base
        base, power = base * base, power >> 1
      return result
    if not reverse and isinstance(exponent, (int, float)) and exponent in (1, 2, 0.5, -0.5, -1):
      # the forms torch also special-cases (the sign of a zero result and of -0.0 ** -0.5 follow from them)
      x = self._float_operand() if exponent in (0.5, -0.5, -1) or isinstance(exponent, float) else self
      if exponent == 1: return x * 1   # a new tensor (folded to x only while x is lazy: lazy.py)
      if exponent == 2: return x * x
      if exponent == 0.5: return x.sqrt()
      if exponent == -0.5:  # torch: rsqrt forward (-inf at -0.0), pow's derivative (-0.5 * x ** -1.5)
        value = x.detach()
        return x._with_derivative(value.rsqrt(), value.pow(-1.5) * -0.5)
      return x.reciprocal()
    base, power = self._broadcasted(exponent, reverse)
    if base.dtype.is_int: return _integer_pow(base, power)
    if not base.dtype.is_float: base, power = base._float_operand(), power._float_operand()
    base_value, power_value = base.detach(), power.detach()
    # exactly 1 (whatever the other side, NaN included): x ** 0, 1 ** y, and (-1) ** +-inf as in C's pow
    def is_one(exponent: Tensor) -> Tensor:
      return (exponent == 0) | (base_value == 1) | ((base_value == -1) & exponent.isinf())
    power_below = power_value - 1
    sign, sign_below = _pow_sign(base_value, power_value), _pow_sign(base_value, power_below)
    return F.Pow.apply(base, power, sign, is_one(power_value), sign_below, is_one(power_below))

  __add__ = add   # (x + y: the method itself, one frame less per op)
  def __radd__(self, other: Any) -> Tensor: return self.add(other, reverse=True)
  __sub__ = sub   # (x - y: the method itself, one frame less per op)
  def __rsub__(self, other: Any) -> Tensor: return self.sub(other, reverse=True)
  __mul__ = mul   # (x * y: the method itself, one frame less per op)
  def __rmul__(self, other: Any) -> Tensor: return self.mul(other, reverse=True)
  def __truediv__(self, other: Any) -> Tensor: return self.div(other)
  @autocast_op(CastPolicy.FLOAT32)
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

  # in place, as PyTorch: written into this tensor's memory (views of it see it), never rebinding the name
  def __iadd__(self, other: Any) -> Tensor: return self._write_result(self + other, "+=")
  def __isub__(self, other: Any) -> Tensor: return self._write_result(self - other, "-=")
  def __imul__(self, other: Any) -> Tensor: return self._write_result(self * other, "*=")
  def __itruediv__(self, other: Any) -> Tensor: return self._write_result(self / other, "/=")
  def __ifloordiv__(self, other: Any) -> Tensor: return self._write_result(self // other, "//=")
  def __imod__(self, other: Any) -> Tensor: return self._write_result(self % other, "%=")
  def __ipow__(self, other: Any) -> Tensor: return self._write_result(self ** other, "**=")
  def __iand__(self, other: Any) -> Tensor: return self._write_result(self & other, "&=")
  def __ior__(self, other: Any) -> Tensor: return self._write_result(self | other, "|=")
  def __ixor__(self, other: Any) -> Tensor: return self._write_result(self ^ other, "^=")
  def __ilshift__(self, other: Any) -> Tensor: return self._write_result(self << other, "<<=")
  def __irshift__(self, other: Any) -> Tensor: return self._write_result(self >> other, ">>=")

  def _write_result(self, result: Tensor, op: str) -> Tensor:
    """`result` written in place into this tensor. As in PyTorch, a result of a higher kind than this tensor's dtype
    (a float into an int tensor, an int into a bool one) is an error, not a silent truncation."""
    def kind(dtype: DType) -> int: return 2 if dtype.is_float else 0 if dtype == dtypes.bool else 1
    if kind(result.dtype) > kind(self.dtype):
      raise DTypeError(f"{op}: result type {result.dtype} can't be cast to the desired output type {self.dtype} "
                       f"(an in-place op keeps the tensor's dtype; compute out of place, or cast first)")
    return self.assign(result)

  # ---------------------------------------------------------------- comparisons and logic

  def __lt__(self, other: Any) -> Tensor: return F.Less.apply(*self._broadcasted(other))
  def __gt__(self, other: Any) -> Tensor: return F.Less.apply(*self._broadcasted(other, reverse=True))
  def __ne__(self, other: Any) -> Tensor: return F.NotEqual.apply(*self._broadcasted(other))  # type: ignore[override]
  def __eq__(self, other: Any) -> Tensor: return F.Equal.apply(*self._broadcasted(other))  # type: ignore[override]
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
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    cond = self if self.dtype == dtypes.bool else self != 0
    if type(x) in _PY_SCALARS and isinstance(y, Tensor): return cond._where_scalar(y, x, scalar_first=True)
    if type(y) in _PY_SCALARS and isinstance(x, Tensor): return cond._where_scalar(x, y, scalar_first=False)
    x_tensor, y_tensor = cond._to_tensor(x), cond._to_tensor(y)
    if isinstance(x, Tensor) and not isinstance(y, Tensor): y_tensor = x_tensor._to_tensor(y)
    if isinstance(y, Tensor) and not isinstance(x, Tensor): x_tensor = y_tensor._to_tensor(x)
    if not isinstance(x, Tensor) and not isinstance(y, Tensor):
      dtype = least_upper_dtype(dtypes.from_py(x), dtypes.from_py(y))
      x_tensor, y_tensor = x_tensor.cast(dtype), y_tensor.cast(dtype)
    x_tensor, y_tensor = x_tensor._broadcasted(y_tensor)
    shape = _broadcast_shape(cond.shape, x_tensor.shape)
    return F.Where.apply(cond.expand(shape), x_tensor.expand(shape), y_tensor.expand(shape))

  def _where_scalar(self, tensor: Tensor, scalar: bool | int | float, scalar_first: bool) -> Tensor:
    """where() of this bool condition between a tensor and a Python number (`mask.where(x, 0)`): the number made at
    the broadcast shape at once, as a shared operand constant (LazyBuffer.operand_constant) of the dtype the tensor
    and the number promote to; the same graph as the general path, without a Tensor and an Expand for the number."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    dtype = result_dtype(tensor.dtype, scalar)
    if dtype is not tensor.dtype: tensor = tensor.cast(dtype)
    shape = _broadcast_shape(self.shape, tensor.shape)
    lazy = tensor._lazydata
    if type(lazy) is not LazyBuffer: constant = Tensor(scalar, dtype=dtype, device=tensor.device).expand(shape)
    else: constant = Tensor(LazyBuffer.operand_constant(scalar, shape, dtype, lazy.device))
    tensor = tensor.expand(shape)
    return F.Where.apply(self.expand(shape), *((constant, tensor) if scalar_first else (tensor, constant)))

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
    """The values limited to [min_, max_] (one bound may be None), as torch.clamp: a value on a bound keeps its
    gradient, NaN stays NaN with a zero gradient. Tensor bounds get the gradient where they win."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    if min_ is None and max_ is None: raise ValueError("clip needs at least one of min and max")
    if isinstance(min_, Tensor) or isinstance(max_, Tensor):
      # one dtype for the value and both bounds, as torch.clamp's result type (an int tensor clamped by int tensors
      # stays an int; a 0-d bound widens only with a higher category)
      operands = [operand for operand in (self, min_, max_) if operand is not None]
      tensors = [operand for operand in operands if isinstance(operand, Tensor)]
      dtype = operands_dtype([t.dtype for t in tensors if t.ndim > 0], [t.dtype for t in tensors if t.ndim == 0],
                             [operand for operand in operands if not isinstance(operand, Tensor)])
      result = self.cast(dtype)
      low, high = (bound.cast(dtype) if isinstance(bound, Tensor) else bound for bound in (min_, max_))
      if not dtype.is_float:
        if low is not None: result = result.maximum(low)
        if high is not None: result = result.minimum(high)
        return result
      # NaN on either side gives NaN and no gradient to either side, as torch.clamp
      nan = result.full_like(math.nan)
      if low is not None: result = (result >= low).where(result, (result < low).where(low, nan))
      if high is not None: result = (result <= high).where(result, (result > high).where(high, nan))
      return result
    value = self.detach()
    result, inside = value, value == value  # NaN is outside every range
    if min_ is not None: result, inside = (result < min_).where(min_, result), inside & (value >= min_)
    if max_ is not None: result, inside = (result > max_).where(max_, result), inside & (value <= max_)
    return self._with_derivative(result, inside.cast(result.dtype)) if result.dtype.is_float else result

  def clamp(self, min: Any = None, max: Any = None) -> Tensor:  # noqa: A002
    """The same as clip (PyTorch's name)."""
    return self.clip(min, max)

  def clamp_min(self, min: Any) -> Tensor:  # noqa: A002
    """clamp(min=min)."""
    return self.clip(min, None)

  def clamp_max(self, max: Any) -> Tensor:  # noqa: A002
    """clamp(max=max)."""
    return self.clip(None, max)

  def addcmul(self, tensor1: Any, tensor2: Any, value: float = 1.0) -> Tensor:
    """self + value * tensor1 * tensor2 (torch.addcmul)."""
    return self + value * (self._to_tensor(tensor1) * tensor2)

  def addcdiv(self, tensor1: Any, tensor2: Any, value: float = 1.0) -> Tensor:
    """self + value * tensor1 / tensor2 (torch.addcdiv)."""
    return self + value * (self._to_tensor(tensor1) / tensor2)

  def masked_fill(self, mask: Tensor, value: Any) -> Tensor:
    """`value` where the bool `mask` (broadcast to this shape) is True, else self; in this tensor's dtype."""
    Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
    if mask.dtype != dtypes.bool: raise DTypeError(f"masked_fill needs a bool mask, got {mask.dtype}")
    fill = value.cast(self.dtype) if isinstance(value, Tensor) else self._to_tensor(value).cast(self.dtype)
    if fill.ndim != 0: raise ShapeError(f"masked_fill takes a number or a 0-d tensor, got shape {fill.shape}")
    shape = _broadcast_shape(self.shape, mask.shape)
    if shape != self.shape:
      raise ShapeError(f"masked_fill mask of shape {mask.shape} does not broadcast to the tensor's {self.shape}")
    return mask.expand(shape).where(fill.expand(shape), self)

  def nan_to_num(self, nan: float = 0.0, posinf: float | None = None, neginf: float | None = None) -> Tensor:
    """NaN replaced by `nan`, +inf by `posinf` and -inf by `neginf` (the dtype's largest and lowest finite values by
    default), as torch.nan_to_num; integer tensors come back unchanged."""
    if not self.dtype.is_float: return self
    finite_max = float(np.finfo(np.float32 if self.dtype == dtypes.bfloat16 else self.dtype.np).max)
    if self.dtype == dtypes.bfloat16: finite_max = 3.3895313892515355e38
    posinf = finite_max if posinf is None else posinf
    neginf = -finite_max if neginf is None else neginf
    result = self.isnan().where(nan, self)
    return (self == math.inf).where(posinf, (self == -math.inf).where(neginf, result))

  # ---------------------------------------------------------------- unary math

  def neg(self) -> Tensor:
    """-self; DTypeError for bool (use ~ or logical_not())."""
    if self.dtype == dtypes.bool: raise DTypeError("negation of a bool tensor; use ~ or logical_not()")
    return F.Neg.apply(self)

  @autocast_op(CastPolicy.FLOAT32)
  def reciprocal(self) -> Tensor:
    """1 / self (integers and bools promote to the default float, as in PyTorch)."""
    return F.Reciprocal.apply(self._float_operand())

  def sqrt(self) -> Tensor:
    """The square root (integers and bools promote to the default float)."""
    return F.Sqrt.apply(self._float_operand())

  @autocast_op(CastPolicy.FLOAT32)
  def rsqrt(self) -> Tensor:
    """1 / sqrt(self) (integers and bools promote to the default float)."""
    return F.Rsqrt.apply(self._float_operand())

  @autocast_op(CastPolicy.FLOAT32)
  def exp(self) -> Tensor:
    """e ** self (integers and bools promote to the default float)."""
    return F.Exp.apply(self._float_operand())

  def exp2(self) -> Tensor:
    """2 ** self (integers and bools promote to the default float)."""
    return F.Exp2.apply(self._float_operand())

  @autocast_op(CastPolicy.FLOAT32)
  def log(self) -> Tensor:
    """The natural logarithm (integers and bools promote to the default float)."""
    return F.Log.apply(self._float_operand())

  @autocast_op(CastPolicy.FLOAT32)
  def log2(self) -> Tensor:
    """The base-2 logarithm (integers and bools promote to the default float)."""
    return F.Log2.apply(self._float_operand())

  @autocast_op(CastPolicy.FLOAT32)
  def log10(self) -> Tensor:
    """The base-10 logarithm, computed as log(self) / ln 10."""
    return self.log() / math.log(10)

  @autocast_op(CastPolicy.FLOAT32)
  def log1p(self) -> Tensor:
    """log(1 + self), accurate for tiny self: log(u) * x / (u - 1) with u = 1 + x rounded cancels the rounding of
    u (Goldberg's trick); the gradient is 1 / (1 + self)."""
    x = self._float_operand()
    value = x.detach()
    u = value + 1
    log_u = u.log()
    corrected = (u == 1).where(value, log_u * (value / (u - 1)))
    return x._with_derivative(u.isinf().where(log_u, corrected), u.reciprocal())

  @autocast_op(CastPolicy.FLOAT32)
  def expm1(self) -> Tensor:
    """exp(self) - 1, accurate for tiny self: (u - 1) * x / log(u) with u = exp(x) (Kahan's trick); the gradient is
    exp(self)."""
    x = self._float_operand()
    value = x.detach()
    u = value.exp()
    corrected = (u == 1).where(value, (u - 1) * (value / u.log()))
    result = (u - 1 == -1).where(-1.0, u.isinf().where(u, corrected))
    return x._with_derivative(result, u)

  def sin(self) -> Tensor:
    """The sine (integers and bools promote to the default float)."""
    return F.Sin.apply(self._float_operand())

  def cos(self) -> Tensor:
    """The cosine, computed as sin(pi/2 - self)."""
    return (math.pi / 2 - self._float_operand()).sin()

  @autocast_op(CastPolicy.FLOAT32)
  def tan(self) -> Tensor:
    """The tangent, computed as sin(self) / cos(self)."""
    return self.sin() / self.cos()

  @autocast_op(CastPolicy.FLOAT32)
  def sinh(self) -> Tensor:
    """The hyperbolic sine, (exp(x) - exp(-x)) / 2; its gradient is cosh."""
    x = self._float_operand()
    value = x.detach()
    up, down = value.exp(), (-value).exp()
    return x._with_derivative((up - down) / 2, (up + down) / 2)

  @autocast_op(CastPolicy.FLOAT32)
  def cosh(self) -> Tensor:
    """The hyperbolic cosine, (exp(x) + exp(-x)) / 2; its gradient is sinh."""
    x = self._float_operand()
    value = x.detach()
    up, down = value.exp(), (-value).exp()
    return x._with_derivative((up + down) / 2, (up - down) / 2)

  def asinh(self) -> Tensor:
    """The inverse hyperbolic sine, log(|x| + sqrt(x^2 + 1)) with the sign of x; gradient 1 / sqrt(x^2 + 1)."""
    x = self._float_operand()
    value = x.detach()
    magnitude = value.abs()
    positive = (magnitude + (magnitude * magnitude + 1).sqrt()).log()
    return x._with_derivative((value < 0).where(-positive, positive), (value * value + 1).rsqrt())

  def acosh(self) -> Tensor:
    """The inverse hyperbolic cosine, log(x + sqrt(x^2 - 1)), NaN below 1; gradient 1 / sqrt(x^2 - 1)."""
    x = self._float_operand()
    value = x.detach()
    root = (value * value - 1).sqrt()
    return x._with_derivative((value + (value < 1).where(math.nan, root)).log(), root.reciprocal())

  def atanh(self) -> Tensor:
    """The inverse hyperbolic tangent, log((1 + x) / (1 - x)) / 2, NaN outside [-1, 1]; gradient 1 / (1 - x^2)."""
    x = self._float_operand()
    value = x.detach()
    return x._with_derivative(((1 + value) / (1 - value)).log() / 2, (1 - value * value).reciprocal())

  def square(self) -> Tensor:
    """self * self, in this tensor's dtype (bool squares to default_int, as pow(x, 2) in PyTorch)."""
    x = self.cast(dtypes.default_int) if self.dtype == dtypes.bool else self
    return x * x

  def abs(self) -> Tensor:
    """The absolute value, in this tensor's dtype (bool and unsigned tensors come back unchanged)."""
    if self.dtype == dtypes.bool or self.dtype.is_unsigned: return self
    return self.relu() + (-self).relu() if self.dtype.is_float else (self < 0).where(-self, self)

  def sign(self) -> Tensor:
    """-1, 0 or 1 by the sign of each element (0 for NaN, as torch on the CPU), in this tensor's dtype; the gradient
    is zero."""
    if self.dtype == dtypes.bool: return self
    value = self.detach()
    signs = (value < 0).where(-1, (value > 0).where(1, value.zeros_like())).cast(self.dtype)
    return self._zero_gradient(signs)

  def _with_derivative(self, value: Tensor, derivative: Tensor) -> Tensor:
    """`value` (computed from this tensor, detached) whose gradient is `derivative` times the upstream one."""
    return _with_derivatives(value, (self, derivative))

  def _zero_gradient(self, value: Tensor) -> Tensor:
    """`value` (computed from this tensor, detached) with a zero gradient for this tensor: the derivative of a step
    function, as PyTorch gives for sign, floor, ceil, round and trunc."""
    return F.ZeroGradient.apply(self, value) if self.requires_grad else value

  def _zero_signed_like(self, value: Tensor) -> Tensor:
    """This result with a zero taking the sign of `value`, as C's trunc/floor/ceil/nearbyint/fmod (and PyTorch)
    give it: ceil(-0.5) is -0.0. value * 0 is that zero (value is finite wherever these give 0)."""
    return (self == 0).where(value * 0, self)

  def _round_toward_zero(self) -> Tensor:
    """Drop the fraction, keeping values too large for int64 (which are integers already) as they are."""
    truncated = self.cast(dtypes.int64).cast(self.dtype)
    return (self.abs() < 2.0 ** 52).where(truncated, self)

  def trunc(self) -> Tensor:
    """Each value rounded toward zero, in this tensor's dtype (integers unchanged); the gradient is zero."""
    if not self.dtype.is_float: return self
    value = self.detach()
    return self._zero_gradient(value._round_toward_zero()._zero_signed_like(value))

  def floor(self) -> Tensor:
    """Each value rounded down, in this tensor's dtype (integers unchanged); the gradient is zero."""
    if not self.dtype.is_float: return self
    value = self.detach()
    truncated = value._round_toward_zero()
    return self._zero_gradient((truncated > value).where(truncated - 1, truncated)._zero_signed_like(value))

  def ceil(self) -> Tensor:
    """Each value rounded up, in this tensor's dtype (integers unchanged); the gradient is zero."""
    if not self.dtype.is_float: return self
    value = self.detach()
    truncated = value._round_toward_zero()
    return self._zero_gradient((truncated < value).where(truncated + 1, truncated)._zero_signed_like(value))

  def round(self) -> Tensor:
    """Round half to even, as torch.round; the gradient is zero."""
    if not self.dtype.is_float: return self
    value = self.detach()
    floor = value.floor()
    diff = value - floor
    floor_is_even = (floor / 2).floor() * 2 == floor
    up = (diff > 0.5) | ((diff == 0.5) & ~floor_is_even)
    return self._zero_gradient(up.where(floor + 1, floor)._zero_signed_like(value))

  def lerp(self, end: Any, weight: Any) -> Tensor:
    """Linear interpolation toward `end`: self + weight * (end - self) for weight < 0.5, else
    end - (end - self) * (1 - weight), PyTorch's two forms (exact at weight 0 and 1)."""
    start, end = self._broadcasted(end)
    start, end = start._float_operand(), end._float_operand()
    weight = start._to_tensor(weight).cast(start.dtype)
    difference = end - start
    return (weight.abs() < 0.5).where(start + weight * difference, end - difference * (1 - weight))

  def logaddexp(self, other: Any) -> Tensor:
    """log(exp(self) + exp(other)) without overflow: max + log(1 + exp(-|self - other|)); equal infinities give
    themselves. The gradients are exp(self - result) and exp(other - result)."""
    x, y = self._broadcasted(other)
    x, y = x._float_operand(), y._float_operand()
    x_value, y_value = x.detach(), y.detach()
    peak = x_value.maximum(y_value)
    result = peak + ((-(x_value - y_value).abs()).exp() + 1).log()
    result = ((x_value == y_value) & x_value.isinf()).where(x_value, result)
    # torch's form: 1 / (1 + exp(other - self)), NaN where both are the same infinity
    return _with_derivatives(result, (x, ((y_value - x_value).exp() + 1).reciprocal()),
                             (y, ((x_value - y_value).exp() + 1).reciprocal()))

  def isnan(self) -> Tensor:
    """A bool tensor, True where the value is NaN."""
    return self != self

  def isinf(self) -> Tensor:
    """A bool tensor, True where the value is +inf or -inf."""
    return (self == math.inf) | (self == -math.inf)

  def isfinite(self) -> Tensor:
    """A bool tensor, True where the value is neither NaN nor infinite."""
    return ~(self.isnan() | self.isinf())
