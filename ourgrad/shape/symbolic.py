"""Symbolic integer expressions for index math.

The code generator describes which buffer element a kernel thread reads with an integer expression in the
loop indices (`Variable`s with known inclusive ranges). Every arithmetic operation on a `Node` builds an
already-simplified node, using the variables' ranges to remove divisions and modulos that cannot change the
value. The tighter these expressions are, the cheaper the generated kernels.

Main types:
  Node      base class: `min`/`max` inclusive bounds, arithmetic, `lt`/`ge`, `substitute`, `evaluate`, `render`.
  Variable  a named integer in [min, max].
  NumNode   an integer constant.
  MulNode   a * b (b an int), DivNode floor(a / b), ModNode a mod b (floor), b a positive int.
  SumNode   a flattened sum (at most one NumNode, last; never a nested SumNode), its terms in one canonical order
            (`_base_order`), so equal sums built in any order are one node and render as one expression.
  LtNode    1 if a < b else 0.   AndNode: 1 if every (boolean) operand is 1.
Nodes are immutable and compare structurally (`==` never builds a node), so they work as dict keys.
Division and modulo follow Python's floor semantics everywhere.
"""
from __future__ import annotations

import math
import re
from typing import Any, Union

__all__ = ["Node", "Variable", "NumNode", "MulNode", "ProdNode", "DivNode", "ModNode", "SumNode", "LtNode", "AndNode",
           "sym_sum", "sym_and", "sym_int", "is_symbolic", "sym_max", "sym_infer", "bound_vars",
           "sym_unbind", "sym_bind", "given_valid"]

NodeLike = Union["Node", int]


def is_symbolic(value: Any) -> bool:
  """True for a Node that is not a constant (a size or index that depends on a Variable)."""
  return isinstance(value, Node) and not isinstance(value, NumNode)


def sym_max(value: NodeLike) -> int:
  """The largest value an int or a Node can take (an allocation or a loop bound for a symbolic size)."""
  return value.max if isinstance(value, Node) else int(value)


def bound_vars(nodes: Any) -> dict[str, int]:
  """{name: value} of the bound Variables inside an iterable of ints and Nodes; raises ValueError when one name is
  bound to two values."""
  values: dict[str, int] = {}
  for node in nodes:
    if not isinstance(node, Node) or isinstance(node, NumNode): continue
    stack = [node]
    while stack:
      current = stack.pop()
      if isinstance(current, Variable):
        if current.val is None: continue
        if values.setdefault(current.expr, current.val) != current.val:
          raise ValueError(f"Variable {current.expr!r} is bound to both {values[current.expr]} and {current.val}")
      else: stack.extend(current._children())
  return values


def sym_infer(value: NodeLike, var_vals: dict[str, int]) -> int:
  """The int value of an int or a Node for the given variable values."""
  return value.evaluate(var_vals) if isinstance(value, Node) else int(value)


def sym_unbind(value: Any) -> tuple[Any, dict[str, int]]:
  """(an int or Node with its bound Variables unbound, {name: value}); anything else comes back as it is."""
  if not is_symbolic(value): return value, {}
  bound = [var for var in value.vars() if var.val is not None]
  if not bound: return value, {}
  return value.substitute({var: var.unbind()[0] for var in bound}), {var.expr: var.val for var in bound}


def sym_bind(value: Any, var_vals: dict[str, int]) -> Any:
  """An unbound int or Node with each Variable named in var_vals bound to its value (a shape for this call)."""
  if not is_symbolic(value): return value
  return value.substitute({var: var.bind(var_vals[var.expr]) for var in value.vars() if var.expr in var_vals})


def sym_int(value: NodeLike) -> Node:
  """`value` as a Node (ints become NumNode)."""
  if isinstance(value, Node): return value
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"expected an int or a Node, got {type(value).__name__}: {value!r}")
  return NumNode(value)


def _const_of(value: Any) -> int | None:
  """The integer value of an int or a NumNode, else None."""
  if isinstance(value, NumNode): return value.b
  if isinstance(value, int) and not isinstance(value, bool): return value
  return None


def _positive_divisor(value: Any, op: str) -> int:
  divisor = _const_of(value)
  if divisor is None: raise TypeError(f"symbolic {op} needs an int divisor, got {value!r}")
  if divisor <= 0: raise ValueError(f"symbolic {op} needs a positive divisor, got {divisor}")
  return divisor


