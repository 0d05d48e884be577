"""Random Tensor-API graphs with a numpy mirror: the generator behind fuzz_graphs, fuzz_opts and fuzz_schedule.

A `GraphGen` draws a random program, one step at a time. Every step is a line of Python over the Tensor API
(`v3 = (v1 + v2).exp()`) and is applied at once, twice:
  - to lazy Tensors on a generation device (nothing is realized: this only gives the result's dtype and shape,
    with ourgrad's promotion rules, and raises ourgrad's errors for invalid combinations, which are dropped);
  - to numpy arrays (the *mirror*), with the same random choices: float values are carried in float64 (exact
    reference math), integers in int64, bools as bools.
The finished `Graph` is the program text plus its input arrays: `Graph.build(device)` runs it on any device, and
`Graph.program()` prints a self-contained repro.

Tolerances: every float node carries `err`, a bound on |float32 result on a device - exact value|, propagated
op by op (rounding of each op, Lipschitz bounds of each function over the values actually present, n*eps for sums
of n terms). `err == 0` means the device must produce the mirror's value exactly (integers, bools, and floats
computed only from exactly representable values by exact operations). Decisions that a tiny error could flip
(float comparisons, float -> int/bool casts, floor) are only generated where the operands keep a margin larger
than their error, so integer and bool results always compare exactly. Values stay small (|float| <= 1e5,
|int| < 2**30) so nothing overflows, no NaN or inf appears, and divisors are never zero.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from fuzzing import random_factorization, random_shrink_bounds
from ourgrad import Tensor, dtypes
from ourgrad.dtype import DType
from ourgrad.errors import OurgradError
from ourgrad.helpers import prod

EPS = 2.0 ** -22                 # two float32 ulps: one correctly rounded operation, with room to spare
TRANSCENDENTAL_EPS = 4e-6        # exp/log/sin/sqrt/sigmoid of libm, OpenCL and numpy (PYTHON), relative
MAX_FLOAT = 1e5
MAX_INT = 2 ** 30
MAX_ELEMENTS = 256
EXACT_FLOAT_LIMIT = 2 ** 24      # integers below this are exact in float32
FLOAT_CONSTANTS = [0.5, -1.5, 2.0, 0.25, 3.0, -0.75, 1.0, -2.0, 0.125]
INT_CONSTANTS = [-5, -3, -2, -1, 1, 2, 3, 4, 7]


def max_abs(array: np.ndarray) -> float:
  return float(np.max(np.abs(array))) if array.size else 0.0


def is_float(dtype: DType) -> bool: return dtype.is_float
def is_bool(dtype: DType) -> bool: return dtype == dtypes.bool
def is_int(dtype: DType) -> bool: return not dtype.is_float and dtype != dtypes.bool


def representable(value: np.ndarray) -> bool:
  """All values exactly representable in float32 (then a correctly rounded op on exact inputs is exact)."""
  return bool(np.all(value.astype(np.float32).astype(np.float64) == value))


def rounding(value: np.ndarray, dtype: DType, roundings: int = 1) -> float:
  """Error that `roundings` correctly rounded float32 operations can add to `value` (0 when it is exact)."""
  if not dtype.is_float: return 0.0
  if roundings == 1 and representable(value): return 0.0
  return roundings * EPS * max_abs(value)


def transcendental(value: np.ndarray, argument_size: float = 0.0) -> float:
  return TRANSCENDENTAL_EPS * max(1.0, max_abs(value)) * (1.0 + argument_size)


def distance_to_integers(value: np.ndarray) -> float:
  if value.size == 0: return math.inf
  return float(np.min(np.abs(value - np.round(value))))


@dataclass
class Node:
  """One value of the program: the mirror, its dtype, its error bound and the generation-time tensor."""
  index: int
  value: np.ndarray
  dtype: DType
  err: float
  tensor: Tensor
  kind: str
  deps: frozenset[tuple[int, int]] = frozenset()   # (mutable buffer id, version) pairs it reads (fuzz_schedule)
  # id of the lazy base the tensor viewed when the node was made: a tensor names memory, so a later write to that
  # base moves `tensor.lazydata` to the newest version; fuzz_schedule tells aliases of overwritten contents by this
  created_base: int = field(init=False, default=0)

  def __post_init__(self) -> None:
    lazy = self.tensor._lazydata
    self.created_base = id(lazy.base) if hasattr(lazy, "base") else id(lazy)

  @property
  def shape(self) -> tuple[int, ...]: return self.value.shape

  @property
  def name(self) -> str: return f"v{self.index}"


class Rejected(Exception):
  """The candidate op does not fit these operands (the generator tries another)."""


@dataclass
class Graph:
  """A finished random program: code lines over v0, v1, ... and the input arrays they read."""
  lines: list[str]
  inputs: list[np.ndarray]
  nodes: list[Node]
  outputs: list[int] = field(default_factory=list)

  def build(self, device: str, lines: list[str] | None = None) -> dict[str, Any]:
    """Run the program on `device`; returns its namespace (v0, v1, ... are Tensors)."""
    namespace: dict[str, Any] = {"Tensor": Tensor, "dtypes": dtypes, "np": np, "device": device,
                                 "inputs": self.inputs}
    for line in (self.lines if lines is None else lines): exec(line, namespace)  # noqa: S102
    return namespace

  def program(self, device: str = "CLANG") -> str:
    """The program as a self-contained script (inputs written out)."""
    header = ["import numpy as np", "from ourgrad import Tensor, dtypes", f"device = {device!r}", "inputs = ["]
    for array in self.inputs:
      header.append(f"  np.array({array.tolist()!r}, dtype={array.dtype.name!r}).reshape({array.shape}),")
    header.append("]")
    outputs = ", ".join(f"v{index}" for index in self.outputs)
    return "\n".join(header + self.lines + [f"# outputs: {outputs}"])


def to_mirror(value: Any, dtype: DType) -> np.ndarray:
  """A numpy result as the mirror of a tensor of `dtype`; Rejected when out of the safe value range."""
  array = np.asarray(value)
  if dtype == dtypes.bool: return array.astype(bool)
  if dtype.is_float:
    mirror = array.astype(np.float64)
    if not np.all(np.isfinite(mirror)) or max_abs(mirror) > MAX_FLOAT: raise Rejected("float out of range")
    return mirror
  if array.dtype.kind == "f" and not np.all(array == np.trunc(array)): raise Rejected("ints from non-integral")
  mirror = array.astype(np.int64)
  info = np.iinfo(dtype.np)
  if mirror.size and (mirror.min() < max(info.min, -MAX_INT) or mirror.max() > min(info.max, MAX_INT)):
    raise Rejected("int out of range")
  return mirror


def as_float_mirror(node: Node) -> np.ndarray:
  return node.value.astype(np.float64)


class GraphGen:
  """Draws a random program; see the module docstring. `rng` drives every choice."""

  def __init__(self, rng: random.Random, device: str = "CLANG", no_flips: bool = False):
    self.rng, self.device, self.no_flips = rng, device, no_flips
    self.np_rng = np.random.default_rng(rng.randrange(2**32))
    self.lines: list[str] = []
    self.inputs: list[np.ndarray] = []
    self.nodes: list[Node] = []
    self.namespace: dict[str, Any] = {"Tensor": Tensor, "dtypes": dtypes, "np": np, "device": device,
                                      "inputs": self.inputs}
    self.rejections: dict[str, int] = {}
    # fuzz_schedule's mutable buffers: current version (assigns issued) and executed version (assigns run)
    self.current: dict[int, int] = {}
    self.executed: dict[int, int] = {}

  # ---------------------------------------------------------------- bookkeeping

  def emit(self, line: str) -> None:
    self.lines.append(line)
    exec(line, self.namespace)  # noqa: S102

  def add_node(self, expression: str, value: Any, err: Callable[[np.ndarray, DType], float] | float, kind: str,
               srcs: tuple[Node, ...] = (), deps: frozenset[tuple[int, int]] | None = None) -> Node:
    """Build `expression` into a new node (v{index}); Rejected if ourgrad refuses it or the values leave range."""
    index = len(self.nodes)
    try:
      tensor = eval(expression, self.namespace)  # noqa: S307
    except OurgradError as error:
      raise Rejected(f"ourgrad refused: {type(error).__name__}") from error
    if not isinstance(tensor, Tensor): raise AssertionError(f"{expression} is not a Tensor")
    mirror = to_mirror(value, tensor.dtype)
    if mirror.shape != tensor.shape:
      raise AssertionError(f"shape: ourgrad {tensor.shape} but numpy {mirror.shape} for {expression}")
    if mirror.size > MAX_ELEMENTS: raise Rejected("too big")
    error_bound = err(mirror, tensor.dtype) if callable(err) else err
    if not tensor.dtype.is_float: error_bound = 0.0
    if deps is None: deps = frozenset().union(*(src.deps for src in srcs)) if srcs else frozenset()
    node = Node(index, mirror, tensor.dtype, error_bound, tensor, kind, deps)
    self.namespace[node.name] = tensor
    self.lines.append(f"{node.name} = {expression}")
    self.nodes.append(node)
    return node

  def stale(self, node: Node) -> bool:
    """Reads a buffer version that an assign has replaced (issued: using it in new ops would be ambiguous)."""
    return any(version < self.current[buffer] for buffer, version in node.deps)

  def dead(self, node: Node) -> bool:
    """Reads a buffer version that an executed assign overwrote: its value is gone."""
    return any(version < self.executed[buffer] for buffer, version in node.deps)

  def live_nodes(self, predicate: Callable[[Node], bool] = lambda node: True) -> list[Node]:
    return [node for node in self.nodes if not self.stale(node) and predicate(node)]

  def pick(self, predicate: Callable[[Node], bool] = lambda node: True) -> Node:
    """An operand: often the newest node (deep chains), else any (shared subgraphs)."""
    candidates = self.live_nodes(predicate)
    if not candidates: raise Rejected("no operand")
    if self.rng.random() < 0.55: return candidates[-1]
    return self.rng.choice(candidates)

  # ---------------------------------------------------------------- inputs and constants

  def random_dtype(self) -> DType:
    return self.rng.choice([dtypes.float32, dtypes.float32, dtypes.float32, dtypes.int32, dtypes.int32, dtypes.bool])

  def random_shape(self) -> tuple[int, ...]:
    ndim = self.rng.choice([0, 1, 1, 2, 2, 2, 3, 3, 3, 4, 4, 1, 2, 3])
    shape = tuple(self.rng.choice([1, 2, 3, 4, 5, 6, 8]) if self.rng.random() > 0.015 else 0 for _ in range(ndim))
    while prod(shape) > 96: shape = tuple(max(1, size // 2) for size in shape)
    return shape

  def random_array(self, shape: tuple[int, ...], dtype: DType) -> np.ndarray:
    if dtype == dtypes.bool: return self.np_rng.random(shape) < 0.5
    if dtype.is_float:
      if self.rng.random() < 0.25: return self.np_rng.integers(-4, 5, shape).astype(np.float32)  # exact values
      return self.np_rng.uniform(-2, 2, shape).astype(np.float32)
    return self.np_rng.integers(-9, 10, shape).astype(dtype.np)

  def add_input(self, shape: tuple[int, ...] | None = None, dtype: DType | None = None) -> Node:
    shape = self.random_shape() if shape is None else shape
    dtype = self.random_dtype() if dtype is None else dtype
    array = self.random_array(shape, dtype)
    self.inputs.append(array)
    node = self.add_node(f"Tensor(inputs[{len(self.inputs) - 1}], device=device)", array, 0.0, "input")
    buffer = node.index
    self.current[buffer] = self.executed[buffer] = 0
    node.deps = frozenset({(buffer, 0)})
    return node

  def constant_for(self, node: Node) -> tuple[str, Any]:
    """A Python scalar operand for `node` (its kind, now and then a float for an int to exercise promotion)."""
    if node.dtype == dtypes.bool and self.rng.random() < 0.7:
      value: Any = self.rng.random() < 0.5
    elif node.dtype.is_float or self.rng.random() < 0.15:
      value = self.rng.choice(FLOAT_CONSTANTS)
    else:
      value = self.rng.choice(INT_CONSTANTS)
    return repr(value), value

  def broadcast_partner_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape that broadcasts with `shape`: some dims set to 1, maybe leading dims dropped."""
    partner = [1 if self.rng.random() < 0.3 else size for size in shape]
    drop = self.rng.randint(0, len(partner)) if self.rng.random() < 0.3 else 0
    return tuple(partner[drop:])

  def operand_for(self, node: Node, dtype_ok: Callable[[DType], bool],
                  shape: tuple[int, ...] | None = None) -> tuple[str, Any, float, Node | None]:
    """A second operand for a binary op on `node`, broadcastable with `shape` (default node's): (code, mirror value,
    err, node or None for a constant)."""
    shape = node.shape if shape is None else shape
    choice = self.rng.random()
    if choice < 0.3:
      code, value = self.constant_for(node)
      if dtype_ok(dtypes.from_py(value)): return code, np.asarray(value), 0.0, None
    if choice < 0.65:
      shapes = [other for other in self.live_nodes(lambda other: dtype_ok(other.dtype))
                if _broadcastable(shape, other.shape)]
      if shapes:
        other = self.rng.choice(shapes)
        return other.name, other.value, other.err, other
    dtype = node.dtype if dtype_ok(node.dtype) and self.rng.random() < 0.7 else self.random_dtype()
    if not dtype_ok(dtype): raise Rejected("no operand dtype")
    other = self.add_input(self.broadcast_partner_shape(shape), dtype)
    return other.name, other.value, other.err, other

  # ---------------------------------------------------------------- ops

  def unary(self) -> Node:
    rng = self.rng
    kind = rng.choice(["neg", "abs", "relu", "exp", "log1p_abs", "sqrt_abs", "sin", "sigmoid", "tanh",
                       "reciprocal", "square", "floor", "clip", "cast", "cast", "not", "contiguous"])
    a = self.pick(lambda node: node.dtype != dtypes.bool or kind in ("cast", "not", "contiguous", "abs"))
    x, ea, size = as_float_mirror(a), a.err, max_abs(a.value)
    name = a.name
    if kind == "neg": return self.add_node(f"-{name}", -a.value, ea, "unary", (a,))
    if kind == "abs": return self.add_node(f"{name}.abs()", np.abs(a.value), ea, "unary", (a,))
    if kind == "relu": return self.add_node(f"{name}.relu()", np.maximum(a.value, 0), ea, "unary", (a,))
    if kind == "contiguous": return self.add_node(f"{name}.contiguous()", a.value, ea, "unary", (a,))
    if kind == "exp":
      if x.size and (x.max() > 6 or x.min() < -30): raise Rejected("exp range")
      top = math.exp(float(x.max()) + ea) if x.size else 1.0
      return self.add_node(f"{name}.exp()", np.exp(x), lambda r, d: top * ea + transcendental(r, size), "unary", (a,))
    if kind == "log1p_abs":
      return self.add_node(f"({name}.abs() + 1).log()", np.log(np.abs(x) + 1),
                           lambda r, d: ea + EPS * (1 + size) + transcendental(r), "unary", (a,))
    if kind == "sqrt_abs":
      return self.add_node(f"({name}.abs() + 1).sqrt()", np.sqrt(np.abs(x) + 1),
                           lambda r, d: 0.5 * (ea + EPS * (1 + size)) + transcendental(r), "unary", (a,))
    if kind == "sin":
      if size > 50: raise Rejected("sin range")
      return self.add_node(f"{name}.sin()", np.sin(x), lambda r, d: ea + transcendental(r, size), "unary", (a,))
    if kind == "sigmoid":
      return self.add_node(f"{name}.sigmoid()", 1 / (1 + np.exp(-x)), lambda r, d: 0.25 * ea + transcendental(r, size),
                           "unary", (a,))
    if kind == "tanh":
      return self.add_node(f"{name}.tanh()", np.tanh(x), lambda r, d: ea + 2 * transcendental(r, size), "unary", (a,))
    if kind == "reciprocal":
      return self.add_node(f"({name}.abs() + 1).reciprocal()", 1 / (np.abs(x) + 1),
                           lambda r, d: ea + EPS * (1 + size) + 2 * EPS, "unary", (a,))
    if kind == "square":
      return self.add_node(f"{name}.square()", a.value * a.value,
                           lambda r, d: 2 * size * ea + ea * ea + rounding(r, d), "unary", (a,))
    if kind == "floor":
      if not a.dtype.is_float or (ea > 0 and distance_to_integers(x) <= 2 * ea): raise Rejected("floor margin")
      return self.add_node(f"{name}.floor()", np.floor(x), 0.0, "unary", (a,))
    if kind == "clip":
      low, high = sorted(rng.sample(FLOAT_CONSTANTS if a.dtype.is_float else INT_CONSTANTS, 2))
      return self.add_node(f"{name}.clip({low!r}, {high!r})", np.clip(a.value, low, high), ea, "unary", (a,))
    if kind == "not":
      if a.dtype.is_float: raise Rejected("not of float")
      return self.add_node(f"~{name}", ~a.value, 0.0, "unary", (a,))
    target = rng.choice([dtypes.float32, dtypes.int32, dtypes.bool])
    if target == a.dtype: raise Rejected("same dtype")
    if a.dtype.is_float and ea > 0:
      if target == dtypes.bool and x.size and np.min(np.abs(x)) <= 2 * ea: raise Rejected("cast margin")
      if target == dtypes.int32 and distance_to_integers(x) <= 2 * ea: raise Rejected("cast margin")
    if target == dtypes.bool: value: np.ndarray = a.value != 0
    elif target.is_float: value = x
    else: value = np.trunc(x) if a.dtype.is_float else a.value
    err = 0.0 if not target.is_float or size < EXACT_FLOAT_LIMIT else EPS * size
    return self.add_node(f"{name}.cast(dtypes.{target.name})", value, err, "cast", (a,))

  def binary(self) -> Node:
    rng = self.rng
    kind = rng.choice(["add", "add", "sub", "mul", "mul", "div", "floordiv", "mod", "truncdiv", "fmod", "maximum",
                       "minimum", "and", "or", "xor", "lt", "gt", "le", "ge", "eq", "ne"])
    def dtype_ok(dtype: DType) -> bool:
      if kind in ("floordiv", "mod", "truncdiv", "fmod"): return is_int(dtype)
      if kind in ("and", "or", "xor"): return not dtype.is_float
      if kind == "sub": return dtype != dtypes.bool
      return True
    a = self.pick(lambda node: dtype_ok(node.dtype))
    b_code, b_value, eb, b_node = self.operand_for(a, dtype_ok)
    reverse = rng.random() < 0.3
    left, right = (b_code, a.name) if reverse else (a.name, b_code)
    lv, rv = (b_value, a.value) if reverse else (a.value, b_value)
    le, re_ = (eb, a.err) if reverse else (a.err, eb)
    srcs = (a,) + ((b_node,) if b_node is not None else ())
    symbol = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%", "and": "&", "or": "|",
              "xor": "^", "lt": "<", "gt": ">", "le": "<=", "ge": ">=", "eq": "==", "ne": "!="}.get(kind)
    if reverse and b_node is None and kind in ("maximum", "minimum", "truncdiv", "fmod"):  # a method call
      left, right, lv, rv, le, re_ = a.name, b_code, a.value, b_value, a.err, eb
    if kind in ("maximum", "minimum"):
      function = np.maximum if kind == "maximum" else np.minimum
      return self.add_node(f"{left}.{kind}({right})", function(lv, rv), max(le, re_), "binary", srcs)
    if kind in ("truncdiv", "fmod"):  # C semantics, exposed on purpose: round toward zero, sign of the dividend
      if np.any(np.asarray(rv) == 0): raise Rejected("zero divisor")
      if kind == "fmod": return self.add_node(f"{left}.fmod({right})", np.fmod(lv, rv), 0.0, "binary", srcs)
      quotient = np.trunc(np.asarray(lv, dtype=np.float64) / np.asarray(rv, dtype=np.float64))
      return self.add_node(f"{left}.div({right}, rounding_mode='trunc')", quotient, 0.0, "binary", srcs)
    expression = f"({left} {symbol} {right})"
    if reverse and b_node is None and kind in ("lt", "gt", "le", "ge", "eq", "ne"):
      # a Python scalar on the left of a comparison is Python's reflected operator: fine, but write it plainly
      expression = f"({a.name} {_mirror_comparison(symbol)} {b_code})"
      lv, rv, le, re_ = a.value, b_value, a.err, eb
      symbol = _mirror_comparison(symbol)
    if kind in ("add", "sub", "mul"):
      if kind == "add": value = lv + rv
      elif kind == "sub": value = lv - rv
      else: value = lv * rv
      ml, mr = max_abs(np.asarray(lv)), max_abs(np.asarray(rv))
      spread = (le * mr + re_ * ml + le * re_) if kind == "mul" else le + re_
      return self.add_node(expression, value, lambda r, d: spread + rounding(r, d), "binary", srcs)
    if kind == "div":
      denominator = np.asarray(rv, dtype=np.float64)
      smallest = float(np.min(np.abs(denominator))) if denominator.size else 1.0
      if smallest < 0.5: raise Rejected("small divisor")
      value = np.asarray(lv, dtype=np.float64) / denominator
      return self.add_node(expression, value, lambda r, d: (le + max_abs(r) * re_) / (smallest - re_)
                           + 3 * EPS * max_abs(r), "binary", srcs)
    if kind in ("floordiv", "mod"):
      if np.any(np.asarray(rv) == 0): raise Rejected("zero divisor")
      value = np.floor_divide(lv, rv) if kind == "floordiv" else np.mod(lv, rv)
      return self.add_node(expression, value, 0.0, "binary", srcs)
    if kind in ("and", "or", "xor"):
      function = {"and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor}[kind]
      return self.add_node(expression, function(lv, rv), 0.0, "binary", srcs)
    # comparisons: a float decision needs a margin larger than the operands' errors
    if le + re_ > 0:
      gap = np.abs(np.asarray(lv, dtype=np.float64) - np.asarray(rv, dtype=np.float64))
      if gap.size and gap.min() <= 2 * (le + re_): raise Rejected("comparison margin")
    function = {"<": np.less, ">": np.greater, "<=": np.less_equal, ">=": np.greater_equal, "==": np.equal,
                "!=": np.not_equal}[symbol]
    return self.add_node(expression, function(lv, rv), 0.0, "compare", srcs)

  def where(self) -> Node:
    condition = self.pick()
    if condition.dtype.is_float and condition.err > 0 and condition.value.size \
        and np.min(np.abs(condition.value)) <= 2 * condition.err:
      raise Rejected("where margin")
    x_code, x_value, ex, x_node = self.operand_for(condition, lambda dtype: True)
    both = np.broadcast_shapes(condition.shape, np.shape(x_value))
    y_code, y_value, ey, y_node = self.operand_for(condition, lambda dtype: True, both)
    srcs = tuple(node for node in (condition, x_node, y_node) if node is not None)
    value = np.where(condition.value != 0, x_value, y_value)
    return self.add_node(f"{condition.name}.where({x_code}, {y_code})", value, max(ex, ey), "where", srcs)

  def reduce(self) -> Node:
    rng = self.rng
    a = self.pick(lambda node: node.value.ndim > 0)
    kind = rng.choice(["sum", "sum", "max", "min", "mean"])
    ndim = a.value.ndim
    axes = tuple(sorted(rng.sample(range(ndim), rng.randint(1, ndim))))
    keepdim = rng.random() < 0.5
    count = prod(a.shape[axis] for axis in axes)
    if kind in ("max", "min", "mean") and count == 0: raise Rejected("empty reduce")
    axis_code = repr(axes[0]) if len(axes) == 1 and rng.random() < 0.5 else repr(axes)
    if len(axes) == ndim and rng.random() < 0.3: axis_code = "None"
    expression = f"{a.name}.{kind}(axis={axis_code}, keepdim={keepdim})"
    value = getattr(np, kind)(a.value, axis=axes, keepdims=keepdim)
    ea = a.err
    if kind in ("max", "min"): return self.add_node(expression, value, ea, "reduce", (a,))
    absolute_sums = np.sum(np.abs(as_float_mirror(a)), axis=axes) if a.value.size else np.zeros(1)
    largest_sum = max_abs(absolute_sums)
    integral = np.all(as_float_mirror(a) == np.trunc(as_float_mirror(a)))
    exact = ea == 0 and bool(integral) and largest_sum < EXACT_FLOAT_LIMIT
    sum_err = 0.0 if exact else count * ea + count * EPS * largest_sum
    if kind == "sum": return self.add_node(expression, value, sum_err, "reduce", (a,))
    return self.add_node(expression, value, lambda r, d: sum_err / count + 3 * EPS * max_abs(r), "reduce", (a,))

  def matmul(self) -> Node:
    rng = self.rng
    a = self.pick(lambda node: 1 <= node.value.ndim <= 3 and node.shape[-1] > 0)
    k = a.shape[-1]
    candidates = self.live_nodes(lambda node: node.value.ndim in (1, 2) and node.shape[0] == k)
    if candidates and rng.random() < 0.4:
      b = rng.choice(candidates)
    else:
      b = self.add_input((k,) if rng.random() < 0.2 else (k, rng.choice([1, 2, 3, 4, 5, 8])),
                         a.dtype if rng.random() < 0.8 else self.random_dtype())
    if a.value.ndim == 1 and b.value.ndim == 1 and rng.random() < 0.5: raise Rejected("dot")
    value = np.matmul(a.value, b.value)
    magnitude = np.matmul(np.abs(as_float_mirror(a)), np.abs(as_float_mirror(b)))
    largest = max_abs(magnitude)
    if not a.dtype.is_float and not b.dtype.is_float and largest >= 2 ** 31: raise Rejected("int overflow")
    ea, eb, ma, mb = a.err, b.err, max_abs(a.value), max_abs(b.value)
    exact = ea == 0 and eb == 0 and largest < EXACT_FLOAT_LIMIT and all(
      np.all(as_float_mirror(node) == np.trunc(as_float_mirror(node))) for node in (a, b))
    err = 0.0 if exact else k * (ea * mb + eb * ma + ea * eb) + (k + 1) * EPS * largest
    return self.add_node(f"({a.name} @ {b.name})", value, err, "matmul", (a, b))

  def movement(self) -> Node:
    rng = self.rng
    kind = rng.choice(["reshape", "reshape", "permute", "expand", "pad", "shrink", "flip", "getitem", "getitem",
                       "cat", "index"])
    a = self.pick()
    shape, name, ea = a.shape, a.name, a.err
    ndim = len(shape)
    if kind == "reshape":
      new_shape = random_factorization(rng, prod(shape), max_ndim=5)
      if rng.random() < 0.2 and new_shape: new_shape = new_shape[:-1] + (-1,) if prod(shape) else new_shape
      return self.add_node(f"{name}.reshape({new_shape!r})", a.value.reshape(new_shape), ea, "movement", (a,))
    if kind == "permute":
      if ndim < 2: raise Rejected("permute of <2 dims")
      axes = list(range(ndim))
      rng.shuffle(axes)
      return self.add_node(f"{name}.permute({tuple(axes)!r})", a.value.transpose(axes), ea, "movement", (a,))
    if kind == "expand":
      if 1 not in shape:
        axis = rng.randint(0, ndim)
        shape = shape[:axis] + (1,) + shape[axis:]
        name = f"{name}.reshape({shape!r})"
      new_shape = tuple(rng.choice([2, 3, 4, 5]) if size == 1 and rng.random() < 0.8 else size for size in shape)
      if rng.random() < 0.2: new_shape = (rng.choice([2, 3]),) + new_shape  # a new leading dim
      value = np.broadcast_to(a.value.reshape(shape), new_shape)
      return self.add_node(f"{name}.expand({new_shape!r})", value, ea, "movement", (a,))
    if kind == "pad":
      if ndim == 0: raise Rejected("pad of 0-d")
      pairs = tuple((rng.choice([0, 0, 1, 2]), rng.choice([0, 0, 1, 3])) for _ in shape)
      fill: Any = 0
      if rng.random() < 0.4 and a.dtype != dtypes.bool:
        fill = rng.choice(FLOAT_CONSTANTS if a.dtype.is_float else INT_CONSTANTS)
      code = f"{name}.pad({pairs!r})" if fill == 0 else f"{name}.pad({pairs!r}, value={fill!r})"
      return self.add_node(code, np.pad(a.value, pairs, constant_values=fill), ea, "movement", (a,))
    if kind == "shrink":
      if ndim == 0: raise Rejected("shrink of 0-d")
      bounds = random_shrink_bounds(rng, shape)
      value = a.value[tuple(slice(start, end) for start, end in bounds)]
      return self.add_node(f"{name}.shrink({tuple(bounds)!r})", value, ea, "movement", (a,))
    if kind == "flip":
      if ndim == 0 or self.no_flips: raise Rejected("flip of 0-d" if ndim == 0 else "flip avoided")
      axes = tuple(sorted(rng.sample(range(ndim), rng.randint(1, ndim))))
      return self.add_node(f"{name}.flip({axes!r})", np.flip(a.value, axes), ea, "movement", (a,))
    if kind == "getitem":
      index = random_basic_index(rng, shape, negative_steps=not self.no_flips)
      return self.add_node(f"{name}[{index_code(index)}]", a.value[index], ea, "movement", (a,))
    if kind == "cat":
      if ndim == 0: raise Rejected("cat of 0-d")
      axis = rng.randrange(ndim)
      other_shape = shape[:axis] + (rng.choice([1, 2, 3]),) + shape[axis + 1:]
      others = self.live_nodes(lambda node: node.shape == other_shape and node.dtype == a.dtype)
      b = rng.choice(others) if others and rng.random() < 0.5 else self.add_input(other_shape, a.dtype)
      value = np.concatenate([a.value, b.value], axis=axis)
      return self.add_node(f"Tensor.cat([{name}, {b.name}], dim={axis})", value, max(ea, b.err), "movement", (a, b))
    # integer-list indexing of one dim (ourgrad computes it as a masked sum)
    if ndim == 0 or shape[0] == 0: raise Rejected("index of empty")
    positions = [rng.randrange(shape[0]) for _ in range(rng.randint(1, 4))]
    return self.add_node(f"{name}[{positions!r}]", a.value[positions], ea, "movement", (a,))

  OPS: dict[str, int] = {"unary": 5, "binary": 6, "where": 2, "reduce": 3, "matmul": 1, "movement": 5}

  def step(self, weights: dict[str, int] | None = None) -> Node | None:
    """Add one random op (up to 30 attempts); None when nothing fitted."""
    weights = weights or self.OPS
    kinds, counts = list(weights), list(weights.values())
    for _ in range(30):
      kind = self.rng.choices(kinds, counts)[0]
      try:
        return getattr(self, kind)()
      except Rejected as rejection:
        self.rejections[str(rejection)] = self.rejections.get(str(rejection), 0) + 1
    return None

  def graph(self, outputs: list[int]) -> Graph:
    return Graph(list(self.lines), list(self.inputs), list(self.nodes), outputs)


def random_graph(rng: random.Random, min_ops: int = 3, max_ops: int = 10, weights: dict[str, int] | None = None,
                 no_flips: bool = False) -> tuple[GraphGen, Graph]:
  """A random program of min_ops..max_ops ops (not counting inputs) whose last node is its output."""
  gen = GraphGen(rng, no_flips=no_flips)
  for _ in range(rng.randint(1, 2)): gen.add_input()
  target = rng.randint(min_ops, max_ops)
  made = 0
  while made < target:
    if gen.step(weights) is None: break
    made += 1
  return gen, gen.graph([gen.nodes[-1].index])


def _broadcastable(first: tuple[int, ...], second: tuple[int, ...]) -> bool:
  try:
    result = np.broadcast_shapes(first, second)
  except ValueError:
    return False
  return prod(result) <= MAX_ELEMENTS


def _mirror_comparison(symbol: str) -> str:
  return {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "==": "==", "!=": "!="}[symbol]


def random_basic_index(rng: random.Random, shape: tuple[int, ...], negative_steps: bool = True) -> tuple[Any, ...]:
  """A numpy/ourgrad basic index: ints, slices with steps (negative too, unless told not to), None."""
  items: list[Any] = []
  for size in shape:
    choice = rng.random()
    if choice < 0.2 and size > 0: items.append(rng.randrange(-size, size))
    elif choice < 0.75:
      step = rng.choice([1, 1, 2, 3, -1, -2] if negative_steps else [1, 1, 2, 3])
      start = rng.choice([None, 0, 1, -1])
      stop = rng.choice([None, None, size - 1, 2])
      items.append(slice(start, stop, step))
    else: items.append(slice(None))
    if rng.random() < 0.08: items.append(None)
  return tuple(items)


def index_code(index: tuple[Any, ...]) -> str:
  def one(item: Any) -> str:
    if isinstance(item, slice):
      parts = ["" if item.start is None else str(item.start), "" if item.stop is None else str(item.stop)]
      return ":".join(parts) + (f":{item.step}" if item.step not in (None, 1) else "")
    return repr(item)
  return ", ".join(one(item) for item in index) + ("," if len(index) == 1 else "") if index else "()"


def compare(got: np.ndarray, node: Node, label: str) -> None:
  """Assert a device result matches the node's mirror within its error bound (exactly when err == 0)."""
  expected = node.value
  assert got.shape == expected.shape, f"{label}: shape {got.shape} != expected {expected.shape}"
  want_dtype = np.dtype(node.dtype.np)
  assert got.dtype == want_dtype, f"{label}: numpy() dtype {got.dtype} != {want_dtype} ({node.dtype})"
  if node.dtype.is_float:
    values = got.astype(np.float64)
    if not np.all(np.isfinite(values)):
      raise AssertionError(f"{label}: non-finite values {values[~np.isfinite(values)][:4]}; expected {expected}")
    tolerance = 2 * node.err + 1e-30
    bad = np.abs(values - expected) > tolerance
  else:
    bad = got.astype(np.int64) != expected.astype(np.int64)
  if np.any(bad):
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise AssertionError(f"{label}: {int(bad.sum())} of {bad.size} elements wrong (tolerance {2 * node.err:.3g}); "
                         f"first at {where}: got {got[where]!r}, expected {expected[where]!r}\n"
                         f"got      {np.array2string(got, threshold=40)}\n"
                         f"expected {np.array2string(expected, threshold=40)}")
