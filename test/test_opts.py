"""Every kernel optimization must leave results unchanged: compare optimized kernels with the plain loop nest
(NOOPT) on random inputs, for the hand-coded heuristic and for random sequences of legal Opts."""
import random

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel, KernelOptError, Opt, OptOps
from ourgrad.device import Buffer, Device
from ourgrad.engine.realize import compile_kernel
from ourgrad.engine.schedule import create_schedule


def _last_item(tensor: Tensor):
  """The ScheduleItem computing `tensor` (its inputs are realized first)."""
  schedule = create_schedule([tensor.lazydata])
  from ourgrad.engine.realize import run_schedule
  run_schedule(schedule[:-1])
  return schedule[-1]


def _run(item, opts: list[Opt] | None) -> tuple[np.ndarray, list[Opt]]:
  device = item.outputs[0].device
  kernel = Kernel(item.ast, Device[device].renderer)
  if opts is None: kernel.hand_coded_optimizations()
  else:
    for opt in opts:
      try: kernel.apply_opt(opt)
      except KernelOptError: pass
  runner = compile_kernel(kernel, device)
  output = Buffer(device, item.outputs[0].size, item.outputs[0].dtype).allocate()
  runner((output,) + item.inputs)
  return output.numpy(), kernel.applied_opts


def _plain(item) -> np.ndarray:
  return _run(item, [])[0]


rng = np.random.default_rng(0)


def _graphs() -> dict[str, Tensor]:
  a = Tensor(rng.standard_normal((16, 24)).astype(np.float32))
  b = Tensor(rng.standard_normal((24, 8)).astype(np.float32))
  bias = Tensor(rng.standard_normal((8,)).astype(np.float32))
  image = Tensor(rng.standard_normal((2, 3, 8, 8)).astype(np.float32))
  ints = Tensor(rng.integers(-50, 50, (12, 16)).astype(np.int32))
  return {
    "matmul_bias_relu": (a @ b + bias).relu(),
    "sum_rows": (a * 2).sum(axis=1),
    "sum_cols_then_exp": a.sum(axis=0).exp(),
    "max_all": a.max(),
    "elementwise_broadcast": (a.reshape(16, 24, 1) + a.reshape(16, 1, 24)).sqrt().reshape(16, 576),
    "padded_window_sum": image.pad(((0, 0), (0, 0), (1, 1), (1, 1))).sum(axis=(2, 3)),
    "int_mod_sum": (ints % 7).sum(axis=0),
    "transposed_reduce": a.T.sum(axis=1) + 1,
  }


@pytest.mark.parametrize("name", list(_graphs().keys()))
def test_hand_coded_matches_plain(name):
  item = _last_item(_graphs()[name])
  optimized, _ = _run(item, None)
  np.testing.assert_allclose(optimized, _plain(item), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", ["matmul_bias_relu", "sum_rows", "elementwise_broadcast", "padded_window_sum",
                                  "int_mod_sum"])
def test_random_opts_match_plain(name, seed):
  item = _last_item(_graphs()[name])
  plain = _plain(item)
  chooser = random.Random(seed)
  # LOCAL and GROUP are refused on devices without thread blocks and local memory (CLANG, LLVM)
  kinds = [OptOps.UPCAST, OptOps.UNROLL, OptOps.LOCAL, OptOps.GROUP, OptOps.GROUPTOP, OptOps.PADTO]
  opts = [Opt(chooser.choice(kinds), chooser.randint(0, 2), chooser.choice([0, 2, 3, 4, 8]))
          for _ in range(4)]
  optimized, applied = _run(item, opts)
  print(f"seed {seed}: applied {applied}")
  np.testing.assert_allclose(optimized, plain, rtol=1e-5, atol=1e-5)


def test_illegal_opts_are_refused():
  item = _last_item(_graphs()["sum_rows"])
  kernel = Kernel(item.ast, Device[item.outputs[0].device].renderer)
  with pytest.raises(KernelOptError): kernel.apply_opt(Opt(OptOps.UPCAST, 0, 5))      # 5 does not divide 16
  with pytest.raises(KernelOptError): kernel.apply_opt(Opt(OptOps.UNROLL, 3, 2))      # no such reduce axis
  with pytest.raises(KernelOptError): kernel.apply_opt(Opt(OptOps.UPCAST, 1, 2))      # axis 1 is the reduce
  assert kernel.applied_opts == []


def test_padto_lets_other_opts_fit():
  data = rng.standard_normal((10, 30)).astype(np.float32)
  item = _last_item((Tensor(data).exp() * 2).sum(axis=1) + 1)  # 10 outputs: no UPCAST 4 fits before padding
  device = item.outputs[0].device
  kernel = Kernel(item.ast, Device[device].renderer)
  with pytest.raises(KernelOptError): kernel.apply_opt(Opt(OptOps.UPCAST, 0, 4))
  with pytest.raises(KernelOptError, match="output axis"): kernel.apply_opt(Opt(OptOps.PADTO, 1, 32))  # not the sum
  with pytest.raises(KernelOptError, match="over half"): kernel.apply_opt(Opt(OptOps.PADTO, 0, 32))
  optimized, applied = _run(item, [Opt(OptOps.PADTO, 0, 4), Opt(OptOps.UPCAST, 0, 4)])
  assert applied == [Opt(OptOps.PADTO, 0, 4), Opt(OptOps.UPCAST, 0, 4)]
  np.testing.assert_allclose(optimized, np.exp(data.astype(np.float64) * 1).sum(axis=1) * 2 + 1, rtol=1e-5)
  np.testing.assert_allclose(optimized, _plain(item), rtol=1e-6)


def test_unroll_of_the_whole_first_reduce_axis_keeps_the_locals() -> None:
  """An UNROLL that takes all of the first reduce loop (no GROUP before it) leaves a size-1 reduce axis that the
  output has too: it is dropped as a reduce axis, so the LOCAL axes stay LOCAL (the block keeps its threads) and the
  results stay the plain kernel's."""
  from ourgrad.runtime.ops_python import PythonRenderer
  a = Tensor(np.random.default_rng(3).standard_normal((64, 4)).astype(np.float32), device="PYTHON")
  b = Tensor(np.random.default_rng(4).standard_normal((4, 32)).astype(np.float32), device="PYTHON")
  item = next(item for item in create_schedule([(a @ b).lazydata]) if item.ast.op.name == "STORE")
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  for opt in (Opt(OptOps.LOCAL, 0, 4), Opt(OptOps.LOCAL, 1, 8), Opt(OptOps.UNROLL, 0, 4)): kernel.apply_opt(opt)
  assert kernel.local_dims == 2 and kernel.block_threads() == 32
  assert kernel.first_loop_reduce == kernel.first_upcast   # no reduce loop left
  out = Buffer("PYTHON", 64 * 32, a.dtype).allocate()
  for buffer in item.inputs: assert buffer.is_allocated
  compile_kernel(kernel, "PYTHON")((out, *item.inputs))
  np.testing.assert_allclose(out.numpy().reshape(64, 32), a.numpy() @ b.numpy(), rtol=1e-5, atol=1e-5)
