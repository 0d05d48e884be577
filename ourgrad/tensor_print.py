"""How a Tensor prints: PyTorch's layout, `tensor([[1., 2.], [3., 4.]])`, built on numpy's array2string.

PyTorch's choices, kept here: floats whose values are all whole print as `1., 2.`; other floats with 4 decimals,
in scientific notation when the non-zero magnitudes span more than 1000x or reach 1e8 or go below 1e-4 (numpy's rule
is the same); more than 1000 elements print the 3 first and last items of each dimension around "..."; lines wrap at
80 columns. After the values come the dtype (unless it is the default float, the default int or bool), the device
(unless it is the default device), and `requires_grad=True` for a leaf or `grad_fn=<...>` for a computed tensor.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ourgrad.device import Device
from ourgrad.dtype import dtypes
from ourgrad.engine.exec_item import jit_recording
from ourgrad.shape.symbolic import is_symbolic

if TYPE_CHECKING:
  from ourgrad.tensor import Tensor

PREFIX = "tensor("
THRESHOLD, EDGE_ITEMS, LINE_WIDTH, PRECISION = 1000, 3, 80, 4  # torch.set_printoptions' defaults


def _shown(values: np.ndarray) -> np.ndarray:
  """The values that appear in the print: all of them, or the edge items of each dimension when summarized."""
  if values.size <= THRESHOLD: return values
  for axis, size in enumerate(values.shape):
    if size > 2 * EDGE_ITEMS:
      values = np.take(values, [*range(EDGE_ITEMS), *range(size - EDGE_ITEMS, size)], axis=axis)
  return values


def _float_format(shown: np.ndarray) -> str:
  """PyTorch's choice of format for these float values: scientific, whole numbers ("1."), or 4 decimals."""
  finite = np.abs(shown[np.isfinite(shown)].astype(np.float64))
  nonzero = finite[finite != 0]
  if nonzero.size and (nonzero.max() / nonzero.min() > 1000.0 or nonzero.max() > 1e8 or nonzero.min() < 1e-4):
    return f"{{:.{PRECISION}e}}"
  return "{:.0f}." if np.all(finite == np.round(finite)) else f"{{:.{PRECISION}f}}"


def _torch_ellipsis(text: str) -> str:
  """numpy writes a summarized row as "a, ..., b"; PyTorch as "a,  ..., b"."""
  return text.replace(", ...,", ",  ...,")


def format_values(values: np.ndarray) -> str:
  """The values of `values` as PyTorch prints them inside "tensor(...)" (continuation lines indented to match)."""
  if values.size == 0: return "[]"
  options = dict(separator=", ", prefix=PREFIX, threshold=THRESHOLD, edgeitems=EDGE_ITEMS, max_line_width=LINE_WIDTH)
  if values.dtype.kind != "f": return _torch_ellipsis(np.array2string(values, **options))  # type: ignore[arg-type]
  shown = _shown(values)
  pattern = _float_format(shown)
  # every number right-aligned to the widest shown one, as PyTorch pads ("-1.5000,  2.0000")
  def text(value: float) -> str: return pattern.format(value) if np.isfinite(value) else str(value).lower()
  # the width comes from the finite values; nan and inf are padded to it but do not widen it (as PyTorch)
  width = max((len(text(value)) for value in shown.flat if np.isfinite(value)), default=0)
  return _torch_ellipsis(np.array2string(values, formatter={"float_kind": lambda value: text(value).rjust(width)},
                                         **options))  # type: ignore[arg-type]


def _suffixes(tensor: Tensor) -> list[str]:
  """The ", name=value" parts after the values: size of an empty tensor, dtype, device, autograd."""
  parts: list[str] = []
  if tensor.numel() == 0 and tensor.shape != (0,): parts.append(f"size={tensor.shape}")
  if tensor.dtype not in (dtypes.default_float, dtypes.default_int, dtypes.bool):
    parts.append(f"dtype={tensor.dtype!r}")
  if tensor.device != Device.DEFAULT: parts.append(f"device={tensor.device!r}")
  if tensor._ctx is not None: parts.append(f"grad_fn=<{type(tensor._ctx).__name__}Backward>")
  elif tensor.requires_grad: parts.append("requires_grad=True")
  return parts


def format_tensor(tensor: Tensor) -> str:
  """`repr(tensor)`: the values (realized now) and the suffixes; the shape only where values cannot be read (inside
  a TinyJit capture, or a symbolic shape)."""
  if jit_recording.active or any(is_symbolic(size) for size in tensor.shape):
    return f"<Tensor shape={tensor.shape} dtype={tensor.dtype!r} device={tensor.device}>"
  text = PREFIX + format_values(tensor.numpy())
  return ", ".join([text, *_suffixes(tensor)]) + ")"
