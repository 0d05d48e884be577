"""The coalescing of a GPT-2 training step's elementwise and packed kernels as CUDA sm_90 lowers them, without a GPU:
the step (loss, backward, both AdamW groups; TF32 matmuls) is scheduled as for an H200 (the renderer of the default
device swapped for CUDA's after the weights are made, so the scheduler stages matmul operands and packs as it does
there), each E_/P_ kernel optimized and lowered, and for one warp of a middle block every global load and store
instruction counted with the sectors it touches (transpose_tiles.warp_sectors, from the index expressions).

    PYTHONPATH=. python extra/tools/step_sectors.py --layers 2                # one row per kernel
    PYTHONPATH=. python extra/tools/step_sectors.py --layers 1 --source out.txt   # and the CUDA sources

A row: the kernel, its load and store instructions per warp (lanes active), the bytes they move, the sectors they
touch and bytes / (sectors x 32): 1.00 is every sector used whole. A packed kernel's rows count every segment's IF
block as taken (the model does not follow branches): compare its bytes per instruction, not its totals. Compare a
codegen change by running it on both trees (the copies branch, session 11, 2 layers: E_36_64_16_16_4_4 64
instructions and 1024 sectors a warp -> 16 and 256).
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from ourgrad import Tensor, set_float32_matmul_precision  # noqa: E402
from ourgrad.codegen.index_accumulate import is_index_accumulate  # noqa: E402
from ourgrad.codegen.kernel import Kernel  # noqa: E402
from ourgrad.codegen.lowering import lower_kernel  # noqa: E402
from ourgrad.codegen.opt.transpose_tiles import SECTOR_BYTES, warp_sectors  # noqa: E402
from ourgrad.codegen.packed import PackedKernel  # noqa: E402
from ourgrad.codegen.uops import UOps  # noqa: E402
from ourgrad.device import Device  # noqa: E402
from ourgrad.engine.realize import function_name  # noqa: E402
from ourgrad.engine.schedule import create_schedule  # noqa: E402
from ourgrad.ops import Ops  # noqa: E402
from ourgrad.renderer.cuda import CUDARenderer  # noqa: E402


def step_schedule(layers: int, batch: int, sequence: int) -> list:
  """The schedule of one GPT-2 small training step of `layers` layers on batch x sequence tokens, as for sm_90."""
  from extra.models.gpt2 import GPT2, GPT2Config, configure_optimizers
  set_float32_matmul_precision("high")
  Tensor.training = True
  model = GPT2(GPT2Config(n_layer=layers))   # weights made (and realized) on the real default device
  optimizers = configure_optimizers(model)
  tokens = Tensor.randint(batch, sequence, high=50257).realize()
  targets = Tensor.randint(batch, sequence, high=50257).realize()
  Device[Device.DEFAULT].renderer = CUDARenderer("sm_90")   # scheduled only from here on: nothing runs
  _, loss = model(tokens, targets)
  loss.backward()
  updates = [tensor for optimizer in optimizers for tensor in optimizer.schedule_step()]
  return create_schedule([tensor.lazydata for tensor in [loss, *updates]])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, default=1)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--sequence", type=int, default=512)
  parser.add_argument("--block", type=float, default=0.5, help="the block the warp is taken from (0: the first)")
  parser.add_argument("--source", type=pathlib.Path, help="also write each kernel's CUDA source here")
  args = parser.parse_args()
  renderer = CUDARenderer("sm_90")
  sources: list[str] = []
  print(f"{'kernel':28s} {'loads':>5s} {'stores':>6s} {'bytes':>6s} {'sectors':>7s} {'use':>5s}")
  for item in step_schedule(args.layers, args.batch, args.sequence):
    if item.ast.op not in (Ops.STORE, Ops.SINK, Ops.PACK) or is_index_accumulate(item.ast): continue
    if item.ast.op is Ops.PACK:
      kernel: Kernel | PackedKernel = PackedKernel(item.ast, renderer)
    else:
      kernel = Kernel(item.ast, renderer)
      kernel.hand_coded_optimizations()
    name = function_name(kernel)
    if not name.startswith(("E_", "P_")): continue
    lowered = lower_kernel(kernel, renderer, name)
    accesses = [access for access in warp_sectors(lowered.uops, block=args.block) if access.lanes]
    loads = sum(access.op is UOps.LOAD for access in accesses)
    moved = sum(access.lanes * access.lane_bytes for access in accesses)
    sectors = sum(access.sectors for access in accesses)
    use = moved / (sectors * SECTOR_BYTES) if sectors else 1.0
    print(f"{name:28s} {loads:5d} {len(accesses) - loads:6d} {moved:6d} {sectors:7d} {use:5.2f}")
    sources.append(f"==== {name} global {lowered.global_size} local {lowered.local_size}\n{lowered.source}")
  if args.source is not None: args.source.write_text("\n".join(sources))


if __name__ == "__main__":
  main()
