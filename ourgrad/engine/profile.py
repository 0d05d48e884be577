"""PROFILE=1 and `ourgrad.profile()`: a Chrome/Perfetto trace of kernels, copies and host phases.

The trace is a JSON file in the Trace Event Format that chrome://tracing and ui.perfetto.dev open:
`{"traceEvents": [...]}` of complete events (`"ph": "X"`) with a start `ts` and a duration `dur` in microseconds,
plus metadata events naming the processes and threads. The host is one process with a thread per phase
(schedule, codegen, compile); each device is a process with a thread for kernels ("kernel") and one for copies
("copy", on the destination device).

The engine reports what it runs through the module-level `profiler`:

    profiler.active()                                   is anything recording? (cheap: check before timing)
    profiler.record(name, device, start_s, duration_s, kind)      an event with a perf_counter() start
    profiler.record_launch(name, device, duration_s, kind)        a launch that just finished (synchronously)
    @host_phase("compile", lambda device, name, source: name)      times every call of a host function

A kernel's duration is its device time (what `program(..., wait=True)` returns: CUDA events on a GPU). Its start
is the host time the launch ended minus that duration, moved later if needed so that the events of one device
never overlap: durations are exact, positions on the timeline approximate. Copies are timed on the host.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import pathlib
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

from ourgrad.helpers import PROFILE, PROFILE_PATH

F = TypeVar("F", bound=Callable[..., Any])

HOST = "HOST"   # the `device` of host phases


@dataclass
class Trace:
  """The events one `profile()` block recorded, and the file they were written to (set when the block ends)."""
  events: list[dict[str, Any]] = field(default_factory=list)
  path: pathlib.Path | None = None

  def kernel_events(self) -> list[dict[str, Any]]:
    """The complete events of kernel launches."""
    return [event for event in self.events if event.get("ph") == "X" and event.get("cat") == "kernel"]


class Profiler:
  """Collects trace events while PROFILE=1 is set or a `profile()` block is open."""

  def __init__(self) -> None:
    self.origin_s = time.perf_counter()          # ts 0 of the trace
    self.events: list[dict[str, Any]] = []      # complete events, in the order recorded
    self.open_blocks = 0                         # nesting depth of profile() blocks
    self.recorded_for_env = False                # PROFILE=1 recorded something: write it at exit
    self._pids: dict[str, int] = {}              # process name -> pid
    self._tids: dict[tuple[int, str], int] = {}  # (pid, thread name) -> tid
    self._track_end_us: dict[tuple[int, int], float] = {}   # (pid, tid) -> end of its last event

  def active(self) -> bool:
    return self.open_blocks > 0 or bool(PROFILE)

  def _track(self, device: str, kind: str) -> tuple[int, int]:
    """(pid, tid) of an event: a process per device (the host is one too), a thread per kind, numbered from 1 in
    order of first use."""
    process = "host" if device == HOST else device
    pid = self._pids.setdefault(process, len(self._pids) + 1)
    if (pid, kind) not in self._tids:
      self._tids[(pid, kind)] = 1 + sum(1 for owner, _ in self._tids if owner == pid)
    return pid, self._tids[(pid, kind)]

  def record(self, name: str, device: str, start_s: float, duration_s: float, kind: str,
             args: dict[str, Any] | None = None) -> None:
    """One complete event: `start_s` is a time.perf_counter() value, `duration_s` seconds. Ignored when inactive."""
    if not self.active(): return
    if PROFILE: self.recorded_for_env = True
    pid, tid = self._track(device, kind)
    start_us = (start_s - self.origin_s) * 1e6
    if device != HOST:  # a device runs one thing at a time: keep its events apart (see the module docstring)
      start_us = max(start_us, self._track_end_us.get((pid, tid), start_us))
    duration_us = max(duration_s * 1e6, 0.0)
    self._track_end_us[(pid, tid)] = start_us + duration_us
    event = {"name": name, "cat": kind, "ph": "X", "ts": round(start_us, 3), "dur": round(duration_us, 3),
             "pid": pid, "tid": tid, "args": {"device": device, **(args or {})}}
    self.events.append(event)

  def record_launch(self, name: str, device: str, duration_s: float | None, kind: str = "kernel",
                    args: dict[str, Any] | None = None) -> None:
    """A launch or copy that has just finished and took `duration_s` (None: not timed, nothing recorded)."""
    if duration_s is None or not self.active(): return
    self.record(name, device, time.perf_counter() - duration_s, duration_s, kind, args)

  def metadata_events(self) -> list[dict[str, Any]]:
    """The events naming each process ("host", "CLANG", ...) and thread ("kernel", "compile", ...)."""
    events = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": process}}
              for process, pid in self._pids.items()]
    events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": thread}}
               for (pid, thread), tid in self._tids.items()]
    return events

  def write(self, path: str | os.PathLike, events: list[dict[str, Any]]) -> pathlib.Path:
    """Write `events` (and the metadata naming their tracks) as a trace file."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    trace = {"traceEvents": self.metadata_events() + events, "displayTimeUnit": "ms"}
    path.write_text(json.dumps(trace))
    return path


profiler = Profiler()


def default_trace_path() -> pathlib.Path:
  """Where PROFILE=1 writes its trace: PROFILE_PATH, else ourgrad_trace.json in the system temp folder."""
  return pathlib.Path(PROFILE_PATH.value) if PROFILE_PATH.value else \
    pathlib.Path(tempfile.gettempdir()) / "ourgrad_trace.json"


@contextlib.contextmanager
def profile(path: str | os.PathLike | None = "ourgrad_trace.json") -> Iterator[Trace]:
  """Record the kernels, copies and host phases that run inside the block, and write them as a Chrome/Perfetto
  trace to `path` when it ends (None: keep them in the yielded Trace only). Open the file in ui.perfetto.dev or
  chrome://tracing.

      with ourgrad.profile("trace.json") as trace:
        model(x).realize()
      print(len(trace.kernel_events()), "kernels")
  """
  trace = Trace()
  first_event = len(profiler.events)
  profiler.open_blocks += 1
  try:
    yield trace
  finally:
    profiler.open_blocks -= 1
    trace.events = profiler.events[first_event:]
    if path is not None: trace.path = profiler.write(path, trace.events)
    if not profiler.active(): profiler.events.clear()  # nobody else needs them: do not grow without end


def host_phase(kind: str, describe: Callable[..., str] | None = None) -> Callable[[F], F]:
  """Decorate a host function so that each call is a `kind` event on the host while profiling; `describe` gets the
  call's arguments and names the event (default: the function's name)."""
  def decorate(function: F) -> F:
    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
      if not profiler.active(): return function(*args, **kwargs)
      start = time.perf_counter()
      try:
        return function(*args, **kwargs)
      finally:
        name = describe(*args, **kwargs) if describe is not None else function.__name__
        profiler.record(name, HOST, start, time.perf_counter() - start, kind)
    return timed  # type: ignore[return-value]
  return decorate


@atexit.register
def _write_env_trace() -> None:
  """PROFILE=1: write everything recorded to default_trace_path() when the process ends."""
  if not profiler.recorded_for_env: return
  path = profiler.write(default_trace_path(), profiler.events)
  print(f"PROFILE=1: wrote {len(profiler.events)} events to {path} (open it in ui.perfetto.dev or chrome://tracing)")
