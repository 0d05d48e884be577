"""GROUP's local-memory legality counts what the linearizer allocates: the partials left after the warp shuffle
(Kernel.group_partial_bytes), none where the shuffle combines every GROUP thread of an output. Checked against the
DEFINE_LOCAL the linearizer emits, on the emulated GPU (NOOPT's results) and on MNIST's conv2 weight gradient, whose
640-thread tile the old count (every thread's partials) refused.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel, KernelOptError, Opt, OptOps
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.opt.conv_tiles import WeightGradientTile, weight_gradient_tiles
from ourgrad.codegen.uops import UOps
from ourgrad.device import Buffer
from ourgrad.engine.realize import compile_kernel, function_name, run_schedule
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import nvrtc_compiler  # noqa: E402


@pytest.fixture(autouse=True)
def _two_kernel_splits(monkeypatch: pytest.MonkeyPatch) -> None:
  """These tests look at a split weight gradient's partial-sums kernel alone: two kernels even where the device has
  atomics (EMULATE=CUDA; test_last_block.py covers the one-kernel form)."""
  monkeypatch.setenv("SPLIT_LAST_BLOCK", "0")


rng = np.random.default_rng(11)


def _item(tensor: Tensor) -> ScheduleItem:
  schedule = create_schedule([tensor.lazydata])
  run_schedule(schedule[:-1])
  return schedule[-1]


def _rows() -> Tensor: return Tensor(rng.standard_normal((12, 256)).astype(np.float32), device="PYTHON")


def _allocated_partial_bytes(kernel: Kernel) -> int:
  """Bytes of the DEFINE_LOCALs the linearizer emits for the GROUP partials (no SHARED tiles in these kernels)."""
  return sum(uop.arg[1] * uop.dtype.itemsize for uop in linearize(kernel) if uop.op is UOps.DEFINE_LOCAL)


def _run(kernel: Kernel, item: ScheduleItem) -> np.ndarray:
  output = Buffer("PYTHON", item.outputs[0].size, item.outputs[0].dtype).allocate()
  compile_kernel(kernel, "PYTHON")((output,) + item.inputs)
  return output.numpy()


CASES = {
  "row sum, group 16": ("row", [Opt(OptOps.GROUP, 0, 16)]),
  "row sum, group 64": ("row", [Opt(OptOps.GROUP, 0, 64)]),
  "row sum, group whole row": ("row", [Opt(OptOps.GROUP, 0, 0)]),
  "row sum, grouptop 16": ("row", [Opt(OptOps.GROUPTOP, 0, 16)]),
  "row sum, upcast 4 local 3, group 8": ("row", [Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.LOCAL, 0, 3),
                                                 Opt(OptOps.GROUP, 0, 8)]),
  "column sum, local 16, grouptop 4": ("column", [Opt(OptOps.LOCAL, 0, 16), Opt(OptOps.GROUPTOP, 0, 4)]),
  "column sum, local 4, grouptop 3": ("column", [Opt(OptOps.LOCAL, 0, 4), Opt(OptOps.GROUPTOP, 0, 3)]),
}


@pytest.mark.parametrize("emulate", ["CUDA", ""], ids=["emulated CUDA", "PYTHON's own limits"])
@pytest.mark.parametrize("case", list(CASES))
def test_group_partial_bytes_are_what_the_linearizer_allocates(case: str, emulate: str) -> None:
  which, opts = CASES[case]
  rows = _rows()
  item = _item(rows.sum(axis=1) if which == "row" else rows.sum(axis=0))
  kernel = Kernel(item.ast, PythonRenderer(emulate))
  for opt in opts:
    try: kernel.apply_opt(opt)
    except KernelOptError: pytest.skip(f"{opt} does not apply with these limits")
  assert kernel.group_partial_bytes() == _allocated_partial_bytes(kernel)
  np.testing.assert_allclose(_run(kernel, item), _run(Kernel(item.ast, PythonRenderer(emulate)), item),
                             rtol=1e-5, atol=1e-5)


def test_a_group_that_warp_shuffles_combine_needs_no_local_memory() -> None:
  """With 4 bytes of local memory: a group of one warp (32 threads per output) is legal and gives NOOPT's results;
  two warps leave two partials per output in local memory, and are refused."""
  item = _item(_rows().sum(axis=1))
  renderer = PythonRenderer("CUDA")
  renderer.local_memory_bytes = 4
  kernel = Kernel(item.ast, renderer)
  kernel.apply_opt(Opt(OptOps.GROUP, 0, 32))
  assert kernel.group_partial_bytes() == 0 and kernel.block_threads() * 4 > renderer.local_memory_bytes
  np.testing.assert_allclose(_run(kernel, item), _run(Kernel(item.ast, PythonRenderer("CUDA")), item), rtol=1e-5)
  with pytest.raises(KernelOptError, match="local memory"): Kernel(item.ast, renderer).apply_opt(
    Opt(OptOps.GROUP, 0, 64))


def test_mnist_conv2_weight_gradient_tile_of_640_threads_is_accepted() -> None:
  """conv2's partial sums (batch 256) with 5 filter rows x 4 cin x 4 cout x 8 image-row GROUP threads: 640 threads
  x 20 outputs of partials (51200 bytes) were counted against the 48 KiB limit; the 8 GROUP threads of an output
  meet by warp shuffles, so the kernel holds no local memory, and it compiles with NVRTC (where installed)."""
  from test_weight_gradient_tiles import _mnist_partials_asts
  renderer = CUDARenderer("sm_90")
  kernel = Kernel(_mnist_partials_asts()[1], renderer)
  tile = WeightGradientTile(cin_threads=4, cout_threads=4, row_group=8, column_unroll=0, filter_rows_local=True)
  assert weight_gradient_tiles(kernel, (tile,))
  assert kernel.block_threads() == 640 and kernel.group_threads() == 8
  assert kernel.block_threads() * kernel.output_lanes() * 4 > renderer.local_memory_bytes
  uops = linearize(kernel)
  assert kernel.group_partial_bytes() == 0 and not any(uop.op is UOps.DEFINE_LOCAL for uop in uops)
  compiler = nvrtc_compiler()
  if compiler is not None: compiler.compile(renderer.render(function_name(kernel), uops))


def test_weight_gradient_tile_refused_before_gives_the_plain_results(monkeypatch: pytest.MonkeyPatch) -> None:
  """A small split weight gradient on the emulated GPU with 1 KiB of local memory: the conv2 tile with 8 GROUP lanes
  over the image rows needs none (its partials meet by shuffles), where every thread's partials would not fit; it
  gives the plain kernel's partial sums."""
  from test_weight_gradient_tiles import _small_split, _weight_gradient
  _small_split(monkeypatch)
  x = Tensor(rng.standard_normal((8, 4, 12, 12)).astype(np.float32), device="PYTHON")
  w = Tensor(rng.standard_normal((8, 4, 5, 5)).astype(np.float32), device="PYTHON", requires_grad=True)
  grad = _weight_gradient(x, w, Tensor(rng.standard_normal((8, 8, 8, 8)).astype(np.float32), device="PYTHON"))
  schedule = create_schedule([grad.lazydata])
  partials = next(item for item in schedule if weight_gradient_tiles(Kernel(item.ast, PythonRenderer("CUDA"))))
  run_schedule(schedule[:schedule.index(partials)])
  renderer = PythonRenderer("CUDA")
  renderer.local_memory_bytes = 1024
  kernel = Kernel(partials.ast, renderer)
  tile = WeightGradientTile(cin_threads=4, cout_threads=4, row_group=8, column_unroll=0, filter_rows_local=True)
  assert weight_gradient_tiles(kernel, (tile,)) and kernel.group_threads() == 8
  assert kernel.block_threads() * kernel.output_lanes() * 4 > renderer.local_memory_bytes
  np.testing.assert_allclose(_run(kernel, partials), _run(Kernel(partials.ast, PythonRenderer("CUDA")), partials),
                             rtol=1e-4, atol=1e-4)
