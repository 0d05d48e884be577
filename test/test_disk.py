"""The DISK device (ourgrad/runtime/ops_disk.py): tensors that are windows of a memory-mapped file.

Covers naming (`DISK:path`), reading tensors of several dtypes at byte offsets, copies of whole tensors, of
contiguous slices (only their bytes are read: checked by recording the windows copied out of the mapping and by
GlobalCounters.global_mem on a 64 MB sparse file) and of non-contiguous views, writing to DISK, the errors (kernels
on DISK, missing or short files), and safetensors loading on top of it (`safe_load` gives lazy DISK tensors).
"""
from __future__ import annotations

import gc
import os
import pathlib

import numpy as np
import pytest

from ourgrad import Tensor, dtypes
from ourgrad.device import Device
from ourgrad.dtype import DType
from ourgrad.errors import DeviceError
from ourgrad.helpers import GlobalCounters
from ourgrad.nn.state import disk_tensor, get_state_dict, load_state_dict, safe_load, safe_save
from ourgrad.runtime.ops_disk import DiskAllocator, DiskDevice, DiskWindow

HOST = "CLANG"


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
  """(byte offset, byte count) of every window copied out of a DISK mapping by the engine, in order."""
  recorded: list[tuple[int, int]] = []
  real = DiskAllocator.as_memoryview

  def recording(self: DiskAllocator, handle: DiskWindow) -> memoryview:
    recorded.append((handle.offset, handle.nbytes))
    return real(self, handle)
  monkeypatch.setattr(DiskAllocator, "as_memoryview", recording)
  return recorded


# ---------------------------------------------------------------- naming

