"""TinyJit's replays on the CLANG device: one C function calls the captured kernels in turn (runtime/host_calls.py).
Results are checked against numpy, and bit for bit against the loop of ctypes calls (ItemReplay) that replays them
on the LLVM device, with new input buffers and changing Variables between calls."""
from __future__ import annotations

import numpy as np
import pytest

from ourgrad import Device, Tensor, TinyJit
from ourgrad.engine.jit import GraphReplay, ItemReplay
from ourgrad.runtime import host_calls
from ourgrad.shape import Variable
from extra.models.llama import Llama
from test_models import TINY, _tiny_weights


@pytest.fixture(autouse=True)
def _plain_settings(monkeypatch):
  monkeypatch.delenv("DEBUG", raising=False)               # DEBUG >= 2 replays item by item
  monkeypatch.delenv("CHECK_CUDA_RENDER", raising=False)   # symbolic kernels skip the opts it applies (docs/jit.md)


def _graph(jit: TinyJit) -> host_calls.HostCallGraph:
  assert jit.captured is not None
  replay = jit.captured.replay_runner
  assert isinstance(replay, GraphReplay) and isinstance(replay.graph, host_calls.HostCallGraph)
  return replay.graph


def test_replay_is_one_call_with_new_inputs_and_values():
  """A capture of several kernels, two of them symbolic: every replay is one call of the dispatcher, and reads this
  call's input buffers and Variable value (one int slot that both symbolic kernels read)."""
  rng = np.random.default_rng(0)
  table = rng.standard_normal((12, 5)).astype(np.float32)
  rows = Tensor(table, device="CLANG").realize()

  @TinyJit
  def f(a, b, n):
    scaled = (a * 2 + b).realize()
    window = (rows.shrink(((0, n), None)) * scaled).realize()
    return (window.sum(0) + scaled.max()).realize()
  n = Variable("n", 1, 12)
  for call, value in enumerate((4, 9, 9, 2, 12, 1)):
    a, b = (rng.standard_normal(5).astype(np.float32) for _ in range(2))
    got = f(Tensor(a, device="CLANG").realize(), Tensor(b, device="CLANG").realize(), n.bind(value)).numpy()
    scaled = a * 2 + b
    np.testing.assert_allclose(got, (table[:value] * scaled).sum(0) + scaled.max(), rtol=1e-5, atol=1e-5)
  graph = _graph(f)
  symbolic = [index for index, item in enumerate(f.captured.items) if item.runner.var_names]
  assert len(graph.steps) == 1 and len(symbolic) == 2
  assert len({graph.table[index].first_int for index in symbolic}) == 1


def test_kernels_past_the_table_are_called_through_ctypes(monkeypatch):
  """A kernel with more buffers than the dispatcher's prototypes cover (here: more than 1) is called through ctypes
  between runs of the table, and a new input buffer reaches its own argument list too."""
  monkeypatch.setattr(host_calls, "MAX_POINTERS", 1)

  @TinyJit
  def f(a, b): return ((a + b).realize().exp2() * a).realize()
  rng = np.random.default_rng(1)
  for _ in range(4):
    a, b = (rng.standard_normal(7).astype(np.float32) for _ in range(2))
    np.testing.assert_allclose(f(Tensor(a, device="CLANG").realize(), Tensor(b, device="CLANG").realize()).numpy(),
                               np.exp2(a + b) * a, rtol=1e-5)
  graph = _graph(f)
  assert len(graph.direct) == 2 and len(graph.steps) == 2   # both kernels take 3 buffers: no run of the table left


def test_the_widest_prototype_calls_with_every_argument():
  """The dispatcher's widest case (MAX_POINTERS buffers, MAX_INTS ints) passes each argument to its parameter."""
  pointers, ints = host_calls.MAX_POINTERS, host_calls.MAX_INTS
  parameters = ", ".join([f"float *p{index}" for index in range(pointers)] +
                         [f"const int n{index}" for index in range(ints)])
  body = " + ".join(f"p{index}[0] * {index + 1}" for index in range(1, pointers))
  ints_sum = " + ".join(f"n{index} * {10 ** index}" for index in range(ints))
  source = f"void widest({parameters}) {{ p0[0] = {body} + (float)({ints_sum}); }}\n"
  device = Device["CLANG"]
  program = device.program("widest", device.compiler.compile_cached(source))
  arrays = [np.full(1, float(index), np.float32) for index in range(pointers)]
  values = list(range(1, ints + 1))
  launch = (program, (1,), (1,), arrays, values, (0, 0))
  graph = host_calls.HostCallGraph([launch], device.compiler.kernel_caller(), lambda array: array.ctypes.data)
  graph.launch()
  expected = sum(index * (index + 1) for index in range(1, pointers)) + sum(v * 10 ** i for i, v in enumerate(values))
  assert arrays[0][0] == expected
  graph.set_argument(0, pointers, 7)   # the first int
  graph.launch()
  assert arrays[0][0] == expected + 6


@pytest.mark.parametrize("symbolic", [True, False], ids=["symbolic", "fixed_shapes"])
def test_llama_decode_logits_are_bit_identical_to_the_ctypes_loop(symbolic: bool):
  """SmolLM2's shape in small: decode steps replayed by the dispatcher and by the loop of ctypes calls over the same
  captured kernels (only how they are called differs) give bit-identical logits at every position (a Variable: the
  position, or the slots in use)."""
  weights = _tiny_weights(TINY, seed=3)
  model = Llama(TINY, {name: Tensor(value) for name, value in weights.items()}, max_context=16, symbolic=symbolic)
  tokens = [4, 9, 31, 2, 17, 17, 40, 1, 8]
  model(Tensor([tokens[:2]]), 0).realize()
  for position in (2, 3): model.decode(tokens[position], position)   # eager, then the capture
  captured = model._decode_jit.captured
  assert captured is not None and isinstance(captured.replay_runner, GraphReplay)
  graph_replay = captured.replay_runner
  loop = ItemReplay(captured.items)
  for position in range(4, len(tokens)):
    got = []
    for replay in (graph_replay, loop):   # (the second writes the same cache slot with the same values)
      captured.replay_runner = replay
      captured.var_vals = {}   # (the runner swapped in is told this call's values: the capture tells one per change)
      got.append(model.decode(tokens[position], position).numpy().copy())
    assert np.array_equal(got[0], got[1])
  captured.replay_runner = graph_replay
