"""docs/debugging.md's table of environment variables names every variable the registry (helpers.ENV_VARS) holds,
once every module that declares one is imported: a variable added without its row fails here."""
import importlib
import pathlib
import pkgutil

import ourgrad
from ourgrad.helpers import ENV_VARS

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "debugging.md"


def _import_every_module() -> None:
  for module in pkgutil.walk_packages(ourgrad.__path__, "ourgrad."):
    try:
      importlib.import_module(module.name)
    except ImportError:  # a device whose package is absent (pyopencl, cuda-python) declares nothing we can check
      pass


def test_every_env_var_has_a_row_in_the_debugging_doc() -> None:
  _import_every_module()
  rows = {line.split("|")[1].strip().strip("`") for line in DOC.read_text().splitlines() if line.startswith("| `")}
  missing = sorted(name for name in ENV_VARS if name not in rows)
  assert not missing, f"docs/debugging.md has no row for {missing}"
