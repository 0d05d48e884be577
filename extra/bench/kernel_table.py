"""Per-kernel tables of a training step: each kernel's time beside the bytes it moves, its GB/s, its share of the
device's copy bandwidth (%copy) and of an ourgrad copy kernel moving the same bytes timed the same way (%same), its
GFLOP/s, what it computes (kind) and its role in examples/mnist.py's step (conv forward, input gradient, weight
gradient partials, second stage, BatchNorm statistics forward/backward, ...). Then the totals per role, the rows of
issue 10's table ("conv weight gradient and BatchNorm statistics, each >= 70% of copy bandwidth").

Used by bench_reduce.py --only-mnist (times from timing.cold_kernel_seconds) and profile_jit_step.py --table (times
from Nsight Compute). Main types: KernelRow (one launch), CopyReference (the copy kernels compared against),
KernelKinds (kind of a compiled kernel), MnistRoles (role of a kernel in the step, from the model's geometry).
"""
from __future__ import annotations

import dataclasses
import os
import statistics
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ourgrad.engine.exec_item import CompiledRunner, ExecItem
from timing import back_to_back_seconds, cold_kernel_seconds, schedule_items

LARGE_COPY_ELEMENTS = 1 << 26   # 256 MB read and 256 MB written: the copy bandwidth every %copy divides by


@dataclass
class KernelRow:
  """One launch of the step: its time (the table's method), the DEBUG=2 event time where measured, the bytes and
  ops the kernel's UOps count, its kind ('reduce 1024x2304': outputs x values per output) and its role."""
  name: str
  axes: str
  seconds: float
  event_seconds: float | None
  moved: int
  ops: int
  kind: str
  role: str


# ---------------------------------------------------------------- copy references

