"""Every composite op at the special points of its formula, forward and backward, against PyTorch on the CPU.

Random inputs almost never land on 0, 1, -1, +-inf, NaN or the boundary of a `where` branch (relu at 0, clamp at
its bounds, max with ties), and that is where composite ops built from primitives go wrong: a `where` that picks a
constant drops a gradient, `0 * inf` turns one into NaN. Each test feeds a fixed list of such points to the op in
ourgrad and in torch, compares forward values and the gradient of every input elementwise, and requires NaN at the
same positions in both.

Where torch's choice at a tie is arbitrary (which of several equal maxima gets the gradient) ours is documented at
the op and tested here against the torch op with the same rule (amax splits the gradient evenly).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as torch_functional
from helpers import TORCH_DTYPES

from ourgrad import Tensor, dtypes
from ourgrad.dtype import DType

INF, NAN = math.inf, math.nan
# 0, +-1, the infinities and NaN, plus points on the branch boundaries of the activations below
SPECIAL_POINTS = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 3.0, -3.0, 6.0, -6.0, 20.0, 30.0, -30.0, 100.0, -100.0,
                  INF, -INF, NAN]
FINITE_POINTS = [value for value in SPECIAL_POINTS if math.isfinite(value)]
# for functions defined on [-1, 1] or (0, inf): the edges of the domain and just inside and outside
UNIT_POINTS = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 0.999, -0.999, 1.5, -1.5, 2.0, INF, -INF, NAN]


def _compare(ours: np.ndarray, theirs: np.ndarray, what: str, atol: float, rtol: float) -> None:
  """Values close, NaN exactly where torch has NaN, infinities equal."""
  ours, theirs = ours.astype(np.float64), theirs.astype(np.float64)
  assert ours.shape == theirs.shape, f"{what}: shape {ours.shape} != torch's {theirs.shape}"
  np.testing.assert_array_equal(np.isnan(ours), np.isnan(theirs), err_msg=f"{what}: NaN positions differ\n"
                                f"ours   {ours}\ntorch  {theirs}")
  np.testing.assert_allclose(ours, theirs, atol=atol, rtol=rtol, equal_nan=True, err_msg=what)


def check_special_points(inputs: list[list[float]], torch_fn: Callable[..., Any], ourgrad_fn: Callable[..., Any],
                         dtype: DType = dtypes.float32, atol: float = 1e-5, rtol: float = 1e-4,
                         grad_atol: float | None = None, grad_rtol: float | None = None,
                         backward: bool = True) -> None:
  """Run both functions on the same points (one list per input, broadcast against each other), compare the
  forward values and, with an upstream gradient of ones, every input's gradient."""
  arrays = [np.array(values, dtype=np.float64) for values in inputs]
  torch_inputs = [torch.tensor(array, dtype=TORCH_DTYPES[dtype], requires_grad=backward) for array in arrays]
  ourgrad_inputs = [Tensor(array, dtype=dtype, requires_grad=backward or None) for array in arrays]
  theirs, ours = torch_fn(*torch_inputs), ourgrad_fn(*ourgrad_inputs)
  _compare(ours.numpy(), theirs.detach().double().numpy(), "forward", atol, rtol)
  if not backward: return
  theirs.backward(torch.ones_like(theirs))
  ours.backward(Tensor.ones(*ours.shape, dtype=ours.dtype))
  for number, (our_input, their_input) in enumerate(zip(ourgrad_inputs, torch_inputs)):
    their_grad = their_input.grad if their_input.grad is not None else torch.zeros_like(their_input)
    assert our_input.grad is not None, f"input {number}: no gradient"
    _compare(our_input.grad.numpy(), their_grad.double().numpy(), f"gradient of input {number}",
             grad_atol if grad_atol is not None else atol, grad_rtol if grad_rtol is not None else rtol)


def param(*values: Any, name: str, marks: Any = ()) -> Any:
  return pytest.param(*values, id=name, marks=marks)


def same(name: str, *args: Any, **kwargs: Any) -> Any:
  """An op spelled the same in both libraries: x.name(*args, **kwargs)."""
  def call(x: Any) -> Any: return getattr(x, name)(*args, **kwargs)
  return param(call, call, name=name)


# ================================================================ unary ops over all special points

