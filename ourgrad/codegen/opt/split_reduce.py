"""Split reduces: whether a reduce with few outputs and a long reduce runs as two kernels, and into how many parts.

One kernel per reduce gives a GPU as many thread blocks as the heuristic makes of the outputs: a block per output
for a reduce along the input's contiguous axis (ROWS), one per COLUMN_LOCALS outputs for a reduce across it
(COLUMNS: a Linear bias gradient, (4096, 768) summed over the tokens, is 24 blocks), one per BLOCK_THREADS register
tiles for a matmul-like one. With fewer blocks than the device has multiprocessors, most of them idle and the reduce
runs at a fraction of the memory bandwidth (24 blocks: ~700 GB/s of an H200's ~4 TB/s). Such a reduce is split: the
first kernel sums `parts` pieces of its longest reduce axis into partial results (parts outermost), the second sums
the parts (deterministic: no atomics). It splits only where the time the idle multiprocessors would cost is more
than a second launch (`saves_more_than_a_launch`, from the device's launch_bytes). The parts are sized so that the
first kernel has one wave of blocks, each piece long enough to be worth a partial's store and load.

The facts come from the device's renderer (`SplitFacts.of`): its multiprocessors (CUDA reads the SM count from the
driver) and the threads one multiprocessor keeps resident (CUDA: from the driver too). A renderer that does not know
them (the PYTHON interpreter, OpenCL) is taken for a GPU of DEFAULT_MULTIPROCESSORS. CPUs (no thread blocks) split
only huge reduces, for their cores (`cpu_split_parts`). DEBUG=3 prints each GPU split; docs/codegen.md ("Split-K")
tells the rule with examples.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from ourgrad.codegen.opt.heuristic import BLOCK_THREADS, COLUMN_LOCALS, SHORT_REDUCE
from ourgrad.helpers import DEBUG, prod

# a renderer with thread blocks that does not know its multiprocessors (the PYTHON interpreter, OpenCL) is taken for
# a GPU of this many, resident threads as many as CUDA's (sm_80/sm_90 keep 2048 a multiprocessor)
DEFAULT_MULTIPROCESSORS = 128
DEFAULT_THREADS_PER_MULTIPROCESSOR = 2048
# parts per output at most (the second kernel reduces this many: one block's row of 4 elements a thread)
MAX_PARTS = 1024
# a split below this many parts gains too little to pay for the second kernel's launch
MIN_PARTS = 4
# elements of one part at least, by kind: a ROWS part is reduced by a block of BLOCK_THREADS threads, 4 elements each
# (more, smaller parts left MNIST's first batchnorm statistics 2 waves of blocks that combined more than they loaded);
# a COLUMNS part by a warp of neighbouring outputs, GROUPTOP threads along the part: a part shorter than the
# heuristic's SHORT_REDUCE would be a loop per thread instead, and register tiles where an input is broadcast (a
# LayerNorm weight gradient's per-token statistics: 12 blocks); a MATMUL part by threads that each hold a register
# tile of outputs (H100, MNIST conv2 weight gradient: 32 parts of 512 products 0.061 ms; 128 of 128: 0.344 ms)
MIN_PART_ROWS = 4 * BLOCK_THREADS
MIN_PART_COLUMNS = SHORT_REDUCE
MIN_PART_MATMUL = 512
# outputs of a matmul-like reduce one GPU thread computes (a register tile)
MATMUL_THREAD_OUTPUTS = 16
# a reduce of at least this many elements per output (and few outputs) is split on a CPU, for its cores
CPU_SPLIT_MIN_ELEMENTS = 1 << 16


class ReduceKind(Enum):
  """How the heuristic lays a reduce's outputs on threads (see the module docstring)."""
  ROWS = "rows"         # the input's contiguous axis is reduced: a block of threads per output
  COLUMNS = "columns"   # the contiguous axis is an output axis: neighbouring threads take neighbouring outputs
  MATMUL = "matmul"     # an input reused across outputs while it varies along the reduce: register tiles


