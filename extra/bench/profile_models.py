"""Per-kernel device times of the jitted SmolLM2 prefill and the jitted MiniLM batch (random weights of the real
shapes, as `bench_models.py --random-weights`), for finding which kernels keep them from their goals.

Two views of the same captured kernels:
- the script itself launches every captured kernel alone (`ExecItem.run(wait=True)`: CUDA events around each launch)
  and prints a table grouped by kernel (same name = same generated code, e.g. one per layer): launches, summed
  device time, the share of the total, GFLOP/s and GB/s from the kernel's op and byte counts, and a guess of what
  the kernel is (matmul, softmax, norm, ...) read off its AST;
- under Nsight Compute only one whole replay (between cuProfilerStart and cuProfilerStop) is profiled:
    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \\
        python extra/bench/profile_models.py --workload prefill

    python extra/bench/profile_models.py --workload prefill [--prefill 512]
    python extra/bench/profile_models.py --workload minilm
    python extra/bench/profile_models.py --workload decode [--sequences 8] [--weights bfloat16|q8_0|stored]
    python extra/bench/profile_models.py --workload decode --weights bfloat16 --timed 64 --no-table   (tokens/s)
    python extra/bench/profile_models.py --workload decode --timed 64 --decode-rows q8_0:1 bfloat16:1 bfloat16:8
Without a GPU, `--device CLANG` runs the same (slowly, with `--layers 2` for a smoke test); on a shared CPU
`OMP_NUM_THREADS=1 ... --device CLANG --cpu-time` gives per-kernel figures the other jobs do not change.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import pathlib
import statistics
import sys
import time
from collections import defaultdict
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_models import MINILM_L6, SMOLLM2_135M, minilm_weights, random_llama_weights  # noqa: E402

from ourgrad import Device, Tensor, TinyJit, dtypes  # noqa: E402
from ourgrad.engine.exec_item import CompiledRunner, ExecItem  # noqa: E402
from ourgrad.nn.gguf import GGML_Q8_0, PackedTensor, quantize_q8_0  # noqa: E402
from ourgrad.nn.state import load_state_dict  # noqa: E402

from extra.models.bert import BertEncoder  # noqa: E402

from extra.models.generate import smollm2_path  # noqa: E402
from extra.models.llama import Llama, cast_weights  # noqa: E402


def kernel_kind(source: str) -> str:
  """What a kernel's generated source contains (loops, accumulators, exp2, sqrt, max, where), so that a reader of
  the table can place it: "loop acc" is a reduce (a matmul when its FLOP/s are high), "exp2 max" softmax-like,
  "sqrt" a norm, "where" a mask or a cache write."""
  text = source.lower()
  features = [("for (", "loop"), ("acc", "acc"), ("exp2", "exp2"), ("sqrt", "sqrt"), ("max", "max"),
              ("?", "where")]
  found = [label for needle, label in features if needle in text]
  return " ".join(found) or "elementwise"


def replay_items(jit: TinyJit) -> list[ExecItem]:
  if jit.captured is None: raise RuntimeError("the TinyJit has not captured yet (it needs two calls)")
  return jit.captured.items


def thread_seconds(item: ExecItem) -> float:
  """The CPU time of this thread running `item` once (a host kernel runs on the calling thread; with
  OMP_NUM_THREADS=1 that is all of it): unlike wall time, the same on a CPU that other jobs share."""
  started = time.thread_time()
  item.run(wait=True)
  return time.thread_time() - started


def per_kernel_table(items: list[ExecItem], repeats: int, cpu_time: bool = False) -> None:
  """Launch each captured item alone `repeats` times (median device time, or this thread's CPU time with
  `cpu_time`) and print the table grouped by name."""
  groups: dict[str, dict[str, Any]] = defaultdict(lambda: {"launches": 0, "seconds": 0.0, "ops": 0, "bytes": 0})
  order: list[str] = []
  for item in items:
    times = [thread_seconds(item) if cpu_time else item.run(wait=True) or 0.0 for _ in range(repeats)]
    runner = item.runner
    name = runner.name if isinstance(runner, CompiledRunner) else type(runner).__name__
    if name not in groups:
      order.append(name)
      groups[name]["kind"] = kernel_kind(runner.source) if isinstance(runner, CompiledRunner) else "copy"
      groups[name]["sizes"] = (getattr(runner, "global_size", ()), getattr(runner, "local_size", ()))
    group = groups[name]
    group["launches"] += 1
    group["seconds"] += statistics.median(times)
    group["ops"] += runner.op_count
    group["bytes"] += runner.byte_count
  total = sum(group["seconds"] for group in groups.values())
  print(f"{len(items)} launches, {len(groups)} distinct kernels, summed device time {total * 1e6:.1f} us")
  print(f"{'kernel':<40} {'n':>4} {'us':>9} {'%':>5} {'GFLOP/s':>8} {'GB/s':>7}  kind; global/local")
  for name in sorted(order, key=lambda n: -groups[n]["seconds"]):
    group = groups[name]
    seconds = max(group["seconds"], 1e-12)
    share = 100 * group["seconds"] / total
    print(f"{name[:40]:<40} {group['launches']:>4} {group['seconds'] * 1e6:>9.1f} {share:>5.1f} "
          f"{group['ops'] / seconds / 1e9:>8.1f} {group['bytes'] / seconds / 1e9:>7.1f}  {group['kind']}; "
          f"{group['sizes'][0]}/{group['sizes'][1]}")
  print("first-layer order: " + " ".join(order[:40]))


def profiled_replay(device: str, call: Callable[[], Any]) -> float:
  """One replay between cuProfilerStart and cuProfilerStop (what ncu --profile-from-start off sees); host seconds."""
  Device[device].synchronize()
  driver = ctypes.CDLL("libcuda.so.1") if device == "CUDA" else None
  if driver is not None: driver.cuProfilerStart()
  started = time.perf_counter()
  call()
  Device[device].synchronize()
  seconds = time.perf_counter() - started
  if driver is not None: driver.cuProfilerStop()
  return seconds


def prefill_workload(args: argparse.Namespace) -> tuple[TinyJit, Callable[[], Any]]:
  config = dataclasses.replace(SMOLLM2_135M, n_layers=args.layers or SMOLLM2_135M.n_layers)
  weights = {name: Tensor(value, device=args.device) for name, value in random_llama_weights(config).items()}
  Tensor.realize_all(*weights.values())
  model = Llama(config, weights, max_context=args.prefill + 8)
  rng = np.random.default_rng(0)
  tokens = Tensor(rng.integers(100, config.vocab_size, (1, args.prefill)).astype(np.int32), device=args.device)

  def call() -> Any: return model(tokens, 0, jit=True).numpy()
  for _ in range(3): call()
  return model.prefill_jit_for(0, args.prefill), call


def random_weight_llama(args: argparse.Namespace) -> Llama:
  """SmolLM2's shapes with random weights kept as `--weights` says (float32, bfloat16, float16 or q8_0)."""
  config = dataclasses.replace(SMOLLM2_135M, n_layers=args.layers or SMOLLM2_135M.n_layers)
  host = random_llama_weights(config)
  weights: dict[str, Any] = {name: Tensor(value, device=args.device) for name, value in host.items()}
  Tensor.realize_all(*weights.values())
  if args.weights in ("bfloat16", "float16"): weights = cast_weights(weights, getattr(dtypes, args.weights))
  elif args.weights == "q8_0":
    weights = {name: PackedTensor.from_blocks(GGML_Q8_0, Tensor(quantize_q8_0(value), device=args.device),
                                              value.shape) if value.ndim == 2 else weights[name]
               for name, value in host.items()}
  return Llama(config, weights, max_context=args.context, symbolic=False, packed=args.weights == "q8_0",
               sequences=args.sequences)