def _trunc_div(num: int, den: int) -> int:
  """Division rounding toward zero (so a coefficient keeps its sign when split as q*den + rem)."""
  return num // den if num >= 0 else -((-num) // den)


class Node:
  """Base class of symbolic integer expressions; see the module docstring."""
  min: int
  max: int
  _hash: int

  # ---- structure
  def _key(self) -> tuple:
    raise NotImplementedError

  def __eq__(self, other: object) -> bool:
    if self is other: return True
    return type(other) is type(self) and self._key() == other._key()  # type: ignore[attr-defined]

  def __ne__(self, other: object) -> bool: return not self.__eq__(other)

  def __hash__(self) -> int: return self._hash

  def __repr__(self) -> str: return f"<{self.render()}>"

  # ---- arithmetic
  def __add__(self, other: NodeLike) -> Node: return sym_sum([self, other])
  def __radd__(self, other: NodeLike) -> Node: return sym_sum([other, self])
  def __sub__(self, other: NodeLike) -> Node: return sym_sum([self, -sym_int(other)])
  def __rsub__(self, other: NodeLike) -> Node: return sym_sum([other, -self])
  def __neg__(self) -> Node: return _mul(self, -1)

  def __mul__(self, other: NodeLike) -> Node:
    factor = _const_of(other)
    if factor is not None: return _mul(self, factor)
    if isinstance(self, NumNode) and isinstance(other, Node): return _mul(other, self.b)
    if isinstance(other, Node): return _fold(ProdNode(self, other))  # a symbolic stride times an index or size
    raise TypeError(f"symbolic multiplication needs an int or a Node operand: {self.render()} * {other!r}")

  def __rmul__(self, other: NodeLike) -> Node: return self.__mul__(other)

  def __floordiv__(self, other: NodeLike) -> Node: return _floordiv(self, _positive_divisor(other, "//"))
  def __mod__(self, other: NodeLike) -> Node: return _mod(self, _positive_divisor(other, "%"))

  # ---- comparisons (they build boolean nodes, 1 or 0)
  def lt(self, other: NodeLike) -> Node:
    """Boolean node: 1 where self < other."""
    return _lt(self, other)

  def ge(self, other: NodeLike) -> Node:
    """Boolean node: 1 where self >= other (written as -self < 1-other so it stays one LtNode)."""
    if isinstance(other, Node) and not isinstance(other, NumNode): return _lt(other, self + 1)
    return _lt(-self, 1 - sym_int(other))

  def __lt__(self, other: NodeLike) -> Node: return self.lt(other)   # type: ignore[override]
  def __ge__(self, other: NodeLike) -> Node: return self.ge(other)   # type: ignore[override]
  def __le__(self, other: NodeLike) -> Node: return self.lt(sym_int(other) + 1)  # type: ignore[override]
  def __gt__(self, other: NodeLike) -> Node: return self.ge(sym_int(other) + 1)  # type: ignore[override]

  # ---- inspection
  def vars(self) -> list[Variable]:
    """Distinct variables in first-seen order."""
    seen: dict[Variable, None] = {}
    self._collect_vars(seen)
    return list(seen)

  def _collect_vars(self, seen: dict[Variable, None]) -> None:
    for child in self._children(): child._collect_vars(seen)

  def _children(self) -> tuple[Node, ...]: return ()

  def substitute(self, values: dict[Variable, Node]) -> Node:
    """Replace variables by nodes (or ints) and re-simplify."""
    raise NotImplementedError

  def evaluate(self, values: dict[str, int]) -> int:
    """Integer value for concrete variable values (by variable name), floor semantics."""
    raise NotImplementedError

  def render(self) -> str:
    """C-like text, e.g. "((gidx0*4)+ridx1)". `/` and `%` here mean floor division/modulo."""
    raise NotImplementedError


