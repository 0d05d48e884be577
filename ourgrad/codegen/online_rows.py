"""Which reduces of a row kernel share one pass over the row (codegen/row_blocks.py, GPU rows that loop).

A GPU block whose row does not fit its registers reads the row again at every pass (from L2, or from memory when
the rows in flight outgrow L2: a vocabulary row of 50304 floats is 200 KB). Reduces that do not need each other's
result share a pass; so does a sum that needs a max of its pass only through a factor exp2(k * m) ("online"
softmax, as flash attention computes it): each thread keeps a running max m and the sum relative to it, and when m
grows to m' it rescales the sum by exp2(P(m') - P(m)) before adding the new terms (P the max's part of the
exponent). Softmax's max and sum of exp(x - max), logsumexp, and cross-entropy's picked logit then take one pass.

The test is structural and general: the sum's input, read as a function of the max node, is a product whose factors
are free of the max but one, exp2(k * x + P(max)) with x the value the max is taken of, k > 0 and P a sum of
constants times terms that depend on the max and on no element of the row (the max itself, logsumexp's
`where(isinf(max), 0, max)`), so the ratio of two of its values at different maxes is the same for every element,
and an element x = -inf adds 0 (a masked score) against any finite max.
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
  """The max's part of the exponent when `source` is a product of factors free of `peak` and of one exp2 of an
  affine expression k * x + P(peak), x the value the max is taken of and k > 0 (see the module docstring); None
  otherwise. Then an element x = -inf adds 0 whatever the max (the online pass skips the terms while the running max
  is still -inf, where P's -inf - -inf would be nan: the two-pass sum adds 0 for them against a finite max)."""
  factors = _factor_terms(source, peak)
  if factors is None or len(factors) != 1: return None
  peak_terms, free_terms = factors[0]
  if not peak_terms or len(free_terms) != 1: return None
  coefficient, value = free_terms[0]
  return peak_terms if coefficient > 0 and value == peak.srcs[0] else None


# an exp2 factor's exponent split in two: (terms reading the max, terms free of it)
_Split = tuple[ShiftTerms, ShiftTerms]


def _factor_terms(node: LazyOp, peak: LazyOp) -> list[_Split] | None:
  """The exp2 factors of `node` that read `peak`, their exponents split (`_affine_split`); None where `node` reads
  the peak other than through such factors of a product."""
  if not _reads(node, peak): return []
  if node.op is Ops.MUL:
    parts = [_factor_terms(src, peak) for src in node.srcs]
    return None if any(part is None for part in parts) else [split for part in parts for split in part or []]
  if node.op is Ops.EXP2:
    split = _affine_split(node.srcs[0], peak, 1.0)
    return None if split is None else [split]
  return None


def _affine_split(node: LazyOp, peak: LazyOp, scale: float) -> _Split | None:
  """`node` as a sum of coefficient * term: the terms that read the peak and depend on nothing else per element (one
  value per row), and the terms free of it; None where it is not of that form."""
  if not _reads(node, peak): return [], [(scale, node)]
  if node.op is Ops.ADD:
    parts = [_affine_split(src, peak, scale) for src in node.srcs]
    if any(part is None for part in parts): return None
    return [term for part in parts for term in part[0]], [term for part in parts for term in part[1]]  # type: ignore
  if node.op is Ops.NEG: return _affine_split(node.srcs[0], peak, -scale)
  if node.op is Ops.MUL:
    for value, other in (node.srcs, node.srcs[::-1]):
      if value.op is Ops.CONST and isinstance(value.arg.val, float):
        return _affine_split(other, peak, scale * value.arg.val)
  return ([(scale, node)], []) if _row_constant(node) else None


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
