"""What an eager SmolLM2 prefill's graph costs, block by block (issue 26): the wall and host time of eager prefills,
the lazy bases and the bytecodes of one call (graph building apart from realizing), and with `--lines` the bytecodes
of one block by the line of extra/models/llama.py that spent them (the line a frame was called from: a Tensor method,
a helper), with `--files` by the file that ran them. Bytecodes do not move with a loaded machine: compare trees by
them, and by time on a quiet one (the H200's host).

Run: `python extra/bench/probe_prefill_graph.py [--device CUDA] [--calls 10] [--lines] [--files] [--digest]`
(`--digest`: only the eager and jitted prefills' digests, which trees that compute the same values share); on a CPU
device the prompt is 32 tokens of 2 blocks unless `--length`/`--layers` say otherwise, and the timed calls run every
compiled kernel as a no-op (bench_eager.host_kernels_disabled: their time is the host's).
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import dataclasses
import pathlib
import sys
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_eager import host_kernels_disabled  # noqa: E402
from bench_models import SMOLLM2_135M, random_llama_weights  # noqa: E402

import extra.models.llama as llama  # noqa: E402
from ourgrad import Device, Tensor, set_float32_matmul_precision  # noqa: E402
from ourgrad.lazy import LazyBuffer  # noqa: E402

MODEL_FILE = str(pathlib.Path(llama.__file__).resolve())


def traced(call: Callable[[], Any], note: Callable[[Any], None]) -> None:
  """Run `call()` with `note(frame)` called before each bytecode instruction any Python frame executes."""
  def local(frame: Any, event: str, arg: Any) -> Any:
    if event == "opcode": note(frame)
    return local

  def start(frame: Any, event: str, arg: Any) -> Any:
    frame.f_trace_opcodes = True
    return local
  previous = sys.gettrace()
  sys.settrace(start)
  try:
    call()
  finally:
    sys.settrace(previous)


def model_line(frame: Any) -> tuple[str, int] | None:
  """(function, line) of the innermost llama.py frame at or above `frame`, None outside the model's code."""
  while frame is not None and frame.f_code.co_filename != MODEL_FILE: frame = frame.f_back
  return None if frame is None else (frame.f_code.co_name, frame.f_lineno)


def split_by_realize(call: Callable[[], Any]) -> dict[str, int]:
  """Bytecodes `call()` runs building its graph and inside Tensor.realize / realize_all (the realize path)."""
  counts = {"graph": 0, "realize": 0}
  depth = [0]
  methods = {name: getattr(Tensor, name) for name in ("realize", "realize_all")}

  def wrapped(method: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
      depth[0] += 1
      try:
        return method(*args, **kwargs)
      finally:
        depth[0] -= 1
    return run

  def note(frame: Any) -> None: counts["realize" if depth[0] else "graph"] += 1
  Tensor.realize = wrapped(methods["realize"])  # type: ignore[method-assign]
  Tensor.realize_all = staticmethod(wrapped(methods["realize_all"]))  # type: ignore[method-assign]
  try:
    traced(call, note)
  finally:
    Tensor.realize = methods["realize"]  # type: ignore[method-assign]
    Tensor.realize_all = staticmethod(methods["realize_all"])  # type: ignore[method-assign]
  return counts


def count_bases(call: Callable[[], Any]) -> int:
  """The lazy bases (ops) `call()` creates."""
  made = [0]
  create = LazyBuffer.create_base

  def counting(*args: Any, **kwargs: Any) -> LazyBuffer:
    made[0] += 1
    return create(*args, **kwargs)
  LazyBuffer.create_base = staticmethod(counting)  # type: ignore[method-assign]
  try:
    call()
  finally:
    LazyBuffer.create_base = staticmethod(create)  # type: ignore[method-assign]
  return made[0]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default=Device.DEFAULT)
  parser.add_argument("--length", type=int, default=0, help="prompt tokens (default: 512 on CUDA, 32 elsewhere)")
  parser.add_argument("--layers", type=int, default=0, help="blocks (default: SmolLM2's 30 on CUDA, 2 elsewhere)")
  parser.add_argument("--calls", type=int, default=10, help="prefills per timing (best of 3)")
  parser.add_argument("--lines", action="store_true", help="one block's bytecodes by the model's line")
  parser.add_argument("--files", action="store_true", help="one block's bytecodes by file")
  parser.add_argument("--digest", action="store_true", help="only the digests of an eager and a jitted prefill's "
                      "logits and last cache (each from fresh caches), then exit")
  parser.add_argument("--block-only", action="store_true", help="no prefill run, only one block's graph (an emulated "
                      "device: DEVICE=PYTHON EMULATE=CUDA builds CUDA's graph without running its kernels)")
  args = parser.parse_args()
  device = Device.canonicalize(args.device)
  cuda = device == "CUDA"
  length, layers = args.length or (512 if cuda else 32), args.layers or (30 if cuda else 2)
  set_float32_matmul_precision("highest")
  config = dataclasses.replace(SMOLLM2_135M, n_layers=layers)
  weights = {name: Tensor(value, device=device) for name, value in random_llama_weights(config).items()}
  Tensor.realize_all(*weights.values())
  model = llama.Llama(config, weights, length + 8, symbolic=False)
  prompt = np.random.default_rng(0).integers(100, config.vocab_size, (1, length)).astype(np.int32)
  sync = Device[device].synchronize

  def call() -> None: model(prompt, 0)
  if args.digest:
    for jit in (False, True):
      model.reset()
      for _ in range(3 if jit else 1): logits = model(prompt, 0, jit=jit).numpy()   # (a capture on the second call)
      print(f"{'TinyJit' if jit else 'eager'} logits and last cache: sha1 {digest(model, logits)}")
    return
  if not args.block_only:
    logits = model(prompt, 0).numpy()
    print(f"logits and last cache: sha1 {digest(model, logits)} (trees that build the same values print the same)")
    time_prefills(call, sync, args.calls, cuda, f"({layers} blocks, {length} tokens, {device})")
  block_graph(model, prompt, device, args.lines, args.files)


