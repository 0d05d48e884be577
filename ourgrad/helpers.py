"""Small shared utilities: the environment-variable registry, counters, and tuple/int helpers.

Every environment variable ourgrad reads is declared once here with its default and meaning
(`ENV_VARS`); modules import the `EnvVar` objects instead of calling os.environ themselves.
"""
from __future__ import annotations

import functools
import operator
import os
import pathlib
import sys
import time
from dataclasses import dataclass
from collections import OrderedDict
from typing import Any, Callable, Iterable, Sequence, TypeVar

# (errors.py imports nothing: no cycle. A function-level import cost every axis normalization ~1 us)
from ourgrad.errors import AxisError, PrecisionError

T = TypeVar("T")


# ---------------------------------------------------------------- environment variables

# os.environ's own store (bytes -> bytes on POSIX), which every change through os.environ updates. Reading it directly
# costs 0.1 us; os.environ.get of an unset variable raises and catches a KeyError inside (about 2 us), and the engine
# reads DEBUG and PROFILE at every launch. None where the store is not that (Windows keys it differently).
_ENVIRON_STORE: dict[bytes, bytes] | None = getattr(os.environ, "_data", None) if os.name == "posix" else None

# the raw value of a variable by its encoded name (None: unset), in one dict lookup where the store allows it: the
# cheapest "is DEBUG set?" that a per-launch fast path can ask (ExecItem.run)
environ_lookup: Callable[[bytes], Any] = _ENVIRON_STORE.get if _ENVIRON_STORE is not None else \
  (lambda key: os.environ.get(os.fsdecode(key)))


@dataclass(frozen=True)
class EnvVar:
  """One environment variable: read fresh on every use, so tests and users can change it at run time."""
  name: str
  default: Any
  help: str

  @functools.cached_property
  def _key(self) -> bytes: return os.fsencode(self.name)

  def raw(self) -> str | None:
    """The variable's text, or None when it is not set."""
    if _ENVIRON_STORE is None: return os.environ.get(self.name)
    raw = _ENVIRON_STORE.get(self._key)
    return None if raw is None else os.fsdecode(raw)

  # the value parsed from each raw text seen (bytes from the environment's store, or None when unset): the engine
  # reads several variables per realize and per op, and a dict lookup is cheaper than decoding and parsing again
  @functools.cached_property
  def _parsed(self) -> dict[Any, Any]: return {}

  @property
  def value(self) -> Any:
    raw = _ENVIRON_STORE.get(self._key) if _ENVIRON_STORE is not None else os.environ.get(self.name)
    if raw is None: return self.default   # (unset, the common case: what _parse(None) gives, no lookup)
    parsed = self._parsed
    if raw in parsed: return parsed[raw]
    value = self._parse(raw if raw is None or isinstance(raw, str) else os.fsdecode(raw))
    if len(parsed) < 64: parsed[raw] = value   # bounded: a variable set to ever new texts keeps parsing them
    return value

  def _parse(self, raw: str | None) -> Any:
    if raw is None: return self.default
    return type(self.default)(raw) if not isinstance(self.default, bool) else raw not in ("", "0")

  # integer comparisons so call sites read `if DEBUG >= 4:`
  def __int__(self) -> int: return int(self.value)
  def __bool__(self) -> bool: return bool(self.value)
  def __ge__(self, other: int) -> bool: return self.value >= other
  def __gt__(self, other: int) -> bool: return self.value > other
  def __le__(self, other: int) -> bool: return self.value <= other
  def __lt__(self, other: int) -> bool: return self.value < other


