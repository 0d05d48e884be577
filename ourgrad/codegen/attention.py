"""Fused (flash) attention kernels: O = softmax(Q K^T * scale (+ causal mask)) V and its per-row logsumexp, in one
kernel that never writes the L x S scores to memory (Ops.ATTENTION).

The kernel AST is `STORE(ATTENTION(LOAD q, LOAD k, LOAD v))` (engine/schedule.py `_schedule_attention`), arg
`(causal, scale)`. q is (B, H, L, D), k and v (B, Hk, S, D) with H a multiple of Hk (grouped-query attention: query
head h reads key/value head h // (H / Hk), no copies); each is read in place through its one View's strides and
offset (GPT-2's q, k, v are strided views of one (B, T, 3, H, D) buffer). The output is one buffer in the operands'
dtype: O laid out (B, L, H, D) (what a projection after the heads reads as (B, L, H * D)), then the float32
logsumexp of each query row at `lse_offset` (in float32 elements: its bytes follow O's), laid out (B, H, L), natural
log: lse = max_j s_ij + log(sum_j exp(s_ij - max)), with s = q . k * scale and masked keys left out. The backward
reads both (tensor_attention.py).

`AttentionPlan` is the whole kernel as typed data (FlashAttention-2): a CTA owns `block_m` query rows of one
(batch, head), one warp per `warp_tiles` m tiles of 16 rows; it loops over tiles of `block_n` keys staged in shared
memory (`stages` buffers; with 16-byte aligned rows they are filled by cp.async while the previous tile is computed),
computes S = Q K^T with mma.sync (m16n8k8 TF32 for float32, m16n8k16 for float16/bfloat16; K's fragments by ldmatrix),
keeps a running max and sum per row in registers (exp2 with scale * log2(e) folded into its fma), converts P to the
operand type in registers and adds P V with mma.sync (16-bit V's fragments by ldmatrix.trans). `plan_attention`
sizes the tiles by a rule of the operand bytes, registers and shared memory; ATTENTION_BLOCKS overrides it.
Causal CTAs stop at their last row's diagonal tile and mask the tiles that cross it; the CTAs with the most tiles
start first, across all heads (attention_render.py `_block_index_lines`). The softmax moves a row's reference max
lazily (`rescale_slack`, ATTENTION_RESCALE_SLACK). With `mma="wgmma"` (sm_90, 16-bit operands; ATTENTION_WGMMA=0
opts out) S and P V run on warpgroup MMA, K and V staged in swizzled tiles (codegen/attention_wgmma.py); the masks,
softmax and store are the same.

This module holds the plan and the rule that picks it; codegen/attention_render.py writes a plan's CUDA C++
(`render_attention`, which renderer/cuda.py calls); runtime/attention_emulator.py runs the same plan with numpy for
the PYTHON device (EMULATE=CUDA).

`AttentionKernel` offers what engine/realize.py reads of a Kernel (name, leaves, sts, applied_opts, print_debug,
colored_shape, op_count) and the plan it is rendered from (`attention`); no Opts apply.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from ourgrad.codegen import attention_wgmma
from ourgrad.codegen.attention_helpers import MMA_SHAPES
from ourgrad.dtype import DType, dtypes
from ourgrad.errors import ShapeError
from ourgrad.helpers import DEBUG, env_var
from ourgrad.ops import LazyOp, MemBuffer, Ops, format_ast
from ourgrad.renderer import ASSUMED_CUDA_GPU

# threads of a warp, and query rows one warp owns (the M of one mma.sync)
WARP_THREADS, WARP_ROWS = 32, 16
# query rows per CTA, 4 warps of 16: on the H200 (bf16, D = 64, causal) 128-row CTAs (8 warps, or 4 of two m tiles)
# were no faster at T = 4096 and slower at 1024 (shorter causal tails with 64; extra/bench/sweep_attention.py)
BLOCK_M = 64
# the key tile sizes tried, largest first, and how many CTAs at least should share a multiprocessor's shared memory
BLOCK_N_CHOICES = (128, 64, 32, 16)
CTAS_PER_PROCESSOR = 3
# registers per thread the tiles may hold across the key loop: Q's A fragments (D / 4 for 16-bit, D / 2 for TF32),
# O's accumulators (D / 2) and S's (block_n / 2); the rest of the 255 hold P's and V's fragments and addresses
FRAGMENT_REGISTERS = 144
# bytes of one cp.async copy
COPY_BYTES = 16
ATTENTION_LDMATRIX = env_var("ATTENTION_LDMATRIX", 1, "0: the fused attention kernel reads its K (16-bit: and V) "
                             "fragments with plain shared-memory loads instead of ldmatrix (codegen/attention.py)")
ATTENTION_WGMMA = env_var("ATTENTION_WGMMA", 1, "0: the fused attention forward of float16/bfloat16 on sm_90 runs "
                          "on mma.sync instead of wgmma (codegen/attention_wgmma.py)")
ATTENTION_PRODUCER = env_var("ATTENTION_PRODUCER", 1, "1: the wgmma attention forward's rule takes the producer "
                             "kernel (three consumer warpgroups fed by a producer warpgroup, "
                             "codegen/attention_wgmma.py `producer_plan`) where it fits and the grid is large enough; "
                             "0: one warpgroup a CTA")
ATTENTION_RESCALE_SLACK = env_var("ATTENTION_RESCALE_SLACK", 8.0, "the fused attention forward's online softmax "
                                  "moves a row's reference max only where a tile passes it by more than this (log2 "
                                  "units), a warp's rescale skipped where no row passes; 0: rescale every tile "
                                  "(codegen/attention_render.py `_lazy_softmax_lines`)")
ATTENTION_TREE_REDUCE = env_var("ATTENTION_TREE_REDUCE", 0, "1: the fused attention forward's softmax takes a row's "
                                "max and sum of a tile as trees of pairwise operations; 0: as chains (H200 bf16 "
                                "T=4096: the producer rule 0.259 ms with chains, 0.262 with trees; the mma.sync rule "
                                "0.398 and 0.389, results/ck_s17/attnfwd5_2.txt)")
ATTENTION_BLOCKS = env_var("ATTENTION_BLOCKS", "", "block_m,block_n[,stages[,warp_tiles[,min_ctas[,overlap"
                           "[,q_shared[,producer[,consumer_registers[,pingpong[,exp_poly[,persistent]]]]]]]]]]] of "
                           "the fused "
                           "attention forward instead of its rule's (codegen/attention.py `plan_attention`), e.g. "
                           "128,64,2,1,2: what extra/bench/sweep_attention.py tries; overlap 1 (wgmma, 3 stages or "
                           "more, 2 with a producer): S and softmax while the previous P V runs; q_shared 1 (wgmma): "
                           "Q staged in shared memory; producer 1 (wgmma): a producer warpgroup fills a ring of "
                           "stages through mbarriers; consumer_registers: the consumers' setmaxnreg (0: their share); "
                           "pingpong 1: the consumer warpgroups take turns on the tensor cores; exp_poly k: every "
                           "k-th 8 keys' exp2 by a polynomial on the FMA pipe; persistent 1 (producer): one CTA a "
                           "multiprocessor walks its share of the query blocks")
# element dtypes the kernel reads (float32 only through TF32)
OPERAND_DTYPES = (dtypes.float32, dtypes.float16, dtypes.bfloat16)


@dataclass(frozen=True)
class Operand:
  """How the kernel reads one of q, k, v: element (b, h, row, d) is at offset + b*strides[0] + h*strides[1] +
  row*strides[2] + d*strides[3] of its buffer (argument `argument` of the kernel)."""
  argument: int
  offset: int
  strides: tuple[int, int, int, int]

  def vector_aligned(self, vector: int) -> bool:
    """Whether rows can be read in pieces of `vector` neighbouring elements at aligned addresses (cp.async)."""
    return self.strides[3] == 1 and all(value % vector == 0 for value in (self.offset, *self.strides[:3]))


@dataclass(frozen=True)
class AttentionPlan:
  """One fused attention kernel (module docstring), everything its renderer and emulator need."""
  dtype: str                 # the operands' element type: float32 (TF32 mma), float16, bfloat16
  batch: int
  heads: int
  kv_heads: int
  length: int                # L, query rows
  source: int                # S, keys
  head_dim: int              # D (q, k and v alike), a multiple of 16
  causal: bool
  scale: float
  q: Operand
  k: Operand
  v: Operand
  block_m: int = BLOCK_M
  block_n: int = 64
  stages: int = 2
  vector_copies: bool = True   # k and v rows copied with 16-byte cp.async (else element by element)
  ldmatrix: bool = False       # K fragments (16-bit: and V's, .trans) read with ldmatrix, else element loads
  warp_tiles: int = 1          # m tiles of 16 query rows per warp: 2 uses each K/V fragment for twice the rows
  min_ctas: int = 1            # CTAs a multiprocessor must fit (__launch_bounds__): registers <= 64K / threads / it
  mma: str = "mma_sync"        # "wgmma": warpgroups of 64 rows, swizzled K/V tiles (codegen/attention_wgmma.py)
  overlap: bool = False        # wgmma: a tile's S and softmax run while the previous tile's P V is in flight
  q_shared: bool = False       # wgmma: Q staged in shared memory once (S's A operand by descriptor), not in registers
  # wgmma: a producer warpgroup after the block_m / 64 consumer ones copies the key tiles into a ring of `stages`
  # (mbarriers between them, no barrier of the CTA in the loop; FlashAttention-3's warp specialization)
  producer: bool = False
  # producer: the consumers' registers a thread after setmaxnreg.inc (the producer's fall to wgmma_tiles'
  # PRODUCER_REGISTERS); 0: none, every thread keeps the launch bounds' share
  consumer_registers: int = 0
  # producer and overlap, 2+ consumer warpgroups: they take turns issuing their products (named barriers), so one's
  # softmax overlaps the next one's wgmmas (FlashAttention-3's ping-pong)
  pingpong: bool = False
  # every exp_poly-th 8 keys of a tile take exp2 by POLY_EXP2_HELPER on the FMA pipe, the rest by MUFU (at D = 64 a
  # tile's exponentials take MUFU as long as its products take the tensor cores); 0: all by MUFU
  exp_poly: int = 0
  # the online softmax's reference max moves only where a tile's max passes it by more than this (log2 units; P
  # stays under 2^slack), a warp's rescale skipped where none of its rows passes (FlashAttention-4); 0: every tile
  rescale_slack: float = 0.0
  # producer: a persistent grid of one CTA a multiprocessor, each walking its share of the query blocks
  # (attention_wgmma.persistent_lines), the producer copying the next block's tiles while the consumers store this one
  persistent: bool = False
  # the softmax's max and sum of a row's scores as trees of pairwise operations, not chains
  # (attention_render._tree_lines)
  tree_reduce: bool = False
  # 32-bit registers of the multiprocessor it runs on (the device's fact: what setmaxnreg divides)
  multiprocessor_registers: int = ASSUMED_CUDA_GPU.registers_per_multiprocessor
  # the device's multiprocessors (a persistent grid's CTAs)
  multiprocessors: int = ASSUMED_CUDA_GPU.multiprocessors

  @property
  def itemsize(self) -> int: return 4 if self.dtype == "float32" else 2

  @property
  def warp_rows(self) -> int: return WARP_ROWS * self.warp_tiles

  @property
  def warps(self) -> int: return self.block_m // self.warp_rows

  @property
  def folded_scale(self) -> bool:
    """Whether scale * log2(e) is folded into the softmax's exp2 (S kept unscaled): the max of S commutes with a
    positive scale only."""
    return self.scale > 0

  @property
  def consumer_threads(self) -> int:
    """Threads that compute (all but the producer warpgroup's)."""
    return self.warps * WARP_THREADS

  @property
  def threads(self) -> int: return self.consumer_threads + attention_wgmma.WARPGROUP_THREADS * self.producer

  @property
  def row_pitch(self) -> int:
    """Elements of one staged key/value row: D and 16 bytes of padding, so the fragment reads of a warp hit 32
    different banks and each row starts 16-byte aligned."""
    return self.head_dim + COPY_BYTES // self.itemsize

  @property
  def tile_elements(self) -> int: return self.block_n * self.row_pitch

  @property
  def shared_bytes(self) -> int:
    if self.mma == "wgmma": return attention_wgmma.shared_bytes(self)
    return self.stages * 2 * self.tile_elements * self.itemsize

  @property
  def fragment_registers(self) -> int:
    """Registers per thread of Q's A fragments, O's and S's accumulators (FRAGMENT_REGISTERS)."""
    k_step, a_registers, _ = MMA_SHAPES[self.dtype]
    queries = 0 if self.q_shared else self.head_dim // k_step * a_registers
    return (queries + self.head_dim // 2 + self.block_n // 2) * self.warp_tiles

  @property
  def group(self) -> int:
    """Query heads per key/value head."""
    return self.heads // self.kv_heads

  @property
  def query_blocks(self) -> int: return math.ceil(self.length / self.block_m)

  @property
  def items(self) -> int:
    """Query blocks of every (batch, head): the CTAs of the grid, or a persistent grid's work."""
    return self.query_blocks * self.heads * self.batch

  @property
  def global_size(self) -> tuple[int, int, int]:
    if self.persistent: return (min(self.items, self.multiprocessors), 1, 1)
    return (self.query_blocks, self.heads, self.batch)

  @property
  def local_size(self) -> tuple[int, int, int]: return (self.threads, 1, 1)

  @property
  def o_elements(self) -> int: return self.batch * self.length * self.heads * self.head_dim

  @property
  def lse_offset(self) -> int:
    """Where the logsumexp starts in the output, in float32 elements (O's bytes before it: D is a multiple of 16, so
    a 16-bit O ends on a 4-byte boundary)."""
    return self.o_elements * self.itemsize // 4

  @property
  def output_elements(self) -> int:
    """The output buffer's size in elements of the operand type: O, then the float32 logsumexp's bytes."""
    return self.o_elements + self.batch * self.heads * self.length * 4 // self.itemsize

  @property
  def name(self) -> str:
    return (f"attn_{self.batch}_{self.heads}_{self.length}_{self.source}_{self.head_dim}"
            f"{'_causal' if self.causal else ''}")


def plan_attention(q: Operand, k: Operand, v: Operand, shapes: tuple[tuple[int, ...], ...], dtype: DType,
                   causal: bool, scale: float, renderer: Any) -> AttentionPlan:
  """The plan for one attention: BLOCK_M query rows per CTA; keys per tile the largest whose fragments fit
  FRAGMENT_REGISTERS (16-bit D = 64: 128 keys; D = 128: 64; TF32 D = 64: 64, as its shared memory also asks) and
  whose staged tiles leave room for CTAS_PER_PROCESSOR CTAs in a multiprocessor's shared memory. ATTENTION_BLOCKS
  overrides the tiles (and stages, warp tiles, CTAs per multiprocessor). With ATTENTION_WGMMA=1 (the default), a
  renderer with wgmma (sm_90) and operands the wgmma kernel takes (attention_wgmma.wgmma_refusal): mma "wgmma", one
  warpgroup of 64 rows a CTA, the launch bounds asking for as many CTAs a multiprocessor (up to
  CTAS_PER_PROCESSOR) as the registers allow (attention_wgmma.resident_ctas: 3 at D = 64, 2 at D = 128)."""
  (batch, heads, length, head_dim), (_, kv_heads, source, _) = shapes[0], shapes[1]
  vector = COPY_BYTES // dtype.itemsize
  vector_copies = k.vector_aligned(vector) and v.vector_aligned(vector)
  wgmma = bool(ATTENTION_WGMMA) and getattr(renderer, "has_wgmma", False) and \
    attention_wgmma.wgmma_refusal(dtype.name, head_dim, vector_copies) is None
  base = AttentionPlan(dtype.name, batch, heads, kv_heads, length, source, head_dim, causal, scale, q, k, v,
                       vector_copies=vector_copies, ldmatrix=bool(ATTENTION_LDMATRIX),
                       rescale_slack=float(ATTENTION_RESCALE_SLACK.value), tree_reduce=bool(ATTENTION_TREE_REDUCE),
                       mma="wgmma" if wgmma else "mma_sync",
                       block_m=attention_wgmma.WGMMA_BLOCK_M if wgmma else BLOCK_M)
  registers = getattr(renderer, "registers_per_multiprocessor", 0) or ASSUMED_CUDA_GPU.registers_per_multiprocessor
  multiprocessors = getattr(renderer, "multiprocessors", 0) or ASSUMED_CUDA_GPU.multiprocessors
  base = replace(base, multiprocessor_registers=registers, multiprocessors=multiprocessors)
  if ATTENTION_BLOCKS.value: return _with_consumer_registers(
      _checked(replace(base, **_blocks_override(str(ATTENTION_BLOCKS.value)))), registers)
  budget = renderer.dynamic_local_memory_bytes // CTAS_PER_PROCESSOR
  fitting = [replace(base, block_n=block_n) for block_n in BLOCK_N_CHOICES]
  fitting = [plan for plan in fitting if plan.fragment_registers <= FRAGMENT_REGISTERS and plan.shared_bytes <= budget]
  plan = fitting[0] if fitting else replace(base, block_n=BLOCK_N_CHOICES[-1])
  if not wgmma: return plan
  producer = attention_wgmma.producer_plan(plan, multiprocessors, registers, renderer.dynamic_local_memory_bytes) \
      if ATTENTION_PRODUCER else None
  return producer or replace(plan, min_ctas=attention_wgmma.resident_ctas(plan, CTAS_PER_PROCESSOR, registers))


def _with_consumer_registers(plan: AttentionPlan, multiprocessor_registers: int) -> AttentionPlan:
  """A producer's plan with consumer_registers left 0: the consumers take their share of the registers
  (attention_wgmma.consumer_register_share) where it is more than the launch bounds give every thread."""
  if not plan.producer or plan.consumer_registers: return plan
  share = attention_wgmma.consumer_register_share(plan, multiprocessor_registers)
  at_launch = attention_wgmma.launch_registers(plan.threads, plan.min_ctas, multiprocessor_registers)
  return replace(plan, consumer_registers=share) if share > at_launch else plan


def _checked(plan: AttentionPlan) -> AttentionPlan:
  """`plan` where its tiles suit its mma (wgmma: whole warpgroups of 64 rows, one m tile a warp), else ShapeError."""
  if plan.mma == "wgmma" and (plan.block_m % attention_wgmma.WARPGROUP_ROWS or plan.warp_tiles != 1):
    raise ShapeError(f"wgmma attention with {plan.block_m} rows a CTA, {plan.warp_tiles} m tiles a warp: want a "
                     f"multiple of {attention_wgmma.WARPGROUP_ROWS} rows and 1")
  # (the CTA's barrier orders the reuse of a stage with 3 or more; the producer's ring with 2)
  if plan.overlap and (plan.mma != "wgmma" or plan.stages < (2 if plan.producer else 3)):
    raise ShapeError(f"overlapped attention tiles with {plan.mma}, {plan.stages} stages: want wgmma and 3 or more "
                     "(2 with a producer warpgroup)")
  if plan.q_shared and (plan.mma != "wgmma" or not plan.q.vector_aligned(COPY_BYTES // plan.itemsize)):
    raise ShapeError(f"Q in shared memory with {plan.mma}, q {plan.q}: want wgmma and 16-byte aligned rows")
  if plan.producer and (plan.mma != "wgmma" or plan.stages < 2):
    raise ShapeError(f"a producer warpgroup with {plan.mma}, {plan.stages} stages: want wgmma and 2 stages or more")
  if plan.pingpong and not (plan.producer and plan.overlap and plan.block_m >= 2 * attention_wgmma.WARPGROUP_ROWS):
    raise ShapeError(f"ping-pong of {plan.block_m // attention_wgmma.WARPGROUP_ROWS} consumer warpgroups, producer "
                     f"{plan.producer}, overlap {plan.overlap}: want a producer, overlap and 2 warpgroups or more")
  # (Q loaded into registers at each item of a persistent CTA made ptxas serialize the wgmmas, C7519)
  if plan.persistent and not (plan.producer and plan.q_shared):
    raise ShapeError("a persistent attention grid without a producer warpgroup or with Q in registers: want producer "
                     "and q_shared")
  if plan.exp_poly < 0: raise ShapeError(f"exp_poly {plan.exp_poly}: want every k-th 8 keys, k >= 1, or 0 for none")
  if plan.consumer_registers and plan.producer and \
      attention_wgmma.producer_registers(plan) < attention_wgmma.LEAST_PRODUCER_REGISTERS:
    raise ShapeError(f"{plan.consumer_registers} registers for each of {plan.consumer_threads} consumer threads leave "
                     f"the producer {attention_wgmma.producer_registers(plan)} a thread: want "
                     f"{attention_wgmma.LEAST_PRODUCER_REGISTERS} or more")
  if plan.consumer_registers and not plan.producer:
    raise ShapeError(f"{plan.consumer_registers} consumer registers without a producer warpgroup to take them from")
  return plan


BLOCKS_FIELDS = ("block_m", "block_n", "stages", "warp_tiles", "min_ctas", "overlap", "q_shared", "producer",
                 "consumer_registers", "pingpong", "exp_poly", "persistent")
_FLAG_FIELDS = ("overlap", "q_shared", "producer", "pingpong", "persistent")


def _blocks_override(text: str) -> dict[str, Any]:
  """ATTENTION_BLOCKS's "block_m,block_n[,stages[,warp_tiles[,min_ctas[,overlap[,q_shared[,producer
  [,consumer_registers[,pingpong[,exp_poly[,persistent]]]]]]]]]]" as plan fields."""
  values = [int(part) for part in text.split(",")]
  warp_rows = WARP_ROWS * (values[3] if len(values) >= 4 else 1)
  if not 2 <= len(values) <= len(BLOCKS_FIELDS) or values[0] % warp_rows or values[1] % 16:
    raise ShapeError(f"ATTENTION_BLOCKS={text!r}: want block_m,block_n[,stages[,warp_tiles[,min_ctas[,overlap"
                     f"[,q_shared[,producer[,consumer_registers[,pingpong[,exp_poly[,persistent]]]]]]]]]]], block_m "
                     "a multiple of "
                     f"{WARP_ROWS} * warp_tiles, block_n of 16")
  return {name: bool(value) if name in _FLAG_FIELDS else value for name, value in zip(BLOCKS_FIELDS, values)}


def blocks_text(plan: AttentionPlan) -> str:
  """The plan's tiles as ATTENTION_BLOCKS writes them (the fields after min_ctas only as far as one is set)."""
  values = [int(getattr(plan, name)) for name in BLOCKS_FIELDS]
  while len(values) > 5 and not values[-1]: values.pop()
  return ",".join(map(str, values))


def is_attention(ast: LazyOp) -> bool:
  """Whether a kernel AST is a fused attention's (STORE(ATTENTION(q, k, v)))."""
  return ast.op is Ops.STORE and ast.srcs[0].op is Ops.ATTENTION


def operand_of(load: LazyOp) -> Operand:
  """How the kernel reads a LOAD of the attention AST: its buffer argument and its one View's offset and strides."""
  view = load.arg.st.views[-1]
  if len(load.arg.st.views) != 1 or view.mask is not None or load.srcs:
    raise AssertionError(f"an attention operand must be one unmasked view, got {load.arg.st}")
  return Operand(load.arg.idx, int(view.offset), tuple(int(stride) for stride in view.strides))  # type: ignore[arg-type]


class AttentionKernel:
  """The kernel of one fused attention AST (module docstring)."""

  def __init__(self, ast: LazyOp, renderer: Any):
    if not is_attention(ast): raise AssertionError(f"not an attention's AST: {ast.op}")
    self.ast, self.renderer = ast, renderer
    loads = ast.srcs[0].srcs
    if any(load.op is not Ops.LOAD or not isinstance(load.arg, MemBuffer) for load in loads):
      raise AssertionError("attention sources must be loads of realized buffers (engine/schedule.py)")
    self.leaves: list[LazyOp] = [ast, *loads]
    self.sts = [leaf.arg.st for leaf in self.leaves]
    self.applied_opts: list[Any] = []
    causal, scale = ast.srcs[0].arg
    shapes = tuple(load.arg.st.shape for load in loads)
    q, k, v = (operand_of(load) for load in loads)
    self.plan = plan_attention(q, k, v, shapes, loads[0].dtype, causal, scale, renderer)
    self.attention = (self.plan, {"out": 0, "q": q.argument, "k": k.argument, "v": v.argument})

  @property
  def name(self) -> str: return self.plan.name

  def colored_shape(self) -> str:
    plan = self.plan
    return f"{plan.batch} {plan.heads} {plan.length} {plan.source} {plan.head_dim}"

  def print_debug(self) -> None:
    if DEBUG >= 3:
      print(format_ast(self.ast))
      print(f"{self.name}: fused attention, plan {self.plan}")

  def op_count(self) -> int:
    """Multiply-adds of S = Q K^T and O = P V (each 2 ops), halved by a causal mask."""
    plan = self.plan
    full = 4 * plan.batch * plan.heads * plan.length * plan.source * plan.head_dim
    return full // 2 if plan.causal else full

  def byte_count(self) -> int:
    """q, k, v read once, O and the logsumexp written once."""
    plan = self.plan
    inputs = plan.batch * (plan.heads * plan.length + 2 * plan.kv_heads * plan.source) * plan.head_dim
    return (inputs + plan.output_elements) * plan.itemsize
