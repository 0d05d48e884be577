"""CPU convolutions at both x86 SIMD widths: a convolution, its input gradient and its weight gradient read the operand
whose register-tile columns would be gathered from scalar loads (the filter along its output or input channels, the
output gradient along its channels) from a packed copy with those columns innermost (codegen/opt/cpu_tiles.py
cpu_gathered_pack, lazy_reduce.cpu_packed_gathered), so the convolution's kernel loads vectors of contiguous columns.
Each schedule is optimized for AVX2 (-march=x86-64-v3) and AVX-512 (-march=x86-64-v4), compiled by gcc at that width
and, where this CPU has it, run and compared with PyTorch (odd sizes, strides, padding).
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.opt.cpu_tiles import CPU_PACK_MIN_ROWS_GATHERED, buffer_loads, cpu_gathered_pack
from ourgrad.engine.schedule import create_schedule
from test_cpu_tiles import (TARGETS, _at_width, _cpu_has, _gcc, _kernel, _renderer, _run_compiled, _run_schedule_at,
                            _source)

# in the C source: a vector loaded whole, and a vector built from scalar loads (renderer/cvector.py)
VECTOR_LOAD = re.compile(r"\*\(const float\d+v_u\*\)\(data\d+")
GATHER = re.compile(r"\(float\d+v\)\{data\d+\[")


# the lazy shape of a convolution's reduce: (batch, groups, out channels, rows, columns, in channels, taps y, taps x)
FORWARD = (128, 1, 32, 20, 20, 32, 5, 5)
FORWARD_REDUCE = (5, 6, 7)


def test_the_filter_is_packed_along_its_output_channels():
  """A 5x5 forward: the image columns (20) take no full tile of columns at either width, the filter (strides 800 along
  the output channels) is packed along them; 16 image columns take the AVX2 tile (2 x 8) as they are, not AVX-512's
  (2 x 16). A filter reused by too few outputs is not packed."""
  window = (18432, 0, 0, 24, 1, 576, 24, 1)
  weight = (0, 0, 800, 0, 0, 25, 5, 1)
  for vector_bytes in (32, 64):
    assert cpu_gathered_pack(FORWARD, FORWARD_REDUCE, [window, weight], [False, True], vector_bytes) == (1, 2)
  wide = (128, 1, 32, 20, 16, 32, 5, 5)
  assert cpu_gathered_pack(wide, FORWARD_REDUCE, [window, weight], [False, True], 32) is None
  assert cpu_gathered_pack(wide, FORWARD_REDUCE, [window, weight], [False, True], 64) == (1, 2)
  few = (1, 1, 32, 2, 20, 32, 5, 5)
  assert 2 * 20 < CPU_PACK_MIN_ROWS_GATHERED
  assert cpu_gathered_pack(few, FORWARD_REDUCE, [window, weight], [False, True], 64) is None


def test_the_smaller_operand_is_packed():
  """A weight gradient (out channels, in channels, taps summed over images and pixels): both operands vary along a
  channel axis the other broadcasts; the output gradient (128x32x20x20) is smaller than the input (its taps too) and is
  the one packed; the input, reused by 32 output channels only, is not."""
  shape, reduce_axes = (1, 32, 32, 5, 5, 128, 20, 20), (5, 6, 7)
  inputs = (0, 0, 576, 24, 1, 18432, 24, 1)
  gradient = (0, 400, 0, 0, 0, 12800, 20, 1)
  assert cpu_gathered_pack(shape, reduce_axes, [inputs, gradient], [True, True], 64) == (1, 1)
  assert cpu_gathered_pack(shape, reduce_axes, [inputs, gradient], [True, False], 64) is None


CASES = {  # name: (input shape, weight shape, stride, padding)
  "5x5": ((6, 16, 13, 13), (32, 16, 5, 5), 1, 0),
  "5x5 larger": ((8, 16, 20, 20), (32, 16, 5, 5), 1, 0),
  "3x3 padded": ((5, 16, 11, 9), (16, 16, 3, 3), 1, 1),
  "3x3 strided": ((4, 16, 14, 15), (32, 16, 3, 3), 2, 1),
}


def _conv_grads(name: str) -> tuple[dict[str, Tensor], dict[str, np.ndarray]]:
  """ourgrad's forward, input gradient and weight gradient of case `name` (lazy), and PyTorch's in float64."""
  x_shape, w_shape, stride, padding = CASES[name]
  rng = np.random.default_rng(3)
  x_np, w_np = (rng.standard_normal(shape).astype(np.float32) for shape in (x_shape, w_shape))
  xt, wt = (torch.from_numpy(array).double().requires_grad_() for array in (x_np, w_np))
  out_t = torch.nn.functional.conv2d(xt, wt, stride=stride, padding=padding)
  g_np = rng.standard_normal(tuple(out_t.shape)).astype(np.float32)
  out_t.backward(torch.from_numpy(g_np).double())
  x, w = Tensor(x_np, requires_grad=True).realize(), Tensor(w_np, requires_grad=True).realize()
  out = x.conv2d(w, stride=stride, padding=padding)
  out.backward(Tensor(g_np).realize())
  ours = {"forward": x.conv2d(w, stride=stride, padding=padding), "input gradient": x.grad, "weight gradient": w.grad}
  reference = {"forward": out_t.detach().numpy(), "input gradient": xt.grad.numpy(), "weight gradient": wt.grad.numpy()}
  return ours, reference


def _conv_kernel(output: Tensor, march: str) -> Kernel:
  """The kernel of `output`'s schedule with the most reduce work, optimized for `march`."""
  items = [item for item in create_schedule([output.lazydata]) if item.outputs]
  kernels = []
  for item in items:
    kernel = Kernel(item.ast, _renderer(march))
    kernel.hand_coded_optimizations()
    kernels.append(kernel)
  return max(kernels, key=lambda kernel: np.prod(kernel.full_shape) if kernel.reduceop is not None else 0)


