"""Where a repeated eager step spends its Python time, with PyTorch eager beside it (issue 26).

Six workloads, each called in a loop without TinyJit:
  op1     `(x + 1).realize()` on a 1-element tensor
  expr8   an 8-op elementwise expression on 2^20 floats, realized
  mlp     an MLP training step (784-512-512-10, Adam)
  cnn     the examples/mnist.py CNN training step (Adam)
  gpt2    a GPT-2 training step (extra/models/gpt2.py, AdamW): 2 layers of GPT-2 small, batch 8 x 512 on CUDA; a tiny
          config (bench_gpt2.CPU_CONFIG) on CPU devices
  prefill SmolLM2-135M's prefill of a 512-token prompt (random weights of the real shapes, extra/models/llama.py,
          fixed shapes); 2 layers and 32 tokens on CPU devices
The last two are the issue's large-graph rows: beside the eager call, the same call under TinyJit in the same process
(the eager goal of GPT-2 is <= 1.2 x its TinyJit step); GPT-2 has no PyTorch row (bench_gpt2.py has one), the prefill
has bench_models.py's PyTorch reference (TorchLlama, the same weights and prompt; its logits read to the host, as
bench_models times it: ours stay on the device).

Per workload: the wall time of a step, its Python time, PyTorch eager's step, and a cProfile table splitting the
Python time into phases:
  graph    building the lazy graph (Tensor methods -> Functions -> LazyBuffers -> views), forward and optimizer
  autograd Tensor.backward (the walk over Functions and the gradient graphs they build)
  describe the creation trace's description (lazy_trace.describe: one pass over the bases made since the last
           schedule; the trace's appends are in graph and autograd)
  key      the rest of the schedule cache's structural key (schedule_cache._trace_tokens: the outputs' positions and
           the tuple) or, where the trace cannot describe the realize, the graph walk (schedule_cache._structure)
  lookup   the rest of scheduling: the comparison with the last traced entry, else the hash and the cache lookup,
           snapshots and packing (or scheduling a miss)
  replay   rebinding a cached schedule to this graph's buffers (schedule_cache._replay: fresh buffers, ScheduleItems;
           a one-kernel replay's schedule_cache._launch_replay, less its launch)
  memory   the memory plan (realize.plan_schedule_memory: a recorded plan replayed on a hit)
  lower    lowering ScheduleItems to ExecItems (compiled-kernel cache lookups) and the compile note
  rebind   a captured schedule's argument check (capture._rebind: each argument compared with the graph's)
  launch   ExecItem.run or a replayed item's launcher (realize.launch_replayed, realize.launch_one: from the schedule
           cache for a one-kernel replay, docs/jit.md): passing the arguments and the
           ctypes/driver call (the kernel itself excluded on the CPU), and a captured schedule's graph launch
           (engine/capture.py run_captured; EAGER_CAPTURE=0 launches item by item)
  other    the rest of realize (locks, the per-device split, freeing the last call's buffers)
Python time: on CUDA the host time of the calls (launches are asynchronous); on CPU devices, where kernels run on the
calling thread, the wall time with every compiled kernel replaced by a no-op; beside it the thread's CPU time
(time.thread_time) of the same calls, which a shared machine's other processes barely move: compare runs by it. The
profiled steps run with those no-ops too, so the phases add up to Python time (cProfile's overhead inflates each phase:
read the shares, and the unprofiled "Python per step" for the absolute figure).

Beside them, the thread CPU time the cyclic garbage collector took per call (gc.callbacks; GC_FREEZE_IMPORT=0 shows
it without the import-time freeze, ourgrad/__init__.py).

Run: `python extra/bench/bench_eager.py` (the default device: op1,expr8,mlp,cnn), `--device CLANG`, `--only op1,mlp`,
`--only gpt2,prefill`, `--no-torch`.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import os
import pathlib
import pstats
import sys
import time
from typing import Any, Callable, Iterator

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_jit import MLP, load_mnist_example, ourgrad_step, torch_mlp, torch_mnist  # noqa: E402

from ourgrad import Device, Tensor, TinyJit, get_float32_matmul_precision, set_float32_matmul_precision  # noqa: E402
from ourgrad.engine import realize  # noqa: E402
from ourgrad.helpers import GC_FREEZE_IMPORT  # noqa: E402

# (phase, file suffix, function name): a phase's time is the cumulative time of its functions
PHASE_FUNCTIONS = {
  "autograd": [("ourgrad/tensor.py", "backward")],
  "realize": [("ourgrad/tensor.py", "realize")],
  "describe": [("ourgrad/lazy_trace.py", "describe")],
  "key": [("ourgrad/engine/schedule_cache.py", "_structure"),
          ("ourgrad/engine/schedule_cache.py", "_trace_tokens")],
  "schedule": [("ourgrad/engine/schedule_cache.py", "schedule")],
  "replay": [("ourgrad/engine/schedule_cache.py", "_replay"), ("ourgrad/engine/schedule_cache.py", "_launch_replay")],
  # a one-kernel replay's launch, made inside the schedule cache (inside schedule and _launch_replay)
  "launch_one": [("ourgrad/engine/realize.py", "launch_one")],
  "memory": [("ourgrad/engine/realize.py", "plan_schedule_memory")],
  "lower": [("ourgrad/engine/realize.py", "lower_schedule_item"), ("ourgrad/engine/realize.py", "note_compiles")],
  "rebind": [("ourgrad/engine/capture.py", "_rebind")],
  "launch": [("ourgrad/engine/exec_item.py", "run"), ("ourgrad/engine/capture.py", "run_captured"),
             ("ourgrad/engine/realize.py", "launch_replayed"), ("ourgrad/engine/realize.py", "launch_one")],
}
PHASES = ("graph", "autograd", "describe", "key", "lookup", "replay", "memory", "lower", "rebind", "launch", "other")


@contextlib.contextmanager
def host_kernels_disabled(enabled: bool) -> Iterator[None]:
  """Every compiled host kernel does nothing inside this block (kernels already compiled: run the step first)."""
  if not enabled:
    yield
    return

  def nothing(*pointers: Any) -> None: return None
  runners = [runner for runner in realize._runner_cache.values() if runner.host_function is not None]
  saved = [runner.host_function for runner in runners]
  try:
    # (launchers read a runner's host_function at each launch: ExecItems keep theirs)
    for runner in runners: runner.host_function = nothing
    yield
  finally:
    for runner, function in zip(runners, saved): runner.host_function = function


@contextlib.contextmanager
def collector_time() -> Iterator[list[float]]:
  """[thread CPU seconds the cyclic garbage collector ran in this block, collections], filled in as it runs."""
  spent = [0.0, 0.0]
  started = [0.0]

  def note(phase: str, info: dict) -> None:
    if phase == "start": started[0] = time.thread_time()
    else: spent[0], spent[1] = spent[0] + time.thread_time() - started[0], spent[1] + 1
  gc.callbacks.append(note)
  try:
    yield spent
  finally:
    gc.callbacks.remove(note)


def cumulative(stats: pstats.Stats, suffix: str, name: str) -> float:
  """Cumulative seconds of the function `name` in a file ending with `suffix` (0 if never called)."""
  total = 0.0
  for (filename, _, function), (_, _, _, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
    if function == name and filename.endswith(suffix): total += cumtime
  return total


def phase_seconds(profile: cProfile.Profile, total: float) -> dict[str, float]:
  """Seconds per phase (PHASES) of a profile whose profiled calls took `total` seconds."""
  stats = pstats.Stats(profile)
  raw = {phase: sum(cumulative(stats, suffix, name) for suffix, name in functions)
         for phase, functions in PHASE_FUNCTIONS.items()}
  # (describe runs inside the key's functions, _replay and the key inside schedule, _rebind inside run_captured)
  phases = {"autograd": raw["autograd"], "describe": raw["describe"], "key": raw["key"] - raw["describe"],
            "lookup": raw["schedule"] - raw["key"] - raw["replay"], "replay": raw["replay"] - raw["launch_one"],
            "memory": raw["memory"], "lower": raw["lower"], "rebind": raw["rebind"],
            "launch": raw["launch"] - raw["rebind"]}
  # (launch_one runs inside schedule: counted once)
  ran = raw["schedule"] + raw["memory"] + raw["lower"] + raw["launch"] - raw["launch_one"]
  phases["other"] = max(0.0, raw["realize"] - ran)
  phases["graph"] = max(0.0, total - raw["autograd"] - raw["realize"])
  return phases


def top_functions(profile: cProfile.Profile, count: int) -> list[tuple[str, float, int]]:
  """The `count` functions with the most own time: (where, seconds, calls)."""
  stats = pstats.Stats(profile)
  rows = [(f"{pathlib.Path(filename).name}:{line}({function})", tottime, calls)
          for (filename, line, function), (_, calls, tottime, _, _) in stats.stats.items()]  # type: ignore[attr-defined]
  return sorted(rows, key=lambda row: -row[1])[:count]


# ---------------------------------------------------------------- workloads: (step, sync) on a device

def op1_step(device: str, batch: int) -> Callable[[], Any]:
  x = Tensor([1.0], device=device).realize()
  return lambda: (x + 1).realize()


def expr8(x: Any, constant: float) -> Any:
  return ((((x * constant + 1.5).exp2() - 0.25).sqrt() * x).relu() + constant).log2()


def expr8_step(device: str, batch: int) -> Callable[[], Any]:
  x = Tensor.rand(1 << 20, device=device).realize()
  return lambda: expr8(x, 1.25).realize()


def training_step(make_model: Callable[[], Any], shape: tuple[int, ...]) -> Callable[[str, int], Callable[[], Any]]:
  def make(device: str, batch: int) -> Callable[[], Any]:
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((batch, *shape)).astype(np.float32), device=device).realize()
    y = Tensor(rng.integers(0, 10, batch).astype(np.int32), device=device).realize()
    step, _ = ourgrad_step(make_model())
    return lambda: step(x, y)
  return make


def gpt2_model_and_batch(device: str) -> tuple[Any, Tensor, Tensor]:
  """The gpt2 workload's model and fixed batch of random tokens (inputs, targets): 2 layers of GPT-2 small, batch
  8 x 512 on CUDA, bench_gpt2's tiny config elsewhere; TF32 matmuls allowed, as bench_gpt2.py runs it by default."""
  from bench_gpt2 import CPU_CONFIG, BenchConfig
  from extra.models.gpt2 import GPT2
  set_float32_matmul_precision("high")
  config = BenchConfig.parse("8,512,768,12,2,50304" if device == "CUDA" else CPU_CONFIG)
  model = GPT2(config.model)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, config.model.vocab_size, (config.batch, config.sequence + 1)).astype(np.int32)
  inputs = Tensor(tokens[:, :-1].copy(), device=device).realize()
  targets = Tensor(tokens[:, 1:].copy(), device=device).realize()
  return model, inputs, targets


