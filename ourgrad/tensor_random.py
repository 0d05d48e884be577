"""Random numbers computed on the device by a counter-based generator (Threefry-2x32, 20 rounds), for TinyJit.

Eager `Tensor.rand`/`randn`/... draw from one numpy generator on the host and copy the values (ourgrad/tensor.py):
that is fast, needs no kernel per new shape, and keeps every seeded run as it was. Inside a TinyJit function (its
first call, the capture and every replay) values drawn on the host would be frozen into the replay, so there the
same functions build the numbers in the Tensor graph instead:

    bits[i] = threefry2x32(key = (seed, draw), counter = (i, 0))[0]     (uint32; Salmon et al., SC'11)

`seed` and `draw` are the two uint32 words of a small state buffer per device. Each draw reads them and assigns
`draw + 1` back (an assign the JIT captures), so every replay reads the state the one before left and draws new
numbers, with no host work. `Tensor.manual_seed(s)` writes (s, 0) into every state buffer in place, so captured
kernels see the new seed too and a seeded run is reproducible. Threefry needs only 32-bit add, xor and shifts,
which every renderer has (unsigned arithmetic wraps modulo 2**32).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from ourgrad.dtype import dtypes

if TYPE_CHECKING:
  from ourgrad.lazy import LazyBuffer
  from ourgrad.tensor import Tensor

# Threefry-2x32 rotation constants (Random123), four rounds per key injection, alternating
ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
KEY_PARITY = 0x1BD11BDA  # Threefish's C240: the third key word is k0 ^ k1 ^ C240
ROUNDS = 20
UINT32_MASK = 0xFFFFFFFF

# one state Tensor per device: uint32 (seed, draw)
_states: dict[str, Tensor] = {}
# per device, while draws wait for their assign to be realized: (the realized state they read, the last draw's
# number j among them, the pending assign's lazy data)
_pending: dict[str, tuple[LazyBuffer, int, LazyBuffer]] = {}


def _rotate_left(x: Tensor, amount: int) -> Tensor: return (x << amount) | (x >> (32 - amount))


def threefry2x32(key: tuple[Tensor, Tensor], counter: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
  """Threefry-2x32 with 20 rounds of uint32 Tensors (broadcastable against each other): the block cipher of
  `counter` under `key`, two uint32 words."""
  key_words = (key[0], key[1], key[0] ^ key[1] ^ KEY_PARITY)
  x0, x1 = counter[0] + key_words[0], counter[1] + key_words[1]
  for block in range(ROUNDS // 4):
    for amount in ROTATIONS[block % 2]:
      x0 = x0 + x1
      x1 = _rotate_left(x1, amount) ^ x0
    x0 = x0 + key_words[(block + 1) % 3]
    x1 = x1 + key_words[(block + 2) % 3] + (block + 1)
  return x0, x1


def device_state(device: str, seed: int) -> Tensor:
  """The (seed, draw) uint32 state of `device`, made realized on first use."""
  from ourgrad.tensor import Tensor
  state = _states.get(device)
  if state is None:
    state = _states[device] = Tensor([seed & UINT32_MASK, 0], dtype=dtypes.uint32, device=device).realize()
  return state


def reseed(seed: int) -> None:
  """Write (seed, 0) into every device's state buffer in place (captured kernels read those buffers): the draws
  still pending run first, then the buffer is overwritten with no kernel (as an optimizer's learning rate is)."""
  words = np.array([seed & UINT32_MASK, 0], dtype=np.uint32)
  for state in _states.values():
    buffer = state.realize().lazydata.base.realized
    assert buffer is not None
    buffer.copyin(memoryview(words).cast("B"))
  _pending.clear()


def random_bits(shape: tuple[int, ...], device: str, seed: int) -> Tensor:
  """uint32 random bits of `shape` from the device generator; advances the device's draw counter (lazily)."""
  from ourgrad.tensor import Tensor
  state = device_state(device, seed)
  # The draws made since the state was last realized read that realized state and add their own number j: one
  # pending assign (state = realized + (0, j + 1)) replaces the one before, instead of an assign chained on an
  # unrealized assign (which would rebind the state Tensor to a new buffer that captured kernels do not read).
  pending = _pending.get(device)
  if pending is not None and state.lazydata is pending[2] and not pending[2].is_realized:
    realized, draw = pending[0], pending[1] + 1
  else:
    realized, draw = state.lazydata, 0
  count = math.prod(shape)
  words = Tensor(realized)
  key = tuple(words.shrink(((word, word + 1),)).reshape(1).expand(count) for word in range(2))
  index = Tensor.arange(count, dtype=dtypes.uint32, device=device)
  zeros = Tensor.zeros(count, dtype=dtypes.uint32, device=device)
  bits, _ = threefry2x32((key[0], key[1] + draw), (index, zeros))
  state.lazydata = realized
  state.assign(words + Tensor.arange(2, dtype=dtypes.uint32, device=device) * (draw + 1))  # (seed, draw + j + 1)
  _pending[device] = (realized, draw, state.lazydata)
  return bits.reshape(shape)


def uniform01(shape: tuple[int, ...], device: str, seed: int) -> Tensor:
  """float32 uniform in [0, 1): the top 24 bits of each random word (exact in float32) times 2**-24."""
  return (random_bits(shape, device, seed) >> 8).cast(dtypes.float32) * (1.0 / (1 << 24))


def standard_normal(shape: tuple[int, ...], device: str, seed: int) -> Tensor:
  """float32 standard normal by Box-Muller from two uniform draws (1 - u keeps the log's argument in (0, 1])."""
  radius = ((1.0 - uniform01(shape, device, seed)).log() * -2.0).sqrt()
  return radius * (uniform01(shape, device, seed) * (2.0 * math.pi)).cos()
