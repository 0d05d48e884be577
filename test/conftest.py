"""Test-session hooks.

CHECK_CUDA_RENDER=1: every kernel the tests compile (on whatever device they run) is also optimized for CUDA,
rendered as CUDA C++ and compiled with NVRTC for sm_90 (an H100: large float16/bfloat16 matmuls become the wgmma
kernel, compiled for sm_90a). NVRTC needs no GPU, so CI catches CUDA rendering bugs on a machine without one. The
kernels a test builds are compiled together at its teardown, few NVRTC programs instead of one each
(runtime/nvrtc_check.py: most of a small kernel's compile is each program's fixed cost); a kernel NVRTC rejects fails
that test at teardown, named, with its source and compiler log. CHECK_CUDA_RENDER=file compiles a whole test file's
kernels together at its end (fewer, larger programs): a rejected kernel then fails the file's last test, the message
naming the test that built it.
"""
import pytest

from cuda_render_check import _check_cuda_mode, _current_test, cuda_checking_compile


@pytest.fixture(autouse=True, scope="session")
def _check_cuda_rendering():
  if not _check_cuda_mode():
    yield None
    return
  from ourgrad.engine import realize
  from ourgrad.renderer.cuda import CUDARenderer
  from ourgrad.runtime.nvrtc_check import NvrtcCheck
  from ourgrad.runtime.ops_cuda import CUDACompiler

  nvrtc_check = NvrtcCheck(CUDACompiler("sm_90"))
  compile_for_device = realize.compile_kernel
  realize.compile_kernel = cuda_checking_compile(compile_for_device, CUDARenderer("sm_90"), nvrtc_check)
  yield nvrtc_check
  realize.compile_kernel = compile_for_device
  nvrtc_check.flush()   # what module and session fixtures built after the last test's teardown


@pytest.fixture(autouse=True, scope="module")
def _check_cuda_kernels_of_this_file(_check_cuda_rendering, request):
  """With CHECK_CUDA_RENDER=file: the CUDA kernels this test file built, compiled together by NVRTC at its end."""
  _current_test[0] = request.node.nodeid   # what the file's module-scoped fixtures build is the file's
  yield
  if _check_cuda_rendering is not None and _check_cuda_mode() == "file": _check_cuda_rendering.flush()


@pytest.fixture(autouse=True)
def _check_cuda_kernels_of_this_test(_check_cuda_rendering, _check_cuda_kernels_of_this_file, request):
  """With CHECK_CUDA_RENDER=1: the CUDA kernels this test built, compiled together by NVRTC when it ends (autouse:
  set up first, so torn down after the test's other fixtures, whose teardowns may build kernels too)."""
  _current_test[0] = request.node.nodeid
  yield
  if _check_cuda_rendering is not None and _check_cuda_mode() == "test": _check_cuda_rendering.flush()


@pytest.fixture
def compiles(monkeypatch):
  """A list that gets one entry (the kernel name) per kernel compiled, not taken from the in-memory cache."""
  from ourgrad.engine import realize
  names: list[str] = []
  original = realize.compile_kernel
  realize._runner_cache.clear()  # count every kernel this test needs, whatever ran before in this process

  def counting(kernel, device):
    names.append(kernel.name)
    return original(kernel, device)

  monkeypatch.setattr(realize, "compile_kernel", counting)
  return names


@pytest.fixture
def small_split(monkeypatch):
  """GPU split reduces scaled down (helpers.small_split_reduces), so small shapes (fast on the PYTHON interpreter)
  are split as a large reduce would be on a GPU."""
  from helpers import small_split_reduces
  small_split_reduces(monkeypatch)
