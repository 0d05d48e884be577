"""Smoke tests of the benchmark timing helpers (extra/bench/timing.py) and of bench_reduce.py, on the CPU.

cold_kernel_seconds falls back to back-to-back timing on devices without graphs (CLANG, PYTHON); its graph path is
checked with a stand-in graph class on CLANG that runs the launches it is given, so the copies, their scratch
buffers and the launch count are what a CUDA graph would replay (the CUDA run itself is the coordinator's:
`python extra/bench/bench_reduce.py --only-mnist`). The scripts run end to end at a tiny scale on PYTHON with
EMULATE=CUDA's kernels."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "extra" / "bench"
sys.path.insert(0, str(BENCH))
import timing  # noqa: E402
from ourgrad import Tensor  # noqa: E402
from ourgrad.device import Device  # noqa: E402


def _sum_items(device: str, rows: int = 16, columns: int = 64) -> list:
  x = Tensor(np.random.randn(rows, columns).astype(np.float32), device=device).realize()
  return timing.schedule_items(device, x.sum(axis=1))


@pytest.mark.parametrize("device", ["CLANG", "PYTHON"])
def test_cold_kernel_seconds_falls_back_without_graphs(device: str) -> None:
  (item,) = _sum_items(device)
  measured = timing.cold_kernel_seconds(item, replays=2, fallback_launches=2)
  assert measured.method == "back-to-back"
  assert measured.sets == 1 and measured.launches == 2
  assert measured.seconds > 0
  assert measured.bytes_per_launch == 16 * 4 + 16 * 64 * 4


def test_scratch_sets_keep_aliasing_and_values() -> None:
  (item,) = _sum_items("CLANG")
  item.bufs.append(item.bufs[1])   # one buffer in two slots: one scratch buffer in both
  sets = timing.scratch_sets(item, 3)
  assert len(sets) == 3
  for scratch in sets:
    assert [(b.size, b.dtype) for b in scratch] == [(b.size, b.dtype) for b in item.bufs]
    assert scratch[1] is scratch[2] and scratch[0] is not scratch[1]
    np.testing.assert_array_equal(scratch[1].numpy(), sets[0][1].numpy())
  assert len({id(scratch[1]) for scratch in sets}) == 3   # every set has buffers of its own
  assert np.isfinite(sets[0][1].numpy()).all() and sets[0][1].numpy().std() > 0.5


class _HostGraph:
  """A stand-in for CUDAGraph on CLANG: runs its launches in order; counts the launches and graph replays."""
  built: list[int] = []
  replays = 0

  def __init__(self, launches: list) -> None:
    self.launches = launches
    _HostGraph.built.append(len(launches))

  def launch(self) -> None:
    _HostGraph.replays += 1
    for program, global_size, local_size, handles, values, *_ in self.launches:   # (op and byte counts after)
      program(*handles, global_size=global_size, local_size=local_size, vals=tuple(values))

  def set_argument(self, index: int, position: int, handle) -> None: raise AssertionError("not patched in timing")


def test_cold_kernel_seconds_graph_path(monkeypatch: pytest.MonkeyPatch) -> None:
  """With a graph class: enough sets to exceed 2x the cache, a multiple of them launched, one graph replayed
  `replays + 1` times (the first untimed), each replay's time divided by its launches."""
  device = Device["CLANG"]
  monkeypatch.setattr(device, "graph", _HostGraph, raising=False)
  monkeypatch.setattr(timing, "_event_seconds", lambda name, launch: (launch(), 0.064)[1])
  _HostGraph.built, _HostGraph.replays = [], 0
  (item,) = _sum_items("CLANG")
  per_launch = 16 * 4 + 16 * 64 * 4
  measured = timing.cold_kernel_seconds(item, replays=3, min_launches=8, cache_bytes=10 * per_launch)
  assert measured.method == "graph"
  assert measured.sets == 20 and measured.launches == 20   # ceil(2 * 10) sets, at least 8 launches
  assert _HostGraph.built == [20] and _HostGraph.replays == 4
  assert measured.seconds == pytest.approx(0.064 / 20)
  small = timing.cold_kernel_seconds(item, replays=1, min_launches=64, cache_bytes=per_launch)
  assert (small.sets, small.launches) == (2, 64)
  capped = timing.cold_kernel_seconds(item, replays=1, min_launches=4, max_sets=5, cache_bytes=1 << 30)
  assert (capped.sets, capped.launches) == (5, 5)


