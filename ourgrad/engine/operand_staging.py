"""Operand staging: a matmul's operands stored first in the layout the device's warpgroup MMA (WGMMA) plan reads.

The WGMMA kernel (codegen/wgmma_tiles.py) copies whole tiles of its operands with 16-byte asynchronous copies, so
it reads each operand as one plain buffer: a LOAD through one unmasked view from offset 0 whose loop nest merges to
(batch, M, N, K); and TensorFloat-32 operands (float32 where `set_float32_matmul_precision("high")` allows TF32)
K-major, since the TF32 instruction cannot transpose (A stored M x K, B stored N x K). In a training step most
matmuls miss that: an input gradient g @ W reads W as K x N, a weight gradient g^T @ x reads both sides M/N-major,
and an operand may be an expression cheap enough to stay fused (the qkv gradient: a cat of the q/k/v gradients as
padded views; LayerNorm and GELU outputs cost more and the recomputation rule stores them). Those run on mma.sync at
a fraction of WGMMA's rate.

`stage_matmul_operands(bases, realizes)` runs in the scheduler after the realizations that need no kernel walk are
chosen (engine/schedule.py). For every SUM of a MUL that is matmul-shaped, on a device whose renderer has WGMMA,
whose dtype policy lets the plan read it and whose sizes divide the plan's smallest block tile, it makes the matmul
kernel plain K-major loads:
- an operand that is not such a load gets a CONTIGUOUS base of its own: the operand without its broadcast axes,
  laid out (batch axes, its own output axes, the reduce axes), read back by the matmul through a permute and an
  expand. The copy (a tiled transpose where the layout changes) moves 2 x the operand's bytes; every staged element
  then feeds `other` outputs of the matmul (the other operand's output size) at WGMMA's rate. It pays where
  `other` is at least the plan's block tile (tensor_core_plans.WGMMA_STAGED_TILE): below that the matmul reads each
  element fewer times than a block's tile of outputs and the copy's two passes are not amortized;
  An operand whose staged copy would hold more than MAX_STAGED_GROWTH times the elements of the base it reads (a
  convolution's window view: im2col repeats each element kh * kw times) is not staged: the matmul is left alone;
- the reduce's result is stored as it is where an epilogue (a bias add, an activation) would fuse into it: the
  WGMMA kernel stores its accumulators plainly. Storing costs 2 x the output's bytes, amortized over the K
  multiply-adds of each output: done where K is at least the same tile.
GPT-2's attention products (per head, 64 wide): the scores q k^T (512 x 512, K = 64) keep their scale/mask
epilogue fused (K below the tile), the weighted sums and three of the four gradients have a 64-wide output side
(below the tile: the plan cannot tile it), and the scores' gradient dO V^T (512 x 512 x 64, its result stored
already) gets dO and V staged per head (each element then feeds 512 outputs).
Devices without WGMMA (CPUs, pre-Hopper GPUs) and float32 without TF32 never stage: their schedule is unchanged.
The decisions are printed at DEBUG=3 with the realize reasons (and the refusals of matmul-shaped reduces).

16-bit matmuls (autocast: a float32 SUM of the product of widening casts of float16/bfloat16 values, no TF32
needed): the plan loads the 16-bit values, K-major or MN-major (the instruction transposes 16-bit operands), so only
an operand that is an expression (a float32 weight's cast) or a view the plan does not read (masked, offset, several
views) is staged, in its 16-bit dtype (K-major), and the product widens the staged values as it did; the result is
stored where its epilogue (a bias) would fuse, by the same cost rule, in the 16-bit dtype where the SUM's only reader
narrows it to that (autocast's output: half the bytes of the float32 sum).
"""
from __future__ import annotations

from dataclasses import dataclass

from ourgrad.codegen.matmul_operands import varying_axes
from ourgrad.codegen.opt.tensor_core_plans import WGMMA_MIN_WORK, WGMMA_STAGED_TILE
from ourgrad.codegen.wgmma_copies import ROW_BYTES
from ourgrad.device import Device
from ourgrad.dtype import dtypes
from ourgrad.helpers import DEBUG, fmt_size, prod, tf32_allowed
from ourgrad.lazy import LazyBuffer
from ourgrad.ops import Ops
from ourgrad.shape.shapetracker import ShapeTracker

