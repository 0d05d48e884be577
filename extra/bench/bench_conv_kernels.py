"""Convolution kernels on a GPU, each timed alone: the hand-coded choice beside explicit opt lists (VARIANTS) and a
BEAM search, to choose the hand-coded convolution opts from measurements.

Rows: the convolution-shaped kernels of one examples/mnist.py training step (the "small" model, batch 256: forward,
input gradient, weight gradient and the weight gradient's second split-K kernel), and conv2d 64x64x56x56 with 64
3x3 filters, pad 1, in float32 and float16 (issue 12's rows; PyTorch/cuDNN beside them where torch has CUDA).
`--parts-sweep` also times every kernel of the MNIST step with the split-K part size of matmul-like reduces
(split_reduce.MIN_PART_MATMUL) set to each of 128, 256, 512 and 1024 products, and with the input gradient's
padded output gradient stored first (tensor_conv.store_padded_gradient, as on the CPU). `--wgrad` times the step's
weight gradients alone (WEIGHT_GRADIENT_VARIANTS), their second split-K kernel and the pair, at each part size of
`--split-part`. `--tf32` allows TensorFloat-32 tensor cores for the float32 kernels (and cuDNN's).

Method: each kernel runs on scratch buffers filled with random values (codegen/opt/search.py's helpers); a figure is
the fastest of `--iters` device-timed launches after one warm-up. Every variant and BEAM's winner is checked
against the unoptimized kernel on the same random inputs ("ok" / "WRONG"); a variant whose opts do not apply says
why. Run on a CUDA machine from the repository root:
  python extra/bench/bench_conv_kernels.py                 # mnist kernels, the 56x56 convs, BEAM=2 on each
  python extra/bench/bench_conv_kernels.py --beam 0 --parts-sweep
  python extra/bench/bench_conv_kernels.py --beam 0 --wgrad --split-part 256,512 --rows hand,group
  python extra/bench/bench_conv_kernels.py --beam 0 --only mnist --kernels r_256_16_12_12_32_5_5 --rows "hand|tile"
The MNIST kernels take MNIST_TILE_VARIANTS (halo tiles of several shapes); a halo-tiled hand-coded kernel also runs
with the halo layouts before: ranges padded to whole rounds ("spans in whole rounds"), and also the last fill
round guarded ("last round guarded": halo_tiles.WRAP_LAST_ROUND off, as before this session).
`--device PYTHON` (with EMULATE=CUDA) checks the script and the variants' results without a GPU (slow: use
`--only mnist --scale 3`).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's ourgrad
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import ourgrad  # noqa: E402
import ourgrad.codegen.halo_tiles as halo_tiles  # noqa: E402
import ourgrad.lazy_reduce as lazy_reduce  # noqa: E402
from ourgrad.codegen.opt import split_reduce  # noqa: E402
import ourgrad.tensor_conv as tensor_conv  # noqa: E402
from ourgrad import Tensor, dtypes  # noqa: E402
from ourgrad.codegen.kernel import Kernel, KernelOptError, Opt, OptOps, matmul_operands  # noqa: E402
from ourgrad.codegen.opt import heuristic  # noqa: E402
from ourgrad.codegen.opt.conv_tiles import (ConvTile, WeightGradientTile, shared_conv_tiles,  # noqa: E402
                                            weight_gradient_tiles)
from ourgrad.codegen.opt.cpu_tiles import matmul_like  # noqa: E402
from ourgrad.codegen.opt.plans import strategies_left_out  # noqa: E402
from ourgrad.codegen.opt.search import apply_opts, beam_search, random_fill, scratch_buffers, verify_kernel  # noqa
from ourgrad.device import Device  # noqa: E402
from ourgrad.engine.realize import compile_kernel, get_kernel  # noqa: E402
from ourgrad.engine.schedule import create_schedule  # noqa: E402
from ourgrad.ops import LazyOp, Ops  # noqa: E402

U, L, R, G, S, T = OptOps.UPCAST, OptOps.LOCAL, OptOps.UNROLL, OptOps.GROUP, OptOps.SHARED, OptOps.TC

# explicit opt lists per unoptimized kernel name (Kernel.name before any opt)
VARIANTS: dict[str, dict[str, list[Opt]]] = {
  # conv2d 64x64x56x56, 64 3x3 filters, pad 1: (batch, cout, 56*56 | cin, kh, kw); a block of 64 cout x 64 output
  # pixels (of 1 or 2 images), 4x4 (4x4x2) outputs per thread, both operands staged in local memory, cin steps of 8
  # or 16; or register tiles alone
  "r_64_64_3136_64_3_3": {
    "shared 64x64 k8": [Opt(U, 2, 4), Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 16), Opt(S, 0, 0), Opt(R, 0, 8)],
    "shared 64x64 k16": [Opt(U, 2, 4), Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 16), Opt(S, 0, 0), Opt(R, 0, 16)],
    "shared 64x64 x2 images k8": [Opt(U, 2, 4), Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 16), Opt(U, 0, 2),
                                  Opt(S, 0, 0), Opt(R, 0, 8)],
    "shared 64x64 k8 kw": [Opt(U, 2, 4), Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 16), Opt(S, 0, 0), Opt(R, 0, 8),
                           Opt(R, 1, 3)],
    # the window unrolled whole: one reduce loop, so the tiles are double buffered (register prefetch)
    "shared 64x64 k4, kh kw unrolled": [Opt(U, 2, 4), Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 16), Opt(S, 0, 0),
                                        Opt(R, 0, 4), Opt(R, 1, 3), Opt(R, 1, 3)],
    "shared 64x64 k2, kh kw unrolled": [Opt(U, 2, 4), Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 16), Opt(S, 0, 0),
                                        Opt(R, 0, 2), Opt(R, 1, 3), Opt(R, 1, 3)],
    # 8x8 outputs per thread (4 pixels x 2 images x 8 channels: 4 FMAs per float read from the tiles, twice the 4x4
    # tile's), 16 x 8 threads: 128 pixels (of 2 images) x 64 channels per block
    "shared 8x8 (2 images) k8": [Opt(U, 2, 4), Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 8), Opt(U, 1, 2), Opt(U, 0, 2),
                                 Opt(S, 0, 0), Opt(R, 0, 8)],
    "shared 8x8 (2 images) k2, kh kw unrolled": [Opt(U, 2, 4), Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 8), Opt(U, 1, 2),
                                                 Opt(U, 0, 2), Opt(S, 0, 0), Opt(R, 0, 2), Opt(R, 1, 3), Opt(R, 1, 3)],
    # float16 (tensor cores; the float32 conv reports these n/a): after TC the axes are (batch, cout/8, pixels/16 |
    # cin/16, kh, kw); the hand-coded kernel is TC, UPCAST 1 4, UPCAST 2 2, LOCAL 1 2, LOCAL 1 2 (64x64 per block)
    "tc hand + unroll kw": [Opt(T, 0, 0), Opt(U, 1, 4), Opt(U, 2, 2), Opt(L, 1, 2), Opt(L, 1, 2), Opt(R, 2, 3)],
    "tc hand + unroll cin 2": [Opt(T, 0, 0), Opt(U, 1, 4), Opt(U, 2, 2), Opt(L, 1, 2), Opt(L, 1, 2), Opt(R, 0, 2)],
    "tc warp 4x4 tiles, 2x2 warps (2 images)": [Opt(T, 0, 0), Opt(U, 1, 4), Opt(U, 2, 4), Opt(L, 1, 2), Opt(L, 0, 2)],
    "tc warp 2x8 tiles, 2x2 warps": [Opt(T, 0, 0), Opt(U, 1, 8), Opt(U, 1, 2), Opt(L, 1, 2), Opt(L, 0, 2)],
    "tc warp 2x4 tiles, 4x2 warps": [Opt(T, 0, 0), Opt(U, 1, 4), Opt(U, 2, 2), Opt(L, 1, 2), Opt(L, 1, 2),
                                     Opt(L, 0, 2)],
    # tensor cores with both tiles staged (cp.async where contiguous, else element by element; the reduce loops walked
    # as one flat loop of steps)
    "tc staged, hand warps": [Opt(T, 0, 0), Opt(U, 1, 4), Opt(U, 2, 2), Opt(L, 1, 2), Opt(L, 1, 2), Opt(S, 0, 0)],
    "tc staged, hand warps, cin steps of 32": [Opt(T, 0, 0), Opt(U, 1, 4), Opt(U, 2, 2), Opt(L, 1, 2), Opt(L, 1, 2),
                                               Opt(R, 0, 2), Opt(S, 0, 0)],
    "tc staged, hand warps, cin steps of 64": [Opt(T, 0, 0), Opt(U, 1, 4), Opt(U, 2, 2), Opt(L, 1, 2), Opt(L, 1, 2),
                                               Opt(R, 0, 4), Opt(S, 0, 0)],
    "tc staged, 8 warps (2 images), cin steps of 32": [Opt(T, 0, 0), Opt(U, 1, 4), Opt(U, 2, 2), Opt(L, 1, 2),
                                                       Opt(L, 1, 2), Opt(L, 0, 2), Opt(R, 0, 2), Opt(S, 0, 0)],
    "tc staged, warp 4x4 tiles (2 images), cin steps of 32": [Opt(T, 0, 0), Opt(U, 1, 4), Opt(U, 2, 4), Opt(L, 1, 2),
                                                              Opt(L, 0, 2), Opt(R, 0, 2), Opt(S, 0, 0)],
    "regs 4x4 16x16": [Opt(U, 2, 4), Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 16)],
    "regs 4x4 16x16 unroll kw": [Opt(U, 2, 4), Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 16), Opt(R, 2, 3)],
  },
}


# the first split-K kernel of a weight gradient, by rank of its plain shape: MNIST conv2's (parts, cout 32, cin 16,
# 5, 5 | images per part, 8, 8) and conv1's (parts, cout 16, 5, 5 | 24, 24; cin 1 is dropped), for any part count.
# A thread's register tile is a filter row (UPCAST kw 5) x cout; its lanes along cin/cout (LOCAL), or also along an
# image row or column (GROUP: coalesced loads, partials combined by warp shuffles, 8x the threads)
KW5 = Opt(U, 4, 5)   # conv2's filter row (kw), upcast whole
WEIGHT_GRADIENT_VARIANTS: dict[int, dict[str, list[Opt]]] = {
  8: {
    "group ow": [Opt(U, 2, 4), Opt(U, 1, 4), Opt(L, 2, 4), Opt(L, 1, 8), Opt(G, 2, 0)],
    "group oh ow": [Opt(U, 2, 4), Opt(U, 1, 4), Opt(L, 2, 4), Opt(G, 1, 0), Opt(G, 1, 0)],
    "upcast kw 5, locals cin 16 cout 8": [KW5, Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 8), Opt(R, 2, 4)],
    "upcast kw 5, locals cin 16 cout 8, unroll ow 8": [KW5, Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 8), Opt(R, 2, 0)],
    "upcast kw 5 cout 8, locals cin 16 cout 4": [KW5, Opt(U, 1, 8), Opt(L, 2, 16), Opt(L, 1, 4), Opt(R, 2, 4)],
    "upcast kw 5 cout 2, locals cin 16 cout 16": [KW5, Opt(U, 1, 2), Opt(L, 2, 16), Opt(L, 1, 16), Opt(R, 2, 4)],
    "upcast kw 5, locals cin 16 cout 8, group oh 2": [KW5, Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 8), Opt(G, 1, 2),
                                                      Opt(R, 2, 4)],
    "upcast kw 5, locals cin 8 cout 8, group oh 2": [KW5, Opt(U, 1, 4), Opt(L, 2, 8), Opt(L, 1, 8), Opt(G, 1, 2),
                                                     Opt(R, 2, 4)],
    "upcast kw 5, locals cin 16 cout 8, group n 2": [KW5, Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 8), Opt(G, 0, 2),
                                                     Opt(R, 2, 4)],
    "upcast kw 5, locals cin 4 cout 8, group ow": [KW5, Opt(U, 1, 4), Opt(L, 2, 4), Opt(L, 1, 8), Opt(G, 2, 0)],
    "upcast kw 5, locals cin 8 cout 4, group ow": [KW5, Opt(U, 1, 4), Opt(L, 2, 8), Opt(L, 1, 4), Opt(G, 2, 0)],
    "upcast kw 5, locals cin 16 cout 2, group ow": [KW5, Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 2), Opt(G, 2, 0)],
    "upcast kw 5, locals cin 2 cout 8, group ow": [KW5, Opt(U, 1, 4), Opt(L, 2, 2), Opt(L, 1, 8), Opt(G, 2, 0)],
    "upcast kw 5, locals cin 4 cout 4, group ow": [KW5, Opt(U, 1, 4), Opt(L, 2, 4), Opt(L, 1, 4), Opt(G, 2, 0)],
    "upcast kw 5 cout 8, locals cin 4 cout 4, group ow": [KW5, Opt(U, 1, 8), Opt(L, 2, 4), Opt(L, 1, 4),
                                                          Opt(G, 2, 0)],
    "upcast kw 5 cout 8, locals cin 8 cout 2, group ow": [KW5, Opt(U, 1, 8), Opt(L, 2, 8), Opt(L, 1, 2),
                                                          Opt(G, 2, 0)],
    "upcast kw 5 cout 2, locals cin 4 cout 16, group ow": [KW5, Opt(U, 1, 2), Opt(L, 2, 4), Opt(L, 1, 16),
                                                           Opt(G, 2, 0)],
    "upcast kw 5, locals cin 4 cout 8, group ow 4 unroll 2": [KW5, Opt(U, 1, 4), Opt(L, 2, 4), Opt(L, 1, 8),
                                                              Opt(G, 2, 4), Opt(R, 2, 0)],
    "upcast kw 5, locals cin 8 cout 8, group ow 4 unroll 2": [KW5, Opt(U, 1, 4), Opt(L, 2, 8), Opt(L, 1, 8),
                                                              Opt(G, 2, 4), Opt(R, 2, 0)],
    "upcast kw 5, locals cin 4 cout 8, group oh, unroll ow 8": [KW5, Opt(U, 1, 4), Opt(L, 2, 4), Opt(L, 1, 8),
                                                                Opt(G, 1, 0), Opt(R, 1, 0)],
    "upcast kw 5, locals cin 8 cout 4, group oh, unroll ow 8": [KW5, Opt(U, 1, 4), Opt(L, 2, 8), Opt(L, 1, 4),
                                                                Opt(G, 1, 0), Opt(R, 1, 0)],
    "upcast kw 5, locals cin 4 cout 8, group oh, unroll ow 4": [KW5, Opt(U, 1, 4), Opt(L, 2, 4), Opt(L, 1, 8),
                                                                Opt(G, 1, 0), Opt(R, 1, 4)],
    "upcast kw 5, locals cin 16 cout 2, group oh, unroll ow 8": [KW5, Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 2),
                                                                 Opt(G, 1, 0), Opt(R, 1, 0)],
    "upcast kw 5, locals cin 2 cout 8, group oh, unroll ow 8": [KW5, Opt(U, 1, 4), Opt(L, 2, 2), Opt(L, 1, 8),
                                                                Opt(G, 1, 0), Opt(R, 1, 0)],
    "upcast kw 5, locals cin 4 cout 4, group oh, unroll ow 8": [KW5, Opt(U, 1, 4), Opt(L, 2, 4), Opt(L, 1, 4),
                                                                Opt(G, 1, 0), Opt(R, 1, 0)],
    "upcast kw 5, locals cin 4 cout 8, group oh 4, unroll ow 8": [KW5, Opt(U, 1, 4), Opt(L, 2, 4), Opt(L, 1, 8),
                                                                  Opt(G, 1, 4), Opt(R, 2, 0)],
    "upcast kw 5 cout 8, locals cin 4 cout 4, group oh, unroll ow 4": [KW5, Opt(U, 1, 8), Opt(L, 2, 4), Opt(L, 1, 4),
                                                                       Opt(G, 1, 0), Opt(R, 1, 4)],
    "upcast kw 5, locals cin 4 cout 8, group n 2 oh, unroll ow 8": [KW5, Opt(U, 1, 4), Opt(L, 2, 4), Opt(L, 1, 8),
                                                                    Opt(G, 1, 0), Opt(G, 0, 2), Opt(R, 1, 0)],
    "upcast kw 5, locals cin 8 cout 8, group oh, unroll ow 8": [KW5, Opt(U, 1, 4), Opt(L, 2, 8), Opt(L, 1, 8),
                                                                Opt(G, 1, 0), Opt(R, 1, 0)],
    # the window's rows as threads of one block (each gradient value loaded once per block, not once per row)
    "upcast kw 5, locals kh 5 cin 2 cout 4, group oh, unroll ow 8": [KW5, Opt(U, 1, 4), Opt(L, 3, 5), Opt(L, 2, 2),
                                                                     Opt(L, 1, 4), Opt(G, 1, 0), Opt(R, 1, 0)],
    "upcast kw 5, locals kh 5 cin 4 cout 4, group oh 4, unroll ow 8": [KW5, Opt(U, 1, 4), Opt(L, 3, 5), Opt(L, 2, 4),
                                                                       Opt(L, 1, 4), Opt(G, 1, 4), Opt(R, 2, 0)],
    # around the hand-coded tile (kh 5 cin 4 cout 4 threads, GROUP oh 4, ow 8 unrolled)
    "upcast kw 5, locals kh 5 cin 2 cout 8, group oh 4, unroll ow 8": [KW5, Opt(U, 1, 4), Opt(L, 3, 5), Opt(L, 2, 2),
                                                                       Opt(L, 1, 8), Opt(G, 1, 4), Opt(R, 2, 0)],
    "upcast kw 5, locals kh 5 cin 8 cout 2, group oh 4, unroll ow 8": [KW5, Opt(U, 1, 4), Opt(L, 3, 5), Opt(L, 2, 8),
                                                                       Opt(L, 1, 2), Opt(G, 1, 4), Opt(R, 2, 0)],
    "upcast kw 5, locals kh 5 cin 4 cout 4, group oh 2, unroll ow 8": [KW5, Opt(U, 1, 4), Opt(L, 3, 5), Opt(L, 2, 4),
                                                                       Opt(L, 1, 4), Opt(G, 1, 2), Opt(R, 2, 0)],
    "upcast kw 5, locals kh 5 cin 4 cout 2, group oh 4, unroll ow 8": [KW5, Opt(U, 1, 4), Opt(L, 3, 5), Opt(L, 2, 4),
                                                                       Opt(L, 1, 2), Opt(G, 1, 4), Opt(R, 2, 0)],
    "upcast kw 5 cout 2, locals kh 5 cin 4 cout 8, group oh 4, unroll ow 8": [KW5, Opt(U, 1, 2), Opt(L, 3, 5),
                                                                              Opt(L, 2, 4), Opt(L, 1, 8), Opt(G, 1, 4),
                                                                              Opt(R, 2, 0)],
    "upcast kw 5 cout 8, locals kh 5 cin 4 cout 2, group oh 4, unroll ow 4": [KW5, Opt(U, 1, 8), Opt(L, 3, 5),
                                                                              Opt(L, 2, 4), Opt(L, 1, 2), Opt(G, 1, 4),
                                                                              Opt(R, 2, 4)],
    "upcast kw 5, locals kh 5 cin 4 cout 4, group oh 4, unroll ow 4": [KW5, Opt(U, 1, 4), Opt(L, 3, 5), Opt(L, 2, 4),
                                                                       Opt(L, 1, 4), Opt(G, 1, 4), Opt(R, 2, 4)],
    "shared: upcast kw 5, locals cin 16 cout 8, step ow 8": [KW5, Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 8),
                                                             Opt(S, 0, 0), Opt(R, 2, 0)],
    "shared: upcast kw 5, locals cin 16 cout 8, step oh ow": [KW5, Opt(U, 1, 4), Opt(L, 2, 16), Opt(L, 1, 8),
                                                              Opt(S, 0, 0), Opt(R, 2, 0), Opt(R, 1, 0)],
    "shared: locals kw 5 cin 4 cout 8, step ow 8": [Opt(U, 2, 4), Opt(U, 1, 4), Opt(L, 4, 5), Opt(L, 2, 4),
                                                    Opt(L, 1, 8), Opt(S, 0, 0), Opt(R, 2, 8)],
  },
  # conv1 with parts of 2 images (a part size of 1024): (parts, cout 16, 5, 5 | 2, 24, 24)
  7: {
    "upcast kw 5, group ow": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(G, 2, 0)],
    "upcast kw 5, group ow 8": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(G, 2, 8)],
    "upcast kw 5, locals cout 4, group oh 4 ow 8": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(G, 1, 4),
                                                    Opt(G, 2, 8)],
    "upcast kw 5, locals cout 4, group oh 8 ow 8": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(G, 1, 8),
                                                    Opt(G, 2, 8)],
    "upcast kw 5, locals cout 4, group oh 8, unroll ow 8": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(G, 1, 8),
                                                            Opt(R, 2, 8)],
  },
  6: {
    "upcast kw 5, group ow": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(G, 1, 0)],
    "upcast kw 5, group oh 4 ow": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(G, 0, 4), Opt(G, 1, 0)],
    "upcast kw 5 kh 5, group ow": [Opt(U, 3, 5), Opt(U, 2, 5), Opt(U, 1, 2), Opt(L, 1, 8), Opt(G, 1, 0)],
    "upcast kw 5, group ow 8": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(G, 1, 8)],
    "upcast kw 5, group ow 8, unroll 3": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(G, 1, 8), Opt(R, 1, 0)],
    "upcast kw 5, cout 8 threads, group ow 8": [Opt(U, 3, 5), Opt(U, 1, 2), Opt(L, 1, 8), Opt(G, 1, 8)],
    "upcast kw 5 cout 8, group ow 8": [Opt(U, 3, 5), Opt(U, 1, 8), Opt(L, 1, 2), Opt(G, 1, 8)],
    "upcast kw 5, locals cout 4, group oh 4 ow 8": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(G, 0, 4),
                                                    Opt(G, 1, 8)],
    "upcast kw 5, locals cout 4, group oh 8 ow 8": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(G, 0, 8),
                                                    Opt(G, 1, 8)],
    "upcast kw 5, locals cout 4, group oh 2 ow, unroll oh 3": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(G, 0, 2),
                                                               Opt(G, 1, 0), Opt(R, 0, 3)],
    "upcast kw 5 cout 16, group ow": [Opt(U, 3, 5), Opt(U, 1, 0), Opt(G, 1, 0)],
    "upcast kw 5 cout 8, group ow": [Opt(U, 3, 5), Opt(U, 1, 8), Opt(L, 1, 2), Opt(G, 1, 0)],
    "upcast kw 5 kh 5 cout 4, group ow 8": [Opt(U, 3, 5), Opt(U, 2, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(G, 1, 8)],
    "upcast kw 5, group oh 2 ow 8": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(G, 0, 2), Opt(G, 1, 8)],
    "upcast kw 5 cout 8, group oh 4 ow 8": [Opt(U, 3, 5), Opt(U, 1, 8), Opt(L, 1, 2), Opt(G, 0, 4), Opt(G, 1, 8)],
    "upcast kw 5, locals cout 4, group oh 8, unroll ow 8": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(G, 0, 8),
                                                            Opt(R, 1, 8)],
    "upcast kw 5, locals cout 4, group oh 8, unroll ow 4": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(G, 0, 8),
                                                            Opt(R, 1, 4)],
    "upcast kw 5 cout 2, locals cout 8, group oh 8, unroll ow 8": [Opt(U, 3, 5), Opt(U, 1, 2), Opt(L, 1, 8),
                                                                   Opt(G, 0, 8), Opt(R, 1, 8)],
    "upcast kw 5, locals cout 4, group oh 8 ow 2, unroll ow 4": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4),
                                                                 Opt(G, 0, 8), Opt(G, 1, 2), Opt(R, 1, 4)],
    "upcast kw 5, locals kh 5 cout 4, group ow 8": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 2, 5), Opt(L, 1, 4),
                                                    Opt(G, 1, 8)],
    "upcast kw 5, locals kh 5 cout 4, group oh 8, unroll ow 8": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 2, 5),
                                                                 Opt(L, 1, 4), Opt(G, 0, 8), Opt(R, 1, 8)],
    "upcast kw 5, locals kh 5 cout 4, group oh 2 ow 8": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 2, 5), Opt(L, 1, 4),
                                                         Opt(G, 0, 2), Opt(G, 1, 8)],
    "upcast kw 5 kh 5 cout 2, locals cout 8, group oh 8, unroll ow 4": [Opt(U, 3, 5), Opt(U, 2, 5), Opt(U, 1, 2),
                                                                        Opt(L, 1, 8), Opt(G, 0, 8), Opt(R, 1, 4)],
    "upcast kw 5, locals kh 5 cout 2, group oh 2 ow 8": [Opt(U, 3, 5), Opt(U, 1, 8), Opt(L, 2, 5), Opt(L, 1, 2),
                                                         Opt(G, 0, 2), Opt(G, 1, 8)],
    "upcast kw 5, locals kh 5 cout 4, group oh 2 ow 8, unroll oh 2": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 2, 5),
                                                                      Opt(L, 1, 4), Opt(G, 0, 2), Opt(G, 1, 8),
                                                                      Opt(R, 0, 2)],
    "upcast kw 5, locals kh 5 cout 4, group oh 2 ow 8, unroll ow 3": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 2, 5),
                                                                      Opt(L, 1, 4), Opt(G, 0, 2), Opt(G, 1, 8),
                                                                      Opt(R, 1, 0)],
    "upcast kw 5, locals kh 5 cout 4, group oh 2 ow 4, unroll ow 2": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 2, 5),
                                                                      Opt(L, 1, 4), Opt(G, 0, 2), Opt(G, 1, 4),
                                                                      Opt(R, 1, 2)],
    "upcast kw 5, unroll ow 8, locals cout 4 parts 8": [Opt(U, 3, 5), Opt(U, 1, 4), Opt(L, 1, 4), Opt(L, 0, 8),
                                                        Opt(R, 1, 8)],
  },
}


def is_weight_gradient_part(plain: Kernel) -> bool:
  """The first kernel of a split weight gradient: an output axis (the parts) along both operands of the product."""
  try: a, b = matmul_operands(plain.reduceop, dtypes.float32, dtypes.float32, "bench")
  except (KernelOptError, AttributeError): return False
  m_axes, n_axes, _ = plain.matmul_axes(a, b)
  return len(m_axes) + len(n_axes) < plain.first_reduce


# conv tiles (conv_tiles.ConvTile: pixel upcast, pixel threads, channel upcast, channel threads, reduce step) tried on
# every convolution kernel they fit, beside the heuristic's own list (conv_tiles.CONV_TILES)
TILE_VARIANTS = (ConvTile(4, 16, 4, 16, 4), ConvTile(4, 16, 4, 16, 16), ConvTile(8, 16, 4, 16, 8),
                 ConvTile(4, 16, 8, 8, 8), ConvTile(4, 32, 4, 8, 8), ConvTile(4, 16, 4, 8, 16), ConvTile(4, 8, 4, 8, 8),
                 ConvTile(2, 16, 4, 8, 8), ConvTile(4, 16, 2, 16, 8),
                 # the 8x8 tile (128 pixels of 2 images x 64 channels) as before the halo tiles, then with padded
                 # tile rows (fewer bank conflicts in the weight tile's fill), and with the window unrolled (the input
                 # a halo tile staged once for all 9 taps) at 2 to 8 input channels a step; the 4x4 tile with a halo
                 ConvTile(4, 16, 4, 8, 8, pixel_repeat=2, channel_repeat=2),
                 ConvTile(4, 16, 4, 8, 8, pixel_repeat=2, channel_repeat=2, padding=4),
                 *(ConvTile(4, 16, 4, 8, step, pixel_repeat=2, channel_repeat=2, window_unrolled=True, padding=padding)
                   for step in (2, 4, 8) for padding in (0, 4)),
                 ConvTile(4, 16, 4, 16, 4, window_unrolled=True, padding=4),
                 # the hand-coded 8x8 halo tile filled by asynchronous copies (cp.async) in 2 and 3 stages
                 *(ConvTile(4, 16, 4, 8, 2, pixel_repeat=2, channel_repeat=2, window_unrolled=True, padding=4,
                            async_stages=stages) for stages in (2, 3)))


# halo tiles (window unrolled) for MNIST's conv2 forward (pixels: batch 256 x 8 x 8, 32 channels, 16 input channels
# x 5 x 5) and input gradient (pixels: batch 256 x 12 x 12, 16 channels, reduce 32 x 5 x 5 over the unpadded output
# gradient): the tile sides, steps of 2 or 4 channels, padded rows or not, 4x4 / 4x8 / 8x4 outputs per thread
def _halo(pixel_upcast: int, pixel_threads: int, channel_upcast: int, channel_threads: int, step: int,
          pixel_repeat: int = 1, channel_repeat: int = 1, padding: int = 4, any_split: bool = False,
          async_stages: int = 0, groups: int = 0) -> ConvTile:
  return ConvTile(pixel_upcast, pixel_threads, channel_upcast, channel_threads, step, pixel_repeat=pixel_repeat,
                  channel_repeat=channel_repeat, window_unrolled=True, padding=padding, any_thread_split=any_split,
                  async_stages=async_stages, reduce_groups=groups)


MNIST_TILE_VARIANTS = (
  # the tiles these kernels took before the halo tiles (forward, input gradient): the window's loops outside the step
  ConvTile(4, 16, 4, 8, 8), ConvTile(4, 32, 4, 4, 8),
  # forward: 64 pixels (one image) x 32 channels (128 threads), then the step, the padding, other block shapes. The
  # tiles are double buffered (register prefetch) only where each fills in whole rounds of the block's threads: the
  # filter tile (32 channels x step x 25 taps) at 128 threads in steps of 4, at 64 threads in steps of 2
  _halo(4, 16, 4, 8, 2), _halo(4, 16, 4, 8, 4), _halo(4, 16, 4, 8, 2, padding=0),
  _halo(4, 32, 4, 8, 2), _halo(4, 16, 4, 4, 2), _halo(4, 8, 4, 8, 2), _halo(4, 16, 4, 4, 2, channel_repeat=2),
  _halo(4, 16, 4, 8, 2, pixel_repeat=2), _halo(2, 32, 4, 8, 2), _halo(2, 32, 4, 4, 2, channel_repeat=2),
  # input gradient: 4x4 pixels of 8 images x 16 channels (128 threads), then the step, the padding, other shapes
  # (double buffered: 128 threads in steps of 8, 64 in steps of 4, 32 in steps of 2)
  _halo(4, 32, 4, 4, 2), _halo(4, 32, 4, 4, 4), _halo(4, 32, 4, 4, 8), _halo(4, 32, 4, 4, 2, padding=0),
  _halo(4, 16, 4, 4, 2), _halo(4, 16, 4, 4, 4), _halo(4, 8, 4, 4, 2), _halo(4, 64, 4, 4, 2),
  _halo(4, 16, 4, 4, 2, pixel_repeat=2), _halo(4, 16, 4, 4, 4, pixel_repeat=2), _halo(4, 32, 4, 2, 2, channel_repeat=2),
  _halo(4, 32, 4, 4, 2, pixel_repeat=2), _halo(2, 64, 4, 4, 2),
  # input gradient, 3 threads x 4 outputs along a 12-pixel row (any_thread_split): 2 images x 4 rows x 12 (96
  # threads, 384 blocks: 3 a multiprocessor), a whole image (144 threads, 256 blocks, no pixel loaded by two blocks),
  # 4 rows of an image (48 threads, 768 blocks); 8x4 and 4x8 outputs per thread on 384 blocks
  _halo(4, 24, 4, 4, 2, any_split=True), _halo(4, 36, 4, 4, 2, any_split=True), _halo(4, 12, 4, 4, 2, any_split=True),
  _halo(4, 12, 4, 4, 2, pixel_repeat=2, any_split=True), _halo(4, 24, 4, 2, 2, channel_repeat=2, any_split=True),
  _halo(4, 24, 4, 4, 4, any_split=True),
  # the tiles filled by asynchronous copies (cp.async, in 2 to 4 stages: ptxas moves the register prefetch's global
  # loads down to their shared stores, after the math, so those wait out the loads' latency every step)
  *(_halo(*shape, any_split=split, async_stages=stages) for shape, split in
    [((4, 24, 4, 4, 2), True), ((4, 36, 4, 4, 2), True), ((4, 32, 4, 4, 2), False), ((4, 8, 4, 4, 2), False),
     ((4, 64, 4, 4, 2), False), ((4, 32, 4, 4, 4), False), ((4, 16, 4, 8, 2), False), ((4, 32, 4, 8, 2), False)]
    for stages in (2, 3)),
  # the input channels split over 2 or 4 GROUP threads (twice or 4 times the warps), loads or 3 async stages
  *(_halo(*shape, any_split=split, async_stages=stages, groups=groups) for shape, split in
    [((4, 24, 4, 4, 2), True), ((4, 36, 4, 4, 2), True), ((4, 32, 4, 4, 2), False), ((4, 64, 4, 4, 2), False),
     ((4, 16, 4, 8, 2), False), ((4, 32, 4, 4, 4), False)]
    for stages in (0, 3) for groups in (2, 4)),
  # around the input gradient's hand-coded tile (run 2: 2 GROUP threads, 37.9 us): steps of 4, smaller blocks, 8x4
  # outputs per thread
  _halo(4, 24, 4, 4, 4, any_split=True, groups=2), _halo(4, 12, 4, 4, 2, any_split=True, groups=2),
  _halo(4, 12, 4, 4, 2, pixel_repeat=2, any_split=True, groups=2), _halo(4, 8, 4, 4, 2, groups=2),
  _halo(4, 16, 4, 4, 2, groups=2), _halo(4, 24, 4, 2, 2, channel_repeat=2, any_split=True, groups=2),
)


# row labels' marks for a halo-tiled kernel compiled with the layouts before: ranges padded to whole rounds of the
# threads (halo_tiles.SPAN_PADDING "rounds"), and also the fills' last partial round behind an `if`
# (halo_tiles.WRAP_LAST_ROUND off: the tiles are double buffered only where every one fills in whole rounds), or
# that guard with the bank padding
ROUND_SPANS, SINGLE_STAGE, GUARDED_BANKS = "spans in whole rounds", "last round guarded", "guarded, bank spans"


def _halo_settings(label: str) -> tuple[bool, str]:
  """(halo_tiles.WRAP_LAST_ROUND, halo_tiles.SPAN_PADDING) a row is compiled with."""
  if SINGLE_STAGE in label: return False, "rounds"
  if GUARDED_BANKS in label: return False, "banks"
  return True, "rounds" if ROUND_SPANS in label else "banks"


# weight-gradient tiles (conv_tiles.WeightGradientTile) tried on both partial-sums kernels where they apply, beside the
# heuristic's list (conv_tiles.WEIGHT_GRADIENT_TILES): more GROUP threads per block (legal since GROUP's local memory
# counts only what warp shuffles leave), wider cout register tiles (more FMAs per load), the filter rows as threads
WGT = WeightGradientTile
WEIGHT_GRADIENT_TILE_VARIANTS = (
  # conv2 (parts of 8 images, 8x8 gradient rows)
  WGT(cin_threads=4, cout_threads=4, row_group=4, column_unroll=0, filter_rows_local=True),
  WGT(cin_threads=4, cout_threads=4, row_group=8, column_unroll=0, filter_rows_local=True),
  WGT(cin_threads=8, cout_threads=2, row_group=4, column_unroll=0, filter_rows_local=True),
  WGT(cin_threads=8, cout_threads=2, row_group=8, column_unroll=0, filter_rows_local=True),
  WGT(cin_threads=2, cout_threads=4, row_group=8, column_unroll=0, filter_rows_local=True),
  # the image row's columns unrolled by 4, not 8: fewer registers (more blocks per SM)
  WGT(cin_threads=4, cout_threads=4, row_group=4, column_unroll=4, filter_rows_local=True),
  WGT(cin_threads=2, cout_threads=4, row_group=8, column_unroll=4, filter_rows_local=True),
  WGT(cin_threads=2, cout_threads=2, row_group=8, column_unroll=4, filter_rows_local=True),
  WGT(cin_threads=1, cout_threads=4, row_group=8, column_unroll=4, filter_rows_local=True),
  WGT(cin_threads=1, cout_threads=4, row_group=8, column_unroll=0, filter_rows_local=True),
  WGT(cout_upcast=8, cin_threads=4, cout_threads=4, row_group=4, column_unroll=4, filter_rows_local=True),
  WGT(cout_upcast=8, cin_threads=4, cout_threads=2, row_group=4, column_unroll=4, filter_rows_local=True),
  WGT(cout_upcast=8, cin_threads=4, cout_threads=2, row_group=8, column_unroll=4, filter_rows_local=True),
  WGT(cout_upcast=8, cin_threads=2, cout_threads=4, row_group=8, column_unroll=4, filter_rows_local=True),
  WGT(cout_upcast=8, cin_threads=4, cout_threads=4, row_group=8, column_unroll=4, filter_rows_local=True),
  # 2 output channels a thread (10 accumulators, 48 registers: 4 blocks of 320 threads per SM, 2x the warps)
  WGT(cout_upcast=2, cin_threads=4, cout_threads=4, row_group=4, column_unroll=0, filter_rows_local=True),
  WGT(cout_upcast=2, cin_threads=4, cout_threads=8, row_group=4, column_unroll=0, filter_rows_local=True),
  WGT(cout_upcast=2, cin_threads=2, cout_threads=8, row_group=4, column_unroll=0, filter_rows_local=True),
  WGT(cout_upcast=2, cin_threads=4, cout_threads=4, row_group=4, column_unroll=4, filter_rows_local=True),
  WGT(cout_upcast=2, cin_threads=2, cout_threads=4, row_group=8, column_unroll=0, filter_rows_local=True),
  # conv1 (parts of 1 image, 24x24 gradient rows)
  WGT(cout_upcast=2, cout_threads=8, row_group=8, column_unroll=8, filter_rows_local=True),
  WGT(cout_upcast=2, cout_threads=4, row_group=8, column_unroll=8, filter_rows_local=True),
  WGT(cout_upcast=2, cout_threads=8, row_group=4, column_group=8, column_unroll=1, filter_rows_local=True),
  WGT(cout_threads=4, row_group=2, column_group=8, column_unroll=1, filter_rows_local=True),
  WGT(cout_threads=4, row_group=4, column_group=8, column_unroll=1, filter_rows_local=True),
  WGT(cout_threads=2, row_group=4, column_group=8, column_unroll=1, filter_rows_local=True),
  WGT(cout_threads=1, row_group=4, column_group=8, column_unroll=1, filter_rows_local=True),
  WGT(cout_threads=2, row_group=2, column_group=8, column_unroll=1, filter_rows_local=True),
  WGT(cout_upcast=8, cout_threads=2, row_group=4, column_group=8, column_unroll=1, filter_rows_local=True),
  WGT(cout_threads=4, row_group=8, column_unroll=8, filter_rows_local=True),
  WGT(cout_threads=4, row_group=8, column_unroll=4, filter_rows_local=True),
  WGT(cout_upcast=8, cout_threads=2, row_group=8, column_unroll=4, filter_rows_local=True),
  WGT(cout_threads=4, row_group=8, column_group=2, column_unroll=4, filter_rows_local=True),
  WGT(cout_threads=2, row_group=8, column_group=2, column_unroll=4, filter_rows_local=True),
  WGT(cout_threads=4, row_group=8, column_group=4, column_unroll=2, filter_rows_local=True),
)


def weight_gradient_tile_label(tile: WeightGradientTile) -> str:
  """A weight-gradient tile's row label: cout upcast x threads, cin threads, GROUP rows and columns, column unroll
  (0 whole, 1 none), `kh`: the filter rows as threads."""
  label = f"wg co {tile.cout_upcast}x{tile.cout_threads} ci {tile.cin_threads} " \
          f"g {tile.row_group}x{tile.column_group} u {tile.column_unroll}"
  return label + (" kh" if tile.filter_rows_local else "")


def weight_gradient_tiled(plain: Kernel, tile: WeightGradientTile) -> Kernel:
  kernel = plain.copy()
  if not weight_gradient_tiles(kernel, (tile,)): raise KernelOptError("the tile does not fit")
  return kernel


def tile_label(tile: ConvTile) -> str:
  """A tile's row label: outputs x threads per side, the reduce step, then what differs from a plain tile."""
  label = f"tile px {tile.pixel_upcast}x{tile.pixel_threads} ch {tile.channel_upcast}x{tile.channel_threads} " \
          f"k{tile.reduce_step}"
  if tile.pixel_repeat > 1 or tile.channel_repeat > 1: label += f" x{tile.pixel_repeat}x{tile.channel_repeat}"
  if tile.window_unrolled: label += " halo"
  if tile.any_thread_split: label += " any-split"
  if tile.async_stages: label += f" async{tile.async_stages}"
  if tile.reduce_groups: label += f" group{tile.reduce_groups}"
  return label + (f" pad{tile.padding}" if tile.padding else "")


