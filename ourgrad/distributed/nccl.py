"""A small ctypes binding of NCCL (libnccl.so.2 from the `nvidia-nccl-cu13` wheel: `pip install 'ourgrad[cuda]'`).

Only what ourgrad's collectives need: the version, unique ids, communicators for several GPUs of one process
(ncclCommInitAll) or one GPU per process (ncclCommInitRank), group calls, and AllReduce, AllGather, Broadcast and
ReduceScatter launched on a given CUDA stream. Signatures follow nccl.h (2.x). NVLink multicast (NVLS) is switched
off before NCCL initialises unless the user set NCCL_NVLS_ENABLE: on a shared host, multicast setup can take every
GPU out of service. Nothing here calls cuMulticastCreate.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys

from ourgrad.dtype import DType, dtypes
from ourgrad.errors import DeviceError

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES in nccl.h


class UniqueId(ctypes.Structure):
  """ncclUniqueId: 128 opaque bytes made by one rank and given to every other (passed by value to InitRank)."""
  _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


# ncclDataType_t and ncclRedOp_t values from nccl.h
NCCL_DTYPES: dict[DType, int] = {
  dtypes.int8: 0, dtypes.uint8: 1, dtypes.int32: 2, dtypes.uint32: 3, dtypes.int64: 4, dtypes.uint64: 5,
  dtypes.float16: 6, dtypes.float32: 7, dtypes.float64: 8, dtypes.bfloat16: 9,
}
NCCL_OPS: dict[str, int] = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}

_library: ctypes.CDLL | None = None


def library_candidates() -> list[str]:
  """Where libnccl may be: NCCL_LIBRARY if set, the nvidia-nccl wheel in each site-packages, then the loader's
  search path."""
  candidates = [os.environ["NCCL_LIBRARY"]] if os.environ.get("NCCL_LIBRARY") else []
  for folder in sys.path:
    candidates += sorted(glob.glob(os.path.join(folder, "nvidia", "nccl", "lib", "libnccl.so*")))
    candidates += sorted(glob.glob(os.path.join(folder, "nvidia", "cu13", "lib", "libnccl.so*")))
  return candidates + ["libnccl.so.2"]


def load() -> ctypes.CDLL:
  """The NCCL library with its argument types declared; DeviceError naming the fix if it cannot be found."""
  global _library
  if _library is not None: return _library
  # before NCCL reads its environment (at the first communicator): no NVLink multicast unless the user asked
  os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
  errors = []
  for candidate in library_candidates():
    try:
      library = ctypes.CDLL(candidate)
      break
    except OSError as error:
      errors.append(f"{candidate}: {error}")
  else:
    raise DeviceError("NCCL not found: pip install 'ourgrad[cuda]' (the nvidia-nccl-cu13 wheel) or set NCCL_LIBRARY "
                      "to libnccl.so.2; tried " + "; ".join(errors[-2:]))
  _declare(library)
  _library = library
  return library


def _declare(library: ctypes.CDLL) -> None:
  voidp, size_t, c_int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
  signatures = {
    "ncclGetVersion": [ctypes.POINTER(c_int)],
    "ncclGetUniqueId": [ctypes.POINTER(UniqueId)],
    "ncclCommInitRank": [ctypes.POINTER(voidp), c_int, UniqueId, c_int],
    "ncclCommInitAll": [ctypes.POINTER(voidp), c_int, ctypes.POINTER(c_int)],
    "ncclCommDestroy": [voidp],
    "ncclGroupStart": [],
    "ncclGroupEnd": [],
    # (sendbuff, recvbuff, count, datatype, [op | root,] comm, stream)
    "ncclAllReduce": [voidp, voidp, size_t, c_int, c_int, voidp, voidp],
    "ncclBroadcast": [voidp, voidp, size_t, c_int, c_int, voidp, voidp],
    "ncclReduceScatter": [voidp, voidp, size_t, c_int, c_int, voidp, voidp],
    "ncclAllGather": [voidp, voidp, size_t, c_int, voidp, voidp],
  }
  for name, argtypes in signatures.items():
    function = getattr(library, name)
    function.argtypes, function.restype = argtypes, c_int
  library.ncclGetErrorString.argtypes, library.ncclGetErrorString.restype = [c_int], ctypes.c_char_p


def check(result: int, call: str) -> None:
  """Raise DeviceError with NCCL's message when a call did not return ncclSuccess (0)."""
  if result != 0:
    message = load().ncclGetErrorString(result).decode(errors="replace")
    raise DeviceError(f"{call} failed with NCCL error {result}: {message}. NCCL_DEBUG=INFO says more")


def version() -> int:
  """NCCL's version code, e.g. 23203 for 2.32.3."""
  code = ctypes.c_int(0)
  check(load().ncclGetVersion(ctypes.byref(code)), "ncclGetVersion")
  return code.value


def unique_id() -> UniqueId:
  """A new id for one communicator: made by rank 0 and handed to the other ranks (launch.py writes it to a file)."""
  new_id = UniqueId()
  check(load().ncclGetUniqueId(ctypes.byref(new_id)), "ncclGetUniqueId")
  return new_id


def id_to_bytes(shared_id: UniqueId) -> bytes:
  """All 128 bytes of an id (its `internal` field would stop at the first zero byte, as a C string)."""
  return bytes(shared_id)


def id_from_bytes(raw: bytes) -> UniqueId:
  """The id written by id_to_bytes; ValueError unless it is exactly 128 bytes."""
  if len(raw) != UNIQUE_ID_BYTES: raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
  return UniqueId.from_buffer_copy(raw)


def comms_for_devices(ordinals: list[int]) -> list[int]:
  """One communicator per GPU of this process (ncclCommInitAll), in the order of `ordinals`."""
  comms = (ctypes.c_void_p * len(ordinals))()
  devices = (ctypes.c_int * len(ordinals))(*ordinals)
  check(load().ncclCommInitAll(comms, len(ordinals), devices), "ncclCommInitAll")
  return [int(comm) for comm in comms]


def comm_for_rank(world_size: int, rank: int, shared_id: UniqueId) -> int:
  """This process's communicator among `world_size` processes (ncclCommInitRank); the current CUDA context's GPU."""
  comm = ctypes.c_void_p()
  check(load().ncclCommInitRank(ctypes.byref(comm), world_size, shared_id, rank), "ncclCommInitRank")
  return int(comm.value or 0)


def nccl_dtype(dtype: DType) -> int:
  if dtype not in NCCL_DTYPES: raise DeviceError(f"NCCL has no data type for {dtype}")
  return NCCL_DTYPES[dtype]


def nccl_op(op: str) -> int:
  if op not in NCCL_OPS: raise ValueError(f"unknown reduction {op!r}; NCCL reduces with {', '.join(NCCL_OPS)}")
  return NCCL_OPS[op]
