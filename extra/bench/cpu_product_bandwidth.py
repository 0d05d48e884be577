"""How close SmolLM2's CPU decode products come to the machine's read bandwidth, measured in one process.

A decode step's quantized products stream every weight from memory once a token (~96 MB for the Q4_1 file: more
than the 32 MB L3), so their floor is the bytes over the read bandwidth of the threads that run them. This script
captures the jitted decode step (stored weights, 520 slots), keeps its product launches (the kernels whose largest
input is a packed uint8 weight of at least `--min-bytes`), and replays only those, in the step's order with their
own arguments, alternately with a plain read of the same weight buffers in the same order (an AVX2 / SSE sum over
each buffer, its lines split over the threads as the products' rows are: `#pragma omp parallel for`). Optional
variant B of the products' C (`--replace PATTERN REPLACEMENT`, as cpu_decode_ab.py) joins the alternation. It
prints each one's median wall time, GB/s of weight bytes, and the products' share of the read's bandwidth
(median of per-round ratios), and whether B's outputs equal A's bit for bit.

    OMP_NUM_THREADS=2 PYTHONPATH=. python extra/bench/cpu_product_bandwidth.py --rounds 20

`--random` needs no GGUF file: SmolLM2's product shapes (per layer Q4_1 960x576, 576x576, 3072x576, 576x1536; a Q8_0
49152x576 head) with random blocks, each product of a random x captured by a TinyJit (a machine without the file).
"""
from __future__ import annotations

import argparse
import ctypes
import pathlib
import re
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
from ourgrad import Device  # noqa: E402  (first: the CLANG device sets libgomp's wait policy before torch loads)

from ourgrad import Tensor  # noqa: E402
from ourgrad.engine.jit import TinyJit  # noqa: E402
from ourgrad.nn.gguf import GGML_Q4_1, GGML_Q8_0, PackedTensor  # noqa: E402

from extra.models.generate import smollm2_path  # noqa: E402
from extra.models.llama import Llama  # noqa: E402

# SmolLM2-135M's products: (output rows, input columns, type) per layer, and the tied Q8_0 head
LAYER_PRODUCTS = ((960, 576, GGML_Q4_1), (576, 576, GGML_Q4_1), (3072, 576, GGML_Q4_1), (576, 1536, GGML_Q4_1))
HEAD_PRODUCT = (49152, 576, GGML_Q8_0)
BLOCK_BYTES = {GGML_Q4_1: 20, GGML_Q8_0: 34}

# one pass over `bytes` bytes, 64-byte lines split over the threads like a product's rows; the sums land in `out`
READ_SOURCE = """
#include <immintrin.h>
#include <omp.h>
void og_read_bytes(const unsigned char* restrict data, long bytes, long long* restrict out) {
  long lines = bytes / 64;
  long long total = 0;
  #pragma omp parallel reduction(+:total)
  {
    long share = (lines + omp_get_num_threads() - 1) / omp_get_num_threads();
    long first = share * omp_get_thread_num(), end = first + share < lines ? first + share : lines;
#if defined(__AVX2__)
    __m256i sums = _mm256_setzero_si256();
    for (long line = first; line < end; line++) {
      __m256i a = _mm256_loadu_si256((const __m256i*)(data + line * 64));
      __m256i b = _mm256_loadu_si256((const __m256i*)(data + line * 64 + 32));
      sums = _mm256_add_epi64(sums, _mm256_xor_si256(a, b));
    }
    total += _mm256_extract_epi64(sums, 0) + _mm256_extract_epi64(sums, 1) + _mm256_extract_epi64(sums, 2) +
             _mm256_extract_epi64(sums, 3);
#else
    for (long line = first; line < end; line++)
      for (int i = 0; i < 64; i += 8) total += *(const long long*)(data + line * 64 + i);
#endif
  }
  out[0] += total;
}
"""


def product_calls(replay: Any, min_bytes: int) -> list[tuple[int, Any, list[Any], Any]]:
  """(index in the replay, function, arguments, weight buffer) of each product launch: a host kernel calling the
  byte dot helpers (renderer/cbytedot.py); its weight is its smallest uint8 input of at least `min_bytes` (layer 0's
  products also take the 30 MB embedding, which they gather one row of)."""
  calls = []
  for index, (item, call) in enumerate(zip(replay.items, replay.host_calls)):
    if call is None or "og_dot_add" not in item.runner.source: continue
    weights = [buffer for buffer in item.bufs[1:] if buffer.dtype.itemsize == 1 and buffer.nbytes >= min_bytes]
    if weights: calls.append((index, call[0], call[1], min(weights, key=lambda buffer: buffer.nbytes)))
  return calls