UNARY = [
  same("neg"), same("abs"), same("sign"), same("relu"), same("sigmoid"), same("tanh"), same("exp"), same("exp2"),
  same("log"), same("log2"), same("log10"), same("log1p"), same("expm1"), same("sqrt"), same("rsqrt"),
  same("reciprocal"), same("square"), same("trunc"), same("floor"), same("ceil"), same("round"),
  same("sinh"), same("cosh"), same("asinh"), same("erf"), same("isnan"), same("isinf"), same("isfinite"),
  same("atan"), same("erfc"), same("frac"), same("deg2rad"), same("rad2deg"),
  same("clamp", -1.0, 2.0), same("clamp", min=0.5), same("clamp", max=-0.5),
  param(lambda x: x ** 3, lambda x: x ** 3, name="pow3"),
  param(lambda x: x ** 1.5, lambda x: x ** 1.5, name="pow1.5"),
  param(lambda x: x ** 0, lambda x: x ** 0, name="pow0"),
  param(lambda x: x ** 1, lambda x: x ** 1, name="pow1"),
  param(lambda x: x ** 2, lambda x: x ** 2, name="pow2"),
  param(lambda x: x ** 0.5, lambda x: x ** 0.5, name="pow0.5"),
  param(lambda x: x ** -1, lambda x: x ** -1, name="pow-1"),
  param(lambda x: x ** -2, lambda x: x ** -2, name="pow-2"),
  param(lambda x: x ** -0.5, lambda x: x ** -0.5, name="pow-0.5"),
  param(lambda x: 2 ** x, lambda x: 2 ** x, name="rpow2"),
  param(lambda x: 0.5 ** x, lambda x: 0.5 ** x, name="rpow0.5"),
  param(lambda x: 0 ** x, lambda x: 0 ** x, name="rpow0"),
  param(lambda x: x % 1.5, lambda x: x % 1.5, name="mod"),
  param(torch_functional.silu, lambda x: x.silu(), name="silu"),
  param(torch_functional.relu6, lambda x: x.relu6(), name="relu6"),
  param(torch_functional.hardsigmoid, lambda x: x.hardsigmoid(), name="hardsigmoid"),
  param(torch_functional.hardswish, lambda x: x.hardswish(), name="hardswish"),
  param(torch_functional.hardtanh, lambda x: x.hardtanh(), name="hardtanh"),
  param(torch_functional.mish, lambda x: x.mish(), name="mish"),
  param(torch_functional.leaky_relu, lambda x: x.leaky_relu(), name="leaky_relu"),
  param(lambda x: torch_functional.leaky_relu(x, 0.2), lambda x: x.leaky_relu(0.2), name="leaky_relu-0.2"),
  param(torch_functional.elu, lambda x: x.elu(), name="elu"),
  param(lambda x: torch_functional.elu(x, 0.5), lambda x: x.elu(0.5), name="elu-0.5"),
  param(torch_functional.celu, lambda x: x.celu(), name="celu"),
  param(torch_functional.selu, lambda x: x.selu(), name="selu"),
  param(torch_functional.softplus, lambda x: x.softplus(), name="softplus"),
  param(lambda x: torch_functional.softplus(x, 2, 3), lambda x: x.softplus(2, 3), name="softplus-threshold"),
  param(torch_functional.softsign, lambda x: x.softsign(), name="softsign"),
  param(torch_functional.logsigmoid, lambda x: x.logsigmoid(), name="logsigmoid"),
]
# torch's gelu gives NaN at +-inf (x * cdf(x)); ours gives the limits
FINITE_ONLY = [
  param(torch_functional.gelu, lambda x: x.gelu(), name="gelu"),
  param(lambda x: torch_functional.gelu(x, approximate="tanh"), lambda x: x.gelu("tanh"), name="gelu-tanh"),
]
# only where both sides are defined: sin/cos/tan of +-inf are NaN in both, but the range reduction of huge
# arguments differs
PERIODIC = [same("sin"), same("cos"), same("tan")]
# functions of [-1, 1] (atanh), [1, inf) (acosh)
UNIT_DOMAIN = [same("atanh"), same("acosh"), same("asinh"), same("asin"), same("acos"), same("atan"), same("logit"),
               same("logit", 0.25)]


# points where torch's answer comes from an internal special case we do not copy, documented at the op:
# torch computes x ** 0.5 inside the gradient of x ** 1.5 as sqrt, so it is NaN at -inf (C's pow gives +inf, as ours)
EXCLUDED_POINTS: dict[str, list[float]] = {"pow1.5": [-INF]}


def _points(request: Any, points: list[float]) -> list[float]:
  excluded = EXCLUDED_POINTS.get(request.node.callspec.id, [])
  return [value for value in points if not any(value == other for other in excluded)]


