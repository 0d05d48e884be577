"""Run the fused attention forward kernel's CUDA source on the CPU: a test harness, not a device.

The same model as test/attention_backward_host.py (whose prelude and `mma` it reuses): the source
codegen/attention_render.py writes is compiled with g++ after a prelude that defines CUDA's keywords away and gives
each CUDA thread of a block a fiber (barriers for __syncthreads/__syncwarp, shuffles through per-warp slots).
The kernel's PTX helpers (`kernel_helpers`) are replaced by host versions: mma gathers the warp's fragments by the
maps of codegen/tensor_cores.py, ldmatrix (and .trans) hands each lane its elements of the 8x8 matrices the lanes' row
addresses name, cvt rounds as the hardware does, cp.async copies at once. So the kernel's own index math, masks,
tiles, fragment loads and stores run as written: a wrong lane mapping gives wrong numbers here as on the GPU.
"""
from __future__ import annotations

import os
import subprocess
import tempfile

import numpy as np

from attention_backward_host import (HOST_CONVERSIONS, PACKED_OPERANDS, PRELUDE, host_binary, host_main, host_mma,
                                     run_binary, wgmma_host_helpers)
from ourgrad.codegen.attention import AttentionPlan
from ourgrad.codegen.attention_render import render_attention
from ourgrad.codegen.attention_helpers import POLY_EXP2_HELPER

FORWARD_PRELUDE = r"""
inline float __int_as_float(int bits) { float f; memcpy(&f, &bits, 4); return f; }
inline int __float_as_int(float f) { int bits; memcpy(&bits, &f, 4); return bits; }
// the warp's vote: every lane posts its flag, then reads all 32
inline bool __any_sync(unsigned, bool flag) {
  WarpSlots& slots = warp_slots[threadIdx.x / 32];
  slots.value[threadIdx.x & 31] = flag ? 1.0f : 0.0f; __syncwarp();
  bool any = false;
  for (int lane = 0; lane < 32; lane++) any = any || slots.value[lane] != 0.0f;
  __syncwarp();
  return any;
}
"""   # (float2 and make_float2: the PRELUDE of attention_backward_host.py)

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

# plan.producer on the host: mbarriers (by shared address) whose phase flips when the expected arrivals are in, and
# whose wait blocks until the phase of the asked parity is over; copies land at once, so copies_arrive arrives; the
# register hand-over does nothing. A wgmma waits for its own warpgroup only (the producer never multiplies)
PRODUCER_HELPERS = r"""
struct HostMbarrier { int expected = 0, pending = 0, phase = 0; };
HostMbarrier host_mbarriers[(1 << 18) / 8];
inline void barrier_init(unsigned barrier, unsigned count) {
  HostMbarrier& b = host_mbarriers[barrier / 8];
  b.expected = b.pending = (int)count; b.phase = 0; }
inline void barrier_arrive(unsigned barrier) {
  HostMbarrier& b = host_mbarriers[barrier / 8];
  if (--b.pending == 0) { b.pending = b.expected; b.phase ^= 1; }
}
inline void barrier_wait(unsigned barrier, unsigned parity) {
  HostMbarrier& b = host_mbarriers[barrier / 8];
  wait_until([&] { return b.phase != (int)parity; });
}
inline void copies_arrive(unsigned barrier) { barrier_arrive(barrier); }
// bar.sync / bar.arrive: a phase ends when `count` threads arrived; sync also waits for its end
struct NamedBarrier { int arrived = 0, generation = 0; };
NamedBarrier named_barriers[16];
inline int named_arrival(unsigned id, unsigned count) {
  NamedBarrier& b = named_barriers[id];
  const int mine = b.generation;
  if (++b.arrived == (int)count) { b.arrived = 0; b.generation++; }
  return mine;
}
inline void named_arrive(unsigned id, unsigned count) { named_arrival(id, count); }
inline void named_sync(unsigned id, unsigned count) {
  const int mine = named_arrival(id, count);
  NamedBarrier& b = named_barriers[id];
  wait_until([&] { return b.generation != mine; });
}
inline void producer_registers() {}
inline void consumer_registers() {}
"""


