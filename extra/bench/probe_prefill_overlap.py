"""Where the eager SmolLM2 prefill's host-to-host time goes, and whether realizing the residual stream every K layers
(so the GPU runs the first layers while Python builds the next ones) shortens it (issue 26).

Each prefill is timed as bench_models.py times it: from the call to the logits on the host (`.numpy()`), beside
PyTorch eager's (bench_models.TorchLlama). The split of one eager call: graph building (Tensor ops, to the
realize), the realize (schedule, lower, launch) and the wait for the GPU's remaining work and the read-back.

Run: `python extra/bench/probe_prefill_overlap.py [--length 512] [--iters 5] [--every 1,5] [--sections loop,split]`
(CUDA); a CPU check: `--device CLANG --layers 2 --length 32`.
"""
from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time
from typing import Callable

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_models import SMOLLM2_135M, TorchLlama, random_llama_weights  # noqa: E402

from extra.models.llama import Llama, as_tensor, rms_norm  # noqa: E402
from ourgrad import Device, Tensor, set_float32_matmul_precision  # noqa: E402


def median_ms(function: Callable[[], object], iters: int) -> float:
  function()
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    function()
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def upload_probe(device: str, size: int = 4096) -> None:
  """The host time of Tensor(small array) on an idle device, and right after a ~10 ms product was queued: a copy-in
  that synchronizes the device waits for the product there."""
  sync = Device[device].synchronize
  host = np.arange(256, dtype=np.float32)
  a = Tensor.rand(size, size, device=device).realize()
  (a @ a).realize()   # compiled
  sync()
  start = time.perf_counter()
  for _ in range(200): Tensor(host, device=device)
  idle = (time.perf_counter() - start) / 200
  busy = []
  for _ in range(5):
    sync()
    products = [(a @ a).realize() for _ in range(5)]   # several ms of queued work
    start = time.perf_counter()
    Tensor(host, device=device)
    busy.append(time.perf_counter() - start)
    queued = time.perf_counter()
    sync()
    left = time.perf_counter() - queued
    del products
  print(f"Tensor(256 floats) on {device}: {idle * 1e6:.1f} us on an idle device, "
        f"{statistics.median(busy) * 1e6:.1f} us right after queueing products that then still ran {left * 1e3:.2f} ms")


def prefill_graph_every(model: Llama, every: int) -> Callable:
  """Llama._prefill_graph with the residual stream (and the caches written so far) realized after every `every`
  blocks."""
  def build(tokens, cos, sin, write, placement, positions, last, sequence, attended, realize_every=0):
    cos, sin, write, visible = model._block_inputs(cos, sin, write, positions, attended)   # (the blocks' shapes)
    x = model.embed(tokens)
    for index, block in enumerate(model.blocks):
      x = block(x, cos, sin, write, placement, visible, sequence)
      if (index + 1) % every == 0: Tensor.realize_all(x, *(done.cache for done in model.blocks[:index + 1]))
    return rms_norm(x[0][last], model.norm, model.config.norm_eps).linear(as_tensor(model.output))
  return build


def loop_ms(model: Llama, prompt: np.ndarray, sync: Callable[[], None], calls: int) -> tuple[float, float]:
  """(wall ms a call of `calls` eager prefills in a row, synchronized at the end only; host ms a call, never
  synchronized): bench_eager.py's prefill figures, where a call's copies-in may wait for the call before."""
  sync()
  start = time.perf_counter()
  for _ in range(calls): model(prompt, 0)
  sync()
  wall = (time.perf_counter() - start) / calls
  start = time.perf_counter()
  for _ in range(calls): model(prompt, 0)
  host = (time.perf_counter() - start) / calls
  sync()
  return wall * 1e3, host * 1e3


