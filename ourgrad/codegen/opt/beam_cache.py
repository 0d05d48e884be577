"""BEAM's on-disk cache: the plan each search chose (codegen/opt/plans.py: the heuristic's typed plan where it won,
else the searched Opts as an OptsPlan), as JSON in an sqlite file in the cache folder
(`ourgrad.helpers.cache_dir()`), keyed by the kernel's AST, the device and its compiler, and the beam width (and the
float32 matmul precision where TF32 is allowed), so that another process running the same program does no search
(docs/beam.md). search.py reads and writes it.

    cache_key(ast, device, width)   the key of a search
    cache_get(key) / cache_put(key, kernel_name, plan)
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import sqlite3
import warnings
from typing import Iterator

from ourgrad.codegen.kernel import Opt, OptOps
from ourgrad.codegen.opt.plans import OptsPlan, Plan, plan_from_json, plan_to_json
from ourgrad.device import Device
from ourgrad.dtype import dtypes
from ourgrad.helpers import cache_dir, tf32_allowed
from ourgrad.ops import ConstBuffer, LazyOp, MemBuffer, Ops

CACHE_VERSION = 1          # bump when the meaning of cached opts changes


def _ast_text(ast: LazyOp) -> str:
  """A stable text of an AST (the same in every process): each node once, children first, sources by number."""
  numbers: dict[int, int] = {}
  lines = []
  for node in ast.walk():
    numbers[id(node)] = len(numbers)
    arg = node.arg
    if isinstance(arg, ConstBuffer): arg = (repr(arg.val), arg.dtype.name, arg.st)
    elif isinstance(arg, MemBuffer): arg = (arg.idx, arg.dtype.name, arg.st)
    sources = [numbers[id(src)] for src in node.srcs]
    lines.append(f"{node.op.name} {node.dtype.name} {sources} {arg!r}")
  return "\n".join(lines)


def cache_key(ast: LazyOp, device: str, beam_width: int) -> str:
  """The cache key of a search: the AST, the device and its compiler (which names the hardware), the width, and for
  a float32 sum (a matmul or convolution may be one) searched with TF32 allowed, that precision: a search that chose
  TF32 tensor cores must not be reused where full float32 is asked for, nor the other way round. Keys without TF32
  are those of earlier versions (their caches stay valid)."""
  compiler_key = getattr(Device[device].compiler, "cache_key", "")
  text = f"beam v{CACHE_VERSION}\n{device}\n{compiler_key}\n{beam_width}\n{_ast_text(ast)}"
  if tf32_allowed() and any(node.op is Ops.SUM and node.dtype == dtypes.float32 for node in ast.walk()):
    text += "\nfloat32 matmul precision: high (TF32)"
  return hashlib.sha256(text.encode()).hexdigest()


@contextlib.contextmanager
def _connect() -> Iterator[sqlite3.Connection]:
  """A connection to the cache file, committed and closed on exit (sqlite's own `with` only commits)."""
  connection = sqlite3.connect(cache_dir() / "beam.sqlite", timeout=30)  # several processes may search at once
  try:
    with connection:
      connection.execute("CREATE TABLE IF NOT EXISTS beam (key TEXT PRIMARY KEY, kernel TEXT, opts TEXT)")
      yield connection
  finally:
    connection.close()


def cache_get(key: str) -> Plan | None:
  """The cached plan of a search, or None (not cached, or written by a version whose Opt kinds or plans are gone). An
  entry of earlier versions (a list of Opts) reads as the OptsPlan of those Opts."""
  try:
    with _connect() as connection:
      row = connection.execute("SELECT opts FROM beam WHERE key = ?", (key,)).fetchone()
  except sqlite3.Error:  # an unreadable cache costs a search, not the result
    return None
  if row is None: return None
  try:
    data = json.loads(row[0])
    if isinstance(data, list): return OptsPlan("search", tuple(Opt(OptOps[name], axis, amount)
                                                              for name, axis, amount in data))
    return plan_from_json(data)
  except (KeyError, ValueError, TypeError):
    return None


def cache_put(key: str, kernel_name: str, plan: Plan) -> None:
  encoded = json.dumps(plan_to_json(plan))
  try:
    with _connect() as connection:
      connection.execute("INSERT OR REPLACE INTO beam VALUES (?, ?, ?)", (key, kernel_name, encoded))
  except sqlite3.Error as error:
    warnings.warn(f"cannot write the BEAM cache in {cache_dir()} ({error}); the search runs again in the next "
                  f"process", RuntimeWarning, stacklevel=2)
