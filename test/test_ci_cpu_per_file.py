""".ci/cpu_per_file.py, the pytest plugin that ends each CI stage with the CPU seconds of each test file: run on two
small test files, under pytest-xdist as CI runs it, it lists both with their test counts, the file whose test waited
on a CPU-bound child process first (a child's CPU counts, as the C compiler's does)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

CI = pathlib.Path(__file__).resolve().parents[1] / ".ci"

BUSY = """
import subprocess, sys
def test_child_burns_cpu():
  subprocess.run([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"], check=True)
def test_light():
  assert True
"""
LIGHT = "def test_nothing():\n  assert 1 + 1 == 2\n"


def test_cpu_per_file_summary_under_xdist(tmp_path: pathlib.Path) -> None:
  (tmp_path / "test_busy.py").write_text(BUSY)
  (tmp_path / "test_idle.py").write_text(LIGHT)
  env = {**os.environ, "PYTHONPATH": str(CI)}
  command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "cpu_per_file", "-p", "no:cacheprovider",
             "--rootdir", str(tmp_path), str(tmp_path)]
  result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
  assert result.returncode == 0, result.stdout + result.stderr
  lines = result.stdout.splitlines()
  header = next(number for number, line in enumerate(lines) if "CPU seconds per test file" in line)
  rows = [line.split() for line in lines[header + 1:header + 3]]
  assert [row[-1] for row in rows] == ["test_busy.py", "test_idle.py"], lines[header:]
  assert [int(row[2]) for row in rows] == [2, 1]   # tests per file
  assert float(rows[0][0]) > float(rows[1][0])
