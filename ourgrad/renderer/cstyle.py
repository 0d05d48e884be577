"""UOps -> C-like source. `CStyleLanguage` renders the common part; a dialect (here `ClangRenderer` for C on
the CPU) fills in how kernels, buffers, math functions and types are spelled in its language.

Every value gets a name (`val3`, `alu5`, `acc0`, `gidx0`); an ALU result used once is written inline into its
user, so short chains read as one expression.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable

from ourgrad.codegen.uops import SIGNED_BYTES, AxisType, UOp, UOps
from ourgrad.renderer.cbytedot import CLANG_BYTE_DOT, CLANG_LOAD_U16, DotPair, little_endian_pair, split_pair
from ourgrad.dtype import DType, dtypes
from ourgrad.helpers import CPU_VECTORS
from ourgrad.ops import Ops
from ourgrad.renderer import Renderer, cpu_loops
from ourgrad.renderer.cpu_loops import C_PREAMBLE
from ourgrad.renderer.cvector import VectorPlan, elementwise_simd_loop, through_first_loop_nest, vector_typedefs


# CUDA tiles over the 48 KB of static shared memory live in one dynamic array; the kernel's module exports its size
# under this name, which the launch reads (runtime/ops_cuda.py)
DYNAMIC_SHARED_SYMBOL, DYNAMIC_SHARED_ARRAY = "ourgrad_dynamic_shared_bytes", "ourgrad_shared"
NARROW_INTS = frozenset({dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.uint16})


# bfloat16 <-> float, written once for every C-like dialect: a dialect fills in its function qualifier and how it
# reinterprets a float's bits. Rounds to nearest even; a NaN keeps its sign and turns quiet, exactly as
# dtype.float32_to_bfloat16_bits does on the host.
BFLOAT16_HELPERS = """{qualifier}unsigned short float_to_bf16(float value) {{
  unsigned int bits = {float_bits};
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((bits >> 16) | 0x40u);  /* NaN: quiet, sign kept */
  bits += 0x7fffu + ((bits >> 16) & 1u);  /* round to nearest even */
  return (unsigned short)(bits >> 16); }}
{qualifier}float bf16_to_float(unsigned short bits) {{ return {float_from_bits}; }}
{qualifier}float bf16_round(float value) {{ return bf16_to_float(float_to_bf16(value)); }}
"""


@dataclass(frozen=True)
class FloatInRegisters:
  """How a dialect spells a 16-bit float it computes in float registers: templates with `{}` for the operand."""
  to_float: str     # its 16 stored bits -> float
  from_float: str   # float -> its 16 bits, rounded to nearest even
  rounded: str      # float -> float, rounded to its precision


# bfloat16 as every C-like dialect spells it, through BFLOAT16_HELPERS
BFLOAT16_IN_FLOAT = FloatInRegisters("bf16_to_float({})", "float_to_bf16({})", "bf16_round((float)({}))")


def kernel_dtypes(uops: list[UOp]) -> set[DType]:
  """Every dtype a kernel's UOps hold: decides which helper functions its source needs."""
  return {uop.dtype for uop in uops if uop.dtype is not None}


# The first line of a CLANG kernel whose integer arithmetic is all index math (see index_math_only): the runtime then
# compiles it without -fwrapv. Index math never overflows (every index fits the buffer), and without the wrap rule
# the compiler may widen `int` indices to pointer offsets: gcc then vectorizes the matmul register tiles that the
# wrap rule made it give up on (measured 2-10x on single-core float32 matmul kernels).
INDEX_MATH_ONLY = "/* ourgrad: integer math is index math only */\n"


def index_math_only(uops: list[UOp]) -> bool:
  """Every buffer holds floats and no value converts between an integer and a float type: integer UOps then only
  compute indices, loop bounds and masks from them, never data a user sees wrap around."""
  if any(uop.op is UOps.DEFINE_GLOBAL and not uop.dtype.is_float for uop in uops): return False
  for uop in uops:
    if uop.op in (UOps.CAST, UOps.BITCAST) and any(dtype.is_int for dtype in (uop.dtype, uop.srcs[0].dtype)):
      return False
  return True


def block_threads(uops: list[UOp]) -> int:
  """Threads per block of a GPU kernel: the product of its thread (not block) index sizes."""
  threads = 1
  for uop in uops:
    if uop.op is UOps.SPECIAL and uop.arg[3] is not AxisType.GLOBAL: threads *= uop.arg[1]
  return threads


AluRendering = Callable[["CStyleLanguage", list[str], DType], str]


def _infix(symbol: str) -> AluRendering:
  def render(renderer: CStyleLanguage, operands: list[str], dtype: DType) -> str:
    a, b = operands
    # bools computed with & | ^ keep their parentheses: `a & b == c` would bind the comparison first
    if symbol in "&|^" and dtype == dtypes.bool: return f"(({a}){symbol}({b}))"
    return f"({a}{symbol}{b})"
  return render


def _math(name: str) -> AluRendering:
  return lambda renderer, operands, dtype: renderer.math_call(name, dtype, operands[0])


def _max(renderer: CStyleLanguage, operands: list[str], dtype: DType) -> str:
  a, b = operands
  # NaN wins, as in PyTorch; `|` rather than `||` keeps it branch-free (a select, not a jump)
  if dtype.is_float: return f"(((({a})!=({a})) | (({a})>({b}))) ? ({a}) : ({b}))"
  return f"((({a})>({b})) ? ({a}) : ({b}))"


def _divide(symbol: str) -> AluRendering:
  def render(renderer: CStyleLanguage, operands: list[str], dtype: DType) -> str:
    a, b = operands
    # x/0 and MIN/-1 trap the process on x86: give 0 for a zero divisor, and negate (wrapping) for -1
    if b.lstrip("-").isdigit() and int(b) not in (0, -1): return f"({a}{symbol}{b})"
    minus_one = (f"({b}) == -1 ? " + (f"-({a}) : " if symbol == "/" else "0 : ")) if not dtype.is_unsigned else ""
    return f"(({b}) == 0 ? 0 : {minus_one}({a}){symbol}({b}))"
  return render


