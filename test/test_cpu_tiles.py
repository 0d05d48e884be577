"""The CPU matmul register tile at both x86 SIMD widths, whatever CPU runs the test: AVX2 (-march=x86-64-v3, 16 ymm
registers) and AVX-512 (-march=x86-64-v4, 32 zmm registers). Each kernel is optimized by the default heuristic for
that width (the renderer's vector_bytes and vector_registers), compiled by gcc at that -march with the CLANG device's
flags and, where this CPU has the width, run on the inputs and compared with numpy. The tile's rows are what the
registers hold: AVX2's 8x2 tile spilled 3 accumulators to the stack in every reduce step (64 GFLOP/s at 1536^3, 6x2
88). Rows the tile does not divide are padded, and the operand that does not vary along them keeps unmasked vector
loads (codegen/opt/cpu_tiles.py, Kernel._pad_view).

Needs gcc as the CLANG device's compiler on x86-64 (skipped otherwise: the flags and assembly read here are gcc's).
"""
from __future__ import annotations

import ctypes
import os
import platform
import re
import subprocess
import tempfile

import numpy as np
import pytest

from ourgrad import Tensor
from ourgrad.codegen.kernel import Kernel, Opt, OptOps
from ourgrad.codegen.kernel_cost import bytes_moved
from ourgrad.codegen.linearizer import linearize
from ourgrad.codegen.opt.cpu_tiles import (CPU_PACK_MIN_ROWS, CPU_PACK_MIN_ROWS_GATHERED, buffer_loads,
                                          cpu_reduce_parts,
                                          cpu_tile_rows)
from ourgrad.device import Device
from ourgrad.dtype import dtypes
from ourgrad.engine.schedule import create_schedule
from ourgrad.renderer.cstyle import ClangRenderer

# -march -> (SIMD register bytes, SIMD registers, the /proc/cpuinfo flag a CPU needs to run it)
TARGETS = {"x86-64-v3": (32, 16, "avx2"), "x86-64-v4": (64, 32, "avx512f")}
# a vector register stored to the stack: a spill (AT&T syntax, as gcc -S writes it)
VECTOR_SPILL = re.compile(r"vmov\w*\s+%[yz]mm\d+,\s*-?\w*\(%[re][sb]p\)")


def _gcc() -> str:
  if platform.machine() != "x86_64": pytest.skip("the -march levels are x86-64's")
  compiler = Device["CLANG"].compiler
  if compiler.identity.family != "gcc": pytest.skip("the flags and assembly read here are gcc's")
  return compiler.compiler


def _renderer(march: str) -> ClangRenderer:
  renderer = ClangRenderer()
  renderer.vector_bytes, renderer.vector_registers, _ = TARGETS[march]
  renderer.l2_cache_bytes = 1 << 20
  return renderer


def _kernel(output: Tensor, march: str, opts: list[Opt] | None = None):
  """The schedule item of `output`'s one kernel and that kernel, optimized by the heuristic for `march` (or `opts`)."""
  items = [item for item in create_schedule([output.lazydata]) if item.outputs]
  assert len(items) == 1, f"expected one kernel, got {len(items)}"
  kernel = Kernel(items[0].ast, _renderer(march))
  if opts is None: kernel.hand_coded_optimizations()
  else:
    for opt in opts: kernel.apply_opt(opt)
  return items[0], kernel


def _source(kernel: Kernel) -> str:
  return kernel.renderer.render(kernel.name, linearize(kernel))


def _gcc_flags(source: str, march: str) -> list[str]:
  flags = Device["CLANG"].compiler.flags_for(source)
  return [flag for flag in flags if not flag.startswith("-march=")] + [f"-march={march}"]


def _assembly(source: str, march: str) -> str:
  flags = [flag for flag in _gcc_flags(source, march) if flag not in ("-shared", "-fPIC")]
  done = subprocess.run([_gcc(), *flags, "-S", "-x", "c", "-", "-o", "-"], input=source, capture_output=True,
                        text=True, check=True)
  return done.stdout


def _cpu_has(flag: str) -> bool:
  with open("/proc/cpuinfo") as info: return f" {flag}" in info.read()


