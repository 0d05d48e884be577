"""Kernel kinds: how a kernel AST becomes a kernel, which opts it takes, how it is lowered to its device's source text
and what a launch costs, each kind in one row of `KINDS`. The one place that decides how; its readers:
engine/realize.py (build, compile and launch a kernel), engine/graph_viz.py (a schedule item's kernel name),
codegen/opt/search.py (compile BEAM's candidates), test/conftest.py (CHECK_CUDA_RENDER's NVRTC check) and
extra/tools/dump_kernels.py.

The kinds, the first whose `matches` takes the AST:
- pack: several elementwise kernels in one launch (codegen/packed.py), linearized by its own plan;
- index_accumulate: an indexed accumulate (an embedding's gradient: codegen/index_accumulate.py), its own plan;
- attention, attention_grad: a fused attention and its backward's kernels (codegen/attention.py, attention_grad.py),
  whole-kernel plans that the renderer renders as they are;
- split_reduce: a one-kernel split reduce whose last blocks finish it (codegen/last_block.py), the heuristic's opts;
- ride_along: a kernel carrying a one-value reduce in its first block (codegen/ride_along.py), the host's heuristic
  opts (engine/ride_along.py checked the rider fits with them);
- loop_nest: any other kernel, with its Opts linearized to UOps (codegen/linearizer.py) and rendered; one whose opts
  chose OptOps.WGMMA is the whole-kernel plan of codegen/wgmma_tiles.py instead.
`lower_kernel` returns a `LoweredKernel`: the source and what its callers need beside it, the launch sizes, the UOps
(to cost or print the kernel) and the wgmma or attention plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, Callable

from ourgrad.codegen.attention import AttentionKernel, AttentionPlan, is_attention
from ourgrad.codegen.attention_backward_plan import AttentionBackwardPlan
from ourgrad.codegen.attention_grad import AttentionGradKernel, is_attention_grad
from ourgrad.codegen.index_accumulate import IndexAccumulateKernel, is_index_accumulate
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.kernel_cost import loop_nest_cost, own_ops_cost, ride_along_cost, split_reduce_cost, wgmma_cost
from ourgrad.codegen.last_block import SplitReduceKernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.packed import PackedKernel
from ourgrad.codegen.ride_along import RideAlongKernel
from ourgrad.codegen.uops import UOp, launch_dims
from ourgrad.codegen.wgmma_tiles import WgmmaMatmul
from ourgrad.helpers import NOOPT
from ourgrad.ops import ConstBuffer, LazyOp, MemBuffer, Ops
from ourgrad.renderer import Renderer
from ourgrad.shape.symbolic import is_symbolic

# every kind of kernel a schedule item lowers to
AnyKernel = Kernel | PackedKernel | IndexAccumulateKernel | AttentionKernel | AttentionGradKernel


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


class OptPolicy(Enum):
  """Which Opts a kind's kernel runs with."""
  OWN_PLAN = auto()    # none: the kernel is sized by its own plan
  HEURISTIC = auto()   # always the hand-coded ones (a one-kernel split reduce: the scheduler checked its layout with
  #                      them, engine/split_fusion.py), NOOPT and BEAM included; no plain kernel replaces it
  SEARCHED = auto()    # the hand-coded ones, BEAM's where a search is given, none with NOOPT or a symbolic view; a
  #                      plain kernel replaces one that fails to compile (engine/realize.py get_runner)


@dataclass(frozen=True)
class KernelKind:
  """One kind of kernel: which ASTs it takes, how it is built, which opts it takes, how it is lowered and costed."""
  name: str
  matches: Callable[[LazyOp], bool]
  build: Callable[[LazyOp, Renderer], AnyKernel]
  lower: Callable[[Any, Renderer, str], LoweredKernel]
  cost: Callable[[Any, LoweredKernel], tuple[int, int]]   # (arithmetic ops, bytes moved) of one launch
  kernel_type: type
  opts: OptPolicy = OptPolicy.OWN_PLAN
  block_counters: bool = False   # its launches take zeroed int32 counters, one per group of blocks (last_block.py)


def _lower_own_linearize(kernel: Any, renderer: Renderer, name: str) -> LoweredKernel:
  """A kernel that linearizes itself (packed, indexed accumulate, split reduce, ride-along), its UOps rendered."""
  return _rendered_uops(kernel.linearize(), renderer, name)


def _rendered_uops(uops: list[UOp], renderer: Renderer, name: str) -> LoweredKernel:
  global_size, local_size = launch_dims(uops)
  return LoweredKernel(name, renderer.render(name, uops), global_size, local_size, uops)


def _lower_loop_nest(kernel: Kernel, renderer: Renderer, name: str) -> LoweredKernel:
  """A Kernel's plan of OptOps.WGMMA if its opts chose one, else its loop nest linearized and rendered."""
  if kernel.wgmma is not None:
    plan, arguments = kernel.wgmma
    return LoweredKernel(name, renderer.render_wgmma(name, plan, arguments), plan.global_size, plan.local_size,
                         wgmma=plan)
  return _rendered_uops(linearize(kernel), renderer, name)


def _lower_attention(kernel: AttentionKernel, renderer: Renderer, name: str) -> LoweredKernel:
  plan, arguments = kernel.attention
  return LoweredKernel(name, renderer.render_attention(name, plan, arguments), plan.global_size, plan.local_size,
                       attention=plan)


