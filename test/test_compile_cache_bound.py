"""When a process checks the on-disk compile cache's size bound (ourgrad/device.py): at its PRUNE_EVERY_WRITES-th
write, then after each 1/PRUNE_BOUND_FRACTION of the bound it writes. A check walks the whole cache folder, so many
small entries (CI's ~31k: kernels, NVRTC check marks) must not walk it every few writes; a bound lowered below what a
process writes must still be kept. (What a check deletes: test_reliability.py's test_disk_compile_cache_is_bounded.)
"""
from __future__ import annotations

import pytest

from ourgrad import device as device_module
from ourgrad.device import Compiler


class _Entries(Compiler):
  cache_key = "test_compile_cache_bound"


@pytest.fixture
def walks(tmp_path, monkeypatch) -> list[int]:
  """A fresh cache folder and write count for this process; one entry (the bound asked for) per folder walk."""
  monkeypatch.setenv("OURGRAD_CACHE_DIR", str(tmp_path))
  monkeypatch.setattr(device_module, "_cache_writes", 0)
  monkeypatch.setattr(device_module, "_bytes_since_check", 0)
  calls: list[int] = []
  original = device_module.prune_compile_cache

  def counting(max_bytes: int | None = None) -> int:
    calls.append(max_bytes)
    return original(max_bytes)

  monkeypatch.setattr(device_module, "prune_compile_cache", counting)
  return calls


def _write(count: int, size: int) -> None:
  compiler = _Entries()
  for number in range(count): compiler.store_cached(f"source {number}", bytes(size))


def test_many_small_entries_walk_the_cache_once(walks, monkeypatch):
  monkeypatch.setenv("COMPILE_CACHE_BYTES", str(1 << 30))
  _write(1000, 100)   # ~150 KB of 1 GiB: only the check at the PRUNE_EVERY_WRITES-th write
  assert walks == [1 << 30]


def test_a_bound_small_for_the_writes_is_checked_each_sixteenth(walks, monkeypatch):
  entry = len(device_module.CACHE_ENTRY_MAGIC) + 32 + 1000
  bound = 32 * entry + 1   # a sixteenth of it is two entries and a byte: a check at every third write
  monkeypatch.setenv("COMPILE_CACHE_BYTES", str(bound))
  _write(60, 1000)
  assert len(walks) == 60 // 3
  # the last check (the 60th write) deleted the oldest entries down to the bound: 32 of the 60 are left
  assert len(list((device_module.cache_dir() / "compile").glob("*/*"))) == 32


def test_no_bound_no_walk(walks, monkeypatch):
  monkeypatch.setenv("COMPILE_CACHE_BYTES", "-1")
  _write(100, 10)
  assert walks == []
