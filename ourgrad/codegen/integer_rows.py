"""Integer inner sums in a CPU row kernel: a float SUM over a row whose value is, per element, integer values cast to
float times factors that stay the same along the row's innermost axes (a quantized product: per block of 32, quants
times quants times the two blocks' scales) is taken as a nested reduce: for each position of the outer row axes (a
block), an exact integer sum of each integer value over the inner axes, then the float sum adds each integer sum
once times its factors. `sum_b sum_i f_b * q_bi = sum_b f_b * (sum_i q_bi)` with the inner sums exact: the result
differs from the flat float sum by rounding only (fewer roundings).

The inner loop is an `omp simd` loop of plain integer additions (`acc += (int)nibble * (int)x`), the form C compilers
turn into SIMD integer dot products at any -march (AVX-512 VNNI `vpdpbusd`, AVX2 `vpmaddubsw`/`vpmaddwd`, SSE
`pmaddwd`): an integer sum may be reordered freely, where a float one keeps its order and needs lanes of its own.
An integer value is taken only where its range (from its loads' dtypes through casts, shifts, masks, products and
sums) times the inner count fits an int32: the sums never wrap (lanes compile without -fwrapv).

Main entries: `integer_terms(kernel, reduce)` gives the split (`IntegerTerms`) or None; `lower_integer_terms` emits
its UOps for RowLinearizer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ourgrad.codegen.linearizer import Linearizer, reduce_identity
from ourgrad.codegen.uops import SIGNED_BYTES, AxisType, UOp, UOps
from ourgrad.dtype import DType, dtypes
from ourgrad.ops import LazyOp, Ops
from ourgrad.shape.symbolic import Node, NumNode, Variable

if TYPE_CHECKING: from ourgrad.codegen.kernel import Kernel

INT32_LIMIT = 2 ** 31 - 1


@dataclass(frozen=True)
class IntegerTerms:
  """A row reduce's value split along its `inner_axes` (the innermost row axes): sum over them of each of `terms`
  (an integer node, summed exactly) times its factors, plus each of `rest` (nodes invariant along the inner axes,
  added inner-count times) times its factors. Factors are float nodes invariant along the inner axes."""
  terms: tuple[tuple[LazyOp, tuple[LazyOp, ...]], ...]
  rest: tuple[tuple[LazyOp, tuple[LazyOp, ...]], ...]
  inner_axes: tuple[int, ...]


def integer_terms(kernel: "Kernel", reduce: LazyOp) -> IntegerTerms | None:
  """The integer split of a CPU row kernel's `reduce` (a float SUM over `kernel.row_axes`), or None where its value
  is not a sum of (integer values cast to float) x (factors invariant along the innermost row axis) plus invariant
  values, or an integer sum could overflow an int32. The inner axes are the longest run of innermost row axes along
  which every factor stays the same (at least one axis, never all the row axes: the outer sum needs a loop)."""
  row_axes = tuple(kernel.row_axes or ())
  if reduce.op is not Ops.SUM or not reduce.dtype.is_float or len(row_axes) < 2: return None
  shape = kernel.full_shape
  views = {id(leaf): st for leaf, st in zip(kernel.leaves, kernel.sts)}   # each leaf's view in the kernel's loop shape
  best = None
  for count in range(1, len(row_axes)):
    inner_axes = row_axes[-count:]
    entries = _split(reduce.srcs[0], lambda node, axes=inner_axes: _varies(node, axes, views))
    if entries is None: break
    terms = tuple(entry for entry in entries if entry[0].op is Ops.CAST and _varies(entry[0], inner_axes, views))
    rest = tuple(entry for entry in entries if entry not in terms)
    inner_count = math.prod(shape[axis] for axis in inner_axes)
    bounds = [integer_bound(node.srcs[0]) for node, _ in terms]
    if not terms or any(bound is None or bound * inner_count > INT32_LIMIT for bound in bounds): break
    best = IntegerTerms(terms, rest, inner_axes)
  return best


def _varies(node: LazyOp, axes: tuple[int, ...], sts: dict[int, Any]) -> bool:
  """Whether `node`'s value may change along any of `axes`: some load or constant under it (its view in `sts`, by
  id) is not broadcast there (one view, size 1 or stride 0, unmasked along the axis)."""
  for leaf in node.walk():
    if leaf.op not in (Ops.LOAD, Ops.CONST): continue
    views = sts[id(leaf)].views
    for axis in axes:
      view = views[0]
      broadcast = len(views) == 1 and (view.shape[axis] == 1 or view.strides[axis] == 0) and \
          (view.mask is None or tuple(view.mask[axis]) == (0, view.shape[axis]))
      if not broadcast: return True
  return False


def _split(node: LazyOp, varies) -> list[tuple[LazyOp, tuple[LazyOp, ...]]] | None:
  """`node` as a list of (core, factors) whose sum it is: a core is an integer value cast to float that varies, or
  a node that does not vary; factors do not vary. None where a varying product of two varying values (or any other
  varying op) is met. An explicit stack of pending (node, factors) pairs, no recursion."""
  entries: list[tuple[LazyOp, tuple[LazyOp, ...]]] = []
  pending: list[tuple[LazyOp, tuple[LazyOp, ...]]] = [(node, ())]
  while pending:
    current, factors = pending.pop()
    if not varies(current): entries.append((current, factors))
    elif current.op is Ops.ADD: pending += [(src, factors) for src in current.srcs]
    elif current.op is Ops.MUL:
      left, right = current.srcs
      if not varies(right): pending.append((left, factors + (right,)))
      elif not varies(left): pending.append((right, factors + (left,)))
      else: return None
    elif current.op is Ops.CAST and current.dtype.is_float and _is_integer(current.srcs[0].dtype):
      entries.append((current, factors))
    else: return None
  return entries


def _is_integer(dtype: DType) -> bool: return not dtype.is_float and dtype != dtypes.bool


def integer_bound(node: LazyOp) -> int | None:
  """The largest |value| an integer node can take, from its leaves' dtypes through casts, masks (AND with a
  non-negative side), right shifts by constants, products and sums; None where unknown (other ops)."""
  ranges: dict[int, tuple[int, int]] = {}
  for current in node.walk():
    found = _range(current, [ranges.get(id(src)) for src in current.srcs])
    if found is None: return None
    ranges[id(current)] = found
  low, high = ranges[id(node)]
  return max(abs(low), abs(high))


def _range(node: LazyOp, sources: list[tuple[int, int] | None]) -> tuple[int, int] | None:
  """[low, high] of one integer node given its sources' ranges (None: unknown)."""
  if not _is_integer(node.dtype) or any(source is None for source in sources): return None
  limits = (int(node.dtype.min), int(node.dtype.max))
  if node.op is Ops.CONST:   # a masked constant is 0 in the padding
    value = int(node.arg.val)   # (masks only ever widen this range, so the AST's own view answers)
    return (min(value, 0), max(value, 0)) if node.arg.st.views[-1].mask is not None else (value, value)
  if node.op is Ops.LOAD: return limits
  if node.op in (Ops.CAST, Ops.BITCAST):
    source = sources[0]
    if node.op is Ops.CAST and source is not None and limits[0] <= source[0] and source[1] <= limits[1]: return source
    return limits
  if node.op is Ops.AND:
    masks = [source for source in sources if source is not None and source[0] >= 0]
    return (0, min(mask[1] for mask in masks)) if masks else None
  if node.op is Ops.SHR:
    (low, high), shift = sources[0], sources[1]
    if low < 0 or shift is None or shift[0] != shift[1]: return None
    return low >> shift[0], high >> shift[0]
  if node.op in (Ops.MUL, Ops.ADD):
    (a_low, a_high), (b_low, b_high) = sources[0], sources[1]
    if node.op is Ops.ADD: low, high = a_low + b_low, a_high + b_high
    else:
      products = [a_low * b_low, a_low * b_high, a_high * b_low, a_high * b_high]
      low, high = min(products), max(products)
    return (low, high) if limits[0] <= low and high <= limits[1] else None
  return None