@dataclass(frozen=True)
class SplitFacts:
  """What the split decision asks of the device."""
  multiprocessors: int
  threads_per_multiprocessor: int
  launch_bytes: int = 0   # bytes the device's memory moves in the time of one kernel launch (Renderer.launch_bytes)

  @staticmethod
  def of(renderer: Any) -> SplitFacts:
    """The renderer's facts (DEFAULT_* where it does not know them). FACTS_OVERRIDE, where a test sets it."""
    if FACTS_OVERRIDE is not None: return FACTS_OVERRIDE
    return SplitFacts(getattr(renderer, "multiprocessors", 0) or DEFAULT_MULTIPROCESSORS,
                      getattr(renderer, "threads_per_multiprocessor", 0) or DEFAULT_THREADS_PER_MULTIPROCESSOR,
                      getattr(renderer, "launch_bytes", 0))

  @property
  def wave_threads(self) -> int:
    """Threads the whole device keeps resident at once."""
    return self.multiprocessors * self.threads_per_multiprocessor

  @property
  def wave_blocks(self) -> int:
    """Blocks of BLOCK_THREADS threads the whole device keeps resident at once (H100, H200: 132 x 2048 / 256)."""
    return max(self.wave_threads // BLOCK_THREADS, 1)


# tests set small facts here, so that small shapes (fast on the PYTHON interpreter) split as large ones do on a GPU
FACTS_OVERRIDE: SplitFacts | None = None


def outputs_per_block(kind: ReduceKind) -> int:
  """Outputs one thread block of the heuristic's default kernel computes, for a reduce of this kind."""
  if kind is ReduceKind.ROWS: return 1
  if kind is ReduceKind.COLUMNS: return COLUMN_LOCALS
  return BLOCK_THREADS * MATMUL_THREAD_OUTPUTS


def min_part(kind: ReduceKind) -> int:
  """Elements of one part at least (MIN_PART_*)."""
  if kind is ReduceKind.ROWS: return MIN_PART_ROWS
  return MIN_PART_COLUMNS if kind is ReduceKind.COLUMNS else MIN_PART_MATMUL


def leaves_device_idle(facts: SplitFacts, kind: ReduceKind, outputs: int) -> bool:
  """Whether one kernel of this reduce leaves the GPU's multiprocessors idle: fewer blocks than multiprocessors for
  a plain reduce; for a matmul-like one, fewer register-tile threads than a wave has blocks (its kernel takes GROUP
  threads along the reduce too, heuristic._group_for_parallelism; larger matmuls are the grid model's to split,
  matmul_grid.split_k_parts)."""
  if kind is ReduceKind.MATMUL: return outputs < facts.wave_blocks * MATMUL_THREAD_OUTPUTS
  return -(-outputs // outputs_per_block(kind)) < facts.multiprocessors


def saves_more_than_a_launch(facts: SplitFacts, kind: ReduceKind, outputs: int, input_bytes: int) -> bool:
  """Whether the split saves more time than its second kernel's launch costs. Unsplit, `blocks` of the device's
  multiprocessors stream the input; split, all of them: the time saved is the input's bytes x (multiprocessors /
  blocks - 1) at the device's bandwidth, a launch costs `facts.launch_bytes` at it. A full sum of 4096 floats
  (16 KB, one block) stays one kernel; a bias gradient of 4096 x 768 floats (12.6 MB, 24 blocks) splits."""
  blocks = -(-outputs // outputs_per_block(kind))
  return input_bytes * (facts.multiprocessors - blocks) > facts.launch_bytes * blocks


def gpu_split_parts(facts: SplitFacts, kind: ReduceKind, outputs: int, elements_per_output: int,
                    split_size: int, input_bytes: int = 0) -> int | None:
  """Parts of the reduce axis of `split_size` elements, for a GPU: where one kernel would leave multiprocessors
  idle (leaves_device_idle) by more than a launch's worth (saves_more_than_a_launch, for the `input_bytes` it
  reads), enough parts for a wave of blocks (`facts.wave_blocks`), each part at least
  `min_part(kind)` elements, at most MAX_PARTS; a divisor of `split_size`. None: no split (the reduce fills the
  device already, or is too short to split into MIN_PARTS parts)."""
  per_block = outputs_per_block(kind)
  if not leaves_device_idle(facts, kind, outputs): return None
  if not saves_more_than_a_launch(facts, kind, outputs, input_bytes): return None
  wanted = min(MAX_PARTS, elements_per_output // min_part(kind), -(-facts.wave_blocks * per_block // outputs))
  parts = max((parts for parts in range(1, min(wanted, split_size) + 1) if split_size % parts == 0), default=1)
  return parts if parts >= MIN_PARTS else None


def cpu_split_parts(outputs: int, elements_per_output: int, split_size: int) -> int | None:
  """Parts for a CPU: a reduce of at least CPU_SPLIT_MIN_ELEMENTS per output into few outputs (a full sum), up to 256,
  dividing the reduce axis of `split_size` into pieces of at least 8. None where the reduce is not split."""
  if elements_per_output < CPU_SPLIT_MIN_ELEMENTS or outputs * 64 > elements_per_output: return None
  return next((parts for parts in (256, 128, 64, 32, 16, 8) if split_size % parts == 0 and split_size // parts >= 8),
              None)


@dataclass(frozen=True)
class ReduceSplit:
  """A split decision: the input axis whose `parts` pieces the first kernel sums; `parts_outermost` (GPUs): the
  first kernel stores (parts, outputs...), so the output axes a GPU kernel tiles stay innermost."""
  axis: int
  parts: int
  parts_outermost: bool


def plan_split(renderer: Any, shape: tuple[int, ...], axes: tuple[int, ...], kind: ReduceKind,
               itemsize: int) -> ReduceSplit | None:
  """Whether (and how) a reduce of `shape` (elements of `itemsize` bytes) over `axes` on `renderer`'s device is split
  (GPU: gpu_split_parts from the device's facts; CPU: cpu_split_parts). The longest reduce axis is split: the batch
  of a weight gradient or of batchnorm statistics, the tokens of a bias gradient."""
  axis = max(axes, key=lambda a: shape[a])
  outputs = prod(size for a, size in enumerate(shape) if a not in axes)
  elements_per_output = prod(shape) // outputs
  if renderer.runs_thread_blocks:
    facts = SplitFacts.of(renderer)
    parts = gpu_split_parts(facts, kind, outputs, elements_per_output, shape[axis], prod(shape) * itemsize)
    if DEBUG >= 3 and parts is not None:
      print(f"split reduce: {shape} over {axes} ({kind.value}, {outputs} outputs: "
            f"{-(-outputs // outputs_per_block(kind))} blocks for {facts.multiprocessors} multiprocessors) -> "
            f"{parts} parts of axis {axis}")
    if parts is not None: return ReduceSplit(axis, parts, True)
  parts = cpu_split_parts(outputs, elements_per_output, shape[axis])
  return ReduceSplit(axis, parts, False) if parts is not None else None
