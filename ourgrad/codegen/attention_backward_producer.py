"""The attention backward's dK/dV kernel warp-specialized (plan.warp_specialized; FlashAttention-3's structure on
Hopper): the consumer warpgroups of codegen/attention_backward_wgmma.py's dK/dV kernel (the single pass's, or
without dq_accumulate the two kernels'), threads [0, consumer_threads), then one producer warpgroup.

- Before the roles split, the whole block copies the owned K and V tiles and thread 0 initialises two mbarriers a
  stage: `full` (`copier_threads` arrivals: each copier's cp.async.mbarrier.arrive, which fires once that thread's
  copies into the stage have landed) and `empty` (consumer_threads arrivals: every consumer thread once the
  products reading the stage are done). The block's barrier after it is the last one all threads meet.
- The producer warpgroup gives back registers (setmaxnreg.dec) and, for every iteration, waits for its stage to be
  empty (from the ring's second round on), issues the 16-byte cp.async copies of the Q and dO tiles (swizzled as the
  consumers read them) and the 4-byte copies of the LSE and delta rows, and arrives on the stage's `full` barrier.
  It then leaves. With dq_bulk_reduce its second warp's first thread is the writer instead (`_writer_lines`).
- The consumers take the registers (setmaxnreg.inc, `consumer_registers`) and run the iteration with the stage's
  `full` barrier in place of the copy wait and block barrier; after the iteration's products they arrive on `empty`,
  then (the single pass) add dQ (red.global.add, or staged for the writer). The single pass's dS tile is
  double-buffered, so the consumers meet once an iteration (a named barrier, the producer absent), after writing
  it: a tile is rewritten two iterations after it was read, and its readers have waited for their products before
  they reached the barrier in between. Without dq_accumulate the consumer warpgroups never meet.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ourgrad.codegen.attention_backward_plan import PRODUCER_REGISTERS, PRODUCER_THREADS
from ourgrad.codegen.attention_backward_wgmma import (HEAD_OFFSET, _last_wait, _owned_descriptor, _owned_tiles,
                                                      _tile_bytes, dq_accumulate_lines, dq_count_final_lines,
                                                      dq_count_helpers, dq_reduce_lines, iteration_tile_lines,
                                                      scores_lines, stage_addresses, values_lines)
from ourgrad.codegen.attention_wgmma import WARPGROUP_ROWS, staged_offset
from ourgrad.codegen.wgmma_tiles import CExpr

if TYPE_CHECKING:
  from ourgrad.codegen.attention_backward_plan import AttentionBackwardPlan

# named barrier 0 is __syncthreads, 1 and 2 the single pass's warpgroup barriers (warpgroup_sync)
CONSUMER_BARRIER = 5

PRODUCER_HELPERS = f"""// mbarriers in shared memory (64-bit, at `bar`), the consumers' named barrier, setmaxnreg
__device__ __forceinline__ void mbarrier_init(unsigned bar, unsigned count) {{
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(bar), "r"(count) : "memory");
}}
__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {{
  asm volatile("{{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [%0]; }}" :: "r"(bar) : "memory");
}}
// an arrival on `bar` once every cp.async this thread issued before has landed (the count set at init includes it)
__device__ __forceinline__ void copy_async_arrive(unsigned bar) {{
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(bar) : "memory");
}}
// (the retry loop inside the asm: a loop in C inside the consumers' loop made ptxas serialize their wgmmas, C7512)
__device__ __forceinline__ void mbarrier_wait(unsigned bar, unsigned parity) {{   // the phase of that parity done
  asm volatile("{{ .reg .pred p; WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1; @!p bra WAIT; }}"
               :: "r"(bar), "r"(parity) : "memory");
}}
__device__ __forceinline__ void copy_async_4_shared(unsigned target, const void* source, bool inside) {{
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(target), "l"(source), "r"(inside ? 4 : 0)
               : "memory");
}}
__device__ __forceinline__ void consumer_sync() {{
  asm volatile("bar.sync {CONSUMER_BARRIER}, %0;" :: "n"(CONSUMER_THREADS) : "memory");
}}
template <int N> __device__ __forceinline__ void registers_decrease() {{
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" :: "n"(N));
}}
template <int N> __device__ __forceinline__ void registers_increase() {{
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" :: "n"(N));
}}
"""


def producer_helpers(plan: AttentionBackwardPlan) -> str:
  """The helpers of the warp-specialized dK/dV kernel, after the single pass's (CONSUMER_THREADS defined)."""
  return f"#define CONSUMER_THREADS {plan.consumer_threads}\n" + PRODUCER_HELPERS


