"""Collectives over one LazyBuffer per device: allreduce, allgather, broadcast, reduce_scatter.

Each takes a sequence of buffers, the i-th on device i, and returns a new list in the same order. On devices NCCL
does not serve (CLANG, LLVM, OPENCL, PYTHON; what CI runs) a collective is built from lazy copies and adds, so it
schedules and fuses like any other op. When every buffer is on a distinct CUDA GPU and NCCL is installed, the inputs
are realized and NCCL runs the collective on each GPU's kernel stream (so it orders after the kernels that produced
its inputs and before those that read its outputs), all GPUs in one NCCL group call.

Shapes: allreduce and broadcast keep them; allgather concatenates along `axis` (sizes may differ along it);
reduce_scatter splits the reduced result along `axis` into `split_sizes` (numpy array_split's sizes by default).
"""
from __future__ import annotations

from typing import Sequence

from ourgrad.errors import ShardingError
from ourgrad.lazy import LazyBuffer
from ourgrad.ops import Ops

REDUCE_ALU = {"sum": Ops.ADD, "max": Ops.MAX}


def even_split_sizes(total: int, parts: int) -> list[int]:
  """`parts` sizes adding up to `total`, the first `total % parts` one larger (numpy.array_split's rule)."""
  return [total // parts + (1 if index < total % parts else 0) for index in range(parts)]


def _check_same_shapes(buffers: Sequence[LazyBuffer], what: str) -> None:
  if not buffers: raise ValueError(f"{what} needs at least one buffer")
  devices = [buffer.device for buffer in buffers]
  if len(set(devices)) != len(devices): raise ShardingError(f"{what}: devices repeat in {devices}")
  for buffer in buffers[1:]:
    if buffer.shape != buffers[0].shape or buffer.dtype != buffers[0].dtype:
      raise ShardingError(f"{what} needs one shape and dtype on every device, got {buffers[0].shape} "
                          f"{buffers[0].dtype} on {buffers[0].device} and {buffer.shape} {buffer.dtype} on "
                          f"{buffer.device}")


def uses_nccl(buffers: Sequence[LazyBuffer]) -> bool:
  """Whether NCCL runs a collective over these buffers: several CUDA GPUs and the library present."""
  if len(buffers) < 2 or not all(buffer.device.partition(":")[0] == "CUDA" for buffer in buffers): return False
  from ourgrad.distributed import nccl
  try:
    nccl.load()
  except Exception:  # no NCCL wheel: the copy-based path still gives the right answer
    return False
  return True


def allreduce(buffers: Sequence[LazyBuffer], op: str = "sum") -> list[LazyBuffer]:
  """Every device gets the elementwise `op` ("sum" or "max") of all buffers."""
  _check_same_shapes(buffers, "allreduce")
  if op not in REDUCE_ALU: raise ValueError(f"allreduce reduces with {', '.join(REDUCE_ALU)}, not {op!r}")
  if uses_nccl(buffers):
    from ourgrad.distributed.nccl_collectives import nccl_allreduce
    return nccl_allreduce(buffers, op)
  # reduce on the first device, then copy the result to the others: n-1 copies in, n-1 copies out
  total = buffers[0]
  for buffer in buffers[1:]: total = total.elementwise(REDUCE_ALU[op], buffer.copy_to_device(total.device))
  return [total.copy_to_device(buffer.device) for buffer in buffers]


def broadcast(buffers: Sequence[LazyBuffer], root: int = 0) -> list[LazyBuffer]:
  """Every device gets the values of the buffer on device `root`."""
  _check_same_shapes(buffers, "broadcast")
  if not 0 <= root < len(buffers): raise ValueError(f"broadcast root {root} is not one of {len(buffers)} devices")
  if uses_nccl(buffers):
    from ourgrad.distributed.nccl_collectives import nccl_broadcast
    return nccl_broadcast(buffers, root)
  return [buffers[root].copy_to_device(buffer.device) for buffer in buffers]


def allgather(buffers: Sequence[LazyBuffer], axis: int = 0) -> list[LazyBuffer]:
  """Every device gets all buffers concatenated along `axis` (in device order; sizes along `axis` may differ)."""
  if not buffers: raise ValueError("allgather needs at least one buffer")
  first = buffers[0]
  for buffer in buffers[1:]:
    other_dims = [size for dim, size in enumerate(buffer.shape) if dim != axis]
    if len(buffer.shape) != len(first.shape) or other_dims != [s for d, s in enumerate(first.shape) if d != axis]:
      raise ShardingError(f"allgather along axis {axis}: shapes {first.shape} on {first.device} and {buffer.shape} "
                          f"on {buffer.device} differ off that axis")
  sizes = [buffer.shape[axis] for buffer in buffers]
  if uses_nccl(buffers) and axis == 0 and len(set(sizes)) == 1:
    from ourgrad.distributed.nccl_collectives import nccl_allgather
    return nccl_allgather(buffers)
  return [gather_to(buffers, axis, buffer.device) for buffer in buffers]


def gather_to(buffers: Sequence[LazyBuffer], axis: int, device: str) -> LazyBuffer:
  """The buffers concatenated along `axis` on one device: each copied there, padded to the full size and added
  (the pads are zeros outside each piece, so the adds fuse into one kernel that writes every element once)."""
  total = sum(buffer.shape[axis] for buffer in buffers)
  result: LazyBuffer | None = None
  start = 0
  for buffer in buffers:
    size = buffer.shape[axis]
    padding = tuple((start, total - start - size) if dim == axis else (0, 0) for dim in range(len(buffer.shape)))
    piece = buffer.copy_to_device(device).pad(padding)
    result = piece if result is None else result.elementwise(Ops.ADD, piece)
    start += size
  assert result is not None
  return result


def reduce_scatter(buffers: Sequence[LazyBuffer], axis: int = 0, op: str = "sum",
                   split_sizes: Sequence[int] | None = None) -> list[LazyBuffer]:
  """Device i gets the i-th piece (along `axis`) of the elementwise `op` of all buffers."""
  _check_same_shapes(buffers, "reduce_scatter")
  length = buffers[0].shape[axis]
  sizes = list(split_sizes) if split_sizes is not None else even_split_sizes(length, len(buffers))
  if len(sizes) != len(buffers) or sum(sizes) != length:
    raise ShardingError(f"reduce_scatter: split sizes {sizes} do not cut axis {axis} of size {length} into "
                        f"{len(buffers)} pieces")
  if uses_nccl(buffers) and axis == 0 and len(set(sizes)) == 1:
    from ourgrad.distributed.nccl_collectives import nccl_reduce_scatter
    return nccl_reduce_scatter(buffers, op)
  reduced = allreduce(buffers, op)
  pieces, start = [], 0
  for buffer, size in zip(reduced, sizes):
    bounds = tuple((start, start + size) if dim == axis else (0, full) for dim, full in enumerate(buffer.shape))
    pieces.append(buffer.shrink(bounds))
    start += size
  return pieces
