"""The same SmolLM2 decode step (random weights, `profile_models.py --workload decode`'s model) timed under the
conditions that differ between `bench_models.py`'s decode rows and `profile_models.py --timed`'s, one condition at a
time and alternated, in one process: which of them costs the bench's ~10%?

Conditions (each runs before every timed run of `--steps` steps; the timed runs are what both scripts time):
- alone: nothing (profile_models.py's back-to-back runs);
- prefill: the 8-token prompt prefilled eagerly into the cache first (bench_models.py's runs start so);
- idle: the GPU left idle for `--idle` seconds first (bench_models.py's PyTorch rows leave it mostly idle);
- torch: a few PyTorch eager decode steps of a TorchLlama resident on the same GPU (what bench_models.py interleaves);
- gc-off: "prefill" with Python's cyclic collector disabled during the timed run;
- resident: bench_models.py's float32 fixed-shape and symbolic models built and captured beside this one;
- torch-import, torch-cuda, torch-alloc, torch-side-stream, torch-kernels: PyTorch imported; its CUDA state made;
  memory from its allocator (no kernel); a few of its kernels on a stream of its own; a few on its default (legacy)
  stream.
- limits, reset-limits: the CUDA context's limits (stack size, heap, printf FIFO, L2 persisting size, ...) printed
  against their values when the model was captured; reset-limits sets any that changed back first.
PyTorch's state persists: a condition after one of them runs beside it.
For each: tokens/s of the steps fed back on the device (`generate_greedy`) and with the token read on the host each
step (`decode_greedy`), the SM clock (NVML) right before and right after the timed runs, and the cyclic collections
(count, ms) that ran inside them.

    python extra/bench/decode_conditions.py --weights q8_0 [--steps 64] [--rounds 3] [--conditions alone,prefill]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import os
import pathlib
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_models import TorchLlama, captured_steps, random_llama_weights  # noqa: E402
from profile_models import random_weight_llama  # noqa: E402

from ourgrad import Device, Tensor, dtypes  # noqa: E402

from extra.models.llama import Llama  # noqa: E402


class Clock:
  """The GPU's current SM clock in MHz through NVML (libnvidia-ml), or None where there is none."""

  def __init__(self) -> None:
    self.handle = ctypes.c_void_p()
    try:
      self.nvml = ctypes.CDLL("libnvidia-ml.so.1")
      if self.nvml.nvmlInit_v2() or self.nvml.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.handle)):
        self.nvml = None
    except OSError:
      self.nvml = None

  def sm_mhz(self) -> int | None:
    if self.nvml is None: return None
    value = ctypes.c_uint()
    return None if self.nvml.nvmlDeviceGetClockInfo(self.handle, 1, ctypes.byref(value)) else value.value


class Collections:
  """Counts the cyclic collector's runs and their time while `active` (gc.callbacks)."""

  def __init__(self) -> None:
    self.active, self.count, self.seconds, self.started = False, 0, 0.0, 0.0
    gc.callbacks.append(self.callback)

  def callback(self, phase: str, info: dict[str, Any]) -> None:
    if not self.active: return
    if phase == "start": self.started = time.perf_counter()
    else:
      self.count += 1
      self.seconds += time.perf_counter() - self.started


def create_streams_with(flags: int) -> None:
  """Make the CUDA device (not opened yet) create its stream with `flags` (an A/B of the stream's kind)."""
  from ourgrad.runtime import ops_cuda
  real = ops_cuda.driver

  class Driver:
    def __getattr__(self, name: str) -> Any: return getattr(real, name)

    @staticmethod
    def cuStreamCreate(_: int) -> Any: return real.cuStreamCreate(flags)
  ops_cuda.driver = Driver()


def context_limits() -> dict[str, int]:
  """The current CUDA context's limits by name (cuCtxGetLimit; CUDA only)."""
  from cuda.bindings import driver
  values = {}
  for limit in driver.CUlimit:
    if limit.name == "CU_LIMIT_MAX": continue
    error, value = driver.cuCtxGetLimit(limit)
    if error == driver.CUresult.CUDA_SUCCESS: values[limit.name] = int(value)
  return values


