"""Multi-output kernels: which realized bases one kernel writes (a part of the scheduler, engine/schedule.py).

`group_outputs(bases, realizes)` takes the realized bases once every realization is settled and returns the kernels
to build, each a list of bases in graph order. Elementwise kernels over one iteration space (same device and shape)
share a kernel, an assign's value read in place by another member included (an optimizer's m, v and parameter
updates); on a GPU, kernels of sibling reduces (same loop shape, axes, op and dtype, a common input or reduce,
neither needing the other's result), each storing a reduce or elementwise work on several of them (batchnorm's
partial sums; its second stages with the mean, inverse std and running variance from them), share one loop
(`SIBLING_REDUCES`, `COMBINED_SIBLING_REDUCES`, `MAX_SIBLING_REDUCES`). Every grouping keeps a run order: groups on a
cycle of the run-order constraints are split (`_split_cyclic_groups`), the others kept. The walk of each kernel's
fused region (`walk_kernel`, the plans read here) and the run-order constraints (`item_precedence`) come from
engine/kernel_walk.py, the one module this imports from the scheduler; build_schedule calls `group_outputs` and
passes `sibling_limit` to the walks it makes. docs/fusion.md describes the rules.
"""
from __future__ import annotations

from collections import defaultdict

from ourgrad.device import Device
from ourgrad.engine.kernel_walk import (KernelPlan, Realizations, item_precedence, items_on_cycles, reads_assign_target,
                                        reuses_an_operand, walk_kernel)
from ourgrad.lazy import LazyBuffer
from ourgrad.ops import ATTENTION_OPS, ELEMENTWISE_OPS, Ops
from ourgrad.shape.shapetracker import ShapeTracker

# a kernel writing more outputs than this passes more pointers than some launchers like, and gains little more
MAX_KERNEL_OUTPUTS = 16
# sibling reduces in one kernel (an accumulator each per thread and upcast lane, and their GROUP partials in local
# memory): batchnorm's backward has 4 over its input (2 for the input's gradient, 2 for the weight's and bias's)
SIBLING_REDUCES = True
MAX_SIBLING_REDUCES = 4
# sibling reduces inside one kernel's value (walk_kernel): elementwise work on several of them (batchnorm's inverse
# std from its two sums) is done after them in their kernel, rather than with all but one of them stored first
COMBINED_SIBLING_REDUCES = True


def group_outputs(bases: list[LazyBuffer], realizes: Realizations) -> list[list[LazyBuffer]]:
  """The kernels to build, each a list of realized bases (graph order) written by one kernel. Needs the buffers.

  Elementwise kernels over one iteration space (same device and shape, no reduce) become one multi-output kernel.
  A member may read an earlier member only if that is an assign read in place: the read becomes the assign's
  value, computed in the same kernel (an optimizer's parameter update reading the new m and v). A result of
  contiguous() read by another kernel stays a kernel boundary, as asked. Grouping must leave a run order: where
  some kernel outside a group both waits on it and must run before it (a cycle), only the groups on cycles are split
  (`_split_cyclic_groups`); the others, sibling reduces included, keep their kernels."""
  plans: dict[int, KernelPlan] = {}
  for base in bases:
    if id(base) not in realizes: continue
    _, plan = walk_kernel(base, realizes, sibling_limit)
    if plan is not None: plans[id(base)] = plan
  groupable = {id(base): base for base in bases if id(base) in plans and _is_groupable(base, plans[id(base)])}
  readers: dict[int, list[int]] = defaultdict(list)   # base id -> ids of the kernels that load it
  for root_id, plan in plans.items():
    for loaded, _ in plan.loads: readers[id(loaded)].append(root_id)
  while True:
    groups = _bucket_outputs(bases, realizes, plans, groupable)
    cyclic = _groups_on_cycles(groups, plans)
    if not cyclic: return groups
    if not _split_cyclic_groups(cyclic, groupable, readers): break
  # a cycle through kernels of one output each: the graph itself reads a buffer before and after an assign to it
  # (build_schedule's order_items says so)
  return _bucket_outputs(bases, realizes, plans, {})


def _groups_on_cycles(groups: list[list[LazyBuffer]], plans: dict[int, KernelPlan]) -> list[list[LazyBuffer]]:
  """The groups of two or more outputs that lie on a cycle of the items' run-order constraints (loads as the plans
  say, in-group reads computed in place): no run order exists while they stay whole."""
  by_leader = {id(group[0]): group for group in groups}
  reads: dict[int, list[LazyBuffer]] = {}
  for leader, group in by_leader.items():
    member_ids = {id(member) for member in group}
    reads[leader] = [loaded for member in group for loaded in _reads_of(member, plans) if id(loaded) not in member_ids]
  on_cycles = items_on_cycles(item_precedence([group[0] for group in groups], by_leader, reads))
  return [by_leader[leader] for leader in on_cycles if len(by_leader[leader]) > 1]