def test_device_names(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.chdir(tmp_path)
  assert Device.canonicalize("disk:weights.bin") == f"DISK:{tmp_path / 'weights.bin'}"
  assert Device.canonicalize(f"DISK:{tmp_path}/./weights.bin") == f"DISK:{tmp_path / 'weights.bin'}"
  assert Device.canonicalize("CPU:0") == "CLANG"  # other devices still drop their argument
  device = Device["disk:weights.bin"]
  assert isinstance(device, DiskDevice) and device is Device[f"DISK:{tmp_path / 'weights.bin'}"]  # one per file
  with pytest.raises(DeviceError, match="DISK:/path/to/file"): Device["DISK"]


# ---------------------------------------------------------------- reading

# (dtype, values): each stored at an offset of its own in one file, some of them unaligned
SAMPLES: list[tuple[DType, np.ndarray]] = [
  (dtypes.float32, np.arange(24, dtype=np.float32).reshape(4, 6) / 3),
  (dtypes.int16, np.array([[-32768, 5, 32767], [1, -2, 3]], dtype=np.int16)),
  (dtypes.float64, np.array([np.pi, -np.e, 1e300], dtype=np.float64)),
  (dtypes.uint8, np.arange(250, 255, dtype=np.uint8)),
  (dtypes.bool, np.array([True, False, True], dtype=np.bool_)),
  (dtypes.int64, np.array(-(2 ** 62), dtype=np.int64)),  # 0-d
  (dtypes.float16, np.array([0.5, -65504.0], dtype=np.float16)),
]


def _write_samples(path: pathlib.Path) -> list[tuple[DType, np.ndarray, int]]:
  """Write SAMPLES after 3 junk bytes (so offsets are odd too); returns (dtype, values, byte offset)."""
  placed, chunks, offset = [], [b"xyz"], 3
  for dt, values in SAMPLES:
    placed.append((dt, values, offset))
    chunks.append(values.tobytes())
    offset += values.nbytes
  path.write_bytes(b"".join(chunks) + b"tail")
  return placed


def test_dtypes_at_offsets(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "mixed.bin"
  for dt, values, offset in _write_samples(path):
    tensor = disk_tensor(path, dt, values.shape, offset)
    assert tensor.device == f"DISK:{path}" and tensor.dtype == dt and tensor.shape == values.shape
    np.testing.assert_array_equal(tensor.numpy(), values)  # straight out of the mapping
    on_host = tensor.to(HOST)
    assert on_host.device == HOST
    np.testing.assert_array_equal(on_host.numpy(), values)


def test_bfloat16(tmp_path: pathlib.Path) -> None:
  bits = np.array([0x3F80, 0xC000, 0x7F80, 0x0000], dtype=np.uint16)  # 1, -2, inf, 0
  path = tmp_path / "bf16.bin"
  path.write_bytes(b"\0\0" + bits.tobytes())
  tensor = disk_tensor(path, dtypes.bfloat16, (4,), 2)
  np.testing.assert_array_equal(tensor.to(HOST).numpy(), [1.0, -2.0, np.inf, 0.0])


def test_empty_tensor_on_disk_and_compute_after_copy(tmp_path: pathlib.Path) -> None:
  values = np.random.default_rng(0).standard_normal((8, 5)).astype(np.float32)
  path = tmp_path / "w.bin"
  values.tofile(path)
  weights = Tensor.empty(8, 5, dtype=dtypes.float32, device=f"DISK:{path}")
  np.testing.assert_allclose((weights.to(HOST) * 2).sum(axis=1).numpy(), (values * 2).sum(axis=1), rtol=1e-6)
  assert disk_tensor(path, dtypes.float32, (0, 5), offset=values.nbytes).to(HOST).numpy().shape == (0, 5)


def test_contiguous_views_copy_their_bytes_only(tmp_path: pathlib.Path, reads: list[tuple[int, int]]) -> None:
  values = np.arange(60, dtype=np.int32).reshape(10, 6)
  path = tmp_path / "grid.bin"
  path.write_bytes(b"\0" * 16 + values.tobytes())
  grid = disk_tensor(path, dtypes.int32, (10, 6), offset=16)
  cases = [
    (grid[2:5], values[2:5], (16 + 2 * 24, 3 * 24)),                       # a shrink of the first axis
    (grid[7], values[7], (16 + 7 * 24, 24)),                               # one row
    (grid.reshape(60)[7:19], values.reshape(60)[7:19], (16 + 7 * 4, 48)),  # any run of the flat file
    (grid.reshape(5, 12)[1:3].reshape(4, 6), values[2:6], (16 + 48, 96)),  # reshapes around it
    (grid, values, (16, 240)),                                             # the whole tensor
  ]
  for view, expected, window in cases:
    reads.clear()
    np.testing.assert_array_equal(view.to(HOST).numpy(), expected)
    assert reads == [window]


def test_non_contiguous_views(tmp_path: pathlib.Path, reads: list[tuple[int, int]]) -> None:
  values = np.arange(60, dtype=np.float32).reshape(10, 6)
  path = tmp_path / "grid.bin"
  values.tofile(path)
  grid = disk_tensor(path, dtypes.float32, (10, 6))
  cases = [
    (grid.T, values.T),
    (grid[2:5, 1:4], values[2:5, 1:4]),
    (grid[::-1, ::2], values[::-1, ::2]),
    (grid[1:3].flip(1), values[1:3, ::-1]),
    (grid.pad(((1, 0), (0, 2))), np.pad(values, ((1, 0), (0, 2)))),
    (grid[4:5].expand(3, 6), np.broadcast_to(values[4:5], (3, 6))),
    (grid.reshape(2, 5, 6).permute(2, 0, 1)[:, 1, 1:3], values.reshape(2, 5, 6).transpose(2, 0, 1)[:, 1, 1:3]),
  ]
  for view, expected in cases:
    reads.clear()
    np.testing.assert_array_equal(view.to(HOST).numpy(), expected)
    assert len(reads) == 1
  # a box of the grid copies the run of the file that covers it: rows 2..4, from column 1 of row 2 to column 3 of
  # row 4, not the whole file
  reads.clear()
  grid[2:5, 1:4].to(HOST).realize()
  assert reads == [((2 * 6 + 1) * 4, (2 * 6 + 3) * 4)]
  # every element padding: nothing to read
  reads.clear()
  np.testing.assert_array_equal(grid.pad(((0, 2), (0, 0)))[10:].to(HOST).numpy(), np.zeros((2, 6)))
  assert reads == []


def test_slice_of_large_sparse_file_reads_only_the_slice(tmp_path: pathlib.Path,
                                                         reads: list[tuple[int, int]]) -> None:
  path = tmp_path / "big.bin"
  size = 64 * 1024 * 1024
  marker = np.arange(1024, dtype=np.float32) + 0.5
  with open(path, "wb") as file:  # sparse: the 64 MB are holes except for the marker
    file.truncate(size)
    file.seek(40 * 1024 * 1024)
    file.write(marker.tobytes())
  big = Tensor.empty(size // 4, dtype=dtypes.float32, device=f"DISK:{path}")
  first = 40 * 1024 * 1024 // 4
  GlobalCounters.reset()
  np.testing.assert_array_equal(big[first:first + 1024].to(HOST).numpy(), marker)
  assert reads == [(40 * 1024 * 1024, 4096)]
  assert GlobalCounters.global_mem == 2 * 4096  # read once from the mapping, written once into the host buffer
  # a 2-D box of it: the covering run, a little over one row of the 4096-wide grid
  reads.clear()
  box = big.reshape(4096, 4096)[2560:2562, 0:8].to(HOST).numpy()
  np.testing.assert_array_equal(box[0], marker[:8])
  assert reads == [(2560 * 4096 * 4, (4096 + 8) * 4)]


# ---------------------------------------------------------------- writing

def test_copy_to_disk_writes_the_file(tmp_path: pathlib.Path) -> None:
  values = np.arange(12, dtype=np.int32).reshape(3, 4)
  path = tmp_path / "out.bin"
  on_disk = Tensor(values, device=HOST).to(f"DISK:{path}")
  # written and read back in one schedule: the slice's copy runs after the write
  np.testing.assert_array_equal(on_disk[1:].to(HOST).numpy(), values[1:])
  assert path.read_bytes() == values.tobytes()
  assert os.path.getsize(path) == values.nbytes
  np.testing.assert_array_equal(disk_tensor(path, dtypes.int32, (3, 4)).numpy(), values)


# ---------------------------------------------------------------- errors

def test_kernels_on_disk_raise(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "k.bin"
  np.ones(6, np.float32).tofile(path)
  weights = disk_tensor(path, dtypes.float32, (2, 3))
  with pytest.raises(DeviceError, match=r"DISK tensors can only be copied to another device: use \.to\('CLANG'\)"):
    (weights + 1).realize()
  with pytest.raises(DeviceError, match="only be copied"):
    weights.sum().numpy()
  with pytest.raises(DeviceError, match="only be copied"):
    weights.T.contiguous().realize()
  with pytest.raises(DeviceError, match="only be copied.*MUL"):  # computing, then copying: raises at the .to()
    (weights * 2).to(HOST)
  np.testing.assert_array_equal((weights.to(HOST) + 1).numpy(), np.full((2, 3), 2, np.float32))  # the fix


def test_missing_and_short_files(tmp_path: pathlib.Path) -> None:
  with pytest.raises(DeviceError, match="cannot open the file"):
    disk_tensor(tmp_path / "missing.bin", dtypes.float32, (2,))
  path = tmp_path / "short.bin"
  path.write_bytes(b"\0" * 10)
  with pytest.raises(DeviceError, match="the file has 10 bytes, but a tensor needs bytes up to 12"):
    disk_tensor(path, dtypes.float32, (3,))
  with pytest.raises(DeviceError, match="needs bytes up to 14"):
    disk_tensor(path, dtypes.float32, (1,), offset=10)
  with pytest.raises(DeviceError, match="has 10 bytes"):  # Tensor.empty maps on first read
    Tensor.empty(4, dtype=dtypes.float32, device=f"DISK:{path}").numpy()


# ---------------------------------------------------------------- safetensors

def test_safe_load_gives_lazy_disk_tensors(tmp_path: pathlib.Path, reads: list[tuple[int, int]]) -> None:
  arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.array([1, -1], dtype=np.int64),
            "h": np.array([0.25, 8], dtype=np.float16), "m": np.array([True, False])}
  path = tmp_path / "model.safetensors"
  safe_save({name: Tensor(values) for name, values in arrays.items()}, path)
  loaded = safe_load(path)
  assert reads == []  # nothing read yet (the small bool mask is checked through numpy(), not the engine)
  for name, values in arrays.items():
    assert loaded[name].device == f"DISK:{path}"
    np.testing.assert_array_equal(loaded[name].numpy(), values)
    np.testing.assert_array_equal(loaded[name].to(HOST).numpy(), values)
  reads.clear()
  np.testing.assert_array_equal(loaded["w"][1:].to(HOST).numpy(), arrays["w"][1:])
  assert len(reads) == 1 and reads[0][1] == 2 * 4 * 4
  on_host = safe_load(path, device=HOST)
  assert all(tensor.device == HOST for tensor in on_host.values())
  for name, values in arrays.items(): np.testing.assert_array_equal(on_host[name].numpy(), values)


def test_load_state_dict_from_disk(tmp_path: pathlib.Path) -> None:
  class Layer:
    def __init__(self, weight: np.ndarray):
      self.weight, self.bias = Tensor(weight, device=HOST), Tensor.zeros(weight.shape[0], device=HOST)
  source = Layer(np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32))
  source.bias = Tensor(np.arange(4, dtype=np.float32), device=HOST)
  path = tmp_path / "layer.safetensors"
  safe_save(get_state_dict(source), path)
  target = Layer(np.zeros((4, 3), np.float32))
  load_state_dict(target, safe_load(path))
  assert target.weight.device == HOST
  np.testing.assert_array_equal(target.weight.numpy(), source.weight.numpy())
  np.testing.assert_array_equal(target.bias.numpy(), np.arange(4, dtype=np.float32))


def test_replaced_file_keeps_old_windows(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "ckpt.safetensors"
  safe_save({"w": Tensor(np.zeros(4, np.float32))}, path)
  old = safe_load(path)["w"]
  safe_save({"w": Tensor(np.ones(8, np.float32))}, path)  # renamed over the old file
  new = safe_load(path)["w"]
  np.testing.assert_array_equal(old.to(HOST).numpy(), np.zeros(4))  # the file as it was loaded
  np.testing.assert_array_equal(new.to(HOST).numpy(), np.ones(8))


def test_mapping_is_released_with_its_tensors(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "once.bin"
  np.ones(4, np.float32).tofile(path)
  tensor = disk_tensor(path, dtypes.float32, (4,))
  device = Device[f"DISK:{path}"]
  assert isinstance(device, DiskDevice) and device._current is not None and device._current() is not None
  del tensor
  gc.collect()
  assert device._current() is None  # unmapped, its file descriptor closed
