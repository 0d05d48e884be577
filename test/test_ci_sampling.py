""".ci/every_nth_case.py, the pytest plugin CI's OpenCL stage runs a sample of the op suites with: every test
function keeps its first case and every N-th after it, in collection order."""
from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

PLUGIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".ci", "every_nth_case.py")


def _plugin():
  spec = importlib.util.spec_from_file_location("every_nth_case", PLUGIN)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _item(file: str, function: str, case: str | None):
  name = function if case is None else f"{function}[{case}]"
  return SimpleNamespace(nodeid=f"{file}::{name}", name=name, originalname=function)


def _select(items: list, every: int, files: str = "") -> tuple[list, list]:
  deselected: list = []
  config = SimpleNamespace(getoption=lambda name: every if name == "--every-nth-case" else files,
                           hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
  kept = list(items)
  _plugin().pytest_collection_modifyitems(config, kept)
  return kept, deselected


def test_every_nth_case_keeps_each_functions_first_case_and_about_one_in_n():
  grid = [_item("test/a.py", "test_cast", f"{first}-{second}") for first in range(10) for second in range(10)]
  items = [_item("test/a.py", "test_one", None)] + grid + [_item("test/b.py", "test_cast", str(k)) for k in range(3)]
  kept, deselected = _select(items, 10)
  ids = [item.nodeid for item in kept]
  assert ids[:2] == ["test/a.py::test_one", "test/a.py::test_cast[0-0]"], "each function's first case"
  assert "test/b.py::test_cast[0]" in ids, "a function of the same name in another file is its own"
  assert sorted(ids + [item.nodeid for item in deselected]) == sorted(item.nodeid for item in items)
  chosen = [item.nodeid for item in kept if item in grid]
  assert 5 <= len(chosen) <= 20, chosen
  assert len({nodeid.split("[")[1].split("-")[1] for nodeid in chosen}) > 2, "not one column of the grid"
  assert [item.nodeid for item in _select(items, 10)[0]] == ids, "the same selection in every process"
  kept, _ = _select(items, 10, files="test/a.py")
  assert [item for item in kept if item.nodeid.startswith("test/b.py")] == items[-3:], "only the files named"


def test_every_nth_case_of_one_keeps_everything():
  items = [_item("test/a.py", "test_many", str(k)) for k in range(4)]
  config = SimpleNamespace(getoption=lambda name: 1 if name == "--every-nth-case" else "", hook=None)
  kept = list(items)
  _plugin().pytest_collection_modifyitems(config, kept)
  assert kept == items
