"""The renderers on their own: hand-built UOp programs rendered as C, LLVM IR, OpenCL C and CUDA C, then compiled and
run where this machine can (C and LLVM on the CPU, the PYTHON interpreter for the GPU-style programs, NVRTC for CUDA
when cuda-python is installed, OpenCL when a device builds kernels) and compared with numpy.

Text checks are kept to what any correct rendering of the dialect contains (the kernel's name, its entry-point
keyword, one parameter per buffer), not to formatting, so renderer changes that keep results do not break them.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest

from ourgrad.codegen.uops import AxisType, UOp, UOpBuilder, UOps
from ourgrad.device import Device
from ourgrad.dtype import dtypes
from ourgrad.engine.realize import launch_dims
from ourgrad.errors import CompileError, DeviceError
from ourgrad.ops import Ops
from ourgrad.renderer.cstyle import ClangRenderer, OpenCLRenderer
from ourgrad.renderer.cuda import CUDARenderer

I32, F32 = dtypes.int32, dtypes.float32
SIZE = 37   # not a multiple of any vector width


# ---------------------------------------------------------------- hand-built programs

@dataclass
class Program:
  """A UOp list for CPU renderers (loops) or GPU renderers (thread indices), its inputs, and the numpy result."""
  uops: list[UOp]
  out: np.ndarray                   # zero-filled output of the right size and dtype
  inputs: list[np.ndarray]
  expected: np.ndarray


def outer_index(build: UOpBuilder, size: int, threads: bool) -> tuple[UOp, UOp | None]:
  """The output index: a loop on CPUs (returned to be closed), a block index on GPUs."""
  if threads: return build.add(UOps.SPECIAL, I32, (), ("gidx0", size, 0, AxisType.GLOBAL)), None
  loop = build.add(UOps.RANGE, I32, (build.const(0, I32), build.const(size, I32)), ("gidx0", AxisType.GLOBAL))
  return loop, loop


def affine_program(threads: bool) -> Program:
  """out[i] = a[i] * 2.5 + b[i] (float32)."""
  build = UOpBuilder()
  out, a, b = (build.add(UOps.DEFINE_GLOBAL, F32, (), (index, index == 0)) for index in range(3))
  index, loop = outer_index(build, SIZE, threads)
  scaled = build.alu(Ops.MUL, F32, build.add(UOps.LOAD, F32, (a, index)), build.const(2.5, F32))
  build.add(UOps.STORE, None, (out, index, build.alu(Ops.ADD, F32, scaled, build.add(UOps.LOAD, F32, (b, index)))))
  if loop is not None: build.end_range(loop)
  rng = np.random.default_rng(0)
  x, y = rng.standard_normal(SIZE).astype(np.float32), rng.standard_normal(SIZE).astype(np.float32)
  return Program(build.uops, np.zeros(SIZE, np.float32), [x, y], x * np.float32(2.5) + y)


def max_reduce_program(threads: bool) -> Program:
  """out[i] = max(x[i*8 .. i*8+7]) with an accumulator starting at -inf."""
  rows, columns = 5, 8
  build = UOpBuilder()
  out, x = (build.add(UOps.DEFINE_GLOBAL, F32, (), (index, index == 0)) for index in range(2))
  row, loop = outer_index(build, rows, threads)
  accumulator = build.add(UOps.DEFINE_ACC, F32, (), -math.inf)
  column = build.add(UOps.RANGE, I32, (build.const(0, I32), build.const(columns, I32)), ("ridx1", AxisType.REDUCE))
  address = build.alu(Ops.ADD, I32, build.alu(Ops.MUL, I32, row, build.const(columns, I32)), column)
  build.add(UOps.ACCUMULATE, F32, (accumulator, build.add(UOps.LOAD, F32, (x, address))), Ops.MAX)
  build.end_range(column)
  build.add(UOps.STORE, None, (out, row, accumulator))
  if loop is not None: build.end_range(loop)
  data = np.random.default_rng(1).standard_normal((rows, columns)).astype(np.float32)
  return Program(build.uops, np.zeros(rows, np.float32), [data.reshape(-1)], data.max(1))


def masked_cast_program(threads: bool) -> Program:
  """out[i] = float(3 <= i < 3+n ? x[i-3] : 0) * 0.5: an int32 input read under a validity condition (the reads
  outside it give 0 and touch no memory), cast to float32."""
  n = 20
  build = UOpBuilder()
  out = build.add(UOps.DEFINE_GLOBAL, F32, (), (0, True))
  x = build.add(UOps.DEFINE_GLOBAL, I32, (), (1, False))
  index, loop = outer_index(build, SIZE, threads)
  shifted = build.alu(Ops.ADD, I32, index, build.const(-3, I32))
  valid = build.alu(Ops.AND, dtypes.bool, build.alu(Ops.CMPLT, dtypes.bool, build.const(2, I32), index),
                    build.alu(Ops.CMPLT, dtypes.bool, index, build.const(3 + n, I32)))
  loaded = build.add(UOps.LOAD, I32, (x, shifted, valid))
  value = build.alu(Ops.MUL, F32, build.add(UOps.CAST, F32, (loaded,)), build.const(0.5, F32))
  build.add(UOps.STORE, None, (out, index, value))
  if loop is not None: build.end_range(loop)
  data = np.arange(-7, -7 + n, dtype=np.int32) * 3
  expected = np.zeros(SIZE, np.float32)
  expected[3:3 + n] = data.astype(np.float32) * np.float32(0.5)
  return Program(build.uops, np.zeros(SIZE, np.float32), [data], expected)


def special_constants_program(threads: bool) -> Program:
  """out = [inf, -inf, nan, -0.0, max(x, nan), max(nan, x)]: constants a C or LLVM spelling gets wrong easily, and
  NaN through MAX from either side (NaN wins, as in PyTorch)."""
  build = UOpBuilder()
  out, x = (build.add(UOps.DEFINE_GLOBAL, F32, (), (index, index == 0)) for index in range(2))
  index, loop = outer_index(build, 1, threads)
  for position, value in enumerate([math.inf, -math.inf, math.nan, -0.0]):
    address = build.alu(Ops.ADD, I32, index, build.const(position, I32))
    build.add(UOps.STORE, None, (out, address, build.const(value, F32)))
  loaded = build.add(UOps.LOAD, F32, (x, index))
  nan = build.const(math.nan, F32)
  for position, maximum in [(4, build.alu(Ops.MAX, F32, loaded, nan)), (5, build.alu(Ops.MAX, F32, nan, loaded))]:
    build.add(UOps.STORE, None, (out, build.alu(Ops.ADD, I32, index, build.const(position, I32)), maximum))
  if loop is not None: build.end_range(loop)
  expected = np.array([np.inf, -np.inf, np.nan, -0.0, np.nan, np.nan], np.float32)
  return Program(build.uops, np.zeros(6, np.float32), [np.array([3.0], np.float32)], expected)


def integer_division_program(threads: bool) -> Program:
  """out[2i] = a[i] / b[i], out[2i+1] = a[i] % b[i] (int32): C semantics, truncating toward zero."""
  a_values = np.array([7, -7, 7, -7, 0, 13, -13, 100, -1, 5], np.int32)
  b_values = np.array([2, 2, -2, -2, 3, 5, 5, -7, 3, 1], np.int32)
  size = len(a_values)
  build = UOpBuilder()
  out = build.add(UOps.DEFINE_GLOBAL, I32, (), (0, True))
  a, b = (build.add(UOps.DEFINE_GLOBAL, I32, (), (index, False)) for index in (1, 2))
  index, loop = outer_index(build, size, threads)
  left, right = build.add(UOps.LOAD, I32, (a, index)), build.add(UOps.LOAD, I32, (b, index))
  doubled = build.alu(Ops.MUL, I32, index, build.const(2, I32))
  build.add(UOps.STORE, None, (out, doubled, build.alu(Ops.IDIV, I32, left, right)))
  build.add(UOps.STORE, None, (out, build.alu(Ops.ADD, I32, doubled, build.const(1, I32)),
                               build.alu(Ops.MOD, I32, left, right)))
  if loop is not None: build.end_range(loop)
  expected = np.array([[int(x / y), int(math.fmod(x, y))] for x, y in zip(a_values, b_values)], np.int32).reshape(-1)
  return Program(build.uops, np.zeros(2 * size, np.int32), [a_values, b_values], expected)


PROGRAMS: dict[str, Callable[[bool], Program]] = {
  "affine": affine_program, "max_reduce": max_reduce_program, "masked_cast": masked_cast_program,
  "special_constants": special_constants_program, "integer_division": integer_division_program,
}


def launch(device: str, source: str, program: Program, name: str) -> np.ndarray:
  """Compile `source` on `device` (no disk cache), run it on the program's inputs; the output array."""
  compiled = Device[device]
  kernel = compiled.program(name, compiled.compiler.compile(source))
  global_size, local_size = launch_dims(program.uops)
  if device in ("CLANG", "LLVM", "PYTHON"):   # host memory: the programs take byte arrays
    out = program.out.copy()
    kernel(out.view(np.uint8), *[array.view(np.uint8) for array in program.inputs], global_size=global_size,
           local_size=local_size)
    return out
  buffers = [compiled.allocator.alloc(max(array.nbytes, 1)) for array in [program.out, *program.inputs]]
  for buffer, array in zip(buffers, [program.out, *program.inputs]):
    compiled.allocator.copyin(buffer, memoryview(array).cast("B"))
  kernel(*buffers, global_size=global_size, local_size=local_size)
  out = program.out.copy()
  compiled.allocator.copyout(memoryview(out).cast("B"), buffers[0])
  return out


