"""Tests for ourgrad.dtype: promotion, scalar/result dtypes, conversions, safe casts and constant rounding.

PyTorch is the independent reference where it is installed; hard-written tables (which the torch tests also
check against torch) cover the same ground when it is not.
"""
from __future__ import annotations

import functools
import itertools
import math
import random
import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ourgrad.dtype import (DType, can_cast_safely, dtypes, least_upper_dtype, result_dtype, sum_dtype, to_numpy_dtype,
                           truncate)
from ourgrad.errors import DTypeError

try:
  import torch
except ImportError:  # the hard-written tables below still run
  torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is the reference here and is not installed")

ALL_DTYPES: list[DType] = dtypes.all()
NUMPY_DTYPES: list[DType] = [dt for dt in ALL_DTYPES if dt != dtypes.bfloat16]


def torch_dtype(dt: DType):
  """The torch dtype with the same name as `dt`."""
  return getattr(torch, dt.name)


def from_torch(torch_dt) -> DType:
  return dtypes.from_name(str(torch_dt).removeprefix("torch."))


# ---------------------------------------------------------------- the DType objects

def test_all_has_thirteen_distinct_dtypes_in_priority_order():
  assert len(ALL_DTYPES) == 13 and len(set(ALL_DTYPES)) == 13
  assert [dt.priority for dt in ALL_DTYPES] == sorted(dt.priority for dt in ALL_DTYPES)
  assert sorted(reversed(ALL_DTYPES)) == ALL_DTYPES


def test_aliases():
  assert dtypes.half is dtypes.float16 and dtypes.float is dtypes.float32 and dtypes.double is dtypes.float64
  assert dtypes.char is dtypes.int8 and dtypes.uchar is dtypes.uint8 and dtypes.short is dtypes.int16
  assert dtypes.int is dtypes.int32 and dtypes.long is dtypes.int64
  assert dtypes.default_float == dtypes.float32 and dtypes.default_int == dtypes.int32


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_dtype_properties_agree_with_numpy_and_struct(dt: DType):
  assert repr(dt) == f"dtypes.{dt.name}"
  assert sum([dt.is_bool, dt.is_int, dt.is_float]) == 1  # exactly one category
  assert dt.is_unsigned == dt.name.startswith("uint")
  rebuilt = DType(dt.priority, dt.itemsize, dt.name, dt.fmt)   # from its four fields: the one interned instance
  assert hash(dt) == hash(rebuilt) and dt is rebuilt
  if dt == dtypes.bfloat16:
    assert dt.np is None and dt.fmt is None and dt.itemsize == 2 and dt.is_float
    assert (dt.min, dt.max) == (-math.inf, math.inf)
    return
  numpy_dtype = np.dtype(dt.np)
  assert numpy_dtype.name == dt.name and numpy_dtype.itemsize == dt.itemsize
  assert struct.calcsize(dt.fmt) == dt.itemsize
  if dt.fmt != "e":  # memoryview.cast only learned the half-float format 'e' in Python 3.12
    assert memoryview(bytearray(dt.itemsize * 3)).cast(dt.fmt).format == dt.fmt
  assert dt.is_float == (numpy_dtype.kind == "f") and dt.is_int == (numpy_dtype.kind in "iu")
  if dt.is_float: assert (dt.min, dt.max) == (-math.inf, math.inf)
  elif dt.is_bool: assert (dt.min, dt.max) == (0, 1)
  else: assert (dt.min, dt.max) == (np.iinfo(numpy_dtype).min, np.iinfo(numpy_dtype).max)


def test_c_names():
  expected = {"bool": "bool", "int8": "signed char", "uint8": "unsigned char", "int16": "short",
              "uint16": "unsigned short", "int32": "int", "uint32": "unsigned int", "int64": "long long",
              "uint64": "unsigned long long", "float16": "_Float16", "bfloat16": "__bf16", "float32": "float",
              "float64": "double"}
  assert {dt.name: dt.c_name for dt in ALL_DTYPES} == expected


