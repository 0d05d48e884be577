"""GC_FREEZE_IMPORT: `import ourgrad` moves the objects alive at import to the collector's permanent generation (its
full passes scan them no more); GC_FREEZE_IMPORT=0 leaves the collector alone. Each case runs in a fresh interpreter,
so that the import is the first. GC_THRESHOLD: the import raises the first-generation threshold."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PROBE = ("import gc; before = gc.get_freeze_count(); import ourgrad; from ourgrad import Tensor; "
         "x = Tensor([1.0, 2.0]) * 3; "
         "print(before, gc.get_freeze_count(), len(gc.get_objects()), x.numpy().tolist())")


@pytest.mark.parametrize("setting", ["1", "0"])
def test_import_freezes_what_it_made_only_when_asked(setting: str) -> None:
  env = {**os.environ, "GC_FREEZE_IMPORT": setting, "PYTHONPATH": str(REPO_ROOT), "DEVICE": "PYTHON"}
  out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True,
                       cwd=REPO_ROOT)
  before, frozen, tracked, values = out.stdout.split(" ", 3)
  assert int(before) == 0
  assert values.strip() == "[3.0, 6.0]"
  if setting == "1":
    # the import's modules, functions and classes: thousands, far more than the objects left to scan
    assert int(frozen) > 5000 and int(frozen) > int(tracked)
  else:
    assert int(frozen) == 0


def test_garbage_from_before_the_import_is_still_collected() -> None:
  """A reference cycle dropped before `import ourgrad` is collected at the import, not frozen (and leaked)."""
  # (automatic collections off: the import's own allocations would otherwise collect the cycle by chance)
  probe = ("import gc, weakref\n"
           "gc.disable()\n"
           "class Node: pass\n"
           "a, b = Node(), Node(); a.other, b.other = b, a\n"
           "alive = weakref.ref(a); del a, b\n"
           "import ourgrad\n"
           "gc.collect(); print(alive() is None, gc.get_freeze_count() > 0)")
  env = {**os.environ, "GC_FREEZE_IMPORT": "1", "PYTHONPATH": str(REPO_ROOT), "DEVICE": "PYTHON"}
  out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True,
                       cwd=REPO_ROOT)
  assert out.stdout.split() == ["True", "True"]


@pytest.mark.parametrize("setting, preset, expected", [("10000", 700, 10000), ("0", 700, 700), ("5000", 20000, 20000)])
def test_import_raises_the_first_generation_threshold_only(setting: str, preset: int, expected: int) -> None:
  """GC_THRESHOLD: `import ourgrad` raises the collector's first threshold (never lowers one the program set, and
  leaves the other two); 0 leaves them alone. Garbage cycles are still collected."""
  probe = ("import gc, weakref\n"
           f"gc.set_threshold({preset}, 11, 12)\n"
           "import ourgrad\n"
           "class Node: pass\n"
           "a, b = Node(), Node(); a.other, b.other = b, a\n"
           "alive = weakref.ref(a); del a, b\n"
           "gc.collect(); print(*gc.get_threshold(), alive() is None)")
  env = {**os.environ, "GC_THRESHOLD": setting, "PYTHONPATH": str(REPO_ROOT), "DEVICE": "PYTHON"}
  out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True,
                       cwd=REPO_ROOT)
  assert out.stdout.split() == [str(expected), "11", "12", "True"]
