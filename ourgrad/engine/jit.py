"""TinyJit: run a function's kernels again without Python building graphs, scheduling or generating code.

    @TinyJit
    def step(x: Tensor, y: Tensor) -> Tensor: ...   # forward, backward, optimizer.step(): anything that launches

Call 1 runs the function normally (kernels compile). Call 2 runs it again and records every ExecItem it launches
(ourgrad/engine/exec_item.py). Later calls skip the function: the recorded items run on the new input buffers
(as one CUDA graph on CUDA, one C function calling the kernels in turn on CLANG, a loop over pre-bound ctypes calls
on LLVM) and the return value is rebuilt with Tensors backed by the outputs. docs/jit.md lists what is checked and
what a replay cannot see.

The outputs are the capture's own buffers, overwritten by the next replay (as a CUDA graph's static outputs in
PyTorch): a Tensor returned earlier shows the latest call's values; `.clone()`, `.numpy()` or `.item()` keep a
call's values. A lazy tensor built from an earlier output keeps the value it was built from (the replay copies the
old contents for it first), and an output passed back in as an input is copied before the replay.

Inputs are the Tensors among the arguments (positional or keyword, also inside lists, tuples and dicts); each is
realized (a view becomes a contiguous copy) before the call. Everything else the function reads (model weights,
optimizer state) is read from the same buffers on every replay, so in-place updates of it (assign) carry over.
Assigns made inside the function are realized at its end, with the outputs, so they are part of the capture.
"""
from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterator, TypeVar

from ourgrad import lazy_trace
from ourgrad.device import Buffer, Device, HostProgram
from ourgrad.engine.exec_item import CompiledRunner, ExecItem, capture_into, jit_recording
from ourgrad.engine.memory import held_only_by_items, plan_memory
from ourgrad.engine.snapshot import redirect_reader, stale_readers
from ourgrad.errors import CompileError, DeviceError, JitError
from ourgrad.helpers import DEBUG, GlobalCounters, env_var, tf32_allowed
from ourgrad.lazy import LazyBuffer
from ourgrad.mixed_precision import get_autocast_dtype
from ourgrad.shape.symbolic import Node, Variable, sym_bind, sym_infer, sym_unbind
from ourgrad.tensor import Tensor

JIT = env_var("JIT", 1, "0: TinyJit functions run eagerly every call (no capture, no replay)")

ReturnType = TypeVar("ReturnType")


@dataclass(frozen=True)
class InputSpec:
  """What a replay needs to find in an input Tensor: the one captured had this shape, dtype and device."""
  path: str
  shape: tuple[int, ...]
  dtype: Any
  device: str