class EnvSnapshot:
  """The values of several variables read at once: one tuple of their raw texts (a map over the environment's store)
  and one dict lookup, where a `value` per variable costs a few Python calls each. For code that reads the same
  settings at every realize (the schedule cache's key)."""

  def __init__(self, *variables: EnvVar):
    self.variables = variables
    self._keys = tuple(variable._key for variable in variables)
    self._parsed: dict[tuple, tuple] = {}

  def values(self) -> tuple:
    """The variables' values now, in the order given."""
    raw = tuple(map(environ_lookup, self._keys))
    parsed = self._parsed.get(raw)
    if parsed is None:
      parsed = tuple(variable.value for variable in self.variables)
      if len(self._parsed) < 64: self._parsed[raw] = parsed   # bounded, as EnvVar's own
    return parsed


ENV_VARS: dict[str, EnvVar] = {}


def env_var(name: str, default: Any, help: str) -> EnvVar:
  """Declare an environment variable (once) and return its handle."""
  var = EnvVar(name, default, help)
  ENV_VARS[name] = var
  return var


DEBUG = env_var("DEBUG", 0, "1: a line per realize; 2: a line per kernel; 3: AST and opts; 4: kernel source; 5: UOps; "
                "6: device assembly")
NOOPT = env_var("NOOPT", 0, "1: apply no kernel optimizations (the plain loop nest)")
DEVICE = env_var("DEVICE", "", "name of the default device (CLANG, CPU, PYTHON, ...); empty picks the best present")
EMULATE = env_var("EMULATE", "", "with DEVICE=PYTHON: lower kernels exactly as for this GPU backend (CUDA: its thread "
                  "limits, local memory and warp shuffles; CUDA_SM90: an H100's, wgmma included) and interpret them; "
                  "empty: the PYTHON device's own limits")
CACHE_DIR = env_var("OURGRAD_CACHE_DIR", "", "folder of the on-disk compile cache (default ~/.cache/ourgrad)")
DISABLE_COMPILER_CACHE = env_var("DISABLE_COMPILER_CACHE", 0, "1: always recompile kernels, never read the disk cache")
CC = env_var("CC", "", "C compiler for the CLANG device (default: clang if present, else gcc)")
CLANG_MARCH = env_var("CLANG_MARCH", "native", "the -march of CLANG kernels (x86-64-v2, x86-64-v3, znver3, ...; "
                      "native: this CPU): part of the compile-cache key, and the SIMD width the renderer assumes "
                      "follows it")
INTEGER_PRODUCTS = env_var("INTEGER_PRODUCTS", 1, "1: a CPU decode step's products with Q8_0/Q4_0/Q4_1 weights "
                           "quantize x to 8-bit blocks and take integer dot products, as llama.cpp (PackedTensor."
                           "integer_linear); 0: x stays float32 (the weights dequantized in registers)")
LLVM_CPU = env_var("LLVM_CPU", "native", "the CPU the LLVM device compiles for (x86-64-v2, x86-64-v3, znver3, ...; "
                   "native: this CPU with all its features); the SIMD width the renderer assumes follows it")
LLVM_FEATURES = env_var("LLVM_FEATURES", "", "LLVM target features applied after LLVM_CPU's own (native's: the "
                        "host's), e.g. \"-avx512f\" or \"+avx2,+fma\"; the SIMD width follows them too")
CPU_VECTORS = env_var("CPU_VECTORS", 1, "0: CLANG register tiles stay scalar C for the compiler to vectorize "
                      "(1: explicit GCC vectors, renderer/cvector.py)")
GRAPH = env_var("GRAPH", 0, "1: write the lazy graph and the schedule of each realize as Graphviz .dot (and .svg)")
GRAPH_DIR = env_var("GRAPH_DIR", "", "folder of the GRAPH=1 files (default: ourgrad_graph in the system temp folder)")
PROFILE = env_var("PROFILE", 0, "1: record kernels, copies and host phases; write a Chrome/Perfetto trace at exit")
PROFILE_PATH = env_var("PROFILE_PATH", "", "file of the PROFILE=1 trace (default: ourgrad_trace.json in the system "
                       "temp folder)")
