"""Structural keys of lazy bases, made once when each base is made, so that the schedule cache finds a graph it
scheduled before by a lookup instead of a walk of the whole graph at every realize (issue 26).

A base's key (`StructureKey`, interned: two keys are equal exactly when they are the same object) stands for the
tree of computation behind it: its op, arg, dtype, device, shape and forced-realize flag, and for each source either
the key of the unrealized base it reads (with the view it reads through) or a realized buffer (a leaf: its view, its
base's shape, its device, size, dtype and kind). Leaves are numbered by first occurrence in source order, and every
base keeps its distinct leaf buffers in that order (`_leaves`): x + x and x + y have different keys, and a hit binds
the cached kernels to this graph's leaves. Buffer identities are not in the key (a training step reads a new batch
buffer each time), constants' values are.

The tree is what the key describes, not the sharing of unrealized bases inside it: two graphs of one key compute the
same values from the same leaves, so the cached kernels compute this graph's values (a subtree shared in one graph
and duplicated in the other is at worst computed twice).

A key stays true while the base's subgraph keeps its realized / unrealized split and its sources. What changes that
calls `forget_readers_of` (a base realized: the keys above it read it as a leaf now) or `forget_structure` (a base's
sources or forced flag changed); the keys above are dropped and remade on demand (`structure`).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
  from ourgrad.lazy import LazyBuffer


class StructureKey:
  """An interned structural token: equal tokens give the same object, so keys compare and hash by identity (object's
  own __eq__ and __hash__, in C: a key is hashed inside every token above it)."""
  __slots__ = ("token",)

  def __init__(self, token: tuple):
    self.token = token

  def __repr__(self) -> str: return f"<StructureKey {hash(self.token):#x}>"


_INTERNED: dict[tuple, StructureKey] = {}
# distinct structures remembered; past it the table starts over: keys made afterwards are new objects, so a graph
# seen before misses once (never a wrong hit: only equal tokens ever share an object)
_INTERNED_MAX = 1 << 17


def intern(token: tuple) -> StructureKey:
  """The one key object of `token` (whose parts hash and compare by value, or are keys themselves)."""
  key = _INTERNED.get(token)
  if key is None:
    if len(_INTERNED) >= _INTERNED_MAX: _INTERNED.clear()
    key = _INTERNED[token] = StructureKey(token)
  return key


_PLAIN_ARG_TYPES = (type(None), int, bool, str)


def hashable_arg(arg: Any) -> Any:
  """An op's arg as a key part: itself where hashable (a float zero with its sign), else its repr."""
  if type(arg) in _PLAIN_ARG_TYPES: return arg   # most args (None for elementwise ops, ints): no hash() to try
  # 0.0 == -0.0 (and both hash alike), but constants of either sign make different kernels
  if type(arg) is float: return (arg, math.copysign(1.0, arg)) if arg == 0 else arg
  try:
    hash(arg)
  except TypeError:
    return repr(arg)
  return arg