def test_cold_kernel_seconds_large_kernel_reads_its_own_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
  """A kernel moving more than twice the cache needs one set: with own_buffers_when_large, its own buffers."""
  device = Device["CLANG"]
  monkeypatch.setattr(device, "graph", _HostGraph, raising=False)
  monkeypatch.setattr(timing, "_event_seconds", lambda name, launch: (launch(), 0.001)[1])
  (item,) = _sum_items("CLANG")
  seen: list[list] = []
  monkeypatch.setattr(_HostGraph, "__init__", lambda self, launches: (seen.append(launches),
                                                                       setattr(self, "launches", launches))[0])
  for own in (True, False):
    measured = timing.cold_kernel_seconds(item, replays=1, min_launches=3, cache_bytes=16,
                                          own_buffers_when_large=own)
    assert (measured.sets, measured.launches) == (1, 3)
    handles = seen[-1][0][3]
    assert (handles[1] is item.bufs[1].handle) == own


def test_cold_schedule_seconds_names_every_kernel() -> None:
  x = Tensor(np.random.randn(8, 32).astype(np.float32), device="CLANG").realize()
  total, kernels = timing.cold_schedule_seconds("CLANG", x.softmax(-1), replays=2)
  assert len(kernels) >= 1 and total == pytest.approx(sum(seconds for _, seconds in kernels))


def test_mnist_roles_name_the_issue_rows() -> None:
  """The roles of the CUDA step's kernels (bench_reduce_mnist_h100_s5.txt's kinds, batch 256)."""
  from kernel_table import MnistRoles, role_group
  roles = MnistRoles([[(16, 5)], [(32, 5)]], 256)
  assert roles.role(("matmul", 2359296, 25), True) == "conv1 forward"
  assert roles.role(("matmul", 524288, 400), True) == "conv2 forward"
  assert roles.role(("matmul", 589824, 800), False) == "conv2 input gradient"
  assert roles.role(("matmul", 409600, 512), False) == "conv2 weight gradient partials (32 parts)"
  assert roles.role(("matmul", 102400, 576), False) == "conv1 weight gradient partials (256 parts)"
  assert roles.role(("reduce", 12800, 32), False) == "conv2 weight gradient second stage"
  assert roles.role(("reduce", 1024, 2304), True) == "bn1 statistics forward partials (64 parts)"
  assert roles.role(("reduce", 512, 1024), False) == "bn2 statistics backward partials (16 parts)"
  assert roles.role(("reduce", 16, 64), True) == "bn1 statistics forward second stage"
  assert roles.role(("reduce", 589824, 4), True) == "max-pool (forward)"
  assert roles.role(("matmul", 2560, 512), True) == "linear (forward)"
  assert role_group("conv2 weight gradient partials (32 parts)") == "conv2 weight gradient"
  assert role_group("bn1 statistics forward second stage") == "bn1 statistics forward"


def test_mnist_forward_flags_end_at_the_logits() -> None:
  from kernel_table import MnistRoles
  roles = MnistRoles([[(16, 5)], [(32, 5)]], 256)
  kinds = [("matmul", 2359296, 25), ("reduce", 16, 64), ("matmul", 2560, 512), ("reduce", 16, 64), ("reduce", 1, 256)]
  assert roles.forward_flags(kinds) == [True, True, True, False, False]
  assert roles.forward_flags(kinds[:2]) == [False, False]   # no logits kernel: nothing is called forward


