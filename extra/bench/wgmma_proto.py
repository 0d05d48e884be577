"""The Hopper wgmma matmul kernel of ourgrad/codegen/wgmma_tiles.py, launched alone through ourgrad's CUDA runtime:
does the shared-memory layout its descriptors name give correct results, and how fast is it?

Part 1 (correctness, 512 x 512 x 512 and 384 x 256 x 1024): every layout variant (B row-major K x N with the
canonical LBO/SBO and with them exchanged, B given as N x K), float16 and bfloat16, against numpy in float64 from
the same rounded inputs. Part 2 (speed, 4096^3): tile and stage choices of the variants that were correct, beside
PyTorch's matmul (cuBLAS) when torch with CUDA is installed. Prints one table; times are the median of `--iters`
launches timed with CUDA events. Needs an sm_90 GPU (H100/H200): `python extra/bench/wgmma_proto.py`
(`--only NAME` keeps the rows whose kernel name contains NAME, `--layouts n,k` the B layouts named, `--specialized`
runs the kernels with a producer warpgroup instead of the cooperative ones; `--no-speed`
skips part 2; `--profile` launches each part-2 kernel once more, untimed, for ncu: `ncu -k regex:wgmma python
extra/bench/wgmma_proto.py --profile`).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

import numpy as np

try:   # before ourgrad opens the GPU: torch imported later in this process failed to register its ops (run 1)
  import torch
except ImportError:
  torch = None

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ourgrad.codegen.wgmma_tiles import WgmmaMatmul, render_wgmma_matmul  # noqa: E402
from ourgrad.device import Buffer, Device  # noqa: E402
from ourgrad.dtype import dtypes  # noqa: E402


def to_bits(values: np.ndarray, dtype: str) -> np.ndarray:
  """float32 values -> their float16/bfloat16 bit patterns (bfloat16: round to nearest even)."""
  if dtype == "float16": return values.astype(np.float16).view(np.uint16)
  bits = values.astype(np.float32).view(np.uint32)
  return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bits(bits: np.ndarray, dtype: str) -> np.ndarray:
  if dtype == "float16": return bits.view(np.float16).astype(np.float64)
  return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@functools.lru_cache(maxsize=2)
def host_inputs(m: int, n: int, k: int, dtype: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Random A (m x k) and B (k x n) as float16/bfloat16 bits, made once per shape (the speed rows share them)."""
  rng = np.random.default_rng(seed)
  return (to_bits(rng.standard_normal((m, k), dtype=np.float32), dtype),
          to_bits(rng.standard_normal((k, n), dtype=np.float32), dtype))


@functools.lru_cache(maxsize=2)
def host_product(m: int, n: int, k: int, dtype: str, seed: int) -> np.ndarray:
  a_bits, b_bits = host_inputs(m, n, k, dtype, seed)
  return from_bits(a_bits, dtype) @ from_bits(b_bits, dtype)


class Case:
  """A compiled kernel with its device buffers and inputs."""

  def __init__(self, plan: WgmmaMatmul, seed: int = 0):
    device = Device["CUDA"]
    self.plan, self.source = plan, render_wgmma_matmul(plan)
    self.program = device.program(plan.name, device.compiler.compile_cached(self.source))
    self.registers = next((line.split("Used ")[1].split(",")[0] for line in
                           device.compiler.ptxas_info(self.source).splitlines() if "Used " in line), "?")
    self.seed = seed
    self.a_bits, self.b_bits = host_inputs(plan.m, plan.n, plan.k, plan.dtype, seed)
    stored_b = np.ascontiguousarray(self.b_bits.T) if plan.b_k_major else self.b_bits
    dtype = dtypes.float16 if plan.dtype == "float16" else dtypes.bfloat16
    self.a = Buffer("CUDA", plan.m * plan.k, dtype).copyin(memoryview(np.ascontiguousarray(self.a_bits)).cast("B"))
    self.b = Buffer("CUDA", plan.k * plan.n, dtype).copyin(memoryview(stored_b).cast("B"))
    self.c = Buffer("CUDA", plan.m * plan.n, dtype).allocate()

  def launch(self, wait: bool = False) -> float | None:
    return self.program(self.c.handle, self.a.handle, self.b.handle, global_size=self.plan.global_size,
                        local_size=self.plan.local_size, wait=wait)

  def error(self) -> float:
    """Relative (Frobenius) error of C against numpy's float64 product of the same rounded inputs."""
    self.launch()
    result = from_bits(np.frombuffer(self.c.as_bytes(), dtype=np.uint16), self.plan.dtype).reshape(self.plan.m,
                                                                                                    self.plan.n)
    reference = host_product(self.plan.m, self.plan.n, self.plan.k, self.plan.dtype, self.seed)
    return float(np.linalg.norm(result - reference) / np.linalg.norm(reference))

  def seconds(self, iters: int) -> float:
    for _ in range(2): self.launch()
    return statistics.median(self.launch(wait=True) for _ in range(iters))


