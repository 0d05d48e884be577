"""ops_llvm.features_host_lacks: the CPU features an LLVM target uses that this CPU lacks, the host's own target
(TargetChoice.native: the host CPU's name and feature list, queried from LLVM) built once per call."""
import platform

import pytest

from helpers import host_has_avx512

try:
  from ourgrad.runtime import ops_llvm
except ImportError:
  ops_llvm = None
pytestmark = pytest.mark.skipif(ops_llvm is None or platform.machine() not in ("x86_64", "AMD64"),
                                reason="needs llvmlite on x86-64")


def test_features_host_lacks_builds_the_native_target_once(monkeypatch):
  built = []
  native = ops_llvm.TargetChoice.native

  def counted() -> "ops_llvm.TargetChoice":
    built.append(1)
    return native()
  monkeypatch.setattr(ops_llvm.TargetChoice, "native", staticmethod(counted))
  assert ops_llvm.features_host_lacks(native(), 16) == []
  assert len(built) == 1
  built.clear()
  wide = ops_llvm.TargetChoice("x86-64-v4", "")
  assert ops_llvm.features_host_lacks(wide, 64) == ([] if host_has_avx512() else ["avx512f"])
  assert len(built) == 1
