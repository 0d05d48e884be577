"""ourgrad.nn.state: state dicts of object trees, safetensors save/load (round trips, interop with the safetensors
package, validation of corrupt files, atomic saves) and loading torch.save checkpoints without torch."""
from __future__ import annotations

import collections
import json
import os
import pathlib
import pickle
import zipfile
from typing import Any

import numpy as np
import pytest
import torch

from ourgrad import Tensor, dtypes
from ourgrad.device import Device
from ourgrad.dtype import DType
from ourgrad.nn.state import (CheckpointError, StateDictError, get_parameters, get_state_dict, load_state_dict,
                              safe_load, safe_load_metadata, safe_save, torch_load)

safetensors_numpy = pytest.importorskip("safetensors.numpy")
safetensors_torch = pytest.importorskip("safetensors.torch")


# ---------------------------------------------------------------- helpers

def _sample(dt: DType, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
  """Values exactly representable in `dt`, with the edge cases of its kind (nan/inf, extremes)."""
  rng = np.random.default_rng(seed)
  n = int(np.prod(shape))
  if dt.is_bool: return rng.integers(0, 2, n).astype(np.bool_).reshape(shape)
  if dt.is_int:
    info = np.iinfo(dt.np)
    values = rng.integers(info.min, info.max, n, dtype=dt.np, endpoint=True)
    values[:2] = [info.min, info.max][:min(2, n)]
    return values.reshape(shape)
  values = rng.standard_normal(n).astype(np.float32 if dt == dtypes.bfloat16 else dt.np)
  values[:4] = [np.nan, np.inf, -np.inf, -0.0][:min(4, n)]
  if dt == dtypes.bfloat16:  # keep only the top 16 bits, so the float32 values are exact bfloat16 values
    values = (values.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
  return values.reshape(shape)


def _make(array: np.ndarray, dt: DType) -> Tensor:
  return Tensor.empty(*array.shape, dtype=dt) if array.size == 0 else Tensor(array, dtype=dt)


def _assert_same(got: Tensor, expected: np.ndarray, dt: DType) -> None:
  """Same dtype, shape and bits (nan compared as nan, -0.0 distinguished)."""
  assert got.dtype == dt and got.shape == expected.shape
  values = got.numpy()
  assert values.shape == expected.shape
  if dt.is_float:
    np.testing.assert_array_equal(values, expected.astype(values.dtype))
    assert np.array_equal(np.signbit(values), np.signbit(expected))
  else:
    np.testing.assert_array_equal(values, expected)


def _write_safetensors(path: pathlib.Path, header: Any, data: bytes, raw_header: bytes | None = None) -> None:
  """Write a hand-made safetensors file (for corruption tests)."""
  header_bytes = raw_header if raw_header is not None else json.dumps(header).encode()
  path.write_bytes(len(header_bytes).to_bytes(8, "little") + header_bytes + data)


def _raises_naming_file(path: pathlib.Path, match: str) -> Any:
  """pytest.raises(CheckpointError) that also checks the message names the file."""
  class _Checker:
    def __enter__(self) -> None:
      self.context = pytest.raises(CheckpointError, match=match)
      self.info = self.context.__enter__()

    def __exit__(self, *exc: Any) -> bool:
      handled = self.context.__exit__(*exc)
      assert str(path) in str(self.info.value), f"message does not name the file: {self.info.value}"
      return handled
  return _Checker()


ALL_SHAPES = [(2, 3), (), (0, 4), (5,)]


# ---------------------------------------------------------------- safetensors round trips

def test_round_trip_every_dtype(tmp_path: pathlib.Path) -> None:
  arrays = {f"{dt.name}.{i}": (_sample(dt, shape, seed=i), dt) for dt in dtypes.all()
            for i, shape in enumerate(ALL_SHAPES)}
  path = tmp_path / "all.safetensors"
  safe_save({name: _make(array, dt) for name, (array, dt) in arrays.items()}, path)
  loaded = safe_load(path)
  assert set(loaded) == set(arrays)
  for name, (array, dt) in arrays.items(): _assert_same(loaded[name], array, dt)
  assert safe_load_metadata(path) == {}


def test_bfloat16_bits_exact(tmp_path: pathlib.Path) -> None:
  bits = np.array([0x0000, 0x8000, 0x3F80, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0xFFFF], dtype=np.uint16)
  path = tmp_path / "bf16.safetensors"
  # a bfloat16 tensor written by the safetensors package, read back by us bit for bit, then written again
  safetensors_torch.save_file({"x": torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)}, str(path))
  x = safe_load(path)["x"]
  assert x.dtype == dtypes.bfloat16
  np.testing.assert_array_equal(x.numpy().view(np.uint32) >> 16, bits)
  safe_save({"x": x}, tmp_path / "again.safetensors")
  assert (tmp_path / "again.safetensors").read_bytes() == path.read_bytes()


def test_interop_ours_to_safetensors(tmp_path: pathlib.Path) -> None:
  arrays = {dt.name: _sample(dt, (3, 2)) for dt in dtypes.all()}
  arrays["empty"], arrays["scalar"] = np.zeros((0, 2), np.float32), np.array(7, np.int64)
  path = tmp_path / "ours.safetensors"
  safe_save({name: _make(a, dtypes.bfloat16 if name == "bfloat16" else dtypes.from_numpy(a.dtype))
             for name, a in arrays.items()}, path, metadata={"format": "pt", "step": "12"})
  theirs = safetensors_torch.load_file(str(path))
  for name, array in arrays.items():
    expected = torch.from_numpy(array).to(torch.bfloat16) if name == "bfloat16" else torch.from_numpy(array)
    assert theirs[name].dtype == expected.dtype and theirs[name].shape == expected.shape
    values = theirs[name].float().numpy() if name == "bfloat16" else theirs[name].numpy()
    np.testing.assert_array_equal(values, array)  # nan equals nan here
    if values.dtype.kind == "f": assert np.array_equal(np.signbit(values), np.signbit(array))
  from safetensors import safe_open
  with safe_open(str(path), framework="np") as f:  # numpy has no bfloat16: read the others one by one
    assert f.metadata() == {"format": "pt", "step": "12"}
    for name in arrays:
      if name != "bfloat16": np.testing.assert_array_equal(f.get_tensor(name), arrays[name])


def test_interop_safetensors_to_ours(tmp_path: pathlib.Path) -> None:
  arrays = {dt.name: _sample(dt, (4, 3)) for dt in dtypes.all() if dt != dtypes.bfloat16}
  arrays["scalar"], arrays["empty"] = np.array(2.5, np.float64), np.zeros((3, 0), np.int16)
  path = tmp_path / "theirs.safetensors"
  safetensors_numpy.save_file(arrays, str(path), metadata={"name": "test"})
  loaded = safe_load(path)
  for name, array in arrays.items(): _assert_same(loaded[name], array, dtypes.from_numpy(array.dtype))
  assert safe_load_metadata(path) == {"name": "test"}


def test_save_order_and_alignment(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "aligned.safetensors"
  safe_save({"b": Tensor(np.ones(3, np.uint8)), "f": Tensor(np.ones(3, np.float64)),
             "h": Tensor(np.ones(1, np.float16))}, path)
  raw = path.read_bytes()
  header_size = int.from_bytes(raw[:8], "little")
  assert header_size % 8 == 0
  header = json.loads(raw[8:8 + header_size])
  itemsizes = {"F64": 8, "F16": 2, "U8": 1}
  for entry in header.values(): assert entry["data_offsets"][0] % itemsizes[entry["dtype"]] == 0
  assert list(safe_load(path)) == ["f", "h", "b"]  # widest dtype first


def test_save_rejects_bad_input(tmp_path: pathlib.Path) -> None:
  with pytest.raises(CheckpointError, match="not a Tensor"): safe_save({"x": np.ones(3)}, tmp_path / "a")  # type: ignore
  with pytest.raises(CheckpointError, match="metadata"):
    safe_save({"x": Tensor([1.0])}, tmp_path / "a", metadata={"k": 1})  # type: ignore[dict-item]
  with pytest.raises(CheckpointError, match="reserved"): safe_save({"__metadata__": Tensor([1.0])}, tmp_path / "a")
  assert not (tmp_path / "a").exists()


def test_save_of_views_and_computed_tensors(tmp_path: pathlib.Path) -> None:
  base = np.arange(12, dtype=np.float32).reshape(3, 4)
  t = Tensor(base)
  path = tmp_path / "views.safetensors"
  safe_save({"t": t.T, "sum": t.sum(axis=1), "slice": t[1:, ::2]}, path)
  loaded = safe_load(path)
  np.testing.assert_array_equal(loaded["t"].numpy(), base.T)
  np.testing.assert_array_equal(loaded["sum"].numpy(), base.sum(axis=1))
  np.testing.assert_array_equal(loaded["slice"].numpy(), base[1:, ::2])


# ---------------------------------------------------------------- corrupt files

@pytest.fixture
def good_file(tmp_path: pathlib.Path) -> pathlib.Path:
  path = tmp_path / "good.safetensors"
  safe_save({"w": Tensor(np.arange(6, dtype=np.float32).reshape(2, 3)), "b": Tensor(np.arange(3, dtype=np.int16))},
            path, metadata={"a": "b"})
  return path


def test_truncated_files(tmp_path: pathlib.Path, good_file: pathlib.Path) -> None:
  raw = good_file.read_bytes()
  header_end = 8 + int.from_bytes(raw[:8], "little")
  for cut in sorted({0, 3, 7, 8, 9, header_end // 2, header_end - 1, header_end, header_end + 5, len(raw) - 1}):
    path = tmp_path / f"cut{cut}.safetensors"
    path.write_bytes(raw[:cut])
    with _raises_naming_file(path, "truncated|fewer|header length|data section"): safe_load(path)
    with _raises_naming_file(path, "."): safe_load_metadata(path)


def test_trailing_garbage(tmp_path: pathlib.Path, good_file: pathlib.Path) -> None:
  path = tmp_path / "long.safetensors"
  path.write_bytes(good_file.read_bytes() + b"\0" * 4)
  with _raises_naming_file(path, "data section has 34 bytes but the tensors cover 30"): safe_load(path)


def test_corrupt_header_json(tmp_path: pathlib.Path, good_file: pathlib.Path) -> None:
  raw = bytearray(good_file.read_bytes())
  raw[8] = ord("[")  # break the JSON
  path = tmp_path / "json.safetensors"
  path.write_bytes(bytes(raw))
  with _raises_naming_file(path, "not valid JSON"): safe_load(path)
  for bad, match in [(b"\xff\xfe{}", "not valid JSON"), (b"[1, 2]", "JSON object"), (b'"x"', "JSON object"),
                     (b'{"a": {}, "a": {}}', "twice")]:
    _write_safetensors(path, None, b"", raw_header=bad)
    with _raises_naming_file(path, match): safe_load(path)


def test_huge_header_length(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "huge.safetensors"
  path.write_bytes((2 ** 63).to_bytes(8, "little") + b"{}")
  with _raises_naming_file(path, "header length"): safe_load(path)


@pytest.mark.parametrize("entries, data_size, match", [
  ({"x": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, 2, "unknown or unsupported dtype 'F8_E4M3'"),
  ({"x": {"dtype": "f32", "shape": [2], "data_offsets": [0, 8]}}, 8, "unknown or unsupported dtype"),
  ({"x": {"shape": [2], "data_offsets": [0, 8]}}, 8, "dtype"),
  ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, 8, "outside the data section"),
  ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [4, 0]}}, 8, "outside the data section"),
  ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, 8, "outside the data section"),
  ({"x": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8, "span 8 bytes but shape"),
  ({"x": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, 8, "non-negative"),
  ({"x": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, 8, "non-negative"),
  ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, 8, "data_offsets must be"),
  ({"x": {"dtype": "F32", "shape": [2], "data_offsets": ["0", "8"]}}, 8, "data_offsets must be"),
  ({"x": [1, 2]}, 0, "must be an object"),
  ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, 12, "overlap"),
  ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    "y": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, 8, "overlap"),
  ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 8, "belong to no tensor"),
  ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 8, "the tensors cover 4"),
  ({"__metadata__": {"a": 1}}, 0, "__metadata__"),
])
def test_bad_headers(tmp_path: pathlib.Path, entries: dict, data_size: int, match: str) -> None:
  path = tmp_path / "bad.safetensors"
  _write_safetensors(path, entries, bytes(data_size))
  with _raises_naming_file(path, match): safe_load(path)


