"""Resampling and border padding for Tensor (ResizeMixin): `interpolate` and the non-constant `pad` modes.

Both only rearrange or mix values along each spatial axis by a rule known when the graph is built, so both are
written without data-dependent indexing:
- the padding modes (reflect, replicate, circular) cut the border pieces out of the tensor with shrink/flip/expand
  and join them with pad-and-add, axis by axis: movement ops and one fused add, gradients for free;
- `interpolate` is separable: along each spatial axis the output is a fixed linear map of the input (nearest
  picks one source, linear mixes two), computed here in numpy as an (out, in) matrix and applied with a matmul.
  Nearest resizing by a whole factor, the common case, is an expand (up) or a strided view (down) instead.
Source positions follow PyTorch's rules (`align_corners`, scale from `scale_factor` or from the sizes), computed in
float32 as PyTorch does, so the chosen neighbours agree at the rounding boundaries.

This module never imports the Tensor class: tensors come from `type(self)`.
"""
from __future__ import annotations

import math
from numbers import Real
from typing import TYPE_CHECKING, Sequence

import numpy as np

from ourgrad.errors import DTypeError, ShapeError

if TYPE_CHECKING:
  from ourgrad.tensor import Tensor

PAD_MODES = ("constant", "reflect", "replicate", "circular")
INTERPOLATE_MODES = ("nearest", "nearest-exact", "linear", "bilinear", "trilinear")
_LINEAR_DIMS = {"linear": 1, "bilinear": 2, "trilinear": 3}


def _axis_bounds(ndim: int, axis: int, bounds: tuple[int, int]) -> list[tuple[int, int] | None]:
  return [bounds if a == axis else None for a in range(ndim)]


def _join(pieces: list[Tensor], axis: int) -> Tensor:
  """Tensors equal in every dim but `axis`, joined along it: each is padded into place and the pads are added
  (one fused kernel, as cat does)."""
  pieces = [piece for piece in pieces if piece.shape[axis] > 0]
  total = sum(piece.shape[axis] for piece in pieces)
  joined, offset = None, 0
  for piece in pieces:
    size = piece.shape[axis]
    placed = piece.pad(_axis_bounds(piece.ndim, axis, (offset, total - offset - size)))
    joined = placed if joined is None else joined + placed
    offset += size
  return joined


def pad_with_mode(x: Tensor, pairs: Sequence[tuple[int, int]], mode: str) -> Tensor:
  """x padded by non-negative (before, after) `pairs`, one per dim, with PyTorch's border `mode`:
  "reflect" mirrors without repeating the edge (amounts < size), "replicate" repeats the edge value, "circular"
  wraps around (amounts <= size)."""
  if mode not in PAD_MODES[1:]: raise ValueError(f"pad mode must be one of {PAD_MODES}, got {mode!r}")
  for axis, (before, after) in enumerate(pairs):
    if before == 0 and after == 0: continue
    size = x.shape[axis]

    def part(start: int, stop: int) -> Tensor:
      return x.shrink(_axis_bounds(x.ndim, axis, (start, stop)))
    if mode == "reflect":
      if before >= size or after >= size:
        raise ShapeError(f"reflect padding ({before}, {after}) of dim {axis} must be smaller than its size {size} "
                         f"(shape {x.shape})")
      left, right = part(1, before + 1).flip(axis), part(size - 1 - after, size - 1).flip(axis)
    elif mode == "replicate":
      if size == 0: raise ShapeError(f"replicate padding of the empty dim {axis} (shape {x.shape})")
      edge_shape = lambda count: tuple(count if a == axis else s for a, s in enumerate(x.shape))  # noqa: E731
      left, right = part(0, 1).expand(edge_shape(before)), part(size - 1, size).expand(edge_shape(after))
    else:
      if before > size or after > size:
        raise ShapeError(f"circular padding ({before}, {after}) of dim {axis} must be at most its size {size} "
                         f"(shape {x.shape})")
      left, right = part(size - before, size), part(0, after)
    x = _join([left, x, right], axis)
  return x


def _source_scale(in_size: int, out_size: int, scale_factor: float | None, align_corners: bool) -> float:
  """PyTorch's area_pixel_compute_scale: how far the source position moves per output step."""
  if align_corners: return (in_size - 1) / (out_size - 1) if out_size > 1 else 0.0
  return 1.0 / scale_factor if scale_factor is not None and scale_factor > 0 else in_size / out_size


def _nearest_sources(in_size: int, out_size: int, scale: float, exact: bool) -> np.ndarray:
  """The source index of each output position: floor(dst * scale) ("nearest", PyTorch's legacy rule) or
  floor((dst + 0.5) * scale) ("nearest-exact"), clamped to the input."""
  positions = np.arange(out_size, dtype=np.float32) + np.float32(0.5 if exact else 0.0)
  return np.minimum(np.floor(positions * np.float32(scale)).astype(np.int64), in_size - 1)


