"""UOps -> LLVM IR text for the LLVM device: one `void @name(ptr noalias %data0, ...)` function per kernel.

Loops are basic blocks with a phi for the counter (head: test, body, latch: increment). Accumulators live in
allocas of the entry block; LLVM's SROA/mem2reg promotes them to registers, so the renderer never has to place
phis for them. Every value gets an SSA name `%vN`; constants are written inline.

Types: bool is `i1` in registers and one byte in memory, float16 is LLVM `half` (each op rounds to half, as
PyTorch does op by op), and bfloat16 is stored as its 16 bits and computed in `float`, like the C renderer:
loads widen the bits, casts to bfloat16 and stores round to nearest even. The IR has no fast-math flags, so
NaN and infinities behave as IEEE (and PyTorch) say; integer division never traps and shifts never make poison.
"""
from __future__ import annotations

import math
import struct

import numpy as np

from ourgrad.codegen.uops import AxisType, UOp, UOps
from ourgrad.dtype import DType, dtypes, to_bfloat16
from ourgrad.ops import COMPARISON_OPS, Ops
from ourgrad.renderer import Renderer

# the LLVM type of a value in registers
REGISTER_TYPES: dict[str, str] = {
  "bool": "i1", "int8": "i8", "uint8": "i8", "int16": "i16", "uint16": "i16", "int32": "i32", "uint32": "i32",
  "int64": "i64", "uint64": "i64", "float16": "half", "bfloat16": "float", "float32": "float", "float64": "double",
}
# the LLVM type of an element in memory, where it differs from the register type
MEMORY_TYPES: dict[str, str] = {"bool": "i8", "bfloat16": "i16"}
FLOAT_MATH = {Ops.EXP2: "exp2", Ops.LOG2: "log2", Ops.SIN: "sin", Ops.SQRT: "sqrt"}
# LLVM spells intrinsic overloads by type: llvm.exp2.f32
TYPE_SUFFIXES = {"half": "f16", "float": "f32", "double": "f64"}


def register_type(dtype: DType) -> str: return REGISTER_TYPES[dtype.name]
def memory_type(dtype: DType) -> str: return MEMORY_TYPES.get(dtype.name, REGISTER_TYPES[dtype.name])


def float_bits_f32(value: float) -> int: return struct.unpack("<I", struct.pack("<f", value))[0]


def round_to_bfloat16(value: float) -> float:
  """A Python float rounded (nearest even) to bfloat16, as a Python float: what a bfloat16 register holds."""
  return to_bfloat16(value)


def render_const(value: float | int | bool, dtype: DType) -> str:
  """An LLVM IR literal. Floats are written as hex bit patterns: decimal floats must be exact in LLVM IR."""
  if dtype == dtypes.bool: return "true" if value else "false"
  if dtype.is_int:
    wrapped = int(value) & ((1 << dtype.bits) - 1)
    # LLVM reads integer literals as signed: write the two's complement value
    return str(wrapped - (1 << dtype.bits) if wrapped >= 1 << (dtype.bits - 1) else wrapped)
  value = float(value)
  if dtype == dtypes.float16:
    with np.errstate(over="ignore"):
      return f"0xH{int(np.array(value, dtype=np.float16).view(np.uint16)):04X}"
  if dtype == dtypes.bfloat16: value = round_to_bfloat16(value)
  elif dtype == dtypes.float32:
    with np.errstate(over="ignore"):
      value = float(np.float32(value))  # a float literal must be exact in float
  return f"0x{struct.unpack('<Q', struct.pack('<d', value))[0]:016X}"


