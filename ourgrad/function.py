"""One autograd Function per primitive: `forward` and `backward` are both written with LazyBuffer ops,
so the backward graph is lazy and fuses into kernels like the forward one.

`Function.apply(*tensors, **kwargs)` runs forward and, when a gradient is needed, records itself as the
result's `_ctx` so `Tensor.backward` can walk back. Backward returns one gradient per input (None where
that input needs none). The movement Functions (views, indexed reads) are in `function_movement.py`.
"""
from __future__ import annotations

import functools
import math
import operator
from typing import TYPE_CHECKING, Any

from ourgrad.dtype import DType, dtypes
from ourgrad.lazy import LazyBuffer
from ourgrad.lazy_moves import composed_view
from ourgrad.lazy_reduce import reduce_product
from ourgrad.lazy_views import Storage
from ourgrad.mixed_precision import store_low_precision
from ourgrad.ops import (
  ADD, AND, CMPLT, CMPNE, EXP2, LOG2, MAX, MAX_REDUCE, MUL, NEG, OR, Ops, PYTHON_ALU, RECIP, SIN, SQRT, SUM, WHERE)

if TYPE_CHECKING:
  from ourgrad.tensor import Tensor


# ourgrad.tensor imports this module, so Tensor is imported on first use; remembered, since an import statement in
# apply would cost every op a module lookup
_TENSOR_CLASS: Any = None


def _tensor_class() -> Any:
  global _TENSOR_CLASS
  from ourgrad.tensor import Tensor
  _TENSOR_CLASS = Tensor
  return Tensor


# the attributes every Function sets for autograd itself (Function.__init__): never values its backward reads
_BOOKKEEPING = frozenset(("device", "needs_input_grad", "requires_grad", "parents", "parent_ctxs", "versions_seen"))


class Function:
  """Base class: subclasses define forward(*lazybuffers, **kwargs) and backward(grad_output). `apply` makes the
  instance without calling __init__ (one frame less for every op), so subclasses keep their state in forward and do
  not define __init__."""

  def __init__(self, device: str, *tensors: Tensor):
    _record_inputs(self, device, tensors)

  def __init_subclass__(cls, **kwargs: Any) -> None:
    super().__init_subclass__(**kwargs)
    if "__init__" in cls.__dict__:
      raise TypeError(f"{cls.__name__} defines __init__, which Function.apply does not call: keep what forward needs "
                      f"in forward (self.x = ...)")

  def forward(self, *args: Any, **kwargs: Any) -> LazyBuffer: raise NotImplementedError
  def backward(self, grad_output: LazyBuffer) -> Any: raise NotImplementedError

  def saved_values(self) -> list[LazyBuffer]:
    """The values backward reads (every LazyBuffer the forward kept), which must not have been written in place
    since (Tensor.backward checks them, as PyTorch's version counters do)."""
    saved = []
    for name, value in vars(self).items():
      if name in _BOOKKEEPING: continue   # (the inputs' tensors and flags: hundreds of items per step, none saved)
      for item in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(item, LazyBuffer): saved.append(item)
    return saved

  @classmethod
  def apply(cls, *tensors: Tensor, **kwargs: Any) -> Tensor:
    Tensor = _TENSOR_CLASS or _tensor_class()  # noqa: N806 (the class)
    ctx = _new_function(cls)
    # the inputs' values read by a Python call (_lazydata) and forward called with its arguments listed, where it can
    # be (one input, or two without keywords: most ops): a property read through map, or a call with *args and
    # **kwargs, re-enters the interpreter from C, which costs as much as the rest of this function. Whether a
    # gradient is needed is decided first: the bookkeeping is written only for a Function that is kept
    count = len(tensors)
    if count == 1:
      requires = tensors[0].requires_grad
      if requires: _record(ctx, tensors, [True])
      source = _lazydata(tensors[0])
      output = ctx.forward(source, **kwargs) if kwargs else ctx.forward(source)
    elif count == 2 and not kwargs:
      first, second = tensors
      first_needs, second_needs = first.requires_grad, second.requires_grad
      if first_needs or second_needs:   # (True, None or False each: one of them True)
        requires = True
        _record(ctx, tensors, [first_needs, second_needs])
      else: requires = None if first_needs is None or second_needs is None else False
      source = _lazydata(first)
      output = ctx.forward(source, _lazydata(second))
    else:
      needs = list(map(_requires_grad_of, tensors))
      requires = True if True in needs else None if None in needs else False
      if requires: _record(ctx, tensors, needs)
      source = tensors[0]._lazydata
      output = ctx.forward(*map(_lazydata_of, tensors), **kwargs)
    # integer and bool results (comparisons, casts to int) carry no gradient, as in PyTorch; under no_grad() nothing
    # is recorded and the result does not require grad (PyTorch's rule: a later backward() through it raises instead
    # of silently doing nothing)
    if requires is not False and (Tensor.no_grad or not output.dtype.is_float): requires = False
    if type(output) is LazyBuffer and output.device == source.device:
      # the result of nearly every op: a tensor around `output` as it is. Its four slots set here cost a fraction of
      # Tensor.__init__'s checks (none applies: one device, no dtype change, a gradient only for floats)
      result = _new_tensor(Tensor)
      result._lazydata, result.requires_grad, result.grad = output, requires, None
      result._ctx = ctx if requires else None
      return result
    # (a forward may have set the device: Shard)
    result = Tensor(output, device=vars(ctx).get("device", source.device), requires_grad=requires)
    if requires: result._ctx = ctx
    return result