def lower_integer_terms(linearizer: Linearizer, idxs: list[Node], reduce: LazyOp, split: IntegerTerms,
                        number: int) -> UOp:
  """The UOps of a row reduce split by `integer_terms`, in a CPU row kernel (RowLinearizer: a thread per row), at the
  row's `idxs` (its row axes' entries are set while the loops are open, 0 after): a loop over the outer row axes;
  inside it an int32 accumulator per integer term summed over the inner axes (the innermost an `omp simd` loop the C
  compiler turns into integer dot products), then one float addition of the terms times their factors (computed at
  inner index 0: they do not vary there) and of the invariant rest times the inner count. Where the renderer has
  byte dot products and every term is one (`byte_dots`), each term's SIMD partial sums are instead multiplied by its
  factors and added into float lanes (BYTE_DOT_ADD), totalled once after the loops: no horizontal sum a block.
  Returns the float accumulator (the reduce's value after the loops)."""
  build, shape, dtype = linearizer.builder, linearizer.kernel.full_shape, reduce.dtype
  total = build.add(UOps.DEFINE_ACC, dtype, (), reduce_identity(reduce.op, dtype))
  byte_dot_products = getattr(linearizer.kernel.renderer, "byte_dot_products", False) and dtype == dtypes.float32
  dots = byte_dots(linearizer.kernel, split) if byte_dot_products else None
  lanes = [build.add(UOps.DOT_LANES, dtypes.float32) for _ in dots] if dots is not None else []
  outer = [axis for axis in linearizer.kernel.row_axes or () if axis not in split.inner_axes]
  outer_loops = [_open_index_loop(linearizer, idxs, axis, f"ridx{number}_", AxisType.REDUCE) for axis in outer]
  sums = _lower_lane_loops(linearizer, idxs, split, number) if dots is None else []
  for axis in split.inner_axes: idxs[axis] = NumNode(0)
  inner_count = math.prod(shape[axis] for axis in split.inner_axes)
  for accumulator, pairs, (_, factors) in zip(lanes, dots or (), split.terms):
    _add_byte_dot(linearizer, idxs, split.inner_axes[0], pairs, accumulator, _scaled(linearizer, idxs, None, factors))
  parts = [(build.add(UOps.CAST, dtype, (accumulator,)), factors, 1.0)
           for accumulator, (_, factors) in zip(sums, split.terms)]
  for core, factors in split.rest:
    core, constant = _peel_constants(core)
    parts.append((linearizer.compute(core, idxs, None), factors, constant * inner_count))
  block_value: UOp | None = None
  for value, factors, constant in parts:
    value = _scaled(linearizer, idxs, value, factors, constant)
    block_value = value if block_value is None else build.alu(Ops.ADD, dtype, block_value, value)
  if block_value is not None: build.add(UOps.ACCUMULATE, dtype, (total, block_value), Ops.ADD)
  for loop in reversed(outer_loops): build.end_range(loop)
  for axis in outer: idxs[axis] = NumNode(0)
  for accumulator in lanes:
    build.add(UOps.ACCUMULATE, dtype, (total, build.add(UOps.LANES_TOTAL, dtype, (accumulator,))), Ops.ADD)
  return total