def copier_threads(plan: AttentionBackwardPlan) -> int:
  """The producer threads that copy: the warpgroup, less its second warp where that one's first thread is the
  writer (dq_bulk_reduce)."""
  return PRODUCER_THREADS - (32 if plan.dq_bulk_reduce else 0)


def _writer_lines(plan: AttentionBackwardPlan) -> list[str]:
  """dq_bulk_reduce: the writer (the producer warpgroup's second warp's first thread; the rest of that warp leaves):
  each iteration's staged dQ added into dq_accum by bulk reductions once the consumers have written it (dq_full),
  dq_empty once they have been read; dq_done once all have been performed."""
  if not plan.dq_bulk_reduce: return []
  return ["    if (producer / 32 == 1) {",
          "      if (producer == 32) {   // the writer",
          "        for (int iteration = 0; iteration < iterations; iteration++) {",
          "          mbarrier_wait(dq_full, iteration & 1);",
          "          const int head = kv_head * GROUP + (GROUP == 1 ? 0 : iteration / q_tiles);",
          "          const int q_start = q_first + (GROUP == 1 ? iteration : iteration % q_tiles) * BQ;",
          "          float* dq_rows = dq_accum + (((long long)batch * H + head) * L + q_start) * D;",
          f"          for (int slice = 0; slice < {plan.dkdv_stream // WARPGROUP_ROWS}; slice++) {{   // rows past L "
          "left out",
          "            const int rows = min(64, L - q_start - slice * 64);",
          "            if (rows > 0)",
          "              bulk_reduce_add(dq_rows + slice * 64 * D, dq_staging + slice * 64 * D * 4, rows * D * 4);",
          "          }",
          "          bulk_commit();",
          "          bulk_wait_read();",
          "          mbarrier_arrive(dq_empty);",
          "        }",
          "        bulk_wait_all();",
          "        mbarrier_arrive(dq_done);",
          "      }",
          "      return;",
          "    }"]


def _producer_lines(plan: AttentionBackwardPlan) -> list[str]:
  """The producer warpgroup: setmaxnreg.dec (the whole warpgroup), the writer (`_writer_lines`), and the copiers:
  each iteration's Q and dO rows (swizzled, rows past L as zeros) and LSE and delta rows copied into stage
  iteration % STAGES once its `empty` barrier has completed the previous round's phase."""
  p, stream = plan, plan.dkdv_stream
  pieces = p.head_dim // 8
  q_stride, do_stride, lse_stride = p.q_strides[2], p.do_strides[2], p.lse_strides[2]
  target = staged_offset(stream, CExpr("row"), CExpr("column"))
  registers = [f"    registers_decrease<{PRODUCER_REGISTERS}>();"] if p.consumer_registers else []
  copiers = copier_threads(p)
  copier = "producer - (producer >= 64 ? 32 : 0)" if p.dq_bulk_reduce else "producer"
  return [
    "  if (threadIdx.x >= CONSUMER_THREADS) {   // the producer warpgroup",
    *registers,
    "    const int producer = threadIdx.x - CONSUMER_THREADS;",
    *_writer_lines(p),
    f"    const int copier = {copier};",
    "    for (int iteration = 0; iteration < iterations; iteration++) {",
    "      const int stage = iteration % STAGES;",
    "      if (iteration >= STAGES) mbarrier_wait(empty_bar + 8 * stage, (iteration / STAGES - 1) & 1);",
    "      const int head = kv_head * GROUP + (GROUP == 1 ? 0 : iteration / q_tiles);",
    "      const int q_start = q_first + (GROUP == 1 ? iteration : iteration % q_tiles) * BQ;",
    "      const int q_rows = min(BQ, L - q_start);",
    f"      const elem_t* q_rows0 = q + {HEAD_OFFSET.format(*p.q_strides[:2])} + (long long)q_start * {q_stride}LL;",
    f"      const elem_t* do_rows0 = dout + {HEAD_OFFSET.format(*p.do_strides[:2])} + "
    f"(long long)q_start * {do_stride}LL;",
    f"      {stage_addresses(p, stream, 'q_stage', 'do_stage', 'stage')}",
    "#pragma unroll 1",   # (unrolled, its addresses did not fit the producer's registers: spilled)
    f"      for (int piece = copier; piece < {stream * pieces}; piece += {copiers}) {{",
    f"        const int row = piece / {pieces}, column = (piece % {pieces}) * 8;",
    "        const bool inside = row < q_rows;",
    "        const long long clamped = inside ? row : 0;",
    f"        const unsigned target = {target};",
    f"        stage16(q_stage + target, q_rows0 + clamped * {q_stride}LL + column, inside);",
    f"        stage16(do_stage + target, do_rows0 + clamped * {do_stride}LL + column, inside);",
    "      }",
    f"      const float* lse_rows0 = lse + {p.lse_offset}LL + {HEAD_OFFSET.format(*p.lse_strides[:2])} + "
    f"(long long)q_start * {lse_stride}LL;",
    "      const float* delta_rows0 = delta + ((long long)batch * H + head) * L + q_start;",
    "      const unsigned rows = shared_address(row_buffers + stage * 2 * BQ);",
    f"      for (int r = copier; r < BQ; r += {copiers}) {{",
    "        const int clamped = r < q_rows ? r : 0;",
    f"        copy_async_4_shared(rows + 4 * r, lse_rows0 + (long long)clamped * {lse_stride}LL, r < q_rows);",
    "        copy_async_4_shared(rows + 4 * (BQ + r), delta_rows0 + clamped, r < q_rows);",
    "      }",
    "      copy_async_arrive(full_bar + 8 * stage);",
    "    }",
    "    copy_async_commit();",
    "    copy_async_wait<0>();   // (its copies tracked by the barriers, committed only to be waited for)",
    "    return;",
    "  }"]


