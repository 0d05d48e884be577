"""The C helpers of UOps.BYTE_DOT_ADD (codegen/integer_rows.py byte_dots): byte dot products of a CPU row
kernel's integer terms as SIMD byte multiply-adds, added into float lanes (ClangRenderer.render_byte_dot_add); and
little-endian 2-byte loads (CLANG_LOAD_U16)."""
from __future__ import annotations

from ourgrad.codegen.uops import UOp, UOps
from ourgrad.dtype import dtypes
from ourgrad.ops import Ops

# The integer sum of ((u >> shift) & mask) * s over `count` bytes (a multiple of 16, each masked u <= 127) for
# UOps.BYTE_DOT_ADD: with SSSE3 (every x86-64-v2 and later) 16 lanes at once as `pmaddubsw` (unsigned x signed
# bytes, adjacent pairs summed in 16 bits: 2 * 127 * 128 cannot saturate) and `pmaddwd` by ones (pairs of those in 32
# bits), 4 int32 partial sums added over the pairs, converted, times the block's factor and added into 4 float lanes
# a row totals once (no horizontal sum a block); elsewhere a plain loop and one float. gcc's own vectorizer widens
# every byte to 16 bits and multiplies with `pmullw` (Q4_1 3072x576 at -march=native: 190 us against ~65). Signed x
# signed bytes (Q8_0) widen to 16 bits (`pmovsxbw`, SSE4.1) for `pmaddwd`: exact for every int8, -128 included
# (`pmaddubsw` with the sign trick would be faster but wrong for -128 x -128).
# With AVX2 the same in 256-bit registers: `og_dot_add2` takes two pairs at once (a Q4 block's low nibbles times the
# first 16 activations in one half, its high nibbles times the next 16 in the other: one `vpmaddubsw` + `vpmaddwd`
# a block, as llama.cpp), a single pair 32 lanes a step, signed bytes 16 a step (`vpmovsxbw`), into 8 float lanes.
# Every branch computes the same integer sums: only the float lanes' count (so the order of the row's float
# additions) follows the target.
# Two pairs over the same bytes under one effective mask (`mask & (255 >> shift)`) against a run of activations
# and the run right after it (a Q4 block: low nibbles x s[0:16], high nibbles x s[16:32]) take `og_dot_add_split`:
# the bytes loaded once, shifted into the two halves and masked by one AND, the activations one 32-byte load, where
# og_dot_add2 loads and masks each half apart (SmolLM2's Q4_1 product loop: 26 instructions a block instead of 31;
# 1024x576 in L2, one thread: 2.12 -> 1.89 ns a block; the decode step, one thread, A/B in one process: og_dot_add2
# 1.042x the time). Its int32 lanes hold the same sums as og_dot_add2's: the same logits bits.
# Every helper prefetches its first operand PREFETCH_AHEAD bytes ahead: that operand is the packed weight's bytes
# (integer_linear's products), which a matrix-vector product streams once, row after row, from memory (a decode
# step's weights, ~96 MB for SmolLM2's Q4_1 file, do not stay in a 32 MB L3); the hardware prefetcher alone left the
# products waiting on memory (a 20-byte Q4_1 block a call, each row's scales in a second stream). SmolLM2's CPU decode
# step, one thread, A/B in one process (extra/bench/cpu_decode_ab.py) on the shared 2-core EPYC: no prefetch 1.163x
# the time with 1536 bytes; 768 bytes 1.069x; 3072 0.993x. A line already cached costs one instruction.
PREFETCH_AHEAD = 1536
CLANG_BYTE_DOT = (
  "static inline void og_prefetch(const void* bytes) {\n"
  f"  __builtin_prefetch((const char*)bytes + {PREFETCH_AHEAD});\n"
  "}\n"
  "#if defined(__AVX2__)\n"
  "#include <immintrin.h>\n"
  "typedef __m256i og_dot_sums;\n"
  "static inline og_dot_sums og_dot_start(void) { return _mm256_setzero_si256(); }\n"
  "static inline __m128i og_dot_bytes(const unsigned char* u, int shift, int mask) {\n"
  "  __m128i bytes = _mm_srli_epi16(_mm_loadu_si128((const __m128i*)u), shift);\n"
  "  return _mm_and_si128(bytes, _mm_set1_epi8((char)(mask & (255 >> shift))));\n"
  "}\n"
  "static inline og_dot_sums og_dot_madd(og_dot_sums sums, __m256i u, __m256i s) {\n"
  "  return _mm256_add_epi32(sums, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));\n"
  "}\n"
  "static inline __m256i og_dot_halves(__m128i low, __m128i high) {\n"
  "  return _mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1);\n"
  "}\n"
  "static inline og_dot_sums og_dot_add(og_dot_sums sums, const unsigned char* u, int shift, int mask,\n"
  "                                     const signed char* s, int count) {\n"
  "  og_prefetch(u);\n"
  "  int i = 0;\n"
  "  for (; i + 32 <= count; i += 32) {\n"
  "    __m256i bytes = og_dot_halves(og_dot_bytes(u + i, shift, mask), og_dot_bytes(u + i + 16, shift, mask));\n"
  "    sums = og_dot_madd(sums, bytes, _mm256_loadu_si256((const __m256i*)(s + i)));\n"
  "  }\n"
  "  for (; i < count; i += 16) {   /* 16 lanes left: the high half multiplies zeros */\n"
  "    __m256i bytes = og_dot_halves(og_dot_bytes(u + i, shift, mask), _mm_setzero_si128());\n"
  "    __m256i signed_bytes = og_dot_halves(_mm_loadu_si128((const __m128i*)(s + i)), _mm_setzero_si128());\n"
  "    sums = og_dot_madd(sums, bytes, signed_bytes);\n"
  "  }\n"
  "  return sums;\n"
  "}\n"
  "static inline og_dot_sums og_dot_add2(og_dot_sums sums, const unsigned char* u0, int shift0, int mask0,\n"
  "                                      const signed char* s0, const unsigned char* u1, int shift1, int mask1,\n"
  "                                      const signed char* s1, int count) {\n"
  "  og_prefetch(u0);\n"
  "  for (int i = 0; i < count; i += 16) {\n"
  "    __m256i bytes = og_dot_halves(og_dot_bytes(u0 + i, shift0, mask0), og_dot_bytes(u1 + i, shift1, mask1));\n"
  "    __m256i signed_bytes = og_dot_halves(_mm_loadu_si128((const __m128i*)(s0 + i)),\n"
  "                                         _mm_loadu_si128((const __m128i*)(s1 + i)));\n"
  "    sums = og_dot_madd(sums, bytes, signed_bytes);\n"
  "  }\n"
  "  return sums;\n"
  "}\n"
  "static inline og_dot_sums og_dot_add_split(og_dot_sums sums, const unsigned char* u, int shift0, int shift1,\n"
  "                                           int mask, const signed char* s, int count) {\n"
  "  og_prefetch(u);\n"
  "  for (int i = 0; i < count; i += 16) {\n"
  "    __m128i raw = _mm_loadu_si128((const __m128i*)(u + i));\n"
  "    __m256i bytes = _mm256_and_si256(og_dot_halves(_mm_srli_epi16(raw, shift0), _mm_srli_epi16(raw, shift1)),\n"
  "                                     _mm256_set1_epi8((char)mask));\n"
  "    __m256i signed_bytes = count == 16 ? _mm256_loadu_si256((const __m256i*)s)\n"
  "        : og_dot_halves(_mm_loadu_si128((const __m128i*)(s + i)),\n"
  "                        _mm_loadu_si128((const __m128i*)(s + count + i)));\n"
  "    sums = og_dot_madd(sums, bytes, signed_bytes);\n"
  "  }\n"
  "  return sums;\n"
  "}\n"
  "static inline og_dot_sums og_dot_add_s8(og_dot_sums sums, const signed char* a, const signed char* b, int count) {\n"
  "  og_prefetch(a);\n"
  "  for (int i = 0; i < count; i += 16) {\n"
  "    __m256i wide_a = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(a + i)));\n"
  "    __m256i wide_b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(b + i)));\n"
  "    sums = _mm256_add_epi32(sums, _mm256_madd_epi16(wide_a, wide_b));\n"
  "  }\n"
  "  return sums;\n"
  "}\n"
  "typedef __m256 og_dot_lanes;\n"
  "static inline og_dot_lanes og_lanes_zero(void) { return _mm256_setzero_ps(); }\n"
  "static inline og_dot_lanes og_lanes_add(og_dot_lanes lanes, og_dot_sums sums, float factor) {\n"
  "  return _mm256_add_ps(lanes, _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(factor)));\n"
  "}\n"
  "static inline float og_lanes_total(og_dot_lanes lanes) {\n"
  "  __m128 half = _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));\n"
  "  half = _mm_add_ps(half, _mm_movehl_ps(half, half));\n"
  "  return _mm_cvtss_f32(_mm_add_ss(half, _mm_shuffle_ps(half, half, 1)));\n"
  "}\n"
  "#elif defined(__SSSE3__)\n"
  "#include <immintrin.h>\n"
  "typedef __m128i og_dot_sums;\n"
  "static inline og_dot_sums og_dot_start(void) { return _mm_setzero_si128(); }\n"
  "static inline og_dot_sums og_dot_add(og_dot_sums sums, const unsigned char* u, int shift, int mask,\n"
  "                                     const signed char* s, int count) {\n"
  "  og_prefetch(u);\n"
  "  for (int i = 0; i < count; i += 16) {\n"
  "    __m128i bytes = _mm_srli_epi16(_mm_loadu_si128((const __m128i*)(u + i)), shift);\n"
  "    bytes = _mm_and_si128(bytes, _mm_set1_epi8((char)(mask & (255 >> shift))));\n"
  "    __m128i pairs = _mm_maddubs_epi16(bytes, _mm_loadu_si128((const __m128i*)(s + i)));\n"
  "    sums = _mm_add_epi32(sums, _mm_madd_epi16(pairs, _mm_set1_epi16(1)));\n"
  "  }\n"
  "  return sums;\n"
  "}\n"
  "static inline og_dot_sums og_dot_add_s8(og_dot_sums sums, const signed char* a, const signed char* b, int count) {\n"
  "  og_prefetch(a);\n"
  "#if defined(__SSE4_1__)\n"
  "  for (int i = 0; i < count; i += 8) {\n"
  "    __m128i wide_a = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)(a + i)));\n"
  "    __m128i wide_b = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)(b + i)));\n"
  "    sums = _mm_add_epi32(sums, _mm_madd_epi16(wide_a, wide_b));\n"
  "  }\n"
  "#else\n"
  "  int total = 0;\n"
  "  for (int i = 0; i < count; i++) total += (int)a[i] * (int)b[i];\n"
  "  sums = _mm_add_epi32(sums, _mm_cvtsi32_si128(total));\n"
  "#endif\n"
  "  return sums;\n"
  "}\n"
  "typedef __m128 og_dot_lanes;\n"
  "static inline og_dot_lanes og_lanes_zero(void) { return _mm_setzero_ps(); }\n"
  "static inline og_dot_lanes og_lanes_add(og_dot_lanes lanes, og_dot_sums sums, float factor) {\n"
  "  return _mm_add_ps(lanes, _mm_mul_ps(_mm_cvtepi32_ps(sums), _mm_set1_ps(factor)));\n"
  "}\n"
  "static inline float og_lanes_total(og_dot_lanes lanes) {\n"
  "  lanes = _mm_add_ps(lanes, _mm_movehl_ps(lanes, lanes));\n"
  "  return _mm_cvtss_f32(_mm_add_ss(lanes, _mm_shuffle_ps(lanes, lanes, 1)));\n"
  "}\n"
  "#else\n"
  "typedef int og_dot_sums;\n"
  "static inline og_dot_sums og_dot_start(void) { return 0; }\n"
  "static inline og_dot_sums og_dot_add(og_dot_sums sums, const unsigned char* u, int shift, int mask,\n"
  "                                     const signed char* s, int count) {\n"
  "  og_prefetch(u);\n"
  "  for (int i = 0; i < count; i++) sums += (int)((u[i] >> shift) & mask) * (int)s[i];\n"
  "  return sums;\n"
  "}\n"
  "static inline og_dot_sums og_dot_add_s8(og_dot_sums sums, const signed char* a, const signed char* b, int count) {\n"
  "  og_prefetch(a);\n"
  "  for (int i = 0; i < count; i++) sums += (int)a[i] * (int)b[i];\n"
  "  return sums;\n"
  "}\n"
  "typedef float og_dot_lanes;\n"
  "static inline og_dot_lanes og_lanes_zero(void) { return 0.0f; }\n"
  "static inline og_dot_lanes og_lanes_add(og_dot_lanes lanes, og_dot_sums sums, float factor) {\n"
  "  return lanes + (float)sums * factor;\n"
  "}\n"
  "static inline float og_lanes_total(og_dot_lanes lanes) { return lanes; }\n"
  "#endif\n"
  "#if !defined(__AVX2__)   /* two pairs at once only where 256-bit registers hold both: else one after the other */\n"
  "static inline og_dot_sums og_dot_add2(og_dot_sums sums, const unsigned char* u0, int shift0, int mask0,\n"
  "                                      const signed char* s0, const unsigned char* u1, int shift1, int mask1,\n"
  "                                      const signed char* s1, int count) {\n"
  "  return og_dot_add(og_dot_add(sums, u0, shift0, mask0, s0, count), u1, shift1, mask1, s1, count);\n"
  "}\n"
  "static inline og_dot_sums og_dot_add_split(og_dot_sums sums, const unsigned char* u, int shift0, int shift1,\n"
  "                                           int mask, const signed char* s, int count) {\n"
  "  return og_dot_add(og_dot_add(sums, u, shift0, mask, s, count), u, shift1, mask, s + count, count);\n"
  "}\n"
  "#endif\n"
)


