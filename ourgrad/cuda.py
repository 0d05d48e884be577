"""torch.cuda's most used calls, so `device = "cuda" if torch.cuda.is_available() else "cpu"` runs unchanged.

ourgrad names devices with strings ("CUDA", "CUDA:1", "CPU"); these functions only answer about the CUDA device and
wait for it. Random numbers have one seed for every device (`manual_seed` is ourgrad.manual_seed).
"""
from __future__ import annotations

from ourgrad.device import Device
from ourgrad.errors import DeviceError
from ourgrad.tensor import Tensor


def is_available() -> bool:
  """Whether the CUDA device opens here (a GPU, its driver and cuda-python present)."""
  try:
    Device["CUDA"]
  except (DeviceError, ImportError, OSError):
    return False
  return True


def synchronize(device: str | int | None = None) -> None:
  """Wait until the CUDA device (or `device`, a name or an index) has finished its queued work."""
  name = f"CUDA:{device}" if isinstance(device, int) else (device or "CUDA")
  Device[Device.canonicalize(name)].synchronize()


manual_seed = manual_seed_all = Tensor.manual_seed  # one generator seed for every device

__all__ = ["is_available", "synchronize", "manual_seed", "manual_seed_all"]