def _scaled(linearizer: Linearizer, idxs: list[Node], value: UOp | None, factors: tuple[LazyOp, ...],
            constant: float = 1.0) -> UOp:
  """`value` (None: 1) times `factors` and `constant` (float32), the constant factors multiplied here, once:
  `offset / 16 * 16` is 1."""
  build = linearizer.builder
  for factor in factors:
    if _uniform_constant(factor) is not None: constant *= _uniform_constant(factor)
    else:
      computed = linearizer.compute(factor, idxs, None)
      value = computed if value is None else build.alu(Ops.MUL, computed.dtype, value, computed)
  if value is None: return build.const(constant, dtypes.float32)
  return value if constant == 1.0 else build.alu(Ops.MUL, value.dtype, value, build.const(constant, value.dtype))


def _lower_lane_loops(linearizer: Linearizer, idxs: list[Node], split: IntegerTerms, number: int) -> list[UOp]:
  """An int32 accumulator per integer term, summed over the inner axes in loops, the innermost an `omp simd` loop the
  C compiler vectorizes (16-bit products and a horizontal sum a block, as gcc does it)."""
  build = linearizer.builder
  sums = [build.add(UOps.DEFINE_ACC, dtypes.int32, (), 0) for _ in split.terms]
  # the innermost inner axis an UNROLL loop: the C renderer marks it `omp simd`
  inner_loops = [_open_index_loop(linearizer, idxs, axis, f"ridx{number}_",
                                  AxisType.UNROLL if axis == split.inner_axes[-1] else AxisType.REDUCE)
                 for axis in split.inner_axes]
  for accumulator, (term, _) in zip(sums, split.terms):
    value = linearizer.compute(term.srcs[0], idxs, None)
    if value.dtype != dtypes.int32: value = build.add(UOps.CAST, dtypes.int32, (value,))
    build.add(UOps.ACCUMULATE, dtypes.int32, (accumulator, value), Ops.ADD)
  for loop in reversed(inner_loops): build.end_range(loop)
  return sums


