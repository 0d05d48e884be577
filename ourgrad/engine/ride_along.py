"""One launch less for each small reduce to one value: it rides in the first block of an independent kernel beside it.

`carry_small_reduces(schedule)` runs once the scheduler has ordered its items (after split-reduce fusion and
packing). A rider is a kernel storing one value, a reduce of at most MAX_RIDER_ELEMENTS elements (a loss's mean over
its rows, the count of samples a loss does not ignore); its host is the nearest kernel before or after it that moves
at least HOST_BYTES_FACTOR times its bytes (and HOST_LATENCIES memory latencies' worth), on the same device, such
that moving the rider to the host's place changes nothing another item sees:
- moved earlier (host before it): neither the host nor an item between writes what the rider reads, nor touches its
  output;
- moved later (host after it): neither the host nor an item between reads or writes the rider's output, nor writes
  what the rider reads.
The merged item's AST is RIDE_ALONG(host root, rider STORE) (codegen/ride_along.py) with the buffers of both (the
host's outputs, the rider's output, the host's inputs, the rider's inputs not among them; the rider's AST keeps its
own numbers, the arg maps them), at the host's place. A
host carries one rider. Cross-entropy's loss and gradient: the count of samples rides in the logsumexp row kernel,
the mean of the losses in the gradient's elementwise kernel: 2 kernels (docs/fusion.md). The devices: those whose
renderer says `carries_riders` (CLANG, CUDA, PYTHON). DEBUG=3 prints each merge. RIDE_ALONG=0 turns it off.
"""
from __future__ import annotations

import warnings

from ourgrad.codegen.attention import is_attention
from ourgrad.codegen.attention_grad import is_attention_grad
from ourgrad.codegen.index_accumulate import is_index_accumulate
from ourgrad.codegen.lowering import ast_is_symbolic
from ourgrad.codegen.ride_along import RideAlongKernel, rider_bytes, rider_elements
from ourgrad.device import Buffer, Device
from ourgrad.engine.schedule_item import ScheduleItem
from ourgrad.helpers import DEBUG, RIDE_ALONG, RUNNER_CACHE_SIZE, BoundedCache
from ourgrad.ops import REDUCE_OPS, LazyOp, Ops

# a rider reduces at most this many elements: a block reads them in about one memory latency per thread's few loads
MAX_RIDER_ELEMENTS = 1 << 16
# a host moves at least this many times the rider's bytes: the first block's extra work hides among the others'
HOST_BYTES_FACTOR = 16
# and, on a device that knows its memory latency (Renderer.latency_bytes), at least this many latencies' worth of
# bytes: the rider's chain (its loads, a shuffle, a few barriers) is a few latencies long, which a short host (a
# small matmul of a few microseconds) would wait for at its end instead of hiding
HOST_LATENCIES = 4

# merged AST -> whether it lowers (a linearization each: cached)
_lowers: BoundedCache[tuple[str, LazyOp], bool] = BoundedCache(RUNNER_CACHE_SIZE)


def carry_small_reduces(schedule: list[ScheduleItem]) -> list[ScheduleItem]:
  """The schedule with each small reduce to one value merged into a host kernel where the module docstring allows."""
  if len(schedule) < 2 or not RIDE_ALONG: return schedule
  items: list[ScheduleItem | None] = list(schedule)
  for position, item in enumerate(schedule):
    if items[position] is not item or not _is_rider(item): continue
    for host_position in (position - 1, position + 1):
      merged = _merged(items, host_position, position)
      if merged is None: continue
      items[host_position], items[position] = merged, None
      break
  return [item for item in items if item is not None]


def _is_rider(item: ScheduleItem) -> bool:
  """A kernel storing one value, a reduce of a few elements, on a device whose renderer carries riders."""
  ast = item.ast
  if ast.op is not Ops.STORE or len(item.outputs) != 1 or item.outputs[0].size != 1: return False
  if not getattr(Device[item.outputs[0].device].renderer, "carries_riders", False): return False
  if not any(node.op in REDUCE_OPS for node in ast.walk()) or is_index_accumulate(ast): return False
  if ast_is_symbolic(ast): return False
  return rider_elements(ast) <= MAX_RIDER_ELEMENTS


