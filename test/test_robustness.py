"""Resource failures and damaged files: ourgrad recovers where it can and says what went wrong where it cannot.

- allocation: an out-of-memory allocation frees the allocator's reuse cache and retries once; a second failure is an
  OutOfMemoryError naming the requested bytes and the bytes in use.
- compilation: a kernel that fails to compile raises CompileError holding the kernel source and the compiler log; an
  optimized kernel that fails to compile or load (a device limit the heuristics did not see) falls back to the
  unoptimized kernel.
- the on-disk compile cache: damaged entries (truncated, overwritten, unloadable) are deleted, recompiled and
  rewritten with a warning; concurrent processes compiling one kernel both succeed and leave one valid entry; an
  unwritable cache folder costs recompiles, not results.

Kernel-level failures are simulated with monkeypatch (a flaky `_alloc`, a renderer that emits bad source, a compile
that fails only with optimizations); damaged cache files are written for real. The cache tests run on CLANG, whose
loader (dlopen) is the one a damaged binary can crash.
"""
from __future__ import annotations

import gc
import hashlib
import os
import pathlib
import subprocess
import sys
import textwrap
import time
from typing import Any

import numpy as np
import pytest

from ourgrad import Tensor, dtypes
from ourgrad.codegen.kernel import Kernel
from ourgrad.device import CACHE_ENTRY_MAGIC, Buffer, Device, LRUAllocator
from ourgrad.engine import realize
from ourgrad.errors import CompileError, DeviceError, OutOfMemoryError

try:
  Device["CLANG"]
  HAVE_CLANG = True
except DeviceError:
  HAVE_CLANG = False
needs_clang = pytest.mark.skipif(not HAVE_CLANG, reason="needs the CLANG device (a C compiler)")


@pytest.fixture
def fresh_runners(monkeypatch: pytest.MonkeyPatch) -> dict:
  """An empty in-memory kernel cache, so the test's kernels are generated and compiled again."""
  runners: dict = {}
  monkeypatch.setattr(realize, "_runner_cache", runners)
  return runners


