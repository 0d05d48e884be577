"""Sweep the fused attention forward kernel's tile configurations on one device: ms and TFLOP/s of the forward alone
(ourgrad's Ops.ATTENTION kernel under TinyJit, launched back to back) for each (block_m, block_n, stages) and ldmatrix
on or off, beside PyTorch's fused SDPA forward in the same process, so the plan's defaults (codegen/attention.py
`plan_attention`) can be picked from one run.

    python extra/bench/sweep_attention.py                                  # B=4 H=12 D=64 causal, T 1024 4096, bf16 f32
    python extra/bench/sweep_attention.py --lengths 4096 --dtypes bfloat16 --configs 128,64,2 128,128,2
    python extra/bench/sweep_attention.py --dtypes bfloat16 --ldmatrix 1 --configs --wgmma-configs 64,128,2,1,3
    DEVICE=PYTHON EMULATE=CUDA python extra/bench/sweep_attention.py --device PYTHON --lengths 128 --batch 1 --heads 2

Each row: the configuration ("rule" is the plan's own choice, printed as the blocks it picked), ms per forward, the
TFLOP/s that makes (a causal forward counts half the 4 B H L S D of Q K^T and P V), its time over PyTorch's, and the
max abs error of O against PyTorch's float64 math SDPA of the same rounded values. A configuration that fails (over
the shared memory, a compile error) prints its error and the sweep goes on. --wgmma-configs runs the wgmma kernel
(ATTENTION_WGMMA=1, codegen/attention_wgmma.py: 16-bit operands on sm_90) with its rule's and these tiles after the
mma.sync ones, labelled "wgmma".
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
sys.path.insert(0, str(Path(__file__).resolve().parent))   # timing.py, beside this script
import torch  # noqa: E402

from ourgrad import Device, Tensor, TinyJit, dtypes, set_float32_matmul_precision  # noqa: E402
from ourgrad.codegen.attention import AttentionKernel, blocks_text, is_attention  # noqa: E402
from ourgrad.engine import realize  # noqa: E402
from ourgrad.engine.schedule import create_schedule  # noqa: E402
from timing import back_to_back_seconds  # noqa: E402

TORCH_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (block_m, block_n, stages[, warp_tiles[, min_ctas]]): the rule's neighbours for head size 64 (rows per CTA 64/128,
# keys per tile 64-128, 2 or 3 stages, one or two m tiles of 16 rows per warp, registers capped for 2 CTAs of 8
# warps). The H200 sweep of session 12 (bf16, causal, B=4 H=12): 64,128,2 fastest at T=1024 and 4096, 128,64,2,2
# within 2%, 128x128 and 128,32 slowest
DEFAULT_CONFIGS = ["64,128,2", "64,128,3", "64,64,2", "64,64,3", "128,64,2,1,2", "128,64,3,1,2", "128,64,2,2",
                   "128,128,2"]


def synchronize_torch() -> None:
  if TORCH_DEVICE == "cuda": torch.cuda.synchronize()


def torch_forward(arrays: list[np.ndarray], dtype: str, causal: bool) -> tuple[float, torch.Tensor]:
  q, k, v = (torch.tensor(a, device=TORCH_DEVICE).to(TORCH_DTYPES[dtype]) for a in arrays)

  def step() -> torch.Tensor: return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
  return back_to_back_seconds(step, synchronize_torch, launches=20), step()


def ourgrad_forward(arrays: list[np.ndarray], dtype: str, causal: bool, device: str,
                    launches: int) -> tuple[float, np.ndarray, str]:
  """Seconds per forward under the current ATTENTION_* settings, its O as float32 (B, H, L, D), and the plan's
  blocks as the kernel was built."""
  realize._runner_cache.clear()   # the plan is made when a kernel is built: a new setting needs a new one
  q, k, v = (Tensor(a, device=device).cast(getattr(dtypes, dtype)).contiguous().realize() for a in arrays)
  out = q.scaled_dot_product_attention(k, v, is_causal=causal)
  items = [item for item in create_schedule([out.lazydata]) if is_attention(item.ast)]
  plan = AttentionKernel(items[0].ast, Device[device].renderer).plan
  blocks = blocks_text(plan)
  blocks += "" if plan.ldmatrix or plan.mma == "wgmma" else " lds"
  blocks += " wgmma" if plan.mma == "wgmma" else ""

  @TinyJit
  def step(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return q.scaled_dot_product_attention(k, v, is_causal=causal).realize()
  results: list[Tensor] = []

  def call() -> None: results[:] = [step(q, k, v)]
  seconds = back_to_back_seconds(call, Device[device].synchronize, launches=launches)
  return seconds, results[0].cast(dtypes.float32).numpy(), blocks


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--heads", type=int, default=12)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
  parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
  parser.add_argument("--configs", nargs="*", default=DEFAULT_CONFIGS,
                      help="block_m,block_n,stages[,warp_tiles[,min_ctas]] each")
  parser.add_argument("--wgmma-configs", nargs="*", default=None,
                      help="block_m,block_n,stages[,1[,min_ctas[,overlap[,q_shared[,producer[,consumer_registers]]]]]] "
                      "each for the wgmma kernel (its rule's always first)")
  parser.add_argument("--ldmatrix", nargs="+", type=int, default=[1, 0], help="1: ldmatrix fragments, 0: plain loads")
  parser.add_argument("--not-causal", action="store_true")
  parser.add_argument("--device", default="CUDA", help="ourgrad device (PYTHON with EMULATE=CUDA: a smoke test)")
  parser.add_argument("--launches", type=int, default=20)
  parser.add_argument("--slacks", nargs="+", type=float, default=[None],
                      help="ATTENTION_RESCALE_SLACK values to run each configuration with (default: the setting's own)")
  parser.add_argument("--settings", nargs="+", default=[""],
                      help="NAME=VALUE[,NAME=VALUE] environment settings to run each configuration under, e.g. "
                      "ATTENTION_TREE_REDUCE=0 (default: as the environment has them)")
  args = parser.parse_args()
  causal = not args.not_causal
  set_float32_matmul_precision("high")
  torch.backends.cuda.matmul.allow_tf32 = True
  os.environ["FUSED_ATTENTION"] = "1"
  torch_on = torch.cuda.get_device_name() if TORCH_DEVICE == "cuda" else "torch on the CPU"
  print(f"fused attention forward sweep, B={args.batch} H={args.heads} D={args.head_dim} "
        f"{'causal' if causal else 'full'}; {torch_on}, ourgrad on {args.device}")
  print(f"{'T':>5} {'dtype':>8} {'config':>20} {'ms':>8} {'TFLOP/s':>8} {'x torch':>8}  max abs error vs float64")
  for length in args.lengths:
    rng = np.random.default_rng(0)
    shape = (args.batch, args.heads, length, args.head_dim)
    arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    flops = 4 * args.batch * args.heads * length * length * args.head_dim // (2 if causal else 1)
    for dtype in args.dtypes:
      rounded = [torch.tensor(a).to(TORCH_DTYPES[dtype]).double().to(TORCH_DEVICE) for a in arrays]
      with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = torch.nn.functional.scaled_dot_product_attention(*rounded, is_causal=causal).cpu().numpy()
      torch_time, torch_out = torch_forward(arrays, dtype, causal)
      torch_error = float(np.abs(torch_out.double().cpu().numpy() - want).max())
      print(f"{length:>5} {dtype:>8} {'torch':>20} {torch_time * 1e3:>8.3f} {flops / torch_time / 1e12:>8.1f} "
            f"{1.0:>8.2f}  {torch_error:.2e}", flush=True)
      runs = [(ldmatrix, 0, config) for ldmatrix in args.ldmatrix for config in [None, *args.configs]]
      if args.wgmma_configs is not None: runs += [(1, 1, config) for config in [None, *args.wgmma_configs]]
      for (ldmatrix, wgmma, config), slack, setting in ((run, slack, setting) for run in runs for slack in args.slacks
                                                         for setting in args.settings):
        for name, value in (pair.split("=", 1) for pair in setting.split(",") if pair): os.environ[name] = value
        os.environ["ATTENTION_LDMATRIX"], os.environ["ATTENTION_WGMMA"] = str(ldmatrix), str(wgmma)
        if config is None: os.environ.pop("ATTENTION_BLOCKS", None)
        else: os.environ["ATTENTION_BLOCKS"] = config
        if slack is not None: os.environ["ATTENTION_RESCALE_SLACK"] = str(slack)
        label = "rule" if config is None else config + ("" if ldmatrix else " lds") + (" wgmma" if wgmma else "")
        try:
          seconds, got, blocks = ourgrad_forward(arrays, dtype, causal, args.device, args.launches)
          if config is None: label = f"rule {blocks}"
          if slack is not None: label += f" slack {slack:g}"
          if setting: label += f" {setting}"
          print(f"{length:>5} {dtype:>8} {label:>20} {seconds * 1e3:>8.3f} {flops / seconds / 1e12:>8.1f} "
                f"{seconds / torch_time:>8.2f}  {float(np.abs(got - want).max()):.2e}", flush=True)
        except Exception as error:  # noqa: BLE001 (report and go on)
          print(f"{length:>5} {dtype:>8} {label:>20} FAILED: {type(error).__name__}: {error}", flush=True)
          traceback.print_exc(limit=2)
  os.environ.pop("ATTENTION_BLOCKS", None)
  os.environ.pop("ATTENTION_WGMMA", None)


if __name__ == "__main__":
  main()
