"""One C function that calls a list of host kernels in turn: the CLANG device's replay graph.

TinyJit replays a captured step on a device graph where the device has one (engine/jit.py, GraphReplay). On the
CPU a kernel is a C function, and calling each one from Python through ctypes costs ~0.5 us of the host's time (the
loop, the argument conversion, the foreign call): ~0.4 ms of a SmolLM2 CPU decode step's ~725 kernels, most of
whose small kernels (norms, activation quantization, attention over a few slots) run for 1-3 us. HostCallGraph makes
the whole replay one foreign call: a dispatcher compiled once per toolchain (`caller_source`) walks a table of calls,
each naming a kernel's function pointer, how many pointer and int arguments it takes and where they start in two
argument arrays. Replacing an argument writes one array element; nothing is compiled per capture.

Each (pointer count, int count) up to MAX_POINTERS and MAX_INTS has its own `case` in the dispatcher, so every kernel
is called through a prototype with its own number and kinds of arguments: a kernel's buffers are typed pointers
(`float *restrict`), called here as `void *` (the same representation for every object pointer on the targets the
C compiler builds for: what ctypes' own calls of them assume), its symbolic Variables `int`s, as the renderer declares
them. A kernel taking more arguments than the table covers is called through ctypes between two runs of the table.
"""
from __future__ import annotations

import ctypes
from typing import Any, Callable

# the largest kernel signatures the dispatcher calls itself (buffers, then symbolic Variables)
MAX_POINTERS = 24
MAX_INTS = 3
CALLER_NAME = "og_call_kernels"


def shape_code(pointers: int, ints: int) -> int:
  """The dispatcher's `case` for a kernel of `pointers` buffer and `ints` int arguments."""
  return pointers * (MAX_INTS + 1) + ints


def covered(pointers: int, ints: int) -> bool:
  """Whether the dispatcher has a `case` for a kernel of `pointers` buffer and `ints` int arguments."""
  return pointers <= MAX_POINTERS and ints <= MAX_INTS


def caller_source(max_pointers: int = MAX_POINTERS) -> str:
  """The dispatcher's C source: `og_call_kernels(calls, count, pointers, ints)` calls `count` table entries in order.
  (The bound is fixed when this module loads: a test that narrows `covered` by patching MAX_POINTERS leaves the
  dispatcher, compiled once a process, as every other caller expects it.)"""
  cases = []
  for pointers in range(max_pointers + 1):
    for ints in range(MAX_INTS + 1):
      parameters = ", ".join(["void *"] * pointers + ["int"] * ints) or "void"
      arguments = ", ".join([f"p[{index}]" for index in range(pointers)] + [f"n[{index}]" for index in range(ints)])
      cases.append(f"    case {shape_code(pointers, ints)}: ((void (*)({parameters}))call->function)({arguments}); "
                   f"break;")
  return "\n".join([
    "/* ourgrad: TinyJit's replay of host kernels, one call each (runtime/host_calls.py) */",
    "typedef struct { void *function; int shape, first_pointer, first_int; } og_call;",
    f"void {CALLER_NAME}(const og_call *calls, int count, void *const *pointers, const int *ints) {{",
    "  for (int index = 0; index < count; index++) {",
    "    const og_call *call = calls + index;",
    "    void *const *p = pointers + call->first_pointer;",
    "    const int *n = ints + call->first_int;",
    "    switch (call->shape) {",
    *cases,
    "    default: __builtin_trap();   /* a shape the table builder never writes */",
    "    }",
    "  }",
    "}",
    ""])


class CallEntry(ctypes.Structure):
  """One row of the dispatcher's table (the C struct `og_call`)."""
  _fields_ = [("function", ctypes.c_void_p), ("shape", ctypes.c_int), ("first_pointer", ctypes.c_int),
              ("first_int", ctypes.c_int)]