def assert_same(result: np.ndarray, expected: np.ndarray) -> None:
  """Equal values, NaN where NaN is expected, and the sign of zeros."""
  np.testing.assert_allclose(result, expected, rtol=1e-6, equal_nan=True)
  assert np.array_equal(np.signbit(result[expected == 0]), np.signbit(expected[expected == 0]))


def parameter_count(uops: list[UOp]) -> int: return sum(1 for uop in uops if uop.op is UOps.DEFINE_GLOBAL)


# ---------------------------------------------------------------- CPU renderers: render, compile, run

@pytest.mark.parametrize("case", list(PROGRAMS))
def test_c_renders_compiles_and_runs(case: str) -> None:
  program = PROGRAMS[case](False)
  name = f"test_{case}"
  source = ClangRenderer().render(name, program.uops)
  signature = re.search(rf"\bvoid\s+{name}\s*\(([^)]*)\)", source)
  assert signature and signature.group(1).count(",") + 1 == parameter_count(program.uops), source
  assert re.search(r"\bfor\s*\(", source), source   # the CPU renderer loops
  assert_same(launch("CLANG", source, program, name), program.expected)


@pytest.mark.parametrize("case", list(PROGRAMS))
def test_llvm_renders_compiles_and_runs(case: str) -> None:
  pytest.importorskip("llvmlite")
  program = PROGRAMS[case](False)
  name = f"test_{case}"
  source = Device["LLVM"].renderer.render(name, program.uops)
  assert re.search(rf"define\s+void\s+@{name}\s*\(", source), source
  assert_same(launch("LLVM", source, program, name), program.expected)


