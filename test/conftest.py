"""Test-session hooks.

CHECK_CUDA_RENDER=1: every kernel the tests compile (on whatever device they run) is also optimized for CUDA,
rendered as CUDA C++ and compiled with NVRTC for sm_90 (an H100: large float16/bfloat16 matmuls become the wgmma
kernel, compiled for sm_90a). NVRTC needs no GPU, so CI catches CUDA rendering bugs on a
machine without one. A kernel NVRTC rejects fails the test that generated it, with the source and compiler log.
"""
import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _check_cuda_rendering():
  if os.environ.get("CHECK_CUDA_RENDER", "") in ("", "0"):
    yield
    return
  from ourgrad.codegen.lowering import build_kernel, lower_kernel
  from ourgrad.engine import realize
  from ourgrad.ops import Ops
  from ourgrad.renderer.cuda import CUDARenderer
  from ourgrad.runtime.ops_cuda import CUDACompiler

  renderer, compiler = CUDARenderer("sm_90"), CUDACompiler("sm_90")
  compile_for_device = realize.compile_kernel

  def compile_and_check_cuda(kernel, device):
    if os.environ.get("CHECK_CUDA_RENDER", "") in ("", "0"):  # a test may switch the check off (monkeypatch.delenv)
      return compile_for_device(kernel, device)
    # the same kind of kernel with the same default opts, built for CUDA (a one-kernel split reduce, EMULATE=CUDA, is
    # one for CUDA too; a kernel carrying a one-value reduce, codegen/ride_along.py, is built from its whole AST)
    ast = getattr(kernel, "split_ast", None) or getattr(kernel, "ride_ast", None) or kernel.ast
    cuda_kernel = build_kernel(ast, renderer)
    try:
      source = lower_kernel(cuda_kernel, renderer, realize.function_name(cuda_kernel)).source
    except AssertionError as error:   # a rider that fits the device's block but not CUDA's: check the host alone
      if ast.op is not Ops.RIDE_ALONG or "does not fit" not in str(error): raise
      host = build_kernel(kernel.ast, renderer)
      source = lower_kernel(host, renderer, realize.function_name(host)).source
    compiler.compile_cached(source)
    return compile_for_device(kernel, device)

  realize.compile_kernel = compile_and_check_cuda
  yield
  realize.compile_kernel = compile_for_device


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
