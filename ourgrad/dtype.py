"""Data types: the `DType` descriptor, the `dtypes` namespace, and the rules that combine dtypes.

This module decides what dtype every result has: promotion between tensors (`least_upper_dtype`), tensor
with Python scalar (`result_dtype`), reductions (`sum_dtype`), plus conversions from numpy / Python / names
(`dtypes.as_dtype` and friends) and `truncate`, which rounds a Python scalar to what a constant of a dtype
holds (used by constant folding and the Python device). Promotion follows PyTorch, extended where PyTorch
refuses (uint16/uint32 mixed with signed integers).
"""
from __future__ import annotations

import functools

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ourgrad.errors import DTypeError

# ---------------------------------------------------------------- per-dtype facts, keyed by name

_FLOAT_NAMES = frozenset({"float16", "bfloat16", "float32", "float64"})
_SIGNED_NAMES = frozenset({"int8", "int16", "int32", "int64"})
_UNSIGNED_NAMES = frozenset({"uint8", "uint16", "uint32", "uint64"})

_C_NAMES: dict[str, str] = {
  "bool": "bool", "int8": "signed char", "uint8": "unsigned char", "int16": "short", "uint16": "unsigned short",
  "int32": "int", "uint32": "unsigned int", "int64": "long long", "uint64": "unsigned long long",
  "float16": "_Float16", "bfloat16": "__bf16", "float32": "float", "float64": "double",
}

# numpy has no bfloat16, so it maps to None
_NUMPY_TYPES: dict[str, type | None] = {
  "bool": np.bool_, "int8": np.int8, "uint8": np.uint8, "int16": np.int16, "uint16": np.uint16,
  "int32": np.int32, "uint32": np.uint32, "int64": np.int64, "uint64": np.uint64,
  "float16": np.float16, "bfloat16": None, "float32": np.float32, "float64": np.float64,
}

# (significand bits including the implicit one, exponent bits): decides exactness of casts and int rounding
_FLOAT_FORMATS: dict[str, tuple[int, int]] = {
  "float16": (11, 5), "bfloat16": (8, 8), "float32": (24, 8), "float64": (53, 11),
}


# every DType made, by its fields: DType(...) hands back the one instance of those fields (DType.__new__)
_INTERNED_DTYPES: dict[tuple, DType] = {}


# eq=False: one instance per dtype (interned, and pickled and copied as itself), so equality and hashing are the
# object's own, done in C. The dataclass's generated __eq__ was a Python call at each `dtype == dtype` (several per op)
@dataclass(frozen=True, eq=False)
class DType:
  """One scalar data type. Instances live in `dtypes`; compare them with `==` (or `is`)."""
  priority: int      # order used only for sorting / tie breaks
  itemsize: int      # bytes per element
  name: str          # "float32", "bfloat16", "bool", ...
  fmt: str | None    # struct/memoryview format char; None for bfloat16, which neither knows

  def __new__(cls, priority: int, itemsize: int, name: str, fmt: str | None) -> DType:
    fields = (cls, priority, itemsize, name, fmt)
    existing = _INTERNED_DTYPES.get(fields)
    if existing is None: existing = _INTERNED_DTYPES[fields] = super().__new__(cls)
    return existing

  def __reduce__(self) -> tuple:   # unpickled and copied through DType(...): the interned instance
    return (type(self), (self.priority, self.itemsize, self.name, self.fmt))

  def __repr__(self) -> str: return f"dtypes.{self.name}"

  def __lt__(self, other: DType) -> bool:
    """Order by priority, so sorted() lists dtypes bool, int8, uint8, ..., float64."""
    return (self.priority, self.itemsize, self.name) < (other.priority, other.itemsize, other.name)

  @functools.cached_property   # (read several times per op built: a plain attribute after the first)
  def is_float(self) -> bool:
    """True for float16, bfloat16, float32, float64."""
    return self.name in _FLOAT_NAMES

  @functools.cached_property
  def is_int(self) -> bool:
    """True for signed and unsigned integers; bool is not an integer here."""
    return self.name in _SIGNED_NAMES or self.name in _UNSIGNED_NAMES

  @functools.cached_property
  def is_unsigned(self) -> bool:
    """True for uint8/16/32/64 (not bool)."""
    return self.name in _UNSIGNED_NAMES

  @functools.cached_property
  def is_bool(self) -> bool:
    """True only for dtypes.bool."""
    return self.name == "bool"

  @property
  def np(self) -> type | None:
    """The numpy scalar type (np.float32, ...), or None for bfloat16, which numpy lacks."""
    return _NUMPY_TYPES[self.name]

  @property
  def c_name(self) -> str:
    """The C type the C renderer declares for this dtype."""
    return _C_NAMES[self.name]

  @property
  def bits(self) -> int:
    """Width in bits."""
    return self.itemsize * 8

  @property
  def min(self) -> int | float:
    """Smallest representable value: -inf for floats, 0 for bool and unsigned ints."""
    if self.is_float: return -math.inf
    if self.is_bool or self.is_unsigned: return 0
    return -(1 << (self.bits - 1))

  @property
  def max(self) -> int | float:
    """Largest representable value: inf for floats, 1 for bool."""
    if self.is_float: return math.inf
    if self.is_bool: return 1
    return (1 << self.bits) - 1 if self.is_unsigned else (1 << (self.bits - 1)) - 1


