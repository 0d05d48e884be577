"""CPU time of the CLANG device's per-kernel build, split into its steps, on kernels the renderer makes (small and
large, with and without OpenMP regions and libm calls), and the LLVM device's compile of the same kernels.

  PYTHONPATH=$PWD python extra/bench/clang_compile_cost.py [--reps N]

Columns (ms of CPU, the children's user + system time, mean of N builds): `driver -S` (the driver and cc1), `as`,
`-c` (driver, cc1 and as), `link alone` (today's `ld -shared kernel.o libgcc.a`, runtime/host_link.py), `driver
link` (the driver linking the object with its default libraries: how kernels were linked before), `build` (today's
ClangCompiler._build, compile and link), `old build` (one driver call compiling and linking with -lm, as before).
LLVM: process CPU of LLVMCompiler.compile (in-process, no linker).
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import tempfile
import time

import numpy as np

from ourgrad import Tensor
from ourgrad.device import Device
from ourgrad.runtime import ops_clang


def children_cpu_ms(run, reps: int) -> float:
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  for _ in range(reps): run()
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  return ((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)) / reps * 1e3


def sample_kernels() -> dict[str, str]:
  """Rendered C sources of a few typical kernels, captured from ClangCompiler.compile."""
  captured: list[str] = []
  compiler = Device["CLANG"].compiler
  original = compiler.compile
  compiler.compile = lambda source: captured.append(source) or original(source)   # type: ignore[method-assign]
  rng = np.random.default_rng(0)
  small = Tensor(rng.standard_normal((16, 16)).astype(np.float32))
  big = Tensor(rng.standard_normal((384, 384)).astype(np.float32))
  cases = {"add 16x16": lambda: small + 1.5, "sin 16x16 (libm)": lambda: small.sin(),
           "sum 16x16": lambda: small.sum(), "softmax 384 rows (OpenMP, exp2)": lambda: big.softmax(-1),
           "matmul 384 (OpenMP, tiles)": lambda: big @ big}
  sources = {}
  for name, make in cases.items():
    captured.clear()
    make().realize()
    if captured: sources[name] = max(captured, key=len)
  compiler.compile = original   # type: ignore[method-assign]
  return sources


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--reps", type=int, default=5)
  reps = parser.parse_args().reps
  os.environ["DISABLE_COMPILER_CACHE"] = "1"
  compiler: ops_clang.ClangCompiler = Device["CLANG"].compiler
  sources = sample_kernels()
  print(f"{compiler._describe()}, linker {compiler.linker.command('k.o', 'k.so')[0]}; ms of CPU, mean of {reps}")
  header = ["driver -S", "as", "-c", "link alone", "driver link", "build", "old build"]
  print(f"{'kernel':36s} {'lines':>5s} {'omp':>3s} " + " ".join(f"{h:>11s}" for h in header))
  for name, source in sources.items():
    flags = compiler.flags_for(source)
    compile_flags = [flag for flag in flags if flag != "-shared"]
    with tempfile.TemporaryDirectory() as folder:
      c, s, o, so = (os.path.join(folder, f"kernel.{ext}") for ext in ("c", "s", "o", "so"))
      with open(c, "w") as file: file.write(source)

      def run(*command: str) -> None: subprocess.run(command, check=True, capture_output=True)
      steps = [lambda: run(compiler.compiler, *compile_flags, "-S", c, "-o", s), lambda: run("as", s, "-o", o),
               lambda: run(compiler.compiler, *compile_flags, "-c", c, "-o", o),
               lambda: run(*compiler.linker.command(o, so)),
               lambda: run(compiler.compiler, "-shared", "-fopenmp", o, "-o", so, "-lm"),
               lambda: compiler._build(source, flags),
               lambda: run(compiler.compiler, *flags, c, "-o", so, *ops_clang.LINK_FLAGS)]
      times = [children_cpu_ms(step, reps) for step in steps]
    omp = "yes" if "omp parallel" in source else "no"
    print(f"{name:36s} {source.count(chr(10)):5d} {omp:>3s} " + " ".join(f"{t:11.1f}" for t in times), flush=True)
  try:
    llvm = Device["LLVM"]
  except Exception as error:   # no llvmlite here
    print(f"LLVM: not available ({error})")
    return
  print("LLVM (in-process MCJIT, no linker): ms of process CPU per compile")
  for name, make in {"add 16x16": lambda t: t + 1.5, "sin 16x16 (libm)": lambda t: t.sin(),
                     "softmax 384 rows": lambda t: t.softmax(-1)}.items():
    captured: list[str] = []
    original = llvm.compiler.compile
    llvm.compiler.compile = lambda source: captured.append(source) or original(source)   # type: ignore[method-assign]
    rows = 384 if "384" in name else 16
    make(Tensor(np.ones((rows, rows), np.float32), device="LLVM")).realize()
    llvm.compiler.compile = original   # type: ignore[method-assign]
    source = max(captured, key=len)
    start = time.process_time()
    for _ in range(reps): original(source)
    print(f"  {name:34s} {(time.process_time() - start) / reps * 1e3:8.1f}")


if __name__ == "__main__":
  main()
