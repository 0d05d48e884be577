"""Fuzz the symbolic integer expressions (ourgrad/shape/symbolic.py) against brute force.

Each case draws 1 to 3 Variables with small random ranges (negative ones included) and a random expression tree
of depth up to 6 over them: + and - (of nodes and of constants), * by a constant (negative and 0 included),
// and % by a positive constant, `lt`/`ge` against constants and against other nodes, `sym_and` of comparisons,
negation. The tree is built twice: as Nodes (every operation simplifies as it goes) and as a plain Python
function (floor semantics). For every assignment of the variables (all of them, at most a few hundred):
  - the simplified node's `evaluate` equals the plain function;
  - the node's `min`/`max` bounds contain the value, and so do the bounds of every sub-node of the simplified tree
    (a wrong bound deep inside can make a later simplification wrong);
  - `render()` read back as Python (`/` as `//`, `&&` as `and`) gives the same value;
  - `substitute` with constants folds to the same number, and substituting a variable by an expression of
    another variable (re-simplifying) matches the plain function evaluated there, wherever that expression stays
    inside the replaced variable's range (the simplified node only equals the expression on the ranges).

Run: `python test/fuzz/fuzz_symbolic.py --iterations 100000 --seed N`; `--case I` replays one case.
"""
from __future__ import annotations

import argparse
import itertools
import random
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fuzzing import Case, main, random_seed, run_for_pytest  # noqa: E402

from ourgrad.shape.symbolic import Node, NumNode, Variable, sym_and, sym_int  # noqa: E402

Plain = Callable[[dict[str, int]], int]
MAX_ASSIGNMENTS = 400


class Expr:
  """One random expression held three ways: the Node, a plain Python function, and its source text."""

  def __init__(self, node: Node, plain: Plain, text: str, boolean: bool = False):
    self.node, self.plain, self.text, self.boolean = node, plain, text, boolean


def random_variables(rng: random.Random) -> list[Variable]:
  variables = []
  for name in ["a", "b", "c"][:rng.choice([1, 2, 2, 3, 3])]:
    low = rng.choice([0, 0, 0, 0, 1, 2, -1, -3, -5])
    variables.append(Variable(name, low, low + rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 9, 12, 15, 20])))
  return variables


def leaf(rng: random.Random, variables: list[Variable]) -> Expr:
  if rng.random() < 0.85:
    variable = rng.choice(variables)
    return Expr(variable, lambda values, name=variable.expr: values[name], variable.expr)
  value = rng.randint(-6, 9)
  return Expr(NumNode(value), lambda values, v=value: v, f"NumNode({value})")


def comparison(rng: random.Random, variables: list[Variable], depth: int) -> Expr:
  """A boolean expression: a comparison with a constant or with another expression."""
  left = expression(rng, variables, depth - 1)
  kind = rng.choice(["lt", "ge", "lt_node", "le", "gt"])
  if kind == "lt_node":
    right = expression(rng, variables, depth - 1)
    return Expr(left.node.lt(right.node), lambda v, l=left.plain, r=right.plain: int(l(v) < r(v)),
                f"({left.text}).lt({right.text})", True)
  bound = rng.randint(-8, 14)
  if kind == "lt": return Expr(left.node.lt(bound), lambda v, l=left.plain: int(l(v) < bound),
                               f"({left.text}).lt({bound})", True)
  if kind == "ge": return Expr(left.node.ge(bound), lambda v, l=left.plain: int(l(v) >= bound),
                               f"({left.text}).ge({bound})", True)
  if kind == "le": return Expr(left.node <= bound, lambda v, l=left.plain: int(l(v) <= bound),
                               f"(({left.text}) <= {bound})", True)
  return Expr(left.node > bound, lambda v, l=left.plain: int(l(v) > bound), f"(({left.text}) > {bound})", True)


