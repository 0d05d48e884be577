"""Vector memory access in the Linearizer: where a lane's load is one element of an aligned vector load (float4 and
the like: contiguous along an upcast or unroll axis, or provably neighbouring elements of a multi-view view, a masked
view loaded as one gated vector where its validity is the same for the whole vector), and where every output is
stored as vectors along one upcast axis. A mixin: the Linearizer supplies the kernel, the builder and the index
helpers (`_index_nodes`, `_index`, `node_to_uop`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ourgrad.codegen.shared_tile_fill import multiple_of
from ourgrad.codegen.uops import UOp, UOps
from ourgrad.dtype import DType, dtypes
from ourgrad.helpers import GATED_VECTOR_LOADS
from ourgrad.ops import LazyOp, MemBuffer, Ops
from ourgrad.shape.symbolic import Node, NumNode, given_valid

if TYPE_CHECKING:
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.codegen.uops import UOpBuilder


def kept_where(kernel: Kernel, number: int) -> tuple[LazyOp, LazyOp] | None:
  """(condition, value) where output `number` stores where(condition, value, its own element): an assign that
  writes only where a mask holds (a KV cache's new row: `cache.assign(write.where(new, cache))`). Its store is gated
  by the condition, so the elements kept are neither read nor written again (the whole cache was, at every decode
  step). None for any other output."""
  store = kernel.stores[number]
  value = store.srcs[0]
  if value.op is not Ops.WHERE: return None
  condition, new, old = value.srcs
  if old.op is not Ops.LOAD or not isinstance(old.arg, MemBuffer) or old.arg.idx != store.arg.idx: return None
  if old.dtype != store.dtype or kernel.sts[kernel.leaf_number(old)] != kernel.sts[number]: return None
  return condition, new


class VectorAccess:
  """The Linearizer's vector loads and stores (a mixin: the Linearizer supplies the state and the index helpers)."""
  kernel: Kernel
  builder: UOpBuilder
  buffers: dict[int, UOp]
  leaf_index: dict[int, int]

  def _vector_widths(self, dtype: DType) -> list[int]:
    """The vector widths a load or store of `dtype` may take, widest first: Renderer.vector_lanes (16 bytes), then
    the float32 width (a 16-bit buffer along an axis upcast by 4, as a float32 kernel upcasts: 8-byte vectors)."""
    renderer = self.kernel.renderer
    width = renderer.vector_lanes(dtype) if hasattr(renderer, "vector_lanes") else 0
    if width < 2: return []
    return [width] + ([renderer.vector_width] if 2 <= renderer.vector_width < width else [])

  def _vector_store_axis(self) -> tuple[int, int] | None:
    """(the upcast axis along which every output is stored as vectors, the vector's width), if any: the renderer has
    them, each output's view is of a vector dtype, contiguous and unmasked along it, and the axis splits into whole
    vectors (a cat stored twice, an optimizer's parameter and moments: one vector store per output). The widest that
    every output takes (the narrowest output dtype's: a float32 output beside a bfloat16 one stores 4 at a time, as
    two float4s where the axis is upcast by 8)."""
    kernel = self.kernel
    if not kernel.stores: return None
    # a gated store (kept_where) writes few elements: scalar stores, each under its own condition
    if any(kept_where(kernel, number) is not None for number in range(len(kernel.stores))): return None
    contiguous = list(kernel.upcast_axes)
    for number, store in enumerate(kernel.stores):
      st = kernel.sts[number]
      if store.dtype not in kernel.renderer.vector_dtypes or len(st.views) != 1 or st.views[0].mask is not None:
        return None
      strides = st.real_strides()
      contiguous = [axis for axis in contiguous if strides[axis] == 1]
    narrowest = min(kernel.stores, key=lambda store: len(self._vector_widths(store.dtype))).dtype
    for width in self._vector_widths(narrowest):
      candidates = [axis for axis in contiguous if kernel.full_shape[axis] % width == 0]
      if candidates: return candidates[0], width
    return None

  def _emit_vector_store(self, pending: dict[tuple[int, ...], list[UOp]], lane: tuple[int, ...], idxs: list[Node],
                         axis: int, width: int, upcast_axes: list[int]) -> None:
    """Once the last element of a vector has every output's value, store each output's vector (aligned), or its
    elements one by one (scalar fallback) when the first element's index is not provably a multiple of the width.
    All the vector's values are computed before its first store: an output may overwrite (in place) a buffer another
    output's value loads."""
    position = upcast_axes.index(axis)
    if lane[position] % width != width - 1: return
    lanes = [lane[:position] + (lane[position] - width + 1 + element,) + lane[position + 1:]
             for element in range(width)]
    first = list(idxs)
    first[axis] = NumNode(idxs[axis].b - width + 1)
    lane_values = [pending.pop(element_lane) for element_lane in lanes]
    for number, store in enumerate(self.kernel.stores):
      buffer = self.buffers[store.arg.idx]
      values = tuple(values_at[number] for values_at in lane_values)
      index_node, _ = self._index_nodes(number, first)
      if multiple_of(index_node, width):
        self.builder.add(UOps.STORE, None, (buffer, self.node_to_uop(index_node)) + values, width)
        continue
      for element, value in enumerate(values):
        element_idxs = list(first)
        element_idxs[axis] = NumNode(first[axis].b + element)
        index, valid = self._index(number, element_idxs)
        self.builder.add(UOps.STORE, None, (buffer, index, value) + ((valid,) if valid is not None else ()))

  def _vector_load(self, node: LazyOp, idxs: list[Node]) -> UOp | None:
    """One element of a vector load (float4) where the renderer has them, the view is contiguous along an upcast or
    unroll axis and the first element's index is a multiple of the width (aligned); None for a scalar load. The
    lanes of that axis share the vector LOAD (the builder merges the identical loads), each taking one element.
    A view of several unmasked views (a reshape of a permuted view: attention heads merged back into rows) counts
    as contiguous along an axis where its real stride is unknown but the vector's elements are provably neighbours.
    A masked view (a piece of a cat, a padded edge) loads one gated vector where its validity is the same for the
    whole vector (the piece's edges fall between vectors): where it is false the load touches no memory."""
    kernel, widths = self.kernel, self._vector_widths(node.dtype)
    if not widths: return None
    # a tensor-core kernel's 16-bit operands are loaded as the mma takes them (raw fragment loads), not unpacked
    if node.dtype != dtypes.float32 and kernel.tensor_core is not None: return None
    leaf = self.leaf_index[id(node)]
    strides = kernel.sts[leaf].real_strides()
    for width in widths:
      # a known stride of 1 first; an unknown stride (several views) only where the elements prove to be neighbours
      axes = sorted((axis for axis in kernel.upcast_axes + kernel.unroll_axes
                     if strides[axis] in (1, None) and kernel.full_shape[axis] % width == 0 and
                     isinstance(idxs[axis], NumNode)), key=lambda axis: strides[axis] is None)
      for axis in axes:
        vector = self._vector_along(node, leaf, idxs, axis, width, strides[axis] is None)
        if vector is not None: return self.builder.add(UOps.GEP, node.dtype, (vector,), idxs[axis].b % width)
    return None

  def _vector_along(self, node: LazyOp, leaf: int, idxs: list[Node], axis: int, width: int,
                    unknown_stride: bool) -> UOp | None:
    """The vector LOAD holding this lane's element along `axis`, or None where the vector is not provably aligned
    and contiguous, or its validity (a masked view) differs between its elements."""
    first = list(idxs)
    first[axis] = NumNode(idxs[axis].b - idxs[axis].b % width)
    index_node, valid_node = self._index_nodes(leaf, first)
    if isinstance(valid_node, NumNode) and valid_node.b == 0: return None   # never read: the scalar path's zero
    masked = any(view.mask is not None for view in self.kernel.sts[leaf].views)
    if masked and not GATED_VECTOR_LOADS: return None
    if masked and not self._uniform_validity(leaf, first, axis, width, valid_node): return None
    # a gated vector's index only matters where its gate holds: simplified for that (a piece's block is known)
    gated = not isinstance(valid_node, NumNode)
    if gated: index_node = given_valid(index_node, valid_node)
    if unknown_stride and not self._neighbours(leaf, first, axis, width, index_node, valid_node if gated else None):
      return None
    if not multiple_of(index_node, width): return None
    gate = () if isinstance(valid_node, NumNode) else (self.node_to_uop(valid_node),)
    return self.builder.add(UOps.LOAD, node.dtype, (self.buffers[node.arg.idx], self.node_to_uop(index_node)) + gate,
                            width)

  def _uniform_validity(self, leaf: int, first: list[Node], axis: int, width: int, first_valid: Node) -> bool:
    """Whether the `width` elements from `first` along `axis` share one validity expression (a masked view whose
    mask edges do not cut the vector)."""
    for element in range(1, width):
      element_idxs = list(first)
      element_idxs[axis] = NumNode(first[axis].b + element)
      if self._index_nodes(leaf, element_idxs)[1] != first_valid: return False
    return True

  def _neighbours(self, leaf: int, first: list[Node], axis: int, width: int, first_index: Node,
                  valid: Node | None = None) -> bool:
    """Whether the `width` elements from `first` along `axis` lie at first_index + 0, 1, ..., width - 1 (where
    `valid` holds, when given)."""
    for element in range(1, width):
      element_idxs = list(first)
      element_idxs[axis] = NumNode(first[axis].b + element)
      index = self._index_nodes(leaf, element_idxs)[0]
      step = (given_valid(index, valid) if valid is not None else index) - first_index
      if not isinstance(step, NumNode) or step.b != element: return False
    return True