def _lower_attention_grad(kernel: AttentionGradKernel, renderer: Renderer, name: str) -> LoweredKernel:
  launch = kernel.launch
  return LoweredKernel(name, renderer.render_attention_grad(name, kernel), launch.grid, launch.block,
                       attention_grad=kernel.plan)


def _loop_nest_cost(kernel: Kernel, lowered: LoweredKernel) -> tuple[int, int]:
  return wgmma_cost(kernel, lowered.wgmma) if lowered.wgmma is not None else loop_nest_cost(kernel, lowered.uops)


def _plan_cost(kernel: AttentionKernel | AttentionGradKernel, lowered: LoweredKernel) -> tuple[int, int]:
  return kernel.op_count(), kernel.byte_count()


# the kinds in the order asked: the last (loop_nest) takes every AST
KINDS: list[KernelKind] = [
  KernelKind("pack", lambda ast: ast.op is Ops.PACK, PackedKernel, _lower_own_linearize,
             lambda kernel, lowered: own_ops_cost(kernel, lowered.uops), PackedKernel),
  KernelKind("index_accumulate", is_index_accumulate, IndexAccumulateKernel, _lower_own_linearize,
             lambda kernel, lowered: own_ops_cost(kernel, lowered.uops), IndexAccumulateKernel),
  KernelKind("attention", is_attention, AttentionKernel, _lower_attention, _plan_cost, AttentionKernel),
  KernelKind("attention_grad", is_attention_grad, AttentionGradKernel, _lower_attention_grad, _plan_cost,
             AttentionGradKernel),
  KernelKind("split_reduce", lambda ast: ast.op is Ops.SPLIT_REDUCE, SplitReduceKernel, _lower_own_linearize,
             lambda kernel, lowered: split_reduce_cost(kernel, lowered.uops), SplitReduceKernel,
             OptPolicy.HEURISTIC, block_counters=True),
  KernelKind("ride_along", lambda ast: ast.op is Ops.RIDE_ALONG, RideAlongKernel, _lower_own_linearize,
             lambda kernel, lowered: ride_along_cost(kernel, lowered.uops), RideAlongKernel, OptPolicy.HEURISTIC),
  KernelKind("loop_nest", lambda ast: True, Kernel, _lower_loop_nest, _loop_nest_cost, Kernel, OptPolicy.SEARCHED),
]


def kind_of_ast(ast: LazyOp) -> KernelKind:
  """The kind of kernel `ast` becomes."""
  return next(kind for kind in KINDS if kind.matches(ast))


def kind_of(kernel: Any) -> KernelKind:
  """The kind `kernel` was built as: the first whose class it is (a SplitReduceKernel is a Kernel too, and comes
  first)."""
  return next(kind for kind in KINDS if isinstance(kernel, kind.kernel_type))


def ast_is_symbolic(ast: LazyOp) -> bool:
  """Whether a leaf's view has a symbolic size, stride, offset or mask (a Variable: docs/jit.md)."""
  return any(isinstance(node.arg, (MemBuffer, ConstBuffer)) and node.arg.st.symbolic for node in ast.walk())


def ast_has_symbolic_shape(ast: LazyOp) -> bool:
  """Whether a leaf's view has a symbolic size, stride or offset: a symbolic mask bound alone (a fixed-shape view of
  a tensor shrunk to a bound Variable and padded back, `Tensor.pad` of a symbolic amount) leaves every size known."""
  return any(isinstance(node.arg, (MemBuffer, ConstBuffer)) and _shape_symbolic(node.arg.st) for node in ast.walk())


def _shape_symbolic(st: Any) -> bool:
  return any(is_symbolic(value) for view in st.views for value in (*view.shape, *view.strides, view.offset))


def build_kernel(ast: LazyOp, renderer: Renderer, search: Callable[[Kernel], Kernel] | None = None) -> AnyKernel:
  """The kernel of `ast` for `renderer` with the opts it runs with (its kind's OptPolicy): for a loop nest the
  hand-coded ones, or `search(kernel)`'s (BEAM) where given; none with NOOPT=1 or a symbolic size, stride or offset
  (the optimizations split and pad sizes they must know: a Variable only in a mask bound leaves them known)."""
  kind = kind_of_ast(ast)
  kernel = kind.build(ast, renderer)
  if kind.opts is OptPolicy.OWN_PLAN: return kernel
  if kind.opts is OptPolicy.SEARCHED:
    if NOOPT or ast_has_symbolic_shape(ast): return kernel
    # BEAM times candidates without the Variables' values: a Variable-bounded mask keeps the hand-coded opts
    if search is not None and not ast_is_symbolic(ast): return search(kernel)
  kernel.hand_coded_optimizations()
  return kernel


def lower_kernel(kernel: AnyKernel, renderer: Renderer, name: str) -> LoweredKernel:
  """`kernel` rendered by `renderer` as the function `name`, as its kind lowers it."""
  return kind_of(kernel).lower(kernel, renderer, name)


def kernel_cost(kernel: AnyKernel, lowered: LoweredKernel) -> tuple[int, int]:
  """(arithmetic ops, bytes moved) of one launch of `kernel` lowered as `lowered`."""
  return kind_of(kernel).cost(kernel, lowered)
