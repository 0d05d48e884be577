"""Opts as DEBUG prints them: SHARED's packed amount (row padding plus structure flags, codegen/shared_tiles.py) and
WGMMA's packed axis spelled out by name, the same text in Kernel.print_debug (DEBUG=3) and BEAM's DEBUG=2 lines."""
from __future__ import annotations

import itertools

import pytest

from ourgrad import Tensor
from ourgrad.codegen import kernel as kernel_module
from ourgrad.codegen.kernel import (SHARED_ASYNC, SHARED_ASYNC_MAX_STAGES, SHARED_REDUCE_INNER, SHARED_ROW_SKEW,
                                    SHARED_TWO_BLOCKS, SHARED_VECTOR_FILL, TC_TILE_STAGES, WGMMA_DEEP,
                                    WGMMA_SPECIALIZED, Kernel, Opt, OptOps, describe_opt, describe_opts)
from ourgrad.codegen.opt import search
from ourgrad.codegen.shared_tiles import SharedStructure, decode_shared_amount
from ourgrad.engine.schedule import create_schedule
from ourgrad.renderer.cuda import CUDARenderer


@pytest.mark.parametrize("amount, text", [
  (0, "pad 0"),
  (4, "pad 4"),
  (4 + SHARED_VECTOR_FILL + SHARED_TWO_BLOCKS + SHARED_ROW_SKEW, "pad 4, VECTOR_FILL|TWO_BLOCKS|ROW_SKEW"),
  (4 + 2 * SHARED_ASYNC + SHARED_TWO_BLOCKS, "pad 4, TWO_BLOCKS|ASYNC 3 stages"),
  (3 * SHARED_ASYNC + SHARED_REDUCE_INNER, "pad 0, ASYNC 4 stages|REDUCE_INNER"),
  (2 * SHARED_REDUCE_INNER + 4, "pad 4, unknown 1024"),
])
def test_shared_amount_is_spelled_out(amount: int, text: str) -> None:
  assert decode_shared_amount(amount).describe() == text
  assert describe_opt(Opt(OptOps.SHARED, 0, amount)) == f"SHARED(axis 0, {text})"


def test_every_structure_round_trips() -> None:
  """SharedStructure -> amount -> SharedStructure is the identity over every padding and flag combination, and
  amount -> SharedStructure -> amount over every amount below the first unknown bit."""
  flags = [False, True]
  async_stages = [0] + list(range(2, SHARED_ASYNC_MAX_STAGES + 1))
  for padding, fill, two, stages, skew, inner in itertools.product([0, 4], flags, flags, async_stages, flags, flags):
    structure = SharedStructure(padding, fill, two, stages, skew, inner)
    assert decode_shared_amount(structure.amount) == structure
  for amount in range(2 * SHARED_REDUCE_INNER + 1):
    assert decode_shared_amount(amount).amount == amount
  assert decode_shared_amount(2 * SHARED_REDUCE_INNER).unknown == 2 * SHARED_REDUCE_INNER


