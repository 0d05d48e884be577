"""Hopper warpgroup MMA (wgmma, sm_90a): the shared-memory tile layout its descriptors name, and a matmul kernel.

`wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16}` is issued by a warpgroup (4 consecutive warps, 128 threads)
and computes D (64 x N, float32, in registers) += A (64 x 16) @ B (16 x N), both operands read by the tensor cores
straight from shared memory. Each operand is named by a 64-bit matrix descriptor (`descriptor`): its start address,
two byte strides and a swizzle mode. This module uses the 128-byte swizzle throughout:

- The tile is stored in 128-byte rows (64 float16/bfloat16 elements), 8 rows to a 1024-byte "atom" (aligned to
  1024 bytes). Inside an atom the 16-byte piece p of row r lies at piece p ^ r (`swizzled`): the 8 rows' pieces of one
  column fall in 8 different bank groups, and so do a row's 8 pieces.
- K-major operand (rows run along K: A of a row-major matmul, or B given as N x K): row = M (N) index, 64 K elements a
  row; atoms follow each other every 8 rows (stride byte offset SBO = 1024); the leading byte offset is unused. The
  instruction's k16 slice j starts 32 j bytes into the row (the swizzle applies to the absolute address, so the
  start moves and the hardware swizzles what it reads).
- MN-major operand (rows run along N: B of a row-major matmul, K x N with N contiguous; the instruction transposes it,
  imm-trans-b = 1): row = K index, 64 N elements a row; a column of 64 N is `block_k` rows (8 K rows an atom, SBO =
  1024 between them) and the next 64 N follow after it (leading byte offset LBO = 128 block_k). The k16 slice j starts
  at row 16 j. A may be MN-major the same way (A stored K x M, M contiguous: the g^T of a weight gradient g^T @ x;
  imm-trans-a = 1, `a_k_major` False): each warpgroup's 64 rows of M are one such column.

TensorFloat-32 (`wgmma.mma_async.sync.aligned.m64nNk8.f32.tf32.tf32`, float32 operands where the user allows TF32):
the same bytes, 32 float32 elements a row (block_k = 32), each instruction 8 of K (32 bytes, as k16 of halves); the
tensor cores read the float32 bits and use their upper 19 (a truncation to TF32, no rounding). The instruction
cannot transpose a TF32 operand, so A and B must be K-major (B N x K: the x @ W^T of a Linear layer).

Accumulators (float32, N/2 per thread; PTX ISA "Matrix Fragments for wgmma.mma_async.m64nNk16"): thread t of the
warpgroup (warp w = t // 32, lane l) holds element i at row 16 w + l // 4 + 8 ((i >> 1) & 1), column 8 (i >> 2) +
2 (l % 4) + (i & 1) (`accumulator_position`): per warp, the mma.sync m16n8 C layout repeated along N.

The kernel (`render_wgmma_matmul`): C (M x N) = A (M x K row-major, or K x M without `a_k_major`) @ B (K x N,
row-major, or N x K with `b_k_major`) for float16/bfloat16 inputs and output (or float32 ones, TF32), float32
accumulation; sizes multiples of the block tile.
One CTA computes a block_m x block_n tile with block_m / 64 warpgroups (each 64 rows, one m64n{block_n}k16 per k16
step); all threads copy the tiles of a K step (block_k = 64) into shared memory with 16-byte cp.async, `stages` deep:

    copy K steps 0 .. stages-3 (one commit group each)
    for step s:
      wait for my copies of step s; fence.proxy.async (the tensor cores read through the async proxy); BARRIER
      wgmma.fence; 4 wgmma on stage s % stages; commit
      copy step s + stages - 2 into stage (s - 2) % stages; commit
      wait until at most 1 wgmma group is in flight (step s - 1 done)
    wait for all wgmma; convert and store the accumulators

The stage written in step s was last read by the wgmma of step s - 2: every warpgroup finished those before it passed
the BARRIER of step s (it waited for them at the end of step s - 1), so one barrier per step orders the reuse.
"""
from __future__ import annotations

from dataclasses import dataclass

from ourgrad.codegen.wgmma_copies import ATOM_BYTES, PIECE_BYTES, ROW_BYTES, a_copy, b_copy, thread_copies
from ourgrad.renderer import ASSUMED_CUDA_GPU

WARPGROUP_THREADS = 128
SWIZZLE_128B = 1   # the descriptor's swizzle mode field (bits 62-63)
# per operand dtype: bytes of an element, its PTX type, its C type; float32 is read by the tensor cores as TF32
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4}
PTX_TYPE = {"float16": "f16", "bfloat16": "bf16", "float32": "tf32"}
C_TYPE = {"float16": "unsigned short", "bfloat16": "unsigned short", "float32": "float"}
SLICE_BYTES = 32   # K bytes of one instruction: k16 of 16-bit elements, k8 of TF32


def swizzled(offset: int) -> int:
  """The byte where the 128-byte-swizzled layout stores the byte at unswizzled `offset` (from a 1024-aligned base):
  the 16-byte piece index (bits 4-6) XOR the row in the atom (bits 7-9)."""
  return offset ^ (((offset >> 7) & 7) << 4)


def descriptor(address: int, leading_bytes: int, stride_bytes: int) -> int:
  """The 64-bit wgmma matrix descriptor of a 128-byte-swizzled operand at shared `address` (PTX ISA "Matrix
  Descriptor Format": address, LBO and SBO each as (value & 0x3FFFF) >> 4 in 14 bits; base offset 0)."""
  def encode(value: int) -> int: return (value & 0x3FFFF) >> 4
  return encode(address) | encode(leading_bytes) << 16 | encode(stride_bytes) << 32 | SWIZZLE_128B << 62


def accumulator_position(thread: int, element: int) -> tuple[int, int]:
  """(row, column) in the 64 x N accumulator tile of float32 accumulator `element` of warpgroup thread `thread`."""
  warp, lane = thread // 32, thread % 32
  return 16 * warp + lane // 4 + 8 * ((element >> 1) & 1), 8 * (element >> 2) + 2 * (lane % 4) + (element & 1)


