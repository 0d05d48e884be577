"""Which reduces of a row kernel share one pass over the row (codegen/row_linearizer.py, GPU rows that loop).

A GPU block whose row does not fit its registers reads the row again at every pass (from L2, or from memory when
the rows in flight outgrow L2: a vocabulary row of 50304 floats is 200 KB). Reduces that do not need each other's
result share a pass; so does a sum that needs a max of its pass only through a factor exp2(k * m) ("online"
softmax, as flash attention computes it): each thread keeps a running max m and the sum relative to it, and when m
grows to m' it rescales the sum by exp2(P(m') - P(m)) before adding the new terms (P the max's part of the
exponent). Softmax's max and sum of exp(x - max), logsumexp, and cross-entropy's picked logit then take one pass.

The test is structural and general: the sum's input, read as a function of the max node, is a product whose factors
are free of the max or are exp2 of an affine expression in it (constants times terms that depend on the max and on
no element of the row: the max itself, `where(isinf(max), 0, max)`), so the ratio of two of its values at
different maxes is the same for every element.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ourgrad.ops import REDUCE_OPS, LazyOp, Ops

# (coefficient, term): the max's part of an exponent is the sum of coefficient * term over these
ShiftTerms = list[tuple[float, LazyOp]]


@dataclass
class RowPass:
  """Reduces computed in one pass over the row, in kernel order. `online` maps id(sum) -> (its max in this pass,
  the max's part of its exponent), for sums accumulated relative to the running max."""
  reduces: list[LazyOp] = field(default_factory=list)
  online: dict[int, tuple[LazyOp, ShiftTerms]] = field(default_factory=dict)

  def peaks(self) -> list[LazyOp]:
    """The maxes that online sums of this pass follow (each kept as a running max, updated once per unit)."""
    found: dict[int, LazyOp] = {}
    for peak, _ in self.online.values(): found.setdefault(id(peak), peak)
    return list(found.values())


def group_row_passes(reduces: list[LazyOp]) -> list[RowPass]:
  """The passes over the row for `reduces` (sources first): a reduce joins the pass before it when it reads no
  reduce of that pass, or (a float sum) reads only one max of it, through exp2 factors (`shift_terms`)."""
  passes: list[RowPass] = []
  for reduce in reduces:
    current = passes[-1] if passes else None
    if current is not None:
      in_pass = [dep for dep in row_reduces_read(reduce.srcs[0]) if any(dep is other for other in current.reduces)]
      if not in_pass:
        current.reduces.append(reduce)
        continue
      peak = in_pass[0]
      if len(in_pass) == 1 and peak.op is Ops.MAX_REDUCE and reduce.op is Ops.SUM and reduce.dtype.is_float and \
          reduce.dtype == peak.dtype:
        terms = shift_terms(reduce.srcs[0], peak)
        if terms:
          current.reduces.append(reduce)
          current.online[id(reduce)] = (peak, terms)
          continue
    passes.append(RowPass([reduce]))
  return passes


def row_reduces_read(root: LazyOp) -> list[LazyOp]:
  """The reduce nodes `root` reads directly (not those inside another reduce's input)."""
  found: dict[int, LazyOp] = {}
  stack, seen = [root], set()
  while stack:
    node = stack.pop()
    if id(node) in seen: continue
    seen.add(id(node))
    if node.op in REDUCE_OPS and node is not root:
      found[id(node)] = node
      continue
    stack.extend(node.srcs)
  return list(found.values())


def shift_terms(source: LazyOp, peak: LazyOp) -> ShiftTerms | None:
  """The max's part of the exponent when `source` is a product of factors free of `peak` and of exp2 of affine
  expressions in it (see the module docstring); None otherwise, or when `source` does not read `peak`."""
  terms = _factor_terms(source, peak)
  return terms if terms else None


def _factor_terms(node: LazyOp, peak: LazyOp) -> ShiftTerms | None:
  if not _reads(node, peak): return []
  if node.op is Ops.MUL:
    parts = [_factor_terms(src, peak) for src in node.srcs]
    return None if any(part is None for part in parts) else [term for part in parts for term in part or []]
  if node.op is Ops.EXP2: return _affine_terms(node.srcs[0], peak, 1.0)
  return None


def _affine_terms(node: LazyOp, peak: LazyOp, scale: float) -> ShiftTerms | None:
  """`node` as (free of the peak) + sum of coefficient * term, each term depending on the peak and on constants only
  (one value per row); None where it is not of that form."""
  if not _reads(node, peak): return []
  if node.op is Ops.ADD:
    parts = [_affine_terms(src, peak, scale) for src in node.srcs]
    return None if any(part is None for part in parts) else [term for part in parts for term in part or []]
  if node.op is Ops.NEG: return _affine_terms(node.srcs[0], peak, -scale)
  if node.op is Ops.MUL:
    for value, other in (node.srcs, node.srcs[::-1]):
      if value.op is Ops.CONST and isinstance(value.arg.val, float):
        return _affine_terms(other, peak, scale * value.arg.val)
  return [(scale, node)] if _row_constant(node) else None


def _reads(node: LazyOp, peak: LazyOp) -> bool:
  """Whether `node` reads `peak` (not looking inside other reduces)."""
  if node is peak: return True
  if node.op in REDUCE_OPS: return False
  return any(_reads(src, peak) for src in node.srcs)


def _row_constant(node: LazyOp) -> bool:
  """Whether `node` has one value per row: it reads no buffer element other than through reduces."""
  if node.op in REDUCE_OPS or node.op is Ops.CONST: return True
  if node.op is Ops.LOAD or not node.srcs: return False
  return all(_row_constant(src) for src in node.srcs)
