"""Reduction benchmark: row/column/full reductions, softmax, layernorm and a fused elementwise chain against the
device's copy bandwidth, with ourgrad's hand-coded kernels (and BEAM=2 when ourgrad.codegen.opt.search exists)
beside PyTorch eager and torch.compile in the same run; then the per-kernel table of one examples/mnist.py training
step.

Method: inputs are realized first. Each ourgrad kernel is timed cold and GPU-bound (timing.cold_kernel_seconds: many
launches on scratch buffers that together exceed twice the L2, replayed as one CUDA graph, per-launch time from
device events; the module docstring of extra/bench/timing.py says what that counts and what it does not); a
workload's figure is the sum over its kernels. The '1-launch' column is the older figure: each kernel launched once
between two CUDA events (what DEBUG=2 prints; it also counts the host's launch into an idle GPU, ~10 us on an
H100), median over `--iters` runs. PyTorch eager and torch.compile are timed back to back (`--iters` calls between
two synchronizations, timing.back_to_back_seconds; the host clock on the CPU). GB/s counts each input read once and
each output written once; '%copy' compares with the large-copy bandwidth (the faster of an ourgrad copy kernel and
torch's copy_ of 2 x 256 MB), '%same' with an ourgrad copy kernel moving the same bytes timed the same way.
Run: `python extra/bench/bench_reduce.py` on a machine with an NVIDIA GPU; `--only-mnist` prints only the step's
table, `--no-mnist` only the workloads (`--device PYTHON --scale 10` runs a tiny version anywhere, for checking the
script).
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
sys.path.insert(0, str(Path(__file__).resolve().parent))   # timing.py and kernel_table.py, beside this script
from ourgrad import Tensor  # noqa: E402
from ourgrad.engine import realize  # noqa: E402
from ourgrad.engine.exec_item import ExecItem  # noqa: E402
from timing import (back_to_back_seconds, cold_kernel_seconds, cold_schedule_seconds, ourgrad_kernel_seconds,  # noqa: E402
                    torch_seconds)
from kernel_table import (CopyReference, KernelKinds, KernelRow, MnistRoles, floor_seconds,  # noqa: E402
                          median_by_launch, print_table, recorded_launches)


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
  parser.add_argument("--replays", type=int, default=10, help="CUDA graph replays per cold kernel time (median)")
  parser.add_argument("--scale", type=int, default=0, help="halve each side this many times (for a quick check)")
  parser.add_argument("--no-mnist", action="store_true")
  parser.add_argument("--only-mnist", action="store_true", help="only the per-kernel table of one MNIST step")
  parser.add_argument("--only", help="only the workloads whose name contains this")
  parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
  parser.add_argument("--no-beam", action="store_true", help="skip the BEAM=2 column (its search takes minutes)")
  parser.add_argument("--no-torch", action="store_true", help="skip PyTorch (for checking the script without it)")
  parser.add_argument("--mnist-steps", type=int, default=5, help="steps of the MNIST table's 1-launch column (median)")
  parser.add_argument("--only-vocab", action="store_true", help="only the vocabulary-wide rows (GPT-2's loss)")
  args = parser.parse_args()
  if args.only_mnist:
    mnist_step(args.device, args.scale, args.mnist_steps, args.replays)
    return
  if args.only_vocab:
    vocab_table(args)
    return
  workload_table(args)
  vocab_table(args)
  if not args.no_mnist: mnist_step(args.device, args.scale, args.mnist_steps, args.replays)


def workload_table(args: argparse.Namespace) -> None:
  """The table of issue 10's workloads: ourgrad cold (and 1-launch, BEAM=2) beside torch eager and compiled."""
  cuda = args.device.upper().startswith("CUDA")
  torch = None
  if not args.no_torch:
    import torch
    if cuda: print(f"device: {torch.cuda.get_device_name()}")
  beam_available = not args.no_beam and _search_available()
  reference = CopyReference(args.device, (1 << 26) >> 2 * args.scale)
  print(reference.describe())
  print("a reduction almost only reads: DRAM serves reads alone faster than a copy's mix of reads and writes, so its "
        "%copy can pass 100% (H100: ~3100 GB/s against ~3000)")
  header = f"{'workload':<22} {'bytes':>9} {'ourgrad':>9} {'GB/s':>7} {'%copy':>6} {'%same':>6} {'kernels':>7}"
  header += f" {'1-launch':>9} {'BEAM=2':>9} {'torch':>9} {'compile':>9}   (times in ms; ourgrad, BEAM=2: cold)"
  print(header)
  rng = np.random.default_rng(0)
  for name, shapes, function, outputs in workloads(args.scale):
    if args.only and args.only not in name: continue
    host = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
    inputs = [Tensor(array, device=args.device).realize() for array in host]
    moved = sum(array.nbytes for array in host) + outputs * 4
    ours, kernels = cold_schedule_seconds(args.device, function(*inputs), args.replays)
    one_launch, _ = ourgrad_kernel_seconds(args.device, lambda: function(*inputs), args.iters)
    beam = _beam_seconds(args.device, lambda: function(*inputs), args.replays) if beam_available else None
    eager = compiled = None
    if torch is not None:
      torch_inputs = [torch.tensor(array, device="cuda" if cuda else "cpu") for array in host]
      eager = _torch_time(lambda: function(*torch_inputs), args.iters, cuda)
      if not args.no_compile:
        try:
          compiled_function = torch.compile(function)
          compiled = _torch_time(lambda: compiled_function(*torch_inputs), args.iters, cuda)
        except Exception as error:  # no compiler toolchain for inductor here
          print(f"  torch.compile failed: {type(error).__name__}")
    gbs = moved / ours

    def ms(value: float | None) -> str: return f"{value * 1e3:9.3f}" if value is not None else f"{'-':>9}"
    print(f"{name:<22} {moved / 1e6:8.0f}M {ms(ours)} {gbs / 1e9:7.0f} {gbs / reference.peak * 100:5.0f}% "
          f"{gbs / reference.same(moved) * 100:5.0f}% {len(kernels):7d} {ms(one_launch)} {ms(beam)} {ms(eager)} "
          f"{ms(compiled)}   [{', '.join(f'{k} {s * 1e3:.3f}' for k, s in kernels)}]")


# GPT-2's loss: 8 x 512 tokens over its (padded) vocabulary
VOCAB_ROWS, VOCAB = 4096, 50304


def vocab_workloads(torch: Any) -> list[tuple[str, Callable[[Any, Any], Any], int]]:
  """(name, function of (logits, targets) for ourgrad and torch alike, bytes it must move in multiples of the logits'
  size): a softmax reads and writes them; logsumexp and the loss read them once; the loss and its gradient read them
  once forward and once backward and write the gradient (the per-row logsumexp kept between)."""
  def is_ours(x: Any) -> bool: return isinstance(x, Tensor)

  def cross_entropy(x: Any, target: Any) -> Any:
    return x.cross_entropy(target) if is_ours(x) else torch.nn.functional.cross_entropy(x, target)

  def forward_backward(x: Any, target: Any) -> Any:
    x.grad = None
    loss = cross_entropy(x, target)
    loss.backward()
    return [loss, x.grad] if is_ours(x) else x.grad
  return [
    ("softmax", lambda x, _: x.softmax(-1), 2),
    ("logsumexp", lambda x, _: x.logsumexp(-1), 1),
    ("cross-entropy fwd", cross_entropy, 1),
    ("cross-entropy fwd+bwd", forward_backward, 3),
  ]


def vocab_table(args: argparse.Namespace) -> None:
  """Softmax, logsumexp and cross-entropy (forward, and forward + backward) over GPT-2's vocabulary-wide rows: float32
  logits of 4096 x 50304 (`--scale` halves both), ourgrad cold beside torch eager and torch.compile, GB/s of the bytes
  each must move at least (cross-entropy fwd+bwd: the logits read twice and the gradient written once)."""
  cuda = args.device.upper().startswith("CUDA")
  torch = None
  if not args.no_torch:
    import torch
  rows, vocab = VOCAB_ROWS >> args.scale, VOCAB >> args.scale
  reference = CopyReference(args.device, (1 << 26) >> 2 * args.scale)
  print(f"\nvocabulary-wide rows: float32 logits {rows} x {vocab}; {reference.describe()}")
  print(f"{'workload':<22} {'bytes':>9} {'ourgrad':>9} {'GB/s':>7} {'%copy':>6} {'kernels':>7} {'torch':>9} "
        f"{'compile':>9}   (times in ms; ourgrad cold, summed over its kernels)")
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((rows, vocab), dtype=np.float32) * 3
  targets = rng.integers(0, vocab, rows).astype(np.int32)
  for name, function, logit_passes in vocab_workloads(torch):
    if args.only and args.only not in name: continue
    backward = "bwd" in name
    x = Tensor(logits, device=args.device, requires_grad=backward).realize()
    target = Tensor(targets, device=args.device).realize()
    moved = logit_passes * logits.nbytes
    ours, kernels = cold_schedule_seconds(args.device, function(x, target), args.replays)
    eager = compiled = None
    if torch is not None:
      torch_device = "cuda" if cuda else "cpu"
      t = torch.tensor(logits, device=torch_device, requires_grad=backward)
      t_target = torch.tensor(targets, device=torch_device, dtype=torch.long)
      eager = _torch_time(lambda: function(t, t_target), args.iters, cuda)
      if not args.no_compile:
        try:
          compiled_function = torch.compile(function)
          compiled = _torch_time(lambda: compiled_function(t, t_target), args.iters, cuda)
        except Exception as error:  # no compiler toolchain for inductor here
          print(f"  torch.compile failed: {type(error).__name__}")
    gbs = moved / ours

    def ms(value: float | None) -> str: return f"{value * 1e3:9.3f}" if value is not None else f"{'-':>9}"
    print(f"{name:<22} {moved / 1e6:8.0f}M {ms(ours)} {gbs / 1e9:7.0f} {gbs / reference.peak * 100:5.0f}% "
          f"{len(kernels):7d} {ms(eager)} {ms(compiled)}   [{', '.join(f'{k} {s * 1e3:.3f}' for k, s in kernels)}]")


def _torch_time(function: Callable[[], Any], iters: int, cuda: bool) -> float:
  """PyTorch's seconds per call: back to back on a GPU (as ourgrad's kernels, no host gap counted), wall on the CPU."""
  if not cuda: return torch_seconds(function, iters, False)
  import torch
  return back_to_back_seconds(function, torch.cuda.synchronize, launches=max(iters, 2))


def _search_available() -> bool:
  try:
    import ourgrad.codegen.opt.search  # noqa: F401
    return True
  except ImportError:
    return False


def _beam_seconds(device: str, build: Callable[[], Tensor], replays: int) -> float | None:
  """Cold summed kernel time with BEAM=2 (the search runs on the first call, then its cache is used)."""
  os.environ["BEAM"] = "2"
  realize._runner_cache.clear()
  try:
    seconds, _ = cold_schedule_seconds(device, build(), replays)
  except Exception as error:
    print(f"  BEAM=2 failed: {type(error).__name__}: {error}")
    seconds = None
  finally:
    del os.environ["BEAM"]
    realize._runner_cache.clear()
  return seconds


def mnist_step(device: str, scale: int, steps: int = 5, replays: int = 10) -> None:
  """Training steps of examples/mnist.py's default model (batch 256) on random images: each kernel's cold time
  (timing.cold_kernel_seconds) beside its DEBUG=2 event time (median over `steps` steps), bytes, GB/s against the
  copy bandwidth, GFLOP/s (a weight gradient is matmul-like), kind and role; then the totals per role."""
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
  kinds, roles = KernelKinds(device), MnistRoles(mnist.MODELS["small"], batch)
  runs: list[list[tuple[ExecItem, float | None]]] = []
  walls = []
  with Tensor.train():
    for _ in range(2): mnist.train_step(model, optimizer, images, labels, buffers)  # compile everything
    for _ in range(steps):
      with recorded_launches() as launches:
        began = time.perf_counter()
        mnist.train_step(model, optimizer, images, labels, buffers)
        walls.append(time.perf_counter() - began)
      runs.append(launches)
  kinds.update()
  events = median_by_launch([[seconds for _, seconds in run] for run in runs])
  cold: dict[tuple, Any] = {}   # one timing per kernel and buffer sizes: a step launches some kernels twice
  rows = []
  step_kinds = [kinds.get(item.runner) for item, _ in runs[0]]
  for (item, _), event, kind, forward in zip(runs[0], events, step_kinds, roles.forward_flags(step_kinds)):
    runner = item.runner
    key = (id(runner), tuple((buffer.size, buffer.dtype) for buffer in item.bufs))
    if key not in cold: cold[key] = cold_kernel_seconds(item, replays)
    rows.append(KernelRow(runner.name, runner.display_name, cold[key].seconds, event, runner.byte_count,
                          runner.op_count, KernelKinds.describe(kind), roles.role(kind, forward)))
  methods = sorted({timing.method for timing in cold.values()})
  total = sum(row.seconds for row in rows)
  event_total = sum(row.event_seconds or 0.0 for row in rows)
  print(f"\nmnist training step (batch {batch}): {len(rows)} kernels, sum of kernel times {total * 1e3:.3f} ms "
        f"(cold, {'/'.join(methods)}: timing.cold_kernel_seconds); DEBUG=2's 1-launch event times sum to "
        f"{event_total * 1e3:.3f} ms (median of {steps} steps per kernel); wall {statistics.median(walls) * 1e3:.1f} "
        f"ms (with DEBUG=2's per-kernel synchronization)")
  reference = CopyReference(device, (1 << 26) >> 2 * scale)
  print(reference.describe())
  print(f"floor: a one-element kernel timed the same way takes {floor_seconds(device, replays) * 1e6:.2f} us (what "
        f"every launch costs here)")
  print("kind: outputs x values per output ('matmul' where an input is reused across outputs: a convolution, its "
        "gradients, a Linear). role: from the model's layer sizes; forward = launched up to the logits' kernel")
  print_table(rows, reference, "ms", "1-launch")


if __name__ == "__main__":
  main()