def random_packed(rows: int, columns: int, ggml_type: int, rng: np.random.Generator) -> PackedTensor:
  """A (rows, columns) matrix of random blocks of `ggml_type`, their f16 scales small and finite."""
  count = rows * columns // 32
  raw = rng.integers(0, 256, (count, BLOCK_BYTES[ggml_type]), dtype=np.uint8)
  for offset in ((0, 2) if ggml_type == GGML_Q4_1 else (0,)):
    raw[:, offset:offset + 2] = rng.uniform(0.001, 0.05, count).astype("<f2").view(np.uint8).reshape(count, 2)
  return PackedTensor.from_blocks(ggml_type, Tensor(raw), (rows, columns))


def random_replay(layers: int) -> Any:
  """The captured replay of SmolLM2's products on random blocks and random activations (--random)."""
  rng = np.random.default_rng(0)
  matrices = [random_packed(*shape, rng) for _ in range(layers) for shape in LAYER_PRODUCTS]
  matrices.append(random_packed(*HEAD_PRODUCT, rng))
  inputs = {columns: Tensor(rng.standard_normal((1, columns)).astype(np.float32)).realize()
            for _, columns, _ in LAYER_PRODUCTS}

  @TinyJit
  def products() -> list[Tensor]:
    outputs = [matrix.integer_linear(inputs[matrix.shape[1]]) for matrix in matrices]
    Tensor.realize(*outputs)
    return outputs
  for _ in range(3): products()
  return products.captured.replay_runner


def compile_function(name: str, source: str) -> Any:
  device = Device["CLANG"]
  return device.program(name, device.compiler.compile_cached(source)).function


Launch = tuple[Callable[..., Any], list[Any], str]   # a function, its arguments, the kernel's name


def hot_launches(replay: Any, calls: list[tuple[int, Any, list[Any], Any]]) -> list[Launch]:
  """The product launches with each one's weight argument replaced by the first launch of the same kernel's."""
  first_weight: dict[str, Any] = {}
  launches = []
  for index, function, arguments, weight in calls:
    name = replay.items[index].runner.name
    position = [buffer.host_pointer().value for buffer in replay.items[index].bufs].index(weight.host_pointer().value)
    hot_arguments = list(arguments)
    hot_arguments[position] = first_weight.setdefault(name, arguments[position])
    launches.append((function, hot_arguments, name))
  return launches


def edited_launches(replay: Any, calls: list[tuple[int, Any, list[Any], Any]],
                    replacements: list[tuple[str, str]]) -> tuple[list[Launch], int]:
  """The product launches with each kernel's C source edited by `replacements` and compiled, and how many kernels
  changed."""
  edited: dict[str, Any] = {}
  launches = []
  for index, function, arguments, _ in calls:
    runner = replay.items[index].runner
    source = runner.source
    for pattern, replacement in replacements: source = re.sub(pattern, replacement, source)
    if source != runner.source: function = edited.setdefault(source, compile_function(runner.name, source))
    launches.append((function, arguments, runner.name))
  return launches, len(edited)


def same_outputs(replay: Any, calls: list[tuple[int, Any, list[Any], Any]], first: list[Launch],
                 second: list[Launch]) -> bool:
  """Whether two variants' launches write the same bytes. The step's planned buffers alias (a product's output may
  be a later product's input), so each run starts from the same bytes in every buffer the products touch."""
  touched = {buffer.host_pointer().value: buffer for index, _, _, _ in calls for buffer in replay.items[index].bufs}
  saved = {pointer: buffer.numpy().tobytes() for pointer, buffer in touched.items()}
  outputs = []
  for launches in (first, second):
    for pointer, data in saved.items(): ctypes.memmove(pointer, data, len(data))
    run(launches, None)
    outputs.append([replay.items[index].bufs[0].numpy().tobytes() for index, _, _, _ in calls])   # NaNs too
  return outputs[0] == outputs[1]


