"""The cost of building one op, kept out of the results: ops built without a Function where nothing needs a gradient
(tensor_math `_direct_operation`: a float tensor with a Python scalar or a tensor of its shape and dtype),
Function.apply's bookkeeping only for Functions it keeps, Linear's weight taken without a transpose and back, reduce
axes remembered. Checked against numpy, the autograd state of the general path, and the very lazy graph it builds."""
from __future__ import annotations

import operator

import numpy as np
import pytest

from ourgrad import Tensor, dtypes
from ourgrad import function as F
from ourgrad.errors import AxisError, DeviceError, ShapeError
from ourgrad.lazy import LazyBuffer

_OPS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv}
_X = np.array([[1.5, -2.0, 3.0], [0.25, 4.0, -0.5]], dtype=np.float32)
_Y = np.array([[2.0, 0.5, -1.0], [3.0, -4.0, 8.0]], dtype=np.float32)


def _expected_requires(*flags: bool | None) -> bool | None:
  """Function.apply's rule over its inputs (a Python scalar counts as None), for a float result outside no_grad."""
  return True if True in flags else None if None in flags else False


def _graph(lazy: LazyBuffer) -> tuple:
  """A lazy value's graph as nested tuples (op, arg, dtype, shape, sources; a view: its tracker and base), walked
  with an explicit stack: a node's key is made once its sources have theirs."""
  keys: dict[int, tuple] = {}
  stack = [lazy]
  while stack:
    node = stack[-1]
    parts = list(node.srcs) if node.is_base else [node.base]
    missing = [part for part in parts if id(part) not in keys]
    if missing:
      stack += missing
      continue
    stack.pop()
    if node.is_base: keys[id(node)] = (node.op, node.arg, node.dtype, node.shape, tuple(keys[id(p)] for p in parts))
    else: keys[id(node)] = ("view", node.st, keys[id(node.base)])
  return keys[id(lazy)]


@pytest.mark.parametrize("name", list(_OPS))
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("other", [2.5, 3, True, "same", "same_false", "needs_grad", "row"])
@pytest.mark.parametrize("requires_grad", [None, False])
def test_direct_ops_give_numpy_values_and_the_general_autograd_state(name, reverse, other, requires_grad):
  x = Tensor(_X, requires_grad=requires_grad)
  flags: tuple = (requires_grad, None)
  if isinstance(other, str):
    values = _Y[:1] if other == "row" else _Y
    operand_grad = {"same_false": False, "needs_grad": True}.get(other)
    operand, operand_value = Tensor(values, requires_grad=operand_grad), values
    flags = (requires_grad, operand_grad)
  else:
    operand, operand_value = other, np.float32(other)
  op = _OPS[name]
  result = op(operand, x) if reverse else op(x, operand)
  expected = op(operand_value, _X) if reverse else op(_X, operand_value)
  np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6)
  assert result.dtype == dtypes.float32 and result.grad is None
  assert result.requires_grad is _expected_requires(*flags)
  assert (result._ctx is not None) == bool(result.requires_grad)
  with Tensor.no_grad_context():
    quiet = op(operand, x) if reverse else op(x, operand)
    assert quiet.requires_grad is False and quiet._ctx is None
  if other == "needs_grad":   # the gradient flows to the operand that needs it
    result.sum().backward()
    assert operand.grad is not None and operand.grad.shape == operand.shape


@pytest.mark.parametrize("make", [lambda x: x + 1.5, lambda x: 2 * x, lambda x: x - 0.25, lambda x: 1 - x,
                                  lambda x: x / 4.0, lambda x: 3.0 / x, lambda x: x * x, lambda x: x + x.exp2(),
                                  lambda x: Tensor(_Y[:1]) * x, lambda x: x[:1] + x])
def test_direct_ops_build_the_graph_function_apply_builds(make):
  """The graph (ops, constants, views) of an op that needs no gradient equals the one built for a tensor that needs
  one (which takes Function.apply's path): the kernels and their values are the same."""
  direct = make(Tensor(_X).realize())
  recorded = make(Tensor(_X, requires_grad=True).realize())
  assert recorded._ctx is not None and direct._ctx is None
  # (the inputs differ as buffers, not as graph nodes: both are realized bases of one shape)
  assert _graph(direct.lazydata) == _graph(recorded.lazydata)
  np.testing.assert_array_equal(direct.numpy(), recorded.numpy())


def test_direct_ops_share_the_operand_constant_of_function_apply():
  x = Tensor(_X).realize()
  direct, general = x + 1.5, F.Add.apply(*x._broadcasted(1.5))
  assert direct.lazydata.srcs[1] is general.lazydata.srcs[1]


def test_direct_ops_leave_other_cases_to_the_general_path():
  """Integer and bool tensors, dtype promotion and broadcasting keep their rules (the general path decides)."""
  ints = Tensor(np.array([1, 2, 3], dtype=np.int32))
  assert (ints + 1).dtype == dtypes.int32 and (ints * 0.5).dtype == dtypes.float32
  np.testing.assert_allclose((ints / 2).numpy(), np.array([0.5, 1.0, 1.5]))
  flags = Tensor(np.array([True, False]))
  np.testing.assert_array_equal((flags + True).numpy(), [True, True])   # bool + bool is or
  halves = Tensor(np.ones(3, np.float16))
  assert (halves + Tensor(np.ones(3, np.float32))).dtype == dtypes.float32
  with pytest.raises(ShapeError): Tensor(_X) + Tensor(np.ones(4, np.float32))
  fake = Tensor(LazyBuffer.empty((2, 3), dtypes.float32, "FAKE"))
  with pytest.raises(DeviceError, match="different devices"): Tensor(_X) * fake


