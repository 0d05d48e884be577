"""Programmatic dependent launch (sm_90): the CUDA renderer's kernel prologue (griddepcontrol.wait) and the TinyJit
graph's programmatic edges (runtime/ops_cuda.CUDAGraph).

Without a GPU: the rendered sources (sm_90 has the prologue as the first lines of every kernel body, the wgmma kernel
included; sm_80 has none), NVRTC compiles them, and CUDAGraph wires its nodes with programmatic edges only when the
renderer writes the prologue, each edge's port as CUDA_DEPENDENT_LAUNCH's mode and CUDARenderer.early_launches say
(the driver's graph calls replaced by fakes that record them), and that rule's decisions from given device facts. On
a GPU: a jitted chain of dependent kernels gives numpy's results in every mode."""
from __future__ import annotations

import numpy as np
import pytest

from ourgrad import Tensor, TinyJit
from ourgrad.device import Device
from ourgrad.renderer.cuda import DEPENDENT_LAUNCH_PROLOGUE, CUDARenderer
from ourgrad.codegen.wgmma_tiles import WgmmaMatmul


def _elementwise_source(renderer: CUDARenderer) -> str:
  """The CUDA source of a small elementwise kernel lowered for `renderer`."""
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.codegen.lowering import lower_kernel
  from ourgrad.engine.schedule import create_schedule
  out = (Tensor.empty(64, device="PYTHON") * 2 + 1).lazydata
  item = create_schedule([out])[-1]
  kernel = Kernel(item.ast, renderer)
  kernel.hand_coded_optimizations()
  return lower_kernel(kernel, renderer, "E_test").source


def _body_start(source: str) -> str:
  start = source.index('extern "C" __global__')
  return source[source.index("{\n", start) + 2:]


def test_sm90_kernels_start_with_the_prologue():
  source = _elementwise_source(CUDARenderer("sm_90"))
  assert _body_start(source).startswith(DEPENDENT_LAUNCH_PROLOGUE)
  assert source.count("griddepcontrol.wait") == 1


def test_other_architectures_have_no_prologue():
  assert "griddepcontrol" not in _elementwise_source(CUDARenderer("sm_80"))
  assert "griddepcontrol" not in _elementwise_source(CUDARenderer())


def test_the_wgmma_kernel_starts_with_the_prologue():
  plan = WgmmaMatmul(m=256, n=256, k=128, block_n=128, dtype="float16", out_dtype="float16")
  source = CUDARenderer("sm_90").render_wgmma("r_wgmma_test", plan, {"c": 0, "a": 1, "b": 2})
  assert _body_start(source).startswith(DEPENDENT_LAUNCH_PROLOGUE)


def test_nvrtc_compiles_the_prologue():
  ops_cuda = pytest.importorskip("ourgrad.runtime.ops_cuda", exc_type=ImportError)
  try:
    cubin = ops_cuda.CUDACompiler("sm_90").compile(_elementwise_source(CUDARenderer("sm_90")))
  except Exception as error:   # no NVRTC library in this environment
    if "nvrtc" in str(error).lower() and "not" in str(error).lower(): pytest.skip(str(error))
    raise
  assert len(cubin) > 0


class _RecordingDriver:
  """The graph calls CUDAGraph makes, recorded; the rest of cuda-python's driver module passes through."""

  def __init__(self, driver):
    self.driver, self.kernel_nodes, self.edges = driver, [], []

  def __getattr__(self, name):
    return getattr(self.driver, name)

  def cuGraphCreate(self, flags): return (self.driver.CUresult.CUDA_SUCCESS, "graph")

  def cuGraphAddKernelNode(self, graph, dependencies, count, params):
    node = f"node{len(self.kernel_nodes)}"
    self.kernel_nodes.append((node, list(dependencies)))
    return (self.driver.CUresult.CUDA_SUCCESS, node)

  def cuGraphAddDependencies(self, graph, from_nodes, to_nodes, edges, count):
    self.edges.append((list(from_nodes), list(to_nodes), [(edge.type, edge.from_port) for edge in edges]))
    return (self.driver.CUresult.CUDA_SUCCESS,)

  def cuGraphInstantiate(self, graph, flags): return (self.driver.CUresult.CUDA_SUCCESS, "exec")

  def cuGraphExecDestroy(self, graph_exec): return (self.driver.CUresult.CUDA_SUCCESS,)

  def cuGraphDestroy(self, graph): return (self.driver.CUresult.CUDA_SUCCESS,)