def test_dtype_is_frozen():
  with pytest.raises(AttributeError):
    dtypes.float32.itemsize = 8  # type: ignore[misc]


# ---------------------------------------------------------------- least_upper_dtype

# Rows and columns in this order; "!" means DTypeError. Cells torch answers are checked against torch below;
# the uint16/32/64 mixes torch refuses are our extension (smallest signed type strictly wider than the unsigned).
_SHORT = {"b": "bool", "u8": "uint8", "i8": "int8", "i16": "int16", "i32": "int32", "i64": "int64", "u16": "uint16",
          "u32": "uint32", "u64": "uint64", "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64"}
_PROMOTION_TABLE = """
      b    u8   i8   i16  i32  i64  u16  u32  u64  f16  bf16 f32  f64
b     b    u8   i8   i16  i32  i64  u16  u32  u64  f16  bf16 f32  f64
u8    u8   u8   i16  i16  i32  i64  u16  u32  u64  f16  bf16 f32  f64
i8    i8   i16  i8   i16  i32  i64  i32  i64  !    f16  bf16 f32  f64
i16   i16  i16  i16  i16  i32  i64  i32  i64  !    f16  bf16 f32  f64
i32   i32  i32  i32  i32  i32  i64  i32  i64  !    f16  bf16 f32  f64
i64   i64  i64  i64  i64  i64  i64  i64  i64  !    f16  bf16 f32  f64
u16   u16  u16  i32  i32  i32  i64  u16  u32  u64  f16  bf16 f32  f64
u32   u32  u32  i64  i64  i64  i64  u32  u32  u64  f16  bf16 f32  f64
u64   u64  u64  !    !    !    !    u64  u64  u64  f16  bf16 f32  f64
f16   f16  f16  f16  f16  f16  f16  f16  f16  f16  f16  f32  f32  f64
bf16  bf16 bf16 bf16 bf16 bf16 bf16 bf16 bf16 bf16 f32  bf16 f32  f64
f32   f32  f32  f32  f32  f32  f32  f32  f32  f32  f32  f32  f32  f64
f64   f64  f64  f64  f64  f64  f64  f64  f64  f64  f64  f64  f64  f64
"""


def _parse_promotion_table() -> dict[tuple[DType, DType], DType | None]:
  header, *rows = [line.split() for line in _PROMOTION_TABLE.strip().splitlines()]
  table: dict[tuple[DType, DType], DType | None] = {}
  for row_name, *cells in rows:
    for column_name, cell in zip(header, cells, strict=True):
      pair = (dtypes.from_name(_SHORT[row_name]), dtypes.from_name(_SHORT[column_name]))
      table[pair] = None if cell == "!" else dtypes.from_name(_SHORT[cell])
  return table


PROMOTION_TABLE = _parse_promotion_table()
ALL_PAIRS = list(itertools.product(ALL_DTYPES, ALL_DTYPES))


def test_promotion_table_is_complete_and_symmetric():
  assert set(PROMOTION_TABLE) == set(ALL_PAIRS)
  for a, b in ALL_PAIRS: assert PROMOTION_TABLE[(a, b)] == PROMOTION_TABLE[(b, a)], (a, b)


@pytest.mark.parametrize("a,b", ALL_PAIRS, ids=lambda dt: dt.name)
def test_least_upper_dtype_matches_table(a: DType, b: DType):
  expected = PROMOTION_TABLE[(a, b)]
  if expected is None:
    with pytest.raises(DTypeError) as info: least_upper_dtype(a, b)
    assert a.name in str(info.value) and b.name in str(info.value) and "cast" in str(info.value)
  else:
    assert least_upper_dtype(a, b) == expected


