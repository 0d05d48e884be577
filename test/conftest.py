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
  from ourgrad.codegen.attention import AttentionKernel
  from ourgrad.codegen.attention_grad import AttentionGradKernel
  from ourgrad.codegen.index_accumulate import IndexAccumulateKernel
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.codegen.last_block import SplitReduceKernel
  from ourgrad.codegen.lowering import lower_kernel
  from ourgrad.codegen.packed import PackedKernel
  from ourgrad.codegen.ride_along import RideAlongKernel
  from ourgrad.engine import realize
  from ourgrad.renderer.cuda import CUDARenderer
  from ourgrad.runtime.ops_cuda import CUDACompiler

  renderer, compiler = CUDARenderer("sm_90"), CUDACompiler("sm_90")
  compile_for_device = realize.compile_kernel

  def compile_and_check_cuda(kernel, device):
    if os.environ.get("CHECK_CUDA_RENDER", "") in ("", "0"):  # a test may switch the check off (monkeypatch.delenv)
      return compile_for_device(kernel, device)
    if isinstance(kernel, PackedKernel):   # a packed kernel takes no opts (codegen/packed.py)
      cuda_kernel = PackedKernel(kernel.ast, renderer)
    elif isinstance(kernel, IndexAccumulateKernel):   # sized by its own plan (codegen/index_accumulate.py)
      cuda_kernel = IndexAccumulateKernel(kernel.ast, renderer)
    elif isinstance(kernel, AttentionKernel):   # a whole-kernel plan (codegen/attention.py)
      cuda_kernel = AttentionKernel(kernel.ast, renderer)
    elif isinstance(kernel, AttentionGradKernel):   # its backward's (codegen/attention_grad.py)
      cuda_kernel = AttentionGradKernel(kernel.ast, renderer)
    elif isinstance(kernel, RideAlongKernel):   # a kernel carrying a one-value reduce (codegen/ride_along.py)
      cuda_kernel = RideAlongKernel(kernel.ride_ast, renderer)
      cuda_kernel.hand_coded_optimizations()
    else:
      # a one-kernel split reduce (EMULATE=CUDA) is one for CUDA too, with the same heuristic opts
      one_kernel_split = isinstance(kernel, SplitReduceKernel)
      cuda_kernel = SplitReduceKernel(kernel.split_ast, renderer) if one_kernel_split else Kernel(kernel.ast, renderer)
      # as realize.get_kernel: a symbolic kernel keeps its plain loop nest on every device
      if not realize.ast_is_symbolic(kernel.ast): cuda_kernel.hand_coded_optimizations()
    try:
      source = lower_kernel(cuda_kernel, renderer, realize.function_name(cuda_kernel)).source
    except AssertionError as error:   # a rider that fits the device's block but not CUDA's: check the host alone
      if not isinstance(cuda_kernel, RideAlongKernel) or "does not fit" not in str(error): raise
      host = Kernel(kernel.ast, renderer)
      host.hand_coded_optimizations()
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
