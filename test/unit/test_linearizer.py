"""The linearizer on its own: small kernel ASTs built by hand, lowered to UOps, checked for their structure (loops,
accumulators, CSE, constant folding, index math) and run on CLANG (and PYTHON for GPU-style lowering) against numpy.

The structural checks read the UOp list through a few helpers (`loops`, `inside`, `count`) and assert what any
correct lowering has (one loop per unmerged axis, the accumulator updated inside the reduce loop and stored after
it, one LOAD per distinct address), not the exact list, so new axis kinds and UOps do not break them.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.codegen.linearizer import INDEX_DTYPE, Linearizer, linearize
from ourgrad.codegen.uops import UOp, UOpBuilder, UOps
from ourgrad.device import Device
from ourgrad.dtype import DType, dtypes
from ourgrad.engine.realize import launch_dims
from ourgrad.ops import ConstBuffer, LazyOp, MemBuffer, Ops
from ourgrad.shape.shapetracker import ShapeTracker
from ourgrad.shape.symbolic import Node, Variable

F32 = dtypes.float32


# ---------------------------------------------------------------- building ASTs

def load(index: int, st: ShapeTracker, dtype: DType = F32) -> LazyOp:
  return LazyOp(Ops.LOAD, (), MemBuffer(index, dtype, st), dtype)


def const(value: float, st: ShapeTracker, dtype: DType = F32) -> LazyOp:
  return LazyOp(Ops.CONST, (), ConstBuffer(value, dtype, st), dtype)


def alu(op: Ops, *srcs: LazyOp) -> LazyOp:
  return LazyOp(op, srcs, None, srcs[-1].dtype)


def store(value: LazyOp, shape: tuple[int, ...]) -> LazyOp:
  return LazyOp(Ops.STORE, (value,), MemBuffer(0, value.dtype, ShapeTracker.from_shape(shape)), value.dtype)


def reduce(op: Ops, value: LazyOp, axes: tuple[int, ...]) -> LazyOp:
  return LazyOp(op, (value,), axes, value.dtype)


def st(*shape: int) -> ShapeTracker: return ShapeTracker.from_shape(shape)


def kernel_for(ast: LazyOp, device: str = "CLANG", opts: tuple[Opt, ...] = ()) -> Kernel:
  kernel = Kernel(ast, Device[device].renderer)
  for opt in opts: kernel.apply_opt(opt)
  return kernel


def run(kernel: Kernel, device: str, out_shape: tuple[int, ...], *inputs: np.ndarray) -> np.ndarray:
  """Linearize, render, compile and launch the kernel; the output buffer as an array of out_shape."""
  uops = linearize(kernel)
  source = Device[device].renderer.render("test_kernel", uops)
  program = Device[device].program("test_kernel", Device[device].compiler.compile(source))
  out = np.zeros(math.prod(out_shape), dtype=kernel.ast.dtype.np)
  global_size, local_size = launch_dims(uops)
  # device programs take raw memory: byte arrays, as the host allocators hand out
  raw_inputs = [np.ascontiguousarray(array).reshape(-1).view(np.uint8) for array in inputs]
  program(out.view(np.uint8), *raw_inputs, global_size=global_size, local_size=local_size)
  return out.reshape(out_shape)


# ---------------------------------------------------------------- reading UOp lists

def count(uops: list[UOp], op: UOps, arg: object = None) -> int:
  return sum(1 for uop in uops if uop.op is op and (arg is None or uop.arg == arg))


def loops(uops: list[UOp]) -> list[tuple[int, int]]:
  """(position of RANGE, position of its ENDRANGE) for every loop, in opening order."""
  position = {id(uop): index for index, uop in enumerate(uops)}
  ends = {id(uop.srcs[0]): index for index, uop in enumerate(uops) if uop.op is UOps.ENDRANGE}
  return [(position[id(uop)], ends[id(uop)]) for uop in uops if uop.op is UOps.RANGE]


def trip_count(range_uop: UOp) -> int:
  start, end = range_uop.srcs
  return end.arg - start.arg


def inside(uops: list[UOp], position: int, loop: tuple[int, int]) -> bool:
  return loop[0] < position < loop[1]


def positions(uops: list[UOp], op: UOps) -> list[int]:
  return [index for index, uop in enumerate(uops) if uop.op is op]


def float_alus(uops: list[UOp]) -> list[UOp]:
  return [uop for uop in uops if uop.op is UOps.ALU and uop.dtype is not None and uop.dtype.is_float]


def rand(*shape: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------- loop structure

def test_contiguous_elementwise_is_one_loop_over_all_elements() -> None:
  ast = store(alu(Ops.ADD, load(1, st(3, 5)), load(2, st(3, 5))), (3, 5))
  kernel = kernel_for(ast)
  uops = linearize(kernel)
  (loop,) = loops(uops)   # two contiguous axes merge into one loop
  assert trip_count(uops[loop[0]]) == 15
  assert [uop.arg for uop in uops if uop.op is UOps.DEFINE_GLOBAL] == [(0, True), (1, False), (2, False)]
  assert count(uops, UOps.LOAD) == 2 and count(uops, UOps.STORE) == 1
  assert all(inside(uops, index, loop) for index in positions(uops, UOps.LOAD) + positions(uops, UOps.STORE))
  a, b = rand(3, 5), rand(3, 5, seed=1)
  np.testing.assert_array_equal(run(kernel, "CLANG", (3, 5), a, b), a + b)


def test_permuted_input_keeps_nested_loops() -> None:
  transposed = st(5, 3).permute((1, 0))
  ast = store(alu(Ops.MUL, load(1, transposed), load(2, st(3, 5))), (3, 5))
  kernel = kernel_for(ast)
  uops = linearize(kernel)
  outer, inner = loops(uops)
  assert outer[0] < inner[0] < inner[1] < outer[1]   # nested, not one after the other
  assert sorted([trip_count(uops[outer[0]]), trip_count(uops[inner[0]])]) == [3, 5]
  a, b = rand(5, 3), rand(3, 5, seed=1)
  np.testing.assert_allclose(run(kernel, "CLANG", (3, 5), a, b), a.T * b)


@pytest.mark.parametrize("op, numpy_reduce, start", [(Ops.SUM, np.sum, 0.0), (Ops.MAX_REDUCE, np.max, -math.inf)])
def test_reduce_accumulates_inside_its_loop_and_stores_after(op: Ops, numpy_reduce, start: float) -> None:
  ast = store(reduce(op, load(1, st(4, 8)), (1,)), (4, 1))
  kernel = kernel_for(ast)
  uops = linearize(kernel)
  global_loop, reduce_loop = loops(uops)
  assert trip_count(uops[global_loop[0]]) == 4 and trip_count(uops[reduce_loop[0]]) == 8
  (accumulator,) = [uop for uop in uops if uop.op is UOps.DEFINE_ACC]
  assert accumulator.arg == start
  acc_position = uops.index(accumulator)
  assert inside(uops, acc_position, global_loop) and acc_position < reduce_loop[0]
  (update,) = positions(uops, UOps.ACCUMULATE)
  assert inside(uops, update, reduce_loop) and uops[update].srcs[0] is accumulator
  (write,) = positions(uops, UOps.STORE)
  assert reduce_loop[1] < write < global_loop[1] and accumulator in uops[write].srcs
  x = rand(4, 8)
  np.testing.assert_allclose(run(kernel, "CLANG", (4, 1), x), numpy_reduce(x, axis=1, keepdims=True), rtol=1e-6)


def test_upcast_unrolls_outputs_into_straight_line_code() -> None:
  ast = store(alu(Ops.ADD, load(1, st(16)), const(1.5, st(16))), (16,))
  kernel = kernel_for(ast, opts=(Opt(OptOps.UPCAST, 0, 4),))
  uops = linearize(kernel)
  (loop,) = loops(uops)
  assert trip_count(uops[loop[0]]) == 4 and count(uops, UOps.STORE) == 4 and count(uops, UOps.LOAD) == 4
  x = rand(16)
  np.testing.assert_array_equal(run(kernel, "CLANG", (16,), x), x + np.float32(1.5))


def test_unrolled_reduce_accumulates_each_lane() -> None:
  ast = store(reduce(Ops.SUM, load(1, st(3, 12)), (1,)), (3, 1))
  kernel = kernel_for(ast, opts=(Opt(OptOps.UNROLL, 0, 4),))
  uops = linearize(kernel)
  _, reduce_loop = loops(uops)
  assert trip_count(uops[reduce_loop[0]]) == 3
  assert count(uops, UOps.DEFINE_ACC) == 1 and count(uops, UOps.ACCUMULATE) == 4
  x = rand(3, 12)
  np.testing.assert_allclose(run(kernel, "CLANG", (3, 1), x), x.sum(1, keepdims=True), rtol=1e-5)


def test_upcast_reduce_output_gives_one_accumulator_per_lane() -> None:
  ast = store(reduce(Ops.SUM, load(1, st(8, 6)), (1,)), (8, 1))
  kernel = kernel_for(ast, opts=(Opt(OptOps.UPCAST, 0, 4),))
  uops = linearize(kernel)
  assert count(uops, UOps.DEFINE_ACC) == 4 and count(uops, UOps.STORE) == 4
  x = rand(8, 6)
  np.testing.assert_allclose(run(kernel, "CLANG", (8, 1), x), x.sum(1, keepdims=True), rtol=1e-5)


def test_gpu_lowering_uses_thread_indices_for_global_axes() -> None:
  transposed = st(6, 4).permute((1, 0))
  ast = store(reduce(Ops.SUM, alu(Ops.MUL, load(1, transposed), load(2, st(4, 6))), (1,)), (4, 1))
  kernel = kernel_for(ast, device="PYTHON")
  uops = linearize(kernel)
  specials = [uop for uop in uops if uop.op is UOps.SPECIAL]
  (reduce_loop,) = loops(uops)   # the output axis is a thread index; only the reduce is a loop
  assert specials and math.prod(uop.arg[1] for uop in specials) == 4 and trip_count(uops[reduce_loop[0]]) == 6
  global_size, local_size = launch_dims(uops)
  assert math.prod(global_size) * math.prod(local_size) == 4
  a, b = rand(6, 4), rand(4, 6, seed=1)
  np.testing.assert_allclose(run(kernel, "PYTHON", (4, 1), a, b), (a.T * b).sum(1, keepdims=True), rtol=1e-5)


# ---------------------------------------------------------------- CSE and constant folding

def test_equal_subtrees_are_computed_once() -> None:
  # four separately built but equal LOADs, two equal MULs: one LOAD and one MUL remain
  square = lambda: alu(Ops.MUL, load(1, st(10)), load(1, st(10)))  # noqa: E731
  ast = store(alu(Ops.ADD, square(), square()), (10,))
  kernel = kernel_for(ast)
  uops = linearize(kernel)
  assert count(uops, UOps.LOAD) == 1
  assert sorted(uop.arg.name for uop in float_alus(uops)) == ["ADD", "MUL"]
  x = rand(10)
  np.testing.assert_allclose(run(kernel, "CLANG", (10,), x), 2 * x * x, rtol=1e-6)


def test_values_from_a_closed_loop_are_not_reused() -> None:
  build = UOpBuilder()
  zero, four = build.const(0, INDEX_DTYPE), build.const(4, INDEX_DTYPE)
  outer_value = build.alu(Ops.ADD, INDEX_DTYPE, zero, build.const(7, INDEX_DTYPE))   # folds to a constant
  loop = build.add(UOps.RANGE, INDEX_DTYPE, (zero, four), "ridx0")
  in_loop = build.alu(Ops.MUL, INDEX_DTYPE, loop, build.const(3, INDEX_DTYPE))
  assert build.alu(Ops.MUL, INDEX_DTYPE, loop, build.const(3, INDEX_DTYPE)) is in_loop   # CSE inside the loop
  build.end_range(loop)
  # after the loop closes, the same expression is a new UOp (the old one is out of scope in C)
  assert build.alu(Ops.MUL, INDEX_DTYPE, loop, build.const(3, INDEX_DTYPE)) is not in_loop
  assert outer_value.op is UOps.CONST and build.const(7, INDEX_DTYPE) is outer_value   # constants stay shared


def test_values_read_from_an_accumulator_are_not_reused_after_it_changes() -> None:
  # an online softmax's units in one loop body: each reads the running max before updating it
  build = UOpBuilder()
  running = build.add(UOps.DEFINE_ACC, dtypes.float32, (), -math.inf)
  before = build.alu(Ops.NEG, dtypes.float32, running)
  assert build.alu(Ops.NEG, dtypes.float32, running) is before   # unchanged: shared
  build.add(UOps.ACCUMULATE, dtypes.float32, (running, build.const(2.0, dtypes.float32)), Ops.MAX)
  after = build.alu(Ops.NEG, dtypes.float32, running)
  assert after is not before and build.alu(Ops.NEG, dtypes.float32, running) is after


def test_constant_arithmetic_folds_to_one_constant() -> None:
  ast = store(alu(Ops.MUL, alu(Ops.ADD, const(2.0, st(6)), const(3.0, st(6))), const(4.0, st(6))), (6,))
  kernel = kernel_for(ast)
  uops = linearize(kernel)
  assert float_alus(uops) == []
  (write,) = [uop for uop in uops if uop.op is UOps.STORE]
  assert write.srcs[2].op is UOps.CONST and write.srcs[2].arg == 20.0
  np.testing.assert_array_equal(run(kernel, "CLANG", (6,)), np.full(6, 20.0, dtype=np.float32))


def test_identities_fold_away() -> None:
  # x * 1 + (-0.0): no arithmetic left; a contiguous load's address is the loop variable itself (i*1 + 0 folded).
  # -0.0 is the float additive identity: x + (-0.0) is x for every x, -0.0 included
  ast = store(alu(Ops.ADD, alu(Ops.MUL, load(1, st(9)), const(1.0, st(9))), const(-0.0, st(9))), (9,))
  kernel = kernel_for(ast)
  uops = linearize(kernel)
  assert float_alus(uops) == [] and count(uops, UOps.ALU) == 0
  (read,) = [uop for uop in uops if uop.op is UOps.LOAD]
  assert read.srcs[1].op is UOps.RANGE
  x = rand(9)
  np.testing.assert_array_equal(run(kernel, "CLANG", (9,), x), x)


def test_float_plus_positive_zero_is_kept() -> None:
  # x + (+0.0) is not x: (-0.0) + (+0.0) is +0.0 (IEEE, numpy, PyTorch), so the add stays
  ast = store(alu(Ops.ADD, load(1, st(4)), const(0.0, st(4))), (4,))
  kernel = kernel_for(ast)
  assert [uop.arg for uop in float_alus(linearize(kernel))] == [Ops.ADD]
  x = np.array([-0.0, 0.0, -1.5, 2.0], dtype=np.float32)
  out = run(kernel, "CLANG", (4,), x)
  np.testing.assert_array_equal(np.signbit(out), np.signbit(x + np.float32(0.0)))


# ---------------------------------------------------------------- index math

VIEW_CASES = {
  "flip": (lambda base: base.flip((True, False)), lambda x: x[::-1, :]),
  "shrink": (lambda base: base.shrink(((1, 3), (2, 5))), lambda x: x[1:3, 2:5]),
  "permute+flip": (lambda base: base.permute((1, 0)).flip((False, True)), lambda x: x.T[:, ::-1]),
  "reshape of permute": (lambda base: base.permute((1, 0)).reshape((2, 3, 4)), lambda x: x.T.reshape(2, 3, 4)),
  "expand": (lambda base: base.reshape((4, 1, 6)).expand((4, 3, 6)), lambda x: np.broadcast_to(x[:, None], (4, 3, 6))),
  "pad": (lambda base: base.pad(((1, 2), (0, 3))), lambda x: np.pad(x, ((1, 2), (0, 3)))),
  "pad+flip+shrink": (lambda base: base.pad(((2, 1), (1, 1))).flip((True, True)).shrink(((1, 6), (0, 7))),
                      lambda x: np.pad(x, ((2, 1), (1, 1)))[::-1, ::-1][1:6, 0:7]),
}


@pytest.mark.parametrize("case", list(VIEW_CASES))
@pytest.mark.parametrize("device", ["CLANG", "PYTHON"])
def test_view_index_math_matches_numpy(case: str, device: str) -> None:
  make_view, numpy_view = VIEW_CASES[case]
  view = make_view(st(4, 6))
  x = rand(4, 6)
  expected = numpy_view(x)
  assert view.shape == expected.shape
  # `+ 0.5` keeps it a kernel that computes (a bare load would be a copy); padded places read 0, as in numpy
  kernel = kernel_for(store(alu(Ops.ADD, load(1, view), const(0.5, st(*view.shape))), view.shape), device=device)
  np.testing.assert_array_equal(run(kernel, device, view.shape, x), expected + np.float32(0.5))


def test_padded_load_carries_a_validity_condition() -> None:
  view = st(5).pad(((2, 3),))
  uops = linearize(kernel_for(store(alu(Ops.ADD, load(1, view), const(1.0, st(10))), (10,))))
  (read,) = [uop for uop in uops if uop.op is UOps.LOAD]
  assert len(read.srcs) == 3 and read.srcs[2].dtype == dtypes.bool   # buffer, index, valid


def evaluate_index(uops: list[UOp], variable: UOp, value: int) -> dict[int, int]:
  """Every UOp's value with `variable` = value, using C's truncating / and % (what every backend does)."""
  values: dict[int, int] = {id(variable): value}
  for uop in uops:
    if uop.op is UOps.CONST: values[id(uop)] = uop.arg
    elif uop.op is UOps.ALU:
      a, b = (values[id(src)] for src in uop.srcs)
      if uop.arg is Ops.ADD: values[id(uop)] = a + b
      elif uop.arg is Ops.MUL: values[id(uop)] = a * b
      elif uop.arg is Ops.IDIV: values[id(uop)] = int(a / b)
      elif uop.arg is Ops.MOD: values[id(uop)] = int(math.fmod(a, b))
      else: raise AssertionError(f"unexpected {uop.arg} in index math")
  return values


@pytest.mark.parametrize("make_node", [lambda x: x // 3, lambda x: x % 3, lambda x: (x * 2 + 1) // 4,
                                       lambda x: (x + 2) % 5, lambda x: x // 7 * 2 + x % 7],
                         ids=["div", "mod", "affine div", "shifted mod", "div and mod"])
def test_symbolic_floor_division_lowers_correctly_for_negative_numerators(make_node) -> None:
  """Symbolic // and % are floor operations; the backends' integer ops truncate. Over a range that crosses zero the
  lowered UOps must still give Python's floor results."""
  kernel = kernel_for(store(load(1, st(4)), (4,)))
  linearizer = Linearizer(kernel)
  low, high = -11, 9
  variable = linearizer.builder.add(UOps.RANGE, INDEX_DTYPE,
                                    (linearizer.builder.const(low, INDEX_DTYPE),
                                     linearizer.builder.const(high + 1, INDEX_DTYPE)), "x")
  linearizer.loop_vars["x"] = variable
  node: Node = make_node(Variable("x", low, high))
  result = linearizer.node_to_uop(node)
  for value in range(low, high + 1):
    expected = make_node(value)   # the same expression on Python ints: floor semantics
    assert evaluate_index(linearizer.builder.uops, variable, value)[id(result)] == expected, (node, value)
