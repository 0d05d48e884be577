"""The host toolchains of the CPU devices: CLANG_MARCH / LLVM_CPU pick the target (and the SIMD width the renderer
assumes follows it, not the host), FLAG_RULES picks flags per compiler and version, and the known-answer self-test
(runtime/toolchain_check.py) catches a miscompile before the first kernel: safe flags and a warning, or a clear
error. The patterns gcc 12.2 miscompiled on CPUs without AVX-512 (any/all/max of comparisons) are checked against
numpy at each -march this CPU can run, so the CPU a test machine happens to have cannot hide them."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import warnings

import numpy as np
import pytest

from ourgrad.errors import CompileError, DeviceError
from ourgrad.runtime import toolchain_check
from helpers import host_has_avx512

try:
  from ourgrad.runtime import ops_clang
  ops_clang.find_c_compiler()
except DeviceError:  # pragma: no cover: no C compiler on this machine
  ops_clang = None

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
X86 = platform.machine() in ("x86_64", "AMD64")
needs_x86_cc = pytest.mark.skipif(ops_clang is None or not X86, reason="needs a C compiler targeting x86-64")
# the x86-64 levels every current x86 CPU runs, and this CPU's own
MARCHES = ["x86-64-v2", "x86-64-v3", "native"]


@pytest.fixture
def fresh_cache(monkeypatch, tmp_path):
  """A compile cache of its own: verdicts and binaries of other runs are not seen."""
  monkeypatch.setenv("OURGRAD_CACHE_DIR", str(tmp_path))
  return tmp_path


def _compiler(monkeypatch, march: str):
  monkeypatch.setenv("CLANG_MARCH", march)
  return ops_clang.ClangCompiler()


# ---------------------------------------------------------------- the target follows CLANG_MARCH

@needs_x86_cc
def test_clang_march_picks_the_target_width_and_cache_key(monkeypatch, fresh_cache):
  widths = {"x86-64-v2": 16, "x86-64-v3": 32, "x86-64-v4": 64}
  # a compiler's known-answer self-test runs its target's code: AVX-512 (v4) only where this CPU runs it (elsewhere
  # the compiler refuses the target: test_a_target_this_cpu_cannot_run_is_refused_before_any_code_runs)
  if not host_has_avx512(): del widths["x86-64-v4"]
  keys = set()
  for march, width in widths.items():
    compiler = _compiler(monkeypatch, march)
    assert compiler.vector_bytes == width
    assert f"-march={march}" in compiler.flags_for("void k(void) {}")
    keys.add(compiler.cache_key)
  assert len(keys) == len(widths), "each target compiles into its own cache entries"


@needs_x86_cc
def test_device_renderer_width_follows_clang_march(monkeypatch):
  """In a fresh process, Device['CLANG'].renderer.vector_bytes is the target's width, not this CPU's."""
  for march, width in (("x86-64-v2", 16), ("x86-64-v3", 32)):
    script = "from ourgrad import Device; print(Device['CLANG'].renderer.vector_bytes)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "CLANG_MARCH": march, "PYTHONPATH": REPO})
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[-1]) == width


@needs_x86_cc
def test_unknown_clang_march_is_a_clear_error(monkeypatch):
  with pytest.raises(DeviceError, match="CLANG_MARCH='no-such-cpu'"):
    _compiler(monkeypatch, "no-such-cpu")


# ---------------------------------------------------------------- a target this CPU cannot run

@needs_x86_cc
def test_clang_target_with_features_the_host_lacks_names_them(monkeypatch):
  """Whatever CPU runs the test: with a host that reads as x86-64-v2 (SSE4.2), CLANG_MARCH=x86-64-v3 is refused with
  a DeviceError naming the target, the AVX2-level features missing and the variable; a target the host has opens."""
  identify = ops_clang.identify_compiler
  monkeypatch.setattr(ops_clang, "identify_compiler",
                      lambda compiler, march: identify(compiler, "x86-64-v2" if march == "native" else march))
  refused = r"CLANG_MARCH='x86-64-v3'.*lacks \(.*avx2.*fma.*\).*SIGILL.*CLANG_MARCH=native"
  with pytest.raises(DeviceError, match=refused):
    _compiler(monkeypatch, "x86-64-v3")
  assert _compiler(monkeypatch, "x86-64-v2").vector_bytes == 16


@pytest.mark.skipif(not X86 or host_has_avx512(), reason="needs an x86 CPU without AVX-512")
def test_a_target_this_cpu_cannot_run_is_refused_before_any_code_runs(tmp_path):
  """CLANG_MARCH / LLVM_CPU=x86-64-v4 on a CPU without AVX-512: the device does not open (a DeviceError naming the
  target, avx512f and the variable) instead of the known-answer self-test dying of SIGILL (an illegal instruction
  killed the process, and with it a pytest worker). A fresh process: a regression crashes it, not this one."""
  devices = {"CLANG": "CLANG_MARCH", "LLVM": "LLVM_CPU"}
  if ops_clang is None: del devices["CLANG"]
  if ops_llvm is None: del devices["LLVM"]
  script = (f"from ourgrad import Tensor\nfor device in {list(devices)}:\n  try:\n"
            f"    Tensor([1.0, 2.0], device=device).sum().item()\n  except Exception as error:\n"
            f"    print(device, type(error).__name__, error)")
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **{variable: "x86-64-v4" for variable in devices.values()},
                               "PYTHONPATH": REPO, "OURGRAD_CACHE_DIR": str(tmp_path)})
  assert result.returncode == 0, f"exit status {result.returncode} (-4: SIGILL)\n{result.stderr}"
  lines = result.stdout.splitlines()
  assert len(lines) == len(devices), result.stdout
  for line, (device, variable) in zip(lines, devices.items()):
    assert line.startswith(f"{device} DeviceError {variable}='x86-64-v4'"), line
    assert "avx512f" in line and "SIGILL" in line, line


# ---------------------------------------------------------------- the miscompiled patterns, at each target

_PATTERNS = """
import json, sys
import numpy as np
from ourgrad import Tensor
v = np.zeros((3, 4), np.float32); v[:, 1] = 1
w = np.array([[0, 0, 0, 0], [0, 0, 3, 0], [1, 1, 1, 1]], np.float32)
n = np.array([1.0, np.nan, 2.0, 3.0], np.float32)
print(json.dumps({
  "any_rows": Tensor(v).any(-1).tolist(), "any_rows_mixed": Tensor(w).any(-1).tolist(),
  "all_rows": Tensor(w).all(-1).tolist(), "any_ne": (Tensor([4, 1, 4, 3]) != 4).any().item(),
  "all_ne": (Tensor([4, 1, 4, 3]) != 4).all().item(), "int_max": (Tensor([4, 1, 4, 3]) != 4).int().max().item(),
  "equal_nan": Tensor(n).eq(Tensor(n)).all().item(), "argmax": Tensor([3, -1, 7, 2]).argmax().item(),
  "flip_sum": (Tensor(np.arange(6, dtype=np.float32)).flip(0) + Tensor(np.float32(100))).sum().item(),
  "count": (Tensor(w) > 0.5).sum().item(),
}))
"""


def _expected_patterns() -> dict:
  v = np.zeros((3, 4), np.float32)
  v[:, 1] = 1
  w = np.array([[0, 0, 0, 0], [0, 0, 3, 0], [1, 1, 1, 1]], np.float32)
  n = np.array([1.0, np.nan, 2.0, 3.0], np.float32)
  ne = np.array([4, 1, 4, 3]) != 4
  return {"any_rows": v.any(-1).tolist(), "any_rows_mixed": w.any(-1).tolist(), "all_rows": w.all(-1).tolist(),
          "any_ne": bool(ne.any()), "all_ne": bool(ne.all()), "int_max": int(ne.astype(np.int32).max()),
          "equal_nan": bool((n == n).all()), "argmax": int(np.argmax([3, -1, 7, 2])),
          "flip_sum": float((np.arange(6, dtype=np.float32)[::-1] + 100).sum()), "count": int((w > 0.5).sum())}


@needs_x86_cc
@pytest.mark.parametrize("march", MARCHES)
def test_known_miscompile_patterns_match_numpy_at_each_march(march, tmp_path):
  """any/all/max of comparisons (gcc 12.2 gave False without AVX-512), equal with NaN, argmax, a flipped reduce: a
  fresh process at each -march (fresh cache: the flags are this version's), against numpy."""
  env = {**os.environ, "CLANG_MARCH": march, "PYTHONPATH": REPO, "OURGRAD_CACHE_DIR": str(tmp_path), "DEVICE": "CLANG"}
  result = subprocess.run([sys.executable, "-c", _PATTERNS], capture_output=True, text=True, timeout=300, env=env)
  assert result.returncode == 0, result.stderr
  assert "miscompiled" not in result.stderr, "the chosen flags needed the safe fallback"
  assert json.loads(result.stdout.splitlines()[-1]) == _expected_patterns()


# ---------------------------------------------------------------- flags per compiler and version

def _identity(family: str, major: int):
  return ops_clang.CompilerIdentity(family, major, f"{major}.1.0", "")


@pytest.mark.skipif(ops_clang is None, reason="needs a C compiler")
def test_flag_rules_per_compiler_and_version():
  def flags(family: str, major: int) -> set[str]:
    return {flag for rule in ops_clang.rules_for(_identity(family, major)) if not rule.optional for flag in rule.flags}
  assert flags("gcc", 12) == {"-fno-tree-loop-vectorize", "-fno-tree-slp-vectorize"}
  assert flags("gcc", 13) == flags("gcc", 14) == set()
  assert flags("clang", 17) == set()


@needs_x86_cc
def test_slp_vectorizer_off_only_for_integer_reduces_on_gcc_12(monkeypatch, fresh_cache):
  compiler = _compiler(monkeypatch, "x86-64-v3")
  compiler.rules = ops_clang.rules_for(_identity("gcc", 12))
  sources = {known.name: known.source for known in toolchain_check.C_KNOWN_ANSWERS}
  integer_reduce, float_reduce = sources["kat_any_rows"], sources["kat_nan_max"]   # unsigned char / float acc0
  assert ops_clang.has_integer_reduce(integer_reduce) and not ops_clang.has_integer_reduce(float_reduce)
  assert "-fno-tree-slp-vectorize" in compiler.flags_for(integer_reduce)
  assert "-fno-tree-slp-vectorize" not in compiler.flags_for(float_reduce)
  assert "-fno-tree-loop-vectorize" in compiler.flags_for(float_reduce)
  simd = "#include <math.h>\n#pragma omp simd\n"
  assert "-fno-tree-loop-vectorize" not in compiler.flags_for(simd), "omp simd loops keep the loop vectorizer"


# ---------------------------------------------------------------- the known-answer self-test

@needs_x86_cc
@pytest.mark.parametrize("march", MARCHES)
def test_self_test_passes_with_the_chosen_flags(monkeypatch, fresh_cache, march):
  compiler = _compiler(monkeypatch, march)
  assert compiler._run_self_test() == ("ok", [])


@needs_x86_cc
def test_self_test_catches_the_gcc12_miscompile_without_the_rules(monkeypatch, fresh_cache):
  """With the FLAG_RULES workarounds removed, gcc <= 12 at -march=x86-64-v3 gets any/all/max wrong: the self-test
  sees it, switches to the safe flags (then right) and warns once; the cache key names the safe flags."""
  monkeypatch.setattr(ops_clang, "FLAG_RULES", ())
  compiler = _compiler(monkeypatch, "x86-64-v3")
  if compiler.identity.family != "gcc" or compiler.identity.major > 12: pytest.skip("the miscompile is gcc <= 12's")
  with pytest.warns(RuntimeWarning, match="kat_any_rows"):
    compiler.verify()
  assert compiler.safe and "safe 1" in compiler.cache_key
  assert set(ops_clang.SAFE_FLAGS) <= set(compiler.flags_for(toolchain_check.C_KNOWN_ANSWERS[0].source))
  again = _compiler(monkeypatch, "x86-64-v3")    # the verdict comes from the disk now: no test run, no warning
  monkeypatch.setattr(again, "_run_self_test", lambda: pytest.fail("the cached verdict was not used"))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    ops_clang._WARNED.add(again.toolchain_key)   # once per process: already reported above
    again.verify()
  assert again.safe


@needs_x86_cc
def test_self_test_raises_when_even_the_safe_flags_are_wrong(monkeypatch, fresh_cache):
  known = toolchain_check.C_KNOWN_ANSWERS[2]    # int max of comparisons: 1 for (4, 1, 4, 3)
  wrong_answer = toolchain_check.KnownAnswer(known.name, known.source, known.output,
                                             (((("int", (4, 1, 4, 3)),), (7,)),), known.pattern)
  monkeypatch.setattr(toolchain_check, "C_KNOWN_ANSWERS", (wrong_answer,))
  compiler = _compiler(monkeypatch, "native")
  with pytest.raises(CompileError, match="kat_int_max_ne.*got \\[1\\], want \\[7\\]"):
    compiler.compile("void k(void) {}")


@needs_x86_cc
def test_self_test_verdict_is_cached_per_toolchain(monkeypatch, fresh_cache):
  first = _compiler(monkeypatch, "x86-64-v2")
  first.verify()
  assert toolchain_check.cached_verdict(first.toolchain_key) == ("ok", [])
  assert toolchain_check.cached_verdict(_compiler(monkeypatch, "x86-64-v3").toolchain_key) is None
  second = _compiler(monkeypatch, "x86-64-v2")
  monkeypatch.setattr(second, "_run_self_test", lambda: pytest.fail("the cached verdict was not used"))
  second.verify()


# ---------------------------------------------------------------- LLVM

try:
  from ourgrad.runtime import ops_llvm
except ImportError:  # pragma: no cover: llvmlite missing
  ops_llvm = None
needs_x86_llvm = pytest.mark.skipif(ops_llvm is None or not X86, reason="needs llvmlite on x86-64")


@needs_x86_llvm
def test_llvm_cpu_picks_the_target_and_its_width(monkeypatch, fresh_cache):
  keys = set()
  targets = [("x86-64-v2", 16), ("x86-64-v3", 32)] + ([("x86-64-v4", 64)] if host_has_avx512() else [])  # as CLANG's
  for cpu, width in targets:
    monkeypatch.setenv("LLVM_CPU", cpu)
    compiler = ops_llvm.LLVMCompiler()
    assert compiler.vector_bytes == width
    keys.add(compiler.cache_key)
  monkeypatch.setenv("LLVM_CPU", "x86-64-v4")
  monkeypatch.setenv("LLVM_FEATURES", "-avx512f")
  assert ops_llvm.LLVMCompiler().vector_bytes == 32, "LLVM_FEATURES applies after the CPU's own features"
  assert len(keys) == len(targets)


@needs_x86_llvm
def test_llvm_unknown_cpu_is_a_clear_error(monkeypatch):
  monkeypatch.setenv("LLVM_CPU", "no-such-cpu")
  with pytest.raises(DeviceError, match="LLVM_CPU='no-such-cpu'"):
    ops_llvm.LLVMCompiler()


@needs_x86_llvm
def test_llvm_features_the_host_lacks_are_named(monkeypatch):
  """LLVM_FEATURES turning on a feature this CPU lacks (the first of these it lacks) is refused by name; x86-64-v4
  with AVX-512 turned off is a target an AVX2 CPU runs."""
  host = ops_llvm.llvm.get_host_cpu_features()
  lacking = [feature for feature in ("avx512f", "xop", "sse4a", "avx512fp16", "amx-tile")
             if not host.get(feature, True)]
  if not lacking: pytest.skip("this CPU has every feature tried")
  monkeypatch.setenv("LLVM_FEATURES", f"+{lacking[0]}")
  with pytest.raises(DeviceError, match=rf"LLVM_FEATURES='\+{lacking[0]}'.*lacks \({lacking[0]}\).*LLVM_CPU=native"):
    ops_llvm.LLVMCompiler()
  if host.get("avx2"):
    monkeypatch.setenv("LLVM_CPU", "x86-64-v4")
    monkeypatch.setenv("LLVM_FEATURES", "-avx512f")
    assert ops_llvm.LLVMCompiler().vector_bytes == 32


@needs_x86_llvm
@pytest.mark.parametrize("cpu", ["x86-64-v2", "x86-64-v3", "native"])
def test_llvm_self_test_passes(monkeypatch, fresh_cache, cpu):
  monkeypatch.setenv("LLVM_CPU", cpu)
  assert ops_llvm.LLVMCompiler()._run_self_test() == ("ok", [])


@needs_x86_llvm
def test_llvm_self_test_raises_on_a_wrong_answer(monkeypatch, fresh_cache):
  known = toolchain_check.LLVM_KNOWN_ANSWERS[0]
  wrong_answer = toolchain_check.KnownAnswer(known.name, known.source, known.output,
                                             (((("float", (0.0,) * 12),), (True, True, True)),), known.pattern)
  monkeypatch.setattr(toolchain_check, "LLVM_KNOWN_ANSWERS", (wrong_answer,))
  with pytest.raises(CompileError, match="kat_any_rows"):
    ops_llvm.LLVMCompiler().verify()


# ---------------------------------------------------------------- opening devices

def test_opening_clang_1_as_the_first_device_does_not_deadlock():
  """Device['CLANG:1'] opens CLANG first to share its compiler: the open lock is re-entrant (it deadlocked)."""
  script = ("from ourgrad import Device, Tensor\nDevice['CLANG:1']\n"
            "print((Tensor([1.0, 2.0], device='CLANG:1') + 1).tolist())")
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO})
  assert result.returncode == 0, result.stderr
  assert result.stdout.split("\n")[-2] == str([2.0, 3.0])
