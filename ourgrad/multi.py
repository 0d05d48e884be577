"""MultiLazyBuffer: one tensor spread over several devices.

A MultiLazyBuffer holds one LazyBuffer per device and `axis`, the dimension it is sharded along, or None when every
device holds the whole tensor (replicated). Shard i holds rows `bounds[i]` of that axis; sizes follow
numpy.array_split (the first `n % k` shards one larger), so uneven sizes work. It answers the same calls as a
LazyBuffer (elementwise, reduce, movement ops, cast, ...), so the autograd Functions of function.py and every
composite Tensor op run on it unchanged, shard by shard:

  elementwise   operands sharded alike run per shard; a replicated operand is cut to each shard's rows
  reduce        over other axes: stays sharded; over the shard axis: a reduce per shard, then an allreduce
                (the K-sharded matmul is exactly this: partial sums, then an allreduce)
  movement      reshape/permute/expand follow the shard axis where it maps to one new axis; a pad, shrink or flip
                of the shard axis, or a reshape that splits or merges it across shards, raises ShardingError

Collectives come from ourgrad/distributed/collectives.py (copies on CPUs, NCCL on CUDA). `Tensor.shard` makes one,
`.to(device)` and `.numpy()` gather it.
"""
from __future__ import annotations

from typing import Any, Sequence

from ourgrad.device import Device
from ourgrad.distributed.collectives import allreduce, even_split_sizes, gather_to
from ourgrad.dtype import DType
from ourgrad.errors import ShardingError
from ourgrad.function import Function
from ourgrad.helpers import normalize_axis, prod
from ourgrad.lazy import LazyBuffer
from ourgrad.ops import Ops

REDUCE_NAMES = {Ops.SUM: "sum", Ops.MAX_REDUCE: "max"}


def canonical_devices(devices: Sequence[str] | int) -> tuple[str, ...]:
  """Canonical names of a device list; an int n means the first n devices of the default kind."""
  if isinstance(devices, int):
    kind = Device.DEFAULT.partition(":")[0]
    devices = [f"{kind}:{index}" for index in range(devices)]
  names = tuple(Device.canonicalize(device) for device in devices)
  if len(set(names)) != len(names): raise ShardingError(f"devices repeat in {names}")
  if not names: raise ShardingError("shard needs at least one device")
  return names