# ---------------------------------------------------------------- the namespace

# scalar categories, ordered: a higher category wins in promotion
_BOOL, _INT, _FLOAT = 0, 1, 2


class dtypes:
  """Namespace of every DType (plus C-style aliases) and the constructors that find a DType from other things."""
  bool = DType(0, 1, "bool", "?")
  int8 = DType(1, 1, "int8", "b")
  uint8 = DType(2, 1, "uint8", "B")
  int16 = DType(3, 2, "int16", "h")
  uint16 = DType(4, 2, "uint16", "H")
  int32 = DType(5, 4, "int32", "i")
  uint32 = DType(6, 4, "uint32", "I")
  int64 = DType(7, 8, "int64", "q")
  uint64 = DType(8, 8, "uint64", "Q")
  float16 = DType(9, 2, "float16", "e")
  bfloat16 = DType(10, 2, "bfloat16", None)
  float32 = DType(11, 4, "float32", "f")
  float64 = DType(12, 8, "float64", "d")

  # aliases (note: inside this class body `bool`/`int`/`float` name DTypes, not the builtins)
  half = float16
  float = float32
  double = float64
  char = int8
  uchar = uint8
  short = int16
  int = int32
  long = int64

  # read at call time (not copied), so assigning dtypes.default_float = dtypes.float16 takes effect everywhere
  default_float: DType = float32
  default_int: DType = int32

  @staticmethod
  def all() -> list[DType]:
    """The 13 dtypes, without aliases, in priority order."""
    return list(_ALL_DTYPES)

  @staticmethod
  def from_numpy(np_dtype: Any) -> DType:
    """DType of a numpy dtype (or anything np.dtype() accepts, e.g. np.float32); DTypeError if unsupported."""
    try:
      numpy_dtype = np.dtype(np_dtype)
    except (TypeError, ValueError) as e:
      raise DTypeError(f"{np_dtype!r} is not a numpy dtype; pass e.g. np.float32 or np.dtype('int8')") from e
    found = _BY_NAME.get(numpy_dtype.name)
    if found is None or found.np is None or numpy_dtype.kind not in "biuf":
      raise DTypeError(f"numpy dtype {numpy_dtype.name} is not supported; convert the array first, e.g. "
                       f".astype(np.float32); supported: {', '.join(dt.name for dt in _ALL_DTYPES if dt.np)}")
    # a byte-swapped array would be read with the wrong byte order by every device
    if numpy_dtype.byteorder not in ("=", "|"):
      raise DTypeError(f"numpy dtype {numpy_dtype.str} ({numpy_dtype.name}) is not in native byte order; "
                       f"convert it with .astype(np.{numpy_dtype.name})")
    return found

  @staticmethod
  def from_py(value: Any) -> DType:
    """DType for a Python scalar or a (nested) list/tuple of them.

    bool -> bool, int -> default_int, float -> default_float; a list takes the highest category of its elements;
    an empty list is default_float. numpy scalars count by category (np.int16(1) counts as an int)."""
    category = _BOOL
    saw_scalar = False
    pending: list[Any] = [value]
    # an explicit stack instead of recursion: deeply nested lists must not hit the recursion limit
    while pending:
      item = pending.pop()
      if isinstance(item, (list, tuple)):
        pending.extend(item)
        continue
      category = max(category, _scalar_category(item, "dtypes.from_py"))
      saw_scalar = True
    if not saw_scalar: return dtypes.default_float
    return (dtypes.bool, dtypes.default_int, dtypes.default_float)[category]

  @staticmethod
  def from_name(name: str) -> DType:
    """DType for a name ("float32") or alias ("float", "half", "long"); a "dtypes." prefix is allowed."""
    key = name[len("dtypes."):] if isinstance(name, str) and name.startswith("dtypes.") else name
    found = _BY_NAME.get(key) if isinstance(key, str) else None
    if found is None:
      raise DTypeError(f"unknown dtype name {name!r}; valid names: {', '.join(sorted(_BY_NAME))}")
    return found

  @staticmethod
  def as_dtype(x: Any) -> DType:
    """Any dtype-like thing -> DType: a DType, a name, a numpy dtype or scalar type, or Python bool/int/float."""
    if isinstance(x, DType): return x
    if isinstance(x, str): return dtypes.from_name(x)
    # the Python types must be checked before numpy: np.dtype(int) would say int64, np.dtype(float) float64
    if x is _py_bool: return dtypes.bool
    if x is _py_int: return dtypes.default_int
    if x is _py_float: return dtypes.default_float
    if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)): return dtypes.from_numpy(x)
    raise DTypeError(f"cannot interpret {x!r} (a {type(x).__name__}) as a dtype; pass a DType such as "
                     f"dtypes.float32, a name like 'float32', a numpy dtype, or bool/int/float")


