"""Bad input raises a clear ourgrad error at the line that caused it, not a compiler error at realize time.

Each test builds the bad op inside `raises_at_build`, which asserts the exception type, that the message names
what went wrong (shapes, dtypes, axes, devices), and that no kernel ran: nothing inside the block realizes, so
the error must come from building the graph.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import numpy as np
import pytest

from ourgrad.device import Device
from ourgrad.dtype import DType, dtypes
from ourgrad.errors import (AutogradError, AxisError, DeviceError, DTypeError, IndexOutOfRangeError, OurgradError,
                            ShapeError)
from ourgrad.helpers import GlobalCounters
from ourgrad.lazy import LazyBuffer
from ourgrad.tensor import Tensor


@contextmanager
def raises_at_build(error: type[Exception], *words: str) -> Iterator[None]:
  """The block raises `error` with every one of `words` in its message, before any kernel runs."""
  GlobalCounters.reset()
  with pytest.raises(error) as info:
    yield
  message = str(info.value)
  for word in words: assert word in message, f"{word!r} is missing from the message {message!r}"
  assert GlobalCounters.kernel_count == 0, "the error must be raised when the op is built, before anything runs"


def ones(*shape: int, dtype: np.dtype = np.float32) -> Tensor:
  return Tensor(np.ones(shape, dtype=dtype))


def test_errors_are_ourgrad_errors_and_builtin_errors():
  assert issubclass(ShapeError, OurgradError) and issubclass(ShapeError, ValueError)
  assert issubclass(AxisError, IndexError) and issubclass(IndexOutOfRangeError, IndexError)
  assert issubclass(DTypeError, TypeError) and issubclass(DeviceError, RuntimeError)
  with pytest.raises(ValueError):  # `except ValueError` keeps working for users who do not know ShapeError
    ones(2, 3) + ones(4, 5)


# ---------------------------------------------------------------- shapes

def test_broadcast_mismatch_names_both_shapes():
  with raises_at_build(ShapeError, "(2, 3)", "(4, 5)", "broadcast"):
    ones(2, 3) + ones(4, 5)


def test_broadcast_mismatch_in_one_dimension_names_the_sizes():
  with raises_at_build(ShapeError, "(2, 3)", "(2, 4)", "3", "4"):
    ones(2, 3) * ones(2, 4)


def test_broadcast_mismatch_in_where():
  x = ones(2, 3)
  with raises_at_build(ShapeError, "(2, 3)", "(4, 5)"):
    (x > 0).where(x, ones(4, 5))


def test_broadcast_mismatch_in_place():
  x = ones(2, 3)
  with raises_at_build(ShapeError, "(2, 3)", "(3, 2)"):
    x += ones(3, 2)


def test_matmul_inner_dimension_mismatch():
  with raises_at_build(ShapeError, "matmul", "(2, 3)", "(4, 5)", "3 != 4"):
    ones(2, 3) @ ones(4, 5)


def test_matmul_inner_dimension_mismatch_of_vectors():
  with raises_at_build(ShapeError, "matmul", "(2,)", "(3,)"):
    ones(2) @ ones(3)


def test_batched_matmul_inner_dimension_mismatch():
  with raises_at_build(ShapeError, "matmul", "(2, 2, 3)", "(3, 2, 4)"):
    ones(2, 2, 3) @ ones(3, 2, 4)


def test_matmul_of_a_scalar():
  with raises_at_build(ShapeError, "matmul", "()"):
    Tensor(2.0) @ ones(2)


def test_reshape_to_a_different_element_count():
  with raises_at_build(ShapeError, "(2, 3)", "6 elements", "(4, 2)", "8 elements"):
    ones(2, 3).reshape(4, 2)


def test_reshape_with_an_impossible_inferred_size():
  with raises_at_build(ShapeError, "(2, 3)", "(4, -1)"):
    ones(2, 3).reshape(4, -1)


def test_expand_of_a_dimension_that_is_not_one():
  with raises_at_build(ShapeError, "(2, 3)", "(4, 4)"):
    ones(2, 3).expand(4, 4)


def test_cat_of_mismatched_shapes():
  with raises_at_build(ShapeError, "(2, 3)", "(4, 5)"):
    Tensor.cat([ones(2, 3), ones(4, 5)])


def test_assign_of_a_different_shape():
  with raises_at_build(ShapeError, "assign", "(4, 5)", "(2, 3)"):
    ones(2, 3).assign(ones(4, 5))


def test_shrink_outside_the_shape():
  with raises_at_build(ShapeError, "(0, 5)", "(2, 3)"):
    ones(2, 3).shrink(((0, 5), None))


# ---------------------------------------------------------------- axes

@pytest.mark.parametrize("reduce", ["sum", "max", "min", "mean"])
def test_reduce_axis_out_of_range(reduce: str):
  with raises_at_build(AxisError, "axis 5", "2 dimensions"):
    getattr(ones(2, 3), reduce)(axis=5)


def test_negative_reduce_axis_out_of_range():
  with raises_at_build(AxisError, "axis -3", "2 dimensions"):
    ones(2, 3).sum(axis=-3)


def test_softmax_axis_out_of_range():
  with raises_at_build(AxisError, "axis 2", "2 dimensions"):
    ones(2, 3).softmax(2)


def test_permute_axis_out_of_range():
  with raises_at_build(AxisError, "axis 2", "2 dimensions"):
    ones(2, 3).permute(0, 2)


def test_permute_with_the_wrong_number_of_axes():
  with raises_at_build(AxisError, "2 dimensions", "3 axes"):
    ones(2, 3).permute(0, 1, 2)


def test_permute_that_repeats_an_axis():
  with raises_at_build(AxisError, "(0, 0)", "permutation"):
    ones(2, 3).permute(0, 0)


def test_transpose_axis_out_of_range():
  with raises_at_build(AxisError, "axis 3", "2 dimensions"):
    ones(2, 3).transpose(0, 3)


def test_flip_axis_out_of_range():
  with raises_at_build(AxisError, "axis 3", "2 dimensions"):
    ones(2, 3).flip(3)


# ---------------------------------------------------------------- indices

def test_index_out_of_range():
  with raises_at_build(IndexOutOfRangeError, "index 10", "size 3"):
    ones(3)[10]


def test_negative_index_out_of_range():
  with raises_at_build(IndexOutOfRangeError, "index -4", "size 3"):
    ones(3)[-4]


def test_index_out_of_range_names_the_tensors_dimension():
  # after the first integer index the view has one dimension less: the message must still say dimension 1
  with raises_at_build(IndexOutOfRangeError, "index 5", "dimension 1", "size 3", "(2, 3)"):
    ones(2, 3)[1, 5]


def test_too_many_indices():
  with raises_at_build(IndexOutOfRangeError, "too many indices", "(2, 3)"):
    ones(2, 3)[0, 0, 0]


def test_float_tensor_as_an_index():
  with raises_at_build(IndexError, "integers", "float32"):
    ones(3)[Tensor([0.5])]


# ---------------------------------------------------------------- dtypes

@pytest.mark.parametrize("op, name", [(lambda x, y: x & y, "bitwise and"), (lambda x, y: x | y, "bitwise or"),
                                      (lambda x, y: x ^ y, "bitwise xor"), (lambda x, y: x << 1, "left shift"),
                                      (lambda x, y: ~x, "bitwise not")])
def test_bitwise_op_on_floats(op, name: str):
  x = ones(3)
  with raises_at_build(DTypeError, name, "float32"):
    op(x, x)


def test_bitwise_op_on_ints_works():
  x = ones(3, dtype=np.int32)
  np.testing.assert_array_equal((x & 3).numpy(), np.ones(3, np.int32))


@pytest.mark.parametrize("target", [dtypes.float16, dtypes.int64])
def test_bitcast_between_sizes(target: DType):
  with raises_at_build(DTypeError, "bitcast", "float32", "4 bytes", str(target.itemsize), target.name):
    ones(3).bitcast(target)


def test_bitcast_between_one_size_works():
  bits = ones(2).bitcast(dtypes.int32).numpy()
  np.testing.assert_array_equal(bits, np.ones(2, np.float32).view(np.int32))


def test_negation_of_bool():
  with raises_at_build(DTypeError, "bool"):
    -Tensor([True, False])


# ---------------------------------------------------------------- devices

def _openable_devices() -> list[str]:
  names = []
  for name in Device.available_names():
    try:
      Device[name]
      names.append(name)
    except DeviceError:
      continue
  return names


def _on_fake_device(*shape: int, dtype: DType = dtypes.float32) -> Tensor:
  """A tensor that claims to live on another device. Nothing runs on it, so the device never has to exist."""
  return Tensor(LazyBuffer.empty(shape, dtype, "FAKE"))


def test_mixing_two_real_devices():
  devices = _openable_devices()
  if len(devices) < 2:
    pytest.skip(f"only {devices} can be opened here (runtimes: {Device.available_names()}); mixing real devices "
                f"needs a second one. test_mixing_devices_* covers the check with a fake device")
  x, y = Tensor([1.0], device=devices[0]), Tensor([1.0], device=devices[1])
  with raises_at_build(DeviceError, devices[0], devices[1]):
    x + y


@pytest.mark.parametrize("op", [lambda x, y: x + y, lambda x, y: y * x, lambda x, y: x.maximum(y),
                                lambda x, y: x < y, lambda x, y: (x > 0).where(y, y)])
def test_mixing_devices_in_elementwise_ops(op):
  with raises_at_build(DeviceError, Device.DEFAULT, "FAKE", "different devices"):
    op(ones(3), _on_fake_device(3))


def test_mixing_devices_in_matmul():
  with raises_at_build(DeviceError, "matmul", Device.DEFAULT, "FAKE"):
    ones(2, 3) @ _on_fake_device(3, 2)


def test_mixing_devices_in_cat():
  with raises_at_build(DeviceError, Device.DEFAULT, "FAKE"):
    Tensor.cat([ones(3), _on_fake_device(3)])


def test_mixing_devices_in_assign():
  with raises_at_build(DeviceError, "assign", Device.DEFAULT, "FAKE"):
    ones(3).assign(_on_fake_device(3))


def test_unknown_device_names_the_available_ones():
  with raises_at_build(DeviceError, "NO_SUCH_DEVICE", "available", "CLANG"):
    Tensor([1.0], device="NO_SUCH_DEVICE")


# ---------------------------------------------------------------- autograd

@pytest.mark.parametrize("data, dtype_name", [([1, 2, 3], "int32"), ([True, False], "bool")])
def test_requires_grad_on_a_non_float_tensor(data: list, dtype_name: str):
  with raises_at_build(DTypeError, "floating point", dtype_name):
    Tensor(data, requires_grad=True)


def test_backward_of_a_non_scalar_without_a_gradient():
  x = Tensor(np.ones((2, 3), np.float32), requires_grad=True)
  y = x * 2
  with raises_at_build(AutogradError, "scalar", "(2, 3)", "gradient"):
    y.backward()


def test_backward_with_a_gradient_of_the_wrong_shape():
  x = Tensor(np.ones((2, 3), np.float32), requires_grad=True)
  y = x * 2
  with raises_at_build(ShapeError, "(3, 2)", "(2, 3)"):
    y.backward(Tensor(np.ones((3, 2), np.float32)))


def test_backward_of_a_tensor_that_does_not_require_grad():
  with raises_at_build(AutogradError, "requires_grad"):
    ones(3).sum().backward()
