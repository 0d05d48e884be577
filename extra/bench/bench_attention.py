"""Causal scaled_dot_product_attention, forward and forward + backward: ourgrad's fused kernel (Ops.ATTENTION),
ourgrad's composite graph (FUSED_ATTENTION=0 semantics) and PyTorch's fused SDPA, in one process on one GPU.

    python extra/bench/bench_attention.py                       # B=4, H=12, D=64, T in 1024 4096, float32 (TF32), bf16
    python extra/bench/bench_attention.py --lengths 1024 --dtypes bfloat16 --modes fwd
    FUSED_ATTENTION_BACKWARD=0 python extra/bench/bench_attention.py --rows fused --modes fwd+bwd   # composite bwd

Each row: median ms of `--steps` steps (each timed between two synchronizations; ourgrad under TinyJit), the max abs
error of O (and of dq, dk, dv for fwd+bwd) against PyTorch's float64 math SDPA on the same device, and the peak
memory (torch: max_memory_allocated; ourgrad: the largest bytes in live buffers at an allocation, over what was
alive before the row). A case that fails
prints its error and the script goes on.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench_gpt2.py, beside this script
import torch  # noqa: E402

from ourgrad import Device, Tensor, TinyJit, dtypes, set_float32_matmul_precision  # noqa: E402
from ourgrad.engine import realize  # noqa: E402
from ourgrad.helpers import GlobalCounters  # noqa: E402
from bench_gpt2 import ourgrad_peak_memory  # noqa: E402
from timing import synchronized_median_seconds  # noqa: E402

TORCH_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def synchronize_torch() -> None:
  if TORCH_DEVICE == "cuda": torch.cuda.synchronize()


def reference(arrays: list[np.ndarray], grad: np.ndarray, backward: bool) -> list[torch.Tensor]:
  """O (and dq, dk, dv) of causal SDPA in float64 (PyTorch's math backend) on the GPU."""
  q, k, v = (torch.tensor(a, dtype=torch.float64, device=TORCH_DEVICE, requires_grad=backward) for a in arrays)
  out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
  if not backward: return [out.detach()]
  out.backward(torch.tensor(grad, dtype=torch.float64, device=TORCH_DEVICE))
  return [out.detach(), q.grad, k.grad, v.grad]


def run_torch(arrays: list[np.ndarray], grad: np.ndarray, dtype: str, backward: bool, args) -> tuple:
  q, k, v = (torch.tensor(a, device=TORCH_DEVICE).to(TORCH_DTYPES[dtype]).requires_grad_(backward) for a in arrays)
  g = torch.tensor(grad, device=TORCH_DEVICE).to(TORCH_DTYPES[dtype])
  results: list[torch.Tensor] = []

  def step() -> None:
    for t in (q, k, v): t.grad = None
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    if backward: out.backward(g)
    results[:] = [out.detach()] + ([q.grad, k.grad, v.grad] if backward else [])
  if TORCH_DEVICE == "cuda": torch.cuda.reset_peak_memory_stats()
  seconds = synchronized_median_seconds(step, synchronize_torch, args.steps, args.warmup)
  peak = torch.cuda.max_memory_allocated() if TORCH_DEVICE == "cuda" else 0
  return seconds, [r.double() for r in results], peak


def run_ourgrad(arrays: list[np.ndarray], grad: np.ndarray, dtype: str, backward: bool, fused: bool, args) -> tuple:
  # 1: the fused forward and (unless FUSED_ATTENTION_BACKWARD=0) the flash backward kernels, training too
  os.environ["FUSED_ATTENTION"] = "1" if fused else "0"
  realize._runner_cache.clear()
  gc.collect()   # the previous row's captured buffers
  baseline = GlobalCounters.mem_used
  low = getattr(dtypes, dtype)
  q, k, v = (Tensor(a, device=args.device).cast(low).contiguous().realize() for a in arrays)
  g = Tensor(grad, device=args.device).cast(low).contiguous().realize()
  for t in (q, k, v): t.requires_grad = backward

  @TinyJit
  def step(q: Tensor, k: Tensor, v: Tensor, g: Tensor) -> list[Tensor]:
    for t in (q, k, v): t.grad = None
    out = q.scaled_dot_product_attention(k, v, is_causal=True)
    # returned as (B, L, H, D), what a projection after the heads reads (the fused kernel's layout; PyTorch's flash
    # output is a transposed view of the same layout): no copy for the kernel, a transpose for the composite graph
    heads_last = out.transpose(1, 2)
    if not backward: return [heads_last.realize()]
    (out.cast(dtypes.float32) * g.cast(dtypes.float32)).sum().backward()
    return [t.realize() for t in (heads_last, q.grad, k.grad, v.grad)]
  results: list[Tensor] = []

  def call() -> None: results[:] = step(q, k, v, g)
  with ourgrad_peak_memory() as peak:
    GlobalCounters.reset()
    seconds = synchronized_median_seconds(call, Device[args.device].synchronize, args.steps, args.warmup)
  kernels = GlobalCounters.kernel_count // (args.warmup + args.steps)
  values = [torch.tensor(r.cast(dtypes.float32).numpy(), dtype=torch.float64, device=TORCH_DEVICE) for r in results]
  values[0] = values[0].transpose(1, 2)   # O back to (B, H, L, D)
  return seconds, values, peak[0] - baseline, kernels


def errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> str:
  return " ".join(f"{name}={float((a - b).abs().max()):.2e}" for name, a, b in zip(("O", "dq", "dk", "dv"), got, want))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--device", default="CUDA", help="ourgrad device (PYTHON with EMULATE=CUDA: a smoke test)")
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"])
  parser.add_argument("--rows", nargs="+", default=["torch", "fused", "composite"])
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--steps", type=int, default=10)
  args = parser.parse_args()
  set_float32_matmul_precision("high")
  torch.backends.cuda.matmul.allow_tf32 = True
  torch_on = torch.cuda.get_device_name() if TORCH_DEVICE == "cuda" else "torch on the CPU"
  print(f"causal SDPA, B={args.batch} H={args.heads} D={args.head_dim}; {torch_on}, ourgrad on {args.device}")
  print(f"{'T':>5} {'dtype':>8} {'mode':>7} {'row':>9} {'ms':>9} {'peak MiB':>9} {'kernels':>7}  "
        "max abs error vs float64")
  for length in args.lengths:
    rng = np.random.default_rng(0)
    shape = (args.batch, args.heads, length, args.head_dim)
    arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    grad = rng.standard_normal(shape).astype(np.float32)
    for dtype in args.dtypes:
      # the float64 reference of the values each row really gets (rounded to the dtype)
      rounded = [torch.tensor(a).to(TORCH_DTYPES[dtype]).float().numpy() for a in arrays]
      grad_rounded = torch.tensor(grad).to(TORCH_DTYPES[dtype]).float().numpy()
      for mode in args.modes:
        backward = mode == "fwd+bwd"
        try:
          want = reference(rounded, grad_rounded, backward)
        except Exception as error:  # noqa: BLE001 (report and go on)
          print(f"{length:>5} {dtype:>8} {mode:>7} reference failed: {error}")
          want = None
        for row in args.rows:
          try:
            if row == "torch":
              seconds, got, peak = run_torch(arrays, grad, dtype, backward, args)
              kernels = "-"
            else:
              seconds, got, peak, kernels = run_ourgrad(arrays, grad, dtype, backward, row == "fused", args)
            error_text = errors(got, want) if want is not None else ""
            print(f"{length:>5} {dtype:>8} {mode:>7} {row:>9} {seconds * 1e3:>9.3f} {peak / 2**20:>9.0f} "
                  f"{kernels:>7}  {error_text}", flush=True)
          except Exception as error:  # noqa: BLE001 (report and go on)
            print(f"{length:>5} {dtype:>8} {mode:>7} {row:>9} FAILED: {type(error).__name__}: {error}", flush=True)
            traceback.print_exc(limit=3)
          if TORCH_DEVICE == "cuda": torch.cuda.empty_cache()


if __name__ == "__main__":
  main()
