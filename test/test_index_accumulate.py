"""The indexed accumulate (Ops.INDEX_ACCUMULATE, codegen/index_accumulate.py) and what is built on it: Embedding's
and integer indexing's gradient, scatter_add, scatter(reduce="add"), index_add.

References are numpy's `np.add.at` (which adds in index order, as the kernel does, so float32 results are compared
bit for bit) and PyTorch on the CPU. The GPU lowering (per-thread row owners) runs on the PYTHON device, which always
lowers as for a GPU; the CPU lowering on the default device.
"""
import numpy as np
import pytest
import torch

from ourgrad import Tensor, nn
from ourgrad.codegen import index_accumulate
from ourgrad.device import Device
from ourgrad.dtype import dtypes
from ourgrad.helpers import GlobalCounters


def _python_device_available() -> bool:
  try:
    Device["PYTHON"]
    return True
  except Exception:
    return False


DEVICES = [None] + (["PYTHON"] if _python_device_available() else [])


def _add_at(start: np.ndarray, index: np.ndarray, rows: np.ndarray) -> np.ndarray:
  """numpy's indexed accumulate with ourgrad's rule for indices: negative ones count from the end, others outside
  the table add nothing."""
  size = start.shape[0]
  wrapped = np.where(index < 0, index + size, index)
  inside = (wrapped >= 0) & (wrapped < size)
  result = start.copy()
  np.add.at(result, wrapped[inside], rows[inside])
  return result


def _accumulate(start: np.ndarray, index: np.ndarray, rows: np.ndarray, device: str | None) -> np.ndarray:
  target = Tensor(start, device=device)
  return target._add_rows_at(Tensor(index, device=device), Tensor(rows, device=device)).numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,width,count", [(7, 12, 9), (37, 5, 23), (1, 1, 6), (50, 1, 64), (9, 8, 3)])
def test_repeated_indices_match_numpy_bitwise(device, rows, width, count):
  rng = np.random.default_rng(rows * 1000 + width * 10 + count)
  start = rng.standard_normal((rows, width)).astype(np.float32)
  index = rng.integers(-rows - 2, rows + 2, count).astype(np.int32)
  index[: count // 2] = index[0]   # many repeats of one row
  values = rng.standard_normal((count, width)).astype(np.float32)
  np.testing.assert_array_equal(_accumulate(start, index, values, device), _add_at(start, index, values))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width", [8, 40, 48, 6])
def test_several_rows_per_thread_and_ragged_ends(device, width, monkeypatch):
  # few threads per multiprocessor and per block: each GPU thread owns several rows, the last ones fewer (the ragged
  # guard), and a row's features span several blocks
  monkeypatch.setattr(index_accumulate, "THREADS_PER_PROCESSOR", 3)
  monkeypatch.setattr(index_accumulate, "BLOCK_THREADS", 2)
  rng = np.random.default_rng(width)
  start = rng.standard_normal((29, width)).astype(np.float32)
  index = rng.integers(-3, 32, 40).astype(np.int32)
  values = rng.standard_normal((40, width)).astype(np.float32)
  np.testing.assert_array_equal(_accumulate(start, index, values, device), _add_at(start, index, values))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,width,count", [(300, 8, 45), (1000, 1, 70), (260, 12, 64)])
def test_whole_warp_blocks(device, rows, width, count):
  # blocks of whole warps: on a device with warp shuffles (EMULATE=CUDA) the scan votes a warp's indices at a time
  rng = np.random.default_rng(rows + count)
  start = rng.standard_normal((rows, width)).astype(np.float32)
  index = rng.integers(-3, rows + 3, count).astype(np.int32)
  index[::3] = rows - 1   # repeats in the last row and the last block
  values = rng.standard_normal((count, width)).astype(np.float32)
  np.testing.assert_array_equal(_accumulate(start, index, values, device), _add_at(start, index, values))


class H200Like:   # the facts plan_index_accumulate reads of the CUDA renderer on an H200
  has_threads, has_local, max_threads, multiprocessors, vector_width, warp_size = True, True, 1024, 132, 4, 32
  local_memory_bytes = 48 * 1024


def test_plan_covers_every_row_and_feature_once():
  for rows, width, count in [(50304, 768, 16384), (50304, 768, 4096), (1000, 3, 17), (13, 1, 5), (4096, 64, 1),
                             (9, 8192, 130)]:
    plan = index_accumulate.plan_index_accumulate(rows, width, count, dtypes.float32, H200Like())
    assert plan.feature_blocks * plan.block_features == width and width % plan.block_features == 0
    assert plan.row_blocks * plan.row_groups * plan.row_slots >= rows
    assert plan.row_blocks * plan.row_groups * (plan.row_slots - 1) < rows   # no thread owns only rows past the end
    assert plan.threads <= H200Like.max_threads and plan.lanes in (1, 32) and plan.threads % plan.lanes == 0
    assert plan.windows * plan.window >= count and plan.window % plan.lanes == 0
    assert index_accumulate._fits_locally(plan, dtypes.float32, H200Like())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [np.int32, np.float16])
