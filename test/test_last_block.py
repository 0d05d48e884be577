"""One-kernel split reduces (codegen/last_block.py, engine/split_fusion.py): on a device with atomics the partials'
kernel's last block of each output group sums the parts, so a split reduce is one launch.

The PYTHON device runs the last-block handshake as CUDA would (ATOMIC_ADD in thread order, blocks in launch order);
the tests switch its atomics on (`atomics`) so that they run the same with and without EMULATE=CUDA. Results are
checked against numpy and PyTorch; kernel counts are pinned; the kernels compile with NVRTC where it is present.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ourgrad import Tensor
from ourgrad.codegen.last_block import MAX_FINISH_PARTS, SplitReduceKernel, second_stage
from ourgrad.codegen.opt import split_reduce
from ourgrad.device import Device
from ourgrad.engine.schedule import create_schedule
from ourgrad.ops import Ops
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer
from helpers import nvrtc_compiler, skip_unless_device

rng = np.random.default_rng(24)


@pytest.fixture
def atomics(monkeypatch: pytest.MonkeyPatch) -> None:
  """The PYTHON device's renderer with ATOMIC_ADD and FENCE (as with EMULATE=CUDA), and split reduces in one kernel."""
  monkeypatch.setattr(Device["PYTHON"].renderer, "has_block_atomics", True)
  monkeypatch.setenv("SPLIT_LAST_BLOCK", "1")


def _kernels(*tensors: Tensor) -> list:
  return [item for item in create_schedule([t.lazydata for t in tensors]) if item.ast.op in (Ops.STORE,
                                                                                             Ops.SPLIT_REDUCE)]


# a reduce axis leading, trailing, in the middle, interleaved with output axes, batchnorm-style; each splits
# (small_split) into parts whose partials one block of each output group finishes
ONE_KERNEL_SPLITS = [((96, 6), (0,)), ((64, 40), (0,)), ((4, 48, 24), (1,)), ((8, 12, 24), (0, 1)),
                     ((16, 3, 8, 8), (0, 2, 3)), ((200, 3, 4), (0,))]


@pytest.mark.parametrize("shape, axes", ONE_KERNEL_SPLITS)
def test_one_kernel_split_reduces_over_every_axis_position_match_numpy(small_split: None, atomics: None,
                                                                       shape: tuple[int, ...],
                                                                       axes: tuple[int, ...]) -> None:
  data = rng.standard_normal(shape).astype(np.float32)
  x = Tensor(data, device="PYTHON")
  for reduced in (x.sum(axis=axes), x.max(axis=axes)):
    kernels = _kernels(reduced)
    assert [item.ast.op for item in kernels] == [Ops.SPLIT_REDUCE], f"{shape} over {axes}: one kernel"
  np.testing.assert_allclose(x.sum(axis=axes).numpy(), data.sum(axis=axes), rtol=1e-5, atol=1e-4)
  np.testing.assert_array_equal(x.max(axis=axes).numpy(), data.max(axis=axes))
  np.testing.assert_allclose(x.mean(axis=axes).numpy(), data.mean(axis=axes), rtol=1e-5, atol=1e-5)


def test_one_kernel_split_is_deterministic_and_leaves_its_counters_zero(small_split: None, atomics: None) -> None:
  """The same input gives the same bits every run (the parts are added in a fixed order); the last block resets its
  group's counter, so the next launch (other data) finishes again."""
  data = rng.standard_normal((64, 40)).astype(np.float32)
  x = Tensor(data, device="PYTHON")
  runs = [x.sum(axis=0).numpy() for _ in range(3)]
  for run in runs[1:]: np.testing.assert_array_equal(run, runs[0])
  other = rng.standard_normal((64, 40)).astype(np.float32)
  np.testing.assert_allclose(Tensor(other, device="PYTHON").sum(axis=0).numpy(), other.sum(axis=0), rtol=1e-5,
                             atol=1e-4)
  from ourgrad.engine.realize import _split_counters
  assert _split_counters, "the kernel took a counters buffer"
  for _, counters in _split_counters.values():
    if counters.device == "PYTHON": assert not counters.numpy().any(), "every counter is back to zero"


