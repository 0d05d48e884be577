"""Where the eager SmolLM2 prefill's host-to-host time goes, and whether realizing the residual stream every K layers
(so the GPU runs the first layers while Python builds the next ones) shortens it (issue 26).

Each prefill is timed as bench_models.py times it: from the call to the logits on the host (`.numpy()`), beside
PyTorch eager's (bench_models.TorchLlama). The split of one eager call: graph building (Tensor ops, to the
realize), the realize (schedule, lower, launch) and the wait for the GPU's remaining work and the read-back.

Run: `python extra/bench/probe_prefill_overlap.py [--length 512] [--iters 5] [--every 1,5]` (CUDA); a CPU check:
`--device CLANG --layers 2 --length 32`.
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
  def build(tokens, cos, sin, write, placement, positions, last, sequence, attended):
    visible = model.slots[:attended].reshape(1, attended) <= positions.reshape(-1, 1)
    cos, sin = (table.reshape(1, table.shape[0], 1, table.shape[1]) for table in (cos, sin))
    x = model.embed(tokens)
    for index, block in enumerate(model.blocks):
      x = block(x, cos, sin, write, placement, visible, sequence)
      if (index + 1) % every == 0: Tensor.realize_all(x, *(done.cache for done in model.blocks[:index + 1]))
    return rms_norm(x[0][last], model.norm, model.config.norm_eps).linear(as_tensor(model.output))
  return build


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--length", type=int, default=512)
  parser.add_argument("--iters", type=int, default=5)
  parser.add_argument("--every", default="1,5", help="comma-separated K: realize every K blocks")
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--layers", type=int, default=0, help="fewer blocks than SmolLM2's 30 (a CPU check)")
  args = parser.parse_args()
  upload_probe(args.device, 4096 if args.device == "CUDA" else 128)
  set_float32_matmul_precision("highest")
  config = dataclasses.replace(SMOLLM2_135M, n_layers=args.layers) if args.layers else SMOLLM2_135M
  host_weights = random_llama_weights(config)
  weights = {name: Tensor(value, device=args.device) for name, value in host_weights.items()}
  Tensor.realize_all(*weights.values())
  model = Llama(config, weights, args.length + 8, symbolic=False)
  prompt = np.random.default_rng(0).integers(100, config.vocab_size, (1, args.length)).astype(np.int32)
  sync = Device[args.device].synchronize

  # one eager call split into graph building, realize and the wait for the logits
  original = model._prefill_graph
  split: list[list[float]] = [[], [], []]

  def timed_graph(*positional, **named):
    start = time.perf_counter()
    logits = original(*positional, **named)
    split[0].append(time.perf_counter() - start)
    return logits
  model._prefill_graph = timed_graph
  for _ in range(args.iters + 1):
    sync()
    start = time.perf_counter()
    logits = model(prompt, 0)
    returned = time.perf_counter()
    logits.numpy()
    split[1].append(returned - start)
    split[2].append(time.perf_counter() - returned)
  build, call, wait = (statistics.median(values[1:]) * 1e3 for values in split)
  print(f"eager prefill of {args.length} tokens, one call: graph building {build:.2f} ms, the rest of the call "
        f"(inputs, realize: schedule, lower, launch) {call - build:.2f} ms, then the GPU's remaining work and the "
        f"read-back {wait:.2f} ms")
  model._prefill_graph = original
  rows = [("eager, as today", median_ms(lambda: model(prompt, 0).numpy(), args.iters))]
  for every in (int(value) for value in args.every.split(",")):
    model._prefill_graph = prefill_graph_every(model, every)
    rows.append((f"eager, realized every {every} blocks", median_ms(lambda: model(prompt, 0).numpy(), args.iters)))
    model._prefill_graph = original
  rows.append(("TinyJit", median_ms(lambda: model(prompt, 0, jit=True).numpy(), args.iters + 2)))
  import torch
  reference = TorchLlama(config, host_weights, "cuda" if args.device == "CUDA" else "cpu",
                         args.length + 8)
  tokens = [int(token) for token in prompt[0]]
  with torch.no_grad(): rows.append(("PyTorch eager", median_ms(lambda: reference(tokens, 0), args.iters)))
  expected = reference(tokens, 0)
  model._prefill_graph = prefill_graph_every(model, 1)
  difference = float(np.abs(model(prompt, 0).numpy()[0] - expected).max())
  for label, milliseconds in rows: print(f"  {label:<36} {milliseconds:8.2f} ms host to host")
  print(f"max |logits realized every block - PyTorch| = {difference:.2e}")


if __name__ == "__main__":
  main()