def _record(ctx: Function, tensors: tuple[Tensor, ...], needs: list[bool | None]) -> None:
  """The bookkeeping of a Function that is kept (an input needs a gradient), before its forward runs: the device, which
  inputs need a gradient, and the inputs with the Functions they have now (an in-place write may give an input tensor
  a new one later: assign); `versions_seen`: no in-place write since (the count unchanged at backward) means nothing
  it saves can have gone stale."""
  ctx.device, ctx.needs_input_grad, ctx.requires_grad = tensors[0]._lazydata.device, needs, True
  ctx.parents, ctx.parent_ctxs, ctx.versions_seen = tensors, tuple(map(_ctx_of, tensors)), Storage.versions_made


_new_function = _new_tensor = object.__new__
# per-input reads through map (C), not list comprehensions: each comprehension is one more Python frame per op built
_lazydata_of = operator.attrgetter("lazydata")   # (Tensor.lazydata: the newest version of the tensor's memory)
_requires_grad_of = operator.attrgetter("requires_grad")


def _lazydata(tensor: Tensor) -> LazyBuffer | Any:
  """tensor.lazydata (its newest version), the property's common case written out: a tensor whose base has no newer
  version and that is no constant's storage holds its value as it is."""
  lazy = tensor._lazydata
  if type(lazy) is LazyBuffer and ((lazy._base or lazy)._storage is not None or lazy._const is not None):
    return tensor.lazydata
  return lazy
_ctx_of = operator.attrgetter("_ctx")


def view_without_gradient(tensor: Tensor, move: Any, arg: Any) -> Tensor | None:
  """`move(lazy, arg)` (a LazyBuffer movement method: reshape, permute, expand, shrink) of a tensor that needs no
  gradient, as its movement Function's forward makes it, in a tensor as Function.apply makes it without keeping the
  Function (one input: the result's requires_grad is the input's, False for no_grad or a non-float). None for a
  tensor that needs one or is on several devices: the caller applies the Function."""
  requires = tensor.requires_grad
  if requires or type(tensor._lazydata) is not LazyBuffer: return None
  output = move(_lazydata(tensor), arg)
  Tensor = type(tensor)  # noqa: N806 (the class)
  result = _new_tensor(Tensor)
  result._lazydata, result.grad, result._ctx = output, None, None
  result.requires_grad = False if Tensor.no_grad or not output.dtype.is_float else requires
  return result


def _record_inputs(ctx: Function, device: str, tensors: tuple[Tensor, ...]) -> None:
  """A new Function's autograd bookkeeping: its device, which inputs need a gradient, and, when one does, the inputs
  with the Functions they have now (an in-place write may give an input tensor a new one later: assign)."""
  ctx.device = device
  ctx.needs_input_grad = needs = list(map(_requires_grad_of, tensors))
  ctx.requires_grad = True if True in needs else None if None in needs else False
  if ctx.requires_grad:
    ctx.parents = tensors
    ctx.parent_ctxs = tuple(map(_ctx_of, tensors))
    # no in-place write since (the count unchanged at backward): nothing it saves can have gone stale
    ctx.versions_seen = Storage.versions_made


# ---------------------------------------------------------------- lazy helpers used by the backward passes

# A constant a backward reads only as an operand (relu's 0, where's zeros) is `operand_like`: one shared LazyBuffer per
# (value, dtype, device, shape), made once for all steps; `const_like` (a new one, a tensor's storage) only where the
# constant is itself a gradient handed on.



def _sub(a: LazyBuffer, b: LazyBuffer) -> LazyBuffer: return a.elementwise(ADD, b.elementwise(NEG))
def _mul(a: LazyBuffer, b: LazyBuffer) -> LazyBuffer: return a.elementwise(MUL, b)
def _div(a: LazyBuffer, b: LazyBuffer) -> LazyBuffer: return a.elementwise(MUL, _reciprocal(b))