def _dq_stage_lines(plan: AttentionBackwardPlan) -> list[str]:
  """dq_bulk_reduce: the consumers' dQ parts (SCALE dQ, once waited for) written row-major into dq_staging, each
  row's columns permuted (plan.dq_swizzled; g is the row's index mod 8), once the writer has read the previous
  iteration's (dq_empty), made visible to the bulk copies (fence.proxy.async) and announced (dq_full)."""
  slices = plan.dkdv_stream // plan.block_kv
  first = f"((threadIdx.x / 128) * {slices} + part) * 64 + (warp & 3) * 16 + g"
  return ["    {",
          "      if (iteration > 0) mbarrier_wait(dq_empty, (iteration - 1) & 1);",
          "      float* staged = (float*)(shared_bytes + (dq_staging - shared_address(shared_bytes)));",
          "#pragma unroll",
          f"      for (int part = 0; part < {slices}; part++)",
          "#pragma unroll",
          "        for (int t = 0; t < D / 8; t++)",
          "#pragma unroll",
          "          for (int half = 0; half < 2; half++) {",
          f"            const int query = {first} + half * 8;",
          "            *(float2*)(staged + query * D + ((t * 8 + 2 * quad) ^ (g << 3))) =   // (plan.dq_swizzled)",
          "                make_float2(SCALE * dq_part[part][t][2 * half], SCALE * dq_part[part][t][2 * half + 1]);",
          "          }",
          "      async_proxy_fence();",
          "      mbarrier_arrive(dq_full);",
          "    }"]


