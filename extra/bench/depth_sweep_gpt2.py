"""Time a GPT-2 (nanoGPT-style) TinyJit training step at several depths: is the step time linear in depth? (issue 24)

Usage: `python extra/bench/depth_sweep_gpt2.py BATCH,SEQ LAYERS,...`, e.g. `8,512 1,2,4,8,12` on a GPU. The model is
the smallest that shows the problem this found (the residual stream recomputed from every earlier layer: a step that
grew with depth squared); bench_gpt2.py is the full benchmark with PyTorch beside it.
"""
from __future__ import annotations

import sys
import time

import numpy as np

import ourgrad
from ourgrad import Device, Tensor, TinyJit, nn


class Block:
  """GPT-2's pre-LayerNorm block: causal self-attention, then a GELU(tanh) MLP, each added to the residual stream."""
  def __init__(self, width: int, heads: int):
    self.heads = heads
    self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
    self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
    self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

  def __call__(self, x: Tensor) -> Tensor:
    batch, length, width = x.shape
    q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
    q, k, v = [t.reshape(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v)]
    attended = q.scaled_dot_product_attention(k, v, is_causal=True).transpose(1, 2).reshape(batch, length, width)
    x = x + self.proj(attended)
    return x + self.down(self.up(self.norm2(x)).gelu(approximate="tanh"))


def median_step_ms(layers: int, batch: int, length: int, width: int = 768, heads: int = 12, vocab: int = 50304,
                   steps: int = 5) -> float:
  """Build the model, warm the jitted AdamW step up (3 calls: compiles and capture), then time `steps` calls."""
  token_table, position_table = Tensor.randn(vocab, width) * 0.02, Tensor.randn(1024, width) * 0.01
  blocks = [Block(width, heads) for _ in range(layers)]
  final_norm = nn.LayerNorm(width)
  params = [token_table, position_table] + [p for block in blocks for p in nn.state.get_parameters(block)]
  params += nn.state.get_parameters(final_norm)
  for param in params: param.requires_grad = True
  Tensor.realize_all(*params)
  optimizer = nn.optim.AdamW(params, lr=6e-4, weight_decay=0.1)

  @TinyJit
  def train_step(tokens: Tensor, targets: Tensor) -> Tensor:
    x = token_table[tokens] + position_table[:length]
    for block in blocks: x = block(x)
    logits = final_norm(x) @ token_table.T   # tied embeddings
    loss = logits.reshape(-1, vocab).cross_entropy(targets.reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.realize()

  rng = np.random.default_rng(0)
  batches = []
  for _ in range(4):
    sequence = Tensor(rng.integers(0, vocab, (batch, length + 1)).astype(np.int32))
    batches.append((sequence[:, :length].contiguous().realize(), sequence[:, 1:].contiguous().realize()))
  started = time.perf_counter()
  for tokens, targets in batches[:3]: loss = train_step(tokens, targets).item()
  warm_up = time.perf_counter() - started
  times = []
  for index in range(steps):
    Device[Device.DEFAULT].synchronize()
    started = time.perf_counter()
    loss = train_step(*batches[index % len(batches)])
    Device[Device.DEFAULT].synchronize()
    times.append(time.perf_counter() - started)
  milliseconds = sorted(times)[len(times) // 2] * 1e3
  print(f"L={layers:2d} B={batch} T={length}: {milliseconds:8.2f} ms/step  warm-up {warm_up:6.1f} s  "
        f"loss {loss.item():.3f}", flush=True)
  return milliseconds


def main() -> None:
  ourgrad.set_float32_matmul_precision("high")
  batch, length = (int(value) for value in sys.argv[1].split(","))
  depths = [int(value) for value in sys.argv[2].split(",")]
  results = {layers: median_step_ms(layers, batch, length) for layers in depths}
  if 1 in results and 2 in results:
    per_layer = results[2] - results[1]
    for layers, milliseconds in sorted(results.items()):
      linear = results[1] + (layers - 1) * per_layer
      print(f"  L={layers}: {milliseconds:.1f} ms; linear from 1 and 2 layers: {linear:.1f}")


if __name__ == "__main__":
  main()
