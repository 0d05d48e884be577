"""GRAPH=1: draw the lazy graph and the schedule of each realize as Graphviz files.

`capture_lazy_graph(outs)` snapshots the LazyBuffer graph when scheduling starts (the scheduler cuts the sources of
the bases it realizes, so the graph must be read first); `write_graphs(snapshot, schedule)` then writes two files
into `graph_dir()`, with the next number that no file in the folder has yet:

  lazy_NNNN.dot      one node per LazyBuffer: bases (op, shape, dtype, device; grey when already realized, bold when
                     this schedule gives them a kernel) and views (dashed, with their ShapeTracker); edges src -> dst
  schedule_NNNN.dot  one node per ScheduleItem (kernel name or copy, the buffers it writes and reads); an edge from
                     the item that writes a buffer to each item that reads it, and from input buffers made earlier

Each .dot is rendered to .svg when Graphviz's `dot` is on PATH.
"""
from __future__ import annotations

import itertools
import pathlib
import shutil
import subprocess
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from ourgrad.codegen.lowering import build_kernel
from ourgrad.device import Buffer, Device
from ourgrad.helpers import GRAPH_DIR
from ourgrad.lazy import LazyBuffer
from ourgrad.ops import ELEMENTWISE_OPS, REDUCE_OPS, Ops

if TYPE_CHECKING:  # schedule.py calls this module: only the type is needed here
  from ourgrad.engine.schedule import ScheduleItem

# fill colors of base nodes by what their op is
OP_COLORS = {"reduce": "#f4a582", "elementwise": "#d1e5f0", "copy": "#fee08b", "const": "#d9f0d3",
             "realized": "#d9d9d9", "other": "#e7d4e8"}

_graph_numbers = itertools.count(1)
_announced_folder: pathlib.Path | None = None


@dataclass
class LazyGraphSnapshot:
  """The LazyBuffers reachable from a schedule's outputs and the edges between them, read before scheduling."""
  nodes: list[LazyBuffer] = field(default_factory=list)
  edges: list[tuple[int, int, bool]] = field(default_factory=list)   # (src node, dst node, dst is a view of src)
  realized_before: set[int] = field(default_factory=set)              # node numbers of bases realized already
  outputs: set[int] = field(default_factory=set)                      # node numbers of the requested outputs


def capture_lazy_graph(outs: Sequence[LazyBuffer]) -> LazyGraphSnapshot:
  """Every LazyBuffer reachable from `outs` (explicit stack), stopping at realized bases. A view and its base are
  two nodes joined by a view edge; a base is joined to each of its sources."""
  snapshot = LazyGraphSnapshot()
  number: dict[int, int] = {}

  def node_number(lazy: LazyBuffer) -> tuple[int, bool]:
    """(node number, whether it is new)."""
    if id(lazy) in number: return number[id(lazy)], False
    number[id(lazy)] = len(snapshot.nodes)
    snapshot.nodes.append(lazy)
    return number[id(lazy)], True

  stack: list[LazyBuffer] = []
  for out in outs:
    index, is_new = node_number(out)
    snapshot.outputs.add(index)
    if is_new: stack.append(out)
  while stack:
    lazy = stack.pop()
    index = number[id(lazy)]
    if not lazy.is_base:
      sources, view_edge = [lazy.base], True
    elif lazy.realized is not None:
      snapshot.realized_before.add(index)
      sources, view_edge = [], False
    else:
      sources, view_edge = list(lazy.srcs), False
    for src in sources:
      src_index, is_new = node_number(src)
      snapshot.edges.append((src_index, index, view_edge))
      if is_new: stack.append(src)
  return snapshot


# ---------------------------------------------------------------- dot text

def _quote(text: str) -> str:
  """A dot string literal; newlines become dot's centered line breaks."""
  return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _attributes(**attributes: str) -> str:
  return "[" + ", ".join(f"{key}={_quote(value)}" for key, value in attributes.items()) + "]"


def _op_kind(lazy: LazyBuffer, realized: bool) -> str:
  if realized: return "realized"
  if lazy.op in REDUCE_OPS: return "reduce"
  if lazy.op in ELEMENTWISE_OPS: return "elementwise"
  if lazy.op is Ops.COPY: return "copy"
  if lazy.op is Ops.CONST: return "const"
  return "other"


def _view_text(lazy: LazyBuffer) -> str:
  lines = []
  for view in lazy.st.views:
    mask = f" mask={view.mask}" if view.mask is not None else ""
    lines.append(f"strides={view.strides} offset={view.offset}{mask}")
  return "\n".join(lines)


