"""Run a schedule: lower each ScheduleItem to an ExecItem (a runner bound to buffers: ourgrad/engine/exec_item.py)
and launch it. `get_kernel` is where a kernel's optimizations are chosen (the hand-coded heuristic; BEAM hooks in
there); `run_schedule` plans the schedule's memory first (ourgrad/engine/memory.py).

Compiled kernels are cached in memory by (device, AST, whether TF32 is allowed) and on disk by source (see
device.Compiler), so the same kernel is generated once per process and compiled once per machine. After a schedule's
first new kernel, its later new ones compile side by side (engine/compile_ahead.py, COMPILE_THREADS).
"""
from __future__ import annotations

import re
import sys
import warnings
from typing import Any

from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.lowering import AnyKernel, LoweredKernel, OptPolicy, ast_is_symbolic, build_kernel, kernel_cost, \
  kind_of, kind_of_ast, lower_kernel
from ourgrad.codegen.opt.search import beam_optimize
from ourgrad.codegen.uops import UOps, format_uops, launch_dims  # noqa: F401 (launch_dims re-exported)
from ourgrad.device import Buffer, Compiled, Device
from ourgrad.dtype import dtypes
from ourgrad.engine.capture import run_captured
from ourgrad.engine.exec_item import _DEBUG_KEY, _PROFILE_KEY, _QUIET_DEBUG, _QUIET_PROFILE, CompiledRunner, \
  CopyRunner, ExecItem, Runner, _capture_lists, is_capturing, jit_recording, quiet_launches  # noqa: F401 (re-exported)
from ourgrad.engine.memory import RecordedPlan, held_only_by_items, plan_memory
from ourgrad.engine.profile import host_phase, profiler
from ourgrad.engine.schedule import ALWAYS_REALIZED_OPS, ScheduleItem
from ourgrad.engine.schedule_item import ReplayedSchedule
from ourgrad import lazy_trace
from ourgrad.lazy import LazyBuffer
from ourgrad.errors import CompileError, DeviceError
from ourgrad.helpers import BEAM, DEBUG, RUNNER_CACHE_SIZE, BoundedCache, GlobalCounters, env_var, environ_lookup, \
  prod, tf32_allowed
from ourgrad.ops import ConstBuffer, LazyOp, MemBuffer, Ops


NO_MEMORY_PLANNER = env_var("NO_MEMORY_PLANNER", 0, "1: every buffer of a schedule gets memory of its own")
OVERLAP_BACKWARD = env_var("OVERLAP_BACKWARD", 0, "n > 0: an eager backward() whose pending graph holds at least n "
                           "lazy bases, on a device that queues its kernels (CUDA, OpenCL), realizes its loss first, "
                           "so the device runs the forward while the backward's graph is built; 0: never "
                           "(docs/jit.md, overlap)")


def queues_work(device: str) -> bool:
  """Whether `device` runs launched kernels asynchronously (a queue the host does not wait for: its `synchronize` is
  its own), so that work launched early overlaps Python's next work. Host devices (CLANG, LLVM, PYTHON) run each
  kernel on the calling thread: launching early only costs there."""
  return type(Device[device]).synchronize is not Compiled.synchronize


def realize_before_backward(device: str | tuple[str, ...]) -> bool:
  """Whether an eager backward() of a loss on `device` should realize it before building the backward graph: the
  forward's kernels then run on the device while Python builds the backward (and the optimizer's) graph, instead of
  after all of it. Only on a device that queues its kernels (queues_work), where the pending graph is large (a small
  forward's kernels take less device time than the realize costs), and never while TinyJit records (its captured
  kernels stay those of one schedule)."""
  setting = OVERLAP_BACKWARD.value
  if setting <= 0 or jit_recording.active or lazy_trace.pending() < setting: return False
  return all(queues_work(name) for name in ((device,) if isinstance(device, str) else device))


# bounded: a long run that builds ever new kernels (changing shapes) must not keep every one (helpers.clear_caches)
_runner_cache: BoundedCache[tuple[str, LazyOp, bool], CompiledRunner] = BoundedCache(RUNNER_CACHE_SIZE)


def get_kernel(ast: LazyOp, device: str) -> AnyKernel:
  """The kernel of an AST with the opts it runs with (codegen/lowering.py build_kernel: the hand-coded ones, none with
  NOOPT=1, searched with BEAM=n; a kind sized by its own plan takes none)."""
  # searched, verified and cached: codegen/opt/search.py
  search = (lambda kernel: beam_optimize(kernel, device, BEAM.value)) if BEAM >= 1 else None
  return build_kernel(ast, Device[device].renderer, search)


