"""codegen/lowering.py: a Kernel lowered to source (a wgmma plan rendered whole, else its UOps linearized and
rendered), against the renderer called directly, and its three callers (realize, BEAM, CHECK_CUDA_RENDER) agreeing
on it."""
from __future__ import annotations

import numpy as np

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.lowering import lower_kernel
from ourgrad.codegen.opt import search
from ourgrad.codegen.packed import PackedKernel
from ourgrad.codegen.uops import UOps, launch_dims
from ourgrad.engine.realize import compile_kernel
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.ops import Ops
from ourgrad.runtime.ops_python import PythonCompiler, PythonRenderer


def _last_item(output: Tensor) -> ScheduleItem:
  return create_schedule([output.lazydata])[-1]


def test_a_loop_nest_is_linearized_and_rendered() -> None:
  """A matmul with GPU opts on the emulated CUDA device: the source is the renderer's text of the linearized UOps,
  the launch sizes are those of its SPECIAL uops, and compile_kernel launches with them."""
  a, b = Tensor.empty(32, 48, device="PYTHON"), Tensor.empty(48, 16, device="PYTHON")
  item = _last_item(a @ b)
  renderer = PythonRenderer("CUDA")
  kernel = Kernel(item.ast, renderer)
  for opt in (Opt(OptOps.LOCAL, 0, 8), Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.GROUP, 0, 4)): kernel.apply_opt(opt)
  lowered = lower_kernel(kernel, renderer, "matmul")
  uops = linearize(kernel)
  assert lowered.linearized and lowered.wgmma is None
  assert lowered.source == renderer.render("matmul", uops)
  assert [uop.op for uop in lowered.uops] == [uop.op for uop in uops]
  assert (lowered.global_size, lowered.local_size) == launch_dims(uops)
  assert lowered.local_size != (1, 1, 1), "the LOCAL and GROUP opts make threads"
  runner = compile_kernel(kernel, "PYTHON")
  assert (runner.global_size, runner.local_size) == (lowered.global_size, lowered.local_size)
  assert runner.source == lower_kernel(kernel, renderer, runner.name).source


def test_a_wgmma_plan_is_rendered_whole() -> None:
  """With OptOps.WGMMA the renderer renders the plan (no UOps); compile_kernel costs it from the plan."""
  a, b = (Tensor.empty(*shape, device="PYTHON", dtype="float16") for shape in ((256, 192), (192, 384)))
  item = _last_item(a @ b)
  renderer = PythonRenderer("CUDA_SM90")
  kernel = Kernel(item.ast, renderer)
  kernel.apply_opt(Opt(OptOps.WGMMA, 3, 128))
  plan, arguments = kernel.wgmma
  lowered = lower_kernel(kernel, renderer, "wgmma_matmul")
  assert not lowered.linearized and lowered.wgmma is plan and lowered.uops == []
  assert lowered.source == renderer.render_wgmma("wgmma_matmul", plan, arguments)
  assert (lowered.global_size, lowered.local_size) == (plan.global_size, plan.local_size)
  runner = compile_kernel(kernel, "PYTHON")
  assert runner.op_count == 2 * 256 * 384 * 192
  assert (runner.global_size, runner.local_size) == (plan.global_size, plan.local_size)


def test_a_packed_kernel_uses_its_own_linearize() -> None:
  """A PACK of small kernels of different shapes is lowered by PackedKernel.linearize (one IF block per segment on
  a GPU-like device)."""
  a, b = Tensor.empty(16, 8, device="PYTHON"), Tensor.empty(5, 3, device="PYTHON")
  items = create_schedule([a.sum(1).lazydata, b.max(1).lazydata])
  pack = next(item for item in items if item.ast.op is Ops.PACK)
  renderer = PythonRenderer()
  packed = PackedKernel(pack.ast, renderer)
  lowered = lower_kernel(packed, renderer, "pack")
  assert lowered.source == renderer.render("pack", PackedKernel(pack.ast, renderer).linearize())
  assert sum(uop.op is UOps.IF for uop in lowered.uops) == 2


def test_a_pack_of_many_segments_halves_them_under_ifs() -> None:
  """16 independent casts in one pack: a GPU thread reaches its segment through two levels of halving IFs (16 -> 8
  -> 4 segments tested in a row), not 16 bounds tests; every segment's values are numpy's."""
  from ourgrad.codegen.packed import PACKED_FLAT_SEGMENTS
  from ourgrad.engine.realize import run_schedule
  data = np.random.default_rng(7)
  values = [data.standard_normal(8 * (number + 1)).astype(np.float32) for number in range(16)]
  results = [Tensor(value, device="PYTHON") * 3 for value in values]
  items = create_schedule([result.lazydata for result in results])
  [pack] = [item for item in items if item.ast.op is Ops.PACK]
  packed = PackedKernel(pack.ast, PythonRenderer("CUDA"))
  uops = packed.linearize()
  assert len(packed.sizes) == 16 and PACKED_FLAT_SEGMENTS == 4
  depth, deepest = 0, 0
  for uop in uops:
    depth += (uop.op is UOps.IF) - (uop.op is UOps.ENDIF)
    deepest = max(deepest, depth)
  assert sum(uop.op is UOps.IF for uop in uops) == 16 + 2 * 3 and deepest == 3
  run_schedule(items)
  for result, value in zip(results, values): np.testing.assert_allclose(result.numpy(), value * 3)


def test_beam_compiles_what_lowering_renders() -> None:
  """A BEAM candidate's binary is the compiled source of lower_kernel for its kernel with its opts."""
  a, b = Tensor.empty(16, 16, device="PYTHON"), Tensor.empty(16, 16, device="PYTHON")
  item = _last_item(a @ b)
  renderer = PythonRenderer()
  base = Kernel(item.ast, renderer)
  opts = (Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.LOCAL, 1, 4))
  job = search._CompileJob(base, PythonCompiler())
  candidate = search.compile_candidate(job, opts, timeout=0)
  assert candidate.error == "", candidate.error
  optimized = search.apply_opts(base, opts)
  lowered = lower_kernel(optimized, renderer, optimized.name)
  assert candidate.binary == PythonCompiler().compile(lowered.source)
  assert (candidate.global_size, candidate.local_size) == (lowered.global_size, lowered.local_size)
  assert np.prod(lowered.local_size) == 4
