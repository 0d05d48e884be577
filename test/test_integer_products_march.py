"""The CPU integer products of quantized matrices (PackedTensor.integer_linear: Q8_0, Q4_0, Q4_1 against x quantized
to 8-bit blocks; UOps.BYTE_DOT_ADD's helpers, renderer/cbytedot.py) rendered and compiled for each x86-64 level
whatever CPU runs the test: x86-64-v2 (SSSE3/SSE4.1, 16-byte lanes), x86-64-v3 (AVX2, 32), the host's own
-march=native, and x86-64-v4 (AVX-512, 64: compiled always, run only where the CPU has it). Each is checked against
numpy's integer block sums at odd sizes (odd row counts, block counts that do not fill a SIMD register). Q6_K's
product dequantizes in floats (no integer path): checked at each level against numpy's dequantization."""
from __future__ import annotations

import platform
import subprocess
import tempfile

import numpy as np
import pytest

from helpers import host_has_avx512
from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.device import Device
from ourgrad.engine.realize import run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.nn.gguf import GGML_Q4_0, GGML_Q4_1, GGML_Q6_K, GGML_Q8_0, PackedTensor
from ourgrad.renderer.cstyle import ClangRenderer
from ourgrad.runtime.ops_clang import ClangProgram
from test_gguf_packed import numpy_dequantize, numpy_integer_product, random_blocks

# -march -> (SIMD register bytes, registers)
LEVELS = {"x86-64-v2": (16, 16), "x86-64-v3": (32, 16), "x86-64-v4": (64, 32)}


def _compiler() -> str:
  if platform.machine() != "x86_64": pytest.skip("the -march levels are x86-64's")
  return Device["CLANG"].compiler.compiler


def _run_last_kernel(output: Tensor, march: str) -> np.ndarray | None:
  """`output` computed with its last kernel (the product) optimized, rendered and compiled for `march` (the kernels
  before it as usual); None where this CPU cannot run that level (x86-64-v4 without AVX-512: compiled only)."""
  schedule = [item for item in create_schedule([output.lazydata]) if item.outputs]
  run_schedule(schedule[:-1])
  item = schedule[-1]
  renderer = ClangRenderer()
  renderer.vector_bytes, renderer.vector_registers = LEVELS[march] if march in LEVELS else (
    Device["CLANG"].renderer.vector_bytes, Device["CLANG"].renderer.vector_registers)
  renderer.l2_cache_bytes = 1 << 20
  kernel = Kernel(item.ast, renderer)
  kernel.hand_coded_optimizations()
  source = renderer.render(kernel.name, linearize(kernel))
  compiler = Device["CLANG"].compiler
  flags = [flag for flag in compiler.flags_for(source) if not flag.startswith("-march=")] + [f"-march={march}"]
  with tempfile.TemporaryDirectory(prefix="ourgrad_test_") as folder:
    library = f"{folder}/kernel.so"
    subprocess.run([_compiler(), *flags, "-x", "c", "-", "-o", library, "-lm"], input=source, text=True, check=True,
                   capture_output=True)
    if march == "x86-64-v4" and not host_has_avx512(): return None
    with open(library, "rb") as compiled: program = ClangProgram(kernel.name, compiled.read())
  for buffer in item.bufs: buffer.allocate()
  program.function(*[buffer.host_pointer() for buffer in item.bufs])
  return item.bufs[0].numpy().reshape(output.shape)


@pytest.mark.parametrize("march", ["x86-64-v2", "x86-64-v3", "native", "x86-64-v4"])
@pytest.mark.parametrize("ggml_type", [GGML_Q4_1, GGML_Q8_0, GGML_Q4_0], ids=["Q4_1", "Q8_0", "Q4_0"])
def test_integer_product_at_each_level(ggml_type: int, march: str) -> None:
  rows, columns = 13, 288   # 9 blocks of 32 a row: neither 2, 4 nor 8 registers' worth
  rng = np.random.default_rng(rows + ggml_type)
  raw = random_blocks(ggml_type, rows * columns // 32, rng)
  packed = PackedTensor.from_blocks(ggml_type, Tensor(raw), (rows, columns))
  x_np = rng.standard_normal((1, columns)).astype(np.float32)
  x_np[0, 32:64] = 0.0   # an all-zero block (d_x = 0)
  got = _run_last_kernel(packed.integer_linear(Tensor(x_np)), march)
  if got is None: return
  np.testing.assert_allclose(got, numpy_integer_product(ggml_type, raw, x_np), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("march", ["x86-64-v2", "x86-64-v3", "x86-64-v4"])
def test_q6_k_product_at_each_level(march: str) -> None:
  rows, columns = 7, 512   # Q6_K's blocks are 256 long
  rng = np.random.default_rng(6)
  raw = random_blocks(GGML_Q6_K, rows * columns // 256, rng)
  packed = PackedTensor.from_blocks(GGML_Q6_K, Tensor(raw), (rows, columns))
  x_np = rng.standard_normal((1, columns)).astype(np.float32)
  got = _run_last_kernel(packed.linear(Tensor(x_np)), march)
  if got is None: return
  weights = numpy_dequantize(GGML_Q6_K, raw).reshape(rows, columns).astype(np.float64)
  np.testing.assert_allclose(got, x_np.astype(np.float64) @ weights.T, rtol=1e-4, atol=1e-3)
