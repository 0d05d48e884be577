"""Split-K of a matmul-shaped reduce wherever its reduce axis is (lazy_reduce._split_matmul): a weight gradient as
autograd builds it sums a (tokens, out, in) product over axis 0, an einsum-like product may sum its middle axis, and
a plain matmul sums its last. The grid model decides the parts from the device (multiprocessors, tiles, K per part),
the product is rebuilt as (parts, ..., K / parts) from views of its factors, and on an H100 operand staging
(engine/operand_staging.py) copies a TF32 factor not read along K into (parts, M, K / parts) for one batched WGMMA
kernel; the consumer adds the parts.

Devices: the PYTHON interpreter as an H100 (`EMULATE=CUDA_SM90`, its WGMMA emulator running the kernels), as a GPU
without WGMMA (`EMULATE=CUDA`: the shared-tile split), and CLANG (whose own split is unchanged). Values against
numpy in float64; kernel counts pinned from the layouts. With CHECK_CUDA_RENDER=1 every kernel is also compiled by
NVRTC for sm_90.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

import ourgrad
from ourgrad import Tensor, dtypes
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.opt import matmul_grid, split_reduce, tensor_core_plans
from ourgrad.device import Device
from ourgrad.engine import operand_staging
from ourgrad.engine.realize import run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.helpers import _float32_matmul_precision
from ourgrad.lazy import LazyBuffer
from ourgrad.lazy_reduce import _matmul_dims
from ourgrad.ops import Ops

from helpers import device_opens, emulated_gpu_tf32

# where the reduce axis sits in the product: (numpy reference, the ourgrad product, operand shapes for M, N, K),
# each operand's K-major-ness (whether it is read along K with stride 1) for the staged-copy count
Position = tuple[Callable[..., np.ndarray], Callable[..., Tensor], Callable[[int, int, int], tuple[tuple, tuple]],
                 tuple[bool, bool]]
POSITIONS: dict[str, Position] = {
  # a weight gradient g^T x: (K, M, N) summed over axis 0, both operands stored token-major
  "first": (lambda a, b: a.T @ b, lambda a, b: (a.reshape(a.shape[0], a.shape[1], 1) *
                                                 b.reshape(b.shape[0], 1, b.shape[1])).sum(0),
            lambda m, n, k: ((k, m), (k, n)), (False, False)),
  # (M, K, N) summed over axis 1: A read along K, B along N
  "middle": (lambda a, b: a @ b, lambda a, b: (a.reshape(a.shape[0], a.shape[1], 1) *
                                                b.reshape(1, b.shape[0], b.shape[1])).sum(1),
             lambda m, n, k: ((m, k), (k, n)), (True, False)),
  # x @ W^T: (M, N, K) summed over its last axis, both along K
  "last": (lambda a, b: a @ b.T, lambda a, b: a @ b.T, lambda m, n, k: ((m, k), (n, k)), (True, True)),
  # a batch of 2 weight gradients: (2, K, M, N) summed over axis 1
  "batched_first": (lambda a, b: np.einsum("bkm,bkn->bmn", a, b),
                    lambda a, b: (a.reshape(*a.shape, 1) * b.reshape(b.shape[0], b.shape[1], 1, b.shape[2])).sum(1),
                    lambda m, n, k: ((2, k, m), (2, k, n)), (False, False)),
}


def _inputs(shapes: tuple[tuple, tuple], seed: int) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  return tuple(rng.standard_normal(shape).astype(np.float32) for shape in shapes)


def _relative_error(got: np.ndarray, want: np.ndarray) -> float:
  return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


def _kernels(out: Tensor, run: bool = False) -> list[tuple[Kernel, tuple[int, ...]]]:
  """The kernels of `out`'s schedule with the heuristic's opts on the PYTHON device's renderer, each with its loop
  shape before them; `run`: the schedule run after."""
  schedule = create_schedule([out.lazydata])
  kernels = []
  for item in schedule:
    if item.ast.op is Ops.COPY: continue
    kernel = Kernel(item.ast, Device["PYTHON"].renderer)
    shape = kernel.full_shape
    kernel.hand_coded_optimizations()
    kernels.append((kernel, shape))
  if run: run_schedule(schedule)
  return kernels


# ================================================================ the product's dims, any reduce axis

@pytest.mark.parametrize("position", list(POSITIONS))
def test_matmul_dims_at_every_reduce_axis(position: str) -> None:
  """(batch, M, N, K) of the product whatever the position of its reduce axis: M the side whose own axis comes
  first in the loop, the batch counted apart."""
  _, build, shapes, _ = POSITIONS[position]
  a, b = (Tensor.empty(*shape, device="CLANG") for shape in shapes(48, 80, 96))
  product = build(a, b).lazydata
  while product.base.op is not Ops.SUM: product = product.base.srcs[0]   # the reduce under any reshape
  reduce = product.base
  assert _matmul_dims(reduce.srcs[0], reduce.arg) == (2 if position.startswith("batched") else 1, 48, 80, 96)


# ================================================================ the grid model's parts

@pytest.mark.parametrize("itemsize", [4, 2], ids=["tf32", "bf16"])
def test_split_only_where_the_whole_grid_leaves_multiprocessors_idle(itemsize: int) -> None:
  """On 132 multiprocessors: GPT-2's weight gradients (the fastest whole grid fills 55-82% of a wave) split at
  K = 4096 and 16384 alike; the lm-head input gradient (128 tiles of 128 x 192: 97% of a wave) does not, whatever
  its K (the split, 4 x 128 x 256, measured 16% slower on the H200 in TF32)."""
  shared = 227 * 1024
  for m, n in ((768, 768), (2304, 768), (768, 3072)):
    whole = matmul_grid.fastest_wgmma_grid(1, m, n, 16384, itemsize, 132, shared)
    assert matmul_grid.wave_fill(whole, 1, m, n, 132) < matmul_grid.WGMMA_SPLIT_MAX_FILL
    assert matmul_grid.wgmma_split_parts(1, m, n, 16384, itemsize, 132, shared) > 1, (m, n)
  assert matmul_grid.wgmma_split_parts(1, 768, 768, 4096, itemsize, 132, shared) > 1
  assert matmul_grid.wgmma_split_parts(1, 4096, 768, 50304, itemsize, 132, shared) == 1


# ================================================================ on an emulated H100 (WGMMA)

@pytest.fixture
def hopper(monkeypatch):
  """The PYTHON device as an H100 with TF32 allowed; WGMMA for small matmuls and split reduces for a few outputs
  (a 128 x 128 output, K = 2048, splits into parts by the grid model as a GPT-2 weight gradient does)."""
  for module in (tensor_core_plans, operand_staging): monkeypatch.setattr(module, "WGMMA_MIN_WORK", 1)
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts(2, 2048))
  with emulated_gpu_tf32(monkeypatch, "CUDA_SM90"): yield


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("position", list(POSITIONS))
def test_split_wgmma_at_every_reduce_axis(hopper, position: str, precision: str) -> None:
  """The product splits into parts (one batched WGMMA kernel, its batch the parts times the product's batch), a
  TF32 operand not read along K staged as (parts, M, K / parts) by one copy each (bfloat16 operands need none),
  the parts added by one kernel; values as numpy's within TF32's (bfloat16's) error."""
  reference, build, shapes, k_major = POSITIONS[position]
  a_np, b_np = _inputs(shapes(128, 128, 2048), seed=3)
  if precision == "bf16": _float32_matmul_precision[0] = "highest"   # the 16-bit plan needs no TF32
  dtype = dtypes.bfloat16 if precision == "bf16" else dtypes.float32
  a, b = (Tensor(x, device="PYTHON").cast(dtype).realize() for x in (a_np, b_np))
  out = build(a.float(), b.float())   # (autocast's product: the factors widened in the matmul)
  kernels = [kernel for kernel, _ in _kernels(out, run=True)]
  wgmma = [kernel.wgmma[0] for kernel in kernels if kernel.wgmma is not None]
  assert len(wgmma) == 1, [kernel.name for kernel in kernels]
  batch = 2 if position.startswith("batched") else 1
  parts = wgmma[0].batch // batch
  assert parts > 1 and wgmma[0].k * parts == 2048, wgmma[0]
  staged = 0 if precision == "bf16" else k_major.count(False)
  assert len(kernels) == staged + 2, [kernel.name for kernel in kernels]   # the copies, the parts, their sum
  if precision == "bf16": a_np, b_np = (x.float().numpy() for x in (a, b))
  error = _relative_error(out.numpy(), reference(a_np.astype(np.float64), b_np.astype(np.float64)))
  assert error < (1e-2 if precision == "bf16" else 2e-3), error


def test_gpt2_weight_gradients_split_by_the_grid(hopper, monkeypatch) -> None:
  """GPT-2's attention projection weight gradient (768 x 768) as autograd builds it (a (tokens, out, in) product
  summed over the tokens) splits by the grid model on an H100's 132 multiprocessors, whatever K: in TF32 at 4096
  tokens (both operands staged as (parts, 768, 4096 / parts)) and in bfloat16 at 16384 tokens, where it ran whole on
  72 CTAs before. Scheduled only."""
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", None)
  for module in (tensor_core_plans, operand_staging): monkeypatch.setattr(module, "WGMMA_MIN_WORK", 512 ** 3)
  for precision, tokens in (("tf32", 4096), ("bf16", 16384)):
    _float32_matmul_precision[0] = "high" if precision == "tf32" else "highest"
    dtype = dtypes.float32 if precision == "tf32" else dtypes.bfloat16
    x = Tensor.empty(tokens, 768, dtype=dtype, device="PYTHON")
    g = Tensor.empty(tokens, 768, dtype=dtype, device="PYTHON")
    w = Tensor.empty(768, 768, device="PYTHON", requires_grad=True)
    (x.float().linear(w) * g.float()).sum().backward()
    kernels = _kernels(w.grad)
    wgmma = [kernel.wgmma[0] for kernel, _ in kernels if kernel.wgmma is not None]
    assert len(wgmma) == 1 and wgmma[0].batch > 1, (precision, [kernel.name for kernel, _ in kernels])
    parts = wgmma[0].batch
    # the kernels besides the product: the staged copies (their loop shape: the copy's) and the parts' sum
    others = sorted(shape for kernel, shape in kernels if kernel.wgmma is None)
    staged = [(parts, 768, tokens // parts)] * 2 if precision == "tf32" else []
    assert others == sorted(staged + [(768 * 768,)]), (precision, others)


# ================================================================ a GPU without WGMMA, and CLANG

@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("device", ["CUDA_SM80", "CLANG"])
def test_split_at_every_reduce_axis_odd_sizes(monkeypatch, position: str, device: str) -> None:
  """Odd sizes (48 x 80, K = 1536) in float32: on a GPU without WGMMA (the PYTHON device as CUDA, the grid model's
  thresholds lowered to this size) the product splits into parts added by one kernel (two kernels, one without the
  split); on CLANG the CPU's own rule. Values as numpy's."""
  reference, build, shapes, _ = POSITIONS[position]
  a_np, b_np = _inputs(shapes(48, 80, 1536), seed=5)
  want = reference(a_np.astype(np.float64), b_np.astype(np.float64))
  if device == "CLANG":
    a, b = (Tensor(x, device="CLANG") for x in (a_np, b_np))
    assert _relative_error(build(a, b).numpy(), want) < 1e-5
    return
  monkeypatch.setattr(matmul_grid, "GRID_MIN_MACS", 1)
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts(2, 2048))
  with emulated_gpu_tf32(monkeypatch, "CUDA"):
    ourgrad.set_float32_matmul_precision("highest")
    a, b = (Tensor(x, device="PYTHON").realize() for x in (a_np, b_np))
    items = [item for item in create_schedule([build(a, b).lazydata]) if item.ast.op is not Ops.COPY]
    assert len(items) == 2, items   # the parts, their sum
    assert _relative_error(build(a, b).numpy(), want) < 1e-5


# ================================================================ on an H100/H200

HOPPER = device_opens("CUDA") and getattr(Device["CUDA"].renderer, "has_wgmma", False)


@pytest.mark.skipif(not HOPPER, reason="needs CUDA on an sm_90 GPU (H100/H200)")
@pytest.mark.parametrize("precision, tokens", [("tf32", 4096), ("bf16", 16384)])
def test_cuda_gpt2_projection_weight_gradient(precision: str, tokens: int) -> None:
  """On the GPU, GPT-2's attention projection weight gradient (768 x 768) as autograd builds it, split by the grid
  model (TF32: operands staged as (parts, 768, K / parts); bf16 read in place): values as torch's in float64."""
  _float32_matmul_precision[0] = "high" if precision == "tf32" else "highest"
  try:
    dtype = dtypes.float32 if precision == "tf32" else dtypes.bfloat16
    x_np, g_np = _inputs(((tokens, 768), (tokens, 768)), seed=9)
    x, g = (Tensor(value, device="CUDA").cast(dtype).realize() for value in (x_np, g_np))
    w = Tensor(np.zeros((768, 768), np.float32), device="CUDA", requires_grad=True)
    (x.float().linear(w) * g.float()).sum().backward()
    got = w.grad.numpy()
    x64, g64 = (value.float().numpy().astype(np.float64) for value in (x, g))
    assert _relative_error(got, g64.T @ x64) < (1e-2 if precision == "bf16" else 3e-3)
  finally:
    _float32_matmul_precision[0] = None


def test_remembered_split_choices_follow_the_thresholds(monkeypatch) -> None:
  """The lazy layer asks the grid model for every matmul it builds, each eager step again: the choices are
  remembered, keyed by the module's thresholds too, so a changed threshold is a new choice and a repeated question
  gets the model's answer (the unremembered function's)."""
  shared = 227 * 1024
  shapes = ((1, 768, 768, 4096), (1, 4096, 768, 50304), (1, 2304, 768, 16384), (1, 2048, 384, 1536))
  for _ in range(2):
    for shape in shapes:
      fresh = matmul_grid._remembered_wgmma_split_parts.__wrapped__(*shape, 4, 132, shared, matmul_grid._tunables())
      assert matmul_grid.wgmma_split_parts(*shape, 4, 132, shared) == fresh
      fresh = matmul_grid._remembered_split_k_parts.__wrapped__(*shape, 132, matmul_grid._tunables())
      assert matmul_grid.split_k_parts(*shape, 132) == fresh
  assert matmul_grid.wgmma_split_parts(1, 768, 768, 4096, 4, 132, shared) > 1
  monkeypatch.setattr(matmul_grid, "SPLIT_MIN_K", 1 << 20)
  assert matmul_grid.wgmma_split_parts(1, 768, 768, 4096, 4, 132, shared) == 1


def test_repeated_split_product_is_built_from_its_factors(monkeypatch) -> None:
  """A matmul built again (an eager step's second call): reduce_plan remembered its split, and the partial products are
  built from the factors' views without the whole (48, 80, 1536) product the first build made and threw away; the
  same kernels, the same values bit for bit."""
  a_np, b_np = _inputs(((48, 1536), (80, 1536)), seed=6)
  monkeypatch.setattr(matmul_grid, "GRID_MIN_MACS", 1)
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts(2, 2048))
  made: list[tuple] = []
  create = LazyBuffer.create_base
  monkeypatch.setattr(LazyBuffer, "create_base", staticmethod(
    lambda *args, **kwargs: made.append((args[3], args[1])) or create(*args, **kwargs)))
  with emulated_gpu_tf32(monkeypatch, "CUDA"):
    ourgrad.set_float32_matmul_precision("highest")
    a, b = (Tensor(x, device="PYTHON").realize() for x in (a_np, b_np))
    outcome = []
    for _ in range(2):
      made.clear()
      out = a @ b.T
      whole = [shape for op, shape in made if op is Ops.MUL and shape == (48, 80, 1536)]
      values = out.numpy().tobytes()
      items = [item.ast for item in create_schedule([(a @ b.T).lazydata]) if item.ast.op is not Ops.COPY]
      outcome.append((len(whole), items, values))
  assert outcome[0][0] == 1 and outcome[1][0] == 0, outcome   # (the first build's product, thrown away by the split)
  assert outcome[0][1] == outcome[1][1] and len(outcome[1][1]) == 2 and outcome[0][2] == outcome[1][2]
  want = a_np.astype(np.float64) @ b_np.astype(np.float64).T
  assert _relative_error(np.frombuffer(outcome[1][2], np.float32).reshape(48, 80), want) < 1e-5
