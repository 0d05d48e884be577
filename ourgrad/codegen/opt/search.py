"""BEAM search: choose a kernel's Opts by compiling and timing candidates on the device (`BEAM=n`).

    beam_optimize(kernel, device, width)   what the engine calls: the cache, then the search, then verification
    beam_search(kernel, buffers, width)    the search itself: returns the fastest Kernel it found
    candidate_opts(kernel)                 every legal Opt that can be added to a kernel (an action list × axes)

The search starts from the kernel it is given (unoptimized) and, beside it, from the hand-coded heuristic's choice.
Each round adds one Opt to every kernel of the beam in every legal way, drops candidates already seen (the same
views and axis layout reached by another order of Opts), compiles the rest in a pool of worker processes (a compile
that fails or runs past BEAM_COMPILE_TIMEOUT drops the candidate), times each on the device on scratch buffers
(fastest of a few launches, cut short when far slower than the best so far) and keeps the `width` fastest. It stops
when a round improves the best time by less than BEAM_MIN_PROGRESS, or when no Opt applies. Last, the best kernel
and the hand-coded one are launched in turns (FINAL_RUNS rounds, medians compared): the hand-coded one stays unless
the searched one is faster by a margin, so BEAM's choice is never slower than the hand-coded one as timed here.

The winner is run against the unoptimized kernel on random inputs before it is used; a mismatch falls back to the
hand-coded heuristic with a BeamVerificationWarning. Winners are kept in an sqlite file in the cache folder
(`ourgrad.helpers.cache_dir()`; beam_cache.py), keyed by the AST, the device and its compiler, and the width: another
process running the same program does no search. IGNORE_BEAM_CACHE=1 searches again.

Opts are enumerated from `OptOps` itself: an Opt kind the Kernel learns joins the search with no change here (with
the amounts of ACTION_AMOUNTS, or DEFAULT_AMOUNTS for a kind that table does not name).
"""
from __future__ import annotations

import copy
import multiprocessing
import os
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterator, Sequence

import numpy as np

from ourgrad.codegen.kernel import Kernel, KernelOptError, Opt, OptOps, describe_opts
from ourgrad.codegen.opt.beam_cache import cache_get, cache_key, cache_put
from ourgrad.codegen.opt.heuristic import STRATEGIES
from ourgrad.codegen.opt.plans import OptsPlan, Plan, replay
from ourgrad.codegen.lowering import lower_kernel
from ourgrad.device import Buffer, Device
from ourgrad.dtype import DType, dtypes
from ourgrad.helpers import (BEAM_COMPILE_TIMEOUT, BEAM_LOCAL_MAX, BEAM_MIN_PROGRESS, BEAM_UPCAST_MAX, BEAM_WORKERS,
                             BEAM_TIME_BUDGET, DEBUG, IGNORE_BEAM_CACHE, tf32_allowed)
from ourgrad.ops import LazyOp, MemBuffer, Ops

# The amounts tried for each kind of Opt, by OptOps name. 0 means "the whole axis". A kind missing here (one the
# Kernel gained later) is tried with DEFAULT_AMOUNTS; a kind a strategy owns (TC, SHARED, WGMMA: their amounts name
# tiles, stages and structures) is tried as that strategy lists it (heuristic.STRATEGIES, Strategy.beam_actions).
ACTION_AMOUNTS: dict[str, tuple[int, ...]] = {
  "UPCAST": (0, 2, 3, 4, 5, 7, 8),
  "UNROLL": (0, 2, 3, 4, 5, 7, 8),
  "LOCAL": (2, 3, 4, 8, 16, 32),
  "GROUP": (4, 8, 16, 32, 64, 128, 256),
  "GROUPTOP": (4, 8, 16, 32, 64, 128, 256),
  "PADTO": (32,),
}
DEFAULT_AMOUNTS: tuple[int, ...] = (2, 4, 8, 16)

MAX_ROUNDS = 10            # Opts added on top of the starting kernel, at most
TIMING_RUNS = 3            # launches per candidate; the fastest is its time
FINAL_RUNS = 5             # rounds of the final duel: the winner and the hand-coded kernel, in alternating order
FINAL_MARGIN = 0.03        # the searched kernel must beat the hand-coded one's median by this fraction (at least)
GPU_TIME_BUDGET = 8.0     # seconds of rounds per search on GPUs when BEAM_TIME_BUDGET is -1 (see time_budget)
OUT_OF_TIME = "the search's time budget ran out"   # the error of a candidate whose compile the budget cut short
EARLY_CUT = 3.0            # two launches this many times slower than the best so far end the candidate's timing
COLD_CUT = 10.0            # ... or a first launch this many times slower than that (see time_program)
VERIFY_RTOL = {dtypes.float16: 2e-2, dtypes.bfloat16: 5e-2}  # other floats: 1e-3
# float32 where TF32 tensor cores are allowed: inputs keep 10 mantissa bits (a product's relative error ~1e-3)
VERIFY_RTOL_TF32 = 5e-3


