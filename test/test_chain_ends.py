"""engine/schedule.py ChainEnds (the scheduler's kernel_of): its kept answers equal a fresh walk of the single-user
elementwise chain, and a realization added between two questions is seen (no stale answer)."""
from collections import defaultdict
from types import SimpleNamespace

from ourgrad.engine.schedule import ChainEnds
from ourgrad.ops import ELEMENTWISE_OPS, Ops


def _walk(base_id: int, realizes: dict, users: dict, by_id: dict) -> int:
  """The reference: follow single-user elementwise bases forward, asking nothing twice."""
  while base_id not in realizes and len(users[base_id]) == 1 and by_id[base_id].op in ELEMENTWISE_OPS:
    base_id = next(iter(users[base_id]))
  return base_id


def _graph() -> tuple[dict, dict]:
  """Ids 0..9: a chain 0 -> 1 -> ... -> 5 of ADDs; 5 is read by a SUM (6); 7 -> 8 -> 5 joins the chain; 9 is read
  by two bases (1 and 8), so its walk stops at itself."""
  ops = {i: Ops.ADD for i in range(10)}
  ops[6] = Ops.SUM
  edges = [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (7, 8), (8, 5), (9, 1), (9, 8)]
  users: dict[int, set[int]] = defaultdict(set)
  for src, user in edges: users[src].add(user)
  return {i: SimpleNamespace(op=op) for i, op in ops.items()}, users


def test_chain_ends_match_a_fresh_walk_in_any_order():
  by_id, users = _graph()
  for order in (list(range(10)), list(reversed(range(10))), [3, 0, 8, 4, 7, 9, 1, 6, 2, 5]):
    realizes: dict[int, str] = {6: "an output"}
    kernel_of = ChainEnds(realizes, users, by_id)
    assert [kernel_of(i) for i in order] == [_walk(i, realizes, users, by_id) for i in order]


def test_chain_ends_see_a_realization_added_between_questions():
  by_id, users = _graph()
  realizes: dict[int, str] = {6: "an output"}
  kernel_of = ChainEnds(realizes, users, by_id)
  assert kernel_of(0) == kernel_of(7) == 6   # both chains run through 5 into the SUM's kernel
  realizes[3] = "stored"   # ends the chain at 3: an answer kept from before would still say 6
  assert kernel_of(0) == 3 and kernel_of(2) == 3 and kernel_of(4) == 6 and kernel_of(7) == 6 and kernel_of(9) == 9
  assert [kernel_of(i) for i in range(10)] == [_walk(i, realizes, users, by_id) for i in range(10)]
