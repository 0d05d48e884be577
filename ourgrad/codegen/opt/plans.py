"""Typed plans: what an optimization strategy chose for a kernel, as a frozen dataclass that prints, saves and replays.

A *strategy* (a `Strategy`: shared-memory matmul tiles, tensor cores, WGMMA, window tiles, ...) recognizes the
kernels it fits (`applies`, then `choose`) and returns a *plan* (a `Plan`): the choice spelled out in named fields
(a tile's threads and outputs, a tensor core, stages, padding), not packed into an Opt's amount. `plan.apply(kernel)`
turns the plan into the Kernel's Opts; it gives the same kernel on the same AST every time, so a plan BEAM stores
(codegen/opt/beam_cache.py, `plan_to_json` / `plan_from_json`) replays. The heuristic (codegen/opt/heuristic.py)
walks the strategies in one declared order (`STRATEGIES`, filled by the modules that define them); BEAM's action space
asks the same strategies for the Opts they own (`Strategy.beam_actions`, codegen/opt/search.py).

    Plan                  base: apply(kernel) -> bool, repr, JSON
    OptsPlan              a plain sequence of Opts (a BEAM search's result; a strategy not yet typed)
    Strategy              base: name, applies(kernel), choose(kernel) -> (plan, kernel) | None, match, beam_actions
    RecognizerStrategy    a strategy still written as a function that applies Opts in place (its plan: OptsPlan)
    register_plan(cls)    a Plan (or a dataclass inside one) JSON can name
    first_plan            the heuristic's walk: the first strategy whose plan fits, applied
    strategies_left_out   a registry without some strategies for a block (a benchmark's "before")
    replay                a plan (from BEAM's cache) applied to a fresh kernel
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

from ourgrad.codegen.opts import KernelOptError, Opt, OptOps, TileStages
from ourgrad.codegen.shared_tiles import SharedStructure
from ourgrad.ops import MemBuffer

if TYPE_CHECKING:
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.shape.shapetracker import ShapeTracker

# the dataclasses a plan's JSON may name (plans and the dataclasses in their fields), by class name
_JSON_TYPES: dict[str, type] = {}


def register_plan(cls: type) -> type:
  """Class decorator: a Plan, or a frozen dataclass a plan holds, that plan_from_json can rebuild by its name."""
  _JSON_TYPES[cls.__name__] = cls
  return cls


# the typed args of OptOps.SHARED (an Opt in a plan, BEAM's cache included, keeps them)
register_plan(SharedStructure)
register_plan(TileStages)


@dataclass(frozen=True)
class Plan:
  """What a strategy chose for one kernel. Subclasses are frozen dataclasses of plain fields (ints, bools, nested
  registered dataclasses, tuples of Opts); `apply` adds the plan's Opts to a kernel not yet optimized."""

  def apply(self, kernel: Kernel) -> bool:
    """Apply the plan's Opts to `kernel` in place; False where they do not fit (the kernel may then hold some of them:
    pass a copy)."""
    raise NotImplementedError


@register_plan
@dataclass(frozen=True)
class OptsPlan(Plan):
  """A plain sequence of Opts, named by the strategy (or "search") that chose it."""
  strategy: str
  opts: tuple[Opt, ...]

  def apply(self, kernel: Kernel) -> bool:
    return all(kernel.try_opt(opt) for opt in self.opts)


def _encode(value: Any) -> Any:
  if isinstance(value, Opt):
    encoded = {"type": "Opt", "op": value.op.name, "axis": value.axis, "amount": value.amount}
    return encoded if value.arg is None else {**encoded, "arg": _encode(value.arg)}
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    if type(value).__name__ not in _JSON_TYPES: raise TypeError(f"{type(value).__name__} is not a registered plan")
    return {"type": type(value).__name__, **{field.name: _encode(getattr(value, field.name))
                                             for field in dataclasses.fields(value)}}
  if isinstance(value, (tuple, list)): return [_encode(item) for item in value]
  if value is None or isinstance(value, (bool, int, str)): return value
  raise TypeError(f"a plan field holds {type(value).__name__}, which JSON cannot keep")


def _decode(value: Any) -> Any:
  if isinstance(value, list): return tuple(_decode(item) for item in value)
  if not isinstance(value, dict): return value
  fields = {name: _decode(item) for name, item in value.items() if name != "type"}
  if value.get("type") == "Opt": return Opt(OptOps[fields["op"]], fields["axis"], fields["amount"], fields.get("arg"))
  return _JSON_TYPES[value["type"]](**fields)


def plan_to_json(plan: Plan) -> Any:
  """The plan as JSON-ready values: each dataclass a dict with its class name under "type"."""
  return _encode(plan)


