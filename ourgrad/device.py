"""Devices, buffers and the pieces every runtime is made of.

`Device[name]` returns the `Compiled` device of that name, importing `ourgrad.runtime.ops_<name>` on first
use. A Compiled device is an `Allocator` (memory), a `Renderer` (UOps -> source), a `Compiler`
(source -> binary, cached on disk) and a program class (binary -> callable kernel). `Buffer` is a
typed, sized piece of memory on one device, allocated lazily and returned to the allocator's cache
when garbage collected.
"""
from __future__ import annotations

import bisect
import ctypes
import hashlib
import importlib
import os
import pathlib
import tempfile
import threading
import time
import warnings
from typing import Any, Callable

import numpy as np

from ourgrad.dtype import DType, dtypes
from ourgrad.errors import DeviceError, OutOfMemoryError
from ourgrad.shape.symbolic import sym_max
from ourgrad.helpers import (ALLOCATOR_CACHE_BYTES, COMPILE_CACHE_BYTES, DEVICE, DISABLE_COMPILER_CACHE, EnvSnapshot,
                             GlobalCounters, cache_dir, environ_lookup, fmt_size, register_cache_clearer)

# user-facing aliases of device names
DEVICE_ALIASES = {"CPU": "CLANG", "GPU": "OPENCL"}
# what to install when a device cannot be opened
DEVICE_INSTALL_HINTS = {
  "LLVM": "pip install 'ourgrad[llvm]' (llvmlite)",
  "OPENCL": "pip install 'ourgrad[opencl]' (pyopencl with PoCL) or an OpenCL driver",
  "CUDA": "pip install 'ourgrad[cuda]' (cuda-python, nvidia-cuda-nvrtc) and an NVIDIA driver",
  "CLANG": "a C compiler (clang or gcc) on PATH, or set CC",
}
# the preference order when no device is requested (OPENCL only counts when it drives a GPU)
DEFAULT_DEVICE_ORDER = ("CUDA", "OPENCL", "CLANG")


# ---------------------------------------------------------------- memory

class Allocator:
  """Allocates raw device memory. Subclasses implement _alloc/_free/copyin/copyout."""

  def alloc(self, nbytes: int) -> Any:
    """`nbytes` of device memory. When the device is out of memory, the buffers this allocator keeps for reuse are
    given back to it and the allocation is tried once more; OutOfMemoryError if that fails too."""
    try:
      return self._alloc(nbytes)
    except MemoryError:
      cached = self.cached_bytes()
      self.free_cache()
      try:
        return self._alloc(nbytes)
      except MemoryError as error:
        raise OutOfMemoryError(
          f"cannot allocate {nbytes} bytes ({fmt_size(nbytes)}) on {type(self).__name__}: {GlobalCounters.mem_used} "
          f"bytes ({fmt_size(GlobalCounters.mem_used)}) are in use by ourgrad buffers and the {cached} cached bytes "
          f"were already freed ({error}). Free tensors you no longer need (del t), or use smaller batches or "
          f"smaller dtypes") from error

  def free(self, handle: Any, nbytes: int) -> None: self._free(handle, nbytes)

  def alloc_counted(self, nbytes: int) -> Any:
    """alloc(nbytes or 1) for a buffer of `nbytes`, counted in GlobalCounters.mem_used (Buffer's own memory)."""
    with MEMORY_LOCK:
      handle = self.alloc(nbytes or 1)
      GlobalCounters.mem_used += nbytes
    return handle

  def free_counted(self, handle: Any, nbytes: int) -> None:
    """free(handle, nbytes or 1) of a buffer of `nbytes` whose memory alloc_counted gave (Buffer.__del__)."""
    with MEMORY_LOCK:
      GlobalCounters.mem_used -= nbytes
      self.free(handle, nbytes or 1)
  # host allocators: id(handle) -> (handle, its address as a ctypes pointer) for the memory they made (HostAllocator)
  pointers: dict[int, tuple[Any, Any]] | None = None
  # whether buffers may run on a part of another buffer's memory (the memory planner's sharing)
  shares_memory: bool = False
  def shared_handle(self, handle: Any, nbytes: int) -> Any:
    """The first `nbytes` of the memory behind `handle`, as a handle of its own (the handle itself by default)."""
    return handle
  # whether `offset_handle` names memory inside another buffer's (BufferView)
  views_memory: bool = False
  def offset_handle(self, handle: Any, offset: int, nbytes: int) -> Any:
    """`nbytes` of the memory behind `handle` from byte `offset`, as a handle of its own (where views_memory)."""
    raise NotImplementedError(f"{type(self).__name__} has no views into its buffers")
  def free_cache(self) -> None: pass
  def device_memory_bytes(self) -> int:
    """The device's memory in bytes, where the device says (0: unknown)."""
    return 0
  def cached_bytes(self) -> int:
    """Bytes held for reuse (freed by free_cache)."""
    return 0
  def _alloc(self, nbytes: int) -> Any: raise NotImplementedError
  def _free(self, handle: Any, nbytes: int) -> None: pass
  def copyin(self, dest: Any, src: memoryview) -> None: raise NotImplementedError
  def copyout(self, dest: memoryview, src: Any) -> None: raise NotImplementedError
  def copyout_later(self, src: Any, nbytes: int) -> Callable[[memoryview], None] | None:
    """Queue a copy of the first `nbytes` of `src` to the host behind the work queued so far, without waiting;
    returns the function that waits for that copy alone and writes the bytes into its argument. None where the
    device has no such copy (the caller then reads synchronously)."""
    return None
  # whether copyout itself waits for the device's queued work (a copy queued behind it, then waited for): Buffer.copyout
  # then skips its own synchronize, one wait for the device a read instead of two
  copyout_waits: bool = False


