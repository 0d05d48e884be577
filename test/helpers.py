"""Shared test helpers: run an op in ourgrad and in PyTorch (the independent reference, on the CPU) on the same
seeded inputs, and compare forward values, result dtypes and the gradients of every input.

Main entry points:
  helper_test_op(shapes_or_values, torch_fn, ourgrad_fn=None, ...)  forward + backward against torch
  make_input_arrays(...)                                             the seeded numpy inputs it uses
  to_torch / to_ourgrad / as_numpy                                   conversions between the two libraries
  TORCH_DTYPES, ourgrad_dtype_of                                     the dtype correspondence
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pytest
import torch

from ourgrad import Device, Tensor, dtypes
from ourgrad.dtype import DType
from ourgrad.errors import DeviceError

# the dtypes both libraries have, ourgrad -> torch
TORCH_DTYPES: dict[DType, torch.dtype] = {
  dtypes.bool: torch.bool, dtypes.int8: torch.int8, dtypes.uint8: torch.uint8, dtypes.int16: torch.int16,
  dtypes.int32: torch.int32, dtypes.int64: torch.int64, dtypes.float16: torch.float16,
  dtypes.bfloat16: torch.bfloat16, dtypes.float32: torch.float32, dtypes.float64: torch.float64,
}
OURGRAD_DTYPES: dict[torch.dtype, DType] = {torch_dtype: dtype for dtype, torch_dtype in TORCH_DTYPES.items()}

# the dtypes the op tests cover, in promotion order
TESTED_DTYPES: list[DType] = [dtypes.bool, dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.int32, dtypes.int64,
                              dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64]
INT_DTYPES: list[DType] = [dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.int32, dtypes.int64]
FLOAT_DTYPES: list[DType] = [dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64]

# (atol, rtol) that a result computed in a dtype can be expected to meet
DTYPE_TOLERANCES: dict[DType, tuple[float, float]] = {
  dtypes.float16: (1e-3, 1e-3), dtypes.bfloat16: (1e-2, 1e-2), dtypes.float32: (1e-6, 1e-5),
  dtypes.float64: (1e-12, 1e-10),
}


@contextmanager
def emulated_gpu_tf32(monkeypatch: pytest.MonkeyPatch, emulate: str) -> Iterator[None]:
  """The PYTHON device lowering as the GPU `emulate` names ("CUDA", "CUDA_SM90": as EMULATE=...), TF32 allowed, with
  fresh compiled-kernel and schedule caches before and after, so that nothing made for the emulated GPU (or under
  TF32) reaches later tests; the float32 matmul precision is reset after."""
  from ourgrad.engine import realize, schedule_cache
  from ourgrad.helpers import _float32_matmul_precision, set_float32_matmul_precision
  from ourgrad.runtime.ops_python import PythonRenderer
  monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer(emulate))
  monkeypatch.delenv("TF32", raising=False)
  set_float32_matmul_precision("high")
  realize._runner_cache.clear()
  schedule_cache._cache.clear()
  try:
    yield
  finally:
    _float32_matmul_precision[0] = None
    realize._runner_cache.clear()
    schedule_cache._cache.clear()


def small_split_reduces(monkeypatch: pytest.MonkeyPatch, multiprocessors: int = 8, min_part: int = 8) -> None:
  """Split reduces (codegen/opt/split_reduce.py) scaled down so that small shapes (fast on the PYTHON interpreter)
  split as large ones do on a GPU: a device of `multiprocessors` (a wave of 64 blocks of 256 threads at the default
  8) and parts of at least `min_part` elements."""
  from ourgrad.codegen.opt import split_reduce
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts(multiprocessors, 2048, 0))
  for name in ("MIN_PART_ROWS", "MIN_PART_COLUMNS", "MIN_PART_MATMUL"):
    monkeypatch.setattr(split_reduce, name, min_part)


def skip_unless_device(name: str) -> None:
  """Skip the calling test when device `name` cannot open here (its package or driver is absent: `pip install
  -e '.[testing]'` alone has no llvmlite, pyopencl or CUDA)."""
  try:
    Device[name]
  except DeviceError as error:
    pytest.skip(f"{name} is not available here: {error}")


def torch_layernorm(t: torch.Tensor) -> torch.Tensor:
  """PyTorch's layer norm over the last axis, without affine parameters (Tensor.layernorm's default)."""
  return torch.nn.functional.layer_norm(t, t.shape[-1:])


# the reduce -> broadcast -> reduce graphs a row kernel fuses, each with its PyTorch reference: (ourgrad, torch)
ROW_NORMALIZATIONS: dict[str, tuple[Callable[[Tensor], Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
  "softmax": (lambda x: x.softmax(-1), lambda t: t.softmax(-1)),
  "log_softmax": (lambda x: x.log_softmax(-1), lambda t: t.log_softmax(-1)),
  "layernorm": (lambda x: x.layernorm(), torch_layernorm),
  "rmsnorm": (lambda x: x * (x.square().mean(-1, keepdim=True) + 1e-6).rsqrt(),
              lambda t: t * torch.rsqrt(t.square().mean(-1, keepdim=True) + 1e-6)),
  "var": (lambda x: x.var(-1), lambda t: t.var(-1)),
  "std": (lambda x: x.std(-1), lambda t: t.std(-1)),
}


def device_opens(name: str) -> bool:
  """Whether device `name` opens here (for `skipif` marks, decided when the module loads)."""
  try:
    Device[name]
  except DeviceError:
    return False
  return True


def nvrtc_compiler() -> Any:
  """A CUDACompiler for sm_90 when cuda-python and its NVRTC library load here, else None: tests that compile CUDA
  source without a GPU skip on None."""
  try:
    from ourgrad.runtime.ops_cuda import CUDACompiler
    compiler = CUDACompiler("sm_90")
    compiler.compile('extern "C" __global__ void probe() {}')
    return compiler
  except Exception:  # no cuda-python or no NVRTC library here
    return None


def cuda_source(item: Any, nvrtc: Any) -> str:
  """The CUDA source of schedule item `item`'s kernel with the hand-coded optimizations, compiled with `nvrtc`
  (`nvrtc_compiler()`; None: rendered only, no compiler here)."""
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.codegen.linearizer import linearize
  from ourgrad.renderer.cuda import CUDARenderer
  kernel = Kernel(item.ast, CUDARenderer())
  kernel.hand_coded_optimizations()
  source = CUDARenderer().render(kernel.name, linearize(kernel))
  if nvrtc is not None: nvrtc.compile(source)
  return source


def run_on_python_checking_cuda(kernel: Any, item: Any, nvrtc: Any) -> np.ndarray:
  """The output of schedule item `item` computed by `kernel` (its opts applied) on the PYTHON device, after the same
  kernel lowered for CUDA compiled with `nvrtc` (`nvrtc_compiler()`; None: no CUDA check here)."""
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.codegen.linearizer import linearize
  from ourgrad.device import Buffer
  from ourgrad.engine.realize import compile_kernel
  from ourgrad.renderer.cuda import CUDARenderer
  if nvrtc is not None:
    cuda = Kernel(kernel.ast, CUDARenderer())
    nvrtc.compile(CUDARenderer().render(cuda.name, linearize(cuda)))
  runner = compile_kernel(kernel, "PYTHON")
  output = Buffer("PYTHON", item.outputs[0].size, item.outputs[0].dtype).allocate()
  runner((output,) + item.inputs)
  return output.numpy()


def ourgrad_dtype_of(torch_dtype: torch.dtype) -> DType:
  """The ourgrad dtype matching a torch dtype."""
  return OURGRAD_DTYPES[torch_dtype]


def numpy_storage_dtype(dtype: DType) -> Any:
  """The numpy dtype that holds the values of `dtype` for the tests (bfloat16 values are kept in float32)."""
  return np.float32 if dtype == dtypes.bfloat16 else dtype.np


def make_input_arrays(shapes_or_values: Sequence[Any], dtype: DType | Any = dtypes.float32, low: float = -2,
                      high: float = 2, seed: int = 0) -> list[np.ndarray]:
  """One numpy array per entry: a tuple is a shape filled with seeded random values in [low, high) (integers for
  integer dtypes, random True/False for bool), anything else (list, array, scalar) is taken as the values.
  `dtype` is a DType or anything dtypes.as_dtype takes (np.float32, "int8", ...)."""
  dtype = dtypes.as_dtype(dtype)
  rng = np.random.default_rng(seed)
  storage = numpy_storage_dtype(dtype)
  arrays = []
  for entry in shapes_or_values:
    if isinstance(entry, tuple):
      if dtype == dtypes.bool: values = rng.random(entry) < 0.5
      elif dtype.is_float: values = rng.uniform(low, high, size=entry)
      else: values = rng.integers(max(low, dtype.min), min(high, dtype.max) + 1, size=entry)
    else:
      values = np.asarray(entry)
    array = np.asarray(values).astype(storage)
    if dtype == dtypes.bfloat16: array = bfloat16_round(array)
    arrays.append(array)
  return arrays


def bfloat16_round(array: np.ndarray) -> np.ndarray:
  """float32 values rounded to the nearest bfloat16 (via torch, the reference), still as float32."""
  return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(torch.bfloat16).float().numpy()


def to_torch(array: np.ndarray, dtype: DType, requires_grad: bool = False) -> torch.Tensor:
  """A torch tensor of `dtype` holding `array`."""
  tensor = torch.from_numpy(np.ascontiguousarray(array)).to(TORCH_DTYPES[dtype])
  return tensor.requires_grad_(requires_grad)


def to_ourgrad(array: np.ndarray, dtype: DType, requires_grad: bool = False) -> Tensor:
  """An ourgrad tensor of `dtype` holding `array`."""
  return Tensor(np.ascontiguousarray(array), dtype=dtype, requires_grad=requires_grad or None)


def as_numpy(value: torch.Tensor | Tensor) -> np.ndarray:
  """The values of either library's tensor as numpy (bfloat16 widened to float32, which holds it exactly)."""
  if isinstance(value, Tensor): return value.numpy()
  value = value.detach()
  if value.dtype == torch.bfloat16: value = value.float()
  return value.numpy()


