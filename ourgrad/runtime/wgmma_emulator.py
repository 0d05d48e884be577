"""The wgmma matmul kernel (codegen/wgmma_tiles.py) emulated with numpy, for the PYTHON device and CI.

It replays what the CUDA kernel does with the same address formulas (wgmma_copies.a_copy, b_copy;
wgmma_tiles.operand_starts, tile_of_block, accumulator_position) and reads the operands back the way the PTX ISA
says the tensor cores do: from a shared-memory image, through the 64-bit descriptors the kernel builds, by the
canonical 128-byte-swizzled layouts ("Shared Memory Matrix Layout", in CuTe notation, T = 8 elements of 16 bits):

    K-major:  ((8, m), (T, 2k)) : ((8T, SBO), (1, T))     row r, k  ->  (r // 8) SBO + (r % 8) 128 B + 2 k B
    MN-major: ((T, 8, m), (8, k)) : ((1, T, LBO), (8T, SBO))   mn, k  ->  (mn // 64) LBO + (k // 8) SBO + (k % 8) 128 B
                                                                           + 2 (mn % 64) B
each address then swizzled (16-byte piece ^= 128-byte row within the 1024-byte atom). A layout whose writes and
descriptors disagree (a wrong stride, swizzle or start) reads the wrong elements here as on the GPU. TF32 operands
(float32, T = 4 elements of 32 bits, K-major only) are read the same way and truncated to TF32 (the 13 low mantissa
bits dropped), as the tensor cores read float32 bits.
D = A @ B + D per warpgroup and K slice in float32 (the hardware's summation order within a slice may differ in the
last bits); the accumulators are held per thread in the PTX fragment order and stored by the kernel's store formula.
"""
from __future__ import annotations

import dataclasses
import json
import time

import numpy as np

from ourgrad.codegen.wgmma_copies import ROW_BYTES, a_copy, b_copy
from ourgrad.codegen.wgmma_tiles import (WARPGROUP_THREADS, WgmmaMatmul, accumulator_position, cta_items, descriptor,
                                         item_tile, operand_starts, swizzled)

# the unsigned integer type holding one operand element's bits, by its size in bytes
WORDS = {2: np.uint16, 4: np.uint32}

# the descriptor fields (PTX ISA "Matrix Descriptor Format")
FIELD_MASK, SWIZZLE_128B = 0x3FFF, 1