def split_ms(model: Llama, prompt: np.ndarray, sync: Callable[[], None], iters: int) -> tuple[float, float, float]:
  """One eager call from an idle device, split: (graph building, the rest of the call: inputs and the realize's
  schedule, lower and launch, then the GPU's remaining work and the logits' read-back), medians in ms."""
  original = model._prefill_graph
  split: list[list[float]] = [[], [], []]

  def timed_graph(*positional, **named):
    start = time.perf_counter()
    logits = original(*positional, **named)
    split[0].append(time.perf_counter() - start)
    return logits
  model._prefill_graph = timed_graph
  try:
    for _ in range(iters + 1):
      sync()
      start = time.perf_counter()
      logits = model(prompt, 0)
      returned = time.perf_counter()
      logits.numpy()
      split[1].append(returned - start)
      split[2].append(time.perf_counter() - returned)
  finally:
    model._prefill_graph = original
  build, call, wait = (statistics.median(values[1:]) * 1e3 for values in split)
  return build, call - build, wait


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--length", type=int, default=512)
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--every", default="1,5", help="comma-separated K: realize every K blocks")
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--layers", type=int, default=0, help="fewer blocks than SmolLM2's 30 (a CPU check)")
  parser.add_argument("--sections", default="upload,loop,split,every,jit,torch")
  args = parser.parse_args()
  sections = set(args.sections.split(","))
  if "upload" in sections: upload_probe(args.device, 4096 if args.device == "CUDA" else 128)
  set_float32_matmul_precision("highest")
  config = dataclasses.replace(SMOLLM2_135M, n_layers=args.layers) if args.layers else SMOLLM2_135M
  host_weights = random_llama_weights(config)
  weights = {name: Tensor(value, device=args.device) for name, value in host_weights.items()}
  Tensor.realize_all(*weights.values())
  model = Llama(config, weights, args.length + 8, symbolic=False)
  prompt = np.random.default_rng(0).integers(100, config.vocab_size, (1, args.length)).astype(np.int32)
  sync = Device[args.device].synchronize
  for _ in range(3): model(prompt, 0)   # compile, fill the schedule cache
  print(f"eager prefill of {args.length} tokens, {config.n_layers} blocks:", flush=True)
  if "loop" in sections:
    wall, host = loop_ms(model, prompt, sync, args.iters * 2)
    print(f"  in a loop (bench_eager.py's figures): wall {wall:.2f} ms a call, host {host:.2f} ms a call", flush=True)
  if "split" in sections:
    build, realize, wait = split_ms(model, prompt, sync, args.iters)
    print(f"  one call from an idle device: graph building {build:.2f} ms, the rest of the call (inputs, realize: "
          f"schedule, lower, launch) {realize:.2f} ms, then the GPU's remaining work and the read-back {wait:.2f} ms",
          flush=True)

  def row(label: str, milliseconds: float) -> None:
    print(f"  {label:<36} {milliseconds:8.2f} ms host to host", flush=True)
  row("eager, as today", median_ms(lambda: model(prompt, 0).numpy(), args.iters))
  original = model._prefill_graph
  if "every" in sections:
    for every in (int(value) for value in args.every.split(",")):
      model._prefill_graph = prefill_graph_every(model, every)
      row(f"eager, realized every {every} blocks", median_ms(lambda: model(prompt, 0).numpy(), args.iters))
      model._prefill_graph = original
  if "jit" in sections: row("TinyJit", median_ms(lambda: model(prompt, 0, jit=True).numpy(), args.iters + 2))
  if "torch" in sections:
    import torch
    reference = TorchLlama(config, host_weights, "cuda" if args.device == "CUDA" else "cpu", args.length + 8)
    tokens = [int(token) for token in prompt[0]]
    with torch.no_grad(): row("PyTorch eager", median_ms(lambda: reference(tokens, 0), args.iters))
    expected = reference(tokens, 0)
    model._prefill_graph = prefill_graph_every(model, 1)
    difference = float(np.abs(model(prompt, 0).numpy()[0] - expected).max())
    print(f"max |logits realized every block - PyTorch| = {difference:.2e}")


if __name__ == "__main__":
  main()