class MultiLazyBuffer:
  """One LazyBuffer per device, sharded along `axis` (None: replicated)."""

  def __init__(self, lbs: Sequence[LazyBuffer], axis: int | None):
    self.lbs, self.axis = list(lbs), axis
    self.dtype: DType = self.lbs[0].dtype
    first = self.lbs[0].shape
    if axis is None:
      self.shape: tuple[int, ...] = first
    else:
      self.shape = first[:axis] + (sum(lb.shape[axis] for lb in self.lbs),) + first[axis + 1:]

  # ---------------------------------------------------------------- construction and properties

  @staticmethod
  def from_lazy(lazy: LazyBuffer, devices: Sequence[str], axis: int | None) -> MultiLazyBuffer:
    """`lazy` copied to every device (axis None) or cut along `axis` into one piece per device."""
    if axis is None: return MultiLazyBuffer([lazy.copy_to_device(device) for device in devices], None)
    sizes = even_split_sizes(lazy.shape[axis], len(devices))
    pieces, start = [], 0
    for device, size in zip(devices, sizes):
      bounds = tuple((start, start + size) if dim == axis else (0, full) for dim, full in enumerate(lazy.shape))
      pieces.append(lazy.shrink(bounds).copy_to_device(device))
      start += size
    return MultiLazyBuffer(pieces, axis)

  @staticmethod
  def from_const(lazy: LazyBuffer) -> MultiLazyBuffer:
    """A constant built with a tuple of devices (LazyBuffer.full(value, shape, dtype, devices)): replicated."""
    value = lazy.const_value()
    if value is None: raise ShardingError(f"a LazyBuffer on devices {lazy.device} must be a constant")
    return MultiLazyBuffer([LazyBuffer.full(value, lazy.shape, lazy.dtype, device) for device in lazy.device], None)

  @property
  def device(self) -> tuple[str, ...]: return tuple(lb.device for lb in self.lbs)

  @property
  def bounds(self) -> list[tuple[int, int]]:
    """The [start, end) of the shard axis that each device holds."""
    if self.axis is None: return [(0, 0)] * len(self.lbs)
    result, start = [], 0
    for lb in self.lbs:
      result.append((start, start + lb.shape[self.axis]))
      start += lb.shape[self.axis]
    return result

  @property
  def size(self) -> int: return prod(self.shape)

  @property
  def is_realized(self) -> bool: return all(lb.is_realized for lb in self.lbs)

  def const_value(self) -> Any | None:
    values = {lb.const_value() for lb in self.lbs}
    return values.pop() if len(values) == 1 else None

  def __repr__(self) -> str:
    return f"<MLB {self.device} {self.shape} {self.dtype} axis={self.axis}>"

  def _describe(self) -> str:
    return "replicated" if self.axis is None else f"sharded on axis {self.axis} as {self.bounds}"

  def _map(self, method: str, *args: Any, **kwargs: Any) -> MultiLazyBuffer:
    return MultiLazyBuffer([getattr(lb, method)(*args, **kwargs) for lb in self.lbs], self.axis)

  def _shard_of(self, index: int, axis: int, bounds: tuple[int, int]) -> LazyBuffer:
    """This replicated buffer's copy on device `index`, cut to `bounds` of `axis` (to meet a sharded operand)."""
    lb = self.lbs[index]
    return lb.shrink(tuple(bounds if dim == axis else (0, full) for dim, full in enumerate(lb.shape)))

  # ---------------------------------------------------------------- gathering

  def gather(self, device: str) -> LazyBuffer:
    """The whole tensor on one device (for a replicated one, the copy already there or the first one's)."""
    device = Device.canonicalize(device)
    if self.axis is None:
      local = next((lb for lb in self.lbs if lb.device == device), self.lbs[0])
      return local.copy_to_device(device)
    return gather_to(self.lbs, self.axis, device)

  def copy_to_device(self, device: str) -> LazyBuffer: return self.gather(device)

  # ---------------------------------------------------------------- compute

  def elementwise(self, op: Ops, *others: MultiLazyBuffer, arg: Any = None, dtype: DType | None = None
                  ) -> MultiLazyBuffer:
    operands = (self, *others)
    for other in others:
      if not isinstance(other, MultiLazyBuffer) or other.device != self.device:
        devices = getattr(other, "device", None)
        raise ShardingError(f"{op.name} of a tensor on {self.device} and one on {devices}: shard both over the "
                            f"same devices")
    sharded = [operand for operand in operands if operand.axis is not None]
    axis = sharded[0].axis if sharded else None
    for operand in sharded[1:]:
      if operand.axis != axis or operand.bounds != sharded[0].bounds:
        raise ShardingError(f"{op.name} of tensors {sharded[0]._describe()} and {operand._describe()} over "
                            f"{self.device}: reshard one (.to(device).shard(devices, axis)) so both match")
    bounds = sharded[0].bounds if sharded else None
    results = []
    for index in range(len(self.lbs)):
      locals_ = [operand.lbs[index] if operand.axis is not None or bounds is None
                 else operand._shard_of(index, axis, bounds[index]) for operand in operands]
      results.append(locals_[0].elementwise(op, *locals_[1:], arg=arg, dtype=dtype))
    return MultiLazyBuffer(results, axis)

  def cast(self, dtype: DType, bitcast: bool = False) -> MultiLazyBuffer: return self._map("cast", dtype, bitcast)
  def contiguous(self) -> MultiLazyBuffer: return self._map("contiguous")
  def clone(self) -> MultiLazyBuffer: return self._map("clone")

  def const_like(self, value: Any, dtype: DType | None = None) -> MultiLazyBuffer:
    return self._map("const_like", value, dtype)

  def operand_like(self, value: Any, dtype: DType | None = None) -> MultiLazyBuffer:
    """LazyBuffer.operand_like per shard: a constant only read by the op being built."""
    return self._map("operand_like", value, dtype)

  def reduce(self, op: Ops, axes: tuple[int, ...]) -> MultiLazyBuffer:
    """Per shard; when the shard axis is reduced, the partial results are combined by an allreduce (replicated)."""
    partials = [lb.reduce(op, axes) for lb in self.lbs]
    if self.axis is None or self.axis not in axes:
      return MultiLazyBuffer(partials, self.axis)
    # an empty shard reduces to the identity, so it joins the allreduce harmlessly
    return MultiLazyBuffer(allreduce(partials, REDUCE_NAMES[op]), None)

  def assign(self, value: MultiLazyBuffer) -> MultiLazyBuffer:
    """Each shard written in place (optimizer updates); the value must be sharded alike."""
    if value.axis != self.axis or value.bounds != self.bounds:
      raise ShardingError(f"assign of a tensor {value._describe()} to one {self._describe()}")
    return MultiLazyBuffer([target.assign(new) if is_assignable(target) else new
                            for target, new in zip(self.lbs, value.lbs)], self.axis)

  # ---------------------------------------------------------------- movement

  def _local_shape(self, shape: tuple[int, ...], axis: int | None, index: int) -> tuple[int, ...]:
    if axis is None: return shape
    return shape[:axis] + (self.lbs[index].shape[self.axis],) + shape[axis + 1:]  # type: ignore[index]

  def reshape(self, shape: tuple[int, ...]) -> MultiLazyBuffer:
    if self.axis is None or shape == self.shape: return self._map("reshape", shape)
    new_axis, local_shapes = self._reshaped_axis(shape)
    return MultiLazyBuffer([lb.reshape(local) for lb, local in zip(self.lbs, local_shapes)], new_axis)

  def _reshaped_axis(self, shape: tuple[int, ...]) -> tuple[int, list[tuple[int, ...]]]:
    """The axis of `shape` that holds the shard axis, and each shard's local shape; ShardingError if the reshape
    would move elements between shards."""
    axis = self.axis
    assert axis is not None
    before, after = prod(self.shape[:axis]), prod(self.shape[axis + 1:])
    candidates = [k for k in range(len(shape)) if prod(shape[:k]) == before]
    # prefer the axis that keeps the shard axis' size, then any other that every shard's rows fill exactly
    candidates.sort(key=lambda k: (shape[k] != self.shape[axis], shape[k] == 1))
    for k in candidates:
      new_after = prod(shape[k + 1:])
      if new_after == 0 or any((lb.shape[axis] * after) % new_after for lb in self.lbs): continue
      if shape[k] * new_after != self.shape[axis] * after: continue
      local_shapes = [shape[:k] + (lb.shape[axis] * after // new_after,) + shape[k + 1:] for lb in self.lbs]
      return k, local_shapes
    raise ShardingError(f"reshape {self.shape} -> {shape} would move elements across the shards of axis {axis} "
                        f"({self.bounds} over {self.device}); gather with .to(device) first")

  def permute(self, order: tuple[int, ...]) -> MultiLazyBuffer:
    new_axis = None if self.axis is None else order.index(self.axis)
    return MultiLazyBuffer([lb.permute(order) for lb in self.lbs], new_axis)

  def expand(self, shape: tuple[int, ...]) -> MultiLazyBuffer:
    if self.axis is not None and shape[self.axis] != self.shape[self.axis]:
      raise ShardingError(f"expand {self.shape} -> {shape} along the shard axis {self.axis} over {self.device}")
    return MultiLazyBuffer([lb.expand(self._local_shape(shape, self.axis, index)) for index, lb in
                            enumerate(self.lbs)], self.axis)

  def _check_axis_untouched(self, what: str, touched: Sequence[bool]) -> None:
    if self.axis is not None and touched[self.axis]:
      raise ShardingError(f"{what} of the shard axis {self.axis} ({self.bounds} over {self.device}) would cross "
                          f"shards; gather with .to(device) first, or shard along another axis")

  def pad(self, arg: tuple[tuple[int, int], ...]) -> MultiLazyBuffer:
    self._check_axis_untouched("pad", [pads != (0, 0) for pads in arg])
    return self._map("pad", arg)

  def shrink(self, arg: tuple[tuple[int, int], ...]) -> MultiLazyBuffer:
    self._check_axis_untouched("shrink", [bounds != (0, size) for bounds, size in zip(arg, self.shape)])
    if self.axis is None: return self._map("shrink", arg)
    return MultiLazyBuffer([lb.shrink(tuple((0, lb.shape[self.axis]) if dim == self.axis else bounds
                                            for dim, bounds in enumerate(arg))) for lb in self.lbs], self.axis)

  def flip(self, axes_mask: tuple[bool, ...]) -> MultiLazyBuffer:
    self._check_axis_untouched("flip", axes_mask)
    return self._map("flip", axes_mask)


def is_assignable(lazy: LazyBuffer | MultiLazyBuffer) -> bool:
  """Whether an assign writes into `lazy`'s own memory in place: a realized base that is not a constant (on every
  device, for a tensor over several). Otherwise Tensor.assign just takes the value's data."""
  if isinstance(lazy, MultiLazyBuffer): return all(is_assignable(lb) for lb in lazy.lbs)
  return lazy.is_base and lazy.realized is not None and lazy.op is not Ops.CONST


def empty_like(lazy: LazyBuffer | MultiLazyBuffer) -> LazyBuffer | MultiLazyBuffer:
  """Realized buffers of unspecified values placed as `lazy`: the same shape and dtype on the same device, or every
  shard's on its device, sharded alike. An assign target that owns its memory (load_state_dict, optimizer state)."""
  if isinstance(lazy, MultiLazyBuffer):
    return MultiLazyBuffer([LazyBuffer.empty(lb.shape, lb.dtype, lb.device) for lb in lazy.lbs], lazy.axis)
  return LazyBuffer.empty(lazy.shape, lazy.dtype, lazy.device)


def shard_lazy(lazy: LazyBuffer | MultiLazyBuffer, devices: Sequence[str] | int, axis: int | None
               ) -> MultiLazyBuffer:
  """`lazy` (on one device, or already multi-device: gathered first) spread over `devices`."""
  names = canonical_devices(devices)
  if isinstance(lazy, MultiLazyBuffer):
    if lazy.device == names and lazy.axis == (None if axis is None else normalize_axis(axis, len(lazy.shape))):
      return lazy
    lazy = lazy.gather(names[0])
  if axis is not None: axis = normalize_axis(axis, len(lazy.shape))
  return MultiLazyBuffer.from_lazy(lazy, names, axis)


class Shard(Function):
  """Tensor.shard as an autograd Function: the gradient of the sharded tensor flows back to the tensor it was made
  from, gathered onto its device (or resharded as it was, for a tensor already over several devices). A replicated
  copy's gradient is the whole tensor's on every device (ops on replicas run alike), so the local copy is taken."""

  def forward(self, x: LazyBuffer | MultiLazyBuffer, devices: tuple[str, ...], axis: int | None) -> MultiLazyBuffer:
    self.source_device, self.source_axis = x.device, getattr(x, "axis", None)
    result = shard_lazy(x, devices, axis)
    self.device = result.device   # Function.apply builds the result on self.device: all of them
    return result

  def backward(self, grad_output: MultiLazyBuffer) -> LazyBuffer | MultiLazyBuffer:
    if isinstance(self.source_device, tuple): return shard_lazy(grad_output, self.source_device, self.source_axis)
    return grad_output.gather(self.source_device)