@pytest.fixture
def cache_folder(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, fresh_runners: dict) -> pathlib.Path:
  """A private, enabled on-disk compile cache."""
  monkeypatch.setenv("OURGRAD_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv("DISABLE_COMPILER_CACHE", raising=False)
  monkeypatch.delenv("CHECK_CUDA_RENDER", raising=False)  # only this test's own kernels go in the cache
  return tmp_path


def cache_entries(folder: pathlib.Path) -> list[pathlib.Path]:
  return sorted(path for path in (folder / "compile").glob("*/*") if path.is_file())


def is_valid_entry(path: pathlib.Path) -> bool:
  entry = path.read_bytes()
  header = len(CACHE_ENTRY_MAGIC) + 32
  return entry.startswith(CACHE_ENTRY_MAGIC) and entry[len(CACHE_ENTRY_MAGIC):header] == \
    hashlib.sha256(entry[header:]).digest()


# ---------------------------------------------------------------- allocation failures

def lru_allocator() -> LRUAllocator:
  allocator = Device[Device.DEFAULT].allocator
  if not isinstance(allocator, LRUAllocator): pytest.skip(f"{Device.DEFAULT} keeps no reuse cache")
  return allocator


def fill_reuse_cache(sizes: list[int]) -> None:
  """Allocate and drop buffers of these sizes: their memory goes to the allocator's reuse cache."""
  buffers = [Buffer(Device.DEFAULT, size, dtypes.uint8).allocate() for size in sizes]
  del buffers
  gc.collect()


def test_allocation_failure_frees_cache_and_retries(monkeypatch: pytest.MonkeyPatch) -> None:
  allocator = lru_allocator()
  fill_reuse_cache([1237, 2339, 3441])
  assert allocator.cached_bytes() >= 1237 + 2339 + 3441
  real_alloc, real_free = allocator._alloc, allocator._free
  attempts: list[int] = []
  freed: list[int] = []

  def fail_once(nbytes: int) -> Any:
    attempts.append(nbytes)
    if len(attempts) == 1: raise MemoryError("simulated: device out of memory")
    return real_alloc(nbytes)

  def record_free(handle: Any, nbytes: int) -> None:
    freed.append(nbytes)
    real_free(handle, nbytes)

  monkeypatch.setattr(allocator, "_alloc", fail_once)
  monkeypatch.setattr(allocator, "_free", record_free)
  buffer = Buffer(Device.DEFAULT, 4543, dtypes.uint8).allocate()  # a size the cache cannot serve
  assert attempts == [4543, 4543], "one failed attempt, then one retry"
  assert {1237, 2339, 3441} <= set(freed), "the cached buffers go back to the device before the retry"
  assert allocator.cached_bytes() == 0
  buffer.copyin(memoryview(bytes(range(256)) * 17 + bytes(191)))
  assert buffer.numpy()[:256].tolist() == list(range(256))


def test_allocation_failing_twice_is_out_of_memory_error(monkeypatch: pytest.MonkeyPatch) -> None:
  allocator = lru_allocator()
  fill_reuse_cache([5647])
  attempts: list[int] = []

  def always_fail(nbytes: int) -> Any:
    attempts.append(nbytes)
    raise MemoryError("simulated: device out of memory")

  monkeypatch.setattr(allocator, "_alloc", always_fail)
  keep = Tensor.ones(1000, device=Device.DEFAULT).contiguous()  # noqa: F841 (allocated before the failure)
  with pytest.raises(OutOfMemoryError) as info:
    Buffer(Device.DEFAULT, 6_000_011, dtypes.uint8).allocate()
  assert attempts == [6_000_011, 6_000_011], "exactly one retry"
  message = str(info.value)
  assert "6000011 bytes" in message, message                # what was asked for
  assert "in use" in message and "cached bytes" in message  # what is taken, and that the cache was freed
  assert "smaller batches" in message                       # what to do
  assert isinstance(info.value, MemoryError), "except MemoryError keeps working"
  assert isinstance(info.value.__cause__, MemoryError), "the device's own error is kept as the cause"


def test_out_of_memory_while_realizing(monkeypatch: pytest.MonkeyPatch) -> None:
  allocator = lru_allocator()
  x = Tensor.arange(1001, device=Device.DEFAULT).float().realize()

  def always_fail(nbytes: int) -> Any: raise MemoryError("simulated: device out of memory")

  monkeypatch.setattr(allocator, "_alloc", always_fail)
  with pytest.raises(OutOfMemoryError, match="cannot allocate 40040 bytes"):
    (x * 3 + 1).reshape(1001, 1).expand(1001, 10).contiguous().realize()
  monkeypatch.undo()
  # nothing half-done stays behind: the same graph realizes once memory is back
  np.testing.assert_equal(((x * 3 + 1).numpy()), np.arange(1001) * 3.0 + 1)


# ---------------------------------------------------------------- compile failures

@needs_clang
def test_compile_error_has_source_and_log() -> None:
  source = "void broken(float* restrict data0) {\n  data0[0] = 1.0f +;\n}\n"
  with pytest.raises(CompileError) as info:
    Device["CLANG"].compiler.compile(source)
  message = str(info.value)
  assert source in message, "the message holds the kernel source"
  assert "compiler log" in message and "error" in message.split("compiler log")[1], "and the compiler's diagnostics"
  assert "expected expression" in message or "expected" in message


@needs_clang
def test_renderer_bug_surfaces_as_compile_error(monkeypatch: pytest.MonkeyPatch, fresh_runners: dict) -> None:
  renderer = Device["CLANG"].renderer
  real_render = renderer.render
  monkeypatch.setattr(renderer, "render", lambda name, uops: real_render(name, uops) + "\nthis is not C;\n")
  monkeypatch.setenv("DISABLE_COMPILER_CACHE", "1")
  x = Tensor([1.0, 2.0, 3.0], device="CLANG")
  with pytest.raises(CompileError) as info:
    (x * 7 + 2).realize()
  message = str(info.value)
  assert "this is not C;" in message and "void E_3(" in message, "the source that failed is in the message"
  assert "compiler log" in message and "error" in message.split("compiler log")[1]
  assert not fresh_runners, "a kernel that failed to compile is not cached"
  monkeypatch.undo()
  np.testing.assert_equal((x * 7 + 2).numpy(), [9.0, 16.0, 23.0])


def optimized_ast_and_inputs() -> tuple[Tensor, np.ndarray]:
  """A matmul: the heuristics optimize it on every device."""
  a = np.arange(64 * 48, dtype=np.float32).reshape(64, 48) % 7
  b = np.arange(48 * 32, dtype=np.float32).reshape(48, 32) % 5
  return Tensor(a) @ Tensor(b), a @ b


def test_optimized_kernel_failure_falls_back_to_unoptimized(monkeypatch: pytest.MonkeyPatch,
                                                            fresh_runners: dict) -> None:
  real_compile = realize.compile_kernel
  attempts: list[list] = []

  def fails_with_opts(kernel: Kernel, device: str) -> realize.CompiledRunner:
    attempts.append(list(kernel.applied_opts))
    if kernel.applied_opts: raise CompileError("ptxas error: entry uses too much shared data (simulated)")
    return real_compile(kernel, device)

  monkeypatch.setattr(realize, "compile_kernel", fails_with_opts)
  product, expected = optimized_ast_and_inputs()
  # the fallback warns (the suite's pytest config turns that warning into an error everywhere else)
  with pytest.warns(realize.OptimizationFallbackWarning, match="too much shared data.*unoptimized"):
    np.testing.assert_allclose(product.numpy(), expected, rtol=1e-6)
  assert len(attempts) == 2 and attempts[0] and not attempts[1], "optimized first, then the plain loop nest"
  # the fallback is cached: the next use compiles nothing and warns no more
  product2, _ = optimized_ast_and_inputs()
  product2.realize()
  assert len(attempts) == 2


def test_fallback_failing_too_raises(monkeypatch: pytest.MonkeyPatch, fresh_runners: dict) -> None:
  attempts: list[bool] = []

  def always_fails(kernel: Kernel, device: str) -> realize.CompiledRunner:
    attempts.append(bool(kernel.applied_opts))
    raise CompileError(f"simulated failure of {kernel.name}")

  monkeypatch.setattr(realize, "compile_kernel", always_fails)
  product, _ = optimized_ast_and_inputs()
  with pytest.raises(CompileError, match="simulated failure"), pytest.warns(realize.OptimizationFallbackWarning):
    product.realize()
  assert attempts == [True, False]
  # a kernel without optimizations is not compiled twice
  attempts.clear()
  monkeypatch.setenv("NOOPT", "1")
  with pytest.raises(CompileError):
    (Tensor([1.0, 2.0]) + 5).realize()
  assert attempts == [False]


def test_other_errors_do_not_fall_back(monkeypatch: pytest.MonkeyPatch, fresh_runners: dict) -> None:
  """Only compile and device errors mean "too big for the device"; a bug (say a TypeError) is not hidden."""
  attempts: list[bool] = []

  def buggy(kernel: Kernel, device: str) -> realize.CompiledRunner:
    attempts.append(bool(kernel.applied_opts))
    raise TypeError("a bug in the code generator")

  monkeypatch.setattr(realize, "compile_kernel", buggy)
  product, _ = optimized_ast_and_inputs()
  with pytest.raises(TypeError, match="a bug"):
    product.realize()
  assert attempts == [True]


# ---------------------------------------------------------------- the on-disk compile cache

def compute_on_clang(value: float) -> np.ndarray:
  return (Tensor.arange(12, device="CLANG").float() * value + 1).numpy()


@needs_clang
@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "flipped byte"])
def test_damaged_cache_entry_is_recompiled(cache_folder: pathlib.Path, damage: str) -> None:
  np.testing.assert_equal(compute_on_clang(3.0), np.arange(12) * 3.0 + 1)
  [entry] = cache_entries(cache_folder)
  good = entry.read_bytes()
  assert is_valid_entry(entry)
  damaged = {"garbage": os.urandom(len(good)), "truncated": good[:len(good) // 2], "empty": b"",
             "flipped byte": good[:-100] + bytes([good[-100] ^ 0xFF]) + good[-99:]}[damage]
  entry.write_bytes(damaged)
  realize._runner_cache.clear()
  with pytest.warns(RuntimeWarning, match="damaged"):
    np.testing.assert_equal(compute_on_clang(3.0), np.arange(12) * 3.0 + 1)
  assert cache_entries(cache_folder) == [entry] and entry.read_bytes() == good, "the entry is rewritten"


@needs_clang
def test_unloadable_cached_binary_is_deleted_and_recompiled(cache_folder: pathlib.Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
  """An intact entry whose binary the loader rejects (another toolchain wrote it): the program factory fails on the
  cached binary, so the kernel is compiled again with the cache bypassed and the entry rewritten."""
  np.testing.assert_equal(compute_on_clang(5.0), np.arange(12) * 5.0 + 1)
  [entry] = cache_entries(cache_folder)
  good = entry.read_bytes()
  junk = b"\x7fELF not really a shared object" + os.urandom(64)
  entry.write_bytes(CACHE_ENTRY_MAGIC + hashlib.sha256(junk).digest() + junk)
  compiler = Device["CLANG"].compiler
  compiles: list[str] = []
  real_compile = compiler.compile
  monkeypatch.setattr(compiler, "compile", lambda source: compiles.append(source) or real_compile(source))
  realize._runner_cache.clear()
  with pytest.warns(RuntimeWarning, match="failed to load"):
    np.testing.assert_equal(compute_on_clang(5.0), np.arange(12) * 5.0 + 1)
  assert len(compiles) == 1, "compiled once, not read from the cache again"
  assert entry.read_bytes() == good and is_valid_entry(entry)


@needs_clang
def test_entries_are_checksummed_binaries(cache_folder: pathlib.Path) -> None:
  compute_on_clang(7.0)
  [entry] = cache_entries(cache_folder)
  assert is_valid_entry(entry)
  binary = entry.read_bytes()[len(CACHE_ENTRY_MAGIC) + 32:]
  assert binary.startswith(b"\x7fELF") or sys.platform != "linux", "the rest is the shared object itself"
  assert not [path for path in (cache_folder / "compile").glob("*/*") if ".tmp" in path.name], "no temporary files"


@needs_clang
def test_unwritable_cache_folder_still_computes(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                fresh_runners: dict) -> None:
  not_a_folder = tmp_path / "cache-is-a-file"
  not_a_folder.write_bytes(b"")
  monkeypatch.setenv("OURGRAD_CACHE_DIR", str(not_a_folder))
  monkeypatch.delenv("DISABLE_COMPILER_CACHE", raising=False)
  with pytest.warns(RuntimeWarning, match="cannot write the compile cache"):
    np.testing.assert_equal(compute_on_clang(11.0), np.arange(12) * 11.0 + 1)


CONCURRENT_SCRIPT = textwrap.dedent("""
  import sys, time
  import numpy as np
  from ourgrad import Tensor
  from ourgrad.device import Device
  compiler = Device["CLANG"].compiler
  real_compile, compiles = compiler.compile, []
  def slow_compile(source):  # hold the compile open so that both processes are inside it at once
    compiles.append(time.time())
    time.sleep(0.3)
    return real_compile(source)
  compiler.compile = slow_compile
  start, value = float(sys.argv[1]), float(sys.argv[2])
  while time.time() < start: time.sleep(0.002)
  result = (Tensor.arange(1000, device="CLANG").float() * value - 2).numpy()
  # float32: near the zero crossing (x * value ~ 2) only an absolute tolerance makes sense
  np.testing.assert_allclose(result, np.arange(1000) * value - 2, rtol=1e-6, atol=1e-4)
  print("compiled", len(compiles))
""")


@needs_clang
def test_concurrent_processes_compile_one_kernel(tmp_path: pathlib.Path) -> None:
  value = 1.0 + (time.time_ns() % 10_000) / 1e4  # a kernel no cache has seen
  env = {**os.environ, "OURGRAD_CACHE_DIR": str(tmp_path), "DEVICE": "CLANG", "DEBUG": "0"}
  env.pop("DISABLE_COMPILER_CACHE", None)
  script = tmp_path / "compile_once.py"
  script.write_text(CONCURRENT_SCRIPT)
  start = time.time() + 2.0
  workers = [subprocess.Popen([sys.executable, str(script), str(start), str(value)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
  outputs = [worker.communicate(timeout=60) for worker in workers]
  for worker, (stdout, stderr) in zip(workers, outputs):
    assert worker.returncode == 0, stderr
    assert "Warning" not in stderr, stderr
  compiled = [int(stdout.split()[-1]) for stdout, _ in outputs]
  assert sum(compiled) >= 2, f"at least two processes compiled the kernel at the same time: {compiled}"
  entries = cache_entries(tmp_path)
  assert len(entries) == 1 and is_valid_entry(entries[0]), entries
  assert not [path for path in (tmp_path / "compile").glob("*/*") if ".tmp" in path.name], "no temporary files left"
  # and a fourth process reads that entry instead of compiling
  stdout = subprocess.run([sys.executable, str(script), "0", str(value)], env=env, capture_output=True, text=True,
                          timeout=60, check=True).stdout
  assert stdout.split()[-1] == "0"
