"""The primitive operations and the kernel AST.

`Ops` names every primitive; the frozensets group them (unary, binary, ...). A `LazyOp` is one node of
a kernel's AST: `STORE(ALU(LOAD(buf, view), CONST, REDUCE(...)))`. LOAD/STORE/CONST nodes carry a
`MemBuffer`/`ConstBuffer` argument holding the ShapeTracker through which the kernel sees the buffer.
`exec_alu` evaluates one ALU op on Python scalars: constant folding and the PYTHON device use it.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from enum import Enum, auto
from typing import Any, Callable

from ourgrad.dtype import DType, dtypes, is_additive_identity, truncate
from ourgrad.shape.shapetracker import ShapeTracker


class Ops(Enum):
  """Every primitive. Comments give the group; the frozensets below are the groups as sets."""
  # unary
  EXP2 = auto()
  LOG2 = auto()
  SIN = auto()
  SQRT = auto()
  RECIP = auto()
  NEG = auto()
  CAST = auto()
  BITCAST = auto()
  # binary
  ADD = auto()
  MUL = auto()
  IDIV = auto()
  MOD = auto()
  MAX = auto()
  CMPLT = auto()
  CMPNE = auto()
  AND = auto()
  OR = auto()
  XOR = auto()
  SHL = auto()
  SHR = auto()
  # ternary
  WHERE = auto()
  MULACC = auto()
  # reduce
  SUM = auto()
  MAX_REDUCE = auto()
  # movement (they only edit views; named so graphs and docs can show them)
  RESHAPE = auto()
  PERMUTE = auto()
  EXPAND = auto()
  PAD = auto()
  SHRINK = auto()
  FLIP = auto()
  # buffer creation and meta ops of the lazy graph
  EMPTY = auto()
  CONST = auto()
  COPY = auto()
  CONTIGUOUS = auto()
  ASSIGN = auto()
  CUSTOM = auto()
  # an indexed read: srcs (table (N, R), index (M, R) int32, the row number broadcast along R) -> (M, R) rows of table
  # (0 where the index is outside [0, N)); in a kernel AST it becomes a LOAD whose srcs give the offset (see LazyOp)
  GATHER = auto()
  # an indexed accumulate: srcs (start (N, R), index (M,) int32, rows (M, R)) -> (N, R): start with rows[m] added to
  # row index[m] for m = 0, 1, ... in order (repeated indices summed; an index outside [0, N) adds nothing). Always a
  # kernel of its own (codegen/index_accumulate.py); its kernel AST is STORE(INDEX_ACCUMULATE(start, index, rows))
  INDEX_ACCUMULATE = auto()
  # fused attention: srcs (q (B, H, L, D), k, v (B, Hk, S, D)), arg (causal, scale) -> one buffer of q's dtype: O laid
  # out (B, L, H, D), then the float32 logsumexp of each query row (B, H, L) as bytes. Always a kernel of its own
  # (codegen/attention.py);
  # its kernel AST is STORE(ATTENTION(LOAD q, LOAD k, LOAD v)), each load one View of a realized buffer
  ATTENTION = auto()
  # fused attention backward (codegen/attention_grad.py), each always a kernel of its own, arg (causal, scale,
  # packed, single_pass), AST STORE(OP(LOAD ...)). ATTENTION_DQ: srcs (q, k, v, the ATTENTION buffer, dO (B, H, L, D))
  # -> one buffer of the operands' dtype: dq (B, H, L, D) then the bytes of delta = rowsum(dO * O) (B, H, L, float32).
  # ATTENTION_DKDV: srcs (q, k, v, dO, the ATTENTION buffer, the ATTENTION_DQ buffer) -> dk then dv, each (B, Hk, S,
  # D). packed (q, k, v tile one base, LazyBuffer.attention_grads): both write one buffer, the base's elements (dq,
  # dk, dv through q, k, v's views) then delta; the dK/dV op writes into the dQ op's buffer. single_pass: one buffer
  # too, a float32 dq (B, H, L, D) that the dQ op zeroes and the dK/dV op adds into, delta, then dk and dv
  ATTENTION_DQ = auto()
  ATTENTION_DKDV = auto()
  # leaves and root of a kernel AST
  LOAD = auto()
  STORE = auto()
  # root of a kernel AST with several outputs over one iteration space: srcs are its STOREs (data0, data1, ...)
  SINK = auto()
  # root of a packed kernel (several independent elementwise kernels of different shapes in one launch): srcs are the
  # segments' roots (STORE or SINK), every view in them flat (one dimension); buffer numbers are the packed kernel's
  PACK = auto()
  # root of a one-kernel split reduce (codegen/last_block.py): srcs (the partials' STORE, the STORE of their reduce
  # over the parts); buffers 0 the partials, 1 the outputs, then the first STORE's inputs
  SPLIT_REDUCE = auto()
  # root of a kernel that carries a one-block reduce (codegen/ride_along.py): srcs (the host kernel's root, STORE or
  # SINK, its buffers numbered as the merged kernel's; the rider's STORE in its own numbers), arg: the merged number
  # of each of the rider's buffers
  RIDE_ALONG = auto()

  # members are singletons compared by identity: hashing by identity is C code, where Enum's own __hash__ (a Python
  # method hashing the name, as randomized per process as this) ran for every op in every set test and cache key
  __hash__ = object.__hash__

# Every member is also a global of this module under its own name (ops.ADD is Ops.ADD): per-op code imports the ones
# it reads (`from ourgrad.ops import ADD, MUL`) and reads them as its own module globals, one dict lookup. In Python
# 3.11 `Ops.ADD` goes through EnumType's __getattr__ hook (the metaclass defines one, so every attribute read of the
# class takes the slow generic slot: ~0.2 us a read, several per op built, a few hundred per training step).
globals().update(Ops.__members__)

UNARY_OPS = frozenset({Ops.EXP2, Ops.LOG2, Ops.SIN, Ops.SQRT, Ops.RECIP, Ops.NEG, Ops.CAST, Ops.BITCAST})
BINARY_OPS = frozenset({Ops.ADD, Ops.MUL, Ops.IDIV, Ops.MOD, Ops.MAX, Ops.CMPLT, Ops.CMPNE, Ops.AND, Ops.OR,
                        Ops.XOR, Ops.SHL, Ops.SHR})
TERNARY_OPS = frozenset({Ops.WHERE, Ops.MULACC})
ELEMENTWISE_OPS = UNARY_OPS | BINARY_OPS | TERNARY_OPS
REDUCE_OPS = frozenset({Ops.SUM, Ops.MAX_REDUCE})
MOVEMENT_OPS = frozenset({Ops.RESHAPE, Ops.PERMUTE, Ops.EXPAND, Ops.PAD, Ops.SHRINK, Ops.FLIP})
BUFFER_OPS = frozenset({Ops.EMPTY, Ops.CONST, Ops.COPY, Ops.CONTIGUOUS, Ops.ASSIGN, Ops.CUSTOM})
COMPARISON_OPS = frozenset({Ops.CMPLT, Ops.CMPNE})
# fused attention and its backward: whole-kernel plans reading each operand in place (STORE(OP(LOAD ...)))
ATTENTION_OPS = frozenset({Ops.ATTENTION, Ops.ATTENTION_DQ, Ops.ATTENTION_DKDV})
# ops with f(0) != 0 (or undefined at 0): a padded view cannot be pushed through them, because the padded
# places read as 0 and must stay 0 after the op. A fused graph holding one of these is realized before padding.
UNSAFE_PAD_OPS = frozenset({Ops.EXP2, Ops.LOG2, Ops.RECIP, Ops.IDIV, Ops.MOD})


@dataclass(frozen=True)
class MemBuffer:
  """A kernel argument: buffer number `idx` of the kernel, seen through `st`."""
  idx: int
  dtype: DType
  st: ShapeTracker


@dataclass(frozen=True)
class ConstBuffer:
  """A constant broadcast through `st` (the view's mask makes padded places 0)."""
  val: Any
  dtype: DType
  st: ShapeTracker


@dataclass(frozen=True, eq=False)
class LazyOp:
  """One node of a kernel AST. `arg` is a MemBuffer/ConstBuffer for leaves, the reduced axes for reduces,
  the target dtype for CAST/BITCAST.

  A LOAD normally has no srcs. A gathered LOAD (from Ops.GATHER) has two: an int32 element offset and a bool
  validity, computed per element by the kernel (from other loads); it reads element `offset + view index` where
  both its view and `valid` allow, and 0 elsewhere.

  ASTs key the compiled-kernel cache, and fused chains can be thousands of nodes deep, so hashing and equality
  never recurse: the hash is computed once at construction from the sources' (already computed) hashes, and
  equality walks both trees with an explicit stack."""
  op: Ops
  srcs: tuple[LazyOp, ...] = ()
  arg: Any = None
  dtype: DType = dtypes.float32

  def __post_init__(self) -> None:
    structure = (self.op, tuple(src._hash for src in self.srcs), _hashable_arg(self.arg), self.dtype)
    object.__setattr__(self, "_hash", hash(structure))

  def __hash__(self) -> int: return self._hash  # type: ignore[attr-defined]

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, LazyOp): return NotImplemented
    pairs = [(self, other)]
    compared: set[tuple[int, int]] = set()
    while pairs:
      left, right = pairs.pop()
      if left is right or (id(left), id(right)) in compared: continue
      compared.add((id(left), id(right)))
      if left._hash != right._hash or left.op is not right.op or left.dtype != right.dtype: return False
      if len(left.srcs) != len(right.srcs) or _hashable_arg(left.arg) != _hashable_arg(right.arg): return False
      pairs.extend(zip(left.srcs, right.srcs))
    return True

  def walk(self) -> list[LazyOp]:
    """Every node once, children before parents (explicit stack, no recursion)."""
    order: list[LazyOp] = []
    seen: set[int] = set()
    stack: list[tuple[LazyOp, bool]] = [(self, False)]
    while stack:
      node, children_done = stack.pop()
      if id(node) in seen: continue
      if children_done:
        seen.add(id(node))
        order.append(node)
        continue
      stack.append((node, True))
      stack.extend((src, False) for src in reversed(node.srcs))
    return order

  def leaves(self) -> list[LazyOp]:
    return [node for node in self.walk() if node.op in (Ops.LOAD, Ops.CONST)]

  def renumbered(self, number: Callable[[int], int]) -> LazyOp:
    """This AST with each MemBuffer's index mapped by `number` (a function of the old index): the kernel's part of a
    schedule item merged with another reads its buffers in the merged item's order."""
    rebuilt: dict[int, LazyOp] = {}
    for node in self.walk():   # sources before the nodes that read them
      arg = node.arg
      if isinstance(arg, MemBuffer): arg = MemBuffer(number(arg.idx), arg.dtype, arg.st)
      rebuilt[id(node)] = LazyOp(node.op, tuple(rebuilt[id(src)] for src in node.srcs), arg, node.dtype)
    return rebuilt[id(self)]

  def stores(self) -> list[LazyOp]:
    """The STOREs of a kernel AST: itself, or the sources of a SINK (a kernel with several outputs)."""
    return list(self.srcs) if self.op is Ops.SINK else [self]

  def __str__(self) -> str: return format_ast(self)


