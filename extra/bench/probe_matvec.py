"""Matrix-vector products (a decode step's GEMVs) alone, each kernel timed in a CUDA graph of that one launch repeated
in a chain (as probe_decode_kernels.py times a step's kernels): microseconds a launch and the weight bytes it reads
per second. The products are built as extra/models/llama.py builds a decode step's (`LlamaBlock._linear`, blocked;
`norm`: the RMSNorm's scale recomputed in the product's kernel, `inverse_rms_per_output`, the norm weight folded into
the columns), for SmolLM2's shapes and larger ones (a 7B model's 4096 x 4096 and 4096 <-> 11008), in float32,
bfloat16 and Q8_0 (kept packed). A chain re-reads one matrix, which stays in L2 where it fits (H200: 50 MB).

    python extra/bench/probe_matvec.py [--formats q8_0 bfloat16] [--shapes 576x960n 1536x576] [--settings "" X=1]

A shape is KxN (k inputs, n outputs); `n` after it: the norm fused; `s`: the input is SwiGLU's silu(gate) * up of
a (1, 2k) row, computed in the product's kernel (a decode step's down projection); `r`: a residual row added to the
product (the output and down projections' epilogue). `--rows R`: R input rows (a batched decode step's R sequences,
each weight read once for all of them where the kernel manages it). Settings as
probe_decode_kernels.py's. `--ncu`: each product's kernels once between cuProfilerStart and cuProfilerStop (for
`ncu --profile-from-start off`), no timing.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import numpy as np

# OURGRAD_ROOT: the tree to measure (another checkout's ourgrad and llama.py, this script run against it for an A/B)
sys.path.insert(0, os.environ.get("OURGRAD_ROOT", str(Path(__file__).resolve().parents[2])))
sys.path.insert(1, str(Path(__file__).resolve().parent))
os.environ.setdefault("DEVICE", "CUDA")
from ourgrad import Tensor  # noqa: E402
from ourgrad.device import Device  # noqa: E402
from ourgrad.dtype import dtypes  # noqa: E402
from ourgrad.engine.exec_item import CompiledRunner  # noqa: E402
from ourgrad.engine.jit import TinyJit, _graph_launch  # noqa: E402
from ourgrad.helpers import clear_caches  # noqa: E402
from ourgrad.nn.gguf import GGML_Q8_0, PackedTensor, quantize_q8_0  # noqa: E402
from extra.models.llama import LlamaBlock, inverse_rms_per_output, row_layout  # noqa: E402

SHAPES = ("576x960n", "576x576", "576x3072n", "1536x576s", "576x49152n", "4096x4096", "4096x11008n", "11008x4096s")


def weight_of(values: np.ndarray, weights: str, device: str) -> Tensor | PackedTensor:
  if weights == "q8_0": return PackedTensor.from_blocks(GGML_Q8_0, Tensor(quantize_q8_0(values), device=device),
                                                        values.shape)
  return Tensor(values, device=device).cast(getattr(dtypes, weights)).contiguous().realize()


def reference_values(values: np.ndarray, weights: str) -> np.ndarray:
  """The float32 values a product in `weights` computes with (numpy's dequantization or rounding)."""
  if weights == "q8_0":
    blocks = quantize_q8_0(values)
    scales = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    return (blocks[:, 2:].view(np.int8).astype(np.float32) * scales).reshape(values.shape)
  if weights == "bfloat16": return (values.view(np.uint32) + 0x7FFF + ((values.view(np.uint32) >> 16) & 1) &
                                    np.uint32(0xFFFF0000)).view(np.float32)
  return values


def product(k: int, n: int, kind: str, weights: str, device: str, batch: int = 1) -> tuple[TinyJit, Tensor, int,
                                                                                            np.ndarray]:
  """A jitted decode-step product of x (batch, k) with an (n, k) matrix in `weights` (`kind`: "n" the norm fused, "s"
  SwiGLU's input, "r" a residual added), its input, the bytes of the weight it reads and numpy's result."""
  norm = kind == "n"
  rng = np.random.default_rng(0)
  values = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
  gain = Tensor((1 + 0.1 * rng.standard_normal(k)).astype(np.float32), device=device).realize()
  packed = weights == "q8_0"
  weight = weight_of(values, weights, device)
  if norm and not packed: weight = (Tensor(values, device=device) * gain).cast(weight.dtype).contiguous().realize()
  parts = (weight.blocks, weight.scales) if isinstance(weight, PackedTensor) else (weight,)
  nbytes = sum(part.numel() * part.dtype.itemsize for part in parts)

  residual_host = rng.standard_normal((batch, n)).astype(np.float32)
  residual = Tensor(residual_host, device=device).realize()

  def step(x: Tensor) -> Tensor:
    if kind == "s": x = x[:, :k].silu() * x[:, k:]
    if kind == "r": return (residual + LlamaBlock._linear(x, weight, blocked=True)).contiguous()
    if not norm: return LlamaBlock._linear(x, weight, blocked=True).cast(dtypes.float32).contiguous()
    out = LlamaBlock._linear(x, weight, gain if packed else None, blocked=True)
    return (out * inverse_rms_per_output(x, n, 1e-5, row_layout(weight))).cast(dtypes.float32).contiguous()
  host = rng.standard_normal((batch, 2 * k if kind == "s" else k)).astype(np.float32)
  x = Tensor(host, device=device).realize()
  rows = host[:, :k] / (1 + np.exp(-host[:, :k])) * host[:, k:] if kind == "s" else host
  matrix = reference_values(values, weights)
  if norm:
    rows = rows * gain.numpy() if packed else rows
    matrix = matrix if packed else reference_values(values * gain.numpy(), weights)
    expected = rows @ matrix.T / np.sqrt(np.mean(host ** 2, axis=-1, keepdims=True) + 1e-5)
  else: expected = rows @ matrix.T + (residual_host if kind == "r" else 0)
  return TinyJit(step), x, nbytes, expected


def probe(args: argparse.Namespace, setting: str) -> None:
  for assignment in filter(None, setting.split(",")):
    name, value = assignment.split("=", 1)
    if ":" in name:
      module, constant = name.split(":")
      setattr(importlib.import_module(f"ourgrad.{module}"), constant, int(value))
    else: os.environ[name] = value
  clear_caches()
  device = Device[Device.DEFAULT]
  for weights in args.formats:
    for shape in args.shapes:
      kind = shape[-1] if shape[-1] in "nsr" else ""
      k, n = (int(part) for part in shape.rstrip("nsr").split("x"))
      jit, x, nbytes, expected = product(k, n, kind, weights, device.name, args.rows)
      for _ in range(2): jit(x)
      error = float(np.abs(jit(x).numpy() - expected).max() / np.abs(expected).max())
      if args.ncu:
        from cuda.bindings import driver
        device.synchronize()
        driver.cuProfilerStart()
        jit(x)
        device.synchronize()
        driver.cuProfilerStop()
        continue
      assert jit.captured is not None
      items = [item for item in jit.captured.items if isinstance(item.runner, CompiledRunner)]
      for item in items:
        launch = _graph_launch(item)
        if device.name != "CUDA":   # a dry run (DEVICE=PYTHON EMULATE=CUDA): the kernels and their launches
          print(f"{weights:<8} {shape:<11} {item.runner.name:<24} grid {launch[1]} block {launch[2]} error {error:.1e}")
          continue
        from bench_pdl import time_graph
        from ourgrad.runtime.ops_cuda import CUDAGraph
        seconds = time_graph(CUDAGraph(device, [launch] * args.repeats), 10) / args.repeats
        print(f"[{setting or 'default'}] {weights:<8} {shape:<11} {item.runner.name:<24} {seconds * 1e6:7.2f} us "
              f"{nbytes / seconds / 1e12:5.2f} TB/s of weights  grid {launch[1]} block {launch[2]} error {error:.1e}",
              flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--formats", nargs="*", default=["q8_0", "bfloat16", "float32"])
  parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
  parser.add_argument("--repeats", type=int, default=32)
  parser.add_argument("--settings", nargs="*", default=[""])
  parser.add_argument("--ncu", action="store_true")
  parser.add_argument("--rows", type=int, default=1, help="input rows (a batched decode step's sequences)")
  args = parser.parse_args()
  for setting in args.settings: probe(args, setting)


if __name__ == "__main__":
  main()
