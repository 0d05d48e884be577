"""Tensor cores: the matrix instructions a renderer may declare, and how their fragments map to a warp's lanes.

One tensor-core instruction (`mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32` on NVIDIA sm_80+)
computes D = A @ B + C for a 16x16 A (M x K), a 16x8 B (K x N) and a 16x8 C/D (float32), spread over the 32 lanes
of a warp. Each lane holds a fixed "fragment" of each matrix, in registers, as the PTX ISA assigns them (with
group = lane >> 2 and quad = lane % 4):

  A (8 halves per lane, a0..a7):  element i at row (i >> 1 & 1) * 8 + group, column (i >> 2) * 8 + quad * 2 + (i & 1)
  B (4 halves per lane, b0..b3):  element i at row (i >> 1) * 8 + quad * 2 + (i & 1), column group
  C, D (4 floats per lane, c0..c3): element i at row (i >> 1) * 8 + group, column quad * 2 + (i & 1)

The linearizer loads each lane's fragment with these maps (codegen/linearizer.py), the CUDA renderer packs the
halves two per 32-bit register for the instruction, and the PYTHON interpreter gathers a warp's fragments with the
same maps to emulate it; a wrong map therefore gives wrong numbers in CI, not only on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

from ourgrad.dtype import DType, dtypes

WARP_LANES = 32


@dataclass(frozen=True)
class TensorCore:
  """One matrix instruction: D (m x n, `dtype_out`) = A (m x k) @ B (k x n) (both `dtype_in`) + C."""
  dims: tuple[int, int, int]   # (m, n, k)
  dtype_in: DType
  dtype_out: DType

  @property
  def a_elements(self) -> int: return self.dims[0] * self.dims[2] // WARP_LANES

  @property
  def b_elements(self) -> int: return self.dims[2] * self.dims[1] // WARP_LANES

  @property
  def c_elements(self) -> int: return self.dims[0] * self.dims[1] // WARP_LANES

  def __repr__(self) -> str:
    m, n, k = self.dims
    return f"TensorCore(m{m}n{n}k{k} {self.dtype_in.name}->{self.dtype_out.name})"


# mma.sync m16n8k16 with float32 accumulation, in the order the TC opt's amount picks them
CUDA_TENSOR_CORES: tuple[TensorCore, ...] = (
  TensorCore((16, 8, 16), dtypes.float16, dtypes.float32),
  TensorCore((16, 8, 16), dtypes.bfloat16, dtypes.float32),
)


# Fragment maps of m16n8k16 as (row, column) of fragment element `element` held by lane (group, quad).
# Each returns integer coefficients: row = row_base + row_group * group + row_quad * quad (and the same for column),
# so the linearizer can build symbolic indices and the interpreter numpy indices from one definition.
Affine = tuple[int, int, int]   # (constant, times group, times quad)


def a_position(element: int) -> tuple[Affine, Affine]:
  """(row, column) in A (M x K) of A fragment element `element` (0..7)."""
  return ((element >> 1 & 1) * 8, 1, 0), ((element >> 2) * 8 + (element & 1), 0, 2)


def b_position(element: int) -> tuple[Affine, Affine]:
  """(row, column) in B (K x N) of B fragment element `element` (0..3)."""
  return ((element >> 1) * 8 + (element & 1), 0, 2), (0, 1, 0)


def c_position(element: int) -> tuple[Affine, Affine]:
  """(row, column) in C/D (M x N) of accumulator element `element` (0..3)."""
  return ((element >> 1) * 8, 1, 0), (element & 1, 0, 2)


def evaluate(position: Affine, group, quad):
  """An affine fragment coordinate at lane (group, quad): works on ints, symbolic nodes and numpy arrays alike."""
  constant, times_group, times_quad = position
  return group * times_group + quad * times_quad + constant
