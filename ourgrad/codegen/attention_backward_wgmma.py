"""The flash-attention backward's kernels on Hopper's warpgroup MMA (wgmma, sm_90a) for float16/bfloat16 operands:
the parts of codegen/attention_backward.py's kernels that differ when their plan says `mma="wgmma"` (that module
renders the header, the masks and elementwise steps, delta and the stores, the same for both).

A block is block_q / 64 (dQ) or block_kv / 64 (dK/dV) warpgroups, warp w owning rows 16 w.. as in the mma.sync
kernels, so the accumulators (wgmma_tiles.accumulator_position: element 4 n + i is the mma.sync kernels' acc[n][i])
and the elementwise steps between the products are theirs, unchanged. Every product is one of the two wgmma shapes
of the forward (codegen/attention_wgmma.py `product_helpers`):

- the owned tile's rows (dQ: Q and dO; dK/dV: K and V) are copied once into padded shared tiles and their A
  fragments (the m16n8k16 A fragments of the warp's 16 rows, which are wgmma's register A) held in registers; or
  (without the plan's dq_held / dkdv_held) into swizzled tiles read as A through K-major descriptors (as the
  forward's q_shared; the dQ kernel copies its padded tiles too, which delta reads);
- the streamed tiles (dQ: K and V of `stream_kv` keys; dK/dV: Q and dO of `stream_q` queries) go by cp.async into
  plan.wgmma_stages stages of 128-byte-swizzled tiles (attention_wgmma.staged_offset), rows whose D is contiguous: as
  K in the forward they are the K-major B of the "scores" shape (`wgmma_scores`, n = the stream), and as V the
  transposed B of the "values" shape (`wgmma_values`, n = D);
- dQ kernel: S = Q K^T and dP = dO V^T (scores shape: B = K, V), dQ += dS K (values shape: A = dS packed from the
  accumulators, B = K transposed); dK/dV kernel: S^T = K Q^T and dP^T = V dO^T (B = Q, dO), dV += P^T dO and
  dK += dS^T Q (A = P^T, dS^T from registers, B = dO, Q transposed).

A loop iteration: wait for its stage's copies, fence.proxy.async (cp.async writes seen by the tensor cores), a
barrier, the next stage's copies issued (its stage last read one iteration back, or two with `wgmma_overlap`: waited
for by every thread before the barrier), the two scores products issued as two groups; the probabilities computed
once the first has landed (while the second runs), the gradients once the second has (the dK/dV kernel's
dV += P^T dO running meanwhile), then the last values product issued and waited for (`wgmma_overlap`: left running
into the next iteration's scores products). The dK/dV kernel's stages also hold the Q tile's LSE and delta rows
(float, `row_buffers`).

The single pass (plan.dq_accumulate; its first kernel is attention_backward's delta kernel): the dK/dV kernel also
computes dQ = dS K an iteration (`dq_accumulate_lines`: dS through a swizzled shared tile), adds it into a float32
dq_accum (`dq_reduce_lines`: vector reductions, or TMA bulk reductions from shared memory), and the block that
completes a Q tile's count converts it into dq (`dq_count_helpers`, `dq_count_final_lines`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ourgrad.codegen.attention_backward_plan import DKDV_KERNEL, DQ_COUNT_ROWS, DQ_KERNEL
from ourgrad.codegen.attention_wgmma import (WARPGROUP_ROWS, key_slice_start, key_strides, pack_lines, product_helpers,
                                             staged_offset, value_slice_start, value_strides)
from ourgrad.codegen.wgmma_copies import ROW_BYTES
from ourgrad.codegen.wgmma_tiles import PTX_TYPE, CExpr

if TYPE_CHECKING:
  from ourgrad.codegen.attention_backward_plan import AttentionBackwardPlan

# C of the element offset of (batch, head) by a tensor's (batch, head) strides
HEAD_OFFSET = "(long long)batch * {0}LL + (long long)head * {1}LL"

# pins accumulators to their registers at a point of the program (CUTLASS's warpgroup_fence_operand): without it
# NVVM may copy an accumulator between the wgmmas of a chain while they are in flight, and ptxas then waits for them
# (C7517/C7511: "wgmma ... serialized")
ACCUMULATOR_FENCE = """template <int N> __device__ __forceinline__ void fence_accumulators(float (&acc)[N][4]) {
#pragma unroll
  for (int t = 0; t < N; t++)
#pragma unroll
    for (int c = 0; c < 4; c++) asm volatile("" : "+f"(acc[t][c]) :: "memory");
}
"""


# the single pass's helpers (plan.dq_accumulate): transposing matrix stores, and two or four neighbouring float32 sums
# added to global memory by one vector reduction (sm_90: red.global.add.v2.f32 / .v4.f32, no value returned)
SINGLE_PASS_HELPERS = """// four 8x8 16-bit matrices, each thread's register i two neighbouring elements of a row of
// matrix i (the C fragment layout, as packed A fragments hold them), stored transposed: lane l names the shared
// address of row l % 8 of matrix l / 8, which receives column l % 8
__device__ __forceinline__ void stmatrix_x4_trans(unsigned address, const unsigned (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
               :: "r"(address), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
}
__device__ __forceinline__ void red_add4(float* address, float first, float second, float third, float fourth) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" :: "l"(address), "f"(first), "f"(second),
               "f"(third), "f"(fourth) : "memory");
}
__device__ __forceinline__ void warpgroup_sync() {   // named barrier 1 + warpgroup (0 is __syncthreads)
  asm volatile("bar.sync %0, 128;" :: "r"(1 + (int)(threadIdx.x / 128)) : "memory");
}
__device__ __forceinline__ void bulk_reduce_add(float* target, unsigned source, unsigned bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :: "l"(target), "r"(source), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
__device__ __forceinline__ void red_add2(float* address, float first, float second) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" :: "l"(address), "f"(first), "f"(second) : "memory");
}
"""


def scores_halved(plan: AttentionBackwardPlan, kernel: str) -> bool:
  """Whether `kernel`'s scores products go as two wgmmas of half its stream each: where A is held in registers and
  the stream equals D, so that the scores and values products would be register-A wgmmas of one shape (m64nDk16)
  differing only in B's transpose. Those kernels (dQ streaming 64 keys, dK/dV 64 queries, D = 64, held) gave
  wrong gradients on the H200 (relative error 0.3-0.8, sweep_attention_backward_h200_s14.txt) while the same
  kernels with A by descriptor, held A at other widths, and the host harness agreed with torch: every case of
  the failure and none of the others is the two products sharing that shape (a ptxas fault suspected, not proven)."""
  stream = plan.dq_stream if kernel == DQ_KERNEL else plan.dkdv_stream
  held = plan.dq_held if kernel == DQ_KERNEL else plan.dkdv_held
  return held and stream == plan.head_dim


def scores_width(plan: AttentionBackwardPlan, kernel: str) -> int:
  """n of `kernel`'s wgmma_scores: its stream, or half of it (`scores_halved`)."""
  stream = plan.dq_stream if kernel == DQ_KERNEL else plan.dkdv_stream
  return stream // 2 if scores_halved(plan, kernel) else stream


