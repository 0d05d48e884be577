"""Split reduces: whether a reduce with few outputs and a long reduce runs as two kernels, and into how many parts.

One kernel per reduce gives a GPU as many thread blocks as the heuristic makes of the outputs: a block per output
for a reduce along the input's contiguous axis (ROWS), one per COLUMN_LOCALS outputs for a reduce across it
(COLUMNS: a Linear bias gradient, (4096, 768) summed over the tokens, is 24 blocks), one per BLOCK_THREADS register
tiles for a matmul-like one. With fewer blocks than the device has multiprocessors, most of them idle and the reduce
runs at a fraction of the memory bandwidth (24 blocks: ~700 GB/s of an H200's ~4 TB/s). Such a reduce is split: the
first kernel sums `parts` pieces of its longest reduce axis into partial results (parts outermost), the second sums
the parts (deterministic: no atomics). It splits only where the time one kernel would take is more than the split's
two kernels take, a launch included (`saves_more_than_a_launch`, a model of memory bandwidth and latency from the
device's launch_bytes and latency_bytes). The parts are sized so that the first kernel has one wave of blocks, each
piece long enough to be worth a partial's store and load.

The facts come from the device's renderer (`SplitFacts.of`): its multiprocessors (CUDA reads the SM count from the
driver) and the threads one multiprocessor keeps resident (CUDA: from the driver too). A renderer that does not know
them (the PYTHON interpreter, OpenCL) is taken for renderer.ASSUMED_THREAD_BLOCK_GPU. CPUs (no thread blocks) split
only huge reduces, for their cores (`cpu_split_parts`). DEBUG=3 prints each GPU split; docs/codegen.md ("Split-K")
tells the rule with examples.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from ourgrad.codegen.opt.heuristic import BLOCK_THREADS, COLUMN_LOCALS, SHORT_REDUCE
from ourgrad.helpers import DEBUG, power_of_two_divisor, prod
from ourgrad.renderer import ASSUMED_THREAD_BLOCK_GPU

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
# loads one GPU thread keeps in flight at most: the compiler overlaps as many loop iterations of a reduce as fit this
# many loads (registers waiting on memory). The H200's one-kernel rows: a plain column sum (1 load an iteration) moves
# a block's SM share, ~16 iterations a latency; MNIST's bn2 statistics backward (6 loads) ~1-2 (bench_fewout_h200_s9,
# bench_mnist_table_h200_s9b)
LOADS_IN_FLIGHT = 16
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
  latency_bytes: int = 0  # bytes it moves in the time one load waits for memory (Renderer.latency_bytes; 0: no bound)

  @staticmethod
  def of(renderer: Any) -> SplitFacts:
    """The renderer's facts (renderer.ASSUMED_THREAD_BLOCK_GPU's where it does not know them). FACTS_OVERRIDE, where a
    test sets it."""
    if FACTS_OVERRIDE is not None: return FACTS_OVERRIDE
    assumed = ASSUMED_THREAD_BLOCK_GPU
    return SplitFacts(getattr(renderer, "multiprocessors", 0) or assumed.multiprocessors,
                      getattr(renderer, "threads_per_multiprocessor", 0) or assumed.threads_per_multiprocessor,
                      getattr(renderer, "launch_bytes", 0), getattr(renderer, "latency_bytes", 0))

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


def block_outputs(kind: ReduceKind, outputs: int) -> int:
  """Outputs one block of a plain (ROWS or COLUMNS) reduce's kernel computes, as the heuristic lays them out: one
  for ROWS; for COLUMNS the largest power of two dividing the outputs up to COLUMN_LOCALS (its LOCAL threads; the
  block's other threads GROUPTOP over the reduce: a classifier's 10 bias gradients are 5 blocks of 2 x 128 threads)."""
  return 1 if kind is ReduceKind.ROWS else power_of_two_divisor(outputs, COLUMN_LOCALS)


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


def iterations_in_flight(loads_per_element: int) -> int:
  """Loop iterations of a reduce whose loads one GPU thread has in flight together: LOADS_IN_FLIGHT / the loads one
  element takes (the distinct buffers its value reads), at least one."""
  return max(LOADS_IN_FLIGHT // max(loads_per_element, 1), 1)


def stream_cost(facts: SplitFacts, input_bytes: int, blocks: int, iterations: int, in_flight: int) -> int:
  """The time of a kernel of `blocks` blocks sharing `input_bytes`, each of its threads looping `iterations` times
  with `in_flight` iterations' loads in flight, in bytes at the device's bandwidth: the slower of the bandwidth its
  blocks get (a block streams at most its multiprocessor's share) and the memory latencies its threads wait in turn,
  once for each round of a wave of blocks (a block of 256 threads with one 4-byte load in flight each moves 1 KB a
  latency: 1.5 GB/s on the H200, not its SM share of 32 GB/s)."""
  bandwidth_cost = input_bytes * facts.multiprocessors // max(min(blocks, facts.multiprocessors), 1)
  rounds = -(-blocks // facts.wave_blocks)
  latency_cost = rounds * -(-iterations // in_flight) * facts.latency_bytes
  return max(bandwidth_cost, latency_cost)


def saves_more_than_a_launch(facts: SplitFacts, kind: ReduceKind, outputs: int, elements_per_output: int,
                             itemsize: int, parts: int, loads_per_element: int = 1) -> bool:
  """Whether `parts` parts take less time than one kernel, the second kernel's launch included (stream_cost, in bytes
  at the device's bandwidth). One kernel has `blocks` blocks of BLOCK_THREADS threads, each thread looping over its
  share of its block's values; split, the first kernel has `parts` times the blocks, each thread's loop `parts` times
  shorter, and the second kernel sums parts x outputs values (a column reduce). A full sum of 4096 floats (16 KB, one
  block of 16 iterations) stays one kernel; a bias gradient of 4096 x 768 floats (12.6 MB, 24 blocks) splits, and so
  does MNIST's bn2 statistics backward (32 blocks of 16,384 values of 6 loads: 64 iterations, 2 in flight). A
  matmul-like reduce (register tiles: many loads in flight), or a device whose latency is unknown, counts the
  bandwidth alone: input bytes x (multiprocessors - blocks) > launch_bytes x blocks."""
  input_bytes = outputs * elements_per_output * itemsize
  if kind is ReduceKind.MATMUL or facts.latency_bytes == 0:
    blocks = -(-outputs // outputs_per_block(kind))
    return input_bytes * (facts.multiprocessors - blocks) > facts.launch_bytes * blocks
  in_flight = iterations_in_flight(loads_per_element)
  blocks = -(-outputs // block_outputs(kind, outputs))
  block_values = elements_per_output * block_outputs(kind, outputs)
  one_kernel = stream_cost(facts, input_bytes, blocks, -(-block_values // BLOCK_THREADS), in_flight)
  first = stream_cost(facts, input_bytes, blocks * parts, -(-block_values // (parts * BLOCK_THREADS)), in_flight)
  # the second kernel: a column reduce of the parts (the parts outermost), one load an element
  second_outputs = block_outputs(ReduceKind.COLUMNS, outputs)
  second_blocks = -(-outputs // second_outputs)
  second_iterations = -(-parts * second_outputs // BLOCK_THREADS)
  second = stream_cost(facts, parts * outputs * itemsize, second_blocks, second_iterations, LOADS_IN_FLIGHT)
  return one_kernel > first + facts.launch_bytes + second


def gpu_split_parts(facts: SplitFacts, kind: ReduceKind, outputs: int, elements_per_output: int,
                    split_size: int, itemsize: int = 4, loads_per_element: int | Callable[[], int] = 1) -> int | None:
  """Parts of the reduce axis of `split_size` elements, for a GPU: where one kernel would leave multiprocessors
  idle (leaves_device_idle), enough parts for a wave of blocks (`facts.wave_blocks`), each part at least
  `min_part(kind)` elements, at most MAX_PARTS; a divisor of `split_size`; and only where the split saves more than
  its second launch costs (saves_more_than_a_launch, for elements of `itemsize` bytes that each read
  `loads_per_element` buffers). None: no split (the reduce fills the device already, is too short to split into
  MIN_PARTS parts, or one kernel is as fast). `loads_per_element` may be a function, asked only where the cheap
  checks leave a split to decide (counting the loads walks the reduced expression: eager graph building pays it)."""
  per_block = outputs_per_block(kind)
  if not leaves_device_idle(facts, kind, outputs): return None
  wanted = min(MAX_PARTS, elements_per_output // min_part(kind), -(-facts.wave_blocks * per_block // outputs))
  parts = max((parts for parts in range(1, min(wanted, split_size) + 1) if split_size % parts == 0), default=1)
  if parts < MIN_PARTS: return None
  if callable(loads_per_element): loads_per_element = loads_per_element()
  if not saves_more_than_a_launch(facts, kind, outputs, elements_per_output, itemsize, parts, loads_per_element):
    return None
  return parts


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
               itemsize: int, loads_per_element: int | Callable[[], int] = 1) -> ReduceSplit | None:
  """Whether (and how) a reduce of `shape` (elements of `itemsize` bytes, each reading `loads_per_element` buffers)
  over `axes` on `renderer`'s device is split (GPU: gpu_split_parts from the device's facts; CPU: cpu_split_parts).
  The longest reduce axis is split: the batch of a weight gradient or of batchnorm statistics, the tokens of a bias
  gradient."""
  axis = max(axes, key=lambda a: shape[a])
  outputs = prod(size for a, size in enumerate(shape) if a not in axes)
  elements_per_output = prod(shape) // outputs
  if renderer.runs_thread_blocks:
    facts = SplitFacts.of(renderer)
    parts = gpu_split_parts(facts, kind, outputs, elements_per_output, shape[axis], itemsize, loads_per_element)
    if DEBUG >= 3 and parts is not None:
      print(f"split reduce: {shape} over {axes} ({kind.value}, {outputs} outputs: "
            f"{-(-outputs // outputs_per_block(kind))} blocks for {facts.multiprocessors} multiprocessors, "
            f"{loads_per_element() if callable(loads_per_element) else loads_per_element} loads a value) -> "
            f"{parts} parts of axis {axis}")
    if parts is not None: return ReduceSplit(axis, parts, True)
  parts = cpu_split_parts(outputs, elements_per_output, shape[axis])
  return ReduceSplit(axis, parts, False) if parts is not None else None
