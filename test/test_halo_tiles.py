"""Halo tiles (codegen/halo_tiles.py): a float32 convolution with its window unrolled inside the staged step
(conv_tiles.ConvTile(window_unrolled=True)) stages its input once for all taps; the tile's layout, its results
against the unoptimized kernel and torch on the emulated GPU (`PythonRenderer("CUDA")`), NVRTC compiles of the 56x56
benchmark conv's kernel, and on a real GPU the kernel against the plain one.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.opt.conv_tiles import ConvTile, shared_conv_tiles
from ourgrad.engine.realize import function_name, run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.ops import Ops
from ourgrad.runtime.ops_python import PythonRenderer
from helpers import nvrtc_compiler, skip_unless_device
from test_conv_gpu import _conv_ast, _run, rng


def halo(pixel_upcast: int, pixel_threads: int, channel_upcast: int, channel_threads: int, step: int,
         repeats: int = 1, padding: int = 0) -> ConvTile:
  return ConvTile(pixel_upcast, pixel_threads, channel_upcast, channel_threads, step, pixel_repeat=repeats,
                  channel_repeat=repeats, window_unrolled=True, padding=padding)


# (input shape, weight shape, padding, tile): the benchmark conv's 8x8 tile (2 images x 64 channels) in steps of 2
# and 4 channels, with and without padded rows; 8 filters over 12x12 images; MNIST's conv2 (5x5, no padding); more
# padding on the columns than the rows of a 6-row image
HALO_CONVS = [
  ((2, 16, 8, 8), (64, 16, 3, 3), 1, halo(4, 16, 4, 8, 2, repeats=2)),
  ((2, 16, 8, 8), (64, 16, 3, 3), 1, halo(4, 16, 4, 8, 4, repeats=2, padding=4)),
  ((2, 8, 12, 12), (8, 8, 3, 3), 1, halo(4, 4, 4, 2, 2, padding=4)),
  ((3, 16, 12, 12), (32, 16, 5, 5), 0, halo(4, 16, 4, 8, 2)),
  ((4, 8, 6, 14), (16, 8, 3, 3), (1, 2), halo(4, 8, 4, 4, 2)),
]


def _halo_windows(kernel: Kernel) -> list:
  return [window for window in (kernel.halo_window(leaf, axes) for leaf, axes in kernel.staged_loads())
          if window is not None]


@pytest.mark.parametrize("x_shape, w_shape, padding, tile", HALO_CONVS)
def test_halo_tiles_match_the_plain_kernel_and_torch(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                                                     padding: object, tile: ConvTile) -> None:
  ast, inputs = _conv_ast(x_shape, w_shape, padding)
  plain, tiled = Kernel(ast, PythonRenderer("CUDA")), Kernel(ast, PythonRenderer("CUDA"))
  assert shared_conv_tiles(tiled, (tile,)), f"{tile} does not fit {plain.full_shape}"
  assert tiled.first_upcast - tiled.first_loop_reduce == 1, "the window is unrolled: one loop (channel steps) left"
  assert len(_halo_windows(tiled)) == 1, "the input is a halo tile, the weights an ordinary one"
  size = int(np.prod(plain.output_shape))
  ours = _run(tiled, inputs, size)
  np.testing.assert_allclose(ours, _run(plain, inputs, size), rtol=1e-5, atol=1e-4)
  x, w = (torch.tensor(buffer.numpy()) for buffer in inputs[:2])
  if x.numel() != int(np.prod(x_shape)): x, w = w, x
  pads = (padding, padding) if isinstance(padding, int) else padding
  expected = torch.nn.functional.conv2d(x.reshape(x_shape), w.reshape(w_shape), padding=pads)
  np.testing.assert_allclose(ours, expected.numpy().reshape(-1), rtol=1e-4, atol=1e-4)


def _benchmark_conv_kernel(tile: ConvTile) -> Kernel:
  """conv2d 64x64x56x56, 64 3x3 filters, pad 1 (issue 12's row) on CUDA with `tile`."""
  from ourgrad.renderer.cuda import CUDARenderer
  x, w = Tensor.empty(64, 64, 56, 56, device="PYTHON"), Tensor.empty(64, 64, 3, 3, device="PYTHON")
  item = next(item for item in create_schedule([x.conv2d(w, padding=1).lazydata]) if item.ast.op is Ops.STORE)
  kernel = Kernel(item.ast, CUDARenderer())
  assert shared_conv_tiles(kernel, (tile,))
  return kernel


@pytest.mark.parametrize("span_padding, span", [("banks", 180), ("rounds", 192)])
def test_halo_tile_layout_of_the_benchmark_conv(span_padding: str, span: int) -> None:
  """The 8x8 tile in steps of 2 channels: the input's window is the tap columns, the block's 64 pixels (4 per
  thread x 16 threads, one image row apart is 56) and the tap rows, 64 + 2 + 2 * 56 = 178 elements padded to 180
  (45 float4s: neighbouring rows an odd number of float4s apart; the fill wraps its last round) or, padded to whole
  rounds, to 192 (4 rows of 2 channels x 2 images fill in whole rounds of 128 threads); the weights stay an
  ordinary tile."""
  import ourgrad.codegen.halo_tiles as halo_tiles
  halo_tiles.SPAN_PADDING = span_padding
  try:
    kernel = _benchmark_conv_kernel(halo(4, 16, 4, 8, 2, repeats=2, padding=4))
    (window,) = _halo_windows(kernel)
    sizes = sorted((kernel.full_shape[axis], stride) for axis, stride in zip(window.window, window.strides))
    assert sizes == [(3, 1), (3, 56), (4, 1), (16, 4)]
    assert window.span == span and [kernel.full_shape[axis] for axis in window.outer] == [2, 2]
    assert window.elements == 4 * span
    # weights: 2 channels x 9 taps rows of 64 output channels, each row padded by 4 (one stage of each tile)
    assert kernel.local_memory_bytes() == (4 * span + 18 * (64 + 4)) * 4
  finally:
    halo_tiles.SPAN_PADDING = "banks"


def test_matmul_tiles_have_no_halo() -> None:
  """A matmul's staged tiles do not overlap: ordinary layouts."""
  a, b = Tensor.empty(64, 64, device="PYTHON"), Tensor.empty(64, 64, device="PYTHON")
  item = next(item for item in create_schedule([(a @ b).lazydata]) if item.ast.op is Ops.STORE)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  for opt in (Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.LOCAL, 0, 8), Opt(OptOps.LOCAL, 1, 8),
              Opt(OptOps.SHARED, 0, 0), Opt(OptOps.UNROLL, 0, 8)):
    kernel.apply_opt(opt)
  assert len(kernel.staged_loads()) == 2 and not _halo_windows(kernel)


