"""Training-step benchmark: ourgrad eager vs ourgrad TinyJit vs PyTorch eager (and PyTorch with the whole step in
one CUDA graph on CUDA), for an MLP (784-512-512-10, Adam) and the examples/mnist.py CNN (batch 256), plus the
Python time of a replayed step, the launch cost of a 1-element kernel and the first result of a never-seen
8-op elementwise expression (code generation and compilation included).

Method: each step time is the mean of `--steps` steps after `--warmup` steps, synchronizing once at the end.
"Python per replayed/eager step" is the host time of a step: on CUDA the calls return before the GPU is done, so
it is their wall time; on the CPU, where kernels run on the calling thread, it is the wall time of the same steps
with every compiled kernel replaced by a no-op (graph building, scheduling, launching and the ctypes calls remain).
Run: `python extra/bench/bench_jit.py` (CUDA when present, else the CPU); `--device CLANG` forces the CPU;
`--replay-only` prints only the Python per replayed step, split into TinyJit's Python and the launch; `--only launch`
only the launch rows (the 1-element kernel through ExecItem.run, and PyTorch's).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib.util
import os
import pathlib
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad, not an installed one
from ourgrad import Device, Tensor, TinyJit  # noqa: E402
from ourgrad.engine import realize
from ourgrad.engine.realize import lower_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.nn import Linear
from ourgrad.nn.losses import cross_entropy
from ourgrad.nn.optim import Adam
from ourgrad.nn.state import get_parameters

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_mnist_example() -> Any:
  spec = importlib.util.spec_from_file_location("mnist_example", ROOT / "examples" / "mnist.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def mean_seconds(step: Callable[[], Any], sync: Callable[[], None], steps: int, warmup: int) -> float:
  for _ in range(warmup): step()
  sync()
  start = time.perf_counter()
  for _ in range(steps): step()
  sync()
  return (time.perf_counter() - start) / steps


# ---------------------------------------------------------------- ourgrad

class MLP:
  def __init__(self) -> None:
    self.layers = [Linear(784, 512), Linear(512, 512), Linear(512, 10)]

  def __call__(self, x: Tensor) -> Tensor:
    for layer in self.layers[:-1]: x = layer(x).relu()
    return self.layers[-1](x)


def ourgrad_step(model: Any) -> tuple[Callable[[Tensor, Tensor], Tensor], Any]:
  """One Adam training step of `model` (made on the default device, which main() sets)."""
  trainable = [tensor for tensor in get_parameters(model) if tensor.requires_grad]
  stats = [tensor for tensor in get_parameters(model) if not tensor.requires_grad]
  optimizer = Adam(trainable, lr=1e-3)

  def step(x: Tensor, y: Tensor) -> Tensor:
    with Tensor.train():
      optimizer.zero_grad()
      loss = cross_entropy(model(x), y)
      loss.backward()
      Tensor.realize_all(loss, *optimizer.schedule_step(), *stats)
    return loss
  return step, optimizer


def bench_ourgrad(name: str, make_model: Callable[[], Any], input_shape: tuple[int, ...], batch: int, device: str,
                  args: argparse.Namespace) -> dict[str, float]:
  rng = np.random.default_rng(0)
  x = Tensor(rng.standard_normal((batch, *input_shape)).astype(np.float32), device=device).realize()
  y = Tensor(rng.integers(0, 10, batch).astype(np.int32), device=device).realize()
  sync = Device[device].synchronize
  eager_step, _ = ourgrad_step(make_model())
  eager = mean_seconds(lambda: eager_step(x, y), sync, args.steps, args.warmup)
  jit_step = TinyJit(ourgrad_step(make_model())[0])
  jitted = mean_seconds(lambda: jit_step(x, y), sync, args.steps, args.warmup)
  replay_python, replay_launch = replay_host_seconds(jit_step, x, y, device, max(args.steps, args.replay_steps))
  replay_new_python, replay_new_launch = replay_host_seconds(jit_step, x, y, device,
                                                             max(args.steps, args.replay_steps), new_inputs=True)
  if device == "CUDA":  # launches are asynchronous: the host time of a call is its Python time
    # one warm-up step first: the TinyJit runs above leave the eager step's first call slower (session 8 printed a
    # Python time above the eager step's own wall time, 11.4 vs 6.9 ms, with 20 steps and no warm-up)
    eager_python = mean_seconds(lambda: eager_step(x, y), lambda: None, args.steps, 1)
    sync()
  else:  # kernels run on the calling thread: time the same calls with every kernel replaced by a no-op
    with host_kernels_disabled(jit_step):
      eager_python = mean_seconds(lambda: eager_step(x, y), sync, args.steps, 1)
  return {"eager": eager, "jit": jitted, "replay_python": replay_python, "replay_launch": replay_launch,
          "replay_new_python": replay_new_python, "replay_new_launch": replay_new_launch,
          "eager_python": eager_python, "kernels": len(jit_step.captured.items)}


def replay_host_seconds(jit_step: TinyJit, x: Tensor, y: Tensor, device: str, calls: int,
                        new_inputs: bool = False) -> tuple[float, float]:
  """(host seconds per replayed call, the part of it spent in the launch itself), medians over `calls` calls (a
  call that the OS preempted on a busy machine does not move a median). Each call is timed on its own and the
  device is synchronized between batches of calls outside the timed part, so a full launch queue never blocks a
  timed call. On CUDA launches are asynchronous, so the host time is the call's time; on CPU devices kernels run on
  the calling thread, so they are replaced by no-ops (the ctypes calls remain, and count as launch). The launch
  part is the graph launch on CUDA (argument patches included) and the loop of kernel calls on the CPU; the rest
  is TinyJit's Python (checking inputs, pointing input slots at new buffers, building the returned Tensors).
  `new_inputs`: calls alternate between two batches in other buffers, so every call patches the input slots (a
  training loop with a new batch each step); otherwise every call passes the same buffers (nothing to patch)."""
  while jit_step.captured is None: jit_step(x, y)  # run and capture
  batches = [(x, y), (Tensor(x.numpy(), device=device).realize(), Tensor(y.numpy(), device=device).realize())]
  if not new_inputs: batches = batches[:1]
  runner = jit_step.captured.replay_runner
  launch_times: list[float] = []
  original_run = runner.run

  def timed_run() -> None:
    start = time.perf_counter()
    original_run()
    launch_times.append(time.perf_counter() - start)

  sync = Device[device].synchronize
  call_times: list[float] = []
  context = contextlib.nullcontext() if device == "CUDA" else host_kernels_disabled(jit_step)
  with context:
    for _ in range(3): jit_step(x, y)
    sync()
    runner.run = timed_run
    try:
      for call in range(calls):
        inputs = batches[call % len(batches)]
        start = time.perf_counter()
        jit_step(*inputs)
        call_times.append(time.perf_counter() - start)
        if call % 10 == 9: sync()
    finally:
      del runner.run
    sync()
  return float(np.median(call_times)), float(np.median(launch_times))


@contextlib.contextmanager
def host_kernels_disabled(jit_step: TinyJit) -> Iterator[None]:
  """Every compiled host kernel (eager runners and the JIT's replayed calls) does nothing inside this block, so a
  step's wall time is its Python time (plus the ctypes calls' cost, which is Python's too). A CLANG replay's
  dispatcher (runtime/host_calls.py) calls a C function that does nothing instead of each kernel."""
  def nothing(*pointers: Any) -> None: return None
  runners = [runner for runner in realize._runner_cache.values() if runner.host_function is not None]
  saved = [runner.host_function for runner in runners]
  replay = jit_step.captured.replay_runner
  host_calls = getattr(replay, "host_calls", None)
  graph = getattr(replay, "graph", None)
  table = getattr(graph, "table", None)
  saved_calls = list(host_calls) if host_calls is not None else []
  saved_table = [row.function for row in table] if table is not None else []
  saved_steps = list(graph.steps) if table is not None else []
  try:
    for runner in runners: runner.host_function = nothing
    if host_calls is not None:
      replay.host_calls = [(nothing, call[1]) if call is not None else None for call in host_calls]
    if table is not None:
      # (called with the kernel's arguments, which a C function of none ignores on the host ABIs ourgrad runs on)
      clang = Device["CLANG"]
      empty = clang.program("og_nothing", clang.compiler.compile_cached("void og_nothing(void) {}\n")).function
      for row in table: row.function = ctypes.cast(empty, ctypes.c_void_p).value
      # kernels with more arguments than the dispatcher covers are called through ctypes between its runs
      graph.steps = [(function if function is graph.caller else nothing, arguments)
                     for function, arguments in saved_steps]
    yield
  finally:
    for runner, function in zip(runners, saved): runner.host_function = function
    if host_calls is not None: replay.host_calls = saved_calls
    for row, function in zip(table if table is not None else [], saved_table): row.function = function
    if table is not None: graph.steps = saved_steps


# ---------------------------------------------------------------- PyTorch

def bench_torch(make_model: Callable[[], Any], input_shape: tuple[int, ...], batch: int, cuda: bool,
                args: argparse.Namespace) -> dict[str, float]:
  import torch
  device = "cuda" if cuda else "cpu"
  torch.manual_seed(0)
  model = make_model().to(device)
  optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=cuda)
  x = torch.randn(batch, *input_shape, device=device)
  y = torch.randint(0, 10, (batch,), device=device)
  sync = torch.cuda.synchronize if cuda else (lambda: None)

  def step() -> Any:
    optimizer.zero_grad(set_to_none=False)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    return loss
  model.train()
  results = {"eager": mean_seconds(step, sync, args.steps, args.warmup)}
  if cuda:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
      for _ in range(3): step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph): step()
    results["graph"] = mean_seconds(graph.replay, sync, args.steps, args.warmup)
  return results


def torch_mlp() -> Any:
  import torch
  return torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                             torch.nn.Linear(512, 10))


def torch_mnist() -> Any:
  import torch
  layers: list[Any] = []
  channels = 1
  for out_channels in (16, 32):
    layers += [torch.nn.Conv2d(channels, out_channels, 5, bias=False), torch.nn.BatchNorm2d(out_channels),
               torch.nn.ReLU(), torch.nn.MaxPool2d(2)]
    channels = out_channels
  return torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 10))


# ---------------------------------------------------------------- small costs

def launch_cost(device: str, iters: int) -> float:
  """Seconds per launch of a lowered 1-element kernel through ExecItem.run (no scheduling), synchronized at the end."""
  x = Tensor([1.0], device=device).realize()
  (item,) = lower_schedule(create_schedule([(x + 1).lazydata]))
  return mean_seconds(item.run, Device[device].synchronize, iters, 10)


def torch_launch_cost(cuda: bool, iters: int) -> float:
  import torch
  x = torch.ones(1, device="cuda" if cuda else "cpu")
  return mean_seconds(lambda: x.add_(1), torch.cuda.synchronize if cuda else (lambda: None), iters, 10)


def eager_op_cost(device: str, iters: int) -> float:
  """Seconds per `(x + 1).realize()` of a 1-element tensor: the whole eager path of one small op (graph building, the
  schedule cache, lowering, launch), synchronized at the end."""
  x = Tensor([1.0], device=device).realize()
  return mean_seconds(lambda: (x + 1).realize(), Device[device].synchronize, iters, 10)


def torch_op_cost(cuda: bool, iters: int) -> float:
  import torch
  x = torch.ones(1, device="cuda" if cuda else "cpu")
  return mean_seconds(lambda: x + 1, torch.cuda.synchronize if cuda else (lambda: None), iters, 10)


def first_result_seconds(device: str, samples: int = 5) -> tuple[float, float, float]:
  """Build, generate, compile and run an 8-op elementwise expression whose constants make its source new: (median,
  fastest, slowest) seconds over `samples` such expressions, each new (one sample moved 42-58 ms between H100 runs)."""
  rng = np.random.default_rng(int(time.time() * 1e6) % 2**32)
  times = []
  for _ in range(samples):
    constant = float(rng.random()) + 1.0
    x = Tensor.randn(4096, device=device).realize()
    start = time.perf_counter()
    value = ((((x * constant + 1.5).exp2() - 0.25).sqrt() * x).relu() + constant).log2().numpy()
    times.append(time.perf_counter() - start)
    assert value.shape == (4096,)
  return float(np.median(times)), min(times), max(times)


def first_result_row(device: str) -> tuple[str, str]:
  median, fastest, slowest = first_result_seconds(device)
  return ("first result of a new 8-op elementwise expression (median of 5 new ones)",
          f"{median * 1e3:.3f} ms ({fastest * 1e3:.1f}-{slowest * 1e3:.1f})")


# ---------------------------------------------------------------- LLM-style decode with a symbolic position

def load_toy_decoder() -> Any:
  """ToyDecoder from test/test_symbolic_jit.py (the model the test checks against numpy)."""
  spec = importlib.util.spec_from_file_location("symbolic_jit_test", ROOT / "test" / "test_symbolic_jit.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.ToyDecoder


@contextlib.contextmanager
def counted_compiles() -> Iterator[list[str]]:
  """Every kernel compiled inside the block (the in-memory kernel cache emptied first, so each one counts)."""
  names: list[str] = []
  original = realize.compile_kernel
  realize._runner_cache.clear()

  def counting(kernel: Any, device: str) -> Any:
    names.append(kernel.name)
    return original(kernel, device)

  realize.compile_kernel = counting
  try:
    yield names
  finally:
    realize.compile_kernel = original


def bench_decode(device: str, positions: int) -> dict[str, Any]:
  """A 4-layer toy transformer decoding `positions` tokens with a KV cache: TinyJit with the position a bound
  Variable, and eager with the position a plain int (new kernels at every position). Seconds per token (compiles
  included: the point is what a new position costs) and kernels compiled."""
  from ourgrad.shape import Variable
  ToyDecoder = load_toy_decoder()  # noqa: N806 (a class)
  tokens = np.random.default_rng(0).standard_normal((positions, 16)).astype(np.float32)
  results: dict[str, Any] = {}
  outputs: dict[str, list[np.ndarray]] = {}
  for mode in ("symbolic", "plain"):
    model = ToyDecoder(max_len=positions)
    step = TinyJit(model.step) if mode == "symbolic" else model.step
    pos_var = Variable("pos", 0, positions - 1)
    outputs[mode] = []
    with counted_compiles() as compiled:
      start = time.perf_counter()
      for pos in range(positions):
        outputs[mode].append(step(Tensor(tokens[pos:pos + 1], device=device),
                                  pos_var.bind(pos) if mode == "symbolic" else pos).numpy())
      results[mode] = ((time.perf_counter() - start) / positions, len(compiled))
  # the jitted symbolic decode (one device graph on CUDA) checked against the eager one, token for token
  results["max_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(outputs["symbolic"], outputs["plain"]))
  return results


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default=Device.DEFAULT)
  parser.add_argument("--steps", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--no-torch", action="store_true")
  parser.add_argument("--decode-positions", type=int, default=100)
  parser.add_argument("--replay-steps", type=int, default=200, help="calls timed for the Python per replayed step")
  parser.add_argument("--replay-only", action="store_true",
                      help="only the Python per replayed step (the host cost of TinyJit's replay) of both workloads")
  parser.add_argument("--only", choices=["launch", "first"],
                      help="launch: only the launch rows of a 1-element kernel; first: only the first-result row")
  args = parser.parse_args()
  device = Device.canonicalize(args.device)
  os.environ["DEVICE"] = device  # models and optimizer state are made on the default device
  cuda = device == "CUDA"
  if args.only == "launch":
    print_rows(device, launch_rows(device, cuda, args.no_torch))
    return
  if args.only == "first":
    print_rows(device, [first_result_row(device)])
    return
  mnist = load_mnist_example()
  workloads = [("MLP step", MLP, (784,), 512 if cuda else 256, torch_mlp),
               ("MNIST CNN step", lambda: mnist.ConvNet(mnist.MODELS["small"]), (1, 28, 28), 256, torch_mnist)]
  rows: list[tuple[str, str]] = []

  def ms(seconds: float) -> str: return f"{seconds * 1e3:.3f} ms"
  if args.replay_only:
    for name, make_model, shape, batch, _ in workloads:
      x, y = Tensor.randn(batch, *shape).realize(), Tensor(np.arange(batch, dtype=np.int32) % 10).realize()
      jit_step = TinyJit(ourgrad_step(make_model())[0])
      for new_inputs, inputs_label in ((False, "same inputs"), (True, "new input buffers each call")):
        seconds, launch = replay_host_seconds(jit_step, x, y, device, args.replay_steps, new_inputs)
        rows.append((f"{name} (batch {batch}, {len(jit_step.captured.items)} kernels), Python per replayed step, "
                     f"{inputs_label}", f"{seconds * 1e6:.1f} us (launch {launch * 1e6:.1f} us of it; medians)"))
    print_rows(device, rows)
    return
  for name, make_model, shape, batch, make_torch in workloads:
    ours = bench_ourgrad(name, make_model, shape, batch, device, args)
    rows += [(f"{name} (batch {batch}), ourgrad eager", ms(ours["eager"])),
             (f"{name} (batch {batch}), ourgrad TinyJit ({ours['kernels']} kernels)", ms(ours["jit"])),
             (f"{name}, Python per replayed step", f"{ours['replay_python'] * 1e6:.1f} us (launch "
              f"{ours['replay_launch'] * 1e6:.1f} us of it; medians)"),
             (f"{name}, Python per replayed step, new input buffers each call",
              f"{ours['replay_new_python'] * 1e6:.1f} us (launch {ours['replay_new_launch'] * 1e6:.1f} us of it; "
              f"medians)"),
             (f"{name}, Python per eager step", ms(ours["eager_python"]))]
    if not args.no_torch:
      theirs = bench_torch(make_torch, shape, batch, cuda, args)
      rows.append((f"{name} (batch {batch}), PyTorch eager", ms(theirs["eager"])))
      if "graph" in theirs: rows.append((f"{name} (batch {batch}), PyTorch CUDA graph", ms(theirs["graph"])))
  rows += launch_rows(device, cuda, args.no_torch)
  rows.append(("1-element op (x + 1).realize(), whole eager path", f"{eager_op_cost(device, 2000) * 1e6:.1f} us"))
  if not args.no_torch:
    rows.append(("1-element op x + 1, PyTorch", f"{torch_op_cost(cuda, 2000) * 1e6:.1f} us"))
  rows.append(first_result_row(device))
  decode = bench_decode(device, args.decode_positions)
  for mode, label in (("symbolic", "symbolic position, TinyJit"), ("plain", "position as int, eager")):
    seconds, compiles = decode[mode]
    rows.append((f"LLM-style decode (4-layer toy transformer, {args.decode_positions} positions), {label}",
                 f"{ms(seconds)} per token, {compiles} kernels compiled"))
  rows.append(("LLM-style decode, TinyJit vs eager outputs", f"max |difference| {decode['max_diff']:.2e}"))
  print_rows(device, rows)


def launch_rows(device: str, cuda: bool, no_torch: bool) -> list[tuple[str, str]]:
  rows = [("launch of a 1-element kernel (ExecItem.run)", f"{launch_cost(device, 2000) * 1e6:.1f} us")]
  if not no_torch:
    rows.append(("launch of a 1-element kernel, PyTorch", f"{torch_launch_cost(cuda, 2000) * 1e6:.1f} us"))
  return rows


def print_rows(device: str, rows: list[tuple[str, str]]) -> None:
  width = max(len(label) for label, _ in rows)
  print(f"device: {device}")
  print(f"| {'workload'.ljust(width)} | time |\n| {'-' * width} | --- |")
  for label, value in rows: print(f"| {label.ljust(width)} | {value} |")


if __name__ == "__main__":
  main()
