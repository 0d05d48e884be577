"""Run the fused attention forward kernel's CUDA source on the CPU: a test harness, not a device.

The same model as test/attention_backward_host.py (whose prelude and `mma` it reuses): the source of
codegen/attention.py is compiled with g++ after a prelude that defines CUDA's keywords away and gives each CUDA thread
of a block a host thread (barriers for __syncthreads/__syncwarp, shuffles through per-warp slots). The kernel's PTX
helpers (`kernel_helpers`) are replaced by host versions: mma gathers the warp's fragments by the maps of
codegen/tensor_cores.py, ldmatrix (and .trans) hands each lane its elements of the 8x8 matrices the lanes' row
addresses name, cvt rounds as the hardware does, cp.async copies at once. So the kernel's own index math, masks,
tiles, fragment loads and stores run as written: a wrong lane mapping gives wrong numbers here as on the GPU.
"""
from __future__ import annotations

import os
import subprocess
import tempfile

import numpy as np

from attention_backward_host import HOST_CONVERSIONS, PACKED_OPERANDS, PRELUDE, host_compiler, host_main, host_mma
from ourgrad.codegen.attention import AttentionPlan, render_attention
from ourgrad.codegen.wgmma_tiles import CExpr, accumulator_position

FORWARD_PRELUDE = r"""
inline float __int_as_float(int bits) { float f; memcpy(&f, &bits, 4); return f; }
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return float2{x, y}; }
"""

# the forward's helper names on the host: mma with pointer operands, packing, ldmatrix over 16-bit rows, copies
FORWARD_HELPERS = r"""
inline void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  const unsigned b[2] = {b0, b1};
  mma(*(float (*)[4])c, *(const unsigned (*)[4])a, b);
}
inline unsigned pack_bits(unsigned short low, unsigned short high) { return (unsigned)low | ((unsigned)high << 16); }
// ldmatrix.x4: lane l names row l % 8 of matrix l / 8 (8 16-bit elements); lane l receives the 32 bits at (row l / 4,
// columns 2 (l % 4), + 1) of each matrix, or with .trans (rows 2 (l % 4) and + 1, column l / 4)
inline void host_ldmatrix(unsigned* r, const void* row, bool transposed) {
  WarpSlots& slots = warp_slots[threadIdx.x / 32];
  const int lane = threadIdx.x & 31;
  slots.row[lane] = row; __syncwarp();
  for (int m = 0; m < 4; m++) {
    const unsigned short* const* rows = (const unsigned short* const*)&slots.row[8 * m];
    const unsigned short low = transposed ? rows[2 * (lane % 4)][lane / 4] : rows[lane / 4][2 * (lane % 4)];
    const unsigned short high = transposed ? rows[2 * (lane % 4) + 1][lane / 4] : rows[lane / 4][2 * (lane % 4) + 1];
    r[m] = (unsigned)low | ((unsigned)high << 16);
  }
  __syncwarp();
}
inline void load_matrices(unsigned* r, const void* rows) { host_ldmatrix(r, rows, false); }
inline void load_matrices_transposed(unsigned* r, const unsigned short* rows) { host_ldmatrix(r, rows, true); }
inline void copy16(void* target, const void* source, bool inside) {
  if (inside) memcpy(target, source, 16); else memset(target, 0, 16); }
inline float fast_exp2(float x) { return exp2f(x); }
inline void copy_commit() {}
inline void copy_wait_all_but_one() {}
"""

PACKING = {
  "float32": "inline unsigned tf32(float value) { return operand_bits(value); }\n",
  "float16": "",   # pack_floats comes with the backward harness's PACKED_OPERANDS
}
PACKING["bfloat16"] = PACKING["float16"]


