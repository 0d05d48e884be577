"""How the host devices' OpenMP threads (libgomp: CLANG's kernels and LLVM's) wait between parallel regions.

Set before libgomp loads (it reads its environment once); a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins. A
libgomp some other library loaded first (PyTorch's bundled one, of the same soname: ourgrad's kernels then share it)
kept the environment it started with (libgomp's default: ~300k spins, which on a busy machine made SmolLM2's CPU
decode ~0.7 tok/s against ~10): configure_wait_policy warns then (import ourgrad's CLANG device first, or set
OMP_WAIT_POLICY yourself).

A thread that finished its share of one kernel either spins, waiting for the next parallel region, or sleeps on a
futex that the next region's start must wake. A decode step launches ~330 parallel kernels a token back to back
(1-20 us of serial work between them): waking a sleeping thread costs ~20 us on a 2-core VM (an empty region, 2
threads: 22 us passive against 1.8 us spinning), so sleeping made 2 threads no faster than one. Spinning on a CPU
that other jobs share is worse: the spinning thread holds the core the thread it waits for needs (SmolLM2's decode,
2 threads at a load average of ~10 on 2 cores: 90 ms a token passive, 540 ms with 0.26 ms spins; a 256K-element
kernel 25-30 ms spinning against 4.5 ms passive). So: a short bounded spin (SPIN_COUNT `pause`s, ~50 us at
~25 ns each: longer than the serial gaps inside a step, shorter than the host's work between steps) where the
machine has an idle core when the process starts (its 1-minute load average under cores - 0.5), and sleeping
(passive) where it has none.
"""
from __future__ import annotations

import os
import warnings

# libgomp's spin-wait iterations before a thread sleeps: one relaxed load and one `pause` each (~25 ns on AMD Zen
# at ~65 cycles, ~45 ns on Intel's 140-cycle pause)
SPIN_COUNT = 2000


def busy_machine(load_average: float | None = None, cores: int | None = None) -> bool:
  """Whether the CPU has no idle core: a 1-minute load average of at least cores - 0.5 (the OS's figure now, or the
  ones given)."""
  if load_average is None:
    try:
      load_average = os.getloadavg()[0]
    except OSError:   # no load average on this OS: assume a shared machine
      return True
  return load_average >= (cores or os.cpu_count() or 1) - 0.5


def wait_policy(load_average: float | None = None, cores: int | None = None) -> dict[str, str]:
  """The libgomp environment for this machine (see the module's docstring)."""
  if busy_machine(load_average, cores): return {"OMP_WAIT_POLICY": "passive"}
  return {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


def openmp_runtime_loaded(maps: str = "/proc/self/maps") -> bool:
  """Whether an OpenMP runtime (libgomp) is mapped in this process already (Linux's `maps`; False where unreadable)."""
  try:
    with open(maps) as lines: return any("libgomp" in line for line in lines)
  except OSError:
    return False


def configure_wait_policy(maps: str = "/proc/self/maps") -> None:
  """Put wait_policy() in os.environ unless the user chose one (OMP_WAIT_POLICY or GOMP_SPINCOUNT set); warn where
  libgomp is loaded already (it will not read it: see the module's docstring)."""
  if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ: return
  policy = wait_policy()
  os.environ.update(policy)
  # (one thread a team, OMP_NUM_THREADS=1 as in CI: no thread ever waits, whatever the policy)
  if os.environ.get("OMP_NUM_THREADS", "").strip() != "1" and openmp_runtime_loaded(maps):
    setting = " ".join(f"{name}={value}" for name, value in policy.items())
    warnings.warn(f"an OpenMP runtime (libgomp) was loaded before ourgrad's CLANG device (PyTorch imported first?): "
                  f"it keeps its own wait policy, not ourgrad's {setting}; on a busy machine its long spins can make "
                  f"CPU kernels many times slower. Open the CLANG device before importing it, or set OMP_WAIT_POLICY "
                  f"or GOMP_SPINCOUNT in the environment before the process starts.", RuntimeWarning, stacklevel=2)