class OptimizationFallbackWarning(RuntimeWarning):
  """An optimized kernel failed to compile or load, and its unoptimized version runs instead."""


# kernels get_runner did not find compiled: run_schedule starts compiling ahead after its schedule's first one
_runner_misses = [0]


def get_runner(device: str, ast: LazyOp) -> CompiledRunner:
  """The compiled kernel of an AST. If the optimized kernel fails to compile or load (it may exceed a device limit
  the heuristics do not model: registers, shared memory, code size), the unoptimized one is used instead."""
  # the float32 matmul precision picks the code (TF32 tensor cores or not): kernels of each are kept apart
  key = (device, ast, tf32_allowed())
  if key not in _runner_cache:
    _runner_misses[0] += 1
    kernel = get_kernel(ast, device)
    kernel.print_debug()
    _runner_cache[key] = compile_or_fall_back(kernel, ast, device)
  return _runner_cache[key]


def compile_or_fall_back(kernel: AnyKernel, ast: LazyOp, device: str) -> CompiledRunner:
  """The runner of `kernel` (get_kernel's kernel of `ast`), or of the unoptimized kernel where it fails to compile
  or load (get_runner)."""
  try:
    return compile_kernel(kernel, device)
  except (CompileError, DeviceError) as error:
    # a one-kernel split reduce's finish needs its opts' layout (checked when it was scheduled): no plain fallback
    if not kernel.applied_opts or kind_of(kernel).opts is not OptPolicy.SEARCHED: raise
    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
    # a warning, not a print: the test suite turns it into an error, so an optimizer bug cannot hide here
    warnings.warn(f"{kernel.name} with opts {kernel.applied_opts} failed to compile or load ({reason}); "
                  f"using the unoptimized kernel", OptimizationFallbackWarning, stacklevel=3)
    plain = Kernel(ast, Device[device].renderer)
    plain.print_debug()
    return compile_kernel(plain, device)


@host_phase("compile", lambda device, name, source: name)
def load_program(device: str, name: str, source: str) -> Any:
  """Compile `source` (or take it from the disk cache) and load it. A cached binary that the device cannot load
  (damaged, or written by another toolchain) is deleted with a warning, recompiled and rewritten."""
  compiled = Device[device]
  cached = compiled.compiler.load_cached(source)
  # a miss compiles at once (refresh: no second look into the cache) and writes the binary into the cache
  if cached is None: return compiled.program(name, compiled.compiler.compile_cached(source, refresh=True))
  try:
    return compiled.program(name, cached)
  except Exception as error:  # loaders raise whatever their library raises (OSError from dlopen, driver errors)
    warnings.warn(f"the cached binary of kernel {name} failed to load ({type(error).__name__}: {error}); "
                  f"deleted and recompiled", RuntimeWarning, stacklevel=2)
    compiled.compiler.evict(source)
    return compiled.program(name, compiled.compiler.compile_cached(source, refresh=True))


def function_name(kernel: Kernel) -> str:
  """The kernel's name as a C identifier: a symbolic size in the name ("r_8_<n>") is not one."""
  return re.sub(r"[^A-Za-z0-9_]", "", kernel.name)


@host_phase("codegen", lambda kernel, device: kernel.name)
def compile_kernel(kernel: AnyKernel, device: str) -> CompiledRunner:
  name, lowered = render_kernel(kernel, device)
  program = load_program(device, name, lowered.source)
  op_count, byte_count = kernel_cost(kernel, lowered)
  var_names = tuple(uop.arg[0] for uop in lowered.uops if uop.op is UOps.DEFINE_VAR)
  return CompiledRunner(name, kernel.colored_shape(), lowered.source, program, lowered.global_size,
                        lowered.local_size, op_count, byte_count, var_names)


# kernels that engine/compile_ahead.py rendered before their compile, by id (with the kernel: an id is unique only
# while its object lives): compile_kernel takes that rendering instead of lowering the kernel again
rendered_ahead: dict[int, tuple[AnyKernel, str, LoweredKernel]] = {}


