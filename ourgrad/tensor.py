"""Tensor: the user-facing array with PyTorch names and semantics, lazily evaluated, with autograd.

Every operation builds LazyBuffers through an autograd Function (ourgrad/function.py); nothing runs until a
value is needed (`numpy()`, `item()`, `tolist()`, `realize()`). Composite operations (softmax, matmul,
conv2d, ...) are written from the primitives, so they fuse like everything else. Shape, axis, dtype and
device mistakes raise at the call that made them (ourgrad/errors.py).

This module holds the Tensor class itself: construction from data, properties, conversion (numpy, item, to,
cast, ...), realize and autograd (backward, detach, no_grad). The rest of
Tensor's methods come from mixins, one module per job:
  ourgrad/tensor_creation.py  CreationMixin     zeros, full, arange, eye, *_like, new_*, rand, randn, manual_seed
  ourgrad/tensor_movement.py  MovementMixin     views (reshape, permute, pad, ...), cat/stack/split
  ourgrad/tensor_indexing.py  IndexingMixin     t[index], t[index] = value, row reads and indexed adds
  ourgrad/tensor_scatter.py   ScatterMixin      gather, scatter, scatter_add, scatter_reduce, index_add
  ourgrad/tensor_math.py      ElementwiseMixin  broadcasting, operators, unary math, rounding
  ourgrad/tensor_activation.py ActivationMixin  relu, sigmoid, tanh, silu, gelu, elu, softplus, erf, ...
  ourgrad/tensor_reduce.py    ReduceMixin       reductions (sum, max, softmax, cumsum, ...) and matmul, triu, tril
  ourgrad/tensor_sort.py      SortMixin         sort, argsort, topk, multinomial
  ourgrad/tensor_special.py   SpecialMixin      atan, asin, acos, atan2, hypot, logit, xlogy, nansum, ...
  ourgrad/tensor_aliases.py   AliasMixin        PyTorch's other names for existing ops (divide, t, ravel, ...)
  ourgrad/tensor_nn.py        NNMixin           layernorm, dropout, losses, attention; and through its bases:
  ourgrad/tensor_conv.py      ConvMixin         conv1d/2d/3d, conv_transpose1d/2d/3d, avg/max pooling
  ourgrad/tensor_resize.py    ResizeMixin       interpolate (and the reflect/replicate/circular pad modes)
  ourgrad/tensor_einsum.py    EinsumMixin       einsum
"""
from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from ourgrad import function as F
from ourgrad import function_movement as FM
from ourgrad.device import Buffer, BufferView, Device
from ourgrad.dtype import DType, bfloat16_bits_to_float32, dtypes, float32_to_bfloat16_bits
from ourgrad.engine.exec_item import jit_recording
# modules, not their functions: realize looks them up at each call, so tools and tests that wrap them see every call
from ourgrad.engine import realize as engine_realize
from ourgrad.engine import schedule_cache
from ourgrad.engine.schedule import REALIZE_LOCK
from ourgrad.errors import AutogradError, DeviceError, DTypeError, JitError, ShapeError
from ourgrad.helpers import DEBUG, normalize_axis, prod
from ourgrad.lazy import LazyBuffer
from ourgrad.lazy_views import Storage
from ourgrad.multi import MultiLazyBuffer, Shard, shard_lazy
from ourgrad.ops import ADD, ASSIGN, Ops
from ourgrad.shape.symbolic import is_symbolic, sym_infer
from ourgrad.tensor_activation import ActivationMixin
from ourgrad.tensor_aliases import AliasMixin
from ourgrad.tensor_creation import CreationMixin, canonical_devices
from ourgrad.tensor_math import ElementwiseMixin
from ourgrad.tensor_indexing import IndexingMixin
from ourgrad.tensor_movement import MovementMixin
from ourgrad.tensor_nn import NNMixin
from ourgrad.tensor_reduce import ReduceMixin
from ourgrad.tensor_scatter import ScatterMixin
from ourgrad.tensor_sort import SortMixin
from ourgrad.tensor_special import SpecialMixin

Scalar = bool | int | float
Devices = str | tuple[str, ...]
Lazy = LazyBuffer | MultiLazyBuffer


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
    if dtype == dtypes.bfloat16: return LazyBuffer.from_numpy(float32_to_bfloat16_bits(data), dtype, device)
    return LazyBuffer.from_numpy(data.astype(dtype.np, copy=False), dtype, device)
  if is_symbolic(data):
    # a bound Variable as a value (mean over a symbolic axis divides by it): its current value, a constant of the
    # kernel, so such a kernel compiles once per value (docs/jit.md, symbolic shapes)
    return LazyBuffer.full(sym_infer(data, {}), (), dtype or dtypes.int32, device)
  raise TypeError(f"cannot make a Tensor from {type(data).__name__}; pass a number, a (nested) list, a numpy "
                  f"array or a Tensor")


