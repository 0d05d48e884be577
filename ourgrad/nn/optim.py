"""Optimizers: SGD (momentum, Nesterov, weight decay), Adam, AdamW and LAMB.

Every optimizer updates its parameters *in place* and *in one schedule*: `step()` builds the new value of
every parameter and every piece of state (momentum buffers, first/second moments, the step count) lazily
with `Tensor.assign`, then realizes all of them with a single `Tensor.realize_all` call. The scheduler fuses
each update into one kernel per written buffer, and the writes land in the buffers the tensors already own.
`schedule_step()` returns those tensors unrealized, to realize other tensors (the loss) in the same schedule.

Hyper-parameters that change during training live in device buffers, not in the kernels: the learning rate
is `lr_tensor` (a realized one-element Tensor; `opt.lr = 0.01` writes into it) and Adam's step count `t` is
a Tensor too. So the kernels of step n + 1 are the same as those of step n, and changing the learning rate
(a schedule, a warm-up) never compiles a new kernel.

Parameter groups, as PyTorch: `AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0}],
lr=1e-3)`. `optimizer.param_groups` is a list of dicts (`ParamGroup`) holding each group's params and
hyper-parameters; writing `group["lr"] = x` (what the schedulers of ourgrad.optim.lr_scheduler do) sets that
group's learning rate buffer, so it compiles nothing. Several groups are several optimizers of the same class, one
per group (built by `_ParamGroupsMeta`), stepped in one schedule: the step code stays the one of a single group.

Each parameter's update is built on lazy buffers directly (`_LazyUpdate`), not through Tensor methods: a step runs
without autograd, and Tensor -> Function -> LazyBuffer per op was most of an eager step's optimizer time (~15 ops per
parameter). What depends only on the step (the learning rate times the bias corrections, Adam's 1/sqrt(1 - b2^t),
AdamW's decay factor) is one 0-d value per step, shared by every parameter as a broadcast view. The values are those
of the Tensor formulas: the same operations in the same order.

The formulas are PyTorch's (`torch.optim.SGD` with dampening=0, `torch.optim.Adam`, `torch.optim.AdamW`);
LAMB follows the paper (You et al., 2019, "Large Batch Optimization for Deep Learning") as tinygrad does.
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable

import numpy as np

from ourgrad.dtype import DType, dtypes
from ourgrad.engine.exec_item import jit_recording
from ourgrad.errors import AutogradError, DTypeError
from ourgrad.lazy import LazyBuffer, _broadcast_scalar
from ourgrad.mixed_precision import LOW_FLOAT_DTYPES, suspend_autocast
from ourgrad.multi import MultiLazyBuffer, is_assignable
from ourgrad.ops import ADD, CONST, EXP2, MUL, NEG, RECIP, SQRT, Ops
from ourgrad.tensor import Tensor, no_grad

Lazy = LazyBuffer | MultiLazyBuffer


def _state_like(param: Tensor) -> Tensor:
  """A realized buffer of zeros shaped like `param` (a real buffer, not a constant, so it can be assigned to); for a
  parameter over several devices, one per shard, sharded as the parameter is."""
  lazy = param.lazydata
  if isinstance(lazy, MultiLazyBuffer):
    return Tensor(MultiLazyBuffer([_state_like(Tensor(shard)).lazydata for shard in lazy.lbs], lazy.axis))
  return Tensor(np.zeros(param.shape, dtype=np.float32), device=param.device, dtype=dtypes.float32)


def _scalar_buffer(value: float, device: str | tuple[str, ...]) -> Tensor:
  """A realized 0-d float32 Tensor holding `value` (kernels read it from memory: changing it recompiles nothing);
  replicated on every device of a tuple."""
  return Tensor(np.array(value, dtype=np.float32), device=device, dtype=dtypes.float32).realize()


class _LazyUpdate:
  """Elementwise math of an optimizer step's updates on lazy buffers (a single device's LazyBuffer or a
  MultiLazyBuffer: both have these methods), one per step. A Python number read by a parameter's update is one shared
  constant per (value, dtype, device, shape), made once for all steps (LazyBuffer.operand_constant); a 0-d number
  (the per-step math) one 0-d constant per step. A per-step value is read by every parameter of one shape and dtype
  through one broadcast view."""

  def __init__(self) -> None:
    self._constants: dict[tuple[float, DType, str], LazyBuffer] = {}
    # (id of a per-step 0-d value, shape, dtype) -> its broadcast view; the step keeps those values alive
    self._broadcasts: dict[tuple[int, tuple[int, ...], DType], Lazy] = {}

  @staticmethod
  def broadcast(scalar: Lazy, like: Lazy) -> Lazy:
    """A 0-d value seen with `like`'s shape (one view of a single device's base)."""
    if type(like) is LazyBuffer and type(scalar) is LazyBuffer and scalar.is_base and scalar.shape == ():
      return scalar.view(_broadcast_scalar(like.shape))
    return scalar.reshape((1,) * len(like.shape)).expand(like.shape)

  def per_step(self, scalar: Lazy, like: Lazy) -> Lazy:
    """A 0-d value computed once per step (a learning rate times a bias correction), as `like`'s shape and dtype."""
    key = (id(scalar), like.shape, like.dtype)
    view = self._broadcasts.get(key)
    if view is None: view = self._broadcasts[key] = self.broadcast(scalar.cast(like.dtype), like)
    return view

  def constant(self, value: float, like: Lazy) -> Lazy:
    """`value` with `like`'s shape and dtype, only as an operand of the op being built (never a tensor's value)."""
    if type(like) is LazyBuffer and like.shape:   # (most calls: operand_constant without operand_like's frame)
      return LazyBuffer.operand_constant(value, like.shape, like.dtype, like.device)
    if type(like) is not LazyBuffer: return like.const_like(value)
    key = (value, like.dtype, like.device)
    scalar = self._constants.get(key)
    if scalar is None: scalar = self._constants[key] = LazyBuffer.full(value, (), like.dtype, like.device)
    return scalar

  @staticmethod
  def add(x: Lazy, y: Lazy) -> Lazy: return x.elementwise(ADD, y)

  def mul(self, x: Lazy, y: Lazy | float) -> Lazy:
    if type(y) is float and type(x) is LazyBuffer and x.shape:   # (most calls: a hyper-parameter, constant's case)
      return x.elementwise(MUL, LazyBuffer.operand_constant(y, x.shape, x.dtype, x.device))
    # (a hyper-parameter may be a numpy scalar: anything not a lazy buffer is a number)
    return x.elementwise(MUL, y if isinstance(y, (LazyBuffer, MultiLazyBuffer)) else self.constant(float(y), x))

  @staticmethod
  def neg(x: Lazy) -> Lazy: return x.elementwise(NEG)   # (x * -1 for floats, as Tensor's neg)

  def one_minus(self, x: Lazy) -> Lazy:
    """1 - x, as Tensor's `1.0 - x` builds it: 1 + (-x)."""
    return self.add(self.constant(1.0, x), self.neg(x))

  def exp(self, x: Lazy) -> Lazy:
    """e ** x of a float32 value, as Tensor.exp builds it: exp2(x * (1 / ln 2))."""
    return self.mul(x, 1 / math.log(2)).elementwise(EXP2)

  @staticmethod
  def div(x: Lazy, y: Lazy) -> Lazy: return x.elementwise(MUL, y.elementwise(RECIP))   # as Tensor.div

  @staticmethod
  def sqrt(x: Lazy) -> Lazy: return x.elementwise(SQRT)

  @staticmethod
  def cast(x: Lazy, dtype: DType) -> Lazy: return x.cast(dtype)


