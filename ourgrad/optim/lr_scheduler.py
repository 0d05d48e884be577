"""Learning-rate schedulers with torch.optim.lr_scheduler's names, arguments and values.

A scheduler writes each parameter group's "lr" (`optimizer.param_groups[i]["lr"] = value`), which lands in the
optimizer's learning-rate buffer: the update kernels read it from memory, so a schedule never compiles anything.
As in PyTorch, constructing a scheduler sets the lr of step 0 and records each group's "initial_lr"; call
`scheduler.step()` once per epoch (or per batch) after `optimizer.step()`. Each scheduler computes the lr of step
`last_epoch` in closed form from the groups' initial lrs (`lr_at`), which agrees with PyTorch's recursive updates to
rounding.
"""
from __future__ import annotations

import bisect
import math
from typing import Any, Callable, Sequence

from ourgrad.nn.optim import Optimizer


class LRScheduler:
  """Base class: subclasses define `lr_at(base_lr, step)`. `get_last_lr()` is the list of lrs last set."""

  def __init__(self, optimizer: Optimizer, last_epoch: int = -1):
    if not isinstance(optimizer, Optimizer):
      raise TypeError(f"{type(self).__name__} needs an ourgrad optimizer, got {type(optimizer).__name__}")
    self.optimizer = optimizer
    for group in optimizer.param_groups:
      if last_epoch == -1: group.setdefault("initial_lr", group["lr"])
      elif "initial_lr" not in group:
        raise KeyError(f"resuming {type(self).__name__} at last_epoch={last_epoch} needs 'initial_lr' in every group")
    self.base_lrs: list[float] = [group["initial_lr"] for group in optimizer.param_groups]
    self.last_epoch = last_epoch
    self._last_lr: list[float] = []
    self.step()

  def lr_at(self, base_lr: float, step: int) -> float:
    """The learning rate of a group whose initial lr is `base_lr`, at step `step` (0 at construction)."""
    raise NotImplementedError

  def lrs_at(self, step: int) -> list[float]:
    """The lr of every group at step `step`."""
    return [self.lr_at(base_lr, step) for base_lr in self.base_lrs]

  def get_lr(self) -> list[float]:
    """The lr of every group at the current step."""
    return self.lrs_at(self.last_epoch)

  def get_last_lr(self) -> list[float]:
    """The lrs the last step() set, one per parameter group."""
    return list(self._last_lr)

  def step(self) -> None:
    """Advance one step (epoch) and set every group's lr."""
    self.last_epoch += 1
    self._last_lr = self.get_lr()
    for group, lr in zip(self.optimizer.param_groups, self._last_lr): group["lr"] = lr

  def state_dict(self) -> dict[str, Any]:
    """The scheduler's state (not the optimizer): last_epoch, base_lrs and the last lrs."""
    return {key: value for key, value in vars(self).items() if key != "optimizer" and not callable(value)}

  def load_state_dict(self, state_dict: dict[str, Any]) -> None:
    """Restore what `state_dict()` returned."""
    vars(self).update(state_dict)


