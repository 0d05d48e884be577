"""Dump the hand-coded kernels of a fixed set of programs, as each renderer writes them, to compare codegen changes:
the MNIST CNN training step, a 1-layer GPT-2 training step, 4096^2 matmuls and a few ragged and batched ones,
scheduled (not run) and lowered for CLANG, CUDA sm_80 (mma.sync) and CUDA sm_90 (wgmma) without a GPU. A refactor of
the codegen must leave every file byte-identical (float32 matmuls also with TF32 allowed):

    PYTHONPATH=. python extra/tools/dump_kernels.py /tmp/before   # on the old tree
    PYTHONPATH=. python extra/tools/dump_kernels.py /tmp/after    # on the new tree
    diff -r /tmp/before /tmp/after
"""
from __future__ import annotations

import argparse
import pathlib
import sys
from typing import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from ourgrad import Tensor, dtypes, set_float32_matmul_precision  # noqa: E402
from ourgrad.codegen.index_accumulate import is_index_accumulate  # noqa: E402
from ourgrad.codegen.kernel import Kernel  # noqa: E402
from ourgrad.codegen.last_block import SplitReduceKernel  # noqa: E402
from ourgrad.codegen.lowering import lower_kernel  # noqa: E402
from ourgrad.codegen.opts import describe_opts  # noqa: E402
from ourgrad.codegen.ride_along import RideAlongKernel  # noqa: E402
from ourgrad.device import Device  # noqa: E402
from ourgrad.engine.realize import function_name  # noqa: E402
from ourgrad.engine.schedule import create_schedule  # noqa: E402
from ourgrad.ops import LazyOp, Ops  # noqa: E402
from ourgrad.renderer.cuda import CUDARenderer  # noqa: E402


def mnist_step() -> list[Tensor]:
  """The loss, gradients and Adam update of examples/mnist.py's small ConvNet on a batch of 32."""
  from examples.mnist import MODELS, ConvNet
  from ourgrad.nn.losses import cross_entropy
  from ourgrad.nn.optim import Adam
  from ourgrad.nn.state import get_parameters
  Tensor.training = True
  model = ConvNet(MODELS["small"])
  optimizer = Adam([p for p in get_parameters(model) if p.requires_grad])
  images, labels = Tensor.rand(32, 1, 28, 28), Tensor.randint(32, high=10)
  loss = cross_entropy(model(images), labels)
  loss.backward()
  return [loss, *optimizer.schedule_step()]


def gpt2_step() -> list[Tensor]:
  """The loss, gradients and AdamW update of a 1-layer GPT-2 small on a batch of 4 x 256 tokens."""
  from extra.models.gpt2 import GPT2, GPT2Config, configure_optimizers
  Tensor.training = True
  model = GPT2(GPT2Config(n_layer=1))
  optimizers = configure_optimizers(model)
  tokens, targets = Tensor.randint(4, 256, high=50257), Tensor.randint(4, 256, high=50257)
  _, loss = model(tokens, targets)
  loss.backward()
  return [loss, *[t for optimizer in optimizers for t in optimizer.schedule_step()]]


def matmul(dtype_name: str, m: int, k: int, n: int, batch: tuple[int, ...] = ()) -> Callable[[], list[Tensor]]:
  """A (batched) matmul of contiguous random operands in `dtype_name`."""
  def build() -> list[Tensor]:
    dtype = getattr(dtypes, dtype_name)
    return [Tensor.rand(*batch, m, k).cast(dtype).contiguous() @ Tensor.rand(*batch, k, n).cast(dtype).contiguous()]
  return build


def conv(dtype_name: str) -> Callable[[], list[Tensor]]:
  """A 3x3 convolution of 64 channels (padding 1) in `dtype_name` with its input and weight gradients."""
  def build() -> list[Tensor]:
    dtype = getattr(dtypes, dtype_name)
    x = Tensor.rand(8, 32, 16, 16).cast(dtype).contiguous().realize().requires_grad_()
    w = Tensor.rand(64, 32, 3, 3).cast(dtype).contiguous().realize().requires_grad_()
    out = x.conv2d(w, padding=1)
    (out * Tensor.rand(*out.shape).cast(dtype)).sum().backward()
    return [out, x.grad, w.grad]
  return build


PROGRAMS: dict[str, Callable[[], list[Tensor]]] = {
  "mnist_step": mnist_step, "gpt2_1layer_step": gpt2_step,
  "matmul4096_float32": matmul("float32", 4096, 4096, 4096), "matmul4096_float16": matmul("float16", 4096, 4096, 4096),
  # ragged sizes (padded tiles) and small batched heads (the unstaged tensor-core kernel)
  "matmul1000_float16": matmul("float16", 1000, 512, 1000), "heads_float16": matmul("float16", 64, 64, 64, (4, 3)),
  "conv_float32": conv("float32"), "conv_float16": conv("float16"), "conv_bfloat16": conv("bfloat16"),
  "heads_float32": matmul("float32", 64, 64, 64, (4, 3)), "small_float16": matmul("float16", 32, 48, 40, (2,)),
}


def asts_of(outputs: list[Tensor]) -> list[LazyOp]:
  """The kernel ASTs of the schedule that computes `outputs` (copies, packed kernels and indexed accumulates, which take
  no opts, left out)."""
  return [item.ast for item in create_schedule([t.lazydata for t in outputs])
          if item.ast.op in (Ops.STORE, Ops.SINK, Ops.SPLIT_REDUCE, Ops.RIDE_ALONG)
          and not is_index_accumulate(item.ast)]


def dump(asts: list[LazyOp], renderer: object) -> str:
  """Each kernel's name, opts and source for `renderer`, hand-coded optimizations applied."""
  parts = []
  for ast in asts:
    # a one-kernel split reduce (codegen/last_block.py, EMULATE=CUDA) dumps as one kernel with its finish
    # and a kernel carrying a one-value reduce (codegen/ride_along.py) with its rider
    kernel = SplitReduceKernel(ast, renderer) if ast.op is Ops.SPLIT_REDUCE else \
      RideAlongKernel(ast, renderer) if ast.op is Ops.RIDE_ALONG else Kernel(ast, renderer)
    kernel.hand_coded_optimizations()
    name = function_name(kernel)
    try:
      source = lower_kernel(kernel, renderer, name).source
    except Exception as error:  # noqa: BLE001  a kernel a renderer cannot lower is a fact to compare too
      source = f"<lowering failed: {type(error).__name__}: {error}>"
    parts.append(f"==== {name}\nopts: {describe_opts(kernel.applied_opts)}\n{source}")
  return "\n".join(parts)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("out", type=pathlib.Path)
  args = parser.parse_args()
  args.out.mkdir(parents=True, exist_ok=True)
  renderers = {"clang": Device["CLANG"].renderer, "cuda_sm80": CUDARenderer("sm_80"),
               "cuda_sm90": CUDARenderer("sm_90")}
  for program, build in PROGRAMS.items():
    asts = asts_of(build())
    for renderer_name, renderer in renderers.items():
      for tf32 in (False, True):
        if tf32 and renderer_name == "clang": continue
        set_float32_matmul_precision("high" if tf32 else "highest")
        path = args.out / f"{program}_{renderer_name}{'_tf32' if tf32 else ''}.txt"
        path.write_text(dump(asts, renderer))
        print(f"{path}: {len(asts)} kernels", flush=True)
  set_float32_matmul_precision("highest")


if __name__ == "__main__":
  main()