@pytest.mark.parametrize("step, padding", [(2, 0), (2, 4), (4, 4)])
def test_halo_benchmark_conv_compiles_with_nvrtc(step: int, padding: int) -> None:
  compiler = nvrtc_compiler()
  if compiler is None: pytest.skip("no NVRTC here")
  from ourgrad.renderer.cuda import CUDARenderer
  kernel = _benchmark_conv_kernel(halo(4, 16, 4, 8, step, repeats=2, padding=padding))
  compiler.compile(CUDARenderer().render(function_name(kernel), linearize(kernel)))


@pytest.mark.parametrize("step, padding", [(2, 4), (4, 4)])
def test_halo_conv_on_cuda_matches_the_plain_kernel(step: int, padding: int) -> None:
  """On a real GPU: the 56x56 conv (8 images) with the halo tile against the unoptimized kernel, random inputs."""
  skip_unless_device("CUDA")
  from ourgrad.codegen.opt.search import verify_kernel
  from ourgrad.device import Device
  x, w = Tensor.empty(8, 64, 56, 56, device="CUDA"), Tensor.empty(64, 64, 3, 3, device="CUDA")
  item = next(item for item in create_schedule([x.conv2d(w, padding=1).lazydata]) if item.ast.op is Ops.STORE)
  plain, tiled = Kernel(item.ast, Device["CUDA"].renderer), Kernel(item.ast, Device["CUDA"].renderer)
  assert shared_conv_tiles(tiled, (halo(4, 16, 4, 8, step, repeats=2, padding=padding),))
  assert verify_kernel(tiled, plain, "CUDA")


