"""TinyJit: capture and replay against eager runs, the checks on inputs, and each known JIT trap (tinygrad's
test/unit/test_jit_footguns.py lists them) as an error or a correct result."""
import numpy as np
import pytest

from ourgrad import GlobalCounters, Tensor, TinyJit
from ourgrad.errors import JitError
from ourgrad.nn import BatchNorm2d, Conv2d, Linear
from ourgrad.nn.losses import cross_entropy
from ourgrad.nn.optim import Adam
from ourgrad.nn.state import get_parameters
from helpers import device_opens, skip_unless_device


def test_replay_matches_numpy_and_changes_with_inputs():
  @TinyJit
  def add(a, b): return (a + b).realize()
  results = []
  for _ in range(5):
    a, b = Tensor.randn(10, 10), Tensor.randn(10, 10)
    c = add(a, b)
    np.testing.assert_allclose(c.numpy(), a.numpy() + b.numpy())
    results.append(c.numpy())
  assert add.captured is not None and len(add.captured.items) == 1
  assert not np.array_equal(results[3], results[4])


def test_replay_runs_no_python_function_and_counts_kernels():
  calls = []

  @TinyJit
  def f(x):
    calls.append(1)
    y = (x + 1).exp()
    return (y - (y * 2).sum()).relu(), (y * 2).sum()
  for _ in range(4):
    x = Tensor.randn(32)
    GlobalCounters.reset()
    w, z = f(x)
    xn = x.numpy()
    yn = np.exp(xn + 1)
    np.testing.assert_allclose(z.numpy(), (yn * 2).sum(), rtol=1e-5)
    np.testing.assert_allclose(w.numpy(), np.maximum(yn - (yn * 2).sum(), 0), rtol=1e-5)
  assert len(calls) == 2  # the function body runs on the first two calls only
  assert GlobalCounters.kernel_count == len(f.captured.items)


