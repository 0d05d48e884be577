"""A one-block kernel carried by a larger one: a small reduce run by the first block of a bigger, independent kernel.

A reduce to one value over a few thousand elements (the mean of a loss over its rows, the count of samples not
ignored) is a launch of one block that reads a few KB: on a GPU it costs a launch and a memory latency for almost no
work, and on a CPU a call. Where the schedule has a larger kernel beside it that neither reads what the other writes
(engine/ride_along.py pairs them), `RideAlongKernel` runs both in one launch: the host kernel as it is, then, in the
host's first block (a CPU: after the host's loops), the rider's code on the host block's threads. Its AST is
RIDE_ALONG(host root, rider STORE) with the merged kernel's number of each rider buffer as its arg.

The rider takes the host block's threads as its own: on a GPU its reduce is GROUPed across all of them (so its
BARRIERs are reached by every thread of the block, inside a branch that is uniform over the block), or, for a reduce
too short to split evenly, one thread loops over it. Its local memory is its own, renamed beside the host's. The
other blocks of the host pay one comparison; the first block runs a few microseconds longer while the others stream.
"""
from __future__ import annotations

from typing import Any

from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import INDEX_DTYPE, linearize
from ourgrad.codegen.opts import KernelOptError, Opt, OptOps
from ourgrad.codegen.uops import AxisType, UOp, UOpBuilder, UOps
from ourgrad.dtype import dtypes
from ourgrad.helpers import prod
from ourgrad.ops import LazyOp, Ops

# a rider whose reduce does not split evenly over the host block's threads runs on one thread: at most this many
# elements (a loop of loads a thread keeps in flight, L2-resident after the first launch)
MAX_ONE_THREAD_ELEMENTS = 1024


def host_of(ast: LazyOp) -> LazyOp:
  """The kernel AST that describes `ast`'s launch: a ride-along's host, any other AST itself."""
  return ast.srcs[0] if ast.op is Ops.RIDE_ALONG else ast


def rider_elements(rider: LazyOp) -> int:
  """The elements the rider's reduce runs over (its loop nest's size)."""
  return max((prod(leaf.arg.st.shape) for leaf in rider.leaves() if hasattr(leaf.arg, "st")), default=1)


def rider_bytes(rider: LazyOp) -> int:
  """The bytes the rider moves: each element of its loads' views once (a gathered load reads one element per
  element of its view, not its whole buffer), and the value it stores."""
  loads = [leaf for leaf in rider.leaves() if leaf.op is Ops.LOAD]
  return sum(min(leaf.arg.st.real_size(), prod(leaf.arg.st.shape)) * leaf.dtype.itemsize for leaf in loads) + \
    rider.dtype.itemsize


def rider_kernel(rider: LazyOp, renderer: Any, threads: int) -> Kernel | None:
  """The rider's Kernel for a host block of `threads` threads: GROUPed over all of them on a GPU, its own heuristic
  on a CPU (no threads), one thread where the split does not fit and the reduce is short. None: it cannot ride."""
  kernel = Kernel(rider, renderer)
  if kernel.row_axes is not None or kernel.reduceop is None or kernel.first_reduce != 0: return None
  if not renderer.has_threads:
    kernel.hand_coded_optimizations()
    return kernel
  if threads > 1 and renderer.has_local:
    grouped = kernel.copy()
    try:
      grouped.apply_opt(Opt(OptOps.GROUP, 0, threads))
      return _unrolled(grouped)
    except KernelOptError:
      pass
  return _unrolled(kernel) if rider_elements(rider) <= MAX_ONE_THREAD_ELEMENTS else None


def _unrolled(kernel: Kernel) -> Kernel:
  """`kernel` with its reduce loop unrolled by 8, 4 or 2 where it has that many iterations: several iterations'
  loads in flight together (a gathered load waits on the index it loads first)."""
  for amount in (8, 4, 2):
    if kernel.try_opt(Opt(OptOps.UNROLL, 0, amount)): break
  return kernel


def _thread_specials(uops: list[UOp], kind_global: bool) -> list[UOp]:
  return [uop for uop in uops if uop.op is UOps.SPECIAL and (uop.arg[3] is AxisType.GLOBAL) == kind_global]


def _flat_thread(builder: UOpBuilder, threads: list[UOp]) -> UOp:
  """The host block's thread id as one number: dimension x fastest (neighbouring ids in neighbouring lanes)."""
  flat = builder.const(0, INDEX_DTYPE)
  for special in sorted(threads, key=lambda uop: -uop.arg[2]):
    flat = builder.alu(Ops.ADD, INDEX_DTYPE, builder.alu(Ops.MUL, INDEX_DTYPE, flat,
                                                         builder.const(special.arg[1], INDEX_DTYPE)), special)
  return flat