@needs_torch
@pytest.mark.parametrize("a,b", ALL_PAIRS, ids=lambda dt: dt.name)
def test_least_upper_dtype_matches_torch(a: DType, b: DType):
  try:
    torch_result = torch.promote_types(torch_dtype(a), torch_dtype(b))
  except RuntimeError:
    # torch refuses uint16/32/64 mixes; we extend (checked by the table) or raise
    assert a.is_unsigned or b.is_unsigned
    return
  assert least_upper_dtype(a, b) == from_torch(torch_result)


def test_uint64_with_signed_raises_naming_both():
  with pytest.raises(DTypeError, match="uint64") as info: least_upper_dtype(dtypes.uint64, dtypes.int8)
  assert "int8" in str(info.value) and isinstance(info.value, TypeError)
  # a float anywhere makes the integers irrelevant, as in torch.result_type
  assert least_upper_dtype(dtypes.uint64, dtypes.int8, dtypes.float16) == dtypes.float16


def test_least_upper_dtype_edge_cases():
  assert least_upper_dtype(dtypes.int8) == dtypes.int8
  assert least_upper_dtype(dtypes.bool, dtypes.bool, dtypes.bool) == dtypes.bool
  with pytest.raises(DTypeError): least_upper_dtype()
  with pytest.raises(DTypeError): least_upper_dtype(dtypes.int8, "float32")  # type: ignore[arg-type]


dtype_lists = st.lists(st.sampled_from(ALL_DTYPES), min_size=1, max_size=5)


def _lub_or_error(*dts: DType) -> DType | None:
  try:
    return least_upper_dtype(*dts)
  except DTypeError:
    return None


@given(dtype_lists, st.randoms())
def test_least_upper_dtype_is_order_independent_and_agrees_with_pairwise(dts: list[DType], rnd: random.Random):
  shuffled = list(dts)
  rnd.shuffle(shuffled)
  assert _lub_or_error(*dts) == _lub_or_error(*shuffled)
  # without a uint64/signed conflict, the n-ary result is the pairwise fold in any order
  pairwise = functools.reduce(lambda x, y: None if x is None else _lub_or_error(x, y), shuffled[1:], shuffled[0])
  if pairwise is not None: assert _lub_or_error(*dts) == pairwise


@given(dtype_lists)
def test_least_upper_dtype_holds_every_input_within_one_category(dts: list[DType]):
  result = _lub_or_error(*dts)
  if result is None: return
  assert all(result == dt or not dt.is_float or result.is_float for dt in dts)
  if all(dt.is_int for dt in dts) or all(dt.is_float for dt in dts):
    assert all(can_cast_safely(dt, result) for dt in dts), (dts, result)


# ---------------------------------------------------------------- result_dtype

SCALARS = [True, 3, 2.5]


def _expected_result_dtype(dt: DType, scalar: bool | int | float) -> DType:
  """Hard-written rule: the scalar matters only if its category is above the tensor's."""
  if isinstance(scalar, float) and not dt.is_float: return dtypes.float32
  if isinstance(scalar, int) and not isinstance(scalar, bool) and dt.is_bool: return dtypes.int32
  return dt


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("scalar", SCALARS, ids=repr)
def test_result_dtype_rules(dt: DType, scalar: bool | int | float):
  assert result_dtype(dt, scalar) == _expected_result_dtype(dt, scalar)


@needs_torch
@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("scalar", SCALARS, ids=repr)
def test_result_dtype_matches_torch(dt: DType, scalar: bool | int | float):
  try:
    torch_result = from_torch((torch.zeros(2, dtype=torch_dtype(dt)) + scalar).dtype)
  except (RuntimeError, NotImplementedError):
    # torch has no CPU add for uint16/32/64; we keep the tensor's dtype as for the other unsigned types
    assert dt.name in ("uint16", "uint32", "uint64")
    assert result_dtype(dt, scalar) == dt
    return
  if dt.is_bool and type(scalar) is int:
    # the one deliberate difference: our default int is int32, torch's is int64
    assert torch_result == dtypes.int64 and result_dtype(dt, scalar) == dtypes.int32
  else:
    assert result_dtype(dt, scalar) == torch_result