def test_decoded_fields_match_the_flag_bits() -> None:
  """The decoded fields against the bit arithmetic the flags are defined by (shared_tiles.py's comments)."""
  for amount in range(2 * SHARED_REDUCE_INNER):
    structure = decode_shared_amount(amount)
    assert structure.padding == amount % 16
    assert structure.vector_fill == (amount // 16 % 2 == 1) and structure.two_blocks == (amount // 32 % 2 == 1)
    assert structure.row_skew == (amount // 256 % 2 == 1) and structure.reduce_inner == (amount // 512 % 2 == 1)
    assert structure.async_stages == (amount // 64 % 4 + 1 if amount // 64 % 4 else 0)


def test_opts_with_tensor_cores_and_wgmma() -> None:
  """After TC, SHARED's amount is the tiles' stages (0: the default); WGMMA's axis packs stages and kernel kinds."""
  opts = [Opt(OptOps.TC, 0, 1), Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.SHARED, 0, 0), Opt(OptOps.UNROLL, 0, 0)]
  assert describe_opts(opts) == (f"TC(axis 0, tensor core 1), UPCAST(axis 1, by 4), "
                                 f"SHARED(axis 0, TC tiles, {TC_TILE_STAGES} stages), UNROLL(axis 0, by all)")
  assert describe_opt(Opt(OptOps.WGMMA, 4 + WGMMA_SPECIALIZED, 256)) == "WGMMA(N 256, 4 stages, SPECIALIZED)"
  assert describe_opt(Opt(OptOps.WGMMA, 3 + WGMMA_DEEP, 128)) == "WGMMA(N 128, 3 stages, DEEP)"
  assert describe_opt(Opt(OptOps.PADTO, 1, 128)) == "PADTO(axis 1, to 128)"
  assert describe_opts([]) == "none"


def _hand_coded_matmul() -> Kernel:
  """The CUDA kernel of a float32 4096^3 matmul as the heuristic builds it (a SHARED amount with flags)."""
  a, b = (Tensor.empty(4096, 4096, device="PYTHON") for _ in range(2))
  kernel = Kernel(create_schedule([(a @ b).lazydata])[-1].ast, CUDARenderer())
  kernel.hand_coded_optimizations()
  return kernel


def test_debug_printers_spell_shared_out(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
  """DEBUG=3's kernel line and BEAM's DEBUG=2 line print the applied Opts through describe_opts."""
  kernel = _hand_coded_matmul()
  shared = next(opt for opt in kernel.applied_opts if opt.op is OptOps.SHARED)
  assert shared.arg.vector_fill and shared.arg.row_skew, "the large float32 tile carries its structure"
  described = describe_opts(kernel.applied_opts)
  assert f"SHARED(axis 0, {shared.arg.describe()})" in described
  monkeypatch.setattr(kernel_module, "DEBUG", 3)
  kernel.print_debug()
  assert f"opts=[{described}]" in capsys.readouterr().out
  monkeypatch.setattr(search, "DEBUG", 2)
  search._report(kernel.name, kernel, 1e-3, 2e-3, 0.5)
  assert f"opts [{described}]" in capsys.readouterr().out


def test_shared_typed_args_and_the_older_amounts_build_the_same_kernels() -> None:
  """SHARED's typed arg (a SharedStructure; after TC, TileStages) and the older packed amount give the same kernel
  source; an arg of the wrong kind for the kernel (stages without TC, a structure after it) is refused; both kinds
  round-trip through a plan's JSON (BEAM's cache)."""
  from ourgrad.codegen.lowering import lower_kernel
  from ourgrad.codegen.opt.plans import OptsPlan, plan_from_json, plan_to_json
  from ourgrad.codegen.opts import KernelOptError, TileStages
  renderer = CUDARenderer("sm_80")
  a, b = (Tensor.empty(256, 256, device="PYTHON") for _ in range(2))
  f32 = create_schedule([(a @ b).lazydata])[-1].ast
  a16, b16 = (Tensor.empty(256, 256, device="PYTHON", dtype="float16") for _ in range(2))
  f16 = create_schedule([(a16 @ b16).lazydata])[-1].ast
  tile = [Opt(OptOps.UPCAST, 0, 4), Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.LOCAL, 0, 16), Opt(OptOps.LOCAL, 1, 16)]
  tc = [Opt(OptOps.TC, 0, 0), Opt(OptOps.UPCAST, 1, 4), Opt(OptOps.LOCAL, 1, 2)]
  structure = SharedStructure(4, vector_fill=True, row_skew=True)
  for ast, before, older, typed in ((f32, tile, structure.amount, structure), (f32, tile, 0, SharedStructure()),
                                    (f16, tc, 3, TileStages(3)), (f16, tc, 0, TileStages(TC_TILE_STAGES))):
    sources = []
    for shared in (Opt(OptOps.SHARED, 0, older), Opt(OptOps.SHARED, 0, 0, typed)):
      kernel = Kernel(ast, renderer)
      for opt in [*before, shared]: kernel.apply_opt(opt)
      sources.append(lower_kernel(kernel, renderer, "k").source)
    assert sources[0] == sources[1]
    plan = OptsPlan("search", (*before, Opt(OptOps.SHARED, 0, 0, typed)))
    assert plan_from_json(plan_to_json(plan)) == plan
  for ast, before, wrong in ((f32, tile, TileStages(3)), (f16, tc, structure)):
    kernel = Kernel(ast, renderer)
    for opt in before: kernel.apply_opt(opt)
    with pytest.raises(KernelOptError): kernel.apply_opt(Opt(OptOps.SHARED, 0, 0, wrong))
