"""TinyJit: run a function's kernels again without Python building graphs, scheduling or generating code.

    @TinyJit
    def step(x: Tensor, y: Tensor) -> Tensor: ...   # forward, backward, optimizer.step(): anything that launches

Call 1 runs the function normally (kernels compile). Call 2 runs it again and records every ExecItem it launches
(ourgrad/engine/exec_item.py). Later calls skip the function: the recorded items run on the new input buffers
(as one CUDA graph on CUDA, a loop over pre-bound ctypes calls on CPU devices) and the return value is rebuilt
with Tensors backed by the outputs. docs/jit.md lists what is checked and what a replay cannot see.

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
from typing import Any, Callable, Generic, TypeVar

from ourgrad.device import Buffer, Device, HostProgram
from ourgrad.engine.exec_item import CompiledRunner, ExecItem, capture_into, jit_recording
from ourgrad.engine.memory import held_only_by_items, plan_memory
from ourgrad.errors import DeviceError, JitError
from ourgrad.helpers import DEBUG, GlobalCounters, env_var
from ourgrad.lazy import LazyBuffer
from ourgrad.shape.symbolic import Node, sym_bind, sym_unbind
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
  """Capture the kernels a function launches on its second call and replay them on later calls (see module doc)."""

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
    if not JIT or jit_recording.active:
      # JIT=0, or a jitted function called by one being captured: its kernels belong to the outer capture
      return self.fn(*args, **kwargs)
    arguments = self._arguments(args, kwargs)
    tensors, statics = _split_arguments(arguments)
    statics, var_vals = _symbolic_values(statics, tensors)
    input_tensors = _prepare_inputs(tensors)
    input_buffers = [_input_buffer(tensor) for tensor in input_tensors.values()]
    _check_distinct(list(input_tensors), input_buffers)
    if self.captured is not None:
      self.call_count += 1
      return self.captured.replay(input_tensors, input_buffers, statics, var_vals)
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
      raise JitError(f"{self.fn.__name__} drew random numbers (Tensor.rand, randn, dropout, ...): a replay would "
                     f"reuse the captured values on every call. Draw them outside and pass them as inputs")
    if not items:
      raise JitError(f"{self.fn.__name__} launched no kernels on its capture call (its outputs were already "
                     f"realized or it returns nothing computed): there is nothing to replay")
    specs = [InputSpec(path, _unbound_shape(tensor.shape), tensor.dtype, tensor.device)
             for path, tensor in input_tensors.items()]
    self.captured = CapturedJit(items, specs, input_buffers, statics, result, outputs)
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


def _is_buffer_backed(tensor: Tensor) -> bool:
  """Whether the tensor reads a realized buffer in row-major order from its first element (the base itself or a
  reshape of it): then that buffer is the input a replay swaps."""
  lazy = tensor.lazydata
  return lazy.base.realized is not None and lazy.st.contiguous and lazy.size == lazy.base.size


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


def _finish_call(result: Any, capturing: bool = False) -> tuple[Any, list[Tensor]]:
  """Realize the function's outputs (views made contiguous) and every assign it made, in one schedule. Returns the
  result with outputs replaced where they had to be made contiguous, and the output tensors in order.

  An assign to a tensor that has no buffer of its own to write (a constant such as a fresh Tensor.zeros(), or a
  view) rebinds the tensor to a new buffer instead of writing in place; a replay cannot rebind a Python object. When
  capturing, such a tensor's new value is also copied into the buffer it read before the call, so each replay reads
  the previous replay's value and the tensor (bound to the new buffer) sees every replay's result."""
  outputs: list[Tensor] = []

  def visit(value: Any, path: str) -> Any:
    if isinstance(value, Tensor):
      if not value.lazydata.is_base and not (value.lazydata.st.contiguous and
                                             value.lazydata.size == value.lazydata.base.size):
        value = value.contiguous()
      outputs.append(value)
      return value
    if isinstance(value, (list, tuple)):
      return type(value)(visit(item, f"{path}[{index}]") for index, item in enumerate(value))
    if isinstance(value, dict): return {key: visit(item, f"{path}[{key!r}]") for key, item in value.items()}
    if value is None: return None
    raise JitError(f"a jitted function returned {type(value).__name__} at {path}: only Tensors (in lists, tuples and "
                   f"dicts) or None can be returned, a Python value would be frozen at its captured value")

  result = visit(result, "return value")
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
      if not (lazy.is_base or (lazy.st.contiguous and lazy.size == lazy.base.size)) or lazy.shape != tensor.shape:
        raise JitError(f"a jitted function assigned to a view {lazy.shape} of a buffer it cannot write in place; "
                       f"assign to a realized tensor of its own (e.g. make it with .contiguous().realize())")
      write_backs.append(Tensor(LazyBuffer.from_buffer(old_buffer, lazy.base.shape)).reshape(tensor.shape)
                         .assign(tensor.detach()))
    if write_backs: Tensor.realize_all(*write_backs)
  return result, outputs


class CapturedJit:
  """The ExecItems of one capture and where a replay puts its inputs and fresh output buffers."""

  def __init__(self, items: list[ExecItem], specs: list[InputSpec], input_buffers: list[Buffer],
               statics: dict[str, Any], result: Any, outputs: list[Tensor]):
    self.items, self.specs, self.statics = items, specs, statics
    self.input_buffers = input_buffers
    self.result_template = _template(result)  # the structure only: the capture call's tensors are not kept alive
    # every (item, argument) slot holding each input buffer, and each output buffer that this capture made
    self.input_slots = [self._slots_of(buffer) for buffer in input_buffers]
    output_buffers = [tensor.lazydata.base.realized for tensor in outputs]
    self.output_shapes = [_unbound_shape(tensor.shape) for tensor in outputs]  # bound again per replay
    self.var_vals: dict[str, int] = {}
    self.output_requires_grad = [tensor.requires_grad for tensor in outputs]
    self.output_buffers: list[Buffer] = output_buffers  # type: ignore[assignment]
    written = {id(item.bufs[0]) for item in items}
    input_ids = {id(buffer) for buffer in input_buffers}
    # outputs computed here get a new buffer on every replay (a Tensor returned earlier keeps its values); an output
    # that is an input or state made before (a weight updated in place) is returned as that same buffer
    self.fresh_outputs = [index for index, buffer in enumerate(output_buffers)
                          if id(buffer) in written and id(buffer) not in input_ids]
    self.fresh_slots = {index: self._slots_of(output_buffers[index]) for index in self.fresh_outputs}
    self.replay_runner = build_replay(items)

  def _slots_of(self, buffer: Buffer) -> list[tuple[int, int]]:
    return [(item_index, slot) for item_index, item in enumerate(self.items) for slot, known in enumerate(item.bufs)
            if known is buffer]

  def plan_memory(self) -> None:
    """Share memory between the capture's internal buffers (made and last read inside it, held by nothing else;
    never an input or an output) across all its schedules."""
    keep = {id(buffer) for buffer in self.input_buffers} | {id(buffer) for buffer in self.output_buffers}
    only_items = held_only_by_items([item.bufs for item in self.items])
    first_use_is_write: set[int] = set()
    seen: set[int] = set()
    for item in self.items:
      for slot, buffer in enumerate(item.bufs):
        if id(buffer) in seen: continue
        seen.add(id(buffer))
        # a buffer read before it is written carries values from one call into the next: never shared
        if slot == 0 and sum(known is buffer for known in item.bufs) == 1: first_use_is_write.add(id(buffer))
    internal = (only_items & first_use_is_write) - keep
    if plan_memory([item.bufs for item in self.items], lambda buffer: id(buffer) in internal, label="jit"):
      self.replay_runner = build_replay(self.items)  # the pre-bound arguments point at the old memory

  def replay(self, inputs: dict[str, Tensor], input_buffers: list[Buffer], statics: dict[str, Any],
             var_vals: dict[str, int] | None = None) -> Any:
    self._check(inputs, statics)
    self.var_vals = var_vals or {}
    if self.var_vals: self.replay_runner.set_var_vals(self.var_vals)
    for buffer, previous, slots in zip(input_buffers, self.input_buffers, self.input_slots):
      if buffer is previous: continue  # the same input as last call: its slots already hold it
      for item_index, slot in slots: self.replay_runner.set_buffer(item_index, slot, buffer)
    self.input_buffers = input_buffers
    for index in self.fresh_outputs:
      old = self.output_buffers[index]
      fresh = Buffer(old.device, old.size, old.dtype)
      for item_index, slot in self.fresh_slots[index]: self.replay_runner.set_buffer(item_index, slot, fresh)
      self.output_buffers[index] = fresh
    self.replay_runner.run()
    return self._rebuild_result()

  def _check(self, inputs: dict[str, Tensor], statics: dict[str, Any]) -> None:
    if list(inputs) != [spec.path for spec in self.specs]:
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

  def _rebuild_result(self) -> Any:
    outputs = iter(range(len(self.output_buffers)))

    def visit(value: Any) -> Any:
      if value is _OUTPUT:
        index = next(outputs)
        shape = tuple(sym_bind(size, self.var_vals) for size in self.output_shapes[index])
        lazy = LazyBuffer.from_buffer(self.output_buffers[index], shape)
        return Tensor(lazy, requires_grad=self.output_requires_grad[index])
      if isinstance(value, (list, tuple)): return type(value)(visit(item) for item in value)
      if isinstance(value, dict): return {key: visit(item) for key, item in value.items()}
      return value

    return visit(self.result_template)


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
    for item, call in zip(self.items, self.host_calls):
      names = getattr(item.runner, "var_names", ())
      if not names: continue
      item.var_vals = {name: var_vals[name] for name in names}
      if call is not None: call[1][len(item.bufs):] = [var_vals[name] for name in names]

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
  """Runs captured kernels of one device as one device graph (CUDA graphs): `set_buffer` updates the graph's
  kernel arguments in place, `run` launches it with one call."""

  def __init__(self, items: list[ExecItem], graph: Any):
    self.items, self.graph = items, graph
    self.dirty: set[int] = set()
    self.op_count = sum(item.runner.op_count for item in items)
    self.byte_count = sum(item.runner.byte_count for item in items)

  def set_buffer(self, item_index: int, slot: int, buffer: Buffer) -> None:
    self.items[item_index].bufs[slot] = buffer
    self.dirty.add(item_index)

  def set_var_vals(self, var_vals: dict[str, int]) -> None:
    """Nothing to do: a capture with symbolic kernels replays item by item (build_replay)."""

  def run(self) -> None:
    for item_index in self.dirty:
      self.graph.update(item_index, [buffer.handle for buffer in self.items[item_index].bufs])
    self.dirty.clear()
    self.graph.launch()
    GlobalCounters.kernel_count += len(self.items)
    GlobalCounters.global_ops += self.op_count
    GlobalCounters.global_mem += self.byte_count


def build_replay(items: list[ExecItem]) -> ItemReplay | GraphReplay:
  """A device graph when every item is a kernel of one device that has a graph class, else an item loop."""
  devices = {item.device for item in items}
  # kernels with symbolic sizes (int arguments, launch sizes computed per call) replay item by item
  symbolic = any(getattr(item.runner, "var_names", ()) for item in items)
  if len(devices) == 1 and all(isinstance(item.runner, CompiledRunner) for item in items) and DEBUG < 2 \
      and not symbolic:
    graph_class = getattr(Device[next(iter(devices))], "graph", None)
    if graph_class is not None:
      for item in items:
        for buffer in item.bufs: buffer.allocate()
      launches = [(item.runner.program, item.runner.global_size, item.runner.local_size,
                   [buffer.handle for buffer in item.bufs]) for item in items]
      try:
        return GraphReplay(items, graph_class(launches))
      except DeviceError as error:  # a driver that refuses the graph: replay item by item, still correct
        warnings.warn(f"device graph failed ({error}); the JIT replays its kernels one by one", RuntimeWarning,
                      stacklevel=2)
  return ItemReplay(items)

