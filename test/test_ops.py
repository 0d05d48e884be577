"""Every Tensor op checked forward and backward against PyTorch on the CPU (the independent reference).

Most tests go through `helper_test_op` (test/helpers.py): the same seeded inputs are fed to a torch function and
an ourgrad function, outputs are compared (shape, dtype, values) and a random upstream gradient is pushed back
through both to compare every input's `.grad`. Where ourgrad differs from torch on purpose (Python ints are int32
here, int64 in torch) the test states our dtype explicitly.

Sections: creation, elementwise math, comparisons and logic, rounding, broadcasting, reductions, movement,
indexing (get and set), joining/splitting, linear algebra, dtypes (promotion, casts, every dtype), special
shapes (0-d, empty, non-contiguous) and the Tensor's own API. conv2d, pooling, layernorm and dropout are tested
in their own file.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as torch_functional
from helpers import (DTYPE_TOLERANCES, INT_DTYPES, TESTED_DTYPES, TORCH_DTYPES, as_numpy, assert_same,
                     helper_test_op, make_input_arrays, ourgrad_dtype_of, to_ourgrad, to_torch)

from ourgrad import Device, Tensor, dtypes
from ourgrad.dtype import DType
from ourgrad.errors import ShapeError


def param(*values: Any, name: str, marks: Any = ()) -> Any:
  """A pytest.param with a readable id."""
  return pytest.param(*values, id=name, marks=marks)


# ================================================================ creation

@pytest.mark.parametrize("data, expected_dtype", [
  param([1, 2, 3], dtypes.int32, name="int-list"),
  param((1, -2, 3), dtypes.int32, name="int-tuple"),
  param([[1.0, 2.0], [3.5, -4.0]], dtypes.float32, name="float-nested"),
  param([[1, 2.5], [3, 4]], dtypes.float32, name="mixed-int-float"),
  param([True, False, True], dtypes.bool, name="bool-list"),
  param([True, 2], dtypes.int32, name="bool-int"),
  param([], dtypes.float32, name="empty-list"),
  param(7, dtypes.int32, name="int-scalar"),
  param(-2.5, dtypes.float32, name="float-scalar"),
  param(True, dtypes.bool, name="bool-scalar"),
])
def test_tensor_from_python(data: Any, expected_dtype: DType) -> None:
  """Python data: values and shape as torch.tensor; Python ints become int32 (torch: int64)."""
  assert_same(Tensor(data), torch.tensor(data), 0, 0, expected_dtype=expected_dtype)


@pytest.mark.parametrize("dtype", [dtype for dtype in TESTED_DTYPES if dtype != dtypes.bfloat16], ids=str)
def test_tensor_from_numpy(dtype: DType) -> None:
  array = make_input_arrays([(2, 3)], dtype, low=-5, high=5)[0]
  assert_same(Tensor(array), torch.from_numpy(array), 0, 0)
  # a non-contiguous numpy view and a 0-d array
  assert_same(Tensor(array.T), torch.from_numpy(np.ascontiguousarray(array.T)), 0, 0)
  assert_same(Tensor(np.array(array[1, 2])), torch.from_numpy(np.array(array[1, 2])), 0, 0)


@pytest.mark.parametrize("data, dtype", [
  param([1, 2, 3], dtypes.float16, name="int-to-float16"),
  param([1.7, -1.7, 2.5], dtypes.int32, name="float-to-int32-truncates"),
  param([0.0, 1.0, -3.0], dtypes.bool, name="float-to-bool"),
  param([1.0, 3.140625, -2.0], dtypes.bfloat16, name="float-to-bfloat16"),
  param([[1, 2], [3, 4]], dtypes.int64, name="int-to-int64"),
  param(3, dtypes.float64, name="scalar-to-float64"),
])
def test_tensor_with_dtype(data: Any, dtype: DType) -> None:
  assert_same(Tensor(data, dtype=dtype), torch.tensor(data, dtype=TORCH_DTYPES[dtype]), 0, 0)


def test_tensor_from_tensor_and_errors() -> None:
  original = Tensor([1.0, 2.0])
  copy = Tensor(original, dtype=dtypes.int8)
  assert copy.dtype == dtypes.int8 and copy.tolist() == [1, 2]
  with pytest.raises(ShapeError): Tensor([[1, 2], [3]])
  with pytest.raises(TypeError): Tensor("abc")


@pytest.mark.parametrize("dtype", [None, dtypes.int8, dtypes.float16], ids=str)
def test_empty(dtype: DType | None) -> None:
  tensor = Tensor.empty(2, 3, dtype=dtype)
  assert tensor.shape == (2, 3) and tensor.dtype == (dtype or dtypes.float32)
  assert tensor.numpy().shape == (2, 3)
  assert Tensor.empty((4,)).shape == (4,) and Tensor.empty(0, 2).numpy().shape == (0, 2)


@pytest.mark.parametrize("make_ourgrad, make_torch, expected_dtype", [
  param(lambda: Tensor.zeros(2, 3), lambda: torch.zeros(2, 3), None, name="zeros"),
  param(lambda: Tensor.zeros((2, 3), dtype=dtypes.int8), lambda: torch.zeros((2, 3), dtype=torch.int8), None,
        name="zeros-int8"),
  param(lambda: Tensor.ones(4), lambda: torch.ones(4), None, name="ones"),
  param(lambda: Tensor.ones(2, 2, dtype=dtypes.bool), lambda: torch.ones(2, 2, dtype=torch.bool), None,
        name="ones-bool"),
  param(lambda: Tensor.full((2, 3), 2.5), lambda: torch.full((2, 3), 2.5), None, name="full-float"),
  param(lambda: Tensor.full((2, 3), -7), lambda: torch.full((2, 3), -7), dtypes.int32, name="full-int"),
  param(lambda: Tensor.full(3, True), lambda: torch.full((3,), True), None, name="full-bool"),
  param(lambda: Tensor.full((2,), 3, dtype=dtypes.float64), lambda: torch.full((2,), 3, dtype=torch.float64),
        None, name="full-dtype"),
  param(lambda: Tensor.full((), 4.0), lambda: torch.full((), 4.0), None, name="full-0d"),
  param(lambda: Tensor.zeros(0, 3), lambda: torch.zeros(0, 3), None, name="zeros-empty"),
])
def test_constant_creation(make_ourgrad: Any, make_torch: Any, expected_dtype: DType | None) -> None:
  assert_same(make_ourgrad(), make_torch(), 0, 0, expected_dtype=expected_dtype)


@pytest.mark.parametrize("args", [
  param((5,), name="stop"), param((2, 11, 3), name="start-stop-step"), param((5, -3, -2), name="negative-step"),
  param((3, 3), name="empty"), param((-4, 4), name="negative-start"),
  param((0, 1, 0.1), name="float-step"), param((1.5, -2.5, -0.5), name="float-negative-step"),
  param((0.0, 3), name="float-start"), param((-1, 1, 0.25), name="quarter-steps"),
])
def test_arange(args: tuple[Any, ...]) -> None:
  is_float = any(isinstance(arg, float) for arg in args)
  assert_same(Tensor.arange(*args), torch.arange(*args), 1e-6, 1e-6,
              expected_dtype=dtypes.float32 if is_float else dtypes.int32)


def test_arange_empty_when_step_points_away() -> None:
  """torch raises here; ourgrad gives an empty tensor, as numpy and Python's range do."""
  for args in ((5, 0), (0, 5, -1), (2.5, 1.0)):
    empty = Tensor.arange(*args)
    assert empty.shape == (0,) and empty.numpy().shape == (0,)


@pytest.mark.parametrize("dtype", [dtypes.int8, dtypes.int64, dtypes.float16, dtypes.float64], ids=str)
def test_arange_dtype(dtype: DType) -> None:
  assert_same(Tensor.arange(1, 9, 2, dtype=dtype), torch.arange(1, 9, 2, dtype=TORCH_DTYPES[dtype]), 0, 0)


@pytest.mark.parametrize("args", [
  param((0, 1, 5), name="unit"), param((-3, 7, 11), name="ints"), param((2.5, -1.5, 9), name="descending"),
  param((4, 8, 1), name="one-step"), param((0, 1, 0), name="no-steps"), param((0.1, 0.2, 100), name="many"),
])
def test_linspace(args: tuple[Any, ...]) -> None:
  assert_same(Tensor.linspace(*args), torch.linspace(*args), 1e-6, 1e-6)


@pytest.mark.parametrize("args, dtype", [
  param((3,), None, name="square"), param((2, 4), None, name="wide"), param((4, 2), dtypes.int32, name="tall-int"),
  param((3,), dtypes.bool, name="bool"), param((0,), None, name="empty"),
])
def test_eye(args: tuple[int, ...], dtype: DType | None) -> None:
  torch_dtype = TORCH_DTYPES[dtype] if dtype is not None else None
  assert_same(Tensor.eye(*args, dtype=dtype), torch.eye(*args, dtype=torch_dtype), 0, 0)


# random numbers: shape, dtype, range, rough statistics (100k samples: the checks are ~10 sigma wide)
RANDOM_SHAPE = (200, 500)


def test_rand() -> None:
  Tensor.manual_seed(1)
  values = Tensor.rand(*RANDOM_SHAPE)
  assert values.shape == RANDOM_SHAPE and values.dtype == dtypes.float32
  array = values.numpy()
  assert array.min() >= 0 and array.max() < 1
  assert abs(array.mean() - 0.5) < 0.01 and abs(array.std() - 1 / math.sqrt(12)) < 0.01
  assert Tensor.rand(2, 3, dtype=dtypes.float16).dtype == dtypes.float16
  assert Tensor.rand((3, 2)).shape == (3, 2) and Tensor.rand().shape == ()


def test_randn() -> None:
  Tensor.manual_seed(2)
  array = Tensor.randn(*RANDOM_SHAPE).numpy()
  assert array.dtype == np.float32 and array.shape == RANDOM_SHAPE
  assert abs(array.mean()) < 0.03 and abs(array.std() - 1) < 0.03
  # the tails a normal has and a uniform has not
  assert 0.002 < (np.abs(array) > 3).mean() < 0.004


