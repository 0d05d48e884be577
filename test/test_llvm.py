"""The LLVM device: kernels rendered to LLVM IR and JIT-compiled with llvmlite compute what the contract says.

Two kinds of checks:
- primitive kernels built directly from UOps (one ALU, CAST or BITCAST per element, gated loads and stores) compared
  with ourgrad's scalar reference (`exec_alu`, `truncate`) on edge values: NaN, infinities, -0, integer limits,
  zero divisors, shifts past the bit width, out-of-range float -> int;
- whole graphs built with Tensor (fused elementwise chains, reductions, matmuls with upcast/unroll, padded views)
  realized on LLVM and on CLANG and compared with each other and with numpy.
"""
from __future__ import annotations

import math
import platform
import re
import struct
from typing import Any, Callable

import numpy as np
import pytest

pytest.importorskip("llvmlite")

from ourgrad import Tensor  # noqa: E402
from ourgrad.codegen.kernel import Kernel, Opt, OptOps  # noqa: E402
from ourgrad.codegen.uops import AxisType, UOp, UOpBuilder, UOps  # noqa: E402
from ourgrad.device import Buffer, Device  # noqa: E402
from ourgrad.dtype import DType, dtypes, truncate  # noqa: E402
from ourgrad.engine.realize import compile_kernel, run_schedule  # noqa: E402
from ourgrad.engine.schedule import create_schedule  # noqa: E402
from ourgrad.errors import CompileError  # noqa: E402
from ourgrad.ops import Ops, exec_alu  # noqa: E402
from ourgrad.renderer.llvmir import round_to_bfloat16  # noqa: E402

INT32 = dtypes.int32
FLOATS = [dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64]
INTS = [dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16, dtypes.int32, dtypes.uint32, dtypes.int64,
        dtypes.uint64]
ALL_DTYPES = [dtypes.bool, *INTS, *FLOATS]
# relative tolerance of libm-style math (exp2, log2, sin) per dtype; basic arithmetic must be exact
MATH_RTOL = {dtypes.float16: 1e-3, dtypes.bfloat16: 8e-3, dtypes.float32: 3e-7, dtypes.float64: 1e-15}
GRAPH_TOL = {dtypes.float16: (2e-3, 2e-3), dtypes.bfloat16: (2e-2, 2e-2), dtypes.float32: (1e-5, 1e-5),
             dtypes.float64: (1e-12, 1e-12)}


# ---------------------------------------------------------------- host values <-> buffer bytes

def to_storage(values: list[Any], dtype: DType) -> np.ndarray:
  """Python scalars -> the numpy array a buffer of `dtype` holds (bfloat16 as its 16 bits)."""
  if dtype == dtypes.bfloat16:
    bits = [struct.unpack("<I", struct.pack("<f", round_to_bfloat16(float(v))))[0] >> 16 for v in values]
    return np.array(bits, dtype=np.uint16)
  if dtype.is_float:
    with np.errstate(over="ignore"): return np.array(values, dtype=np.float64).astype(dtype.np)
  return np.array([truncate(dtype, v) for v in values], dtype=dtype.np)


def from_storage(array: np.ndarray, dtype: DType) -> list[Any]:
  """A buffer's numpy array -> Python scalars (bool, int or float)."""
  if dtype == dtypes.bfloat16:
    return [struct.unpack("<f", struct.pack("<I", int(bits) << 16))[0] for bits in array]
  return [value.item() for value in array]


def same_value(ours: Any, expected: Any, rtol: float = 0.0) -> bool:
  """Equal, NaN equal to NaN, -0.0 distinct from 0.0 when compared exactly, infinities exact."""
  if isinstance(expected, float) or isinstance(ours, float):
    ours, expected = float(ours), float(expected)
    if math.isnan(expected) or math.isnan(ours): return math.isnan(expected) and math.isnan(ours)
    if math.isinf(expected) or math.isinf(ours) or rtol == 0:
      return ours == expected and (rtol > 0 or math.copysign(1, ours) == math.copysign(1, expected))
    return abs(ours - expected) <= rtol * abs(expected) + 1e-300
  return ours == expected and type(ours) is type(expected)


# ---------------------------------------------------------------- primitive kernels from UOps

def elementwise_uops(kind: UOps, arg: Any, out_dtype: DType, in_dtypes: list[DType], size: int) -> list[UOp]:
  """out[i] = op(in0[i], in1[i], ...) in one loop: op is an ALU (arg = Ops member), a CAST or a BITCAST."""
  build = UOpBuilder()
  out = build.add(UOps.DEFINE_GLOBAL, out_dtype, (), (0, True))
  inputs = [build.add(UOps.DEFINE_GLOBAL, dtype, (), (index + 1, False)) for index, dtype in enumerate(in_dtypes)]
  loop = build.add(UOps.RANGE, INT32, (build.const(0, INT32), build.const(size, INT32)), ("gidx0", AxisType.GLOBAL))
  values = tuple(build.add(UOps.LOAD, dtype, (buffer, loop)) for buffer, dtype in zip(inputs, in_dtypes))
  result = build.add(kind, out_dtype, values, arg if kind is UOps.ALU else None)
  build.add(UOps.STORE, None, (out, loop, result))
  build.end_range(loop)
  return build.uops


