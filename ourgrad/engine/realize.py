"""Run a schedule: lower each ScheduleItem to a runner (a compiled kernel or a copy) and launch it.

Compiled kernels are cached in memory by (device, AST) and on disk by source (see device.Compiler), so the
same kernel is generated once per process and compiled once per machine.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import INDEX_DTYPE, linearize
from ourgrad.codegen.uops import AxisType, UOp, UOps, format_uops
from ourgrad.device import Buffer, Device
from ourgrad.engine.schedule import ScheduleItem
from ourgrad.errors import CompileError, DeviceError
from ourgrad.helpers import DEBUG, NOOPT, GlobalCounters, colored, prod
from ourgrad.ops import LazyOp, Ops


@dataclass
class CompiledRunner:
  """A compiled kernel and what it costs: ops and bytes estimated from its UOps."""
  name: str
  display_name: str
  source: str
  program: Any
  global_size: tuple[int, ...]
  local_size: tuple[int, ...]
  op_count: int
  byte_count: int

  def __call__(self, buffers: tuple[Buffer, ...], wait: bool = False) -> float | None:
    return self.program(*[buffer.handle for buffer in buffers], global_size=self.global_size,
                        local_size=self.local_size, wait=wait)


_runner_cache: dict[tuple[str, LazyOp], CompiledRunner] = {}


def get_kernel(ast: LazyOp, device: str) -> Kernel:
  """The Kernel for an AST with the default optimizations applied (none with NOOPT=1)."""
  kernel = Kernel(ast, Device[device].renderer)
  if not NOOPT: kernel.hand_coded_optimizations()
  return kernel


class OptimizationFallbackWarning(RuntimeWarning):
  """An optimized kernel failed to compile or load, and its unoptimized version runs instead."""


def get_runner(device: str, ast: LazyOp) -> CompiledRunner:
  """The compiled kernel of an AST. If the optimized kernel fails to compile or load (it may exceed a device limit
  the heuristics do not model: registers, shared memory, code size), the unoptimized one is used instead."""
  key = (device, ast)
  if key not in _runner_cache:
    kernel = get_kernel(ast, device)
    kernel.print_debug()
    try:
      runner = compile_kernel(kernel, device)
    except (CompileError, DeviceError) as error:
      if not kernel.applied_opts: raise
      reason = str(error).splitlines()[0] if str(error) else type(error).__name__
      # a warning, not a print: the test suite turns it into an error, so an optimizer bug cannot hide here
      warnings.warn(f"{kernel.name} with opts {kernel.applied_opts} failed to compile or load ({reason}); "
                    f"using the unoptimized kernel", OptimizationFallbackWarning, stacklevel=2)
      plain = Kernel(ast, Device[device].renderer)
      plain.print_debug()
      runner = compile_kernel(plain, device)
    _runner_cache[key] = runner
  return _runner_cache[key]


def load_program(device: str, name: str, source: str) -> Any:
  """Compile `source` (or take it from the disk cache) and load it. A cached binary that the device cannot load
  (damaged, or written by another toolchain) is deleted with a warning, recompiled and rewritten."""
  compiled = Device[device]
  cached = compiled.compiler.load_cached(source)
  if cached is None: return compiled.program(name, compiled.compiler.compile_cached(source))
  try:
    return compiled.program(name, cached)
  except Exception as error:  # loaders raise whatever their library raises (OSError from dlopen, driver errors)
    warnings.warn(f"the cached binary of kernel {name} failed to load ({type(error).__name__}: {error}); "
                  f"deleted and recompiled", RuntimeWarning, stacklevel=2)
    compiled.compiler.evict(source)
    return compiled.program(name, compiled.compiler.compile_cached(source, refresh=True))


def compile_kernel(kernel: Kernel, device: str) -> CompiledRunner:
  uops = linearize(kernel)
  if DEBUG >= 5: print(format_uops(uops))
  name = kernel.name
  source = Device[device].renderer.render(name, uops)
  if DEBUG >= 4: print(source)
  program = load_program(device, name, source)
  op_count, byte_count = estimate_cost(kernel, uops)
  global_size, local_size = launch_dims(uops)
  return CompiledRunner(name, kernel.colored_shape(), source, program, global_size, local_size, op_count, byte_count)


def launch_dims(uops: list[UOp]) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(blocks, threads per block) along x, y, z from a kernel's SPECIAL uops; CPU kernels launch once."""
  blocks, threads = [1, 1, 1], [1, 1, 1]
  for uop in uops:
    if uop.op is UOps.SPECIAL:
      _, size, dimension, kind = uop.arg
      (blocks if kind is AxisType.GLOBAL else threads)[dimension] = size
  return tuple(blocks), tuple(threads)