def assert_same(ourgrad_value: Tensor, torch_value: torch.Tensor, atol: float, rtol: float, what: str = "output",
                expected_dtype: DType | None = None, check_dtype: bool = True) -> None:
  """Shapes equal, dtype equal to torch's (or `expected_dtype`), values close (NaN matches NaN)."""
  assert isinstance(ourgrad_value, Tensor), f"{what}: expected an ourgrad Tensor, got {type(ourgrad_value).__name__}"
  assert ourgrad_value.shape == tuple(torch_value.shape), \
    f"{what}: shape {ourgrad_value.shape} != torch's {tuple(torch_value.shape)}"
  if check_dtype:
    want = expected_dtype if expected_dtype is not None else ourgrad_dtype_of(torch_value.dtype)
    assert ourgrad_value.dtype == want, f"{what}: dtype {ourgrad_value.dtype} != expected {want}"
  ours, theirs = as_numpy(ourgrad_value), as_numpy(torch_value)
  if ours.dtype == np.bool_ or theirs.dtype == np.bool_ or not np.issubdtype(theirs.dtype, np.floating):
    np.testing.assert_array_equal(ours, theirs, err_msg=what)
  else:
    np.testing.assert_allclose(ours.astype(np.float64), theirs.astype(np.float64), atol=atol, rtol=rtol, err_msg=what)