Realizations = dict   # base id -> why it gets its own buffer (as in engine/kernel_walk.py)

# operand dtypes the WGMMA instruction reads in either layout (it transposes them; TF32 it cannot)
LOW_DTYPES = (dtypes.float16, dtypes.bfloat16)



@dataclass(frozen=True)
class MatmulLoop:
  """A matmul-shaped SUM in its loop shape: the loop axes of each kind (size-1 axes in none)."""
  reduce: LazyBuffer      # the SUM base
  product: LazyBuffer     # the MUL base it reduces (read by nothing else)
  operands: tuple[LazyBuffer, LazyBuffer]   # the MUL's two sources, views in the loop shape; A first
  batch: tuple[int, ...]  # output axes both operands vary along
  own: tuple[tuple[int, ...], tuple[int, ...]]   # output axes only A (M) / only B (N) varies along
  k: tuple[int, ...]      # reduce axes (both vary along them)

  def size(self, axes: tuple[int, ...]) -> int: return prod(self.product.shape[axis] for axis in axes)

  def layout(self, side: int) -> tuple[int, ...]:
    """The loop axes of operand `side` in the order its K-major buffer stores them."""
    return self.batch + self.own[side] + self.k

  def describe(self) -> str:
    batch = f"{self.size(self.batch)} x " if self.batch else ""
    return f"{batch}{self.size(self.own[0])}x{self.size(self.own[1])}x{self.size(self.k)} matmul"


def stage_matmul_operands(bases: list[LazyBuffer], realizes: Realizations) -> list[LazyBuffer]:
  """Stage the operands (and store the results) of the matmuls WGMMA could run, as the module docstring says.
  Returns `bases` with the staged operands' CONTIGUOUS bases inserted before the products that read them; their
  reasons are in `realizes`. Unchanged where no device of `bases` has WGMMA."""
  reduce_devices = {base.device for base in bases if base.op is Ops.SUM}
  wgmma_devices = {device for device in reduce_devices if getattr(Device[device].renderer, "has_wgmma", False)}
  if not wgmma_devices: return bases
  readers = _readers(bases)
  users = {base_id: len(bases_reading) for base_id, bases_reading in readers.items()}
  staged: dict[tuple[int, ShapeTracker], LazyBuffer] = {}   # (operand base, its staged view) -> the staged base
  inserted: dict[int, list[LazyBuffer]] = {}   # id(product) -> the staged bases to place before it
  for base in bases:
    if base.op is not Ops.SUM or base.device not in wgmma_devices: continue
    loop = _matmul_loop(base, users, realizes)
    if loop is None: continue
    result = _result_base(loop, readers)
    refusal = _wgmma_refusal(loop, stored=id(result) in realizes) or _duplicating_operand(loop, realizes)
    if refusal is not None:
      if DEBUG >= 3: print(f"operand staging: {loop.describe()} {base.shape} not staged: {refusal}")
      continue
    if id(result) not in realizes:
      cast = f" (cast to {result.dtype.name})" if result is not base else ""
      realizes[id(result)] = (f"the result of a {loop.describe()} stored as it is{cast} (WGMMA fuses no epilogue): "
                              f"2 x {fmt_size(result.size * result.dtype.itemsize)} amortized over "
                              f"K={loop.size(loop.k)} >= {WGMMA_STAGED_TILE} products per output")
    for side in (0, 1): _stage_operand(loop, side, realizes, staged, inserted)
  if not inserted: return bases
  ordered: list[LazyBuffer] = []
  for base in bases:
    ordered.extend(inserted.get(id(base), ()))
    ordered.append(base)
  return ordered