_py_bool, _py_int, _py_float = bool, int, float  # the builtins, for code where `dtypes.bool` etc. could confuse

_ALL_DTYPES: tuple[DType, ...] = (dtypes.bool, dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16, dtypes.int32,
                                  dtypes.uint32, dtypes.int64, dtypes.uint64, dtypes.float16, dtypes.bfloat16,
                                  dtypes.float32, dtypes.float64)
_ALIASES: dict[str, DType] = {"half": dtypes.float16, "float": dtypes.float32, "double": dtypes.float64,
                              "char": dtypes.int8, "uchar": dtypes.uint8, "short": dtypes.int16,
                              "int": dtypes.int32, "long": dtypes.int64}
_BY_NAME: dict[str, DType] = {**{dt.name: dt for dt in _ALL_DTYPES}, **_ALIASES}
_SIGNED_BY_SIZE: dict[int, DType] = {1: dtypes.int8, 2: dtypes.int16, 4: dtypes.int32, 8: dtypes.int64}
_UNSIGNED_BY_SIZE: dict[int, DType] = {1: dtypes.uint8, 2: dtypes.uint16, 4: dtypes.uint32, 8: dtypes.uint64}


def _scalar_category(value: Any, caller: str) -> int:
  """Category (_BOOL/_INT/_FLOAT) of a Python or numpy scalar; DTypeError for anything else."""
  # the plain Python scalars by their exact type first (every `x * 0.9` asks): no isinstance with numpy's types
  category = _PY_SCALAR_CATEGORIES.get(type(value))
  if category is not None: return category
  # bool before int: bool is a subclass of int
  if isinstance(value, (_py_bool, np.bool_)): return _BOOL
  if isinstance(value, (_py_int, np.integer)): return _INT
  if isinstance(value, (_py_float, np.floating)): return _FLOAT
  raise DTypeError(f"{caller}: {value!r} (a {type(value).__name__}) has no ourgrad dtype; only bool, int and float "
                   f"scalars are supported (complex numbers and strings are not)")


