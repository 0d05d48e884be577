"""The ops and spellings issue 9 added or fixed, forward and backward against PyTorch on the CPU.

Sections: reductions with an explicit axis on 0-d tensors, PyTorch's `dim=` keyword, indexing forms that crashed,
cat/stack spellings, the new elementwise ops (random points, several shapes and dtypes; their special points are in
test_special_points.py), movement ops, cumprod, sort/argsort/topk, multinomial (statistically), where with scalars,
and the torch.Tensor method names a model zoo uses.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as torch_functional
from helpers import TORCH_DTYPES, assert_same, helper_test_op

from ourgrad import Tensor, dtypes
from ourgrad.dtype import DType
from ourgrad.errors import AxisError, ShapeError


def param(*values: Any, name: str, marks: Any = ()) -> Any:
  return pytest.param(*values, id=name, marks=marks)


# ================================================================ 0-d tensors with an explicit axis

ZERO_D_REDUCES = [
  param(lambda x: x.sum(0), None, name="sum-0"), param(lambda x: x.sum(-1), None, name="sum-minus-1"),
  param(lambda x: x.sum(0, keepdim=True), None, name="sum-keepdim"),
  param(lambda x: x.mean(0), None, name="mean"), param(lambda x: x.amax(0), None, name="amax"),
  param(lambda x: x.amin(-1), None, name="amin"), param(lambda x: x.prod(0), None, name="prod"),
  param(lambda x: x.softmax(-1), None, name="softmax"), param(lambda x: x.log_softmax(0), None, name="log_softmax"),
  param(lambda x: x.logsumexp(0), None, name="logsumexp"), param(lambda x: x.cumsum(0), None, name="cumsum"),
  param(lambda x: x.cumprod(0), None, name="cumprod"), param(lambda x: x.norm(dim=0), None, name="norm"),
  param(lambda x: x.max(dim=0).values, None, name="max-dim"),
  param(lambda x: x.min(dim=0).values, None, name="min-dim"),
  param(lambda x: x.argmax(0), None, name="argmax"), param(lambda x: x.argmin(-1), None, name="argmin"),
  param(lambda x: x.std(0), None, name="std"), param(lambda x: x.var(0, correction=0), None, name="var-biased"),
  param(lambda x: x.any(0), None, name="any"), param(lambda x: x.all(0), None, name="all"),
  param(lambda x: x.sort(0)[0], None, name="sort"), param(lambda x: x.topk(1, 0)[0], None, name="topk"),
]


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch warns about std of one element
@pytest.mark.parametrize("torch_fn, ourgrad_fn", ZERO_D_REDUCES)
def test_zero_d_reduce_with_axis(torch_fn: Any, ourgrad_fn: Any) -> None:
  """Tensor(0.7).sum(0) and friends crashed; torch treats a 0-d tensor as having dims 0 and -1."""
  helper_test_op([[0.7]], lambda x: torch_fn(x.reshape(())), lambda x: (ourgrad_fn or torch_fn)(x.reshape(())),
                 check_dtype=False)


@pytest.mark.parametrize("call", [lambda x: x.sum(1), lambda x: x.softmax(2), lambda x: x.squeeze(1),
                                  lambda x: x.squeeze(-2), lambda x: x.argmax(1), lambda x: x.cumsum(-2)],
                         ids=["sum", "softmax", "squeeze", "squeeze-negative", "argmax", "cumsum"])
def test_zero_d_axis_out_of_range_raises(call: Any) -> None:
  """Out-of-range dims on a 0-d tensor raise, as in torch (squeeze used to return silently)."""
  with pytest.raises(IndexError):
    call(torch.tensor(0.7))
  with pytest.raises(AxisError):
    call(Tensor(0.7))


# ================================================================ PyTorch's dim= keyword

@pytest.mark.parametrize("name", ["sum", "mean", "amax", "amin", "prod", "std", "var", "logsumexp", "softmax",
                                  "log_softmax", "cumsum", "cumprod", "argmax", "argmin", "any", "all"])
def test_dim_keyword(name: str) -> None:
  kwargs: dict[str, Any] = {"dim": 1}
  if name not in ("softmax", "log_softmax", "cumsum", "cumprod"): kwargs["keepdim"] = True
  helper_test_op([(3, 4)], lambda x: getattr(x, name)(**kwargs), low=0.5, high=2,
                 forward_only=name in ("argmax", "argmin", "any", "all"), check_dtype=False)


@pytest.mark.parametrize("name", ["max", "min"])
def test_max_min_with_dim_keyword_give_values_and_indices(name: str) -> None:
  """x.max(dim=1) is PyTorch's (values, indices); x.max(1) stays tinygrad's values-only form."""
  values = np.array([[1.0, 5.0, 5.0, 0.0], [7.0, 2.0, 7.0, 7.0], [3.0, 3.0, 3.0, 3.0]], dtype=np.float32)
  ours, theirs = getattr(Tensor(values), name)(dim=1), getattr(torch.tensor(values), name)(dim=1)
  assert_same(ours.values, theirs.values, 0, 0)
  assert_same(ours.indices, theirs.indices, 0, 0)
  assert_same(getattr(Tensor(values), name)(1), theirs.values, 0, 0)
  helper_test_op([(3, 4)], lambda x: getattr(x, name)(dim=0, keepdim=True)[0])


# ================================================================ indexing forms that crashed

X = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
INDEXES = [
  param(lambda t, i: t[i, ...], name="tensor-then-ellipsis"),
  param(lambda t, i: t[[0], ...], name="list-then-ellipsis"),
  param(lambda t, i: t[None, i, ..., 1], name="none-tensor-ellipsis-int"),
  param(lambda t, i: t[..., i, 2], name="ellipsis-tensor-int"),
  param(lambda t, i: t[1, (2, 0, 1)], name="tuple-inside"),
  param(lambda t, i: t[i[0], (1, 2)], name="0d-tensor-and-tuple"),
  param(lambda t, i: t[:, [[0, 1], [2, 2]], (3, 1)], name="nested-list-and-tuple"),
]


@pytest.mark.parametrize("index", INDEXES)
def test_indexing_forms(index: Any) -> None:
  """Values as torch; gradients too (x[...] of a tensor that requires grad)."""
  helper_test_op([X], lambda t: index(t, torch.tensor([1, 0])), lambda t: index(t, Tensor([1, 0])))


@pytest.mark.filterwarnings("ignore:Using a non-tuple sequence")
def test_a_list_holding_sequences_or_tensors_is_a_tuple_of_indices() -> None:
  """As in PyTorch 2.13 (which warns that this reading is deprecated): a list shorter than 32 holding a sequence, a
  tensor, a slice, None or ... indexes like the tuple of its items; numpy reads it as one array index instead."""
  i_ours, i_torch = Tensor(1), torch.tensor(1)
  helper_test_op([X], lambda t: t[[i_torch, 1]], lambda t: t[[i_ours, 1]])
  helper_test_op([X], lambda t: t[[[1, 0], [0, 1]]])
  helper_test_op([X], lambda t: t[[[0]]])
  helper_test_op([X], lambda t: t[[slice(None), 1]])


def test_a_list_of_numbers_or_of_tensors_inside_a_tuple_is_one_index() -> None:
  i_ours, i_torch = Tensor(1), torch.tensor(1)
  helper_test_op([X], lambda t: t[(torch.tensor([[1, 0], [0, 1]]),)], lambda t: t[([[i_ours, 0], [0, i_ours]],)])
  helper_test_op([X], lambda t: t[torch.stack([i_torch, torch.tensor(1)]), :], lambda t: t[[i_ours, 1], :])


# ================================================================ cat and stack spellings

@pytest.mark.parametrize("spelling", [
  param(lambda a, b, c: type(a).cat([a, b, c], 1), name="list-positional-dim"),
  param(lambda a, b, c: type(a).cat([a, b, c], dim=1), name="list-keyword-dim"),
  param(lambda a, b, c: type(a).cat((a, b, c), dim=-1), name="tuple"),
  param(lambda a, b, c: type(a).cat(a, b, c, dim=1), name="varargs"),
  param(lambda a, b, c: a.cat(b, c, dim=1), name="method"),
])
def test_cat_spellings(spelling: Any) -> None:
  helper_test_op([(2, 3), (2, 1), (2, 4)], lambda a, b, c: torch.cat([a, b, c], 1),
                 lambda a, b, c: spelling(a, b, c))


@pytest.mark.parametrize("spelling", [
  param(lambda a, b: type(a).stack([a, b], 1), name="list-positional-dim"),
  param(lambda a, b: type(a).stack([a, b], dim=1), name="list-keyword-dim"),
  param(lambda a, b: type(a).stack(a, b, dim=1), name="varargs"),
  param(lambda a, b: a.stack(b, dim=1), name="method"),
])
def test_stack_spellings(spelling: Any) -> None:
  helper_test_op([(2, 3), (2, 3)], lambda a, b: torch.stack([a, b], 1), lambda a, b: spelling(a, b))


def test_cat_errors() -> None:
  a = Tensor.ones(2, 3)
  with pytest.raises(TypeError, match="dim="): a.cat(a, 1)
  with pytest.raises(ValueError): Tensor.cat([])
  with pytest.raises(ShapeError): a.cat(Tensor.ones(3, 3), dim=1)


# ================================================================ new elementwise ops, random points

FLOATS = [dtypes.float32, dtypes.float64]
SHAPES = [(5,), (3, 4), (2, 1, 3)]
NEW_UNARY = [
  param(lambda x: x.sinh(), None, {}, name="sinh"), param(lambda x: x.cosh(), None, {}, name="cosh"),
  param(lambda x: x.asinh(), None, {"low": -4, "high": 4}, name="asinh"),
  param(lambda x: x.acosh(), None, {"low": 1.1, "high": 5}, name="acosh"),
  param(lambda x: x.atanh(), None, {"low": -0.95, "high": 0.95}, name="atanh"),
  param(torch_functional.softsign, lambda x: x.softsign(), {}, name="softsign"),
  param(torch_functional.logsigmoid, lambda x: x.logsigmoid(), {"low": -10, "high": 10}, name="logsigmoid"),
  param(lambda x: x.log1p(), None, {"low": -0.9, "high": 3}, name="log1p"),
  param(lambda x: x.expm1(), None, {}, name="expm1"),
  param(lambda x: x.clamp_min(0.3), None, {}, name="clamp_min"),
  param(lambda x: x.clamp_max(-0.3), None, {}, name="clamp_max"),
  param(lambda x: x.nan_to_num(), None, {}, name="nan_to_num"),
]


@pytest.mark.parametrize("torch_fn, ourgrad_fn, options", NEW_UNARY)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_new_unary(torch_fn: Any, ourgrad_fn: Any, options: dict[str, Any], shape: tuple[int, ...],
                   dtype: DType) -> None:
  helper_test_op([shape], torch_fn, ourgrad_fn, dtype=dtype, atol=1e-6, rtol=1e-5, grad_atol=1e-6, grad_rtol=1e-5,
                 **options)


@pytest.mark.parametrize("name", ["sinh", "cosh", "asinh", "softsign", "expm1", "log1p"])
def test_new_unary_half(name: str) -> None:
  def call(x: Any) -> Any:
    return torch_functional.softsign(x) if isinstance(x, torch.Tensor) and name == "softsign" else getattr(x, name)()
  helper_test_op([(3, 4)], call, dtype=dtypes.float16, low=0, high=2, atol=2e-3, rtol=2e-3, grad_atol=2e-3,
                 grad_rtol=2e-3)


def test_log1p_expm1_tiny_values() -> None:
  """Accurate where 1 + x rounds to 1, unlike log(1 + x) and exp(x) - 1."""
  values = [1e-10, -3e-9, 1e-7, 2e-5, -1e-4]
  helper_test_op([values], lambda x: x.log1p(), atol=0, rtol=1e-6)
  helper_test_op([values], lambda x: x.expm1(), atol=0, rtol=1e-6)


@pytest.mark.parametrize("shapes", [[(3, 4), (3, 4)], [(3, 1), (1, 4)], [(2, 3, 4), (4,)]], ids=str)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_logaddexp(shapes: list[tuple[int, ...]], dtype: DType) -> None:
  helper_test_op(shapes, torch.logaddexp, lambda x, y: x.logaddexp(y), dtype=dtype, low=-30, high=30)


@pytest.mark.parametrize("weight", [param(0.3, name="scalar-low"), param(0.8, name="scalar-high"),
                                    param(None, name="tensor")])
def test_lerp(weight: Any) -> None:
  if weight is None:
    helper_test_op([(3, 4), (3, 4), (3, 4)], torch.lerp, lambda x, y, w: x.lerp(y, w), low=-1, high=1.5)
  else:
    helper_test_op([(3, 4), (1, 4)], lambda x, y: torch.lerp(x, y, weight), lambda x, y: x.lerp(y, weight))


@pytest.mark.parametrize("value", [param(2.5, name="float"), param(0, name="int")])
def test_masked_fill(value: Any) -> None:
  mask = np.array([[True, False, False, True]])
  helper_test_op([(3, 4)], lambda x: x.masked_fill(torch.tensor(mask), value),
                 lambda x: x.masked_fill(Tensor(mask), value))
  helper_test_op([(3, 4)], lambda x: x.masked_fill(torch.tensor(mask), value),
                 lambda x: x.masked_fill(Tensor(mask), value), dtype=dtypes.int32)


def test_addcmul_addcdiv() -> None:
  helper_test_op([(3, 4), (3, 4), (1, 4)], lambda x, a, b: x.addcmul(a, b, value=0.5))
  helper_test_op([(3, 4), (3, 4), (3, 4)], lambda x, a, b: x.addcdiv(a, b + 3, value=-2))


@pytest.mark.parametrize("form", [
  param(lambda where, c, x, y: where(c, x, 0.5), name="scalar-right"),
  param(lambda where, c, x, y: where(c, -1, y), name="scalar-left"),
  param(lambda where, c, x, y: where(c, x, y), name="tensors"),
])
def test_where_forms(form: Any) -> None:
  """Tensor.where(cond, x, y) with a scalar on either side, like torch.where."""
  condition = np.array([[True, False, True, False]])
  helper_test_op([(3, 4), (3, 4)], lambda x, y: form(torch.where, torch.tensor(condition), x, y),
                 lambda x, y: form(Tensor.where, Tensor(condition), x, y))


def test_where_both_scalars() -> None:
  condition = np.array([True, False, True])
  assert_same(Tensor.where(Tensor(condition), 1.5, -2.0), torch.where(torch.tensor(condition), 1.5, -2.0), 0, 0)


# ================================================================ movement, linear algebra, cumulative ops

@pytest.mark.parametrize("torch_fn, ourgrad_fn", [
  param(lambda x: x.roll(1, 2), None, name="roll"), param(lambda x: x.roll((2, -5), (0, 2)), None, name="roll-two"),
  param(lambda x: x.roll(7), None, name="roll-flat"), param(lambda x: x.triu(), None, name="triu"),
  param(lambda x: x.triu(1), None, name="triu-1"), param(lambda x: x.tril(-1), None, name="tril-minus-1"),
  param(lambda x: x.tril(2), None, name="tril-2"), param(lambda x: x.diagonal(), None, name="diagonal"),
  param(lambda x: x.diagonal(1, 1, 2), None, name="diagonal-offset"),
  param(lambda x: x.diagonal(-1, 2, 1), None, name="diagonal-below"),
  param(lambda x: x.repeat_interleave(2, 1), None, name="repeat_interleave"),
  param(lambda x: x.repeat_interleave(3), None, name="repeat_interleave-flat"),
  param(lambda x: x.narrow(2, 1, 2), None, name="narrow"), param(lambda x: x.narrow(1, -2, 2), None, name="narrow-neg"),
  param(lambda x: x.movedim(0, -1), None, name="movedim"),
  param(lambda x: x.movedim((0, 1), (2, 0)), None, name="movedim-two"),
  param(lambda x: x.swapaxes(0, 2), None, name="swapaxes"), param(lambda x: x.diff(), None, name="diff"),
  param(lambda x: x.diff(2, 1), None, name="diff-2"), param(lambda x: x.cumprod(2), None, name="cumprod"),
  param(lambda x: x.cumprod(0), None, name="cumprod-0"), param(lambda x: x[0].trace(), None, name="trace"),
  param(lambda x: x[0].diag(), None, name="diag-of-matrix"), param(lambda x: x[0, 0].diag(1), None, name="diag-1"),
  param(lambda x: x[0, 0].diag(-2), None, name="diag-minus-2"),
  param(lambda x: x.norm(dim=2), None, name="norm"), param(lambda x: x.norm(1, dim=(0, 2)), None, name="norm-1"),
  param(lambda x: torch.var_mean(x, dim=1), lambda x: x.var_mean(dim=1), name="var_mean"),
  param(lambda x: torch.std_mean(x, dim=2), lambda x: x.std_mean(dim=2), name="std_mean"),
  param(lambda x: x.prod(2), None, name="prod"),
])
def test_movement_and_reduce_ops(torch_fn: Any, ourgrad_fn: Any) -> None:
  helper_test_op([(2, 3, 4)], torch_fn, ourgrad_fn, low=-1.5, high=1.5)


def test_cumprod_with_zeros() -> None:
  """Zeros in the row: exact values and torch's gradients."""
  helper_test_op([[[1.5, 0.0, 2.0, -1.0, 0.0, 3.0], [0.0, 2.0, 0.5, 1.0, 4.0, -2.0]]], lambda x: x.cumprod(1))