class Variable(Node):
  """A named integer in the inclusive range [min, max]. Stays a Variable even when min == max.

  `bind(value)` gives the same variable carrying a value (a symbolic shape: a batch size, a sequence position).
  The value is part of the identity (a bound Variable is not equal to the unbound one), so every cache keyed by
  views stays exact; the engine unbinds a kernel's AST before it looks the compiled kernel up, so every value
  shares one compiled kernel and the values travel to the launch as `var_vals`."""
  def __init__(self, expr: str, min: int, max: int):
    if min > max: raise ValueError(f"Variable {expr!r} has an empty range [{min}, {max}]")
    self.expr, self.min, self.max = expr, int(min), int(max)
    self.val: int | None = None
    self._hash = hash(("Variable", expr, self.min, self.max))

  def bind(self, value: int) -> Variable:
    """This variable bound to `value`, which must lie in [min, max]."""
    if isinstance(value, bool) or not isinstance(value, int):
      raise TypeError(f"Variable {self.expr!r} binds an int, got {type(value).__name__}: {value!r}")
    if not self.min <= value <= self.max:
      raise ValueError(f"Variable {self.expr!r} cannot bind {value}: outside its range [{self.min}, {self.max}]")
    bound = Variable(self.expr, self.min, self.max)
    bound.val, bound._hash = value, hash(("Variable", self.expr, self.min, self.max, value))
    return bound

  def unbind(self) -> tuple[Variable, int]:
    """(the unbound variable, its value); raises ValueError when it is not bound."""
    if self.val is None: raise ValueError(f"Variable {self.expr!r} is not bound to a value")
    return Variable(self.expr, self.min, self.max), self.val

  def _key(self) -> tuple: return (self.expr, self.min, self.max, self.val)
  def _collect_vars(self, seen: dict[Variable, None]) -> None: seen.setdefault(self, None)
  def substitute(self, values: dict[Variable, Node]) -> Node: return sym_int(values.get(self, self))
  def evaluate(self, values: dict[str, int]) -> int:
    if self.expr in values or self.val is None: return values[self.expr]
    return self.val

  def render(self) -> str: return self.expr


class NumNode(Node):
  """An integer constant. Compares equal to the plain int of the same value."""
  def __init__(self, b: int):
    self.b = self.min = self.max = int(b)
    self._hash = hash(self.b)  # equal to hash(int) since NumNode(3) == 3

  def _key(self) -> tuple: return (self.b,)

  def __eq__(self, other: object) -> bool:
    if isinstance(other, int) and not isinstance(other, bool): return self.b == other
    return isinstance(other, NumNode) and self.b == other.b

  def __hash__(self) -> int: return self._hash
  def __int__(self) -> int: return self.b
  def __index__(self) -> int: return self.b
  def substitute(self, values: dict[Variable, Node]) -> Node: return self
  def evaluate(self, values: dict[str, int]) -> int: return self.b
  def render(self) -> str: return str(self.b)


class MulNode(Node):
  """a * b with b a constant int (build it with `*`, which simplifies)."""
  def __init__(self, a: Node, b: int):
    self.a, self.b = a, b
    self.min, self.max = sorted((a.min * b, a.max * b))
    self._hash = hash(("Mul", a, b))

  def _key(self) -> tuple: return (self.a, self.b)
  def _children(self) -> tuple[Node, ...]: return (self.a,)
  def substitute(self, values: dict[Variable, Node]) -> Node: return self.a.substitute(values) * self.b
  def evaluate(self, values: dict[str, int]) -> int: return self.a.evaluate(values) * self.b
  def render(self) -> str: return f"({self.a.render()}*{self.b})"


class ProdNode(Node):
  """a * b of two non-constant nodes (a symbolic size or stride times an index): kept as it is, not simplified
  further; sums, comparisons, div and mod treat it as one opaque term with its bounds."""
  def __init__(self, a: Node, b: Node):
    self.a, self.b = a, b
    corners = (a.min * b.min, a.min * b.max, a.max * b.min, a.max * b.max)
    self.min, self.max = min(corners), max(corners)
    self._hash = hash(("ProdNode", a, b))

  def _key(self) -> tuple: return (self.a, self.b)
  def _children(self) -> tuple[Node, ...]: return (self.a, self.b)
  def evaluate(self, values: dict[str, int]) -> int: return self.a.evaluate(values) * self.b.evaluate(values)
  def render(self) -> str: return f"({self.a.render()}*{self.b.render()})"

  def substitute(self, values: dict[Variable, Node]) -> Node:
    return self.a.substitute(values) * self.b.substitute(values)


