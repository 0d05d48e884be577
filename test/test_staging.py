"""The staging ring of host<->device copies (runtime/staging.py) and the CUDA allocator's copies through it.

On the CPU: a simulated device whose transfers are queued in order and run only when the test lets the device make
progress (or a fence is waited for); a transfer reads the ring when it runs, not when it is queued, so a range handed
out again before its transfer ran shows up as wrong bytes on the device. The CUDA allocator is driven the same way
through a stand-in for the driver calls it makes (skips where cuda-python is not installed); on a GPU the last tests
run the real thing.
"""
from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.runtime.staging import MAX_IN_FLIGHT, STAGING_ALIGNMENT, StagingRing
from helpers import device_opens


class SimulatedQueue:
  """An in-order device queue of transfers and fences. `memory` is the device's: a host array standing in for it."""

  def __init__(self, device_bytes: int):
    self.memory = np.zeros(device_bytes, np.uint8)
    self.queue: list[tuple] = []   # ("in", ring address, device offset, n) | ("out", ...) | ("fence", number)
    self.completed_fences = 0
    self.recorded = 0
    self.released: list[int] = []

  # the Fences protocol
  def record(self) -> int:
    self.recorded += 1
    self.queue.append(("fence", self.recorded))
    return self.recorded

  def done(self, fence: int) -> bool: return fence <= self.completed_fences

  def wait(self, fence: int) -> None:
    while fence > self.completed_fences: self.run(1)

  def release(self, fence: int) -> None:
    assert fence <= self.completed_fences, "a fence was released before it completed"
    self.released.append(fence)

  def run(self, steps: int) -> None:
    """Let the device carry out its next `steps` queued entries (transfers read and write memory only now)."""
    for _ in range(min(steps, len(self.queue))):
      kind, *what = self.queue.pop(0)
      if kind == "fence": self.completed_fences = what[0]
      elif kind == "in":
        staged, offset, nbytes = what
        self.memory[offset:offset + nbytes] = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(staged), np.uint8)
      else:
        staged, offset, nbytes = what
        ctypes.memmove(staged, self.memory[offset:].ctypes.data, nbytes)


class CheckedRing(StagingRing):
  """A ring that checks each range it hands out against every transfer still queued (reserve looks at the oldest
  ones only, on the ground that ranges go around the ring in order)."""

  def reserve(self, nbytes: int) -> int:
    start = super().reserve(nbytes)
    queued = [(first, last) for first, last, fence in self.in_flight if not self.fences.done(fence)]
    assert not [(first, last) for first, last in queued if first < start + nbytes and start < last], \
      f"[{start}, {start + nbytes}) handed out while transfers on it are queued"
    return start


def make_ring(capacity: int, device_bytes: int) -> tuple[StagingRing, SimulatedQueue]:
  queue = SimulatedQueue(device_bytes)
  queue.pinned = (ctypes.c_uint8 * capacity)()   # the ring's memory, alive as long as the queue
  return CheckedRing(ctypes.addressof(queue.pinned), capacity, queue), queue


def copy_in(ring: StagingRing, queue: SimulatedQueue, device_offset: int, data: np.ndarray) -> None:
  def transfer(staged: int, offset: int, nbytes: int) -> None: queue.queue.append(("in", staged, device_offset + offset,
                                                                                     nbytes))
  ring.copy_in(data.ctypes.data, data.nbytes, transfer)


def copy_out(ring: StagingRing, queue: SimulatedQueue, device_offset: int, nbytes: int) -> np.ndarray:
  result = np.zeros(nbytes, np.uint8)

  def transfer(staged: int, offset: int, size: int) -> None: queue.queue.append(("out", staged, device_offset + offset,
                                                                                  size))
  ring.copy_out(result.ctypes.data, nbytes, transfer)
  return result


@pytest.mark.parametrize("seed", range(6))
def test_random_copies_overwrites_and_reads_match_a_host_model(seed):
  """Copies in of random sizes (some over a chunk) to random places, the host array overwritten right after each
  (the copy must have taken its bytes already), the device running a random number of steps in between, and reads
  that must see every earlier copy."""
  rng = random.Random(seed)
  ring, queue = make_ring(4096, 1 << 14)
  expected = np.zeros(1 << 14, np.uint8)
  host = np.zeros(3000, np.uint8)
  for _ in range(300):
    action = rng.random()
    if action < 0.6:
      nbytes = rng.choice([1, 3, 64, 255, 256, 257, 1000, 1024, 2500, 3000])
      offset = rng.randrange(0, expected.size - nbytes)
      host[:nbytes] = np.frombuffer(rng.randbytes(nbytes), np.uint8)
      copy_in(ring, queue, offset, host[:nbytes])
      expected[offset:offset + nbytes] = host[:nbytes]
      host[:nbytes] = 0xEE   # the caller reuses its array at once
    elif action < 0.9:
      queue.run(rng.randrange(0, 6))
    else:
      start = rng.randrange(0, expected.size - 2000)
      nbytes = rng.randrange(1, 2000)
      np.testing.assert_array_equal(copy_out(ring, queue, start, nbytes), expected[start:start + nbytes])
  queue.run(len(queue.queue))
  np.testing.assert_array_equal(queue.memory, expected)
  assert sorted(queue.released) == list(range(1, len(queue.released) + 1)), "each fence released once"