def test_cumprod_integers() -> None:
  helper_test_op([(2, 5)], lambda x: x.cumprod(1), dtype=dtypes.int32, low=-3, high=3)


def test_one_hot() -> None:
  indices = np.array([[0, 3], [2, 1]])
  assert_same(Tensor(indices).one_hot(5), torch_functional.one_hot(torch.tensor(indices), 5), 0, 0)
  assert_same(Tensor(indices).one_hot(), torch_functional.one_hot(torch.tensor(indices)), 0, 0)


@pytest.mark.parametrize("torch_fn, ourgrad_fn, shapes", [
  param(lambda a, b: a.mm(b), None, [(3, 4), (4, 5)], name="mm"),
  param(lambda a, b: a.bmm(b), None, [(2, 3, 4), (2, 4, 5)], name="bmm"),
  param(lambda c, a, b: c.baddbmm(a, b, beta=0.5, alpha=2), None, [(2, 3, 5), (2, 3, 4), (2, 4, 5)], name="baddbmm"),
  param(lambda c, a, b: c.addmm(a, b), None, [(3, 5), (3, 4), (4, 5)], name="addmm"),
  param(lambda a, b: a.outer(b), None, [(3,), (4,)], name="outer"),
])
def test_linear_algebra(torch_fn: Any, ourgrad_fn: Any, shapes: list[tuple[int, ...]]) -> None:
  helper_test_op(shapes, torch_fn, ourgrad_fn, atol=1e-5)


