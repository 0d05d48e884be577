"""Random ourgrad programs written twice, for ourgrad and for PyTorch: the generator behind fuzz_torch.

A `Program` is its input arrays and a list of `Step`s; each step is one line of ourgrad code and the same line for
PyTorch (`v3 = v1.amax(dim=-1)` is the same text for both; `v4 = v2.cast(dtypes.float16)` is `v4 =
v2.to(torch.float16)`). `TorchGen` draws the steps from a `random.Random` and runs each one at once on PyTorch
(CPU, eager): PyTorch is the reference for every shape, dtype and value, and a step PyTorch refuses is dropped (or,
now and then, kept as a step that ourgrad must refuse too). ourgrad runs only later, the whole program at once
(`run_ourgrad`), so the generator never depends on what ourgrad does.

What the steps cover: inputs of float32/float16/int32/int64/bool (realized or lazy, some `requires_grad`, some
made by Tensor.full/zeros/ones), Python
scalars and 0-d tensors as operands, unary and binary elementwise ops (comparisons, where, casts, bitwise ops,
// and %), reduces (sum/mean/amax/amin/max(dim=)/any/all/argmax/var/std; keepdim, negative and tuple axes),
movement (reshape, permute, transpose, expand, squeeze/unsqueeze, pad, shrink, flip, cat, stack), indexing
(ints, slices with positive and negative steps, None, tensor indices, gather), in-place writes (assign, +=, -=,
*=, setitem) into inputs, computed tensors and views of them, `realize()` at random points, `observe()` of a
value in the middle of the program (a read: the value is compared there), and a backward pass of a scalar loss
whose leaves' gradients are compared.

Semantics the generator keeps to, so that PyTorch's eager answer is the one right answer (docs/reliability.md):
- a write changes its *root* (the tensor owning the storage) and every view of it; values computed before the
  write keep the old contents. A value that is a view in ourgrad but a copy in PyTorch (flip, pad, a negative
  step, `x*1`, a reshape PyTorch copies, a same-dtype cast: docs/api.md and reliability.md document these) or the
  reverse is *ambiguous*: it is never written to, and never read once a root it came from has been written;
- values that require grad are never written, and a root read by them is never written afterwards (PyTorch
  raises at backward where ourgrad would use the new values: reliability.md, "Not covered");
- decisions that a last-bit rounding difference could flip (a float comparison, floor, a float -> int cast,
  argmax over near-ties) are only generated on *exact* values (PyTorch's float64 recomputation of the step gives
  the same numbers), or where the operands keep a margin larger than the tolerance.
"""
from __future__ import annotations

import random
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fuzzing import random_factorization, random_shrink_bounds

# dtypes the programs use: name -> (numpy dtype, weight when drawing an input)
DTYPES: dict[str, tuple[Any, int]] = {"float32": (np.float32, 6), "float16": (np.float16, 2), "int32": (np.int32, 3),
                                      "int64": (np.int64, 1), "bool": (np.bool_, 2)}
FLOAT_NAMES = ("float32", "float16")
# relative tolerance of a float value that is not exact (float16: a few of its 2**-10 ulps)
TOLERANCE = {"float32": 2e-4, "float16": 2e-2, "float64": 1e-9}
# largest magnitude a value may reach (float16 overflows at 65504; squares and sums must stay finite)
MAX_MAGNITUDE = {"float32": 1e6, "float16": 2e3, "float64": 1e6, "int32": 2 ** 24, "int64": 2 ** 24}
MAX_ELEMENTS = 192
# ops whose zero may have either sign (a sum starts from +0 or from its first element; max(-0, +0) picks either)
SIGNLESS_ZERO = ("sum", "mean", "var", "std", "amax", "amin", "max", "min", "maximum", "minimum", "relu", "clamp",
                 "sign")
INEXACT_UNARY = ("exp", "log", "sqrt", "sin", "sigmoid", "tanh")
FLOAT_SCALARS = [0.5, -1.5, 2.0, 0.25, 3.0, -0.75, 1.0, -2.0, 0.0]
INT_SCALARS = [-3, -2, -1, 1, 2, 3, 4, 0]


class Rejected(Exception):
  """The step does not fit (PyTorch refused it, or it would make a decision on a rounding margin)."""


@dataclass
class Step:
  """One line of the program. `kind`: input, op, write, realize, observe, backward. `expect_error`: PyTorch raises
  on it, so ourgrad must raise too (and the program goes on without it). An observe step compares `name` there,
  `exact` (bitwise, sign of zero included where `signed_zeros`) or within `tolerance` times `scale` (the tolerance
  of the least precise float dtype the value went through: TOLERANCE)."""
  kind: str
  og: str
  pt: str
  expect_error: bool = False
  name: str = ""
  exact: bool = True
  scale: float = 1.0
  signed_zeros: bool = True
  tolerance: float = 2e-4


@dataclass
class Program:
  """A random program: the input arrays and the steps that read them (as `inputs[i]`)."""
  inputs: list[np.ndarray]
  steps: list[Step]
  device: str = "CLANG"

  def source(self, library: str) -> str:
    """The program as a standalone script for "ourgrad" or "torch" (inputs written out)."""
    if library == "ourgrad":
      header = ["import numpy as np", "from ourgrad import Tensor, dtypes", f"device = {self.device!r}"]
    else:
      header = ["import numpy as np", "import torch", "import torch.nn.functional as F"]
    header += ["def observe(label, value):", "  print(label, None if value is None else value.detach().numpy())",
               "inputs = ["]
    for array in self.inputs:
      header.append(f"  np.array({array.tolist()!r}, dtype=np.{array.dtype.name}).reshape({array.shape}),")
    header.append("]")
    lines = []
    for step in self.steps:
      code = step.og if library == "ourgrad" else step.pt
      if step.expect_error: code = f"# torch raises here (so must ourgrad): {code}"
      lines.append(code)
    return "\n".join(header + lines)


# ---------------------------------------------------------------- running a program on either library

@dataclass
class Observation:
  label: str
  value: np.ndarray | None
  dtype: str
  shape: tuple[int, ...]


@dataclass
class Outcome:
  """What one library did with a program: the observations, and the first step that raised (index, error)."""
  observations: list[Observation] = field(default_factory=list)
  error_step: int | None = None
  error: BaseException | None = None
  silent_steps: list[int] = field(default_factory=list)  # expect_error steps that did not raise


def _observer(observations: list[Observation], library: str) -> Any:
  def observe(label: str, value: Any) -> None:
    if value is None:
      observations.append(Observation(label, None, "None", ()))
      return
    if library == "torch":
      array, dtype = value.detach().numpy().copy(), str(value.dtype).removeprefix("torch.")
    else:
      array, dtype = value.numpy().copy(), value.dtype.name
    observations.append(Observation(label, array, dtype, tuple(value.shape)))
  return observe


