"""The PYTHON device: no compiler; kernels are interpreted from their UOps with numpy.

It lets CI run the GPU-only code paths (thread blocks, local memory, barriers, `if` blocks, warp shuffles) on any
machine, and it is an executable reference for what the UOps mean (the contract in `ourgrad/codegen/uops.py`).
With `EMULATE=CUDA` the renderer reports CUDA's limits (threads per block, local memory, warp size), so the
optimizer makes exactly the kernels it makes for CUDA, and the interpreter runs them.

- `PythonRenderer` serializes a kernel's UOp list to JSON text, one UOp per line: the "source" (DEBUG=4 prints it).
- `PythonCompiler` passes that text through as bytes: there is nothing to compile.
- `PythonProgram` parses the text back (plain JSON, no eval) and runs the kernel for every (block, thread) at once:
  each value is a numpy array with one entry per thread (or a 0-d array when it is the same in every thread).
  All threads step together (one uop for every thread, then the next), which is what a BARRIER guarantees on a GPU;
  so that a kernel missing a barrier still fails here, local memory remembers which thread stored each element
  since the last BARRIER, and a read of (or a store over) another thread's element before a barrier is an error.
  IF blocks keep a mask of the threads that run them: loads, stores and accumulations inside are masked.
  RANGE loops run in Python, one iteration at a time; a reduce loop (its only effects are ACCUMULATEs) runs a chunk
  of iterations at once and folds them in loop order, which gives the same numbers much faster. Loads and stores
  are bounds-checked, so a bad index is an error, not a silent read.

Numbers follow the contract exactly: C integer division and modulo (a zero divisor gives 0), two's-complement
wraparound, NaN-propagating MAX, C casts. float16 values are numpy float16 (each op rounds to half); bfloat16
values are float32 in registers, rounded to bfloat16 (nearest even) by CAST and STORE, and kept in memory as the
upper 16 bits of a float32, as the C renderers do.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ourgrad.codegen.tensor_cores import WARP_LANES, a_position, b_position, c_position, evaluate
from ourgrad.codegen.uops import AxisType, UOp, UOps
from ourgrad.device import Compiled, Compiler, HostAllocator
from ourgrad.dtype import (DType, bfloat16_bits_to_float32, dtypes, float32_to_bfloat16_bits, round_to_bfloat16,
                           truncate)
from ourgrad.errors import CompileError, DeviceError
from ourgrad.helpers import EMULATE
from ourgrad.shape.symbolic import Node
from ourgrad.ops import Ops
from ourgrad.renderer import Renderer
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.wgmma_emulator import WgmmaMatmul, WgmmaProgram, is_wgmma_program, wgmma_program_text

PROGRAM_FORMAT = "ourgrad-python-uops-v1"
DTYPES_BY_NAME: dict[str, DType] = {dtype.name: dtype for dtype in dtypes.all()}
# reduce loops run this many (iteration, thread) values at a time; below 2 iterations per chunk they run one by one
LOOP_CHUNK_ELEMENTS = 1 << 18


# ---------------------------------------------------------------- serializing UOps (the "source")

def encode_arg(arg: Any) -> Any:
  """A UOp argument as JSON data: Ops members become {"alu": name}, non-finite floats {"float": "inf"|"-inf"|"nan"},
  tuples become lists (no other argument is a list, so decoding turns every list back into a tuple)."""
  if isinstance(arg, np.generic): arg = arg.item()
  if isinstance(arg, Ops): return {"alu": arg.name}
  if isinstance(arg, AxisType): return {"axis": arg.name}
  if arg is None or isinstance(arg, (bool, int, str)): return arg
  if isinstance(arg, float):
    if math.isfinite(arg): return arg  # json writes repr(float), which reads back to the same float
    return {"float": "nan" if math.isnan(arg) else ("inf" if arg > 0 else "-inf")}
  if isinstance(arg, tuple): return [encode_arg(item) for item in arg]
  # a symbolic launch size (SPECIAL over a Variable's range): kept as text, the launch passes the real size
  if isinstance(arg, Node): return {"symbolic": arg.render()}
  raise NotImplementedError(f"the PYTHON renderer cannot serialize a UOp argument of type {type(arg).__name__}: "
                            f"{arg!r}")


def decode_arg(data: Any) -> Any:
  """The inverse of `encode_arg`; rejects anything it did not produce."""
  if data is None or isinstance(data, (bool, int, float, str)): return data
  if isinstance(data, list): return tuple(decode_arg(item) for item in data)
  if isinstance(data, dict) and len(data) == 1:
    if "alu" in data and data["alu"] in Ops.__members__: return Ops[data["alu"]]
    if "axis" in data and data["axis"] in AxisType.__members__: return AxisType[data["axis"]]
    if "float" in data and data["float"] in ("inf", "-inf", "nan"): return float(data["float"])
    if "symbolic" in data and isinstance(data["symbolic"], str): return data["symbolic"]
  raise CompileError(f"PYTHON program: cannot decode UOp argument {data!r}")


class PythonRenderer(Renderer):
  """Renders UOps as JSON, one UOp per line: `[position, op, dtype, [source positions], arg]`.

  The text is deterministic (the compile cache keys on it) and is the whole program: the interpreter needs
  nothing else. GPU-like: global axes become block indices, LOCAL and GROUP opts become thread indices, GROUP
  partials meet in local memory. `emulate="CUDA"` takes CUDA's limits instead of its own."""
  device = "PYTHON"
  has_threads = True
  max_threads = 128
  has_local = True
  local_memory_bytes = 16384
  dynamic_local_memory_bytes = 16384
  warp_size = 0
  vector_width = 4
  tensor_cores: tuple = ()   # EMULATE=CUDA takes CUDA's (WMMA is interpreted as mma.sync, see Interpreter.wmma)

  has_wgmma = False   # EMULATE=CUDA_SM90: also OptOps.WGMMA (runtime/wgmma_emulator.py)

  def __init__(self, emulate: str = "") -> None:
    if emulate == "": return
    if emulate.upper() not in ("CUDA", "CUDA_SM90"):
      raise DeviceError(f"EMULATE={emulate}: the PYTHON device emulates only CUDA (CUDA_SM90: an H100, with wgmma)")
    self.has_wgmma = emulate.upper() == "CUDA_SM90"
    for limit in ("max_threads", "has_local", "local_memory_bytes", "dynamic_local_memory_bytes", "warp_size",
                  "vector_width", "global_max", "local_max", "tensor_cores", "multiprocessors", "has_async_copy"):
      setattr(self, limit, getattr(CUDARenderer, limit))

  def render(self, name: str, uops: list[UOp]) -> str:
    position = {id(uop): index for index, uop in enumerate(uops)}
    lines = []
    for index, uop in enumerate(uops):
      srcs = [position[id(src)] for src in uop.srcs]
      entry = [index, uop.op.name, uop.dtype.name if uop.dtype is not None else None, srcs, encode_arg(uop.arg)]
      lines.append(json.dumps(entry, allow_nan=False))
    header = json.dumps({"format": PROGRAM_FORMAT, "name": name})[:-1]  # left open: the uops follow
    return header + ', "uops": [\n' + ",\n".join(lines) + "\n]}\n"

  def render_wgmma(self, name: str, plan: WgmmaMatmul, arguments: dict[str, int]) -> str:
    return wgmma_program_text(name, plan, arguments)


