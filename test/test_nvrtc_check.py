"""CHECK_CUDA_RENDER's NVRTC check (runtime/nvrtc_check.py, wired in by test/conftest.py): a test's CUDA kernels are
compiled together at its teardown, few NVRTC programs for many kernels, and a kernel NVRTC rejects is still named,
with its source and compiler log, among kernels that compile. Needs NVRTC (no GPU); each NVRTC program costs
~50-100 ms of CPU, so the tests count programs instead of timing them."""
import numpy as np
import pytest
from helpers import nvrtc_compiler

from ourgrad import Tensor
from ourgrad.errors import CompileError
from ourgrad.renderer.cuda import DYNAMIC_SHARED_SYMBOL, CUDARenderer
from ourgrad.runtime.nvrtc_check import FAST_COMPILE, FAST_COMPILE_SINCE, NvrtcCheck
from ourgrad.runtime.ops_cuda import SM_90A_ONLY, CUDACompiler

# two kernels of one name, each defining the dynamic shared memory symbol (C linkage: one program cannot hold both
# unless the check drops it), a macro, then a kernel whose local variable has that macro's name
SAME_NAME_1 = (f'extern "C" __device__ unsigned int {DYNAMIC_SHARED_SYMBOL} = 0;\n'
               'extern "C" __global__ void E_4(float* __restrict__ data0) { data0[threadIdx.x] = 1.0f; }\n')
SAME_NAME_2 = (f'extern "C" __device__ unsigned int {DYNAMIC_SHARED_SYMBOL} = 16;\n'
               'extern "C" __global__ void E_4(int* __restrict__ data0) { data0[threadIdx.x] = 2; }\n')
WITH_MACRO = '#define SCALE 2.0f\nextern "C" __global__ void r_4(float* data0) { data0[0] = SCALE; }\n'
MACRO_NAME_AS_VARIABLE = 'extern "C" __global__ void r_5(float* data0) { float SCALE = 3.0f; data0[0] = SCALE; }\n'
GOOD = [SAME_NAME_1, SAME_NAME_2, WITH_MACRO, MACRO_NAME_AS_VARIABLE]
# C++ that parses: only ptxas, which a PTX-only compile never runs, rejects its inline PTX
BAD_PTX = 'extern "C" __global__ void E_bad(float* data0) { asm volatile("not.an.instruction;"); data0[0] = 0.0f; }\n'

# C++ that compiles to PTX: only ptxas's layout of the kernel finds its 80 KB of static shared memory (48 KB at most)
TOO_MUCH_SHARED = ('extern "C" __global__ void r_big(float* data0) { __shared__ float tile[20480]; '
                   'tile[threadIdx.x] = data0[threadIdx.x]; __syncthreads(); '
                   'data0[threadIdx.x] = tile[20479 - threadIdx.x]; }\n')


@pytest.fixture
def compiler(monkeypatch, tmp_path):
  """An sm_90 NVRTC compiler with a disk cache of this test's own (the check's marks live there)."""
  monkeypatch.setenv("OURGRAD_CACHE_DIR", str(tmp_path))
  found = nvrtc_compiler()
  if found is None: pytest.skip("cuda-python's NVRTC does not load here")
  return found


def test_kernels_compile_together_in_one_program(compiler):
  check = NvrtcCheck(compiler)
  for index, source in enumerate(GOOD): check.add(f"k{index}", source)
  check.add("k0 again", SAME_NAME_1)   # a source built twice is compiled once
  assert len(check.pending()) == len(GOOD)
  check.flush()
  assert check.programs == 1 and check.pending() == []