def torch_namespace(program: Program) -> dict[str, Any]:
  return {"torch": torch, "F": torch.nn.functional, "np": np, "inputs": program.inputs}


def run_torch(program: Program) -> Outcome:
  """Run the PyTorch version; an unexpected error ends it (error_step set), an expected one is skipped."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # PyTorch warns of var()'s correction >= n and a non-leaf's .grad
    return _run_torch(program)


def _run_torch(program: Program) -> Outcome:
  outcome = Outcome()
  namespace = torch_namespace(program)
  namespace["observe"] = _observer(outcome.observations, "torch")
  for index, step in enumerate(program.steps):
    try:
      exec(step.pt, namespace)  # noqa: S102
    except Exception as error:  # noqa: BLE001 - any error of the reference is recorded
      if step.expect_error: continue
      outcome.error_step, outcome.error = index, error
      return outcome
    if step.expect_error: outcome.silent_steps.append(index)
  return outcome


def run_ourgrad(program: Program) -> Outcome:
  """Run the ourgrad version on program.device; the first unexpected error ends it."""
  from ourgrad import Tensor, dtypes
  outcome = Outcome()
  namespace: dict[str, Any] = {"Tensor": Tensor, "dtypes": dtypes, "np": np, "inputs": program.inputs,
                               "device": program.device, "observe": _observer(outcome.observations, "ourgrad")}
  for index, step in enumerate(program.steps):
    try:
      exec(step.og, namespace)  # noqa: S102
    except Exception as error:  # noqa: BLE001 - any error of ourgrad is a finding unless torch raised too
      if step.expect_error: continue
      outcome.error_step, outcome.error = index, error
      return outcome
    if step.expect_error: outcome.silent_steps.append(index)
  return outcome


# ---------------------------------------------------------------- values the generator tracks

@dataclass
class Value:
  """A named value of the program at generation time: its PyTorch tensor and what the generator knows of it."""
  name: str
  tensor: torch.Tensor
  exact: bool
  scale: float
  roots: frozenset[str]          # the roots whose storage it shares (itself when it owns its storage)
  reads: dict[str, int]          # every root it read (through any path) -> that root's version then
  ambiguous: bool = False        # a view in one library and a copy in the other
  born: dict[str, int] = field(default_factory=dict)  # the versions of its roots when it was made
  signed_zeros: bool = True      # the sign of a zero is defined (not after a sum, max, relu, ...: see SIGNLESS_ZERO)
  tolerance: float = 2e-4        # relative error allowed: that of the least precise float dtype in its history
  constant: bool = False         # made by Tensor.full/zeros/ones, or computed from such tensors only
  writable: bool = True          # may be the target of an in-place write

  @property
  def dtype(self) -> str: return str(self.tensor.dtype).removeprefix("torch.")

  @property
  def shape(self) -> tuple[int, ...]: return tuple(self.tensor.shape)

  @property
  def is_float(self) -> bool: return self.tensor.is_floating_point()

  @property
  def grad(self) -> bool: return self.tensor.requires_grad


def og_dtype(name: str) -> str: return f"dtypes.{name}"
def pt_dtype(name: str) -> str: return f"torch.{name}"


def magnitude(tensor: torch.Tensor) -> float:
  if tensor.numel() == 0 or tensor.dtype == torch.bool: return 0.0
  return float(tensor.detach().abs().max().double())


def index_code(items: tuple[Any, ...]) -> str:
  """Python source of a basic index (ints, slices, None, Ellipsis, or code strings for tensor indices)."""
  def one(item: Any) -> str:
    if isinstance(item, slice):
      parts = ["" if item.start is None else str(item.start), "" if item.stop is None else str(item.stop)]
      return ":".join(parts) + (f":{item.step}" if item.step not in (None, 1) else "")
    if item is Ellipsis: return "..."
    if isinstance(item, str): return item
    return repr(item)
  return ", ".join(one(item) for item in items) + ("," if len(items) == 1 else "") if items else "()"


# ---------------------------------------------------------------- the generator

# constructs of known bugs that `avoid` can leave out (fuzz_torch.KNOWN_BUGS says which bug each stands for):
# "stale-view": reading a view of a root after a write to the root; "inplace-cast": an in-place op whose result
# dtype cannot be cast back, kept as a step ourgrad must refuse; "view-write": a write into a view (not into the
# tensor owning the memory); "zero-d-promotion": a 0-d tensor operand of another dtype than the n-d one;
# "negative-zero-rounding": ceil/trunc/round compared bitwise; "constant-write": a write into (a view of) a
# Tensor.full/zeros/ones tensor or a value computed from such tensors only (ourgrad folds it to a constant);
# "float-mod-multiple": a float a % b where a is a multiple of b
AVOIDABLE = ("stale-view", "inplace-cast", "view-write", "zero-d-promotion", "negative-zero-rounding",
             "constant-write", "float-mod-multiple")

# PyTorch errors that ourgrad must raise too (shape and in-place dtype rules); other refusals (an op PyTorch does not
# implement for a dtype, which ourgrad may well support) just drop the step
EXPECTED_ERRORS = ("must match the size", "cannot be broadcast", "can't be cast to the desired output type",
                   "Dimension out of range", "is out of bounds", "shape mismatch", "expanded size",
                   "doesn't match the broadcast shape", "is invalid for input of size")


class TorchRefused(Rejected):
  def __init__(self, message: str, og: str, pt: str):
    super().__init__(message)
    self.og, self.pt = og, pt


class TorchGen:
  """Draws a random program (see the module docstring); `rng` makes every choice."""

  WEIGHTS = {"unary": 6, "binary": 8, "where": 2, "reduce": 5, "movement": 6, "index": 3, "write": 6, "realize": 2,
             "observe": 2, "input": 1}

  def __init__(self, rng: random.Random, device: str = "CLANG", grad: bool = True,
               avoid: frozenset[str] = frozenset()):
    self.rng, self.device = rng, device
    self.np_rng = np.random.default_rng(rng.randrange(2 ** 32))
    self.inputs: list[np.ndarray] = []
    self.steps: list[Step] = []
    self.values: dict[str, Value] = {}
    self.versions: dict[str, int] = {}
    self.frozen: set[str] = set()
    self.namespace: dict[str, Any] = {"torch": torch, "F": torch.nn.functional, "np": np, "inputs": self.inputs}
    self.count = 0
    self.grad = grad
    self.leaves: list[str] = []
    self.avoid = avoid
    self.rejections: dict[str, int] = {}
    # ourgrad's lazy version of the program, built as it is drawn (nothing realized): it tells which results are
    # views of their operands in ourgrad
    from ourgrad import Tensor, dtypes
    self.og_namespace: dict[str, Any] | None = {"Tensor": Tensor, "dtypes": dtypes, "np": np, "inputs": self.inputs,
                                                "device": device}
    self.og_result: Any = None

  # ---------------------------------------------------------------- bookkeeping

  def new_name(self) -> str:
    self.count += 1
    return f"v{self.count - 1}"

  def usable(self, value: Value) -> bool:
    """Not ambiguous-and-overwritten (see the module docstring)."""
    if "stale-view" in self.avoid and any(self.versions[root] != version for root, version in value.born.items()
                                          if root != value.name):
      return False
    if not value.ambiguous: return True
    return all(self.versions[root] == version for root, version in value.reads.items())

  def live(self, predicate: Any = lambda value: True) -> list[Value]:
    return [value for value in self.values.values() if self.usable(value) and predicate(value)]

  def pick(self, predicate: Any = lambda value: True) -> Value:
    """An operand: often the newest value (deep chains), else any (shared subgraphs)."""
    candidates = self.live(predicate)
    if not candidates: raise Rejected("no operand")
    if self.rng.random() < 0.5: return candidates[-1]
    return self.rng.choice(candidates)

  def torch_eval(self, og: str, pt: str) -> torch.Tensor:
    try:
      result = eval(pt, self.namespace)  # noqa: S307
    except Exception as error:  # noqa: BLE001 - PyTorch refusing is part of the generation
      raise TorchRefused(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", og, pt) \
        from error
    if not isinstance(result, torch.Tensor): raise AssertionError(f"{pt} is not a tensor")
    return result

  def check_range(self, tensor: torch.Tensor) -> None:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.numel() > MAX_ELEMENTS: raise Rejected("too big")
    if tensor.dtype == torch.bool or tensor.numel() == 0: return
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor.detach()).all()): raise Rejected("not finite")
    if magnitude(tensor) > MAX_MAGNITUDE.get(dtype, 2 ** 24): raise Rejected("out of range")

  def exact_result(self, pt: str, operands: list[Value], tensor: torch.Tensor) -> bool:
    """Whether both libraries must give these very bits: exact operands and no rounding in the step (PyTorch's
    float64 recomputation gives the same numbers). Non-float results are exact once their decisions have margin."""
    if not tensor.is_floating_point(): return True
    if not all(operand.exact for operand in operands): return False
    shadow = dict(self.namespace)
    for operand in operands:  # ints and bools too: an int -> float op rounds as well
      shadow[operand.name] = operand.tensor.detach().double()
    try:
      again = eval(pt, shadow)  # noqa: S307
    except Exception:  # noqa: BLE001 - no float64 version of the step: call it inexact
      return False
    if not isinstance(again, torch.Tensor) or again.shape != tensor.shape: return False
    return bool(torch.equal(again.detach().double(), tensor.detach().double()))

  def margin(self, operands: list[Value]) -> float:
    """How far a decision must stay from its boundary: 0 for exact operands, else a few tolerances."""
    inexact = [operand for operand in operands if not operand.exact]
    if not inexact: return 0.0
    return 4 * max(operand.tolerance * operand.scale for operand in inexact)

  def require_margin(self, distance: torch.Tensor, operands: list[Value]) -> None:
    """Rejected when a decision is within the rounding margin (distance: from each value to its boundary)."""
    needed = self.margin(operands)
    if needed == 0 or distance.numel() == 0: return
    if float(distance.detach().double().abs().min()) <= needed: raise Rejected("decision margin")

  def og_views(self, og: str, operands: list[Value]) -> set[str] | None:
    """The operands whose memory ourgrad's result of `og` shares (lazily built on the generation namespace), or None
    when ourgrad refused it (the run will report that)."""
    if self.og_namespace is None: return None
    try:
      result = eval(og, self.og_namespace)  # noqa: S307
    except Exception:  # noqa: BLE001 - ourgrad's failures are found when the program runs
      self.og_namespace = None
      return None
    self.og_result = result
    base = result.lazydata.base
    return {operand.name for operand in operands if self.og_namespace[operand.name].lazydata.base is base}

  def og_exec(self, statement: str) -> None:
    if self.og_namespace is None: return
    try:
      exec(statement, self.og_namespace)  # noqa: S102
    except Exception:  # noqa: BLE001 - ourgrad's failures are found when the program runs
      self.og_namespace = None

  def add_value(self, og: str, pt: str, operands: list[Value], view_op: bool = False, exact_op: bool = True,
                signed_zeros: bool = True) -> Value:
    """Run `pt` on PyTorch and name it; classify whether it is a view (in both libraries) of its operands."""
    tensor = self.torch_eval(og, pt)
    self.check_range(tensor)
    name = self.new_name()
    torch_views = {operand.name for operand in operands if _shares_storage(tensor, operand.tensor)}
    og_views = self.og_views(og, operands)
    # without ourgrad's answer: movement ops are views, compute ops make new memory
    if og_views is None: og_views = {operand.name for operand in operands} if view_op else set()
    else: self.og_namespace[name] = self.og_result  # type: ignore[index]
    if tensor.numel() == 0: og_views = torch_views  # no memory to share: nothing to tell apart
    ambiguous = torch_views != og_views or any(self.values[view].ambiguous for view in og_views | torch_views)
    roots = frozenset().union(*(self.values[view].roots for view in torch_views)) if torch_views else frozenset({name})
    reads: dict[str, int] = {}
    for operand in operands: reads.update(operand.reads)
    for root in roots: reads.setdefault(root, self.versions.get(root, 0))
    scale = max([1.0, magnitude(tensor)] + [operand.scale for operand in operands])
    exact = self.exact_result(pt, operands, tensor) if exact_op or not tensor.is_floating_point() else False
    signed_zeros = signed_zeros and all(operand.signed_zeros for operand in operands) and not any(
      f".{function}(" in pt for function in SIGNLESS_ZERO)
    tolerance = max([TOLERANCE.get(str(tensor.dtype).removeprefix("torch."), 0.0)]
                    + [operand.tolerance for operand in operands])
    value = Value(name, tensor, exact, scale, roots, reads, ambiguous,
                  born={root: self.versions.get(root, 0) for root in roots}, signed_zeros=signed_zeros,
                  tolerance=tolerance)
    value.writable = not ambiguous and not tensor.requires_grad and not _has_broadcast_stride(tensor)
    if tensor.requires_grad: self.frozen.update(reads)
    value.constant = bool(operands) and all(operand.constant for operand in operands)
    if value.constant and "constant-write" in self.avoid: self.frozen.update(roots)
    if roots == frozenset({name}): self.versions[name] = 0
    self.namespace[name] = tensor
    self.values[name] = value
    self.steps.append(Step("op", f"{name} = {og}", f"{name} = {pt}"))
    return value

  # ---------------------------------------------------------------- inputs and operands

  def random_shape(self) -> tuple[int, ...]:
    ndim = self.rng.choice([0, 1, 1, 2, 2, 2, 3, 3, 4])
    shape = tuple(self.rng.choice([1, 2, 3, 4, 5, 6]) if self.rng.random() > 0.03 else 0 for _ in range(ndim))
    while int(np.prod(shape)) > 64: shape = tuple(max(1, size // 2) for size in shape)
    return shape

  def random_dtype(self) -> str:
    names = list(DTYPES)
    return self.rng.choices(names, [DTYPES[name][1] for name in names])[0]

  def random_array(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if dtype == "bool": return self.np_rng.random(shape) < 0.5
    if dtype in FLOAT_NAMES:
      if self.rng.random() < 0.5: return (self.np_rng.integers(-12, 13, shape) / 4).astype(DTYPES[dtype][0])
      return self.np_rng.uniform(-3, 3, shape).astype(DTYPES[dtype][0])
    return self.np_rng.integers(-9, 10, shape).astype(DTYPES[dtype][0])

  def add_input(self, shape: tuple[int, ...] | None = None, dtype: str | None = None, grad: bool = False,
                array: np.ndarray | None = None) -> Value:
    """An input tensor (`Tensor(inputs[i])`), realized at once or left lazy, maybe a requires_grad leaf."""
    shape = self.random_shape() if shape is None else shape
    dtype = self.random_dtype() if dtype is None else dtype
    constant = False
    self.inputs.append(self.random_array(shape, dtype) if array is None else array)
    index = len(self.inputs) - 1
    name = self.new_name()
    if grad:
      og, pt = f"Tensor(inputs[{index}], device=device, requires_grad=True)", f"torch.tensor(inputs[{index}], " \
        "requires_grad=True)"
    elif array is None and self.rng.random() < 0.12:
      # a constant tensor: ourgrad keeps it a broadcast scalar until it is written (reliability.md, "Constants")
      constant = True
      if "constant-write" in self.avoid: self.frozen.add(name)
      fill = self.inputs[index].flat[0].item() if self.inputs[index].size else 0
      function, arguments = self.rng.choice([("full", f"{shape!r}, {fill!r}"), ("zeros", repr(shape)),
                                             ("ones", repr(shape))])
      og = f"Tensor.{function}({arguments}, dtype={og_dtype(dtype)}, device=device)"
      pt = f"torch.{function}({arguments}, dtype={pt_dtype(dtype)})"
    else:
      realize = ".realize()" if self.rng.random() < 0.5 else ""
      og, pt = f"Tensor(inputs[{index}], device=device){realize}", f"torch.tensor(inputs[{index}])"
    tensor = eval(pt, self.namespace)  # noqa: S307
    self.og_exec(f"{name} = {og}")
    self.versions[name] = 0
    value = Value(name, tensor, True, max(1.0, magnitude(tensor)), frozenset({name}), {name: 0},
                  writable=not grad, tolerance=TOLERANCE.get(dtype, 0.0), constant=constant)
    if grad:
      self.frozen.add(name)
      self.leaves.append(name)
    self.namespace[name] = tensor
    self.values[name] = value
    self.steps.append(Step("input", f"{name} = {og}", f"{name} = {pt}"))
    return value

  def scalar_for(self, value: Value) -> Any:
    """A Python scalar operand of the value's kind (now and then a float for an int, to exercise promotion)."""
    if value.dtype == "bool": return self.rng.random() < 0.5 if self.rng.random() < 0.7 else self.rng.choice([0.5, 2.0])
    if value.is_float or self.rng.random() < 0.15: return self.rng.choice(FLOAT_SCALARS)
    return self.rng.choice(INT_SCALARS)

  def partner_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts with `shape`: some dims 1, maybe leading dims dropped."""
    partner = [1 if self.rng.random() < 0.3 else size for size in shape]
    drop = self.rng.randint(0, len(partner)) if self.rng.random() < 0.3 else 0
    return tuple(partner[drop:])

  def operand_for(self, value: Value, shape: tuple[int, ...] | None = None) -> Value | Any:
    """A second operand: a Python scalar, another live value that broadcasts, or a new input (0-d sometimes)."""
    shape = value.shape if shape is None else shape
    choice = self.rng.random()
    if choice < 0.3: return self.scalar_for(value)
    if choice < 0.7:
      partners = self.live(lambda other: _broadcastable(shape, other.shape) and other.name != value.name)
      if partners: return self.rng.choice(partners)
    dtype = value.dtype if self.rng.random() < 0.6 else self.random_dtype()
    partner_shape = () if self.rng.random() < 0.15 else self.partner_shape(shape)
    return self.add_input(partner_shape, dtype)

  def operand_code(self, operand: Value | Any) -> str:
    return operand.name if isinstance(operand, Value) else repr(operand)

  # ---------------------------------------------------------------- elementwise

  def unary(self) -> Value:
    rng = self.rng
    kind = rng.choice(["neg", "abs", "relu", "exp", "log", "sqrt", "sin", "sigmoid", "tanh", "reciprocal", "square",
                       "floor", "ceil", "round", "trunc", "clamp", "sign", "logical_not", "invert", "cast", "cast",
                       "cast", "clone", "contiguous", "detach"])
    a = self.pick()
    x = a.name
    if kind in ("exp", "sin", "sigmoid", "tanh") and a.is_float and not a.exact and a.scale > 40:
      raise Rejected("transcendental of a large inexact value")
    simple = {"neg": f"-{x}", "abs": f"{x}.abs()", "relu": f"{x}.relu()", "exp": f"{x}.exp()",
              "log": f"({x}.abs() + 1).log()", "sqrt": f"({x}.abs() + 1).sqrt()", "sin": f"{x}.sin()",
              "sigmoid": f"{x}.sigmoid()", "tanh": f"{x}.tanh()", "square": f"{x}.square()", "sign": f"{x}.sign()",
              "logical_not": f"{x}.logical_not()", "invert": f"~{x}", "clone": f"{x}.clone()",
              "contiguous": f"{x}.contiguous()"}
    if kind in simple:
      if kind in ("relu", "abs", "sign") and a.grad: self.require_margin(a.tensor, [a])  # the gradient's kink at 0
      if kind == "logical_not" and a.is_float: self.require_margin(a.tensor, [a])
      # square() of bool is pow(x, 2): the default int, int64 in PyTorch and int32 in ourgrad (docs/pytorch.md)
      if kind == "square" and a.dtype == "bool": raise Rejected("bool square: the default int differs")
      # transcendental functions need not be correctly rounded: their results are never exact
      return self.add_value(simple[kind], simple[kind], [a], exact_op=kind not in INEXACT_UNARY)
    if kind == "detach": return self.add_value(f"{x}.detach()", f"{x}.detach()", [a], view_op=True)
    if kind == "reciprocal":
      if a.tensor.numel() and float(a.tensor.detach().double().abs().min()) < 0.25: raise Rejected("small divisor")
      return self.add_value(f"{x}.reciprocal()", f"{x}.reciprocal()", [a], exact_op=False)
    if kind in ("floor", "ceil", "trunc", "round"):
      if a.is_float:
        offset = 0.5 if kind == "round" else 0.0
        values = a.tensor.detach().double() - offset
        self.require_margin(values - values.round(), [a])
      exact_op = kind == "floor" or "negative-zero-rounding" not in self.avoid
      return self.add_value(f"{x}.{kind}()", f"{x}.{kind}()", [a], exact_op=exact_op)
    if kind == "clamp":
      low, high = sorted(rng.sample(FLOAT_SCALARS if a.is_float else INT_SCALARS, 2))
      if a.dtype == "bool": raise Rejected("clamp of bool")
      if a.grad: self.require_margin(torch.minimum((a.tensor - low).abs(), (a.tensor - high).abs()), [a])
      code = f"{x}.clamp({low!r}, {high!r})"
      return self.add_value(code, code, [a])
    # cast
    target = self.random_dtype()
    if a.is_float and target not in FLOAT_NAMES:
      values = a.tensor.detach().double()
      self.require_margin(values if target == "bool" else values - values.trunc(), [a])
      if target != "bool" and a.tensor.numel() and values.trunc().abs().max() >= 2 ** 24: raise Rejected("cast range")
    if a.grad and target not in FLOAT_NAMES: raise Rejected("cast of a grad value to int")
    shortcut = {"float32": "float", "float16": "half", "int32": "int", "int64": "long", "bool": "bool"}[target]
    if rng.random() < 0.5: return self.add_value(f"{x}.{shortcut}()", f"{x}.{shortcut}()", [a])
    return self.add_value(f"{x}.cast({og_dtype(target)})", f"{x}.to({pt_dtype(target)})", [a])

  BINARY_SYMBOLS = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%", "and": "&",
                    "or": "|", "xor": "^", "lt": "<", "gt": ">", "le": "<=", "ge": ">=", "eq": "==", "ne": "!="}

  def binary(self) -> Value:
    rng = self.rng
    kind = rng.choice(["add", "add", "sub", "mul", "mul", "div", "floordiv", "mod", "and", "or", "xor", "lt", "gt",
                       "le", "ge", "eq", "ne", "maximum", "minimum", "pow"])
    a = self.pick()
    if kind == "pow":
      if a.dtype == "bool": raise Rejected("pow of bool")
      exponent = rng.choice([2, 3] if not a.is_float else [2, 3, 0.5])
      base = f"{a.name}.abs()" if exponent == 0.5 else a.name
      code = f"{base} ** {exponent!r}"
      return self.add_value(code, code, [a], exact_op=False)  # pow may go through exp2(log2): not exact
    b = self.operand_for(a)
    self.check_zero_d([a, b])
    reverse = rng.random() < 0.3
    operands = [a] + ([b] if isinstance(b, Value) else [])
    if not isinstance(b, Value):
      if a.dtype == "bool" and isinstance(b, int) and not isinstance(b, bool) and kind not in ("lt", "gt", "le",
                                                                                                 "ge", "eq", "ne"):
        raise Rejected("bool with a Python int")  # PyTorch's default int is int64, ourgrad's int32 (docs/api.md)
    left, right = (b, a) if reverse else (a, b)
    left_code, right_code = self.operand_code(left), self.operand_code(right)
    if kind in ("maximum", "minimum"):
      if not isinstance(b, Value): raise Rejected("maximum with a scalar")
      if a.grad or b.grad: self.require_margin(a.tensor.detach().double() - b.tensor.detach().double(), operands)
      code = f"{left_code}.{kind}({right_code})"
      return self.add_value(code, code, operands)
    if not isinstance(left, Value) and kind not in ("add", "sub", "mul", "div", "floordiv", "mod"):
      left, right, left_code, right_code = right, left, right_code, left_code  # a scalar on the left of a comparison
    left_values, right_values = _as_tensor(left), _as_tensor(right)
    if kind in ("div", "floordiv", "mod"):
      if right_values.numel() and float(right_values.double().abs().min()) < 0.25: raise Rejected("small divisor")
      if kind != "div" and (left_values.is_floating_point() or right_values.is_floating_point()):
        quotient = left_values.double() / right_values.double()
        self.require_margin(quotient - quotient.round(), operands)
        if kind == "mod" and "float-mod-multiple" in self.avoid and bool((quotient == quotient.round()).any()):
          raise Rejected("avoided")
    if kind in ("lt", "gt", "le", "ge", "eq", "ne"):
      self.require_margin(left_values.double() - right_values.double(), operands)
    code = f"({left_code} {self.BINARY_SYMBOLS[kind]} {right_code})"
    # a / b may be a * (1 / b): not exact
    exact_op = kind != "div" and not (kind == "floordiv" and "negative-zero-rounding" in self.avoid)
    # the sign of a zero remainder differs between PyTorch (-2.5 % 0.5 is -0.0), numpy and Python (+0.0)
    return self.add_value(code, code, operands, exact_op=exact_op, signed_zeros=kind != "mod")

  def check_zero_d(self, operands: list[Value | Any]) -> None:
    """Under avoid "zero-d-promotion": Rejected when a 0-d tensor meets an n-d one of another dtype."""
    if "zero-d-promotion" not in self.avoid: return
    tensors = [operand for operand in operands if isinstance(operand, Value)]
    if any(not value.shape for value in tensors) and any(value.shape for value in tensors) \
        and len({value.dtype for value in tensors}) > 1:
      raise Rejected("avoided")

  def where(self) -> Value:
    condition = self.pick(lambda value: value.dtype == "bool")
    x = self.operand_for(condition)
    shape = tuple(np.broadcast_shapes(condition.shape, _as_tensor(x).shape))
    y = self.operand_for(condition, shape)
    for scalar, other in ((x, y), (y, x)):
      # PyTorch's default int is int64, ourgrad's int32 (docs/api.md): an int scalar needs an int or float tensor
      if isinstance(scalar, int) and not isinstance(scalar, bool) and (not isinstance(other, Value)
                                                                        or other.dtype == "bool"):
        raise Rejected("int scalar without an int tensor")
    if not isinstance(x, Value) and not isinstance(y, Value) and type(x) is not type(y):
      raise Rejected("two scalars of different kinds")
    operands = [condition] + [operand for operand in (x, y) if isinstance(operand, Value)]
    self.check_zero_d([x, y])
    x_code, y_code = self.operand_code(x), self.operand_code(y)
    return self.add_value(f"{condition.name}.where({x_code}, {y_code})",
                          f"torch.where({condition.name}, {x_code}, {y_code})", operands)

  # ---------------------------------------------------------------- reduces

  def reduce(self) -> Value:
    rng = self.rng
    kind = rng.choice(["sum", "sum", "mean", "amax", "amin", "max", "min", "any", "all", "argmax", "argmin", "var",
                       "std"])
    a = self.pick()
    ndim = len(a.shape)
    axes: tuple[int, ...] | None = None
    if ndim and rng.random() < 0.8:
      axes = tuple(rng.sample(range(ndim), rng.randint(1, ndim)))
      axes = tuple(axis - ndim if rng.random() < 0.4 else axis for axis in axes)
    keepdim = rng.random() < 0.4
    if kind in ("argmax", "argmin", "max", "min"):
      if kind in ("max", "min") and axes is None: axes = (rng.randrange(-ndim, ndim),) if ndim else None
      if axes is not None: axes = axes[:1]
    if kind in ("mean", "var", "std") and not a.is_float: raise Rejected("mean of ints")  # ourgrad promotes on purpose
    x = a.tensor.detach()
    if kind in ("argmax", "argmin", "max", "min", "amax", "amin") and a.is_float and not a.exact:
      self.require_margin(_gaps(x, axes), [a])  # near-ties would let rounding pick another index or gradient
    if kind in ("any", "all") and a.is_float: self.require_margin(x, [a])
    if kind in ("amax", "amin") and a.grad and not a.exact: self.require_margin(_gaps(x, axes), [a])
    dim = "" if axes is None else (repr(axes[0]) if len(axes) == 1 and rng.random() < 0.5 else repr(axes))
    arguments = [f"dim={dim}"] if dim else []
    if keepdim and (dim or kind not in ("amax", "amin", "max", "min")): arguments.append("keepdim=True")
    if kind in ("var", "std") and rng.random() < 0.5: arguments.append(f"correction={rng.choice([0, 1, 2])}")
    if kind in ("max", "min"):
      if not dim: raise Rejected("max of all as a pair")
      part = rng.choice(["values", "indices", "0", "1"])
      code = f"{a.name}.{kind}({', '.join(arguments)})" + (f".{part}" if part.isalpha() else f"[{part}]")
      return self.add_value(code, code, [a])
    code = f"{a.name}.{kind}({', '.join(arguments)})"
    # a sum is exact in every order only when every partial sum is: small multiples of 2**-12
    exact_op = kind not in ("mean", "var", "std") and (kind != "sum" or _sums_exactly(a.tensor))
    return self.add_value(code, code, [a], exact_op=exact_op)

  # ---------------------------------------------------------------- movement and indexing

  def movement(self) -> Value:
    rng = self.rng
    kind = rng.choice(["reshape", "reshape", "permute", "transpose", "expand", "unsqueeze", "squeeze", "pad", "shrink",
                       "flip", "slice", "slice", "cat", "stack"])
    a = self.pick()
    shape, x, ndim = a.shape, a.name, len(a.shape)
    if kind == "reshape":
      new_shape: tuple[int, ...] = random_factorization(rng, int(np.prod(shape)), max_ndim=4)
      if new_shape and rng.random() < 0.2 and int(np.prod(shape)): new_shape = new_shape[:-1] + (-1,)
      return self.add_value(f"{x}.reshape({new_shape!r})", f"{x}.reshape({new_shape!r})", [a], view_op=True)
    if kind == "permute":
      order = list(range(ndim))
      rng.shuffle(order)
      return self.add_value(f"{x}.permute({tuple(order)!r})", f"{x}.permute({tuple(order)!r})", [a], view_op=True)
    if kind == "transpose":
      if ndim < 2: raise Rejected("transpose of < 2 dims")
      first, second = rng.sample(range(-ndim, ndim), 2)
      code = f"{x}.transpose({first}, {second})"
      return self.add_value(code, code, [a], view_op=True)
    if kind == "expand":
      if 1 not in shape: raise Rejected("expand without a size-1 dim")
      target = [rng.choice([2, 3, 4]) if size == 1 and rng.random() < 0.8 else size for size in shape]
      if rng.random() < 0.3: target = [-1 if size == shape[i] else size for i, size in enumerate(target)]
      if rng.random() < 0.2: target = [rng.choice([2, 3])] + target
      code = f"{x}.expand({tuple(target)!r})"
      return self.add_value(code, code, [a], view_op=True)
    if kind == "unsqueeze":
      code = f"{x}.unsqueeze({rng.randint(-ndim - 1, ndim)})"
      return self.add_value(code, code, [a], view_op=True)
    if kind == "squeeze":
      if ndim == 0: raise Rejected("squeeze of 0-d")
      code = f"{x}.squeeze({rng.randrange(-ndim, ndim)})" if rng.random() < 0.7 else f"{x}.squeeze()"
      return self.add_value(code, code, [a], view_op=True)
    if kind == "pad":
      if ndim == 0: raise Rejected("pad of 0-d")
      flat = [rng.choice([0, 0, 1, 2, -1]) for _ in range(2 * rng.randint(1, ndim))]
      value = rng.choice([0, 0, 1.5, -2]) if a.is_float else rng.choice([0, 0, 3])
      if a.dtype == "bool": value = 0
      og = f"{x}.pad({tuple(flat)!r}" + (f", value={value!r})" if value else ")")
      pt = f"F.pad({x}, {tuple(flat)!r}" + (f", value={value!r})" if value else ")")
      return self.add_value(og, pt, [a], view_op=True)
    if kind == "shrink":
      if ndim == 0: raise Rejected("shrink of 0-d")
      bounds = random_shrink_bounds(rng, shape)
      pt = f"{x}[{', '.join(f'{start}:{end}' for start, end in bounds)}]"
      return self.add_value(f"{x}.shrink({tuple(bounds)!r})", pt, [a], view_op=True)
    if kind == "flip":
      if ndim == 0: raise Rejected("flip of 0-d")
      dims = tuple(rng.sample(range(-ndim, ndim), rng.randint(1, ndim)))
      if len({d % ndim for d in dims}) != len(dims): raise Rejected("repeated flip dim")
      return self.add_value(f"{x}.flip({dims!r})", f"{x}.flip({dims!r})", [a], view_op=True)
    if kind == "slice": return self.slice(a)
    # cat and stack: a second operand of the same shape (except along the cat axis), same dtype mostly
    if kind == "cat" and ndim == 0: raise Rejected("cat of 0-d")
    axis = rng.randrange(-ndim, ndim) if kind == "cat" else rng.randint(-ndim - 1, ndim)
    other_shape = list(shape)
    if kind == "cat": other_shape[axis] = rng.choice([0, 1, 2, 3])
    dtype = a.dtype if rng.random() < 0.8 else self.random_dtype()
    others = self.live(lambda value: value.shape == tuple(other_shape) and value.dtype == dtype and value is not a)
    b = rng.choice(others) if others and rng.random() < 0.6 else self.add_input(tuple(other_shape), dtype)
    pair = f"[{x}, {b.name}]" if rng.random() < 0.5 else f"[{b.name}, {x}]"
    return self.add_value(f"Tensor.{kind}({pair}, dim={axis})", f"torch.{kind}({pair}, dim={axis})", [a, b])

  def slice(self, a: Value) -> Value:
    """Basic indexing: ints, slices (negative steps too), None, Ellipsis. PyTorch has no negative steps: its line
    slices with the positive ones and picks the reversed ones with index_select (a copy, where ourgrad's is a view)."""
    rng = self.rng
    items: list[Any] = []
    negative = rng.random() < 0.25
    for size in a.shape:
      choice = rng.random()
      if choice < 0.2 and size > 0 and not negative: items.append(rng.randrange(-size, size))
      else:
        step = rng.choice([-1, -2, -3] if negative and rng.random() < 0.6 else [1, 1, 2, 3])
        items.append(slice(rng.choice([None, 0, 1, -1, -2]), rng.choice([None, None, size - 1, 2, -1]), step))
      if rng.random() < 0.06 and not negative: items.append(None)
    if items and rng.random() < 0.2 and not negative:
      cut = rng.randrange(len(items))
      items = items[:cut] + [Ellipsis]
    og = f"{a.name}[{index_code(tuple(items))}]"
    if not negative: return self.add_value(og, og, [a], view_op=True)
    positive = [item if item.step > 0 else slice(None) for item in items]
    pt = f"{a.name}[{index_code(tuple(positive))}]"
    for dim, item in enumerate(items):
      if item.step < 0:
        picked = list(range(a.shape[dim]))[item]
        pt += f".index_select({dim}, torch.tensor({picked!r}, dtype=torch.long))"
    return self.add_value(og, pt, [a], view_op=True)

  def index(self) -> Value:
    """Advanced indexing with int64 tensors (and int lists), mixed with slices and ints; or gather."""
    rng = self.rng
    a = self.pick(lambda value: len(value.shape) > 0 and 0 not in value.shape)
    shape = a.shape
    if rng.random() < 0.3:
      dim = rng.randrange(-len(shape), len(shape))
      index_shape = tuple(rng.randint(1, size) if d != dim % len(shape) else rng.randint(1, 4)
                          for d, size in enumerate(shape))
      positions = self.add_input(array=self.np_rng.integers(0, shape[dim], index_shape).astype(np.int64),
                                 shape=index_shape, dtype="int64")
      code = f"{a.name}.gather({dim}, {positions.name})"
      return self.add_value(code, code, [a, positions])
    items: list[Any] = []
    tensors: list[Value] = []
    index_shape = rng.choice([(), (1,), (2,), (3,), (2, 2)])
    for size in shape:
      choice = rng.random()
      if choice < 0.35 and len(tensors) < 2:
        array = self.np_rng.integers(-size, size, index_shape).astype(np.int64)
        if rng.random() < 0.3 and len(index_shape) == 1:
          items.append(repr(array.tolist()))
        else:
          tensors.append(self.add_input(array=array, shape=index_shape, dtype="int64"))
          items.append(tensors[-1].name)
      elif choice < 0.5: items.append(rng.randrange(-size, size))
      else: items.append(slice(None) if rng.random() < 0.6 else slice(rng.choice([0, 1]), None, rng.choice([1, 2])))
    if not tensors and not any(isinstance(item, str) for item in items): raise Rejected("no tensor index")
    code = f"{a.name}[{index_code(tuple(items))}]"
    return self.add_value(code, code, [a] + tensors)

  # ---------------------------------------------------------------- in-place writes, realizes, reads

  def write(self) -> None:
    """`t.assign(e)`, `t += e` (-=, *=) or `t[index] = e` into a value that owns its memory or is a view of it."""
    rng = self.rng
    target = self.pick(lambda value: value.writable and not value.roots & self.frozen and len(value.roots) == 1
                       and ("view-write" not in self.avoid or value.roots == {value.name}))
    root = next(iter(target.roots))
    form = rng.choice(["assign", "iadd", "isub", "imul", "setitem", "setitem"])
    if form == "setitem" and not target.shape: raise Rejected("setitem of 0-d")
    index = ""
    if form == "setitem":
      items: list[Any] = []
      for size in target.shape:
        if rng.random() < 0.3 and size > 0: items.append(rng.randrange(-size, size))
        else: items.append(slice(rng.choice([None, 0, 1, -2]), rng.choice([None, None, -1, 2]), rng.choice([1, 1, 2])))
      index = f"[{index_code(tuple(items))}]"
    selected = self.torch_eval("", f"{target.name}{index}")
    value = self.operand_for(target, tuple(selected.shape))
    value_tensor = _as_tensor(value)
    if tuple(np.broadcast_shapes(selected.shape, value_tensor.shape)) != tuple(selected.shape):
      raise Rejected("value does not broadcast to the target")
    operands = [target] + ([value] if isinstance(value, Value) else [])
    if isinstance(value, Value) and value.grad: raise Rejected("writing a grad value")
    code = self.operand_code(value)
    if form in ("assign", "setitem"):
      preview, preview_code, exact_operands = value_tensor, code, operands[1:]
      if value_tensor.is_floating_point() and not target.is_float:
        values = value_tensor.double()
        self.require_margin(values if target.dtype == "bool" else values - values.trunc(), operands[1:])
        if values.numel() and values.abs().max() >= 2 ** 24: raise Rejected("cast range")
    else:
      symbol = {"iadd": "+", "isub": "-", "imul": "*"}[form]
      preview_code = f"({target.name}{index} {symbol} {code})"
      preview, exact_operands = self.torch_eval("", preview_code), operands
    self.check_range(preview.to(selected.dtype) if preview.dtype != selected.dtype else preview)
    exact = self.exact_result(preview_code, exact_operands, preview) if isinstance(preview, torch.Tensor) else True
    if form == "assign":
      og = f"{target.name}.assign({code})"
      pt = f"{target.name}.copy_({code})" if isinstance(value, Value) else f"{target.name}.fill_({code})"
    elif form == "setitem": og = pt = f"{target.name}{index} = {code}"
    else: og = pt = f"{target.name} {symbol}= {code}"
    try:
      exec(pt, self.namespace)  # noqa: S102
    except Exception as error:  # noqa: BLE001 - PyTorch refusing is part of the generation
      raise TorchRefused(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", og, pt) \
        from error
    self.og_exec(og)
    self.versions[root] += 1
    for other in self.values.values():
      if root in other.roots:  # a view of the root (or the root): it reads the new contents
        if not other.ambiguous: other.reads[root] = self.versions[root]  # (an ambiguous one is unusable from now)
        other.exact = other.exact and exact
        other.scale = max(other.scale, magnitude(other.tensor))
    self.steps.append(Step("write", og, pt))

  def realize(self) -> None:
    chosen = [self.pick() for _ in range(self.rng.choice([1, 1, 2]))]
    if len(chosen) == 1: og = f"{chosen[0].name}.realize()"
    else: og = f"Tensor.realize_all({', '.join(value.name for value in chosen)})"
    self.steps.append(Step("realize", og, "pass"))

  def observe(self, value: Value | None = None) -> None:
    """A read in the middle of the program (or at its end): ourgrad's value there must equal PyTorch's."""
    value = self.pick() if value is None else value
    code = f"observe({value.name!r}, {value.name})"
    self.steps.append(Step("observe", code, code, name=value.name, exact=value.exact, scale=value.scale,
                           signed_zeros=value.signed_zeros, tolerance=value.tolerance))

  def input(self) -> None:
    self.add_input()

  def backward(self) -> None:
    """A scalar loss of up to 3 values that require grad (each times a fixed random array), its backward, and the
    gradients of every leaf."""
    candidates = self.live(lambda value: value.grad and value.is_float)
    if not candidates: return
    chosen = [candidates[-1]] + self.rng.sample(candidates[:-1], min(len(candidates) - 1, self.rng.randint(0, 2)))
    weights = [self.add_input(value.shape, "float32") for value in chosen]
    terms = " + ".join(f"({value.name}.float() * {weight.name}).sum()" for value, weight in zip(chosen, weights))
    steps_before = len(self.steps)
    loss = self.add_value(terms, terms, chosen + weights, exact_op=False)  # (its .float() would fool the shadow)
    self.observe(loss)
    code = f"{loss.name}.backward()"
    try:
      exec(code, self.namespace)  # noqa: S102
    except RuntimeError:  # an op PyTorch has no derivative for (remainder, ...): no backward in this program
      del self.steps[steps_before:]
      del self.values[loss.name]
      return
    self.steps.append(Step("backward", code, code))
    # gradients flow back through every value that requires grad: the least precise of them sets the tolerance
    tolerance = max(value.tolerance for value in self.values.values() if value.grad)
    for leaf in self.values.values():
      if leaf.name in self.leaves:
        grad = leaf.tensor.grad
        scale = max(loss.scale, magnitude(grad)) if grad is not None else 1.0
        code = f"observe({leaf.name + '.grad'!r}, {leaf.name}.grad)"
        self.steps.append(Step("observe", code, code, name=f"{leaf.name}.grad", exact=False, scale=scale,
                               tolerance=tolerance))

  # ---------------------------------------------------------------- the program

  def try_step(self, kind: str) -> bool:
    """Add one step of `kind`; False when it did not fit. A step PyTorch refuses with a shape or in-place dtype
    error is now and then kept as one ourgrad must refuse too."""
    try:
      getattr(self, kind)()
      return True
    except TorchRefused as refusal:
      expected = any(text in str(refusal) for text in EXPECTED_ERRORS)
      if "inplace-cast" in self.avoid and "can't be cast" in str(refusal): expected = False
      if self.rng.random() < 0.5 and expected and refusal.og:
        statement = refusal.og if "=" in refusal.og.split("(")[0] else f"{self.new_name()} = {refusal.og}"
        pt = refusal.pt if statement == refusal.og else f"{statement.split(' = ')[0]} = {refusal.pt}"
        self.steps.append(Step("op", statement, pt, expect_error=True))
        return True
      self.rejections[str(refusal).split(":")[0]] = self.rejections.get(str(refusal).split(":")[0], 0) + 1
    except Rejected as rejection:
      self.rejections[str(rejection)] = self.rejections.get(str(rejection), 0) + 1
    return False

  def program(self, min_steps: int = 4, max_steps: int = 14) -> Program:
    rng = self.rng
    for _ in range(rng.randint(1, 2)): self.add_input()
    if self.grad and rng.random() < 0.4: self.add_input(dtype="float32", grad=True)
    kinds, weights = list(self.WEIGHTS), list(self.WEIGHTS.values())
    target, made = rng.randint(min_steps, max_steps), 0
    for _ in range(target * 20):
      if made >= target: break
      made += self.try_step(rng.choices(kinds, weights)[0])
    if self.grad: self.backward()
    ends = [value for value in self.live() if value.tensor.numel() <= MAX_ELEMENTS]
    for value in ([ends[-1]] if ends else []) + rng.sample(ends[:-1], min(len(ends) - 1, 2)):
      self.observe(value)
    return Program(list(self.inputs), list(self.steps), self.device)


def random_program(rng: random.Random, device: str, min_steps: int = 4, max_steps: int = 14, grad: bool = True,
                   avoid: frozenset[str] = frozenset()) -> tuple[TorchGen, Program]:
  """A random program; `avoid` names constructs of known, still open bugs not to generate (AVOIDABLE)."""
  gen = TorchGen(rng, device, grad, avoid)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # see run_torch
    return gen, gen.program(min_steps, max_steps)


# ---------------------------------------------------------------- helpers

def _shares_storage(first: torch.Tensor, second: torch.Tensor) -> bool:
  if first.numel() == 0 or second.numel() == 0: return False
  return first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()


def _has_broadcast_stride(tensor: torch.Tensor) -> bool:
  """A view where several elements share memory (expand): PyTorch refuses to write into it."""
  return any(stride == 0 and size > 1 for stride, size in zip(tensor.stride(), tensor.shape))


def _broadcastable(first: tuple[int, ...], second: tuple[int, ...]) -> bool:
  try:
    shape = np.broadcast_shapes(first, second)
  except ValueError:
    return False
  return int(np.prod(shape)) <= MAX_ELEMENTS


def _as_tensor(operand: Value | Any) -> torch.Tensor:
  return operand.tensor.detach() if isinstance(operand, Value) else torch.tensor(operand)


def _sums_exactly(values: torch.Tensor) -> bool:
  """Whether every partial sum of these values, in any order, is exact in float16 accumulated in float32: they are
  multiples of 2**-12 whose absolute sum stays below 2**24 of them."""
  if not values.is_floating_point(): return True
  scaled = values.detach().double() * 4096
  return bool((scaled == scaled.round()).all()) and float(scaled.abs().sum()) < 2 ** 24


def _gaps(values: torch.Tensor, axes: tuple[int, ...] | None) -> torch.Tensor:
  """The gaps between neighbouring sorted values along the reduced axes (all when None): a near-tie is a small gap."""
  values = values.double()
  if values.ndim == 0: return torch.zeros(0)
  reduced = list(range(values.ndim)) if axes is None else sorted({axis % values.ndim for axis in axes})
  kept = [axis for axis in range(values.ndim) if axis not in reduced]
  count = int(np.prod([values.shape[axis] for axis in reduced]))
  if count < 2 or values.numel() == 0: return torch.zeros(0)
  rows = values.permute(kept + reduced).reshape(-1, count)
  ordered = rows.sort(dim=-1).values
  return ordered[:, 1:] - ordered[:, :-1]
