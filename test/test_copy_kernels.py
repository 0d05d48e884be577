"""Elementwise kernels at copy bandwidth on GPUs: float4 loads and stores wherever the views allow them.

- a flat elementwise kernel (GELU forward and backward over a whole activation) takes 4 elements a thread, one
  float4 load per input and one float4 store (heuristic._elementwise_rows);
- a cat of pieces (a sum of masked pad views) loads each piece as one gated float4 vector where the piece's edges
  fall between vectors: where the gate is false the load touches no memory (linearizer._vector_load);
- a kernel of several outputs (two cats fused, an output stored twice) stores each as float4 vectors
  (linearizer._vector_store_axis).

Each kernel is optimized for CUDA's limits (the PYTHON device's EMULATE=CUDA renderer) and run on the PYTHON
interpreter against numpy (or torch for GELU's gradient); the same opts rendered as CUDA C are pinned (vector widths,
no scalar access left) and compiled with NVRTC where it is installed.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.uops import UOps
from ourgrad.device import Buffer
from ourgrad.engine.realize import compile_kernel, run_schedule
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer

from helpers import cuda_source, nvrtc_compiler

rng = np.random.default_rng(24)
NVRTC = nvrtc_compiler()



@pytest.fixture(autouse=True)
def gated_vector_loads(monkeypatch):
  """The gated float4 loads these tests pin (GATED_VECTOR_LOADS, on by default), set here so that the tests hold
  whatever the environment says."""
  monkeypatch.setenv("GATED_VECTOR_LOADS", "1")

def _array(*shape: int) -> np.ndarray: return rng.standard_normal(shape).astype(np.float32)


def _last_item(outputs: list[Tensor]) -> ScheduleItem:
  schedule = create_schedule([tensor.lazydata for tensor in outputs])
  run_schedule(schedule[:-1])
  return schedule[-1]


def _run_emulated(item: ScheduleItem) -> list[np.ndarray]:
  """The kernel of `item` optimized for CUDA and interpreted by the PYTHON device: each output's values."""
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  kernel.hand_coded_optimizations()
  runner = compile_kernel(kernel, "PYTHON")
  outputs = [Buffer("PYTHON", buffer.size, buffer.dtype).allocate() for buffer in item.outputs]
  runner(tuple(outputs) + item.inputs)
  return [output.numpy() for output in outputs]


def _scalar_accesses(source: str) -> int:
  """Scalar global loads and stores in a CUDA source (`dataN[...]`)."""
  return len(re.findall(r"\bdata\d+\[", source))


def _scalar_loads(source: str) -> int:
  """Scalar global loads in a CUDA source (`valN = ... dataN[...]`)."""
  return len(re.findall(r"\bval\d+ = [^;]*\bdata\d+\[", source))


def _gelu_tanh(h: np.ndarray) -> np.ndarray:
  return 0.5 * h * (1 + np.tanh(0.7978845608 * (h + 0.044715 * h ** 3)))


def test_flat_gelu_forward_loads_and_stores_float4() -> None:
  """GELU over a (64, 512) activation is one flat axis: each thread one float4 load and one float4 store."""
  h = _array(64, 512)
  item = _last_item([Tensor(h, device="PYTHON").gelu(approximate="tanh")])
  np.testing.assert_allclose(_run_emulated(item)[0].reshape(h.shape), _gelu_tanh(h), rtol=1e-5, atol=1e-5)
  source = cuda_source(item, NVRTC)
  assert source.count("*((const float4*)(data1+") == 1 and source.count("*((float4*)(data0+") == 1
  assert _scalar_accesses(source) == 0


