"""Fuzz the scheduler: random multi-output programs with assigns, realized together vs one output at a time.

Each case draws a random program with `graphgen` (shared subgraphs, reductions read by several users) and mixes
in the statements that make scheduling hard:
  - `t.assign(value)` and `t[index] = value` (setitem: ints, slices with steps, None) into realized buffers (the
    program's inputs), with values that read the target itself, through the same view or another one (flip,
    shrink + pad, ...), or other nodes of the program, broadcast and cast to the target's dtype;
  - `t.realize()` of random nodes in the middle of the program (a second assign to a buffer first realizes the
    pending one, as an optimizer step does).
Then 2 to 4 outputs are realized in one `Tensor.realize_all(...)`, and, in a fresh build of the same program, one
at a time in program order. Both must equal the numpy mirror, which runs the program eagerly (PyTorch semantics:
an assign changes the buffer from that statement on; values computed before it keep the old contents).

Lazy semantics the generator respects, so both ways of realizing have one right answer: after an assign to a
buffer is issued, nodes that read the buffer's old contents are not used in new ops (they may still be outputs,
which the scheduler must compute before the assign runs); after the assign has run (a realize reached it), nodes
that still read the old contents are never outputs (their memory has been overwritten).

TODO(memory planner): ourgrad/engine/ has no memory planner yet (buffers come from the allocator's LRU cache, no
schedule-level reuse). When one lands, run every case with the planner on and off and compare the outputs (and
check that no two live buffers of one schedule share memory).

Run: `python test/fuzz/fuzz_schedule.py --iterations 1000 --seed N [--device PYTHON]`; `--case I` replays one
case and prints its program.
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fuzz_graphs import device_available  # noqa: E402
from fuzzing import Case, Check, main, random_seed, run_for_pytest  # noqa: E402
from graphgen import (EPS, FLOAT_CONSTANTS, INT_CONSTANTS, GraphGen, Node, Rejected,  # noqa: E402
                      compare, distance_to_integers, index_code, max_abs, random_basic_index, to_mirror)

from ourgrad import Tensor, dtypes  # noqa: E402
from ourgrad.dtype import DType  # noqa: E402
from ourgrad.errors import OurgradError  # noqa: E402

# Bugs this fuzzer found (all fixed; repros in test_regressions.py): assign/setitem into a 0-element buffer,
# assigning a value that is only a view of the target itself, and a gcc 12 miscompile of a reduce over a flip.
WEIGHTS = {"unary": 4, "binary": 5, "where": 2, "reduce": 5, "matmul": 1, "movement": 4}


def cast_value(value: np.ndarray, err: float, dtype: DType) -> tuple[np.ndarray, float]:
  """The mirror of `value.cast(dtype)` (as assign and setitem do), or Rejected when a float -> int/bool cast is
  too close to a boundary for its error."""
  if dtype == dtypes.bool:
    if value.dtype.kind == "f" and err > 0 and value.size and np.min(np.abs(value)) <= 2 * err:
      raise Rejected("cast margin")
    return value != 0, 0.0
  if dtype.is_float: return value.astype(np.float64), err + (EPS * max_abs(value) if value.dtype.kind == "f" else 0.0)
  if value.dtype.kind == "f":
    if err > 0 and distance_to_integers(value) <= 2 * err: raise Rejected("cast margin")
    return np.trunc(value).astype(np.int64), 0.0
  return value.astype(np.int64), 0.0


class ScheduleGen(GraphGen):
  """GraphGen plus assign, setitem and realize statements on the program's input buffers."""

  def __init__(self, rng: random.Random, device: str = "CLANG", no_flips: bool = False):
    super().__init__(rng, device, no_flips)
    self.latest: dict[int, int] = {}   # buffer id -> the node holding its newest contents
    self.owner: dict[int, int] = {}    # node holding some contents of a buffer (input, assign, setitem) -> buffer id

  def add_input(self, shape: tuple[int, ...] | None = None, dtype: DType | None = None) -> Node:
    node = super().add_input(shape, dtype)
    self.latest[node.index] = self.owner[node.index] = node.index
    return node

  def statement_node(self, statements: list[str], value: np.ndarray, err: float, kind: str,
                     deps: frozenset[tuple[int, int]]) -> Node:
    """Run statements that define v{next index} (rolled back from the namespace on Rejected)."""
    index = len(self.nodes)
    name = f"v{index}"
    try:
      for statement in statements: exec(statement, self.namespace)  # noqa: S102
    except OurgradError as error:
      self.namespace.pop(name, None)
      raise Rejected(f"ourgrad refused: {type(error).__name__}") from error
    tensor = self.namespace[name]
    mirror = to_mirror(value, tensor.dtype)
    assert mirror.shape == tensor.shape, f"{statements}: ourgrad {tensor.shape}, numpy {mirror.shape}"
    node = Node(index, mirror, tensor.dtype, err if tensor.dtype.is_float else 0.0, tensor, kind, deps)
    self.lines.extend(statements)
    self.nodes.append(node)
    return node

  def realize_step(self, node: Node) -> None:
    self.emit(f"{node.name}.realize()")
    # every pending assign this node's graph reaches has now run
    for buffer, version in node.deps: self.executed[buffer] = max(self.executed[buffer], version)
    # a realized assign lives in its buffer's memory: it reads nothing else any more
    if node.index in self.owner and self.latest[self.owner[node.index]] == node.index:
      node.deps = frozenset({(self.owner[node.index], self.current[self.owner[node.index]])})

  def realize(self) -> Node:
    node = self.pick(lambda candidate: candidate.kind != "input")
    self.realize_step(node)
    return node

  def mutate(self) -> Node:
    rng = self.rng
    buffer = rng.choice(list(self.latest))
    target = self.nodes[self.latest[buffer]]
    if self.executed[buffer] < self.current[buffer]: self.realize_step(target)  # run the pending assign first
    shape = target.shape
    setitem = rng.random() < 0.5 and len(shape) > 0
    index = random_basic_index(rng, shape, negative_steps=not self.no_flips) if setitem else ()
    selected_shape = np.empty(shape)[index].shape if setitem else shape
    code, value, err, srcs = self.assign_value(target, selected_shape)
    value, err = cast_value(np.broadcast_to(np.asarray(value), selected_shape), err, target.dtype)
    new = target.value.copy()
    if setitem: new[index] = value
    else: new = np.array(np.broadcast_to(value, shape))
    name = f"v{len(self.nodes)}"
    statement = f"{name}[{index_code(index)}] = {code}" if setitem else f"{name}.assign({code})"
    deps = frozenset({(buffer, self.current[buffer] + 1)}).union(*(src.deps for src in srcs), target.deps)
    deps = frozenset(dep for dep in deps if dep[0] != buffer or dep[1] == self.current[buffer] + 1)
    node = self.statement_node([f"{name} = Tensor({target.name}.lazydata)", statement],
                               new, max(err, target.err), "setitem" if setitem else "assign", deps)
    self.current[buffer] += 1
    self.latest[buffer] = node.index
    self.owner[node.index] = buffer
    return node

  def assign_value(self, target: Node, shape: tuple[int, ...]) -> tuple[str, Any, float, tuple[Node, ...]]:
    """A value to write: a scalar, a node of a broadcastable shape, or an expression of the target itself."""
    rng = self.rng
    choice = rng.random()
    if choice < 0.2:
      constant = rng.choice(FLOAT_CONSTANTS if target.dtype.is_float else INT_CONSTANTS)
      if target.dtype == dtypes.bool: constant = rng.random() < 0.5
      return repr(constant), np.asarray(constant), 0.0, ()
    if choice < 0.55 and shape == target.shape:
      # the target read back through a view of itself: in place only if the kernel reads each element before
      # overwriting it (the scheduler must realize the value first when it reads through another view)
      views = [("", lambda a: a)]
      if target.value.ndim and not self.no_flips:
        views.append((f".flip({target.value.ndim - 1})", lambda a: np.flip(a, -1)))
      if target.value.ndim and shape[-1] > 1:  # shifted by one along the last dim
        pads = ((0, 0),) * (target.value.ndim - 1) + ((0, 1),)
        views.append((f"[..., 1:].pad({pads!r})", lambda a, pads=pads: np.pad(a[..., 1:], pads)))
      suffix, function = rng.choice(views)
      if target.dtype == dtypes.bool: return f"~{target.name}{suffix}", ~function(target.value), 0.0, (target,)
      constant = rng.choice(FLOAT_CONSTANTS if target.dtype.is_float else INT_CONSTANTS)
      value = function(target.value) * 2 + constant
      err = 2 * target.err + (EPS * max_abs(value) if target.dtype.is_float else 0.0)
      return f"({target.name}{suffix} * 2 + {constant!r})", value, err, (target,)
    candidates = [node for node in self.live_nodes(lambda node: node.index != target.index)
                  if _broadcasts_to(node.shape, shape)]
    if candidates and rng.random() < 0.8:
      node = rng.choice(candidates)
      return node.name, node.value, node.err, (node,)
    node = self.add_input(shape, target.dtype)
    return node.name, node.value, 0.0, (node,)

  OPS: dict[str, int] = dict(WEIGHTS)


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
  try:
    return np.broadcast_shapes(shape, target) == target
  except ValueError:
    return False


