"""A Kernel with its Opts applied, lowered to its device's source text: the one place that decides how.

A kernel with OptOps.WGMMA, a fused attention (codegen/attention.py) and its backward's (codegen/attention_grad.py) are
whole-kernel plans (codegen/wgmma_tiles.py)
that the renderer renders as they are; any other kernel is linearized to UOps (codegen/linearizer.py; a PackedKernel
and an IndexAccumulateKernel by their own linearize) and the UOps are rendered. `lower_kernel` returns a
`LoweredKernel`: the source and what its callers need beside it, the launch sizes, the UOps (to cost or print the
kernel) and the wgmma or attention plan. Its callers: engine/realize.py (compile and launch a kernel),
codegen/opt/search.py (compile BEAM's candidates) and test/conftest.py (CHECK_CUDA_RENDER's NVRTC check).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ourgrad.codegen.attention import AttentionKernel, AttentionPlan
from ourgrad.codegen.attention_backward import AttentionBackwardPlan
from ourgrad.codegen.attention_grad import AttentionGradKernel
from ourgrad.codegen.index_accumulate import IndexAccumulateKernel
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.last_block import SplitReduceKernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.packed import PackedKernel
from ourgrad.codegen.ride_along import RideAlongKernel
from ourgrad.codegen.uops import UOp, launch_dims
from ourgrad.codegen.wgmma_tiles import WgmmaMatmul
from ourgrad.renderer import Renderer


@dataclass(frozen=True)
class LoweredKernel:
  """A kernel's source for one renderer, and what compiling, launching and costing it need."""
  name: str
  source: str
  global_size: tuple[Any, ...]   # blocks of a launch along x, y, z (a symbolic size is a Node; CPUs: 1, 1, 1)
  local_size: tuple[Any, ...]    # threads per block along x, y, z
  uops: list[UOp] = field(default_factory=list)   # the linearized loop nest; empty for a wgmma plan
  wgmma: WgmmaMatmul | None = None   # the plan rendered instead of a loop nest
  attention: AttentionPlan | None = None   # a fused attention's plan, rendered as it is
  attention_grad: AttentionBackwardPlan | None = None   # a fused attention backward kernel's plan

  @property
  def linearized(self) -> bool:
    """Whether the source was rendered from UOps (every kernel but a wgmma or attention plan)."""
    return self.wgmma is None and self.attention is None and self.attention_grad is None


def lower_kernel(kernel: Kernel | PackedKernel | IndexAccumulateKernel | AttentionKernel | AttentionGradKernel,
                 renderer: Renderer, name: str) -> LoweredKernel:
  """`kernel` rendered by `renderer` as the function `name`: its wgmma or attention plan if it has one, else its
  UOps."""
  if isinstance(kernel, AttentionKernel):
    plan, arguments = kernel.attention
    return LoweredKernel(name, renderer.render_attention(name, plan, arguments), plan.global_size, plan.local_size,
                         attention=plan)
  if isinstance(kernel, AttentionGradKernel):
    launch = kernel.launch
    return LoweredKernel(name, renderer.render_attention_grad(name, kernel), launch.grid, launch.block,
                         attention_grad=kernel.plan)
  wgmma = getattr(kernel, "wgmma", None)
  # a split reduce's and a ride-along's raise in their linearize
  if wgmma is not None and not isinstance(kernel, (SplitReduceKernel, RideAlongKernel)):
    plan, arguments = wgmma
    return LoweredKernel(name, renderer.render_wgmma(name, plan, arguments), plan.global_size, plan.local_size,
                         wgmma=plan)
  own_linearize = isinstance(kernel, (PackedKernel, IndexAccumulateKernel, SplitReduceKernel, RideAlongKernel))
  uops = kernel.linearize() if own_linearize else linearize(kernel)
  global_size, local_size = launch_dims(uops)
  return LoweredKernel(name, renderer.render(name, uops), global_size, local_size, uops)