class Tensor(CreationMixin, MovementMixin, IndexingMixin, ScatterMixin, ElementwiseMixin, ActivationMixin, ReduceMixin,
             SortMixin, SpecialMixin, AliasMixin, NNMixin):
  """A multi-dimensional array on a device, computed lazily, with automatic differentiation.

  `Tensor(data, device=None, dtype=None, requires_grad=None)` takes a number, a nested list, a numpy array,
  or a LazyBuffer. `device` defaults to `Device.DEFAULT`; `dtype` to what the data holds (float32 for Python
  floats, int32 for Python ints).

  The methods defined here are construction, conversion and autograd; the mixins bring the rest (views
  and indexing, elementwise math, reductions, neural-network ops: see this module's docstring)."""
  __slots__ = ("_lazydata", "requires_grad", "grad", "_ctx", "__weakref__")
  __array_priority__ = 1000  # make numpy defer to Tensor's reflected operators (np.float32(2) * t)
  # None until the user sets it (`with Tensor.train():` or an assignment): then a Module that was never given
  # train()/eval() is in training mode, as in PyTorch, while Tensor.dropout() does not drop, as in tinygrad
  training: bool | None = None
  no_grad: bool = False

  def __init__(self, data: Any, device: str | None = None, dtype: DType | str | None = None,
               requires_grad: bool | None = None):
    if dtype is None and type(data) is LazyBuffer and type(data.device) is str and \
        (device is None or device == data.device):
      # the result of an op (Function.apply): a single-device LazyBuffer that stays as it is; the general path below
      # would come to the same, through a dozen checks that cost more than the rest of a small op's graph building
      self._lazydata = data
      self.requires_grad, self.grad, self._ctx = requires_grad, None, None
      if requires_grad and not data.dtype.is_float:
        raise DTypeError(f"only floating point tensors can require gradients, got {data.dtype}")
      return
    dtype = dtypes.as_dtype(dtype) if dtype is not None else None
    device = canonical_devices(device)
    if isinstance(data, Tensor): data = data.lazydata
    # several devices (ourgrad/multi.py): a constant made with a tuple of devices is replicated over them
    if isinstance(data, LazyBuffer) and isinstance(data.device, tuple): data = MultiLazyBuffer.from_const(data)
    if isinstance(device, tuple) and not isinstance(data, MultiLazyBuffer):
      data = shard_lazy(data if isinstance(data, LazyBuffer) else _to_lazy(data, dtype, device[0]), device, None)
    if isinstance(data, MultiLazyBuffer) and isinstance(device, str): data = data.gather(device)
    if isinstance(data, MultiLazyBuffer):
      lazy: LazyBuffer | MultiLazyBuffer = data.cast(dtype) if dtype is not None else data
    elif isinstance(data, LazyBuffer):
      if device is not None and device != data.device: data = data.copy_to_device(device)
      if dtype is not None and dtype != data.dtype: data = data.cast(dtype)
      lazy = data
    else:
      lazy = _to_lazy(data, dtype, device or Device.DEFAULT)
    self._lazydata: LazyBuffer | MultiLazyBuffer = lazy  # type: ignore[assignment]
    self.requires_grad: bool | None = requires_grad
    self.grad: Tensor | None = None
    self._ctx: F.Function | None = None
    if requires_grad and not self.dtype.is_float:
      raise DTypeError(f"only floating point tensors can require gradients, got {self.dtype}")

  # ---------------------------------------------------------------- properties and conversion

  @property
  def lazydata(self) -> LazyBuffer | MultiLazyBuffer:
    """The lazy value. A tensor names memory, as in PyTorch: where an in-place write to its base (through any
    tensor) made a newer version, this is the same view of the newest one (LazyBuffer.current)."""
    lazy = self._lazydata
    if type(lazy) is not LazyBuffer: return lazy
    # LazyBuffer.stale written out: read for every input of every op
    base = lazy._base or lazy   # (a LazyBuffer is always true)
    storage, const = base._storage, lazy._const
    if (storage is not None and storage.head is not base) or (const is not None and const[0].head is not None):
      lazy = self._lazydata = lazy.current()
    return lazy

  @lazydata.setter
  def lazydata(self, lazy: LazyBuffer | MultiLazyBuffer) -> None: self._lazydata = lazy

  @property
  def shape(self) -> tuple[int, ...]:
    """The size of each dimension, as a plain tuple of ints (PyTorch returns a torch.Size)."""
    return self._lazydata.shape  # every version of a base has its shape, dtype and device

  @property
  def dtype(self) -> DType:
    """The element type, a DType such as dtypes.float32."""
    return self._lazydata.dtype

  @property
  def device(self) -> str | tuple[str, ...]:  # type: ignore[override]
    """The canonical name of the device that holds the values, e.g. "CLANG"; a tuple of names for a tensor spread
    over several devices (`shard`)."""
    return self._lazydata.device

  def shard(self, devices: tuple[str, ...] | list[str] | int, axis: int | None = None) -> Tensor:
    """This tensor spread over `devices` (names, or n for the first n devices of the default kind): cut into one
    piece per device along `axis` (uneven sizes as numpy.array_split), or copied whole to each when axis is None.
    Ops keep the sharding where they can and raise ShardingError where they cannot (ourgrad/multi.py).
    Gradients flow back through it: this tensor's `.grad` is the sharded gradient gathered onto its device."""
    return Shard.apply(self, devices=devices, axis=axis)

  def shard_(self, devices: tuple[str, ...] | list[str] | int, axis: int | None = None) -> Tensor:
    """shard, in place: this tensor's data becomes the sharded data (for parameters, before an optimizer)."""
    self.lazydata = shard_lazy(self.lazydata, devices, axis)
    return self

  @property
  def ndim(self) -> int:
    """The number of dimensions."""
    return len(self.shape)

  def numel(self) -> int:
    """The number of elements: the product of the shape (1 for a 0-d tensor)."""
    return prod(self.shape)

  def size(self, dim: int | None = None) -> tuple[int, ...] | int:
    """The shape as a plain tuple, or the size of dimension `dim` (negative counts from the end)."""
    return self.shape if dim is None else self.shape[normalize_axis(dim, self.ndim)]

  def dim(self) -> int:
    """The number of dimensions (the same as ndim)."""
    return self.ndim

  def element_size(self) -> int:
    """The size of one element in bytes."""
    return self.dtype.itemsize

  def __len__(self) -> int:
    if not self.shape: raise TypeError("len() of a 0-d tensor")
    return self.shape[0]

  def __repr__(self) -> str:
    """The values, as PyTorch prints them: `tensor([[1., 2.], [3., 4.]])`, summarized with "..." beyond 1000
    elements, then the dtype and device when they are not the defaults, and requires_grad / grad_fn. Printing
    realizes the tensor, as in PyTorch; inside a TinyJit function (where reading values is refused) and for symbolic
    shapes it prints the shape only."""
    from ourgrad.tensor_print import format_tensor
    return format_tensor(self)

  def __format__(self, format_spec: str) -> str:
    # f"{loss:.4f}" on a one-element tensor formats its value, as in PyTorch
    if format_spec and self.numel() == 1: return format(self.item(), format_spec)
    return format(repr(self), format_spec)

  def __hash__(self) -> int: return id(self)

  def _single_value(self, conversion: str) -> Scalar:
    """The value of a one-element tensor for int()/float()/bool()/index; ShapeError (a RuntimeError too, as
    PyTorch raises) naming the shape otherwise."""
    if self.numel() != 1:
      raise ShapeError(f"{conversion} of a tensor with {self.numel()} elements (shape {self.shape}) is ambiguous: "
                       f"only one-element tensors convert to a Python number; reduce it first (.sum(), .any())")
    return self.item()

  def __bool__(self) -> bool: return bool(self._single_value("bool()"))

  def __float__(self) -> float: return float(self._single_value("float()"))

  def __int__(self) -> int: return int(self._single_value("int()"))

  def __index__(self) -> int:
    # as PyTorch: only integer tensors index (a float would silently truncate)
    if self.dtype.is_float or self.dtype.is_bool:
      raise DTypeError(f"only integer tensors of a single element can be converted to an index, got {self.dtype}")
    return int(self._single_value("an index"))

  def realize(self, *others: Tensor) -> Tensor:
    """Compute this tensor (and `others`) now, in one schedule."""
    timed = DEBUG.value >= 1   # (the clock read only where it is printed)
    with REALIZE_LOCK:  # one thread at a time between scheduling and running (see REALIZE_LOCK)
      if timed: start = time.perf_counter()
      # cached by the graph's structure
      lazy = self.lazydata
      outs = [lazy] if not others and type(lazy) is LazyBuffer else \
          [lazy for tensor in (self, *others) for lazy in _per_device(tensor.lazydata)]
      # (a replayed one-kernel schedule is launched there, where nothing is timed: [] comes back)
      schedule = schedule_cache.schedule(outs, None if timed else engine_realize.launch_one)
      if timed: scheduled = time.perf_counter()
      if schedule: engine_realize.run_schedule(schedule)
    if timed and schedule:
      print(f"realize: {len(schedule)} items, scheduled in {(scheduled - start) * 1e3:.2f} ms, "
            f"ran in {(time.perf_counter() - scheduled) * 1e3:.2f} ms")
    return self

  @staticmethod
  def realize_all(*tensors: Tensor) -> None:
    """Compute all `tensors` now, in one schedule (nothing if none are given)."""
    if tensors: tensors[0].realize(*tensors[1:])

  def _buffer(self) -> Buffer:
    """The realized, contiguous buffer of this tensor's values."""
    lazy = self.lazydata
    if isinstance(lazy, MultiLazyBuffer): lazy = lazy.gather(lazy.device[0])
    # a contiguous view of the whole base (the base or a reshape of it) reads the base's memory as it is: no copy;
    # nor one contiguous run of a stored base (a slice, the fused attention's O): a view of its memory
    run = None
    if not lazy.reads_whole_base:
      run = engine_realize.stored_run(lazy)
      if run is None: lazy = lazy.contiguous()
    if lazy.base.realized is None: Tensor(lazy).realize()
    return lazy.base.realized if run is None else BufferView(lazy.base.realized, *run)

  def numpy(self) -> np.ndarray:
    """The values as a numpy array (bfloat16 comes back as float32, which holds it exactly)."""
    if jit_recording.active:
      raise JitError(f"numpy()/item()/tolist() of a {self.shape} tensor inside a TinyJit function: the value would be "
                     f"read once and frozen into every replay. Return the tensor and read it after the call")
    if self.numel() == 0:
      return np.zeros(self.shape, dtype=np.float32 if self.dtype == dtypes.bfloat16 else self.dtype.np)
    values = self._buffer().numpy()   # a new array: returned as it is when it holds exactly this tensor
    if self.dtype == dtypes.bfloat16: values = bfloat16_bits_to_float32(values)
    # a symbolic shape reads as its bound values; the buffer holds room for the largest ones (then a copy of the
    # part read, not a view that keeps the whole buffer's array alive)
    shape = tuple(size if type(size) is int else sym_infer(size, {}) for size in self.shape)
    count = prod(shape)
    return values.reshape(shape) if count == values.size else values[:count].reshape(shape).copy()

  def item(self) -> Scalar:
    """The single value as a Python bool, int or float; ValueError unless the tensor has exactly one element."""
    if self.numel() != 1: raise ValueError(f"item() needs a tensor with one element, this one has shape {self.shape}")
    return self.numpy().reshape(()).item()

  def tolist(self) -> Any:
    """The values as nested Python lists (a Python number for a 0-d tensor); bfloat16 gives floats."""
    return self.numpy().tolist()

  def to(self, *args: Any, device: str | tuple[str, ...] | None = None, dtype: DType | str | None = None,
         **kwargs: Any) -> Tensor:
    """This tensor on another device and/or with another dtype, PyTorch's forms: `to(device)`, `to(dtype)`,
    `to(device, dtype)`, `to(other_tensor)` (its device and dtype), `to(device=..., dtype=...)`; non_blocking and
    copy are accepted and ignored. The same tensor when nothing changes. A sharded tensor is gathered; a tuple of
    devices replicates (see shard)."""
    unknown = set(kwargs) - {"non_blocking", "copy", "memory_format"}
    if unknown: raise TypeError(f"to() got unexpected keyword arguments {sorted(unknown)}")
    for arg in args:
      if isinstance(arg, Tensor): device, dtype = arg.device, arg.dtype
      elif isinstance(arg, DType): dtype = arg
      elif isinstance(arg, (str, tuple, list)) and device is None: device = arg
      elif isinstance(arg, bool): continue  # to(device, dtype, non_blocking) positionally
      else: raise TypeError(f"to() takes a device name, a DType or a Tensor, got {type(arg).__name__} {arg!r}")
    result = self if device is None else self._to_device(device)
    return result if dtype is None else result.cast(dtype)

  def cpu(self) -> Tensor:
    """This tensor on the CPU device (CLANG); the same tensor if already there."""
    return self.to("CPU")

  def cuda(self, device: int | None = None) -> Tensor:
    """This tensor on the CUDA device (`cuda(1)`: the second GPU)."""
    return self.to("CUDA" if device is None else f"CUDA:{device}")

  def type(self, dtype: DType | str | None = None) -> Tensor | str:
    """With a dtype, this tensor cast to it (torch.Tensor.type(dtype)); without, the dtype's name ("float32")."""
    return self.dtype.name if dtype is None else self.cast(dtype)

  def _to_device(self, device: str | tuple[str, ...] | list[str]) -> Tensor:
    device = canonical_devices(device)
    if device == self.device: return self
    if isinstance(device, tuple): return self.shard(device)
    result = Tensor(self.lazydata.copy_to_device(device), requires_grad=self.requires_grad)
    if self.grad is not None: result.grad = self.grad.to(device)
    return result

  def cast(self, dtype: DType | str) -> Tensor:
    """This tensor converted to `dtype` (the same tensor if it already has it); float to int truncates."""
    if dtype is self._lazydata.dtype: return self   # the common no-op (promotions to the dtype a tensor has)
    dtype = dtypes.as_dtype(dtype)
    return self if dtype == self.dtype else F.Cast.apply(self, dtype=dtype)

  def bitcast(self, dtype: DType | str) -> Tensor:
    """The same bits read as `dtype` of the same size (torch's view(dtype)); AutogradError if it requires grad."""
    dtype = dtypes.as_dtype(dtype)
    if self.requires_grad: raise AutogradError("bitcast is not differentiable; detach() the tensor first")
    return F.Cast.apply(self, dtype=dtype, bitcast=True)

  def float(self) -> Tensor:
    """Cast to float32."""
    return self.cast(dtypes.float32)

  def half(self) -> Tensor:
    """Cast to float16."""
    return self.cast(dtypes.float16)

  def int(self) -> Tensor:
    """Cast to int32."""
    return self.cast(dtypes.int32)

  def long(self) -> Tensor:
    """Cast to int64."""
    return self.cast(dtypes.int64)

  def bool(self) -> Tensor:
    """Cast to bool (non-zero is True)."""
    return self.cast(dtypes.bool)

  def double(self) -> Tensor:
    """Cast to float64."""
    return self.cast(dtypes.float64)

  def type_as(self, other: Tensor) -> Tensor:
    """This tensor cast to `other`'s dtype."""
    return self.cast(other.dtype)

  def requires_grad_(self, requires_grad: bool = True) -> Tensor:
    """Set requires_grad in place and return this tensor (torch.Tensor.requires_grad_)."""
    if requires_grad and not self.dtype.is_float:
      raise DTypeError(f"only floating point tensors can require gradients, got {self.dtype}")
    self.requires_grad = requires_grad
    return self

  # in-place forms: each writes through assign, so the tensor keeps its buffer (optimizer-style updates)
  def add_(self, other: Any, alpha: float = 1.0) -> Tensor:
    """self += alpha * other, in place."""
    return self._write_result(self + (other * alpha if alpha != 1.0 else other), "add_")

  def sub_(self, other: Any, alpha: float = 1.0) -> Tensor:
    """self -= alpha * other, in place."""
    return self._write_result(self - (other * alpha if alpha != 1.0 else other), "sub_")

  def mul_(self, other: Any) -> Tensor:
    """self *= other, in place."""
    return self._write_result(self * other, "mul_")

  def div_(self, other: Any) -> Tensor:
    """self /= other, in place."""
    return self._write_result(self / other, "div_")

  def clamp_(self, min: Any = None, max: Any = None) -> Tensor:  # noqa: A002
    """self.clamp(min, max), in place."""
    return self.assign(self.clamp(min, max))

  def fill_(self, value: Scalar) -> Tensor:
    """Every element set to `value`, in place."""
    return self.assign(self.full_like(value))

  def zero_(self) -> Tensor:
    """Every element set to 0, in place."""
    return self.fill_(0)

  def copy_(self, source: Tensor) -> Tensor:
    """The values of `source` (broadcast, cast to this dtype, moved to this device) written in place."""
    source = source if isinstance(source, Tensor) else Tensor(source, dtype=self.dtype)
    return self.assign(source.detach().to(self.device).cast(self.dtype))

  def uniform_(self, low: float = 0.0, high: float = 1.0) -> Tensor:
    """Random values uniform in [low, high), in place."""
    return self.assign(Tensor.uniform(*self.shape, low=low, high=high, dtype=self.dtype, device=self.device))

  def normal_(self, mean: float = 0.0, std: float = 1.0) -> Tensor:
    """Random values from a normal distribution, in place."""
    return self.assign(Tensor.normal(*self.shape, mean=mean, std=std, dtype=self.dtype, device=self.device))

  def contiguous(self) -> Tensor:
    """The values in row-major order: a copy kernel for a view; a tensor that is not a view is returned as the same
    data, marked to be realized."""
    return F.Contiguous.apply(self)

  def clone(self) -> Tensor:
    """A copy with memory of its own, as torch.clone: in-place writes to either never change the other."""
    return F.Clone.apply(self)

  def detach(self) -> Tensor:
    """A tensor with the same (lazy) data, cut from the autograd graph (requires_grad=False)."""
    return Tensor(self.lazydata, requires_grad=False)

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
    jit_recording.note_assign(self)  # a TinyJit call realizes the assigns it made when it ends
    target = self.lazydata
    if isinstance(target, MultiLazyBuffer):
      self.lazydata = target.assign(value.lazydata)
      return self
    # differentiable, as in PyTorch: the tensor's gradient will flow through the written value's graph, whose
    # Functions reach the tensor's old value through the Function it had then (F.Function.parent_ctxs). A leaf
    # that requires grad (a parameter written outside no_grad) stays a leaf: the write is data only
    adopt = value._ctx is not None and value.requires_grad and not (self._ctx is None and self.requires_grad)
    if adopt: _keep_old_value(value._ctx, target)
    viewed_from = self._ctx
    # into the memory this tensor names: its base's next version, which every tensor viewing that base reads
    self.lazydata = target.write(value.lazydata)
    if adopt:
      self._ctx, self.requires_grad = value._ctx, True
      if not target.is_base: _rebase_viewed_tensor(self, viewed_from, target)
    return self

  def sequential(self, layers: Any) -> Tensor:
    """`layers` applied one after another to this tensor (tinygrad's `x.sequential([conv, Tensor.relu, ...])`)."""
    result = self
    for layer in layers: result = layer(result)
    return result

  # ---------------------------------------------------------------- autograd

  def _toposort(self) -> list[F.Function]:
    """The Functions that lead to this tensor's, inputs first: a depth-first post-order from this tensor's Function
    that enters each Function's inputs last to first (iterative, no recursion limit). The graph's edges are each
    Function's inputs with the Functions they had when it was applied (`parent_ctxs`): an in-place write that later
    gave an input tensor a new Function does not change what the older ones read."""
    if self._ctx is None: return []
    order: list[F.Function] = []
    entered: set[F.Function] = set()   # (a Function hashes by identity)
    # a Function on the stack is to be entered; a 1-tuple holding one is to be emitted, its inputs all emitted
    # (Functions entered already are skipped when popped: the inputs are pushed by one extend, in C, rather than
    # tested one by one here; so are the leaves' None, which the filter drops, also in C)
    stack: list[Any] = [self._ctx]
    while stack:
      item = stack.pop()
      if type(item) is tuple:
        order.append(item[0])
      elif item not in entered:
        entered.add(item)
        stack.append((item,))
        stack.extend(filter(None, item.parent_ctxs))
    return order

  def backward(self, gradient: Tensor | None = None) -> Tensor:
    """Accumulate d(self)/d(leaf) into `.grad` of every leaf that requires grad."""
    if gradient is None:
      if self.numel() != 1:
        raise AutogradError(f"backward() without a gradient needs a scalar (one-element) tensor, this one has "
                            f"shape {self.shape}; pass gradient=Tensor.ones_like(t) or reduce it first (.sum())")
      gradient = Tensor.full(self.shape, 1.0, self.dtype, device=self.device)
    if not self.requires_grad and self._ctx is None:
      raise AutogradError("element 0 of tensors does not require grad and does not have a grad_fn: backward() on a "
                          "tensor that does not require grad: no input has requires_grad=True, it was computed under "
                          "no_grad(), or every path to one goes through an op without a gradient (comparisons, "
                          "argmax/argmin, casts to integer or bool, detach())")
    if gradient.shape != self.shape:
      raise ShapeError(f"backward gradient of shape {gradient.shape} does not match the tensor's shape {self.shape}")
    if self._ctx is None:  # a leaf: its own gradient is the one given
      self.grad = gradient if self.grad is None else self.grad + gradient
      return self
    # a large eager forward starts on the device now, while the backward's graph is built (OVERLAP_BACKWARD)
    if engine_realize.realize_before_backward(self.device): self.realize()
    for leaf, leaf_grad in self._backpropagate(gradient, free_graph=True).values():
      leaf.grad = leaf_grad if leaf.grad is None else leaf.grad + leaf_grad
    return self

  def _backpropagate(self, gradient: Tensor, free_graph: bool,
                     wanted: set[int] | frozenset[int] = frozenset()) -> dict[int, tuple[Tensor, Tensor]]:
    """The one backward walk (backward and gradient share it): push `gradient`, d(loss)/d(self), back through the
    recorded Functions in reverse topological order (`_toposort`: each Function's inputs as they were when it was
    applied, so a later in-place write does not reroute the walk). Returns {id: (tensor, its total gradient)} for
    every leaf that requires grad and for each intermediate tensor whose id is in `wanted` (complete when the walk
    reaches its Function: every consumer comes before it). `free_graph` drops the Functions once used, as PyTorch
    does without retain_graph.

    Gradients travel as lazy buffers (a Function's backward takes and returns them) and become tensors only at the
    end: a tensor per gradient in between was a wrapper and an Add Function per accumulation, no graph of its own."""
    assert self._ctx is not None
    grads: dict[F.Function, Lazy] = {self._ctx: gradient.lazydata}   # Function -> the gradient of its output
    order = self._toposort()
    # the intermediate tensors asked for, by the Function that made them
    wanted_outputs = {parent._ctx: parent for ctx in order for parent in ctx.parents
                      if id(parent) in wanted and parent._ctx is not None} if wanted else {}
    found: dict[int, tuple[Tensor, Lazy]] = {}
    versions_made = Storage.versions_made   # (backward bodies write nothing)
    for ctx in reversed(order):
      grad_output = grads.pop(ctx, None)
      if grad_output is None: continue
      if wanted_outputs and ctx in wanted_outputs:
        found[id(wanted_outputs[ctx])] = (wanted_outputs[ctx], grad_output)
      # a Function applied after the last in-place write saved only current values
      if ctx.versions_seen != versions_made: _check_saved_values(ctx)
      input_grads = ctx.backward(grad_output)
      if type(input_grads) is not tuple: input_grads = (input_grads,)
      for parent, parent_ctx, needed, parent_grad in zip(ctx.parents, ctx.parent_ctxs, ctx.needs_input_grad,
                                                         input_grads):
        if parent_grad is None or not needed: continue
        parent_lazy = parent._lazydata
        if parent_grad.shape != parent_lazy.shape:
          raise AssertionError(f"grad shape {parent_grad.shape} != {parent.shape}")
        # the gradient as a value of its own on the parent's device(s): a computed gradient on the parent's single
        # device as it is (checked here, without _own_value's call: every edge of every backward walk), one that is a
        # buffer's memory as an identity op of it (`_own_value`)
        if type(parent_grad) is LazyBuffer and type(parent_lazy) is LazyBuffer and \
            parent_grad.device == parent_lazy.device:
          grad_base = parent_grad._base or parent_grad   # (a LazyBuffer is always true)
          if grad_base.realized is not None or grad_base.op is ASSIGN: parent_grad = _own_value(parent_grad)
        else: parent_grad = _gradient_moved_for(parent, parent_grad)
        if parent_ctx is None:  # a leaf: its gradient is complete at the end of the walk
          known = found.get(id(parent))
          found[id(parent)] = (parent, parent_grad if known is None else _accumulate(known[1], parent_grad))
        else:
          known_grad = grads.get(parent_ctx)
          grads[parent_ctx] = parent_grad if known_grad is None else _accumulate(known_grad, parent_grad)
        if free_graph and parent._ctx is parent_ctx: parent._ctx = None
    if free_graph: self._ctx = None
    return {key: (tensor, Tensor(grad, requires_grad=False)) for key, (tensor, grad) in found.items()}

  def gradient(self, *targets: Tensor, gradient: Tensor | None = None,
               materialize_grads: bool = False) -> list[Tensor]:
    """d(self)/d(target) for each of `targets`, as new lazy tensors (tinygrad's functional gradient, torch's
    torch.autograd.grad): `.grad` is left untouched and the graph is kept, so it can be asked again. Targets may be
    leaves or intermediate tensors of the graph; they must require grad. `gradient` is d(loss)/d(self), needed
    unless self has one element. A target the graph does not reach raises AutogradError, or gives zeros with
    `materialize_grads`. The gradients are not differentiable themselves (no double backward)."""
    if gradient is None:
      if self.numel() != 1:
        raise AutogradError(f"gradient() without a gradient needs a scalar (one-element) tensor, this one has shape "
                            f"{self.shape}; pass gradient=Tensor.ones_like(t) or reduce it first (.sum())")
      gradient = Tensor.full(self.shape, 1.0, self.dtype, device=self.device)
    if gradient.shape != self.shape:
      raise ShapeError(f"gradient of shape {gradient.shape} does not match the tensor's shape {self.shape}")
    wanted = {id(target) for target in targets}
    found: dict[int, tuple[Tensor, Tensor]] = {}
    if id(self) in wanted: found[id(self)] = (self, gradient)
    if self._ctx is not None: found.update(self._backpropagate(gradient, free_graph=False, wanted=wanted))
    results = []
    for number, target in enumerate(targets):
      if id(target) in found: results.append(found[id(target)][1])
      elif materialize_grads: results.append(target.zeros_like(requires_grad=False))
      else:
        raise AutogradError(f"gradient(): target {number} (shape {target.shape}) is not reached from this tensor's "
                            f"graph: it does not require grad, or no path from it leads here (pass "
                            f"materialize_grads=True for zeros)")
    return results

  @staticmethod
  @contextmanager
  def no_grad_context() -> Iterator[None]:
    """A context manager that stops recording autograd graphs in its block (like ourgrad.no_grad())."""
    previous = Tensor.no_grad
    Tensor.no_grad = True
    try:
      yield
    finally:
      Tensor.no_grad = previous

  @staticmethod
  @contextmanager
  def train(mode: bool = True) -> Iterator[None]:
    """A context manager that sets Tensor.training to `mode` in its block (dropout acts only while training)."""
    previous = Tensor.training
    Tensor.training = mode
    try:
      yield
    finally:
      Tensor.training = previous


