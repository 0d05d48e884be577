"""Tests of ourgrad.shape.symbolic: brute-force correctness of simplification and bounds, plus each rule."""
import itertools
import operator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ourgrad.shape.symbolic import (AndNode, DivNode, LtNode, ModNode, MulNode, Node, NumNode, SumNode, Variable,
                                    sym_and, sym_sum)

VARIABLES = [Variable("a", 0, 3), Variable("b", 0, 5), Variable("c", -2, 4)]
ASSIGNMENTS = [dict(zip(("a", "b", "c"), values))
               for values in itertools.product(range(0, 4), range(0, 6), range(-2, 5))]

# expression trees as nested tuples, interpreted both symbolically and with plain ints
leaf = st.one_of(st.sampled_from(["a", "b", "c"]), st.integers(-6, 8))


def extend(children):
  return st.one_of(
    st.tuples(st.just("add"), children, children),
    st.tuples(st.just("sub"), children, children),
    st.tuples(st.just("mul"), children, st.integers(-4, 6)),
    st.tuples(st.just("div"), children, st.integers(1, 9)),
    st.tuples(st.just("mod"), children, st.integers(1, 9)),
    st.tuples(st.just("lt"), children, st.integers(-5, 12)),
    st.tuples(st.just("ge"), children, st.integers(-5, 12)),
    st.tuples(st.just("ltn"), children, children),
    st.tuples(st.just("and"), children, children),
  )


expressions = st.recursive(leaf, extend, max_leaves=10)


def build(tree) -> Node | int:
  if isinstance(tree, str): return VARIABLES[["a", "b", "c"].index(tree)]
  if isinstance(tree, int): return tree
  op, left, right = tree
  lhs = build(left)
  rhs = build(right) if op in ("add", "sub", "ltn", "and") else right
  if not isinstance(lhs, Node): lhs = NumNode(lhs)
  if op == "add": return lhs + rhs
  if op == "sub": return lhs - rhs
  if op == "mul": return lhs * rhs
  if op == "div": return lhs // rhs
  if op == "mod": return lhs % rhs
  if op == "lt": return lhs.lt(rhs)
  if op == "ge": return lhs.ge(rhs)
  if op == "ltn": return lhs.lt(rhs)
  # "and" needs boolean operands: compare each side with a constant first
  return sym_and([lhs.lt(2), (rhs if isinstance(rhs, Node) else NumNode(rhs)).ge(0)])


def interpret(tree, values: dict[str, int]) -> int:
  if isinstance(tree, str): return values[tree]
  if isinstance(tree, int): return tree
  op, left, right = tree
  lhs = interpret(left, values)
  rhs = interpret(right, values) if op in ("add", "sub", "ltn", "and") else right
  return {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.floordiv,
          "mod": operator.mod, "lt": lambda x, y: int(x < y), "ge": lambda x, y: int(x >= y),
          "ltn": lambda x, y: int(x < y), "and": lambda x, y: int(x < 2 and y >= 0)}[op](lhs, rhs)


def all_subnodes(node: Node) -> list[Node]:
  found, stack = [], [node]
  while stack:
    current = stack.pop()
    found.append(current)
    stack.extend(current._children())
  return found


@settings(max_examples=300, deadline=None)
@given(expressions)
def test_random_expressions_match_python(tree):
  node = build(tree)
  if not isinstance(node, Node): node = NumNode(node)
  subnodes = all_subnodes(node)
  for values in ASSIGNMENTS:
    expected = interpret(tree, values)
    assert node.evaluate(values) == expected, f"{node.render()} at {values}"
    for sub in subnodes:  # every node's bounds must hold, not just the root's
      value = sub.evaluate(values)
      assert sub.min <= value <= sub.max, f"{sub.render()} = {value} outside [{sub.min}, {sub.max}] at {values}"


