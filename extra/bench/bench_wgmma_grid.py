"""The WGMMA matmul's grid choices on every GPT-2 Linear matmul shape: each variant timed alone beside cuBLAS.

Rows: for each Linear of GPT-2 small (qkv 768->2304, proj 768->768, fc 768->3072, fc-proj 3072->768, the tied lm-head
768->50304) over 8 x 512 = 4096 tokens, its forward (M = tokens, N = out, K = in), input gradient (M = tokens, N =
in, K = out) and weight gradient (M = out, N = in, K = tokens), in TF32 (float32 operands) and bfloat16. Every
operand in the layout the WGMMA kernel reads after operand staging (A M x K and B N x K, both K contiguous: TF32
cannot transpose), and cuBLAS (torch.matmul, a @ b.T) on the same layout.

Variants of each row (codegen/wgmma_tiles.WgmmaMatmul, launched directly): `before` (the rule WgmmaStrategy had
before the grid model: 128x256 where its blocks fill the multiprocessors, else 128x128, warp-specialized), `model`
(codegen/opt/matmul_grid.fastest_wgmma_grid: block tile, stages, CTAs per multiprocessor, persistent grid, split-K
parts) and the model's next `--top` ranked grids. A split-K variant is the batched kernel over the parts (float32
partials) plus the parts' sum (timed as torch's sum over them: in a step the consumer adds them). Each time is the
median of 3 batches of `--iters` back-to-back launches between two CUDA events on the device's stream. The
`pred` column is the model's time; `err` the relative error against cuBLAS.

Run on an H100/H200: `python extra/bench/bench_wgmma_grid.py` (`--only lm-head,tf32` keeps the rows whose name
contains every word; given again, `--only` adds rows; `--square` adds 4096^3 in bfloat16 and float16; `--top N` the
ranked variants; `--kinds model,256rows` only those variants; `--layouts "fc dW,square"` (or all) the best unsplit
grid of those rows with each operand K-major or MN-major (16-bit); `--dry` prints the variants and predictions
without a GPU).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

try:   # before ourgrad opens the GPU (see wgmma_proto.py)
  import torch
except ImportError:
  torch = None

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ourgrad.codegen.opt.matmul_grid import (WGMMA_BLOCK_MS, WGMMA_TALL_BLOCK_MS, WgmmaGrid, wgmma_grids,  # noqa: E402
                                              wgmma_seconds, wgmma_split_parts)
from ourgrad.codegen.wgmma_tiles import WgmmaMatmul, render_wgmma_matmul  # noqa: E402

TOKENS, WIDTH, VOCAB = 8 * 512, 768, 50304
LINEARS = [("qkv", WIDTH, 3 * WIDTH), ("proj", WIDTH, WIDTH), ("fc", WIDTH, 4 * WIDTH), ("fc-proj", 4 * WIDTH, WIDTH),
           ("lm-head", WIDTH, VOCAB)]
DTYPES = {"tf32": "float32", "bf16": "bfloat16"}
TALL_WITHIN = 1.25   # the tall grids timed: those predicted within this factor of the model's choice
SQUARE = 4096   # --square: SQUARE^3 in each of SQUARE_DTYPES
SQUARE_DTYPES = {"bf16": "bfloat16", "f16": "float16"}
SHARED_BYTES = 227 * 1024   # CUDARenderer.dynamic_local_memory_bytes (sm_90)


def rows() -> list[tuple[str, int, int, int]]:
  """(name, M, N, K) of every Linear matmul."""
  found = []
  for name, fan_in, fan_out in LINEARS:
    found += [(f"{name} fwd", TOKENS, fan_out, fan_in), (f"{name} dx", TOKENS, fan_in, fan_out),
              (f"{name} dW", fan_out, fan_in, TOKENS)]
  return found


def before_grid(m: int, n: int, processors: int) -> WgmmaGrid:
  """WgmmaStrategy's rule before the grid model: 128x256 in 4 stages where N allows and its blocks fill the
  multiprocessors, else 128x128 in 6 (both warp-specialized)."""
  if n % 256 == 0 and m * n // (128 * 256) >= processors: return WgmmaGrid(128, 256, 4)
  return WgmmaGrid(128, 128, 6)


# label, grid, copy lag (0: the default; -1: the copies arrive on their barrier, WgmmaMatmul.async_arrive), operand
# layout (LAYOUTS), paired 16-bit stores (WgmmaMatmul.paired_stores)
Variant = tuple[str, WgmmaGrid, int, str, bool]
# the operands' layouts: A K-major ("k": M x K) or MN-major ("m": K x M), B K-major ("k": N x K) or not ("n": K x N)
LAYOUTS = ("kk", "mk", "kn", "mn")


def variants(m: int, n: int, k: int, itemsize: int, processors: int, top: int, kinds: tuple[str, ...] = (),
             layouts: bool = False) -> list[Variant]:
  """(label, grid, copy lag, layout): before, the model's choice (with the default copy lag, 1, and with stages - 2),
  its best grid of 128 or 64 rows (short), every 128-row grid of N tile 128 or more (persistent or not) unsplit, the
  best 64-row grid, the best 192- and 256-row grid of each N tile and split predicted within TALL_WITHIN of the
  model's, the model's best split into 2 and into 4 parts, then its next `top` ranked grids (no repeats): the
  spread the model's constants are fitted on; all K-major. With `layouts` (16-bit operands), the best unsplit grid
  again with A, B and both MN-major. `kinds`: keep only the labels starting with one of these."""
  def seconds(grid: WgmmaGrid) -> float: return wgmma_seconds(grid, 1, m, n, k, itemsize, processors)
  def rank(block_ms: tuple[int, ...]) -> list[WgmmaGrid]:
    return sorted(wgmma_grids(1, m, n, k, itemsize, SHARED_BYTES, split=True, block_ms=block_ms), key=seconds)
  ranked, tall = rank(WGMMA_BLOCK_MS), rank(WGMMA_TALL_BLOCK_MS)
  # the model's choice: its fastest grid of the parts the lazy layer splits K into (wgmma_split_parts)
  parts = wgmma_split_parts(1, m, n, k, itemsize, processors, SHARED_BYTES)
  ranked.sort(key=lambda grid: grid.parts != parts)   # (stable: by predicted time within each)
  short = tuple(rows_ for rows_ in WGMMA_BLOCK_MS if rows_ not in WGMMA_TALL_BLOCK_MS)
  best_short = rank(short)[0]   # the model's choice among 128- and 64-row tiles (before it ranked the tall ones)
  chosen = [("before", before_grid(m, n, processors)), ("model", ranked[0]), ("short", best_short)]
  chosen += [("tile", grid) for grid in ranked if grid.parts == 1 and grid.block_m == 128 and grid.block_n >= 128]
  chosen += [("64rows", grid) for grid in ranked if grid.parts == 1 and grid.block_m == 64][:1]
  # the tall tiles (3 and 4 consumer warpgroups): the best of each shape and split whose predicted time is within
  # TALL_WITHIN of the model's choice
  best_tall: dict[tuple[int, int, int], WgmmaGrid] = {}
  for grid in (grid for grid in tall if seconds(grid) <= TALL_WITHIN * seconds(ranked[0])):
    best_tall.setdefault((grid.block_m, grid.block_n, grid.parts), grid)
  chosen += [(f"{grid.block_m}rows", grid) for grid in best_tall.values()]
  for parts in (2, 4): chosen += [(f"split{parts}", grid) for grid in ranked if grid.parts == parts][:1]
  chosen += [(f"rank{number}", grid) for number, grid in enumerate(ranked[1:top + 1], 1)]
  # the producer's lead: 1 (the default) and stages - 2 on the model's grid
  unique, seen = [("before", chosen[0][1], 1, "kk", True), ("model", ranked[0], 0, "kk", True),
                  ("lag", ranked[0], max(1, ranked[0].stages - 2), "kk", True)], set()
  for label, grid in chosen[1:]:
    if grid in seen: continue
    seen.add(grid)
    if label != "model": unique.append((label, grid, 0, "kk", True))
  # the model's grid with one 4-byte store per accumulator pair (its output 16-bit: unsplit; the kernel's default
  # pairs them, WgmmaMatmul.paired_stores), and with the copies arriving on their stage's barrier
  if itemsize == 2 and ranked[0].parts == 1: unique.append(("single", ranked[0], 0, "kk", False))
  unique.append(("arrive", ranked[0], -1, "kk", True))
  if layouts and itemsize == 2:
    whole = next(grid for grid in ranked if grid.parts == 1)
    unique += [(f"{layout}", whole, 0, layout, True) for layout in LAYOUTS]
  return [variant for variant in unique if not kinds or variant[0].startswith(kinds)]


def plan_of(grid: WgmmaGrid, m: int, n: int, k: int, dtype: str, processors: int, lag: int = 0,
            layout: str = "kk", paired: bool = True) -> WgmmaMatmul:
  """The kernel of `grid`: operands in `layout` (LAYOUTS; MN-major ones only unsplit); split-K as a batch over the
  parts (each reading its K slice of the rows) into float32 partials."""
  part_k = k // grid.parts
  out_dtype = "float32" if grid.parts > 1 or dtype == "float32" else dtype
  a_k_major, b_k_major = layout[0] == "k", layout[1] == "k"
  return WgmmaMatmul(m, n, part_k, dtype=dtype, out_dtype=out_dtype, block_m=grid.block_m, block_n=grid.block_n,
                     stages=grid.stages, specialized=True, a_k_major=a_k_major, b_k_major=b_k_major,
                     a_row_stride=k if a_k_major else m, b_row_stride=k if b_k_major else n, batch=grid.parts,
                     a_batch=part_k, b_batch=part_k, c_batch=m * n, ctas_per_sm=grid.ctas_per_sm,
                     persistent_ctas=processors * grid.ctas_per_sm if grid.persistent else 0,
                     copy_lag=max(lag, 0), async_arrive=lag < 0, paired_stores=paired)


def describe(grid: WgmmaGrid, lag: int = 0, layout: str = "kk", paired: bool = True) -> str:
  return (f"{grid.block_m}x{grid.block_n} s{grid.stages}" + (f" c{grid.ctas_per_sm}" if grid.ctas_per_sm > 1 else "")
          + (" persistent" if grid.persistent else "") + (f" split{grid.parts}" if grid.parts > 1 else "")
          + (f" lag{lag}" if lag > 0 else " arrive" if lag < 0 else "") + (f" {layout}" if layout != "kk" else "")
          + ("" if paired else " single"))


def event_seconds(launch, iters: int) -> float:
  """Median over 3 batches of `iters` back-to-back launches, per launch (CUDA events on ourgrad's stream)."""
  from timing import _event_seconds
  launch()
  return statistics.median(_event_seconds("CUDA", lambda: [launch() for _ in range(iters)]) / iters
                           for _ in range(3))


def torch_event_seconds(function, iters: int) -> float:
  function()
  times = []
  for _ in range(3):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters): function()
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3 / iters)
  return statistics.median(times)


