"""Transparent capture: a cached schedule that an eager loop realizes again and again runs as one device graph.

A realize whose graph has the structure of one seen before replays that schedule (engine/schedule_cache.py); its items
keep their lowering from one replay to the next (schedule_item.LoweringMemo). After CAPTURE_AFTER_REPLAYS such
replays, the schedule's kernels are captured into one graph of their device (CUDA: a CUDA graph, `Device.graph`,
the class TinyJit replays with), and later replays launch that graph instead of each kernel: each argument position of
each kernel is compared with the buffer the replay holds there (by identity: the allocator hands the same handle
objects back, LRUAllocator in a stable order), the ones that changed are written into the graph's nodes
(cuGraphExecKernelNodeSetParams, no re-instantiation), and the graph is launched once. Results and eager reads are
what launching item by item gives: the graph runs on the same stream, in the same order, on the same buffers.

A schedule is not captured (DEBUG=2 says why, once per realize) when it holds a copy (to or from the host, or between
devices), a kernel with symbolic sizes, a single kernel (one launch already), kernels on several devices, or its device
has no graph; nor while DEBUG >= 2, PROFILE or a profile() block asks for each launch, nor while TinyJit records.
EAGER_CAPTURE=0 turns it off; host devices (CLANG, LLVM) are captured only with EAGER_CAPTURE=2 (read at each realize;
docs/jit.md says what was measured).
"""
from __future__ import annotations

from itertools import chain, compress, repeat
from operator import attrgetter, is_
from typing import Any

from ourgrad.device import Buffer, Device
from ourgrad.engine.exec_item import CompiledRunner, quiet_launches
from ourgrad.engine.schedule_item import ScheduleItem
from ourgrad.errors import DeviceError
from ourgrad.helpers import DEBUG, GlobalCounters, env_var
from ourgrad.ops import Ops

EAGER_CAPTURE = env_var("EAGER_CAPTURE", 1, "0: launch a repeated eager realize kernel by kernel, never as one "
                        "captured graph; 1: capture on devices with a device graph (a CUDA graph on CUDA); 2: also on "
                        "host devices (CLANG, LLVM: one loop of ctypes calls); docs/jit.md, transparent capture")
# replays of a cached schedule launched kernel by kernel before it is captured: a realize repeated a few times is a loop
CAPTURE_AFTER_REPLAYS = 2


class CaptureStats:
  """What transparent capture did in this process: graphs built, and realizes launched as one graph."""
  __slots__ = ("captures", "graph_launches")

  def __init__(self) -> None: self.captures = self.graph_launches = 0


stats = CaptureStats()


class ScheduleCapture:
  """The capture state of one cached schedule, kept on its first item's LoweringMemo: how many times it was seen,
  and once captured the graph, the argument each kernel's graph node holds per position, and what a launch counts."""
  __slots__ = ("seen", "checked", "reason", "host_kernels", "graph", "host", "memos", "arguments", "generation",
               "kernel_count", "op_count", "byte_count", "key", "parked", "builds", "hits")

  def __init__(self) -> None:
    self.seen = 0
    self.checked = False             # whether `reason` is final (the schedule's kernels were lowered)
    self.reason: str | None = None   # why this schedule is never captured (None: it may be)
    self.host_kernels = False        # host kernels (CLANG, LLVM): captured only with EAGER_CAPTURE=2 (once checked)
    self.graph: Any = None
    self.host = False                # a HostGraph: arguments are Buffer.host_pointer()s, not handles
    self.memos: list[Any] = []       # the LoweringMemo of each item it captured (a replay must bring the same items)
    self.arguments: list[list[Any]] = []
    self.generation: Any = None      # the compiled-kernel cache's generation its runners came from
    self.kernel_count = self.op_count = self.byte_count = 0
    # device graphs only: the identities of the buffers' handles the graph's nodes hold (_identity_key; None: not
    # known), and other graphs of this schedule bound to other buffers, by that key (see _rebind)
    self.key: tuple[int, ...] | None = None
    self.parked: dict[tuple[int, ...], tuple[Any, list[list[Any]]]] = {}
    # graphs built for other buffers, and replays that found theirs parked: a schedule whose buffers change at every
    # call (whose parked graphs are never found again) builds two such graphs, not GRAPHS_PER_SCHEDULE
    self.builds = self.hits = 0


def structural_reason(schedule: list[ScheduleItem]) -> str | None:
  """Why a schedule whose items the cache all keeps can never run as one graph; None if it can, or if its kernels
  are not lowered yet (the first replay lowers them: `ScheduleCapture.checked` stays False until then)."""
  if len(schedule) < 2: return "one kernel"
  devices = set()
  for item in schedule:
    if item.ast.op is Ops.COPY:
      return f"a copy {item.inputs[0].device} -> {item.outputs[0].device} (the host waits for it)"
    devices.add(item.outputs[0].device)
  if len(devices) > 1: return f"kernels on several devices ({', '.join(sorted(devices))})"
  if any(item.lowering.runner is None for item in schedule): return None
  if not all(isinstance(item.lowering.runner, CompiledRunner) for item in schedule): return "an item that is no kernel"
  if any(item.lowering.var_vals for item in schedule): return "symbolic shapes (bound Variables)"
  device = next(iter(devices))
  if getattr(Device[device], "graph", None) is None and \
      not all(item.lowering.runner.host_function is not None for item in schedule):
    return f"{device} has no device graph"
  return None