# ================================================================ sort, argsort, topk

def _rows_with_ties(dtype: DType) -> np.ndarray:
  values = np.random.default_rng(3).integers(-3, 4, size=(4, 9)).astype(dtype.np)
  if dtype.is_float: values[1, 2], values[2, 5], values[2, 7] = np.nan, np.nan, np.inf
  return values


@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.float64, dtypes.int32, dtypes.int8], ids=str)
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_sort_stable(dtype: DType, descending: bool, dim: int) -> None:
  """Values and indices as torch's stable sort, with ties, NaN and inf."""
  values = _rows_with_ties(dtype)
  ours = Tensor(values).sort(dim, descending=descending)
  theirs = torch.tensor(values).sort(dim=dim, descending=descending, stable=True)
  assert_same(ours[0], theirs.values, 0, 0)
  assert_same(ours[1], theirs.indices, 0, 0)
  assert_same(Tensor(values).argsort(dim, descending), torch.tensor(values).argsort(dim=dim, descending=descending,
                                                                                     stable=True), 0, 0)


def test_sort_gradient() -> None:
  helper_test_op([(3, 6)], lambda x: x.sort(dim=1, descending=True)[0], lambda x: x.sort(1, descending=True)[0])
  helper_test_op([(3, 6)], lambda x: x.sort(dim=0)[0], lambda x: x.sort(0)[0])


