"""The PYTHON device (ourgrad/runtime/ops_python.py, uop_interpreter.py, gpu_emulator.py): UOps interpreted with numpy.

Sections: the serialized program (round trip, determinism, rejecting malformed text); the interpreter on
hand-built UOps (thread indices, gated loads, bounds checks, every ALU op and dtype against `ops.exec_alu`, casts,
bitcasts, reduce loops run at once vs one by one); whole graphs realized on PYTHON vs CLANG vs numpy (every dtype,
reductions, matmul with LOCAL/UPCAST/UNROLL, softmax, padded convolutions, integer division, casts, bitcasts,
argmax, cumsum, indexing); and the optimized-vs-plain kernel checks of test_opts.py run on PYTHON.
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable

import numpy as np
import pytest
import torch
import test_opts

from ourgrad import Device, Tensor, dtypes
from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.codegen.uops import AxisType, UOp, UOpBuilder, UOps
from ourgrad.dtype import DType, bfloat16_bits_to_float32
from ourgrad.engine.schedule import create_schedule
from ourgrad.errors import CompileError, DeviceError
from ourgrad.nn import functional
from ourgrad.ops import Ops, exec_alu
from ourgrad.runtime import uop_interpreter
from ourgrad.runtime.ops_python import PythonCompiler, PythonProgram, PythonRenderer, parse_program

INT32 = dtypes.int32
rng = np.random.default_rng(1234)


# ================================================================ helpers: hand-built kernels

def build_program(uops: list[UOp], name: str = "test_kernel") -> PythonProgram:
  source = PythonRenderer().render(name, uops)
  return PythonProgram(name, PythonCompiler().compile(source))


def as_bytes(array: np.ndarray) -> np.ndarray:
  return np.ascontiguousarray(array).reshape(-1).view(np.uint8).copy()


def elementwise_kernel(op: Ops, in_dtypes: list[DType], out_dtype: DType, count: int) -> PythonProgram:
  """out[i] = op(in0[i], in1[i], ...), one thread per element."""
  build = UOpBuilder()
  output = build.add(UOps.DEFINE_GLOBAL, out_dtype, (), (0, True))
  inputs = [build.add(UOps.DEFINE_GLOBAL, dtype, (), (number + 1, False)) for number, dtype in enumerate(in_dtypes)]
  thread = build.add(UOps.SPECIAL, INT32, (), ("gidx0", count, 0, AxisType.GLOBAL))
  loaded = [build.add(UOps.LOAD, dtype, (buffer, thread)) for buffer, dtype in zip(inputs, in_dtypes)]
  build.add(UOps.STORE, None, (output, thread, build.alu(op, out_dtype, *loaded)))
  return build_program(build.uops)


def unary_kernel(uop: UOps, in_dtype: DType, out_dtype: DType, count: int) -> PythonProgram:
  """out[i] = CAST/BITCAST(in[i])."""
  build = UOpBuilder()
  output = build.add(UOps.DEFINE_GLOBAL, out_dtype, (), (0, True))
  source = build.add(UOps.DEFINE_GLOBAL, in_dtype, (), (1, False))
  thread = build.add(UOps.SPECIAL, INT32, (), ("gidx0", count, 0, AxisType.GLOBAL))
  value = build.add(uop, out_dtype, (build.add(UOps.LOAD, in_dtype, (source, thread)),))
  build.add(UOps.STORE, None, (output, thread, value))
  return build_program(build.uops)


def run_elementwise(program: PythonProgram, out_dtype: np.dtype, *inputs: np.ndarray) -> np.ndarray:
  output = np.zeros(len(inputs[0]), out_dtype)
  output_bytes = as_bytes(output)
  program(output_bytes, *(as_bytes(array) for array in inputs), global_size=(len(inputs[0]), 1, 1))
  return output_bytes.view(out_dtype)


# ================================================================ the serialized program

def test_render_round_trips_every_kind_of_argument() -> None:
  build = UOpBuilder()
  output = build.add(UOps.DEFINE_GLOBAL, dtypes.float32, (), (0, True))
  block = build.add(UOps.SPECIAL, INT32, (), ("gidx0", 4, 0, AxisType.GLOBAL))
  constants = [build.const(value, dtypes.float32) for value in (math.inf, -math.inf, -0.0, 1e-45, 0.1)]
  nan = build.const(math.nan, dtypes.float64)
  big = build.const(-2**63, dtypes.int64)
  flag = build.const(True, dtypes.bool)
  total = constants[0]
  for constant in constants[1:]: total = build.alu(Ops.ADD, dtypes.float32, total, constant)
  build.add(UOps.STORE, None, (output, block, total))
  uops = build.uops
  source = PythonRenderer().render("r_4", uops)
  assert source == PythonRenderer().render("r_4", uops), "rendering must be deterministic (the cache keys on it)"
  json.loads(source, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
  assert len(source.splitlines()) == len(uops) + 2, "one UOp per line, readable with DEBUG=4"
  name, instructions = parse_program(source)
  assert name == "r_4" and len(instructions) == len(uops)
  position = {id(uop): index for index, uop in enumerate(uops)}
  for uop, instruction in zip(uops, instructions):
    assert (instruction.op, instruction.dtype) == (uop.op, uop.dtype)
    assert instruction.srcs == tuple(position[id(src)] for src in uop.srcs)
    if isinstance(uop.arg, float) and math.isnan(uop.arg): assert math.isnan(instruction.arg)
    else: assert instruction.arg == uop.arg and type(instruction.arg) is type(uop.arg)
  assert math.copysign(1, instructions[position[id(constants[2])]].arg) == -1, "-0.0 keeps its sign"
  assert instructions[position[id(nan)]].dtype == dtypes.float64
  assert instructions[position[id(big)]].arg == -2**63 and instructions[position[id(flag)]].arg is True


@pytest.mark.parametrize("text", [
  "not json",
  '{"format": "something-else", "uops": []}',
  '{"format": "ourgrad-python-uops-v1", "name": "k", "uops": [[0, "EVAL", null, [], null]]}',
  '{"format": "ourgrad-python-uops-v1", "name": "k", "uops": [[0, "CONST", "float128", [], 1]]}',
  '{"format": "ourgrad-python-uops-v1", "name": "k", "uops": [[0, "ALU", "int32", [0, 0], {"alu": "ADD"}]]}',
  '{"format": "ourgrad-python-uops-v1", "name": "k", "uops": [[0, "CONST", "float32", [], NaN]]}',
  '{"format": "ourgrad-python-uops-v1", "name": "k", "uops": [[0, "CONST", "int32", [], {"py": "__import__"}]]}',
  '{"format": "ourgrad-python-uops-v1", "name": "k", "uops": [[1, "CONST", "int32", [], 1]]}',
], ids=["not-json", "wrong-format", "unknown-uop", "unknown-dtype", "source-not-earlier", "nan-token",
        "unknown-arg-tag", "wrong-position"])
def test_malformed_programs_are_rejected(text: str) -> None:
  with pytest.raises(CompileError):
    PythonProgram("k", text.encode())


def test_unclosed_loop_is_rejected() -> None:
  build = UOpBuilder()
  build.add(UOps.RANGE, INT32, (build.const(0, INT32), build.const(4, INT32)), ("ridx0", AxisType.REDUCE))
  with pytest.raises(CompileError, match="never closed"):
    build_program(build.uops)


# ================================================================ the interpreter on hand-built UOps

def test_thread_indices_unravel_blocks_major_threads_minor_x_fastest() -> None:
  """Every thread stores its six indices at its flat id; the flat id order is (block z, y, x, thread z, y, x)."""
  global_size, local_size = (3, 2, 2), (2, 3, 1)
  build = UOpBuilder()
  output = build.add(UOps.DEFINE_GLOBAL, INT32, (), (0, True))
  blocks = [build.add(UOps.SPECIAL, INT32, (), (f"gidx{dim}", global_size[dim], dim, AxisType.GLOBAL))
            for dim in range(3)]
  threads = [build.add(UOps.SPECIAL, INT32, (), (f"lidx{dim}", local_size[dim], dim, AxisType.LOCAL))
             for dim in range(3)]
  flat = build.const(0, INT32)
  for index, size in [(blocks[2], 2), (blocks[1], 2), (blocks[0], 3), (threads[2], 1), (threads[1], 3),
                      (threads[0], 2)]:
    flat = build.alu(Ops.ADD, INT32, build.alu(Ops.MUL, INT32, flat, build.const(size, INT32)), index)
  for slot, index in enumerate(blocks + threads):
    address = build.alu(Ops.ADD, INT32, build.alu(Ops.MUL, INT32, flat, build.const(6, INT32)),
                        build.const(slot, INT32))
    build.add(UOps.STORE, None, (output, address, index))
  count = math.prod(global_size) * math.prod(local_size)
  memory = np.full(count * 6, -1, np.int32).view(np.uint8)
  build_program(build.uops)(memory, global_size=global_size, local_size=local_size)
  stored = memory.view(np.int32).reshape(count, 6)
  expected = [(bx, by, bz, tx, ty, tz) for bz in range(2) for by in range(2) for bx in range(3)
              for tz in range(1) for ty in range(3) for tx in range(2)]
  np.testing.assert_array_equal(stored, np.array(expected))


def gated_load_kernel(count: int, offset: int) -> list[UOp]:
  """out[i] = (i < 4) ? in[i + offset] : 0, then out[i] += 1 only where i is even (a gated store)."""
  build = UOpBuilder()
  output = build.add(UOps.DEFINE_GLOBAL, dtypes.float32, (), (0, True))
  source = build.add(UOps.DEFINE_GLOBAL, dtypes.float32, (), (1, False))
  thread = build.add(UOps.SPECIAL, INT32, (), ("gidx0", count, 0, AxisType.GLOBAL))
  valid = build.alu(Ops.CMPLT, dtypes.bool, thread, build.const(4, INT32))
  address = build.alu(Ops.ADD, INT32, thread, build.const(offset, INT32))
  loaded = build.add(UOps.LOAD, dtypes.float32, (source, address, valid))
  build.add(UOps.STORE, None, (output, thread, loaded))
  even = build.alu(Ops.CMPNE, dtypes.bool, build.alu(Ops.MOD, INT32, thread, build.const(2, INT32)),
                   build.const(1, INT32))
  incremented = build.alu(Ops.ADD, dtypes.float32, loaded, build.const(1.0, dtypes.float32))
  build.add(UOps.STORE, None, (output, thread, incremented, even))
  return build.uops


def test_gated_loads_never_touch_memory_and_gated_stores_skip() -> None:
  source = np.arange(1, 5, dtype=np.float32)  # 4 elements; threads 4..7 would read past the end
  output = np.zeros(8, np.float32).view(np.uint8)
  build_program(gated_load_kernel(8, 0))(output, as_bytes(source), global_size=(8, 1, 1))
  np.testing.assert_array_equal(output.view(np.float32), [2, 2, 4, 4, 1, 0, 1, 0])


def test_out_of_bounds_access_is_an_error() -> None:
  output = np.zeros(8, np.float32).view(np.uint8)
  with pytest.raises(DeviceError, match="outside the buffer of 4 elements"):
    build_program(gated_load_kernel(8, 1))(output, as_bytes(np.ones(4, np.float32)), global_size=(8, 1, 1))
  with pytest.raises(DeviceError, match="index -2"):
    build_program(gated_load_kernel(8, -2))(output, as_bytes(np.ones(4, np.float32)), global_size=(8, 1, 1))


def edge_values(dtype: DType) -> np.ndarray:
  """Values that break careless implementations, then random ones."""
  if dtype == dtypes.bool: return rng.random(64) < 0.5
  if dtype.is_float:
    finfo = np.finfo(dtype.np)
    special = [0.0, -0.0, 1.0, -1.0, 0.5, -2.5, 3.0, math.inf, -math.inf, math.nan, float(finfo.max), 1e-3, 100.0]
    return np.concatenate([special, rng.uniform(-4, 4, 51)]).astype(dtype.np)
  info = np.iinfo(dtype.np)
  special = [0, 1, 2, 7, info.max, info.min, info.max - 1, info.min + 1]
  if dtype.is_unsigned: special += [3, 5, 0, 1]
  else: special += [-1, -2, -7, -1]
  low, high = (0, 200) if dtype.is_unsigned else (-100, 100)
  return np.concatenate([np.array(special, dtype.np), rng.integers(low, high, 52).astype(dtype.np)])


ALU_CASES = [(op, dtype) for dtype in [dtypes.bool, dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16, INT32,
                                       dtypes.uint32, dtypes.int64, dtypes.uint64]
             for op in [Ops.ADD, Ops.MUL, Ops.MAX, Ops.CMPLT, Ops.CMPNE, Ops.AND, Ops.OR, Ops.XOR, Ops.NEG, Ops.WHERE]
             + ([Ops.IDIV, Ops.MOD, Ops.SHL, Ops.SHR] if dtype != dtypes.bool else [])]
ALU_CASES += [(op, dtype) for dtype in [dtypes.float16, dtypes.float32, dtypes.float64]
              for op in [Ops.ADD, Ops.MUL, Ops.MAX, Ops.CMPLT, Ops.CMPNE, Ops.NEG, Ops.WHERE, Ops.RECIP, Ops.SQRT,
                         Ops.EXP2, Ops.LOG2, Ops.SIN]]


@pytest.mark.parametrize("op, dtype", ALU_CASES, ids=[f"{op.name}-{dtype.name}" for op, dtype in ALU_CASES])
def test_alu_matches_scalar_reference(op: Ops, dtype: DType) -> None:
  """Each ALU op on every dtype, element by element against ops.exec_alu (the scalar semantics of the contract)."""
  a = edge_values(dtype)
  b = np.roll(edge_values(dtype), 3)  # pairs edge values with each other and with zero divisors
  if op is Ops.MOD or op is Ops.IDIV: b[::5] = 0
  if op in (Ops.SHL, Ops.SHR): b = (np.abs(b.astype(np.int64)) % dtype.bits).astype(dtype.np)
  operands = {Ops.NEG: [a], Ops.RECIP: [a], Ops.SQRT: [a], Ops.EXP2: [a], Ops.LOG2: [a], Ops.SIN: [a],
              Ops.WHERE: [rng.random(len(a)) < 0.5, a, b]}.get(op, [a, b])
  operand_dtypes = [dtypes.bool, dtype, dtype] if op is Ops.WHERE else [dtype] * len(operands)
  out_dtype = dtypes.bool if op in (Ops.CMPLT, Ops.CMPNE) else dtype
  result = run_elementwise(elementwise_kernel(op, operand_dtypes, out_dtype, len(a)), out_dtype.np, *operands)
  expected = np.array([exec_alu(op, out_dtype, tuple(operand[i].item() for operand in operands))
                       for i in range(len(a))], out_dtype.np)
  if op in (Ops.EXP2, Ops.LOG2, Ops.SIN):  # libm accuracy: a few ulp
    np.testing.assert_allclose(result, expected, rtol={dtypes.float16: 2e-3}.get(dtype, 1e-6), atol=1e-7)
  else:  # correctly rounded (or integer) operations: bit-exact
    np.testing.assert_array_equal(result, expected)


def test_casts_follow_c() -> None:
  floats = np.array([-2.7, 2.7, -0.5, 0.5, 100.9, -100.9, 0.0, -0.0], np.float32)
  cases: list[tuple[DType, DType, np.ndarray, Any]] = [
    (dtypes.float32, INT32, floats, [-2, 2, 0, 0, 100, -100, 0, 0]),  # truncation toward zero
    (dtypes.float32, dtypes.int8, floats, [-2, 2, 0, 0, 100, -100, 0, 0]),
    (dtypes.float32, dtypes.bool, np.array([0.0, -0.0, math.nan, 2.0, -1e-30], np.float32), [0, 0, 1, 1, 1]),
    (dtypes.bool, dtypes.float32, np.array([True, False]), [1.0, 0.0]),
    (INT32, dtypes.int8, np.array([127, 128, 255, 256, -129], np.int32), [127, -128, -1, 0, 127]),  # wraps
    (INT32, dtypes.uint8, np.array([-1, 256, 300], np.int32), [255, 0, 44]),
    (dtypes.int64, dtypes.float32, np.array([2**24 + 1, -3], np.int64), [2.0**24, -3.0]),  # rounds to nearest even
    (dtypes.float32, dtypes.float16, np.array([1 + 2**-11, 1 + 3 * 2**-11, 70000.0], np.float32), [1, 1 + 2**-9,
                                                                                                     math.inf]),
  ]
  for from_dtype, to_dtype, values, expected in cases:
    result = run_elementwise(unary_kernel(UOps.CAST, from_dtype, to_dtype, len(values)), to_dtype.np, values)
    np.testing.assert_array_equal(result, np.array(expected, to_dtype.np), err_msg=f"{from_dtype} -> {to_dtype}")


def test_bfloat16_rounds_to_nearest_even_like_torch() -> None:
  values = np.concatenate([rng.standard_normal(200).astype(np.float32) * 1e3,
                           np.array([1 + 2**-8, 1 + 3 * 2**-8, 3.4e38, -3.4e38, math.inf, math.nan, 0.0, -0.0],
                                    np.float32)])
  bits = run_elementwise(unary_kernel(UOps.CAST, dtypes.float32, dtypes.bfloat16, len(values)), np.uint16, values)
  expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
  finite = ~np.isnan(values)
  np.testing.assert_array_equal(bits[finite], expected[finite])
  assert np.isnan(bfloat16_bits_to_float32(bits[~finite])).all(), "NaN stays NaN"
  # a double is rounded to float first, as the C renderers do: this one lands exactly on a bfloat16 tie after that
  double = np.array([1 + 2**-8 + 2**-40], np.float64)
  bits = run_elementwise(unary_kernel(UOps.CAST, dtypes.float64, dtypes.bfloat16, 1), np.uint16, double)
  assert bfloat16_bits_to_float32(bits)[0] == 1.0


def test_bitcasts_reinterpret_bits() -> None:
  cases = [(dtypes.float32, INT32, np.array([1.0, -2.0, math.inf], np.float32)),
           (dtypes.uint32, dtypes.float32, np.array([0x3F800000, 0x7F800000], np.uint32)),
           (dtypes.float16, dtypes.int16, np.array([1.0, -0.0, 65504], np.float16)),
           (dtypes.float64, dtypes.uint64, np.array([1.5, -math.inf], np.float64))]
  for from_dtype, to_dtype, values in cases:
    result = run_elementwise(unary_kernel(UOps.BITCAST, from_dtype, to_dtype, len(values)), to_dtype.np, values)
    np.testing.assert_array_equal(result, values.view(to_dtype.np))
  # bfloat16 memory holds bits: bitcast to int16 gives those bits back
  bits = np.array([0x3F80, 0xC000, 0x7F80], np.uint16)
  result = run_elementwise(unary_kernel(UOps.BITCAST, dtypes.bfloat16, dtypes.int16, 3), np.int16, bits)
  np.testing.assert_array_equal(result, bits.view(np.int16))


def test_empty_loop_runs_no_iterations() -> None:
  build = UOpBuilder()
  output = build.add(UOps.DEFINE_GLOBAL, INT32, (), (0, True))
  zero = build.const(0, INT32)
  accumulator = build.add(UOps.DEFINE_ACC, INT32, (), 5)
  loop = build.add(UOps.RANGE, INT32, (build.const(3, INT32), build.const(3, INT32)), ("ridx0", AxisType.REDUCE))
  build.add(UOps.ACCUMULATE, INT32, (accumulator, loop), Ops.ADD)
  build.end_range(loop)
  build.add(UOps.STORE, None, (output, zero, accumulator))
  memory = np.zeros(1, np.int32).view(np.uint8)
  build_program(build.uops)(memory)
  assert memory.view(np.int32)[0] == 5


# ================================================================ graphs: PYTHON vs CLANG vs numpy

def realize_on(device: str, build: Callable[..., Tensor], arrays: list[np.ndarray]) -> np.ndarray:
  return build(*[Tensor(array, device=device) for array in arrays]).numpy()


def check_graph(build: Callable[..., Tensor], arrays: list[np.ndarray], expected: np.ndarray | None,
                rtol: float = 1e-5, atol: float = 1e-6, clang_rtol: float = 1e-6,
                with_clang: bool = True) -> np.ndarray:
  """Realize on PYTHON and on CLANG; both must agree with each other and with the numpy expectation."""
  python = realize_on("PYTHON", build, arrays)
  if with_clang:
    clang = realize_on("CLANG", build, arrays)
    assert python.shape == clang.shape and python.dtype == clang.dtype
    if python.dtype.kind in "biu": np.testing.assert_array_equal(python, clang, err_msg="PYTHON vs CLANG")
    else: np.testing.assert_allclose(python, clang, rtol=clang_rtol, atol=clang_rtol, err_msg="PYTHON vs CLANG")
  if expected is not None:
    if python.dtype.kind in "biu": np.testing.assert_array_equal(python, expected, err_msg="PYTHON vs numpy")
    else: np.testing.assert_allclose(python, expected, rtol=rtol, atol=atol, err_msg="PYTHON vs numpy")
  return python


INT_TYPES = [dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16, INT32, dtypes.uint32, dtypes.int64,
             dtypes.uint64]
# C promotes these to int and the C renderer inlines single-use results without converting back, so CLANG does
# not wrap them between ops (see test_clang_wraps_narrow_integers_between_ops); numpy is the reference for them
NARROW_INTS = (dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16)


@pytest.mark.parametrize("dtype", INT_TYPES, ids=str)
def test_integer_chain_wraps(dtype: DType) -> None:
  info = np.iinfo(dtype.np)
  x = np.concatenate([np.array([info.max, info.min, info.max - 3], dtype.np),
                      rng.integers(info.min // 2, info.max // 2, 29, dtype=dtype.np)])
  y = np.concatenate([np.array([2, 3, info.max], dtype.np),
                      rng.integers(0 if dtype.is_unsigned else -50, 50, 29, dtype=dtype.np)])

  def chain(a: Any, b: Any) -> Any:
    mixed = (a * b + a) ^ (b << 1)
    return (mixed - (a >> 2)).maximum(b) if isinstance(a, Tensor) else np.maximum(mixed - (a >> 2), b)

  def selected(a: Any, b: Any) -> Any:
    return (a < b).where(a | b, a & b) if isinstance(a, Tensor) else np.where(a < b, a | b, a & b)

  with np.errstate(over="ignore"):
    check_graph(chain, [x, y], chain(x, y), with_clang=dtype not in NARROW_INTS)
  check_graph(selected, [x, y], selected(x, y))


def test_clang_wraps_narrow_integers_between_ops() -> None:
  x, y = np.array([100, 127, -128, 50], np.int8), np.array([3, 2, 3, 4], np.int8)
  check_graph(lambda a, b: (a * b).maximum(b), [x, y], np.array([44, 2, 3, 4], np.int8))


def test_bool_chain() -> None:
  x, y = rng.random(40) < 0.5, rng.random(40) < 0.3
  expected = ((x & y) | ~x) ^ y
  check_graph(lambda a, b: ((a & b) | ~a) ^ b, [x, y], expected)
  check_graph(lambda a, b: a.where(b, ~b) != a, [x, y], np.where(x, y, ~y) != x)
  check_graph(lambda a, b: (a + b) * b, [x, y], (x | y) & y)  # bool + is or, * is and


FLOAT_TOLERANCES = {dtypes.float16: 5e-3, dtypes.bfloat16: 4e-2, dtypes.float32: 1e-5, dtypes.float64: 1e-12}


@pytest.mark.parametrize("dtype", list(FLOAT_TOLERANCES), ids=str)
def test_float_chain(dtype: DType) -> None:
  x = rng.uniform(-2, 2, (6, 10)).astype(np.float32)
  y = rng.uniform(-2, 2, (6, 10)).astype(np.float32)
  if dtype == dtypes.bfloat16:  # inputs that bfloat16 holds exactly, so numpy sees the same inputs
    x, y = (torch.from_numpy(v).to(torch.bfloat16).float().numpy() for v in (x, y))
  else:
    x, y = x.astype(dtype.np), y.astype(dtype.np)

  def chain(a: Tensor, b: Tensor) -> Tensor:
    a, b = a.cast(dtype), b.cast(dtype)
    return (a * b + a.sin()).maximum(b) + (a.abs() + 1).log() - b.exp() * 0.5 + (a * a + 0.1).sqrt() / (b.abs() + 1)

  wide_x, wide_y = x.astype(np.float64), y.astype(np.float64)
  expected = (np.maximum(wide_x * wide_y + np.sin(wide_x), wide_y) + np.log(np.abs(wide_x) + 1) - np.exp(wide_y) * 0.5
              + np.sqrt(wide_x * wide_x + 0.1) / (np.abs(wide_y) + 1))
  tolerance = FLOAT_TOLERANCES[dtype]
  result = check_graph(chain, [x, y], expected, rtol=tolerance, atol=tolerance,
                       clang_rtol=max(tolerance, 1e-6))
  assert result.dtype == (np.float32 if dtype == dtypes.bfloat16 else dtype.np)


def test_reductions_sum_and_max_with_nan() -> None:
  x = rng.standard_normal((8, 33)).astype(np.float32)
  x[2, 5] = np.nan
  x[6, 0] = np.nan
  check_graph(lambda a: a.sum(axis=1), [x], x.sum(axis=1), clang_rtol=1e-5)  # 33 values each, in other orders
  check_graph(lambda a: a.max(axis=1), [x], x.max(axis=1))
  check_graph(lambda a: a.max(axis=0), [x], x.max(axis=0))
  clean = np.nan_to_num(x)
  # a full sum of 264 float32 values: the two devices add in different orders (CLANG's vector lanes), as numpy does
  check_graph(lambda a: a.sum(), [clean], clean.sum(dtype=np.float64), rtol=1e-5, clang_rtol=1e-5)
  check_graph(lambda a: a.mean(axis=0, keepdim=True), [clean], clean.mean(axis=0, keepdims=True))
  ints = rng.integers(-1000, 1000, (5, 300)).astype(np.int32)
  check_graph(lambda a: a.sum(axis=1), [ints], ints.sum(axis=1))
  check_graph(lambda a: a.max(), [ints], ints.max())


def test_reduce_loops_run_at_once_exactly_as_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
  """Reduce loops are evaluated a chunk of iterations at a time; the fold keeps the sequential order, so the
  numbers are bit-identical to running each iteration (and close to CLANG's: PYTHON splits the sum over GROUP
  threads, CLANG runs one loop)."""
  values = (rng.standard_normal(3000) * np.logspace(-6, 6, 3000)).astype(np.float32)
  halves = rng.uniform(-8, 8, (4, 700)).astype(np.float16)
  ints = rng.integers(2**30, 2**31 - 1, 1000).astype(np.int32)  # the sum wraps around many times
  with_nan = rng.standard_normal((3, 50)).astype(np.float32)
  with_nan[1, 7] = np.nan
  graphs: list[tuple[Callable[..., Tensor], list[np.ndarray]]] = [
    (lambda a: a.sum(), [values]), (lambda a: a.sum(axis=1, dtype=dtypes.float16), [halves]),
    (lambda a: a.sum(dtype=INT32), [ints]), (lambda a: a.max(axis=1), [with_nan]),
    (lambda a, b: a @ b, [values[:600].reshape(20, 30), values[600:1500].reshape(30, 30)]),
    (lambda a: a.pad(((0, 0), (1, 2), (2, 1))).sum(axis=(1, 2)), [values[:2400].reshape(8, 15, 20)])]  # nested loops

  def run_all() -> list[np.ndarray]: return [realize_on("PYTHON", build, arrays) for build, arrays in graphs]

  at_once = run_all()
  monkeypatch.setattr(uop_interpreter, "LOOP_CHUNK_ELEMENTS", 0)
  one_by_one = run_all()
  for fast, slow in zip(at_once, one_by_one): np.testing.assert_array_equal(fast, slow)
  assert ints.sum(dtype=np.int32) == at_once[2]
  clang = realize_on("CLANG", graphs[0][0], graphs[0][1])
  np.testing.assert_allclose(at_once[0], clang, rtol=0, atol=1e-6 * float(np.abs(values).sum()))


def test_nested_reduce_loops_run_at_once() -> None:
  """Two nested reduce loops (the inner bound declared inside the outer loop) form one chain run at once."""
  build = UOpBuilder()
  output = build.add(UOps.DEFINE_GLOBAL, dtypes.float32, (), (0, True))
  source = build.add(UOps.DEFINE_GLOBAL, dtypes.float32, (), (1, False))
  zero = build.const(0, INT32)
  accumulator = build.add(UOps.DEFINE_ACC, dtypes.float32, (), 0.0)
  outer = build.add(UOps.RANGE, INT32, (zero, build.const(40, INT32)), ("ridx0", AxisType.REDUCE))
  inner = build.add(UOps.RANGE, INT32, (zero, build.const(25, INT32)), ("ridx1", AxisType.REDUCE))
  address = build.alu(Ops.ADD, INT32, build.alu(Ops.MUL, INT32, outer, build.const(25, INT32)), inner)
  build.add(UOps.ACCUMULATE, dtypes.float32, (accumulator, build.add(UOps.LOAD, dtypes.float32, (source, address))),
            Ops.ADD)
  build.end_range(inner)
  build.end_range(outer)
  build.add(UOps.STORE, None, (output, zero, accumulator))
  program = build_program(build.uops)
  positions = {id(uop): index for index, uop in enumerate(build.uops)}
  assert program.vectorizable[positions[id(outer)]] == [positions[id(outer)], positions[id(inner)]]
  values = (rng.standard_normal(1000) * np.logspace(-4, 4, 1000)).astype(np.float32)
  sequential = np.float32(0)
  for value in values: sequential = np.float32(sequential + value)
  memory = np.zeros(1, np.float32).view(np.uint8)
  program(memory, as_bytes(values))
  assert memory.view(np.float32)[0] == sequential, "the fold adds in loop order, rounding after each step"


def test_a_reduce_loop_reading_local_memory_runs_one_iteration_at_a_time() -> None:
  """A loop that sums local memory (a prefix of a block's counts: codegen/index_accumulate.py) is not run at once:
  local memory is read at one index per thread, so it runs iteration by iteration, and sums what was stored."""
  build = UOpBuilder()
  output = build.add(UOps.DEFINE_GLOBAL, INT32, (), (0, True))
  zero = build.const(0, INT32)
  counts = build.add(UOps.DEFINE_LOCAL, INT32, (), ("counts", 8))
  fill = build.add(UOps.RANGE, INT32, (zero, build.const(8, INT32)), ("fill", AxisType.REDUCE))
  build.add(UOps.STORE, None, (counts, fill, build.alu(Ops.MUL, INT32, fill, build.const(3, INT32))))
  build.end_range(fill)
  total = build.add(UOps.DEFINE_ACC, INT32, (), 0)
  walk = build.add(UOps.RANGE, INT32, (zero, build.const(8, INT32)), ("walk", AxisType.REDUCE))
  build.add(UOps.ACCUMULATE, INT32, (total, build.add(UOps.LOAD, INT32, (counts, walk))), Ops.ADD)
  build.end_range(walk)
  build.add(UOps.STORE, None, (output, zero, total))
  program = build_program(build.uops)
  positions = {id(uop): index for index, uop in enumerate(build.uops)}
  assert positions[id(walk)] not in program.vectorizable
  memory = np.zeros(1, np.int32).view(np.uint8)
  program(memory)
  assert memory.view(np.int32)[0] == 3 * sum(range(8))


def test_matmul_uses_local_upcast_and_unroll() -> None:
  a = rng.standard_normal((32, 48)).astype(np.float32)
  b = rng.standard_normal((48, 16)).astype(np.float32)
  product = Tensor(a, device="PYTHON") @ Tensor(b, device="PYTHON")
  kernel = Kernel(create_schedule([product.lazydata])[-1].ast, Device["PYTHON"].renderer)
  kernel.hand_coded_optimizations()
  assert {OptOps.LOCAL, OptOps.UPCAST, OptOps.UNROLL} <= {opt.op for opt in kernel.applied_opts}
  # the C compiler may fuse a*b+c into one FMA (one rounding instead of two): CLANG differs in the last bits
  check_graph(lambda x, y: x @ y, [a, b], a @ b, rtol=1e-5, atol=1e-5, clang_rtol=1e-5)
  check_graph(lambda x, y: x @ y, [a[:17, :33], b[:33, :9]], a[:17, :33] @ b[:33, :9], rtol=1e-5, atol=1e-5,
              clang_rtol=1e-5)


def test_softmax() -> None:
  x = rng.standard_normal((7, 19)).astype(np.float32) * 4
  shifted = np.exp(x - x.max(axis=-1, keepdims=True))
  check_graph(lambda a: a.softmax(-1), [x], shifted / shifted.sum(axis=-1, keepdims=True))


def test_padded_convolution_and_pooling() -> None:
  """Padding makes gated loads: the border threads must read 0 (or -inf for max) without touching memory."""
  image = rng.standard_normal((2, 3, 9, 8)).astype(np.float32)
  weight = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
  expected = torch.nn.functional.conv2d(torch.from_numpy(image), torch.from_numpy(weight), padding=1, stride=2)
  check_graph(lambda x, w: functional.conv2d(x, w, padding=1, stride=2), [image, weight], expected.numpy(),
              rtol=1e-5, atol=1e-5, clang_rtol=1e-5)
  pooled = torch.nn.functional.max_pool2d(torch.from_numpy(image), 3, stride=2, padding=1)
  check_graph(lambda x: functional.max_pool2d(x, 3, stride=2, padding=1), [image], pooled.numpy())
  # sums of 72 values that may nearly cancel: the devices add in different orders, so 1e-5 absolute between them
  check_graph(lambda x: x.pad(((0, 0), (0, 0), (2, 1), (1, 3))).sum(axis=(2, 3)), [image], image.sum(axis=(2, 3)),
              clang_rtol=1e-5)


def test_integer_division_and_modulo_with_negatives_and_zero_divisors() -> None:
  x = np.array([7, -7, 7, -7, 0, 5, -5, -2**31, -2**31, 13, -13, 9], np.int32)
  y = np.array([2, 2, -2, -2, 3, 0, 0, 3, 1, 0, 4, -4], np.int32)
  nonzero = np.where(y == 0, 1, y)
  c_quotient = np.where(y == 0, 0, np.trunc(x.astype(np.float64) / nonzero)).astype(np.int64).astype(np.int32)
  check_graph(lambda a, b: a.div(b, rounding_mode="trunc"), [x, y], c_quotient)  # IDIV itself
  check_graph(lambda a, b: a.fmod(b), [x, y], np.where(y == 0, 0, np.fmod(x, nonzero)))  # MOD itself
  with np.errstate(all="ignore"):
    check_graph(lambda a, b: a // b, [x, y], np.where(y == 0, 0, x // nonzero))
    check_graph(lambda a, b: a % b, [x, y], np.where(y == 0, 0, x % nonzero))
  # INT_MIN / -1 overflows: it wraps to INT_MIN, remainder 0 (x86's idiv would trap: the C renderers guard it)
  x, y = np.array([-2**31, -2**31, 5], np.int32), np.array([-1, -1, -1], np.int32)
  check_graph(lambda a, b: a.div(b, rounding_mode="trunc"), [x, y], np.array([-2**31, -2**31, -5], np.int32))
  check_graph(lambda a, b: a.fmod(b), [x, y], np.zeros(3, np.int32))
  small = np.array([200, 7, 255, 0], np.uint8)
  check_graph(lambda a, b: (a // b) + (a % b), [small, np.array([3, 0, 16, 5], np.uint8)],
              np.array([66 + 2, 0, 15 + 15, 0], np.uint8))


def test_casts_in_graphs() -> None:
  x = np.array([-2.7, 2.7, -0.5, 0.5, 100.9, -100.9, 0.0, 1e-3], np.float32)
  check_graph(lambda a: a.cast(INT32), [x], x.astype(np.int32))
  check_graph(lambda a: a.cast(dtypes.bool), [x], x != 0)
  check_graph(lambda a: a.cast(dtypes.float16).cast(dtypes.float32), [x], x.astype(np.float16).astype(np.float32),
              rtol=0, atol=0, clang_rtol=0)
  check_graph(lambda a: a.cast(dtypes.bfloat16), [x], torch.from_numpy(x).to(torch.bfloat16).float().numpy(),
              rtol=0, atol=0, clang_rtol=0)
  check_graph(lambda a: (a > 0).cast(dtypes.float32) * 3, [x], (x > 0).astype(np.float32) * 3)
  ints = np.array([300, -129, 2**24 + 1, 7], np.int32)
  check_graph(lambda a: a.cast(dtypes.int8), [ints], ints.astype(np.int8))
  check_graph(lambda a: a.cast(dtypes.float32), [ints], ints.astype(np.float32), rtol=0, atol=0, clang_rtol=0)


def test_bitcasts_in_graphs() -> None:
  x = np.array([1.0, -2.5, np.inf, 0.1], np.float32)
  check_graph(lambda a: a.bitcast(INT32), [x], x.view(np.int32))
  check_graph(lambda a: a.bitcast(dtypes.uint32).bitcast(dtypes.float32) + 1, [x], x + 1)
  halves = np.array([1.0, -0.0, 65504, 0.333], np.float16)
  check_graph(lambda a: a.bitcast(dtypes.int16), [halves], halves.view(np.int16))
  check_graph(lambda a: (a + 1).bitcast(dtypes.int16), [halves], (halves + np.float16(1)).view(np.int16))


def test_argmax_cumsum_and_indexing() -> None:
  x = rng.standard_normal((6, 11)).astype(np.float32)
  x[3, 2] = x[3, 7] = 9.0  # a tie: the first index wins
  check_graph(lambda a: a.argmax(axis=1), [x], x.argmax(axis=1))
  check_graph(lambda a: a.argmax(), [x], np.array(x.argmax()))
  check_graph(lambda a: a.cumsum(1), [x], np.cumsum(x, axis=1), rtol=1e-5, atol=1e-5)
  check_graph(lambda a: a[1:, ::3] * 2, [x], x[1:, ::3] * 2)
  check_graph(lambda a: a[::-1, 4], [x], x[::-1, 4])
  check_graph(lambda a, rows: a[rows], [x, np.array([5, 0, 2], np.int32)], x[[5, 0, 2]])

  def assigned(a: Tensor) -> Tensor:
    a = a.contiguous()
    a[1:4, ::2] = -1.0
    a[0] = a[5] + 1
    return a

  expected = x.copy()
  expected[1:4, ::2] = -1.0
  expected[0] = expected[5] + 1
  check_graph(assigned, [x], expected)


# ================================================================ optimized kernels vs the plain loop nest

@pytest.fixture
def python_default(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setenv("DEVICE", "PYTHON")
  assert Device.DEFAULT == "PYTHON"


@pytest.mark.parametrize("name", list(test_opts._graphs().keys()))
def test_hand_coded_opts_match_plain_on_python(python_default: None, name: str) -> None:
  test_opts.test_hand_coded_matches_plain(name)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", ["matmul_bias_relu", "sum_rows", "elementwise_broadcast", "padded_window_sum",
                                  "int_mod_sum"])
def test_random_opts_match_plain_on_python(python_default: None, name: str, seed: int) -> None:
  test_opts.test_random_opts_match_plain(name, seed)


def test_explicit_local_upcast_unroll_match_plain(python_default: None) -> None:
  item = test_opts._last_item(test_opts._graphs()["matmul_bias_relu"])
  opts = [Opt(OptOps.LOCAL, 0, 4), Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.UNROLL, 0, 4), Opt(OptOps.LOCAL, 1, 2)]
  optimized, applied = test_opts._run(item, opts)
  assert applied == opts, f"all opts should apply, got {applied}"
  np.testing.assert_allclose(optimized, test_opts._plain(item), rtol=1e-5, atol=1e-5)
