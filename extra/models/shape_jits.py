"""TinyJits of one function, one per input shape, the most recently used few kept.

A TinyJit replays the kernels of one set of input shapes. A model called with a few recurring shapes (a prompt
length, a batch of sentences padded to one length) keeps a capture for each:

    prefill = ShapeJits(self._forward, keep=4)
    logits = prefill((start, length), tokens, cos, sin, ...)   # the key names what the captured kernels depend on

The first two calls with a key run the function (the second captures), later ones replay. Each capture holds its
kernels' buffers, hence the bound on how many are kept (the least recently used is dropped).
"""
from __future__ import annotations

from typing import Any, Callable, Hashable

from ourgrad import TinyJit


class ShapeJits:
  """`jits(key, *args)`: `fn(*args)` through the TinyJit kept for `key` (made on first use)."""

  def __init__(self, fn: Callable[..., Any], keep: int = 4):
    if keep < 1: raise ValueError(f"ShapeJits keeps at least 1 capture, got keep={keep}")
    self.fn, self.keep = fn, keep
    self.jits: dict[Hashable, TinyJit] = {}  # least recently used first

  def __call__(self, key: Hashable, *args: Any) -> Any:
    jit = self.jits.pop(key, None) or TinyJit(self.fn)
    self.jits[key] = jit
    while len(self.jits) > self.keep: self.jits.pop(next(iter(self.jits)))
    return jit(*args)
