"""Opts: the optimizations a Kernel applies (OptOps, Opt), how they read (describe_opt), and the error an Opt that
does not apply raises. The vocabulary shared by the Kernel that applies them (codegen/kernel.py), the heuristics
and BEAM search that choose them (codegen/opt/) and everything that prints them.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Sequence

from ourgrad.codegen.shared_tiles import SharedStructure, decode_shared_amount

# elements of padding after each row of a tensor-core tile (16 bytes of float16) and its stages (cp.async double
# buffering)
TC_TILE_PADDING, TC_TILE_STAGES = 8, 2


# OptOps.WGMMA's axis: stages (0: 4) + WGMMA_SPECIALIZED for the warp-specialized kernel, + WGMMA_DEEP for the
# cooperative one that copies stages - 1 steps ahead
WGMMA_SPECIALIZED, WGMMA_DEEP = 16, 32
# OptOps.WGMMA's defaults: the stages of an axis of 0 and the N tile of an amount of 0
WGMMA_DEFAULT_STAGES, WGMMA_DEFAULT_N = 4, 256


class OptOps(Enum):
  UPCAST = auto()   # compute `amount` neighbouring outputs of an axis per thread, in registers
  UNROLL = auto()   # unroll `amount` iterations of a reduce axis (axis counts reduce axes after the group axes)
  LOCAL = auto()    # split a global axis into threads of a block (GPU)
  GROUP = auto()    # split a reduce axis (counted as for UNROLL) across threads of a block, neighbouring elements to
  #                   neighbouring threads (coalesced); partials are combined in local memory (GPU)
  GROUPTOP = auto() # as GROUP, but each thread reduces one contiguous slice of the axis
  PADTO = auto()    # pad an output axis up to a multiple of `amount` so other opts fit: loads read 0 and stores are
  #                   masked beyond the real size
  BLOCK = auto()    # cache block (CPU): split a global axis into (size/amount, amount) and make the outer part the
  #                   outermost loop, so the loops in between revisit only `amount` slices of that axis (an operand's
  #                   strip that stays in cache); see _apply_cache_block
  SHARED = auto()   # shared-memory tiles (GPU): each reduce step, the block's threads load the loads they share (a
  #                   matmul's operands) into local memory together, then compute from it; axis 0, `arg` the tiles'
  #                   structure (shared_tiles.SharedStructure: row padding, fills, stages) or, after TC, their
  #                   TileStages; without one (the older form) `amount` packs them (see shared_choice)
  TC = auto()       # tensor cores (GPU): the matmul-shaped reduce's 16x8x16 tiles go to one matrix instruction per
  #                   warp; `amount` picks the renderer's TensorCore (dtype), axis must be 0; see _apply_tensor_core
  WGMMA = auto()    # Hopper warpgroup MMA (CUDA sm_90a): a float16/bfloat16 matmul whose sizes are multiples of the
  #                   tile becomes the kernel of codegen/wgmma_tiles.py; `arg` is its wgmma_tiles.WgmmaTile (block
  #                   tile, stages, kind, CTAs per multiprocessor, persistent grid); without one (the older form)
  #                   `amount` is the block's N tile (64..256), `axis` the shared-memory stages (0: 4), plus
  #                   WGMMA_SPECIALIZED / WGMMA_DEEP for those kinds; the only opt of its kernel


@dataclass(frozen=True)
class Opt:
  """One optimization: its kind, the axis it applies to, an amount, and for a kind whose choice has several fields
  a frozen dataclass of them (`arg`: OptOps.WGMMA's wgmma_tiles.WgmmaTile), never packed into the ints."""
  op: OptOps
  axis: int
  amount: int
  arg: Any = None

  def __repr__(self) -> str:
    return f"Opt({self.op.name}, {self.axis}, {self.amount}{'' if self.arg is None else ', ' + repr(self.arg)})"


@dataclass(frozen=True)
class TileStages:
  """OptOps.SHARED's arg after TC: the shared-memory stages of the staged tensor-core tiles (cp.async, 2: double
  buffered)."""
  stages: int = TC_TILE_STAGES


def shared_choice(opt: Opt, tensor_cores: bool) -> SharedStructure | TileStages:
  """What an OptOps.SHARED asks: its typed `arg`, or the older int amount read as the kernel it applies to reads it
  (`tensor_cores`: a TC opt came before, so the amount is the stages, 0 the default; else the rows' padding plus the
  SHARED_* flags of shared_tiles.py)."""
  if opt.arg is not None: return opt.arg
  return TileStages(opt.amount or TC_TILE_STAGES) if tensor_cores else decode_shared_amount(opt.amount)


def describe_opt(opt: Opt, tensor_cores: bool = False) -> str:
  """One Opt for a reader: "UPCAST(axis 0, by 4)", "SHARED(axis 0, pad 4, VECTOR_FILL|TWO_BLOCKS|ROW_SKEW)" (SHARED's
  choice spelled out, see shared_choice),
  "WGMMA(N 256, 4 stages, SPECIALIZED)". repr(opt) stays the Opt(...) a program can rebuild it from."""
  if opt.op is OptOps.SHARED:
    choice = shared_choice(opt, tensor_cores)
    if isinstance(choice, TileStages): return f"SHARED(axis {opt.axis}, TC tiles, {choice.stages} stages)"
    return f"SHARED(axis {opt.axis}, {choice.describe()})"
  if opt.op is OptOps.WGMMA and opt.arg is not None: return f"WGMMA({opt.arg.describe()})"
  if opt.op is OptOps.WGMMA:
    stages = opt.axis % WGMMA_SPECIALIZED or WGMMA_DEFAULT_STAGES
    kinds = [name for flag, name in [(WGMMA_SPECIALIZED, "SPECIALIZED"), (WGMMA_DEEP, "DEEP")] if opt.axis & flag]
    return f"WGMMA(N {opt.amount or WGMMA_DEFAULT_N}, {stages} stages{''.join(', ' + kind for kind in kinds)})"
  if opt.op is OptOps.PADTO: return f"PADTO(axis {opt.axis}, to {opt.amount})"
  if opt.op is OptOps.TC: return f"TC(axis {opt.axis}, tensor core {opt.amount})"
  return f"{opt.op.name}(axis {opt.axis}, by {opt.amount or 'all'})"


def describe_opts(opts: Sequence[Opt]) -> str:
  """Opts for a reader, as DEBUG=2 and DEBUG=3 print them (describe_opt of each, comma separated); "none" if none."""
  described, tensor_cores = [], False
  for opt in opts:
    described.append(describe_opt(opt, tensor_cores))
    tensor_cores = tensor_cores or opt.op is OptOps.TC
  return ", ".join(described) or "none"


class KernelOptError(Exception):
  """An Opt that does not apply to this kernel."""