def test_result_dtype_keeps_narrow_tensor_dtypes_and_follows_defaults():
  assert result_dtype(dtypes.uint8, 300) == dtypes.uint8
  assert result_dtype(dtypes.float16, 1.5) == dtypes.float16
  assert result_dtype(dtypes.int8, np.float64(1.5)) == dtypes.float32
  with pytest.raises(DTypeError): result_dtype(dtypes.float32, 1j)  # type: ignore[arg-type]
  saved = dtypes.default_float
  try:
    dtypes.default_float = dtypes.float16
    assert result_dtype(dtypes.int32, 0.5) == dtypes.float16 and dtypes.from_py(0.5) == dtypes.float16
  finally:
    dtypes.default_float = saved


# ---------------------------------------------------------------- sum_dtype

@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_sum_dtype_rules(dt: DType):
  expected = dt if dt.is_float or dt == dtypes.uint64 else dtypes.int64
  assert sum_dtype(dt) == expected


@needs_torch
@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_sum_dtype_matches_torch(dt: DType):
  torch_result = from_torch(torch.zeros(2, dtype=torch_dtype(dt)).sum().dtype)
  if dt == dtypes.uint64:
    # deliberate: torch sums uint64 into int64, which cannot hold values >= 2**63; we keep uint64
    assert torch_result == dtypes.int64 and sum_dtype(dt) == dtypes.uint64
  else:
    assert sum_dtype(dt) == torch_result


# ---------------------------------------------------------------- conversions

@pytest.mark.parametrize("dt", NUMPY_DTYPES, ids=str)
def test_from_numpy_round_trips(dt: DType):
  assert dtypes.from_numpy(np.dtype(dt.np)) == dt
  assert dtypes.from_numpy(dt.np) == dt
  assert dtypes.from_numpy(np.zeros(2, dtype=dt.np).dtype) == dt
  assert to_numpy_dtype(dt) == np.dtype(dt.np)
  assert dtypes.from_numpy(to_numpy_dtype(dt)) == dt
  assert dtypes.as_dtype(dt.np) == dt and dtypes.as_dtype(np.dtype(dt.np)) == dt


@pytest.mark.parametrize("unsupported", [np.complex64, np.complex128, object, "U3", "S2", "datetime64[s]",
                                         "timedelta64[s]", np.longdouble if np.dtype(np.longdouble).itemsize > 8
                                         else np.clongdouble])
def test_from_numpy_rejects_unsupported(unsupported):
  name = np.dtype(unsupported).name
  with pytest.raises(DTypeError, match=re.escape(name)): dtypes.from_numpy(unsupported)
  with pytest.raises(DTypeError, match=re.escape(name)): dtypes.as_dtype(np.dtype(unsupported))


def test_from_numpy_rejects_byte_swapped():
  swapped = np.dtype(np.float32).newbyteorder()
  with pytest.raises(DTypeError, match="byte order"): dtypes.from_numpy(swapped)
  assert dtypes.from_numpy(np.dtype("<f4" if swapped.str.startswith(">") else ">f4")) == dtypes.float32


def test_to_numpy_dtype_refuses_bfloat16():
  with pytest.raises(DTypeError, match="bfloat16"): to_numpy_dtype(dtypes.bfloat16)


@pytest.mark.parametrize("dt", ALL_DTYPES, ids=str)
def test_from_name_and_as_dtype(dt: DType):
  assert dtypes.from_name(dt.name) is dt
  assert dtypes.from_name(repr(dt)) is dt
  assert dtypes.as_dtype(dt.name) is dt and dtypes.as_dtype(dt) is dt