def read_operand(shared: np.ndarray, matrix_descriptor: int, rows: int, k_major: bool) -> np.ndarray:
  """The rows x K operand (rows along M or N; K = 16 16-bit or 8 32-bit elements, one instruction's) that a wgmma
  reads through `matrix_descriptor` from the shared-memory image `shared` (elements of 16 or 32 bits: byte address b
  is element b // itemsize)."""
  itemsize = shared.itemsize
  start = (matrix_descriptor & FIELD_MASK) << 4
  leading = ((matrix_descriptor >> 16) & FIELD_MASK) << 4
  stride = ((matrix_descriptor >> 32) & FIELD_MASK) << 4
  if matrix_descriptor >> 62 != SWIZZLE_128B: raise NotImplementedError("only the 128-byte swizzle is emulated")
  row, k = np.arange(rows)[:, None], np.arange(32 // itemsize)[None, :]
  if k_major: address = start + (row // 8) * stride + (row % 8) * ROW_BYTES + itemsize * k
  else: address = start + (row // 64) * leading + (k // 8) * stride + (k % 8) * ROW_BYTES + 2 * (row % 64)
  address = swizzled(address)
  if np.any(address >= shared.size * itemsize): raise IndexError("a wgmma operand reads past the end of shared memory")
  return shared[address // itemsize]


def to_float(bits: np.ndarray, dtype: str) -> np.ndarray:
  """float16/bfloat16 bit patterns (uint16) -> float32; float32 bits (uint32) -> float32 truncated to TF32 (the
  tensor cores use the upper 19 bits)."""
  if dtype == "float32": return (bits & np.uint32(0xFFFFE000)).view(np.float32)
  if dtype == "float16": return bits.view(np.float16).astype(np.float32)
  return (bits.astype(np.uint32) << 16).view(np.float32)


def from_float(values: np.ndarray, dtype: str) -> np.ndarray:
  """float32 -> the output's bits (float16/bfloat16 rounded to nearest even, as cvt.rn), or float32 itself."""
  if dtype == "float32": return values.astype(np.float32)
  if dtype == "float16": return values.astype(np.float16).view(np.uint16)
  bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
  return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def emulate_wgmma_matmul(plan: WgmmaMatmul, c: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
  """Run the kernel of `plan` on flat buffers: a, b as bit patterns (uint16; TF32: uint32), c as the output's (uint16
  bits, or float32 where plan.out_dtype is float32), written in place; batch entry e's operands start plan.*_batch e
  elements in. CTA by CTA, each over its items (wgmma_tiles.cta_items: one, or a persistent CTA's), its K steps
  counted across them as the kernel counts its stages."""
  for cta in range(plan.global_size[0]):
    counted = 0
    for item in cta_items(plan, cta):
      entry, tile_m, tile_n = item_tile(plan, item)
      _emulate_tile(plan, c[entry * plan.c_batch:], a[entry * plan.a_batch:], b[entry * plan.b_batch:], tile_m,
                    tile_n, counted)
      counted += plan.k // plan.block_k


def _emulate_tile(plan: WgmmaMatmul, c: np.ndarray, a: np.ndarray, b: np.ndarray, tile_m: int, tile_n: int,
                  counted: int) -> None:
  """One item: the (tile_m, tile_n) block tile of one batch entry, its K steps in stages from count `counted` on."""
  pieces_a = np.arange(plan.block_m * plan.block_k // plan.piece_elements)
  pieces_b = np.arange(plan.block_n * plan.block_k // plan.piece_elements)
  lanes = np.arange(plan.piece_elements)
  itemsize = plan.itemsize
  thread = np.arange(WARPGROUP_THREADS)[:, None]
  element = np.arange(plan.block_n // 2)[None, :]
  fragment_rows, fragment_columns = accumulator_position(thread, element)
  shared = np.zeros(plan.stages * plan.stage_bytes // itemsize, dtype=WORDS[itemsize])
  a_block = tile_m * plan.block_m * (plan.a_row_stride if plan.a_k_major else 1)
  b_block = tile_n * plan.block_n * (plan.b_row_stride if plan.b_k_major else 1)
  fragments = np.zeros((plan.warpgroups, WARPGROUP_THREADS, plan.block_n // 2), dtype=np.float32)
  for step in range(plan.k // plan.block_k):
    stage_base = ((counted + step) % plan.stages) * plan.stage_bytes
    for pieces, copy, source, first in ((pieces_a, a_copy, a, a_block), (pieces_b, b_copy, b, b_block)):
      source_offset, target = copy(plan, pieces, step)
      shared[(stage_base + target)[:, None] // itemsize + lanes] = source[(first + source_offset)[:, None] + lanes]
    for warpgroup in range(plan.warpgroups):
      # the warpgroup's accumulators as the 64 x N matrix D they hold (fragment i of thread t is D at its position)
      accumulator = np.zeros((64, plan.block_n), dtype=np.float32)
      accumulator[fragment_rows, fragment_columns] = fragments[warpgroup]
      for j in range(plan.block_k // plan.instruction_k):
        a_start, b_start = operand_starts(plan, warpgroup, j)
        a_leading, a_stride = plan.a_leading_stride()
        b_leading, b_stride = plan.b_leading_stride()
        operand_a = read_operand(shared, descriptor(stage_base + a_start, a_leading, a_stride), 64, plan.a_k_major)
        operand_b = read_operand(shared, descriptor(stage_base + b_start, b_leading, b_stride), plan.block_n,
                                 plan.b_k_major)
        accumulator += to_float(operand_a, plan.dtype) @ to_float(operand_b, plan.dtype).T
      fragments[warpgroup] = accumulator[fragment_rows, fragment_columns]
  for warpgroup in range(plan.warpgroups):
    rows = tile_m * plan.block_m + warpgroup * 64 + fragment_rows
    columns = tile_n * plan.block_n + fragment_columns
    c[rows * plan.n + columns] = from_float(fragments[warpgroup], plan.out_dtype)


# ---------------------------------------------------------------- the PYTHON device's wgmma program

WGMMA_PROGRAM_FORMAT = "ourgrad-python-wgmma-v1"


def wgmma_program_text(name: str, plan: WgmmaMatmul, arguments: dict[str, int]) -> str:
  """The PYTHON device's "source" of an OptOps.WGMMA kernel: its plan and argument positions as JSON."""
  return json.dumps({"format": WGMMA_PROGRAM_FORMAT, "name": name, "plan": dataclasses.asdict(plan),
                     "arguments": arguments}) + "\n"


def is_wgmma_program(binary: bytes) -> bool:
  return binary.startswith(b'{"format": "' + WGMMA_PROGRAM_FORMAT.encode())


class WgmmaProgram:
  """An OptOps.WGMMA kernel on the PYTHON device: emulate_wgmma_matmul on its buffers (raw byte arrays)."""

  def __init__(self, name: str, binary: bytes):
    document = json.loads(binary.decode())
    self.name, self.plan, self.arguments = name, WgmmaMatmul(**document["plan"]), document["arguments"]

  def __call__(self, *buffers: np.ndarray, global_size: tuple[int, ...] = (1, 1, 1),
               local_size: tuple[int, ...] = (1, 1, 1), wait: bool = False, vals: tuple[int, ...] = ()) -> float | None:
    start = time.perf_counter()
    if tuple(global_size) != self.plan.global_size or tuple(local_size) != self.plan.local_size:
      raise ValueError(f"{self.name} launched as {global_size}x{local_size}, its plan needs "
                       f"{self.plan.global_size}x{self.plan.local_size}")
    out = buffers[self.arguments["c"]].view(np.float32 if self.plan.out_dtype == "float32" else np.uint16)
    word = WORDS[self.plan.itemsize]
    emulate_wgmma_matmul(self.plan, out, buffers[self.arguments["a"]].view(word),
                         buffers[self.arguments["b"]].view(word))
    return time.perf_counter() - start if wait else None
