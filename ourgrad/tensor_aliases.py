"""PyTorch's other names for ops Tensor already has (AliasMixin): divide for div, t() for a 2-D transpose, ravel for
flatten, take_along_dim for gather, ... Each is one line on top of the op that does the work, so it has that op's
gradient and fuses like it; nothing here computes anything of its own.

The methods become Tensor's through `class Tensor(..., AliasMixin, ...)` in ourgrad/tensor.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ourgrad.dtype import dtypes
from ourgrad.errors import ShapeError

if TYPE_CHECKING:
  from ourgrad.tensor import Tensor


class AliasMixin:
  """torch.Tensor names that are another spelling of an existing op."""
  __slots__ = ()

  # ---------------------------------------------------------------- arithmetic and comparison

  def divide(self, other: Any, rounding_mode: str | None = None) -> Tensor:
    """The same as div."""
    return self.div(other, rounding_mode=rounding_mode)

  def true_divide(self, other: Any) -> Tensor:
    """The same as div (true division)."""
    return self.div(other)

  def multiply(self, other: Any) -> Tensor:
    """The same as mul."""
    return self.mul(other)

  def subtract(self, other: Any, alpha: float = 1.0) -> Tensor:
    """self - alpha * other (torch.subtract)."""
    return self.sub(other * alpha if alpha != 1.0 else other)

  def negative(self) -> Tensor:
    """The same as neg."""
    return self.neg()

  def positive(self) -> Tensor:
    """self, unchanged."""
    return self

  def absolute(self) -> Tensor:
    """The same as abs."""
    return self.abs()

  def fix(self) -> Tensor:
    """The same as trunc."""
    return self.trunc()

  def sgn(self) -> Tensor:
    """The same as sign (for real tensors)."""
    return self.sign()

  def greater(self, other: Any) -> Tensor:
    """self > other."""
    return self > other

  def greater_equal(self, other: Any) -> Tensor:
    """self >= other."""
    return self >= other

  def less(self, other: Any) -> Tensor:
    """self < other."""
    return self < other

  def less_equal(self, other: Any) -> Tensor:
    """self <= other."""
    return self <= other

  def not_equal(self, other: Any) -> Tensor:
    """self != other."""
    return self != other

  # ---------------------------------------------------------------- dtypes and properties

  def byte(self) -> Tensor:
    """Cast to uint8."""
    return self.cast(dtypes.uint8)

  def short(self) -> Tensor:
    """Cast to int16."""
    return self.cast(dtypes.int16)

  def bfloat16(self) -> Tensor:
    """Cast to bfloat16."""
    return self.cast(dtypes.bfloat16)

  def is_floating_point(self) -> bool:
    """True for float dtypes."""
    return self.dtype.is_float

  def ndimension(self) -> int:
    """The number of dimensions (the same as ndim)."""
    return self.ndim

  # ---------------------------------------------------------------- views

  def t(self) -> Tensor:
    """The transpose of a tensor of at most 2 dimensions (torch.Tensor.t)."""
    if self.ndim > 2: raise ShapeError(f"t() takes a tensor of at most 2 dimensions, got shape {self.shape}")
    return self.transpose(0, -1) if self.ndim == 2 else self

  def ravel(self) -> Tensor:
    """The same as flatten()."""
    return self.flatten()

  def swapdims(self, dim0: int, dim1: int) -> Tensor:
    """The same as transpose(dim0, dim1)."""
    return self.transpose(dim0, dim1)

  def fliplr(self) -> Tensor:
    """flip(1)."""
    return self.flip(1)

  def flipud(self) -> Tensor:
    """flip(0)."""
    return self.flip(0)

  def tile(self, *dims: int | Sequence[int]) -> Tensor:
    """repeat, with fewer counts than dimensions meaning 1 for the leading ones (torch.tile)."""
    counts = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else tuple(dims)
    return self.repeat((1,) * (self.ndim - len(counts)) + counts)

  def unbind(self, dim: int = 0) -> tuple[Tensor, ...]:
    """The slices along `dim`, each without that dimension."""
    axis = self._axis(dim)
    return tuple(self[(slice(None),) * axis + (index,)] for index in range(self.shape[axis]))

  def select(self, dim: int, index: int) -> Tensor:
    """The slice at `index` of `dim`, without that dimension (torch.select)."""
    return self[(slice(None),) * self._axis(dim) + (index,)]

  def index_select(self, dim: int, index: Tensor) -> Tensor:
    """The entries of `dim` at the 1-D integer `index` (torch.index_select)."""
    if index.ndim > 1: raise ShapeError(f"index_select takes a 0-d or 1-D index, got shape {index.shape}")
    return self[(slice(None),) * self._axis(dim) + (index.reshape(-1),)]

  def take_along_dim(self, indices: Tensor, dim: int) -> Tensor:
    """The same as gather(dim, indices) for indices of this tensor's rank."""
    return self.gather(dim, indices)

  # ---------------------------------------------------------------- products

  def mv(self, vector: Tensor) -> Tensor:
    """Matrix times vector (torch.mv)."""
    if self.ndim != 2 or vector.ndim != 1:
      raise ShapeError(f"mv takes a matrix and a vector, got shapes {self.shape} and {vector.shape}")
    return self.matmul(vector)

  def inner(self, other: Tensor) -> Tensor:
    """The sum of products over the last dimension of both (torch.inner)."""
    return self.matmul(other.transpose(-1, -2)) if other.ndim > 1 else self.matmul(other)

  def ger(self, other: Tensor) -> Tensor:
    """The same as outer."""
    return self.outer(other)

  def vdot(self, other: Tensor) -> Tensor:
    """The dot product of two 1-D tensors."""
    if self.ndim != 1 or other.ndim != 1:
      raise ShapeError(f"vdot takes two 1-D tensors, got shapes {self.shape} and {other.shape}")
    return self.matmul(other)
