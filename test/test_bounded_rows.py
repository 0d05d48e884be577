"""GPU row kernels whose rows end at a Variable bound (codegen/bounded_loops.py `row_end`; the rounds of
codegen/row_passes.py and the staged element reduces of codegen/element_reduces.py): decode attention's softmax x V
with the slots past those in use left out by a mask of the bound Variable (extra/models/llama.py
`softmax_weighted_sum(..., valid)`) runs its rounds up to the bound only. Lowered as for CUDA (PYTHON's EMULATE=CUDA
mode), checked against numpy at odd sizes and bounds (the first slot, inside a round, the last slot), the round
guards pinned in the UOps, the CUDA source compiled by NVRTC where it loads; row kernels the rule must leave whole (a
per-element output, terms that are not the reduce's identity past the bound, a constant pad) keep their full rows."""
from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import pytest

from ourgrad import Tensor, dtypes
from ourgrad.codegen.bounded_loops import row_end
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.opt.heuristic import hand_coded_optimizations
from ourgrad.codegen.uops import UOp, UOps
from ourgrad.device import Device
from ourgrad.engine.schedule import create_schedule
from ourgrad.helpers import clear_caches
from ourgrad.ops import Ops
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer
from ourgrad.shape import Variable

from extra.models.llama import softmax_weighted_sum
from helpers import nvrtc_compiler

KV_HEADS, GROUP, SLOTS, HEAD_DIM = 2, 3, 150, 16   # 150 slots: no float4 unit divides them
NVRTC = nvrtc_compiler()


@pytest.fixture
def emulated_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
  monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer("CUDA"))
  monkeypatch.delenv("CHECK_CUDA_RENDER", raising=False)
  clear_caches()
  yield
  clear_caches()


def _in_use(used: Variable | int, slots: int = SLOTS) -> Tensor:
  """True at the first `used` slots: a mask of the bound Variable (a padded constant, no buffer)."""
  return Tensor.ones(used, dtype=dtypes.bool, device="PYTHON").pad(((0, slots - used),))


def _attention(q: np.ndarray, cache: np.ndarray, valid: Tensor | None) -> Tensor:
  """Decode attention as a GPU decode step computes it: scores q . k of each slot (an element reduce of the row
  kernel with ELEMENT_REDUCES=1, else a kernel before it), softmax x V in one row kernel."""
  stored = Tensor(cache, device="PYTHON")
  keys = stored[:, :KV_HEADS].permute(1, 2, 0)     # (kv, hd, slots)
  values = stored[:, KV_HEADS:].permute(1, 0, 2)   # (kv, slots, hd)
  scores = Tensor(q, device="PYTHON") @ keys * (1.0 / math.sqrt(cache.shape[-1]))
  return softmax_weighted_sum(scores, values, valid)


def _numpy_attention(q: np.ndarray, cache: np.ndarray, used: int) -> np.ndarray:
  keys, values = cache[:used, :KV_HEADS].astype(np.float64), cache[:used, KV_HEADS:].astype(np.float64)
  scores = np.einsum("kgd,skd->kgs", q.astype(np.float64), keys) / math.sqrt(HEAD_DIM)
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  return np.einsum("kgs,skd->kgd", weights / weights.sum(-1, keepdims=True), values)


def _row_kernel(out: Tensor) -> Kernel:
  """The CUDA lowering's kernel of `out`'s row kernel (the schedule's last), the ones before it run."""
  item = [item for item in create_schedule([out.lazydata]) if item.ast.op is not Ops.COPY][-1]
  kernel = Kernel(item.ast, CUDARenderer("sm_90"))
  hand_coded_optimizations(kernel)
  return kernel


def _round_guards(uops: list[UOp]) -> int:
  """IFs on `constant < used`: a round (or a staged step) that runs only where the row reaches it."""
  return sum(1 for uop in uops if uop.op is UOps.IF and uop.srcs[0].op is UOps.ALU and uop.srcs[0].arg is Ops.CMPLT
             and uop.srcs[0].srcs[0].op is UOps.CONST and uop.srcs[0].srcs[1].op is UOps.DEFINE_VAR)