def _linear_matrix(in_size: int, out_size: int, scale: float, align_corners: bool) -> np.ndarray:
  """(out, in) weights of linear interpolation: each row mixes the two nearest sources."""
  dst = np.arange(out_size, dtype=np.float32)
  if align_corners: src = dst * np.float32(scale)
  else: src = np.maximum((dst + np.float32(0.5)) * np.float32(scale) - np.float32(0.5), np.float32(0.0))
  low = np.minimum(np.floor(src).astype(np.int64), in_size - 1)
  high = np.minimum(low + 1, in_size - 1)
  frac = (src - low).astype(np.float32)
  matrix = np.zeros((out_size, in_size), dtype=np.float32)
  np.add.at(matrix, (np.arange(out_size), low), 1.0 - frac)
  np.add.at(matrix, (np.arange(out_size), high), frac)
  return matrix


def _apply_along(x: Tensor, axis: int, matrix: np.ndarray) -> Tensor:
  """x with dim `axis` (size in) replaced by matrix @ x along it (size out)."""
  weights = type(x)(matrix.T.copy(), device=x.device, dtype=x.dtype)
  return x.transpose(axis, -1).matmul(weights).transpose(axis, -1)


def _take_along(x: Tensor, axis: int, sources: np.ndarray) -> Tensor:
  """x indexed by the static `sources` along `axis`: an expand when it repeats each index k times in order
  (nearest upsampling by a whole factor), a strided view when it steps by a whole number (downsampling), else a
  one-hot matrix product."""
  in_size, count = x.shape[axis], len(sources)
  step = int(sources[1] - sources[0]) if count > 1 else 1
  start = int(sources[0])
  if step >= 1 and np.array_equal(sources, start + step * np.arange(count)):
    # pad to a whole number of steps, split the axis into (count, step) and keep the first of each step
    stop = start + count * step
    x = x.pad(_axis_bounds(x.ndim, axis, (0, max(0, stop - in_size)))).shrink(_axis_bounds(x.ndim, axis, (start, stop)))
    x = x.reshape(*x.shape[:axis], count, step, *x.shape[axis + 1:])
    return x.shrink(_axis_bounds(x.ndim, axis + 1, (0, 1))).reshape(*x.shape[:axis], count, *x.shape[axis + 2:])
  factor = len(sources) // in_size if in_size else 0
  whole_factor = factor >= 1 and len(sources) == factor * in_size
  if whole_factor and np.array_equal(sources, np.repeat(np.arange(in_size), factor)):
    repeated = x.unsqueeze(axis + 1).expand(*x.shape[:axis + 1], factor, *x.shape[axis + 1:])
    return repeated.reshape(*x.shape[:axis], in_size * factor, *x.shape[axis + 1:])
  one_hot = np.zeros((len(sources), in_size), dtype=np.float32)
  one_hot[np.arange(len(sources)), sources] = 1.0
  return _apply_along(x, axis, one_hot)


def _output_sizes(x: Tensor, dims: int, size: int | Sequence[int] | None,
                  scale_factor: float | Sequence[float] | None) -> tuple[tuple[int, ...], tuple[float, ...] | None]:
  if (size is None) == (scale_factor is None):
    raise ValueError("interpolate needs exactly one of size and scale_factor")
  if size is not None:
    sizes = (int(size),) * dims if isinstance(size, Real) else tuple(int(s) for s in size)
    if len(sizes) != dims: raise ShapeError(f"interpolate size {size} needs {dims} values for input {x.shape}")
    if any(s <= 0 for s in sizes): raise ValueError(f"interpolate size must be positive, got {sizes}")
    return sizes, None
  factors = (float(scale_factor),) * dims if isinstance(scale_factor, Real) else tuple(float(f) for f in scale_factor)
  if len(factors) != dims:
    raise ShapeError(f"interpolate scale_factor {scale_factor} needs {dims} values for input {x.shape}")
  sizes = tuple(math.floor(i * f) for i, f in zip(x.shape[2:], factors))
  if any(s <= 0 for s in sizes): raise ValueError(f"interpolate scale_factor {factors} gives empty output {sizes}")
  return sizes, factors


def _adaptive_matrix(in_size: int, out_size: int) -> np.ndarray:
  """(out, in) weights of adaptive average pooling: bin j averages [floor(j*in/out), ceil((j+1)*in/out))."""
  matrix = np.zeros((out_size, in_size), dtype=np.float32)
  for j in range(out_size):
    start, stop = (j * in_size) // out_size, -((-(j + 1) * in_size) // out_size)
    matrix[j, start:stop] = 1.0 / (stop - start)
  return matrix