def plan_from_json(data: Any) -> Plan:
  """The plan plan_to_json wrote; ValueError where the data names no registered plan or has other fields."""
  try:
    plan = _decode(data)
  except (KeyError, TypeError) as error:
    raise ValueError(f"not a plan: {data!r} ({error})") from None
  if not isinstance(plan, Plan): raise ValueError(f"not a plan: {data!r}")
  return plan


class Strategy:
  """One way of optimizing a kind of kernel. `applies` is the cheap guard (device kind, a reduce or not);
  `choose` finds the plan and the kernel it gives (the kernel passed in untouched); `match` is choose's plan.
  `beam_actions` lists the Opts of this strategy's own kinds that BEAM may try on `kernel` (see search.py)."""
  name = "strategy"
  beam_ops: tuple[OptOps, ...] = ()   # the Opt kinds whose BEAM actions this strategy lists

  def applies(self, kernel: Kernel) -> bool: return True

  def choose(self, kernel: Kernel) -> tuple[Plan, Kernel] | None: raise NotImplementedError

  def match(self, kernel: Kernel) -> Plan | None:
    chosen = self.choose(kernel) if self.applies(kernel) else None
    return chosen[0] if chosen is not None else None

  def beam_actions(self, kernel: Kernel) -> Iterator[Opt]: return iter(())

  def __repr__(self) -> str: return f"{type(self).__name__}({self.name!r})"


class RecognizerStrategy(Strategy):
  """A strategy still written as a function that applies its Opts to the kernel in place and returns whether it did
  (`recognize`), behind a guard (`guard`); its plan is the Opts it applied (OptsPlan)."""

  def __init__(self, name: str, guard: Callable[[Kernel], bool], recognize: Callable[[Kernel], Any]):
    self.name, self._guard, self._recognize = name, guard, recognize

  def applies(self, kernel: Kernel) -> bool: return self._guard(kernel)

  def choose(self, kernel: Kernel) -> tuple[Plan, Kernel] | None:
    trial = kernel.copy()
    if self._recognize(trial) is False: return None
    return OptsPlan(self.name, tuple(trial.applied_opts[len(kernel.applied_opts):])), trial


# which kernels a strategy is for (its `applies`): the renderer's kind and whether the kernel reduces
def gpu_reduce(kernel: Kernel) -> bool:
  """A reduce kernel on a renderer of thread blocks."""
  return kernel.renderer.has_threads and kernel.reduceop is not None


def gpu_local_reduce(kernel: Kernel) -> bool:
  """A reduce kernel on a renderer of thread blocks with local (shared) memory."""
  return gpu_reduce(kernel) and getattr(kernel.renderer, "has_local", False)


def gpu_elementwise(kernel: Kernel) -> bool:
  """A kernel without a reduce on a renderer of thread blocks."""
  return kernel.renderer.has_threads and kernel.reduceop is None


def cpu_reduce(kernel: Kernel) -> bool:
  """A reduce kernel on a CPU renderer (no thread blocks)."""
  return not kernel.renderer.has_threads and kernel.reduceop is not None


def memory_loads(kernel: Kernel) -> list[ShapeTracker]:
  """The views of the kernel's loads from memory (not its constants), in AST order: what strategies match on."""
  return [st for st, leaf in zip(kernel.sts[1:], kernel.leaves[1:]) if isinstance(leaf.arg, MemBuffer)]


def first_plan(strategies: list[Strategy], kernel: Kernel) -> Plan | None:
  """Walk `strategies` in order: the first whose plan fits is applied to `kernel` in place (kernel.plan records it);
  None where none fits (the kernel untouched)."""
  for strategy in strategies:
    if not strategy.applies(kernel): continue
    chosen = strategy.choose(kernel)
    if chosen is None: continue
    plan, optimized = chosen
    kernel.__dict__.update(optimized.__dict__)
    kernel.plan = plan
    return plan
  return None


@contextlib.contextmanager
def strategies_left_out(strategies: list[Strategy], *names: str) -> Iterator[None]:
  """`strategies` (a registry: changed in place) without the strategies named, until the block ends: how a benchmark
  measures the heuristic as it was before a strategy."""
  kept = list(strategies)
  strategies[:] = [strategy for strategy in kept if strategy.name not in names]
  try:
    yield
  finally:
    strategies[:] = kept


def replay(plan: Plan, kernel: Kernel) -> Kernel:
  """A copy of `kernel` with `plan` applied (kernel.plan set); KernelOptError where it does not fit."""
  new = kernel.copy()
  if not plan.apply(new): raise KernelOptError(f"{plan!r} does not fit {kernel.name}")
  new.plan = plan
  return new
