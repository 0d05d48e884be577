"""The collectives of collectives.py on CUDA GPUs through NCCL (nccl.py), and a process group for one process per
GPU. Not lazy: the inputs are realized, NCCL is launched on each GPU's kernel stream inside one group call, and the
outputs come back as realized LazyBuffers. NCCL orders itself after the kernels already queued on those streams,
so no host synchronisation is needed.

Untested in CI (no GPUs there): test/test_multi.py runs these only with two or more GPUs and the NCCL wheel.
"""
from __future__ import annotations

import os
from typing import Callable, Sequence

from ourgrad.device import Buffer, Device
from ourgrad.distributed import nccl
from ourgrad import lazy_trace
from ourgrad.helpers import env_var, prod
from ourgrad.lazy import LazyBuffer

NCCL_ID_FILE = env_var("OURGRAD_NCCL_ID_FILE", "", "file holding the NCCL unique id of a multi-process run (written by "
                       "rank 0, read by the others; python -m ourgrad.distributed.launch sets it)")

# one communicator per GPU for each ordered set of devices
_COMMS: dict[tuple[str, ...], list[int]] = {}


def communicators(devices: Sequence[str]) -> list[int]:
  """The NCCL communicators of these devices (one per device, made once with ncclCommInitAll)."""
  key = tuple(devices)
  if key not in _COMMS:
    for device in devices: Device[device]  # open each GPU (retains its primary context) before NCCL uses it
    _COMMS[key] = nccl.comms_for_devices([Device.device_index(device) for device in devices])
  return _COMMS[key]


def realized_pointer(buffer: LazyBuffer) -> int:
  """The device address of `buffer`'s values, realizing them first (contiguous)."""
  from ourgrad.engine.realize import run_schedule
  from ourgrad.engine.schedule_cache import schedule
  lazy = buffer if buffer.reads_whole_base else buffer.contiguous()
  if lazy.base.realized is None:
    lazy_trace.force(lazy.base)
    run_schedule(schedule([lazy]))
  return int(lazy.base.realized.handle)


def stream_of(device: str) -> int:
  return Device[device].stream_handle


def _grouped(devices: Sequence[str], launch: Callable[[int, str, int], None]) -> None:
  """Call `launch(index, device, comm)` for each device inside one ncclGroupStart/End (required for several GPUs of
  one thread: a lone call would wait for its peers and deadlock)."""
  comms = communicators(devices)
  library = nccl.load()
  nccl.check(library.ncclGroupStart(), "ncclGroupStart")
  try:
    for index, (device, comm) in enumerate(zip(devices, comms)):
      Device[device].make_current()
      launch(index, device, comm)
  finally:
    nccl.check(library.ncclGroupEnd(), "ncclGroupEnd")


def _outputs(buffers: Sequence[LazyBuffer], shape: tuple[int, ...]) -> list[Buffer]:
  return [Buffer(buffer.device, prod(shape), buffer.dtype).allocate() for buffer in buffers]


def nccl_allreduce(buffers: Sequence[LazyBuffer], op: str) -> list[LazyBuffer]:
  devices = [buffer.device for buffer in buffers]
  sends = [realized_pointer(buffer) for buffer in buffers]
  outputs = _outputs(buffers, buffers[0].shape)
  dtype, reduction = nccl.nccl_dtype(buffers[0].dtype), nccl.nccl_op(op)
  def launch(index: int, device: str, comm: int) -> None:
    nccl.check(nccl.load().ncclAllReduce(sends[index], int(outputs[index].handle), buffers[0].size, dtype, reduction,
                                         comm, stream_of(device)), "ncclAllReduce")
  _grouped(devices, launch)
  return [LazyBuffer.from_buffer(output, buffers[0].shape) for output in outputs]


def nccl_broadcast(buffers: Sequence[LazyBuffer], root: int) -> list[LazyBuffer]:
  devices = [buffer.device for buffer in buffers]
  sends = [realized_pointer(buffer) if index == root else 0 for index, buffer in enumerate(buffers)]
  outputs = _outputs(buffers, buffers[0].shape)
  dtype = nccl.nccl_dtype(buffers[0].dtype)
  def launch(index: int, device: str, comm: int) -> None:
    nccl.check(nccl.load().ncclBroadcast(sends[index] or None, int(outputs[index].handle), buffers[0].size, dtype, root,
                                         comm, stream_of(device)), "ncclBroadcast")
  _grouped(devices, launch)
  return [LazyBuffer.from_buffer(output, buffers[0].shape) for output in outputs]


