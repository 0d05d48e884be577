"""BEAM search (ourgrad/codegen/opt/search.py): the kernel it picks computes what the unoptimized kernel (NOOPT)
computes, a second process reuses the on-disk cache instead of searching, candidates that fail to compile or hang
are dropped without failing the search, and candidate enumeration only yields Opts that apply.

Shapes are tiny and searches short (width 2, one or two rounds): these tests check behaviour, never speed."""
import hashlib
import json
import multiprocessing
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.codegen import lowering
from ourgrad.codegen.kernel import Kernel, KernelOptError, OptOps
from ourgrad.codegen.opt import beam_cache, search
from ourgrad.codegen.opt.plans import OptsPlan
from ourgrad.device import Buffer, Device
from ourgrad.engine.realize import compile_kernel, run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.renderer.cuda import CUDARenderer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
rng = np.random.default_rng(0)


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path, monkeypatch):
  """Each test gets its own cache folder (BEAM's sqlite file and the compile cache) and zeroed counters."""
  monkeypatch.setenv("OURGRAD_CACHE_DIR", str(tmp_path / "cache"))
  search.BeamCounters.reset()


def _last_item(tensor: Tensor):
  """The ScheduleItem computing `tensor`, with its inputs realized."""
  schedule = create_schedule([tensor.lazydata])
  run_schedule(schedule[:-1])
  return schedule[-1]


def _run(kernel: Kernel, item) -> np.ndarray:
  """Run `kernel` on the item's real inputs into a fresh output buffer."""
  device = item.outputs[0].device
  runner = compile_kernel(kernel, device)
  output = Buffer(device, item.outputs[0].size, item.outputs[0].dtype).allocate()
  runner((output,) + item.inputs, wait=True)
  return output.numpy()


def _matmul(m: int, k: int, n: int) -> Tensor:
  a = Tensor(rng.standard_normal((m, k)).astype(np.float32))
  b = Tensor(rng.standard_normal((k, n)).astype(np.float32))
  return a @ b


def _plain_kernel(item) -> Kernel:
  return Kernel(item.ast, Device[item.outputs[0].device].renderer)


# ---------------------------------------------------------------- the search result is correct

def test_beam_matmul_matches_noopt():
  """A search compiling in the process pool (the in-process path is covered by test_bad_candidates_are_dropped)."""
  item = _last_item(_matmul(16, 24, 8))
  plain = _plain_kernel(item)
  winner = search.beam_search(plain, None, 2, device=item.outputs[0].device, max_rounds=1, workers=2)
  assert search.BeamCounters.timed >= 2, "the search timed no candidates"
  np.testing.assert_allclose(_run(winner, item), _run(plain, item), rtol=1e-5, atol=1e-5)
  assert plain.applied_opts == [], "the search changed the kernel it was given"
  assert not multiprocessing.active_children(), "the compile workers outlived the search"


def test_beam_env_var_runs_search_and_matches_numpy(monkeypatch):
  monkeypatch.setenv("BEAM", "2")
  monkeypatch.setattr(search, "MAX_ROUNDS", 1)
  a = rng.standard_normal((12, 20)).astype(np.float32)
  b = rng.standard_normal((20, 28)).astype(np.float32)
  result = (Tensor(a) @ Tensor(b)).numpy()
  np.testing.assert_allclose(result, a @ b, rtol=1e-4, atol=1e-4)
  assert search.BeamCounters.searches == 1
  assert search.BeamCounters.cache_hits == 0


