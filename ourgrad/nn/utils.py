"""torch.nn.utils's gradient clipping: `clip_grad_norm_` and `clip_grad_value_`.

Both rescale the gradients lazily (each `.grad` becomes a new lazy tensor), so the clipping fuses into the
optimizer's update kernels; the returned total norm is a lazy 0-d Tensor too (read it with `.item()`).
"""
from __future__ import annotations

from typing import Iterable

from ourgrad.errors import AutogradError
from ourgrad.tensor import Tensor, no_grad


def _with_grads(parameters: Tensor | Iterable[Tensor]) -> list[Tensor]:
  params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
  return [param for param in params if param.grad is not None]


def clip_grad_norm_(parameters: Tensor | Iterable[Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> Tensor:
  """Scale the gradients of `parameters` so that their total `norm_type`-norm (over all of them, as if
  concatenated) is at most `max_norm`; returns the total norm before clipping. As PyTorch: the scale is
  max_norm / (total + 1e-6), applied only when below 1. `error_if_nonfinite` raises AutogradError on a nan/inf
  norm (it reads the norm, so it realizes it)."""
  params = _with_grads(parameters)
  if not params: return Tensor(0.0)
  with no_grad():
    grads = [param.grad.detach() for param in params]  # type: ignore[union-attr]
    if norm_type == float("inf"):
      total = Tensor.stack([grad.abs().max() for grad in grads]).max()
    else:
      total = Tensor.stack([(grad.abs() ** norm_type).sum() for grad in grads]).sum() ** (1.0 / norm_type)
    if error_if_nonfinite and not total.isfinite().item():
      raise AutogradError(f"the total norm of order {norm_type} of the gradients is {total.item()}; pass "
                          f"error_if_nonfinite=False to clip anyway")
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for param, grad in zip(params, grads): param.grad = grad * scale.cast(grad.dtype)
  return total


def clip_grad_value_(parameters: Tensor | Iterable[Tensor], clip_value: float, foreach: bool | None = None) -> None:
  """Clamp every gradient element of `parameters` into [-clip_value, clip_value]."""
  with no_grad():
    for param in _with_grads(parameters): param.grad = param.grad.clamp(-clip_value, clip_value)  # type: ignore


__all__ = ["clip_grad_norm_", "clip_grad_value_"]
