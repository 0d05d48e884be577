"""Run the attention backward kernels' CUDA source on the CPU: a test harness, not a device.

The source of codegen/attention_backward.py is compiled with g++ as C++ after a prelude that defines CUDA's keywords
away and gives each CUDA thread of a block a fiber (switched at its waits: a barrier's generation, an mbarrier's
phase; a wait no thread can end is reported as the hang it is on the GPU): __syncthreads and __syncwarp are barriers,
__shfl_xor_sync swaps through per-warp slots. The binaries are cached by source (`host_binary`).
The PTX helpers (`instruction_helpers`) are replaced by host versions: the conversions
round as cvt does, and `mma` gathers the 32 lanes' fragments of one warp (by the maps of codegen/tensor_cores.py),
rebuilds A and B, and gives each lane its elements of A @ B + C. So the kernels' own index math, masks, tiles,
barriers and fragment loads run as written; a wrong one gives wrong numbers here as on the GPU.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile

import numpy as np

from ourgrad.codegen import attention_backward_producer, attention_backward_wgmma
from ourgrad.codegen.attention_backward import _k_step, fragment_maps, instruction_helpers, launches
from ourgrad.codegen.attention_backward_plan import DQ_KERNEL, AttentionBackwardPlan, KernelLaunch
from ourgrad.codegen.wgmma_tiles import CExpr, accumulator_position

PRELUDE = r"""
// the C math functions the kernels call, declared here (g++ knows them as builtins): <math.h> in C++ brings
// libstdc++'s <cmath>, 20,000 lines whose parsing was a third of a kernel's compile
extern "C" {
float exp2f(float); float expf(float); float log2f(float); float logf(float); float fmaf(float, float, float);
float fmaxf(float, float); float fminf(float, float); float fabsf(float); float sqrtf(float); float floorf(float);
float ceilf(float); float rintf(float); float roundf(float); float truncf(float); float ldexpf(float, int);
float powf(float, float); float tanhf(float); float copysignf(float, float);
}
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#include <string.h>
#include <stdio.h>
#include <stdlib.h>
#include <ucontext.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__
#define __align__(n)
#define __shared__
struct Dim3 { int x, y, z; };
Dim3 threadIdx, blockIdx, blockDim, gridDim;   // threadIdx: the running fiber's, set by run_block at each switch
template <class T> inline T min(T a, T b) { return b < a ? b : a; }
// The CUDA threads of a block are fibers of one host thread: each runs until it waits (a barrier, an mbarrier's
// phase), then the next runs. No locks are needed (a fiber is never interrupted between waits), a switch costs no
// system call's wake-up, and a wait no thread can end (a whole round of the block's fibers with no wait passed) is
// the GPU's hang: reported, not waited for
struct Fiber { ucontext_t context; char* stack; bool done; };
const int FIBER_STACK = 1 << 18;
Fiber* fibers; int running;
ucontext_t scheduler_context;
unsigned long long progress;   // waits passed, fibers started and finished
inline void fiber_yield() { swapcontext(&fibers[running].context, &scheduler_context); }
template <class Ready> inline void wait_until(Ready ready) {
  while (!ready()) fiber_yield();
  progress++;
}
struct Barrier {
  int count = 0, waiting = 0, generation = 0;
  void wait() {
    const int mine = generation;
    if (++waiting == count) { waiting = 0; generation++; }
    wait_until([&] { return mine != generation; });
  }
};
struct WarpSlots { unsigned a[32][4]; unsigned b[32][2]; float value[32]; const void* row[32]; };
Barrier block_barrier, warp_barriers[32];
WarpSlots warp_slots[32];
inline void __syncthreads() { block_barrier.wait(); }
inline void __syncwarp() { warp_barriers[threadIdx.x / 32].wait(); }
inline float __shfl_xor_sync(unsigned, float value, int width) {
  WarpSlots& slots = warp_slots[threadIdx.x / 32];
  int lane = threadIdx.x & 31;
  slots.value[lane] = value; __syncwarp();
  float other = slots.value[lane ^ width]; __syncwarp();
  return other;
}
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
struct uint2 { unsigned x, y; };
inline uint2 make_uint2(unsigned x, unsigned y) { return uint2{x, y}; }
// cp.async copies at once on the host: nothing is in flight
inline void copy_async_16(void* shared, const void* global, bool valid) {
  if (valid) memcpy(shared, global, 16); else memset(shared, 0, 16); }