def copy_item(device: str, elements: int) -> Any:
  """The ExecItem of an ourgrad kernel that reads `elements` float32 and writes as many (a copy with one add).
  Where the size allows, rows of 1024 read out of rows of 1032 (so the two axes cannot merge into one): the
  elementwise heuristic then gives each thread a float4 load and store. A 1-D copy moves one float per thread and
  reached 1613 GB/s on the H100 (too few loads in flight). The values are drawn on the device (Tensor.rand): a
  copy's speed does not depend on them, and drawing gigabytes with numpy takes seconds."""
  from ourgrad import Tensor
  if elements % 1024 == 0:
    source = Tensor.rand(elements // 1024, 1032, device=device).realize()[:, :1024]
  else:
    source = Tensor.rand(elements, device=device).realize()
  (item,) = schedule_items(device, source + 1.0)
  return item


def copy_bandwidth(device: str, elements: int, replays: int = 10) -> float:
  """Bytes per second of the ourgrad copy kernel of `elements` float32 (copy_item), timed cold
  (timing.cold_kernel_seconds) like every kernel of the tables."""
  seconds = cold_kernel_seconds(copy_item(device, elements), replays, own_buffers_when_large=True).seconds
  return 2 * elements * 4 / max(seconds, 1e-12)


def floor_seconds(device: str, replays: int = 10) -> float:
  """Cold time of a kernel that does nothing to speak of (one float32 plus one): what every launch costs with this
  timing (on a CUDA graph, the gap between two chained nodes and the launch of one block)."""
  from ourgrad import Tensor
  (item,) = schedule_items(device, Tensor.rand(1, device=device).realize() + 1.0)
  return cold_kernel_seconds(item, replays).seconds


def torch_copy_bandwidth(device: str, elements: int, launches: int = 20) -> float | None:
  """Bytes per second of torch's device-to-device copy_ of `elements` float32, back to back (None without CUDA
  torch)."""
  if not device.upper().startswith("CUDA"): return None
  try:
    import torch
    if not torch.cuda.is_available(): return None
  except ImportError:
    return None
  source, target = torch.randn(elements, device="cuda"), torch.empty(elements, device="cuda")
  seconds = back_to_back_seconds(lambda: target.copy_(source), torch.cuda.synchronize, launches=launches)
  return 2 * elements * 4 / seconds


class CopyReference:
  """The copies a kernel is compared with: the large-copy bandwidth (the faster of an ourgrad copy kernel and torch's
  copy_ of 2 x 256 MB) and, per power of two of bytes, the ourgrad copy kernel moving that many bytes, timed with
  `copy_seconds` (the table's method)."""

  def __init__(self, device: str, large_elements: int = LARGE_COPY_ELEMENTS,
               bandwidth: Callable[[str, int], float] = copy_bandwidth, with_torch: bool = True):
    self.device, self.bandwidth = device, bandwidth
    self.ours = bandwidth(device, large_elements)
    self.theirs = torch_copy_bandwidth(device, large_elements) if with_torch else None
    self.peak = max(self.ours, self.theirs or 0.0)
    self.by_bucket: dict[int, float] = {}

  @staticmethod
  def bucket(moved: int) -> int:
    """The power of two of bytes (at least 1 KB) whose copy a kernel moving `moved` bytes is compared with."""
    return max(1 << max(moved - 1, 1).bit_length(), 1024)

  def same(self, moved: int) -> float:
    """Bytes per second of the ourgrad copy kernel moving about `moved` bytes (read + write)."""
    bucket = self.bucket(moved)
    if bucket not in self.by_bucket: self.by_bucket[bucket] = self.bandwidth(self.device, bucket // 8)
    return self.by_bucket[bucket]

  def describe(self) -> str:
    theirs = f"{self.theirs / 1e9:.0f} GB/s" if self.theirs else "not measured"
    return (f"copy bandwidth: {self.peak / 1e9:.0f} GB/s, the faster of an ourgrad copy kernel of 2 x 256 MB timed "
            f"like the kernels ({self.ours / 1e9:.0f} GB/s) and torch's copy_ back to back ({theirs}). '%copy' = "
            f"GB/s / that; '%same' = GB/s / the GB/s of the ourgrad copy kernel moving the same bytes (rounded up to "
            f"a power of two), timed the same way: a kernel of a few KB is bound by latency, and so is that copy")


# ---------------------------------------------------------------- what a kernel computes

class KernelKinds:
  """What each compiled kernel of the engine's runner cache computes, by the runner's id: (label, outputs, values
  per output) with label 'matmul' (an input reused across outputs: a convolution, its gradients, a Linear),
  'reduce', 'elementwise', 'packed' (a multi-tensor kernel: several elementwise segments in one launch) or 'indexed'
  (an indexed accumulate: outputs, rows added)."""

  def __init__(self, device: str):
    self.device, self.kinds = device, {}

  def update(self) -> None:
    from ourgrad.codegen.index_accumulate import IndexAccumulateKernel, is_index_accumulate
    from ourgrad.codegen.kernel import Kernel
    from ourgrad.codegen.opt.cpu_tiles import matmul_like
    from ourgrad.codegen.ride_along import host_of
    from ourgrad.device import Device
    from ourgrad.engine import realize
    from ourgrad.helpers import prod
    from ourgrad.ops import Ops
    for (device, ast, _tf32), runner in list(realize._runner_cache.items()):
      if device != self.device or id(runner) in self.kinds: continue
      if ast.op is Ops.PACK:
        self.kinds[id(runner)] = ("packed", len(ast.srcs), 0)
        continue
      if is_index_accumulate(ast):   # (N, R) outputs, M rows added into them: codegen/index_accumulate.py
        accumulate = IndexAccumulateKernel(ast, Device[device].renderer)
        self.kinds[id(runner)] = ("indexed", accumulate.row_count * accumulate.width, accumulate.count)
        continue
      # a one-kernel split reduce (codegen/last_block.py) is described by its partials' kernel, as when it was two;
      # a kernel carrying a one-value reduce (codegen/ride_along.py) by its host
      kernel = Kernel(ast.srcs[0] if ast.op is Ops.SPLIT_REDUCE else host_of(ast), Device[device].renderer)
      outputs = prod(kernel.full_shape[:kernel.first_reduce])
      if kernel.reduceop is None:
        self.kinds[id(runner)] = ("elementwise", outputs, 0)
        continue
      label = "matmul" if matmul_like(kernel) else "reduce"
      self.kinds[id(runner)] = (label, outputs, prod(kernel.full_shape[kernel.first_reduce:]))

  def get(self, runner: Any) -> tuple[str, int, int]: return self.kinds.get(id(runner), ("", 0, 0))

  @staticmethod
  def describe(kind: tuple[str, int, int]) -> str:
    label, outputs, values = kind
    if label == "packed": return f"packed {outputs} segments"
    if label == "indexed": return f"indexed accumulate of {values} rows into {outputs}"
    if label == "elementwise": return f"elementwise {outputs}"
    return f"{label} {outputs}x{values}" if label else ""


@dataclass(frozen=True)
class _Conv:
  index: int
  in_channels: int
  out_channels: int
  kernel: int
  in_size: int
  out_size: int

  @property
  def weights(self) -> int: return self.out_channels * self.in_channels * self.kernel * self.kernel


class MnistRoles:
  """The role of a kernel in examples/mnist.py's training step, read off the model's geometry: a kernel's kind
  (outputs x values per output) matches one layer's forward, input gradient, weight gradient or statistics; whether
  it is forward or backward comes from its place in the step (`forward_flags`)."""

  def __init__(self, blocks: list[list[tuple[int, int]]], batch: int, image_size: int = 28, classes: int = 10):
    self.batch, self.classes, self.convs = batch, classes, []
    self.pools: list[tuple[int, int]] = []   # (channels, input size) of each 2x2 max-pool
    channels, size = 1, image_size
    for block in blocks:
      for out_channels, kernel in block:
        self.convs.append(_Conv(len(self.convs) + 1, channels, out_channels, kernel, size, size - kernel + 1))
        channels, size = out_channels, size - kernel + 1
      self.pools.append((channels, size))
      size //= 2
    self.features = channels * size * size

  def forward_flags(self, kinds: list[tuple[str, int, int]]) -> list[bool]:
    """Per launch of a step (kinds in launch order): True up to the kernel computing the logits (the Linear layer's
    forward: batch x classes outputs over the features), False after it. Launches follow the dependencies, and every
    gradient kernel depends on the logits (the gradient of the loss starts from their softmax), so each kernel of the
    forward pass (an ancestor of the logits) launches before that one and each gradient kernel after it; kernels that
    depend on neither (a running-statistics update, the loss's value) may fall on either side. A kernel's AST alone
    cannot tell: the second stage of a batchnorm statistic is the same kernel forward and backward."""
    logits = ("matmul", self.batch * self.classes, self.features)
    last = kinds.index(logits) if logits in kinds else -1
    return [index <= last for index in range(len(kinds))]

  def role(self, kind: tuple[str, int, int], forward: bool) -> str:
    label, outputs, values = kind
    direction = "forward" if forward else "backward"
    if label == "packed": return "optimizer / elementwise (packed)"
    if label == "elementwise": return f"elementwise ({direction})"
    if not label: return ""
    for channels, size in self.pools:   # before the statistics: a pool's outputs x 4 also equal batch x pixels
      if values == 4 and outputs == self.batch * channels * (size // 2) ** 2: return f"max-pool ({direction})"
    for conv in self.convs:
      found = self._conv_role(conv, label, outputs, values, forward)
      if found: return found
    if label == "matmul" and outputs in (self.batch * self.classes, self.features * self.classes,
                                         self.batch * self.features):
      return f"linear ({direction})"
    return f"loss / small reduce ({direction})"

  def _conv_role(self, conv: _Conv, label: str, outputs: int, values: int, forward: bool) -> str:
    name = f"conv{conv.index}"
    pixels = self.batch * conv.out_size ** 2   # what a weight gradient and a batchnorm statistic sum over
    if label == "matmul":
      if forward and outputs == self.batch * conv.out_channels * conv.out_size ** 2: return f"{name} forward"
      if not forward and outputs == self.batch * conv.in_channels * conv.in_size ** 2: return f"{name} input gradient"
      if outputs % conv.weights == 0 and outputs // conv.weights * values == pixels:
        parts = outputs // conv.weights
        return f"{name} weight gradient" + (f" partials ({parts} parts)" if parts > 1 else "")
      return ""
    if outputs == conv.weights: return f"{name} weight gradient second stage"
    direction = "forward" if forward else "backward"
    channels = conv.out_channels
    if outputs % channels == 0 and outputs // channels * values == pixels:
      parts = outputs // channels
      return f"bn{conv.index} statistics {direction}" + (f" partials ({parts} parts)" if parts > 1 else "")
    if outputs == channels: return f"bn{conv.index} statistics {direction} second stage"
    return ""


def role_group(role: str) -> str:
  """The row of issue 10's table a role counts in: 'conv2 weight gradient', 'bn1 statistics forward', ...; roles
  outside those rows are their own group."""
  for marker in (" partials", " second stage"):
    role = role.split(marker)[0]
  return role


# ---------------------------------------------------------------- Nsight Compute's times

_NCU_UNITS = {"ns": 1e-9, "nsecond": 1e-9, "us": 1e-6, "usecond": 1e-6, "ms": 1e-3, "msecond": 1e-3, "s": 1.0,
              "second": 1.0}


def ncu_kernel_seconds(text: str, metric: str = "gpu__time_duration.sum") -> list[tuple[str, float]]:
  """(kernel name, seconds) of each profiled launch in an `ncu --csv` output (a --log-file, or stdout with the
  profiled program's own lines mixed in), in launch order (ncu's ID column)."""
  import csv
  lines = text.splitlines()
  starts = [index for index, line in enumerate(lines) if line.startswith('"ID"')]
  if not starts: raise ValueError("no ncu CSV header (a line starting with \"ID\") in the file")
  rows = [line for line in lines[starts[0]:] if line.startswith('"')]
  by_id: dict[int, tuple[str, float]] = {}
  for row in csv.DictReader(rows):
    if row.get("Metric Name") != metric: continue
    scale = _NCU_UNITS.get(row.get("Metric Unit", "ns").strip(), 1e-9)
    by_id[int(row["ID"])] = (row["Kernel Name"], float(row["Metric Value"].replace(",", "")) * scale)
  return [by_id[key] for key in sorted(by_id)]


# ---------------------------------------------------------------- recording a step

@contextmanager
def recorded_launches() -> Iterator[list[tuple[ExecItem, float | None]]]:
  """Every compiled kernel launched in the block, with its DEBUG=2 event time: DEBUG=2 is set for the block, and
  ExecItem._print (where every launch passes at DEBUG=2) records instead of printing."""
  launches: list[tuple[ExecItem, float | None]] = []
  original = ExecItem._print

  def record(item: ExecItem, seconds: float | None) -> None:
    # a copy: an eager realize hands its ExecItems back after the launch (engine/realize.release empties their
    # buffers, and the next replay of the schedule runs the same objects on new buffers)
    if isinstance(item.runner, CompiledRunner):
      launches.append((dataclasses.replace(item, bufs=list(item.bufs), var_vals=dict(item.var_vals)), seconds))
  previous = os.environ.get("DEBUG")
  os.environ["DEBUG"] = "2"
  ExecItem._print = record  # type: ignore[method-assign]
  try:
    yield launches
  finally:
    ExecItem._print = original  # type: ignore[method-assign]
    if previous is None: del os.environ["DEBUG"]
    else: os.environ["DEBUG"] = previous


# ---------------------------------------------------------------- printing

def print_table(rows: list[KernelRow], reference: CopyReference, time_label: str, event_label: str | None) -> None:
  """One line per launch, slowest first, then the totals per role group."""
  event_header = f" {event_label:>8}" if event_label else ""
  print(f"{'kernel':<32} {time_label:>8}{event_header} {'MB':>7} {'GB/s':>7} {'%copy':>6} {'%same':>6} "
        f"{'GFLOP/s':>8}  {'kind':<22} {'role':<42} axes")
  for row in sorted(rows, key=lambda row: -row.seconds):
    gbs = row.moved / max(row.seconds, 1e-12)
    event = f" {row.event_seconds * 1e3:8.3f}" if event_label and row.event_seconds is not None else \
      (f" {'-':>8}" if event_label else "")
    print(f"{row.name:<32} {row.seconds * 1e3:8.3f}{event} {row.moved / 1e6:7.2f} {gbs / 1e9:7.0f} "
          f"{gbs / reference.peak * 100:5.1f}% {gbs / reference.same(row.moved) * 100:5.0f}% "
          f"{row.ops / max(row.seconds, 1e-12) / 1e9:8.0f}  {row.kind:<22} {row.role:<42} {row.axes}")
  groups: dict[str, list[KernelRow]] = {}
  for row in rows: groups.setdefault(role_group(row.role) or row.kind or row.name, []).append(row)
  print(f"\nper role (its kernels together: summed time and bytes; the issue's rows are the conv weight gradients and "
        f"the batchnorm statistics)\n{'role':<42} {'kernels':>7} {time_label:>8} {'MB':>7} {'GB/s':>7} {'%copy':>6}")
  for group, members in sorted(groups.items(), key=lambda entry: -sum(row.seconds for row in entry[1])):
    seconds, moved = sum(row.seconds for row in members), sum(row.moved for row in members)
    gbs = moved / max(seconds, 1e-12)
    print(f"{group:<42} {len(members):7d} {seconds * 1e3:8.3f} {moved / 1e6:7.2f} {gbs / 1e9:7.0f} "
          f"{gbs / reference.peak * 100:5.1f}%")


def median_by_launch(runs: list[list[float | None]]) -> list[float | None]:
  """Each launch's median over steps (the same kernels launch in the same order every step)."""
  medians: list[float | None] = []
  for index in range(len(runs[0])):
    values = [run[index] for run in runs if run[index] is not None]
    medians.append(statistics.median(values) if values else None)
  return medians