def assign_lazy(tensor: Tensor, value: Lazy, current: Lazy | None = None) -> Tensor:
  """`tensor.assign(value)` for a lazy value (cast to the tensor's dtype); returns the tensor. A value of the
  tensor's shape, dtype and device written into a single device's buffer takes the short way, what assign does for
  it: optimizer state, parameters and running statistics are leaves and the value has no Function, so there is no
  autograd to adopt.
  `current`: the tensor's lazydata as the caller read it in this step, before any write (saves reading it again)."""
  target = tensor.lazydata if current is None else current
  if type(target) is LazyBuffer and type(value) is LazyBuffer and tensor._ctx is None and \
      value.shape == target.shape and value.dtype == target.dtype and value.device == target.device:
    jit_recording.note_assign(tensor)   # (as Tensor.assign: a TinyJit call realizes the assigns it made)
    tensor._lazydata = target.write(value)   # (the lazydata setter's assignment, without its call)
    return tensor
  return tensor.assign(Tensor(value))


def _is_assignable(tensor: Tensor) -> bool:
  """Whether `tensor` owns a realized buffer (one per shard) that `assign` writes into in place."""
  return is_assignable(tensor.lazydata)


def _own_buffers(param: Tensor) -> None:
  """Give `param` realized memory of its own, keeping its values and sharding: updates are written in place."""
  lazy = param.lazydata
  if isinstance(lazy, MultiLazyBuffer):
    param.lazydata = MultiLazyBuffer([shard if is_assignable(shard) else shard.clone() for shard in lazy.lbs],
                                     lazy.axis)
    param.realize()
  else:
    param.lazydata = Tensor(param.detach().numpy(), device=param.device, dtype=param.dtype).lazydata


