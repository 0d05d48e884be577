"""Shared-memory tiles (OptOps.SHARED without tensor cores): the part of the Linearizer that lays out the staged
tiles of a reduce step in local memory (Kernel.staged_loads, tile_row_axes/padding/skew), fills them (every thread
of the block, element by element or as float4s; register prefetch into a second stage, or cp.async copies in
stages), and reads them back (float4 reads where a lane's elements are neighbours). Halo tiles (a convolution's
input) are filled by codegen/halo_tiles.py's HaloTileFill and read here.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ourgrad.codegen.kernel import SHARED_VECTOR_FILL, SKEW_ROWS
from ourgrad.codegen.halo_tiles import (last_round_unit, outer_row, split_constant, window_offset, wraps_back,
                                        wraps_last_round)
from ourgrad.codegen.uops import UOp, UOps
from ourgrad.dtype import DType, dtypes
from ourgrad.ops import LazyOp, Ops
from ourgrad.shape.symbolic import MulNode, Node, NumNode, SumNode

if TYPE_CHECKING:
  from ourgrad.codegen.kernel import Kernel
  from ourgrad.codegen.uops import UOpBuilder


class SharedTileFill:
  """The Linearizer's shared-memory tiles (a mixin: the Linearizer supplies the state and the helpers below)."""
  kernel: Kernel
  builder: UOpBuilder
  tiles: dict[int, tuple[UOp, list[int]]]
  tile_vectors: dict[tuple, UOp]
  tile_offsets: dict[int, Node]
  tile_layouts: dict[tuple[int, ...], tuple[list[int], list[int], int, int]]
  leaf_index: dict[int, int]

  def _define_shared_tiles(self, stages: int = 1) -> dict[int, tuple[UOp, list[int]]]:
    """A DEFINE_LOCAL per staged load (Kernel.staged_loads), `stages` tiles long: id of the load -> (local memory,
    tile axes)."""
    kernel, tiles = self.kernel, {}
    for number, (leaf, axes) in enumerate(kernel.staged_loads()):
      node = kernel.leaves[leaf]
      size = kernel.tile_elements(axes, leaf) * stages
      local = self.builder.add(UOps.DEFINE_LOCAL, node.dtype, (), (f"tile{number}", size))
      tiles[id(node)] = (local, axes)
      window = kernel.halo_window(leaf, axes)
      if window is not None: self.tile_windows[id(local)] = window
    return tiles

  def _tiles_double_buffered(self) -> bool:
    """SHARED tiles in two stages (register prefetch): each step loads step r + 1's tile values into registers
    before its math and stores them into the other stage after it, so the global loads' latency hides behind the
    math and one BARRIER per step is enough (stage (r + 1) % 2 was last read in step r - 1, before that step's
    barrier). Where there is one reduce loop, every tile fills in whole rounds of the block's threads (or the fills
    wrap their last round around: halo_tiles.wraps_last_round), and the tiles twice over still fit the device's
    local memory."""
    kernel = self.kernel
    staged = kernel.staged_loads()
    if not staged or kernel.first_upcast - kernel.first_loop_reduce != 1: return False
    threads = kernel.local_threads() * kernel.group_threads()
    wrap = wraps_last_round(kernel)
    for leaf, axes in staged:
      node = kernel.leaves[leaf]
      window = kernel.halo_window(leaf, axes)
      if window is not None: units = window.elements
      else:
        strides = kernel.sts[leaf].real_strides()
        fill_axes = sorted(axes, key=lambda axis: -abs(strides[axis]) if strides[axis] is not None else -2**62)
        units = math.prod(kernel.full_shape[axis] for axis in axes) // self._tile_load_width(node, fill_axes)
      if units % threads and not (wrap and wraps_back(units, threads)): return False
    # a second stage of the tiles beside what the block already holds (the tiles, GROUP partials)
    return kernel.local_memory_bytes() + kernel.staged_tile_bytes() <= getattr(kernel.renderer, "local_memory_bytes", 0)

  def _tile_address(self, axes: list[int], idxs: list[Node]) -> Node:
    key = tuple(axes)
    if key not in self.tile_layouts:   # (sizes, row axes, padding, skew) of a tile, computed once
      kernel = self.kernel
      self.tile_layouts[key] = ([kernel.full_shape[axis] for axis in axes], kernel.tile_row_axes(axes),
                                kernel.tile_row_padding(axes), kernel.tile_row_skew(axes))
    sizes, row_axes, padding, skew = self.tile_layouts[key]
    address: Node = NumNode(0)
    for axis, size in zip(axes, sizes): address = address * size + idxs[axis]
    if not padding: return address
    row: Node = NumNode(0)   # each row (Kernel.tile_row_axes) `padding` elements further on
    for axis in row_axes: row = row * sizes[axes.index(axis)] + idxs[axis]
    address = address + row * padding
    return address + row // SKEW_ROWS * skew if skew else address   # and each group of rows `skew` further on

  def _stage_shared_tiles(self, tiles: dict[int, tuple[UOp, list[int]]], axis_idxs: list[Node],
                          offsets: dict[int, Node], defer: bool = False,
                          copy: bool = False) -> list[tuple[UOp, Node, tuple[UOp, ...]]]:
    """At each reduce step, the block's threads load every staged tile together (element e by thread e mod the
    block's threads: neighbouring threads, neighbouring elements), then wait at a BARRIER; `_load` then reads the
    tiles. The tiles' elements are the loads' values at this step for every LOCAL/UPCAST/UNROLL index, stored at
    `offsets` (by id of the local memory) in it. `defer`: only the loads; returns the stores (local memory, address,
    values: one, or a vector's neighbouring elements) for the caller to emit (whole rounds only: no IF). `copy`:
    asynchronous COPYs instead of loads and stores, no BARRIER (the caller waits; see _copy_next_tile_step)."""
    if not tiles: return []
    kernel, build = self.kernel, self.builder
    deferred: list[tuple[UOp, Node, tuple[UOp, ...]]] = []
    # every thread of the block fills: LOCAL and GROUP threads (their ids in thread order, see Kernel.thread_axes)
    thread = self._flat_index(axis_idxs, range(kernel.global_dims, kernel.first_loop_reduce))
    threads = kernel.local_threads() * kernel.group_threads()
    wrap = wraps_last_round(kernel)
    nodes = {id(leaf): leaf for leaf in kernel.leaves}
    for node_id, (local, axes) in tiles.items():
      node = nodes[node_id]
      if id(local) in self.tile_windows:
        deferred += self._stage_halo_tile(node, local, axis_idxs, thread, offsets.get(id(local), NumNode(0)), defer,
                                          copy)
        continue
      # filled in the order of the load's strides (the smallest innermost: neighbouring threads read neighbouring
      # addresses), each element stored at its place in the tile's layout
      strides = kernel.sts[self.leaf_index[node_id]].real_strides()
      fill_axes = sorted(axes, key=lambda axis: -abs(strides[axis]) if strides[axis] is not None else -2**62)
      sizes = [kernel.full_shape[axis] for axis in fill_axes]
      total, width = math.prod(sizes), self._tile_load_width(node, fill_axes)
      # a unit's elements are neighbours in the tile too where the load's innermost axis is the tile's
      tile_vector = width > 1 and fill_axes[-1] == axes[-1]
      for first in range(0, total // width, threads):
        # this thread's unit (element, or float4) of the tile in this round; the last round wraps (loads into
        # registers, see halo_tiles.WRAP_LAST_ROUND) or is guarded
        unit, condition = last_round_unit(thread + first, total // width, first, threads, wrap and not copy)
        guard = None if condition is None else build.add(UOps.IF, None, (self.node_to_uop(condition),))
        element = unit * width
        idxs = list(axis_idxs) + [NumNode(0)] * (kernel.shape_len - len(axis_idxs))
        # the block's thread axes the load does not vary along take 0, not this thread's index: a padded view (PADTO)
        # masks a broadcast operand along them too, and the tile element serves every thread of the block
        for axis in range(kernel.global_dims, kernel.first_loop_reduce):
          if axis not in axes: idxs[axis] = NumNode(0)
        inner = 1
        for axis, size in reversed(list(zip(fill_axes, sizes))):
          idxs[axis] = (element // inner) % size
          inner *= size
        lane_idxs = []
        for lane in range(width):
          lane_idxs.append(list(idxs))
          lane_idxs[-1][fill_axes[-1]] = idxs[fill_axes[-1]] + lane
        index_node, _ = self._index_nodes(self.leaf_index[node_id], idxs)
        offset = offsets.get(id(local), NumNode(0))
        first_address = offset + self._tile_address(axes, idxs)
        whole = tile_vector and multiple_of(index_node, width) and multiple_of(first_address, width)
        if copy:
          self._copy_tile_unit(node, local, axes, offset, lane_idxs if not whole else [idxs], width if whole else 1)
          if guard is not None: build.end_if(guard)
          continue
        if width > 1 and multiple_of(index_node, width):
          vector = build.add(UOps.LOAD, node.dtype, (self.buffers[node.arg.idx], self.node_to_uop(index_node)), width)
          values = [build.add(UOps.GEP, node.dtype, (vector,), lane) for lane in range(width)]
        else:   # not provably aligned: the unit's elements one by one
          values = [self._global_load(node, lane_idx, ()) for lane_idx in lane_idxs]
        if whole and kernel.tile_flags & SHARED_VECTOR_FILL:   # one vector store of the unit's neighbours
          units = [(first_address, tuple(values))]
        else: units = [(offset + self._tile_address(axes, lane_idx), (value,))
                       for lane_idx, value in zip(lane_idxs, values)]
        for address, unit_values in units:
          if defer: deferred.append((local, address, unit_values))
          else: self._store_tile(local, address, unit_values)
        if guard is not None: build.end_if(guard)
    if defer or copy: return deferred
    build.add(UOps.BARRIER, None)
    self.tiles = tiles
    return []

  def _store_tile(self, local: UOp, address: Node, values: tuple[UOp, ...]) -> None:
    """One STORE into a tile: a value, or a vector of neighbouring elements (address a multiple of their count)."""
    srcs = (local, self.node_to_uop(address), *values)
    self.builder.add(UOps.STORE, None, srcs, len(values) if len(values) > 1 else None)

  def _copy_tile_unit(self, node: LazyOp, local: UOp, axes: list[int], offset: Node, lane_idxs: list[list[Node]],
                      width: int) -> None:
    """Asynchronous COPYs of a fill unit into its tile: one of `width` neighbouring elements from each of
    `lane_idxs` (the unit's first element: a whole 16-byte vector; else every element, 4 bytes each)."""
    for idxs in lane_idxs:
      index, valid = self._index(self.leaf_index[id(node)], idxs)
      address = self.node_to_uop(offset + self._tile_address(axes, idxs))
      srcs = (local, address, self.buffers[node.arg.idx], index) + ((valid,) if valid is not None else ())
      self.builder.add(UOps.COPY, None, srcs, (width, True))

  def _async_tile_stages(self) -> int:
    """Stages of SHARED tiles filled by asynchronous copies (Kernel.async_tile_stages) where the kernel stages tiles
    along one reduce loop of at least that many steps and the renderer copies asynchronously; else 0 (the tiles are
    filled as _tiles_double_buffered says)."""
    kernel = self.kernel
    stages = kernel.async_tile_stages
    if not stages or not kernel.staged_loads() or kernel.first_upcast - kernel.first_loop_reduce != 1: return 0
    if not getattr(kernel.renderer, "has_async_copy", False): return 0
    # a halo tile (codegen/halo_tiles.py) is copied element by element, zero-filled outside the buffer
    return stages if kernel.full_shape[kernel.first_loop_reduce] >= stages else 0

  def _copy_first_tile_steps(self, tiles: dict[int, tuple[UOp, list[int]]], axis_idxs: list[Node],
                             stages: int) -> None:
    """Before the reduce loop: the first stages - 1 steps' tiles copied into stages 0.., one commit group each (the
    copies of one step; the ASYNC_WAIT before the next step's copies commits them and waits for none)."""
    kernel = self.kernel
    for first_step in range(stages - 1):
      if first_step: self.builder.add(UOps.ASYNC_WAIT, None, (), stages)
      step_idxs = list(axis_idxs)
      step_idxs[kernel.first_loop_reduce] = NumNode(first_step)
      sizes = {id(local): local.arg[1] // stages for local, _ in tiles.values()}
      self._stage_shared_tiles(tiles, step_idxs, {key: NumNode(first_step * size) for key, size in sizes.items()},
                               copy=True)

  def _copy_next_tile_step(self, tiles: dict[int, tuple[UOp, list[int]]], axis_idxs: list[Node], stages: int) -> None:
    """In reduce step r: wait for step r's copies (the newer stages - 2 groups may still be on their way), a BARRIER
    (every thread's copies landed, and every thread done with step r - 1's stage), then copy step r + stages - 1
    into that stage (none past the last step: an empty group keeps the waits' count) and read step r's stage."""
    kernel, build = self.kernel, self.builder
    step, steps = axis_idxs[kernel.first_loop_reduce], kernel.full_shape[kernel.first_loop_reduce]
    sizes = {id(local): local.arg[1] // stages for local, _ in tiles.values()}
    build.add(UOps.ASYNC_WAIT, None, (), stages - 2)
    build.add(UOps.BARRIER, None)
    prefetch = build.add(UOps.IF, None, (self.node_to_uop(step < steps - (stages - 1)),))
    next_idxs = list(axis_idxs)
    next_idxs[kernel.first_loop_reduce] = step + (stages - 1)
    self._stage_shared_tiles(tiles, next_idxs, {key: (step + (stages - 1)) % stages * size
                                                for key, size in sizes.items()}, copy=True)
    build.end_if(prefetch)
    self.tile_offsets = {key: step % stages * size for key, size in sizes.items()}
    self.tiles = tiles

  def _tile_load(self, node: LazyOp, local: UOp, axes: list[int], idxs: list[Node]) -> UOp:
    """One element of a staged tile: from a float4 of the tile where its innermost axis is an UPCAST/UNROLL axis of
    whole vectors and the first element's address is a multiple of 4, else a scalar read. The lanes of one vector
    share its LOAD (local loads are not merged by the builder: they are remembered here, for this reduce step)."""
    if id(local) in self.tile_windows: return self._halo_tile_load(node, local, idxs)
    width, innermost = getattr(self.kernel.renderer, "vector_width", 0), axes[-1]
    if width >= 2 and node.dtype == dtypes.float32 and isinstance(idxs[innermost], NumNode) and \
        innermost >= self.kernel.first_upcast and self.kernel.full_shape[innermost] % width == 0:
      lane = idxs[innermost].b % width
      first = list(idxs)
      first[innermost] = NumNode(idxs[innermost].b - lane)
      address = self.tile_offsets.get(id(local), NumNode(0)) + self._tile_address(axes, first)
      if multiple_of(address, width):
        key = (id(local), address.render())
        if key not in self.tile_vectors:
          self.tile_vectors[key] = self.builder.add(UOps.LOAD, node.dtype, (local, self.node_to_uop(address)), width)
        return self.builder.add(UOps.GEP, node.dtype, (self.tile_vectors[key],), lane)
    address = self.tile_offsets.get(id(local), NumNode(0)) + self._tile_address(axes, idxs)
    # one read per element and step: the lanes that reuse it (a fused operand's ReLU, computed once) share it
    key = (id(local), address.render(), 1)
    if key not in self.tile_vectors:
      self.tile_vectors[key] = self.builder.add(UOps.LOAD, node.dtype, (local, self.node_to_uop(address)))
    return self.tile_vectors[key]

  def _halo_tile_load(self, node: LazyOp, local: UOp, idxs: list[Node]) -> UOp:
    """One lane's element of a halo tile: from a float4 of the tile where the address is a multiple of 4 plus a
    constant (the float4 holding it, shared by the lanes that read it), else a scalar read; zero where the load's
    mask says the lane reads padding."""
    kernel, build, window = self.kernel, self.builder, self.tile_windows[id(local)]
    address = self.tile_offsets.get(id(local), NumNode(0)) + outer_row(kernel, window, idxs) * window.span + \
        window_offset(window, idxs)
    width = getattr(kernel.renderer, "vector_width", 0)
    rest, constant = split_constant(address)
    if width >= 2 and node.dtype == dtypes.float32 and multiple_of(rest, width):
      start = rest + (constant - constant % width)
      key = (id(local), start.render())
      if key not in self.tile_vectors:
        self.tile_vectors[key] = build.add(UOps.LOAD, node.dtype, (local, self.node_to_uop(start)), width)
      value = build.add(UOps.GEP, node.dtype, (self.tile_vectors[key],), constant % width)
    else:
      key = (id(local), address.render(), 1)
      if key not in self.tile_vectors:
        self.tile_vectors[key] = build.add(UOps.LOAD, node.dtype, (local, self.node_to_uop(address)))
      value = self.tile_vectors[key]
    valid = self._halo_valid(self.leaf_index[id(node)], idxs)
    if isinstance(valid, NumNode) and valid.b: return value
    zero = build.const(zero_of(node.dtype), node.dtype)
    if isinstance(valid, NumNode): return zero
    return build.alu(Ops.WHERE, node.dtype, self.node_to_uop(valid), value, zero)

  def _tile_load_width(self, node: LazyOp, axes: list[int]) -> int:
    """4 (float4 loads into the tile) where the renderer has them, the load is float32 through one unmasked view
    contiguous along the tile's innermost axis and that axis splits into whole vectors; else 1."""
    kernel, width = self.kernel, getattr(self.kernel.renderer, "vector_width", 0)
    st = kernel.sts[self.leaf_index[id(node)]]
    if width < 2 or node.dtype != dtypes.float32 or len(st.views) != 1 or st.views[0].mask is not None: return 1
    if st.real_strides()[axes[-1]] != 1 or kernel.full_shape[axes[-1]] % width != 0: return 1
    return width


def multiple_of(node: Node, divisor: int) -> bool:
  """Whether an index expression is a multiple of `divisor` for every value of its variables (provably)."""
  if isinstance(node, NumNode): return node.b % divisor == 0
  if isinstance(node, MulNode):
    return (isinstance(node.b, int) and node.b % divisor == 0) or multiple_of(node.a, divisor)
  if isinstance(node, SumNode): return all(multiple_of(term, divisor) for term in node.nodes)
  return False


def zero_of(dtype: DType) -> float | int | bool:
  """The zero of a dtype (False for bool)."""
  return False if dtype == dtypes.bool else (0.0 if dtype.is_float else 0)