def _booleans(fn: Callable[..., Any]) -> bool:
  return fn.__name__ == "call" and fn.__closure__ is not None and \
    any(cell.cell_contents in ("isnan", "isinf", "isfinite") for cell in fn.__closure__)


@pytest.mark.parametrize("torch_fn, ourgrad_fn", UNARY)
def test_unary_special_points(torch_fn: Any, ourgrad_fn: Any, request: Any) -> None:
  backward = not _booleans(ourgrad_fn)
  check_special_points([_points(request, SPECIAL_POINTS)], torch_fn, ourgrad_fn, backward=backward)


@pytest.mark.parametrize("torch_fn, ourgrad_fn", UNARY)
def test_unary_special_points_float64(torch_fn: Any, ourgrad_fn: Any, request: Any) -> None:
  backward = not _booleans(ourgrad_fn)
  # erf (and erfc) is a polynomial approximation good to 1.5e-7 in every dtype (its gradient is exact)
  tolerance = 2e-7 if request.node.callspec.id in ("erf", "erfc") else 1e-10
  # torch's float64 hardsigmoid gradient is the float32 constant 1/6; ours is the float64 one
  grad_rtol = 1e-7 if request.node.callspec.id == "hardsigmoid" else 1e-9
  check_special_points([_points(request, SPECIAL_POINTS)], torch_fn, ourgrad_fn, dtype=dtypes.float64,
                       atol=tolerance, rtol=1e-9, grad_atol=1e-10, grad_rtol=grad_rtol, backward=backward)


@pytest.mark.parametrize("torch_fn, ourgrad_fn", FINITE_ONLY)
def test_finite_special_points(torch_fn: Any, ourgrad_fn: Any) -> None:
  check_special_points([FINITE_POINTS + [NAN]], torch_fn, ourgrad_fn)


@pytest.mark.parametrize("torch_fn, ourgrad_fn", PERIODIC)
def test_periodic_special_points(torch_fn: Any, ourgrad_fn: Any) -> None:
  check_special_points([[0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -3.0, math.pi / 4, INF, -INF, NAN]],
                       torch_fn, ourgrad_fn)


@pytest.mark.parametrize("torch_fn, ourgrad_fn", UNIT_DOMAIN)
def test_unit_domain_special_points(torch_fn: Any, ourgrad_fn: Any) -> None:
  check_special_points([UNIT_POINTS], torch_fn, ourgrad_fn, rtol=1e-3)


# ================================================================ binary ops over every pair of special points

GRID = [0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0, INF, -INF, NAN]
PAIRS_X = [x for x in GRID for _ in GRID]
PAIRS_Y = [y for _ in GRID for y in GRID]

BINARY = [
  param(lambda x, y: x + y, lambda x, y: x + y, name="add"),
  param(lambda x, y: x - y, lambda x, y: x - y, name="sub"),
  param(lambda x, y: x * y, lambda x, y: x * y, name="mul"),
  param(lambda x, y: x / y, lambda x, y: x / y, name="div"),
  param(lambda x, y: x ** y, lambda x, y: x ** y, name="pow"),
  param(torch.maximum, lambda x, y: x.maximum(y), name="maximum"),
  param(torch.minimum, lambda x, y: x.minimum(y), name="minimum"),
  param(torch.logaddexp, lambda x, y: x.logaddexp(y), name="logaddexp"),
  param(lambda x, y: torch.where(x > y, x, y), lambda x, y: (x > y).where(x, y), name="where"),
  param(lambda x, y: torch.lerp(x, y, 0.25), lambda x, y: x.lerp(y, 0.25), name="lerp"),
  param(lambda x, y: x % y, lambda x, y: x % y, name="remainder"),
  param(torch.atan2, lambda x, y: x.atan2(y), name="atan2"),
  param(torch.hypot, lambda x, y: x.hypot(y), name="hypot"),
  param(torch.xlogy, lambda x, y: x.xlogy(y), name="xlogy"),
  param(torch.fmod, lambda x, y: x.fmod(y), name="fmod"),
  param(lambda x, y: torch.clamp(x, min=y), lambda x, y: x.clamp(min=y), name="clamp-tensor-min"),
  param(lambda x, y: torch.clamp(x, max=y), lambda x, y: x.clamp(max=y), name="clamp-tensor-max"),
]


@pytest.mark.parametrize("torch_fn, ourgrad_fn", BINARY)
def test_binary_special_points(torch_fn: Any, ourgrad_fn: Any) -> None:
  check_special_points([PAIRS_X, PAIRS_Y], torch_fn, ourgrad_fn)


