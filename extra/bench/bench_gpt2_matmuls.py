"""Every matmul of a GPT-2 small training step, alone, in the layout the step reads it: ourgrad beside PyTorch eager
(cuBLAS) on the same shapes and layouts, TF32 (float32 with TensorFloat-32 allowed on both sides) and bfloat16.

Rows (B=8, T=512, C=768, H=12, D=64, vocabulary 50304; N = B*T = 4096 tokens): for each Linear (qkv 768->2304, proj
768->768, fc 768->3072, fc-proj 3072->768, the tied lm-head 768->50304) its forward x @ W^T (W stored out x in), its
input gradient g @ W and its weight gradient g^T @ x (a reduce over the 4096 tokens, both operands contiguous along
the outputs); attention per batch and head: Q @ K^T and P @ V with Q, K, V read from the projection's (B, T, 3C)
output through the head reshape and permute with its bias added in the kernel (as the step fuses it), and the four
backward products dO @ V^T, P^T @ dO, dS @ K and dS^T @ Q (dO read from the proj input gradient's (N, C) buffer
through the head permute). Then 4096^3 float16 and bfloat16.

Method: inputs realized first; ourgrad's schedule lowered once, its kernels (the hand-coded opts) and PyTorch's
call each timed back to back (timing.back_to_back_seconds: `--iters` calls between two synchronizations, median of
5 batches). "% cuBLAS" is PyTorch's time over ourgrad's. Each row's error is ||ours - torch|| / ||torch|| against
PyTorch in the same precision. The kernel names (DEBUG=2's) and the opts say which path each took (tensor cores:
opts with TC or a wgmma kernel name).

Run on a CUDA machine: `python extra/bench/bench_gpt2_matmuls.py` (both precisions), `--only tf32` or `--only bf16`
for one, `--only attn` for the attention rows, `--only dW` for the weight gradients; `--batch 32` for K = 16384 (the
bf16 step's 16 x 1024 tokens); `--device CLANG --scale 4` checks the script on a CPU in a minute.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ourgrad import Tensor  # noqa: E402
from ourgrad.dtype import dtypes  # noqa: E402
from bench_matmul import allow_tf32, ourgrad_seconds, relative_error  # noqa: E402
from timing import back_to_back_seconds, torch_seconds  # noqa: E402

BATCH, SEQUENCE, WIDTH, HEADS, VOCAB = 8, 512, 768, 12, 50304
# the Linears of one block and the tied lm-head: (name, in features, out features)
LINEARS = [("qkv", WIDTH, 3 * WIDTH), ("proj", WIDTH, WIDTH), ("fc", WIDTH, 4 * WIDTH), ("fc-proj", 4 * WIDTH, WIDTH),
           ("lm-head", WIDTH, VOCAB)]


def heads(buffer: Any, bias: Any, part: int, batch: int, length: int, heads_: int) -> Any:
  """Part `part` (0 q, 1 k, 2 v) of a (B, T, 3C) projection output plus its bias (3C), as (B, H, T, D): the step's
  split, head reshape and permute, with the bias added where it is read."""
  width = buffer.shape[-1] // 3
  chunk = (buffer + bias)[:, :, part * width:(part + 1) * width]
  return chunk.reshape(batch, length, heads_, width // heads_).transpose(1, 2)


def from_rows(rows: Any, batch: int, length: int, heads_: int) -> Any:
  """A (B*T, C) gradient buffer read as (B, H, T, D) through the head reshape and permute."""
  return rows.reshape(batch, length, heads_, rows.shape[-1] // heads_).transpose(1, 2)


Row = tuple[str, list[tuple[int, ...]], Callable[..., Any], float]


def gpt2_rows(batch: int, length: int, width: int, heads_: int, vocab: int) -> list[Row]:
  """(name, input shapes, the product written with ops ourgrad and PyTorch share, FLOPs) of every matmul."""
  tokens, head_dim = batch * length, width // heads_
  rows: list[Row] = []
  for name, fan_in, fan_out in LINEARS:
    fan_out = vocab if name == "lm-head" else fan_out * width // WIDTH
    fan_in = fan_in * width // WIDTH
    work = 2.0 * tokens * fan_in * fan_out
    rows += [(f"{name} fwd x@W^T {tokens}x{fan_in}->{fan_out}", [(tokens, fan_in), (fan_out, fan_in)],
              lambda x, w: x @ w.T, work),
             (f"{name} dx g@W {tokens}x{fan_out}->{fan_in}", [(tokens, fan_out), (fan_out, fan_in)],
              lambda g, w: g @ w, work),
             (f"{name} dW g^T@x {fan_out}x{fan_in} K={tokens}", [(tokens, fan_out), (tokens, fan_in)],
              lambda g, x: g.T @ x, work)]
  work = 2.0 * batch * heads_ * length * length * head_dim
  qkv, bias, square, rows_c = (batch, length, 3 * width), (3 * width,), (batch, heads_, length, length), (tokens, width)
  split = lambda buffer, b, part: heads(buffer, b, part, batch, length, heads_)   # noqa: E731
  per_head = lambda rows_: from_rows(rows_, batch, length, heads_)   # noqa: E731
  rows += [
    ("attn Q@K^T", [qkv, bias], lambda x, b: split(x, b, 0) @ split(x, b, 1).transpose(-1, -2), work),
    ("attn P@V", [square, qkv, bias], lambda p, x, b: p @ split(x, b, 2), work),
    ("attn dP=dO@V^T", [rows_c, qkv, bias], lambda g, x, b: per_head(g) @ split(x, b, 2).transpose(-1, -2), work),
    ("attn dV=P^T@dO", [square, rows_c], lambda p, g: p.transpose(-1, -2) @ per_head(g), work),
    ("attn dQ=dS@K", [square, qkv, bias], lambda s, x, b: s @ split(x, b, 1), work),
    ("attn dK=dS^T@Q", [square, qkv, bias], lambda s, x, b: s.transpose(-1, -2) @ split(x, b, 0), work),
  ]
  return rows


def square_rows(side: int) -> list[Row]:
  return [(f"matmul {side}^3", [(side, side), (side, side)], lambda a, b: a @ b, 2.0 * side ** 3)]


def time_row(device: str, cuda: bool, row: Row, precision: str, iters: int) -> str:
  """One row: ourgrad and PyTorch times, TFLOP/s, % of cuBLAS, the error against PyTorch, ourgrad's kernels."""
  import torch
  name, shapes, product, work = row
  allow_tf32(torch, precision == "tf32")
  dtype_name = {"tf32": "float32", "bf16": "bfloat16", "f16": "float16"}[precision]
  rng = np.random.default_rng(0)
  host = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
  inputs = [Tensor(array, device=device).cast(getattr(dtypes, dtype_name)).realize() for array in host]
  ours, kernels = ourgrad_seconds(device, lambda: [product(*inputs)], iters, cuda)
  ours_output = product(*inputs).realize()
  torch_inputs = [torch.tensor(array, device="cuda" if cuda else "cpu").to(getattr(torch, dtype_name))
                  for array in host]
  if cuda: theirs = back_to_back_seconds(lambda: product(*torch_inputs), torch.cuda.synchronize,
                                         launches=max(iters, 2))
  else: theirs = torch_seconds(lambda: product(*torch_inputs), iters, False, warmup=1)
  error = relative_error(ours_output, product(*torch_inputs))
  rate, torch_rate = work / ours / 1e12, work / theirs / 1e12
  return (f"{name + ' ' + precision:<44} {work / 1e9:7.1f} {ours * 1e3:9.3f} {rate:8.1f} {theirs * 1e3:9.3f} "
          f"{torch_rate:8.1f} {theirs / ours * 100:7.0f}%  err {error:.1e}  [{', '.join(kernels)}]")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--scale", type=int, default=0, help="divide batch, sequence and width by 2**scale (a check)")
  parser.add_argument("--batch", type=int, default=BATCH, help="sequences of 512 tokens: the weight gradients' K "
                      "(32: K = 16384, the bf16 step's 16 x 1024)")
  parser.add_argument("--only", default="", help="rows whose name (with its precision) contains one of these, "
                      "comma-separated")
  args = parser.parse_args()
  import torch
  cuda = args.device.upper().startswith("CUDA")
  shrink = 2 ** args.scale
  rows = gpt2_rows(max(args.batch // shrink, 1), SEQUENCE // shrink, WIDTH // shrink, HEADS, VOCAB // shrink)
  jobs = [(row, precision) for precision in ("tf32", "bf16") for row in rows]
  jobs += [(row, precision) for precision in ("f16", "bf16") for row in square_rows(4096 // shrink)]
  print(f"device: {torch.cuda.get_device_name() if cuda else args.device}")
  print(f"{'matmul':<44} {'GFLOP':>7} {'ourgrad':>9} {'TFLOP/s':>8} {'torch':>9} {'TFLOP/s':>8} {'% cuBLAS':>8}"
        "   (times in ms)")
  for row, precision in jobs:
    if not any(part in f"{row[0]} {precision}" for part in args.only.split(",")): continue
    try: print(time_row(args.device, cuda, row, precision, args.iters), flush=True)
    except Exception as error:   # a row that fails is a line saying so, not a failed benchmark
      print(f"{row[0] + ' ' + precision:<44} failed: {type(error).__name__}: {str(error)[:160]}", flush=True)


if __name__ == "__main__":
  main()
