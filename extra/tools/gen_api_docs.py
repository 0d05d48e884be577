"""Write docs/api.md from the public API's signatures and docstrings: `python extra/tools/gen_api_docs.py`.

The reference is generated so it never drifts from the code; edit the docstrings, then run this again.
"""
from __future__ import annotations

import inspect
import pathlib

import ourgrad
from ourgrad import Tensor, amp, nn
from ourgrad.nn import functional, init, losses, optim, state
from ourgrad.nn import utils as nn_utils
from ourgrad.optim import lr_scheduler
from ourgrad.utils import data

SECTIONS = [("ourgrad", ourgrad), ("Tensor", Tensor), ("ourgrad.nn (layers)", nn), ("ourgrad.nn.Module", nn.Module),
            ("ourgrad.nn.functional", functional),
            ("ourgrad.nn.losses", losses), ("ourgrad.nn.optim", optim), ("ourgrad.optim.lr_scheduler", lr_scheduler),
            ("ourgrad.nn.init", init), ("ourgrad.nn.utils", nn_utils), ("ourgrad.utils.data", data),
            ("ourgrad.nn.state", state), ("ourgrad.amp", amp)]


def first_paragraph(obj: object) -> str:
  doc = inspect.getdoc(obj) or ""
  return " ".join(doc.split("\n\n")[0].split())


def signature(obj: object) -> str:
  try:
    return str(inspect.signature(obj))
  except (TypeError, ValueError):
    return ""


def namespace(container: object) -> dict[str, object]:
  """A module's names, or a class's own and inherited attributes (Tensor's methods live in mixins): the class's
  own first, then each base's in MRO order, a name overridden lower down appearing once, as the override."""
  if inspect.ismodule(container): return dict(vars(container))
  found: dict[str, object] = {}
  for klass in inspect.getmro(container)[:-1]:  # not `object`
    for name, value in vars(klass).items(): found.setdefault(name, value)
  return found


def members(container: object) -> list[tuple[str, object]]:
  found = []
  for name, value in namespace(container).items():
    if name.startswith("_") and name not in ("__getitem__", "__setitem__"): continue
    if isinstance(value, (staticmethod, classmethod)): value = value.__func__
    # a module's own definitions, and what it re-exports on purpose (its __all__: nn.functional's names)
    exported = getattr(container, "__all__", ())
    if inspect.ismodule(container) and getattr(value, "__module__", None) != container.__name__ \
        and name not in exported: continue
    if callable(value) or isinstance(value, property): found.append((name, value))
  return found


def main() -> None:
  lines = ["# API reference", "",
           f"Generated from the docstrings of ourgrad {ourgrad.__version__} by `extra/tools/gen_api_docs.py`; "
           "every name behaves like its PyTorch namesake unless its line says otherwise.", ""]
  for title, container in SECTIONS:
    lines += [f"## {title}", "", "| name | signature | what it does |", "| --- | --- | --- |"]
    for name, value in members(container):
      target = value.fget if isinstance(value, property) else value
      text = first_paragraph(target).replace("|", "\\|")
      sig = "" if isinstance(value, property) else signature(target).replace("|", "\\|")
      lines.append(f"| `{name}` | `{sig}` | {text} |" if sig else f"| `{name}` | | {text} |")
    lines.append("")
  path = pathlib.Path(__file__).resolve().parents[2] / "docs" / "api.md"
  path.write_text("\n".join(lines))
  print(f"wrote {path} ({len(lines)} lines)")


if __name__ == "__main__":
  main()
