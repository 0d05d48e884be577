"""UOps -> CUDA C++ for NVRTC: the CUDA dialect of `CStyleLanguage` (renderer/cstyle.py): thread blocks, shared
memory (static, and dynamic for staged tensor-core tiles), warp shuffles, cp.async, ldmatrix and mma.sync; on sm_90
the wgmma matmul kernel of codegen/wgmma_tiles.py."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ourgrad.codegen.attention import AttentionPlan
from ourgrad.codegen.attention_render import render_attention
from ourgrad.codegen.attention_grad import AttentionGradKernel, render_attention_grad_cuda
from ourgrad.codegen.tensor_cores import CUDA_TENSOR_CORES
from ourgrad.codegen.uops import AxisType, UOp, UOps
from ourgrad.codegen.wgmma_tiles import WgmmaMatmul, render_wgmma_matmul
from ourgrad.dtype import DType, dtypes
from ourgrad.renderer import ASSUMED_CUDA_GPU
from ourgrad.renderer.cstyle import (BFLOAT16_IN_FLOAT, DYNAMIC_SHARED_ARRAY, DYNAMIC_SHARED_SYMBOL, CStyleLanguage,
                                     FloatInRegisters, block_threads,
                                     kernel_dtypes, stored_format_locals)

# Programmatic dependent launch (PTX griddepcontrol, sm_90): a kernel waits here until the kernel before it has
# finished and its writes are visible (a no-op when it was launched the ordinary way). In a CUDA graph with programmatic
# edges (runtime/ops_cuda.CUDAGraph) the next kernel is launched before this one has completed: by default as this
# kernel's blocks exit (the implicit trigger; H200 against plain edges: MLP step 0.120 -> 0.114 ms, MNIST CNN 0.144 ->
# 0.133, SmolLM2 decode 728 -> 776 tok/s), or, for measurements, as soon as all of them have started where
# CUDARenderer.early_launches says (the edge's launch-order port: what a griddepcontrol.launch_dependents at the
# kernel's start does, without a recompile). Launched early, the next kernel's blocks wait resident beside this one
# and slow it: session 15 (bench_pdl.py) MLP step 0.114 -> 0.218 ms with the one-wave rule, bf16 decode 1436 -> 1408
# tok/s (a graph's own cost is ~0.6 us a kernel either way). Session 11, the trigger at every kernel's start: decode
# 854 tok/s but the MLP step 0.222 ms; session 13 (bf16 decode, the trigger right after the wait): 1191 tok/s with the
# logits read each step (1336 without) and 1714 fed back (1671); L2 prefetches of each thread's first loads before the
# wait gave 656 / 747 tok/s and MLP / MNIST CNN steps of 0.218 / 0.389 ms: none kept.
DEPENDENT_LAUNCH_PROLOGUE = ("#if __CUDA_ARCH__ >= 900\n"
                             '  asm volatile("griddepcontrol.wait;" ::: "memory");\n'
                             "#endif\n")


@dataclass(frozen=True)
class GridFootprint:
  """One kernel launch as dependent launch sees it: its grid's blocks and how many of its blocks one multiprocessor
  holds at once (the device's occupancy from the kernel's registers, shared memory and threads)."""
  blocks: int
  resident_per_multiprocessor: int
  op_count: int = 0      # arithmetic ops and bytes moved by one launch (0: not known)
  byte_count: int = 0

  def waves(self, multiprocessors: int) -> float:
    """The share of the whole GPU's room for this kernel's blocks that its grid takes (1.0: exactly one wave)."""
    return self.blocks / (multiprocessors * max(self.resident_per_multiprocessor, 1))


# A reduce loop of at most this many iterations over straight-line code is unrolled fully (`#pragma unroll`): its
# iterations' loads are independent of each other, and a rolled loop issues them one round trip to memory at a time
# (nvcc leaves some short loops rolled: a decode step's down projection, 3 iterations with SwiGLU's exp2 in them)
SHORT_LOOP_UNROLL = 8
# ...whose unrolled body stays at most this many UOps (a loop of tensor-core tiles or staged copies is left as it is)
SHORT_LOOP_UOPS = 2048
# A byte (int8, uint8: Q8_0's quants) becomes a float32 through its bits: the byte added into the mantissa of a float of
# exponent 23 (an integer add or or), then that float's offset subtracted (a float add), exact for every byte. Two
# full-rate instructions where a conversion (I2F) issues at a quarter of the float rate or less: the products of a
# decode step convert every weight they read (the logits product, 28 M bytes, and each layer's in one wave).
BYTE_FLOAT_BITS = 1
# what keeps a loop rolled: another loop inside it, a barrier, tensor-core or asynchronous-copy work
_NOT_UNROLLED_INSIDE = (UOps.RANGE, UOps.BARRIER, UOps.WMMA, UOps.COPY)


def short_reduce_loops(uops: list[UOp]) -> set[int]:
  """Ids of the constant-trip REDUCE loops of at most SHORT_LOOP_UNROLL iterations whose bodies are straight-line code
  (no loop, barrier, tensor-core or copy UOp inside) of at most SHORT_LOOP_UOPS UOps unrolled."""
  chosen: set[int] = set()
  # (loop, its first body index, its trip count while it is still a candidate, else 0)
  open_loops: list[tuple[UOp, int, int]] = []
  for index, uop in enumerate(uops):
    if uop.op in _NOT_UNROLLED_INSIDE and open_loops:
      open_loops = [(loop, start, 0) for loop, start, _ in open_loops]
    if uop.op is UOps.RANGE:
      start, end = uop.srcs
      trip = end.arg - start.arg if start.op is UOps.CONST and end.op is UOps.CONST else 0
      short = uop.arg[1] is AxisType.REDUCE and 2 <= trip <= SHORT_LOOP_UNROLL
      open_loops.append((uop, index + 1, trip if short else 0))
    elif uop.op is UOps.ENDRANGE and open_loops and open_loops[-1][0] is uop.srcs[0]:
      loop, start, trip = open_loops.pop()
      if trip and trip * (index - start) <= SHORT_LOOP_UOPS: chosen.add(id(loop))
  return chosen


# the device function that rounds two floats to one word of two 16-bit floats (the first in the low half), per dtype
PAIR_TO_BITS = {dtypes.float16: "floats_to_f16x2", dtypes.bfloat16: "floats_to_bf16x2"}


def pair_helper(name: str, ptx_type: str) -> str:
  """A device function `name(low, high)`: both floats rounded to nearest even into one word by one cvt.rn (sm_80 and
  newer), `low` in the low half. PTX's cvt puts its first source operand in the high half."""
  return (f"__device__ __forceinline__ unsigned int {name}(float low, float high) {{\n"
          f'  unsigned int bits; asm("cvt.rn.{ptx_type}.f32 %0, %1, %2;" : "=r"(bits) : "f"(high), "f"(low)); '
          "return bits; }\n")