class ParamGroup(dict):
  """One entry of `optimizer.param_groups`: "params" and the group's hyper-parameters ("lr", "weight_decay",
  "betas", "momentum", ...), as in PyTorch. Setting an entry updates the optimizer that steps the group: "lr" writes
  its learning-rate buffer (no recompile); another hyper-parameter is a constant of the update kernels, so changing
  it compiles them anew. Other keys ("initial_lr", set by schedulers) are only stored."""

  def __init__(self, optimizer: Optimizer, values: dict[str, Any]):
    super().__init__(values)
    self._optimizer = optimizer

  def __setitem__(self, key: str, value: Any) -> None:
    super().__setitem__(key, value)
    self._optimizer._set_hyper_parameter(key, value)


def _as_param_groups(params: Any) -> list[dict[str, Any]] | None:
  """The group dicts of an optimizer's `params` argument (copied, "params" made a list), or None for plain tensors."""
  if isinstance(params, Tensor): return None
  params = list(params)
  if not any(isinstance(item, dict) for item in params): return None
  if not all(isinstance(item, dict) and "params" in item for item in params):
    raise TypeError("optimizer params must be all Tensors or all dicts with a 'params' entry (parameter groups)")
  groups = []
  for group in params:
    tensors = group["params"]
    groups.append({**group, "params": [tensors] if isinstance(tensors, Tensor) else list(tensors)})
  seen: set[int] = set()
  for group in groups:
    for tensor in group["params"]:
      if id(tensor) in seen: raise ValueError("some parameters appear in more than one parameter group")
      seen.add(id(tensor))
  return groups


class _ParamGroupsMeta(type):
  """Builds optimizers from PyTorch's arguments: reads the hyper-parameters of the call (for `param_groups`), and
  turns a list of several parameter groups into one optimizer of the class per group under a grouping instance."""

  @property
  def __signature__(cls) -> inspect.Signature:
    # help() and inspect show the constructor's parameters, not this __call__'s (*args, **kwargs)
    parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
    return inspect.Signature(parameters)

  def __call__(cls, params: Any, *args: Any, **kwargs: Any) -> Any:
    bound = inspect.signature(cls.__init__).bind(None, None, *args, **kwargs)
    bound.apply_defaults()
    defaults = {key: value for key, value in list(bound.arguments.items())[2:]}
    if not isinstance(params, Tensor): params = list(params)  # an iterator (model.parameters()) is read once
    groups = _as_param_groups(params)
    if groups is None: return cls._with_groups(super().__call__(params, **defaults), defaults)
    optimizers = []
    for group in groups:
      unknown = set(group) - {"params"} - set(defaults)
      if unknown: raise TypeError(f"{cls.__name__} parameter group has unknown options {sorted(unknown)}; "
                                  f"it takes {sorted(defaults)}")
      options = {**defaults, **{key: value for key, value in group.items() if key != "params"}}
      optimizers.append(cls._with_groups(super().__call__(group["params"], **options), options))
    if len(optimizers) == 1: return optimizers[0]
    grouping = cls.__new__(cls)
    grouping._init_grouping(optimizers, defaults)
    return grouping