class _FakeProgram:
  function, shared_bytes = 0, 0   # the kernel handle: a CUfunction (an address) in a real program


class _FakeDevice:
  def __init__(self, arch: str): self.renderer = CUDARenderer(arch)

  def make_current(self) -> None: pass


def _kinds(recorder, early: list[bool]) -> list:
  driver = recorder.driver
  ports = {False: driver.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, True: driver.CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER}
  return [(driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC, ports[flag]) for flag in early]


# three one-block kernels, then one of 1000 blocks (a fake program: one block a multiprocessor), then one block
_GRIDS = [1, 1, 1, 1000, 1]


@pytest.mark.parametrize("arch, mode, early", [
  ("sm_90", 1, [False, False, False, False]),
  ("sm_90", 2, [True, True, False, False]),   # the 1000-block grid is several waves: it and the next wait for exits
  ("sm_90", 3, [True, True, True, True]),
  ("sm_90", 4, [True, True, False, False]),   # the fakes carry no costs: short
  ("sm_90", 0, None), ("sm_80", 1, None), ("sm_80", 2, None)])
def test_graph_edges_follow_the_mode_and_the_prologue(monkeypatch, arch, mode, early):
  ops_cuda = pytest.importorskip("ourgrad.runtime.ops_cuda", exc_type=ImportError)
  recorder = _RecordingDriver(ops_cuda.driver)
  monkeypatch.setattr(ops_cuda, "driver", recorder)
  monkeypatch.setattr(ops_cuda, "CUDA_DEPENDENT_LAUNCH", mode)
  launches = [(_FakeProgram(), (blocks, 1, 1), (32, 1, 1), [1000 + index], []) for index, blocks in enumerate(_GRIDS)]
  graph = ops_cuda.CUDAGraph(_FakeDevice(arch), launches)
  nodes = [node for node, _ in recorder.kernel_nodes]
  if early is not None:   # programmatic edges, each from the node before
    assert all(dependencies == [] for _, dependencies in recorder.kernel_nodes)
    expected = [([nodes[index]], [nodes[index + 1]], [kind]) for index, kind in enumerate(_kinds(recorder, early))]
    assert recorder.edges == expected
  else:
    assert [dependencies for _, dependencies in recorder.kernel_nodes] == [[], *[[node] for node in nodes[:-1]]]
    assert recorder.edges == []
  del graph


def test_footprints_take_the_programs_occupancy(monkeypatch):
  """Each node's footprint: its grid's blocks and the blocks of its block size the program says a multiprocessor
  holds (the driver's occupancy on a GPU); 132 multiprocessors (the assumed H100)."""
  ops_cuda = pytest.importorskip("ourgrad.runtime.ops_cuda", exc_type=ImportError)
  recorder = _RecordingDriver(ops_cuda.driver)
  monkeypatch.setattr(ops_cuda, "driver", recorder)
  monkeypatch.setattr(ops_cuda, "CUDA_DEPENDENT_LAUNCH", 2)

  class OccupancyProgram(_FakeProgram):
    name = "r_test"

    def __init__(self, resident: int): self.resident, self.asked = resident, []

    def resident_blocks(self, threads: int) -> int:
      self.asked.append(threads)
      return self.resident
  programs = [OccupancyProgram(8), OccupancyProgram(8), OccupancyProgram(2)]
  # 528 blocks at 8 a multiprocessor: half a wave each; then 132 at 2: another half: the third waits for exits
  launches = [(programs[0], (528, 1, 1), (16, 8, 1), [1], []), (programs[1], (264, 2, 1), (128, 1, 1), [2], []),
              (programs[2], (132, 1, 1), (8, 8, 4), [3], [])]
  graph = ops_cuda.CUDAGraph(_FakeDevice("sm_90"), launches)
  assert [program.asked for program in programs] == [[128], [128], [256]]
  assert [(footprint.blocks, footprint.resident_per_multiprocessor) for footprint in graph.footprints] == \
    [(528, 8), (528, 8), (132, 2)]
  assert graph.edges == ["first", "start", "exit"]
  assert "r_test" in graph.describe(launches) and "start 1" in graph.describe(launches).splitlines()[0]
  assert graph.describe(launches, per_kernel=False) == "CUDA graph: 3 kernels, edges first 1, start 1, exit 1"
  del graph