@pytest.mark.parametrize("k, dim, largest", [(3, -1, True), (1, 0, True), (2, 1, False), (6, 1, True)])
def test_topk(k: int, dim: int, largest: bool) -> None:
  """Distinct random values (torch leaves the order of ties unspecified): values, indices and gradients."""
  outputs = helper_test_op([(4, 6)], lambda x: x.topk(k, dim, largest)[0])
  assert outputs
  values = np.random.default_rng(5).permutation(24).reshape(4, 6).astype(np.float32)
  assert_same(Tensor(values).topk(k, dim, largest)[1], torch.tensor(values).topk(k, dim, largest)[1], 0, 0)


def test_topk_ties_take_the_earlier_index() -> None:
  values, indices = Tensor([1.0, 3.0, 3.0, 2.0, 3.0]).topk(2)
  assert values.tolist() == [3.0, 3.0] and indices.tolist() == [1, 2]


# ================================================================ multinomial (statistics over many draws)

def _chi_square(counts: np.ndarray, probabilities: np.ndarray) -> float:
  expected = probabilities * counts.sum()
  keep = expected > 0
  return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


def test_multinomial_with_replacement_distribution() -> None:
  """20000 draws: no zero-weight category ever drawn, and a chi-square far below the 1e-6 tail (8 degrees: 45)."""
  Tensor.manual_seed(1)
  weights = np.array([0.5, 0.0, 2.0, 1.0, 0.25, 3.0, 0.0, 1.25, 1.0, 0.75], dtype=np.float32)
  samples = Tensor(weights).multinomial(20000, replacement=True).numpy()
  assert samples.shape == (20000,) and samples.dtype == np.int64
  counts = np.bincount(samples, minlength=len(weights))
  assert counts[weights == 0].sum() == 0
  assert _chi_square(counts, weights / weights.sum()) < 45


