"""Compile latency of a never-seen kernel: the first result of a new 8-op elementwise expression, split into its parts.

Each trial builds `((((x*c + 1.5).exp2() - 0.25).sqrt() * x).relu() + c).log2()` with a constant `c` no process has
used before (so its kernel source is new: no in-memory or disk cache can answer) and times, one after another:
  graph      building the lazy graph (Python)
  schedule   create_schedule (Python)
  codegen    Kernel + hand-coded opts + linearize + render to CUDA C++ (Python)
  nvrtc      NVRTC: CUDA C++ -> CUBIN for the GPU's sm_XX
  cache      writing the binary into the on-disk compile cache
  load       cuModuleLoadData + cuModuleGetFunction (CUDA only)
  run        launch, synchronize and copy the 4096 results back (CUDA only)
  cubin: nvrtc / cubin: load   the other way to the same kernel (ptx: ... with CUDA_PTX=0): by default (CUDA_PTX=1)
                           NVRTC stops at PTX and the driver compiles the PTX inside cuModuleLoadData (load only on
                           CUDA); the other way has NVRTC compile to CUBIN
then, separately, `end to end`: the same expression with another new constant through the real path (`.numpy()`),
which is the figure the issue's goal is about (bench_jit.py's "first result" row measures it the same way).
`second process, cache hit` is a fresh Python process reading the first trials' binaries from the disk cache;
`new process, first NVRTC compile` is a fresh process's first compile, cold and after the background warm-up that
opening a CUDA device starts (NVRTC's one-time initialization).

Without a CUDA device (no GPU) the kernels are generated for --arch and compiled with NVRTC only (NVRTC needs no
GPU): the Python and NVRTC parts are measured, load/run/end to end are not.
Run: `python extra/bench/bench_compile.py` (`--trials 10`, `--arch sm_90` without a GPU).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # run from anywhere: this checkout's ourgrad

ELEMENTS = 4096
ROOT = pathlib.Path(__file__).resolve().parents[2]


def expression(x: Any, constant: float) -> Any:
  """The 8-op elementwise expression (mul, add, exp2, sub, sqrt, mul, relu, add, log2: one fused kernel)."""
  return ((((x * constant + 1.5).exp2() - 0.25).sqrt() * x).relu() + constant).log2()


def new_constant(rng: random.Random) -> float:
  """A float32 constant that makes the kernel's source new (random: not seen by an earlier run either)."""
  return float(np.float32(1.0 + rng.random()))


def time_parts(x: Any, constant: float, device: str, renderer: Any, compiler: Any,
               other_compiler: Any) -> tuple[dict[str, float], str]:
  """Seconds of each part of a first result (module docstring), and the kernel source."""
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.codegen.linearizer import linearize
  from ourgrad.codegen.uops import launch_dims
  from ourgrad.device import CACHE_ENTRY_MAGIC, Device, write_atomic
  from ourgrad.engine.schedule import create_schedule
  parts: dict[str, float] = {}
  start = time.perf_counter()
  out = expression(x, constant)
  parts["graph"] = time.perf_counter() - start
  start = time.perf_counter()
  (item,) = create_schedule([out.lazydata])
  parts["schedule"] = time.perf_counter() - start
  start = time.perf_counter()
  kernel = Kernel(item.ast, renderer)
  kernel.hand_coded_optimizations()
  uops = linearize(kernel)
  source = renderer.render(kernel.name, uops)
  parts["codegen"] = time.perf_counter() - start
  start = time.perf_counter()
  binary = compiler.compile(source)
  parts["nvrtc"] = time.perf_counter() - start
  start = time.perf_counter()
  write_atomic(compiler.cache_path(source), CACHE_ENTRY_MAGIC + hashlib.sha256(binary).digest() + binary,
               durable=False)  # as Compiler.compile_cached writes it
  parts["cache"] = time.perf_counter() - start
  if device == "CUDA":
    start = time.perf_counter()
    program = Device["CUDA"].program(kernel.name, binary)
    parts["load"] = time.perf_counter() - start
    buffers = [*item.outputs, *item.inputs]
    start = time.perf_counter()
    global_size, local_size = launch_dims(uops)
    program(*[buffer.handle for buffer in buffers], global_size=global_size, local_size=local_size)
    result = item.outputs[0].numpy()
    parts["run"] = time.perf_counter() - start
    assert result.shape == (ELEMENTS,)
  start = time.perf_counter()
  other_binary = other_compiler.compile(source)
  parts[f"{other_compiler.label}: nvrtc"] = time.perf_counter() - start
  if device == "CUDA":
    start = time.perf_counter()
    Device["CUDA"].program(kernel.name, other_binary)
    parts[f"{other_compiler.label}: load"] = time.perf_counter() - start
  return parts, source


def end_to_end_seconds(x: Any, constant: float) -> float:
  start = time.perf_counter()
  value = expression(x, constant).numpy()
  seconds = time.perf_counter() - start
  assert value.shape == (ELEMENTS,)
  return seconds


def cache_hit_in_new_process(sources: list[str], arch: str, ptx: bool) -> float:
  """Median seconds a fresh process takes to read one of `sources`' binaries from the disk cache (asserting that
  every one is there)."""
  script = (
    "import sys, time, statistics, json\n"
    "from ourgrad.runtime.ops_cuda import CUDACompiler\n"
    f"compiler = CUDACompiler({arch!r}, ptx={ptx})\n"
    "sources = json.loads(sys.stdin.read())\n"
    "times = []\n"
    "for source in sources:\n"
    "  start = time.perf_counter()\n"
    "  binary = compiler.load_cached(source)\n"
    "  times.append(time.perf_counter() - start)\n"
    "  assert binary, 'not in the disk cache'\n"
    "print(statistics.median(times))\n")
  import json
  environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  done = subprocess.run([sys.executable, "-c", script], input=json.dumps(sources), capture_output=True, text=True,
                        check=True, env=environment)
  return float(done.stdout.strip().splitlines()[-1])