def expression(rng: random.Random, variables: list[Variable], depth: int) -> Expr:
  if depth <= 0 or rng.random() < 0.15: return leaf(rng, variables)
  kind = rng.choice(["add", "add", "add_const", "sub", "mul", "mul", "div", "div", "mod", "mod", "neg", "bool",
                     "and"])
  if kind in ("add", "sub"):
    left, right = expression(rng, variables, depth - 1), expression(rng, variables, depth - 1)
    if kind == "add": return Expr(left.node + right.node, lambda v, l=left.plain, r=right.plain: l(v) + r(v),
                                  f"({left.text} + {right.text})")
    return Expr(left.node - right.node, lambda v, l=left.plain, r=right.plain: l(v) - r(v),
                f"({left.text} - {right.text})")
  inner = expression(rng, variables, depth - 1)
  if kind == "add_const":
    constant = rng.randint(-12, 12)
    return Expr(inner.node + constant, lambda v, i=inner.plain: i(v) + constant, f"({inner.text} + {constant})")
  if kind == "mul":
    factor = rng.choice([-3, -2, -1, 0, 2, 2, 3, 4, 5, 6, 8])
    return Expr(inner.node * factor, lambda v, i=inner.plain: i(v) * factor, f"({inner.text} * {factor})")
  if kind == "div":
    divisor = rng.choice([1, 2, 2, 3, 3, 4, 5, 6, 7, 8, 9, 12, 16])
    return Expr(inner.node // divisor, lambda v, i=inner.plain: i(v) // divisor, f"({inner.text} // {divisor})")
  if kind == "mod":
    divisor = rng.choice([1, 2, 2, 3, 3, 4, 5, 6, 7, 8, 9, 12, 16])
    return Expr(inner.node % divisor, lambda v, i=inner.plain: i(v) % divisor, f"({inner.text} % {divisor})")
  if kind == "neg": return Expr(-inner.node, lambda v, i=inner.plain: -i(v), f"(-{inner.text})")
  if kind == "bool": return comparison(rng, variables, depth)
  operands = [comparison(rng, variables, depth - 1) for _ in range(rng.randint(2, 3))]
  return Expr(sym_and([operand.node for operand in operands]),
              lambda v, ops=tuple(o.plain for o in operands): int(all(op(v) for op in ops)),
              f"sym_and([{', '.join(operand.text for operand in operands)}])", True)


def sub_nodes(node: Node) -> list[Node]:
  """Every node of the tree (children are reached through `_children`, the library's own traversal)."""
  found, stack = [], [node]
  while stack:
    current = stack.pop()
    found.append(current)
    stack.extend(current._children())
  return found


def render_as_python(node: Node) -> str:
  return node.render().replace("/", "//").replace("&&", " and ")


def check_case(case: Case) -> str:
  rng = case.rng
  variables = random_variables(rng)
  expr = expression(rng, variables, rng.randint(1, 6))
  node = expr.node
  case.log(f"variables {[(v.expr, v.min, v.max) for v in variables]}\nexpression {expr.text}\n"
           f"simplified {node.render()}  bounds [{node.min}, {node.max}]")
  names = [variable.expr for variable in variables]
  assignments = [dict(zip(names, values)) for values in
                 itertools.product(*(range(variable.min, variable.max + 1) for variable in variables))]
  assignments = assignments[:MAX_ASSIGNMENTS]
  subs = [sub for sub in sub_nodes(node) if not isinstance(sub, NumNode)]
  rendered = compile(render_as_python(node), "<render>", "eval")
  for values in assignments:
    want = expr.plain(values)
    got = node.evaluate(values)
    assert got == want, f"{values}: simplified {node.render()} gives {got}, the expression gives {want}"
    for sub in subs:
      value = sub.evaluate(values)
      assert sub.min <= value <= sub.max, f"{values}: sub-node {sub.render()} = {value} outside [{sub.min}, {sub.max}]"
    assert int(eval(rendered, {}, dict(values))) == want, f"{values}: render() {node.render()} reads back wrong"
  for values in rng.sample(assignments, min(3, len(assignments))):
    folded = node.substitute({variable: NumNode(values[variable.expr]) for variable in variables})
    assert isinstance(folded, NumNode) and folded.b == expr.plain(values), \
      f"{values}: substitute gives {folded.render()}, want {expr.plain(values)}"
  # substitute a variable by an expression in another one: a = b*k + c, re-simplified, checked over b's range
  if len(variables) >= 2:
    target, source = rng.sample(variables, 2)
    scale, shift = rng.choice([-2, -1, 1, 2, 3]), rng.randint(-3, 3)
    replaced = node.substitute({target: sym_int(source * scale + shift)})
    case.log(f"substitute {target.expr} := {source.expr}*{scale}+{shift} -> {replaced.render()}")
    others = [variable for variable in variables if variable is not target]
    for combo in itertools.islice(itertools.product(*(range(v.min, v.max + 1) for v in others)), MAX_ASSIGNMENTS):
      values = dict(zip([v.expr for v in others], combo))
      full = dict(values, **{target.expr: values[source.expr] * scale + shift})
      # the simplified node equals the expression only inside the target's range
      if not target.min <= full[target.expr] <= target.max: continue
      got = replaced.evaluate(values)
      assert got == expr.plain(full), f"{values}: substituted {replaced.render()} gives {got}, want {expr.plain(full)}"
      assert replaced.min <= got <= replaced.max, f"{values}: substituted node leaves its bounds"
  if isinstance(node, NumNode): return "ok: folded to a constant"
  return f"ok: {type(node).__name__}"


# ---------------------------------------------------------------- pytest and command line

ITERATIONS = 3000


@pytest.mark.parametrize("seed", [0, 1])
def test_symbolic_fixed_seed(seed: int) -> None:
  run_for_pytest("fuzz_symbolic", check_case, seed, ITERATIONS)


def test_symbolic_random_seed() -> None:
  run_for_pytest("fuzz_symbolic", check_case, random_seed(), ITERATIONS)


if __name__ == "__main__":
  def make_check(args: argparse.Namespace) -> Any: return check_case
  main("fuzz_symbolic", make_check, 10000)
