"""Probe a GPT-2 training step's kernels: one 8 x 512 TinyJit step (PROBE_LAYERS layers, default 2; PROBE_CONFIG
'batch,seq,width,heads,layers,vocab' overrides) with TF32 matmuls (PROBE_AUTOCAST=bf16: under bf16 autocast);
writes the CUDA source of each kernel whose name matches PROBE_RE to $OUT/sources.txt, then replays one step between
cuProfilerStart/Stop for ncu:

    ncu --profile-from-start off --metrics $METRICS --csv --log-file k.csv python extra/bench/probe_gpt2_kernels.py

(extra/bench/plans/probe11.txt lists the metrics used for results/probe_s11/.)"""
import os
import re
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DEVICE", "CUDA")
import numpy as np  # noqa: E402
import bench_gpt2 as bg  # noqa: E402
from ourgrad import Tensor, TinyJit, set_float32_matmul_precision  # noqa: E402
from ourgrad.device import Device  # noqa: E402

def main() -> None:
  set_float32_matmul_precision("high")
  layers = int(os.environ.get("PROBE_LAYERS", "2"))
  config = bg.BenchConfig.parse(os.environ.get("PROBE_CONFIG", f"8,512,768,12,{layers},50304"))
  dev = os.environ["DEVICE"]
  weights = bg.initial_weights(config)
  rng = np.random.default_rng(0)
  batch = rng.integers(0, config.model.vocab_size, (config.batch, config.sequence + 1)).astype(np.int32)
  tokens, targets = Tensor(batch[:, :-1].copy()).realize(), Tensor(batch[:, 1:].copy()).realize()
  model = bg.ourgrad_model(config, weights, dev)
  step = TinyJit(bg.ourgrad_step(model, os.environ.get("PROBE_AUTOCAST") or None))
  for _ in range(3): step(tokens, targets).item()
  pattern = re.compile(os.environ.get("PROBE_RE", "^E_|^r_8_12|^r_768|^r_2304|^r_3072"))
  seen = set()
  out = Path(os.environ.get("OUT", "/tmp")) / "sources.txt"
  with out.open("w") as f:
    for item in step.captured.items:
      r = item.runner
      if r.name in seen or not pattern.search(r.name): continue
      seen.add(r.name)
      f.write(f"==== {r.name} global {r.global_size} local {r.local_size} bytes {r.byte_count} ops {r.op_count}\n")
      f.write(f"buffers {[(b.size, str(b.dtype)) for b in item.bufs]}\n{r.source}\n")
  print("sources of", len(seen), "kernels")
  if dev != "CUDA": return
  from cuda.bindings import driver
  Device["CUDA"].synchronize()
  driver.cuProfilerStart()
  step(tokens, targets).item()
  Device["CUDA"].synchronize()
  driver.cuProfilerStop()
  print("profiled one step")

if __name__ == "__main__":
  main()