def runs_host_kernels(schedule: list[ScheduleItem]) -> bool:
  """Whether a schedule that structural_reason lets through runs on a host device (a HostGraph, not a device graph):
  captured only while EAGER_CAPTURE is 2, read at each realize (not part of the schedule's lasting reason)."""
  return getattr(Device[schedule[0].outputs[0].device], "graph", None) is None


class HostGraph:
  """The kernels of a captured schedule on a host device (CLANG, LLVM): each one's ctypes function called in turn
  with its arguments' addresses (Buffer.host_pointer), no ExecItem lowered or run per kernel. Arguments are compared
  and set as pointers: a planned buffer's handle is a new view at each replay, its address is not."""

  def __init__(self, runners: list[CompiledRunner], pointers: list[list[Any]]):
    self.runners, self.pointers = runners, pointers

  def set_argument(self, index: int, position: int, pointer: Any) -> None: self.pointers[index][position] = pointer

  def launch(self) -> None:
    for runner, pointers in zip(self.runners, self.pointers): runner.host_function(*pointers)


def run_captured(schedule: list[ScheduleItem], generation: Any) -> bool:
  """Launch `schedule` as its captured graph and count it (True), or leave it to the caller's launch loop (False).
  `generation`: the compiled-kernel cache's, which a capture's runners must come from."""
  memo = schedule[0].lowering
  setting = EAGER_CAPTURE.value
  if memo is None or not setting: return False
  state: ScheduleCapture | None = memo.capture
  if state is None: state = memo.capture = ScheduleCapture()
  # (the setting is read at each realize: a schedule checked while it was 1 is captured once it is 2, and back)
  host_off = state.host_kernels and setting < 2
  quiet = quiet_launches()
  if state.graph is not None and state.generation == generation and quiet and not host_off:
    if _rebind(state, schedule):
      _launch(state)
      return True
    return False   # this call brings other items than the capture (copy-on-write snapshots): item by item
  # an item the cache does not keep: a copy-on-write snapshot (or a pack of them), decided per call
  kept = all(item.lowering is not None for item in schedule)
  if kept and not state.checked:
    state.reason = structural_reason(schedule)
    state.checked = state.reason is not None or all(item.lowering.runner is not None for item in schedule)
    state.host_kernels = state.checked and state.reason is None and runs_host_kernels(schedule)
    host_off = state.host_kernels and setting < 2
  if not quiet or host_off:
    if DEBUG >= 2:
      snapshots = "this call's copy-on-write snapshots (items the schedule cache does not keep)"
      device = schedule[0].outputs[0].device
      host = f"{device} runs host kernels (EAGER_CAPTURE=2 captures them as one ctypes loop)"
      _explain(schedule, state.reason or (host if host_off else "DEBUG >= 2 launches kernel by kernel" if kept else
                                          snapshots))
    return False
  if state.reason is not None or not kept: return False
  state.seen += 1
  if state.seen <= CAPTURE_AFTER_REPLAYS or generation is None or \
      any(item.lowering.generation != generation for item in schedule):
    return False
  return _capture(state, schedule, generation)


def _explain(schedule: list[ScheduleItem], reason: str) -> None:
  print(f"capture: {len(schedule)} items not replayed as one graph: {reason}")


def _arguments_of(item: ScheduleItem) -> list[Buffer]:
  """The buffers a kernel of `item` takes, in argument order (the block counters of a one-kernel split reduce last)."""
  buffers = [*item.outputs, *item.inputs]
  memo = item.lowering
  if memo.block_counters:
    from ourgrad.engine.realize import split_counters   # (realize imports this module)
    buffers.append(split_counters(item.outputs[0].device, memo.runner))
  return buffers


def _capture(state: ScheduleCapture, schedule: list[ScheduleItem], generation: Any) -> bool:
  """Build the graph of `schedule`'s kernels on its current buffers and launch it (False: the driver refused)."""
  state.parked, state.builds, state.hits = {}, 0, 0   # (graphs of another generation's runners)
  if not _build(state, schedule): return False
  runners: list[CompiledRunner] = [item.lowering.runner for item in schedule]
  state.generation = generation
  state.memos = [item.lowering for item in schedule]
  state.kernel_count = len(schedule)
  state.op_count = sum(runner.op_count for runner in runners)
  state.byte_count = sum(runner.byte_count for runner in runners)
  stats.captures += 1
  _launch(state)
  return True