def run_row(name: str, m: int, n: int, k: int, precision: str, processors: int, top: int, iters: int,
            dry: bool, kinds: tuple[str, ...] = (), layouts: bool = False) -> None:
  dtype = {**DTYPES, **SQUARE_DTYPES}[precision]
  itemsize = 4 if dtype == "float32" else 2
  work = 2.0 * m * n * k
  chosen = variants(m, n, k, itemsize, processors, top, kinds, layouts)
  title = f"{name} {precision} {m}x{n}x{k}"
  if dry:
    for label, grid, lag, layout, paired in chosen:
      predicted = wgmma_seconds(grid, 1, m, n, k, itemsize, processors)
      print(f"{title:<36} {label:<7} {describe(grid, lag, layout, paired):<34} pred {predicted * 1e6:8.1f} us")
    return
  from ourgrad.device import Buffer, Device
  from ourgrad.dtype import dtypes
  device = Device["CUDA"]
  plans = [plan_of(grid, m, n, k, dtype, processors, lag, layout, paired) for _, grid, lag, layout, paired in chosen]
  binaries = [device.compiler.compile_cached(render_wgmma_matmul(plan)) for plan in plans]   # compiled in main()
  torch_dtype = getattr(torch, dtype)
  generator = torch.Generator(device="cuda").manual_seed(0)
  a = torch.randn(m, k, device="cuda", generator=generator).to(torch_dtype)
  b = torch.randn(n, k, device="cuda", generator=generator).to(torch_dtype)
  torch.backends.cuda.matmul.allow_tf32 = True
  reference = a @ b.T
  cublas = torch_event_seconds(lambda: a @ b.T, iters)
  ours_dtype = getattr(dtypes, dtype)
  def device_buffer(tensor) -> Buffer:
    host = tensor.contiguous().view(-1).view(torch.uint8).cpu().numpy()
    return Buffer("CUDA", tensor.numel(), ours_dtype).copyin(memoryview(host))
  # per layout letter: the operand as stored (K-major as drawn, MN-major transposed)
  operands = {"a": {"k": device_buffer(a)}, "b": {"k": device_buffer(b)}}
  if any(layout != "kk" for *_, layout, _ in chosen):
    operands["a"]["m"], operands["b"]["n"] = device_buffer(a.T), device_buffer(b.T)
  print(f"{title:<36} cuBLAS{'':<29} {cublas * 1e3:9.3f} ms {work / cublas / 1e12:6.1f} TFLOP/s", flush=True)
  for (label, grid, lag, layout, paired), plan, binary in zip(chosen, plans, binaries):
    a_buffer, b_buffer = operands["a"][layout[0]], operands["b"][layout[1]]
    program = device.program(plan.name, binary)
    out_dtype = getattr(dtypes, plan.out_dtype)
    c_buffer = Buffer("CUDA", plan.batch * m * n, out_dtype).allocate()
    def launch(program=program, c_buffer=c_buffer, plan=plan, a_buffer=a_buffer, b_buffer=b_buffer):
      program(c_buffer.handle, a_buffer.handle, b_buffer.handle, global_size=plan.global_size,
              local_size=plan.local_size)
    seconds = event_seconds(launch, iters)
    result = np.frombuffer(c_buffer.as_bytes(), dtype=np.float32 if out_dtype == dtypes.float32 else np.uint16)
    if out_dtype == dtypes.bfloat16: result = (result.astype(np.uint32) << 16).view(np.float32)
    elif out_dtype == dtypes.float16: result = result.view(np.float16).astype(np.float32)
    result = torch.tensor(result.reshape(plan.batch, m, n)).cuda().sum(0)
    if grid.parts > 1:   # the consumer's read of the partials
      partials = torch.zeros(grid.parts, m, n, device="cuda")
      seconds += torch_event_seconds(lambda: partials.sum(0), iters)
    expected = reference.float()
    error = float((result - expected).norm() / expected.norm())
    predicted = wgmma_seconds(grid, 1, m, n, k, itemsize, processors)
    print(f"{title:<36} {label:<7} {describe(grid, lag, layout, paired):<34} {seconds * 1e3:9.3f} ms "
          f"{work / seconds / 1e12:6.1f} TFLOP/s {cublas / seconds * 100:5.0f}% cuBLAS  "
          f"pred {predicted * 1e3:8.3f} ms  err {error:.1e}",
          flush=True)