def test_multinomial_without_replacement() -> None:
  """Each row draws distinct categories, never a zero weight; drawing all is a permutation; the first draw of many
  rows follows the weights."""
  Tensor.manual_seed(2)
  weights = np.array([1.0, 0.0, 4.0, 2.0, 3.0], dtype=np.float32)
  rows = Tensor(np.tile(weights, (4000, 1))).multinomial(4)
  drawn = rows.numpy()
  assert drawn.shape == (4000, 4)
  assert all(len(set(row)) == 4 for row in drawn) and not (drawn == 1).any()
  first = np.bincount(drawn[:, 0], minlength=5)
  assert _chi_square(first, weights / weights.sum()) < 30  # 3 degrees of freedom: far beyond the 1e-6 tail
  # the second draw is from the weights without the first: P(second = j) summed over the first draw
  probabilities = weights / weights.sum()
  second = np.zeros(5)
  for i in range(5):
    rest = probabilities.copy()
    rest[i] = 0
    if rest.sum() > 0: second += probabilities[i] * rest / rest.sum()
  assert _chi_square(np.bincount(drawn[:, 1], minlength=5), second) < 30
  everything = Tensor([0.2, 0.3, 0.5]).multinomial(3).numpy()
  assert sorted(everything.tolist()) == [0, 1, 2]


def test_multinomial_errors() -> None:
  with pytest.raises(ShapeError): Tensor([0.5, 0.5]).multinomial(3)
  with pytest.raises(ShapeError): Tensor.ones(2, 2, 2).multinomial(1)


# ================================================================ the torch.Tensor names a model zoo uses

ZOO_METHODS = ["clamp_min", "clamp_max", "addcmul", "addcdiv", "expm1", "log1p", "erf", "rsqrt", "square", "flatten",
               "unflatten", "repeat_interleave", "chunk", "split", "narrow", "isnan", "isinf", "isfinite",
               "nan_to_num", "amax", "amin", "prod", "all", "any", "std_mean", "var_mean", "diff", "trace", "diag",
               "outer", "bmm", "mm", "matmul", "baddbmm", "new_zeros", "new_ones", "new_full", "new_empty",
               "new_tensor", "type_as", "float", "half", "int", "long", "numel", "dim", "size", "element_size",
               "masked_fill", "roll", "triu", "tril", "sort", "argsort", "topk", "cumprod", "cumsum", "lerp",
               "logaddexp", "sinh", "cosh", "asinh", "acosh", "atanh", "softsign", "expand_as", "view_as",
               "reshape_as", "movedim", "swapaxes", "diagonal", "norm", "requires_grad_", "add_", "sub_", "mul_",
               "div_", "zero_", "fill_", "copy_", "clamp_", "uniform_", "normal_", "multinomial", "one_hot",
               "atan", "asin", "acos", "atan2", "hypot", "logit", "xlogy", "erfc", "frac", "nansum", "nanmean", "t",
               "tile", "unbind", "select", "index_select", "scatter", "scatter_add", "index_add", "fmax", "fmin",
               "isclose", "allclose", "equal", "count_nonzero", "signbit", "divide", "multiply", "subtract",
               "median", "kthvalue", "quantile", "cummax", "cummin", "logcumsumexp"]


def test_model_zoo_method_names_exist() -> None:
  missing = [name for name in ZOO_METHODS if not hasattr(Tensor, name)]
  assert not missing, f"missing Tensor methods: {missing}"
  # the list holds torch's names (a few are functions of torch or torch.nn.functional rather than methods)
  assert all(any(hasattr(space, name) for space in (torch.Tensor, torch, torch_functional)) for name in ZOO_METHODS)


