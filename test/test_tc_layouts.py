"""Tensor cores for any operand layout: transposed, batched, permuted (several views), padded (masked loads) and
computed operands (an expression of loads: a fused bias, a sum of padded loads, a scale), float16, bfloat16 and
float32 through TF32.

Each matmul is the last kernel of its schedule, with the operand's views and elementwise work fused into it. It runs
on the PYTHON device with CUDA's limits (`DEVICE=PYTHON EMULATE=CUDA`: the interpreter emulates COPY, LDMATRIX and
mma.sync with the PTX ISA's lane maps) with tensor cores unstaged (TC alone: fragments loaded from global memory) and
staged (TC + SHARED: tiles copied or computed into local memory), and must give the plain kernel's (NOOPT) results
and PyTorch's float64 result within the input dtype's error. `_run` also renders each kernel as CUDA C++ and
compiles it with NVRTC (sm_90) where it is installed.
"""
from __future__ import annotations

import itertools
from typing import Callable

import numpy as np
import pytest
import torch

from ourgrad import Tensor, dtypes
from ourgrad.codegen.index_accumulate import is_index_accumulate
from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.matmul_operands import varying_axes
from ourgrad.codegen.opt.tensor_core_plans import TensorCoreTile, apply_staged_tensor_core
from ourgrad.codegen.uops import UOps
from ourgrad.device import Buffer, Device
from ourgrad.dtype import DType, bfloat16_bits_to_float32
from ourgrad.engine.realize import compile_kernel, run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.helpers import _float32_matmul_precision, set_float32_matmul_precision
from ourgrad.ops import Ops
from ourgrad.runtime.ops_python import PythonRenderer
from ourgrad.shape.shapetracker import ShapeTracker
from ourgrad.shape.symbolic import NumNode

from helpers import device_opens, host_has_avx512
from test_tensor_cores import _run

DEVICE = "PYTHON"
TC_CHOICE = {dtypes.float16: 0, dtypes.bfloat16: 1, dtypes.float32: 2}
# relative error (norm) against float64 the input dtype allows: its unit roundoff times a margin for the sums
RELATIVE_ERROR = {dtypes.float16: 3e-3, dtypes.bfloat16: 2.5e-2, dtypes.float32: 3e-3}
# a block of 2 warps along M x 1 along N, 1 x 2 instruction tiles each: 32 x 16 elements (m16n8)
SMALL_TILE = TensorCoreTile(1, 2, 2, 1)


@pytest.fixture(autouse=True)
def _tf32_allowed():
  """float32 matmuls may use TF32 (set_float32_matmul_precision("high")) during each test, then the default again."""
  set_float32_matmul_precision("high")
  yield
  _float32_matmul_precision[0] = None


Expression = Callable[..., Tensor]
# name -> (input shapes, the expression of the inputs whose last kernel is the matmul)
CASES: dict[str, tuple[tuple[tuple[int, ...], ...], Expression]] = {
  # A stored K x M (M-contiguous), M ragged (40: padded to the block tile), N odd (24)
  "transposed_a": (((32, 40), (32, 24)), lambda a, b: a.T @ b),
  # both transposed: A M-contiguous, B K-contiguous
  "both_transposed": (((48, 32), (24, 48)), lambda a, b: a.T @ b.T),
  # a batch dimension: a grid dimension of the kernel
  "batched": (((3, 32, 32), (3, 32, 24)), lambda a, b: a @ b),
  # attention scores per batch and head, Q and K read through the head reshape and permute of one (B, T, 3C) buffer
  "heads_qk": (((2, 32, 192),), lambda x: _heads(x, 0) @ _heads(x, 1).transpose(-1, -2)),
  # P @ V per head, V through the head permute
  "heads_pv": (((2, 2, 32, 32), (2, 32, 192)), lambda p, x: p @ _heads(x, 2)),
  # a weight gradient over the tokens of the attention output, read back through the head permute (several views)
  "merged_heads": (((2, 2, 32, 16), (64, 24)),
                   lambda y, g: y.permute(0, 2, 1, 3).reshape(64, 32).T @ g),
  # the same with heads of 8: an M tile of 16 spans two heads, so the view has no plain stride inside the block
  "narrow_heads": (((2, 4, 32, 8), (64, 24)), lambda y, g: y.permute(0, 2, 1, 3).reshape(64, 32).T @ g),
  # A read backwards along K (a negative stride)
  "flipped": (((32, 48), (48, 16)), lambda a, b: a.flip(1) @ b),
  # a bias added to A inside the kernel (an ADD of two loads: a computed operand)
  "bias_operand": (((40, 32), (32,), (32, 24)), lambda a, bias, b: (a + bias) @ b),
  # V with its bias added in the kernel, read through the head permute: a computed operand contiguous along N
  "biased_v": (((2, 2, 32, 32), (2, 32, 192), (192,)), lambda p, x, bias: p @ _heads(x + bias, 2)),
  # three gradients concatenated into one operand (padded, masked loads summed), K along the concatenation
  "concatenated": (((32, 16), (32, 16), (32, 16), (48, 24)), lambda a, c, d, b: _cat(a, c, d) @ b),
  # a scaled operand (MUL by a constant)
  "scaled": (((32, 32), (32, 16)), lambda a, b: (a * 0.5) @ b),
}