def wgmma_helpers(plan: AttentionBackwardPlan, kernel: str) -> str:
  """The PTX helpers of `kernel` (DQ_KERNEL or DKDV_KERNEL): scores n = `scores_width`, A from registers or (without
  the plan's dq_held / dkdv_held) shared memory, values n = D (the single pass's dK/dV kernel: also with A from
  shared memory, and SINGLE_PASS_HELPERS); the accumulator fence."""
  shared_a = not (plan.dq_held if kernel == DQ_KERNEL else plan.dkdv_held)
  single_pass = plan.dq_accumulate and kernel != DQ_KERNEL
  return product_helpers(scores_width(plan, kernel), plan.head_dim, PTX_TYPE[plan.dtype], shared_a, single_pass) + \
      ACCUMULATOR_FENCE + (SINGLE_PASS_HELPERS if single_pass else "")


def _tile_bytes(plan: AttentionBackwardPlan, rows: int) -> int:
  return rows * plan.head_dim * plan.itemsize


def copy_stage_lines(plan: AttentionBackwardPlan, rows: int, first_row: str, valid: str,
                     tiles: tuple[tuple[str, str, int], tuple[str, str, int]]) -> list[str]:
  """Copies (one 16-byte cp.async a piece) of rows [0, `rows`) of two tiles into their swizzled stage tiles: each
  (shared address of the stage tile, first element of row `first_row` in global memory, row stride), rows from
  `valid` on as zeros (a zero-filled copy still names row `first_row`'s address)."""
  pieces = plan.head_dim // 8
  target = staged_offset(rows, CExpr("row"), CExpr("column"))
  return [f"    for (int piece = threadIdx.x; piece < {rows * pieces}; piece += blockDim.x) {{",
          f"      const int row = piece / {pieces}, column = (piece % {pieces}) * 8;",
          f"      const bool inside = row < {valid};",
          "      const long long clamped = inside ? row : 0;",
          f"      const unsigned target = {target};",
          *(f"      stage16({stage} + target, {source} + clamped * {stride}LL + column, inside);"
            for stage, source, stride in tiles),
          "    }"]