def test_ncu_kernel_seconds_reads_a_real_ncu_csv() -> None:
  """extra/bench/results/ncu_jit_cnn_h100_s5.txt: the script's own lines, then ncu's CSV (three metrics a launch)."""
  text = (BENCH / "results" / "ncu_jit_cnn_h100_s5.txt").read_text()
  from kernel_table import ncu_kernel_seconds
  measured = ncu_kernel_seconds(text)
  captured = next(line for line in text.splitlines() if "captured items:" in line).split("captured items: ")[1].split()
  assert [name for name, _ in measured] == captured
  assert measured[0] == ("r_128_3_3_2_16_2_2_5_5_4_4", pytest.approx(11.36e-6))
  with pytest.raises(ValueError): ncu_kernel_seconds("no csv here")


def _run(arguments: list[str], script: str = "bench_reduce.py", device: str = "PYTHON") -> str:
  environment = {**os.environ, "DEVICE": device, "EMULATE": "CUDA"}
  result = subprocess.run([sys.executable, str(BENCH / script), "--device", device, *arguments],
                          capture_output=True, text=True, env=environment, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def test_profile_jit_step_table_from_ncu_csv(tmp_path: Path) -> None:
  """--copies then --table on CLANG with a CSV made up in ncu's format: the step's kernels take the CSV's first
  times in launch order, and the copy kernels after them become the %copy / %same references."""
  captured = _run(["--model", "cnn", "--copies"], "profile_jit_step.py", "CLANG")
  names = next(line for line in captured.splitlines() if "captured items:" in line).split("captured items: ")[1].split()
  copies = int(next(line for line in captured.splitlines() if "copy kernels after the step" in line).split()[1])
  from kernel_table import LARGE_COPY_ELEMENTS
  rows = ['"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"']
  rows += [f'"{index}","{name}","gpu__time_duration.sum","ns","{(index + 1) * 1000:,}"'
           for index, name in enumerate(names)]
  # every copy in 1 us but the large one (the last), in 1 ms: 2 x 256 MB / 1 ms = 537 GB/s
  rows += [f'"{len(names) + index}","E_copy","gpu__time_duration.sum","ns","1,000"' for index in range(copies - 1)]
  rows.append(f'"{len(names) + copies - 1}","E_copy","gpu__time_duration.sum","usecond","1,000"')
  (tmp_path / "ncu.csv").write_text("==PROF== Connected\n" + "\n".join(rows) + "\n")
  output = _run(["--model", "cnn", "--table", str(tmp_path / "ncu.csv")], "profile_jit_step.py", "CLANG")
  assert "ncu's times of the ourgrad copy kernels" in output and "warning" not in output
  assert f"copy bandwidth: {2 * LARGE_COPY_ELEMENTS * 4 / 1e-3 / 1e9:.0f} GB/s" in output
  assert f"ncu sum {sum(range(1, len(names) + 1)) * 1e-3:.3f} ms" in output
  for role in ("conv2 weight gradient", "bn1 statistics forward", "bn1 statistics backward", "conv1 forward"):
    assert role in output


def test_bench_reduce_runs_small() -> None:
  output = _run(["--scale", "9", "--no-mnist", "--no-beam", "--no-torch", "--only", "row", "--iters", "2"])
  lines = [line for line in output.splitlines() if line.startswith("row ")]
  assert [line.split()[1] for line in lines] == ["sum", "max"]
  assert "1-launch" in output and "%same" in output


def test_bench_reduce_mnist_table_small() -> None:
  output = _run(["--scale", "5", "--only-mnist", "--mnist-steps", "1", "--replays", "2"])
  assert "sum of kernel times" in output and "DEBUG=2's 1-launch event times sum to" in output
  for role in ("conv2 weight gradient", "conv2 input gradient", "bn1 statistics forward", "bn1 statistics backward",
               "conv1 forward", "max-pool (forward)", "linear (forward)"):
    assert role in output
  assert "per role" in output
