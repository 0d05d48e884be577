"""Vocabulary-wide rows (docs/fusion.md "Long rows"): softmax, log_softmax, logsumexp and cross-entropy over rows of
50k+ classes, values and gradients against PyTorch on the CPU, and the kernels they take.

On a GPU renderer a block streams its row: the max and the sum of exp(x - max) share one pass (online: the sum is
rescaled as the running max grows, codegen/online_rows.py), cross-entropy's target logit is one indexed load a row,
and the gradient reads the logsumexp saved by the forward (F.LogSumExpGrad): the loss is one row kernel (plus the
mean over rows) and the gradient one elementwise kernel. The values run on the default device and on the PYTHON
device (a GPU renderer: under `DEVICE=PYTHON EMULATE=CUDA` CUDA's limits); the kernel pins lower for CUDA's renderer.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest
import torch

from ourgrad import Tensor
from ourgrad.codegen.opt import split_reduce
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.online_rows import group_row_passes, shift_terms
from ourgrad.codegen.uops import UOps
from ourgrad.device import Device
from ourgrad.engine.kernel_walk import MAX_ROW_FUSION_LENGTH
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.ops import REDUCE_OPS, LazyOp, Ops
from ourgrad.renderer.cuda import CUDARenderer

@pytest.fixture(autouse=True)
def no_split_k(monkeypatch: pytest.MonkeyPatch) -> None:
  """A GPU splits a reduce of few long rows across blocks first (codegen/opt/split_reduce.py: 3 rows leave most
  multiprocessors idle); here the split is off (a device of one multiprocessor is never idle), so that the rows run
  as the row kernel that streams them (what GPT-2's 4096 rows get)."""
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts(1, 2048, 0))


# (rows, classes): GPT-2's vocabulary (a multiple of 4: float4 units) and an odd width beyond 65536 (scalar units,
# longer than a CPU row kernel takes)
SHAPES = [(3, 50304), (2, 70001)]
DEVICES = [None, "PYTHON"]   # the default device, and a GPU renderer's lowering


def _logits(shape: tuple[int, int]) -> np.ndarray:
  # a spread like a language model's logits, and one large value a row (the running max jumps mid-row)
  logits = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32) * 3
  logits[:, shape[1] * 2 // 3] += 20
  return logits


ROW_FUNCTIONS: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
  "softmax": (lambda x: x.softmax(-1), lambda t: t.softmax(-1)),
  "log_softmax": (lambda x: x.log_softmax(-1), lambda t: t.log_softmax(-1)),
  "logsumexp": (lambda x: x.logsumexp(-1), lambda t: t.logsumexp(-1)),
}


def _assert_close(ours: np.ndarray, truth: np.ndarray, float32: np.ndarray, spread: float = 1e-5) -> None:
  """`ours` against the float64 `truth`: within 1e-4 relative, or within a few times PyTorch's own float32 error,
  or within `spread` of the largest magnitude (softmax's gradient at the peak is a difference of near-equal terms)."""
  scale = float(np.abs(truth).max())
  allowed = 1e-4 * np.abs(truth) + 4 * np.abs(float32 - truth) + spread * scale
  worst = np.unravel_index(np.argmax(np.abs(ours - truth) - allowed), truth.shape)
  assert np.all(np.abs(ours - truth) <= allowed), f"at {worst}: {ours[worst]} vs {truth[worst]} (float32 torch " \
                                                  f"{float32[worst]})"


def _torch_run(theirs: Callable[[torch.Tensor], torch.Tensor], logits: np.ndarray, upstream: np.ndarray,
               dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
  t = torch.tensor(logits, dtype=dtype, requires_grad=True)
  out = theirs(t)
  (out * torch.tensor(upstream, dtype=dtype)).sum().backward()
  assert t.grad is not None
  return out.detach().numpy(), t.grad.numpy()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", sorted(ROW_FUNCTIONS))
def test_row_function_and_gradient_match_torch(name: str, shape: tuple[int, int], device: str | None):
  ours, theirs = ROW_FUNCTIONS[name]
  logits = _logits(shape)
  x = Tensor(logits, device=device, requires_grad=True)
  out = ours(x)
  upstream = np.random.default_rng(1).standard_normal(out.shape).astype(np.float32)
  (out * Tensor(upstream, device=device)).sum().backward()
  assert x.grad is not None
  truth, truth_grad = _torch_run(theirs, logits, upstream, torch.float64)
  single, single_grad = _torch_run(theirs, logits, upstream, torch.float32)
  # a CPU's rows beyond its row kernels (MAX_ROW_FUSION_LENGTH) are plain reduce kernels, each row's float32 sum in
  # one accumulator: ~1e-5 relative error over 70001 terms, which softmax's gradient at the peak amplifies
  long_cpu_row = not Device[x.device].renderer.has_threads and shape[1] > MAX_ROW_FUSION_LENGTH
  _assert_close(out.numpy(), truth, single)
  _assert_close(x.grad.numpy(), truth_grad, single_grad, 1e-3 if long_cpu_row else 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1}, {"reduction": "sum"}])
