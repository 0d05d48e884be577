"""A pytest plugin for CI's stages on slow devices: `-p every_nth_case --every-nth-case N` keeps, of each test
function's parametrized cases, the first and about one in N of the others, and deselects the rest
(`--every-nth-case-in test/test_ops.py,...`: only in those files; the others run whole).

Every test function still runs (every op, every kind of kernel the suite builds), each over a spread of its
parameters (dtypes, axes, shapes). Which cases: those whose test id's CRC-32 is a multiple of N, a spread that no
grid of parameters lines up with (every N-th case of a 10 x 10 grid of dtype pairs, N=10, would cast every dtype to
the first one only). Deterministic (not Python's salted hash): pytest-xdist's workers select alike, and a run
selects what the last one did. Load it with `.ci` on PYTHONPATH (.ci/run does).
"""
from __future__ import annotations

import zlib

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
  parser.addoption("--every-nth-case", type=int, default=1, metavar="N",
                   help="of each test function's parametrized cases, run the first and ~1 in N (default 1: all)")
  parser.addoption("--every-nth-case-in", default="", metavar="FILES",
                   help="comma-separated test files (as in the test ids) --every-nth-case applies to (default: all)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
  every = config.getoption("--every-nth-case")
  if every <= 1: return
  files = {name for name in config.getoption("--every-nth-case-in").split(",") if name}
  seen: dict[tuple[str, str], int] = {}   # (file, function) -> how many of its cases came before
  kept, dropped = [], []
  for item in items:
    function = (item.nodeid.split("::", 1)[0], getattr(item, "originalname", item.name))
    position = seen.get(function, 0)
    seen[function] = position + 1
    chosen = position == 0 or (files and function[0] not in files) or zlib.crc32(item.nodeid.encode()) % every == 0
    (kept if chosen else dropped).append(item)
  if dropped:
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept
