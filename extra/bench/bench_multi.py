"""Benchmark training over several GPUs: ourgrad's DataParallel against PyTorch DDP, and allreduce bus bandwidth
against torch.distributed's NCCL allreduce, all in one run.

    python extra/bench/bench_multi.py                      # CUDA: 1, 2 and 4 GPUs (those present), full sizes
    python extra/bench/bench_multi.py --gpus 1 2           # pick the GPU counts
    python extra/bench/bench_multi.py --kind CLANG --quick # a smoke test on CPU devices CLANG:0..n-1 (gloo for torch)

Methodology
- Workloads: an MLP (784-1024-1024-10, ReLU, SGD lr 0.01) and the MNIST CNN of examples/mnist.py ("small": two
  conv-batchnorm-relu-maxpool blocks and a Linear; Adam lr 2e-3), on random MNIST-shaped float32 data, cross-entropy.
  Global batch: MLP 8192, CNN 2048 (--quick: 256 and 128), cut evenly over the GPUs (weak scaling per GPU count is
  not measured: the global batch stays fixed, as when a user adds GPUs to finish a run sooner).
- ourgrad: DataParallel over CUDA:0..n-1 (bucketed NCCL allreduce of gradients, 25 MiB buckets). torch: one process
  per GPU (torch.multiprocessing), DistributedDataParallel with its defaults, the NCCL backend.
- Step time: 3 warm-up steps (compiles), then the median of 10 steps, each ended by a synchronize of every device.
  samples/s = global batch / step time; scaling efficiency = samples/s at n GPUs / (n x samples/s at 1 GPU).
- Allreduce: 256 MiB of float32 per GPU; bus bandwidth = bytes x 2(n-1)/n / time (nccl-tests' definition), the
  median of 10 after 3 warm-ups. ourgrad: collectives.allreduce through NCCL (inputs realized first, output
  realized; a synchronize of every GPU ends each). torch: dist.all_reduce in one process per GPU, then
  torch.cuda.synchronize and a barrier.
- NCCL_NVLS_ENABLE=0 for both libraries (NVLink multicast stays off on shared hosts).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [ROOT, os.path.join(ROOT, "examples"), os.path.dirname(os.path.abspath(__file__))]
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
from timing import synchronized_median_seconds  # noqa: E402  (beside this script)

WARMUP, RUNS = 3, 10


def device_names(kind: str, count: int) -> list[str]:
  return [f"{kind}:{index}" for index in range(count)]


def median_time(step: Callable[[], None], sync: Callable[[], None]) -> float:
  """Median seconds of RUNS synchronized steps after WARMUP (timing.synchronized_median_seconds)."""
  return synchronized_median_seconds(step, sync, RUNS, WARMUP)


# ---------------------------------------------------------------- ourgrad

def ourgrad_models() -> dict[str, tuple[Callable[[], Any], Callable[[list], Any], tuple[int, ...]]]:
  from mnist import MODELS, ConvNet
  from ourgrad.nn import Linear
  from ourgrad.nn.optim import SGD, Adam

  class MLP:
    def __init__(self) -> None: self.layers = [Linear(784, 1024), Linear(1024, 1024), Linear(1024, 10)]
    def __call__(self, x: Any) -> Any:
      x = x.reshape(x.shape[0], -1)
      for layer in self.layers[:-1]: x = layer(x).relu()
      return self.layers[-1](x)

  return {"mlp": (MLP, lambda params: SGD(params, lr=0.01), (1, 28, 28)),
          "cnn": (lambda: ConvNet(MODELS["small"]), lambda params: Adam(params, lr=2e-3), (1, 28, 28))}


def ourgrad_step_time(workload: str, devices: list[str], batch: int) -> float:
  from ourgrad.device import Device
  from ourgrad.distributed.data_parallel import DataParallel
  from ourgrad.nn.losses import cross_entropy
  make_model, make_optimizer, sample_shape = ourgrad_models()[workload]
  parallel = DataParallel(make_model, devices, make_optimizer)
  rng = np.random.default_rng(0)
  images = rng.standard_normal((batch, *sample_shape)).astype(np.float32)
  labels = rng.integers(0, 10, batch).astype(np.int32)
  step = lambda: parallel.step(lambda model, x, y: cross_entropy(model(x), y), images, labels)  # noqa: E731
  return median_time(step, lambda: [Device[name].synchronize() for name in parallel.devices])


def ourgrad_allreduce_seconds(devices: list[str], nbytes: int) -> float:
  from ourgrad import Tensor
  from ourgrad.device import Device
  from ourgrad.distributed.collectives import allreduce
  inputs = [Tensor.ones(nbytes // 4, device=name).contiguous().realize().lazydata for name in devices]
  def step() -> None:
    outputs = allreduce(inputs)
    Tensor.realize_all(*[Tensor(output) for output in outputs])
  return median_time(step, lambda: [Device[name].synchronize() for name in devices])


# ---------------------------------------------------------------- torch (one process per device)

def torch_worker(rank: int, world_size: int, task: str, batch: int, nbytes: int, use_cuda: bool, port: int,
                 results: Any) -> None:
  import torch
  import torch.distributed as dist
  os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
  dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
  device = torch.device(f"cuda:{rank}") if use_cuda else torch.device("cpu")
  if use_cuda: torch.cuda.set_device(device)
  sync = (lambda: (torch.cuda.synchronize(), dist.barrier())) if use_cuda else dist.barrier
  if task == "allreduce":
    data = torch.ones(nbytes // 4, device=device)
    seconds = median_time(lambda: dist.all_reduce(data), sync)
  else:
    model = torch_model(task).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if use_cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01) if task == "mlp" else torch.optim.Adam(ddp.parameters(),
                                                                                                   lr=2e-3)
    local = batch // world_size
    images = torch.randn(local, 1, 28, 28, device=device)
    labels = torch.randint(0, 10, (local,), device=device)
    def step() -> None:
      optimizer.zero_grad()
      torch.nn.functional.cross_entropy(ddp(images), labels).backward()
      optimizer.step()
    seconds = median_time(step, sync)
  if rank == 0: results.put(seconds)
  dist.destroy_process_group()


def torch_model(task: str) -> Any:
  import torch.nn as nn
  if task == "mlp":
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))
  return nn.Sequential(nn.Conv2d(1, 16, 5, bias=False), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                       nn.Conv2d(16, 32, 5, bias=False), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                       nn.Flatten(), nn.Linear(512, 10))


def torch_seconds(task: str, world_size: int, batch: int, nbytes: int, use_cuda: bool) -> float:
  import torch.multiprocessing as mp
  context = mp.get_context("spawn")
  results = context.Queue()
  port = 29500 + np.random.default_rng().integers(0, 1000)
  mp.start_processes(torch_worker, args=(world_size, task, batch, nbytes, use_cuda, int(port), results),
                     nprocs=world_size, start_method="spawn")
  return results.get()


# ---------------------------------------------------------------- report

def bus_bandwidth(nbytes: int, devices: int, seconds: float) -> float:
  return nbytes * 2 * (devices - 1) / devices / seconds / 1e9


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--gpus", type=int, nargs="+", help="device counts (default 1 2 4, those present)")
  parser.add_argument("--kind", default="CUDA", help="device kind: CUDA, or CLANG for a CPU smoke test")
  parser.add_argument("--quick", action="store_true", help="small batches and a 16 MiB allreduce")
  parser.add_argument("--skip-torch", action="store_true")
  args = parser.parse_args()
  use_cuda = args.kind.upper() == "CUDA"
  available = 4
  if use_cuda:
    import torch
    available = torch.cuda.device_count()
  counts = [count for count in (args.gpus or [1, 2, 4]) if count <= available]
  batches = {"mlp": 256, "cnn": 128} if args.quick else {"mlp": 8192, "cnn": 2048}
  nbytes = (16 if args.quick else 256) << 20
  print(f"{args.kind} x {counts}; global batches {batches}; allreduce {nbytes >> 20} MiB; median of {RUNS}")

  print(f"\n{'workload':8} {'GPUs':>4} {'ourgrad samples/s':>18} {'eff':>6} {'torch DDP samples/s':>20} {'eff':>6}")
  for workload, batch in batches.items():
    base: dict[str, float] = {}
    for count in counts:
      ours = batch / ourgrad_step_time(workload, device_names(args.kind, count), batch)
      theirs = float("nan") if args.skip_torch else batch / torch_seconds(workload, count, batch, nbytes, use_cuda)
      base.setdefault("ours", ours)
      base.setdefault("theirs", theirs)
      print(f"{workload:8} {count:>4} {ours:>18,.0f} {ours / (count * base['ours']):>6.1%} {theirs:>20,.0f} "
            f"{theirs / (count * base['theirs']):>6.1%}", flush=True)

  print(f"\n{'GPUs':>4} {'ourgrad busbw GB/s':>19} {'torch.distributed busbw GB/s':>29}   "
        f"({nbytes >> 20} MiB allreduce)")
  for count in (count for count in counts if count >= 2):
    ours = bus_bandwidth(nbytes, count, ourgrad_allreduce_seconds(device_names(args.kind, count), nbytes))
    theirs = float("nan") if args.skip_torch else bus_bandwidth(nbytes, count, torch_seconds("allreduce", count, 0,
                                                                                              nbytes, use_cuda))
    print(f"{count:>4} {ours:>19.1f} {theirs:>29.1f}", flush=True)


if __name__ == "__main__":
  main()
