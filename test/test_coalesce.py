"""A reduce whose inputs are contiguous only in pieces of an output axis (codegen/opt/coalesce.py): GPT-2's c_attn
bias gradient, the tokens' sum of the q, k and v gradients concatenated along the channels, each read through the
attention's head permute (B, H, T, D) -> (B, T, 3 H D). The warp's lanes take neighbouring channels (D within a
head), as for a contiguous input, not a token each (64 floats apart: a 32-byte sector per lane). Values against
numpy on CLANG and on the PYTHON interpreter with CUDA's heuristics, the bias gradient against PyTorch."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel, OptOps
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.opt import split_reduce
from ourgrad.codegen.opt.coalesce import contiguous_in_pieces
from ourgrad.engine.realize import compile_kernel, run_schedule
from ourgrad.engine.schedule import create_schedule
from ourgrad.ops import MemBuffer, Ops
from ourgrad.renderer.cuda import CUDARenderer
from ourgrad.runtime.ops_python import PythonRenderer
from helpers import nvrtc_compiler

rng = np.random.default_rng(24)


def _heads_cat(heads: list[Tensor]) -> Tensor:
  """(B, H, T, D) q, k, v gradients -> their (B, T, 3 H D) concatenation, as the attention's backward builds it."""
  batch, count, length, width = heads[0].shape
  return Tensor.cat(*[head.transpose(1, 2).reshape(batch, length, count * width) for head in heads], dim=2)


def _optimized(item, renderer=None) -> Kernel:  # noqa: ANN001
  kernel = Kernel(item.ast, renderer or PythonRenderer("CUDA"))
  kernel.hand_coded_optimizations()
  return kernel


def _lane_strides(kernel: Kernel) -> list[int | None]:
  """The stride of the launch's x thread index (a warp's neighbouring lanes) in each memory load."""
  lanes = kernel.thread_axes()[-1]
  loads = [st for st, leaf in zip(kernel.sts[1:], kernel.leaves[1:]) if isinstance(leaf.arg, MemBuffer)]
  return [st.real_strides()[lanes] for st in loads]


def _gpt2_heads(v_transposed: bool, dims: tuple[int, int, int, int] = (8, 12, 512, 64),
                device: str = "PYTHON") -> list[Tensor]:
  """q, k, v gradients (B, H, T, D); `v_transposed`: v's as its matmul stores it in the GPT-2 step, (B, H, D, T)."""
  batch, count, length, width = dims
  heads = [Tensor.empty(batch, count, length, width, device=device) for _ in range(2)]
  last = Tensor.empty(batch, count, width, length, device=device).transpose(2, 3) if v_transposed else \
    Tensor.empty(batch, count, length, width, device=device)
  return heads + [last]


@pytest.mark.parametrize("v_transposed", [False, True])
def test_gpt2_c_attn_bias_gradient_partials_take_lanes_along_head_dim(monkeypatch: pytest.MonkeyPatch,
                                                                     v_transposed: bool) -> None:
  """GPT-2 at its real width (batch 8, 512 tokens, 12 heads of 64): the split's partial sums are laid out as for a
  contiguous (8, 512, 2304) input (LOCAL 32 on the channels, GROUPTOP over the batch), each warp load of q and k
  reading 32 neighbouring floats (4 sectors), where it was a warp per channel, its lanes 64 floats apart. With v's
  gradient stored (B, H, D, T) (the GPT-2 step), v alone is read across the lanes (2 of 3 sources coalesced)."""
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts.of(PythonRenderer("CUDA")))
  monkeypatch.setenv("SPLIT_LAST_BLOCK", "0")   # the partials' kernel alone (test_last_block.py: in one kernel)
  heads = _gpt2_heads(v_transposed)
  permuted = create_schedule([_heads_cat(heads).sum(axis=(0, 1)).lazydata])
  contiguous = create_schedule([Tensor.empty(8, 512, 2304, device="PYTHON").sum(axis=(0, 1)).lazydata])
  first, plain = (next(item for item in schedule if item.ast.op is Ops.STORE) for schedule in (permuted, contiguous))
  kernel = _optimized(first)
  assert kernel.applied_opts == _optimized(plain).applied_opts
  assert any(opt.op is OptOps.LOCAL for opt in kernel.applied_opts)
  assert kernel.full_shape[kernel.thread_axes()[-1]] == 32
  assert _lane_strides(kernel) == ([1, 1, 512] if v_transposed else [1, 1, 1])


def test_pieces_must_hold_a_sector() -> None:
  """Heads of 4 floats: the channels are contiguous in pieces of 4 only, too short to take a warp's lanes."""
  heads = [Tensor.empty(2, 8, 16, 4, device="PYTHON") for _ in range(3)]
  item = next(item for item in create_schedule([_heads_cat(heads).sum(axis=(0, 1)).lazydata])
              if item.ast.op is Ops.STORE)
  kernel = Kernel(item.ast, PythonRenderer("CUDA"))
  loads = [st for st, leaf in zip(kernel.sts[1:], kernel.leaves[1:]) if isinstance(leaf.arg, MemBuffer)]
  assert not contiguous_in_pieces(loads, 0, 32)


def _heads_data(batch: int, count: int, length: int, width: int) -> list[np.ndarray]:
  return [rng.standard_normal((batch, count, length, width)).astype(np.float32) for _ in range(3)]