def run_uops(device: str, uops: list[UOp], out: np.ndarray, *inputs: np.ndarray, name: str = "test_kernel") -> None:
  """Render, compile (no disk cache) and run a UOp kernel on `device`; `out` is written in place."""
  source = Device[device].renderer.render(name, uops)
  program = Device[device].program(name, Device[device].compiler.compile(source))
  program(out, *inputs)


def run_primitive(device: str, kind: UOps, arg: Any, out_dtype: DType, columns: list[tuple[list[Any], DType]]) -> list:
  """Run one primitive elementwise op over columns of Python values; the results as Python scalars."""
  size = len(columns[0][0])
  uops = elementwise_uops(kind, arg, out_dtype, [dtype for _, dtype in columns], size)
  storage = np.dtype(np.uint16) if out_dtype == dtypes.bfloat16 else np.dtype(out_dtype.np)
  out = np.zeros(size, dtype=storage)
  run_uops(device, uops, out, *[to_storage(values, dtype) for values, dtype in columns])
  return from_storage(out, out_dtype)


def edge_values(dtype: DType) -> list[Any]:
  """Values that break naive code generation for `dtype`."""
  if dtype == dtypes.bool: return [False, True]
  if dtype.is_float: return [0.0, -0.0, 1.0, -1.0, 2.5, -3.75, 0.1, 100.0, -1e-3, math.inf, -math.inf, math.nan]
  values = [0, 1, 2, 3, 7, 100, dtype.max, dtype.max - 1]
  if not dtype.is_unsigned: values += [-1, -2, -7, -100, dtype.min, dtype.min + 1]
  return [value for value in values if dtype.min <= value <= dtype.max]


def all_pairs(values: list[Any]) -> tuple[list[Any], list[Any]]:
  return [a for a in values for _ in values], [b for _ in values for b in values]


def reference(op: Ops, dtype: DType, *operands: Any) -> Any:
  try:
    return exec_alu(op, dtype, operands)
  except (ValueError, OverflowError):  # e.g. a negative shift: the contract leaves it open
    return None


def check_primitive(op: Ops, out_dtype: DType, columns: list[tuple[list[Any], DType]], rtol: float = 0.0,
                    clang_where: Callable[..., bool] | None = None) -> None:
  """LLVM matches the scalar reference everywhere, and CLANG where `clang_where(*operands)` (C has no UB there)."""
  ours = run_primitive("LLVM", UOps.ALU, op, out_dtype, columns)
  operand_rows = list(zip(*[values for values, _ in columns]))
  operand_rows = [tuple(truncate(dtype, v) for v, (_, dtype) in zip(row, columns)) for row in operand_rows]
  for row, value in zip(operand_rows, ours):
    expected = reference(op, out_dtype, *row)
    if expected is None: continue
    assert same_value(value, expected, rtol), f"LLVM {op.name} {out_dtype} {row}: {value!r}, expected {expected!r}"
  if clang_where is None: return
  keep = [index for index, row in enumerate(operand_rows) if clang_where(*row)]
  clang_columns = [([values[index] for index in keep], dtype) for values, dtype in columns]
  theirs = run_primitive("CLANG", UOps.ALU, op, out_dtype, clang_columns)
  for index, value in zip(keep, theirs):
    assert same_value(ours[index], value, rtol), f"{op.name} {out_dtype} {operand_rows[index]}: LLVM {ours[index]!r}" \
                                                 f" != CLANG {value!r}"


BINARY_FLOAT_OPS = [Ops.ADD, Ops.MUL, Ops.MAX, Ops.CMPLT, Ops.CMPNE]
UNARY_FLOAT_OPS = [Ops.NEG, Ops.RECIP, Ops.SQRT, Ops.EXP2, Ops.LOG2, Ops.SIN]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("op", BINARY_FLOAT_OPS + UNARY_FLOAT_OPS, ids=lambda op: op.name)
def test_float_alu(op: Ops, dtype: DType) -> None:
  values = edge_values(dtype)
  a, b = all_pairs(values)
  if op is Ops.MAX:  # max(-0.0, 0.0): the reference keeps the first, PyTorch and llvm.maximum say +0.0
    a, b = zip(*[(x, y) for x, y in zip(a, b) if not (x == 0 and y == 0)])
  columns = [(values, dtype)] if op in UNARY_FLOAT_OPS else [(list(a), dtype), (list(b), dtype)]
  out_dtype = dtypes.bool if op in (Ops.CMPLT, Ops.CMPNE) else dtype
  rtol = MATH_RTOL[dtype] if op in (Ops.EXP2, Ops.LOG2, Ops.SIN) else 0.0
  check_primitive(op, out_dtype, columns, rtol, clang_where=lambda *row: True)