def _readers(bases: list[LazyBuffer]) -> dict[int, list[LazyBuffer]]:
  """id(base) -> the distinct bases reading it."""
  readers: dict[int, dict[int, LazyBuffer]] = {}
  for base in bases:
    for src in base.srcs: readers.setdefault(id(src.base), {})[id(base)] = base
  return {base_id: list(by_id.values()) for base_id, by_id in readers.items()}


def _result_base(loop: MatmulLoop, readers: dict[int, list[LazyBuffer]]) -> LazyBuffer:
  """The base whose store the WGMMA kernel makes: the SUM, or where its only reader narrows it to the 16-bit dtype
  of the operands (autocast's matmul result, through a reshape), that cast: storing it halves the result's bytes."""
  reduce = loop.reduce
  bases_reading = readers.get(id(reduce), [])
  if len(bases_reading) != 1: return reduce
  reader = bases_reading[0]
  operands = _plan_operands(loop)
  if reader.op is not Ops.CAST or operands is None or reader.dtype != operands[0].dtype or \
      reader.dtype not in LOW_DTYPES or len(reader.srcs) != 1: return reduce
  src = reader.srcs[0]
  return reader if src.base is reduce and src.st.contiguous else reduce


def _matmul_loop(reduce: LazyBuffer, users: dict[int, int], realizes: Realizations) -> MatmulLoop | None:
  """The matmul `reduce` computes, where it is a SUM of a MUL of two operands in the loop shape that no one else
  reads, each output axis varied along by A, by B or by both (batch) and each reduce axis by both; the output axes
  in the order batch, then one operand's, then the other's (the loop nest then merges into (batch, M, N, K))."""
  product = reduce.srcs[0]
  if not (product.st.contiguous and product.shape == product.base.shape): return None
  product = product.base
  if not all(isinstance(size, int) for size in product.shape): return None   # a symbolic size: no tile to check
  if product.op is not Ops.MUL or product.realized is not None or id(product) in realizes: return None
  if users.get(id(product), 0) != 1 or len(product.srcs) != 2: return None
  varies = [varying_axes(src.st.simplify())[0] for src in product.srcs]
  kinds: list[str] = []   # per output axis of size > 1, in loop order: "batch", "0" (A only) or "1" (B only)
  axes: dict[str, list[int]] = {"batch": [], "0": [], "1": [], "k": []}
  for axis, size in enumerate(product.shape):
    if size == 1: continue
    a_varies, b_varies = varies[0][axis], varies[1][axis]
    if axis in reduce.arg:
      if not (a_varies and b_varies): return None
      axes["k"].append(axis)
      continue
    if not (a_varies or b_varies): return None
    kind = "batch" if a_varies and b_varies else ("0" if a_varies else "1")
    axes[kind].append(axis)
    if not kinds or kinds[-1] != kind: kinds.append(kind)
  if not axes["0"] or not axes["1"] or not axes["k"]: return None
  if kinds not in (["batch", "0", "1"], ["batch", "1", "0"], ["0", "1"], ["1", "0"]): return None
  first = 0 if kinds[-2] == "0" else 1   # A: the operand whose own axes come first (the output's rows)
  operands = (product.srcs[first], product.srcs[1 - first])
  return MatmulLoop(reduce, product, operands, tuple(axes["batch"]),
                    (tuple(axes[str(first)]), tuple(axes[str(1 - first)])), tuple(axes["k"]))


def _low_operand(operand: LazyBuffer) -> LazyBuffer | None:
  """The float16/bfloat16 values a float32 operand widens (a view of a CAST of 16-bit data: autocast's matmuls),
  seen through the operand's view (in the loop shape), or None where the operand is no such cast."""
  base = operand.base
  if base.op is not Ops.CAST or base.dtype != dtypes.float32: return None
  inner = base.srcs[0]
  if inner.dtype not in LOW_DTYPES: return None
  return inner.view(inner.st + operand.st)


