"""nn.Module, PyTorch's base class for layers and models, and its containers Sequential, ModuleList, ModuleDict.

A Module finds its state by looking at its attributes, in the order they were set, the way ourgrad's state-dict
walker does (ourgrad/nn/state.py) rather than through registration calls:
- a Tensor attribute is a *parameter* unless it has requires_grad=False, which makes it a *buffer* (BatchNorm's
  running statistics); `register_buffer(name, tensor, persistent=False)` keeps a buffer out of the state dict;
- a Module attribute is a *child*; lists, tuples and dicts of Tensors and Modules count too, named "name.0",
  "name.key" (a plain list of layers works like a ModuleList);
- any other object (a plain tinygrad-style layer) is looked through the same way: its tensors count as this
  module's own parameters/buffers ("plain.gain") and its Modules as children ("plain.proj");
- attributes whose name starts with "_" are ignored.

Names and order follow PyTorch for the same structure: `named_parameters()` walks the modules in pre-order and
gives each module's own parameters in attribute order; `state_dict()` gives a module's own parameters, then its
persistent buffers, then each child's entries. `get_state_dict(module)` and `module.state_dict()` agree, because
the walker in state.py asks a Module for its items (`_state_items`).

Training mode: `train()` / `eval()` set `training` on a module and all modules below it. A module starts in
training mode, as in PyTorch (BatchNorm normalizes with batch statistics and updates its running ones, Dropout
drops): call `model.eval()` before evaluating. Until train()/eval() is called on it, a module also follows the
global flag inside tinygrad's `with Tensor.train(mode):` (or after `Tensor.training = mode`), so tinygrad-style
code behaves as it expects there.

Subclasses need not call `Module.__init__` (every default is a class attribute), so plain tinygrad-style classes
turn into Modules by adding the base class.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Mapping

from ourgrad.device import Device
from ourgrad.dtype import DType, dtypes
from ourgrad.nn.state import LoadResult, get_state_dict, load_state_dict, named_items
from ourgrad.tensor import Tensor


def _join(prefix: str, name: str) -> str:
  return f"{prefix}.{name}" if prefix else name


def _expand(name: str, value: Any) -> list[tuple[str, Tensor | Module]]:
  """The Tensors and Modules inside one attribute value, with dotted names, in order: the value itself, or the
  contents of (nested) lists, tuples, dicts and plain objects, never looking inside a Module. An explicit stack;
  containers already on the path are skipped (so back-references end)."""
  found: list[tuple[str, Tensor | Module]] = []
  stack: list[tuple[str, Any, frozenset[int]]] = [(name, value, frozenset())]
  while stack:
    path, item, ancestors = stack.pop()
    if isinstance(item, (Tensor, Module)):
      found.append((path, item))
      continue
    if id(item) in ancestors: continue
    # lists, tuples, dicts and plain (tinygrad-style) objects are looked through, as get_state_dict does
    entries = named_items(item)
    if not entries: continue
    inner = ancestors | {id(item)}
    stack.extend((_join(path, key), child, inner) for key, child in reversed(entries))
  return found


def Parameter(data: Tensor, requires_grad: bool = True) -> Tensor:  # noqa: N802 (PyTorch's name)
  """torch.nn.Parameter's spelling: `data` itself, marked requires_grad (a Module finds every Tensor attribute
  without requires_grad=False as a parameter, so no wrapper class is needed)."""
  if not isinstance(data, Tensor): raise TypeError(f"Parameter needs a Tensor, got {type(data).__name__}")
  data.requires_grad = requires_grad
  return data


class Module:
  """Base class of layers and models, like torch.nn.Module: set Tensors and sub-Modules as attributes in
  `__init__`, write `forward`, and call the module. See the module docstring for how state is found."""
  _training: bool | None = None  # None: follow the global Tensor.training when set, else training (PyTorch)
  _non_persistent: frozenset[str] = frozenset()

  def __init__(self) -> None:
    """Nothing to set up: PyTorch code calls `super().__init__()`, which is harmless here."""

  # ---------------------------------------------------------------- calling

  def forward(self, *args: Any, **kwargs: Any) -> Any:
    """The computation of the module; subclasses override it."""
    raise NotImplementedError(f"{type(self).__name__} has no forward(); define forward(self, x) in the subclass")

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return self.forward(*args, **kwargs)

  # ---------------------------------------------------------------- training mode

  @property
  def training(self) -> bool:
    """Whether the module is in training mode: the last train()/eval() on it or a parent; else Tensor.training
    where the user set it (`with Tensor.train(False):`); else True, PyTorch's default."""
    if self._training is not None: return self._training
    return True if Tensor.training is None else Tensor.training

  @training.setter
  def training(self, mode: bool) -> None:
    self._training = bool(mode)

  def train(self, mode: bool = True) -> Module:
    """Put this module and every module below it in training mode (or evaluation mode with mode=False)."""
    if not isinstance(mode, bool): raise TypeError(f"train() takes a bool, got {type(mode).__name__}")
    for _, module in self.named_modules(remove_duplicate=True): module._training = mode
    return self

  def eval(self) -> Module:
    """Put this module and every module below it in evaluation mode: `train(False)`."""
    return self.train(False)

  # ---------------------------------------------------------------- the walk

  def _items(self) -> list[tuple[str, Tensor | Module]]:
    """This module's own Tensors and child Modules, with (dotted) names, in attribute order."""
    items: list[tuple[str, Tensor | Module]] = []
    for name, value in vars(self).items():
      if not name.startswith("_"): items.extend(_expand(name, value))
    return items

  def _own_parameters(self) -> list[tuple[str, Tensor]]:
    return [(name, item) for name, item in self._items()
            if isinstance(item, Tensor) and item.requires_grad is not False]

  def _own_buffers(self) -> list[tuple[str, Tensor]]:
    return [(name, item) for name, item in self._items() if isinstance(item, Tensor) and item.requires_grad is False]

  def _state_items(self) -> list[tuple[str, Tensor | Module]]:
    """What a state dict holds, in PyTorch's order: own parameters, own persistent buffers, then the children
    (ourgrad/nn/state.py's walker calls this)."""
    buffers = [(name, t) for name, t in self._own_buffers() if name not in self._non_persistent]
    return [*self._own_parameters(), *buffers, *self.named_children()]

  def named_children(self) -> Iterator[tuple[str, Module]]:
    """(name, module) for each direct child module, in attribute order."""
    for name, item in self._items():
      if isinstance(item, Module): yield name, item

  def children(self) -> Iterator[Module]:
    """The direct child modules."""
    for _, module in self.named_children(): yield module

  def named_modules(self, prefix: str = "", remove_duplicate: bool = True) -> Iterator[tuple[str, Module]]:
    """(name, module) for this module ("" or `prefix`) and every module below it, in pre-order; a module reachable
    by several paths comes once (the first) unless remove_duplicate=False. Walked with an explicit stack."""
    seen: set[int] = set()
    stack: list[tuple[str, Module, frozenset[int]]] = [(prefix, self, frozenset())]
    while stack:
      name, module, ancestors = stack.pop()
      if id(module) in ancestors: continue  # a module that contains itself: stop the cycle
      if remove_duplicate:
        if id(module) in seen: continue
        seen.add(id(module))
      yield name, module
      inner = ancestors | {id(module)}
      children = list(module.named_children())
      stack.extend((_join(name, child_name), child, inner) for child_name, child in reversed(children))

  def modules(self) -> Iterator[Module]:
    """This module and every module below it, in pre-order, each once."""
    for _, module in self.named_modules(): yield module

  def _named_tensors(self, own: Callable[[Module], list[tuple[str, Tensor]]], prefix: str, recurse: bool,
                     remove_duplicate: bool) -> Iterator[tuple[str, Tensor]]:
    modules = self.named_modules(prefix, remove_duplicate) if recurse else iter([(prefix, self)])
    seen: set[int] = set()
    for module_name, module in modules:
      for name, tensor in own(module):
        if remove_duplicate:
          if id(tensor) in seen: continue
          seen.add(id(tensor))
        yield _join(module_name, name), tensor

  def named_parameters(self, prefix: str = "", recurse: bool = True,
                       remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) for every parameter (a Tensor attribute without requires_grad=False), module by module in
    pre-order like PyTorch; a shared tensor comes once unless remove_duplicate=False."""
    return self._named_tensors(Module._own_parameters, prefix, recurse, remove_duplicate)

  def parameters(self, recurse: bool = True) -> Iterator[Tensor]:
    """The parameters, as in `named_parameters()`: what an optimizer takes (`Adam(model.parameters())`)."""
    for _, tensor in self.named_parameters(recurse=recurse): yield tensor

  def named_buffers(self, prefix: str = "", recurse: bool = True,
                    remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) for every buffer (a Tensor attribute with requires_grad=False), non-persistent ones included."""
    return self._named_tensors(Module._own_buffers, prefix, recurse, remove_duplicate)

  def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
    """The buffers, as in `named_buffers()`."""
    for _, tensor in self.named_buffers(recurse=recurse): yield tensor

  # ---------------------------------------------------------------- registration

  def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
    """Set `tensor` as the attribute `name` and mark it a buffer (requires_grad=False); a non-persistent buffer
    is left out of `state_dict()`."""
    if not name or "." in name: raise KeyError(f"buffer name must be non-empty and contain no '.', got {name!r}")
    if tensor is not None:
      if not isinstance(tensor, Tensor): raise TypeError(f"register_buffer({name!r}) needs a Tensor or None, got "
                                                         f"{type(tensor).__name__}")
      tensor.requires_grad = False
    self._non_persistent = (self._non_persistent | {name}) if not persistent else (self._non_persistent - {name})
    setattr(self, name, tensor)

  def register_parameter(self, name: str, tensor: Tensor | None) -> None:
    """Set `tensor` as the attribute `name`, marked as a parameter (requires_grad=True)."""
    if not name or "." in name: raise KeyError(f"parameter name must be non-empty and contain no '.', got {name!r}")
    if tensor is not None: tensor.requires_grad = True
    setattr(self, name, tensor)

  def add_module(self, name: str, module: Module | None) -> None:
    """Set `module` as the attribute `name` (PyTorch's spelling of `self.name = module`)."""
    if module is not None and not isinstance(module, Module):
      raise TypeError(f"add_module({name!r}) needs a Module, got {type(module).__name__}")
    setattr(self, name, module)

  def apply(self, function: Callable[[Module], Any]) -> Module:
    """Call `function` on every module below this one and then on this one (children first, as PyTorch)."""
    for module in reversed(list(self.modules())): function(module)
    return self

  # ---------------------------------------------------------------- state

  def state_dict(self, prefix: str = "") -> dict[str, Tensor]:
    """name -> Tensor for every parameter and persistent buffer, PyTorch's keys and order ("layers.0.weight").
    The tensors are the module's own (not copies); a tensor shared by two names is listed under both."""
    return get_state_dict(self, prefix)

  def load_state_dict(self, state_dict: Mapping[str, Tensor], strict: bool = True) -> LoadResult:
    """Copy the tensors of `state_dict` into this module's (cast to each one's dtype, moved to its device).
    With strict, missing and unexpected keys raise StateDictError listing all of them; a shape mismatch always
    raises. Returns (missing_keys, unexpected_keys). See ourgrad.nn.state.load_state_dict."""
    return load_state_dict(self, dict(state_dict), strict)

  def to(self, device: str | DType | None = None, dtype: DType | None = None) -> Module:
    """Move every parameter and buffer (and their gradients) to `device` and/or cast the floating-point ones to
    `dtype`, in place (the tensors stay the same objects, so an optimizer holding them sees the change); returns
    the module. `to(dtypes.float16)` casts only, as in PyTorch."""
    if isinstance(device, DType): device, dtype = None, device
    device = Device.canonicalize(device) if device is not None else None
    changed: dict[int, Tensor] = {}
    for _, tensor in [*self.named_parameters(), *self.named_buffers()]:
      if id(tensor) in changed: continue
      value = tensor.to(device) if device is not None else tensor
      if dtype is not None and tensor.dtype.is_float: value = value.detach().cast(dtype)
      if value is tensor: continue
      tensor.lazydata = value.lazydata
      if tensor.grad is not None: tensor.grad = tensor.grad.to(tensor.device).cast(tensor.dtype)
      changed[id(tensor)] = tensor
    if changed: Tensor.realize_all(*changed.values())
    return self

  def half(self) -> Module:
    """Cast the floating-point parameters and buffers to float16, in place."""
    return self.to(dtype=dtypes.float16)

  def bfloat16(self) -> Module:
    """Cast the floating-point parameters and buffers to bfloat16, in place (for inference: optimizers refuse
    low-precision parameters; train float32 weights under ourgrad.autocast instead)."""
    return self.to(dtype=dtypes.bfloat16)

  def float(self) -> Module:
    """Cast the floating-point parameters and buffers to float32, in place."""
    return self.to(dtype=dtypes.float32)

  def zero_grad(self) -> None:
    """Forget every parameter's gradient (set `.grad` to None, as PyTorch's default set_to_none=True)."""
    for tensor in self.parameters(): tensor.grad = None

  def requires_grad_(self, requires_grad: bool = True) -> Module:
    """Set requires_grad on every parameter (freeze a part of a model with False)."""
    for tensor in self.parameters(): tensor.requires_grad = requires_grad
    return self

  # ---------------------------------------------------------------- printing

  def extra_repr(self) -> str:
    """The arguments shown in this module's repr line; layers override it."""
    return ""

  def __repr__(self) -> str:
    """PyTorch's layout: one line per module, children indented under their parent as "(name): Child(...)".
    Walked with an explicit stack; a module inside itself prints as "Name(...)"."""
    lines: list[str] = []
    # (label, module or None for a closing parenthesis, depth, ids of the modules above)
    stack: list[tuple[str, Module | None, int, frozenset[int]]] = [("", self, 0, frozenset())]
    while stack:
      label, module, depth, ancestors = stack.pop()
      indent = "  " * depth
      if module is None:
        lines.append(f"{indent})")
        continue
      head = f"{indent}{label}{type(module).__name__}("
      if id(module) in ancestors:
        lines.append(f"{head}...)")
        continue
      children = list(module.named_children())
      if not children:
        lines.append(f"{head}{module.extra_repr()})")
        continue
      lines.append(head)
      if module.extra_repr(): lines.append(f"{indent}  {module.extra_repr()}")
      stack.append(("", None, depth, ancestors))
      inner = ancestors | {id(module)}
      stack.extend((f"({name}): ", child, depth + 1, inner) for name, child in reversed(children))
    return "\n".join(lines)