def render_kernel(kernel: AnyKernel, device: str) -> tuple[str, LoweredKernel]:
  """(the kernel's function name, its lowering: UOps and source for `device`), printed as DEBUG asks."""
  ahead = rendered_ahead.get(id(kernel))
  if ahead is not None and ahead[0] is kernel: return ahead[1], ahead[2]
  name = function_name(kernel)
  lowered = lower_kernel(kernel, Device[device].renderer, name)
  if DEBUG >= 5 and lowered.linearized: print(format_uops(lowered.uops))
  if DEBUG >= 4: print(lowered.source)
  if DEBUG >= 6: print(Device[device].compiler.disassemble(lowered.source))
  return name, lowered


# AST -> (unbound AST, values, block counters: _lowering_facts). Bound values are part of an AST's identity, so the
# entry is exact; a step that builds the same graph (the schedule cache hands back the same AST objects) pays one dict
# lookup per kernel
_unbound_asts: BoundedCache[LazyOp, tuple[LazyOp, dict[str, int], bool]] = BoundedCache(RUNNER_CACHE_SIZE)


def unbind_ast(ast: LazyOp) -> tuple[LazyOp, dict[str, int]]:
  """(the AST with every bound Variable in its views unbound, {variable name: value}). The unbound AST is the
  compiled-kernel cache key, the same for every value; the values are the kernel's int arguments at launch."""
  unbound, var_vals, _ = _lowering_facts(ast)
  return unbound, var_vals


def _lowering_facts(ast: LazyOp) -> tuple[LazyOp, dict[str, int], bool]:
  """(unbind_ast's two, whether the kernel's kind needs block counters): pure functions of the AST, asked for every
  kernel of every eager step (the kinds' matchers walk the AST), so remembered per AST."""
  cached = _unbound_asts.get(ast)
  if cached is None:
    unbound, var_vals = _unbind_ast(ast)
    cached = _unbound_asts[ast] = (unbound, var_vals, kind_of_ast(unbound).block_counters)
  return cached


def _unbind_ast(ast: LazyOp) -> tuple[LazyOp, dict[str, int]]:
  if not ast_is_symbolic(ast): return ast, {}
  rebuilt: dict[int, LazyOp] = {}
  var_vals: dict[str, int] = {}
  for node in ast.walk():
    arg = node.arg
    if isinstance(arg, (MemBuffer, ConstBuffer)) and arg.st.symbolic:
      st, values = arg.st.unbind()
      for name, value in values.items():
        if var_vals.setdefault(name, value) != value:
          raise ValueError(f"one kernel reads Variable {name!r} bound to both {var_vals[name]} and {value}")
      arg = MemBuffer(arg.idx, arg.dtype, st) if isinstance(arg, MemBuffer) else ConstBuffer(arg.val, arg.dtype, st)
    rebuilt[id(node)] = LazyOp(node.op, tuple(rebuilt[id(src)] for src in node.srcs), arg, node.dtype)
  return rebuilt[id(ast)], var_vals


def lower_schedule_item(item: ScheduleItem, reuse: bool = False) -> ExecItem:
  """The ExecItem that runs one ScheduleItem: a copy, or the compiled kernel of its AST (from the cache) with the
  values of its bound Variables. `reuse`: the caller runs it at once and hands it back (`release`), so a replayed
  schedule's item may be the ExecItem its last replay ran, rebound to these buffers."""
  buffers = [*item.outputs, *item.inputs]
  if item.ast.op is Ops.COPY: return ExecItem(CopyRunner(item.inputs[0].nbytes), buffers, device=buffers[0].device)
  device = item.outputs[0].device
  memo = item.lowering
  # (a cache without a generation, as a test may swap in, keeps no lowering)
  generation = getattr(_runner_cache, "generation", None)
  if memo is not None and memo.source is _runner_cache and memo.generation == generation and generation is not None:
    runner, var_vals, block_counters = memo.runner, memo.var_vals, memo.block_counters
    if reuse and memo.idle:
      exec_item = memo.idle.pop()
      if block_counters: buffers.append(split_counters(device, runner))
      exec_item.bufs = buffers
      return exec_item
  else:
    ast, var_vals, block_counters = _lowering_facts(item.ast)
    runner = get_runner(device, ast)
    # (the generation after get_runner, whose insert may have evicted another kernel; a cache without one keeps no
    # lowering: run_schedule's quiet path reads the generation of the cache a memo came from)
    generation = getattr(_runner_cache, "generation", None)
    if memo is not None and generation is not None:
      memo.runner, memo.var_vals, memo.block_counters = runner, var_vals, block_counters
      memo.source, memo.generation, memo.idle = _runner_cache, generation, []
      # (a kernel with bound Variables or block counters takes more than the item's buffers: an ExecItem runs it)
      memo.launch = runner.launcher() if not var_vals and not block_counters else None
  if block_counters: buffers.append(split_counters(device, runner))
  return ExecItem(runner, buffers, var_vals, device=device, outputs=len(item.outputs))