inline void copy_async_4(void* shared, const void* global, bool valid) {
  if (valid) memcpy(shared, global, 4); else memset(shared, 0, 4); }
inline void copy_async_commit() {}
template <int PENDING> inline void copy_async_wait() {}
inline float __uint_as_float(unsigned bits) { float f; memcpy(&f, &bits, 4); return f; }
inline unsigned float_as_uint(float f) { unsigned bits; memcpy(&bits, &f, 4); return bits; }
struct float2 { float x, y; };
inline float2 make_float2(float x, float y) { return float2{x, y}; }
"""

HOST_CONVERSIONS = {
  "float32": r"""
typedef float elem_t;
inline float to_float(elem_t x) { return x; }
inline elem_t from_float(float x) { return x; }
inline unsigned operand_bits(elem_t x) { return (float_as_uint(x) + 0x1000u) & 0xFFFFE000u; }  // cvt.rna.tf32
inline unsigned tf32_round_bits(unsigned bits) { return operand_bits(__uint_as_float(bits)); }
inline unsigned tile_bits(elem_t x) {   // a fragment read of a tile that round_tile has rounded: no low bits left
  const unsigned bits = float_as_uint(x);
  if (bits & 0x1FFFu) { fprintf(stderr, "a TF32 fragment read an unrounded tile element\n"); abort(); }
  return bits;
}
inline float operand_value(const unsigned* registers, int element) { return __uint_as_float(registers[element]); }
""",
  "float16": r"""
typedef unsigned short elem_t;
inline float to_float(elem_t x) { _Float16 h; memcpy(&h, &x, 2); return (float)h; }
inline elem_t from_float(float x) { _Float16 h = (_Float16)x; elem_t bits; memcpy(&bits, &h, 2); return bits; }
""",
  "bfloat16": r"""
typedef unsigned short elem_t;
inline float to_float(elem_t x) { return __uint_as_float((unsigned)x << 16); }
inline elem_t from_float(float x) {
  unsigned bits = float_as_uint(x); return (elem_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16); }
""",
}
PACKED_OPERANDS = r"""
inline unsigned pack(elem_t low, elem_t high) { return (unsigned)low | ((unsigned)high << 16); }
inline unsigned pack_floats(float first, float second) { return pack(from_float(first), from_float(second)); }
inline float operand_value(const unsigned* registers, int element) {
  return to_float((elem_t)(registers[element / 2] >> (16 * (element % 2)) & 0xFFFFu)); }
// ldmatrix: lane l names row l % 8 of matrix l / 8; lane l receives (row l / 4, columns 2 (l % 4) and + 1) of each
// matrix, or with .trans (rows 2 (l % 4) and + 1, column l / 4)
inline void ldmatrix(unsigned (&r)[4], const elem_t* row, bool transposed) {
  WarpSlots& slots = warp_slots[threadIdx.x / 32];
  const int lane = threadIdx.x & 31;
  slots.row[lane] = row; __syncwarp();
  for (int m = 0; m < 4; m++) {
    const elem_t* const* rows = (const elem_t* const*)&slots.row[8 * m];
    const elem_t low = transposed ? rows[2 * (lane % 4)][lane / 4] : rows[lane / 4][2 * (lane % 4)];
    const elem_t high = transposed ? rows[2 * (lane % 4) + 1][lane / 4] : rows[lane / 4][2 * (lane % 4) + 1];
    r[m] = pack(low, high);
  }
  __syncwarp();
}
inline void ldmatrix_x4(unsigned (&r)[4], const elem_t* row) { ldmatrix(r, row, false); }
inline void ldmatrix_x4_trans(unsigned (&r)[4], const elem_t* row) { ldmatrix(r, row, true); }
"""

HOST_EXP2 = "inline float fast_exp2(float x) { return exp2f(x); }   // ex2.approx.ftz.f32 on the GPU\n"

ARGUMENT_TYPES = {"q": "elem_t", "k": "elem_t", "v": "elem_t", "do": "elem_t", "dq": "grad_t", "dk": "grad_t",
                  "dv": "grad_t", "o": "o_t", "lse": "float", "delta": "float", "dq_accum": "float",
                  "dq_counts": "unsigned"}


def _position_table(name: str, positions) -> str:
  """A C table of (row constant, row per group, row per quad, column constant, per group, per quad)."""
  rows = ", ".join("{" + ", ".join(map(str, (*row, *column))) + "}" for row, column in positions)
  return f"static const int {name}[{len(positions)}][6] = {{{rows}}};\n"


def host_mma(dtype: str) -> str:
  """`mma` on the host: every lane publishes its fragments, then computes its own accumulator elements from all."""
  maps, k = fragment_maps(dtype), _k_step(dtype)
  tables = _position_table("A_MAP", maps.a) + _position_table("B_MAP", maps.b) + _position_table("C_MAP", maps.c)
  return tables + f"""
