"""torch.nn.init: fill a tensor in place with values for a weight initialization scheme.

Each function writes through `Tensor.assign` (the tensor keeps its identity, so a module or optimizer holding it
sees the new values), under no_grad, and returns the tensor. The random draws come from ourgrad's generator
(`ourgrad.manual_seed`), so the numbers differ from PyTorch's for the same seed; the distributions (bounds, standard
deviations from fan-in/fan-out and gain) are PyTorch's.
"""
from __future__ import annotations

import math

import numpy as np

from ourgrad.errors import ShapeError
from ourgrad.helpers import prod
from ourgrad.tensor import Tensor, no_grad


def _fill(tensor: Tensor, values: Tensor) -> Tensor:
  with no_grad(): tensor.assign(values.cast(tensor.dtype).to(tensor.device).detach())
  return tensor


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
  """The recommended gain for a nonlinearity, as torch.nn.init.calculate_gain."""
  linear = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
            "sigmoid")
  if nonlinearity in linear: return 1.0
  if nonlinearity == "tanh": return 5.0 / 3
  if nonlinearity == "relu": return math.sqrt(2.0)
  if nonlinearity == "leaky_relu":
    slope = 0.01 if param is None else param
    return math.sqrt(2.0 / (1 + slope ** 2))
  if nonlinearity == "selu": return 3.0 / 4
  raise ValueError(f"unsupported nonlinearity {nonlinearity!r}")


def _calculate_fan_in_and_fan_out(tensor: Tensor) -> tuple[int, int]:
  """(fan_in, fan_out) as PyTorch: dimension 1 and 0 sizes times the receptive field (the product of the rest)."""
  if tensor.ndim < 2:
    raise ShapeError(f"fan in and fan out need a tensor of at least 2 dimensions, got shape {tensor.shape}")
  receptive_field = prod(tensor.shape[2:])
  return tensor.shape[1] * receptive_field, tensor.shape[0] * receptive_field


def _fan(tensor: Tensor, mode: str) -> int:
  if mode not in ("fan_in", "fan_out"): raise ValueError(f"mode is 'fan_in' or 'fan_out', got {mode!r}")
  fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
  return fan_in if mode == "fan_in" else fan_out


def uniform_(tensor: Tensor, a: float = 0.0, b: float = 1.0) -> Tensor:
  """Values uniform in [a, b)."""
  return _fill(tensor, Tensor.uniform(*tensor.shape, low=a, high=b))


def normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0) -> Tensor:
  """Values from N(mean, std^2)."""
  return _fill(tensor, Tensor.normal(*tensor.shape, mean=mean, std=std))


def trunc_normal_(tensor: Tensor, mean: float = 0.0, std: float = 1.0, a: float = -2.0, b: float = 2.0) -> Tensor:
  """Values from N(mean, std^2) restricted to [a, b]: draws outside are drawn again (on the host, once at
  initialization, from ourgrad's generator)."""
  values = Tensor._rng.normal(mean, std, tensor.shape)
  outside = (values < a) | (values > b)
  while outside.any():
    values[outside] = Tensor._rng.normal(mean, std, int(outside.sum()))
    outside = (values < a) | (values > b)
  return _fill(tensor, Tensor(values.astype(np.float32)))


def constant_(tensor: Tensor, val: float) -> Tensor:
  """Every value set to `val`."""
  return _fill(tensor, tensor.full_like(val))


def zeros_(tensor: Tensor) -> Tensor:
  """Every value set to 0."""
  return constant_(tensor, 0.0)


def ones_(tensor: Tensor) -> Tensor:
  """Every value set to 1."""
  return constant_(tensor, 1.0)


def eye_(tensor: Tensor) -> Tensor:
  """A 2-d tensor set to the identity matrix."""
  if tensor.ndim != 2: raise ShapeError(f"eye_ needs a 2-d tensor, got shape {tensor.shape}")
  return _fill(tensor, Tensor.eye(*tensor.shape))


def xavier_uniform_(tensor: Tensor, gain: float = 1.0) -> Tensor:
  """Glorot uniform: U(-a, a) with a = gain * sqrt(6 / (fan_in + fan_out))."""
  fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
  bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
  return uniform_(tensor, -bound, bound)


def xavier_normal_(tensor: Tensor, gain: float = 1.0) -> Tensor:
  """Glorot normal: N(0, std^2) with std = gain * sqrt(2 / (fan_in + fan_out))."""
  fan_in, fan_out = _calculate_fan_in_and_fan_out(tensor)
  return normal_(tensor, 0.0, gain * math.sqrt(2.0 / (fan_in + fan_out)))


def kaiming_uniform_(tensor: Tensor, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Tensor:
  """He uniform: U(-b, b) with b = gain * sqrt(3 / fan), gain = calculate_gain(nonlinearity, a)."""
  bound = calculate_gain(nonlinearity, a) * math.sqrt(3.0 / _fan(tensor, mode))
  return uniform_(tensor, -bound, bound)


def kaiming_normal_(tensor: Tensor, a: float = 0.0, mode: str = "fan_in", nonlinearity: str = "leaky_relu") -> Tensor:
  """He normal: N(0, std^2) with std = gain / sqrt(fan), gain = calculate_gain(nonlinearity, a)."""
  return normal_(tensor, 0.0, calculate_gain(nonlinearity, a) / math.sqrt(_fan(tensor, mode)))


__all__ = ["calculate_gain", "uniform_", "normal_", "trunc_normal_", "constant_", "zeros_", "ones_", "eye_",
           "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_"]