def test_the_rejected_kernel_is_named_with_its_source_and_log(compiler):
  check = NvrtcCheck(compiler)
  for index, source in enumerate(GOOD[:2]): check.add(f"good{index}", source)
  check.add("E_bad", BAD_PTX, made_by="test_that_built_it")
  with pytest.raises(CompileError) as failure:
    check.flush()
  message = str(failure.value)
  assert "NVRTC rejects 1 CUDA kernel(s): E_bad (built by test_that_built_it)" in message
  assert "not.an.instruction" in message and "ptxas" in message   # the source and ptxas's log
  assert "good0" not in message and "good1" not in message
  assert check.programs == 1 + 3   # the combined program failed, then each kernel alone

  # the kernels that compiled are marked in the disk cache (another process skips them); the rejected one is not
  other = NvrtcCheck(compiler)
  for index, source in enumerate(GOOD[:2]): other.add(f"good{index}", source)
  other.flush()
  assert other.programs == 0
  other.add("E_bad", BAD_PTX)
  with pytest.raises(CompileError, match="E_bad"):
    other.flush()


def test_sm_90a_kernels_get_a_program_of_their_own(compiler):
  check = NvrtcCheck(compiler)
  check.add("plain", MACRO_NAME_AS_VARIABLE)
  check.add("marked", f"// {SM_90A_ONLY} (the marker alone picks sm_90a)\n{WITH_MACRO}")
  check.flush()
  assert check.programs == 2


class BrokenCUDARenderer(CUDARenderer):
  """CUDA C++ with an undeclared identifier at the start of the kernel's body."""

  def render(self, name: str, uops: list) -> str:
    source = super().render(name, uops)
    body = source.index("{\n", source.index('extern "C" __global__')) + 2
    return source[:body] + "  not_declared_anywhere = 1;\n" + source[body:]


def test_a_broken_cuda_rendering_fails_naming_the_kernel(compiler, monkeypatch):
  """The conftest hook with a renderer that emits bad CUDA: the test's own result is right (CLANG computes it), and
  the check's flush at teardown names the kernel, with the bad line and NVRTC's complaint."""
  from cuda_render_check import cuda_checking_compile

  from ourgrad.engine import realize
  check = NvrtcCheck(compiler)
  monkeypatch.setenv("CHECK_CUDA_RENDER", "1")
  monkeypatch.setattr(realize, "compile_kernel",
                      cuda_checking_compile(realize.compile_kernel, BrokenCUDARenderer("sm_90"), check))
  values = np.arange(37, dtype=np.float32)
  realize._runner_cache.clear()   # compile the kernel here, whatever an earlier test left in the cache
  np.testing.assert_allclose((Tensor(values) * 3 + 1).numpy(), values * 3 + 1)
  names = [kernel.name for kernel in check.pending()]
  assert len(names) == 1
  with pytest.raises(CompileError) as failure:
    check.flush()
  message = str(failure.value)
  assert f"CUDA kernel(s): {names[0]}" in message
  assert "not_declared_anywhere = 1;" in message and "is undefined" in message


def test_fast_compile_programs_still_run_ptxas(compiler, monkeypatch):
  """The combined program is compiled with FAST_COMPILE (little optimization: the check keeps only the verdict), and
  ptxas's checks still reject: inline PTX it cannot assemble, static shared memory over the limit. The culprits are
  then compiled alone with the device's own options."""
  options_used: list[list[bytes]] = []
  check_compiles = CUDACompiler.check_compiles
  def recording(self, source, arch):
    options_used.append(list(self.options))
    return check_compiles(self, source, arch)
  monkeypatch.setattr(CUDACompiler, "check_compiles", recording)
  check = NvrtcCheck(compiler)
  check.add("good", MACRO_NAME_AS_VARIABLE)
  check.add("E_bad", BAD_PTX)
  check.add("r_big", TOO_MUCH_SHARED)
  with pytest.raises(CompileError) as failure:
    check.flush()
  message = str(failure.value)
  assert "rejects 2 CUDA kernel(s): E_bad, r_big" in message and "too much shared data" in message
  from ourgrad.runtime.ops_cuda import check as checked, nvrtc
  has_fast_compile = checked(nvrtc.nvrtcVersion(), "nvrtcVersion") >= FAST_COMPILE_SINCE
  assert options_used[0] == compiler.options + (FAST_COMPILE if has_fast_compile else [])
  assert options_used[1:] == [compiler.options] * 3   # each alone as the device compiles it