_PY_SCALAR_CATEGORIES = {_py_bool: _BOOL, _py_int: _INT, _py_float: _FLOAT}


def _category(dt: DType) -> int:
  return _FLOAT if dt.is_float else _INT if dt.is_int else _BOOL


# ---------------------------------------------------------------- promotion

def _promote_ints(dts: list[DType]) -> DType:
  """Least integer dtype holding every value of all `dts` (all integers)."""
  signed = [dt for dt in dts if not dt.is_unsigned]
  unsigned = [dt for dt in dts if dt.is_unsigned]
  if not signed: return max(unsigned, key=lambda dt: dt.itemsize)
  widest_signed = max(signed, key=lambda dt: dt.itemsize)
  if not unsigned: return widest_signed
  widest_unsigned = max(unsigned, key=lambda dt: dt.itemsize)
  # a signed type holds an unsigned one only if strictly wider
  needed_size = max(widest_signed.itemsize, widest_unsigned.itemsize * 2)
  if needed_size > 8:
    raise DTypeError(f"cannot promote {widest_unsigned} and {widest_signed}: no integer dtype holds every value of "
                     f"both; cast one explicitly first, e.g. x.cast(dtypes.int64) or x.cast(dtypes.float64)")
  return _SIGNED_BY_SIZE[needed_size]


def _promote_floats(dts: list[DType]) -> DType:
  """Least float dtype for a mix of floats: the widest, except float16 with bfloat16 which needs float32."""
  names = {dt.name for dt in dts}
  if "float64" in names: return dtypes.float64
  # neither 16-bit format holds the other (more mantissa vs more exponent), float32 holds both
  if "float32" in names or {"float16", "bfloat16"} <= names: return dtypes.float32
  return dtypes.float16 if "float16" in names else dtypes.bfloat16


def least_upper_dtype(*dts: DType) -> DType:
  """Promotion of tensor dtypes, PyTorch's rules, order independent.

  Category bool < integer < floating, and only the dtypes of the highest category present matter (int64 with
  float16 gives float16). Within integers the widest, and signed mixed with unsigned gives the smallest signed
  type strictly wider than the unsigned one (uint8+int8 -> int16, uint16+int8 -> int32, uint32+int32 -> int64);
  uint64 with any signed int raises DTypeError (PyTorch refuses all uint16/32/64 mixes; we extend where we can).
  Within floats the widest; float16 with bfloat16 gives float32."""
  if not dts: raise DTypeError("least_upper_dtype needs at least one dtype")
  for dt in dts:
    if not isinstance(dt, DType): raise DTypeError(f"least_upper_dtype takes DTypes, got {dt!r}; use dtypes.as_dtype")
  top = max(_category(dt) for dt in dts)
  candidates = [dt for dt in dts if _category(dt) == top]
  if top == _FLOAT: return _promote_floats(candidates)
  if top == _INT: return _promote_ints(candidates)
  return dtypes.bool


def result_dtype(tensor_dtype: DType, scalar: bool | int | float) -> DType:
  """dtype of `tensor <op> python_scalar` (PyTorch semantics).

  The scalar only matters if its category is higher than the tensor's: bool tensor + int -> default_int (int32;
  PyTorch would say int64), bool/int tensor + float -> default_float; otherwise the tensor's dtype is kept
  (uint8 tensor + 300 stays uint8, float16 tensor + 1.5 stays float16)."""
  scalar_category = _scalar_category(scalar, "result_dtype")
  if scalar_category <= _category(tensor_dtype): return tensor_dtype
  return dtypes.default_float if scalar_category == _FLOAT else dtypes.default_int