def test_flat_gelu_backward_loads_and_stores_float4() -> None:
  """GELU's input gradient (its transcendentals in the expression): float4 for every input and the output; the
  values against torch's autograd."""
  import torch
  h, g = _array(64, 512), _array(64, 512)
  x = Tensor(h, device="PYTHON", requires_grad=True)
  x.gelu(approximate="tanh").backward(Tensor(g, device="PYTHON"))
  item = _last_item([x.grad])
  reference = torch.tensor(h, requires_grad=True)
  torch.nn.functional.gelu(reference, approximate="tanh").backward(torch.tensor(g))
  np.testing.assert_allclose(_run_emulated(item)[0].reshape(h.shape), reference.grad.numpy(), rtol=1e-4, atol=1e-5)
  source = cuda_source(item, NVRTC)
  assert _scalar_accesses(source) == 0 and source.count("*((float4*)(data0+") == 1


def _qkv_pieces(batch: int, heads: int, tokens: int, head_dim: int) -> tuple[list[np.ndarray], list[Tensor]]:
  """GPT-2's attention input gradients as they are stored: dq and dk (B, H, T, D), dv (B, H, D, T) (K-major, as
  its matmul writes it); the numpy (B*T, H*D) rows of each and the tensors viewed so."""
  dq, dk, dv_t = _array(batch, heads, tokens, head_dim), _array(batch, heads, tokens, head_dim), \
    _array(batch, heads, head_dim, tokens)
  rows = [dq.transpose(0, 2, 1, 3), dk.transpose(0, 2, 1, 3), dv_t.transpose(0, 3, 1, 2)]
  arrays = [piece.reshape(batch * tokens, heads * head_dim) for piece in rows]
  tensors = [Tensor(dq, device="PYTHON").permute(0, 2, 1, 3), Tensor(dk, device="PYTHON").permute(0, 2, 1, 3),
             Tensor(dv_t, device="PYTHON").permute(0, 3, 1, 2)]
  return arrays, [tensor.reshape(batch * tokens, heads * head_dim) for tensor in tensors]


def test_two_aligned_cats_transposed_read_only_gated_vectors() -> None:
  """Two cats of dq, dk, dv along the channels stored K-major (the WGMMA weight gradient's operand,
  engine/operand_staging.py) that share their dq piece, so one kernel writes both (engine/multi_output.py groups only
  outputs with a common read). Each piece's 32 channels align to the 4 x 4 register tiles: every load is a gated
  float4 (no masked scalar load), every store a float4 row of each output."""
  layers = [_qkv_pieces(2, 2, 32, 32) for _ in range(2)]
  layers[1][0][0], layers[1][1][0] = layers[0][0][0], layers[0][1][0]   # the second cat reads the first's dq
  cats = [tensors[0].cat(tensors[1], tensors[2], dim=1) for _, tensors in layers]
  item = _last_item([cat.T.contiguous() for cat in cats])
  assert len(item.outputs) == 2
  for (arrays, _), got in zip(layers, _run_emulated(item)):
    expected = np.concatenate(arrays, axis=1).T
    np.testing.assert_allclose(got.reshape(expected.shape), expected)
  source = cuda_source(item, NVRTC)
  assert _scalar_accesses(source) == 0, source
  assert source.count("? *((const float4*)") == 20   # 4 vectors of a 4 x 4 tile x 5 pieces (dq's loaded once)
  assert source.count("*((float4*)(data0+") == source.count("*((float4*)(data1+") == 4


def test_transposed_cat_stores_float4_and_loads_each_piece_as_vectors() -> None:
  """The K-major cat alone (the WGMMA weight gradient's operand, engine/operand_staging.py): its loads are gated
  float4 vectors along each piece's own contiguous axis, its stores float4 along the tokens; no lane of a warp
  reads a piece its block does not hold (the tile's sectors counted on the emulated lowering)."""
  from ourgrad.codegen.opt.transpose_tiles import warp_sectors
  arrays, tensors = _qkv_pieces(2, 2, 32, 32)
  item = _last_item([tensors[0].cat(tensors[1], tensors[2], dim=1).T.contiguous()])
  expected = np.concatenate(arrays, axis=1).T
  np.testing.assert_allclose(_run_emulated(item)[0].reshape(expected.shape), expected)
  source = cuda_source(item, NVRTC)
  assert _scalar_accesses(source) == 0, source
  kernel = Kernel(item.ast, CUDARenderer())
  kernel.hand_coded_optimizations()
  for block in (0.0, 0.5, 0.9):   # a block in each piece: only that piece's loads have lanes
    loads = [access for access in warp_sectors(linearize(kernel), block=block) if access.op is UOps.LOAD]
    assert all(access.lane_bytes == 16 for access in loads)
    assert len({access.buffer for access in loads if access.lanes}) == 1