def _wgmma_helpers(plan: AttentionPlan) -> str:
  """The host wgmma (test/attention_backward_host.py: its threads meet by warpgroup, so a producer warpgroup that
  never multiplies does not hold it up); with a producer warpgroup also PRODUCER_HELPERS."""
  helpers = wgmma_host_helpers(plan.block_n, plan.head_dim)
  if "__syncthreads();" in helpers: raise AssertionError("the host wgmma meets the whole CTA, not its warpgroup")
  return PRODUCER_HELPERS + helpers if plan.producer else helpers


def host_source(plan: AttentionPlan) -> str:
  """The kernel as a C++ program: it reads its buffers (out, q, k, v) from the files named on its command line, runs
  every block of the grid (one fiber per CUDA thread) and writes them back."""
  helpers = HOST_CONVERSIONS[plan.dtype] + ("" if plan.dtype == "float32" else PACKED_OPERANDS) + \
      host_mma(plan.dtype) + FORWARD_HELPERS + PACKING[plan.dtype] + (POLY_EXP2_HELPER if plan.exp_poly else "") + \
      (_wgmma_helpers(plan) if plan.mma == "wgmma" else "")
  source = render_attention(plan, "attention", {"out": 0, "q": 1, "k": 2, "v": 3}, helpers=helpers)
  source = source.replace("extern __shared__ __align__(16) unsigned char attention_shared[];",
                          "alignas(16) unsigned char attention_shared[1 << 18];")
  storage = "float" if plan.dtype == "float32" else "unsigned short"
  arguments = ", ".join(f"({storage}*)buffers[{index}]" for index in range(4))
  return PRELUDE + FORWARD_PRELUDE + source + host_main(f"attention({arguments})", plan.threads, plan.global_size,
                                                       written=1)


def run_forward_on_host(plan: AttentionPlan, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
  """The kernel of `plan` run on the host on flat buffers q, k, v (numpy arrays of the stored elements, bfloat16 as
  uint16 bits); returns the output buffer's bytes (plan.output_elements elements of the operand type)."""
  itemsize = 4 if plan.dtype == "float32" else 2
  binary_path = host_binary(host_source(plan))
  with tempfile.TemporaryDirectory(prefix="ourgrad_attention_forward_host_") as folder:
    paths = [os.path.join(folder, f"{name}.bin") for name in ("out", "q", "k", "v")]
    np.zeros(plan.output_elements * itemsize, dtype=np.uint8).tofile(paths[0])
    for path, array in zip(paths[1:], (q, k, v)): np.ascontiguousarray(array).tofile(path)
    run_binary(binary_path, paths)
    return np.fromfile(paths[0], dtype=np.uint8)


def evaluate_poly_exp2_on_host(points: np.ndarray) -> np.ndarray:
  """codegen/attention_helpers.py's POLY_EXP2_HELPER compiled with g++ and evaluated at float32 `points`."""
  main = r"""
int main(int argc, char** argv) {
  FILE* in = fopen(argv[1], "rb"); FILE* out = fopen(argv[2], "wb"); float x;
  while (fread(&x, 4, 1, in) == 1) { float y = poly_exp2(x); fwrite(&y, 4, 1, out); }
  fclose(in); fclose(out); return 0;
}
"""
  binary_path = host_binary(PRELUDE + FORWARD_PRELUDE + POLY_EXP2_HELPER + main)
  with tempfile.TemporaryDirectory(prefix="ourgrad_poly_exp2_") as folder:
    inputs, outputs = os.path.join(folder, "in.bin"), os.path.join(folder, "out.bin")
    np.ascontiguousarray(points, dtype=np.float32).tofile(inputs)
    subprocess.run([binary_path, inputs, outputs], check=True)
    return np.fromfile(outputs, dtype=np.float32)