def _reciprocal(x: LazyBuffer) -> LazyBuffer:
  """1 / x. A float constant's (a mean's divisor, dividing every step's gradient) is the value the constant fold
  makes, as a shared operand constant (made once) instead of a new constant per op."""
  if type(x) is LazyBuffer and x.dtype.is_float:
    value = x.const_value()
    if value is not None: return x.operand_like(PYTHON_ALU[RECIP](value))
  return x.elementwise(RECIP)
def _scale(a: LazyBuffer, factor: float) -> LazyBuffer: return a.elementwise(MUL, a.operand_like(factor))


def _where(cond: LazyBuffer, a: LazyBuffer, b: LazyBuffer) -> LazyBuffer:
  return cond.elementwise(WHERE, a, b)


def _not(mask: LazyBuffer) -> LazyBuffer: return mask.elementwise(CMPNE, mask.operand_like(True))
def _equal(a: LazyBuffer, b: LazyBuffer) -> LazyBuffer: return _not(a.elementwise(CMPNE, b))


def _where_equal(x: LazyBuffer, y: LazyBuffer, a: LazyBuffer, b: LazyBuffer) -> LazyBuffer:
  """a where x == y, else b: the select on x != y with its branches swapped (one compare; `_equal` is two). The same
  values for every x and y, NaN included (x == y is false exactly where x != y is true)."""
  return x.elementwise(CMPNE, y).elementwise(WHERE, b, a)


def _widen(x: LazyBuffer) -> LazyBuffer:
  """float16/bfloat16 as float32: their exp, log and sigmoid compute in float32 and round once, as in PyTorch. In 11
  (or 8) bits the constant 1/ln 2 and the scaled argument would each be rounded: several ulps off for large |x|."""
  return x.cast(dtypes.float32) if x.dtype in _NARROW_FLOATS else x


_NARROW_FLOATS = (dtypes.float16, dtypes.bfloat16)


def _widened(x: LazyBuffer, op: Ops) -> LazyBuffer:
  """The unary `op` of x, computed in float32 for float16/bfloat16 and rounded once (_widen's rule, one call)."""
  if x.dtype in _NARROW_FLOATS: return x.cast(dtypes.float32).elementwise(op).cast(x.dtype)
  return x.elementwise(op)


def _exp(x: LazyBuffer) -> LazyBuffer:
  """e ** x (Exp's forward, and composites built on lazy buffers: Tensor.logsumexp, softmax)."""
  return _scale(_widen(x), 1 / math.log(2)).elementwise(EXP2).cast(x.dtype)


def _log(x: LazyBuffer) -> LazyBuffer:
  """The natural logarithm of x (Log's forward, and composites built on lazy buffers)."""
  return _scale(_widen(x).elementwise(LOG2), math.log(2)).cast(x.dtype)


def _broadcast_to(x: LazyBuffer, shape: tuple[int, ...]) -> LazyBuffer:
  """x broadcast to `shape` as Expand's forward does it (size-1 dims put in front first, then the expand)."""
  if len(shape) != len(x.shape): x = x.reshape((1,) * (len(shape) - len(x.shape)) + x.shape)
  return x.expand(shape)


def _sum_to_shape(grad: LazyBuffer, shape: tuple[int, ...]) -> LazyBuffer:
  """The gradient of a value broadcast from `shape` (`_broadcast_to`): `grad` summed over the broadcast axes, in one
  reduce, and reshaped to `shape` where dims were added."""
  try:
    axes, added = _broadcast_axes(grad.shape, shape)
  except TypeError:   # (a shape that does not hash: not remembered)
    axes, added = _broadcast_axes.__wrapped__(grad.shape, shape)
  summed = grad.reduce(SUM, axes)
  return summed.reshape(shape) if added else summed


@functools.lru_cache(maxsize=1024)
def _broadcast_axes(broadcast: tuple[int, ...], shape: tuple[int, ...]) -> tuple[tuple[int, ...], bool]:
  """(the axes along which `shape` was broadcast to `broadcast`, whether dims were added in front): remembered, as
  every linear layer's and broadcast operand's backward asks the same few every step."""
  padded = (1,) * (len(broadcast) - len(shape)) + shape
  return tuple(axis for axis, (old, new) in enumerate(zip(padded, broadcast)) if old != new), padded != shape


# ---------------------------------------------------------------- unary

class Contiguous(Function):
  def forward(self, x: LazyBuffer) -> LazyBuffer: return x.contiguous()
  def backward(self, grad_output: LazyBuffer) -> LazyBuffer: return grad_output


class Clone(Function):
  def forward(self, x: LazyBuffer) -> LazyBuffer: return x.clone()
  def backward(self, grad_output: LazyBuffer) -> LazyBuffer: return grad_output