class BeamVerificationWarning(RuntimeWarning):
  """The kernel BEAM chose gave other results than the unoptimized kernel; the hand-coded one is used instead."""


@dataclass
class RoundStats:
  """One round of a search (round 0: the seeds): its candidates and the seconds of each phase."""
  candidates: int
  expand_s: float = 0.0       # enumerating and deduplicating the candidates (this process)
  compile_s: float = 0.0      # wall time of compiling them (the pool, or this process)
  compile_cpu_s: float = 0.0  # the candidates' own compile times summed: compile_cpu_s / compile_s = parallelism
  compile_max_s: float = 0.0  # the slowest candidate's compile (a round lasts at least this long)
  time_s: float = 0.0         # loading and launching them on the device
  failed: int = 0             # dropped: compile errors, timeouts, launch failures
  best_s: float = float("inf")   # the best kernel time after this round


@dataclass
class SearchStats:
  """Where one search's seconds went, phase by phase (DEBUG=2 prints it; BeamCounters.stats keeps each one)."""
  kernel: str
  workers: int = 1
  rounds: list[RoundStats] = field(default_factory=list)
  pool_start_s: float = 0.0   # forking the compile workers
  duel_s: float = 0.0         # the final duel against the hand-coded kernel (compile and launches)
  verify_s: float = 0.0       # checking the winner against an independent result (beam_optimize)
  total_s: float = 0.0        # the whole search, verification included
  hand_s: float | None = None   # the hand-coded kernel's time, and the winner's
  out_of_time: bool = False     # the time budget ended the rounds (BEAM_TIME_BUDGET)
  best_s: float = float("inf")

  def phases(self) -> dict[str, float]:
    """Seconds per phase; "other" is what the phases leave of total_s (hand-coded heuristic, scratch buffers)."""
    named = {"pool": self.pool_start_s, "expand": sum(r.expand_s for r in self.rounds),
             "compile": sum(r.compile_s for r in self.rounds), "time": sum(r.time_s for r in self.rounds),
             "duel": self.duel_s, "verify": self.verify_s}
    return {**named, "other": max(self.total_s - sum(named.values()), 0.0)}

  @property
  def candidates(self) -> int:
    return sum(r.candidates for r in self.rounds)

  def summary(self) -> str:
    phases = ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.phases().items())
    cpu = sum(r.compile_cpu_s for r in self.rounds)
    return (f"{len(self.rounds) - 1} rounds, {self.candidates} candidates ({sum(r.failed for r in self.rounds)} "
            f"dropped), {self.total_s:.2f} s: {phases} s; compile CPU {cpu:.2f} s on {self.workers} workers"
            f"{'; stopped by the time budget' if self.out_of_time else ''}")


class BeamCounters:
  """What BEAM did in this process since the last `reset()` (tests and bench_beam.py read these)."""
  searches: int = 0
  cache_hits: int = 0
  compiled: int = 0
  compile_failures: int = 0
  timed: int = 0
  search_seconds: float = 0.0  # wall time in beam_optimize: cache look-ups, searches, verification
  stats: list[SearchStats] = []  # one per search, in order

  @staticmethod
  def reset() -> None:
    BeamCounters.searches = BeamCounters.cache_hits = BeamCounters.compiled = 0
    BeamCounters.compile_failures = BeamCounters.timed = 0
    BeamCounters.search_seconds = 0.0
    BeamCounters.stats = []


# ---------------------------------------------------------------- candidates

def copy_kernel(kernel: Kernel) -> Kernel:
  """An independent copy: the AST, renderer and views are shared (immutable), lists and dicts are copied."""
  new = copy.copy(kernel)
  for name, value in vars(kernel).items():
    if isinstance(value, (list, dict, set)): setattr(new, name, copy.copy(value))
  return new


def apply_opts(kernel: Kernel, opts: Sequence[Opt]) -> Kernel:
  """A copy of `kernel` with `opts` applied in order; KernelOptError if one does not apply."""
  new = copy_kernel(kernel)
  for opt in opts: new.apply_opt(opt)
  return new


def hand_coded(kernel: Kernel) -> Kernel:
  """A copy of `kernel` with the hand-coded heuristic's Opts added (the one place this module calls it)."""
  new = copy_kernel(kernel)
  new.hand_coded_optimizations()
  return new


def _within_search_limits(kernel: Kernel) -> bool:
  """Register and thread budgets of the search (on top of the Kernel's own legality checks)."""
  if kernel.upcast_lanes() > BEAM_UPCAST_MAX.value: return False
  max_threads = min(BEAM_LOCAL_MAX.value, getattr(kernel.renderer, "max_threads", 1))
  return kernel.local_threads() <= max(max_threads, 1)