def without_conv_tiles(kernel: Kernel) -> Kernel:
  """The heuristic's choice as it was before the convolution tiles (the shared_conv strategy switched off)."""
  with strategies_left_out(heuristic.STRATEGIES, "shared_conv"): kernel.hand_coded_optimizations()
  return kernel


def tiled(plain: Kernel, tile: ConvTile) -> Kernel:
  kernel = plain.copy()
  if not shared_conv_tiles(kernel, (tile,)): raise KernelOptError("the tile does not fit")
  return kernel


def mnist_step_schedule(scale: int) -> list:
  """The kernel ScheduleItems of one examples/mnist.py training step (nothing runs): the graph is built and
  scheduled."""
  import mnist
  from ourgrad.nn.losses import cross_entropy
  from ourgrad.nn.optim import Adam
  from ourgrad.nn.state import get_parameters
  batch = 256 >> scale
  model = mnist.ConvNet(mnist.MODELS["small"])
  optimizer = Adam([p for p in get_parameters(model) if p.requires_grad], lr=2e-3)
  rng = np.random.default_rng(0)
  with Tensor.train():
    images = Tensor(rng.integers(0, 255, (batch, 1, 28, 28)).astype(np.uint8))
    labels = Tensor(rng.integers(0, 10, batch).astype(np.int32))
    optimizer.zero_grad()
    loss = cross_entropy(model(mnist.normalize(images)), labels)
    loss.backward()
    outs = [loss, *optimizer.schedule_step(), *mnist.batchnorm_buffers(model)]
    schedule = create_schedule([t.lazydata for t in outs])
  return [item for item in schedule if item.ast.op in (Ops.STORE, Ops.PACK)]