def digest(model: llama.Llama, logits: np.ndarray) -> str:
  """A short hash of a prefill's logits and its last block's cache."""
  return hashlib.sha1(logits.tobytes() + model.blocks[-1].cache.numpy().tobytes()).hexdigest()[:16]


def time_prefills(call: Callable[[], None], sync: Callable[[], None], calls: int, cuda: bool, label: str) -> None:
  """The wall, host and thread CPU time of eager prefills (best of 3 runs of `calls`), and one's bytecodes and bases."""
  for _ in range(3): call()   # compile, fill the schedule cache
  sync()
  with host_kernels_disabled(not cuda):
    for name, clock, wait in (("wall", time.perf_counter, True), ("host", time.perf_counter, False),
                               ("thread CPU", time.thread_time, False)):
      best = float("inf")
      for _ in range(3):
        sync()
        start = clock()
        for _ in range(calls): call()
        if wait: sync()
        best = min(best, (clock() - start) / calls)
      sync()
      print(f"{name:10} per prefill {best * 1e3:8.2f} ms  {label}")
    where = split_by_realize(call)
    print(f"bytecodes per prefill: graph {where['graph']}, realize {where['realize']}; "
          f"lazy bases {count_bases(call)}")
    sync()


def block_graph(model: llama.Llama, prompt: np.ndarray, device: str, by_line: bool, by_file: bool) -> None:
  """One block's graph (the second's, as a prefill from position 0 builds it): its bytecodes and bases, by model line
  (`by_line`) and by file (`by_file`)."""
  length = prompt.shape[1]
  block = model.blocks[min(1, len(model.blocks) - 1)]
  # (an eager call's inputs: views of the model's tables where the tree has them)
  eager = getattr(model, "_eager_inputs", None)
  inputs = eager(0, length, 0) if eager is not None else model._position_inputs(0, length, length)
  x = model.embed(Tensor(prompt, device=device)).realize()
  if hasattr(model, "_block_inputs"):
    cos, sin, write, visible = model._block_inputs(inputs["cos"], inputs["sin"], inputs["write"],
                                                   inputs["positions"], length)
  else:   # (a tree from before Llama._block_inputs: the blocks read the tables as (1, B, 1, hd))
    visible = model.slots[:length].reshape(1, length) <= inputs["positions"].reshape(-1, 1)
    cos, sin = (table.reshape(1, length, 1, table.shape[1]) for table in (inputs["cos"], inputs["sin"]))
    write = inputs["write"]

  def one_block() -> None: block(x, cos, sin, write, inputs["placement"], visible, inputs["sequence"])
  one_block()
  lines: collections.Counter[tuple[str, int]] = collections.Counter()
  files: collections.Counter[str] = collections.Counter()

  def note(frame: Any) -> None:
    files[pathlib.Path(frame.f_code.co_filename).name] += 1
    at = model_line(frame)
    if at is not None: lines[at] += 1
  traced(one_block, note)
  print(f"one block: {sum(files.values())} bytecodes, {count_bases(one_block)} lazy bases")
  source = pathlib.Path(MODEL_FILE).read_text().splitlines()
  if by_line:
    for (function, line), count in lines.most_common():
      print(f"  {count:7d}  {function}:{line}  {source[line - 1].strip()[:90]}")
  if by_file:
    for name, count in files.most_common(): print(f"  {count:7d}  {name}")


if __name__ == "__main__":
  main()