def gpt2_step(jit: bool) -> Callable[[str, int], Callable[[], Any]]:
  """A GPT-2 training step (loss, backward, AdamW) on gpt2_model_and_batch, eager or under TinyJit."""
  def make(device: str, batch: int) -> Callable[[], Any]:
    from extra.models.gpt2 import configure_optimizers, training_step
    model, inputs, targets = gpt2_model_and_batch(device)
    step = training_step(model, configure_optimizers(model))
    if jit: step = TinyJit(step)
    return lambda: step(inputs, targets)
  return make


def prefill_step(jit: bool) -> Callable[[str, int], Callable[[], Any]]:
  """SmolLM2's prefill of one prompt from position 0 (random weights of the real shapes), eager or under the model's
  own TinyJit (Llama(..., jit=True)); full float32 matmuls, as bench_models.py runs it."""
  def make(device: str, batch: int) -> Callable[[], Any]:
    set_float32_matmul_precision("highest")
    from bench_models import SMOLLM2_135M, random_llama_weights
    from extra.models.llama import Llama
    cuda = device == "CUDA"
    config = SMOLLM2_135M if cuda else dataclasses.replace(SMOLLM2_135M, n_layers=2)
    length = 512 if cuda else 32
    weights = {name: Tensor(value, device=device) for name, value in random_llama_weights(config).items()}
    Tensor.realize_all(*weights.values())
    model = Llama(config, weights, length + 8, symbolic=False)
    prompt = np.random.default_rng(0).integers(100, config.vocab_size, (1, length)).astype(np.int32)
    return lambda: model(prompt, 0, jit=jit)
  return make