def scores_lines(plan: AttentionBackwardPlan, stream: int, products: tuple[tuple[str, str, str], ...],
                 halves: bool = False) -> list[str]:
  """Each (accumulators, A: held fragments, or a descriptor of D's k16 slice `j` in shared memory, shared address of
  a stage tile) product of the scores shape issued as a group of its own (one wgmma per 16 of D, the first not
  adding): accumulators (64 x stream a warpgroup) = A's rows @ the tile's rows^T; `halves` (`scores_halved`): two
  wgmmas a slice, each half the tile's rows (its accumulator elements the first or second half of the thread's: 4
  a group of 8 columns). Groups complete in order: wgmma_wait_one leaves the last in flight."""
  lbo, sbo = key_strides()
  start = key_slice_start(stream, CExpr("j"))
  parts = ((0, 0), (stream // 16, stream // 2 * ROW_BYTES)) if halves else ((0, 0),)
  lines = [f"    float {acc}[{stream // 8}][4];" for acc, _, _ in products] + ["    wgmma_fence();"]
  for acc, held, tile in products:
    lines += ["#pragma unroll",
              f"    for (int j = 0; j < {plan.head_dim // 16}; j++) {{",
              *(f"      wgmma_scores(&{acc}[{group}][0], {held if '(' in held else held + '[j]'}, "
                f"wgmma_descriptor({tile} + {start}{f' + {offset}' if offset else ''}, {lbo}, {sbo}), j > 0);"
                for group, offset in parts),
              "    }",
              "    wgmma_commit();",
              f"    fence_accumulators({acc});"]
  return lines


def values_lines(stream: int, acc: str, source: str, packed: str, tile: str) -> list[str]:
  """A product of the values shape issued as a group: the accumulator tile `source` of an earlier product packed
  into A fragments `packed`, then accumulators `acc` (64 x D) += that tile @ the stage tile at shared address `tile`
  (one wgmma per 16 of its rows). `packed` and `acc` stay untouched until the group is waited for."""
  lbo, sbo = value_strides(stream)
  start = value_slice_start(CExpr("kk"))
  return [*pack_lines(source, packed, stream, declare=True),
          "    wgmma_fence();",
          f"    fence_accumulators({acc});",
          "#pragma unroll",
          f"    for (int kk = 0; kk < {stream // 16}; kk++)",
          f"      wgmma_values(&{acc}[0][0], {packed}[kk], wgmma_descriptor({tile} + {start}, {lbo}, {sbo}), 1);",
          "    wgmma_commit();",
          f"    fence_accumulators({acc});"]


def _last_wait(plan: AttentionBackwardPlan, *accumulators: str) -> list[str]:
  """The end of the loop: its last product waited for, or (`wgmma_overlap`) left in flight into the next iteration's
  scores products (whose first wait finds it done: groups complete in order) and waited for after the loop. Its
  stage is not refilled before then: with 3 stages the next copy into it is issued two iterations on, past a barrier
  that every thread reaches after that wait."""
  fences = [f"    fence_accumulators({acc});" for acc in accumulators]
  if not plan.wgmma_overlap: return ["    wgmma_wait_all();", *fences, "  }"]
  return ["  }", "  wgmma_wait_all();", *(fence[2:] for fence in fences)]


def block_sync(plan: AttentionBackwardPlan) -> str:
  """C of the barrier of the threads that multiply: the block's, or (warp_specialized: the producer warpgroup has
  left) the consumers' named barrier (codegen/attention_backward_producer.py)."""
  return "consumer_sync()" if plan.warp_specialized else "__syncthreads()"


def block_threads(plan: AttentionBackwardPlan) -> str:
  """C of the number of threads that multiply (the threads `block_sync` waits for)."""
  return f"{plan.consumer_threads}" if plan.warp_specialized else "blockDim.x"


def dq_accumulate_lines(plan: AttentionBackwardPlan) -> list[str]:
  """The single pass's dQ (plan.dq_accumulate), after dK += dS^T Q is issued: dS (the stream's queries x the block's
  keys) stored from dS^T's packed A fragments `dst` into the K-major dS tile after the stages (staged_offset, as a K
  tile of `stream` rows whose D is the block's keys) by transposing matrix stores (fragment kk's four 8x8 matrices are
  keys 0-7 / 8-15 of the warp's 16 by queries 16 kk.. / 16 kk + 8..), made visible to the tensor cores
  (fence.proxy.async, then the block's barrier), and dQ = dS K issued as one group, each warpgroup its share of the
  stream's queries (stream / block_kv of its 64-row slices: the dQ parts of all the block's keys are summed before
  they are added to global memory) over all the block's keys: A = the dS tile, B = the owned K tile read transposed
  (as V in O += P V). The tile is rewritten in the next iteration only after the loop's barrier, which every thread
  reaches after its wait for this group."""
  p, stream = plan, plan.dkdv_stream
  slices = stream // p.block_kv   # a warpgroup's 64-query slices
  a_lbo, a_sbo = key_strides()
  b_lbo, b_sbo = value_strides(p.block_kv)
  ds_byte = staged_offset(stream, CExpr("query"), CExpr("key"))
  a_start = f"ds_tile + slice * {WARPGROUP_ROWS * ROW_BYTES} + {key_slice_start(stream, CExpr('kk'))}"
  b_start = f"k_owned + {value_slice_start(CExpr('kk'))}"
  ds_first = f"stages + {p.wgmma_stages * 2 * _tile_bytes(p, stream)}u"
  # (warp_specialized: the tiles in turn, the consumers' barrier in place of the block's)
  ds_tile = f"{ds_first} + (iteration & 1) * {p.ds_buffer_bytes}u" if p.ds_buffers == 2 else ds_first
  return [f"    const unsigned ds_tile = {ds_tile};",
          "#pragma unroll",
          f"    for (int kk = 0; kk < {stream // 16}; kk++) {{   // this lane's row: a query's 8 keys",
          "      const int query = kk * 16 + ((lane >> 4) << 3) + (lane & 7), key = warp * 16 + (lane & 8);",
          f"      stmatrix_x4_trans(ds_tile + {ds_byte}, dst[kk]);",
          "    }",
          "    async_proxy_fence();",
          f"    {block_sync(p)};   // the block's dS tile written",
          f"    float dq_part[{slices}][D / 8][4];",
          "    wgmma_fence();",
          "#pragma unroll",
          f"    for (int part = 0; part < {slices}; part++) {{",
          f"      const int slice = (threadIdx.x / 128) * {slices} + part;",
          "#pragma unroll",
          f"      for (int kk = 0; kk < {p.block_kv // 16}; kk++)",
          f"        wgmma_values(&dq_part[part][0][0], wgmma_descriptor({a_start}, {a_lbo}, {a_sbo}), "
          f"wgmma_descriptor({b_start}, {b_lbo}, {b_sbo}), kk > 0);",
          "    }",
          "    wgmma_commit();",
          *(f"    fence_accumulators(dq_part[{part}]);" for part in range(slices))]


def dq_reduce_lines(plan: AttentionBackwardPlan) -> list[str]:
  """The single pass's dQ parts, once waited for, added (scaled by SCALE) into dq_accum's rows of this iteration's
  query head, rows past L left out: two neighbouring columns a vector reduction, or (plan.dq_reduce_width 4) four,
  neighbouring quads trading halves (the even one takes row g's four columns, the odd one row g + 8's); or
  (plan.dq_bulk_reduce) staged row-major in shared memory (`dq_staging`, after the flags) and added by one thread of
  the warpgroup as bulk reductions (cp.reduce.async.bulk, the TMA unit), whose reads of the staging rows it waits
  for before the next iteration's first barrier and whose completion before the block's counts."""
  slices = plan.dkdv_stream // plan.block_kv
  first = f"((threadIdx.x / 128) * {slices} + part) * 64 + (warp & 3) * 16 + g"
  if plan.dq_reduce_width == 4:
    reductions = ["        for (int t = 0; t < D / 8; t++) {",
                  "          const float* mine = dq_part[part][t];",
                  "          const bool even = (quad & 1) == 0;",
                  "          const float given0 = __shfl_xor_sync(0xffffffffu, even ? mine[2] : mine[0], 1);",
                  "          const float given1 = __shfl_xor_sync(0xffffffffu, even ? mine[3] : mine[1], 1);",
                  f"          const int query = {first} + (even ? 0 : 8);",
                  "          if (q_start + query < L)",
                  "            red_add4(dq_rows + (long long)query * D + t * 8 + 2 * (quad & ~1),",
                  "                     SCALE * (even ? mine[0] : given0), SCALE * (even ? mine[1] : given1),",
                  "                     SCALE * (even ? given0 : mine[2]), SCALE * (even ? given1 : mine[3]));",
                  "        }"]
  else:
    reductions = ["        for (int t = 0; t < D / 8; t++)",
                  "#pragma unroll",
                  "          for (int half = 0; half < 2; half++) {",
                  f"            const int query = {first} + half * 8;",
                  "            if (q_start + query < L)",
                  "              red_add2(dq_rows + (long long)query * D + t * 8 + 2 * quad,",
                  "                       SCALE * dq_part[part][t][2 * half], SCALE * dq_part[part][t][2 * half + 1]);",
                  "          }"]
  if plan.dq_bulk_reduce:
    return ["    {",
            "      const int head = kv_head * GROUP + (GROUP == 1 ? 0 : iteration / q_tiles);",
            "      float* dq_rows = dq_accum + (((long long)batch * H + head) * L + q_start) * D;",
            "      float* staged = (float*)(shared_bytes + (dq_staging - shared_address(shared_bytes)));",
            "#pragma unroll",
            f"      for (int part = 0; part < {slices}; part++)",
            "#pragma unroll",
            "        for (int t = 0; t < D / 8; t++)",
            "#pragma unroll",
            "          for (int half = 0; half < 2; half++) {",
            f"            const int query = {first} + half * 8;",
            "            *(float2*)(staged + query * D + t * 8 + 2 * quad) =",
            "                make_float2(SCALE * dq_part[part][t][2 * half], SCALE * dq_part[part][t][2 * half + 1]);",
            "          }",
            "      async_proxy_fence();",
            "      warpgroup_sync();   // the warpgroup's rows staged",
            "      if (threadIdx.x % 128 == 0) {   // one thread adds them by bulk reductions (rows past L left out)",
            f"        for (int part = 0; part < {slices}; part++) {{",
            f"          const int slice = (threadIdx.x / 128) * {slices} + part;",
            "          const int rows = min(64, L - q_start - slice * 64);",
            "          if (rows > 0)",
            "            bulk_reduce_add(dq_rows + slice * 64 * D, dq_staging + slice * 64 * D * 4, rows * D * 4);",
            "        }",
            "        bulk_commit();",
            "      }",
            "    }"]
  return ["    {",
          "      const int head = kv_head * GROUP + (GROUP == 1 ? 0 : iteration / q_tiles);",
          "      float* dq_rows = dq_accum + (((long long)batch * H + head) * L + q_start) * D;",
          "#pragma unroll",
          f"      for (int part = 0; part < {slices}; part++)",
          "#pragma unroll",
          *reductions,
          "    }"]


def dq_count_helpers(plan: AttentionBackwardPlan) -> list[str]:
  """The single pass's dq (plan.dq_accumulate): each (query head, Q tile) of dq_accum has a count in dq_counts (the
  delta kernel zeroes it) of the K/V blocks that have added into it; the block whose addition completes the count
  (`contributors`: the causal blocks whose first Q tile is at or before it) rounds the tile's sums into dq
  (`dq_count_final_lines`). `done`: a flag a thread in shared memory after the dS tile."""
  p, threads = plan, plan.consumer_threads   # (the threads that convert: all but a producer warpgroup)
  stored = "(column ^ ((row & 7) << 3))" if p.dq_swizzled else "column"   # (rows start at multiples of 16)
  flags = p.wgmma_stages * 2 * _tile_bytes(p, p.dkdv_stream) + p.ds_tile_bytes
  return [f"  constexpr int COUNTED_TILES = (L + {DQ_COUNT_ROWS - 1}) / {DQ_COUNT_ROWS};   // dq_counts of a head",
          f"  unsigned* done = (unsigned*)(shared_bytes + (stages - shared_address(shared_bytes)) + {flags});",
          f"  const unsigned dq_staging = stages + {flags + 4 * p.dkdv_block[0]}u;   // (dq_bulk_reduce)",
          "  auto tile_head = [&](int it) { return kv_head * GROUP + (GROUP == 1 ? 0 : it / q_tiles); };",
          "  auto tile_start = [&](int it) { return q_first + (GROUP == 1 ? it : it % q_tiles) * BQ; };",
          "  auto tile_count = [&](int it) {",
          "    return dq_counts + ((long long)batch * H + tile_head(it)) * COUNTED_TILES + tile_start(it) / BQ; };",
          "  auto contributors = [&](int it) {",
          "    return (unsigned)(CAUSAL ? min((int)gridDim.y, (tile_start(it) + BQ + BK - 1) / BK) : (int)gridDim.y);",
          "  };",
          "  auto convert_tile = [&](int it) {   // dq of the tile's rows from dq_accum's (read in L2)",
          "    const int head = tile_head(it), first = tile_start(it), rows = min(BQ, L - first);",
          "    const float* sums = dq_accum + (((long long)batch * H + head) * L + first) * D;",
          f"    grad_t* target = dq + {HEAD_OFFSET.format(*p.dq_strides[:2])} + (long long)first * "
          f"{p.dq_strides[2]}LL;",
          "    // every load issued before the first store (the stores might alias the sums, so the compiler would",
          "    // keep each load after the stores before it: an L2 round trip a piece instead of one a tile)",
          f"    constexpr int PIECES = (BQ * (D / 4) + {threads} - 1) / {threads};",
          "    float4 sum[PIECES];",
          "#pragma unroll",
          "    for (int n = 0; n < PIECES; n++) {",
          f"      const int i = threadIdx.x + n * {threads}, row = i / (D / 4), column = (i % (D / 4)) * 4;",
          f"      if (row < rows) sum[n] = __ldcg((const float4*)(sums + (long long)row * D + {stored}));",
          "    }",
          "#pragma unroll",
          "    for (int n = 0; n < PIECES; n++) {",
          f"      const int i = threadIdx.x + n * {threads}, row = i / (D / 4), column = (i % (D / 4)) * 4;",
          f"      grad_t* out = target + (long long)row * {p.dq_strides[2]}LL + column;",
          *_four_stores(p, "      if (row < rows) ", "out", "sum[n]"),
          "    }",
          "  };"]


def _four_stores(plan: AttentionBackwardPlan, guard: str, out: str, value: str) -> list[str]:
  """C storing float4 `value` into four neighbouring gradient elements at `out`: one 16-byte (float32) or 8-byte
  (two packed pairs) store where dq's strides keep every row's start a multiple of 4 elements (its buffer aligned,
  as plan.vector_width assumes of the operands), else four."""
  if all(stride % 4 == 0 for stride in plan.dq_strides):
    if plan.grad_float32: return [f"{guard}*(float4*){out} = {value};"]
    return [f"{guard}*(uint2*){out} = make_uint2(pack_floats({value}.x, {value}.y), "
            f"pack_floats({value}.z, {value}.w));"]
  return [f"{guard}{{",
          f"        {out}[0] = grad_from_float({value}.x); {out}[1] = grad_from_float({value}.y);",
          f"        {out}[2] = grad_from_float({value}.z); {out}[3] = grad_from_float({value}.w);",
          "      }"]


def dq_count_final_lines(plan: AttentionBackwardPlan) -> list[str]:
  """The single pass after the loop: every thread's reductions fenced, a barrier, then the block's tiles counted (a
  thread a tile, blockDim of them at a time), and the tiles whose counts this block completed converted by the whole
  block (the threadFenceReduction pattern: the counting thread fences again before the block reads the sums)."""
  sync, threads = block_sync(plan), block_threads(plan)
  return [*(["  if (threadIdx.x % 128 == 0) bulk_wait_all();   // the bulk reductions performed"]
            if plan.dq_bulk_reduce else []),
          "  __threadfence();",
          f"  {sync};",
          f"  for (int base = 0; base < iterations; base += {threads}) {{",
          "    const int it = base + threadIdx.x;",
          "    done[threadIdx.x] = it < iterations && atomicAdd(tile_count(it), 1u) + 1u == contributors(it);",
          "    if (done[threadIdx.x]) __threadfence();",
          f"    {sync};",
          f"    for (int j = 0; j < {threads} && base + j < iterations; j++)",
          "      if (done[j]) convert_tile(base + j);",
          f"    {sync};   // (done rewritten next)",
          "  }"]


def iteration_tile_lines(plan: AttentionBackwardPlan) -> list[str]:
  """C naming a dK/dV iteration's tiles (`iteration` and its `stage` declared before): its first query, the shared
  addresses of the stage's Q and dO tiles, its LSE and delta rows."""
  return ["    const int q_start = q_first + (GROUP == 1 ? iteration : iteration % q_tiles) * BQ;",
          f"    {stage_addresses(plan, plan.dkdv_stream, 'q_stage', 'do_stage', 'stage')}",
          "    const float* lse_tile = row_buffers + stage * 2 * BQ;",
          "    const float* delta_tile = lse_tile + BQ;"]


def stage_addresses(plan: AttentionBackwardPlan, rows: int, first: str, second: str, stage: str) -> str:
  """C declaring the shared addresses `first` and `second` of stage `stage`'s two tiles of `rows` rows."""
  tile = _tile_bytes(plan, rows)
  return f"const unsigned {first} = stages + ({stage}) * {2 * tile}u, {second} = {first} + {tile}u;"


def _owned_tiles(plan: AttentionBackwardPlan, rows: int, base: str, prologue: str, start: str, count: str,
                 tiles: tuple[tuple[str, str, int], tuple[str, str, int]]) -> list[str]:
  """C placing a kernel's two owned swizzled tiles of `rows` rows (`tiles`: (shared address name, source pointer,
  row stride) each) from the first 1024-byte atom at or after shared address `base`, the stages after them, then
  `prologue` and the tiles' copies (rows `start` on, `count` of them)."""
  (first, _, _), (second, _, _) = tiles
  tile = _tile_bytes(plan, rows)
  return [f"  const unsigned {first} = ({base} + 1023u) & ~1023u;",
          f"  const unsigned {second} = {first} + {tile}u, stages = {second} + {tile}u;",
          prologue, *copy_stage_lines(plan, rows, start, count, tiles)]


def _owned_descriptor(rows: int, tile: str) -> str:
  """The descriptor of this warpgroup's 64 rows of the owned tile of `rows` rows at shared address `tile`, D's k16
  slice j: the A operand of a scores product read from shared memory."""
  lbo, sbo = key_strides()
  offset = f"(threadIdx.x / 128) * {64 * ROW_BYTES} + {key_slice_start(rows, CExpr('j'))}"
  return f"wgmma_descriptor({tile} + {offset}, {lbo}, {sbo})"


def dkdv_body(plan: AttentionBackwardPlan, entry: str, prologue: str, held_loads: str, probabilities: str,
              gradients: str, store: str) -> str:
  """The dK/dV kernel (the parameters of attention_backward's): `prologue` (the block's keys and Q tiles), K and V
  held, the loop over (query head, Q tile) iterations, `probabilities` (P^T in place of S^T, masked) and `gradients`
  (dS^T in place of dP^T), `store`. In an iteration dP^T runs while P^T is computed, and dV += P^T dO while dS^T is."""
  p, stream = plan, plan.dkdv_stream
  q_stride, do_stride, lse_stride = p.q_strides[2], p.do_strides[2], p.lse_strides[2]
  copy = copy_stage_lines(p, stream, "q_start", "q_rows", (("q_stage", "q + q_row0", q_stride),
                                                            ("do_stage", "dout + do_row0", do_stride)))
  offset = HEAD_OFFSET
  if p.dkdv_held:   # K's and V's A fragments in registers, loaded from padded tiles
    owned = ["  elem_t* k_tile = (elem_t*)shared_bytes;               // BK x PITCH",
             "  elem_t* v_tile = k_tile + BK * PITCH;                 // BK x PITCH",
             "  float* row_buffers = (float*)(v_tile + BK * PITCH);  // a stage's LSE and delta rows: 2 x stages x BQ",
             "  // the stages' swizzled Q and dO tiles from the next 1024-byte atom",
             f"  const unsigned stages = (shared_address(row_buffers + {2 * p.wgmma_stages} * BQ) + 1023u) & ~1023u;",
             prologue]
    scores = scores_lines(p, stream, (("st", "k_held", "q_stage"), ("dpt", "v_held", "do_stage")),
                          scores_halved(p, DKDV_KERNEL))
  else:   # K and V in swizzled tiles before the stages, A read through descriptors (fewer registers)
    owned = ["  float* row_buffers = (float*)shared_bytes;   // a stage's LSE and delta rows: 2 x stages x BQ",
             "  // the swizzled K and V tiles from the next 1024-byte atom, then the stages' Q and dO tiles",
             *_owned_tiles(p, p.block_kv, f"shared_address(row_buffers + {2 * p.wgmma_stages} * BQ)", prologue,
                           "k_start", "k_rows", (("k_owned", "k + k_row0", p.k_strides[2]),
                                                 ("v_owned", "v + v_row0", p.v_strides[2])))]
    scores = scores_lines(p, stream, (("st", _owned_descriptor(p.block_kv, "k_owned"), "q_stage"),
                                      ("dpt", _owned_descriptor(p.block_kv, "v_owned"), "do_stage")))
  body = "\n".join([
    f"{entry}(const elem_t* __restrict__ q,",
    "    const elem_t* __restrict__ k, const elem_t* __restrict__ v, const elem_t* __restrict__ dout,",
    "    const float* __restrict__ lse, const float* __restrict__ delta, grad_t* __restrict__ dk,",
    "    grad_t* __restrict__ dv" + (", float* __restrict__ dq_accum, unsigned* __restrict__ dq_counts, grad_t* "
                                    "__restrict__ dq" if p.dq_accumulate else "") + ") {",
    *owned,
    "  copy_async_commit();   // K and V: a group of their own",
    *(dq_count_helpers(p) if p.dq_accumulate else []),
    "  // the Q and dO tiles, LSE and delta rows of iteration `iteration` into stage `stage`, not committed",
    "  auto copy_stage = [&](int iteration, int stage) {",
    "    const int head = kv_head * GROUP + (GROUP == 1 ? 0 : iteration / q_tiles);",
    "    const int q_start = q_first + (GROUP == 1 ? iteration : iteration % q_tiles) * BQ;",
    "    const int q_rows = min(BQ, L - q_start);",
    f"    const long long q_row0 = {offset.format(*p.q_strides[:2])} + (long long)q_start * {q_stride}LL;",
    f"    const long long do_row0 = {offset.format(*p.do_strides[:2])} + (long long)q_start * {do_stride}LL;",
    f"    const long long lse_row0 = {p.lse_offset}LL + {offset.format(*p.lse_strides[:2])} + "
    f"(long long)q_start * {lse_stride}LL;",
    f"    {stage_addresses(p, stream, 'q_stage', 'do_stage', 'stage')}",
    *copy,
    f"    load_row(row_buffers + stage * 2 * BQ, lse + lse_row0, {lse_stride}LL, q_rows, BQ);",
    "    load_row(row_buffers + stage * 2 * BQ + BQ, delta + ((long long)batch * H + head) * L + q_start, 1, q_rows,",
    "             BQ);",
    "  };",
    "  if (iterations > 0) copy_stage(0, 0);",
    "  copy_async_commit();",
    "  copy_async_wait<1>();   // K and V have landed",
    "  __syncthreads();",
    held_loads,
    "  float dk_acc[D / 8][4], dv_acc[D / 8][4];",
    "#pragma unroll",
    "  for (int t = 0; t < D / 8; t++) for (int c = 0; c < 4; c++) { dk_acc[t][c] = 0.0f; dv_acc[t][c] = 0.0f; }",
    "  for (int iteration = 0; iteration < iterations; iteration++) {",
    "    copy_async_wait<0>();",
    "    async_proxy_fence();",
    *(["    if (threadIdx.x % 128 == 0) bulk_wait_read();   // the staged dQ rows read: free to rewrite"]
      if p.dq_bulk_reduce else []),
    "    __syncthreads();   // this stage's copies, by every thread, have landed; the other stage is free",
    "    if (iteration + 1 < iterations) {",
    f"      copy_stage(iteration + 1, (iteration + 1) % {p.wgmma_stages});",
    "      copy_async_commit();",
    "    }",
    f"    const int stage = iteration % {p.wgmma_stages};",
    *iteration_tile_lines(p),
    *scores,
    "    wgmma_wait_one();   // S^T",
    "    fence_accumulators(st);",
    "    // mask only the tiles that need it: keys past S, queries past L, or (causal) keys past its first query",
    "    const bool masked = k_start + BK > S || q_start + BQ > L || (CAUSAL && k_start + BK - 1 > q_start);",
    probabilities,
    *values_lines(stream, "dv_acc", "st", "pt", "do_stage"),
    "    wgmma_wait_one();   // dP^T",
    "    fence_accumulators(dpt);",
    gradients,
    *values_lines(stream, "dk_acc", "dpt", "dst", "q_stage"),
    *(dq_accumulate_lines(p) if p.dq_accumulate else []),
    *(_last_wait(p, "dv_acc", "dk_acc") if not p.dq_accumulate else
      [*_last_wait(p, "dv_acc", "dk_acc")[:-1], *dq_reduce_lines(p), "  }", *dq_count_final_lines(p)]),
    "  copy_async_wait<0>();",
    store,
    "}"])
  return body + "\n"


def dq_body(plan: AttentionBackwardPlan, entry: str, prologue: str, delta: str, held_loads: str, probabilities: str,
            gradients: str, store: str) -> str:
  """The dQ kernel (the parameters of attention_backward's): `prologue` (the block's rows and K/V tiles), Q, dO and
  LSE copied, `delta`, Q and dO held, the loop over K/V tiles, `probabilities` (P in place of S, masked) and
  `gradients` (dS in place of dP), `store`. In an iteration dP runs while P is computed."""
  p, stream = plan, plan.dq_stream
  k_stride, v_stride = p.k_strides[2], p.v_strides[2]
  copy = copy_stage_lines(p, stream, "k_first", "S - k_first",
                          (("k_stage", "k + k_base + (long long)k_first * " + f"{k_stride}LL", k_stride),
                           ("v_stage", "v + v_base + (long long)k_first * " + f"{v_stride}LL", v_stride)))
  if p.dq_held:
    owned = ["  // the stages' swizzled K and V tiles from the next 1024-byte atom",
             "  const unsigned stages = (shared_address(delta_tile + BQ) + 1023u) & ~1023u;", prologue]
    scores = scores_lines(p, stream, (("s", "q_held", "k_stage"), ("dp", "do_held", "v_stage")),
                          scores_halved(p, DQ_KERNEL))
  else:   # Q and dO also in swizzled tiles before the stages, A read through descriptors
    owned = ["  // the swizzled Q and dO tiles from the next 1024-byte atom, then the stages' K and V tiles",
             *_owned_tiles(p, p.block_q, "shared_address(delta_tile + BQ)", prologue, "q_start", "q_rows",
                           (("q_owned", "q + q_row0", p.q_strides[2]),
                            ("do_owned", "dout + do_row0", p.do_strides[2])))]
    scores = scores_lines(p, stream, (("s", _owned_descriptor(p.block_q, "q_owned"), "k_stage"),
                                      ("dp", _owned_descriptor(p.block_q, "do_owned"), "v_stage")))
  body = "\n".join([
    f"{entry}(const elem_t* __restrict__ q,",
    "    const elem_t* __restrict__ k, const elem_t* __restrict__ v, const o_t* __restrict__ o,",
    "    const elem_t* __restrict__ dout, const float* __restrict__ lse, grad_t* __restrict__ dq,",
    "    float* __restrict__ delta) {",
    "  elem_t* q_tile = (elem_t*)shared_bytes;                // BQ x PITCH (dq_held: Q's A fragments from it)",
    "  elem_t* do_tile = q_tile + BQ * PITCH;                 // BQ x PITCH (delta reads it)",
    "  float* lse_tile = (float*)(do_tile + BQ * PITCH);      // BQ",
    "  float* delta_tile = lse_tile + BQ;                     // BQ",
    *owned,
    "  copy_async_commit();   // Q, dO and LSE: a group of their own",
    "  // the K and V tiles of `tile` into stage `stage`, not committed",
    "  auto copy_stage = [&](int tile, int stage) {",
    "    const int k_first = tile * BK;",
    f"    {stage_addresses(p, stream, 'k_stage', 'v_stage', 'stage')}",
    *copy,
    "  };",
    "  copy_stage(0, 0);",
    "  copy_async_commit();",
    "  copy_async_wait<1>();   // Q, dO and LSE have landed",
    "  __syncthreads();",
    delta,
    "  __syncthreads();",
    "  // this lane's two accumulator rows (C fragment rows g and g + 8 of the warp's 16)",
    "  const float row_lse[2] = {lse_tile[warp * 16 + g] * LSE_TO_LOG2, lse_tile[warp * 16 + g + 8] * LSE_TO_LOG2};",
    "  const float row_delta[2] = {delta_tile[warp * 16 + g], delta_tile[warp * 16 + g + 8]};",
    held_loads,
    "  float dq_acc[D / 8][4];",
    "#pragma unroll",
    "  for (int t = 0; t < D / 8; t++) for (int c = 0; c < 4; c++) dq_acc[t][c] = 0.0f;",
    "  for (int tile = 0; tile < kv_tiles; tile++) {",
    "    copy_async_wait<0>();",
    "    async_proxy_fence();",
    "    __syncthreads();   // this stage's copies, by every thread, have landed; the other stage is free",
    "    if (tile + 1 < kv_tiles) {",
    f"      copy_stage(tile + 1, (tile + 1) % {p.wgmma_stages});",
    "      copy_async_commit();",
    "    }",
    "    const int k_start = tile * BK;",
    f"    {stage_addresses(p, stream, 'k_stage', 'v_stage', f'tile % {p.wgmma_stages}')}",
    *scores,
    "    wgmma_wait_one();   // S",
    "    fence_accumulators(s);",
    "    // mask only the tiles that need it: keys past S, rows past L, or (causal) keys past the tile's first query",
    "    const bool masked = k_start + BK > S || q_start + BQ > L || (CAUSAL && k_start + BK - 1 > q_start);",
    probabilities,
    "    wgmma_wait_all();   // dP",
    "    fence_accumulators(dp);",
    gradients,
    *values_lines(stream, "dq_acc", "dp", "ds", "k_stage"),
    *_last_wait(p, "dq_acc"),
    store,
    "}"])
  return body + "\n"
