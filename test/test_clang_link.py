"""The CLANG device's kernel build (runtime/host_link.py): each kernel compiled to an object file, linked alone, its
libm, OpenMP and compiler-helper symbols resolved when it loads. Hand-written C kernels (independent of the renderer)
that call libm, run OpenMP regions, take many arguments and need the compiler's helper archive are built, loaded and
checked against numpy; a symbol nothing defines is a DeviceError naming it. Runs with whatever compiler the CLANG
device picks (CC=clang to check clang)."""
from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest

from ourgrad.device import Device
from ourgrad.errors import CompileError, DeviceError
from ourgrad.runtime import ops_clang
from ourgrad.runtime.host_link import RUNTIME_SOURCE, KernelLinker

LIBM_KERNEL = """float sinf(float); float exp2f(float); float log2f(float); float sqrtf(float);
double exp(double); double atan2(double, double);
void libm_calls(float* restrict out, const float* restrict x, double* restrict wide) {
  for (int i = 0; i < 9; i++) {
    out[i] = sinf(x[i]) + exp2f(x[i]) + log2f(x[i] + 3.0f) + sqrtf(x[i] + 2.0f);
    wide[i] = exp((double)x[i]) + atan2((double)x[i], 0.5);
  }
}
"""

# a team of 2 threads whatever OMP_NUM_THREADS says: each thread's number is written where the loop put it
OPENMP_KERNEL = """int omp_get_thread_num(void); int omp_get_num_threads(void);
void openmp_region(float* restrict out, const float* restrict x, int* restrict team) {
  #pragma omp parallel for num_threads(2) schedule(static)
  for (int i = 0; i < 4096; i++) {
    out[i] = x[i] * 3.0f + 1.0f;
    if (i == 0 || i == 4095) team[i == 0 ? 0 : 1] = omp_get_thread_num() * 100 + omp_get_num_threads();
  }
  float total = 0.0f;
  #pragma omp parallel for simd reduction(+:total)
  for (int i = 0; i < 4096; i++) total += x[i];
  out[4096] = total;
}
"""

ARGUMENTS = 24   # more buffers than the calling convention passes in registers (6 on x86-64, 8 on AArch64)
MANY_ARGUMENTS_KERNEL = (
  "void many_arguments(float* restrict out, " + ", ".join(f"const float* restrict in{i}" for i in range(ARGUMENTS)) +
  ", int scale) {\n  for (int j = 0; j < 5; j++) out[j] = (float)scale * (" +
  " + ".join(f"in{i}[j] * {i + 1}.0f" for i in range(ARGUMENTS)) + ");\n}\n")

# a 128-bit division: a call into the compiler's helper archive (libgcc's __udivti3, or compiler-rt's) on x86-64
# and AArch64, linked into the kernel's shared object
HELPER_KERNEL = """void helper_division(unsigned long long* restrict out, const unsigned long long* restrict x) {
  for (int i = 0; i < 4; i++) {
    unsigned __int128 wide = ((unsigned __int128)x[i] << 64) | x[i];
    out[i] = (unsigned long long)(wide / (x[i] | 3ull));
  }
}
"""

# float16 -> float on an x86 target without F16C (x86-64-v2): gcc calls libgcc's __extendhfsf2
HALF_KERNEL = """void half_to_float(float* restrict out, const _Float16* restrict x) {
  for (int i = 0; i < 7; i++) out[i] = (float)x[i] * 2.0f;
}
"""

MISSING_SYMBOL_KERNEL = """float ourgrad_no_such_function(float);
void calls_missing(float* restrict out) { out[0] = ourgrad_no_such_function(out[0]); }
"""


def _compiler() -> ops_clang.ClangCompiler:
  return Device["CLANG"].compiler


def _load(source: str, name: str, compiler: ops_clang.ClangCompiler | None = None,
          flags: list[str] | None = None) -> ops_clang.ClangProgram:
  compiler = compiler or _compiler()
  library = compiler._build(source, flags or compiler.flags_for(source))
  return ops_clang.ClangProgram(name, library, compiler.load_runtime)


def _pointers(*arrays: np.ndarray) -> list[ctypes.c_void_p]:
  return [ctypes.c_void_p(array.ctypes.data) for array in arrays]


def test_libm_calls_resolve_at_load():
  x = np.linspace(-1.5, 1.5, 9, dtype=np.float32)
  out, wide = np.zeros(9, np.float32), np.zeros(9, np.float64)
  _load(LIBM_KERNEL, "libm_calls").function(*_pointers(out, x, wide))
  x64 = x.astype(np.float64)
  expected = np.sin(x64) + np.exp2(x64) + np.log2(x64 + 3) + np.sqrt(x64 + 2)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(wide, np.exp(x64) + np.arctan2(x64, 0.5), rtol=1e-12)