class Cast(Function):
  def forward(self, x: LazyBuffer, dtype: DType, bitcast: bool = False) -> LazyBuffer:
    self.input_dtype, self.bitcast = x.dtype, bitcast
    self.input_computed = not x.is_realized   # (is_realized: a MultiLazyBuffer has no single base)
    return x.cast(dtype, bitcast)

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer:
    if self.bitcast: raise RuntimeError("bitcast is not differentiable")
    # the gradient of a narrowing cast of a computed value (a matmul's float32 sum rounded to bfloat16, autocast's
    # cast of an activation) arrives in the low type: stored there (half the bytes, a low-precision matmul operand),
    # widened by its readers. Not for a stored input's cast (a float32 weight): its gradient is widened in the kernel
    # that computes it, straight into the float32 master gradient
    if self.input_computed and self.input_dtype.itemsize > grad_output.dtype.itemsize:
      store_low_precision(grad_output)
    return grad_output.cast(self.input_dtype)


class Neg(Function):
  def forward(self, x: LazyBuffer) -> LazyBuffer: return x.elementwise(NEG)
  def backward(self, grad_output: LazyBuffer) -> LazyBuffer: return grad_output.elementwise(NEG)


class Reciprocal(Function):
  def forward(self, x: LazyBuffer) -> LazyBuffer:
    self.result = x.elementwise(RECIP)
    return self.result

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer:
    return _mul(grad_output.elementwise(NEG), _mul(self.result, self.result))


class Sin(Function):
  def forward(self, x: LazyBuffer) -> LazyBuffer:
    self.x = x
    return x.elementwise(SIN)

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer:
    cos_x = _sub(self.x.const_like(math.pi / 2), self.x).elementwise(SIN)
    return _mul(cos_x, grad_output)


class Relu(Function):
  def forward(self, x: LazyBuffer) -> LazyBuffer:
    self.result = x.elementwise(MAX, x.operand_like(0))
    return self.result

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer:
    # the result is >= 0 or NaN: the gradient passes where it is not 0 (at NaN too, as in torch)
    passes = self.result.elementwise(CMPNE, self.result.operand_like(0))
    return _mul(passes.cast(grad_output.dtype), grad_output)


class Log(Function):
  def forward(self, x: LazyBuffer) -> LazyBuffer:
    self.x = x
    return _log(x)

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer: return _div(grad_output, self.x)


class Log2(Function):
  """log2(x): one LOG2 (log(x) / ln 2 would scale by ln 2 and back, rounding twice)."""

  def forward(self, x: LazyBuffer) -> LazyBuffer:
    self.x = x
    return _widened(x, LOG2)

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer: return _scale(_div(grad_output, self.x), 1 / math.log(2))


class Exp(Function):
  def forward(self, x: LazyBuffer) -> LazyBuffer:
    self.result = _exp(x)
    return self.result

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer: return _mul(self.result, grad_output)


class Exp2(Function):
  """2 ** x: one EXP2 (exp(x * ln 2) would round x * ln 2 and scale it back in the kernel)."""

  def forward(self, x: LazyBuffer) -> LazyBuffer:
    self.result = _widened(x, EXP2)
    return self.result

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer: return _scale(_mul(self.result, grad_output), math.log(2))


class Sqrt(Function):
  def forward(self, x: LazyBuffer) -> LazyBuffer:
    self.result = x.elementwise(SQRT)
    return self.result

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer: return _div(grad_output, _scale(self.result, 2))


class Rsqrt(Function):
  """1 / sqrt(x), whose gradient is read off its result (-0.5 * result^3, as PyTorch's rsqrt_backward): a LayerNorm's
  backward then multiplies by the stored per-row rsqrt. As Reciprocal(Sqrt(x)) the backward read sqrt(x), and every
  kernel of it divided by it per element (H200, GPT-2's LayerNorm weight+bias partial sums: 12.0 us, now 9.4)."""

  def forward(self, x: LazyBuffer) -> LazyBuffer:
    self.result = x.elementwise(SQRT).elementwise(RECIP)
    return self.result

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer:
    return _scale(_mul(grad_output, _mul(self.result, _mul(self.result, self.result))), -0.5)


class ZeroGradient(Function):
  """`value` as computed, with a zero gradient for `x`: the derivative of a step function (sign, floor, round, ...)
  is zero almost everywhere, and PyTorch gives zeros rather than refusing backward."""

  def forward(self, x: LazyBuffer, value: LazyBuffer) -> LazyBuffer:
    self.input_shape = x.shape
    return value

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer, None]:
    return grad_output.const_like(0).expand(self.input_shape), None