def estimate_cost(kernel: Kernel, uops: list[UOp]) -> tuple[int, int]:
  """(arithmetic ops, bytes moved) of one launch: ALUs weighted by the loops around them; each buffer's
  bytes counted once over the elements its view can touch."""
  blocks, threads = launch_dims(uops)
  op_count, multiplier, multipliers = 0, prod(blocks) * prod(threads), []
  for uop in uops:
    if uop.op is UOps.RANGE:
      multipliers.append(multiplier)
      multiplier *= uop.srcs[1].arg - uop.srcs[0].arg
    elif uop.op is UOps.ENDRANGE:
      multiplier = multipliers.pop()
    elif uop.op in (UOps.ALU, UOps.ACCUMULATE) and uop.dtype is not None and uop.dtype != INDEX_DTYPE:
      op_count += multiplier
  byte_count = 0
  seen: set[int] = set()
  for leaf, st in zip(kernel.leaves, kernel.sts):
    if leaf.op not in (Ops.LOAD, Ops.STORE) or leaf.arg.idx in seen: continue
    seen.add(leaf.arg.idx)
    touched = min(st.real_size(), prod(st.shape)) if leaf.op is Ops.LOAD else prod(st.shape)
    byte_count += touched * leaf.dtype.itemsize
  return op_count, byte_count


def run_schedule(schedule: list[ScheduleItem]) -> None:
  """Launch every item in order, counting kernels, ops and bytes in GlobalCounters."""
  for item in schedule:
    for buffer in item.outputs: buffer.allocate()
    if item.ast.op is Ops.COPY:
      _run_copy(item)
      continue
    device = item.outputs[0].device
    runner = get_runner(device, item.ast)
    timing = runner(item.bufs, wait=DEBUG >= 2)
    GlobalCounters.kernel_count += 1
    GlobalCounters.global_ops += runner.op_count
    GlobalCounters.global_mem += runner.byte_count
    if timing is not None: GlobalCounters.time_sum_s += timing
    if DEBUG >= 2: _print_launch(runner, device, timing)


def _run_copy(item: ScheduleItem) -> None:
  destination, source = item.outputs[0], item.inputs[0]
  start = time.perf_counter()
  mapped = getattr(Device[source.device].allocator, "as_memoryview", None)
  if mapped is not None:
    # the source is a memory-mapped file (DISK): its bytes go from the mapping straight into the destination, with
    # no staging copy, and only the pages of this buffer's window are read
    if source.nbytes: destination.copyin(mapped(source.handle))
  else:
    staging = memoryview(bytearray(source.nbytes))
    source.copyout(staging)
    destination.copyin(staging)
  GlobalCounters.global_mem += 2 * source.nbytes
  if DEBUG >= 2:
    elapsed = time.perf_counter() - start
    print(f"{colored('copy', 'yellow'):>28} {source.nbytes:>10} bytes {source.device} -> {destination.device} "
          f"{elapsed * 1e6:9.2f} us")


def _print_launch(runner: CompiledRunner, device: str, timing: float | None) -> None:
  seconds = timing or 1e-9
  print(f"*** {device:<7} {GlobalCounters.kernel_count:4d} {runner.name:<28} {runner.display_name:<40} "
        f"{seconds * 1e6:9.2f} us  {runner.op_count / seconds / 1e9:8.2f} GFLOP/s  "
        f"{runner.byte_count / seconds / 1e9:8.2f} GB/s")
