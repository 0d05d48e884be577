"""The fused attention forward on Hopper's warpgroup MMA (wgmma, sm_90a) for float16/bfloat16 operands: the parts of
codegen/attention_render.py's kernel that differ when its plan says `mma="wgmma"`.

A CTA is block_m / 64 warpgroups, each owning 64 query rows (warp w of the CTA: rows 16 w.., as the mma.sync kernel's
warps). Per key tile (block_n keys):

- K and V rows are copied by cp.async into shared memory in the 128-byte-swizzled layout of codegen/wgmma_tiles.py
  (`staged_offset`): a tile is block_n rows of 128 bytes (64 elements) per 64 columns of D, the chunks of 64 columns
  one after another, 8 rows to a 1024-byte atom, 16-byte piece p of row r at piece p ^ (r % 8).
- S (64 x block_n per warpgroup) = Q K^T: one m64n{block_n}k16 per 16 of D, A = Q from registers (loaded once, the
  m16n8k16 A fragments the mma.sync kernel loads: wgmma's register A of warp w is that fragment of rows 16 w..), B = K
  through a K-major descriptor (`key_slice_start`: slice j of D starts 32 (j % 4) bytes into the rows of chunk j / 4).
- The accumulators hold S in the m16n8 C layout per warp (wgmma_tiles.accumulator_position: element 4 n + i is the
  mma.sync kernel's scores[n][i]), so the masks and the online softmax are the mma.sync kernel's, unchanged.
- O (64 x D) += P V: one m64n{D}k16 per 16 keys, A = P from registers (two neighbouring n tiles of S's accumulators
  packed to 16 bits are its A fragment, as for mma.sync), B = V through an MN-major descriptor with the transpose bit
  (`value_slice_start`: keys 16 j.. start at row 16 j; LBO = the bytes of one chunk of 64 columns, SBO = one atom).

Every wgmma group is waited for before its results are read. Without `overlap` a tile's S, softmax and P V follow
each other (the warpgroups of a CTA and the CTAs of a multiprocessor overlap each other); with it
(`overlapped_loop_lines`, 3+ stages) the previous tile's P V is in flight while this tile's S is computed, masked and
softmaxed, O's rescale deferred until it lands (FlashAttention-3's pipelining inside a warpgroup). `q_shared`: Q is
staged once in a swizzled tile after the stages (`copy_q_lines`) and S's A operand read through a K-major descriptor
instead of registers.

Not here yet: a producer warp with TMA copies and mbarriers, and two warpgroups taking turns on the tensor cores.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

from ourgrad.codegen.wgmma_copies import ATOM_BYTES, PIECE_BYTES, ROW_BYTES
from ourgrad.codegen.wgmma_tiles import (BARRIER_HELPERS, PRODUCER_REGISTERS, SLICE_BYTES, SWIZZLE_128B,
                                         WARPGROUP_THREADS, CExpr, launch_registers, ring_barrier_lines)

if TYPE_CHECKING:
  from ourgrad.codegen.attention import AttentionPlan

# query rows of one warpgroup (the M of one wgmma), elements of one 128-byte row of a staged tile (16-bit)
WARPGROUP_ROWS, CHUNK_ELEMENTS = 64, 64
# the wgmma kernel's query rows per CTA: one warpgroup, and as many CTAs a multiprocessor as their registers allow
# (up to CTAS_PER_PROCESSOR): on the H200 (bf16, D = 64, causal, B=4 H=12) 64 x 128 with 3 CTAs was the fastest at
# T = 1024 and 4096, 13-25% ahead of two or three warpgroups a CTA and of the overlapped loop at 2 CTAs
# (extra/bench/results/sweep_attention_wgmma_h200_s13.txt)
WGMMA_BLOCK_M = 64
# registers a thread needs beside Q's, S's and O's fragments (AttentionPlan.fragment_registers): ptxas gave 166 for
# D = 64 with 128 keys a tile (112 of fragments)
WGMMA_OVERHEAD_REGISTERS = 54
WGMMA_DTYPES = ("float16", "bfloat16")
# the rule's kernel where it fits (producer_plan, ATTENTION_PRODUCER=1): a producer warpgroup and three consumers of
# 64 rows each over a ring of 4 stages, overlapped, ping-pong. H200, bf16 causal B=4 H=12 D=64 T=4096, one call
# (results/sweep_attention_producer_h200_s16_2.txt): 192 x 112 0.320 ms, 192 x 96 0.319 (with or without
# ping-pong), the one-warpgroup rule 0.333, PyTorch 0.259; 3 stages without overlap 0.348, two consumers 0.367+,
# 2 stages with overlap (no prefetch left) 0.46-0.72, exp_poly slower (results/sweep_attention_producer_h200_s16.txt)
PRODUCER_CONSUMERS, PRODUCER_STAGES, PRODUCER_OVERLAP, PRODUCER_LEAST_WAVES = 3, 4, True, 4
# the producer kernel's consumers stage Q in shared memory (own_q_lines), which frees Q's registers: 192 x 128 fits
# 160 without spills where Q in registers left 112 keys. H200 bf16 causal B=4 H=12 D=64 T=4096, one call
# (results/ck_s17/attnfwd5_1.txt, _2.txt): 0.262 and 0.259 ms against 0.266 and 0.266 for 192 x 112, PyTorch
# 0.262 and 0.257
PRODUCER_Q_SHARED = True
# the fewest key tiles a CTA streams on average, in rings of PRODUCER_STAGES, for the producer kernel: its ring fills
# and drains once a CTA. H200 bf16 causal D=64 B=16 T=1024 (GPT-2's shape, ~5 tiles of 112 keys a causal CTA: about
# one ring): 0.140 ms against the one-warpgroup rule's 0.113 (results/final_s16/producer_t1024.txt); T=4096 (~19):
# 0.320 against 0.333
PRODUCER_LEAST_RINGS = 2
# registers a producer thread keeps when the consumers take their share (its cp.async loop fits 32), and the fewest
# it may be left with (setmaxnreg's least is 24)
PRODUCER_KEEPS, LEAST_PRODUCER_REGISTERS = 32, 24
# the fewest keys a tile of the rule's producer kernel (fewer: more rescales and waits than the shared tiles save;
# 96-128 measured on the H200, 192 x 64 over 2 stages 0.72 ms at T=4096, results/ck_s16/attnfwd4_1.txt). D = 128
# (80 keys at 160 registers with Q in shared memory) keeps the one-warpgroup rule
PRODUCER_LEAST_KEYS = 96


def wgmma_refusal(dtype: str, head_dim: int, vector_copies: bool) -> str | None:
  """Why the wgmma kernel cannot run an attention (None: it can): 16-bit operands, D a multiple of 64 (whole 128-byte
  rows), rows copied as 16-byte pieces."""
  if dtype not in WGMMA_DTYPES: return f"{dtype} operands (wgmma attention takes float16/bfloat16)"
  if head_dim % CHUNK_ELEMENTS: return f"head size {head_dim} (wgmma attention takes multiples of {CHUNK_ELEMENTS})"
  if not vector_copies: return "k or v rows not 16-byte aligned (cp.async copies)"
  return None


def resident_ctas(plan: AttentionPlan, most: int, multiprocessor_registers: int) -> int:
  """The most CTAs (at most `most`) a multiprocessor can hold by registers: the launch bounds' cap for that many
  (wgmma_tiles.launch_registers) must fit the fragments and WGMMA_OVERHEAD_REGISTERS."""
  needed = plan.fragment_registers + WGMMA_OVERHEAD_REGISTERS
  fitting = [ctas for ctas in range(1, most + 1)
             if launch_registers(plan.threads, ctas, multiprocessor_registers) >= needed]
  return max(fitting, default=1)


def consumer_register_share(plan: AttentionPlan, multiprocessor_registers: int) -> int:
  """Registers a consumer thread of plan.producer may take by setmaxnreg: the CTA's share of the multiprocessor's
  registers (its launch bounds: threads x min_ctas resident) less the producer's PRODUCER_KEEPS, over the consumers,
  in granules of 8, at most 240 (1 CTA of 2 consumer warpgroups: 168 a thread at launch, 232 after; of 3: 160)."""
  pool = launch_registers(plan.threads, plan.min_ctas, multiprocessor_registers) * plan.threads - \
      WARPGROUP_THREADS * PRODUCER_KEEPS
  return min(pool // plan.consumer_threads // 8 * 8, 240)


def producer_plan(plan: AttentionPlan, multiprocessors: int, multiprocessor_registers: int,
                  shared_limit: int) -> AttentionPlan | None:
  """The rule's producer kernel for a wgmma plan (ATTENTION_PRODUCER=1): PRODUCER_CONSUMERS consumer warpgroups over
  a ring of PRODUCER_STAGES, overlapped and ping-pong (PRODUCER_OVERLAP), one CTA a multiprocessor, the consumers at
  their setmaxnreg share (consumer_register_share), keys a tile the most (a multiple of 16 from 128 to
  PRODUCER_LEAST_KEYS) whose fragments and WGMMA_OVERHEAD_REGISTERS fit that share (D = 64, 3 consumers at 160 with
  Q in shared memory, PRODUCER_Q_SHARED: 128; ptxas fits them without spills) and whose stages fit `shared_limit`;
  None where none fits, where the grid is under PRODUCER_LEAST_WAVES CTAs a multiprocessor (a CTA of 2-3
  warpgroups needs more of them to even out the causal tails than the 1-warpgroup ones), or where a CTA streams
  fewer than PRODUCER_LEAST_RINGS rings of key tiles on average (mean_key_tiles: the ring's fill and drain are not
  paid back)."""
  consumers = replace(plan, block_m=PRODUCER_CONSUMERS * WARPGROUP_ROWS, stages=PRODUCER_STAGES, min_ctas=1,
                      producer=True, overlap=PRODUCER_OVERLAP, pingpong=PRODUCER_OVERLAP and PRODUCER_CONSUMERS > 1,
                      q_shared=PRODUCER_Q_SHARED and plan.q.vector_aligned(PIECE_BYTES // plan.itemsize))
  if consumers.query_blocks * plan.heads * plan.batch < PRODUCER_LEAST_WAVES * multiprocessors: return None
  share = consumer_register_share(consumers, multiprocessor_registers)
  for block_n in range(128, PRODUCER_LEAST_KEYS - 1, -16):
    candidate = replace(consumers, block_n=block_n, consumer_registers=share)
    if candidate.fragment_registers + WGMMA_OVERHEAD_REGISTERS <= share and candidate.shared_bytes <= shared_limit:
      return candidate if mean_key_tiles(candidate) >= PRODUCER_LEAST_RINGS * PRODUCER_STAGES else None
  return None


def mean_key_tiles(plan: AttentionPlan) -> float:
  """Key tiles a CTA streams on average: all of them, or about half under a causal mask (the diagonal's CTAs stop
  where their last query row does)."""
  tiles = math.ceil(plan.source / plan.block_n)
  return (tiles + 1) / 2 if plan.causal else tiles


def producer_registers(plan: AttentionPlan) -> int:
  """Registers a producer thread keeps after setmaxnreg.dec: the CTA's launch registers less the consumers'
  consumer_registers, over the producer's 128 threads, in granules of 8, at most PRODUCER_REGISTERS (its copies
  need 24 to 40; 3 consumers at 160 leave 32)."""
  pool = launch_registers(plan.threads, plan.min_ctas, plan.multiprocessor_registers) * plan.threads
  return min((pool - plan.consumer_threads * plan.consumer_registers) // WARPGROUP_THREADS // 8 * 8,
             PRODUCER_REGISTERS)


def tile_bytes(plan: AttentionPlan) -> int:
  """Bytes of one staged K (or V) tile: block_n rows of 128 bytes per 64 columns of D."""
  return plan.block_n * plan.head_dim * plan.itemsize


def stage_bytes(plan: AttentionPlan) -> int: return 2 * tile_bytes(plan)


def q_tile_bytes(plan: AttentionPlan) -> int:
  """Bytes of the CTA's staged Q tile (q_shared; else none): block_m rows, laid out as a K tile."""
  return plan.block_m * plan.head_dim * plan.itemsize if plan.q_shared else 0