def test_randint() -> None:
  Tensor.manual_seed(3)
  values = Tensor.randint(-3, 5, size=RANDOM_SHAPE)
  assert values.dtype == dtypes.int32 and values.shape == RANDOM_SHAPE
  array = values.numpy()
  assert set(np.unique(array).tolist()) == set(range(-3, 5))
  assert abs(array.mean() - 0.5) < 0.05
  one_bound = Tensor.randint(4, size=(1000,), dtype=dtypes.int64)
  assert one_bound.dtype == dtypes.int64 and set(np.unique(one_bound.numpy()).tolist()) == {0, 1, 2, 3}
  with pytest.raises(ValueError): Tensor.randint(3, 3, size=(2,))


def test_uniform_and_normal() -> None:
  Tensor.manual_seed(4)
  uniform = Tensor.uniform(*RANDOM_SHAPE, low=-3.0, high=2.0).numpy()
  assert uniform.min() >= -3 and uniform.max() < 2 and abs(uniform.mean() + 0.5) < 0.03
  assert abs(uniform.std() - 5 / math.sqrt(12)) < 0.03
  normal = Tensor.normal(*RANDOM_SHAPE, mean=2.0, std=3.0).numpy()
  assert normal.dtype == np.float32 and abs(normal.mean() - 2) < 0.1 and abs(normal.std() - 3) < 0.1


@pytest.mark.parametrize("make", [
  param(lambda: Tensor.rand(3, 4), name="rand"), param(lambda: Tensor.randn(3, 4), name="randn"),
  param(lambda: Tensor.randint(0, 100, size=(3, 4)), name="randint"),
  param(lambda: Tensor.uniform(3, 4, low=-1.0, high=1.0), name="uniform"),
  param(lambda: Tensor.normal(3, 4, mean=1.0, std=2.0), name="normal"),
])
def test_manual_seed_reproducible(make: Any) -> None:
  Tensor.manual_seed(1234)
  first, second = make().numpy(), make().numpy()
  Tensor.manual_seed(1234)
  again = make().numpy()
  np.testing.assert_array_equal(first, again)
  assert not np.array_equal(first, second), "consecutive draws must differ"
  Tensor.manual_seed(4321)
  assert not np.array_equal(first, make().numpy()), "another seed must give other numbers"


@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.int16, dtypes.bool, dtypes.float16], ids=str)
def test_like_creation(dtype: DType) -> None:
  base_array = make_input_arrays([(2, 3)], dtype)[0]
  ours, theirs = to_ourgrad(base_array, dtype), to_torch(base_array, dtype)
  assert_same(ours.zeros_like(), torch.zeros_like(theirs), 0, 0)
  assert_same(ours.ones_like(), torch.ones_like(theirs), 0, 0)
  assert_same(ours.full_like(1), torch.full_like(theirs, 1), 0, 0)
  assert_same(ours.zeros_like(dtype=dtypes.float64), torch.zeros_like(theirs, dtype=torch.float64), 0, 0)
  if dtype.is_float:
    for random_like in (ours.rand_like(), ours.randn_like()):
      assert random_like.shape == (2, 3) and random_like.dtype == dtype
    assert (ours.rand_like().numpy() >= 0).all() and (ours.rand_like().numpy() < 1).all()
  assert ours.rand_like(dtype=dtypes.float32).dtype == dtypes.float32


# ================================================================ elementwise math

UNARY_OPS = [
  param(lambda x: -x, None, {}, name="neg"),
  param(lambda x: x.abs(), None, {}, name="abs"),
  param(lambda x: x.sign(), None, {}, name="sign"),
  param(lambda x: x.sqrt(), None, {"low": 0.1, "high": 4}, name="sqrt"),
  param(lambda x: x.rsqrt(), None, {"low": 0.1, "high": 4}, name="rsqrt"),
  param(lambda x: x.exp(), None, {}, name="exp"),
  param(lambda x: x.exp2(), None, {}, name="exp2"),
  param(lambda x: x.log(), None, {"low": 0.1, "high": 4}, name="log"),
  param(lambda x: x.log2(), None, {"low": 0.1, "high": 4}, name="log2"),
  param(lambda x: x.sin(), None, {"low": -6, "high": 6}, name="sin"),
  param(lambda x: x.cos(), None, {"low": -6, "high": 6}, name="cos"),
  param(lambda x: x.tan(), None, {"low": -1.3, "high": 1.3}, name="tan"),
  param(lambda x: x.relu(), None, {}, name="relu"),
  param(lambda x: x.sigmoid(), None, {"low": -6, "high": 6}, name="sigmoid"),
  param(lambda x: x.tanh(), None, {"low": -4, "high": 4}, name="tanh"),
  param(lambda x: torch_functional.gelu(x), lambda x: x.gelu(), {"low": -4, "high": 4}, name="gelu"),
  param(lambda x: torch_functional.gelu(x, approximate="tanh"), lambda x: x.gelu("tanh"), {"low": -4, "high": 4},
        name="gelu-tanh"),
  param(lambda x: torch_functional.silu(x), lambda x: x.silu(), {"low": -4, "high": 4}, name="silu"),
  param(lambda x: torch_functional.softplus(x), lambda x: x.softplus(), {"low": -4, "high": 4}, name="softplus"),
  param(lambda x: torch_functional.softplus(x, beta=2, threshold=3), lambda x: x.softplus(2, 3),
        {"low": -4, "high": 4}, name="softplus-threshold"),
  param(lambda x: torch_functional.leaky_relu(x), lambda x: x.leaky_relu(), {}, name="leaky_relu"),
  param(lambda x: torch_functional.leaky_relu(x, 0.2), lambda x: x.leaky_relu(0.2), {}, name="leaky_relu-0.2"),
  param(lambda x: torch_functional.elu(x), lambda x: x.elu(), {}, name="elu"),
  param(lambda x: torch_functional.elu(x, alpha=0.5), lambda x: x.elu(0.5), {}, name="elu-alpha"),
  param(lambda x: torch_functional.hardswish(x), lambda x: x.hardswish(), {"low": -5, "high": 5}, name="hardswish"),
  param(lambda x: x.reciprocal(), None, {"low": 0.5, "high": 3}, name="reciprocal"),
  param(lambda x: x.square(), None, {}, name="square"),
  param(lambda x: x.clip(-0.5, 1.0), None, {}, name="clip"),
  param(lambda x: x.clip(min=0.3), lambda x: x.clip(0.3), {}, name="clip-min"),
  param(lambda x: x.clip(max=-0.3), lambda x: x.clip(max_=-0.3), {}, name="clip-max"),
]


@pytest.mark.parametrize("torch_fn, ourgrad_fn, options", UNARY_OPS)
def test_unary(torch_fn: Any, ourgrad_fn: Any, options: dict[str, Any]) -> None:
  helper_test_op([(3, 4)], torch_fn, ourgrad_fn, atol=1e-6, rtol=1e-4, **options)


