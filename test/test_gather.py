"""Indexed reads: `x[int_tensor]`, `gather` and Embedding load only the rows they pick (Ops.GATHER -> a LOAD whose
offset is computed from another buffer), against numpy/PyTorch; bytes moved pinned with GlobalCounters; an index
outside [-n, n) reads zeros (never a wild read); gradients scatter-add.

    python -m pytest -q -n 0 test/test_gather.py
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ourgrad import Tensor, dtypes
from ourgrad.device import Device
from ourgrad.helpers import GlobalCounters
from ourgrad.nn import Embedding


def test_embedding_reads_only_the_picked_rows() -> None:
  """512 tokens from a 49152 x 576 table (SmolLM2's): about 512 rows of bytes moved, not the 113 MB table."""
  rng = np.random.default_rng(0)
  table = rng.standard_normal((49152, 576), dtype=np.float32)
  tokens = rng.integers(0, 49152, 512)
  embedding = Embedding(49152, 576)
  embedding.weight = Tensor(table)
  index = Tensor(tokens, dtype=dtypes.int64)
  GlobalCounters.reset()
  out = embedding(index).realize()
  row_bytes = 576 * 4
  # the index (int64 -> int32, negatives wrapped) is one small kernel, the row reads another
  assert GlobalCounters.kernel_count == 2
  # read 512 rows + write 512 rows + the indices (8 + 4 bytes, then 4 again); the table holds 49152 rows
  assert 2 * 512 * row_bytes <= GlobalCounters.global_mem <= 2 * 512 * row_bytes + 512 * 16
  expected = torch.nn.functional.embedding(torch.from_numpy(tokens), torch.from_numpy(table)).numpy()
  np.testing.assert_array_equal(out.numpy(), expected)


def test_out_of_range_rows_read_zeros() -> None:
  table = np.arange(20, dtype=np.float32).reshape(5, 4)
  index = np.array([[0, 5, -1], [-5, -6, 1000]])
  got = Tensor(table)[Tensor(index)].numpy()
  inside = (index >= -5) & (index < 5)
  expected = np.where(inside[..., None], table[np.clip(np.where(index < 0, index + 5, index), 0, 4)], 0)
  np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_gather_against_torch(dim: int) -> None:
  rng = np.random.default_rng(dim)
  x = rng.standard_normal((4, 5, 6)).astype(np.float32)
  index_shape = [3, 4, 5]
  index = rng.integers(-x.shape[dim], x.shape[dim], index_shape)
  got = Tensor(x).gather(dim, Tensor(index)).numpy()
  expected = torch.gather(torch.from_numpy(x), dim, torch.from_numpy(np.where(index < 0, index + x.shape[dim], index)))
  np.testing.assert_array_equal(got, expected.numpy())
  # out of range along `dim` reads 0, in every position
  bad = index.copy()
  bad[0, 0, 0], bad[-1, -1, -1] = x.shape[dim], -x.shape[dim] - 1
  got_bad = Tensor(x).gather(dim, Tensor(bad)).numpy()
  assert got_bad[0, 0, 0] == 0 and got_bad[-1, -1, -1] == 0
  np.testing.assert_array_equal(got_bad[1:-1], got[1:-1])


def test_gather_gradient_scatter_adds() -> None:
  rng = np.random.default_rng(7)
  x = rng.standard_normal((3, 6)).astype(np.float32)
  index = np.array([[0, 0, 5, 2], [1, 1, 1, 4], [5, 3, 3, 0]])
  weights = rng.standard_normal((3, 4)).astype(np.float32)
  ours = Tensor(x, requires_grad=True)
  (ours.gather(1, Tensor(index)) * Tensor(weights)).sum().backward()
  reference = torch.tensor(x, requires_grad=True)
  (torch.gather(reference, 1, torch.from_numpy(index)) * torch.from_numpy(weights)).sum().backward()
  np.testing.assert_allclose(ours.grad.numpy(), reference.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_rows_fused_into_reduce_and_pad() -> None:
  """A gathered read inside a reduce, and through a padded view, in one kernel each."""
  rng = np.random.default_rng(8)
  table = rng.standard_normal((10, 7)).astype(np.float32)
  index = np.array([3, 9, 0, 3])
  rows = Tensor(table)[Tensor(index)]
  np.testing.assert_allclose(rows.sum(1).numpy(), table[index].sum(1), rtol=1e-5)
  np.testing.assert_allclose((rows * 2).max(0).numpy(), (table[index] * 2).max(0), rtol=1e-6)
  np.testing.assert_array_equal(rows.pad(((1, 0), (0, 2))).numpy(), np.pad(table[index], ((1, 0), (0, 2))))
  # an index computed from the index buffer: realized once (it is read once per column), then the row reads
  GlobalCounters.reset()
  shifted = Tensor(table)[Tensor(index) * 2 - 6].realize()
  assert GlobalCounters.kernel_count == 2
  picked = index * 2 - 6  # [0, 12, -6, 0]: 12 is out of range
  expected = np.where(((picked >= -10) & (picked < 10))[:, None], table[picked % 10], 0)
  np.testing.assert_array_equal(shifted.numpy(), expected)


def test_gathered_read_on_the_python_device() -> None:
  """The PYTHON device interprets the UOps: the computed offset and its validity mean what the C code means."""
  if "PYTHON" not in Device.available_names(): pytest.skip("PYTHON device unavailable")
  table = np.arange(12, dtype=np.int32).reshape(4, 3)
  got = Tensor(table, device="PYTHON")[Tensor([3, -1, 4, 0], device="PYTHON")].numpy()
  np.testing.assert_array_equal(got, np.stack([table[3], table[3], np.zeros(3, np.int32), table[0]]))