# ---------------------------------------------------------------- GPU renderers

@pytest.mark.parametrize("case", list(PROGRAMS))
def test_gpu_style_programs_run_on_the_python_interpreter(case: str) -> None:
  """The thread-indexed programs the GPU renderers get are right: the PYTHON device runs them."""
  program = PROGRAMS[case](True)
  source = Device["PYTHON"].renderer.render(f"test_{case}", program.uops)
  assert_same(launch("PYTHON", source, program, f"test_{case}"), program.expected)


@pytest.mark.parametrize("case", list(PROGRAMS))
def test_cuda_renders_and_nvrtc_compiles(case: str) -> None:
  pytest.importorskip("cuda.bindings")
  from ourgrad.runtime.ops_cuda import CUDACompiler
  program = PROGRAMS[case](True)
  name = f"test_{case}"
  source = CUDARenderer().render(name, program.uops)
  signature = re.search(rf"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?{name}\s*\(([^)]*)\)", source)
  assert signature and signature.group(1).count(",") + 1 == parameter_count(program.uops), source
  assert "for (" not in source.split(name, 1)[1] or case == "max_reduce"   # only the reduce loops; blocks index
  cubin = CUDACompiler("sm_90").compile(source)
  assert cubin[:4] == b"\x7fELF"
  try:
    Device["CUDA"]
  except DeviceError:
    return   # no GPU here: NVRTC accepting the source is what can be checked
  assert_same(launch("CUDA", source, program, name), program.expected)


def opencl_builds_kernels() -> bool:
  try:
    Device["OPENCL"].compiler.compile("__kernel void probe(__global float* out) { out[0] = 1.0f; }")
  except (DeviceError, CompileError):
    return False
  return True


@pytest.mark.parametrize("case", list(PROGRAMS))
def test_opencl_renders_and_runs_where_a_device_builds(case: str) -> None:
  program = PROGRAMS[case](True)
  name = f"test_{case}"
  source = OpenCLRenderer().render(name, program.uops)
  signature = re.search(rf"__kernel\s+void\s+(?:__attribute__\(\([^)]*\)\)\s+)?{name}\s*\(([^)]*)\)", source)
  assert signature and signature.group(1).count("__global") == parameter_count(program.uops), source
  pytest.importorskip("pyopencl")
  if not opencl_builds_kernels(): pytest.skip("no OpenCL device here builds kernels")
  assert_same(launch("OPENCL", source, program, name), program.expected)


def test_renderers_name_the_dtypes_of_their_buffers() -> None:
  """An int32 output and a float input are declared with their own types in every C dialect."""
  for renderer in (ClangRenderer(), OpenCLRenderer(), CUDARenderer()):
    source = renderer.render("typed", masked_cast_program(renderer.has_threads).uops)
    parameters = re.search(r"typed\s*\(([^)]*)\)", source).group(1)
    assert "float" in parameters.split(",")[0] and "int" in parameters.split(",")[1], source