def _wasteful(parent: Kernel, opt: Opt, new: Kernel) -> bool:
  """An Opt that can only make the kernel slower, not worth a compile: a PADTO that doubles its axis (16 -> 32:
  half the threads of that axis only run masked loads, and its size already divides whatever a larger one would
  let other Opts use)."""
  if opt.op is not OptOps.PADTO: return False
  before, after = parent.full_shape[opt.axis], new.full_shape[opt.axis]
  return isinstance(before, int) and isinstance(after, int) and after >= 2 * before


def _all_actions(kernel: Kernel) -> Iterator[Opt]:
  """Every Opt to try on `kernel`, kind by kind in OptOps' order: each axis with each amount of ACTION_AMOUNTS, or
  for a kind a strategy owns, the Opts the strategies list (the same registry the heuristic walks)."""
  owned = [(strategy, set(strategy.beam_ops)) for strategy in STRATEGIES if strategy.beam_ops]
  listed = [opt for strategy, _ in owned for opt in strategy.beam_actions(kernel)]
  for op in OptOps:
    if any(op in ops for _, ops in owned):
      yield from (opt for opt in listed if opt.op is op)
      continue
    for axis in range(kernel.shape_len):
      for amount in ACTION_AMOUNTS.get(op.name, DEFAULT_AMOUNTS): yield Opt(op, axis, amount)


def candidate_opts(kernel: Kernel) -> list[tuple[Opt, Kernel]]:
  """Every Opt that applies to `kernel` within the search limits (and is not _wasteful), each with the kernel it
  gives."""
  candidates = []
  for opt in _all_actions(kernel):
    try:
      new = apply_opts(kernel, [opt])
    except KernelOptError:
      continue
    if _within_search_limits(new) and not _wasteful(kernel, opt, new): candidates.append((opt, new))
  return candidates


def kernel_key(kernel: Kernel) -> tuple:
  """What makes two kernels the same loop nest, whatever order of Opts built them: the views, and the kernel's
  plain layout fields (upcasted, local_dims, and any the Kernel adds: counts, flags, lists of axis kinds)."""
  layout = []
  for name, value in sorted(vars(kernel).items()):
    if name == "applied_opts": continue
    if isinstance(value, (bool, int, str, Enum)): layout.append((name, value))
    elif isinstance(value, (list, tuple)) and all(isinstance(item, (bool, int, str, Enum)) for item in value):
      layout.append((name, tuple(value)))
  # OptOps.WGMMA leaves the views as they are: the plan (a frozen dataclass) tells its kernels apart
  if getattr(kernel, "wgmma", None) is not None: layout.append(("wgmma", kernel.wgmma[0]))
  return (tuple(kernel.sts), tuple(layout))


# ---------------------------------------------------------------- scratch buffers and random inputs

def buffer_specs(ast: LazyOp) -> list[tuple[int, DType]]:
  """(elements, dtype) of each kernel argument, in argument order: enough elements for every index its views touch."""
  specs: dict[int, tuple[int, DType]] = {}
  for node in ast.walk():
    if isinstance(node.arg, MemBuffer):
      size = max(node.arg.st.real_size(), 1)
      previous = specs.get(node.arg.idx, (0, node.arg.dtype))[0]
      specs[node.arg.idx] = (max(size, previous), node.arg.dtype)
  return [specs[idx] for idx in sorted(specs)]


def scratch_buffers(ast: LazyOp, device: str) -> list[Buffer]:
  """Freshly allocated (uninitialized) buffers for a kernel's arguments: what candidates are timed on."""
  return [Buffer(device, size, dtype).allocate() for size, dtype in buffer_specs(ast)]