@settings(max_examples=100, deadline=None)
@given(expressions)
def test_substitute_matches_evaluate(tree):
  node = build(tree)
  if not isinstance(node, Node): return
  replacement = {VARIABLES[0]: VARIABLES[1] * 2 + 1}
  substituted = node.substitute(replacement)
  for values in ASSIGNMENTS[::7]:
    shifted = dict(values, a=values["b"] * 2 + 1)
    assert substituted.evaluate(values) == node.evaluate(shifted)


a, b = Variable("a", 0, 3), Variable("b", 0, 3)
x = Variable("x", 0, 100)


def test_div_mod_of_split_index():
  assert (a * 4 + b) // 4 == a
  assert (a * 4 + b) % 4 == b
  assert (b + a * 4) // 4 == a
  assert (a * 4 + b + 8) // 4 == a + 2


def test_constant_folding_and_identities():
  assert NumNode(3) + 4 == NumNode(7)
  assert x * 0 == NumNode(0)
  assert x * 1 == x
  assert x + 0 == x
  assert x - x == NumNode(0)
  assert (x + x * 3) == x * 4
  assert isinstance(x * 4, MulNode)
  assert (x + 2) + (x + 3) == sym_sum([x * 2, 5])
  assert sym_sum([]) == NumNode(0)
  assert NumNode(5) * NumNode(2) == 10


def test_min_max_fold():
  fixed = Variable("f", 2, 2)
  assert isinstance(fixed, Variable) and fixed.min == fixed.max == 2
  assert fixed * 3 == NumNode(6)
  assert Variable("s", 0, 0) + 5 == NumNode(5)