def release(item: ScheduleItem, exec_item: ExecItem) -> None:
  """Hand back an ExecItem that lower_schedule_item(item, reuse=True) gave and that has run: it lets go of its
  buffers, and a replayed schedule keeps it for its next replay (nothing else holds it: no JIT was capturing)."""
  exec_item.bufs = []
  memo = item.lowering
  if memo is not None and memo.runner is exec_item.runner and not memo.idle: memo.idle.append(exec_item)


# the block counters of each one-kernel split reduce's runner (codegen/last_block.py), by (device, runner id): zeros
# that every launch leaves zero again, so launches of one runner on one device (one stream, in order) share them
_split_counters: dict[tuple[str, int], tuple[CompiledRunner, Buffer]] = {}


def split_counters(device: str, runner: CompiledRunner) -> Buffer:
  """The int32 counters of `runner`'s launches on `device`: one per group of blocks, allocated and zeroed once."""
  key = (device, id(runner))
  if key not in _split_counters:
    counters = Buffer(device, max(prod(runner.global_size), 1), dtypes.int32).allocate()
    counters.copyin(memoryview(bytearray(counters.nbytes)))
    _split_counters[key] = (runner, counters)   # the runner kept alive: its id stays its own
  return _split_counters[key][1]


def lower_schedule(schedule: list[ScheduleItem]) -> list[ExecItem]:
  """Every ScheduleItem lowered, in run order."""
  return [lower_schedule_item(item) for item in schedule]


def plan_schedule_memory(schedule: list[ScheduleItem]) -> None:
  """Let the schedule's internal buffers (ones that only its items hold and that are not allocated yet) share
  memory where their lifetimes do not overlap. A replayed schedule (schedule_item.ReplayedSchedule: its items as the
  cache keeps them) plans once per set of internal buffers and replays that plan (memory.RecordedPlan) at its later
  realizes, found by the slots of its pool of buffers (memory.PoolMemory) without counting every item's buffers."""
  if len(schedule) < 3 or NO_MEMORY_PLANNER: return
  plans = _recorded_plans(schedule)
  if plans is not None and _replay_recorded_plan(schedule, plans): return
  containers = [container for item in schedule for container in (item.outputs, item.inputs)]
  # (a replayed schedule's pool holds each of its buffers too)
  if type(schedule) is ReplayedSchedule: containers.append(schedule.pool)
  internal = held_only_by_items(containers)
  if len(internal) < 2: return
  internal = {id(buffer) for item in schedule for buffer in item.outputs if id(buffer) in internal
              and not buffer.is_allocated}
  buffer_lists = [item.outputs + item.inputs for item in schedule]
  assigned = plan_memory(buffer_lists, lambda buffer: id(buffer) in internal)
  if plans is None: return
  # recorded by pool slot: a later replay's pool has the same slots (the set found again by PoolMemory.internal_slots)
  pool: list[Buffer] = schedule.pool   # type: ignore[attr-defined]
  slot_of = {id(buffer): slot for slot, buffer in enumerate(pool)}
  pattern = tuple(sorted(slot_of[key] for key in internal))
  if len(plans) >= RECORDED_PLANS_PER_SCHEDULE: plans.clear()
  plans[pattern] = RecordedPlan.of(slot_of, assigned, "schedule")


def _replay_recorded_plan(schedule: list[ScheduleItem], plans: dict[tuple[int, ...], RecordedPlan]) -> bool:
  """Plan a replayed schedule by the slots of its pool: apply the plan recorded for its set of internal buffers, or
  nothing where that set has fewer than two. False where this cannot tell (reference counts do not tell, no plan
  recorded for the set): plan as usual."""
  pool: list[Buffer] = schedule.pool   # type: ignore[attr-defined]
  pattern = schedule.memory.internal_slots(pool)   # type: ignore[attr-defined]
  if pattern is None: return False
  if len(pattern) < 2: return True   # (as planning: fewer than two internal buffers share nothing)
  recorded = plans.get(pattern)
  if recorded is None: return False
  recorded.apply(pool)
  return True


# sets of internal buffers a replayed schedule keeps a plan for (a loop meets one or two: the first step's outputs
# may still be held by the user when the next step runs)
RECORDED_PLANS_PER_SCHEDULE = 4