def _reads_of(base: LazyBuffer, plans: dict[int, KernelPlan]) -> list[LazyBuffer]:
  """The realized bases the item of `base` reads: its kernel's loads, or a copy's or fused attention's sources (they
  have no kernel walk; a cycle may pass through copies between devices: a gather, then a reshard of its result, or
  through an attention backward: dO made contiguous in one group with a gradient computed from dQ)."""
  if base.op is Ops.COPY or base.op in ATTENTION_OPS: return [src.base for src in base.srcs]
  return [loaded for loaded, _ in plans[id(base)].loads] if id(base) in plans else []


def _split_cyclic_groups(cyclic: list[list[LazyBuffer]], groupable: dict[int, LazyBuffer],
                         readers: dict[int, list[int]]) -> bool:
  """Take members out of the groups on cycles (`groupable` shrinks): those that kernels outside their group read (a
  (C,) statistic that joined an optimizer's (C,) updates while the backward reads it and the parameter those
  overwrite), or where none is, every member. False where nothing was left to split."""
  split = False
  for group in cyclic:
    member_ids = {id(member) for member in group}
    read_outside = [member for member in group if any(reader not in member_ids for reader in readers[id(member)])]
    for member in read_outside or group:
      split = groupable.pop(id(member), None) is not None or split
  return split


def _bucket_outputs(bases: list[LazyBuffer], realizes: Realizations, plans: dict[int, KernelPlan],
                    groupable: dict[int, LazyBuffer]) -> list[list[LazyBuffer]]:
  """Realized bases in graph order, each joining a group of its iteration space (or loop) where it may, the newest
  first: a forward's running statistics join its mean and inverse std past the backward's second stages."""
  groups: list[list[LazyBuffer]] = []
  open_groups: dict[tuple, list[list[LazyBuffer]]] = defaultdict(list)
  for base in bases:
    if id(base) not in realizes or base.size == 0: continue
    if id(base) not in groupable:
      groups.append([base])
      continue
    candidates = open_groups[_group_key(base, plans)]
    group = next((group for group in reversed(candidates) if _may_join(group, base, plans)), None)
    if group is None:
      group = []
      candidates.append(group)
      groups.append(group)
    group.append(base)
  return groups


def _may_join(group: list[LazyBuffer], base: LazyBuffer, plans: dict[int, KernelPlan]) -> bool:
  if len(group) >= MAX_KERNEL_OUTPUTS or _targets_clash(group, base, plans): return False
  # successive assigns to one buffer (x += 1; x += 1) stay kernels of their own: one kernel's stores to one buffer
  # through two arguments have no order
  if base.op is Ops.ASSIGN and any(member.realized is base.realized for member in group): return False
  if plans[id(base)].reduce_bases and not _may_join_siblings(group, base, plans): return False
  member_ids = {id(member) for member in group}
  if not plans[id(base)].reduce_bases and not _shares_a_read(group, base, plans, member_ids): return False
  for loaded, view in plans[id(base)].loads:
    if id(loaded) in member_ids and (loaded.op is not Ops.ASSIGN or view != _in_place(loaded)): return False
  # nor may a member read `base`: bases come in graph order, but a snapshot that a shared subgraph reads is placed
  # before one of its readers only (schedule.py _snapshot_old_read)
  return not any(loaded is base for member in group for loaded, _ in plans[id(member)].loads)


def _shares_a_read(group: list[LazyBuffer], base: LazyBuffer, plans: dict[int, KernelPlan],
                   member_ids: set[int]) -> bool:
  """Whether elementwise kernel `base` reads a buffer some member reads, or a member itself (an optimizer's update
  reading the new moments): only then does one kernel save memory traffic. Independent outputs stay kernels of their
  own: small ones are packed into one launch later (engine/packing.py), and large ones run slower together (the
  compiler keeps all their loads in flight: GPT-2's twelve transposed qkv gradients as one kernel took 255 registers
  a thread and 0.68 ms on the H200; the 2-layer step's two took 69 us)."""
  read_by_group = {id(loaded) for member in group for loaded, _ in plans[id(member)].loads} | member_ids
  return any(id(loaded) in read_by_group for loaded, _ in plans[id(base)].loads)


def _may_join_siblings(group: list[LazyBuffer], base: LazyBuffer, plans: dict[int, KernelPlan]) -> bool:
  """Whether sibling reduce kernel `base` may join `group` (same loop): at most MAX_SIBLING_REDUCES reduces in all,
  a common input or reduce (only then one loop gains), and no need of a member's result."""
  reduces = {id(reduce) for member in group + [base] for reduce in plans[id(member)].reduce_bases}
  if len(reduces) > MAX_SIBLING_REDUCES: return False
  shared = {id(loaded) for member in group for loaded, _ in plans[id(member)].loads}
  shared |= {id(reduce) for member in group for reduce in plans[id(member)].reduce_bases}
  plan = plans[id(base)]
  if not any(id(loaded) in shared for loaded, _ in plan.loads) and not any(id(r) in shared for r in plan.reduce_bases):
    return False
  # a reduce that needs a member's result through other kernels (a variance's sum needs the mean's) runs after it
  return not _reaches(base, {id(member) for member in group}, plans)


