"""Sweep the flash-attention backward kernels' plan parameters on a CUDA GPU: each kernel timed alone per config.

For each case (causal, B x H x T x D, float32 as TF32 and bfloat16): q, k, v, dO are made with torch, O and LSE by
torch's own float32 attention, the default plan's dQ kernel writes delta once, then every config of each kernel
(codegen/attention_backward.py's plan fields: rows a block owns, rows of the streamed tiles, held A fragments,
the occupancy hint of __launch_bounds__) is compiled with NVRTC (all in parallel), launched on torch's stream and
timed alone: CUDA events around back-to-back launches, median of 5 batches (bench_attention_backward.median_seconds).
Each row prints the kernel's registers, spills, shared memory, the blocks a multiprocessor holds (by shared memory
and registers), ms, TFLOP/s (the kernel's products: dQ 3, dK/dV 4, each 2 B H L S D, halved when causal), and its
gradient's error relative to torch's backward in the same dtype (a broken config shows here; the single pass's
dK/dV kernel, plan.dq_accumulate, runs after its own delta kernel, timed together: 5 products, dQ checked too). A
last table gives,
per case and kernel, the default config's time and the fastest one's, for choosing `default_blocks`.

Run on the H200: `python extra/bench/sweep_attention_backward.py` (about a minute; `--cases 512` for one length,
`--dtype bfloat16` for one dtype, `--only wgmma` for the default and the wgmma configs).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import dataclasses
import re
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
sys.path.insert(0, str(Path(__file__).resolve().parent))      # bench_attention_backward.py, beside this script
from bench_attention_backward import compile_with_report, logsumexp_rows, median_seconds  # noqa: E402

from ourgrad.codegen.attention_backward import launches  # noqa: E402
from ourgrad.codegen.attention_backward_plan import (BLOCK_RESERVED_SHARED, DKDV_KERNEL, DQ_KERNEL,  # noqa: E402
                                                     REGISTERS_PER_SM, AttentionBackwardPlan, default_blocks)

CASES = {512: (8, 12, 12, 512, 512, 64), 1024: (4, 12, 12, 1024, 1024, 64), 4096: (4, 12, 12, 4096, 4096, 64)}
PRODUCTS = {DQ_KERNEL: 3, DKDV_KERNEL: 4}


def configs(plan: AttentionBackwardPlan, wgmma: bool) -> dict[str, dict[str, dict]]:
  """Per kernel, named plan overrides: the default, the owned and streamed tile sizes, held fragments, no hint; on
  mma.sync and (`wgmma`: sm_90, 16-bit) on wgmma (codegen/attention_backward_wgmma.py)."""
  dq = {f"block_q {owned} stream_kv {stream}{' held' if held else ''}": {"block_q": owned, "stream_kv": stream,
                                                                        "dq_held": held, "mma": "mma_sync"}
        for owned in (64, 128) for stream in (32, 64) for held in (False, True)}
  dkdv = {f"block_kv {owned} stream_q {stream}{' held' if held else ''}": {"block_kv": owned, "stream_q": stream,
                                                                          "dkdv_held": held, "mma": "mma_sync"}
          for owned in (64, 128) for stream in (32, 64) for held in (False, True)}
  if wgmma:
    dq.update({f"wgmma block_q 64 stream_kv {stream}{'' if held else ' unheld'}": {
      "block_q": 64, "stream_kv": stream, "dq_held": held, "mma": "wgmma"}
      for stream in (32, 64, 128) for held in (True, False)})
    dq.update({f"wgmma block_q 128 stream_kv {stream}": {"block_q": 128, "stream_kv": stream, "mma": "wgmma"}
               for stream in (32, 64)})
    dkdv.update({f"wgmma block_kv 64 stream_q {stream}{' held' if held else ''}": {
      "block_kv": 64, "stream_q": stream, "dkdv_held": held, "mma": "wgmma"}
      for stream in (32, 64, 128) for held in (False, True)})
    dkdv.update({f"wgmma block_kv 128 stream_q {stream}": {"block_kv": 128, "stream_q": stream, "mma": "wgmma"}
                 for stream in (32, 64)})
    dq["wgmma overlap"] = {"mma": "wgmma", "wgmma_overlap": True, "stream_kv": 32}
    # the single pass's first kernel in the dQ kernel's place: delta, dq_accum zeroed (no products, no dq)
    dq["wgmma single pass delta"] = {"mma": "wgmma", "dq_accumulate": True, "dkdv_held": False, "stream_q": 128}
    dkdv["wgmma overlap"] = {"mma": "wgmma", "wgmma_overlap": True, "stream_q": 64}
    dkdv["wgmma block_kv 64 stream_q 64 held"] = {"block_kv": 64, "stream_q": 64, "dkdv_held": True, "mma": "wgmma"}
    # the single pass: dQ added into a float32 buffer by the dK/dV kernel (5 products; the dQ kernel only for delta)
    dkdv.update({f"wgmma single pass block_kv {owned} stream_q {stream} red.v{width}": {
      "block_kv": owned, "stream_q": stream, "dkdv_held": False, "mma": "wgmma", "dq_accumulate": True,
      "dq_reduce_width": width} for owned, stream, width in ((64, 128, 4), (128, 128, 2), (128, 128, 4))})
    dkdv["wgmma single pass block_kv 128 stream_q 128 bulk"] = {
      "block_kv": 128, "stream_q": 128, "dkdv_held": False, "mma": "wgmma", "dq_accumulate": True,
      "dq_bulk_reduce": True}
    # the single pass warp-specialized: a producer warpgroup and mbarriers (codegen/attention_backward_producer.py)
    dkdv.update({f"wgmma single pass producer stages {stages}": {
      "block_kv": 128, "stream_q": 128, "dkdv_held": False, "mma": "wgmma", "dq_accumulate": True,
      "dq_reduce_width": 4, "warp_specialized": True, "ring_stages": stages} for stages in (2, 3)})
    dkdv.update({f"wgmma producer block_kv 128 stream_q 64 stages {stages}": {   # the two kernels' dK/dV
      "block_kv": 128, "stream_q": 64, "dkdv_held": False, "mma": "wgmma", "warp_specialized": True,
      "ring_stages": stages} for stages in (2, 3)})
    dkdv["wgmma single pass producer bulk"] = {   # dQ staged, added by the producer's writer thread
      "block_kv": 128, "stream_q": 128, "dkdv_held": False, "mma": "wgmma", "dq_accumulate": True,
      "warp_specialized": True, "dq_bulk_reduce": True}
  for table in (dq, dkdv):
    table["default no hint"] = {"shared_per_sm": 0}
    if wgmma: table["mma_sync default"] = {"mma": "mma_sync", **default_blocks(plan.head_dim, plan.dtype)}
  return {DQ_KERNEL: {"default": {}, **dq}, DKDV_KERNEL: {"default": {}, **dkdv}}


def resources(log: str) -> tuple[int, int]:
  """(registers, spilled bytes stored) from ptxas's report."""
  registers = re.search(r"Used (\d+) registers", log)
  spills = re.search(r"(\d+) bytes spill stores", log)
  return int(registers.group(1)) if registers else -1, int(spills.group(1)) if spills else -1