class WithDerivatives(Function):
  """`value` as computed, with closed-form partial derivatives: apply(value, d_1, ..., d_n, x_1, ..., x_n) gives
  x_i the gradient d_i * upstream. The value and the derivatives are elementwise functions of the x_i computed
  without a graph; this is for composite ops whose autograd through the pieces would be wrong at special points
  (0 * inf through a `where` branch that was not taken) or would cost more than the closed form."""

  def forward(self, value: LazyBuffer, *derivatives_and_inputs: LazyBuffer) -> LazyBuffer:
    self.derivatives = derivatives_and_inputs[:len(derivatives_and_inputs) // 2]
    return value

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, ...]:
    count = len(self.derivatives)
    input_grads = tuple(_mul(derivative, grad_output) if needed else None
                        for derivative, needed in zip(self.derivatives, self.needs_input_grad[count + 1:]))
    return (None,) * (count + 1) + input_grads


def _sigmoid(x: LazyBuffer) -> LazyBuffer:
  """1 / (1 + exp(-x)) on a lazy buffer (Sigmoid's forward, and composites built on lazy buffers: GELU)."""
  exp_neg = _scale(_widen(x), -1 / math.log(2)).elementwise(EXP2)
  return exp_neg.operand_like(1).elementwise(ADD, exp_neg).elementwise(RECIP).cast(x.dtype)


class Sigmoid(Function):
  """1 / (1 + exp(-x)), as one Function so its backward reuses the forward result."""

  def forward(self, x: LazyBuffer) -> LazyBuffer:
    self.result = _sigmoid(x)
    return self.result

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer:
    return _mul(_mul(self.result, _sub(self.result.operand_like(1), self.result)), grad_output)


# ---------------------------------------------------------------- binary and ternary

class Less(Function):
  def forward(self, x: LazyBuffer, y: LazyBuffer) -> LazyBuffer: return x.elementwise(CMPLT, y)
  def backward(self, grad_output: LazyBuffer) -> tuple[None, None]: return None, None


class NotEqual(Function):
  def forward(self, x: LazyBuffer, y: LazyBuffer) -> LazyBuffer: return x.elementwise(CMPNE, y)
  def backward(self, grad_output: LazyBuffer) -> tuple[None, None]: return None, None


class Equal(Function):
  """x == y as (x != y) != True: one Function for what `(x != y).logical_not()` built with two."""
  def forward(self, x: LazyBuffer, y: LazyBuffer) -> LazyBuffer: return _equal(x, y)
  def backward(self, grad_output: LazyBuffer) -> tuple[None, None]: return None, None


class BitwiseOp(Function):
  """AND, OR, XOR, SHL, SHR: integer and bool only, not differentiable."""

  def forward(self, x: LazyBuffer, y: LazyBuffer, op: Ops) -> LazyBuffer: return x.elementwise(op, y)
  def backward(self, grad_output: LazyBuffer) -> tuple[None, None]: return None, None


class IntDiv(Function):
  """Integer division truncating toward zero and its remainder (C semantics); not differentiable."""

  def forward(self, x: LazyBuffer, y: LazyBuffer, op: Ops) -> LazyBuffer: return x.elementwise(op, y)
  def backward(self, grad_output: LazyBuffer) -> tuple[None, None]: return None, None


class Add(Function):
  def forward(self, x: LazyBuffer, y: LazyBuffer) -> LazyBuffer: return x.elementwise(ADD, y)

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, LazyBuffer | None]:
    return (grad_output if self.needs_input_grad[0] else None, grad_output if self.needs_input_grad[1] else None)


class Sub(Function):
  def forward(self, x: LazyBuffer, y: LazyBuffer) -> LazyBuffer: return _sub(x, y)

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, LazyBuffer | None]:
    return (grad_output if self.needs_input_grad[0] else None,
            grad_output.elementwise(NEG) if self.needs_input_grad[1] else None)


class Mul(Function):
  def forward(self, x: LazyBuffer, y: LazyBuffer) -> LazyBuffer:
    self.x, self.y = x, y
    return x.elementwise(MUL, y)

  def saved_values(self) -> list[LazyBuffer]:   # each factor is needed only for the other's gradient
    return [value for value, needed in ((self.y, self.needs_input_grad[0]), (self.x, self.needs_input_grad[1]))
            if needed]

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, LazyBuffer | None]:
    return (_mul(self.y, grad_output) if self.needs_input_grad[0] else None,
            _mul(self.x, grad_output) if self.needs_input_grad[1] else None)


class Div(Function):
  """True division of floats."""

  def forward(self, x: LazyBuffer, y: LazyBuffer) -> LazyBuffer:
    self.x, self.y = x, y
    return _div(x, y)

  def saved_values(self) -> list[LazyBuffer]:   # x only for y's gradient
    return [self.y] + ([self.x] if self.needs_input_grad[1] else [])

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, LazyBuffer | None]:
    grad_x = _div(grad_output, self.y) if self.needs_input_grad[0] else None
    grad_y = None
    if self.needs_input_grad[1]:
      grad_y = _div(_mul(grad_output.elementwise(NEG), self.x), _mul(self.y, self.y))
    return grad_x, grad_y