def test_one_kernel_linear_bias_and_layernorm_gradients_match_torch(small_split: None, atomics: None) -> None:
  """A Linear's bias gradient and a LayerNorm's weight and bias gradients (sums over batch and tokens), against
  torch, through autograd."""
  x_data = rng.standard_normal((4, 32, 8)).astype(np.float32)
  w_data = rng.standard_normal((8, 8)).astype(np.float32)
  x = Tensor(x_data, device="PYTHON")
  weight = Tensor(w_data, device="PYTHON", requires_grad=True)
  bias = Tensor.zeros(8, device="PYTHON", requires_grad=True)
  gamma = Tensor.ones(8, device="PYTHON", requires_grad=True)
  (((x.layernorm() * gamma) @ weight + bias) ** 2).sum().backward()
  tx, tw = torch.tensor(x_data), torch.tensor(w_data, requires_grad=True)
  tb, tg = torch.zeros(8, requires_grad=True), torch.ones(8, requires_grad=True)
  ((torch.nn.functional.layer_norm(tx, (8,), eps=1e-5) * tg @ tw + tb) ** 2).sum().backward()
  np.testing.assert_allclose(bias.grad.numpy(), tb.grad.numpy(), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(gamma.grad.numpy(), tg.grad.numpy(), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(weight.grad.numpy(), tw.grad.numpy(), rtol=1e-4, atol=1e-3)


def _cuda_facts(monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts.of(PythonRenderer("CUDA")))


def test_gpt2_bias_gradient_is_one_kernel_with_cuda_facts(atomics: None, monkeypatch: pytest.MonkeyPatch) -> None:
  """GPT-2's bias gradient, (4096, 768) summed over the tokens, split as on an H200 (32 parts): one launch whose
  blocks store the partials and whose last block per 32 outputs sums them."""
  _cuda_facts(monkeypatch)
  kernels = _kernels(Tensor.empty(4096, 768, device="PYTHON").sum(axis=0))
  assert [item.ast.op for item in kernels] == [Ops.SPLIT_REDUCE]
  assert [buffer.size for buffer in kernels[0].outputs] == [32 * 768, 768]   # the partials, then the outputs
  assert second_stage(kernels[0].ast.srcs[1]) == (Ops.SUM, 32, 768)


def test_split_stays_two_kernels_without_atomics(small_split: None, monkeypatch: pytest.MonkeyPatch) -> None:
  """A device without atomics (PYTHON without EMULATE=CUDA, CLANG, LLVM, OpenCL) keeps the second kernel; so does
  SPLIT_LAST_BLOCK=0 on one with them."""
  monkeypatch.setattr(Device["PYTHON"].renderer, "has_block_atomics", False)
  x = Tensor.empty(64, 40, device="PYTHON")
  assert [item.ast.op for item in _kernels(x.sum(axis=0))] == [Ops.STORE, Ops.STORE]
  monkeypatch.setattr(Device["PYTHON"].renderer, "has_block_atomics", True)
  monkeypatch.setenv("SPLIT_LAST_BLOCK", "0")
  assert [item.ast.op for item in _kernels(x.sum(axis=0))] == [Ops.STORE, Ops.STORE]
  assert not Device["CLANG"].renderer.has_block_atomics


def test_blocks_storing_other_outputs_finish_grid_wide(small_split: None, atomics: None) -> None:
  """Where a block's partials are not one group's (the heuristic merged the parts with the outputs into one block
  axis, or spread the parts over threads), the last block of the whole grid finishes every output (few of them)."""
  for shape, axes in [((3, 40, 11), (0, 1)), ((8, 12, 24), (0, 1)), ((16, 3, 8, 8), (0, 2, 3))]:
    data = rng.standard_normal(shape).astype(np.float32)
    x = Tensor(data, device="PYTHON")
    kernels = _kernels(x.sum(axis=axes))
    assert [item.ast.op for item in kernels] == [Ops.SPLIT_REDUCE]
    kernel = SplitReduceKernel(kernels[0].ast, Device["PYTHON"].renderer)
    kernel.hand_coded_optimizations()
    plan = kernel.last_block_plan()
    assert plan is not None and plan.part is None and plan.counters == 1, f"{shape} over {axes}: grid-wide"
    np.testing.assert_allclose(x.sum(axis=axes).numpy(), data.sum(axis=axes), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(x.max(axis=axes).numpy(), data.max(axis=axes))


def test_second_stage_recognizes_only_a_plain_reduce_over_the_parts(small_split: None, atomics: None) -> None:
  """A scaled sum (a fused multiply after the reduce) or more parts than MAX_FINISH_PARTS stay two kernels."""
  x = Tensor.empty(64, 40, device="PYTHON")
  assert len(_kernels(x.sum(axis=0) * 3)) == 2
  assert MAX_FINISH_PARTS >= 32


def test_one_kernel_splits_compile_with_nvrtc(atomics: None, monkeypatch: pytest.MonkeyPatch) -> None:
  """GPT-2's few-output reduces as one-kernel splits, rendered for CUDA, compile with NVRTC (skips without it)."""
  compiler = nvrtc_compiler()
  if compiler is None: pytest.skip("no NVRTC here")
  _cuda_facts(monkeypatch)
  builds = [Tensor.empty(4096, 768, device="PYTHON").sum(axis=0),
            Tensor.empty(8, 512, 768, device="PYTHON").max(axis=(0, 1)),
            Tensor.empty(4096, 3072, device="PYTHON").sum(axis=0)]
  fused = 0
  for item in _kernels(*builds):
    if item.ast.op is not Ops.SPLIT_REDUCE: continue
    kernel = SplitReduceKernel(item.ast, CUDARenderer("sm_90"))
    kernel.hand_coded_optimizations()
    source = CUDARenderer("sm_90").render(kernel.name, kernel.linearize())
    assert "atomicAdd(" in source and "__threadfence();" in source and "__ldcg(" in source
    compiler.compile(source)
    fused += 1
  assert fused >= 2


def test_one_kernel_split_on_cuda_matches_numpy() -> None:
  """On a real GPU: GPT-2's bias gradient and a LayerNorm weight gradient in one kernel each, equal to numpy, and the
  same bits run after run."""
  skip_unless_device("CUDA")
  data = rng.standard_normal((4096, 768)).astype(np.float32)
  x = Tensor(data, device="CUDA")
  assert [item.ast.op for item in _kernels(x.sum(axis=0))] == [Ops.SPLIT_REDUCE]
  runs = [x.sum(axis=0).numpy() for _ in range(3)]
  np.testing.assert_allclose(runs[0], data.sum(axis=0), rtol=1e-4, atol=1e-3)
  for run in runs[1:]: np.testing.assert_array_equal(run, runs[0])
  dy = rng.standard_normal((4096, 768)).astype(np.float32)
  got = (x * Tensor(dy, device="CUDA")).sum(axis=0).numpy()
  np.testing.assert_allclose(got, (data * dy).sum(axis=0), rtol=1e-4, atol=1e-3)


def test_one_kernel_split_replays_in_tiny_jit(small_split: None, atomics: None) -> None:
  """A jitted function with a one-kernel split reduce: every replay finishes (the counters are reset by the kernel,
  never planned onto other memory) and equals numpy."""
  from ourgrad import TinyJit

  @TinyJit
  def column_sums(x: Tensor) -> Tensor: return (x * 2).sum(axis=0).realize()
  for step in range(4):
    data = rng.standard_normal((64, 40)).astype(np.float32)
    got = column_sums(Tensor(data, device="PYTHON")).numpy()
    np.testing.assert_allclose(got, (data * 2).sum(axis=0), rtol=1e-5, atol=1e-4, err_msg=f"step {step}")


def test_emulated_atomic_add_returns_each_threads_old_value_in_launch_order() -> None:
  """ATOMIC_ADD on the PYTHON device: the running threads add one after another in thread order (blocks in launch
  order); each gets the element before its own add. Here every block's thread 0 counts its block on counter[block %
  2]: blocks 0, 2, 4 see 0, 1, 2 and blocks 1, 3, 5 see 0, 1, 2; COHERENT_LOAD reads as LOAD; FENCE does nothing."""
  from ourgrad.codegen.uops import AxisType, UOpBuilder, UOps
  from ourgrad.dtype import dtypes
  from ourgrad.runtime.ops_python import PythonCompiler, PythonProgram
  build = UOpBuilder()
  seen = build.add(UOps.DEFINE_GLOBAL, dtypes.int32, (), (0, True))
  counters = build.add(UOps.DEFINE_GLOBAL, dtypes.int32, (), (1, True))
  block = build.add(UOps.SPECIAL, dtypes.int32, (), ("gidx0", 6, 0, AxisType.GLOBAL))
  thread = build.add(UOps.SPECIAL, dtypes.int32, (), ("lidx0", 4, 0, AxisType.LOCAL))
  build.add(UOps.FENCE, None)
  first = build.add(UOps.IF, None, (build.alu(Ops.CMPLT, dtypes.bool, thread, build.const(1, dtypes.int32)),))
  group = build.alu(Ops.MOD, dtypes.int32, block, build.const(2, dtypes.int32))
  before = build.add(UOps.ATOMIC_ADD, dtypes.int32, (counters, group, build.const(1, dtypes.int32)))
  total = build.add(UOps.COHERENT_LOAD, dtypes.int32, (counters, group))
  build.add(UOps.STORE, None, (seen, block, build.alu(Ops.ADD, dtypes.int32, before,
                                                      build.alu(Ops.MUL, dtypes.int32, total,
                                                                build.const(100, dtypes.int32)))))
  build.end_if(first)
  program = PythonProgram("atomics", PythonCompiler().compile(PythonRenderer().render("atomics", build.uops)))
  seen_bytes, counter_bytes = np.zeros(6, np.int32).view(np.uint8), np.zeros(2, np.int32).view(np.uint8)
  program(seen_bytes, counter_bytes, global_size=(6, 1, 1), local_size=(4, 1, 1))
  # the old value, plus 100 x the counter after every block's add (COHERENT_LOAD runs after the whole ATOMIC_ADD)
  np.testing.assert_array_equal(seen_bytes.view(np.int32), [300, 300, 301, 301, 302, 302])
  np.testing.assert_array_equal(counter_bytes.view(np.int32), [3, 3])


def _partials_uops(rest_depends_on_part: bool, outputs: int = 64) -> list:
  """A partials kernel's stores: block (part, group) x 32 threads store P[part * outputs + group * 32 + thread], or
  with the output rotated by the part (a layout whose group's blocks store different outputs)."""
  from ourgrad.codegen.uops import AxisType, UOpBuilder, UOps
  from ourgrad.dtype import dtypes
  build = UOpBuilder()
  partials = build.add(UOps.DEFINE_GLOBAL, dtypes.float32, (), (0, True))
  part = build.add(UOps.SPECIAL, dtypes.int32, (), ("gidx0", 4, 1, AxisType.GLOBAL))
  group = build.add(UOps.SPECIAL, dtypes.int32, (), ("gidx1", outputs // 32, 0, AxisType.GLOBAL))
  thread = build.add(UOps.SPECIAL, dtypes.int32, (), ("lidx0", 32, 0, AxisType.LOCAL))
  output = build.alu(Ops.ADD, dtypes.int32, build.alu(Ops.MUL, dtypes.int32, group, build.const(32, dtypes.int32)),
                     thread)
  if rest_depends_on_part:
    output = build.alu(Ops.MOD, dtypes.int32, build.alu(Ops.ADD, dtypes.int32, output, part),
                       build.const(outputs, dtypes.int32))
  index = build.alu(Ops.ADD, dtypes.int32, build.alu(Ops.MUL, dtypes.int32, part, build.const(outputs, dtypes.int32)),
                    output)
  build.add(UOps.STORE, None, (partials, index, build.const(1.0, dtypes.float32)))
  return build.uops


def test_finish_plan_groups_blocks_only_where_they_store_the_same_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
  """The layout check: blocks that differ only in the part and store the same outputs are a group (a counter each);
  where the part moves the outputs, the whole grid is one group, and beyond MAX_GRID_FINISH_VALUES no plan."""
  from ourgrad.codegen import last_block
  plan = last_block.finish_plan(_partials_uops(False), 4, 64)
  assert plan is not None and plan.part is not None and plan.part.arg[0] == "gidx0" and plan.counters == 2
  plan = last_block.finish_plan(_partials_uops(True), 4, 64)
  assert plan is not None and plan.part is None and plan.counters == 1 and plan.blocks == 8
  monkeypatch.setattr(last_block, "MAX_GRID_FINISH_VALUES", 128)
  assert last_block.finish_plan(_partials_uops(True), 4, 64) is None
