"""A ring of host staging memory for asynchronous copies between the host and a device (the CUDA allocator's).

A device's DMA engine reads host memory only from page-locked (pinned) memory, asynchronously, so a copy-in goes
in two steps: the host bytes are copied into a range of the pinned ring at once (the caller's array may change as
soon as the call returns), then the device's transfer from that range is queued on its stream, followed by a fence
(a CUDA event) that completes when the transfer has. A range is handed out again only after the fences of every
transfer that read it have completed. Ranges are handed out in ring order, so a new copy gets the range that held
the oldest transfers, which have most likely finished long ago: the host waits only when the ring is full of
transfers still queued behind the device's work, where before each copy-in waited for the whole device.

A copy larger than a chunk (a quarter of the ring) goes chunk by chunk, so a large upload (a model's weights)
needs no staging memory of its own size and the host copies one chunk while the device transfers the one before.

`StagingRing` is the bookkeeping without a device: the device hands it the ring's host address and `Fences` (how
to record, query, wait for and recycle a fence), so the CPU tests drive it with simulated transfers and fences.
"""
from __future__ import annotations

import collections
import ctypes
from typing import Any, Callable, Protocol

# a range starts at a multiple of this (DMA engines move aligned host memory fastest)
STAGING_ALIGNMENT = 256


class Fences(Protocol):
  """What the ring asks of a device about its fences. The device's queue is in order: when a fence has completed,
  every fence recorded before it has too."""

  def record(self) -> Any:
    """A fence that completes once everything queued so far (the transfer just queued) has completed."""
  def done(self, fence: Any) -> bool:
    """Whether `fence` has completed (without waiting)."""
  def wait(self, fence: Any) -> None:
    """Block until `fence` has completed."""
  def release(self, fence: Any) -> None:
    """`fence` (completed) is no longer needed: the device may reuse it."""


# (queued transfer's first byte, its end, the fence that completes after it), oldest first
InFlight = tuple[int, int, Any]


class StagingRing:
  """Ranges of `capacity` bytes of pinned host memory at `address`, handed out in ring order to transfers."""

  def __init__(self, address: int, capacity: int, fences: Fences):
    if capacity < 4 * STAGING_ALIGNMENT: raise ValueError(f"a staging ring of {capacity} bytes is too small")
    self.address, self.capacity, self.fences = address, capacity, fences
    self.chunk_bytes = capacity // 4
    self.head = 0   # where the next range starts, unless it does not fit before the end (then at 0)
    self.in_flight: collections.deque[InFlight] = collections.deque()
    self.waits = 0   # how often a range had to wait for a transfer still queued (the ring was full)

  def reserve(self, nbytes: int) -> int:
    """The offset of `nbytes` (at most a chunk) free bytes: the transfers that read them before have completed."""
    if not 0 < nbytes <= self.chunk_bytes:
      raise ValueError(f"{nbytes} bytes do not fit the staging ring's {self.chunk_bytes}-byte chunks")
    self._retire_completed()
    start = self.head if self.head + nbytes <= self.capacity else 0
    end = start + nbytes
    newest = -1
    for index, (first, last, _) in enumerate(self.in_flight):
      if first < end and start < last: newest = index
    if newest >= 0:
      # the queue is in order: once the newest transfer on the range has completed, every older one has too
      self.waits += 1
      self.fences.wait(self.in_flight[newest][2])
      for _ in range(newest + 1): self.fences.release(self.in_flight.popleft()[2])
    self.head = min(self.capacity, -(-end // STAGING_ALIGNMENT) * STAGING_ALIGNMENT)
    return start

  def queued(self, start: int, nbytes: int) -> None:
    """A transfer reading `nbytes` at offset `start` was just queued: the range stays taken until it completes."""
    self.in_flight.append((start, start + nbytes, self.fences.record()))

  def _retire_completed(self) -> None:
    """Forget the oldest transfers that have completed (one query when the oldest has not)."""
    while self.in_flight and self.fences.done(self.in_flight[0][2]):
      self.fences.release(self.in_flight.popleft()[2])

  def drain(self) -> None:
    """Wait for every queued transfer and forget them all (before the ring's memory is freed)."""
    if self.in_flight: self.fences.wait(self.in_flight[-1][2])
    while self.in_flight: self.fences.release(self.in_flight.popleft()[2])

  def copy_in(self, source: int, nbytes: int, transfer: Callable[[int, int, int], None]) -> None:
    """Copy `nbytes` at host address `source` to a device: chunk by chunk into the ring, then
    `transfer(ring address, offset in the copy, bytes)` queues the device's read of the chunk. The host bytes are
    in the ring when this returns; the device has them once the fences recorded after the transfers complete."""
    for offset in range(0, nbytes, self.chunk_bytes):
      size = min(self.chunk_bytes, nbytes - offset)
      start = self.reserve(size)
      ctypes.memmove(self.address + start, source + offset, size)
      transfer(self.address + start, offset, size)
      self.queued(start, size)

  def copy_out(self, destination: int, nbytes: int, transfer: Callable[[int, int, int], None]) -> None:
    """Copy `nbytes` from a device to host address `destination`: `transfer(ring address, offset in the copy,
    bytes)` queues the device's write of a chunk into the ring, which is copied out once it has completed (all
    queued work before it has too: a read sees every earlier write)."""
    for offset in range(0, nbytes, self.chunk_bytes):
      size = min(self.chunk_bytes, nbytes - offset)
      start = self.reserve(size)
      transfer(self.address + start, offset, size)
      self.queued(start, size)
      self.drain()
      ctypes.memmove(destination + offset, self.address + start, size)
