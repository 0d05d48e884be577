"""CUDA's byte vectors (renderer/cuda.py): 4 bytes (Q8_0's quants) loaded and stored as one 32-bit word, a lane taken
out by a shift, and a lane converted to float32 through its bits (`byte_lane_float`: one byte_perm under the exponent
of 2^23 and one float add, instead of a conversion instruction at a fraction of the float rate).

The kernels are lowered for CUDA's limits and run in the PYTHON device's emulation against numpy (the UOps); their
CUDA source is compiled with NVRTC where it loads, and the conversion helper the renderer writes runs on the host
(g++, with __byte_perm as the CUDA documentation defines it) for every byte of every lane.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel
from ourgrad.dtype import dtypes
from ourgrad.engine.realize import run_schedule
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.nn.gguf import GGML_Q8_0, PackedTensor, quantize_q8_0
from ourgrad.ops import Ops
from ourgrad.runtime.ops_python import PythonRenderer

from extra.models.llama import inverse_rms_per_output
from helpers import cuda_source, nvrtc_compiler, run_on_python_checking_cuda
from test_gguf_packed import numpy_dequantize

NVRTC = nvrtc_compiler()

# CUDA's intrinsics on the host: __byte_perm(x, y, s) picks result byte n from the 8 bytes {y, x} (x's bytes 0-3,
# y's 4-7) by the low 3 bits of s's nibble n
HOST_INTRINSICS = r"""
#include <cstdio>
#include <cstring>
#define __device__
#define __forceinline__ inline
static unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
  unsigned long long bytes = ((unsigned long long)y << 32) | x;
  unsigned int result = 0;
  for (int n = 0; n < 4; n++) result |= (unsigned int)((bytes >> (8 * ((s >> (4 * n)) & 7))) & 0xFF) << (8 * n);
  return result;
}
static float __int_as_float(unsigned int bits) { float f; memcpy(&f, &bits, 4); return f; }
"""


def _kernel_item(out: Tensor) -> ScheduleItem:
  schedule = create_schedule([out.lazydata])
  run_schedule(schedule[:-1])
  assert schedule[-1].ast.op is not Ops.COPY
  return schedule[-1]


def _emulated(item: ScheduleItem) -> np.ndarray:
  """The kernel with the CUDA defaults, run in the PYTHON device's emulation of CUDA."""
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  kernel.hand_coded_optimizations()
  return run_on_python_checking_cuda(kernel, item, None)


def _q8_0_product(rows: int, k: int) -> tuple[Tensor, np.ndarray]:
  """A decode step's Q8_0 product with the RMS of its input recomputed beside each output (a row kernel), and
  numpy's result from its dequantized blocks."""
  rng = np.random.default_rng(rows + k)
  w_np, x_np = rng.standard_normal((rows, k)).astype(np.float32), rng.standard_normal((1, 1, k)).astype(np.float32)
  blocks = quantize_q8_0(w_np)
  packed = PackedTensor.from_blocks(GGML_Q8_0, Tensor(blocks, device="PYTHON"), w_np.shape)
  x = Tensor(x_np, device="PYTHON")
  out = packed.linear(x) * inverse_rms_per_output(x, rows, 1e-5, packed.row_blocks)
  values = numpy_dequantize(GGML_Q8_0, blocks).reshape(rows, k)
  return out, values @ x_np[0, 0] / np.sqrt(np.mean(x_np[0, 0] ** 2) + 1e-5)


@pytest.mark.parametrize("rows, k", [(96, 128), (40, 96)], ids=["96x128", "40x96_odd_blocks"])
def test_q8_0_product_converts_quants_through_their_bits(rows: int, k: int) -> None:
  """The product's quants load as 32-bit words and become floats through byte_lane_float (no byte vector type, no
  conversion of a byte); its values in the emulation against numpy's dequantization."""
  out, expected = _q8_0_product(rows, k)
  item = _kernel_item(out)
  source = cuda_source(item, NVRTC)
  assert "byte_lane_float(" in source and "uchar4" not in source and "unsigned int vec" in source
  got = _emulated(item)
  np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no host C++ compiler")