def _check_saved_values(ctx: F.Function) -> None:
  """AutogradError if a value `ctx` saved for backward was written in place after the forward: its buffer holds
  another value now (PyTorch raises this error from its version counters; here an in-place write makes a newer
  version of the buffer's base, LazyBuffer.write)."""
  for saved in ctx.saved_values():
    if type(saved) is LazyBuffer:
      # (LazyBuffer.stale without the property call: every saved value of every step is checked)
      base = saved._base if saved._base is not None else saved
      if (base._storage is None or base._storage.head is base) and saved._const is None: continue
    if any(lazy.stale for lazy in _per_device(saved)):
      raise AutogradError(f"one of the variables needed for gradient computation has been modified by an inplace "
                          f"operation: the {saved.shape} {saved.dtype} tensor that {type(ctx).__name__} saved for "
                          f"backward was written in place (assign, +=, setitem, an optimizer step) after the forward "
                          f"pass; write it after backward(), or use a clone() in the forward")


def _gradient_moved_for(parent: Tensor, grad: Lazy) -> Lazy:
  """A Function's gradient for its input `parent` that is no single device's lazy buffer on the parent's device (a
  Function may move data between devices: Shard), as a value of its own (`_own_value`) on the parent's device(s).
  (The common case, a lazy buffer on the parent's device, is the backward walk's edge loop's.)"""
  return Tensor(_own_value(grad), device=parent.device, requires_grad=False).lazydata


