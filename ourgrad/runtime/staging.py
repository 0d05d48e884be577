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
# transfers remembered before the older half is forgotten (once completed): their fences (CUDA events) are then
# reused, so a loop of small copies creates no event after its first few dozen copies
MAX_IN_FLIGHT = 32


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
    """The offset of `nbytes` (at most a chunk) free bytes: the transfers that read them before have completed.

    Ranges go around the ring in the order they are handed out, so the transfers in the way of a new range are the
    oldest ones: those on it and, when it wraps to 0, those on the skipped end of the ring. Only they are looked
    at (no driver call at all while the ring has room), and the newest of them is waited for: the queue is in
    order, so the older ones have completed then too."""
    if not 0 < nbytes <= self.chunk_bytes:
      raise ValueError(f"{nbytes} bytes do not fit the staging ring's {self.chunk_bytes}-byte chunks")
    wraps = self.head + nbytes > self.capacity
    start = 0 if wraps else self.head
    end = start + nbytes
    in_the_way = 0
    for first, last, _ in self.in_flight:
      if not (first < end and start < last) and not (wraps and first >= self.head): break
      in_the_way += 1
    if in_the_way: self._retire(in_the_way)
    self.head = min(self.capacity, -(-end // STAGING_ALIGNMENT) * STAGING_ALIGNMENT)
    return start

  def queued(self, start: int, nbytes: int) -> None:
    """A transfer reading `nbytes` at offset `start` was just queued: the range stays taken until it completes."""
    self.in_flight.append((start, start + nbytes, self.fences.record()))
    if len(self.in_flight) > MAX_IN_FLIGHT:
      # many small copies fill the ring slowly: forget the older half once it has completed (one query a copy
      # until it has), so that the device's fences do not pile up
      half = len(self.in_flight) // 2
      if self.fences.done(self.in_flight[half - 1][2]): self._retire(half)

  def _retire(self, count: int) -> None:
    """Forget the `count` oldest transfers, after waiting for the last of them if it has not completed yet."""
    fence = self.in_flight[count - 1][2]
    if not self.fences.done(fence):
      self.waits += 1
      self.fences.wait(fence)
    for _ in range(count): self.fences.release(self.in_flight.popleft()[2])

  def drain(self) -> None:
    """Wait for every queued transfer and forget them all."""
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
