"""ourgrad: a small, fast, hackable lazy-tensor deep-learning library.

    from ourgrad import Tensor, dtypes
    x = Tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    (x @ x).relu().sum().backward()

PyTorch's module-level names work too (ourgrad/namespace.py): `import ourgrad as torch; torch.zeros(2, 3)`,
`torch.cat`, `torch.float32`, `torch.no_grad()`, `torch.save`/`torch.load`, `torch.nn`, `torch.nn.functional`,
`torch.optim` (with `lr_scheduler`), `torch.utils.data`; docs/pytorch.md has the table.
"""
import gc as _gc
from types import ModuleType
from typing import Any

from ourgrad.device import Device
from ourgrad.dtype import DType, dtypes
from ourgrad.engine.profile import profile
from ourgrad.helpers import GlobalCounters, get_float32_matmul_precision, set_float32_matmul_precision
from ourgrad.mixed_precision import autocast, get_autocast_dtype, is_autocast_enabled
from ourgrad.tensor import Tensor, no_grad
from ourgrad.engine.jit import TinyJit  # noqa: E402 (after Tensor, which it wraps)
from ourgrad import namespace
from ourgrad.namespace import *  # noqa: F401,F403 (PyTorch's spellings: thin aliases, listed in namespace.__all__)
from ourgrad import amp, cuda, nn, optim, utils  # noqa: E402 (torch.amp, torch.cuda, torch.nn, torch.optim, torch.utils.data)
from ourgrad import helpers as _helpers, tensor as _tensor_module  # noqa: E402

_tensor_module.__class__ = namespace.CallableModule  # ourgrad.tensor(data) is torch.tensor(data)

# An eager training step allocates thousands of tracked objects (tensors, Functions, lazy buffers) that live for a
# step, so the cyclic collector runs every step and a full pass every few dozen steps; a full pass scanned the ~30k
# objects this import made (modules, functions, classes), which live until exit: most of the collector's time, 10-15%
# of an eager MLP or CNN step's Python time on the CPU. Frozen, they are never scanned again; nothing else changes
# (an object frozen here that later becomes cyclic garbage is not reclaimed: import-time objects do not). Collected
# first (~20 ms once), so that garbage the importing program had not collected yet is not frozen with them
if _helpers.GC_FREEZE_IMPORT:
  _gc.collect()
  _gc.freeze()

# Most objects of an eager step (tensors, Functions, lazy buffers: ~2000 alive at a CNN step's peak) are freed by
# reference count when the step's graph goes. With the default first-generation threshold (700 net allocations) the
# collector scanned them ~3 times a step, and each pass promoted survivors toward the full passes: 6-10% of the CNN
# step's thread time on the CPU (docs/jit.md). GC_THRESHOLD (default 10000) raises the threshold. A higher one only
# delays what the collector frees, reference cycles: a training step, eager or jitted, makes none
# (test/test_eager_cycles.py), so no device buffer of ourgrad's waits for a collection (a closure in the jit that called
# itself once kept a step's outputs alive until one, which raised a capture's peak memory in test_memory_planner)
if _helpers.GC_THRESHOLD.value > _gc.get_threshold()[0]:
  _gc.set_threshold(_helpers.GC_THRESHOLD.value, *_gc.get_threshold()[1:])

__all__ = ["Tensor", "TinyJit", "dtypes", "DType", "Device", "GlobalCounters", "no_grad", "profile",
           "set_float32_matmul_precision", "get_float32_matmul_precision", "autocast", "get_autocast_dtype",
           "is_autocast_enabled", "amp", "cuda", "nn", "optim", "utils",
           "tensor", *namespace.__all__]  # noqa: F405 (tensor: the callable submodule below)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
  """A name ourgrad lacks (often a PyTorch one): AttributeError naming the nearest ourgrad spellings."""
  if name.startswith("__"): raise AttributeError(name)
  # suggest the public names a user calls, not the internal submodules (ourgrad.renderer, ourgrad.lazy, ...)
  torch_like_modules = ("amp", "cuda", "nn", "optim", "utils")
  names = [key for key, value in globals().items()
           if not key.startswith("_") and (not isinstance(value, ModuleType) or key in torch_like_modules)]
  raise namespace.missing_name_error("ourgrad", name, names)
