"""Reduce loops that end where a Variable-bounded mask does (codegen/bounded_loops.py): a KV cache read as shrunk to
the slots in use and padded back keeps its fixed shape (optimized as any other kernel), and the products over it stop
at the bound. Checked against numpy at odd lengths, at the first, second, a middle and the last slot; the bound is
pinned in the generated source; reduces the mechanism must leave whole (a constant pad, a MAX, a sum whose padded
terms are not zero) keep their full loops."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.device import Device
from ourgrad.codegen.lowering import build_kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.engine.schedule import create_schedule
from ourgrad.ops import Ops
from ourgrad.shape import Variable
from ourgrad.helpers import clear_caches
from ourgrad.renderer.cstyle import ClangRenderer
from ourgrad.runtime.ops_python import PythonRenderer
from helpers import device_opens

SLOTS, KV_HEADS, GROUP, HEAD_DIM = 37, 2, 3, 8   # odd slots: no upcast width divides them


def _sources(tensor: Tensor, renderer: object | None = None) -> list[str]:
  """The C source of every kernel computing `tensor` with the opts it runs with (the graph is consumed): the CLANG
  device's own renderer unless one is given."""
  renderer = renderer or Device["CLANG"].renderer
  return [renderer.render("k", linearize(build_kernel(item.ast, renderer)))
          for item in create_schedule([tensor.lazydata]) if item.ast.op is not Ops.COPY]


def _inputs(seed: int = 0, slots: int = SLOTS, head_dim: int = HEAD_DIM) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  cache = rng.standard_normal((slots, 2 * KV_HEADS, head_dim)).astype(np.float32)
  q = rng.standard_normal((KV_HEADS, GROUP, head_dim)).astype(np.float32)
  return cache, q


def _attention(cache: np.ndarray, q: np.ndarray, position: int, device: str) -> Tensor:
  """One query per head over the cache slots [0, position], the cache read shrunk to a bound Variable and padded
  back (as extra/models/llama.py's fixed-shape decode), the tail hidden by an additive -inf mask."""
  slots, head_dim = cache.shape[0], cache.shape[-1]
  used = Variable("used", 1, slots).bind(position + 1)
  unused = ((0, slots - used), None, None)
  stored = Tensor(cache, device=device)
  keys = stored[:, :KV_HEADS].shrink(((0, used), None, None)).pad(unused).permute(1, 2, 0)   # (kv, hd, slots)
  values = stored[:, KV_HEADS:].shrink(((0, used), None, None)).pad(unused).permute(1, 0, 2)   # (kv, slots, hd)
  mask = np.where(np.arange(slots) <= position, 0.0, -math.inf).astype(np.float32)
  scores = Tensor(q, device=device) @ keys * (1.0 / math.sqrt(head_dim)) + Tensor(mask, device=device)
  return scores.softmax(-1) @ values


def _numpy_attention(cache: np.ndarray, q: np.ndarray, position: int) -> np.ndarray:
  keys, values = cache[:position + 1, :KV_HEADS], cache[:position + 1, KV_HEADS:]
  scores = np.einsum("kgd,skd->kgs", q.astype(np.float64), keys) / math.sqrt(HEAD_DIM)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum("kgs,skd->kgd", weights, values)