@pytest.mark.parametrize("widths", [(6, 10), (8, 12, 4)], ids=["unaligned", "vector_aligned"])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
def test_cat_pieces_across_vectors_match_numpy(widths: tuple[int, ...], transposed: bool) -> None:
  """Pieces whose edges cut a float4 (6 + 10 channels) keep scalar masked loads there; pieces on vector edges load
  gated vectors. Stored row-major (times 2) and transposed, against numpy."""
  arrays = [_array(48, width) for width in widths]
  tensors = [Tensor(array, device="PYTHON") for array in arrays]
  cat = tensors[0].cat(*tensors[1:], dim=1)
  expected = np.concatenate(arrays, axis=1)
  result, expected = (cat.T.contiguous(), expected.T) if transposed else ((cat * 2).contiguous(), expected * 2)
  item = _last_item([result])
  np.testing.assert_allclose(_run_emulated(item)[0].reshape(expected.shape), expected)
  source = cuda_source(item, NVRTC)
  # the tile pads 48 rows to 64: its edge stores stay masked scalars, the loads are vectors
  if widths == (8, 12, 4) and transposed: assert _scalar_loads(source) == 0, source
  if widths == (6, 10): assert _scalar_loads(source) > 0   # a piece's edge inside a vector


def test_two_outputs_store_float4() -> None:
  """Two outputs of one kernel in one layout (x + 1 and x * 2 realized together): a float4 store each."""
  x = _array(64, 256)
  xt = Tensor(x, device="PYTHON")
  item = _last_item([xt + 1, xt * 2])
  plus, times = _run_emulated(item)
  np.testing.assert_allclose(plus.reshape(x.shape), x + 1)
  np.testing.assert_allclose(times.reshape(x.shape), x * 2)
  source = cuda_source(item, NVRTC)
  assert source.count("*((float4*)(data0+") == source.count("*((float4*)(data1+") == 1
  assert _scalar_accesses(source) == 0


