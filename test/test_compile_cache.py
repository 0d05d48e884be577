"""The on-disk compile cache across processes, and the CUDA compiler's cache key and warm-up.

A kernel compiled in one process is read back by the next one without compiling (checked by a second Python process
whose compiler raises if it is asked to compile). The CUDA compiler's entries are keyed by the architecture and the
NVRTC options, so a binary is never handed to a compiler that would have produced another one. NVRTC needs no GPU,
so the CUDA cases run wherever cuda-python and NVRTC are installed, and skip cleanly elsewhere.
Damaged entries and the size bound are tested in test_robustness.py and test_reliability.py.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CLANG_SOURCE = "void cache_probe_{tag}(float* out) {{ out[0] = {tag}.0f; }}\n"
CUDA_SOURCE = 'extern "C" __global__ void cache_probe_{tag}(float* out) {{ out[threadIdx.x] = {tag}.0f; }}\n'


def _cuda_compiler(arch: str = "sm_90"):
  try:
    from ourgrad.runtime.ops_cuda import CUDACompiler
    return CUDACompiler(arch, ptx=False)  # CUBIN, whatever CUDA_PTX says
  except Exception:  # no cuda-python or no NVRTC library here
    return None


HAS_NVRTC = _cuda_compiler() is not None

# the second process: compile_cached must find every source in the cache (its compile raises), and prints the
# sha256 of each binary it read
SECOND_PROCESS = """
import hashlib, json, sys
kind, arch = sys.argv[1], sys.argv[2]
if kind == "CUDA":
  from ourgrad.runtime.ops_cuda import CUDACompiler
  compiler = CUDACompiler(arch, ptx=False)
else:
  from ourgrad.device import Device
  compiler = Device["CLANG"].compiler
def refuse(source):
  raise AssertionError("compiled although the disk cache holds the binary")
