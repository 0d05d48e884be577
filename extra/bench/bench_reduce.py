"""Reduction benchmark: row/column/full reductions, softmax, layernorm and a fused elementwise chain against the
device's copy bandwidth, with ourgrad's hand-coded kernels (and BEAM=2 when ourgrad.codegen.opt.search exists)
beside PyTorch eager and torch.compile in the same run; then the per-kernel table of one examples/mnist.py training
step.

Method: inputs are realized first; each ourgrad figure is the median over `--iters` runs (after 3 warm-up runs) of
the summed device times of the kernels realizing the result (CUDA events, the timing DEBUG=2 prints). PyTorch is
timed with torch.cuda events over the same runs. GB/s counts each input read once and each output written once;
"% copy" compares with a device-to-device copy of the same bytes measured here.
Run: `python extra/bench/bench_reduce.py` on a machine with an NVIDIA GPU (`--device PYTHON --scale 10` runs a
tiny version anywhere, for checking the script).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ourgrad import Tensor  # noqa: E402
from timing import torch_seconds  # noqa: E402 (extra/bench/timing.py, beside this script)
from ourgrad.engine import realize  # noqa: E402
from ourgrad.engine.exec_item import CompiledRunner, ExecItem  # noqa: E402
from ourgrad.engine.realize import get_runner  # noqa: E402
from ourgrad.engine.schedule import create_schedule  # noqa: E402


def kernel_seconds(device: str, build: Callable[[], Tensor], iters: int) -> tuple[float, list[tuple[str, float]]]:
  """Median summed kernel time of realizing `build()`, and the (name, seconds) of each kernel of the last run."""
  totals, kernels = [], []
  for _ in range(iters + 3):
    schedule = create_schedule([build().lazydata])
    total, kernels = 0.0, []
    for item in schedule:
      for buffer in item.outputs: buffer.allocate()
      runner = get_runner(device, item.ast)
      seconds = runner(item.bufs, wait=True) or 0.0
      total += seconds
      kernels.append((runner.name, seconds))
    totals.append(total)
  return statistics.median(totals[3:]), kernels




def workloads(scale: int) -> list[tuple[str, list[tuple[int, ...]], Callable[..., Any], int]]:
  """(name, input shapes, function of the inputs (ourgrad and torch alike), output elements)."""
  side = 8192 >> scale
  full = 1 << max(28 - 2 * scale, 4)
  flat = 1 << max(26 - 2 * scale, 4)
  return [
    ("row sum", [(side, side)], lambda x: x.sum(axis=1) if isinstance(x, Tensor) else x.sum(dim=1), side),
    ("row max", [(side, side)], lambda x: x.max(axis=1) if isinstance(x, Tensor) else x.amax(dim=1), side),
    ("column sum", [(side, side)], lambda x: x.sum(axis=0) if isinstance(x, Tensor) else x.sum(dim=0), side),
    ("full sum", [(full,)], lambda x: x.sum(), 1),
    ("softmax", [(side, side)], lambda x: x.softmax(-1), side * side),
    ("layernorm", [(side, side)],
     lambda x: x.layernorm(-1) if isinstance(x, Tensor) else _torch_layernorm(x), side * side),
    ("elementwise (a+b)*c", [(flat,)] * 3, lambda a, b, c: (a + b) * c, flat),
  ]


def _torch_layernorm(x: Any) -> Any:
  import torch
  return torch.nn.functional.layer_norm(x, x.shape[-1:])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--scale", type=int, default=0, help="halve each side this many times (for a quick check)")
  parser.add_argument("--no-mnist", action="store_true")
  parser.add_argument("--only-mnist", action="store_true", help="only the per-kernel table of one MNIST step")
  parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
  parser.add_argument("--mnist-steps", type=int, default=5, help="steps timed for the MNIST table (median per kernel)")
  args = parser.parse_args()
  if args.only_mnist:
    mnist_step(args.device, args.scale, args.mnist_steps)
    return
  import torch
  cuda = args.device.upper().startswith("CUDA")
  torch_device = "cuda" if cuda else "cpu"
  if cuda: print(f"device: {torch.cuda.get_device_name()}")
  search_available = _search_available()

  header = f"{'workload':<22} {'bytes':>9} {'ourgrad':>9} {'GB/s':>7} {'%copy':>6} {'kernels':>7}"
  header += f" {'BEAM=2':>9} {'torch':>9} {'compile':>9}   (times in ms)"
  print(header)
  for name, shapes, function, outputs in workloads(args.scale):
    host = [np.random.randn(*shape).astype(np.float32) for shape in shapes]
    inputs = [Tensor(array, device=args.device).realize() for array in host]
    moved = sum(array.nbytes for array in host) + outputs * 4
    ours, kernels = kernel_seconds(args.device, lambda: function(*inputs), args.iters)
    beam = _beam_seconds(args.device, lambda: function(*inputs), args.iters) if search_available else None
    torch_inputs = [torch.tensor(array, device=torch_device) for array in host]
    eager = torch_seconds(lambda: function(*torch_inputs), args.iters, cuda)
    compiled = None
    if not args.no_compile:
      try:
        compiled_function = torch.compile(function)
        compiled = torch_seconds(lambda: compiled_function(*torch_inputs), args.iters, cuda)
      except Exception as error:  # no compiler toolchain for inductor here
        print(f"  torch.compile failed: {type(error).__name__}")
    scratch = torch.empty(moved // 4, device=torch_device)
    source = torch.randn(moved // 4, device=torch_device)
    copy = torch_seconds(lambda: scratch.copy_(source), args.iters, cuda)
    copy_gbs = 2 * moved / copy / 1e9  # the copy reads and writes `moved` bytes
    gbs = moved / ours / 1e9

    def ms(value: float | None) -> str: return f"{value * 1e3:9.3f}" if value is not None else f"{'-':>9}"
    print(f"{name:<22} {moved / 1e6:8.0f}M {ms(ours)} {gbs:7.0f} {gbs / copy_gbs * 100:5.0f}% {len(kernels):7d}"
          f" {ms(beam)} {ms(eager)} {ms(compiled)}   [{', '.join(f'{k} {s * 1e3:.3f}' for k, s in kernels)}]")
  if not args.no_mnist: mnist_step(args.device, args.scale, args.mnist_steps)


def _search_available() -> bool:
  try:
    import ourgrad.codegen.opt.search  # noqa: F401
    return True
  except ImportError:
    return False


def _beam_seconds(device: str, build: Callable[[], Tensor], iters: int) -> float | None:
  """Kernel time with BEAM=2 (the search runs on the first call, then its cache is used)."""
  os.environ["BEAM"] = "2"
  realize._runner_cache.clear()
  try:
    seconds, _ = kernel_seconds(device, build, iters)
  except Exception as error:
    print(f"  BEAM=2 failed: {type(error).__name__}: {error}")
    seconds = None
  finally:
    del os.environ["BEAM"]
    realize._runner_cache.clear()
  return seconds


def mnist_step(device: str, scale: int, steps: int = 5) -> None:
  """Training steps of examples/mnist.py's default model (batch 256) on random images: each kernel's time (median
  over `steps` steps), bytes, GB/s against the copy bandwidth, and GFLOP/s (a weight gradient is matmul-like)."""
  sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
  import mnist
  from ourgrad.nn.optim import Adam
  from ourgrad.nn.state import get_parameters
  os.environ["DEVICE"] = device  # the step makes its tensors on the default device
  batch = 256 >> scale
  model = mnist.ConvNet(mnist.MODELS["small"])
  optimizer = Adam([p for p in get_parameters(model) if p.requires_grad], lr=2e-3)
  buffers = mnist.batchnorm_buffers(model)
  images = np.random.randint(0, 255, (batch, 1, 28, 28)).astype(np.uint8)
  labels = np.random.randint(0, 10, batch).astype(np.int32)
  runs: list[list[tuple[str, str, float, int, int, str]]] = []
  original = ExecItem._print  # every launch passes here at DEBUG=2, with its device time

  def record(item: ExecItem, timing: float | None) -> None:
    runner = item.runner
    if isinstance(runner, CompiledRunner):
      runs[-1].append((runner.name, runner.display_name, timing or 0.0, runner.byte_count, runner.op_count,
                       kinds.get(id(runner), "")))
  kinds = _KernelKinds(device)
  walls = []
  with Tensor.train():
    for _ in range(2): mnist.train_step(model, optimizer, images, labels, buffers)  # compile everything
    kinds.update()
    os.environ["DEBUG"] = "2"
    ExecItem._print = record  # type: ignore[method-assign]
    try:
      for _ in range(steps):
        runs.append([])
        began = time.perf_counter()
        mnist.train_step(model, optimizer, images, labels, buffers)
        walls.append(time.perf_counter() - began)
    finally:
      ExecItem._print = original  # type: ignore[method-assign]
      del os.environ["DEBUG"]
  # the same kernels launch in the same order every step: each launch's time is its median over the steps
  launches = [(name, shape, statistics.median(run[index][2] for run in runs), moved, ops, kind)
              for index, (name, shape, _, moved, ops, kind) in enumerate(runs[0])]
  total = sum(launch[2] for launch in launches)
  print(f"\nmnist training step (batch {batch}): {len(launches)} kernels, sum of kernel times {total * 1e3:.3f} ms "
        f"(median of {steps} steps per kernel), wall {statistics.median(walls) * 1e3:.1f} ms (with DEBUG=2's "
        f"per-kernel synchronization)")
  ours, theirs = copy_bandwidth(device, 1 << 26), torch_copy_bandwidth(device, 1 << 26)
  peak = max(ours, theirs or 0.0)
  print(f"copy bandwidth: {peak / 1e9:.0f} GB/s, the faster of an ourgrad copy kernel of 2 x 256 MB timed like the "
        f"kernels below ({ours / 1e9:.0f} GB/s) and torch's copy_ ("
        f"{f'{theirs / 1e9:.0f} GB/s' if theirs else 'no CUDA torch'}). '%copy' = GB/s / that; '%same' = GB/s / the "
        f"GB/s of the ourgrad copy kernel moving the same bytes, timed the same way (a small kernel cannot beat its "
        f"launch and event overhead, neither can that copy)")
  print("kind: outputs x values per output of a reduce ('matmul' where an input is reused across outputs: a weight "
        "gradient or a convolution; 'reduce': batchnorm statistics, losses, the second kernel of a split)")
  print(f"{'kernel':<36} {'ms':>8} {'MB':>7} {'GB/s':>8} {'%copy':>6} {'%same':>6} {'GFLOP/s':>8}  {'kind':<26} axes")
  same_cache: dict[int, float] = {}
  for name, shape, seconds, moved, ops, kind in sorted(launches, key=lambda launch: -launch[2]):
    gbs = moved / max(seconds, 1e-12)
    bucket = max(1 << max(moved - 1, 1).bit_length(), 1024)   # copies timed at powers of two of bytes
    if bucket not in same_cache: same_cache[bucket] = copy_bandwidth(device, bucket // 8)
    print(f"{name:<36} {seconds * 1e3:8.3f} {moved / 1e6:7.2f} {gbs / 1e9:8.1f} {gbs / peak * 100:5.1f}% "
          f"{gbs / same_cache[bucket] * 100:5.0f}% {ops / max(seconds, 1e-12) / 1e9:8.0f}  {kind:<26} {shape}")


class _KernelKinds:
  """What each compiled kernel of the engine's runner cache computes, by the runner's id: 'matmul 12800x512',
  'reduce 1024x512' (outputs x values per output) or 'elementwise 200704'."""

  def __init__(self, device: str):
    self.device, self.kinds = device, {}

  def update(self) -> None:
    from ourgrad.codegen.kernel import Kernel
    from ourgrad.codegen.opt.heuristic import _matmul_like
    from ourgrad.device import Device
    from ourgrad.helpers import prod
    from ourgrad.ops import Ops
    for (device, ast), runner in list(realize._runner_cache.items()):
      if device != self.device or id(runner) in self.kinds: continue
      if ast.op is Ops.PACK:   # a multi-tensor kernel: several elementwise segments in one launch
        self.kinds[id(runner)] = f"packed {len(ast.srcs)} segments"
        continue
      kernel = Kernel(ast, Device[device].renderer)
      outputs = prod(kernel.full_shape[:kernel.first_reduce])
      if kernel.reduceop is None:
        self.kinds[id(runner)] = f"elementwise {outputs}"
        continue
      label = "matmul" if _matmul_like(kernel) else "reduce"
      self.kinds[id(runner)] = f"{label} {outputs}x{prod(kernel.full_shape[kernel.first_reduce:])}"

  def get(self, key: int, default: str) -> str: return self.kinds.get(key, default)


def copy_bandwidth(device: str, elements: int, iters: int = 10) -> float:
  """Bytes per second of an ourgrad kernel that reads `elements` float32 and writes as many (a copy with one add),
  timed like every kernel here (median of the device times of `iters` launches). Where the size allows, rows of
  1024 read out of rows of 1032 (so the two axes cannot merge into one): the elementwise heuristic then gives each
  thread a float4 load and store. A 1-D copy moves one float per thread and reached 1613 GB/s on the H100 (too few
  loads in flight)."""
  if elements % 1024 == 0:
    padded = Tensor(np.random.randn(elements // 1024, 1032).astype(np.float32), device=device).realize()
    source = padded[:, :1024]
  else:
    source = Tensor(np.random.randn(elements).astype(np.float32), device=device).realize()
  seconds, _ = kernel_seconds(device, lambda: source + 1.0, iters)
  return 2 * elements * 4 / max(seconds, 1e-12)


def torch_copy_bandwidth(device: str, elements: int, iters: int = 10) -> float | None:
  """Bytes per second of torch's device-to-device copy_ of `elements` float32 (None without CUDA torch)."""
  if not device.upper().startswith("CUDA"): return None
  try:
    import torch
    if not torch.cuda.is_available(): return None
  except ImportError:
    return None
  source, target = torch.randn(elements, device="cuda"), torch.empty(elements, device="cuda")
  return 2 * elements * 4 / torch_seconds(lambda: target.copy_(source), iters, True)


if __name__ == "__main__":
  main()
