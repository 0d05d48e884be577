"""GPT-2 training-step benchmark: PyTorch eager, torch.compile, ourgrad TinyJit and ourgrad eager on the same model
(extra/models/gpt2.py: GPT-2 small as nanoGPT writes it, float32 weights, AdamW(6e-4, wd 0.1, betas (0.9, 0.95))),
all starting from the same weights (torch's initialization copied into ourgrad through numpy), over a depth sweep,
then the per-kernel table of one ourgrad step.

Method: a step is forward, cross-entropy over the vocabulary, backward and the AdamW update on one fixed batch of
random tokens. 'warm-up s' is the wall time of the first --warmup steps (3; compiles and captures included); then
--steps steps (at most 3 for ourgrad eager, which schedules every step anew) are each timed on the host clock
between two device synchronizations and 'ms/step' is their median.
tokens/s = batch * sequence / step. TFLOP/s counts 6 * weights * tokens (the weights without the position table; the
tied embedding counted once, as the logits' matmul) + 12 * layers * sequence^2 * width * batch (attention scores and
their weighted sum over the full T x T square, forward and backward), divided by the step time (nanoGPT's
estimate_mfu count). 'peak MB' is torch.cuda.max_memory_allocated for torch rows on CUDA, and for ourgrad rows the
largest GlobalCounters.mem_used seen at a buffer allocation during the row (buffers alive, not the allocator's cache).
'kernels', 'GFLOP' and 'GB' are ourgrad's own counts per step (kernels launched, their UOps' arithmetic, the bytes
they read and write: what grows linearly with depth when the schedule does). 'first loss' is each row's first-step
loss: the ourgrad rows must agree with PyTorch eager's (same weights, same batch; 1e-4 relative in float32, 2e-3
with TF32 matmuls), otherwise the script says MISMATCH and exits with 1.

The per-kernel table (--table-layers, default the config's depth; 0: none): every kernel of one replayed TinyJit
step, its in-step time (launched one by one, each timed with device events as at DEBUG=2) and its cold time
(timing.cold_kernel_seconds: scratch buffers beyond twice the L2, many launches in one CUDA graph; back to back on
the CPU), GB/s, %copy (of the large-copy bandwidth, kernel_table.CopyReference), TFLOP/s, what it computes
(kernel_table.KernelKinds: outputs x values per output) and its role in the step (GPT2Roles), then the check line of
issue 24's few-output reduces (few_output_check: each bias or LayerNorm gradient kernel's cold time against an ourgrad
copy moving the same bytes timed the same way, >= 70% or <= 5 us) and the totals per role.

Run (the defaults on CUDA are GPT-2 small, batch 8 x 512, TF32 matmuls allowed, all four rows at 12 layers):
  python extra/bench/bench_gpt2.py                                  # headline rows + the kernel table
  python extra/bench/bench_gpt2.py --layers 1,2,4,8,12 --sweep-rows torch,jit --table-layers 0   # depth sweep
  python extra/bench/bench_gpt2.py --config 16,1024,768,12,12,50304 --rows torch,compile,jit --table-layers 0
  python extra/bench/bench_gpt2.py --layers 1,2,4,8,12 --rows jit --table-layers 0 --realize-residual   # the
      # residual stream stored by the model (GPT2Config.realize_residual), against the scheduler's own rule
  python extra/bench/bench_gpt2.py --device CLANG                   # a tiny config in seconds (CI smoke)
  python extra/bench/bench_gpt2.py --config 16,1024,768,12,12,50304 --autocast bf16 --rows torch,compile,jit \
      --table-layers 0                                              # the bf16 autocast row (float32 master weights)
--config batch,seq,width,heads,layers,vocab; --out NAME writes what is printed to extra/bench/results/NAME.
On CPU devices the script sets OMP_WAIT_POLICY=passive unless it is set (see main()).
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's ourgrad and extra/
sys.path.insert(0, str(Path(__file__).resolve().parent))   # timing.py and kernel_table.py, beside this script
from ourgrad import Device, Tensor, TinyJit, dtypes, set_float32_matmul_precision  # noqa: E402
from ourgrad.helpers import GlobalCounters  # noqa: E402
from extra.models.gpt2 import (GPT2, GPT2Config, configure_optimizers, make_torch_gpt2,  # noqa: E402
                               torch_optimizer, training_flops, training_step)
from kernel_table import CopyReference, KernelKinds  # noqa: E402
from timing import cold_kernel_seconds, synchronized_median_seconds  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROWS = {"torch": "PyTorch eager", "compile": "torch.compile", "jit": "ourgrad TinyJit", "eager": "ourgrad eager"}
GPU_CONFIG = "8,512,768,12,12,50304"   # GPT-2 small, batch 8 x 512
EAGER_STEPS = 3   # at most this many timed steps for ourgrad eager (each schedules the whole graph again)
CPU_CONFIG = "2,32,48,2,2,256"         # a few seconds on a CPU device (tokens, width and vocabulary all differ)
AUTOCAST = {"bf16": dtypes.bfloat16, "fp16": dtypes.float16}   # --autocast: the forward's low dtype


@dataclass(frozen=True)
class BenchConfig:
  batch: int
  sequence: int
  model: GPT2Config

  @staticmethod
  def parse(text: str) -> "BenchConfig":
    """'batch,seq,width,heads,layers,vocab' (block size = seq)."""
    batch, sequence, width, heads, layers, vocab = (int(part) for part in text.split(","))
    return BenchConfig(batch, sequence, GPT2Config(n_layer=layers, n_head=heads, n_embd=width, vocab_size=vocab,
                                                   block_size=sequence))

  def with_layers(self, layers: int) -> "BenchConfig": return replace(self, model=replace(self.model, n_layer=layers))

  def describe(self) -> str:
    model = self.model
    return (f"batch {self.batch} x {self.sequence}, width {model.n_embd}, {model.n_head} heads, {model.n_layer} "
            f"layers, vocabulary {model.vocab_size}, {model.parameter_count() / 1e6:.1f}M parameters")


@dataclass
class RowResult:
  row: str
  layers: int
  step_seconds: float
  warmup_seconds: float
  peak_bytes: int | None
  first_loss: float
  kernels: int | None = None
  counted_ops: int | None = None     # ourgrad's own count of one step's arithmetic (its kernels' UOps)
  counted_bytes: int | None = None   # and of the bytes its kernels read and write


class Report:
  """Lines printed as they come and kept for --out."""

  def __init__(self) -> None: self.lines: list[str] = []

  def __call__(self, line: str = "") -> None:
    print(line, flush=True)
    self.lines.append(line)

  def write(self, name: str, quiet: bool = False) -> None:
    path = Path(name) if "/" in name else RESULTS / name
    path.write_text("\n".join(self.lines) + "\n")
    if not quiet: print(f"wrote {path}")


# ---------------------------------------------------------------- one row

def timed_steps(step: Callable[[], float], synchronize: Callable[[], None], warmup: int,
                steps: int) -> tuple[float, float, float]:
  """(first step's loss, seconds of the first `warmup` steps together, median seconds of `steps` later steps, each
  timed between two synchronizations)."""
  synchronize()
  began = time.perf_counter()
  first_loss = step()
  for _ in range(warmup - 1): step()
  synchronize()
  warmup_seconds = time.perf_counter() - began
  return first_loss, warmup_seconds, synchronized_median_seconds(step, synchronize, steps)


@contextmanager
def ourgrad_peak_memory() -> Iterator[list[int]]:
  """[peak]: the largest GlobalCounters.mem_used (bytes in live ourgrad buffers) seen after any buffer allocation in
  the block. ourgrad keeps no peak of its own; Buffer.allocate is where the count grows."""
  from ourgrad.device import Buffer
  peak = [GlobalCounters.mem_used]
  original = Buffer.allocate

  def allocate(self: Buffer) -> Buffer:
    result = original(self)
    if GlobalCounters.mem_used > peak[0]: peak[0] = GlobalCounters.mem_used
    return result
  Buffer.allocate = allocate  # type: ignore[method-assign]
  try:
    yield peak
  finally:
    Buffer.allocate = original  # type: ignore[method-assign]


def ourgrad_model(config: BenchConfig, weights: dict[str, np.ndarray], device: str) -> GPT2:
  model = GPT2(config.model)
  for name, param in model.named_parameters():
    param.assign(Tensor(weights[name], device=device)).realize()
  return model


def ourgrad_step(model: GPT2, autocast: str | None) -> Callable[[Tensor, Tensor], Tensor]:
  """One training step of `model` (loss, backward, both AdamW groups), realized in one schedule; the forward under
  ourgrad.autocast when `autocast` names a low dtype."""
  return training_step(model, configure_optimizers(model), AUTOCAST[autocast] if autocast else None)


def run_ourgrad(row: str, config: BenchConfig, weights: dict[str, np.ndarray], batch: np.ndarray, device: str,
                args: argparse.Namespace) -> tuple[RowResult, Any]:
  """The TinyJit ('jit') or eager row; also returns the jitted step (for the kernel table) or None."""
  tokens = Tensor(batch[:, :-1].copy(), device=device).realize()
  targets = Tensor(batch[:, 1:].copy(), device=device).realize()
  synchronize = Device[device].synchronize
  with ourgrad_peak_memory() as peak:
    model = ourgrad_model(config, weights, device)
    step = ourgrad_step(model, args.autocast)
    if row == "jit": step = TinyJit(step)
    GlobalCounters.reset()
    steps = args.steps if row == "jit" else min(args.steps, EAGER_STEPS)
    first, warmup, seconds = timed_steps(lambda: step(tokens, targets).item(), synchronize, args.warmup, steps)
  if row == "jit" and step.captured is not None:
    runners = [item.runner for item in step.captured.items]
    kernels, ops, moved = len(runners), sum(r.op_count for r in runners), sum(r.byte_count for r in runners)
  else:
    taken = args.warmup + steps
    kernels, ops, moved = (GlobalCounters.kernel_count // taken, GlobalCounters.global_ops // taken,
                           GlobalCounters.global_mem // taken)
  result = RowResult(row, config.model.n_layer, seconds, warmup, peak[0], first, kernels, ops, moved)
  return result, (step if row == "jit" else None)


def run_torch(row: str, config: BenchConfig, weights: dict[str, np.ndarray], batch: np.ndarray, torch_device: str,
              args: argparse.Namespace) -> RowResult:
  """The PyTorch eager ('torch') or torch.compile ('compile': the model compiled, the fused AdamW eager, as in
  nanoGPT) row."""
  import torch
  cuda = torch_device == "cuda"
  model = make_torch_gpt2(config.model).to(torch_device)
  with torch.no_grad():
    for name, param in model.named_parameters(): param.copy_(torch.from_numpy(weights[name]))
  optimizer = torch_optimizer(model)
  forward = torch.compile(model) if row == "compile" else model
  tokens = torch.from_numpy(batch[:, :-1].astype(np.int64)).to(torch_device)
  targets = torch.from_numpy(batch[:, 1:].astype(np.int64)).to(torch_device)

  low_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.autocast)

  def step() -> float:
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(torch_device, dtype=low_dtype or torch.bfloat16, enabled=low_dtype is not None):
      loss = forward(tokens, targets)[1]
    loss.backward()
    optimizer.step()
    return loss.item()
  synchronize = torch.cuda.synchronize if cuda else (lambda: None)
  if cuda: torch.cuda.reset_peak_memory_stats()
  first, warmup, seconds = timed_steps(step, synchronize, args.warmup, args.steps)
  peak = torch.cuda.max_memory_allocated() if cuda else None
  return RowResult(row, config.model.n_layer, seconds, warmup, peak, first)


def initial_weights(config: BenchConfig) -> dict[str, np.ndarray]:
  """GPT-2's initialization drawn by torch (seed 0), as numpy arrays by parameter name."""
  model = make_torch_gpt2(config.model)
  return {name: param.detach().numpy().copy() for name, param in model.named_parameters()}


