"""Reduce loops that end where a Variable-bounded mask makes every term zero.

A fixed-shape view can carry a mask whose bound is a Variable: a tensor shrunk to a bound length and padded back
(`cache.shrink((0, used)).pad((0, N - used))`, a KV cache read up to the slots in use while every kernel keeps the
shape N, so the optimizer handles it as any other). A load outside its mask reads 0. When a SUM's source is zero
wherever such a load is masked (the load, or a product or cast of it), the terms past the mask add nothing, so the
reduce loop can stop where the mask ends: for a load valid while `k * r + c < b` (r the loop's index, b free of it)
the loop runs to min(N, ceil((b - c) / k)); a mask bound that does not involve r (the load varies along an output
axis only) runs the loop in full or not at all. Across the output and unroll lanes of one iteration the loop ends at
the largest of their ends; for one lane, at the smallest over the zeroing loads.

Only masks with a Variable bound are read this way: a constant pad keeps its full loop, so a term such as
`pad(x) * inf` stays NaN there as IEEE says (a bound-Variable pad is the "slots in use" reading, whose absent
terms are taken as absent). The skipped terms are exact zeros added to the accumulator (x + 0 == x), so the result
is the full loop's bit for bit where the kept factors are finite.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Sequence

from ourgrad.codegen.uops import UOp, UOps
from ourgrad.dtype import dtypes
from ourgrad.ops import REDUCE_OPS, LazyOp, MemBuffer, Ops
from ourgrad.shape.symbolic import AndNode, LtNode, Node, NumNode, Variable, is_symbolic, sym_and

if TYPE_CHECKING:
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.codegen.linearizer import Linearizer
  from ourgrad.shape.shapetracker import ShapeTracker


def has_variable_mask(st: ShapeTracker) -> bool:
  """Whether a view of the ShapeTracker has a mask bound that holds a Variable."""
  return any(is_symbolic(bound) for view in st.views for dim in (view.mask or ()) for bound in dim)


def zeroing_loads(node: LazyOp, masked: set[int]) -> list[LazyOp]:
  """The loads under `node` (ids in `masked`) that make `node` zero where they read their mask's 0: the load itself,
  either factor of a product, the source of a cast or negation."""
  if node.op is Ops.LOAD: return [node] if id(node) in masked else []
  if node.op is Ops.MUL: return zeroing_loads(node.srcs[0], masked) + zeroing_loads(node.srcs[1], masked)
  if node.op in (Ops.CAST, Ops.NEG) and node.dtype != dtypes.bool: return zeroing_loads(node.srcs[0], masked)
  return []


def _conjuncts(valid: Node) -> list[Node]:
  return list(valid.nodes) if isinstance(valid, AndNode) else [valid]


def without_implied(valid: Node, implied: frozenset[Node]) -> Node:
  """A load's validity with the conditions that hold anyway inside a shortened loop (`implied`) left out."""
  conditions = _conjuncts(valid)
  kept = [condition for condition in conditions if condition not in implied]
  return valid if len(kept) == len(conditions) else sym_and(kept)


def _upper_bound(condition: Node, index: Variable) -> Node | None:
  """E with `condition` false for index >= E, where `condition` is k * index + c < b (k > 0, b and c free of the
  index): E = ceil((b - c) / k). None for any other form (a lower bound, a bound that is not linear)."""
  if not isinstance(condition, LtNode) or not isinstance(condition.a, Node): return None
  left, right = condition.a, condition.b
  if isinstance(right, Node) and index in right.vars(): return None
  if index not in left.vars(): return None
  c = left.substitute({index: NumNode(0)})
  k, k2 = left.substitute({index: NumNode(1)}) - c, left.substitute({index: NumNode(2)}) - c
  if not isinstance(k, NumNode) or not isinstance(k2, NumNode) or k.b <= 0 or k2.b != 2 * k.b: return None
  return (NumNode(0) + right - c + (k.b - 1)) // k.b


