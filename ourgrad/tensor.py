"""Tensor: the user-facing array with PyTorch names and semantics, lazily evaluated, with autograd.

Every operation builds LazyBuffers through an autograd Function (ourgrad/function.py); nothing runs until a
value is needed (`numpy()`, `item()`, `tolist()`, `realize()`). Composite operations (softmax, matmul,
conv2d, ...) are written here from the primitives, so they fuse like everything else. Shape, axis, dtype and
device mistakes raise at the call that made them (ourgrad/errors.py).

Layout of this file: construction and conversion, autograd, movement and indexing, elementwise math,
reductions, and composite ops (matmul, softmax, ...). Neural-network ops (conv2d, pooling, normalization,
dropout, losses) live in ourgrad/nn/functional.py and are attached here as methods.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np

from ourgrad import function as F
from ourgrad.device import Buffer, Device
from ourgrad.dtype import DType, dtypes, least_upper_dtype, result_dtype, sum_dtype
from ourgrad.errors import (AutogradError, AxisError, DeviceError, DTypeError, IndexOutOfRangeError, ShapeError)
from ourgrad.helpers import DEBUG, normalize_axis, prod
from ourgrad.lazy import LazyBuffer
from ourgrad.ops import Ops

Scalar = bool | int | float


def _numpy_to_bfloat16_bits(array: np.ndarray) -> np.ndarray:
  """float data rounded to bfloat16 (nearest even), returned as the uint16 bit patterns."""
  bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32).astype(np.uint64)
  is_nan = np.isnan(array.astype(np.float32))
  rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
  # ascontiguousarray makes a 0-d array 1-d: reshape, so a 0-d bfloat16 tensor keeps shape ()
  return np.where(is_nan, np.uint16(0x7FC0), rounded).reshape(np.shape(array))


def _bfloat16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
  return (bits.astype(np.uint32) << 16).view(np.float32)


def _to_lazy(data: Any, dtype: DType | None, device: str) -> LazyBuffer:
  """A LazyBuffer holding `data` (Python scalar, nested list, or numpy array)."""
  if isinstance(data, np.generic): data = np.asarray(data)  # a numpy scalar keeps its dtype, as in PyTorch
  if isinstance(data, (bool, int, float)):
    return LazyBuffer.full(data, (), dtype or dtypes.from_py(data), device)
  if isinstance(data, (list, tuple)):
    dtype = dtype or dtypes.from_py(data)
    try:
      array = np.array(data, dtype=np.float64 if dtype.is_float else (np.bool_ if dtype.is_bool else np.int64))
    except ValueError as error:
      raise ShapeError(f"cannot make a tensor from a ragged nested list: {error}") from None
    if array.dtype == object: raise ShapeError("cannot make a tensor from a ragged nested list")
    data = array
  if isinstance(data, np.ndarray):
    dtype = dtype or dtypes.from_numpy(data.dtype)
    if dtype == dtypes.bfloat16: return LazyBuffer.from_numpy(_numpy_to_bfloat16_bits(data), dtype, device)
    return LazyBuffer.from_numpy(data.astype(dtype.np, copy=False), dtype, device)
  raise TypeError(f"cannot make a Tensor from {type(data).__name__}; pass a number, a (nested) list, a numpy "
                  f"array or a Tensor")


def _broadcast_shape(*shapes: tuple[int, ...]) -> tuple[int, ...]:
  """The shape every input broadcasts to (numpy/PyTorch rules), or ShapeError naming the shapes."""
  ndim = max(len(shape) for shape in shapes)
  padded = [(1,) * (ndim - len(shape)) + shape for shape in shapes]
  result = []
  for sizes in zip(*padded):
    non_one = {size for size in sizes if size != 1}
    if len(non_one) > 1:
      raise ShapeError(f"shapes {' and '.join(str(shape) for shape in shapes)} cannot be broadcast together: "
                       f"sizes {sorted(non_one)} meet in one dimension")
    result.append(non_one.pop() if non_one else 1)
  return tuple(result)


class Tensor:
  """A multi-dimensional array on a device, computed lazily, with automatic differentiation.

  `Tensor(data, device=None, dtype=None, requires_grad=None)` takes a number, a nested list, a numpy array,
  or a LazyBuffer. `device` defaults to `Device.DEFAULT`; `dtype` to what the data holds (float32 for Python
  floats, int32 for Python ints)."""
  __slots__ = ("lazydata", "requires_grad", "grad", "_ctx", "__weakref__")
  __array_priority__ = 1000  # make numpy defer to Tensor's reflected operators (np.float32(2) * t)
  training: bool = False
  no_grad: bool = False
  _seed: int = 0
  _rng: np.random.Generator = np.random.default_rng(0)

  def __init__(self, data: Any, device: str | None = None, dtype: DType | str | None = None,
               requires_grad: bool | None = None):
    dtype = dtypes.as_dtype(dtype) if dtype is not None else None
    device = Device.canonicalize(device) if device is not None else None
    if isinstance(data, Tensor): data = data.lazydata
    if isinstance(data, LazyBuffer):
      if device is not None and device != data.device: data = data.copy_to_device(device)
      if dtype is not None and dtype != data.dtype: data = data.cast(dtype)
      lazy = data
    else:
      lazy = _to_lazy(data, dtype, device or Device.DEFAULT)
    self.lazydata: LazyBuffer = lazy
    self.requires_grad: bool | None = requires_grad
    self.grad: Tensor | None = None
    self._ctx: F.Function | None = None
    if requires_grad and not self.dtype.is_float:
      raise DTypeError(f"only floating point tensors can require gradients, got {self.dtype}")

  # ---------------------------------------------------------------- properties and conversion

  @property
  def shape(self) -> tuple[int, ...]: return self.lazydata.shape

  @property
  def dtype(self) -> DType: return self.lazydata.dtype

  @property
  def device(self) -> str: return self.lazydata.device

  @property
  def ndim(self) -> int: return len(self.shape)

  def numel(self) -> int: return prod(self.shape)

  def size(self, dim: int | None = None) -> tuple[int, ...] | int:
    return self.shape if dim is None else self.shape[normalize_axis(dim, self.ndim)]

  def dim(self) -> int: return self.ndim

  def element_size(self) -> int: return self.dtype.itemsize

  def __len__(self) -> int:
    if not self.shape: raise TypeError("len() of a 0-d tensor")
    return self.shape[0]

  def __repr__(self) -> str:
    grad = f", requires_grad={self.requires_grad}" if self.requires_grad else ""
    return f"<Tensor shape={self.shape} dtype={self.dtype} device={self.device}{grad}>"

  def __hash__(self) -> int: return id(self)

  def __bool__(self) -> bool:
    if self.numel() != 1: raise ValueError(f"the truth value of a tensor with {self.numel()} elements is ambiguous")
    return bool(self.item())

  def realize(self, *others: Tensor) -> Tensor:
    """Compute this tensor (and `others`) now, in one schedule."""
    from ourgrad.engine.realize import run_schedule
    from ourgrad.engine.schedule import create_schedule
    start = time.perf_counter()
    schedule = create_schedule([tensor.lazydata for tensor in (self, *others)])
    scheduled = time.perf_counter()
    run_schedule(schedule)
    if DEBUG >= 1 and schedule:
      print(f"realize: {len(schedule)} items, scheduled in {(scheduled - start) * 1e3:.2f} ms, "
            f"ran in {(time.perf_counter() - scheduled) * 1e3:.2f} ms")
    return self

  @staticmethod
  def realize_all(*tensors: Tensor) -> None:
    if tensors: tensors[0].realize(*tensors[1:])

  def _buffer(self) -> Buffer:
    """The realized, contiguous buffer of this tensor's values."""
    lazy = self.lazydata
    # a contiguous view of the whole base (the base or a reshape of it) reads the base's memory as it is: no copy
    if not (lazy.st.contiguous and lazy.size == lazy.base.size): lazy = lazy.contiguous()
    if lazy.base.realized is None: Tensor(lazy).realize()
    return lazy.base.realized

  def numpy(self) -> np.ndarray:
    """The values as a numpy array (bfloat16 comes back as float32, which holds it exactly)."""
    if self.numel() == 0:
      return np.zeros(self.shape, dtype=np.float32 if self.dtype == dtypes.bfloat16 else self.dtype.np)
    values = self._buffer().numpy()
    if self.dtype == dtypes.bfloat16: values = _bfloat16_bits_to_float32(values)
    return values.reshape(self.shape).copy()

  def item(self) -> Scalar:
    if self.numel() != 1: raise ValueError(f"item() needs a tensor with one element, this one has shape {self.shape}")
    return self.numpy().reshape(()).item()

  def tolist(self) -> Any: return self.numpy().tolist()

  def to(self, device: str) -> Tensor:
    """This tensor on another device (the same tensor if already there)."""
    device = Device.canonicalize(device)
    if device == self.device: return self
    result = Tensor(self.lazydata.copy_to_device(device), requires_grad=self.requires_grad)
    if self.grad is not None: result.grad = self.grad.to(device)
    return result

  def cast(self, dtype: DType | str) -> Tensor:
    dtype = dtypes.as_dtype(dtype)
    return self if dtype == self.dtype else F.Cast.apply(self, dtype=dtype)

  def bitcast(self, dtype: DType | str) -> Tensor:
    dtype = dtypes.as_dtype(dtype)
    if self.requires_grad: raise AutogradError("bitcast is not differentiable; detach() the tensor first")
    return F.Cast.apply(self, dtype=dtype, bitcast=True)

  def float(self) -> Tensor: return self.cast(dtypes.float32)
  def half(self) -> Tensor: return self.cast(dtypes.float16)
  def int(self) -> Tensor: return self.cast(dtypes.int32)
  def long(self) -> Tensor: return self.cast(dtypes.int64)
  def bool(self) -> Tensor: return self.cast(dtypes.bool)
  def double(self) -> Tensor: return self.cast(dtypes.float64)

  def contiguous(self) -> Tensor: return F.Contiguous.apply(self)

  def clone(self) -> Tensor: return F.Contiguous.apply(self)

  def detach(self) -> Tensor: return Tensor(self.lazydata, requires_grad=False)

  def assign(self, value: Tensor | Any) -> Tensor:
    """Write `value` into this tensor's memory (the same buffer, so optimizers update weights in place)."""
    if not isinstance(value, Tensor): value = Tensor(value, device=self.device, dtype=self.dtype)
    if value.device != self.device:
      raise DeviceError(f"cannot assign a tensor on {value.device} to one on {self.device}; use .to({self.device!r})")
    if value.shape != self.shape:
      # check first, so the error names the assign and both shapes rather than failing inside expand
      broadcastable = len(value.shape) <= len(self.shape) and all(
        size in (1, target) for size, target in zip(value.shape[::-1], self.shape[::-1]))
      if not broadcastable:
        raise ShapeError(f"assign of a tensor of shape {value.shape} to one of shape {self.shape}: the value must "
                         f"have the target's shape or broadcast to it")
      value = value.expand(self.shape)
    value = value.cast(self.dtype)
    target = self.lazydata
    if target.is_base and target.realized is not None and target.op is not Ops.CONST:
      self.lazydata = target.assign(value.lazydata)
    else:
      self.lazydata = value.lazydata
    return self

  # ---------------------------------------------------------------- creation

  @staticmethod
  def _shape_arg(shape: tuple) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)): shape = tuple(shape[0])
    for size in shape:
      if not isinstance(size, (int, np.integer)) or size < 0:
        raise ShapeError(f"shape sizes must be non-negative integers, got {shape}")
    return tuple(int(size) for size in shape)

  @staticmethod
  def empty(*shape: int, dtype: DType | str | None = None, device: str | None = None, **kwargs: Any) -> Tensor:
    dtype = dtypes.as_dtype(dtype) if dtype is not None else dtypes.default_float
    device = Device.canonicalize(device or Device.DEFAULT)
    return Tensor(LazyBuffer.empty(Tensor._shape_arg(shape), dtype, device), **kwargs)

  @staticmethod
  def full(shape: tuple[int, ...] | int, fill_value: Scalar, dtype: DType | str | None = None,
           device: str | None = None, **kwargs: Any) -> Tensor:
    shape = Tensor._shape_arg((shape,) if isinstance(shape, int) else tuple(shape))
    dtype = dtypes.as_dtype(dtype) if dtype is not None else dtypes.from_py(fill_value)
    device = Device.canonicalize(device or Device.DEFAULT)
    return Tensor(LazyBuffer.full(fill_value, shape, dtype, device), **kwargs)

  @staticmethod
  def zeros(*shape: int, dtype: DType | str | None = None, **kwargs: Any) -> Tensor:
    return Tensor.full(Tensor._shape_arg(shape), 0, dtype or dtypes.default_float, **kwargs)

  @staticmethod
  def ones(*shape: int, dtype: DType | str | None = None, **kwargs: Any) -> Tensor:
    return Tensor.full(Tensor._shape_arg(shape), 1, dtype or dtypes.default_float, **kwargs)

  def full_like(self, fill_value: Scalar, dtype: DType | str | None = None, **kwargs: Any) -> Tensor:
    return Tensor.full(self.shape, fill_value, dtype or self.dtype, device=kwargs.pop("device", self.device), **kwargs)

  def zeros_like(self, **kwargs: Any) -> Tensor: return self.full_like(0, **kwargs)
  def ones_like(self, **kwargs: Any) -> Tensor: return self.full_like(1, **kwargs)

  @staticmethod
  def arange(start: Scalar, stop: Scalar | None = None, step: Scalar = 1, dtype: DType | str | None = None,
             device: str | None = None, **kwargs: Any) -> Tensor:
    """start, start+step, ... < stop, like torch.arange (int32 for integer arguments, float32 otherwise)."""
    if stop is None: start, stop = 0, start
    if step == 0: raise ValueError("arange step must be non-zero")
    count = max(math.ceil((stop - start) / step), 0)
    is_float = any(isinstance(value, float) for value in (start, stop, step))
    dtype = dtypes.as_dtype(dtype) if dtype is not None else (dtypes.default_float if is_float else dtypes.default_int)
    # computed on the host: exact in every dtype and O(n); a lazy form would cost O(n^2) work per element
    values = start + np.arange(count, dtype=np.float64 if is_float else np.int64) * step
    if dtype == dtypes.bfloat16: return Tensor(values, device=device, dtype=dtype, **kwargs)
    return Tensor(values.astype(dtype.np), device=device, dtype=dtype, **kwargs)

  @staticmethod
  def linspace(start: Scalar, stop: Scalar, steps: int, dtype: DType | str | None = None,
               device: str | None = None, **kwargs: Any) -> Tensor:
    dtype = dtypes.as_dtype(dtype) if dtype is not None else dtypes.default_float
    if steps < 0: raise ValueError(f"linspace needs steps >= 0, got {steps}")
    if steps == 1: return Tensor.full((1,), start, dtype, device=device, **kwargs)
    index = Tensor.arange(steps, device=device).cast(dtypes.float64)
    values = index * ((stop - start) / (steps - 1)) + start
    return Tensor(values.cast(dtype).lazydata, **kwargs)

  @staticmethod
  def eye(n: int, m: int | None = None, dtype: DType | str | None = None, device: str | None = None,
          **kwargs: Any) -> Tensor:
    m = n if m is None else m
    rows = Tensor.arange(n, device=device).reshape(n, 1)
    cols = Tensor.arange(m, device=device).reshape(1, m)
    return Tensor((rows == cols).cast(dtype or dtypes.default_float).lazydata, **kwargs)

  # random numbers come from one numpy generator seeded by manual_seed, so runs are reproducible
  @staticmethod
  def manual_seed(seed: int = 0) -> None:
    Tensor._seed = seed
    Tensor._rng = np.random.default_rng(seed)

  @staticmethod
  def _from_random(values: np.ndarray, dtype: DType | str | None, device: str | None, **kwargs: Any) -> Tensor:
    dtype = dtypes.as_dtype(dtype) if dtype is not None else dtypes.default_float
    return Tensor(values, device=device, dtype=dtype, **kwargs)

  @staticmethod
  def rand(*shape: int, dtype: DType | str | None = None, device: str | None = None, **kwargs: Any) -> Tensor:
    """Uniform in [0, 1)."""
    values = Tensor._rng.random(Tensor._shape_arg(shape), dtype=np.float32)
    return Tensor._from_random(values, dtype, device, **kwargs)

  @staticmethod
  def randn(*shape: int, dtype: DType | str | None = None, device: str | None = None, **kwargs: Any) -> Tensor:
    """Standard normal."""
    values = Tensor._rng.standard_normal(Tensor._shape_arg(shape), dtype=np.float32)
    return Tensor._from_random(values, dtype, device, **kwargs)

  @staticmethod
  def randint(low: int, high: int | None = None, size: tuple[int, ...] = (), dtype: DType | str | None = None,
              device: str | None = None, **kwargs: Any) -> Tensor:
    """Integers in [low, high) (or [0, low) with one bound), like torch.randint."""
    if high is None: low, high = 0, low
    if high <= low: raise ValueError(f"randint needs low < high, got {low} and {high}")
    values = Tensor._rng.integers(low, high, size=Tensor._shape_arg(tuple(size)))
    return Tensor(values, device=device, dtype=dtype or dtypes.default_int, **kwargs)

  @staticmethod
  def uniform(*shape: int, low: float = 0.0, high: float = 1.0, dtype: DType | str | None = None,
              device: str | None = None, **kwargs: Any) -> Tensor:
    values = Tensor._rng.uniform(low, high, Tensor._shape_arg(shape)).astype(np.float32)
    return Tensor._from_random(values, dtype, device, **kwargs)

  @staticmethod
  def normal(*shape: int, mean: float = 0.0, std: float = 1.0, dtype: DType | str | None = None,
             device: str | None = None, **kwargs: Any) -> Tensor:
    values = Tensor._rng.normal(mean, std, Tensor._shape_arg(shape)).astype(np.float32)
    return Tensor._from_random(values, dtype, device, **kwargs)

  def rand_like(self, **kwargs: Any) -> Tensor:
    return Tensor.rand(*self.shape, dtype=kwargs.pop("dtype", self.dtype), device=kwargs.pop("device", self.device),
                       **kwargs)

  def randn_like(self, **kwargs: Any) -> Tensor:
    return Tensor.randn(*self.shape, dtype=kwargs.pop("dtype", self.dtype), device=kwargs.pop("device", self.device),
                        **kwargs)

  # ---------------------------------------------------------------- autograd

  def _toposort(self) -> list[Tensor]:
    """Tensors that lead to this one through recorded Functions, inputs first (iterative, no recursion limit)."""
    order: list[Tensor] = []
    visited: set[int] = set()
    stack: list[tuple[Tensor, bool]] = [(self, False)]
    while stack:
      tensor, children_done = stack.pop()
      if children_done:
        order.append(tensor)
        continue
      if id(tensor) in visited: continue
      visited.add(id(tensor))
      if tensor._ctx is None: continue
      stack.append((tensor, True))
      stack.extend((parent, False) for parent in tensor._ctx.parents)
    return order

  def backward(self, gradient: Tensor | None = None) -> Tensor:
    """Accumulate d(self)/d(leaf) into `.grad` of every leaf that requires grad."""
    if gradient is None:
      if self.numel() != 1:
        raise AutogradError(f"backward() without a gradient needs a scalar (one-element) tensor, this one has "
                            f"shape {self.shape}; pass gradient=Tensor.ones_like(t) or reduce it first (.sum())")
      gradient = Tensor.full(self.shape, 1.0, self.dtype, device=self.device)
    if not self.requires_grad and self._ctx is None:
      raise AutogradError("backward() on a tensor that does not require grad: no input has requires_grad=True, or "
                          "every path to one goes through an op without a gradient (comparisons, argmax/argmin, "
                          "casts to integer or bool, floor/ceil/round/trunc/sign, detach())")
    if gradient.shape != self.shape:
      raise ShapeError(f"backward gradient of shape {gradient.shape} does not match the tensor's shape {self.shape}")
    grads: dict[int, Tensor] = {id(self): gradient}
    for tensor in reversed(self._toposort()):
      grad_output = grads.pop(id(tensor), None)
      if grad_output is None: continue
      ctx = tensor._ctx
      assert ctx is not None
      input_grads = ctx.backward(grad_output.lazydata)
      if not isinstance(input_grads, tuple): input_grads = (input_grads,)
      for parent, parent_grad in zip(ctx.parents, input_grads):
        if parent_grad is None or not parent.requires_grad: continue
        if parent_grad.shape != parent.shape: raise AssertionError(f"grad shape {parent_grad.shape} != {parent.shape}")
        new_grad = Tensor(parent_grad, device=self.device, requires_grad=False)
        if parent._ctx is None:  # a leaf: accumulate into .grad
          parent.grad = new_grad if parent.grad is None else (parent.grad + new_grad)
        else:
          grads[id(parent)] = new_grad if id(parent) not in grads else grads[id(parent)] + new_grad
      tensor._ctx = None  # free the graph, as PyTorch does without retain_graph
    return self

  @staticmethod
  @contextmanager
  def no_grad_context() -> Iterator[None]:
    previous = Tensor.no_grad
    Tensor.no_grad = True
    try:
      yield
    finally:
      Tensor.no_grad = previous

  @staticmethod
  @contextmanager
  def train(mode: bool = True) -> Iterator[None]:
    previous = Tensor.training
    Tensor.training = mode
    try:
      yield
    finally:
      Tensor.training = previous

  # ---------------------------------------------------------------- movement

  def _axis(self, axis: int) -> int: return normalize_axis(axis, self.ndim)

  def reshape(self, *shape: int | Sequence[int]) -> Tensor:
    """A view with a new shape; one size may be -1 (inferred)."""
    new_shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
    if sum(1 for size in new_shape if size == -1) > 1: raise ShapeError(f"reshape to {new_shape}: at most one -1")
    if any(not isinstance(size, (int, np.integer)) or size < -1 for size in new_shape):
      raise ShapeError(f"reshape to {new_shape}: sizes must be integers >= -1")
    if -1 in new_shape:
      known = prod(size for size in new_shape if size != -1)
      if known == 0 or self.numel() % known != 0:
        raise ShapeError(f"cannot reshape {self.shape} ({self.numel()} elements) to {new_shape}")
      new_shape = tuple(self.numel() // known if size == -1 else size for size in new_shape)
    new_shape = tuple(int(size) for size in new_shape)
    if prod(new_shape) != self.numel():
      raise ShapeError(f"cannot reshape {self.shape} ({self.numel()} elements) to {new_shape} "
                       f"({prod(new_shape)} elements)")
    return self if new_shape == self.shape else F.Reshape.apply(self, shape=new_shape)

  def view(self, *shape: int | Sequence[int]) -> Tensor: return self.reshape(*shape)

  def permute(self, *order: int | Sequence[int]) -> Tensor:
    axes = tuple(order[0]) if len(order) == 1 and isinstance(order[0], (tuple, list)) else tuple(order)
    if len(axes) != self.ndim:
      raise AxisError(f"permute of a tensor with {self.ndim} dimensions got {len(axes)} axes: {axes}")
    axes = tuple(self._axis(axis) for axis in axes)
    if sorted(axes) != list(range(self.ndim)): raise AxisError(f"permute axes {axes} are not a permutation")
    return self if axes == tuple(range(self.ndim)) else F.Permute.apply(self, order=axes)

  def expand(self, *shape: int | Sequence[int]) -> Tensor:
    """Broadcast size-1 dimensions to `shape` (-1 keeps a size); no data is copied."""
    new_shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
    if len(new_shape) < self.ndim:
      raise ShapeError(f"cannot expand shape {self.shape} to {new_shape}: fewer dimensions")
    padded = (1,) * (len(new_shape) - self.ndim) + self.shape
    final = tuple(old if new == -1 else new for old, new in zip(padded, new_shape))
    for old, new in zip(padded, final):
      if old != new and old != 1: raise ShapeError(f"cannot expand shape {self.shape} to {new_shape}")
    reshaped = self.reshape(padded)
    return reshaped if final == padded else F.Expand.apply(reshaped, shape=final)

  def broadcast_to(self, shape: Sequence[int]) -> Tensor: return self.expand(tuple(shape))

  def transpose(self, dim0: int = -2, dim1: int = -1) -> Tensor:
    order = list(range(self.ndim))
    dim0, dim1 = self._axis(dim0), self._axis(dim1)
    order[dim0], order[dim1] = order[dim1], order[dim0]
    return self.permute(order)

  @property
  def T(self) -> Tensor:  # noqa: N802
    """All dimensions reversed (the matrix transpose for 2-D tensors)."""
    return self.permute(tuple(reversed(range(self.ndim))))

  def flip(self, *dims: int | Sequence[int]) -> Tensor:
    axes = tuple(dims[0]) if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else tuple(dims)
    axes = {self._axis(axis) for axis in axes}
    return F.Flip.apply(self, axes_mask=tuple(axis in axes for axis in range(self.ndim)))

  def shrink(self, arg: Sequence[tuple[int, int] | None]) -> Tensor:
    """Keep [start, end) of each dimension (None keeps all)."""
    if len(arg) != self.ndim: raise ShapeError(f"shrink of shape {self.shape} needs {self.ndim} ranges, got {arg}")
    bounds = tuple((0, size) if bound is None else tuple(bound) for bound, size in zip(arg, self.shape))
    for (start, end), size in zip(bounds, self.shape):
      if not 0 <= start <= end <= size: raise ShapeError(f"shrink {bounds} is outside shape {self.shape}")
    if all(bound == (0, size) for bound, size in zip(bounds, self.shape)): return self
    return F.Shrink.apply(self, arg=bounds)

  def pad(self, padding: Sequence[int] | Sequence[tuple[int, int] | None], value: Scalar = 0.0) -> Tensor:
    """Pad with `value`. `padding` is PyTorch's flat form (last dim first: (left, right, top, bottom, ...)) or
    one (before, after) pair (or None) per dimension. Negative amounts crop."""
    if all(isinstance(amount, (int, np.integer)) for amount in padding):
      if len(padding) % 2 or len(padding) // 2 > self.ndim:
        raise ShapeError(f"pad {tuple(padding)} needs an even count of at most {2 * self.ndim} values")
      pairs = [(0, 0)] * self.ndim
      for index in range(len(padding) // 2): pairs[self.ndim - 1 - index] = (padding[2 * index], padding[2 * index + 1])
    else:
      if len(padding) != self.ndim: raise ShapeError(f"pad of shape {self.shape} needs {self.ndim} pairs: {padding}")
      pairs = [(0, 0) if pair is None else tuple(pair) for pair in padding]
    crop = [(-min(before, 0), size + min(after, 0)) for (before, after), size in zip(pairs, self.shape)]
    x = self.shrink(crop) if any(b < 0 or a < 0 for b, a in pairs) else self
    grow = tuple((max(before, 0), max(after, 0)) for before, after in pairs)
    if all(pair == (0, 0) for pair in grow): return x
    padded = F.Pad.apply(x, arg=grow)
    if value == 0: return padded
    inside = F.Pad.apply(Tensor.ones(*x.shape, dtype=dtypes.bool, device=x.device), arg=grow)
    return inside.where(padded, value)

  def squeeze(self, dim: int | None = None) -> Tensor:
    if dim is None: return self.reshape(tuple(size for size in self.shape if size != 1))
    if self.ndim == 0: return self
    axis = self._axis(dim)
    if self.shape[axis] != 1: return self
    return self.reshape(self.shape[:axis] + self.shape[axis + 1:])

  def unsqueeze(self, dim: int) -> Tensor:
    axis = normalize_axis(dim, self.ndim + 1)
    return self.reshape(self.shape[:axis] + (1,) + self.shape[axis:])

  def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    if self.ndim == 0: return self.reshape(1)
    start, end = self._axis(start_dim), self._axis(end_dim)
    return self.reshape(self.shape[:start] + (prod(self.shape[start:end + 1]),) + self.shape[end + 1:])

  def unflatten(self, dim: int, sizes: Sequence[int]) -> Tensor:
    axis = self._axis(dim)
    return self.reshape(self.shape[:axis] + tuple(sizes) + self.shape[axis + 1:])

  def repeat(self, *repeats: int | Sequence[int]) -> Tensor:
    """Tile the tensor `repeats[i]` times along dimension i (torch.Tensor.repeat)."""
    counts = tuple(repeats[0]) if len(repeats) == 1 and isinstance(repeats[0], (tuple, list)) else tuple(repeats)
    if len(counts) < self.ndim:
      raise ShapeError(f"repeat needs at least {self.ndim} counts for shape {self.shape}, got {counts}")
    base_shape = (1,) * (len(counts) - self.ndim) + self.shape
    x = self.reshape(base_shape)
    interleaved = tuple(size for pair in zip((1,) * len(counts), base_shape) for size in pair)
    expanded = tuple(size for pair in zip(counts, base_shape) for size in pair)
    return x.reshape(interleaved).expand(expanded).reshape(tuple(c * s for c, s in zip(counts, base_shape)))

  def _stride_axis(self, axis: int, step: int) -> Tensor:
    """Every `step`-th element along `axis`, starting at the first."""
    size = self.shape[axis]
    kept = math.ceil(size / step)
    padded = self.pad([(0, kept * step - size) if a == axis else None for a in range(self.ndim)])
    split = padded.reshape(self.shape[:axis] + (kept, step) + self.shape[axis + 1:])
    picked = split.shrink([(0, 1) if a == axis + 1 else None for a in range(split.ndim)])
    return picked.reshape(self.shape[:axis] + (kept,) + self.shape[axis + 1:])

  # ---------------------------------------------------------------- indexing

  def _normalize_index(self, index: Any) -> list[Any]:
    items = list(index) if isinstance(index, tuple) else [index]
    items = [Tensor(item, device=self.device) if isinstance(item, (list, np.ndarray)) else item for item in items]
    ellipsis_count = sum(1 for item in items if item is Ellipsis)
    if ellipsis_count > 1: raise IndexError("an index can only have a single ellipsis ('...')")
    used = sum(1 for item in items if item is not None and item is not Ellipsis)
    if used > self.ndim:
      raise IndexOutOfRangeError(f"too many indices for a tensor of shape {self.shape}: {used} given")
    if ellipsis_count:
      position = items.index(Ellipsis)
      items[position:position + 1] = [slice(None)] * (self.ndim - used)
      return items
    return items + [slice(None)] * (self.ndim - used)  # unindexed trailing dims are kept whole

  def _basic_index_steps(self, items: list[Any]) -> tuple[list[tuple[Any, Any]], list[tuple[int, Tensor]]]:
    """The view steps of basic indexing as (forward, inverse) pairs of functions on Tensors, plus the integer
    tensor indices left for advanced indexing (with the dimension each applies to after the steps). The
    inverses let __setitem__ put a value back where getitem would have read it."""
    steps: list[tuple[Any, Any]] = []
    tensor_dims: list[tuple[int, Tensor]] = []
    shape, dim = list(self.shape), 0
    for item_number, item in enumerate(items):
      if item is None:
        steps.append((lambda t, d=dim: t.unsqueeze(d), lambda t, d=dim: t.squeeze(d)))
        shape.insert(dim, 1)
        dim += 1
      elif isinstance(item, Tensor):
        if item.dtype.is_float: raise IndexError(f"tensors used as indices must be integers, got {item.dtype}")
        if item.dtype == dtypes.bool:
          raise IndexError("boolean mask indexing gives a data-dependent shape; use Tensor.where instead")
        tensor_dims.append((dim, item))
        dim += 1
      elif isinstance(item, (bool, np.bool_)):
        raise IndexError("a Python bool is not a valid index")
      elif isinstance(item, (int, np.integer)):
        size = shape[dim]
        position = int(item) + size if item < 0 else int(item)
        if not 0 <= position < size:
          # name the dimension of the indexed tensor, not of the partly indexed view `dim` counts in
          source_dim = sum(1 for earlier in items[:item_number] if earlier is not None)
          raise IndexOutOfRangeError(f"index {item} is out of range for dimension {source_dim} with size {size} "
                                     f"(tensor shape {self.shape})")
        steps.append(_narrow_step(dim, position, position + 1, size))
        steps.append((lambda t, d=dim: t.squeeze(d), lambda t, d=dim: t.unsqueeze(d)))
        shape.pop(dim)
        tensor_dims = [(d - 1 if d > dim else d, t) for d, t in tensor_dims]
      elif isinstance(item, slice):
        size = shape[dim]
        start, stop, step = item.indices(size)
        if step > 0:
          low, high = start, max(stop, start)
        else:
          low, high = stop + 1, max(start + 1, stop + 1)  # a negative step walks high-1 down to low
        steps.append(_narrow_step(dim, low, high, size))
        if step < 0: steps.append((lambda t, d=dim: t.flip(d), lambda t, d=dim: t.flip(d)))
        length = high - low
        if abs(step) > 1 and length > 0:
          steps.append(_stride_step(dim, abs(step), length))
          length = math.ceil(length / abs(step))
        shape[dim] = length
        dim += 1
      else:
        raise IndexError(f"cannot index a tensor with {type(item).__name__}; use ints, slices, None, ... or tensors")
    return steps, tensor_dims

  def __getitem__(self, index: Any) -> Tensor:
    """Basic indexing (ints, slices with steps, None, Ellipsis) as views, and integer-Tensor indexing."""
    steps, tensor_dims = self._basic_index_steps(self._normalize_index(index))
    x = self
    for forward, _ in steps: x = forward(x)
    return x._index_with_tensors(tensor_dims) if tensor_dims else x

  def _index_with_tensors(self, tensor_dims: list[tuple[int, Tensor]]) -> Tensor:
    """Advanced (integer tensor) indexing, numpy rules: the broadcast index shape replaces the indexed dims,
    in place if they were adjacent, else at the front. Computed as a masked sum (one kernel), no gather op."""
    dims = [dim for dim, _ in tensor_dims]
    index_shape = _broadcast_shape(*(index.shape for _, index in tensor_dims))
    rest = [axis for axis in range(self.ndim) if axis not in dims]
    x = self.permute(rest + dims)  # (rest..., indexed...)
    sizes = [self.shape[dim] for dim in dims]
    batch = len(index_shape)
    picked = None
    for number, (dim, index) in enumerate(tensor_dims):
      size = self.shape[dim]
      index = index.cast(dtypes.int32).expand(index_shape)
      index = (index < 0).where(index + size, index)
      positions = Tensor.arange(size, device=self.device)
      shape = (1,) * len(index_shape) + tuple(size if n == number else 1 for n in range(len(dims)))
      one_hot = index.reshape(index_shape + (1,) * len(dims)) == positions.reshape(shape)
      picked = one_hot if picked is None else (picked & one_hot)
    assert picked is not None
    values = x.reshape(tuple(x.shape[:len(rest)]) + (1,) * batch + tuple(sizes))
    chosen = picked.where(values, 0) if self.dtype != dtypes.bool else picked.where(values.cast(dtypes.int32), 0)
    summed = chosen.sum(axis=tuple(range(len(rest) + batch, len(rest) + batch + len(dims))), dtype=chosen.dtype)
    result = summed.cast(self.dtype)
    adjacent = dims == list(range(dims[0], dims[0] + len(dims)))
    if adjacent and dims[0] > 0:
      # move the index dims to where the indexed dims were
      order = list(range(len(rest)))
      order = order[:dims[0]] + list(range(len(rest), len(rest) + batch)) + order[dims[0]:]
      result = result.permute(order)
    elif not adjacent or dims[0] == 0:
      order = list(range(len(rest), len(rest) + batch)) + list(range(len(rest)))
      result = result.permute(order)
    return result

  def __setitem__(self, index: Any, value: Tensor | Scalar) -> None:
    """`t[index] = value` for basic indices (ints, slices, None, ...). The value is put back into place by
    the inverse view steps and merged with `where`: one fused elementwise kernel writing this tensor's buffer."""
    steps, tensor_dims = self._basic_index_steps(self._normalize_index(index))
    if tensor_dims:
      raise NotImplementedError("assignment through tensor indices is not supported; build a mask and use where")
    selected = self
    for forward, _ in steps: selected = forward(selected)
    value = value if isinstance(value, Tensor) else Tensor(value, device=self.device, dtype=self.dtype)
    if value.device != self.device:
      raise DeviceError(f"cannot assign a tensor on {value.device} into one on {self.device}; use .to()")
    value = value.cast(self.dtype).expand(selected.shape)
    inside = Tensor.full(selected.shape, True, dtypes.bool, device=self.device)
    for _, inverse in reversed(steps): value, inside = inverse(value), inverse(inside)
    self.assign(inside.where(value, self.detach()))

  def gather(self, dim: int, index: Tensor) -> Tensor:
    """out[i][j] = self[i][index[i][j]] along `dim` (torch.gather)."""
    axis = self._axis(dim)
    if index.ndim != self.ndim:
      raise ShapeError(f"gather index must have {self.ndim} dims like the input {self.shape}, got {index.shape}")
    for a, (size, index_size) in enumerate(zip(self.shape, index.shape)):
      if a != axis and index_size > size:
        raise ShapeError(f"gather index shape {index.shape} exceeds input shape {self.shape} in dim {a}")
    x = self.shrink([(0, index.shape[a]) if a != axis else None for a in range(self.ndim)])
    x_last = x.transpose(axis, -1).unsqueeze(-2)            # (..., 1, n)
    index_last = index.transpose(axis, -1).unsqueeze(-1)    # (..., k, 1)
    size = self.shape[axis]
    index_last = (index_last < 0).where(index_last + size, index_last)
    one_hot = index_last == Tensor.arange(size, device=self.device)
    values = x_last if self.dtype != dtypes.bool else x_last.cast(dtypes.int32)
    picked = one_hot.where(values, 0).sum(-1, dtype=values.dtype).cast(self.dtype)
    return picked.transpose(axis, -1)

  # ---------------------------------------------------------------- joining and splitting

  @staticmethod
  def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Join tensors along `dim` (pad each into place and add: one fused kernel)."""
    if not tensors: raise ValueError("cat needs at least one tensor")
    first = tensors[0]
    axis = first._axis(dim)
    for tensor in tensors[1:]:
      if tensor.ndim != first.ndim or any(a != axis and s != t for a, (s, t) in enumerate(zip(first.shape,
                                                                                            tensor.shape))):
        raise ShapeError(f"cat along dim {axis} needs equal other sizes, got {first.shape} and {tensor.shape}")
      if tensor.device != first.device:
        raise DeviceError(f"cat of tensors on {first.device} and {tensor.device}; move them with .to()")
    dtype = least_upper_dtype(*(tensor.dtype for tensor in tensors))
    total = sum(tensor.shape[axis] for tensor in tensors)
    result, offset = None, 0
    for tensor in tensors:
      pads = [(offset, total - offset - tensor.shape[axis]) if a == axis else None for a in range(first.ndim)]
      piece = tensor.cast(dtype if dtype != dtypes.bool else dtypes.uint8).pad(pads)
      result = piece if result is None else result + piece
      offset += tensor.shape[axis]
    assert result is not None
    return result.cast(dtype)

  def cat_with(self, *others: Tensor, dim: int = 0) -> Tensor: return Tensor.cat([self, *others], dim=dim)

  @staticmethod
  def stack(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    if not tensors: raise ValueError("stack needs at least one tensor")
    for tensor in tensors[1:]:
      if tensor.shape != tensors[0].shape:
        raise ShapeError(f"stack needs tensors of one shape, got {tensors[0].shape} and {tensor.shape}")
    axis = normalize_axis(dim, tensors[0].ndim + 1)
    return Tensor.cat([tensor.unsqueeze(axis) for tensor in tensors], dim=axis)

  def split(self, split_size: int | Sequence[int], dim: int = 0) -> tuple[Tensor, ...]:
    axis = self._axis(dim)
    size = self.shape[axis]
    if isinstance(split_size, int):
      if split_size <= 0: raise ValueError(f"split size must be positive, got {split_size}")
      sizes = [min(split_size, size - start) for start in range(0, size, split_size)] or [0]
    else:
      sizes = list(split_size)
      if sum(sizes) != size: raise ShapeError(f"split sizes {sizes} do not add up to dim {axis} of size {size}")
    pieces, start = [], 0
    for piece_size in sizes:
      pieces.append(self.shrink([(start, start + piece_size) if a == axis else None for a in range(self.ndim)]))
      start += piece_size
    return tuple(pieces)

  def chunk(self, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
    if chunks <= 0: raise ValueError(f"chunk count must be positive, got {chunks}")
    size = self.shape[self._axis(dim)]
    return self.split(max(math.ceil(size / chunks), 1), dim)

  # ---------------------------------------------------------------- elementwise plumbing

  def _to_tensor(self, other: Any) -> Tensor:
    if isinstance(other, Tensor): return other
    if isinstance(other, (bool, int, float, np.generic)) and not isinstance(other, np.ndarray):
      value = other.item() if isinstance(other, np.generic) else other
      return Tensor(LazyBuffer.full(value, (), result_dtype(self.dtype, value), self.device))
    return Tensor(other, device=self.device)

  def _broadcasted(self, other: Any, reverse: bool = False) -> tuple[Tensor, Tensor]:
    """Both operands as tensors of one dtype (promoted) and one shape (broadcast)."""
    other_tensor = self._to_tensor(other)
    if other_tensor.device != self.device:
      raise DeviceError(f"tensors on different devices: {self.device} and {other_tensor.device}; move one with "
                        f".to({self.device!r})")
    x, y = (other_tensor, self) if reverse else (self, other_tensor)
    dtype = least_upper_dtype(x.dtype, y.dtype)
    shape = _broadcast_shape(x.shape, y.shape)
    return x.cast(dtype).expand(shape), y.cast(dtype).expand(shape)

  def _float_operand(self) -> Tensor:
    """Float math on ints and bools promotes to the default float, as in PyTorch."""
    return self if self.dtype.is_float else self.cast(dtypes.default_float)

  def _check_integer(self, name: str) -> None:
    if self.dtype.is_float:
      raise DTypeError(f"{name} is only defined for integer and bool tensors, got {self.dtype}")

  @staticmethod
  def _check_divisor(divisor: Any, dtype: DType, name: str) -> None:
    """Integer division by a Python zero raises here, as in PyTorch. Kernels cannot raise: an integer division by a
    zero inside a tensor divisor gives 0 (PyTorch raises on the CPU)."""
    if not dtype.is_float and isinstance(divisor, (int, np.integer)) and divisor == 0:
      raise ZeroDivisionError(f"integer {name} by zero ({dtype}); use a float tensor to get inf/nan")

  # ---------------------------------------------------------------- arithmetic

  def add(self, other: Any, reverse: bool = False) -> Tensor:
    x, y = self._broadcasted(other, reverse)
    if x.dtype == dtypes.bool: return x | y
    return F.Add.apply(x, y)

  def sub(self, other: Any, reverse: bool = False) -> Tensor:
    x, y = self._broadcasted(other, reverse)
    if x.dtype == dtypes.bool: raise DTypeError("subtraction of bool tensors is not supported; use ^ or logical_xor")
    return F.Sub.apply(x, y)

  def mul(self, other: Any, reverse: bool = False) -> Tensor:
    x, y = self._broadcasted(other, reverse)
    if x.dtype == dtypes.bool: return x & y
    return F.Mul.apply(x, y)

  def div(self, other: Any, reverse: bool = False, rounding_mode: str | None = None) -> Tensor:
    """True division (ints promote to float); rounding_mode "trunc" or "floor" as in torch.div."""
    x, y = self._broadcasted(other, reverse)
    if rounding_mode is not None and not reverse: self._check_divisor(other, x.dtype, "division")
    if rounding_mode == "floor": return x.floor_divide(y)
    if rounding_mode == "trunc":
      if not x.dtype.is_float: return F.IntDiv.apply(x, y, op=Ops.IDIV)
      return F.Div.apply(x, y).trunc()
    if rounding_mode is not None:
      raise ValueError(f"rounding_mode must be None, 'trunc' or 'floor', got {rounding_mode}")
    return F.Div.apply(x._float_operand(), y._float_operand())

  def floor_divide(self, other: Any, reverse: bool = False) -> Tensor:
    """a // b rounding toward minus infinity (PyTorch and Python semantics)."""
    x, y = self._broadcasted(other, reverse)
    if not reverse: self._check_divisor(other, x.dtype, "division")
    if x.dtype.is_float: return F.Div.apply(x, y).floor()
    if x.dtype == dtypes.bool: raise DTypeError("floor division of bool tensors is not supported")
    quotient = F.IntDiv.apply(x, y, op=Ops.IDIV)
    remainder = F.IntDiv.apply(x, y, op=Ops.MOD)
    # C truncates toward zero: step down where the remainder is non-zero and the signs differ
    if x.dtype.is_unsigned: return quotient
    adjust = (remainder != 0) & ((remainder < 0) != (y < 0))
    return adjust.where(quotient - 1, quotient)

  def remainder(self, other: Any, reverse: bool = False) -> Tensor:
    """a % b with the sign of b (PyTorch's remainder and Python's %)."""
    x, y = self._broadcasted(other, reverse)
    if not reverse: self._check_divisor(other, x.dtype, "modulo")
    if x.dtype.is_float: return x - (x / y).floor() * y
    if x.dtype == dtypes.bool: raise DTypeError("remainder of bool tensors is not supported")
    remainder = F.IntDiv.apply(x, y, op=Ops.MOD)
    if x.dtype.is_unsigned: return remainder
    adjust = (remainder != 0) & ((remainder < 0) != (y < 0))
    return adjust.where(remainder + y, remainder)

  def fmod(self, other: Any) -> Tensor:
    """Remainder with the sign of the dividend (C's fmod / torch.fmod)."""
    x, y = self._broadcasted(other)
    self._check_divisor(other, x.dtype, "modulo")
    if x.dtype.is_float: return x - (x / y).trunc() * y
    return F.IntDiv.apply(x, y, op=Ops.MOD)

  def pow(self, exponent: Any, reverse: bool = False) -> Tensor:
    """x ** y. Integer tensors to non-negative integer powers stay integers; otherwise float math with the
    sign of negative bases handled for integer exponents, as in PyTorch."""
    if not reverse and isinstance(exponent, int) and not self.dtype.is_float and exponent >= 0:
      result, base, power = self.ones_like(), self, exponent
      while power:  # square-and-multiply: exact for integers
        if power & 1: result = result * base
        base, power = base * base, power >> 1
      return result
    if not reverse and isinstance(exponent, (int, float)) and exponent in (0, 1, 2, 0.5, -1):
      x = self._float_operand() if exponent in (0.5, -1) or isinstance(exponent, float) else self
      if exponent == 0: return x.ones_like()
      if exponent == 1: return x
      if exponent == 2: return x * x
      if exponent == 0.5: return x.sqrt()
      return x.reciprocal()
    base, power = self._broadcasted(exponent, reverse)
    if not base.dtype.is_float: base, power = base._float_operand(), power._float_operand()
    magnitude = (power * base.abs().log()).exp()
    # a negative base with an odd integer power is negative; with a non-integer power it is NaN
    is_integer_power = power.floor() == power
    odd = is_integer_power & ((power.abs() % 2) == 1)
    signed = ((base < 0) & odd).where(-magnitude, magnitude)
    nan_case = (base < 0) & ~is_integer_power
    result = nan_case.where(math.nan, signed)
    return ((power == 0) | (base == 1)).where(1.0, result)

  def __add__(self, other: Any) -> Tensor: return self.add(other)
  def __radd__(self, other: Any) -> Tensor: return self.add(other, reverse=True)
  def __sub__(self, other: Any) -> Tensor: return self.sub(other)
  def __rsub__(self, other: Any) -> Tensor: return self.sub(other, reverse=True)
  def __mul__(self, other: Any) -> Tensor: return self.mul(other)
  def __rmul__(self, other: Any) -> Tensor: return self.mul(other, reverse=True)
  def __truediv__(self, other: Any) -> Tensor: return self.div(other)
  def __rtruediv__(self, other: Any) -> Tensor: return self.div(other, reverse=True)
  def __floordiv__(self, other: Any) -> Tensor: return self.floor_divide(other)
  def __rfloordiv__(self, other: Any) -> Tensor: return self.floor_divide(other, reverse=True)
  def __mod__(self, other: Any) -> Tensor: return self.remainder(other)
  def __rmod__(self, other: Any) -> Tensor: return self.remainder(other, reverse=True)
  def __pow__(self, other: Any) -> Tensor: return self.pow(other)
  def __rpow__(self, other: Any) -> Tensor: return self.pow(other, reverse=True)
  def __matmul__(self, other: Tensor) -> Tensor: return self.matmul(other)
  def __rmatmul__(self, other: Tensor) -> Tensor: return self._to_tensor(other).matmul(self)
  def __neg__(self) -> Tensor: return self.neg()
  def __abs__(self) -> Tensor: return self.abs()
  def __pos__(self) -> Tensor: return self

  def __iadd__(self, other: Any) -> Tensor: return self.assign(self + other)
  def __isub__(self, other: Any) -> Tensor: return self.assign(self - other)
  def __imul__(self, other: Any) -> Tensor: return self.assign(self * other)
  def __itruediv__(self, other: Any) -> Tensor: return self.assign(self / other)

  # ---------------------------------------------------------------- comparisons and logic

  def __lt__(self, other: Any) -> Tensor: return F.Less.apply(*self._broadcasted(other))
  def __gt__(self, other: Any) -> Tensor: return F.Less.apply(*self._broadcasted(other, reverse=True))
  def __ne__(self, other: Any) -> Tensor: return F.NotEqual.apply(*self._broadcasted(other))  # type: ignore[override]
  def __eq__(self, other: Any) -> Tensor: return (self != other).logical_not()  # type: ignore[override]
  # not `~(a > b)`: every comparison with NaN is False
  def __le__(self, other: Any) -> Tensor: return (self < other) | (self == other)
  def __ge__(self, other: Any) -> Tensor: return (self > other) | (self == other)

  def eq(self, other: Any) -> Tensor: return self == other
  def ne(self, other: Any) -> Tensor: return self != other
  def lt(self, other: Any) -> Tensor: return self < other
  def gt(self, other: Any) -> Tensor: return self > other
  def le(self, other: Any) -> Tensor: return self <= other
  def ge(self, other: Any) -> Tensor: return self >= other

  def _bitwise(self, other: Any, op: Ops, name: str, reverse: bool = False) -> Tensor:
    x, y = self._broadcasted(other, reverse)
    x._check_integer(name)
    return F.BitwiseOp.apply(x, y, op=op)

  def bitwise_and(self, other: Any) -> Tensor: return self._bitwise(other, Ops.AND, "bitwise and (&)")
  def bitwise_or(self, other: Any) -> Tensor: return self._bitwise(other, Ops.OR, "bitwise or (|)")
  def bitwise_xor(self, other: Any) -> Tensor: return self._bitwise(other, Ops.XOR, "bitwise xor (^)")

  def bitwise_not(self) -> Tensor:
    self._check_integer("bitwise not (~)")
    if self.dtype == dtypes.bool: return self.logical_not()
    return self.bitwise_xor(-1 if not self.dtype.is_unsigned else self.dtype.max)

  def __and__(self, other: Any) -> Tensor: return self.bitwise_and(other)
  def __rand__(self, other: Any) -> Tensor: return self._bitwise(other, Ops.AND, "bitwise and (&)", reverse=True)
  def __or__(self, other: Any) -> Tensor: return self.bitwise_or(other)
  def __ror__(self, other: Any) -> Tensor: return self._bitwise(other, Ops.OR, "bitwise or (|)", reverse=True)
  def __xor__(self, other: Any) -> Tensor: return self.bitwise_xor(other)
  def __rxor__(self, other: Any) -> Tensor: return self._bitwise(other, Ops.XOR, "bitwise xor (^)", reverse=True)
  def __invert__(self) -> Tensor: return self.bitwise_not()

  def __lshift__(self, shift: Any) -> Tensor: return self._bitwise(shift, Ops.SHL, "left shift (<<)")
  def __rshift__(self, shift: Any) -> Tensor: return self._bitwise(shift, Ops.SHR, "right shift (>>)")

  def logical_not(self) -> Tensor: return F.NotEqual.apply(*self._broadcasted(True)) if self.dtype == dtypes.bool \
    else (self == 0)
  def logical_and(self, other: Any) -> Tensor: return self.bool() & self._to_tensor(other).bool()
  def logical_or(self, other: Any) -> Tensor: return self.bool() | self._to_tensor(other).bool()
  def logical_xor(self, other: Any) -> Tensor: return self.bool() ^ self._to_tensor(other).bool()

  def where(self, x: Any, y: Any) -> Tensor:
    """self ? x : y, broadcasting all three (self is the condition)."""
    cond = self if self.dtype == dtypes.bool else self != 0
    x_tensor, y_tensor = cond._to_tensor(x), cond._to_tensor(y)
    if isinstance(x, Tensor) and not isinstance(y, Tensor): y_tensor = x_tensor._to_tensor(y)
    if isinstance(y, Tensor) and not isinstance(x, Tensor): x_tensor = y_tensor._to_tensor(x)
    if not isinstance(x, Tensor) and not isinstance(y, Tensor):
      dtype = least_upper_dtype(dtypes.from_py(x), dtypes.from_py(y))
      x_tensor, y_tensor = x_tensor.cast(dtype), y_tensor.cast(dtype)
    x_tensor, y_tensor = x_tensor._broadcasted(y_tensor)
    shape = _broadcast_shape(cond.shape, x_tensor.shape)
    return F.Where.apply(cond.expand(shape), x_tensor.expand(shape), y_tensor.expand(shape))

  def maximum(self, other: Any) -> Tensor:
    x, y = self._broadcasted(other)
    return F.Maximum.apply(x, y)

  def minimum(self, other: Any) -> Tensor:
    x, y = self._broadcasted(other)
    if x.dtype == dtypes.bool: return x & y
    if not x.dtype.is_float: return ~F.Maximum.apply(~x, ~y)  # ~ reverses integer order without overflow
    return -F.Maximum.apply(-x, -y)

  def clip(self, min_: Any = None, max_: Any = None) -> Tensor:
    if min_ is None and max_ is None: raise ValueError("clip needs at least one of min and max")
    # where, not maximum/minimum: a value on a bound keeps its whole gradient, as in torch.clamp
    result = self
    if min_ is not None: result = (result < min_).where(min_, result)
    if max_ is not None: result = (result > max_).where(max_, result)
    return result

  def clamp(self, min: Any = None, max: Any = None) -> Tensor: return self.clip(min, max)  # noqa: A002

  # ---------------------------------------------------------------- unary math

  def neg(self) -> Tensor:
    if self.dtype == dtypes.bool: raise DTypeError("negation of a bool tensor; use ~ or logical_not()")
    return F.Neg.apply(self)

  def reciprocal(self) -> Tensor: return F.Reciprocal.apply(self._float_operand())
  def sqrt(self) -> Tensor: return F.Sqrt.apply(self._float_operand())
  def rsqrt(self) -> Tensor: return self.sqrt().reciprocal()
  def exp(self) -> Tensor: return F.Exp.apply(self._float_operand())
  def exp2(self) -> Tensor: return F.Exp.apply(self._float_operand() * math.log(2))
  def log(self) -> Tensor: return F.Log.apply(self._float_operand())
  def log2(self) -> Tensor: return self.log() / math.log(2)
  def log10(self) -> Tensor: return self.log() / math.log(10)
  def log1p(self) -> Tensor: return (self._float_operand() + 1).log()
  def expm1(self) -> Tensor: return self.exp() - 1
  def sin(self) -> Tensor: return F.Sin.apply(self._float_operand())
  def cos(self) -> Tensor: return (math.pi / 2 - self._float_operand()).sin()
  def tan(self) -> Tensor: return self.sin() / self.cos()
  def square(self) -> Tensor: return self * self

  def abs(self) -> Tensor:
    if self.dtype == dtypes.bool or self.dtype.is_unsigned: return self
    return self.relu() + (-self).relu() if self.dtype.is_float else (self < 0).where(-self, self)

  def sign(self) -> Tensor:
    if self.dtype == dtypes.bool: return self
    zero = self.zeros_like()
    return (self < 0).where(-1, (self > 0).where(1, zero)).cast(self.dtype)

  def relu(self) -> Tensor:
    if self.dtype == dtypes.bool: return self
    return F.Relu.apply(self) if self.dtype.is_float else self.maximum(0)

  def sigmoid(self) -> Tensor: return F.Sigmoid.apply(self._float_operand())
  def tanh(self) -> Tensor: return 2.0 * (2.0 * self._float_operand()).sigmoid() - 1.0
  def silu(self) -> Tensor: return self * self.sigmoid()
  def swish(self) -> Tensor: return self.silu()
  def relu6(self) -> Tensor: return self.relu().minimum(6)
  def hardsigmoid(self) -> Tensor: return (self / 6 + 0.5).clip(0, 1)
  def hardswish(self) -> Tensor: return self * (self + 3).relu6() / 6
  def hardtanh(self, min_val: float = -1.0, max_val: float = 1.0) -> Tensor: return self.clip(min_val, max_val)
  def mish(self) -> Tensor: return self * self.softplus().tanh()
  def leaky_relu(self, negative_slope: float = 0.01) -> Tensor: return (self < 0).where(self * negative_slope, self)
  def elu(self, alpha: float = 1.0) -> Tensor: return self.relu() - alpha * (1 - self.exp()).relu()
  def celu(self, alpha: float = 1.0) -> Tensor: return self.maximum(0) + (alpha * ((self / alpha).exp() - 1)).minimum(0)
  def selu(self) -> Tensor:
    alpha, scale = 1.6732632423543772, 1.0507009873554805
    return scale * (self.relu() - alpha * (1 - self.exp()).relu())

  def softplus(self, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """log(1 + exp(beta*x)) / beta, linear above `threshold` (PyTorch's numerically safe form)."""
    scaled = self._float_operand() * beta
    safe = (scaled.minimum(threshold).exp() + 1).log() / beta
    return (scaled > threshold).where(self._float_operand(), safe)

  def gelu(self, approximate: str = "none") -> Tensor:
    """Gaussian error linear unit: exact (erf) by default, "tanh" for the approximation."""
    x = self._float_operand()
    if approximate == "tanh": return 0.5 * x * (1 + (math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)).tanh())
    return 0.5 * x * (1 + (x / math.sqrt(2)).erf())

  def erf(self) -> Tensor:
    """Error function (Abramowitz-Stegun 7.1.26 refined: max abs error ~1.5e-7)."""
    x = self._float_operand()
    t = 1.0 / (1.0 + 0.3275911 * x.abs())
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return x.sign() * (1.0 - poly * (-(x * x)).exp())

  def _round_toward_zero(self) -> Tensor:
    """Drop the fraction, keeping values too large for int64 (which are integers already) as they are."""
    truncated = self.cast(dtypes.int64).cast(self.dtype)
    # detached: rounding has a zero gradient everywhere, as in PyTorch
    return (self.abs() < 2.0 ** 52).where(truncated, self.detach())

  def trunc(self) -> Tensor: return self._round_toward_zero() if self.dtype.is_float else self

  def floor(self) -> Tensor:
    if not self.dtype.is_float: return self
    truncated = self.trunc()
    return (truncated > self).where(truncated - 1, truncated)

  def ceil(self) -> Tensor:
    if not self.dtype.is_float: return self
    truncated = self.trunc()
    return (truncated < self).where(truncated + 1, truncated)

  def round(self) -> Tensor:
    """Round half to even, as torch.round."""
    if not self.dtype.is_float: return self
    floor = self.floor()
    diff = self - floor
    floor_is_even = (floor / 2).floor() * 2 == floor
    up = (diff > 0.5) | ((diff == 0.5) & ~floor_is_even)
    return up.where(floor + 1, floor)

  def lerp(self, end: Tensor, weight: Any) -> Tensor: return self + (end - self) * weight

  def isnan(self) -> Tensor: return self != self
  def isinf(self) -> Tensor: return (self == math.inf) | (self == -math.inf)
  def isfinite(self) -> Tensor: return ~(self.isnan() | self.isinf())

  # ---------------------------------------------------------------- reductions

  def _reduce_axes(self, axis: int | Sequence[int] | None) -> tuple[int, ...]:
    if axis is None: return tuple(range(self.ndim))
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    normalized = tuple(self._axis(int(a)) for a in axes)
    if len(set(normalized)) != len(normalized): raise AxisError(f"axis {axis} repeats a dimension")
    return normalized

  def _reduce(self, function: type[F.Function], axis: int | Sequence[int] | None, keepdim: bool) -> Tensor:
    axes = self._reduce_axes(axis)
    reduced = function.apply(self, axes=axes)
    if keepdim: return reduced
    return reduced.reshape(tuple(size for a, size in enumerate(self.shape) if a not in axes))

  def sum(self, axis: int | Sequence[int] | None = None, keepdim: bool = False, dtype: DType | None = None) -> Tensor:
    """Sum over `axis` (all if None). Integers and bools sum in int64, as in PyTorch, unless `dtype` is given."""
    target = dtypes.as_dtype(dtype) if dtype is not None else sum_dtype(self.dtype)
    # half-precision floats accumulate in float32 and round once at the end
    accumulate = dtypes.float32 if target in (dtypes.float16, dtypes.bfloat16) else target
    return self.cast(accumulate)._reduce(F.Sum, axis, keepdim).cast(target)

  def max(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    if self.numel() == 0 and any(self.shape[a] == 0 for a in self._reduce_axes(axis)):
      raise ShapeError(f"max of an empty dimension of shape {self.shape} has no identity; give a non-empty axis")
    if self.dtype == dtypes.bool: return self.cast(dtypes.uint8)._reduce(F.Max, axis, keepdim).cast(dtypes.bool)
    return self._reduce(F.Max, axis, keepdim)

  def min(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    if self.dtype == dtypes.bool: return ~((~self).max(axis, keepdim))
    if not self.dtype.is_float: return ~((~self).max(axis, keepdim))
    return -((-self).max(axis, keepdim))

  def amax(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    return self.max(axis, keepdim)

  def amin(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    return self.min(axis, keepdim)

  def mean(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    x = self._float_operand()
    count = prod(self.shape[a] for a in self._reduce_axes(axis))
    total = x.sum(axis, keepdim)
    return total / count if count else total * math.nan

  def var(self, axis: int | Sequence[int] | None = None, keepdim: bool = False, correction: int = 1) -> Tensor:
    x = self._float_operand()
    count = prod(self.shape[a] for a in self._reduce_axes(axis))
    squares = (x - x.mean(axis, keepdim=True)).square().sum(axis, keepdim)
    return squares / max(count - correction, 0) if count - correction > 0 else squares * math.nan

  def std(self, axis: int | Sequence[int] | None = None, keepdim: bool = False, correction: int = 1) -> Tensor:
    return self.var(axis, keepdim, correction).sqrt()

  def prod(self, axis: int | None = None, keepdim: bool = False) -> Tensor:
    """Product over one axis (or all), by halving the axis repeatedly: log2(n) fused multiply steps."""
    target = sum_dtype(self.dtype) if not self.dtype.is_float else self.dtype
    if axis is None:
      result = self.flatten().cast(target).prod(0)
      return result.reshape((1,) * self.ndim) if keepdim else result
    dim = self._axis(axis)
    x = self.cast(target).transpose(dim, -1)
    while x.shape[-1] > 1:
      size = x.shape[-1]
      if size % 2: x = x.pad([None] * (x.ndim - 1) + [(0, 1)], value=1)
      halves = x.reshape(x.shape[:-1] + (x.shape[-1] // 2, 2))
      x = (halves[..., 0] * halves[..., 1]).contiguous()
    if x.shape[-1] == 0: x = Tensor.ones(*x.shape[:-1], 1, dtype=target, device=self.device)
    result = x.transpose(dim, -1)
    return result if keepdim else result.squeeze(dim)

  def any(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    # max has no identity for an empty axis; a sum has (zero), and keeps the reduced shape
    if self.numel() == 0: return self.bool().sum(axis, keepdim) != 0
    return self.bool().max(axis, keepdim)

  def all(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    return self.logical_not().any(axis, keepdim).logical_not()

  def argmax(self, axis: int | None = None, keepdim: bool = False) -> Tensor:
    """Index of the first maximal element (flattened if axis is None), int64 as in PyTorch."""
    if axis is None:
      result = self.flatten().argmax(0)
      return result.reshape((1,) * self.ndim) if keepdim else result
    dim = self._axis(axis)
    size = self.shape[dim]
    if size == 0: raise ShapeError(f"argmax of an empty dimension {dim} of shape {self.shape}")
    is_max = self == self.max(dim, keepdim=True)
    if self.dtype.is_float: is_max = is_max | (self.isnan() & self.isnan().any(dim, keepdim=True))
    # the first maximal index has the largest (size - index)
    countdown = Tensor.arange(size, 0, -1, device=self.device).reshape((size,) + (1,) * (self.ndim - dim - 1))
    best = is_max.where(countdown, 0).max(dim, keepdim)
    return (size - best).cast(dtypes.int64)

  def argmin(self, axis: int | None = None, keepdim: bool = False) -> Tensor:
    if self.dtype.is_float: return (-self).argmax(axis, keepdim)
    return (~self if self.dtype != dtypes.bool else self.logical_not()).argmax(axis, keepdim)

  def logsumexp(self, axis: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    x = self._float_operand()
    peak = x.max(axis, keepdim=True)
    peak = peak.isinf().where(0, peak)  # all -inf (or an inf) would give nan through x - peak
    total = (x - peak).exp().sum(axis, keepdim=True).log() + peak
    return total if keepdim else total.reshape(tuple(s for a, s in enumerate(self.shape)
                                                     if a not in self._reduce_axes(axis)))

  def softmax(self, axis: int = -1) -> Tensor:
    x = self._float_operand()
    if x.numel() == 0: return x  # nothing to normalize (and max of an empty axis has no identity)
    # half precision computes in float32 and rounds once, as in PyTorch (rounding exps and sum too: 2 ulps off)
    if x.dtype in (dtypes.float16, dtypes.bfloat16): return x.float().softmax(axis).cast(x.dtype)
    exps = (x - x.max(axis, keepdim=True)).exp()
    return exps / exps.sum(axis, keepdim=True)

  def log_softmax(self, axis: int = -1) -> Tensor:
    x = self._float_operand()
    if x.numel() == 0: return x  # nothing to normalize (and max of an empty axis has no identity)
    if x.dtype in (dtypes.float16, dtypes.bfloat16): return x.float().log_softmax(axis).cast(x.dtype)
    shifted = x - x.max(axis, keepdim=True)
    return shifted - shifted.exp().sum(axis, keepdim=True).log()

  def _cumsum_last(self) -> Tensor:
    """Inclusive cumulative sum over the last axis: out[i] = sum of x[j] for j <= i, as one masked-sum kernel
    (O(n^2) work per row: fine for the sizes cumsum meets in models)."""
    size = self.shape[-1]
    if size == 0: return self.cast(sum_dtype(self.dtype))
    positions = Tensor.arange(size, device=self.device)
    keep = positions.reshape(size, 1) >= positions.reshape(1, size)  # row i keeps columns j <= i
    values = self.unsqueeze(-2).expand(self.shape[:-1] + (size, size))
    return keep.where(values, 0).sum(-1)

  def cumsum(self, axis: int = 0) -> Tensor:
    dim = self._axis(axis)
    return self.transpose(dim, -1)._cumsum_last().transpose(dim, -1)

  # ---------------------------------------------------------------- linear algebra

  def dot(self, other: Tensor) -> Tensor: return self.matmul(other)

  def matmul(self, other: Tensor) -> Tensor:
    """Matrix product with PyTorch's rules for 1-D operands and batch broadcasting: a broadcast multiply and
    a sum over the inner dimension, which the optimizer turns into one tiled kernel."""
    other = self._to_tensor(other)
    if self.ndim == 0 or other.ndim == 0:
      raise ShapeError(f"matmul needs tensors with at least 1 dimension, got shapes {self.shape} and {other.shape}")
    if self.device != other.device:
      raise DeviceError(f"matmul of tensors on {self.device} and {other.device}; move one with .to()")
    x = self.reshape(1, -1) if self.ndim == 1 else self
    y = other.reshape(-1, 1) if other.ndim == 1 else other
    if x.shape[-1] != y.shape[-2]:
      raise ShapeError(f"matmul inner dimensions differ: {self.shape} @ {other.shape} "
                       f"({x.shape[-1]} != {y.shape[-2]})")
    dtype = least_upper_dtype(x.dtype, y.dtype)
    accumulate = dtypes.float32 if dtype in (dtypes.float16, dtypes.bfloat16) else dtype
    if dtype == dtypes.bool: accumulate = dtypes.int32
    x, y = x.cast(accumulate), y.cast(accumulate)
    product = x.unsqueeze(-2) * y.transpose(-1, -2).unsqueeze(-3)   # (..., n, m, k)
    result = product.sum(-1, dtype=accumulate)
    result = result.cast(dtype) if dtype != dtypes.bool else (result != 0)
    if self.ndim == 1: result = result.squeeze(-2)
    if other.ndim == 1: result = result.squeeze(-1)
    return result

  def linear(self, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias, with weight of shape (out_features, in_features) as in torch.nn.functional.linear."""
    result = self.matmul(weight.T)
    return result + bias if bias is not None else result

  # ---------------------------------------------------------------- neural-network ops (ourgrad/nn/functional.py)

  def conv2d(self, weight: Tensor, bias: Tensor | None = None, stride: int | tuple[int, int] = 1,
             padding: int | tuple[int, int] = 0, dilation: int | tuple[int, int] = 1, groups: int = 1) -> Tensor:
    """2-D convolution, torch.nn.functional.conv2d semantics (input NCHW, weight (out, in/groups, kh, kw))."""
    from ourgrad.nn import functional
    return functional.conv2d(self, weight, bias, stride, padding, dilation, groups)

  def avg_pool2d(self, kernel_size: int | tuple[int, int] = 2, stride: int | tuple[int, int] | None = None,
                 padding: int | tuple[int, int] = 0) -> Tensor:
    from ourgrad.nn import functional
    return functional.avg_pool2d(self, kernel_size, stride, padding)

  def max_pool2d(self, kernel_size: int | tuple[int, int] = 2, stride: int | tuple[int, int] | None = None,
                 padding: int | tuple[int, int] = 0, dilation: int | tuple[int, int] = 1) -> Tensor:
    from ourgrad.nn import functional
    return functional.max_pool2d(self, kernel_size, stride, padding, dilation)

  def layernorm(self, axis: int | tuple[int, ...] = -1, eps: float = 1e-5) -> Tensor:
    """Normalize over `axis` to zero mean and unit variance (no affine part; see nn.LayerNorm)."""
    from ourgrad.nn import functional
    return functional.layernorm(self, axis, eps)

  def dropout(self, p: float = 0.5) -> Tensor:
    """Zero each element with probability p and scale the rest by 1/(1-p), only while Tensor.training."""
    from ourgrad.nn import functional
    return functional.dropout(self, p)

  def cross_entropy(self, target: Tensor, reduction: str = "mean", label_smoothing: float = 0.0,
                    ignore_index: int = -100) -> Tensor:
    """Cross entropy of these logits (classes on axis 1, or 0 if 1-D) against class indices or probabilities,
    like torch.nn.functional.cross_entropy (see ourgrad/nn/losses.py)."""
    from ourgrad.nn import losses
    return losses.cross_entropy(self, target, reduction, label_smoothing, ignore_index)

  def sparse_categorical_crossentropy(self, target: Tensor, ignore_index: int = -1, label_smoothing: float = 0.0,
                                      reduction: str = "mean") -> Tensor:
    """tinygrad's cross entropy of these logits (classes on the LAST axis) against integer class indices."""
    from ourgrad.nn import losses
    return losses.sparse_categorical_crossentropy(self, target, ignore_index, label_smoothing, reduction)

  def nll_loss(self, target: Tensor, reduction: str = "mean", ignore_index: int = -100) -> Tensor:
    """Negative log-likelihood of these log-probabilities at the class indices `target`."""
    from ourgrad.nn import losses
    return losses.nll_loss(self, target, reduction, ignore_index)

  def binary_cross_entropy(self, target: Tensor, reduction: str = "mean") -> Tensor:
    """Binary cross entropy of these probabilities against `target`."""
    from ourgrad.nn import losses
    return losses.binary_cross_entropy(self, target, reduction)

  def binary_cross_entropy_with_logits(self, target: Tensor, reduction: str = "mean",
                                       pos_weight: Tensor | None = None) -> Tensor:
    """Binary cross entropy of sigmoid(self) against `target`, computed stably from the logits."""
    from ourgrad.nn import losses
    return losses.binary_cross_entropy_with_logits(self, target, reduction, pos_weight)

  def mse_loss(self, target: Tensor, reduction: str = "mean") -> Tensor:
    """Mean (or summed, or per-element) squared error against `target`."""
    from ourgrad.nn import losses
    return losses.mse_loss(self, target, reduction)

  def scaled_dot_product_attention(self, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                   enable_gqa: bool = False) -> Tensor:
    """Attention with this tensor as the query, like torch.nn.functional.scaled_dot_product_attention."""
    from ourgrad.nn import attention
    return attention.scaled_dot_product_attention(self, key, value, attn_mask, dropout_p, is_causal, scale,
                                                  enable_gqa)

  def outer(self, other: Tensor) -> Tensor: return self.reshape(-1, 1) * other.reshape(1, -1)

  def triu(self, diagonal: int = 0) -> Tensor:
    rows = Tensor.arange(self.shape[-2], device=self.device).reshape(-1, 1)
    cols = Tensor.arange(self.shape[-1], device=self.device).reshape(1, -1)
    return (cols - rows >= diagonal).where(self, 0).cast(self.dtype)

  def tril(self, diagonal: int = 0) -> Tensor:
    rows = Tensor.arange(self.shape[-2], device=self.device).reshape(-1, 1)
    cols = Tensor.arange(self.shape[-1], device=self.device).reshape(1, -1)
    return (cols - rows <= diagonal).where(self, 0).cast(self.dtype)


def _narrow_step(dim: int, start: int, end: int, size: int) -> tuple[Any, Any]:
  """Keep [start, end) of `dim`; the inverse pads back to `size`."""
  def forward(t: Tensor) -> Tensor: return t.shrink([(start, end) if a == dim else None for a in range(t.ndim)])
  def inverse(t: Tensor) -> Tensor: return t.pad([(start, size - end) if a == dim else None for a in range(t.ndim)])
  return forward, inverse


def _stride_step(dim: int, step: int, length: int) -> tuple[Any, Any]:
  """Keep every `step`-th element of `dim` (of size `length`); the inverse spreads them back out with zeros."""
  def forward(t: Tensor) -> Tensor: return t._stride_axis(dim, step)

  def inverse(t: Tensor) -> Tensor:
    kept = t.shape[dim]
    spread = t.unsqueeze(dim + 1).pad([(0, step - 1) if a == dim + 1 else None for a in range(t.ndim + 1)])
    flat = spread.reshape(t.shape[:dim] + (kept * step,) + t.shape[dim + 1:])
    return flat.shrink([(0, length) if a == dim else None for a in range(t.ndim)])
  return forward, inverse


class no_grad:  # noqa: N801 (PyTorch's name)
  """Context manager and decorator that stops recording autograd graphs: `with ourgrad.no_grad(): ...`."""

  def __enter__(self) -> None:
    self.previous = Tensor.no_grad
    Tensor.no_grad = True

  def __exit__(self, *exc: Any) -> None:
    Tensor.no_grad = self.previous

  def __call__(self, function: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
      with no_grad(): return function(*args, **kwargs)
    return wrapper