def test_copies_in_wait_only_when_the_ring_is_full_of_queued_transfers():
  """A device that keeps up: no copy in waits. A device that runs nothing: the ring waits once it wrapped onto
  transfers still queued, and then for the oldest only."""
  ring, queue = make_ring(4096, 1 << 16)
  for index in range(100):
    copy_in(ring, queue, 0, np.full(300, index, np.uint8))
    queue.run(2)   # the transfer and its fence
  assert ring.waits == 0
  ring, queue = make_ring(4096, 1 << 16)
  per_ring = 4096 // (-(-300 // STAGING_ALIGNMENT) * STAGING_ALIGNMENT)   # 8 copies of 300 bytes fit before a wrap
  for index in range(per_ring): copy_in(ring, queue, 300 * index, np.full(300, index, np.uint8))
  assert ring.waits == 0 and len(queue.queue) == 2 * per_ring
  copy_in(ring, queue, 300 * per_ring, np.full(300, per_ring, np.uint8))
  assert ring.waits == 1 and queue.completed_fences == 1, "only the oldest transfer was waited for"


def test_many_small_copies_keep_few_fences_while_the_device_keeps_up():
  ring, queue = make_ring(1 << 20, 1 << 16)
  for index in range(3 * MAX_IN_FLIGHT):
    copy_in(ring, queue, 4 * (index % 100), np.full(4, index % 251, np.uint8))
    queue.run(2)
    assert len(ring.in_flight) <= MAX_IN_FLIGHT
  assert ring.waits == 0
  ring, queue = make_ring(1 << 20, 1 << 16)
  for index in range(2 * MAX_IN_FLIGHT): copy_in(ring, queue, 0, np.full(4, 1, np.uint8))
  assert ring.waits == 0 and len(ring.in_flight) == 2 * MAX_IN_FLIGHT, "a busy device is not waited for"


