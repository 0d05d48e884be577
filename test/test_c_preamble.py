"""The C kernels' preamble (renderer/cpu_loops.py C_PREAMBLE): the C library functions a kernel calls are declared there
instead of including math.h (a fifth of a small kernel's gcc time), and a call of one not declared fails the build
(-Werror=implicit-function-declaration) instead of going through an implicit `int f()` declaration."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ourgrad import Device, Tensor, dtypes
from ourgrad.errors import CompileError
from ourgrad.renderer.cpu_loops import C_MATH_FUNCTIONS, C_PREAMBLE


def test_preamble_declares_each_math_function_without_math_h():
  assert "#include <math.h>" not in C_PREAMBLE
  for name in C_MATH_FUNCTIONS:
    assert f"float {name}f(float);" in C_PREAMBLE and f"double {name}(double);" in C_PREAMBLE


@pytest.mark.parametrize("dtype", [dtypes.float32, dtypes.float64], ids=str)
def test_every_math_op_and_non_finite_constant_compiles_and_matches_numpy(dtype):
  """exp2, log2, sin and sqrt of both C float types and the INFINITY / NAN constants, in one CLANG kernel."""
  values = np.array([0.25, 1.0, 2.0, 9.0], dtype=dtype.np)
  x = Tensor(values, device="CLANG")
  out = x.exp2() + x.log2() + x.sin() + x.sqrt() + x.maximum(-math.inf)
  nan_out = (x * 0).where(math.nan, x).maximum(math.inf)   # (x*0) is 0: the NAN constant is never taken
  expected = np.exp2(values) + np.log2(values) + np.sin(values) + np.sqrt(values) + values
  np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6)
  np.testing.assert_array_equal(nan_out.numpy(), np.full(4, np.inf, dtype=dtype.np))


def test_an_undeclared_c_library_call_is_a_compile_error():
  source = C_PREAMBLE + "void k(float* restrict data0) { data0[0] = cbrtf(data0[0]); }\n"
  with pytest.raises(CompileError, match="implicit"):
    Device["CLANG"].compiler.compile(source)
