"""engine/compile_ahead.py: a schedule's new kernels compile side by side (COMPILE_THREADS) with the same results,
the same fallbacks and one compile (and one cache write) per kernel as the serial path."""
import pathlib
import re
import threading

import numpy as np
import pytest

from helpers import nvrtc_compiler
from ourgrad import Device, Tensor
from ourgrad.codegen.kernel import Kernel
from ourgrad.engine import compile_ahead, realize
from ourgrad.engine.schedule import create_schedule
from ourgrad.errors import CompileError

concurrent_device = pytest.mark.skipif(not Device[Device.DEFAULT].compiler.concurrent_compiles,
                                reason="the default device's compiler compiles one kernel at a time")

KERNELS = 8


@pytest.fixture
def cold(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
  """No compiled kernel in memory and an empty private disk cache: every kernel of the test is compiled."""
  monkeypatch.setattr(realize, "_runner_cache", {})
  monkeypatch.setenv("OURGRAD_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv("DISABLE_COMPILER_CACHE", raising=False)
  # on GPUs independent kernels share one packed launch (engine/packing.py): the tests need a kernel each
  monkeypatch.setenv("PACK_KERNELS", "0")
  return tmp_path


@pytest.fixture
def compiled_sources(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
  """(thread name, source) of every compile of the default device's compiler."""
  compiler = Device[Device.DEFAULT].compiler
  real_compile, sources = compiler.compile, []

  def recording(source: str) -> bytes:
    sources.append((threading.current_thread().name, source))
    return real_compile(source)

  monkeypatch.setattr(compiler, "compile", recording)
  return sources


def many_kernels(seed: int) -> tuple[list[Tensor], list[np.ndarray]]:
  """KERNELS reductions of different shapes (each its own kernel), with their numpy values."""
  rng = np.random.default_rng(seed)
  inputs = [rng.standard_normal((8, 5 + index)).astype(np.float32) for index in range(KERNELS)]
  outputs = [((Tensor(x) * (index + 1)).exp() + 1).sum(axis=1) for index, x in enumerate(inputs)]
  return outputs, [(np.exp(x * (index + 1)) + 1).sum(axis=1) for index, x in enumerate(inputs)]


def realize_all(outputs: list[Tensor]) -> list[np.ndarray]:
  Tensor.realize_all(*outputs)
  return [output.numpy() for output in outputs]


@concurrent_device
@pytest.mark.parametrize("threads", ["1", "4"])
def test_results_match_numpy(threads: str, cold: pathlib.Path, compiled_sources: list, monkeypatch) -> None:
  monkeypatch.setenv("COMPILE_THREADS", threads)
  outputs, expected = many_kernels(seed=1)
  for got, want in zip(realize_all(outputs), expected): np.testing.assert_allclose(got, want, rtol=1e-5)
  in_pool = [name for name, _ in compiled_sources if name.startswith("ourgrad-compile")]
  # 4 threads: every new kernel after the schedule's first compiled in the pool
  assert len(in_pool) == (0 if threads == "1" else KERNELS - 1)


@concurrent_device
def test_one_compile_and_one_cache_write_per_kernel(cold: pathlib.Path, compiled_sources: list, monkeypatch) -> None:
  monkeypatch.setenv("COMPILE_THREADS", "4")
  writes: list[str] = []
  compiler = Device[Device.DEFAULT].compiler
  real_store = compiler.store_cached
  monkeypatch.setattr(compiler, "store_cached", lambda source, binary: writes.append(source) or
                      real_store(source, binary))
  # the same kernels twice in one schedule: each is rendered, compiled and written once
  first, expected = many_kernels(seed=2)
  again, _ = many_kernels(seed=2)
  for got, want in zip(realize_all(first + again), expected * 2): np.testing.assert_allclose(got, want, rtol=1e-5)
  sources = [source for _, source in compiled_sources]
  assert len(sources) == len(set(sources)) == KERNELS and sorted(writes) == sorted(sources)
  assert all(compiler.cache_path(source).is_file() for source in sources)
  # a new process's view: the same kernels again come from the disk cache, compiling nothing
  monkeypatch.setattr(realize, "_runner_cache", {})
  third, _ = many_kernels(seed=2)
  realize_all(third)
  assert len(compiled_sources) == KERNELS and len(writes) == KERNELS


def optimized_product() -> tuple[Tensor, np.ndarray]:
  """A matmul (the heuristics optimize it) beside other new kernels, and its numpy value."""
  a = np.arange(64 * 48, dtype=np.float32).reshape(64, 48) % 7
  b = np.arange(48 * 32, dtype=np.float32).reshape(48, 32) % 5
  return Tensor(a) @ Tensor(b), a @ b


def optimized_name(tensor: Tensor) -> str:
  """The function name of the optimized kernel of a one-kernel tensor (not the plain loop nest's)."""
  (item,) = create_schedule([tensor.lazydata])
  kernel = realize.get_kernel(item.ast, Device.DEFAULT)
  assert kernel.applied_opts and kernel.name != Kernel(item.ast, Device[Device.DEFAULT].renderer).name
  return realize.function_name(kernel)


@concurrent_device
def test_compile_failure_in_a_thread_falls_back(cold: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setenv("COMPILE_THREADS", "4")
  compiler = Device[Device.DEFAULT].compiler
  real_compile = compiler.compile
  failing = optimized_name(optimized_product()[0])
  threads: list[str] = []

  def fails_optimized_matmul(source: str) -> bytes:
    if re.search(rf"\b{re.escape(failing)}\(", source):   # the kernel's definition, in C or CUDA source
      threads.append(threading.current_thread().name)
      raise CompileError("ptxas error: entry uses too much shared data (simulated)")
    return real_compile(source)

  monkeypatch.setattr(compiler, "compile", fails_optimized_matmul)
  product, expected_product = optimized_product()
  outputs, expected = many_kernels(seed=3)
  with pytest.warns(realize.OptimizationFallbackWarning, match="too much shared data.*unoptimized"):
    got = realize_all([*outputs, product])   # the matmul last: not the schedule's first new kernel
  np.testing.assert_allclose(got[-1], expected_product, rtol=1e-6)
  for value, want in zip(got, expected): np.testing.assert_allclose(value, want, rtol=1e-5)
  # failed in a compile thread first, then once more on the serial path that reports it and falls back
  assert len(threads) == 2 and threads[0].startswith("ourgrad-compile") and threads[1] == "MainThread"


@concurrent_device
def test_serial_where_nothing_overlaps(cold: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setenv("COMPILE_THREADS", "4")
  outputs, _ = many_kernels(seed=4)
  schedule = create_schedule([output.lazydata for output in outputs])
  assert compile_ahead.compile_ahead(schedule[-1:]) is None, "one kernel: nothing to overlap"
  monkeypatch.setenv("COMPILE_THREADS", "1")
  assert compile_ahead.compile_ahead(schedule) is None
  monkeypatch.setenv("COMPILE_THREADS", "2")
  monkeypatch.setenv("DISABLE_COMPILER_CACHE", "1")
  assert compile_ahead.compile_ahead(schedule) is None, "the rendered kernels' binaries go through the disk cache"


def test_nvrtc_compiles_the_same_in_threads() -> None:
  """CUDACompiler.concurrent_compiles: NVRTC in several threads at once gives the binaries it gives one at a time."""
  compiler = nvrtc_compiler()
  if compiler is None: pytest.skip("no NVRTC here")
  sources = [f'extern "C" __global__ void k{index}(float* a) {{ a[threadIdx.x] = sinf(a[threadIdx.x]) * {index}.0f; }}'
             for index in range(8)]
  serial = [compiler.compile(source) for source in sources]
  assert compiler.concurrent_compiles
  assert list(compile_ahead.compile_pool(4).map(compiler.compile, sources)) == serial