def set_context_limits(values: dict[str, int]) -> None:
  """cuCtxSetLimit for each named limit whose value differs from `values`."""
  from cuda.bindings import driver
  now = context_limits()
  for name, value in values.items():
    if now.get(name) != value:
      status = driver.cuCtxSetLimit(driver.CUlimit[name], value)[0]
      print(f"  set {name} {now.get(name)} -> {value}: {status}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--weights", default="q8_0", choices=("float32", "bfloat16", "float16", "q8_0"))
  parser.add_argument("--steps", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=3, help="timed runs per condition and way (median)")
  parser.add_argument("--idle", type=float, default=0.5, help="seconds of the idle condition")
  parser.add_argument("--torch-steps", type=int, default=4, help="PyTorch decode steps of the torch condition")
  parser.add_argument("--conditions", default="alone,prefill,idle,torch,alone,gc-off,resident,alone")
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--layers", type=int, default=0)
  parser.add_argument("--stream-flags", type=int, help="CUDA: create ourgrad's stream with these cuStreamCreate flags "
                      "(1: CU_STREAM_NON_BLOCKING, no implicit order with the legacy default stream PyTorch uses)")
  args = parser.parse_args()
  args.device = Device.canonicalize(args.device)
  os.environ["DEVICE"] = args.device
  if args.stream_flags is not None: create_streams_with(args.stream_flags)
  args.sequences, args.context = 1, 520
  model = random_weight_llama(args)
  device, clock, collections = Device[args.device], Clock(), Collections()
  prompt = [int(t) for t in range(100, 108)]
  start = len(prompt)
  reference: list[Any] = []
  host_weights: list[dict[str, Any]] = []

  def float32_weights() -> dict[str, Any]:   # the model's random weights again (the same seed), made once
    if not host_weights: host_weights.append(random_llama_weights(model.config))
    return host_weights[0]
  torch_device = "cuda" if args.device == "CUDA" else "cpu"

  def prefill() -> None: model(Tensor([prompt], dtype=dtypes.int32, device=args.device), 0).numpy()

  def torch_steps() -> None:
    if not reference:
      import torch
      reference.append(TorchLlama(model.config, float32_weights(), torch_device, args.context))
      reference.append(torch)
    with reference[1].no_grad():
      for step in range(args.torch_steps): reference[0]([5], start + step)
    if torch_device == "cuda": reference[1].cuda.synchronize()

  others: list[Any] = []

  def resident() -> None:
    """bench_models.py's other models, made once: float32 fixed-shape and symbolic Llamas on the same weights, their
    decode steps captured (their weights, caches and graphs resident beside this model's)."""
    if others: return
    config = model.config
    weights = {name: Tensor(value, device=args.device) for name, value in float32_weights().items()}
    for symbolic in (False, True):
      other = Llama(config, weights, args.context, symbolic=symbolic)
      for step in range(3): other.decode(5, start + step).numpy()
      others.append(other)

  def torch_module() -> Any:
    import torch
    return torch

  def torch_cuda() -> None:   # PyTorch's CUDA state made (its runtime retains the same primary context), no kernel
    torch = torch_module()
    if torch_device == "cuda": torch.cuda.init(), torch.cuda.synchronize()

  def torch_kernels(side_stream: bool) -> None:
    """A few PyTorch kernels on its default stream (CUDA's legacy stream) or on a stream of its own."""
    torch = torch_module()
    x = torch.ones(1 << 16, device=torch_device)
    stream = torch.cuda.Stream() if side_stream and torch_device == "cuda" else None
    if stream is not None:
      with torch.cuda.stream(stream):
        for _ in range(8): x.add_(1)
    else:
      for _ in range(8): x.add_(1)
    if torch_device == "cuda": torch.cuda.synchronize()

  def torch_alloc() -> None:   # device memory from PyTorch's caching allocator (cudaMalloc), no kernel
    torch = torch_module()
    allocations.append(torch.empty(1 << 20, device=torch_device))
    if torch_device == "cuda": torch.cuda.synchronize()
  allocations: list[Any] = []

  befores: dict[str, Callable[[], None]] = {
    "alone": lambda: None, "prefill": prefill, "idle": lambda: time.sleep(args.idle), "torch": torch_steps,
    "gc-off": prefill, "resident": resident, "limits": lambda: limits(),
    "reset-limits": lambda: set_context_limits(initial_limits), "torch-import": torch_module, "torch-cuda": torch_cuda,
    "torch-side-stream": lambda: torch_kernels(True), "torch-kernels": lambda: torch_kernels(False),
    "torch-alloc": torch_alloc}

  def fed_back() -> list[int]: return model.generate_greedy(5, start, args.steps)[0]

  def token_loop() -> list[int]:
    ids = [5]
    for step in range(args.steps): ids = model.decode_greedy(ids, [start + step])
    return ids
  for run in (fed_back, token_loop): run(), run()   # compile and capture
  model.decode(5, start).numpy(), model.decode(5, start).numpy()
  print(f"captured steps: {captured_steps(model)}")
  initial_limits = context_limits() if args.device == "CUDA" else {}

  def limits() -> None:
    changed = {name: (initial_limits.get(name), value) for name, value in context_limits().items()
               if initial_limits.get(name) != value}
    if changed not in printed_limits:
      printed_limits.append(changed)
      print(f"  context limits changed since capture: {changed or 'none'}")
  printed_limits: list[Any] = []
  print(f"decode {args.weights}, {args.steps} steps, {args.rounds} rounds a condition; SM clock now "
        f"{clock.sm_mhz()} MHz; gc thresholds {gc.get_threshold()}, objects tracked {len(gc.get_objects())}")
  for name in args.conditions.split(","):
    before = befores[name]
    rates: dict[str, list[float]] = {"fed back": [], "token": []}
    clocks: list[tuple[int | None, int | None]] = []
    collections.count, collections.seconds = 0, 0.0
    for _ in range(args.rounds):
      for way, run in (("fed back", fed_back), ("token", token_loop)):
        before()
        device.synchronize()
        mhz = clock.sm_mhz()
        if name == "gc-off": gc.disable()
        collections.active = True
        started = time.perf_counter()
        ids = run()
        seconds = time.perf_counter() - started
        collections.active = False
        gc.enable()
        clocks.append((mhz, clock.sm_mhz()))
        rates[way].append(args.steps / seconds)
    print(f"{name:>8}: fed back {statistics.median(rates['fed back']):7.1f} tok/s "
          f"{[round(r) for r in rates['fed back']]}, token {statistics.median(rates['token']):7.1f} tok/s "
          f"{[round(r) for r in rates['token']]}; SM MHz before/after {clocks}; gc {collections.count} runs "
          f"{collections.seconds * 1e3:.2f} ms; last ids {ids[-3:]}", flush=True)


if __name__ == "__main__":
  main()
