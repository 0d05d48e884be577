"""A transformer's training step costs the same per layer at every depth (issue 24: GPT-2's step time grew with depth
squared). The residual stream x = x + f(x) is read by a LayerNorm and by the next add; fused into every reader it was
recomputed from all earlier layers' outputs, so the kernels of layer l read O(l) buffers. The scheduler's
store-or-recompute rule (engine/store_or_recompute.py `_store_or_recompute`) stores it instead. These tests schedule
(never run) the forward and backward pass of a small GPT-style stack at depths 2, 3 and 4 and pin what grows linearly
with depth: kernels, the kernels' names and opts per added layer, and the bytes the kernels read and write; and that
no kernel's inputs grow with depth. (The optimizer's step is per-parameter work, packed into launches: test_optim.py
pins it.)"""
from __future__ import annotations

import collections
import math

import pytest

from ourgrad import Device, Tensor, dtypes
from ourgrad.engine.realize import get_kernel
from ourgrad.engine.schedule import create_schedule
from ourgrad.ops import Ops


def _param(*shape: int) -> Tensor:
  return Tensor.empty(*shape, requires_grad=True).realize()


class _Block:
  """Pre-LayerNorm attention + GELU MLP, GPT-2's block, with weights that are never initialized (only scheduled)."""
  def __init__(self, width: int, heads: int):
    self.heads = heads
    self.norm_weights = [_param(width) for _ in range(4)]
    self.qkv, self.qkv_bias = _param(3 * width, width), _param(3 * width)
    self.proj, self.proj_bias = _param(width, width), _param(width)
    self.up, self.up_bias = _param(4 * width, width), _param(4 * width)
    self.down, self.down_bias = _param(width, 4 * width), _param(width)

  def params(self) -> list[Tensor]:
    return [*self.norm_weights, self.qkv, self.qkv_bias, self.proj, self.proj_bias, self.up, self.up_bias, self.down,
            self.down_bias]

  def __call__(self, x: Tensor) -> Tensor:
    batch, length, width = x.shape
    g1, b1, g2, b2 = self.norm_weights
    q, k, v = x.layernorm().mul(g1).add(b1).linear(self.qkv, self.qkv_bias).split(width, dim=2)
    q, k, v = [t.reshape(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v)]
    attended = q.scaled_dot_product_attention(k, v, is_causal=True).transpose(1, 2).reshape(batch, length, width)
    x = x + attended.linear(self.proj, self.proj_bias)
    hidden = x.layernorm().mul(g2).add(b2).linear(self.up, self.up_bias).gelu(approximate="tanh")
    return x + hidden.linear(self.down, self.down_bias)


def _step_schedule(layers: int, batch: int, length: int, width: int, heads: int, vocab: int):
  embedding = _param(vocab, width)
  blocks = [_Block(width, heads) for _ in range(layers)]
  params = [embedding] + [p for block in blocks for p in block.params()]
  tokens = Tensor.empty(batch, length, dtype=dtypes.int32).realize()
  x = embedding[tokens]
  for block in blocks: x = block(x)
  loss = x.layernorm().matmul(embedding.T).reshape(-1, vocab).cross_entropy(tokens.reshape(-1))
  loss.backward()
  return create_schedule([t.lazydata for t in [loss, *(p.grad for p in params)]])


def _summary(schedule) -> tuple[int, collections.Counter, int, float]:
  """(items, kernel name + opts counts, bytes the items read and write, most inputs of one item per output it
  writes: a multi-output kernel that writes one value per layer, as the causal masks of every layer, reads more)."""
  kernels: collections.Counter = collections.Counter()
  device = Device.DEFAULT
  for item in schedule:
    if item.ast.op in (Ops.COPY, Ops.PACK): continue
    kernel = get_kernel(item.ast, device)
    kernels[(kernel.name, tuple(getattr(kernel, "applied_opts", ())))] += 1
  moved = sum(buffer.size * buffer.dtype.itemsize for item in schedule for buffer in item.bufs)
  kernel_items = [item for item in schedule if item.ast.op is not Ops.PACK]
  return len(schedule), kernels, moved, max(len(item.inputs) / len(item.outputs) for item in kernel_items)


@pytest.mark.parametrize("length,width,heads,vocab", [(64, 256, 4, 512)])
def test_step_is_linear_in_depth(length: int, width: int, heads: int, vocab: int):
  # a residual stream of at least the device's launch_bytes: smaller ones are cheaper to recompute than to store
  launch_bytes = getattr(Device[Device.DEFAULT].renderer, "launch_bytes", 0)
  config = (max(2, math.ceil(launch_bytes / (length * width * 4))), length, width, heads, vocab)
  (items2, names2, moved2, inputs2), (items3, names3, moved3, inputs3), (items4, names4, moved4, inputs4) = \
      [_summary(_step_schedule(layers, *config)) for layers in (2, 3, 4)]
  # each added layer adds the same kernels, with the same opts, and moves the same bytes
  assert names4 - names3 == names3 - names2 and not names3 - names4
  assert items4 - items3 == items3 - items2
  assert math.isclose(moved4 - moved3, moved3 - moved2, rel_tol=1e-9)
  # no kernel reads more buffers in a deeper model (the residual stream is stored, not recomputed from every layer)
  assert inputs4 <= inputs2