def _heads(x: Tensor, part: int) -> Tensor:
  """Part `part` (q, k or v) of a (B, T, 3 * 2 * D) buffer as (B, 2 heads, T, D), as attention splits it."""
  batch, length, width = x.shape
  chunk = x[:, :, part * width // 3:(part + 1) * width // 3]
  return chunk.reshape(batch, length, 2, width // 6).permute(0, 2, 1, 3)


def _cat(*parts):
  """Concatenated along dim 1 (ourgrad's or PyTorch's, for the reference)."""
  return torch.cat(parts, dim=1) if isinstance(parts[0], torch.Tensor) else parts[0].cat(*parts[1:], dim=1)


def _inputs(shapes: tuple[tuple[int, ...], ...], dtype: DType, seed: int) -> tuple[list[Tensor], list[np.ndarray]]:
  """Realized inputs in `dtype` and their values (as rounded to `dtype`) in float64."""
  rng = np.random.default_rng(seed)
  tensors, values = [], []
  for shape in shapes:
    tensor = Tensor(rng.standard_normal(shape).astype(np.float32), device=DEVICE).cast(dtype).realize()
    tensors.append(tensor)
    values.append(tensor.cast(dtypes.float32).numpy().astype(np.float64))
  return tensors, values


def _kernels(case: str, dtype: DType, staged: bool) -> tuple[Kernel, Kernel, object, np.ndarray]:
  """(plain kernel, TC kernel (staged in SMALL_TILE, or TC alone), their schedule item, PyTorch's float64 result) of a
  case."""
  shapes, expression = CASES[case]
  tensors, values = _inputs(shapes, dtype, seed=len(case))
  schedule = create_schedule([expression(*tensors).lazydata])
  run_schedule(schedule[:-1])
  item = schedule[-1]
  plain = Kernel(item.ast, PythonRenderer("CUDA"))
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  if staged: assert apply_staged_tensor_core(kernel, TC_CHOICE[dtype], SMALL_TILE), f"{case}: no staged tile fits"
  else:
    for axis in range(kernel.first_reduce):   # the instruction's M/N tile padded where ragged, then TC
      if kernel.full_shape[axis] % 16: kernel.try_opt(Opt(OptOps.PADTO, axis, 16))
    kernel.apply_opt(Opt(OptOps.TC, 0, TC_CHOICE[dtype]))
  reference = expression(*[torch.from_numpy(value) for value in values]).numpy().reshape(-1)
  return plain, kernel, item, reference


@pytest.mark.parametrize("staged", [False, True], ids=["unstaged", "staged"])
@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16, dtypes.float32],
                         ids=["float16", "bfloat16", "tf32"])
@pytest.mark.parametrize("case", list(CASES))
def test_layout_on_tensor_cores(case: str, dtype: DType, staged: bool) -> None:
  if case == "concatenated" and dtype != dtypes.float32:
    # the scheduler stores a 16-bit concatenation as float32 before the matmul (the cast moves above the pads), so
    # the operand is a float32 load that 16-bit tensor cores cannot take (no rounding of it is done silently)
    pytest.skip("16-bit concatenation reaches the matmul as a float32 buffer")
  plain, kernel, item, reference = _kernels(case, dtype, staged)
  assert kernel.tensor_core is not None and kernel.shared_tiles == staged
  got, expected = _run(kernel, item), _run(plain, item)
  tolerance = 5 * RELATIVE_ERROR[dtype] * np.abs(expected).max()
  np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance)
  error = np.linalg.norm(got - reference) / np.linalg.norm(reference)
  assert error < RELATIVE_ERROR[dtype], (case, dtype, error)


@pytest.mark.parametrize("case", ["narrow_heads", "flipped"])
def test_index_math_tiles(case: str) -> None:
  """A load without plain non-negative strides inside the block is staged K-contiguous, element by element."""
  _, kernel, _, _ = _kernels(case, dtypes.float16, staged=True)
  tile_a, _ = kernel.tensor_core_tiles()
  assert not tile_a.computed and not tile_a.transposed and tile_a.axes[-1] == kernel.shape_len - 1


