"""Transparent capture (engine/capture.py): a cached schedule realized again and again runs as one graph, with results
identical to launching item by item (EAGER_CAPTURE=0) and to numpy, whichever buffers, constants and scalars change
between calls; DEBUG=2 says why a schedule is not captured. On the CPU the graph is a HostGraph; the device-graph path
(a CUDA graph on CUDA) is checked with a fake graph class that records what the driver would be told."""
from __future__ import annotations

import numpy as np
import pytest

from ourgrad import Device, GlobalCounters, Tensor
from ourgrad.device import Buffer
from ourgrad.engine import capture, schedule_cache
from ourgrad.shape.symbolic import Variable
from test_jit import _make_training


# devices whose kernels a schedule can be captured for: a device graph (CUDA) or host kernels (CLANG, LLVM)
CAPTURES = getattr(Device[Device.DEFAULT], "graph", None) is not None or Device.DEFAULT in ("CLANG", "LLVM")
needs_capture = pytest.mark.skipif(not CAPTURES,
                                   reason=f"{Device.DEFAULT} captures nothing (no device graph, no host kernels)")


@pytest.fixture(autouse=True)
def plain_environment(monkeypatch):
  # capture runs only while DEBUG < 2 and PROFILE is off: start from neither set, capture on
  monkeypatch.delenv("DEBUG", raising=False)
  monkeypatch.delenv("PROFILE", raising=False)
  monkeypatch.delenv("EAGER_CAPTURE", raising=False)


# small graphs over three inputs and a Python scalar, each as (ourgrad, numpy): several kernels each
def _graph_a(x, y, z, scalar): return (x * scalar + y).exp2().contiguous().sum(1, keepdim=True) - z
def _numpy_a(x, y, z, scalar): return np.exp2(x * scalar + y).sum(1, keepdims=True) - z
def _graph_b(x, y, z, scalar): return ((x - x.max(1, keepdim=True)).relu() * y).contiguous() + z.sum(0) * scalar
def _numpy_b(x, y, z, scalar): return np.maximum(x - x.max(1, keepdims=True), 0) * y + z.sum(0) * scalar


GRAPHS = [(_graph_a, _numpy_a), (_graph_b, _numpy_b)]


@pytest.mark.parametrize("seed", range(4))
def test_values_are_identical_with_capture_on_and_off(seed, monkeypatch):
  """Repeated realizes of random graphs: inputs swapped for new buffers, written in place (assign), scalars changed
  (another schedule), results kept alive (later calls write other memory) between calls; each result matches numpy,
  a kept result never changes, and the outputs of capture on and off are bitwise equal."""
  rng = np.random.default_rng(seed)
  # per call: (graph, scalar, input change: none, new buffer, assign; whether the result is kept alive)
  plan = [(int(rng.integers(len(GRAPHS))), float(rng.choice([0.5, 1.5])), int(rng.integers(3)),
           bool(rng.random() < 0.3)) for _ in range(14)]
  arrays = [rng.standard_normal((4, 6)).astype(np.float32) for _ in range(3 * len(plan))]
  results = {}
  for setting in ("0", "2"):
    monkeypatch.setenv("EAGER_CAPTURE", setting)
    schedule_cache._cache.clear()
    launches = capture.stats.graph_launches
    inputs = [Tensor(array).realize() for array in arrays[:3]]
    outputs, kept = [], []
    for call, (graph, scalar, change, keep) in enumerate(plan):
      if change == 1: inputs[call % 3] = Tensor(arrays[3 * call]).realize()       # a new buffer
      if change == 2: inputs[call % 3].assign(Tensor(arrays[3 * call + 1])).realize()  # the same buffer, new values
      expected = GRAPHS[graph][1](*[tensor.numpy() for tensor in inputs], np.float32(scalar))
      result = GRAPHS[graph][0](*inputs, scalar)
      got = result.numpy()
      if keep: kept.append((result, got))   # held: the next calls' outputs get other memory
      np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=f"call {call}, capture {setting}")
      outputs.append(got.tobytes())
    for result, got in kept: assert result.numpy().tobytes() == got.tobytes()   # never overwritten by a later call
    results[setting] = outputs
    if setting == "0": assert capture.stats.graph_launches == launches
    elif CAPTURES: assert capture.stats.graph_launches > launches
  assert results["0"] == results["2"]