def _plan_operands(loop: MatmulLoop) -> tuple[LazyBuffer, LazyBuffer] | None:
  """The operands the WGMMA plan would load: the 16-bit values both operands widen (one dtype), or the float32
  operands themselves where TF32 is allowed; None where neither."""
  if loop.reduce.dtype != dtypes.float32: return None
  low = tuple(_low_operand(operand) for operand in loop.operands)
  if low[0] is not None and low[1] is not None and low[0].dtype == low[1].dtype: return low[0], low[1]
  if all(operand.dtype == dtypes.float32 for operand in loop.operands) and tf32_allowed(): return loop.operands
  return None


def _wgmma_refusal(loop: MatmulLoop, stored: bool) -> str | None:
  """Why the WGMMA plan could not run this matmul even with staged operands (and its result `stored` as it is, or
  stored by this rule), or None where it can."""
  operands = _plan_operands(loop)
  if operands is None:
    return ("not a float32 product of float16/bfloat16 casts (one dtype), nor of float32 operands where TF32 is "
            "allowed (set_float32_matmul_precision('high'))")
  m, n, k = loop.size(loop.own[0]), loop.size(loop.own[1]), loop.size(loop.k)
  block_k = ROW_BYTES // operands[0].dtype.itemsize
  if m % WGMMA_STAGED_TILE or n % WGMMA_STAGED_TILE or k % block_k:
    return f"M={m}, N={n} not multiples of the {WGMMA_STAGED_TILE} tile or K={k} of {block_k}"
  if loop.size(loop.batch) * m * n * k < WGMMA_MIN_WORK: return f"under WGMMA_MIN_WORK ({WGMMA_MIN_WORK}) products"
  if not stored and k < WGMMA_STAGED_TILE: return f"K={k} < {WGMMA_STAGED_TILE}: its epilogue stays fused"
  return None


# a staged operand may hold at most this many times the elements of the base it reads: a pad or a cat of views adds
# some; a convolution's window view (im2col) repeats each element kh * kw times, which its own plans read in place
MAX_STAGED_GROWTH = 2


def _duplicating_operand(loop: MatmulLoop, realizes: Realizations) -> str | None:
  """Why staging would copy an operand's data several times over (a convolution's windows), or None."""
  operands = _plan_operands(loop)
  assert operands is not None, "checked by _wgmma_refusal"
  for side, operand in enumerate(operands):
    staged_size = loop.size(loop.layout(side))
    if not _reads_as_plan_layout(operand, _plan_layouts(loop, side, operand), realizes) and \
        staged_size > MAX_STAGED_GROWTH * operand.base.size:
      return (f"operand {'AB'[side]} would be {staged_size // operand.base.size}x the {operand.base.shape} it reads "
              f"(a window view, as a convolution's: its own plans read it in place)")
  return None


# (batch axes, row axes, axes within a row) of an operand in one order the WGMMA plan reads
Layout = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
# the plan's asynchronous copies move 16 bytes from 16-byte aligned addresses: each row and batch starts on one
COPY_ALIGN_BYTES = 16


def _plan_layouts(loop: MatmulLoop, side: int, operand: LazyBuffer) -> tuple[Layout, ...]:
  """The loop axes of operand `side` in each order the WGMMA plan reads it: K-major first; 16-bit operands also
  MN-major (the instruction transposes them: W of x @ W, g^T of a weight gradient)."""
  k_major = (loop.batch, loop.own[side], loop.k)
  if operand.dtype not in LOW_DTYPES: return (k_major,)
  return (k_major, (loop.batch, loop.k, loop.own[side]))


def _reads_as_plan_layout(operand: LazyBuffer, layouts: tuple[Layout, ...], realizes: Realizations) -> bool:
  """Whether `operand` is already a plain load of a stored buffer that the plan reads in one of `layouts`
  (wgmma_tiles.plan_for_kernel): one unmasked view from offset 0, each group of axes merging into one (the loop nest
  then merges into (batch, M, N, K)), the axes within a row contiguous, rows at least a row apart (a split-K part
  reads a slice of each row of its operand) and batches anywhere, every row and batch on an aligned address."""
  base = operand.base
  if base.realized is None and id(base) not in realizes: return False   # an expression: computed inside the matmul
  st = operand.st.simplify()
  if len(st.views) != 1 or st.views[0].mask is not None or st.views[0].offset != 0: return False
  shape, strides = st.shape, st.views[0].strides
  if not all(isinstance(stride, int) for stride in strides): return False
  align = COPY_ALIGN_BYTES // operand.dtype.itemsize
  return any(_reads_as(shape, strides, layout, align) for layout in layouts)