@dataclass(frozen=True)
class BytePair:
  """One product of a byte dot product, lane by lane: ((`unsigned` >> shift) & mask) times `signed`, both loads of
  one byte at consecutive addresses along the inner axis (a Q4 block's nibbles times an 8-bit activation); with
  shift SIGNED_BYTES, `unsigned` is read as int8 (a Q8_0 block's quants, bitcast from its bytes) and mask unused."""
  unsigned: LazyOp
  shift: int
  mask: int
  signed: LazyOp


# the lanes a byte dot product takes at once (one 128-bit register of bytes); the inner axis a multiple of it
BYTE_DOT_LANES = 16


def byte_dots(kernel: "Kernel", split: IntegerTerms) -> list[tuple[BytePair, ...]] | None:
  """Each integer term of `split` as the pairs of its byte dot product, or None where one is not: a term must be a
  sum of products of an unsigned byte (a uint8 load, shifted right and masked by constants, at most 127: the
  pairwise 16-bit sums of `pmaddubsw` cannot saturate) or a signed byte (int8, or uint8 bitcast to int8) and a
  signed one (an int8 load), both unmasked with unit stride along the one inner axis, whose length is a multiple of
  BYTE_DOT_LANES. SIMD byte multiply-adds sum those
  (the C renderer's helpers: `pmaddubsw` + `pmaddwd`), where gcc's own vectorizer widens every byte to 16 bits and
  ends each block with a horizontal sum (Q4_1 3072x576 at -march=native: 190 us against 65-100 us)."""
  if len(split.inner_axes) != 1 or kernel.full_shape[split.inner_axes[0]] % BYTE_DOT_LANES: return None
  views = {id(leaf): st for leaf, st in zip(kernel.leaves, kernel.sts)}
  axis, dots = split.inner_axes[0], []
  for term, _ in split.terms:
    pairs = []
    for product in _summands(term.srcs[0]):
      pair = _byte_pair(product)
      if pair is None or not all(_unit_stride(views[id(load)], axis) for load in (pair.unsigned, pair.signed)):
        return None
      pairs.append(pair)
    dots.append(tuple(pairs))
  return dots


def _summands(node: LazyOp) -> list[LazyOp]:
  """The operands of a tree of integer ADDs."""
  found, pending = [], [node]
  while pending:
    current = pending.pop()
    if current.op is Ops.ADD: pending += list(current.srcs)
    else: found.append(current)
  return found[::-1]


def _widened(node: LazyOp) -> LazyOp:
  """`node` without its casts to wider integers (the value unchanged)."""
  while node.op is Ops.CAST and _is_integer(node.srcs[0].dtype) and node.dtype.itemsize > node.srcs[0].dtype.itemsize:
    node = node.srcs[0]
  return node


def _byte_pair(product: LazyOp) -> BytePair | None:
  """`product` as (unsigned byte, shift, mask) times a signed byte load, or as two signed bytes, or None."""
  if product.op is not Ops.MUL: return None
  for left, right in (product.srcs, product.srcs[::-1]):
    signed = _widened(right)
    if signed.op is not Ops.LOAD or signed.dtype != dtypes.int8: continue
    unsigned = _shifted_byte(_widened(left))
    if unsigned is not None: return BytePair(unsigned[0], unsigned[1], unsigned[2], signed)
    first = _signed_byte(_widened(left))
    if first is not None: return BytePair(first, SIGNED_BYTES, 255, signed)
  return None


