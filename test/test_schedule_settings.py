"""The schedule cache's key holds every setting the scheduler's decisions read (engine/schedule_cache.py _SETTINGS):
a process that changes one (ROW_KERNELS, ELEMENT_REDUCES) gets a schedule made under the new value, with no
clear_caches() in between."""
import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.device import Device
from ourgrad.engine import kernel_walk, multi_output, operand_staging, packing, ride_along, schedule, schedule_cache, \
  split_fusion, store_or_recompute
from ourgrad.helpers import DEBUG, RUNNER_CACHE_SIZE, EnvVar, clear_caches
from ourgrad.ops import Ops
from ourgrad.runtime.ops_python import PythonRenderer

# the modules whose code makes the scheduler's decisions, and the settings they read that change none (printing,
# cache sizes)
SCHEDULER_MODULES = (schedule, kernel_walk, packing, split_fusion, ride_along, multi_output, store_or_recompute,
                     operand_staging)
NOT_DECISIONS = (DEBUG, RUNNER_CACHE_SIZE)


def test_every_setting_the_scheduler_reads_is_in_the_cache_key():
  keyed = {id(variable) for variable in schedule_cache._SETTINGS.variables}
  for module in SCHEDULER_MODULES:
    read = [value for value in vars(module).values() if isinstance(value, EnvVar)]
    missing = [variable.name for variable in read if id(variable) not in keyed and
               not any(variable is other for other in NOT_DECISIONS)]
    assert not missing, f"{module.__name__} reads {missing}, which the schedule cache's key does not hold"


def _kernels(out: Tensor) -> int:
  return sum(item.ast.op is not Ops.COPY for item in schedule_cache.schedule([out.lazydata]))


def test_row_kernels_setting_changes_a_cached_schedule(monkeypatch: pytest.MonkeyPatch):
  data = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
  counts = []
  for setting in ("1", "0", "1"):
    monkeypatch.setenv("ROW_KERNELS", setting)
    counts.append(_kernels(Tensor(data).softmax(-1)))
  assert counts == [1, 3, 1]   # softmax: one row kernel, else max, sum and the division


def test_element_reduces_setting_changes_a_cached_schedule(monkeypatch: pytest.MonkeyPatch):
  """Decode attention's scores (a short reduce per element of the softmax row) staged in the row kernel, on the
  PYTHON device lowering as for CUDA, then a kernel of their own once ELEMENT_REDUCES is 0."""
  monkeypatch.setattr(Device["PYTHON"], "renderer", PythonRenderer("CUDA"))
  clear_caches()   # schedules made for the device's own renderer
  rng = np.random.default_rng(1)
  q, keys, values = (rng.standard_normal(shape).astype(np.float32) for shape in ((2, 1, 16), (2, 16, 24), (2, 24, 16)))

  def attention() -> Tensor:
    scores = Tensor(q, device="PYTHON") @ Tensor(keys, device="PYTHON")
    return scores.softmax(-1) @ Tensor(values, device="PYTHON")
  counts = []
  try:
    for setting in ("1", "0"):
      monkeypatch.setenv("ELEMENT_REDUCES", setting)
      counts.append(_kernels(attention()))
  finally:
    clear_caches()
  assert counts[0] < counts[1], counts