def paired_store_position(thread, element):
  """(row, column) where thread `thread`'s 8-byte store of a paired 16-bit epilogue starts, for the accumulators
  `element`, + 1 (column block j = element >> 2, j even) and element + 4, + 5 (block j + 1): an even lane keeps its
  block-j pair and takes its odd neighbour's (columns 8 j + 2 lane .. + 3), an odd lane takes its even neighbour's
  block-(j + 1) pair and keeps its own (8 (j + 1) + 2 lane - 2 .. + 3)."""
  row, column = accumulator_position(thread, element)
  return row, column + (thread & 1) * 6


# registers per thread: the most a thread may have, the producer's after setmaxnreg (what its copies need), the
# granule setmaxnreg counts in, and what a consumer needs beside its accumulators (a multiprocessor's file is the
# device's fact: WgmmaMatmul.multiprocessor_registers)
MAX_THREAD_REGISTERS, PRODUCER_REGISTERS, REGISTER_GRANULE = 255, 40, 8
ACCUMULATOR_OVERHEAD_REGISTERS = 32


def _granule(value: int) -> int: return value // REGISTER_GRANULE * REGISTER_GRANULE


def launch_registers(threads: int, ctas_per_sm: int, multiprocessor_registers: int) -> int:
  """Registers per thread that __launch_bounds__(threads, ctas_per_sm) leaves each thread (ptxas's cap) of a
  multiprocessor with `multiprocessor_registers`."""
  return _granule(min(MAX_THREAD_REGISTERS, multiprocessor_registers // (threads * ctas_per_sm)))


@dataclass(frozen=True)
class WgmmaTile:
  """What an OptOps.WGMMA asks of the kernel (its Opt's `arg`; plan_for_kernel adds the matmul's shape and layout):
  the block tile (64 rows per consumer warpgroup), the shared-memory stages, the kernel's kind (`specialized`: a
  producer warpgroup copies, the others compute; `deep`: the cooperative kernel copying stages - 1 steps ahead;
  neither: the cooperative kernel), CTAs per multiprocessor, and a persistent grid (the renderer's multiprocessors x
  ctas_per_sm CTAs looping over the tiles) or one CTA per tile."""
  block_n: int = 256
  stages: int = 4
  block_m: int = 128
  specialized: bool = False
  deep: bool = False
  ctas_per_sm: int = 1
  persistent: bool = False

  def describe(self) -> str:
    """For a reader: "128x256, 4 stages, SPECIALIZED, PERSISTENT"."""
    kinds = [name for flag, name in ((self.specialized, "SPECIALIZED"), (self.deep, "DEEP"),
                                     (self.ctas_per_sm > 1, f"{self.ctas_per_sm} CTAS/SM"),
                                     (self.persistent, "PERSISTENT")) if flag]
    return f"{self.block_m}x{self.block_n}, {self.stages} stages" + "".join(", " + kind for kind in kinds)


@dataclass(frozen=True)
class WgmmaMatmul:
  """One wgmma matmul kernel's shape and tiling (see the module docstring)."""
  m: int
  n: int
  k: int
  dtype: str = "float16"         # of A and B: "float16", "bfloat16" or "float32" (TF32)
  out_dtype: str = ""            # of C: the inputs' dtype (empty) or "float32"
  block_m: int = 128             # rows per CTA: 64 per warpgroup
  block_n: int = 256             # columns per CTA = the instruction's N (8..256, a multiple of 64 here)
  block_k: int = 0               # K per stage: one 128-byte row (64 halves, 32 floats; 0: that)
  stages: int = 4                # shared-memory stages (>= 3: two are being read while the rest fill)
  b_k_major: bool = False        # B given as N x K (K contiguous) instead of K x N
  a_k_major: bool = True         # A given as M x K (K contiguous); False: K x M (M contiguous, 16-bit only)
  b_lbo_sbo_swapped: bool = False  # the MN-major B descriptor with LBO and SBO exchanged (a layout probe)
  group_m: int = 8               # CTAs of neighbouring M rows run together (L2 reuse of B's columns)
  specialized: bool = False      # a producer warpgroup copies, the others only compute (mbarriers between them)
  deep: bool = False             # cooperative kernel: copy stages - 1 steps ahead (a second barrier per step)
  batch: int = 1                 # independent matmuls (grid y), each operand `*_batch` elements after the previous
  a_batch: int = 0               # (0: the same operand for every batch entry)
  b_batch: int = 0
  c_batch: int = 0
  # elements from one row of an operand to the next in memory (its leading dimension): rows run along K for a K-major
  # operand (0: dense, K) and along M (N) for an MN-major one (0: dense, M or N). A split-K partial reads K / parts
  # of each row, so its rows are longer than its K.
  a_row_stride: int = 0
  b_row_stride: int = 0
  # CTAs the launch bounds keep resident on one multiprocessor (registers per thread: 64K / (threads x this))
  ctas_per_sm: int = 1
  # a persistent grid of this many CTAs (the multiprocessors x ctas_per_sm), each looping over tiles (its next tile's
  # copies overlap its epilogue; specialized only); 0: one CTA per tile
  persistent_ctas: int = 0
  # the specialized producer's K steps of copies in flight beyond the one it just issued: 1 (0: that) waits for each
  # step's copies before issuing the one after next; up to stages - 2 (the most that cannot deadlock) keep more in
  # flight, measured 2-4% slower on the H200 (bench_wgmma_grid_h200_s11.txt)
  copy_lag: int = 0
  # 16-bit output: neighbouring lanes swap one packed pair so each thread stores 8 bytes (4 outputs) and a quad of
  # lanes 32 contiguous bytes of a row (whole sectors; half the store instructions); False: 4 bytes a store. H200
  # (results/matmul_h200_s13_checkpoint.txt): bf16 fc fwd 0.045 -> 0.033 ms, lm-head fwd 0.689 -> 0.486, 4096^3
  # 0.197 -> 0.181
  paired_stores: bool = True
  # specialized: each producer thread's copies of a step arrive on the stage's `full` barrier when they land
  # (cp.async.mbarrier.arrive), so the producer never waits for its copies (up to `stages` steps in flight) and the
  # consumers fence the async proxy after their wait; False: the producer waits copy_lag steps behind. H200: bf16
  # fc dW 0.040 -> 0.038 ms, qkv fwd unchanged (two rows measured: off until more are)
  async_arrive: bool = False
  # 32-bit registers of the multiprocessor it runs on (the device's fact, Renderer.registers_per_multiprocessor)
  multiprocessor_registers: int = ASSUMED_CUDA_GPU.registers_per_multiprocessor

  def __post_init__(self):
    if self.dtype not in ITEMSIZE: raise ValueError(f"wgmma matmul of {self.dtype}: float16/bfloat16/float32 (TF32)")
    if not self.out_dtype: object.__setattr__(self, "out_dtype", self.dtype)
    for operand, k_major, across in (("a", self.a_k_major, self.m), ("b", self.b_k_major, self.n)):
      dense = self.k if k_major else across
      stride = getattr(self, f"{operand}_row_stride") or dense
      object.__setattr__(self, f"{operand}_row_stride", stride)
      # each row starts a 16-byte cp.async piece, so it must start on a 16-byte boundary
      if stride < dense or stride * ITEMSIZE[self.dtype] % 16:
        raise ValueError(f"wgmma operand {operand.upper()} with rows {stride} elements apart: at least {dense}, "
                         "a multiple of 16 bytes")
    if not self.block_k: object.__setattr__(self, "block_k", ROW_BYTES // self.itemsize)
    if self.out_dtype not in (self.dtype, "float32"):
      raise ValueError(f"wgmma matmul of {self.dtype} into {self.out_dtype}: {self.dtype} or float32")
    if self.dtype == "float32" and not (self.b_k_major and self.a_k_major):
      raise ValueError("TF32 wgmma cannot transpose an operand: A must be M x K and B N x K (both K-major)")
    a_elements = (self.m if self.a_k_major else self.k) * self.a_row_stride
    b_elements = (self.n if self.b_k_major else self.k) * self.b_row_stride
    if max(a_elements, b_elements, self.m * self.n) >= 2 ** 31:
      raise ValueError(f"wgmma matmul {self.m}x{self.k}x{self.n}: an operand of 2^31 elements or more (int indices)")
    if self.block_m % 64 or self.block_n % 64 or self.block_n > 256 or self.block_k != ROW_BYTES // self.itemsize \
        or self.stages < 3:
      raise ValueError(f"wgmma tile {self.block_m}x{self.block_n}x{self.block_k}, {self.stages} stages")
    if self.m % self.block_m or self.n % self.block_n or self.k % self.block_k:
      raise ValueError(f"wgmma matmul {self.m}x{self.k}x{self.n} is not a multiple of its block tile "
                       f"{self.block_m}x{self.block_k}x{self.block_n}")
    if not self.copy_lag: object.__setattr__(self, "copy_lag", 1)
    if not 1 <= self.copy_lag <= max(1, self.stages - 2):
      raise ValueError(f"wgmma producer with {self.copy_lag} steps of copies in flight over {self.stages} stages: "
                       f"1 to {max(1, self.stages - 2)}")
    if self.persistent_ctas and not self.specialized:
      raise ValueError("a persistent wgmma grid needs the specialized kernel (its producer runs ahead into the next "
                       "tile)")
    if self.ctas_per_sm < 1 or self.persistent_ctas < 0:
      raise ValueError(f"wgmma kernel with {self.ctas_per_sm} CTAs per multiprocessor, {self.persistent_ctas} "
                       "persistent CTAs")
    # ptxas compiles the consumers under the launch's cap (setmaxnreg raises it only at run time): their N / 2
    # accumulators and the addressing around them must fit it
    if self.block_n // 2 + ACCUMULATOR_OVERHEAD_REGISTERS > self.launch_registers:
      raise ValueError(f"wgmma tile {self.block_m}x{self.block_n} with {self.ctas_per_sm} CTAs of {self.threads} "
                       f"threads per multiprocessor: {self.block_n // 2} accumulators a thread do not fit "
                       f"{self.launch_registers} registers")

  @property
  def launch_registers(self) -> int:
    """Registers per thread its launch bounds leave each thread (ptxas's cap)."""
    return launch_registers(self.threads, self.ctas_per_sm, self.multiprocessor_registers)

  @property
  def warpgroups(self) -> int: return self.block_m // 64

  @property
  def itemsize(self) -> int: return ITEMSIZE[self.dtype]

  @property
  def piece_elements(self) -> int:
    """Elements of one 16-byte copy piece."""
    return PIECE_BYTES // self.itemsize

  @property
  def instruction_k(self) -> int:
    """K of one wgmma: 16 (16-bit operands) or 8 (TF32)."""
    return SLICE_BYTES // self.itemsize

  @property
  def threads(self) -> int: return (self.warpgroups + self.specialized) * WARPGROUP_THREADS

  @property
  def a_stage_bytes(self) -> int: return self.block_m * ROW_BYTES

  @property
  def b_stage_bytes(self) -> int: return self.block_n * self.block_k * self.itemsize

  @property
  def stage_bytes(self) -> int: return self.a_stage_bytes + self.b_stage_bytes

  @property
  def shared_bytes(self) -> int:
    # + room to align the base, + the specialized kernel's mbarriers (8 bytes, full and empty per stage)
    return self.stages * self.stage_bytes + ATOM_BYTES + 16 * self.stages * self.specialized

  @property
  def name(self) -> str:
    major = ("" if self.a_k_major else "m") + ("k" if self.b_k_major else "n")
    out = "_f32" if self.out_dtype == "float32" else ""
    batched = f"{self.batch}x" if self.batch > 1 else ""
    variant = ("_swapped" if self.b_lbo_sbo_swapped else "") + ("_ws" if self.specialized else "") + \
      ("_deep" if self.deep else "") + (f"_g{self.group_m}" if self.group_m != 8 else "") + \
      (f"_c{self.ctas_per_sm}" if self.ctas_per_sm > 1 else "") + \
      (f"_p{self.persistent_ctas}" if self.persistent_ctas else "") + \
      (f"_lag{self.copy_lag}" if self.specialized and self.copy_lag != 1 else "") + \
      ("_single" if not self.paired_stores and self.out_dtype != "float32" else "") + \
      ("_arrive" if self.async_arrive and self.specialized else "")
    dtype = "tf32" if self.dtype == "float32" else self.dtype
    dense = (self.k if self.a_k_major else self.m), (self.k if self.b_k_major else self.n)
    strides = (self.a_row_stride, self.b_row_stride)
    rows = f"_rows{strides[0]}x{strides[1]}" if strides != dense else ""
    return (f"wgmma_{dtype}{out}_{batched}{self.m}_{self.n}_{self.k}_b{self.block_m}x{self.block_n}_"
            f"s{self.stages}_{major}{rows}{variant}")

  @property
  def tiles(self) -> int:
    """Block tiles of one batch entry."""
    return (self.m // self.block_m) * (self.n // self.block_n)

  @property
  def items(self) -> int:
    """Block tiles of all batch entries: item i is tile i % tiles of entry i // tiles."""
    return self.tiles * self.batch

  @property
  def ctas(self) -> int:
    """CTAs of the grid: one per item, or the persistent grid's (no more than the items)."""
    return min(self.items, self.persistent_ctas) if self.persistent_ctas else self.items

  @property
  def global_size(self) -> tuple[int, int, int]: return (self.ctas, 1, 1)

  @property
  def local_size(self) -> tuple[int, int, int]: return (self.threads, 1, 1)

  def a_leading_stride(self) -> tuple[int, int]:
    """(LBO, SBO) of A's descriptor (MN-major: as B's; one 64-row column per warpgroup, so LBO is not stepped)."""
    return (PIECE_BYTES, ATOM_BYTES) if self.a_k_major else (self.block_k * ROW_BYTES, ATOM_BYTES)

  def b_leading_stride(self) -> tuple[int, int]:
    """(LBO, SBO) of B's descriptor."""
    if self.b_k_major: return PIECE_BYTES, ATOM_BYTES
    pair = (self.block_k * ROW_BYTES, ATOM_BYTES)
    return pair[::-1] if self.b_lbo_sbo_swapped else pair


def _wgmma_instruction(plan: WgmmaMatmul) -> str:
  """The inline-asm statement of one m64n{block_n}k16 (TF32: k8) wgmma on the accumulator array `acc` (descriptors
  a_desc, b_desc): D += A @ B (scale-d = 1: the accumulators start at 0)."""
  count = plan.block_n // 2
  ptx_type = PTX_TYPE[plan.dtype]
  registers = ", ".join(f"%{i}" for i in range(count))
  # each operand transposed where it is MN-major (A K x M, B K x N). TF32 has no transpose operands (both K-major)
  transposes = "" if plan.dtype == "float32" else f", {0 if plan.a_k_major else 1}, {0 if plan.b_k_major else 1}"
  # scale-d is a predicate (set from an int operand, as 1): D = A @ B + D
  instruction = ("{ .reg .pred accumulate; setp.ne.b32 accumulate, %" + str(count + 2) + ", 0; "
                 f"wgmma.mma_async.sync.aligned.m64n{plan.block_n}k{plan.instruction_k}.f32.{ptx_type}.{ptx_type} "
                 f"{{{registers}}}, %{count}, %{count + 1}, accumulate, 1, 1{transposes}; }}")
  outputs = ", ".join(f'"+f"(acc[{i}])' for i in range(count))
  return f'asm volatile("{instruction}"\n      : {outputs}\n      : "l"(a_desc), "l"(b_desc), "r"(1));'


class CExpr:
  """An integer expression of the kernel, built with Python's operators and rendered as C (non-negative values, so
  // and % are C's / and %): the address formulas below evaluate on ints and numpy arrays (the emulator) and on
  CExprs (the CUDA source) alike."""

  def __init__(self, text: str): self.text = text

  def _op(self, other, op: str, reflected: bool = False) -> CExpr:
    other_text = other.text if isinstance(other, CExpr) else str(other)
    return CExpr(f"({other_text} {op} {self.text})" if reflected else f"({self.text} {op} {other_text})")

  def __add__(self, other): return self._op(other, "+")
  def __radd__(self, other): return self._op(other, "+", True)
  def __mul__(self, other): return self._op(other, "*")
  def __rmul__(self, other): return self._op(other, "*", True)
  def __floordiv__(self, other): return self._op(other, "/")
  def __mod__(self, other): return self._op(other, "%")
  def __xor__(self, other): return self._op(other, "^")
  def __and__(self, other): return self._op(other, "&")
  def __rshift__(self, other): return self._op(other, ">>")
  def __lshift__(self, other): return self._op(other, "<<")

  def __str__(self) -> str: return self.text


def operand_starts(plan: WgmmaMatmul, warpgroup, j):
  """Byte offsets in the stage where K slice `j`'s (one instruction's K) A (of `warpgroup`'s 64 rows) and B start
  (the descriptors' start addresses, before the stage's base)."""
  # K-major: 64 rows of 128 bytes a warpgroup; MN-major: one column of block_k rows a warpgroup
  if plan.a_k_major: a_start = warpgroup * 64 * ROW_BYTES + SLICE_BYTES * j
  else: a_start = warpgroup * plan.block_k * ROW_BYTES + 16 * ROW_BYTES * j
  b_start = plan.a_stage_bytes + (SLICE_BYTES * j if plan.b_k_major else 16 * ROW_BYTES * j)
  return a_start, b_start


def tile_of_block(plan: WgmmaMatmul, block):
  """(M tile, N tile) CTA `block` computes: CTAs run in groups of group_m M tiles down each column of N tiles (B's
  block columns are then reused from L2 by the CTAs running together)."""
  tiles_m, tiles_n = plan.m // plan.block_m, plan.n // plan.block_n
  group_m = min(plan.group_m, tiles_m)
  group = block // (group_m * tiles_n)
  first_m = group * group_m
  group_rows = _minimum((first_m * -1) + tiles_m, group_m)   # the last group may have fewer M tiles
  in_group = block + group * -(group_m * tiles_n)
  return first_m + in_group % group_rows, in_group // group_rows


def cta_items(plan: WgmmaMatmul, cta: int) -> range:
  """The items (tiles of batch entries, see WgmmaMatmul.items) CTA `cta` computes, in order: every ctas-th."""
  return range(cta, plan.items, plan.ctas)


def item_tile(plan: WgmmaMatmul, item):
  """(batch entry, M tile, N tile) of item `item`."""
  entry, tile = item // plan.tiles, item % plan.tiles
  return (entry, *tile_of_block(plan, tile))


def _minimum(value, limit: int):
  return CExpr(f"min({value}, {limit})") if isinstance(value, CExpr) else min(value, limit)


def _copy_lines(plan: WgmmaMatmul, thread: str, threads: int) -> list[str]:
  """The body of copy_step(step, stage): the 16-byte cp.async pieces of A's and B's tiles of one K step that copying
  thread `thread` (of `threads`) moves: from one address plus constants where thread_copies finds them, else a loop
  over its pieces."""
  lines = []
  piece, step = CExpr("piece"), CExpr("step")
  for name, pieces, copy in (("a", plan.block_m * plan.block_k // plan.piece_elements, a_copy),
                             ("b", plan.block_n * plan.block_k // plan.piece_elements, b_copy)):
    split = thread_copies(plan, name, CExpr(thread), threads, step)
    if split is None:
      source, target = copy(plan, piece, step)
      lines += [f"  for (int piece = {thread}; piece < {pieces}; piece += {threads})",
                f"    copy16(stage_base + {target}, {name}_block + {source});"]
      continue
    (source, target), offsets = split
    lines += ["  {",
              f"    const unsigned {name}_target = stage_base + {target};",
              f"    const {C_TYPE[plan.dtype]}* {name}_source = {name}_block + {source};",
              *[f"    copy16({name}_target + {target_offset}u, {name}_source + {source_offset});"
                for source_offset, target_offset in offsets],
              "  }"]
  return lines


def _store_body(plan: WgmmaMatmul) -> list[str]:
  """The store lambda's loop over the thread's accumulators: pairs (i, i + 1) of neighbouring columns, each one
  32-bit store of two halves (or a float2); with paired_stores (16-bit output) two such pairs a store
  (paired_store_position), the neighbouring lanes swapping one through a shuffle."""
  count = plan.block_n // 2
  def index(row, column) -> str:
    return (f"(tile_m * {plan.block_m} + warpgroup * 64 + {row}) * {plan.n} + tile_n * {plan.block_n} + {column}")
  if not (plan.paired_stores and plan.out_dtype != "float32"):
    row, column = accumulator_position(CExpr("thread"), CExpr("i"))
    return ["#pragma unroll",
            f"    for (int i = 0; i < {count}; i += 2) {{",
            f"      int index = {index(row, column)};",
            *["  " + line for line in _store_lines(plan)],
            "    }"]
  ptx_type = {"float16": "f16", "bfloat16": "bf16"}[plan.dtype]
  row, column = paired_store_position(CExpr("thread"), CExpr("i"))
  def pack(name: str, first: str) -> str:
    return (f'        unsigned {name}; asm("cvt.rn.{ptx_type}x2.f32 %0, %1, %2;" : "=r"({name}) : '
            f'"f"(acc[{first} + 1]), "f"(acc[{first}]));')
  # i walks the pairs of column blocks 2 j', 2 j' + 1 (8 accumulators), both row halves (i, i + 2)
  return ["    const int odd = thread & 1;",
          "#pragma unroll",
          f"    for (int block = 0; block < {count}; block += 8) {{",
          "#pragma unroll",
          "      for (int i = block; i < block + 4; i += 2) {",
          pack("low", "i"), pack("high", "i + 4"),
          "        unsigned swapped = __shfl_xor_sync(0xffffffffu, odd ? low : high, 1);",
          f"        int index = {index(row, column)};",
          "        *(uint2*)(c + index) = odd ? make_uint2(swapped, high) : make_uint2(low, swapped);",
          "      }",
          "    }"]


def _store_lines(plan: WgmmaMatmul) -> list[str]:
  """Store accumulators i and i + 1 (neighbouring columns) at C[index]: float32 as a float2, else converted and
  packed two to a 32-bit word (cvt's first source goes to the upper half)."""
  if plan.out_dtype == "float32": return ["    *(float2*)(c + index) = make_float2(acc[i], acc[i + 1]);"]
  ptx_type = {"float16": "f16", "bfloat16": "bf16"}[plan.dtype]
  return ["    unsigned packed;",
          f'    asm("cvt.rn.{ptx_type}x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(acc[i + 1]), "f"(acc[i]));',
          "    *(unsigned*)(c + index) = packed;"]


def _signature(plan: WgmmaMatmul, name: str, arguments: dict[str, int] | None) -> list[str]:
  """The kernel's first line: its parameters in argument order (`arguments`: the position of C, A and B; A and B
  may be one buffer) as data0, data1, ..."""
  out_type, in_type = C_TYPE[plan.out_dtype], C_TYPE[plan.dtype]
  positions = arguments or {"c": 0, "a": 1, "b": 2}
  params = {position: f"{out_type if operand == 'c' else 'const ' + in_type}* __restrict__ data{position}"
            for operand, position in positions.items()}
  return [f'extern "C" __global__ void __launch_bounds__({plan.threads}, {plan.ctas_per_sm}) {name}('
          f'{", ".join(params[position] for position in sorted(params))}) {{']


def _select_item(plan: WgmmaMatmul, positions: dict[str, int]) -> list[str]:
  """The lambda select(item): the item's tile (tile_m, tile_n) and its operands' and output's first elements
  (a_block, b_block, c), as item_tile says."""
  entry, tile_m, tile_n = item_tile(plan, CExpr("item"))
  b_block = f"tile_n * {plan.block_n * plan.b_row_stride if plan.b_k_major else plan.block_n}"
  a_block = f"tile_m * {plan.block_m * (plan.a_row_stride if plan.a_k_major else 1)}"
  return [
    "  auto select = [&](int item) {",
    f"    size_t entry = {entry};",
    # tiles in groups of group_m M tiles down one column of N tiles, so B's block columns are reused from L2
    f"    tile_m = {tile_m}; tile_n = {tile_n};",
    f"    a_block = data{positions['a']} + entry * {plan.a_batch} + {a_block};",
    f"    b_block = data{positions['b']} + entry * {plan.b_batch} + {b_block};",
    f"    c = data{positions['c']} + entry * {plan.c_batch};",
    "  };",
  ]


def render_wgmma_matmul(plan: WgmmaMatmul, name: str | None = None, arguments: dict[str, int] | None = None,
                        dynamic_shared_symbol: str = "ourgrad_dynamic_shared_bytes") -> str:
  """CUDA C++ (for NVRTC, sm_90a) of the matmul kernel `name` (default plan.name) taking its buffers in the order
  `arguments` gives (default c, a, b); launch with plan.global_size and plan.local_size, plan.shared_bytes of dynamic
  shared memory (the kernel exports that size as `dynamic_shared_symbol`, which ourgrad's CUDA runtime reads back at
  load)."""
  a_lbo, a_sbo = plan.a_leading_stride()
  b_lbo, b_sbo = plan.b_leading_stride()
  a_start, b_start = operand_starts(plan, CExpr("warpgroup"), CExpr("j"))
  copy_thread, copy_threads = ("thread", WARPGROUP_THREADS) if plan.specialized else ("threadIdx.x", plan.threads)
  positions = arguments or {"c": 0, "a": 1, "b": 2}
  in_type = C_TYPE[plan.dtype]
  lines = [
    f'extern "C" __device__ unsigned int {dynamic_shared_symbol} = {plan.shared_bytes};',
    "extern __shared__ __align__(1024) unsigned char wgmma_shared[];",
    "__device__ __forceinline__ unsigned long long wgmma_descriptor(unsigned address, unsigned lbo, unsigned sbo) {",
    "  return (unsigned long long)((address & 0x3FFFF) >> 4) | ((unsigned long long)((lbo & 0x3FFFF) >> 4) << 16) |",
    f"         ((unsigned long long)((sbo & 0x3FFFF) >> 4) << 32) | ({SWIZZLE_128B}ull << 62);",
    "}",
    "__device__ __forceinline__ void copy16(unsigned target, const void* source) {",
    '  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(target), "l"(source) : "memory");',
    "}",
    *(BARRIER_HELPERS if plan.specialized else []),
    *_signature(plan, name or plan.name, arguments),
    # the 128-byte swizzle is a function of address bits 7-9: the tiles start on a 1024-byte boundary
    "  unsigned shared_base = ((unsigned)__cvta_generic_to_shared(wgmma_shared) + 1023u) & ~1023u;",
    "  int tile_m = 0, tile_n = 0;",
    f"  const {in_type}* a_block = 0;",
    f"  const {in_type}* b_block = 0;",
    f"  {C_TYPE[plan.out_dtype]}* c = 0;",
    *_select_item(plan, positions),
    # with a producer, warpgroup -1 copies and 0.. compute
    f"  int warpgroup = threadIdx.x / 128{' - 1' if plan.specialized else ''}, thread = threadIdx.x % 128;",
    f"  const int steps = {plan.k // plan.block_k};",
    "  auto copy_step = [&](int step, int stage) {",
    f"    unsigned stage_base = shared_base + stage * {plan.stage_bytes};",
    *["  " + line for line in _copy_lines(plan, copy_thread, copy_threads)],
    "  };",
    "  auto compute_step = [&](float* acc, int stage) {",
    f"    unsigned stage_base = shared_base + stage * {plan.stage_bytes};",
    '    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");',
    "#pragma unroll",
    f"    for (int j = 0; j < {plan.block_k // plan.instruction_k}; j++) {{",
    f"      unsigned long long a_desc = wgmma_descriptor(stage_base + {a_start}, {a_lbo}, {a_sbo});",
    f"      unsigned long long b_desc = wgmma_descriptor(stage_base + {b_start}, {b_lbo}, {b_sbo});",
    "      " + _wgmma_instruction(plan),
    "    }",
    '    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");',
    "  };",
    "  auto store = [&](float* acc) {",
    '    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");',
    *_store_body(plan),
    "  };",
    *(_specialized_loop(plan) if plan.specialized else _cooperative_loop(plan)),
    "}",
  ]
  return "\n".join(lines) + "\n"


def _cooperative_loop(plan: WgmmaMatmul) -> list[str]:
  """Every thread copies and computes; one barrier per K step (see the module docstring)."""
  if plan.deep: return _deep_cooperative_loop(plan)
  count = plan.block_n // 2
  return [
    "  select(blockIdx.x);",
    f"  float acc[{count}];",
    "#pragma unroll",
    f"  for (int i = 0; i < {count}; i++) acc[i] = 0.0f;",
    f"  for (int step = 0; step < {plan.stages - 2}; step++) {{",
    "    if (step < steps) copy_step(step, step);",
    '    asm volatile("cp.async.commit_group;" ::: "memory");',
    "  }",
    "  for (int step = 0; step < steps; step++) {",
    f'    asm volatile("cp.async.wait_group {plan.stages - 3};" ::: "memory");',
    '    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");',
    "    __syncthreads();",
    f"    compute_step(acc, step % {plan.stages});",
    # the copies go out while the tensor cores work: their stage's readers (step s - 2) finished before the barrier
    f"    int next = step + {plan.stages - 2};",
    f"    if (next < steps) copy_step(next, next % {plan.stages});",
    '    asm volatile("cp.async.commit_group;" ::: "memory");',
    '    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");',
    "  }",
    "  store(acc);",
  ]


def _deep_cooperative_loop(plan: WgmmaMatmul) -> list[str]:
  """As _cooperative_loop, but stages - 1 steps in flight: after waiting for step s - 1's wgmmas, a second barrier
  (while step s's run) tells every thread that stage (s - 1) % stages is free, and step s + stages - 1 goes there."""
  count, stages = plan.block_n // 2, plan.stages
  return [
    "  select(blockIdx.x);",
    f"  float acc[{count}];",
    "#pragma unroll",
    f"  for (int i = 0; i < {count}; i++) acc[i] = 0.0f;",
    f"  for (int step = 0; step < {stages - 1}; step++) {{",
    "    if (step < steps) copy_step(step, step);",
    '    asm volatile("cp.async.commit_group;" ::: "memory");',
    "  }",
    "  for (int step = 0; step < steps; step++) {",
    f'    asm volatile("cp.async.wait_group {stages - 2};" ::: "memory");',
    '    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");',
    "    __syncthreads();",
    f"    compute_step(acc, step % {stages});",
    '    asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");',
    "    __syncthreads();",
    f"    int next = step + {stages - 1};",
    f"    if (next < steps) copy_step(next, next % {stages});",
    '    asm volatile("cp.async.commit_group;" ::: "memory");',
    "  }",
    "  store(acc);",
  ]


# mbarriers of the specialized kernels (this matmul's, attention_wgmma's producer): init, arrive (release), wait for a
# phase's parity (acquire), in a C loop
BARRIER_HELPERS = [
  "__device__ __forceinline__ void barrier_init(unsigned barrier, unsigned count) {",
  '  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(barrier), "r"(count) : "memory");',
  "}",
  "__device__ __forceinline__ void barrier_arrive(unsigned barrier) {",
  '  asm volatile("{ .reg .b64 state; mbarrier.arrive.shared::cta.b64 state, [%0]; }" :: "r"(barrier) : "memory");',
  "}",
  "__device__ __forceinline__ void barrier_wait(unsigned barrier, unsigned parity) {",
  "  unsigned done = 0;",
  "  while (!done) {",
  '    asm volatile("{ .reg .pred ready; mbarrier.try_wait.parity.shared::cta.b64 ready, [%1], %2; '
  'selp.u32 %0, 1, 0, ready; }" : "=r"(done) : "r"(barrier), "r"(parity) : "memory");',
  "  }",
  "}",
]


def ring_barrier_lines(full_offset: int, stages: int, consumers: int) -> list[str]:
  """Set up a producer's ring of `stages` (this matmul's, attention_wgmma's producer): `full` and `empty` mbarriers
  from `full_offset` past the aligned shared base, a stage's `full` counting the producer warpgroup's arrivals and its
  `empty` the `consumers` threads', initialised by one thread before the CTA meets."""
  return [f"  unsigned full = shared_base + {full_offset}, empty = full + {8 * stages};",
          "  if (threadIdx.x == 0) {",
          f"    for (int stage = 0; stage < {stages}; stage++) {{",
          f"      barrier_init(full + 8 * stage, {WARPGROUP_THREADS});",
          f"      barrier_init(empty + 8 * stage, {consumers});",
          "    }",
          "  }",
          "  __syncthreads();"]


def consumer_registers(plan: WgmmaMatmul) -> int:
  """Registers per consumer thread after setmaxnreg: the CTA's share of the multiprocessor's registers (its launch
  bounds: threads x ctas_per_sm resident) less the producer's PRODUCER_REGISTERS, over the consumers (1 CTA of
  128 x 256: 168 a thread at launch, 232 a consumer after)."""
  consumers = plan.warpgroups * WARPGROUP_THREADS
  pool = plan.launch_registers * plan.threads - WARPGROUP_THREADS * PRODUCER_REGISTERS
  return min(_granule(pool // consumers), 240)


def _specialized_loop(plan: WgmmaMatmul) -> list[str]:
  """Warpgroup -1 copies, the others compute, over the CTA's items (cta_items: one, or a persistent CTA's every
  ctas-th) with one running count u of K steps across them (stage u % S, its (u / S)-th use); stage s's `full`
  barrier (128 producer arrivals) says its tiles are in, its `empty` barrier (every consumer thread) that the wgmmas
  reading it finished:

      producer, count u: wait empty[u % S] (phase u / S - 1) unless u < S; copy; commit
                         then wait for count u - L's copies (L = copy_lag: L + 1 counts' copies in flight);
                         fence.proxy.async; arrive full[(u - L) % S]
      consumer, count u: wait full[u % S] (phase u / S); 4 wgmma; commit; wait for count u - 1's; arrive
                         empty[(u - 1) % S]; after an item's last step: wait for all, arrive empty[u % S], store

  The producer runs on into the next item's copies while the consumers store, so a persistent CTA overlaps its
  epilogue with the next tile's loads. L <= S - 2 keeps it free of deadlock: full[u] needs the producer at count
  u + L, which needs empty of count u + L - S <= u - 2, which the consumers arrive at once they issued count u - 1.
  """
  count, stages, lag = plan.block_n // 2, plan.stages, plan.copy_lag
  consumers = plan.warpgroups * WARPGROUP_THREADS
  # 128 x 128 consumers fit the launch's cap of 168 registers; setmaxnreg may only raise the consumers' count (a
  # lone consumer warpgroup already has more at launch)
  registers = plan.block_n > 128 and consumer_registers(plan) > plan.launch_registers
  return [
    *ring_barrier_lines(stages * plan.stage_bytes, stages, consumers),
    "  int counted = 0;",
    "  if (warpgroup < 0) {",
    *([f'    asm volatile("setmaxnreg.dec.sync.aligned.u32 {PRODUCER_REGISTERS};");'] if registers else []),
    f"    for (int item = blockIdx.x; item < {plan.items}; item += gridDim.x) {{",
    "      select(item);",
    "      for (int step = 0; step < steps; step++, counted++) {",
    f"        int stage = counted % {stages};",
    f"        if (counted >= {stages}) barrier_wait(empty + 8 * stage, (counted / {stages} - 1) & 1);",
    "        copy_step(step, stage);",
    *(_landing_lines(plan) if plan.async_arrive else _lagged_landing_lines(plan)),
    "      }",
    "    }",
    *(['    asm volatile("cp.async.wait_all;" ::: "memory");'] if plan.async_arrive else [
      '    asm volatile("cp.async.wait_group 0;" ::: "memory");',
      '    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");',
      # the last `lag` counts' stages (fewer where the CTA had fewer steps)
      f"    for (int landed = counted < {lag} ? 0 : counted - {lag}; landed < counted; landed++)",
      f"      barrier_arrive(full + 8 * (landed % {stages}));"]),
    "  } else {",
    *([f'    asm volatile("setmaxnreg.inc.sync.aligned.u32 {consumer_registers(plan)};");'] if registers else []),
    f"    float acc[{count}];",
    f"    for (int item = blockIdx.x; item < {plan.items}; item += gridDim.x) {{",
    "      select(item);",
    "#pragma unroll",
    f"      for (int i = 0; i < {count}; i++) acc[i] = 0.0f;",
    "      for (int step = 0; step < steps; step++, counted++) {",
    f"        barrier_wait(full + 8 * (counted % {stages}), (counted / {stages}) & 1);",
    # the copies landed through the generic proxy; the tensor cores read through the async one
    *(['        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");'] if plan.async_arrive else []),
    f"        compute_step(acc, counted % {stages});",
    '        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");',
    f"        if (step > 0) barrier_arrive(empty + 8 * ((counted - 1) % {stages}));",
    "      }",
    # the item's last stage is free once its wgmmas are done: the producer may fill it while this CTA stores
    '      asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");',
    f"      barrier_arrive(empty + 8 * ((counted - 1) % {stages}));",
    "      store(acc);",
    "    }",
    "  }",
  ]


def _lagged_landing_lines(plan: WgmmaMatmul) -> list[str]:
  """The producer after a step's copies: wait for the copies copy_lag steps back, fence, arrive on their `full`."""
  lag, stages = plan.copy_lag, plan.stages
  return ['        asm volatile("cp.async.commit_group;" ::: "memory");',
          f"        if (counted >= {lag}) {{",
          f'          asm volatile("cp.async.wait_group {lag};" ::: "memory");',
          '          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");',
          f"          barrier_arrive(full + 8 * ((counted - {lag}) % {stages}));",
          "        }"]


def _landing_lines(plan: WgmmaMatmul) -> list[str]:
  """The producer after a step's copies (async_arrive): the stage's `full` barrier counts this thread's arrival
  when its copies land (noinc: the arrival is one of the 128 the barrier expects)."""
  return ['        asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" :: "r"(full + 8 * stage) : '
          '"memory");']


def plan_for_kernel(kernel, tile: WgmmaTile) -> tuple[WgmmaMatmul, dict[str, int]]:
  """The plan of a Kernel (codegen/kernel.py, no opts applied) that is a plain float16/bfloat16 matmul (or float32,
  TF32, where the user allows it, with A M x K and B N x K): C (M x N, row-major, the inputs' dtype or float32) = A
  (M x K row-major, or its transpose stored K x M) @ B (K x N row-major, or its transpose stored N x K), a SUM in
  float32 of the product of the two loads, stored as it is (or cast), unmasked views from offset 0; and the argument
  positions of C, A and B; the block tile and kernel kind from `tile`. Raises ValueError (or the matmul check's
  KernelOptError) naming what does not fit."""
  from ourgrad.codegen.kernel import KernelOptError, matmul_operands   # kernel.py imports this module
  from ourgrad.dtype import dtypes
  from ourgrad.helpers import tf32_allowed
  from ourgrad.ops import Ops
  if len(kernel.reduceops) != 1 or len(kernel.stores) != 1: raise ValueError("needs one reduce and one store")
  store = kernel.stores[0]
  value = store.srcs[0]
  if value.op is Ops.CAST: value = value.srcs[0]
  if value is not kernel.reduceop: raise ValueError("the matmul's result must be stored as it is (or cast)")
  for dtype in (dtypes.float16, dtypes.bfloat16) + ((dtypes.float32,) if tf32_allowed() else ()):
    try:
      a, b = matmul_operands(kernel.reduceop, dtype, dtypes.float32, "WGMMA")
      break
    except KernelOptError:
      continue
  else:
    raise ValueError("needs a float32 SUM of the product of two float16 or bfloat16 loads (float32 ones: only where "
                     "TF32 is allowed)")
  if len(kernel.full_shape) not in (3, 4):
    raise ValueError(f"needs the loop nest (M, N, K) or (batch, M, N, K), got {kernel.full_shape}")
  *batch, m, n, k = kernel.full_shape
  views, batch_strides = {}, {}
  for leaf in (store, a, b):
    st = kernel.sts[kernel.leaf_number(leaf)]
    if len(st.views) != 1 or st.views[0].mask is not None or st.views[0].offset != 0:
      raise ValueError(f"needs plain views (one, unmasked, from offset 0), got {st}")
    strides = st.views[0].strides
    views[id(leaf)], batch_strides[id(leaf)] = strides[-3:], strides[0] if batch else 0
  if views[id(store)] != (n, 1, 0): raise ValueError(f"needs a row-major M x N output, strides {views[id(store)]}")
  if views[id(a)][1] != 0: a, b = b, a   # A is the operand that does not vary along N
  # rows may be longer than the loop nest's K (M, N): a split-K partial reads one slice of each row
  a_m, _, a_k = views[id(a)]
  if not ((a_k == 1 and a_m >= k) or (a_m == 1 and a_k >= m)):
    raise ValueError(f"needs A as M x K or K x M, strides {views[id(a)]}")
  _, b_n, b_k = views[id(b)]
  if not ((b_n == 1 and b_k >= n) or (b_k == 1 and b_n >= k)):
    raise ValueError(f"needs B as K x N or N x K, strides {views[id(b)]}")
  out_dtype = store.dtype.name
  processors = getattr(kernel.renderer, "multiprocessors", 0)
  if tile.persistent and processors <= 0: raise ValueError(f"a persistent grid on {kernel.renderer.device}, whose "
                                                           "multiprocessors are unknown")
  plan = WgmmaMatmul(m, n, k, dtype=dtype.name, out_dtype=out_dtype, block_m=tile.block_m, block_n=tile.block_n,
                     stages=tile.stages, specialized=tile.specialized, deep=tile.deep, ctas_per_sm=tile.ctas_per_sm,
                     persistent_ctas=processors * tile.ctas_per_sm if tile.persistent else 0,
                     b_k_major=b_k == 1, a_k_major=a_k == 1,
                     a_row_stride=a_m if a_k == 1 else a_k, b_row_stride=b_n if b_k == 1 else b_k,
                     batch=batch[0] if batch else 1, a_batch=batch_strides[id(a)], b_batch=batch_strides[id(b)],
                     c_batch=batch_strides[id(store)],
                     multiprocessor_registers=getattr(kernel.renderer, "registers_per_multiprocessor", 0) or
                     ASSUMED_CUDA_GPU.registers_per_multiprocessor)
  # the renderer's dynamic shared memory per block (the device's fact: 227 KB on sm_90)
  # (each resident CTA also reserves a kilobyte of the multiprocessor's, which is a kilobyte over a block's limit)
  limit = getattr(kernel.renderer, "dynamic_local_memory_bytes", 0)
  if plan.ctas_per_sm * (plan.shared_bytes + ATOM_BYTES) > limit + ATOM_BYTES:
    raise ValueError(f"wgmma tile {plan.block_m}x{plan.block_n}, {plan.stages} stages: {plan.ctas_per_sm} x "
                     f"{plan.shared_bytes} bytes of shared memory, over the {limit} a block of "
                     f"{kernel.renderer.device} may have")
  return plan, {"c": store.arg.idx, "a": a.arg.idx, "b": b.arg.idx}