@pytest.mark.parametrize("dtype", INTS, ids=str)
@pytest.mark.parametrize("op", [Ops.ADD, Ops.MUL, Ops.MAX, Ops.CMPLT, Ops.CMPNE, Ops.AND, Ops.OR, Ops.XOR, Ops.NEG,
                                Ops.IDIV, Ops.MOD], ids=lambda op: op.name)
def test_integer_alu(op: Ops, dtype: DType) -> None:
  """Wrapping arithmetic; C division (toward zero) where x/0 == 0 and MIN/-1 wraps instead of trapping."""
  values = edge_values(dtype)
  columns = [(values, dtype)] if op is Ops.NEG else [(a, dtype) for a in all_pairs(values)]
  out_dtype = dtypes.bool if op in (Ops.CMPLT, Ops.CMPNE) else dtype

  def defined_in_c(*row: int) -> bool:
    # signed overflow is UB in C (CLANG has no -fwrapv), and x86 traps on INT_MIN / -1
    if op in (Ops.IDIV, Ops.MOD) and row[1] == -1: return False
    if dtype.is_unsigned or dtype.itemsize < 4: return True
    exact = {Ops.ADD: lambda a, b: a + b, Ops.MUL: lambda a, b: a * b, Ops.NEG: lambda a: -a}.get(op)
    return exact is None or dtype.min <= exact(*row) <= dtype.max
  check_primitive(op, out_dtype, columns, clang_where=defined_in_c)


@pytest.mark.parametrize("dtype", INTS, ids=str)
@pytest.mark.parametrize("op", [Ops.SHL, Ops.SHR], ids=lambda op: op.name)
def test_shifts(op: Ops, dtype: DType) -> None:
  """Shifts by 0..bits+3: past the width they give Python's answer (0, or the sign for >>), never poison."""
  amounts = list(range(dtype.bits + 4))
  values = edge_values(dtype)
  a = [v for v in values for _ in amounts]
  b = [s for _ in values for s in amounts]
  check_primitive(op, dtype, [(a, dtype), (b, dtype)], clang_where=lambda x, s: s < dtype.bits and
                  (op is Ops.SHR or dtype.is_unsigned or dtype.itemsize < 4 or 0 <= x << s <= dtype.max))


@pytest.mark.parametrize("op", [Ops.AND, Ops.OR, Ops.XOR, Ops.MAX, Ops.CMPLT, Ops.CMPNE, Ops.NEG, Ops.ADD, Ops.MUL],
                         ids=lambda op: op.name)
def test_bool_alu(op: Ops) -> None:
  columns = [([False, True], dtypes.bool)] if op is Ops.NEG else \
    [(a, dtypes.bool) for a in all_pairs([False, True])]
  check_primitive(op, dtypes.bool, columns, clang_where=lambda *row: op not in (Ops.ADD, Ops.MUL))


@pytest.mark.parametrize("dtype", [dtypes.bool, dtypes.int8, dtypes.uint64, dtypes.float16, dtypes.bfloat16,
                                   dtypes.float64], ids=str)
def test_where(dtype: DType) -> None:
  values = edge_values(dtype)
  a, b = all_pairs(values)
  conditions = [index % 3 == 0 for index in range(len(a))]
  check_primitive(Ops.WHERE, dtype, [(conditions, dtypes.bool), (a, dtype), (b, dtype)], clang_where=lambda *r: True)


# ---------------------------------------------------------------- casts and bitcasts

def cast_values(from_dtype: DType, to_dtype: DType) -> list[Any]:
  """Edge values of `from_dtype` whose conversion the reference defines (|x| < 2**63 for float -> int)."""
  values = edge_values(from_dtype)
  if from_dtype.is_float:
    values += [0.5, -0.5, 1.75, -2.25, 255.9, 256.0, -129.5, 65504.0, 65520.0, 3e9, -3e9, 1e10, 1e-8, 1e30]
    if not to_dtype.is_float and to_dtype != dtypes.bool:
      values = [v for v in values if math.isnan(v) or math.isinf(v) or abs(v) < 2.0 ** 63]
  return values


def c_defined_cast(value: Any, from_dtype: DType, to_dtype: DType) -> bool:
  """Whether C's conversion is defined and exact enough to compare: in range, and no double rounding."""
  if from_dtype.is_float and not to_dtype.is_float and to_dtype != dtypes.bool:
    return math.isfinite(value) and to_dtype.min <= math.trunc(value) <= to_dtype.max
  if to_dtype == dtypes.bfloat16 and from_dtype != dtypes.bfloat16:
    return abs(value) < 2 ** 24 if not from_dtype.is_float else from_dtype != dtypes.float64
  return True


