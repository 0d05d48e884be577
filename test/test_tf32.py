"""TensorFloat-32 tensor cores for float32 matmuls, only where the user allows them.

`ourgrad.set_float32_matmul_precision("high")` (or TF32=1) lets float32 matmuls and convolutions use
`mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`; "highest" (the default) never does. TC kernels run on the
PYTHON device with CUDA's limits (`PythonRenderer("CUDA")`, as `DEVICE=PYTHON EMULATE=CUDA`), whose interpreter
gathers each warp's fragments with the PTX ISA's maps and rounds the inputs to TF32 as cvt.rna.tf32.f32 does. Each
result is checked against two independent references: a numpy model of TF32 (inputs rounded with frexp arithmetic,
products summed in float64: tight) and PyTorch's float32 matmul on the CPU (a TF32-sized tolerance). Every TC
kernel is also rendered as CUDA C++ and compiled with NVRTC when it is installed; the DEVICE=CUDA tests at the end
skip without a GPU.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import ourgrad
from ourgrad import Tensor, TinyJit, dtypes
from ourgrad.codegen.kernel import Kernel, KernelOptError, Opt, OptOps
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.opt import tensor_core_plans
from ourgrad.codegen.opt.beam_cache import cache_key
from ourgrad.codegen.tensor_cores import CUDA_TENSOR_CORES, FragmentMaps, evaluate, tf32_round
from ourgrad.codegen.uops import UOps
from ourgrad.codegen.wgmma_tiles import WgmmaMatmul, render_wgmma_matmul
from ourgrad.device import Buffer, Device
from ourgrad.engine import realize
from ourgrad.engine.realize import compile_kernel, run_schedule
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.errors import PrecisionError
from ourgrad.helpers import _float32_matmul_precision, get_float32_matmul_precision, tf32_allowed
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer
from ourgrad.runtime.wgmma_emulator import emulate_wgmma_matmul

from helpers import device_opens, nvrtc_compiler

DEVICE = "PYTHON"
TF32_CHOICE = 2   # CUDA_TENSOR_CORES[2]
TF32_MMA = "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"
NVRTC = nvrtc_compiler()


@pytest.fixture(autouse=True)
def _precision_restored(monkeypatch):
  """Each test starts at the default precision (no TF32 variable, set_float32_matmul_precision not called)."""
  monkeypatch.delenv("TF32", raising=False)
  _float32_matmul_precision[0] = None
  yield
  _float32_matmul_precision[0] = None


# ================================================================ the numpy model of TF32

def tf32_model(values: np.ndarray) -> np.ndarray:
  """float32 values rounded to 10 mantissa bits, to nearest with ties away from zero, by frexp arithmetic in float64
  (independent of tensor_cores.tf32_round's bit manipulation)."""
  values = np.asarray(values, np.float64)
  mantissa, exponent = np.frexp(values)   # |mantissa| in [0.5, 1): 11 significant bits are mantissa * 2^11
  scaled = mantissa * 2.0 ** 11
  rounded = np.sign(scaled) * np.floor(np.abs(scaled) + 0.5)
  return np.ldexp(rounded, exponent - 11)


def tf32_matmul_model(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  return np.matmul(tf32_model(a), tf32_model(b))


def test_tf32_round_matches_the_model() -> None:
  rng = np.random.default_rng(0)
  values = np.concatenate([rng.standard_normal(4096) * 10.0 ** rng.integers(-30, 30, 4096),
                           [0.0, -0.0, 1.0, 1 + 2 ** -11, -(1 + 2 ** -11), 1 + 3 * 2 ** -11, 2 ** -126, 3e38]])
  values = values.astype(np.float32)
  np.testing.assert_array_equal(tf32_round(values).astype(np.float64), tf32_model(values))
  assert tf32_round(np.float32([1 + 2 ** -11]))[0] == 1 + 2 ** -10   # a tie goes away from zero
  special = tf32_round(np.float32([np.inf, -np.inf, np.nan]))
  assert special[0] == np.inf and special[1] == -np.inf and np.isnan(special[2])


# ================================================================ the fragment maps against the PTX ISA's table

def test_tf32_fragment_maps_follow_the_ptx_isa() -> None:
  """m16n8k8 .tf32 as the PTX ISA lists it: a0..a3 at row groupID (+8 for a1, a3), column threadID_in_group (+4 for
  a2, a3); b0, b1 at row threadID_in_group (+4 for b1), column groupID; each map covers its matrix once."""
  tc = CUDA_TENSOR_CORES[TF32_CHOICE]
  assert (tc.dims, tc.dtype_in, tc.a_elements, tc.b_elements, tc.c_elements) == ((16, 8, 8), dtypes.float32, 4, 2, 4)
  for lane in range(32):
    group, quad = lane >> 2, lane % 4
    for element in range(4):
      row, column = group + 8 * (element % 2), quad + 4 * (element // 2)
      assert tuple(evaluate(c, group, quad) for c in tc.a_position(element)) == (row, column)
    for element in range(2):
      assert tuple(evaluate(c, group, quad) for c in tc.b_position(element)) == (quad + 4 * element, group)
  for position_of, count, shape in ((tc.a_position, 4, (16, 8)), (tc.b_position, 2, (8, 8)),
                                    (tc.c_position, 4, (16, 8))):
    held = np.zeros(shape, int)
    for lane in range(32):
      for element in range(count): held[tuple(evaluate(c, lane >> 2, lane % 4) for c in position_of(element))] += 1
    assert (held == 1).all()


# ================================================================ the switch

def test_precision_switch() -> None:
  assert get_float32_matmul_precision() == "highest" and not tf32_allowed()
  ourgrad.set_float32_matmul_precision("high")
  assert ourgrad.get_float32_matmul_precision() == "high" and tf32_allowed()
  ourgrad.set_float32_matmul_precision("highest")
  assert not tf32_allowed()
  with pytest.raises(PrecisionError, match="medium"): ourgrad.set_float32_matmul_precision("medium")
  with pytest.raises(ValueError): ourgrad.set_float32_matmul_precision("tf32")


def test_env_var_and_override(monkeypatch) -> None:
  monkeypatch.setenv("TF32", "1")
  assert tf32_allowed() and get_float32_matmul_precision() == "high"
  ourgrad.set_float32_matmul_precision("highest")   # the call wins over the variable
  assert not tf32_allowed()
  _float32_matmul_precision[0] = None
  monkeypatch.setenv("TF32", "0")
  assert not tf32_allowed()


# ================================================================ kernels

def _operands(shape_a: tuple[int, ...], shape_b: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray]:
  rng = np.random.default_rng(seed)
  return rng.standard_normal(shape_a).astype(np.float32), rng.standard_normal(shape_b).astype(np.float32)


def _matmul_item(a: np.ndarray, b: np.ndarray) -> ScheduleItem:
  schedule = create_schedule([(Tensor(a, device=DEVICE) @ Tensor(b, device=DEVICE)).lazydata])
  run_schedule(schedule[:-1])
  return schedule[-1]


def _cuda_source(kernel: Kernel) -> str:
  """The kernel's opts applied for CUDA, rendered (and compiled with NVRTC where it is installed)."""
  cuda = Kernel(kernel.ast, CUDARenderer())
  for opt in kernel.applied_opts: cuda.apply_opt(opt)
  source = CUDARenderer().render(cuda.name, linearize(cuda))
  if NVRTC is not None: NVRTC.compile(source)
  return source


def _run(kernel: Kernel, item: ScheduleItem) -> np.ndarray:
  output = Buffer(DEVICE, item.outputs[0].size, item.outputs[0].dtype).allocate()
  compile_kernel(kernel, DEVICE)((output,) + item.inputs)
  return output.numpy().astype(np.float64)


def _check_tf32(got: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
  """Tight against the TF32 model (float32 sums of exact products), loose against PyTorch's full float32 matmul,
  and measurably off full float32 (the rounding happened)."""
  model = tf32_matmul_model(a, b).reshape(-1)
  scale = np.abs(model).max()
  np.testing.assert_allclose(got, model, rtol=0, atol=2e-6 * scale * np.sqrt(a.shape[-1]))
  full = (torch.from_numpy(a) @ torch.from_numpy(b)).double().numpy().reshape(-1)
  np.testing.assert_allclose(got, full, rtol=0, atol=2e-3 * scale)
  assert np.abs(got - full).max() > 1e-5 * scale


def test_tc_tf32_refused_at_highest() -> None:
  a, b = _operands((32, 32), (32, 32), seed=1)
  kernel = Kernel(_matmul_item(a, b).ast, PythonRenderer("CUDA"))
  with pytest.raises(KernelOptError, match="TF32"): kernel.apply_opt(Opt(OptOps.TC, 0, TF32_CHOICE))
  assert kernel.tensor_core is None
  hand = Kernel(kernel.ast, PythonRenderer("CUDA"))
  hand.hand_coded_optimizations()
  assert all(opt.op is not OptOps.TC for opt in hand.applied_opts)
  assert "tf32" not in _cuda_source(hand)


MANUAL = {
  "one_instruction": ((16, 8), (8, 8), [Opt(OptOps.TC, 0, TF32_CHOICE)]),
  "warp_tiles": ((64, 32), (32, 48), [Opt(OptOps.TC, 0, TF32_CHOICE), Opt(OptOps.UPCAST, 1, 2),
                                      Opt(OptOps.UPCAST, 0, 2), Opt(OptOps.LOCAL, 0, 2), Opt(OptOps.UNROLL, 0, 2)]),
  "batched": ((3, 32, 16), (3, 16, 16), [Opt(OptOps.TC, 0, TF32_CHOICE)]),
  "ragged": ((20, 16), (16, 12), [Opt(OptOps.PADTO, 0, 32), Opt(OptOps.PADTO, 1, 16), Opt(OptOps.TC, 0, TF32_CHOICE)]),
  "staged": ((32, 64), (64, 32), [Opt(OptOps.TC, 0, TF32_CHOICE), Opt(OptOps.UPCAST, 1, 2), Opt(OptOps.LOCAL, 0, 2),
                                  Opt(OptOps.UNROLL, 0, 2), Opt(OptOps.SHARED, 0, 0)]),
  "staged_transposed_a": ((32, 64), (64, 32), [Opt(OptOps.TC, 0, TF32_CHOICE), Opt(OptOps.LOCAL, 0, 2),
                                               Opt(OptOps.SHARED, 0, 3)]),
}


@pytest.mark.parametrize("case", list(MANUAL))
def test_tf32_kernels(case: str) -> None:
  """TC with TF32 and the opts of each case: the emulated kernel against both references, the CUDA source holds the
  TF32 mma and compiles."""
  ourgrad.set_float32_matmul_precision("high")
  shape_a, shape_b, opts = MANUAL[case]
  a, b = _operands(shape_a, shape_b, seed=len(case))
  if case == "staged_transposed_a":   # A read through a transposed view: its tile is M-contiguous
    a = np.ascontiguousarray(a.T).T
    schedule = create_schedule([(Tensor(np.ascontiguousarray(a.T), device=DEVICE).T @
                                 Tensor(b, device=DEVICE)).lazydata])
    run_schedule(schedule[:-1])
    item = schedule[-1]
  else:
    item = _matmul_item(a, b)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  for opt in opts: kernel.apply_opt(opt)
  assert kernel.tensor_core is not None and kernel.tensor_core.tc.dtype_in == dtypes.float32
  _check_tf32(_run(kernel, item), a, b)
  source = _cuda_source(kernel)
  assert TF32_MMA in source and "cvt.rna.tf32.f32" in source


@pytest.mark.parametrize("shape", [((128, 64), (64, 128)), ((130, 64), (64, 120))], ids=["staged", "ragged_staged"])
def test_heuristic_takes_tf32_only_when_allowed(monkeypatch, shape) -> None:
  """The staged TF32 kernel where allowed (the block count gate lowered to these small grids)."""
  monkeypatch.setattr(tensor_core_plans, "TF32_MIN_BLOCKS", 1)
  a, b = _operands(*shape, seed=3)
  item = _matmul_item(a, b)
  highest = Kernel(item.ast, PythonRenderer("CUDA"))
  highest.hand_coded_optimizations()
  assert all(opt.op is not OptOps.TC for opt in highest.applied_opts)
  ourgrad.set_float32_matmul_precision("high")
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  kernel.hand_coded_optimizations()
  assert Opt(OptOps.TC, 0, TF32_CHOICE) in kernel.applied_opts and OptOps.SHARED in [o.op for o in kernel.applied_opts]
  _check_tf32(_run(kernel, item), a, b)
  assert TF32_MMA in _cuda_source(kernel)


@pytest.mark.parametrize("shape", [((128, 64), (64, 128)), ((2, 32, 96), (2, 96, 40))], ids=["few_blocks", "unstaged"])
def test_heuristic_keeps_float32_tiles_where_tf32_loses(shape) -> None:
  """With TF32 allowed, a grid of fewer than TF32_MIN_BLOCKS blocks (here 1) and a matmul the staged kernel does not
  fit (the unstaged TF32 kernel never won on the H100) keep the float32 kernel."""
  a, b = _operands(*shape, seed=4)
  ast = _matmul_item(a, b).ast
  highest = Kernel(ast, PythonRenderer("CUDA"))
  highest.hand_coded_optimizations()
  ourgrad.set_float32_matmul_precision("high")
  high = Kernel(ast, PythonRenderer("CUDA"))
  high.hand_coded_optimizations()
  assert high.applied_opts == highest.applied_opts and high.tensor_core is None


def test_staged_tf32_with_b_k_major(monkeypatch) -> None:
  """x @ W^T on a GPU without wgmma: the staged TF32 kernel with both tiles K-contiguous (both fragments by ldmatrix,
  32-bit elements: .x4 for A, .x2 for B)."""
  ourgrad.set_float32_matmul_precision("high")
  monkeypatch.setattr(tensor_core_plans, "TF32_MIN_BLOCKS", 1)
  a, b_t = _operands((128, 64), (128, 64), seed=8)
  item = _transposed_b_item(a, b_t)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  kernel.hand_coded_optimizations()
  assert Opt(OptOps.TC, 0, TF32_CHOICE) in kernel.applied_opts and OptOps.SHARED in [o.op for o in kernel.applied_opts]
  assert not any(layout.transposed for layout in kernel.tensor_core_tiles())
  assert sum(uop.op is UOps.LDMATRIX for uop in linearize(kernel)) > 0
  _check_tf32(_run(kernel, item), a, np.ascontiguousarray(b_t.T))
  assert "ldmatrix" in _cuda_source(kernel)


def test_a_wrong_tf32_map_fails() -> None:
  """The linearizer loads B with b0 and b1 swapped (a TensorCore whose maps lie) while the interpreter takes the
  instruction's true maps from the table by the WMMA's arg: the result must be wrong."""
  ourgrad.set_float32_matmul_precision("high")
  a, b = _operands((16, 8), (8, 8), seed=5)
  item = _matmul_item(a, b)
  true = CUDA_TENSOR_CORES[TF32_CHOICE]
  renderer = PythonRenderer("CUDA")
  lying = dataclasses.replace(true, maps=FragmentMaps(true.maps.a, true.maps.b[::-1], true.maps.c))
  renderer.tensor_cores = CUDA_TENSOR_CORES[:TF32_CHOICE] + (lying,)
  kernel = Kernel(item.ast, renderer)
  kernel.apply_opt(Opt(OptOps.TC, 0, TF32_CHOICE))
  got = _run(kernel, item)
  assert not np.allclose(got, tf32_matmul_model(a, b).reshape(-1), rtol=1e-2, atol=1e-2)


def test_conv_takes_tf32() -> None:
  """A float32 convolution lowered to matmul form gets the staged TF32 tensor cores where the float16 one does."""
  ourgrad.set_float32_matmul_precision("high")
  rng = np.random.default_rng(7)
  x_values = rng.standard_normal((2, 32, 8, 8)).astype(np.float32)
  w_values = rng.standard_normal((64, 32, 3, 3)).astype(np.float32)
  x, w = Tensor(x_values, device=DEVICE).realize(), Tensor(w_values, device=DEVICE).realize()
  schedule = create_schedule([x.conv2d(w, padding=1).lazydata])
  run_schedule(schedule[:-1])
  item = schedule[-1]
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  kernel.hand_coded_optimizations()
  assert Opt(OptOps.TC, 0, TF32_CHOICE) in kernel.applied_opts, kernel.applied_opts
  got = _run(kernel, item)
  model = torch.nn.functional.conv2d(torch.from_numpy(tf32_model(x_values)), torch.from_numpy(tf32_model(w_values)),
                                     padding=1).numpy().reshape(-1)
  np.testing.assert_allclose(got, model, rtol=0, atol=1e-5 * np.abs(model).max())
  assert TF32_MMA in _cuda_source(kernel)


# ================================================================ wgmma (sm_90a): TF32 with B K-major

def tf32_truncated(values: np.ndarray) -> np.ndarray:
  """float32 values with their 13 low mantissa bits dropped (what wgmma's tensor cores read of float32 operands),
  by float64 arithmetic: the 11 significant bits rounded toward zero."""
  mantissa, exponent = np.frexp(np.asarray(values, np.float64))
  return np.ldexp(np.trunc(mantissa * 2.0 ** 11), exponent - 11)


WGMMA_PLANS = {"128x256_4stages": dict(), "64x128_3stages": dict(block_m=64, block_n=128, stages=3),
               "specialized_128x128": dict(block_n=128, stages=6, specialized=True),
               "deep_128x128": dict(block_n=128, stages=4, deep=True)}


@pytest.mark.parametrize("name", list(WGMMA_PLANS))
def test_tf32_wgmma_plan_emulated(name: str) -> None:
  """The TF32 wgmma kernel (32 floats a 128-byte row, k8 instructions) emulated: equal to the truncation model up to
  float32 sums, off full float32 by TF32's error; NVRTC compiles it for sm_90a without spills."""
  options = WGMMA_PLANS[name]
  m, n, k = 3 * options.get("block_m", 128), 2 * options.get("block_n", 256), 224
  plan = WgmmaMatmul(m, n, k, dtype="float32", b_k_major=True, **options)
  assert (plan.block_k, plan.instruction_k, plan.out_dtype) == (32, 8, "float32")
  rng = np.random.default_rng(len(name))
  a, b = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
  c = np.zeros(m * n, np.float32)
  emulate_wgmma_matmul(plan, c, a.reshape(-1).view(np.uint32), np.ascontiguousarray(b.T).reshape(-1).view(np.uint32))
  model = tf32_truncated(a) @ tf32_truncated(b)
  scale = np.abs(model).max()
  np.testing.assert_allclose(c.reshape(m, n), model, rtol=0, atol=1e-5 * scale)
  assert np.abs(c.reshape(m, n) - a.astype(np.float64) @ b).max() > 1e-5 * scale
  if NVRTC is not None:
    source = render_wgmma_matmul(plan)
    assert f"m64n{plan.block_n}k8.f32.tf32.tf32" in source
    info = NVRTC.ptxas_info(source)
    assert "0 bytes spill stores" in info or "ptxas info" not in info, info


def test_tf32_wgmma_needs_b_k_major() -> None:
  with pytest.raises(ValueError, match="K-major"): WgmmaMatmul(128, 256, 64, dtype="float32")


def _transposed_b_item(a: np.ndarray, b_t: np.ndarray) -> ScheduleItem:
  """a @ b_t.T (B stored N x K, as a Linear layer's weight)."""
  schedule = create_schedule([(Tensor(a, device=DEVICE) @ Tensor(b_t, device=DEVICE).T).lazydata])
  run_schedule(schedule[:-1])
  return schedule[-1]


def test_tf32_wgmma_opt_only_when_allowed() -> None:
  a, b_t = _operands((256, 96), (384, 96), seed=31)
  item = _transposed_b_item(a, b_t)
  with pytest.raises(KernelOptError): Kernel(item.ast, PythonRenderer("CUDA_SM90")).apply_opt(Opt(OptOps.WGMMA, 3, 128))
  ourgrad.set_float32_matmul_precision("high")
  kernel = Kernel(item.ast, PythonRenderer("CUDA_SM90"))
  kernel.apply_opt(Opt(OptOps.WGMMA, 3, 128))
  plan, _ = kernel.wgmma
  assert (plan.dtype, plan.b_k_major, plan.m, plan.n, plan.k) == ("float32", True, 256, 384, 96)
  got = _run(kernel, item)
  b = np.ascontiguousarray(b_t.T)
  model = (tf32_truncated(a) @ tf32_truncated(b)).reshape(-1)
  np.testing.assert_allclose(got, model, rtol=0, atol=1e-5 * np.abs(model).max())
  if NVRTC is not None:
    cuda = Kernel(item.ast, CUDARenderer("sm_90"))
    cuda.apply_opt(Opt(OptOps.WGMMA, 3, 128))
    NVRTC.compile(CUDARenderer("sm_90").render_wgmma(cuda.name, *cuda.wgmma))
  # B stored K x N: TF32 wgmma cannot transpose it
  plain = Kernel(_matmul_item(a, np.ascontiguousarray(b_t.T)).ast, PythonRenderer("CUDA_SM90"))
  with pytest.raises(KernelOptError, match="K-major"): plain.apply_opt(Opt(OptOps.WGMMA, 3, 128))


def test_tf32_wgmma_reads_rows_longer_than_k() -> None:
  """Operands whose rows are longer than the product's K (a slice of K, as a split-K partial reads): the plan keeps
  the rows' real stride, the kernel reads only its slice (the rest of each row holds values that would change the
  sum), and NVRTC compiles it."""
  a_full, b_t_full = _operands((256, 160), (384, 160), seed=37)
  ourgrad.set_float32_matmul_precision("high")
  schedule = create_schedule([(Tensor(a_full, device=DEVICE)[:, :96] @ Tensor(b_t_full, device=DEVICE)[:, :96].T)
                              .lazydata])
  run_schedule(schedule[:-1])
  item = schedule[-1]
  kernel = Kernel(item.ast, PythonRenderer("CUDA_SM90"))
  kernel.apply_opt(Opt(OptOps.WGMMA, 3, 128))
  plan, _ = kernel.wgmma
  assert (plan.k, plan.a_row_stride, plan.b_row_stride) == (96, 160, 160)
  a, b = a_full[:, :96], np.ascontiguousarray(b_t_full[:, :96].T)
  model = (tf32_truncated(a) @ tf32_truncated(b)).reshape(-1)
  np.testing.assert_allclose(_run(kernel, item), model, rtol=0, atol=1e-5 * np.abs(model).max())
  if NVRTC is not None:
    cuda = Kernel(item.ast, CUDARenderer("sm_90"))
    cuda.apply_opt(Opt(OptOps.WGMMA, 3, 128))
    NVRTC.compile(CUDARenderer("sm_90").render_wgmma(cuda.name, *cuda.wgmma))


def test_tf32_split_weight_gradient_takes_wgmma(monkeypatch) -> None:
  """A weight gradient g^T @ x with both operands stored K-major (transposed copies) and K long enough to split: the
  split's partial kernel reads a K slice of each row and still takes WGMMA on an emulated H100."""
  monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer("CUDA_SM90"))   # the split reads the device
  ourgrad.set_float32_matmul_precision("high")
  g_t, x_t = Tensor.empty(2304, 4096, device=DEVICE), Tensor.empty(768, 4096, device=DEVICE)
  kernels = [Kernel(item.ast, PythonRenderer("CUDA_SM90")) for item in create_schedule([(g_t @ x_t.T).lazydata])]
  for kernel in kernels: kernel.hand_coded_optimizations()
  partial = next(kernel for kernel in kernels if kernel.reduceops)
  assert len(partial.full_shape) == 4, partial.full_shape   # (parts, M, N, K / parts)
  assert [opt.op for opt in partial.applied_opts] == [OptOps.WGMMA]


def test_heuristic_tf32_on_sm90(monkeypatch) -> None:
  """On an emulated H100 with TF32 allowed: a large x @ W^T takes WGMMA, a large x @ W (B K x N) mma.sync TF32."""
  monkeypatch.setattr(tensor_core_plans, "WGMMA_MIN_WORK", 1)
  monkeypatch.setattr(tensor_core_plans, "TF32_MIN_BLOCKS", 1)
  ourgrad.set_float32_matmul_precision("high")
  def opts(ast) -> list[Opt]:
    kernel = Kernel(ast, PythonRenderer("CUDA_SM90"))
    kernel.hand_coded_optimizations()
    return kernel.applied_opts
  x, w = Tensor.empty(256, 128, device=DEVICE), Tensor.empty(512, 128, device=DEVICE)
  assert [opt.op for opt in opts(create_schedule([(x @ w.T).lazydata])[-1].ast)] == [OptOps.WGMMA]
  assert Opt(OptOps.TC, 0, TF32_CHOICE) in opts(create_schedule([(x @ w.T.contiguous()).lazydata])[-1].ast)


# ================================================================ caches

@pytest.fixture
def emulated_cuda(monkeypatch):
  """Tensors on the PYTHON device run as on CUDA (EMULATE=CUDA), with fresh compiled-kernel caches; the staged TF32
  kernel is taken for a single block (TF32_MIN_BLOCKS lowered)."""
  monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer("CUDA"))
  monkeypatch.setattr(tensor_core_plans, "TF32_MIN_BLOCKS", 1)
  realize._runner_cache.clear()
  yield
  realize._runner_cache.clear()   # kernels made for the emulated GPU stay out of later tests


def _error_vs_full(got: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
  full = a.astype(np.float64) @ b.astype(np.float64)
  return float(np.abs(got - full).max() / np.abs(full).max())


def test_runner_cache_keeps_precisions_apart(emulated_cuda) -> None:
  """The same AST realized under each precision in turn runs the kernel of that precision."""
  a, b = _operands((128, 64), (64, 128), seed=11)
  ta, tb = Tensor(a, device=DEVICE).realize(), Tensor(b, device=DEVICE).realize()
  errors = {}
  for precision in ("highest", "high", "highest", "high"):
    ourgrad.set_float32_matmul_precision(precision)
    got = (ta @ tb).numpy().astype(np.float64)
    errors.setdefault(precision, []).append(_error_vs_full(got, a, b))
    if precision == "high": np.testing.assert_allclose(got, tf32_matmul_model(a, b), rtol=0, atol=1e-4)
  assert max(errors["highest"]) < 1e-6 < 1e-4 < min(errors["high"])


def test_jit_captures_again_after_a_switch(emulated_cuda) -> None:
  """A TinyJit captured under one precision does not replay its kernels under the other: switching back and forth,
  each call's result is that of the precision in force."""
  a, b = _operands((128, 64), (64, 128), seed=12)
  tb = Tensor(b, device=DEVICE).realize()

  @TinyJit
  def step(x: Tensor) -> Tensor: return (x @ tb).realize()

  for precision in ("highest", "high", "highest", "high", "highest"):
    ourgrad.set_float32_matmul_precision(precision)
    for _ in range(3):   # eager, capture, replay
      got = step(Tensor(a, device=DEVICE).realize()).numpy().astype(np.float64)
      error = _error_vs_full(got, a, b)
      assert (error > 1e-4) if precision == "high" else (error < 1e-6), (precision, error)
    assert step.captured is not None and step.captured.tf32 == (precision == "high")


def test_beam_cache_key_names_the_precision() -> None:
  a, b = _operands((32, 32), (32, 32), seed=13)
  matmul = _matmul_item(a, b).ast
  maximum = create_schedule([Tensor(a, device=DEVICE).max(axis=1).lazydata])[-1].ast
  highest = (cache_key(matmul, DEVICE, 2), cache_key(maximum, DEVICE, 2))
  ourgrad.set_float32_matmul_precision("high")
  high = (cache_key(matmul, DEVICE, 2), cache_key(maximum, DEVICE, 2))
  assert highest[0] != high[0]      # a float32 sum: searched apart
  assert highest[1] == high[1]      # no float32 sum: TF32 changes nothing, the search is shared
  ourgrad.set_float32_matmul_precision("highest")
  assert cache_key(matmul, DEVICE, 2) == highest[0]


# ================================================================ on a GPU

CUDA = device_opens("CUDA")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", [((1024, 256), (256, 1024)), ((1000, 72), (72, 1100))],
                         ids=["1024x1024x256", "ragged"])
def test_cuda_tf32_matmul(shape) -> None:
  """On the GPU: "high" runs a TF32 kernel (results near the TF32 model of its path, off full float32), "highest"
  full float32. The staged mma.sync kernel rounds each operand to TF32 (tf32_matmul_model); on sm_90 the operands are
  copied K-major and read by WGMMA, whose tensor cores truncate them (tf32_truncated)."""
  a, b = _operands(*shape, seed=21)
  ta, tb = Tensor(a, device="CUDA").realize(), Tensor(b, device="CUDA").realize()
  full = (ta @ tb).numpy().astype(np.float64)
  assert _error_vs_full(full, a, b) < 1e-5
  ourgrad.set_float32_matmul_precision("high")
  got = (ta @ tb).numpy().astype(np.float64)
  wgmma = any("wgmma" in realize.get_runner("CUDA", item.ast).name for item in create_schedule([(ta @ tb).lazydata]))
  model = tf32_truncated(a) @ tf32_truncated(b) if wgmma else tf32_matmul_model(a, b)
  np.testing.assert_allclose(got, model, rtol=0, atol=5e-5 * np.abs(model).max())
  assert _error_vs_full(got, a, b) > 1e-5


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_cuda_tf32_conv() -> None:
  rng = np.random.default_rng(22)
  x_values = rng.standard_normal((4, 64, 16, 16)).astype(np.float32)
  w_values = rng.standard_normal((64, 64, 3, 3)).astype(np.float32)
  ourgrad.set_float32_matmul_precision("high")
  got = Tensor(x_values, device="CUDA").conv2d(Tensor(w_values, device="CUDA"), padding=1).numpy()
  model = torch.nn.functional.conv2d(torch.from_numpy(tf32_model(x_values)), torch.from_numpy(tf32_model(w_values)),
                                     padding=1).numpy()
  np.testing.assert_allclose(got, model, rtol=0, atol=5e-5 * np.abs(model).max())
  full = torch.nn.functional.conv2d(torch.from_numpy(x_values).double(), torch.from_numpy(w_values).double(),
                                    padding=1).numpy()
  assert np.abs(got - full).max() > 1e-5 * np.abs(full).max()   # the TF32 kernel ran, not full float32


CUDA_SM90 = CUDA and getattr(Device["CUDA"].renderer, "has_wgmma", False) if CUDA else False


@pytest.mark.skipif(not CUDA_SM90, reason="needs CUDA on an sm_90 GPU (H100/H200)")
def test_cuda_tf32_wgmma() -> None:
  """On an H100: x @ W^T of 1024 x 512 x 2048 with TF32 allowed runs the TF32 wgmma kernel; the tensor cores read
  the float32 bits as TF32 (the truncation model, within float32 sums; a looser bound covers rounding instead)."""
  a, b_t = _operands((1024, 512), (2048, 512), seed=23)
  ta, tb = Tensor(a, device="CUDA").realize(), Tensor(b_t, device="CUDA").realize()
  ourgrad.set_float32_matmul_precision("high")
  schedule = create_schedule([(ta @ tb.T).lazydata])
  kernel = Kernel(schedule[-1].ast, Device["CUDA"].renderer)
  kernel.hand_coded_optimizations()
  assert kernel.wgmma is not None and kernel.wgmma[0].dtype == "float32", kernel.applied_opts
  got = (ta @ tb.T).numpy().astype(np.float64)
  b = np.ascontiguousarray(b_t.T)
  model = tf32_truncated(a) @ tf32_truncated(b)
  np.testing.assert_allclose(got, model, rtol=0, atol=3e-4 * np.abs(model).max())
  assert _error_vs_full(got, a, b) > 1e-5
