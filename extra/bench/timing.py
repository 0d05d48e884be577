"""Timing helpers the benchmarks share: PyTorch's side of a comparison and ourgrad's summed kernel times, each timed
the same way everywhere.

Three ways of timing a kernel, from the least to the most faithful to its device time:
- `ourgrad_kernel_seconds`: one launch between two CUDA events (what DEBUG=2 prints). It also counts the gap while
  the host launches into an idle GPU: on an H100 no kernel reads under ~10 us this way, while Nsight Compute reads
  2.6 us for the smallest kernels of a replayed training step.
- `back_to_back_seconds`: calls queued one after another between two synchronizations (Triton's do_bench, cuBLAS),
  per call. Fair for kernels longer than the host's launch cost (~5 us); shorter ones make it host-bound, and a
  kernel repeated on the same small buffers finds them in the L2 cache (an H100's is 50 MB), faster than DRAM.
- `cold_kernel_seconds` (for per-kernel tables): the kernel's ExecItem is copied onto S sets of scratch buffers
  (random values, the same sizes and dtypes; S large enough that the sets together hold more than twice the L2, so
  each launch reads its inputs from DRAM as in a real step where other kernels ran in between), the copies are
  launched N times in turn (N >= 64, a multiple of S) as one CUDA graph built by the JIT's graph runner
  (engine/jit.py `build_replay`), and R graph replays are timed with CUDA events on the device's stream: the
  kernel's time is the median over replays of elapsed / N. The host launches nothing per kernel, so a kernel
  shorter than the launch cost is timed by the GPU, not by Python.
  What it counts: the kernel's execution and the gap between two dependent kernel nodes of a graph (about a
  microsecond on an H100: the nodes are chained, as the JIT chains a step's kernels), which a replayed step pays too.
  What it does not count: the host's launch cost, L2 hits on inputs the step's previous kernel just wrote (every
  input is cold here, so a kernel reading a producer's fresh output may read a little faster in the real step), and
  Nsight Compute's clock control. Kernels with less than 2x L2 of data over 512 sets (a few hundred KB per launch)
  keep their buffers in the L2: those are bound by latency, not by bandwidth, either way.
  A kernel that alone moves more than twice the L2 needs one set; `cold_schedule_seconds` then lets it read the
  realized inputs it was scheduled with (drawing gigabytes of random values takes seconds).
  Devices without a graph class (CLANG, LLVM, PYTHON) fall back to `back_to_back_seconds` on one set (caches warm).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

DEFAULT_L2_BYTES = 50 << 20   # an H100's L2, where the device cannot say its own


def synchronized_median_seconds(step: Callable[[], Any], synchronize: Callable[[], None], steps: int,
                                warmup: int = 0) -> float:
  """Median seconds of `steps` calls of `step`, each timed on the host clock between two synchronizations, after
  `warmup` untimed calls (whole training steps, attention fwd+bwd: long enough that the host clock is fair)."""
  for _ in range(warmup): step()
  synchronize()
  times = []
  for _ in range(steps):
    began = time.perf_counter()
    step()
    synchronize()
    times.append(time.perf_counter() - began)
  return statistics.median(times)


def torch_seconds(function: Callable[[], Any], iters: int, cuda: bool, warmup: int = 3) -> float:
  """Median seconds of `function` over `iters` runs after `warmup` runs: CUDA events on a GPU (device time of the
  work it launches), the host clock on the CPU."""
  import torch
  times = []
  for _ in range(iters + warmup):
    if cuda:
      start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      start.record()
      function()
      end.record()
      torch.cuda.synchronize()
      times.append(start.elapsed_time(end) / 1e3)
    else:
      began = time.perf_counter()
      function()
      times.append(time.perf_counter() - began)
  return statistics.median(times[warmup:])


def ourgrad_kernel_seconds(device: str, build: Callable[[], Any], iters: int, warmup: int = 3) -> tuple[float, int]:
  """Median summed kernel seconds (device-timed launches) of scheduling what `build()` returns (a Tensor or a list of
  them) over `iters` runs after `warmup`, and the schedule's kernel count. Each run builds the graph anew."""
  from ourgrad.engine.realize import get_runner
  from ourgrad.engine.schedule import create_schedule
  totals, count = [], 0
  for _ in range(iters + warmup):
    built = build()
    schedule = create_schedule([tensor.lazydata for tensor in (built if isinstance(built, (list, tuple)) else [built])])
    total = 0.0
    for item in schedule:
      for buffer in item.outputs: buffer.allocate()
      total += get_runner(device, item.ast)(item.bufs, wait=True) or 0.0
    totals.append(total)
    count = len(schedule)
  return statistics.median(totals[warmup:]), count


