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

from typing import TYPE_CHECKING, Iterable, Sequence

from ourgrad.codegen.uops import UOp
from ourgrad.dtype import dtypes
from ourgrad.ops import LazyOp, MemBuffer, Ops
from ourgrad.shape.symbolic import AndNode, LtNode, Node, NumNode, Variable, is_symbolic, sym_and

if TYPE_CHECKING:
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