inline void mma(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {{
  WarpSlots& slots = warp_slots[threadIdx.x / 32];
  const int lane = threadIdx.x & 31;
  memcpy(slots.a[lane], a, sizeof a); memcpy(slots.b[lane], b, sizeof b);
  __syncwarp();
  float A[16][{k}], B[{k}][8];
  for (int other = 0; other < 32; other++) {{
    const int g = other >> 2, quad = other & 3;
    for (int e = 0; e < {len(maps.a)}; e++) {{
      const int* m = A_MAP[e];
      A[m[0] + m[1] * g + m[2] * quad][m[3] + m[4] * g + m[5] * quad] = operand_value(slots.a[other], e);
    }}
    for (int e = 0; e < {len(maps.b)}; e++) {{
      const int* m = B_MAP[e];
      B[m[0] + m[1] * g + m[2] * quad][m[3] + m[4] * g + m[5] * quad] = operand_value(slots.b[other], e);
    }}
  }}
  const int g = lane >> 2, quad = lane & 3;
  for (int e = 0; e < 4; e++) {{
    const int* m = C_MAP[e];
    const int row = m[0] + m[1] * g + m[2] * quad, column = m[3] + m[4] * g + m[5] * quad;
    float sum = 0.0f;
    for (int i = 0; i < {k}; i++) sum += A[row][i] * B[i][column];
    c[e] += sum;
  }}
  __syncwarp();
}}
"""


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
struct WarpgroupBarriers { Barrier of[8]; WarpgroupBarriers() { for (Barrier& b : of) b.count = 128; } };
WarpgroupBarriers warpgroup_barriers;
inline void warpgroup_sync() { warpgroup_barriers.of[threadIdx.x / 128].wait(); }
// (a warpgroup's gather: the producer warpgroup of a warp-specialized kernel never multiplies)
inline void host_wgmma(float* acc, const unsigned* a, unsigned long long b, int n, bool mn_major, int accumulate) {
  memcpy(wgmma_a_slots[threadIdx.x], a, 16);
  warpgroup_sync();
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
  warpgroup_sync();
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
// the single pass (plan.dq_accumulate): dQ += dS K with A (the dS tile) through its K-major descriptor, and the
// float32 reductions into dq_accum (the blocks run one after another here, a block's fibers switch only at waits:
// the additions need no lock)
inline void wgmma_values(float* acc, unsigned long long a, unsigned long long b, int accumulate) {
  const int thread = threadIdx.x % 128;
  for (int i = 0; i < HEAD_DIM / 2; i++) {
    const int row = ACC_ROW, column = ACC_COLUMN;
    float sum = 0.0f;
    for (int k = 0; k < 16; k++) sum += shared_operand(a, row, k, false) * shared_operand(b, column, k, true);
    acc[i] = accumulate ? acc[i] + sum : sum;
  }
}
// stmatrix .x4 .trans: lane l's register i holds (row l / 4, columns 2 (l % 4) and + 1) of matrix i; the row
// address lane l names (row l % 8 of matrix l / 8) receives that matrix's column l % 8
inline void stmatrix_x4_trans(unsigned address, const unsigned (&r)[4]) {
  WarpSlots& slots = warp_slots[threadIdx.x / 32];
  const int lane = threadIdx.x & 31;
  memcpy(slots.a[lane], r, 16); __syncwarp();
  const int matrix = lane / 8, column = lane % 8;
  for (int row = 0; row < 8; row++) {
    const unsigned short half = (unsigned short)(slots.a[4 * row + column / 2][matrix] >> (16 * (column % 2)));
    memcpy(attention_shared + address + 2 * row, &half, 2);
  }
  __syncwarp();
}
inline void red_add2(float* address, float first, float second) {
  address[0] += first; address[1] += second; }
inline void red_add4(float* address, float first, float second, float third, float fourth) {
  address[0] += first; address[1] += second; address[2] += third; address[3] += fourth; }
inline void bulk_reduce_add(float* target, unsigned source, unsigned bytes) {   // at once: nothing in flight
  const float* values = (const float*)(attention_shared + source);
  for (unsigned i = 0; i < bytes / 4; i++) target[i] += values[i]; }
inline void bulk_commit() {}
inline void bulk_wait_read() {}
inline void bulk_wait_all() {}
inline unsigned atomicAdd(unsigned* address, unsigned value) {
  unsigned old = *address; *address += value; return old; }
inline void __threadfence() {}
inline float4 __ldcg(const float4* address) { return *address; }
"""


# the warp-specialized dK/dV kernel's helpers (codegen/attention_backward_producer.py) on the host: copies land at
# once, so a cp.async arrival is an arrival; an mbarrier counts arrivals to its phase's end, a wait for a parity
# returns once the current phase has the other one
PRODUCER_HOST_HELPERS = r"""
struct HostMbarrier { unsigned expected = 0, pending = 0, phase = 0; };
HostMbarrier host_mbarriers[64];
inline HostMbarrier& mbarrier_at(unsigned bar) { return host_mbarriers[(bar / 8) % 64]; }
inline void mbarrier_init(unsigned bar, unsigned count) {
  HostMbarrier& m = mbarrier_at(bar);
  m.expected = m.pending = count; m.phase = 0; }
inline void mbarrier_arrive(unsigned bar) {
  HostMbarrier& m = mbarrier_at(bar);
  if (--m.pending == 0) { m.pending = m.expected; m.phase++; }
}
inline void copy_async_arrive(unsigned bar) { mbarrier_arrive(bar); }
inline void mbarrier_wait(unsigned bar, unsigned parity) {
  HostMbarrier& m = mbarrier_at(bar);
  wait_until([&] { return (m.phase & 1u) != parity; });
}
inline void copy_async_4_shared(unsigned target, const void* source, bool inside) {
  if (inside) memcpy(attention_shared + target, source, 4); else memset(attention_shared + target, 0, 4); }
struct ConsumerBarrier { Barrier barrier; ConsumerBarrier() { barrier.count = CONSUMER_THREADS; } };
ConsumerBarrier consumer_barrier;
inline void consumer_sync() { consumer_barrier.barrier.wait(); }
template <int N> inline void registers_decrease() {}
template <int N> inline void registers_increase() {}
"""


def wgmma_host_helpers(scores_n: int, head_dim: int) -> str:
  """WGMMA_HOST_HELPERS for the shapes of attention_wgmma.product_helpers (scores: n = scores_n, values: n =
  head_dim), with the accumulator position formula of codegen/wgmma_tiles.py."""
  row, column = accumulator_position(CExpr("thread"), CExpr("i"))
  return (WGMMA_HOST_HELPERS.replace("ACC_ROW", str(row)).replace("ACC_COLUMN", str(column))
          .replace("BLOCK_N", str(scores_n)).replace("HEAD_DIM", str(head_dim)))


def host_source(plan: AttentionBackwardPlan, launch: KernelLaunch) -> str:
  """The kernel's source as a C++ program: it reads its buffers from the files named on its command line (in the
  kernel's argument order), runs every block of the grid (one fiber per CUDA thread) and writes them back."""
  device_helpers = instruction_helpers(plan.dtype)
  if device_helpers not in launch.source: raise AssertionError("the kernel source has no instruction helpers")
  host_helpers = HOST_CONVERSIONS[plan.dtype] + ("" if plan.dtype == "float32" else PACKED_OPERANDS) + HOST_EXP2
  source = launch.source.replace(device_helpers, host_helpers + host_mma(plan.dtype))
  # (shared addresses: offsets into shared_bytes; the single pass's delta kernel multiplies nothing)
  if plan.mma == "wgmma" and not (plan.dq_accumulate and launch.name == DQ_KERNEL):
    stream = attention_backward_wgmma.scores_width(plan, launch.name)
    device_wgmma = attention_backward_wgmma.wgmma_helpers(plan, launch.name)
    if device_wgmma not in source: raise AssertionError("the kernel source has no wgmma helpers")
    source = source.replace(device_wgmma, "#define attention_shared shared_bytes\n" +
                            wgmma_host_helpers(stream, plan.head_dim) +
                            "template <int N> inline void fence_accumulators(float (&)[N][4]) {}\n")
    if plan.warp_specialized and launch.name != DQ_KERNEL:
      device_producer = attention_backward_producer.PRODUCER_HELPERS
      if device_producer not in source: raise AssertionError("the kernel source has no producer helpers")
      source = source.replace(device_producer, PRODUCER_HOST_HELPERS)
  source = source.replace("extern __shared__ __align__(16) unsigned char shared_bytes[];",
                          "alignas(16) unsigned char shared_bytes[1 << 18];")
  arguments = ", ".join(f"({ARGUMENT_TYPES[name]}*)buffers[{index}]"
                        for index, name in enumerate(launch.arguments))
  return PRELUDE + source + host_main(f"{launch.name}({arguments})", launch.block[0], (*launch.grid[:2], 1))


def host_main(call: str, threads: int, grid: tuple[int, int, int], written: int | None = None) -> str:
  """A C++ main() that reads the kernel's buffers from the files named on its command line (`buffers[i]`), runs
  `call` (the kernel on them) for every block of `grid`, one fiber per CUDA thread of `threads` (PRELUDE), and writes
  the first `written` buffers (all: None) back to their files."""
  grid_x, grid_y, grid_z = grid
  return f"""
unsigned char* buffers[32];
static void run_thread() {{ {call}; fibers[running].done = true; progress++; }}
// the block's fibers from their first instruction, in rounds (alternately from the first thread and from the last,
// so a read that misses its barrier finds the writer not yet run in one order or the other) until all returned
static void run_block(int threads) {{
  for (int t = 0; t < threads; t++) {{
    Fiber& fiber = fibers[t];
    getcontext(&fiber.context);
    fiber.context.uc_stack.ss_sp = fiber.stack; fiber.context.uc_stack.ss_size = FIBER_STACK;
    fiber.context.uc_link = &scheduler_context; fiber.done = false;
    makecontext(&fiber.context, run_thread, 0);
  }}
  for (int live = threads, round = 0; live > 0; round++) {{
    const unsigned long long before = progress;
    for (int i = 0; i < threads; i++) {{
      running = round % 2 ? threads - 1 - i : i;
      if (fibers[running].done) continue;
      if (round == 0) progress++;
      threadIdx = Dim3{{running, 0, 0}};
      swapcontext(&scheduler_context, &fibers[running].context);
      if (fibers[running].done) live--;
    }}
    if (progress == before) {{
      fprintf(stderr, "hang: block (%d, %d, %d): %d threads wait and none can go on\\n", blockIdx.x, blockIdx.y,
              blockIdx.z, live);
      exit(3);
    }}
  }}
}}
int main(int argc, char** argv) {{
  for (int index = 1; index < argc; index++) {{
    FILE* file = fopen(argv[index], "rb"); fseek(file, 0, SEEK_END); long size = ftell(file); fseek(file, 0, SEEK_SET);
    buffers[index - 1] = (unsigned char*)calloc(size + 16, 1);
    if (fread(buffers[index - 1], 1, size, file) != (size_t)size) return 1;
    fclose(file);
  }}
  const int threads = {threads};
  fibers = (Fiber*)calloc(threads, sizeof(Fiber));
  for (int t = 0; t < threads; t++) fibers[t].stack = (char*)malloc(FIBER_STACK);
  blockDim = Dim3{{threads, 1, 1}};
  gridDim = Dim3{{{grid_x}, {grid_y}, {grid_z}}};
  block_barrier.count = threads;
  for (int warp = 0; warp < threads / 32; warp++) warp_barriers[warp].count = 32;
  for (int z = 0; z < {grid_z}; z++) for (int y = 0; y < {grid_y}; y++) for (int x = 0; x < {grid_x}; x++) {{
    blockIdx = Dim3{{x, y, z}};
    run_block(threads);
  }}
  for (int index = 1; index < {"argc" if written is None else written + 1}; index++) {{
    FILE* file = fopen(argv[index], "r+b");
    fseek(file, 0, SEEK_END); long size = ftell(file); fseek(file, 0, SEEK_SET);
    fwrite(buffers[index - 1], 1, size, file); fclose(file);
  }}
  return 0;
}}
"""


def host_compiler() -> str | None:
  """g++ when it is installed (the harness needs C++17, ucontext and _Float16)."""
  return shutil.which("g++")


# -O1: the harness checks values, and -O1 compiles the kernels in about half the CPU time of -O2 while they run about
# as fast (their time goes to the fibers' switches and the emulated mma)
HOST_FLAGS = ("-std=c++17", "-O1", "-w")


def host_binary(source: str) -> str:
  """The path of `source` compiled by g++, from a disk cache keyed by the source, the flags and the compiler (under
  OURGRAD_CACHE_DIR, else ~/.cache/ourgrad): a source that a parametrized case, an xdist worker or an earlier run
  already compiled is not compiled again. DISABLE_COMPILER_CACHE=1 compiles into a fresh file each time."""
  compiler = host_compiler()
  if compiler is None: raise RuntimeError("no g++ to run the kernel on the host")
  key = hashlib.sha256("\0".join((compiler, *HOST_FLAGS, source)).encode()).hexdigest()[:32]
  folder = os.path.join(os.environ.get("OURGRAD_CACHE_DIR") or os.path.expanduser("~/.cache/ourgrad"), "host_kernels")
  os.makedirs(folder, exist_ok=True)
  binary = os.path.join(folder, key)
  fresh = os.environ.get("DISABLE_COMPILER_CACHE", "0") not in ("", "0")
  if fresh or not os.path.exists(binary):
    # each compile writes its own files, then renames the binary into place: workers compiling the same source at
    # once leave one whole binary
    with tempfile.TemporaryDirectory(prefix="ourgrad_host_kernel_", dir=folder) as build:
      source_path, built = os.path.join(build, "kernel.cpp"), os.path.join(build, "kernel")
      with open(source_path, "w") as source_file: source_file.write(source)
      subprocess.run([compiler, *HOST_FLAGS, source_path, "-o", built], check=True, capture_output=True, text=True)
      if fresh: binary = os.path.join(folder, f"{key}.{os.getpid()}")
      os.replace(built, binary)
  return binary


def run_binary(binary: str, paths: list[str]) -> None:
  """Run a harness binary on its buffer files; a failure (a hang reported, an abort) raises with its message."""
  result = subprocess.run([binary, *paths], capture_output=True, text=True)
  if result.returncode != 0:
    raise RuntimeError(f"the host kernel exited with {result.returncode}: {result.stderr.strip()}")


def run_on_host(plan: AttentionBackwardPlan, buffers: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Run both kernels of `plan` on flat buffers (numpy arrays, by argument name: q, k, v, o, do, lse, dq, dk, dv,
  delta), in launch order; returns the buffers after the run."""
  state = {name: np.ascontiguousarray(array).copy() for name, array in buffers.items()}
  with tempfile.TemporaryDirectory(prefix="ourgrad_attention_host_") as folder:
    for launch in launches(plan):
      binary_path = host_binary(host_source(plan, launch))
      paths = []
      for name in launch.arguments:
        path = os.path.join(folder, f"{name}.bin")
        state[name].tofile(path)
        paths.append(path)
      run_binary(binary_path, paths)
      for name, path in zip(launch.arguments, paths):
        state[name] = np.fromfile(path, dtype=state[name].dtype)
  return state