compiler.compile = refuse
sources = json.loads(sys.stdin.read())
print(json.dumps([hashlib.sha256(compiler.compile_cached(source)).hexdigest() for source in sources]))
"""


@pytest.fixture
def cache_folder(tmp_path, monkeypatch) -> pathlib.Path:
  monkeypatch.setenv("OURGRAD_CACHE_DIR", str(tmp_path))
  monkeypatch.delenv("DISABLE_COMPILER_CACHE", raising=False)
  return tmp_path


def _read_in_second_process(kind: str, arch: str, sources: list[str]) -> list[str]:
  environment = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
  environment.pop("CHECK_CUDA_RENDER", None)
  done = subprocess.run([sys.executable, "-c", SECOND_PROCESS, kind, arch], input=json.dumps(sources), text=True,
                        capture_output=True, env=environment, cwd=str(ROOT), timeout=300)
  assert done.returncode == 0, done.stderr
  return json.loads(done.stdout.strip().splitlines()[-1])


def _compile_here(compiler, sources: list[str]) -> list[str]:
  return [hashlib.sha256(compiler.compile_cached(source)).hexdigest() for source in sources]


def test_clang_binary_is_read_by_a_second_process(cache_folder):
  from ourgrad.device import Device
  sources = [CLANG_SOURCE.format(tag=tag) for tag in (1, 2)]
  compiled = _compile_here(Device["CLANG"].compiler, sources)
  assert len(list((cache_folder / "compile").glob("*/*"))) == 2
  assert _read_in_second_process("CLANG", "", sources) == compiled


@pytest.mark.skipif(not HAS_NVRTC, reason="cuda-python with NVRTC is not installed")
def test_cuda_binary_is_read_by_a_second_process(cache_folder):
  compiler = _cuda_compiler("sm_90")
  sources = [CUDA_SOURCE.format(tag=tag) for tag in (3, 4)]
  compiled = _compile_here(compiler, sources)
  assert all(compiler.load_cached(source) is not None for source in sources)
  assert _read_in_second_process("CUDA", "sm_90", sources) == compiled
  # another architecture has entries of its own: the sm_90 binaries are not handed to it
  assert all(_cuda_compiler("sm_80").load_cached(source) is None for source in sources)


@pytest.mark.skipif(not HAS_NVRTC, reason="cuda-python with NVRTC is not installed")
def test_cuda_cache_key_names_arch_and_options():
  sm90, sm80 = _cuda_compiler("sm_90"), _cuda_compiler("sm_80")
  source = CUDA_SOURCE.format(tag=5)
  assert "sm_90" in sm90.cache_key and "sm_80" in sm80.cache_key
  assert sm90.cache_path(source) != sm80.cache_path(source)
  for option in sm90.options: assert option.decode() in sm90.cache_key
  other = _cuda_compiler("sm_90")
  other.options = other.options + [b"--ftz=true"]
  other.cache_key = other.cache_key + " --ftz=true"
  assert other.cache_path(source) != sm90.cache_path(source)


@pytest.mark.skipif(not HAS_NVRTC, reason="cuda-python with NVRTC is not installed")
def test_cuda_warm_up_compiles_in_the_background_and_caches_nothing(cache_folder):
  from ourgrad.runtime.ops_cuda import WARM_UP_SOURCE
  compiler = _cuda_compiler("sm_90")
  compiler.warm_up()
  compiler.warm_up()  # once per compiler
  compiler._warm_up.join(timeout=120)
  assert not compiler._warm_up.is_alive()
  assert compiler.load_cached(WARM_UP_SOURCE) is None
  cubin = compiler.compile(CUDA_SOURCE.format(tag=6))
  assert cubin[:4] == b"\x7fELF"  # a CUBIN is an ELF file


@pytest.mark.skipif(not HAS_NVRTC, reason="cuda-python with NVRTC is not installed")
def test_cuda_ptx_mode_gives_loadable_ptx_under_its_own_key():
  from ourgrad.runtime.ops_cuda import CUDACompiler
  source = CUDA_SOURCE.format(tag=7)
  ptx_compiler, cubin_compiler = CUDACompiler("sm_90", ptx=True), CUDACompiler("sm_90")
  ptx = ptx_compiler.compile(source)
  # a NUL-terminated PTX module for the GPU's virtual architecture, which cuModuleLoadData compiles when it loads it
  assert ptx.endswith(b"\0") and ptx.count(b"\0") == 1
  assert b".target sm_90" in ptx and b".entry cache_probe_7" in ptx
  assert ptx_compiler.cache_path(source) != cubin_compiler.cache_path(source)
  assert cubin_compiler.compile(source)[:4] == b"\x7fELF"


_FORKED_COMPILER = None  # inherited by the forked worker, as BEAM hands its compiler to its workers


def _compile_with_forked_compiler(source: str) -> bytes: return _FORKED_COMPILER.compile(source)


def _compile_in_fork(compiler, source: str) -> bytes:
  import multiprocessing
  global _FORKED_COMPILER
  _FORKED_COMPILER = compiler
  with multiprocessing.get_context("fork").Pool(1) as pool:
    return pool.apply(_compile_with_forked_compiler, (source,))


@pytest.mark.skipif(not HAS_NVRTC or not hasattr(os, "fork"), reason="needs NVRTC and fork")
def test_cuda_ptx_compiler_in_a_forked_worker_compiles_cubin():
  """BEAM's forked workers compile candidates for the parent to load: machine code, not PTX the driver would have to
  compile candidate after candidate in the parent. The warm-up thread is finished before the fork."""
  from ourgrad.runtime.ops_cuda import CUDACompiler
  compiler = CUDACompiler("sm_90", ptx=True)
  compiler.warm_up()
  source = CUDA_SOURCE.format(tag=8)
  assert _compile_in_fork(compiler, source)[:4] == b"\x7fELF"
  assert compiler.compile(source).endswith(b"\0")
  assert not compiler._warm_up.is_alive()