def random_program(gen: ScheduleGen) -> list[int]:
  """Fill `gen` with a random program (realizing on its device where the program says so); returns the outputs."""
  rng = gen.rng
  for _ in range(rng.randint(1, 3)): gen.add_input()
  for _ in range(rng.randint(4, 12)):
    roll = rng.random()
    try:
      if roll < 0.18: gen.mutate()
      elif roll < 0.25: gen.realize()
      else: gen.step()
    except Rejected as rejection:
      gen.rejections[str(rejection)] = gen.rejections.get(str(rejection), 0) + 1
  # outputs: never a node whose memory an executed assign overwrote, nor an alias (the buffer itself or a view of
  # it) of contents that a later assign replaces: reading it reads the buffer as it is then, as in PyTorch
  # (`b = a[1:]; a.copy_(...)` changes b). Prefer assigns, reductions and the last node.
  # (by the base each tensor viewed when it was made: reading `.lazydata` now gives the newest version of them all)
  holders = {gen.nodes[index].created_base: (buffer, index) for index, buffer in gen.owner.items()}

  def overwritten_alias(node: Node) -> bool:
    holder = holders.get(node.created_base)
    return holder is not None and gen.latest[holder[0]] != holder[1]
  candidates = [node for node in gen.nodes
                if not gen.dead(node) and node.kind != "input" and not overwritten_alias(node)]
  if not candidates: return []
  preferred = [node for node in candidates if node.kind in ("assign", "setitem", "reduce")]
  count = min(len(candidates), rng.randint(2, 4))
  chosen = {candidates[-1].index}
  while len(chosen) < count:
    pool = preferred if preferred and rng.random() < 0.6 else candidates
    chosen.add(rng.choice(pool).index)
  return sorted(chosen)


