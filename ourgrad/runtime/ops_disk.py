"""The DISK device: a file as a device, memory-mapped, so a tensor can be a window of a weights file.

`Device["DISK:/path/to/file"]` is one device per file (the path is made absolute by `Device.canonicalize`).
Its buffers are windows, (byte offset, byte count), of that file: making one reads nothing, and copying one to
another device reads only its bytes, straight from the mapping into the destination (`as_memoryview`, used by
the engine's copy). This is what safetensors loading is built on (`ourgrad.nn.state.safe_load`).

DISK runs no kernels: it has no renderer or compiler, and asking for either raises a DeviceError telling the
user to `.to()` another device first. Movement ops on a DISK tensor are views as everywhere; `.to(device)` of a
view copies the file's byte range under it (see `LazyBuffer.copy_to_device`).

Reading maps the file read-only (`mmap.ACCESS_READ`, shared, so it sees later writes to the file). Writing (a copy
*to* a DISK buffer, e.g. `Tensor(data).to("DISK:/f")`) goes through an ordinary file write that creates or grows
the file. A window reads the file it first mapped: a file replaced by another (a rename over it, as safe_save
does) keeps its old contents for the windows made before, and new windows map the new file. A mapping lives as
long as some window holds it, so a file that no tensor uses any more is unmapped and its descriptor closed.
"""
from __future__ import annotations

import mmap
import os
import weakref
from typing import Any, NoReturn

import numpy as np

from ourgrad.device import Allocator, Buffer, Compiled, Device
from ourgrad.dtype import DType
from ourgrad.errors import DeviceError


class _Mapping:
  """One read-only mapping of the whole file, tagged with the file it maps ((st_dev, st_ino)).
  (A wrapper because mmap objects cannot be weakly referenced.)"""
  __slots__ = ("data", "identity", "__weakref__")

  def __init__(self, data: mmap.mmap | bytes, identity: tuple[int, int]):
    self.data, self.identity = data, identity

  def __len__(self) -> int: return len(self.data)


class DiskWindow:
  """`nbytes` bytes of the device's file from byte `offset`. The mapping it reads is taken on first read (or
  given by the window it was cut from) and then kept, so the window keeps reading the same file."""

  def __init__(self, device: DiskDevice, offset: int, nbytes: int, mapping: _Mapping | None = None):
    if offset < 0 or nbytes < 0: raise DeviceError(f"{device.name}: bad window of {nbytes} bytes at byte {offset}")
    self.device, self.offset, self.nbytes, self.mapping = device, offset, nbytes, mapping

  def pin(self) -> DiskWindow:
    """Map the file now (checking that it covers the window) instead of on first read."""
    if self.mapping is None and self.nbytes: self.mapping = self.device.mapping(self.offset + self.nbytes)
    return self

  def memoryview(self) -> memoryview:
    """The window's bytes, read-only, in place in the mapping (no copy; pages are read as they are touched)."""
    if not self.nbytes: return memoryview(b"")
    if self.mapping is None or len(self.mapping) < self.offset + self.nbytes:
      # a window written before it was read may lie past the end of the file as it was first mapped
      self.mapping = self.device.mapping(self.offset + self.nbytes)
    return memoryview(self.mapping.data)[self.offset:self.offset + self.nbytes]

  def sub(self, offset: int, nbytes: int) -> DiskWindow:
    """The window of `nbytes` bytes at `offset` inside this one (reading the same mapping)."""
    if offset + nbytes > self.nbytes:
      raise DeviceError(f"{self.device.name}: bytes [{offset}, {offset + nbytes}) lie outside a window of "
                        f"{self.nbytes} bytes")
    return DiskWindow(self.device, self.offset + offset, nbytes, self.mapping)

  def __repr__(self) -> str: return f"<DiskWindow {self.device.path} [{self.offset}, {self.offset + self.nbytes})>"


class DiskAllocator(Allocator):
  """Hands out windows of the file. A plain `alloc` is the window at byte 0 (a buffer that *is* the file, as
  `Tensor.empty(..., device="DISK:/f")` or a copy to DISK makes); `window` cuts one at any offset."""

  def __init__(self, device: DiskDevice):
    self.device = device

  def _alloc(self, nbytes: int) -> DiskWindow: return DiskWindow(self.device, 0, nbytes)

  def window(self, offset: int, nbytes: int) -> DiskWindow: return DiskWindow(self.device, offset, nbytes)

  def as_memoryview(self, handle: DiskWindow) -> memoryview:
    """The window's bytes in place in the mapping: a copy out of DISK reads from here with no staging copy."""
    return handle.memoryview()

  def copyout(self, dest: memoryview, src: DiskWindow) -> None:
    np.frombuffer(dest, dtype=np.uint8)[:] = np.frombuffer(src.memoryview(), dtype=np.uint8)

  def copyin(self, dest: DiskWindow, src: memoryview) -> None:
    self.device.write(dest.offset, src)