def torch_tflops(size: int, dtype: str, iters: int) -> str:
  if torch is None or not torch.cuda.is_available(): return "-"
  torch_dtype = torch.float16 if dtype == "float16" else torch.bfloat16
  a = torch.randn(size, size, device="cuda", dtype=torch_dtype)
  b = torch.randn(size, size, device="cuda", dtype=torch_dtype)
  for _ in range(3): a @ b
  times = []
  for _ in range(iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    a @ b
    end.record()
    torch.cuda.synchronize()
    times.append(start.elapsed_time(end) / 1e3)
  return f"{2 * size ** 3 / statistics.median(times) / 1e12:.1f}"


# a probe with wrong strides may read outside its tile (a launch error ends the process): the riskiest goes last
LAYOUTS = {"n": dict(), "k": dict(b_k_major=True), "n_swapped": dict(b_lbo_sbo_swapped=True)}
SPEED_TILES = [dict(block_m=128, block_n=256, stages=4), dict(block_m=128, block_n=256, stages=3),
               dict(block_m=128, block_n=128, stages=6), dict(block_m=256, block_n=128, stages=4),
               dict(block_m=64, block_n=256, stages=5), dict(block_m=128, block_n=256, stages=4, group_m=16),
               dict(block_m=128, block_n=256, stages=4, group_m=1)]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--only", default="")
  parser.add_argument("--no-speed", action="store_true")
  parser.add_argument("--profile", action="store_true")
  parser.add_argument("--size", type=int, default=4096)
  parser.add_argument("--layouts", default=",".join(LAYOUTS), help="B layouts to run, of " + ",".join(LAYOUTS))
  parser.add_argument("--specialized", action="store_true", help="the warp-specialized kernels (a producer warpgroup)")
  parser.add_argument("--deep", action="store_true", help="the cooperative kernels that copy stages - 1 steps ahead")
  args = parser.parse_args()
  print(f"device: {Device['CUDA'].arch}")
  print(f"{'kernel':58s} {'regs':>5s} {'err':>9s} {'ms':>8s} {'TFLOP/s':>8s}")
  correct: dict[tuple[str, str], bool] = {}   # (dtype, layout) -> every checked case right (unchecked: tried)
  for dtype in ("float16", "bfloat16"):
    for layout in args.layouts.split(","):
      options, ok = dict(LAYOUTS[layout], specialized=args.specialized, deep=args.deep), True
      for m, n, k, tile in ((512, 512, 512, dict()), (384, 256, 1024, dict(block_n=128, stages=5))):
        plan = WgmmaMatmul(m, n, k, dtype=dtype, **tile, **options)
        if args.only not in plan.name: continue
        case = Case(plan)
        error = case.error()
        ok = ok and error < 1e-2
        verdict = "ok" if error < 1e-2 else "WRONG"
        print(f"{plan.name:58s} {case.registers:>5s} {error:9.1e} {'':>8s} {'':>8s}  {verdict}", flush=True)
      correct[(dtype, layout)] = ok
  if args.no_speed: return
  size = args.size
  for dtype in ("float16", "bfloat16"):
    print(f"torch {dtype} {size}^3: {torch_tflops(size, dtype, args.iters)} TFLOP/s", flush=True)
    for layout in args.layouts.split(","):
      options = dict(LAYOUTS[layout], specialized=args.specialized, deep=args.deep)
      if not correct.get((dtype, layout), True): continue
      for tile in SPEED_TILES if layout == "n" else SPEED_TILES[:1]:
        plan = WgmmaMatmul(size, size, size, dtype=dtype, **tile, **options)
        if args.only not in plan.name: continue
        case = Case(plan)
        error = case.error()
        seconds = case.seconds(args.iters)
        if args.profile: case.launch()
        print(f"{plan.name:58s} {case.registers:>5s} {error:9.1e} {seconds * 1e3:8.3f} "
              f"{2 * size ** 3 / seconds / 1e12:8.1f}", flush=True)
        if tile is SPEED_TILES[0]:   # the machine code: HGMMA (wgmma) and no HMMA (mma.sync) expected
          sass = Device["CUDA"].compiler.sass(case.source)
          print(f"  SASS: {sass.count('HGMMA')} HGMMA, {sass.count('HMMA')} HMMA, {sass.count('LDGSTS')} LDGSTS"
                if "HGMMA" in sass or "HMMA" in sass else f"  SASS: {sass.splitlines()[0][:100]}", flush=True)


if __name__ == "__main__":
  main()
