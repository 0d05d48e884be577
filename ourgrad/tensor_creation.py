"""Creation of tensors for Tensor (CreationMixin): empty, full, zeros, ones and their *_like / new_* forms, arange,
linspace, eye, and random numbers (manual_seed, rand, randn, randint, uniform, normal, rand_like, randn_like).

The methods become Tensor's through `class Tensor(CreationMixin, ...)` in ourgrad/tensor.py. The constructors are
classmethods and the per-tensor ones use `type(self)`, so this module makes Tensors without importing tensor.py
(which imports it).

Random numbers come from one numpy generator (`_rng`) seeded by manual_seed, so runs are reproducible; inside a
TinyJit function they are computed on the device instead (ourgrad/tensor_random.py), so that every replay draws anew.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ourgrad import tensor_random
from ourgrad.device import Device
from ourgrad.dtype import DType, dtypes, truncate
from ourgrad.engine.exec_item import jit_recording
from ourgrad.errors import ShapeError
from ourgrad.lazy import LazyBuffer
from ourgrad.multi import MultiLazyBuffer
from ourgrad.shape.symbolic import Node, is_symbolic

if TYPE_CHECKING:
  from ourgrad.tensor import Scalar, Tensor


def canonical_devices(device: str | tuple[str, ...] | list[str] | None) -> str | tuple[str, ...] | None:
  """A device name, or a tuple of them (a tensor spread over several devices), in canonical form."""
  if device is None or isinstance(device, str): return Device.canonicalize(device) if device else None
  return tuple(Device.canonicalize(name) for name in device)


class CreationMixin:
  """Tensor's constructors (zeros, arange, randn, ...) and random numbers."""
  __slots__ = ()
  _seed: int = 0
  _rng: np.random.Generator = np.random.default_rng(0)


  @classmethod
  def _shape_arg(cls, shape: tuple) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)): shape = tuple(shape[0])
    for size in shape:
      if is_symbolic(size): continue  # a bound Variable (or an expression of one): a symbolic size, docs/jit.md
      if not isinstance(size, (int, np.integer)) or size < 0:
        raise ShapeError(f"shape sizes must be non-negative integers, got {shape}")
    return tuple(size if is_symbolic(size) else int(size) for size in shape)

  @classmethod
  def empty(cls, *shape: int, dtype: DType | str | None = None, device: str | None = None, **kwargs: Any) -> Tensor:
    """A tensor of `shape` with unspecified values (float32 unless `dtype`)."""
    dtype = dtypes.as_dtype(dtype) if dtype is not None else dtypes.default_float
    if isinstance(device, (tuple, list)): return cls.empty(*shape, dtype=dtype, device=device[0]).shard(device)
    device = Device.canonicalize(device or Device.DEFAULT)
    return cls(LazyBuffer.empty(cls._shape_arg(shape), dtype, device), **kwargs)

  @classmethod
  def full(cls, shape: tuple[int, ...] | int, fill_value: Scalar, dtype: DType | str | None = None,
           device: str | None = None, **kwargs: Any) -> Tensor:
    """A tensor of `shape` filled with `fill_value`; the dtype follows the value (bool, int32 or float32; PyTorch gives
    int64 for an int) unless given."""
    shape = cls._shape_arg((shape,) if isinstance(shape, (int, Node)) else tuple(shape))
    dtype = dtypes.as_dtype(dtype) if dtype is not None else dtypes.from_py(fill_value)
    if isinstance(device, (tuple, list)):  # replicated: a constant on each device (nothing is copied)
      constants = [LazyBuffer.full(fill_value, shape, dtype, name) for name in canonical_devices(device)]  # type: ignore
      return cls(MultiLazyBuffer(constants, None), **kwargs)
    device = Device.canonicalize(device or Device.DEFAULT)
    return cls(LazyBuffer.full(fill_value, shape, dtype, device), **kwargs)

  @classmethod
  def zeros(cls, *shape: int, dtype: DType | str | None = None, **kwargs: Any) -> Tensor:
    """A tensor of `shape` filled with 0 (float32 unless `dtype`)."""
    return cls.full(cls._shape_arg(shape), 0, dtype or dtypes.default_float, **kwargs)

  @classmethod
  def ones(cls, *shape: int, dtype: DType | str | None = None, **kwargs: Any) -> Tensor:
    """A tensor of `shape` filled with 1 (float32 unless `dtype`)."""
    return cls.full(cls._shape_arg(shape), 1, dtype or dtypes.default_float, **kwargs)

  def full_like(self, fill_value: Scalar, dtype: DType | str | None = None, **kwargs: Any) -> Tensor:
    """A tensor of this one's shape, dtype and device (unless given) filled with `fill_value`."""
    device = kwargs.pop("device", self.device)
    return type(self).full(self.shape, fill_value, dtype or self.dtype, device=device, **kwargs)

  def zeros_like(self, **kwargs: Any) -> Tensor:
    """A tensor of this one's shape, dtype and device (unless given) filled with 0."""
    return self.full_like(0, **kwargs)

  def ones_like(self, **kwargs: Any) -> Tensor:
    """A tensor of this one's shape, dtype and device (unless given) filled with 1."""
    return self.full_like(1, **kwargs)

  def new_full(self, size: tuple[int, ...] | int, fill_value: Scalar, dtype: DType | str | None = None,
               device: str | None = None, **kwargs: Any) -> Tensor:
    """A tensor of `size` filled with `fill_value`, with this tensor's dtype and device unless given."""
    return type(self).full(size, fill_value, dtype or self.dtype, device=device or self.device, **kwargs)

  def new_zeros(self, *size: int, dtype: DType | str | None = None, **kwargs: Any) -> Tensor:
    """A tensor of `size` filled with 0, with this tensor's dtype and device unless given."""
    return self.new_full(type(self)._shape_arg(size), 0, dtype, **kwargs)

  def new_ones(self, *size: int, dtype: DType | str | None = None, **kwargs: Any) -> Tensor:
    """A tensor of `size` filled with 1, with this tensor's dtype and device unless given."""
    return self.new_full(type(self)._shape_arg(size), 1, dtype, **kwargs)

  def new_empty(self, *size: int, dtype: DType | str | None = None, device: str | None = None,
                **kwargs: Any) -> Tensor:
    """A tensor of `size` with unspecified values, with this tensor's dtype and device unless given."""
    shape = type(self)._shape_arg(size)
    return type(self).empty(*shape, dtype=dtype or self.dtype, device=device or self.device, **kwargs)

  def new_tensor(self, data: Any, dtype: DType | str | None = None, device: str | None = None,
                 **kwargs: Any) -> Tensor:
    """A tensor holding `data`, with this tensor's dtype and device unless given."""
    return type(self)(data, dtype=dtype or self.dtype, device=device or self.device, **kwargs)

  @classmethod
  def arange(cls, start: Scalar, stop: Scalar | None = None, step: Scalar = 1, dtype: DType | str | None = None,
             device: str | None = None, **kwargs: Any) -> Tensor:
    """start, start+step, ... < stop, like torch.arange (int32 for integer arguments, float32 otherwise)."""
    if stop is None: start, stop = 0, start
    if step == 0: raise ValueError("arange step must be non-zero")
    count = max(math.ceil((stop - start) / step), 0)
    is_float = any(isinstance(value, float) for value in (start, stop, step))
    dtype = dtypes.as_dtype(dtype) if dtype is not None else (dtypes.default_float if is_float else dtypes.default_int)
    # computed on the host: exact in every dtype and O(n); a lazy form would cost O(n^2) work per element
    values = start + np.arange(count, dtype=np.float64 if is_float else np.int64) * step
    if dtype == dtypes.bfloat16: return cls(values, device=device, dtype=dtype, **kwargs)
    device = canonical_devices(device) or Device.DEFAULT
    if isinstance(device, tuple): return cls(values.astype(dtype.np), device=device, dtype=dtype, **kwargs)
    # the same range again (every eager step's one-hot or causal mask) reads one upload of it
    return cls(LazyBuffer.from_host_constant(values.astype(dtype.np), dtype, device), **kwargs)

  @classmethod
  def linspace(cls, start: Scalar, stop: Scalar, steps: int, dtype: DType | str | None = None,
               device: str | None = None, **kwargs: Any) -> Tensor:
    """`steps` evenly spaced values from `start` to `stop` inclusive (float32 unless `dtype`), as torch.linspace
    computes them: the first half as start + i * step, the second as stop - (steps - 1 - i) * step, so both ends are
    exact. The ends and the step are rounded to a float dtype (the step to float64 for integers) as PyTorch's are;
    the rest is computed in float64 and rounded once (PyTorch's fused multiply-add), integers truncating."""
    dtype = dtypes.as_dtype(dtype) if dtype is not None else dtypes.default_float
    if steps < 0: raise ValueError(f"linspace needs steps >= 0, got {steps}")
    if steps == 1: return cls.full((1,), start, dtype, device=device, **kwargs)
    if dtype.is_float: start, stop = truncate(dtype, float(start)), truncate(dtype, float(stop))
    step = (float(stop) - float(start)) / (steps - 1)
    if dtype.is_float: step = truncate(dtype, step)
    index = np.arange(steps, dtype=np.float64)
    # computed on the host, as arange is
    values = np.where(index < steps // 2, start + index * step, stop - (steps - 1 - index) * step)
    if dtype == dtypes.bfloat16: return cls(values, device=device, dtype=dtype, **kwargs)
    return cls(values.astype(dtype.np), device=device, dtype=dtype, **kwargs)

  @classmethod
  def eye(cls, n: int, m: int | None = None, dtype: DType | str | None = None, device: str | None = None,
          **kwargs: Any) -> Tensor:
    """The n x m identity matrix (m defaults to n), float32 unless `dtype`."""
    m = n if m is None else m
    rows = cls.arange(n, device=device).reshape(n, 1)
    cols = cls.arange(m, device=device).reshape(1, m)
    return cls((rows == cols).cast(dtype or dtypes.default_float).lazydata, **kwargs)

  @classmethod
  def manual_seed(cls, seed: int = 0) -> None:
    """Reseed the random generator behind rand, randn, randint, uniform, normal and dropout (numpy's, so a seed gives
    other numbers than in PyTorch), and the device generator used inside TinyJit functions."""
    cls._seed = seed
    cls._rng = np.random.default_rng(seed)
    tensor_random.reseed(seed)

  @classmethod
  def _from_random(cls, values: np.ndarray, dtype: DType | str | None, device: str | None, **kwargs: Any) -> Tensor:
    dtype = dtypes.as_dtype(dtype) if dtype is not None else dtypes.default_float
    return cls(values, device=device, dtype=dtype, **kwargs)

  @classmethod
  def _device_random(cls, device: str | tuple[str, ...] | list[str] | None) -> str | None:
    """The device to draw on with the device generator (inside a TinyJit function), or None to draw with numpy."""
    if not jit_recording.active: return None
    device = canonical_devices(device) or Device.DEFAULT
    return device if isinstance(device, str) else None  # several devices: numpy (a JIT capture then refuses it)

  @classmethod
  def rand(cls, *shape: int, dtype: DType | str | None = None, device: str | None = None, **kwargs: Any) -> Tensor:
    """Uniform in [0, 1)."""
    shape = cls._shape_arg(shape)
    if (on_device := cls._device_random(device)) is not None:
      return cls._from_random_tensor(tensor_random.uniform01(shape, on_device, cls._seed), dtype, **kwargs)
    values = cls._rng.random(shape, dtype=np.float32)
    return cls._from_random(values, dtype, device, **kwargs)

  @classmethod
  def randn(cls, *shape: int, dtype: DType | str | None = None, device: str | None = None, **kwargs: Any) -> Tensor:
    """Standard normal."""
    shape = cls._shape_arg(shape)
    if (on_device := cls._device_random(device)) is not None:
      normal = tensor_random.standard_normal(shape, on_device, cls._seed)
      return cls._from_random_tensor(normal, dtype, **kwargs)
    values = cls._rng.standard_normal(shape, dtype=np.float32)
    return cls._from_random(values, dtype, device, **kwargs)

  @classmethod
  def randint(cls, *args: Any, low: int | None = None, high: int | None = None, size: tuple[int, ...] | None = None,
              dtype: DType | str | None = None, device: str | None = None, **kwargs: Any) -> Tensor:
    """Integers in [low, high), in PyTorch's forms `randint(high, size)`, `randint(low, high, size)` (size=()
    gives a 0-d tensor), and in tinygrad's `randint(*shape, low=0, high=10)`: positional ints with no size given
    (as a tuple argument or `size=`) are the shape."""
    sizes = [arg for arg in args if isinstance(arg, (tuple, list))]
    bounds = [arg for arg in args if not isinstance(arg, (tuple, list))]
    if sizes or size is not None or (low is None and high is None and len(bounds) <= 2):
      # PyTorch's form: the positional ints are the bounds
      size = tuple(sizes[0]) if sizes else (tuple(size) if size is not None else ())
      if len(bounds) == 2: low, high = bounds
      elif len(bounds) == 1: low, high = (0, bounds[0]) if high is None else (bounds[0], high)
      elif low is None and high is not None: low = 0
    else:  # tinygrad's form
      size, low, high = tuple(bounds), 0 if low is None else low, 10 if high is None else high
    if low is None or high is None: raise TypeError("randint needs an upper bound: randint(high, size)")
    if high <= low: raise ValueError(f"randint needs low < high, got {low} and {high}")
    shape = cls._shape_arg(tuple(size))
    if (on_device := cls._device_random(device)) is not None:
      uniform = tensor_random.uniform01(shape, on_device, cls._seed)
      values = (uniform * (high - low)).floor().minimum(high - low - 1) + low  # float32 holds 24 bits: small ranges
      return cls(values.cast(dtype or dtypes.default_int).lazydata, **kwargs)
    values = cls._rng.integers(low, high, size=shape)
    return cls(values, device=device, dtype=dtype or dtypes.default_int, **kwargs)

  @classmethod
  def uniform(cls, *shape: int, low: float = 0.0, high: float = 1.0, dtype: DType | str | None = None,
              device: str | None = None, **kwargs: Any) -> Tensor:
    """Random values uniform in [low, high) (tinygrad's form; float32 unless `dtype`)."""
    shape = cls._shape_arg(shape)
    if (on_device := cls._device_random(device)) is not None:
      uniform = tensor_random.uniform01(shape, on_device, cls._seed)
      return cls._from_random_tensor(uniform * (high - low) + low, dtype, **kwargs)
    values = cls._rng.uniform(low, high, shape).astype(np.float32)
    return cls._from_random(values, dtype, device, **kwargs)

  @classmethod
  def normal(cls, *shape: int, mean: float = 0.0, std: float = 1.0, dtype: DType | str | None = None,
             device: str | None = None, **kwargs: Any) -> Tensor:
    """Random values from a normal distribution with `mean` and `std` (tinygrad's form; float32 unless `dtype`)."""
    shape = cls._shape_arg(shape)
    if (on_device := cls._device_random(device)) is not None:
      normal = tensor_random.standard_normal(shape, on_device, cls._seed)
      return cls._from_random_tensor(normal * std + mean, dtype, **kwargs)
    values = cls._rng.normal(mean, std, shape).astype(np.float32)
    return cls._from_random(values, dtype, device, **kwargs)

  @classmethod
  def _from_random_tensor(cls, values: Tensor, dtype: DType | str | None, **kwargs: Any) -> Tensor:
    dtype = dtypes.as_dtype(dtype) if dtype is not None else dtypes.default_float
    return cls(values.cast(dtype).lazydata, **kwargs)

  def rand_like(self, **kwargs: Any) -> Tensor:
    """Tensor.rand with this tensor's shape, dtype and device (unless given)."""
    dtype, device = kwargs.pop("dtype", self.dtype), kwargs.pop("device", self.device)
    return type(self).rand(*self.shape, dtype=dtype, device=device, **kwargs)

  def randn_like(self, **kwargs: Any) -> Tensor:
    """Tensor.randn with this tensor's shape, dtype and device (unless given)."""
    dtype, device = kwargs.pop("dtype", self.dtype), kwargs.pop("device", self.device)
    return type(self).randn(*self.shape, dtype=dtype, device=device, **kwargs)