def _recorded_plans(schedule: list[ScheduleItem]) -> dict[tuple[int, ...], RecordedPlan] | None:
  """The plans a replayed schedule recorded (its cached schedule's PoolMemory.plans), or None for a schedule that is
  not one as the cache keeps it (planned as usual, nothing recorded): a miss's, or a replay that copy-on-write
  snapshots lengthened or kernel packing rebuilt."""
  if type(schedule) is not ReplayedSchedule or len(schedule) != schedule.memory.items: return None
  return schedule.memory.plans


COMPILE_NOTE = env_var("COMPILE_NOTE", -1, "-1: before a schedule that compiles at least 8 new kernels (a first "
                       "training step), say so on stderr when it is a terminal; 1: always; 0: never")
COMPILE_NOTE_MIN_KERNELS = 8


def count_new_kernels(schedule: list[ScheduleItem]) -> int:
  """How many kernels of `schedule` are not compiled yet in this process (each costs code generation, and a
  compile unless the disk cache has its binary)."""
  new = 0
  for item in schedule:
    if item.ast.op is Ops.COPY: continue
    ast, _ = unbind_ast(item.ast)
    if (item.outputs[0].device, ast, tf32_allowed()) not in _runner_cache: new += 1
  return new


def note_compiles(schedule: list[ScheduleItem]) -> None:
  """The "compiling N kernels" note of COMPILE_NOTE: a first step that is silent for seconds looks hung."""
  if len(schedule) < COMPILE_NOTE_MIN_KERNELS: return   # (before reading the setting: most realizes are short)
  # a replayed schedule lowered its kernels at its first replay (no isatty() call for it at every realize)
  memo = schedule[0].lowering
  if memo is not None and memo.runner is not None: return
  setting = COMPILE_NOTE.value
  if setting == 0 or (setting < 0 and not sys.stderr.isatty()): return
  new = count_new_kernels(schedule)
  if new >= COMPILE_NOTE_MIN_KERNELS:
    print(f"ourgrad: compiling {new} kernels (once per process; compiled binaries are cached on disk)",
          file=sys.stderr, flush=True)


def launch_replayed(item: ScheduleItem, memo: Any) -> None:
  """Launch a replayed item through its memo's launcher (run_schedule's quiet path) and count it as ExecItem.run
  does."""
  memo.launch([*item.outputs, *item.inputs])
  runner = memo.runner
  GlobalCounters.kernel_count += 1
  GlobalCounters.global_ops += runner.op_count
  GlobalCounters.global_mem += runner.byte_count


def launch_one(memo: Any, buffers: list[Buffer]) -> bool:
  """Launch a replayed one-kernel schedule's kernel (schedule_cache.schedule's `launch_one`) through its memo's
  launcher on `buffers` (outputs, then inputs), as run_schedule's quiet path would; False where that path would not
  take it: not lowered from the compiled-kernel cache in use, a launch that prints or is timed, a JIT recording."""
  launch = memo.launch
  # (is_capturing and quiet_launches written out: this runs at every small eager realize)
  if launch is None or memo.source is not _runner_cache or memo.generation != _runner_cache.generation or \
      _capture_lists or environ_lookup(_DEBUG_KEY) not in _QUIET_DEBUG or \
      environ_lookup(_PROFILE_KEY) not in _QUIET_PROFILE or profiler.open_blocks:
    return False
  launch(buffers)
  runner = memo.runner
  GlobalCounters.kernel_count += 1
  GlobalCounters.global_ops += runner.op_count
  GlobalCounters.global_mem += runner.byte_count
  return True