def byte_vector_lane(uop: UOp) -> tuple[UOp, int, bool] | None:
  """(vector, lane, signed) where `uop` is a CAST to float32 of one lane of a 4-byte vector load (uint8, or int8 as
  the BITCAST of a uint8 lane: Q8_0's quants), else None."""
  if uop.op is not UOps.CAST or uop.dtype != dtypes.float32: return None
  source, signed = uop.srcs[0], uop.srcs[0].dtype == dtypes.int8
  if source.op is UOps.BITCAST and signed and source.srcs[0].dtype == dtypes.uint8: source = source.srcs[0]
  elif source.dtype not in (dtypes.uint8, dtypes.int8): return None
  vector = source.srcs[0] if source.op is UOps.GEP else None
  if vector is None or vector.op is not UOps.LOAD or vector.arg != 4 or vector.dtype != dtypes.uint8: return None
  if vector.srcs[0].op is not UOps.DEFINE_GLOBAL: return None
  return vector, source.arg, signed


class CUDARenderer(CStyleLanguage):
  """CUDA C++ compiled by NVRTC: one thread block per block of local axes, blockIdx/threadIdx as thread indices.

  NVRTC compiles without the toolkit's headers, so the kernel needs none: float16 and bfloat16 values live
  in float registers, widened at loads with one PTX instruction (half) or a bit shift (bfloat16) and rounded at
  stores and casts with one PTX instruction (cvt.rn: bfloat16 on sm_80 and newer, else the bit arithmetic of
  cstyle's BFLOAT16_HELPERS); a vector store rounds each pair of values with one instruction (cvt.rn.*x2.f32).
  Infinities are spelled through their bit patterns."""
  device = "CUDA"
  has_threads = True
  max_threads = 1024
  has_local = True
  local_memory_bytes = 48 * 1024  # static __shared__ memory per block
  # staged tensor-core tiles may go beyond, in dynamic shared memory, and the heuristics size grids by the
  # multiprocessors, their resident threads and registers: the GPU's facts, ASSUMED_CUDA_GPU's unless the CUDA device
  # sets its own (Renderer.set_gpu_facts)
  dynamic_local_memory_bytes = ASSUMED_CUDA_GPU.dynamic_local_memory_bytes
  multiprocessors = ASSUMED_CUDA_GPU.multiprocessors
  threads_per_multiprocessor = ASSUMED_CUDA_GPU.threads_per_multiprocessor
  registers_per_multiprocessor = ASSUMED_CUDA_GPU.registers_per_multiprocessor
  has_async_copy = True   # COPY with cp.async (sm_80+): SHARED_ASYNC tiles without tensor cores
  carries_riders = True   # a rider runs in the first block (engine/ride_along.py)
  has_block_atomics = True   # ATOMIC_ADD and FENCE: one-kernel split reduces (codegen/split_finish.py)
  warp_size = 32
  # ~1.5 us a launch inside a CUDA graph at ~3 TB/s of HBM; the CUDA device computes it from its own memory bandwidth
  launch_bytes = 4 << 20
  # a load waits ~0.6 us for HBM under load (MNIST's bn2 statistics backward on the H200: 0.65 us a loop iteration
  # whose loads are not overlapped): 0.4 launches; the CUDA device computes it from its own memory bandwidth
  latency_bytes = 1600 << 10
  # float32 ops in one launch's time (132 multiprocessors x 128 lanes x 2 ops x 1.98 GHz x 1.5 us); the CUDA device
  # computes it from its own multiprocessors and clock
  launch_ops = 100_000_000
  local_prefix = "__shared__ "
  local_align = "__align__(16) "
  barrier = "__syncthreads();"
  bfloat16_spelling = ("__device__ __forceinline__ ", "__float_as_uint(value)",
                       "__uint_as_float(((unsigned int)bits) << 16)")
  vector_width = 4
  # mma.sync m16n8k16 (sm_80 and newer: A100, H100; the GPUs this renderer targets)
  tensor_cores = CUDA_TENSOR_CORES
  # warpgroup MMA (OptOps.WGMMA, codegen/wgmma_tiles.py): on sm_90 (H100, H200), compiled for sm_90a
  has_wgmma = False
  # programmatic dependent launch (sm_90): every kernel starts with DEPENDENT_LAUNCH_PROLOGUE, so a CUDA graph whose
  # edges are programmatic (runtime/ops_cuda.CUDAGraph) launches each kernel while the one before still runs
  dependent_launch = False

  def __init__(self, arch: str = "") -> None:
    """`arch`: the GPU's sm_XX when known (the CUDA device passes it): sm_90 enables wgmma and dependent launch."""
    self.has_wgmma = self.dependent_launch = arch == "sm_90"
    # the fused attention kernel uses mma.sync (TF32, bfloat16) and cp.async: sm_80 and newer (unknown: assumed)
    self.has_fused_attention = arch == "" or int(arch.removeprefix("sm_").rstrip("a")) >= 80
    # cvt.rn.bf16.f32 and the paired cvt.rn.bf16x2.f32 / cvt.rn.f16x2.f32 (sm_80 and newer; unknown: assumed)
    self.has_16bit_cvt = self.has_fused_attention

  def early_launches(self, footprints: list[GridFootprint], short_only: bool = False) -> list[bool]:
    """Per kernel of a CUDA graph's chain, whether it is launched as soon as every block of the kernel before it has
    started (True) instead of as those blocks exit (the implicit trigger; always so for the first kernel).

    A kernel launched early waits, resident, until the one before completes: its blocks take room beside the running
    kernels, and once placed they stay where they were put. So it is launched early only where its blocks and those
    of every kernel that may still be resident (the run of early launches before it, back to the last kernel launched
    as its predecessor's blocks exited) fit in one wave of this GPU together, each spread over all multiprocessors. A
    decode step's small one-wave kernels chain that way; a grid of several waves is never launched early, nor is the
    kernel after it (its predecessor's last blocks start only as its first ones exit: no latency left to hide).
    `short_only`: also only after a kernel whose bytes and ops take at most one launch's time on this GPU
    (launch_bytes, launch_ops), so that no block waits long beside a running kernel."""
    early, resident = [False] * len(footprints), 0.0
    for index, footprint in enumerate(footprints):
      share = footprint.waves(self.multiprocessors)
      if index > 0 and resident + share <= 1.0 and (not short_only or self._short(footprints[index - 1])):
        early[index] = True
        resident += share
      else:
        resident = share
    return early

  def unrolled_loops(self, uops: list[UOp]) -> set[int]: return short_reduce_loops(uops)

  def _short(self, footprint: GridFootprint) -> bool:
    """Whether a launch moves and computes at most what this GPU does in one launch's time."""
    return footprint.byte_count <= self.launch_bytes and footprint.op_count <= self.launch_ops

  def render_attention(self, name: str, plan: AttentionPlan, arguments: dict[str, int]) -> str:
    """The fused attention kernel of `plan`, its buffers in argument order (see codegen/attention_render.py)."""
    return self._with_prologue(render_attention(plan, name, arguments, DYNAMIC_SHARED_SYMBOL))

  def render_attention_grad(self, name: str, kernel: AttentionGradKernel) -> str:
    """A fused attention backward kernel, its buffers in argument order (see codegen/attention_grad.py)."""
    return self._with_prologue(render_attention_grad_cuda(name, kernel))

  def render_wgmma(self, name: str, plan: WgmmaMatmul, arguments: dict[str, int]) -> str:
    """The kernel of an OptOps.WGMMA plan, its buffers in argument order (see codegen/wgmma_tiles.py)."""
    return self._with_prologue(render_wgmma_matmul(plan, name, arguments, DYNAMIC_SHARED_SYMBOL))

  def _with_prologue(self, source: str) -> str:
    """`source` with DEPENDENT_LAUNCH_PROLOGUE as the first lines of its kernel's body (when dependent_launch)."""
    if not self.dependent_launch: return source
    start = source.index('extern "C" __global__')
    body = source.index("{\n", start) + 2
    return source[:body] + DEPENDENT_LAUNCH_PROLOGUE + source[body:]

  # float16 and bfloat16 vectors are their stored bits, two values a 32-bit word: 8 of them one 16-byte access (a
  # warp's 16-bit loads one element a thread move 64 bytes an instruction: GPT-2's bf16 GELU backward ran at 30% of
  # DRAM). int32 as int4 (an uploaded arange beside a cross-entropy gradient's columns: scalar loads 8 columns a lane
  # apart were 8 L1 requests of 16 sectors per 16-byte vector of logits). Bytes too (Q8_0's quants, read by a decode
  # step's products: one byte a load was 4 load instructions for each of a bfloat16 weight's uint2), as one 16- or
  # 32-bit word (render_vector_type)
  vector_dtypes = (dtypes.float32, dtypes.float16, dtypes.bfloat16, dtypes.int32, dtypes.uint8, dtypes.int8)
  byte_vector_names = {dtypes.uint8: "uchar", dtypes.int8: "char"}
  byte_vector_lanes = 4   # one 32-bit word (render_vector_type)

  def render_vector_type(self, width: int, dtype: DType) -> str:
    # bytes as one word (their lanes taken out by shifts, or as floats by byte_lane_float): a uchar4 is four 8-bit
    # registers to the compiler, which packed them back into a word with 3 PRMTs for each bit trick on it
    if dtype in self.byte_vector_names: return {2: "unsigned short", 4: "unsigned int"}[width]
    if dtype not in self.floats_in_registers: return super().render_vector_type(width, dtype)
    return f"uint{width // 2}"   # uint1, uint2, uint4: a word per two values

  def render_vector_load(self, buffer: str, index: str, width: int, dtype: DType) -> str:
    # the index is a multiple of the width (the linearizer checks), so the address is aligned to the vector's bytes
    return f"*((const {self.render_vector_type(width, dtype)}*)({buffer}+({index})))"

  def render_cast(self, value: str, from_dtype: DType, to_dtype: DType) -> str:
    # bytes to float32 through the bits (BYTE_FLOAT_BITS): 2^23 * 1.5 + s for a signed byte s, 2^23 + u for an unsigned
    if BYTE_FLOAT_BITS and to_dtype == dtypes.float32 and from_dtype == dtypes.int8:
      return f"(__int_as_float(0x4B400000 + (int)({value})) - 12582912.0f)"
    if BYTE_FLOAT_BITS and to_dtype == dtypes.float32 and from_dtype == dtypes.uint8:
      return f"(__int_as_float(0x4B000000 | (unsigned int)({value})) - 8388608.0f)"
    return super().render_cast(value, from_dtype, to_dtype)

  def _expression(self, uop: UOp, ref) -> str:
    lane = byte_vector_lane(uop) if BYTE_FLOAT_BITS else None
    if lane is None: return super()._expression(uop, ref)
    # one byte_perm puts the lane's byte under the exponent bits of 2^23 (a signed byte's sign bit flipped once for
    # the word: 2^23 + 128 + s), one float add removes the offset
    vector, element, signed = lane
    return f"byte_lane_float({ref(vector)}, {element}, {'true' if signed else 'false'})"

  def render_vector_element(self, vector: str, element: int, dtype: DType) -> str:
    if dtype in self.byte_vector_names: return f"(({dtype.c_name})({vector} >> {8 * element}))"
    if dtype not in self.floats_in_registers: return super().render_vector_element(vector, element, dtype)
    word = f"{vector}.{'xyzw'[element // 2]}"
    return self.floats_in_registers[dtype].to_float.format(f"((unsigned short)({word} >> {16 * (element % 2)}))")

  def render_vector_store(self, buffer: str, index: str, values: list[str], dtype: DType) -> str:
    vector = self.render_vector_type(len(values), dtype)
    if dtype in self.byte_vector_names:   # the bytes packed into the word, the first in its lowest byte
      word = " | ".join(f"((unsigned int)(unsigned char)({value}) << {8 * lane})" for lane, value in enumerate(values))
      return f"*(({vector}*)({buffer}+({index}))) = ({vector})({word});"
    if dtype in self.floats_in_registers:   # each pair of values packed into one word, the first in its low half
      if self.has_16bit_cvt:
        pair = PAIR_TO_BITS[dtype]
        values = [f"{pair}({low}, {high})" for low, high in zip(values[0::2], values[1::2])]
      else:
        bits = [f"((unsigned int){self.floats_in_registers[dtype].from_float.format(value)})" for value in values]
        values = [f"({low} | ({high} << 16))" for low, high in zip(bits[0::2], bits[1::2])]
    return f"*(({vector}*)({buffer}+({index}))) = make_{vector}({', '.join(values)});"

  def bfloat16_helpers(self) -> str:
    """cstyle's bit arithmetic before sm_80; from sm_80 one cvt.rn rounds a float (a NaN becomes the canonical NaN,
    as torch's __float2bfloat16 makes it on these GPUs) and one rounds a pair into a word: a bfloat16 GELU
    spent 15 of its ~48 SASS instructions an element on the bit arithmetic and was issue-bound at half of the H200's
    DRAM bandwidth."""
    if not self.has_16bit_cvt: return super().bfloat16_helpers()
    return ('__device__ __forceinline__ unsigned short float_to_bf16(float value) {\n'
            '  unsigned short bits; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(value)); return bits; }\n'
            '__device__ __forceinline__ float bf16_to_float(unsigned short bits) { return '
            '__uint_as_float(((unsigned int)bits) << 16); }\n'
            '__device__ __forceinline__ float bf16_round(float value) { return bf16_to_float(float_to_bf16(value)); }\n'
            f'{pair_helper("floats_to_bf16x2", "bf16x2")}')

  def render_vector_zero(self, width: int, dtype: DType) -> str:
    if dtype in self.floats_in_registers: return f"make_uint{width // 2}({', '.join(['0u'] * (width // 2))})"
    if dtype in self.byte_vector_names: return f"(({self.render_vector_type(width, dtype)})0)"
    return f"make_{self.render_dtype(dtype)}{width}({', '.join([self.render_const(0, dtype)] * width)})"
  buffer_suffix = " __restrict__"
  preamble = ""
  storage_names = {"float16": "unsigned short", "bfloat16": "unsigned short"}

  def render_dtype(self, dtype: DType) -> str:
    return "float" if dtype in (dtypes.float16, dtypes.bfloat16) else dtype.c_name

  def memory_type(self, dtype: DType) -> str: return self.storage_names.get(dtype.name, dtype.c_name)

  def render_const(self, value: float | int | bool, dtype: DType) -> str:
    if dtype.is_float and not math.isfinite(value):
      if dtype == dtypes.float64:
        bits = {math.inf: "0x7ff0000000000000ll", -math.inf: "0xfff0000000000000ll"}.get(value, "0x7ff8000000000000ll")
        return f"__longlong_as_double({bits})"
      bits = {math.inf: "0x7f800000", -math.inf: "0xff800000"}.get(value, "0x7fc00000")
      return f"__int_as_float({bits})"
    if dtype in (dtypes.float16, dtypes.bfloat16): return super().render_const(value, dtypes.float32)
    return super().render_const(value, dtype)

  floats_in_registers = {
    dtypes.float16: FloatInRegisters("half_to_float({})", "float_to_half({})",
                                     "half_to_float(float_to_half((float)({})))"),
    dtypes.bfloat16: BFLOAT16_IN_FLOAT}

  def reinterpret(self, value: str, from_dtype: DType, to_dtype: DType) -> str:
    return f"bitcast<{to_dtype.c_name}, {from_dtype.c_name}>({value})"

  def render_special(self, arg: tuple) -> str:
    _, _, dimension, kind = arg
    return f"{'blockIdx' if kind is AxisType.GLOBAL else 'threadIdx'}.{'xyz'[dimension]}"

  def render_warp_reduce(self, variable: str, uop: UOp, uops: list[UOp]) -> list[str]:
    """A butterfly over `width` neighbouring lanes with __shfl_xor_sync: after it every lane holds the result."""
    op, width, stride = uop.arg
    threads = block_threads(uops)
    mask = "0xffffffffu" if threads >= self.warp_size else f"{(1 << threads) - 1:#x}u"
    register = self.render_dtype(uop.dtype)
    # shuffles move 32- and 64-bit values: narrower types travel as int
    wide = "int" if uop.dtype.itemsize < 4 and register not in ("float", "double") else register
    # every lane shuffles (no shuffle inside a conditional expression), then combines
    combined = self.render_alu(op, uop.dtype, [variable, "other"], [uop.dtype, uop.dtype])
    return [f"for (int offset = {width // 2 * stride}; offset >= {stride}; offset >>= 1) {{",
            f"  {register} other = ({register})__shfl_xor_sync({mask}, ({wide}){variable}, offset);",
            f"  {variable} = {combined};",
            "}"]

  def dynamic_local_offsets(self, uops: list[UOp], copied_locals: set[int]) -> dict[int, int]:
    """Over `local_memory_bytes` of tiles (only staged tensor-core tiles may be: their limit is
    `dynamic_local_memory_bytes`), every local memory is a 16-byte aligned piece of one dynamic shared array."""
    offsets, total = self.dynamic_local_layout(uops, copied_locals)
    return offsets if total > self.local_memory_bytes else {}

  @staticmethod
  def dynamic_local_layout(uops: list[UOp], copied_locals: set[int]) -> tuple[dict[int, int], int]:
    """(byte offset of each local memory by id, total bytes), each 16-byte aligned; a tile that COPYs fill holds
    its dtype as stored, any other local memory 4-byte registers values."""
    offsets, total = {}, 0
    for uop in uops:
      if uop.op is not UOps.DEFINE_LOCAL: continue
      offsets[id(uop)] = total
      total += -(-uop.arg[1] * (uop.dtype.itemsize if id(uop) in copied_locals else 4) // 16) * 16
    return offsets, total

  # the integer type that moves a COPY's bytes in one access
  copy_types = {16: ("uint4", "make_uint4(0, 0, 0, 0)"), 8: ("uint2", "make_uint2(0, 0)"), 4: ("unsigned", "0u"),
                2: ("unsigned short", "(unsigned short)0")}

  def render_copy(self, uop: UOp, local: str, local_index: str, buffer: str, index: str, valid: str | None) -> str:
    """A tile COPY: cp.async (4, 8 or 16 bytes; .cg for 16: it bypasses L1) with a source size of 0 where not
    valid (zero-filled, nothing read), else one plain vector load and store (2 bytes, or a synchronous COPY)."""
    width, asynchronous = uop.arg
    size = width * uop.srcs[0].dtype.itemsize
    source = f"{buffer}+({index})" if valid is None else f"{buffer}+(({valid}) ? ({index}) : 0)"
    if asynchronous and size in (4, 8, 16):
      cache = "cg" if size == 16 else "ca"
      operands = f'"r"((unsigned)__cvta_generic_to_shared({local}+({local_index}))), "l"({source})'
      if valid is not None: operands += f', "r"(({valid}) ? {size} : 0)'
      source_size = "" if valid is None else ", %2"
      instruction = f"cp.async.{cache}.shared.global [%0], [%1], {size}{source_size};"
      return f'asm volatile("{instruction}" :: {operands} : "memory");'
    vector, zero = self.copy_types[size]
    loaded = f"*((const {vector}*)({source}))"
    if valid is not None: loaded = f"({valid}) ? {loaded} : {zero}"
    return f"*(({vector}*)({local}+({local_index}))) = {loaded};"

  def render_atomic_add(self, buffer: str, index: str, value: str) -> str:
    return f"atomicAdd({buffer}+({index}), {value})"

  def render_fence(self) -> str: return "__threadfence();"

  # ld.global.cg: cached in L2 only. Another block of the SM may have loaded the line into L1 before its neighbours'
  # partials landed (a line shared by two groups)
  def render_coherent_load(self, buffer: str, index: str) -> str: return f"__ldcg({buffer}+({index}))"

  def render_async_wait(self, keep: int) -> str:
    return ('asm volatile("cp.async.commit_group;" ::: "memory"); '
            f'asm volatile("cp.async.wait_group {keep};" ::: "memory");')

  def render_ldmatrix(self, variable: str, uop: UOp, local: str, index: str) -> list[str]:
    """ldmatrix into `count` 32-bit registers {variable}_0.. (each two 16-bit fragment elements)."""
    count, transposed = uop.arg
    registers = [f"{variable}_{number}" for number in range(count)]
    outputs = ", ".join(f'"=r"({register})' for register in registers)
    operands = ", ".join(f"%{number}" for number in range(count))
    instruction = (f"ldmatrix.sync.aligned.m8n8.x{count}{'.trans' if transposed else ''}.shared.b16 "
                   f"{{{operands}}}, [%{count}];")
    address = f"(unsigned)__cvta_generic_to_shared({local}+({index}))"
    return [f"unsigned {', '.join(registers)};", f'asm volatile("{instruction}" : {outputs} : "r"({address}));']

  def raw_fragment_loads(self, uops: list[UOp]) -> set[int]:
    """float16/bfloat16 loads of kernel arguments read only by WMMAs: the mma takes their 16 bits as stored, so they
    skip the round trip through a float register (a conversion there and one back). A 2-wide vector load of them
    (two K-neighbouring fragment elements, see Linearizer._fragment_pair) is one 32-bit load whose GEPs are its two
    halves."""
    wmma_uses: dict[int, int] = {}
    for uop in uops:
      if uop.op is UOps.WMMA:
        for src in uop.srcs: wmma_uses[id(src)] = wmma_uses.get(id(src), 0) + 1
    raw: set[int] = set()
    for uop in uops:
      if uop.op is UOps.LOAD and uop.arg in (None, 2) and uop.srcs[0].op is UOps.DEFINE_GLOBAL and \
          uop.dtype in (dtypes.float16, dtypes.bfloat16):
        if uop.arg is None and wmma_uses.get(id(uop), 0) == uop.uses: raw.add(id(uop))
        if uop.arg == 2: raw.add(id(uop))
      elif uop.op is UOps.GEP and uop.srcs[0].op is UOps.LDMATRIX: raw.add(id(uop))
      elif uop.op is UOps.GEP and id(uop.srcs[0]) in raw:
        if wmma_uses.get(id(uop), 0) != uop.uses: raise NotImplementedError("a paired half load read outside a WMMA")
        raw.add(id(uop))
    return raw

  def render_wmma(self, uop: UOp, operands: list[str], raw: list[bool]) -> str:
    """A call of the kernel's mma helper (render_mma_helper) on the fragments' 16-bit patterns (a value that lives
    in a float register is converted; TF32 fragments are floats, converted inside the helper); the accumulators are
    passed by reference."""
    (m, n, k), dtype_in, _ = uop.arg
    fragment_count = (m * k + k * n) // 32
    if dtype_in == "float32": return f"mma_m{m}n{n}k{k}_{dtype_in}({', '.join(operands)});"
    to_bits = "float_to_half" if dtype_in == "float16" else "float_to_bf16"
    fragments = [operand if is_raw else f"{to_bits}({operand})"
                 for operand, is_raw in zip(operands[:fragment_count], raw)]
    return f"mma_m{m}n{n}k{k}_{dtype_in}({', '.join(fragments + operands[fragment_count:])});"

  @staticmethod
  def render_mma_helper(arg: tuple) -> str:
    """The device function for one tensor-core instruction (arg of a WMMA uop): it takes the A and B fragments'
    16-bit patterns and packs them two per 32-bit register (the lower-numbered element in the lower half, as
    mma.sync reads them), or (TF32) takes floats and rounds each to TF32 in its own register (cvt.rna.tf32.f32);
    the C fragment is updated in place."""
    (m, n, k), dtype_in, dtype_out = arg
    tf32 = dtype_in == "float32"
    ptx_type = {"float16": "f16", "bfloat16": "bf16", "float32": "tf32"}[dtype_in]
    a_count, b_count, c_count = m * k // 32, k * n // 32, m * n // 32
    a_names, b_names = [f"a{i}" for i in range(a_count)], [f"b{i}" for i in range(b_count)]
    c_names = [f"c{i}" for i in range(c_count)]
    if tf32:
      registers = [f"{name}_tf32" for name in a_names + b_names]
      conversions = "".join(f'  unsigned {register}; asm("cvt.rna.tf32.f32 %0, %1;" : "=r"({register}) : '
                            f'"f"({name}));\n' for register, name in zip(registers, a_names + b_names))
    else:
      registers = [f"((unsigned){low} | ((unsigned){high} << 16))" for names in (a_names, b_names)
                   for low, high in zip(names[::2], names[1::2])]
      conversions = ""
    a_registers = a_count if tf32 else a_count // 2
    b_registers = b_count if tf32 else b_count // 2
    c_operands = ", ".join(f"%{i}" for i in range(c_count))
    a_operands = ", ".join(f"%{c_count + i}" for i in range(a_registers))
    b_operands = ", ".join(f"%{c_count + a_registers + i}" for i in range(b_registers))
    # in the WMMA uop's source order: A, B, then the accumulators (by reference)
    fragment_type = "float" if tf32 else "unsigned short"
    params = ", ".join([f"{fragment_type} {name}" for name in a_names + b_names] +
                       [f"float &{name}" for name in c_names])
    outputs = ", ".join('"+f"(' + name + ")" for name in c_names)
    inputs = ", ".join('"r"(' + value + ")" for value in registers)
    instruction = (f"mma.sync.aligned.m{m}n{n}k{k}.row.col.f32.{ptx_type}.{ptx_type}.f32 "
                   f"{{{c_operands}}}, {{{a_operands}}}, {{{b_operands}}}, {{{c_operands}}};")
    return (f"__device__ __forceinline__ void mma_m{m}n{n}k{k}_{dtype_in}({params}) {{\n{conversions}"
            f'  asm volatile("{instruction}"\n    : {outputs}\n    : {inputs});\n}}\n')

  def render_kernel(self, name: str, params: list[str], body: list[str], uops: list[UOp]) -> str:
    threads = block_threads(uops)
    used, helpers = kernel_dtypes(uops), []
    if dtypes.float16 in used:
      helpers.append('__device__ __forceinline__ float half_to_float(unsigned short h) {\n'
                     '  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }\n'
                     '__device__ __forceinline__ unsigned short float_to_half(float f) {\n'
                     '  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }\n' +
                     (pair_helper("floats_to_f16x2", "f16x2") if self.has_16bit_cvt else ""))
    if dtypes.bfloat16 in used: helpers.append(self.bfloat16_helpers())
    if BYTE_FLOAT_BITS and any(byte_vector_lane(uop) is not None for uop in uops):
      helpers.append("__device__ __forceinline__ float byte_lane_float(unsigned int bytes, int lane, "
                     "bool is_signed) {\n"
                     "  unsigned int word = bytes ^ (is_signed ? 0x80808080u : 0u);\n"
                     "  return __int_as_float(__byte_perm(0x4B000000u, word, 0x3004u + lane)) - "
                     "(is_signed ? 8388736.0f : 8388608.0f); }\n")
    if any(uop.op is UOps.BITCAST for uop in uops):
      helpers.append("template <class To, class From> __device__ __forceinline__ To bitcast(From value) {\n"
                     "  union { From from; To to; } u; u.from = value; return u.to; }\n")
    for arg in dict.fromkeys(uop.arg for uop in uops if uop.op is UOps.WMMA):
      helpers.append(self.render_mma_helper(arg))
    copied = stored_format_locals(uops)
    if self.dynamic_local_offsets(uops, copied):   # the size the launch reads back, and the array tiles point into
      total = self.dynamic_local_layout(uops, copied)[1]
      helpers.append(f'extern "C" __device__ unsigned int {DYNAMIC_SHARED_SYMBOL} = {total};\n'
                     f"extern __shared__ __align__(16) unsigned char {DYNAMIC_SHARED_ARRAY}[];\n")
    # a kernel compiled for n resident blocks per multiprocessor (UOps.OCCUPANCY) caps its registers to fit them
    blocks = next((uop.arg for uop in uops if uop.op is UOps.OCCUPANCY), 0)
    launch_bounds = f"__launch_bounds__({threads}{f', {blocks}' if blocks else ''}) " if threads > 1 else ""
    signature = f'extern "C" __global__ void {launch_bounds}{name}({", ".join(params)}) {{\n'
    return self._with_prologue("".join(helpers) + signature + "\n".join(body) + "\n}\n")