class DivNode(Node):
  """floor(a / b) with b a positive int."""
  def __init__(self, a: Node, b: int):
    self.a, self.b = a, b
    self.min, self.max = a.min // b, a.max // b  # floor division is monotonic
    self._hash = hash(("Div", a, b))

  def _key(self) -> tuple: return (self.a, self.b)
  def _children(self) -> tuple[Node, ...]: return (self.a,)
  def substitute(self, values: dict[Variable, Node]) -> Node: return self.a.substitute(values) // self.b
  def evaluate(self, values: dict[str, int]) -> int: return self.a.evaluate(values) // self.b
  def render(self) -> str: return f"({self.a.render()}/{self.b})"


class ModNode(Node):
  """a mod b (floor, so the result is in [0, b-1]) with b a positive int."""
  def __init__(self, a: Node, b: int):
    self.a, self.b = a, b
    self.min, self.max = 0, (min(a.max, b - 1) if a.min >= 0 else b - 1)
    self._hash = hash(("Mod", a, b))

  def _key(self) -> tuple: return (self.a, self.b)
  def _children(self) -> tuple[Node, ...]: return (self.a,)
  def substitute(self, values: dict[Variable, Node]) -> Node: return self.a.substitute(values) % self.b
  def evaluate(self, values: dict[str, int]) -> int: return self.a.evaluate(values) % self.b
  def render(self) -> str: return f"({self.a.render()}%{self.b})"


class SumNode(Node):
  """A sum of terms: no nested SumNode, at most one NumNode (last). Build with `sym_sum` or `+`."""
  def __init__(self, nodes: tuple[Node, ...]):
    self.nodes = tuple(nodes)
    self.min, self.max = sum(node.min for node in nodes), sum(node.max for node in nodes)
    self._hash = hash(("Sum", self.nodes))

  def _key(self) -> tuple: return self.nodes
  def _children(self) -> tuple[Node, ...]: return self.nodes
  def substitute(self, values: dict[Variable, Node]) -> Node: return sym_sum([n.substitute(values) for n in self.nodes])
  def evaluate(self, values: dict[str, int]) -> int: return sum(node.evaluate(values) for node in self.nodes)
  def render(self) -> str: return "(" + "+".join(node.render() for node in self.nodes) + ")"


class LtNode(Node):
  """1 if a < b else 0; b is an int or a non-constant Node."""
  def __init__(self, a: Node, b: int | Node):
    self.a, self.b = a, b
    self.min, self.max = 0, 1
    self._hash = hash(("Lt", a, b))

  def _key(self) -> tuple: return (self.a, self.b)
  def _children(self) -> tuple[Node, ...]: return (self.a, self.b) if isinstance(self.b, Node) else (self.a,)

  def substitute(self, values: dict[Variable, Node]) -> Node:
    bound = self.b.substitute(values) if isinstance(self.b, Node) else self.b
    return self.a.substitute(values).lt(bound)

  def evaluate(self, values: dict[str, int]) -> int:
    bound = self.b.evaluate(values) if isinstance(self.b, Node) else self.b
    return int(self.a.evaluate(values) < bound)

  def render(self) -> str:
    bound = self.b.render() if isinstance(self.b, Node) else str(self.b)
    return f"({self.a.render()}<{bound})"


class AndNode(Node):
  """1 if every operand (each a boolean node) is 1. Build with `sym_and`."""
  def __init__(self, nodes: tuple[Node, ...]):
    self.nodes = tuple(nodes)
    self.min, self.max = min(node.min for node in nodes), min(node.max for node in nodes)
    self._hash = hash(("And", self.nodes))

  def _key(self) -> tuple: return self.nodes
  def _children(self) -> tuple[Node, ...]: return self.nodes
  def substitute(self, values: dict[Variable, Node]) -> Node: return sym_and([n.substitute(values) for n in self.nodes])
  def evaluate(self, values: dict[str, int]) -> int: return int(all(node.evaluate(values) for node in self.nodes))
  def render(self) -> str: return "(" + "&&".join(node.render() for node in self.nodes) + ")"


# ---------------------------------------------------------------- construction with simplification

def _fold(node: Node) -> Node:
  """A node whose range is a single value is that constant."""
  return NumNode(node.min) if node.min == node.max else node


def _linear_terms(node: Node) -> tuple[list[tuple[Node, int]], int]:
  """Split node into ([(base, coefficient)], constant) so that node == sum(base*coefficient) + constant."""
  terms: list[tuple[Node, int]] = []
  constant = 0
  for term in (node.nodes if isinstance(node, SumNode) else (node,)):
    if isinstance(term, NumNode): constant += term.b
    elif isinstance(term, MulNode): terms.append((term.a, term.b))
    else: terms.append((term, 1))
  return terms, constant