# how the C family writes each ALU op; a dialect that spells one differently overrides that entry only
C_CODE_FOR_OP: dict[Ops, AluRendering] = {
  Ops.EXP2: _math("exp2"), Ops.LOG2: _math("log2"), Ops.SIN: _math("sin"), Ops.SQRT: _math("sqrt"),
  Ops.RECIP: lambda renderer, x, dtype: f"({renderer.render_const(1, dtype)}/{x[0]})",
  Ops.NEG: lambda renderer, x, dtype: f"(!{x[0]})" if dtype == dtypes.bool else f"(-{x[0]})",
  Ops.MAX: _max, Ops.IDIV: _divide("/"), Ops.MOD: _divide("%"),
  Ops.WHERE: lambda renderer, x, dtype: f"({x[0]} ? {x[1]} : {x[2]})",
  Ops.ADD: _infix("+"), Ops.MUL: _infix("*"), Ops.CMPLT: _infix("<"), Ops.CMPNE: _infix("!="), Ops.AND: _infix("&"),
  Ops.OR: _infix("|"), Ops.XOR: _infix("^"), Ops.SHL: _infix("<<"), Ops.SHR: _infix(">>"),
}


# Scalar float max and select for C on the CPU, written as bit selects on one SIMD lane: gcc turns the `?:` of a
# float compare into a conditional jump, which data with random signs (a GELU's erf, a ReLU's mask) mispredicts
# about half the time (measured: a fused matmul + GELU epilogue about 2x slower with the jumps)
CLANG_SCALAR_SELECTS = (
  "typedef float float1v __attribute__((vector_size(16)));\n"
  "typedef int int1v __attribute__((vector_size(16)));\n"
  "static inline float fsel(bool c, float a, float b) {\n"
  "  int1v keep = {-(int)c}; float1v va = {a}, vb = {b};\n"
  "  return ((float1v)((keep & (int1v)va) | (~keep & (int1v)vb)))[0]; }\n"
  "static inline float fmax_nan(float a, float b) {\n"
  "  float1v va = {a}, vb = {b}; int1v keep = (va != va) | (va > vb);\n"
  "  return ((float1v)((keep & (int1v)va) | (~keep & (int1v)vb)))[0]; }\n"
  "static inline float fbool(bool c) {\n"
  "  int1v keep = {-(int)c}; float1v one = {1.0f};\n"
  "  return ((float1v)(keep & (int1v)one))[0]; }\n")
# the helpers above, by the name a kernel calls them with: a kernel gets them when its body calls one
CLANG_SELECT_HELPERS = ("fsel(", "fmax_nan(", "fbool(")


def _clang_max(renderer: CStyleLanguage, operands: list[str], dtype: DType) -> str:
  """MAX for the CPU: NaN wins (the `_max` rule) without a jump for float32 (and bfloat16, computed in float)."""
  if renderer.render_dtype(dtype) == "float" and renderer.scalar_selects:
    return f"fmax_nan({operands[0]}, {operands[1]})"
  return _max(renderer, operands, dtype)


def _clang_where(renderer: CStyleLanguage, operands: list[str], dtype: DType) -> str:
  """WHERE for the CPU: a float select without a jump. Both sides are computed: they are ALU expressions (loads
  are always statements of their own, gated there), so neither can fault."""
  condition, if_true, if_false = operands
  if renderer.render_dtype(dtype) == "float" and renderer.scalar_selects:
    return f"fsel({condition}, {if_true}, {if_false})"
  return f"({condition} ? {if_true} : {if_false})"


def stored_format_locals(uops: list[UOp]) -> set[int]:
  """Ids of the local memories that hold elements as a buffer stores them (16-bit halves), not as register values:
  those COPYs fill (raw bytes from global memory) or LDMATRIX reads (raw 16-bit rows); a STORE into one converts."""
  return {id(uop.srcs[0]) for uop in uops if uop.op in (UOps.COPY, UOps.LDMATRIX)}