def decode_workload(args: argparse.Namespace) -> tuple[TinyJit, Callable[[], Any]]:
  """One jitted SmolLM2 decode step (fixed shapes) of `--sequences` sequences, weights as `--weights` (float32,
  bfloat16, float16, or q8_0: every matrix quantized to Q8_0, kept packed), the cache of `--context` slots."""
  if args.weights == "stored":
    model, _ = Llama.from_gguf(smollm2_path(), args.context, args.device, symbolic=args.symbolic, dtype="stored",
                               sequences=args.sequences)
  else:
    model = random_weight_llama(args)
  tokens, positions = [5] * args.sequences, [getattr(args, "position", 8)] * args.sequences

  def call() -> Any: return model.decode(tokens, positions).numpy()
  for _ in range(3): call()
  if args.host_breakdown: host_breakdown(model, args)
  if args.timed: time_decode(model, call, args)
  return model._decode_jit, call


def time_decode(model: Llama, call: Callable[[], Any], args: argparse.Namespace) -> None:
  """Tokens/s of `args.timed` decode steps (median of 3 runs) two ways, as bench_models.py's rows: the logits of
  every step read on the host, and the steps fed back on the device (`generate_greedy`, the ids read once)."""
  results: list[Any] = []

  def median_seconds(run: Callable[[], Any]) -> float:
    results.append(run())   # the first run compiles and captures (generate_greedy's resident step)
    times = []
    for _ in range(3):
      started = time.perf_counter()
      run()
      times.append(time.perf_counter() - started)
    return statistics.median(times)
  steps, sequences = args.timed, args.sequences
  logits = median_seconds(lambda: [call() for _ in range(steps)])

  def token_loop() -> list[int]:   # the greedy id read on the host each step and fed to the next (argmax on device)
    ids = [5] * sequences
    for step in range(steps): ids = model.decode_greedy(ids, [8 + step] * sequences)
    return ids
  token = median_seconds(token_loop)
  streaming = hasattr(model, "stream_greedy")   # this script run against an older tree's model for an A/B
  streamed = median_seconds(lambda: list(model.stream_greedy([5] * sequences, [8] * sequences, steps))) \
    if streaming else float("nan")
  stream_ids = [step[0] for step in results[-1]] if streaming else []
  fed_back = median_seconds(lambda: model.generate_greedy([5] * sequences, [8] * sequences, steps))
  agree = stream_ids == results[-1][0] and results[-3][:sequences] == [row[-1] for row in results[-1]]
  same = "not run" if not streaming else "same" if agree \
    else f"DIFFERENT: streamed {stream_ids[:8]}, token loop's last {results[-3]}"
  label = f"decode {args.weights}, {sequences} sequence(s), {steps} steps"
  print(f"{label}: {sequences * steps / logits:.1f} tok/s (logits to the host each step), "
        f"{sequences * steps / token:.1f} tok/s (token to the host each step), "
        f"{sequences * steps / streamed:.1f} tok/s (token to the host each step, one step ahead), "
        f"{sequences * steps / fed_back:.1f} tok/s (fed back on the device) "
        f"[CUDA_DEPENDENT_LAUNCH={os.environ.get('CUDA_DEPENDENT_LAUNCH', 'default')}]; first greedy ids of "
        f"sequence 0: {results[-1][0][:8]} (a setting that changes no result keeps them); streamed ids: {same}")