class Maximum(Function):
  """Elementwise max. As in PyTorch, equal inputs share the gradient in halves, and where either is NaN (so neither
  is smaller) both get all of it."""

  def forward(self, x: LazyBuffer, y: LazyBuffer) -> LazyBuffer:
    self.x, self.y = x, y
    return x.elementwise(MAX, y)

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, LazyBuffer | None]:
    zero = grad_output.operand_like(0)
    shared = _where_equal(self.x, self.y, _scale(grad_output, 0.5), grad_output)
    return (_where(self.x.elementwise(CMPLT, self.y), zero, shared) if self.needs_input_grad[0] else None,
            _where(self.y.elementwise(CMPLT, self.x), zero, shared) if self.needs_input_grad[1] else None)


def _abs(x: LazyBuffer) -> LazyBuffer:
  return _where(x.elementwise(CMPLT, x.const_like(0)), x.elementwise(NEG), x)


def _magnitude_pow(x: LazyBuffer, y: LazyBuffer) -> LazyBuffer:
  """|x| ** y as exp2(y * log2|x|), float16/bfloat16 computed in float32."""
  log_base = _abs(_widen(x)).elementwise(LOG2)
  return _mul(_widen(y), log_base).elementwise(EXP2).cast(x.dtype)


class Pow(Function):
  """x ** y for floats of one shape. The caller passes `sign` and `sign_below`, the signs (1, -1, or NaN where the
  power is undefined) of x ** y and of x ** (y - 1), and `is_one` and `is_one_below`, where those are exactly 1
  (y == 0, x == 1, (-1) ** inf). Gradients follow PyTorch at every special point: d/dx is 0 where y == 0 and
  y * x ** (y - 1) elsewhere (so 3 at x = 1 for x ** 3, 0 at x = 0); d/dy is 0 where x == 0 and y >= 0 and
  x ** y * ln x elsewhere (NaN for x < 0)."""

  def forward(self, x: LazyBuffer, y: LazyBuffer, sign: LazyBuffer, is_one: LazyBuffer, sign_below: LazyBuffer,
              is_one_below: LazyBuffer) -> LazyBuffer:
    self.x, self.y, self.sign_below, self.is_one_below = x, y, sign_below, is_one_below
    self.result = _where(is_one, x.const_like(1), _mul(sign, _magnitude_pow(x, y)))
    return self.result

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, LazyBuffer | None, None, None, None, None]:
    x, y, zero, one = self.x, self.y, self.x.const_like(0), self.x.const_like(1)
    grad_x = grad_y = None
    if self.needs_input_grad[0]:
      power = _where(self.is_one_below, one, _mul(self.sign_below, _magnitude_pow(x, _sub(y, one))))
      grad_x = _mul(_where_equal(y, zero, zero, _mul(y, power)), grad_output)
    if self.needs_input_grad[1]:
      log_x = _scale(_widen(x).elementwise(LOG2), math.log(2)).cast(x.dtype)
      y_not_negative = zero.elementwise(CMPLT, y).elementwise(OR, _equal(y, zero))  # False for NaN
      no_slope = _equal(x, zero).elementwise(AND, y_not_negative)
      grad_y = _mul(_where(no_slope, zero, _mul(self.result, log_x)), grad_output)
    return grad_x, grad_y, None, None, None, None


class Where(Function):
  def forward(self, cond: LazyBuffer, x: LazyBuffer, y: LazyBuffer) -> LazyBuffer:
    self.cond = cond
    return cond.elementwise(WHERE, x, y)

  def backward(self, grad_output: LazyBuffer) -> tuple[None, LazyBuffer | None, LazyBuffer | None]:
    zeros = grad_output.operand_like(0)
    return (None,
            _where(self.cond, grad_output, zeros) if self.needs_input_grad[1] else None,
            _where(self.cond, zeros, grad_output) if self.needs_input_grad[2] else None)


# ---------------------------------------------------------------- reduce

class Sum(Function):
  """Sum over `axes`, kept as size-1 dims, or viewed as `shape` (those dims dropped: keepdim=False), so that a reduce
  and its reshape are one Function; the backward is the same reshape back, then the expand."""

  def forward(self, x: LazyBuffer, axes: tuple[int, ...], shape: tuple[int, ...] | None = None) -> LazyBuffer:
    self.input_shape = x.shape
    reduced = x.reduce(SUM, axes)
    self.reduced_shape = reduced.shape
    return reduced if shape is None else reduced.reshape(shape)

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer:
    return grad_output.reshape(self.reduced_shape).expand(self.input_shape)