def first_compile_in_new_process(source: str, arch: str, ptx: bool, warm_up: bool) -> float:
  """Seconds of the first NVRTC compile of a fresh process (NVRTC's one-time initialization included unless the
  compiler's background warm-up, which opening a CUDA device starts, had half a second to run first)."""
  script = (
    "import sys, time\n"
    "from ourgrad.runtime.ops_cuda import CUDACompiler\n"
    f"compiler = CUDACompiler({arch!r}, ptx={ptx})\n"
    f"if {warm_up}: compiler.warm_up(); time.sleep(0.5)\n"
    "source = sys.stdin.read()\n"
    "start = time.perf_counter()\n"
    "compiler.compile(source)\n"
    "print(time.perf_counter() - start)\n")
  environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  done = subprocess.run([sys.executable, "-c", script], input=source, capture_output=True, text=True, check=True,
                        env=environment)
  return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--trials", type=int, default=10)
  parser.add_argument("--arch", default="sm_90", help="architecture to compile for when there is no CUDA device")
  args = parser.parse_args()
  # a cache folder of this run's own: its entries are the trials' kernels only
  os.environ["OURGRAD_CACHE_DIR"] = tempfile.mkdtemp(prefix="ourgrad_bench_compile_")
  from ourgrad import Device, Tensor
  from ourgrad.errors import DeviceError
  try:
    cuda = Device["CUDA"]
    device, renderer, compiler, arch = "CUDA", cuda.renderer, cuda.compiler, cuda.arch
  except DeviceError as error:
    from ourgrad.renderer.cuda import CUDARenderer
    from ourgrad.runtime.ops_cuda import CUDACompiler
    print(f"no CUDA device ({str(error).splitlines()[0][:100]}): NVRTC only, for {args.arch}")
    from ourgrad.helpers import CUDA_PTX
    device, renderer, compiler, arch = "CLANG", CUDARenderer(), CUDACompiler(args.arch, ptx=bool(CUDA_PTX)), args.arch
    compiler.warm_up()  # what opening a CUDA device does
  # the way to a loaded kernel that this run does not use by default (CUDA_PTX flips it)
  from ourgrad.runtime.ops_cuda import CUDACompiler
  other_compiler = CUDACompiler(arch, ptx=not compiler.emit_ptx)
  other_compiler.label = "cubin" if compiler.emit_ptx else "ptx"
  compiler_threads = [thread for thread in __import__("threading").enumerate() if "warm-up" in thread.name]
  for thread in compiler_threads: thread.join()
  rng = random.Random(time.time_ns())
  x = Tensor(np.random.default_rng(0).standard_normal(ELEMENTS).astype(np.float32), device=device).realize()
  trials: list[dict[str, float]] = []
  sources: list[str] = []
  for _ in range(args.trials):
    parts, source = time_parts(x, new_constant(rng), device, renderer, compiler, other_compiler)
    trials.append(parts)
    sources.append(source)
  end_to_end = [end_to_end_seconds(x, new_constant(rng)) for _ in range(args.trials)] if device == "CUDA" else []
  cache_hit = cache_hit_in_new_process(sources, arch, compiler.emit_ptx)
  # a source no process compiled yet (NVRTC keeps no cache of its own, but be sure): its constant is changed
  fresh = [sources[-1].replace("1.5f", f"{1.5 + index / 64:.6f}f") for index in range(2)]
  first_cold = first_compile_in_new_process(fresh[0], arch, compiler.emit_ptx, warm_up=False)
  first_warmed = first_compile_in_new_process(fresh[1], arch, compiler.emit_ptx, warm_up=True)

  print(f"device: {device}  arch: {arch}  compiler: {compiler.cache_key}  trials: {args.trials}")
  print("| part | median ms | min ms | first trial ms |\n| --- | --- | --- | --- |")
  python_parts = ("graph", "schedule", "codegen")
  own_parts = [name for name in trials[0] if ":" not in name]  # the other compiler's parts are not summed
  for name in trials[0]:
    values = [trial[name] * 1e3 for trial in trials]
    print(f"| {name} | {statistics.median(values):.2f} | {min(values):.2f} | {values[0]:.2f} |")
  python_ms = [sum(trial[name] for name in python_parts) * 1e3 for trial in trials]
  total_ms = [sum(trial[name] for name in own_parts) * 1e3 for trial in trials]
  print(f"| Python (graph + schedule + codegen) | {statistics.median(python_ms):.2f} | {min(python_ms):.2f} | "
        f"{python_ms[0]:.2f} |")
  print(f"| sum of the parts (not the other way's) | {statistics.median(total_ms):.2f} | {min(total_ms):.2f} | "
        f"{total_ms[0]:.2f} |")
  if end_to_end:
    values = [seconds * 1e3 for seconds in end_to_end]
    print(f"| end to end (.numpy() of a new expression) | {statistics.median(values):.2f} | {min(values):.2f} | "
          f"{values[0]:.2f} |")
  print(f"| second process, cache hit (read + check) | {cache_hit * 1e3:.3f} | | |")
  print(f"| new process, first NVRTC compile, cold | {first_cold * 1e3:.2f} | | |")
  print(f"| new process, first NVRTC compile, after the warm-up | {first_warmed * 1e3:.2f} | | |")


if __name__ == "__main__":
  main()