@pytest.mark.parametrize("element_reduces", ["0", "1"], ids=["scores_kernel", "scores_in_the_row_kernel"])
def test_bounded_rows_match_numpy(element_reduces: str, emulated_cuda, monkeypatch: pytest.MonkeyPatch) -> None:
  """softmax(q . k) x V over the slots in use, the rest of the cache garbage (finite: terms there are taken as
  finite), at bounds on the first slot, inside a round and the last slot; the same kernel for every bound."""
  monkeypatch.setenv("ELEMENT_REDUCES", element_reduces)
  clear_caches()
  rng = np.random.default_rng(3)
  q = rng.standard_normal((KV_HEADS, GROUP, HEAD_DIM)).astype(np.float32)
  names = set()
  for used in (1, 37, SLOTS):
    cache = rng.standard_normal((SLOTS, 2 * KV_HEADS, HEAD_DIM)).astype(np.float32)
    cache[used:] = 1e30
    valid = _in_use(Variable("used", 1, SLOTS).bind(used))
    np.testing.assert_allclose(_attention(q, cache, valid).numpy(), _numpy_attention(q, cache, used), rtol=1e-5,
                               atol=1e-5)
    schedule = create_schedule([_attention(q, cache, valid).lazydata])   # (a graph of its own: this one is consumed)
    assert len([item for item in schedule if item.ast.op is not Ops.COPY]) == (1 if element_reduces == "1" else 2)
    names.add(_row_kernel(_attention(q, cache, valid)).name)
  assert len(names) == 1, names


@pytest.mark.parametrize("element_reduces", ["0", "1"], ids=["scores_kernel", "scores_in_the_row_kernel"])
def test_round_guards_in_the_cuda_source(element_reduces: str, emulated_cuda, monkeypatch: pytest.MonkeyPatch) -> None:
  """Each round but the first (which every bound reaches) of a row of several rounds runs under `start < used`, the
  same condition for every thread of the block; with the scores staged in the row kernel their steps are guarded
  alike. NVRTC compiles it."""
  monkeypatch.setenv("ELEMENT_REDUCES", element_reduces)
  clear_caches()
  rng = np.random.default_rng(4)
  q = rng.standard_normal((KV_HEADS, GROUP, HEAD_DIM)).astype(np.float32)
  cache = rng.standard_normal((SLOTS, 2 * KV_HEADS, HEAD_DIM)).astype(np.float32)
  kernel = _row_kernel(_attention(q, cache, _in_use(Variable("used", 1, SLOTS).bind(9))))
  assert row_end(kernel) is not None
  uops = linearize(kernel)
  assert _round_guards(uops) >= 2
  source = CUDARenderer("sm_90").render(kernel.name, uops)
  assert "const int used" in source
  if NVRTC is not None: NVRTC.compile(source)
  # without the Variable's mask (the whole cache) the same kernel has no round guards
  whole = _row_kernel(_attention(q, cache, None))
  assert row_end(whole) is None and _round_guards(linearize(whole)) == 0


def test_rows_that_must_stay_whole(emulated_cuda) -> None:
  """No row end where a round past the bound would be needed: an output per element of the row (softmax's own), a
  sum whose terms past the bound are not 0 (exp of a 0 fill), a constant pad (no Variable)."""
  rng = np.random.default_rng(5)
  scores = Tensor(rng.standard_normal((4, SLOTS)).astype(np.float32), device="PYTHON")
  values = Tensor(rng.standard_normal((1, SLOTS, 8)).astype(np.float32), device="PYTHON")
  used = Variable("used", 1, SLOTS).bind(20)
  per_element = _in_use(used).where(scores, -math.inf).softmax(-1)
  assert row_end(_row_kernel(per_element)) is None
  rows = scores.reshape(1, 4, SLOTS)
  zero_fill = _in_use(used).reshape(1, 1, -1).where(rows, 0.0)   # exp(0 - max) is no 0: the sums need every slot
  assert row_end(_row_kernel(softmax_weighted_sum(zero_fill, values))) is None
  assert row_end(_row_kernel(softmax_weighted_sum(rows, values, _in_use(20)))) is None
  assert row_end(_row_kernel(softmax_weighted_sum(rows, values, _in_use(used)))) is not None


def test_decode_rows_end_at_the_slots_in_use(emulated_cuda) -> None:
  """A fixed-shape GPU decode step (extra/models/llama.py) over a 64-slot cache whose `used` bound is rounded to 8
  slots (rows of two rounds, the second skipped) gives the bits of the same step bound to the whole cache (the
  skipped terms are the reduces' identities: x + 0, max(x, -inf)), in the same kernels, each attention row kernel
  taking `used`. (Two steps: the second is the captured one.)"""
  from test_decode_kernels import DECODE, _decode_weights, _stored_as
  from extra.models.llama import Llama
  weights = _decode_weights(seed=5)
  logits, counts = [], []
  for granule in (8, 64):
    tensors, _ = _stored_as(weights, "float32", "PYTHON")
    model = Llama(DECODE, tensors, max_context=64, symbolic=False)
    model.used_granule = granule
    logits.append([model.decode([token], [step]).numpy() for step, token in enumerate([3, 5])])
    captured = model._decode_jit.captured
    assert captured is not None
    counts.append(len(captured.items))
    bound = [item.var_vals for item in captured.items if item.var_vals]
    assert bound == [{"used": granule}] * DECODE.n_layers, bound
  np.testing.assert_array_equal(np.stack(logits[0]), np.stack(logits[1]))
  assert counts[0] == counts[1]