def bounded_reduce_end(lin: Linearizer, axis: int, size: int,
                       lanes: Iterable[Sequence[Node]]) -> tuple[UOp, frozenset[Node]] | None:
  """The end of reduce loop `axis` (of `size`) as a UOp computed before it opens, or None for the full loop: the
  largest, over the lanes' index lists (each with the loop's Variable at `axis`), of the smallest end the zeroing
  loads of each SUM allow (module docstring). None unless every reduce of the kernel is a SUM with such a load.
  With it, the mask conditions that hold at every index of the shortened loop (where every lane's end is one upper
  bound: the loads' `index < bound` tests): the loads leave them out, so they stay the unmasked loads that vector
  code takes (renderer/cvector.py), the update's arithmetic what the full loop's was."""
  kernel = lin.kernel
  if kernel.reduceop is None or any(reduce.op is not Ops.SUM for reduce in kernel.reduceops): return None
  masked = {id(leaf) for leaf, st in zip(kernel.leaves, kernel.sts)
            if leaf.op is Ops.LOAD and isinstance(leaf.arg, MemBuffer) and has_variable_mask(st)}
  if not masked: return None
  loads = [zeroing_loads(reduce.srcs[0], masked) for reduce in kernel.reduceops]
  if not all(loads): return None
  build = lin.builder

  def pick(a: UOp | None, b: UOp, larger: bool) -> UOp:
    if a is None or a is b: return b
    below = build.alu(Ops.CMPLT, dtypes.bool, a, b)
    return build.alu(Ops.WHERE, a.dtype, below, b, a) if larger else build.alu(Ops.WHERE, a.dtype, below, a, b)
  ends: dict[int, UOp] = {}   # each lane's end, by id: lanes that differ only where no load varies share one
  bounded_by: dict[int, set[Node]] = {}   # id of an end that is one clamped upper bound -> the conditions giving it
  for idxs in lanes:
    index = idxs[axis]
    assert isinstance(index, Variable)
    for sibling in loads:
      end: UOp | None = None
      for load in sibling:
        found = _load_end(lin, lin._index_nodes(kernel.leaf_number(load), list(idxs))[1], index, size)
        if found is None: continue
        load_end, condition = found
        if condition is not None: bounded_by.setdefault(id(load_end), set()).add(condition)
        end = pick(end, load_end, larger=False)
      if end is None: return None   # a reduce none of whose loads bounds the loop
      ends.setdefault(id(end), end)
  result: UOp | None = None
  for end in ends.values(): result = pick(result, end, larger=True)
  assert result is not None
  return result, frozenset(bounded_by.get(id(result), ()))


def _load_end(lin: Linearizer, valid: Node, index: Variable, size: int) -> tuple[UOp, Node | None] | None:
  """The loop end one masked load allows at one lane: its validity `valid` holds only below it. Conditions free of
  the index gate the whole loop (end 0 where one is false); an upper bound on the index, clamped to [0, size], ends
  it; None where the load bounds nothing (no condition of either kind). With the end, the bounding condition where
  it alone gives the end (no gate): it holds at every index below that end."""
  build = lin.builder
  if isinstance(valid, NumNode): return lin._int(size if valid.b else 0), None
  gates: list[Node] = []
  bound: Node | None = None
  bounding: Node | None = None
  for condition in _conjuncts(valid):
    if index not in condition.vars(): gates.append(condition)
    elif bound is None and (bound := _upper_bound(condition, index)) is not None: bounding = condition
  if bound is None and not gates: return None
  end = lin._int(size)
  if bound is not None:
    value = lin.node_to_uop(bound)
    end = build.alu(Ops.WHERE, value.dtype, build.alu(Ops.CMPLT, dtypes.bool, value, end), value, end)
    zero = lin._int(0)
    end = build.alu(Ops.WHERE, value.dtype, build.alu(Ops.CMPLT, dtypes.bool, end, zero), zero, end)
  for gate in gates: end = build.alu(Ops.WHERE, end.dtype, lin.node_to_uop(gate), end, lin._int(0))
  return end, None if gates else bounding


# ---------------------------------------------------------------- GPU row kernels: rows that end at a Variable bound
#
# A GPU block runs its row in rounds (codegen/row_passes.py: round j is the units j * T .. (j + 1) * T - 1 of the
# block's T threads of a row; codegen/element_reduces.py: step j of the staged element reduces). A round that starts
# at or past the row's bound is skipped by every thread of the block alike (one condition for the whole block: no
# thread diverges from the others' shuffles or barriers), so the work follows the bound: decode attention's rows
# (scores, max, sum of exp, exp x V) over the cache slots in use, not over the whole fixed-shape cache.

_ZERO, _NEG_INF, _FALSE, _NOT_FINITE = "zero", "-inf", "false", "not finite"


def round_guard(lin: Linearizer, start: int, end: Node | None) -> UOp | None:
  """An IF, the same for every thread of the block, around a round of a row that starts at element `start`, where the
  row may end (`end`, from `row_end`) before it; None where it cannot (no bound, or the bound's least value is past
  `start`). The caller ends the IF after the round."""
  if end is None or start < end.min: return None
  inside = lin.builder.alu(Ops.CMPLT, dtypes.bool, lin._int(start), lin.node_to_uop(end))
  return lin.builder.add(UOps.IF, None, (inside,))