def lazy_graph_dot(snapshot: LazyGraphSnapshot) -> str:
  """The snapshot as a dot digraph. Read after scheduling, a base that now has a buffer but had none before got a
  kernel (or copy) in this schedule: it is drawn bold."""
  lines = ["digraph lazy_graph {", "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];']
  for index, lazy in enumerate(snapshot.nodes):
    if not lazy.is_base:
      label = f"VIEW {lazy.shape}\n{_view_text(lazy)}"
      attributes = {"shape": "box", "style": "dashed,rounded", "label": label}
    else:
      realized_before = index in snapshot.realized_before
      op_name = lazy.op.name if lazy.op is not None else "?"
      arg = f" {lazy.arg}" if lazy.op in REDUCE_OPS or lazy.op is Ops.CONST else ""
      state = "realized" if realized_before else ("-> kernel" if lazy.realized is not None else "fused")
      label = f"{op_name}{arg}\n{lazy.shape} {lazy.dtype.name}\n{lazy.device}\n{state}"
      style = "filled,bold" if (lazy.realized is not None and not realized_before) else "filled"
      attributes = {"shape": "box", "style": style, "fillcolor": OP_COLORS[_op_kind(lazy, realized_before)],
                    "label": label}
    if index in snapshot.outputs: attributes["peripheries"] = "2"
    lines.append(f"  n{index} {_attributes(**attributes)};")
  for src, dst, view_edge in snapshot.edges:
    lines.append(f"  n{src} -> n{dst}" + (' [style="dashed"]' if view_edge else "") + ";")
  lines.append("}")
  return "\n".join(lines) + "\n"


def kernel_name(item: ScheduleItem) -> str:
  """The name a kernel item runs under: its kernel with the default optimizations, as engine/realize.py builds it
  (the optimizations split axes, so they change the name)."""
  if item.ast.op is Ops.COPY: return f"copy {item.inputs[0].device} -> {item.outputs[0].device}"
  return build_kernel(item.ast, Device[item.outputs[0].device].renderer).name


def schedule_dot(schedule: Sequence[ScheduleItem]) -> str:
  """The schedule as a dot digraph: items in run order, buffers named b0, b1, ... by first appearance."""
  buffer_names: dict[int, str] = {}

  def name_of(buffer: Buffer) -> str:
    return buffer_names.setdefault(id(buffer), f"b{len(buffer_names)}")

  def describe(buffer: Buffer) -> str: return f"{name_of(buffer)} {buffer.dtype.name}[{buffer.size}]"

  lines = ["digraph schedule {", "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];',
           '  edge [fontname="monospace", fontsize=9];']
  writer: dict[int, int] = {}          # id(Buffer) -> the item that last wrote it
  drawn_inputs: set[int] = set()
  for number, item in enumerate(schedule):
    label = (f"{number}: {kernel_name(item)}\nwrites {', '.join(describe(buffer) for buffer in item.outputs)}\n"
             f"reads {', '.join(describe(buffer) for buffer in item.inputs) or '-'}")
    has_reduce = any(node.op in REDUCE_OPS for node in item.ast.walk())
    color = OP_COLORS["copy" if item.ast.op is Ops.COPY else "reduce" if has_reduce else "elementwise"]
    lines.append(f"  k{number} {_attributes(shape='box', style='filled', fillcolor=color, label=label)};")
    for buffer in dict.fromkeys(item.inputs):   # a buffer read twice is one edge
      if id(buffer) in writer:
        lines.append(f"  k{writer[id(buffer)]} -> k{number} {_attributes(label=name_of(buffer))};")
        continue
      if id(buffer) not in drawn_inputs:
        drawn_inputs.add(id(buffer))
        attributes = _attributes(shape="ellipse", style="filled", fillcolor=OP_COLORS["realized"],
                                 label=f"{describe(buffer)}\n{buffer.device}")
        lines.append(f"  {name_of(buffer)} {attributes};")
      lines.append(f"  {name_of(buffer)} -> k{number};")
    for buffer in item.outputs: writer[id(buffer)] = number
  lines.append("}")
  return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- files

def graph_dir() -> pathlib.Path:
  """The folder GRAPH=1 writes into (GRAPH_DIR, default <temp>/ourgrad_graph); its path is printed once."""
  global _announced_folder
  folder = pathlib.Path(GRAPH_DIR.value) if GRAPH_DIR.value else pathlib.Path(tempfile.gettempdir()) / "ourgrad_graph"
  folder.mkdir(parents=True, exist_ok=True)
  if _announced_folder != folder:
    print(f"GRAPH=1: writing the lazy graph and schedule of each realize to {folder}")
    _announced_folder = folder
  return folder


def render_svg(dot_path: pathlib.Path) -> pathlib.Path | None:
  """dot_path rendered to an .svg beside it with Graphviz; None when `dot` is not installed or fails."""
  dot = shutil.which("dot")
  if dot is None: return None
  svg_path = dot_path.with_suffix(".svg")
  result = subprocess.run([dot, "-Tsvg", str(dot_path), "-o", str(svg_path)], capture_output=True, text=True)
  if result.returncode != 0:
    warnings.warn(f"Graphviz could not render {dot_path}: {result.stderr.strip()}", RuntimeWarning, stacklevel=2)
    return None
  return svg_path


def write_graphs(snapshot: LazyGraphSnapshot, schedule: Sequence[ScheduleItem]) -> tuple[pathlib.Path, pathlib.Path]:
  """Write (and render) lazy_NNNN.dot and schedule_NNNN.dot; returns the two .dot paths."""
  folder = graph_dir()
  lazy_path, number = _reserve(folder)
  schedule_path = folder / f"schedule_{number:04d}.dot"
  lazy_path.write_text(lazy_graph_dot(snapshot))
  schedule_path.write_text(schedule_dot(schedule))
  for path in (lazy_path, schedule_path): render_svg(path)
  return lazy_path, schedule_path


def _reserve(folder: pathlib.Path) -> tuple[pathlib.Path, int]:
  """Create the next free lazy_NNNN.dot. Creating it exclusively makes the number this process's own: several
  processes (test workers, data loaders) can share one folder, and earlier runs' files are kept."""
  while True:
    number = next(_graph_numbers)
    path = folder / f"lazy_{number:04d}.dot"
    try:
      path.open("x").close()
    except FileExistsError:
      continue
    return path, number
