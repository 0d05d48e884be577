"""One causal SDPA forward + backward step of ourgrad on CUDA (B=4 H=12 T=4096 D=64 bfloat16 by default) between
cuProfilerStart and cuProfilerStop, after warm-up steps: the step `ncu --profile-from-start off` profiles
(extra/bench/ncu_source_stalls.py summarizes a kernel's per-instruction stall samples). Environment: T, B, H."""
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this checkout's ourgrad

from cuda.bindings import driver  # noqa: E402

from ourgrad import Device, Tensor, TinyJit, dtypes  # noqa: E402

T, B, H, D = int(os.environ.get("T", "4096")), int(os.environ.get("B", "4")), int(os.environ.get("H", "12")), 64
rng = np.random.default_rng(0)
q, k, v, grad = (Tensor(rng.standard_normal((B, H, T, D)).astype(np.float32), device="CUDA").cast(dtypes.bfloat16)
                 .contiguous().realize() for _ in range(4))
for t in (q, k, v): t.requires_grad = True


@TinyJit
def step(q: Tensor, k: Tensor, v: Tensor, grad: Tensor) -> list[Tensor]:
  for t in (q, k, v): t.grad = None
  out = q.scaled_dot_product_attention(k, v, is_causal=True)
  (out.cast(dtypes.float32) * grad.cast(dtypes.float32)).sum().backward()
  return [t.realize() for t in (out, q.grad, k.grad, v.grad)]


for _ in range(3): step(q, k, v, grad)
Device["CUDA"].synchronize()
driver.cuProfilerStart()
step(q, k, v, grad)
Device["CUDA"].synchronize()
driver.cuProfilerStop()
print(f"profiled one step: B={B} H={H} T={T} D={D}")