def operands_dtype(tensor_dtypes: Sequence[DType], zero_dim_dtypes: Sequence[DType] = (),
                   scalars: Sequence[bool | int | float] = ()) -> DType:
  """dtype of an op over n-d tensors, 0-d tensors and Python scalars: PyTorch's torch.result_type.

  Each of the three groups promotes within itself (least_upper_dtype; a Python int counts as default_int, a float as
  default_float). A 0-d tensor then matters only when its category is higher than the n-d tensors' (float16 tensor
  + 0-d float32 tensor -> float16, int tensor + 0-d float64 tensor -> float64), and a Python scalar only when its
  category is higher than both tensor groups' (result_dtype)."""
  def group(dts: list[DType]) -> DType | None: return least_upper_dtype(*dts) if dts else None
  wrapped = [dtypes.default_float if category == _FLOAT else dtypes.default_int if category == _INT else dtypes.bool
             for category in (_scalar_category(value, "operands_dtype") for value in scalars)]
  result = _combine_groups(group(list(tensor_dtypes)), _combine_groups(group(list(zero_dim_dtypes)), group(wrapped)))
  if result is None: raise DTypeError("operands_dtype needs at least one operand")
  return result


def _combine_groups(higher: DType | None, lower: DType | None) -> DType | None:
  """PyTorch's combine_categories: `lower` (a lower-priority group) changes `higher` only if of a higher category."""
  if higher is None or lower is None: return lower if higher is None else higher
  if higher.is_float: return higher
  if higher.is_bool or lower.is_float: return least_upper_dtype(higher, lower)
  return higher


def sum_dtype(dt: DType) -> DType:
  """dtype of sum()/cumsum()/prod() results: bool and integers accumulate in int64, as in PyTorch, except uint64,
  which stays uint64 (PyTorch uses int64, which cannot hold its large values); floats keep their dtype."""
  if dt.is_float or dt == dtypes.uint64: return dt
  return dtypes.int64


def is_additive_identity(value: Any, dtype: DType) -> bool:
  """Whether x + value is x for every x of `dtype`: 0 for integers and bools, but for floats only -0.0
  ((-0.0) + (+0.0) is +0.0, so folding x + 0.0 to x would turn a -0.0 result into -0.0 where IEEE gives +0.0)."""
  if value is None or value != 0: return False
  return not dtype.is_float or math.copysign(1.0, float(value)) < 0


def can_cast_safely(src: DType, dst: DType) -> bool:
  """True when every value of `src` is exactly representable in `dst` (nan and infinities included)."""
  if src == dst or src.is_bool: return True  # 0 and 1 fit everywhere
  if dst.is_bool: return False
  if src.is_float:
    if not dst.is_float: return False
    src_significand, src_exponent = _FLOAT_FORMATS[src.name]
    dst_significand, dst_exponent = _FLOAT_FORMATS[dst.name]
    return dst_significand >= src_significand and dst_exponent >= src_exponent
  # src is an integer; magnitude bits of its largest value (in absolute terms, -2**(n-1) is a power of two)
  magnitude_bits = src.bits if src.is_unsigned else src.bits - 1
  if dst.is_float: return magnitude_bits <= _FLOAT_FORMATS[dst.name][0]
  if src.is_unsigned: return dst.bits >= src.bits if dst.is_unsigned else dst.bits > src.bits
  return not dst.is_unsigned and dst.bits >= src.bits


def to_numpy_dtype(dt: DType) -> np.dtype:
  """The numpy dtype for `dt`; bfloat16 raises DTypeError (numpy has none; callers handle bfloat16 themselves)."""
  if dt.np is None:
    raise DTypeError(f"{dt} has no numpy dtype; convert bfloat16 data explicitly (e.g. via float32 bits)")
  return np.dtype(dt.np)


# ---------------------------------------------------------------- constant rounding