def _accumulate(total: Lazy, grad: Lazy) -> Lazy:
  """total + grad: the gradients of a tensor that several Functions read, summed in the order the walk reaches them.
  One lazy ADD where they agree in dtype and shape (the graph Tensor's + builds), Tensor's + (promotion) otherwise."""
  if total.dtype == grad.dtype and total.shape == grad.shape and type(total) is type(grad):
    return total.elementwise(ADD, grad)
  return (Tensor(total, requires_grad=False) + Tensor(grad, requires_grad=False)).lazydata


# Storage -> the tensors made views of a rebased tensor (`_rebase_viewed_tensor`), rebuilt at each later write
_REBASED_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_VIEW_FUNCTIONS = (FM.Reshape, FM.Permute, FM.Shrink, FM.Flip, FM.Pad, FM.Expand, FM.ViewOf)


def _rebase_viewed_tensor(view: Tensor, viewed_from: F.Function | None, target: LazyBuffer) -> None:
  """After a differentiable write through `view` (`v = h[0:2]; v += x`), the tensors it was viewed from take the
  write into their gradient paths, as PyTorch does: the movement Functions that made `view` (`viewed_from` first)
  lead back through them to the one that is the whole of the written memory (FM.WriteThroughView); the others become
  views of that one (FM.ViewOf). Tensors written since, or made another way, are left as they are."""
  ctx, chain, root = viewed_from, [], None   # chain: the tensors `view` was made from, nearest first
  while isinstance(ctx, _VIEW_FUNCTIONS):
    parent, parent_ctx = ctx.parents[0], ctx.parent_ctxs[0]
    lazy = parent._lazydata
    if type(lazy) is not LazyBuffer or parent._ctx is not parent_ctx: break
    lazy = lazy.current()
    if lazy.base is not view.lazydata.base: break
    chain.append(parent)
    if lazy.reads_whole_base: root = parent
    ctx = parent_ctx
  if root is None or (root._ctx is None and root.requires_grad): return   # a parameter: the write is data only
  rebased = FM.WriteThroughView.apply(root, view, st=target.st)
  root._ctx, root.requires_grad = rebased._ctx, True
  # the views in between, `view` itself, and the views an earlier write made so, are views of the root's new value
  # from now on (a later write through any of them finds the root again)
  storage = view.lazydata.base._storage
  # by id, with weak references (a Tensor's == is elementwise, so it cannot be a set member)
  views: dict[int, weakref.ref[Tensor]] = _REBASED_VIEWS.setdefault(storage, {}) if storage is not None else {}
  known = [tensor for ref in list(views.values()) if (tensor := ref()) is not None and
           isinstance(tensor._ctx, FM.ViewOf) and tensor._ctx.parents[0] is root]
  between = chain[:next(index for index, tensor in enumerate(chain) if tensor is root)]
  for tensor in [view, *reversed(between), *known]:
    try:
      tensor._ctx, tensor.requires_grad = FM.ViewOf.apply(root, st=tensor.lazydata.st)._ctx, True
      views[id(tensor)] = weakref.ref(tensor, lambda _, key=id(tensor): views.pop(key, None))
    except ShapeError:   # a view that is no lattice of the memory (expanded): its gradient path stays as it was
      continue


