"""Renderers turn a kernel's UOps into source text for one language. See cstyle.py."""
from __future__ import annotations

from ourgrad.codegen.uops import UOp


class Renderer:
  """What the optimizer needs to know about the target, and `render(name, uops) -> source`."""
  device: str = ""
  has_threads: bool = False       # GPU-style thread indices (SPECIAL) instead of loops for global axes
  has_local: bool = False         # workgroup/shared memory
  max_upcast_lanes: int = 256

  def render(self, name: str, uops: list[UOp]) -> str: raise NotImplementedError
