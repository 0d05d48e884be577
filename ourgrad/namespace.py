"""PyTorch's module-level spellings (`torch.zeros`, `torch.cat`, `torch.float32`, `torch.save`, ...) for ourgrad.

`import ourgrad as torch` then reads like PyTorch code: ourgrad/__init__.py re-exports everything listed in
`__all__` here. Each name is a thin alias of the one implementation (a Tensor method or creation function, a DType,
ourgrad.nn.state's safetensors reader/writer); nothing is computed here. `ourgrad.tensor(data)` is `tensor` below,
reached through the submodule ourgrad/tensor.py made callable (`CallableModule`), so the submodule stays
importable. A PyTorch name ourgrad lacks raises an AttributeError that says so and names the nearest ourgrad
spellings (`missing_name_error`).
"""
from __future__ import annotations

import builtins
import difflib
import pathlib
import types
from typing import Any

from ourgrad.dtype import DType, dtypes
from ourgrad.tensor import Tensor, no_grad

# ---------------------------------------------------------------- dtypes, PyTorch's names
# (float, int, bool, sum, max, all, ... shadow the built-ins in this module: use builtins.all and friends here)

float32, float16, float64, bfloat16 = dtypes.float32, dtypes.float16, dtypes.float64, dtypes.bfloat16
int8, int16, int32, int64 = dtypes.int8, dtypes.int16, dtypes.int32, dtypes.int64
uint8, uint16, uint32, uint64 = dtypes.uint8, dtypes.uint16, dtypes.uint32, dtypes.uint64
half, double, short, long = dtypes.float16, dtypes.float64, dtypes.int16, dtypes.int64
float, int, bool = dtypes.float32, dtypes.int32, dtypes.bool  # noqa: A001 (torch.float, torch.int, torch.bool)

# ---------------------------------------------------------------- creation

zeros, ones, full, empty, arange, linspace, eye = \
  Tensor.zeros, Tensor.ones, Tensor.full, Tensor.empty, Tensor.arange, Tensor.linspace, Tensor.eye
rand, randn, randint, manual_seed = Tensor.rand, Tensor.randn, Tensor.randint, Tensor.manual_seed
zeros_like, ones_like, full_like = Tensor.zeros_like, Tensor.ones_like, Tensor.full_like
rand_like, randn_like = Tensor.rand_like, Tensor.randn_like


def tensor(data: Any, dtype: DType | str | None = None, device: str | None = None,
           requires_grad: bool = False) -> Tensor:
  """torch.tensor: a new Tensor holding `data` (a number, nested list, numpy array or Tensor). Python ints give
  int32 (PyTorch: int64), Python floats float32."""
  return Tensor(data, device=device, dtype=dtype, requires_grad=requires_grad or None)


class CallableModule(types.ModuleType):
  """The class given to the module ourgrad.tensor: calling it is `tensor(data, ...)`, PyTorch's `torch.tensor`, while
  `from ourgrad.tensor import Tensor` and `ourgrad.tensor.Tensor` keep working (a plain function of that name would
  hide the submodule)."""

  def __call__(self, data: Any, dtype: DType | str | None = None, device: str | None = None,
               requires_grad: bool = False) -> Tensor:
    return tensor(data, dtype=dtype, device=device, requires_grad=requires_grad)


def from_numpy(array: Any) -> Tensor:
  """torch.from_numpy: a Tensor with the array's values and dtype (a copy on the device, not shared memory)."""
  return Tensor(array)


def empty_like(like: Tensor, dtype: DType | str | None = None, device: str | None = None, **kwargs: Any) -> Tensor:
  """A tensor of `like`'s shape, dtype and device (unless given) with unspecified values."""
  return Tensor.empty(*like.shape, dtype=dtype or like.dtype, device=device or like.device, **kwargs)


# ---------------------------------------------------------------- operations: each Tensor's method, as a function
# `ourgrad.exp(x)` is `Tensor.exp(x)` is `x.exp()`; `cat` and `stack` take a sequence, as PyTorch's do

cat, concat, stack, where, einsum = Tensor.cat, Tensor.cat, Tensor.stack, Tensor.where, Tensor.einsum
argmax, argmin, flatten, reshape, permute, transpose = \
  Tensor.argmax, Tensor.argmin, Tensor.flatten, Tensor.reshape, Tensor.permute, Tensor.transpose
squeeze, unsqueeze, split, chunk, gather, tril, triu = \
  Tensor.squeeze, Tensor.unsqueeze, Tensor.split, Tensor.chunk, Tensor.gather, Tensor.tril, Tensor.triu
sum, mean, var, std, prod, cumsum, logsumexp = \
  Tensor.sum, Tensor.mean, Tensor.var, Tensor.std, Tensor.prod, Tensor.cumsum, Tensor.logsumexp  # noqa: A001
max, min, maximum, minimum, clamp, clip = \
  Tensor.max, Tensor.min, Tensor.maximum, Tensor.minimum, Tensor.clamp, Tensor.clamp  # noqa: A001
any, all, sort, argsort, topk, multinomial = \
  Tensor.any, Tensor.all, Tensor.sort, Tensor.argsort, Tensor.topk, Tensor.multinomial  # noqa: A001
abs, exp, log, sqrt, rsqrt, sin, cos, tanh, sigmoid, relu, erf, sign = \
  Tensor.abs, Tensor.exp, Tensor.log, Tensor.sqrt, Tensor.rsqrt, Tensor.sin, Tensor.cos, Tensor.tanh, \
  Tensor.sigmoid, Tensor.relu, Tensor.erf, Tensor.sign  # noqa: A001