class Sequential(Module):
  """Modules applied one after another, like torch.nn.Sequential: `Sequential(a, b, c)(x) == c(b(a(x)))`; the
  children are named "0", "1", ... (or by the keys of one dict passed instead)."""

  def __init__(self, *modules: Module | Callable[[Any], Any] | Mapping[str, Module]):
    if len(modules) == 1 and isinstance(modules[0], Mapping): self._layers = dict(modules[0])
    else: self._layers = {str(index): module for index, module in enumerate(modules)}

  def _items(self) -> list[tuple[str, Tensor | Module]]:
    return [(name, layer) for name, layer in self._layers.items() if isinstance(layer, Module)]

  def forward(self, x: Any) -> Any:
    for layer in self._layers.values(): x = layer(x)
    return x

  def __getitem__(self, index: int | slice) -> Any:
    layers = list(self._layers.values())
    return Sequential(*layers[index]) if isinstance(index, slice) else layers[index]

  def __len__(self) -> int: return len(self._layers)

  def __iter__(self) -> Iterator[Any]: return iter(list(self._layers.values()))

  def append(self, module: Module) -> Sequential:
    """Add `module` at the end."""
    self._layers[str(len(self._layers))] = module
    return self


class ModuleList(Module):
  """A list of modules whose parameters the parent finds (named "0", "1", ...), like torch.nn.ModuleList."""

  def __init__(self, modules: Iterable[Module] = ()):
    self._modules_list: list[Module] = []
    self.extend(modules)

  def _items(self) -> list[tuple[str, Tensor | Module]]:
    return [(str(index), module) for index, module in enumerate(self._modules_list)]

  @staticmethod
  def _check(module: Any) -> Module:
    if not isinstance(module, Module): raise TypeError(f"ModuleList holds Modules, got {type(module).__name__}")
    return module

  def append(self, module: Module) -> ModuleList:
    """Add `module` at the end."""
    self._modules_list.append(self._check(module))
    return self

  def extend(self, modules: Iterable[Module]) -> ModuleList:
    """Add each of `modules` at the end."""
    for module in modules: self.append(module)
    return self

  def insert(self, index: int, module: Module) -> None:
    """Insert `module` before position `index`."""
    self._modules_list.insert(index, self._check(module))

  def __getitem__(self, index: int | slice) -> Any:
    if isinstance(index, slice): return ModuleList(self._modules_list[index])
    return self._modules_list[index]

  def __setitem__(self, index: int, module: Module) -> None: self._modules_list[index] = self._check(module)

  def __delitem__(self, index: int | slice) -> None: del self._modules_list[index]

  def __len__(self) -> int: return len(self._modules_list)

  def __iter__(self) -> Iterator[Module]: return iter(list(self._modules_list))

  def forward(self, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("a ModuleList is a container, not a layer: iterate over it in the parent's forward()")


class ModuleDict(Module):
  """A dict of modules whose parameters the parent finds (named by the keys), like torch.nn.ModuleDict."""

  def __init__(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]] | None = None):
    self._modules_dict: dict[str, Module] = {}
    if modules is not None: self.update(modules)

  def _items(self) -> list[tuple[str, Tensor | Module]]:
    return list(self._modules_dict.items())

  def __getitem__(self, key: str) -> Module: return self._modules_dict[key]

  def __setitem__(self, key: str, module: Module) -> None:
    if not isinstance(module, Module): raise TypeError(f"ModuleDict holds Modules, got {type(module).__name__}")
    if not isinstance(key, str) or not key or "." in key:
      raise KeyError(f"ModuleDict keys must be non-empty strings without '.', got {key!r}")
    self._modules_dict[key] = module

  def __delitem__(self, key: str) -> None: del self._modules_dict[key]

  def __contains__(self, key: object) -> bool: return key in self._modules_dict

  def __len__(self) -> int: return len(self._modules_dict)

  def __iter__(self) -> Iterator[str]: return iter(list(self._modules_dict))

  def keys(self) -> list[str]:
    """The keys, in insertion order."""
    return list(self._modules_dict.keys())

  def values(self) -> list[Module]:
    """The modules, in insertion order."""
    return list(self._modules_dict.values())

  def items(self) -> list[tuple[str, Module]]:
    """(key, module) pairs, in insertion order."""
    return list(self._modules_dict.items())

  def update(self, modules: Mapping[str, Module] | Iterable[tuple[str, Module]]) -> None:
    """Add or replace the entries of `modules` (a mapping or (key, module) pairs)."""
    pairs = modules.items() if isinstance(modules, Mapping) else modules
    for key, module in pairs: self[key] = module

  def pop(self, key: str) -> Module:
    """Remove the entry `key` and return its module."""
    return self._modules_dict.pop(key)

  def forward(self, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("a ModuleDict is a container, not a layer: index it in the parent's forward()")
