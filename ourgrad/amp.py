"""torch.amp's names: `autocast` (ourgrad/mixed_precision.py) and `GradScaler`, the loss scaling float16 training needs.

    scaler = ourgrad.amp.GradScaler()
    with ourgrad.autocast(dtypes.float16):
      loss = model(x).cross_entropy(y)
    scaler.scale(loss).backward()      # gradients of loss * scale: small float16 gradients stay above the underflow
    scaler.step(optimizer)             # unscale the float32 gradients; skip the step if one is inf or nan
    scaler.update()                    # halve the scale after a skipped step, double it after growth_interval good ones

bfloat16 has float32's exponent range and needs no scaler. The scale lives in a realized device buffer (changing it
compiles nothing); `step` reads one number back from the device to decide whether to skip, as torch's does, so call
it outside a TinyJit (jit the forward and backward).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ourgrad.dtype import dtypes
from ourgrad.mixed_precision import autocast, get_autocast_dtype, is_autocast_enabled
from ourgrad.tensor import Tensor, no_grad

__all__ = ["autocast", "GradScaler", "get_autocast_dtype", "is_autocast_enabled"]

# per-optimizer progress within one iteration, as torch's OptState
_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"


class GradScaler:
  """Dynamic loss scaling, as torch.amp.GradScaler: `scale(loss)` multiplies by the scale, `unscale_(opt)` divides
  the optimizer's gradients by it (in place) and notes whether any is inf/nan, `step(opt)` steps unless one was,
  and `update()` moves the scale: times backoff_factor after a skipped step, times growth_factor after
  growth_interval steps in a row without inf/nan. `enabled=False` makes every call a pass-through. `device` is
  accepted for torch's signature (the scale lives where the loss is)."""

  def __init__(self, device: str = "cuda", init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
               backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True):
    if growth_factor <= 1.0: raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
    if not 0.0 < backoff_factor < 1.0: raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
    if growth_interval <= 0: raise ValueError(f"growth_interval must be > 0, got {growth_interval}")
    self.device, self._enabled = device, bool(enabled)
    self._scale_value, self._growth_factor, self._backoff_factor = float(init_scale), growth_factor, backoff_factor
    self._growth_interval, self._growth_tracker = growth_interval, 0
    self._scale_buffers: dict[Any, Tensor] = {}  # device -> realized 0-d float32 scale
    self._states: dict[int, str] = {}            # id(optimizer) -> _UNSCALED / _STEPPED this iteration
    self._found_inf: dict[int, Tensor] = {}      # id(optimizer) -> 0-d bool: an inf/nan among its gradients

  # ---------------------------------------------------------------- scaling

  def _scale_on(self, device: Any) -> Tensor:
    """The scale as a realized float32 buffer on `device` (one per device, written in place when it changes)."""
    if device not in self._scale_buffers:
      self._scale_buffers[device] = Tensor(np.array(self._scale_value, dtype=np.float32), device=device,
                                           dtype=dtypes.float32).realize()
    return self._scale_buffers[device]

  def scale(self, outputs: Any) -> Any:
    """`outputs` (a Tensor, or a list/tuple of them) times the scale, each in its own dtype."""
    if not self._enabled: return outputs
    if isinstance(outputs, Tensor): return outputs * self._scale_on(outputs.device).cast(outputs.dtype)
    if isinstance(outputs, (list, tuple)): return type(outputs)(self.scale(output) for output in outputs)
    raise TypeError(f"GradScaler.scale takes a Tensor or a list/tuple of them, got {type(outputs).__name__}")

  def unscale_(self, optimizer: Any) -> None:
    """Divide the gradients of `optimizer`'s parameters by the scale, in place, and note whether any holds inf/nan.
    Call it before clipping gradients; `step` calls it when you did not. Once per optimizer per iteration."""
    if not self._enabled: return
    state = self._states.get(id(optimizer), _READY)
    if state == _UNSCALED: raise RuntimeError("unscale_() has already been called on this optimizer since the last "
                                              "update()")
    if state == _STEPPED: raise RuntimeError("unscale_() is being called after step()")
    params = [param for param in optimizer.params if param.grad is not None]
    with no_grad():
      flags = []
      for param in params:
        inverse = 1.0 / self._scale_on(param.grad.device)  # float32: the scale itself may not fit a float16
        param.grad = (param.grad.float() * inverse).cast(param.grad.dtype)
        flags.append((~param.grad.isfinite()).any())
      found = Tensor.stack(*flags).any() if flags else Tensor(False)
      Tensor.realize_all(found, *[param.grad for param in params])
    self._found_inf[id(optimizer)] = found
    self._states[id(optimizer)] = _UNSCALED

  def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
    """Unscale `optimizer`'s gradients (if `unscale_` was not called) and call `optimizer.step(*args, **kwargs)`
    unless one of them holds inf or nan; returns what step returned, or None for a skipped step."""
    if not self._enabled: return optimizer.step(*args, **kwargs)
    if self._states.get(id(optimizer)) == _STEPPED:
      raise RuntimeError("step() has already been called since the last update()")
    if self._states.get(id(optimizer), _READY) == _READY: self.unscale_(optimizer)
    self._states[id(optimizer)] = _STEPPED
    if bool(self._found_inf[id(optimizer)].item()): return None
    return optimizer.step(*args, **kwargs)

  def update(self, new_scale: float | Tensor | None = None) -> None:
    """Set the scale for the next iteration: `new_scale` if given, otherwise backed off after an inf/nan in any
    optimizer stepped since the last update, or grown after growth_interval clean iterations."""
    if not self._enabled: return
    if new_scale is not None:
      self._set_scale(float(new_scale.item() if isinstance(new_scale, Tensor) else new_scale))
    else:
      if not self._found_inf: raise RuntimeError("no inf checks were recorded prior to update(): call "
                                                 "scaler.step(optimizer) (or unscale_) first")
      found = any(bool(flag.item()) for flag in self._found_inf.values())
      if found:
        self._growth_tracker = 0
        self._set_scale(self._scale_value * self._backoff_factor)
      else:
        self._growth_tracker += 1
        if self._growth_tracker == self._growth_interval:
          self._growth_tracker = 0
          self._set_scale(self._scale_value * self._growth_factor)
    self._states.clear()
    self._found_inf.clear()

  def _set_scale(self, value: float) -> None:
    # written into the existing buffers (no new kernel: the scaled loss reads the scale from memory)
    self._scale_value = value
    for buffer in self._scale_buffers.values():
      buffer.lazydata.base.realized.copyin(memoryview(np.array([value], dtype=np.float32)).cast("B"))

  # ---------------------------------------------------------------- torch's accessors

  def get_scale(self) -> float:
    """The current scale (1.0 when disabled)."""
    return self._scale_value if self._enabled else 1.0

  def is_enabled(self) -> bool:
    """Whether scaling is on."""
    return self._enabled

  def get_growth_factor(self) -> float: return self._growth_factor
  def set_growth_factor(self, value: float) -> None: self._growth_factor = value
  def get_backoff_factor(self) -> float: return self._backoff_factor
  def set_backoff_factor(self, value: float) -> None: self._backoff_factor = value
  def get_growth_interval(self) -> int: return self._growth_interval
  def set_growth_interval(self, value: int) -> None: self._growth_interval = value

  def state_dict(self) -> dict[str, Any]:
    """torch's keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker (empty when disabled)."""
    if not self._enabled: return {}
    return {"scale": self._scale_value, "growth_factor": self._growth_factor, "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval, "_growth_tracker": self._growth_tracker}

  def load_state_dict(self, state_dict: dict[str, Any]) -> None:
    """Restore what state_dict() returned."""
    if not self._enabled: return
    if not state_dict: raise RuntimeError("the state_dict passed to GradScaler.load_state_dict is empty: it came "
                                          "from a disabled scaler")
    self._growth_factor, self._backoff_factor = state_dict["growth_factor"], state_dict["backoff_factor"]
    self._growth_interval, self._growth_tracker = state_dict["growth_interval"], state_dict["_growth_tracker"]
    self._set_scale(float(state_dict["scale"]))