def _round_int_to_significand(value: int, significand_bits: int) -> int:
  """Round an int to the nearest int with at most `significand_bits` significant bits, ties to even.

  Rounding the int exactly first avoids double rounding (int -> float64 -> float32 can be off by one ulp)."""
  magnitude = abs(value)
  if magnitude < (1 << significand_bits): return value
  shift = magnitude.bit_length() - significand_bits
  kept, dropped = magnitude >> shift, magnitude & ((1 << shift) - 1)
  half = 1 << (shift - 1)
  if dropped > half or (dropped == half and kept & 1): kept += 1
  return (kept << shift) if value >= 0 else -(kept << shift)


def _exact_float(value: Any) -> float:
  """float(value), with ints too large for float64 becoming +-inf instead of raising OverflowError."""
  try:
    return float(value)
  except OverflowError:
    return math.inf if value > 0 else -math.inf


# ---------------------------------------------------------------- bfloat16 rounding: the one home
# bfloat16 is the top half of a float32. Rounding is to nearest, ties to even; a NaN keeps its sign and becomes a quiet
# NaN (payload truncated, quiet bit set, so it cannot turn into an infinity). The C helpers every C-like renderer emits
# (renderer/cstyle.py `bfloat16_helpers`) and LLVM's rounding compute exactly this.

def float32_to_bfloat16_bits(values: Any) -> np.ndarray:
  """float values rounded to bfloat16, as uint16 bit patterns (the same shape)."""
  array = np.asarray(values)
  with np.errstate(over="ignore", invalid="ignore"):
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32).reshape(array.shape)
  is_nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
  # adding 0x7fff plus the lowest kept bit rounds to nearest, ties to even; a carry correctly rounds up to inf
  rounded = (bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
  return np.where(is_nan, (bits >> np.uint32(16)) | np.uint32(0x40), rounded).astype(np.uint16)


def bfloat16_bits_to_float32(bits: Any) -> np.ndarray:
  """uint16 bfloat16 bit patterns as float32 values (exact)."""
  return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_to_bfloat16(values: Any) -> np.ndarray:
  """float values rounded to the nearest bfloat16, held as float32."""
  return bfloat16_bits_to_float32(float32_to_bfloat16_bits(values))


def to_bfloat16(value: float) -> float:
  """A Python float rounded to bfloat16 (see `float32_to_bfloat16_bits`), as a Python float."""
  with np.errstate(over="ignore"):
    as_float32 = np.float32(value)
  return float(round_to_bfloat16(as_float32))


def truncate(dt: DType, value: Any) -> Any:
  """Convert a Python scalar to what a constant of dtype `dt` holds (constant folding, Python device).

  Integers wrap modulo 2**bits (two's complement for signed); floats are truncated toward zero first, and since
  nan/inf have no integer value they saturate (nan -> 0, inf -> max, -inf -> min) like CUDA's conversions.
  bool -> bool(value). Floats round to nearest even in the target format (ints are rounded exactly, without
  going through float64); float64 -> float(value)."""
  if dt.is_bool: return bool(value)
  if dt.is_int:
    if isinstance(value, (_py_float, np.floating)) and not math.isfinite(value):
      return 0 if math.isnan(value) else dt.max if value > 0 else dt.min
    wrapped = int(value) & ((1 << dt.bits) - 1)
    if not dt.is_unsigned and wrapped >= (1 << (dt.bits - 1)): wrapped -= 1 << dt.bits
    return wrapped
  if not dt.is_float: raise DTypeError(f"truncate: unknown dtype {dt!r}")
  if isinstance(value, (_py_int, np.integer)) and not isinstance(value, (_py_bool, np.bool_)):
    value = _round_int_to_significand(int(value), _FLOAT_FORMATS[dt.name][0])
  as_float = _exact_float(value)
  if dt == dtypes.float64: return as_float
  if dt == dtypes.bfloat16: return to_bfloat16(as_float)
  # float64 -> float32/float16 overflow to inf is the intended result, not an error worth a warning
  with np.errstate(over="ignore"):
    return float(dt.np(as_float))