def _build(state: ScheduleCapture, schedule: list[ScheduleItem]) -> bool:
  """Make `state.graph` the graph of `schedule`'s kernels on its current buffers (False: the driver refused)."""
  device = Device[schedule[0].outputs[0].device]
  runners: list[CompiledRunner] = [item.lowering.runner for item in schedule]
  device_graph = getattr(device, "graph", None)
  host = device_graph is None   # (structural_reason: then every kernel is a host kernel)
  launches, arguments = [], []
  for item, runner in zip(schedule, runners):
    values = [buffer.host_pointer() if host else buffer.handle for buffer in _arguments_of(item)]
    launches.append((runner.program, runner.global_size, runner.local_size, values, []))
    arguments.append(values[:len(item.outputs) + len(item.inputs)])
  try:
    graph = HostGraph(runners, [launch[3] for launch in launches]) if host else device_graph(launches)
  except DeviceError as error:   # a driver that refuses the graph: launched item by item, still correct
    state.reason = f"the device refused the graph ({error})"
    return False
  state.graph, state.arguments, state.host = graph, arguments, host
  state.key = None if host else _identity_key(schedule)
  return True


# graphs of one schedule kept bound to other buffers (the blocks of a model, each with its own weights, realized one
# by one replay one schedule: each replay would otherwise rewrite most nodes' arguments, one driver call per node)
GRAPHS_PER_SCHEDULE = 16
_inputs_and_outputs = attrgetter("outputs", "inputs")


def _identity_key(schedule: list[ScheduleItem]) -> tuple[int, ...]:
  """The identities of the handles of every item's buffers in argument order, read in C (None's for buffers not
  allocated: no graph's key holds one, since graphs are keyed once every argument is bound). A graph's argument
  lists hold those handles, so no identity in a kept key is reused while the key is kept."""
  return tuple(map(id, map(_handle_of, chain.from_iterable(chain.from_iterable(map(_inputs_and_outputs,
                                                                                     schedule))))))


def _rebind(state: ScheduleCapture, schedule: list[ScheduleItem]) -> bool:
  """Point the graph's nodes at this replay's buffers where they changed; False if the replay brings other items
  than the capture (copy-on-write snapshots or packing decided otherwise this time).

  A device graph is first looked up by the identities of the replay's handles (_identity_key): the graph bound to
  them already (this one, or one parked) launches with no argument written. Otherwise, where most items read other
  buffers (another block's weights) and fewer than GRAPHS_PER_SCHEDULE graphs exist, this one is parked as it is and
  a new graph is built on these buffers; else the changed arguments are written into this graph."""
  if len(schedule) != len(state.memos): return False
  memos = state.memos
  for item, memo in zip(schedule, memos):
    if item.lowering is not memo: return False
  host = state.host
  key: tuple[int, ...] | None = None
  if not host:
    # (all in C: the buffers in argument order, their handles, the handles' identities)
    buffers = list(chain.from_iterable(chain.from_iterable(map(_inputs_and_outputs, schedule))))
    handles = list(map(_handle_of, buffers))
    missing = list(map(is_, handles, repeat(None)))   # (by identity: a handle's == may be elementwise, numpy's)
    if any(missing):   # (fresh outputs get their memory at launch: here, in argument order as the walk below would)
      for buffer in compress(buffers, missing): buffer.allocate()
      handles = list(map(_handle_of, buffers))
    key = tuple(map(id, handles))
    if key == state.key: return True
    parked = state.parked.pop(key, None)
    if parked is not None:
      state.hits += 1
      if state.key is not None: state.parked[state.key] = (state.graph, state.arguments)
      state.graph, state.arguments = parked
      state.key = key
      return True
  read = _pointer_of if host else _handle_of
  # most items of a repeated step hold what their node holds: one identity check per argument in C (map, is_), the
  # per-argument walk below only where something changed or is not allocated yet (None is no node's argument; a host
  # buffer's address is made at its first launch)
  changed = [index for index, (item, bound) in enumerate(zip(schedule, state.arguments))
             if not all(map(is_, map(read, chain(item.outputs, item.inputs)), bound))]
  if not host and state.key is not None and state.reason is None and 2 * len(changed) > len(schedule) and \
      len(state.parked) + 1 < GRAPHS_PER_SCHEDULE and state.builds < 2 * state.hits + 2:
    kept, kept_key = (state.graph, state.arguments), state.key
    state.builds += 1
    if _build(state, schedule):   # (which allocates what is not yet: graph nodes take handles)
      state.parked[kept_key] = kept
      return True
    state.graph, state.arguments, state.key = *kept, kept_key   # (refused: the graph there is gets rebound)
  graph = state.graph
  for index in changed:
    item, bound = schedule[index], state.arguments[index]
    position = 0
    for buffers in (item.outputs, item.inputs):
      for buffer in buffers:
        if host: argument = buffer._pointer or buffer.host_pointer()   # (see CompiledRunner.launcher)
        else:
          argument = buffer._handle
          if argument is None: argument = buffer.allocate()._handle
        if argument is not bound[position]:
          graph.set_argument(index, position, argument)
          bound[position] = argument
        position += 1
  state.key = key   # (the handles read above: every one was allocated then, and the walk only wrote them in)
  return True


_handle_of, _pointer_of = attrgetter("_handle"), attrgetter("_pointer")


def _launch(state: ScheduleCapture) -> None:
  state.graph.launch()
  stats.graph_launches += 1
  GlobalCounters.kernel_count += state.kernel_count
  GlobalCounters.global_ops += state.op_count
  GlobalCounters.global_mem += state.byte_count
