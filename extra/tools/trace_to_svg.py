"""Draw a Chrome/Perfetto trace (what PROFILE=1 and ourgrad.profile() write) as an SVG timeline, for places with no
browser to open ui.perfetto.dev: one row per process/thread, one bar per complete event, a time axis in ms.

    python extra/tools/trace_to_svg.py trace.json trace.svg
    python extra/tools/trace_to_svg.py trace.json trace.svg --width 1200 --from-ms 120 --to-ms 180

Each bar has a tooltip (SVG <title>) with the event's name and duration; names are written inside bars wide enough.
"""
from __future__ import annotations

import argparse
import html
import json
import math
import pathlib
from typing import Any

# bar colors by event category (the `cat` field ourgrad writes)
CATEGORY_COLORS = {"kernel": "#4393c3", "copy": "#fdb863", "schedule": "#5aae61", "codegen": "#b2abd2",
                   "compile": "#8073ac"}
DEFAULT_COLOR = "#bababa"
ROW_HEIGHT, ROW_GAP, LABEL_WIDTH, AXIS_HEIGHT, MARGIN = 22, 6, 150, 30, 10
CHAR_WIDTH = 6.2   # average width of a 10px monospace character


def load_events(path: pathlib.Path) -> tuple[list[dict[str, Any]], dict[tuple[int, int], str]]:
  """(complete events, {(pid, tid): "process / thread"}) of a trace file."""
  trace = json.loads(path.read_text())
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  processes = {event["pid"]: event["args"]["name"] for event in events if event.get("name") == "process_name"}
  threads = {(event["pid"], event["tid"]): event["args"]["name"] for event in events
             if event.get("name") == "thread_name"}
  complete = [event for event in events if event.get("ph") == "X"]
  names = {}
  for event in complete:
    key = (event["pid"], event["tid"])
    names[key] = f"{processes.get(key[0], key[0])} / {threads.get(key, key[1])}"
  return complete, names


def nice_step(span: float, target_ticks: int = 8) -> float:
  """A tick step of 1, 2 or 5 times a power of ten giving about `target_ticks` ticks over `span` (> 0)."""
  raw = span / target_ticks
  power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
  return next(multiple * power for multiple in (1, 2, 5, 10) if multiple * power >= raw)


def render_svg(events: list[dict[str, Any]], row_names: dict[tuple[int, int], str], width: int,
               from_us: float | None = None, to_us: float | None = None) -> str:
  """The SVG text of the timeline between from_us and to_us (default: all events)."""
  if not events: raise ValueError("the trace has no complete events to draw")
  start = min(event["ts"] for event in events) if from_us is None else from_us
  end = max(event["ts"] + event["dur"] for event in events) if to_us is None else to_us
  events = [event for event in events if event["ts"] + event["dur"] >= start and event["ts"] <= end]
  rows = sorted({(event["pid"], event["tid"]) for event in events})
  plot_width = width - LABEL_WIDTH - 2 * MARGIN
  scale = plot_width / max(end - start, 1e-9)   # pixels per microsecond
  height = AXIS_HEIGHT + len(rows) * (ROW_HEIGHT + ROW_GAP) + 2 * MARGIN

  def x_of(time_us: float) -> float: return MARGIN + LABEL_WIDTH + (min(max(time_us, start), end) - start) * scale

  def y_of(row: int) -> float: return MARGIN + AXIS_HEIGHT + row * (ROW_HEIGHT + ROW_GAP)

  parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="10">',
           f'<rect width="{width}" height="{height}" fill="white"/>']
  # time axis: ticks in milliseconds from the window's start
  step_us = nice_step((end - start) / 1000) * 1000
  tick = 0.0
  while start + tick <= end:
    x = x_of(start + tick)
    parts.append(f'<line x1="{x:.1f}" y1="{MARGIN + AXIS_HEIGHT - 6}" x2="{x:.1f}" y2="{height - MARGIN}" '
                 f'stroke="#e0e0e0"/>')
    parts.append(f'<text x="{x:.1f}" y="{MARGIN + 12}" text-anchor="middle">{tick / 1000:g} ms</text>')
    tick += step_us
  for row, key in enumerate(rows):
    y = y_of(row)
    parts.append(f'<text x="{MARGIN}" y="{y + ROW_HEIGHT * 0.65:.1f}">{html.escape(row_names[key])}</text>')
    parts.append(f'<line x1="{MARGIN + LABEL_WIDTH}" y1="{y + ROW_HEIGHT}" x2="{width - MARGIN}" '
                 f'y2="{y + ROW_HEIGHT}" stroke="#c0c0c0"/>')
  row_of = {key: row for row, key in enumerate(rows)}
  for event in sorted(events, key=lambda event: -event["dur"]):   # short events last: drawn on top
    left, right = x_of(event["ts"]), x_of(event["ts"] + event["dur"])
    bar_width = max(right - left, 1.0)   # a sub-pixel event is still visible
    y = y_of(row_of[(event["pid"], event["tid"])])
    color = CATEGORY_COLORS.get(event.get("cat", ""), DEFAULT_COLOR)
    tooltip = html.escape(f"{event['name']} ({event.get('cat', '')}): {event['dur']:.1f} us")
    parts.append(f'<rect x="{left:.2f}" y="{y}" width="{bar_width:.2f}" height="{ROW_HEIGHT}" fill="{color}" '
                 f'stroke="white" stroke-width="0.5"><title>{tooltip}</title></rect>')
    label = event["name"]
    if bar_width > CHAR_WIDTH * 4:
      fitting = int(bar_width / CHAR_WIDTH) - 1
      shown = label if len(label) <= fitting else label[:max(fitting - 1, 1)] + "…"
      parts.append(f'<text x="{left + 3:.2f}" y="{y + ROW_HEIGHT * 0.65:.1f}" fill="white">{html.escape(shown)}</text>')
  parts.append("</svg>")
  return "\n".join(parts) + "\n"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("trace", type=pathlib.Path, help="trace JSON written by PROFILE=1 or ourgrad.profile()")
  parser.add_argument("svg", type=pathlib.Path, help="SVG file to write")
  parser.add_argument("--width", type=int, default=1000, help="image width in pixels")
  parser.add_argument("--from-ms", type=float, default=None, help="start of the window, ms from the trace's origin")
  parser.add_argument("--to-ms", type=float, default=None, help="end of the window, ms from the trace's origin")
  args = parser.parse_args()
  events, row_names = load_events(args.trace)
  from_us = args.from_ms * 1000 if args.from_ms is not None else None
  to_us = args.to_ms * 1000 if args.to_ms is not None else None
  args.svg.write_text(render_svg(events, row_names, args.width, from_us, to_us))
  print(f"wrote {args.svg}: {len(events)} events in {len(set(row_names))} rows")


if __name__ == "__main__":
  main()
