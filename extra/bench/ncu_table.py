"""Print one row per kernel from an ncu --csv log (the metrics of extra/bench/plans/probe11.txt): time in us, DRAM %
of peak, MB read and written, achieved occupancy, sectors per global load / store request (4 = coalesced float, 16 =
one sector per lane), tensor-pipe %, grid, block, registers, SM %; slowest first.

    python extra/bench/ncu_table.py ncu.csv
"""
from __future__ import annotations

import collections
import csv
import sys


def read_kernels(path: str) -> list[tuple[str, dict[str, str]]]:
  """(kernel name, {metric: value}) per profiled launch, in launch order."""
  lines = [line for line in open(path) if not line.startswith("==")]
  rows = list(csv.reader(lines))
  header = rows[0]
  id_at, name_at = header.index("ID"), header.index("Kernel Name")
  metric_at, value_at = header.index("Metric Name"), header.index("Metric Value")
  metrics: dict[str, dict[str, str]] = collections.defaultdict(dict)
  names: dict[str, str] = {}
  for row in rows[1:]:
    if len(row) < len(header): continue
    metrics[row[id_at]][row[metric_at]] = row[value_at].replace(",", "")
    names[row[id_at]] = row[name_at]
  return [(names[launch], metrics[launch]) for launch in metrics]


TENSOR_PIPE = "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"


def main() -> None:
  kernels = read_kernels(sys.argv[1])

  def value(metric: dict[str, str], key: str) -> float: return float(metric.get(key) or 0)

  def per_request(metric: dict[str, str], kind: str) -> float:
    sectors = value(metric, f"l1tex__t_sectors_pipe_lsu_mem_global_op_{kind}.sum")
    return sectors / max(value(metric, f"l1tex__t_requests_pipe_lsu_mem_global_op_{kind}.sum"), 1)

  print(f"{'us':>7} {'kernel':42} {'dram%':>6} {'rdMB':>7} {'wrMB':>7} {'occ%':>5} {'ld s/r':>6} {'st s/r':>6} "
        f"{'tc%':>5} {'grid':>7} {'blk':>4} {'reg':>4} {'sm%':>5}")
  total = 0.0
  for name, metric in sorted(kernels, key=lambda kernel: -value(kernel[1], "gpu__time_duration.sum")):
    micros = value(metric, "gpu__time_duration.sum") / 1e3
    total += micros
    print(f"{micros:7.1f} {name[:42]:42} {value(metric, 'dram__throughput.avg.pct_of_peak_sustained_elapsed'):6.1f} "
          f"{value(metric, 'dram__bytes_read.sum') / 1e6:7.1f} {value(metric, 'dram__bytes_write.sum') / 1e6:7.1f} "
          f"{value(metric, 'sm__warps_active.avg.pct_of_peak_sustained_active'):5.1f} {per_request(metric, 'ld'):6.1f} "
          f"{per_request(metric, 'st'):6.1f} {value(metric, TENSOR_PIPE):5.1f} "
          f"{metric.get('launch__grid_size', ''):>7} {metric.get('launch__block_size', ''):>4} "
          f"{metric.get('launch__registers_per_thread', ''):>4} "
          f"{value(metric, 'sm__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f}")
  print(f"total {total:.1f} us in {len(kernels)} kernels")


if __name__ == "__main__":
  main()