@pytest.mark.parametrize("torch_fn, ourgrad_fn", BINARY)
def test_binary_special_points_float64(torch_fn: Any, ourgrad_fn: Any) -> None:
  check_special_points([PAIRS_X, PAIRS_Y], torch_fn, ourgrad_fn, dtype=dtypes.float64, atol=1e-10, rtol=1e-9)


# the pow cases of issue 9, each a regression test of a wrong gradient
@pytest.mark.parametrize("base, exponent", [
  param([1.0], 3.0, name="cube-at-1"), param([0.0], 3.0, name="cube-at-0"), param([1.0], 1.5, name="1.5-at-1"),
  param([-2.0, -0.5], 1.5, name="negative-base-nan"), param([0.0, 2.0, -3.0, math.nan], 0.0, name="power-0"),
])
def test_pow_scalar_exponent_gradient(base: list[float], exponent: float) -> None:
  check_special_points([base], lambda x: x ** exponent, lambda x: x ** exponent)


def test_pow_zero_base_gradients() -> None:
  """0 ** y: both gradients 0 for y > 0 (NaN before the fix)."""
  check_special_points([[0.0, 0.0, 0.0], [2.0, 1.0, 0.5]], lambda x, y: x ** y, lambda x, y: x ** y)


def test_sign_and_rounding_backward_give_zeros() -> None:
  """sign, floor, ceil, round and trunc have a zero gradient (they raised in backward before)."""
  for name in ("sign", "floor", "ceil", "round", "trunc"):
    check_special_points([[-1.5, 0.0, 0.5, 2.5]], lambda x: getattr(x, name)(), lambda x: getattr(x, name)())


# ================================================================ reductions over rows of special values

ROWS = [[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, -1.0, -1.0], [INF, 1.0, 2.0, 3.0], [-INF, -INF, -INF, -INF],
        [NAN, 1.0, 2.0, 3.0], [INF, -INF, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0], [-1.0, 0.0, 1.0, 2.0],
        [INF, INF, 1.0, 0.0], [-0.0, 0.0, -2.0, 0.5]]
REDUCES = [
  same("sum", 1), same("mean", 1), same("amax", 1), same("amin", 1), same("prod", 1), same("logsumexp", 1),
  same("softmax", 1), same("log_softmax", 1), same("cumsum", 1), same("std", 1),
  same("var", 1), same("norm", dim=1), same("sum"), same("amax"), same("norm"),
  param(lambda x: x.max(dim=1).values, lambda x: x.max(dim=1).values, name="max-dim-values"),
  param(lambda x: x.min(dim=1).values, lambda x: x.min(dim=1).values, name="min-dim-values"),
  param(lambda x: x.sort(dim=1).values, lambda x: x.sort(1)[0], name="sort-values"),
  param(lambda x: x.norm(1, dim=1), lambda x: x.norm(1, dim=1), name="norm-1"),
]


@pytest.mark.parametrize("torch_fn, ourgrad_fn", REDUCES)
@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.float64], ids=str)
def test_reduce_special_points(torch_fn: Any, ourgrad_fn: Any, dtype: DType) -> None:
  """Ties split the gradient of amax/amin evenly (as torch's amax); max(dim=) and sort route it to the index they
  return (as torch)."""
  tolerance = 1e-5 if dtype == dtypes.float32 else 1e-10
  check_special_points([ROWS], torch_fn, ourgrad_fn, dtype=dtype, atol=tolerance, rtol=tolerance * 10)


@pytest.mark.parametrize("name", ["argmax", "argmin", "any", "all"])
def test_reduce_special_points_without_gradient(name: str) -> None:
  """First index of the extreme value (NaN counts as the extreme, as in torch); any/all of NaN are True."""
  check_special_points([ROWS], lambda x: getattr(x, name)(1), lambda x: getattr(x, name)(1), backward=False)


def test_cumprod_special_points() -> None:
  """Finite rows only: with an infinite or NaN element torch's cumprod gradient divides by it and gives NaN, where
  ours is the sum of products that the derivative is (10 for d/dx0 of cumprod([inf, 1, 2, 3]))."""
  finite_rows = [row for row in ROWS if all(math.isfinite(value) for value in row)]
  check_special_points([finite_rows], lambda x: x.cumprod(1), lambda x: x.cumprod(1))


def test_floor_divide_special_points() -> None:
  """Forward only (torch's floor_divide has no gradient): Python's // at zeros, infinities and NaN."""
  check_special_points([PAIRS_X, PAIRS_Y], torch.floor_divide, lambda x, y: x // y, backward=False)
