"""The GPU half of the PYTHON device's interpreter: what a kernel for a GPU uses beyond loops and arithmetic.

`GpuInterpreter` extends the UOp interpreter (runtime/uop_interpreter.py) with a GPU's execution model, so CI runs
the GPU-only code paths on any machine (`DEVICE=PYTHON EMULATE=CUDA`, docs/debugging.md):
- thread blocks: SPECIAL gives each thread its block and thread index (the flat thread id runs over blocks, then
  threads in a block);
- local memory (DEFINE_LOCAL, one `LocalMemory` per block) and BARRIER: all threads step together, which is what a
  barrier guarantees on a GPU, so that a kernel missing a barrier still fails here, local memory remembers which
  thread stored each element since the last BARRIER, and a read of (or a store over) another thread's element
  before a barrier is an error;
- warp shuffles (WARP_REDUCE), tensor-core instructions as the PTX ISA lays out their fragments (WMMA as
  mma.sync, LDMATRIX), asynchronous copies into local memory (COPY, ASYNC_WAIT) and launch hints (OCCUPANCY).
The Hopper wgmma kernel is emulated on its own (runtime/wgmma_emulator.py).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ourgrad.codegen.tensor_cores import WARP_LANES, evaluate, tensor_core_of, tf32_round
from ourgrad.codegen.uops import AxisType, UOps
from ourgrad.dtype import DType
from ourgrad.runtime.uop_interpreter import (Instruction, Interpreter, UOpProgram, compute_dtype, execute_alu,
                                            from_memory)


# the uops only a GPU runs (with LOAD and STORE of local memory), each handled by GpuInterpreter.execute
GPU_UOPS = frozenset({UOps.DEFINE_LOCAL, UOps.BARRIER, UOps.OCCUPANCY, UOps.SPECIAL, UOps.WARP_REDUCE, UOps.WMMA,
                      UOps.COPY, UOps.ASYNC_WAIT, UOps.LDMATRIX, UOps.ATOMIC_ADD, UOps.FENCE,
                      UOps.COHERENT_LOAD})


class LocalMemory:
  """One DEFINE_LOCAL: an array per block, and which thread stored each element since the last BARRIER
  (-1: none), to catch reads and stores that race on a GPU."""

  def __init__(self, dtype: DType, size: int, blocks: int):
    self.dtype, self.size = dtype, size
    self.data = np.zeros(blocks * size, compute_dtype(dtype))
    self.writer = np.full(blocks * size, -1, np.int64)

  def barrier(self, blocks: np.ndarray | None = None) -> None:
    """The stores so far are visible to every thread of the block: of every block, or of the `blocks` (a mask)
    that reached this BARRIER."""
    if blocks is None: self.writer[:] = -1
    else: self.writer.reshape(-1, self.size)[blocks] = -1


class GpuInterpreter(Interpreter):
  """One launch of a UOpProgram on an emulated GPU: the Interpreter plus thread indices, local memory, barriers,
  warp reduces, tensor cores and asynchronous copies."""

  def __init__(self, program: UOpProgram, buffers: tuple[np.ndarray, ...], global_size: tuple[int, ...],
               local_size: tuple[int, ...]):
    super().__init__(program, buffers, global_size, local_size)
    self.locals: list[LocalMemory] = []
    # asynchronous COPYs not yet landed, in groups (one per ASYNC_WAIT): (position, memory, index, values, threads)
    self.pending_copies: list[list[tuple]] = [[]]

  def execute(self, position: int, instruction: Instruction) -> Any:
    op, values = instruction.op, self.values
    in_local_memory = op in (UOps.LOAD, UOps.STORE) and isinstance(values[instruction.srcs[0]], LocalMemory)
    if not in_local_memory and op not in GPU_UOPS: return super().execute(position, instruction)
    operands = [values[src] for src in instruction.srcs]
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
    if op is UOps.BARRIER:
      # a branch every thread of a block takes or none does (a carried reduce in the first block) may hold one
      blocks = None if self.active is None else self.active.reshape(-1, self.threads_per_block)
      if blocks is not None and (blocks.any(axis=1) != blocks.all(axis=1)).any():
        raise self.error(position, "a BARRIER inside an IF block that some threads of a block skip (they would hang)")
      for memory in self.locals: memory.barrier(None if blocks is None else blocks[:, 0])
      return None
    if op is UOps.OCCUPANCY: return None   # a compile hint (launch bounds), nothing to run
    if op is UOps.DEFINE_LOCAL:
      memory = LocalMemory(instruction.dtype, int(instruction.arg[1]), math.prod(self.global_size))
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
    if op is UOps.SPECIAL: return self.special(position, instruction.arg)
    if op is UOps.ATOMIC_ADD: return self.atomic_add(position, *operands)
    if op is UOps.COHERENT_LOAD: return self.load(position, instruction, *operands)   # one memory: always coherent
    if op is UOps.FENCE: return None   # every thread's stores land at once here: they are visible to all
    raise self.error(position, "the PYTHON device does not implement this uop")

  def atomic_add(self, position: int, buffer: np.ndarray, index: np.ndarray, value: np.ndarray) -> np.ndarray:
    """The running threads' adds one after another in thread order (blocks in launch order, as if each block ran
    to this point before the next), each getting the element as it was before its own add."""
    index = np.broadcast_to(np.asarray(index, np.int64), (self.thread_count,))
    value = np.broadcast_to(np.asarray(value), (self.thread_count,))
    running = np.ones(self.thread_count, bool) if self.active is None else self.active
    self.check_bounds(position, buffer, index[running], "atomic add at")
    before = np.zeros(self.thread_count, buffer.dtype)
    for thread in np.nonzero(running)[0]:
      before[thread] = buffer[index[thread]]
      buffer[index[thread]] += value[thread]
    return before

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
    warp's A, B and C matrices with the PTX ISA's maps (codegen/tensor_cores.py: the instruction the arg names, its
    maps from the table, not from the kernel), D = A @ B + C is computed in float32, and each lane gets back its D
    fragment in its accumulators (the C sources). TF32 rounds A and B as cvt.rna.tf32.f32 does first."""
    if self.active is not None: raise self.error(position, "a WMMA inside an IF block (a warp must run it together)")
    if self.threads_per_block % WARP_LANES:
      raise self.error(position, f"a WMMA in blocks of {self.threads_per_block} threads (not whole warps)")
    tc = tensor_core_of(instruction.arg)
    (m, n, k), a_count, b_count = tc.dims, tc.a_elements, tc.b_elements
    fragments = [np.broadcast_to(np.asarray(value, np.float32), (self.thread_count,)) for value in operands]
    warp, lane = self.thread_ids // WARP_LANES, self.thread_ids % WARP_LANES
    group, quad = lane >> 2, lane & 3
    warps = self.thread_count // WARP_LANES
    matrices = {"a": np.zeros((warps, m, k), np.float32), "b": np.zeros((warps, k, n), np.float32),
                "c": np.zeros((warps, m, n), np.float32)}
    layout = [("a", tc.a_position, fragments[:a_count]), ("b", tc.b_position, fragments[a_count:a_count + b_count]),
              ("c", tc.c_position, fragments[a_count + b_count:])]
    for name, position_of, values in layout:
      for element, value in enumerate(values):
        row, column = (evaluate(coordinate, group, quad) for coordinate in position_of(element))
        matrices[name][warp, row, column] = value
    if tc.is_tf32: matrices["a"], matrices["b"] = tf32_round(matrices["a"]), tf32_round(matrices["b"])
    result = np.matmul(matrices["a"], matrices["b"]) + matrices["c"]
    for element, accumulator in enumerate(instruction.srcs[a_count + b_count:]):
      row, column = (evaluate(coordinate, group, quad) for coordinate in tc.c_position(element))
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
    l // 4). Returns (2 count, threads): element 2j + e of each lane. In a local memory of 32-bit elements (TF32) a
    row of 8 16-bit elements is 4 of them, and lane l gets, per matrix, the one at row l // 4, column l % 4: (count,
    threads), element j from matrix j."""
    if self.active is not None: raise self.error(position, "an LDMATRIX inside an IF block (a warp runs it together)")
    if self.threads_per_block % WARP_LANES:
      raise self.error(position, f"an LDMATRIX in blocks of {self.threads_per_block} threads (not whole warps)")
    count, transposed = instruction.arg
    index = np.broadcast_to(np.asarray(index, np.int64), (self.thread_count,))
    if (index * memory.dtype.itemsize % 16).any():
      raise self.error(position, "an LDMATRIX row address that is not 16-byte aligned")
    warp_first = self.thread_ids // WARP_LANES * WARP_LANES
    lane = self.thread_ids % WARP_LANES
    if memory.dtype.itemsize == 4:
      if transposed: raise self.error(position, "ldmatrix .trans of 32-bit elements (it transposes 16-bit ones)")
      rows = [self.load_local(position, memory, index[warp_first + 8 * matrix + lane // 4] + lane % 4)
              for matrix in range(count)]
      return np.stack(rows)
    result = np.zeros((2 * count, self.thread_count), memory.data.dtype)
    for matrix in range(count):
      for element in range(2):
        if transposed: row_lane, column = 8 * matrix + 2 * (lane % 4) + element, lane // 4
        else: row_lane, column = 8 * matrix + lane // 4, 2 * (lane % 4) + element
        result[2 * matrix + element] = self.load_local(position, memory, index[warp_first + row_lane] + column)
    return result