def torch_step(name: str, batch: int, cuda: bool) -> Callable[[], Any]:
  import torch
  device = "cuda" if cuda else "cpu"
  torch.manual_seed(0)
  if name == "prefill": return torch_prefill(device)
  if name == "op1":
    one = torch.ones(1, device=device)
    return lambda: one + 1
  if name == "expr8":
    x = torch.rand(1 << 20, device=device)
    return lambda: expr8(x, 1.25)
  model = (torch_mlp() if name == "mlp" else torch_mnist()).to(device)
  optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
  inputs = torch.randn(batch, *((784,) if name == "mlp" else (1, 28, 28)), device=device)
  labels = torch.randint(0, 10, (batch,), device=device)

  def step() -> Any:
    optimizer.zero_grad(set_to_none=False)
    loss = torch.nn.functional.cross_entropy(model(inputs), labels)
    loss.backward()
    optimizer.step()
    return loss
  return step


def torch_prefill(device: str) -> Callable[[], Any]:
  """`prefill_step`'s prompt through bench_models.py's PyTorch SmolLM2 (the same random weights), without gradients."""
  import torch
  from bench_models import SMOLLM2_135M, TorchLlama, random_llama_weights
  cuda = device == "cuda"
  config = SMOLLM2_135M if cuda else dataclasses.replace(SMOLLM2_135M, n_layers=2)
  length = 512 if cuda else 32
  reference = TorchLlama(config, random_llama_weights(config), device, length + 8)
  prompt = [int(t) for t in np.random.default_rng(0).integers(100, config.vocab_size, length)]

  def step() -> Any:
    with torch.no_grad(): return reference(prompt, 0)
  return step