class ResizeMixin:
  """Tensor methods that resample the spatial dims (interpolate, adaptive average pooling); the padding modes are
  used by Tensor.pad."""
  __slots__ = ()

  def _adaptive_avg_pool(self: Tensor, dims: int, output_size: int | Sequence[int | None]) -> Tensor:
    name = f"adaptive_avg_pool{dims}d"
    if self.ndim not in (dims + 1, dims + 2):
      raise ShapeError(f"{name} expects a {dims + 1}-D or {dims + 2}-D input, got shape {self.shape}")
    sizes = (output_size,) * dims if isinstance(output_size, int) or output_size is None else tuple(output_size)
    if len(sizes) != dims: raise ShapeError(f"{name} output_size {output_size} needs {dims} values")
    x = self
    for index, out_size in enumerate(sizes):
      axis = self.ndim - dims + index
      in_size = self.shape[axis]
      if out_size is None or out_size == in_size: continue  # None keeps the size, as in PyTorch
      if out_size <= 0: raise ValueError(f"{name} output sizes must be positive, got {sizes}")
      if in_size % out_size == 0:
        # equal bins: a reshape and a mean (no matrix)
        step = in_size // out_size
        x = x.reshape(*x.shape[:axis], out_size, step, *x.shape[axis + 1:]).mean(axis + 1)
      else:
        x = _apply_along(x, axis, _adaptive_matrix(in_size, out_size))
    return x

  def adaptive_avg_pool1d(self: Tensor, output_size: int | Sequence[int | None]) -> Tensor:
    """Average the last dim into `output_size` bins, like torch.nn.functional.adaptive_avg_pool1d."""
    return self._adaptive_avg_pool(1, output_size)

  def adaptive_avg_pool2d(self: Tensor, output_size: int | Sequence[int | None]) -> Tensor:
    """Average the last two dims into `output_size` bins (int, pair, None keeps a size), like
    torch.nn.functional.adaptive_avg_pool2d; bin j covers [floor(j*in/out), ceil((j+1)*in/out))."""
    return self._adaptive_avg_pool(2, output_size)

  def adaptive_avg_pool3d(self: Tensor, output_size: int | Sequence[int | None]) -> Tensor:
    """Average the last three dims into `output_size` bins, like torch.nn.functional.adaptive_avg_pool3d."""
    return self._adaptive_avg_pool(3, output_size)

  def interpolate(self: Tensor, size: int | Sequence[int] | None = None,
                  scale_factor: float | Sequence[float] | None = None, mode: str = "nearest",
                  align_corners: bool | None = None, recompute_scale_factor: bool | None = None) -> Tensor:
    """Resize the spatial dims of (N, C, *spatial) to `size` or by `scale_factor` (output floor(in * factor)),
    like torch.nn.functional.interpolate. mode: "nearest" (PyTorch's floor rule), "nearest-exact", "linear"
    (1 spatial dim in PyTorch; any number here, as in tinygrad), "bilinear" (2) or "trilinear" (3);
    align_corners (linear modes only, default False) maps the corner pixels' centres onto each other. As in
    PyTorch, a given scale_factor also sets the source step (1 / factor) unless recompute_scale_factor=True."""
    if mode not in INTERPOLATE_MODES: raise ValueError(f"interpolate mode must be one of {INTERPOLATE_MODES}, "
                                                       f"got {mode!r}")
    dims = self.ndim - 2
    if dims < 1: raise ShapeError(f"interpolate needs input (N, C, *spatial), got shape {self.shape}")
    linear = mode in _LINEAR_DIMS
    # "linear" on more than one spatial dim is tinygrad's meaning (linear along each); PyTorch only allows 1
    if linear and _LINEAR_DIMS[mode] != dims and mode != "linear":
      raise ShapeError(f"interpolate mode {mode!r} needs {_LINEAR_DIMS[mode]} spatial dims, got input {self.shape}")
    if align_corners is not None and not linear:
      raise ValueError(f"align_corners only applies to the linear modes, not {mode!r}")
    if not self.dtype.is_float and linear:
      raise DTypeError(f"interpolate mode {mode!r} needs a float tensor, got {self.dtype}")
    sizes, factors = _output_sizes(self, dims, size, scale_factor)
    if recompute_scale_factor: factors = None
    x = self
    for index, (in_size, out_size) in enumerate(zip(self.shape[2:], sizes)):
      axis = 2 + index
      if in_size == 0: raise ShapeError(f"interpolate of an empty spatial dim (input {self.shape})")
      scale = _source_scale(in_size, out_size, None if factors is None else factors[index], bool(align_corners))
      if linear: x = _apply_along(x, axis, _linear_matrix(in_size, out_size, scale, bool(align_corners)))
      else: x = _take_along(x, axis, _nearest_sources(in_size, out_size, scale, mode == "nearest-exact"))
    return x
