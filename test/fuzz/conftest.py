"""pytest collects the fuzzers (test/fuzz/fuzz_*.py) as test modules; they are scripts too (see fuzzing.py)."""
from __future__ import annotations

import pathlib

import pytest


def pytest_collect_file(file_path: pathlib.Path, parent: pytest.Collector) -> pytest.Module | None:
  # a path named on the command line is collected by pytest itself already, whatever its name
  if file_path.suffix == ".py" and file_path.name.startswith("fuzz_") and not parent.session.isinitpath(file_path):
    return pytest.Module.from_parent(parent, path=file_path)
  return None