def _build(terms: list[tuple[Node, int]], constant: int) -> Node:
  return sym_sum([_mul(base, coefficient) for base, coefficient in terms] + [constant])


def _mul(node: Node, factor: int) -> Node:
  if factor == 0: return NumNode(0)
  if factor == 1: return node
  if isinstance(node, NumNode): return NumNode(node.b * factor)
  if isinstance(node, MulNode): return _mul(node.a, node.b * factor)
  if isinstance(node, SumNode): return sym_sum([_mul(term, factor) for term in node.nodes])
  return _fold(MulNode(node, factor))


def _div_base(node: Node) -> tuple[Node, int]:
  """node as (x, a) with node == x // a (a == 1 when node is not a division)."""
  return (node.a, node.b) if isinstance(node, DivNode) else (node, 1)


def _combine_div_mod(coefficients: dict[Node, int]) -> Node | None:
  """Find (x//a % m)*c + (x//(a*m))*(c*m) among the terms; remove both and return their sum, (x//a)*c."""
  for base, coefficient in coefficients.items():
    if not isinstance(base, ModNode) or coefficient == 0: continue
    inner, divisor = _div_base(base.a)
    partner = DivNode(inner, divisor * base.b)
    if coefficients.get(partner) == coefficient * base.b:
      del coefficients[base], coefficients[partner]
      return _mul(_floordiv(inner, divisor), coefficient)
  return None


# sum terms in their canonical order (below); False keeps them in the order they were added (main before it), for
# side-by-side measurements of the generated code (extra/bench/profile_jit_step.py --plain-sum-order)
CANONICAL_SUM_ORDER = True


def _variable_order(variable: Variable) -> tuple:
  """Names in natural order (gidx2 before gidx10), so the kernel's axes stay in their order: gidx*, lidx*, ridx*."""
  cached = variable.__dict__.get("_variable_order")
  if cached is None:
    match = re.fullmatch(r"(.*?)(\d*)", variable.expr)
    assert match is not None
    prefix, digits = match.groups()
    cached = (prefix, int(digits) if digits else -1, variable.expr, variable.min, variable.max,
              variable.val is not None, variable.val or 0)
    variable.__dict__["_variable_order"] = cached
  return cached


def _base_order(base: Node) -> tuple:
  """The sort key of a sum's term by its base (the term without its coefficient; a sum has one term per base): the
  base's variables in natural order, then its text. Stable across processes (Python's string hashes are not), so a
  kernel's source and its cache key stay the same from run to run. Cached on the node (nodes are immutable)."""
  cached = base.__dict__.get("_base_order")
  if cached is None:
    if isinstance(base, Variable): cached = ((_variable_order(base),), "")
    else: cached = (tuple(sorted(_variable_order(variable) for variable in base.vars())), base.render())
    base.__dict__["_base_order"] = cached
  return cached


def sym_sum(nodes: list[Node | int]) -> Node:
  """Sum of nodes and ints: flattens nested sums, collects like terms (x + x*3 -> x*4), folds constants."""
  coefficients: dict[Node, int] = {}
  constant = 0
  pending: list[Node | int] = list(nodes)
  pending.reverse()
  while True:
    # an explicit stack (not recursion) so long sums of sums cannot overflow
    while pending:
      item = pending.pop()
      if isinstance(item, SumNode): pending.extend(reversed(item.nodes))
      elif isinstance(item, NumNode): constant += item.b
      elif isinstance(item, Node):
        base, coefficient = (item.a, item.b) if isinstance(item, MulNode) else (item, 1)
        coefficients[base] = coefficients.get(base, 0) + coefficient
      else: constant += sym_int(item).min  # a plain int (sym_int rejects anything else)
    combined = _combine_div_mod(coefficients)
    if combined is None: break
    pending.append(combined)
  # one order for the same terms however they were summed: two views with one address give one index
  # expression (and one load) in the generated code
  ordered = sorted(coefficients.items(), key=lambda item: _base_order(item[0])) \
    if CANONICAL_SUM_ORDER and len(coefficients) > 1 else coefficients.items()
  terms = [_mul(base, coefficient) for base, coefficient in ordered if coefficient != 0]
  terms = [term for term in terms if not (isinstance(term, NumNode) and term.b == 0)]
  # a term can fold to a constant (a Variable with min == max times a factor); move it into the constant
  constant += sum(term.b for term in terms if isinstance(term, NumNode))
  terms = [term for term in terms if not isinstance(term, NumNode)]
  if not terms: return NumNode(constant)
  if len(terms) == 1 and constant == 0: return terms[0]
  return _fold(SumNode(tuple(terms) + ((NumNode(constant),) if constant != 0 else ())))