def _reaches(base: LazyBuffer, targets: set[int], plans: dict[int, KernelPlan]) -> bool:
  """Whether the kernel of `base` reads one of `targets` (ids of realized bases), directly or through the kernels
  that compute what it reads."""
  stack, seen = [base], set()
  while stack:
    node = stack.pop()
    for loaded, _ in plans[id(node)].loads if id(node) in plans else ():
      if id(loaded) in targets: return True
      if id(loaded) not in seen:
        seen.add(id(loaded))
        stack.append(loaded)
  return False


def _is_groupable(base: LazyBuffer, plan: KernelPlan) -> bool:
  if base.size == 0: return False
  if plan.has_reduce: return _is_sibling_kernel(base, plan)
  return base.op in ELEMENTWISE_OPS or base.op in (Ops.ASSIGN, Ops.CONTIGUOUS)


def sibling_limit(device: str) -> int:
  """How many sibling reduces one kernel's value on `device` may combine (walk_kernel): MAX_SIBLING_REDUCES where
  sibling reduces share kernels (`_siblings_share_kernels`) and COMBINED_SIBLING_REDUCES is on, else 1."""
  return MAX_SIBLING_REDUCES if COMBINED_SIBLING_REDUCES and _siblings_share_kernels(device) else 1


def _siblings_share_kernels(device: str) -> bool:
  """Whether sibling reduces may share a kernel on `device`: one with thread blocks and local memory, while
  SIBLING_REDUCES is on. A CPU's reduce defaults (SIMD lanes, matmul tiles) are for one reduce."""
  return SIBLING_REDUCES and Device[device].renderer.runs_thread_blocks


def _is_sibling_kernel(base: LazyBuffer, plan: KernelPlan) -> bool:
  """A kernel of sibling reduces and elementwise work on their results only (batchnorm's sums over N, H, W, their
  split's parts; the mean and inverse std from the sums' second stages), on a GPU: it may share one loop with the
  other such kernels of its loop shape and axes that read a common input or compute a common reduce, each reduce an
  accumulator of its own, so that input is loaded once (codegen: Kernel.sibling_reduces). Not a row kernel, nor a
  matmul's or convolution's reduce (`reuses_an_operand`)."""
  if plan.row_kernel or not plan.reduce_bases or not _siblings_share_kernels(base.device): return False
  return not any(reuses_an_operand(reduce, plan) for reduce in plan.reduce_bases)


def _group_key(base: LazyBuffer, plans: dict[int, KernelPlan]) -> tuple:
  """Kernels of one key may share a kernel: elementwise ones of one iteration space, sibling reduce kernels of one
  loop (their outputs are stored in the reduces' shape)."""
  plan = plans.get(id(base))
  if plan is not None and plan.reduce_bases:
    reduce = plan.reduce_bases[0]
    return ("reduce", reduce.device, reduce.shape, reduce.op, reduce.dtype, reduce.arg, reduce.srcs[0].shape)
  return ("elementwise", base.device, base.shape)


def _in_place(base: LazyBuffer) -> ShapeTracker:
  return ShapeTracker.from_shape(base.shape).simplify()


def _targets_clash(group: list[LazyBuffer], base: LazyBuffer, plans: dict[int, KernelPlan]) -> bool:
  """Whether one kernel writing `group` and `base` would read a buffer it overwrites anywhere but in place, or
  read it in place in a member whose result the overwriting member's value does not use: only a data dependency
  (the stored value needs the loaded one) orders the load before the store whatever order a code generator or
  compiler emits the members' accesses in (gcc and LLVM stored an assigned constant first when the buffer was also
  passed as a second `restrict` pointer; engine/schedule.py now reads an output through its own argument). An
  optimizer's momentum, read by its parameter's update, has that dependency."""
  members = group + [base]
  member_ids = {id(member) for member in members}
  assigns = [(member, member.srcs[1].base) for member in members if member.op is Ops.ASSIGN]
  for member in members:
    for loaded, view in plans[id(member)].loads:
      for writer, target in assigns:
        if not reads_assign_target(loaded, target): continue
        if view != _in_place(member): return True
        # (a member's own result, read in place, is computed in this kernel: no load of the old contents)
        if id(loaded) not in member_ids and not _uses_member(writer, member, plans, member_ids): return True
  return False


def _uses_member(user: LazyBuffer, member: LazyBuffer, plans: dict[int, KernelPlan], member_ids: set[int]) -> bool:
  """Whether the value of group member `user` is computed from member `member` (itself included), through the
  members it reads in the kernel."""
  stack, seen = [user], {id(user)}
  while stack:
    node = stack.pop()
    if node is member: return True
    for loaded, _ in plans[id(node)].loads:
      if id(loaded) in member_ids and id(loaded) not in seen:
        seen.add(id(loaded))
        stack.append(loaded)
  return False
