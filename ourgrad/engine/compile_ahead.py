"""Compile a schedule's new kernels side by side (COMPILE_THREADS).

A cold first step (a model's first token, a training step) meets dozens of kernels this process has not compiled,
and each compile is a C compiler subprocess that the engine would otherwise wait for one at a time. When
run_schedule meets its schedule's first new kernel (compiled as usual), `compile_ahead` renders every later new
kernel (code generation is Python and not thread safe: it stays in this thread, in schedule order) and hands the
compiles the disk cache cannot answer to a small pool of threads. `CompileAhead.ready(index)` then waits for that
item's own binary only and caches its runner, so kernel i launches as soon as its compile ends while later ones
still compile. A warm schedule (no new kernel) never gets here: it pays one comparison per item.

Only who produces the binaries changes: the disk cache (device.Compiler) stays the one place binaries live, and
each runner is still made by realize's compile path (compile_or_fall_back, with the rendering handed over, loading
the binary from the disk cache), at its item's turn: a kernel that fails to compile falls back to its unoptimized
version with the same OptimizationFallbackWarning, or raises, as with COMPILE_THREADS=1. A compile that failed in a
thread, or a kernel that failed to render, is left to get_runner, which redoes it serially and reports it in full.
Compilers whose compile holds the GIL or is not known to be thread safe (Compiler.concurrent_compiles False: all
but CLANG and CUDA) keep the serial path.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ourgrad.codegen.lowering import AnyKernel, LoweredKernel
from ourgrad.device import Device
from ourgrad.engine.profile import host_phase
from ourgrad.engine import realize
from ourgrad.engine.schedule import ScheduleItem
from ourgrad.helpers import COMPILE_THREADS, DISABLE_COMPILER_CACHE, tf32_allowed
from ourgrad.ops import LazyOp, Ops

MAX_DEFAULT_THREADS = 8

RunnerKey = tuple[str, Any, bool]   # realize._runner_cache's key: (device, unbound AST, TF32 allowed)


def compile_threads() -> int:
  """How many kernels may compile at once (COMPILE_THREADS, its default sized by the CPU count)."""
  setting = int(COMPILE_THREADS.value)
  return setting if setting > 0 else min(os.cpu_count() or 1, MAX_DEFAULT_THREADS)


_pool_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}   # at most one: {its thread count: the pool}


def compile_pool(threads: int) -> ThreadPoolExecutor:
  """The process's compile threads (made on first use, remade when COMPILE_THREADS changes)."""
  with _pool_lock:
    if threads not in _pools:
      # an old pool's running compiles finish and their futures still answer
      for old in _pools.values(): old.shutdown(wait=False)
      _pools.clear()
      _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="ourgrad-compile")
    return _pools[threads]


@dataclass
class RenderedKernel:
  """A new kernel of the schedule, rendered in this thread, with its compile under way (None: the disk cache has its
  binary)."""
  device: str
  ast: LazyOp
  kernel: AnyKernel
  name: str
  lowered: LoweredKernel
  compile: Future[bytes] | None


class CompileAhead:
  """The new kernels of one schedule, by the index of the first item that runs each, with their compiles under way."""

  def __init__(self, rendered: dict[int, tuple[RunnerKey, RenderedKernel]]) -> None:
    self.rendered = rendered
    self.stored: set[int] = set()   # ids of the compiles whose binary is in the disk cache (kernels may share one)

  def ready(self, index: int) -> None:
    """Before item `index` is lowered: if it is the first launch of a new kernel, wait for that kernel's compile and
    cache its runner, through realize's compile path (compile_or_fall_back: the disk cache now answers it)."""
    entry = self.rendered.pop(index, None)
    if entry is None: return
    key, rendered = entry
    if rendered.compile is not None and not self._store(rendered): return
    realize.rendered_ahead[id(rendered.kernel)] = (rendered.kernel, rendered.name, rendered.lowered)
    # at the item's turn, as get_runner would: a kernel that fails falls back, or raises, here
    try:
      realize._runner_cache[key] = realize.compile_or_fall_back(rendered.kernel, rendered.ast, rendered.device)
    finally:
      del realize.rendered_ahead[id(rendered.kernel)]

  @host_phase("compile", lambda self, rendered: rendered.name)
  def _store(self, rendered: RenderedKernel) -> bool:
    """Wait for the kernel's compile and write its binary into the disk cache (once per compile). False where the
    compile failed: get_runner compiles it again at the item's turn and raises or falls back as the serial path."""
    assert rendered.compile is not None
    try:
      binary = rendered.compile.result()
    except Exception:  # compilers raise what their tools raise; the serial compile reports it in full
      return False
    if id(rendered.compile) not in self.stored:
      Device[rendered.device].compiler.store_cached(rendered.lowered.source, binary)
      self.stored.add(id(rendered.compile))
    return True


def new_kernel_keys(schedule: list[ScheduleItem], start: int = 0) -> dict[int, RunnerKey]:
  """{index of the first item (from `start` on) of each kernel not compiled yet in this process: its runner-cache
  key}."""
  new: dict[int, RunnerKey] = {}
  seen: set[RunnerKey] = set()
  tf32 = tf32_allowed()
  for index in range(start, len(schedule)):
    item = schedule[index]
    if item.ast.op is Ops.COPY: continue
    key = (item.outputs[0].device, realize._lowering_facts(item.ast)[0], tf32)
    if key in seen or key in realize._runner_cache: continue
    seen.add(key)
    new[index] = key
  return new


@host_phase("codegen", lambda key: key[1].op.name)
def _render(key: RunnerKey) -> tuple[AnyKernel, str, LoweredKernel] | None:
  device, ast, _ = key
  try:
    kernel = realize.get_kernel(ast, device)
    kernel.print_debug()
    return (kernel, *realize.render_kernel(kernel, device))
  except Exception:  # raised again by get_runner at the item's turn, after the items before it ran, as today
    return None


def compile_ahead(schedule: list[ScheduleItem], start: int = 0) -> CompileAhead | None:
  """Render the new kernels of schedule[start:] and start the compiles the disk cache does not answer, or None where
  there is nothing to overlap: COMPILE_THREADS=1, fewer than two new kernels, compilers that compile one at a time,
  or no disk cache (it hands the binaries to realize's compile path)."""
  threads = compile_threads()
  if threads <= 1 or DISABLE_COMPILER_CACHE or len(schedule) - start < 2: return None
  new = new_kernel_keys(schedule, start)
  if len(new) < 2 or not all(Device[key[0]].compiler.concurrent_compiles for key in new.values()): return None
  pool = compile_pool(threads)
  compiles: dict[tuple[str, str], Future[bytes]] = {}   # by (device, source): one compile per distinct source
  rendered: dict[int, tuple[RunnerKey, RenderedKernel]] = {}
  for index, key in new.items():
    parts = _render(key)
    if parts is None: continue
    kernel, name, lowered = parts
    device = key[0]
    compiler = Device[device].compiler
    future = compiles.get((device, lowered.source))
    if future is None and compiler.load_cached(lowered.source) is None:
      future = compiles[(device, lowered.source)] = pool.submit(compiler.compile, lowered.source)
    rendered[index] = (key, RenderedKernel(device, key[1], kernel, name, lowered, future))
  return CompileAhead(rendered)