# the wgmma kernel's helpers on the host (codegen/attention_wgmma.py): shared addresses are byte offsets into
# attention_shared; a wgmma gathers the A registers of the CTA's threads (each warp's as an m16n8k16 A fragment of
# its 16 rows, the A_MAP of host_mma), reads B from the shared image through its descriptor as the PTX ISA's canonical
# 128-byte-swizzled layouts say (as runtime/wgmma_emulator.py `read_operand`), and adds to each thread's accumulators
# at their wgmma_tiles.accumulator_position. The fences and waits have nothing to wait for.
WGMMA_HOST_HELPERS = r"""
inline unsigned shared_address(const void* pointer) {
  return (unsigned)((const unsigned char*)pointer - attention_shared); }
inline unsigned long long wgmma_descriptor(unsigned address, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((address & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
         ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}
inline void stage16(unsigned target, const void* source, bool inside) {
  if (inside) memcpy(attention_shared + target, source, 16); else memset(attention_shared + target, 0, 16); }
inline void async_proxy_fence() {}
inline void wgmma_fence() {}
inline void wgmma_commit() {}
inline void wgmma_wait_all() {}
inline void wgmma_wait_one() {}
inline void copy_wait_all() {}
unsigned wgmma_a_slots[1024][4];
// element (row along N, k) of the B operand of descriptor `b`: K-major (rows of K) or MN-major (transposed)
inline float shared_operand(unsigned long long b, int row, int k, bool mn_major) {
  if ((b >> 62) != 1) { fprintf(stderr, "not a 128-byte-swizzle descriptor\n"); exit(2); }
  const unsigned start = (unsigned)(b & 0x3FFF) << 4, lbo = (unsigned)((b >> 16) & 0x3FFF) << 4;
  const unsigned sbo = (unsigned)((b >> 32) & 0x3FFF) << 4;
  unsigned address = mn_major ? start + (row / 64) * lbo + (k / 8) * sbo + (k % 8) * 128 + 2 * (row % 64)
                              : start + (row / 8) * sbo + (row % 8) * 128 + 2 * k;
  address ^= ((address >> 7) & 7) << 4;
  elem_t bits; memcpy(&bits, attention_shared + address, 2);
  return to_float(bits);
}
inline void host_wgmma(float* acc, const unsigned* a, unsigned long long b, int n, bool mn_major, int accumulate) {
  memcpy(wgmma_a_slots[threadIdx.x], a, 16);
  __syncthreads();
  const int first = threadIdx.x / 128 * 128, thread = threadIdx.x % 128;
  float A[64][16];
  for (int other = 0; other < 128; other++) {
    const int warp = other / 32, g = (other % 32) >> 2, quad = other & 3;
    for (int e = 0; e < 8; e++) {
      const int* m = A_MAP[e];
      A[16 * warp + m[0] + m[1] * g + m[2] * quad][m[3] + m[4] * g + m[5] * quad] =
        operand_value(wgmma_a_slots[first + other], e);
    }
  }
  for (int i = 0; i < n / 2; i++) {
    const int row = ACC_ROW, column = ACC_COLUMN;
    float sum = 0.0f;
    for (int k = 0; k < 16; k++) sum += A[row][k] * shared_operand(b, column, k, mn_major);
    acc[i] = accumulate ? acc[i] + sum : sum;
  }
  __syncthreads();
}
inline void wgmma_scores(float* acc, const unsigned* a, unsigned long long b, int accumulate) {
  host_wgmma(acc, a, b, BLOCK_N, false, accumulate); }
// A from shared memory too (the Q tile), through its K-major descriptor
inline void wgmma_scores(float* acc, unsigned long long a, unsigned long long b, int accumulate) {
  const int thread = threadIdx.x % 128;
  for (int i = 0; i < BLOCK_N / 2; i++) {
    const int row = ACC_ROW, column = ACC_COLUMN;
    float sum = 0.0f;
    for (int k = 0; k < 16; k++) sum += shared_operand(a, row, k, false) * shared_operand(b, column, k, false);
    acc[i] = accumulate ? acc[i] + sum : sum;
  }
}
inline void wgmma_values(float* acc, const unsigned* a, unsigned long long b, int accumulate) {
  host_wgmma(acc, a, b, HEAD_DIM, true, accumulate); }
"""


def wgmma_host_helpers(plan: AttentionPlan) -> str:
  """WGMMA_HOST_HELPERS for `plan`: its shapes, and the accumulator position formula of codegen/wgmma_tiles.py."""
  row, column = accumulator_position(CExpr("thread"), CExpr("i"))
  return (WGMMA_HOST_HELPERS.replace("ACC_ROW", str(row)).replace("ACC_COLUMN", str(column))
          .replace("BLOCK_N", str(plan.block_n)).replace("HEAD_DIM", str(plan.head_dim)))


def host_source(plan: AttentionPlan) -> str:
  """The kernel as a C++ program: it reads its buffers (out, q, k, v) from the files named on its command line, runs
  every block of the grid (one host thread per CUDA thread) and writes them back."""
  helpers = HOST_CONVERSIONS[plan.dtype] + ("" if plan.dtype == "float32" else PACKED_OPERANDS) + \
      host_mma(plan.dtype) + FORWARD_HELPERS + PACKING[plan.dtype] + \
      (wgmma_host_helpers(plan) if plan.mma == "wgmma" else "")
  source = render_attention(plan, "attention", {"out": 0, "q": 1, "k": 2, "v": 3}, helpers=helpers)
  source = source.replace("extern __shared__ __align__(16) unsigned char attention_shared[];",
                          "alignas(16) unsigned char attention_shared[1 << 18];")
  storage = "float" if plan.dtype == "float32" else "unsigned short"
  arguments = ", ".join(f"({storage}*)buffers[{index}].data()" for index in range(4))
  return PRELUDE + FORWARD_PRELUDE + source + host_main(f"attention({arguments})", plan.threads, plan.global_size,
                                                       written=1)


def run_forward_on_host(plan: AttentionPlan, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
  """The kernel of `plan` run on the host on flat buffers q, k, v (numpy arrays of the stored elements, bfloat16 as
  uint16 bits); returns the output buffer's bytes (plan.output_elements elements of the operand type)."""
  compiler = host_compiler()
  if compiler is None: raise RuntimeError("no g++ to run the kernel on the host")
  itemsize = 4 if plan.dtype == "float32" else 2
  with tempfile.TemporaryDirectory(prefix="ourgrad_attention_forward_host_") as folder:
    source_path, binary_path = os.path.join(folder, "attention.cpp"), os.path.join(folder, "attention")
    with open(source_path, "w") as source_file: source_file.write(host_source(plan))
    subprocess.run([compiler, "-std=c++17", "-O1", "-pthread", "-w", source_path, "-o", binary_path], check=True,
                   capture_output=True, text=True)
    paths = [os.path.join(folder, f"{name}.bin") for name in ("out", "q", "k", "v")]
    np.zeros(plan.output_elements * itemsize, dtype=np.uint8).tofile(paths[0])
    for path, array in zip(paths[1:], (q, k, v)): np.ascontiguousarray(array).tofile(path)
    subprocess.run([binary_path, *paths], check=True, capture_output=True)
    return np.fromfile(paths[0], dtype=np.uint8)