def test_new_and_type_methods() -> None:
  base_ours, base_torch = Tensor.ones(2, dtype=dtypes.float16), torch.ones(2, dtype=torch.float16)
  assert_same(base_ours.new_zeros(2, 3), base_torch.new_zeros(2, 3), 0, 0)
  assert_same(base_ours.new_ones((3,)), base_torch.new_ones((3,)), 0, 0)
  assert_same(base_ours.new_full((2,), 5), base_torch.new_full((2,), 5), 0, 0)
  assert_same(base_ours.new_tensor([1, 2]), base_torch.new_tensor([1, 2]), 0, 0)
  assert base_ours.new_empty(4).shape == (4,) and base_ours.new_empty(4).dtype == dtypes.float16
  assert_same(Tensor([1, 2]).type_as(base_ours), torch.tensor([1, 2]).type_as(base_torch), 0, 0)


def test_in_place_methods() -> None:
  ours, theirs = Tensor([1.0, -2.0, 3.0]).realize(), torch.tensor([1.0, -2.0, 3.0])
  for step in (lambda t: t.add_(2), lambda t: t.mul_(3), lambda t: t.sub_(1, alpha=2), lambda t: t.div_(4),
               lambda t: t.clamp_(-1, 2), lambda t: t.add_(t, alpha=0.5)):
    result = step(ours)
    step(theirs)
    assert result is ours
    assert_same(ours, theirs, 1e-6, 1e-6)
  ours.zero_()
  assert ours.tolist() == [0.0, 0.0, 0.0]
  ours.fill_(2.5)
  assert ours.tolist() == [2.5, 2.5, 2.5]
  ours.copy_(Tensor([1, 2, 3]))
  assert ours.tolist() == [1.0, 2.0, 3.0] and ours.dtype == dtypes.float32
  weight = Tensor.empty(200, 50).realize()
  values = weight.uniform_(-0.5, 0.5).numpy()
  assert values.min() >= -0.5 and values.max() < 0.5 and abs(values.mean()) < 0.02
  values = weight.normal_(1.0, 2.0).numpy()
  assert abs(values.mean() - 1.0) < 0.05 and abs(values.std() - 2.0) < 0.05
  leaf = Tensor([1.0, 2.0]).requires_grad_()
  (leaf * leaf).sum().backward()
  assert leaf.grad is not None and leaf.grad.tolist() == [2.0, 4.0]


# ================================================================ special functions (tensor_special.py) and aliases

SPECIAL_UNARY = [
  param(lambda x: x.atan(), None, {"low": -8, "high": 8}, name="atan"),
  param(lambda x: x.asin(), None, {"low": -0.99, "high": 0.99}, name="asin"),
  param(lambda x: x.acos(), None, {"low": -0.99, "high": 0.99}, name="acos"),
  param(lambda x: x.logit(), None, {"low": 0.01, "high": 0.99}, name="logit"),
  param(lambda x: x.logit(0.2), None, {"low": 0.0, "high": 1.0}, name="logit-eps"),
  param(lambda x: x.erfc(), None, {"atol": 2e-7}, name="erfc"),  # erf's polynomial: 1.5e-7 absolute in any dtype
  param(lambda x: x.frac(), None, {"low": -5, "high": 5}, name="frac"),
  param(lambda x: x.deg2rad(), None, {}, name="deg2rad"), param(lambda x: x.rad2deg(), None, {}, name="rad2deg"),
]


@pytest.mark.parametrize("torch_fn, ourgrad_fn, options", SPECIAL_UNARY)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_special_unary(torch_fn: Any, ourgrad_fn: Any, options: dict[str, Any], shape: tuple[int, ...],
                       dtype: DType) -> None:
  options = dict(options)
  atol = options.pop("atol", 2e-7 if dtype == dtypes.float32 else 1e-12)
  helper_test_op([shape], torch_fn, ourgrad_fn, dtype=dtype, atol=atol, rtol=1e-5, grad_atol=1e-6, grad_rtol=1e-5,
                 **options)


@pytest.mark.parametrize("torch_fn, ourgrad_fn, options", [
  param(torch.atan2, lambda y, x: y.atan2(x), {"low": -3, "high": 3}, name="atan2"),
  param(torch.hypot, lambda x, y: x.hypot(y), {"low": -3, "high": 3}, name="hypot"),
  param(torch.xlogy, lambda x, y: x.xlogy(y), {"low": 0.1, "high": 3}, name="xlogy"),
])
@pytest.mark.parametrize("shapes", [[(3, 4), (3, 4)], [(3, 1), (4,)]], ids=str)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_special_binary(torch_fn: Any, ourgrad_fn: Any, options: dict[str, Any], shapes: list[tuple[int, ...]],
                        dtype: DType) -> None:
  helper_test_op(shapes, torch_fn, ourgrad_fn, dtype=dtype, atol=1e-6, rtol=1e-5, **options)


def test_nansum_nanmean() -> None:
  values = [[1.0, float("nan"), 2.0], [float("nan"), float("nan"), float("nan")], [0.5, -1.0, 3.0]]
  helper_test_op([values], lambda x: x.nansum(1), forward_only=True)
  helper_test_op([values], lambda x: x.nanmean(1), forward_only=True)
  helper_test_op([values], lambda x: torch.nansum(x), lambda x: x.nansum(), forward_only=True)