ROW_KERNELS = env_var("ROW_KERNELS", -1, "1: fuse reduces over the same rows (softmax, layernorm) into one kernel on "
                      "every device; 0: never; -1: on CPUs (a thread per row) and on GPUs with local memory (a block "
                      "per row)")
ROW_INTERLEAVE = env_var("ROW_INTERLEAVE", 1, "1: a GPU row kernel whose largest loads are strided along the row but "
                         "contiguous across rows runs neighbouring rows on neighbouring threads (whole 32-byte "
                         "sectors a warp load); 0: a row's threads side by side")
ELEMENT_REDUCES = env_var("ELEMENT_REDUCES", 0, "1: a short reduce whose results a GPU row kernel reads per element of "
                          "its rows (decode attention's scores inside the softmax x V row kernel) is computed by that "
                          "kernel's blocks into local memory (codegen/element_reduces.py); 0 (default: slower on the "
                          "H200's decode, docs/fusion.md): a kernel of its own")
VECTOR_GROUP_REDUCE = env_var("VECTOR_GROUP_REDUCE", 1, "1: a GPU row reduction over a byte load (Q8_0's "
                              "quants) contiguous along its reduce reads a vector a thread (its innermost reduce "
                              "axis unrolled by the vector width before GROUP); 0: one element a thread")
STACK_MANY_ROWS = env_var("STACK_MANY_ROWS", 1, "1: a GPU row kernel whose rows fill the GPU several times over, "
                          "with a load broadcast along them (a vocabulary's logits), stacks rows side by side in a "
                          "thread group while a wave stays full; 0: a row a thread group")
QUANTS_APART = env_var("QUANTS_APART", 1, "1: a GPU PackedTensor keeps its blocks without their leading f16 scale "
                       "bytes (Q8_0, Q4_0, Q4_1: the quants aligned); 0: the blocks as stored")
MATMUL_GRID = env_var("MATMUL_GRID", 1, "1: a float32 matmul on a GPU (of at least 2^28 multiply-adds) takes the block "
                      "tile and the split of its reduce across blocks (split-K) that codegen/opt/matmul_grid.py "
                      "predicts fastest; 0: the largest tile whose grid gives every multiprocessor a block, no split")
KERNEL_OPS_LIMIT = env_var("KERNEL_OPS_LIMIT", 1024, "most ops fused into one kernel; a bigger fused graph is split "
                           "by realizing intermediates, so compile time grows linearly with graph size (0: no limit)")
SPLIT_LAST_BLOCK = env_var("SPLIT_LAST_BLOCK", 0, "1: on a device with atomics (CUDA), a split reduce's partials are "
                           "summed by the last block of the first kernel (one launch: engine/split_fusion.py); 0 (the "
                           "default: the H200's MNIST TinyJit step took 0.146 ms with 1, 0.134 with 0): a second "
                           "kernel sums them, as on other devices")
RIDE_ALONG = env_var("RIDE_ALONG", 1, "1: a one-block reduce to one value (a loss's mean over rows, a count) runs in "
                     "the first block of an independent larger kernel beside it in the schedule, one launch less "
                     "(engine/ride_along.py); 0: in a kernel of its own")
GATED_VECTOR_LOADS = env_var("GATED_VECTOR_LOADS", 1, "1 (the default): a masked view (a cat piece, a padded edge) "
                             "whose validity is uniform over a float4 loads one gated vector (codegen/linearizer.py; "
                             "the H200's 2-layer GPT-2 qkv-gradient cat: 50 us against 69 us); 0: scalar masked loads")
PACK_KERNELS = env_var("PACK_KERNELS", 1, "1: pack independent elementwise kernels of different shapes (an optimizer's "
                       "per-parameter updates) and, on GPUs, small reduces (split reduces' second kernels) into one "
                       "launch (engine/packing.py); 0: one launch per kernel")
MAX_PACK_BUFFERS = env_var("MAX_PACK_BUFFERS", 128, "most buffer arguments of one packed kernel; more kernels are "
                           "split into several packs (CUDA passes at most 4 KB of kernel arguments)")
