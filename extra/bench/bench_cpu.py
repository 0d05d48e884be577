"""CPU benchmark at both SIMD widths in one run: numpy, PyTorch (CPU, 2 threads) and ourgrad's CLANG device compiled
for this machine (CLANG_MARCH=native) and for AVX2 (CLANG_MARCH=x86-64-v3), on the same inputs.

    python extra/bench/bench_cpu.py                  # every row, both widths
    python extra/bench/bench_cpu.py --only matmul    # rows whose name contains 'matmul'
    python extra/bench/bench_cpu.py --marches native # one width

Rows: matmul 1024^3 and 2048^3, softmax and layernorm over 4096x4096, conv 32x16x64^2 -> 32 3x3 forward and
forward+backward, an MLP step (784-512-512-10, Adam, batch 256) and the examples/mnist.py "full" CNN step (4 convs
32-32-64-64 with BatchNorm, batch 128), both TinyJit, then examples/mnist.py itself (--epochs 2 --limit 10240
--eval-limit 1000; its last epoch's ms/step: CPU time with --cpu-time). The CNN step also prints a per-kernel table.

References at each width: numpy's OpenBLAS and PyTorch pick AVX-512 kernels on an AVX-512 machine, so the
x86-64-v3 columns would compare our AVX2 code with their AVX-512 code. The references therefore run once per width in
a subprocess whose environment caps them at that width before they load (REFERENCE_ENV: OPENBLAS_CORETYPE=Haswell,
ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2; native clears them); the header
prints what each one really picked (OpenBLAS core, PyTorch capability, oneDNN ISA). Each width's "/torch" and
"/numpy" divide by that width's references (the goal's ratio); the last two columns divide the x86-64-v3 time by the
native (AVX-512) references. MKL (PyTorch's matmul) runs its generic path on AMD CPUs whatever the cap. ourgrad at
each width runs in its own subprocess (the compile cache and the kernels' SIMD width follow CLANG_MARCH, read once
at import). Ops: the inputs are realized once; each run builds a fresh lazy graph (not timed)
and times its realize (scheduling from the cache and the launches). numpy and torch time the whole expression.
Training steps: the mean of --steps steps after warm-up. Every figure is a median; the machine is shared, so compare
ratios from one run, not absolute times across runs (--cpu-time: one thread for every library and CPU time, which
a busy machine disturbs far less than wall time). The "/ torch" column is ourgrad's time over PyTorch's.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

# --cpu-time: every library on one thread, timed by this process's CPU time (set before numpy loads its BLAS)
CPU_TIME = "--cpu-time" in sys.argv
if CPU_TIME: os.environ.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")

import numpy as np  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
MARCHES = ("native", "x86-64-v3")
TORCH_THREADS = 1 if CPU_TIME else 2
# CPU time stays near the work done when the machine is shared (wall time there also counts the waits for a core)
clock = time.process_time if CPU_TIME else time.perf_counter


def median_seconds(run: Callable[[], Any], budget: float, min_runs: int = 3, max_runs: int = 30,
                   prepare: Callable[[], Any] | None = None) -> float:
  """Median of timed `run(prepared)` calls after one warm-up, until `budget` seconds or `max_runs` runs."""
  def once() -> float:
    prepared = prepare() if prepare is not None else None
    began = clock()
    run(prepared) if prepare is not None else run()
    return clock() - began
  once()
  times: list[float] = []
  started = time.perf_counter()
  while len(times) < min_runs or (time.perf_counter() - started < budget and len(times) < max_runs):
    times.append(once())
  return statistics.median(times)


# ---------------------------------------------------------------- inputs, shared by the three libraries

def op_inputs() -> dict[str, list[np.ndarray]]:
  rng = np.random.default_rng(0)
  def normal(*shape: int) -> np.ndarray: return rng.standard_normal(shape, dtype=np.float32)
  return {"matmul 1024^3": [normal(1024, 1024), normal(1024, 1024)],
          "matmul 2048^3": [normal(2048, 2048), normal(2048, 2048)],
          "softmax 4096^2": [normal(4096, 4096)], "layernorm 4096^2": [normal(4096, 4096)],
          "conv 32x16x64^2->32 3x3 fwd": [normal(32, 16, 64, 64), normal(32, 16, 3, 3)],
          "conv 32x16x64^2->32 3x3 fwd+bwd": [normal(32, 16, 64, 64), normal(32, 16, 3, 3), normal(32, 32, 62, 62)]}


def flops(name: str) -> float | None:
  if name.startswith("matmul"): return 2 * int(name.split()[1].split("^")[0]) ** 3
  if name.startswith("conv"): return 2 * 32 * 32 * 62 * 62 * 16 * 9 * (3 if "bwd" in name else 1)
  return None


def numpy_row(name: str, arrays: list[np.ndarray], budget: float) -> float | None:
  if name.startswith("matmul"): return median_seconds(lambda: arrays[0] @ arrays[1], budget)
  if name.startswith("softmax"):
    def softmax() -> np.ndarray:
      e = np.exp(arrays[0] - arrays[0].max(-1, keepdims=True))
      return e / e.sum(-1, keepdims=True)
    return median_seconds(softmax, budget)
  if name.startswith("layernorm"):
    x = arrays[0]
    return median_seconds(lambda: (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5), budget)
  return None


def torch_ops(name: str, arrays: list[np.ndarray], budget: float) -> float:
  import torch
  import torch.nn.functional as F
  t = [torch.from_numpy(a) for a in arrays]
  if name.startswith("matmul"): return median_seconds(lambda: t[0] @ t[1], budget)
  if name.startswith("softmax"): return median_seconds(lambda: t[0].softmax(-1), budget)
  if name.startswith("layernorm"): return median_seconds(lambda: F.layer_norm(t[0], (4096,)), budget)
  if name.endswith("fwd"): return median_seconds(lambda: F.conv2d(t[0], t[1]), budget)
  x, w = t[0].clone().requires_grad_(), t[1].clone().requires_grad_()
  def step() -> None:
    x.grad = w.grad = None
    F.conv2d(x, w).backward(t[2])
  return median_seconds(step, budget)


def mean_seconds(step: Callable[[], Any], sync: Callable[[], None], steps: int, warmup: int) -> float:
  """Mean seconds of `steps` calls of `step` after `warmup`, by `clock`."""
  for _ in range(warmup): step()
  sync()
  began = clock()
  for _ in range(steps): step()
  sync()
  return (clock() - began) / steps


STEP_ROWS = ("MLP step (batch 256), TinyJit", "CNN step (batch 128), TinyJit")


def torch_steps(steps: int, names: tuple[str, ...] = STEP_ROWS) -> dict[str, float]:
  import torch
  torch.manual_seed(0)
  mlp = torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                            torch.nn.Linear(512, 10))
  layers: list[torch.nn.Module] = []
  channels = 1
  for block in [[32, 32], [64, 64]]:
    for out_channels in block:
      kernel = 5 if out_channels == 32 else 3
      layers += [torch.nn.Conv2d(channels, out_channels, kernel, bias=False), torch.nn.BatchNorm2d(out_channels),
                 torch.nn.ReLU()]
      channels = out_channels
    layers.append(torch.nn.MaxPool2d(2))
  cnn = torch.nn.Sequential(*layers, torch.nn.Flatten(), torch.nn.Linear(576, 10))
  results = {}
  for name, model, shape in ((STEP_ROWS[0], mlp, (256, 784)), (STEP_ROWS[1], cnn, (128, 1, 28, 28))):
    if name not in names: continue
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(*shape), torch.randint(0, 10, (shape[0],))
    def step(model: torch.nn.Module = model, optimizer: Any = optimizer, x: Any = x, y: Any = y) -> None:
      optimizer.zero_grad(set_to_none=False)
      torch.nn.functional.cross_entropy(model(x), y).backward()
      optimizer.step()
    results[name] = mean_seconds(step, lambda: None, steps, 3)
  return results


# ---------------------------------------------------------------- ourgrad (one width per process)

def ourgrad_ops(name: str, arrays: list[np.ndarray], budget: float) -> tuple[float, int]:
  """(median seconds, kernels per run) of one op row; the result is checked against numpy/PyTorch first."""
  from ourgrad import Tensor
  from ourgrad.helpers import GlobalCounters
  t = [Tensor(a).realize() for a in arrays]
  if name.startswith("matmul"): build = lambda: [t[0] @ t[1]]  # noqa: E731
  elif name.startswith("softmax"): build = lambda: [t[0].softmax(-1)]  # noqa: E731
  elif name.startswith("layernorm"): build = lambda: [t[0].layernorm()]  # noqa: E731
  elif name.endswith("fwd"): build = lambda: [t[0].conv2d(t[1])]  # noqa: E731
  else:
    def build() -> list[Tensor]:
      x, w = Tensor(t[0].lazydata, requires_grad=True), Tensor(t[1].lazydata, requires_grad=True)
      x.conv2d(w).backward(t[2])
      return [x.grad, w.grad]
  check(name, arrays, [out.numpy() for out in build()])
  GlobalCounters.reset()
  Tensor.realize_all(*build())
  kernels = GlobalCounters.kernel_count
  return median_seconds(lambda built: Tensor.realize_all(*built), budget, prepare=build), kernels


def check(name: str, arrays: list[np.ndarray], results: list[np.ndarray]) -> None:
  import torch
  import torch.nn.functional as F
  t = [torch.from_numpy(a).double() for a in arrays]
  if name.startswith("matmul"): expected = [t[0] @ t[1]]
  elif name.startswith("softmax"): expected = [t[0].softmax(-1)]
  elif name.startswith("layernorm"): expected = [F.layer_norm(t[0], (4096,))]
  elif name.endswith("fwd"): expected = [F.conv2d(t[0], t[1])]
  else:
    x, w = t[0].requires_grad_(), t[1].requires_grad_()
    F.conv2d(x, w).backward(t[2])
    expected = [x.grad, w.grad]
  for got, want in zip(results, expected):
    scale = float(want.abs().max())
    np.testing.assert_allclose(got, want.numpy(), atol=1e-4 * scale, rtol=1e-3, err_msg=name)


def ourgrad_steps(steps: int, names: tuple[str, ...] = STEP_ROWS) -> tuple[dict[str, float], list[dict[str, Any]]]:
  """Seconds per TinyJit step of the MLP and the CNN, and the CNN step's per-kernel rows."""
  from bench_jit import MLP, load_mnist_example, ourgrad_step
  from ourgrad import Device, Tensor, TinyJit
  rng = np.random.default_rng(0)
  results, table = {}, []
  mnist = load_mnist_example()
  for name, make, shape in ((STEP_ROWS[0], MLP, (256, 784)),
                            (STEP_ROWS[1], lambda: mnist.ConvNet(mnist.MODELS["full"]), (128, 1, 28, 28))):
    if name not in names: continue
    x = Tensor(rng.standard_normal(shape).astype(np.float32)).realize()
    y = Tensor(rng.integers(0, 10, shape[0]).astype(np.int32)).realize()
    jit_step = TinyJit(ourgrad_step(make())[0])
    results[name] = mean_seconds(lambda: jit_step(x, y), Device["CLANG"].synchronize, steps, 3)
    if name.startswith("CNN"): table = kernel_rows(jit_step.captured.items)
  return results, table


