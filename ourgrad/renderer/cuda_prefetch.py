"""L2 prefetches in a CUDA kernel's dependent-launch prologue (CUDA_DEPENDENT_LAUNCH=3, renderer/cuda.py).

With programmatic dependent launch a kernel's blocks are resident and waiting (griddepcontrol.wait) while the kernel
before still runs. Before that wait, each thread may already ask for the lines of memory it will load: a prefetch
into L2 reads no value into a register, and L2 is where every multiprocessor's writes meet, so a line prefetched
before the kernel before has written it is still read fresh after the wait. Weights (never written by the graph)
then come from L2 instead of HBM once the wait is over: a decode step's ~3 us matrix-vector kernels begin with a
round trip to HBM.

Only addresses the thread surely loads later are prefetched: a load that is not gated, not inside an IF, in loops
whose trip counts are constants, and addressed by thread and block indices, loop counters and constants (a gather's
index is a loaded value: not known before the wait). Loop counters take their values in order, the loads in turn,
at most PREFETCHES_PER_THREAD addresses, one per 128-byte line of a load's neighbours (x[i], x[i+1], ...)."""
from __future__ import annotations

import itertools
from typing import Callable, Iterator

from ourgrad.codegen.uops import UOp, UOps
from ourgrad.ops import Ops

PREFETCHES_PER_THREAD = 16
LINE_BYTES = 128


def _index_leaves(index: UOp) -> list[UOp] | None:
  """The RANGEs an index reads, or None when it reads anything other than SPECIALs, RANGEs, CONSTs and arithmetic
  (a loaded value, an accumulator, a symbolic Variable)."""
  ranges: dict[int, UOp] = {}
  stack, seen = [index], set()
  while stack:
    uop = stack.pop()
    if id(uop) in seen: continue
    seen.add(id(uop))
    if uop.op is UOps.RANGE: ranges[id(uop)] = uop
    elif uop.op in (UOps.ALU, UOps.CAST): stack.extend(uop.srcs)
    elif uop.op not in (UOps.SPECIAL, UOps.CONST): return None
  return list(ranges.values())


def _base_and_offset(index: UOp) -> tuple[int, int]:
  """(the id of the index's variable part, its constant offset): x[alu + 3] is (alu, 3), x[alu] is (alu, 0)."""
  if index.op is UOps.ALU and index.arg is Ops.ADD and index.srcs[1].op is UOps.CONST:
    return id(index.srcs[0]), int(index.srcs[1].arg)
  return id(index), 0


def sure_loads(uops: list[UOp]) -> list[tuple[UOp, list[UOp]]]:
  """(load, the constant-count RANGEs its index reads) of every global load each thread surely makes (see the module
  docstring), one per 128-byte line of loads that differ by a constant offset."""
  found: list[tuple[UOp, list[UOp]]] = []
  lines: set[tuple[int, int, int]] = set()
  ifs, loops_ok = 0, [True]
  for uop in uops:
    if uop.op is UOps.IF: ifs += 1
    elif uop.op is UOps.ENDIF: ifs -= 1
    elif uop.op is UOps.RANGE:
      constant = all(src.op is UOps.CONST for src in uop.srcs[:2]) and uop.srcs[1].arg > uop.srcs[0].arg
      loops_ok.append(loops_ok[-1] and constant)
    elif uop.op is UOps.ENDRANGE: loops_ok.pop()
    elif uop.op is UOps.LOAD and uop.srcs[0].op is UOps.DEFINE_GLOBAL and len(uop.srcs) == 2 and not ifs \
        and loops_ok[-1]:
      ranges = _index_leaves(uop.srcs[1])
      if ranges is None or not all(all(src.op is UOps.CONST for src in r.srcs[:2]) for r in ranges): continue
      base, offset = _base_and_offset(uop.srcs[1])
      line = (uop.srcs[0].arg[0], base, offset * uop.srcs[0].dtype.itemsize // LINE_BYTES)
      if line in lines: continue
      lines.add(line)
      found.append((uop, ranges))
  return found


def prefetch_addresses(uops: list[UOp], special: Callable[[UOp], str], const: Callable[[UOp], str],
                       expression: Callable[[UOp, Callable[[UOp], str]], str]) -> list[str]:
  """`data<n> + (index)` of the sure loads (sure_loads) at their loop counters' values, in turns over the buffers
  and each buffer's loads (each one's first iteration first), at most PREFETCHES_PER_THREAD distinct ones; `special`
  renders a thread or block index, `const` a constant and `expression` an ALU or CAST of its rendered sources."""
  def values(load: UOp, ranges: list[UOp]) -> Iterator[str]:
    for counters in itertools.product(*(range(r.srcs[0].arg, r.srcs[1].arg) for r in ranges)):
      at = {id(r): value for r, value in zip(ranges, counters)}
      rendered: dict[int, str] = {}

      def ref(uop: UOp) -> str:
        if id(uop) in at: return str(at[id(uop)])
        if uop.op is UOps.SPECIAL: return f"(int){special(uop)}"
        if uop.op is UOps.CONST: return const(uop)
        if id(uop) not in rendered: rendered[id(uop)] = f"({expression(uop, ref)})"
        return rendered[id(uop)]
      yield f"data{load.srcs[0].arg[0]} + {ref(load.srcs[1])}"
  # in turns over the buffers, then over each buffer's loads: a matrix-vector product's weights get as many lines as
  # its (small, cached) vector, which it loads in more places
  by_buffer: dict[int, list[Iterator[str]]] = {}
  for load, ranges in sure_loads(uops): by_buffer.setdefault(load.srcs[0].arg[0], []).append(values(load, ranges))
  streams = [_in_turns(loads) for loads in by_buffer.values()]
  addresses: dict[str, None] = {}
  for address in _in_turns(streams):
    addresses[address] = None
    if len(addresses) == PREFETCHES_PER_THREAD: break
  return list(addresses)


def _in_turns(streams: list[Iterator[str]]) -> Iterator[str]:
  """The streams' items, one of each in turn, until all are exhausted."""
  return (item for item in itertools.chain.from_iterable(itertools.zip_longest(*streams)) if item is not None)