class PythonCompiler(Compiler):
  """Nothing to compile: the serialized UOps are the binary."""
  cache_key = "python v1"

  def compile(self, source: str) -> bytes: return source.encode()


# ---------------------------------------------------------------- parsing the program back

@dataclass(frozen=True)
class Instruction:
  """One decoded UOp: sources are positions of earlier instructions."""
  op: UOps
  dtype: DType | None
  srcs: tuple[int, ...]
  arg: Any


def _reject_constant(name: str) -> Any:
  raise CompileError(f"PYTHON program: non-standard JSON constant {name}")


def parse_program(text: str) -> tuple[str, list[Instruction]]:
  """(kernel name, instructions) from `PythonRenderer.render` output, checking that it is well formed."""
  try:
    document = json.loads(text, parse_constant=_reject_constant)
  except json.JSONDecodeError as error:
    raise CompileError(f"PYTHON program is not valid JSON: {error}") from None
  if not isinstance(document, dict) or document.get("format") != PROGRAM_FORMAT:
    raise CompileError(f"PYTHON program: expected format {PROGRAM_FORMAT!r}")
  instructions: list[Instruction] = []
  for index, entry in enumerate(document.get("uops", [])):
    if not (isinstance(entry, list) and len(entry) == 5 and entry[0] == index):
      raise CompileError(f"PYTHON program: malformed uop {index}: {entry!r}")
    _, op_name, dtype_name, srcs, arg = entry
    if op_name not in UOps.__members__: raise CompileError(f"PYTHON program: unknown uop {op_name!r}")
    if dtype_name is not None and dtype_name not in DTYPES_BY_NAME:
      raise CompileError(f"PYTHON program: unknown dtype {dtype_name!r}")
    if not (isinstance(srcs, list) and all(isinstance(src, int) and 0 <= src < index for src in srcs)):
      raise CompileError(f"PYTHON program: uop {index} has sources {srcs!r} that are not earlier uops")
    dtype = DTYPES_BY_NAME[dtype_name] if dtype_name is not None else None
    instructions.append(Instruction(UOps[op_name], dtype, tuple(srcs), decode_arg(arg)))
  return str(document.get("name", "")), instructions


def match_loops(instructions: list[Instruction]) -> dict[int, int]:
  """Position of each RANGE -> position of its ENDRANGE; loops and IF blocks must nest properly."""
  ends: dict[int, int] = {}
  open_scopes: list[int] = []
  closers = {UOps.ENDRANGE: UOps.RANGE, UOps.ENDIF: UOps.IF}
  for index, instruction in enumerate(instructions):
    if instruction.op is UOps.RANGE and len(instruction.srcs) != 2:
      raise CompileError(f"PYTHON program: RANGE at {index} needs (start, end)")
    if instruction.op in (UOps.RANGE, UOps.IF): open_scopes.append(index)
    elif instruction.op in closers:
      if not open_scopes or instruction.srcs[:1] != (open_scopes[-1],) or \
          instructions[open_scopes[-1]].op is not closers[instruction.op]:
        raise CompileError(f"PYTHON program: {instruction.op.name} at {index} does not close the innermost scope")
      opened = open_scopes.pop()
      if instruction.op is UOps.ENDRANGE: ends[opened] = index
  if open_scopes: raise CompileError(f"PYTHON program: scopes opened at {open_scopes} are never closed")
  return ends


