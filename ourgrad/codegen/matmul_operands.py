"""The operands of a matmul-shaped reduce, and the loop axes each one varies along.

A matmul kernel is a SUM of MUL(x, y) (each side possibly cast to the accumulation dtype). The tile strategies read x
and y in different ways:
- the WGMMA plan and the convolution tiles copy whole tiles of a buffer, so they need x and y to be LOADs
  (`matmul_operands(..., computed=False)`);
- the tensor-core path (OptOps.TC) evaluates each fragment element (or each element of a staged tile) through the
  kernel's index math, so an operand may be any elementwise expression of loads and constants: a bias fused into the
  attention's Q (ADD), the q/k/v gradients concatenated into the qkv gradient (an ADD of padded, masked loads), a
  scale (MUL by a constant), a load through several views (a head permute after a reshape)
  (`matmul_operands(..., computed=True)`).

Which loop axes an operand varies along (`varying_axes`) is read from the index and validity expressions of its
leaves' views, not from strides alone: a view of several views has no single stride along an axis it still varies
along, and a padded view varies along its mask's axes (except along an output axis PADTO padded: there every view,
the output's too, is masked alike, and the padded outputs are never stored).
"""
from __future__ import annotations

import functools

from ourgrad.codegen.opts import KernelOptError
from ourgrad.dtype import DType
from ourgrad.ops import REDUCE_OPS, LazyOp, MemBuffer, Ops
from ourgrad.shape.shapetracker import ShapeTracker
from ourgrad.shape.symbolic import Variable


def is_plain_load(node: LazyOp) -> bool:
  """A LOAD of a buffer through its view (not a gathered load, whose address depends on other loads)."""
  return node.op is Ops.LOAD and isinstance(node.arg, MemBuffer) and not node.srcs


def operand_leaves(operand: LazyOp) -> list[LazyOp]:
  """The LOAD and CONST nodes an operand expression reads (each carries a view of the loop nest)."""
  return [node for node in operand.walk() if node.op in (Ops.LOAD, Ops.CONST)]


def _computed_operand_problem(operand: LazyOp) -> str | None:
  """Why an operand expression cannot be evaluated per element by the tensor-core path, or None where it can."""
  for node in operand.walk():
    if node.op in REDUCE_OPS: return f"a reduce ({node.op}) inside it"
    if node.op is Ops.LOAD and not is_plain_load(node): return "a gathered load (its address depends on loaded data)"
  return None


def matmul_operands(reduceop: LazyOp | None, dtype_in: DType, dtype_out: DType, what: str,
                    computed: bool = False) -> tuple[LazyOp, LazyOp]:
  """The two operands a matmul-shaped reduce multiplies: a SUM in `dtype_out` of MUL(x, y), each of x and y in
  `dtype_in`, possibly cast to the accumulation dtype (before or after the MUL). Each is a LOAD; with `computed`, any
  elementwise expression of loads and constants (no reduce, no gathered load). Raises KernelOptError naming what does
  not fit (`what`: the opt asking)."""
  if reduceop is None or reduceop.op is not Ops.SUM:
    raise KernelOptError(f"{what} needs a SUM reduce, not {reduceop.op if reduceop is not None else 'no reduce'}")
  if reduceop.dtype != dtype_out:
    raise KernelOptError(f"{what} accumulates in {dtype_out.name}, the reduce is {reduceop.dtype.name}")
  product = reduceop.srcs[0]
  if product.op is Ops.CAST: product = product.srcs[0]
  if product.op is not Ops.MUL: raise KernelOptError(f"{what} needs a reduce of a MUL, not of {product.op}")
  operands = [src.srcs[0] if src.op is Ops.CAST else src for src in product.srcs]
  for operand in operands:
    if computed:
      problem = _computed_operand_problem(operand)
      if problem is not None: raise KernelOptError(f"{what}: an operand of the MUL has {problem}")
    elif not is_plain_load(operand):
      raise KernelOptError(f"{what} needs the MUL's operands to be loads, got {operand.op}")
    if operand.dtype != dtype_in: raise KernelOptError(f"{what} takes {dtype_in.name} inputs, got {operand.dtype.name}")
  return operands[0], operands[1]


@functools.lru_cache(maxsize=4096)
def varying_axes(st: ShapeTracker) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
  """Per axis of the view's shape: (whether the element it addresses changes along the axis, whether its validity
  does): whether the axis's index variable appears in the index, in the validity expression."""
  idxs = st.default_idxs()
  index, valid = st.expr_idxs(idxs)
  in_index, in_valid = set(index.vars()), set(valid.vars())
  return (tuple(isinstance(idx, Variable) and idx in in_index for idx in idxs),
          tuple(isinstance(idx, Variable) and idx in in_valid for idx in idxs))
