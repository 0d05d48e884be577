"""Small shared utilities: the environment-variable registry, counters, and tuple/int helpers.

Every environment variable ourgrad reads is declared once here with its default and meaning
(`ENV_VARS`); modules import the `EnvVar` objects instead of calling os.environ themselves.
"""
from __future__ import annotations

import functools
import operator
import os
import pathlib
from dataclasses import dataclass
from typing import Any, Iterable, Sequence, TypeVar

T = TypeVar("T")


# ---------------------------------------------------------------- environment variables

@dataclass(frozen=True)
class EnvVar:
  """One environment variable: read fresh on every use, so tests and users can change it at run time."""
  name: str
  default: Any
  help: str

  @property
  def value(self) -> Any:
    raw = os.environ.get(self.name)
    if raw is None: return self.default
    return type(self.default)(raw) if not isinstance(self.default, bool) else raw not in ("", "0")

  # integer comparisons so call sites read `if DEBUG >= 4:`
  def __int__(self) -> int: return int(self.value)
  def __bool__(self) -> bool: return bool(self.value)
  def __ge__(self, other: int) -> bool: return self.value >= other
  def __gt__(self, other: int) -> bool: return self.value > other
  def __le__(self, other: int) -> bool: return self.value <= other
  def __lt__(self, other: int) -> bool: return self.value < other


ENV_VARS: dict[str, EnvVar] = {}


def env_var(name: str, default: Any, help: str) -> EnvVar:
  """Declare an environment variable (once) and return its handle."""
  var = EnvVar(name, default, help)
  ENV_VARS[name] = var
  return var


DEBUG = env_var("DEBUG", 0, "1: a line per realize; 2: a line per kernel; 3: AST and opts; 4: kernel source; 5: UOps")
NOOPT = env_var("NOOPT", 0, "1: apply no kernel optimizations (the plain loop nest)")
DEVICE = env_var("DEVICE", "", "name of the default device (CLANG, CPU, PYTHON, ...); empty picks the best present")
EMULATE = env_var("EMULATE", "", "with DEVICE=PYTHON: lower kernels exactly as for this GPU backend (CUDA: its thread "
                  "limits, local memory and warp shuffles) and interpret them; empty: the PYTHON device's own limits")
CACHE_DIR = env_var("OURGRAD_CACHE_DIR", "", "folder of the on-disk compile cache (default ~/.cache/ourgrad)")
DISABLE_COMPILER_CACHE = env_var("DISABLE_COMPILER_CACHE", 0, "1: always recompile kernels, never read the disk cache")
CC = env_var("CC", "", "C compiler for the CLANG device (default: clang if present, else gcc)")


def cache_dir() -> pathlib.Path:
  """The folder of ourgrad's on-disk caches (created on first use)."""
  folder = pathlib.Path(CACHE_DIR.value) if CACHE_DIR.value else pathlib.Path.home() / ".cache" / "ourgrad"
  folder.mkdir(parents=True, exist_ok=True)
  return folder


# ---------------------------------------------------------------- counters

class GlobalCounters:
  """What ran since the last `reset()`: kernels launched, arithmetic ops, bytes read+written, device time."""
  kernel_count: int = 0
  global_ops: int = 0
  global_mem: int = 0
  time_sum_s: float = 0.0
  mem_used: int = 0  # bytes currently allocated on all devices (not reset)

  @staticmethod
  def reset() -> None:
    GlobalCounters.kernel_count = 0
    GlobalCounters.global_ops = 0
    GlobalCounters.global_mem = 0
    GlobalCounters.time_sum_s = 0.0


# ---------------------------------------------------------------- small helpers

def prod(values: Iterable[int]) -> int:
  """Product of integers (1 for an empty sequence)."""
  return functools.reduce(operator.mul, values, 1)














def make_tuple(value: int | Sequence[int], count: int) -> tuple[int, ...]:
  """`3` -> (3, 3) for count 2; sequences are returned as tuples unchanged."""
  return (value,) * count if isinstance(value, int) else tuple(value)


def normalize_axis(axis: int, ndim: int) -> int:
  """A possibly negative axis as a non-negative one; raises AxisError naming the valid range."""
  from ourgrad.errors import AxisError
  lo, hi = (-ndim, ndim - 1) if ndim > 0 else (-1, 0)
  if not lo <= axis <= hi:
    raise AxisError(f"axis {axis} is out of range for a tensor with {ndim} dimensions (expected {lo}..{hi})")
  return axis + ndim if axis < 0 else axis




def fmt_size(num_bytes: float) -> str:
  return f"{num_bytes/1e9:.2f} GB" if num_bytes >= 1e9 else f"{num_bytes/1e6:.2f} MB"


def colored(text: str, color: str | None) -> str:
  codes = {"red": 31, "green": 32, "yellow": 33, "blue": 34, "magenta": 35, "cyan": 36, "white": 37}
  return f"\x1b[{codes[color]}m{text}\x1b[0m" if color else text

