"""The flash-attention backward kernels (ourgrad/codegen/attention_backward.py) on a CUDA GPU, beside PyTorch.

For each case: q, k, v (B, H, T, D), O and dO are made with torch on the GPU, LSE (natural log, float32, (B, H, T)) is
computed by torch, the two kernels are compiled with NVRTC (ourgrad's CUDACompiler) and launched through cuda-python
on torch's current stream, and dq, dk, dv are compared with a reference:
- "check" cases (small, odd lengths, GQA, L != S, head_dim 128): torch float64 autograd of SDPA;
- "time" cases (the issue's shapes): torch's fused SDPA backward in the same dtype (its own error is printed too,
  against float64 where that fits in memory), and both are timed: CUDA events around `--iters` back-to-back calls
  (fewer where a call is long), median of 5 batches after a warm-up. Each timed shape runs several plan variants
  (tile sizes, held fragments, with and without the occupancy hint), each printing its registers, spills, errors
  and times. torch's time is `torch.autograd.grad` of its fused SDPA output (the backward kernels alone; the forward
  ran before). ourgrad's is the dQ kernel (with delta) then the dK/dV kernel.
Every case prints its errors and times and the next case runs even if one fails; each dtype runs in a process
of its own.
Run on the H200: `python extra/bench/bench_attention_backward.py` (`--quick` for the check cases alone).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import dataclasses
import math
import statistics
import subprocess
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from ourgrad.codegen.attention_backward import launches  # noqa: E402
from ourgrad.codegen.attention_backward_plan import AttentionBackwardPlan, KernelLaunch  # noqa: E402

TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def compile_with_report(source: str, arch: str) -> tuple[bytes, str]:
  """CUBIN and ptxas's resource report (registers, spills) from one NVRTC compile."""
  from cuda.bindings import nvrtc
  from ourgrad.runtime.ops_cuda import check
  program = check(nvrtc.nvrtcCreateProgram(source.encode(), b"kernel.cu", 0, [], []), "nvrtcCreateProgram")
  options = [f"--gpu-architecture={arch}".encode(), b"-default-device", b"--std=c++17", b"--ptxas-options=-v"]
  status = nvrtc.nvrtcCompileProgram(program, len(options), options)[0]
  log = b" " * check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
  check(nvrtc.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog")
  if status != nvrtc.nvrtcResult.NVRTC_SUCCESS: raise RuntimeError(f"NVRTC failed:\n{log.decode(errors='replace')}")
  cubin = b" " * check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
  check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
  check(nvrtc.nvrtcDestroyProgram(program), "nvrtcDestroyProgram")
  return cubin, log.rstrip(b"\x00").decode(errors="replace")


class Kernels:
  """The two kernels of a plan, compiled and loaded into torch's CUDA context."""

  def __init__(self, plan: AttentionBackwardPlan, compiled: list[tuple[bytes, str]], verbose: bool):
    from cuda.bindings import driver
    from ourgrad.runtime.ops_cuda import check
    self.plan, self.driver, self.check = plan, driver, check
    self.loaded: list[tuple[KernelLaunch, object]] = []
    for launch, (cubin, log) in zip(launches(plan), compiled):
      if verbose:
        report = [line for line in log.splitlines() if "registers" in line or "spill" in line]
        print(f"    {launch.name}: grid {launch.grid} block {launch.block} shared {launch.shared_bytes} B; "
              + " | ".join(line.split(":", 1)[-1].strip() for line in report))
      module = check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
      function = check(driver.cuModuleGetFunction(module, launch.name.encode()), "cuModuleGetFunction")
      attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
      check(driver.cuFuncSetAttribute(function, attribute, launch.shared_bytes), "cuFuncSetAttribute")
      self.loaded.append((launch, function))
    self.keep_alive: list = []

  def bind(self, buffers: dict) -> list:
    """One launcher per kernel on these buffers (argument arrays built once)."""
    from ourgrad.runtime.ops_cuda import pointer_arguments
    launchers = []
    for launch, function in self.loaded:
      arguments, pointers = pointer_arguments([buffers[name].data_ptr() for name in launch.arguments])
      self.keep_alive.append((arguments, pointers))
      launchers.append((function, launch, ctypes.addressof(pointers)))
    return launchers

  def run(self, launchers: list, stream: int) -> None:
    for function, launch, params in launchers:
      self.check(self.driver.cuLaunchKernel(function, *launch.grid, *launch.block, launch.shared_bytes,
                                            self.driver.CUstream(stream), params, 0), f"cuLaunchKernel({launch.name})")


def logsumexp_rows(q, k, plan: AttentionBackwardPlan):
  """LSE (natural log, float32, (B, H, L)) of the scaled, masked scores, one batch entry at a time (memory)."""
  import torch
  rows = []
  for batch in range(plan.batch):
    keys = k[batch].float().repeat_interleave(plan.group, dim=0)
    scores = plan.scale * (q[batch].float() @ keys.transpose(-1, -2))
    if plan.causal:
      mask = torch.ones(plan.q_len, plan.kv_len, dtype=torch.bool, device=q.device).triu(1)
      scores = scores.masked_fill(mask, -math.inf)
    rows.append(torch.logsumexp(scores, -1))
  return torch.stack(rows).contiguous()


def relative_error(result, reference) -> float:
  return ((result.double() - reference.double()).abs().max() / reference.double().abs().max()).item()


def median_seconds(function, iters: int) -> float:
  """Median over 5 batches of back-to-back calls (after a warm-up batch) of the time per call; a batch is `iters`
  calls, fewer where one call is long (a batch of about 15 ms, at least 2 calls)."""
  import torch
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  start.record()
  function()
  end.record()
  end.synchronize()
  iters = max(2, min(iters, int(0.015 / max(start.elapsed_time(end) / 1e3, 1e-6))))
  times = []
  for batch in range(6):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters): function()
    end.record()
    end.synchronize()
    if batch: times.append(start.elapsed_time(end) / 1e3 / iters)
  return statistics.median(times)