def test_cross_entropy_and_gradient_match_torch(shape: tuple[int, int], options: dict, device: str | None):
  logits = _logits(shape)
  target = np.random.default_rng(2).integers(0, shape[1], shape[0]).astype(np.int32)
  target[0] = -100   # an ignored sample
  x = Tensor(logits, device=device, requires_grad=True)
  loss = x.cross_entropy(Tensor(target, device=device), **options)
  loss.backward()
  t = torch.tensor(logits, requires_grad=True)
  expected = torch.nn.functional.cross_entropy(t, torch.tensor(target, dtype=torch.long), **options)
  expected.backward()
  np.testing.assert_allclose(loss.numpy(), expected.detach().numpy(), rtol=1e-5)
  assert x.grad is not None and t.grad is not None
  np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), rtol=1e-4, atol=float(t.grad.abs().max()) * 1e-5)
  assert not x.grad.numpy()[0].any(), "an ignored sample has no gradient"


# ---------------------------------------------------------------- kernels on a GPU renderer

def _kernels(items: list[ScheduleItem]) -> list[ScheduleItem]:
  return [item for item in items if item.ast.op not in (Ops.COPY,)]


def _cuda_uops(item: ScheduleItem) -> list:
  kernel = Kernel(item.ast, CUDARenderer())
  kernel.hand_coded_optimizations()
  return linearize(kernel)


def _row_loops(item: ScheduleItem) -> int:
  return sum(1 for uop in _cuda_uops(item) if uop.op is UOps.RANGE)


def _row_loops_of(ast: LazyOp, item: ScheduleItem) -> int:
  """The loops of a kernel of `ast` (a ride-along's host) for CUDA's renderer."""
  kernel = Kernel(ast, CUDARenderer())
  kernel.hand_coded_optimizations()
  return sum(1 for uop in linearize(kernel) if uop.op is UOps.RANGE)


def _reads_whole_rows(item: ScheduleItem, size: int) -> bool:
  return any(buffer.size == size for buffer in item.inputs)


def _rider(item: ScheduleItem) -> LazyOp | None:
  return item.ast.srcs[1] if item.ast.op is Ops.RIDE_ALONG else None


def _host(item: ScheduleItem) -> LazyOp: return item.ast.srcs[0] if item.ast.op is Ops.RIDE_ALONG else item.ast


def _cross_entropy_items(rows: int, classes: int, device: str = "PYTHON") -> list[ScheduleItem]:
  x = Tensor.empty(rows, classes, device=device, requires_grad=True)
  target = Tensor.empty(rows, dtype="int32", device=device)
  loss = x.cross_entropy(target)
  loss.backward()
  assert x.grad is not None
  return _kernels(create_schedule([loss.lazydata, x.grad.lazydata]))


def test_cross_entropy_is_one_kernel_forward_and_one_backward():
  """GPT-2's loss at its vocabulary (4096 tokens x 50304): 2 kernels. The logsumexp row kernel reads the logits once
  (one pass: max, sum of exps); the gradient (softmax - one_hot) * scale is one elementwise kernel reading the saved
  logsumexp. The loss's two reduces to one value each ride in the first block of one of them (engine/ride_along.py):
  the count of samples not ignored (the mean's divisor, which the gradient's scale reads) in the row kernel, the
  mean over rows of logsumexp - picked logit (4096 indexed loads) in the gradient's kernel."""
  rows, classes = 4096, 50304
  items = _cross_entropy_items(rows, classes)
  assert len(items) == 2 and all(item.ast.op is Ops.RIDE_ALONG for item in items)
  forward, backward = items
  assert forward.outputs[0].size == rows and _row_loops_of(_host(forward), forward) == 1, \
    "logsumexp: one pass over each row"
  count, mean = _rider(forward), _rider(backward)
  assert count is not None and mean is not None
  assert not any(node.op is Ops.LOAD and len(node.srcs) == 2 for node in count.walk()), "the count reads the targets"
  assert any(node.op is Ops.LOAD and len(node.srcs) == 2 for node in mean.walk()), "the mean gathers picked logits"
  assert backward.outputs[0].size == rows * classes and backward.outputs[1].size == 1
  assert not any(node.op in REDUCE_OPS for node in _host(backward).walk()), "the gradient is elementwise"
  assert _row_loops_of(_host(backward), backward) == 0


def test_cross_entropy_without_riding_is_four_kernels(monkeypatch: pytest.MonkeyPatch):
  """RIDE_ALONG=0: the count and the mean are kernels of their own."""
  monkeypatch.setenv("RIDE_ALONG", "0")
  items = _cross_entropy_items(4096, 50304)
  assert len(items) == 4 and sorted(item.outputs[0].size for item in items) == [1, 1, 4096, 4096 * 50304]


def test_cross_entropy_loss_alone_is_one_row_kernel_and_the_mean():
  x = Tensor.empty(4096, 50304, device="PYTHON")
  items = _kernels(create_schedule([x.cross_entropy(Tensor.empty(4096, dtype="int32", device="PYTHON")).lazydata]))
  assert len(items) == 2 and items[0].outputs[0].size == 4096 and _row_loops(items[0]) == 1
  assert items[1].outputs[0].size == 1