def test_early_launches_fit_one_wave_together():
  """The rule from given device facts: 100 multiprocessors, footprints as (blocks, resident blocks a multiprocessor)."""
  from ourgrad.renderer import GpuFacts
  from ourgrad.renderer.cuda import GridFootprint
  renderer = CUDARenderer("sm_90")
  renderer.set_gpu_facts(GpuFacts(multiprocessors=100, threads_per_multiprocessor=2048,
                                  registers_per_multiprocessor=65536, dynamic_local_memory_bytes=227 * 1024))

  def decide(*grids: tuple[int, int]) -> list[bool]:
    return renderer.early_launches([GridFootprint(blocks, resident) for blocks, resident in grids])
  # waves 0.5, 0.25, 0.25 fit together; a fourth (0.25) would not: it waits for the exits and starts a new run
  assert decide((200, 4), (100, 4), (50, 2), (100, 4), (100, 4)) == [False, True, True, False, True]
  # a grid of more than one wave never launches early, nor does the kernel after it
  assert decide((1, 1), (101, 1), (1, 1), (1, 1)) == [False, False, False, True]
  # exactly one wave together is allowed; occupancy counts (8 blocks a multiprocessor: 800 blocks are one wave)
  assert decide((400, 8), (400, 8), (1, 8)) == [False, True, False]
  assert decide() == []
  # the same grids on a GPU of twice the multiprocessors: all fit
  renderer.multiprocessors = 200
  assert decide((200, 4), (100, 4), (50, 2), (100, 4), (100, 4)) == [False, True, True, True, True]


def test_short_only_launches_early_after_short_kernels():
  """short_only: a kernel is launched early only after one that moves at most launch_bytes and computes at most
  launch_ops (what the GPU does in one launch's time)."""
  from ourgrad.renderer.cuda import GridFootprint
  renderer = CUDARenderer("sm_90")
  renderer.multiprocessors, renderer.launch_bytes, renderer.launch_ops = 100, 1000, 5000
  footprints = [GridFootprint(1, 1, op_count=5000, byte_count=1000),   # short: the next may launch early
                GridFootprint(1, 1, op_count=5001, byte_count=10),     # too many ops
                GridFootprint(1, 1, op_count=10, byte_count=1001),     # too many bytes
                GridFootprint(1, 1), GridFootprint(1, 1)]
  assert renderer.early_launches(footprints, short_only=True) == [False, True, False, False, True]
  assert renderer.early_launches(footprints) == [False, True, True, True, True]


@pytest.mark.skipif(Device.DEFAULT != "CUDA", reason="needs a CUDA GPU")
@pytest.mark.parametrize("enabled", [0, 1, 2, 3, 4])
def test_jitted_chain_matches_numpy(monkeypatch, enabled):
  from ourgrad.runtime import ops_cuda
  monkeypatch.setattr(ops_cuda, "CUDA_DEPENDENT_LAUNCH", enabled)
  rng = np.random.default_rng(0)
  values = rng.standard_normal((256, 512)).astype(np.float32)

  @TinyJit
  def chain(x: Tensor) -> Tensor:
    # each kernel reads the one before's result: a reduce, an elementwise use of it, a matmul, a softmax
    centered = x - x.mean(axis=1, keepdim=True)
    return (centered @ centered.T).softmax(axis=1).sum(axis=0).realize()

  for step in range(4):
    x = Tensor(values + step).realize()
    got = chain(x).numpy()
    shifted = values + step
    centered = shifted - shifted.mean(axis=1, keepdims=True)
    scores = centered.astype(np.float64) @ centered.T.astype(np.float64)
    expected = np.exp(scores - scores.max(axis=1, keepdims=True))
    expected = (expected / expected.sum(axis=1, keepdims=True)).sum(axis=0)
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=2e-3)