def random_fill(buffers: Sequence[Buffer], seed: int) -> None:
  """Fill every buffer with seeded random values: floats ~ N(0, 1), integers in 1..7 (no kernel divides by zero)."""
  rng = np.random.default_rng(seed)
  for buffer in buffers:
    if buffer.dtype == dtypes.bfloat16:
      values = (rng.standard_normal(buffer.size, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    elif buffer.dtype.is_float:
      values = rng.standard_normal(buffer.size, dtype=np.float64 if buffer.dtype.itemsize == 8 else np.float32)
      values = values.astype(buffer.dtype.np)
    elif buffer.dtype == dtypes.bool:
      values = rng.integers(0, 2, buffer.size).astype(np.bool_)
    else:
      values = rng.integers(1, 8, buffer.size).astype(buffer.dtype.np)
    buffer.copyin(memoryview(np.ascontiguousarray(values)).cast("B"))


def _as_numbers(buffer: Buffer) -> np.ndarray:
  values = buffer.numpy()
  if buffer.dtype == dtypes.bfloat16: return (values.astype(np.uint32) << 16).view(np.float32)
  return values


def outputs_match(expected: Buffer, actual: Buffer) -> bool:
  """Equal for integers and bools; close for floats (the Opts reorder sums), NaN and inf where the reference has
  them."""
  want, got = _as_numbers(expected), _as_numbers(actual)
  if not expected.dtype.is_float: return bool(np.array_equal(want, got))
  rtol = VERIFY_RTOL.get(expected.dtype, 1e-3)
  if expected.dtype == dtypes.float32 and tf32_allowed(): rtol = VERIFY_RTOL_TF32
  finite = np.abs(want[np.isfinite(want)])
  scale = max(1.0, float(finite.max())) if finite.size else 1.0
  return bool(np.allclose(got, want, rtol=rtol, atol=rtol * scale, equal_nan=True))


# ---------------------------------------------------------------- compiling candidates

@dataclass
class CompiledCandidate:
  """A candidate's binary and launch shape, or `error` (why it was dropped)."""
  opts: tuple[Opt, ...]
  name: str = ""
  binary: bytes = b""
  global_size: tuple[int, ...] = ()
  local_size: tuple[int, ...] = ()
  error: str = ""
  seconds: float = 0.0   # lowering, rendering and compiling it (where it was compiled)


@dataclass
class _CompileJob:
  """What a worker needs to build any candidate: the starting kernel (its opts are added on top) and the compiler."""
  base: Kernel
  compiler: Any


class _CompileTimeout(Exception):
  pass


def _raise_timeout(signum: int, frame: Any) -> None:
  raise _CompileTimeout()


def compile_candidate(job: _CompileJob, opts: tuple[Opt, ...], timeout: float) -> CompiledCandidate:
  """Lower, render and compile one candidate. Never raises: a failure comes back as `error`. On the main thread
  of a process (a pool worker) a compile past `timeout` seconds is interrupted; the compilers that run a
  subprocess (the C compiler) then kill it."""
  started = time.perf_counter()
  try:
    result = _compile_with_alarm(job, opts, timeout)
  except _CompileTimeout:  # also an alarm that fires while the inner function is disarming it
    result = CompiledCandidate(opts, error=f"compile took over {timeout:g} s")
  except Exception as error:  # any failure drops the candidate (compilers raise their library's errors)
    first_line = str(error).splitlines()[0] if str(error) else ""
    result = CompiledCandidate(opts, error=f"{type(error).__name__}: {first_line}")
  result.seconds = time.perf_counter() - started
  return result


def _compile_with_alarm(job: _CompileJob, opts: tuple[Opt, ...], timeout: float) -> CompiledCandidate:
  use_alarm = timeout > 0 and threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
  if use_alarm:
    previous = signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout)
  try:
    kernel = apply_opts(job.base, opts)
    lowered = lower_kernel(kernel, kernel.renderer, kernel.name)
    binary = job.compiler.compile(lowered.source)
    return CompiledCandidate(opts, kernel.name, binary, lowered.global_size, lowered.local_size)
  finally:
    if use_alarm:
      signal.setitimer(signal.ITIMER_REAL, 0)
      signal.signal(signal.SIGALRM, previous)


# The job of the pool being created: forked workers inherit it, so neither the kernel nor the compiler (which can
# hold unpicklable handles) is ever pickled; only the opts of each candidate travel.
_FORKED_JOB: _CompileJob | None = None


def _compile_in_worker(opts: tuple[Opt, ...], timeout: float) -> CompiledCandidate:
  assert _FORKED_JOB is not None, "a BEAM compile worker started without a job"
  return compile_candidate(_FORKED_JOB, opts, timeout)


# Devices whose compiler must not run in a forked child: its driver keeps threads and a context that a fork loses.
COMPILE_IN_PROCESS = {"OPENCL"}


def usable_cpus() -> int:
  """The CPU cores this process may run on (its affinity mask where the OS has one: a container or `taskset` can
  give it fewer than the machine has, and a worker per machine core would then only queue)."""
  if hasattr(os, "sched_getaffinity"): return max(len(os.sched_getaffinity(0)), 1)
  return os.cpu_count() or 1


class CandidateCompiler:
  """Compiles candidates of one search in parallel: a pool of forked worker processes (BEAM_WORKERS), or this
  process where fork is missing, BEAM_WORKERS=1, or the device's compiler cannot be forked."""

  def __init__(self, job: _CompileJob, device: str, workers: int | None = None):
    self.job = job
    count = BEAM_WORKERS.value if workers is None else workers
    self.workers = count if count > 0 else usable_cpus()
    forkable = "fork" in multiprocessing.get_all_start_methods() and device.split(":")[0] not in COMPILE_IN_PROCESS
    if not forkable: self.workers = 1
    self.pool: Any = None
    self.pool_start_s = 0.0   # seconds spent forking workers (every pool of this search)

  def _start_pool(self) -> None:
    global _FORKED_JOB
    _FORKED_JOB = self.job
    started = time.perf_counter()
    with warnings.catch_warnings():  # Python 3.12 warns on fork in a threaded process; the workers only compile
      warnings.simplefilter("ignore", DeprecationWarning)
      self.pool = multiprocessing.get_context("fork").Pool(self.workers)
    self.pool_start_s += time.perf_counter() - started

  def compile(self, candidates: Sequence[tuple[Opt, ...]], deadline: float = float("inf")) -> list[CompiledCandidate]:
    """Each candidate compiled, in order. A compile still running at `deadline` (time.perf_counter()) is dropped:
    the search's time budget is spent."""
    timeout = BEAM_COMPILE_TIMEOUT.value
    if self.workers <= 1 or len(candidates) <= 1: return [self._compile_here(opts, deadline) for opts in candidates]
    if self.pool is None: self._start_pool()
    started = time.perf_counter()
    pending = [self.pool.apply_async(_compile_in_worker, (opts, timeout)) for opts in candidates]
    results, hung = [], False
    for position, (opts, result) in enumerate(zip(candidates, pending)):
      # a worker interrupts its own slow compile; this deadline only catches a compiler stuck in native code
      stuck_at = started + (timeout + 5.0) * (position // self.workers + 1)
      try:
        results.append(result.get(timeout=max(min(stuck_at, deadline) - time.perf_counter(), 0.01)))
      except multiprocessing.TimeoutError:
        over_budget = deadline < stuck_at
        results.append(CompiledCandidate(opts, error=OUT_OF_TIME if over_budget else
                                         f"compile took over {timeout:g} s (worker stuck)"))
        hung = True
      except Exception as error:  # a worker that died (killed for memory, say) fails its candidate, not the search
        results.append(CompiledCandidate(opts, error=f"compile worker failed: {type(error).__name__}: {error}"))
    if hung: self.close()  # a stuck (or still busy) worker is killed with its pool; the next round forks a fresh one
    return results

  def _compile_here(self, opts: tuple[Opt, ...], deadline: float) -> CompiledCandidate:
    left = deadline - time.perf_counter()
    if left <= 0: return CompiledCandidate(opts, error=OUT_OF_TIME)
    return compile_candidate(self.job, opts, min(BEAM_COMPILE_TIMEOUT.value, left))

  def close(self) -> None:
    global _FORKED_JOB
    if self.pool is not None:
      self.pool.terminate()
      self.pool.join()
      self.pool = None
    _FORKED_JOB = None


# ---------------------------------------------------------------- timing

def time_program(program: Any, handles: Sequence[Any], candidate: CompiledCandidate, cutoff: float,
                 warmup: bool = False) -> float | None:
  """Fastest of TIMING_RUNS launches, after one untimed launch if `warmup`; None when the device cannot time a
  launch. The minimum, not the median: on a shared machine other work only ever adds time to a launch.
  Early cut: the timing ends when two launches were slower than `cutoff`, or the first one COLD_CUT times slower
  (a program's first launch can pay for loading it: CUDA loads a module's code lazily, at its first launch, so one
  slow first launch does not condemn a candidate that may win), or after a warm-up the first one at all."""
  if warmup: program(*handles, global_size=candidate.global_size, local_size=candidate.local_size, wait=True)
  first_cut = cutoff if warmup else cutoff * COLD_CUT
  times: list[float] = []
  for _ in range(TIMING_RUNS):
    seconds = program(*handles, global_size=candidate.global_size, local_size=candidate.local_size, wait=True)
    if seconds is None: return None
    times.append(seconds)
    if min(times) > cutoff and (len(times) >= 2 or seconds > first_cut): break
  return min(times)


@dataclass
class TimedCandidate:
  opts: tuple[Opt, ...]
  seconds: float


class _Progress:
  """A tqdm bar over the candidates (when tqdm is installed and DEBUG>=1 or stderr is a terminal), else nothing."""

  def __init__(self, name: str):
    self.name, self.bar = name, None
    self.show = DEBUG >= 1 or sys.stderr.isatty()

  def add(self, count: int) -> None:
    if not self.show: return
    if self.bar is None:
      try:
        from tqdm import tqdm
      except ImportError:
        self.show = False
        return
      self.bar = tqdm(total=0, desc=f"BEAM {self.name}", leave=DEBUG >= 2, unit="kernel")
    self.bar.total += count
    self.bar.refresh()

  def step(self, best_seconds: float) -> None:
    if self.bar is not None:
      self.bar.set_postfix_str(f"best {best_seconds * 1e3:.3f} ms", refresh=False)
      self.bar.update(1)

  def close(self) -> None:
    if self.bar is not None: self.bar.close()


class _Timer:
  """Loads compiled candidates and times them on one set of buffers, keeping the best time seen."""

  def __init__(self, device: str, buffers: Sequence[Buffer], progress: _Progress):
    self.device, self.progress = device, progress
    self.handles = [buffer.handle for buffer in buffers]
    self.best = float("inf")
    self.untimable = False
    self.compiled: dict[tuple[Opt, ...], CompiledCandidate] = {}  # every timed candidate's binary, by its opts

  def time_all(self, compiled: Sequence[CompiledCandidate], warmup: bool = False) -> list[TimedCandidate]:
    timed: list[TimedCandidate] = []
    for candidate in compiled:
      seconds = self._time_one(candidate, warmup)
      if seconds is not None:
        timed.append(TimedCandidate(candidate.opts, seconds))
        self.compiled[candidate.opts] = candidate
        self.best = min(self.best, seconds)
      self.progress.step(self.best)
      if self.untimable: break
    return timed

  def _time_one(self, candidate: CompiledCandidate, warmup: bool) -> float | None:
    if candidate.error:
      BeamCounters.compile_failures += 1
      if DEBUG >= 4: print(f"BEAM dropped [{describe_opts(candidate.opts)}]: {candidate.error}")
      return None
    BeamCounters.compiled += 1
    try:
      program = Device[self.device].program(candidate.name, candidate.binary)
      seconds = time_program(program, self.handles, candidate, self.best * EARLY_CUT, warmup)
    except Exception as error:  # a binary the device cannot load or launch drops the candidate
      BeamCounters.compile_failures += 1
      if DEBUG >= 4: print(f"BEAM dropped [{describe_opts(candidate.opts)}]: {type(error).__name__}: {error}")
      return None
    if seconds is None:
      self.untimable = True
      return None
    BeamCounters.timed += 1
    return seconds


# ---------------------------------------------------------------- the search

def beam_search(kernel: Kernel, buffers: Sequence[Buffer] | None, beam_width: int, device: str | None = None,
                min_progress: float | None = None, max_rounds: int | None = None,
                workers: int | None = None, stats: SearchStats | None = None) -> Kernel:
  """The fastest kernel found by a beam search of width `beam_width` over Opts added to `kernel` (normally the
  unoptimized one), timed on `buffers` (the kernel's arguments in order; None: scratch buffers). The hand-coded
  heuristic's kernel competes in the first round, so the result is never slower than it as timed here. Returns
  the hand-coded kernel when the device cannot time launches. Results are not verified here (see beam_optimize).
  Where the seconds went is filled into `stats` (a new SearchStats if None), which BeamCounters.stats keeps."""
  return _search(kernel, buffers, beam_width, device, min_progress, max_rounds, workers, stats)[0]


def time_budget(kernel: Kernel) -> float:
  """Seconds a search of `kernel` may spend in its rounds (BEAM_TIME_BUDGET; -1: 8 s on GPUs, where compiling is
  what costs and the H100's 1024^3 matmul once searched for 20 s, unlimited on CPUs, where timing slow candidates
  is what costs and a budget would cut the searches that find the large gains); inf: no limit."""
  budget = BEAM_TIME_BUDGET.value
  if budget < 0: budget = GPU_TIME_BUDGET if getattr(kernel.renderer, "has_local", False) else 0.0
  return budget if budget > 0 else float("inf")


def _search(kernel: Kernel, buffers: Sequence[Buffer] | None, beam_width: int, device: str | None,
            min_progress: float | None, max_rounds: int | None, workers: int | None,
            stats: SearchStats | None) -> tuple[Kernel, CompiledCandidate | None]:
  """beam_search, also returning the winner's compiled binary (None: the heuristic's kernel, not compiled here)."""
  started = time.perf_counter()
  device = device or (buffers[0].device if buffers else kernel.renderer.device)
  stats = stats if stats is not None else SearchStats(kernel.name)
  BeamCounters.stats.append(stats)
  if buffers is None:
    buffers = scratch_buffers(kernel.ast, device)
    random_fill(buffers, seed=0)  # not uninitialized memory: NaNs and denormals take slow paths on some CPUs
  progress_threshold = BEAM_MIN_PROGRESS.value if min_progress is None else min_progress
  BeamCounters.searches += 1
  job = _CompileJob(copy_kernel(kernel), Device[device].compiler)
  compiler = CandidateCompiler(job, device, workers)
  stats.workers = compiler.workers
  progress = _Progress(kernel.name)
  timer = _Timer(device, buffers, progress)
  try:
    heuristic = hand_coded(kernel)
    hand_opts = tuple(heuristic.applied_opts[len(kernel.applied_opts):])
    seeds = [hand_opts, ()] if hand_opts else [()]
    seen = {kernel_key(apply_opts(kernel, opts)) for opts in seeds}
    progress.add(len(seeds))
    # the first launches of a process pay for thread pools and first touches of memory: the seeds warm up first
    timed = _run_round(stats, timer, compiler, seeds, 0.0, warmup=True)
    if timer.untimable or not timed: return heuristic, None  # nothing to compare: the heuristic's choice
    hand_seconds = next((c.seconds for c in timed if c.opts == hand_opts), None)
    beam = sorted(timed, key=lambda c: c.seconds)[:beam_width]
    best = beam[0]
    deadline = started + time_budget(kernel)
    for _ in range(MAX_ROUNDS if max_rounds is None else max_rounds):
      expand_started = time.perf_counter()
      if expand_started >= deadline:
        stats.out_of_time = True
        break
      candidates = _expand(kernel, beam, seen)
      if not candidates: break
      progress.add(len(candidates))
      timed = _run_round(stats, timer, compiler, candidates, time.perf_counter() - expand_started, deadline)
      if not timed: break
      round_beam = sorted(timed, key=lambda c: c.seconds)[:beam_width]
      if round_beam[0].seconds >= best.seconds * (1 - progress_threshold): break
      beam, best = round_beam, round_beam[0]
    if hand_seconds is not None and best.opts != hand_opts:
      duel_started = time.perf_counter()
      best, hand_seconds = _final_choice(timer, [timer.compiled[best.opts], timer.compiled[hand_opts]], best,
                                         hand_seconds, progress_threshold)
      stats.duel_s = time.perf_counter() - duel_started
  finally:
    stats.pool_start_s = compiler.pool_start_s
    compiler.close()
    progress.close()
  winner = apply_opts(kernel, best.opts)
  if best.opts == hand_opts: winner.plan = heuristic.plan   # the heuristic's typed plan, saved by the cache
  stats.hand_s, stats.best_s = hand_seconds, best.seconds
  stats.total_s += time.perf_counter() - started
  _report(kernel.name, winner, best.seconds, hand_seconds, stats.total_s)
  return winner, timer.compiled.get(best.opts)


def _run_round(stats: SearchStats, timer: _Timer, compiler: CandidateCompiler, candidates: Sequence[tuple[Opt, ...]],
               expand_s: float, deadline: float = float("inf"), warmup: bool = False) -> list[TimedCandidate]:
  """Compile (until `deadline`) and time one round's candidates, recording the round's phases in `stats` (and
  printing them at DEBUG>=2)."""
  pool_before, started = compiler.pool_start_s, time.perf_counter()
  compiled = compiler.compile(candidates, deadline)
  if any(candidate.error == OUT_OF_TIME for candidate in compiled): stats.out_of_time = True
  compiled_at = time.perf_counter()
  timed = timer.time_all(compiled, warmup)
  round_stats = RoundStats(len(candidates), expand_s, compiled_at - started - (compiler.pool_start_s - pool_before),
                           sum(candidate.seconds for candidate in compiled),
                           max((candidate.seconds for candidate in compiled), default=0.0),
                           time.perf_counter() - compiled_at, len(candidates) - len(timed), timer.best)
  stats.rounds.append(round_stats)
  if DEBUG >= 2:
    print(f"BEAM {stats.kernel} round {len(stats.rounds) - 1}: {round_stats.candidates} candidates "
          f"({round_stats.failed} dropped), expand {expand_s:.2f} s, compile {round_stats.compile_s:.2f} s "
          f"({round_stats.compile_cpu_s:.2f} s CPU, {compiler.workers} workers, slowest "
          f"{round_stats.compile_max_s:.2f} s), time {round_stats.time_s:.2f} s, "
          f"best {timer.best * 1e3:.4f} ms")
  return timed


def _final_choice(timer: _Timer, compiled: Sequence[CompiledCandidate], best: TimedCandidate,
                  hand_seconds: float, margin: float) -> tuple[TimedCandidate, float]:
  """The search's best (`compiled[0]`) against the hand-coded kernel (`compiled[1]`): FINAL_RUNS rounds, each
  launching both in turns (which goes first alternates, so neither always finds the caches warm), then the medians
  of the rounds are compared. The hand-coded kernel stays unless the searched one's median is faster by more than
  `margin` (at least FINAL_MARGIN): a search that won by noise returns the heuristic's choice, so BEAM never picks
  a kernel slower than the hand-coded one as timed here. Returns the winner and the hand-coded kernel's time."""
  hand = TimedCandidate(compiled[1].opts, hand_seconds)
  if compiled[0].error: return hand, hand_seconds
  if compiled[1].error: return best, hand_seconds
  programs = [Device[timer.device].program(candidate.name, candidate.binary) for candidate in compiled]
  times: list[list[float]] = [[], []]
  for round_number in range(FINAL_RUNS):
    order = (0, 1) if round_number % 2 == 0 else (1, 0)
    for index in order:
      times[index].append(time_program(programs[index], timer.handles, compiled[index], float("inf")) or 0.0)
  searched_median, hand_median = float(np.median(times[0])), float(np.median(times[1]))
  if searched_median < hand_median * (1 - max(margin, FINAL_MARGIN)):
    return TimedCandidate(best.opts, searched_median), hand_median
  return TimedCandidate(hand.opts, hand_median), hand_median


def _expand(kernel: Kernel, beam: Sequence[TimedCandidate], seen: set) -> list[tuple[Opt, ...]]:
  """Each beam member with one more legal Opt, minus loop nests already seen (marked seen now). A member over
  EARLY_CUT times slower than the best is not expanded: its children are timed at its speed, and on a CPU a slow
  kernel (an unoptimized matmul) costs seconds per launch.
  The costliest to compile first (longest processing time first): a round waits for its last compile, and one large
  kernel started last would keep the pool waiting on it alone. The cost is guessed by the register lanes (upcasts x
  unrolls), which the compile time follows (CUDA 1024^3 matmul: 24 lanes 0.2-0.45 s, 84 lanes 0.6-0.9 s, 164 lanes
  1.7-1.9 s on this project's CPU); H100 run: a round of 33 candidates took 5.5 s for 36 s of CPU on 16 workers."""
  candidates: list[tuple[int, tuple[Opt, ...]]] = []
  fastest = min(member.seconds for member in beam)
  for member in beam:
    if member.seconds > fastest * EARLY_CUT: continue
    for opt, new in candidate_opts(apply_opts(kernel, member.opts)):
      key = kernel_key(new)
      if key in seen: continue
      seen.add(key)
      candidates.append((new.upcast_lanes(), member.opts + (opt,)))
  candidates.sort(key=lambda candidate: -candidate[0])   # stable: equal costs keep the beam's order
  return [opts for _, opts in candidates]


def _report(name: str, winner: Kernel, seconds: float, hand_seconds: float | None, search_seconds: float) -> None:
  if DEBUG >= 2:
    gain = f"{hand_seconds * 1e3:.3f} ms -> {seconds * 1e3:.3f} ms, {hand_seconds / seconds:.2f}x" \
      if hand_seconds else f"{seconds * 1e3:.3f} ms"
    print(f"BEAM {name}: {gain} (hand-coded -> BEAM), opts [{describe_opts(winner.applied_opts)}], "
          f"searched in {search_seconds:.2f} s")


# ---------------------------------------------------------------- verification

def verify_kernel(candidate: Kernel, reference: Kernel, device: str, seed: int = 0,
                  candidate_binary: CompiledCandidate | None = None) -> bool:
  """Whether `candidate` writes the same values as `reference` (same AST) from the same random inputs.
  `candidate_binary`: the candidate as the search compiled it (saves compiling it again; a large searched kernel
  takes seconds), else it is compiled here."""
  results = []
  for kernel, binary in ((reference, None), (candidate, candidate_binary)):
    compiled = binary or compile_candidate(_CompileJob(kernel, Device[device].compiler), (), BEAM_COMPILE_TIMEOUT.value)
    if compiled.error: return False
    buffers = scratch_buffers(kernel.ast, device)
    random_fill(buffers, seed)  # outputs too: places a kernel does not store keep the same values in both runs
    program = Device[device].program(compiled.name, compiled.binary)
    program(*[buffer.handle for buffer in buffers], global_size=compiled.global_size,
            local_size=compiled.local_size, wait=True)
    results.append(buffers)
  stored = sorted({node.arg.idx for node in reference.ast.walk() if node.op is Ops.STORE})
  return all(outputs_match(results[0][idx], results[1][idx]) for idx in stored)


# ---------------------------------------------------------------- what the engine calls

def beam_optimize(kernel: Kernel, device: str, beam_width: int) -> Kernel:
  """`kernel` (unoptimized) with the Opts BEAM chose: from the cache, or searched, verified and cached."""
  started = time.perf_counter()
  try:
    return _cached_or_searched(kernel, device, beam_width)
  finally:
    BeamCounters.search_seconds += time.perf_counter() - started


def _cached_or_searched(kernel: Kernel, device: str, beam_width: int) -> Kernel:
  key = cache_key(kernel.ast, device, beam_width)
  if not IGNORE_BEAM_CACHE:
    cached = cache_get(key)
    if cached is not None:
      try:
        optimized = replay(cached, kernel)
      except KernelOptError:  # cached under Opt rules that changed since: search again
        optimized = None
      if optimized is not None:
        BeamCounters.cache_hits += 1
        if DEBUG >= 2: print(f"BEAM {kernel.name}: cache hit, {cached!r}")
        return optimized
  stats = SearchStats(kernel.name)
  winner, binary = _search(kernel, None, beam_width, device, None, None, None, stats)
  verify_started = time.perf_counter()
  if winner.applied_opts and not verify_kernel(winner, kernel, device, candidate_binary=binary):
    warnings.warn(f"BEAM's kernel for {kernel.name} with opts {winner.applied_opts} gives other results than the "
                  f"unoptimized kernel; using the hand-coded optimizations", BeamVerificationWarning, stacklevel=2)
    winner = hand_coded(kernel)
  stats.verify_s = time.perf_counter() - verify_started
  stats.total_s += stats.verify_s
  if DEBUG >= 2: print(f"BEAM {kernel.name} phases: {stats.summary()}")
  cache_put(key, kernel.name, plan_of(winner))
  return winner


def plan_of(kernel: Kernel) -> Plan:
  """The plan that gives `kernel`: the strategy's where the heuristic's choice won, else its Opts (an OptsPlan)."""
  return kernel.plan if kernel.plan is not None else OptsPlan("search", tuple(kernel.applied_opts))