def back_to_back_seconds(launch: Callable[[], Any], synchronize: Callable[[], None], launches: int = 10,
                         batches: int = 5) -> float:
  """Seconds per call of `launch` when calls follow each other with the device kept busy: each batch synchronizes,
  queues `launches` calls and synchronizes again; the median over `batches` batches after one warm-up batch, divided
  by `launches`. Launches are asynchronous, so the host's launch cost hides behind the previous call's work and the
  figure is the device's time per call (how cuBLAS and Triton's do_bench time a kernel). A single call between two
  events also times the gap while the host launches into an idle device."""
  times = []
  for _ in range(batches + 1):
    synchronize()
    began = time.perf_counter()
    for _ in range(launches): launch()
    synchronize()
    times.append((time.perf_counter() - began) / launches)
  return statistics.median(times[1:])


@dataclass
class KernelTiming:
  """Seconds per launch of one kernel and how they were measured: method 'graph' (cold, one CUDA graph) or
  'back-to-back' (the fallback), the sets of scratch buffers and the launches per timed batch."""
  seconds: float
  method: str
  sets: int
  launches: int
  bytes_per_launch: int


def l2_cache_bytes(device: str) -> int:
  """The device's last-level cache in bytes as the CUDA driver reports it; DEFAULT_L2_BYTES elsewhere."""
  from ourgrad.device import Device
  cu_device = getattr(Device[device], "cu_device", None)
  if cu_device is None: return DEFAULT_L2_BYTES
  from ourgrad.runtime.ops_cuda import check, driver
  attribute = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE
  reported = check(driver.cuDeviceGetAttribute(attribute, cu_device), "cuDeviceGetAttribute")
  return int(reported) if reported else DEFAULT_L2_BYTES


def scratch_sets(item: Any, sets: int, seed: int = 0) -> list[list[Any]]:
  """`sets` lists of fresh buffers shaped like `item.bufs` (a buffer passed in two slots gets one scratch buffer in
  both), all holding the same random values (codegen/opt/search.py random_fill: finite floats, small positive
  integers, so no index goes out of range and nothing divides by zero)."""
  from ourgrad.codegen.opt.search import random_fill
  from ourgrad.device import Buffer
  distinct = list({id(buffer): buffer for buffer in item.bufs}.values())
  first = [Buffer(buffer.device, buffer.size, buffer.dtype).allocate() for buffer in distinct]
  random_fill(first, seed)
  # copied into the other sets, not drawn again (numpy draws ~200 MB/s of normals)
  contents = [memoryview(buffer.as_bytes()) for buffer in first] if sets > 1 else []
  made = [first]
  for _ in range(sets - 1):
    made.append([Buffer(buffer.device, buffer.size, buffer.dtype).allocate().copyin(data)
                 for buffer, data in zip(distinct, contents)])
  slot_of = {id(buffer): index for index, buffer in enumerate(distinct)}
  return [[scratch[slot_of[id(buffer)]] for buffer in item.bufs] for scratch in made]


