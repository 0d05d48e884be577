"""The scheduler's store-or-recompute rules (engine/schedule.py asks them while choosing realizations): whether an
elementwise intermediate read by several kernels is stored once or recomputed inline in each. A producer that would
compute an unrealized reduce again per reader (a matmul's product) is stored; otherwise bytes decide: the inputs every
reader would load again against one write, its reads and one more launch (`_store_or_recompute`). After operand
staging stores a matmul's product, `_reconsider_reduce_stores` puts the bases stored for that reason back to the
byte rule. docs/fusion.md lists the reasons."""
from __future__ import annotations

from collections import defaultdict
from typing import Callable

from ourgrad.device import Device
from ourgrad.engine.kernel_walk import Realizations, joins_rows
from ourgrad.helpers import fmt_size
from ourgrad.lazy import LazyBuffer
from ourgrad.ops import ELEMENTWISE_OPS, REDUCE_OPS, Ops


def _store_or_recompute(bases: list[LazyBuffer], realizes: Realizations, users: dict[int, set[int]],
                        kernel_of: Callable[[int], int], by_id: dict[int, LazyBuffer]) -> None:
  """Store an elementwise intermediate read by several kernels when recomputing it in each costs more memory traffic
  than storing it once. Fused, each of the n kernels reading it loads every input of its fused graph again; stored,
  the inputs are read once, the result written once and read n times, and there is one more launch (the device's
  `launch_bytes`). Without this rule a chain such as a transformer's residual stream (x = x + attention(x), then
  x = x + mlp(x), each x read by a LayerNorm and by the next add) is recomputed from every earlier layer's output in
  every later layer: kernels that read O(depth) buffers, a step whose time grows with depth squared.

  Bases are visited sources first, so a base stored here becomes a plain load in the graphs of the bases after it.
  Row kernels are unaffected: softmax's exp(x - max) reads one input, and recomputing it costs less than a store."""
  launch_bytes: dict[str, int] = {}

  def reading_kernel(user: int) -> int:
    """The kernel a reader fuses into; a reduce not realized with one user joins that user's kernel (a row kernel:
    softmax's sum of exp(x - max) is in the kernel that reads the sum, beside the max), and so does an unrealized
    value (a reduce or elementwise) whose users all end in one kernel (`_converged`: a split softmax's max, read
    inside its exp and by the log-sum-exp it stores)."""
    kernel = kernel_of(user)
    while kernel in by_id and kernel not in realizes and by_id[kernel].op in REDUCE_OPS | ELEMENTWISE_OPS:
      if by_id[kernel].op in REDUCE_OPS and len(users[kernel]) == 1: kernel = kernel_of(next(iter(users[kernel])))
      else:
        end = _converged(kernel, users, realizes, kernel_of, by_id)
        if end is None or end == kernel: break
        kernel = end
    return kernel

  for base in bases:
    if base.realized is not None or id(base) in realizes or base.op not in ELEMENTWISE_OPS: continue
    if not isinstance(base.size, int): continue   # a symbolic size (a Variable): no byte count to compare
    readers = {reading_kernel(user) for user in users[id(base)]}
    if len(readers) < 2: continue
    if _recomputes_a_reduce(base, realizes):
      kernels = _kernels_reading(id(base), realizes, users, by_id)
      if len(kernels) > 1:
        realizes[id(base)] = f"stored, not recomputed: {len(kernels)} kernels read it, and {RECOMPUTES_A_REDUCE}"
      continue
    if base.device not in launch_bytes:
      launch_bytes[base.device] = getattr(Device[base.device].renderer, "launch_bytes", 0)
    reason = _storing_saves_bytes(base, len(readers), realizes, launch_bytes[base.device])
    if reason is not None: realizes[id(base)] = reason


def _converged(start: int, users: dict[int, set[int]], realizes: Realizations, kernel_of: Callable[[int], int],
               by_id: dict[int, LazyBuffer]) -> int | None:
  """The one kernel that every use of the unrealized value `start` ends in, following its users' kernels through
  unrealized reduces and elementwise values read by several; None where they end in more than one (or none)."""
  ends: set[int] = set()
  stack, seen = [kernel_of(user) for user in users[start]], {start}
  while stack and len(ends) < 2:
    kernel = stack.pop()
    if kernel in seen: continue
    seen.add(kernel)
    if kernel in realizes or kernel not in by_id or not users[kernel] or \
        by_id[kernel].op not in REDUCE_OPS | ELEMENTWISE_OPS:
      ends.add(kernel)
    else: stack.extend(kernel_of(user) for user in users[kernel])
  return next(iter(ends)) if len(ends) == 1 else None


RECOMPUTES_A_REDUCE = "each would compute the reduce (a matmul's product) inside it again"


def _storing_saves_bytes(base: LazyBuffer, readers: int, realizes: Realizations, launch_bytes: int) -> str | None:
  """The reason to store `base`, read by `readers` kernels, where that moves fewer bytes than recomputing it in each
  (one more launch counted as `launch_bytes`); None where recomputing is cheaper or a size is symbolic."""
  input_bytes = _fused_input_bytes(base, realizes)
  if input_bytes is None: return None
  output_bytes = base.size * base.dtype.itemsize
  recompute_cost = readers * input_bytes
  store_cost = input_bytes + (1 + readers) * output_bytes + launch_bytes
  if recompute_cost <= store_cost: return None
  return (f"stored, not recomputed: {readers} kernels read it; recomputing moves {fmt_size(recompute_cost)}, "
          f"storing {fmt_size(store_cost)} (one launch included)")