def _past_bound(node: LazyOp, masked: set[int], memo: dict[int, str | None]) -> str | None:
  """What `node` is wherever the leaves `masked` (ids) read their mask's 0: 0, -inf or False, or None (a value taken
  as finite, as the module docstring takes the kept factors: x + -inf is -inf; a constant inf or NaN is not taken so).
  Other reduces' values (an element reduce under a row reduce, the row's max under its sum of exp) are such values."""
  if id(node) in memo: return memo[id(node)]
  op, found = node.op, None
  if op in (Ops.LOAD, Ops.CONST) and id(node) in masked: found = _FALSE if node.dtype == dtypes.bool else _ZERO
  elif op is Ops.CONST and node.dtype != dtypes.bool and isinstance(node.arg.val, (int, float)):
    value = float(node.arg.val)
    found = _NEG_INF if value == -math.inf else _ZERO if value == 0 else None if math.isfinite(value) else _NOT_FINITE
  elif op not in REDUCE_OPS and node.srcs:
    kinds = [_past_bound(src, masked, memo) for src in node.srcs]
    if op is Ops.WHERE: found = kinds[2] if kinds[0] == _FALSE else kinds[1] if kinds[1] == kinds[2] else None
    elif op is Ops.MUL:
      if _ZERO in kinds and _NEG_INF not in kinds and _NOT_FINITE not in kinds: found = _ZERO
      elif kinds.count(_NEG_INF) == 1 and _positive_const(node.srcs[kinds.index(None)] if None in kinds else None):
        found = _NEG_INF
    elif op is Ops.ADD:
      if _NEG_INF in kinds and _NOT_FINITE not in kinds: found = _NEG_INF   # the other term finite (or -inf)
      elif kinds == [_ZERO, _ZERO]: found = _ZERO
    elif op in (Ops.NEG, Ops.CAST) and node.dtype != dtypes.bool and kinds[0] == _ZERO: found = _ZERO
    elif op is Ops.EXP2 and kinds[0] == _NEG_INF: found = _ZERO
    elif op is Ops.MAX and kinds == [_NEG_INF, _NEG_INF]: found = _NEG_INF
  memo[id(node)] = found
  return found


def _positive_const(node: LazyOp | None) -> bool:
  return node is not None and node.op is Ops.CONST and isinstance(node.arg.val, (int, float)) and node.arg.val > 0


def _leaf_row_end(kernel: Kernel, leaf: LazyOp, axis: int) -> Node | None:
  """The element of row axis `axis` from which `leaf` reads its mask's 0 whatever the other axes' indices: an upper
  bound on the axis' index in its view's validity (`k * i + c < b`) that holds a Variable and no other index."""
  st = kernel.sts[kernel.leaf_number(leaf)]
  if not has_variable_mask(st): return None
  idxs: list[Node] = [Variable(f"_bound{number}", 0, size - 1) if size > 1 else NumNode(0)
                      for number, size in enumerate(kernel.full_shape)]
  index = idxs[axis]
  if not isinstance(index, Variable): return None
  indices = {var for var in idxs if isinstance(var, Variable)}
  for condition in _conjuncts(st.expr_idxs(idxs)[1]):
    if index not in condition.vars(): continue
    end = _upper_bound(condition, index)
    if end is not None and isinstance(end, Node) and end.vars() and not indices & set(end.vars()): return end
  return None


def row_end(kernel: Kernel) -> Node | None:
  """Where the rows of a row kernel with one row axis may end (a Node of bound Variables), or None for the whole
  row: every leaf with a Variable-bounded mask along the row axis reads its mask's 0 from one element E on, and from
  there each row reduce's terms are its identity (a SUM's 0: a masked load, a product with one, exp2 of -inf; a
  MAX's -inf: a `where` whose condition is a masked True, choosing -inf there). Only for outputs once per row (a
  per-element output, softmax's, is written at every element)."""
  row_axes = kernel.row_axes or ()
  if len(row_axes) != 1 or any(kernel.sts[0].shape[axis] != 1 for axis in row_axes): return None
  ends = {id(leaf): end for leaf in kernel.leaves if leaf.op in (Ops.LOAD, Ops.CONST)
          if (end := _leaf_row_end(kernel, leaf, row_axes[0])) is not None}
  if not ends or len(set(ends.values())) != 1: return None
  reduces = [reduce for reduce in kernel.reduceops if reduce not in kernel.final_reduces
             and not any(reduce is inner for inner in kernel.element_reduces)]
  memo: dict[int, str | None] = {}
  identities = {Ops.SUM: _ZERO, Ops.MAX_REDUCE: _NEG_INF}
  masked = set(ends)
  if not reduces or any(_past_bound(reduce.srcs[0], masked, memo) != identities.get(reduce.op) for reduce in reduces):
    return None
  return next(iter(ends.values()))