def cold_kernel_seconds(item: Any, replays: int = 10, min_launches: int = 64, max_sets: int = 512,
                        cache_bytes: int | None = None, fallback_launches: int = 5,
                        own_buffers_when_large: bool = False) -> KernelTiming:
  """Device seconds per launch of the kernel of `item` (an ExecItem with a CompiledRunner), every launch reading
  its inputs from DRAM, timed as one CUDA graph of many launches (the method is in the module docstring).
  `cache_bytes`: the cache to defeat (the device's L2 unless given). On a device without graphs: back to back.
  `own_buffers_when_large`: a kernel that alone moves more than twice the cache runs on its own buffers (one set is
  enough and drawing random values for gigabytes takes seconds); only for items whose buffers hold data the kernel
  can read (realized inputs) and whose outputs may be overwritten."""
  from ourgrad.device import Device
  from ourgrad.engine.exec_item import ExecItem
  from ourgrad.engine.jit import GraphReplay, build_replay
  device = item.device or item.bufs[0].device
  per_launch = sum({id(buffer): buffer.nbytes for buffer in item.bufs}.values())
  synchronize = Device[device].synchronize
  cache = l2_cache_bytes(device) if cache_bytes is None else cache_bytes
  sets = min(max(math.ceil(2 * cache / max(per_launch, 1)), 1), max_sets)
  own = own_buffers_when_large and sets == 1
  if getattr(Device[device], "graph", None) is None:
    scratch = list(item.bufs) if own else scratch_sets(item, 1)[0]
    copy = ExecItem(item.runner, scratch, dict(item.var_vals), device)
    seconds = back_to_back_seconds(lambda: copy.run(), synchronize, launches=fallback_launches, batches=3)
    return KernelTiming(seconds, "back-to-back", 1, fallback_launches, per_launch)
  launches = sets * math.ceil(max(min_launches, sets) / sets)
  buffer_sets = [list(item.bufs)] if own else scratch_sets(item, sets)
  copies = [ExecItem(item.runner, buffer_sets[index % sets], dict(item.var_vals), device) for index in range(launches)]
  replay = build_replay(copies)
  if not isinstance(replay, GraphReplay):   # DEBUG >= 2 or a driver that refused the graph
    seconds = back_to_back_seconds(replay.run, synchronize, launches=1, batches=max(replays, 2)) / launches
    return KernelTiming(seconds, "back-to-back", sets, launches, per_launch)
  elapsed = [_event_seconds(device, replay.run) for _ in range(replays + 1)][1:]   # the first replay loads, warms
  return KernelTiming(statistics.median(elapsed) / launches, "graph", sets, launches, per_launch)


def _event_seconds(device: str, launch: Callable[[], None]) -> float:
  """Seconds between two CUDA events recorded on the device's stream around what `launch` queues there."""
  from ourgrad.device import Device
  from ourgrad.runtime.ops_cuda import check, driver
  cuda = Device[device]
  check(driver.cuEventRecord(cuda.start_event, cuda.stream), "cuEventRecord")
  launch()
  check(driver.cuEventRecord(cuda.end_event, cuda.stream), "cuEventRecord")
  check(driver.cuEventSynchronize(cuda.end_event), "cuEventSynchronize")
  return check(driver.cuEventElapsedTime(cuda.start_event, cuda.end_event), "cuEventElapsedTime") / 1e3


def schedule_items(device: str, built: Any) -> list[Any]:
  """The ExecItems (kernel runners bound to the schedule's buffers, allocated) of realizing `built` (a Tensor or a
  list of them), without running them: what cold_kernel_seconds times one by one."""
  from ourgrad.engine.exec_item import CompiledRunner
  from ourgrad.engine.realize import lower_schedule_item
  from ourgrad.engine.schedule import create_schedule
  tensors = built if isinstance(built, (list, tuple)) else [built]
  items = []
  for scheduled in create_schedule([tensor.lazydata for tensor in tensors]):
    for buffer in scheduled.outputs: buffer.allocate()
    item = lower_schedule_item(scheduled)
    if isinstance(item.runner, CompiledRunner) and item.device == device: items.append(item)
  return items


def cold_schedule_seconds(device: str, built: Any, replays: int = 10) -> tuple[float, list[tuple[str, float]]]:
  """Summed cold_kernel_seconds of the kernels realizing `built` (a kernel moving more than twice the cache reads
  the realized inputs it was scheduled with), and each kernel's (name, seconds)."""
  kernels = [(item.runner.name, cold_kernel_seconds(item, replays, own_buffers_when_large=True).seconds)
             for item in schedule_items(device, built)]
  return sum(seconds for _, seconds in kernels), kernels
