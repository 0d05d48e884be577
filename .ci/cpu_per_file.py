"""A pytest plugin for CI's stages: `-p cpu_per_file` ends the run with the CPU seconds each test file took (user +
system of the process running it, with the children it waited for: the C compiler, subprocess tests), the costliest
files first, so that each CI log says where its time went. CPU, not wall: on a shared or loaded machine the wall
time of a test says little; its CPU does not depend on the others. Works with pytest-xdist (each worker measures its
tests and the numbers travel in the reports' user_properties) and without. Load it with `.ci` on PYTHONPATH.

A test's CPU runs from its setup to its teardown: a module fixture's teardown (CHECK_CUDA_RENDER=file's NVRTC check
of the file's kernels) counts in the file's last test on that worker. Collection and the workers' start are not in
any file's figure (the total line gives them apart).
"""
from __future__ import annotations

import os
from collections import defaultdict

import pytest

SHOWN_FILES = 15            # the costliest files listed; the rest are summed on one line
_PROPERTY = "cpu_seconds"   # the user_properties entry each report carries (a phase's CPU)
_started = [0.0]            # process CPU when the running test's current phase began
_per_file: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])   # file -> [tests, CPU seconds]


def _process_cpu() -> float:
  times = os.times()
  return times.user + times.system + times.children_user + times.children_system


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
  _started[0] = _process_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
  outcome = yield
  now = _process_cpu()
  outcome.get_result().user_properties.append((_PROPERTY, now - _started[0]))
  _started[0] = now


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
  """On the process that prints (xdist's controller, or the only one): add each phase's CPU to its file."""
  entry = _per_file[report.nodeid.split("::", 1)[0]]
  entry[1] += sum(value for name, value in report.user_properties if name == _PROPERTY)
  if report.when == "setup": entry[0] += 1


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
  if not _per_file: return
  ranked = sorted(_per_file.items(), key=lambda file: -file[1][1])
  total = sum(seconds for _, (_, seconds) in ranked)
  terminalreporter.write_sep("-", f"CPU seconds per test file (tests' user+sys with their waited children; "
                                  f"{total:.0f} in all, collection and worker start not included)")
  for name, (tests, seconds) in ranked[:SHOWN_FILES]:
    terminalreporter.write_line(f"{seconds:8.1f} {100 * seconds / total:5.1f}% {tests:5d} tests  {name}")
  rest = ranked[SHOWN_FILES:]
  if rest:
    seconds = sum(seconds for _, (_, seconds) in rest)
    terminalreporter.write_line(f"{seconds:8.1f} {100 * seconds / total:5.1f}% {sum(t for _, (t, _) in rest):5d} "
                                f"tests  the other {len(rest)} files")