def test_kwargs_positional_mix_and_containers():
  @TinyJit
  def f(first, second): return (first / second[0] + second[1]["c"]).realize()
  for i in range(4):
    a, b, c = Tensor.randn(6), Tensor.randn(6) + 3, Tensor.randn(6)
    out = f(a, [b, {"c": c}]) if i % 2 else f(second=[b, {"c": c}], first=a)
    np.testing.assert_allclose(out.numpy(), a.numpy() / b.numpy() + c.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_wrong_input_raises_naming_it(bad):
  @TinyJit
  def f(a, b): return (a + b).realize()
  for _ in range(3): f(Tensor.randn(4, 4), Tensor.randn(4, 4))
  wrong = Tensor.randn(5, 4) if bad == "shape" else Tensor.randn(4, 4).cast("float16")
  with pytest.raises(JitError, match="input b"):
    f(Tensor.randn(4, 4), wrong)


def test_wrong_device_raises():
  @TinyJit
  def f(a): return (a * 2).realize()
  for _ in range(3): f(Tensor.randn(4))
  from ourgrad.device import Device
  other = "CLANG" if Device.DEFAULT == "PYTHON" else "PYTHON"  # a device other than the default (DEVICE=PYTHON runs)
  with pytest.raises(JitError, match="input a"):
    f(Tensor.randn(4, device=other))


def test_changed_python_argument_raises():
  @TinyJit
  def f(x, use_square):
    return (x * x).realize() if use_square else (x * 2).realize()
  f(Tensor([3.0]), True)
  f(Tensor([3.0]), False)
  assert f(Tensor([4.0]), False).item() == 8.0
  with pytest.raises(JitError, match="use_square"):
    f(Tensor([3.0]), True)


def test_item_and_numpy_inside_raise():
  @TinyJit
  def f(x): return Tensor.zeros(int(x.sum().item()))
  with pytest.raises(JitError, match="frozen"):
    f(Tensor([1, 1, 1]))

  @TinyJit
  def g(x): return Tensor(x.numpy() * 2)
  with pytest.raises(JitError):
    g(Tensor([1.0]))


def test_nothing_launched_raises():
  @TinyJit
  def f(a, b): return None
  with pytest.raises(JitError, match="no kernels"):
    for _ in range(3): f(Tensor([1]), Tensor([2]))


def test_non_tensor_output_raises():
  @TinyJit
  def f(x, mult): return (x * 2).realize(), mult * 10
  with pytest.raises(JitError, match="int"):
    f(Tensor([1]), 2)


def test_duplicate_inputs_raise():
  @TinyJit
  def f(a, b): return (a + b).realize()
  x = Tensor([1, 2, 3]).realize()
  with pytest.raises(JitError, match="same buffer"):
    f(x, x)


def test_random_inside_draws_new_numbers_each_replay():
  """rand inside a jitted function is computed on the device (ourgrad/tensor_random.py; statistics and seeding in
  test/test_random_jit.py): no JitError, and every replay gives other numbers."""
  @TinyJit
  def f(x): return (x + Tensor.rand(3)).realize()
  values = [f(Tensor([0.0, 0.0, 0.0])).numpy() for _ in range(5)]
  assert f.captured is not None and len({value.tobytes() for value in values}) == 5


def test_host_random_inside_capture_raises():
  """Numbers drawn on the host inside a capture (numpy's generator) would be frozen into the replay: JitError."""
  @TinyJit
  def f(x): return (x + Tensor(Tensor._rng.random(3).astype(np.float32))).realize()
  f(Tensor([0.0, 0.0, 0.0]))
  with pytest.raises(JitError, match="random"):
    f(Tensor([0.0, 0.0, 0.0]))


def test_outputs_are_the_jits_buffers_overwritten_by_the_next_replay():
  """As a CUDA graph's static outputs in PyTorch: a replay returns Tensors backed by the capture's own output
  buffers, so a Tensor returned earlier (from the capture call on) shows the latest replay's values. A clone, or a
  value read to the host, keeps its values."""
  @TinyJit
  def f(x): return x.sum().realize()
  r1 = f(Tensor([1.0, 1.0]))            # call 1 runs eagerly: a buffer of its own
  r2 = f(Tensor([2.0, 2.0]))            # the capture call: the JIT's output buffer
  kept, value = r2.clone().realize(), r2.item()
  r3 = f(Tensor([3.0, 3.0]))
  r4 = f(Tensor([4.0, 4.0]))
  assert [r1.item(), r2.item(), r3.item(), r4.item()] == [2.0, 8.0, 8.0, 8.0]
  assert (kept.item(), value) == (4.0, 4.0)
  assert r2.lazydata.base.realized is r4.lazydata.base.realized is f.captured.output_buffers[0]


def test_lazy_readers_of_an_earlier_output_keep_its_value():
  """`total = total + loss` left lazy across replays reads each loss as it was when the line ran (the library's
  rule for in-place writes, docs/reliability.md): the replay snapshots the old output for that lazy reader."""
  @TinyJit
  def f(x): return (x * 2).sum().realize()
  total = Tensor(0.0)
  scaled = []
  for i in range(1, 7):
    out = f(Tensor([float(i), 1.0]))
    total = total + out
    scaled.append(out * 10)
  assert total.item() == sum(2.0 * (i + 1) for i in range(1, 7))
  assert [s.item() for s in scaled] == [20.0 * (i + 1) for i in range(1, 7)]
  # a reader built from an old output after a later call reads that later call's value (the buffer's contents when
  # the line ran), and keeps it through further replays
  old = f(Tensor([1.0, 1.0]))
  assert (old * 3).item() == 12.0  # a reader of the output's base, realized at once
  f(Tensor([5.0, 1.0]))
  built_late = old + 0.5
  f(Tensor([9.0, 1.0]))
  f(Tensor([3.0, 1.0]))
  assert built_late.item() == 12.5 and old.item() == 8.0


def test_replay_updates_only_changed_input_slots(monkeypatch):
  """A replay with the same input buffers patches no kernel argument; a new input buffer patches only the slots
  that read it; the output buffers never move."""
  from ourgrad.engine.jit import GraphReplay, ItemReplay
  patched = []
  for replay_class in (ItemReplay, GraphReplay):  # a loop of kernel calls on CPUs, a device graph on CUDA
    original = replay_class.set_buffer
    monkeypatch.setattr(replay_class, "set_buffer",
                        lambda self, i, slot, buffer, original=original: (patched.append((i, slot)),
                                                                          original(self, i, slot, buffer)))

  @TinyJit
  def f(a, b): return ((a + 1).realize() * b).realize()
  a, b = Tensor([1.0, 2.0]).realize(), Tensor([3.0, 4.0]).realize()
  for _ in range(3): f(a, b)
  out_buffer = f.captured.output_buffers[0]
  for _ in range(3): assert f(a, b).tolist() == [6.0, 12.0]
  assert patched == []
  b2 = Tensor([5.0, 6.0]).realize()
  assert f(a, b2).tolist() == [10.0, 18.0]
  (item_index, slot), = patched  # one slot: b's, in the second kernel
  assert item_index == 1 and f.captured.items[1].bufs[slot] is b2.lazydata.realized
  assert f.captured.output_buffers[0] is out_buffer


def test_output_fed_back_as_input():
  @TinyJit
  def step(x): return ((x + 1).realize() * 2).realize()
  step(Tensor([10.0]).contiguous().realize())
  x = step(Tensor([20.0]).contiguous().realize())
  for _ in range(3): x = step(x)
  assert x.item() == 350.0
  y = Tensor([100.0]).contiguous().realize()
  for _ in range(3): y = step(y)
  assert y.item() == 814.0


def test_views_with_different_offsets_are_correct():
  @TinyJit
  def f(a): return (a + 1).realize()
  base = Tensor.randn(10, 10).realize()
  for i in range(1, 6):
    np.testing.assert_allclose(f(base[:, i:i + 2]).numpy(), base.numpy()[:, i:i + 2] + 1, rtol=1e-6)


def test_constant_input_is_realized():
  @TinyJit
  def f(a, b): return (a * b).realize()
  for i in range(4):
    np.testing.assert_array_equal(f(Tensor([1, 2, 3]), Tensor.full((3,), i)).numpy(), [i, 2 * i, 3 * i])


def test_assign_not_returned_is_captured():
  state = Tensor.zeros(4).contiguous().realize()

  @TinyJit
  def f(x):
    state.assign(state + x)  # never realized by the function itself
    return (x * 2).realize()
  for i in range(5): f(Tensor.full((4,), float(i)).contiguous())
  np.testing.assert_array_equal(state.numpy(), [10.0] * 4)


def test_input_mutation():
  @TinyJit
  def f(x):
    x += 1
    return x.realize()
  a = Tensor([0.0]).contiguous().realize()
  for _ in range(5): f(a)
  assert a.item() == 5.0


def test_nested_jit_runs_inside_the_outer_capture():
  @TinyJit
  def inner(t): return (t + 1).realize()

  @TinyJit
  def outer(t): return (inner(t) * 3).realize()
  assert [outer(Tensor([float(i)])).item() for i in range(4)] == [3.0, 6.0, 9.0, 12.0]


def test_method_is_per_instance():
  class Model:
    def __init__(self, scale): self.scale = Tensor([scale]).realize()

    @TinyJit
    def forward(self, x): return (x * self.scale).realize()
  m1, m2 = Model(2.0), Model(3.0)
  for _ in range(3): m1.forward(Tensor([5.0]))
  assert m1.forward(Tensor([5.0])).item() == 10.0
  assert [m2.forward(Tensor([5.0])).item() for _ in range(3)] == [15.0, 15.0, 15.0]
  assert m1.forward.captured is not None and m2.forward.captured is not None  # each instance replays its own

  class Late:
    def __init__(self, scale): self.scale = Tensor([scale]).realize()
    def forward(self, x): return (x * self.scale).realize()
  Late.forward = TinyJit(Late.forward)  # wrapped after the class body: no __set_name__
  late = Late(4.0)
  assert [late.forward(Tensor([float(i)])).item() for i in range(4)] == [0.0, 4.0, 8.0, 12.0]
  assert late.forward.captured is not None


def test_unrealized_outputs_are_realized():
  @TinyJit
  def f(a, b): return a + b
  for _ in range(4):
    a, b = Tensor.randn(10), Tensor.randn(10)
    np.testing.assert_allclose(f(a, b).numpy(), a.numpy() + b.numpy(), rtol=1e-6)


def test_jit_off_runs_eagerly(monkeypatch):
  monkeypatch.setenv("JIT", "0")
  calls = []

  @TinyJit
  def f(x):
    calls.append(1)
    return (x * 2).realize()
  for i in range(4): assert f(Tensor([float(i)])).item() == 2.0 * i
  assert len(calls) == 4 and f.captured is None


# ---------------------------------------------------------------- a whole training step

class SmallNet:
  def __init__(self):
    self.conv = Conv2d(1, 4, 3, bias=False)
    self.bn = BatchNorm2d(4)
    self.fc = Linear(4 * 3 * 3, 10)

  def __call__(self, x):
    return self.fc(self.bn(self.conv(x)).relu().max_pool2d().flatten(1))


def _make_training(seed):
  Tensor.manual_seed(seed)
  model = SmallNet()
  optimizer = Adam([tensor for tensor in get_parameters(model) if tensor.requires_grad], lr=0.01)
  stats = [tensor for tensor in get_parameters(model) if not tensor.requires_grad]

  def step(x, y):
    with Tensor.train():
      optimizer.zero_grad()
      loss = cross_entropy(model(x), y)
      loss.backward()
      Tensor.realize_all(loss, *optimizer.schedule_step(), *stats)
    return loss
  return model, step


def test_jitted_training_step_is_bit_identical_to_eager():
  rng = np.random.default_rng(0)
  batches = [(rng.standard_normal((8, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 8)) for _ in range(5)]
  eager_model, eager_step = _make_training(1)
  jit_model, plain_step = _make_training(1)
  jit_step = TinyJit(plain_step)
  for images, labels in batches:
    eager_loss = eager_step(Tensor(images), Tensor(labels))
    jit_loss = jit_step(Tensor(images), Tensor(labels))
    assert eager_loss.numpy().tobytes() == jit_loss.numpy().tobytes()
  assert jit_step.captured is not None
  for eager, jitted in zip(get_parameters(eager_model), get_parameters(jit_model)):
    assert eager.numpy().tobytes() == jitted.numpy().tobytes()
  # the batchnorm running statistics moved, identically
  assert not np.allclose(jit_model.bn.running_mean.numpy(), 0)


# ---------------------------------------------------------------- CUDA graphs



@pytest.mark.skipif(not device_opens("CUDA"), reason="needs an NVIDIA GPU")
def test_cuda_replay_is_one_graph_updated_with_new_buffers():
  from ourgrad.engine.jit import GraphReplay

  @TinyJit
  def f(a, b):
    c = (a @ b).relu().realize()
    return (c.sum(1) + a.max(1)).realize(), c
  outputs = []
  for _ in range(5):
    a, b = Tensor.randn(32, 16, device="CUDA"), Tensor.randn(16, 8, device="CUDA")
    s, c = f(a, b)
    an, bn = a.numpy(), b.numpy()
    cn = np.maximum(an @ bn, 0)
    np.testing.assert_allclose(c.numpy(), cn, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(s.numpy(), cn.sum(1) + an.max(1), rtol=1e-4, atol=1e-4)
    outputs.append((s, cn.sum(1) + an.max(1)))
  assert isinstance(f.captured.replay_runner, GraphReplay)
  # replays write the capture's own output buffers: the last call's values, in every output returned since capture
  for s, _ in outputs[1:]: np.testing.assert_allclose(s.numpy(), outputs[-1][1], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not device_opens("CUDA"), reason="needs an NVIDIA GPU")
def test_cuda_jitted_training_step_is_bit_identical(monkeypatch):
  monkeypatch.setenv("DEVICE", "CUDA")
  test_jitted_training_step_is_bit_identical_to_eager()


@pytest.mark.parametrize("device", ["LLVM", "PYTHON"])
def test_other_devices_replay(device):
  skip_unless_device(device)
  """LLVM replays through pre-bound ctypes calls like CLANG; PYTHON (no ctypes function) through ExecItem.run."""
  @TinyJit
  def f(a, b): return ((a * b).sum(1) + a.max(1)).realize()
  for _ in range(4):
    a, b = Tensor.randn(6, 5, device=device), Tensor.randn(6, 5, device=device)
    np.testing.assert_allclose(f(a, b).numpy(), (a.numpy() * b.numpy()).sum(1) + a.numpy().max(1), rtol=1e-5,
                               atol=1e-5)
  assert f.captured is not None
  host_calls = [call is not None for call in f.captured.replay_runner.host_calls]
  assert all(host_calls) == (device == "LLVM")


def _recording_graph(built: list, updates: list, launches: list, sizes: list | None = None) -> type:
  """A stand-in for a device graph class on CLANG: it records what GraphReplay asks of it and runs the kernels
  through their programs at each launch (buffer handles, then the symbolic Variables' values)."""
  class RecordingGraph:
    def __init__(self, kernel_launches):
      built.append(len(kernel_launches))
      self.kernels = [(program, len(handles), [*handles, *values])
                      for program, _, _, handles, values, _costs in kernel_launches]
      self.sizes = [[global_size, local_size] for _, global_size, local_size, *_ in kernel_launches]

    def set_argument(self, index, position, value):
      updates.append((index, position))
      self.kernels[index][2][position] = value

    def set_launch_size(self, index, global_size, local_size):
      if sizes is not None: sizes.append((index, global_size, local_size))
      self.sizes[index] = [global_size, local_size]

    def launch(self):
      launches.append(1)
      for (program, buffer_count, arguments), (global_size, local_size) in zip(self.kernels, self.sizes):
        program(*arguments[:buffer_count], global_size=global_size, local_size=local_size,
                vals=tuple(arguments[buffer_count:]))
  return RecordingGraph


def test_fast_and_general_replay_paths_agree():
  """Positional calls like the capture take the fast path; keyword calls, views and outputs fed back take the
  general one. Mixed in any order, each replay reads this call's inputs."""
  @TinyJit
  def f(a, b, scale=2.0): return (a * scale + b).realize()
  rng = np.random.default_rng(1)
  arrays = [rng.standard_normal(6).astype(np.float32) for _ in range(8)]
  tensors = [Tensor(array).realize() for array in arrays]
  f(tensors[0], tensors[1])
  f(tensors[1], tensors[0])
  view = Tensor(np.concatenate([arrays[0], arrays[1]]))[3:9]
  calls = [(lambda: f(tensors[2], tensors[3]), arrays[2] * 2 + arrays[3]),
           (lambda: f(a=tensors[4], b=tensors[5]), arrays[4] * 2 + arrays[5]),
           (lambda: f(tensors[6], tensors[7]), arrays[6] * 2 + arrays[7]),
           (lambda: f(tensors[6], view), arrays[6] * 2 + np.concatenate([arrays[0], arrays[1]])[3:9]),
           (lambda: f(tensors[2], tensors[3]), arrays[2] * 2 + arrays[3])]
  for call, expected in calls: np.testing.assert_allclose(call().numpy(), expected, rtol=1e-6)
  fed_back = f(tensors[2], tensors[3])
  np.testing.assert_allclose(f(fed_back, tensors[1]).numpy(), (arrays[2] * 2 + arrays[3]) * 2 + arrays[1],
                             rtol=1e-6)
  with pytest.raises(JitError, match="scale"):
    f(tensors[2], tensors[3], 3.0)


def test_graph_replay_updates_arguments_in_place(monkeypatch):
  """GraphReplay's bookkeeping, with a stand-in for a device graph on CLANG: built once from the launches, told
  about each kernel argument whose buffer changed, launched once per call."""
  from ourgrad.device import Device
  from ourgrad.engine.jit import GraphReplay
  built, updates, launches = [], [], []

  monkeypatch.setattr(Device["CLANG"], "graph", _recording_graph(built, updates, launches), raising=False)

  @TinyJit
  def f(a): return ((a + 1).realize() * 3).realize()
  for i in range(5):
    a = Tensor.full((4,), float(i), device="CLANG").contiguous().realize()
    assert f(a).numpy().tolist() == [3.0 * (i + 1)] * 4
  assert isinstance(f.captured.replay_runner, GraphReplay)
  # each replay has a new input: only its slot (kernel 0, argument 1) is patched; outputs and intermediates stay
  assert built == [2] and len(launches) == 3 and updates == [(0, 1)] * 3


def test_cuda_graph_patches_cached_params_and_sets_them_once_per_launch(monkeypatch):
  """CUDAGraph against a recording stand-in for the driver (no GPU needed): a changed argument is written into the
  node's cached argument array, each changed node's parameter struct (the same object every time) is handed to the
  driver once, at the next launch, and a launch with nothing changed sets no parameters."""
  ops_cuda = pytest.importorskip("ourgrad.runtime.ops_cuda")
  real = ops_cuda.driver
  calls = []
  success = real.CUresult.CUDA_SUCCESS

  class FakeDriver:
    CUresult, CUDA_KERNEL_NODE_PARAMS = real.CUresult, real.CUDA_KERNEL_NODE_PARAMS

    def cuGraphCreate(self, flags): return success, "graph"
    def cuGraphInstantiate(self, graph, flags): return success, "exec"
    def cuGraphExecDestroy(self, graph_exec): return (success,)
    def cuGraphDestroy(self, graph): return (success,)

    def cuGraphAddKernelNode(self, graph, deps, count, params):
      calls.append(("add", list(deps)))
      return success, f"node{len([c for c in calls if c[0] == 'add'])}"

    def cuGraphExecKernelNodeSetParams(self, graph_exec, node, params):
      calls.append(("set", node, params))
      return (success,)

  class FakeDirectCalls:   # the device's ctypes calls (ops_cuda.DirectCalls): the graph launch
    def graph_launch(self, graph_exec): calls.append(("launch",))

  class FakeDevice:
    stream = "stream"
    direct = FakeDirectCalls()
    def make_current(self): pass

  class FakeProgram:
    function = None
    shared_bytes = 0   # no dynamic shared memory (staged tensor-core kernels set it)

  monkeypatch.setattr(ops_cuda, "driver", FakeDriver())
  graph = ops_cuda.CUDAGraph(FakeDevice(), [(FakeProgram(), (1, 1, 1), (1, 1, 1), [16, 32], []),
                                            (FakeProgram(), (2, 1, 1), (4, 1, 1), [48, 16, 64], [5])])
  assert [call[1] for call in calls] == [[], ["node1"]]  # a chain: each node after the one before
  calls.clear()
  graph.launch()
  assert calls == [("launch",)]
  calls.clear()
  params_before = graph.node_params[1]
  graph.set_argument(1, 2, 80)
  graph.set_argument(1, 0, 96)
  assert list(graph.arguments[1]) == [96, 16, 80, 5] and list(graph.arguments[0]) == [16, 32]
  graph.launch()
  assert calls == [("set", "node2", params_before), ("launch",)]
  calls.clear()
  graph.launch()
  assert calls == [("launch",)]
  calls.clear()
  graph.set_argument(1, 3, 9)  # a symbolic Variable's new value, and the launch size that follows it
  graph.set_launch_size(1, (9, 1, 1), (4, 1, 1))
  graph.launch()
  assert list(graph.arguments[1]) == [96, 16, 80, 9] and graph.node_params[1].gridDimX == 9
  assert calls == [("set", "node2", params_before), ("launch",)]


@pytest.mark.parametrize("device", ["CLANG", "PYTHON"])
def test_graph_replay_of_symbolic_kernels_sets_values_and_sizes(device, monkeypatch):
  """A capture with symbolic kernels is one device graph too: each call writes the Variable's value into the int
  argument of the kernels that take it, and the launch sizes of those whose sizes depend on it (the PYTHON device's
  elementwise kernel launched over n rows; never a host kernel's, whose loops read the value: CLANG); the same
  value as last call changes nothing."""
  from ourgrad.device import Device
  from ourgrad.engine.jit import GraphReplay
  from ourgrad.shape import Variable
  skip_unless_device(device)
  monkeypatch.delenv("CHECK_CUDA_RENDER", raising=False)  # symbolic kernels skip the opts it applies (docs/jit.md)
  built, updates, launches, sizes = [], [], [], []
  monkeypatch.setattr(Device[device], "graph", _recording_graph(built, updates, launches, sizes), raising=False)
  data = np.arange(40, dtype=np.float32).reshape(10, 4)
  table = Tensor(data, device=device).realize()

  @TinyJit
  def window_sum(x, n):
    window = (table.shrink(((0, n), None)) * x).realize()   # launched over n rows (PYTHON)
    return (window.sum(0) + 1).realize()                    # one launch of 4 outputs, each a loop over n rows
  n = Variable("n", 1, 10)
  x = Tensor(np.full(4, 2.0, dtype=np.float32), device=device).realize()
  for value in (3, 7, 7, 2, 10):
    np.testing.assert_allclose(window_sum(x, n.bind(value)).numpy(), (data[:value] * 2).sum(0) + 1)
  assert isinstance(window_sum.captured.replay_runner, GraphReplay) and built == [2] and len(launches) == 3
  # 7 -> 7 patches nothing: replays with 7, 2 and 10 after the capture with 7: two changes of each kernel's int
  # argument, and of the launch size of the kernel launched over n rows
  assert sorted(index for index, _ in updates) == [0, 0, 1, 1]
  assert [(index, global_size) for index, global_size, _ in sizes] == \
      ([] if device == "CLANG" else [(0, (4, 2, 1)), (0, (4, 10, 1))])


@pytest.mark.skipif(not device_opens("CUDA"), reason="needs an NVIDIA GPU")
def test_cuda_symbolic_capture_is_one_graph():
  """On a GPU: a capture with symbolic kernels replays as one CUDA graph, its int arguments and launch sizes
  patched per value, with results equal to numpy's."""
  from ourgrad.engine.jit import GraphReplay
  from ourgrad.shape import Variable
  data = np.random.default_rng(4).standard_normal((64, 8)).astype(np.float32)
  table = Tensor(data, device="CUDA").realize()

  @TinyJit
  def window_sum(x, n):
    return ((table.shrink(((0, n), None)) * x).sum(0) + 1).realize()
  n = Variable("n", 1, 64)
  x = Tensor(np.linspace(-1, 1, 8, dtype=np.float32), device="CUDA").realize()
  for value in (5, 17, 17, 64, 1, 33):
    np.testing.assert_allclose(window_sum(x, n.bind(value)).numpy(), (data[:value] * x.numpy()).sum(0) + 1,
                               rtol=1e-5, atol=1e-5)
  assert isinstance(window_sum.captured.replay_runner, GraphReplay)


def test_bound_variable_arguments_take_the_fast_path(monkeypatch):
  """A call made like the capture call with a bound Variable among its positional arguments (a decode step's position)
  replays without the general path's argument walk; another Variable, a plain int there, or a keyword call take the
  general path; every call reads its own value."""
  from ourgrad.engine.jit import CapturedJit
  from ourgrad.shape import Variable
  monkeypatch.delenv("CHECK_CUDA_RENDER", raising=False)  # symbolic kernels skip the opts it applies (docs/jit.md)
  general = []
  original = CapturedJit.replay
  monkeypatch.setattr(CapturedJit, "replay", lambda self, *args: (general.append(1), original(self, *args))[1])
  data = np.arange(24, dtype=np.float32).reshape(6, 4)
  table = Tensor(data).realize()

  @TinyJit
  def window_sum(x, n): return ((table.shrink(((0, n), None)) * x).sum(0)).realize()
  n = Variable("n", 1, 6)
  x = Tensor(np.full(4, 3.0, dtype=np.float32)).realize()
  for value in (2, 5, 5, 1, 6, 3):
    np.testing.assert_allclose(window_sum(x, n.bind(value)).numpy(), (data[:value] * 3).sum(0))
  assert general == []
  other = Variable("other", 1, 6)
  with pytest.raises(JitError):
    window_sum(x, other.bind(2))
  np.testing.assert_allclose(window_sum(x=x, n=n.bind(4)).numpy(), (data[:4] * 3).sum(0))
  assert general == [1, 1]