def dkdv_body(plan: AttentionBackwardPlan, entry: str, prologue: str, probabilities: str, gradients: str,
              store: str) -> str:
  """The warp-specialized dK/dV kernel (the parameters of the single pass's, or without dq_accumulate of the two
  kernels'): `prologue` (the block's keys and Q tiles), the owned K and V tiles, the producer, then the consumers'
  loop: `probabilities` (P^T in place of S^T, masked), `gradients` (dS^T in place of dP^T), (the single pass) dQ,
  `store`."""
  p, stream, single = plan, plan.dkdv_stream, plan.dq_accumulate
  # (the single pass: the dS tiles and a flag a thread after the stages)
  flags = p.wgmma_stages * 2 * _tile_bytes(p, stream) + (p.ds_tile_bytes + 4 * p.dkdv_block[0] if single else 0)
  staging = stream * p.head_dim * 4 if p.dq_bulk_reduce else 0   # (dq_staging: after the flags)
  scores = scores_lines(p, stream, (("st", _owned_descriptor(p.block_kv, "k_owned"), "q_stage"),
                                    ("dpt", _owned_descriptor(p.block_kv, "v_owned"), "do_stage")))
  registers = [f"  registers_increase<{p.consumer_registers}>();"] if p.consumer_registers else []
  body = "\n".join([
    f"{entry}(const elem_t* __restrict__ q,",
    "    const elem_t* __restrict__ k, const elem_t* __restrict__ v, const elem_t* __restrict__ dout,",
    "    const float* __restrict__ lse, const float* __restrict__ delta, grad_t* __restrict__ dk,",
    "    grad_t* __restrict__ dv" + (", float* __restrict__ dq_accum, unsigned* __restrict__ dq_counts, grad_t* "
                                    "__restrict__ dq" if single else "") + ") {",
    f"  constexpr int STAGES = {p.wgmma_stages};",
    "  float* row_buffers = (float*)shared_bytes;   // a stage's LSE and delta rows: 2 x stages x BQ",
    "  // the swizzled K and V tiles from the next 1024-byte atom, then the stages' Q and dO tiles",
    *_owned_tiles(p, p.block_kv, "shared_address(row_buffers + 2 * STAGES * BQ)", prologue,
                  "k_start", "k_rows", (("k_owned", "k + k_row0", p.k_strides[2]),
                                        ("v_owned", "v + v_row0", p.v_strides[2]))),
    "  copy_async_commit();",
    *(dq_count_helpers(p) if single else []),
    f"  const unsigned full_bar = stages + {flags + staging}u, empty_bar = full_bar + 8 * STAGES;   // (8-byte "
    "aligned)",
    *(["  // the staged dQ: written (the consumers), its reductions' reads done, all of them done (the writer)",
       "  const unsigned dq_full = empty_bar + 8 * STAGES, dq_empty = dq_full + 8, dq_done = dq_full + 16;"]
      if p.dq_bulk_reduce else []),
    "  if (threadIdx.x == 0) {",
    "    for (int stage = 0; stage < STAGES; stage++) {",
    f"      mbarrier_init(full_bar + 8 * stage, {copier_threads(p)});",
    "      mbarrier_init(empty_bar + 8 * stage, CONSUMER_THREADS);",
    "    }",
    *(["    mbarrier_init(dq_full, CONSUMER_THREADS);", "    mbarrier_init(dq_empty, 1);",
       "    mbarrier_init(dq_done, 1);"] if p.dq_bulk_reduce else []),
    "  }",
    "  copy_async_wait<0>();   // K and V have landed",
    "  async_proxy_fence();",
    "  __syncthreads();   // K, V and the barriers ready: the last barrier of the whole block",
    *_producer_lines(p),
    *registers,
    "  float dk_acc[D / 8][4], dv_acc[D / 8][4];",
    "#pragma unroll",
    "  for (int t = 0; t < D / 8; t++) for (int c = 0; c < 4; c++) { dk_acc[t][c] = 0.0f; dv_acc[t][c] = 0.0f; }",
    "  for (int iteration = 0; iteration < iterations; iteration++) {",
    "    const int stage = iteration % STAGES;",
    "    mbarrier_wait(full_bar + 8 * stage, (iteration / STAGES) & 1);   // its copies have landed",
    "    async_proxy_fence();",
    *iteration_tile_lines(p),
    *scores,
    "    wgmma_wait_one();   // S^T",
    "    fence_accumulators(st);",
    "    // mask only the tiles that need it: keys past S, queries past L, or (causal) keys past its first query",
    "    const bool masked = k_start + BK > S || q_start + BQ > L || (CAUSAL && k_start + BK - 1 > q_start);",
    probabilities,
    *(values_lines(stream, "dv_acc", "st", "pt", "do_stage") if single else []),
    f"    wgmma_wait_{'one' if single else 'all'}();   // dP^T",
    "    fence_accumulators(dpt);",
    gradients,
    *([] if single else values_lines(stream, "dv_acc", "st", "pt", "do_stage")),
    *values_lines(stream, "dk_acc", "dpt", "dst", "q_stage"),
    *(dq_accumulate_lines(p) if single else []),
    # (the single pass: the stage's last readers, dV's and dK's products, done while dQ's may still run: groups
    # complete in order)
    *(["    wgmma_wait_one();   // dV, dK", "    fence_accumulators(dv_acc);", "    fence_accumulators(dk_acc);",
       "    mbarrier_arrive(empty_bar + 8 * stage);   // this stage's tiles read"] if single else []),
    *_last_wait(p, "dv_acc", "dk_acc")[:-1],
    *([] if single else ["    mbarrier_arrive(empty_bar + 8 * stage);   // this stage's tiles read"]),
    *(_dq_stage_lines(p) if p.dq_bulk_reduce else dq_reduce_lines(p) if single else []),
    "  }",
    # (dq_bulk_reduce: dK and dV stored first, their stores in flight while the last reductions complete)
    *([store, "  mbarrier_wait(dq_done, 0);   // every bulk reduction performed"] if p.dq_bulk_reduce else []),
    *(dq_count_final_lines(p) if single else []),
    *([] if p.dq_bulk_reduce else [store]),
    "}"])
  return body + "\n"