def _is_host(item: ScheduleItem, rider: ScheduleItem) -> bool:
  """A plain kernel (one loop nest, not carrying a rider yet) on the rider's device, moving far more bytes."""
  ast = item.ast
  if ast.op not in (Ops.STORE, Ops.SINK) or is_index_accumulate(ast) or is_attention(ast) or is_attention_grad(ast):
    return False
  if item.outputs[0].device != rider.outputs[0].device: return False
  if ast_is_symbolic(ast): return False
  moved = sum({id(buffer): buffer.nbytes for buffer in item.bufs}.values())
  latency_bytes = getattr(Device[item.outputs[0].device].renderer, "latency_bytes", 0)
  return moved >= HOST_BYTES_FACTOR * rider_bytes(rider.ast) and moved >= HOST_LATENCIES * latency_bytes


def _touches(buffers: tuple[Buffer, ...], targets: tuple[Buffer, ...]) -> bool:
  return any(buffer is target for buffer in buffers for target in targets)


def _moves_safely(items: list[ScheduleItem | None], host_position: int, rider_position: int) -> bool:
  """Whether running the rider at the host's place leaves what every item sees unchanged (module docstring)."""
  rider = items[rider_position]
  assert rider is not None
  low, high = sorted((host_position, rider_position))
  for position in range(low, high + 1):
    other = items[position]
    if position == rider_position or other is None: continue
    if _touches(other.outputs, rider.inputs) or _touches(other.bufs, rider.outputs): return False
  return True


def _merged(items: list[ScheduleItem | None], host_position: int, rider_position: int) -> ScheduleItem | None:
  """The host carrying the rider, or None (with the reason at DEBUG=3)."""
  if not 0 <= host_position < len(items): return None
  host, rider = items[host_position], items[rider_position]
  if host is None or rider is None or not _is_host(host, rider) or not _moves_safely(items, host_position,
                                                                                    rider_position):
    return None
  inputs = host.inputs + tuple(buffer for buffer in rider.inputs if not _touches(host.inputs, (buffer,)))
  outputs = host.outputs + rider.outputs
  position_of = {id(buffer): index for index, buffer in reversed(list(enumerate(outputs + inputs)))}
  # the host's buffers renumbered to the merged item's; the rider keeps its own (a Kernel's outputs are data0..)
  # with the merged number of each in the arg
  rider_arguments = tuple(position_of[id(buffer)] for buffer in rider.bufs)
  host_ast = host.ast.renumbered(lambda index: position_of[id(host.bufs[index])])
  ast = LazyOp(Ops.RIDE_ALONG, (host_ast, rider.ast), rider_arguments)
  device = host.outputs[0].device
  key = (device, ast)
  if key not in _lowers: _lowers[key] = _lowers_fine(ast, device)
  if not _lowers[key]:
    if DEBUG >= 3: print("one-value reduce stays a kernel: it does not fit the host kernel's block")
    return None
  if DEBUG >= 3: print(f"one-value reduce of {rider_elements(rider.ast)} elements rides in a kernel of "
                       f"{host.outputs[0].size} outputs")
  return ScheduleItem(ast, outputs, inputs)


def _lowers_fine(ast: LazyOp, device: str) -> bool:
  """Whether the merged kernel, with the host's heuristic opts, linearizes (a WGMMA host or a rider that fits no
  thread layout does not)."""
  try:
    kernel = RideAlongKernel(ast, Device[device].renderer)
    kernel.hand_coded_optimizations()
    if kernel.wgmma is not None: return False
    kernel.linearize()
    return True
  except Exception as error:  # noqa: BLE001  a kernel the check cannot build stays apart, said as a warning
    # (the test suite turns it into an error, so a bug here cannot hide)
    if isinstance(error, AssertionError) and "does not fit" in str(error): return False
    warnings.warn(f"a one-value reduce stays a kernel: riding failed ({type(error).__name__}: {error})",
                  RuntimeWarning, stacklevel=2)
    return False