def test_halo_index_helpers() -> None:
  """split_constant takes the constant term off an address; without_window drops the window variables' terms of an
  index (the range's first element), and refuses an index where a window variable is not a plain term."""
  from ourgrad.codegen.halo_tiles import split_constant, without_window
  from ourgrad.shape.symbolic import NumNode, Variable
  lane, thread, tap = Variable("lane", 0, 3), Variable("thread", 0, 15), Variable("tap", 0, 2)
  rest, constant = split_constant(thread * 4 + 7)
  assert constant == 7 and rest.render() == (thread * 4).render()
  assert split_constant(NumNode(5))[1] == 5 and split_constant(thread * 4)[1] == 0
  index = thread * 4 + lane + tap * 56 - 57
  assert without_window(index, [lane, tap]).render() == (thread * 4 - 57).render()
  with pytest.raises(ValueError):
    without_window((lane + tap) // 2 + thread, [lane, tap])


def _input_gradient_item(x_shape: tuple[int, ...], w_shape: tuple[int, ...], padding: object) -> tuple:
  """The input gradient's kernel AST of a conv on PYTHON (a conv of the output gradient, unpadded in memory and read
  through masked loads, with the flipped filters), its inputs realized, its output size, and the torch inputs."""
  x_data = rng.standard_normal(x_shape).astype(np.float32)
  w_data = rng.standard_normal(w_shape).astype(np.float32)
  x = Tensor(x_data, device="PYTHON", requires_grad=True)
  w = Tensor(w_data, device="PYTHON")
  out = x.conv2d(w, padding=padding)
  g_data = rng.standard_normal(out.shape).astype(np.float32)
  (out * Tensor(g_data, device="PYTHON")).sum().backward()
  schedule = create_schedule([x.grad.lazydata])
  run_schedule(schedule[:-1])
  item = schedule[-1]
  return item.ast, list(item.inputs), item.outputs[0].size, (x_data, w_data, g_data)


# (input shape, weight shape, padding, tile) of input gradients: MNIST's conv2 (8 of its 256 images; 4x4 pixels of 8
# images x 16 channels a block, the gradient's 4 rows and columns of padding masked), a 3x3 conv with padding 1, and
# a 2-images-per-thread tile with padded columns only
HALO_INPUT_GRADIENTS = [
  ((8, 16, 12, 12), (32, 16, 5, 5), 0, halo(4, 32, 4, 4, 2, padding=4)),
  ((4, 8, 6, 6), (16, 8, 3, 3), 1, halo(4, 8, 4, 2, 2)),
  ((4, 8, 6, 10), (16, 8, 3, 3), (1, 0), ConvTile(4, 4, 4, 2, 2, pixel_repeat=2, window_unrolled=True, padding=4)),
  # 3 threads x 4 outputs along MNIST's 12-pixel rows (any_thread_split): 2 images x 4 rows x 12 pixels a block
  ((4, 16, 12, 12), (32, 16, 5, 5), 0, ConvTile(4, 24, 4, 4, 2, window_unrolled=True, padding=4,
                                                any_thread_split=True)),
]


@pytest.mark.parametrize("x_shape, w_shape, padding, tile", HALO_INPUT_GRADIENTS)
def test_halo_input_gradient_matches_the_plain_kernel_and_torch(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                                                                padding: object, tile: ConvTile) -> None:
  ast, inputs, size, (x_data, w_data, g_data) = _input_gradient_item(x_shape, w_shape, padding)
  plain, tiled = Kernel(ast, PythonRenderer("CUDA")), Kernel(ast, PythonRenderer("CUDA"))
  assert shared_conv_tiles(tiled, (tile,)), f"{tile} does not fit {plain.full_shape}"
  assert len(_halo_windows(tiled)) == 1, "the output gradient is a halo tile"
  if tile.any_thread_split: assert Opt(OptOps.LOCAL, 3, 3) in tiled.applied_opts, tiled.applied_opts
  ours = _run(tiled, inputs, size)
  np.testing.assert_allclose(ours, _run(plain, inputs, size), rtol=1e-5, atol=1e-4)
  # the kernel writes the gradient of the padded input (a later kernel crops it): torch's gradient of that
  rows, columns = (padding, padding) if isinstance(padding, int) else padding
  padded = torch.nn.functional.pad(torch.tensor(x_data, dtype=torch.float64), (columns, columns, rows, rows))
  padded.requires_grad_(True)
  tout = torch.nn.functional.conv2d(padded, torch.tensor(w_data, dtype=torch.float64))
  (tout * torch.tensor(g_data, dtype=torch.float64)).sum().backward()
  np.testing.assert_allclose(ours, padded.grad.numpy().reshape(-1), rtol=1e-4, atol=1e-3)


def _mnist_conv2_kernels(renderer: object, device: str = "PYTHON") -> dict[str, Kernel]:
  """MNIST's conv2 (batch 256) forward and input gradient kernels, plain, by name (scheduled only)."""
  x = Tensor.empty(256, 16, 12, 12, device=device, requires_grad=True)
  w = Tensor.empty(32, 16, 5, 5, device=device, requires_grad=True)
  out = x.conv2d(w)
  (out * Tensor.empty(*out.shape, device=device)).sum().backward()
  kernels = {}
  for item in create_schedule([out.lazydata, x.grad.lazydata]):
    if item.ast.op is not Ops.STORE: continue
    kernel = Kernel(item.ast, renderer)
    if kernel.name in ("r_256_32_8_8_16_5_5", "r_256_16_12_12_32_5_5"): kernels[kernel.name] = kernel
  assert len(kernels) == 2, list(kernels)
  return kernels


def test_mnist_conv2_takes_halo_tiles_and_compiles_with_nvrtc() -> None:
  """The hand-coded choice of MNIST's conv2 forward and input gradient on CUDA is a halo tile with the window
  unrolled (one loop left: the channel steps); both compile with NVRTC where it is here."""
  from ourgrad.renderer.cuda import CUDARenderer
  compiler = nvrtc_compiler()
  for name, kernel in _mnist_conv2_kernels(CUDARenderer()).items():
    kernel.hand_coded_optimizations()
    assert kernel.first_upcast - kernel.first_loop_reduce == 1 and len(_halo_windows(kernel)) == 1, kernel.name
    (window,) = _halo_windows(kernel)
    if name == "r_256_16_12_12_32_5_5":   # 2 images' ranges of 2 GROUP threads x 2 channels x 64 gradient
      assert window.span == 268 and window.elements == 2 * 268   # values (+ 8), 67 float4s apart
      assert kernel.group_threads() == 2
    else:   # 4 images' ranges of 2 x 144 input values, 73 float4s apart
      assert window.span == 292 and window.elements == 4 * 292
    if compiler is not None: compiler.compile(CUDARenderer().render(function_name(kernel), linearize(kernel)))


def test_mnist_conv2_on_cuda_matches_the_plain_kernels() -> None:
  """On a real GPU: MNIST's conv2 forward and input gradient (batch 256), hand-coded, against the plain kernels."""
  skip_unless_device("CUDA")
  from ourgrad.codegen.opt.search import verify_kernel
  from ourgrad.device import Device
  for name, plain in _mnist_conv2_kernels(Device["CUDA"].renderer, "CUDA").items():
    tiled = plain.copy()
    tiled.hand_coded_optimizations()
    assert verify_kernel(tiled, plain, "CUDA"), name


def test_fills_wrap_their_last_round_so_the_tiles_are_double_buffered() -> None:
  """MNIST's conv2 forward with 64 pixels x 32 channels a block in steps of 2 channels: its filter tile (1600
  elements) does not fill in whole rounds of 128 threads. With WRAP_LAST_ROUND the last round's threads past the end
  fill their unit of the round before again, no `if`, and the tiles are double buffered (a BARRIER before the loop
  and one per step); without it, the last round is guarded and the tiles single staged (two BARRIERs per step). Both
  give the plain kernel's results on the emulated GPU (which refuses two threads storing one element)."""
  import ourgrad.codegen.halo_tiles as halo_tiles
  from ourgrad.codegen.uops import UOps
  ast, inputs = _conv_ast((3, 16, 12, 12), (32, 16, 5, 5), 0)
  plain = Kernel(ast, PythonRenderer("CUDA"))
  size = int(np.prod(plain.output_shape))
  expected = _run(plain, inputs, size)
  for wrap, barriers, ifs in ((True, 2, 0), (False, 2, 2)):   # unwrapped: the filter's and the halo's last rounds
    halo_tiles.WRAP_LAST_ROUND = wrap
    try:
      tiled = Kernel(ast, PythonRenderer("CUDA"))
      assert shared_conv_tiles(tiled, (halo(4, 16, 4, 8, 2, padding=4),))
      uops = linearize(tiled)
      loop = next(number for number, uop in enumerate(uops) if uop.op is UOps.RANGE)
      assert sum(uop.op is UOps.BARRIER for uop in uops[:loop]) == (1 if wrap else 0)
      assert sum(uop.op is UOps.BARRIER for uop in uops[loop:]) == (1 if wrap else barriers)
      assert sum(uop.op is UOps.IF for uop in uops) == ifs
      np.testing.assert_allclose(_run(tiled, inputs, size), expected, rtol=1e-5, atol=1e-4)
    finally:
      halo_tiles.WRAP_LAST_ROUND = True


def test_last_round_unit() -> None:
  """A whole round keeps the unit; a partial last round wraps a thread past the end back to its unit of the round
  before (more than one round), else guards it."""
  from ourgrad.codegen.halo_tiles import last_round_unit
  from ourgrad.shape.symbolic import Variable
  thread = Variable("thread", 0, 127)
  unit, guard = last_round_unit(thread + 0, 1600, 0, 128, True)
  assert guard is None and unit.render() == thread.render()
  unit, guard = last_round_unit(thread + 1536, 1600, 1536, 128, True)
  assert guard is None
  assert [unit.evaluate({"thread": t}) for t in (0, 63, 64, 127)] == [1536, 1599, 1472, 1535]
  unit, guard = last_round_unit(thread + 1536, 1600, 1536, 128, False)
  assert guard is not None and unit.render() == (thread + 1536).render()
  unit, guard = last_round_unit(thread + 0, 100, 0, 128, True)   # one partial round: guarded
  assert guard is not None


@pytest.mark.parametrize("stages", [2, 3])
def test_halo_tiles_filled_by_asynchronous_copies(stages: int) -> None:
  """ConvTile(async_stages=n): the halo tile (and the filter tile) filled by COPYs in n stages (cp.async on CUDA,
  zero-filled outside the buffer), no register prefetch: MNIST conv2's forward (3 images) and input gradient (8
  images) give the plain kernels' results on the emulated GPU and compile with NVRTC."""
  from ourgrad.codegen.uops import UOps
  from ourgrad.renderer.cuda import CUDARenderer
  compiler = nvrtc_compiler()
  forward, inputs = _conv_ast((3, 16, 12, 12), (32, 16, 5, 5), 0)
  gradient, gradient_inputs, gradient_size, _ = _input_gradient_item((8, 16, 12, 12), (32, 16, 5, 5), 0)
  cases = [(forward, inputs, 3 * 32 * 64, ConvTile(4, 16, 4, 8, 2, window_unrolled=True, padding=4,
                                                   async_stages=stages)),
           (gradient, gradient_inputs, gradient_size, ConvTile(4, 24, 4, 4, 2, window_unrolled=True, padding=4,
                                                               any_thread_split=True, async_stages=stages))]
  for ast, buffers, size, tile in cases:
    plain, tiled = Kernel(ast, PythonRenderer("CUDA")), Kernel(ast, PythonRenderer("CUDA"))
    assert shared_conv_tiles(tiled, (tile,)) and len(_halo_windows(tiled)) == 1
    uops = linearize(tiled)
    assert sum(uop.op is UOps.ASYNC_WAIT for uop in uops) == stages - 1
    assert any(uop.op is UOps.COPY for uop in uops) and not any(uop.op is UOps.LOAD and uop.srcs[0].op is
                                                                 UOps.DEFINE_GLOBAL for uop in uops)
    np.testing.assert_allclose(_run(tiled, buffers, size), _run(plain, buffers, size), rtol=1e-5, atol=1e-4)
    if compiler is not None:
      cuda = Kernel(ast, CUDARenderer())
      assert shared_conv_tiles(cuda, (tile,))
      compiler.compile(CUDARenderer().render(function_name(cuda), linearize(cuda)))


@pytest.mark.parametrize("groups, stages", [(2, 0), (4, 3)])
def test_halo_tiles_with_the_input_channels_grouped(groups: int, stages: int) -> None:
  """ConvTile(reduce_groups=n): n GROUP threads each take a share of the input-channel steps (each its own part of
  the halo tile), partial sums combined at the end: MNIST conv2's input gradient (8 images) against the plain
  kernel on the emulated GPU (sums in another order: float32 tolerance)."""
  ast, inputs, size, _ = _input_gradient_item((8, 16, 12, 12), (32, 16, 5, 5), 0)
  plain, tiled = Kernel(ast, PythonRenderer("CUDA")), Kernel(ast, PythonRenderer("CUDA"))
  tile = ConvTile(4, 24, 4, 4, 2, window_unrolled=True, padding=4, any_thread_split=True, async_stages=stages,
                  reduce_groups=groups)
  assert shared_conv_tiles(tiled, (tile,)) and tiled.group_threads() == groups and len(_halo_windows(tiled)) == 1
  np.testing.assert_allclose(_run(tiled, inputs, size), _run(plain, inputs, size), rtol=1e-4, atol=1e-3)