def host_breakdown(model: Llama, args: argparse.Namespace) -> None:
  """Where a token-on-the-host decode step's wall time goes (`decode_greedy`, `args.host_breakdown` steps): the
  host-made inputs and their upload, the TinyJit call (Python and the graph launch), the wait for the device, and
  the id's copy back, each the median over steps; then the driver's own costs on an idle GPU, and the Python
  functions of the loop by own time (cProfile, which slows Python: compare the rows, not the totals)."""
  import cProfile
  import pstats
  device = Device[args.device]
  sequences, steps = args.sequences, args.host_breakdown
  phases: dict[str, list[float]] = defaultdict(list)
  ids = [5] * sequences
  for step in range(steps):
    t0 = time.perf_counter()
    inputs = model._step_inputs(ids, [8 + step % 64] * sequences)
    t1 = time.perf_counter()
    result = model._greedy_jit(*inputs)
    t2 = time.perf_counter()
    device.synchronize()
    t3 = time.perf_counter()
    ids = [int(value) for value in result.numpy()]
    t4 = time.perf_counter()
    for name, seconds in (("inputs+upload", t1 - t0), ("jit call", t2 - t1), ("wait", t3 - t2),
                          ("read id", t4 - t3), ("step", t4 - t0)):
      phases[name].append(seconds)
  print(f"host breakdown, decode_greedy, {steps} steps (median us): " +
        ", ".join(f"{name} {statistics.median(values) * 1e6:.1f}" for name, values in phases.items()))

  def per_call(run: Callable[[], Any], n: int = 200) -> float:
    started = time.perf_counter()
    for _ in range(n): run()
    return (time.perf_counter() - started) / n * 1e6
  buffer = model._step_buffer.lazydata.realized if model._step_buffer is not None else None
  host = np.zeros((sequences, 2), np.int32)
  jit = model._greedy_jit
  assert jit.captured is not None
  graph = getattr(jit.captured.replay_runner, "graph", None)
  timings = {"synchronize (idle)": per_call(device.synchronize),
             "step upload (copyin)": per_call(lambda: buffer.copyin(memoryview(host).cast("B"))) if buffer else 0.0,
             "_step_inputs": per_call(lambda: model._step_inputs(ids, [8] * sequences)),
             "id read (numpy)": per_call(lambda: result.numpy()),
             "id read (read_later)": per_call(lambda: result._buffer().read_later().numpy()),
             "graph launch+sync": per_call(lambda: (graph.launch(), device.synchronize())) if graph else 0.0,
             "jit call+sync": per_call(lambda: (jit(*inputs), device.synchronize()))}
  if graph is not None:
    device.synchronize()
    started = time.perf_counter()
    for _ in range(20): graph.launch()
    timings["graph launch (host, queued)"] = (time.perf_counter() - started) / 20 * 1e6
    device.synchronize()
  tiny = TinyJit(lambda x: (x + 1).sum())   # the floor of any jitted step's round trip: one small kernel
  scalar = Tensor(np.ones(4, np.float32), device=args.device).realize()
  for _ in range(3): tiny(scalar).numpy()
  timings["tiny jit call+numpy"] = per_call(lambda: tiny(scalar).numpy())
  timings["tiny jit call+sync"] = per_call(lambda: (tiny(scalar), device.synchronize()))
  if args.device == "CUDA":   # the binding's own cost: the same idle-stream wait through ctypes
    libcuda = ctypes.CDLL("libcuda.so.1")
    stream = ctypes.c_void_p(int(getattr(device, "stream")))
    timings["synchronize (idle, ctypes)"] = per_call(lambda: libcuda.cuStreamSynchronize(stream))
  print("driver/host costs (us per call): " + ", ".join(f"{name} {value:.1f}" for name, value in timings.items()))
  profiler = cProfile.Profile()
  profiler.enable()
  for step in range(steps): ids = model.decode_greedy(ids, [8 + step % 64] * sequences)
  profiler.disable()
  stats = pstats.Stats(profiler)
  rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:args.top]   # type: ignore[attr-defined]
  print(f"top functions by own time over {steps} steps (us per step, calls per step):")
  for (file, line, name), (_, calls, own, _, _) in rows:
    print(f"  {own / steps * 1e6:8.1f} {calls / steps:6.1f}  {pathlib.Path(file).name}:{line}({name})")