@pytest.mark.parametrize("march", sorted(TARGETS))
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("part", ["forward", "input gradient", "weight gradient"])
def test_convolution_loads_contiguous_columns(march: str, name: str, part: str, monkeypatch: pytest.MonkeyPatch):
  """The convolution's kernel has a register tile whose columns (the last UPCAST) are contiguous in one operand: its
  C source loads whole vectors and builds none from scalar loads (a gather). The values match PyTorch at that width."""
  _gcc()
  _at_width(monkeypatch, march)
  ours, reference = _conv_grads(name)
  kernel = _conv_kernel(ours[part], march)
  columns = kernel.upcast_axes[-1]
  assert 1 in [st.real_strides()[columns] for st in buffer_loads(kernel)], f"{part} of {name} at {march}"
  source = _source(kernel)
  assert VECTOR_LOAD.search(source) and not GATHER.search(source), f"{part} of {name} at {march}: a gathered vector"
  if not _cpu_has(TARGETS[march][2]): pytest.skip(f"this CPU cannot run -march={march} code")
  ours, reference = _conv_grads(name)
  # contiguous(): a strided convolution's input gradient is a view of its kernel's output
  _, result = _run_schedule_at(ours[part].contiguous(), march)
  want = reference[part]
  np.testing.assert_allclose(result.reshape(want.shape), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_reduce_parts_fit_the_l2():
  """A weight gradient's images in the fewest parts whose operands fill half the L2 (125 KB an image, 1 MiB L2: 4
  images a part), the image rows where one image overflows it, none where the operands fit already or the partial
  results would outweigh them."""
  from ourgrad.codegen.opt.cpu_tiles import cpu_gathered_reduce_parts
  assert cpu_gathered_reduce_parts([128, 20, 20], 16_000_000, 102_400, 1 << 20) == (0, 32)
  assert cpu_gathered_reduce_parts([4, 20, 20], 500_000, 102_400, 1 << 20) == (0, 1)
  assert cpu_gathered_reduce_parts([128, 20, 20], 16_000_000, 600_000, 1 << 20) == (0, 1)   # 32 x 600 KB > 16 MB
  assert cpu_gathered_reduce_parts([128, 20, 20], 16_000_000, 102_400, 0) == (0, 1)
  # 32 images of 62x62 (24 MB): 32 parts of one image each would still take 750 KB; 62 parts of one row take 390 KB
  assert cpu_gathered_reduce_parts([32, 62, 62], 24_000_000, 18_432, 1 << 20) == (1, 62)


@pytest.mark.parametrize("march", sorted(TARGETS))
def test_weight_gradient_in_parts(march: str, monkeypatch: pytest.MonkeyPatch):
  """With a 256 KiB L2 the 5x5 weight gradient's 8 images (58 KB of operands each) go in 4 parts of 2: a kernel of
  partial results (the parts outermost), then their sum. The values match PyTorch at that width."""
  _gcc()
  _at_width(monkeypatch, march)
  from ourgrad.device import Device
  monkeypatch.setattr(Device["CLANG"].renderer, "l2_cache_bytes", 256 << 10, raising=False)
  ours, reference = _conv_grads("5x5 larger")
  items = [item for item in create_schedule([ours["weight gradient"].lazydata]) if item.outputs]
  assert [item.outputs[0].size for item in items[-2:]] == [4 * 32 * 16 * 25, 32 * 16 * 25]
  if not _cpu_has(TARGETS[march][2]): pytest.skip(f"this CPU cannot run -march={march} code")
  ours, reference = _conv_grads("5x5 larger")
  _, result = _run_schedule_at(ours["weight gradient"], march)
  want = reference["weight gradient"]
  np.testing.assert_allclose(result.reshape(want.shape), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_two_registers_of_channels_before_one_of_columns(monkeypatch: pytest.MonkeyPatch):
  """A 3x3 forward with 8 output columns at AVX2: one register of image columns with 8 rows of channels, or the packed
  filter's 64 output channels as two registers with the 6 images as rows: the two registers come first
  (the CNN step's 3x3 input gradient and forward: 89-94 -> 112-117 GFLOP/s)."""
  _gcc()
  _at_width(monkeypatch, "x86-64-v3")
  rng = np.random.default_rng(4)
  x = Tensor(rng.standard_normal((6, 32, 10, 10)).astype(np.float32)).realize()
  w = Tensor(rng.standard_normal((64, 32, 3, 3)).astype(np.float32)).realize()
  kernel = _conv_kernel(x.conv2d(w), "x86-64-v3")
  assert kernel.full_shape[kernel.upcast_axes[-1]] == 16
  assert [opt.amount for opt in kernel.applied_opts if opt.op.name == "UPCAST"] == [6, 16]


@pytest.mark.parametrize("march", sorted(TARGETS))
def test_short_elementwise_loop_takes_fewer_lanes(march: str):
  """An elementwise kernel's `omp simd` loop of 20 columns (a max-pool backward's: half-index loads) runs as 8 lanes
  at AVX-512 (two vectors and 4 left, where 16 lanes made one vector and gathers), as the target's 8 lanes at AVX2
  (no simdlen). The values match numpy."""
  _gcc()
  rng = np.random.default_rng(5)
  a_np = rng.standard_normal((64, 20, 20)).astype(np.float32)
  b_np = rng.standard_normal((64, 10, 10)).astype(np.float32)
  a, b = Tensor(a_np).realize(), Tensor(b_np).realize()
  output = a * b.reshape(64, 10, 1, 10, 1).expand(64, 10, 2, 10, 2).reshape(64, 20, 20) + 1
  item, kernel = _kernel(output, march)
  source = _source(kernel)
  assert ("simdlen(8)" in source) == (march == "x86-64-v4"), source
  if not _cpu_has(TARGETS[march][2]): pytest.skip(f"this CPU cannot run -march={march} code")
  result = np.zeros(64 * 400, np.float32)
  _run_compiled(source, kernel.name, march, [result, *[buffer.numpy() for buffer in item.inputs]])
  want = a_np * np.repeat(np.repeat(b_np, 2, axis=1), 2, axis=2) + 1
  np.testing.assert_allclose(result.reshape(64, 20, 20), want, rtol=1e-5, atol=1e-6)   # a fused multiply-add