def nccl_allgather(buffers: Sequence[LazyBuffer]) -> list[LazyBuffer]:
  """Equal pieces along axis 0 (NCCL's layout: rank i's piece at offset i * count)."""
  devices = [buffer.device for buffer in buffers]
  sends = [realized_pointer(buffer) for buffer in buffers]
  shape = (buffers[0].shape[0] * len(buffers),) + buffers[0].shape[1:]
  outputs = _outputs(buffers, shape)
  dtype = nccl.nccl_dtype(buffers[0].dtype)
  def launch(index: int, device: str, comm: int) -> None:
    nccl.check(nccl.load().ncclAllGather(sends[index], int(outputs[index].handle), buffers[0].size, dtype, comm,
                                         stream_of(device)), "ncclAllGather")
  _grouped(devices, launch)
  return [LazyBuffer.from_buffer(output, shape) for output in outputs]


def nccl_reduce_scatter(buffers: Sequence[LazyBuffer], op: str) -> list[LazyBuffer]:
  """Equal pieces along axis 0: device i gets rows [i*n/k, (i+1)*n/k) of the reduction."""
  devices = [buffer.device for buffer in buffers]
  sends = [realized_pointer(buffer) for buffer in buffers]
  shape = (buffers[0].shape[0] // len(buffers),) + buffers[0].shape[1:]
  outputs = _outputs(buffers, shape)
  dtype, reduction = nccl.nccl_dtype(buffers[0].dtype), nccl.nccl_op(op)
  def launch(index: int, device: str, comm: int) -> None:
    nccl.check(nccl.load().ncclReduceScatter(sends[index], int(outputs[index].handle), prod(shape), dtype, reduction,
                                             comm, stream_of(device)), "ncclReduceScatter")
  _grouped(devices, launch)
  return [LazyBuffer.from_buffer(output, shape) for output in outputs]


# ---------------------------------------------------------------- one process per GPU

class ProcessGroup:
  """This process's place among WORLD_SIZE processes (one GPU each), as set by ourgrad.distributed.launch: RANK,
  WORLD_SIZE, LOCAL_RANK (the GPU of this host), and the NCCL unique id in the file OURGRAD_NCCL_ID_FILE (rank 0
  writes it, the others wait for it). Several hosts: give every process the same file on a shared filesystem."""

  def __init__(self) -> None:
    self.rank = int(os.environ.get("RANK", "0"))
    self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    self.local_rank = int(os.environ.get("LOCAL_RANK", str(self.rank)))
    self.device = "CUDA" if self.local_rank == 0 else f"CUDA:{self.local_rank}"
    self.comm: int | None = None

  def init_nccl(self, timeout_s: float = 300.0) -> None:
    """Make this rank's communicator (ncclCommInitRank); blocks until every rank joined."""
    Device[self.device].make_current()
    shared_id = read_or_create_unique_id(str(NCCL_ID_FILE.value), self.rank, timeout_s)
    self.comm = nccl.comm_for_rank(self.world_size, self.rank, shared_id)

  def allreduce(self, buffer: LazyBuffer, op: str = "sum") -> LazyBuffer:
    """The elementwise `op` of this buffer over all processes (each calls it with the same shape, in one order)."""
    if self.world_size == 1: return buffer
    if self.comm is None: self.init_nccl()
    send = realized_pointer(buffer)
    output = Buffer(buffer.device, buffer.size, buffer.dtype).allocate()
    Device[buffer.device].make_current()
    nccl.check(nccl.load().ncclAllReduce(send, int(output.handle), buffer.size, nccl.nccl_dtype(buffer.dtype),
                                         nccl.nccl_op(op), self.comm, stream_of(buffer.device)), "ncclAllReduce")
    return LazyBuffer.from_buffer(output, buffer.shape)


def read_or_create_unique_id(path: str, rank: int, timeout_s: float) -> nccl.UniqueId:
  """Rank 0 makes the id and writes it to `path` (renamed into place, so readers see all 128 bytes or nothing);
  other ranks poll for the file."""
  import time
  if not path: raise RuntimeError("OURGRAD_NCCL_ID_FILE is not set: start the processes with "
                                  "python -m ourgrad.distributed.launch, or set it to a file every rank can read")
  if rank == 0:
    shared_id = nccl.unique_id()
    with open(path + ".tmp", "wb") as id_file: id_file.write(nccl.id_to_bytes(shared_id))
    os.replace(path + ".tmp", path)
    return shared_id
  deadline = time.monotonic() + timeout_s
  while not os.path.exists(path):
    if time.monotonic() > deadline: raise TimeoutError(f"rank {rank}: no NCCL id in {path} after {timeout_s:g} s")
    time.sleep(0.05)
  with open(path, "rb") as id_file: return nccl.id_from_bytes(id_file.read())
