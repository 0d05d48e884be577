"""Dtype audit of one GPT-2 training step under autocast, from its schedule alone (nothing runs, no GPU needed).

Every kernel of the step (forward, cross-entropy, backward, both AdamW updates): its matmul-shaped reduces (a SUM of a
MUL of two broadcast loads, through casts) with each operand's stored dtype, every buffer it stores (dtype, bytes) and
the bytes it moves (each leaf's view counted once over the elements it can touch, as engine/realize.py's wgmma_cost
counts). Then the totals: kernels, bytes moved, bytes stored per dtype, matmuls per operand dtype.

  DEVICE=PYTHON EMULATE=CUDA python extra/bench/autocast_audit.py --config 2,64,64,2,2,256 --autocast bf16
  DEVICE=PYTHON EMULATE=CUDA python extra/bench/autocast_audit.py --config 16,1024,768,12,12,50304 --autocast bf16 \
      --summary                          # the real config: the weights are empty buffers (nothing initialised)
--config batch,seq,width,heads,layers,vocab as bench_gpt2.py; --autocast none gives the float32 step.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's ourgrad and extra/
from ourgrad import Tensor, dtypes  # noqa: E402
from ourgrad.engine.schedule import create_schedule  # noqa: E402
from ourgrad.ops import LazyOp, Ops  # noqa: E402
from extra.models.gpt2 import GPT2, GPT2Config, configure_optimizers  # noqa: E402

AUTOCAST = {"bf16": dtypes.bfloat16, "fp16": dtypes.float16, "none": None}


def _through_casts(op: LazyOp) -> LazyOp:
  while op.op is Ops.CAST: op = op.srcs[0]
  return op


def matmul_operands(ast: LazyOp) -> list[tuple[str, str, str]]:
  """(operand dtypes, accumulator dtype) of each matmul-shaped SUM in `ast`: a MUL of two broadcast loads (a stride 0
  in each load's view), through casts."""
  found = []
  for op in ast.walk():
    if op.op is not Ops.SUM: continue
    product = _through_casts(op.srcs[0])
    if product.op is not Ops.MUL: continue
    loads = [_through_casts(src) for src in product.srcs]
    if all(load.op is Ops.LOAD and 0 in load.arg.st.views[-1].strides for load in loads):
      found.append((loads[0].dtype.name, loads[1].dtype.name, op.dtype.name))
  return found


def leaf_bytes(ast: LazyOp) -> int:
  """Bytes a kernel moves: each buffer's leaf counted once over the elements its view can touch."""
  seen: dict[tuple[int, Ops], int] = {}
  for op in ast.walk():
    if op.op in (Ops.LOAD, Ops.STORE) and hasattr(op.arg, "idx"):
      seen[(op.arg.idx, op.op)] = op.arg.st.real_size() * op.arg.dtype.itemsize
  return sum(seen.values())


def step_schedule(config: GPT2Config, batch: int, sequence: int, low: Any) -> list[Any]:
  """The schedule of one training step (what gpt2.training_step realizes) with empty weights, forward under
  autocast(`low`) (None: float32). Not run: its buffers hold nothing."""
  from ourgrad import autocast
  initialize = GPT2._initialize
  GPT2._initialize = lambda self: None  # type: ignore[method-assign]  (the audit reads dtypes, not values)
  try:
    model = GPT2(config)
  finally:
    GPT2._initialize = initialize  # type: ignore[method-assign]
  for param in model.parameters(): param.lazydata = Tensor.empty(*param.shape, dtype=param.dtype).realize().lazydata
  optimizers = configure_optimizers(model)
  tokens = Tensor.empty(batch, sequence, dtype=dtypes.int32).realize()
  targets = Tensor.empty(batch, sequence, dtype=dtypes.int32).realize()
  with Tensor.train():
    for optimizer in optimizers: optimizer.zero_grad()
    with autocast(low or "bfloat16", enabled=low is not None):
      loss = model(tokens, targets)[1]
    loss.backward()
    outs = [loss, *[tensor for optimizer in optimizers for tensor in optimizer.schedule_step()]]
  return create_schedule([tensor.lazydata for tensor in outs])


def audit(schedule: list[Any], summary: bool) -> None:
  """Print each kernel (unless `summary`) and the totals."""
  moved, stored, matmuls = 0, Counter(), Counter()
  for number, item in enumerate(schedule):
    kernel_bytes = leaf_bytes(item.ast) if item.ast.op is not Ops.COPY else 2 * item.outputs[0].nbytes
    moved += kernel_bytes
    products = matmul_operands(item.ast)
    for product in products: matmuls[product] += 1
    outs = []
    for buffer in item.outputs:
      stored[buffer.dtype.name] += buffer.nbytes
      outs.append(f"{buffer.dtype.name}[{buffer.size}]")
    if summary: continue
    ins = ",".join(sorted({buffer.dtype.name for buffer in item.inputs}))
    reduces = [op.op.name for op in item.ast.walk() if op.op in (Ops.SUM, Ops.MAX_REDUCE)]
    matmul = " ".join(f"{a}x{b}->{acc}" for a, b, acc in products)
    print(f"{number:4d} {kernel_bytes / 1e6:10.3f} MB  out {' '.join(outs):32s} in {ins:24s} "
          f"reduces {len(reduces)} {('matmul ' + matmul) if matmul else ''}")
  print(f"kernels {len(schedule)}, moved {moved / 1e9:.3f} GB")
  print("stored: " + ", ".join(f"{name} {nbytes / 1e9:.3f} GB" for name, nbytes in sorted(stored.items())))
  print("matmuls (operand, operand -> accumulator): " +
        ", ".join(f"{a} x {b} -> {acc}: {count}" for (a, b, acc), count in sorted(matmuls.items())))


def peak_intermediates(schedule: list[Any], top: int = 6) -> None:
  """The most bytes of buffers the step creates that are alive at once (each from the kernel that writes it to its
  last reader; buffers that exist before the step, the weights and optimizer state, are not counted), as the memory
  planner sees lifetimes, and what is alive at that point: what holds the step's peak memory beyond its weights."""
  first_write: dict[int, int] = {}
  first_read: dict[int, int] = {}
  last_use: dict[int, int] = {}
  by_id: dict[int, Any] = {}
  for number, item in enumerate(schedule):
    for buffer in item.outputs: first_write.setdefault(id(buffer), number)
    for buffer in item.inputs: first_read.setdefault(id(buffer), number)
    for buffer in (*item.outputs, *item.inputs):
      last_use[id(buffer)], by_id[id(buffer)] = number, buffer
  # made by the step: written before anything reads it (an updated weight is read first: it existed before)
  made = [key for key, number in first_write.items() if first_read.get(key, number) >= number]
  peak, peak_at = 0, 0
  for number in range(len(schedule)):
    alive = sum(by_id[key].nbytes for key in made if first_write[key] <= number <= last_use[key])
    if alive > peak: peak, peak_at = alive, number
  alive_at_peak = sorted((by_id[key] for key in made if first_write[key] <= peak_at <= last_use[key]),
                         key=lambda buffer: -buffer.nbytes)
  by_kind: Counter = Counter()
  for buffer in alive_at_peak: by_kind[(buffer.dtype.name, buffer.size)] += 1
  print(f"peak of buffers made by the step: {peak / 1e9:.3f} GB at kernel {peak_at}; largest alive there: " +
        ", ".join(f"{count} x {name}[{size}] ({count * size * dtypes.as_dtype(name).itemsize / 1e9:.2f} GB)"
                  for (name, size), count in sorted(by_kind.items(), key=lambda kv: -kv[0][1] * kv[1])[:top]))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="2,64,64,2,2,256", help="batch,seq,width,heads,layers,vocab")
  parser.add_argument("--autocast", choices=sorted(AUTOCAST), default="bf16")
  parser.add_argument("--summary", action="store_true", help="totals only, no per-kernel lines")
  args = parser.parse_args()
  batch, sequence, width, heads, layers, vocab = (int(part) for part in args.config.split(","))
  config = GPT2Config(n_layer=layers, n_head=heads, n_embd=width, vocab_size=vocab, block_size=sequence)
  schedule = step_schedule(config, batch, sequence, AUTOCAST[args.autocast])
  audit(schedule, args.summary)
  peak_intermediates(schedule)


if __name__ == "__main__":
  main()