def _reconsider_reduce_stores(bases: list[LazyBuffer], realizes: Realizations) -> None:
  """Operand staging stores a matmul's result where WGMMA fuses no epilogue. An elementwise base stored only so that
  its readers would not each compute that matmul again (a Linear's x @ W + b, read by GELU and by GELU's gradient)
  now reads the stored product: it stays stored only where the byte rule says so (a bias add recomputed in its two
  readers reads the same bytes as the stored sum, and saves its kernel: a full write and read of the activation).
  Kept where a reader's kernel is not elementwise (a matmul's operand must stay a plain load for its plan)."""
  candidates = [base for base in bases if realizes.get(id(base), "").endswith(RECOMPUTES_A_REDUCE)]
  if not candidates: return
  users: dict[int, set[int]] = defaultdict(set)
  for base in bases:
    for src in base.srcs: users[id(src.base)].add(id(base))
  by_id = {id(base): base for base in bases}
  for base in candidates:
    reason = realizes.pop(id(base))
    kernels = _kernels_reading(id(base), realizes, users, by_id)
    if base.forced_realize or _recomputes_a_reduce(base, realizes) or \
        any(kernel not in by_id or by_id[kernel].op not in ELEMENTWISE_OPS for kernel in kernels):
      realizes[id(base)] = reason
      continue
    launch_bytes = getattr(Device[base.device].renderer, "launch_bytes", 0)
    stored = _storing_saves_bytes(base, len(kernels), realizes, launch_bytes)
    if stored is not None: realizes[id(base)] = stored


def _kernels_reading(base_id: int, realizes: Realizations, users: dict[int, set[int]],
                     by_id: dict[int, LazyBuffer]) -> set[int]:
  """The kernels (their root bases) that read `base_id` inline: its users' kernels, following every unrealized
  elementwise user forward (GELU's formula reads x several times, all inside one kernel)."""
  kernels, stack, seen = set(), [base_id], {base_id}
  while stack:
    for user in users[stack.pop()]:
      if user in seen: continue
      seen.add(user)
      if user in realizes or user not in by_id or by_id[user].op not in ELEMENTWISE_OPS: kernels.add(user)
      else: stack.append(user)
  return kernels


def _recomputes_a_reduce(base: LazyBuffer, realizes: Realizations) -> bool:
  """Whether computing `base` inline computes an unrealized reduce again, element for element: its fused
  elementwise graph reads a reduce's result without broadcasting it (a Linear's x @ W + b, where each output
  element is a whole dot product). Fused into n kernels, the reduce would run n times, which no byte count shows.
  A reduce read through a broadcast (softmax's max, layernorm's mean) is a per-row value a row kernel computes
  once per row: not counted. `_is_per_row_value` bases (math on reduce results only) are left to the row kernels."""
  if _is_per_row_value(base): return False
  stack, seen = [base], {id(base)}
  while stack:
    node = stack.pop()
    for src in node.srcs:
      src_base = src.base
      if id(src_base) in seen or src_base.realized is not None or id(src_base) in realizes: continue
      if src.st.size != src_base.size: continue   # broadcast (or a part): per-row values below, not per element
      seen.add(id(src_base))
      if src_base.op in REDUCE_OPS: return True
      if src_base.op in ELEMENTWISE_OPS: stack.append(src_base)
  return False


def _fused_input_bytes(base: LazyBuffer, realizes: Realizations) -> int | None:
  """The bytes a kernel loads to compute `base` inline: the result of every base its fused elementwise graph reads
  (buffers, reduces, gathers), once each, at most its whole size. None where a size is symbolic."""
  total, stack, seen = 0, [base], {id(base)}
  while stack:
    node = stack.pop()
    for src in node.srcs:
      src_base = src.base
      if id(src_base) in seen: continue
      seen.add(id(src_base))
      if src_base.op is Ops.CONST: continue
      fused = src_base.realized is None and id(src_base) not in realizes
      # an elementwise op is computed inline; so is a reduce not realized (yet): a row kernel recomputes it from its
      # input (a per-row logsumexp read by a loss and by its gradient: each would read the whole row again)
      if fused and (src_base.op in ELEMENTWISE_OPS or (src_base.op in REDUCE_OPS and joins_rows(src_base))):
        stack.append(src_base)
      # a buffer, or another op whose result the kernel reads: counted as loading its result
      elif isinstance(src.st.size, int) and isinstance(src_base.size, int):
        total += min(src.st.size, src_base.size) * src_base.dtype.itemsize
      else: return None
  return total


def _is_per_row_value(base: LazyBuffer) -> bool:
  """Whether `base` is elementwise math on unrealized reduce results and constants only (layernorm's
  rsqrt(var + eps)): a row kernel computes it from registers, so fusing it moves no memory."""
  stack, seen, reaches_reduce = [base], set(), False
  while stack:
    node = stack.pop()
    if id(node) in seen: continue
    seen.add(id(node))
    if node.realized is not None: return False
    if node.op in REDUCE_OPS:
      reaches_reduce = True
      continue
    if node.op is Ops.CONST: continue
    if node.op not in ELEMENTWISE_OPS: return False
    stack.extend(src.base for src in node.srcs)
  return reaches_reduce
