"""One launch for a split reduce: its partials' kernel and their reduce merged where the device has atomics.

`fuse_split_reduces(schedule)` runs after the scheduler has ordered its items, before packing. It merges a kernel A
that stores one buffer P and a later kernel B that reads P alone and reduces it over its first axis
(codegen/last_block.py `second_stage`: a split reduce's second kernel), into one item whose AST is
SPLIT_REDUCE(A's STORE, B's STORE) at A's place, where
- A's device renders ATOMIC_ADD and FENCE (`Renderer.has_block_atomics`: CUDA, and PYTHON with EMULATE=CUDA; other
  devices keep two kernels);
- no item between A and B writes P or touches B's output (B runs earlier now);
- A's kernel, with the opts the heuristic gives it, stores each part's partials of a group of outputs from blocks
  that differ only in the part (`finish_plan`), so the group's last block can sum them. Checking it linearizes A:
  the answer is cached by the merged AST.
DEBUG=3 prints each merge and why a second stage stayed a kernel of its own.
"""
from __future__ import annotations

import warnings

from ourgrad.codegen.index_accumulate import is_index_accumulate
from ourgrad.codegen.last_block import SplitReduceKernel, second_stage
from ourgrad.device import Buffer, Device
from ourgrad.engine.schedule_item import ScheduleItem
from ourgrad.helpers import DEBUG, RUNNER_CACHE_SIZE, SPLIT_LAST_BLOCK, BoundedCache
from ourgrad.ops import LazyOp, Ops

# merged AST -> whether its first kernel's layout lets the last block finish (a linearization each: cached)
_fits: BoundedCache[tuple[str, LazyOp], bool] = BoundedCache(RUNNER_CACHE_SIZE)


def fuse_split_reduces(schedule: list[ScheduleItem]) -> list[ScheduleItem]:
  """The schedule with each split reduce's two kernels merged into one where the module docstring allows."""
  if len(schedule) < 2 or not SPLIT_LAST_BLOCK: return schedule
  writer: dict[int, int] = {}   # buffer id -> the position of the last item writing it
  merged: dict[int, ScheduleItem] = {}   # position of A -> the merged item
  dropped: set[int] = set()
  for position, item in enumerate(schedule):
    first_position = writer.get(id(item.inputs[0])) if len(item.inputs) == 1 else None
    if first_position is not None and first_position not in merged:
      fused = _fused(schedule, first_position, position)
      if fused is not None:
        merged[first_position] = fused
        dropped.add(position)
    for buffer in item.outputs: writer[id(buffer)] = position
  if not merged: return schedule
  return [merged.get(position, item) for position, item in enumerate(schedule) if position not in dropped]


def _fused(schedule: list[ScheduleItem], first_position: int, second_position: int) -> ScheduleItem | None:
  """The merged item of A (at first_position) and B (at second_position), or None with the reason at DEBUG=3."""
  first, second = schedule[first_position], schedule[second_position]
  reason = _why_not_fused(schedule, first_position, second_position)
  if reason is None:
    ast = LazyOp(Ops.SPLIT_REDUCE, (first.ast.renumbered(lambda index: index if index == 0 else index + 1),
                                    second.ast.renumbered(lambda index: 1 - index)), None, second.ast.dtype)
    device = first.outputs[0].device
    key = (device, ast)
    if key not in _fits: _fits[key] = _layout_fits(ast, device)
    if _fits[key]:
      if DEBUG >= 3: print(f"split reduce in one kernel: {first.outputs[0].size} partials -> {second.outputs[0].size}")
      return ScheduleItem(ast, (first.outputs[0], second.outputs[0]), first.inputs)
    reason = "the first kernel's blocks of one group do not store every part of the same outputs"
  if DEBUG >= 3 and second_stage(second.ast) is not None: print(f"split reduce in two kernels: {reason}")
  return None


def _why_not_fused(schedule: list[ScheduleItem], first_position: int, second_position: int) -> str | None:
  """Why A and B cannot merge before their layout is checked, or None."""
  first, second = schedule[first_position], schedule[second_position]
  if second.ast.op is not Ops.STORE or second_stage(second.ast) is None: return "not a reduce over the parts"
  if first.ast.op is not Ops.STORE or len(first.outputs) != 1 or is_index_accumulate(first.ast):
    return "the partials' kernel is not a single store of a loop nest"
  if first.ast.dtype != second.ast.dtype: return "the partials' dtype differs"
  partials, output = first.outputs[0], second.outputs[0]
  if not getattr(Device[partials.device].renderer, "has_block_atomics", False): return "the device has no atomics"
  if any(buffer is output for buffer in first.inputs): return "the partials' kernel reads the output"
  for between in schedule[first_position + 1:second_position]:
    if _touches(between.outputs, partials) or _touches(between.bufs, output): return "an item between them uses them"
  return None


def _touches(buffers: tuple[Buffer, ...], target: Buffer) -> bool: return any(buffer is target for buffer in buffers)


def _layout_fits(ast: LazyOp, device: str) -> bool:
  """Whether the merged kernel, with the heuristic's opts, has a finish plan (codegen/last_block.py)."""
  try:
    kernel = SplitReduceKernel(ast, Device[device].renderer)
    kernel.hand_coded_optimizations()
    return kernel.last_block_plan() is not None
  except Exception as error:  # noqa: BLE001  a kernel the check cannot build keeps two kernels, said as a warning
    # (the test suite turns it into an error, so a bug here cannot hide)
    warnings.warn(f"a split reduce stays two kernels: its one-kernel form failed ({type(error).__name__}: {error})",
                  RuntimeWarning, stacklevel=2)
    return False