@pytest.mark.parametrize("name, passes", [("softmax", 2), ("log_softmax", 2), ("logsumexp", 1)])
def test_long_gpu_rows_are_one_kernel_with_an_online_pass(name: str, passes: int):
  """A row of 50304 (or 70001) floats is one kernel: the max and the sum of exps in one pass, then the store's pass
  where the output is per element."""
  for classes in (50304, 70001):
    items = _kernels(create_schedule([ROW_FUNCTIONS[name][0](Tensor.empty(4096, classes, device="PYTHON")).lazydata]))
    assert len(items) == 1 and _row_loops(items[0]) == passes


# ---------------------------------------------------------------- the pass grouping (codegen/online_rows.py)

def _row_reduces(out: Tensor) -> list:
  ast = create_schedule([out.lazydata])[-1].ast
  return Kernel(ast, CUDARenderer()).reduceops


def test_softmax_max_and_sum_share_a_pass_online():
  reduces = _row_reduces(Tensor.empty(4096, 50304, device="PYTHON").softmax(-1))
  passes = group_row_passes(reduces)
  assert len(passes) == 1 and len(passes[0].online) == 1 and passes[0].peaks()[0].op is Ops.MAX_REDUCE
  peak, terms = next(iter(passes[0].online.values()))
  assert [term for _, term in terms] == [peak]
  assert terms[0][0] == pytest.approx(-1 / np.log(2), rel=1e-6), "exp(x - max) = exp2((x - max) / ln 2)"


def test_a_sum_reading_the_max_outside_exp_takes_a_second_pass():
  x = Tensor.empty(4096, 50304, device="PYTHON")
  shifted = x - x.max(-1, keepdim=True)
  reduces = _row_reduces(shifted.square().sum(-1))   # (x - max)^2 is no exp2 factor: no rescale gives it
  assert [len(found.reduces) for found in group_row_passes(reduces)] == [1, 1]
  assert shift_terms(reduces[1].srcs[0], reduces[0]) is None


def test_independent_reduces_share_a_pass():
  x = Tensor.empty(4096, 50304, device="PYTHON")
  reduces = _row_reduces(x.sum(-1, keepdim=True) * x.max(-1, keepdim=True) + x)
  assert [len(found.reduces) for found in group_row_passes(reduces)] == [2]


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_categorical_crossentropy_as_gpt2_calls_it(device: str | None):
  """extra/models/gpt2.py: logits (B, T, V) flattened to (B * T, V), targets flattened, -1 ignored."""
  batch, tokens, vocab = 2, 3, 50304
  logits = _logits((batch * tokens, vocab)).reshape(batch, tokens, vocab)
  target = np.random.default_rng(3).integers(0, vocab, (batch, tokens)).astype(np.int32)
  target[1, 2] = -1
  x = Tensor(logits, device=device, requires_grad=True)
  loss = x.reshape(-1, vocab).sparse_categorical_crossentropy(Tensor(target, device=device).reshape(-1))
  loss.backward()
  t = torch.tensor(logits, requires_grad=True)
  expected = torch.nn.functional.cross_entropy(t.reshape(-1, vocab), torch.tensor(target, dtype=torch.long).reshape(-1),
                                               ignore_index=-1)
  expected.backward()
  np.testing.assert_allclose(loss.numpy(), expected.detach().numpy(), rtol=1e-5)
  assert x.grad is not None and t.grad is not None
  np.testing.assert_allclose(x.grad.numpy(), t.grad.numpy(), rtol=1e-4, atol=float(t.grad.abs().max()) * 1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_of_very_negative_and_masked_values(device: str | None):
  """The online sum starts at 0 relative to a running max of -inf: logsumexp's shift (where(isinf(max), 0, max)) is
  0 there, and rescaling to a max of -1000 would multiply 0 by exp2(1443) = inf (also in the PYTHON device's float64
  arithmetic). Rows of values around -1000, and rows with -inf entries (a masked row), against PyTorch."""
  logits = _logits((3, 50304)) - 1000
  logits[1, :30000] = -np.inf
  x = Tensor(logits, device=device)
  if device is not None: assert len(_kernels(create_schedule([x.logsumexp(-1).lazydata]))) == 1, "the row kernel"
  np.testing.assert_allclose(x.logsumexp(-1).numpy(), torch.tensor(logits).logsumexp(-1).numpy(), rtol=1e-6)
  np.testing.assert_allclose(x.softmax(-1).numpy(), torch.tensor(logits).softmax(-1).numpy(), rtol=1e-4, atol=1e-9)


def test_a_sum_of_exp_of_another_value_than_the_max_takes_a_second_pass():
  """exp(y - max(x)): an element with x = -inf may have a finite y, which adds exp(y - max) against the final max;
  no online rule gives that while the running max is -inf, so the sum waits for the max."""
  x, y = Tensor.empty(4096, 50304, device="PYTHON"), Tensor.empty(4096, 50304, device="PYTHON")
  reduces = _row_reduces((y - x.max(-1, keepdim=True)).exp().sum(-1))
  assert [len(found.reduces) for found in group_row_passes(reduces)] == [1, 1]
