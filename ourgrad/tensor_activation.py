"""Activation functions for Tensor (ActivationMixin): relu, sigmoid, tanh, silu, gelu, elu, softplus, ... and erf.

Each is written from the elementwise primitives of tensor_math.py, so it fuses into its neighbours; where the
composed form would differentiate badly (a kink, a saturated tail) the value carries its own derivative
(`_with_derivative`, `_zero_gradient` of ElementwiseMixin).

The methods become Tensor's through `class Tensor(ActivationMixin, ...)` in ourgrad/tensor.py; this module does not
import that one (it imports this one).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ourgrad import function as F
from ourgrad.dtype import dtypes
from ourgrad.lazy import LazyBuffer
from ourgrad.ops import Ops
from ourgrad.mixed_precision import CastPolicy, autocast_op

# 16-bit floats whose composed activations compute in float32 and round once (PyTorch's opmath)
HALF_FLOATS = (dtypes.float16, dtypes.bfloat16)

if TYPE_CHECKING:
  from ourgrad.tensor import Tensor


def _gelu_tanh_lazy(value: LazyBuffer, k: float, c: float) -> tuple[LazyBuffer, LazyBuffer]:
  """(value * s, s + 2k value s (1 - s) (1 + 3c value^2)) with s = sigmoid(2k (value + c value^3)): the tanh GELU
  and its derivative as `gelu` writes them with Tensor ops on the detached input, built op for op on its lazy buffer
  (the same graph and kernels, without ~20 Functions of which none is recorded: a GPT-2 eager step has one a block)."""
  def scalar(number: float) -> LazyBuffer:   # a Python number as Tensor's operators make it, at the value's shape
    return LazyBuffer.operand_constant(number, value.shape, value.dtype, value.device)

  def times(a: LazyBuffer, b: LazyBuffer) -> LazyBuffer: return a.elementwise(Ops.MUL, b)
  cubed = times(times(times(scalar(c), value), value), value)
  s = F._sigmoid(times(scalar(2 * k), value.elementwise(Ops.ADD, cubed)))
  slope = times(times(times(scalar(2 * k), value), s), F._sub(scalar(1), s))
  curve = scalar(1).elementwise(Ops.ADD, times(times(scalar(3 * c), value), value))
  return times(value, s), s.elementwise(Ops.ADD, times(slope, curve))


class ActivationMixin:
  """Tensor's activation functions."""
  __slots__ = ()

  def relu(self) -> Tensor:
    """max(self, 0), in this tensor's dtype (a bool tensor comes back unchanged)."""
    dtype = self._lazydata.dtype   # (no dtype property call: every relu)
    if dtype.is_float: return F.Relu.apply(self)
    return self if dtype is dtypes.bool else self.maximum(0)

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
    """min(max(self, 0), 6): hardtanh(0, 6)."""
    return self.hardtanh(0.0, 6.0)

  def hardsigmoid(self) -> Tensor:
    """clip(self / 6 + 0.5, 0, 1); the gradient is 1/6 strictly inside (-3, 3), else 0 (NaN included), as in torch."""
    x = self._float_operand()
    value = x.detach()
    inside = (value > -3) & (value < 3)
    return x._with_derivative((value / 6 + 0.5).clip(0, 1), inside.where(value.full_like(1 / 6), 0.0))

  def hardswish(self) -> Tensor:
    """self * relu6(self + 3) / 6; the gradient is 0 up to -3, x/3 + 1/2 inside (-3, 3), else 1 (NaN included)."""
    x = self._float_operand()
    value = x.detach()
    slope = (value <= -3).where(0.0, (value < 3).where(value / 3 + 0.5, 1.0))
    return x._with_derivative(value * (value + 3).clip(0, 6) / 6, slope)

  def hardtanh(self, min_val: float = -1.0, max_val: float = 1.0) -> Tensor:
    """self clipped to [min_val, max_val]; unlike clamp, the gradient is 0 on the bounds (as in torch). Integer
    tensors stay integers, as in PyTorch."""
    if self.dtype.is_int: return self.clip(min_val, max_val).cast(self.dtype)
    x = self._float_operand()
    value = x.detach()
    outside = (value <= min_val) | (value >= max_val)
    return x._with_derivative(value.clip(min_val, max_val), outside.where(0.0, 1.0))

  def softsign(self) -> Tensor:
    """self / (1 + |self|)."""
    x = self._float_operand()
    return x / (1 + x.abs())

  @autocast_op(CastPolicy.NATIVE)
  def logsigmoid(self) -> Tensor:
    """log(sigmoid(self)), computed stably as min(x, 0) - log(1 + exp(-|x|)); the gradient is sigmoid(-x)."""
    x = self._float_operand()
    value = x.detach()
    return x._with_derivative(value.minimum(0) - ((-value.abs()).exp() + 1).log(), (-value).sigmoid())

  @autocast_op(CastPolicy.NATIVE)
  def mish(self) -> Tensor:
    """self * tanh(softplus(self))."""
    return self * self.softplus().tanh()

  def leaky_relu(self, negative_slope: float = 0.01) -> Tensor:
    """self where it is > 0, else self * negative_slope (also the slope at 0 and at NaN, as in torch)."""
    x = self._float_operand()
    value = x.detach()
    positive = value > 0
    slope = positive.where(1.0, value.full_like(negative_slope))
    return x._with_derivative(positive.where(value, value * negative_slope), slope)

  @autocast_op(CastPolicy.NATIVE)
  def _exponential_linear(self, scale: float, alpha: float, inner: float) -> Tensor:
    """scale * (x if x > 0 else alpha * (exp(x * inner) - 1)): elu, celu and selu. The gradient takes the
    exponential branch at 0 and the linear one at NaN, as torch's elu_backward does."""
    x = self._float_operand()
    value = x.detach()
    exponential = (value * inner).exp()
    negative = value <= 0
    result = negative.where(alpha * (exponential - 1), value) * scale
    return x._with_derivative(result, negative.where(exponential * (scale * alpha * inner), scale))

  def elu(self, alpha: float = 1.0) -> Tensor:
    """self where it is positive, else alpha * (exp(self) - 1)."""
    return self._exponential_linear(1.0, alpha, 1.0)

  def celu(self, alpha: float = 1.0) -> Tensor:
    """max(self, 0) + min(alpha * (exp(self / alpha) - 1), 0)."""
    return self._exponential_linear(1.0, alpha, 1.0 / alpha)

  def selu(self) -> Tensor:
    """scale * elu(self, alpha) with PyTorch's constants alpha = 1.6733 and scale = 1.0507."""
    return self._exponential_linear(1.0507009873554805, 1.6732632423543772, 1.0)

  @autocast_op(CastPolicy.FLOAT32)
  def softplus(self, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """log(1 + exp(beta*x)) / beta, linear above `threshold` (PyTorch's numerically safe form); the gradient is
    sigmoid(beta * x) below the threshold and 1 above."""
    x = self._float_operand()
    value = x.detach()
    scaled = value * beta
    linear = scaled > threshold
    safe = (scaled.minimum(threshold).exp() + 1).log() / beta
    return x._with_derivative(linear.where(value, safe), linear.where(1.0, scaled.sigmoid()))

  @autocast_op(CastPolicy.NATIVE)
  def gelu(self, approximate: str = "none") -> Tensor:
    """Gaussian error linear unit: exact (erf) by default, "tanh" for the approximation. float16/bfloat16 compute in
    float32 and round once, as PyTorch's opmath: its constants and the tanh rounded to 8 bits moved a bf16 GELU
    off torch's by up to an ulp, and the mid-way rounding cost the GPU's bf16 GELU instructions."""
    x = self._float_operand()
    if x.dtype in HALF_FLOATS: return x.float().gelu(approximate).cast(x.dtype)
    if approximate == "tanh":
      # 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = k (x + c x^3); the derivative sigmoid(2u) + 2k x s (1 - s) (1 + 3c x^2)
      # (1 - tanh(u)^2 = 4 s (1 - s)) written out: autograd of the composed form was ~50 SASS instructions an element
      # of GPT-2's bf16 GELU backward, and 1 + tanh(u) cancels far below zero
      value, k, c = x.detach(), math.sqrt(2 / math.pi), 0.044715
      if type(x._lazydata) is LazyBuffer:
        result, derivative = _gelu_tanh_lazy(x._lazydata, k, c)
        Tensor = type(self)  # noqa: N806 (the concrete class; mixins never import it)
        return x._with_derivative(Tensor(result, requires_grad=False), Tensor(derivative, requires_grad=False))
      s = (2 * k * (value + c * value * value * value)).sigmoid()
      return x._with_derivative(value * s, s + 2 * k * value * s * (1 - s) * (1 + 3 * c * value * value))
    return 0.5 * x * (1 + (x / math.sqrt(2)).erf())

  @autocast_op(CastPolicy.NATIVE)
  def erf(self) -> Tensor:
    """Error function (Abramowitz-Stegun 7.1.26 refined: max abs error ~1.5e-7); the gradient is the exact
    2 / sqrt(pi) * exp(-x^2)."""
    x = self._float_operand()
    value = x.detach()
    t = 1.0 / (1.0 + 0.3275911 * value.abs())
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    result = value.sign() * (1.0 - poly * (-(value * value)).exp())
    return x._with_derivative(result, (-(value * value)).exp() * (2 / math.sqrt(math.pi)))