def test_beam_with_given_buffers():
  """beam_search can time on the caller's buffers (the kernel's arguments in order) instead of scratch ones."""
  item = _last_item((Tensor(rng.standard_normal((32, 16)).astype(np.float32)) * 3).sum(axis=1))
  plain = _plain_kernel(item)
  winner = search.beam_search(plain, item.bufs, 2, max_rounds=1, workers=1)
  np.testing.assert_allclose(_run(winner, item), _run(plain, item), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- the cache

CACHE_SCRIPT = """
import json, numpy as np
from ourgrad import Tensor
from ourgrad.codegen.opt import search
search.MAX_ROUNDS = 1
a = np.arange(16 * 24, dtype=np.float32).reshape(16, 24) / 100
b = np.arange(24 * 8, dtype=np.float32).reshape(24, 8) / 100
ok = bool(np.allclose((Tensor(a) @ Tensor(b)).numpy(), a @ b, rtol=1e-4))
c = search.BeamCounters
print(json.dumps({"ok": ok, "searches": c.searches, "cache_hits": c.cache_hits, "compiled": c.compiled}))
"""


def _run_cache_script(env: dict[str, str]) -> dict:
  done = subprocess.run([sys.executable, "-c", CACHE_SCRIPT], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0, done.stderr
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_hits_the_cache(tmp_path):
  env = {**os.environ, "OURGRAD_CACHE_DIR": str(tmp_path / "shared_cache"), "BEAM": "2", "DEBUG": "0",
         "DEVICE": Device.DEFAULT}
  env.pop("IGNORE_BEAM_CACHE", None)
  first = _run_cache_script(env)
  assert first == {"ok": True, "searches": 1, "cache_hits": 0, "compiled": first["compiled"]}
  assert first["compiled"] >= 2
  second = _run_cache_script(env)
  assert second == {"ok": True, "searches": 0, "cache_hits": 1, "compiled": 0}
  # IGNORE_BEAM_CACHE=1 searches again even though the cache has the kernel
  third = _run_cache_script({**env, "IGNORE_BEAM_CACHE": "1"})
  assert (third["searches"], third["cache_hits"]) == (1, 0)


def test_cache_key_depends_on_ast_device_and_width():
  device = Device.DEFAULT
  first = _last_item((Tensor(np.ones((8, 8), np.float32)) * 2).sum(axis=1)).ast
  same = _last_item((Tensor(np.zeros((8, 8), np.float32)) * 2).sum(axis=1)).ast
  other = _last_item((Tensor(np.ones((8, 8), np.float32)) * 3).sum(axis=1)).ast
  assert beam_cache.cache_key(first, device, 2) == beam_cache.cache_key(same, device, 2)
  assert beam_cache.cache_key(first, device, 2) != beam_cache.cache_key(first, device, 3)
  assert beam_cache.cache_key(first, device, 2) != beam_cache.cache_key(other, device, 2)


def test_cache_roundtrip_and_unknown_opt_kinds():
  plan = OptsPlan("search", (search.Opt(OptOps.UPCAST, 0, 4), search.Opt(OptOps.UNROLL, 0, 2)))
  beam_cache.cache_put("k1", "r_8_8", plan)
  assert beam_cache.cache_get("k1") == plan
  assert beam_cache.cache_get("missing") is None
  with beam_cache._connect() as connection:  # an entry naming an Opt kind this version lacks reads as not cached
    connection.execute("INSERT INTO beam VALUES (?, ?, ?)", ("k2", "r_8_8", json.dumps([["NOT_AN_OPT", 0, 2]])))
  assert beam_cache.cache_get("k2") is None


# ---------------------------------------------------------------- bad candidates are dropped

@pytest.mark.parametrize("workers", [1, 2], ids=["in_process", "process_pool"])
@pytest.mark.parametrize("failure", ["compile_error", "hang"])
def test_bad_candidates_are_dropped(monkeypatch, workers, failure):
  """Every candidate with an UNROLL by 2 fails to compile (or hangs past the compile timeout): the search still
  finishes, counts the failures, and returns a working kernel without that Opt."""
  real_linearize = lowering.linearize
  sabotaged = search.Opt(OptOps.UNROLL, 0, 2)

  def sabotaged_linearize(kernel):
    if sabotaged in kernel.applied_opts:
      if failure == "hang": time.sleep(60)
      raise RuntimeError("sabotaged candidate")
    return real_linearize(kernel)

  monkeypatch.setattr(lowering, "linearize", sabotaged_linearize)  # forked workers inherit the patch
  monkeypatch.setenv("BEAM_COMPILE_TIMEOUT", "5")  # generous: the healthy candidates compile on a busy machine too
  item = _last_item(_matmul(8, 16, 8))
  plain = _plain_kernel(item)
  started = time.perf_counter()
  winner = search.beam_search(plain, None, 2, device=item.outputs[0].device, max_rounds=1, workers=workers)
  assert time.perf_counter() - started < 50, "a hanging compile was not cut off"
  assert search.BeamCounters.compile_failures >= 1
  assert search.BeamCounters.timed >= 2
  assert sabotaged not in winner.applied_opts
  monkeypatch.setattr(lowering, "linearize", real_linearize)
  np.testing.assert_allclose(_run(winner, item), _run(plain, item), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- candidate enumeration

def _enumeration_cases():
  a = Tensor(rng.standard_normal((16, 24)).astype(np.float32))
  b = Tensor(rng.standard_normal((24, 12)).astype(np.float32))
  image = Tensor(rng.standard_normal((2, 3, 6, 6)).astype(np.float32))
  return {
    "matmul": a @ b,
    "row_sum": a.sum(axis=1),
    "elementwise": (a * 2 + 1).exp(),
    "padded_window_sum": image.pad(((0, 0), (0, 0), (1, 1), (1, 1))).sum(axis=(2, 3)),
  }


@pytest.mark.parametrize("renderer_kind", ["device", "cuda"])
@pytest.mark.parametrize("name", list(_enumeration_cases().keys()))
def test_candidate_enumeration_only_yields_legal_opts(name, renderer_kind):
  """Each enumerated Opt applies to a fresh copy without KernelOptError and stays in the search limits; every action
  left out either raises or breaks a limit. Two levels deep, on this device and on the CUDA renderer (LOCAL)."""
  item = _last_item(_enumeration_cases()[name])
  renderer = Device[item.outputs[0].device].renderer if renderer_kind == "device" else CUDARenderer()
  level = [Kernel(item.ast, renderer)]
  for _ in range(2):
    next_level = []
    for kernel in level:
      candidates = search.candidate_opts(kernel)
      assert candidates, f"no candidate for {kernel.name}"
      chosen = {opt for opt, _ in candidates}
      for opt, expected in candidates:
        applied = search.apply_opts(kernel, [opt])  # must not raise
        assert applied.full_shape == expected.full_shape
        assert search._within_search_limits(applied)
      for opt in search._all_actions(kernel):
        if opt in chosen: continue
        try:
          applied = search.apply_opts(kernel, [opt])
        except KernelOptError:
          continue
        assert not search._within_search_limits(applied) or search._wasteful(kernel, opt, applied), \
          f"{opt} applies but was not enumerated"
      next_level += [new for _, new in candidates[::7]]
    level = next_level[:6]
  if renderer_kind == "cuda":
    first = search.candidate_opts(Kernel(item.ast, renderer))
    assert any(opt.op is OptOps.LOCAL for opt, _ in first), "LOCAL is not searched on a GPU renderer"


def test_padto_that_doubles_an_axis_is_not_searched():
  """PADTO 32 on an axis of 16 (half its threads idle) is not a candidate; on an axis of 24 (to 32) it is."""
  item = _last_item(_matmul(16, 8, 24))
  kernel = Kernel(item.ast, CUDARenderer())
  sizes = dict(enumerate(kernel.full_shape))
  padded = {sizes[opt.axis] for opt, _ in search.candidate_opts(kernel) if opt.op is OptOps.PADTO}
  assert 16 in sizes.values() and 24 in sizes.values(), kernel.full_shape
  assert padded == {24}


def test_round_compiles_the_costliest_candidates_first():
  """_expand orders a round by register lanes, most first (a large kernel started last would keep the pool waiting
  on it alone), and still returns every unseen child of every beam member."""
  kernel = Kernel(_last_item(_matmul(32, 64, 32)).ast, CUDARenderer())
  beam = [search.TimedCandidate((), 1e-3), search.TimedCandidate((search.Opt(OptOps.UNROLL, 0, 4),), 1e-3)]
  ordered = search._expand(kernel, beam, set())
  lanes = [search.apply_opts(kernel, opts).upcast_lanes() for opts in ordered]
  assert lanes == sorted(lanes, reverse=True) and lanes[0] > lanes[-1]
  children = {member.opts + (opt,) for member in beam for opt, _ in search.candidate_opts(
    search.apply_opts(kernel, member.opts))}
  assert set(ordered) <= children and len(ordered) == len(set(ordered))
  assert {len(opts) for opts in ordered} == {1, 2}, "both members' children are in the round"


def test_every_optops_kind_is_tried():
  """Opt kinds come from OptOps itself: a kind the Kernel gains later is tried without editing the search."""
  kernel = Kernel(_last_item(_matmul(8, 8, 8)).ast, CUDARenderer())
  assert {opt.op for opt in search._all_actions(kernel)} == set(OptOps)


# ---------------------------------------------------------------- verification

def test_verify_kernel_detects_a_different_kernel():
  x = Tensor(rng.standard_normal((16, 8)).astype(np.float32))
  twice = _plain_kernel(_last_item((x * 2).sum(axis=1)))
  thrice = _plain_kernel(_last_item((x * 3).sum(axis=1)))
  device = Device.DEFAULT
  optimized = search.apply_opts(twice, [search.Opt(OptOps.UPCAST, 0, 4), search.Opt(OptOps.UNROLL, 0, 2)])
  assert search.verify_kernel(optimized, twice, device)
  assert not search.verify_kernel(thrice, twice, device)


def test_failed_verification_falls_back_to_hand_coded(monkeypatch):
  """A winner that fails verification is not used: the hand-coded kernel is, with a warning, and that is cached."""
  item = _last_item(_matmul(8, 12, 8))
  plain = _plain_kernel(item)
  monkeypatch.setattr(search, "verify_kernel", lambda *args, **kwargs: False)
  monkeypatch.setattr(search, "_search", lambda kernel, *args, **kwargs: (search.apply_opts(
    kernel, [search.Opt(OptOps.UPCAST, 0, 4)]), None))
  with pytest.warns(search.BeamVerificationWarning):
    chosen = search.beam_optimize(plain, item.outputs[0].device, 2)
  hand_coded = search.hand_coded(plain)
  assert chosen.applied_opts == hand_coded.applied_opts
  assert beam_cache.cache_get(beam_cache.cache_key(item.ast, item.outputs[0].device, 2)) == hand_coded.plan
  np.testing.assert_allclose(_run(chosen, item), _run(plain, item), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- CUDA candidates (NVRTC needs no GPU)

def test_cuda_candidates_compile_in_the_process_pool():
  """Candidates rendered for CUDA (LOCAL included) compile with NVRTC in forked workers, with launch sizes."""
  pytest.importorskip("cuda.bindings")
  from ourgrad.runtime.ops_cuda import CUDACompiler
  try:
    compiler = CUDACompiler("sm_90")
  except Exception as error:  # cuda-python without NVRTC
    pytest.skip(f"NVRTC is not usable here: {error}")
  kernel = Kernel(_last_item(_matmul(16, 8, 32)).ast, CUDARenderer())
  enumerated = [opt for opt, _ in search.candidate_opts(kernel)]
  candidates = [(opt,) for kind in (OptOps.LOCAL, OptOps.UPCAST) for opt in enumerated if opt.op is kind][:3] + \
    [(opt,) for opt in enumerated if opt.op is OptOps.UPCAST][:3]
  assert any(opts[0].op is OptOps.LOCAL for opts in candidates)
  pool = search.CandidateCompiler(search._CompileJob(kernel, compiler), "CUDA", workers=2)
  try:
    results = pool.compile(candidates)
  finally:
    pool.close()
  assert [result.error for result in results] == [""] * len(candidates)
  for opts, result in zip(candidates, results):
    threads = 1
    for size in result.local_size: threads *= size
    assert threads == (opts[0].amount if opts[0].op is OptOps.LOCAL else 1)
    assert result.binary


def test_kernel_key_dedupes_equal_loop_nests():
  kernel = Kernel(_last_item(_matmul(16, 16, 16)).ast, Device[Device.DEFAULT].renderer)
  upcast, unroll = search.Opt(OptOps.UPCAST, 0, 4), search.Opt(OptOps.UNROLL, 0, 4)

  def key(*opts):
    return search.kernel_key(search.apply_opts(kernel, list(opts)))

  assert key(upcast) == key(upcast)
  assert key(upcast) != key()
  assert key(upcast) != key(upcast, unroll)


# ---------------------------------------------------------------- the final choice against the hand-coded kernel

class _FakeClock:
  """Stands in for search.time_program: a time per candidate from `search_time(opts)` during the search and from
  `duel_time(opts, launch)` during the final duel; records the duel's times per opts."""

  def __init__(self, monkeypatch, search_time, duel_time):
    self.in_duel, self.duel_times, self.launches = False, {}, 0
    self.search_time, self.duel_time = search_time, duel_time
    real_final_choice = search._final_choice

    def final_choice(*args, **kwargs):
      self.in_duel = True
      return real_final_choice(*args, **kwargs)
    monkeypatch.setattr(search, "_final_choice", final_choice)
    monkeypatch.setattr(search, "time_program", self)

  def __call__(self, program, handles, candidate, cutoff, warmup=False):
    if not self.in_duel: return self.search_time(candidate.opts)
    self.launches += 1
    seconds = self.duel_time(candidate.opts, self.launches)
    self.duel_times.setdefault(candidate.opts, []).append(seconds)
    return seconds


def _hand_and_plain():
  item = _last_item(_matmul(16, 32, 16))
  plain = _plain_kernel(item)
  return item, plain, tuple(search.hand_coded(plain).applied_opts)


@pytest.mark.parametrize("duel_ratio, keeps_hand", [(0.99, True), (1.3, True), (0.5, False)])
def test_final_duel_keeps_the_hand_coded_kernel_unless_clearly_faster(monkeypatch, duel_ratio, keeps_hand):
  """Every searched candidate looks 2x faster during the search (noise); in the duel the searched kernel takes
  `duel_ratio` of the hand-coded one's time: only a clear win (beyond FINAL_MARGIN) replaces the hand-coded kernel."""
  item, plain, hand_opts = _hand_and_plain()
  _FakeClock(monkeypatch, lambda opts: 1e-3 if opts == hand_opts else 5e-4,
             lambda opts, launch: 1e-3 if opts == hand_opts else 1e-3 * duel_ratio)
  winner = search.beam_search(plain, item.bufs, 2, max_rounds=1, workers=1)
  assert (tuple(winner.applied_opts) == hand_opts) == keeps_hand


@pytest.mark.parametrize("seed", range(3))
def test_beam_never_returns_a_kernel_slower_than_hand_coded(monkeypatch, seed):
  """Random noisy timings (outliers included): BEAM returns the hand-coded kernel, or one whose median duel time
  beats the hand-coded kernel's median by FINAL_MARGIN. Medians of alternated rounds, not a single fastest launch."""
  item, plain, hand_opts = _hand_and_plain()
  noise = np.random.default_rng(seed)

  def noisy(base):
    return base * (1 + 0.05 * noise.standard_normal()) * (20 if noise.random() < 0.15 else 1)
  # the search itself times the hand-coded kernel slower (noise-free), so its best is always another kernel and
  # the noisy part under test is the duel
  clock = _FakeClock(monkeypatch, lambda opts: 2e-3 if opts == hand_opts else noisy(8e-4),
                     lambda opts, launch: noisy(1e-3 if opts == hand_opts else 0.98e-3))
  winner = search.beam_search(plain, item.bufs, 2, max_rounds=1, workers=1)
  opts = tuple(winner.applied_opts)
  assert clock.in_duel, "the search's best (timed faster) met the hand-coded kernel in a duel"
  if opts != hand_opts:
    assert np.median(clock.duel_times[opts]) < np.median(clock.duel_times[hand_opts]) * (1 - search.FINAL_MARGIN)
  assert all(len(times) == search.FINAL_RUNS for times in clock.duel_times.values())


# ---------------------------------------------------------------- where a search's seconds go, its budget, the cut

def test_search_stats_report_every_phase(monkeypatch, capsys):
  """beam_optimize records one SearchStats: the seeds' round and each search round (candidates, compile wall and
  CPU seconds, timing), the pool's start, the final duel and the verification; DEBUG=2 prints each round and the
  phases."""
  monkeypatch.setattr(search, "DEBUG", 2)
  monkeypatch.setattr(search, "MAX_ROUNDS", 1)
  monkeypatch.setenv("BEAM_WORKERS", "2")
  monkeypatch.setenv("BEAM_TIME_BUDGET", "0")   # a slow machine (or an emulated GPU) still runs the round
  item = _last_item(_matmul(16, 24, 8))
  search.beam_optimize(_plain_kernel(item), item.outputs[0].device, 2)
  assert len(search.BeamCounters.stats) == 1
  stats = search.BeamCounters.stats[0]
  seeds, searched = stats.rounds
  assert seeds.candidates == 2 and searched.candidates > 0
  assert stats.candidates == search.BeamCounters.timed + sum(round_stats.failed for round_stats in stats.rounds)
  assert stats.workers == 2 and stats.pool_start_s > 0
  for round_stats in stats.rounds:
    assert round_stats.compile_s > 0 and round_stats.compile_cpu_s > 0 and round_stats.time_s > 0
  assert searched.expand_s > 0 and searched.best_s <= seeds.best_s
  assert stats.verify_s > 0 or stats.best_s == stats.hand_s   # verified unless the hand-coded kernel won
  phases = stats.phases()
  assert set(phases) == {"pool", "expand", "compile", "time", "duel", "verify", "other"}
  assert sum(phases.values()) == pytest.approx(stats.total_s)
  assert stats.total_s <= search.BeamCounters.search_seconds
  printed = capsys.readouterr().out
  assert f"BEAM {stats.kernel} round 1: {searched.candidates} candidates" in printed
  assert f"BEAM {stats.kernel} phases: 1 rounds, {stats.candidates} candidates" in printed


@pytest.mark.parametrize("workers", [1, 2])
def test_time_budget_stops_the_search(monkeypatch, workers):
  """Past BEAM_TIME_BUDGET no round starts and compiles still running are dropped: the best kernel so far wins."""
  monkeypatch.setenv("BEAM_TIME_BUDGET", "1e-9")
  item = _last_item(_matmul(16, 24, 8))
  plain = _plain_kernel(item)
  stats = search.SearchStats(plain.name)
  winner = search.beam_search(plain, None, 2, device=item.outputs[0].device, workers=workers, stats=stats)
  assert stats.out_of_time and len(stats.rounds) == 1, "only the seeds were compiled and timed"
  assert tuple(winner.applied_opts) in {(), tuple(search.hand_coded(plain).applied_opts)}
  np.testing.assert_allclose(_run(winner, item), _run(plain, item), rtol=1e-5, atol=1e-5)
  assert not multiprocessing.active_children()


def test_time_budget_defaults_by_device_kind(monkeypatch):
  """-1 (the default): a budget on GPUs, where compiles dominate a search, none on CPUs; 0: none; else seconds."""
  item = _last_item(_matmul(16, 24, 8))
  from ourgrad.renderer.cstyle import ClangRenderer
  cpu, gpu = Kernel(item.ast, ClangRenderer()), Kernel(item.ast, CUDARenderer())
  monkeypatch.setenv("BEAM_TIME_BUDGET", "-1")
  assert (search.time_budget(cpu), search.time_budget(gpu)) == (float("inf"), search.GPU_TIME_BUDGET)
  monkeypatch.setenv("BEAM_TIME_BUDGET", "0")
  assert search.time_budget(gpu) == float("inf")
  monkeypatch.setenv("BEAM_TIME_BUDGET", "2.5")
  assert search.time_budget(cpu) == 2.5


class _ColdStartDevice:
  """Stands in for a device (search.Device[name]): the compiler returns the source as the binary, and a program's
  time is fixed by its source (by a hash: 0.1-10 ms, log-uniform), except that its first launch also pays for loading it
  (COLD_FACTOR times longer, as CUDA's lazy module loading can). Counts launches."""
  COLD_FACTOR = 5.0

  def __init__(self):
    self.compiler = type("FakeCompiler", (), {"compile": staticmethod(lambda source: source.encode())})()
    self.launched: set[bytes] = set()
    self.launches = 0

  def true_seconds(self, binary: bytes) -> float:
    return 1e-3 * 10 ** (2 * int.from_bytes(hashlib.sha256(binary).digest()[:4], "little") / 2**32 - 1)

  def program(self, name: str, binary: bytes):
    def launch(*handles, global_size=(), local_size=(), wait=False) -> float:
      self.launches += 1
      cold = binary not in self.launched
      self.launched.add(binary)
      return self.true_seconds(binary) * (self.COLD_FACTOR if cold else 1.0)
    return launch


_TIME_PROGRAM = search.time_program


def _UNCUT_TIME_PROGRAM(program, handles, candidate, cutoff, warmup=False):  # noqa: N802 (stands in for a function)
  return _TIME_PROGRAM(program, handles, candidate, float("inf"), warmup)


def _search_on_cold_device(monkeypatch, timing_cut: bool) -> tuple[tuple, int]:
  """The winner's opts and the launches of a search on a _ColdStartDevice; timing_cut=False times every candidate
  TIMING_RUNS times (time_program's cutoff infinite)."""
  fake = _ColdStartDevice()
  monkeypatch.setattr(search, "Device", {"FAKE": fake})
  monkeypatch.setenv("BEAM_TIME_BUDGET", "0")   # both searches run every round, however slow the machine
  monkeypatch.setattr(search, "time_program", _UNCUT_TIME_PROGRAM if not timing_cut else _TIME_PROGRAM)
  item = _last_item(_matmul(16, 32, 16))
  winner = search.beam_search(_plain_kernel(item), item.bufs, 2, device="FAKE", max_rounds=2, workers=1)
  return tuple(winner.applied_opts), fake.launches


@pytest.mark.parametrize("vector_bytes", [16, 32, 64])
def test_early_cut_never_drops_the_eventual_winner(monkeypatch, vector_bytes):
  """The same search with and without the early cut of time_program (deterministic fake timings, every program's
  first launch 5x slow) returns the same kernel; the cut saves launches. The pruning of slow beam members in _expand
  (the same EARLY_CUT) stays on in both: it is a guess that children run at their parent's speed, which hash-random
  timings do not follow. The search space depends on the renderer's SIMD width (the CPU matmul tiles), so each
  width an x86 CPU can have is checked, whatever the host's."""
  monkeypatch.setattr(Device[Device.DEFAULT].renderer, "vector_bytes", vector_bytes, raising=False)
  with_cut, launches_with_cut = _search_on_cold_device(monkeypatch, timing_cut=True)
  without_cut, launches_without_cut = _search_on_cold_device(monkeypatch, timing_cut=False)
  assert with_cut == without_cut
  assert launches_with_cut < launches_without_cut


def test_time_program_cuts_only_far_slower_candidates():
  """Launch counts of time_program: a contender gets TIMING_RUNS launches; a candidate over the cutoff twice stops
  after two; a first launch over COLD_CUT x the cutoff stops at once, and after a warm-up any over the cutoff."""
  def program_taking(*seconds):
    launches = iter(seconds)
    calls = []

    def launch(*handles, global_size=(), local_size=(), wait=False):
      calls.append(1)
      return next(launches)
    return launch, calls
  candidate = search.CompiledCandidate(())
  cases = [((1.0, 1.0, 1.0), 3, 1.0), ((5.0, 1.0, 1.0), 3, 1.0), ((5.0, 4.0, 1.0), 2, 4.0),
           ((50.0, 1.0, 1.0), 1, 50.0)]
  for seconds, launches, fastest in cases:
    program, calls = program_taking(*seconds)
    assert search.time_program(program, [], candidate, cutoff=3.0) == fastest
    assert len(calls) == launches, seconds
  # after a warm-up launch (the seeds') the program is loaded: one launch over the cutoff ends the timing
  program, calls = program_taking(1.0, 5.0, 1.0, 1.0)
  assert search.time_program(program, [], candidate, cutoff=3.0, warmup=True) == 5.0 and len(calls) == 2
