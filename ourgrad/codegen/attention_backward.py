"""Flash-attention backward on CUDA: the two kernels' CUDA C source for a plan (codegen/attention_backward_plan.py).

The forward (`Ops.ATTENTION`) computes O = softmax(scale Q K^T) V per (batch, head) and the per-row logsumexp
LSE_i = log sum_j exp(scale q_i . k_j) (natural log, float32, (B, H, L); `lse_log2` reads a base-2 one). The backward
recomputes the scores tile by tile instead of reading a T x T matrix (FlashAttention-2, Dao 2023):

    P = exp(scale Q K^T - LSE)           dV = P^T dO          dP = dO V^T
    delta_i = rowsum(dO * O)_i           dS = P (dP - delta)  dQ = scale dS K     dK = scale dS^T Q

Two kernels, launched in this order on one stream (`launches`):

- `attention_backward_dq`: one block per (Q tile of `block_q` rows, batch, head). It first writes delta for its rows
  (rowsum(dO * O), float32, (B, H, L) contiguous) to a scratch buffer, then loops over K/V tiles of `stream_kv`
  keys (only those a causal mask leaves alive), recomputes S, P and dP, and accumulates dQ += dS K in registers: no
  atomics, so the result does not depend on the schedule.
- `attention_backward_dkdv`: one block per (K/V tile of `block_kv` keys, batch, kv head). It loops over the query
  heads sharing that kv head (GQA: query head h reads kv head h // (heads // kv_heads)) and their Q tiles of
  `stream_q` rows (skipping those a causal mask kills), recomputes S^T and P^T, and accumulates dV += P^T dO and
  dK += dS^T Q; it reads the delta the dQ kernel wrote.

Block order: a grid is (batch x heads, tiles), the heads varying fastest, and a causal block's tile index counts down
its work (the dQ kernel numbers its Q tiles from the last, the dK/dV kernel its K/V tiles from the first). A GPU
starts blocks in the order of their linear index, so every head's longest block starts before any shorter one, and
the last blocks to start are the shortest (longest processing time first). Ordered the other way (tiles fastest) the
longest blocks of the last heads start last: a tail that leaves most multiprocessors idle (a list-scheduling model of
causal T = 1024, 48 heads, 396 resident blocks: 1.6x the balanced time; T = 4096: 1.15x).

Inside a block each warp owns 16 rows (queries in the dQ kernel, keys in the dK/dV kernel). Every product is a
warp-level `mma.sync` (m16n8k16 with float32 accumulation for float16/bfloat16, m16n8k8 TF32 for float32) whose
fragments are gathered from shared-memory tiles with the maps of codegen/tensor_cores.py. P and dS never touch shared
memory: a warp's accumulator fragments of S (dP) are the A fragments of the next product (`warp_mma_c`), rounded to the
operand type in registers (FlashAttention-2's register reuse); for TF32 the k index of that product is permuted within
each 8-wide step so the accumulator layout matches, and B is read with the same permutation.
A causal mask is torch's `is_causal` (top-left aligned): key j is kept for query i when j <= i.

runtime/attention_backward_emulator.py computes the same numbers with numpy (operands rounded where the tensor cores
round them, float32 sums), per launch on flat buffers: the PYTHON device's model of the kernels. test/
attention_backward_host.py runs this CUDA source itself on the CPU (a host thread per CUDA thread).
"""
from __future__ import annotations

from ourgrad.codegen import attention_backward_producer, attention_backward_wgmma
from ourgrad.codegen.attention_backward_plan import (DKDV_KERNEL, DQ_COUNT_ROWS, DQ_KERNEL, LOG2E,
                                                    AttentionBackwardPlan, KernelLaunch, Strides)
from ourgrad.codegen.tensor_cores import M16N8K8_TF32_MAPS, M16N8K16_MAPS, FragmentMaps
from ourgrad.codegen.wgmma_tiles import C_TYPE, PTX_TYPE
from ourgrad.renderer.cstyle import DYNAMIC_SHARED_SYMBOL   # the size ops_cuda.CUDAProgram reads at load

# ---------------------------------------------------------------- CUDA source

def _affine(position: tuple[int, int, int], offset: str) -> str:
  """A fragment coordinate (constant, times group, times quad) of tensor_cores as C text, plus `offset`."""
  constant, times_group, times_quad = position
  return f"{offset} + {constant} + {times_group} * g + {times_quad} * quad"


def instruction_helpers(dtype: str) -> str:
  """The element type `elem_t` and the device functions written with PTX: to_float / from_float (stored element <->
  float32, to nearest even), the operand register of one element (TF32: `operand_bits`, cvt.rna) or of two
  (`pack`), and `mma` (one m16n8k16 or m16n8k8 TF32 instruction, float32 accumulators updated in place)."""
  lines = [f"typedef {C_TYPE[dtype]} elem_t;"]
  if dtype == "float32":
    lines += ["__device__ __forceinline__ float to_float(elem_t x) { return x; }",
              "__device__ __forceinline__ elem_t from_float(float x) { return x; }",
              "__device__ __forceinline__ unsigned operand_bits(elem_t x) {",
              '  unsigned r; asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x)); return r; }',
              "// a shared-memory tile's element rounded to TF32 in place once (`round_tile`), its 13 low bits zero,",
              "// so that the fragments read from it are its bits (`tile_bits`) with no cvt a read",
              "__device__ __forceinline__ unsigned tf32_round_bits(unsigned bits) {",
              "  return operand_bits(__uint_as_float(bits)) & 0xFFFFE000u; }",
              "__device__ __forceinline__ unsigned tile_bits(elem_t x) { return __float_as_uint(x); }",
              ]
  else:
    if dtype == "float16":
      lines += ["__device__ __forceinline__ float to_float(elem_t x) {",
                '  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x)); return f; }']
    else:
      lines += ["__device__ __forceinline__ float to_float(elem_t x) { return __uint_as_float((unsigned)x << 16); }"]
    lines += ["__device__ __forceinline__ elem_t from_float(float x) {",
              f'  unsigned r; asm("cvt.rn.{PTX_TYPE[dtype]}x2.f32 %0, %1, %2;" : "=r"(r) : "f"(0.0f), "f"(x));',
              "  return (elem_t)(r & 0xFFFF); }",
              "// two floats rounded by one cvt into one operand register (the first in the low half)",
              "__device__ __forceinline__ unsigned pack_floats(float first, float second) {",
              f'  unsigned r; asm("cvt.rn.{PTX_TYPE[dtype]}x2.f32 %0, %1, %2;" : "=r"(r) : "f"(second), "f"(first));',
              "  return r; }",
              "__device__ __forceinline__ unsigned pack(elem_t low, elem_t high) {",
              "  return (unsigned)low | ((unsigned)high << 16); }"]
    for suffix, modifier in (("", ""), ("_trans", ".trans")):
      lines += [f"__device__ __forceinline__ void ldmatrix_x4{suffix}(unsigned (&r)[4], const elem_t* row) {{",
                f'  asm volatile("ldmatrix.sync.aligned.m8n8.x4{modifier}.shared.b16 {{%0, %1, %2, %3}}, [%4];"',
                '    : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((unsigned)__cvta_generic_to_shared(row)));',
                "}"]
  # cp.async (sm_80+): a copy to shared memory that the thread does not wait for; a source size of 0 writes zeros
  for size, cache in ((16, "cg"), (4, "ca")):
    lines += [f"__device__ __forceinline__ void copy_async_{size}(void* shared, const void* global, bool valid) {{",
              f'  asm volatile("cp.async.{cache}.shared.global [%0], [%1], {size}, %2;"',
              '    :: "r"((unsigned)__cvta_generic_to_shared(shared)), "l"(global), '
              f'"r"(valid ? {size} : 0) : "memory");',
              "}"]
  lines += ["__device__ __forceinline__ void copy_async_commit() {",
            '  asm volatile("cp.async.commit_group;" ::: "memory"); }',
            "template <int PENDING> __device__ __forceinline__ void copy_async_wait() {",
            '  asm volatile("cp.async.wait_group %0;" :: "n"(PENDING) : "memory"); }']
  # 2^x as one MUFU.EX2: exp2f without fast math adds a range check and two multiplies for subnormal results, and a
  # probability under 2^-126 flushed to 0 changes no gradient
  lines += ["__device__ __forceinline__ float fast_exp2(float x) {",
            '  float y; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }']
  instruction = (f"mma.sync.aligned.m16n8k{_k_step(dtype)}.row.col.f32.{PTX_TYPE[dtype]}.{PTX_TYPE[dtype]}.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};")
  lines += ["__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {",
            f'  asm volatile("{instruction}"',
            '    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])',
            '    : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));',
            "}"]
  return "\n".join(lines) + "\n"


