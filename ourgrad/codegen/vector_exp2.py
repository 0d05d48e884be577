"""exp2 for float32 in plain arithmetic, which a C compiler vectorizes (libm's exp2f is a call per element): the CPU
row kernels' softmax and logsumexp (codegen/row_linearizer.py)."""
from __future__ import annotations

import math

from ourgrad.codegen.uops import UOp, UOpBuilder, UOps
from ourgrad.dtype import DType, dtypes
from ourgrad.ops import Ops

# 2**f for f in [-0.5, 0.5]: the Taylor series of exp(f ln 2) to degree 7 (truncation error < 6e-9, under half an ulp)
_EXP2_COEFFICIENTS = tuple(math.log(2) ** power / math.factorial(power) for power in range(8))


def vector_exp2(build: UOpBuilder, x: UOp) -> UOp:
  """exp2(x) for float32 in plain arithmetic (a C compiler vectorizes it; libm's exp2f is a call per element):
  x = n + f with n = round(x) (x clamped to [-252, 256], beyond which the result is 0 or inf anyway) and |f| <= 0.5,
  2**f by a polynomial, 2**n as two float exponents (n split in halves, so that 2**128 overflows to inf and 2**-140
  underflows gradually, as exp2f does). Within 1 ulp of the rounded exact result; NaN stays NaN.
  Written for gcc's if-conversion: selects on one comparison each, and no float/int conversions (they may trap,
  which keeps a loop with selects from vectorizing): n is rounded by adding 1.5 * 2**23 and read from the bits."""
  f32, i32 = dtypes.float32, dtypes.int32

  def const(value: float, dtype: DType = f32) -> UOp: return build.const(value, dtype)

  def select(condition: UOp, yes: UOp, no: UOp) -> UOp: return build.alu(Ops.WHERE, f32, condition, yes, no)
  low = select(build.alu(Ops.CMPLT, dtypes.bool, const(-252.0), x), x, const(-252.0))
  clamped = select(build.alu(Ops.CMPLT, dtypes.bool, low, const(256.0)), low, const(256.0))
  rounding = 1.5 * 2 ** 23   # adding it rounds a float of magnitude < 2**22 to an integer, kept in the low bits
  shifted = build.alu(Ops.ADD, f32, clamped, const(rounding))
  n = build.alu(Ops.ADD, i32, build.add(UOps.BITCAST, i32, (shifted,)), const(-0x4B400000, i32))
  rounded = build.alu(Ops.ADD, f32, shifted, const(-rounding))
  fraction = build.alu(Ops.ADD, f32, clamped, build.alu(Ops.NEG, f32, rounded))
  power = const(_EXP2_COEFFICIENTS[-1])
  for coefficient in reversed(_EXP2_COEFFICIENTS[:-1]):
    power = build.alu(Ops.ADD, f32, build.alu(Ops.MUL, f32, power, fraction), const(coefficient))
  # n = half + rest, each in [-126, 128]: (n + 256) >> 1 is a shift of a non-negative number
  half = build.alu(Ops.ADD, i32, build.alu(Ops.SHR, i32, build.alu(Ops.ADD, i32, n, const(256, i32)), const(1, i32)),
                   const(-128, i32))
  rest = build.alu(Ops.ADD, i32, n, build.alu(Ops.NEG, i32, half))

  def two_to(exponent: UOp) -> UOp:   # 2**e for e in [-126, 128] (128: inf), from the float's exponent bits
    bits = build.alu(Ops.SHL, i32, build.alu(Ops.ADD, i32, exponent, const(127, i32)), const(23, i32))
    return build.add(UOps.BITCAST, f32, (bits,))
  result = build.alu(Ops.MUL, f32, build.alu(Ops.MUL, f32, power, two_to(half)), two_to(rest))
  return select(build.alu(Ops.CMPNE, dtypes.bool, x, x), x, result)