def test_openmp_region_runs_on_a_team_of_two():
  x = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
  out, team = np.zeros(4097, np.float32), np.zeros(2, np.int32)
  _load(OPENMP_KERNEL, "openmp_region").function(*_pointers(out, x, team))
  np.testing.assert_allclose(out[:4096], x * 3 + 1, rtol=1e-5, atol=1e-6)   # a fused multiply-add may round once
  np.testing.assert_allclose(out[4096], x.astype(np.float64).sum(), rtol=1e-4, atol=1e-3)
  assert list(team) == [2, 102]   # the first iteration on thread 0, the last on thread 1, both of a team of 2


def test_kernel_needs_no_library_of_its_own():
  """The object is linked alone: its shared object names no library (the C runtime library names them)."""
  compiler = _compiler()
  library = compiler._build(OPENMP_KERNEL, compiler.flags_for(OPENMP_KERNEL))
  assert not any(name in library for name in (b"libgomp.so", b"libomp.so", b"libm.so", b"libc.so"))


def test_many_arguments():
  rng = np.random.default_rng(1)
  inputs = [rng.standard_normal(5).astype(np.float32) for _ in range(ARGUMENTS)]
  out = np.zeros(5, np.float32)
  _load(MANY_ARGUMENTS_KERNEL, "many_arguments").function(*_pointers(out, *inputs), 3)
  expected = 3 * sum(array.astype(np.float64) * (i + 1) for i, array in enumerate(inputs))
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_compiler_helper_archive_is_linked_in():
  x = np.array([7, 1 << 40, (1 << 63) + 5, 12345678901], dtype=np.uint64)
  out = np.zeros(4, np.uint64)
  _load(HELPER_KERNEL, "helper_division").function(*_pointers(out, x))
  expected = [(((int(v) << 64) | int(v)) // (int(v) | 3)) & ((1 << 64) - 1) for v in x]
  assert [int(v) for v in out] == expected


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64-v2 is an x86 target")
def test_half_conversion_without_f16c(monkeypatch):
  """CI runs the op suites at CLANG_MARCH=x86-64-v2, where gcc converts float16 through libgcc."""
  monkeypatch.setenv("CLANG_MARCH", "x86-64-v2")
  compiler = ops_clang.ClangCompiler()
  try:
    program = _load(HALF_KERNEL, "half_to_float", compiler)
  except CompileError as error:
    if "not supported on this target" in str(error): pytest.skip("this compiler has no _Float16 at x86-64-v2")
    raise
  x = np.array([0.5, -2.25, 65504, 1e-7, 3.140625, -0.0, 7], dtype=np.float16)
  out = np.zeros(7, np.float32)
  program.function(*_pointers(out, x))
  np.testing.assert_array_equal(out, x.astype(np.float32) * 2)


def test_missing_symbol_is_a_device_error_naming_it():
  with pytest.raises(DeviceError, match="ourgrad_no_such_function"):
    _load(MISSING_SYMBOL_KERNEL, "calls_missing")


def test_linking_through_the_driver_where_no_linker_is_found(monkeypatch):
  """A driver whose linker is not on PATH: the kernel is linked by the driver with -nostdlib, as right."""
  compiler = _compiler()
  linker = KernelLinker(compiler.compiler)
  linker.linker = None
  monkeypatch.setattr(compiler, "linker", linker)
  assert linker.command("k.o", "k.so")[:3] == [compiler.compiler, "-shared", "-nostdlib"]
  test_libm_calls_resolve_at_load()
  test_compiler_helper_archive_is_linked_in()


def test_runtime_library_is_cached_on_disk(monkeypatch, tmp_path):
  monkeypatch.setenv("OURGRAD_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv("DISABLE_COMPILER_CACHE", raising=False)
  compiler = _compiler()
  first = ops_clang._RuntimeLibrary(compiler).compile_cached(RUNTIME_SOURCE)
  assert list(tmp_path.glob("toolchain/c_runtime_*.so")) and not list(tmp_path.glob("compile/*/*"))

  def refuse() -> bytes: raise AssertionError("linked again although the disk cache holds the runtime library")
  monkeypatch.setattr(compiler, "_link_runtime", refuse)
  assert ops_clang._RuntimeLibrary(compiler).compile_cached(RUNTIME_SOURCE) == first
