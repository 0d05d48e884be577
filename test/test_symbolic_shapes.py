"""Symbolic shapes: a bound Variable as a size changes the shape without recompiling (docs/jit.md).

Every result is checked against numpy on the same data; compiles are counted by wrapping the engine's
compile_kernel, so "compiles once" is a count, not a timing."""
import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.uops import UOps
from ourgrad.engine import realize
from ourgrad.engine.schedule import create_schedule
from ourgrad.errors import ShapeError
from ourgrad.renderer.cstyle import OpenCLRenderer
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.renderer.llvmir import LLVMRenderer
from ourgrad.shape import ShapeTracker, Variable
from helpers import skip_unless_device


@pytest.fixture(autouse=True)
def _no_cuda_render_check(monkeypatch):
  """CHECK_CUDA_RENDER (test/conftest.py) applies the hand-coded optimizations, which symbolic kernels skip; their
  CUDA rendering is checked here by test_symbolic_shapes.py::test_cuda_source_compiles_with_nvrtc instead."""
  monkeypatch.delenv("CHECK_CUDA_RENDER", raising=False)



def _data(*shape: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------- Variable and views

def test_bind_unbind():
  n = Variable("n", 1, 1024)
  bound = n.bind(37)
  assert bound.val == 37 and n.val is None
  assert bound.unbind() == (n, 37)
  assert bound != n and bound != n.bind(38) and bound == n.bind(37)
  with pytest.raises(ValueError): n.bind(0)
  with pytest.raises(ValueError): n.bind(1025)
  with pytest.raises(TypeError): n.bind(3.0)
  with pytest.raises(ValueError): n.unbind()


def test_shapetracker_unbind_and_var_vals():
  n = Variable("n", 1, 64)
  st = ShapeTracker.from_shape((64, 8)).shrink(((0, n.bind(5)), (0, 8)))
  assert st.symbolic and st.var_vals() == {"n": 5}
  unbound, values = st.unbind()
  assert values == {"n": 5} and unbound.var_vals() == {} and unbound.shape == (n, 8)
  # the same window at another value unbinds to the same tracker: one kernel for every value
  assert ShapeTracker.from_shape((64, 8)).shrink(((0, n.bind(9)), (0, 8))).unbind()[0] == unbound
  assert st.real_size() == 64 * 8  # an allocation bound: the largest value


def test_shrink_outside_buffer_raises():
  x = Tensor(_data(16, 4))
  with pytest.raises(ShapeError): x.shrink(((0, Variable("n", 1, 64).bind(20)), None))


# ---------------------------------------------------------------- one kernel for every value

def test_elementwise_over_n_compiles_once(compiles):
  data = _data(64, 8)
  x = Tensor(data)
  n = Variable("n", 1, 64)
  for value in range(1, 51):
    out = (x.shrink(((0, n.bind(value)), None)) * 2 + 1).numpy()
    np.testing.assert_allclose(out, data[:value] * 2 + 1, rtol=1e-6)
  assert len(compiles) == 1, compiles


def test_symbolic_reduce_compiles_once(compiles):
  data = _data(48, 8, seed=1)
  x = Tensor(data)
  n = Variable("n", 1, 48)
  for value in (1, 7, 30, 48):
    window = x.shrink(((0, n.bind(value)), None))
    np.testing.assert_allclose(window.sum(0).numpy(), data[:value].sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(window.max(0).numpy(), data[:value].max(0))
    np.testing.assert_allclose(window.sum(1).numpy(), data[:value].sum(1), rtol=1e-5, atol=1e-5)
  assert len(compiles) == 3, compiles  # sum over n, max over n, sum with n as an output dim


def test_ones_of_symbolic_shape(compiles):
  n = Variable("n", 1, 64)
  for value in (3, 11):
    ones = Tensor.ones(n.bind(value), 8)
    assert ones.shape == (n.bind(value), 8)
    np.testing.assert_allclose((ones * 3).sum(0).numpy(), np.full(8, 3.0 * value))
    np.testing.assert_allclose((Tensor.ones(8, n.bind(value)) + 1).numpy(), np.full((8, value), 2.0))
  assert len(compiles) == 2, compiles


def test_symbolic_inner_dim_and_matmul():
  data = _data(8, 40, seed=2)
  x = Tensor(data)
  n = Variable("n", 1, 40)
  for value in (1, 13):
    window = x.shrink((None, (0, n.bind(value))))
    np.testing.assert_allclose(window.numpy(), data[:, :value])
    np.testing.assert_allclose((window @ window.T).numpy(), data[:, :value] @ data[:, :value].T, rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(window.softmax(-1).numpy(),
                               np.exp(data[:, :value]) / np.exp(data[:, :value]).sum(-1, keepdims=True), rtol=1e-5)


def test_kv_cache_row_and_prefix(compiles):
  data = _data(32, 4, seed=3)
  cache = Tensor(data)
  pos = Variable("pos", 0, 31)
  for value in (0, 5, 31):
    bound = pos.bind(value)
    np.testing.assert_allclose(cache.shrink(((bound, bound + 1), None)).numpy(), data[value:value + 1])
    np.testing.assert_allclose((cache.shrink(((0, bound + 1), None)) * 1).sum(0).numpy(), data[:value + 1].sum(0),
                               rtol=1e-5, atol=1e-5)
  assert len(compiles) == 2, compiles


def test_pad_back_to_fixed_size():
  data = _data(16, 3, seed=4)
  n = Variable("n", 1, 16).bind(6)
  padded = Tensor(data).shrink(((0, n), None)).pad(((0, 16 - n), None))
  assert padded.shape == (16, 3)
  np.testing.assert_allclose(padded.numpy(), np.pad(data[:6], ((0, 10), (0, 0))))


def test_mean_over_symbolic_axis():
  data = _data(20, 5, seed=5)
  n = Variable("n", 1, 20).bind(7)
  np.testing.assert_allclose(Tensor(data).shrink(((0, n), None)).mean(0).numpy(), data[:7].mean(0), rtol=1e-5)


@pytest.mark.parametrize("device", ["PYTHON", "LLVM"])
def test_other_devices(device):
  skip_unless_device(device)
  data = _data(24, 4, seed=6)
  x = Tensor(data, device=device)
  n = Variable("n", 1, 24)
  for value in (2, 17):
    window = x.shrink(((0, n.bind(value)), None))
    np.testing.assert_allclose((window + 1).sum(0).numpy(), (data[:value] + 1).sum(0), rtol=1e-5)
    np.testing.assert_allclose((window * 2).numpy(), data[:value] * 2)


# ---------------------------------------------------------------- DEFINE_VAR in every renderer

def _symbolic_kernel_uops(renderer):
  n = Variable("n", 1, 64)
  x = Tensor(_data(64, 8)).realize()
  out = (x.shrink(((0, n.bind(4)), None)) * 2).sum(0)
  schedule = create_schedule([out.lazydata])
  ast, var_vals = realize.unbind_ast(schedule[-1].ast)
  assert var_vals == {"n": 4}
  uops = linearize(Kernel(ast, renderer))
  return uops


@pytest.mark.parametrize("renderer", [CUDARenderer(), OpenCLRenderer(), LLVMRenderer()], ids=lambda r: type(r).__name__)
def test_define_var_is_an_int_parameter(renderer):
  uops = _symbolic_kernel_uops(renderer)
  define_vars = [uop for uop in uops if uop.op is UOps.DEFINE_VAR]
  assert [uop.arg for uop in define_vars] == [("n", 1, 64)]
  source = renderer.render("r_8_n", uops)
  header = source[source.index("r_8_n"):].split("{")[0]
  assert ("i32 %var_n" if isinstance(renderer, LLVMRenderer) else "const int n") in header


def test_cuda_source_compiles_with_nvrtc():
  try:
    from ourgrad.runtime.ops_cuda import CUDACompiler
    compiler = CUDACompiler("sm_90")
  except Exception as error:  # no cuda-python / NVRTC here
    pytest.skip(f"NVRTC is not available: {error}")
  renderer = CUDARenderer()
  compiler.compile_cached(renderer.render("r_8_n", _symbolic_kernel_uops(renderer)))


def test_symbolic_value_read_by_several_kernels():
  """An elementwise value of symbolic shape read by two kernels (a sum over rows, a sum over columns): the
  scheduler's store-or-recompute rule has no byte count to compare there and leaves it fused (it raised TypeError
  comparing symbolic sizes, found on an H200 by bench_jit's decode)."""
  data, other = _data(4096, 64, seed=2), _data(4096, 64, seed=3)
  x, y = Tensor(data), Tensor(other)
  n = Variable("n", 1, 4096)
  for value in (100, 4000):
    shared = x.shrink(((0, n.bind(value)), None)) * y.shrink(((0, n.bind(value)), None)) + x.shrink(
      ((0, n.bind(value)), None))
    rows, columns = shared.sum(1), shared.sum(0)
    Tensor.realize_all(rows, columns)
    expected = data[:value] * other[:value] + data[:value]
    np.testing.assert_allclose(rows.numpy(), expected.sum(1), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(columns.numpy(), expected.sum(0), rtol=1e-4, atol=1e-3)