ALIASES = [
  param(lambda x, y: x.divide(y + 3), name="divide"), param(lambda x, y: x.true_divide(y + 3), name="true_divide"),
  param(lambda x, y: x.multiply(y), name="multiply"), param(lambda x, y: x.subtract(y, alpha=2), name="subtract"),
  param(lambda x, y: x.negative(), name="negative"), param(lambda x, y: x.positive(), name="positive"),
  param(lambda x, y: x.absolute(), name="absolute"), param(lambda x, y: x.fix(), name="fix"),
  param(lambda x, y: x.t(), name="t"), param(lambda x, y: x.ravel(), name="ravel"),
  param(lambda x, y: x.swapdims(0, 1), name="swapdims"), param(lambda x, y: x.fliplr(), name="fliplr"),
  param(lambda x, y: x.flipud(), name="flipud"), param(lambda x, y: x.tile(2), name="tile"),
  param(lambda x, y: x.tile((2, 1, 3)), name="tile-more"), param(lambda x, y: x.unbind(1), name="unbind"),
  param(lambda x, y: x.select(1, -1), name="select"),
  param(lambda x, y: x.mv(y[0]), name="mv"), param(lambda x, y: x.inner(y), name="inner"),
  param(lambda x, y: x[0].ger(y[1]), name="ger"), param(lambda x, y: x[0].vdot(y[1]), name="vdot"),
]


@pytest.mark.parametrize("fn", ALIASES)
def test_aliases(fn: Any) -> None:
  helper_test_op([(3, 4), (3, 4)], fn)


def test_index_aliases() -> None:
  index = np.array([2, 0, 2])
  helper_test_op([(3, 4)], lambda x: x.index_select(1, torch.tensor(index)),
                 lambda x: x.index_select(1, Tensor(index)))
  gather_index = np.array([[0, 3], [1, 1], [2, 0]])
  helper_test_op([(3, 4)], lambda x: x.take_along_dim(torch.tensor(gather_index), 1),
                 lambda x: x.take_along_dim(Tensor(gather_index), 1))


def test_alias_comparisons_and_casts() -> None:
  values = np.array([[1.0, -2.5, 3.0], [0.0, 2.0, -1.0]], dtype=np.float32)
  ours, theirs = Tensor(values), torch.tensor(values)
  for name in ("greater", "greater_equal", "less", "less_equal", "not_equal"):
    assert_same(getattr(ours, name)(1.0), getattr(theirs, name)(1.0), 0, 0)
  for name in ("byte", "short", "bfloat16"):
    assert_same(getattr(ours.abs(), name)(), getattr(theirs.abs(), name)(), 0, 0)
  assert ours.is_floating_point() and not ours.int().is_floating_point() and ours.ndimension() == 2
  assert_same(ours.sgn(), theirs.sgn(), 0, 0)  # torch's sgn backward is a ZeroTensor: forward only here


# ================================================================ scatter family and NaN-aware comparisons

def test_scatter_add() -> None:
  index = np.array([[0, 2, 1, 2], [1, 0, 2, 0]])
  helper_test_op([(3, 5), (2, 4)], lambda x, s: x.scatter_add(0, torch.tensor(index), s),
                 lambda x, s: x.scatter_add(0, Tensor(index), s))
  index1 = np.array([[4, 0], [1, 3], [2, 2]])
  helper_test_op([(3, 5), (3, 2)], lambda x, s: x.scatter_add(1, torch.tensor(index1), s),
                 lambda x, s: x.scatter_add(1, Tensor(index1), s))


def test_scatter_unique_indices() -> None:
  index = np.array([[0, 2, 1], [1, 0, 4]])
  # src larger than the index is legal; torch's backward rejects its own gradient then, so forward only
  helper_test_op([(2, 5), (2, 4)], lambda x, s: x.scatter(1, torch.tensor(index), s),
                 lambda x, s: x.scatter(1, Tensor(index), s), forward_only=True)
  helper_test_op([(2, 5), (2, 3)], lambda x, s: x.scatter(1, torch.tensor(index), s),
                 lambda x, s: x.scatter(1, Tensor(index), s))
  helper_test_op([(2, 5)], lambda x: x.scatter(1, torch.tensor(index), 7.5), lambda x: x.scatter(1, Tensor(index), 7.5))
  helper_test_op([(2, 5), (2, 3)], lambda x, s: x.scatter(1, torch.tensor(index), s, reduce="add"),
                 lambda x, s: x.scatter(1, Tensor(index), s, reduce="add"), forward_only=True)  # torch: no derivative


def test_index_add() -> None:
  index = np.array([4, 0, 4])
  helper_test_op([(3, 5), (3, 3)], lambda x, s: x.index_add(1, torch.tensor(index), s, alpha=2),
                 lambda x, s: x.index_add(1, Tensor(index), s, alpha=2))
  helper_test_op([(4, 2), (2, 2)], lambda x, s: x.index_add(0, torch.tensor([3, 1]), s),
                 lambda x, s: x.index_add(0, Tensor([3, 1]), s))


NAN_AWARE = [float("nan"), 1.0, -0.0, 0.0, float("inf"), -float("inf"), 2.0, 1.0 + 1e-7]