def test_computed_tile_follows_its_load() -> None:
  """A computed operand is laid out in the memory order of its load that varies along the whole tile (V of v + bias:
  N-contiguous, so the fill's neighbouring threads read neighbouring memory and ldmatrix .trans reads it)."""
  _, kernel, _, _ = _kernels("biased_v", dtypes.float16, staged=True)
  tile_a, tile_b = kernel.tensor_core_tiles()
  assert not tile_a.computed and tile_b.computed and tile_b.transposed


def test_computed_tile_is_stored_and_copied_tile_is_copied() -> None:
  """The staged bias case: A (a + bias) is computed into its tile (STOREs to local memory), B copied (COPYs)."""
  _, kernel, _, _ = _kernels("bias_operand", dtypes.float16, staged=True)
  tile_a, tile_b = kernel.tensor_core_tiles()
  assert tile_a.computed and not tile_b.computed
  uops = linearize(kernel)
  copied = {uop.srcs[0].arg[0] for uop in uops if uop.op is UOps.COPY}
  stored = {uop.srcs[0].arg[0] for uop in uops if uop.op is UOps.STORE and uop.srcs[0].op is UOps.DEFINE_LOCAL}
  assert copied == {"tile_b"} and stored == {"tile_a"}


# ================================================================ every matmul of a GPT-2 step

def _matmul_shaped(kernel: Kernel) -> bool:
  """A SUM of a MUL whose two sides each vary along an output axis the other does not (M and N) and both along the
  reduce (K): a matmul, whatever its operands' layouts (independent of what the TC opt accepts)."""
  reduce = kernel.reduceop
  if reduce is None or reduce.op is not Ops.SUM or len(kernel.reduceops) != 1 or kernel.row_axes is not None:
    return False
  product = reduce.srcs[0].srcs[0] if reduce.srcs[0].op is Ops.CAST else reduce.srcs[0]
  if product.op is not Ops.MUL: return False
  sides = [side.srcs[0] if side.op is Ops.CAST else side for side in product.srcs]
  return all(kernel.matmul_axes(*sides))


# the graph is built on the default device (CLANG), whose reduce decisions follow this CPU: on an AVX2 machine five
# weight gradients come split (r_512_144_16_768 ...) and leave the tensor cores (found in session 17, main too; the
# decision belongs in the scheduler, where the target's facts are)
@pytest.mark.skipif(not host_has_avx512(), reason="the CLANG-built graph's reduce splits follow this CPU's width")
@pytest.mark.parametrize("emulate", ["CUDA", "CUDA_SM90"])
def test_every_gpt2_matmul_on_tensor_cores(emulate: str) -> None:
  """One GPT-2 training step (1 layer, width 768, 12 heads, 2 x 256 tokens, float32 with TF32 allowed) scheduled,
  each kernel optimized by the heuristic for the CUDA-emulated renderer (CUDA: mma.sync only; CUDA_SM90: wgmma
  too): every matmul (per Linear the forward, the input gradient and the weight gradient; the tied logits' three;
  attention's Q@K^T, P@V and their four backward products, per batch and head) is on tensor cores."""
  from extra.models.gpt2 import GPT2, GPT2Config
  from ourgrad.nn.state import get_parameters
  Tensor.manual_seed(0)
  model = GPT2(GPT2Config(n_layer=1, vocab_size=1024, block_size=256))
  tokens = Tensor(np.random.default_rng(0).integers(0, 1024, (2, 256)).astype(np.int32))
  with Tensor.train():
    loss = model(tokens, tokens)[1]
    loss.backward()
  gradients = [parameter.grad.lazydata for parameter in get_parameters(model) if parameter.grad is not None]
  renderer = PythonRenderer(emulate)
  on_tensor_cores, elsewhere = [], []
  for item in create_schedule([loss.lazydata, *gradients]):
    if item.ast.op not in (Ops.STORE, Ops.SINK) or is_index_accumulate(item.ast): continue   # own kernel
    kernel = Kernel(item.ast, renderer)
    if not _matmul_shaped(kernel): continue
    start = kernel.name
    kernel.hand_coded_optimizations()
    tensor_cores = kernel.tensor_core is not None or kernel.wgmma is not None
    (on_tensor_cores if tensor_cores else elsewhere).append(start)
  print(f"on tensor cores: {on_tensor_cores}\nelsewhere: {elsewhere}")
  # 4 Linears x 3 + the logits x 3 + attention x 6 (22 before the scheduler stored c_fc's x @ W + b: the GELU's
  # backward computed the product again inside its kernel; store_or_recompute.py `_recomputes_a_reduce`)
  assert not elsewhere and len(on_tensor_cores) == 21