class LLVMRenderer(Renderer):
  """LLVM IR for the CPU: every axis is a loop (no GPU threads); LLVM vectorizes and unrolls the loops itself.

  With `parallel` on (the runtime turns it on when libgomp loads), a kernel with enough work runs its outermost
  global loop on all cores, as CLANG does with `#pragma omp parallel for`: the loop nest becomes an internal
  function over a slice of that loop, and `@name` hands it to GOMP_parallel, whose threads each take one slice.
  `@name` keeps its signature either way."""
  device = "LLVM"
  has_threads = False
  # below this many loop iterations times uops, starting threads costs more than it saves (CLANG's threshold)
  parallel_min_work = 1 << 17
  # the SIMD register width (bytes) of the CPU LLVM targets (the runtime sets it from LLVM_CPU/LLVM_FEATURES); the CPU
  # matmul heuristic sizes its register tiles by it, LLVM's SLP vectorizer packs them into vectors
  vector_bytes = 16
  vector_registers = 16   # SIMD registers of the target (32 with AVX-512 or NEON; the runtime sets it)

  def __init__(self, parallel: bool = False):
    self.parallel = parallel

  def render(self, name: str, uops: list[UOp]) -> str:
    return _FunctionWriter(name, uops, self.parallel_loop(uops) if self.parallel else None).write()

  def parallel_loop(self, uops: list[UOp]) -> UOp | None:
    """The outermost global loop, if the kernel is worth splitting across threads. Global loops come first and
    each of their iterations writes its own outputs, so threads never store to the same element."""
    loops = [uop for uop in uops if uop.op is UOps.RANGE]
    if not loops or loops[0].arg[1] is not AxisType.GLOBAL: return None
    if any(uop.op is UOps.DEFINE_VAR for uop in uops): return None  # symbolic sizes: the wrapper passes no ints
    iterations = 1
    for loop in loops: iterations *= loop.srcs[1].arg - loop.srcs[0].arg
    outer = loops[0]
    if outer.srcs[1].arg - outer.srcs[0].arg < 2 or iterations * len(uops) < self.parallel_min_work: return None
    return outer