class Matmul(Function):
  """x (..., m, k) @ y (..., k, n) -> (..., m, n), operands of one dtype: the multiply of x (..., m, 1, k) and y's
  transpose (..., 1, n, k) broadcast to `shape` (..., m, n, k), summed over k. Its graph is the one the Tensor ops
  build for it (unsqueeze, transpose, the broadcast, the product, the sum), and so is its backward's, operation for
  operation: one autograd node in place of nine, a product's gradient for each operand summed to its shape in one
  reduce, y's put back with a permute (a view)."""

  def forward(self, x: LazyBuffer, y: LazyBuffer, shape: tuple[int, ...]) -> LazyBuffer:
    self.x_shape = x.shape
    rank = len(y.shape)
    self.y_order = (*range(rank - 2), rank - 1, rank - 2)   # y's transpose (its own inverse)
    y_columns = y.permute(self.y_order)
    self.y_transposed_shape = y_columns.shape
    x_rows = x.reshape(x.shape[:-1] + (1, x.shape[-1]))
    return self._product(x_rows, y_columns.reshape(y_columns.shape[:-2] + (1,) + y_columns.shape[-2:]), shape)

  def _product(self, x_rows: LazyBuffer, y_columns: LazyBuffer, shape: tuple[int, ...]) -> LazyBuffer:
    """x_rows (..., m, 1, k) times y_columns (..., 1, n, k), both broadcast to `shape`, summed over k: (..., m, n)."""
    self.shape, self.x_rows_shape, self.y_columns_shape = shape, x_rows.shape, y_columns.shape
    self.x, self.y = _broadcast_to(x_rows, shape), _broadcast_to(y_columns, shape)
    return reduce_product(self.x, self.y, len(shape) - 1).reshape(shape[:-1])   # (a remembered split: no product)

  def saved_values(self) -> list[LazyBuffer]:   # each operand is needed only for the other's gradient (as Mul)
    return [value for value, needed in ((self.y, self.needs_input_grad[0]), (self.x, self.needs_input_grad[1]))
            if needed]

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, LazyBuffer | None]:
    # (y's gradient in y's transpose's shape, put back with the transpose's own inverse)
    return self._product_gradients(grad_output, (), (), (("permute", self.y_order),))

  def _product_gradients(self, grad_output: LazyBuffer, output_moves: tuple, x_moves: tuple,
                         y_moves: tuple) -> tuple[LazyBuffer | None, LazyBuffer | None]:
    """The gradients of x (in x's shape) and of y_columns (in y's transpose's shape, (..., n, k)) of `_product`,
    moved on by `x_moves` and `y_moves` to a caller's inputs; `output_moves` take the output's gradient to the
    product's output shape (Linear's). Each chain of views is one composed view (lazy_moves.composed_view: the same
    tracker, one view)."""
    # the sum's gradient: the output's, broadcast over k
    grad = composed_view(grad_output, (*output_moves, ("reshape", self.shape[:-1] + (1,)), ("expand", self.shape)))
    grad_x = grad_y = None
    if self.needs_input_grad[0]:
      grad_x = composed_view(_sum_to_shape(_mul(self.y, grad), self.x_rows_shape),
                             (("reshape", self.x_shape), *x_moves))
    if self.needs_input_grad[1]:
      grad_y = composed_view(_sum_to_shape(_mul(self.x, grad), self.y_columns_shape),
                             (("reshape", self.y_transposed_shape), *y_moves))
    return grad_x, grad_y


class Linear(Matmul):
  """x (..., k) @ weight (n, k).T [+ bias (n,)] -> (..., n), operands of one dtype: Tensor.linear's graph as one
  autograd node. The Tensor ops build weight.T (a Permute), x viewed as (rows, k) (a Reshape, where x has more than two
  dims), the Matmul, its result viewed back, and the bias broadcast (an Expand) and added: five nodes where this is
  one, and its backward the graph their backward walk built, operation for operation (so the kernels are the same).
  The weight is the Matmul's y transposed, which the Matmul transposes back: taken as it is (a permute of a permute is
  the view itself), in the forward and the backward."""

  def forward(self, x: LazyBuffer, weight: LazyBuffer, *bias: LazyBuffer) -> LazyBuffer:   # type: ignore[override]
    self.input_shape, outputs = x.shape, weight.shape[0]
    count, features = math.prod(x.shape[:-1]), x.shape[-1]
    # x seen as (rows, k) and then as (rows, 1, k): one view to the second (a reshape of a reshape is one reshape)
    self.x_shape, self.y_transposed_shape = (count, features), weight.shape
    x_rows = x.reshape((count, 1, features))
    product = self._product(x_rows, weight.reshape((1,) + weight.shape), (count, outputs, features))
    product = product.reshape(x.shape[:-1] + (outputs,))
    self.bias_shape = bias[0].shape if bias else None
    return product.elementwise(ADD, _broadcast_to(bias[0], product.shape)) if bias else product

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer | None, ...]:   # type: ignore[override]
    grad_bias = None
    if self.bias_shape is not None and self.needs_input_grad[2]: grad_bias = _sum_to_shape(grad_output, self.bias_shape)
    grad_x, grad_weight = self._product_gradients(grad_output, (("reshape", self.shape[:-1]),),
                                                  (("reshape", self.input_shape),), ())
    return (grad_x, grad_weight) if self.bias_shape is None else (grad_x, grad_weight, grad_bias)


