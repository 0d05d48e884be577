"""Summarize `ncu --page source --print-source sass --csv` of one kernel (stdin): the instructions with the most warp
stall samples, each with its nonzero stall-reason columns, and the totals per reason. Usage:
ncu --clock-control none --profile-from-start off -k regex:NAME --section SourceCounters --section WarpStateStats
    --page source --print-source sass --csv python extra/bench/probe_attention_step.py | python
    extra/bench/ncu_source_stalls.py [TOP]"""
import csv
import io
import sys


def number(text: str) -> float:
  try: return float(text.replace(",", ""))
  except ValueError: return 0.0


def main() -> None:
  top = int(sys.argv[1]) if len(sys.argv) > 1 else 50
  lines = sys.stdin.read().splitlines()
  # the table's header: the first CSV line of several fields that names the source or address (ncu's own lines and
  # the profiled program's output come before it)
  start = next((i for i, line in enumerate(lines) if line.startswith('"') and len(next(csv.reader([line]))) >= 4
                and ("Source" in line or "Address" in line)), None)
  if start is None:
    print("no source table found; the output's first and last lines:", *lines[:20], *lines[-20:], sep="\n")
    return
  rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
  header, body = rows[0], [row for row in rows[1:] if len(row) == len(rows[0])]
  print("columns:", " | ".join(header))
  sampled = [i for i, name in enumerate(header) if "Sampling (All" in name]
  key = sampled[0] if sampled else max(range(len(header)), key=lambda i: sum(number(r[i]) for r in body))
  source = next((i for i, name in enumerate(header) if name.lower() in ("source", "sass")), 1)
  stall_columns = [i for i, name in enumerate(header) if "stall" in name.lower() and i != key]
  total = sum(number(row[key]) for row in body)
  print(f"{len(body)} instructions, {total:.0f} samples in {header[key]!r}")
  totals = sorted(((sum(number(r[i]) for r in body), header[i]) for i in stall_columns), reverse=True)
  for value, name in totals[:25]:
    if value: print(f"  {value:10.0f} {name}")
  for index, row in sorted(enumerate(body), key=lambda item: -number(item[1][key]))[:top]:
    details = ", ".join(f"{header[i]}={row[i]}" for i in stall_columns if number(row[i]))[:300]
    print(f"{number(row[key]):7.0f} #{index:5d} {row[source][:70]:70s} {details}")


if __name__ == "__main__":
  main()
