"""Seeing the graph and the time: GRAPH=1 (Graphviz files), PROFILE=1 / ourgrad.profile() (Chrome traces) and
DEBUG=6 (device assembly).

Graph files are checked by parsing the dot text (and, where Graphviz is installed, by Graphviz's own parser through
`dot -Tplain`); traces by loading the JSON and counting kernel events against GlobalCounters.
"""
from __future__ import annotations

import itertools
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest

import ourgrad
from ourgrad import GlobalCounters, Tensor
from ourgrad.device import Compiler, Device
from ourgrad.engine import graph_viz
from ourgrad.engine.profile import profiler
from ourgrad.engine.realize import get_runner, run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.ops import Ops

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")


# ---------------------------------------------------------------- dot parsing

def parse_dot(text: str) -> tuple[dict[str, str], list[tuple[str, str, str]]]:
  """({node: its attribute text}, [(src, dst, edge attribute text)]) of the dot files graph_viz writes."""
  nodes: dict[str, str] = {}
  edges: list[tuple[str, str, str]] = []
  for line in text.splitlines():
    edge = re.match(r"\s*(\w+) -> (\w+)\s*(\[.*\])?;$", line)
    if edge:
      edges.append((edge.group(1), edge.group(2), edge.group(3) or ""))
      continue
    node = re.match(r"\s*(\w+) (\[.*\]);$", line)
    if node and node.group(1) not in ("node", "edge", "graph"): nodes[node.group(1)] = node.group(2)
  return nodes, edges


def graphviz_counts(dot_path: pathlib.Path) -> tuple[int, int]:
  """(nodes, edges) as Graphviz itself reads the file."""
  plain = subprocess.run(["dot", "-Tplain", str(dot_path)], capture_output=True, text=True, check=True).stdout
  lines = plain.splitlines()
  return sum(line.startswith("node ") for line in lines), sum(line.startswith("edge ") for line in lines)


def known_graph() -> Tensor:
  """(a.reshape(2, 2) + b).sum(1) over two realized inputs. Its lazy graph, by construction:
  the output view (2,) of the SUM base (2, 1), the ADD base, the reshape view of `a`, and the realized bases a, b:
  6 nodes (2 of them views, 2 realized), 5 edges (SUM->out view, ADD->SUM, a view->ADD, b->ADD, a->a view)."""
  a = Tensor(np.arange(4, dtype=np.float32))
  b = Tensor(np.ones((2, 2), dtype=np.float32))
  return (a.reshape(2, 2) + b).sum(1)


@pytest.fixture
def graph_folder(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
  monkeypatch.setenv("GRAPH", "1")
  monkeypatch.setenv("GRAPH_DIR", str(tmp_path))
  return tmp_path


def only_file(folder: pathlib.Path, pattern: str) -> pathlib.Path:
  matches = sorted(folder.glob(pattern))
  assert len(matches) == 1, matches
  return matches[0]


# ---------------------------------------------------------------- GRAPH=1

def test_lazy_graph_nodes_edges_and_views(graph_folder: pathlib.Path) -> None:
  out = known_graph()
  np.testing.assert_allclose(out.numpy(), np.arange(4, dtype=np.float32).reshape(2, 2).sum(1) + 2)
  nodes, edges = parse_dot(only_file(graph_folder, "lazy_*.dot").read_text())
  assert len(nodes) == 6 and len(edges) == 5
  views = [name for name, attributes in nodes.items() if "VIEW" in attributes]
  assert len(views) == 2 and all("dashed" in nodes[name] for name in views)
  assert sum("realized" in attributes for attributes in nodes.values()) == 2
  assert sum("SUM" in attributes for attributes in nodes.values()) == 1
  # the edges into a view come from its base and are drawn dashed; every other edge is solid
  view_edges = [edge for edge in edges if edge[1] in views]
  assert len(view_edges) == 2 and all("dashed" in attributes for _, _, attributes in view_edges)
  # the reduce got the kernel: drawn bold, and it feeds the output view
  (sum_node,) = [name for name, attributes in nodes.items() if "SUM" in attributes]
  assert "bold" in nodes[sum_node] and any(src == sum_node and dst in views for src, dst, _ in edges)


def test_schedule_graph_has_one_node_per_item(graph_folder: pathlib.Path) -> None:
  x = Tensor(np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32))
  out = x.T - x.max(1)   # the max is read through a permute (not along its rows): its own kernel
  schedule = create_schedule([out.lazydata])
  nodes, edges = parse_dot(only_file(graph_folder, "schedule_*.dot").read_text())
  item_nodes = [name for name in nodes if name.startswith("k")]
  assert len(item_nodes) == len(schedule) == 2
  # an item -> item edge for each (earlier item, later item) pair where the later one reads what the earlier wrote
  expected_item_edges = sum(1 for later, item in enumerate(schedule) for buffer in set(map(id, item.inputs))
                            if any(buffer in map(id, earlier.outputs) for earlier in schedule[:later]))
  item_edges = [edge for edge in edges if edge[0].startswith("k")]
  assert len(item_edges) == expected_item_edges == 1
  for number, item in enumerate(schedule):   # the label names the kernel and its buffers
    label = nodes[f"k{number}"]
    assert graph_viz.kernel_name(item) in label and "writes" in label and "reads" in label
    assert get_runner(item.outputs[0].device, item.ast).name == graph_viz.kernel_name(item)
  run_schedule(schedule)
  np.testing.assert_allclose(out.numpy(), x.numpy().T - x.numpy().max(1))


