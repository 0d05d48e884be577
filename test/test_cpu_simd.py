"""Elementwise kernels on the CPU (CLANG) run their innermost loop as an `omp simd` loop (renderer/cvector.py's
elementwise_simd_loop; `parallel for simd` where it is the only loop): checked against numpy on broadcasts, odd sizes
whose tails do not divide the SIMD width, NaN and infinities in max and select, and the kernels kept scalar (flipped
and padded views) still right."""
from __future__ import annotations

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.device import Device
from ourgrad.engine.schedule import create_schedule
from ourgrad.ops import Ops

DEVICE = "CLANG"


def _source(tensor: Tensor) -> str:
  """The C source of the last kernel computing `tensor`, with the default opts (consumes the graph)."""
  item = [item for item in create_schedule([tensor.lazydata]) if item.ast.op is not Ops.COPY][-1]
  kernel = Kernel(item.ast, Device[DEVICE].renderer)
  kernel.hand_coded_optimizations()
  return Device[DEVICE].renderer.render("k", linearize(kernel))


def _values(shape: tuple[int, ...], seed: int) -> np.ndarray:
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  flat = x.reshape(-1)
  flat[::13] = 0.0
  flat[3 % flat.size], flat[7 % flat.size], flat[11 % flat.size] = np.nan, np.inf, -np.inf
  return x


def _expression(x, y, z, maximum, where):
  """The same expression on Tensors or numpy arrays: broadcasts of a row, a column and a scalar, max, select."""
  return where(x > y, maximum(x, z) * 2.0 - y, (x + 1.5) * z) + maximum(y, 0.0)


@pytest.mark.parametrize("shape", [(37, 19), (8, 64), (3, 5, 7), (1001,), (2, 3, 33, 17)])
def test_elementwise_simd_matches_numpy(shape: tuple[int, ...]):
  x, y = _values(shape, 1), _values(shape[-1:], 2)                 # y: a row broadcast over the leading axes
  z = _values(shape[:-1] + (1,), 3) if len(shape) > 1 else _values((1,), 3)   # z: a column (or scalar) broadcast

  def ours(x_t: Tensor, y_t: Tensor, z_t: Tensor) -> Tensor:
    return _expression(x_t, y_t, z_t, lambda a, b: a.maximum(b), lambda c, a, b: c.where(a, b))
  tensors = [Tensor(value, device=DEVICE) for value in (x, y, z)]
  source = _source(ours(*[Tensor.empty(*value.shape, device=DEVICE) for value in (x, y, z)]))
  loops = source.count("for (int")
  assert ("#pragma omp simd" in source) != ("#pragma omp parallel for simd" in source)
  assert "#pragma omp parallel for simd" not in source or loops == 1, "the shared pragma only on a single loop"
  assert "fmax_nan(" not in source and "fsel(" not in source, "plain selects: gcc vectorizes them as masks"
  with np.errstate(invalid="ignore"):
    expected = _expression(x, y, z, lambda a, b: np.where(np.isnan(a) | (a > b), a, b), np.where)
  np.testing.assert_allclose(ours(*tensors).numpy(), expected.astype(np.float32), rtol=1e-6, atol=1e-6)


def test_large_single_loop_kernel_shares_parallel_and_simd():
  x = np.random.default_rng(4).standard_normal(1 << 20).astype(np.float32)
  source = _source(Tensor.empty(1 << 20, device=DEVICE) * 3 + 1)
  assert "#pragma omp parallel for simd\n" in source
  # gcc contracts x * 3 + 1 into one fused multiply-add, as it did in the scalar loop: a last-bit difference
  np.testing.assert_allclose((Tensor(x, device=DEVICE) * 3 + 1).numpy(), x * 3 + 1, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["flip", "pad", "int"])
def test_kernels_kept_scalar_are_right(case: str):
  """A flipped view (gcc 12's loop vectorizer miscompiles some), a padded one (negative index constants) and an
  integer kernel (wrapping arithmetic) get no `omp simd` loop; their results are numpy's."""
  x = np.random.default_rng(5).standard_normal((6, 35)).astype(np.float32)
  if case == "flip":
    make, expected = (lambda t: t.flip(-1) * 2 + 1), x[:, ::-1] * 2 + 1
  elif case == "pad":
    make, expected = (lambda t: t.pad(((1, 2), (3, 0))) + 1), np.pad(x, ((1, 2), (3, 0))) + 1
  else:
    x = (x * 100).astype(np.int32)
    make, expected = (lambda t: t * 3 + 7), x * 3 + 7
  assert "simd" not in _source(make(Tensor.empty(*x.shape, dtype=Tensor(x[:1, :1]).dtype, device=DEVICE)))
  np.testing.assert_allclose(make(Tensor(x, device=DEVICE)).numpy(), expected, rtol=1e-6)


def test_render_leaves_no_state_on_the_device_renderer():
  """Each render's loop/select choices live on a copy: rendering a row kernel (plain `?:`, lane loops) in between
  does not change the source of an elementwise kernel, and the device's renderer keeps its class defaults."""
  renderer = Device[DEVICE].renderer
  if not hasattr(renderer, "scalar_selects"): pytest.skip("not a C renderer")
  elementwise = lambda: Tensor(_values((33, 17), 1), device=DEVICE).maximum(0.5) * 2   # noqa: E731
  first = _source(elementwise())
  _source(Tensor(_values((64, 257), 2), device=DEVICE).softmax(-1))
  assert _source(elementwise()) == first
  assert "scalar_selects" not in vars(renderer) and "simd_loop" not in vars(renderer)
