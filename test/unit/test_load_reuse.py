"""Load reuse (UOpBuilder): a scalar load of an element that a vector (float4) load in scope already read becomes a
GEP of that vector instead of a second load. Checked on the builder directly (which loads qualify, scopes), on a
sliding-window kernel built by hand (an upcast filter row over an unrolled, contiguous input row: the shape of a
convolution's weight gradient) against numpy on the PYTHON device, and on MNIST's conv2 weight gradient as the CUDA
renderer lowers it (each input element loaded once).
"""
from __future__ import annotations

import numpy as np
import pytest

from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.codegen.linearizer import INDEX_DTYPE, linearize
from ourgrad.codegen.uops import UOp, UOpBuilder, UOps
from ourgrad.dtype import dtypes
from ourgrad.ops import LazyOp, MemBuffer, Ops
from ourgrad.runtime.ops_python import PythonRenderer
from ourgrad.shape.shapetracker import ShapeTracker
from ourgrad.shape.view import View

F32 = dtypes.float32


def _buffers(build: UOpBuilder) -> tuple[UOp, UOp]:
  return (build.add(UOps.DEFINE_GLOBAL, F32, (), (1, False)), build.add(UOps.DEFINE_GLOBAL, F32, (), (2, False)))


def _index(build: UOpBuilder, base: UOp, offset: int) -> UOp:
  return build.alu(Ops.ADD, INDEX_DTYPE, base, build.const(offset, INDEX_DTYPE))


def test_scalar_loads_inside_a_vector_become_its_elements() -> None:
  build = UOpBuilder()
  data, other = _buffers(build)
  base = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("gidx0", 8, 0, None))
  first = build.add(UOps.LOAD, F32, (data, _index(build, base, 4)), 4)   # elements base+4 .. base+7
  for offset in (4, 5, 7):
    lane = build.add(UOps.LOAD, F32, (data, _index(build, base, offset)))
    assert lane.op is UOps.GEP and lane.srcs == (first,) and lane.arg == offset - 4
  # outside the vector, another buffer, or a load that may read 0 (a validity source): loaded
  assert build.add(UOps.LOAD, F32, (data, _index(build, base, 8))).op is UOps.LOAD
  assert build.add(UOps.LOAD, F32, (data, _index(build, base, 3))).op is UOps.LOAD
  assert build.add(UOps.LOAD, F32, (other, _index(build, base, 5))).op is UOps.LOAD
  valid = build.alu(Ops.CMPLT, dtypes.bool, base, build.const(4, INDEX_DTYPE))
  assert build.add(UOps.LOAD, F32, (data, _index(build, base, 5), valid)).op is UOps.LOAD
  # the indices computed for the loads that became elements are taken back: every ALU left is read
  assert all(uop.uses for uop in build.uops if uop.op is UOps.ALU)


def test_a_vector_at_the_bare_base_and_at_a_constant_index_serve_scalar_loads() -> None:
  build = UOpBuilder()
  data, _ = _buffers(build)
  base = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("gidx0", 8, 0, None))
  at_base = build.add(UOps.LOAD, F32, (data, base), 4)
  assert build.add(UOps.LOAD, F32, (data, _index(build, base, 3))).srcs == (at_base,)
  at_eight = build.add(UOps.LOAD, F32, (data, build.const(8, INDEX_DTYPE)), 4)
  lane = build.add(UOps.LOAD, F32, (data, build.const(10, INDEX_DTYPE)))
  assert lane.op is UOps.GEP and lane.srcs == (at_eight,) and lane.arg == 2


def test_a_vector_from_a_closed_loop_is_not_reused() -> None:
  build = UOpBuilder()
  data, _ = _buffers(build)
  zero, four = build.const(0, INDEX_DTYPE), build.const(4, INDEX_DTYPE)
  loop = build.add(UOps.RANGE, INDEX_DTYPE, (zero, four), ("ridx0", None))
  base = build.alu(Ops.MUL, INDEX_DTYPE, loop, build.const(16, INDEX_DTYPE))
  build.add(UOps.LOAD, F32, (data, base), 4)
  assert build.add(UOps.LOAD, F32, (data, _index(build, base, 1))).op is UOps.GEP
  build.end_range(loop)
  assert build.add(UOps.LOAD, F32, (data, _index(build, base, 1))).op is UOps.LOAD