class TinyJit(Generic[ReturnType]):
  """Capture the kernels a function launches on its second call and replay them on later calls (see module doc).
  A replay returns Tensors backed by the capture's own output buffers, which the next replay overwrites."""

  def __init__(self, fn: Callable[..., ReturnType]):
    self.fn = fn
    self.call_count = 0
    self.captured: CapturedJit | None = None
    self._per_instance: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # method: instance -> its TinyJit
    self._by_id: dict[int, TinyJit] = {}
    try:
      self.signature: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and some callables have none: arguments are then taken as given
      self.signature = None
    functools.update_wrapper(self, fn)

  def __get__(self, instance: Any, owner: type | None = None) -> Any:
    """A method: each instance gets a TinyJit of its own (one shared by the class would replay the kernels of the
    first instance, reading its weights, for every other instance)."""
    if instance is None: return self
    try:
      bound = self._per_instance.get(instance)
    except TypeError:  # an instance that cannot be weakly referenced or hashed: kept by id
      bound = self._by_id.get(id(instance))
    if bound is None:
      bound = TinyJit(self.fn.__get__(instance, owner))
      try:
        self._per_instance[instance] = bound
      except TypeError:
        self._by_id[id(instance)] = bound
    return bound

  def reset(self) -> None:
    """Forget the capture: the next call runs eagerly, the one after captures again."""
    self.call_count, self.captured = 0, None

  def __call__(self, *args: Any, **kwargs: Any) -> ReturnType:
    captured = self.captured
    if captured is not None and captured.tf32 != tf32_allowed():
      # captured under the other float32 matmul precision (set_float32_matmul_precision): its kernels would keep it
      if DEBUG >= 1: print(f"jit: {self.fn.__name__} was captured with TF32 {'on' if captured.tf32 else 'off'}")
      self.reset()
      captured = None
    if captured is not None and captured.autocast_dtype != get_autocast_dtype():
      # captured under another autocast state: its kernels compute in the dtypes that state chose
      if DEBUG >= 1: print(f"jit: {self.fn.__name__} was captured with autocast {captured.autocast_dtype}")
      self.reset()
      captured = None
    if captured is not None and not kwargs and not jit_recording.active:
      # the common replay: the same positional layout as the capture, every input a realized buffer of the
      # captured shape, dtype and device (anything else takes the general path below, which explains errors)
      fast = captured.fast_inputs(args)
      if fast is not None and JIT:
        self.call_count += 1
        return captured.run(*fast)
    if not JIT or jit_recording.active:
      # JIT=0, or a jitted function called by one being captured: its kernels belong to the outer capture
      return self.fn(*args, **kwargs)
    arguments = self._arguments(args, kwargs)
    tensors, statics = _split_arguments(arguments)
    _check_single_device(self.fn.__name__, tensors)
    statics, var_vals = _symbolic_values(statics, tensors)
    input_tensors = _prepare_inputs(tensors)
    if captured is not None: input_tensors = captured.unshare_outputs(input_tensors)
    input_buffers = [_input_buffer(tensor) for tensor in input_tensors.values()]
    _check_distinct(list(input_tensors), input_buffers)
    if captured is not None:
      self.call_count += 1
      return captured.replay(input_tensors, input_buffers, statics, var_vals)
    args, kwargs = self._substitute(args, kwargs, tensors, input_tensors)
    if self.call_count == 0:
      self.call_count = 1
      with jit_recording.scope():
        return _finish_call(self.fn(*args, **kwargs))[0]
    items: list[ExecItem] = []
    rng_state = Tensor._rng.bit_generator.state
    with jit_recording.scope(), capture_into(items):
      result, outputs = _finish_call(self.fn(*args, **kwargs), capturing=True)
    if Tensor._rng.bit_generator.state != rng_state:
      raise JitError(f"{self.fn.__name__} drew random numbers on the host (Tensor._rng, numpy's generator): a "
                     f"replay would reuse the captured values on every call. Use Tensor.rand/randn/... (drawn on "
                     f"the device inside a TinyJit), or draw them outside and pass them as inputs")
    if not items:
      raise JitError(f"{self.fn.__name__} launched no kernels on its capture call (its outputs were already "
                     f"realized or it returns nothing computed): there is nothing to replay")
    specs = [InputSpec(path, _unbound_shape(tensor.shape), tensor.dtype, tensor.device)
             for path, tensor in input_tensors.items()]
    self.captured = CapturedJit(items, specs, input_buffers, statics, result, outputs)
    if not kwargs: self.captured.fast_layout = _fast_layout(args, input_tensors, specs, var_vals)
    self.call_count = 2
    del items, outputs
    self.captured.plan_memory()
    if DEBUG >= 1:
      print(f"jit: captured {len(self.captured.items)} items of {self.fn.__name__} "
            f"({len(specs)} inputs), replayed by {type(self.captured.replay_runner).__name__}")
    return result

  def _arguments(self, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments by parameter name, so a call may pass a tensor by position once and by keyword the next time."""
    if self.signature is not None:
      try:
        bound = self.signature.bind(*args, **kwargs)
        return dict(bound.arguments)
      except TypeError:
        pass  # let the function raise its own error on the eager call
    return {**{f"args[{index}]": value for index, value in enumerate(args)}, **dict(sorted(kwargs.items()))}

  def _substitute(self, args: tuple, kwargs: dict, found: dict[str, Tensor], inputs: dict[str, Tensor]) -> tuple:
    """The call's arguments with each input that had to be realized as a copy (a view, a constant) replaced by
    that copy, so the captured kernels read the buffer that later calls replace."""
    replaced = {id(found[path]): inputs[path] for path in found if inputs[path] is not found[path]}
    if not replaced: return args, kwargs
    swap = functools.partial(_replace_tensors, replaced=replaced)
    return tuple(swap(value) for value in args), {name: swap(value) for name, value in kwargs.items()}


def _unbound_shape(shape: tuple) -> tuple:
  return tuple(sym_unbind(size)[0] for size in shape)


def _symbolic_values(statics: dict[str, Any], tensors: dict[str, Tensor]) -> tuple[dict[str, Any], dict[str, int]]:
  """(the non-Tensor arguments with bound Variables unbound, {name: value} of every bound Variable among the
  arguments and in the input tensors' shapes). A replay compares the unbound statics and shapes, and launches the
  captured kernels with this call's values: a new value recompiles nothing."""
  var_vals: dict[str, int] = {}

  def note(path: str, values: dict[str, int]) -> None:
    for name, value in values.items():
      if var_vals.setdefault(name, value) != value:
        raise JitError(f"Variable {name!r} is bound to {var_vals[name]} and, at {path}, to {value}")

  unbound_statics: dict[str, Any] = {}
  for path, value in statics.items():
    if isinstance(value, Node):
      value, values = sym_unbind(value)
      note(path, values)
    unbound_statics[path] = value
  for path, tensor in tensors.items():
    for size in tensor.shape: note(path, sym_unbind(size)[1])
  return unbound_statics, var_vals


def _replace_tensors(value: Any, replaced: dict[int, Tensor]) -> Any:
  if isinstance(value, Tensor): return replaced.get(id(value), value)
  if isinstance(value, (list, tuple)): return type(value)(_replace_tensors(item, replaced) for item in value)
  if isinstance(value, dict): return {key: _replace_tensors(item, replaced) for key, item in value.items()}
  return value


def _split_arguments(arguments: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
  """(input tensors by path, every other argument value by path), walking lists, tuples and dicts."""
  tensors: dict[str, Tensor] = {}
  statics: dict[str, Any] = {}
  stack = list(reversed(arguments.items()))
  while stack:
    path, value = stack.pop()
    if isinstance(value, Tensor):
      tensors[path] = value
    elif isinstance(value, (list, tuple)):
      stack.extend(reversed([(f"{path}[{index}]", item) for index, item in enumerate(value)]))
    elif isinstance(value, dict):
      stack.extend(reversed([(f"{path}[{key!r}]", item) for key, item in value.items()]))
    else:
      statics[path] = value
  return tensors, statics


def _check_single_device(name: str, tensors: dict[str, Tensor]) -> None:
  """A replay swaps each input's one buffer: an input sharded over several devices (a MultiLazyBuffer) has one per
  device, which the capture does not record, so it is refused by name rather than failing inside the capture."""
  for path, tensor in tensors.items():
    if not isinstance(tensor.lazydata, LazyBuffer):
      raise JitError(f"{name}: input {path} is sharded over {tensor.device} (a {type(tensor.lazydata).__name__}); "
                     f"TinyJit captures single-device inputs only (JIT=0 runs the function eagerly)")


def _is_buffer_backed(tensor: Tensor) -> bool:
  """Whether the tensor reads a realized buffer in row-major order from its first element (the base itself or a
  reshape of it): then that buffer is the input a replay swaps."""
  lazy = tensor.lazydata
  return lazy.base.realized is not None and lazy.reads_whole_base


def _prepare_inputs(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
  """Each input realized into a buffer of its own values: the tensor itself where it is one, else a contiguous
  copy (views, constants and pending graphs), all realized in one schedule."""
  prepared = {path: tensor if tensor.lazydata.base.realized is not None or tensor.lazydata.is_base
              else tensor.contiguous() for path, tensor in tensors.items()}
  pending = [tensor for tensor in prepared.values() if tensor.lazydata.base.realized is None]
  if pending: Tensor.realize_all(*pending)
  for path, tensor in prepared.items():
    if not _is_buffer_backed(tensor):
      prepared[path] = Tensor(tensor.lazydata.contiguous(), requires_grad=tensor.requires_grad).realize()
  return prepared


def _input_buffer(tensor: Tensor) -> Buffer:
  buffer = tensor.lazydata.base.realized
  assert buffer is not None
  return buffer


def _check_distinct(paths: list[str], buffers: list[Buffer]) -> None:
  seen: dict[int, str] = {}
  for path, buffer in zip(paths, buffers):
    if id(buffer) in seen:
      raise JitError(f"inputs {seen[id(buffer)]} and {path} are the same buffer: a jitted function takes each "
                     f"input once (pass it once, or pass a .clone())")
    seen[id(buffer)] = path


def _contiguous_outputs(value: Any, path: str, outputs: list[Tensor]) -> Any:
  """`value` (a function's result) with each Tensor that is a view made contiguous, except a view of one contiguous
  run of its base with fixed sizes (LazyBuffer.fixed_base_range: a slice of its leading axis, a part of a kernel's
  output buffer such as the fused attention's O or one of its gradients): a replay returns that as the same view of
  the buffer, no copy kernel. Appends the Tensors to `outputs` in order. A module-level function, not a closure
  calling itself: such a closure is a reference cycle (function -> cell -> function) that would keep `outputs`, and
  the device buffers of its Tensors, alive until the cyclic collector runs."""
  if isinstance(value, Tensor):
    lazy = value.lazydata
    if not lazy.reads_whole_base and (type(lazy) is not LazyBuffer or lazy.fixed_base_range() is None):
      value = value.contiguous()
    outputs.append(value)
    return value
  if isinstance(value, (list, tuple)):
    return type(value)(_contiguous_outputs(item, f"{path}[{index}]", outputs) for index, item in enumerate(value))
  if isinstance(value, dict):
    return {key: _contiguous_outputs(item, f"{path}[{key!r}]", outputs) for key, item in value.items()}
  if value is None: return None
  raise JitError(f"a jitted function returned {type(value).__name__} at {path}: only Tensors (in lists, tuples and "
                 f"dicts) or None can be returned, a Python value would be frozen at its captured value")


def _finish_call(result: Any, capturing: bool = False) -> tuple[Any, list[Tensor]]:
  """Realize the function's outputs (views made contiguous) and every assign it made, in one schedule. Returns the
  result with outputs replaced where they had to be made contiguous, and the output tensors in order.

  An assign to a tensor that has no buffer of its own to write (a constant such as a fresh Tensor.zeros(), or a
  view) rebinds the tensor to a new buffer instead of writing in place; a replay cannot rebind a Python object. When
  capturing, such a tensor's new value is also copied into the buffer it read before the call, so each replay reads
  the previous replay's value and the tensor (bound to the new buffer) sees every replay's result."""
  outputs: list[Tensor] = []
  result = _contiguous_outputs(result, "return value", outputs)
  assigned = jit_recording.take_assigned()
  previous: dict[int, tuple[Tensor, LazyBuffer]] = {}
  for tensor, lazy in assigned: previous.setdefault(id(tensor), (tensor, lazy))
  pending = [tensor for tensor in outputs if not tensor.lazydata.is_realized]
  pending += [tensor for tensor, _ in previous.values() if not tensor.lazydata.is_realized]
  if pending: Tensor.realize_all(*pending)
  if capturing:
    write_backs = []
    for tensor, lazy in previous.values():
      old_buffer = lazy.base.realized
      if old_buffer is None or tensor.lazydata.base.realized is old_buffer: continue
      if not lazy.reads_whole_base or lazy.shape != tensor.shape:
        raise JitError(f"a jitted function assigned to a view {lazy.shape} of a buffer it cannot write in place; "
                       f"assign to a realized tensor of its own (e.g. make it with .contiguous().realize())")
      write_backs.append(Tensor(LazyBuffer.from_buffer(old_buffer, lazy.base.shape)).reshape(tensor.shape)
                         .assign(tensor.detach()))
    if write_backs: Tensor.realize_all(*write_backs)
  return result, outputs


class CapturedJit:
  """The ExecItems of one capture, where a replay puts its input buffers, and the output buffers it returns.

  Every buffer the capture made (outputs and intermediates) stays the same across replays: a replay overwrites the
  outputs of the one before, as a CUDA graph's static outputs do in PyTorch. Only the input slots of the kernels
  change, and only when an input buffer differs from the previous call's."""

  def __init__(self, items: list[ExecItem], specs: list[InputSpec], input_buffers: list[Buffer],
               statics: dict[str, Any], result: Any, outputs: list[Tensor]):
    self.items, self.specs, self.statics = items, specs, statics
    self.tf32 = tf32_allowed()   # the float32 matmul precision its kernels were compiled for
    self.autocast_dtype = get_autocast_dtype()  # the autocast low dtype (None: off) its ops were cast for
    self.input_buffers = list(input_buffers)
    self.result_template = _template(result)  # the structure only: the capture call's tensors are not kept alive
    # every (item, argument) slot holding each input buffer
    self.input_slots = [self._slots_of(buffer) for buffer in input_buffers]
    self.output_shapes = [_unbound_shape(tensor.shape) for tensor in outputs]  # bound again per replay
    # (first element, count) of the buffer each output that is a part of one reads (None: all of it)
    self.output_ranges = [_part_range(tensor.lazydata) for tensor in outputs]
    self.output_symbolic = [any(isinstance(size, Node) for size in shape) for shape in self.output_shapes]
    self.var_vals: dict[str, int] = {}
    self.output_requires_grad = [tensor.requires_grad for tensor in outputs]
    self.output_buffers: list[Buffer] = [tensor.lazydata.base.realized for tensor in outputs]  # type: ignore[misc]
    input_index = {id(buffer): index for index, buffer in enumerate(input_buffers)}
    # an output that is an input is returned as this call's input buffer; any other as the buffer of the capture
    self.output_inputs = [input_index.get(id(buffer)) for buffer in self.output_buffers]
    made_here = _first_written(items)
    # outputs this capture computed into buffers of its own: the next replay overwrites them
    self.owned_outputs = [index for index, buffer in enumerate(self.output_buffers)
                          if self.output_inputs[index] is None and id(buffer) in made_here]
    self.owned_ids = {id(self.output_buffers[index]) for index in self.owned_outputs}
    # outputs whose buffer a replay writes: the owned ones, and a part of state the capture writes in place (a cache
    # slice): their lazy readers get the old contents before a replay (_protect_lazy_readers)
    written = _written(items)
    self.overwritten_outputs = [index for index, buffer in enumerate(self.output_buffers)
                                if index in self.owned_outputs or (self.output_inputs[index] is None and
                                                                   self.output_ranges[index] is not None
                                                                   and id(buffer) in written)]
    # the base each output is returned with (reused while its buffer and shape stay), and every base given out for
    # an owned output (weakly): their lazy readers are protected before a replay overwrites the buffer
    self.output_lazies: list[LazyBuffer | None] = [None] * len(outputs)
    self.given_out: list[list[weakref.ref[LazyBuffer]]] = [[weakref.ref(tensor.lazydata.base)] for tensor in outputs]
    # positional layout of the capture call for TinyJit's fast path (None: every replay takes the general path)
    self.fast_layout: list[tuple[InputSpec | None, Any]] | None = None
    self.replay_runner = build_replay(items)

  def _slots_of(self, buffer: Buffer) -> list[tuple[int, int]]:
    return [(item_index, slot) for item_index, item in enumerate(self.items) for slot, known in enumerate(item.bufs)
            if known is buffer]

  def plan_memory(self) -> None:
    """Share memory between the capture's internal buffers (made and last read inside it, held by nothing else;
    never an input or an output) across all its schedules."""
    keep = {id(buffer) for buffer in self.input_buffers} | {id(buffer) for buffer in self.output_buffers}
    only_items = held_only_by_items([item.bufs for item in self.items])
    internal = (only_items & _first_written(self.items)) - keep
    if plan_memory([item.bufs for item in self.items], lambda buffer: id(buffer) in internal, label="jit"):
      self.replay_runner = build_replay(self.items)  # the pre-bound arguments point at the old memory

  def fast_inputs(self, args: tuple) -> tuple[list[Buffer], dict[str, int]] | None:
    """The input buffers and Variable values of a call made like the capture call (the same positional layout, each
    input a realized buffer of the captured shape, dtype and device, each Variable argument the same Variable bound
    to some value, the same other values, no input that is one of this capture's outputs, no buffer twice); None for
    any other call, which then takes the general path."""
    layout = self.fast_layout
    if layout is None or len(args) != len(layout): return None
    buffers: list[Buffer] = []
    var_vals: dict[str, int] = {}
    for arg, (spec, static) in zip(args, layout):
      if spec is None:
        if type(static) is _VariableArgument:   # a bound Variable (a decode step's position): its value this call
          if type(arg) is not Variable or arg.val is None or (arg.expr, arg.min, arg.max) != static.key: return None
          var_vals[arg.expr] = arg.val
        elif not _same_static(arg, static): return None
        continue
      if type(arg) is not Tensor: return None
      lazy = arg.lazydata
      if type(lazy) is not LazyBuffer or not lazy.is_base: return None  # a sharded tensor, a view
      buffer = lazy.realized
      if buffer is None or lazy.shape != spec.shape or lazy.dtype != spec.dtype or lazy.device != spec.device \
          or id(buffer) in self.owned_ids:
        return None
      buffers.append(buffer)
    if len(buffers) > 1 and len({id(buffer) for buffer in buffers}) != len(buffers): return None
    return buffers, var_vals

  def unshare_outputs(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """`inputs` with each one backed by an output buffer of this capture (`x = step(x)`) replaced by a copy: the
    replay writes that buffer while its kernels read the input."""
    if not any(id(_input_buffer(tensor)) in self.owned_ids for tensor in inputs.values()): return inputs
    return {path: Tensor(tensor.lazydata.clone(), requires_grad=tensor.requires_grad).realize()
            if id(_input_buffer(tensor)) in self.owned_ids else tensor for path, tensor in inputs.items()}

  def replay(self, inputs: dict[str, Tensor], input_buffers: list[Buffer], statics: dict[str, Any],
             var_vals: dict[str, int] | None = None) -> Any:
    self._check(inputs, statics)
    return self.run(input_buffers, var_vals or {})

  def run(self, input_buffers: list[Buffer], var_vals: dict[str, int]) -> Any:
    """Point the input slots at `input_buffers` (where they changed), launch, and return the result."""
    runner = self.replay_runner
    if var_vals != self.var_vals:   # (a GPU decode step's `used` changes once every USED_GRANULE steps)
      self.var_vals = var_vals
      runner.set_var_vals(var_vals)
    previous = self.input_buffers
    for index, buffer in enumerate(input_buffers):
      if buffer is previous[index]: continue  # the same input as last call: its slots already hold it
      for item_index, slot in self.input_slots[index]: runner.set_buffer(item_index, slot, buffer)
      previous[index] = buffer
    self._protect_lazy_readers()
    runner.run()
    return self._rebuild_result()

  def _protect_lazy_readers(self) -> None:
    """Before the replay overwrites the outputs: a lazy tensor built from an output of an earlier call (`total =
    total + loss`, still unrealized) keeps the value it was built from (a snapshot copy, as before an assign:
    engine/snapshot.py). A Tensor that is the earlier output itself is an alias of the buffer and sees new values."""
    # the creation trace holds every base made since the last schedule: a reader the user dropped must not look alive
    lazy_trace.invalidate()
    for index in self.overwritten_outputs:
      for ref in self.given_out[index]:
        lazy = ref()
        if lazy is None or not lazy._readers: continue
        readers = stale_readers(lazy, lazy)  # only readers whose sources still are this base (not redirected yet)
        if not readers: continue
        snapshot = Tensor(lazy.clone()).realize().lazydata.base
        for reader in readers: redirect_reader(reader, lazy, snapshot)

  def _check(self, inputs: dict[str, Tensor], statics: dict[str, Any]) -> None:
    if len(inputs) != len(self.specs) or any(path != spec.path for path, spec in zip(inputs, self.specs)):
      captured_paths = [spec.path for spec in self.specs]
      raise JitError(f"this call passes tensors as {list(inputs)}, the captured call passed {captured_paths}")
    for spec, tensor in zip(self.specs, inputs.values()):
      if (_unbound_shape(tensor.shape), tensor.dtype, tensor.device) != (spec.shape, spec.dtype, spec.device):
        raise JitError(f"input {spec.path} is {tensor.shape} {tensor.dtype} on {tensor.device}; the jitted function "
                       f"was captured with {spec.shape} {spec.dtype} on {spec.device}. Use another TinyJit (or "
                       f"jit.reset()) for other shapes")
    for path, value in statics.items():
      captured = self.statics.get(path, _MISSING)
      if not _same_static(value, captured):
        raise JitError(f"argument {path} is {value!r}, the captured call had {captured!r}: non-Tensor arguments are "
                       f"baked into the captured kernels. Pass it as a Tensor, or use another TinyJit")

  def _output_tensor(self, index: int) -> Tensor:
    """A Tensor backed by output `index` of this replay. One base per output serves every call (a new base per
    call would cost more and behave the same: the Tensors returned earlier alias the buffer either way)."""
    input_index = self.output_inputs[index]
    buffer = self.output_buffers[index] if input_index is None else self.input_buffers[input_index]
    lazy = self.output_lazies[index]
    if lazy is None or lazy.base.realized is not buffer or self.output_symbolic[index]:
      shape = tuple(sym_bind(size, self.var_vals) for size in self.output_shapes[index]) \
        if self.output_symbolic[index] else self.output_shapes[index]
      part = self.output_ranges[index]
      if part is None:
        lazy = LazyBuffer.from_buffer(buffer, shape)
      else:   # a view of its run of the whole buffer (outputs that are parts of one buffer each get a base of it)
        start, count = part
        lazy = LazyBuffer.from_buffer(buffer, (buffer.size,)).shrink(((start, start + count),)).reshape(shape)
      self.output_lazies[index] = lazy
      if input_index is None:
        given_out = self.given_out[index]
        if len(given_out) > 8: given_out[:] = [ref for ref in given_out if ref() is not None]
        given_out.append(weakref.ref(lazy.base))
    return Tensor(lazy, requires_grad=self.output_requires_grad[index])

  def _rebuild_result(self) -> Any:
    if self.result_template is _OUTPUT: return self._output_tensor(0)  # the common case: one Tensor
    return self._fill_template(self.result_template, iter(range(len(self.output_buffers))))

  def _fill_template(self, value: Any, outputs: Iterator[int]) -> Any:
    """`value` (the result template) with each output marker replaced by the next output's Tensor (a method, not a
    closure calling itself: that is a reference cycle left for the cyclic collector on every replay)."""
    if value is _OUTPUT: return self._output_tensor(next(outputs))
    if isinstance(value, (list, tuple)): return type(value)(self._fill_template(item, outputs) for item in value)
    if isinstance(value, dict): return {key: self._fill_template(item, outputs) for key, item in value.items()}
    return value


def _part_range(lazy: LazyBuffer) -> tuple[int, int] | None:
  """The run of its base's buffer that an output reads when it is not all of it (`_contiguous_outputs`), else None."""
  if type(lazy) is not LazyBuffer or lazy.reads_whole_base: return None
  return lazy.fixed_base_range()


def _written(items: list[ExecItem]) -> set[int]:
  """ids of the buffers some item of `items` writes."""
  return {id(buffer) for item in items for buffer in item.bufs[:item.outputs]}


def _first_written(items: list[ExecItem]) -> set[int]:
  """ids of the buffers whose first use among `items` is a write (made inside the capture; a buffer read before it is
  written carries values from one call into the next)."""
  first_use_is_write: set[int] = set()
  seen: set[int] = set()
  for item in items:
    for slot, buffer in enumerate(item.bufs):
      if id(buffer) in seen: continue
      seen.add(id(buffer))
      # an output (every output of a multi-output kernel: its later ones were never planned, and each kept the
      # whole backing the eager schedule had given it) that the same kernel does not also read
      if slot < item.outputs and sum(known is buffer for known in item.bufs) == 1: first_use_is_write.add(id(buffer))
  return first_use_is_write


@dataclass(frozen=True)
class _VariableArgument:
  """A positional argument of the capture call that was a bound Variable: a fast replay takes the same Variable
  (name and range) bound to any value."""
  key: tuple[str, int, int]


def _fast_layout(args: tuple, inputs: dict[str, Tensor], specs: list[InputSpec], var_vals: dict[str, int]) \
    -> list[tuple[InputSpec | None, Any]] | None:
  """For each positional argument of the capture call: (its InputSpec, None) for an input that is a buffer of its own,
  (None, value) for a plain Python value, (None, _VariableArgument) for a bound Variable. None when the call had
  anything else (containers, views, expressions of Variables), or Variables bound elsewhere than as arguments."""
  position = {id(tensor): index for index, tensor in enumerate(inputs.values())}
  layout: list[tuple[InputSpec | None, Any]] = []
  variables: set[str] = set()
  for arg in args:
    if isinstance(arg, Tensor):
      index = position.get(id(arg))
      if index is None or type(arg) is not Tensor or not arg.lazydata.is_base: return None
      layout.append((specs[index], None))
    elif type(arg) is Variable and arg.val is not None:
      layout.append((None, _VariableArgument((arg.expr, arg.min, arg.max))))
      variables.add(arg.expr)
    elif arg is None or type(arg) in (int, float, bool, str):
      layout.append((None, arg))
    else:
      return None
  tensor_order = [position[id(arg)] for arg in args if isinstance(arg, Tensor)]
  return layout if tensor_order == list(range(len(inputs))) and variables == set(var_vals) else None


_MISSING = object()
_OUTPUT = object()  # where a Tensor stood in the return value


def _template(value: Any) -> Any:
  if isinstance(value, Tensor): return _OUTPUT
  if isinstance(value, (list, tuple)): return type(value)(_template(item) for item in value)
  if isinstance(value, dict): return {key: _template(item) for key, item in value.items()}
  return value


def _same_static(value: Any, captured: Any) -> bool:
  if value is captured: return True
  try:
    return bool(type(value) is type(captured) and value == captured)
  except Exception:  # objects whose == is not a plain bool (arrays): compared by identity only
    return False


class VariableGroup:
  """The replayed kernels that take one list of symbolic Variables (`names`), and the values they were last given."""

  def __init__(self, names: tuple[str, ...], values: dict[str, int]):
    self.names, self.values = names, values
    self.members: list[Any] = []

  def changed(self, var_vals: dict[str, int]) -> dict[str, int] | None:
    """This call's values of the group's Variables where they differ from the last ones given (then remembered)."""
    values = {name: var_vals[name] for name in self.names}
    if values == self.values: return None
    self.values = values
    return values


def _symbolic_groups(items: list[ExecItem], names_of: Callable[[ExecItem], Any],
                     member: Callable[[int], Any]) -> list[VariableGroup]:
  """The items that take symbolic Variables grouped by their Variables' names, each item as `member(index)` gives it;
  each group starts from the values its items were captured (or last replayed) with. A replay keeps its own groups:
  two replays of one capture (a benchmark's A/B) each know what they last gave their kernels."""
  groups: dict[tuple[str, ...], VariableGroup] = {}
  for index, item in enumerate(items):
    names = tuple(names_of(item))
    if not names: continue
    group = groups.get(names)
    if group is None: group = groups[names] = VariableGroup(names, {name: item.var_vals[name] for name in names})
    group.members.append(member(index))
  return list(groups.values())


class ItemReplay:
  """Runs captured ExecItems in order; kernels of host devices (CLANG, LLVM) are called through their ctypes
  function with pre-bound pointer arguments, so one replayed kernel costs one foreign call."""

  def __init__(self, items: list[ExecItem]):
    self.items = items
    self.host_calls: list[tuple[Callable[..., Any], list[Any]] | None] = []
    for item in items:
      program = getattr(item.runner, "program", None)
      if isinstance(item.runner, CompiledRunner) and isinstance(program, HostProgram) and DEBUG < 2:
        # a kernel with symbolic sizes takes the Variables' values after the buffers (set_var_vals updates them)
        values = [item.var_vals[name] for name in item.runner.var_names]
        self.host_calls.append((program.function, [buffer.host_pointer() for buffer in item.bufs] + values))
      else:
        self.host_calls.append(None)
    # the items whose kernels take symbolic Variables, grouped by the names they take: set_var_vals visits only these
    # and reads each group's values once (a decode step of ~725 kernels has 60 that take `used`; walking every item
    # cost ~0.3 ms of the CPU step's ~12)
    self.symbolic = _symbolic_groups(items, lambda item: getattr(item.runner, "var_names", ()), lambda index: index)
    # what the pre-bound calls add to GlobalCounters (items run through ExecItem.run count themselves)
    host_items = [item for item, call in zip(items, self.host_calls) if call is not None]
    self.host_kernel_count = len(host_items)
    self.op_count = sum(item.runner.op_count for item in host_items)
    self.byte_count = sum(item.runner.byte_count for item in host_items)

  def set_buffer(self, item_index: int, slot: int, buffer: Buffer) -> None:
    self.items[item_index].bufs[slot] = buffer
    call = self.host_calls[item_index]
    if call is not None: call[1][slot] = buffer.host_pointer()

  def set_var_vals(self, var_vals: dict[str, int]) -> None:
    """This call's values of the symbolic Variables, for every kernel that takes them."""
    for group in self.symbolic:
      values = group.changed(var_vals)
      if values is None: continue
      arguments = list(values.values())
      for index in group.members:
        item, call = self.items[index], self.host_calls[index]
        item.var_vals = values   # (shared by the group's items: never changed in place, only replaced)
        if call is not None: call[1][len(item.bufs):] = arguments

  def run(self) -> None:
    for item, call in zip(self.items, self.host_calls):
      if call is None:
        item.run()
        continue
      call[0](*call[1])
    GlobalCounters.kernel_count += self.host_kernel_count
    GlobalCounters.global_ops += self.op_count
    GlobalCounters.global_mem += self.byte_count


class GraphReplay:
  """Runs captured kernels of one device as one device graph (CUDA graphs): `set_buffer` patches one kernel
  argument of the graph in place, `set_var_vals` the int arguments and launch sizes of the kernels with symbolic
  sizes (the driver is told at the next launch), `run` launches it with one call."""

  def __init__(self, items: list[ExecItem], graph: Any):
    self.items, self.graph = items, graph
    self.kernel_count = len(items)
    self.op_count = sum(item.runner.op_count for item in items)
    self.byte_count = sum(item.runner.byte_count for item in items)
    # the kernels that take symbolic Variables, grouped by the names they take (a group's values are read and
    # compared once a call), each as _sizes_of gives it
    self.symbolic = _symbolic_groups(items, lambda item: item.runner.var_names, self._sizes_of)
    # a graph that can point several kernels at one copy of their int arguments (HostCallGraph) is told each group's
    # kernels; one update of the copy then serves them all (a CPU decode step: 60 kernels take `used`). Each member
    # becomes (index, sizes, whether set_argument must be told its int arguments)
    share = getattr(graph, "share_int_arguments", None)
    for group in self.symbolic:
      indices = [member[0] for member in group.members]
      patched = set(share(indices) if share is not None else indices)
      group.members = [(*member, member[0] in patched) for member in group.members]

  def _sizes_of(self, index: int) -> tuple[int, tuple | None, tuple | None]:
    """(index, the kernel's global and local sizes where they depend on a Variable, else None: a kernel whose loops
    end at a Variable inside a fixed launch, as every host kernel's, keeps its sizes)."""
    runner = self.items[index].runner
    sized = any(isinstance(size, Node) for size in (*runner.global_size, *runner.local_size))
    return (index, runner.global_size, runner.local_size) if sized else (index, None, None)

  def set_buffer(self, item_index: int, slot: int, buffer: Buffer) -> None:
    self.items[item_index].bufs[slot] = buffer
    self.graph.set_argument(item_index, slot, buffer.handle)

  def set_var_vals(self, var_vals: dict[str, int]) -> None:
    """This call's values of the symbolic Variables: the int arguments after the buffers, and the launch sizes
    computed from them, of every kernel that takes them."""
    for group in self.symbolic:
      values = group.changed(var_vals)
      if values is None: continue
      arguments = list(values.values())
      for index, global_size, local_size, patched in group.members:
        item = self.items[index]
        item.var_vals = values   # (shared by the group's items: never changed in place, only replaced)
        if patched:
          for position, value in enumerate(arguments, start=len(item.bufs)): self.graph.set_argument(index, position,
                                                                                                     value)
        if global_size is None or local_size is None: continue
        self.graph.set_launch_size(index, tuple(sym_infer(size, values) for size in global_size),
                                   tuple(sym_infer(size, values) for size in local_size))

  def run(self) -> None:
    self.graph.launch()
    GlobalCounters.kernel_count += self.kernel_count
    GlobalCounters.global_ops += self.op_count
    GlobalCounters.global_mem += self.byte_count


def build_replay(items: list[ExecItem]) -> ItemReplay | GraphReplay:
  """A graph when every item is a kernel of one device that has a graph class (a device graph, or a graph for replays
only: CLANG's HostCallGraph), else an item loop.

  A graph launch is (program, global size, local size, buffer handles, int arguments, (ops, bytes)): kernels with
  symbolic sizes get their Variables' values at capture, and GraphReplay.set_var_vals changes them (and the sizes)
  per call."""
  devices = {item.device for item in items}
  if len(devices) == 1 and all(isinstance(item.runner, CompiledRunner) for item in items) and DEBUG < 2:
    device = Device[next(iter(devices))]
    # a device graph (CUDA), else a graph only replays use (CLANG: one C function calling the kernels in turn,
    # runtime/host_calls.py; eager schedule capture, engine/capture.py, keeps its own host loop there)
    graph_class = getattr(device, "graph", None) or getattr(device, "replay_graph", None)
    if graph_class is not None:
      for item in items:
        for buffer in item.bufs: buffer.allocate()
      launches = [_graph_launch(item) for item in items]
      try:
        return GraphReplay(items, graph_class(launches))
      except (DeviceError, CompileError) as error:  # a refused graph: replay item by item, still correct
        warnings.warn(f"device graph failed ({error}); the JIT replays its kernels one by one", RuntimeWarning,
                      stacklevel=2)
  return ItemReplay(items)


def _graph_launch(item: ExecItem) -> tuple[Any, tuple[int, ...], tuple[int, ...], list[Any], list[int],
                                           tuple[int, int]]:
  runner = item.runner
  assert isinstance(runner, CompiledRunner)
  values = [item.var_vals[name] for name in runner.var_names]
  global_size = tuple(sym_infer(size, item.var_vals) for size in runner.global_size)
  local_size = tuple(sym_infer(size, item.var_vals) for size in runner.local_size)
  costs = (runner.op_count, runner.byte_count)   # what one launch computes and moves (a graph's launch policy)
  return runner.program, global_size, local_size, [buffer.handle for buffer in item.bufs], values, costs