def _hashable_arg(arg: Any) -> Any:
  """Constants compare by type and value (1 and 1.0 and True differ; NaN equals NaN)."""
  if isinstance(arg, ConstBuffer):
    value = ("nan",) if isinstance(arg.val, float) and math.isnan(arg.val) else (type(arg.val), arg.val)
    # 0.0 == -0.0, but x * -0.0 and x * 0.0 are different kernels
    if isinstance(arg.val, float) and arg.val == 0: value = (float, arg.val, math.copysign(1.0, arg.val))
    return (value, arg.dtype, arg.st)
  return arg


def _describe_view(st: ShapeTracker) -> str:
  parts = []
  for view in st.views:
    mask = f" mask={view.mask}" if view.mask is not None else ""
    offset = f" offset={view.offset}" if view.offset else ""
    parts.append(f"shape={view.shape} strides={view.strides}{offset}{mask}")
  return " | ".join(parts)


def format_ast(ast: LazyOp) -> str:
  """The AST as an indented tree, one node per line (DEBUG=3). Shared subtrees are printed each time."""
  lines: list[str] = []
  stack: list[tuple[LazyOp, int]] = [(ast, 0)]
  while stack:
    node, depth = stack.pop()
    if isinstance(node.arg, MemBuffer):
      detail = f" data{node.arg.idx} {_describe_view(node.arg.st)}"
    elif isinstance(node.arg, ConstBuffer):
      detail = f" {node.arg.val} {_describe_view(node.arg.st)}"
    elif node.arg is not None:
      detail = f" {node.arg}"
    else:
      detail = ""
    lines.append(f"{'  ' * depth}{node.op.name} {node.dtype.name}{detail}")
    stack.extend((src, depth + 1) for src in reversed(node.srcs))
  return "\n".join(lines)