def run(launches: list[Launch], per_kernel: dict[str, float] | None) -> float:
  """Seconds of wall time to run `launches` in order; with `per_kernel`, each kernel's seconds are added to it."""
  clock = time.perf_counter
  started = clock()
  if per_kernel is None:
    for function, arguments, _ in launches: function(*arguments)
  else:
    for function, arguments, name in launches:
      before = clock()
      function(*arguments)
      per_kernel[name] = per_kernel.get(name, 0.0) + clock() - before
  return clock() - started


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=20)
  parser.add_argument("--min-bytes", type=int, default=64 * 1024, help="the smallest weight counted as a product's")
  parser.add_argument("--random", action="store_true", help="random blocks of SmolLM2's product shapes (no GGUF)")
  parser.add_argument("--layers", type=int, default=30, help="--random: layers of products")
  parser.add_argument("--hot", action="store_true",
                      help="also replay the products with every layer's launch reading layer 0's weights (in cache): "
                           "their compute-bound time")
  parser.add_argument("--per-kernel", action="store_true",
                      help="each product kernel's median time against the read of its own weights")
  parser.add_argument("--replace", nargs=2, action="append", default=[], metavar=("PATTERN", "REPLACEMENT"),
                      help="variant B: a regex replacement applied to every product kernel's C source")
  args = parser.parse_args()

  if args.random: replay = random_replay(args.layers)
  else:
    model, _ = Llama.from_gguf(smollm2_path(), 520, "CLANG", symbolic=False, dtype="stored")
    for position in range(9, 13): model.decode([5], [position]).numpy()
    replay = model._decode_jit.captured.replay_runner
  calls = product_calls(replay, args.min_bytes)
  weight_bytes = sum(weight.nbytes for _, _, _, weight in calls)
  print(f"{len(calls)} product launches of {len(replay.items)}, {weight_bytes / 1e6:.1f} MB of weights a step")

  read = compile_function("og_read_bytes", READ_SOURCE)
  sink = np.zeros(1, np.int64)
  sink_pointer = ctypes.c_void_p(sink.ctypes.data)
  variants: dict[str, list[Launch]] = {"A": [(function, arguments, replay.items[index].runner.name)
                                             for index, function, arguments, _ in calls]}
  if args.hot: variants["hot"] = hot_launches(replay, calls)
  variants["read"] = [(read, [weight.host_pointer(), ctypes.c_long(weight.nbytes), sink_pointer],
                       replay.items[index].runner.name) for index, _, _, weight in calls]
  if args.replace:
    variants["B"], changed = edited_launches(replay, calls, args.replace)
    print(f"variant B: {changed} kernels edited")
    print(f"B's outputs equal A's bit for bit: {same_outputs(replay, calls, variants['A'], variants['B'])}")

  times: dict[str, list[float]] = {name: [] for name in variants}
  kernel_times: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
  names = list(variants)
  for round_number in range(args.rounds):
    for name in (names if round_number % 2 == 0 else names[::-1]):
      per_kernel: dict[str, float] | None = {} if args.per_kernel else None
      times[name].append(run(variants[name], per_kernel))
      if per_kernel is not None: kernel_times[name].append(per_kernel)
  for name in names:
    median = statistics.median(times[name])
    print(f"{name:5s} median {median * 1e3:7.2f} ms, min {min(times[name]) * 1e3:7.2f} ms, "
          f"{weight_bytes / median / 1e9:6.2f} GB/s of weights")
  for name in names:
    if name in ("read", "hot"): continue
    ratios = [r / p for p, r in zip(times[name], times["read"])]
    print(f"{name}: share of the read's bandwidth per round: median {statistics.median(ratios):.3f}")
  if "B" in variants:
    print(f"B / A per round: median {statistics.median(b / a for a, b in zip(times['A'], times['B'])):.3f}")
  if args.per_kernel: print_kernel_table(calls, replay, kernel_times)


def print_kernel_table(calls: list[tuple[int, Any, list[Any], Any]], replay: Any,
                       kernel_times: dict[str, list[dict[str, float]]]) -> None:
  """Each product kernel's launches, weight bytes, median milliseconds a step of the products and of the read of
  the same weights, and the products' share of that read (median of per-round ratios)."""
  weights: dict[str, int] = {}
  launches: dict[str, int] = {}
  for index, _, _, weight in calls:
    name = replay.items[index].runner.name
    weights[name] = weights.get(name, 0) + weight.nbytes
    launches[name] = launches.get(name, 0) + 1
  print(f"{'kernel':24s} {'launches':>8s} {'MB':>7s} {'A ms':>8s} {'read ms':>8s} {'share':>6s}")
  for name in sorted(weights, key=lambda kernel: -weights[kernel]):
    products = [round_times[name] for round_times in kernel_times["A"]]
    reads = [round_times[name] for round_times in kernel_times["read"]]
    share = statistics.median(r / p for p, r in zip(products, reads))
    print(f"{name:24s} {launches[name]:8d} {weights[name] / 1e6:7.1f} {statistics.median(products) * 1e3:8.3f} "
          f"{statistics.median(reads) * 1e3:8.3f} {share:6.3f}")


if __name__ == "__main__":
  main()