def _numpy_bias(data: list[np.ndarray]) -> np.ndarray:
  return np.concatenate([d.transpose(0, 2, 1, 3).reshape(d.shape[0], d.shape[2], -1) for d in data], axis=2).sum((0, 1))


def _heads_tensors(data: list[np.ndarray], v_transposed: bool, device: str) -> list[Tensor]:
  """Tensors of q, k, v gradients; `v_transposed`: v's stored (B, H, D, T) and read through a transpose."""
  heads = [Tensor(d, device=device) for d in data]
  if v_transposed: heads[2] = Tensor(np.ascontiguousarray(data[2].transpose(0, 1, 3, 2)), device=device).transpose(2, 3)
  return heads


@pytest.mark.parametrize("dims, v_transposed", [((2, 2, 256, 32), False), ((1, 3, 512, 16), False),
                                                ((2, 2, 256, 32), True)])
def test_cat_of_permuted_heads_sum_on_emulated_cuda_matches_numpy(monkeypatch: pytest.MonkeyPatch,
                                                                  dims: tuple[int, int, int, int],
                                                                  v_transposed: bool) -> None:
  """Every kernel of the (split) sum, optimized with CUDA's heuristics and run on the PYTHON interpreter, against
  numpy; the partial sums' lanes along the head dim."""
  monkeypatch.setenv("PACK_KERNELS", "0")
  monkeypatch.setenv("SPLIT_LAST_BLOCK", "0")   # each stage run on its own (test_last_block.py: in one kernel)
  data = _heads_data(*dims)
  out = _heads_cat(_heads_tensors(data, v_transposed, "PYTHON")).sum(axis=(0, 1))
  schedule = create_schedule([out.lazydata])
  kernels = [item for item in schedule if item.ast.op is Ops.STORE]
  assert len(kernels) == 2 and _lane_strides(_optimized(kernels[0]))[:2] == [1, 1]
  for item in schedule:
    if item.ast.op is Ops.STORE:
      for buffer in item.outputs: buffer.allocate()
      compile_kernel(_optimized(item), "PYTHON")(item.outputs + item.inputs)
    else: run_schedule([item])
  result = kernels[-1].outputs[0].numpy()
  expected = _numpy_bias(data)
  np.testing.assert_allclose(result.reshape(expected.shape), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("v_transposed", [False, True])
def test_cat_of_permuted_heads_sum_on_clang_matches_numpy(v_transposed: bool) -> None:
  data = _heads_data(2, 3, 20, 32)
  out = _heads_cat(_heads_tensors(data, v_transposed, "CLANG")).sum(axis=(0, 1))
  np.testing.assert_allclose(out.numpy(), _numpy_bias(data), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("device", ["CLANG", "PYTHON"])
def test_attention_c_attn_bias_gradient_matches_torch(small_split: None, device: str) -> None:
  """The bias gradient of a q/k/v projection whose heads go through attention, against PyTorch."""
  batch, length, count, width = 2, 16, 2, 16
  channels = count * width
  x_data = rng.standard_normal((batch, length, channels)).astype(np.float32)
  w_data = (rng.standard_normal((3 * channels, channels)) / np.sqrt(channels)).astype(np.float32)
  b_data = rng.standard_normal(3 * channels).astype(np.float32)

  def attention_loss(x, w, b, split_heads):  # noqa: ANN001, ANN202
    q, k, v = split_heads((x @ w.transpose(0, 1) + b))
    scores = (q @ k.transpose(-1, -2)).softmax(-1)
    return ((scores @ v) ** 2).sum()

  def ours_heads(qkv: Tensor) -> list[Tensor]:
    return [t.reshape(batch, length, count, width).transpose(1, 2) for t in qkv.split(channels, dim=2)]

  def torch_heads(qkv: torch.Tensor) -> list[torch.Tensor]:
    return [t.reshape(batch, length, count, width).transpose(1, 2) for t in qkv.split(channels, dim=2)]

  b = Tensor(b_data, device=device, requires_grad=True)
  attention_loss(Tensor(x_data, device=device), Tensor(w_data, device=device), b, ours_heads).backward()
  tb = torch.tensor(b_data, requires_grad=True)
  attention_loss(torch.tensor(x_data), torch.tensor(w_data), tb, torch_heads).backward()
  np.testing.assert_allclose(b.grad.numpy(), tb.grad.numpy(), rtol=1e-4, atol=1e-3)  # sums of 32 tokens near 0


@pytest.mark.parametrize("v_transposed", [False, True])
def test_gpt2_c_attn_bias_gradient_kernels_compile_with_nvrtc(monkeypatch: pytest.MonkeyPatch,
                                                              v_transposed: bool) -> None:
  """Both kernels of the real-width bias gradient, optimized for CUDA, compile with NVRTC (skips without it)."""
  compiler = nvrtc_compiler()
  if compiler is None: pytest.skip("no NVRTC here")
  monkeypatch.setattr(split_reduce, "FACTS_OVERRIDE", split_reduce.SplitFacts.of(PythonRenderer("CUDA")))
  for item in create_schedule([_heads_cat(_gpt2_heads(v_transposed)).sum(axis=(0, 1)).lazydata]):
    if item.ast.op is not Ops.STORE: continue
    kernel = _optimized(item, CUDARenderer())
    compiler.compile(CUDARenderer().render(kernel.name, linearize(kernel)))
