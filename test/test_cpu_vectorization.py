"""Whether gcc vectorizes the CPU kernels' `omp simd` loops at both x86 SIMD widths, AVX2 (-march=x86-64-v3, 8
floats) and AVX-512 (-march=x86-64-v4, 16 floats), whatever CPU runs the test: each kernel is rendered for that
width (the renderer's vector_bytes) and compiled, not run, with the flags the CLANG device would give it at that
-march, and gcc's -fopt-info-vec report must name every `omp simd` loop as vectorized. A loop gcc leaves scalar runs
8-16x slower with no wrong number to show for it: softmax's exp at -march=x86-64-v3 (a select whose arm may raise a
floating-point flag was a branch without -fno-trapping-math), and the max-pool backward's first-max selection (an OR
of an equality and a NaN test, which gcc 12 does not vectorize, made the MNIST step's BatchNorm backward kernel
scalar at both widths).

Needs gcc as the CLANG device's compiler on x86-64 (skipped otherwise: the report format is gcc's).
"""
from __future__ import annotations

import platform
import re
import subprocess

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.device import Device
from ourgrad.engine.schedule import create_schedule
from ourgrad.ops import Ops
from ourgrad.renderer.cstyle import ClangRenderer

WIDTHS = {"x86-64-v3": 32, "x86-64-v4": 64}   # -march -> SIMD register bytes


def _gcc() -> str:
  if platform.machine() != "x86_64": pytest.skip("the -march levels are x86-64's")
  compiler = Device["CLANG"].compiler
  if compiler.identity.family != "gcc": pytest.skip("the vectorizer report parsed here is gcc's")
  return compiler.compiler


def _sources(outputs: list[Tensor], vector_bytes: int) -> list[str]:
  """The C source of each kernel of the outputs' schedule, optimized by the default heuristic for `vector_bytes`."""
  renderer = ClangRenderer()
  renderer.vector_bytes = vector_bytes
  sources = []
  for item in create_schedule([out.lazydata for out in outputs]):
    if item.ast.op in (Ops.COPY, Ops.PACK): continue
    kernel = Kernel(item.ast, renderer)
    kernel.hand_coded_optimizations()
    sources.append(renderer.render(kernel.name, linearize(kernel)))
  return sources


def _scalar_simd_loops(source: str, march: str) -> list[int]:
  """Line numbers of the `omp simd` loops of `source` that gcc leaves scalar at -march=`march`."""
  compiler = Device["CLANG"].compiler
  flags = [flag for flag in compiler.flags_for(source) if not flag.startswith("-march=") and flag != "-shared"]
  done = subprocess.run([_gcc(), *flags, f"-march={march}", "-fopt-info-vec-optimized", "-x", "c", "-c", "-",
                         "-o", "/dev/null"], input=source, capture_output=True, text=True, check=True)
  vectorized = {int(line) for line in re.findall(r"<stdin>:(\d+):\d+: optimized: loop vectorized", done.stderr)}
  lines = source.splitlines()
  scalar = []
  for number, line in enumerate(lines):
    if not (line.strip().startswith("#pragma omp") and "simd" in line): continue
    # the `for` after the pragma, to its closing brace at the same indentation (an innermost loop: gcc reports a
    # statement of its body); 1-based line numbers as gcc's
    indent = len(lines[number + 1]) - len(lines[number + 1].lstrip())
    end = next(index for index in range(number + 2, len(lines)) if lines[index].startswith(" " * indent + "}"))
    if not any(number + 2 <= report <= end + 1 for report in vectorized): scalar.append(number + 2)
  return scalar


def _assert_vectorized(outputs: list[Tensor], march: str, least: int) -> None:
  sources = [source for source in _sources(outputs, WIDTHS[march]) if "omp simd" in source or "omp parallel for simd"
             in source]
  assert sum(source.count("simd") for source in sources) >= least, "the kernels lost their `omp simd` loops"
  for source in sources:
    scalar = _scalar_simd_loops(source, march)
    assert not scalar, f"gcc left the `omp simd` loops at lines {scalar} scalar at -march={march}:\n{source}"


@pytest.mark.parametrize("march", sorted(WIDTHS))
def test_softmax_exp_vectorizes(march: str):
  _assert_vectorized([Tensor.empty(8, 4096).softmax(-1)], march, least=3)


@pytest.mark.parametrize("march", sorted(WIDTHS))
def test_max_pool_backward_vectorizes(march: str):
  """MNIST's block end: BatchNorm-like affine, ReLU, 2x2 max-pool; the input gradient's kernels."""
  x = Tensor(np.random.default_rng(0).standard_normal((4, 8, 24, 24), dtype=np.float32), requires_grad=True)
  scale = Tensor.ones(1, 8, 1, 1, requires_grad=True)
  (x * scale + 0.5).relu().max_pool2d().sum().backward()
  _assert_vectorized([x.grad, scale.grad], march, least=1)