@pytest.mark.parametrize("to_dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("from_dtype", ALL_DTYPES, ids=str)
def test_cast(from_dtype: DType, to_dtype: DType) -> None:
  """C conversions: truncation toward zero, x != 0 for bool, round to nearest even for narrower floats; outside
  C's range the reference's answer (wrap modulo 2**bits, NaN -> 0, +-inf -> max/min)."""
  values = [truncate(from_dtype, v) for v in cast_values(from_dtype, to_dtype)]
  ours = run_primitive("LLVM", UOps.CAST, None, to_dtype, [(values, from_dtype)])
  for value, result in zip(values, ours):
    expected = truncate(to_dtype, value)
    assert same_value(result, expected), f"cast {from_dtype}->{to_dtype} of {value!r}: {result!r}, want {expected!r}"
  keep = [index for index, value in enumerate(values) if c_defined_cast(value, from_dtype, to_dtype)]
  theirs = run_primitive("CLANG", UOps.CAST, None, to_dtype, [([values[index] for index in keep], from_dtype)])
  for index, result in zip(keep, theirs):
    assert same_value(ours[index], result), f"cast {from_dtype}->{to_dtype} of {values[index]!r}: LLVM " \
                                            f"{ours[index]!r} != CLANG {result!r}"


def test_casts_round_once() -> None:
  """float64 -> float16/bfloat16 round once (through float32 they would round twice and miss these)."""
  half_case = 1 + 2.0 ** -11 + 2.0 ** -40      # just above a float16 tie: rounds up
  bfloat_case = 1 + 2.0 ** -8 + 2.0 ** -40     # just above a bfloat16 tie: rounds up
  assert run_primitive("LLVM", UOps.CAST, None, dtypes.float16, [([half_case], dtypes.float64)]) == [1 + 2.0 ** -10]
  assert run_primitive("LLVM", UOps.CAST, None, dtypes.bfloat16, [([bfloat_case], dtypes.float64)]) == [1 + 2.0 ** -7]
  # ties go to even
  ties = [1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11]
  assert run_primitive("LLVM", UOps.CAST, None, dtypes.float16, [(ties, dtypes.float32)]) == [1.0, 1 + 2 * 2.0 ** -10]


BITCAST_PAIRS = [(dtypes.float32, dtypes.int32), (dtypes.float32, dtypes.uint32), (dtypes.int32, dtypes.float32),
                 (dtypes.uint32, dtypes.float32), (dtypes.float64, dtypes.int64), (dtypes.int64, dtypes.float64),
                 (dtypes.uint64, dtypes.float64), (dtypes.float64, dtypes.uint64), (dtypes.float16, dtypes.int16),
                 (dtypes.int16, dtypes.float16), (dtypes.float16, dtypes.uint16), (dtypes.bfloat16, dtypes.uint16),
                 (dtypes.bfloat16, dtypes.int16), (dtypes.uint16, dtypes.bfloat16), (dtypes.float16, dtypes.bfloat16),
                 (dtypes.bfloat16, dtypes.float16), (dtypes.int8, dtypes.uint8), (dtypes.uint8, dtypes.int8)]


@pytest.mark.parametrize("from_dtype, to_dtype", BITCAST_PAIRS, ids=lambda dtype: str(dtype))
def test_bitcast(from_dtype: DType, to_dtype: DType) -> None:
  """The bits are kept: compare the output buffer's bytes with the input's."""
  values = [v for v in edge_values(from_dtype) if not (isinstance(v, float) and math.isnan(v))]
  source = to_storage(values, from_dtype)
  out = np.zeros(len(values), dtype=np.uint16 if to_dtype == dtypes.bfloat16 else to_dtype.np)
  run_uops("LLVM", elementwise_uops(UOps.BITCAST, None, to_dtype, [from_dtype], len(values)), out, source)
  assert out.tobytes() == source.tobytes(), f"bitcast {from_dtype}->{to_dtype}: {out} from {source}"
  clang_out = np.zeros_like(out)
  run_uops("CLANG", elementwise_uops(UOps.BITCAST, None, to_dtype, [from_dtype], len(values)), clang_out, source)
  assert clang_out.tobytes() == out.tobytes()


# ---------------------------------------------------------------- gated memory access and loops

def test_gated_load_does_not_read_invalid_index() -> None:
  """Where valid is false the index points 2**30 elements past the buffer: reading it would crash the process."""
  build = UOpBuilder()
  out = build.add(UOps.DEFINE_GLOBAL, dtypes.float32, (), (0, True))
  data = build.add(UOps.DEFINE_GLOBAL, dtypes.float32, (), (1, False))
  loop = build.add(UOps.RANGE, INT32, (build.const(0, INT32), build.const(8, INT32)), ("gidx0", AxisType.GLOBAL))
  valid = build.alu(Ops.CMPLT, dtypes.bool, loop, build.const(4, INT32))
  index = build.alu(Ops.WHERE, INT32, valid, loop, build.const(1 << 30, INT32))
  build.add(UOps.STORE, None, (out, loop, build.add(UOps.LOAD, dtypes.float32, (data, index, valid))))
  build.end_range(loop)
  result = np.full(8, -1, dtype=np.float32)
  run_uops("LLVM", build.uops, result, np.arange(1, 5, dtype=np.float32))
  np.testing.assert_array_equal(result, [1, 2, 3, 4, 0, 0, 0, 0])


def test_gated_store_and_nested_accumulator() -> None:
  """out[i] = sum_j max(in[i*4+j]) only for even i; odd rows keep their old value. Accumulators reset per row."""
  build = UOpBuilder()
  out = build.add(UOps.DEFINE_GLOBAL, dtypes.float32, (), (0, True))
  data = build.add(UOps.DEFINE_GLOBAL, dtypes.float32, (), (1, False))
  row = build.add(UOps.RANGE, INT32, (build.const(0, INT32), build.const(6, INT32)), ("gidx0", AxisType.GLOBAL))
  acc = build.add(UOps.DEFINE_ACC, dtypes.float32, (), -math.inf)
  column = build.add(UOps.RANGE, INT32, (build.const(0, INT32), build.const(4, INT32)), ("ridx1", AxisType.REDUCE))
  index = build.alu(Ops.ADD, INT32, build.alu(Ops.MUL, INT32, row, build.const(4, INT32)), column)
  build.add(UOps.ACCUMULATE, dtypes.float32, (acc, build.add(UOps.LOAD, dtypes.float32, (data, index))), Ops.MAX)
  build.end_range(column)
  even = build.alu(Ops.CMPNE, dtypes.bool, build.alu(Ops.MOD, INT32, row, build.const(2, INT32)),
                   build.const(1, INT32))
  build.add(UOps.STORE, None, (out, row, acc, even))
  build.end_range(row)
  values = np.random.default_rng(0).standard_normal(24).astype(np.float32)
  values[5] = np.nan  # row 1 (odd: not stored) ... and row 2 gets one in its window below
  values[9] = np.nan
  result = np.full(6, 7.0, dtype=np.float32)
  run_uops("LLVM", build.uops, result, values)
  expected = values.reshape(6, 4).max(axis=1)
  expected[1::2] = 7.0
  np.testing.assert_array_equal(result, expected)


def test_parameters_follow_buffer_index_order() -> None:
  """Kernel arguments are positional by DEFINE_GLOBAL index even when the uops define them in another order."""
  build = UOpBuilder()
  second = build.add(UOps.DEFINE_GLOBAL, dtypes.int32, (), (2, False))
  out = build.add(UOps.DEFINE_GLOBAL, dtypes.int32, (), (0, True))
  first = build.add(UOps.DEFINE_GLOBAL, dtypes.int32, (), (1, False))
  loop = build.add(UOps.RANGE, INT32, (build.const(0, INT32), build.const(3, INT32)), ("gidx0", AxisType.GLOBAL))
  difference = build.alu(Ops.ADD, INT32, build.add(UOps.LOAD, INT32, (first, loop)),
                         build.alu(Ops.NEG, INT32, build.add(UOps.LOAD, INT32, (second, loop))))
  build.add(UOps.STORE, None, (out, loop, difference))
  build.end_range(loop)
  result = np.zeros(3, dtype=np.int32)
  run_uops("LLVM", build.uops, result, np.array([10, 20, 30], np.int32), np.array([1, 2, 3], np.int32))
  np.testing.assert_array_equal(result, [9, 18, 27])


# ---------------------------------------------------------------- whole graphs: LLVM vs CLANG vs numpy

def realize_on(device: str, build: Callable[..., Tensor], arrays: list[np.ndarray], dtype: DType | None) -> np.ndarray:
  tensors = [Tensor(array, device=device) for array in arrays]
  if dtype is not None: tensors = [tensor.cast(dtype) for tensor in tensors]
  return build(*tensors).numpy()


def check_graph(build: Callable[..., Tensor], arrays: list[np.ndarray], expected: np.ndarray,
                dtype: DType | None = None, tol: tuple[float, float] | None = None) -> None:
  """The graph on LLVM equals numpy's answer (within tol for floats) and CLANG's (within tol)."""
  ours = realize_on("LLVM", build, arrays, dtype)
  theirs = realize_on("CLANG", build, arrays, dtype)
  assert ours.shape == expected.shape, f"shape {ours.shape} != {expected.shape}"
  if tol is None:
    np.testing.assert_array_equal(ours, expected)
    np.testing.assert_array_equal(ours, theirs)
  else:
    atol, rtol = tol
    np.testing.assert_allclose(ours.astype(np.float64), expected.astype(np.float64), atol=atol, rtol=rtol)
    np.testing.assert_allclose(ours.astype(np.float64), theirs.astype(np.float64), atol=atol, rtol=rtol)


rng = np.random.default_rng(1234)


def randn(*shape: int) -> np.ndarray: return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_fused_float_chain(dtype: DType) -> None:
  """One kernel with every float ALU op; NaN/inf/-0 among the inputs."""
  a, b = randn(37, 19), randn(37, 19)
  a[0, :6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-3]
  b[1, :3] = [np.nan, -np.inf, 0.0]

  def graph(x: Tensor, y: Tensor) -> Tensor:
    mixed = (x * y + x.abs().sqrt() - y.sin()).maximum(x.exp() * 0.25) + (1 + x * x).log() / (2 + y.abs())
    return (x < y).where(mixed, -mixed) + (x != y).cast(x.dtype)

  def numpy_graph(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
      mixed = np.fmax(x * y + np.sqrt(np.abs(x)) - np.sin(y), np.exp(x) * 0.25)
      mixed = np.where(np.isnan(x * y + np.sqrt(np.abs(x)) - np.sin(y)) | np.isnan(x), np.nan, mixed)
      mixed = mixed + np.log(1 + x * x) / (2 + np.abs(y))
      return np.where(x < y, mixed, -mixed) + (x != y)
  # inputs rounded to the dtype first, so numpy sees what the kernel sees
  rounded = [realize_on("CLANG", lambda t: t.cast(dtypes.float64), [v], dtype) for v in (a, b)]
  tolerance = GRAPH_TOL[dtype] if dtype != dtypes.float32 else (1e-4, 1e-4)  # libm differs from numpy's in ulps
  check_graph(graph, [a, b], numpy_graph(*rounded), dtype, tolerance)


@pytest.mark.parametrize("dtype", [dtypes.int8, dtypes.uint8, dtypes.int32, dtypes.uint32, dtypes.int64,
                                   dtypes.uint64], ids=str)
def test_fused_integer_chain(dtype: DType) -> None:
  """Wrapping +, *, bitwise ops, shifts, max and comparisons in one kernel, on the dtype's full range."""
  info = np.iinfo(dtype.np)
  a = rng.integers(info.min, info.max, (9, 13), dtype=dtype.np, endpoint=True)
  b = rng.integers(info.min, info.max, (9, 13), dtype=dtype.np, endpoint=True)
  shifts = rng.integers(0, dtype.bits, (9, 13), dtype=dtype.np)

  def graph(x: Tensor, y: Tensor, s: Tensor) -> Tensor:
    return ((x * y + (x ^ y)) | (x & 5)) + ((x << s) ^ (y >> s)) + x.maximum(y) + (x < y).cast(x.dtype)

  with np.errstate(over="ignore"):
    expected = ((a * b + (a ^ b)) | (a & 5)) + ((a << shifts) ^ (b >> shifts)) + np.maximum(a, b) + (a < b)
  check_graph(graph, [a, b, shifts], expected.astype(dtype.np))


@pytest.mark.parametrize("dtype", [dtypes.int8, dtypes.int16, dtypes.int32, dtypes.int64, dtypes.uint8,
                                   dtypes.uint64], ids=str)
def test_floor_divide_and_remainder(dtype: DType) -> None:
  """Python-style // and % (built on C-style IDIV/MOD) with negative operands and zero divisors, as numpy."""
  low = 0 if dtype.is_unsigned else -20
  a = rng.integers(low, 20, (200,)).astype(dtype.np)
  b = rng.integers(low, 6, (200,)).astype(dtype.np)
  b[:10] = 0
  with np.errstate(divide="ignore"):
    check_graph(lambda x, y: x // y, [a, b], a // b)
    check_graph(lambda x, y: x % y, [a, b], a % b)
    check_graph(lambda x, y: x.fmod(y), [a, b], np.fmod(a, b))


def test_reductions() -> None:
  x = randn(33, 65)
  check_graph(lambda t: t.sum(axis=1), [x], x.sum(axis=1), tol=(1e-4, 1e-5))
  check_graph(lambda t: t.sum(axis=0), [x], x.sum(axis=0), tol=(1e-4, 1e-5))
  check_graph(lambda t: t.mean(), [x], np.array(x.mean(), dtype=np.float32), tol=(1e-6, 1e-5))
  ints = rng.integers(-1000, 1000, (16, 40)).astype(np.int32)
  check_graph(lambda t: t.sum(axis=1), [ints], ints.sum(axis=1).astype(np.int32))
  check_graph(lambda t: t.max(axis=0), [ints], ints.max(axis=0))
  big = rng.integers(0, 2 ** 64 - 1, (8, 8), dtype=np.uint64)
  check_graph(lambda t: t.max(axis=1), [big], big.max(axis=1))


def test_max_propagates_nan() -> None:
  x = randn(6, 50)
  x[1, 7] = np.nan
  x[2, :] = -np.inf
  x[3, 0] = np.nan
  x[3, 1] = np.inf
  x[4, 49] = np.nan
  check_graph(lambda t: t.max(axis=1), [x], x.max(axis=1))
  check_graph(lambda t: t.max(axis=0), [x], x.max(axis=0))
  check_graph(lambda t: t.min(axis=1), [x], x.min(axis=1))


@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16, dtypes.float64], ids=str)
def test_low_and_high_precision_reductions(dtype: DType) -> None:
  x = randn(24, 48)
  rounded = realize_on("CLANG", lambda t: t.cast(dtypes.float64), [x], dtype)
  atol, rtol = GRAPH_TOL[dtype]
  check_graph(lambda t: t.sum(axis=1), [x], rounded.sum(axis=1), dtype, (atol * 48, rtol * 4))
  check_graph(lambda t: t.max(axis=0), [x], rounded.max(axis=0), dtype, (0, 0))


def test_matmul_default_opts() -> None:
  a, b = randn(64, 48), randn(48, 80)
  check_graph(lambda x, y: x @ y, [a, b], a @ b, tol=(1e-4, 1e-4))
  check_graph(lambda x, y: (x @ y + 1).relu(), [a, b], np.maximum(a @ b + 1, 0), tol=(1e-4, 1e-4))


@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16, dtypes.int32], ids=str)
def test_matmul_dtypes(dtype: DType) -> None:
  if dtype.is_int:
    a, b = rng.integers(-50, 50, (20, 30)).astype(np.int32), rng.integers(-50, 50, (30, 12)).astype(np.int32)
    check_graph(lambda x, y: x @ y, [a, b], a @ b)
    return
  a, b = randn(20, 30), randn(30, 12)
  ra, rb = (realize_on("CLANG", lambda t: t.cast(dtypes.float64), [v], dtype) for v in (a, b))
  check_graph(lambda x, y: x @ y, [a, b], ra @ rb, dtype, (GRAPH_TOL[dtype][0] * 30, GRAPH_TOL[dtype][1] * 4))