class CStyleLanguage(Renderer):
  """The C family: C on the CPU; OpenCL C and CUDA C subclass this and change the spellings."""
  kernel_prefix = ""
  buffer_prefix = ""
  buffer_suffix = " restrict"
  float_suffix = {dtypes.float32: "f", dtypes.float16: "f", dtypes.bfloat16: "f"}
  preamble = ""
  max_inline_length = 120
  local_prefix = ""     # how a block-shared array is declared (`__shared__ `, `__local `)
  # put before a loop of kind UPCAST/UNROLL (lanes computed side by side, no dependence between iterations: the CPU
  # row kernels' lanes, codegen/row_linearizer.py) so that the compiler vectorizes it
  vector_loop_pragma = ""
  # per kernel, on the copy ClangRenderer.render works on: float max/select as bit-select helpers (off in kernels
  # with lane loops), the elementwise kernel's loop marked `omp simd` (cvector.py), and whether that loop is the
  # kernel's only one (`parallel for simd` when parallel)
  scalar_selects = True
  simd_loop: UOp | None = None
  simd_loop_is_parallel = False
  local_align = ""      # and how it is aligned to 16 bytes (float4 reads of SHARED tiles)
  code_for_op: dict[Ops, AluRendering] = C_CODE_FOR_OP
  # how this dialect spells BFLOAT16_HELPERS: function qualifier, a float's bits (of `value`), a float from 16 bits
  bfloat16_spelling: tuple[str, str, str] = (
    "static inline ", "((union { float f; unsigned int u; }){ .f = value }).u",
    "((union { unsigned int u; float f; }){ .u = (unsigned int)bits << 16 }).f")

  def bfloat16_helpers(self) -> str:
    qualifier, float_bits, float_from_bits = self.bfloat16_spelling
    return BFLOAT16_HELPERS.format(qualifier=qualifier, float_bits=float_bits, float_from_bits=float_from_bits)
  barrier = ""          # the statement that waits for every thread of the block

  # ---------------------------------------------------------------- spellings a dialect may change

  def render_dtype(self, dtype: DType) -> str: return dtype.c_name

  def math_call(self, name: str, dtype: DType, arg: str) -> str:
    """exp2/log2/sin/sqrt for a dtype: float computes in float, double in double, halves through float."""
    if dtype == dtypes.float64: return f"{name}({arg})"
    return f"{name}f({arg})"

  def render_const(self, value: float | int | bool, dtype: DType) -> str:
    if dtype == dtypes.bool: return "1" if value else "0"
    if dtype.is_float:
      if math.isnan(value): text = "NAN"
      elif math.isinf(value): text = "INFINITY" if value > 0 else "(-INFINITY)"
      else: text = repr(float(value)) + ("" if dtype == dtypes.float64 else "f")
      return text if dtype in (dtypes.float32, dtypes.float64) else f"(({self.render_dtype(dtype)}){text})"
    if dtype == dtypes.int64: return f"{int(value)}ll"
    if dtype == dtypes.uint64: return f"{int(value)}ull"
    if dtype == dtypes.uint32: return f"{int(value)}u"
    if dtype == dtypes.int32 and value == -2**31: return "(-2147483647-1)"
    if dtype == dtypes.int32: return str(int(value))
    return f"(({self.render_dtype(dtype)}){int(value)})"

  # Dtypes a language cannot compute in (bfloat16 in C, halves in OpenCL and NVRTC without headers) live in float
  # registers: `memory_type` says how buffers store them, `floats_in_registers` how the dialect converts them at loads
  # and stores and rounds a cast result to their precision. The defaults are for dtypes the language has.
  floats_in_registers: dict[DType, FloatInRegisters] = {}
  # byte dtypes whose vectors a dialect keeps in words (CUDA): a lane of one is read by render_vector_element
  byte_vector_names: dict[DType, str] = {}

  def memory_type(self, dtype: DType) -> str: return self.render_dtype(dtype)

  def read_element(self, buffer: str, index: str, dtype: DType) -> str:
    narrow = self.floats_in_registers.get(dtype)
    return narrow.to_float.format(f"{buffer}[{index}]") if narrow else f"{buffer}[{index}]"

  def write_element(self, buffer: str, index: str, value: str, dtype: DType) -> str:
    narrow = self.floats_in_registers.get(dtype)
    return f"{buffer}[{index}] = {narrow.from_float.format(value) if narrow else value};"

  def round_to(self, dtype: DType, value: str) -> str | None:
    narrow = self.floats_in_registers.get(dtype)
    return narrow.rounded.format(value) if narrow else None

  def render_cast(self, value: str, from_dtype: DType, to_dtype: DType) -> str:
    rounded = self.round_to(to_dtype, value)
    if rounded is not None: return rounded
    if to_dtype == dtypes.bool: return f"({value} != 0)"
    return f"(({self.render_dtype(to_dtype)})({value}))"

  @property
  def float_register_dtypes(self) -> frozenset[DType]:
    """The dtypes this dialect keeps in float registers (see memory_type): a bitcast goes through their 16 bits."""
    return frozenset(self.floats_in_registers)

  def bits_of(self, dtype: DType, value: str) -> str: return self.floats_in_registers[dtype].from_float.format(value)
  def from_bits(self, dtype: DType, bits: str) -> str: return self.floats_in_registers[dtype].to_float.format(bits)

  def reinterpret(self, value: str, from_dtype: DType, to_dtype: DType) -> str:
    """A bitcast between two types the language has."""
    source, target = self.render_dtype(from_dtype), self.render_dtype(to_dtype)
    return f"((union {{ {source} from; {target} to; }}){{ .from = {value} }}).to"

  def render_bitcast(self, value: str, from_dtype: DType, to_dtype: DType) -> str:
    widened = self.float_register_dtypes
    if from_dtype not in widened and to_dtype not in widened: return self.reinterpret(value, from_dtype, to_dtype)
    bits = self.bits_of(from_dtype, value) if from_dtype in widened else \
      self.reinterpret(value, from_dtype, dtypes.uint16)
    return self.from_bits(to_dtype, bits) if to_dtype in widened else self.reinterpret(bits, dtypes.uint16, to_dtype)

  def render_load(self, buffer: str, index: str, valid: str | None, dtype: DType) -> str:
    loaded = self.read_element(buffer, index, dtype)
    return loaded if valid is None else f"(({valid}) ? {loaded} : {self.render_const(0, dtype)})"

  def render_store(self, buffer: str, index: str, value: str, dtype: DType) -> str:
    return self.write_element(buffer, index, value, dtype)

  def render_alu(self, op: Ops, dtype: DType, operands: list[str], operand_dtypes: list[DType]) -> str:
    """`op` on rendered operands, looked up in the dialect's `code_for_op` table."""
    if op not in self.code_for_op: raise NotImplementedError(f"{type(self).__name__} cannot render {op}")
    return self.code_for_op[op](self, operands, dtype)

  def render_kernel(self, name: str, params: list[str], body: list[str], uops: list[UOp]) -> str:
    return f"{self.preamble}{self.kernel_prefix}void {name}({', '.join(params)}) {{\n" + "\n".join(body) + "\n}\n"

  def render_param(self, uop: UOp, name: str) -> str:
    index, is_output = uop.arg
    const = "" if is_output else "const "
    return f"{self.buffer_prefix}{const}{self.memory_type(uop.dtype)}*{self.buffer_suffix} {name}"

  def render_var_param(self, name: str) -> str:
    """A symbolic Variable's kernel argument (DEFINE_VAR): an int passed by value after the buffers."""
    return f"const int {name}"

  # ---------------------------------------------------------------- the walk over the UOps

  def render(self, name: str, uops: list[UOp]) -> str:
    names: dict[int, str] = {}
    params: list[str] = []
    body: list[str] = []
    depth = 1
    counters: dict[str, int] = {}

    def new_name(prefix: str) -> str:
      counters[prefix] = counters.get(prefix, 0) + 1
      return f"{prefix}{counters[prefix] - 1}"

    def ref(uop: UOp) -> str: return names[id(uop)]

    def emit(line: str) -> None: body.append("  " * depth + line)

    def define(uop: UOp, prefix: str, expression: str) -> None:
      variable = new_name(prefix)
      emit(f"{self.render_dtype(uop.dtype)} {variable} = {expression};")
      names[id(uop)] = variable


    parallel_loops = self.parallel_loop_count(uops)
    unrolled_loops = self.unrolled_loops(uops)
    vectors = self.vector_plan(uops)
    raw_loads = self.raw_fragment_loads(uops)
    vector_locals = {id(uop.srcs[0]) for uop in uops
                     if uop.op is UOps.LOAD and uop.arg is not None and uop.srcs[0].op is UOps.DEFINE_LOCAL}
    copied_locals = stored_format_locals(uops)
    dynamic_offsets = self.dynamic_local_offsets(uops, copied_locals)
    rounded_by_store = self.casts_rounded_by_stores(uops)
    for uop in uops:
      if uop.op is UOps.DEFINE_GLOBAL:
        names[id(uop)] = f"data{uop.arg[0]}"
        params.append(self.render_param(uop, names[id(uop)]))
      elif uop.op is UOps.DEFINE_VAR:
        names[id(uop)] = uop.arg[0]
        params.append(self.render_var_param(uop.arg[0]))
      elif uop.op is UOps.CONST:
        names[id(uop)] = self.render_const(uop.arg, uop.dtype)
      elif uop.op is UOps.RANGE:
        variable, kind = uop.arg
        names[id(uop)] = variable
        if parallel_loops and kind is AxisType.GLOBAL and depth == 1:
          emit(self.parallel_pragma(parallel_loops))
        elif (kind in (AxisType.UPCAST, AxisType.UNROLL) or uop is self.simd_loop) and self.vector_loop_pragma:
          emit(self.loop_pragma(uop))
        elif id(uop) in unrolled_loops:
          emit("#pragma unroll")
        emit(f"for (int {variable} = {ref(uop.srcs[0])}; {variable} < {ref(uop.srcs[1])}; {variable}++) {{")
        depth += 1
      elif uop.op is UOps.ENDRANGE:
        depth -= 1
        emit("}")
      elif uop.op is UOps.SPECIAL:
        names[id(uop)] = uop.arg[0]
        emit(f"int {uop.arg[0]} = {self.render_special(uop.arg)};  /* 0..{uop.arg[1] - 1} */")
      elif uop.op is UOps.LOAD and uop.srcs[0].op is UOps.DEFINE_LOCAL and uop.arg is not None:   # a tile's float4
        variable = new_name("vec")
        names[id(uop)] = variable
        emit(f"{self.render_dtype(uop.dtype)}{uop.arg} {variable} = "
             f"{self.render_local_vector_load(ref(uop.srcs[0]), ref(uop.srcs[1]), uop.arg, uop.dtype)};")
      elif uop.op is UOps.LOAD and uop.srcs[0].op is UOps.DEFINE_LOCAL:
        define(uop, "val", f"{ref(uop.srcs[0])}[{ref(uop.srcs[1])}]")  # local memory holds register values
      elif uop.op is UOps.LOAD and uop.arg == 2 and id(uop) in raw_loads:   # two fragment elements in one register
        variable = new_name("vec")
        names[id(uop)] = variable
        emit(f"unsigned {variable} = *((const unsigned*)({ref(uop.srcs[0])}+({ref(uop.srcs[1])})));")
      elif uop.op is UOps.LDMATRIX:
        variable = new_name("frag")
        names[id(uop)] = variable
        for line in self.render_ldmatrix(variable, uop, ref(uop.srcs[0]), ref(uop.srcs[1])): emit(line)
      elif uop.op is UOps.GEP and uop.srcs[0].op is UOps.LDMATRIX and uop.dtype.itemsize == 4:   # a TF32 register
        names[id(uop)] = f"__uint_as_float({ref(uop.srcs[0])}_{uop.arg})"
      elif uop.op is UOps.GEP and uop.srcs[0].op is UOps.LDMATRIX:   # one 16-bit half of a fragment register
        names[id(uop)] = f"((unsigned short)({ref(uop.srcs[0])}_{uop.arg // 2} >> {16 * (uop.arg % 2)}))"
      elif uop.op is UOps.COPY:
        valid = ref(uop.srcs[4]) if len(uop.srcs) > 4 else None
        emit(self.render_copy(uop, ref(uop.srcs[0]), ref(uop.srcs[1]), ref(uop.srcs[2]), ref(uop.srcs[3]), valid))
      elif uop.op is UOps.ASYNC_WAIT:
        emit(self.render_async_wait(uop.arg))
      elif uop.op is UOps.ATOMIC_ADD:
        define(uop, "old", self.render_atomic_add(ref(uop.srcs[0]), ref(uop.srcs[1]), ref(uop.srcs[2])))
      elif uop.op is UOps.COHERENT_LOAD:
        define(uop, "val", self.render_coherent_load(ref(uop.srcs[0]), ref(uop.srcs[1])))
      elif uop.op is UOps.FENCE:
        emit(self.render_fence())
      elif uop.op is UOps.OCCUPANCY: continue   # read by render_kernel (launch bounds), no code
      elif uop.op is UOps.GEP and id(uop) in raw_loads:
        names[id(uop)] = f"((unsigned short)({ref(uop.srcs[0])} >> {16 * uop.arg}))"
      elif uop.op is UOps.LOAD and id(uop) in raw_loads:   # kept as stored (a tensor-core fragment element)
        variable, loaded = new_name("val"), f"{ref(uop.srcs[0])}[{ref(uop.srcs[1])}]"
        memory = self.memory_type(uop.dtype)
        if len(uop.srcs) > 2: loaded = f"(({ref(uop.srcs[2])}) ? {loaded} : ({memory})0)"
        emit(f"{memory} {variable} = {loaded};")
        names[id(uop)] = variable
      elif uop.op is UOps.LOAD and uop.arg is not None:
        variable = new_name("vec")
        names[id(uop)] = variable
        loaded = self.render_vector_load(ref(uop.srcs[0]), ref(uop.srcs[1]), uop.arg, uop.dtype)
        # a gated vector (a cat's piece): zeros where the gate is false, and no memory touched
        if len(uop.srcs) > 2:
          loaded = f"(({ref(uop.srcs[2])}) ? {loaded} : {self.render_vector_zero(uop.arg, uop.dtype)})"
        emit(f"{self.render_vector_type(uop.arg, uop.dtype)} {variable} = {loaded};")
      elif uop.op is UOps.GEP and uop.srcs[0].op is UOps.LOAD and (uop.srcs[0].srcs[0].op is UOps.DEFINE_GLOBAL or
                                                                    uop.dtype in self.byte_vector_names):
        names[id(uop)] = self.render_vector_element(ref(uop.srcs[0]), uop.arg, uop.dtype)
      elif uop.op is UOps.GEP:
        names[id(uop)] = f"{ref(uop.srcs[0])}.{'xyzw'[uop.arg]}"
      elif uop.op is UOps.LOAD:
        valid = ref(uop.srcs[2]) if len(uop.srcs) > 2 else None
        define(uop, "val", self.render_load(ref(uop.srcs[0]), ref(uop.srcs[1]), valid, uop.dtype))
      elif uop.op is UOps.STORE and uop.arg is not None:
        emit(self.render_vector_store(ref(uop.srcs[0]), ref(uop.srcs[1]), [ref(src) for src in uop.srcs[2:]],
                                      uop.srcs[2].dtype))
      elif uop.op is UOps.STORE:
        # local memory holds register values, except where it holds elements as stored (stored_format_locals)
        raw_local = uop.srcs[0].op is UOps.DEFINE_LOCAL and id(uop.srcs[0]) not in copied_locals
        if raw_local: store = f"{ref(uop.srcs[0])}[{ref(uop.srcs[1])}] = {ref(uop.srcs[2])};"
        else: store = self.render_store(ref(uop.srcs[0]), ref(uop.srcs[1]), ref(uop.srcs[2]), uop.srcs[2].dtype)
        emit(store if len(uop.srcs) < 4 else f"if ({ref(uop.srcs[3])}) {{ {store} }}")
      elif uop.op is UOps.DEFINE_LOCAL:
        names[id(uop)] = uop.arg[0]
        # 16-byte aligned where it is read as float4 (a SHARED tile: its vector indices are multiples of 4)
        align = self.local_align if id(uop) in vector_locals | copied_locals else ""
        # a tile that COPYs fill or LDMATRIX reads holds the bits as stored (16-bit halves), not register values
        element = self.memory_type(uop.dtype) if id(uop) in copied_locals else self.render_dtype(uop.dtype)
        if id(uop) in dynamic_offsets:   # a pointer into the dynamic shared memory (tiles over the static limit)
          emit(f"{element}* {uop.arg[0]} = ({element}*)({DYNAMIC_SHARED_ARRAY} + {dynamic_offsets[id(uop)]});")
        else: emit(f"{self.local_prefix}{align}{element} {uop.arg[0]}[{uop.arg[1]}];")
      elif uop.op is UOps.BARRIER:
        emit(self.barrier)
      elif uop.op is UOps.IF:
        emit(f"if ({ref(uop.srcs[0])}) {{")
        depth += 1
      elif uop.op is UOps.ENDIF:
        depth -= 1
        emit("}")
      elif uop.op is UOps.WARP_REDUCE:
        variable = new_name("warp")
        names[id(uop)] = variable
        emit(f"{self.render_dtype(uop.dtype)} {variable} = {ref(uop.srcs[0])};")
        for line in self.render_warp_reduce(variable, uop, uops): emit(line)
      elif uop.op is UOps.WMMA:
        emit(self.render_wmma(uop, [ref(src) for src in uop.srcs], [id(src) in raw_loads for src in uop.srcs]))
      elif uop.op is UOps.DEFINE_ACC and id(uop) in vectors.lane_of:   # a lane of a vector accumulator
        vector, lane = vectors.lane_of[id(uop)]
        if lane == 0: emit(vectors.accumulator(uop, self.render_const(uop.arg, uop.dtype)))
        names[id(uop)] = f"{vector}[{lane}]"
      elif uop.op is UOps.DEFINE_ACC:
        define(uop, "acc", self.render_const(uop.arg, uop.dtype))
      elif uop.op is UOps.ACCUMULATE and id(uop) in vectors.skipped:
        continue   # done by lane 0's vector update
      elif uop.op is UOps.ACCUMULATE and id(uop) in vectors.updates:
        emit(vectors.update(uop, ref))
      elif uop.op is UOps.ACCUMULATE:
        acc, value = uop.srcs
        combined = self.render_alu(uop.arg, acc.dtype, [ref(acc), ref(value)], [acc.dtype, value.dtype])
        emit(f"{ref(acc)} = {combined};")
      elif uop.op is UOps.DOT_LANES:
        variable = new_name("lanes")
        names[id(uop)] = variable
        emit(f"og_dot_lanes {variable} = og_lanes_zero();")
      elif uop.op is UOps.BYTE_DOT_ADD:
        emit(f"{ref(uop.srcs[0])} = {self.render_byte_dot_add(uop, ref)};")
      elif uop.op is UOps.LANES_TOTAL:
        define(uop, "total", f"og_lanes_total({ref(uop.srcs[0])})")
      elif id(uop) in rounded_by_store:   # the store's own conversion rounds it
        names[id(uop)] = ref(uop.srcs[0])
      elif uop.op in (UOps.ALU, UOps.CAST, UOps.BITCAST):
        expression = self._expression(uop, ref)
        # a value used once is written inline into its user, unless the expression is already long: long
        # chains would otherwise nest without bound (and copying ever longer strings is quadratic)
        if uop.uses == 1 and uop.op is not UOps.BITCAST and len(expression) <= self.max_inline_length:
          names[id(uop)] = expression
        else: define(uop, "alu" if uop.op is UOps.ALU else "cast", expression)
      else:
        raise NotImplementedError(f"{type(self).__name__} cannot render {uop.op}")
    source = self.render_kernel(name, params, body, uops)
    return source.replace(self.preamble, self.preamble + vector_typedefs(vectors.width), 1) if vectors else source

  def casts_rounded_by_stores(self, uops: list[UOp]) -> set[int]:
    """The CASTs of a float32 value to a 16-bit float kept in float registers whose one use is a store to a global
    buffer: the store converts it to its bits, rounding it itself (rounding twice to one precision is rounding once),
    so the cast renders as its operand (2 SASS instructions an element of a bf16 gradient on CUDA)."""
    rounded = set()
    for uop in uops:
      if uop.op is not UOps.STORE or uop.srcs[0].op is not UOps.DEFINE_GLOBAL: continue
      values = uop.srcs[2:] if uop.arg is not None else uop.srcs[2:3]
      rounded.update(id(value) for value in values if value.op is UOps.CAST and value.uses == 1 and
                     value.dtype in self.floats_in_registers and value.srcs[0].dtype == dtypes.float32)
    return rounded

  def vector_plan(self, uops: list[UOp]) -> VectorPlan:
    """The accumulators rendered as lanes of explicit vectors (renderer/cvector.py); none unless a dialect says."""
    return VectorPlan(uops, 0)

  def _expression(self, uop: UOp, ref: Callable[[UOp], str]) -> str:
    operands = [ref(src) for src in uop.srcs]
    if uop.op is UOps.CAST: return self.render_cast(operands[0], uop.srcs[0].dtype, uop.dtype)
    if uop.op is UOps.BITCAST: return self.render_bitcast(operands[0], uop.srcs[0].dtype, uop.dtype)
    expression = self.render_alu(uop.arg, uop.dtype, operands, [src.dtype for src in uop.srcs])
    # C computes narrow integers as int: wrap the result back to its own type before anything else reads it
    if uop.dtype in NARROW_INTS: expression = f"(({self.render_dtype(uop.dtype)}){expression})"
    return expression

  def render_special(self, arg: tuple) -> str: raise NotImplementedError

  def render_vector_load(self, buffer: str, index: str, width: int, dtype: DType) -> str:
    raise NotImplementedError(f"{type(self).__name__} has no vector loads")

  def render_vector_store(self, buffer: str, index: str, values: list[str], dtype: DType) -> str:
    raise NotImplementedError(f"{type(self).__name__} has no vector stores")

  def render_vector_zero(self, width: int, dtype: DType) -> str:
    """A `width`-wide vector of zeros (a gated vector load's value where its gate is false)."""
    raise NotImplementedError(f"{type(self).__name__} has no vector loads")

  def render_vector_type(self, width: int, dtype: DType) -> str:
    """The type of a variable holding a `width`-wide vector loaded from a buffer of `dtype`."""
    return f"{self.render_dtype(dtype)}{width}"

  def render_vector_element(self, vector: str, element: int, dtype: DType) -> str:
    """Element `element` of a vector loaded from a buffer of `dtype`, as a register value."""
    return f"{vector}.{'xyzw'[element]}"

  def render_local_vector_load(self, buffer: str, index: str, width: int, dtype: DType) -> str:
    return self.render_vector_load(buffer, index, width, dtype).replace("const ", "")

  def render_warp_reduce(self, variable: str, uop: UOp, uops: list[UOp]) -> list[str]:
    raise NotImplementedError(f"{type(self).__name__} has no warp shuffles")

  def dynamic_local_offsets(self, uops: list[UOp], copied_locals: set[int]) -> dict[int, int]:
    """Byte offsets in dynamic shared memory of the local memories, by id, where the renderer has it and the tiles
    exceed the static limit (CUDA); none here."""
    return {}

  def render_copy(self, uop: UOp, local: str, local_index: str, buffer: str, index: str, valid: str | None) -> str:
    raise NotImplementedError(f"{type(self).__name__} has no tile copies")

  def render_async_wait(self, keep: int) -> str:
    raise NotImplementedError(f"{type(self).__name__} has no asynchronous copies")

  def render_atomic_add(self, buffer: str, index: str, value: str) -> str:
    """An expression adding `value` to buffer[index] atomically, whose value is the element before the add."""
    raise NotImplementedError(f"{type(self).__name__} has no atomics")

  def render_coherent_load(self, buffer: str, index: str) -> str:
    """A load of buffer[index] that bypasses this block's cache (what other blocks stored and fenced)."""
    raise NotImplementedError(f"{type(self).__name__} has no coherent loads")

  def render_fence(self) -> str:
    """The statement after which this thread's global stores are visible to every block."""
    raise NotImplementedError(f"{type(self).__name__} has no memory fence")

  def render_ldmatrix(self, variable: str, uop: UOp, local: str, index: str) -> list[str]:
    raise NotImplementedError(f"{type(self).__name__} has no ldmatrix")

  def render_wmma(self, uop: UOp, operands: list[str], raw: list[bool]) -> str:
    raise NotImplementedError(f"{type(self).__name__} has no tensor cores")

  def raw_fragment_loads(self, uops: list[UOp]) -> set[int]:
    """Ids of the LOADs a dialect renders as the bits they are stored as (for its tensor-core instructions)."""
    return set()

  def parallel_loop_count(self, uops: list[UOp]) -> int:
    """How many outer global loops to run on several threads (0: none). Only CPU dialects parallelize."""
    return 0

  def parallel_pragma(self, loop_count: int) -> str: return ""

  def unrolled_loops(self, uops: list[UOp]) -> set[int]:
    """Ids of the RANGEs the compiler is told to unroll fully (`#pragma unroll`); the GPU dialect picks some."""
    return set()

  def loop_pragma(self, loop: UOp) -> str:
    """The pragma put before a vectorized loop (vector_loop_pragma)."""
    return self.vector_loop_pragma


