"""Hand-coded CPU register tiles for matmul-shaped reduces (called by heuristic.hand_coded_optimizations): a tile of
rows x SIMD registers of columns sized from the target's vector width and register count, the columns innermost so
the C compiler (or LLVM's SLP vectorizer) keeps each row's accumulators in vector registers, then a cache block of
column tiles sized from the L2 (docs/backends.md, "CPU matmul tiles").
"""
from __future__ import annotations

import math
from typing import Iterator

from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.helpers import prod
from ourgrad.ops import MemBuffer

# CPU matmul register tile: at most CPU_TILE_ROWS rows x CPU_TILE_VECTORS SIMD registers of columns. The rows are as
# many as the target's vector registers hold without spilling: an accumulator per row and column register, the
# column registers themselves and the row's broadcast value. AVX-512 (32 registers): 8 rows x 2 vectors; AVX2 (16):
# 6 x 2 (8 x 2 spilled 3 accumulators to the stack in every reduce step). One run each, one core, float32, GFLOP/s by
# CPU time, AVX2 (-march=x86-64-v3, Zen 5): 6x2 against 8x2 at 1536^3 88 / 64, 1024x1040x1024 119 / 79,
# 1024x768x768 113 / 78, 256x512x784 111 / 65; 4x3 88, 4x2 62, 3x4 72, 12x1 79 at 1536^3. AVX-512 8x2 against 16x1
# 156/159/104 against 120/146/64 at 1024/1536/2048. More accumulators are refused by MAX_UPCAST_LANES.
CPU_TILE_ROWS = 8
CPU_TILE_VECTORS = 2
CPU_MAX_TILE_COLUMNS = 32
# the B panel of a block of column tiles (reduce length x the block's columns) fills at most this share of the L2, so
# it stays there while every row tile passes over it (see _cpu_cache_block)
CPU_PANEL_SHARE_OF_L2 = 0.5
# a rows axis the tile's rows do not divide is padded up to a multiple of them (PADTO: the padded rows' loads are
# masked, their stores skipped) where that adds at most this share of its length: a 256-row batch on AVX2 takes
# 43 tiles of 6 rows (258) rather than 32 tiles of 8 that spill
CPU_MAX_ROW_PADDING = 1 / 8
# a tall tile's rows (_tall_rows) at most where they are read a multiple of L1_SET_STRIDE bytes apart (the images of
# a batch): such rows share one L1 set, which holds 12 lines on current x86 cores (48 KiB, 12-way); 16 batch rows
# evicted each other (the 3x3 conv forward at AVX-512: 21 ms, against 15 with 8 rows)
CPU_MAX_TALL_ROWS = 12
L1_SET_STRIDE = 4096


def buffer_loads(kernel: Kernel) -> list:
  """The views of the kernel's loads from buffers (not constants)."""
  return [st for st, leaf in zip(kernel.sts[1:], kernel.leaves[1:]) if isinstance(leaf.arg, MemBuffer)]


def matmul_like(kernel: Kernel) -> bool:
  """Some input is reused across outputs while it varies along the reduce (a matmul or convolution operand):
  register tiles pay off there. A per-output value (stride 0 on every reduce axis) does not count."""
  for st in buffer_loads(kernel):
    strides = st.real_strides()
    reused = any(strides[axis] == 0 for axis in range(kernel.first_reduce))
    varies = any(strides[axis] != 0 for axis in range(kernel.first_reduce, kernel.shape_len))
    if reused and varies: return True
  return False