# A uint16 assembled from two adjacent bytes, low | (high << 8) (a GGUF block's f16 scale read in a product's kernel:
# nn/gguf.py PackedTensor._product_scales), as one 2-byte load where the target is little-endian. gcc 12 leaves the
# assembly as written: two byte loads, a shift and an or per scale (the index's int arithmetic hides that the
# bytes are neighbours); SmolLM2's CPU decode step with the Q4_1 products' scales loaded so, A/B in one process
# (extra/bench/cpu_decode_ab.py, one thread): 0.842x the time of the assembled form.
CLANG_LOAD_U16 = (
  "static inline unsigned short og_load_u16(const unsigned char* bytes) {\n"
  "#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__\n"
  "  unsigned short value;\n"
  "  __builtin_memcpy(&value, bytes, 2);\n"
  "  return value;\n"
  "#else\n"
  "  return (unsigned short)(bytes[0] | (bytes[1] << 8));\n"
  "#endif\n"
  "}\n"
)


# a BYTE_DOT_ADD's pair: ((shift, mask), the bytes' buffer, their index, the activations' buffer, their index)
DotPair = tuple[tuple[int, int], UOp, UOp, UOp, UOp]


def split_pair(first: DotPair, second: DotPair, count: int) -> tuple[int, int, int] | None:
  """(shift0, shift1, mask) where two unsigned pairs of a BYTE_DOT_ADD read the same bytes (one buffer, one index)
  under one effective mask against `count` activations and the `count` right after them (one buffer, the second
  index the first's plus `count`): og_dot_add_split's operands. Else None."""
  (shift0, mask0), u_buffer0, u_index0, s_buffer0, s_index0 = first
  (shift1, mask1), u_buffer1, u_index1, s_buffer1, s_index1 = second
  mask = mask0 & (255 >> shift0)
  if u_buffer0 is not u_buffer1 or u_index0 is not u_index1 or mask1 & (255 >> shift1) != mask: return None
  (base0, offset0), (base1, offset1) = _index_offset(s_index0), _index_offset(s_index1)
  if s_buffer0 is not s_buffer1 or base0 is not base1 or offset1 != offset0 + count: return None
  return shift0, shift1, mask