def test_index_given_valid_matches_brute_force() -> None:
  """symbolic.given_valid: wherever the validity holds, the simplified index has the original's value (every
  variable value tried); the piece's modulo and division fold away."""
  import itertools
  from ourgrad.shape.symbolic import Variable, given_valid, sym_and
  block, lane = Variable("gidx0", 0, 2), Variable("lidx1", 0, 15)
  index = ((block + lane * 4 + 30) % 32) + ((block + lane * 4 + 30) // 32) * 2048
  for valid in [sym_and([(block * -1).lt(-1)]), (block * -16 + lane * -1).lt(-31),
                sym_and([(block * -1).lt(0), block.lt(2)])]:
    simplified = given_valid(index, valid)
    for block_value, lane_value in itertools.product(range(3), range(16)):
      values = {"gidx0": block_value, "lidx1": lane_value}
      if valid.evaluate(values): assert simplified.evaluate(values) == index.evaluate(values)
    # each piece's mask fixes the block index: it leaves the expression
    assert "gidx0" not in simplified.render(), simplified


def test_packed_adamw_segments_load_and_store_float4() -> None:
  """Two AdamW groups (nanoGPT's: decayed matrices, plain vectors) over parameters of 4-divisible sizes and one of 7
  elements: the step's packed kernel (codegen/packed.py) takes 4 elements a thread in each 4-divisible segment
  (float4 loads of parameter, gradient and moments, float4 stores of each output) and one in the odd one; two steps
  on the PYTHON device (GPU-like: vector width 4) against torch.optim.AdamW."""
  import torch
  from ourgrad.codegen.packed import PackedKernel
  from ourgrad.nn.optim import AdamW
  from ourgrad.ops import Ops
  shapes = [(24, 16), (40, 8), (64,), (7,), (12,)]
  initial = [_array(*shape) for shape in shapes]
  weights = [_array(*shape) for shape in shapes]
  params = [Tensor(value.copy(), device="PYTHON", requires_grad=True) for value in initial]
  decayed, plain = [p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2]
  optimizers = [AdamW(decayed, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
                AdamW(plain, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)]
  torch_params = [torch.tensor(value.copy(), requires_grad=True) for value in initial]
  torch_optimizers = [torch.optim.AdamW([p for p in torch_params if p.ndim >= 2], lr=1e-2, betas=(0.9, 0.95),
                                        weight_decay=0.1),
                      torch.optim.AdamW([p for p in torch_params if p.ndim < 2], lr=1e-2, betas=(0.9, 0.95),
                                        weight_decay=0.0)]
  sources: list[str] = []
  for _ in range(2):
    for optimizer in optimizers: optimizer.zero_grad()
    loss = sum(((param * Tensor(weight, device="PYTHON")) ** 2).sum() for param, weight in zip(params, weights))
    loss.backward()
    updates = [tensor for optimizer in optimizers for tensor in optimizer.schedule_step()]
    schedule = create_schedule([tensor.lazydata for tensor in updates])
    sources += [CUDARenderer().render("pack", PackedKernel(item.ast, CUDARenderer()).linearize())
                for item in schedule if item.ast.op is Ops.PACK]
    run_schedule(schedule)
    for torch_optimizer in torch_optimizers: torch_optimizer.zero_grad()
    torch_loss = sum(((param * torch.tensor(weight)) ** 2).sum() for param, weight in zip(torch_params, weights))
    torch_loss.backward()
    for torch_optimizer in torch_optimizers: torch_optimizer.step()
  for param, expected in zip(params, torch_params):
    np.testing.assert_allclose(param.numpy(), expected.detach().numpy(), rtol=1e-5, atol=1e-6)
  update = max(sources, key=len)   # the parameters' update pack
  assert update.count("*((float4*)(") >= 3 * (len(shapes) - 1), update   # param, m, v of each 4-divisible one
  assert re.search(r"\bdata\d+\[[^\]]*\] = ", update), update            # the 7-element segment: scalar stores
  if NVRTC is not None:
    for source in sources: NVRTC.compile(source)


@pytest.mark.parametrize("name", ["merge_heads", "split_heads"])
def test_head_permutes_load_and_store_float4(name: str) -> None:
  """Attention's head permutes, rows of D = 64 floats: merging (B, H, T, D) back into (B*T, H*D) rows (the biggest
  input contiguous only in pieces of D along the channels: its vectors proven neighbours) and splitting (B, T, H*D)
  into (B, H, T, D) heads (rows of 64: 16 float4 lanes a row). Every load and store a float4, values against numpy."""
  if name == "merge_heads":
    y = _array(2, 3, 16, 64)
    result, expected = Tensor(y, device="PYTHON").permute(0, 2, 1, 3).reshape(32, 192), \
      y.transpose(0, 2, 1, 3).reshape(32, 192)
  else:
    x = _array(2, 16, 192)
    result, expected = Tensor(x, device="PYTHON").reshape(2, 16, 3, 64).permute(0, 2, 1, 3), \
      x.reshape(2, 16, 3, 64).transpose(0, 2, 1, 3)
  item = _last_item([(result * 2).contiguous()])
  np.testing.assert_allclose(_run_emulated(item)[0].reshape(expected.shape), expected * 2)
  source = cuda_source(item, NVRTC)
  assert _scalar_accesses(source) == 0, source
  assert "*((const float4*)(data1+" in source and "*((float4*)(data0+" in source
