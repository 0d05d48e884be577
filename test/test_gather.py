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
  # an index computed from the index buffer, read once per column (7 times): recomputed in the row kernel rather
  # than stored (engine/schedule.py REGISTER_ROW_VISITS: values read at most 8 times an element are not stored)
  GlobalCounters.reset()
  shifted = Tensor(table)[Tensor(index) * 2 - 6].realize()
  assert GlobalCounters.kernel_count == 1
  picked = index * 2 - 6  # [0, 12, -6, 0]: 12 is out of range
  expected = np.where(((picked >= -10) & (picked < 10))[:, None], table[picked % 10], 0)
  np.testing.assert_array_equal(shifted.numpy(), expected)


def test_gathered_read_on_the_python_device() -> None:
  """The PYTHON device interprets the UOps: the computed offset and its validity mean what the C code means."""
  if "PYTHON" not in Device.available_names(): pytest.skip("PYTHON device unavailable")
  table = np.arange(12, dtype=np.int32).reshape(4, 3)
  got = Tensor(table, device="PYTHON")[Tensor([3, -1, 4, 0], device="PYTHON")].numpy()
  np.testing.assert_array_equal(got, np.stack([table[3], table[3], np.zeros(3, np.int32), table[0]]))


# ---------------------------------------------------------------- gradients: a scatter-add of the picked rows


def test_embedding_gradient_scatter_adds_repeated_rows() -> None:
  """Embedding backward against torch, with indices that repeat (within a row of the batch and across rows)."""
  rng = np.random.default_rng(11)
  table = rng.standard_normal((10, 6)).astype(np.float32)
  tokens = np.array([[1, 1, 7, 3, 1, 0], [9, 3, 3, 3, 0, 1], [7, 7, 7, 7, 7, 7], [2, 4, 6, 8, 9, 0]])
  upstream = rng.standard_normal((4, 6, 6)).astype(np.float32)
  embedding = Embedding(10, 6)
  embedding.weight = Tensor(table, requires_grad=True)
  (embedding(Tensor(tokens)) * Tensor(upstream)).sum().backward()
  reference = torch.tensor(table, requires_grad=True)
  (torch.nn.functional.embedding(torch.from_numpy(tokens), reference) * torch.from_numpy(upstream)).sum().backward()
  np.testing.assert_allclose(embedding.weight.grad.numpy(), reference.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_tensor_index_gradient_on_a_middle_dim() -> None:
  """x[:, idx] with negative and repeated indices: the gradient of a view-indexed dim against torch."""
  rng = np.random.default_rng(12)
  x = rng.standard_normal((3, 7, 4)).astype(np.float32)
  index = np.array([[0, -1, 6], [2, 2, -7]])  # -1 is row 6, -7 row 0: repeats through negative indices too
  upstream = rng.standard_normal((3, 2, 3, 4)).astype(np.float32)
  ours = Tensor(x, requires_grad=True)
  (ours[:, Tensor(index)] * Tensor(upstream)).sum().backward()
  reference = torch.tensor(x, requires_grad=True)
  (reference[:, torch.from_numpy(index)] * torch.from_numpy(upstream)).sum().backward()
  np.testing.assert_allclose(ours.grad.numpy(), reference.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_out_of_range_rows_get_no_gradient() -> None:
  """An index outside [-n, n) reads zeros and so adds nothing to any row (PyTorch raises; numpy reference)."""
  table = np.arange(20, dtype=np.float32).reshape(5, 4)
  index = np.array([4, 5, -6, 4, 1000, 0])
  upstream = np.arange(24, dtype=np.float32).reshape(6, 4)
  ours = Tensor(table, requires_grad=True)
  (ours[Tensor(index)] * Tensor(upstream)).sum().backward()
  expected = np.zeros_like(table)
  for row, picked in zip(upstream, index):
    if -5 <= picked < 5: expected[picked] += row
  np.testing.assert_array_equal(ours.grad.numpy(), expected)


def test_embedding_gradient_touches_only_the_picked_rows() -> None:
  """The gradient of 512 tokens from a 49152 x 576 table (SmolLM2's): the one-hot masked sum over the whole table
  (512 x 49152 x 576 compare-selects and adds, about 3e10 ops) is gone. The scatter-add sums the repeated rows
  (512 x 512 x 576), finds each table row's last pick (49152 x 512 compares, no width) and writes the (dense)
  gradient as an indexed read of the summed rows: ops pinned to those three loops (2% of the one-hot's at most),
  bytes at the dense gradient's write plus the gathered read's estimate (one element per output, as the forward
  counts it) plus rows-sized terms."""
  rng = np.random.default_rng(13)
  rows, width, count = 49152, 576, 512
  table = Tensor(rng.standard_normal((rows, width), dtype=np.float32), requires_grad=True).realize()
  tokens = rng.integers(0, rows, count)
  tokens[:8] = tokens[8]  # some repeats
  upstream = rng.standard_normal((count, width), dtype=np.float32)
  upstream_t, tokens_t = Tensor(upstream).realize(), Tensor(tokens.astype(np.int32)).realize()
  out = table[tokens_t]
  (out * upstream_t).sum().backward()
  GlobalCounters.reset()
  grad = table.grad.realize()
  # two to three ops (select or compare, then add or max; the GPU kernels count a little more) per element of each of
  # the three loops
  ops = GlobalCounters.global_ops
  assert ops <= 3 * (count * count * width + rows * count + rows * width), ops
  assert ops < 2 * count * rows * width // 50  # the one-hot's
  table_bytes, row_bytes = rows * width * 4, width * 4
  assert table_bytes <= GlobalCounters.global_mem <= 2 * table_bytes + 4 * count * row_bytes + 16 * rows + count ** 2
  assert GlobalCounters.kernel_count <= 4
  expected = np.zeros((rows, width), np.float32)
  np.add.at(expected, tokens, upstream)
  got = grad.numpy()
  touched = np.unique(tokens)
  np.testing.assert_allclose(got[touched], expected[touched], rtol=1e-5, atol=1e-5)
  assert not np.any(np.delete(got, touched, axis=0))


def test_more_picks_than_rows_gradient() -> None:
  """More indices than table rows (M > N: the one-hot sum is the cheaper loop then) against torch."""
  rng = np.random.default_rng(14)
  table = rng.standard_normal((3, 5)).astype(np.float32)
  index = rng.integers(-3, 3, 40)
  upstream = rng.standard_normal((40, 5)).astype(np.float32)
  ours = Tensor(table, requires_grad=True)
  (ours[Tensor(index)] * Tensor(upstream)).sum().backward()
  reference = torch.tensor(table, requires_grad=True)
  (reference[torch.from_numpy(index)] * torch.from_numpy(upstream)).sum().backward()
  np.testing.assert_allclose(ours.grad.numpy(), reference.grad.numpy(), rtol=1e-5, atol=1e-5)
