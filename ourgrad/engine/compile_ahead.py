"""Compile a schedule's new kernels side by side before it runs (COMPILE_THREADS).

A cold first step (a model's first token, a training step) meets dozens of kernels this process has not compiled,
and each compile is a C compiler subprocess that the engine would otherwise wait for one at a time. Before
run_schedule launches anything, `compile_ahead` renders every new kernel (code generation is Python and not thread
safe: it stays in this thread, in schedule order) and hands the compiles the disk cache cannot answer to a small pool
of threads. `CompileAhead.ready(index)` then waits for that item's own binary only, loads it and puts its runner in
the compiled-kernel cache, so kernel i launches as soon as its compile ends while later ones still compile.

Only who produces the binaries changes: the disk cache (device.Compiler) stays the one place binaries live and the
compiled-kernel cache (realize._runner_cache) the one place runners live. A kernel whose rendering or compile fails,
or whose binary does not load, is left to get_runner, which redoes it as with COMPILE_THREADS=1: it raises, or falls
back to the unoptimized kernel with the same OptimizationFallbackWarning, at the item's turn.
Compilers whose compile holds the GIL or is not known to be thread safe (Compiler.concurrent_compiles False) keep
the serial path.
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
from ourgrad.engine.realize import _lowering_facts, _runner_cache, get_kernel, kernel_runner, load_program, \
  render_kernel
from ourgrad.engine.schedule import ScheduleItem
from ourgrad.helpers import env_var, tf32_allowed
from ourgrad.ops import Ops

COMPILE_THREADS = env_var("COMPILE_THREADS", 0, "threads that compile a schedule's new kernels side by side "
                          "(engine/compile_ahead.py); 0: min(CPU count, 8); 1: one at a time, as each kernel launches")
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
  """A new kernel of the schedule, rendered in this thread: its binary comes from the disk cache (compile is None)
  or from a compile thread."""
  device: str
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
    """Before item `index` is lowered: if it is the first launch of a new kernel, wait for that kernel's binary and
    cache its runner. A failure leaves the kernel to get_runner (the serial path, with its errors and fallback)."""
    entry = self.rendered.pop(index, None)
    if entry is None: return
    key, rendered = entry
    runner = _finish(rendered, self.stored)
    if runner is not None: _runner_cache[key] = runner


@host_phase("compile", lambda rendered, stored: rendered.name)
def _finish(rendered: RenderedKernel, stored: set[int]) -> Any:
  device = Device[rendered.device]
  source = rendered.lowered.source
  try:
    if rendered.compile is None: program = load_program(rendered.device, rendered.name, source)
    else:
      binary = rendered.compile.result()
      if id(rendered.compile) not in stored: device.compiler.store_cached(source, binary)
      stored.add(id(rendered.compile))
      program = device.program(rendered.name, binary)
  except Exception:  # compilers and loaders raise what their tools raise: get_runner redoes it and reports it
    return None
  return kernel_runner(rendered.kernel, rendered.name, rendered.lowered, program)


def new_kernel_keys(schedule: list[ScheduleItem]) -> dict[int, RunnerKey]:
  """{index of the first item of each kernel not compiled yet in this process: its runner-cache key}."""
  new: dict[int, RunnerKey] = {}
  seen: set[RunnerKey] = set()
  tf32 = tf32_allowed()
  for index, item in enumerate(schedule):
    if item.ast.op is Ops.COPY: continue
    key = (item.outputs[0].device, _lowering_facts(item.ast)[0], tf32)
    if key in seen or key in _runner_cache: continue
    seen.add(key)
    new[index] = key
  return new


@host_phase("codegen", lambda key: key[1].op.name)
def _render(key: RunnerKey) -> tuple[AnyKernel, str, LoweredKernel] | None:
  device, ast, _ = key
  try:
    kernel = get_kernel(ast, device)
    kernel.print_debug()
    return (kernel, *render_kernel(kernel, device))
  except Exception:  # raised again by get_runner at the item's turn, after the items before it ran, as today
    return None


def compile_ahead(schedule: list[ScheduleItem]) -> CompileAhead | None:
  """Render the schedule's new kernels and start the compiles the disk cache does not answer, or None where there is
  nothing to overlap: COMPILE_THREADS=1, fewer than two new kernels, or compilers that compile one at a time."""
  threads = compile_threads()
  if threads <= 1 or len(schedule) < 2: return None
  new = new_kernel_keys(schedule)
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
    rendered[index] = (key, RenderedKernel(device, kernel, name, lowered, future))
  return CompileAhead(rendered)