class DiskDevice(Compiled):
  """The file at `path` as a device: an allocator of windows of it, and nothing to run kernels with."""

  def __init__(self, name: str):
    # Compiled.__init__ is not called: a DISK device has an allocator only, and `renderer`, `compiler` and
    # `program` are properties that raise, so the first kernel scheduled on DISK fails with a clear message
    self.name, self.path = name, name.partition(":")[2]
    self.allocator = DiskAllocator(self)
    self._current: weakref.ref[_Mapping] | None = None  # the latest mapping, while some window holds it

  def _no_kernels(self) -> NoReturn:
    raise DeviceError(f"DISK tensors can only be copied to another device: use .to('CLANG') (or another device) "
                      f"before computing with a tensor of {self.name}")

  @property
  def renderer(self) -> Any: self._no_kernels()

  @property
  def compiler(self) -> Any: self._no_kernels()

  @property
  def program(self) -> Any: self._no_kernels()

  def mapping(self, end: int) -> _Mapping:
    """A read-only mapping of the file covering bytes [0, end): the current one if it still maps this file, whole,
    and far enough; else a new one of the file as it is now. DeviceError if the file is missing or too short."""
    current = self._current() if self._current is not None else None
    try:
      stat = os.stat(self.path)
    except OSError as error:
      raise DeviceError(f"{self.name}: cannot open the file: {error.strerror or error}") from None
    if current is not None and current.identity == (stat.st_dev, stat.st_ino) and end <= len(current) <= stat.st_size:
      return current
    try:
      with open(self.path, "rb") as file:
        stat = os.fstat(file.fileno())  # the file actually opened, should it have been replaced since os.stat
        if stat.st_size < end:
          raise DeviceError(f"{self.name}: the file has {stat.st_size} bytes, but a tensor needs bytes up to {end} "
                            f"(truncated file, or a wrong offset or shape)")
        # mmap cannot map an empty file; an empty file has no bytes to read anyway
        data = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if stat.st_size else b""
    except OSError as error:
      raise DeviceError(f"{self.name}: cannot map the file: {error.strerror or error}") from None
    current = _Mapping(data, (stat.st_dev, stat.st_ino))
    self._current = weakref.ref(current)
    return current

  def buffer_view(self, buffer: Buffer, byte_offset: int, size: int, dtype: DType) -> DiskBuffer:
    """`size` elements of `dtype` at `byte_offset` inside `buffer` (a buffer of this device) as a buffer of their
    own; nothing is read or mapped until it is used (`buffer` may still be waiting for a copy into it)."""
    return DiskBuffer(self.name, size, dtype, byte_offset, base=buffer)

  def write(self, offset: int, data: memoryview) -> None:
    """Write `data` at byte `offset` of the file, creating it or growing it (zero-filled) as needed."""
    try:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
      with open(fd, "r+b") as file:
        file.seek(offset)
        file.write(data)
    except OSError as error:
      raise DeviceError(f"{self.name}: cannot write the file: {error.strerror or error}") from None


class DiskBuffer(Buffer):
  """A DISK buffer at byte `offset`: of the file, or, with `base`, inside another DISK buffer (a buffer view: the
  bytes of a contiguous view of a DISK tensor, so a copy reads just those). Its window costs no memory, so
  unlike a plain Buffer it is not counted in GlobalCounters.mem_used."""

  def __init__(self, device: str, size: int, dtype: DType, offset: int, base: Buffer | None = None):
    super().__init__(device, size, dtype)
    self.offset, self.base = offset, base

  def allocate(self) -> DiskBuffer:
    if self._handle is None:
      if self.base is None:
        allocator = Device[self.device].allocator
        assert isinstance(allocator, DiskAllocator), f"{self.device} is not a DISK device"
        self._handle = allocator.window(self.offset, self.nbytes)
      else:
        self._handle = self.base.handle.sub(self.offset, self.nbytes)
    return self

  def __del__(self) -> None:
    pass  # nothing to give back: dropping the window drops its reference to the mapping

  def __repr__(self) -> str: return f"<DiskBuffer {self.device} {self.size} {self.dtype} at byte {self.offset}>"


def disk_buffer(device: str, offset: int, size: int, dtype: DType) -> DiskBuffer:
  """A buffer of `size` elements of `dtype` at byte `offset` of DISK device `device`'s file, mapped now, so a
  missing or too short file raises DeviceError here (nothing is read)."""
  buffer = DiskBuffer(Device.canonicalize(device), size, dtype, offset).allocate()
  buffer.handle.pin()
  return buffer


def create_device(name: str) -> DiskDevice:
  if not name.partition(":")[2]:
    raise DeviceError("the DISK device is a file: name it as 'DISK:/path/to/file'")
  return DiskDevice(name)