class StepLR(LRScheduler):
  """lr = initial_lr * gamma ** (step // step_size)."""

  def __init__(self, optimizer: Optimizer, step_size: int, gamma: float = 0.1, last_epoch: int = -1):
    self.step_size, self.gamma = step_size, gamma
    super().__init__(optimizer, last_epoch)

  def lr_at(self, base_lr: float, step: int) -> float: return base_lr * self.gamma ** (step // self.step_size)


class MultiStepLR(LRScheduler):
  """lr = initial_lr * gamma ** (the number of milestones <= step)."""

  def __init__(self, optimizer: Optimizer, milestones: Sequence[int], gamma: float = 0.1, last_epoch: int = -1):
    self.milestones, self.gamma = sorted(milestones), gamma
    super().__init__(optimizer, last_epoch)

  def lr_at(self, base_lr: float, step: int) -> float:
    return base_lr * self.gamma ** bisect.bisect_right(self.milestones, step)


class ExponentialLR(LRScheduler):
  """lr = initial_lr * gamma ** step."""

  def __init__(self, optimizer: Optimizer, gamma: float, last_epoch: int = -1):
    self.gamma = gamma
    super().__init__(optimizer, last_epoch)

  def lr_at(self, base_lr: float, step: int) -> float: return base_lr * self.gamma ** step


class CosineAnnealingLR(LRScheduler):
  """lr = eta_min + (initial_lr - eta_min) * (1 + cos(pi * step / T_max)) / 2 (half a cosine over T_max steps)."""

  def __init__(self, optimizer: Optimizer, T_max: int, eta_min: float = 0.0, last_epoch: int = -1):  # noqa: N803
    if T_max <= 0: raise ValueError(f"CosineAnnealingLR needs T_max > 0, got {T_max}")
    self.T_max, self.eta_min = T_max, eta_min  # noqa: N815 (PyTorch's attribute names)
    super().__init__(optimizer, last_epoch)

  def lr_at(self, base_lr: float, step: int) -> float:
    return self.eta_min + (base_lr - self.eta_min) * (1 + math.cos(math.pi * step / self.T_max)) / 2


class LinearLR(LRScheduler):
  """A linear warm-up (or decay): the factor goes from start_factor to end_factor over total_iters steps, then
  stays: lr = initial_lr * (start + (end - start) * min(step, total_iters) / total_iters)."""

  def __init__(self, optimizer: Optimizer, start_factor: float = 1.0 / 3, end_factor: float = 1.0,
               total_iters: int = 5, last_epoch: int = -1):
    if not 0 < start_factor <= 1 or not 0 <= end_factor <= 1:
      raise ValueError(f"LinearLR needs 0 < start_factor <= 1 and 0 <= end_factor <= 1, got {start_factor}, "
                       f"{end_factor}")
    self.start_factor, self.end_factor, self.total_iters = start_factor, end_factor, total_iters
    super().__init__(optimizer, last_epoch)

  def lr_at(self, base_lr: float, step: int) -> float:
    progress = min(step, self.total_iters) / self.total_iters if self.total_iters else 1.0
    return base_lr * (self.start_factor + (self.end_factor - self.start_factor) * progress)


class LambdaLR(LRScheduler):
  """lr = initial_lr * lr_lambda(step); one function for every group, or a list with one per group."""

  def __init__(self, optimizer: Optimizer, lr_lambda: Callable[[int], float] | Sequence[Callable[[int], float]],
               last_epoch: int = -1):
    count = len(optimizer.param_groups)
    self.lr_lambdas = list(lr_lambda) if isinstance(lr_lambda, (list, tuple)) else [lr_lambda] * count
    if len(self.lr_lambdas) != count:
      raise ValueError(f"LambdaLR got {len(self.lr_lambdas)} functions for {count} parameter groups")
    super().__init__(optimizer, last_epoch)

  def lrs_at(self, step: int) -> list[float]:
    return [base_lr * function(step) for base_lr, function in zip(self.base_lrs, self.lr_lambdas)]


class SequentialLR(LRScheduler):
  """One scheduler after another: `schedulers[i]` runs from milestones[i-1] on, counting its steps from 0 (a warm-up
  LinearLR, then CosineAnnealingLR)."""

  def __init__(self, optimizer: Optimizer, schedulers: Sequence[LRScheduler], milestones: Sequence[int],
               last_epoch: int = -1):
    if len(milestones) != len(schedulers) - 1:
      raise ValueError(f"SequentialLR needs {len(schedulers) - 1} milestones for {len(schedulers)} schedulers, "
                       f"got {len(milestones)}")
    self.schedulers, self.milestones = list(schedulers), list(milestones)
    super().__init__(optimizer, last_epoch)

  def lrs_at(self, step: int) -> list[float]:
    index = bisect.bisect_right(self.milestones, step)
    start = self.milestones[index - 1] if index else 0
    return self.schedulers[index].lrs_at(step - start)


class OneCycleLR(LRScheduler):
  """The 1cycle policy (lr only; momentum is not cycled): from max_lr / div_factor up to max_lr over the first
  pct_start of total_steps, then down to initial / final_div_factor, by half cosines (or linearly)."""

  def __init__(self, optimizer: Optimizer, max_lr: float | Sequence[float], total_steps: int | None = None,
               epochs: int | None = None, steps_per_epoch: int | None = None, pct_start: float = 0.3,
               anneal_strategy: str = "cos", div_factor: float = 25.0, final_div_factor: float = 1e4,
               three_phase: bool = False, last_epoch: int = -1, **ignored: Any):
    if total_steps is None:
      if epochs is None or steps_per_epoch is None:
        raise ValueError("OneCycleLR needs total_steps, or epochs and steps_per_epoch")
      total_steps = epochs * steps_per_epoch
    if anneal_strategy not in ("cos", "linear"): raise ValueError(f"anneal_strategy is 'cos' or 'linear', got "
                                                                 f"{anneal_strategy!r}")
    count = len(optimizer.param_groups)
    max_lrs = list(max_lr) if isinstance(max_lr, (list, tuple)) else [max_lr] * count
    self.total_steps, self.anneal_strategy = total_steps, anneal_strategy
    for group, group_max in zip(optimizer.param_groups, max_lrs):
      # PyTorch keeps these in the groups: initial_lr is where the cycle starts, not the optimizer's lr
      group["initial_lr"], group["max_lr"] = group_max / div_factor, group_max
      group["min_lr"] = group["initial_lr"] / final_div_factor
    end_up = float(pct_start * total_steps) - 1
    if three_phase:
      self.phases = [(end_up, "initial_lr", "max_lr"), (2 * end_up, "max_lr", "initial_lr"),
                     (total_steps - 1, "initial_lr", "min_lr")]
    else:
      self.phases = [(end_up, "initial_lr", "max_lr"), (total_steps - 1, "max_lr", "min_lr")]
    super().__init__(optimizer, last_epoch)

  def _anneal(self, start: float, end: float, fraction: float) -> float:
    if self.anneal_strategy == "linear": return (end - start) * fraction + start
    return end + (start - end) / 2 * (math.cos(math.pi * fraction) + 1)

  def lrs_at(self, step: int) -> list[float]:
    if step >= self.total_steps:
      raise ValueError(f"OneCycleLR stepped {step + 1} times for total_steps={self.total_steps}")
    lrs = []
    for group in self.optimizer.param_groups:
      phase_start = 0.0
      for index, (phase_end, start_key, end_key) in enumerate(self.phases):
        if step <= phase_end or index == len(self.phases) - 1:
          lrs.append(self._anneal(group[start_key], group[end_key], (step - phase_start) / (phase_end - phase_start)))
          break
        phase_start = phase_end
    return lrs


__all__ = ["LRScheduler", "StepLR", "MultiStepLR", "ExponentialLR", "CosineAnnealingLR", "LinearLR", "LambdaLR",
           "SequentialLR", "OneCycleLR"]