ALLOCATOR_CACHE_BYTES = env_var("ALLOCATOR_CACHE_BYTES", -2, "most bytes of freed buffers an allocator keeps for "
                                "reuse per device; more are given back to the device (-1: no limit; -2: a quarter of "
                                "the device's memory, at least 2 GiB, 2 GiB where the device does not say)")
RUNNER_CACHE_SIZE = env_var("RUNNER_CACHE_SIZE", 4096, "most compiled kernels kept in memory; the least recently "
                            "used is dropped past it (-1: no limit)")
COMPILE_CACHE_BYTES = env_var("COMPILE_CACHE_BYTES", 2 << 30, "most bytes the on-disk compile cache keeps; past it the "
                              "least recently used binaries are deleted (-1: no limit)")
CUDA_PTX = env_var("CUDA_PTX", 0, "1: the CUDA device has NVRTC compile kernels to PTX only and the driver compile "
                   "the PTX when it loads it; 0: NVRTC compiles to the GPU's machine code (CUBIN). On the H100 a new "
                   "8-op kernel's first result took 41 ms with CUBIN, 57 ms with PTX (the driver's load: 22 ms)")
CUDA_DEPENDENT_LAUNCH = env_var("CUDA_DEPENDENT_LAUNCH", 1, "on sm_90, how a TinyJit's CUDA graph launches each "
                                "kernel before the one before it has completed (each waits for it in its prologue): "
                                "0: plain edges (launched when the one before completed); 1: programmatic edges, "
                                "launched as the blocks of the one before exit; 2: as 1, but a kernel whose blocks fit "
                                "beside those still resident is launched as soon as the blocks of the one before have "
                                "started (CUDARenderer.early_launches); 3: every kernel that early; 4: as 2, and only "
                                "after a kernel that takes at most a launch's time (2-4: measurements, docs/jit.md)")
COMPILE_TIMEOUT = env_var("COMPILE_TIMEOUT", 300.0, "seconds one kernel may take to compile before a CompileError "
                          "naming it (CLANG; 0: no limit)")
COMPILE_THREADS = env_var("COMPILE_THREADS", 0, "threads that compile a schedule's new kernels side by side "
                          "(CLANG, CUDA; engine/compile_ahead.py); 0: min(CPU count, 8); 1: one at a time, as each "
                          "kernel launches")
BEAM = env_var("BEAM", 0, "n>0: pick each kernel's Opts by a beam search of width n, timed on the device and "
               "cached on disk (docs/beam.md)")
IGNORE_BEAM_CACHE = env_var("IGNORE_BEAM_CACHE", 0, "1: BEAM searches again even when its cache has the kernel")
BEAM_MIN_PROGRESS = env_var("BEAM_MIN_PROGRESS", 0.02, "BEAM stops when a round makes the best kernel faster by less "
                            "than this fraction")
BEAM_COMPILE_TIMEOUT = env_var("BEAM_COMPILE_TIMEOUT", 10.0, "seconds a BEAM candidate may take to compile; a slower "
                               "one is dropped")
BEAM_TIME_BUDGET = env_var("BEAM_TIME_BUDGET", -1.0, "seconds of compiling and timing candidates after which a BEAM "
                           "search starts no new round and drops the compiles still running (the best so far wins); "
                           "-1: 8 on GPUs (devices with local memory), no limit on CPUs; 0: no limit")
BEAM_WORKERS = env_var("BEAM_WORKERS", 0, "processes compiling BEAM candidates: 0 one per CPU core, 1 none (compile in "
                       "this process)")
BEAM_UPCAST_MAX = env_var("BEAM_UPCAST_MAX", 256, "BEAM considers no kernel with more upcast/unroll lanes than this")
BEAM_LOCAL_MAX = env_var("BEAM_LOCAL_MAX", 1024, "BEAM considers no kernel with more threads per block than this "
                         "(the device's own limit applies too)")
