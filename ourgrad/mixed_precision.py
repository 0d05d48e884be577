"""Automatic mixed precision: the `autocast` context and the cast policy each eligible op follows under it.

    with ourgrad.autocast(dtypes.bfloat16):      # or autocast("cuda", dtype=dtypes.bfloat16), torch's spelling
      loss = model(x).cross_entropy(y)           # matmuls in bfloat16, norms / softmax / losses in float32
    loss.backward()                              # float32 parameters get float32 gradients

An op opts in with a decorator naming its policy (`@autocast_op(CastPolicy.LOWER)` on matmul, linear, conv, einsum,
attention; `FLOAT32` on reductions, norms, softmax, exp/log/pow and losses; `NATIVE` on composites that torch runs in
their input dtype but ourgrad builds from FLOAT32 ops, such as gelu or mean). The lists follow torch's CUDA autocast
lists (docs/training.md has them). While a policy op runs, autocast is suspended in that thread: the ops it is built
from run in the dtypes it handed them, as torch's kernels below the autocast dispatch key do.

The state is per thread (a stack of (enabled, dtype) frames), so autocast in one thread never changes another's ops.
Under TinyJit the state at capture decides the kernels, as it decides the graph torch.compile traces.
This module sits below Tensor: it never imports it (tensors are recognised by their `dtype` and `cast`).
"""
from __future__ import annotations

import enum
import functools
import threading
from typing import Any, Callable, TypeVar

from ourgrad.dtype import DType, dtypes
from ourgrad.errors import DTypeError
from ourgrad.ops import ELEMENTWISE_OPS, REDUCE_OPS

LOW_FLOAT_DTYPES = (dtypes.float16, dtypes.bfloat16)
# floats that autocast moves between the low type and float32; float64 is never touched (torch: "not eligible")
_ELIGIBLE_DTYPES = (dtypes.float32, dtypes.float16, dtypes.bfloat16)


class CastPolicy(enum.Enum):
  """What an op does with its floating-point tensor arguments under autocast."""
  LOWER = "lower"      # cast to the autocast dtype (matmul, linear, conv, einsum, attention); result in that dtype
  FLOAT32 = "float32"  # cast float16/bfloat16 to float32 (reductions, norms, softmax, exp/log, losses)
  NATIVE = "native"    # leave the arguments alone: run in their dtype, with autocast off inside


class _ThreadState(threading.local):
  """This thread's autocast frames (innermost last) and how many policy ops are running (autocast is off inside)."""

  def __init__(self) -> None:
    self.frames: list[tuple[bool, DType]] = []
    self.suspended = 0


_state = _ThreadState()
# how many autocast frames are entered in all threads: 0 lets every op skip the thread-local lookup
_open_frames = 0
_open_frames_lock = threading.Lock()


def get_autocast_dtype(device_type: str | None = None) -> DType | None:
  """The low dtype ops cast to in this thread now (None when autocast is off, disabled, or inside a policy op).
  `device_type` is accepted for torch's signature: one state serves every device."""
  if _open_frames == 0 or _state.suspended or not _state.frames: return None
  enabled, dtype = _state.frames[-1]
  return dtype if enabled else None


def is_autocast_enabled(device_type: str | None = None) -> bool:
  """Whether ops of this thread autocast now (torch.is_autocast_enabled; `device_type` as in get_autocast_dtype)."""
  return get_autocast_dtype() is not None


def _default_dtype(device_type: str) -> DType:
  """torch's default low type: float16 for CUDA, bfloat16 for the CPU."""
  return dtypes.bfloat16 if device_type.split(":")[0].lower() in ("cpu", "clang", "llvm", "python") else dtypes.float16


class autocast:  # noqa: N801 (torch's name: a context manager class spelled like a function)
  """Run eligible ops in a low float type inside a `with` block (or a decorated function), as torch.autocast.

  autocast(dtype=None, *, enabled=True) or autocast(device_type, dtype=None, enabled=True, cache_enabled=None):
  the first argument is the low dtype (`dtypes.bfloat16`, `dtypes.float16`, or their names) or, in torch's
  spelling, a device type ("cuda", "cpu"; ourgrad applies one op list on every device). Without a dtype it is
  torch's default for the device type: float16 for "cuda", bfloat16 for "cpu". `enabled=False` turns autocast
  off inside an enclosing autocast; blocks nest, the innermost wins. `cache_enabled` is accepted for torch's
  signature: the lazy graph shares a cast parameter between its uses within a step anyway."""

  def __init__(self, device_type: str | DType | None = None, dtype: DType | str | None = None, enabled: bool = True,
               cache_enabled: bool | None = None):
    if isinstance(device_type, DType) or (isinstance(device_type, str) and _is_dtype_name(device_type)):
      if dtype is not None:
        raise TypeError(f"autocast got two dtypes ({device_type} and {dtype}); give one: autocast(dtypes.bfloat16)")
      device_type, dtype = None, device_type
    low = dtypes.as_dtype(dtype) if dtype is not None else _default_dtype(device_type or "cuda")
    if low not in LOW_FLOAT_DTYPES:
      raise DTypeError(f"autocast takes float16 or bfloat16, got {low}; float32 is the precision outside autocast")
    self.device_type, self.dtype, self.enabled = device_type or "cuda", low, bool(enabled)

  def __enter__(self) -> autocast:
    global _open_frames
    _state.frames.append((self.enabled, self.dtype))
    with _open_frames_lock: _open_frames += 1
    return self

  def __exit__(self, *exc_info: Any) -> None:
    global _open_frames
    _state.frames.pop()
    with _open_frames_lock: _open_frames -= 1

  def __call__(self, function: Callable[..., Any]) -> Callable[..., Any]:
    """Use as a decorator: `function` runs inside this autocast block on every call."""
    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
      with autocast(self.dtype, enabled=self.enabled): return function(*args, **kwargs)
    return run