def launch_all(schedule: ReplayedSchedule, generation: int) -> bool:
  """Launch every item of a replayed schedule through its memo's launcher and count them, as run_schedule's quiet
  path would item by item, where every item was lowered (a kernel with no bound Variables and no block counters) from
  the compiled-kernel cache in use at `generation`: the launchers and the totals are taken once per cached schedule
  (ReplayedSchedule.launches), not per item and realize. False where that cannot be done (an item not lowered yet, a
  copy, a schedule that copy-on-write snapshots lengthened): the caller launches item by item."""
  if len(schedule) != schedule.memory.items: return False
  known = schedule.launches[0]
  if known is None or known[0] != generation or known[1] is not _runner_cache:
    memos = [item.lowering for item in schedule]
    if not all(memo is not None and memo.launch is not None and memo.generation == generation and
               memo.source is _runner_cache for memo in memos):
      # never, at this generation, where an item is a copy or was lowered without a launcher (symbolic sizes, block
      # counters): remembered, so such a schedule pays this check once; an item not lowered yet may be next time
      if any(item.ast.op is Ops.COPY or (memo is not None and memo.runner is not None and memo.launch is None and
                                         memo.generation == generation) for item, memo in zip(schedule, memos)):
        schedule.launches[0] = (generation, _runner_cache, None, 0, 0)
      return False
    known = schedule.launches[0] = (generation, _runner_cache, tuple(memo.launch for memo in memos),
                                    sum(memo.runner.op_count for memo in memos),
                                    sum(memo.runner.byte_count for memo in memos))
  launches = known[2]
  if launches is None: return False
  for launch, item in zip(launches, schedule): launch([*item.outputs, *item.inputs])
  GlobalCounters.kernel_count += len(schedule)
  GlobalCounters.global_ops += known[3]
  GlobalCounters.global_mem += known[4]
  return True


def run_schedule(schedule: list[ScheduleItem]) -> None:
  """Plan memory, lower and launch every item in order (counting kernels, ops and bytes in GlobalCounters)."""
  if not schedule: return
  if len(schedule) == 1:
    # one kernel (a small eager realize): nothing to plan, no note, no graph. A replayed item lowered before, while
    # nothing prints, times or records launches, is launched through its memo's launcher (ExecItem.run's fast path,
    # without an ExecItem): valid while the compiled-kernel cache it was lowered from is the one in use and has dropped
    # nothing since (a memo is only filled from a cache with a generation)
    memo = schedule[0].lowering
    if memo is not None and memo.launch is not None and memo.source is _runner_cache and \
        memo.generation == _runner_cache.generation and not is_capturing() and quiet_launches():
      launch_replayed(schedule[0], memo)
      return
  capturing = is_capturing()   # a capturing JIT keeps the items it sees: each one its own
  # a replayed item lowered before, launched while nothing prints, times or records launches: its memo's launcher
  # called with its buffers (what ExecItem.run's fast path does, without an ExecItem). A cache without a generation
  # (as a test may swap in) keeps no lowering
  generation = getattr(_runner_cache, "generation", None) if not capturing and quiet_launches() else None
  if len(schedule) > 1:
    note_compiles(schedule)
    plan_schedule_memory(schedule)
    # a cached schedule realized again and again runs as one graph (engine/capture.py; one kernel: one launch already)
    if not capturing and schedule[0].lowering is not None and \
        run_captured(schedule, getattr(_runner_cache, "generation", None)):
      return
    if generation is not None and type(schedule) is ReplayedSchedule and launch_all(schedule, generation): return
  ahead: Any = None   # the later new kernels' compiles under way side by side (COMPILE_THREADS)
  misses = _runner_misses[0]
  for index, item in enumerate(schedule):
    if ahead is not None: ahead.ready(index)
    memo = item.lowering
    if generation is not None and memo is not None and memo.launch is not None and memo.generation == generation \
        and memo.source is _runner_cache:
      launch_replayed(item, memo)
      continue
    if capturing: lower_schedule_item(item).run()
    else:
      exec_item = lower_schedule_item(item, reuse=True)
      exec_item.run()
      release(item, exec_item)
    # after the schedule's first new kernel (a warm schedule pays this one comparison per item, no look ahead)
    if misses >= 0 and _runner_misses[0] != misses:
      misses = -1
      # here, not at the top: compile_ahead builds on this module's kernel cache and rendering
      from ourgrad.engine.compile_ahead import compile_ahead
      ahead = compile_ahead(schedule, index + 1)


def stored_run(lazy: LazyBuffer) -> tuple[int, int] | None:
  """(first element, count) of the one contiguous run of its base's buffer that `lazy`, a view, reads, where that
  base is stored whatever reads it (realized already, or a kernel's output buffer: the fused attention's, a copy, a
  contiguous()) and the device's allocator names memory inside a buffer: then a device.BufferView of the run is read
  with no kernel copying it out first (Tensor.numpy() of a slice, of the fused attention's O). None for anything
  else: a strided view, or a base still to compute, whose contiguous copy computes only the elements read."""
  base = lazy.base
  if lazy.is_base or not Device[lazy.device].allocator.views_memory: return None
  if base.realized is None and base.op not in ALWAYS_REALIZED_OPS: return None
  return lazy.fixed_base_range()