TF32 = env_var("TF32", 0, "1: float32 matmuls and convolutions may run on TensorFloat-32 tensor cores (inputs rounded "
              "to 10 mantissa bits, float32 sums), as set_float32_matmul_precision('high'); 0: full float32 (default). "
              "set_float32_matmul_precision overrides it")
FUSED_ATTENTION = env_var("FUSED_ATTENTION", 1, "where the device has the fused attention kernel "
                          "(tensor_attention.py): 1 (or 2, its older spelling) scaled_dot_product_attention uses it, "
                          "training too (the backward: FUSED_ATTENTION_BACKWARD); 0 never (the composite graph: "
                          "scores, softmax, weighted sum)")
FUSED_ATTENTION_BACKWARD = env_var("FUSED_ATTENTION_BACKWARD", 1, "1: the backward of a fused attention runs as the "
                                   "flash backward kernels (codegen/attention_grad.py); 0: as composite math from its "
                                   "logsumexp (tensor_attention.attention_backward)")
FUSED_ATTENTION_PACKED = env_var("FUSED_ATTENTION_PACKED", 1, "1: where q, k, v are views tiling one tensor (GPT-2's "
                                 "c_attn output), the flash backward kernels write that tensor's gradient whole "
                                 "(tensor_attention.packed_source); 0: q, k, v's gradients apart, concatenated after")


# ---------------------------------------------------------------- float32 matmul precision

FLOAT32_MATMUL_PRECISIONS = ("highest", "high")
# the choice of set_float32_matmul_precision (None: not called, the TF32 variable decides); a list so tests and the
# user change it in place
_float32_matmul_precision: list[str | None] = [None]


def set_float32_matmul_precision(precision: str) -> None:
  """How float32 matmuls and convolutions may compute, with PyTorch's names: "highest" (the default) keeps full
  float32; "high" allows TensorFloat-32 tensor cores (on CUDA sm_80+: inputs rounded to 10 mantissa bits, products
  summed in float32; about 1e-3 relative error, several times faster). Kernels compiled, searched (BEAM) or captured
  (TinyJit) under one precision are not reused under the other. Overrides the TF32 environment variable."""
  if precision not in FLOAT32_MATMUL_PRECISIONS:
    raise PrecisionError(f"float32 matmul precision {precision!r} is not one of {FLOAT32_MATMUL_PRECISIONS} "
                         f"('highest': full float32, 'high': TF32 tensor cores allowed)")
  _float32_matmul_precision[0] = precision


def get_float32_matmul_precision() -> str:
  """"highest" or "high": the precision float32 matmuls compile with now (set_float32_matmul_precision, else TF32)."""
  chosen = _float32_matmul_precision[0]
  if chosen is not None: return chosen
  return "high" if TF32 else "highest"


def tf32_allowed() -> bool:
  """Whether float32 matmuls may use TF32 tensor cores now: part of every cache key a kernel's code depends on."""
  chosen = _float32_matmul_precision[0]
  return chosen == "high" if chosen is not None else bool(TF32.value)   # (.value: one call less, read per realize)


def cache_dir() -> pathlib.Path:
  """The folder of ourgrad's on-disk caches (created on first use)."""
  folder = pathlib.Path(CACHE_DIR.value) if CACHE_DIR.value else pathlib.Path.home() / ".cache" / "ourgrad"
  folder.mkdir(parents=True, exist_ok=True)
  return folder


# ---------------------------------------------------------------- counters

class _GlobalCounters:
  """What ran since the last `reset()`: kernels launched, arithmetic ops, bytes read+written, device time."""
  __slots__ = ("kernel_count", "global_ops", "global_mem", "time_sum_s", "mem_used")

  def __init__(self) -> None:
    self.kernel_count, self.global_ops, self.global_mem, self.time_sum_s = 0, 0, 0, 0.0
    self.mem_used = 0  # bytes currently allocated on all devices (not reset)

  def reset(self) -> None:
    self.kernel_count, self.global_ops, self.global_mem, self.time_sum_s = 0, 0, 0, 0.0