@pytest.mark.parametrize("name", ["fmax", "fmin", "logaddexp2", "isclose"])
def test_nan_aware_binary(name: str) -> None:
  xs = [x for x in NAN_AWARE for _ in NAN_AWARE]
  ys = [y for _ in NAN_AWARE for y in NAN_AWARE]
  helper_test_op([xs, ys], lambda x, y: getattr(torch, name)(x, y), lambda x, y: getattr(x, name)(y),
                 forward_only=True)


def test_nan_aware_unary_and_bools() -> None:
  values = np.array(NAN_AWARE, dtype=np.float32)
  ours, theirs = Tensor(values), torch.tensor(values)
  for name in ("signbit", "isposinf", "isneginf"):
    assert_same(getattr(ours, name)(), getattr(theirs, name)(), 0, 0)
  assert_same(ours.isclose(ours, equal_nan=True), theirs.isclose(theirs, equal_nan=True), 0, 0)
  assert ours.allclose(ours + 1e-9, equal_nan=True) and not ours.allclose(ours) and ours.allclose(ours, equal_nan=True)
  assert ours.equal(Tensor(values.copy() * 1)) is False  # NaN != NaN, as torch.equal
  assert Tensor([1, 2]).equal(Tensor([1, 2])) and not Tensor([1, 2]).equal(Tensor([1, 2, 3]))
  assert_same(Tensor([[0, 1, 2], [0, 0, 3]]).count_nonzero(1), torch.tensor([[0, 1, 2], [0, 0, 3]]).count_nonzero(1),
              0, 0)


# ================================================================ order statistics

def _with_ties_and_nan() -> np.ndarray:
  values = np.random.default_rng(0).integers(0, 6, (4, 7)).astype(np.float32)
  values[1, 3] = values[1, 5] = np.nan
  return values


@pytest.mark.parametrize("keepdim", [False, True])
def test_median(keepdim: bool) -> None:
  """Lower median; NaN (and the first NaN's index) for a row holding NaN; values and gradient as torch."""
  values = _with_ties_and_nan()
  ours, theirs = Tensor(values).median(1, keepdim), torch.tensor(values).median(1, keepdim)
  assert_same(ours[0], theirs.values, 0, 0)
  assert_same(ours[1], theirs.indices, 0, 0)
  assert_same(Tensor(values).median(), torch.tensor(values).median(), 0, 0)
  helper_test_op([(3, 6)], lambda x: x.median(dim=0)[0], lambda x: x.median(0)[0])
  helper_test_op([(3, 5)], lambda x: x.median(), lambda x: x.median())


@pytest.mark.parametrize("k", [1, 3, 7])
def test_kthvalue(k: int) -> None:
  """Values as torch (NaN sorts last); the index points at an element of that value (torch leaves ties open)."""
  values = _with_ties_and_nan()
  ours, theirs = Tensor(values).kthvalue(k, 1), torch.tensor(values).kthvalue(k, 1)
  assert_same(ours[0], theirs.values, 0, 0)
  picked = np.take_along_axis(values, ours[1].numpy()[:, None], 1)[:, 0]
  np.testing.assert_array_equal(picked, theirs.values.numpy())
  helper_test_op([(3, 6)], lambda x: x.kthvalue(k if k < 7 else 6, 1)[0])


@pytest.mark.parametrize("q", [0.0, 0.3, 0.5, 1.0])
def test_quantile(q: float) -> None:
  helper_test_op([(3, 6)], lambda x: x.quantile(q, dim=1))
  helper_test_op([(3, 6)], lambda x: x.quantile(q, dim=0, keepdim=True))
  helper_test_op([(3, 6)], lambda x: x.quantile(q))
  values = _with_ties_and_nan()
  assert_same(Tensor(values).quantile(q, 1), torch.tensor(values).quantile(q, 1), 1e-6, 1e-6)


# ================================================================ running extremes and logcumsumexp

@pytest.mark.parametrize("name", ["cummax", "cummin"])
@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.int32], ids=str)
def test_cumulative_extremes(name: str, dtype: DType) -> None:
  """Values and the latest index of ties (NaN wins once seen), as torch; gradients go to that index."""
  values = _with_ties_and_nan() if dtype.is_float else np.random.default_rng(1).integers(-3, 3, (4, 7))
  ours = getattr(Tensor(values, dtype=dtype), name)(dim=1)
  theirs = getattr(torch.tensor(values).to(TORCH_DTYPES[dtype]), name)(dim=1)
  assert_same(ours.values, theirs.values, 0, 0)
  assert_same(ours.indices, theirs.indices, 0, 0)
  if dtype.is_float:
    helper_test_op([(3, 6)], lambda x: getattr(x, name)(dim=1)[0])
    helper_test_op([(5, 2)], lambda x: getattr(x, name)(dim=0)[0])


def test_logcumsumexp() -> None:
  helper_test_op([(3, 6)], lambda x: x.logcumsumexp(dim=1), low=-30, high=30)
  helper_test_op([(4, 2)], lambda x: x.logcumsumexp(dim=0), dtype=dtypes.float64)
  wide = [[0.0, -float("inf"), -float("inf"), 1.0, -1000.0, 50.0], [-float("inf")] * 6]
  helper_test_op([wide], lambda x: x.logcumsumexp(dim=1), forward_only=True)