def _first_block(builder: UOpBuilder, blocks: list[UOp]) -> UOp | None:
  """blockIdx == 0 along every dimension (None: a CPU, or one block)."""
  condition = None
  for special in blocks:
    first = builder.alu(Ops.CMPLT, dtypes.bool, special, builder.const(1, INDEX_DTYPE))
    condition = first if condition is None else builder.alu(Ops.AND, dtypes.bool, condition, first)
  return condition


def carry(host: list[UOp], rider: list[UOp], arguments: tuple[int, ...]) -> list[UOp]:
  """The host's UOps followed by the rider's, run by the host's first block on the host block's threads (module
  docstring); rider buffer i is the merged kernel's argument `arguments[i]`. The rider has one thread SPECIAL of the
  host block's size, or none (one thread)."""
  if _thread_specials(rider, True): raise AssertionError("a rider runs in one block: it has block indices")
  rider_threads = _thread_specials(rider, False)
  host_threads = _thread_specials(host, False)
  builder = UOpBuilder()
  flat = _flat_thread(builder, host_threads) if host_threads else None
  condition = _first_block(builder, _thread_specials(host, True))
  substitutes: dict[int, UOp] = {}
  if rider_threads:
    if len(rider_threads) != 1 or flat is None or rider_threads[0].arg[1] != prod(u.arg[1] for u in host_threads):
      raise AssertionError("a rider's threads are the host block's")
    substitutes[id(rider_threads[0])] = flat
  elif flat is not None:   # one thread runs it
    first_thread = builder.alu(Ops.CMPLT, dtypes.bool, flat, builder.const(1, INDEX_DTYPE))
    condition = first_thread if condition is None else builder.alu(Ops.AND, dtypes.bool, condition, first_thread)
  # one argument per buffer: the rider's DEFINE_GLOBAL of a buffer the host takes too is the host's
  host_globals = {uop.arg[0]: uop for uop in host if uop.op is UOps.DEFINE_GLOBAL}
  rider_globals = [uop for uop in rider if uop.op is UOps.DEFINE_GLOBAL]
  for uop in rider_globals:
    uop.arg = (arguments[uop.arg[0]], *uop.arg[1:])
    if uop.arg[0] in host_globals: substitutes[id(uop)] = host_globals[uop.arg[0]]
  locals_, body = [], []
  for uop in rider:
    if uop.op in (UOps.DEFINE_GLOBAL, UOps.SPECIAL, UOps.OCCUPANCY): continue
    sources = []
    for src in uop.srcs:
      taken = substitutes.get(id(src), src)
      if taken is not src: taken.uses += 1
      sources.append(taken)
    uop.srcs = tuple(sources)
    if uop.op is UOps.DEFINE_LOCAL:
      uop.arg = (f"ride_{uop.arg[0]}", *uop.arg[1:])   # beside the host's own local arrays
      locals_.append(uop)
    else: body.append(uop)
  if any(uop.op is UOps.DEFINE_VAR for uop in host + rider): raise AssertionError("a symbolic kernel carries no rider")
  defines = sorted([uop for uop in host if uop.op is UOps.DEFINE_GLOBAL] +
                   [uop for uop in rider_globals if id(uop) not in substitutes], key=lambda uop: uop.arg[0])
  host_body = [uop for uop in host if uop.op is not UOps.DEFINE_GLOBAL]
  opened = builder.add(UOps.IF, None, (condition,)) if condition is not None else None
  closing = [UOp(UOps.ENDIF, None, (opened,))] if opened is not None else []
  return defines + host_body + locals_ + builder.uops + body + closing


class RideAlongKernel(Kernel):
  """A RIDE_ALONG AST's kernel: the host's Kernel (its opts apply as usual) whose linearize appends the rider run by
  the first block (module docstring)."""

  def __init__(self, ast: LazyOp, renderer: Any):
    if ast.op is not Ops.RIDE_ALONG: raise AssertionError(f"a ride-along kernel's AST is RIDE_ALONG, not {ast.op}")
    host, rider = ast.srcs
    super().__init__(host, renderer)
    self.ride_ast, self.rider_ast = ast, rider   # `ast` is the host's root, as the Kernel's opts see it

  @property
  def name(self) -> str: return f"{super().name}_and_r_{rider_elements(self.rider_ast)}"

  def rider_bytes(self) -> int: return rider_bytes(self.rider_ast)

  def linearize(self) -> list[UOp]:
    if self.wgmma is not None: raise AssertionError(f"{self.name}: a WGMMA plan has no UOps to carry a rider")
    host = linearize(self)
    threads = prod(uop.arg[1] for uop in _thread_specials(host, False))
    rider = rider_kernel(self.rider_ast, self.renderer, threads)
    if rider is None: raise AssertionError(f"{self.name}: the rider does not fit a block of {threads} threads")
    return carry(host, linearize(rider), self.ride_ast.arg)