def _signed_byte(node: LazyOp) -> LazyOp | None:
  """The load of an int8 value: an int8 load, or a uint8 load bitcast to int8 (its bytes read as int8)."""
  bitcast = node.op is Ops.BITCAST and node.dtype == dtypes.int8 and node.srcs[0].dtype == dtypes.uint8
  if bitcast: node = node.srcs[0]
  return node if node.op is Ops.LOAD and (node.dtype == dtypes.int8 or bitcast) else None


def _shifted_byte(node: LazyOp) -> tuple[LazyOp, int, int] | None:
  """(uint8 load, shift, mask) for `(load >> shift) & mask` (either part optional, uint8 throughout) with a largest
  value of at most 127, else None."""
  mask, shift = 255, 0
  if node.op is Ops.AND and node.dtype == dtypes.uint8:
    constant = _integer_constant(node.srcs[1])
    if constant is None: return None
    mask, node = constant & 255, node.srcs[0]
  if node.op is Ops.SHR and node.dtype == dtypes.uint8:
    constant = _integer_constant(node.srcs[1])
    if constant is None or not 0 <= constant < 8: return None
    shift, node = constant, node.srcs[0]
  if node.op is not Ops.LOAD or node.dtype != dtypes.uint8 or (255 >> shift) & mask > 127: return None
  return node, shift, mask


def _integer_constant(node: LazyOp) -> int | None:
  if node.op is not Ops.CONST or any(view.mask is not None for view in node.arg.st.views): return None
  return int(node.arg.val)


def _unit_stride(st: Any, axis: int) -> bool:
  """Whether a view reads consecutive elements along `axis`, unmasked (one view)."""
  return len(st.views) == 1 and st.views[0].mask is None and st.views[0].strides[axis] == 1


def _add_byte_dot(linearizer: Linearizer, idxs: list[Node], axis: int, pairs: tuple[BytePair, ...], lanes: UOp,
                  factor: UOp) -> None:
  """One BYTE_DOT_ADD of a term's pairs over the inner `axis` (addressed at its first lane) into float `lanes`."""
  idxs[axis] = NumNode(0)
  srcs: list[UOp] = [lanes, factor]
  for pair in pairs:
    for load in (pair.unsigned, pair.signed):
      index, valid = linearizer._index(linearizer.leaf_index[id(load)], idxs)
      assert valid is None, "a byte dot's loads are unmasked (_unit_stride)"
      srcs += [linearizer.buffers[load.arg.idx], index]
  arg = (linearizer.kernel.full_shape[axis], tuple((pair.shift, pair.mask) for pair in pairs))
  linearizer.builder.add(UOps.BYTE_DOT_ADD, None, tuple(srcs), arg)


def _open_index_loop(linearizer: Linearizer, idxs: list[Node], axis: int, prefix: str, kind: AxisType) -> UOp:
  """A loop over all of `axis` (its index variable put in `idxs`)."""
  size = linearizer.kernel.full_shape[axis]
  idxs[axis] = Variable(f"{prefix}{axis}", 0, size - 1)
  return linearizer._open_loop(f"{prefix}{axis}", size, kind)


def _uniform_constant(node: LazyOp) -> float | None:
  """The value of an unmasked float constant (the same everywhere), else None."""
  if node.op is not Ops.CONST or not node.dtype.is_float or any(view.mask is not None for view in node.arg.st.views):
    return None
  return float(node.arg.val)


def _peel_constants(node: LazyOp) -> tuple[LazyOp, float]:
  """(node without its constant factors, their product): MUL(MUL(x, 0.5), 2.0) -> (x, 1.0)."""
  constant = 1.0
  while node.op is Ops.MUL:
    values = [_uniform_constant(src) for src in node.srcs]
    if values[1] is not None: constant, node = constant * values[1], node.srcs[0]
    elif values[0] is not None: constant, node = constant * values[0], node.srcs[1]
    else: break
  return node, constant