def make_check(device: str) -> Check:
  def check_case(case: Case) -> str:
    gen = ScheduleGen(case.rng)
    try:
      outputs = random_program(gen)  # realize statements run on the generation device (CLANG) already
    except Exception:
      case.log("failed while generating (on CLANG), after:\n" + gen.graph([]).program())
      raise
    graph = gen.graph(outputs)
    case.log(graph.program())
    if not outputs: return "ok: no outputs"
    # all outputs in one schedule
    namespace = graph.build(device)
    tensors = [namespace[f"v{index}"] for index in outputs]
    Tensor.realize_all(*tensors)
    for index, tensor in zip(outputs, tensors):
      compare(tensor.numpy(), graph.nodes[index], f"realize_all: v{index}")
    # a fresh build, one output at a time in program order
    namespace = graph.build(device)
    for index in outputs:
      compare(namespace[f"v{index}"].numpy(), graph.nodes[index], f"one at a time: v{index}")
    kinds = {graph.nodes[index].kind for index in outputs}
    return "ok: with assign" if kinds & {"assign", "setitem"} else "ok"
  return check_case


# ---------------------------------------------------------------- pytest and command line

ITERATIONS = 30


@pytest.mark.parametrize("seed", [0, 1])
def test_schedule_fixed_seed(seed: int) -> None:
  run_for_pytest("fuzz_schedule", make_check("CLANG"), seed, ITERATIONS)


def test_schedule_random_seed() -> None:
  run_for_pytest("fuzz_schedule", make_check("CLANG"), random_seed(), ITERATIONS)


if __name__ == "__main__":
  def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="CLANG", help="device to realize on")

  def make_check_from_args(args: argparse.Namespace) -> Any:
    if not device_available(args.device): raise SystemExit(f"{args.device} does not open here")
    return make_check(args.device.upper())

  main("fuzz_schedule", make_check_from_args, 200, add_arguments)