@needs_dot
def test_graph_files_render_to_svg(graph_folder: pathlib.Path) -> None:
  known_graph().realize()
  for kind in ("lazy", "schedule"):
    dot_path = only_file(graph_folder, f"{kind}_*.dot")
    svg_path = dot_path.with_suffix(".svg")
    assert svg_path.exists() and "<svg" in svg_path.read_text()
    nodes, edges = parse_dot(dot_path.read_text())
    assert graphviz_counts(dot_path) == (len(nodes), len(edges))


def test_graph_files_never_overwrite_another_process(graph_folder: pathlib.Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
  """Two processes writing into one folder count from 1 each: a number already taken is skipped."""
  monkeypatch.setattr(graph_viz, "_graph_numbers", itertools.count(1))
  (graph_folder / "lazy_0001.dot").write_text("another process's graph")
  known_graph().realize()
  assert (graph_folder / "lazy_0001.dot").read_text() == "another process's graph"
  assert (graph_folder / "lazy_0002.dot").exists() and (graph_folder / "schedule_0002.dot").exists()
  assert not (graph_folder / "schedule_0001.dot").exists()


def test_graph_off_writes_nothing(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.delenv("GRAPH", raising=False)
  monkeypatch.setenv("GRAPH_DIR", str(tmp_path))
  known_graph().realize()
  assert list(tmp_path.iterdir()) == []


def test_copy_item_in_schedule_graph(graph_folder: pathlib.Path) -> None:
  if Device.DEFAULT == "PYTHON": pytest.skip("copies from the default device to PYTHON")
  moved = Tensor(np.arange(6, dtype=np.float32)).to("PYTHON")
  np.testing.assert_array_equal(moved.numpy(), np.arange(6, dtype=np.float32))
  nodes, _ = parse_dot(only_file(graph_folder, "schedule_*.dot").read_text())
  assert sum(f"copy {Device.DEFAULT} -> PYTHON" in attributes for attributes in nodes.values()) == 1


# ---------------------------------------------------------------- PROFILE=1 / ourgrad.profile()

def kernel_items_and_names(outs: list[Tensor]) -> tuple[list, list[str]]:
  schedule = create_schedule([out.lazydata for out in outs])
  names = [get_runner(item.outputs[0].device, item.ast).name for item in schedule if item.ast.op is not Ops.COPY]
  return schedule, names


def test_profile_records_one_event_per_kernel(tmp_path: pathlib.Path) -> None:
  x = Tensor(np.random.default_rng(1).standard_normal((9, 13)).astype(np.float32))
  out = (x @ x.T).softmax(-1)
  schedule, expected_names = kernel_items_and_names([out])
  trace_path = tmp_path / "trace.json"
  launched_before = GlobalCounters.kernel_count
  with ourgrad.profile(trace_path) as trace:
    run_schedule(schedule)
  launched = GlobalCounters.kernel_count - launched_before
  reference = np.exp(x.numpy() @ x.numpy().T - (x.numpy() @ x.numpy().T).max(-1, keepdims=True))
  np.testing.assert_allclose(out.numpy(), reference / reference.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
  events = json.loads(trace_path.read_text())["traceEvents"]
  kernels = [event for event in events if event["ph"] == "X" and event["cat"] == "kernel"]
  assert len(kernels) == launched == len(expected_names) and trace.path == trace_path
  assert [event["name"] for event in kernels] == expected_names
  assert all(event["dur"] > 0 and event["ts"] >= 0 and event["args"]["device"] == Device.DEFAULT for event in kernels)
  assert len(trace.kernel_events()) == launched


def test_profile_tracks_are_named_and_never_overlap(tmp_path: pathlib.Path) -> None:
  x = Tensor(np.random.default_rng(2).standard_normal((11, 17)).astype(np.float32))
  with ourgrad.profile(tmp_path / "trace.json"):
    ((x * 2).sum(0) + x.max()).realize()
    (x.exp().sum(1) - 3).realize()
  events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
  process_names = {event["pid"]: event["args"]["name"] for event in events if event["name"] == "process_name"}
  thread_names = {(event["pid"], event["tid"]): event["args"]["name"] for event in events
                  if event["name"] == "thread_name"}
  complete = [event for event in events if event["ph"] == "X"]
  assert {"host", Device.DEFAULT} <= set(process_names.values())
  assert all((event["pid"], event["tid"]) in thread_names for event in complete)
  # a host phase is on the host's thread of that phase; a kernel on its device's kernel thread
  for event in complete:
    device = event["args"]["device"]
    assert process_names[event["pid"]] == ("host" if device == "HOST" else device)
    assert thread_names[(event["pid"], event["tid"])] == event["cat"]
  assert {"schedule", "kernel"} <= {event["cat"] for event in complete}
  by_track: dict[tuple[int, int], list] = defaultdict(list)
  for event in complete:
    if event["args"]["device"] != "HOST": by_track[(event["pid"], event["tid"])].append(event)
  for track in by_track.values():
    track.sort(key=lambda event: event["ts"])
    for earlier, later in zip(track, track[1:]): assert earlier["ts"] + earlier["dur"] <= later["ts"] + 1e-3


def test_profile_records_compile_phases_of_new_kernels(tmp_path: pathlib.Path) -> None:
  x = Tensor(np.arange(29 * 31, dtype=np.float32).reshape(29, 31))   # a shape no other test compiles
  with ourgrad.profile(tmp_path / "trace.json") as trace:
    (x * 3 - 1).sum(1).realize()
  phases = {event["cat"] for event in trace.events}
  assert {"schedule", "codegen", "compile", "kernel"} <= phases
  (kernel,) = trace.kernel_events()
  assert any(event["cat"] == "codegen" and event["name"] == kernel["name"] for event in trace.events)


def test_profile_records_copies(tmp_path: pathlib.Path) -> None:
  if Device.DEFAULT == "PYTHON": pytest.skip("copies from the default device to PYTHON")
  with ourgrad.profile(tmp_path / "trace.json") as trace:
    moved = Tensor(np.arange(10, dtype=np.float32)).to("PYTHON").realize()
  copies = [event for event in trace.events if event["cat"] == "copy"]
  assert len(copies) == 1 and copies[0]["args"]["device"] == "PYTHON" and copies[0]["dur"] >= 0
  np.testing.assert_array_equal(moved.numpy(), np.arange(10, dtype=np.float32))


def test_nothing_recorded_outside_profile(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.delenv("PROFILE", raising=False)
  with ourgrad.profile(None):
    pass
  assert not profiler.active()
  before = len(profiler.events)
  (Tensor([1.0, 2.0]) * 5).realize()
  assert len(profiler.events) == before


def test_nested_profile_blocks(tmp_path: pathlib.Path) -> None:
  x = Tensor(np.ones((3, 5), dtype=np.float32))
  with ourgrad.profile(tmp_path / "outer.json") as outer:
    (x + 1).realize()
    with ourgrad.profile(tmp_path / "inner.json") as inner:
      (x * 7).sum().realize()
  assert len(inner.kernel_events()) == 1 and len(outer.kernel_events()) == 2


def run_script(code: str, **env: str) -> subprocess.CompletedProcess:
  environment = {**os.environ, **env}
  environment.pop("CHECK_CUDA_RENDER", None)   # the child's output is the subject: no extra compiles
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, env=environment,
                        timeout=300, check=True)


def test_profile_env_writes_trace_at_exit(tmp_path: pathlib.Path) -> None:
  trace_path = tmp_path / "env_trace.json"
  code = ("from ourgrad import Tensor, GlobalCounters\nx = Tensor([[1.0, 2.0], [3.0, 4.0]])\n"
          "(x @ x).relu().sum().realize()\nprint('kernels', GlobalCounters.kernel_count)")
  result = run_script(code, PROFILE="1", PROFILE_PATH=str(trace_path))
  launched = int(re.search(r"kernels (\d+)", result.stdout).group(1))
  assert str(trace_path) in result.stdout
  events = json.loads(trace_path.read_text())["traceEvents"]
  assert sum(event.get("cat") == "kernel" for event in events) == launched > 0


# ---------------------------------------------------------------- DEBUG=6

ELEMENTWISE_SCRIPT = "from ourgrad import Tensor\n(Tensor([1.0, 2.0, 3.0, 4.0, 5.0]) * 3 + 1).realize()\n"


@pytest.mark.parametrize("device", ["CLANG", "LLVM"])
def test_debug6_prints_host_assembly(device: str, tmp_path: pathlib.Path) -> None:
  if device == "LLVM": pytest.importorskip("llvmlite")
  result = run_script(ELEMENTWISE_SCRIPT, DEBUG="6", DEVICE=device, OURGRAD_CACHE_DIR=str(tmp_path))
  kernel_name = re.search(r"void (E_\w+)\(|define void @(E_\w+)\(", result.stdout)
  assert kernel_name, result.stdout
  name = kernel_name.group(1) or kernel_name.group(2)
  # assembler directives and the kernel's label: the function's machine code, not its source
  assert re.search(rf"^\s*\.globl\s+{name}\s*$", result.stdout, re.MULTILINE), result.stdout
  assert re.search(rf"^{name}:", result.stdout, re.MULTILINE), result.stdout
  assert re.search(r"^\s+ret", result.stdout, re.MULTILINE), result.stdout


def test_debug5_prints_no_assembly(tmp_path: pathlib.Path) -> None:
  result = run_script(ELEMENTWISE_SCRIPT, DEBUG="5", DEVICE="CLANG", OURGRAD_CACHE_DIR=str(tmp_path))
  assert ".globl" not in result.stdout and "void E_" in result.stdout


def test_cuda_disassembly_is_ptx() -> None:
  pytest.importorskip("cuda.bindings")
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.codegen.linearizer import linearize
  from ourgrad.renderer.cuda import CUDARenderer
  from ourgrad.runtime.ops_cuda import CUDACompiler
  item = create_schedule([(Tensor(np.ones(64, dtype=np.float32)) * 2).lazydata])[-1]
  kernel = Kernel(item.ast, CUDARenderer())
  kernel.hand_coded_optimizations()
  source = CUDARenderer().render(kernel.name, linearize(kernel))
  assembly = CUDACompiler("sm_90").disassemble(source)
  assert f".entry {kernel.name}" in assembly and ".target sm_90" in assembly
  assert "st.global" in assembly


def test_opencl_binary_description() -> None:
  pytest.importorskip("pyopencl")
  from ourgrad.runtime.ops_opencl import describe_program_binary
  ptx_like = b"//\n.version 8.0\n.target sm_90\n.entry E_4(\n)\n{ ret; }\n\x00"
  assert describe_program_binary(ptx_like).startswith("//\n.version 8.0")
  note = describe_program_binary(b"BC\xc0\xde\x35\x14\x00\x00\x05\x00")
  assert "not text" in note and "10 bytes" in note


def test_compiler_without_disassembler_says_so() -> None:
  assert "no disassembler" in Compiler().disassemble("void k() {}")


# ---------------------------------------------------------------- the trace drawing tool and the docs' pictures

def test_trace_to_svg_draws_one_bar_per_event(tmp_path: pathlib.Path) -> None:
  sys.path.insert(0, str(REPO_ROOT / "extra" / "tools"))
  try:
    from trace_to_svg import load_events, render_svg
  finally:
    sys.path.pop(0)
  x = Tensor(np.ones((6, 10), dtype=np.float32))
  with ourgrad.profile(tmp_path / "trace.json") as trace:
    (x.sum(1) * 4).realize()
    (x - 1).realize()
  events, rows = load_events(tmp_path / "trace.json")
  svg = render_svg(events, rows, width=800)
  assert len(events) == len([event for event in trace.events if event["ph"] == "X"])
  assert svg.count("<title>") == len(events) and svg.startswith("<svg")
  for kernel in trace.kernel_events(): assert kernel["name"] in svg
  assert all(name in svg for name in set(rows.values()))


def test_debugging_doc_pictures_exist() -> None:
  doc = (REPO_ROOT / "docs" / "debugging.md").read_text()
  pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", doc)
  assert len(pictures) >= 3
  for picture in pictures:
    path = REPO_ROOT / "docs" / picture
    assert path.exists() and path.read_text().lstrip().startswith(("<svg", "<?xml")), picture