def loss_tolerance(tf32: bool, cuda: bool, autocast: str | None = None) -> float:
  """Relative difference allowed between two rows' first-step losses: TF32 rounds matmul inputs to 10 bits; under
  autocast every matmul output is rounded to 8 (bf16) or 11 (fp16) bits, and torch's CPU autocast also keeps
  layer norms and softmax in the low type where ourgrad (as torch on CUDA) runs them in float32."""
  if autocast is not None: return 1e-2 if autocast == "bf16" else 5e-3
  return 2e-3 if tf32 and cuda else 1e-4


# ---------------------------------------------------------------- tables

def print_rows(report: Report, config: BenchConfig, results: list[RowResult]) -> None:
  report("| row | layers | ms/step | tokens/s | TFLOP/s | warm-up s | peak MB | kernels | GFLOP | GB | first loss |")
  report("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
  tokens = config.batch * config.sequence
  for result in results:
    flops = training_flops(config.with_layers(result.layers).model, config.batch, config.sequence)
    peak = f"{result.peak_bytes / 1e6:.0f}" if result.peak_bytes is not None else "-"
    kernels = str(result.kernels) if result.kernels is not None else "-"
    counted_ops = f"{result.counted_ops / 1e9:.4g}" if result.counted_ops is not None else "-"
    counted_bytes = f"{result.counted_bytes / 1e9:.4g}" if result.counted_bytes is not None else "-"
    report(f"| {ROWS[result.row]} | {result.layers} | {result.step_seconds * 1e3:.2f} | "
           f"{tokens / result.step_seconds:,.0f} | {flops / result.step_seconds / 1e12:.3f} | "
           f"{result.warmup_seconds:.1f} | {peak} | {kernels} | {counted_ops} | {counted_bytes} | "
           f"{result.first_loss:.6f} |")


def print_sweep(report: Report, results: list[RowResult]) -> None:
  """Per row: time at each depth and the issue's linearity check time(L) - time(1) vs (L - 1) x (time(2) - time(1))."""
  for row in ROWS:
    by_depth = {result.layers: result.step_seconds for result in results if result.row == row}
    if len(by_depth) < 3 or 1 not in by_depth or 2 not in by_depth: continue
    per_layer = by_depth[2] - by_depth[1]
    parts = []
    for layers, seconds in sorted(by_depth.items()):
      if layers <= 2: continue
      ratio = (seconds - by_depth[1]) / per_layer if per_layer > 0 else float("nan")
      parts.append(f"{layers}: {ratio:.1f} (linear {layers - 1})")
    report(f"{ROWS[row]}: (time(L) - time(1)) / (time(2) - time(1)) = " + ", ".join(parts))


def check_losses(report: Report, results: list[RowResult], tolerance: float) -> bool:
  """Each ourgrad row's first loss against the PyTorch eager row of the same depth."""
  agree = True
  for result in results:
    reference = next((other for other in results if other.row == "torch" and other.layers == result.layers), None)
    if reference is None or result.row == "torch": continue
    difference = abs(result.first_loss - reference.first_loss) / max(abs(reference.first_loss), 1e-12)
    verdict = "ok" if difference <= tolerance else "MISMATCH"
    agree &= difference <= tolerance
    report(f"first-step loss, {ROWS[result.row]} vs PyTorch eager, {result.layers} layers: {result.first_loss:.6f} vs "
           f"{reference.first_loss:.6f}, relative difference {difference:.2e} (tolerance {tolerance:.0e}): {verdict}")
  return agree


# ---------------------------------------------------------------- the per-kernel table

class GPT2Roles:
  """The role of a kernel in a GPT-2 training step, read off its kind (outputs x values per output) and the model's
  sizes: N = batch x sequence tokens, C width, V vocabulary, H heads, T sequence. A matmul-shaped kernel before the
  logits' forward matmul (N*V outputs over C) is forward, after it backward (each gradient depends on the logits)."""

  def __init__(self, config: BenchConfig):
    model = config.model
    self.tokens, self.width, self.vocab = config.batch * config.sequence, model.n_embd, model.vocab_size
    self.sequence, self.head_dim = config.sequence, model.head_dim
    self.attention_rows = config.batch * model.n_head * config.sequence
    self._wte_seen = 0   # wte's weight-gradient kernels met so far (role() is asked in launch order)

  def forward_flags(self, kinds: list[tuple[str, int, int]]) -> list[bool]:
    logits = [index for index, (label, outputs, values) in enumerate(kinds)
              if outputs == self.tokens * self.vocab and values == self.width]
    last = logits[0] if logits else -1
    return [index <= last for index in range(len(kinds))]

  def role(self, kind: tuple[str, int, int], forward: bool) -> str:
    label, outputs, values = kind
    direction = "forward" if forward else "backward"
    if label == "packed": return "optimizer (packed)"
    if label == "indexed":   # an embedding gradient: token rows added into the table (codegen/index_accumulate.py)
      return "wte embedding backward (indexed)" if outputs == self.vocab * self.width else "wpe embedding backward"
    if label == "elementwise": return f"elementwise ({direction})"
    if not label: return ""
    n, c, v = self.tokens, self.width, self.vocab
    matmuls = {(n * 3 * c, c): "attn.c_attn forward", (n * c, 3 * c): "attn.c_attn input gradient",
               (n * 4 * c, c): "mlp.c_fc forward" if forward else "mlp.c_proj input gradient",
               (n * c, 4 * c): "mlp.c_proj forward" if forward else "mlp.c_fc input gradient",
               (n * c, c): "attn.c_proj forward" if forward else "attn.c_proj input gradient",
               (n * v, c): "logits forward (x @ wte.T)", (n * c, v): "logits input gradient"}
    if (outputs, values) in matmuls: return matmuls[(outputs, values)]
    weight_role = self._weight_gradient(outputs, values)
    if weight_role: return weight_role
    if outputs == self.attention_rows * self.sequence and values == self.head_dim:
      return f"attention scores ({direction})"
    if outputs == self.attention_rows * self.head_dim and values == self.sequence:
      return f"attention weighted sum ({direction})"
    if outputs == self.attention_rows: return f"attention softmax rows ({direction})"
    if outputs == n and values == v: return f"cross-entropy rows over the vocabulary ({direction})"
    if outputs == n and values in (c, 4 * c): return f"LayerNorm rows ({direction})"
    # a reduce over one value per output (an axis of size 1 the scheduler kept) is elementwise work
    if values == 1: return f"elementwise ({direction})"
    # wpe's gradient: the embedding's input gradient summed over the batch, (sequence x width) outputs of `batch`
    # values each: many outputs, no few-output reduce (it computes that gradient on the way, from the first block)
    if outputs == self.sequence * c and values == n // self.sequence: return "wpe gradient (a sum over the batch)"
    for features in (c, 3 * c, 4 * c):   # a sum over the tokens per feature: split into parts, then a second stage
      if outputs % features == 0 and outputs * values == n * features:
        parts = outputs // features
        return "bias / LayerNorm gradient" + (f" partials ({parts} parts)" if parts > 1 else "")
      if outputs == features: return "bias / LayerNorm gradient second stage"
    return f"{label} ({direction})"

  def _weight_gradient(self, outputs: int, values: int) -> str:
    """A weight gradient (a sum over the N tokens per weight), possibly split into parts with a second stage. wte
    gets two: the logits' (first in the step) and the embedding's backward (the last gradient computed)."""
    n, c, v = self.tokens, self.width, self.vocab
    for size, name in ((3 * c * c, "attn.c_attn"), (c * c, "attn.c_proj"), (4 * c * c, "mlp.c_fc/c_proj"),
                       (v * c, "wte")):
      if outputs % size == 0 and outputs // size * values == n:
        parts = outputs // size
        if name == "wte":
          name = "wte (from the logits)" if not self._wte_seen else "wte (embedding backward)"
          self._wte_seen += 1
        return f"{name} weight gradient" + (f" partials ({parts} parts)" if parts > 1 else "")
      if outputs == size and values < n: return f"{name} weight gradient second stage"
    return ""


# issue 24's goal for each few-output reduce of the step: this share of the copy bandwidth, or at most this long
FEW_OUTPUT_COPY_SHARE = 0.70
FEW_OUTPUT_SECONDS = 5e-6


def few_output_check(report: Report, reference: CopyReference, rows: list[tuple[Any, float, str]]) -> bool:
  """The check line of the few-output reduces (bias and LayerNorm gradients: their partial sums and second stages),
  each launch of `rows` (runner, cold seconds, role): it meets the goal where its cold time is at most
  FEW_OUTPUT_SECONDS or its GB/s at least FEW_OUTPUT_COPY_SHARE of the ourgrad copy kernel that moves the same bytes
  (rounded up to a power of two), timed the same way (CopyReference.same). Cold, not in-step: the in-step column
  times each launch between two events, which adds their cost to every kernel (the 12-layer step's in-step sum
  exceeded its measured step by 6 ms, ~10 us a kernel); the cold sum matched the step. The same-bytes copy, not the
  2 x 256 MB one: a kernel of 12-25 MB read from DRAM pays a launch and a ramp that a copy of its size pays too.
  Prints the line, the kernels that miss, and wpe's gradient (many outputs: not in the count). Returns whether all
  meet it."""
  few = [(runner, seconds, role) for runner, seconds, role in rows if role.startswith("bias / LayerNorm gradient")]
  misses: dict[str, list] = {}
  for runner, seconds, role in few:
    share = runner.byte_count / max(seconds, 1e-12) / reference.same(runner.byte_count)
    if seconds > FEW_OUTPUT_SECONDS and share < FEW_OUTPUT_COPY_SHARE:
      misses.setdefault(runner.name + " " + role, []).append((runner, seconds, share))
  missed = sum(len(launches) for launches in misses.values())
  report(f"\nfew-output reduces: {len(few) - missed} of {len(few)} meet >= {FEW_OUTPUT_COPY_SHARE:.0%} of copy or "
         f"<= {FEW_OUTPUT_SECONDS * 1e6:.0f} us (cold; copy = an ourgrad copy kernel moving the same bytes, timed "
         f"the same way){'' if missed else ': met'}")
  for name, launches in sorted(misses.items(), key=lambda entry: -len(entry[1])):
    runner, seconds, share = launches[0]
    report(f"  misses: {len(launches)} x {name}: {seconds * 1e6:.1f} us, {runner.byte_count / 1e6:.2f} MB, "
           f"{share:.0%} of the same-bytes copy, {runner.byte_count / seconds / reference.peak:.0%} of the large copy")
  for runner, seconds, role in rows:
    if role.startswith("wpe gradient"):
      share = runner.byte_count / max(seconds, 1e-12) / reference.same(runner.byte_count)
      report(f"  not counted: {runner.name} {role}: {seconds * 1e6:.1f} us, {runner.byte_count / 1e6:.2f} MB, "
             f"{share:.0%} of the same-bytes copy")
  return not missed


def kernel_table(report: Report, config: BenchConfig, step: TinyJit, device: str) -> None:
  """Per-kernel table of one replayed TinyJit step (see the module docstring)."""
  items = step.captured.items
  in_step = [item.run(wait=True) for item in items]   # one step, each launch timed with device events
  Device[device].synchronize()
  kinds = KernelKinds(device)
  kinds.update()
  step_kinds = [kinds.get(item.runner) for item in items]
  roles = GPT2Roles(config)
  forward = roles.forward_flags(step_kinds)
  cuda = device.upper().startswith("CUDA")
  reference = CopyReference(device, 1 << 26 if cuda else 1 << 20)
  report(f"copy bandwidth (%copy divides by it): {reference.peak / 1e9:.0f} GB/s, the faster of an ourgrad copy "
         f"kernel timed like the kernels and torch's copy_ (on CUDA)")
  cold: dict[tuple, float] = {}
  rows = []
  for item, event, kind, is_forward in zip(items, in_step, step_kinds, forward):
    runner = item.runner
    key = (id(runner), tuple((buffer.size, buffer.dtype) for buffer in item.bufs))
    if key not in cold: cold[key] = cold_kernel_seconds(item, own_buffers_when_large=True).seconds
    rows.append((runner, cold[key], event or 0.0, KernelKinds.describe(kind), roles.role(kind, is_forward)))
  total_cold, total_event = sum(row[1] for row in rows), sum(row[2] for row in rows)
  report(f"{len(rows)} kernels ({len(cold)} distinct): cold sum {total_cold * 1e3:.3f} ms, in-step sum "
         f"{total_event * 1e3:.3f} ms")
  report(f"{'kernel':<34} {'cold ms':>8} {'step ms':>8} {'MB':>8} {'GB/s':>7} {'%copy':>6} {'TFLOP/s':>8}  "
         f"{'kind':<24} role")
  for runner, seconds, event, kind, role in sorted(rows, key=lambda row: -row[1]):
    gbs = runner.byte_count / max(seconds, 1e-12)
    report(f"{runner.name:<34} {seconds * 1e3:8.3f} {event * 1e3:8.3f} {runner.byte_count / 1e6:8.2f} "
           f"{gbs / 1e9:7.0f} {gbs / reference.peak * 100:5.1f}% {runner.op_count / max(seconds, 1e-12) / 1e12:8.3f}  "
           f"{kind:<24} {role}")
  few_output_check(report, reference, [(row[0], row[1], row[4]) for row in rows])
  groups: dict[str, list[tuple]] = {}
  for row in rows: groups.setdefault(row[4] or row[3] or row[0].name, []).append(row)
  report(f"\nper role (kernels together)\n{'role':<50} {'kernels':>7} {'cold ms':>8} {'step ms':>8} {'GB/s':>7} "
         f"{'%copy':>6}")
  for role, members in sorted(groups.items(), key=lambda entry: -sum(row[1] for row in entry[1])):
    seconds, event = sum(row[1] for row in members), sum(row[2] for row in members)
    moved = sum(row[0].byte_count for row in members)
    gbs = moved / max(seconds, 1e-12)
    report(f"{role:<50} {len(members):7d} {seconds * 1e3:8.3f} {event * 1e3:8.3f} {gbs / 1e9:7.0f} "
           f"{gbs / reference.peak * 100:5.1f}%")


# ---------------------------------------------------------------- main

def torch_device_for(device: str) -> str:
  """PyTorch's device beside ourgrad's: CUDA when ourgrad runs on CUDA and torch sees a GPU, else the CPU."""
  import torch
  return "cuda" if device.upper().startswith("CUDA") and torch.cuda.is_available() else "cpu"


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default=None, help="ourgrad device (default: ourgrad's default device)")
  parser.add_argument("--config", help=f"batch,seq,width,heads,layers,vocab (default {GPU_CONFIG} on CUDA, "
                                       f"{CPU_CONFIG} elsewhere)")
  parser.add_argument("--layers", help="depths to run, e.g. 1,2,4,8,12 (default: the config's)")
  parser.add_argument("--rows", default=None, help="rows at the config's depth: any of torch,compile,jit,eager "
                                                   "(default all four on CUDA, torch,jit,eager elsewhere)")
  parser.add_argument("--sweep-rows", default=None, help="rows at the other depths of --layers (default: --rows)")
  parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10 on CUDA, 3 elsewhere)")
  parser.add_argument("--warmup", type=int, default=3, help="steps before timing (their time is 'warm-up s')")
  parser.add_argument("--no-tf32", action="store_true", help="full float32 matmuls (TF32 is allowed by default)")
  parser.add_argument("--table-layers", type=int, default=None,
                      help="depth whose jitted step gets the per-kernel table (default: the config's; 0: none)")
  parser.add_argument("--realize-residual", action="store_true",
                      help="ourgrad's model stores the residual stream at each block input (GPT2Config.realize_residual"
                           ": the workaround for its recomputation in every later kernel)")
  parser.add_argument("--autocast", choices=sorted(AUTOCAST), default=None,
                      help="run the forward under autocast (ourgrad.autocast / torch.autocast) in this low dtype, "
                           "float32 master weights; fp16 runs without a GradScaler on both sides (static steps)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", help="also write what is printed to extra/bench/results/OUT (or to OUT with a '/')")
  args = parser.parse_args()
  args.device = (args.device or Device.DEFAULT).upper()
  cuda = args.device.startswith("CUDA")
  args.config = BenchConfig.parse(args.config or (GPU_CONFIG if cuda else CPU_CONFIG))
  if args.realize_residual: args.config = replace(args.config, model=replace(args.config.model, realize_residual=True))
  args.layers = [int(part) for part in args.layers.split(",")] if args.layers else [args.config.model.n_layer]
  args.rows = (args.rows or ("torch,compile,jit,eager" if cuda else "torch,jit,eager")).split(",")
  args.sweep_rows = args.sweep_rows.split(",") if args.sweep_rows else args.rows
  for row in args.rows + args.sweep_rows:
    if row not in ROWS: parser.error(f"unknown row {row!r}: choose from {','.join(ROWS)}")
  if args.steps is None: args.steps = 10 if cuda else 3
  if args.table_layers is None: args.table_layers = args.config.model.n_layer
  return args