def _as_tuple(value: Any) -> tuple[Any, ...]:
  return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def helper_test_op(shapes_or_values: Sequence[Any], torch_fn: Callable[..., Any],
                   ourgrad_fn: Callable[..., Any] | None = None, atol: float = 1e-6, rtol: float = 1e-3,
                   grad_atol: float = 1e-4, grad_rtol: float = 1e-3, forward_only: bool = False, low: float = -2,
                   high: float = 2, dtype: DType | Any = dtypes.float32, expected_dtype: DType | None = None,
                   check_dtype: bool = True, seed: int = 0) -> tuple[Any, Any]:
  """Run `torch_fn` and `ourgrad_fn` (default: the same function, for ops spelled alike) on the same seeded inputs
  and compare outputs (shape, dtype, values). Unless `forward_only` or `dtype` is not a float, backpropagate a
  seeded random gradient of each output's shape through both and compare every input's `.grad`.

  `shapes_or_values`: per input, a shape tuple (random values in [low, high)) or the values themselves.
  `dtype`: of every input, a DType or anything dtypes.as_dtype takes (np.float32, "bfloat16", ...).
  `expected_dtype`: the output dtype when ours differs from torch's on purpose (Python ints are int32 here).
  The functions may return one tensor or a tuple of them. Returns (ourgrad outputs, torch outputs)."""
  ourgrad_fn = ourgrad_fn or torch_fn
  dtype = dtypes.as_dtype(dtype)
  arrays = make_input_arrays(shapes_or_values, dtype, low, high, seed)
  with_grad = dtype.is_float and not forward_only
  torch_inputs = [to_torch(array, dtype, requires_grad=with_grad) for array in arrays]
  ourgrad_inputs = [to_ourgrad(array, dtype, requires_grad=with_grad) for array in arrays]

  torch_outputs = _as_tuple(torch_fn(*torch_inputs))
  ourgrad_outputs = _as_tuple(ourgrad_fn(*ourgrad_inputs))
  assert len(torch_outputs) == len(ourgrad_outputs), \
    f"torch gave {len(torch_outputs)} outputs, ourgrad {len(ourgrad_outputs)}"
  if ourgrad_outputs: ourgrad_outputs[0].realize(*ourgrad_outputs[1:])
  for number, (ours, theirs) in enumerate(zip(ourgrad_outputs, torch_outputs)):
    assert_same(ours, theirs, atol, rtol, f"forward output {number}", expected_dtype, check_dtype)
  if not with_grad: return ourgrad_outputs, torch_outputs

  # backward: a random upstream gradient per (float, differentiable) output catches transposed or mixed-up grads
  rng = np.random.default_rng(seed + 1)
  torch_loss, ourgrad_loss = None, None
  for ours, theirs in zip(ourgrad_outputs, torch_outputs):
    if not theirs.requires_grad or not theirs.dtype.is_floating_point: continue
    upstream = rng.uniform(-1, 1, size=tuple(theirs.shape)).astype(np.float32)
    upstream_dtype = ourgrad_dtype_of(theirs.dtype)
    if upstream_dtype == dtypes.bfloat16: upstream = bfloat16_round(upstream)
    torch_term = (theirs * to_torch(upstream, upstream_dtype)).sum()
    ourgrad_term = (ours * to_ourgrad(upstream, upstream_dtype)).sum()
    torch_loss = torch_term if torch_loss is None else torch_loss + torch_term
    ourgrad_loss = ourgrad_term if ourgrad_loss is None else ourgrad_loss + ourgrad_term
  if torch_loss is None: return ourgrad_outputs, torch_outputs  # nothing differentiable came out
  torch_loss.backward()
  if not ourgrad_loss.requires_grad:
    # ourgrad records no graph for outputs that do not depend on the inputs (x ** 0) or only through ops with a
    # zero derivative (sign, floor): the gradient torch computes must then be zero
    for number, theirs in enumerate(torch_inputs):
      if theirs.grad is not None: np.testing.assert_array_equal(as_numpy(theirs.grad), 0, err_msg=f"input {number}")
    return ourgrad_outputs, torch_outputs
  ourgrad_loss.backward()
  ourgrad_grads = [tensor.grad for tensor in ourgrad_inputs if tensor.grad is not None]
  if ourgrad_grads: ourgrad_grads[0].realize(*ourgrad_grads[1:])
  for number, (ours, theirs) in enumerate(zip(ourgrad_inputs, torch_inputs)):
    if theirs.grad is None:
      if ours.grad is not None:
        np.testing.assert_array_equal(ours.grad.numpy(), 0, err_msg=f"input {number}: torch has no gradient")
      continue
    assert ours.grad is not None, f"input {number}: torch has a gradient, ourgrad none"
    assert_same(ours.grad, theirs.grad, grad_atol, grad_rtol, f"gradient of input {number}")
  return ourgrad_outputs, torch_outputs


def host_has_avx512() -> bool:
  """Whether this machine's CPU runs AVX-512 (x86 Linux: its /proc/cpuinfo flags). Expectations fitted on AVX-512
  machines (a heuristic's choice at that SIMD width, a target this CPU must run) are guarded by it."""
  try:
    with open("/proc/cpuinfo") as cpuinfo: return " avx512f" in cpuinfo.read()
  except OSError:
    return False
