"""The cheap graph-building paths (issue 26): shared operand constants, where() with a Python number, one Function for
==, a reduce and its keepdim reshape as one Function, matmul's Functions applied directly, LazyBuffers made without
__init__. Each is checked against numpy or PyTorch, and for the sharing, that no user-visible tensor is shared."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from ourgrad import Tensor, dtypes
from ourgrad.errors import ShapeError
from ourgrad import function as F
from ourgrad.lazy import LazyBuffer
from ourgrad.ops import Ops

RNG = np.random.default_rng(7)


def _values(*shape: int) -> np.ndarray:
  return RNG.standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------- operand constants

def test_scalar_operand_is_shared_and_correct() -> None:
  x = _values(4, 5)
  t = Tensor(x)
  first, second = t + 1.5, t + 1.5
  assert first.lazydata.srcs[1] is second.lazydata.srcs[1]   # one constant for both ops
  np.testing.assert_allclose(first.numpy(), x + np.float32(1.5), rtol=1e-6)
  np.testing.assert_allclose((2.0 - t).numpy(), np.float32(2.0) - x, rtol=1e-6)
  np.testing.assert_allclose((t * -3).numpy(), x * np.float32(-3), rtol=1e-6)


def test_shared_constant_keeps_no_readers() -> None:
  t = Tensor(_values(3, 4))
  for _ in range(50): t * 0.5
  constant = LazyBuffer.operand_constant(0.5, (3, 4), dtypes.float32, t.device)
  assert constant.base.op is Ops.CONST and not constant.base._readers


def test_operand_constants_keep_types_and_signs_apart() -> None:
  shape, device = (2, 3), Tensor([1.0]).device
  one_int = LazyBuffer.operand_constant(1, shape, dtypes.float32, device)
  one_bool = LazyBuffer.operand_constant(True, shape, dtypes.float32, device)
  zero, negative_zero = (LazyBuffer.operand_constant(value, shape, dtypes.float32, device) for value in (0.0, -0.0))
  assert one_int is not one_bool and zero is not negative_zero
  assert math.copysign(1.0, negative_zero.base.arg) == -1.0
  x = Tensor(np.array([[0.0, -0.0, 1.0]] * 2, np.float32))
  # -0.0 is the additive identity (the add folds away), +0.0 is not: -0.0 + 0.0 is +0.0
  np.testing.assert_array_equal(np.signbit((x + 0.0).numpy()), np.signbit(x.numpy() + np.float32(0.0)))
  np.testing.assert_array_equal(np.signbit((x + -0.0).numpy()), np.signbit(x.numpy() + np.float32(-0.0)))


def test_operand_constant_keys_tell_every_value_apart() -> None:
  """One shared constant per (value, its type, dtype, device, shape), zeros also by their sign (numpy's too); a value
  met again is the same LazyBuffer; NaN (never equal to its key) is made anew."""
  shape, device = (2, 3), Tensor([1.0]).device
  def constant(value: Any) -> LazyBuffer: return LazyBuffer.operand_constant(value, shape, dtypes.float32, device)
  values = [0, 0.0, -0.0, False, np.float32(0.0), np.float32(-0.0), 2, 2.0, True, 1, np.float32(2.0), -2.0]
  made = [constant(value) for value in values]
  assert len({id(lazy) for lazy in made}) == len(values)
  assert all(constant(value) is lazy for value, lazy in zip(values, made))
  assert [math.copysign(1.0, lazy.base.arg) for lazy in made[4:6]] == [1.0, -1.0]
  assert constant(math.nan) is not constant(math.nan)


def test_nan_and_symbolic_free_constants() -> None:
  x = _values(3, 3)
  np.testing.assert_array_equal(np.isnan((Tensor(x) + math.nan).numpy()), np.ones((3, 3), bool))
  np.testing.assert_allclose((Tensor(x) * math.inf).numpy(), x * np.float32(math.inf))


def test_results_holding_constants_stay_their_own_memory() -> None:
  # a folded constant is a tensor the user holds: a write to it must not reach another such result or an operand
  first = Tensor.zeros(2, 3) * 2.0
  second = Tensor.zeros(2, 3) * 2.0
  first[0, 1] = 5.0
  np.testing.assert_array_equal(second.numpy(), np.zeros((2, 3), np.float32))
  np.testing.assert_array_equal(first.numpy(), np.array([[0, 5, 0], [0, 0, 0]], np.float32))
  x = Tensor(np.ones((2, 3), np.float32))
  y = x + 1.0
  y[1, 2] = -7.0
  np.testing.assert_array_equal((x + 1.0).numpy(), np.full((2, 3), 2.0, np.float32))


def test_one_element_constants_are_shared_and_never_marked() -> None:
  """A one-element operand constant is shared as larger ones are (session 21: op1's `x + 1` made it per op);
  contiguous() of it copies it instead of marking the shared base for realizing."""
  device = Tensor([1.0]).device
  shared = LazyBuffer.operand_constant(2.0, (1, 1), dtypes.float32, device)
  assert shared is LazyBuffer.operand_constant(2.0, (1, 1), dtypes.float32, device)
  assert shared.contiguous().base is not shared.base and not shared.base.forced_realize
  t = Tensor([[3.0]])
  np.testing.assert_array_equal((t + 2.0).contiguous().numpy(), [[5.0]])
  np.testing.assert_array_equal((t + 2.0).numpy(), [[5.0]])


# ---------------------------------------------------------------- where with a Python number

@pytest.mark.parametrize("tensor_dtype,scalar", [(np.float32, 0), (np.float32, 2.5), (np.int32, 3), (np.int32, 1.5),
                                                 (np.bool_, True)])
@pytest.mark.parametrize("scalar_first", [False, True])
def test_where_scalar_matches_torch(tensor_dtype: type, scalar: float, scalar_first: bool) -> None:
  values = (RNG.standard_normal((4, 1)) * 3).astype(tensor_dtype)
  condition = RNG.standard_normal((4, 5)) > 0   # broadcasts the (4, 1) tensor
  ours = Tensor(condition).where(*((scalar, Tensor(values)) if scalar_first else (Tensor(values), scalar)))
  theirs = torch.where(torch.tensor(condition), *((scalar, torch.tensor(values)) if scalar_first else
                                                   (torch.tensor(values), scalar)))
  assert ours.shape == tuple(theirs.shape)
  expected = theirs.numpy()
  if expected.dtype == np.int64: expected = expected.astype(np.int32)   # ourgrad's int is int32 (dtype.py)
  assert ours.numpy().dtype == expected.dtype
  np.testing.assert_array_equal(ours.numpy(), expected)


def test_where_scalar_gradient_matches_torch() -> None:
  values = _values(3, 4)
  ours = Tensor(values, requires_grad=True)
  (ours > 0).where(ours * 2, 0.5).sum().backward()
  theirs = torch.tensor(values, requires_grad=True)
  torch.where(theirs > 0, theirs * 2, 0.5).sum().backward()
  np.testing.assert_allclose(ours.grad.numpy(), theirs.grad.numpy())


# ---------------------------------------------------------------- ==

def test_equal_matches_numpy() -> None:
  x = np.array([[1.0, np.nan, 2.0], [np.inf, -np.inf, 0.0]], np.float32)
  y = np.array([1.0, np.nan, 3.0], np.float32)
  np.testing.assert_array_equal((Tensor(x) == Tensor(y)).numpy(), x == y)   # broadcast; NaN == NaN is False
  np.testing.assert_array_equal((Tensor(x) == 2.0).numpy(), x == 2.0)
  np.testing.assert_array_equal(Tensor(x).isinf().numpy(), np.isinf(x))
  flags = np.array([True, False, True])
  np.testing.assert_array_equal((Tensor(flags) == Tensor(np.array([True, True, False]))).numpy(),
                                flags == np.array([True, True, False]))
  assert (Tensor(x) == Tensor(y)).dtype == dtypes.bool


# ---------------------------------------------------------------- reduces with keepdim=False, matmul

@pytest.mark.parametrize("axis,keepdim", [(None, False), (0, False), (1, False), ((0, 2), False), (1, True)])
def test_sum_max_mean_gradients_match_torch(axis: int | tuple | None, keepdim: bool) -> None:
  values = np.round(_values(3, 4, 5) * 2) / 2   # ties for max
  for name in ("sum", "max", "mean"):
    ours = Tensor(values, requires_grad=True)
    theirs = torch.tensor(values, requires_grad=True)
    if name == "max" and axis is not None and not isinstance(axis, int): continue
    our_result = getattr(ours, name)(axis, keepdim) if axis is not None else getattr(ours, name)()
    if name == "max" and axis is not None: their_result = theirs.amax(axis, keepdim)
    else: their_result = getattr(theirs, name)(axis, keepdim) if axis is not None else getattr(theirs, name)()
    assert our_result.shape == tuple(their_result.shape)
    np.testing.assert_allclose(our_result.numpy(), their_result.detach().numpy(), rtol=1e-5, atol=1e-6)
    weights = _values(*their_result.shape)
    (our_result * Tensor(weights)).sum().backward()
    (their_result * torch.tensor(weights)).sum().backward()
    np.testing.assert_allclose(ours.grad.numpy(), theirs.grad.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("left,right", [((5,), (5,)), ((3, 5), (5,)), ((5,), (5, 4)), ((3, 5), (5, 4)),
                                        ((2, 3, 5), (5, 4)), ((2, 3, 5), (2, 5, 4)), ((1, 3, 5), (2, 5, 4))])
def test_matmul_values_and_gradients_match_torch(left: tuple, right: tuple) -> None:
  a, b = _values(*left), _values(*right)
  ours_a, ours_b = Tensor(a, requires_grad=True), Tensor(b, requires_grad=True)
  theirs_a, theirs_b = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
  ours, theirs = ours_a @ ours_b, theirs_a @ theirs_b
  assert ours.shape == tuple(theirs.shape)
  np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), rtol=1e-5, atol=1e-5)
  (ours * 1.5).sum().backward()
  (theirs * 1.5).sum().backward()
  np.testing.assert_allclose(ours_a.grad.numpy(), theirs_a.grad.numpy(), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ours_b.grad.numpy(), theirs_b.grad.numpy(), rtol=1e-5, atol=1e-5)


def test_integer_and_bool_matmul_match_numpy() -> None:
  a, b = RNG.integers(-4, 4, (3, 5)).astype(np.int32), RNG.integers(-4, 4, (5, 2)).astype(np.int32)
  np.testing.assert_array_equal((Tensor(a) @ Tensor(b)).numpy(), a @ b)
  flags_a, flags_b = a > 0, b > 0
  np.testing.assert_array_equal((Tensor(flags_a) @ Tensor(flags_b)).numpy(), flags_a @ flags_b)


# ---------------------------------------------------------------- views of views, dtype promotion, errors

def test_views_of_views_match_numpy() -> None:
  x = _values(4, 6, 5)
  ours = Tensor(x).reshape(8, 3, 5).permute(2, 0, 1)[1:4, ::2].reshape(3, 4, 3).expand(2, 3, 4, 3)
  expected = np.broadcast_to(x.reshape(8, 3, 5).transpose(2, 0, 1)[1:4, ::2].reshape(3, 4, 3), (2, 3, 4, 3))
  np.testing.assert_array_equal((ours + 0.25).numpy(), expected + np.float32(0.25))


def test_broadcast_and_promotion_match_torch() -> None:
  cases = [(np.float32, (3, 1), np.float16, (1, 4)), (np.int32, (3, 4), np.float32, (4,)), (np.int8, (2, 3), None, 7),
           (np.int32, (2, 3), None, 2.5), (np.bool_, (2, 3), None, 3)]
  for left_dtype, left_shape, right_dtype, right in cases:
    a = (RNG.standard_normal(left_shape) * 3).astype(left_dtype)
    b = (RNG.standard_normal(right) * 3).astype(right_dtype) if right_dtype is not None else right
    ours = Tensor(a) + (Tensor(b) if right_dtype is not None else b)
    theirs = torch.tensor(a) + (torch.tensor(b) if right_dtype is not None else b)
    assert ours.shape == tuple(theirs.shape)
    assert ours.dtype.name == str(theirs.dtype).removeprefix("torch.").replace("int64", "int32")
    np.testing.assert_allclose(ours.numpy().astype(np.float64), theirs.numpy().astype(np.float64), rtol=1e-3)


def test_bad_shapes_still_raise_clear_errors() -> None:
  with pytest.raises(ValueError, match=r"\(3, 4\).*\(5,\)"): Tensor(_values(3, 4)) + Tensor(_values(5))
  with pytest.raises(ValueError, match="inner dimensions"): Tensor(_values(3, 4)) @ Tensor(_values(3, 4))
  with pytest.raises(ValueError, match="cannot reshape"): Tensor(_values(3, 4)).reshape(5, 3)


def test_function_subclass_may_not_define_init() -> None:
  with pytest.raises(TypeError, match="__init__"):
    class Broken(F.Function):  # noqa: F841
      def __init__(self, device: str, *tensors: Tensor): super().__init__(device, *tensors)


# ---------------------------------------------------------------- composites built on lazy buffers

def _structure(tensor: Tensor) -> tuple:
  from ourgrad.engine.schedule_cache import _structure as structure
  return structure([tensor.lazydata])[0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("axis", [-1, 0, (0, 1)])
def test_logsumexp_and_softmax_build_the_tensor_formulas_graph(dtype: type, axis: int | tuple) -> None:
  from ourgrad.tensor_reduce import _logsumexp_lazy, _softmax_lazy
  values = np.array([[1.0, -np.inf, 3.0], [-np.inf, -np.inf, -np.inf]], dtype)
  source = Tensor(values)
  axes = source._reduce_axes(axis)
  peak = source.max(axis, keepdim=True)
  peak = peak.isinf().where(0, peak)
  formula = (source - peak).exp().sum(axis, keepdim=True).log() + peak
  assert _structure(Tensor(_logsumexp_lazy(source.lazydata, axes))) == _structure(formula)
  if isinstance(axis, int):
    exps = (source - source.max(axis, keepdim=True)).exp()
    assert _structure(Tensor(_softmax_lazy(source.lazydata, axes))) == _structure(exps / exps.sum(axis, keepdim=True))
  theirs = torch.logsumexp(torch.tensor(values), dim=axis, keepdim=True).numpy()
  np.testing.assert_allclose(Tensor(values).logsumexp(axis, keepdim=True).numpy(), theirs, rtol=1e-6)


def test_logsumexp_softmax_values_and_gradients_match_torch() -> None:
  values = _values(4, 7) * 3
  for name in ("logsumexp", "softmax"):
    ours, theirs = Tensor(values, requires_grad=True), torch.tensor(values, requires_grad=True)
    our_out = ours.logsumexp(1) if name == "logsumexp" else ours.softmax(1)
    their_out = torch.logsumexp(theirs, 1) if name == "logsumexp" else torch.softmax(theirs, 1)
    np.testing.assert_allclose(our_out.numpy(), their_out.detach().numpy(), rtol=1e-5, atol=1e-6)
    weights = _values(*their_out.shape)
    (our_out * Tensor(weights)).sum().backward()
    (their_out * torch.tensor(weights)).sum().backward()
    np.testing.assert_allclose(ours.grad.numpy(), theirs.grad.numpy(), rtol=1e-4, atol=1e-6)
  half = Tensor(values.astype(np.float16))
  np.testing.assert_allclose(half.softmax(-1).numpy().astype(np.float32),
                             torch.softmax(torch.tensor(values.astype(np.float16)).float(), -1).numpy(), atol=1e-3)


@pytest.mark.parametrize("left,right", [((3, 5), (5, 4)), ((2, 3, 5), (2, 5, 4)), ((64, 128), (128, 32))])
def test_matmul_builds_the_tensor_formulas_graph(left: tuple, right: tuple) -> None:
  a, b = Tensor(_values(*left), requires_grad=True), Tensor(_values(*right), requires_grad=True)
  formula = (a.unsqueeze(-2) * b.transpose(-1, -2).unsqueeze(-3)).sum(-1)
  assert _structure(a @ b) == _structure(formula)


@pytest.mark.parametrize("left,right", [((4, 5), (5,)), ((4, 1), (1, 5)), ((2, 1, 5), (3, 1)), ((5,), (3, 4, 5))])
def test_broadcast_of_one_dtype_matches_torch_and_expand(left: tuple, right: tuple) -> None:
  a, b = _values(*left), _values(*right)
  ours_a, ours_b = Tensor(a, requires_grad=True), Tensor(b, requires_grad=True)
  theirs_a, theirs_b = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
  ours, theirs = ours_a * ours_b - ours_b, theirs_a * theirs_b - theirs_b
  # a*b - b cancels near b ~ a*b: the kernel may contract it into one fused multiply-add (one rounding, torch has
  # two), so an absolute tolerance as well
  np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), rtol=1e-6, atol=1e-7)
  (ours * 2).sum().backward()
  (theirs * 2).sum().backward()
  np.testing.assert_allclose(ours_a.grad.numpy(), theirs_a.grad.numpy(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ours_b.grad.numpy(), theirs_b.grad.numpy(), rtol=1e-5, atol=1e-6)
  shape = tuple(theirs.shape)
  expanded = Tensor(a).expand(shape) + Tensor(b).expand(shape)
  assert _structure(Tensor(a) + Tensor(b)) == _structure(expanded)


def test_sharded_tensors_take_the_operand_constant_paths() -> None:
  # two CPU devices (as test_multi.py): a GPU machine may have only one GPU
  devices = ("CLANG:0", "CLANG:1")
  values = _values(4, 6)
  x = Tensor(values, requires_grad=True, device="CLANG")
  sharded = x.shard(devices, axis=0)
  out = ((sharded * 2.0).relu().exp() + 1.5).softmax(-1).logsumexp(-1)
  reference = torch.tensor(values, requires_grad=True)
  expected = torch.logsumexp(torch.softmax(torch.exp(torch.relu(reference * 2.0)) + 1.5, -1), -1)
  np.testing.assert_allclose(out.numpy(), expected.detach().numpy(), rtol=1e-5)
  out.sum().backward()
  expected.sum().backward()
  np.testing.assert_allclose(x.grad.numpy(), reference.grad.numpy(), rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- the per-op path: readers, trace, Python frames

def test_new_bases_note_their_readers_and_trace_positions() -> None:
  """A base made from sources is a reader of each non-constant source's base (the copy-on-write of an assign finds
  it) and sits at its position of the open creation trace; values against numpy."""
  from ourgrad import lazy_trace
  x_value, y_value = _values(3, 4), _values(3, 4)
  x, y = Tensor(x_value).realize(), Tensor(y_value).realize()
  total = (x + y) * 0.5
  product = total.lazydata.base
  added = product.srcs[0].base
  assert any(reader is added for reader in x.lazydata.base.live_readers())
  assert any(reader is product for reader in added.live_readers())
  assert not product.srcs[1].base._readers   # (the shared 0.5: never written, so no readers kept)
  trace = lazy_trace._trace[0]
  assert trace is not None and trace.position(added) == added._trace_index >= 0
  assert trace.position(product) == added._trace_index + 1
  np.testing.assert_allclose(total.numpy(), (x_value + y_value) * np.float32(0.5), rtol=1e-6)


def test_a_full_trace_is_dropped_and_values_stay_right(monkeypatch: pytest.MonkeyPatch) -> None:
  """More bases than MAX_TRACED before a realize: the trace is dropped (the realize walks its graph), with the same
  values and kernels as a traced realize."""
  from ourgrad import lazy_trace
  from ourgrad.helpers import GlobalCounters
  x_value = _values(5)

  def run() -> tuple[np.ndarray, int]:
    out = Tensor(x_value).realize()
    for step in range(12): out = out * 1.5 + step
    GlobalCounters.reset()
    result = out.numpy()
    return result, GlobalCounters.kernel_count
  traced, traced_kernels = run()
  monkeypatch.setattr(lazy_trace, "MAX_TRACED", 5)
  dropped, dropped_kernels = run()
  expected = x_value.copy()
  for step in range(12): expected = expected * np.float32(1.5) + np.float32(step)
  np.testing.assert_allclose(traced, expected, rtol=1e-5)
  np.testing.assert_array_equal(dropped, traced)
  assert dropped_kernels == traced_kernels


def _python_frames_per_call(build: object, calls: int = 10) -> float:
  """Python function calls (cProfile's count, C built-ins left out) per call of `build`, after warm-up calls."""
  import cProfile
  import pstats
  for _ in range(3): build()  # type: ignore[operator]
  profile = cProfile.Profile()
  profile.enable()
  for _ in range(calls): build()  # type: ignore[operator]
  profile.disable()
  stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
  frames = sum(calls_made for (filename, _, _), (_, calls_made, *_) in stats.items()
               if filename != "~" and filename != __file__)
  return frames / calls


def test_building_an_op_costs_a_few_python_frames() -> None:
  """The Python frames one op costs to build (a deterministic count: 18 for x + y, 20 with autograd, before the
  per-op path was written out in create_base/view/apply): x + y is __add__ (the method), _broadcasted, apply, two
  lazydata reads, forward, elementwise and create_base."""
  x, y = Tensor(_values(4, 4)).realize(), Tensor(_values(4, 4)).realize()
  weight = Tensor(_values(4, 4), requires_grad=True)
  assert _python_frames_per_call(lambda: x + y) <= 9
  assert _python_frames_per_call(lambda: weight * y) <= 11
  assert _python_frames_per_call(lambda: x * 2.5) <= 18
  assert _python_frames_per_call(lambda: x.reshape(16)) <= 12   # (21 before)
  with pytest.raises(ShapeError, match="cannot reshape"): x.reshape(5, 3)
  np.testing.assert_array_equal(x.reshape(2, 8).numpy(), x.numpy().reshape(2, 8))
