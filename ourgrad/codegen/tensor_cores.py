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

TensorFloat-32 (`mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`, sm_80+) multiplies float32 matrices whose
inputs are rounded to TF32 (8 exponent bits, 10 mantissa bits; `cvt.rna.tf32.f32`: to nearest, ties away from
zero) and sums in float32. Only where the user allows it (`set_float32_matmul_precision("high")` or TF32=1, see
`TensorCore.allowed`). Its fragments hold one 32-bit value per register:

  A (4 per lane, a0..a3): element i at row (i & 1) * 8 + group, column (i >> 1) * 4 + quad
  B (2 per lane, b0, b1): element i at row i * 4 + quad, column group
  C, D: as m16n8k16's
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ourgrad.dtype import DType, dtypes
from ourgrad.helpers import tf32_allowed

WARP_LANES = 32


# Fragment maps as (row, column) of fragment element `element` held by lane (group, quad). Each coordinate is given
# by integer coefficients: row = row_base + row_group * group + row_quad * quad (and the same for column), so the
# linearizer can build symbolic indices and the interpreter numpy indices from one definition.
Affine = tuple[int, int, int]   # (constant, times group, times quad)
Position = tuple[Affine, Affine]


def a_position(element: int) -> Position:
  """m16n8k16: (row, column) in A (M x K) of A fragment element `element` (0..7)."""
  return ((element >> 1 & 1) * 8, 1, 0), ((element >> 2) * 8 + (element & 1), 0, 2)


def b_position(element: int) -> Position:
  """m16n8k16: (row, column) in B (K x N) of B fragment element `element` (0..3)."""
  return ((element >> 1) * 8 + (element & 1), 0, 2), (0, 1, 0)


def c_position(element: int) -> Position:
  """m16n8k16 and m16n8k8: (row, column) in C/D (M x N) of accumulator element `element` (0..3)."""
  return ((element >> 1) * 8, 1, 0), (element & 1, 0, 2)


def tf32_a_position(element: int) -> Position:
  """m16n8k8 .tf32: (row, column) in A (M x K) of A fragment element `element` (0..3)."""
  return ((element & 1) * 8, 1, 0), ((element >> 1) * 4, 0, 1)


def tf32_b_position(element: int) -> Position:
  """m16n8k8 .tf32: (row, column) in B (K x N) of B fragment element `element` (0..1)."""
  return (element * 4, 0, 1), (0, 1, 0)


@dataclass(frozen=True)
class FragmentMaps:
  """Where each fragment element of A, B and C/D lies in its matrix (one Position per element)."""
  a: tuple[Position, ...]
  b: tuple[Position, ...]
  c: tuple[Position, ...]


M16N8K16_MAPS = FragmentMaps(tuple(map(a_position, range(8))), tuple(map(b_position, range(4))),
                             tuple(map(c_position, range(4))))
M16N8K8_TF32_MAPS = FragmentMaps(tuple(map(tf32_a_position, range(4))), tuple(map(tf32_b_position, range(2))),
                                 tuple(map(c_position, range(4))))


@dataclass(frozen=True)
class TensorCore:
  """One matrix instruction: D (m x n, `dtype_out`) = A (m x k) @ B (k x n) (both `dtype_in`) + C, its fragments
  laid out as `maps` says."""
  dims: tuple[int, int, int]   # (m, n, k)
  dtype_in: DType
  dtype_out: DType
  maps: FragmentMaps = M16N8K16_MAPS

  @property
  def a_elements(self) -> int: return self.dims[0] * self.dims[2] // WARP_LANES

  @property
  def b_elements(self) -> int: return self.dims[2] * self.dims[1] // WARP_LANES

  @property
  def c_elements(self) -> int: return self.dims[0] * self.dims[1] // WARP_LANES

  @property
  def is_tf32(self) -> bool:
    """float32 inputs: the instruction rounds them to TensorFloat-32."""
    return self.dtype_in == dtypes.float32

  def allowed(self) -> bool:
    """Whether kernels may use it now: TF32 only where the user allows it (float32 matmul precision "high")."""
    return not self.is_tf32 or tf32_allowed()

  def a_position(self, element: int) -> Position: return self.maps.a[element]
  def b_position(self, element: int) -> Position: return self.maps.b[element]
  def c_position(self, element: int) -> Position: return self.maps.c[element]

  @property
  def arg(self) -> tuple:
    """The WMMA uop's arg naming this instruction: ((m, n, k), input dtype name, accumulator dtype name)."""
    return (self.dims, self.dtype_in.name, self.dtype_out.name)

  def __repr__(self) -> str:
    m, n, k = self.dims
    return f"TensorCore(m{m}n{n}k{k} {'tf32' if self.is_tf32 else self.dtype_in.name}->{self.dtype_out.name})"


# mma.sync with float32 accumulation, in the order the TC opt's amount picks them: m16n8k16 float16, bfloat16, then
# m16n8k8 TF32 for float32 operands (offered only where allowed)
CUDA_TENSOR_CORES: tuple[TensorCore, ...] = (
  TensorCore((16, 8, 16), dtypes.float16, dtypes.float32),
  TensorCore((16, 8, 16), dtypes.bfloat16, dtypes.float32),
  TensorCore((16, 8, 8), dtypes.float32, dtypes.float32, M16N8K8_TF32_MAPS),
)
_BY_ARG = {tc.arg: tc for tc in CUDA_TENSOR_CORES}


def tensor_core_of(arg: tuple) -> TensorCore:
  """The instruction a WMMA uop's arg names (the table above holds its true fragment maps)."""
  dims, dtype_in, dtype_out = arg
  return _BY_ARG[(tuple(dims), dtype_in, dtype_out)]


def tf32_round(values: np.ndarray) -> np.ndarray:
  """float32 values rounded to TensorFloat-32 as cvt.rna.tf32.f32 does: the 13 low mantissa bits dropped, to
  nearest with ties away from zero (add half of the dropped unit to the magnitude, then truncate); inf and NaN kept.
  Returns float32 (the low bits zero)."""
  bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
  finite = (bits & 0x7F800000) != 0x7F800000
  rounded = np.where(finite, (bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000), bits)
  return rounded.astype(np.uint32).view(np.float32)


def evaluate(position: Affine, group, quad):
  """An affine fragment coordinate at lane (group, quad): works on ints, symbolic nodes and numpy arrays alike."""
  constant, times_group, times_quad = position
  return group * times_group + quad * times_quad + constant