def relative_error(result, reference) -> float:
  return ((result.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


class LoadedKernel:
  """One kernel of a plan loaded from its CUBIN into the current context, bound to a set of buffers."""

  def __init__(self, launch, cubin: bytes, buffers: dict):
    from cuda.bindings import driver
    from ourgrad.runtime.ops_cuda import check, pointer_arguments
    self.launch, self.driver, self.check = launch, driver, check
    module = check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
    self.function = check(driver.cuModuleGetFunction(module, launch.name.encode()), "cuModuleGetFunction")
    attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    check(driver.cuFuncSetAttribute(self.function, attribute, launch.shared_bytes), "cuFuncSetAttribute")
    self.arguments, self.pointers = pointer_arguments([buffers[name].data_ptr() for name in launch.arguments])

  def run(self, stream: int) -> None:
    self.check(self.driver.cuLaunchKernel(self.function, *self.launch.grid, *self.launch.block,
                                          self.launch.shared_bytes, self.driver.CUstream(stream),
                                          ctypes.addressof(self.pointers), 0), f"cuLaunchKernel({self.launch.name})")


def run_case(length: int, dtype_name: str, compiler, shared_per_sm: int, pool, iters: int, has_wgmma: bool,
             only: list[str] | None) -> list[tuple]:
  """Every config of both kernels on one case (`only`: the default and those whose label holds one of these);
  returns (case, kernel, config, seconds) rows for the summary."""
  import torch
  batch, heads, kv_heads, q_len, kv_len, head_dim = CASES[length]
  base = AttentionBackwardPlan.contiguous(batch, heads, kv_heads, q_len, kv_len, head_dim, dtype_name, True,
                                          shared_per_sm=shared_per_sm).with_device_mma(has_wgmma)
  dtype = getattr(torch, dtype_name)
  generator = torch.Generator(device="cuda").manual_seed(0)
  q_shape, kv_shape = (batch, heads, q_len, head_dim), (batch, kv_heads, kv_len, head_dim)
  q, k, v = (torch.randn(shape, generator=generator, device="cuda", dtype=dtype).requires_grad_()
             for shape in (q_shape, kv_shape, kv_shape))
  grad_out = torch.randn(q_shape, generator=generator, device="cuda", dtype=dtype)
  out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=base.scale)
  reference = torch.autograd.grad(out, (q, k, v), grad_out)
  # torch's fused forward may return O as a transposed view ((B, L, H, D) memory): the kernels read it in place
  o_view = out.detach() if out.stride()[-1] == 1 else out.detach().contiguous()
  base = dataclasses.replace(base, o_strides=tuple(o_view.stride()[:3]))
  lse = logsumexp_rows(q.detach(), k.detach(), base)
  buffers = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "o": o_view, "do": grad_out, "lse": lse,
             "dq": torch.zeros_like(q), "dk": torch.zeros_like(k), "dv": torch.zeros_like(v),
             "delta": torch.zeros(base.delta_elements, device="cuda", dtype=torch.float32),
             "dq_accum": torch.zeros(q_shape, device="cuda", dtype=torch.float32),
             "dq_counts": torch.zeros(base.count_elements, device="cuda", dtype=torch.int32)}
  stream = torch.cuda.current_stream().cuda_stream
  name = f"{dtype_name} B={batch} H={heads} T={length} D={head_dim} causal"
  print(f"== {name}: default {base.mma} block_q {base.block_q} block_kv {base.block_kv} stream_q "
        f"{base.dkdv_stream} stream_kv {base.dq_stream}", flush=True)
  wgmma = has_wgmma and base.mma == "wgmma"
  plans = {(kernel, label): dataclasses.replace(base, **override)
           for kernel, table in configs(base, wgmma).items() for label, override in table.items()
           if only is None or label == "default" or any(part in label for part in only)}

  def compile_one(plan: AttentionBackwardPlan, kernel: str):
    launch = next(launch for launch in launches(plan) if launch.name == kernel)
    return launch, *compile_with_report(launch.source, compiler.target(launch.source))

  # every config's kernel compiled in parallel (NVRTC releases the GIL), a failed one reported at its turn
  compiled = {key: pool.submit(compile_one, plan, key[0]) for key, plan in plans.items()}
  # a single-pass dK/dV kernel runs and is timed after its own delta kernel (which zeroes its sums and counts)
  deltas = {key: pool.submit(compile_one, plan, DQ_KERNEL) for key, plan in plans.items()
            if key[0] == DKDV_KERNEL and plan.dq_accumulate}
  rows = []
  for (kernel, label), plan in plans.items():
    try:
      if kernel == DKDV_KERNEL and label == "default":   # delta from the default dQ kernel, for every dK/dV config
        launch, cubin, _ = compiled[(DQ_KERNEL, "default")].result()
        LoadedKernel(launch, cubin, buffers).run(stream)
      launch, cubin, log = compiled[(kernel, label)].result()
      for gradient in ("dq", "dk", "dv"): buffers[gradient].zero_()
      loaded = LoadedKernel(launch, cubin, buffers)
      runners = [loaded]
      if (kernel, label) in deltas: runners.insert(0, LoadedKernel(*deltas[(kernel, label)].result()[:2], buffers))
      def run() -> None:
        for runner in runners: runner.run(stream)
      run()
      torch.cuda.synchronize()
      errors = ([relative_error(buffers["dq"], reference[0])] if kernel == DQ_KERNEL else
                [relative_error(buffers["dk"], reference[1]), relative_error(buffers["dv"], reference[2])])
      if plan.dq_accumulate:   # the single pass (with its delta kernel): dK, dV, dQ; its delta kernel alone: none
        errors = [] if kernel == DQ_KERNEL else [*errors, relative_error(buffers["dq"], reference[0])]
      seconds = median_seconds(run, iters)
      registers, spills = resources(log)
      resident = min(shared_per_sm // (launch.shared_bytes + BLOCK_RESERVED_SHARED),
                     REGISTERS_PER_SM // (launch.block[0] * max(registers, 1)))
      products = (0 if kernel == DQ_KERNEL else PRODUCTS[kernel] + 1) if plan.dq_accumulate else PRODUCTS[kernel]
      flops = products * 2 * batch * heads * q_len * kv_len * head_dim / 2
      print(f"  {kernel.replace('attention_backward_', ''):5s} {label:32s} regs {registers:3d} spill {spills:4d} "
            f"smem {launch.shared_bytes:6d} blocks/SM {resident} | {seconds * 1e3:7.3f} ms "
            f"{flops / seconds / 1e12:6.1f} TFLOP/s | err vs torch " + (" ".join(f"{e:.1e}" for e in errors) or "-"),
            flush=True)
      rows.append((name, kernel, label, seconds))
    except Exception:
      print(f"  {kernel} {label}: FAILED\n{traceback.format_exc()}", flush=True)
  return rows


def summary(rows: list[tuple]) -> None:
  print("\n== summary: per case and kernel, the default config and the fastest", flush=True)
  for case in dict.fromkeys(row[0] for row in rows):
    for kernel in (DQ_KERNEL, DKDV_KERNEL):
      mine = [row for row in rows if row[0] == case and row[1] == kernel]
      if not mine: continue
      default = next((row[3] for row in mine if row[2] == "default"), float("nan"))
      best = min(mine, key=lambda row: row[3])
      print(f"  {case:42s} {kernel.replace('attention_backward_', ''):5s} default {default * 1e3:7.3f} ms | "
            f"fastest {best[3] * 1e3:7.3f} ms [{best[2]}] ({default / best[3]:.2f}x)", flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--cases", type=int, nargs="*", default=list(CASES), choices=list(CASES),
                      help="sequence lengths to run")
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), action="append")
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--only", nargs="+", help="run the default config and those whose label holds one of these "
                      "(e.g. wgmma mma_sync)")
  options = parser.parse_args()
  import torch
  from cuda.bindings import driver
  from ourgrad.runtime.ops_cuda import CUDACompiler
  torch.zeros(1, device="cuda")   # torch's primary context: the kernels load into it
  driver.cuInit(0)
  major, minor = torch.cuda.get_device_capability()
  compiler = CUDACompiler(f"sm_{major}{minor}")
  device = driver.cuDeviceGet(torch.cuda.current_device())[1]
  driver.cuCtxSetCurrent(driver.cuDevicePrimaryCtxRetain(device)[1])
  shared_per_sm = driver.cuDeviceGetAttribute(
    driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, device)[1]
  print(f"device: {torch.cuda.get_device_name()} sm_{major}{minor}, {shared_per_sm} B shared a multiprocessor; "
        f"torch {torch.__version__}", flush=True)
  rows: list[tuple] = []
  with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
    for dtype in options.dtype or ("float32", "bfloat16"):
      for length in options.cases:
        try:
          rows += run_case(length, dtype, compiler, shared_per_sm, pool, options.iters, major == 9, options.only)
        except Exception:
          print(f"  {dtype} T={length}: FAILED\n{traceback.format_exc()}", flush=True)
        finally:
          torch.cuda.empty_cache()
  summary(rows)


if __name__ == "__main__":
  main()