SPECIAL_VALUES = [0.0, -0.0, 1.0, -1.0, 30.0, -30.0, 100.0, -100.0, math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("torch_fn, ourgrad_fn", [
  param(lambda x: x.exp(), None, name="exp"), param(lambda x: x.log(), None, name="log"),
  param(lambda x: x.sqrt(), None, name="sqrt"), param(lambda x: x.sigmoid(), None, name="sigmoid"),
  param(lambda x: x.tanh(), None, name="tanh"), param(lambda x: x.relu(), None, name="relu"),
  param(lambda x: x.abs(), None, name="abs"), param(lambda x: x.sign(), None, name="sign"),
  param(lambda x: torch_functional.softplus(x), lambda x: x.softplus(), name="softplus"),
  param(lambda x: torch_functional.silu(x), lambda x: x.silu(), name="silu"),
  param(lambda x: x.reciprocal(), None, name="reciprocal"),
])
def test_unary_special_values(torch_fn: Any, ourgrad_fn: Any) -> None:
  """Zeros, large values, infinities and NaN: forward values as torch."""
  helper_test_op([SPECIAL_VALUES], torch_fn, ourgrad_fn, atol=1e-6, rtol=1e-5, forward_only=True)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_special_values(approximate: str) -> None:
  """Without the infinities, where torch's gelu gives NaN (x * cdf(x) at +-inf) and ours may give the limit."""
  finite = [value for value in SPECIAL_VALUES if not math.isinf(value)]
  helper_test_op([finite], lambda x: torch_functional.gelu(x, approximate=approximate),
                 lambda x: x.gelu(approximate), atol=1e-6, rtol=1e-5, forward_only=True)


BINARY_OPS = [
  param(lambda x, y: x + y, None, {}, name="add"),
  param(lambda x, y: x - y, None, {}, name="sub"),
  param(lambda x, y: x * y, None, {}, name="mul"),
  param(lambda x, y: x / y, None, {"low": 0.5, "high": 3}, name="div"),
  param(lambda x, y: x / -y, None, {"low": 0.5, "high": 3}, name="div-negative"),
  param(lambda x, y: x ** y, None, {"low": 0.5, "high": 2}, name="pow"),
  param(lambda x, y: torch.maximum(x, y), lambda x, y: x.maximum(y), {}, name="maximum"),
  param(lambda x, y: torch.minimum(x, y), lambda x, y: x.minimum(y), {}, name="minimum"),
  param(lambda x, y: x % y, None, {"low": 0.5, "high": 3}, name="mod"),
  param(lambda x, y: (x - 1.5) % (y - 1.5), None, {"low": 0.5, "high": 3}, name="mod-signs"),
]
BROADCAST_SHAPES = [
  param((3, 4), (3, 4), name="same"), param((3, 1), (1, 4), name="outer"), param((2, 3, 4), (4,), name="trailing"),
  param((), (3, 4), name="0d-left"), param((2, 1, 4), (3, 1), name="both-sides"), param((3, 4), (), name="0d-right"),
]


@pytest.mark.parametrize("torch_fn, ourgrad_fn, options", BINARY_OPS)
@pytest.mark.parametrize("shape_x, shape_y", BROADCAST_SHAPES)
def test_binary(torch_fn: Any, ourgrad_fn: Any, options: dict[str, Any], shape_x: tuple[int, ...],
                shape_y: tuple[int, ...]) -> None:
  helper_test_op([shape_x, shape_y], torch_fn, ourgrad_fn, atol=1e-6, rtol=1e-4, **options)


@pytest.mark.parametrize("fn, options", [
  param(lambda x: x + 2, {}, name="add-int"), param(lambda x: 1.5 + x, {}, name="radd"),
  param(lambda x: x - 0.5, {}, name="sub"), param(lambda x: 3 - x, {}, name="rsub"),
  param(lambda x: x * -2, {}, name="mul"), param(lambda x: 0.5 * x, {}, name="rmul"),
  param(lambda x: x / 4, {}, name="div"), param(lambda x: 3 / x, {"low": 0.5, "high": 3}, name="rdiv"),
  param(lambda x: x ** 2, {}, name="pow2"), param(lambda x: x ** 3, {}, name="pow3-negative-base"),
  param(lambda x: x ** 0.5, {"low": 0.1, "high": 3}, name="pow-half"), param(lambda x: x ** -1, {"low": 0.5},
                                                                           name="pow-minus-one"),
  param(lambda x: x ** 0, {}, name="pow0"), param(lambda x: x ** 1, {}, name="pow1"),
  param(lambda x: x ** 2.5, {"low": 0.1, "high": 3}, name="pow-float"),
  param(lambda x: x ** -2, {"low": 0.5}, name="pow-minus-two"),
  param(lambda x: 2 ** x, {}, name="rpow"), param(lambda x: 0.5 ** x, {}, name="rpow-float"),
  param(lambda x: x % 0.7, {}, name="mod"), param(lambda x: x % -0.7, {}, name="mod-negative"),
  param(lambda x: x.maximum(torch.tensor(0.5)) if isinstance(x, torch.Tensor) else x.maximum(0.5), {},
        name="maximum"),
])
def test_binary_with_python_scalar(fn: Any, options: dict[str, Any]) -> None:
  helper_test_op([(3, 4)], fn, atol=1e-6, rtol=1e-4, **options)


@pytest.mark.parametrize("dtype", [dtypes.int8, dtypes.int32, dtypes.int64], ids=str)
def test_integer_pow(dtype: DType) -> None:
  """Integer tensors to non-negative integer powers stay integers (exact), as in torch."""
  helper_test_op([(3, 4)], lambda x: x ** 3, dtype=dtype, low=-4, high=4)
  helper_test_op([(3, 4)], lambda x: x ** 0, dtype=dtype, low=-4, high=4)


def test_pow_negative_base_and_special_exponents() -> None:
  base = [-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 2.0]
  exponent = [3.0, 2.0, 0.5, 0.0, -1.0, 1.0, -2.0]
  helper_test_op([base, exponent], lambda x, y: x ** y, forward_only=True)
  helper_test_op([[-2.0, -1.5, -0.5, 0.5, 1.5]], lambda x: x ** 3)


def test_floor_divide_float() -> None:
  """torch's floor_divide has no gradient: forward only."""
  helper_test_op([(3, 4), (3, 4)], lambda x, y: x // (y - 2.5), low=0.5, high=3, forward_only=True)
  helper_test_op([(3, 4)], lambda x: x // 0.3, forward_only=True)
  helper_test_op([(3, 4)], lambda x: 2 // (x + 3), forward_only=True)


def test_maximum_minimum_ties() -> None:
  """Equal inputs share the gradient equally, as in torch."""
  x_values, y_values = [1.0, 2.0, -3.0, 2.0, 0.0], [1.0, 3.0, -4.0, 2.0, 0.0]
  helper_test_op([x_values, y_values], lambda x, y: torch.maximum(x, y), lambda x, y: x.maximum(y))
  helper_test_op([x_values, y_values], lambda x, y: torch.minimum(x, y), lambda x, y: x.minimum(y))
  helper_test_op([[-1.0, 0.0, 0.5, 1.0, 2.0]], lambda x: x.clip(0.0, 1.0))


@pytest.mark.parametrize("shapes", [
  param([(3, 4), (3, 4), (3, 4)], name="same"), param([(3, 1), (1, 4), (4,)], name="broadcast"),
  param([(), (3, 4), ()], name="0d"),
])
def test_where(shapes: list[tuple[int, ...]]) -> None:
  def torch_where(condition: Any, x: Any, y: Any) -> Any: return torch.where(condition > 0, x, y)
  def ourgrad_where(condition: Any, x: Any, y: Any) -> Any: return (condition > 0).where(x, y)
  helper_test_op(shapes, torch_where, ourgrad_where)


def test_where_scalars_and_dtypes() -> None:
  helper_test_op([(3, 4)], lambda x: torch.where(x > 0, x, 0.5), lambda x: (x > 0).where(x, 0.5))
  helper_test_op([(3, 4)], lambda x: torch.where(x > 0, 2.0, x), lambda x: (x > 0).where(2.0, x))
  # both branches Python numbers: int and float give float32
  helper_test_op([(3, 4)], lambda x: torch.where(x > 0, 1, 2.5), lambda x: (x > 0).where(1, 2.5), forward_only=True)
  helper_test_op([(3, 4)], lambda x: torch.where(x > 0, 1, -1), lambda x: (x > 0).where(1, -1), forward_only=True,
                 expected_dtype=dtypes.int32)
  # an int condition means != 0; int and float branches promote
  helper_test_op([(3, 4)], lambda x: torch.where(x != 0, x, 7), lambda x: x.where(x, 7), dtype=dtypes.int32)
  helper_test_op([(3, 4)], lambda x: torch.where(x > 0, x, x.float() / 2), lambda x: (x > 0).where(x, x / 2),
                 dtype=dtypes.int32)


# ================================================================ comparisons and logic

COMPARISONS = [
  param(lambda x, y: x < y, name="lt"), param(lambda x, y: x <= y, name="le"), param(lambda x, y: x > y, name="gt"),
  param(lambda x, y: x >= y, name="ge"), param(lambda x, y: x == y, name="eq"), param(lambda x, y: x != y, name="ne"),
]


@pytest.mark.parametrize("compare", COMPARISONS)
@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.int32, dtypes.bool, dtypes.uint8], ids=str)
def test_comparison(compare: Any, dtype: DType) -> None:
  # integer-valued inputs give ties
  helper_test_op([(3, 4), (3, 4)], compare, dtype=dtype, low=-2, high=2, forward_only=True)
  helper_test_op([(3, 1), (4,)], compare, dtype=dtype, low=-2, high=2, forward_only=True)


@pytest.mark.parametrize("compare", COMPARISONS)
def test_comparison_with_scalar_and_grad_input(compare: Any) -> None:
  helper_test_op([(3, 4)], lambda x: compare(x, 0.5))
  helper_test_op([(3, 4)], lambda x: compare(1, x), dtype=dtypes.int32)
  helper_test_op([(3, 4)], lambda x: compare(x, 1.5), dtype=dtypes.int32)  # int tensor against a float
  helper_test_op([[1.0, math.nan, 2.0, math.inf]], lambda x: compare(x, 1.0), forward_only=True)


BITWISE_OPS = [
  param(lambda x, y: x & y, name="and"), param(lambda x, y: x | y, name="or"), param(lambda x, y: x ^ y, name="xor"),
]


@pytest.mark.parametrize("bitwise", BITWISE_OPS)
@pytest.mark.parametrize("dtype", [dtypes.bool] + INT_DTYPES, ids=str)
def test_bitwise(bitwise: Any, dtype: DType) -> None:
  helper_test_op([(3, 4), (3, 4)], bitwise, dtype=dtype, low=-100, high=100)
  helper_test_op([(3, 4)], lambda x: bitwise(x, 5) if dtype != dtypes.bool else bitwise(x, True), dtype=dtype,
                 low=-100, high=100)


@pytest.mark.parametrize("dtype", [dtypes.bool] + INT_DTYPES, ids=str)
def test_bitwise_not(dtype: DType) -> None:
  helper_test_op([(3, 4)], lambda x: ~x, dtype=dtype, low=-100, high=100)


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_shifts(dtype: DType) -> None:
  values = make_input_arrays([(3, 4)], dtype, low=-8, high=8)[0]
  amounts = make_input_arrays([(3, 4)], dtype, low=0, high=3, seed=1)[0]
  helper_test_op([values, amounts], lambda x, y: x << y, dtype=dtype)
  helper_test_op([values, amounts], lambda x, y: x >> y, dtype=dtype)
  helper_test_op([values], lambda x: x << 2, dtype=dtype)
  helper_test_op([values], lambda x: x >> 1, dtype=dtype)


@pytest.mark.parametrize("dtype", [dtypes.bool, dtypes.int32, dtypes.float32], ids=str)
def test_logical(dtype: DType) -> None:
  values = make_input_arrays([(3, 4), (3, 4)], dtype, low=-1, high=1)
  if dtype == dtypes.float32: values = [np.round(array) for array in values]  # zeros are what matters
  helper_test_op([values[0]], lambda x: x.logical_not(), dtype=dtype, forward_only=True)
  helper_test_op(values, lambda x, y: x.logical_and(y), dtype=dtype, forward_only=True)
  helper_test_op(values, lambda x, y: x.logical_or(y), dtype=dtype, forward_only=True)
  helper_test_op(values, lambda x, y: x.logical_xor(y), dtype=dtype, forward_only=True)


# ================================================================ rounding

ROUNDING_VALUES = [-3.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, -0.49999997, 0.49999997, 1.2, -1.7, 0.0, 2.0, -7.0,
                   1e10, -1e10, 123456.5, 0.7, -0.3]


@pytest.mark.parametrize("rounding", [
  param(lambda x: x.floor(), name="floor"), param(lambda x: x.ceil(), name="ceil"),
  param(lambda x: x.round(), name="round"), param(lambda x: x.trunc(), name="trunc"),
])
def test_rounding(rounding: Any) -> None:
  """Rounding (round: half to even); the gradient is zero, as in torch."""
  helper_test_op([ROUNDING_VALUES], rounding)
  helper_test_op([(3, 4)], rounding, low=-10, high=10)
  helper_test_op([[-2.5, -0.5, 0.5, 1.5, 2.5, 1.2, -1.7, 1e4]], rounding, dtype=dtypes.float16, forward_only=True)
  helper_test_op([[-2.5, -0.5, 0.5, 1.5, 2.5, 1.2, -1.7, 1e4]], rounding, dtype=dtypes.bfloat16, forward_only=True)
  helper_test_op([ROUNDING_VALUES + [2.0 ** 60, 0.5 + 2.0 ** -40]], rounding, dtype=dtypes.float64)
  helper_test_op([(3, 4)], rounding, dtype=dtypes.int32, low=-10, high=10)


# ================================================================ reductions

def torch_axis(axis: Any, ndim: int) -> Any:
  """torch wants an explicit tuple of dims where ourgrad takes None for all of them."""
  return tuple(range(ndim)) if axis is None else axis


REDUCE_AXES = [param(None, name="all"), param(0, name="0"), param(1, name="1"), param(-1, name="-1"),
               param((0, 2), name="0,2")]
KEEPDIM = [param(False, name="drop"), param(True, name="keep")]


@pytest.mark.parametrize("axis", REDUCE_AXES)
@pytest.mark.parametrize("keepdim", KEEPDIM)
def test_sum_mean_amax_amin(axis: Any, keepdim: bool) -> None:
  dims = torch_axis(axis, 3)
  helper_test_op([(2, 3, 4)], lambda x: x.sum(dims, keepdim=keepdim), lambda x: x.sum(axis, keepdim=keepdim),
                 atol=1e-5)
  helper_test_op([(2, 3, 4)], lambda x: x.mean(dims, keepdim=keepdim), lambda x: x.mean(axis, keepdim=keepdim))
  helper_test_op([(2, 3, 4)], lambda x: x.amax(dims, keepdim=keepdim), lambda x: x.max(axis, keepdim=keepdim))
  helper_test_op([(2, 3, 4)], lambda x: x.amin(dims, keepdim=keepdim), lambda x: x.min(axis, keepdim=keepdim))


@pytest.mark.parametrize("axis", REDUCE_AXES)
@pytest.mark.parametrize("correction", [0, 1])
def test_var_std(axis: Any, correction: int) -> None:
  dims = torch_axis(axis, 3)
  helper_test_op([(2, 3, 4)], lambda x: x.var(dims, correction=correction),
                 lambda x: x.var(axis, correction=correction), atol=1e-5)
  helper_test_op([(2, 3, 4)], lambda x: x.std(dims, correction=correction, keepdim=True),
                 lambda x: x.std(axis, correction=correction, keepdim=True), atol=1e-5)


def test_max_min_ties_share_gradient() -> None:
  """amax/amin spread the gradient evenly over tied extremes (torch.amax semantics)."""
  values = [[1.0, 3.0, 3.0, -1.0], [2.0, 2.0, 2.0, 2.0], [-5.0, 0.0, -5.0, 0.0]]
  helper_test_op([values], lambda x: x.amax(1), lambda x: x.max(1))
  helper_test_op([values], lambda x: x.amin(1), lambda x: x.min(1))
  helper_test_op([values], lambda x: x.amax(), lambda x: x.max())


@pytest.mark.parametrize("axis", [param(None, name="all"), param(0, name="0"), param(-1, name="-1")])
@pytest.mark.parametrize("keepdim", KEEPDIM)
def test_prod(axis: Any, keepdim: bool) -> None:
  if axis is None and keepdim:
    helper_test_op([(2, 3, 5)], lambda x: x.prod().reshape(1, 1, 1), lambda x: x.prod(None, keepdim=True),
                   low=0.5, high=1.5)
    return
  torch_fn = (lambda x: x.prod()) if axis is None else (lambda x: x.prod(axis, keepdim=keepdim))
  helper_test_op([(2, 3, 5)], torch_fn, lambda x: x.prod(axis, keepdim=keepdim), low=0.5, high=1.5)


@pytest.mark.parametrize("axis", [param(None, name="all"), param(0, name="0"), param(1, name="1"),
                                  param(-1, name="-1")])
@pytest.mark.parametrize("keepdim", KEEPDIM)
def test_argmax_argmin(axis: Any, keepdim: bool) -> None:
  # integer-valued floats: ties, where the first index wins
  values = np.round(make_input_arrays([(3, 4, 5)], low=-3, high=3)[0])
  helper_test_op([values], lambda x: x.argmax(axis, keepdim=keepdim), forward_only=True)
  helper_test_op([values], lambda x: x.argmin(axis, keepdim=keepdim), forward_only=True)
  helper_test_op([(3, 4, 5)], lambda x: x.argmax(axis, keepdim=keepdim), dtype=dtypes.int32, forward_only=True)
  helper_test_op([(3, 4, 5)], lambda x: x.argmin(axis, keepdim=keepdim), dtype=dtypes.int8, forward_only=True)


def test_argmax_nan_and_bool() -> None:
  helper_test_op([[[1.0, math.nan, 3.0], [2.0, 1.0, math.nan]]], lambda x: x.argmax(1), forward_only=True)
  # torch has no argmax of bools: numpy is the reference
  values = make_input_arrays([(3, 4)], dtypes.bool, seed=5)[0]
  for axis in (0, 1):
    for ours, expected in ((Tensor(values).argmax(axis), values.argmax(axis)),
                           (Tensor(values).argmin(axis), values.argmin(axis))):
      assert ours.dtype == dtypes.int64
      np.testing.assert_array_equal(ours.numpy(), expected)


@pytest.mark.parametrize("axis", REDUCE_AXES)
@pytest.mark.parametrize("keepdim", KEEPDIM)
@pytest.mark.parametrize("dtype", [dtypes.bool, dtypes.float32], ids=str)
def test_any_all(axis: Any, keepdim: bool, dtype: DType) -> None:
  dims = torch_axis(axis, 3)
  values = make_input_arrays([(2, 3, 4)], dtype, low=-1, high=1)[0]
  if dtype.is_float: values = np.round(values)
  helper_test_op([values], lambda x: x.any(dims, keepdim=keepdim), lambda x: x.any(axis, keepdim=keepdim),
                 dtype=dtype, forward_only=True)
  helper_test_op([values], lambda x: x.all(dims, keepdim=keepdim), lambda x: x.all(axis, keepdim=keepdim),
                 dtype=dtype, forward_only=True)


@pytest.mark.parametrize("axis", REDUCE_AXES)
@pytest.mark.parametrize("keepdim", KEEPDIM)
def test_logsumexp(axis: Any, keepdim: bool) -> None:
  dims = torch_axis(axis, 3)
  helper_test_op([(2, 3, 4)], lambda x: x.logsumexp(dims, keepdim=keepdim),
                 lambda x: x.logsumexp(axis, keepdim=keepdim), low=-5, high=5)


def test_logsumexp_extremes() -> None:
  helper_test_op([[[1000.0, 1000.0, -1000.0], [-math.inf, -math.inf, -math.inf]]], lambda x: x.logsumexp(1),
                 forward_only=True)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_softmax_log_softmax(axis: int) -> None:
  helper_test_op([(2, 3, 4)], lambda x: x.softmax(axis), low=-5, high=5)
  helper_test_op([(2, 3, 4)], lambda x: x.log_softmax(axis), low=-5, high=5)
  helper_test_op([[[1000.0, 0.0, -1000.0]]], lambda x: x.softmax(axis), forward_only=True)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_cumsum(axis: int) -> None:
  helper_test_op([(2, 3, 4)], lambda x: x.cumsum(axis), atol=1e-5)
  helper_test_op([(2, 3, 4)], lambda x: x.cumsum(axis), dtype=dtypes.int32, low=-50, high=50)


@pytest.mark.parametrize("dtype", [dtypes.bool, dtypes.int8, dtypes.uint8, dtypes.int32, dtypes.int64], ids=str)
def test_integer_reductions(dtype: DType) -> None:
  """Integer and bool sums and products accumulate in int64, max/min keep the dtype, as in torch."""
  helper_test_op([(3, 4)], lambda x: x.sum(), dtype=dtype, low=-100, high=100)
  helper_test_op([(3, 4)], lambda x: x.sum(1), dtype=dtype, low=-100, high=100)
  helper_test_op([(3, 4)], lambda x: x.prod(0), dtype=dtype, low=-3, high=3)
  if dtype != dtypes.bool:
    helper_test_op([(3, 4)], lambda x: x.amax(0), lambda x: x.max(0), dtype=dtype, low=-100, high=100)
    helper_test_op([(3, 4)], lambda x: x.amin(1), lambda x: x.min(1), dtype=dtype, low=-100, high=100)
  # torch has no mean of integers; ours promotes to float32 like float math on ints
  ours = to_ourgrad(make_input_arrays([(3, 4)], dtype, low=-100, high=100)[0], dtype)
  assert_same(ours.mean(0), to_torch(ours.numpy(), dtype).float().mean(0), 1e-5, 1e-6)


# ================================================================ movement

@pytest.mark.parametrize("torch_fn, ourgrad_fn, shape", [
  param(lambda x: x.reshape(4, 3), None, (3, 4), name="reshape"),
  param(lambda x: x.reshape(2, -1), None, (3, 4), name="reshape-infer"),
  param(lambda x: x.reshape(-1), None, (2, 3, 4), name="reshape-flat"),
  param(lambda x: x.reshape((12, 1)), None, (3, 4), name="reshape-tuple"),
  param(lambda x: x.reshape(()), None, (1, 1), name="reshape-0d"),
  param(lambda x: x.view(6, 2), None, (3, 4), name="view"),
  param(lambda x: x.permute(2, 0, 1), None, (2, 3, 4), name="permute"),
  param(lambda x: x.permute((1, 2, 0)), None, (2, 3, 4), name="permute-tuple"),
  param(lambda x: x.permute(-1, 0, 1), None, (2, 3, 4), name="permute-negative"),
  param(lambda x: x.transpose(0, 2), None, (2, 3, 4), name="transpose"),
  param(lambda x: x.transpose(-1, -2), None, (2, 3, 4), name="transpose-negative"),
  param(lambda x: x.T, None, (3, 4), name="T"),
  param(lambda x: x.expand(3, 4), None, (3, 1), name="expand"),
  param(lambda x: x.expand(2, 3, 4), None, (1, 4), name="expand-new-dims"),
  param(lambda x: x.expand(2, -1, 4), None, (3, 1), name="expand-minus-one"),
  param(lambda x: x.expand(2, 3), None, (), name="expand-0d"),
  param(lambda x: x.flip(0), None, (3, 4), name="flip"),
  param(lambda x: x.flip((0, 2)), None, (2, 3, 4), name="flip-two"),
  param(lambda x: x.flip(-1), None, (2, 3, 4), name="flip-negative"),
  param(lambda x: x.squeeze(), None, (1, 3, 1, 4), name="squeeze"),
  param(lambda x: x.squeeze(2), None, (1, 3, 1, 4), name="squeeze-dim"),
  param(lambda x: x.squeeze(1), None, (1, 3, 1, 4), name="squeeze-not-one"),
  param(lambda x: x.squeeze(-2), None, (1, 3, 1, 4), name="squeeze-negative"),
  param(lambda x: x.unsqueeze(0), None, (3, 4), name="unsqueeze"),
  param(lambda x: x.unsqueeze(-1), None, (3, 4), name="unsqueeze-last"),
  param(lambda x: x.unsqueeze(1), None, (3, 4), name="unsqueeze-middle"),
  param(lambda x: x.unsqueeze(0), None, (), name="unsqueeze-0d"),
  param(lambda x: x.flatten(), None, (2, 3, 4), name="flatten"),
  param(lambda x: x.flatten(1), None, (2, 3, 4), name="flatten-start"),
  param(lambda x: x.flatten(0, 1), None, (2, 3, 4), name="flatten-range"),
  param(lambda x: x.flatten(), None, (), name="flatten-0d"),
  param(lambda x: x.unflatten(1, (2, 2)), None, (3, 4), name="unflatten"),
  param(lambda x: x.unflatten(-1, (2, 1, 2)), None, (3, 4), name="unflatten-negative"),
  param(lambda x: x.repeat(2, 1), None, (3, 4), name="repeat"),
  param(lambda x: x.repeat(2, 1, 3), None, (3, 4), name="repeat-new-dim"),
  param(lambda x: x.repeat(2, 2), None, (), name="repeat-0d"),
  param(lambda x: x[1:3, 0:2], lambda x: x.shrink(((1, 3), (0, 2))), (3, 4), name="shrink"),
  param(lambda x: x[:, 1:], lambda x: x.shrink((None, (1, 4))), (3, 4), name="shrink-none"),
])
def test_movement(torch_fn: Any, ourgrad_fn: Any, shape: tuple[int, ...]) -> None:
  helper_test_op([shape], torch_fn, ourgrad_fn)


@pytest.mark.parametrize("torch_padding, ourgrad_padding", [
  param((1, 2), None, name="last-dim"),
  param((1, 2, 0, 1), None, name="two-dims"),
  param((0, 0, 2, 0, 1, 1), None, name="three-dims"),
  param((-1, 2), None, name="negative-crops"),
  param((2, 1, 1, 0), ((0, 0), (1, 0), (2, 1)), name="pairs"),
  param((0, 0, 1, 3), (None, (1, 3), None), name="pairs-none"),
  param((-1, 1, 0, -1), (None, (0, -1), (-1, 1)), name="pairs-negative"),
])
@pytest.mark.parametrize("value", [0.0, 1.5, -math.inf])
def test_pad(torch_padding: tuple[int, ...], ourgrad_padding: Any, value: float) -> None:
  padding = ourgrad_padding if ourgrad_padding is not None else torch_padding
  helper_test_op([(2, 3, 4)], lambda x: torch_functional.pad(x, torch_padding, value=value),
                 lambda x: x.pad(padding, value=value))


def test_pad_int_and_errors() -> None:
  helper_test_op([(3, 4)], lambda x: torch_functional.pad(x, (1, 1), value=7), lambda x: x.pad((1, 1), value=7),
                 dtype=dtypes.int32)
  with pytest.raises(ShapeError): Tensor.ones(3, 4).pad((1, 2, 3))
  with pytest.raises(ShapeError): Tensor.ones(3, 4).reshape(5, -1)
  with pytest.raises(ShapeError): Tensor.ones(3, 4).expand(3, 5)


# ================================================================ indexing

def torch_getitem(tensor: torch.Tensor, index: Any) -> torch.Tensor:
  """tensor[index] in torch, with numpy arrays as index tensors and negative-step slices (which torch lacks) done
  as a flip followed by a positive-step slice."""
  items = list(index) if isinstance(index, tuple) else [index]
  consumed = sum(1 for item in items if item is not None and item is not Ellipsis)
  expanded: list[Any] = []
  for item in items:
    if item is Ellipsis: expanded.extend([slice(None)] * (tensor.ndim - consumed))
    else: expanded.append(item)
  converted: list[Any] = []
  dim = 0
  for item in expanded:
    if item is None:
      converted.append(None)
      continue
    if isinstance(item, slice) and item.step is not None and item.step < 0:
      size = tensor.shape[dim]
      start, stop, step = item.indices(size)
      tensor = tensor.flip(dim)
      item = slice(size - 1 - start, size - 1 - stop, -step)  # the same elements, counted from the other end
    converted.append(torch.from_numpy(item) if isinstance(item, np.ndarray) else item)
    dim += 1
  return tensor[tuple(converted)]


def ourgrad_index(index: Any) -> Any:
  """The index with numpy arrays as ourgrad tensors."""
  if isinstance(index, tuple): return tuple(ourgrad_index(item) for item in index)
  return Tensor(index) if isinstance(index, np.ndarray) else index


BASIC_INDICES = [
  param(1, name="int"),
  param(-1, name="negative-int"),
  param((1, 2), name="two-ints"),
  param((-1, -2, -3), name="all-ints"),
  param(slice(1, 3), name="slice"),
  param(slice(None, None, 2), name="step"),
  param(slice(None, None, -1), name="reverse"),
  param(slice(3, 0, -2), name="negative-step"),
  param(slice(-2, None), name="negative-start"),
  param((slice(None), 1), name="second-dim"),
  param((slice(1, None, 2), None, slice(None, None, -2)), name="mixed-steps"),
  param(None, name="none"),
  param((None, 1, None), name="nones"),
  param(Ellipsis, name="ellipsis"),
  param((Ellipsis, 0), name="ellipsis-int"),
  param((0, Ellipsis, None), name="int-ellipsis-none"),
  param((slice(10, 20),), name="empty-slice"),
  param((slice(None, None, 3), 2, slice(5, 1, -3)), name="steps-3"),
  param((slice(-100, 100),), name="clamped-slice"),
]
TENSOR_INDICES = [
  param(np.array([0, 2]), name="one"), param(np.array([-1, 0, 3]), name="negative"),
  param(np.array([1, 1, 2]), name="repeated"), param(np.array([[0, 1], [3, 2]]), name="2d-index"),
  param((np.array([0, 1]), np.array([2, 3])), name="two-adjacent"),
  param((np.array([[0], [3]]), np.array([1, 2, 4])), name="two-broadcast"),
  param((np.array([0, 1]), slice(None), np.array([2, 3])), name="two-apart"),
  param((slice(None), np.array([0, 4]), np.array([-1, 2])), name="two-adjacent-middle"),
  param((1, slice(None), np.array([0, 5])), name="int-and-tensor"),
  param((slice(1, 3), np.array([[4, 0]])), name="slice-and-tensor"),
  param((Ellipsis, np.array([5, 0, 1])), name="ellipsis-and-tensor"),
  param((np.array([2]), None, slice(None, None, -1)), name="tensor-none-step"),
  param(np.array(2), name="0d-index"),
]


@pytest.mark.parametrize("index", BASIC_INDICES + TENSOR_INDICES)
def test_getitem(index: Any) -> None:
  helper_test_op([(4, 5, 6)], lambda x: torch_getitem(x, index), lambda x: x[ourgrad_index(index)])


def test_getitem_int_tensor_dtypes_and_errors() -> None:
  for index_dtype in (dtypes.int8, dtypes.int32, dtypes.int64, dtypes.uint8):
    index = np.array([2, 0, 1])
    helper_test_op([(3, 4)], lambda x: x[torch.from_numpy(index).long()],
                   lambda x: x[Tensor(index, dtype=index_dtype)], dtype=dtypes.int32)
  helper_test_op([(3, 4)], lambda x: x[torch.tensor([2, 0])], lambda x: x[Tensor([2, 0])], dtype=dtypes.bool)
  tensor = Tensor.ones(3, 4)
  with pytest.raises(IndexError): tensor[3]
  with pytest.raises(IndexError): tensor[0, 0, 0]
  with pytest.raises(IndexError): tensor[..., ...]


SETITEM_CASES = [
  param(1, 7.0, name="int-scalar"),
  param(-1, 7.0, name="negative-int"),
  param((1, 2), -3.0, name="element"),
  param(slice(1, 3), 2.5, name="slice"),
  param(slice(None, None, 2), 0.0, name="step"),
  param((slice(None), slice(None, None, -2)), 9.0, name="negative-step"),
  param((Ellipsis, 1), 4.0, name="ellipsis"),
  param(1, np.arange(6, dtype=np.float32), name="broadcast-tensor"),
  param(slice(0, 4, 3), np.arange(60, dtype=np.float32).reshape(2, 5, 6), name="tensor-value"),
  param((slice(None), 0, slice(1, None, 2)), np.array([[1.0, 2.0, 3.0]], dtype=np.float32), name="strided-tensor"),
]


@pytest.mark.parametrize("index, value", SETITEM_CASES)
@pytest.mark.parametrize("realized", [False, True])
def test_setitem(index: Any, value: Any, realized: bool) -> None:
  """numpy is the reference here: torch has no negative-step slices."""
  array = make_input_arrays([(4, 5, 6)])[0]
  ours = Tensor(array)
  if realized: ours = ours.contiguous().realize()
  expected = array.copy()
  expected[index] = value
  ours[index] = Tensor(value) if isinstance(value, np.ndarray) else value
  assert ours.dtype == dtypes.float32
  np.testing.assert_array_equal(ours.numpy(), expected)


def test_setitem_int_and_cast() -> None:
  ours, expected = Tensor.zeros(3, 4, dtype=dtypes.int32).contiguous().realize(), np.zeros((3, 4), np.int32)
  for index, value in ((0, 5), ((slice(None), 1), -2), ((2, slice(None, None, -3)), 9)):
    ours[index] = value
    expected[index] = value
  assert ours.dtype == dtypes.int32
  np.testing.assert_array_equal(ours.numpy(), expected)
  ours[1] = Tensor([1.7, 2.2, -3.9, 4.0])  # a float value into an int tensor is cast (truncated), as in torch
  expected[1] = [1, 2, -3, 4]
  np.testing.assert_array_equal(ours.numpy(), expected)


def test_flip_of_padded_reshape() -> None:
  """Regression: index math of a flip over a padded, reshaped view has negative numerators in its div/mod, which
  C's truncating / and % once got wrong ((1-i)%2 == -1 for i=2)."""
  spread = Tensor([1.0, 2.0, 3.0]).unsqueeze(1).pad(((0, 0), (0, 1))).reshape(6)  # [1, 0, 2, 0, 3, 0]
  assert spread.flip(0).tolist() == [0.0, 3.0, 0.0, 2.0, 0.0, 1.0]


def test_assign() -> None:
  weights = Tensor.zeros(3, 4).contiguous().realize()
  buffer_before = weights.lazydata.base.realized
  weights.assign(Tensor.ones(3, 4) * 2)
  np.testing.assert_array_equal(weights.numpy(), np.full((3, 4), 2.0, np.float32))
  weights.assign(weights * 3 + 1)  # reads its old value
  np.testing.assert_array_equal(weights.numpy(), np.full((3, 4), 7.0, np.float32))
  assert weights.lazydata.base.realized is buffer_before, "assign must write the same buffer"
  weights += 1
  weights.assign(5)  # a scalar broadcasts
  np.testing.assert_array_equal(weights.numpy(), np.full((3, 4), 5.0, np.float32))
  integers = Tensor.zeros(2, dtype=dtypes.int32).contiguous().realize()
  integers.assign(Tensor([1.9, -2.9]))  # cast to the target's dtype
  assert integers.dtype == dtypes.int32 and integers.tolist() == [1, -2]
  with pytest.raises(ShapeError): weights.assign(Tensor.ones(4, 3))
  lazy = Tensor.ones(2, 2)
  lazy.assign(Tensor.full((2, 2), 3.0))
  assert lazy.tolist() == [[3.0, 3.0], [3.0, 3.0]]


# ================================================================ joining and splitting

@pytest.mark.parametrize("shapes, dim", [
  param([(2, 3), (4, 3)], 0, name="dim0"), param([(2, 3), (2, 1), (2, 4)], 1, name="dim1-three"),
  param([(2, 3, 4), (2, 3, 2)], -1, name="dim-last"), param([(2, 3), (0, 3), (1, 3)], 0, name="with-empty"),
  param([(3,)], 0, name="one"),
])
def test_cat(shapes: list[tuple[int, ...]], dim: int) -> None:
  helper_test_op(shapes, lambda *xs: torch.cat(xs, dim), lambda *xs: Tensor.cat(xs, dim=dim))
  helper_test_op(shapes, lambda *xs: torch.cat(xs, dim), lambda *xs: Tensor.cat(xs, dim=dim), dtype=dtypes.int32)
  helper_test_op(shapes, lambda *xs: torch.cat(xs, dim), lambda *xs: Tensor.cat(xs, dim=dim), dtype=dtypes.bool)


def test_cat_mixed_dtypes() -> None:
  ours = Tensor.cat([Tensor([1, 2], dtype=dtypes.int8), Tensor([1.5], dtype=dtypes.float16)])
  assert_same(ours, torch.cat([torch.tensor([1, 2], dtype=torch.int8), torch.tensor([1.5], dtype=torch.float16)]),
              0, 0)


@pytest.mark.parametrize("dim", [0, 1, -1, 2])
def test_stack(dim: int) -> None:
  helper_test_op([(2, 3), (2, 3), (2, 3)], lambda *xs: torch.stack(xs, dim), lambda *xs: Tensor.stack(xs, dim=dim))


@pytest.mark.parametrize("torch_fn, ourgrad_fn", [
  param(lambda x: x.split(2), None, name="split-even"), param(lambda x: x.split(3, 1), None, name="split-uneven"),
  param(lambda x: x.split([1, 3, 1], 1), None, name="split-sizes"), param(lambda x: x.chunk(2), None, name="chunk"),
  param(lambda x: x.chunk(3, 1), None, name="chunk-uneven"), param(lambda x: x.chunk(4, -1), None,
                                                                  name="chunk-fewer"),
  param(lambda x: x.split(10), None, name="split-larger"),
])
def test_split_chunk(torch_fn: Any, ourgrad_fn: Any) -> None:
  helper_test_op([(4, 5)], torch_fn, ourgrad_fn)


@pytest.mark.parametrize("dim, index", [
  param(0, np.array([[0, 1, 2, 0], [2, 2, 1, 0]]), name="dim0"),
  param(1, np.array([[3, 0], [1, 1], [0, 2]]), name="dim1"),
  param(-1, np.array([[0], [3], [2]]), name="dim-last"),
  param(1, np.array([[0, 0, 0, 0, 0]]), name="index-smaller"),
])
def test_gather(dim: int, index: np.ndarray) -> None:
  helper_test_op([(3, 4)], lambda x: x.gather(dim, torch.from_numpy(index)),
                 lambda x: x.gather(dim, Tensor(index)))
  helper_test_op([(3, 4)], lambda x: x.gather(dim, torch.from_numpy(index)),
                 lambda x: x.gather(dim, Tensor(index)), dtype=dtypes.int32)


def test_gather_3d() -> None:
  index = make_input_arrays([(2, 3, 4)], dtypes.int64, low=0, high=4, seed=3)[0]
  helper_test_op([(2, 3, 5)], lambda x: x.gather(2, torch.from_numpy(index)), lambda x: x.gather(2, Tensor(index)))


# ================================================================ linear algebra

@pytest.mark.parametrize("shape_a, shape_b", [
  param((4,), (4,), name="vector-vector"), param((3, 4), (4,), name="matrix-vector"),
  param((4,), (4, 5), name="vector-matrix"), param((3, 4), (4, 5), name="matrix"),
  param((2, 3, 4), (2, 4, 5), name="batched"), param((2, 1, 3, 4), (5, 4, 2), name="broadcast-batch"),
  param((3, 4), (2, 4, 5), name="broadcast-left"), param((2, 3, 4), (4,), name="batched-vector"),
  param((45, 65), (65, 45), name="45x65"),
])
def test_matmul(shape_a: tuple[int, ...], shape_b: tuple[int, ...]) -> None:
  helper_test_op([shape_a, shape_b], lambda x, y: x @ y, atol=1e-5, grad_atol=1e-4)


def test_matmul_dot_and_dtypes() -> None:
  helper_test_op([(3, 4), (4, 2)], lambda x, y: x.matmul(y), atol=1e-5)
  helper_test_op([(4,), (4,)], lambda x, y: x.dot(y), atol=1e-5)
  helper_test_op([(3, 4), (4, 2)], lambda x, y: x @ y, dtype=dtypes.int32, low=-5, high=5)
  helper_test_op([(3, 4), (4, 2)], lambda x, y: x @ y, dtype=dtypes.float64, atol=1e-12)
  helper_test_op([(3, 4), (4, 2)], lambda x, y: x @ y, dtype=dtypes.float16, atol=1e-2, rtol=1e-2,
                 grad_atol=1e-2, grad_rtol=1e-2)
  with pytest.raises(ShapeError): Tensor.ones(3, 4) @ Tensor.ones(3, 4)


@pytest.mark.parametrize("shape_x", [(4,), (3, 4), (2, 3, 4)], ids=str)
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear(shape_x: tuple[int, ...], with_bias: bool) -> None:
  """weight is (out_features, in_features), as torch.nn.functional.linear."""
  shapes = [shape_x, (5, 4)] + ([(5,)] if with_bias else [])
  helper_test_op(shapes, lambda x, w, *b: torch_functional.linear(x, w, *b), lambda x, w, *b: x.linear(w, *b),
                 atol=1e-5)


# ================================================================ dtypes

def dtype_pairs(dtypes_list: list[DType]) -> list[Any]:
  return [param(first, second, name=f"{first.name}-{second.name}") for first in dtypes_list for second in dtypes_list]


@pytest.mark.parametrize("first, second", dtype_pairs(TESTED_DTYPES))
def test_promotion(first: DType, second: DType) -> None:
  """Mixed-dtype binary ops: result dtype and values as torch (every pair of the tested dtypes)."""
  arrays = [make_input_arrays([(5,)], dtype, low=0, high=4, seed=number)[0] for number, dtype in
            enumerate((first, second))]
  ours, theirs = [to_ourgrad(a, d) for a, d in zip(arrays, (first, second))], [to_torch(a, d) for a, d in
                                                                                zip(arrays, (first, second))]
  tolerance = max(DTYPE_TOLERANCES.get(first, (0, 0)), DTYPE_TOLERANCES.get(second, (0, 0)))
  assert_same(ours[0] * ours[1], theirs[0] * theirs[1], *tolerance)
  assert (ours[0] + ours[1]).dtype == ourgrad_dtype_of((theirs[0] + theirs[1]).dtype)
  assert (ours[0] < ours[1]).dtype == dtypes.bool
  assert ours[0].maximum(ours[1]).dtype == ourgrad_dtype_of(torch.maximum(theirs[0], theirs[1]).dtype)
  assert (ours[0] / ours[1]).dtype == ourgrad_dtype_of((theirs[0] / theirs[1]).dtype)
  assert Tensor.cat([ours[0], ours[1]]).dtype == ourgrad_dtype_of(torch.cat([theirs[0], theirs[1]]).dtype)


@pytest.mark.parametrize("dtype", TESTED_DTYPES, ids=str)
@pytest.mark.parametrize("scalar", [True, 3, -2, 2.5])
def test_promotion_with_python_scalar(dtype: DType, scalar: Any) -> None:
  """A Python scalar only raises the category; bool tensors with a Python int give int32 (torch: int64)."""
  array = make_input_arrays([(4,)], dtype, low=0, high=4)[0]
  ours, theirs = to_ourgrad(array, dtype), to_torch(array, dtype)
  if dtype == dtypes.bool and isinstance(scalar, bool):
    expected = torch.logical_or(theirs, torch.tensor(scalar))  # torch adds bools as or, like ours
    assert_same(ours + scalar, expected, 0, 0)
    return
  expected_dtype = dtypes.int32 if dtype == dtypes.bool and type(scalar) is int else None
  tolerance = DTYPE_TOLERANCES.get(expected_dtype or ourgrad_dtype_of((theirs * scalar).dtype), (0, 0))
  assert_same(ours * scalar, theirs * scalar, *tolerance, expected_dtype=expected_dtype)
  assert_same(scalar * ours, scalar * theirs, *tolerance, expected_dtype=expected_dtype)


def test_mixed_dtype_ops() -> None:
  """Promotion inside composite ops: where, maximum, comparisons, sum(dtype=), integer abs/neg wrap-around."""
  helper_test_op([(3, 4), (3, 4)], lambda x, y: torch.where(x > 0, x, y.half()),
                 lambda x, y: (x > 0).where(x, y.half()), dtype=dtypes.int8, low=-5, high=5)
  helper_test_op([(3, 4), (3, 4)], lambda x, y: torch.maximum(x, y.to(torch.int16)),
                 lambda x, y: x.maximum(y.cast(dtypes.int16)), dtype=dtypes.uint8, low=0, high=200)
  helper_test_op([(3, 4), (3, 4)], lambda x, y: x.to(torch.int64) < y.double(),
                 lambda x, y: x.cast(dtypes.int64) < y.cast(dtypes.float64), dtype=dtypes.int32, low=-3, high=3)
  helper_test_op([(3, 4)], lambda x: x.sum(1, dtype=torch.float64), lambda x: x.sum(1, dtype=dtypes.float64))
  helper_test_op([(3, 4)], lambda x: x.sum(0, dtype=torch.int8), lambda x: x.sum(0, dtype=dtypes.int8),
                 dtype=dtypes.int32, low=-100, high=100)
  extremes = [-128, 127, -1, 0]
  helper_test_op([extremes], lambda x: x.abs(), dtype=dtypes.int8)
  helper_test_op([extremes], lambda x: -x, dtype=dtypes.int8)
  with pytest.raises(ShapeError): Tensor.ones(3, 4) + Tensor.ones(5)


def test_promotion_wraps_like_torch() -> None:
  """uint8 tensor + 300 stays uint8 (wrapping), int8 + int8 overflow wraps, as in torch."""
  assert_same(Tensor([1, 2], dtype=dtypes.uint8) + 300, torch.tensor([1, 2], dtype=torch.uint8) + 300, 0, 0)
  assert_same(Tensor([100, -100], dtype=dtypes.int8) * 2, torch.tensor([100, -100], dtype=torch.int8) * 2, 0, 0)
  assert_same(Tensor([250], dtype=dtypes.uint8) + Tensor([10], dtype=dtypes.uint8),
              torch.tensor([250], dtype=torch.uint8) + torch.tensor([10], dtype=torch.uint8), 0, 0)
  # true division of ints gives float32, float math on ints too
  assert_same(Tensor([1, 2, 3]) / Tensor([2, 2, 2]), torch.tensor([1, 2, 3]) / torch.tensor([2, 2, 2]), 0, 0)
  assert_same(Tensor([1, 4, 9]).sqrt(), torch.tensor([1, 4, 9]).sqrt(), 1e-6, 1e-6)
  assert_same(Tensor([True, False]).exp(), torch.tensor([True, False]).exp(), 1e-6, 1e-6)
  assert_same(Tensor([1, 2], dtype=dtypes.int16) + 2.5, torch.tensor([1, 2], dtype=torch.int16) + 2.5, 0, 0)


INT_DIVISION_VALUES = ([7, -7, 7, -7, 0, 1, -1, 6, -6, 127, -128, 5],
                       [2, 2, -2, -2, 3, -3, 3, 3, -4, 10, 3, -5])


@pytest.mark.parametrize("dtype", [dtypes.int8, dtypes.int16, dtypes.int32, dtypes.int64], ids=str)
def test_integer_division_semantics(dtype: DType) -> None:
  """// rounds toward minus infinity and % takes the divisor's sign, as in torch and Python."""
  dividend, divisor = INT_DIVISION_VALUES
  helper_test_op([dividend, divisor], lambda x, y: x // y, dtype=dtype)
  helper_test_op([dividend, divisor], lambda x, y: x % y, dtype=dtype)
  helper_test_op([dividend], lambda x: x // -3, dtype=dtype)
  helper_test_op([dividend], lambda x: x % -3, dtype=dtype)
  helper_test_op([divisor], lambda x: 7 // x, dtype=dtype)
  helper_test_op([divisor], lambda x: -7 % x, dtype=dtype)
  helper_test_op([dividend, divisor], lambda x, y: torch.div(x, y, rounding_mode="trunc"),
                 lambda x, y: x.div(y, rounding_mode="trunc"), dtype=dtype)
  helper_test_op([dividend, divisor], lambda x, y: torch.div(x, y, rounding_mode="floor"),
                 lambda x, y: x.div(y, rounding_mode="floor"), dtype=dtype)


def test_unsigned_and_float_division() -> None:
  helper_test_op([[7, 200, 0, 255], [2, 3, 5, 16]], lambda x, y: x // y, dtype=dtypes.uint8)
  helper_test_op([[7, 200, 0, 255], [2, 3, 5, 16]], lambda x, y: x % y, dtype=dtypes.uint8)
  floats = ([7.5, -7.5, 7.5, -7.5, 0.0, 1.0], [2.0, 2.0, -2.0, -2.0, 3.0, -0.25])
  helper_test_op(list(floats), lambda x, y: x // y, forward_only=True)
  helper_test_op(list(floats), lambda x, y: x % y)
  helper_test_op(list(floats), lambda x, y: torch.div(x, y, rounding_mode="trunc"),
                 lambda x, y: x.div(y, rounding_mode="trunc"), forward_only=True)


def cast_values(source: DType, target: DType) -> np.ndarray:
  """Representative values of `source` whose cast to `target` is defined (float -> int of NaN, infinities and
  out-of-range values is undefined behaviour, in C and in torch)."""
  if source == dtypes.bool: return np.array([True, False, True])
  if source.is_int:
    candidates = [0, 1, -1, 2, 7, 100, -100, 127, -128, 255, 1000, -1000, 65535, 2 ** 31 - 1, -2 ** 31, 2 ** 40 + 3,
                  -2 ** 62, 2 ** 63 - 1]
    return np.array([value for value in candidates if source.min <= value <= source.max], dtype=source.np)
  candidates = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, 2.7, -2.7, 100.25, -100.25, 127.9, -128.9, 255.5, 300.0,
                1e4, -1e4, 65504.0, 1e5, 3e38, 1e-30, math.inf, -math.inf, math.nan]
  storage = np.float32 if source == dtypes.bfloat16 else source.np
  with np.errstate(over="ignore"):
    values = np.array(candidates, dtype=np.float64).astype(storage)
  if source == dtypes.bfloat16:
    values = torch.from_numpy(values).to(torch.bfloat16).float().numpy()
  if target.is_int:
    with np.errstate(invalid="ignore"):
      truncated = np.trunc(values.astype(np.float64))
      in_range = np.isfinite(truncated) & (truncated >= target.min) & (truncated <= target.max)
    values = values[in_range]
  return values


@pytest.mark.parametrize("source, target", dtype_pairs(TESTED_DTYPES))
def test_cast(source: DType, target: DType) -> None:
  """Casting between every pair of dtypes on representative values, as torch's .to(dtype)."""
  values = cast_values(source, target)
  ours = to_ourgrad(values, source).cast(target)
  theirs = to_torch(values, source).to(TORCH_DTYPES[target])
  assert_same(ours, theirs, 0, 0)


@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16, dtypes.float64], ids=str)
def test_float_dtypes_forward_backward(dtype: DType) -> None:
  """Float math in the narrow and wide float dtypes, with grads, at tolerances fit for the dtype."""
  atol, rtol = DTYPE_TOLERANCES[dtype]
  options = {"dtype": dtype, "atol": atol * 10, "rtol": rtol * 10, "grad_atol": atol * 10, "grad_rtol": rtol * 10}
  helper_test_op([(3, 4), (3, 4)], lambda x, y: x * y + x / (y.abs() + 1), **options)
  helper_test_op([(3, 4)], lambda x: x.exp().log().sigmoid(), **options)
  helper_test_op([(3, 4)], lambda x: (x.sin() * x.sqrt().relu()).tanh(), low=0.1, **options)
  helper_test_op([(3, 4)], lambda x: x.sum(1) + x.amax(1), lambda x: x.sum(1) + x.max(1), **options)
  helper_test_op([(3, 4)], lambda x: x.softmax(-1), **options)


EVERY_DTYPE_OPS = [  # (torch_fn = ourgrad_fn, the dtypes it applies to, id)
  param(lambda x, y: x + y, lambda dtype: True, name="add"),
  param(lambda x, y: x - y, lambda dtype: dtype != dtypes.bool, name="sub"),
  param(lambda x, y: x * y, lambda dtype: True, name="mul"),
  param(lambda x, y: torch.maximum(x, y) if isinstance(x, torch.Tensor) else x.maximum(y), lambda dtype: True,
        name="maximum"),
  param(lambda x, y: torch.minimum(x, y) if isinstance(x, torch.Tensor) else x.minimum(y), lambda dtype: True,
        name="minimum"),
  param(lambda x, y: x < y, lambda dtype: True, name="lt"),
  param(lambda x, y: x == y, lambda dtype: True, name="eq"),
  param(lambda x, y: -x, lambda dtype: dtype != dtypes.bool, name="neg"),
  param(lambda x, y: x.abs(), lambda dtype: dtype != dtypes.bool, name="abs"),
  param(lambda x, y: x.sign(), lambda dtype: True, name="sign"),
  param(lambda x, y: x.relu() if isinstance(x, Tensor) else torch.relu(x), lambda dtype: dtype != dtypes.bool,
        name="relu"),
  param(lambda x, y: (x > y).where(x, y) if isinstance(x, Tensor) else torch.where(x > y, x, y), lambda dtype: True,
        name="where"),
  param(lambda x, y: x.sum(1), lambda dtype: True, name="sum"),
  param(lambda x, y: x.amax(0) if isinstance(x, torch.Tensor) else x.max(0), lambda dtype: True, name="max"),
  param(lambda x, y: x.amin(1) if isinstance(x, torch.Tensor) else x.min(1), lambda dtype: True, name="min"),
  param(lambda x, y: x.cumsum(1), lambda dtype: True, name="cumsum"),
  param(lambda x, y: x.flip(0).permute(1, 0)[1:, ::2].reshape(-1), lambda dtype: True, name="movement"),
  param(lambda x, y: x.exp(), lambda dtype: dtype.is_float, name="exp"),
  param(lambda x, y: x.sqrt(), lambda dtype: dtype.is_float, name="sqrt"),
  param(lambda x, y: x.sigmoid(), lambda dtype: dtype.is_float, name="sigmoid"),
]


def every_dtype_cases() -> list[Any]:
  """(op, dtype) for each tested dtype the op applies to."""
  cases = []
  for op_param in EVERY_DTYPE_OPS:
    op, applies = op_param.values
    for dtype in TESTED_DTYPES:
      if applies(dtype): cases.append(param(op, dtype, name=f"{op_param.id}-{dtype.name}"))
  return cases


@pytest.mark.parametrize("op, dtype", every_dtype_cases())
def test_every_dtype(op: Any, dtype: DType) -> None:
  """Each op in each dtype it applies to: values and result dtype as torch, gradients for floats."""
  atol, rtol = DTYPE_TOLERANCES.get(dtype, (0, 0))
  low, high = (0, 3) if dtype.is_float else (-5, 5)
  helper_test_op([(3, 4), (3, 4)], op, atol=atol * 10, rtol=rtol * 10, grad_atol=atol * 10, grad_rtol=rtol * 10,
                 dtype=dtype, low=low, high=high)


# ================================================================ special shapes

@pytest.mark.parametrize("torch_fn, ourgrad_fn, shapes", [
  param(lambda x: x.exp(), None, [()], name="unary"),
  param(lambda x, y: x * y + y, None, [(), ()], name="binary"),
  param(lambda x: x.sum(), None, [()], name="sum"),
  param(lambda x: x.sum(0), None, [()], name="sum-axis0"),
  param(lambda x: x.amax(), lambda x: x.max(), [()], name="max"),
  param(lambda x: x.reshape(1, 1) * 2, None, [()], name="reshape"),
  param(lambda x: x.softmax(0), None, [()], name="softmax"),
  param(lambda x: x.cumsum(0), None, [()], name="cumsum"),
  param(lambda x, y: torch.stack([x, y]), lambda x, y: Tensor.stack([x, y]), [(), ()], name="stack"),
])
def test_zero_dim(torch_fn: Any, ourgrad_fn: Any, shapes: list[tuple[int, ...]]) -> None:
  helper_test_op(shapes, torch_fn, ourgrad_fn)


@pytest.mark.parametrize("torch_fn, ourgrad_fn, shapes", [
  param(lambda x: x.exp(), None, [(0, 3)], name="unary"),
  param(lambda x, y: x + y, None, [(0, 3), (1, 3)], name="binary-broadcast"),
  param(lambda x: x.sum(0), None, [(0, 3)], name="sum-empty-axis"),
  param(lambda x: x.sum(1), None, [(0, 3)], name="sum-other-axis"),
  param(lambda x: x.sum(), None, [(2, 0)], name="sum-all"),
  param(lambda x: x.mean(), None, [(2, 0)], name="mean"),
  param(lambda x: x.prod(0), None, [(0, 3)], name="prod"),
  param(lambda x: x.amax(0), lambda x: x.max(0), [(3, 0)], name="max-other-axis"),
  param(lambda x: x.reshape(3, 0), None, [(0, 3)], name="reshape"),
  param(lambda x: x.permute(1, 0).flip(0), None, [(0, 3)], name="permute-flip"),
  param(lambda x, y: x @ y, None, [(2, 0), (0, 3)], name="matmul-inner-empty"),
  param(lambda x, y: x @ y, None, [(0, 4), (4, 3)], name="matmul-outer-empty"),
  param(lambda x: x[1:1], None, [(3, 4)], name="getitem-empty"),
  param(lambda x: torch_functional.pad(x, (1, 1)), lambda x: x.pad((1, 1)), [(0, 2)], name="pad"),
  param(lambda x: x.cumsum(1), None, [(2, 0)], name="cumsum"),
  param(lambda x: x.softmax(0), None, [(0, 3)], name="softmax"),
])
def test_empty_tensors(torch_fn: Any, ourgrad_fn: Any, shapes: list[tuple[int, ...]]) -> None:
  helper_test_op(shapes, torch_fn, ourgrad_fn)


def test_realize_empty() -> None:
  for empty in (Tensor.zeros(0, 3).exp(), Tensor.ones(2, 0).sum(1), Tensor.ones(2, 3)[1:1] * 2,
                Tensor.cat([Tensor.ones(0, 3), Tensor.ones(0, 3)])):
    assert empty.realize() is empty and empty.numpy().shape == empty.shape


def test_empty_reductions_bool_and_errors() -> None:
  helper_test_op([(0, 3)], lambda x: x.any(0), dtype=dtypes.bool)
  helper_test_op([(0, 3)], lambda x: x.all(0), dtype=dtypes.bool)
  helper_test_op([(0, 3)], lambda x: x.any(1), dtype=dtypes.bool)
  helper_test_op([(0, 3)], lambda x: x.any(), dtype=dtypes.bool)
  helper_test_op([(0, 3)], lambda x: x.all(), dtype=dtypes.bool)
  with pytest.raises(ShapeError): Tensor.zeros(0, 3).max(0)


@pytest.mark.parametrize("torch_fn, ourgrad_fn, shapes", [
  param(lambda x, y: x.T + y, None, [(4, 3), (3, 4)], name="transposed-add"),
  param(lambda x: x.T.exp(), None, [(4, 3)], name="transposed-unary"),
  param(lambda x: x[::2, 1:] * 2, None, [(5, 4)], name="sliced"),
  param(lambda x: x.permute(2, 0, 1).sum(1), None, [(2, 3, 4)], name="permuted-sum"),
  param(lambda x, y: x.T @ y, None, [(4, 3), (4, 5)], name="transposed-matmul"),
  param(lambda x, y: x @ y.flip(1)[:, 1:], None, [(3, 4), (4, 5)], name="flipped-matmul"),
  param(lambda x: x.T.reshape(12), None, [(3, 4)], name="transposed-reshape"),
  param(lambda x: x[:, 1:3].reshape(-1).cumsum(0), None, [(3, 4)], name="sliced-cumsum"),
  param(lambda x: x.expand(3, 4).reshape(12) * 1.5, None, [(3, 1)], name="expanded-reshape"),
  param(lambda x: x.T.contiguous(), None, [(3, 4)], name="contiguous"),
  param(lambda x: x.T.softmax(0), None, [(3, 4)], name="transposed-softmax"),
  param(lambda x: x.flip(0)[1:, ::2].amax(0), lambda x: x.flip(0)[1:, ::2].max(0), [(5, 4)], name="strided-max"),
  param(lambda x: torch_functional.pad(x.T, (1, 0)).flip(1)[1:], lambda x: x.T.pad((1, 0)).flip(1)[1:], [(3, 4)],
        name="pad-of-transposed"),
  param(lambda x: x.permute(1, 0, 2).reshape(3, 8) @ x.reshape(8, 3), None, [(2, 3, 4)], name="reshape-chain"),
])
def test_non_contiguous_inputs(torch_fn: Any, ourgrad_fn: Any, shapes: list[tuple[int, ...]]) -> None:
  helper_test_op(shapes, torch_fn, ourgrad_fn, atol=1e-5)


# ================================================================ the Tensor's own API

def test_tensor_api() -> None:
  array = make_input_arrays([(2, 3)])[0]
  tensor = Tensor(array)
  assert tensor.realize() is tensor
  assert isinstance(tensor.numpy(), np.ndarray) and tensor.numpy().dtype == np.float32
  np.testing.assert_array_equal(tensor.numpy(), array)
  assert tensor.tolist() == array.tolist()
  assert tensor.shape == (2, 3) and tensor.ndim == 2 and tensor.numel() == 6 and len(tensor) == 2
  assert tensor.size() == (2, 3) and tensor.size(-1) == 3
  assert tensor.dtype == dtypes.float32
  assert tensor.device == Device.DEFAULT
  assert tensor.to(tensor.device) is tensor
  assert tensor.to("CPU").device == Device.canonicalize("CPU")
  np.testing.assert_array_equal(tensor.to("CPU").numpy(), array)
  assert Tensor([[2.5]]).item() == 2.5 and isinstance(Tensor(3).item(), int) and Tensor(True).item() is True
  with pytest.raises(ValueError): tensor.item()
  assert Tensor([[1, 2], [3, 4]]).tolist() == [[1, 2], [3, 4]]
  assert Tensor(1.5).tolist() == 1.5
  assert Tensor([1, 2], dtype=dtypes.bfloat16).numpy().dtype == np.float32


def test_cast_contiguous_and_numpy_of_views() -> None:
  tensor = Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
  transposed = tensor.T
  np.testing.assert_array_equal(transposed.numpy(), np.arange(12, dtype=np.float32).reshape(3, 4).T)
  contiguous = transposed.contiguous()
  assert contiguous.shape == (4, 3)
  np.testing.assert_array_equal(contiguous.numpy(), transposed.numpy())
  as_int = (tensor * 0.5).cast(dtypes.int8)
  assert as_int.dtype == dtypes.int8 and as_int.numpy().dtype == np.int8
  np.testing.assert_array_equal(as_int.numpy(), (np.arange(12) * 0.5).astype(np.int8).reshape(3, 4))
  assert tensor.cast("float16").dtype == dtypes.float16 and tensor.half().dtype == dtypes.float16
  assert tensor.int().dtype == dtypes.int32 and tensor.long().dtype == dtypes.int64
  assert tensor.bool().dtype == dtypes.bool and tensor.double().dtype == dtypes.float64
  assert tensor.float() is tensor
  np.testing.assert_array_equal(tensor[1:, ::2].numpy(), np.arange(12, dtype=np.float32).reshape(3, 4)[1:, ::2])


def test_cast_gradient() -> None:
  """Casts between floats pass the gradient through (converted back to the input's dtype)."""
  helper_test_op([(3, 4)], lambda x: x.double() * 2, lambda x: x.cast(dtypes.float64) * 2)
  helper_test_op([(3, 4)], lambda x: x.half().float() * 2, lambda x: x.cast(dtypes.float16).cast(dtypes.float32) * 2,
                 atol=1e-3, grad_atol=1e-3)
  helper_test_op([(3, 4)], lambda x: x * x.long(), lambda x: x * x.cast(dtypes.int64), low=-5, high=5)


def test_backward_accumulates_and_detach() -> None:
  array = make_input_arrays([(3,)])[0]
  ours, theirs = Tensor(array, requires_grad=True), torch.tensor(array, requires_grad=True)
  for _ in range(2):
    (ours * ours).sum().backward()
    (theirs * theirs).sum().backward()
  assert ours.grad is not None
  np.testing.assert_allclose(ours.grad.numpy(), as_numpy(theirs.grad), rtol=1e-6)
  detached = Tensor(array, requires_grad=True)
  (detached.detach() * detached).sum().backward()
  assert detached.grad is not None
  np.testing.assert_allclose(detached.grad.numpy(), array, rtol=1e-6)


def test_clone_has_its_own_memory() -> None:
  """In-place writes to a clone never reach the original, and the clone's gradient flows to the original."""
  original = Tensor([1.0, 2.0, 3.0]).realize()
  copy = original.clone()
  copy[0] = 5.0
  copy += 1
  np.testing.assert_array_equal(original.numpy(), [1.0, 2.0, 3.0])
  np.testing.assert_array_equal(copy.numpy(), [6.0, 3.0, 4.0])
  leaf = Tensor([1.0, 2.0], requires_grad=True)
  (leaf.clone() * 3).sum().backward()
  np.testing.assert_array_equal(leaf.grad.numpy(), [3.0, 3.0])