def test_debug_says_why_a_matmul_stays_off_tensor_cores(monkeypatch, capsys) -> None:
  """DEBUG=3: a float16 matmul whose K (20) is not a multiple of the instruction's 16 keeps CUDA cores, and the
  heuristic prints the TC opt's refusal."""
  monkeypatch.setenv("DEBUG", "3")
  tensors, _ = _inputs(((32, 20), (20, 32)), dtypes.float16, seed=1)
  kernel = Kernel(create_schedule([(tensors[0] @ tensors[1]).lazydata])[-1].ast, PythonRenderer("CUDA"))
  kernel.hand_coded_optimizations()
  assert kernel.tensor_core is None
  assert "no tensor cores (TensorCore(m16n8k16 float16->float32)): TC" in capsys.readouterr().out


# ================================================================ which axes an operand varies along

def _brute_force_varies(st) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
  """Per axis: whether some neighbouring positions along it address different elements, or differ in validity."""
  table = {}
  for position in itertools.product(*[range(size) for size in st.shape]):
    index, valid = st.expr_idxs([NumNode(value) for value in position])
    table[position] = (index.b, valid.b)
  index_varies, valid_varies = [False] * len(st.shape), [False] * len(st.shape)
  for position, (index, valid) in table.items():
    for axis, size in enumerate(st.shape):
      if position[axis] + 1 < size:
        other = table[position[:axis] + (position[axis] + 1,) + position[axis + 1:]]
        valid_varies[axis] |= other[1] != valid
        index_varies[axis] |= bool(valid and other[1] and other[0] != index)
  return tuple(index_varies), tuple(valid_varies)


@pytest.mark.parametrize("name", ["permuted", "heads_merged", "padded", "expanded", "flipped"])
def test_varying_axes_match_brute_force(name: str) -> None:
  """varying_axes (from the index and validity expressions) against every pair of neighbouring positions: several
  views, masks, broadcasts and flips."""
  base = ShapeTracker.from_shape((2, 3, 4, 2))
  st = {"permuted": base.permute((2, 0, 3, 1)),
        "heads_merged": base.permute((0, 2, 1, 3)).reshape((8, 6)),
        "padded": base.reshape((6, 8)).pad(((1, 1), (0, 2))),
        "expanded": ShapeTracker.from_shape((3, 1, 4)).expand((3, 5, 4)),
        "flipped": base.flip((False, True, False, True)).reshape((6, 8))}[name]
  expected_index, expected_valid = _brute_force_varies(st)
  index_varies, valid_varies = varying_axes(st)
  assert valid_varies == expected_valid
  # the index expression may mention an axis only where it matters for some valid position
  assert all(got or not want for got, want in zip(index_varies, expected_index))
  assert index_varies == expected_index


# ================================================================ on an NVIDIA GPU

@pytest.mark.skipif(not device_opens("CUDA"), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16, dtypes.float32],
                         ids=["float16", "bfloat16", "tf32"])
@pytest.mark.parametrize("case", ["bias_operand", "narrow_heads", "heads_qk", "heads_pv", "merged_heads", "flipped"])
def test_layout_on_cuda(case: str, dtype: DType) -> None:
  """The staged kernels of the layouts above (computed tiles, index-math tiles, head permutes) run on the GPU."""
  shapes, expression = CASES[case]
  rng = np.random.default_rng(len(case))
  tensors = [Tensor(rng.standard_normal(shape).astype(np.float32), device="CUDA").cast(dtype).realize()
             for shape in shapes]
  values = [tensor.cast(dtypes.float32).numpy().astype(np.float64) for tensor in tensors]
  schedule = create_schedule([expression(*tensors).lazydata])
  run_schedule(schedule[:-1])
  item = schedule[-1]
  kernel = Kernel(item.ast, Device["CUDA"].renderer)
  assert apply_staged_tensor_core(kernel, TC_CHOICE[dtype], SMALL_TILE)
  output = Buffer("CUDA", item.outputs[0].size, item.outputs[0].dtype).allocate()
  compile_kernel(kernel, "CUDA")((output,) + item.inputs)
  result = output.numpy()
  if output.dtype == dtypes.bfloat16: result = bfloat16_bits_to_float32(result)
  reference = expression(*[torch.from_numpy(value) for value in values]).numpy().reshape(-1)
  error = np.linalg.norm(result.astype(np.float64) - reference) / np.linalg.norm(reference)
  assert error < RELATIVE_ERROR[dtype], (case, dtype, error)