def _reads_as(shape: tuple[int, ...], strides: tuple[int, ...], layout: Layout, align: int) -> bool:
  """_reads_as_plan_layout for one layout, given the view's `shape` and `strides` and the copies' alignment in
  elements."""
  in_layout = {axis for group in layout for axis in group}
  if any(shape[axis] != 1 and strides[axis] != 0 for axis in range(len(shape)) if axis not in in_layout): return False
  merged: list[tuple[int, int]] = []   # (size, stride) of each group merged into one axis
  for group in layout:
    sized = [axis for axis in group if shape[axis] != 1]
    if any(strides[outer] != strides[inner] * shape[inner] for outer, inner in zip(sized, sized[1:])): return False
    merged.append((prod(shape[axis] for axis in sized), strides[sized[-1]] if sized else 0))
  (batches, batch_stride), (rows, row_stride), (row, element_stride) = merged
  if row > 1 and element_stride != 1: return False
  if rows > 1 and (row_stride < row or row_stride % align): return False
  return batches == 1 or batch_stride % align == 0


def _stage_operand(loop: MatmulLoop, side: int, realizes: Realizations,
                   staged: dict[tuple[int, ShapeTracker], LazyBuffer], inserted: dict[int, list[LazyBuffer]]) -> None:
  """Give operand `side` of `loop` its K-major buffer unless it is one the plan reads already; the product reads it
  instead (a 16-bit operand: its 16-bit values stored, widened in the matmul as before)."""
  operand, plan_operands = loop.operands[side], _plan_operands(loop)
  assert plan_operands is not None, "checked by _wgmma_refusal"
  plan_operand = plan_operands[side]
  layout = loop.layout(side)
  if _reads_as_plan_layout(plan_operand, _plan_layouts(loop, side, plan_operand), realizes): return
  loop_shape = loop.product.shape
  dropped = tuple(axis for axis in range(len(loop_shape)) if axis not in layout)   # broadcast and size-1 axes
  shape = tuple(loop_shape[axis] for axis in layout)
  one_of_each = plan_operand.shrink(tuple((0, 1) if axis in dropped else (0, size)
                                          for axis, size in enumerate(loop_shape)))
  source = one_of_each.permute(layout + dropped).reshape(shape)
  key = (id(source.base), source.st)
  base = staged.get(key)
  if base is None:
    base = LazyBuffer.create_base(operand.device, shape, plan_operand.dtype, Ops.CONTIGUOUS, None, (source,))
    staged[key] = base
    inserted.setdefault(id(loop.product), []).append(base)
    other = loop.size(loop.own[1 - side])
    plain = plan_operand.base.realized is None and id(plan_operand.base) not in realizes
    why = "an expression of loads" if plain else \
        "a view WGMMA does not read (not K-major, several views, masked or offset)"
    realizes[id(base)] = (f"operand {'AB'[side]} of a {loop.describe()} staged K-major for WGMMA ({why}): the copy "
                          f"moves 2 x {fmt_size(base.size * base.dtype.itemsize)}, each element then feeds {other} "
                          f">= {WGMMA_STAGED_TILE} outputs")
  inverse = tuple(sorted(range(len(loop_shape)), key=(layout + dropped).__getitem__))
  back = base.reshape(shape + (1,) * len(dropped)).permute(inverse).expand(loop_shape)
  if back.dtype != operand.dtype:   # the 16-bit values widened in the matmul, as the operand did (a fused cast)
    back = back.cast(operand.dtype)
    inserted.setdefault(id(loop.product), []).append(back)
  loop.product.srcs = tuple(back if src is operand else src for src in loop.product.srcs)