# the one set of counters: attributes of an instance, not of a class, because every launch adds to them and a write
# to a class attribute invalidates the class's attribute cache (three counts cost ~140 ns instead of ~40)
GlobalCounters = _GlobalCounters()


# ---------------------------------------------------------------- bounded caches

_CACHE_CLEARERS: list[Callable[[], None]] = []


def register_cache_clearer(clear: Callable[[], None]) -> None:
  """Have `clear_caches()` call `clear` (a module's function emptying a cache it owns)."""
  _CACHE_CLEARERS.append(clear)


def clear_caches() -> None:
  """Empty every in-memory cache ourgrad keeps: compiled kernels, and freed buffers kept for reuse (given back to
  the device). Nothing computed is lost; the next use recompiles (from the disk cache) and reallocates."""
  for clear in _CACHE_CLEARERS: clear()


K = TypeVar("K")
V = TypeVar("V")


class BoundedCache(OrderedDict[K, V]):
  """A dict that keeps its `limit.value` most recently used entries (a limit below 0 keeps all), read afresh
  at each insert so that tests and users can change it at run time. Registered with `clear_caches()`."""

  def __init__(self, limit: EnvVar):
    super().__init__()
    self.limit = limit
    # counts the times entries were dropped (cleared, evicted, deleted): a value taken from this cache and kept
    # elsewhere (the schedule cache keeps its kernels' runners) is still the cache's while the count is unchanged
    self.generation = 0
    register_cache_clearer(self.clear)

  def clear(self) -> None:
    self.generation += 1
    super().clear()

  def __delitem__(self, key: K) -> None:
    self.generation += 1
    super().__delitem__(key)

  def popitem(self, last: bool = True) -> tuple[K, V]:
    self.generation += 1
    return super().popitem(last)

  def pop(self, key: K, *default: Any) -> Any:
    self.generation += 1
    return super().pop(key, *default)

  def __getitem__(self, key: K) -> V:
    value = super().__getitem__(key)
    self.move_to_end(key)
    return value

  def __setitem__(self, key: K, value: V) -> None:
    super().__setitem__(key, value)
    self.move_to_end(key)
    limit = int(self.limit.value)
    while 0 <= limit < len(self): self.popitem(last=False)


# ---------------------------------------------------------------- small helpers

def prod(values: Iterable[int]) -> int:
  """Product of integers (1 for an empty sequence)."""
  return functools.reduce(operator.mul, values, 1)


def power_of_two_divisor(size: int, limit: int) -> int:
  """The largest power of two dividing `size` that is at most `limit` (1 if none)."""
  amount = 1
  while amount * 2 <= limit and size % (amount * 2) == 0: amount *= 2
  return amount


def inverse_permutation(order: Sequence[int]) -> tuple[int, ...]:
  """The order that undoes permuting by `order` (axis i goes back to where order put it)."""
  return tuple(sorted(range(len(order)), key=order.__getitem__))


def make_tuple(value: int | Sequence[int], count: int) -> tuple[int, ...]:
  """`3` -> (3, 3) for count 2; sequences are returned as tuples unchanged."""
  return (value,) * count if isinstance(value, int) else tuple(value)


def normalize_axis(axis: int, ndim: int) -> int:
  """A possibly negative axis as a non-negative one; raises AxisError naming the valid range."""
  if 0 <= axis < ndim: return axis   # the common case, without building the range
  lo, hi = (-ndim, ndim - 1) if ndim > 0 else (-1, 0)
  if not lo <= axis <= hi:
    raise AxisError(f"axis {axis} is out of range for a tensor with {ndim} dimensions (expected {lo}..{hi})")
  return axis + ndim if axis < 0 else axis




