"""The device functions of the fused attention forward kernel (codegen/attention_render.py), written with PTX:
mma.sync and the operand conversions it needs, exp2 on MUFU (and, plan.exp_poly, by a cubic on the FMA pipe),
ldmatrix loads, cp.async copies, and the wgmma kernel's (codegen/attention_wgmma.py). test/attention_forward_host.py
swaps them for host versions to run the kernel on a CPU."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ourgrad.codegen import attention_wgmma

if TYPE_CHECKING:
  from ourgrad.codegen.attention import AttentionPlan

# m16n8k16 for 16-bit operands, m16n8k8 TF32 for float32: (k per instruction, A registers, PTX type)
MMA_SHAPES = {"float32": (8, 4, "tf32"), "float16": (16, 4, "f16"), "bfloat16": (16, 4, "bf16")}
LOG2_E, LN_2 = 1.4426950408889634, 0.6931471805599453

_HELPERS_16 = """__device__ __forceinline__ unsigned pack_bits(unsigned short low, unsigned short high) {
  return (unsigned)low | ((unsigned)high << 16);
}
__device__ __forceinline__ unsigned pack_floats(float low, float high) {
  unsigned packed;
  asm("cvt.rn.TYPEx2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
  return packed;
}
__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.TYPE.TYPE.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
"""

_HELPERS_TF32 = """__device__ __forceinline__ unsigned tf32(float value) {
  unsigned rounded;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(rounded) : "f"(value));
  return rounded;
}
__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
"""

# ldmatrix: lanes 8j..8j+7 give the row addresses of 8x8 matrix j; with .trans each lane gets a column pair instead
_LDMATRIX_HELPERS = """__device__ __forceinline__ void load_matrices(unsigned* r, const void* rows) {
  unsigned address = (unsigned)__cvta_generic_to_shared(rows);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address) : "memory");
}
__device__ __forceinline__ void load_matrices_transposed(unsigned* r, const unsigned short* rows) {
  unsigned address = (unsigned)__cvta_generic_to_shared(rows);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address) : "memory");
}
"""

_COPY_HELPER = """__device__ __forceinline__ void copy16(void* target, const void* source, bool inside) {
  unsigned address = (unsigned)__cvta_generic_to_shared(target);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(address), "l"(source), "r"(inside ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void copy_wait_all_but_one() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }
"""


# 2^x as one MUFU.EX2 (exp2f without fast math adds a range check and two multiplies for subnormal results; a
# probability under 2^-126 flushed to 0 changes no sum)
_EXP2_HELPER = """__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
"""


# 2^x (x <= 0) on the FMA and integer pipes instead of MUFU (plan.exp_poly): x = j + f, j the nearest integer (the
# 1.5 * 2^23 addition leaves it in the low mantissa bits), 2^f for f in [-1/2, 1/2] by a cubic fitted to relative
# error 8e-5 (under bfloat16's and float16's rounding of P), 2^j added to its exponent. x is clamped to -126, so the
# exponent stays >= 0 (2^-126 for masked scores: P under 1e-37, nothing to any sum)
POLY_EXP2_HELPER = """__device__ __forceinline__ float poly_exp2(float x) {
  x = fmaxf(x, -126.0f);
  float rounded = x + 12582912.0f;
  float f = x - (rounded - 12582912.0f);
  float power = fmaf(fmaf(fmaf(0.05508877f, f, 0.24260466f), f, 0.69327628f), f, 0.99992890f);
  return __int_as_float(__float_as_int(power) + (__float_as_int(rounded) << 23));
}
"""


def kernel_helpers(plan: AttentionPlan) -> str:
  """The device functions the kernel calls, written with PTX: mma (and the operand conversions it needs), exp2,
  ldmatrix loads, cp.async copies. test/attention_forward_host.py swaps them for host versions to run the kernel on a
  CPU."""
  helpers = _HELPERS_TF32 if plan.dtype == "float32" else _HELPERS_16.replace("TYPE", MMA_SHAPES[plan.dtype][2])
  if plan.exp_poly: helpers += POLY_EXP2_HELPER
  if plan.mma == "wgmma":
    return helpers + _EXP2_HELPER + _COPY_HELPER + attention_wgmma.wgmma_helpers(plan, MMA_SHAPES[plan.dtype][2])
  return (helpers + _EXP2_HELPER + (_LDMATRIX_HELPERS if plan.ldmatrix else "") +
          (_COPY_HELPER if plan.vector_copies else ""))