class Max(Function):
  """Max reduce; the gradient is shared equally among the maximal elements, as in PyTorch's amax."""

  def forward(self, x: LazyBuffer, axes: tuple[int, ...], shape: tuple[int, ...] | None = None) -> LazyBuffer:
    self.x, self.axes = x, axes
    self.result = x.reduce(MAX_REDUCE, axes)
    return self.result if shape is None else self.result.reshape(shape)   # (as Sum's `shape`)

  def backward(self, grad_output: LazyBuffer) -> LazyBuffer:
    grad_output = grad_output.reshape(self.result.shape)
    is_max = self.x.elementwise(CMPNE, self.result.expand(self.x.shape)).elementwise(NEG)
    is_max = is_max.cast(grad_output.dtype)
    count = is_max.reduce(SUM, self.axes).expand(self.x.shape)
    return _mul(_div(is_max, count), grad_output.expand(self.x.shape))


class LogSumExpGrad(Function):
  """Passes a logsumexp's value (computed from its input cut from the graph, keepdim shape) through and gives it
  the gradient exp(x - value) * grad: the backward reads the value saved from the forward, one elementwise kernel,
  instead of recomputing the max and the sum of exps (a reduce) from x."""

  def forward(self, x: LazyBuffer, value: LazyBuffer) -> LazyBuffer:
    self.x, self.value = x, value
    return value

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer, None]:
    shape = self.x.shape
    shifted = _widen(_sub(self.x, self.value.expand(shape)))
    softmax = _scale(shifted, 1 / math.log(2)).elementwise(EXP2).cast(self.x.dtype)
    return _mul(softmax, grad_output.expand(shape)), None


class SoftmaxGrad(Function):
  """Passes a softmax's output y (computed from its input cut from the graph) through and gives the input the
  gradient y * (grad - sum(grad * y)) over `axis`, as torch's softmax backward: it reads the saved output only (no
  exps kept from the forward, no max or sum recomputed). float16/bfloat16 compute in float32 and round once; a low-
  precision gradient reaching it is stored in its dtype (the attention's T x T products)."""

  def forward(self, x: LazyBuffer, y: LazyBuffer, axis: int) -> LazyBuffer:
    self.input_dtype, self.y, self.axis = x.dtype, y, axis
    return y

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer, None]:
    store_low_precision(grad_output)
    grad, y = _widen(grad_output), _widen(self.y)
    weighted = _mul(grad, y).reduce(SUM, (self.axis,)).expand(y.shape)
    return _mul(y, _sub(grad, weighted)).cast(self.input_dtype), None


class MaxToOne(Function):
  """Max reduce whose gradient goes whole to one element of each reduced group, as PyTorch's max_pool does: among the
  maximal elements, the one with the largest `rank` (a tensor of x's shape; ranks > 0 are distinct within a
  group, 0 marks padding); where the maximum is NaN, the NaN with the smallest rank. Ranks counting down in
  row-major order give the first maximum and the last NaN, as PyTorch's pooling loop picks them."""

  def forward(self, x: LazyBuffer, rank: LazyBuffer, axes: tuple[int, ...]) -> LazyBuffer:
    self.x, self.rank, self.axes = x, rank, axes
    self.result = x.reduce(MAX_REDUCE, axes)
    return self.result

  def backward(self, grad_output: LazyBuffer) -> tuple[LazyBuffer, None]:
    x, rank = self.x, self.rank
    is_nan = x.elementwise(CMPNE, x)
    # a NaN peak makes every comparison false, so the NaNs are the candidates there; the smallest rank wins among them.
    # Two nested selects, not one on `x == max | x != x`: gcc 12 does not vectorize that OR of an equality and a NaN
    # test (the CPU's max-pool backward then ran scalar, 3.5x slower).
    not_max = _where(is_nan, rank.elementwise(NEG), rank.operand_like(rank.dtype.min))
    key = _where_equal(x, self.result.expand(x.shape), rank, not_max)
    # (the zeros a shared operand constant of x's shape: no new view of the reduced shape's zeros each step)
    grad = _where_equal(key, key.reduce(MAX_REDUCE, self.axes).expand(x.shape), grad_output.expand(x.shape),
                        x.operand_like(0, grad_output.dtype))
    return grad, None
