"""The integer and float numerics of power, remainder and floor division on tensors, as C and PyTorch compute them
(the sign of pow, fmod, floor division's quotient, square-and-multiply integer powers): composites of Tensor ops that
tensor_math.py's `pow`, `%` and `//` call.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ourgrad.dtype import dtypes

if TYPE_CHECKING:
  from ourgrad.tensor import Tensor


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
