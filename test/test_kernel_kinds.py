"""codegen/lowering.py's kernel kinds (one table that realize.get_kernel, graph_viz.kernel_name and lower_kernel read)
and the GPU facts the heuristics take from the device (renderer.GpuFacts), on the PYTHON device lowering as CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel
from ourgrad.codegen.lowering import KINDS, OptPolicy, build_kernel, kernel_cost, kind_of, kind_of_ast, lower_kernel
from ourgrad.codegen.opt import split_reduce
from ourgrad.engine import ride_along
from ourgrad.codegen.wgmma_tiles import WgmmaMatmul
from ourgrad.device import Device
from ourgrad.engine import graph_viz, realize
from ourgrad.engine.schedule import ScheduleItem, create_schedule
from ourgrad.ops import Ops
from ourgrad.renderer import ASSUMED_CUDA_GPU, ASSUMED_THREAD_BLOCK_GPU, GpuFacts
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer
from helpers import emulated_gpu_tf32, small_split_reduces

rng = np.random.default_rng(25)


@pytest.fixture
def emulated_cuda(monkeypatch: pytest.MonkeyPatch):
  """The PYTHON device as EMULATE=CUDA (TF32 allowed: float32 attention is fused), split reduces scaled down and
  finished by their last blocks."""
  small_split_reduces(monkeypatch)
  monkeypatch.setenv("SPLIT_LAST_BLOCK", "1")
  with emulated_gpu_tf32(monkeypatch, "CUDA"):
    yield


def _items(*tensors: Tensor) -> list[ScheduleItem]:
  return [item for item in create_schedule([t.lazydata for t in tensors]) if item.ast.op is not Ops.COPY]


def _numpy(data: np.ndarray) -> Tensor: return Tensor(data, device="PYTHON")


def test_each_kind_is_built_named_lowered_and_costed_through_the_table(emulated_cuda: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
  """A program with a kernel of every kind: each schedule item's kernel is its kind's (realize.get_kernel), runs
  under the name graph_viz gives it, lowers to the kind's source, and costs what the kind says; the results match
  torch (float64)."""
  q, k, v = (rng.standard_normal((1, 2, 16, 16)).astype(np.float32) for _ in range(3))
  table, tokens = rng.standard_normal((10, 8)).astype(np.float32), np.array([1, 3, 3, 7, 0, 9], dtype=np.int32)
  tall = rng.standard_normal((200, 3)).astype(np.float32)
  small = [rng.standard_normal(size).astype(np.float32) for size in (5, 7)]
  rider, host = rng.standard_normal(24).astype(np.float32), rng.standard_normal((256, 256)).astype(np.float32)
  tq, tk, tv = (_numpy(x).requires_grad_() for x in (q, k, v))
  ttable = _numpy(table).requires_grad_()
  attended = tq.scaled_dot_product_attention(tk, tv, is_causal=True)
  embedded = ttable[_numpy(tokens)]
  (attended.sum() + (embedded * embedded).sum()).backward()
  outputs = [attended, tq.grad, tk.grad, tv.grad, ttable.grad, _numpy(tall).sum(axis=0),
             *[_numpy(x) * 2 + 1 for x in small]]
  items = _items(*outputs)
  # a one-value sum riding along in an independent larger kernel (engine/ride_along.py), scheduled apart with packing
  # off (on a GPU it packs small reduces first) and the latency rule waived (the emulated GPU asks megabytes of a host)
  monkeypatch.setenv("PACK_KERNELS", "0")
  monkeypatch.setattr(ride_along, "HOST_LATENCIES", 0)
  # and a plain loop nest (a small product): with packing on, independent small kernels share a packed launch
  ride_outputs = [_numpy(rider).sum(), _numpy(host) * 3, _numpy(tall).T @ _numpy(tall)]
  ride_items = _items(*ride_outputs)
  outputs, items = outputs + ride_outputs, items + ride_items
  kinds = {kind_of_ast(item.ast).name for item in items}
  assert kinds == {kind.name for kind in KINDS}, f"every kind in the program: {sorted(kinds)}"
  renderer = Device["PYTHON"].renderer
  for item in items:
    kind = kind_of_ast(item.ast)
    kernel = realize.get_kernel(item.ast, "PYTHON")
    assert kind_of(kernel) is kind and type(kernel) is kind.kernel_type
    assert (kernel.applied_opts == []) == (kind.opts is OptPolicy.OWN_PLAN), kind.name
    runner = realize.get_runner("PYTHON", item.ast)
    assert runner.name == graph_viz.kernel_name(item) == realize.function_name(kernel)
    lowered = lower_kernel(kernel, renderer, runner.name)
    assert lowered.source == runner.source
    assert (runner.op_count, runner.byte_count) == kernel_cost(kernel, lowered) == kind.cost(kernel, lowered)
  realize.run_schedule(items[:len(items) - len(ride_items)])
  realize.run_schedule(ride_items)
  tq64, tk64, tv64 = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
  ttable64 = torch.tensor(table, dtype=torch.float64, requires_grad=True)
  expected = torch.nn.functional.scaled_dot_product_attention(tq64, tk64, tv64, is_causal=True)
  embedded64 = ttable64[torch.tensor(tokens, dtype=torch.long)]
  (expected.sum() + (embedded64 * embedded64).sum()).backward()
  column_sums = torch.tensor(tall, dtype=torch.float64).sum(0)
  references = [expected, tq64.grad, tk64.grad, tv64.grad, ttable64.grad, column_sums]
  references += [torch.tensor(x, dtype=torch.float64) * 2 + 1 for x in small]
  tall64 = torch.tensor(tall, dtype=torch.float64)
  references += [torch.tensor(rider, dtype=torch.float64).sum(), torch.tensor(host, dtype=torch.float64) * 3,
                 tall64.T @ tall64]
  for output, reference in zip(outputs, references):   # TF32 products: a loose tolerance for attention
    np.testing.assert_allclose(output.numpy(), reference.detach().numpy(), rtol=2e-2, atol=2e-2)


def test_a_loop_nest_follows_noopt_and_a_search(emulated_cuda: None, monkeypatch: pytest.MonkeyPatch) -> None:
  """build_kernel's policy: a loop nest takes the hand-coded opts, a search's where one is given, none with NOOPT=1;
  a one-kernel split reduce takes the hand-coded ones even then (its layout was checked with them)."""
  item = _items(_numpy(rng.standard_normal((32, 48)).astype(np.float32)) @
                _numpy(rng.standard_normal((48, 64)).astype(np.float32)))[-1]
  renderer = Device["PYTHON"].renderer
  assert build_kernel(item.ast, renderer).applied_opts
  searched: list[Kernel] = []
  assert build_kernel(item.ast, renderer, lambda kernel: searched.append(kernel) or kernel) is searched[0]
  assert searched[0].applied_opts == []
  split = _items(_numpy(rng.standard_normal((200, 3)).astype(np.float32)).sum(axis=0))[-1]
  assert split.ast.op is Ops.SPLIT_REDUCE
  monkeypatch.setenv("NOOPT", "1")
  assert build_kernel(item.ast, renderer).applied_opts == []
  assert build_kernel(split.ast, renderer).applied_opts


def test_renderers_without_their_device_assume_one_gpu() -> None:
  """A CUDA renderer made without its device, and the PYTHON device's EMULATE=CUDA, carry ASSUMED_CUDA_GPU's facts;
  a renderer of thread blocks that knows none is taken for ASSUMED_THREAD_BLOCK_GPU by the split decision."""
  for renderer in (CUDARenderer("sm_90"), PythonRenderer("CUDA")):
    assert (renderer.multiprocessors, renderer.threads_per_multiprocessor, renderer.registers_per_multiprocessor,
            renderer.dynamic_local_memory_bytes) == (132, 2048, 65536, 227 * 1024) == (
              ASSUMED_CUDA_GPU.multiprocessors, ASSUMED_CUDA_GPU.threads_per_multiprocessor,
              ASSUMED_CUDA_GPU.registers_per_multiprocessor, ASSUMED_CUDA_GPU.dynamic_local_memory_bytes)
  facts = split_reduce.SplitFacts.of(PythonRenderer())
  assert (facts.multiprocessors, facts.threads_per_multiprocessor) == (
    ASSUMED_THREAD_BLOCK_GPU.multiprocessors, ASSUMED_THREAD_BLOCK_GPU.threads_per_multiprocessor)


def test_a_devices_facts_reach_the_decisions() -> None:
  """set_gpu_facts (what the CUDA device calls with the driver's figures) changes what the heuristics read: the split
  decision's multiprocessors and resident threads, and the registers a wgmma kernel's launch bounds leave a thread
  (65536 / (3 x 128 threads) = 170, in granules of 8: 168; with half the registers 85 -> 80, too few for 128
  accumulators of a 128x256 tile)."""
  renderer = CUDARenderer("sm_90")
  renderer.set_gpu_facts(GpuFacts(66, 1536, 32768, 100 * 1024))
  facts = split_reduce.SplitFacts.of(renderer)
  assert (facts.multiprocessors, facts.threads_per_multiprocessor) == (66, 1536)
  assert renderer.dynamic_local_memory_bytes == 100 * 1024
  assert CUDARenderer("sm_90").multiprocessors == 132, "another renderer keeps the assumed facts"
  assert WgmmaMatmul(256, 256, 512, block_n=256, specialized=True).launch_registers == 168
  with pytest.raises(ValueError, match="do not fit 80 registers"):
    WgmmaMatmul(256, 256, 512, block_n=256, specialized=True, multiprocessor_registers=32768)