def mnist_step_asts(scale: int) -> list[LazyOp]:
  """The kernel ASTs of one examples/mnist.py training step (packed elementwise kernels left out)."""
  return [item.ast for item in mnist_step_schedule(scale) if item.ast.op is Ops.STORE]


def weight_gradients(device: str, scale: int) -> list[tuple[LazyOp, list[LazyOp]]]:
  """The MNIST step's split weight gradients: each first (partial sums) kernel's AST and the ASTs of the kernels
  that read its partials (the second stage; it may be fused with the optimizer's update)."""
  items = mnist_step_schedule(scale)
  pairs = []
  for item in items:
    if item.ast.op is not Ops.STORE: continue
    plain = Kernel(item.ast, Device[device].renderer)
    if plain.reduceop is None or not is_weight_gradient_part(plain): continue
    written = {id(buffer) for buffer in item.outputs}
    readers = [other.ast for other in items if any(id(buffer) in written for buffer in other.inputs)]
    pairs.append((item.ast, readers))
  return pairs


def bench_weight_gradients(device: str, iters: int, scale: int, beam: int, rows: tuple[str, ...]) -> None:
  """The weight gradients alone: each first kernel's hand-coded choice, variants and BEAM's choice, then its second
  stage (hand-coded), and the sum of the hand-coded pair with its GFLOP/s."""
  for partials, readers in weight_gradients(device, scale):
    bench_ast(partials, device, iters, beam, f"weight gradient (split part {split_reduce.MIN_PART_MATMUL}, "
              f"row parts {lazy_reduce.GPU_SPLIT_ROW_PARTS})", rows=rows)
    hand = Kernel(partials, Device[device].renderer)
    hand.hand_coded_optimizations()
    buffers = scratch_buffers(partials, device)
    random_fill(buffers, seed=0)
    flops = compile_kernel(hand, device).op_count
    total = time_kernel(hand, device, buffers, iters)
    for reader in readers:
      kernel = get_kernel(reader, device)
      reader_buffers = scratch_buffers(reader, device)
      random_fill(reader_buffers, seed=0)
      seconds = time_kernel(kernel, device, reader_buffers, iters)
      total += seconds
      row("second stage (hand-coded)", kernel, seconds, flops, "")
    print(f"  {'pair, hand-coded':<44} {hand.name:<38} {total * 1e3:8.4f} {flops / total / 1e9:8.0f}")