def test_function_apply_writes_bookkeeping_only_for_kept_functions():
  x = Tensor(_X)
  assert (x * 2)._ctx is None and x.exp2()._ctx is None
  w = Tensor(_Y, requires_grad=True)
  product, exp = x * w, w.exp2()
  assert product._ctx.needs_input_grad == [None, True] and product._ctx.parents == (x, w)
  assert exp._ctx.needs_input_grad == [True] and exp._ctx.requires_grad is True
  (product.sum() + exp.sum()).backward()
  np.testing.assert_allclose(w.grad.numpy(), _X + np.exp2(_Y) * np.log(2), rtol=1e-5)


@pytest.mark.parametrize("shape, bias", [((6, 8), False), ((6, 8), True), ((2, 3, 8), True)])
def test_linear_node_gives_numpy_values_and_gradients(shape, bias):
  rng = np.random.default_rng(0)
  x_value, w_value, b_value = (rng.standard_normal(s).astype(np.float32) for s in (shape, (5, 8), (5,)))
  x, w = Tensor(x_value, requires_grad=True), Tensor(w_value, requires_grad=True)
  b = Tensor(b_value, requires_grad=True) if bias else None
  out = x.linear(w, b)
  assert type(out._ctx) is F.Linear
  grad_value = rng.standard_normal(out.shape).astype(np.float32)
  expected = x_value @ w_value.T + (b_value if bias else 0)
  np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)
  out.backward(Tensor(grad_value))
  rows, grad_rows = x_value.reshape(-1, 8), grad_value.reshape(-1, 5)
  np.testing.assert_allclose(x.grad.numpy(), (grad_rows @ w_value).reshape(shape), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(w.grad.numpy(), grad_rows.T @ rows, rtol=1e-5, atol=1e-5)
  if bias: np.testing.assert_allclose(b.grad.numpy(), grad_rows.sum(0), rtol=1e-5, atol=1e-5)


def test_linear_node_builds_the_graph_of_the_tensor_ops():
  """The weight is used as it is (no transpose and back): the forward graph and, for 2-D operands, each gradient's are
  those of `x @ w.T` built op by op."""
  def built(one_node: bool) -> list[tuple]:
    rng = np.random.default_rng(1)
    x = Tensor(rng.random((6, 8), np.float32), requires_grad=True).realize()
    w = Tensor(rng.random((5, 8), np.float32), requires_grad=True).realize()
    out = x.linear(w) if one_node else x.matmul(w.T)
    out.backward(Tensor(rng.random(out.shape, np.float32)).realize())
    return [_graph(out.lazydata), _graph(x.grad.lazydata), _graph(w.grad.lazydata)]
  assert built(True) == built(False)


def test_reduce_axes_are_remembered_by_type_and_raise_each_time():
  x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
  for _ in range(2):   # errors are never remembered: raised again
    with pytest.raises(AxisError): x.sum(2)
    with pytest.raises(AxisError): x.sum((0, -2))
    with pytest.raises(TypeError): x.sum(1.0)   # a float axis is its own key: never the answer for 1
  np.testing.assert_array_equal(x.sum(1).numpy(), [3, 12])
  np.testing.assert_array_equal(x.sum(np.int64(-1)).numpy(), [3, 12])
  np.testing.assert_array_equal(x.mean([0, 1]).numpy(), 2.5)   # (a list: not hashable, not remembered)
  np.testing.assert_array_equal(x.max((-1,), keepdim=True).numpy(), [[2], [5]])
  assert Tensor(np.float32(3)).sum(0).shape == ()


def test_argmax_of_a_tensor_that_needs_a_gradient_records_nothing():
  """An index has no gradient: argmax builds no Function for the backward, and picks the first maximum (the first NaN
  where there is one), as numpy and PyTorch do."""
  values = np.array([[1, np.nan, 3, np.nan], [2, 5, 5, 1], [np.inf, 1, np.nan, np.inf], [-np.inf] * 4], np.float32)
  x = Tensor(values, requires_grad=True)
  for axis in (0, 1):
    index = x.argmax(axis)
    assert index._ctx is None and index.requires_grad is False
    np.testing.assert_array_equal(index.numpy(), np.argmax(values, axis))
  assert x.argmax().item() == np.argmax(values)


_VIEWS = [(lambda t: t.reshape(3, 2), lambda a: a.reshape(3, 2)), (lambda t: t.permute(1, 0), lambda a: a.T),
          (lambda t: t[1:, ::1], lambda a: a[1:]),
          (lambda t: t.reshape(6)[2:5].reshape(1, 3), lambda a: a.reshape(1, 6)[:, 2:5]),
          (lambda t: t.T.reshape(-1), lambda a: a.T.reshape(-1)),
          (lambda t: t[:1].expand(3, 2, 3), lambda a: np.broadcast_to(a[:1], (3, 2, 3)))]


@pytest.mark.parametrize("move, expected", _VIEWS)
@pytest.mark.parametrize("requires_grad", [None, False])
def test_views_without_a_gradient_build_the_graph_of_the_movement_functions(move, expected, requires_grad):
  """reshape, permute, shrink and expand of a tensor that needs no gradient make the view without a Function: the
  graph of the Function's forward (a tensor that needs a gradient takes that path), Function.apply's autograd state."""
  direct, recorded = move(Tensor(_X, requires_grad=requires_grad)), move(Tensor(_X, requires_grad=True))
  assert direct._ctx is None and recorded._ctx is not None and direct.requires_grad is requires_grad
  assert _graph(direct.lazydata) == _graph(recorded.lazydata)
  np.testing.assert_array_equal(direct.numpy(), expected(_X))
  assert move(Tensor(np.arange(6, dtype=np.int32).reshape(2, 3))).requires_grad is False   # (no float: no gradient)
  with Tensor.no_grad_context(): assert move(Tensor(_X)).requires_grad is False
