"""Element reduces (engine/kernel_walk.py `element_reduce_refusal`, codegen/element_reduces.py): a short reduce whose
results a GPU row kernel reads per element of its rows is computed by the row kernel's blocks into local memory,
one kernel where it was two. Decode attention is the case: softmax(q . K * scale + mask) @ V in one kernel, the
scores staged per block. Lowered for CUDA (the PYTHON device's EMULATE=CUDA mode) and compared with numpy and with
the two-kernel path (ELEMENT_REDUCES=0, the default); on a CPU nothing changes (no local memory: two kernels)."""
from __future__ import annotations

import math
from typing import Iterator

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.opt.heuristic import hand_coded_optimizations
from ourgrad.codegen.uops import UOps
from ourgrad.device import Device
from ourgrad.engine.schedule import create_schedule
from ourgrad.helpers import clear_caches
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer

from extra.models.llama import Llama, LlamaConfig, softmax_weighted_sum, split_softmax_weighted_sum
from helpers import nvrtc_compiler
from test_models import _tiny_weights

NVRTC = nvrtc_compiler()


@pytest.fixture
def emulated_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
  """The PYTHON device lowering as for CUDA (EMULATE=CUDA), element reduces on (ELEMENT_REDUCES=1), fresh caches."""
  monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer("CUDA"))
  monkeypatch.setenv("ELEMENT_REDUCES", "1")
  clear_caches()   # schedules made without element reduces
  yield
  clear_caches()