def mean_seconds(step: Callable[[], Any], sync: Callable[[], None], calls: int,
                 clock: Callable[[], float] = time.perf_counter) -> float:
  """Mean seconds of a call: the best of 3 runs of `calls` calls (others share this machine's cores). With
  clock=time.thread_time, the CPU time of this thread: on a shared machine, waiting for a core does not count."""
  best = float("inf")
  for _ in range(3):
    sync()
    start = clock()
    for _ in range(calls): step()
    sync()
    best = min(best, (clock() - start) / calls)
  return best


def bench(name: str, make: Callable[[str, int], Callable[[], Any]], device: str, batch: int, calls: int,
          args: argparse.Namespace, make_jit: Callable[[str, int], Callable[[], Any]] | None = None) -> dict[str, Any]:
  """The figures of one workload (print_result); with `make_jit`, the same call under TinyJit beside the eager one
  (and no PyTorch row)."""
  step = make(device, batch)
  sync = Device[device].synchronize
  for _ in range(3): step()   # compile, fill the schedule cache, bind launchers
  sync()
  result: dict[str, Any] = {"wall": mean_seconds(step, sync, calls)}
  host = device != "CUDA"
  with host_kernels_disabled(host):
    result["python"] = mean_seconds(step, sync if host else lambda: None, calls)
    with collector_time() as collector:
      result["python_cpu"] = mean_seconds(step, sync if host else lambda: None, calls, time.thread_time)
    result["gc"] = (collector[0] / (3 * calls), collector[1] / (3 * calls))   # (mean_seconds runs 3 x calls)
    sync()
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(calls): step()
    profile.disable()
    total = time.perf_counter() - start
    sync()
  result["phases"] = {phase: seconds / calls for phase, seconds in phase_seconds(profile, total).items()}
  result["profiled"] = total / calls
  result["top"] = [(where, seconds / calls, count // calls) for where, seconds, count in
                   top_functions(profile, args.top)]
  if make_jit is not None:
    jitted = make_jit(device, batch)
    for _ in range(3): jitted()   # captured on the second call, replayed from the third
    result["jit"] = mean_seconds(jitted, sync, calls)
  if not args.no_torch and name != "gpt2":
    import torch
    cuda = device == "CUDA"
    theirs = torch_step(name, batch, cuda)
    for _ in range(3): theirs()
    result["torch"] = mean_seconds(theirs, torch.cuda.synchronize if cuda else (lambda: None), calls)
  return result


def print_result(name: str, label: str, result: dict[str, Any]) -> None:
  def us(seconds: float) -> str: return f"{seconds * 1e6:9.1f} us"
  print(f"## {name}: {label}")
  print(f"wall per call {us(result['wall'])} | Python per call {us(result['python'])} (CPU time of the thread: "
        f"{us(result['python_cpu'])})"
        + (f" | PyTorch eager {us(result['torch'])}" if "torch" in result else "")
        + (f" | TinyJit {us(result['jit'])} (eager / TinyJit {result['wall'] / result['jit']:.2f}x)"
           if "jit" in result else ""))
  print(f"cyclic garbage collector: {us(result['gc'][0])} of thread CPU time per call, {result['gc'][1]:.2f} "
        f"collections per call (GC_FREEZE_IMPORT={os.environ.get('GC_FREEZE_IMPORT', '1')}, first-generation "
        f"threshold {gc.get_threshold()[0]})")
  profiled = result["profiled"]
  print("| phase    | profiled us | share |\n| -------- | ----------- | ----- |")
  for phase in PHASES:
    seconds = result["phases"][phase]
    print(f"| {phase:<8} | {seconds * 1e6:11.1f} | {seconds / profiled * 100:4.0f}% |")
  print(f"| total    | {profiled * 1e6:11.1f} |  100% |")
  print("top functions by own time (profiled us per call, calls per call):")
  for where, seconds, count in result["top"]: print(f"  {seconds * 1e6:9.1f} {count:6d}  {where}")
  print()


def freeze_torch_import() -> None:
  """Import PyTorch (for its rows) before anything is timed, and freeze what its import made as `import ourgrad` does
  for its own (GC_FREEZE_IMPORT): imported mid-run, its ~10^5 module objects were scanned by every full pass of the
  collector in ourgrad's steps (the H200's CNN step: 2.7 ms of collector time a call), a cost of the comparison, not
  of ourgrad's eager path."""
  import torch  # noqa: F401
  if GC_FREEZE_IMPORT: gc.freeze()


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default=Device.DEFAULT)
  parser.add_argument("--only", default="op1,expr8,mlp,cnn", help="comma-separated workloads (also: gpt2, prefill)")
  parser.add_argument("--batch", type=int, default=0, help="training batch (default: 512 MLP / 256 CNN on CUDA, 64 on "
                      "CPU devices)")
  parser.add_argument("--calls", type=int, default=0, help="calls per timing (default: 1000 op1, 100 expr8, 20 steps, "
                      "5 GPT-2 steps or prefills)")
  parser.add_argument("--top", type=int, default=12, help="functions listed by own time")
  parser.add_argument("--no-torch", action="store_true")
  args = parser.parse_args()
  if not args.no_torch: freeze_torch_import()
  device = Device.canonicalize(args.device)
  os.environ["DEVICE"] = device   # models and optimizer state are made on the default device
  # torch's libgomp spinning beside ourgrad's CPU kernels slowed them several times on a shared machine (bench_gpt2)
  if device != "CUDA": os.environ.setdefault("OMP_WAIT_POLICY", "passive")
  cuda = device == "CUDA"
  mnist = load_mnist_example()
  workloads = {
    "op1": ("(x + 1).realize(), 1 element", op1_step, 1, 1000),
    "expr8": ("8-op elementwise expression on 2^20 floats", expr8_step, 1, 100),
    "mlp": ("MLP step 784-512-512-10, Adam", training_step(MLP, (784,)), 512 if cuda else 64, 20),
    "cnn": ("examples/mnist.py CNN step, Adam", training_step(lambda: mnist.ConvNet(mnist.MODELS["small"]),
                                                               (1, 28, 28)), 256 if cuda else 64, 20),
    "gpt2": ("GPT-2 step, 2 layers, AdamW, " + ("batch 8 x 512" if cuda else "tiny config"), gpt2_step(False), 0, 5),
    "prefill": (f"SmolLM2 prefill, {'30 layers, 512' if cuda else '2 layers, 32'} tokens", prefill_step(False), 0, 5),
  }
  jitted = {"gpt2": gpt2_step(True), "prefill": prefill_step(True)}
  print(f"device: {device}")
  for name in args.only.split(","):
    label, make, batch, calls = workloads[name]
    batch = args.batch or batch if name in ("mlp", "cnn") else batch
    precision = get_float32_matmul_precision()   # (the large-graph workloads set their own: restored after each)
    result = bench(name, make, device, batch, args.calls or calls, args, jitted.get(name))
    set_float32_matmul_precision(precision)
    print_result(name, label + (f", batch {batch}" if name in ("mlp", "cnn") else ""), result)


if __name__ == "__main__":
  main()
