"""What one kernel launch costs the host on CUDA through each way of calling the driver (issue 26, op1's realize): the
same 1-element kernel (`x + 1`'s) launched again and again through
  cuda-python          the bound cuda-python wrapper (what PositionalLaunch calls: functools.partial of
                       driver.cuLaunchKernel with every argument bound)
  ctypes, 11 args      libcuda's cuLaunchKernel through ctypes, its argument types declared, every argument bound
  C trampoline         one ctypes call with one argument (the address of a struct holding the launch's arguments and
                       the driver function's address): a C function compiled here makes the driver call
  trampoline, no-op    the same with the driver function replaced by a C function that returns at once: the cost of
                       the Python call and ctypes alone
  PyTorch add_         torch's `x.add_(1)` on a 1-element tensor, for scale (where torch is installed)
Rounds alternate between the rows; each times `--launches` launches by the host's clock (the device synchronized
before each round, outside the timing). Medians over `--rounds`, in microseconds per launch.

Run: `python extra/bench/probe_launch_calls.py` on a CUDA machine with a C compiler (cc).
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from ourgrad import Device, Tensor  # noqa: E402
from ourgrad.device import Buffer  # noqa: E402
from ourgrad.dtype import dtypes  # noqa: E402
from ourgrad.engine import schedule_cache  # noqa: E402
from ourgrad.runtime.ops_cuda import LAUNCH_TRAMPOLINE_SOURCE, LaunchRecord  # noqa: E402

# the library's own trampoline (runtime/ops_cuda.py), plus a function of the driver's signature that does nothing:
# the cost of the call path alone
TRAMPOLINE = LAUNCH_TRAMPOLINE_SOURCE + r"""
int og_no_launch(void *f, unsigned a, unsigned b, unsigned c, unsigned d, unsigned e, unsigned g, unsigned h,
                 void *s, void **p, void **x) { return 0; }
"""


def compile_trampoline() -> ctypes.CDLL:
  folder = tempfile.mkdtemp()
  source, library = os.path.join(folder, "t.c"), os.path.join(folder, "t.so")
  pathlib.Path(source).write_text(TRAMPOLINE)
  subprocess.run([os.environ.get("CC", "cc"), "-O2", "-shared", "-fPIC", source, "-o", library], check=True)
  return ctypes.CDLL(library)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--launches", type=int, default=400)
  parser.add_argument("--rounds", type=int, default=15)
  args = parser.parse_args()
  x = Tensor([1.0], device="CUDA").realize()
  for _ in range(3): (x + 1).realize()
  cached = schedule_cache._last_traced[0]
  memo = cached.lowerings[0]
  launch = memo.launch
  out = Buffer("CUDA", 1, dtypes.float32).allocate()
  launch([out, x.lazydata.base.realized])
  program = memo.runner.program
  device = Device["CUDA"]
  rows: dict[str, Callable[[], Any]] = {"cuda-python": launch.call_driver}
  library = ctypes.CDLL("libcuda.so.1")
  direct = library.cuLaunchKernel
  direct.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
  direct.restype = ctypes.c_int
  sizes = [*launch.global_size, *launch.local_size, program.shared_bytes]
  params = ctypes.addressof(launch.pointers)
  stream = int(device.stream)
  rows["ctypes, 11 args"] = functools.partial(direct, int(program.function), *sizes, stream, params, None)
  try:
    trampoline = compile_trampoline()
  except (OSError, subprocess.CalledProcessError) as error:
    print(f"no C trampoline: {error}")
  else:
    call = trampoline.og_launch_kernel
    call.argtypes, call.restype = [ctypes.c_void_p], ctypes.c_int
    record = LaunchRecord(ctypes.cast(direct, ctypes.c_void_p).value, int(program.function),
                          (ctypes.c_uint * 7)(*sizes), stream, params)
    rows["C trampoline"] = functools.partial(call, ctypes.addressof(record))
    no_op = LaunchRecord(ctypes.cast(trampoline.og_no_launch, ctypes.c_void_p).value, int(program.function),
                         (ctypes.c_uint * 7)(*sizes), stream, params)
    rows["trampoline, no-op"] = functools.partial(call, ctypes.addressof(no_op))
    plain = trampoline.og_no_launch
    plain.argtypes, plain.restype = [], ctypes.c_int
  syncs: dict[str, Callable[[], None]] = {name: device.synchronize for name in rows}
  try:
    import torch
    if torch.cuda.is_available():
      t = torch.ones(1, device="cuda")
      rows["PyTorch add_"], syncs["PyTorch add_"] = (lambda: t.add_(1)), torch.cuda.synchronize
  except ImportError:
    pass
  times: dict[str, list[float]] = {name: [] for name in rows}
  for row in rows.values(): row()
  device.synchronize()
  clock = time.perf_counter
  for _ in range(args.rounds):
    for name, row in rows.items():
      syncs[name]()
      start = clock()
      for _ in range(args.launches): row()
      times[name].append((clock() - start) / args.launches * 1e6)
  device.synchronize()
  print(f"host us per launch, median of {args.rounds} rounds of {args.launches} (min)")
  for name, values in times.items():
    print(f"{name:20s} {statistics.median(values):6.2f} ({min(values):5.2f})")
  print("op1 check:", (x + 1).numpy())


if __name__ == "__main__":
  main()