def compile_all(jobs: list[tuple[str, int, int, int, str]], processors: int, top: int, kinds: tuple[str, ...] = (),
                layouts: str = "") -> None:
  """Every variant's kernel compiled into the disk cache first, 16 at a time (NVRTC releases the GIL)."""
  from ourgrad.device import Device
  compiler = Device["CUDA"].compiler
  def with_layouts(name: str) -> bool:
    return layouts == "all" or any(word and word in name for word in layouts.split(","))
  sources = [render_wgmma_matmul(plan_of(grid, m, n, k, {**DTYPES, **SQUARE_DTYPES}[precision], processors, lag,
                                         layout, paired))
             for name, m, n, k, precision in jobs
             for _, grid, lag, layout, paired in variants(m, n, k, 4 if precision == "tf32" else 2, processors, top,
                                                          kinds, with_layouts(name))]
  def compile_one(source: str) -> str:
    try: compiler.compile_cached(source)
    except Exception as error:   # the row that needs it says so again when it loads
      return f"{type(error).__name__}: {str(error)[-300:]}"
    return ""
  with ThreadPoolExecutor(16) as pool: failures = [failure for failure in pool.map(compile_one, sources) if failure]
  print(f"{len(sources)} kernels compiled, {len(failures)} failed{': ' + failures[0] if failures else ''}", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--top", type=int, default=0, help="the model's ranked grids timed beside its choice")
  parser.add_argument("--only", action="append", default=[], help="rows whose name contains every one of these "
                      "words (comma-separated); several --only: the rows of any")
  parser.add_argument("--square", action="store_true", help=f"also {SQUARE}^3 in bfloat16 and float16")
  parser.add_argument("--kinds", default="", help="only the variants whose label starts with one of these "
                      "(comma-separated: before, model, short, lag, tile, 64rows, 192rows, 256rows, split, rank, "
                      "single, arrive, kk, mk, kn, mn)")
  parser.add_argument("--layouts", default="", help="16-bit rows whose name contains one of these (comma-separated; "
                      "'all': every row): the best unsplit grid also with A, B and both operands MN-major (mk, kn, mn)")
  parser.add_argument("--dry", action="store_true", help="print the variants and predictions only (no GPU)")
  parser.add_argument("--processors", type=int, default=0, help="multiprocessors (default: the GPU's; --dry 132)")
  args = parser.parse_args()
  processors = args.processors
  if not args.dry:
    from ourgrad.device import Device
    processors = processors or Device["CUDA"].renderer.multiprocessors
    print(f"device: {torch.cuda.get_device_name()}, {processors} multiprocessors")
  processors = processors or 132
  jobs = [(name, m, n, k, precision) for precision in DTYPES for name, m, n, k in rows()
          if not args.only or any(all(word in f"{name} {precision}" for word in only.split(",")) for only in args.only)]
  if args.square: jobs = [("square", SQUARE, SQUARE, SQUARE, precision) for precision in SQUARE_DTYPES] + jobs
  kinds = tuple(kind for kind in args.kinds.split(",") if kind)
  if not args.dry: compile_all(jobs, processors, args.top, kinds, args.layouts)
  for name, m, n, k, precision in jobs:
    layouts = args.layouts == "all" or any(word and word in name for word in args.layouts.split(","))
    try: run_row(name, m, n, k, precision, processors, args.top, args.iters, args.dry, kinds, layouts)
    except Exception as error:   # a row that fails is a line saying so
      print(f"{name} {precision}: failed: {type(error).__name__}: {str(error)[:300]}", flush=True)


if __name__ == "__main__":
  main()