def run_with_opts(tensor: Tensor, opts: list[Opt]) -> tuple[np.ndarray, list[Opt]]:
  """Realize the last kernel of `tensor`'s schedule with exactly these Opts (its inputs realized first)."""
  schedule = create_schedule([tensor.lazydata])
  run_schedule(schedule[:-1])
  item = schedule[-1]
  device = item.outputs[0].device
  kernel = Kernel(item.ast, Device[device].renderer)
  for opt in opts: kernel.apply_opt(opt)
  output = Buffer(device, item.outputs[0].size, item.outputs[0].dtype).allocate()
  compile_kernel(kernel, device)((output,) + item.inputs)
  return output.numpy().reshape(tensor.shape), kernel.applied_opts


@pytest.mark.parametrize("opts", [
  [],
  [Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.UNROLL, 0, 4)],
  [Opt(OptOps.UPCAST, 1, 8), Opt(OptOps.UNROLL, 0, 2)],
  [Opt(OptOps.UNROLL, 0, 8), Opt(OptOps.UPCAST, 0, 2)],
], ids=lambda opts: "_".join(f"{o.op.name}{o.axis}x{o.amount}" for o in opts) or "plain")
def test_matmul_with_upcast_and_unroll(opts: list[Opt]) -> None:
  a, b = randn(32, 64), randn(64, 16)
  results = {}
  for device in ("LLVM", "CLANG"):
    results[device], applied = run_with_opts(Tensor(a, device=device) @ Tensor(b, device=device), opts)
    assert applied == opts
  np.testing.assert_allclose(results["LLVM"], a @ b, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(results["LLVM"], results["CLANG"], atol=1e-5, rtol=1e-5)


def test_padded_views() -> None:
  """Pads, shrinks and flips become gated loads; the padding reads as 0 (or the pad value)."""
  image = randn(2, 3, 9, 7)
  pad = ((0, 0), (0, 0), (2, 1), (1, 3))
  padded = np.pad(image, pad)
  check_graph(lambda t: t.pad(pad), [image], padded)
  windows = sum(padded[:, :, i:i + 10, j:j + 9] for i in range(3) for j in range(3))
  check_graph(lambda t: sum(t.pad(pad)[:, :, i:i + 10, j:j + 9] for i in range(3) for j in range(3)), [image],
              windows, tol=(1e-5, 1e-5))
  check_graph(lambda t: t.pad(pad).flip(3)[:, 1:, 2:-1].sum(axis=2), [image],
              padded[:, :, :, ::-1][:, 1:, 2:-1].sum(axis=2), tol=(1e-5, 1e-5))
  check_graph(lambda t: t.pad(pad).max(axis=3), [image], padded.max(axis=3))


@pytest.mark.parametrize("dtype", [dtypes.int8, dtypes.bool, dtypes.uint64, dtypes.float16], ids=str)
def test_padded_views_of_small_and_wide_dtypes(dtype: DType) -> None:
  if dtype == dtypes.bool: values = rng.random((5, 6)) < 0.5
  elif dtype.is_float: values = randn(5, 6).astype(np.float16)
  else: values = rng.integers(np.iinfo(dtype.np).min, np.iinfo(dtype.np).max, (5, 6), dtype=dtype.np, endpoint=True)
  pad = ((1, 2), (3, 1))
  check_graph(lambda t: t.pad(pad), [values], np.pad(values, pad))
  check_graph(lambda t: t.pad(pad)[::-1, 1:-1], [values], np.pad(values, pad)[::-1, 1:-1])


def test_casts_and_bitcasts_in_graphs() -> None:
  x = randn(64) * 300
  check_graph(lambda t: t.cast(dtypes.int32), [x], x.astype(np.int32))
  check_graph(lambda t: t.cast(dtypes.float16).cast(dtypes.float32), [x], x.astype(np.float16).astype(np.float32))
  check_graph(lambda t: t.cast(dtypes.bool), [x], x.astype(bool))
  check_graph(lambda t: t.bitcast(dtypes.int32) >> 3, [x], x.view(np.int32) >> 3)
  check_graph(lambda t: (t.bitcast(dtypes.uint32) & 0x7FFFFFFF).bitcast(dtypes.float32), [x], np.abs(x))
  bits = rng.integers(0, 2 ** 16, 64).astype(np.uint16)
  bits = bits[~np.isnan(bits.view(np.float16))]
  check_graph(lambda t: t.bitcast(dtypes.float16).cast(dtypes.float32), [bits],
              bits.view(np.float16).astype(np.float32))


# ---------------------------------------------------------------- the compiler and the program

def test_vectorizes_elementwise_loops() -> None:
  """A plain elementwise loop comes out as packed SIMD instructions for this CPU."""
  if platform.machine().lower() not in ("x86_64", "amd64"): pytest.skip("checks x86 packed instructions")
  x = Tensor(randn(4096), device="LLVM")
  item = create_schedule([(x * 3 + 1).lazydata])[-1]
  kernel = Kernel(item.ast, Device["LLVM"].renderer)
  from ourgrad.codegen.linearizer import linearize
  source = Device["LLVM"].renderer.render(kernel.name, linearize(kernel))
  assembly = Device["LLVM"].compiler.disassemble(source)
  assert re.search(r"\bv?(mul|fmadd\w*)ps\b", assembly), assembly


def test_compile_error_names_the_ir_and_the_reason() -> None:
  broken = "define void @broken(ptr %data0) {\nbody:\n  %v1 = add i32 %nope, 1\n  ret void\n}\n"
  with pytest.raises(CompileError) as error:
    Device["LLVM"].compiler.compile(broken)
  assert "%nope" in str(error.value) and "LLVM message" in str(error.value)


def test_cache_key_names_llvm_and_the_cpu() -> None:
  import llvmlite.binding as llvm
  key = Device["LLVM"].compiler.cache_key
  assert llvm.get_host_cpu_name() in key and ".".join(map(str, llvm.llvm_version_info)) in key


def test_device_realizes_tensors() -> None:
  x = Tensor([1.0, 2.0, 3.0], device="LLVM")
  assert (x * 2 + 1).tolist() == [3.0, 5.0, 7.0]
  assert Tensor.arange(10, device="LLVM").sum().item() == 45


@pytest.mark.parametrize("threads", [1, 3, 0])
def test_large_kernels_split_their_outer_loop_across_threads(threads: int) -> None:
  """Big kernels run their outer loop in slices on an OpenMP team (uneven slices with 3 threads; 0: the default
  team); the result is what one thread computes."""
  import ctypes
  import ctypes.util
  from ourgrad.runtime import ops_llvm
  if not ops_llvm._LIBGOMP_LOADED: pytest.skip("libgomp is not available: LLVM kernels run on one thread")
  a, b = randn(1000, 300), randn(300, 70)
  x = Tensor(a, device="LLVM")
  item = create_schedule([(x * 2 + 1).lazydata])[-1]
  kernel = Kernel(item.ast, Device["LLVM"].renderer)
  kernel.hand_coded_optimizations()
  from ourgrad.codegen.linearizer import linearize
  assert "@GOMP_parallel" in Device["LLVM"].renderer.render(kernel.name, linearize(kernel))
  libgomp = ctypes.CDLL(ctypes.util.find_library("gomp"))
  default_threads = libgomp.omp_get_max_threads()
  libgomp.omp_set_num_threads(threads or default_threads)
  try:
    np.testing.assert_allclose((x * 2 + 1).numpy(), a * 2 + 1, rtol=1e-6)
    np.testing.assert_allclose((x @ Tensor(b, device="LLVM")).numpy(), a @ b, atol=1e-3, rtol=1e-4)
    weights = Tensor(b[:, :1].T.copy(), device="LLVM").reshape(1, 300, 1)
    maxima = (x.reshape(1000, 300, 1) * weights).max(axis=1)
    np.testing.assert_allclose(maxima.numpy().ravel(), (a * b[:, 0]).max(axis=1), rtol=1e-6)
  finally:
    libgomp.omp_set_num_threads(default_threads)
