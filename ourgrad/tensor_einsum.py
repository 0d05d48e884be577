"""einsum for Tensor (EinsumMixin): Einstein summation like torch.einsum / numpy.einsum.

`Tensor.einsum("bij,bjk->bik", a, b)`. The formula is parsed once; each operand is then brought to one common
layout with movement ops only: a letter repeated within an operand ("ii") takes the diagonal (a strided view),
the operand's axes are permuted into the order of all letters and size-1 axes are inserted for the letters it
lacks. The operands are then contracted left to right: multiply the running result with the next operand
(broadcasting) and sum the letters that neither a later operand nor the output uses. A two-operand einsum is one
broadcast multiply and one reduce, which the scheduler fuses like a matmul (the product is never stored).

Letters are a-z and A-Z; "..." stands for the broadcast batch dims (right-aligned, as numpy); an explicit output
may keep them anywhere ("b...i->...bi") or leave them out, which sums them ("...i->i"). Without "->" the output is
every letter used exactly once, in alphabetical order, after the "..." dims (the implicit form).

This module never imports the Tensor class: it works through the operands' methods.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ourgrad.errors import ShapeError
from ourgrad.mixed_precision import CastPolicy, autocast_op

if TYPE_CHECKING:
  from ourgrad.tensor import Tensor

_ELLIPSIS = "..."


def _split_terms(formula: str, count: int) -> tuple[list[str], str | None]:
  """The input terms and the output term (None for the implicit form) of a formula, spaces removed."""
  formula = formula.replace(" ", "")
  inputs, arrow, output = formula.partition("->")
  terms = inputs.split(",")
  if len(terms) != count:
    raise ValueError(f"einsum formula {formula!r} has {len(terms)} operand terms but {count} tensors were given")
  for term in [*terms, output] if arrow else terms:
    rest = term.replace(_ELLIPSIS, "", 1)
    if _ELLIPSIS[0] in rest or any(not char.isalpha() or not char.isascii() for char in rest):
      raise ValueError(f"einsum term {term!r} of {formula!r} may hold only letters and at most one '...'")
  return terms, (output if arrow else None)


def _letters(term: str, ndim: int, batch_names: list[str]) -> list[str]:
  """One name per dim of an operand: its letters, with "..." replaced by the batch names of its dims."""
  if _ELLIPSIS not in term:
    if len(term) != ndim: raise ShapeError(f"einsum term {term!r} names {len(term)} dims, the tensor has {ndim}")
    return list(term)
  before, after = term.split(_ELLIPSIS)
  batch = ndim - len(before) - len(after)
  if batch < 0: raise ShapeError(f"einsum term {term!r} names more dims than the tensor's {ndim}")
  return [*before, *batch_names[len(batch_names) - batch:], *after]


def _take_diagonals(x: Tensor, names: list[str]) -> tuple[Tensor, list[str]]:
  """For each name used twice by one operand, keep only the diagonal of those two dims (a view)."""
  while len(set(names)) != len(names):
    name = next(n for n in names if names.count(n) > 1)
    first, second = [index for index, n in enumerate(names) if n == name][:2]
    size = x.shape[first]
    if x.shape[second] != size:
      raise ShapeError(f"einsum index {name!r} repeated in one operand has sizes {size} and {x.shape[second]}")
    # move the pair last, flatten it to size*size and read every (size+1)-th element: the diagonal
    others = [index for index in range(x.ndim) if index not in (first, second)]
    kept = tuple(x.shape[i] for i in others)
    x = x.permute(*others, first, second).reshape(*kept, size * size)
    x = x.pad([None] * len(others) + [(0, size)]).reshape(*kept, size, size + 1)
    x = x.shrink([None] * len(others) + [None, (0, 1)]).reshape(*kept, size)
    names = [names[i] for i in others] + [name]
  return x, names


def _needed(rest: list[tuple[Tensor, list[str]]], output_names: list[str]) -> set[str]:
  """The indices that the operands still to come or the output use."""
  return set(output_names).union(*(names for _, names in rest))


def _sum_unneeded(x: Tensor, names: list[str], needed: set[str]) -> tuple[Tensor, list[str]]:
  """x summed over its indices not in `needed`, and the names of the dims left."""
  axes = tuple(axis for axis, name in enumerate(names) if name not in needed)
  if not axes: return x, names
  return x.sum(axes), [name for name in names if name in needed]


def _aligned(x: Tensor, names: list[str], order: list[str]) -> Tensor:
  """x permuted into `order` (a subset of it), with a size-1 dim for every index of `order` it lacks."""
  present = [n for n in order if n in names]
  x = x.permute(*(names.index(n) for n in present))
  return x.reshape(*(x.shape[present.index(n)] if n in names else 1 for n in order))


class EinsumMixin:
  """Tensor.einsum."""
  __slots__ = ()

  @staticmethod
  @autocast_op(CastPolicy.LOWER)
  def einsum(formula: str, *operands: Tensor | Sequence[Tensor]) -> Tensor:
    """Einstein summation, like torch.einsum: `Tensor.einsum("ij,jk->ik", a, b)` is a @ b, "ii->i" the diagonal,
    "ii" the trace, "...ij->...ji" a batched transpose, "i,j" the outer product (implicit output: the letters
    used once, alphabetically). The operands may also be given as one list. Differentiable in every operand."""
    tensors = list(operands[0]) if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else list(operands)
    if not tensors: raise ValueError("einsum needs at least one tensor")
    terms, output = _split_terms(formula, len(tensors))
    batch_rank = max((t.ndim - len(term.replace(_ELLIPSIS, "")) for t, term in zip(tensors, terms)
                      if _ELLIPSIS in term), default=0)
    batch_names = [f"...{index}" for index in range(batch_rank)]
    named = [_take_diagonals(t, _letters(term, t.ndim, batch_names)) for t, term in zip(tensors, terms)]

    # how often each index is written in the formula: the implicit output keeps those written once
    counts: dict[str, int] = {}
    for tensor, term in zip(tensors, terms):
      for name in _letters(term, tensor.ndim, batch_names): counts[name] = counts.get(name, 0) + 1
    if output is None:
      output_names = batch_names + sorted(n for n, c in counts.items() if c == 1 and n not in batch_names)
    else:
      output_names = _letters(output, len(output.replace(_ELLIPSIS, "")) + batch_rank * (_ELLIPSIS in output),
                              batch_names)
      if len(set(output_names)) != len(output_names):
        raise ValueError(f"einsum output {output!r} repeats an index")
      unknown = [n for n in output_names if n not in counts]
      if unknown: raise ValueError(f"einsum output {output!r} names indices no operand has: {unknown}")

    # the size of each index, checked across operands (size 1 broadcasts, as in the batch dims of numpy)
    sizes: dict[str, int] = {}
    for tensor, names in named:
      for name, size in zip(names, tensor.shape):
        if sizes.get(name, 1) != 1 and size not in (1, sizes[name]):
          raise ShapeError(f"einsum index {name!r} has size {sizes[name]} in one operand and {size} in another "
                           f"(formula {formula!r})")
        if size != 1 or name not in sizes: sizes[name] = size
    # contract left to right: multiply the running result with the next operand, then sum every index that no
    # later operand and not the output needs (a chain "ij,jk,kl" never builds the (i, j, k, l) product)
    result, result_names = _sum_unneeded(*named[0], _needed(named[1:], output_names))
    for index, (tensor, names) in enumerate(named[1:], start=1):
      order = result_names + [n for n in names if n not in result_names]
      product = _aligned(result, result_names, order) * _aligned(tensor, names, order)
      result, result_names = _sum_unneeded(product, order, _needed(named[index + 1:], output_names))
    result = _aligned(result, result_names, output_names)
    return result.expand(*(sizes[n] for n in output_names))