def cpu_tile_rows(vector_registers: int, vectors: int = CPU_TILE_VECTORS) -> int:
  """Rows of the register tile that `vector_registers` hold with `vectors` column registers: an accumulator per row
  and column register, plus the column registers and one broadcast row value (at most CPU_TILE_ROWS)."""
  return max(1, min(CPU_TILE_ROWS, (vector_registers - vectors - 1) // vectors))


def cpu_tile_shape(vector_bytes: int, itemsize: int = 4, vector_registers: int = 32) -> tuple[int, int]:
  """(rows, columns) of the CPU matmul register tile for a SIMD width, element size and vector register count."""
  lanes = max(vector_bytes // itemsize, 1)
  return cpu_tile_rows(vector_registers), min(lanes * CPU_TILE_VECTORS, CPU_MAX_TILE_COLUMNS)


def _cpu_tile_axes(kernel: Kernel) -> Iterator[tuple[bool, int, int]]:
  """(contiguous, rows axis, columns axis) of a matmul-shaped CPU reduce, best first: the columns axis is one along
  which some input is contiguous (stride 1, vector loads) while another input broadcasts it; the rows axis is another
  output axis that the contiguous input broadcasts (its value is reused across the columns from a register). Then,
  for A.B^T (both operands contiguous along the reduce only), columns along which an input is strided: the
  renderer builds that vector from scalar loads once per reduce step and reuses it across the rows."""
  loads = buffer_loads(kernel)
  for column_strides in ((1,), None):
    for columns in reversed(range(kernel.first_reduce)):
      streamed = [st for st in loads if (st.real_strides()[columns] in column_strides if column_strides else
                                         st.real_strides()[columns] not in (0, 1, None))]
      if not streamed or not any(st.real_strides()[columns] == 0 for st in loads): continue
      for rows in reversed(range(kernel.first_reduce)):
        if rows != columns and any(st.real_strides()[rows] == 0 for st in streamed):
          yield column_strides is not None, rows, columns


# a rows axis shorter than the tile (a 5x5 or 3x3 convolution's kernel width) may be the tile's rows whole, when no
# axes pair divides the full tile: MNIST's first conv weight gradient (25 taps x 16 channels) as 5 rows x 16 columns
# took 0.94 ms instead of 10.9 with 4 scalar accumulators (2 cores, one run)
CPU_MIN_WHOLE_ROWS = 3


def _row_choices(tile_rows: int, float_reduce: bool) -> list[tuple[int, str]]:
  """How the tile's rows may fit a rows axis, best first: (rows, "divides" | "padded" | "whole"). Padding needs a
  float reduce (a padded row reads 0s; an integer kernel could divide by them). Where the register count allows fewer
  than CPU_TILE_ROWS rows, CPU_TILE_ROWS rows that divide come before a short axis taken whole: spilled a little,
  they still beat 4 rows (AVX2, 1536^3: 8x2 64 GFLOP/s against 4x2 62, 1024^3 66 against 44)."""
  choices = [(tile_rows, "divides")] + ([(tile_rows, "padded")] if float_reduce else [])
  if tile_rows < CPU_TILE_ROWS: choices.append((CPU_TILE_ROWS, "divides"))
  return choices + [(tile_rows, "whole")]


def _cpu_tile_row_count(size: int, tile_rows: int, fit: str) -> int:
  """Rows of the tile along an axis of `size` for one of _row_choices' fits: `tile_rows` where they divide it
  ("divides"; fewer rows would take an earlier axes pair with a weaker tile over a later one with the full tile: the
  CNN step's 5x5 input gradient as 4 rows x 32 columns ran at 52 GFLOP/s, as 8 x 32 at 81, one AVX-512 core), or
  where padding the axis up to a multiple adds at most CPU_MAX_ROW_PADDING of it ("padded"); a short axis
  (CPU_MIN_WHOLE_ROWS up to the tile's rows) taken whole ("whole"); 0 where none fits."""
  if fit == "whole": return size if CPU_MIN_WHOLE_ROWS <= size < tile_rows else 0
  if fit == "divides": return tile_rows if size % tile_rows == 0 else 0
  padding = -size % tile_rows
  return tile_rows if 0 < padding <= size * CPU_MAX_ROW_PADDING else 0


def _aliased(kernel: Kernel, axis: int, readers: list) -> bool:
  """Whether some of the views `readers` reads consecutive values along `axis` a multiple of L1_SET_STRIDE bytes apart
  (in one L1 set)."""
  itemsize = kernel.reduceop.dtype.itemsize
  return any((stride := st.real_strides()[axis]) and (stride * itemsize) % L1_SET_STRIDE == 0 for st in readers)


def _tall_rows(kernel: Kernel, rows: int, columns: int, registers: int) -> int:
  """Rows of a tile of one register of gathered columns: the largest divisor of the rows axis above CPU_TILE_ROWS
  that the registers hold (an accumulator a row, the gathered vector, the broadcast row value), at most
  CPU_MAX_TALL_ROWS where the row values share an L1 set; 0 where none fits, or where the gathered lanes share one
  (the images of a batch as columns: 16 lanes 256 KiB apart)."""
  loads = buffer_loads(kernel)
  if _aliased(kernel, columns, [st for st in loads if st.real_strides()[columns] != 0]): return 0
  row_aliased = _aliased(kernel, rows, [st for st in loads if st.real_strides()[columns] == 0])
  limit = min(registers - 2, CPU_MAX_TALL_ROWS) if row_aliased else registers - 2
  return next((count for count in range(limit, CPU_TILE_ROWS, -1) if kernel.full_shape[rows] % count == 0), 0)


def _tile_tries(kernel: Kernel, registers: int, lanes: int,
                tile_columns: int) -> Iterator[tuple[int, int, int, int, str]]:
  """(rows axis, columns axis, rows, columns, row fit) to try, best first. Columns: two SIMD registers where they
  divide the axis, else one. Rows: what the registers hold beside those columns (cpu_tile_rows) where the columns
  are contiguous vector loads. Where each column vector is built from scalar loads (strided columns: a convolution's
  gradients and forward over channels) the built vector is what costs, and each one serves a row per accumulator:
  first one register of columns with as many rows as the registers hold (_tall_rows: 16 with AVX-512, where
  MAX_UPCAST_LANES refuses 24, 12 or 10 with AVX2; the CNN step at AVX-512 173 -> 146 ms, AVX2 195 -> 191), then
  CPU_TILE_ROWS rows of two registers,
  spilled or not (AVX2, the 5x5 weight gradient: 8 rows 51 ms, 6 rows 61). Contiguous columns with padded rows come
  before strided columns with rows that divide: A.B with 1024 rows on AVX2 took 768 strided columns as its 6 rows
  (25 GFLOP/s) instead of padding its rows to 1026 (113)."""
  pairs = list(_cpu_tile_axes(kernel))
  float_reduce = kernel.reduceop.dtype.is_float
  for contiguous in (True, False):
    tries: list[tuple[int, int, tuple[int, int, int, int, str]]] = []   # (choice rank, pair rank, the try)
    for rank, (kind, rows, columns) in enumerate(pairs):
      column_count = next((count for count in (tile_columns, lanes) if kernel.full_shape[columns] % count == 0), 0)
      if kind != contiguous or not column_count: continue
      tile_rows = cpu_tile_rows(registers, column_count // lanes) if contiguous else CPU_TILE_ROWS
      if not contiguous and kernel.full_shape[columns] % lanes == 0:
        tall = _tall_rows(kernel, rows, columns, registers)
        if tall: tries.append((-1, rank, (rows, columns, tall, lanes, "divides")))
      for choice, (rows_wanted, fit) in enumerate(_row_choices(tile_rows, float_reduce)):
        row_count = _cpu_tile_row_count(kernel.full_shape[rows], rows_wanted, fit)
        if row_count: tries.append((choice, rank, (rows, columns, row_count, column_count, fit)))
    # contiguous columns: the full rows (dividing or padded) with two registers of columns before one, then the fits
    # in order: a packed filter's output channels (rows padded) before 8 image columns (one register; AVX2, the 3x3
    # input gradient and forward of the CNN step: 89-94 -> 112-117 GFLOP/s) or 24 (the 5x5 input gradient)
    def rank(entry: tuple[int, int, tuple[int, int, int, int, str]]) -> tuple[int, ...]:
      return (entry[0] > 1, -entry[2][3], *entry[:2]) if contiguous else entry[:2]
    yield from (attempt for _, _, attempt in sorted(tries, key=rank))


def cpu_matmul_tiles(kernel: Kernel) -> bool:
  """CPU matmul register tile (rows x two SIMD registers of columns, or one register of columns where two do not
  divide), the columns innermost so the C compiler packs each row's accumulators into vector registers and the column
  loads into vector loads, then the cache block (_cpu_cache_block). The first of _tile_tries that applies is taken (a
  padded rows axis is padded first). False (kernel untouched) where the kernel is not matmul-shaped or none fits."""
  if not matmul_like(kernel) or kernel.reduceop.dtype.itemsize > 8: return False
  vector_bytes = getattr(kernel.renderer, "vector_bytes", 16)  # renderers that do not say: SSE/NEON width
  registers = getattr(kernel.renderer, "vector_registers", 16)
  _, tile_columns = cpu_tile_shape(vector_bytes, kernel.reduceop.dtype.itemsize, registers)
  lanes = max(vector_bytes // kernel.reduceop.dtype.itemsize, 1)
  for rows, columns, row_count, column_count, fit in _tile_tries(kernel, registers, lanes, tile_columns):
    start = kernel._state()
    if fit == "padded" and not kernel.try_opt(Opt(OptOps.PADTO, rows, row_count)): continue
    # rows first: the upcast applied last varies fastest in the unrolled code, and the columns must be the fastest
    if not kernel.try_opt(Opt(OptOps.UPCAST, rows, row_count)):
      kernel._restore(start)
      continue
    # a rows axis the tile used whole leaves its place (the upcast lands at the end): no split, the length is kept
    rows_dropped = kernel.shape_len <= len(start[0][0].shape)
    columns_after = columns - (1 if rows_dropped and rows < columns else 0)
    # the operand streamed along the columns (B), by its place among the loads: the upcasts keep that order
    streamed = [index for index, st in enumerate(buffer_loads(kernel)) if st.real_strides()[columns_after] != 0]
    axes_before = kernel.shape_len
    if kernel.try_opt(Opt(OptOps.UPCAST, columns_after, column_count)):
      columns_left = columns_after if kernel.shape_len > axes_before else None
      tiles = _column_tiles_axis(kernel, columns_left, streamed)
      if tiles is not None: _cpu_cache_block(kernel, tiles, column_count)
      return True
    kernel._restore(start)
  return False


def _column_tiles_axis(kernel: Kernel, columns_left: int | None, streamed: list[int]) -> int | None:
  """The output axis that steps from one column tile to the next once the tile's columns are upcast: what is left of
  the columns axis (`columns_left`), or where the tile took it whole (a packed operand, lazy_reduce.py
  cpu_packed_matmul: (N/T, K, T)) the output axis along which only the `streamed` loads vary. None where there is
  none."""
  if columns_left is not None: return columns_left
  loads = buffer_loads(kernel)
  for axis in range(kernel.global_dims):
    varies = [index for index, st in enumerate(loads) if st.real_strides()[axis] != 0]
    if varies and set(varies) <= set(streamed) and len(varies) < len(loads) and kernel.full_shape[axis] > 1:
      return axis
  return None


def _cpu_cache_block(kernel: Kernel, columns: int, tile_columns: int) -> None:
  """Cache block (BLOCK): where the column tiles' panels of the streamed operand (reduce length x tile columns each)
  together overflow the L2, the column tiles go in blocks whose panels fill CPU_PANEL_SHARE_OF_L2 of it, the block
  loop outermost: each panel is then read from memory once and reused by every row tile from the L2, instead of being
  read again for each row tile (2048^3 float32, one core: AVX-512 65 -> 104 GFLOP/s, AVX2 24 -> 51). The L2 size is
  the renderer's (the host CPU's, runtime/ops_clang.py); renderers that do not say get none."""
  l2_bytes = getattr(kernel.renderer, "l2_cache_bytes", 0)
  if not l2_bytes or columns >= kernel.global_dims: return
  reduce_length = prod(kernel.full_shape[kernel.first_reduce:kernel.first_upcast])
  panel = reduce_length * tile_columns * kernel.reduceop.dtype.itemsize
  tiles = kernel.full_shape[columns]
  if panel * tiles <= l2_bytes: return
  fitting = int(l2_bytes * CPU_PANEL_SHARE_OF_L2 // panel)
  # a panel too long for the L2 on its own (a reduce of many thousands) would need the reduce blocked too: left as is
  amount = max((count for count in range(2, min(fitting, tiles) + 1) if tiles % count == 0), default=0)
  if amount: kernel.try_opt(Opt(OptOps.BLOCK, columns, amount))


# Reduce blocks (split K): the streamed operand's panel (reduce length x a tile's columns) is read one cache line a
# reduce step, a row stride apart. With 4 KiB pages, a line's place within its page picks which part of the L2 it may
# use: lines a multiple of 4 KiB apart (a power-of-two row of 1024 or more float32) all land in 1/64 of the L2, lines
# 6 KiB apart (1536 columns) in 2/64. Where the panel has more lines than that part holds, every row tile reads it
# from L3 again (2048^3 float32 at AVX2: 2.1x numpy's time). The reduce is then split into parts whose panels fit
# CPU_REDUCE_PANEL_SHARE of that part, each part a matmul of its own into partial results that are added after.
# The share: how many lines a part's panel may have, in L2 lines of its page positions; measured (one AVX2 core, Zen 5,
# 1 MiB L2, float32, ms by CPU time, parts of 128/256/512): 2048^3 238/202/201 (373 whole), 1536^3 72/66/65 (88),
# 1024^3 26/30/25 (32); a stride that is not aliased (1000x1024x1040) 20/19/18 (18 whole): the hardware prefetcher
# keeps a panel of twice the lines its positions hold flowing, more than those of one part miss again.
PAGE_BYTES = 4096
CACHE_LINE_BYTES = 64
CPU_REDUCE_PANEL_SHARE = 2.0
# Only a panel whose lines take at most this many line positions of a page is split: rows 3 KiB apart (768 columns,
# 4 positions) lost from a split at AVX-512 (one core, ms, whole / 2 parts / 3: 1536x3072x768 34 / 48 / 40,
# 768x3072x768 18 / 21 / 20; AVX2 768x3072x768 34 / 39 / 35), where rows 4 and 6 KiB apart (1 and 2) win at both widths.
CPU_REDUCE_MAX_POSITIONS = 2


def cpu_reduce_parts(reduce_length: int, stride_bytes: int, l2_bytes: int) -> int:
  """Parts to split a CPU matmul's reduce of `reduce_length` into, where the streamed operand's consecutive reduce
  elements are `stride_bytes` apart and the core's L2 holds `l2_bytes`: 1 (no split) where the panel's lines fit the
  L2 lines their page offsets may use or take more than CPU_REDUCE_MAX_POSITIONS of them, else the fewest parts
  (dividing the reduce) whose pieces fit."""
  if not l2_bytes or stride_bytes <= 0: return 1
  # the distinct line positions within a page that the panel's lines take, and the L2 lines each position has
  positions = PAGE_BYTES // max(math.gcd(stride_bytes, PAGE_BYTES), CACHE_LINE_BYTES)
  fitting_lines = int(positions * (l2_bytes // PAGE_BYTES) * CPU_REDUCE_PANEL_SHARE)
  if positions > CPU_REDUCE_MAX_POSITIONS or reduce_length <= fitting_lines: return 1
  return next((parts for parts in range(2, reduce_length + 1)
               if reduce_length % parts == 0 and reduce_length // parts <= fitting_lines), 1)


# B-panel packing: a CPU matmul reads its streamed operand B (varying along the output columns N) one row of a column
# tile (the tile's columns, a cache line or two) a reduce step. Where B is read transposed (x @ w.T, a Linear layer's
# weight: the tile's columns lie a row of w apart) each column vector is gathered from scalar loads; where B's rows lie
# a multiple of 4 KiB apart (or 2 page line positions, as for cpu_reduce_parts) a tile's panel (reduce length x tile
# columns) shares a few L1 sets and a small part of the L2. A packed copy of B, its column tiles one after another,
# each tile's panel contiguous in reduce order (N/T, K, T), turns every panel into one sequential stream of vector
# loads. One core, float32, ms by CPU time, one run each (plain / packed), x86-64-v3 then native (AVX-512):
#   transposed B: 1024^3 52.1 / 18.0, 96.6 / 10.7; 768x768 @ 768x3072 49.8 / 31.2, 36.3 / 15.9; 256x784 @ 784x512
#   3.68 / 2.09, 1.88 / 1.31; 64x512 @ 512x512 0.70 / 0.60, 0.65 / 0.49; not aliased 1024x1040 @ 1040x1040 28.2 / 18.9,
#   18.8 / 19.3.
#   B aliased: 1024^3 25.4 / 19.0, 10.4 / 9.6; 1024x1024 @ 1024x1536 30.7 / 26.7, 17.0 / 14.8; 2048x256 @ 256x1024
#   13.8 / 9.6, 5.8 / 5.2; with few rows the copy (one pass over B, once per matmul) does not pay: 512x256 @ 256x512
#   1.33 / 1.38, 0.75 / 0.74.
#   B neither: 1024x1024 @ 1024x1040 18.2 / 18.1, 10.7 / 10.6; 1024x2048 @ 2048x1040 41.1 / 37.1, 25.6 / 29.3;
#   512x256 @ 256x784 1.90 / 2.23: not packed.
CPU_PACK_MIN_ROWS = 512
CPU_PACK_MIN_ROWS_GATHERED = 64


def cpu_pack_columns(rows: int, columns: int, column_stride: int, reduce_stride_bytes: int, vector_bytes: int,
                     vector_registers: int, itemsize: int = 4) -> int:
  """The column tile T to pack a CPU matmul's streamed operand B in (its panels (N/T, K, T)), where B's consecutive
  columns are `column_stride` elements apart and its consecutive reduce elements `reduce_stride_bytes` bytes apart:
  the register tile's columns (cpu_tile_shape) where they divide the `columns` (N) and either B is read transposed
  (columns gathered, at least CPU_PACK_MIN_ROWS_GATHERED rows) or its rows alias in the caches (at most
  CPU_REDUCE_MAX_POSITIONS line positions of a page, at least CPU_PACK_MIN_ROWS rows); 0 where it is not packed."""
  _, tile_columns = cpu_tile_shape(vector_bytes, itemsize, vector_registers)
  if columns % tile_columns or columns <= tile_columns: return 0
  if abs(column_stride) != 1: return tile_columns if rows >= CPU_PACK_MIN_ROWS_GATHERED else 0
  positions = PAGE_BYTES // max(math.gcd(abs(reduce_stride_bytes), PAGE_BYTES), CACHE_LINE_BYTES)
  return tile_columns if rows >= CPU_PACK_MIN_ROWS and positions <= CPU_REDUCE_MAX_POSITIONS else 0


# Gathered-operand packing for convolution-shaped reduces: a reduce of a product whose register tile has no full
# contiguous columns (no output axis that the tile's two registers of columns divide along which one operand is stride
# 1 and the other broadcast) takes one register of contiguous columns or builds each column vector from scalar loads,
# one per lane (a convolution's filter read along its output channels, a weight gradient's output gradient along its
# channels). Where an operand is a plain view (one View) that varies along an output axis the other operand
# broadcasts, a copy of it with that axis innermost turns the gathers into vector loads and the reduce into the
# register tile of a matmul. The copy costs one pass over the operand, so only an operand reused across at least
# CPU_PACK_MIN_ROWS_GATHERED outputs per element is packed (the filter: every pixel of every image; the output gradient
# of a weight gradient: input channels x taps), the smaller one where both qualify. The CNN step of examples/mnist.py
# (batch 128, one core, ms by CPU time, Zen 5): AVX-512 135 -> 83 (its 5x5 convolutions 100-120 -> 208-233 GFLOP/s),
# AVX2 178 -> 132.


def cpu_gathered_pack(shape: tuple[int, ...], reduce_axes: tuple[int, ...],
                      operand_strides: list[tuple[int | None, ...]], packable: list[bool],
                      vector_bytes: int, itemsize: int = 4) -> tuple[int, int] | None:
  """(operand, output axis) of a product of two operands (their `operand_strides` over `shape`, None where an axis
  has no single stride) summed over `reduce_axes`, whose operand should be packed with that axis innermost; None where
  a register tile already has full contiguous columns or no `packable` operand is reused enough (see above)."""
  lanes = max(vector_bytes // itemsize, 1)
  _, tile_columns = cpu_tile_shape(vector_bytes, itemsize)
  outputs = [axis for axis in range(len(shape)) if axis not in reduce_axes and shape[axis] > 1]
  def streams(strides: tuple[int | None, ...], other: tuple[int | None, ...], axis: int, columns: int) -> bool:
    return other[axis] == 0 and strides[axis] not in (0, None) and shape[axis] % columns == 0
  for axis in outputs:
    if any(strides[axis] == 1 and streams(strides, other, axis, tile_columns)
           for strides, other in (operand_strides, operand_strides[::-1])): return None
  candidates = []
  for index, (strides, other) in enumerate((operand_strides, operand_strides[::-1])):
    reuse = prod(shape[axis] for axis in outputs if strides[axis] == 0)
    if not packable[index] or reuse < CPU_PACK_MIN_ROWS_GATHERED: continue
    # an operand contiguous along such an axis already (a packed copy) is not packed again
    if any(strides[axis] == 1 and streams(strides, other, axis, lanes) for axis in outputs): continue
    size = prod(shape[axis] for axis in range(len(shape)) if strides[axis] != 0)
    # full tiles of columns first, then the smaller operand, then the innermost axis
    candidates += [(shape[axis] % tile_columns != 0, size, -axis, index) for axis in outputs
                   if streams(strides, other, axis, lanes)]
  if not candidates: return None
  *_, axis, index = min(candidates)
  return index, -axis


# A packed product with few outputs and a long reduce (a weight gradient: 32x32x5x5 outputs summed over 128 images of
# 20x20 pixels) reads its operands once for every output tile; where they overflow the L2, each pass streams them from
# the L3 (or memory) again. A reduce axis (the outermost that can: the images, else the image rows) then goes in parts
# whose operands fill at most CPU_GATHERED_PART_SHARE of the L2, the parts outermost (every output tile of a part reads
# the part from the L2), the partial results summed after; only where those partials (parts x outputs) stay under the
# operands' bytes. AVX2, one core, ms: the CNN step's 5x5 weight gradient 26-38 -> 24 (32 parts of 4 images); the
# conv 32x16x64^2 -> 32 3x3 weight gradient 36 -> 12.4 (62 parts of one row of 32 images; AVX-512 21.7 -> 6.7).
CPU_GATHERED_PART_SHARE = 0.5


def cpu_gathered_reduce_parts(lengths: list[int], operand_bytes: int, output_bytes: int,
                              l2_bytes: int) -> tuple[int, int]:
  """(which of the reduce axes of `lengths`, outermost first, parts) to split a packed product's reduce into, where
  its operands take `operand_bytes` and its outputs `output_bytes`: (0, 1) (no split) where the operands fit the L2
  share or the partials would outweigh them, else the first axis with a part count (dividing it) whose share of the
  operands fits, the fewest such parts."""
  budget = l2_bytes * CPU_GATHERED_PART_SHARE
  if not l2_bytes or operand_bytes <= budget: return 0, 1
  for index, length in enumerate(lengths):
    parts = next((count for count in range(2, length + 1)
                  if length % count == 0 and operand_bytes / count <= budget), 0)
    if parts: return (index, parts) if parts * output_bytes < operand_bytes else (0, 1)
  return 0, 1