# Buffers are allocated, filled, read and freed from any thread (a data-loading thread, or the garbage collector
# running a Buffer's __del__ in whichever thread drops the last reference): the allocators' caches, their staging
# buffers (copyin/copyout) and the byte counter are used under this lock. Re-entrant, because a __del__ can run
# inside a locked section of the same thread.
MEMORY_LOCK = threading.RLock()


# read at every free (an EnvSnapshot: one dict lookup where the variable's `value` costs a few calls)
_CACHE_LIMIT = EnvSnapshot(ALLOCATOR_CACHE_BYTES)
_CACHE_LIMIT_KEY = os.fsencode(ALLOCATOR_CACHE_BYTES.name)


class LRUAllocator(Allocator):
  """Keeps freed buffers by size and hands them out again instead of asking the device each time. At most
  `ALLOCATOR_CACHE_BYTES` bytes are kept; a freed buffer that would pass the bound goes back to the device.

  The buffers of one size are kept in a stable order (by the identity of their handles) and handed out from one end:
  which buffer an allocation gets depends on the set of cached buffers, not on the order they were freed in. A repeated
  eager step allocates and frees in the same order every time, so from its second run on each of its buffers gets the
  very memory it got the step before (a replayed device graph then needs no argument updated: engine/capture.py). A
  most-recently-freed order would hand the same memory to other buffers each step (a permutation that cycles)."""

  shares_memory = True

  def __init__(self) -> None:
    self.cache: dict[int, list[Any]] = {}
    self.cached_total = 0
    self._limit: tuple[Any, int] | None = None   # (ALLOCATOR_CACHE_BYTES's raw text, cache_limit's answer for it)

  def alloc(self, nbytes: int) -> Any:
    with MEMORY_LOCK:
      handles = self.cache.get(nbytes)
      if handles:
        self.cached_total -= nbytes
        return handles.pop()
      return super().alloc(nbytes)

  # (alloc_counted and free_counted written out: every eager realize allocates its outputs, and every dropped result
  # comes back here, from a buffer's __del__; the general versions take the lock twice and make two more calls)
  def alloc_counted(self, nbytes: int) -> Any:
    with MEMORY_LOCK:
      handles = self.cache.get(nbytes or 1)
      if handles:
        self.cached_total -= nbytes or 1
        handle = handles.pop()
      else: handle = Allocator.alloc(self, nbytes or 1)
      GlobalCounters.mem_used += nbytes
    return handle

  def free_counted(self, handle: Any, nbytes: int) -> None:
    with MEMORY_LOCK:
      GlobalCounters.mem_used -= nbytes
      self._keep(handle, nbytes or 1)

  def cache_limit(self) -> int:
    """The most bytes kept (-1: no limit): ALLOCATOR_CACHE_BYTES, by default (-2) a quarter of the device's memory and
    at least 2 GiB. A fixed 2 GiB on an H200 gave an 824 MB GPT-2 logits buffer back to the device every eager step,
    and cuMemFree waits for the device: the step's Python stalled until its kernels had run (6.7 ms a step)."""
    # (asked at every free: the answer is kept for the variable's raw text, the same object while it is not set again)
    raw = environ_lookup(_CACHE_LIMIT_KEY)
    known = self._limit
    if known is not None and known[0] is raw: return known[1]
    limit = int(_CACHE_LIMIT.values()[0])
    limit = limit if limit != -2 else max(2 << 30, self.device_memory_bytes() // 4)
    self._limit = (raw, limit)
    return limit

  def free(self, handle: Any, nbytes: int) -> None:
    with MEMORY_LOCK: self._keep(handle, nbytes)

  def _keep(self, handle: Any, nbytes: int) -> None:
    """Keep freed memory for reuse, or give it back to the device past the bound (under MEMORY_LOCK)."""
    # (cache_limit's kept answer read here: every buffer freed asks)
    known = self._limit
    limit = known[1] if known is not None and known[0] is environ_lookup(_CACHE_LIMIT_KEY) else self.cache_limit()
    if limit >= 0 and self.cached_total + nbytes > limit:
      self._free(handle, nbytes)
      return
    handles = self.cache.get(nbytes)
    if not handles: self.cache[nbytes] = [handle]
    else: bisect.insort(handles, handle, key=id)   # (handles are kept alive here: no id is reused meanwhile)
    self.cached_total += nbytes

  def free_cache(self) -> None:
    with MEMORY_LOCK:
      for nbytes, handles in self.cache.items():
        for handle in handles: self._free(handle, nbytes)
      self.cache.clear()
      self.cached_total = 0

  def cached_bytes(self) -> int: return self.cached_total


def host_l2_cache_bytes() -> int:
  """The L2 cache of one core of this machine in bytes (the CPU devices' cache blocks are sized by it), from the C
  library or Linux's sysfs; 0 where neither says."""
  try:
    size = os.sysconf("SC_LEVEL2_CACHE_SIZE")
    if size > 0: return size
  except (ValueError, OSError, AttributeError):
    pass
  try:
    text = pathlib.Path("/sys/devices/system/cpu/cpu0/cache/index2/size").read_text().strip()
  except OSError:
    return 0
  scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
  return int(text.rstrip("KM")) * scale if text.rstrip("KM").isdigit() else 0


class HostAllocator(LRUAllocator):
  """Host memory as numpy byte arrays (uninitialized, 64-byte aligned for vector loads). The address of each array it
  made is kept as a ctypes pointer while the array is in use or cached (`pointer`): host kernels take it as their
  argument, and `array.ctypes.data` costs microseconds per call, which a new Buffer on reused memory would otherwise
  pay at every eager step."""

  def __init__(self) -> None:
    super().__init__()
    # id(array) -> (the array, its address): the array is kept, so no id is reused while its entry lives
    self.pointers: dict[int, tuple[np.ndarray, ctypes.c_void_p]] = {}

  def _alloc(self, nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + 64, dtype=np.uint8)
    start = (-raw.ctypes.data) % 64
    array = raw[start:start + nbytes]
    self.pointers[id(array)] = (array, ctypes.c_void_p(array.ctypes.data))
    return array

  def _free(self, handle: np.ndarray, nbytes: int) -> None: self.pointers.pop(id(handle), None)

  def pointer(self, handle: np.ndarray) -> ctypes.c_void_p:
    """The address of a host array as a ctypes pointer: remembered for the arrays this allocator made."""
    entry = self.pointers.get(id(handle))
    if entry is not None and entry[0] is handle: return entry[1]
    return ctypes.c_void_p(handle.ctypes.data)

  def shared_handle(self, handle: np.ndarray, nbytes: int) -> np.ndarray: return handle[:nbytes]
  views_memory = True
  def offset_handle(self, handle: np.ndarray, offset: int, nbytes: int) -> np.ndarray:
    return handle[offset:offset + nbytes]

  def copyin(self, dest: np.ndarray, src: memoryview) -> None:
    dest[:] = np.frombuffer(src, dtype=np.uint8)

  def copyout(self, dest: memoryview, src: np.ndarray) -> None:
    np.frombuffer(dest, dtype=np.uint8)[:] = src


class Buffer:
  """`size` elements of `dtype` on `device`. Memory is taken on first use (`allocate`)."""
  # its device's allocator, once allocate took memory from it (or the replay that made it named it: new_buffer): where
  # allocate takes memory and __del__ gives it back without looking the device up again (None: not known yet, or
  # memory set by a subclass)
  _allocator: Allocator | None = None

  def __init__(self, device: str, size: int, dtype: DType):
    # a symbolic size (a shape with a bound Variable) gets memory for the Variable's largest value
    self.device, self.size, self.dtype = device, size if type(size) is int else sym_max(size), dtype
    self._handle: Any = None
    self._backing: Buffer | None = None  # set when the memory planner makes this buffer use another's memory
    self._pointer: ctypes.c_void_p | None = None  # host devices: the memory's address, made once (host_pointer)

  @property
  def nbytes(self) -> int: return self.size * self.dtype.itemsize

  @property
  def is_allocated(self) -> bool: return self._handle is not None

  @property
  def handle(self) -> Any:
    if self._handle is None: self.allocate()
    return self._handle

  def allocate(self) -> Buffer:
    with MEMORY_LOCK:
      if self._handle is None:
        allocator = self._allocator
        if allocator is None: allocator = self._allocator = Device[self.device].allocator
        handle = self._handle = allocator.alloc_counted(self.size * self.dtype.itemsize)
        # a host array's address, remembered by its allocator (HostAllocator.pointers): what host kernels take
        pointers = allocator.pointers
        if pointers is not None:
          entry = pointers.get(id(handle))
          if entry is not None and entry[0] is handle: self._pointer = entry[1]
    return self

  def release_memory(self) -> None:
    """Give up the memory this buffer runs on (its contents are dropped): its own goes back to its allocator, a
    backing buffer's share is let go. The next use allocates again (or the memory planner gives it a backing)."""
    with MEMORY_LOCK:
      if self._handle is not None and self._backing is None:
        GlobalCounters.mem_used -= self.nbytes
        Device[self.device].allocator.free(self._handle, max(self.nbytes, 1))
      self._handle, self._backing, self._pointer = None, None, None

  def use_memory_of(self, backing: Buffer) -> None:
    """Run on the first bytes of `backing`'s memory from now on (the memory planner gives buffers whose lifetimes
    do not overlap one backing buffer). Memory this buffer held before goes back to its allocator."""
    # (sizes and the allocator read once: a replayed memory plan runs this for every internal buffer of a step)
    nbytes = self.size * self.dtype.itemsize
    if backing.device != self.device or backing.size * backing.dtype.itemsize < nbytes:
      raise ValueError(f"{self!r} cannot use the memory of {backing!r}")
    allocator = self._allocator
    if allocator is None: allocator = Device[self.device].allocator
    with MEMORY_LOCK:
      if self._handle is not None and self._backing is None:
        GlobalCounters.mem_used -= nbytes
        allocator.free(self._handle, nbytes or 1)
      handle = backing._handle
      if handle is None: handle = backing.allocate()._handle
      self._handle = allocator.shared_handle(handle, nbytes or 1)
      self._backing = backing
      # (a host buffer's address is its backing's, where that is known: host kernels take it without a call)
      self._pointer = backing._pointer

  def host_pointer(self) -> ctypes.c_void_p:
    """The address of a host buffer's memory (a numpy array) as a ctypes pointer, made once: kernels of host devices
    take it as their argument, and `array.ctypes.data` costs microseconds per call."""
    if self._pointer is None:
      if self._handle is None: self.allocate()   # (which remembers the address of host allocators' memory)
      # a planned buffer runs on the first bytes of its backing's memory: the same address
      if self._pointer is not None: pass
      elif self._backing is not None: self._pointer = self._backing.host_pointer()
      else:
        allocator = Device[self.device].allocator
        self._pointer = allocator.pointer(self._handle) if isinstance(allocator, HostAllocator) else \
          ctypes.c_void_p(self._handle.ctypes.data)
    return self._pointer

  def __del__(self) -> None:
    handle = getattr(self, "_handle", None)
    if handle is None or self._backing is not None: return   # (_backing is set before _handle ever is)
    try:
      allocator = self._allocator
      (allocator if allocator is not None else Device[self.device].allocator).free_counted(
        handle, self.size * self.dtype.itemsize)
    except Exception:  # interpreter shutdown: the device module (or the lock) may be gone already
      pass

  def copyin(self, data: memoryview) -> Buffer:
    if data.nbytes != self.nbytes:
      raise ValueError(f"copyin of {data.nbytes} bytes into a buffer of {self.nbytes} bytes")
    # under the lock: a GPU allocator copies through one shared host staging buffer
    if self.nbytes:
      with MEMORY_LOCK: Device[self.device].allocator.copyin(self.handle, data)
    return self

  def copyout(self, dest: memoryview) -> memoryview:
    if self.nbytes:
      with MEMORY_LOCK:
        device = Device[self.device]
        if not device.allocator.copyout_waits: device.synchronize()
        device.allocator.copyout(dest, self.handle)
    return dest

  def read_later(self) -> PendingRead:
    """The contents as they will be once the work queued so far has run, read without waiting for work queued after
    this call (a device with queued copies: CUDA): queue the next step, then read this one's result while it runs.
    Other devices read at once."""
    values = self._host_array()
    finish = None
    if self.nbytes:
      with MEMORY_LOCK: finish = Device[self.device].allocator.copyout_later(self.handle, self.nbytes)
      if finish is None: self.copyout(memoryview(values).cast("B"))
    return PendingRead(values, finish)

  def as_bytes(self) -> bytearray:
    data = bytearray(self.nbytes)
    self.copyout(memoryview(data))
    return data

  def numpy(self) -> np.ndarray:
    """The contents as a new numpy array (bfloat16 comes back as its raw uint16 bits)."""
    values = self._host_array()
    self.copyout(memoryview(values).cast("B"))
    return values

  def _host_array(self) -> np.ndarray:
    """An empty host array this buffer's contents fit (bfloat16 as raw uint16 bits)."""
    return np.empty(self.size, np.uint16 if self.dtype == dtypes.bfloat16 else self.dtype.np)

  def __repr__(self) -> str: return f"<Buffer {self.device} {self.size} {self.dtype}>"


def new_buffer(allocator: Allocator, device: str, size: int, dtype: DType) -> Buffer:
  """Buffer(device, size, dtype) with its device's allocator named (`allocator`, Device[device]'s): allocate takes its
  memory there without looking the device up. A replayed schedule (engine/schedule_cache.py) makes one for each
  buffer it realizes, with the allocators it looked up once. (Made by the constructor: an object whose __dict__ is
  set whole costs twice as much to make and more at each attribute read, Python 3.11.)"""
  buffer = Buffer(device, size, dtype)
  buffer._allocator = allocator
  return buffer


def allocated_buffer(allocator: Allocator, device: str, size: int, dtype: DType) -> Buffer:
  """new_buffer(...).allocate() in one step: its memory from `allocator` (Device[device]'s) in one locked call, the
  counting included, where allocate would take the lock twice. The schedule cache's one-kernel replays
  (engine/schedule_cache.py _launch_replay) make one for each buffer they realize, at every small eager realize."""
  buffer = Buffer(device, size, dtype)
  handle = buffer._handle = allocator.alloc_counted(size * dtype.itemsize)
  buffer._allocator = allocator
  pointers = allocator.pointers
  if pointers is not None:   # (a host array's address, as allocate remembers it)
    entry = pointers.get(id(handle))
    if entry is not None and entry[0] is handle: buffer._pointer = entry[1]
  return buffer


class PendingRead:
  """A buffer's contents on their way to the host (`Buffer.read_later`): `numpy()` waits for that copy only."""

  def __init__(self, values: np.ndarray, finish: Callable[[memoryview], None] | None):
    self._values, self._finish = values, finish

  def numpy(self) -> np.ndarray:
    """The values (bfloat16 as its raw uint16 bits), waiting for the copy the first time."""
    if self._finish is not None:
      finish, self._finish = self._finish, None
      with MEMORY_LOCK: finish(memoryview(self._values).cast("B"))
    return self._values


class BufferView(Buffer):
  """`size` elements of `base`'s memory from element `offset`, no memory of its own (tinygrad's buffer view): what
  reads one contiguous run of a bigger realized buffer (Tensor.numpy() of a slice, or of the fused attention's O
  beside its logsumexp) copies out, with no kernel copying the run first. Only where the device's allocator names
  memory inside a buffer (`Allocator.views_memory`); it reads `base` as it is when used, so it is made for one read
  and dropped (it never outlives a write it should not see)."""

  def __init__(self, base: Buffer, offset: int, size: int):
    if offset < 0 or offset + size > base.size: raise ValueError(f"elements {offset}..{offset + size} of {base!r}")
    super().__init__(base.device, size, base.dtype)
    self.base, self.byte_offset = base, offset * base.dtype.itemsize
    self._backing = base   # (its memory is base's: never given back to the allocator, never counted as used)

  def allocate(self) -> BufferView:
    with MEMORY_LOCK:
      if self._handle is None:
        self._handle = Device[self.device].allocator.offset_handle(self.base.handle, self.byte_offset,
                                                                   max(self.nbytes, 1))
        self._backing = self.base
    return self

  def release_memory(self) -> None: self._handle, self._pointer = None, None

  def use_memory_of(self, backing: Buffer) -> None:
    raise ValueError(f"{self!r} is a view of another buffer's memory: it cannot be given other memory")

  def host_pointer(self) -> ctypes.c_void_p:
    if self._pointer is None: self._pointer = ctypes.c_void_p(self.base.host_pointer().value + self.byte_offset)
    return self._pointer


# ---------------------------------------------------------------- compilers

# A cache entry is this header, the sha256 of the binary, then the binary. The digest catches a truncated or
# overwritten entry before a loader sees it: dlopen of a truncated shared object can kill the process with SIGBUS.
CACHE_ENTRY_MAGIC = b"ourgrad compiled binary v1\n"


class Compiler:
  """Turns kernel source into a binary, caching the result on disk by a hash of (compiler, source)."""
  cache_key: str = "compiler"
  # compile() may run in several threads at once and spends its time outside the GIL (a compiler subprocess), so a
  # schedule's new kernels can compile side by side (engine/compile_ahead.py)
  concurrent_compiles: bool = False

  def compile(self, source: str) -> bytes: raise NotImplementedError

  def disassemble(self, source: str) -> str:
    """The device assembly of a kernel's source (what DEBUG=6 prints); a note where the toolchain gives none."""
    return f"; DEBUG=6: {type(self).__name__} has no disassembler; DEBUG=4 shows the source"

  def cache_path(self, source: str) -> pathlib.Path:
    digest = hashlib.sha256(CACHE_ENTRY_MAGIC + f"{self.cache_key}\n{source}".encode()).hexdigest()
    return cache_dir() / "compile" / digest[:2] / digest

  def load_cached(self, source: str) -> bytes | None:
    """The cached binary of `source`, or None: not cached, or the cache is off. A damaged entry is deleted with a
    warning and reads as not cached."""
    if DISABLE_COMPILER_CACHE: return None
    try:
      path = self.cache_path(source)
      entry = path.read_bytes()
      os.utime(path)  # a used entry is recent: the size bound deletes the least recently used ones first
    except OSError:  # not cached, or no cache folder can be made (read-only home): compile
      return None
    header_size = len(CACHE_ENTRY_MAGIC) + 32
    binary = entry[header_size:]
    if entry[:len(CACHE_ENTRY_MAGIC)] == CACHE_ENTRY_MAGIC and entry[len(CACHE_ENTRY_MAGIC):header_size] == \
        hashlib.sha256(binary).digest():
      return binary
    warnings.warn(f"compile cache entry {path} is damaged (truncated or overwritten); deleted, the kernel is "
                  f"recompiled", RuntimeWarning, stacklevel=2)
    self.evict(source)
    return None

  def evict(self, source: str) -> None:
    """Delete the cache entry of `source` if there is one."""
    try:
      self.cache_path(source).unlink()
    except OSError:  # already gone (another process evicted it), or the folder cannot be written
      pass

  def compile_cached(self, source: str, refresh: bool = False) -> bytes:
    """The binary of `source`: from the disk cache, else compiled and cached. refresh=True skips the cached binary
    (one the device could not load) and overwrites it."""
    binary = None if refresh else self.load_cached(source)
    if binary is not None: return binary
    binary = self.compile(source)
    self.store_cached(source, binary)
    return binary

  def store_cached(self, source: str, binary: bytes) -> None:
    """Write `binary` into the disk cache as the entry of `source` (nothing with DISABLE_COMPILER_CACHE=1)."""
    # concurrent writers of one entry each rename a complete file into place: readers see one whole entry
    if not DISABLE_COMPILER_CACHE:
      try:
        entry = CACHE_ENTRY_MAGIC + hashlib.sha256(binary).digest() + binary
        write_atomic(self.cache_path(source), entry, durable=False)
        _count_cache_write(len(entry))
      except OSError as error:  # a full disk or a read-only cache folder costs recompiles, not the result
        warnings.warn(f"cannot write the compile cache ({type(error).__name__}: {error.strerror}); kernels are "
                      f"compiled again in each process. "
                      f"Set OURGRAD_CACHE_DIR to a writable folder, or DISABLE_COMPILER_CACHE=1", RuntimeWarning,
                      stacklevel=3)


# When a process checks the size bound: at its PRUNE_EVERY_WRITES-th write (a bound lowered since the last run applies
# soon), then each time it has written another 1/PRUNE_BOUND_FRACTION of the bound (so it overshoots the bound by at
# most that much). A check walks the whole cache folder (~12 us an entry on a 2-core EPYC); checking every 64 writes
# made that quadratic: CI's run fills one cache with ~31k entries, and each test worker walked 10-30k of them every
# 64 of its ~14k writes (~70 CPU-s of the run).
PRUNE_EVERY_WRITES = 64
PRUNE_BOUND_FRACTION = 16
_cache_writes = 0
_bytes_since_check = 0


def _count_cache_write(entry_bytes: int) -> None:
  global _cache_writes, _bytes_since_check
  _cache_writes += 1
  _bytes_since_check += entry_bytes
  limit = int(COMPILE_CACHE_BYTES.value)
  if limit < 0: return
  if _cache_writes == PRUNE_EVERY_WRITES or _bytes_since_check * PRUNE_BOUND_FRACTION > limit:
    _bytes_since_check = 0
    prune_compile_cache(limit)


def prune_compile_cache(max_bytes: int | None = None) -> int:
  """Delete the least recently used compiled binaries until the on-disk cache holds at most `max_bytes` (default
  COMPILE_CACHE_BYTES; 0 empties it, -1 keeps everything). Returns the bytes deleted. Safe beside other processes:
  an entry deleted under a reader is recompiled."""
  limit = int(COMPILE_CACHE_BYTES.value) if max_bytes is None else max_bytes
  if limit < 0: return 0
  entries = []
  for path in (cache_dir() / "compile").glob("*/*"):
    try:
      stat = path.stat()
    except OSError:  # deleted by another process meanwhile
      continue
    entries.append((stat.st_mtime, stat.st_size, path))
  total, deleted = sum(size for _, size, _ in entries), 0
  for _, size, path in sorted(entries):  # oldest use first
    if total - deleted <= limit: break
    try:
      path.unlink()
      deleted += size
    except OSError:
      pass
  return deleted


def write_atomic(path: pathlib.Path, data: bytes, durable: bool = True) -> None:
  """Write to a temporary file beside `path`, then rename: readers see the old file or the whole new one.
  durable=True also waits until the bytes are on the disk before the rename (a checkpoint survives a power loss);
  the compile cache skips that wait (milliseconds on a busy disk, on the path of every new kernel), because its
  entries carry a digest that catches one cut short by a crash."""
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
  try:
    with os.fdopen(fd, "wb") as tmp_file:
      tmp_file.write(data)
      if durable:
        tmp_file.flush()
        os.fsync(tmp_file.fileno())  # the bytes reach the disk before the rename makes them the file
    os.replace(tmp_name, path)
  except BaseException:
    if os.path.exists(tmp_name): os.unlink(tmp_name)
    raise


# ---------------------------------------------------------------- host programs

class HostProgram:
  """A kernel compiled to machine code for this CPU (CLANG, LLVM): `self.function` is a ctypes function that takes
  one pointer per buffer; it runs synchronously on the calling thread."""
  function: Callable[..., None]

  def __call__(self, *buffers: np.ndarray, global_size: tuple[int, ...] = (), local_size: tuple[int, ...] = (),
               wait: bool = False, vals: tuple[int, ...] = ()) -> float | None:
    start = time.perf_counter()
    # vals: the symbolic Variables' values, int arguments after the buffers (ctypes passes a Python int as C int)
    self.function(*[ctypes.c_void_p(buffer.ctypes.data) for buffer in buffers], *vals)
    return time.perf_counter() - start if wait else None


# ---------------------------------------------------------------- devices

class Compiled:
  """A device that runs generated kernels: allocator + renderer + compiler + program class."""

  def __init__(self, name: str, allocator: Allocator, renderer: Any, compiler: Compiler,
               program: Callable[[str, bytes], Any]):
    self.name, self.allocator, self.renderer, self.compiler, self.program = name, allocator, renderer, compiler, program

  def synchronize(self) -> None:
    """Wait until every launched kernel finished (host devices run synchronously)."""


_OPEN_LOCK = threading.RLock()  # re-entrant: opening "CLANG:1" opens "CLANG" first (_share_codegen)
_CANONICAL_NAMES: dict[str, str] = {}   # device name as written -> canonical name (see canonicalize)


class _DeviceRegistry:
  """`Device["CLANG"]` opens (once) and returns a device; `Device.DEFAULT` is the default's name."""

  def __init__(self) -> None:
    self._opened: dict[str, Compiled] = {}
    self._best: str | None = None

  @staticmethod
  def canonicalize(name: str) -> str:
    """The registry's name of a device: upper case, aliases resolved. An index after ":" names one of several
    devices of a kind ("CUDA:1", "CLANG:1"); index 0 is the bare name ("cuda:0" -> "CUDA"). Any other argument is
    dropped, except for DISK, whose argument is its file: "disk:weights.bin" -> "DISK:/abs/path/weights.bin"."""
    # every tensor op and Device[...] lookup canonicalizes its device: names seen before are answered from a dict
    known = _CANONICAL_NAMES.get(name)
    if known is not None: return known
    base, _, argument = name.partition(":")
    base = base.upper()
    # the path is made absolute so that two spellings of one file are one device (one mapping); not remembered, since
    # a relative path depends on the working folder
    if base == "DISK" and argument: return f"DISK:{os.path.abspath(os.path.expanduser(argument))}"
    base = DEVICE_ALIASES.get(base, base)
    canonical = f"{base}:{int(argument)}" if argument.strip().isdigit() and int(argument) > 0 else base
    if len(_CANONICAL_NAMES) < 1024: _CANONICAL_NAMES[name] = canonical  # bounded: names are few in practice
    return canonical

  @staticmethod
  def device_index(name: str) -> int:
    """The index of a canonical device name: 1 for "CUDA:1", 0 for "CUDA" (and for DISK files)."""
    base, _, argument = name.partition(":")
    return int(argument) if argument.isdigit() else 0

  def __getitem__(self, name: str) -> Compiled:
    opened = self._opened.get(name)   # a canonical name of an opened device (every Buffer's): one dict lookup
    if opened is not None: return opened
    name = self.canonicalize(name)
    if name not in self._opened:
      with _OPEN_LOCK:  # two threads' first use of a device opens it once
        if name not in self._opened: self._opened[name] = self._open(name)
    return self._opened[name]

  def free_allocator_caches(self) -> None:
    """Give the freed buffers every opened device keeps for reuse back to the device."""
    for device in list(self._opened.values()): device.allocator.free_cache()

  def _open(self, name: str) -> Compiled:
    try:
      module = importlib.import_module(f"ourgrad.runtime.ops_{name.partition(':')[0].lower()}")
    except ModuleNotFoundError as error:
      if error.name and error.name.startswith("ourgrad.runtime"):
        raise DeviceError(f"unknown device {name!r}; available: {', '.join(self.available_names())}") from None
      raise DeviceError(f"device {name} needs a package that is missing ({error.name}): "
                        f"{DEVICE_INSTALL_HINTS.get(name, 'see docs/backends.md')}") from error
    try:
      device = module.create_device(name)
    except DeviceError:
      raise
    except Exception as error:
      raise DeviceError(f"cannot open device {name}: {error}. "
                        f"Needs {DEVICE_INSTALL_HINTS.get(name, 'see docs/backends.md')}") from error
    if self.device_index(name) > 0: self._share_codegen(device, name.partition(":")[0])
    return device

  def _share_codegen(self, device: Compiled, first_name: str) -> None:
    """Device N of a kind keeps its own allocator (its own memory) but uses the renderer and compiler of device 0
    when they compile for the same target, so a kernel is rendered and compiled once for all of them."""
    first = self[first_name]
    if getattr(first.compiler, "cache_key", None) == getattr(device.compiler, "cache_key", None) and \
        type(first.renderer) is type(device.renderer):
      device.renderer, device.compiler = first.renderer, first.compiler

  @staticmethod
  def available_names() -> list[str]:
    """Device names that have a runtime module (whether or not they can be opened here)."""
    runtime_dir = pathlib.Path(__file__).parent / "runtime"
    return sorted(path.stem[len("ops_"):].upper() for path in runtime_dir.glob("ops_*.py"))

  @property
  def DEFAULT(self) -> str:  # noqa: N802 (reads as a constant, as in tinygrad)
    if DEVICE.value: return self.canonicalize(DEVICE.value)
    for name in self.available_names():  # NAME=1 selects a device too
      if os.environ.get(name, "") not in ("", "0"): return name
    if self._best is None: self._best = self._best_present()  # probing drivers is slow: once per process
    return self._best

  def _best_present(self) -> str:
    for name in DEFAULT_DEVICE_ORDER:
      try:
        device = self[name]
      except DeviceError:
        continue
      if getattr(device, "is_gpu", True): return name  # OpenCL on a CPU (PoCL) is slower than CLANG
    return "CLANG"


Device = _DeviceRegistry()
register_cache_clearer(Device.free_allocator_caches)
