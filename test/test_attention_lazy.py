"""scaled_dot_product_attention without a gradient to record: its composite graph built on lazy buffers
(tensor_attention.composite_attention). The values are the Tensor path's bit for bit (the same lazy ops), grouped-query
attention folds the query heads into the rows of one product per key head (Llama's prefill formula, bit for bit), a
fully masked row gives 0 as in PyTorch, and no autograd node is made."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ourgrad import Tensor
from ourgrad.tensor_attention import composite_attention_refusal

RNG = np.random.default_rng(7)


def _operands(*shapes: tuple[int, ...]) -> list[np.ndarray]:
  return [RNG.standard_normal(shape).astype(np.float32) for shape in shapes]


def _attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, grad: bool, **kwargs) -> Tensor:
  mask = kwargs.pop("attn_mask", None)
  return Tensor(q, requires_grad=grad).scaled_dot_product_attention(
    Tensor(k), Tensor(v), attn_mask=None if mask is None else Tensor(mask), **kwargs)


def _torch(q: np.ndarray, k: np.ndarray, v: np.ndarray, **kwargs) -> np.ndarray:
  mask = kwargs.pop("attn_mask", None)
  return torch.nn.functional.scaled_dot_product_attention(
    *(torch.from_numpy(x) for x in (q, k, v)), attn_mask=None if mask is None else torch.from_numpy(mask),
    **kwargs).numpy()


masked_rows = RNG.random((2, 1, 5, 7)) > 0.4
masked_rows[0, 0, 1] = False   # a query row that sees no key: 0, as PyTorch's


@pytest.mark.parametrize("shapes, kwargs", [
  (((5, 8), (7, 8), (7, 8)), {}),
  (((2, 5, 8), (2, 7, 8), (2, 7, 6)), {"is_causal": True}),
  (((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8)), {"attn_mask": masked_rows}),
  (((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8)), {"attn_mask": RNG.standard_normal((5, 7)).astype(np.float32),
                                                "scale": 0.3}),
], ids=["plain", "causal", "bool_mask", "float_mask"])
def test_lazy_graph_equals_the_tensor_path(shapes, kwargs) -> None:
  q, k, v = _operands(*shapes)
  lazy = _attention(q, k, v, False, **dict(kwargs))
  assert lazy._ctx is None and lazy.requires_grad is not True
  got = lazy.numpy()
  np.testing.assert_array_equal(got, _attention(q, k, v, True, **dict(kwargs)).numpy())
  np.testing.assert_allclose(got, np.nan_to_num(_torch(q, k, v, **dict(kwargs))), atol=1e-6)
  if "attn_mask" in kwargs and kwargs["attn_mask"].dtype == bool: assert not got[0, :, 1].any()


@pytest.mark.parametrize("shapes, mask", [
  (((2, 6, 5, 16), (2, 2, 5, 16), (2, 2, 5, 16)), None),
  (((2, 6, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8)), RNG.random((2, 6, 5, 7)) > 0.3),
], ids=["causal", "per_head_mask"])
def test_grouped_query_heads_match_torch(shapes, mask) -> None:
  q, k, v = _operands(*shapes)
  kwargs = {"enable_gqa": True, **({"is_causal": True} if mask is None else {"attn_mask": mask})}
  np.testing.assert_allclose(_attention(q, k, v, False, **dict(kwargs)).numpy(), _torch(q, k, v, **dict(kwargs)),
                             atol=1e-6)


def test_grouped_query_heads_fold_into_rows_as_llama_did() -> None:
  """Llama's prefill attention as it was written before it called scaled_dot_product_attention (the query heads of a
  KV head as the rows of one product, a bool mask, the plain softmax): the same bits."""
  heads, kv_heads, length, slots, head_dim = 6, 2, 5, 9, 16
  group = heads // kv_heads
  q, k, v = _operands((heads, length, head_dim), (kv_heads, slots, head_dim), (kv_heads, slots, head_dim))
  visible = np.arange(slots)[None, :] <= np.arange(4, 4 + length)[:, None]
  rows = Tensor(q).reshape(kv_heads, group * length, head_dim)
  scores = (rows @ Tensor(k).permute(0, 2, 1) * (1.0 / math.sqrt(head_dim))).reshape(kv_heads, group, length, slots)
  weights = Tensor(visible).where(scores, -math.inf).softmax(-1).reshape(kv_heads, group * length, slots)
  expected = (weights @ Tensor(v)).reshape(heads, length, head_dim).numpy()
  got = _attention(q, k, v, False, attn_mask=visible, enable_gqa=True).numpy()
  np.testing.assert_array_equal(got, expected)


def test_refusals() -> None:
  q, k, v = (Tensor(x) for x in _operands((2, 4, 8), (2, 4, 8), (2, 4, 8)))
  assert composite_attention_refusal(q, k, v, None, 0.0, False) is None
  assert composite_attention_refusal(q.requires_grad_(), k, v, None, 0.0, False) == "an operand needs a gradient"
  q.requires_grad = None
  assert composite_attention_refusal(q, k, v, None, 0.1, False) == "dropout_p=0.1"
  assert "float16" in composite_attention_refusal(q.half(), k.half(), v.half(), None, 0.0, False)
  assert "broadcast" in composite_attention_refusal(q, Tensor(_operands((1, 4, 8))[0]), v, None, 0.0, False)
  # four query heads on two key heads without enable_gqa: the Tensor path's broadcast rules (and errors) decide
  q4, k2 = Tensor(_operands((1, 4, 3, 8))[0]), Tensor(_operands((1, 2, 3, 8))[0])
  assert "heads" in composite_attention_refusal(q4, k2, k2, None, 0.0, False)
  assert composite_attention_refusal(q4, k2, k2, None, 0.0, True) is None


def test_one_index_tensor_reads_its_rows() -> None:
  """x[idx] for one integer tensor: the rows it picks (negative from the end, outside [-n, n) zeros), built as the
  gather and its index's wrap (a compare, an add, a select) and nothing else; a float or bool index still raises."""
  from ourgrad.lazy import LazyBuffer
  table = RNG.standard_normal((6, 3, 2)).astype(np.float32)
  index = np.array([[0, -1, 5], [7, -7, 2]], np.int32)
  x = Tensor(table).realize()
  idx = Tensor(index).realize()
  expected = np.where(((index >= -6) & (index < 6))[..., None, None], table[np.clip(index, -6, 5)], 0)
  np.testing.assert_array_equal(x[idx].numpy(), expected)
  made = []
  create = LazyBuffer.create_base
  LazyBuffer.create_base = staticmethod(lambda *args, **kwargs: made.append(args[3]) or create(*args, **kwargs))
  try:
    x[idx]
  finally:
    LazyBuffer.create_base = staticmethod(create)
  assert sorted(op.name for op in made) == ["ADD", "CMPLT", "GATHER", "WHERE"]
  for bad in (Tensor([1.0]), Tensor([True])):
    with pytest.raises(IndexError): x[bad]


def _bases_made(call) -> int:
  from ourgrad.lazy import LazyBuffer
  made = [0]
  create = LazyBuffer.create_base

  def counting(*args, **kwargs):
    made[0] += 1
    return create(*args, **kwargs)
  LazyBuffer.create_base = staticmethod(counting)
  try:
    call()
  finally:
    LazyBuffer.create_base = staticmethod(create)
  return made[0]


def test_lazy_graph_makes_no_more_ops_than_the_tensor_path() -> None:
  """The same lazy ops (a fully masked row's two fixes cost one op each where the Tensor path's cost two)."""
  q, k, v = _operands((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8))
  for kwargs in ({"is_causal": True}, {"attn_mask": masked_rows}):
    # (each counted on its second call: a first one may upload the causal mask's ranges, Tensor.arange)
    lazy = [_bases_made(lambda: _attention(q, k, v, False, **dict(kwargs))) for _ in range(2)][1]
    composed = [_bases_made(lambda: _attention(q, k, v, True, **dict(kwargs))) for _ in range(2)][1]
    assert lazy <= composed, (kwargs, lazy, composed)
