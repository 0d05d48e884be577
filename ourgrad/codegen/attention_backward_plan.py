"""The flash-attention backward's plan: shapes, dtype, mask, every operand's layout, the block and tile sizes, and the
launch sizes and register and shared-memory budgets that follow from them (codegen/attention_backward.py renders the
kernels of a plan; its module docstring describes them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from ourgrad.codegen.attention_wgmma import WARPGROUP_ROWS, wgmma_refusal
from ourgrad.codegen.wgmma_copies import ATOM_BYTES
from ourgrad.codegen.wgmma_tiles import ITEMSIZE
from ourgrad.errors import DTypeError, ShapeError


Strides = tuple[int, int, int]   # element strides of (batch, head, row); the last dim (head_dim) is contiguous
WARP_ROWS = 16                   # rows of an mma.sync tile (m16): each warp owns 16 rows of its block
PAD_BYTES = 16                   # added to each shared-memory row so a fragment's 8 rows fall in different banks
LOG2E = 1.4426950408889634
# the register file of a multiprocessor (every sm_80/sm_86/sm_89/sm_90 GPU), the fewest registers a thread of these
# kernels is given, those it needs beside its float32 accumulators (the operand fragments in flight, addresses, row
# statistics, loop state: what ptxas used over the accumulators in NVRTC compiles of D=64 plans), and the shared
# memory the driver reserves per resident block (sm_80+)
REGISTERS_PER_SM, REGISTER_FLOOR, REGISTERS_BESIDE_ACCUMULATORS, BLOCK_RESERVED_SHARED = 65536, 128, 40, 1024
DQ_KERNEL, DKDV_KERNEL = "attention_backward_dq", "attention_backward_dkdv"
PRODUCER_THREADS = 128   # warp_specialized: the dK/dV block's producer warpgroup (setmaxnreg acts on whole warpgroups)
PRODUCER_REGISTERS = 24  # warp_specialized: the producer's registers after setmaxnreg.dec (the least it allows)
DQ_COUNT_ROWS = 16   # the single pass: dq_counts has a count per 16 query rows (at least one per streamed Q tile)
WGMMA_MAX_HEAD_DIM = 128   # the largest head the wgmma kernels are chosen for (`with_device_mma`)


def contiguous_strides(heads: int, rows: int, head_dim: int) -> Strides:
  """The (batch, head, row) strides of a contiguous (B, heads, rows, head_dim) tensor."""
  return (heads * rows * head_dim, rows * head_dim, head_dim)


@dataclass(frozen=True)
class AttentionBackwardPlan:
  """One attention backward: shapes, dtype, mask, scale, every operand's layout and the block sizes.

  q, o, do, dq are (batch, heads, q_len, head_dim); k, v, dk, dv (batch, kv_heads, kv_len, head_dim), each given by
  its (batch, head, row) element strides (the last dim contiguous), so a (B, L, H, D) projection is read in place.
  lse is float32 (batch, heads, q_len) by its own strides. The delta scratch buffer the kernels share is float32
  (batch, heads, q_len) contiguous. dq, dk, dv have the input dtype, or float32 with `grad_float32`."""
  batch: int
  heads: int
  kv_heads: int
  q_len: int
  kv_len: int
  head_dim: int
  dtype: str                  # "float32" (multiplied as TF32), "float16" or "bfloat16"
  causal: bool
  scale: float
  q_strides: Strides
  k_strides: Strides
  v_strides: Strides
  o_strides: Strides
  do_strides: Strides
  dq_strides: Strides
  dk_strides: Strides
  dv_strides: Strides
  lse_strides: Strides
  block_q: int = 64           # query rows a dQ block owns (a warp each 16)
  block_kv: int = 64          # keys a dK/dV block owns
  stream_q: int = 0           # the Q tile a dK/dV block streams (0: block_q)
  stream_kv: int = 0          # the K/V tile a dQ block streams (0: block_kv)
  lse_log2: bool = False      # LSE holds log2 of the softmax sum of 2^(scale log2(e) q.k) instead of the natural log
  o_dtype: str | None = None  # O's dtype where the forward keeps it in float32; None: plan.dtype
  shared_per_sm: int = 0      # the device's shared memory per multiprocessor (0: unknown, no occupancy hint)
  lse_offset: int = 0         # where LSE starts in its buffer (elements): the forward may write it after O
  dq_held: bool = False       # the dQ kernel's owned Q and dO A fragments kept in registers across its loop
  dkdv_held: bool = False     # the dK/dV kernel's owned K and V A fragments kept in registers across its loop
  grad_float32: bool = False  # dq, dk, dv written as float32 (the sums unrounded) instead of in plan.dtype
  mma: str = "mma_sync"       # "wgmma": warpgroup MMAs on sm_90 (codegen/attention_backward_wgmma.py), 16-bit only
  # wgmma: each iteration's last product runs on into the next one's (3 stages, not 2); ptxas (CUDA 12.x) serializes
  # its wgmmas (C7515: accumulators defined by other instructions while in flight)
  wgmma_overlap: bool = False
  # wgmma: the single pass: the dK/dV kernel also adds SCALE dS K of each of its iterations into `dq_accum`, float32
  # (batch, heads, q_len, head_dim) contiguous and zeroed before it runs (red.global.add), 5 products a K/V block
  # and Q tile instead of the two kernels' 7 (codegen/attention_backward_wgmma.py `dq_accumulate_lines`)
  dq_accumulate: bool = False
  dq_reduce_width: int = 2   # dq_accumulate: the float32 sums a reduction adds (2 or 4: red.global.add.v2 / .v4.f32)
  dq_bulk_reduce: bool = False   # dq_accumulate: dQ staged in shared memory, added by TMA bulk reductions instead
  # the dK/dV kernel warp-specialized (FlashAttention-3's structure; the single pass's or the two kernels'): a
  # producer warpgroup after the consumer warpgroups copies each iteration's Q, dO, LSE and delta into a ring of
  # `wgmma_stages` stages whose fills and releases mbarriers count, and gives its registers to the consumers
  # (setmaxnreg); the consumers never wait at a block barrier for copies (codegen/attention_backward_producer.py);
  # with dq_bulk_reduce the producer's second warp issues the staged dQ's bulk reductions
  warp_specialized: bool = False
  ring_stages: int = 0   # the wgmma kernels' stages of streamed tiles where set (0: `wgmma_stages`'s rule)

  def __post_init__(self) -> None:
    if self.dtype not in ITEMSIZE:
      raise DTypeError(f"attention backward kernels take float32, float16 or bfloat16, not {self.dtype}")
    if self.o_dtype not in (None, self.dtype, "float32"):
      raise DTypeError(f"attention backward reads O as {self.dtype} or float32, not {self.o_dtype}")
    if self.head_dim % 16 or not 16 <= self.head_dim <= 256:
      raise ShapeError(f"attention backward kernels need head_dim a multiple of 16 in [16, 256], got {self.head_dim}")
    if self.kv_heads <= 0 or self.heads % self.kv_heads:
      raise ShapeError(f"{self.heads} query heads cannot share {self.kv_heads} kv heads (heads % kv_heads != 0)")
    if min(self.batch, self.q_len, self.kv_len) <= 0:
      raise ShapeError(f"attention backward of an empty problem: batch {self.batch}, q_len {self.q_len}, "
                       f"kv_len {self.kv_len}")
    for name in ("block_q", "block_kv", "stream_q", "stream_kv"):
      size = getattr(self, name)
      if size % WARP_ROWS or size < 0 or (size == 0 and name.startswith("block")):
        raise ShapeError(f"{name} must be a positive multiple of {WARP_ROWS}, got {size}")
    if self.mma not in ("mma_sync", "wgmma"):
      raise ShapeError(f"attention backward mma {self.mma!r}: want mma_sync or wgmma")
    if self.mma == "wgmma":
      refusal = wgmma_refusal(self.dtype, self.head_dim, self.vector_width > 1)
      if refusal is not None: raise ShapeError(f"wgmma attention backward refuses {refusal}")
      streams = (self.dq_stream, self.dkdv_stream)
      if self.block_q % WARPGROUP_ROWS or self.block_kv % WARPGROUP_ROWS or max(streams) > 256:
        raise ShapeError(f"wgmma attention backward owns whole warpgroups of {WARPGROUP_ROWS} rows and streams at most "
                         f"256: block_q {self.block_q}, block_kv {self.block_kv}, streams {streams}")
    if self.dq_bulk_reduce and not self.dq_accumulate:
      raise ShapeError("dq_bulk_reduce adds the single pass's dQ (dq_accumulate)")
    if self.warp_specialized and (self.mma != "wgmma" or self.dkdv_held or self.wgmma_overlap):
      raise ShapeError("the warp-specialized dK/dV kernel runs on wgmma with K and V read by descriptor, without "
                       f"wgmma_overlap: mma {self.mma}, dkdv_held {self.dkdv_held}, wgmma_overlap {self.wgmma_overlap}")
    if self.ring_stages not in (0, 2, 3, 4):
      raise ShapeError(f"ring_stages {self.ring_stages}: want 2, 3 or 4 stages (0: by the plan's rule)")
    if self.dq_reduce_width not in (2, 4):
      raise ShapeError(f"dq_reduce_width {self.dq_reduce_width}: the reductions add 2 or 4 float32 sums")
    if self.dq_accumulate and (self.mma != "wgmma" or self.dkdv_held or self.wgmma_overlap or
                               self.dkdv_stream % self.block_kv):
      raise ShapeError("the single-pass backward (dq_accumulate) runs on wgmma with K and V read by descriptor, "
                       "without wgmma_overlap, and streams a multiple of block_kv queries (each warpgroup's dQ a "
                       f"64-row slice of them): mma {self.mma}, dkdv_held {self.dkdv_held}, wgmma_overlap "
                       f"{self.wgmma_overlap}, block_kv {self.block_kv}, stream_q {self.dkdv_stream}")

  @staticmethod
  def contiguous(batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int, head_dim: int, dtype: str,
                 causal: bool, scale: float | None = None, **options: Any) -> AttentionBackwardPlan:
    """A plan for contiguous (B, H, T, D) operands; scale defaults to 1/sqrt(head_dim) as SDPA's. `options` sets
    other fields (block sizes default to `default_blocks(head_dim, dtype)`)."""
    q_like, kv_like = contiguous_strides(heads, q_len, head_dim), contiguous_strides(kv_heads, kv_len, head_dim)
    sizes = {**default_blocks(head_dim, dtype), **options}
    return AttentionBackwardPlan(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype, causal,
                                 1 / math.sqrt(head_dim) if scale is None else scale, q_like, kv_like, kv_like,
                                 q_like, q_like, q_like, kv_like, kv_like, (heads * q_len, q_len, 1), **sizes)

  @property
  def group(self) -> int:
    """Query heads per kv head."""
    return self.heads // self.kv_heads

  @property
  def itemsize(self) -> int: return ITEMSIZE[self.dtype]

  @property
  def grad_dtype(self) -> str:
    """The dtype dq, dk and dv are written in."""
    return "float32" if self.grad_float32 else self.dtype

  @property
  def stored_o_dtype(self) -> str:
    """The dtype O is read in."""
    return self.o_dtype or self.dtype

  @property
  def row_pitch(self) -> int:
    """Elements of one head_dim row of a shared-memory tile (padded)."""
    return self.head_dim + PAD_BYTES // self.itemsize

  @property
  def vector_width(self) -> int:
    """Elements of one 16-byte global load when every stride of q, k, v, do is a multiple of it (the buffers start
    16-byte aligned, as allocations do), else 1."""
    width = 16 // self.itemsize
    strides = (*self.q_strides, *self.k_strides, *self.v_strides, *self.do_strides)
    return width if all(stride % width == 0 for stride in strides) else 1

  @property
  def o_vector_width(self) -> int:
    """Elements of O in one 16-byte load when O's strides allow it (its buffer 16-byte aligned, as `vector_width`
    assumes of the operands), else 1."""
    width = 16 // ITEMSIZE[self.stored_o_dtype]
    return width if all(stride % width == 0 for stride in self.o_strides) else 1

  @property
  def delta_elements(self) -> int:
    """Size (float32 elements) of the delta scratch buffer: (batch, heads, q_len) contiguous."""
    return self.batch * self.heads * self.q_len

  # ------------------------------------------------------------ launch sizes
  @property
  def dq_stream(self) -> int:
    """Keys of the K/V tiles a dQ block streams."""
    return self.stream_kv or self.block_kv

  @property
  def dkdv_stream(self) -> int:
    """Queries of the Q tiles a dK/dV block streams."""
    return self.stream_q or self.block_q

  @property
  def dq_grid(self) -> tuple[int, int, int]:
    """(batch x heads, Q tiles): the heads vary fastest, so blocks start in the order of their tiles (module
    docstring)."""
    return (self.batch * self.heads, -(-self.q_len // self.block_q), 1)

  @property
  def dq_block(self) -> tuple[int, int, int]: return (32 * self.block_q // WARP_ROWS, 1, 1)

  @property
  def dq_shared_bytes(self) -> int:
    """Q and dO tiles, two K and V tiles (double-buffered), then LSE and delta of the block's rows (dS stays in
    registers). wgmma: the K and V tiles swizzled after the rest (`wgmma_shared_bytes`)."""
    if self.dq_accumulate:   # the single pass's delta kernel: a dO tile and the delta of its rows
      return self.block_q * self.row_pitch * self.itemsize + self.block_q * 4
    if self.mma == "wgmma":   # (without dq_held: Q and dO in swizzled tiles too)
      owned = 0 if self.dq_held else 2 * self.block_q * self.head_dim * self.itemsize
      return self.wgmma_shared_bytes(self.block_q, 2 * self.block_q * 4, self.dq_stream) + owned
    tiles = 2 * self.block_q * self.row_pitch + 4 * self.dq_stream * self.row_pitch
    return tiles * self.itemsize + 2 * self.block_q * 4

  @property
  def wgmma_stages(self) -> int:
    """Stages of the wgmma kernels' streamed tiles: 3 where a stage's last product may still run in the next
    iteration (`wgmma_overlap`), else 2."""
    return self.ring_stages or (3 if self.wgmma_overlap else 2)

  def wgmma_shared_bytes(self, owned: int, row_bytes: int, streamed: int) -> int:
    """A wgmma kernel's shared memory: its two owned tiles of `owned` rows (padded rows: the A fragments held in
    registers are read from them, and the dQ kernel's delta), `row_bytes` of float rows, then, from the next 1024-byte
    atom (the 128-byte swizzle is a function of address bits 7-9), `wgmma_stages` stages of the two streamed tiles of
    `streamed` rows of 128-byte swizzled pieces (codegen/attention_wgmma.staged_offset)."""
    streamed_bytes = 2 * self.wgmma_stages * streamed * self.head_dim * self.itemsize
    return 2 * owned * self.row_pitch * self.itemsize + row_bytes + streamed_bytes + ATOM_BYTES

  @property
  def dkdv_grid(self) -> tuple[int, int, int]:
    """(batch x kv heads, K/V tiles): the heads vary fastest, as `dq_grid`."""
    return (self.batch * self.kv_heads, -(-self.kv_len // self.block_kv), 1)

  @property
  def dkdv_block(self) -> tuple[int, int, int]:
    """A warp a 16 keys (the consumers), then (warp_specialized) the producer warpgroup."""
    return (self.consumer_threads + (PRODUCER_THREADS if self.warp_specialized else 0), 1, 1)

  @property
  def consumer_threads(self) -> int:
    """The dK/dV block's threads that multiply: a warp a 16 keys."""
    return 32 * self.block_kv // WARP_ROWS

  @property
  def consumer_registers(self) -> int:
    """warp_specialized: the registers a consumer thread asks for by setmaxnreg.inc: what the producer's
    setmaxnreg.dec frees of the block's launch share (one block a multiprocessor: the register file over its threads,
    a multiple of 8), shared by the consumers, at most 240 (FlashAttention-3's two-consumer figure); 0 where that is
    not more than the launch share (no setmaxnreg)."""
    if not self.warp_specialized: return 0
    launch = REGISTERS_PER_SM // self.dkdv_block[0] // 8 * 8
    given = (launch * self.dkdv_block[0] - PRODUCER_REGISTERS * PRODUCER_THREADS) // self.consumer_threads // 8 * 8
    given = min(240, given)
    return given if given > launch else 0

  @property
  def dkdv_shared_bytes(self) -> int:
    """K and V tiles, two Q and dO tiles (double-buffered), then two LSE and delta rows of a Q tile (P^T and dS^T stay
    in registers)."""
    stream = self.dkdv_stream
    if self.mma == "wgmma":   # (without dkdv_held K and V swizzled: no padding, the same bytes at most)
      # (the single pass: the dS tile, then a flag a thread)
      return self.wgmma_shared_bytes(self.block_kv, 2 * self.wgmma_stages * stream * 4, stream) + \
          (self.ds_tile_bytes + 4 * self.dkdv_block[0] if self.dq_accumulate else 0) + \
          (stream * self.head_dim * 4 if self.dq_bulk_reduce else 0) + \
          self.mbarrier_bytes
    tiles = 2 * self.block_kv * self.row_pitch + 4 * stream * self.row_pitch
    return tiles * self.itemsize + 4 * stream * 4

  @property
  def dq_swizzled(self) -> bool:
    """Whether dq_accum's rows hold their columns permuted: column c of row r at c ^ 8 (r % 8) (warp_specialized with
    dq_bulk_reduce: the staging rows so, a warp's stores of 8 rows' same columns fall in different banks; the bulk
    reductions copy rows whole, and the tile's conversion reads them back so)."""
    return self.warp_specialized and self.dq_bulk_reduce

  @property
  def mbarrier_bytes(self) -> int:
    """warp_specialized: the dK/dV kernel's mbarriers (8 bytes each): a full and an empty one a stage, and with
    dq_bulk_reduce the staged dQ's full, empty and done ones; else none."""
    if not self.warp_specialized: return 0
    return 8 * (2 * self.wgmma_stages + (3 if self.dq_bulk_reduce else 0))

  @property
  def count_elements(self) -> int:
    """The single pass's dq_counts (uint32): a count per DQ_COUNT_ROWS query rows of each (batch, head)."""
    return self.batch * self.heads * -(-self.q_len // DQ_COUNT_ROWS)

  @property
  def ds_tile_bytes(self) -> int:
    """dq_accumulate: the dK/dV kernel's dS tile after its stages (the stream's queries x the block's keys, in
    128-byte rows of 64 keys: the K-major A of dQ += dS K; warp_specialized: two, used in turn); else none."""
    return self.ds_buffers * self.ds_buffer_bytes

  @property
  def ds_buffer_bytes(self) -> int:
    """One dS tile of `ds_tile_bytes` (0 without dq_accumulate)."""
    return (self.block_kv // WARPGROUP_ROWS) * self.dkdv_stream * WARPGROUP_ROWS * self.itemsize \
        if self.dq_accumulate else 0

  @property
  def ds_buffers(self) -> int:
    """dS tiles: two where warp_specialized (the consumers meet once an iteration, after writing one: the other's
    readers have waited for their products before that), else one (none without dq_accumulate)."""
    return 2 if self.warp_specialized else 1

  @property
  def dq_registers(self) -> int:
    """Registers a dQ thread needs: its share of the dQ accumulators (16 x D a warp) and of S and dP (16 x stream);
    the single pass's delta kernel: no accumulators (REGISTER_FLOOR / 2: as many blocks as its shared memory lets)."""
    if self.dq_accumulate: return REGISTER_FLOOR // 2
    held = self.head_dim // 2 if self.mma == "wgmma" and self.dq_held else 0   # wgmma: Q's and dO's A fragments
    return max(REGISTER_FLOOR, self.head_dim // 2 + self.dq_stream + held + REGISTERS_BESIDE_ACCUMULATORS)

  @property
  def dkdv_registers(self) -> int:
    """Registers a dK/dV thread needs: its share of dK and dV (16 x D each a warp) and of S^T and dP^T (16 x stream)."""
    if self.mma != "wgmma": return max(REGISTER_FLOOR, self.head_dim + self.dkdv_stream + REGISTERS_BESIDE_ACCUMULATORS)
    # warp-specialized: one block a multiprocessor, its launch share (setmaxnreg moves them to the consumers)
    if self.warp_specialized: return REGISTERS_PER_SM // self.dkdv_block[0] // 8 * 8
    # wgmma: also P^T's packed A fragments (stream / 4), in flight while dS^T is computed (a tighter bound makes
    # ptxas serialize the wgmmas), and K's and V's A fragments where held (D / 2)
    held = self.head_dim // 2 if self.dkdv_held else 0
    # dq_accumulate: dQ's accumulators (a warpgroup's share of the stream's queries x D) where S^T's and dP^T's were
    accumulated = max(0, self.dkdv_stream * self.head_dim * WARPGROUP_ROWS // self.block_kv // 128 -
                      self.dkdv_stream) if self.dq_accumulate else 0
    return (self.head_dim + self.dkdv_stream + self.dkdv_stream // 4 + held + accumulated +
            REGISTERS_BESIDE_ACCUMULATORS)

  def launch_bounds(self, threads: int, shared_bytes: int, registers: int, specialized: bool = False) -> str:
    """`__launch_bounds__` of a kernel: its threads, and where the device's shared memory per multiprocessor is
    known, the blocks that fit in it and in the register file at `registers` a thread (so ptxas keeps registers for
    that many blocks and no more: a tighter bound would spill the accumulators). `specialized` (the warp-specialized
    dK/dV kernel): one block, always (without the 1, ptxas could not tell the registers at entry and ignored
    setmaxnreg, C7508, where the kernel needed fewer than its share)."""
    if specialized: return f"__launch_bounds__({threads}, 1)"
    if not self.shared_per_sm: return f"__launch_bounds__({threads})"
    by_shared = self.shared_per_sm // (shared_bytes + BLOCK_RESERVED_SHARED)
    resident = min(by_shared, REGISTERS_PER_SM // (threads * registers))
    return f"__launch_bounds__({threads}, {resident})" if resident > 1 else f"__launch_bounds__({threads})"

  def with_device_mma(self, has_wgmma: bool) -> AttentionBackwardPlan:
    """This plan on wgmma (mma "wgmma", its blocks rounded up to whole warpgroups) where the device has it and the
    wgmma kernels take its operands (16-bit, D 64 or 128, 16-byte aligned rows), else unchanged. At D = 64 the
    dQ kernel streams 32 keys (Q and dO held) and the dK/dV kernel 128 queries (K and V read by descriptor).
    H200, causal B=4 H=12 D=64 bfloat16, each kernel alone (extra/bench/results/sweep_attention_backward_h200_s14_2.txt,
    T = 1024 / 4096): dQ 0.040 / 0.387 ms (mma.sync 0.052 / 0.571), dK/dV 0.059 / 0.546 (0.073 / 0.800); held A
    fragments with 64-row streams gave wrong gradients on the GPU until their scores went as two half-width wgmmas
    (attention_backward_wgmma.scores_halved; session 16: correct, 0.389 / 0.601 ms at T = 4096, slower)."""
    if not has_wgmma or wgmma_refusal(self.dtype, self.head_dim, self.vector_width > 1) is not None: return self
    # over D = 128 the dK and dV accumulators (D / 2 registers a thread each) would not fit beside the rest
    if self.head_dim > WGMMA_MAX_HEAD_DIM: return self
    def whole(rows: int) -> int: return -(-rows // WARPGROUP_ROWS) * WARPGROUP_ROWS
    streams = {"stream_kv": 32, "stream_q": 128} if self.head_dim == 64 else {}
    return replace(self, mma="wgmma", block_q=whole(self.block_q), block_kv=whole(self.block_kv), dq_held=True,
                   dkdv_held=False, **streams)

  def fits(self, max_shared_bytes: int) -> bool:
    """Whether both kernels' shared memory fits a block's limit (the device's opt-in maximum)."""
    return max(self.dq_shared_bytes, self.dkdv_shared_bytes) <= max_shared_bytes


def default_blocks(head_dim: int, dtype: str) -> dict[str, Any]:
  """Block sizes by the bytes of a head_dim row: each block owns 64 rows (a warp 16) and streams 64-row tiles, except
  that over 128 bytes (float32 rows of 64, 16-bit rows of 128) both kernels stream 32-row tiles, so that the
  accumulators (dQ: head_dim / 2 floats a thread, dK and dV: head_dim / 2 each; S and dP: stream / 2 each) and the
  wider fragments stay in registers with three blocks a multiprocessor, and over 256 bytes the dQ block owns 32 rows
  (its shared memory). The dQ kernel holds its Q and dO A fragments in registers (`dq_held`); the dK/dV kernel reads
  K and V from shared memory (holding them spills at 64 keys a block).
  H200, causal D = 64, each kernel alone (extra/bench/results/sweep_attention_backward_h200_s12.txt): float32 dQ
  0.118 / 0.199 / 2.03 ms at T = 512 (B=8) / 1024 / 4096 (B=4) streaming 32 keys, 0.115 / 0.193 / 1.89 held,
  0.130 / 0.206 / 2.13 streaming 64 (255 registers, 2 blocks a multiprocessor); dK/dV 0.146 / 0.257 / 2.73 streaming
  32 queries, 0.145 / 0.251 / 2.77 streaming 64, 0.175 / 0.306 / 3.24 held (spills). bfloat16 dQ 0.057 / 0.088 /
  0.800, held 0.056 / 0.086 / 0.768; dK/dV 0.068 / 0.109 / 1.077 (64 throughout, the fastest of the sweep).
  Session 13 (interior tiles unmasked, heads-first block order, float32 tiles rounded once;
  sweep_attention_backward_h200_s13.txt, T = 1024 / 4096): the defaults still the fastest configs within 1%;
  bfloat16 dQ 0.053 / 0.574 ms, dK/dV 0.073 / 0.798; float32 dQ 0.130 / 1.59, dK/dV 0.162 / 2.06."""
  row_bytes = head_dim * ITEMSIZE.get(dtype, 4)   # an unknown dtype is refused by the plan itself
  stream = 64 if row_bytes <= 128 else 32
  return {"block_q": 64 if row_bytes <= 256 else 32, "block_kv": 64, "stream_q": stream, "stream_kv": stream,
          "dq_held": True}


def single_pass_blocks(head_dim: int) -> dict[str, int]:
  """The single pass's dK/dV blocks (plan.dq_accumulate): at D = 64 two warpgroups of 64 keys streaming 128 queries
  (their dQ parts summed over 128 keys before the reductions, which go 4 sums a reduction); at D = 128 one streaming
  64 (NVRTC sm_90: 128 spilled 880 bytes and serialized its wgmmas). H200, causal B=4 H=12 T=4096 D=64 bfloat16,
  with its delta kernel (0.030 ms; extra/bench/results/sweep_attention_backward_h200_s15.txt, third checkpoint):
  0.927 ms at 128 keys and 128 queries (0.925 with 2-sum reductions, 0.994 with TMA bulk reductions), 1.020 at 64
  keys, against 0.387 + 0.540 for the dQ and dK/dV kernels; SDPA forward + backward 1.325 ms against 1.322: equal.
  Warp-specialized with the producer's bulk reductions (session 16, sweep_attention_backward_h200_s16.txt): 0.757
  ms, the default where ATTENTION_SINGLE_PASS is unset (codegen/attention_grad.single_pass_mode); session 17 (its
  dq conversion's loads before its stores, pair stores; ck_s17/attnbwd5_2.txt): 0.696 ms (main's 0.754)."""
  return {"block_kv": 128, "stream_q": 128, "dq_reduce_width": 4} if head_dim <= 64 else \
      {"block_kv": 64, "stream_q": 64, "dq_reduce_width": 4}


@dataclass(frozen=True)
class KernelLaunch:
  """One kernel of the backward: its name (the extern "C" symbol), CUDA source, the buffers it takes in order, and
  its launch sizes (grid, block, dynamic shared memory bytes)."""
  name: str
  source: str = field(repr=False)
  arguments: tuple[str, ...]
  grid: tuple[int, int, int]
  block: tuple[int, int, int]
  shared_bytes: int