def conv_ast(device: str, dtype_name: str, scale: int) -> LazyOp:
  """The forward kernel of conv2d 64x64x56x56 with 64 3x3 filters, pad 1."""
  dtype = getattr(dtypes, dtype_name)
  size = max(56 >> scale, 8)
  x = Tensor.empty(max(64 >> scale, 2), 64, size, size, dtype=dtype, device=device)
  w = Tensor.empty(64, 64, 3, 3, dtype=dtype, device=device)
  return next(item.ast for item in create_schedule([x.conv2d(w, padding=1).lazydata]) if item.ast.op is Ops.STORE)


def time_kernel(kernel: Kernel, device: str, buffers: list, iters: int) -> float:
  runner = compile_kernel(kernel, device)
  runner(buffers, wait=True)
  return min(runner(buffers, wait=True) or 0.0 for _ in range(iters))


def row(label: str, kernel: Kernel | None, seconds: float | None, flops: int, check: str, note: str = "") -> None:
  name = kernel.name if kernel is not None else "-"
  ms = f"{seconds * 1e3:8.4f}" if seconds else f"{'-':>8}"
  rate = f"{flops / seconds / 1e9:8.0f}" if seconds else f"{'-':>8}"
  opts = note or (str(kernel.applied_opts) if kernel is not None else "")
  print(f"  {label:<44} {name:<38} {ms} {rate} {check:<6} {opts}")