def test_other_dtypes(device, dtype):
  rng = np.random.default_rng(3)
  start = rng.integers(-5, 5, (6, 3)).astype(dtype)
  index = rng.integers(0, 6, 11).astype(np.int64)
  values = rng.integers(-5, 5, (11, 3)).astype(dtype)
  result = Tensor(start, device=device)._add_rows_at(Tensor(index, device=device), Tensor(values, device=device))
  np.testing.assert_array_equal(result.numpy(), _add_at(start, index, values))


def test_bool_scatter_add_is_a_logical_or():
  start = np.array([False, True, False, False])
  index = np.array([2, 2, 0], dtype=np.int32)
  result = Tensor(start).scatter_add(0, Tensor(index), Tensor(np.array([True, True, False]))).numpy()
  np.testing.assert_array_equal(result, np.array([False, True, True, False]))


def _zipf_indices(rng: np.random.Generator, rows: int, count: int, exponent: float) -> np.ndarray:
  """Text-like indices: row r drawn with probability ~ 1 / (r + 1) ** exponent, so a few neighbouring rows take most
  of the draws (a tokenizer's frequent tokens have small ids)."""
  weights = 1.0 / np.arange(1, rows + 1) ** exponent
  return rng.choice(rows, count, p=weights / weights.sum()).astype(np.int32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("threads_per_processor,rows", [(512, 301), (2, 389)])
def test_zipf_repeats_match_numpy_bitwise_run_to_run(device, threads_per_processor, rows, monkeypatch):
  # a few rows repeated hundreds of times, many times in a row of one thread's hits (the GPU adds them to its
  # carry, one read-modify-write of the table per change of row); with 2 threads per multiprocessor one block owns
  # every row (a shape of its own: a new kernel, not the cached one)
  monkeypatch.setattr(index_accumulate, "THREADS_PER_PROCESSOR", threads_per_processor)
  rng = np.random.default_rng(threads_per_processor)
  start = rng.standard_normal((rows, 4)).astype(np.float32)
  index = _zipf_indices(rng, rows, 400, 1.3)
  index[::50] = -1   # counts from the end: the last row, between the hot ones
  values = (rng.standard_normal((400, 4)) * 1e3).astype(np.float32)   # large: the order of the sums shows
  assert np.bincount(index[index >= 0]).max() > 80
  first = _accumulate(start, index, values, device)
  np.testing.assert_array_equal(first, _add_at(start, index, values))
  assert _accumulate(start, index, values, device).tobytes() == first.tobytes()


def test_plan_strides_rows_over_the_grid():
  plan = index_accumulate.plan_index_accumulate(50304, 768, 16384, dtypes.float32, H200Like())
  # row r's owner is block r mod B, row group (r div B) mod G, slot r div (B G): every row one owner, and
  # neighbouring rows (the hot ones of text) in different blocks
  rows = np.arange(50304)
  blocks, groups = rows % plan.row_blocks, (rows // plan.row_blocks) % plan.row_groups
  slots = rows // (plan.row_blocks * plan.row_groups)
  assert slots.max() < plan.row_slots
  owners = (blocks * plan.row_groups + groups) * plan.row_slots + slots
  assert len(np.unique(owners)) == 50304
  assert (blocks[1:] != blocks[:-1]).all()
  # the GPT-2 step's embedding gradient: the index array read once per block, a few hundred blocks
  assert plan.lanes == 32 and plan.row_blocks >= H200Like.multiprocessors and plan.feature_blocks == 1


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_run_to_run(device):
  rng = np.random.default_rng(11)
  start = np.zeros((16, 8), np.float32)
  index = rng.integers(0, 4, 200).astype(np.int32)   # heavy repeats: a float sum whose order shows in the bits
  values = (rng.standard_normal((200, 8)) * 1e3).astype(np.float32)
  first = _accumulate(start, index, values, device)
  for _ in range(2): assert _accumulate(start, index, values, device).tobytes() == first.tobytes()


@pytest.mark.parametrize("device", DEVICES)
def test_embedding_gradients_match_torch(device):
  rng = np.random.default_rng(1)
  vocab, width = 13, 6
  weight = rng.standard_normal((vocab, width)).astype(np.float32)
  tokens = rng.integers(0, vocab, (3, 7))
  tokens[0, :4] = 5   # repeated tokens
  upstream = rng.standard_normal((3, 7, width)).astype(np.float32)
  embedding = nn.Embedding(vocab, width)
  embedding.weight = Tensor(weight, requires_grad=True, device=device)
  (embedding(Tensor(tokens.astype(np.int32), device=device)) * Tensor(upstream, device=device)).sum().backward()
  torch_weight = torch.tensor(weight, requires_grad=True)
  (torch.nn.functional.embedding(torch.tensor(tokens), torch_weight) * torch.tensor(upstream)).sum().backward()
  np.testing.assert_allclose(embedding.weight.grad.numpy(), torch_weight.grad.numpy(), rtol=1e-6, atol=1e-6)


def _embedding_gradient_cost(vocab: int, width: int, tokens: int) -> tuple[int, int, int]:
  """(kernels, ops, bytes) of realizing an embedding table's gradient from a realized upstream gradient."""
  weight = Tensor(np.zeros((vocab, width), np.float32), requires_grad=True)
  index = Tensor(np.random.default_rng(0).integers(0, vocab, tokens).astype(np.int32)).realize()
  upstream = Tensor(np.ones((tokens, width), np.float32)).realize()
  weight[index].backward(upstream)
  GlobalCounters.reset()
  weight.grad.realize()
  return GlobalCounters.kernel_count, GlobalCounters.global_ops, GlobalCounters.global_mem


def test_no_one_hot_in_the_embedding_gradient():
  tokens, width = 64, 16
  small = _embedding_gradient_cost(32, width, tokens)
  large = _embedding_gradient_cost(2048, width, tokens)
  assert small[0] == large[0] == 1   # one indexed-accumulate kernel (the upstream gradient is realized)
  assert small[1] == large[1] == tokens * width   # one addition per gradient element, whatever the vocabulary
  # bytes: the table written once (and the upstream gradient and index read), not a table-sized pass per token
  assert large[2] <= 4 * (2048 * width + 2 * tokens * width + tokens)


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_scatter_add_matches_torch(dim):
  rng = np.random.default_rng(dim)
  self_values = rng.standard_normal((4, 5, 3)).astype(np.float32)
  index_shape = [3, 4, 2]
  index_shape[dim] = 6
  index = rng.integers(0, self_values.shape[dim], index_shape)
  source = rng.standard_normal(index_shape).astype(np.float32)
  x, src = Tensor(self_values, requires_grad=True), Tensor(source, requires_grad=True)
  result = x.scatter_add(dim, Tensor(index), src)
  result.square().sum().backward()
  torch_x, torch_src = torch.tensor(self_values, requires_grad=True), torch.tensor(source, requires_grad=True)
  expected = torch_x.scatter_add(dim, torch.tensor(index), torch_src)
  expected.square().sum().backward()
  np.testing.assert_allclose(result.numpy(), expected.detach().numpy(), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(x.grad.numpy(), torch_x.grad.numpy(), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(src.grad.numpy(), torch_src.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_scatter_add_index_smaller_than_src_and_out_of_range():
  self_values = np.zeros((3, 4), np.float32)
  source = np.arange(15, dtype=np.float32).reshape(3, 5)
  index = np.array([[0, 1, 2], [2, 2, 7]])   # 7 is outside: it adds nothing (a gather there reads 0)
  result = Tensor(self_values).scatter_add(0, Tensor(index), Tensor(source)).numpy()
  expected = self_values.copy()
  for i in range(2):
    for j in range(3):
      if index[i, j] < 3: expected[index[i, j], j] += source[i, j]
  np.testing.assert_array_equal(result, expected)


def test_scatter_reduce_add_and_index_add_match_torch():
  rng = np.random.default_rng(7)
  self_values = rng.standard_normal((5, 6)).astype(np.float32)
  index = rng.integers(0, 5, (4, 6))
  source = rng.standard_normal((4, 6)).astype(np.float32)
  result = Tensor(self_values).scatter(0, Tensor(index), Tensor(source), reduce="add").numpy()
  expected = torch.tensor(self_values).scatter_add(0, torch.tensor(index), torch.tensor(source)).numpy()
  np.testing.assert_allclose(result, expected, rtol=1e-6, atol=1e-6)

  positions = np.array([4, 0, 4, 4, 2, 0, 1])
  slices = rng.standard_normal((5, 7, 3)).astype(np.float32)
  target = rng.standard_normal((5, 5, 3)).astype(np.float32)
  x, src = Tensor(target, requires_grad=True), Tensor(slices, requires_grad=True)
  result = x.index_add(1, Tensor(positions), src, alpha=0.5)
  result.square().sum().backward()
  torch_x, torch_src = torch.tensor(target, requires_grad=True), torch.tensor(slices, requires_grad=True)
  expected = torch_x.index_add(1, torch.tensor(positions), torch_src, alpha=0.5)
  expected.square().sum().backward()
  np.testing.assert_allclose(result.numpy(), expected.detach().numpy(), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(x.grad.numpy(), torch_x.grad.numpy(), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(src.grad.numpy(), torch_src.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_index_add_checks_shapes():
  with pytest.raises(ValueError):
    Tensor.zeros(4, 3).index_add(0, Tensor([0, 1]), Tensor.ones(3, 3))


def test_scatter_add_ops_do_not_grow_with_the_target():
  # a one-hot would cost (targets x sources); the indexed accumulate one addition per source element
  rng = np.random.default_rng(2)
  index = Tensor(rng.integers(0, 16, (40,)).astype(np.int32)).realize()
  source = Tensor(rng.standard_normal(40).astype(np.float32)).realize()
  counts = []
  for size in (16, 4096):
    target = Tensor(np.zeros(size, np.float32)).realize()
    GlobalCounters.reset()
    target.scatter_add(0, index, source).realize()
    counts.append((GlobalCounters.kernel_count, GlobalCounters.global_ops))
  assert counts[0] == counts[1] == (1, 40)


def test_jitted_embedding_gradient_with_new_indices():
  from ourgrad import TinyJit
  rng = np.random.default_rng(4)
  embedding = nn.Embedding(50, 8)

  @TinyJit
  def gradient(tokens: Tensor, upstream: Tensor) -> Tensor:
    embedding.weight.grad = None
    embedding(tokens).backward(upstream)
    return embedding.weight.grad.realize()

  for _ in range(4):   # captured on the second call, replayed after: each call's own indices
    tokens = rng.integers(0, 50, (3, 5)).astype(np.int32)
    upstream = rng.standard_normal((3, 5, 8)).astype(np.float32)
    expected = np.zeros((50, 8), np.float32)
    np.add.at(expected, tokens.reshape(-1), upstream.reshape(-1, 8))
    np.testing.assert_array_equal(gradient(Tensor(tokens), Tensor(upstream)).numpy(), expected)


def test_symbolic_sizes_raise_a_clear_error():
  from ourgrad.errors import ShapeError
  from ourgrad.shape import Variable
  count = Variable("n", 1, 8).bind(3)
  index = Tensor(np.array([0, 1, 1, 2, 0, 0, 0, 0], np.int32)).shrink(((0, count),))
  rows = Tensor(np.ones((8, 2), np.float32)).shrink(((0, count), None))
  with pytest.raises(ShapeError, match="symbolic"):
    Tensor.zeros(4, 2)._add_rows_at(index, rows)


def test_scatter_add_assigned_in_place_keeps_lazy_readers_old_values():
  start = np.arange(12, dtype=np.float32).reshape(4, 3)
  index = np.array([[0, 1, 3], [0, 0, 3]], np.int32)
  x = Tensor(start).realize()
  reader = x + 1   # lazy, made before the write: it must see the old values
  x.assign(x.scatter_add(0, Tensor(index), Tensor(np.ones((2, 3), np.float32))))
  expected = start.copy()
  np.add.at(expected, (index, np.broadcast_to(np.arange(3), index.shape)), 1.0)
  np.testing.assert_array_equal(x.numpy(), expected)
  np.testing.assert_array_equal(reader.numpy(), start + 1)


@pytest.mark.skipif("PYTHON" not in DEVICES, reason="the PYTHON device runs the GPU lowering")
@pytest.mark.parametrize("rows,width,count,threads_per_processor",
                         [(301, 8, 400, 1024), (97, 256, 300, 2), (64, 4, 256, 1024), (9, 4096, 130, 1024),
                          (700, 12, 1000, 64)])   # (9, 4096): a row's features in several blocks
def test_hot_rows_through_the_carry_match_numpy_bitwise_run_to_run(rows, width, count, threads_per_processor,
                                                                   monkeypatch):
  # Zipf repeats: a hot row's hits run one after another in its owner's carry, others interleave (each change of row
  # stores the carry back and loads the next row), windows end inside the index array; np.add.at's order, every run
  monkeypatch.setattr(index_accumulate, "THREADS_PER_PROCESSOR", threads_per_processor)
  rng = np.random.default_rng(rows + count)
  start = rng.standard_normal((rows, width)).astype(np.float32)
  index = _zipf_indices(rng, rows, count, 1.2)
  index[::37] = -1   # counts from the end
  index[5::41] = rows + 3   # outside: adds nothing
  values = (rng.standard_normal((count, width)) * 1e3).astype(np.float32)   # large: the order shows in the bits
  first = _accumulate(start, index, values, "PYTHON")
  np.testing.assert_array_equal(first, _add_at(start, index, values))
  assert _accumulate(start, index, values, "PYTHON").tobytes() == first.tobytes()


def test_bfloat16_gradient_lowers_for_cuda() -> None:
  """An embedding's gradient from a bf16 upstream gradient (autocast's GPT-2 step) lowers for CUDA: its index
  computations load through the linearizer's vector-load path, whose source views have no tensor core to ask."""
  from ourgrad.codegen.lowering import build_kernel, lower_kernel
  from ourgrad.engine.schedule import create_schedule
  from ourgrad.ops import Ops
  from ourgrad.renderer.cuda import CUDARenderer
  data = np.random.default_rng(5)
  table = Tensor(data.standard_normal((512, 64)).astype(np.float32), device="PYTHON", requires_grad=True)
  tokens = Tensor(data.integers(0, 512, (4, 32)).astype(np.int32), device="PYTHON")
  upstream = Tensor(data.standard_normal((4, 32, 64)).astype(np.float32), device="PYTHON").cast(dtypes.bfloat16)
  (table[tokens].cast(dtypes.bfloat16) * upstream).float().sum().backward()
  renderer = CUDARenderer("sm_90")
  kernels = [build_kernel(item.ast, renderer) for item in create_schedule([table.grad.lazydata])
             if item.ast.op is not Ops.COPY]
  assert any(type(kernel).__name__ == "IndexAccumulateKernel" for kernel in kernels)
  for kernel in kernels: assert lower_kernel(kernel, renderer, "kernel").source


def test_gpu_kernel_reads_the_index_once_per_block() -> None:
  """GPT-2's embedding gradient lowered for CUDA: each thread reads `unroll` indices a window (the block reads the
  array once), and the walk loads its hits' source rows `batch` at a time before adding them."""
  from ourgrad.codegen.lowering import build_kernel
  from ourgrad.codegen.uops import UOps
  from ourgrad.engine.schedule import create_schedule
  from ourgrad.ops import Ops
  from ourgrad.renderer.cuda import CUDARenderer
  table = Tensor.empty(50304, 768, device="PYTHON", requires_grad=True)
  tokens = Tensor.empty(16, 1024, dtype=dtypes.int32, device="PYTHON")
  (table[tokens] * Tensor.empty(16, 1024, 768, device="PYTHON")).sum().backward()
  kernels = [build_kernel(item.ast, CUDARenderer("sm_90")) for item in create_schedule([table.grad.lazydata])
             if item.ast.op is not Ops.COPY]
  kernel = next(kernel for kernel in kernels if isinstance(kernel, index_accumulate.IndexAccumulateKernel))
  plan = kernel.plan
  assert plan is not None and plan.windows * plan.window >= 16384 and plan.lanes == 32
  uops = kernel.linearize()
  index_buffer = next(uop for uop in uops if uop.op is UOps.DEFINE_GLOBAL and uop.dtype == dtypes.int32)
  index_loads = [uop for uop in uops if uop.op is UOps.LOAD and uop.srcs[0] is index_buffer]
  assert len(index_loads) == plan.unroll
  row_buffer = next(uop for uop in uops
                    if uop.op is UOps.DEFINE_GLOBAL and uop.arg[0] != 0 and uop.dtype == dtypes.float32)
  row_loads = [uop for uop in uops if uop.op is UOps.LOAD and uop.srcs[0] is row_buffer]
  assert len(row_loads) == plan.batch * plan.vectors_per_thread and plan.batch == 8
