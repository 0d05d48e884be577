"""What runs: `Runner`s (a compiled kernel, a copy, a replayed graph) bound to Buffers as `ExecItem`s.

Lowering a schedule (ourgrad/engine/realize.py) gives a list of ExecItems. `ExecItem.run()` is the one place
where anything is launched, so it is also the one place where
  - the JIT records what a function launches (`capture_into`, used by ourgrad/engine/jit.py),
  - counters (GlobalCounters) and DEBUG=2 lines are written, and
  - a profiler can read each item's time (the `wait=True` launch returns device seconds).
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ourgrad.device import Buffer, Device, HostProgram
from ourgrad.engine.profile import profiler
from ourgrad.helpers import DEBUG, PROFILE, GlobalCounters, colored, environ_lookup
from ourgrad.shape.symbolic import sym_infer


class Runner:
  """Something that runs on buffers: `runner(buffers, wait)` returns device seconds when `wait` (else None)."""
  # plain class attributes, not dataclass fields: subclasses set them (name, display_name, op_count, byte_count)
  name = display_name = "runner"
  op_count = byte_count = 0

  def __call__(self, buffers: list[Buffer], wait: bool = False) -> float | None: raise NotImplementedError


class CompiledRunner(Runner):
  """A compiled kernel and what it costs: ops and bytes estimated from its UOps."""

  def __init__(self, name: str, display_name: str, source: str, program: Any, global_size: tuple[Any, ...],
               local_size: tuple[Any, ...], op_count: int, byte_count: int, var_names: tuple[str, ...] = ()):
    self.name, self.display_name, self.source, self.program = name, display_name, source, program
    self.global_size, self.local_size, self.op_count, self.byte_count = global_size, local_size, op_count, byte_count
    # the kernel's int arguments after the buffers: the values of these symbolic Variables, in this order
    self.var_names = var_names
    # host kernels (CLANG, LLVM) are called straight through ctypes with each buffer's cached address
    self.host_function = program.function if isinstance(program, HostProgram) else None

  def __call__(self, buffers: list[Buffer], wait: bool = False, var_vals: dict[str, int] | None = None) -> float | None:
    if self.var_names: return self._call_symbolic(buffers, wait, var_vals or {})
    if self.host_function is not None and not wait:
      self.host_function(*[buffer.host_pointer() for buffer in buffers])
      return None
    return self.program(*[buffer.handle for buffer in buffers], global_size=self.global_size,
                        local_size=self.local_size, wait=wait)

  def launcher(self) -> Callable[[list[Buffer]], None] | None:
    """A launcher of this kernel for ExecItem.run's fast path: called with the item's buffers, it reads each one's
    memory at launch (a buffer's address or handle in its argument position), so it serves whichever buffers the item
    holds. A host kernel's ctypes function with each buffer's remembered address; a program's own
    `positional_launcher` where it has one (CUDA: argument arrays of its own, a slot rewritten only when that
    argument's buffer changed); else the program called with its sizes bound. None for a kernel with symbolic sizes
    (its values and launch sizes can change between launches)."""
    if self.var_names: return None
    if self.host_function is not None:
      runner = self

      def launch_host(buffers: list[Buffer]) -> None:   # (host_function read at launch: a tool may swap it)
        # (a buffer's remembered address first: no method call; an address is never 0, so a pointer is true. A list
        # comprehension: reading the attribute by map and attrgetter was measured slower, Python 3.11)
        runner.host_function(*[buffer._pointer or buffer.host_pointer() for buffer in buffers])
      return launch_host
    positional = getattr(self.program, "positional_launcher", None)
    if positional is not None: return positional(self.global_size, self.local_size)
    program, global_size, local_size = self.program, self.global_size, self.local_size

    def launch(buffers: list[Buffer]) -> None:
      program(*[buffer.handle for buffer in buffers], global_size=global_size, local_size=local_size)
    return launch

  def _call_symbolic(self, buffers: list[Buffer], wait: bool, var_vals: dict[str, int]) -> float | None:
    """A launch of a kernel with symbolic sizes: the Variables' values follow the buffers as int arguments, and
    launch sizes that depend on them are computed now."""
    missing = [name for name in self.var_names if name not in var_vals]
    if missing: raise ValueError(f"kernel {self.name} needs values for the symbolic Variables {missing}")
    values = [var_vals[name] for name in self.var_names]
    if self.host_function is not None and not wait:
      self.host_function(*[buffer.host_pointer() for buffer in buffers], *values)
      return None
    global_size = tuple(sym_infer(size, var_vals) for size in self.global_size)
    local_size = tuple(sym_infer(size, var_vals) for size in self.local_size)
    return self.program(*[buffer.handle for buffer in buffers], global_size=global_size, local_size=local_size,
                        wait=wait, vals=tuple(values))


class CopyRunner(Runner):
  """A copy of one buffer into another of the same size (buffers[0] <- buffers[1]), across devices."""
  name = display_name = "copy"

  def __init__(self, nbytes: int):
    self.byte_count = 2 * nbytes

  def __call__(self, buffers: list[Buffer], wait: bool = False) -> float | None:
    destination, source = buffers[0], buffers[1]
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
    return time.perf_counter() - start if wait else None


# the lists that running ExecItems are appended to while a JIT records (innermost last)
_capture_lists: list[list[ExecItem]] = []


@contextmanager
def capture_into(items: list[ExecItem]) -> Iterator[list[ExecItem]]:
  """Append every ExecItem that runs inside this block to `items` (how TinyJit records a call)."""
  _capture_lists.append(items)
  try:
    yield items
  finally:
    _capture_lists.remove(items)


def is_capturing() -> bool: return bool(_capture_lists)


class JitRecording:
  """Whether a TinyJit function is running (its first or capture call), and the tensors it assigned to. Tensor
  reads this to refuse `.numpy()`/`.item()` (a value read on the host would be frozen into the replay) and to
  report assigns, which the JIT realizes at the end of the call so that they are captured."""

  def __init__(self) -> None:
    self.depth = 0
    self.assigned: list[tuple[Any, Any]] = []   # (tensor, its lazydata before the assign)

  @property
  def active(self) -> bool: return self.depth > 0

  @contextmanager
  def scope(self) -> Iterator[None]:
    self.depth += 1
    try:
      yield
    finally:
      self.depth -= 1
      if not self.depth: self.assigned = []

  def note_assign(self, tensor: Any) -> None:
    """Called by Tensor.assign before the assign: keeps the tensor and the lazy data it had."""
    if self.depth: self.assigned.append((tensor, tensor.lazydata))

  def take_assigned(self) -> list[tuple[Any, Any]]:
    assigned, self.assigned = self.assigned, []
    return assigned


jit_recording = JitRecording()




# DEBUG and PROFILE by their encoded names, and their raw values under which a launch is neither printed nor timed
# (unset, DEBUG=0 or 1, PROFILE=0): the fast path tests them with two dict lookups instead of parsing them, and any
# other value takes the general path, which reads them properly
_DEBUG_KEY, _PROFILE_KEY = os.fsencode(DEBUG.name), os.fsencode(PROFILE.name)
_QUIET_DEBUG = frozenset({None, b"0", b"1", "0", "1"})   # str where the environment store is os.environ itself
_QUIET_PROFILE = frozenset({None, b"0", "0"})


def quiet_launches() -> bool:
  """Whether launches now are neither printed nor timed: DEBUG < 2, PROFILE off and no profile() block open."""
  return environ_lookup(_DEBUG_KEY) in _QUIET_DEBUG and environ_lookup(_PROFILE_KEY) in _QUIET_PROFILE and \
    not profiler.open_blocks


@dataclass(eq=False)
class ExecItem:
  """A runner bound to its buffers (outputs first, then inputs) and the values of its symbolic variables.

  Fast path: a kernel item (no symbolic sizes) takes its runner's launcher once (`CompiledRunner.launcher`) and every
  launch calls it with `bufs` as they are then: the launcher reads each buffer's memory in its argument position (a
  host kernel: the buffer's remembered address; CUDA: a slot of the item's own argument array, rewritten only where
  that position's buffer changed). So an item rebound to other buffers (a replayed schedule's, TinyJit's new inputs),
  a buffer allocated, freed or moved onto planned memory all launch fast, whichever memory the allocator handed out.
  The fast path runs only while DEBUG < 2, PROFILE is off and no profile() block is open; it counts like the general
  path, and a capturing JIT records the item the same way."""
  runner: Runner
  bufs: list[Buffer]
  var_vals: dict[str, int] = field(default_factory=dict)
  device: str = ""
  outputs: int = 1   # how many of `bufs` (the first ones) the item writes: a multi-output kernel writes several
  _launch: Callable[[list[Buffer]], None] | None = field(default=None, init=False, repr=False)
  _launch_runner: Runner | None = field(default=None, init=False, repr=False)   # the runner _launch was made by

  def run(self, wait: bool = False) -> float | None:
    """Launch: allocate the buffers, run, count, print at DEBUG=2, and record the item if a JIT is capturing."""
    quiet = not wait and environ_lookup(_DEBUG_KEY) in _QUIET_DEBUG and environ_lookup(_PROFILE_KEY) in _QUIET_PROFILE \
      and not profiler.open_blocks
    if quiet:
      runner = self.runner
      launch = self._launch if self._launch_runner is runner else self._take_launcher()
      if launch is not None:
        launch(self.bufs)
        GlobalCounters.kernel_count += 1   # only CompiledRunners have launchers
        GlobalCounters.global_ops += runner.op_count
        GlobalCounters.global_mem += runner.byte_count
        if _capture_lists: _capture_lists[-1].append(self)
        return None
    return self._run_general(wait, quiet)

  def _take_launcher(self) -> Callable[[list[Buffer]], None] | None:
    """The current runner's launcher for the fast path (None: a copy, a kernel with symbolic sizes), kept until the
    runner changes."""
    runner = self.runner
    launch = runner.launcher() if isinstance(runner, CompiledRunner) and not self.var_vals else None
    self._launch, self._launch_runner = launch, runner
    return launch

  def _run_general(self, wait: bool, quiet: bool = False) -> float | None:
    """A launch through the runner itself: timed where `wait`, DEBUG >= 2 or a profiler asks; `quiet`: the caller
    found DEBUG < 2, PROFILE off and no profile() block open, so nothing is printed or timed."""
    for buffer in self.bufs:
      if buffer._handle is None: buffer.allocate()
    if quiet: debug, plain = 0, True
    else:
      debug = DEBUG.value  # read once: each read looks the environment up
      plain = not wait and debug < 2 and not profiler.active()
    wait = not plain
    runner = self.runner
    seconds = runner(self.bufs, wait=wait, var_vals=self.var_vals) if self.var_vals else runner(self.bufs, wait=wait)
    if seconds is not None: self._record_profile(seconds)
    if isinstance(runner, CompiledRunner):
      GlobalCounters.kernel_count += 1
    GlobalCounters.global_ops += runner.op_count
    GlobalCounters.global_mem += runner.byte_count
    if seconds is not None: GlobalCounters.time_sum_s += seconds
    if debug >= 2: self._print(seconds)
    if _capture_lists: _capture_lists[-1].append(self)
    return seconds

  def _record_profile(self, seconds: float) -> None:
    if isinstance(self.runner, CopyRunner):
      source, destination = self.bufs[1].device, self.bufs[0].device
      profiler.record_launch(f"copy {source} -> {destination}", destination, seconds, "copy")
    else:
      profiler.record_launch(self.runner.name, self.device, seconds, "kernel",
                             {"ops": self.runner.op_count, "bytes": self.runner.byte_count})

  def _print(self, seconds: float | None) -> None:
    runner = self.runner
    if isinstance(runner, CopyRunner):
      print(f"{colored('copy', 'yellow'):>28} {self.bufs[1].nbytes:>10} bytes {self.bufs[1].device} -> "
            f"{self.bufs[0].device} {(seconds or 0) * 1e6:9.2f} us")
      return
    seconds = seconds or 1e-9
    print(f"*** {self.device:<7} {GlobalCounters.kernel_count:4d} {runner.name:<28} {runner.display_name:<40} "
          f"{seconds * 1e6:9.2f} us  {runner.op_count / seconds / 1e9:8.2f} GFLOP/s  "
          f"{runner.byte_count / seconds / 1e9:8.2f} GB/s")