def test_div_rules():
  assert a // 4 == NumNode(0)
  assert a % 4 == a
  assert (x * 8) // 4 == x * 2
  assert (x * 2) // 8 == x // 4
  assert (x // 3) // 5 == x // 15
  assert isinstance(x // 7, DivNode)
  assert (x * 4 + b) // 8 == x // 2  # b < 4 cannot carry into a multiple of 8
  assert (x * 2 + Variable("y", 0, 10) * 2) // 4 == (x + Variable("y", 0, 10)) // 2
  assert (x * 6) // 4 == (x * 3) // 2
  with pytest.raises(ValueError): x // 0
  with pytest.raises(ValueError): x % -2
  with pytest.raises(TypeError): x // x


def test_mod_rules():
  assert (x * 8) % 4 == NumNode(0)
  assert (x * 4 + b) % 8 == (x % 2) * 4 + b
  assert (x % 12) % 4 == x % 4
  assert isinstance((x % 12) // 4, DivNode)
  assert (x * 3) % 12 == (x % 4) * 3
  assert (x + 8) % 4 == x % 4
  assert (x * 4 + 5) % 4 == NumNode(1)
  assert isinstance(x % 7, ModNode)


def test_div_mod_recombine():
  assert (x // 4) * 4 + x % 4 == x
  assert ((x // 3) % 5) * 6 + (x // 15) * 30 + (x % 3) * 2 == x * 2


def test_lt_rules():
  assert a.lt(4) == NumNode(1)
  assert a.lt(0) == NumNode(0)
  assert (x * 4).lt(9) == x.lt(3)
  assert (x * 4 + a).lt(8) == x.lt(2)
  assert (x * 2 + Variable("y", 0, 10) * 4).lt(7) == (x + Variable("y", 0, 10) * 2).lt(4)
  assert (x + 3).lt(10) == x.lt(7)
  assert isinstance(x.lt(a), LtNode)
  assert (x // 6).lt(5) == x.lt(30)
  assert (x // 6).ge(1) == x.ge(6)
  assert x.ge(5) == (-x).lt(-4)
  for value in range(0, 101, 7):
    assert x.ge(5).evaluate({"x": value}) == int(value >= 5)
    assert (x < 5).evaluate({"x": value}) == int(value < 5)
    assert (x >= 5).evaluate({"x": value}) == int(value >= 5)


def test_and_folding():
  assert sym_and([]) == NumNode(1)
  assert sym_and([x.lt(5), NumNode(0)]) == NumNode(0)
  assert sym_and([x.lt(5), NumNode(1)]) == x.lt(5)
  both = sym_and([x.lt(5), a.lt(2)])
  assert isinstance(both, AndNode) and len(both.nodes) == 2
  assert sym_and([both, x.lt(5)]) == both


def test_mul_node_by_node():
  assert x * NumNode(3) == x * 3
  assert NumNode(3) * x == x * 3
  # two non-constant nodes (a symbolic stride times an index) make an opaque product with the bounds' corners
  product = x * a
  assert product.min == min(x.min * a.min, x.min * a.max, x.max * a.min, x.max * a.max)
  assert product.max == max(x.min * a.min, x.min * a.max, x.max * a.min, x.max * a.max)
  assert product.evaluate({"x": 3, "a": 2}) == 6 and product.substitute({x: NumNode(2)}) == a * 2
  with pytest.raises(TypeError): x * 1.5


def test_structural_equality_and_hash():
  assert Variable("q", 0, 3) == Variable("q", 0, 3)
  assert Variable("q", 0, 3) != Variable("q", 0, 4)
  table = {x * 4 + a: "hit"}
  assert table[x * 4 + a] == "hit"
  assert NumNode(3) == 3 and hash(NumNode(3)) == hash(3)


def test_vars_order():
  """First-seen order in the node's structure, where a sum's terms are in their canonical order."""
  assert (b * 2 + a + b).vars() == [a, b]
  assert (x // 4 + a % 2).vars() == [a, x]
  assert ((b + a) // 4).lt(x).vars() == [a, b, x]


def test_sum_terms_have_one_order():
  """The same terms summed in any order give one node (equal, same hash, same text): two views of one buffer
  with the same address give one index expression, so the generated code loads the element once."""
  gidx0, gidx2, gidx10 = Variable("gidx0", 0, 7), Variable("gidx2", 0, 7), Variable("gidx10", 0, 7)
  lidx, ridx = Variable("lidx0", 0, 31), Variable("ridx4", 0, 3)
  terms = [gidx0 * 36864, ridx * 9216, gidx2 * 576, gidx10 * 24, lidx, (lidx // 2) * 12]
  sums = [sym_sum(list(order) + [5]) for order in itertools.permutations(terms)]
  assert all(total == sums[0] and hash(total) == hash(sums[0]) for total in sums)
  assert len({total.render() for total in sums}) == 1
  # variables in natural order (gidx2 before gidx10), kinds by name (g, l, r), a variable before the terms built
  # on it, the constant last
  assert sums[0].render() == "((gidx0*36864)+(gidx2*576)+(gidx10*24)+lidx0+((lidx0/2)*12)+(ridx4*9216)+5)"
  # ... and sums built inside other nodes too
  assert (gidx0 * 4 + lidx) // 3 == (lidx + gidx0 * 4) // 3
  assert sym_and([(ridx + gidx0).lt(5), lidx.lt(3)]) == sym_and([(gidx0 + ridx).lt(5), lidx.lt(3)])


def test_render():
  gidx = Variable("gidx0", 0, 15)
  ridx = Variable("ridx1", 0, 3)
  assert (gidx * 4 + ridx).render() == "((gidx0*4)+ridx1)"
  assert (gidx // 3).render() == "(gidx0/3)"
  assert (gidx % 3).render() == "(gidx0%3)"
  assert gidx.lt(3).render() == "(gidx0<3)"
  assert sym_and([gidx.lt(3), ridx.lt(2)]).render() == "((gidx0<3)&&(ridx1<2))"
  assert (gidx + 1).render() == "(gidx0+1)"


def test_sum_structure():
  total = x + a * 2 + 3 + b
  assert isinstance(total, SumNode)
  assert sum(isinstance(node, NumNode) for node in total.nodes) == 1
  assert not any(isinstance(node, SumNode) for node in total.nodes)
  assert (total.min, total.max) == (3, 100 + 6 + 3 + 3)


def test_long_sum_does_not_recurse():
  total = sym_sum([Variable(f"v{i}", 0, 1) for i in range(3000)])
  assert total.max == 3000