@pytest.mark.parametrize("device", ["CLANG", "LLVM"])
@pytest.mark.parametrize("position", [0, 1, SLOTS // 2, SLOTS - 1])
def test_bounded_attention_matches_numpy(position: int, device: str) -> None:
  if not device_opens(device): pytest.skip(f"{device} does not open here")
  cache, q = _inputs(position)
  cache[position + 1:] = np.inf   # slots past the bound are never read (an inf there would make NaN if they were)
  got = _attention(cache, q, position, device).numpy()
  np.testing.assert_allclose(got, _numpy_attention(cache, q, position), rtol=1e-5, atol=1e-5)


def test_bounded_attention_in_the_cuda_lowering(monkeypatch: pytest.MonkeyPatch) -> None:
  """The same attention lowered as for CUDA (the PYTHON device, EMULATE=CUDA): the kernels keep their full loops
  there (a thread's own loop count would diverge), the masks read the pad's zeros, the result numpy's."""
  monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer("CUDA"))
  clear_caches()
  try:
    for position in (0, SLOTS - 1):
      cache, q = _inputs(position)
      cache[position + 1:] = np.inf
      got = _attention(cache, q, position, "PYTHON").numpy()
      np.testing.assert_allclose(got, _numpy_attention(cache, q, position), rtol=1e-5, atol=1e-5)
  finally:
    clear_caches()


def test_bounded_loops_in_the_source() -> None:
  """The scores' reduce (over the head dim, the slot an output axis) runs in full or not at all per block of slots;
  the weighted sum's reduce (over the slots) ends at the bound; the softmax's kernels read no masked load."""
  cache, q = _inputs()
  sources = _sources(_attention(cache, q, 5, "CLANG"))
  bounded = [source for source in sources if re.search(r"for \(int ridx\d+ = 0; ridx\d+ < \(", source)]
  assert len(bounded) == 2, sources
  scores, weighted = bounded
  assert "const int used" in scores and "const int used" in weighted
  assert re.search(rf"\(used\+1\)|used\b.*{SLOTS}", weighted), weighted   # min(used, SLOTS) clamps the slot loop


def test_constant_pad_keeps_the_full_loop() -> None:
  """A constant pad is not read as absent terms: 0 * inf in the pad stays NaN, as numpy gives."""
  x = np.arange(1, 6, dtype=np.float32)
  y = np.full(9, np.inf, np.float32)
  out = Tensor(x).pad((0, 4)) * Tensor(y)
  assert np.isnan(out.sum().numpy())
  sources = _sources((Tensor(x).pad((0, 4)) * Tensor(y)).sum())
  assert not any(re.search(r"ridx\d+ < \(", source) for source in sources)


@pytest.mark.parametrize("position", [0, 4])
def test_reduces_whose_padded_terms_count_keep_their_loops(position: int) -> None:
  """A MAX over a bound-Variable pad reads its zeros (they can be the max), and a sum of padded elements plus one
  counts one per padded slot: neither loop is cut at the bound."""
  x = -np.arange(1, 10, dtype=np.float32)
  used = Variable("used", 1, 9).bind(position + 1)
  padded = Tensor(x).shrink(((0, used),)).pad(((0, 9 - used),))
  expected = np.concatenate([x[:position + 1], np.zeros(8 - position, np.float32)])
  assert padded.max().numpy() == expected.max()
  padded = Tensor(x).shrink(((0, used),)).pad(((0, 9 - used),))
  np.testing.assert_allclose((padded + 1).sum().numpy(), (expected + 1).sum())


def _full_cache_attention(cache: np.ndarray, q: np.ndarray, position: int, device: str) -> Tensor:
  """The same attention over the whole cache (no bound Variable): every loop runs over all the slots."""
  stored = Tensor(cache, device=device)
  keys, values = stored[:, :KV_HEADS].permute(1, 2, 0), stored[:, KV_HEADS:].permute(1, 0, 2)
  mask = np.where(np.arange(SLOTS) <= position, 0.0, -math.inf).astype(np.float32)
  scores = Tensor(q, device=device) @ keys * (1.0 / math.sqrt(HEAD_DIM)) + Tensor(mask, device=device)
  return scores.softmax(-1) @ values


@pytest.mark.parametrize("position", [1, SLOTS - 2])
def test_bounded_attention_is_the_full_loops_bits(position: int) -> None:
  """With zeros past the position (a KV cache's unwritten slots) the shortened loops give the whole-cache kernels'
  result bit for bit: the same kernels and opts, the skipped terms exact zeros, and inside the weighted sum's
  shortened loop its loads unmasked (the bound implies their mask), the vector code the same."""
  cache, q = _inputs(position)
  cache[position + 1:] = 0.0
  bounded = _attention(cache, q, position, "CLANG").numpy()
  assert np.array_equal(bounded, _full_cache_attention(cache, q, position, "CLANG").numpy())


def test_masked_loads_stay_vector_code() -> None:
  """The scores' keys, masked slot by slot, are one vector built from masked element loads; the weighted sum's
  values, whose mask the loop's end implies, one plain vector load (renderer/cvector.py). SmolLM2's head dim and
  136 slots (8 x 17, as 520 is 8 x 65): the optimizer's upcasts are the decode's. Rendered for AVX2's 32-byte vectors
  and 16 registers whatever the host has (with AVX-512's 64 bytes the heuristic picks four scalar accumulators for
  the scores instead: other code, the same values, which the tests above check on the host's own width)."""
  cache, q = _inputs(slots=136, head_dim=64)
  avx2 = ClangRenderer()
  avx2.vector_bytes, avx2.vector_registers = 32, 16
  scores, weighted = [source for source in _sources(_attention(cache, q, 5, "CLANG"), avx2)
                      if re.search(r"for \(int ridx\d+ = 0; ridx\d+ < \(", source)]
  assert re.search(r"vacc\d+ \+= .*\(\(float\d+v\)\{\(\(alu\d+\) \? data\d+\[", scores), scores
  assert re.search(r"vacc\d+ \+= .*\(\*\(const float\d+v_u\*\)\(data\d+\+", weighted), weighted
  body = weighted[re.search(r"for \(int ridx\d+ = 0;[^\n]*\n", weighted).end():]
  assert "used" not in body[:body.index("\n      }")], weighted   # no mask test inside the loop body


def test_variable_masked_kernels_get_hand_coded_opts_not_a_search() -> None:
  """A kernel whose only Variable is a mask bound is optimized as a fixed-shape one (the sizes are known), but BEAM
  is not asked: it would time candidates without the Variable's value."""
  cache, q = _inputs(slots=136, head_dim=64)
  renderer = Device["CLANG"].renderer

  def search(kernel: object) -> object: raise AssertionError("searched a kernel with a Variable-bounded mask")
  items = [item for item in create_schedule([_attention(cache, q, 5, "CLANG").lazydata]) if item.ast.op is not Ops.COPY]
  kernels = [build_kernel(item.ast, renderer, search) for item in items
             if any(node.op is Ops.LOAD and node.arg.st.symbolic for node in item.ast.walk())]
  assert len(kernels) == 2 and all(kernel.applied_opts for kernel in kernels)