class _FunctionWriter:
  """The state of rendering one kernel: the instructions so far, the current block, SSA names, allocas."""

  def __init__(self, name: str, uops: list[UOp], parallel_loop: UOp | None = None):
    self.name, self.uops, self.parallel_loop = name, uops, parallel_loop
    self.body: list[str] = []
    self.allocas: list[str] = []
    self.declarations: set[str] = set()
    self.values: dict[int, str] = {}     # id(uop) -> SSA name or literal
    self.loops: dict[int, str] = {}      # id(RANGE or IF uop) -> label prefix of its blocks
    self.counter = 0
    self.block = "body"

  # ---------------------------------------------------------------- emitting

  def fresh(self, prefix: str = "v") -> str:
    self.counter += 1
    return f"%{prefix}{self.counter}"

  def emit(self, instruction: str) -> str:
    """Append `%vN = instruction` and return %vN."""
    name = self.fresh()
    self.body.append(f"  {name} = {instruction}")
    return name

  def emit_void(self, instruction: str) -> None: self.body.append(f"  {instruction}")

  def start_block(self, label: str) -> None:
    self.body.append(f"{label}:")
    self.block = label

  def intrinsic(self, name: str, result_type: str, argument_types: list[str]) -> str:
    self.declarations.add(f"declare {result_type} @{name}({', '.join(argument_types)})")
    return f"@{name}"

  def call(self, name: str, result_type: str, arguments: list[tuple[str, str]]) -> str:
    function = self.intrinsic(name, result_type, [kind for kind, _ in arguments])
    return self.emit(f"call {result_type} {function}({', '.join(f'{kind} {value}' for kind, value in arguments)})")

  def operand(self, uop: UOp) -> str:
    """The value of a source; an accumulator is read at the point of use (it holds its CURRENT value)."""
    if uop.op is UOps.DEFINE_ACC:
      return self.emit(f"load {register_type(uop.dtype)}, ptr {self.values[id(uop)]}")
    return self.values[id(uop)]

  # ---------------------------------------------------------------- the walk over the UOps

  def write(self) -> str:
    params: dict[int, str] = {}
    var_params: list[str] = []
    for uop in self.uops:
      if uop.op is UOps.DEFINE_GLOBAL:
        self.values[id(uop)] = f"%data{uop.arg[0]}"
        # ourgrad never passes one buffer twice to a kernel: noalias is what C's restrict says
        params[uop.arg[0]] = f"ptr noalias {'' if uop.arg[1] else 'readonly '}%data{uop.arg[0]}"
      elif uop.op is UOps.DEFINE_VAR:  # a symbolic Variable's value: an i32 argument after the buffers
        self.values[id(uop)] = f"%var_{uop.arg[0]}"
        var_params.append(f"i32 %var_{uop.arg[0]}")
      elif uop.op is UOps.CONST:
        self.values[id(uop)] = render_const(uop.arg, uop.dtype)
      elif uop.op is UOps.RANGE: self.open_loop(uop)
      elif uop.op is UOps.ENDRANGE: self.close_loop(uop.srcs[0])
      elif uop.op is UOps.IF: self.open_if(uop)
      elif uop.op is UOps.ENDIF: self.close_if(uop.srcs[0])
      elif uop.op is UOps.LOAD: self.values[id(uop)] = self.load(uop)
      elif uop.op is UOps.STORE: self.store(uop)
      elif uop.op is UOps.DEFINE_ACC:
        slot = self.fresh("acc")
        self.allocas.append(f"  {slot} = alloca {register_type(uop.dtype)}")
        self.values[id(uop)] = slot
        self.emit_void(f"store {register_type(uop.dtype)} {render_const(uop.arg, uop.dtype)}, ptr {slot}")
      elif uop.op is UOps.ACCUMULATE:
        acc, value = uop.srcs
        combined = self.alu(uop.arg, acc.dtype, [self.operand(acc), self.operand(value)], [acc.dtype, value.dtype])
        self.emit_void(f"store {register_type(acc.dtype)} {combined}, ptr {self.values[id(acc)]}")
      elif uop.op is UOps.ALU:
        operands = [self.operand(src) for src in uop.srcs]
        self.values[id(uop)] = self.alu(uop.arg, uop.dtype, operands, [src.dtype for src in uop.srcs])
      elif uop.op is UOps.CAST:
        self.values[id(uop)] = self.cast(self.operand(uop.srcs[0]), uop.srcs[0].dtype, uop.dtype)
      elif uop.op is UOps.BITCAST:
        self.values[id(uop)] = self.bitcast(self.operand(uop.srcs[0]), uop.srcs[0].dtype, uop.dtype)
      else:
        raise NotImplementedError(f"LLVMRenderer cannot render {uop.op}")
    # the runtime passes buffers in index order, whatever order the DEFINE_GLOBALs come in (an index no uop
    # defines still takes its position)
    signature = [params.get(index, f"ptr %unused{index}") for index in range(max(params, default=-1) + 1)]
    signature += var_params
    # no-trapping-math is clang's default too: FP ops may be speculated (if-converted); results are unchanged
    attributes = 'attributes #0 = { nounwind "no-trapping-math"="true" }'
    if self.parallel_loop is None:
      header = f"define void @{self.name}({', '.join(signature)}) #0 {{"
      wrappers: list[str] = []
    else:
      parameters = ", ".join(signature + ["i32 %range_start", "i32 %range_end"])
      header = f"define internal void @{self.name}_slice({parameters}) #0 {{"
      wrappers = self.parallel_wrappers(len(signature))
    lines = [*sorted(self.declarations), "", header, "entry:", *self.allocas, "  br label %body", "body:", *self.body,
             "  ret void", "}", "", *wrappers, attributes]
    return "\n".join(lines) + "\n"

  def parallel_wrappers(self, buffer_count: int) -> list[str]:
    """`@name(buffers...)` packs the buffer pointers into an array and calls GOMP_parallel with `@name_worker`,
    which every thread of the team runs: thread t of n takes iterations [size*t/n, size*(t+1)/n) of the outer
    loop (in i64: size*t may not fit in i32)."""
    assert self.parallel_loop is not None
    first, size = self.parallel_loop.srcs[0].arg, self.parallel_loop.srcs[1].arg - self.parallel_loop.srcs[0].arg
    array = f"[{buffer_count} x ptr]"
    slots = [f"  %slot{index} = getelementptr {array}, ptr %arguments, i64 0, i64 {index}"
             for index in range(buffer_count)]
    loads = [f"  %data{index} = load ptr, ptr %slot{index}" for index in range(buffer_count)]
    stores = [f"  store ptr %data{index}, ptr %slot{index}" for index in range(buffer_count)]
    buffers = ", ".join(f"ptr %data{index}" for index in range(buffer_count))
    worker = f"""define internal void @{self.name}_worker(ptr %arguments) #0 {{
entry:
  %thread = call i32 @omp_get_thread_num()
  %threads = call i32 @omp_get_num_threads()
  %t = sext i32 %thread to i64
  %n = sext i32 %threads to i64
  %t_next = add i64 %t, 1
  %low_scaled = mul i64 %t, {size}
  %high_scaled = mul i64 %t_next, {size}
  %low_offset = sdiv i64 %low_scaled, %n
  %high_offset = sdiv i64 %high_scaled, %n
  %low_32 = trunc i64 %low_offset to i32
  %high_32 = trunc i64 %high_offset to i32
  %low = add i32 %low_32, {first}
  %high = add i32 %high_32, {first}
{chr(10).join(slots + loads)}
  call void @{self.name}_slice({buffers}, i32 %low, i32 %high)
  ret void
}}

define void @{self.name}({buffers.replace("ptr ", "ptr noalias ")}) #0 {{
entry:
  %arguments = alloca {array}
{chr(10).join(slots + stores)}
  ; 0 threads: the team size OpenMP picks (OMP_NUM_THREADS, else one per core), as for CLANG's kernels
  call void @GOMP_parallel(ptr @{self.name}_worker, ptr %arguments, i32 0, i32 0)
  ret void
}}

declare i32 @omp_get_thread_num()
declare i32 @omp_get_num_threads()
declare void @GOMP_parallel(ptr, ptr, i32, i32)
"""
    return worker.split("\n")

  # ---------------------------------------------------------------- loops

  def open_loop(self, uop: UOp) -> None:
    """for (i = start; i < end; i++): head tests, body runs, latch increments and jumps back to head."""
    label = f"loop_{uop.arg[0]}_{self.counter}"
    self.counter += 1
    counter = f"%{uop.arg[0]}_{self.counter}"
    self.loops[id(uop)] = label
    self.values[id(uop)] = counter
    start, end = self.values[id(uop.srcs[0])], self.values[id(uop.srcs[1])]
    if uop is self.parallel_loop:  # each thread runs its own slice of this loop
      start, end = "%range_start", "%range_end"
    entered_from = self.block
    self.emit_void(f"br label %{label}_head")
    self.start_block(f"{label}_head")
    self.emit_void(f"{counter} = phi i32 [ {start}, %{entered_from} ], [ {counter}_next, %{label}_latch ]")
    keep_going = self.emit(f"icmp slt i32 {counter}, {end}")
    self.emit_void(f"br i1 {keep_going}, label %{label}_body, label %{label}_exit")
    self.start_block(f"{label}_body")

  def close_loop(self, range_uop: UOp) -> None:
    label, counter = self.loops[id(range_uop)], self.values[id(range_uop)]
    self.emit_void(f"br label %{label}_latch")
    self.start_block(f"{label}_latch")
    # the counter stays below `end`, an int32: it cannot overflow, and saying so lets SCEV analyse the loop
    self.emit_void(f"{counter}_next = add nuw nsw i32 {counter}, 1")
    self.emit_void(f"br label %{label}_head")
    self.start_block(f"{label}_exit")

  def open_if(self, uop: UOp) -> None:
    """if (condition) { ... }: the block runs where the condition holds; its values are used only inside it."""
    label = f"if_{self.counter}"
    self.counter += 1
    self.loops[id(uop)] = label
    self.emit_void(f"br i1 {self.operand(uop.srcs[0])}, label %{label}_then, label %{label}_end")
    self.start_block(f"{label}_then")

  def close_if(self, if_uop: UOp) -> None:
    label = self.loops[id(if_uop)]
    self.emit_void(f"br label %{label}_end")
    self.start_block(f"{label}_end")

  # ---------------------------------------------------------------- memory

  def element_pointer(self, buffer: UOp, index: str, index_dtype: DType) -> str:
    return self.emit(f"getelementptr inbounds {memory_type(buffer.dtype)}, ptr {self.values[id(buffer)]}, "
                     f"{register_type(index_dtype)} {index}")

  def load(self, uop: UOp) -> str:
    buffer, index_uop = uop.srcs[0], uop.srcs[1]
    index = self.operand(index_uop)
    valid = self.operand(uop.srcs[2]) if len(uop.srcs) > 2 else None
    kind, index_kind = register_type(uop.dtype), register_type(index_uop.dtype)
    gated = valid is not None and valid != "true"
    # a gated load reads element 0 (always in the buffer) where invalid, then selects 0: no out-of-bounds read, and
    # no branch, so the loop still vectorizes (measured faster than a branch LLVM turns into masked loads)
    if gated: index = self.emit(f"select i1 {valid}, {index_kind} {index}, {index_kind} 0")
    pointer = self.element_pointer(buffer, index, index_uop.dtype)
    value = self.emit(f"load {memory_type(uop.dtype)}, ptr {pointer}, align {uop.dtype.itemsize}")
    value = self.from_memory(value, uop.dtype)
    if not gated: return value
    return self.emit(f"select i1 {valid}, {kind} {value}, {kind} {render_const(0, uop.dtype)}")

  def store(self, uop: UOp) -> None:
    buffer, index_uop, value_uop = uop.srcs[:3]
    index, value = self.operand(index_uop), self.operand(value_uop)
    valid = self.operand(uop.srcs[3]) if len(uop.srcs) > 3 else None
    skip_label = None
    if valid is not None and valid != "true":
      store_label, skip_label = f"store_{self.counter}", f"stored_{self.counter}"
      self.counter += 1
      self.emit_void(f"br i1 {valid}, label %{store_label}, label %{skip_label}")
      self.start_block(store_label)
    pointer = self.element_pointer(buffer, index, index_uop.dtype)
    stored = self.to_memory(value, value_uop.dtype)
    self.emit_void(f"store {memory_type(value_uop.dtype)} {stored}, ptr {pointer}, align {value_uop.dtype.itemsize}")
    if skip_label is not None:
      self.emit_void(f"br label %{skip_label}")
      self.start_block(skip_label)

  def from_memory(self, value: str, dtype: DType) -> str:
    if dtype == dtypes.bool: return self.emit(f"icmp ne i8 {value}, 0")
    if dtype == dtypes.bfloat16: return self.bfloat16_bits_to_float(value)
    return value

  def to_memory(self, value: str, dtype: DType) -> str:
    if dtype == dtypes.bool: return self.emit(f"zext i1 {value} to i8")
    if dtype == dtypes.bfloat16: return self.float_to_bfloat16_bits(value)
    return value

  # ---------------------------------------------------------------- bfloat16 and float rounding helpers

  def bfloat16_bits_to_float(self, bits: str) -> str:
    wide = self.emit(f"zext i16 {bits} to i32")
    shifted = self.emit(f"shl i32 {wide}, 16")
    return self.emit(f"bitcast i32 {shifted} to float")

  def float_to_bfloat16_bits(self, value: str) -> str:
    """Round a float to bfloat16 (nearest even) and return its 16 bits; NaN stays a quiet NaN."""
    bits = self.emit(f"bitcast float {value} to i32")
    magnitude = self.emit(f"and i32 {bits}, 2147483647")
    is_nan = self.emit(f"icmp ugt i32 {magnitude}, 2139095040")
    high = self.emit(f"lshr i32 {bits}, 16")
    lowest_kept = self.emit(f"and i32 {high}, 1")
    bias = self.emit(f"add i32 {lowest_kept}, 32767")
    rounded = self.emit(f"add i32 {bits}, {bias}")
    rounded_high = self.emit(f"lshr i32 {rounded}, 16")
    quiet_nan = self.emit(f"or i32 {high}, 64")
    chosen = self.emit(f"select i1 {is_nan}, i32 {quiet_nan}, i32 {rounded_high}")
    return self.emit(f"trunc i32 {chosen} to i16")

  def round_bfloat16(self, value: str) -> str:
    return self.bfloat16_bits_to_float(self.float_to_bfloat16_bits(value))

  def double_to_float_round_to_odd(self, value: str) -> str:
    """double -> float rounded to odd: rounding that float again to half or bfloat16 gives the correctly rounded
    result (a plain double -> float -> half would round twice and can land on the wrong side of a tie)."""
    nearest = self.emit(f"fptrunc double {value} to float")
    back = self.emit(f"fpext float {nearest} to double")
    exact = self.emit(f"fcmp oeq double {back}, {value}")
    bits = self.emit(f"bitcast float {nearest} to i32")
    magnitude_back = self.call("llvm.fabs.f64", "double", [("double", back)])
    magnitude = self.call("llvm.fabs.f64", "double", [("double", value)])
    rounded_up = self.emit(f"fcmp ogt double {magnitude_back}, {magnitude}")
    toward_zero = self.emit(f"sub i32 {bits}, {self.emit(f'zext i1 {rounded_up} to i32')}")
    odd = self.emit(f"or i32 {toward_zero}, 1")
    chosen = self.emit(f"select i1 {exact}, i32 {bits}, i32 {odd}")
    return self.emit(f"bitcast i32 {chosen} to float")

  # ---------------------------------------------------------------- ALU

  def alu(self, op: Ops, dtype: DType, operands: list[str], operand_dtypes: list[DType]) -> str:
    kind = register_type(dtype)
    source = operand_dtypes[0]
    a = operands[0]
    b = operands[1] if len(operands) > 1 else ""
    if op in FLOAT_MATH:
      return self.call(f"llvm.{FLOAT_MATH[op]}.{TYPE_SUFFIXES[kind]}", kind, [(kind, a)])
    if op is Ops.RECIP: return self.emit(f"fdiv {kind} {render_const(1, dtype)}, {a}")
    if op is Ops.NEG:
      if dtype == dtypes.bool: return self.emit(f"xor i1 {a}, true")
      return self.emit(f"fneg {kind} {a}" if dtype.is_float else f"sub {kind} 0, {a}")
    if op is Ops.WHERE: return self.emit(f"select i1 {a}, {kind} {b}, {kind} {operands[2]}")
    if op in COMPARISON_OPS:
      operand_kind = register_type(source)
      if source.is_float:
        return self.emit(f"fcmp {'olt' if op is Ops.CMPLT else 'une'} {operand_kind} {a}, {b}")
      less = "ult" if source.is_unsigned or source == dtypes.bool else "slt"
      return self.emit(f"icmp {less if op is Ops.CMPLT else 'ne'} {operand_kind} {a}, {b}")
    if op is Ops.MAX: return self.maximum(dtype, a, b)
    if op in (Ops.IDIV, Ops.MOD): return self.divide(op, dtype, a, b)
    if op in (Ops.SHL, Ops.SHR): return self.shift(op, dtype, a, b, operand_dtypes[1])
    if dtype == dtypes.bool and op in (Ops.ADD, Ops.MUL):  # True+True is True: or, and
      return self.emit(f"{'or' if op is Ops.ADD else 'and'} i1 {a}, {b}")
    instructions = {Ops.ADD: ("add", "fadd"), Ops.MUL: ("mul", "fmul"), Ops.AND: ("and", None),
                    Ops.OR: ("or", None), Ops.XOR: ("xor", None)}
    if op in instructions:
      integer_instruction, float_instruction = instructions[op]
      instruction = float_instruction if dtype.is_float else integer_instruction
      if instruction is None: raise NotImplementedError(f"LLVMRenderer: {op} on {dtype}")
      return self.emit(f"{instruction} {kind} {a}, {b}")
    raise NotImplementedError(f"LLVMRenderer cannot render {op}")

  def maximum(self, dtype: DType, a: str, b: str) -> str:
    kind = register_type(dtype)
    if dtype.is_float:  # llvm.maximum: NaN wins, as in PyTorch (minnum/maxnum would drop the NaN)
      return self.call(f"llvm.maximum.{TYPE_SUFFIXES[kind]}", kind, [(kind, a), (kind, b)])
    if dtype == dtypes.bool: return self.emit(f"or i1 {a}, {b}")
    greater = self.emit(f"icmp {'ugt' if dtype.is_unsigned else 'sgt'} {kind} {a}, {b}")
    return self.emit(f"select i1 {greater}, {kind} {a}, {kind} {b}")

  def divide(self, op: Ops, dtype: DType, a: str, b: str) -> str:
    """C division (truncating; remainder has the dividend's sign) that never traps: x/0 is 0, and MIN/-1 (an
    overflow that x86 traps on) wraps to MIN, remainder 0."""
    kind = register_type(dtype)
    signed = not dtype.is_unsigned and dtype != dtypes.bool
    instruction = ("sdiv" if signed else "udiv") if op is Ops.IDIV else ("srem" if signed else "urem")
    literal = b.lstrip("-").isdigit()
    if literal and int(b) != 0 and (int(b) != -1 or not signed): return self.emit(f"{instruction} {kind} {a}, {b}")
    is_zero = self.emit(f"icmp eq {kind} {b}, 0")
    unsafe = is_zero
    if signed:
      is_minus_one = self.emit(f"icmp eq {kind} {b}, -1")
      unsafe = self.emit(f"or i1 {is_zero}, {is_minus_one}")
    divisor = self.emit(f"select i1 {unsafe}, {kind} 1, {kind} {b}")
    result = self.emit(f"{instruction} {kind} {a}, {divisor}")
    if signed:  # x / -1 = -x (wrapping), x % -1 = 0
      by_minus_one = self.emit(f"sub {kind} 0, {a}") if op is Ops.IDIV else "0"
      result = self.emit(f"select i1 {is_minus_one}, {kind} {by_minus_one}, {kind} {result}")
    return self.emit(f"select i1 {is_zero}, {kind} 0, {kind} {result}")

  def shift(self, op: Ops, dtype: DType, a: str, amount: str, amount_dtype: DType) -> str:
    """Shifts by >= the bit width give what Python's unbounded shifts give (0, or the sign for >>), not poison."""
    kind = register_type(dtype)
    if amount_dtype != dtype: amount = self.resize_integer(amount, amount_dtype, dtype, signed=False)
    signed = not dtype.is_unsigned and dtype != dtypes.bool
    bits = 1 if dtype == dtypes.bool else dtype.bits
    if op is Ops.SHR and signed:
      in_range = self.emit(f"icmp ult {kind} {amount}, {bits}")
      clamped = self.emit(f"select i1 {in_range}, {kind} {amount}, {kind} {bits - 1}")
      return self.emit(f"ashr {kind} {a}, {clamped}")
    in_range = self.emit(f"icmp ult {kind} {amount}, {bits}")
    safe_amount = self.emit(f"select i1 {in_range}, {kind} {amount}, {kind} 0")
    shifted = self.emit(f"{'shl' if op is Ops.SHL else 'lshr'} {kind} {a}, {safe_amount}")
    return self.emit(f"select i1 {in_range}, {kind} {shifted}, {kind} 0")

  # ---------------------------------------------------------------- casts

  def resize_integer(self, value: str, from_dtype: DType, to_dtype: DType, signed: bool) -> str:
    from_kind, to_kind = register_type(from_dtype), register_type(to_dtype)
    from_bits = 1 if from_dtype == dtypes.bool else from_dtype.bits
    to_bits = 1 if to_dtype == dtypes.bool else to_dtype.bits
    if from_bits == to_bits: return value
    if from_bits > to_bits: return self.emit(f"trunc {from_kind} {value} to {to_kind}")
    return self.emit(f"{'sext' if signed else 'zext'} {from_kind} {value} to {to_kind}")

  def cast(self, value: str, from_dtype: DType, to_dtype: DType) -> str:
    from_kind = register_type(from_dtype)
    if from_dtype == to_dtype: return value
    if to_dtype == dtypes.bool:
      if from_dtype.is_float: return self.emit(f"fcmp une {from_kind} {value}, {render_const(0, from_dtype)}")
      return self.emit(f"icmp ne {from_kind} {value}, 0")
    if not from_dtype.is_float and not to_dtype.is_float:  # integers and bool: C conversions
      signed = from_dtype.is_int and not from_dtype.is_unsigned
      return self.resize_integer(value, from_dtype, to_dtype, signed)
    if not from_dtype.is_float: return self.int_to_float(value, from_dtype, to_dtype)
    if not to_dtype.is_float: return self.float_to_int(value, from_dtype, to_dtype)
    return self.float_to_float(value, from_dtype, to_dtype)

  def int_to_float(self, value: str, from_dtype: DType, to_dtype: DType) -> str:
    from_kind = register_type(from_dtype)
    convert = "uitofp" if from_dtype.is_unsigned or from_dtype == dtypes.bool else "sitofp"
    if to_dtype == dtypes.bfloat16:  # through double (exact up to 2**53), then one correct rounding to bfloat16
      wide = self.emit(f"{convert} {from_kind} {value} to double")
      return self.round_bfloat16(self.double_to_float_round_to_odd(wide))
    if to_dtype == dtypes.float16:
      # integers that float cannot hold exactly are beyond half's range (inf either way); half direct from a
      # 64-bit integer would need a compiler-rt routine the JIT may not find
      as_float = self.emit(f"{convert} {from_kind} {value} to float")
      return self.emit(f"fptrunc float {as_float} to half")
    return self.emit(f"{convert} {from_kind} {value} to {register_type(to_dtype)}")

  def float_to_int(self, value: str, from_dtype: DType, to_dtype: DType) -> str:
    """Truncate toward zero. In range this is C's cast; out of range (UB in C, poison in LLVM) it follows
    ourgrad's reference: finite values wrap modulo 2**bits, NaN gives 0, +-inf the dtype's max/min."""
    from_kind, to_kind = register_type(from_dtype), register_type(to_dtype)
    suffix = TYPE_SUFFIXES[from_kind]
    if to_dtype == dtypes.uint64:  # negative values wrap (as int64 bits), the rest convert unsigned
      as_signed = self.call(f"llvm.fptosi.sat.i64.{suffix}", "i64", [(from_kind, value)])
      as_unsigned = self.call(f"llvm.fptoui.sat.i64.{suffix}", "i64", [(from_kind, value)])
      negative = self.emit(f"fcmp olt {from_kind} {value}, {render_const(0, from_dtype)}")
      result = self.emit(f"select i1 {negative}, i64 {as_signed}, i64 {as_unsigned}")
      minus_infinity = self.emit(f"fcmp oeq {from_kind} {value}, {render_const(-math.inf, from_dtype)}")
      return self.emit(f"select i1 {minus_infinity}, i64 0, i64 {result}")
    wide = self.call(f"llvm.fptosi.sat.i64.{suffix}", "i64", [(from_kind, value)])
    if to_dtype == dtypes.int64: return wide  # saturation gives inf -> max, -inf -> min, NaN -> 0 already
    result = self.emit(f"trunc i64 {wide} to {to_kind}")
    for infinity, limit in ((math.inf, to_dtype.max), (-math.inf, to_dtype.min)):
      is_infinity = self.emit(f"fcmp oeq {from_kind} {value}, {render_const(infinity, from_dtype)}")
      result = self.emit(f"select i1 {is_infinity}, {to_kind} {render_const(limit, to_dtype)}, {to_kind} {result}")
    return result

  def float_to_float(self, value: str, from_dtype: DType, to_dtype: DType) -> str:
    from_kind, to_kind = register_type(from_dtype), register_type(to_dtype)
    if to_dtype == dtypes.bfloat16:
      if from_dtype == dtypes.float64: value = self.double_to_float_round_to_odd(value)
      elif from_dtype == dtypes.float16: value = self.emit(f"fpext half {value} to float")
      return self.round_bfloat16(value)
    if from_dtype == dtypes.float64 and to_dtype == dtypes.float16:
      return self.emit(f"fptrunc float {self.double_to_float_round_to_odd(value)} to half")
    if from_kind == to_kind: return value  # bfloat16 -> float32: the register already holds the float
    widening = {"half": 0, "float": 1, "double": 2}
    instruction = "fpext" if widening[to_kind] > widening[from_kind] else "fptrunc"
    return self.emit(f"{instruction} {from_kind} {value} to {to_kind}")

  def bitcast(self, value: str, from_dtype: DType, to_dtype: DType) -> str:
    """Reinterpret the bits: through the memory representation, so bool is a byte and bfloat16 is 16 bits."""
    from_kind, to_kind = memory_type(from_dtype), memory_type(to_dtype)
    raw = self.to_memory(value, from_dtype)
    if from_kind != to_kind: raw = self.emit(f"bitcast {from_kind} {raw} to {to_kind}")
    return self.from_memory(raw, to_dtype)