def run_case(name: str, variants: dict[str, AttentionBackwardPlan], compiler, timed: bool, iters: int,
             against_float64: bool) -> None:
  """One shape: inputs and references made once, then each plan variant (same shape, other blocks or hints) checked
  and, if `timed`, timed beside torch."""
  import torch
  plan = next(iter(variants.values()))
  dtype = getattr(torch, TORCH_DTYPES[plan.dtype])
  generator = torch.Generator(device="cuda").manual_seed(0)
  q_shape = (plan.batch, plan.heads, plan.q_len, plan.head_dim)
  kv_shape = (plan.batch, plan.kv_heads, plan.kv_len, plan.head_dim)
  q, k, v = (torch.randn(shape, generator=generator, device="cuda", dtype=dtype).requires_grad_()
             for shape in (q_shape, kv_shape, kv_shape))
  grad_out = torch.randn(q_shape, generator=generator, device="cuda", dtype=dtype)
  gqa = plan.kv_heads != plan.heads
  out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=plan.causal, scale=plan.scale,
                                                         enable_gqa=gqa)
  lse = logsumexp_rows(q.detach(), k.detach(), plan)
  # torch's fused forward may return O as a transposed view ((B, L, H, D) memory): the kernels read it in place
  o_view = out.detach() if out.stride()[-1] == 1 else out.detach().contiguous()
  variants = {variant: dataclasses.replace(variant_plan, o_strides=tuple(o_view.stride()[:3]))
              for variant, variant_plan in variants.items()}
  # every variant's kernels compiled at once (NVRTC releases the GIL), a failed one reported at its turn
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)
  compiled = {variant: pool.submit(lambda chosen: [compile_with_report(launch.source, compiler.target(launch.source))
                                                    for launch in launches(chosen)], variant_plan)
              for variant, variant_plan in variants.items()}
  torch_grads = torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True)
  if against_float64:
    q64, k64, v64 = (tensor.detach().double().requires_grad_() for tensor in (q, k, v))
    out64 = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=plan.causal, scale=plan.scale,
                                                             enable_gqa=gqa)
    reference, label = torch.autograd.grad(out64, (q64, k64, v64), grad_out.double()), "f64"
    del q64, k64, v64, out64
    print(f"  {name}: torch vs f64 " + " ".join(f"{n}={relative_error(a, b):.1e}"
                                                for n, a, b in zip("qkv", torch_grads, reference)), flush=True)
  else:
    reference, label = torch_grads, "torch"
    print(f"  {name}:", flush=True)
  stream = torch.cuda.current_stream().cuda_stream
  flops = 10 * plan.batch * plan.heads * plan.q_len * plan.kv_len * plan.head_dim * (0.5 if plan.causal else 1)
  if timed:
    torch_seconds = median_seconds(lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True), iters)
    print(f"    torch fused backward {torch_seconds * 1e3:.3f} ms ({flops / torch_seconds / 1e12:.1f} TFLOP/s)",
          flush=True)
  for variant, variant_plan in variants.items():
    try:
      buffers = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "o": o_view, "do": grad_out, "lse": lse,
                 "dq": torch.zeros_like(q), "dk": torch.zeros_like(k), "dv": torch.zeros_like(v),
                 "delta": torch.zeros(plan.delta_elements, device="cuda", dtype=torch.float32)}
      kernels = Kernels(variant_plan, compiled[variant].result(), verbose=True)
      launchers = kernels.bind(buffers)
      kernels.run(launchers, stream)
      torch.cuda.synchronize()
      ours = (buffers["dq"], buffers["dk"], buffers["dv"])
      line = f"    [{variant}] ours vs {label} " + " ".join(f"{n}={relative_error(a, b):.1e}"
                                                         for n, a, b in zip("qkv", ours, reference))
      if timed:
        ours_seconds = median_seconds(lambda: kernels.run(launchers, stream), iters)
        single = [median_seconds(lambda launcher=launcher: kernels.run([launcher], stream), iters)
                  for launcher in launchers]
        line += (f" | ours {ours_seconds * 1e3:.3f} ms ({flops / ours_seconds / 1e12:.1f} TFLOP/s; dq+delta "
                 f"{single[0] * 1e3:.3f} ms, dkdv {single[1] * 1e3:.3f} ms) | torch/ours "
                 f"{torch_seconds / ours_seconds:.2f}")
      print(line, flush=True)
    except Exception:
      print(f"    [{variant}] FAILED\n{traceback.format_exc()}", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="only the small correctness cases")
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), action="append",
                      help="run these dtypes in this process (default: each in its own process, so that a kernel "
                           "fault, which poisons the CUDA context, only loses the rest of its dtype)")
  options = parser.parse_args()
  if not options.dtype:
    for dtype in ("float32", "bfloat16", "float16"):
      subprocess.run([sys.executable, __file__, "--dtype", dtype, "--iters", str(options.iters)]
                     + (["--quick"] if options.quick else []))
    return
  import torch
  from cuda.bindings import driver
  from ourgrad.runtime.ops_cuda import CUDACompiler
  torch.zeros(1, device="cuda")   # torch's primary context, current on this thread: the kernels load into it
  driver.cuInit(0)
  major, minor = torch.cuda.get_device_capability()
  compiler = CUDACompiler(f"sm_{major}{minor}")
  device = driver.cuDeviceGet(torch.cuda.current_device())[1]
  driver.cuCtxSetCurrent(driver.cuDevicePrimaryCtxRetain(device)[1])   # torch's context (the device's primary one)
  shared_per_sm = driver.cuDeviceGetAttribute(
    driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, device)[1]
  print(f"device: {torch.cuda.get_device_name()} sm_{major}{minor}, {shared_per_sm} B shared a multiprocessor; "
        f"torch {torch.__version__}", flush=True)
  checks = [  # batch, heads, kv_heads, q_len, kv_len, head_dim, causal
    (1, 2, 2, 64, 64, 64, False), (2, 4, 2, 300, 300, 64, True), (1, 4, 1, 257, 130, 64, False),
    (1, 2, 2, 130, 257, 128, True), (2, 3, 3, 200, 200, 128, False)]
  timings = [(4, 12, 12, 1024, 1024, 64, True), (4, 12, 12, 4096, 4096, 64, True), (8, 12, 12, 512, 512, 64, True)]
  for dtype in options.dtype:
    print(f"== {dtype}{' (TF32)' if dtype == 'float32' else ''}", flush=True)
    cases = [(case, False) for case in checks] + ([] if options.quick or dtype == "float16" else
                                                   [(case, True) for case in timings])
    for case, timed in cases:
      name = f"B={case[0]} H={case[1]} KVH={case[2]} L={case[3]} S={case[4]} D={case[5]} causal={case[6]}"
      try:
        plan = AttentionBackwardPlan.contiguous(*case[:6], dtype, case[6], shared_per_sm=shared_per_sm)
        variants = {"default": plan}
        if timed:   # the same shape with other blocks and without the occupancy hint
          variants["no hint"] = dataclasses.replace(plan, shared_per_sm=0)
          other_stream = 96 - plan.dkdv_stream   # 32 <-> 64
          variants[f"stream_q {other_stream}"] = dataclasses.replace(plan, stream_q=other_stream)
          variants["block_q 32"] = dataclasses.replace(plan, block_q=32)
          variants["block_kv 32"] = dataclasses.replace(plan, block_kv=32, stream_kv=64)
          variants["block_q 128"] = dataclasses.replace(plan, block_q=128)      # 8 warps a dQ block
          variants["block_kv 128"] = dataclasses.replace(plan, block_kv=128, stream_kv=64)   # 8 warps a dK/dV block
          variants["held toggled"] = dataclasses.replace(plan, dq_held=not plan.dq_held, dkdv_held=not plan.dkdv_held)
        run_case(name, variants, compiler, timed, options.iters, against_float64=not timed or case[3] <= 1024)
      except Exception:
        print(f"  {name}: FAILED\n{traceback.format_exc()}", flush=True)
      finally:
        torch.cuda.empty_cache()


if __name__ == "__main__":
  main()
