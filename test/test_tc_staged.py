"""Tensor-core tiles staged through local memory (OptOps.TC + OptOps.SHARED): cp.async COPYs, ldmatrix fragments.

The kernels run on the PYTHON device with CUDA's limits, whose interpreter emulates the COPY (asynchronous: the data
lands at the ASYNC_WAIT), LDMATRIX (lane -> row addresses as the PTX ISA gives them) and mma.sync; they must give the
plain kernel's (NOOPT) results with an error against float64 no worse than PyTorch's in the same dtype. Every kernel
is also rendered as CUDA C++ and compiled by NVRTC (sm_90) when it is installed, and the 4096^3 kernel the
heuristic makes is checked for ldmatrix / cp.async / mma in its PTX and for no register spills.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ourgrad import Tensor, dtypes
from ourgrad.codegen import tensor_core_tiles
from ourgrad.codegen.kernel import Kernel, KernelOptError, Opt, OptOps
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.uops import UOps
from ourgrad.engine.schedule import create_schedule
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer

from helpers import device_opens
from test_tensor_cores import NVRTC, TC_CHOICE, _check_against_reference, _matmul_item, _operands, _run

# 2x2 warps of 2x2 mma tiles (a 64x32 block tile), reduce steps of 32
STAGED_OPTS = [Opt(OptOps.UPCAST, 1, 2), Opt(OptOps.UPCAST, 0, 2), Opt(OptOps.LOCAL, 1, 2), Opt(OptOps.LOCAL, 0, 2),
               Opt(OptOps.UNROLL, 0, 2), Opt(OptOps.SHARED, 0, 0)]
LAYOUTS = {"a@b": lambda a, b: (a, b), "a@bT": lambda a, b: (a, b.T), "aT@b": lambda a, b: (a.T, b),
           "aT@bT": lambda a, b: (a.T, b.T)}


def _staged_kernel(item, dtype, pads: list[Opt] = (), batch_axes: int = 0) -> Kernel:
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  shifted = [Opt(opt.op, opt.axis + batch_axes, opt.amount) if opt.op in (OptOps.UPCAST, OptOps.LOCAL) else opt
             for opt in STAGED_OPTS]
  for opt in [*pads, Opt(OptOps.TC, 0, TC_CHOICE[dtype]), *shifted]: kernel.apply_opt(opt)
  return kernel


@pytest.mark.parametrize("dtype", [dtypes.float16, dtypes.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_staged_tc_matches_noopt(dtype, layout: str) -> None:
  """Each operand contiguous along K (ldmatrix) or along M/N (ldmatrix .trans), four reduce steps (double buffered)."""
  shape_a, shape_b = (128, 64) if "aT" in layout else (64, 128), (64, 128) if "bT" in layout else (128, 64)
  left, right = LAYOUTS[layout](*_operands(dtype, shape_a, shape_b, seed=len(layout)))
  item = _matmul_item(left, right)
  plain = _run(Kernel(item.ast, PythonRenderer("CUDA")), item)
  kernel = _staged_kernel(item, dtype)
  tile_a, tile_b = kernel.tensor_core_tiles()
  assert (tile_a.transposed, tile_b.transposed) == ("aT" in layout, "bT" not in layout)
  uops = linearize(kernel)
  loads = [uop for uop in uops if uop.op is UOps.LDMATRIX]
  # per reduce step: 2 K instructions x (2 A fragments (.x4) + the 2 neighbouring B fragments (one .x4)); one wait
  # and barrier
  assert [uop.arg[0] for uop in loads] == [4] * 6
  assert sum(uop.op is UOps.ASYNC_WAIT for uop in uops) == 1 and sum(uop.op is UOps.BARRIER for uop in uops) == 1
  assert all(uop.arg == (8, True) for uop in uops if uop.op is UOps.COPY)   # 16-byte asynchronous copies
  assert not any(uop.op is UOps.LOAD and uop.srcs[0].op is UOps.DEFINE_GLOBAL for uop in uops)
  _check_against_reference(left, right, dtype, _run(kernel, item), plain)


def test_staged_tc_ragged_and_batched() -> None:
  """Ragged M and N padded to the block tile: the padding is zero-filled by the copies (B's rows of 40 halves are
  only 16-byte aligned every 8: 8-byte pieces); and a batched matmul (the batch is a block index)."""
  a, b = _operands(dtypes.float16, (40, 64), (64, 20), seed=21)
  item = _matmul_item(a, b)
  plain = _run(Kernel(item.ast, PythonRenderer("CUDA")), item)
  kernel = _staged_kernel(item, dtypes.float16, [Opt(OptOps.PADTO, 0, 64), Opt(OptOps.PADTO, 1, 32)])
  uops = linearize(kernel)
  widths = {uop.srcs[0].arg[0]: uop.arg[0] for uop in uops if uop.op is UOps.COPY}
  masked = {uop.srcs[0].arg[0] for uop in uops if uop.op is UOps.COPY and len(uop.srcs) == 5}
  assert widths == {"tile_a": 8, "tile_b": 4} and masked == {"tile_a", "tile_b"}
  _check_against_reference(a, b, dtypes.float16, _run(kernel, item), plain)
  a, b = _operands(dtypes.bfloat16, (3, 64, 64), (3, 64, 32), seed=22)
  item = _matmul_item(a, b)
  plain = _run(Kernel(item.ast, PythonRenderer("CUDA")), item)
  kernel = _staged_kernel(item, dtypes.bfloat16, batch_axes=1)
  _check_against_reference(a, b, dtypes.bfloat16, _run(kernel, item), plain)


def test_heuristic_stages_large_tc_matmuls() -> None:
  """A float16 matmul that fills the 128x128x32 block tile gets TC + SHARED from the GPU heuristic (2x2 warps of
  64x64, 128 threads); a small one keeps the unstaged TC kernel."""
  a, b = _operands(dtypes.float16, (128, 64), (64, 128), seed=23)
  item = _matmul_item(a, b)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  kernel.hand_coded_optimizations()
  assert kernel.shared_tiles and kernel.tensor_core is not None and kernel.block_threads() == 128
  plain = _run(Kernel(item.ast, PythonRenderer("CUDA")), item)
  _check_against_reference(a, b, dtypes.float16, _run(kernel, item), plain)
  small = Kernel(_matmul_item(*_operands(dtypes.float16, (32, 32), (32, 32), seed=24)).ast, PythonRenderer("CUDA"))
  small.hand_coded_optimizations()
  assert small.tensor_core is not None and not small.shared_tiles


def test_a_wrong_ldmatrix_row_map_fails(monkeypatch) -> None:
  """The linearizer points A's lanes at the wrong 8x8 matrices (matrices 1 and 2 swapped) while the interpreter
  keeps the PTX ISA's ldmatrix semantics: the results must differ from the plain kernel's."""
  a, b = _operands(dtypes.float16, (64, 64), (64, 64), seed=25)
  item = _matmul_item(a, b)
  plain = _run(Kernel(item.ast, PythonRenderer("CUDA")), item)
  right = tensor_core_tiles.ldmatrix_row

  def swapped(lane, operand_is_a: bool):
    m_or_n, k = right(lane, operand_is_a)
    return (k, m_or_n) if operand_is_a else (m_or_n, k)
  monkeypatch.setattr(tensor_core_tiles, "ldmatrix_row", swapped)
  kernel = _staged_kernel(item, dtypes.float16)
  from ourgrad.device import Buffer
  from ourgrad.engine.realize import compile_kernel
  output = Buffer("PYTHON", item.outputs[0].size, item.outputs[0].dtype).allocate()
  compile_kernel(kernel, "PYTHON")((output,) + item.inputs)
  assert not np.allclose(output.numpy().astype(np.float64), plain, rtol=2e-2, atol=2e-2)


# a convolution's several reduce loops (input channels and the filter's window) are staged as one flat loop now:
# test_conv_gpu.py::test_staged_tensor_core_conv_matches_the_plain_kernel
@pytest.mark.parametrize("case", ["rows_under_8"])
def test_illegal_staged_tc_raises(case: str) -> None:
  if case == "rows_under_8":   # aT@b with one 16-row M tile per block: A's rows (along M) are 16 long; B's along N 8
    a, b = _operands(dtypes.float16, (32, 16), (32, 8), seed=27)
    kernel = Kernel(_matmul_item(a.T, b).ast, PythonRenderer("CUDA"))
    kernel.apply_opt(Opt(OptOps.TC, 0, 0))
    kernel.apply_opt(Opt(OptOps.UNROLL, 0, 2))
    with pytest.raises(KernelOptError): kernel.apply_opt(Opt(OptOps.SHARED, 0, 0))


@pytest.mark.skipif(NVRTC is None, reason="needs NVRTC")
@pytest.mark.parametrize("shape", [(4096, 4096, 4096), (4097, 4096, 4095)], ids=["4096", "ragged"])
def test_cuda_staged_kernel_ptx_and_registers(shape) -> None:
  """The heuristic's kernel for the benchmark's matmuls: ldmatrix (.x4 for A, .x4.trans for pairs of a row-major B),
  cp.async.cg, mma.sync in the PTX; no global loads in the 4096^3 one; no local-memory spills."""
  m, k, n = shape
  # scheduled on the PYTHON device (GPU-like decisions): a CPU default device may pack or split a large matmul
  a, b = Tensor.empty(m, k, dtype=dtypes.float16, device="PYTHON"), Tensor.empty(k, n, dtype=dtypes.float16,
                                                                                  device="PYTHON")
  kernel = Kernel(create_schedule([(a @ b).lazydata])[-1].ast, CUDARenderer())
  kernel.hand_coded_optimizations()
  assert kernel.shared_tiles and kernel.tensor_core is not None
  source = CUDARenderer().render(kernel.name, linearize(kernel))
  ptx = NVRTC.ptx(source)
  # per reduce step of 64 (4 K instructions): A 4 M tiles x 4, B 8 N tiles in pairs x 4, 32 tiles x 4 mma
  assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.shared.b16") == 16
  assert ptx.count("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 16
  assert ptx.count("mma.sync.aligned.m16n8k16") == 128 and "cp.async.cg.shared.global" in ptx
  assert kernel.local_memory_bytes() == 2 * (128 * 72 + 64 * 136) * 2   # 72 KB: dynamic shared memory
  assert ("ld.global" in ptx) == (shape[0] == 4097)   # B's ragged rows: element by element
  info = NVRTC.ptxas_info(source)
  assert "0 bytes spill stores, 0 bytes spill loads" in info, info




@pytest.mark.skipif(not device_opens("CUDA"), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("shape", [(256, 128, 256), (300, 96, 200)], ids=["tiles", "ragged"])
def test_staged_tc_on_cuda(shape) -> None:
  m, k, n = shape
  rng = np.random.default_rng(28)
  a_values, b_values = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
  a, b = (Tensor(values, device="CUDA").cast(dtypes.float16) for values in (a_values, b_values))
  got = (a @ b).cast(dtypes.float32).numpy()
  a64, b64 = (torch.tensor(values.astype(np.float16).astype(np.float64)) for values in (a_values, b_values))
  reference = (a64 @ b64).numpy()
  torch_out = (a64.half() @ b64.half()).double().numpy() if torch.cuda.is_available() else reference
  error = np.linalg.norm(got - reference) / np.linalg.norm(reference)
  assert error <= 1.5 * np.linalg.norm(torch_out - reference) / np.linalg.norm(reference) + 1e-3


@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("k", [32, 128], ids=["fewer_steps_than_stages", "more_steps"])
def test_staged_tc_with_more_stages(stages: int, k: int) -> None:
  """SHARED's amount sets the stages: stages - 1 steps are copied ahead (one cp.async group each, empty groups past
  the last step) and each step waits for all but the newest stages - 2 groups; the interpreter lands a group only
  when its wait says so, so a wrong count reads stale or unwritten tiles."""
  a, b = _operands(dtypes.float16, (64, k), (k, 64), seed=29)
  item = _matmul_item(a, b)
  plain = _run(Kernel(item.ast, PythonRenderer("CUDA")), item)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  for opt in [Opt(OptOps.TC, 0, 0), *STAGED_OPTS[:-2], Opt(OptOps.SHARED, 0, stages)]: kernel.apply_opt(opt)
  assert kernel.tensor_core_tiles()[0].stages == stages
  waits = [uop.arg for uop in linearize(kernel) if uop.op is UOps.ASYNC_WAIT]
  assert waits == [stages] * (stages - 2) + [stages - 2]
  _check_against_reference(a, b, dtypes.float16, _run(kernel, item), plain)


def test_odd_n_tiles_use_x2() -> None:
  """Three N tiles per warp do not pair: each B fragment is one ldmatrix .x2 (lanes 16..31 unused)."""
  a, b = _operands(dtypes.float16, (32, 64), (64, 48), seed=30)
  item = _matmul_item(a, b)
  plain = _run(Kernel(item.ast, PythonRenderer("CUDA")), item)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  for opt in [Opt(OptOps.TC, 0, 0), Opt(OptOps.UPCAST, 1, 3), Opt(OptOps.LOCAL, 1, 2), Opt(OptOps.UNROLL, 0, 2),
              Opt(OptOps.SHARED, 0, 0)]: kernel.apply_opt(opt)
  counts = sorted(uop.arg[0] for uop in linearize(kernel) if uop.op is UOps.LDMATRIX)
  assert counts == [2] * 6 + [4] * 2
  _check_against_reference(a, b, dtypes.float16, _run(kernel, item), plain)


def test_heuristic_stages_with_k_steps_of_16() -> None:
  """K = 48 is not a multiple of the 32-element step: the heuristic stages with steps of 16 (3 steps)."""
  a, b = _operands(dtypes.float16, (128, 48), (48, 128), seed=31)
  item = _matmul_item(a, b)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  kernel.hand_coded_optimizations()
  assert kernel.shared_tiles and Opt(OptOps.UNROLL, 0, 2) not in kernel.applied_opts
  plain = _run(Kernel(item.ast, PythonRenderer("CUDA")), item)
  _check_against_reference(a, b, dtypes.float16, _run(kernel, item), plain)


def test_tiles_over_48kb_use_dynamic_shared_memory() -> None:
  """Three stages of 128x128x32 tiles (56 KB) fit the staged-TC limit (dynamic shared memory), not the static one:
  CUDA renders one extern shared array the tiles point into, and exports its size for the launch."""
  a = Tensor.empty(4096, 4096, dtype=dtypes.float16, device="PYTHON")   # GPU-like scheduling (see above)
  b = Tensor.empty(4096, 4096, dtype=dtypes.float16, device="PYTHON")
  kernel = Kernel(create_schedule([(a @ b).lazydata])[-1].ast, CUDARenderer())
  for opt in [Opt(OptOps.TC, 0, 0), Opt(OptOps.UPCAST, 1, 8), Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.LOCAL, 1, 2),
              Opt(OptOps.LOCAL, 0, 2), Opt(OptOps.UNROLL, 0, 2), Opt(OptOps.SHARED, 0, 3)]: kernel.apply_opt(opt)
  assert kernel.local_memory_bytes() == 3 * (128 * 40 + 32 * 136) * 2 > 48 * 1024
  source = CUDARenderer().render(kernel.name, linearize(kernel))
  assert "extern __shared__ __align__(16) unsigned char ourgrad_shared[];" in source
  assert 'extern "C" __device__ unsigned int ourgrad_dynamic_shared_bytes = 56832;' in source
  assert "unsigned short* tile_b = (unsigned short*)(ourgrad_shared + 30720);" in source
  if NVRTC is not None:   # no static shared memory left; the 4-byte size is the module's global
    info = NVRTC.ptxas_info(source)
    assert "bytes smem" not in info and "4 bytes gmem" in info and "0 bytes spill stores" in info


def test_tc_convolution_with_several_reduce_loops() -> None:
  """A float16 convolution whose K is several reduce loops (input channels / 16 = 2, and the 3x3 window): every loop
  keeps its own extent (the H100 run caught the unstaged TC kernel opening each with the first loop's)."""
  rng = np.random.default_rng(32)
  x_values, w_values = rng.standard_normal((2, 32, 8, 8)), rng.standard_normal((16, 32, 3, 3))
  x, w = (Tensor(values.astype(np.float32), device="PYTHON").cast(dtypes.float16).realize()
          for values in (x_values, w_values))
  schedule = create_schedule([x.conv2d(w, padding=1).lazydata])
  from ourgrad.engine.realize import run_schedule
  run_schedule(schedule[:-1])
  item = schedule[-1]
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  kernel.hand_coded_optimizations()
  assert Opt(OptOps.TC, 0, 0) in kernel.applied_opts and kernel.first_upcast - kernel.first_loop_reduce == 3
  got = _run(kernel, item)
  x64, w64 = (torch.tensor(values.astype(np.float16).astype(np.float64)) for values in (x_values, w_values))
  reference = torch.nn.functional.conv2d(x64, w64, padding=1).numpy().reshape(-1)
  assert np.linalg.norm(got - reference) / np.linalg.norm(reference) < 1e-3