def bench_ast(ast: LazyOp, device: str, iters: int, beam: int, label: str, beam_filter: str = "",
              rows: tuple[str, ...] = (), tiles: tuple[ConvTile, ...] = TILE_VARIANTS) -> None:
  """Hand-coded, each variant (`tiles`, then VARIANTS) and BEAM's kernel of one AST (those whose label contains one
  of `rows`, where given): ms, GFLOP/s, checked against the plain kernel."""
  renderer = Device[device].renderer
  plain = Kernel(ast, renderer)
  buffers = scratch_buffers(ast, device)
  random_fill(buffers, seed=0)
  hand = Kernel(ast, renderer)
  hand.hand_coded_optimizations()
  flops = compile_kernel(hand, device).op_count
  print(f"{label}: {plain.name} (plain shape {plain.full_shape})")
  candidates: list[tuple[str, Callable[[], Kernel]]] = [("hand-coded", lambda: hand),
                                                        ("no conv tiles", lambda: without_conv_tiles(plain.copy()))]
  if halo_tiles.wraps_last_round(hand):   # the same kernel with the halo layouts before (see _halo_settings)
    candidates += [(f"hand-coded, {label}", lambda: hand) for label in (ROUND_SPANS, SINGLE_STAGE, GUARDED_BANKS)]
  for tile in (tiles if not is_weight_gradient_part(plain) else ()):
    candidates.append((tile_label(tile), lambda tile=tile: tiled(plain, tile)))
  for wgrad_tile in (WEIGHT_GRADIENT_TILE_VARIANTS if is_weight_gradient_part(plain) else ()):
    candidates.append((weight_gradient_tile_label(wgrad_tile),
                       lambda wgrad_tile=wgrad_tile: weight_gradient_tiled(plain, wgrad_tile)))
  variants = dict(VARIANTS.get(plain.name, {}))
  if is_weight_gradient_part(plain): variants.update(WEIGHT_GRADIENT_VARIANTS.get(len(plain.full_shape), {}))
  for name, opts in variants.items():
    candidates.append((name, lambda opts=opts: apply_opts(plain, opts)))
  if beam and beam_filter in plain.name:
    candidates.append((f"BEAM={beam}", lambda: beam_search(plain, None, beam, device=device)))
  for name, make in candidates:
    if rows and not any(part in name for part in rows): continue
    try:
      kernel = make()
    except KernelOptError as error:
      row(name, None, None, flops, "n/a", f"does not apply: {error}")
      continue
    halo_tiles.WRAP_LAST_ROUND, halo_tiles.SPAN_PADDING = _halo_settings(name)
    try:
      seconds = time_kernel(kernel, device, buffers, iters)
      check = "ok" if not kernel.applied_opts or verify_kernel(kernel, plain, device) else "WRONG"
    except Exception as error:  # a variant that fails to compile or launch is a row, not the end of the run
      row(name, kernel, None, flops, "error", f"{type(error).__name__}: {str(error).splitlines()[0][:150]}")
      continue
    finally:
      halo_tiles.WRAP_LAST_ROUND, halo_tiles.SPAN_PADDING = True, "banks"
    row(name, kernel, seconds, flops, check)