def test_bool_bytes_are_normalized(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "bool.safetensors"
  _write_safetensors(path, {"b": {"dtype": "BOOL", "shape": [4], "data_offsets": [0, 4]}}, bytes([0, 1, 2, 255]))
  np.testing.assert_array_equal(safe_load(path)["b"].numpy(), [False, True, True, True])


def test_file_without_tensors(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "empty.safetensors"
  safe_save({}, path, metadata={"only": "metadata"})
  assert safe_load(path) == {} and safe_load_metadata(path) == {"only": "metadata"}


def test_failed_save_keeps_previous_checkpoint(tmp_path: pathlib.Path, good_file: pathlib.Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
  import ourgrad.device
  before = good_file.read_bytes()
  real_fdopen = os.fdopen

  class _FailingFile:
    """Writes half the data, then fails as a full disk would."""
    def __init__(self, file: Any) -> None: self.file = file
    def __enter__(self) -> _FailingFile: return self
    def __exit__(self, *exc: Any) -> None: self.file.close()

    def write(self, data: bytes) -> int:
      self.file.write(data[:len(data) // 2])
      self.file.flush()
      raise OSError(28, "No space left on device")

  monkeypatch.setattr(ourgrad.device.os, "fdopen", lambda *args, **kwargs: _FailingFile(real_fdopen(*args, **kwargs)))
  with pytest.raises(OSError, match="No space left"):
    safe_save({"w": Tensor(np.zeros((100, 100), np.float32))}, good_file)
  monkeypatch.undo()
  assert good_file.read_bytes() == before
  assert sorted(p.name for p in good_file.parent.iterdir()) == ["good.safetensors"]  # no temporary left behind
  np.testing.assert_array_equal(safe_load(good_file)["w"].numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))


def test_failed_serialization_writes_nothing(tmp_path: pathlib.Path, good_file: pathlib.Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
  import ourgrad.nn.state as state
  before = good_file.read_bytes()
  calls = []

  def failing(tensor: Tensor) -> bytes:
    calls.append(tensor)
    if len(calls) == 2: raise RuntimeError("device lost")
    return b"\0" * tensor.numel() * tensor.dtype.itemsize
  monkeypatch.setattr(state, "_tensor_bytes", failing)
  with pytest.raises(RuntimeError, match="device lost"):
    safe_save({"a": Tensor(np.ones(3, np.float32)), "b": Tensor(np.ones(3, np.float32))}, good_file)
  assert good_file.read_bytes() == before


# ---------------------------------------------------------------- state dicts of object trees

class Layer:
  def __init__(self, n_in: int, n_out: int, seed: int):
    rng = np.random.default_rng(seed)
    self.weight = Tensor(rng.standard_normal((n_out, n_in)).astype(np.float32))
    self.bias = Tensor.zeros(n_out)
    self.activation = "relu"  # not a tensor: ignored


class Model:
  def __init__(self) -> None:
    self.layers = [Layer(4, 8, 0), Layer(8, 2, 1)]
    self.heads = {"cls": Layer(2, 3, 2)}
    self.scale = (Tensor([1.0]), 3)
    self._cache = Tensor([0.0])  # private: skipped
    self.parent = self  # a cycle must not loop forever
    self.np = np  # a module: never walked into


EXPECTED_KEYS = ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias", "heads.cls.weight",
                 "heads.cls.bias", "scale.0"]


def test_get_state_dict_names() -> None:
  model = Model()
  state = get_state_dict(model)
  assert list(state) == EXPECTED_KEYS
  assert state["layers.1.weight"] is model.layers[1].weight
  assert list(get_state_dict(model.layers, prefix="enc")) == [f"enc.{k[len('layers.'):]}" for k in EXPECTED_KEYS[:4]]
  assert get_state_dict(Tensor([1.0]), prefix="x").keys() == {"x"}


def test_get_state_dict_deep_and_tied() -> None:
  deep: Any = Tensor([1.0])
  for _ in range(5000): deep = [deep]  # deeper than the recursion limit
  assert list(get_state_dict(deep)) == [".".join(["0"] * 5000)]
  model = Model()
  model.heads["tied"] = model.layers[0]  # shared sub-object: both names, one parameter
  state = get_state_dict(model)
  assert state["heads.tied.weight"] is state["layers.0.weight"]
  params = get_parameters(model)
  assert len(params) == 7 and len({id(p) for p in params}) == 7


def test_get_state_dict_slots() -> None:
  class Slotted:
    __slots__ = ("weight", "_hidden", "missing")

    def __init__(self) -> None: self.weight, self._hidden = Tensor([1.0]), Tensor([2.0])
  assert list(get_state_dict({"s": Slotted()})) == ["s.weight"]


def test_load_state_dict_round_trip(tmp_path: pathlib.Path) -> None:
  source, target = Model(), Model()
  for layer in target.layers: layer.weight.assign(Tensor.zeros(*layer.weight.shape)).realize()
  path = tmp_path / "model.safetensors"
  safe_save(get_state_dict(source), path)
  loaded = safe_load(path)
  result = load_state_dict(target, loaded)
  assert result.missing_keys == [] and result.unexpected_keys == []
  for name, tensor in get_state_dict(target).items():
    np.testing.assert_array_equal(tensor.numpy(), get_state_dict(source)[name].numpy())
  # the model holds copies, also where its tensor was a constant (bias = zeros): changing the loaded tensors
  # does not change the model (safe_load gives DISK tensors, which run no kernels: load these onto a device)
  fresh, on_device = Model(), safe_load(path, device=Device.DEFAULT)
  load_state_dict(fresh, on_device)
  on_device["heads.cls.bias"].assign(on_device["heads.cls.bias"] + 1).realize()
  np.testing.assert_array_equal(fresh.heads["cls"].bias.numpy(), np.zeros(3, np.float32))


def test_load_state_dict_keeps_identity_and_casts() -> None:
  layer = Layer(4, 8, 0)
  weight = layer.weight
  state = {"weight": Tensor(weight.numpy().astype(np.float64) + 1), "bias": Tensor(np.arange(8, dtype=np.int32))}
  load_state_dict(layer, state)
  assert layer.weight is weight and weight.dtype == dtypes.float32 and layer.bias.dtype == dtypes.float32
  np.testing.assert_array_equal(weight.numpy(), state["weight"].numpy().astype(np.float32))
  np.testing.assert_array_equal(layer.bias.numpy(), np.arange(8, dtype=np.float32))


def test_load_state_dict_strict_errors() -> None:
  model = Model()
  before = {name: t.numpy() for name, t in get_state_dict(model).items()}
  state = {name: Tensor.ones(*t.shape) for name, t in get_state_dict(model).items()}
  del state["layers.1.bias"], state["scale.0"]
  state["layers.2.weight"] = Tensor.ones(2)
  state["layers.0.weight"] = Tensor.ones(4, 8)  # transposed shape
  with pytest.raises(StateDictError) as info: load_state_dict(model, state)
  message = str(info.value)
  for part in ["2 missing keys: layers.1.bias, scale.0", "1 unexpected key: layers.2.weight",
               "1 shape mismatch: layers.0.weight (model expects (8, 4), state dict has (4, 8))"]:
    assert part in message, message
  assert info.value.missing_keys == ["layers.1.bias", "scale.0"]
  assert info.value.shape_mismatches == [("layers.0.weight", (8, 4), (4, 8))]
  assert isinstance(info.value, ValueError)
  for name, tensor in get_state_dict(model).items(): np.testing.assert_array_equal(tensor.numpy(), before[name])
  # not strict: missing/unexpected are returned, but a wrong shape still raises (as in PyTorch)
  with pytest.raises(StateDictError, match="shape mismatch") as info: load_state_dict(model, state, strict=False)
  assert "missing" not in str(info.value)
  state["heads.cls.bias"] = Tensor.ones(4)
  with pytest.raises(StateDictError, match="2 shape mismatches: layers.0.weight .*, heads.cls.bias"):
    load_state_dict(model, state, strict=False)
  state["heads.cls.bias"] = Tensor.ones(3)
  state["layers.0.weight"] = Tensor.ones(8, 4)
  result = load_state_dict(model, state, strict=False)
  assert result.missing_keys == ["layers.1.bias", "scale.0"] and result.unexpected_keys == ["layers.2.weight"]
  np.testing.assert_array_equal(model.layers[0].weight.numpy(), np.ones((8, 4), np.float32))
  np.testing.assert_array_equal(model.layers[1].bias.numpy(), before["layers.1.bias"])


# ---------------------------------------------------------------- torch checkpoints

def _torch_equal(ours: Tensor, theirs: torch.Tensor) -> None:
  theirs = theirs.detach()
  assert ours.shape == tuple(theirs.shape)
  if theirs.dtype == torch.bfloat16:
    assert ours.dtype == dtypes.bfloat16
    np.testing.assert_array_equal(ours.numpy(), theirs.float().numpy())
  elif theirs.dtype in (torch.uint16, torch.uint32, torch.uint64):
    np.testing.assert_array_equal(ours.numpy(), theirs.to(torch.int64).numpy().astype(ours.numpy().dtype))
  else:
    assert ours.numpy().dtype == theirs.numpy().dtype
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())


def test_torch_load_dtypes_and_views(tmp_path: pathlib.Path) -> None:
  gen = torch.Generator().manual_seed(0)
  base = torch.arange(20, dtype=torch.float32)
  state = collections.OrderedDict(
    f32=torch.randn(3, 4, generator=gen), f64=torch.randn(5, generator=gen, dtype=torch.float64),
    f16=torch.randn(2, 3, generator=gen).half(), bf16=torch.randn(4, 2, generator=gen).bfloat16(),
    i8=torch.tensor([-128, 0, 127], dtype=torch.int8), u8=torch.tensor([0, 255], dtype=torch.uint8),
    i16=torch.tensor([-3, 30000], dtype=torch.int16), i32=torch.tensor([[1, -2]], dtype=torch.int32),
    i64=torch.tensor([2 ** 40, -1]), boolean=torch.tensor([True, False, True]),
    u16=torch.tensor([1, 65535], dtype=torch.int32).to(torch.uint16),
    u32=torch.tensor([1, 2 ** 32 - 1], dtype=torch.int64).to(torch.uint32),
    transposed=torch.randn(3, 5, generator=gen).T, base=base, offset_view=base[5:11].view(2, 3),
    strided=base[1::4], permuted=torch.randn(2, 3, 4, generator=gen).permute(2, 0, 1),
    scalar=torch.tensor(3.5), empty=torch.zeros(0, 3), param=torch.nn.Parameter(torch.ones(2, 2)),
    expanded=torch.tensor([1.0, 2.0]).expand(3, 2),
  )
  assert not state["transposed"].is_contiguous() and state["offset_view"].storage_offset() == 5
  path = tmp_path / "model.pt"
  torch.save(state, path)
  loaded = torch_load(path)
  assert list(loaded) == list(state)
  for name, tensor in state.items(): _torch_equal(loaded[name], tensor)
  assert loaded["f16"].dtype == dtypes.float16 and loaded["boolean"].dtype == dtypes.bool
  assert loaded["u32"].dtype == dtypes.uint32 and loaded["scalar"].shape == ()


def test_torch_load_module_state_dict_and_nesting(tmp_path: pathlib.Path) -> None:
  torch.manual_seed(0)
  net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
  path = tmp_path / "net.pth"
  torch.save({"model": net.state_dict(), "epoch": 7, "layers": [torch.ones(2)]}, path)
  loaded = torch_load(path)
  expected = {f"model.{k}": v for k, v in net.state_dict().items()} | {"layers.0": torch.ones(2)}
  assert list(loaded) == list(expected)
  for name, tensor in expected.items(): _torch_equal(loaded[name], tensor)


def test_torch_load_into_model(tmp_path: pathlib.Path) -> None:
  model = Model()
  state = {name: torch.from_numpy(t.numpy() * 2) for name, t in get_state_dict(model).items()}
  torch.save(state, tmp_path / "m.pt")
  load_state_dict(model, torch_load(tmp_path / "m.pt"))
  for name, tensor in get_state_dict(model).items(): np.testing.assert_array_equal(tensor.numpy(), state[name])


class _Evil:
  def __init__(self, marker: pathlib.Path) -> None: self.marker = marker
  def __reduce__(self) -> tuple: return (os.system, (f"touch {self.marker}",))


def _zip_with_pickle(path: pathlib.Path, payload: bytes, storages: dict[str, bytes] | None = None) -> None:
  with zipfile.ZipFile(path, "w") as archive:
    archive.writestr("evil/data.pkl", payload)
    for key, data in (storages or {}).items(): archive.writestr(f"evil/data/{key}", data)


def test_torch_load_refuses_code_execution(tmp_path: pathlib.Path) -> None:
  marker = tmp_path / "pwned"
  path = tmp_path / "evil.pt"
  _zip_with_pickle(path, pickle.dumps({"w": _Evil(marker)}, protocol=2))
  with _raises_naming_file(path, r"references (posix|nt|os)\.system.*refusing"): torch_load(path)
  assert not marker.exists()
  # the same pickle outside a zip is the legacy format: refused before unpickling anything
  path.write_bytes(pickle.dumps(_Evil(marker), protocol=2))
  with _raises_naming_file(path, "legacy"): torch_load(path)
  assert not marker.exists()


def test_torch_load_refuses_pickled_modules(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "module.pt"
  torch.save(torch.nn.Linear(2, 2), path)
  with _raises_naming_file(path, r"torch\.nn\.modules\.linear\.Linear"): torch_load(path)


def test_torch_load_legacy_and_garbage(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "legacy.pt"
  torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
  with _raises_naming_file(path, "legacy"): torch_load(path)
  path.write_bytes(b"hello")
  with _raises_naming_file(path, "not a PyTorch checkpoint"): torch_load(path)
  with zipfile.ZipFile(path, "w") as archive: archive.writestr("x/other.txt", "x")
  with _raises_naming_file(path, "data.pkl"): torch_load(path)
  _zip_with_pickle(path, b"\x80\x02}q\x00(")  # a pickle cut short
  with _raises_naming_file(path, "not a valid checkpoint pickle"): torch_load(path)


def _tensor_pickle(size: tuple[int, ...], stride: tuple[int, ...], numel: int, offset: int = 0) -> bytes:
  """A hand-written data.pkl: {"w": _rebuild_tensor_v2(FloatStorage "0" of numel, offset, size, stride)}."""
  def ints(values: tuple[int, ...]) -> bytes: return b"(" + b"".join(b"I%d\n" % v for v in values) + b"t"
  return (b"\x80\x02}Vw\nctorch._utils\n_rebuild_tensor_v2\n("
          b"(Vstorage\nctorch\nFloatStorage\nV0\nVcpu\nI%d\ntQ" % numel
          + b"I%d\n" % offset + ints(size) + ints(stride) + b"I00\nccollections\nOrderedDict\n)RtRs.")


def test_torch_load_hand_written_pickles(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "hand.pt"
  storage = np.arange(6, dtype="<f4").tobytes()
  _zip_with_pickle(path, _tensor_pickle((2, 2), (1, 2), 6, offset=1), {"0": storage})
  # offset 1, strides (1, 2): elements 1, 3 / 2, 4
  np.testing.assert_array_equal(torch_load(path)["w"].numpy(), np.array([[1, 3], [2, 4]], np.float32))
  # a view that reaches outside its storage must not read stray memory
  _zip_with_pickle(path, _tensor_pickle((2, 2), (100, 1), 6), {"0": storage})
  with _raises_naming_file(path, "reaches element 101 but the storage has 6"): torch_load(path)
  # a storage file shorter than the pickle says
  _zip_with_pickle(path, _tensor_pickle((2,), (1,), 6), {"0": storage[:8]})
  with _raises_naming_file(path, "has 8 bytes, expected 24"): torch_load(path)
  _zip_with_pickle(path, _tensor_pickle((2,), (1,), 6), {})
  with _raises_naming_file(path, "missing from the archive"): torch_load(path)
  _zip_with_pickle(path, _tensor_pickle((2,), (-1,), 6), {"0": storage})
  with _raises_naming_file(path, "malformed view"): torch_load(path)


def test_torch_load_big_endian(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "be.pt"
  with zipfile.ZipFile(path, "w") as archive:
    archive.writestr("be/data.pkl", _tensor_pickle((3,), (1,), 3))
    archive.writestr("be/byteorder", "big")
    archive.writestr("be/data/0", np.array([1.5, -2, 3], dtype=">f4").tobytes())
  np.testing.assert_array_equal(torch_load(path)["w"].numpy(), np.array([1.5, -2, 3], np.float32))


def test_checkpoint_error_is_value_error() -> None:
  assert issubclass(CheckpointError, ValueError) and issubclass(StateDictError, ValueError)