def sources_token(srcs: Sequence[LazyBuffer]) -> tuple[tuple, tuple]:
  """(one token per source, the distinct leaf buffers they read in first-occurrence order)."""
  tokens: list[tuple] = []
  leaves: tuple = ()
  merged: list | None = None               # the leaves as a list, once a second source's leaves are numbered in
  position: dict[int, int] = {}            # id(leaf) -> its number, filled with `merged`
  for src in srcs:
    base = src._base if src._base is not None else src
    buffer = base.realized
    if buffer is None:
      key, child_leaves = base._skey, base._leaves
      if key is None: key, child_leaves = structure(base)
      if not child_leaves or child_leaves is leaves:
        tokens.append((key, src.st))
        continue
      if merged is None and leaves == child_leaves[:len(leaves)]:
        # the leaves so far begin the source's (none yet, or a chain that read more leaves since): numbered as the
        # source numbers them, nothing to map (a tuple compare by identity, in C: no per-leaf work)
        leaves = child_leaves
        tokens.append((key, src.st))
        continue
      if merged is None and child_leaves == leaves[:len(child_leaves)]:
        tokens.append((key, src.st))   # the source's leaves begin these: the same numbers
        continue
    if buffer is not None and merged is None:
      # a leaf read next to the leaves so far: found or appended by tuple operations in C (a Buffer compares by
      # identity), no numbering dict to build
      if buffer in leaves: index = leaves.index(buffer)
      else: index, leaves = len(leaves), leaves + (buffer,)   # (no ValueError to raise and catch)
      tokens.append((index, src.st, _leaf_key(base, buffer)))
      continue
    if merged is None:
      merged = list(leaves)
      position = {id(leaf): index for index, leaf in enumerate(merged)}
    if buffer is not None:
      index = position.setdefault(id(buffer), len(merged))
      if index == len(merged): merged.append(buffer)
      tokens.append((index, src.st, _leaf_key(base, buffer)))
      continue
    numbers = []   # the source's leaf numbers -> this token's
    for leaf in child_leaves:
      index = position.setdefault(id(leaf), len(merged))
      if index == len(merged): merged.append(leaf)
      numbers.append(index)
    tokens.append((key, src.st, tuple(numbers)))
  return tuple(tokens), (leaves if merged is None else tuple(merged))


def _leaf_key(base: LazyBuffer, buffer: Any) -> StructureKey:
  """A realized base as a leaf: its shape and its buffer's device, size, dtype and kind (the scheduler reads it only as
  memory, its op no longer matters), interned once per base: a weight is read by many ops every step."""
  remembered = base._leaf
  if remembered is not None and remembered[0] is buffer: return remembered[1]
  key = intern(("leaf", base.shape, buffer.device, buffer.size, buffer.dtype, type(buffer)))
  base._leaf = (buffer, key)
  return key


def describe(base: LazyBuffer) -> tuple[StructureKey, tuple]:
  """A base's key and leaves, from its sources' (which must be current)."""
  tokens, leaves = sources_token(base.srcs) if base.srcs else ((), ())
  arg = base.arg
  token = (base.op, arg if type(arg) in _PLAIN_ARG_TYPES else hashable_arg(arg), base.dtype, base.device, base.shape,
           base.forced_realize, tokens)
  # (intern's lookup inlined: one call fewer for every base made)
  key = _INTERNED.get(token)
  return (key if key is not None else intern(token)), leaves


def structure(base: LazyBuffer) -> tuple[StructureKey, tuple]:
  """An unrealized base's (key, leaves): the remembered ones, or remade where a change dropped them (an explicit
  stack: a dropped key may sit above a deep graph)."""
  if base._skey is not None: return base._skey, base._leaves
  stack: list[tuple[LazyBuffer, bool]] = [(base, False)]
  while stack:
    node, sources_done = stack.pop()
    if sources_done:
      node._skey, node._leaves = describe(node)
      continue
    if node._skey is not None: continue
    stack.append((node, True))
    for src in node.srcs:
      src_base = src._base if src._base is not None else src
      if src_base.realized is None and src_base._skey is None: stack.append((src_base, False))
  assert base._skey is not None
  return base._skey, base._leaves


def forget_structure(base: LazyBuffer) -> None:
  """`base`'s sources or forced flag changed: drop its key and those of the live unrealized bases built on it."""
  stack = [base]
  while stack:
    node = stack.pop()
    # a node without a key has none above it either: a reader made later remade it (and set it) first
    if node._skey is None and node is not base: continue
    node._skey = node._leaves = None
    stack.extend(reader for reader in node.live_readers() if reader.realized is None)


def forget_readers_of(base: LazyBuffer) -> None:
  """`base` was just realized: the live unrealized bases built on it read it as a leaf from now on. Its own key
  and leaves are dropped (a realized base is a leaf; its leaves would keep their buffers alive)."""
  base._skey = base._leaves = None
  for reader in base.live_readers():
    if reader.realized is None: forget_structure(reader)