def torch_conv(dtype_name: str, iters: int) -> None:
  try:
    import torch
    if not torch.cuda.is_available(): return
  except ImportError:
    return
  from timing import torch_seconds
  dtype = getattr(torch, dtype_name)
  x = torch.randn(64, 64, 56, 56, device="cuda", dtype=dtype)
  w = torch.randn(64, 64, 3, 3, device="cuda", dtype=dtype)
  tf32 = ourgrad.get_float32_matmul_precision() == "high"   # --tf32: both sides
  torch.backends.cudnn.allow_tf32 = tf32
  seconds = torch_seconds(lambda: torch.nn.functional.conv2d(x, w, padding=1), iters, cuda=True)
  flops = 2 * 64 * 64 * 56 * 56 * 64 * 9
  label = f"PyTorch (cuDNN, TF32 {'on' if tf32 else 'off'})"
  print(f"  {label:<44} {'-':<38} {seconds * 1e3:8.4f} {flops / seconds / 1e9:8.0f}")


def parts_sweep(device: str, iters: int, scale: int) -> None:
  """Every kernel of the MNIST step, hand-coded, with each split-K part size of matmul-like reduces (and at 512, with
  the stride-1 input gradient's padded output gradient stored first, as on the CPU): the summed time of the
  matmul-like kernels and of the whole step, then the weight gradients' variants at that part size."""
  original, original_store = split_reduce.MIN_PART_MATMUL, tensor_conv.store_padded_gradient
  print("\nsplit-K part size of matmul-like reduces (products per part): summed kernel ms of the MNIST step")
  try:
    for part in (128, 256, 512, 1024, "512, padded gradient stored"):
      split_reduce.MIN_PART_MATMUL = part if isinstance(part, int) else 512
      tensor_conv.store_padded_gradient = original_store if isinstance(part, int) else lambda device: True
      total, matmul, names = 0.0, 0.0, []
      for ast in mnist_step_asts(scale):
        kernel = Kernel(ast, Device[device].renderer)
        kernel.hand_coded_optimizations()
        buffers = scratch_buffers(ast, device)
        random_fill(buffers, seed=0)
        seconds = time_kernel(kernel, device, buffers, iters)
        total += seconds
        if kernel.reduceop is not None and matmul_like(Kernel(ast, Device[device].renderer)):
          matmul += seconds
          names.append(f"{kernel.name} {seconds * 1e3:.4f}")
      print(f"  part {part}: step {total * 1e3:.3f} ms, matmul-like {matmul * 1e3:.3f} ms: {', '.join(names)}")
      for ast in mnist_step_asts(scale):
        plain = Kernel(ast, Device[device].renderer)
        if plain.reduceop is not None and is_weight_gradient_part(plain):
          bench_ast(ast, device, iters, 0, f"  part {part}: weight gradient")
  finally:
    split_reduce.MIN_PART_MATMUL, tensor_conv.store_padded_gradient = original, original_store


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--beam", type=int, default=2, help="BEAM width per kernel (0: no search)")
  parser.add_argument("--beam-filter", default="", help="only the kernels whose plain name contains this")
  parser.add_argument("--only", default="", help="rows whose label contains this: mnist, f32, f16")
  parser.add_argument("--rows", default="", help="the rows whose label contains one of these (comma-separated, or "
                      "'|'-separated where a label has commas), e.g. 'hand,halo'")
  parser.add_argument("--kernels", default="", help="the MNIST kernels whose plain name contains one of these "
                      "(comma-separated), e.g. r_256_32_8_8_16_5_5 (conv2 forward), r_256_16_12_12_32_5_5 (its input "
                      "gradient)")
  parser.add_argument("--scale", type=int, default=0, help="divide batch and image sizes by 2^scale (smoke tests)")
  parser.add_argument("--parts-sweep", action="store_true", help="time the MNIST step with several split-K parts")
  parser.add_argument("--wgrad", action="store_true", help="the MNIST step's weight gradients alone: the first "
                      "kernel's variants (--rows filters them), the second stage, the pair's sum")
  parser.add_argument("--split-part", default="", help="comma-separated split-K part sizes of matmul-like reduces "
                      "(split_reduce.MIN_PART_MATMUL) to run --wgrad at, e.g. 128,256,512")
  parser.add_argument("--tf32", action="store_true", help="allow TF32 tensor cores for the float32 kernels "
                      "(ourgrad.set_float32_matmul_precision('high'); cuDNN's allow_tf32 for the PyTorch rows)")
  parser.add_argument("--split-rows", default="", help="comma-separated row parts "
                      "(lazy_reduce.GPU_SPLIT_ROW_PARTS: a split of one image per part also splits the image rows) "
                      "to run --wgrad at, e.g. 1,2,4")
  args = parser.parse_args()
  if args.tf32: ourgrad.set_float32_matmul_precision("high")
  os.environ["DEVICE"] = args.device   # the MNIST step makes its tensors on the default device
  print(f"{'':<46}{'kernel':<38} {'ms':>8} {'GFLOP/s':>8} {'check':<6} opts")
  # labels hold commas: "|" separates the parts where it is used
  rows = tuple(part for part in args.rows.split("|" if "|" in args.rows else ",") if part)
  if args.wgrad:
    original, original_rows = split_reduce.MIN_PART_MATMUL, lazy_reduce.GPU_SPLIT_ROW_PARTS
    try:
      for part in [int(size) for size in args.split_part.split(",") if size] or [original]:
        for row_parts in [int(count) for count in args.split_rows.split(",") if count] or [original_rows]:
          split_reduce.MIN_PART_MATMUL, lazy_reduce.GPU_SPLIT_ROW_PARTS = part, row_parts
          bench_weight_gradients(args.device, args.iters, args.scale, args.beam, rows)
    finally:
      split_reduce.MIN_PART_MATMUL, lazy_reduce.GPU_SPLIT_ROW_PARTS = original, original_rows
    return
  if "mnist".startswith(args.only) or args.only in "mnist":
    for ast in mnist_step_asts(args.scale):
      plain = Kernel(ast, Device[args.device].renderer)
      # convolution-shaped: a matmul-like reduce over a window (the Linear layer's kernels have 3 axes)
      if plain.reduceop is None or not matmul_like(plain) or len(plain.full_shape) < 5: continue
      if args.beam_filter not in plain.name: continue   # --beam-filter: those kernels alone
      if args.kernels and not any(part in plain.name for part in args.kernels.split(",")): continue
      bench_ast(ast, args.device, args.iters, args.beam, "mnist step", args.beam_filter, rows,
                MNIST_TILE_VARIANTS)
  for dtype_name in ("float32", "float16"):
    label = f"conv 64x64x56x56 3x3 pad 1 {'f32' if dtype_name == 'float32' else 'f16'}"
    if args.only and args.only not in label: continue
    bench_ast(conv_ast(args.device, dtype_name, args.scale), args.device, args.iters, args.beam, label,
              args.beam_filter, rows)
    if args.device.startswith("CUDA"): torch_conv(dtype_name, args.iters)
  if args.parts_sweep: parts_sweep(args.device, args.iters, args.scale)


if __name__ == "__main__":
  main()