def _keep_old_value(ctx: F.Function, target: LazyBuffer) -> None:
  """The in-place op `ctx` (x *= w) saved the value it overwrites (w's gradient needs the old x): it keeps that
  value (an identity cast computed from it, which the write leaves alone or snapshots), as PyTorch keeps the
  original of `self` for an in-place op, rather than failing the saved-value check at backward()."""
  for name, saved in vars(ctx).items():
    if saved is target and type(target) is LazyBuffer:
      setattr(ctx, name, LazyBuffer.create_base(target.device, target.shape, target.dtype, Ops.CAST, target.dtype,
                                                (target,)))


def _own_value(lazy: LazyBuffer) -> LazyBuffer:
  """A gradient as a value of its own. One that folded to a tensor's memory (d(x*w)/dw is x itself) would otherwise
  name that memory and follow in-place writes to it (an optimizer step writing x before reading w.grad): an identity
  cast, fused into its readers, is a value computed from it, kept as it was at backward() (docs/reliability.md)."""
  if type(lazy) is not LazyBuffer or (lazy.base.realized is None and lazy.base.op is not ASSIGN): return lazy
  return LazyBuffer.create_base(lazy.device, lazy.shape, lazy.dtype, Ops.CAST, lazy.dtype, (lazy,))


def _per_device(lazy: LazyBuffer | MultiLazyBuffer) -> list[LazyBuffer]:
  """The LazyBuffers behind a tensor's data: itself, or one per device of a multi-device tensor."""
  return lazy.lbs if isinstance(lazy, MultiLazyBuffer) else [lazy]


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