def kernel_rows(items: list[Any]) -> list[dict[str, Any]]:
  """Each compiled kernel of a captured step: median seconds of 5 back-to-back launches (caches warm), its ops."""
  from ourgrad.engine.exec_item import CompiledRunner
  rows = []
  for item in items:
    if not isinstance(item.runner, CompiledRunner): continue
    item.run()
    times = []
    for _ in range(5):
      began = clock()
      item.run()
      times.append(clock() - began)
    rows.append({"name": item.runner.name, "seconds": statistics.median(times), "ops": int(item.runner.op_count)})
  return rows


def mnist_example_ms() -> float | None:
  """examples/mnist.py's last reported ms/step (the script trains, so compiles fall in its first epoch): its CPU
  time per step with --cpu-time (one thread: OMP_NUM_THREADS=1), else its wall time."""
  command = [sys.executable, str(ROOT / "examples" / "mnist.py"), "--epochs", "2", "--limit", "10240",
             "--eval-limit", "1000"]
  done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy(), cwd=ROOT)
  found = re.findall(r"\((\d+) ms/step, (\d+) ms CPU/step\)", done.stdout)
  if not found: print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
  return float(found[-1][1 if CPU_TIME else 0]) / 1e3 if found else None


def worker(args: argparse.Namespace) -> None:
  """The ourgrad rows at this process's CLANG_MARCH, as one JSON object on stdout's last line."""
  from ourgrad.device import Device
  results: dict[str, Any] = {"simd_bytes": Device["CLANG"].renderer.vector_bytes}
  for name, arrays in op_inputs().items():
    if wanted(name, args): results[name] = ourgrad_ops(name, arrays, args.budget)
  if step_rows := tuple(name for name in STEP_ROWS if wanted(name, args)):
    steps, results["cnn_table"] = ourgrad_steps(args.steps, step_rows)
    results.update({name: (seconds, None) for name, seconds in steps.items()})
  if wanted("mnist.py", args): results["examples/mnist.py step"] = (mnist_example_ms(), None)
  print(json.dumps(results))