softmax, log_softmax, matmul, mm, bmm, outer, dot, lerp = \
  Tensor.softmax, Tensor.log_softmax, Tensor.matmul, Tensor.matmul, Tensor.matmul, Tensor.outer, Tensor.dot, \
  Tensor.lerp
allclose, isclose, masked_fill, numel = Tensor.allclose, Tensor.isclose, Tensor.masked_fill, Tensor.numel


def is_tensor(obj: Any) -> bool:
  """Whether `obj` is a Tensor."""
  return isinstance(obj, Tensor)


def is_floating_point(x: Tensor) -> bool:
  """Whether `x` has a floating-point dtype."""
  return x.dtype.is_float


# ---------------------------------------------------------------- autograd switches

inference_mode = no_grad  # ourgrad has no separate inference tensors: no_grad is what inference_mode gives


class enable_grad:  # noqa: N801 (PyTorch's name)
  """Context manager and decorator that records autograd graphs again inside a no_grad block."""

  def __enter__(self) -> None:
    self.previous = Tensor.no_grad
    Tensor.no_grad = False

  def __exit__(self, *exc: Any) -> None:
    Tensor.no_grad = self.previous

  def __call__(self, function: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
      with enable_grad(): return function(*args, **kwargs)
    return wrapper


class set_grad_enabled(enable_grad):  # noqa: N801 (PyTorch's name)
  """`with set_grad_enabled(False):` is no_grad, `set_grad_enabled(True)` is enable_grad."""

  def __init__(self, mode: bool) -> None:
    self.mode = mode

  def __enter__(self) -> None:
    self.previous = Tensor.no_grad
    Tensor.no_grad = not self.mode


def is_grad_enabled() -> bool:
  """Whether operations record autograd graphs now (False inside no_grad)."""
  return not Tensor.no_grad


# ---------------------------------------------------------------- save and load

_SINGLE_TENSOR_KEY = "__ourgrad_single_tensor__"  # torch.save(tensor) stores the one tensor under this name


def save(obj: dict[str, Tensor] | Tensor, f: str | pathlib.Path) -> None:
  """torch.save for what models and checkpoints hold: a dict of name -> Tensor (`model.state_dict()`) or a single
  Tensor, written as safetensors (readable by PyTorch's `safetensors.torch.load_file`)."""
  from ourgrad.nn.state import safe_save
  if isinstance(obj, Tensor): obj = {_SINGLE_TENSOR_KEY: obj}
  if not isinstance(obj, dict) or not builtins.all(isinstance(value, Tensor) for value in obj.values()):
    raise TypeError(f"ourgrad.save writes safetensors: it takes a Tensor or a dict of name -> Tensor (a state_dict), "
                    f"got {type(obj).__name__}; save other Python objects with pickle or json")
  safe_save(obj, f)


def load(f: str | pathlib.Path, map_location: str | None = None, weights_only: bool = True,
         **kwargs: Any) -> dict[str, Tensor] | Tensor:
  """torch.load: a safetensors file written by `save` (or anyone), or a PyTorch checkpoint (a zip of pickles, read
  without torch: tensors only); `map_location` names the device. Returns what `save` was given."""
  from ourgrad.nn.state import safe_load, torch_load
  device = None if map_location in (None, "cpu") else map_location
  with open(f, "rb") as file: start = file.read(9)
  # safetensors: an 8-byte header length, then the JSON header ("{"); anything else goes to the checkpoint reader,
  # which reads zip archives and names what it cannot read (a legacy pickle, another format)
  loaded = safe_load(f, device) if start[8:9] == b"{" else torch_load(f, device)
  return loaded[_SINGLE_TENSOR_KEY] if list(loaded) == [_SINGLE_TENSOR_KEY] else loaded


# ---------------------------------------------------------------- missing names

def missing_name_error(module: str, name: str, available: list[str]) -> AttributeError:
  """The AttributeError for `module.name`: says ourgrad has no such name and suggests the nearest spellings."""
  close = difflib.get_close_matches(name, available, n=3, cutoff=0.6)
  hint = f"; the nearest ourgrad names: {', '.join(close)}" if close else ""
  tensor_hint = f"; Tensor.{name} exists: call x.{name}(...)" if hasattr(Tensor, name) else ""
  return AttributeError(f"module {module!r} has no attribute {name!r}: ourgrad does not provide PyTorch's "
                        f"{module.replace('ourgrad', 'torch')}.{name}{tensor_hint}{hint} (docs/pytorch.md lists "
                        f"the names)")


__all__ = ["float32", "float16", "float64", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "uint16",
           "uint32", "uint64", "half", "double", "short", "long", "float", "int", "bool",
           "zeros", "ones", "full", "empty", "arange", "linspace", "eye", "rand", "randn", "randint", "manual_seed",
           "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "empty_like", "from_numpy",
           "cat", "concat", "stack", "where", "einsum", "argmax", "argmin", "flatten", "reshape", "permute",
           "transpose", "squeeze", "unsqueeze", "split", "chunk", "gather", "tril", "triu", "sum", "mean", "var",
           "std", "prod", "cumsum", "logsumexp", "max", "min", "maximum", "minimum", "clamp", "clip", "any", "all",
           "sort", "argsort", "topk", "multinomial", "abs", "exp", "log", "sqrt", "rsqrt", "sin", "cos", "tanh",
           "sigmoid", "relu", "erf", "sign", "softmax", "log_softmax", "matmul", "mm", "bmm", "outer", "dot", "lerp",
           "allclose", "isclose", "masked_fill", "numel", "is_tensor", "is_floating_point", "inference_mode",
           "enable_grad", "set_grad_enabled", "is_grad_enabled", "save", "load"]