def test_byte_lane_float_is_exact_for_every_byte() -> None:
  """The helper the renderer writes, compiled on the host: every byte value in every lane of a word, as a signed and
  as an unsigned byte, against numpy's int8 and uint8 values."""
  out, _ = _q8_0_product(8, 64)
  source = cuda_source(_kernel_item(out), NVRTC)
  helper = re.search(r"__device__ __forceinline__ float byte_lane_float\(.*?\n.*?\n.*?\}\n", source, re.S)
  assert helper is not None
  program = HOST_INTRINSICS + helper.group(0) + r"""
int main() {
  for (unsigned int value = 0; value < 256; value++)
    for (int lane = 0; lane < 4; lane++) {
      unsigned int word = (value << (8 * lane)) | (0x5Au << (8 * ((lane + 1) % 4)));   // a neighbour byte set too
      printf("%g %g\n", byte_lane_float(word, lane, true), byte_lane_float(word, lane, false));
    }
}
"""
  with tempfile.TemporaryDirectory() as directory:
    path = Path(directory)
    (path / "lanes.cpp").write_text(program)
    subprocess.run(["g++", "-O1", "-o", str(path / "lanes"), str(path / "lanes.cpp")], check=True)
    printed = subprocess.run([str(path / "lanes")], check=True, capture_output=True, text=True).stdout
  got = np.array([line.split() for line in printed.splitlines()], dtype=np.float32).reshape(256, 4, 2)
  values = np.arange(256, dtype=np.uint8)
  np.testing.assert_array_equal(got[..., 0], np.repeat(values.view(np.int8).astype(np.float32)[:, None], 4, 1))
  np.testing.assert_array_equal(got[..., 1], np.repeat(values.astype(np.float32)[:, None], 4, 1))


def test_byte_vectors_store_as_words() -> None:
  """A uint8 elementwise kernel (bytes in, bytes out) stores 4 bytes as one packed word and reads its lanes by
  shifts; values in the emulation against numpy (wrapping at 256)."""
  data = np.arange(256, dtype=np.uint8)
  x = Tensor(data, device="PYTHON")
  item = _kernel_item((x + 3).cast(dtypes.uint8))
  source = cuda_source(item, NVRTC)
  assert "*((unsigned int*)(data0+" in source and "uchar4" not in source
  got = _emulated(item)
  np.testing.assert_array_equal(got, (data + 3).astype(np.uint8))


def test_emulated_cuda_takes_cudas_vector_lanes() -> None:
  """EMULATE=CUDA vectorizes as CUDA does, bytes included (one 32-bit word at most: `byte_vector_lanes`): with 16
  bytes a vector the emulation made a decode step's Q8_0 down projection 4 bytes a thread wider than CUDA's, a kernel
  the CUDA renderer cannot write (no 16-byte byte vector), so its tests checked a kernel the GPU never runs."""
  from ourgrad.renderer.cuda import CUDARenderer
  emulated, cuda = PythonRenderer("CUDA"), CUDARenderer()
  for dtype in (dtypes.float32, dtypes.float16, dtypes.bfloat16, dtypes.int32, dtypes.uint8, dtypes.int8):
    assert emulated.vector_lanes(dtype) == cuda.vector_lanes(dtype), dtype


def test_q8_0_down_projection_lowers_as_on_cuda() -> None:
  """A one-token Q8_0 down projection whose input is the SwiGLU recomputed on its loads (LlamaBlock._feed_forward on
  a GPU) plus the residual: the emulation applies the opts CUDA's renderer does, CUDA's source renders (and compiles
  where NVRTC loads), and the emulated values match numpy's."""
  from ourgrad.renderer.cuda import CUDARenderer
  rows, hidden = 32, 256
  rng = np.random.default_rng(7)
  w_np = rng.standard_normal((rows, hidden)).astype(np.float32)
  gate_up_np = rng.standard_normal((1, 1, 2 * hidden)).astype(np.float32)
  x_np = rng.standard_normal((1, 1, rows)).astype(np.float32)
  blocks = quantize_q8_0(w_np)
  packed = PackedTensor.from_blocks(GGML_Q8_0, Tensor(blocks, device="PYTHON"), w_np.shape)
  gate, up = Tensor(gate_up_np, device="PYTHON").chunk(2, dim=-1)
  item = _kernel_item(Tensor(x_np, device="PYTHON") + packed.linear(gate.silu() * up))
  emulated, cuda = Kernel(item.ast, PythonRenderer("CUDA")), Kernel(item.ast, CUDARenderer())
  emulated.hand_coded_optimizations()
  cuda.hand_coded_optimizations()
  assert emulated.applied_opts == cuda.applied_opts
  cuda_source(item, NVRTC)
  g, u = gate_up_np[0, 0, :hidden], gate_up_np[0, 0, hidden:]
  expected = x_np[0, 0] + numpy_dequantize(GGML_Q8_0, blocks).reshape(rows, hidden) @ (g / (1 + np.exp(-g)) * u)
  got = run_on_python_checking_cuda(emulated, item, None)
  np.testing.assert_allclose(got.reshape(expected.shape), expected, rtol=1e-4, atol=1e-4)