def wanted(name: str, args: argparse.Namespace) -> bool: return args.only is None or args.only in name


# ---------------------------------------------------------------- references, one width per process

# the environment that caps numpy's OpenBLAS, PyTorch's ATen kernels, oneDNN and MKL at a width; it must be set before
# the libraries load, hence a subprocess per width. Native runs with these cleared (the libraries' own choice): a
# caller's OPENBLAS_CORETYPE=Haswell would otherwise hand the native column an AVX2 BLAS.
REFERENCE_ENV: dict[str, dict[str, str]] = {
  "x86-64-v3": {"OPENBLAS_CORETYPE": "Haswell", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}
REFERENCE_CAPS = ("OPENBLAS_CORETYPE", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def reference_env(march: str) -> dict[str, str]:
  """This process's environment with the width caps cleared, then `march`'s caps set."""
  env = {key: value for key, value in os.environ.items() if key not in REFERENCE_CAPS}
  return {**env, **REFERENCE_ENV.get(march, {})}


def reference_worker(args: argparse.Namespace) -> None:
  """numpy and PyTorch rows under this process's environment, as one JSON object on stdout's last line."""
  import torch
  torch.set_num_threads(TORCH_THREADS)
  rows: dict[str, tuple[float | None, float | None]] = {}
  for name, arrays in op_inputs().items():
    if wanted(name, args): rows[name] = (numpy_row(name, arrays, args.budget), torch_ops(name, arrays, args.budget))
  if step_rows := tuple(name for name in STEP_ROWS if wanted(name, args)):
    rows.update({name: (None, seconds) for name, seconds in torch_steps(args.steps, step_rows).items()})
  if wanted("mnist.py", args): rows["examples/mnist.py step"] = (None, None)
  print(json.dumps({"rows": rows, "picked": reference_picks()}))


def reference_picks() -> str:
  """What the references really run: OpenBLAS's core, PyTorch's CPU capability, oneDNN's ISA, read in this process."""
  import ctypes
  import glob

  import torch
  np.ones((64, 64), np.float32) @ np.ones((64, 64), np.float32)  # OpenBLAS names its core once a kernel has run
  core = "?"
  for library in glob.glob(str(pathlib.Path(np.__file__).parent.parent / "numpy.libs" / "*openblas*")):
    for symbol in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
      if hasattr(ctypes.CDLL(library), symbol):
        get_core = getattr(ctypes.CDLL(library), symbol)
        get_core.restype = ctypes.c_char_p
        core = get_core().decode()
  return f"OpenBLAS {core}, torch {torch.backends.cpu.get_cpu_capability()}, oneDNN {onednn_isa()}"


def onednn_isa() -> str:
  """oneDNN's ISA as its verbose mode prints it, from a one-convolution subprocess under this environment."""
  # (a convolution this size goes through oneDNN; tiny ones do not)
  probe = "import torch; torch.nn.functional.conv2d(torch.ones(2, 16, 16, 16), torch.ones(16, 16, 3, 3))"
  done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                        env={**os.environ, "ONEDNN_VERBOSE": "1"})
  found = re.search(r"isa:([^\n]+)", done.stdout)
  return found.group(1).strip() if found else "?"


def run_worker(flag: str, march: str, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
  """One worker subprocess (`flag` --worker or --reference) for `march` under `env`; its JSON result."""
  command = [sys.executable, __file__, flag, "--budget", str(args.budget), "--steps", str(args.steps)]
  if CPU_TIME: command.append("--cpu-time")
  if args.only: command += ["--only", args.only]
  done = subprocess.run(command, capture_output=True, text=True, env=env)
  if done.returncode != 0: sys.exit(f"{flag} at CLANG_MARCH={march} failed:\n{done.stderr[-4000:]}")
  return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- report

def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--only", help="rows whose name contains this")
  parser.add_argument("--marches", default=",".join(MARCHES), help="CLANG_MARCH values, comma-separated")
  parser.add_argument("--budget", type=float, default=3.0, help="seconds per op row and library")
  parser.add_argument("--steps", type=int, default=10, help="timed training steps")
  parser.add_argument("--cpu-time", action="store_true", help="one thread per library, timed by CPU time (for a "
                      "shared machine; examples/mnist.py's row is its CPU time per step, on one thread)")
  parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--reference", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  os.environ.setdefault("DEVICE", "CLANG")
  if args.worker: return worker(args)
  if args.reference: return reference_worker(args)
  marches = args.marches.split(",")
  references = {march: run_worker("--reference", march, args, reference_env(march)) for march in marches}
  ours = {march: run_worker("--worker", march, args, {**os.environ, "CLANG_MARCH": march}) for march in marches}
  report(references, ours)


def report(references: dict[str, dict[str, Any]], ours: dict[str, dict[str, Any]]) -> None:
  load = os.getloadavg()[0]
  clock_name = "CPU time, one thread each" if CPU_TIME else "wall time"
  print(f"# python extra/bench/bench_cpu.py {' '.join(sys.argv[1:])}; {clock_name}; torch {TORCH_THREADS} threads; "
        f"load average {load:.1f}; simd bytes: " +
        ", ".join(f"{march}={result['simd_bytes']}" for march, result in ours.items()))
  for march, reference in references.items():
    capped = " ".join(f"{key}={value}" for key, value in REFERENCE_ENV.get(march, {}).items()) or "caps cleared"
    print(f"# references at {march} ({capped}): {reference['picked']}")
  marches = list(ours)
  # the widest march's references (native) also divide the others' times: the figure before same-width references
  widest = marches[0]
  header = f"{'row':34}" + "".join(f" {march + ' numpy':>17} {'torch':>8} {'ours ms':>8} {'/torch':>7} {'/numpy':>7}"
                                   f" {'GFLOP/s':>8} {'kern':>4}" for march in marches)
  if len(marches) > 1: header += f" {'/torch@' + widest:>14} {'/numpy@' + widest:>14}"
  print(header)
  for name in references[widest]["rows"]:
    line = f"{name:34}"
    for march in marches:
      numpy_s, torch_s = references[march]["rows"].get(name, (None, None))
      seconds, kernels = ours[march].get(name, (None, None))
      work = flops(name)
      line += (f" {fmt_ms(numpy_s):>17} {fmt_ms(torch_s):>8} {fmt_ms(seconds):>8} {ratio(seconds, torch_s):>7}"
               f" {ratio(seconds, numpy_s):>7} {(f'{work / seconds / 1e9:.1f}' if work and seconds else '-'):>8}"
               f" {kernels or '-':>4}")
    if len(marches) > 1:
      seconds = ours[marches[-1]].get(name, (None, None))[0]
      numpy_s, torch_s = references[widest]["rows"][name]
      line += f" {ratio(seconds, torch_s):>14} {ratio(seconds, numpy_s):>14}"
    print(line)
  for march in marches:
    table = ours[march].get("cnn_table")
    if table: print_kernel_table(f"CNN step kernels at CLANG_MARCH={march}", table)


def print_kernel_table(title: str, rows: list[dict[str, Any]]) -> None:
  total = sum(row["seconds"] for row in rows)
  print(f"\n# {title}: {len(rows)} kernels, {total * 1e3:.2f} ms summed (each launched back to back, caches warm)")
  print(f"{'kernel (E_ elementwise, r_ reduce)':44} {'ms':>8} {'GFLOP/s':>8} {'share':>6}")
  for row in sorted(rows, key=lambda row: -row["seconds"]):
    print(f"{row['name'][:44]:44} {row['seconds'] * 1e3:8.3f} {row['ops'] / row['seconds'] / 1e9:8.1f} "
          f"{row['seconds'] / total * 100:5.1f}%")


def fmt_ms(seconds: float | None) -> str: return f"{seconds * 1e3:.2f}" if seconds is not None else "-"
def ratio(mine: float | None, theirs: float | None) -> str: return f"{mine / theirs:.2f}" if mine and theirs else "-"


if __name__ == "__main__":
  main()