def sym_and(nodes: list[Node]) -> Node:
  """AND of boolean nodes: a NumNode(0) makes it 0, NumNode(1)s drop, nested ANDs flatten, empty is 1."""
  operands: dict[Node, None] = {}
  for node in nodes:
    for operand in (node.nodes if isinstance(node, AndNode) else (sym_int(node),)):
      if isinstance(operand, NumNode):
        if operand.b == 0: return NumNode(0)
        continue
      operands.setdefault(operand, None)
  if not operands: return NumNode(1)
  if len(operands) == 1: return next(iter(operands))
  return _fold(AndNode(tuple(operands)))


def _split_small(terms: list[tuple[Node, int]], constant: int, divisor: int) -> tuple[int, Node, Node] | None:
  """Write sum as f*K + r with f dividing divisor and 0 <= r < f; then floor/mod/compare by divisor ignore r.

  Returns (f, big part f*K, small part r) or None when no such split exists."""
  factors = sorted({math.gcd(coefficient, divisor) for _, coefficient in terms} - {1}, reverse=True)
  for factor in factors:
    big = [(base, c) for base, c in terms if c % factor == 0]
    small = [(base, c) for base, c in terms if c % factor != 0]
    small_node = _build(small, constant % factor)
    if big and small_node.min >= 0 and small_node.max < factor:
      return factor, _build(big, constant - constant % factor), small_node
  return None