def _k_step(dtype: str) -> int:
  """K of one mma instruction: m16n8k8 for TF32, m16n8k16 for 16-bit operands."""
  return 8 if dtype == "float32" else 16


def fragment_maps(dtype: str) -> FragmentMaps:
  """Where each element of the A, B, C fragments lies (codegen/tensor_cores.py) for the instruction of `dtype`."""
  return M16N8K8_TF32_MAPS if dtype == "float32" else M16N8K16_MAPS


def _warp_helpers(dtype: str) -> str:
  """`warp_mma`: a warp's 16 x (8 NT) accumulator tile += A (16 x K) @ B (K x 8 NT) with A(r, c) at
  a[r * A_ROW + c * A_COL] and B(r, c) at b[r * B_ROW + c * B_COL] in shared memory (the strides are template
  constants), gathered into fragments by the maps of codegen/tensor_cores.py. Two 16-bit elements of one register
  that lie next to each other in shared memory are read as one 32-bit word; TF32 elements are read as their bits,
  the tiles having been rounded in place (`round_tile`)."""
  tf32 = dtype == "float32"
  maps, k_step = fragment_maps(dtype), _k_step(dtype)

  def address(matrix: str, position, offsets: tuple[str, str]) -> str:
    row, column = _affine(position[0], offsets[0]), _affine(position[1], offsets[1])
    upper = matrix.upper()
    return f"{matrix}[({row}) * {upper}_ROW + ({column}) * {upper}_COL]"

  def pair(matrix: str, first, second, offsets: tuple[str, str]) -> str:
    """One register of two 16-bit elements (the lower-numbered in the low half)."""
    packed = f"pack({address(matrix, first, offsets)}, {address(matrix, second, offsets)})"
    step = tuple(b[0] - a[0] for a, b in zip(first, second))   # how far apart they are (rows, columns)
    if step not in ((1, 0), (0, 1)): return packed
    contiguous = f"{matrix.upper()}_{'ROW' if step == (1, 0) else 'COL'} == 1"
    return f"({contiguous} ? *(const unsigned*)&{address(matrix, first, offsets)} : {packed})"

  def registers(matrix: str, positions, offsets: tuple[str, str]) -> list[str]:
    if tf32: return [f"tile_bits({address(matrix, position, offsets)})" for position in positions]
    return [pair(matrix, positions[2 * i], positions[2 * i + 1], offsets) for i in range(len(positions) // 2)]

  a_registers = registers("a", maps.a, ("0", "k0"))
  b_registers = registers("b", maps.b, ("k0", "t * 8"))
  b_next = registers("b", maps.b, ("k0", "(t + 1) * 8"))
  # a_fragment: the A registers of the k step at k0; b_mma: acc += that A times the B of the same k step
  lines = ["template <int A_ROW, int A_COL>",
           "__device__ __forceinline__ void a_fragment(unsigned (&ra)[4], const elem_t* a, int k0) {",
           "  const int lane = threadIdx.x & 31, g = lane >> 2, quad = lane & 3;"]
  if tf32:
    lines += [f"  const unsigned fill[4] = {{{', '.join(a_registers)}}};",
              "  for (int i = 0; i < 4; i++) ra[i] = fill[i];",
              "}",
              "template <int NT, int B_ROW, int B_COL>",
              "__device__ __forceinline__ void b_mma(float (&acc)[NT][4], const unsigned (&ra)[4], const elem_t* b,",
              "                                      int k0) {",
              "  const int lane = threadIdx.x & 31, g = lane >> 2, quad = lane & 3;",
              "#pragma unroll",
              "  for (int t = 0; t < NT; t++) {",
              f"    const unsigned rb[2] = {{{', '.join(b_registers)}}};",
              "    mma(acc[t], ra, rb);",
              "  }",
              "}"]
  else:
    # ldmatrix: lane l names row l % 8 of 8x8 matrix l / 8; the four matrices give A's four registers (rows 0-7 and
    # 8-15 at k0, then at k0 + 8), or the two registers of B for two n8 tiles (.trans where B's rows run along K)
    lines += ["  if constexpr (A_COL == 1) ldmatrix_x4(ra, a + (lane & 15) * A_ROW + k0 + (lane >> 4) * 8);",
              f"  else {{ const unsigned fill[4] = {{{', '.join(a_registers)}}}; for (int i = 0; i < 4; i++) "
              "ra[i] = fill[i]; }",
              "}",
              "template <int NT, int B_ROW, int B_COL>",
              "__device__ __forceinline__ void b_mma(float (&acc)[NT][4], const unsigned (&ra)[4], const elem_t* b,",
              "                                      int k0) {",
              "  const int lane = threadIdx.x & 31, g = lane >> 2, quad = lane & 3;",
              "#pragma unroll",
              "  for (int t = 0; t < NT; t += 2) {",
              "    unsigned rb[4];",
              "    if constexpr (B_ROW == 1)",
              "      ldmatrix_x4(rb, b + ((t + (lane >> 4)) * 8 + (lane & 7)) * B_COL + k0 + ((lane >> 3) & 1) * 8);",
              "    else if constexpr (B_COL == 1)",
              "      ldmatrix_x4_trans(rb, b + (k0 + (lane & 15)) * B_ROW + (t + (lane >> 4)) * 8);",
              f"    else {{ const unsigned fill[4] = {{{', '.join(b_registers + b_next)}}};",
              "      for (int i = 0; i < 4; i++) rb[i] = fill[i]; }",
              "    const unsigned first[2] = {rb[0], rb[1]}, second[2] = {rb[2], rb[3]};",
              "    mma(acc[t], ra, first);",
              "    mma(acc[t + 1], ra, second);",
              "  }",
              "}"]
  lines += ["template <int NT, int K, int A_ROW, int A_COL, int B_ROW, int B_COL>",
            "__device__ __forceinline__ void warp_mma(float (&acc)[NT][4], const elem_t* a, const elem_t* b) {",
            "#pragma unroll",
            f"  for (int k0 = 0; k0 < K; k0 += {k_step}) {{",
            "    unsigned ra[4];",
            "    a_fragment<A_ROW, A_COL>(ra, a, k0);",
            "    b_mma<NT, B_ROW, B_COL>(acc, ra, b, k0);",
            "  }",
            "}",
            "// the A fragments of a whole 16 x K row-major operand, held in registers across many products",
            "template <int K, int A_ROW>",
            f"__device__ __forceinline__ void load_fragments(unsigned (&held)[K / {k_step}][4], const elem_t* a) {{",
            "#pragma unroll",
            f"  for (int k0 = 0; k0 < K; k0 += {k_step}) a_fragment<A_ROW, 1>(held[k0 / {k_step}], a, k0);",
            "}",
            "template <int NT, int K, int B_ROW, int B_COL>",
            "__device__ __forceinline__ void warp_mma_held(float (&acc)[NT][4],",
            f"                                              const unsigned (&held)[K / {k_step}][4],",
            "                                              const elem_t* b) {",
            "#pragma unroll",
            f"  for (int k0 = 0; k0 < K; k0 += {k_step}) b_mma<NT, B_ROW, B_COL>(acc, held[k0 / {k_step}], b, k0);",
            "}"]
  return "\n".join(lines) + "\n" + _register_operand_helpers(dtype)


def _register_operand_helpers(dtype: str) -> str:
  """`warp_mma_c`: acc (16 x 8 NT) += A (16 x K) @ B (K x 8 NT), A being K / 8 accumulator tiles of an earlier product
  (C fragments: rows g and g + 8, columns 2 quad and + 1 of each 8-wide tile), rounded to the operand type in
  registers, B in shared memory as in warp_mma. 16-bit: two C tiles are exactly one k16 A fragment. TF32: the m16n8k8
  A fragment holds columns quad and quad + 4, so the product's k index is permuted within each 8-wide step (A's
  column quad is the tile's column 2 quad, quad + 4 is 2 quad + 1) and B's rows are read with the same permutation;
  the sum over k is unchanged (B's elements already rounded in their tile, A's rounded here)."""
  lines = ["template <int NT, int K, int B_ROW, int B_COL>",
           "__device__ __forceinline__ void warp_mma_c(float (&acc)[NT][4], const float (&a)[K / 8][4],",
           "                                           const elem_t* b) {"]
  if dtype == "float32":
    lines += ["  const int lane = threadIdx.x & 31, g = lane >> 2, quad = lane & 3;",
              "#pragma unroll",
              "  for (int u = 0; u < K / 8; u++) {",
              "    const unsigned ra[4] = {operand_bits(a[u][0]), operand_bits(a[u][2]), operand_bits(a[u][1]),",
              "                            operand_bits(a[u][3])};",
              "    const elem_t* rows = b + (u * 8 + 2 * quad) * B_ROW + g * B_COL;   // k rows 2 quad and 2 quad + 1",
              "#pragma unroll",
              "    for (int t = 0; t < NT; t++) {",
              "      const unsigned rb[2] = {tile_bits(rows[t * 8 * B_COL]), tile_bits(rows[B_ROW + t * 8 * B_COL])};",
              "      mma(acc[t], ra, rb);",
              "    }",
              "  }",
              "}"]
  else:
    lines += ["#pragma unroll",
              "  for (int u = 0; u < K / 8; u += 2) {",
              "    const unsigned ra[4] = {pack_floats(a[u][0], a[u][1]), pack_floats(a[u][2], a[u][3]),",
              "                            pack_floats(a[u + 1][0], a[u + 1][1]),",
              "                            pack_floats(a[u + 1][2], a[u + 1][3])};",
              "    b_mma<NT, B_ROW, B_COL>(acc, ra, b, u * 8);",
              "  }",
              "}"]
  return "\n".join(lines) + "\n"


def _load_tile(plan: AttentionBackwardPlan) -> str:
  """`load_tile`: rows [0, valid) of a rows x D tile from global memory (row stride `stride`) into shared memory,
  zeros below, by all threads of the block: 16-byte cp.async copies (waited for with copy_async_wait) where every
  stride allows them, else plain loads and stores. `load_row`: `count` floats (element stride `stride`) the same way,
  zeros from `valid` on. float32: `round_tile`, a tile's elements rounded to TF32 in place by the threads that
  copied them (the kernels round each tile once after it lands instead of each fragment read: 4 warps read it)."""
  width = plan.vector_width
  if width == 1:
    copy = ["    tile[r * PITCH + c] = r < valid ? source[r * stride + c] : (elem_t)0;"]
  else:   # a zero-filled row's copy still names a readable address: row 0's
    copy = ["    copy_async_16(tile + r * PITCH + c, source + (r < valid ? r : 0) * stride + c, r < valid);"]
  lines = ["__device__ __forceinline__ void load_tile(elem_t* tile, const elem_t* source, long long stride,",
           "                                          int valid, int rows) {",
           f"  for (int index = threadIdx.x; index < rows * (D / {width}); index += blockDim.x) {{",
           f"    const int r = index / (D / {width}), c = (index % (D / {width})) * {width};",
           *copy,
           "  }",
           "}",
           "__device__ __forceinline__ void load_row(float* row, const float* source, long long stride, int valid,",
           "                                         int count) {",
           "  for (int r = threadIdx.x; r < count; r += blockDim.x)",
           "    copy_async_4(row + r, source + (r < valid ? r : 0) * stride, r < valid);",
           "}"]
  if plan.dtype == "float32":
    # each thread rounds the elements it copied itself (they have landed for it after its wait; the barrier that
    # follows publishes them), so rounding needs no barrier of its own
    if width == 1: rounding = ["    unsigned* word = (unsigned*)chunk;", "    *word = tf32_round_bits(*word);"]
    else:   # one 16-byte shared-memory load and store a chunk (tile rows are 16-byte aligned)
      rounding = ["    uint4 bits = *(uint4*)chunk;",
                  "    bits = make_uint4(tf32_round_bits(bits.x), tf32_round_bits(bits.y), tf32_round_bits(bits.z),",
                  "                      tf32_round_bits(bits.w));",
                  "    *(uint4*)chunk = bits;"]
    lines += ["__device__ __forceinline__ void round_tile(elem_t* tile, int rows) {",
              f"  for (int index = threadIdx.x; index < rows * (D / {width}); index += blockDim.x) {{",
              f"    elem_t* chunk = tile + index / (D / {width}) * PITCH + (index % (D / {width})) * {width};",
              *rounding,
              "  }",
              "}"]
  return "\n".join(lines) + "\n"


def _header(plan: AttentionBackwardPlan, shared_bytes: int, block_q: int, block_kv: int) -> str:
  """Constants of the plan, the dynamic shared memory size the launcher reads, and the helpers."""
  log2_scale = plan.scale * LOG2E
  constants = {"D": plan.head_dim, "PITCH": plan.row_pitch, "BQ": block_q, "BK": block_kv,
               "H": plan.heads, "KVH": plan.kv_heads, "GROUP": plan.group, "L": plan.q_len, "S": plan.kv_len,
               "CAUSAL": int(plan.causal), "KSTEP": _k_step(plan.dtype)}
  lines = [f"#define {name} {value}" for name, value in constants.items()]
  lines += [f"#define SCALE {plan.scale!r}f", f"#define SCALE_LOG2E {log2_scale!r}f",
            f"#define LSE_TO_LOG2 {1.0 if plan.lse_log2 else LOG2E!r}f",
            f'extern "C" __device__ unsigned int {DYNAMIC_SHARED_SYMBOL} = {shared_bytes};',
            "extern __shared__ __align__(16) unsigned char shared_bytes[];"]
  if plan.stored_o_dtype == plan.dtype: o_helpers = "typedef elem_t o_t;\n#define o_to_float to_float\n"
  else: o_helpers = "typedef float o_t;\n__device__ __forceinline__ float o_to_float(float x) { return x; }\n"
  if plan.grad_float32: o_helpers += "typedef float grad_t;\n#define grad_from_float(x) (x)\n"
  else: o_helpers += "typedef elem_t grad_t;\n#define grad_from_float from_float\n"
  helpers = instruction_helpers(plan.dtype) + o_helpers + _warp_helpers(plan.dtype) + _load_tile(plan)
  return "\n".join(lines) + "\n" + helpers


def _rounded(plan: AttentionBackwardPlan, barrier: str, *tiles: tuple[str, str], indent: int = 2,
             wait: bool = False) -> str:
  """float32: C lines rounding each (tile, rows) to TF32 in place (`round_tile`), after the copies of all but the
  newest group have landed (`wait`), then a barrier where `barrier` names why one is needed here; nothing for 16-bit
  operands."""
  if plan.dtype != "float32": return ""
  pad = " " * indent
  lines = ([f"{pad}copy_async_wait<1>();   // K and V (the older group) have landed for this thread"] if wait else [])
  lines += [f"{pad}round_tile({tile}, {rows});" for tile, rows in tiles]
  if barrier: lines.append(f"{pad}__syncthreads();  // every tile rounded before it is read, {barrier}")
  return "\n" + "\n".join(lines)


def _offset(strides: Strides, batch: str, head: str) -> str:
  return f"(long long){batch} * {strides[0]}LL + (long long){head} * {strides[1]}LL"


def _held_loads(holds: bool, *tiles: tuple[str, str]) -> str:
  """With `holds` (the plan's dq_held or dkdv_held): declare and load each (registers, tile) pair's A fragments (the
  warp's 16 rows)."""
  if not holds: return ""
  return "".join(f"\n  unsigned {held}[D / KSTEP][4];\n  load_fragments<D, PITCH>({held}, {tile} + warp * 16 * PITCH);"
                 for held, tile in tiles)


def _owned_product(holds: bool, columns: str, acc: str, held: str, tile: str, other: str) -> str:
  """acc += (the warp's 16 rows of `tile`) @ `other`^T, from the held fragments (`holds`) or from shared memory."""
  if holds: return f"warp_mma_held<{columns} / 8, D, 1, PITCH>({acc}, {held}, {other});"
  return f"warp_mma<{columns} / 8, D, PITCH, 1, 1, PITCH>({acc}, {tile} + warp * 16 * PITCH, {other});"


def _delta_lines(plan: AttentionBackwardPlan) -> str:
  """The dQ kernel's delta = rowsum(dO * O) of its rows into `delta_tile` and the delta buffer (for the dK/dV kernel).
  With 16-byte aligned O rows (`o_vector_width`), LANES threads (a power of two, at most a warp) share a row, each
  reading 16-byte chunks of O (every pass's loads independent, so in flight together) against dO in shared memory,
  then summing over the LANES by shuffles; otherwise a warp a row, one element a lane."""
  width, stride = plan.o_vector_width, plan.o_strides[2]
  if width == 1:
    return f"""  // delta = rowsum(dO * O) of the block's rows: one warp a row, written for the dK/dV kernel too
  for (int r = warp; r < BQ; r += BQ / 16) {{
    float sum = 0.0f;
    if (r < q_rows) {{
      const o_t* o_row = o + o_row0 + (long long)r * {stride}LL;
      for (int c = lane; c < D; c += 32) sum += to_float(do_tile[r * PITCH + c]) * o_to_float(o_row[c]);
    }}
    for (int width = 16; width > 0; width >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, width);
    if (lane == 0) {{
      delta_tile[r] = sum;
      if (r < q_rows) delta[delta_row0 + r] = sum;
    }}
  }}
"""
  chunks = plan.head_dim // width
  lanes = min(32, 1 << (chunks.bit_length() - 1))   # the largest power of two <= the chunks of a row
  return f"""  // delta = rowsum(dO * O) of the block's rows, written for the dK/dV kernel too: {lanes} threads a row,
  // each reading 16-byte chunks of O ({width} elements)
  {{
    constexpr int CHUNKS = {chunks}, LANES = {lanes}, ROWS = 2 * BQ / LANES;   // a pass's rows: the block's threads
    const int part = threadIdx.x % LANES;
#pragma unroll
    for (int r0 = 0; r0 < BQ; r0 += ROWS) {{
      const int r = r0 + threadIdx.x / LANES;
      float sum = 0.0f;
      if (r < q_rows) {{
        const o_t* o_row = o + o_row0 + (long long)r * {stride}LL;
#pragma unroll
        for (int chunk = part; chunk < CHUNKS; chunk += LANES) {{
          union {{ uint4 vector; o_t values[{width}]; }} loaded;
          loaded.vector = *(const uint4*)(o_row + chunk * {width});
#pragma unroll
          for (int e = 0; e < {width}; e++)
            sum += to_float(do_tile[r * PITCH + chunk * {width} + e]) * o_to_float(loaded.values[e]);
        }}
      }}
#pragma unroll
      for (int width = LANES / 2; width > 0; width >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, width);
      if (part == 0) {{
        delta_tile[r] = sum;
        if (r < q_rows) delta[delta_row0 + r] = sum;
      }}
    }}
  }}
"""


# the elementwise step between the products, per accumulator element (`{prob}`: its probability, masked or not):
# dQ kernel: P and then dS in place of dP; dK/dV kernel: P^T in place of S^T, dS^T in place of dP^T
_DQ_ELEMENT = """const float prob = {prob}fmaf(s[t][c], SCALE_LOG2E, -row_lse[c >> 1]){close};
          dp[t][c] = prob * (dp[t][c] - row_delta[c >> 1]);"""
_DKDV_PROBABILITY = "st[t][c] = {prob}fmaf(st[t][c], SCALE_LOG2E, -lse_tile[column] * LSE_TO_LOG2){close};"
_DKDV_GRADIENT = "dpt[t][c] = st[t][c] * (dpt[t][c] - delta_tile[column]);"
_DKDV_ELEMENT = _DKDV_PROBABILITY + "\n          " + _DKDV_GRADIENT
# the wgmma kernels' step in two (codegen/attention_backward_wgmma.py): the probabilities (masked), then dS
_DQ_PROBABILITY = "s[t][c] = {prob}fmaf(s[t][c], SCALE_LOG2E, -row_lse[c >> 1]){close};"
_DQ_GRADIENT = "dp[t][c] = s[t][c] * (dp[t][c] - row_delta[c >> 1]);"


def _masked_elements(columns: str, comment: str, element: str, query: str, key: str) -> str:
  """The elementwise step over a warp's 16 x `columns` accumulator tiles, rendered twice: where the tile is `masked`
  each element's query `query` and key `key` (C expressions of its `row` and `column`) are tested (past L or S, or
  causal and the key after the query: probability 0); elsewhere (interior tiles, most of a long sequence's) not."""
  return f"    if (masked) {{\n{_element_loop(columns, comment, element, query, key, True)}\n    }} else {{\n" \
      f"{_element_loop(columns, comment, element, query, key, False)}\n    }}"


def _element_loop(columns: str, comment: str, element: str, query: str, key: str, masked: bool) -> str:
  """`element` (its `{prob}`, `{close}` filled in) for every element of the warp's tiles, its mask tested or not."""
  if masked:
    indices = ("const int row = warp * 16 + g + (c >> 1) * 8, column = t * 8 + 2 * quad + (c & 1);\n"
               f"          const int i = {query}, j = {key};\n"
               "          const bool keep = i < L && j < S && (!CAUSAL || j <= i);\n          ")
  else: indices = "const int column = t * 8 + 2 * quad + (c & 1);\n          " if "column" in element else ""
  step = element.format(prob="keep ? fast_exp2(" if masked else "fast_exp2(", close=") : 0.0f" if masked else ")")
  return f"""#pragma unroll
      for (int t = 0; t < {columns} / 8; t++) {{
#pragma unroll
        for (int c = 0; c < 4; c++) {{   // {comment}
          {indices}{step}
        }}
      }}"""


def _entry(launch_bounds: str, name: str, device_function: bool) -> str:
  """A kernel's declaration up to its parameters: an extern "C" __global__ kernel, or (`device_function`) an inlined
  __device__ function `name`_body that a wrapper kernel of another signature calls (codegen/attention_grad.py)."""
  if device_function: return f"__device__ __forceinline__ void {name}_body"
  return f'extern "C" __global__ void {launch_bounds} {name}'


def _dq_prologue(p: AttentionBackwardPlan, loads: tuple[str, ...] = ("q", "do", "lse")) -> str:
  """The dQ kernel's block: its Q rows and K/V tiles, operand offsets, and the copies of its rows of `loads` (Q, dO,
  LSE)."""
  copies = {"q": f"  load_tile(q_tile, q + q_row0, {p.q_strides[2]}LL, q_rows, BQ);",
            "do": f"  load_tile(do_tile, dout + do_row0, {p.do_strides[2]}LL, q_rows, BQ);",
            "lse": f"  load_row(lse_tile, lse + lse_row0, {p.lse_strides[2]}LL, q_rows, BQ);"}
  return f"""  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, quad = lane & 3;
  const int q_start = (CAUSAL ? gridDim.y - 1 - blockIdx.y : blockIdx.y) * BQ;   // the longest first
  const int batch = blockIdx.x / H, head = blockIdx.x % H, kv_head = head / GROUP;
  const int q_rows = min(BQ, L - q_start);
  const long long q_row0 = {_offset(p.q_strides, "batch", "head")} + (long long)q_start * {p.q_strides[2]}LL;
  const long long do_row0 = {_offset(p.do_strides, "batch", "head")} + (long long)q_start * {p.do_strides[2]}LL;
  const long long o_row0 = {_offset(p.o_strides, "batch", "head")} + (long long)q_start * {p.o_strides[2]}LL;
  const long long k_base = {_offset(p.k_strides, "batch", "kv_head")};
  const long long v_base = {_offset(p.v_strides, "batch", "kv_head")};
  const long long lse_row0 = {p.lse_offset}LL + {_offset(p.lse_strides, "batch", "head")}
                             + (long long)q_start * {p.lse_strides[2]}LL;
  const long long delta_row0 = ((long long)batch * H + head) * L + q_start;
  // a causal block's last live key is its last query
  const int kv_end = CAUSAL ? min(S, q_start + BQ) : S;
  const int kv_tiles = (kv_end + BK - 1) / BK;
""" + "\n".join(copies[name] for name in loads)


def _dq_store(p: AttentionBackwardPlan) -> str:
  """dQ = SCALE dq_acc stored from the accumulators (C fragment rows g, g + 8 of the warp's 16)."""
  first = f"{_offset(p.dq_strides, 'batch', 'head')} + (long long)q_start * {p.dq_strides[2]}LL"
  return f"""  const long long dq_row0 = {first};
#pragma unroll
  for (int t = 0; t < D / 8; t++) {{
#pragma unroll
    for (int c = 0; c < 4; c++) {{
      const int row = warp * 16 + g + (c >> 1) * 8, column = t * 8 + 2 * quad + (c & 1);
      if (row < q_rows)
        dq[dq_row0 + (long long)row * {p.dq_strides[2]}LL + column] = grad_from_float(SCALE * dq_acc[t][c]);
    }}
  }}"""


def _dkdv_prologue(p: AttentionBackwardPlan, padded_tiles: bool = True) -> str:
  """The dK/dV kernel's block: its keys, live Q tiles and iterations, and the copies of its K and V rows (into the
  padded k_tile and v_tile, with `padded_tiles`)."""
  return f"""  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, quad = lane & 3;
  const int k_start = blockIdx.y * BK, batch = blockIdx.x / KVH, kv_head = blockIdx.x % KVH;   // the longest first
  const int k_rows = min(BK, S - k_start);
  const long long k_row0 = {_offset(p.k_strides, "batch", "kv_head")} + (long long)k_start * {p.k_strides[2]}LL;
  const long long v_row0 = {_offset(p.v_strides, "batch", "kv_head")} + (long long)k_start * {p.v_strides[2]}LL;
  // a causal Q tile whose last query precedes this block's first key is dead
  const int q_first = CAUSAL ? (k_start / BQ) * BQ : 0;
  const int q_tiles = q_first < L ? (L - q_first + BQ - 1) / BQ : 0;
  const int iterations = GROUP * q_tiles;""" + (f"""
  load_tile(k_tile, k + k_row0, {p.k_strides[2]}LL, k_rows, BK);
  load_tile(v_tile, v + v_row0, {p.v_strides[2]}LL, k_rows, BK);""" if padded_tiles else "")


def _dkdv_store(p: AttentionBackwardPlan) -> str:
  """dK = SCALE dk_acc and dV = dv_acc stored from the accumulators: each thread's two neighbouring columns (C
  fragment elements c, c + 1) by one store where dk's and dv's strides are even (their buffers aligned, as
  plan.vector_width assumes of the operands), else an element a store."""
  first = f"{_offset(p.dk_strides, 'batch', 'kv_head')} + (long long)k_start * {p.dk_strides[2]}LL"
  pairs = all(stride % 2 == 0 for stride in (*p.dk_strides, *p.dv_strides))
  dk_at, dv_at = (f"{name}[{name}_row0 + (long long)row * {strides[2]}LL + column]"
                  for name, strides in (("dk", p.dk_strides), ("dv", p.dv_strides)))
  if pairs:
    stores = (f"        {_pair_store(p, dk_at, 'SCALE * dk_acc[t][c]', 'SCALE * dk_acc[t][c + 1]')}\n"
              f"        {_pair_store(p, dv_at, 'dv_acc[t][c]', 'dv_acc[t][c + 1]')}")
  else:
    stores = (f"        {dk_at} = grad_from_float(SCALE * dk_acc[t][c]);\n"
              f"        {dv_at} = grad_from_float(dv_acc[t][c]);")
  return f"""  const long long dk_row0 = {first};
  const long long dv_row0 = {_offset(p.dv_strides, "batch", "kv_head")} + (long long)k_start * {p.dv_strides[2]}LL;
#pragma unroll
  for (int t = 0; t < D / 8; t++) {{
#pragma unroll
    for (int c = 0; c < 4; c += {2 if pairs else 1}) {{
      const int row = warp * 16 + g + (c >> 1) * 8, column = t * 8 + 2 * quad + (c & 1);
      if (row < k_rows) {{
{stores}
      }}
    }}
  }}"""


def _pair_store(p: AttentionBackwardPlan, target: str, first: str, second: str) -> str:
  """C storing two neighbouring gradient elements (floats `first`, `second`) at `target` as one 4-byte (16-bit pair)
  or 8-byte (float32) store."""
  if p.grad_dtype == "float32": return f"*(float2*)&{target} = make_float2({first}, {second});"
  return f"*(unsigned*)&{target} = pack_floats({first}, {second});"


def _dq_elementwise() -> str:
  return _masked_elements("BK", "dS, in place of dP", _DQ_ELEMENT, "q_start + row", "k_start + column")


def _dkdv_elementwise() -> str:
  return _masked_elements("BQ", "P^T in place of S^T, dS^T in place of dP^T", _DKDV_ELEMENT, "q_start + column",
                          "k_start + row")


def _wgmma_elementwise(kernel: str) -> tuple[str, str]:
  """The wgmma kernels' elementwise step in two: the probabilities (masked where the tile is) and dS (unmasked: P is
  0 where masked)."""
  if kernel == DQ_KERNEL:
    return (_masked_elements("BK", "P, in place of S", _DQ_PROBABILITY, "q_start + row", "k_start + column"),
            _element_loop("BK", "dS, in place of dP", _DQ_GRADIENT, "", "", False))
  return (_masked_elements("BQ", "P^T, in place of S^T", _DKDV_PROBABILITY, "q_start + column", "k_start + row"),
          _element_loop("BQ", "dS^T, in place of dP^T", _DKDV_GRADIENT, "", "", False))


def _delta_kernel(plan: AttentionBackwardPlan, entry: str) -> str:
  """The single pass's first kernel (plan.dq_accumulate) in the dQ kernel's place: delta of its rows, and its rows of
  dq_accum zeroed for the dK/dV kernel's additions (its dq parameter unused)."""
  p = plan
  return _header(p, p.dq_shared_bytes, p.block_q, p.dq_stream) + f"""
{entry}(const elem_t* __restrict__ q,
    const elem_t* __restrict__ k, const elem_t* __restrict__ v, const o_t* __restrict__ o,
    const elem_t* __restrict__ dout, const float* __restrict__ lse, grad_t* __restrict__ dq,
    float* __restrict__ delta, float* __restrict__ dq_accum, unsigned* __restrict__ dq_counts) {{
  elem_t* do_tile = (elem_t*)shared_bytes;              // BQ x PITCH
  float* delta_tile = (float*)(do_tile + BQ * PITCH);   // BQ
{_dq_prologue(p, ("do",))}
  copy_async_commit();
  copy_async_wait<0>();
  __syncthreads();
{_delta_lines(p)}  // the block's rows of dq_accum (B, H, L, D) contiguous, zeroed 16 bytes a store, and the counts of
  // the dK/dV kernel's Q tiles ({p.dkdv_stream} rows) that start in them
  float4* accumulated = (float4*)(dq_accum + delta_row0 * D);
  for (int i = threadIdx.x; i < q_rows * (D / 4); i += blockDim.x) accumulated[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  constexpr int TILE = {p.dkdv_stream}, COUNTED_TILES = {-(-p.q_len // DQ_COUNT_ROWS)};
  for (int tile = (q_start + TILE - 1) / TILE + threadIdx.x; tile * TILE < q_start + q_rows; tile += blockDim.x)
    dq_counts[((long long)batch * H + head) * COUNTED_TILES + tile] = 0u;
}}
"""


def render_dq_kernel(plan: AttentionBackwardPlan, device_function: bool = False) -> str:
  """CUDA source of the dQ kernel (also writes delta): grid `dq_grid`, block `dq_block`, `dq_shared_bytes`; with the
  plan's dq_accumulate (the single pass) the delta kernel in its place (`_delta_kernel`).

  The K/V tiles are double-buffered: the copies of tile n + 1 are in flight while tile n is multiplied. A causal
  block's work grows with its Q tile, so blockIdx.y numbers the Q tiles from the last down (the longest start first)."""
  p = plan
  entry = _entry(p.launch_bounds(p.dq_block[0], p.dq_shared_bytes, p.dq_registers), DQ_KERNEL, device_function)
  if p.dq_accumulate: return _delta_kernel(p, entry)
  if p.mma == "wgmma":
    held = _held_loads(p.dq_held, ("q_held", "q_tile"), ("do_held", "do_tile"))
    return _header(p, p.dq_shared_bytes, p.block_q, p.dq_stream) + attention_backward_wgmma.wgmma_helpers(
      p, DQ_KERNEL) + attention_backward_wgmma.dq_body(p, entry, _dq_prologue(p), _delta_lines(p), held,
                                                         *_wgmma_elementwise(DQ_KERNEL), _dq_store(p))
  held_loads = _held_loads(p.dq_held, ("q_held", "q_tile"), ("do_held", "do_tile"))
  round_owned = _rounded(p, "after delta, which reads dO unrounded", ("q_tile", "BQ"), ("do_tile", "BQ"))
  round_streamed = _rounded(p, "", ("k_tiles + (tile & 1) * BK * PITCH", "BK"),
                            ("v_tiles + (tile & 1) * BK * PITCH", "BK"), indent=4)
  body = f"""
{entry}(const elem_t* __restrict__ q,
    const elem_t* __restrict__ k, const elem_t* __restrict__ v, const o_t* __restrict__ o,
    const elem_t* __restrict__ dout, const float* __restrict__ lse, grad_t* __restrict__ dq,
    float* __restrict__ delta) {{
  elem_t* q_tile = (elem_t*)shared_bytes;               // BQ x PITCH
  elem_t* do_tile = q_tile + BQ * PITCH;                // BQ x PITCH
  elem_t* k_tiles = do_tile + BQ * PITCH;               // 2 x BK x PITCH
  elem_t* v_tiles = k_tiles + 2 * BK * PITCH;           // 2 x BK x PITCH
  float* lse_tile = (float*)(v_tiles + 2 * BK * PITCH);  // BQ
  float* delta_tile = lse_tile + BQ;                    // BQ
{_dq_prologue(p)}
  load_tile(k_tiles, k + k_base, {p.k_strides[2]}LL, min(BK, S), BK);
  load_tile(v_tiles, v + v_base, {p.v_strides[2]}LL, min(BK, S), BK);
  copy_async_commit();
  copy_async_wait<0>();
  __syncthreads();
{_delta_lines(p)}  __syncthreads();{round_owned}
  // this lane's two accumulator rows (C fragment rows g and g + 8 of the warp's 16)
  const float row_lse[2] = {{lse_tile[warp * 16 + g] * LSE_TO_LOG2, lse_tile[warp * 16 + g + 8] * LSE_TO_LOG2}};
  const float row_delta[2] = {{delta_tile[warp * 16 + g], delta_tile[warp * 16 + g + 8]}};
  float dq_acc[D / 8][4];
#pragma unroll
  for (int t = 0; t < D / 8; t++) for (int c = 0; c < 4; c++) dq_acc[t][c] = 0.0f;{held_loads}
  for (int tile = 0; tile < kv_tiles; tile++) {{
    const int k_start = tile * BK;
    if (tile + 1 < kv_tiles) {{  // the next K/V tiles into the other buffer, while this one is used
      const int next = k_start + BK, buffer = (tile + 1) & 1;
      load_tile(k_tiles + buffer * BK * PITCH, k + k_base + (long long)next * {p.k_strides[2]}LL, {p.k_strides[2]}LL,
                min(BK, S - next), BK);
      load_tile(v_tiles + buffer * BK * PITCH, v + v_base + (long long)next * {p.v_strides[2]}LL, {p.v_strides[2]}LL,
                min(BK, S - next), BK);
      copy_async_commit();
      copy_async_wait<1>();
    }} else {{
      copy_async_wait<0>();
    }}{round_streamed}
    __syncthreads();  // this tile's copies, by every thread, have landed
    const elem_t* k_tile = k_tiles + (tile & 1) * BK * PITCH;
    const elem_t* v_tile = v_tiles + (tile & 1) * BK * PITCH;
    float s[BK / 8][4], dp[BK / 8][4];
#pragma unroll
    for (int t = 0; t < BK / 8; t++) for (int c = 0; c < 4; c++) {{ s[t][c] = 0.0f; dp[t][c] = 0.0f; }}
    {_owned_product(p.dq_held, "BK", "s", "q_held", "q_tile", "k_tile")}     // Q K^T
    {_owned_product(p.dq_held, "BK", "dp", "do_held", "do_tile", "v_tile")}   // dO V^T
    // mask only the tiles that need it: keys past S, rows past L, or (causal) keys past the tile's first query
    const bool masked = k_start + BK > S || q_start + BQ > L || (CAUSAL && k_start + BK - 1 > q_start);
{_dq_elementwise()}
    warp_mma_c<D / 8, BK, PITCH, 1>(dq_acc, dp, k_tile);   // dS K, dS from registers
    __syncthreads();  // every warp is done with this buffer before the next iteration refills it
  }}
{_dq_store(p)}
}}
"""
  return _header(plan, plan.dq_shared_bytes, plan.block_q, plan.dq_stream) + body


def render_dkdv_kernel(plan: AttentionBackwardPlan, device_function: bool = False) -> str:
  """CUDA source of the dK/dV kernel (reads delta): grid `dkdv_grid`, block `dkdv_block`, `dkdv_shared_bytes`.

  The block's iterations run over (query head of its group, Q tile) pairs; their Q, dO, LSE and delta tiles are
  double-buffered: the copies of iteration n + 1 are in flight while iteration n is multiplied."""
  p = plan
  entry = _entry(p.launch_bounds(p.dkdv_block[0], p.dkdv_shared_bytes, p.dkdv_registers, p.warp_specialized),
                 DKDV_KERNEL, device_function)
  if p.warp_specialized:   # with a producer warpgroup (the single pass's or the two kernels' dK/dV kernel)
    return _header(p, p.dkdv_shared_bytes, p.dkdv_stream, p.block_kv) + attention_backward_wgmma.wgmma_helpers(
      p, DKDV_KERNEL) + attention_backward_producer.producer_helpers(p) + attention_backward_producer.dkdv_body(
        p, entry, _dkdv_prologue(p, False), *_wgmma_elementwise(DKDV_KERNEL), _dkdv_store(p))
  if p.mma == "wgmma":
    held = _held_loads(p.dkdv_held, ("k_held", "k_tile"), ("v_held", "v_tile"))
    return _header(p, p.dkdv_shared_bytes, p.dkdv_stream, p.block_kv) + attention_backward_wgmma.wgmma_helpers(
      p, DKDV_KERNEL) + attention_backward_wgmma.dkdv_body(p, entry, _dkdv_prologue(p, p.dkdv_held), held,
                                                             *_wgmma_elementwise(DKDV_KERNEL), _dkdv_store(p))
  # K and V have landed (their copy group is the older one) before their fragments are held
  held_loads = ("\n  copy_async_wait<1>();\n  __syncthreads();" if p.dkdv_held else "") + _held_loads(
    p.dkdv_held, ("k_held", "k_tile"), ("v_held", "v_tile"))
  round_owned = _rounded(p, "", ("k_tile", "BK"), ("v_tile", "BK"), wait=True)
  round_streamed = _rounded(p, "", ("q_buffers + (iteration & 1) * BQ * PITCH", "BQ"),
                            ("do_buffers + (iteration & 1) * BQ * PITCH", "BQ"), indent=4)
  body = f"""
__device__ __forceinline__ void load_q_tiles(int iteration, int q_tiles, int q_first, int batch, int kv_head,
    const elem_t* q, const elem_t* dout, const float* lse, const float* delta, elem_t* q_tile, elem_t* do_tile,
    float* lse_tile, float* delta_tile) {{
  // (without GQA the iterations are the Q tiles: no integer division)
  const int head = kv_head * GROUP + (GROUP == 1 ? 0 : iteration / q_tiles);
  const int q_start = q_first + (GROUP == 1 ? iteration : iteration % q_tiles) * BQ;
  const int q_rows = min(BQ, L - q_start);
  const long long q_row0 = {_offset(p.q_strides, "batch", "head")} + (long long)q_start * {p.q_strides[2]}LL;
  const long long do_row0 = {_offset(p.do_strides, "batch", "head")} + (long long)q_start * {p.do_strides[2]}LL;
  const long long lse_row0 = {p.lse_offset}LL + {_offset(p.lse_strides, "batch", "head")}
                             + (long long)q_start * {p.lse_strides[2]}LL;
  load_tile(q_tile, q + q_row0, {p.q_strides[2]}LL, q_rows, BQ);
  load_tile(do_tile, dout + do_row0, {p.do_strides[2]}LL, q_rows, BQ);
  load_row(lse_tile, lse + lse_row0, {p.lse_strides[2]}LL, q_rows, BQ);
  load_row(delta_tile, delta + ((long long)batch * H + head) * L + q_start, 1, q_rows, BQ);
}}

{entry}(
    const elem_t* __restrict__ q,
    const elem_t* __restrict__ k, const elem_t* __restrict__ v, const elem_t* __restrict__ dout,
    const float* __restrict__ lse, const float* __restrict__ delta, grad_t* __restrict__ dk,
    grad_t* __restrict__ dv) {{
  elem_t* k_tile = (elem_t*)shared_bytes;               // BK x PITCH
  elem_t* v_tile = k_tile + BK * PITCH;                 // BK x PITCH
  elem_t* q_buffers = v_tile + BK * PITCH;              // 2 x BQ x PITCH
  elem_t* do_buffers = q_buffers + 2 * BQ * PITCH;     // 2 x BQ x PITCH
  float* lse_buffers = (float*)(do_buffers + 2 * BQ * PITCH);  // 2 x BQ
  float* delta_buffers = lse_buffers + 2 * BQ;         // 2 x BQ
{_dkdv_prologue(p)}
  copy_async_commit();   // K and V: a group of their own, waited for first
  if (iterations > 0)
    load_q_tiles(0, q_tiles, q_first, batch, kv_head, q, dout, lse, delta, q_buffers, do_buffers, lse_buffers,
                 delta_buffers);
  copy_async_commit();{round_owned}
  float dk_acc[D / 8][4], dv_acc[D / 8][4];
#pragma unroll
  for (int t = 0; t < D / 8; t++) for (int c = 0; c < 4; c++) {{ dk_acc[t][c] = 0.0f; dv_acc[t][c] = 0.0f; }}
{held_loads}
  for (int iteration = 0; iteration < iterations; iteration++) {{
    if (iteration + 1 < iterations) {{  // the next Q tiles into the other buffer, while this one is used
      const int buffer = (iteration + 1) & 1;
      load_q_tiles(iteration + 1, q_tiles, q_first, batch, kv_head, q, dout, lse, delta,
                   q_buffers + buffer * BQ * PITCH, do_buffers + buffer * BQ * PITCH, lse_buffers + buffer * BQ,
                   delta_buffers + buffer * BQ);
      copy_async_commit();
      copy_async_wait<1>();
    }} else {{
      copy_async_wait<0>();
    }}{round_streamed}
    __syncthreads();  // this iteration's copies, by every thread, have landed
    const int q_start = q_first + (GROUP == 1 ? iteration : iteration % q_tiles) * BQ, buffer = iteration & 1;
    const elem_t* q_tile = q_buffers + buffer * BQ * PITCH;
    const elem_t* do_tile = do_buffers + buffer * BQ * PITCH;
    const float* lse_tile = lse_buffers + buffer * BQ;
    const float* delta_tile = delta_buffers + buffer * BQ;
    float st[BQ / 8][4], dpt[BQ / 8][4];
#pragma unroll
    for (int t = 0; t < BQ / 8; t++) for (int c = 0; c < 4; c++) {{ st[t][c] = 0.0f; dpt[t][c] = 0.0f; }}
    {_owned_product(p.dkdv_held, "BQ", "st", "k_held", "k_tile", "q_tile")}    // K Q^T = S^T
    {_owned_product(p.dkdv_held, "BQ", "dpt", "v_held", "v_tile", "do_tile")}  // V dO^T = dP^T
    // mask only the tiles that need it: keys past S, queries past L, or (causal) keys past the tile's first query
    const bool masked = k_start + BK > S || q_start + BQ > L || (CAUSAL && k_start + BK - 1 > q_start);
{_dkdv_elementwise()}
    warp_mma_c<D / 8, BQ, PITCH, 1>(dv_acc, st, do_tile);    // P^T dO, P^T from registers
    warp_mma_c<D / 8, BQ, PITCH, 1>(dk_acc, dpt, q_tile);    // dS^T Q, dS^T from registers
    __syncthreads();  // every warp is done with this buffer before the next iteration refills it
  }}
  copy_async_wait<0>();  // a block without live Q tiles still has its K/V copies in flight
{_dkdv_store(p)}
}}
"""
  return _header(plan, plan.dkdv_shared_bytes, plan.dkdv_stream, plan.block_kv) + body


def launches(plan: AttentionBackwardPlan) -> list[KernelLaunch]:
  """The two kernels in launch order, with their arguments (names of the buffers) and sizes (the single pass,
  plan.dq_accumulate: both also take dq_accum, float32 (B, H, L, D) contiguous, and dq_counts, uint32
  (plan.count_elements), which the first zeroes and the second adds into; the second writes dq)."""
  accumulated = ("dq_accum", "dq_counts") if plan.dq_accumulate else ()
  return [KernelLaunch(DQ_KERNEL, render_dq_kernel(plan), ("q", "k", "v", "o", "do", "lse", "dq", "delta") +
                       accumulated, plan.dq_grid, plan.dq_block, plan.dq_shared_bytes),
          KernelLaunch(DKDV_KERNEL, render_dkdv_kernel(plan), ("q", "k", "v", "do", "lse", "delta", "dk", "dv") +
                       accumulated + (("dq",) if plan.dq_accumulate else ()),
                       plan.dkdv_grid, plan.dkdv_block, plan.dkdv_shared_bytes)]