@needs_capture
def test_training_steps_are_identical_and_captured(monkeypatch):
  rng = np.random.default_rng(1)
  batches = [(rng.standard_normal((8, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(7)]
  results = {}
  for setting in ("0", "2"):
    monkeypatch.setenv("EAGER_CAPTURE", setting)
    model, step = _make_training(3)
    launches = capture.stats.graph_launches
    losses = [step(Tensor(images), Tensor(labels)).numpy().tobytes() for images, labels in batches]
    results[setting] = (losses, [model.fc.weight.numpy().tobytes(), model.bn.running_var.numpy().tobytes()])
    if setting == "2": assert capture.stats.graph_launches - launches >= 3
  assert results["0"] == results["2"]


@needs_capture
def test_a_captured_realize_counts_like_item_by_item(monkeypatch):
  x = Tensor.randn(8, 8).realize()
  counts = {}
  for setting in ("0", "2"):
    monkeypatch.setenv("EAGER_CAPTURE", setting)
    schedule_cache._cache.clear()
    for _ in range(5): (x.exp2().contiguous().sum(0) + 1).realize()
    GlobalCounters.reset()
    launches = capture.stats.graph_launches
    (x.exp2().contiguous().sum(0) + 1).realize()
    counts[setting] = (GlobalCounters.kernel_count, GlobalCounters.global_ops, GlobalCounters.global_mem)
    assert capture.stats.graph_launches - launches == (setting == "2")
  assert counts["0"] == counts["2"] and counts["0"][0] == 2


def _explanations(capsys) -> list[str]:
  return [line for line in capsys.readouterr().out.splitlines() if line.startswith("capture:")]


@needs_capture
def test_debug_2_says_why_a_schedule_is_not_captured(monkeypatch, capsys):
  x = Tensor.randn(8, 8).realize()
  n = Variable("n", 1, 8)
  for _ in range(3):   # replays (cached), then DEBUG=2
    (x.to("PYTHON").exp2().contiguous() + 1).realize()
    (x.shrink(((0, n.bind(3)), None)).exp2().contiguous() + 1).realize()
  monkeypatch.setenv("DEBUG", "2")
  capsys.readouterr()
  (x.to("PYTHON").exp2().contiguous() + 1).realize()
  assert any(f"a copy {x.device} -> PYTHON" in line for line in _explanations(capsys))
  (x.shrink(((0, n.bind(3)), None)).exp2().contiguous() + 1).realize()
  assert any("symbolic shapes" in line for line in _explanations(capsys))
  (x.exp2().contiguous() + 1).realize()
  (x.exp2().contiguous() + 1).realize()
  assert any("DEBUG >= 2" in line for line in _explanations(capsys))


@pytest.mark.skipif(Device.DEFAULT not in ("CLANG", "LLVM"), reason="host capture is for host devices")
def test_host_capture_follows_the_setting_of_each_realize(monkeypatch, capsys):
  """A schedule replayed on a host device while EAGER_CAPTURE=1 (not captured, DEBUG=2 says why) is captured once the
  setting is 2, and launched item by item again at 1: the setting is no lasting part of the schedule's capture
  state (it was: a schedule first seen at 1 was never captured in the process). Values against numpy throughout."""
  values = np.random.default_rng(5).standard_normal((4, 6)).astype(np.float32)
  x = Tensor(values).realize()

  def step() -> np.ndarray: return ((x * 1.5).exp2().contiguous().sum(1) - 0.5).numpy()
  expected = np.exp2(values * np.float32(1.5)).sum(1) - np.float32(0.5)
  monkeypatch.setenv("EAGER_CAPTURE", "1")
  launches = capture.stats.graph_launches
  for _ in range(5): np.testing.assert_allclose(step(), expected, rtol=1e-5)
  assert capture.stats.graph_launches == launches
  monkeypatch.setenv("DEBUG", "2")
  capsys.readouterr()
  step()
  assert any("runs host kernels" in line for line in _explanations(capsys))
  monkeypatch.delenv("DEBUG")
  monkeypatch.setenv("EAGER_CAPTURE", "2")
  for _ in range(5): np.testing.assert_allclose(step(), expected, rtol=1e-5)
  assert capture.stats.graph_launches - launches >= 2
  monkeypatch.setenv("EAGER_CAPTURE", "1")
  launches = capture.stats.graph_launches
  for _ in range(3): np.testing.assert_allclose(step(), expected, rtol=1e-5)
  assert capture.stats.graph_launches == launches


class FakeDeviceGraph:
  """A device graph as CUDAGraph's interface gives it (launches; set_argument; launch), running each kernel through
  its host program on the handles its nodes hold: what a driver would run."""
  built: list[FakeDeviceGraph] = []

  def __init__(self, launches):
    self.nodes = [(program, list(handles)) for program, _, _, handles, _ in launches]
    self.updates: list[tuple[int, int]] = []
    FakeDeviceGraph.built.append(self)

  def set_argument(self, index, position, handle):
    self.nodes[index][1][position] = handle
    self.updates.append((index, position))

  def launch(self):
    for program, handles in self.nodes: program(*handles)


def test_a_device_graph_is_told_only_the_arguments_that_changed(monkeypatch):
  """With the allocator's stable order, a repeated step's fresh buffers land on the memory of the step before: the
  device graph's nodes need updates only for the buffers that really changed (a new input)."""
  monkeypatch.setattr(Device["CLANG"], "graph", FakeDeviceGraph, raising=False)
  FakeDeviceGraph.built.clear()
  rng = np.random.default_rng(2)
  # (6, 5): no buffer of the step but x has x's size
  weight = Tensor(rng.standard_normal((6, 5)).astype(np.float32), device="CLANG").realize()
  schedule_cache._cache.clear()
  for call in range(8):
    data = rng.standard_normal((4, 6)).astype(np.float32)
    x = Tensor(data, device="CLANG").realize()   # a new buffer each call, allocated while the last one lives
    got = ((x @ weight).relu().contiguous().sum(1) * 2).numpy()
    np.testing.assert_allclose(got, np.maximum(data @ weight.numpy(), 0).sum(1) * 2, rtol=1e-5, atol=1e-5)
    if call == 5: FakeDeviceGraph.built[-1].updates.clear()
  # (two more graphs at most: built for the buffers of calls that moved most items, never found again)
  assert len(FakeDeviceGraph.built) <= 3
  graph = FakeDeviceGraph.built[-1]
  # the last two calls: only the input x (read by the first kernel) moved
  x_position = next(position for position, handle in enumerate(graph.nodes[0][1])
                    if handle is x.lazydata.base.realized.handle)
  assert graph.updates and set(graph.updates) == {(0, x_position)}


def test_a_device_graph_with_stable_handles_is_told_nothing_until_a_buffer_moves(monkeypatch):
  """CUDA's planned buffers run on their backing's very handle, so a replay that brings the same memory finds every
  node's arguments in place (capture._rebind's per-item identity check) and updates none; a buffer that gets other
  memory between calls (released and written again: a new handle on the same Buffer) is updated, and the values
  follow it."""
  monkeypatch.setattr(Device["CLANG"], "graph", FakeDeviceGraph, raising=False)
  # as CUDA's allocator: a planned buffer's handle is its backing's own object (CLANG's is a new view of it)
  monkeypatch.setattr(Device["CLANG"].allocator, "shared_handle", lambda handle, nbytes: handle)
  FakeDeviceGraph.built.clear()
  rng = np.random.default_rng(4)
  x = Tensor(rng.standard_normal((4, 6)).astype(np.float32), device="CLANG").realize()
  weight = Tensor(rng.standard_normal((6, 5)).astype(np.float32), device="CLANG").realize()
  schedule_cache._cache.clear()

  def step() -> np.ndarray: return (((x @ weight).relu() + 1).contiguous().exp2().sum(1) * 2).numpy()
  for _ in range(5): step()
  assert len(FakeDeviceGraph.built) <= 3   # (see test_a_device_graph_is_told_only_the_arguments_that_changed)
  graph = FakeDeviceGraph.built[-1]
  graph.updates.clear()
  for _ in range(3): step()
  assert graph.updates == []
  data = rng.standard_normal((4, 6)).astype(np.float32)
  buffer = x.lazydata.base.realized
  buffer.release_memory()
  holder = Buffer("CLANG", buffer.size, buffer.dtype).allocate()   # takes x's old memory: x gets other memory
  buffer.copyin(memoryview(data))
  assert buffer.handle is not holder.handle
  got = step()
  np.testing.assert_allclose(got, np.exp2(np.maximum(data @ weight.numpy(), 0) + 1).sum(1) * 2, rtol=1e-5, atol=1e-5)
  reads_x = {(index, position) for index, (_, handles) in enumerate(graph.nodes) for position, handle in
             enumerate(handles) if handle is buffer.handle}
  assert reads_x and set(graph.updates) == reads_x


@pytest.mark.parametrize("blocks", [3, capture.GRAPHS_PER_SCHEDULE + 2])
def test_blocks_with_their_own_weights_keep_a_device_graph_each(monkeypatch, blocks):
  """The blocks of a model realized one by one (each with its own weights) replay one schedule: each block gets a
  graph of its own, bound to its weights, so that a warm call writes no node's arguments; past GRAPHS_PER_SCHEDULE
  the rest share one graph that is rebound. Every value is numpy's either way."""
  monkeypatch.setattr(Device["CLANG"], "graph", FakeDeviceGraph, raising=False)
  monkeypatch.setattr(Device["CLANG"].allocator, "shared_handle", lambda handle, nbytes: handle)   # (as CUDA's)
  FakeDeviceGraph.built.clear()
  rng = np.random.default_rng(5)
  weights = [(Tensor(rng.standard_normal((6, 6)).astype(np.float32), device="CLANG").realize(),
              Tensor(rng.standard_normal(6).astype(np.float32), device="CLANG").realize()) for _ in range(blocks)]
  x = Tensor(rng.standard_normal((4, 6)).astype(np.float32), device="CLANG").realize()
  schedule_cache._cache.clear()

  def forward() -> np.ndarray:
    h, expected = x, x.numpy()
    for w, b in weights:
      h = ((h @ w + b).relu().contiguous() @ w * 0.5).realize()   # (two kernels: a schedule of one is not captured)
      expected = np.maximum(expected @ w.numpy() + b.numpy(), 0) @ w.numpy() * 0.5
    np.testing.assert_allclose(h.numpy(), expected, rtol=1e-4, atol=1e-5)
    return h.numpy()
  for _ in range(6): forward()   # (graphs are built as parked ones are found again: a few calls)
  graphs = len(FakeDeviceGraph.built)
  cached = [*schedule_cache._cache.values(), *schedule_cache._traced.values()]
  states = [entry.lowerings[0].capture for entry in cached if entry.lowerings and entry.lowerings[0].capture]
  assert graphs > 0 and all(len(state.parked) + 1 <= capture.GRAPHS_PER_SCHEDULE for state in states)
  for graph in FakeDeviceGraph.built: graph.updates.clear()
  forward()
  updates = sum(len(graph.updates) for graph in FakeDeviceGraph.built)
  # warm: fewer blocks than the bound each find their own graph (past it, the rest rebind one: values checked above)
  if blocks < capture.GRAPHS_PER_SCHEDULE: assert len(FakeDeviceGraph.built) == graphs and updates == 0


@needs_capture
def test_calls_with_copy_on_write_snapshots_run_item_by_item_and_stay_right(monkeypatch):
  """Two in-place updates realized together, again and again; in some calls a lazy reader of the old values is alive,
  so that call's schedule adds snapshot copies (items the cache does not keep): it runs item by item, the others as
  the captured graph, and every value is numpy's."""
  monkeypatch.setenv("EAGER_CAPTURE", "2")   # host devices too
  rng = np.random.default_rng(11)
  a_values, b_values = rng.standard_normal(16).astype(np.float32), rng.standard_normal(16).astype(np.float32)
  a, b = Tensor(a_values).realize(), Tensor(b_values).realize()
  launches = capture.stats.graph_launches
  for call in range(10):
    reader = a * 3 if call % 3 == 2 else None
    Tensor.realize_all(a.assign(a + b), b.assign(b * 0.5 + 1))
    if reader is not None: np.testing.assert_allclose(reader.numpy(), a_values * 3, rtol=1e-6)
    a_values, b_values = a_values + b_values, b_values * np.float32(0.5) + 1
    np.testing.assert_allclose(a.numpy(), a_values, rtol=1e-6)
    np.testing.assert_allclose(b.numpy(), b_values, rtol=1e-6)
  assert capture.stats.graph_launches > launches