def _floordiv(node: Node, divisor: int) -> Node:
  if divisor == 1: return node
  if isinstance(node, NumNode): return NumNode(node.b // divisor)
  if node.min // divisor == node.max // divisor: return NumNode(node.min // divisor)
  if isinstance(node, MulNode):
    common = math.gcd(node.b, divisor)
    # (x*c)//b == (x*(c/g))//(b/g): exact rational identity; gives x*(c/b) or x//(b/c) in the dividing cases
    if common > 1: return _floordiv(_mul(node.a, node.b // common), divisor // common)
  if isinstance(node, DivNode): return _floordiv(node.a, node.b * divisor)  # (x//a)//b == x//(a*b) for a, b > 0
  if isinstance(node, SumNode):
    terms, constant = _linear_terms(node)
    # pull out whole multiples of the divisor: (a*(q*b+r) + rest)//b == a*q + (a*r + rest)//b
    quotient: list[Node | int] = []
    remainder_terms: list[tuple[Node, int]] = []
    for base, coefficient in terms:
      whole = _trunc_div(coefficient, divisor)
      if whole != 0: quotient.append(_mul(base, whole))
      if coefficient - whole * divisor != 0: remainder_terms.append((base, coefficient - whole * divisor))
    whole_constant, remainder_constant = divmod(constant, divisor)
    if quotient or whole_constant != 0:
      return sym_sum(quotient + [whole_constant, _floordiv(_build(remainder_terms, remainder_constant), divisor)])
    common = math.gcd(divisor, constant, *(coefficient for _, coefficient in terms))
    if common > 1: return _floordiv(_build([(b, c // common) for b, c in terms], constant // common), divisor // common)
    split = _split_small(terms, constant, divisor)
    if split is not None: return _floordiv(split[1], divisor)
  return DivNode(node, divisor)


def _mod(node: Node, divisor: int) -> Node:
  if divisor == 1: return NumNode(0)
  if isinstance(node, NumNode): return NumNode(node.b % divisor)
  if node.min // divisor == node.max // divisor: return node - (node.min // divisor) * divisor  # one period only
  if isinstance(node, MulNode):
    common = math.gcd(node.b, divisor)
    # (x*c) % b == ((x*(c/g)) % (b/g)) * g; e.g. (x*a) % (a*b) -> (x % b)*a, and 0 when b divides c
    if common > 1: return _mul(_mod(_mul(node.a, node.b // common), divisor // common), common)
    if abs(node.b) >= divisor: return _mod(_mul(node.a, node.b - _trunc_div(node.b, divisor) * divisor), divisor)
  if isinstance(node, ModNode) and node.b % divisor == 0: return _mod(node.a, divisor)  # (x % (a*b)) % b == x % b
  if isinstance(node, SumNode):
    terms, constant = _linear_terms(node)
    reduced = [(base, c - _trunc_div(c, divisor) * divisor) for base, c in terms]
    if reduced != terms or not 0 <= constant < divisor:
      return _mod(_build([(b, c) for b, c in reduced if c != 0], constant % divisor), divisor)
    common = math.gcd(divisor, constant, *(coefficient for _, coefficient in terms))
    if common > 1:
      return _mul(_mod(_build([(b, c // common) for b, c in terms], constant // common), divisor // common), common)
    split = _split_small(terms, constant, divisor)
    if split is not None: return _mod(split[1], divisor) + split[2]
  return ModNode(node, divisor)


def _lt(node: Node, bound_like: NodeLike) -> Node:
  bound_const = _const_of(bound_like)
  if bound_const is None:
    bound_node = sym_int(bound_like)
    if node.max < bound_node.min: return NumNode(1)
    if node.min >= bound_node.max: return NumNode(0)
    return LtNode(node, bound_node)
  bound = bound_const
  if node.max < bound: return NumNode(1)
  if node.min >= bound: return NumNode(0)
  if isinstance(node, DivNode): return _lt(node.a, bound * node.b)  # x//d < b  <=>  x < b*d  (floor, d > 0)
  if isinstance(node, MulNode):
    if node.b > 0: return _lt(node.a, -((-bound) // node.b))  # x*c < b  <=>  x < ceil(b/c)
    if node.b == -1 and isinstance(node.a, DivNode):  # -(x//d) < b  <=>  x//d >= 1-b  <=>  -x < 1 - (1-b)*d
      return _lt(_mul(node.a.a, -1), 1 - (1 - bound) * node.a.b)
    if node.b < -1: return _lt(_mul(node.a, -1), -((-bound) // -node.b))  # -x*k < b  <=>  -x < -floor(-b/k)
  if isinstance(node, SumNode):
    terms, constant = _linear_terms(node)
    if constant != 0: return _lt(_build(terms, 0), bound - constant)
    common = math.gcd(*(coefficient for _, coefficient in terms))
    if common > 1: return _lt(_build([(b, c // common) for b, c in terms], 0), -((-bound) // common))
    split = _split_small(terms, 0, bound)
    if split is not None: return _lt(split[1], bound)
  return LtNode(node, bound)



def given_valid(node: Node, valid: Node) -> Node:
  """`node` re-simplified for the variable values where `valid` (an AndNode of LtNodes, a masked view's validity)
  holds: each clause linear in its variables tightens every variable's range (`x*c + rest < b` bounds x by the
  least `rest` can be). A cat's piece reads `(t + 511) % 512` where the piece's own mask fixes the block's index:
  the division and modulo fold away. The result equals `node` only where `valid` is true: for a gated access."""
  clauses = valid.nodes if isinstance(valid, AndNode) else (valid,)
  ranges: dict[Variable, tuple[int, int]] = {variable: (variable.min, variable.max) for variable in node.vars()}
  for clause in clauses:
    if not isinstance(clause, LtNode) or not isinstance(clause.b, int): continue
    terms, constant = _linear_terms(clause.a)
    if not all(isinstance(base, Variable) for base, _ in terms): continue
    for base, coefficient in terms:
      if base not in ranges: continue
      # the least the other terms can add (at their ranges' ends)
      rest = constant + sum(min(other_coefficient * other.min, other_coefficient * other.max)
                            for other, other_coefficient in terms if other is not base)
      limit = clause.b - rest - 1   # coefficient * x <= limit
      low, high = ranges[base]
      if coefficient > 0: high = min(high, limit // coefficient)
      else: low = max(low, -(limit // -coefficient))
      if low > high: return node   # never valid: nothing to simplify for
      ranges[base] = (low, high)
  tighter: dict[Variable, Node] = {}
  for variable, (low, high) in ranges.items():
    if (low, high) == (variable.min, variable.max) or variable.val is not None: continue
    tighter[variable] = NumNode(low) if low == high else Variable(variable.expr, low, high)
  return node.substitute(tighter) if tighter else node