def fmt_size(num_bytes: float) -> str:
  return f"{num_bytes/1e9:.2f} GB" if num_bytes >= 1e9 else f"{num_bytes/1e6:.2f} MB"


GC_FREEZE_IMPORT = env_var("GC_FREEZE_IMPORT", 1, "1: `import ourgrad` ends with gc.freeze(): the objects alive "
                           "then (the modules, functions and classes of ourgrad and what it imports) leave the cyclic "
                           "collector's generations, so its full passes no longer scan them (docs/jit.md, the schedule "
                           "cache); 0: the collector is left as it is")
GC_THRESHOLD = env_var("GC_THRESHOLD", 10000, "the cyclic collector's first-generation threshold that `import "
                       "ourgrad` sets (gc.set_threshold; raised only, never lowered): an eager step keeps thousands of "
                       "tracked objects alive that die by reference count, and Python's threshold (700) has the "
                       "collector scan them several times a step, finding no garbage (docs/jit.md; ourgrad's steps "
                       "make no reference cycles, test_eager_cycles); 0: the thresholds are left as they are")
NO_COLOR = env_var("NO_COLOR", "", "set (to anything): no ANSI colours in DEBUG output (https://no-color.org); "
                   "colours are also off when stdout is not a terminal")


def use_colors() -> bool:
  """Whether printed output may carry ANSI colours: stdout is a terminal and NO_COLOR is not set."""
  if NO_COLOR.raw(): return False
  isatty = getattr(sys.stdout, "isatty", None)
  return bool(isatty and isatty())


def colored(text: str, color: str | None) -> str:
  """`text` in an ANSI colour (red, green, yellow, blue, magenta, cyan, white), or plain where colours are off."""
  codes = {"red": 31, "green": 32, "yellow": 33, "blue": 34, "magenta": 35, "cyan": 36, "white": 37}
  return f"\x1b[{codes[color]}m{text}\x1b[0m" if color and use_colors() else text


# ---------------------------------------------------------------- for scripts written for tinygrad

def getenv(name: str, default: Any = 0) -> Any:
  """tinygrad's getenv for user scripts: the variable converted to the type of `default` (ourgrad's own settings
  are declared with env_var above)."""
  raw = os.environ.get(name)
  return default if raw is None else type(default)(raw)


class tqdm:  # noqa: N801 (the name scripts import)
  """A minimal progress bar with tqdm's interface (iterate, `set_description`, `update`), for scripts that import
  `trange`/`tqdm` from tinygrad's helpers; on a terminal it redraws one line on stderr, else it writes the last
  line once, when the loop ends."""

  def __init__(self, iterable: Iterable[T] | None = None, desc: str = "", total: int | None = None, **_: Any):
    self.iterable, self.desc, self.count = iterable, desc, 0
    self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)  # type: ignore
    self.start = time.perf_counter()

  def __iter__(self) -> Iterable[T]:
    for item in self.iterable or ():
      yield item
      self.update(1)
    self.close()

  def set_description(self, desc: str, refresh: bool = True) -> None:
    self.desc = desc
    self._draw()

  def update(self, count: int = 1) -> None:
    self.count += count
    self._draw()

  def close(self) -> None:
    if not sys.stderr.isatty(): self._draw(force=True)
    sys.stderr.write("\n")

  def _draw(self, force: bool = False) -> None:
    if not (force or sys.stderr.isatty()): return
    elapsed = time.perf_counter() - self.start
    total = f"/{self.total}" if self.total else ""
    sys.stderr.write(f"\r{self.desc} {self.count}{total} [{elapsed:.1f}s, {self.count / max(elapsed, 1e-9):.2f} it/s]")
    sys.stderr.flush()


def trange(count: int, **kwargs: Any) -> tqdm:
  """`tqdm(range(count))`."""
  return tqdm(range(count), **kwargs)