def minilm_workload(args: argparse.Namespace) -> tuple[TinyJit, Callable[[], Any]]:
  config = dataclasses.replace(MINILM_L6, num_hidden_layers=args.layers or MINILM_L6.num_hidden_layers)
  loaded = minilm_weights(True)
  assert loaded is not None
  model = BertEncoder(config)
  weights = {name: Tensor(value, device=args.device) for name, value in loaded[1].items()
             if not name.startswith("encoder.layer.") or int(name.split(".")[2]) < config.num_hidden_layers}
  load_state_dict(model, weights)
  rng = np.random.default_rng(1)
  ids = rng.integers(1000, config.vocab_size, (args.batch, 32)).astype(np.int32)
  ids_t, mask_t = Tensor(ids, device=args.device), Tensor(np.ones_like(ids), device=args.device)

  def call() -> Any: return model.sentence_embeddings(ids_t, mask_t, jit=True).numpy()
  for _ in range(3): call()
  return next(iter(model._pooled_jits.jits.values())), call


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workload", choices=("prefill", "minilm", "decode"), default="prefill")
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill")
  parser.add_argument("--batch", type=int, default=64, help="MiniLM sentences per batch (32 tokens each)")
  parser.add_argument("--sequences", type=int, default=1, help="decode: sequences decoded together")
  parser.add_argument("--weights", default="float32", choices=("float32", "bfloat16", "float16", "q8_0", "stored"),
                      help="decode: how the weight matrices are kept (stored: the installed SmolLM2 GGUF's own "
                           "Q4_1/Q8_0 blocks, packed; the others random weights)")
  parser.add_argument("--cpu-time", action="store_true", help="per-kernel table in this thread's CPU time (a host "
                      "device with OMP_NUM_THREADS=1: figures that other jobs on a shared CPU do not change)")
  parser.add_argument("--context", type=int, default=520, help="decode: cache slots (bench_models.py's 520)")
  parser.add_argument("--symbolic", action="store_true", help="decode, stored weights: the position a bound Variable "
                      "(attention reads only the cache slots in use: Llama(symbolic=True))")
  parser.add_argument("--layers", type=int, default=0, help="fewer layers (a smoke test); 0: the model's")
  parser.add_argument("--repeats", type=int, default=5, help="launches per kernel for the per-kernel table")
  parser.add_argument("--no-table", action="store_true", help="only the profiled replay (under ncu)")
  parser.add_argument("--timed", type=int, default=0, help="decode: also the tokens/s of this many steps, logits read "
                      "each step and fed back on the device (bench_models.py's rows, without PyTorch)")
  parser.add_argument("--host-breakdown", type=int, default=0, help="decode: where this many token-on-the-host "
                      "steps spend their wall time (phases, driver costs, cProfile)")
  parser.add_argument("--top", type=int, default=25, help="functions listed by --host-breakdown")
  parser.add_argument("--decode-rows", nargs="*", default=[], help="decode, with --timed: only the tokens/s rows, of "
                      "each WEIGHTS:SEQUENCES given (q8_0:1 bfloat16:8), one model after the other in this process")
  args = parser.parse_args()
  args.device = Device.canonicalize(args.device)
  os.environ["DEVICE"] = args.device  # the models' own tensors (BertEncoder's layers) go to this device
  if args.decode_rows:
    for row in args.decode_rows:
      weights, sequences = row.split(":")
      decode_workload(argparse.Namespace(**{**vars(args), "weights": weights, "sequences": int(sequences)}))
    return
  workloads = {"prefill": prefill_workload, "minilm": minilm_workload, "decode": decode_workload}
  jit, call = workloads[args.workload](args)
  seconds = profiled_replay(args.device, call)
  print(f"{args.workload} on {args.device}: one replay {seconds * 1e3:.3f} ms (host, to the result on the host)")
  if not args.no_table: per_kernel_table(replay_items(jit), args.repeats, args.cpu_time)


if __name__ == "__main__":
  main()