def _attention_inputs(sequences: int, kv_heads: int, group: int, head_dim: int, slots: int,
                      seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  mask = np.zeros((sequences, slots), np.float32)
  for row in range(sequences): mask[row, slots - 1 - row % slots:] = -np.inf   # each row's unwritten tail
  mask[:, 0] = 0.0
  return {"q": rng.standard_normal((sequences, kv_heads, group, head_dim)).astype(np.float32),
          "k": rng.standard_normal((sequences, slots, kv_heads, head_dim)).astype(np.float32),
          "v": rng.standard_normal((sequences, slots, kv_heads, head_dim)).astype(np.float32), "mask": mask}


def _decode_attention(inputs: dict[str, np.ndarray], device: str) -> Tensor:
  """extra/models/llama.py's fixed-shape decode attention: scores of one query per head over the cache (grouped
  query heads folded into one axis), the mask added, then softmax x V as one row kernel."""
  sequences, kv_heads, group, head_dim = inputs["q"].shape
  q = Tensor(inputs["q"], device=device)
  keys = Tensor(inputs["k"], device=device).permute(0, 2, 3, 1)     # (S, kv, hd, slots)
  values = Tensor(inputs["v"], device=device).permute(0, 2, 1, 3)   # (S, kv, slots, hd)
  scores = q @ keys * (1.0 / math.sqrt(head_dim)) + Tensor(inputs["mask"], device=device).reshape(sequences, 1, 1, -1)
  return softmax_weighted_sum(scores, values)


def _numpy_attention(inputs: dict[str, np.ndarray]) -> np.ndarray:
  q, k, v = (inputs[name].astype(np.float64) for name in "qkv")
  scores = np.einsum("skgh,svkh->skgv", q, k) / math.sqrt(q.shape[-1]) + inputs["mask"][:, None, None, :]
  weights = np.exp(scores - scores.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum("skgv,svkh->skgh", weights, v)


# (sequences, kv_heads, group, slots, staged rows a block): one sequence's rows interleave 8 head_dim outputs of one
# query head (one staged row); more stack the group's query heads in each thread (codegen/row_blocks.py stacked
# rows: the values read once for them), each head's scores a staged row of its own
@pytest.mark.parametrize("sequences, kv_heads, group, slots, staged", [(1, 3, 3, 40, 1), (8, 3, 3, 40, 3),
                                                                        (2, 1, 2, 300, 2)],
                         ids=["smollm2_heads", "smollm2_heads_8_sequences", "two_heads_long_cache"])
def test_decode_attention_is_one_kernel(sequences: int, kv_heads: int, group: int, slots: int, staged: int,
                                        emulated_cuda: None) -> None:
  """Lowered for CUDA, decode attention (grouped-query heads, head_dim 64, several sequences, a mask) is one kernel
  whose scores are an element reduce staged in local memory before the row passes (a BARRIER after the staging),
  and it gives numpy's values; its CUDA source compiles."""
  inputs = _attention_inputs(sequences, kv_heads, group, 64, slots, seed=slots + sequences)
  out = _decode_attention(inputs, "PYTHON")
  schedule = create_schedule([out.lazydata])
  assert len(schedule) == 1
  kernel = Kernel(schedule[0].ast, Device["PYTHON"].renderer)
  assert len(kernel.element_reduces) == 1 and kernel.row_axes is not None
  uops = linearize(kernel)
  locals_ = [uop for uop in uops if uop.op is UOps.DEFINE_LOCAL and uop.arg[0].startswith("element")]
  assert len(locals_) == 1 and locals_[0].arg[1] == staged * slots   # a block's rows share the scores
  first_barrier = next(position for position, uop in enumerate(uops) if uop.op is UOps.BARRIER)
  assert all(not (uop.op is UOps.STORE and uop.srcs[0] is locals_[0]) for uop in uops[first_barrier:])
  if staged == 1:   # every input's loads issued before the staging's BARRIER (V's too: it does not need the scores)
    inputs_read = {id(uop.srcs[0]) for uop in uops[:first_barrier] if uop.op is UOps.LOAD}
    assert all(id(uop) in inputs_read for uop in uops if uop.op is UOps.DEFINE_GLOBAL and not uop.arg[1])
  if NVRTC is not None:
    cuda = Kernel(schedule[0].ast, CUDARenderer())
    hand_coded_optimizations(cuda)
    NVRTC.compile(CUDARenderer().render(cuda.name, linearize(cuda)))
  # values from a graph built again (this one's buffers were given to the schedule above)
  np.testing.assert_allclose(_decode_attention(inputs, "PYTHON").numpy(), _numpy_attention(inputs), rtol=1e-5,
                             atol=1e-5)


def _split_decode_attention(inputs: dict[str, np.ndarray], chunks: int) -> Tensor:
  """`_decode_attention` with the slots in `chunks` pieces (llama.py `split_softmax_weighted_sum`)."""
  sequences, kv_heads, group, head_dim = inputs["q"].shape
  q = Tensor(inputs["q"], device="PYTHON")
  keys = Tensor(inputs["k"], device="PYTHON").permute(0, 2, 3, 1)
  values = Tensor(inputs["v"], device="PYTHON").permute(0, 2, 1, 3)
  scores = q @ keys * (1.0 / math.sqrt(head_dim)) + Tensor(inputs["mask"], device="PYTHON").reshape(sequences, 1, 1, -1)
  return split_softmax_weighted_sum(scores, values, chunks)


# (sequences, kv_heads, group, slots, chunks): SmolLM2's heads over 40 slots in 4 pieces of 10, and 2 query heads of
# one KV head over 16 slots in 4 pieces of 4 (a row one thread holds whole, 2 rows a block: their block combine)
@pytest.mark.parametrize("sequences, kv_heads, group, slots, chunks", [(1, 3, 3, 40, 4), (2, 1, 2, 16, 4)],
                         ids=["smollm2_heads", "short_pieces"])
def test_split_decode_attention_is_two_kernels(sequences: int, kv_heads: int, group: int, slots: int, chunks: int,
                                               emulated_cuda: None) -> None:
  """Decode attention split over the slots (flash-decoding): one row kernel for the pieces, whose scores are an
  element reduce staged per block (the softmax's max read inside its exp and in the stored log-sum-exp: the scheduler
  counts one kernel reading the scores, engine/store_or_recompute.py), then a small kernel combining the pieces;
  numpy's values, with pieces that the mask hides entirely (log-sum-exp -inf, weight 0); the CUDA source compiles."""
  inputs = _attention_inputs(sequences, kv_heads, group, 64, slots, seed=slots)
  inputs["mask"][:, slots // 2:] = -np.inf   # the later pieces all masked, as a cache's unwritten tail
  schedule = create_schedule([_split_decode_attention(inputs, chunks).lazydata])
  assert len(schedule) == 2
  pieces = Kernel(schedule[0].ast, Device["PYTHON"].renderer)
  assert len(pieces.element_reduces) == 1 and pieces.row_axes is not None
  if NVRTC is not None:
    for item in schedule:
      cuda = Kernel(item.ast, CUDARenderer())
      hand_coded_optimizations(cuda)
      NVRTC.compile(CUDARenderer().render(cuda.name, linearize(cuda)))
  np.testing.assert_allclose(_split_decode_attention(inputs, chunks).numpy(), _numpy_attention(inputs), rtol=1e-5,
                             atol=1e-5)


def test_two_kernels_without_element_reduces(emulated_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
  """ELEMENT_REDUCES=0: the scores are a kernel of their own again, and both paths give the same values."""
  inputs = _attention_inputs(2, 3, 3, 64, 24, seed=3)
  fused = _decode_attention(inputs, "PYTHON").numpy()
  monkeypatch.setenv("ELEMENT_REDUCES", "0")
  clear_caches()
  out = _decode_attention(inputs, "PYTHON")
  assert len(create_schedule([out.lazydata])) == 2
  np.testing.assert_allclose(_decode_attention(inputs, "PYTHON").numpy(), fused, rtol=1e-6, atol=1e-6)


def test_cpu_keeps_two_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
  """A CPU has no local memory to stage the scores in: the scores kernel, then the row kernel, numpy's values."""
  monkeypatch.setenv("ELEMENT_REDUCES", "1")
  clear_caches()
  inputs = _attention_inputs(2, 3, 3, 64, 24, seed=4)
  out = _decode_attention(inputs, "CLANG")
  schedule = create_schedule([out.lazydata])
  assert len(schedule) == 2
  assert not any(Kernel(item.ast, Device["CLANG"].renderer).element_reduces for item in schedule)
  np.testing.assert_allclose(_decode_attention(inputs, "CLANG").numpy(), _numpy_attention(inputs), rtol=1e-5,
                             atol=1e-5)


def test_rows_with_their_own_element_values(emulated_cuda: None) -> None:
  """An element reduce that differs for every row (softmax's denominator over p of s = 0.5 * sum_h x[a, b, p, h]):
  no two rows of a block share a staged row, so a block owns one row; numpy's values."""
  rng = np.random.default_rng(9)
  x_np = rng.standard_normal((3, 5, 48, 16)).astype(np.float32)

  def denominators() -> Tensor:
    sums = Tensor(x_np, device="PYTHON").sum(-1) * 0.5   # (3, 5, 48): read per element of the rows below
    return (sums - sums.max(-1, keepdim=True)).exp().sum(-1)
  schedule = create_schedule([denominators().lazydata])
  assert len(schedule) == 1
  kernel = Kernel(schedule[0].ast, Device["PYTHON"].renderer)
  assert len(kernel.element_reduces) == 1
  uops = linearize(kernel)
  staged = [uop for uop in uops if uop.op is UOps.DEFINE_LOCAL and uop.arg[0].startswith("element")]
  assert len(staged) == 1 and staged[0].arg[1] == 48
  totals = x_np.astype(np.float64).sum(-1) * 0.5
  peak = totals.max(-1)
  expected = np.exp(totals - peak[..., None]).sum(-1)
  np.testing.assert_allclose(denominators().numpy(), expected, rtol=1e-5, atol=1e-5)


def test_smollm2_decode_step_shares_staged_scores(emulated_cuda: None) -> None:
  """A SmolLM2-shaped decode step (9 query heads, 3 KV heads, head_dim 64, 520 cache slots; one block, random
  weights) lowered for CUDA: its attention is one kernel whose K is RoPE'd and this step's row recomputed (a where
  over two-view loads: the pair swap), and a block's 8 interleaved head_dim rows share one staged row of scores
  (72 blocks, not a block per row)."""
  config = LlamaConfig(dim=576, n_layers=1, n_heads=9, n_kv_heads=3, hidden_dim=1536, vocab_size=64, norm_eps=1e-5,
                       rope_theta=10000.0, context_length=520)
  weights = {name: Tensor(value, device="PYTHON") for name, value in _tiny_weights(config, 0).items()}
  model = Llama(config, weights, max_context=520, symbolic=False)
  logits = model._step_graph(Tensor(np.array([[1, 5]], np.int32), device="PYTHON"), None)
  schedule = create_schedule([logits.lazydata, model.blocks[0].cache.lazydata])
  kernels = [Kernel(item.ast, CUDARenderer()) for item in schedule if item.ast.op.name != "COPY"]
  attention = [kernel for kernel in kernels if kernel.element_reduces]
  assert len(attention) == 1
  uops = linearize(attention[0])
  blocks = next(uop.arg[1] for uop in uops if uop.op is UOps.SPECIAL and uop.arg[0] == "gidx0")
  staged = [uop for uop in uops if uop.op is UOps.DEFINE_LOCAL and uop.arg[0].startswith("element")]
  assert blocks == 3 * 3 * 64 // 8 and len(staged) == 1 and staged[0].arg[1] == 520


def test_softmax_of_small_scores_stores_per_element(emulated_cuda: None) -> None:
  """softmax(q @ k.T * scale) of a few short rows (a composed attention's weights): the scores are an element reduce
  of the softmax row kernel, read back from local memory by its per-element store as well; numpy's values."""
  rng = np.random.default_rng(0)
  q_np, k_np = (rng.standard_normal((2, 4, 8, 16)).astype(np.float32) for _ in range(2))

  def weights() -> Tensor:
    return (Tensor(q_np, device="PYTHON") @ Tensor(k_np, device="PYTHON").transpose(-1, -2) * 0.25).softmax(-1)
  schedule = create_schedule([weights().lazydata])
  assert len(schedule) == 1 and len(Kernel(schedule[0].ast, Device["PYTHON"].renderer).element_reduces) == 1
  scores = q_np.astype(np.float64) @ k_np.astype(np.float64).transpose(0, 1, 3, 2) * 0.25
  expected = np.exp(scores - scores.max(-1, keepdims=True))
  expected /= expected.sum(-1, keepdims=True)
  np.testing.assert_allclose(weights().numpy(), expected, rtol=1e-5, atol=1e-6)