def test_from_name_aliases_and_errors():
  for alias, dt in [("half", dtypes.float16), ("float", dtypes.float32), ("double", dtypes.float64),
                    ("char", dtypes.int8), ("uchar", dtypes.uint8), ("short", dtypes.int16), ("int", dtypes.int32),
                    ("long", dtypes.int64)]:
    assert dtypes.from_name(alias) is dt
  with pytest.raises(DTypeError, match="float32") as info: dtypes.from_name("float33")
  assert "float33" in str(info.value) and "bfloat16" in str(info.value)  # lists the valid names


def test_as_dtype_python_types_and_errors():
  assert dtypes.as_dtype(bool) is dtypes.bool
  assert dtypes.as_dtype(int) is dtypes.default_int
  assert dtypes.as_dtype(float) is dtypes.default_float
  for bad in [complex, 3, None, [dtypes.int8], np.float32(1.0), "nonsense"]:
    with pytest.raises(DTypeError): dtypes.as_dtype(bad)


FROM_PY_CASES = [
  (True, dtypes.bool), (3, dtypes.int32), (2.5, dtypes.float32), ([], dtypes.float32), ([[]], dtypes.float32),
  ([True, False], dtypes.bool), ([1, True], dtypes.int32), ([True, 2.5], dtypes.float32),
  ([[1, 2], [3.0, 4]], dtypes.float32), (((1,), (2,)), dtypes.int32), ([[[False]]], dtypes.bool),
  ([1, [2, [3, [4.5]]]], dtypes.float32),
]


@pytest.mark.parametrize("value,expected", FROM_PY_CASES, ids=repr)
def test_from_py(value, expected: DType):
  assert dtypes.from_py(value) == expected


@needs_torch
@pytest.mark.parametrize("value,expected", [c for c in FROM_PY_CASES if c[0] != [1, [2, [3, [4.5]]]]], ids=repr)
def test_from_py_matches_torch(value, expected: DType):
  torch_result = from_torch(torch.tensor(value).dtype)
  # torch's default int is int64, ours int32
  assert dtypes.from_py(value) == (dtypes.int32 if torch_result == dtypes.int64 else torch_result)


def test_from_py_rejects_non_numbers_and_handles_deep_nesting():
  for bad in [1j, "a", [1, "a"], [2.5, None], None]:
    with pytest.raises(DTypeError): dtypes.from_py(bad)
  deep: list = [1.5]
  for _ in range(5000): deep = [deep]
  assert dtypes.from_py(deep) == dtypes.float32
  assert dtypes.from_py([np.int16(1), np.bool_(True)]) == dtypes.int32


# ---------------------------------------------------------------- can_cast_safely

def _bfloat16_values() -> list[float]:
  bits = np.arange(1 << 16, dtype=np.uint32) << 16
  with np.errstate(invalid="ignore"):  # signalling-nan bit patterns warn when widened
    return bits.view(np.float32).astype(np.float64).tolist()


def _sample_values(dt: DType) -> list[int | float]:
  """Every value of the 1- and 2-byte dtypes; for wider ones the values most likely to fail a cast."""
  if dt.is_bool: return [0, 1]
  if dt.is_int and dt.itemsize <= 2: return list(range(int(dt.min), int(dt.max) + 1))
  if dt == dtypes.float16: return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float64).tolist()
  if dt == dtypes.bfloat16: return _bfloat16_values()
  if dt.is_int:
    powers = [sign * (1 << k) + delta for k in range(dt.bits) for sign in (1, -1) for delta in (-1, 0, 1)]
    return [v for v in powers + [int(dt.min), int(dt.max)] if dt.min <= v <= dt.max]
  info = np.finfo(dt.np)
  # each candidate rounded to a value of `dt` itself (0.1 stands for float32's nearest value to 0.1)
  return [float(dt.np(v)) for v in (info.max, -info.max, info.tiny, info.smallest_subnormal, 1 + info.eps, 0.1, 1e10,
                             65504.0, 2.0 ** 24 + 2 if dt == dtypes.float32 else 2.0 ** 53 + 2, math.inf, 3.0)]