def main() -> int:
  args = parse_args()
  os.environ["DEVICE"] = args.device   # the models and optimizer state are made on the default device
  if not args.device.startswith("CUDA"):
    # before OpenMP loads (torch's import, or the first CLANG kernel): with torch's libgomp in the process, idle
    # OpenMP threads spinning made ourgrad's jitted CPU step 7x slower on the shared 2-core machine (0.36 -> 2.5 s)
    # and torch's own step 6x slower (0.38 -> 2.2 s); passive waiting restored both
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
  import torch
  torch_device = torch_device_for(args.device)
  tf32 = not args.no_tf32
  set_float32_matmul_precision("high" if tf32 else "highest")
  torch.backends.cuda.matmul.allow_tf32 = tf32
  torch.backends.cudnn.allow_tf32 = tf32
  report = Report()
  device_name = torch.cuda.get_device_name() if torch_device == "cuda" else "CPU"
  openmp = f"; OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}" if "OMP_WAIT_POLICY" in os.environ else ""
  precision = f"; autocast {args.autocast}" if args.autocast else ""
  report(f"device: ourgrad {args.device}, torch {torch_device} ({device_name}), torch {torch.__version__}; "
         f"TF32 matmuls {'allowed' if tf32 else 'off'}{precision}{openmp}")
  report(f"config: {args.config.describe()}" + ("; ourgrad stores the residual stream at each block input "
                                                 "(--realize-residual)" if args.config.model.realize_residual else ""))
  report(f"rows at {args.config.model.n_layer} layers: {', '.join(ROWS[row] for row in args.rows)}; timed steps "
         f"{args.steps} (median) after {args.warmup} warm-up steps")
  rng = np.random.default_rng(args.seed)
  batch = rng.integers(0, args.config.model.vocab_size, (args.config.batch, args.config.sequence + 1)).astype(np.int32)
  results: list[RowResult] = []
  table_step = None
  for layers in args.layers:
    config = args.config.with_layers(layers)
    weights = initial_weights(config)
    rows = args.rows if layers == args.config.model.n_layer else args.sweep_rows
    for row in ROWS:   # in the table's order
      if row not in rows: continue
      if row in ("torch", "compile"): result = run_torch(row, config, weights, batch, torch_device, args)
      else:
        result, step = run_ourgrad(row, config, weights, batch, args.device, args)
        if step is not None and layers == args.table_layers: table_step = step
      results.append(result)
      report(f"  {ROWS[row]}, {layers} layers: {result.step_seconds * 1e3:.2f} ms/step, warm-up "
             f"{result.warmup_seconds:.1f} s, first loss {result.first_loss:.6f}")
      if args.out: report.write(args.out, quiet=True)   # a run cut short by a time limit keeps its finished rows
      gc.collect()
      if torch_device == "cuda": torch.cuda.empty_cache()
  report()
  print_rows(report, args.config, results)
  if len(args.layers) > 2:
    report()
    print_sweep(report, results)
  report()
  agree = check_losses(report, results, loss_tolerance(tf32, torch_device == "cuda", args.autocast))
  if table_step is not None:
    report(f"\nper-kernel table of one TinyJit step at {args.table_layers} layers")
    kernel_table(report, args.config.with_layers(args.table_layers), table_step, args.device)
  if args.out: report.write(args.out)
  return 0 if agree else 1


if __name__ == "__main__":
  sys.exit(main())