class Optimizer(metaclass=_ParamGroupsMeta):
  """Base class: holds the parameters and the learning rate; subclasses implement `_updates()`.

  `params` is a list of Tensors (an iterator such as `model.parameters()` works too). Tensors with
  requires_grad=False (BatchNorm's running statistics) are skipped, so `Adam(get_parameters(model))` works for any
  model; a tensor whose requires_grad is unset (None) becomes a parameter (requires_grad=True), as in tinygrad.
  Duplicates are dropped; AutogradError if no tensor is left. A list of dicts gives parameter groups (see
  `param_groups`).
  The learning rate is stored in `lr_tensor`, a realized 0-d Tensor read by the update kernels; the `lr`
  property reads it and its setter writes a new value into the same buffer, which takes effect on the next
  `step()` without compiling anything."""

  def __init__(self, params: list[Tensor], lr: float):
    params = list(params) if not isinstance(params, Tensor) else [params]
    if not params:
      raise AutogradError("optimizer got an empty parameter list: pass the model's weight tensors "
                          "(created with requires_grad=True)")
    unique: list[Tensor] = []
    seen: set[int] = set()
    for index, param in enumerate(params):
      if not isinstance(param, Tensor):
        raise TypeError(f"optimizer got a {type(param).__name__} at position {index}, expected a Tensor")
      if param.requires_grad is False: continue  # buffers (running statistics) are not optimized
      if param.requires_grad is None: param.requires_grad = True
      if id(param) not in seen: unique.append(param); seen.add(id(param))
      if param.dtype in LOW_FLOAT_DTYPES:
        # updates of a few 1e-4 relative size vanish when rounded to 8 (bfloat16) or 11 (float16) mantissa bits
        raise DTypeError(f"{type(self).__name__} got a {param.dtype.name} parameter of shape {param.shape} "
                         f"(position {index}): optimizers update float32 master weights. Keep the model float32 and "
                         f"train under ourgrad.autocast(dtypes.{param.dtype.name}), or call model.float() first; "
                         f"cast to {param.dtype.name} with model.to() for inference only")
    if not unique:
      raise AutogradError(f"optimizer got {len(params)} tensors, all with requires_grad=False: there is nothing "
                          f"to optimize; create the weights with requires_grad=True")
    self.params: list[Tensor] = unique
    self.device: str | tuple[str, ...] = self.params[0].device
    for param in self.params:
      # updates are written in place: every parameter needs its own realized buffer, not a constant or a view
      if not _is_assignable(param): _own_buffers(param)
    self.lr_tensor: Tensor = _scalar_buffer(lr, self.device)

  # ---------------------------------------------------------------- parameter groups

  _group_optimizers: list[Optimizer] = []  # a grouping instance's optimizers, one per parameter group
  param_groups: list[ParamGroup]
  defaults: dict[str, Any]

  @classmethod
  def _with_groups(cls, optimizer: Optimizer, options: dict[str, Any]) -> Optimizer:
    """`optimizer` with its one `param_groups` entry (its params and the hyper-parameters it was built with)."""
    optimizer.defaults = dict(options)
    optimizer.param_groups = [ParamGroup(optimizer, {"params": optimizer.params, **options})]
    return optimizer

  def _init_grouping(self, optimizers: list[Optimizer], defaults: dict[str, Any]) -> None:
    """Make this (not yet initialized) instance step `optimizers` together: one per parameter group."""
    self._group_optimizers = optimizers
    self.defaults = dict(defaults)
    self.params = [param for optimizer in optimizers for param in optimizer.params]
    self.device = optimizers[0].device
    self.lr_tensor = optimizers[0].lr_tensor
    self.param_groups = [optimizer.param_groups[0] for optimizer in optimizers]

  def _set_hyper_parameter(self, key: str, value: Any) -> None:
    """What writing `param_groups[i][key] = value` does to this (single-group) optimizer."""
    if key == "lr": self._write_lr(value)
    elif key == "betas": self.b1, self.b2 = value
    elif key != "params" and key in self.defaults: setattr(self, key, value)

  # ---------------------------------------------------------------- learning rate

  @property
  def lr(self) -> float:
    """The current learning rate (read from `lr_tensor`; the first group's with several groups)."""
    return float(self.lr_tensor.item())

  @lr.setter
  def lr(self, value: float) -> None:
    for group in self.param_groups: group["lr"] = value

  def _write_lr(self, value: float) -> None:
    # write into the existing buffer (no kernel, no recompile): the update kernels load lr from memory
    if not _is_assignable(self.lr_tensor): self.lr_tensor.realize()
    lazy = self.lr_tensor.lazydata
    for replica in (lazy.lbs if isinstance(lazy, MultiLazyBuffer) else [lazy]):
      replica.base.realized.copyin(memoryview(np.array([value], dtype=np.float32)).cast("B"))

  # ---------------------------------------------------------------- stepping

  def zero_grad(self) -> None:
    """Forget the gradients (set every parameter's `.grad` to None), as `zero_grad(set_to_none=True)` does."""
    for param in self.params: param.grad = None

  def step(self) -> None:
    """Update every parameter from its `.grad` (parameters without a gradient are skipped), in one schedule."""
    Tensor.realize_all(*self.schedule_step())

  def schedule_step(self) -> list[Tensor]:
    """Build this step's updates lazily (assigns) and return the tensors to realize, without realizing them.

    `step()` is `Tensor.realize_all(*opt.schedule_step())`. Realize a tensor that reads the old parameters, such
    as the loss, in the same schedule: `Tensor.realize_all(loss, *opt.schedule_step())`.
    (Realized later, a lazy loss would read the already updated parameters.)"""
    if self._group_optimizers:  # several parameter groups: each group's optimizer builds its updates
      return [tensor for optimizer in self._group_optimizers for tensor in optimizer.schedule_step()]
    # an optimizer's math is on float32 master weights: autocast (a step inside an autocast block) never casts it
    with no_grad(), suspend_autocast():
      # (the gradients as they are, not detached: under no_grad nothing the step builds records a Function)
      active = [(param, param.grad) for param in self.params if param.grad is not None]
      if not active: return []
      for param, grad in active:
        if grad.shape != param.shape:
          raise AutogradError(f"gradient of shape {grad.shape} does not match its parameter's shape {param.shape}")
      updated = self._updates(active)
    # the scheduler runs every kernel reading a parameter's old value (the gradients) before the assign to it
    return updated

  def _updates(self, active: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
    """Assign the new values of the parameters in `active` (param, its gradient) and of the optimizer state;
    return every tensor assigned to."""
    raise NotImplementedError


class SGD(Optimizer):
  """Stochastic gradient descent, as `torch.optim.SGD` with dampening=0:

    g = grad + weight_decay * p
    if momentum: b = momentum * b + g            (b starts at 0, so b = g on the first step)
                 g = g + momentum * b if nesterov else b
    p = p - lr * g
  """

  def __init__(self, params: list[Tensor], lr: float = 0.001, momentum: float = 0.0, weight_decay: float = 0.0,
               nesterov: bool = False):
    if nesterov and momentum <= 0: raise ValueError("nesterov momentum needs momentum > 0")
    super().__init__(params, lr)
    self.momentum, self.weight_decay, self.nesterov = momentum, weight_decay, nesterov
    self.buffers: list[Tensor] = [_state_like(param) for param in self.params] if momentum else []

  def _updates(self, active: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
    updated: list[Tensor] = []
    buffer_of = {id(param): buffer for param, buffer in zip(self.params, self.buffers)}
    lazy = _LazyUpdate()
    minus_lr = lazy.neg(self.lr_tensor.lazydata)   # -(lr * g) is (-lr) * g exactly: p + (-lr) * g is p - lr * g
    for param, grad in active:
      weights, g = param.lazydata, grad.lazydata
      if self.weight_decay: g = lazy.add(g, lazy.mul(weights, self.weight_decay))
      if self.momentum:
        buffer = buffer_of[id(param)]
        assign_lazy(buffer, lazy.add(lazy.mul(buffer.lazydata, self.momentum), lazy.cast(g, buffer.dtype)))
        new_buffer = lazy.cast(buffer.lazydata, g.dtype)   # (float32 state; g in the parameter's dtype)
        g = lazy.add(g, lazy.mul(new_buffer, self.momentum)) if self.nesterov else new_buffer
        updated.append(buffer)
      g = lazy.cast(g, param.dtype)
      step = lazy.mul(g, lazy.per_step(minus_lr, g))
      updated.append(assign_lazy(param, lazy.add(weights, step)))
    return updated


class _AdamBase(Optimizer):
  """Shared state of Adam-like optimizers: the moments m and v, and the step count t (a Tensor)."""

  def __init__(self, params: list[Tensor], lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
    super().__init__(params, lr)
    self.b1, self.b2 = betas
    self.eps, self.weight_decay = eps, weight_decay
    if not 0.0 <= self.b1 < 1.0 or not 0.0 <= self.b2 < 1.0:
      raise ValueError(f"betas must be in [0, 1), got {betas}")
    self.m: list[Tensor] = [_state_like(param) for param in self.params]
    self.v: list[Tensor] = [_state_like(param) for param in self.params]
    self.t: Tensor = _scalar_buffer(0.0, self.device)  # steps taken (a buffer, so every step runs the same kernels)
    self._constants_made: dict[tuple, tuple[LazyBuffer, ...]] = {}   # (_operands)

  def _count_step(self, lazy: _LazyUpdate) -> None:
    """t = t + 1, assigned."""
    assign_lazy(self.t, lazy.add(self.t.lazydata, lazy.constant(1.0, self.t.lazydata)))

  def _bias_corrections(self, lazy: _LazyUpdate) -> tuple[Lazy, Lazy]:
    """(1 - b1**t, 1 - b2**t) for the step count t after this step's increment, as lazy 0-d values (the operations
    of the Tensor formula `1.0 - (t * math.log(beta)).exp()`, built without Tensors: the optimizer's own math needs
    no autograd)."""
    t = self.t.lazydata
    def one_minus_power(beta: float) -> Lazy:
      if beta == 0.0: return t.const_like(1.0)
      return lazy.one_minus(lazy.exp(lazy.mul(t, math.log(beta))))  # beta**t with t read from memory
    return one_minus_power(self.b1), one_minus_power(self.b2)

  def _moments(self, index: int, g: Lazy, old: tuple[Lazy, Lazy], node: Node,
               constants: tuple[Lazy, ...]) -> tuple[Lazy, Lazy]:
    """m = b1 * m + (1 - b1) * g and v = b2 * v + (1 - b2) * g * g (g float32), assigned; returns the new (m, v).
    `old` is (m, v) as they are now (their tensors' lazydata), `constants` (b1, 1 - b1, b2, 1 - b2) as operands of g's
    shape, and `node` makes each base (`_node_maker`)."""
    b1, one_minus_b1, b2, one_minus_b2 = constants[:4]
    m, v = self.m[index], self.v[index]
    write = assign_lazy if node is _checked_node else _write_made   # (the state is never a Function's result)
    write(m, node(ADD, None, (node(MUL, None, (old[0], b1)), node(MUL, None, (g, one_minus_b1)))), old[0])
    write(v, node(ADD, None, (node(MUL, None, (old[1], b2)), node(MUL, None, (node(MUL, None, (g, g)), one_minus_b2)))),
          old[1])
    # (each tensor's _lazydata is its newest version: assign_lazy set it)
    return m._lazydata, v._lazydata

  def _operands(self, values: tuple[float, ...], like: Lazy) -> tuple[Lazy, ...]:
    """`values` as operands of `like`'s shape and dtype (`_LazyUpdate.constant`); a single device's, remembered
    across steps by (values, shape, dtype, device): a parameter's update reads five."""
    if type(like) is not LazyBuffer or not like.shape:
      return tuple(_LazyUpdate().constant(value, like) for value in values)
    key = (values, like.shape, like.dtype, like.device)
    known = self._constants_made.get(key)
    if known is None:
      known = self._constants_made[key] = tuple(LazyBuffer.operand_constant(value, like.shape, like.dtype, like.device)
                                                for value in values)
    return known


# makes one base of an optimizer's update: (op, arg, sources) -> the op's result
Node = Callable[[Ops, Any, tuple], Lazy]


def _checked_node(op: Ops, arg: Any, srcs: tuple) -> Lazy:
  """A base made through elementwise, which folds constants and checks operands (the general node maker)."""
  return srcs[0].elementwise(op, *srcs[1:], arg=arg)


def _node_maker(folding: bool, weights: Lazy, g: Lazy, m: Lazy, v: Lazy) -> Node:
  """How the bases of one parameter's update are made: `create_base` itself (a partial: a call in C, no frame) where
  elementwise would make exactly that base for every op of the update, because the parameter, its gradient and its
  moments are float32 values of one shape on one device, none of them a constant (a constant may fold), and no
  hyper-parameter constant folds (`folding`: `_folding`); else `_checked_node`. Building through elementwise's checks
  was most of an update's cost per op. (The checks as chained comparisons, not a loop: they run for every parameter
  of every step.)"""
  if folding or not type(weights) is type(g) is type(m) is type(v) is LazyBuffer: return _checked_node
  shape, device, float32 = weights.shape, weights.device, dtypes.float32
  if not (weights.dtype is g.dtype is m.dtype is v.dtype is float32 and shape == g.shape == m.shape == v.shape and
          device == g.device == m.device == v.device) or \
      CONST in ((weights._base or weights).op, (g._base or g).op, (m._base or m).op, (v._base or v).op):
    return _checked_node
  return functools.partial(LazyBuffer.create_base, device, shape, float32)


def _write_made(tensor: Tensor, value: LazyBuffer, current: LazyBuffer) -> Tensor:
  """`assign_lazy`'s short way without its checks, for a value a `_node_maker` partial made: a single device's
  float32 value of the shape and device of `current` (the tensor's lazydata, checked there), written into a tensor
  that no Function made."""
  jit_recording.note_assign(tensor)
  tensor._lazydata = current.write(value)
  return tensor


def _folding(values: tuple[float, ...]) -> bool:
  """Whether a hyper-parameter constant among `values` may fold with a computed operand in elementwise (x * 1 is x,
  x + -0.0 is x: a 1 or a zero; a NaN too, to be safe)."""
  return 0.0 in values or 1.0 in values or any(value != value for value in values)


class Adam(_AdamBase):
  """Adam, as `torch.optim.Adam` (weight decay is an L2 term added to the gradient):

    g = grad + weight_decay * p
    m = b1 * m + (1 - b1) * g;   v = b2 * v + (1 - b2) * g^2;   t = t + 1
    p = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
  """

  def __init__(self, params: list[Tensor], lr: float = 0.001, betas: tuple[float, float] = (0.9, 0.999),
               eps: float = 1e-8, weight_decay: float = 0.0):
    super().__init__(params, lr, betas, eps, weight_decay)

  def _decay_factor(self, lazy: _LazyUpdate) -> Lazy | None:
    """The 0-d factor the weights are multiplied by before the update (AdamW's decoupled decay), or None."""
    return None

  def _updates(self, active: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
    index_of = {id(param): index for index, param in enumerate(self.params)}
    lazy = _LazyUpdate()
    self._count_step(lazy)
    correction1, correction2 = self._bias_corrections(lazy)
    # per step, not per parameter: p + (-lr / c1) * m / (sqrt(v) / sqrt(c2) + eps), the Tensor formula's operations
    minus_step_size = lazy.neg(lazy.div(self.lr_tensor.lazydata, correction1))
    inverse_sqrt_correction2 = lazy.sqrt(correction2).elementwise(RECIP)
    decay_factor = self._decay_factor(lazy)
    updated: list[Tensor] = [self.t]
    values = (float(self.b1), 1.0 - float(self.b1), float(self.b2), 1.0 - float(self.b2), float(self.eps))
    folding = _folding(values)
    for param, grad in active:
      index = index_of[id(param)]
      weights, g = param.lazydata, lazy.cast(grad.lazydata, dtypes.float32)
      stored = weights   # (the parameter as it is now: the decay below makes a new `weights`)
      m, v = self.m[index].lazydata, self.v[index].lazydata
      constants = self._operands(values, g)
      if self.weight_decay and decay_factor is None:   # Adam's L2 term: weight_decay * p added to the gradient
        g = lazy.add(g, lazy.mul(lazy.cast(weights, dtypes.float32), self.weight_decay))
      node = _node_maker(folding, weights, g, m, v)
      if decay_factor is not None: weights = node(MUL, None, (weights, lazy.per_step(decay_factor, weights)))
      m, v = self._moments(index, g, (m, v), node, constants)
      scaled_root = node(MUL, None, (node(SQRT, None, (v,)), lazy.per_step(inverse_sqrt_correction2, v)))
      denominator = node(ADD, None, (scaled_root, constants[4]))
      numerator = node(MUL, None, (lazy.per_step(minus_step_size, m), m))
      step = node(MUL, None, (numerator, node(RECIP, None, (denominator,))))
      new_weights = node(ADD, None, (weights, lazy.cast(step, param.dtype)))
      write = assign_lazy if node is _checked_node or param._ctx is not None else _write_made
      updated += [self.m[index], self.v[index], write(param, new_weights, stored)]
    return updated


class AdamW(Adam):
  """AdamW, as `torch.optim.AdamW` (decoupled weight decay): first p = p * (1 - lr * weight_decay), then the
  Adam update above with the plain gradient."""

  def __init__(self, params: list[Tensor], lr: float = 0.001, betas: tuple[float, float] = (0.9, 0.999),
               eps: float = 1e-8, weight_decay: float = 0.01):
    super().__init__(params, lr, betas, eps, weight_decay)

  def _decay_factor(self, lazy: _LazyUpdate) -> Lazy | None:
    return lazy.one_minus(lazy.mul(self.lr_tensor.lazydata, self.weight_decay)) if self.weight_decay else None


class LAMB(_AdamBase):
  """LAMB (layer-wise adaptive moments), as in the paper and tinygrad:

    m = b1 * m + (1 - b1) * grad;   v = b2 * v + (1 - b2) * grad^2;   t = t + 1
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * p
    r = ||p|| / ||u|| if both norms are > 0 else 1      (r = 1 when adam=True)
    p = p - lr * r * u
  """

  def __init__(self, params: list[Tensor], lr: float = 0.001, betas: tuple[float, float] = (0.9, 0.999),
               eps: float = 1e-6, weight_decay: float = 0.0, adam: bool = False):
    super().__init__(params, lr, betas, eps, weight_decay)
    self.adam = adam

  def _updates(self, active: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
    index_of = {id(param): index for index, param in enumerate(self.params)}
    lazy = _LazyUpdate()
    moment_values = (float(self.b1), 1.0 - float(self.b1), float(self.b2), 1.0 - float(self.b2))
    self._count_step(lazy)
    correction1, correction2 = (Tensor(value, requires_grad=False) for value in self._bias_corrections(lazy))
    updated: list[Tensor] = [self.t]
    for param, grad in active:
      weights, index = param.detach(), index_of[id(param)]
      g = grad.lazydata.cast(dtypes.float32)
      old = (self.m[index].lazydata, self.v[index].lazydata)
      self._moments(index, g, old, _checked_node, self._operands(moment_values, g))
      m, v = self.m[index], self.v[index]
      update = (m / correction1) / ((v / correction2).sqrt() + self.eps)
      if self.weight_decay: update = update + self.weight_decay * weights
      if self.adam:
        param.assign(weights - self.lr_tensor * update)
      else:
        weight_norm, update_norm = weights.square().sum().sqrt(), update.square().sum().sqrt()
        trust_ratio = ((weight_norm > 0) & (update_norm > 0)).where(weight_norm / update_norm, 1.0)
        param.assign(weights - self.lr_tensor * trust_ratio * update)
      updated += [m, v, param]
    return updated