def vectorizable_loops(instructions: list[Instruction], loop_ends: dict[int, int]) -> dict[int, list[int]]:
  """RANGE position -> the chain of loops (outer to inner) that can run all iterations at once.

  A loop whose only effects are ACCUMULATEs (a reduce loop) need not run one iteration at a time: its body can be
  evaluated for a chunk of iterations together (each value gets an iteration axis) and the accumulated values
  folded afterwards in iteration order, which gives the same numbers. That holds when the body stores nothing,
  declares no accumulator, never reads an accumulator's running value, keeps its values to itself, and nests its
  loops as one chain with every ACCUMULATE in the innermost body (so the order of the accumulations is the
  flattened iteration order)."""
  result: dict[int, list[int]] = {}
  for start, end in loop_ends.items():
    chain, closed, accumulate_ops = [start], False, {}
    eligible = True
    for position in range(start + 1, end):
      instruction = instructions[position]
      op = instruction.op
      if op in (UOps.STORE, UOps.DEFINE_ACC, UOps.DEFINE_GLOBAL, UOps.DEFINE_LOCAL, UOps.BARRIER, UOps.IF,
                UOps.WARP_REDUCE, UOps.WMMA, UOps.COPY, UOps.ASYNC_WAIT, UOps.LDMATRIX): eligible = False
      elif op is UOps.RANGE:
        # a loop after an inner one closed is a sibling, not a chain; bounds must be known before the block runs
        eligible = not closed and all(instructions[src].op is UOps.CONST for src in instruction.srcs)
        chain.append(position)
      elif op is UOps.ENDRANGE: closed = True
      elif op is UOps.ACCUMULATE:
        accumulator = instruction.srcs[0]
        # every accumulation in the innermost body, and one kind of accumulation per accumulator
        eligible = not closed and instruction.arg in (Ops.ADD, Ops.MAX) and \
          instruction.arg is accumulate_ops.setdefault(accumulator, instruction.arg)
      for operand_number, src in enumerate(instruction.srcs):
        src_op = instructions[src].op
        reads_accumulator = src_op is UOps.DEFINE_ACC and not (op is UOps.ACCUMULATE and operand_number == 0)
        if reads_accumulator or src_op is UOps.ACCUMULATE: eligible = False
      if not eligible: break
    # a value of the body used after the loop (constants excepted: they are loop-invariant and kept)
    if eligible and any(start < src < end and instructions[src].op is not UOps.CONST
                        for later in instructions[end + 1:] for src in later.srcs):
      eligible = False
    if eligible: result[start] = chain
  return result


# ---------------------------------------------------------------- value representation

def compute_dtype(dtype: DType) -> np.dtype:
  """The numpy dtype a value of `dtype` is held in while computing (bfloat16 computes in float32)."""
  return np.dtype(np.float32 if dtype == dtypes.bfloat16 else dtype.np)


def memory_dtype(dtype: DType) -> np.dtype:
  """The numpy dtype a buffer of `dtype` is viewed as (bfloat16 as its raw uint16 bits)."""
  return np.dtype(np.uint16 if dtype == dtypes.bfloat16 else dtype.np)


def to_memory(values: np.ndarray, dtype: DType) -> np.ndarray:
  """Register values of `dtype` -> what a buffer of `dtype` stores."""
  if dtype == dtypes.bfloat16: return float32_to_bfloat16_bits(values)
  return np.asarray(values).astype(memory_dtype(dtype), copy=False)


def from_memory(values: np.ndarray, dtype: DType) -> np.ndarray:
  """What a buffer of `dtype` stores -> register values."""
  if dtype == dtypes.bfloat16: return bfloat16_bits_to_float32(values)
  return values


# ---------------------------------------------------------------- ALU semantics, vectorized

