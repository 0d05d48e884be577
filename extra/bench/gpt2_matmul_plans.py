"""The plan each matmul kernel of one GPT-2 training step gets on an H100/H200 (WGMMA or mma.sync TC), and the
operand copies the scheduler stages for WGMMA (engine/operand_staging.py), without a GPU: the step is scheduled for
the PYTHON device with CUDA sm_90's facts (`PythonRenderer("CUDA_SM90")`, TF32 allowed) and each kernel's opts are
the heuristic's; nothing runs.

  python extra/bench/gpt2_matmul_plans.py                      # GPT-2 small, 1 layer, batch 8 x 512
  python extra/bench/gpt2_matmul_plans.py --no-staging         # the same without the staging rule (before)
  python extra/bench/gpt2_matmul_plans.py --config 8,512,768,12,1,50304
  python extra/bench/gpt2_matmul_plans.py --autocast bfloat16     # the forward under ourgrad.autocast (16-bit)
"""
from __future__ import annotations

import argparse
import os

import ourgrad  # noqa: E402
from ourgrad import Tensor, autocast, dtypes  # noqa: E402
from ourgrad.codegen.kernel import Kernel, OptOps  # noqa: E402
from ourgrad.codegen.ride_along import host_of  # noqa: E402
from ourgrad.device import Device  # noqa: E402
from ourgrad.engine import schedule as scheduler  # noqa: E402
from ourgrad.ops import Ops  # noqa: E402
from ourgrad.runtime.ops_python import PythonRenderer  # noqa: E402

from extra.models.gpt2 import GPT2, GPT2Config, configure_optimizers  # noqa: E402


def step_outputs(batch: int, sequence: int, width: int, heads: int, layers: int, vocab: int,
                 low_dtype: str | None = None) -> list[Tensor]:
  """The loss and every optimizer update of one training step, lazy (as extra/models/gpt2.training_step builds);
  with `low_dtype` the forward runs under ourgrad.autocast(low_dtype)."""
  model = GPT2(GPT2Config(n_layer=layers, n_head=heads, n_embd=width, vocab_size=vocab, block_size=sequence))
  optimizers = configure_optimizers(model)
  tokens = Tensor.empty(batch, sequence, dtype=dtypes.int32)
  targets = Tensor.empty(batch, sequence, dtype=dtypes.int32)
  with Tensor.train():
    for optimizer in optimizers: optimizer.zero_grad()
    with autocast(low_dtype or "bfloat16", enabled=low_dtype is not None):
      loss = model(tokens, targets)[1]
    loss.backward()
    return [loss] + [tensor for optimizer in optimizers for tensor in optimizer.schedule_step()]


def main() -> None:
  # the script's default device; set here, not at import: tests import step_outputs, and a DEVICE set at import
  # would make PYTHON every later test's default device
  os.environ.setdefault("DEVICE", "PYTHON")
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="8,512,768,12,1,50304", help="batch,seq,width,heads,layers,vocab")
  parser.add_argument("--no-staging", action="store_true", help="schedule without engine/operand_staging.py")
  parser.add_argument("--autocast", choices=("bfloat16", "float16"), help="the forward under ourgrad.autocast(dtype)")
  args = parser.parse_args()
  ourgrad.set_float32_matmul_precision("high")
  renderer = Device["PYTHON"].renderer = PythonRenderer("CUDA_SM90")
  staged_bases = []
  original = scheduler.stage_matmul_operands

  def recording(bases, realizes):
    if args.no_staging: return bases
    staged = original(bases, realizes)
    staged_bases.extend(base for base in staged if base.op is Ops.CONTIGUOUS and id(base) in realizes
                        and "staged K-major" in realizes[id(base)])
    return staged
  scheduler.stage_matmul_operands = recording
  outs = step_outputs(*(int(size) for size in args.config.split(",")), low_dtype=args.autocast)
  schedule = scheduler.create_schedule([tensor.lazydata for tensor in outs])
  staged_buffers = {id(base.realized) for base in staged_bases}
  print(f"{len(schedule)} items; matmul kernels (the heuristic's plan on sm_90) and staged copies:")
  print(f"{'plan':6} {'kernel':42} {'loop (batch, M, N, K)':28} {'MB written':>10}")
  copies = 0
  for item in schedule:
    if item.ast.op is Ops.COPY: continue
    written = sum(buffer.nbytes for buffer in item.outputs) / 1e6
    if any(id(buffer) in staged_buffers for buffer in item.outputs):
      copies += 1
      name = "(packed with small kernels)" if item.ast.op is Ops.PACK else Kernel(host_of(item.ast), renderer).name
      print(f"{'copy':6} {name:42} {'':28} {written:10.2f}  (reads as much)")
      continue
    # small kernels packed into one launch (engine/packing.py), a one-kernel split reduce (codegen/last_block.py)
    if item.ast.op in (Ops.PACK, Ops.SPLIT_REDUCE): continue
    ast = host_of(item.ast)   # a kernel carrying a one-value reduce: its host (codegen/ride_along.py)
    sums = [node for node in ast.walk() if node.op is Ops.SUM]
    if len(sums) != 1 or not any(node.op is Ops.MUL for node in sums[0].walk()): continue
    kernel = Kernel(ast, renderer)
    if len(kernel.full_shape) < 3: continue   # a row or column sum
    shape = str(kernel.full_shape)
    kernel.hand_coded_optimizations()
    kinds = {opt.op for opt in kernel.applied_opts}
    plan = "WGMMA" if OptOps.WGMMA in kinds else ("TC" if OptOps.TC in kinds else "other")
    print(f"{plan:6} {kernel.name:42} {shape:28} {written:10.2f}")
  print(f"{copies} staged copies")


if __name__ == "__main__":
  main()
