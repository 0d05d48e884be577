"""Matmul and convolution benchmark: ourgrad (hand-coded opts, and BEAM=2) beside PyTorch eager (cuBLAS/cuDNN on
CUDA, its own BLAS/oneDNN on the CPU), torch.compile(mode="max-autotune") and, on the CPU, numpy's BLAS, in one run.

Rows on CUDA: matmul 4096^3 float32 (TF32 off everywhere), float16 and bfloat16 (float32 accumulation), ragged
4097x4095x4096 float16, conv2d 64x64x56x56 with 64 3x3 filters, pad 1, float32 and float16; then the float32 rows
named "tf32" with TensorFloat-32 allowed on both sides (ourgrad.set_float32_matmul_precision("high"), PyTorch's
allow_tf32 for cuBLAS and cuDNN, which torch.compile follows): `--only tf32` runs those alone.
Rows on the CPU (`--device CLANG`): matmul 1024^3 and 2048^3 float32, conv2d forward+backward of 32x16x64x64 with
32 3x3 filters.

Method: inputs are realized first. On CUDA, ourgrad's schedule is lowered once and its kernels, PyTorch eager and
torch.compile are each timed the same way: `--iters` calls queued back to back between two synchronizations, per call,
median of 5 such batches after a warm-up batch (timing.back_to_back_seconds). Timing one launch between two events
instead also counts the gap while the host launches into an idle GPU: 30-60 us more on the f32 conv (0.435 vs
0.375 ms, H100). On the CPU: the median wall time of `--iters` runs after 2 warm-ups (kernels run synchronously).
"% torch" is PyTorch eager's time over ourgrad's.
Each row also gives its relative error against PyTorch's output, and on CUDA the 4096^3 float16 and float32 rows are
followed by variants: the same matmul with explicit opt lists (VARIANTS: warp and block tiles, K step, staged or
not, and on sm_90 the wgmma kernel's tiles), to compare tile choices in one run (`--no-variants` skips them).
Run: `python extra/bench/bench_matmul.py` on a CUDA machine, `python extra/bench/bench_matmul.py --device CLANG`
on the CPU (`--scale 4` divides every side by 16, to check the script quickly). BEAM=2 and max-autotune each
search for minutes per row: `--beam 0 --no-compile` gives the hand-coded and eager columns alone, and `--only f16`
runs the rows whose name contains `f16`.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import ourgrad  # noqa: E402
from ourgrad import Device, Tensor  # noqa: E402
from timing import back_to_back_seconds, torch_seconds  # noqa: E402 (extra/bench/timing.py, beside this script)
from ourgrad.codegen.kernel import describe_opts  # noqa: E402
from ourgrad.dtype import dtypes  # noqa: E402
from ourgrad.engine import realize  # noqa: E402
from ourgrad.engine.realize import get_kernel, get_runner, lower_schedule  # noqa: E402
from ourgrad.engine.schedule import create_schedule  # noqa: E402

# (name, kind, shapes..., dtype name): the "mm" kinds (MATMUL_LAYOUTS) take (m, k, n); "conv" (batch, cin, height,
# width, cout, pad); "conv_step" the same, forward and backward
CUDA_ROWS = [
  ("matmul 4096^3 f32", "mm", (4096, 4096, 4096), "float32"),
  ("matmul 4096^3 f16", "mm", (4096, 4096, 4096), "float16"),
  ("matmul 4096^3 bf16", "mm", (4096, 4096, 4096), "bfloat16"),
  ("matmul 4097x4096 @ 4096x4095 f16", "mm", (4097, 4096, 4095), "float16"),
  ("conv 64x64x56x56 3x3 f32", "conv", (64, 64, 56, 56, 64, 1), "float32"),
  ("conv 64x64x56x56 3x3 f16", "conv", (64, 64, 56, 56, 64, 1), "float16"),
  # TF32 allowed on both sides (see the module doc)
  ("matmul 4096^3 f32 tf32", "mm", (4096, 4096, 4096), "float32"),
  ("matmul 4097x4096 @ 4096x4095 f32 tf32", "mm", (4097, 4096, 4095), "float32"),
  ("matmul 4096^3 x @ W^T f32 tf32", "mm_bT", (4096, 4096, 4096), "float32"),   # B K-major: wgmma on sm_90
  ("matmul 4096^3 B copied K-major first f32 tf32", "mm_bcopy", (4096, 4096, 4096), "float32"),
  ("conv 64x64x56x56 3x3 f32 tf32", "conv", (64, 64, 56, 56, 64, 1), "float32"),
  # the matmuls of bench_jit.py's MLP step (784-512-512-10, batch 512), of the SmolLM2 prefill (512 tokens, 576 and
  # 1536 wide) and of MiniLM (2048 tokens, 384 and 1536 wide): too small for 128x128 tiles to fill the GPU
  ("mlp fwd 512x784 @ W^T", "mm_bT", (512, 784, 512), "float32"),
  ("mlp fwd relu(h+b) @ W^T 512^3", "mm_relu_bT", (512, 512, 512), "float32"),
  ("mlp dx 512^3 g @ W", "mm", (512, 512, 512), "float32"),
  ("mlp dW 512^3 g^T @ relu(h+b)", "mm_aT_relu", (512, 512, 512), "float32"),
  ("mlp dW 512x784 g^T @ x", "mm_aT", (512, 512, 784), "float32"),
  ("mlp fwd 512x512 @ W^T (10 wide)", "mm_relu_bT", (512, 512, 10), "float32"),
  ("mlp dW 10x512 g^T @ relu(h+b)", "mm_aT_relu", (10, 512, 512), "float32"),
  ("mlp dx 512x10 @ 10x512", "mm", (512, 10, 512), "float32"),
  ("smollm2 512x576 @ (1536x576)^T", "mm_bT", (512, 576, 1536), "float32"),
  ("smollm2 512x1536 @ (576x1536)^T", "mm_bT", (512, 1536, 576), "float32"),
  ("minilm 2048x384 @ (1536x384)^T", "mm_bT", (2048, 384, 1536), "float32"),
  # the rest of MiniLM's matmuls at batch 64 x 32 tokens (FFN down, the fused Q/K/V projection, the attention output
  # projection reading the heads' permuted output, the attention's two batched matmuls reading the Q/K/V buffer) and
  # SmolLM2's K/V projection (3 heads of 64)
  ("minilm 2048x1536 @ (384x1536)^T", "mm_bT", (2048, 1536, 384), "float32"),
  ("minilm 2048x384 @ (1152x384)^T", "mm_bT", (2048, 384, 1152), "float32"),
  ("minilm attn out 64x32x(12x32) @ (384x384)^T", "attn_out", (64, 12, 32, 32, 384), "float32"),
  ("minilm attn q@k^T 64x12x32x32x32", "attn_qk", (64, 12, 32, 32), "float32"),
  ("minilm attn p@v 64x12x32x32x32", "attn_pv", (64, 12, 32, 32), "float32"),
  ("smollm2 512x576 @ (192x576)^T", "mm_bT", (512, 576, 192), "float32"),
  # the SmolLM2 prefill's fused projections: gate and up (2 x 1536), Q/K/V (576 + 2 x 192), and the output projection
  ("smollm2 512x576 @ (3072x576)^T", "mm_bT", (512, 576, 3072), "float32"),
  ("smollm2 512x576 @ (960x576)^T", "mm_bT", (512, 576, 960), "float32"),
  ("smollm2 512x576 @ (576x576)^T", "mm_bT", (512, 576, 576), "float32"),
]
# the matmul kinds: operand shapes from (m, k, n), and the product (`relu` of the library's tensors)
MATMUL_LAYOUTS: dict[str, tuple[Callable[[int, int, int], list[tuple[int, ...]]], Callable[..., Any]]] = {
  "mm": (lambda m, k, n: [(m, k), (k, n)], lambda relu: lambda a, b: a @ b),
  # a Linear's forward: the weight is stored (out, in)
  "mm_bT": (lambda m, k, n: [(m, k), (n, k)], lambda relu: lambda a, b: a @ b.T),
  # a @ b with b first copied K-major (N x K, a kernel of its own), read back transposed: TF32 wgmma reads only K-major
  "mm_bcopy": (lambda m, k, n: [(m, k), (k, n)], lambda relu: lambda a, b: a @ b.T.contiguous().T),
  # a Linear's weight gradient: both operands contiguous along the outputs, not the reduce
  "mm_aT": (lambda m, k, n: [(k, m), (k, n)], lambda relu: lambda a, b: a.T @ b),
  # the next Linear's forward with the bias and ReLU of the previous one fused into its operand
  "mm_relu_bT": (lambda m, k, n: [(m, k), (k,), (n, k)], lambda relu: lambda a, bias, b: relu(a + bias) @ b.T),
  # the weight gradient that recomputes the forward's activation
  "mm_aT_relu": (lambda m, k, n: [(k, m), (k, n), (n,)], lambda relu: lambda g, h, bias: g.T @ relu(h + bias)),
}


def _heads(qkv: Any, bias: Any, part: int) -> Any:
  """Q, K or V (batch, heads, tokens, head_dim) of a fused projection's (batch, tokens, 3, heads, head_dim) output
  before its bias, plus the bias (3 x heads x head_dim): MiniLM's attention matmuls read the projection so, the bias
  add fused into their loads."""
  return (qkv + bias.reshape(qkv.shape[2:]))[:, :, part].transpose(1, 2)


# attention-shaped kinds, sizes (batch, heads, tokens, head_dim[, out features]): (operand shapes, product, FLOPs).
# The products use only indexing, transpose, reshape and @, which ourgrad and PyTorch share.
ATTENTION_LAYOUTS: dict[str, tuple[Callable[..., list[tuple[int, ...]]], Callable[..., Any], Callable[..., float]]] = {
  # scores: Q @ K^T, both read from the Q/K/V buffer
  "attn_qk": (lambda b, h, t, d: [(b, t, 3, h, d), (3 * h * d,)],
              lambda qkv, bias: _heads(qkv, bias, 0) @ _heads(qkv, bias, 1).transpose(-2, -1),
              lambda b, h, t, d: 2.0 * b * h * t * t * d),
  # probabilities @ V
  "attn_pv": (lambda b, h, t, d: [(b, h, t, t), (b, t, 3, h, d), (3 * h * d,)],
              lambda p, qkv, bias: p @ _heads(qkv, bias, 2),
              lambda b, h, t, d: 2.0 * b * h * t * t * d),
  # the output projection of the heads' (batch, heads, tokens, head_dim) result, read as (batch, tokens, hidden)
  "attn_out": (lambda b, h, t, d, n: [(b, h, t, d), (n, h * d)],
               lambda x, w: x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1) @ w.T,
               lambda b, h, t, d, n: 2.0 * b * t * h * d * n),
}
CPU_ROWS = [
  ("matmul 1024^3 f32", "mm", (1024, 1024, 1024), "float32"),
  ("matmul 2048^3 f32", "mm", (2048, 2048, 2048), "float32"),
  ("conv 32x16x64x64 3x3 fwd+bwd", "conv_step", (32, 16, 64, 64, 32, 0), "float32"),
]


def scaled(kind: str, sizes: tuple[int, ...], scale: int) -> tuple[int, ...]:
  if scale == 0: return sizes
  if kind in ATTENTION_LAYOUTS: return (max(sizes[0] >> scale, 2),) + sizes[1:]
  if kind.startswith("mm"): return tuple(max(size >> scale, 8) + (size & 1) for size in sizes)
  batch, cin, height, width, cout, pad = sizes
  return (max(batch >> scale, 2), cin, max(height >> scale, 8), max(width >> scale, 8), cout, pad)


def flops(kind: str, sizes: tuple[int, ...]) -> float:
  if kind in ATTENTION_LAYOUTS: return ATTENTION_LAYOUTS[kind][2](*sizes)
  if kind.startswith("mm"):
    m, k, n = sizes
    return 2.0 * m * k * n
  batch, cin, height, width, cout, pad = sizes
  out_h, out_w = height + 2 * pad - 2, width + 2 * pad - 2
  forward = 2.0 * batch * cout * out_h * out_w * cin * 9
  return forward * (3 if kind == "conv_step" else 1)  # backward: input and weight gradients, each a forward's work


def host_inputs(kind: str, sizes: tuple[int, ...]) -> list[np.ndarray]:
  rng = np.random.default_rng(0)
  if kind in ATTENTION_LAYOUTS: return [rng.standard_normal(shape, dtype=np.float32)
                                        for shape in ATTENTION_LAYOUTS[kind][0](*sizes)]
  if kind.startswith("mm"):
    return [rng.standard_normal(shape, dtype=np.float32) for shape in MATMUL_LAYOUTS[kind][0](*sizes)]
  batch, cin, height, width, cout, pad = sizes
  out_h, out_w = height + 2 * pad - 2, width + 2 * pad - 2
  operands = [rng.standard_normal((batch, cin, height, width), dtype=np.float32),
              rng.standard_normal((cout, cin, 3, 3), dtype=np.float32)]
  # the output's gradient: random, as in training (a constant one, from out.sum(), would fold away the matmul)
  if kind == "conv_step": operands.append(rng.standard_normal((batch, cout, out_h, out_w), dtype=np.float32))
  return operands


def ourgrad_function(kind: str, sizes: tuple[int, ...]) -> Callable[..., list[Tensor]]:
  if kind in ATTENTION_LAYOUTS: return lambda *operands: [ATTENTION_LAYOUTS[kind][1](*operands)]
  if kind.startswith("mm"):
    product = MATMUL_LAYOUTS[kind][1](lambda x: x.relu())
    return lambda *operands: [product(*operands)]
  pad = sizes[-1]
  if kind == "conv": return lambda x, w: [x.conv2d(w, padding=pad)]

  def step(x: Tensor, w: Tensor, grad_out: Tensor) -> list[Tensor]:
    x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    out = x.conv2d(w, padding=pad)
    out.backward(grad_out)
    return [out, x.grad, w.grad]
  return step


def torch_function(kind: str, sizes: tuple[int, ...]) -> Callable[..., Any]:
  import torch
  if kind in ATTENTION_LAYOUTS: return ATTENTION_LAYOUTS[kind][1]
  if kind.startswith("mm"): return MATMUL_LAYOUTS[kind][1](lambda x: x.relu())
  pad = sizes[-1]
  if kind == "conv": return lambda x, w: torch.nn.functional.conv2d(x, w, padding=pad)

  def step(x: Any, w: Any, grad_out: Any) -> Any:
    x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    out = torch.nn.functional.conv2d(x, w, padding=pad)
    out.backward(grad_out)
    return out, x.grad, w.grad
  return step


def ourgrad_seconds(device: str, build: Callable[[], list[Tensor]], iters: int, cuda: bool) -> tuple[float, list[str]]:
  """Seconds of the kernels that realize what `build()` returns, and their names (with opts). On CUDA the schedule is
  lowered once and its kernels launched back to back (timing.back_to_back_seconds, as the torch column); on the CPU
  the median wall time of `iters` runs after 2 warm-ups (kernels run synchronously there)."""
  schedule = create_schedule([tensor.lazydata for tensor in build()])
  names = [get_runner(device, item.ast).name + kernel_opts(device, item.ast) for item in schedule]
  items = lower_schedule(schedule)

  def run_all() -> None:
    for item in items: item.run()
  if cuda: return back_to_back_seconds(run_all, Device[device].synchronize, launches=max(iters, 2)), names
  totals = []
  for _ in range(iters + 2):
    began = time.perf_counter()
    run_all()
    totals.append(time.perf_counter() - began)
  return statistics.median(totals[2:]), names


def relative_error(ours: Tensor, theirs: Any) -> float:
  """||ours - theirs|| / ||theirs|| in float64 (the first output of a row against PyTorch's)."""
  mine = ours.cast(dtypes.float32).numpy().astype(np.float64).reshape(-1)
  reference = theirs.detach().float().cpu().numpy().astype(np.float64).reshape(-1)
  return float(np.linalg.norm(mine - reference) / max(np.linalg.norm(reference), 1e-30))


# the float32 128x128 block tile's opts before SHARED: 16x16 threads, 2x2 float4 runs of outputs each
F32_TILE = "UPCAST 0 4;UPCAST 1 4;LOCAL 0 16;LOCAL 1 16;UPCAST 1 2;UPCAST 0 2"
# the same block tile with each warp's 32 threads 8 along M by 4 along N (a warp reads 8 float4s of the A tile and 4
# of the B tile per reduce element, 16 and 2 above), and 4 by 8
F32_WARP_8X4 = "UPCAST 0 4;UPCAST 1 4;LOCAL 0 8;LOCAL 1 4;LOCAL 0 2;LOCAL 1 4;UPCAST 1 2;UPCAST 0 2"
F32_WARP_4X8 = "UPCAST 0 4;UPCAST 1 4;LOCAL 0 4;LOCAL 1 8;LOCAL 0 4;LOCAL 1 2;UPCAST 1 2;UPCAST 0 2"
# the same block tile with a thread's 8 rows 16 apart (LOCAL before UPCAST along M: a warp's 16 threads along M take
# neighbouring rows) for SHARED_REDUCE_INNER's A tile
F32_ROWS = "LOCAL 0 16;UPCAST 0 8;UPCAST 1 4;LOCAL 1 16;UPCAST 1 2"
# 8x16 and 16x8 outputs per thread (4 float4 runs along N, or along M), 16x8 and 8x16 threads: the same 128x128 tile
F32_8X16 = "UPCAST 0 4;UPCAST 1 4;LOCAL 0 16;LOCAL 1 8;UPCAST 1 4;UPCAST 0 2"
F32_16X8 = "UPCAST 0 4;UPCAST 1 4;LOCAL 0 8;LOCAL 1 16;UPCAST 1 2;UPCAST 0 4"
# explicit opt lists for the 4096^3 and ragged matmuls, timed beside the heuristic's choice to pick tiles from one GPU
# run: (part of the row's name, label, opts); "TC" uses the row's dtype's tensor core
VARIANTS = [
  ("4096^3 f16", "staged 2x2 warps of 64x64, K step 32",
   "TC;UPCAST 1 8;UPCAST 0 4;LOCAL 1 2;LOCAL 0 2;UNROLL 0 2;SHARED"),
  ("4096^3 f16", "staged 2x2 warps of 64x64, K step 16",
   "TC;UPCAST 1 8;UPCAST 0 4;LOCAL 1 2;LOCAL 0 2;SHARED"),
  ("4096^3 f16", "staged 2x2 warps of 64x64, K step 16, 3 stages",
   "TC;UPCAST 1 8;UPCAST 0 4;LOCAL 1 2;LOCAL 0 2;SHARED 0 3"),
  ("4096^3 f16", "staged 2x2 warps of 64x64, K step 16, 4 stages",
   "TC;UPCAST 1 8;UPCAST 0 4;LOCAL 1 2;LOCAL 0 2;SHARED 0 4"),
  ("4096^3 f16", "staged 2x4 warps of 64x32, K step 16, 4 stages",
   "TC;UPCAST 1 4;UPCAST 0 4;LOCAL 1 4;LOCAL 0 2;SHARED 0 4"),
  ("4096^3 f16", "staged 2x4 warps of 64x32, K step 32",
   "TC;UPCAST 1 4;UPCAST 0 4;LOCAL 1 4;LOCAL 0 2;UNROLL 0 2;SHARED"),
  ("4096^3 f16", "staged 4x2 warps of 32x64, K step 32",
   "TC;UPCAST 1 8;UPCAST 0 2;LOCAL 1 2;LOCAL 0 4;UNROLL 0 2;SHARED"),
  ("4096^3 f16", "staged 2x2 warps of 32x32, K step 32",
   "TC;UPCAST 1 4;UPCAST 0 2;LOCAL 1 2;LOCAL 0 2;UNROLL 0 2;SHARED"),
  ("4096^3 f16", "unstaged (before): 2x2 warps of 32x32", "TC;UPCAST 1 4;UPCAST 0 2;LOCAL 1 2;LOCAL 0 2"),
  ("4097x4096", "staged, M and N padded to 128, K step 32",
   "PADTO 0 128;PADTO 1 128;TC;UPCAST 1 8;UPCAST 0 4;LOCAL 1 2;LOCAL 0 2;UNROLL 0 2;SHARED"),
  ("4097x4096", "staged, K step 16, 4 stages",
   "PADTO 0 128;PADTO 1 128;TC;UPCAST 1 8;UPCAST 0 4;LOCAL 1 2;LOCAL 0 2;SHARED 0 4"),
  ("4097x4096", "unstaged, 2x2 warps of 32x32",
   "PADTO 0 64;PADTO 1 64;TC;UPCAST 1 4;UPCAST 0 2;LOCAL 1 2;LOCAL 0 2"),
  ("4096^3 f32", "SHARED 8x8 per thread, 128x128, K step 8",
   "UPCAST 0 4;UPCAST 1 4;LOCAL 0 16;LOCAL 1 16;UPCAST 1 2;UPCAST 0 2;SHARED;UNROLL 0 8"),
  ("4096^3 f32", "SHARED 8x8 per thread, 128x128, K step 16, rows not padded",
   "UPCAST 0 4;UPCAST 1 4;LOCAL 0 16;LOCAL 1 16;UPCAST 1 2;UPCAST 0 2;SHARED;UNROLL 0 16"),
  ("4096^3 f32", "SHARED 8x4 per thread, 128x64",
   "UPCAST 0 4;UPCAST 1 4;LOCAL 0 16;LOCAL 1 16;UPCAST 0 2;SHARED;UNROLL 0 8"),
  ("4096^3 f32", "SHARED 4x4 per thread, 64x64 (before)",
   "UPCAST 0 4;UPCAST 1 4;LOCAL 0 16;LOCAL 1 16;UNROLL 0 8;SHARED"),
  # dynamic shared memory (over 48 KB of tiles): run after all others
  ("4096^3 f16", "staged 2x2 warps of 64x64, K step 32, 3 stages (dynamic smem)",
   "TC;UPCAST 1 8;UPCAST 0 4;LOCAL 1 2;LOCAL 0 2;UNROLL 0 2;SHARED 0 3"),
  ("4096^3 f16", "staged 2x2 warps of 64x64, K step 64 (dynamic smem, heuristic)",
   "TC;UPCAST 1 8;UPCAST 0 4;LOCAL 1 2;LOCAL 0 2;UNROLL 0 4;SHARED"),
  ("4096^3 f16", "staged 2x4 warps of 64x64 (128x256), K step 32 (dynamic smem)",
   "TC;UPCAST 1 8;UPCAST 0 4;LOCAL 1 4;LOCAL 0 2;UNROLL 0 2;SHARED"),
  ("4096^3 f16", "staged 2x4 warps of 64x32, K step 32, 3 stages (dynamic smem)",
   "TC;UPCAST 1 4;UPCAST 0 4;LOCAL 1 4;LOCAL 0 2;UNROLL 0 2;SHARED 0 3"),
  # Hopper warpgroup MMA (OptOps.WGMMA: sm_90 only; codegen/wgmma_tiles.py), block N tile and cp.async stages
  ("4096^3 f16", "wgmma 128x256, 4 stages (heuristic on sm_90)", "WGMMA 4 256"),
  ("4096^3 f16", "wgmma 128x256, 3 stages", "WGMMA 3 256"),
  ("4096^3 f16", "wgmma 128x128, 6 stages", "WGMMA 6 128"),
  ("4096^3 f16", "wgmma 128x128, 4 stages", "WGMMA 4 128"),
  ("4096^3 f16", "wgmma 128x256, 4 stages, copies 3 steps ahead (deep)", "WGMMA 36 256"),
  ("4096^3 f16", "wgmma 128x128, 6 stages, copies 5 steps ahead (deep)", "WGMMA 38 128"),
  ("4096^3 f16", "wgmma 128x256, 4 stages, producer warpgroup (specialized)", "WGMMA 20 256"),
  ("4096^3 f16", "wgmma 128x128, 6 stages, producer warpgroup (specialized)", "WGMMA 22 128"),
  ("4096^3 bf16", "wgmma 128x256, 4 stages, copies 3 steps ahead (deep)", "WGMMA 36 256"),
  ("4096^3 bf16", "wgmma 128x256, 4 stages, producer warpgroup (specialized)", "WGMMA 20 256"),
]




def shared_opts(threads_m: int, threads_n: int, step: int, runs: int = 1, pad: str = "", group: int = 1,
                row_padding: int = 4) -> str:
  """The float32 SHARED tile's opts (shared_tile_plans.py's _apply_shared_tile): 4x4 outputs per thread (`runs` x `runs`
  float4 runs), threads_m x threads_n threads, `group` GROUP threads splitting the reduce, tile rows padded by
  `row_padding` floats (SHARED's amount), reduce steps of `step`; `pad`: opts applied first."""
  runs_opts = f"UPCAST 1 {runs};UPCAST 0 {runs};" if runs > 1 else ""
  group_opts = f"GROUP 0 {group};" if group > 1 else ""
  return (f"{pad}UPCAST 0 4;UPCAST 1 4;LOCAL 0 {threads_m};LOCAL 1 {threads_n};{runs_opts}{group_opts}"
          f"SHARED 0 {row_padding};UNROLL 0 {step}")


# block tiles compared on the MLP step's 512-sized matmuls: (label, threads along M, along N, reduce step[, GROUP])
SMALL_MATMUL_TILES = [("32x32 (8x8 threads), GROUP 4, K step 16 (heuristic at K=512)", 8, 8, 16, 4),
                      ("32x32, GROUP 2, K step 16", 8, 8, 16, 2), ("32x32, GROUP 2, K step 8", 8, 8, 8, 2),
                      ("32x64 (8x16 threads), GROUP 2", 8, 16, 16, 2), ("32x64, GROUP 4", 8, 16, 16, 4),
                      ("64x64 (16x16 threads), GROUP 2, K step 8", 16, 16, 8, 2),
                      ("16x16 (4x4 threads), GROUP 4", 4, 4, 16, 4), ("16x32 (4x8 threads), GROUP 4", 4, 8, 16, 4),
                      ("32x32 (8x8 threads), no GROUP, K step 16", 8, 8, 16), ("32x32, K step 8", 8, 8, 8),
                      ("32x64 (8x16 threads)", 8, 16, 16), ("64x32 (16x8 threads)", 16, 8, 16),
                      ("64x64 (16x16 threads), K step 8", 16, 16, 8), ("64x64, K step 16", 16, 16, 16),
                      ("16x32 (4x8 threads)", 4, 8, 16), ("16x16 (4x4 threads)", 4, 4, 16)]
for part in ("mlp fwd 512x784", "mlp dx 512^3", "mlp dW 512^3"):
  VARIANTS += [(part, f"SHARED {label}", shared_opts(threads_m, threads_n, step, group=group[0] if group else 1))
               for label, threads_m, threads_n, step, *group in SMALL_MATMUL_TILES]
  VARIANTS.append((part, "SHARED 32x32, GROUP 7, K step 16", shared_opts(8, 8, 16, group=7)))
  VARIANTS.append((part, "SHARED 128x128, K step 16 (the 4096^3 tile)", shared_opts(16, 16, 16, runs=2,
                                                                                     row_padding=0)))
  VARIANTS.append((part, "SHARED 32x32, GROUP 4, rows not padded", shared_opts(8, 8, 16, group=4, row_padding=0)))
VARIANTS += [
  ("mlp fwd 512x512 @ W^T (10", "2 rows x 32 GROUP threads, 10 outputs each (heuristic)",
   "LOCAL 0 2;UPCAST 1 10;GROUP 0 32;UNROLL 0 4"),
  ("mlp fwd 512x512 @ W^T (10", "4 rows x 32 GROUP threads (128 blocks)",
   "LOCAL 0 4;UPCAST 1 10;GROUP 0 32;UNROLL 0 4"),
  ("mlp fwd 512x512 @ W^T (10", "1 row x 32 GROUP threads (512 blocks)", "UPCAST 1 10;GROUP 0 32;UNROLL 0 4"),
  ("mlp fwd 512x512 @ W^T (10", "2 rows x 64 GROUP threads", "LOCAL 0 2;UPCAST 1 10;GROUP 0 64;UNROLL 0 4"),
  ("mlp fwd 512x512 @ W^T (10", "before: register tiles, GROUP 8",
   "UPCAST 0 4;UNROLL 0 4;LOCAL 1 2;LOCAL 0 64;GROUP 0 8"),
  ("mlp dW 10x512", "32 outputs x 8 GROUPTOP threads (heuristic)", "LOCAL 1 32;GROUPTOP 0 8;UNROLL 0 4"),
  ("mlp dW 10x512", "32 outputs x 16 GROUPTOP threads", "LOCAL 1 32;GROUPTOP 0 16;UNROLL 0 4"),
  ("mlp dW 10x512", "16 outputs x 16 GROUPTOP threads (320 blocks)", "LOCAL 1 16;GROUPTOP 0 16;UNROLL 0 4"),
  ("mlp dW 10x512", "32 outputs x 8 GROUPTOP, 2 rows upcast (80 blocks)",
   "UPCAST 0 2;LOCAL 1 32;GROUPTOP 0 8;UNROLL 0 4"),
  ("mlp dW 10x512", "before: register tiles, 10 blocks", "UPCAST 1 4;UNROLL 0 4;LOCAL 1 128;GROUP 0 8"),
  ("4096^3 f32", "SHARED 8x8 per thread, 128x128, K step 16, tile rows padded by 4 (heuristic before)",
   "UPCAST 0 4;UPCAST 1 4;LOCAL 0 16;LOCAL 1 16;UPCAST 1 2;UPCAST 0 2;SHARED 0 4;UNROLL 0 16"),
  # the 128x128 tile's structure (SHARED's amount: padding 4 + flags, kernel.py SHARED_VECTOR_FILL 16, SHARED_TWO_BLOCKS
  # 32, SHARED_ASYNC 64 x (stages - 1))
  ("4096^3 f32", "128x128 K16, float4 tile stores (vector fill)", f"{F32_TILE};SHARED 0 20;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, 2 blocks/SM (launch bounds)", f"{F32_TILE};SHARED 0 36;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, vector fill + 2 blocks/SM", f"{F32_TILE};SHARED 0 52;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, cp.async 2 stages", f"{F32_TILE};SHARED 0 68;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, cp.async 2 stages, 2 blocks/SM", f"{F32_TILE};SHARED 0 100;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K8, cp.async 3 stages, 2 blocks/SM", f"{F32_TILE};SHARED 0 164;UNROLL 0 8"),
  ("4096^3 f32", "128x128 K8, cp.async 4 stages, 2 blocks/SM", f"{F32_TILE};SHARED 0 228;UNROLL 0 8"),
  ("4096^3 f32", "128x128 K8, vector fill + 2 blocks/SM", f"{F32_TILE};SHARED 0 52;UNROLL 0 8"),
  ("4096^3 f32", "128x128 K16, rows skewed by 8 every 8 (SHARED_ROW_SKEW 256)", f"{F32_TILE};SHARED 0 260;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, skew + vector fill + 2 blocks/SM (heuristic under 4 blocks/SM)",
   f"{F32_TILE};SHARED 0 308;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, skew + cp.async 2 stages + 2 blocks/SM", f"{F32_TILE};SHARED 0 356;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, warps of 8x4 threads (32x16 +runs), skew + vector fill",
   f"{F32_WARP_8X4};SHARED 0 276;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, warps of 8x4 threads, skew + vector fill + 2 blocks/SM",
   f"{F32_WARP_8X4};SHARED 0 308;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, warps of 8x4 threads, skew + cp.async 2 stages + 2 blocks/SM",
   f"{F32_WARP_8X4};SHARED 0 356;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, warps of 4x8 threads (16x32 +runs), skew + vector fill + 2 blocks/SM",
   f"{F32_WARP_4X8};SHARED 0 308;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, skew + 2 blocks/SM", f"{F32_TILE};SHARED 0 292;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K8, warps of 8x4, vector fill + 2 blocks/SM", f"{F32_WARP_8X4};SHARED 0 52;UNROLL 0 8"),
  ("4096^3 f32", "128x128 K8, warps of 8x4, cp.async 3 stages + 2 blocks/SM",
   f"{F32_WARP_8X4};SHARED 0 164;UNROLL 0 8"),
  ("4096^3 f32", "128x128 K16, warps of 4x8, skew + cp.async 2 stages + 2 blocks/SM",
   f"{F32_WARP_4X8};SHARED 0 356;UNROLL 0 16"),
  # SHARED_REDUCE_INNER (512): A's tile k-innermost (16-byte copies, float4 reads of 4 k), a thread's rows 16 apart
  ("4096^3 f32", "128x128 K16, A k-inner, rows strided, vector fill", f"{F32_ROWS};SHARED 0 532;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, A k-inner, rows strided, vector fill + 2 blocks/SM",
   f"{F32_ROWS};SHARED 0 564;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, A k-inner, rows strided, cp.async 2 stages", f"{F32_ROWS};SHARED 0 580;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, A k-inner, rows strided, cp.async 2 stages + 2 blocks/SM",
   f"{F32_ROWS};SHARED 0 612;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K8, A k-inner, rows strided, cp.async 3 stages + 2 blocks/SM",
   f"{F32_ROWS};SHARED 0 676;UNROLL 0 8"),
  # 16 outputs per thread along N (8x16: 4 float4 runs), 128 threads per block (4 warps): half the tile reads per FMA
  ("4096^3 f32", "128x128, 8x16 per thread (128 threads), K16, skew + vector fill + 2 blocks/SM (heuristic)",
   f"{F32_8X16};SHARED 0 308;UNROLL 0 16"),
  ("4096^3 f32", "128x128, 8x16 per thread (128 threads), K16, skew + vector fill",
   f"{F32_8X16};SHARED 0 276;UNROLL 0 16"),
  ("4096^3 f32", "128x128, 8x16 per thread (128 threads), K8, skew + vector fill + 2 blocks/SM",
   f"{F32_8X16};SHARED 0 308;UNROLL 0 8"),
  ("4096^3 f32", "128x128, 16x8 per thread (128 threads), K16, skew + vector fill + 2 blocks/SM",
   f"{F32_16X8};SHARED 0 308;UNROLL 0 16"),
  ("4096^3 f32", "128x256, 8x16 per thread (256 threads), K16, skew + vector fill",
   "UPCAST 0 4;UPCAST 1 4;LOCAL 0 16;LOCAL 1 16;UPCAST 1 4;UPCAST 0 2;SHARED 0 276;UNROLL 0 16"),
  ("4096^3 f32", "64x128, 8x8 per thread (128 threads), K16, skew + vector fill",
   "UPCAST 0 4;UPCAST 1 4;LOCAL 0 8;LOCAL 1 16;UPCAST 1 2;UPCAST 0 2;SHARED 0 276;UNROLL 0 16"),
  ("4096^3 f32", "128x64, 8x8 per thread (128 threads), K16, skew + vector fill",
   "UPCAST 0 4;UPCAST 1 4;LOCAL 0 16;LOCAL 1 8;UPCAST 1 2;UPCAST 0 2;SHARED 0 276;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, cp.async 3 stages (dynamic smem)", f"{F32_TILE};SHARED 0 132;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, A k-inner, rows strided, cp.async 3 stages + 2 blocks/SM (dynamic smem)",
   f"{F32_ROWS};SHARED 0 676;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, skew + cp.async 3 stages + 2 blocks/SM (dynamic smem)",
   f"{F32_TILE};SHARED 0 420;UNROLL 0 16"),
  ("4096^3 f32", "128x128 K16, warps of 8x4, skew + cp.async 4 stages + 2 blocks/SM (dynamic smem)",
   f"{F32_WARP_8X4};SHARED 0 484;UNROLL 0 16"),
  ("4096^3 f32", "SHARED 4x4 per thread, 64x64, K step 8, rows padded (heuristic's 64x64)",
   "UPCAST 0 4;UPCAST 1 4;LOCAL 0 16;LOCAL 1 16;SHARED 0 4;UNROLL 0 8"),
  ("mlp dW 512^3", "register tiles, 128 threads (before)", "UPCAST 1 4;UPCAST 0 4;UNROLL 0 4;LOCAL 1 128"),
  ("mlp dW 512x784", "SHARED 64x16 (16x4 threads), GROUP 4, K step 16 (heuristic)", shared_opts(16, 4, 16, group=4)),
  ("mlp dW 512x784", "SHARED 64x16, GROUP 2", shared_opts(16, 4, 16, group=2)),
  ("mlp dW 512x784", "SHARED 64x16, no GROUP", shared_opts(16, 4, 16)),
  ("mlp dW 512x784", "SHARED 32x16 (8x4 threads)", shared_opts(8, 4, 16)),
  ("mlp dW 512x784", "SHARED 16x16 (4x4 threads)", shared_opts(4, 4, 16)),
  ("mlp dW 512x784", "SHARED 32x64, N padded to 832", shared_opts(8, 16, 16, pad="PADTO 1 64;")),
  ("mlp dW 512x784", "register tiles (before)", "UPCAST 1 4;UPCAST 0 4;UNROLL 0 4;LOCAL 1 4;LOCAL 0 32"),
]


# block tiles compared on MiniLM's and SmolLM2's medium matmuls: (label, "TILE threads_m threads_n runs_m runs_n step
# group"); a tile's outputs per thread are 4 x 4 times its runs, its block threads_m x threads_n x group threads
MEDIUM_TILES = {
  "128x128 8x8/thread": "TILE 16 16 2 2 16 1", "128x64 8x4/thread": "TILE 16 16 2 1 16 1",
  "64x128 4x8/thread": "TILE 16 16 1 2 16 1", "128x64 8x8/thread (128 threads)": "TILE 16 8 2 2 16 1",
  "64x128 8x8/thread (128 threads)": "TILE 8 16 2 2 16 1", "64x64 4x4/thread, K step 8": "TILE 16 16 1 1 8 1",
  "64x64 4x4/thread, K step 16": "TILE 16 16 1 1 16 1", "64x64 8x8/thread (64 threads)": "TILE 8 8 2 2 16 1",
  "64x32 4x4/thread": "TILE 16 8 1 1 16 1", "32x64 4x4/thread": "TILE 8 16 1 1 16 1",
  "64x32 4x4/thread, GROUP 2": "TILE 16 8 1 1 16 2", "32x64 4x4/thread, GROUP 2": "TILE 8 16 1 1 16 2",
  "32x32 4x4/thread, GROUP 2": "TILE 8 8 1 1 16 2", "32x64 8x8/thread, GROUP 4, K step 8": "TILE 4 8 2 2 8 4",
  "32x32 8x8/thread, GROUP 4, K step 8": "TILE 4 4 2 2 8 4", "32x128 4x8/thread": "TILE 8 16 1 2 16 1",
  "32x32 4x4/thread, K step 8": "TILE 8 8 1 1 8 1", "32x32 4x4/thread, GROUP 2, K step 8": "TILE 8 8 1 1 8 2",
  "16x32 4x4/thread, GROUP 2, K step 8": "TILE 4 8 1 1 8 2", "32x16 4x4/thread, GROUP 2": "TILE 8 4 1 1 16 2",
}
WIDE = ["128x128 8x8/thread", "128x64 8x4/thread", "64x128 4x8/thread", "128x64 8x8/thread (128 threads)",
        "64x128 8x8/thread (128 threads)", "64x64 4x4/thread, K step 8", "64x64 4x4/thread, K step 16",
        "64x64 8x8/thread (64 threads)"]
NARROW = ["64x32 4x4/thread", "32x64 4x4/thread", "64x32 4x4/thread, GROUP 2", "32x64 4x4/thread, GROUP 2",
          "32x32 4x4/thread, GROUP 2", "32x64 8x8/thread, GROUP 4, K step 8", "32x32 8x8/thread, GROUP 4, K step 8"]
MEDIUM_ROWS = {
  "minilm 2048x1536 @": WIDE + NARROW, "minilm 2048x384 @ (1152": WIDE[:4] + WIDE[5:7],
  "minilm 2048x384 @ (1536": WIDE[:4] + WIDE[5:7], "smollm2 512x1536 @": WIDE[5:] + NARROW,
  "smollm2 512x576 @ (1536": WIDE[3:] + NARROW[:3],
  "smollm2 512x576 @ (3072": WIDE[:4] + WIDE[5:7], "smollm2 512x576 @ (960": WIDE[5:] + NARROW[:3],
  "smollm2 512x576 @ (576": WIDE[5:] + NARROW[:3],
  "smollm2 512x576 @ (192": ["64x64 4x4/thread, K step 16", "64x32 4x4/thread, GROUP 2", "32x32 4x4/thread, GROUP 2",
                             "32x32 8x8/thread, GROUP 4, K step 8", "32x16 4x4/thread, GROUP 2",
                             "16x32 4x4/thread, GROUP 2, K step 8"],
  "minilm attn out": ["32x64 4x4/thread", "32x64 4x4/thread, GROUP 2", "32x128 4x8/thread", "32x32 4x4/thread, GROUP 2",
                      "32x64 8x8/thread, GROUP 4, K step 8", "32x32 8x8/thread, GROUP 4, K step 8"],
  "minilm attn q@k^T": ["32x32 4x4/thread, K step 8", "32x32 4x4/thread, GROUP 2, K step 8",
                        "16x32 4x4/thread, GROUP 2, K step 8"],
  "minilm attn p@v": ["32x32 4x4/thread, K step 8", "32x32 4x4/thread, GROUP 2, K step 8",
                      "16x32 4x4/thread, GROUP 2, K step 8"],
}
VARIANTS += [(part, f"SHARED {label}", MEDIUM_TILES[label]) for part, labels in MEDIUM_ROWS.items() for label in labels]
# split-K across blocks: the partial products of K slices as a batched matmul (the heuristic's tile), then their sum
VARIANTS += [("minilm 2048x1536 @", f"split-K {parts} (2 kernels)", f"SPLITK {parts}") for parts in (2, 3, 4, 6)]
VARIANTS += [("minilm 2048x1536 @", f"split-K {parts}, 128x128 tiles", f"SPLITK {parts};TILE 16 16 2 2 16 1")
             for parts in (2, 4, 8)]
VARIANTS += [("minilm 2048x1536 @", "split-K 2, 128x64 8x8/thread", "SPLITK 2;TILE 16 8 2 2 16 1")]
VARIANTS += [(part, f"split-K {parts}, 128x128 tiles", f"SPLITK {parts};TILE 16 16 2 2 16 1")
             for part in ("minilm 2048x384 @ (1152", "minilm 2048x384 @ (1536") for parts in (2, 3)]
# tiles of 3 float4 runs along N (8x12 or 4x12 outputs a thread) whose grids fill the 132 multiprocessors in one round
# of about 128 blocks (144 of 128x128 tiles take two rounds)
VARIANTS += [
  ("minilm 2048x384 @ (1152", "SHARED 128x144 8x12/thread (192 threads, 128 blocks)", "TILE 16 12 2 3 16 1"),
  ("minilm 2048x384 @ (1152", "SHARED 128x96 8x12/thread (128 threads, 192 blocks)", "TILE 16 8 2 3 16 1"),
  ("minilm 2048x384 @ (1152", "SHARED 64x144 8x12/thread (96 threads, 256 blocks)", "TILE 8 12 2 3 16 1"),
  ("minilm 2048x384 @ (1536", "SHARED 128x192 8x12/thread (256 threads, 128 blocks)", "TILE 16 16 2 3 16 1"),
  ("minilm 2048x384 @ (1536", "SHARED 128x96 8x12/thread (128 threads, 256 blocks)", "TILE 16 8 2 3 16 1"),
  ("minilm 2048x1536 @", "split-K 2, 128x96 8x12/thread (128 blocks)", "SPLITK 2;TILE 16 8 2 3 16 1"),
  ("minilm 2048x1536 @", "split-K 4, 128x192 8x12/thread (128 blocks)", "SPLITK 4;TILE 16 16 2 3 16 1"),
  ("minilm attn out", "SHARED 32x192 4x12/thread (128 threads, 128 blocks)", "TILE 8 16 1 3 16 1"),
  ("minilm attn out", "SHARED 32x96 4x12/thread (64 threads, 256 blocks)", "TILE 8 8 1 3 16 1"),
  ("smollm2 512x1536 @", "split-K 4, 64x144 8x12/thread (128 blocks)", "SPLITK 4;TILE 8 12 2 3 16 1"),
  ("smollm2 512x1536 @", "split-K 8, 128x144 8x12/thread (128 blocks)", "SPLITK 8;TILE 16 12 2 3 16 1"),
  ("smollm2 512x576 @ (3072", "SHARED 128x96 8x12/thread (128 blocks)", "TILE 16 8 2 3 16 1"),
  ("smollm2 512x576 @ (960", "SHARED 64x60 4x12/thread (80 threads, 128 blocks)", "TILE 16 5 1 3 16 1"),
  ("smollm2 512x576 @ (1536", "SHARED 64x96 4x12/thread (128 threads, 128 blocks)", "TILE 16 8 1 3 16 1"),
]
VARIANTS += [("smollm2 512x1536 @", f"split-K {parts} (2 kernels)", f"SPLITK {parts}") for parts in (2, 3, 4)]
VARIANTS += [("smollm2 512x1536 @", f"split-K {parts}, 64x64 8x8/thread", f"SPLITK {parts};TILE 8 8 2 2 16 1")
             for parts in (2, 4)]
VARIANTS.append(("minilm attn q@k^T", "register tiles (main before: the fused bias kept it from SHARED)",
                 "UPCAST 3 4;UPCAST 2 4;UNROLL 0 4;LOCAL 3 8;LOCAL 2 8;LOCAL 1 2"))

# TF32 tensor cores (TC 2 on CUDA) on the 4096^3 float32 matmul: the staged kernel's warp tile (64x64: 4x8 m16n8k8
# tiles), K step and stages, and the unstaged one; with B K-major (x @ W^T) the TF32 wgmma kernel's tiles (sm_90)
TF32_WARPS = "TC;UPCAST 1 8;UPCAST 0 4;LOCAL 1 2;LOCAL 0 2"
VARIANTS += [
  ("4096^3 f32 tf32", "TC staged 128x128, K step 32, 2 stages (heuristic)", f"{TF32_WARPS};UNROLL 0 4;SHARED 0 0"),
  ("4096^3 f32 tf32", "TC staged 128x128, K step 32, 3 stages", f"{TF32_WARPS};UNROLL 0 4;SHARED 0 3"),
  ("4096^3 f32 tf32", "TC staged 128x128, K step 16, 3 stages", f"{TF32_WARPS};UNROLL 0 2;SHARED 0 3"),
  ("4096^3 f32 tf32", "TC staged 128x128, K step 16, 4 stages", f"{TF32_WARPS};UNROLL 0 2;SHARED 0 4"),
  ("4096^3 f32 tf32", "TC staged 128x64 (warps 64x32), K step 32, 3 stages",
   "TC;UPCAST 1 4;UPCAST 0 4;LOCAL 1 2;LOCAL 0 2;UNROLL 0 4;SHARED 0 3"),
  ("4096^3 f32 tf32", "TC not staged, 2x4 tiles per warp, 2x2 warps", "TC;UPCAST 1 4;UPCAST 0 2;LOCAL 1 2;LOCAL 0 2"),
  ("x @ W^T f32 tf32", "wgmma 128x256, 4 stages, producer warpgroup (heuristic on sm_90)", "WGMMA 20 256"),
  ("x @ W^T f32 tf32", "wgmma 128x128, 6 stages, producer warpgroup", "WGMMA 22 128"),
  ("x @ W^T f32 tf32", "wgmma 128x256, 4 stages", "WGMMA 4 256"),
  ("x @ W^T f32 tf32", "wgmma 128x256, 4 stages, copies 3 steps ahead (deep)", "WGMMA 36 256"),
]


def parse_opts(text: str, tc_choice: int) -> list:
  from ourgrad.codegen.kernel import Opt, OptOps
  opts = []
  for item in text.split(";"):
    op, *numbers = item.split()
    if op == "TC": opts.append(Opt(OptOps.TC, 0, tc_choice))
    elif op == "PADTO": opts.append(Opt(OptOps.PADTO, int(numbers[0]), int(numbers[1])))
    elif op == "SHARED": opts.append(Opt(OptOps.SHARED, 0, int(numbers[1]) if numbers else 0))
    else: opts.append(Opt(OptOps[op], int(numbers[0]), int(numbers[1])))
  return opts


def variant_kernel(device: str, ast: Any, opts_text: str, dtype: Any) -> Any:
  """The kernel of `ast` with the variant's opts: an opt list, or "TILE tm tn rm rn step group", a float32 SHARED
  block tile applied as the heuristic applies its tiles (shared_tile_plans.apply_shared_tile)."""
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.codegen.opt.shared_tile_plans import SharedTile, apply_shared_tile
  from ourgrad.device import Device
  kernel = Kernel(ast, Device[device].renderer)
  if opts_text.startswith("TILE"):
    threads_m, threads_n, runs_m, runs_n, step, group = (int(number) for number in opts_text.split()[1:])
    tile = SharedTile(threads_m, threads_n, runs_m, runs_n, (step,))
    if not apply_shared_tile(kernel, tile, step, group): raise RuntimeError("the tile does not fit this matmul")
    return kernel
  tc_choice = {dtypes.float16: 0, dtypes.bfloat16: 1, dtypes.float32: 2}[dtype]   # CUDA_TENSOR_CORES' order
  for opt in parse_opts(opts_text, tc_choice): kernel.apply_opt(opt)
  return kernel


def variant_row(device: str, inputs: list[Tensor], opts_text: str, dtype: Any, iters: int, kind: str = "mm",
                sizes: tuple[int, ...] = ()) -> str:
  """One matmul kernel with explicit opts: its time, rate and relative error against float64 (the first 64 rows of
  a plain matmul; the whole output of the others)."""
  from ourgrad.device import Buffer
  from ourgrad.engine.realize import compile_kernel, run_schedule
  if opts_text.startswith("SPLITK"):   # "SPLITK parts[;TILE ...]"
    split, _, tile_text = opts_text.partition(";")
    return split_k_row(device, inputs, int(split.split()[1]), iters, sizes, tile_text)
  schedule = create_schedule([one_matmul_kernel(lambda: ourgrad_function(kind, sizes)(*inputs)[0])])
  run_schedule(schedule[:-1])   # a copy before the matmul, if the row has one
  item = schedule[-1]
  kernel = variant_kernel(device, item.ast, opts_text, dtype)
  runner = compile_kernel(kernel, device)
  needed = kernel.local_memory_bytes()
  if needed > 48 * 1024 and getattr(runner.program, "shared_bytes", 0) < needed:
    raise RuntimeError("the dynamic shared memory size was not found in the module (not launched)")
  output = Buffer(device, item.outputs[0].size, item.outputs[0].dtype).allocate()
  seconds = statistics.median([runner([output, *item.inputs], wait=True) for _ in range(iters + 2)][2:])
  rate = flops(kind, sizes) / seconds / 1e12
  operands = [tensor.cast(dtypes.float32).numpy().astype(np.float64) for tensor in inputs]
  values = output.numpy()
  if output.dtype == dtypes.bfloat16: values = (values.astype(np.uint32) << 16).view(np.float32)   # raw bits
  if kind in ATTENTION_LAYOUTS:
    import torch
    reference = ATTENTION_LAYOUTS[kind][1](*(torch.from_numpy(operand) for operand in operands)).numpy()
  else:
    m, k, n = sizes
    rows = min(m, 64) if kind == "mm" else m   # a plain matmul: the first 64 rows against float64 (cheap on the host)
    values = values[:rows * n]
    if kind == "mm": reference = operands[0][:rows] @ operands[1]
    else: reference = MATMUL_LAYOUTS[kind][1](lambda x: np.maximum(x, 0))(*operands)
  got = values.astype(np.float64).reshape(reference.shape)
  error = np.linalg.norm(got - reference) / np.linalg.norm(reference)
  return f"{seconds * 1e3:8.3f} ms {rate:7.1f} TFLOP/s  err {error:.1e}  {runner.name}"


def one_matmul_kernel(build: Callable[[], Tensor]) -> Any:
  """The lazy graph of `build()` with the lazy layer's own split-K off (MATMUL_GRID=0 while it is built): a variant
  times the one matmul kernel its opts are for."""
  saved = os.environ.get("MATMUL_GRID")
  os.environ["MATMUL_GRID"] = "0"
  try:
    return build().lazydata
  finally:
    if saved is None: del os.environ["MATMUL_GRID"]
    else: os.environ["MATMUL_GRID"] = saved


def split_k_product(a: Any, b: Any, parts: int) -> Any:
  """a @ b.T (a Linear's forward) as `parts` partial products over slices of K, summed: a batched matmul whose grid
  has `parts` times the blocks, then a reduce over the parts (split-K across blocks)."""
  (m, k), n = a.shape, b.shape[0]
  return (a.reshape(m, parts, k // parts).permute(1, 0, 2) @ b.reshape(n, parts, k // parts).permute(1, 2, 0)).sum(0)


def split_k_row(device: str, inputs: list[Tensor], parts: int, iters: int, sizes: tuple[int, ...],
                tile_text: str = "") -> str:
  """A Linear-shaped row (mm_bT) as split_k_product: summed kernel times, the partial products' kernel with the
  heuristic's opts or `tile_text` ("TILE ..."), the sum over the parts with the heuristic's."""
  from ourgrad.engine.realize import compile_kernel
  schedule = create_schedule([one_matmul_kernel(lambda: split_k_product(*inputs, parts))])
  runners = []
  for number, item in enumerate(schedule):
    for buffer in item.outputs: buffer.allocate()
    if number == 0 and tile_text: runner = compile_kernel(variant_kernel(device, item.ast, tile_text, dtypes.float32),
                                                          device)
    else: runner = get_runner(device, item.ast)
    runners.append((runner, item))
  times = [sum(runner(item.bufs, wait=True) or 0.0 for runner, item in runners) for _ in range(iters + 2)]
  seconds = statistics.median(times[2:])
  m, k, n = sizes
  got = schedule[-1].outputs[0].numpy().astype(np.float64).reshape(m, n)
  operands = [tensor.numpy().astype(np.float64) for tensor in inputs]
  reference = operands[0] @ operands[1].T
  error = np.linalg.norm(got - reference) / np.linalg.norm(reference)
  rate = 2.0 * m * k * n / seconds / 1e12
  return f"{seconds * 1e3:8.3f} ms {rate:7.1f} TFLOP/s  err {error:.1e}  {' + '.join(r.name for r, _ in runners)}"


def kernel_opts(device: str, ast: Any) -> str:
  """The hand-coded opts of a reduce kernel (what the heuristic chose: tiles, TC, SHARED with its flags by name), as
  " opts=[...]"."""
  if os.environ.get("BEAM") or not any(node.op.name == "SUM" for node in ast.walk()): return ""
  return f" opts=[{describe_opts(get_kernel(ast, device).applied_opts)}]"


def beam_seconds(device: str, build: Callable[[], list[Tensor]], iters: int, cuda: bool) -> float | None:
  """Kernel time with BEAM=2 (the search runs on the first call and is cached on disk)."""
  os.environ["BEAM"] = "2"
  realize._runner_cache.clear()
  try:
    return ourgrad_seconds(device, build, iters, cuda)[0]
  except Exception as error:  # a search that fails is a row with a dash, not a failed benchmark
    print(f"  BEAM=2 failed: {type(error).__name__}: {error}")
    return None
  finally:
    del os.environ["BEAM"]
    realize._runner_cache.clear()


def allow_tf32(torch: Any, allowed: bool) -> None:
  """TensorFloat-32 for float32 matmuls and convolutions on both sides, or on neither."""
  ourgrad.set_float32_matmul_precision("high" if allowed else "highest")
  torch.backends.cuda.matmul.allow_tf32 = allowed
  torch.backends.cudnn.allow_tf32 = allowed


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--scale", type=int, default=0, help="divide every side by 2**scale (a quick check)")
  parser.add_argument("--beam", type=int, default=None, help="1: also BEAM=2 (default: on CUDA only)")
  parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
  parser.add_argument("--only", default="", help="run only the rows whose name contains this (or one of these, "
                      "comma-separated)")
  parser.add_argument("--no-variants", dest="variants", action="store_false",
                      help="skip the explicit-opts variants of the 4096^3 rows (CUDA)")
  parser.add_argument("--variants-matching", default="", help="only the variants whose label matches this regex")
  parser.add_argument("--tf32", action="store_true", help="TF32 allowed in every row (both sides), not only in the "
                      "rows named tf32")
  args = parser.parse_args()
  import torch
  cuda = args.device.upper().startswith("CUDA")
  torch_device = "cuda" if cuda else "cpu"
  # TF32 off: float32 rows compare full-precision matmuls (the rows named tf32 turn it on, both sides)
  allow_tf32(torch, False)
  with_beam = args.beam if args.beam is not None else cuda
  print(f"device: {torch.cuda.get_device_name() if cuda else args.device} "
        f"({'TF32 on in every row' if args.tf32 else 'TF32 off but in the rows named tf32'})")
  rate_title = "TFLOP/s" if cuda else "GFLOP/s"
  print(f"{'workload':<34} {'GFLOP':>8} {'ourgrad':>9} {rate_title:>8} {'BEAM=2':>9} {'torch':>9} {'compile':>9} "
        f"{'numpy':>9} {'% torch':>8}   (times in ms)")
  variant_jobs: list[tuple] = []
  for name, kind, sizes, dtype_name in CUDA_ROWS if cuda else CPU_ROWS:
    if not any(part in name for part in args.only.split(",")): continue
    sizes = scaled(kind, sizes, args.scale)
    allow_tf32(torch, args.tf32 or "tf32" in name)
    host = host_inputs(kind, sizes)
    dtype = getattr(dtypes, dtype_name)
    inputs = [Tensor(array, device=args.device).cast(dtype).realize() for array in host]
    function = ourgrad_function(kind, sizes)
    ours, kernels = ourgrad_seconds(args.device, lambda: function(*inputs), args.iters, cuda)
    ours_output = function(*inputs)[0].realize()
    beam = beam_seconds(args.device, lambda: function(*inputs), args.iters, cuda) if with_beam else None
    torch_inputs = [torch.tensor(array, device=torch_device).to(getattr(torch, dtype_name)) for array in host]
    reference = torch_function(kind, sizes)
    if cuda: eager = back_to_back_seconds(lambda: reference(*torch_inputs), torch.cuda.synchronize,
                                          launches=max(args.iters, 2))
    else: eager = torch_seconds(lambda: reference(*torch_inputs), args.iters, cuda, warmup=2)
    compiled = None
    if not args.no_compile:
      try:
        compiled_function = torch.compile(reference, mode="max-autotune")
        compiled_call = lambda: compiled_function(*torch_inputs)  # noqa: E731
        compiled_call()   # compiles (max-autotune searches here)
        compiled = (back_to_back_seconds(compiled_call, torch.cuda.synchronize, launches=max(args.iters, 2)) if cuda
                    else torch_seconds(compiled_call, args.iters, cuda, warmup=2))
      except Exception as error:  # no toolchain for inductor here
        print(f"  torch.compile failed: {type(error).__name__}")
    blas = None
    if kind.startswith("mm") and not cuda:
      numpy_product = MATMUL_LAYOUTS[kind][1](lambda x: np.maximum(x, 0))
      blas = torch_seconds(lambda: numpy_product(*host), args.iters, False, warmup=2)

    def ms(value: float | None) -> str: return f"{value * 1e3:9.3f}" if value is not None else f"{'-':>9}"
    work = flops(kind, sizes)
    rate = f"{work / ours / 1e12:8.1f}" if cuda else f"{work / ours / 1e9:8.1f}"
    error = relative_error(ours_output, reference(*torch_inputs)[0] if kind == "conv_step" else
                           reference(*torch_inputs))
    print(f"{name:<34} {work / 1e9:8.1f} {ms(ours)} {rate} {ms(beam)} {ms(eager)} {ms(compiled)} "
          f"{ms(blas)} {eager / ours * 100:7.0f}%" + (f" ({blas / ours * 100:.0f}% of numpy)" if blas else "")
          + f"  err {error:.1e} vs torch   [{', '.join(kernels)}]")
    if cuda and args.variants and (kind.startswith("mm") or kind in ATTENTION_LAYOUTS):
      variant_jobs += [(name, label, opts_text, inputs, dtype, kind, sizes) for part, label, opts_text in VARIANTS
                       if part in name and ("tf32" in part) == ("tf32" in name)
                       and re.search(args.variants_matching, label)]
  # after every row: a variant launch that went wrong would leave the CUDA context unusable; dynamic shared memory
  # and wgmma (the newest code) last
  if variant_jobs: print("variants (explicit opts):")
  def launch_order(job: tuple) -> tuple[bool, bool]: return "wgmma" in job[1], "dynamic" in job[1]
  for name, label, opts_text, inputs, dtype, kind, sizes in sorted(variant_jobs, key=launch_order):
    allow_tf32(torch, args.tf32 or "tf32" in name)
    try: row = variant_row(args.device, inputs, opts_text, dtype, args.iters, kind, sizes)
    except Exception as variant_error:  # an opt list that does not fit (or compile): say so, go on
      row = f"failed: {type(variant_error).__name__}: {str(variant_error)[:120]}"
    print(f"  {name:<34} {label:<62} {row}")


if __name__ == "__main__":
  main()