# ---------------------------------------------------------------- evaluating ALU ops on Python scalars

def _safe_exp2(x: float) -> float:
  try: return 2.0 ** x
  except OverflowError: return math.inf


def _safe_log2(x: float) -> float:
  if x > 0: return math.log2(x) if not math.isinf(x) else math.inf
  if x == 0: return -math.inf
  return math.nan


def _safe_sqrt(x: float) -> float: return math.sqrt(x) if x >= 0 else (x if math.isnan(x) else math.nan)
def _safe_recip(x: float) -> float: return (1 / x) if x != 0 else math.copysign(math.inf, x)
def _safe_sin(x: float) -> float: return math.sin(x) if math.isfinite(x) else math.nan


def _int_div(a: int, b: int) -> int:
  """C semantics: truncate toward zero (what every backend's integer '/' does). Division by 0 gives 0."""
  if b == 0: return 0
  quotient = abs(a) // abs(b)
  return quotient if (a >= 0) == (b >= 0) else -quotient


def _int_mod(a: int, b: int) -> int:
  """C semantics: the remainder has the sign of the dividend."""
  return a - _int_div(a, b) * b if b != 0 else 0


def _nan_max(a: Any, b: Any) -> Any:
  if isinstance(a, float) and math.isnan(a): return a
  if isinstance(b, float) and math.isnan(b): return b
  return max(a, b)


