"""The interpreter of the PYTHON device: a kernel's UOps run with numpy for every thread at once.

Each value is a numpy array with one entry per thread (or a 0-d array when it is the same in every thread); all
threads step together, one uop for every thread, then the next. IF blocks keep a mask of the threads that run them:
loads, stores and accumulations inside are masked. RANGE loops run in Python, one iteration at a time; a reduce loop
(its only effects are ACCUMULATEs) runs a chunk of iterations at once and folds them in loop order, which gives the
same numbers much faster. Loads and stores are bounds-checked, so a bad index is an error, not a silent read.

Numbers follow the contract of `ourgrad/codegen/uops.py` exactly: C integer division and modulo (a zero divisor
gives 0), two's-complement wraparound, NaN-propagating MAX, C casts. float16 values are numpy float16 (each op
rounds to half); bfloat16 values are float32 in registers, rounded to bfloat16 (nearest even) by CAST and STORE, and
kept in memory as the upper 16 bits of a float32, as the C renderers do.

- `UOpProgram`: a kernel's decoded instructions and the loop structure found in them (`match_loops`,
  `vectorizable_loops`).
- `Interpreter`: one launch of it over global buffers: control flow, ALU ops (`execute_alu`, `cast`, `bitcast`),
  accumulators, global loads and stores. What only a GPU has (block and thread indices, local memory and barriers,
  warp reduces, tensor cores, asynchronous copies) is runtime/gpu_emulator.py's GpuInterpreter, which the PYTHON
  device (runtime/ops_python.py) runs every kernel with.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ourgrad.codegen.uops import UOps
from ourgrad.dtype import (DType, bfloat16_bits_to_float32, dtypes, float32_to_bfloat16_bits, round_to_bfloat16,
                           truncate)
from ourgrad.errors import CompileError, DeviceError
from ourgrad.ops import Ops

# reduce loops run this many (iteration, thread) values at a time; below 2 iterations per chunk they run one by one
LOOP_CHUNK_ELEMENTS = 1 << 18


# ---------------------------------------------------------------- the program: instructions and loops

@dataclass(frozen=True)
class Instruction:
  """One decoded UOp: sources are positions of earlier instructions."""
  op: UOps
  dtype: DType | None
  srcs: tuple[int, ...]
  arg: Any



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
      elif op is UOps.LOAD and instructions[instruction.srcs[0]].op is UOps.DEFINE_LOCAL:
        eligible = False   # local memory is read one iteration (a thread's index) at a time
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

class UOpProgram:
  """A kernel's instructions (sources are positions of earlier ones), checked for properly nested scopes, with each
  loop's end (`loop_ends`) and the reduce loops that may run a chunk of iterations at once (`vectorizable`)."""

  def __init__(self, name: str, instructions: list[Instruction]):
    self.name, self.instructions = name, instructions
    self.loop_ends = match_loops(self.instructions)
    self.vectorizable = vectorizable_loops(self.instructions, self.loop_ends)


def _pad3(sizes: tuple[int, ...]) -> tuple[int, int, int]:
  padded = tuple(sizes) + (1,) * (3 - len(sizes))
  return int(padded[0]), int(padded[1]), int(padded[2])


class Interpreter:
  """One launch of a UOpProgram. `values[i]` holds the current value of instruction i: a numpy array of one
  entry per thread, or 0-d when uniform; DEFINE_GLOBAL holds the buffer's typed view; a RANGE holds its counter
  and a DEFINE_ACC the accumulator's current value."""

  def __init__(self, program: UOpProgram, buffers: tuple[np.ndarray, ...], global_size: tuple[int, ...],
               local_size: tuple[int, ...]):
    self.program, self.buffers = program, buffers
    self.var_values: dict[str, int] = {}
    self.global_size, self.local_size = _pad3(global_size), _pad3(local_size)
    self.threads_per_block = math.prod(self.local_size)
    self.thread_count = math.prod(self.global_size) * self.threads_per_block
    self.values: list[Any] = [None] * len(program.instructions)
    self.thread_ids = np.arange(self.thread_count, dtype=np.int64)
    self.masks: list[np.ndarray] = []  # the threads running each open IF block, innermost last

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
    if op is UOps.CAST: return cast(operands[0], self.src_dtype(instruction), dtype)
    if op is UOps.BITCAST: return bitcast(operands[0], self.src_dtype(instruction), dtype)
    if op is UOps.DEFINE_ACC: return np.asarray(truncate(dtype, instruction.arg), dtype=compute_dtype(dtype))
    if op is UOps.ACCUMULATE:
      accumulator_position = instruction.srcs[0]
      accumulator_dtype = self.program.instructions[accumulator_position].dtype
      if instruction.arg not in (Ops.ADD, Ops.MAX, Ops.MUL):
        raise self.error(position, f"cannot accumulate {instruction.arg}")
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

  def vector_load(self, position: int, instruction: Instruction, buffer: np.ndarray, index: np.ndarray,
                  valid: np.ndarray | None = None) -> np.ndarray:
    """`width` neighbouring elements, stacked on a new first axis (GEP takes one); the index must be a multiple of
    the width, as a GPU's aligned vector load needs. Where `valid` (a gated vector) is false: zeros, and the index is
    neither read nor checked."""
    width, index = instruction.arg, np.asarray(index, dtype=np.int64)
    # threads outside the IF block they are in neither read nor are checked (a guard keeps them off the buffer's end)
    if self.active is not None: valid = self.active if valid is None else np.asarray(valid, bool) & self.active
    if valid is not None: index = np.where(valid, index, 0)
    if (index % width).any(): raise self.error(position, f"a {width}-wide vector load from an unaligned index")
    self.check_bounds(position, buffer, index + (width - 1), "read at")
    elements = [from_memory(buffer[index + element], instruction.dtype) for element in range(width)]
    if valid is not None: elements = [np.where(valid, values, np.zeros((), values.dtype)) for values in elements]
    return np.stack(elements)

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