def _run_compiled(source: str, name: str, march: str, buffers: list[np.ndarray]) -> None:
  """Compile `source` at -march=`march` and call kernel `name` on the numpy `buffers` (the first is written)."""
  with tempfile.TemporaryDirectory() as folder:
    library = os.path.join(folder, "kernel.so")
    subprocess.run([_gcc(), *_gcc_flags(source, march), "-x", "c", "-", "-o", library, "-lm"], input=source,
                   text=True, check=True, capture_output=True)
    function = getattr(ctypes.CDLL(library), name)
    function(*[ctypes.c_void_p(buffer.ctypes.data) for buffer in buffers])


def _matmul(m: int, k: int, n: int, dtype=dtypes.float32) -> tuple[Tensor, np.ndarray, np.ndarray]:
  rng = np.random.default_rng(0)
  a_np, b_np = (rng.standard_normal(shape).astype(np.float32) for shape in ((m, k), (k, n)))
  if dtype != dtypes.float32: a_np, b_np = (np.rint(x * 4).astype(dtype.np) for x in (a_np, b_np))
  a, b = Tensor(a_np, dtype=dtype).realize(), Tensor(b_np, dtype=dtype).realize()
  return a @ b, a_np, b_np


@pytest.mark.parametrize("march", sorted(TARGETS))
@pytest.mark.parametrize("m,k,n", [(96, 64, 48), (100, 40, 64), (61, 33, 32)])
def test_tile_rows_fill_the_registers(march: str, m: int, k: int, n: int):
  """6 rows on AVX2, 8 on AVX-512, padded where they do not divide (100 rows: 102 or 104; not 61: 8 rows would add
  over an eighth), two registers of columns (one where two do not divide); the values match numpy where this CPU
  runs the width."""
  _gcc()
  vector_bytes, registers, cpu_flag = TARGETS[march]
  output, a_np, b_np = _matmul(m, k, n)
  item, kernel = _kernel(output, march)
  rows = cpu_tile_rows(registers)
  assert rows == {16: 6, 32: 8}[registers]
  padded = m % rows != 0 and -m % rows <= m / 8
  if m % rows == 0 or padded:
    lanes = vector_bytes // 4
    columns = 2 * lanes if n % (2 * lanes) == 0 else lanes   # one register of columns where two do not divide
    assert [kernel.full_shape[axis] for axis in kernel.upcast_axes] == [rows, columns]
  assert any(opt.op is OptOps.PADTO for opt in kernel.applied_opts) == padded
  source = _source(kernel)
  if not _cpu_has(cpu_flag): pytest.skip(f"this CPU cannot run -march={march} code (no {cpu_flag})")
  # the kernel's inputs in its own order: the scheduled buffers' contents (A and B, whichever comes first)
  inputs = [np.ascontiguousarray(buffer.numpy()) for buffer in item.inputs]
  result = np.zeros((m, n), np.float32)
  _run_compiled(source, kernel.name, march, [result, *inputs])
  np.testing.assert_allclose(result, a_np @ b_np, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("march", sorted(TARGETS))
def test_tile_does_not_spill(march: str):
  """No vector register of the heuristic's tile goes to the stack; AVX2's former 8x2 tile (forced) does: what the
  assembly check catches."""
  _gcc()
  output, _, _ = _matmul(96, 256, 64)
  _, kernel = _kernel(output, march)
  assert not VECTOR_SPILL.findall(_assembly(_source(kernel), march))
  if march == "x86-64-v3":
    _, forced = _kernel(_matmul(96, 256, 64)[0], march, [Opt(OptOps.UPCAST, 0, 8), Opt(OptOps.UPCAST, 1, 16)])
    assert VECTOR_SPILL.findall(_assembly(_source(forced), march)), "8x2 ymm accumulators no longer spill"


def test_padded_rows_keep_vector_loads():
  """Padding the rows masks the operand that varies along them (A's rows); B, which every row shares, keeps plain
  vector loads (a masked view would read each lane as a scalar select)."""
  _gcc()
  output, _, _ = _matmul(100, 40, 64)
  _, kernel = _kernel(output, "x86-64-v3")
  assert any(opt.op is OptOps.PADTO for opt in kernel.applied_opts)
  source = _source(kernel)
  vector_loads = [line for line in source.splitlines() if "(const float8v_u*)" in line]
  assert vector_loads and not [line for line in vector_loads if "?" in line]


def test_padded_rows_are_not_counted_as_moved_bytes():
  """Padded rows are masked (never loaded or stored): a kernel's bytes (GlobalCounters.global_mem, DEBUG=2's GB/s)
  are its buffers' own, at any width. At SSE2 width a 16-row matmul padded to 18 rows counted 448 bytes too many."""
  output, _, _ = _matmul(100, 40, 64)
  _, kernel = _kernel(output, "x86-64-v3")
  assert any(opt.op is OptOps.PADTO for opt in kernel.applied_opts)
  linearize(kernel)
  assert bytes_moved(kernel) == (100 * 40 + 40 * 64 + 100 * 64) * 4


def test_integer_matmul_is_not_padded():
  """A padded row reads 0s: an integer kernel might divide by them, so integer reduces keep rows that divide."""
  _gcc()
  output, _, _ = _matmul(100, 40, 64, dtypes.int32)
  _, kernel = _kernel(output, "x86-64-v3")
  assert not any(opt.op is OptOps.PADTO for opt in kernel.applied_opts)


@pytest.mark.parametrize("march", sorted(TARGETS))
def test_strided_columns_take_tall_tiles(march: str):
  """A.B^T (both operands contiguous along the reduce only: a convolution's gradients) builds each column vector from
  scalar loads: one register of columns shared by as many rows as the registers hold (48 rows: 12 of AVX2's 16
  registers, 16 with AVX-512, where MAX_UPCAST_LANES refuses 24). The values match numpy where this CPU runs the
  width."""
  _gcc()
  _, _, cpu_flag = TARGETS[march]
  rng = np.random.default_rng(1)
  a_np, b_np = rng.standard_normal((48, 40)).astype(np.float32), rng.standard_normal((64, 40)).astype(np.float32)
  item, kernel = _kernel(Tensor(a_np).realize() @ Tensor(b_np).realize().T, march)
  tile = [kernel.full_shape[axis] for axis in kernel.upcast_axes]
  assert tile == {"x86-64-v3": [12, 8], "x86-64-v4": [16, 16]}[march]
  assert "(float8v){" in _source(kernel) or "(float16v){" in _source(kernel), "columns no longer gathered"
  if not _cpu_has(cpu_flag): pytest.skip(f"this CPU cannot run -march={march} code (no {cpu_flag})")
  result = np.zeros((48, 64), np.float32)
  _run_compiled(_source(kernel), kernel.name, march, [result, *[buffer.numpy() for buffer in item.inputs]])
  np.testing.assert_allclose(result, a_np @ b_np.T, rtol=1e-4, atol=1e-4)


def test_tall_tile_skips_lanes_in_one_l1_set():
  """Gathered lanes a multiple of 4 KiB apart share one L1 set (the images of a batch as columns): no tall tile there,
  the 8-row tile of two registers instead (the 3x3 conv forward at AVX-512: 21 ms tall, 15 ms 8 rows)."""
  _gcc()
  rng = np.random.default_rng(2)
  a_np, b_np = rng.standard_normal((48, 1024)).astype(np.float32), rng.standard_normal((64, 1024)).astype(np.float32)
  _, kernel = _kernel(Tensor(a_np).realize() @ Tensor(b_np).realize().T, "x86-64-v4")
  assert [kernel.full_shape[axis] for axis in kernel.upcast_axes][:2] == [8, 32]


def test_reduce_parts_follow_the_page_positions():
  """Parts of a CPU matmul's reduce (1 MiB L2): rows 4 KiB apart (1024 float32) take one line position of a page,
  whose L2 lines (256) hold a panel of 512 lines at CPU_REDUCE_PANEL_SHARE 2; 6 KiB apart, two positions; a stride
  that is no multiple of 64 bytes takes every position (the whole L2's lines), and more than CPU_REDUCE_MAX_POSITIONS
  positions are not split."""
  assert cpu_reduce_parts(1024, 4096, 1 << 20) == 2
  assert cpu_reduce_parts(2048, 8192, 1 << 20) == 4
  assert cpu_reduce_parts(1536, 6144, 1 << 20) == 2
  assert cpu_reduce_parts(512, 4096, 1 << 20) == 1
  assert cpu_reduce_parts(1024, 4160, 1 << 20) == 1
  assert cpu_reduce_parts(3072, 3072, 1 << 20) == 1   # rows 3 KiB apart: 4 positions, more than a split pays for
  assert cpu_reduce_parts(1024, 4096, 0) == 1   # a renderer that does not know its L2


def _run_schedule_at(output: Tensor, march: str) -> tuple[int, np.ndarray]:
  """Every kernel of `output`'s schedule optimized for `march`, compiled and run in order on numpy buffers: the
  kernel count and the last kernel's output."""
  arrays: dict[int, np.ndarray] = {}
  items = [item for item in create_schedule([output.lazydata]) if item.outputs]
  for item in items:
    kernel = Kernel(item.ast, _renderer(march))
    kernel.hand_coded_optimizations()
    inputs = [arrays[id(buffer)] if id(buffer) in arrays else np.ascontiguousarray(buffer.numpy())
              for buffer in item.inputs]
    result = np.zeros(item.outputs[0].size, item.outputs[0].dtype.np)
    _run_compiled(_source(kernel), kernel.name, march, [result, *inputs])
    arrays[id(item.outputs[0])] = result
  return len(items), result


@pytest.mark.parametrize("march", sorted(TARGETS))
@pytest.mark.parametrize("n,parts", [(1024, 2), (1040, 1)])
def test_aliased_panel_splits_the_reduce(march: str, n: int, parts: int, monkeypatch: pytest.MonkeyPatch):
  """A matmul whose B rows are 4 KiB apart (1024 columns) runs its reduce of 1024 in 2 parts (a kernel of partial
  results, then their sum); 1040 columns stays one kernel. The values match numpy at both widths."""
  _gcc()
  _, _, cpu_flag = TARGETS[march]
  monkeypatch.setattr(Device["CLANG"].renderer, "l2_cache_bytes", 1 << 20, raising=False)
  output, a_np, b_np = _matmul(12, 1024, n)
  assert Device[output.device].renderer is Device["CLANG"].renderer
  if not _cpu_has(cpu_flag): pytest.skip(f"this CPU cannot run -march={march} code (no {cpu_flag})")
  kernels, result = _run_schedule_at(output, march)
  assert kernels == (2 if parts > 1 else 1)
  np.testing.assert_allclose(result.reshape(12, n), a_np @ b_np, rtol=1e-4, atol=1e-3)
  # the CLANG device's own path (a fresh product: the one above was scheduled by hand)
  np.testing.assert_allclose((Tensor(a_np) @ Tensor(b_np)).numpy(), a_np @ b_np, rtol=1e-4, atol=1e-3)


def _at_width(monkeypatch: pytest.MonkeyPatch, march: str) -> None:
  """The CLANG renderer that lazy.py's packing decision reads, set to `march`'s width, registers and a 1 MiB L2."""
  renderer = Device["CLANG"].renderer
  monkeypatch.setattr(renderer, "vector_bytes", TARGETS[march][0], raising=False)
  monkeypatch.setattr(renderer, "vector_registers", TARGETS[march][1], raising=False)
  monkeypatch.setattr(renderer, "l2_cache_bytes", 1 << 20, raising=False)


@pytest.mark.parametrize("march", sorted(TARGETS))
@pytest.mark.parametrize("layout", ["a@b", "a@w.T", "batched"])
def test_streamed_operand_is_packed(march: str, layout: str, monkeypatch: pytest.MonkeyPatch):
  """A matmul whose B rows lie 4 KiB apart (1024 columns) or whose B is read transposed (x @ w.T) reads B from a
  packed copy (a kernel of its own: B's column tiles of T = the tile's columns one after another, each (K, T) panel
  contiguous), so the matmul kernel loads one contiguous run of T floats a reduce step (stride T along the reduce, 1
  along the tile's columns) with the register tile rows x T. Rows that span a batch axis count as rows. The values
  match numpy."""
  _gcc()
  _at_width(monkeypatch, march)
  _, registers, cpu_flag = TARGETS[march]
  tile = {"x86-64-v3": 16, "x86-64-v4": 32}[march]
  rng = np.random.default_rng(1)
  k, n = 96, 1024
  a_np = rng.standard_normal((2, 300, k) if layout == "batched" else (600, k)).astype(np.float32)
  b_np = rng.standard_normal((k, n)).astype(np.float32)
  a, b, w = (Tensor(array).realize() for array in (a_np, b_np, np.ascontiguousarray(b_np.T)))
  def product() -> Tensor: return a @ w.T if layout == "a@w.T" else a @ b
  items = [item for item in create_schedule([product().lazydata]) if item.outputs]
  assert len(items) == 2 and items[0].outputs[0].size == k * n   # the packed copy, then the matmul
  kernel = Kernel(items[1].ast, _renderer(march))
  kernel.hand_coded_optimizations()
  assert [kernel.full_shape[axis] for axis in kernel.upcast_axes] == [cpu_tile_rows(registers), tile]
  strides = [st.real_strides() for st in buffer_loads(kernel)]
  assert any(stride[kernel.first_reduce] == tile and stride[kernel.upcast_axes[1]] == 1 for stride in strides)
  if not _cpu_has(cpu_flag): pytest.skip(f"this CPU cannot run -march={march} code (no {cpu_flag})")
  _, result = _run_schedule_at(product(), march)
  np.testing.assert_allclose(result.reshape(a_np.shape[:-1] + (n,)), a_np @ b_np, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("march", sorted(TARGETS))
@pytest.mark.parametrize("m,n,transposed", [(CPU_PACK_MIN_ROWS - 8, 1024, False), (1024, 1056, False),
                                            (CPU_PACK_MIN_ROWS_GATHERED - 8, 1024, True)])
def test_unpacked_matmuls(march: str, m: int, n: int, transposed: bool, monkeypatch: pytest.MonkeyPatch):
  """One kernel reads B in place where the copy would not pay for itself: aliased rows under CPU_PACK_MIN_ROWS rows,
  rows 4224 bytes apart (no aliasing; the tile's columns divide 1056 at both widths), a transposed B under
  CPU_PACK_MIN_ROWS_GATHERED rows."""
  _at_width(monkeypatch, march)
  rng = np.random.default_rng(2)
  a = Tensor(rng.standard_normal((m, 64)).astype(np.float32)).realize()
  b_np = rng.standard_normal((64, n)).astype(np.float32)
  b = Tensor(np.ascontiguousarray(b_np.T)).realize().T if transposed else Tensor(b_np).realize()
  assert len([item for item in create_schedule([(a @ b).lazydata]) if item.outputs]) == 1


@pytest.mark.parametrize("march", sorted(TARGETS))
def test_packed_panels_are_cache_blocked(march: str, monkeypatch: pytest.MonkeyPatch):
  """The packed column tiles' panels (1024 x T floats each) overflow a 1 MiB L2 together: the tiles go in blocks
  whose panels fill half of it, the block loop outermost (BLOCK on the column-tiles axis)."""
  _at_width(monkeypatch, march)
  output, _, _ = _matmul(512, 1024, 1024)
  items = [item for item in create_schedule([output.lazydata]) if item.outputs]
  kernel = Kernel(items[-1].ast, _renderer(march))
  kernel.hand_coded_optimizations()
  tile = {"x86-64-v3": 16, "x86-64-v4": 32}[march]
  blocks = [opt for opt in kernel.applied_opts if opt.op is OptOps.BLOCK]
  assert len(blocks) == 1 and blocks[0].amount == (1 << 19) // (1024 * tile * 4)
  assert kernel.full_shape[0] == 1024 // tile // blocks[0].amount