def barrier_offset(plan: AttentionPlan) -> int:
  """Where the producer's mbarriers start from the aligned base: after the stages and the Q tile."""
  return plan.stages * stage_bytes(plan) + q_tile_bytes(plan)


def shared_bytes(plan: AttentionPlan) -> int:
  """The stages' K and V tiles, the Q tile after them (q_shared), the producer's mbarriers (8 bytes, `full` and
  `empty` a stage), and room to align their base to an atom (the swizzle is a function of address bits 7-9)."""
  return barrier_offset(plan) + 16 * plan.stages * plan.producer + ATOM_BYTES


def staged_offset(block_n: int, row, column):
  """The byte in a staged tile where element `column` (a multiple of 8: a 16-byte piece's first) of row `row` goes:
  chunk column // 64 (block_n rows of 128 bytes each), piece (column % 64) // 8 swizzled with the row in its atom.
  Evaluates on ints, numpy arrays and wgmma_tiles.CExpr alike."""
  return (column // CHUNK_ELEMENTS) * (block_n * ROW_BYTES) + row * ROW_BYTES + \
      ((((column % CHUNK_ELEMENTS) // 8) ^ (row & 7)) << 4)


def key_slice_start(block_n: int, j):
  """Byte offset in the K tile where the K-major descriptor of D's k16 slice j starts."""
  return (j // 4) * (block_n * ROW_BYTES) + (j % 4) * SLICE_BYTES


def value_slice_start(j):
  """Byte offset in the V tile where the MN-major descriptor of keys 16 j .. 16 j + 15 starts."""
  return 16 * j * ROW_BYTES


def key_strides() -> tuple[int, int]:
  """(LBO, SBO) of K's K-major descriptor: LBO unused with the 128-byte swizzle, SBO one atom (8 rows)."""
  return PIECE_BYTES, ATOM_BYTES


def value_strides(block_n: int) -> tuple[int, int]:
  """(LBO, SBO) of V's MN-major descriptor: LBO from one 64-column chunk to the next, SBO one atom (8 keys)."""
  return block_n * ROW_BYTES, ATOM_BYTES


# ---------------------------------------------------------------- the CUDA source

def _wgmma_function(name: str, n: int, ptx_type: str, transposed: int) -> str:
  """`name(acc, a, b, accumulate)`: acc (64 x n per warpgroup, float32, n / 2 a thread) = A (64 x 16, from the 4
  registers `a`) @ B (16 x n, the shared-memory operand of descriptor `b`; transposed: MN-major), + acc where
  `accumulate` is not 0 (the wgmma's scale-d: a first product needs no zeroed accumulators)."""
  count = n // 2
  registers = ", ".join(f"%{i}" for i in range(count))
  instruction = ("{ .reg .pred accumulate; setp.ne.b32 accumulate, %" + str(count + 5) + ", 0; "
                 f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx_type}.{ptx_type} {{{registers}}}, "
                 f"{{%{count}, %{count + 1}, %{count + 2}, %{count + 3}}}, %{count + 4}, accumulate, 1, 1, "
                 f"{transposed}; }}")
  outputs = ", ".join(f'"+f"(acc[{i}])' for i in range(count))
  return (f"__device__ __forceinline__ void {name}(float* acc, const unsigned* a, unsigned long long b, "
          "int accumulate) {\n"
          f'  asm volatile("{instruction}"\n    : {outputs}\n'
          '    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));\n}\n')


_WGMMA_SYNC_HELPERS = f"""__device__ __forceinline__ unsigned shared_address(const void* pointer) {{
  return (unsigned)__cvta_generic_to_shared(pointer);
}}
__device__ __forceinline__ unsigned long long wgmma_descriptor(unsigned address, unsigned lbo, unsigned sbo) {{
  return (unsigned long long)((address & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |
         ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32) | ({SWIZZLE_128B}ull << 62);
}}
__device__ __forceinline__ void stage16(unsigned target, const void* source, bool inside) {{
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(target), "l"(source), "r"(inside ? 16 : 0)
               : "memory");
}}
__device__ __forceinline__ void async_proxy_fence() {{ asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }}
__device__ __forceinline__ void wgmma_fence() {{ asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }}
__device__ __forceinline__ void wgmma_commit() {{ asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }}
__device__ __forceinline__ void wgmma_wait_all() {{ asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }}
__device__ __forceinline__ void wgmma_wait_one() {{ asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }}
__device__ __forceinline__ void copy_wait_all() {{ asm volatile("cp.async.wait_group 0;" ::: "memory"); }}
"""


def _wgmma_shared_a_function(name: str, n: int, ptx_type: str, transposed: int = 0) -> str:
  """`name(acc, a, b, accumulate)` as _wgmma_function's, A (64 x 16) read from shared memory through the K-major
  descriptor `a`."""
  count = n // 2
  registers = ", ".join(f"%{i}" for i in range(count))
  instruction = ("{ .reg .pred accumulate; setp.ne.b32 accumulate, %" + str(count + 2) + ", 0; "
                 f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx_type}.{ptx_type} {{{registers}}}, "
                 f"%{count}, %{count + 1}, accumulate, 1, 1, 0, {transposed}; }}")
  outputs = ", ".join(f'"+f"(acc[{i}])' for i in range(count))
  return (f"__device__ __forceinline__ void {name}(float* acc, unsigned long long a, unsigned long long b, "
          "int accumulate) {\n"
          f'  asm volatile("{instruction}"\n    : {outputs}\n    : "l"(a), "l"(b), "r"(accumulate));\n}}\n')


def product_helpers(scores_n: int, head_dim: int, ptx_type: str, shared_a: bool = False,
                    values_shared_a: bool = False) -> str:
  """The PTX helpers of attention's two wgmma shapes: `wgmma_scores` (n = scores_n, K-major B: a tile of rows whose D
  is contiguous, as K in S = Q K^T; A from registers, or (`shared_a`) from shared memory) and `wgmma_values` (n =
  head_dim, transposed B: such a tile read along its rows, as V in O += P V; with `values_shared_a` also an overload
  reading A through a descriptor), with the descriptors, swizzled cp.async copies to a shared address, and the fences
  and waits. The backward's kernels (codegen/attention_backward_wgmma.py) multiply by the same two shapes."""
  scores = (_wgmma_shared_a_function("wgmma_scores", scores_n, ptx_type) if shared_a else
            _wgmma_function("wgmma_scores", scores_n, ptx_type, 0))
  values = _wgmma_function("wgmma_values", head_dim, ptx_type, 1)
  if values_shared_a: values += _wgmma_shared_a_function("wgmma_values", head_dim, ptx_type, 1)
  return _WGMMA_SYNC_HELPERS + scores + values


def wgmma_helpers(plan: AttentionPlan, ptx_type: str) -> str:
  """The wgmma kernel's PTX helpers (`product_helpers`): S's n = block_n, A from registers or (q_shared) shared
  memory; O's n = D."""
  helpers = product_helpers(plan.block_n, plan.head_dim, ptx_type, plan.q_shared)
  return helpers + producer_helpers(plan) if plan.producer else helpers


def producer_helpers(plan: AttentionPlan) -> str:
  """plan.producer's helpers: the mbarriers (wgmma_tiles.BARRIER_HELPERS), `copies_arrive` (this thread's cp.async
  copies so far arrive on a barrier when they land) and the register hand-over (setmaxnreg; no-ops without
  consumer_registers)."""
  def registers(kind: str, count: int) -> str:
    return f'asm volatile("setmaxnreg.{kind}.sync.aligned.u32 {count};");' if plan.consumer_registers else ""
  return "\n".join([*BARRIER_HELPERS,
                    "__device__ __forceinline__ void copies_arrive(unsigned barrier) {",
                    '  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(barrier) : '
                    '"memory");',
                    "}",
                    "__device__ __forceinline__ void producer_registers() "
                    f"{{ {registers('dec', producer_registers(plan))} }}",
                    "__device__ __forceinline__ void consumer_registers() "
                    f"{{ {registers('inc', plan.consumer_registers)} }}",
                    # named barriers (0 is __syncthreads): wait with `count` threads arrived, or arrive and go on
                    "__device__ __forceinline__ void named_sync(unsigned id, unsigned count) {",
                    '  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");',
                    "}",
                    "__device__ __forceinline__ void named_arrive(unsigned id, unsigned count) {",
                    '  asm volatile("bar.arrive %0, %1;" :: "r"(id), "r"(count) : "memory");',
                    "}", ""])


def copy_q_lines(plan: AttentionPlan) -> list[str]:
  """q_shared: the CTA's query rows into the Q tile after the stages (as a K tile of block_m rows; rows past L as
  zeros), joining the first tile's commit group."""
  pieces = plan.head_dim // 8
  target = staged_offset(plan.block_m, CExpr("row"), CExpr("column"))
  return [f"  const unsigned q_tile = shared_base + {plan.stages * stage_bytes(plan)};",
          f"  for (int piece = threadIdx.x; piece < {plan.block_m * pieces}; piece += {plan.threads}) {{",
          f"    int row = piece / {pieces}, column = (piece % {pieces}) * 8;",
          f"    bool inside = block_first_row + row < {plan.length};",
          "    long long clamped = inside ? block_first_row + row : 0;",
          f"    stage16(q_tile + {target}, q_base + clamped * {plan.q.strides[2]} + column, inside);",
          "  }"]


def own_q_lines(plan: AttentionPlan) -> list[str]:
  """q_shared with a producer: each consumer warpgroup stages its own 64 query rows of the Q tile (copy_q_lines'
  layout) by cp.async, waits for them, fences the async proxy and meets its own 128 threads (named barrier
  OWN_Q_BARRIER + warpgroup): no warpgroup reads another's rows, so none waits for the others or the producer."""
  pieces = plan.head_dim // 8
  target = staged_offset(plan.block_m, CExpr("row"), CExpr("column"))
  return [f"  const unsigned q_tile = shared_base + {plan.stages * stage_bytes(plan)};",
          f"  for (int piece = threadIdx.x % {WARPGROUP_THREADS}; piece < {WARPGROUP_ROWS * pieces}; "
          f"piece += {WARPGROUP_THREADS}) {{",
          f"    int row = threadIdx.x / {WARPGROUP_THREADS} * {WARPGROUP_ROWS} + piece / {pieces}, "
          f"column = (piece % {pieces}) * 8;",
          f"    bool inside = block_first_row + row < {plan.length};",
          "    long long clamped = inside ? block_first_row + row : 0;",
          f"    stage16(q_tile + {target}, q_base + clamped * {plan.q.strides[2]} + column, inside);",
          "  }",
          "  copy_commit();",
          "  copy_wait_all();",
          "  async_proxy_fence();",
          f"  named_sync({OWN_Q_BARRIER} + threadIdx.x / {WARPGROUP_THREADS}, {WARPGROUP_THREADS});"]


def copy_tile_lines(plan: AttentionPlan, thread: str = "threadIdx.x", threads: int = 0,
                    landing: str = "    copy_commit();") -> list[str]:
  """`copy_tile(tile, stage)`: the key and value rows of one tile into the stage's swizzled K and V tiles by 16-byte
  cp.async (rows past S as zeros), copying thread `thread` of `threads` (default: every thread of the CTA), then
  `landing` (one commit group; the producer: an arrival on the stage's `full` barrier when the copies land)."""
  pieces = plan.head_dim // 8
  target = staged_offset(plan.block_n, CExpr("row"), CExpr("column"))
  return ["  auto copy_tile = [&](int tile, int stage) {",
          f"    unsigned k_stage = shared_base + stage * {stage_bytes(plan)}, v_stage = k_stage + {tile_bytes(plan)};",
          f"    for (int piece = {thread}; piece < {plan.block_n * pieces}; piece += {threads or plan.threads}) {{",
          f"      int row = piece / {pieces}, column = (piece % {pieces}) * 8;",
          f"      int key = tile * {plan.block_n} + row;",
          f"      bool inside = key < {plan.source};",
          "      long long clamped = inside ? key : 0;",
          f"      unsigned target = {target};",
          f"      stage16(k_stage + target, k_base + clamped * {plan.k.strides[2]} + column, inside);",
          f"      stage16(v_stage + target, v_base + clamped * {plan.v.strides[2]} + column, inside);",
          "    }",
          landing,
          "  };"]


def shifted_descriptor(address: str, offset, lbo: int, sbo: int) -> str:
  """The descriptor of the operand `offset` bytes after shared address `address`: `address`'s own descriptor plus
  offset / 16 (its start field counts 16 bytes; an operand inside shared memory never carries out of it). The unrolled
  wgmmas of one tile then share one descriptor and add constants, where each built its own (about three uniform
  instructions a wgmma, ~30 a tile of the forward)."""
  return f"(wgmma_descriptor({address}, {lbo}, {sbo}) + (unsigned long long)(({offset}) >> 4))"


def _scores_issue_lines(plan: AttentionPlan) -> list[str]:
  """S = Q K^T of the warpgroup's 64 rows and the tile's keys issued (scores[0][n][i] is accumulator element 4 n + i):
  the fence that orders the registers' earlier writes before the wgmmas, one wgmma per 16 of D (the first one not
  adding to the accumulators, so they need no zeroing), one group."""
  n_tiles = plan.block_n // 8
  lbo, sbo = key_strides()
  start = key_slice_start(plan.block_n, CExpr("j"))
  # q_shared: this warpgroup's 64 rows of the Q tile, slice j as K's
  queries = (shifted_descriptor(f"q_tile + (threadIdx.x / 128) * {WARPGROUP_ROWS * ROW_BYTES}",
                                key_slice_start(plan.block_m, CExpr('j')), lbo, sbo)
             if plan.q_shared else "q_fragments[0][j]")
  return [f"    float scores[1][{n_tiles}][4];",
          "    wgmma_fence();",
          "#pragma unroll",
          f"    for (int j = 0; j < {plan.head_dim // 16}; j++)",
          f"      wgmma_scores(&scores[0][0][0], {queries}, {shifted_descriptor('k_stage', start, lbo, sbo)}, j > 0);",
          "    wgmma_commit();"]


def pack_lines(source: str, target: str, columns: int, declare: bool) -> list[str]:
  """The A fragments `target`[columns / 16][4] of a 64 x `columns` accumulator tile `source` ([columns / 8][4] a
  thread: two neighbouring n tiles packed to 16 bits are one k16 A fragment, as for mma.sync), all before the wgmmas
  that read them: a wgmma's registers must stay as they are until it is waited for."""
  steps = columns // 16
  return [*([f"    unsigned {target}[{steps}][4];"] if declare else []),
          "#pragma unroll",
          f"    for (int kk = 0; kk < {steps}; kk++) {{",
          f"      {target}[kk][0] = pack_floats({source}[2 * kk][0], {source}[2 * kk][1]);",
          f"      {target}[kk][1] = pack_floats({source}[2 * kk][2], {source}[2 * kk][3]);",
          f"      {target}[kk][2] = pack_floats({source}[2 * kk + 1][0], {source}[2 * kk + 1][1]);",
          f"      {target}[kk][3] = pack_floats({source}[2 * kk + 1][2], {source}[2 * kk + 1][3]);",
          "    }"]


def _pack_lines(plan: AttentionPlan, declare: bool) -> list[str]:
  """P's A fragments of every 16 keys (`pack_lines` of S's accumulators)."""
  return pack_lines("scores[0]", "p", plan.block_n, declare)


def _values_issue_lines(plan: AttentionPlan, values: str, indent: str = "    ") -> list[str]:
  """O += P V issued (one wgmma per 16 keys, V's tile at shared address `values`), one group."""
  lbo, sbo = value_strides(plan.block_n)
  start = value_slice_start(CExpr("kk"))
  return ["#pragma unroll",
          f"{indent}for (int kk = 0; kk < {plan.block_n // 16}; kk++)",
          f"{indent}  wgmma_values(&outputs[0][0][0], p[kk], {shifted_descriptor(values, start, lbo, sbo)}, 1);",
          f"{indent}wgmma_commit();"]


def scores_lines(plan: AttentionPlan) -> list[str]:
  """S = Q K^T of the warpgroup's rows and the tile's keys, waited for."""
  return [*_scores_issue_lines(plan), "    wgmma_wait_all();"]


def weighted_sum_lines(plan: AttentionPlan) -> list[str]:
  """O += P V of the tile, waited for."""
  return [*_pack_lines(plan, declare=True), "    wgmma_fence();", *_values_issue_lines(plan, "v_stage"),
          "    wgmma_wait_all();"]


# ---------------------------------------------------------------- the producer warpgroup (plan.producer)

def producer_lines(plan: AttentionPlan) -> list[str]:
  """The CTA's mbarriers set up, then the producer warpgroup (the threads after the consumers') copying the key tiles
  into the ring of `stages` and leaving: tile t goes to stage t % stages once the consumers released the tile before
  it there (`empty`: every consumer thread arrives, phase t / stages - 1), and each producer thread's copies arrive
  on the stage's `full` barrier (128 arrivals) as they land (cp.async.mbarrier.arrive.noinc: no wait in the
  producer, up to `stages` tiles in flight). With `consumer_registers` the producer gives registers back
  (setmaxnreg.dec) for the consumers to take."""
  stages, consumers = plan.stages, plan.consumer_threads
  return [*ring_barrier_lines(barrier_offset(plan), stages, consumers),
          f"  if (threadIdx.x >= {consumers}) {{",
          "    producer_registers();",
          *("  " + line for line in copy_tile_lines(plan, f"(threadIdx.x - {consumers})", WARPGROUP_THREADS,
                                                    "    copies_arrive(full + 8 * stage);")),
          "    for (int tile = 0; tile < tiles; tile++) {",
          f"      int count = {ring_count(plan)}, stage = count % {stages};",
          f"      if (count >= {stages}) barrier_wait(empty + 8 * stage, (count / {stages} - 1) & 1);",
          "      copy_tile(tile, stage);",
          "    }",
          "    copy_commit();",
          "    copy_wait_all();",
          "    return;",
          "  }",
          "  consumer_registers();"]


def ring_count(plan: AttentionPlan, tile: str = "tile") -> str:
  """Which use of the ring key tile `tile` of this CTA is (its stage: count % stages, its phase: count / stages): the
  tile itself, or a persistent CTA's running count over its items (`used`: the tiles of the items before)."""
  return f"(used + {tile})" if plan.persistent else tile


def persistent_lines(plan: AttentionPlan, item: list[str], consumer: list[str]) -> list[str]:
  """plan.persistent: the ring's mbarriers set up, then the producer and the consumers each walk the CTA's items
  (query blocks of one head) in the same order (`_rounds`), the producer copying each item's key tiles into the ring
  as producer_lines does and the consumers running `consumer` (Q, the loop, the store) per item, both counting the
  ring's uses across items (`used`). The producer copies the next item's first tiles while the consumers finish and
  store this one: a CTA's start and end overlap its neighbours' work (FlashAttention-3's persistent kernel).
  `item`: the lines that name the item's block, head and bases from `order` and its `tiles`."""
  consumers = plan.consumer_threads
  def rounds(body: list[str]) -> list[str]:
    return ["  int used = 0;", *_rounds(plan), *("  " + line for line in item), *("  " + line for line in body),
            "    used += tiles;", "  }"]
  return [*ring_barrier_lines(barrier_offset(plan), plan.stages, consumers),
          f"  if (threadIdx.x >= {consumers}) {{",
          "    producer_registers();",
          *("  " + line for line in rounds([
            *copy_tile_lines(plan, f"(threadIdx.x - {consumers})", WARPGROUP_THREADS,
                             "    copies_arrive(full + 8 * stage);"),
            "  for (int tile = 0; tile < tiles; tile++) {",
            f"    int count = used + tile, stage = count % {plan.stages};",
            f"    if (count >= {plan.stages}) barrier_wait(empty + 8 * stage, (count / {plan.stages} - 1) & 1);",
            "    copy_tile(tile, stage);",
            "  }"])),
          "    copy_commit();",
          "    copy_wait_all();",
          "    return;",
          "  }",
          "  consumer_registers();",
          *rounds(consumer)]


def _rounds(plan: AttentionPlan) -> list[str]:
  """The loop over a persistent CTA's items: round r of the grid's CTAs takes the next gridDim.x items of the order
  (the longest first, _block_index_lines), CTA c the c-th of an even round and the c-th from the end of an odd one
  (a snake: the CTA that took a round's longest takes the next round's shortest, which evens out their sums)."""
  return ["  for (int round = 0;; round++) {",
          "    int order = round * gridDim.x + (round & 1 ? gridDim.x - 1 - blockIdx.x : blockIdx.x);",
          f"    if (order >= {plan.items}) break;"]


def _await_tile_lines(plan: AttentionPlan) -> list[str]:
  """A consumer waiting for tile `tile` in its stage (`full`, phase tile / stages), then fencing the async proxy:
  the copies landed through the generic one, the tensor cores read through the async one."""
  count = ring_count(plan)
  return [f"    barrier_wait(full + 8 * ({count} % {plan.stages}), ({count} / {plan.stages}) & 1);",
          "    async_proxy_fence();"]


def consumer_loop_lines(plan: AttentionPlan, mask: list[str], softmax: list[str]) -> list[str]:
  """The consumers' loop over key tiles (plan.producer, without overlap): wait for the tile, S, mask, softmax,
  O += P V, release the stage (`empty`). No barrier of the CTA: each warpgroup runs at its own pace, the ring keeps
  them within `stages` tiles of each other."""
  stage = stage_bytes(plan)
  return ["  for (int tile = 0; tile < tiles; tile++) {",
          *_await_tile_lines(plan),
          f"    unsigned k_stage = shared_base + ({ring_count(plan)} % {plan.stages}) * {stage}, v_stage = k_stage + "
          f"{tile_bytes(plan)};",
          *scores_lines(plan), *mask, *softmax, *weighted_sum_lines(plan),
          f"    barrier_arrive(empty + 8 * ({ring_count(plan)} % {plan.stages}));",
          "  }"]


# the named barrier of consumer warpgroup w's turn on the tensor cores (plan.pingpong) is PINGPONG_BARRIER + w (0 is
# __syncthreads), and OWN_Q_BARRIER + w its meeting once its Q rows are staged (own_q_lines; 16 barriers in all)
PINGPONG_BARRIER, OWN_Q_BARRIER = 1, 8


def _turn_lines(plan: AttentionPlan) -> tuple[list[str], list[str], list[str], list[str]]:
  """plan.pingpong: (before the loop, before a tile's wgmmas are issued, after) of the consumer warpgroups' turns:
  warpgroup w issues once warpgroup w - 1 has issued its own (named barrier PINGPONG_BARRIER + w: its 128 threads
  wait, w - 1's arrive), so one's softmax runs while the next one's products do (FlashAttention-3's ping-pong). The
  last warpgroup opens the first turn before its loop, and the first one takes the turn the last one hands it after
  the last tile once more after its loop (each barrier gets as many arrivals as waits; an arrival under a condition
  between the wgmmas and their wait would make ptxas serialize them). Without pingpong: nothing."""
  if not plan.pingpong: return [], [], [], []
  groups, pair = plan.consumer_threads // WARPGROUP_THREADS, 2 * WARPGROUP_THREADS
  return ([f"  int warpgroup = threadIdx.x / {WARPGROUP_THREADS};",
           f"  if (warpgroup == {groups - 1}) named_arrive({PINGPONG_BARRIER}, {pair});"],
          [f"    named_sync({PINGPONG_BARRIER} + warpgroup, {pair});"],
          [f"    named_arrive({PINGPONG_BARRIER} + (warpgroup + 1) % {groups}, {pair});"],
          [f"  if (warpgroup == 0) named_sync({PINGPONG_BARRIER}, {pair});"])


def overlapped_loop_lines(plan: AttentionPlan, mask: list[str], softmax: list[str], rescale: list[str]) -> list[str]:
  """The loop over key tiles with the previous tile's P V in flight while this tile's S is masked and softmaxed
  (FlashAttention-3's pipelining inside a warpgroup), from its first tile's copies on:

      for tile t: await t's stage (_overlap_await_lines)
                  [pingpong: wait for this warpgroup's turn]
                  issue S_t = Q K_t^T; issue O += P_{t-1} V_{t-1} (t > 0); [pingpong: hand the turn on]
                  wait for S_t (groups finish in order); mask and softmax S_t (the factor of O kept)
                  wait for P V; [producer: release t - 1's stage]; O *= factor; pack P_t
      issue and wait O += P_last V_last

  Without a producer every thread copies and the CTA's barrier orders a stage's reuse: stage (t + 1) % stages was
  last read by P_{t-2} V_{t-2} (stages >= 3), waited for in iteration t - 1, which every thread has finished once
  past iteration t's barrier. With plan.producer the tile's stage is awaited on its `full` barrier and the previous
  tile's released (`empty`) once its P V is done (two stages suffice: a consumer holds tile t - 1's values while it
  waits for tile t); with pingpong the warpgroups take turns issuing (_turn_lines)."""
  stages, stage = plan.stages, stage_bytes(plan)
  opening, turn, turn_over, closing = _turn_lines(plan)
  count, last = ring_count(plan), ring_count(plan, "(tiles - 1)")
  release = [f"    if (tile > 0) barrier_arrive(empty + 8 * (({count} + {stages - 1}) % {stages}));"] * plan.producer
  # (a persistent CTA's next item reuses the ring: its last tile's stage is released too)
  release_last = [f"  barrier_arrive(empty + 8 * ({last} % {stages}));"] * plan.persistent
  return [
    f"  unsigned p[{plan.block_n // 16}][4];",
    "  float row_rescale[1][2];",
    *opening,
    "  for (int tile = 0; tile < tiles; tile++) {",
    *_overlap_await_lines(plan),
    f"    unsigned k_stage = shared_base + ({count} % {stages}) * {stage};",
    f"    unsigned previous_values = shared_base + (({count} + {stages - 1}) % {stages}) * {stage} + "
    f"{tile_bytes(plan)};",
    *turn,
    *_scores_issue_lines(plan),
    "    if (tile > 0) {",
    *_values_issue_lines(plan, "previous_values", "      "),
    *("  " + line for line in turn_over),
    "      wgmma_wait_one();",
    "    } else {",
    *("  " + line for line in turn_over),
    "      wgmma_wait_all();",
    "    }",
    *mask,
    *softmax,
    "    wgmma_wait_all();",
    *release,
    *rescale,
    *_pack_lines(plan, declare=False),
    "  }",
      f"  unsigned last_values = shared_base + ({last} % {stages}) * {stage} + {tile_bytes(plan)};",
    "  wgmma_fence();",
    *_values_issue_lines(plan, "last_values", "  "),
    "  wgmma_wait_all();",
    *release_last,
    *closing]


def _overlap_await_lines(plan: AttentionPlan) -> list[str]:
  """overlapped_loop_lines' wait for tile `tile`: a producer's `full` barrier (_await_tile_lines), or this thread's
  copies, the async proxy's fence and the CTA's barrier, then the next tile's copies issued."""
  if plan.producer: return _await_tile_lines(plan)
  return ["    copy_wait_all();",
          "    async_proxy_fence();",
          "    __syncthreads();",
          f"    if (tile + 1 < tiles) copy_tile(tile + 1, (tile + 1) % {plan.stages});"]