def test_local_memory_and_half_loads_are_not_reused() -> None:
  """Local memory changes between barriers; a 16-bit pair is a tensor-core fragment's raw bits."""
  build = UOpBuilder()
  local = build.add(UOps.DEFINE_LOCAL, F32, (), ("temp0", 64))
  base = build.add(UOps.SPECIAL, INDEX_DTYPE, (), ("lidx0", 8, 0, None))
  build.add(UOps.LOAD, F32, (local, base), 4)
  assert build.add(UOps.LOAD, F32, (local, _index(build, base, 1))).op is UOps.LOAD
  halves = build.add(UOps.DEFINE_GLOBAL, dtypes.float16, (), (1, False))
  build.add(UOps.LOAD, dtypes.float16, (halves, base), 2)
  assert build.add(UOps.LOAD, dtypes.float16, (halves, _index(build, base, 1))).op is UOps.LOAD


# ---------------------------------------------------------------- a sliding window: out[r, k] = sum_j x[r, k + j] w[j]

ROWS, TAPS, WIDTH = 4, 5, 8   # a row of TAPS outputs reads TAPS + WIDTH - 1 = 12 neighbouring inputs


def _window_ast() -> LazyOp:
  row = TAPS + WIDTH - 1
  window = ShapeTracker((View.create((ROWS, TAPS, WIDTH), (row, 1, 1)),))
  weights = ShapeTracker((View.create((ROWS, TAPS, WIDTH), (0, 0, 1)),))
  product = LazyOp(Ops.MUL, (LazyOp(Ops.LOAD, (), MemBuffer(1, F32, window), F32),
                             LazyOp(Ops.LOAD, (), MemBuffer(2, F32, weights), F32)), None, F32)
  total = LazyOp(Ops.SUM, (product,), (2,), F32)
  out = ShapeTracker.from_shape((ROWS, TAPS, 1))
  return LazyOp(Ops.STORE, (total,), MemBuffer(0, F32, out), F32)


def _window_kernel() -> Kernel:
  kernel = Kernel(_window_ast(), PythonRenderer("CUDA"))
  for opt in (Opt(OptOps.UPCAST, 1, TAPS), Opt(OptOps.UNROLL, 0, WIDTH)): kernel.apply_opt(opt)
  return kernel


def test_sliding_window_loads_each_input_once() -> None:
  """The row's 12 inputs are 3 float4 loads (aligned at 0, 4, 8) and the 8 weights 2; the 5 x 8 products read
  every other element from those vectors (10 scalar loads before load reuse)."""
  uops = linearize(_window_kernel())
  loads = [uop for uop in uops if uop.op is UOps.LOAD]
  assert sorted(uop.arg for uop in loads) == [4] * 5
  assert sum(1 for uop in uops if uop.op is UOps.GEP) == TAPS + WIDTH - 1 + WIDTH


def test_sliding_window_matches_numpy_on_the_emulated_gpu() -> None:
  from ourgrad.device import Buffer
  from ourgrad.engine.realize import compile_kernel
  rng = np.random.default_rng(3)
  x = rng.standard_normal((ROWS, TAPS + WIDTH - 1)).astype(np.float32)
  w = rng.standard_normal(WIDTH).astype(np.float32)
  buffers = [Buffer("PYTHON", size, F32).allocate() for size in (ROWS * TAPS, x.size, w.size)]
  buffers[1].copyin(memoryview(x.reshape(-1)).cast("B"))
  buffers[2].copyin(memoryview(w).cast("B"))
  compile_kernel(_window_kernel(), "PYTHON")(buffers)
  expected = np.stack([np.correlate(row, w, mode="valid") for row in x])
  np.testing.assert_allclose(buffers[0].numpy().reshape(ROWS, TAPS), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", [0, 1], ids=["conv1", "conv2"])
def test_mnist_weight_gradients_load_each_address_once(which: int) -> None:
  """MNIST's weight-gradient partials (batch 256) as the CUDA renderer gets them: no two loads of one reduce step
  read the same element (conv2's input row: 3 float4 loads and no scalar ones; 21 loads before load reuse)."""
  import sys
  from pathlib import Path
  sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
  from test_weight_gradient_tiles import _mnist_partials_asts
  from ourgrad.renderer.cuda import CUDARenderer
  kernel = Kernel(_mnist_partials_asts()[which], CUDARenderer("sm_90"))
  kernel.hand_coded_optimizations()
  uops = linearize(kernel)
  addresses = []
  for uop in uops:
    if uop.op is not UOps.LOAD or uop.srcs[0].op is not UOps.DEFINE_GLOBAL: continue
    index = uop.srcs[1]
    base, offset = (index.srcs[0], index.srcs[1].arg) if index.op is UOps.ALU and index.srcs[1].op is UOps.CONST \
        else (index, 0)
    addresses += [(id(uop.srcs[0]), id(base), offset + element) for element in range(uop.arg or 1)]
  assert len(addresses) == len(set(addresses))
  if which == 1: assert sum(1 for uop in uops if uop.op is UOps.LOAD and uop.arg is None) == 0
