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


def test_every_nth_case_keeps_each_functions_first_and_every_nth_case():
  items = [_item("test/a.py", "test_one", None)] + [_item("test/a.py", "test_many", str(k)) for k in range(7)] + \
          [_item("test/b.py", "test_many", str(k)) for k in range(2)]   # the same name in another file: its own
  deselected = []
  config = SimpleNamespace(getoption=lambda name: 3,
                           hook=SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items)))
  kept = list(items)
  _plugin().pytest_collection_modifyitems(config, kept)
  assert [item.nodeid for item in kept] == ["test/a.py::test_one", "test/a.py::test_many[0]", "test/a.py::test_many[3]",
                                            "test/a.py::test_many[6]", "test/b.py::test_many[0]"]
  assert len(deselected) + len(kept) == len(items)


def test_every_nth_case_of_one_keeps_everything():
  items = [_item("test/a.py", "test_many", str(k)) for k in range(4)]
  config = SimpleNamespace(getoption=lambda name: 1, hook=None)
  kept = list(items)
  _plugin().pytest_collection_modifyitems(config, kept)
  assert kept == items