def _is_dtype_name(name: str) -> bool:
  """Whether `name` spells a dtype ("bfloat16", "float16", "half") rather than a device type ("cuda")."""
  try:
    dtypes.as_dtype(name)
    return True
  except (DTypeError, TypeError, KeyError, ValueError, AttributeError):
    return False


def _is_tensor(value: Any) -> bool:
  """Whether `value` is a Tensor (recognised by its DType and cast method: this module sits below Tensor)."""
  return isinstance(getattr(value, "dtype", None), DType) and hasattr(value, "cast")


def _cast_argument(value: Any, policy: CastPolicy, low: DType) -> Any:
  """`value` as the policy wants it: tensors cast, lists/tuples of tensors (einsum's operands) cast element-wise."""
  if isinstance(value, (list, tuple)) and value and any(_is_tensor(item) for item in value):
    return type(value)(_cast_argument(item, policy, low) for item in value)
  if not _is_tensor(value): return value
  if policy is CastPolicy.LOWER and value.dtype in _ELIGIBLE_DTYPES and value.dtype != low:
    # stored in the low type (torch's autocast writes its casts too): the product then loads low-precision buffers,
    # which tensor cores take, and reads half the bytes; the producer (a norm, a weight) writes them in its kernel
    return value.cast(low).contiguous()
  if policy is CastPolicy.LOWER and value.dtype == low: _store_computed_base(value)
  if policy is CastPolicy.FLOAT32 and value.dtype in LOW_FLOAT_DTYPES:
    # a computed low-precision input (the logits into a loss) is stored as it is and widened by the op's kernels
    store_low_precision(value.lazydata)
    return value.cast(dtypes.float32)
  return value


def _store_computed_base(value: Any) -> None:
  """Have the scheduler store the base behind a low-precision operand when it is computed elementwise here (an
  attention output cast after its reduce, an activation): the product loads it rather than recomputing it in its
  prologue, as every low-precision operand in torch's autocast is a stored tensor. A view is not copied: its base
  is stored."""
  base = getattr(getattr(value, "lazydata", None), "base", None)
  if base is not None and base.realized is None and base.op in ELEMENTWISE_OPS: base.contiguous()  # marks a base


def store_low_precision(buffer: Any) -> None:
  """Have the scheduler store `buffer` (a LazyBuffer) in its own float16/bfloat16 dtype when it is computed
  elementwise from a reduce (a product, a row sum), so a widening cast after it happens in each reader. The scheduler
  must store such a value anyway before the next reduce reads it; left to itself it stores the end of the elementwise
  chain, often the float32 cast, twice the bytes (and a float32 matmul operand instead of a low-precision one).
  torch stores every low-precision activation and gradient in its dtype: the same bytes."""
  if buffer.dtype not in LOW_FLOAT_DTYPES: return
  base = buffer.base
  if base.realized is not None or base.op not in ELEMENTWISE_OPS or not _computed_from_reduce(base): return
  base.contiguous()  # marks the base (a view is not copied)


def _computed_from_reduce(base: Any) -> bool:
  """Whether the unrealized elementwise chain that computes `base` reads a reduce not yet realized."""
  stack, seen = [base], set()
  while stack:
    node = stack.pop()
    if id(node) in seen or node.realized is not None: continue
    seen.add(id(node))
    if node.op in REDUCE_OPS: return True
    if node.op in ELEMENTWISE_OPS: stack.extend(src.base for src in node.srcs)
  return False


Op = TypeVar("Op", bound=Callable[..., Any])


def autocast_op(policy: CastPolicy) -> Callable[[Op], Op]:
  """Decorate a Tensor op (or a layer's forward) with the cast `policy` it follows under autocast. Outside
  autocast the op is called as is (one global read). An explicit `dtype=` argument opts the call out, as in torch."""
  def decorate(op: Op) -> Op:
    @functools.wraps(op)
    def run(*args: Any, **kwargs: Any) -> Any:
      if _open_frames == 0: return op(*args, **kwargs)
      low = get_autocast_dtype()
      if low is None or kwargs.get("dtype") is not None: return op(*args, **kwargs)
      if policy is not CastPolicy.NATIVE:
        args = tuple(_cast_argument(arg, policy, low) for arg in args)
        kwargs = {key: _cast_argument(value, policy, low) for key, value in kwargs.items()}
      _state.suspended += 1
      try:
        return op(*args, **kwargs)
      finally:
        _state.suspended -= 1
    run.autocast_policy = policy  # type: ignore[attr-defined]  (tests read which list an op is on)
    return run  # type: ignore[return-value]
  return decorate


def autocast_policy_of(op: Callable[..., Any]) -> CastPolicy | None:
  """The cast policy `op` follows under autocast (None: it runs in its inputs' dtypes, promoted as usual)."""
  return getattr(op, "autocast_policy", None)


class suspend_autocast:  # noqa: N801 (a context manager, spelled as torch's autocast(enabled=False))
  """Turn autocast off in this thread for a block, whatever frames are open: what optimizers' steps run under (their
  math is on float32 master weights and must not be cast)."""

  def __enter__(self) -> None:
    _state.suspended += 1

  def __exit__(self, *exc_info: Any) -> None:
    _state.suspended -= 1