PYTHON_ALU: dict[Ops, Callable[..., Any]] = {
  Ops.EXP2: _safe_exp2, Ops.LOG2: _safe_log2, Ops.SIN: _safe_sin, Ops.SQRT: _safe_sqrt, Ops.RECIP: _safe_recip,
  Ops.NEG: lambda x: (not x) if isinstance(x, bool) else -x,
  Ops.ADD: operator.add, Ops.MUL: operator.mul, Ops.IDIV: _int_div, Ops.MOD: _int_mod, Ops.MAX: _nan_max,
  Ops.CMPLT: operator.lt, Ops.CMPNE: operator.ne, Ops.AND: operator.and_, Ops.OR: operator.or_,
  Ops.XOR: operator.xor, Ops.SHL: lambda a, b: a << b, Ops.SHR: lambda a, b: a >> b,
  Ops.WHERE: lambda cond, a, b: a if cond else b, Ops.MULACC: lambda a, b, c: a * b + c,
}


def exec_alu(op: Ops, dtype: DType, operands: tuple[Any, ...]) -> Any:
  """Evaluate `op` on Python scalars and round the result to what `dtype` holds."""
  if op is Ops.RECIP and dtype.is_int: raise ValueError("RECIP of an integer dtype")
  result = PYTHON_ALU[op](*operands)
  return truncate(dtype, result)


def is_identity_constant(op: Ops, value: Any, dtype: DType) -> bool:
  """Whether `x op value` is x for every x of `dtype` (and `value op x`, both ops commuting): x * 1, and x + 0 where
  0 is the dtype's additive identity (for floats only -0.0: dtype.is_additive_identity)."""
  if op is Ops.MUL: return value is not None and value == 1
  return op is Ops.ADD and is_additive_identity(value, dtype)