def _c_divide(dtype: np.dtype, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Integer a / b as in C: truncate toward zero; a zero divisor gives 0 (hardware would trap)."""
  a, b = np.asarray(a, dtype), np.asarray(b, dtype)
  zero = b == 0
  safe_b = np.where(zero, np.ones((), dtype), b)
  # a - fmod(a, b) is an exact multiple of b, so floor division of it truncates; INT_MIN / -1 wraps to INT_MIN
  quotient = (a - np.fmod(a, safe_b)) // safe_b if dtype.kind == "i" else a // safe_b
  return np.where(zero, np.zeros((), dtype), quotient)


def _c_modulo(dtype: np.dtype, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Integer a % b as in C: the remainder has the dividend's sign; a zero divisor gives 0."""
  a, b = np.asarray(a, dtype), np.asarray(b, dtype)
  zero = b == 0
  return np.where(zero, np.zeros((), dtype), np.fmod(a, np.where(zero, np.ones((), dtype), b)))


def _integer_only(op: Ops, function: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
  def checked(dtype: np.dtype, *operands: np.ndarray) -> np.ndarray:
    if dtype.kind not in "iu": raise DeviceError(f"PYTHON device: {op.name} is defined on integers, not {dtype}")
    return function(dtype, *operands)
  return checked


def _shift(function: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
  # the shift amount takes the shifted value's dtype, as C converts it
  return lambda dtype, a, b: function(np.asarray(a, dtype), np.asarray(b).astype(dtype))


def _negate(dtype: np.dtype, a: np.ndarray) -> np.ndarray:
  return np.logical_not(a) if dtype == np.bool_ else np.negative(np.asarray(a, dtype))


def _add(dtype: np.dtype, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  return np.logical_or(a, b) if dtype == np.bool_ else np.add(a, b)


def _multiply(dtype: np.dtype, a: np.ndarray, b: np.ndarray) -> np.ndarray:
  return np.logical_and(a, b) if dtype == np.bool_ else np.multiply(a, b)


def _float_only(op: Ops, function: Callable[[np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
  def checked(dtype: np.dtype, a: np.ndarray) -> np.ndarray:
    if dtype.kind != "f": raise DeviceError(f"PYTHON device: {op.name} is defined on floats, not {dtype}")
    return function(np.asarray(a, dtype))
  return checked


# each takes (result numpy dtype, *operands) and returns values the caller converts to the result dtype
ALU_FUNCTIONS: dict[Ops, Callable[..., np.ndarray]] = {
  Ops.EXP2: _float_only(Ops.EXP2, np.exp2),
  Ops.LOG2: _float_only(Ops.LOG2, np.log2),
  Ops.SIN: _float_only(Ops.SIN, np.sin),
  Ops.SQRT: _float_only(Ops.SQRT, np.sqrt),
  Ops.RECIP: _float_only(Ops.RECIP, np.reciprocal),
  Ops.NEG: _negate,
  Ops.ADD: _add,
  Ops.MUL: _multiply,
  Ops.IDIV: _integer_only(Ops.IDIV, _c_divide),
  Ops.MOD: _integer_only(Ops.MOD, _c_modulo),
  Ops.MAX: lambda dtype, a, b: np.maximum(a, b),  # np.maximum propagates NaN, as the contract's MAX does
  Ops.CMPLT: lambda dtype, a, b: np.less(a, b),
  Ops.CMPNE: lambda dtype, a, b: np.not_equal(a, b),
  Ops.AND: lambda dtype, a, b: np.bitwise_and(a, b),
  Ops.OR: lambda dtype, a, b: np.bitwise_or(a, b),
  Ops.XOR: lambda dtype, a, b: np.bitwise_xor(a, b),
  Ops.SHL: _shift(np.left_shift),
  Ops.SHR: _shift(np.right_shift),
  Ops.WHERE: lambda dtype, cond, a, b: np.where(np.asarray(cond, bool), a, b),
  Ops.MULACC: lambda dtype, a, b, c: _add(dtype, _multiply(dtype, a, b).astype(dtype, copy=False), c),
}


def execute_alu(op: Ops, dtype: DType, operands: list[np.ndarray]) -> np.ndarray:
  """`op` on numpy operands, the result held in `dtype`'s compute dtype."""
  if op not in ALU_FUNCTIONS: raise DeviceError(f"PYTHON device: no implementation of ALU op {op.name}")
  result_dtype = compute_dtype(dtype)
  # comparisons take their operands' dtype; everything else computes in the result dtype, as C converts operands
  if op not in (Ops.CMPLT, Ops.CMPNE, Ops.WHERE):
    operands = [np.asarray(operand).astype(result_dtype, copy=False) for operand in operands]
  elif op is Ops.WHERE:
    operands = [operands[0]] + [np.asarray(operand).astype(result_dtype, copy=False) for operand in operands[1:]]
  return np.asarray(ALU_FUNCTIONS[op](result_dtype, *operands)).astype(result_dtype, copy=False)


def cast(values: np.ndarray, from_dtype: DType, to_dtype: DType) -> np.ndarray:
  """C value conversion: float -> int truncates toward zero, x -> bool is x != 0, float -> half/bfloat16 rounds
  to nearest even (to bfloat16 through float32, as the C renderers do)."""
  values = np.asarray(values)
  if to_dtype == dtypes.bool: return values != 0
  if to_dtype == dtypes.bfloat16: return round_to_bfloat16(values.astype(np.float32))
  return values.astype(compute_dtype(to_dtype))  # numpy's float -> int conversion truncates, like C


def bitcast(values: np.ndarray, from_dtype: DType, to_dtype: DType) -> np.ndarray:
  """Reinterpret the bits; bfloat16 is rounded to its 16 bits first (its registers hold float32)."""
  if from_dtype.itemsize != to_dtype.itemsize:
    raise DeviceError(f"PYTHON device: BITCAST from {from_dtype.name} to {to_dtype.name} changes the size")
  bits = to_memory(values, from_dtype)
  return from_memory(np.ascontiguousarray(bits).view(memory_dtype(to_dtype)), to_dtype)


# ---------------------------------------------------------------- the interpreter

class LocalMemory:
  """One DEFINE_LOCAL: an array per block, and which thread stored each element since the last BARRIER
  (-1: none), to catch reads and stores that race on a GPU."""

  def __init__(self, dtype: DType, size: int, blocks: int):
    self.dtype, self.size = dtype, size
    self.data = np.zeros(blocks * size, compute_dtype(dtype))
    self.writer = np.full(blocks * size, -1, np.int64)

  def barrier(self) -> None: self.writer[:] = -1


class PythonProgram:
  """A kernel's UOps, run for all threads at once with numpy. Called like any device program:
  `program(*buffers, global_size=(bx, by, bz), local_size=(tx, ty, tz), wait=False)`."""

  def __init__(self, name: str, binary: bytes):
    self.name = name
    _, self.instructions = parse_program(binary.decode())
    self.loop_ends = match_loops(self.instructions)
    self.vectorizable = vectorizable_loops(self.instructions, self.loop_ends)

  def __call__(self, *buffers: np.ndarray, global_size: tuple[int, ...] = (1, 1, 1),
               local_size: tuple[int, ...] = (1, 1, 1), wait: bool = False, vals: tuple[int, ...] = ()) -> float | None:
    start = time.perf_counter()
    with np.errstate(all="ignore"):  # wraparound, inf and NaN are intended results here, not accidents
      interpreter = Interpreter(self, buffers, tuple(global_size), tuple(local_size))
      # vals: the symbolic Variables' values, one per DEFINE_VAR in program order (the kernel's int arguments)
      var_names = [instruction.arg[0] for instruction in self.instructions if instruction.op is UOps.DEFINE_VAR]
      interpreter.var_values = dict(zip(var_names, vals))
      interpreter.run()
    return time.perf_counter() - start if wait else None


def _pad3(sizes: tuple[int, ...]) -> tuple[int, int, int]:
  padded = tuple(sizes) + (1,) * (3 - len(sizes))
  return int(padded[0]), int(padded[1]), int(padded[2])


class Interpreter:
  """One launch of a PythonProgram. `values[i]` holds the current value of instruction i: a numpy array of one
  entry per thread, or 0-d when uniform; DEFINE_GLOBAL holds the buffer's typed view; a RANGE holds its counter
  and a DEFINE_ACC the accumulator's current value."""

  def __init__(self, program: PythonProgram, buffers: tuple[np.ndarray, ...], global_size: tuple[int, ...],
               local_size: tuple[int, ...]):
    self.program, self.buffers = program, buffers
    self.var_values: dict[str, int] = {}
    self.global_size, self.local_size = _pad3(global_size), _pad3(local_size)
    self.threads_per_block = math.prod(self.local_size)
    self.thread_count = math.prod(self.global_size) * self.threads_per_block
    self.values: list[Any] = [None] * len(program.instructions)
    self.thread_ids = np.arange(self.thread_count, dtype=np.int64)
    self.masks: list[np.ndarray] = []  # the threads running each open IF block, innermost last
    self.locals: list[LocalMemory] = []
    # asynchronous COPYs not yet landed, in groups (one per ASYNC_WAIT): (position, memory, index, values, threads)
    self.pending_copies: list[list[tuple]] = [[]]

  @property
  def active(self) -> np.ndarray | None:
    """Which threads run the current uop (None: all)."""
    return self.masks[-1] if self.masks else None

  def error(self, position: int, message: str) -> DeviceError:
    instruction = self.program.instructions[position]
    return DeviceError(f"PYTHON kernel {self.program.name}, uop {position} ({instruction.op.name}): {message}")

  def run(self) -> None:
    instructions, values, loop_ends = self.program.instructions, self.values, self.program.loop_ends
    open_loops: list[tuple[int, int]] = []  # (RANGE position, end) of the loops being iterated, innermost last
    position = 0
    while position < len(instructions):
      instruction = instructions[position]
      op = instruction.op
      if op is UOps.RANGE:
        begin, end = (int(values[src]) for src in instruction.srcs)
        if begin >= end:
          position = loop_ends[position] + 1
          continue
        if self.run_loops_at_once(position):
          position = loop_ends[position] + 1
          continue
        values[position] = np.asarray(begin, dtype=compute_dtype(instruction.dtype))
        open_loops.append((position, end))
      elif op is UOps.IF:
        condition = np.broadcast_to(np.asarray(values[instruction.srcs[0]], bool), (self.thread_count,))
        self.masks.append(condition if self.active is None else condition & self.active)
      elif op is UOps.ENDIF:
        self.masks.pop()
      elif op is UOps.BARRIER:
        if self.active is not None: raise self.error(position, "a BARRIER inside an IF block (threads would hang)")
        for memory in self.locals: memory.barrier()
      elif op is UOps.ENDRANGE:
        loop_position, end = open_loops[-1]
        counter = int(values[loop_position]) + 1
        if counter < end:
          values[loop_position] = np.asarray(counter, dtype=values[loop_position].dtype)
          position = loop_position + 1
          continue
        open_loops.pop()
      else:
        values[position] = self.execute(position, instruction)
      position += 1

  def run_loops_at_once(self, start: int) -> bool:
    """Run the loop chain opened at `start` a chunk of iterations at a time (see `vectorizable_loops`); False
    when it is not eligible or one iteration's values are already as big as a chunk."""
    chain = self.program.vectorizable.get(start)
    chunk = LOOP_CHUNK_ELEMENTS // max(self.thread_count, 1)
    if chain is None or chunk < 2: return False
    instructions, values = self.program.instructions, self.values
    block = range(start + 1, self.program.loop_ends[start])
    for position in block:  # constants first: inner loop bounds may be declared inside the block
      if instructions[position].op is UOps.CONST: values[position] = self.execute(position, instructions[position])
    bounds = [tuple(int(values[src]) for src in instructions[loop].srcs) for loop in chain]
    sizes = [max(end - begin, 0) for begin, end in bounds]
    strides = [math.prod(sizes[depth + 1:]) for depth in range(len(sizes))]  # the innermost loop varies fastest
    total = math.prod(sizes)
    body = [position for position in block if instructions[position].op not in (UOps.RANGE, UOps.ENDRANGE, UOps.CONST)]
    for first in range(0, total, chunk):
      iterations = np.arange(first, min(first + chunk, total), dtype=np.int64)
      for loop, (begin, _), size, stride in zip(chain, bounds, sizes, strides):
        counter = begin + (iterations // stride) % size
        values[loop] = counter.astype(compute_dtype(instructions[loop].dtype))[:, None]  # axes: (iteration, thread)
      accumulated: dict[int, tuple[Ops, list[np.ndarray]]] = {}  # accumulator -> (operation, values in order)
      for position in body:
        instruction = instructions[position]
        if instruction.op is UOps.ACCUMULATE:
          accumulator, value = instruction.srcs
          accumulated.setdefault(accumulator, (instruction.arg, []))[1].append(values[value])
        else:
          values[position] = self.execute(position, instruction)
      for accumulator, (operation, parts) in accumulated.items():
        values[accumulator] = self.fold(accumulator, operation, parts, len(iterations))
    for position in chain + body: values[position] = None  # free the chunk-sized arrays
    return True

  def fold(self, accumulator: int, operation: Ops, parts: list[np.ndarray], iteration_count: int) -> np.ndarray:
    """The accumulator after applying `parts` (per iteration, in body order) one after another."""
    dtype = self.program.instructions[accumulator].dtype
    element = compute_dtype(dtype)
    current = np.asarray(self.values[accumulator])
    shape = np.broadcast_shapes((iteration_count, 1), current.shape, *(np.shape(part) for part in parts))
    # (iteration, accumulation in the body, thread) flattened to the order a sequential run applies them in
    sequence = np.stack([np.broadcast_to(np.asarray(part).astype(element, copy=False), shape) for part in parts], 1)
    sequence = sequence.reshape(-1, shape[-1])
    if operation is Ops.ADD and element.kind == "f":
      # float addition is not associative: add strictly in order, rounding after each step as the loop does
      total = np.array(np.broadcast_to(current, shape[-1:]), dtype=element)
      if shape[-1] >= 64:  # many threads: one vector add per step is faster than numpy's accumulate
        for row in sequence: np.add(total, row, out=total)
        return total
      return np.add.accumulate(np.concatenate([total[None], sequence]), axis=0)[-1]
    # integer addition (wrapping), logical or, and max give the same result in any order
    if operation is Ops.MAX: reduced = np.maximum.reduce(sequence, axis=0)
    elif element == np.bool_: reduced = np.logical_or.reduce(sequence, axis=0)
    else: reduced = np.add.reduce(sequence, axis=0, dtype=element)
    return execute_alu(operation, dtype, [current, reduced])

  def execute(self, position: int, instruction: Instruction) -> Any:
    op, dtype, values = instruction.op, instruction.dtype, self.values
    operands = [values[src] for src in instruction.srcs]
    if op is UOps.ALU: return execute_alu(instruction.arg, dtype, operands)
    if op is UOps.CONST: return np.asarray(truncate(dtype, instruction.arg), dtype=compute_dtype(dtype))
    if op is UOps.LOAD and isinstance(operands[0], LocalMemory):
      if instruction.arg is None: return self.load_local(position, *operands)
      index = np.asarray(operands[1], np.int64)   # a vector from local memory: aligned, like a global one
      if (index % instruction.arg).any(): raise self.error(position, "an unaligned vector load from local memory")
      return np.stack([self.load_local(position, operands[0], index + lane) for lane in range(instruction.arg)])
    if op is UOps.STORE and isinstance(operands[0], LocalMemory) and instruction.arg is not None:
      index = np.asarray(operands[1], np.int64)   # a vector into local memory: aligned, like a global one
      if (index % instruction.arg).any(): raise self.error(position, "an unaligned vector store to local memory")
      for element, value in enumerate(operands[2:]): self.store_local(position, operands[0], index + element, value)
      return None
    if op is UOps.STORE and isinstance(operands[0], LocalMemory):
      self.store_local(position, *operands)
      return None
    if op is UOps.OCCUPANCY: return None   # a compile hint (launch bounds), nothing to run
    if op is UOps.LOAD and instruction.arg is not None: return self.vector_load(position, instruction, *operands)
    if op is UOps.GEP: return operands[0][instruction.arg]
    if op is UOps.LOAD: return self.load(position, instruction, *operands)
    if op is UOps.STORE and instruction.arg is not None:
      buffer, index, values = operands[0], np.asarray(operands[1], dtype=np.int64), operands[2:]
      aligned_index = index if self.active is None else np.where(self.active, index, 0)
      if (aligned_index % instruction.arg).any(): raise self.error(position, "a vector store to an unaligned index")
      for element, value in enumerate(values): self.store(position, instruction, buffer, index + element, value)
      return None
    if op is UOps.STORE:
      self.store(position, instruction, *operands)
      return None
    if op is UOps.DEFINE_LOCAL:
      memory = LocalMemory(dtype, int(instruction.arg[1]), math.prod(self.global_size))
      self.locals.append(memory)
      return memory
    if op is UOps.WARP_REDUCE: return self.warp_reduce(position, instruction, operands[0])
    if op is UOps.WMMA:
      self.wmma(position, instruction, operands)
      return None
    if op is UOps.COPY:
      self.copy(position, instruction, operands)
      return None
    if op is UOps.ASYNC_WAIT:
      self.async_wait(instruction.arg)
      return None
    if op is UOps.LDMATRIX: return self.ldmatrix(position, instruction, operands[0], operands[1])
    if op is UOps.CAST: return cast(operands[0], self.src_dtype(instruction), dtype)
    if op is UOps.BITCAST: return bitcast(operands[0], self.src_dtype(instruction), dtype)
    if op is UOps.SPECIAL: return self.special(position, instruction.arg)
    if op is UOps.DEFINE_ACC: return np.asarray(truncate(dtype, instruction.arg), dtype=compute_dtype(dtype))
    if op is UOps.ACCUMULATE:
      accumulator_position = instruction.srcs[0]
      accumulator_dtype = self.program.instructions[accumulator_position].dtype
      if instruction.arg not in (Ops.ADD, Ops.MAX): raise self.error(position, f"cannot accumulate {instruction.arg}")
      combined = execute_alu(instruction.arg, accumulator_dtype, operands)
      if self.active is not None: combined = np.where(self.active, combined, operands[0])
      values[accumulator_position] = combined
      return combined
    if op is UOps.DEFINE_GLOBAL: return self.buffer_view(position, instruction)
    if op is UOps.DEFINE_VAR: return np.asarray(self.var_values[instruction.arg[0]], dtype=np.int32)
    raise self.error(position, "the PYTHON device does not implement this uop")

  def src_dtype(self, instruction: Instruction) -> DType:
    return self.program.instructions[instruction.srcs[0]].dtype

  def buffer_view(self, position: int, instruction: Instruction) -> np.ndarray:
    index = instruction.arg[0]
    if index >= len(self.buffers): raise self.error(position, f"kernel argument {index} was not passed")
    raw = self.buffers[index]
    element = memory_dtype(instruction.dtype)
    usable = len(raw) - len(raw) % element.itemsize  # an empty buffer is allocated as 1 byte
    return raw[:usable].view(element)

  def special(self, position: int, arg: tuple) -> np.ndarray:
    """Block or thread index along one launch dimension of every thread: the flat thread id runs over blocks
    (major) then threads in a block (minor), x varying fastest in each."""
    name, _, dimension, kind = arg
    flat = self.thread_ids
    if kind is AxisType.GLOBAL: within, sizes = flat // self.threads_per_block, self.global_size
    elif kind is AxisType.LOCAL: within, sizes = flat % self.threads_per_block, self.local_size
    else: raise self.error(position, f"thread index {name!r} of kind {kind}")
    stride = math.prod(sizes[:dimension])
    return ((within // stride) % sizes[dimension]).astype(np.int32)

  def local_addresses(self, position: int, memory: LocalMemory, index: np.ndarray,
                      valid: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(threads, addresses in the memory's array) of the threads that access local memory here."""
    index = np.broadcast_to(np.asarray(index, np.int64), (self.thread_count,))
    running = np.ones(self.thread_count, bool) if self.active is None else self.active.copy()
    if valid is not None: running &= np.broadcast_to(np.asarray(valid, bool), (self.thread_count,))
    threads, index = self.thread_ids[running], index[running]
    if index.size and (index.min() < 0 or index.max() >= memory.size):
      bad = int(index.min()) if index.min() < 0 else int(index.max())
      raise self.error(position, f"local memory index {bad} outside its {memory.size} elements")
    return threads, threads // self.threads_per_block * memory.size + index

  def load_local(self, position: int, memory: LocalMemory, index: np.ndarray,
                 valid: np.ndarray | None = None) -> np.ndarray:
    threads, addresses = self.local_addresses(position, memory, index, valid)
    writers = memory.writer[addresses]
    racing = (writers != -1) & (writers != threads)
    if racing.any():
      raise self.error(position, f"thread {int(threads[racing][0])} reads local memory that thread "
                                 f"{int(writers[racing][0])} stored with no BARRIER between")
    result = np.zeros(self.thread_count, memory.data.dtype)
    result[threads] = memory.data[addresses]
    return result

  def store_local(self, position: int, memory: LocalMemory, index: np.ndarray, value: np.ndarray,
                  valid: np.ndarray | None = None) -> None:
    threads, addresses = self.local_addresses(position, memory, index, valid)
    writers = memory.writer[addresses]
    unique, counts = np.unique(addresses, return_counts=True)
    racing = (writers != -1) & (writers != threads)
    if racing.any() or (counts > 1).any():
      raise self.error(position, f"two threads store to local memory element {int(unique[counts.argmax()])} "
                                 f"with no BARRIER between")
    value = np.broadcast_to(np.asarray(value).astype(memory.data.dtype, copy=False), (self.thread_count,))
    memory.data[addresses] = value[threads]
    memory.writer[addresses] = threads

  def warp_reduce(self, position: int, instruction: Instruction, value: np.ndarray) -> np.ndarray:
    """A butterfly over `width` neighbouring threads, as __shfl_xor_sync does: every thread gets the result."""
    op, width, stride = instruction.arg
    span = width * stride
    if self.threads_per_block % span and self.threads_per_block > span:
      raise self.error(position, f"a warp reduce over {span} thread ids in blocks of {self.threads_per_block}")
    result = np.broadcast_to(np.asarray(value), (self.thread_count,))
    offset = width // 2 * stride
    while offset >= stride:
      result = execute_alu(op, instruction.dtype, [result, result[self.thread_ids ^ offset]])
      offset //= 2
    return result

  def wmma(self, position: int, instruction: Instruction, operands: list[np.ndarray]) -> None:
    """mma.sync as the hardware does it: each warp's 32 lanes hand in their fragments, which are gathered into the
    warp's A, B and C matrices with the PTX ISA's maps (codegen/tensor_cores.py), D = A @ B + C is computed in
    float32, and each lane gets back its D fragment in its accumulators (the C sources)."""
    if self.active is not None: raise self.error(position, "a WMMA inside an IF block (a warp must run it together)")
    if self.threads_per_block % WARP_LANES:
      raise self.error(position, f"a WMMA in blocks of {self.threads_per_block} threads (not whole warps)")
    (m, n, k), _, _ = instruction.arg
    a_count, b_count = m * k // WARP_LANES, k * n // WARP_LANES
    fragments = [np.broadcast_to(np.asarray(value, np.float32), (self.thread_count,)) for value in operands]
    warp, lane = self.thread_ids // WARP_LANES, self.thread_ids % WARP_LANES
    group, quad = lane >> 2, lane & 3
    warps = self.thread_count // WARP_LANES
    matrices = {"a": np.zeros((warps, m, k), np.float32), "b": np.zeros((warps, k, n), np.float32),
                "c": np.zeros((warps, m, n), np.float32)}
    layout = [("a", a_position, fragments[:a_count]), ("b", b_position, fragments[a_count:a_count + b_count]),
              ("c", c_position, fragments[a_count + b_count:])]
    for name, position_of, values in layout:
      for element, value in enumerate(values):
        row, column = (evaluate(coordinate, group, quad) for coordinate in position_of(element))
        matrices[name][warp, row, column] = value
    result = np.matmul(matrices["a"], matrices["b"]) + matrices["c"]
    for element, accumulator in enumerate(instruction.srcs[a_count + b_count:]):
      row, column = (evaluate(coordinate, group, quad) for coordinate in c_position(element))
      self.values[accumulator] = result[warp, row, column]

  def copy(self, position: int, instruction: Instruction, operands: list) -> None:
    """COPY: `width` elements from global memory (0 where not valid) to local memory, as stored. Asynchronous copies
    land at the ASYNC_WAIT that completes their group (stored then, by the thread that issued them)."""
    memory, local_index, buffer, index = operands[:4]
    valid = operands[4] if len(operands) > 4 else None
    width, asynchronous = instruction.arg
    index, local_index = (np.broadcast_to(np.asarray(value, np.int64), (self.thread_count,))
                          for value in (index, local_index))
    running = np.ones(self.thread_count, bool) if self.active is None else self.active.copy()
    if ((index % width != 0) & running).any() or ((local_index % width != 0) & running).any():
      raise self.error(position, f"a {width}-wide copy from or to an unaligned index")
    loaded = np.broadcast_to(np.asarray(True if valid is None else valid, bool), (self.thread_count,)) & running
    safe = np.where(loaded, index, 0)
    self.check_bounds(position, buffer, safe[loaded] + (width - 1), "read at")
    values = [np.where(loaded, buffer[np.where(loaded, safe + element, 0)], np.zeros((), buffer.dtype))
              for element in range(width)]
    copies = [(position, memory, local_index + element, from_memory(value, memory.dtype), running.copy())
              for element, value in enumerate(values)]
    if asynchronous: self.pending_copies[-1].extend(copies)
    else: self._land(copies)

  def _land(self, copies: list[tuple]) -> None:
    saved = self.masks
    for position, memory, local_index, value, running in copies:
      self.masks = [running]
      self.store_local(position, memory, local_index, value)
    self.masks = saved

  def async_wait(self, keep: int) -> None:
    """ASYNC_WAIT keep: the copies since the last wait become a group; all but the last `keep` groups land."""
    groups = self.pending_copies
    landing, self.pending_copies = groups[:len(groups) - keep], groups[len(groups) - keep:] + [[]]
    for group in landing: self._land(group)

  def ldmatrix(self, position: int, instruction: Instruction, memory: LocalMemory, index: np.ndarray) -> np.ndarray:
    """ldmatrix.m8n8.x{count}[.trans].b16 per warp: matrix j's 8 rows start at the addresses of lanes 8j..8j+7;
    lane l gets, per matrix, row l // 4 columns 2 (l % 4) + (0, 1) (transposed: rows 2 (l % 4) + (0, 1), column
    l // 4). Returns (2 count, threads): element 2j + e of each lane."""
    if self.active is not None: raise self.error(position, "an LDMATRIX inside an IF block (a warp runs it together)")
    if self.threads_per_block % WARP_LANES:
      raise self.error(position, f"an LDMATRIX in blocks of {self.threads_per_block} threads (not whole warps)")
    count, transposed = instruction.arg
    index = np.broadcast_to(np.asarray(index, np.int64), (self.thread_count,))
    if (index % 8).any(): raise self.error(position, "an LDMATRIX row address that is not 16-byte aligned")
    warp_first = self.thread_ids // WARP_LANES * WARP_LANES
    lane = self.thread_ids % WARP_LANES
    result = np.zeros((2 * count, self.thread_count), memory.data.dtype)
    for matrix in range(count):
      for element in range(2):
        if transposed: row_lane, column = 8 * matrix + 2 * (lane % 4) + element, lane // 4
        else: row_lane, column = 8 * matrix + lane // 4, 2 * (lane % 4) + element
        result[2 * matrix + element] = self.load_local(position, memory, index[warp_first + row_lane] + column)
    return result

  def vector_load(self, position: int, instruction: Instruction, buffer: np.ndarray, index: np.ndarray) -> np.ndarray:
    """`width` neighbouring elements, stacked on a new first axis (GEP takes one); the index must be a multiple of
    the width, as a GPU's aligned vector load needs."""
    width, index = instruction.arg, np.asarray(index, dtype=np.int64)
    # threads outside the IF block they are in neither read nor are checked (a guard keeps them off the buffer's end)
    if self.active is not None: index = np.where(self.active, index, 0)
    if (index % width).any(): raise self.error(position, f"a {width}-wide vector load from an unaligned index")
    self.check_bounds(position, buffer, index + (width - 1), "read at")
    return np.stack([from_memory(buffer[index + element], instruction.dtype) for element in range(width)])

  def check_bounds(self, position: int, buffer: np.ndarray, index: np.ndarray, what: str) -> None:
    if index.size == 0: return
    low, high = int(index.min()), int(index.max())
    if low < 0 or high >= buffer.size:
      bad = low if low < 0 else high
      raise self.error(position, f"{what} index {bad} outside the buffer of {buffer.size} elements")

  def load(self, position: int, instruction: Instruction, buffer: np.ndarray, index: np.ndarray,
           valid: np.ndarray | None = None) -> np.ndarray:
    """Gather; where `valid` is false the result is 0 and memory is not touched (the index may be anything)."""
    index = np.asarray(index, dtype=np.int64)
    if self.active is not None: valid = self.active if valid is None else np.asarray(valid, bool) & self.active
    if valid is None:
      self.check_bounds(position, buffer, index, "read at")
      return from_memory(buffer[index], instruction.dtype)
    valid = np.asarray(valid, dtype=bool)
    safe_index = np.where(valid, index, 0)
    if not valid.any(): gathered = np.zeros(safe_index.shape, buffer.dtype)
    else:
      self.check_bounds(position, buffer, safe_index, "read at")
      gathered = np.where(valid, buffer[safe_index], np.zeros((), buffer.dtype))
    return from_memory(gathered, instruction.dtype)

  def store(self, position: int, instruction: Instruction, buffer: np.ndarray, index: np.ndarray, value: np.ndarray,
            valid: np.ndarray | None = None) -> None:
    """Scatter (where `valid`). Threads writing one address: the last thread wins, a GPU leaves it undefined."""
    buffer_dtype = self.program.instructions[instruction.srcs[0]].dtype
    value = to_memory(value, buffer_dtype)
    if self.active is not None: valid = self.active if valid is None else np.asarray(valid, bool) & self.active
    index = np.asarray(index, dtype=np.int64)
    if valid is None: index, value = (np.atleast_1d(array) for array in np.broadcast_arrays(index, value))
    else:
      index, value, valid = (np.atleast_1d(array) for array in np.broadcast_arrays(index, value, np.asarray(valid)))
      valid = valid.astype(bool, copy=False)
      index, value = index[valid], value[valid]
    self.check_bounds(position, buffer, index, "write to")
    buffer[index] = value


def load_program(name: str, binary: bytes) -> PythonProgram | WgmmaProgram:
  return WgmmaProgram(name, binary) if is_wgmma_program(binary) else PythonProgram(name, binary)


def create_device(name: str) -> Compiled:
  return Compiled(name, HostAllocator(), PythonRenderer(EMULATE.value), PythonCompiler(), load_program)