def little_endian_pair(uop: UOp) -> tuple[UOp, UOp] | None:
  """(buffer, index of the low byte) where `uop` is a uint16 assembled little-endian from two loads of one uint8
  buffer at neighbouring indices, both unmasked: cast(low) | (cast(high) << 8) (either order of the or); else None."""
  if uop.op is not UOps.ALU or uop.arg is not Ops.OR or uop.dtype != dtypes.uint16: return None
  for low, shifted in (uop.srcs, uop.srcs[::-1]):
    if shifted.op is not UOps.ALU or shifted.arg is not Ops.SHL or shifted.srcs[1].op is not UOps.CONST or \
        shifted.srcs[1].arg != 8:
      continue
    low_load, high_load = _widened_byte(low), _widened_byte(shifted.srcs[0])
    if low_load is None or high_load is None or low_load.srcs[0] is not high_load.srcs[0]: continue
    (low_base, low_offset), (high_base, high_offset) = _index_offset(low_load.srcs[1]), _index_offset(high_load.srcs[1])
    if low_base is high_base and high_offset == low_offset + 1: return low_load.srcs[0], low_load.srcs[1]
  return None


def _widened_byte(uop: UOp) -> UOp | None:
  """The unmasked uint8 load of a global buffer that `uop` casts to uint16, else None."""
  if uop.op is not UOps.CAST or uop.dtype != dtypes.uint16: return None
  load = uop.srcs[0]
  if load.op is not UOps.LOAD or load.dtype != dtypes.uint8 or len(load.srcs) != 2 or load.arg is not None or \
      load.srcs[0].op is not UOps.DEFINE_GLOBAL:
    return None
  return load


def _index_offset(index: UOp) -> tuple[UOp | None, int]:
  """An index as (base, constant offset): base + c for an ADD of a constant, (None, c) for a constant."""
  if index.op is UOps.CONST: return None, int(index.arg)
  if index.op is UOps.ALU and index.arg is Ops.ADD and index.srcs[1].op is UOps.CONST:
    return index.srcs[0], int(index.srcs[1].arg)
  return index, 0