def test_a_copy_larger_than_a_chunk_goes_in_chunks():
  ring, queue = make_ring(4096, 1 << 16)
  data = np.arange(10_000, dtype=np.uint32).view(np.uint8)   # 40,000 bytes through 1,024-byte chunks
  copy_in(ring, queue, 8, data)
  assert queue.recorded == -(-data.nbytes // ring.chunk_bytes), "a fence after each chunk's transfer"
  np.testing.assert_array_equal(copy_out(ring, queue, 8, data.nbytes), data)


def test_a_ring_too_small_or_a_reservation_too_large_is_refused():
  with pytest.raises(ValueError):
    make_ring(512, 16)
  ring, _ = make_ring(4096, 16)
  with pytest.raises(ValueError):
    ring.reserve(ring.chunk_bytes + 1)


# ---------------------------------------------------------------- the CUDA allocator through a driver stand-in

class FakeCUDA:
  """The driver calls CUDAAllocator's copies make, on a SimulatedQueue; device pointers are offsets into its memory
  plus 1 << 40 (a pointer 0 would pass unnoticed). Counts the calls that wait for the whole stream."""
  base = 1 << 40

  def __init__(self, monkeypatch, driver, device_bytes: int):
    self.queue = SimulatedQueue(device_bytes)
    self.pinned: list[ctypes.Array] = []
    self.stream_syncs = 0
    success = driver.CUresult.CUDA_SUCCESS
    queue = self.queue

    def host_alloc(nbytes: int, flags: int) -> tuple:
      self.pinned.append((ctypes.c_uint8 * nbytes)())
      return success, ctypes.addressof(self.pinned[-1])

    def htod(destination, staged, nbytes, stream) -> tuple:
      queue.queue.append(("in", int(staged), int(destination) - self.base, nbytes))
      return (success,)

    def dtoh(staged, source, nbytes, stream) -> tuple:
      queue.queue.append(("out", int(staged), int(source) - self.base, nbytes))
      return (success,)

    def query(event) -> tuple:
      return (success if queue.done(event) else driver.CUresult.CUDA_ERROR_NOT_READY,)

    def stream_sync(stream) -> tuple:
      self.stream_syncs += 1
      queue.run(len(queue.queue))
      return (success,)
    events = iter(range(1, 1 << 30))
    record_numbers: dict[int, int] = {}

    def record(event, stream) -> tuple:
      record_numbers[event] = queue.record()
      return (success,)
    replacements = {
      "cuMemHostAlloc": host_alloc, "cuMemcpyHtoDAsync": htod, "cuMemcpyDtoHAsync": dtoh,
      "cuEventCreate": lambda flags: (success, next(events)), "cuEventRecord": record,
      "cuEventQuery": lambda event: query(record_numbers[event]),
      "cuEventSynchronize": lambda event: (queue.wait(record_numbers[event]), (success,))[1],
      "cuStreamSynchronize": stream_sync, "cuCtxSetCurrent": lambda context: (success,)}
    for name, function in replacements.items(): monkeypatch.setattr(driver, name, function)


def test_cuda_allocator_copies_in_without_waiting_for_the_device(monkeypatch):
  """Random copies in (some over a chunk, the host array overwritten after each) and reads through CUDAAllocator:
  no copy in waits for the stream, the device ends up with every byte, and a read sees every earlier copy."""
  ops_cuda = pytest.importorskip("ourgrad.runtime.ops_cuda", exc_type=ImportError)
  monkeypatch.setattr(ops_cuda, "STAGING_BYTES", 8192)
  # every copy through the ring (copies of at most SMALL_COPY_BYTES go straight through the driver's own staging,
  # DirectCalls, which test_devices checks on a GPU)
  monkeypatch.setattr(ops_cuda, "SMALL_COPY_BYTES", 0)
  fake = FakeCUDA(monkeypatch, ops_cuda.driver, 1 << 16)

  class Device:
    stream = "stream"
    def make_current(self) -> None: pass
  allocator = ops_cuda.CUDAAllocator(Device())
  rng = random.Random(0)
  expected = np.zeros(1 << 16, np.uint8)
  for _ in range(200):
    nbytes = rng.choice([4, 100, 2048, 5000, 9000])
    offset = rng.randrange(0, expected.size - nbytes)
    host = np.frombuffer(rng.randbytes(nbytes), np.uint8).copy()
    allocator.copyin(fake.base + offset, memoryview(host))
    expected[offset:offset + nbytes] = host
    host[:] = 0
    fake.queue.run(rng.randrange(0, 4))
  assert fake.stream_syncs == 0 and len(fake.pinned) == 1, "copies in never waited for the stream"
  for start in range(0, expected.size, 7000):
    out = np.zeros(min(7000, expected.size - start), np.uint8)
    allocator.copyout(memoryview(out), fake.base + start)
    np.testing.assert_array_equal(out, expected[start:start + out.size])
  fake.queue.run(len(fake.queue.queue))
  np.testing.assert_array_equal(fake.queue.memory, expected)


# ---------------------------------------------------------------- on a GPU

@pytest.mark.skipif(not device_opens("CUDA"), reason="needs an NVIDIA GPU")
def test_cuda_copies_in_take_the_host_bytes_at_once_and_reads_see_them():
  """Tensors made from one host array overwritten after each, between kernels that read the earlier ones; a large
  array (several staging chunks) too."""
  rng = np.random.default_rng(0)
  host = np.zeros(4096, np.float32)
  tensors, expected = [], []
  for index in range(200):
    host[:] = rng.standard_normal(4096).astype(np.float32)
    tensor = Tensor(host, device="CUDA")
    expected.append(host.copy())
    host[:] = np.nan   # the copy in must have taken its bytes already
    tensors.append((tensor * 2 + index).realize())
  for index, (tensor, values) in enumerate(zip(tensors, expected)):
    np.testing.assert_array_equal(tensor.numpy(), values * 2 + index)
  large = rng.standard_normal(3 << 20).astype(np.float32)   # 12 MiB: 3 chunks of the 16 MiB ring
  np.testing.assert_array_equal(Tensor(large, device="CUDA").numpy(), large)


@pytest.mark.skipif(not device_opens("CUDA"), reason="needs an NVIDIA GPU")
def test_cuda_copy_in_queues_behind_kernels_that_read_the_buffer():
  """A buffer overwritten by a copy in while kernels queued before it still read its old contents."""
  from ourgrad.device import Buffer
  from ourgrad.dtype import dtypes
  buffer = Buffer("CUDA", 1 << 20, dtypes.float32)
  buffer.copyin(memoryview(np.ones(1 << 20, np.float32)).cast("B"))
  from ourgrad.lazy import LazyBuffer
  source = Tensor(LazyBuffer.from_buffer(buffer, (1 << 20,)))
  sums = [(source * 1).sum().realize() for _ in range(4)]
  buffer.copyin(memoryview(np.full(1 << 20, 2, np.float32)).cast("B"))
  after = (source * 1).sum().realize()
  assert [float(total.item()) for total in sums] == [1 << 20] * 4
  assert float(after.item()) == 2 << 20