def _exactly_representable(dt: DType, value: int | float) -> bool:
  """Is `value` one of dt's values? Checked with plain Python/numpy, independently of ourgrad.dtype."""
  if isinstance(value, float) and math.isnan(value): return dt.is_float
  if dt.is_bool: return value in (0, 1)
  if dt.is_int: return (not isinstance(value, float) or (math.isfinite(value) and value.is_integer())) and \
    dt.min <= value <= dt.max
  with np.errstate(over="ignore"):
    rounded = np.float64(value).astype(np.float32 if dt == dtypes.bfloat16 else dt.np)
  if dt == dtypes.bfloat16 and (int(np.float32(rounded).view(np.uint32)) & 0xFFFF) != 0: return False
  return float(rounded) == value if isinstance(value, float) else math.isfinite(rounded) and int(rounded) == value


@pytest.mark.parametrize("src,dst", ALL_PAIRS, ids=lambda dt: dt.name)
def test_can_cast_safely_agrees_with_sampled_values(src: DType, dst: DType):
  values = _sample_values(src)
  failures = [v for v in values if not _exactly_representable(dst, v)]
  if can_cast_safely(src, dst): assert not failures, f"{src}->{dst} claimed safe but {failures[:3]} are not exact"
  else: assert failures, f"{src}->{dst} claimed unsafe but every sampled value is exact"


def test_can_cast_safely_examples():
  assert can_cast_safely(dtypes.int16, dtypes.float32) and not can_cast_safely(dtypes.int32, dtypes.float32)
  assert can_cast_safely(dtypes.uint8, dtypes.bfloat16) and not can_cast_safely(dtypes.int16, dtypes.bfloat16)
  assert not can_cast_safely(dtypes.float16, dtypes.bfloat16) and not can_cast_safely(dtypes.bfloat16, dtypes.float16)
  assert can_cast_safely(dtypes.uint32, dtypes.int64) and not can_cast_safely(dtypes.int8, dtypes.uint64)


# ---------------------------------------------------------------- truncate

def test_truncate_integers_wrap():
  assert truncate(dtypes.int8, 200) == -56
  assert truncate(dtypes.uint8, -1) == 255
  assert truncate(dtypes.int32, 2**31) == -(2**31)
  assert truncate(dtypes.uint64, -1) == 2**64 - 1
  assert truncate(dtypes.int64, 2**63 + 5) == -(2**63) + 5
  assert truncate(dtypes.int16, -3.9) == -3  # floats truncate toward zero first, like a C cast
  assert truncate(dtypes.int32, True) == 1 and type(truncate(dtypes.int32, 7.0)) is int
  # nan/inf have no integer value; saturate like CUDA instead of crashing constant folding
  assert truncate(dtypes.int32, math.nan) == 0
  assert truncate(dtypes.int8, math.inf) == 127 and truncate(dtypes.uint8, -math.inf) == 0