class HostCallGraph:
  """The kernels of a capture called by the dispatcher, in order (GraphReplay's graph interface: built from the
  launches, `set_argument` replaces one argument, `launch` runs them all). A launch is (program, global size, local
  size, buffer handles, int arguments, (ops, bytes)); a host kernel's sizes are its own loops', so they are unused.

  `caller` is the compiled dispatcher (its ctypes function), `address_of` the memory address of a buffer handle."""

  def __init__(self, launches: list[tuple], caller: Callable[..., None], address_of: Callable[[Any], int]):
    self.caller, self.address_of = caller, address_of
    # the table holds bare function addresses: the programs (and through them their loaded libraries) stay alive
    self.programs = [launch[0] for launch in launches]
    pointer_total = sum(len(launch[3]) for launch in launches)
    int_total = sum(len(launch[4]) for launch in launches)
    self.pointers = (ctypes.c_void_p * max(pointer_total, 1))()
    self.ints = (ctypes.c_int * max(int_total, 1))()
    self.table = (CallEntry * max(len(launches), 1))()
    # per launch: where its arguments start in the two arrays, and how many buffers it takes
    self.places: list[tuple[int, int, int]] = []
    # what launch() calls: (the dispatcher, a run of table rows) or (a kernel's ctypes function, its arguments)
    self.steps: list[tuple[Callable[..., None], list[Any]]] = []
    self.direct: dict[int, list[Any]] = {}   # launch index -> the argument list of a kernel called through ctypes
    first_pointer = first_int = 0
    run_start = 0
    for index, (program, _, _, handles, values, _costs) in enumerate(launches):
      self.places.append((first_pointer, first_int, len(handles)))
      for offset, handle in enumerate(handles): self.pointers[first_pointer + offset] = address_of(handle)
      for offset, value in enumerate(values): self.ints[first_int + offset] = value
      function = program.function
      if covered(len(handles), len(values)):
        self.table[index] = CallEntry(ctypes.cast(function, ctypes.c_void_p).value,
                                      shape_code(len(handles), len(values)), first_pointer, first_int)
      else:   # too many arguments for the dispatcher: called from Python between two runs of the table
        self._add_run(caller, run_start, index)
        arguments = [ctypes.c_void_p(address_of(handle)) for handle in handles] + list(values)
        self.direct[index] = arguments
        self.steps.append((function, arguments))
        run_start = index + 1
      first_pointer += len(handles)
      first_int += len(values)
    self._add_run(caller, run_start, len(launches))

  def _add_run(self, caller: Callable[..., None], start: int, stop: int) -> None:
    """A step calling table rows [start, stop) (none if the run is empty)."""
    if stop <= start: return
    rows = ctypes.addressof(self.table) + start * ctypes.sizeof(CallEntry)
    self.steps.append((caller, [ctypes.c_void_p(rows), stop - start, self.pointers, self.ints]))

  def set_argument(self, index: int, position: int, value: Any) -> None:
    """Argument `position` of launch `index`: a buffer handle (positions before its buffer count) or an int."""
    first_pointer, first_int, buffers = self.places[index]
    direct = self.direct.get(index)
    if position < buffers:
      address = self.address_of(value)
      self.pointers[first_pointer + position] = address
      if direct is not None: direct[position] = ctypes.c_void_p(address)
    else:
      self.ints[first_int + position - buffers] = value
      if direct is not None: direct[position] = value

  def share_int_arguments(self, indices: list[int]) -> list[int]:
    """Point the kernels `indices`, which take the same Variables in the same order (and so always the same values),
    at the first one's int arguments: a new value is then one write for all of them. Returns the kernels whose int
    arguments set_argument must still be told: that first one, and any called through ctypes."""
    rows = [index for index in indices if index not in self.direct]
    if not rows: return list(indices)
    owner = self.table[rows[0]].first_int
    for index in rows[1:]:
      self.table[index].first_int = owner
      first_pointer, _, buffers = self.places[index]
      self.places[index] = (first_pointer, owner, buffers)
    return [rows[0]] + [index for index in indices if index in self.direct]

  def set_launch_size(self, index: int, global_size: tuple[int, ...], local_size: tuple[int, ...]) -> None:
    """Nothing: a host kernel's loops compute their own bounds from its int arguments."""

  def launch(self) -> None:
    for function, arguments in self.steps: function(*arguments)