class ClangRenderer(CStyleLanguage):
  """C for the CPU (gcc or clang): loops for every axis, `restrict` pointers, libm functions (C_PREAMBLE).

  C compilers do not all do arithmetic on bfloat16, so a bfloat16 value lives in a float register: loads
  widen the stored 16 bits, casts to bfloat16 round to its precision, and stores keep the top 16 bits."""
  device = "CLANG"
  carries_riders = True   # a rider runs after the kernel's loops (engine/ride_along.py)
  preamble = C_PREAMBLE
  code_for_op = {**C_CODE_FOR_OP, Ops.MAX: _clang_max, Ops.WHERE: _clang_where}
  # below this many loop iterations times instructions, starting threads costs more than it saves
  parallel_min_work = 1 << 17
  # the width of the SIMD registers the C compiler targets (16: SSE/NEON, 32: AVX2, 64: AVX-512); the runtime sets
  # it from the compiler's -march=native macros. The CPU matmul heuristic sizes its register tiles by it.
  vector_bytes = 16
  vector_registers = 16   # SIMD registers of the target (32 with AVX-512 or NEON; the runtime sets it)
  # DEFINE_LOCAL is a plain C array where it is declared (inside a loop body: one per iteration, private to its thread)
  has_stack_arrays = True
  # vectorized even where the loop vectorizer is off (gcc 12, ops_clang.FLAG_RULES); allows no reordering
  vector_loop_pragma = "#pragma omp simd"
  # BYTE_DOT_ADD: integer products of bytes as SIMD byte multiply-adds (codegen/integer_rows.py byte_dots)
  byte_dot_products = True

  # the OpenMP choices (renderer/cpu_loops.py), from this kernel's `omp simd` loop and the target's SIMD width
  def parallel_loop_count(self, uops: list[UOp]) -> int:
    return cpu_loops.parallel_loop_count(uops, self.simd_loop, max(self.vector_bytes // 4, 1), self.parallel_min_work)

  def loop_pragma(self, loop: UOp) -> str:
    return cpu_loops.simd_loop_pragma(loop, self.simd_loop, self.vector_bytes // 4, self.vector_loop_pragma)

  def parallel_pragma(self, loop_count: int) -> str:
    return cpu_loops.parallel_pragma(loop_count, self.simd_loop_is_parallel)

  def render(self, name: str, uops: list[UOp]) -> str:
    # this kernel's choices live on a copy, so the device's one renderer holds no per-kernel state
    kernel_renderer = copy.copy(self)
    kernel_renderer._choose_loops_and_selects(uops)
    return CStyleLanguage.render(kernel_renderer, name, uops)

  def _choose_loops_and_selects(self, uops: list[UOp]) -> None:
    # An elementwise kernel whose integers are index math only runs its innermost loop as an `omp simd` loop (gcc 12's
    # loop vectorizer is otherwise off, ops_clang.FLAG_RULES): the MNIST step's batchnorm-backward elementwise
    # kernel took 2.3 ms instead of 4.1 with 4 unrolled scalar outputs (one core, same data)
    self.simd_loop = elementwise_simd_loop(uops) if index_math_only(uops) else None
    self.simd_loop_is_parallel = self.simd_loop is not None and \
      sum(uop.op is UOps.RANGE for uop in through_first_loop_nest(uops)) == 1
    # A kernel with `omp simd` lane loops (a CPU row kernel) keeps the plain `?:` max and select: gcc if-converts them
    # inside the vectorized loop, while the bit-select helpers are calls it leaves scalar (softmax 4096^2 on 2 cores:
    # 40 ms with the helpers, PyTorch 20 ms). Elsewhere the helpers save mispredicted jumps (CLANG_SCALAR_SELECTS).
    self.scalar_selects = self.simd_loop is None and not any(
      uop.op is UOps.RANGE and uop.arg[1] in (AxisType.UPCAST, AxisType.UNROLL) for uop in uops)

  def vector_plan(self, uops: list[UOp]) -> VectorPlan:
    """Register tiles as explicit vectors of one SIMD register (renderer/cvector.py: gcc's own vectorizer drops
    whole tiles). CPU_VECTORS=0 leaves them to the compiler."""
    return VectorPlan(uops, self.vector_bytes // 4 if CPU_VECTORS.value else 0)

  def render_dtype(self, dtype: DType) -> str:
    return "float" if dtype == dtypes.bfloat16 else dtype.c_name

  def render_cast(self, value: str, from_dtype: DType, to_dtype: DType) -> str:
    # a float compare cast to float (a ReLU's or max-pool's backward mask): gcc folds `(float)(a != b)` into
    # `a != b ? 1.0f : 0.0f` and branches on it, which masks of random signs mispredict half the time (measured
    # on the MNIST step's batchnorm backward: 15.4 ms with the jumps, 4.2 ms with the bit select, same data)
    if from_dtype == dtypes.bool and to_dtype == dtypes.float32 and self.scalar_selects: return f"fbool({value})"
    return super().render_cast(value, from_dtype, to_dtype)

  def render_byte_dot_add(self, uop: UOp, ref: Callable[[UOp], str]) -> str:
    """A BYTE_DOT_ADD as calls of the CLANG_BYTE_DOT helpers: each pair's lanes added into SIMD int32 partial sums,
    then those times the factor added into the float lanes. Unsigned pairs go two at a time (`og_dot_add2`: a Q4
    block's low and high nibbles, one 256-bit multiply-add where the target has AVX2; `og_dot_add_split` where both
    read the same bytes against adjacent activations: cbytedot.split_pair)."""
    count, selects = uop.arg
    sums = "og_dot_start()"
    pairs = [((shift, mask), *operands) for (shift, mask), operands in zip(selects, zip(*[iter(uop.srcs[2:])] * 4))]
    waiting: list[DotPair] = []   # an unsigned pair, until a second one joins it

    def operands(pair: DotPair) -> str:
      (shift, mask), u_buffer, u_index, s_buffer, s_index = pair
      return f"{ref(u_buffer)} + {ref(u_index)}, {shift}, {mask}, {ref(s_buffer)} + {ref(s_index)}"
    for pair in pairs:
      (shift, _), u_buffer, u_index, s_buffer, s_index = pair
      if shift == SIGNED_BYTES:
        sums = (f"og_dot_add_s8({sums}, (const signed char*)({ref(u_buffer)} + {ref(u_index)}), "
                f"{ref(s_buffer)} + {ref(s_index)}, {count})")
      elif not waiting: waiting.append(pair)
      elif (split := split_pair(first := waiting.pop(), pair, count)) is not None:   # one load of the bytes
        sums = (f"og_dot_add_split({sums}, {ref(first[1])} + {ref(first[2])}, {split[0]}, {split[1]}, {split[2]}, "
                f"{ref(first[3])} + {ref(first[4])}, {count})")
      else: sums = f"og_dot_add2({sums}, {operands(first)}, {operands(pair)}, {count})"
    if waiting: sums = f"og_dot_add({sums}, {operands(waiting.pop())}, {count})"
    return f"og_lanes_add({ref(uop.srcs[0])}, {sums}, {ref(uop.srcs[1])})"

  def render_kernel(self, name: str, params: list[str], body: list[str], uops: list[UOp]) -> str:
    source = super().render_kernel(name, params, body, uops)
    if any(uop.op is UOps.DOT_LANES for uop in uops):
      source = source.replace(self.preamble, self.preamble + CLANG_BYTE_DOT, 1)
    if "og_load_u16(" in source: source = source.replace(self.preamble, self.preamble + CLANG_LOAD_U16, 1)
    if index_math_only(uops): source = INDEX_MATH_ONLY + source
    if any(helper in source for helper in CLANG_SELECT_HELPERS):
      source = source.replace(self.preamble, self.preamble + CLANG_SCALAR_SELECTS, 1)
    if dtypes.bfloat16 not in kernel_dtypes(uops): return source
    return source.replace(self.preamble, self.preamble + self.bfloat16_helpers(), 1)

  floats_in_registers = {dtypes.bfloat16: BFLOAT16_IN_FLOAT}

  def memory_type(self, dtype: DType) -> str:
    return "unsigned short" if dtype == dtypes.bfloat16 else super().memory_type(dtype)

  def _expression(self, uop: UOp, ref: Callable[[UOp], str]) -> str:
    # two neighbouring bytes assembled little-endian: one 2-byte load (renderer/cbytedot.py CLANG_LOAD_U16)
    pair = little_endian_pair(uop)
    if pair is not None: return f"og_load_u16({ref(pair[0])} + {ref(pair[1])})"
    return super()._expression(uop, ref)


class OpenCLRenderer(CStyleLanguage):
  """OpenCL C: one work-group per block, get_group_id/get_local_id as thread indices, overloaded math builtins.

  Kernel arguments cannot be `bool*`, so bool buffers travel as uchar. Half-precision values live in float
  registers: float16 buffers are read and written with the core vload_half/vstore_half_rte (no cl_khr_fp16
  needed), bfloat16 travels as ushort as on the CPU."""
  device = "OPENCL"
  has_threads = True
  max_threads = 256
  has_local = True
  local_memory_bytes = 32768  # the minimum OpenCL guarantees for a full-profile device
  local_prefix = "__local "
  local_align = "__attribute__((aligned(16))) "
  barrier = "barrier(CLK_LOCAL_MEM_FENCE);"
  bfloat16_spelling = ("", "as_uint(value)", "as_float(((uint)bits) << 16)")
  vector_width = 4

  def render_vector_load(self, buffer: str, index: str, width: int, dtype: DType) -> str:
    return f"vload{width}(0, {buffer}+({index}))"

  def render_vector_store(self, buffer: str, index: str, values: list[str], dtype: DType) -> str:
    vector = f"({self.render_dtype(dtype)}{len(values)})({', '.join(values)})"
    return f"vstore{len(values)}({vector}, 0, {buffer}+({index}));"

  def render_vector_zero(self, width: int, dtype: DType) -> str:
    return f"({self.render_dtype(dtype)}{width})({self.render_const(0, dtype)})"
  kernel_prefix = "__kernel "
  buffer_prefix = "__global "
  buffer_suffix = " restrict"
  preamble = ""
  type_names = {"bool": "bool", "int8": "char", "uint8": "uchar", "int16": "short", "uint16": "ushort",
                "int32": "int", "uint32": "uint", "int64": "long", "uint64": "ulong", "float16": "float",
                "bfloat16": "float", "float32": "float", "float64": "double"}

  def render_dtype(self, dtype: DType) -> str: return self.type_names[dtype.name]

  def memory_type(self, dtype: DType) -> str:
    """How a buffer of `dtype` is declared (what a kernel argument may point to)."""
    return {"bool": "uchar", "bfloat16": "ushort", "float16": "half"}.get(dtype.name, self.render_dtype(dtype))

  def math_call(self, name: str, dtype: DType, arg: str) -> str: return f"{name}({arg})"

  def render_const(self, value: float | int | bool, dtype: DType) -> str:
    if dtype == dtypes.float16: return super().render_const(value, dtypes.float32)
    if dtype == dtypes.int64:
      return f"((long){int(value)}l)" if value != -2**63 else "((long)(-9223372036854775807l-1))"
    if dtype == dtypes.uint64: return f"((ulong){int(value)}ul)"
    return super().render_const(value, dtype)

  # halves through the helpers of render_kernel (loads and stores use vload_half/vstore_half_rte instead)
  floats_in_registers = {
    dtypes.float16: FloatInRegisters("half_from_bits({})", "half_bits({})", "half_round((float)({}))"),
    dtypes.bfloat16: BFLOAT16_IN_FLOAT}

  def read_element(self, buffer: str, index: str, dtype: DType) -> str:
    if dtype == dtypes.bool: return f"({buffer}[{index}] != 0)"
    if dtype == dtypes.float16: return f"vload_half({index}, {buffer})"   # no cl_khr_fp16 needed
    return super().read_element(buffer, index, dtype)

  def write_element(self, buffer: str, index: str, value: str, dtype: DType) -> str:
    if dtype == dtypes.bool: return f"{buffer}[{index}] = (uchar)({value});"
    if dtype == dtypes.float16: return f"vstore_half_rte({value}, {index}, {buffer});"
    return super().write_element(buffer, index, value, dtype)

  def reinterpret(self, value: str, from_dtype: DType, to_dtype: DType) -> str:
    if dtypes.bool in (from_dtype, to_dtype):
      raise NotImplementedError(f"bitcast between {from_dtype} and {to_dtype} on OpenCL")
    return f"as_{self.render_dtype(to_dtype)}({value})"

  def render_special(self, arg: tuple) -> str:
    _, _, dimension, kind = arg
    return f"get_group_id({dimension})" if kind is AxisType.GLOBAL else f"get_local_id({dimension})"

  def render_kernel(self, name: str, params: list[str], body: list[str], uops: list[UOp]) -> str:
    source = super().render_kernel(name, params, body, uops)
    used, extensions = kernel_dtypes(uops), []
    if dtypes.float16 in used:
      extensions.append("ushort half_bits(float value) {\n"
                        "  ushort bits; vstore_half_rte(value, 0, (__private half*)&bits); return bits; }\n"
                        "float half_from_bits(ushort bits) { return vload_half(0, (__private const half*)&bits); }\n"
                        "float half_round(float value) { return half_from_bits(half_bits(value)); }\n")
    if dtypes.float64 in used: extensions.append("#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n")
    if dtypes.bfloat16 in used: extensions.append(self.bfloat16_helpers())
    return "".join(extensions) + source