@pytest.mark.parametrize("dt", [dt for dt in NUMPY_DTYPES if dt.is_int], ids=str)
@settings(max_examples=200)
@given(value=st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_truncate_integers_match_numpy_wraparound(dt: DType, value: int):
  assert truncate(dt, value) == int(np.array(value, dtype=np.int64).astype(dt.np))


def test_truncate_bool():
  assert truncate(dtypes.bool, 5) is True and truncate(dtypes.bool, 0.0) is False and truncate(dtypes.bool, -1) is True


def _random_float_values(count: int, seed: int) -> list[float]:
  rnd = random.Random(seed)
  values = [0.0, -0.0, 1.0, -1.0, 1.00390625, 1.01171875, -1.00390625, math.inf, -math.inf, math.nan, -math.nan,
            3.4028234663852886e38, 3.3961e38, 1e39, -1e39, 1e-39, 1e-45, 1.5e-45, 5e-324, 65504.0, 65520.0, 1e300,
            float(2**24 + 1), 0.1, 1 / 3]
  while len(values) < count:
    magnitude = 10.0 ** rnd.uniform(-46, 40)
    values.append(rnd.choice([-1, 1]) * rnd.choice([magnitude, rnd.gauss(0, 10)]))
  return values


FLOAT_VALUES = _random_float_values(220, seed=0)


def _same_float(a: float, b: float) -> bool:
  if math.isnan(a) or math.isnan(b): return math.isnan(a) and math.isnan(b)
  return a == b and math.copysign(1, a) == math.copysign(1, b)


def test_truncate_bfloat16_known_values():
  assert truncate(dtypes.bfloat16, 1.00390625) == 1.0          # exact tie: rounds to the even mantissa
  assert truncate(dtypes.bfloat16, 1.01171875) == 1.015625     # exact tie: rounds up to the even mantissa
  assert truncate(dtypes.bfloat16, 1.005) == 1.0078125
  assert truncate(dtypes.bfloat16, 3.4028234663852886e38) == math.inf  # float32 max rounds up past bfloat16 max
  assert math.isnan(truncate(dtypes.bfloat16, math.nan))
  assert truncate(dtypes.bfloat16, 257) == 256 and truncate(dtypes.bfloat16, 259) == 260  # ints: ties to even
  assert math.copysign(1, truncate(dtypes.bfloat16, -0.0)) == -1


@needs_torch
def test_truncate_bfloat16_matches_torch():
  for value in FLOAT_VALUES:
    expected = torch.tensor(value, dtype=torch.bfloat16).item()
    assert _same_float(truncate(dtypes.bfloat16, value), expected), value


@needs_torch
@settings(max_examples=300)
@given(st.integers(min_value=-(2**24), max_value=2**24))
def test_truncate_bfloat16_integers_match_torch(value: int):
  # below 2**24 torch's int -> float32 step is exact, so its bfloat16 is the correctly rounded one
  assert truncate(dtypes.bfloat16, value) == torch.tensor(value, dtype=torch.bfloat16).item()


@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.float32], ids=str)
def test_truncate_narrow_floats_match_numpy(dt: DType):
  with np.errstate(over="ignore"):
    for value in FLOAT_VALUES:
      assert _same_float(truncate(dt, value), float(dt.np(value))), value
  assert truncate(dtypes.float16, 65519.0) == 65504.0 and truncate(dtypes.float16, 65520.0) == math.inf
  assert truncate(dtypes.float16, 1e-8) == 0.0


@pytest.mark.parametrize("dt", [dtypes.float16, dtypes.float32, dtypes.float64], ids=str)
@settings(max_examples=300)
@given(value=st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1),
                       st.integers(min_value=-(2**63), max_value=2**63 - 1).map(lambda v: v | 1)))
def test_truncate_integers_to_floats_round_correctly(dt: DType, value: int):
  # numpy's int64 -> float cast is a single, correctly rounded hardware conversion (no double rounding)
  with np.errstate(over="ignore"):
    expected = float(np.array(value, dtype=np.int64).astype(dt.np))
  assert truncate(dt, value) == expected


def test_truncate_float32_int_avoids_double_rounding():
  # 2**60 + 2**36 + 1: rounding to float64 first gives the exact tie 2**60 + 2**36, which then rounds to even (down)
  value = 2**60 + 2**36 + 1
  assert truncate(dtypes.float32, value) == float(2**60 + 2**37)


def test_truncate_float64_and_huge_ints():
  assert truncate(dtypes.float64, 0.1) == 0.1 and truncate(dtypes.float64, True) == 1.0
  assert truncate(dtypes.float64, 2**2000) == math.inf and truncate(dtypes.float32, -(2**2000)) == -math.inf
  assert type(truncate(dtypes.float16, 3)) is float
