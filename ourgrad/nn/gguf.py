"""Reading GGUF files (llama.cpp's model format): `gguf_load(path)` -> (tensors, metadata).

A GGUF file (versions 2 and 3; everything little-endian) is:

- a header: the magic b"GGUF", the version (u32), the tensor count (u64) and the metadata key/value count (u64);
- the metadata: key/value pairs, each a string key, a value type (u32) and a value. Value types are
  u8/i8/u16/i16/u32/i32/u64/i64, f32/f64, bool (one byte, 0 or 1), string (u64 byte length + UTF-8 bytes) and
  array (element type u32 + count u64 + the elements; arrays of arrays are allowed). Strings and the tensor names
  below have the same layout;
- the tensor infos: for each tensor its name, n_dims (u32), the dims (u64 each, innermost first, so the row-major
  shape is their reverse), the ggml type (u32) and the byte offset of its data within the data section (u64, a
  multiple of the alignment);
- the data section, from the first multiple of the alignment (metadata `general.alignment`, default 32) at or after
  the end of the tensor infos, to the end of the file.

Tensors of type F32, F16 and BF16 load as windows of the memory-mapped file on the `DISK:<path>` device (see
`ourgrad.nn.state.disk_tensor`): nothing is read until they are used. Block-quantized tensors are dequantized to
float32 by ordinary Tensor ops on their raw bytes (a uint8 tensor copied from the file to a compute device), so
the dequantization is lazy too and runs as a kernel on whatever device the tensors go to:

- Q8_0: blocks of 32 values stored as 34 bytes, an f16 scale d and 32 int8 quants q; value = d * q;
- Q4_0: blocks of 32 values stored as 18 bytes, an f16 scale d and 16 bytes of 4-bit quants q; value = d * (q - 8),
  nibbles ordered as in Q4_1;
- Q4_1: blocks of 32 values stored as 20 bytes, an f16 scale d, an f16 minimum m and 16 bytes of 4-bit quants q;
  value = d * q + m, where byte j holds element j in its low nibble and element j + 16 in its high nibble;
- Q6_K: super-blocks of 256 values stored as 210 bytes: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits),
  16 int8 sub-block scales (one per 16 values) and an f16 super-scale d; value = d * scale * (q - 32) with the 6-bit
  q = low | high << 4. Each half of 128 values uses 64 ql bytes and 32 qh bytes: value 32*g + l (g = 0..3,
  l = 0..31) takes the low nibble (g even) or high nibble (g odd) of ql[l + 32 * (g & 1)] and bits 2g..2g+1 of
  qh[l], and the scale of its 16-value run.

The whole header is validated against the file before any tensor is made: every read is bounds-checked, counts
and lengths are checked against the bytes left, and the tensors must be aligned, inside the data section and not
overlap. Every problem raises `CheckpointError` naming the file.
"""
from __future__ import annotations

import functools
import math
import mmap
import os
import pathlib
import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from ourgrad.device import Device, HostAllocator
from ourgrad.dtype import DType, dtypes
from ourgrad.errors import ShapeError
from ourgrad.helpers import QUANTS_APART
from ourgrad.nn.state import CheckpointError, disk_tensor
from ourgrad.tensor import Tensor

PathLike = str | os.PathLike

GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
_MAX_NESTING = 64  # arrays of arrays deeper than this are corruption (and would exhaust the stack)
_MAX_DIMS = 4  # GGML_MAX_DIMS
_HOST_LITTLE_ENDIAN = sys.byteorder == "little"  # F32/F16/BF16 data can then be used in place

# metadata value types: id -> (name, little-endian numpy dtype of one value; None for string and array)
_STRING, _ARRAY, _BOOL = 8, 9, 7
_VALUE_TYPES: dict[int, tuple[str, np.dtype | None]] = {
  0: ("UINT8", np.dtype("<u1")), 1: ("INT8", np.dtype("<i1")), 2: ("UINT16", np.dtype("<u2")),
  3: ("INT16", np.dtype("<i2")), 4: ("UINT32", np.dtype("<u4")), 5: ("INT32", np.dtype("<i4")),
  6: ("FLOAT32", np.dtype("<f4")), 7: ("BOOL", np.dtype("<u1")), 8: ("STRING", None), 9: ("ARRAY", None),
  10: ("UINT64", np.dtype("<u8")), 11: ("INT64", np.dtype("<i8")), 12: ("FLOAT64", np.dtype("<f8")),
}
_INTEGER_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})

# ggml tensor types by id, for error messages (ids 4 and 5 were Q4_2/Q4_3, removed from ggml)
GGML_TYPE_NAMES: dict[int, str] = {
  0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K",
  12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
  20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
  29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0",
}
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0, GGML_Q6_K, GGML_BF16 = 0, 1, 2, 3, 8, 14, 30


@dataclass(frozen=True)
class _GGMLType:
  """How a supported ggml type is stored: `block_size` values in `block_bytes` bytes (1 value per block for the
  plain float types, whose `dtype` is the stored dtype)."""
  name: str
  block_size: int
  block_bytes: int
  dtype: DType | None = None  # None: quantized, dequantized to float32


_SUPPORTED_TYPES: dict[int, _GGMLType] = {
  GGML_F32: _GGMLType("F32", 1, 4, dtypes.float32),
  GGML_F16: _GGMLType("F16", 1, 2, dtypes.float16),
  GGML_BF16: _GGMLType("BF16", 1, 2, dtypes.bfloat16),
  GGML_Q8_0: _GGMLType("Q8_0", 32, 34),
  GGML_Q4_0: _GGMLType("Q4_0", 32, 18),
  GGML_Q4_1: _GGMLType("Q4_1", 32, 20),
  GGML_Q6_K: _GGMLType("Q6_K", 256, 210),
}


@dataclass(frozen=True)
class GGUFTensorInfo:
  """One tensor of a GGUF file: its row-major `shape` (the file's dims reversed), ggml type id, and byte range
  [begin, end) within the data section."""
  name: str
  shape: tuple[int, ...]
  ggml_type: int
  begin: int
  end: int


@dataclass(frozen=True)
class GGUFHeader:
  """The validated header of a GGUF file."""
  version: int
  metadata: dict[str, Any]
  tensors: list[GGUFTensorInfo]  # in file order
  alignment: int
  data_start: int  # absolute file offset of the data section
  file_size: int


def _type_name(type_id: int) -> str:
  return f"{type_id} ({GGML_TYPE_NAMES[type_id]})" if type_id in GGML_TYPE_NAMES else f"{type_id} (unknown)"


class _Reader:
  """Bounds-checked little-endian reads from the start of a byte buffer (the memory-mapped file)."""

  def __init__(self, path: pathlib.Path, data: Any, size: int):
    self.path, self.data, self.size, self.pos = path, data, size, 0

  def error(self, message: str) -> CheckpointError: return CheckpointError(f"{self.path}: {message}")

  @property
  def left(self) -> int: return self.size - self.pos

  def take(self, nbytes: int, what: str) -> int:
    """Claim the next `nbytes` bytes for `what`; returns their offset. CheckpointError if the file ends first."""
    if nbytes > self.left:
      raise self.error(f"truncated file: {what} needs {nbytes} bytes at byte {self.pos}, but the file has only "
                       f"{self.left} bytes left ({self.size} in all)")
    start = self.pos
    self.pos += nbytes
    return start

  def bytes(self, nbytes: int, what: str) -> bytes:
    """The next `nbytes` bytes, copied (so no view of the mapping outlives the read)."""
    start = self.take(nbytes, what)
    return bytes(self.data[start:start + nbytes])

  def scalar(self, fmt: str, what: str) -> Any:
    return struct.unpack_from("<" + fmt, self.data, self.take(struct.calcsize(fmt), what))[0]

  def u32(self, what: str) -> int: return self.scalar("I", what)

  def u64(self, what: str) -> int: return self.scalar("Q", what)

  def string(self, what: str) -> str:
    length = self.u64(f"the length of {what}")
    if length > self.left:
      raise self.error(f"{what} at byte {self.pos - 8} claims {length} bytes, but the file has only {self.left} "
                       f"bytes left (corrupt or truncated file)")
    start = self.pos
    try:
      return self.bytes(length, what).decode("utf-8")
    except UnicodeDecodeError as error:
      raise self.error(f"{what} at byte {start} is not valid UTF-8 ({error})") from None

  def strings(self, count: int, what: str) -> list[str]:
    """`count` strings in a row (a vocabulary: tens of thousands), read by a tight loop; an element that is not
    well-formed is read again by `string`, which raises the error for it."""
    data, end, pos = self.data, self.size, self.pos
    unpack = struct.Struct("<Q").unpack_from
    result: list[str] = []
    try:
      for _ in range(count):
        if end - pos < 8: break
        length = unpack(data, pos)[0]
        if length > end - pos - 8: break
        result.append(data[pos + 8:pos + 8 + length].decode("utf-8"))
        pos += 8 + length
    except UnicodeDecodeError:
      pass
    self.pos = pos
    if len(result) < count:
      self.string(f"{what}[{len(result)}]")  # raises the error for the element that stopped the loop
      raise self.error(f"{what}[{len(result)}] cannot be read")  # not reached
    return result

  def value(self, type_id: int, what: str, depth: int = 0) -> Any:
    """One metadata value of type `type_id` as a Python object (arrays as lists)."""
    if type_id not in _VALUE_TYPES:
      raise self.error(f"{what} has unknown metadata value type {type_id} (known: 0..12)")
    dt = _VALUE_TYPES[type_id][1]
    if type_id == _STRING: return self.string(what)
    if type_id == _ARRAY: return self.array(what, depth + 1)
    assert dt is not None
    value = np.frombuffer(self.bytes(dt.itemsize, what), dtype=dt)[0].item()
    if type_id == _BOOL:
      if value > 1: raise self.error(f"{what} is a bool stored as byte {value}, not 0 or 1")
      return bool(value)
    return value

  def array(self, what: str, depth: int) -> list[Any]:
    if depth > _MAX_NESTING: raise self.error(f"{what}: arrays nested more than {_MAX_NESTING} deep")
    start = self.pos
    item_type = self.u32(f"the element type of {what}")
    count = self.u64(f"the length of {what}")
    if item_type not in _VALUE_TYPES:
      raise self.error(f"{what} (array at byte {start}) has unknown element type {item_type} (known: 0..12)")
    name, dt = _VALUE_TYPES[item_type]
    # the least each element can take: its size, a string's length field, an array's type and count
    least = dt.itemsize if dt is not None else 8 if item_type == _STRING else 12
    if count * least > self.left:
      raise self.error(f"{what} (array at byte {start}) claims {count} {name} elements, at least {count * least} "
                       f"bytes, but the file has only {self.left} bytes left (corrupt or truncated file)")
    if item_type == _STRING: return self.strings(count, what)
    if dt is None:
      return [self.value(item_type, f"{what}[{index}]", depth) for index in range(count)]
    values = np.frombuffer(self.bytes(count * dt.itemsize, what), dtype=dt)
    if item_type == _BOOL:
      if count and int(values.max()) > 1:
        raise self.error(f"{what}: a bool array holds byte {int(values.max())}, not 0 or 1")
      return [bool(value) for value in values.tolist()]
    return values.tolist()


def _not_gguf_hint(head: bytes) -> str:
  """A guess at what a file with the wrong magic is, for the error message."""
  if head[:4] in (b"lmgg", b"fmgg", b"tjgg"): return "; it looks like a legacy GGML/GGJT file, which is not supported"
  if len(head) >= 9 and head[8:9] == b"{": return "; it looks like a safetensors file (use ourgrad.nn.state.safe_load)"
  if head[:2] == b"PK": return "; it looks like a zip archive (torch.save? use ourgrad.nn.state.torch_load)"
  return ""


def _parse_header(path: pathlib.Path, data: Any, size: int) -> GGUFHeader:
  reader = _Reader(path, data, size)
  head = bytes(data[:16])
  if size < 4 and GGUF_MAGIC.startswith(head):
    raise reader.error(f"truncated file: {size} bytes, fewer than the 4-byte magic {GGUF_MAGIC!r} of a GGUF file")
  if size < 4 or head[:4] != GGUF_MAGIC:
    raise reader.error(f"not a GGUF file: it starts with {head[:4]!r}, not the magic {GGUF_MAGIC!r}"
                       f"{_not_gguf_hint(head)}")
  reader.pos = 4
  version = reader.u32("the version")
  if version not in GGUF_VERSIONS:
    if version == 1: detail = "GGUF v1 is not supported; re-convert the model with a recent llama.cpp"
    elif int.from_bytes(version.to_bytes(4, "little"), "big") in GGUF_VERSIONS:
      detail = "big-endian GGUF files are not supported"
    else: detail = "unsupported GGUF version"
    raise reader.error(f"GGUF version {version}: {detail} (supported: {', '.join(map(str, GGUF_VERSIONS))})")
  tensor_count = reader.u64("the tensor count")
  kv_count = reader.u64("the metadata key/value count")
  # each key/value takes at least 13 bytes (key length, type, a one-byte value) and each tensor info 24 (name
  # length, n_dims, type, offset): a larger count than the file can hold is corruption, not a reason to loop
  if kv_count * 13 > reader.left:
    raise reader.error(f"the header claims {kv_count} metadata key/value pairs, more than the {reader.left} bytes "
                       f"left in the file can hold (corrupt or truncated file)")
  if tensor_count * 24 > reader.left:
    raise reader.error(f"the header claims {tensor_count} tensors, more than the {reader.left} bytes left in the "
                       f"file can hold (corrupt or truncated file)")

  metadata: dict[str, Any] = {}
  value_types: dict[str, int] = {}
  for index in range(kv_count):
    key = reader.string(f"the key of metadata pair {index}")
    if key in metadata: raise reader.error(f"metadata key {key!r} appears twice")
    type_id = reader.u32(f"the value type of metadata {key!r}")
    metadata[key] = reader.value(type_id, f"metadata {key!r}")
    value_types[key] = type_id

  alignment = DEFAULT_ALIGNMENT
  if "general.alignment" in metadata:
    alignment = metadata["general.alignment"]
    if value_types["general.alignment"] not in _INTEGER_TYPES or alignment <= 0 or alignment & (alignment - 1):
      raise reader.error(f"general.alignment must be a positive power of two (a UINT32), got {alignment!r} of type "
                         f"{_VALUE_TYPES[value_types['general.alignment']][0]}")

  infos: list[tuple[str, tuple[int, ...], int, int]] = []
  names: set[str] = set()
  for index in range(tensor_count):
    name = reader.string(f"the name of tensor {index}")
    if name in names: raise reader.error(f"tensor name {name!r} appears twice")
    names.add(name)
    n_dims = reader.u32(f"n_dims of tensor {name!r}")
    if not 1 <= n_dims <= _MAX_DIMS:
      raise reader.error(f"tensor {name!r} has n_dims {n_dims}; GGUF tensors have 1 to {_MAX_DIMS} dims")
    dims = [reader.u64(f"dim {axis} of tensor {name!r}") for axis in range(n_dims)]
    ggml_type = reader.u32(f"the type of tensor {name!r}")
    offset = reader.u64(f"the data offset of tensor {name!r}")
    infos.append((name, tuple(reversed(dims)), ggml_type, offset))

  data_start = -(-reader.pos // alignment) * alignment
  data_size = max(0, size - data_start)
  tensors: list[GGUFTensorInfo] = []
  for name, shape, ggml_type, offset in infos:
    where = f"tensor {name!r}"
    kind = _SUPPORTED_TYPES.get(ggml_type)
    if kind is None:
      supported = ", ".join(f"{t.name} ({type_id})" for type_id, t in _SUPPORTED_TYPES.items())
      raise reader.error(f"{where} has ggml type {_type_name(ggml_type)}, which is not supported (supported: "
                         f"{supported})")
    if shape[-1] % kind.block_size:
      raise reader.error(f"{where} of type {kind.name} has an innermost dim of {shape[-1]}, not a multiple of its "
                         f"block size {kind.block_size}")
    if offset % alignment:
      raise reader.error(f"{where} has data offset {offset}, not a multiple of the alignment {alignment}")
    nbytes = math.prod(shape) // kind.block_size * kind.block_bytes
    if offset + nbytes > data_size:
      raise reader.error(f"{where} ({kind.name}, shape {shape}) needs bytes [{offset}, {offset + nbytes}) of the "
                         f"data section, which has {data_size} bytes (from byte {data_start} of the file): "
                         f"truncated file or corrupt offset/shape")
    tensors.append(GGUFTensorInfo(name, shape, ggml_type, offset, offset + nbytes))
  previous: GGUFTensorInfo | None = None
  for info in sorted((info for info in tensors if info.end > info.begin), key=lambda info: info.begin):
    if previous is not None and info.begin < previous.end:
      raise reader.error(f"tensors {previous.name!r} (bytes [{previous.begin}, {previous.end})) and {info.name!r} "
                         f"(bytes [{info.begin}, {info.end})) overlap in the data section (corrupt offsets)")
    previous = info
  return GGUFHeader(version, metadata, tensors, alignment, data_start, size)


def gguf_read_header(path: PathLike) -> GGUFHeader:
  """Read and validate the header of the GGUF file at `path` (metadata and tensor infos; no tensor data is read).
  CheckpointError names the file and the problem."""
  path = pathlib.Path(path)
  with open(path, "rb") as file:
    size = os.fstat(file.fileno()).st_size
    if size == 0: return _parse_header(path, b"", 0)  # mmap cannot map an empty file
    with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
      return _parse_header(path, data, size)


# ---------------------------------------------------------------- building tensors from raw bytes

def _unsigned(raw: Tensor, nbytes: int) -> Tensor:
  """(n, nbytes) uint8 little-endian bytes -> (n,) unsigned integers (uint16/uint32), assembled by shifts, so the
  result does not depend on the host's byte order."""
  unsigned = {2: dtypes.uint16, 4: dtypes.uint32}[nbytes]
  value = raw[:, 0].cast(unsigned)
  for index in range(1, nbytes): value = value | (raw[:, index].cast(unsigned) << (8 * index))
  return value


def half_bits_to_float(bits: Tensor) -> Tensor:
  """IEEE half-precision bit patterns (an unsigned integer tensor) -> their float32 values, exactly (signed zeros,
  subnormals, infinities and NaNs included). Built from integer ops and a uint32 -> float32 bitcast only, so it
  compiles on every device (some renderers cannot bitcast to float16)."""
  bits = bits.cast(dtypes.uint32)
  exponent, magnitude = bits & 0x7C00, (bits & 0x7FFF) << 13  # the fields moved to float32's places
  normal = magnitude + ((127 - 15) << 23)  # rebias the exponent
  special = magnitude | 0x7F800000  # exponent 31: infinity (mantissa 0) or NaN
  subnormal = ((bits & 0x3FF).cast(dtypes.float32) * 2.0 ** -24).bitcast(dtypes.uint32)  # exponent 0: m * 2^-24
  magnitude = (exponent != 0).where((exponent != 0x7C00).where(normal, special), subnormal)
  return (magnitude | ((bits & 0x8000) << 16)).bitcast(dtypes.float32)


def _plain_values(raw: Tensor, dtype: DType) -> Tensor:
  """(n, itemsize) uint8 little-endian bytes of F32/F16/BF16 values -> (n,) values of `dtype`, for hosts whose byte
  order is not the file's."""
  if dtype == dtypes.float32: return _unsigned(raw, 4).bitcast(dtypes.float32)
  bits = _unsigned(raw, 2)
  if dtype == dtypes.float16: return half_bits_to_float(bits).cast(dtypes.float16)  # exact: every half is a float
  return (bits.cast(dtypes.uint32) << 16).bitcast(dtypes.float32).cast(dtypes.bfloat16)  # bfloat16: float's top half


def block_scales(ggml_type: int, raw: Tensor) -> Tensor:
  """The f16 scales of quantized blocks `raw` (blocks, block_bytes) uint8 decoded to float32 (blocks, k): d for
  Q8_0, Q4_0 and Q6_K (Q6_K's int8 sub-block scales stay in the bytes), d and m for Q4_1."""
  if _quant_shift(ggml_type, raw): raise ValueError(f"{_type_name(ggml_type)} blocks of {raw.shape[1]} bytes have no "
                                                    f"scales (kept apart): pass them to block_values")
  if ggml_type == GGML_Q4_1: return half_bits_to_float(_unsigned(raw[:, 0:4].reshape(-1, 2), 2)).reshape(-1, 2)
  where = 208 if ggml_type == GGML_Q6_K else 0
  return half_bits_to_float(_unsigned(raw[:, where:where + 2], 2)).reshape(-1, 1)


# where each block's f16 scales sit (byte offset, count), for `_host_block_scales`: the same as `block_scales` reads
_SCALE_BYTES = {GGML_Q8_0: (0, 1), GGML_Q4_0: (0, 1), GGML_Q4_1: (0, 2), GGML_Q6_K: (208, 1)}


def scale_prefix_bytes(ggml_type: int) -> int:
  """The bytes at the start of a block that hold its f16 scales (Q8_0, Q4_0: d; Q4_1: d and m), else 0 (Q6_K's d
  is at its end). A PackedTensor that runs on thread blocks keeps its blocks without them (`PackedTensor.quants`)."""
  start, count = _SCALE_BYTES.get(ggml_type, (1, 0))
  return 2 * count if start == 0 else 0


def _quant_shift(ggml_type: int, raw: Tensor) -> int:
  """How many bytes earlier than in a stored block each quant sits in the rows of `raw`: 0 for whole blocks, the
  scale prefix for blocks stored without it (`PackedTensor.quants`)."""
  prefix = scale_prefix_bytes(ggml_type)
  if prefix and raw.shape[-1] == _SUPPORTED_TYPES[ggml_type].block_bytes - prefix: return prefix
  return 0


def _host_block_scales(ggml_type: int, raw: np.ndarray) -> np.ndarray:
  """`block_scales` of blocks in host memory, with numpy (a f16 is widened exactly): float32 (blocks, k)."""
  start, count = _SCALE_BYTES[ggml_type]
  halves = np.ascontiguousarray(raw[:, start:start + 2 * count]).view("<f2")
  return halves.astype(np.float32).reshape(-1, count)


def _on_host(device: str) -> bool:
  """Whether `device` keeps its buffers in host memory (CLANG, LLVM, PYTHON): numpy reads and writes them there
  without a kernel to compile, where a load-time kernel per tensor shape cost ~0.1 s of gcc each on a cold cache."""
  return isinstance(Device[device].allocator, HostAllocator)


def _low_high_nibbles(packed: Tensor) -> Tensor:
  """(blocks, 16) bytes -> (blocks, 2, 16) 4-bit quants as float32: the low nibbles (elements 0..15), then the high.
  A broadcast view of the bytes shifted by a per-half table (no cat: each element loads one byte, unmasked)."""
  blocks = packed.shape[0]
  both = packed.reshape(blocks, 1, 16).expand(blocks, 2, 16).cast(dtypes.int32)
  return ((both >> _nibble_shifts(packed.device)) & 0xF).cast(dtypes.float32)


@functools.lru_cache(maxsize=None)
def _nibble_shifts(device: str) -> Tensor:
  """(1, 2, 1) int32 [0, 4]: the shift of the low and the high nibble, a tiny table realized once per device (an
  arange-made one would be a kernel of its own in every graph)."""
  return Tensor(np.array([0, 4], np.int32).reshape(1, 2, 1), device=device).realize()


@functools.lru_cache(maxsize=None)
def _q6_k_shifts(device: str) -> tuple[Tensor, Tensor]:
  """The shifts of group g = 0..3 of a Q6_K half (4 * (g // 2) for its nibble, 2 * g for its high bits), each
  (1, 1, 4, 1) int32, realized once per device: a tiny table the decoding kernels load (computed from an arange
  they would be a kernel of their own each time)."""
  nibble = Tensor(np.array([0, 0, 4, 4], np.int32).reshape(1, 1, 4, 1), device=device).realize()
  bits = Tensor(np.array([0, 2, 4, 6], np.int32).reshape(1, 1, 4, 1), device=device).realize()
  return nibble, bits


def _q6_k_quants(raw: Tensor) -> Tensor:
  """Q6_K super-blocks (blocks, 210) -> their 6-bit quants minus 32 as float32 (blocks, 16, 16), in value order.
  Built from broadcast views and per-group shifts (no stack or cat: each quant byte is read where it is needed, so
  the decoding fuses into the kernel that reads the values)."""
  blocks = raw.shape[0]
  # value 128 h + 32 g + l: nibble g // 2 of ql[64 h + 32 (g % 2) + l], bits 2g..2g+1 of qh[32 h + l]
  low = raw[:, 0:128].reshape(blocks, 2, 1, 2, 32).expand(blocks, 2, 2, 2, 32).reshape(blocks, 2, 4, 32)
  high = raw[:, 128:192].reshape(blocks, 2, 1, 32).expand(blocks, 2, 4, 32)
  nibble_shift, bits_shift = _q6_k_shifts(raw.device)
  nibble = (low.cast(dtypes.int32) >> nibble_shift) & 0xF
  bits = (high.cast(dtypes.int32) >> bits_shift) & 3
  return ((nibble | (bits << 4)).cast(dtypes.float32) - 32.0).reshape(blocks, 16, 16)


# The shape of one block's values as `block_values` builds them, in value order: each load of the decoding is one
# view of the packed bytes in this shape (Q4's two halves are a broadcast of the same 16 bytes; merged into one axis
# of 32 they would be indexed by k // 16 and k % 16). Q6_K's are computed in their (16, 16) sub-blocks and merged.
BLOCK_VALUE_SHAPES: dict[int, tuple[int, ...]] = {GGML_Q8_0: (32,), GGML_Q4_0: (2, 16), GGML_Q4_1: (2, 16),
                                                  GGML_Q6_K: (256,)}


def block_values(ggml_type: int, raw: Tensor, scales: Tensor | None = None) -> Tensor:
  """Quantized blocks `raw` (blocks, block_bytes) uint8 -> their values (blocks, *BLOCK_VALUE_SHAPES[type]) float32,
  by lazy tensor ops (so they fuse into the kernel that reads them). `scales`: the blocks' `block_scales` (any float
  dtype), when they were decoded ahead of time; else they are decoded from `raw` here."""
  if ggml_type not in BLOCK_VALUE_SHAPES:
    raise ValueError(f"ggml type {_type_name(ggml_type)} is not block-quantized (quantized: "
                     f"{', '.join(_SUPPORTED_TYPES[t].name for t in QUANTIZED_TYPES)})")
  scales = (block_scales(ggml_type, raw) if scales is None else scales).cast(dtypes.float32)
  shift = _quant_shift(ggml_type, raw)   # blocks kept without their scale bytes: the quants start at byte 0
  if ggml_type == GGML_Q8_0: return raw[:, 2 - shift:34 - shift].bitcast(dtypes.int8).cast(dtypes.float32) * scales
  if ggml_type == GGML_Q4_0: return (_low_high_nibbles(raw[:, 2 - shift:18 - shift]) - 8.0) * scales.reshape(-1, 1, 1)
  if ggml_type == GGML_Q4_1:
    quants = _low_high_nibbles(raw[:, 4 - shift:20 - shift])
    return quants * scales[:, 0:1].reshape(-1, 1, 1) + scales[:, 1:2].reshape(-1, 1, 1)
  sub_scales = raw[:, 192:208].bitcast(dtypes.int8).cast(dtypes.float32)  # Q6_K (block, 16): one per 16 values
  return (_q6_k_quants(raw) * sub_scales.unsqueeze(2) * scales.unsqueeze(2)).reshape(raw.shape[0], 256)


def dequantize_blocks(ggml_type: int, raw: Tensor, scales: Tensor | None = None) -> Tensor:
  """Quantized blocks `raw` (blocks, block_bytes) uint8 -> their values (blocks, block_size) float32 (`block_values`
  with each block's values in one axis)."""
  values = block_values(ggml_type, raw, scales)
  return values.reshape(raw.shape[0], _SUPPORTED_TYPES[ggml_type].block_size)


def dequantize_q8_0(raw: Tensor) -> Tensor:
  """Q8_0 blocks as a (blocks, 34) uint8 tensor -> (blocks, 32) float32: the f16 scale times each int8 quant."""
  return dequantize_blocks(GGML_Q8_0, raw)


def dequantize_q4_1(raw: Tensor) -> Tensor:
  """Q4_1 blocks as a (blocks, 20) uint8 tensor -> (blocks, 32) float32: d * q + m, with the f16 scale d and
  minimum m, and q the low nibbles (elements 0..15) then the high nibbles (elements 16..31) of the 16 quant bytes."""
  return dequantize_blocks(GGML_Q4_1, raw)


def dequantize_q4_0(raw: Tensor) -> Tensor:
  """Q4_0 blocks as a (blocks, 18) uint8 tensor -> (blocks, 32) float32: d * (q - 8), with the f16 scale d and q
  the low nibbles (elements 0..15) then the high nibbles (elements 16..31) of the 16 quant bytes."""
  return dequantize_blocks(GGML_Q4_0, raw)


def dequantize_q6_k(raw: Tensor) -> Tensor:
  """Q6_K super-blocks as a (blocks, 210) uint8 tensor -> (blocks, 256) float32 (layout in the module docstring)."""
  return dequantize_blocks(GGML_Q6_K, raw)


QUANTIZED_TYPES = (GGML_Q8_0, GGML_Q4_0, GGML_Q4_1, GGML_Q6_K)


def quantize_q8_0(values: np.ndarray) -> np.ndarray:
  """Float values (their count a multiple of 32) -> Q8_0 blocks (count / 32, 34) uint8, as llama.cpp quantizes
  (quantize_row_q8_0_ref): per block of 32, d = max |x| / 127 stored as f16, q = round(x / d) with the float32 d."""
  blocks = np.asarray(values, np.float32).reshape(-1, 32)
  scale = np.abs(blocks).max(axis=1, keepdims=True) / 127
  inverse = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale != 0)
  out = np.empty((len(blocks), 34), np.uint8)
  out[:, 0:2] = scale.astype("<f2").view(np.uint8)
  # roundf rounds halves away from zero; numpy's round goes to even
  out[:, 2:34] = (np.sign(blocks * inverse) * np.floor(np.abs(blocks * inverse) + 0.5)).astype(np.int8).view(np.uint8)
  return out


# The 8-bit blocks an activation is quantized to for integer products (PackedTensor.integer_linear): 32 values each.
ACTIVATION_BLOCK = 32
# formats whose blocks have integer quants an 8-bit activation block multiplies exactly (PackedTensor.integer_linear)
INTEGER_PRODUCT_TYPES = (GGML_Q8_0, GGML_Q4_0, GGML_Q4_1)


def quantize_activation(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
  """x (rows, k) float, k a multiple of 32 -> its 8-bit blocks as llama.cpp quantizes the vector of a quantized
  product (quantize_row_q8_1): per block of 32 values d = max |x| / 127 and q = round(x / d) (halves away from zero)
  as int8 (rows, k / 32, 32), d as float32 (rows, k / 32, 1) (llama.cpp rounds it to f16; kept here), and d times the
  sum of q (rows, k / 32, 1) float32: the term a weight block's offset multiplies (Q4_1's minimum, Q4_0's -8 d).
  That term is the rounded x's, not x's own sum: a block's offset and its scaled quants then see the same x, whose
  rounding errors cancel where the weights are small (with x's exact sum SmolLM2's logits moved 3x further)."""
  if x.ndim != 2 or x.shape[1] % ACTIVATION_BLOCK:
    raise ShapeError(f"cannot quantize x of shape {x.shape} to blocks of {ACTIVATION_BLOCK}: expected (rows, k) with "
                     f"k a multiple of {ACTIVATION_BLOCK}")
  blocks = x.cast(dtypes.float32).reshape(x.shape[0], -1, ACTIVATION_BLOCK)
  scale = (blocks.abs().max(-1, keepdim=True) / 127).contiguous()
  scaled = blocks * (scale != 0).where(1 / scale, 0.0)
  # |scaled| <= 127 (plus rounding): the conversion truncates, so half away from zero is +-0.5 first
  quants = (scaled + (scaled < 0).where(-0.5, 0.5)).cast(dtypes.int32).cast(dtypes.int8).contiguous()
  offset = scale * quants.sum(-1, keepdim=True, dtype=dtypes.int32).cast(dtypes.float32)
  return quants, scale, offset.contiguous()


@dataclass(frozen=True)
class PackedTensor:
  """A block-quantized tensor kept in its stored precision on a device (`gguf_load(..., packed=True)`): the blocks'
  bytes (`blocks`, (n, block_bytes) uint8 as stored; on a GPU without their leading scale bytes, `quants_apart`)
  and their f16 scales decoded once (`scales`, (n, k): float16 on a GPU, exact and 2-4 bytes a block as in the
  file; float32 on a CPU, `scale_dtype`), both realized.
  `dequantize()` is the float32 tensor of `shape` as lazy ops on them, so the kernel that reads it (a matrix-vector
  product) loads the packed bytes and dequantizes them in registers: no float32 copy of the weight is ever stored
  (unless a kernel reads each value many times, as a prefill's matrix product does, when the scheduler stores the
  values once for that kernel)."""
  ggml_type: int
  shape: tuple[int, ...]
  blocks: Tensor
  scales: Tensor

  @staticmethod
  def from_blocks(ggml_type: int, blocks: Tensor, shape: tuple[int, ...]) -> "PackedTensor":
    """The tensor of `shape` stored as quantized blocks (n, block_bytes) uint8 of `ggml_type`, kept on their device."""
    blocks, dtype = blocks.contiguous().realize(), PackedTensor.scale_dtype(blocks.device)
    prefix = scale_prefix_bytes(ggml_type) if PackedTensor.quants_apart(blocks.device) else 0
    if _on_host(blocks.device):   # decoded with numpy: no kernel per tensor shape to compile at load
      stored = blocks.numpy()
      host = _host_block_scales(ggml_type, stored).astype(dtype.np)
      if prefix: blocks = Tensor(np.ascontiguousarray(stored[:, prefix:]), device=blocks.device).realize()
      return PackedTensor(ggml_type, tuple(shape), blocks, Tensor(host, device=blocks.device).realize())
    scales = block_scales(ggml_type, blocks).cast(dtype)
    if prefix: blocks = blocks[:, prefix:].contiguous()
    Tensor.realize_all(blocks, scales)
    return PackedTensor(ggml_type, tuple(shape), blocks, scales)

  @staticmethod
  def quants_apart(device: str) -> bool:
    """Whether the blocks are kept on `device` without their leading f16 scale bytes (`scale_prefix_bytes`; the
    scales are decoded apart anyway): on a GPU, whose products read each block's quants as vectors. A Q8_0 block of
    34 bytes put its 32 quants at addresses aligned to 2 bytes only (uchar2 loads, or single bytes); without the
    scale they start at a multiple of 32 (the same bytes in all). A CPU keeps the stored blocks (its integer
    products read them as llama.cpp lays them out)."""
    return bool(QUANTS_APART.value) and Device[device].renderer.runs_thread_blocks

  @staticmethod
  def scale_dtype(device: str) -> DType:
    """How the decoded block scales are kept on `device` (both exact): float16 where a product is bound by the bytes
    it reads (a GPU), float32 on a CPU, whose integer products are bound by instructions: a half's load and
    conversion are 2 of ~30 a Q4_1 block (SmolLM2's step, one core: the Q4_1 products 5.0 -> 4.4 ms, Q8_0 same)."""
    return dtypes.float16 if Device[device].renderer.runs_thread_blocks else dtypes.float32

  @property
  def device(self) -> str: return self.blocks.device

  @property
  def dtype(self) -> DType: return dtypes.float32

  @property
  def ndim(self) -> int: return len(self.shape)

  @property
  def type_name(self) -> str: return GGML_TYPE_NAMES[self.ggml_type]

  def dequantize(self) -> Tensor:
    """The values, float32 of `shape`, as lazy ops that fuse into the kernel reading them."""
    return dequantize_blocks(self.ggml_type, self.blocks, self.scales).reshape(self.shape)

  @property
  def row_blocks(self) -> tuple[int, ...]:
    """The last dim (a matrix row) as its blocks' values are laid out: (blocks per row, *BLOCK_VALUE_SHAPES)."""
    return (self.shape[-1] // _SUPPORTED_TYPES[self.ggml_type].block_size, *BLOCK_VALUE_SHAPES[self.ggml_type])

  def linear(self, x: Tensor, column_scale: Tensor | None = None) -> Tensor:
    """x @ (values * column_scale).T for this (n, k) matrix and x (..., k), computed block by block: x seen as
    (..., 1, *row_blocks) against the values (n, *row_blocks), reduced over the block axes. Each load of the packed
    bytes is then one view with unit strides inside a block (a row of blocks, the values of a block), where the
    (n, k) values index the bytes by k // block and k % block: the kernel's optimizer reads a block's bytes side by
    side (coalesced, a warp's threads along k) instead of treating k as a strided axis. `column_scale` (k,): a norm
    weight folded into the columns (in the kernel, beside the dequantization)."""
    if len(self.shape) != 2 or x.shape[-1] != self.shape[1]:
      raise ShapeError(f"cannot multiply x of shape {x.shape} by a packed matrix of shape {self.shape} transposed")
    layout = self.row_blocks
    values = block_values(self.ggml_type, self.blocks, self.scales).reshape(self.shape[0], *layout)
    if column_scale is not None: values = values * column_scale.reshape(1, *layout)
    rows = x.reshape(-1, 1, *layout)   # (rows, 1, *layout): the loop shape (rows, n, *layout) of a row kernel's norm
    return (rows * values).sum(tuple(range(2, 2 + len(layout)))).reshape(*x.shape[:-1], self.shape[0])

  def integer_linear(self, x: Tensor) -> Tensor:
    """x @ values.T for this (n, k) Q8_0, Q4_0 or Q4_1 matrix and x (..., k) as llama.cpp computes it on a CPU: x
    quantized to 8-bit blocks first (`quantize_activation`: its own small kernel), then per block of 32 the integer
    sum of quants times quants (int8 x int8, or a nibble x int8) times the two blocks' scales, plus the block's
    offset term (Q4_1: minimum x d_x x sum(q_x); Q4_0: -8 d x d_x x sum(q_x)). The product is one sum over (blocks,
    lanes) whose per-block factors the CPU row kernel takes out of the lanes' integer sums
    (codegen/integer_rows.py); x's rounding to 8 bits is the only change from `linear` (within the formats'
    quantization error). The offset term, one per block, is spread over its 16 byte lanes (a power of two: exact)."""
    if self.ggml_type not in INTEGER_PRODUCT_TYPES:
      raise ValueError(f"integer products take {', '.join(GGML_TYPE_NAMES[t] for t in INTEGER_PRODUCT_TYPES)} "
                       f"weights, not {self.type_name}")
    if len(self.shape) != 2 or x.shape[-1] != self.shape[1]:
      raise ShapeError(f"cannot multiply x of shape {x.shape} by a packed matrix of shape {self.shape} transposed")
    outputs, blocks = self.shape[0], self.shape[1] // ACTIVATION_BLOCK
    quants, scale, offset = quantize_activation(x.reshape(-1, self.shape[1]))
    rows = quants.shape[0]
    quants = quants.reshape(rows, 1, blocks, ACTIVATION_BLOCK).cast(dtypes.int32)
    scales = self._product_scales(32 if self.ggml_type == GGML_Q8_0 else 16)
    factor = scales[0] * scale.reshape(rows, 1, blocks, 1)
    shift = _quant_shift(self.ggml_type, self.blocks)
    if self.ggml_type == GGML_Q8_0:
      weights = self.blocks[:, 2 - shift:34 - shift].bitcast(dtypes.int8).reshape(1, outputs, blocks, 32)
      weights = weights.cast(dtypes.int32)
      return ((weights * quants).cast(dtypes.float32) * factor).sum((2, 3)).reshape(*x.shape[:-1], outputs)
    start = (4 if self.ggml_type == GGML_Q4_1 else 2) - shift
    packed = self.blocks[:, start:start + 16].reshape(1, outputs, blocks, 16)
    low, high = (packed & 0xF).cast(dtypes.int32), (packed >> 4).cast(dtypes.int32)
    products = low * quants[..., :16] + high * quants[..., 16:]
    offset = offset.reshape(rows, 1, blocks, 1)
    offset = offset * (scales[1] if self.ggml_type == GGML_Q4_1 else scales[0] * -8.0)
    terms = products.cast(dtypes.float32) * factor + offset * (1 / 16)
    return terms.sum((2, 3)).reshape(*x.shape[:-1], outputs)

  def _product_scales(self, lanes: int) -> list[Tensor]:
    """Each f16 scale of the blocks (d; Q4_1: d, then m) as float32 for integer_linear: (1, n, blocks per row, 1)
    from the decoded `scales`, or on a CPU with byte dot products (the C renderer's) (1, n, blocks, `lanes`) decoded
    in the product's kernel from the f16 bits inside the stored blocks (two byte loads the C compiler merges, a half
    conversion), so that the product streams the blocks alone: the float32 `scales` are a second stream of 8 bytes
    to each 20-byte Q4_1 block (4 to Q8_0's 34). SmolLM2's CPU decode step, A/B in one process (extra/bench/
    cpu_decode_ab.py, the Q4_1 products' C edited so): 0.913x the time on one thread, 0.884x on two. Decoded at each
    lane (views of the same two bytes), not broadcast to the lanes: the scheduler stores a graph of several ops read
    many times per element (its recompute rule: here a pass over every block's bytes of its own), where the CPU's
    integer row kernel computes factors that do not vary along the lanes once per block anyway. A half widens
    exactly: the values, and the logits' bits, are those of `scales`."""
    outputs, blocks = self.shape[0], self.shape[1] // ACTIVATION_BLOCK
    start, count = _SCALE_BYTES[self.ggml_type]
    if _quant_shift(self.ggml_type, self.blocks) or \
        not getattr(Device[self.device].renderer, "byte_dot_products", False):
      scales = self.scales.cast(dtypes.float32).reshape(1, outputs, blocks, count)
      return [scales[..., index:index + 1] for index in range(count)]

    def byte(at: int) -> Tensor:   # byte `at` of every block, at each lane of its product
      return self.blocks[:, at].reshape(1, outputs, blocks, 1).expand(1, outputs, blocks, lanes).cast(dtypes.uint16)
    return [(byte(start + 2 * index) | (byte(start + 2 * index + 1) << 8)).bitcast(dtypes.float16).cast(dtypes.float32)
            for index in range(count)]

  def take_rows(self, index: Tensor) -> Tensor:
    """`self.dequantize()[index]` for an integer tensor `index` (an embedding lookup), reading and dequantizing only
    the picked rows' blocks: index.shape + shape[1:] float32."""
    rows, rest = self.shape[0], self.shape[1:]
    blocks_per_row = math.prod(rest) // _SUPPORTED_TYPES[self.ggml_type].block_size
    picked = self.blocks.reshape(rows, -1)[index.reshape(-1)].reshape(-1, self.blocks.shape[1])
    scales = self.scales.reshape(rows, -1)[index.reshape(-1)].reshape(-1, self.scales.shape[1])
    assert picked.shape[0] == index.numel() * blocks_per_row
    return dequantize_blocks(self.ggml_type, picked, scales).reshape(*index.shape, *rest)

  @staticmethod
  def cat(parts: list["PackedTensor"]) -> "PackedTensor":
    """The tensors stacked along dim 0 (as Tensor.cat(..., dim=0) of their values), still packed: their blocks and
    scales concatenated. They must share the ggml type and the trailing dims (ShapeError otherwise)."""
    first = parts[0]
    for part in parts[1:]:
      if part.ggml_type != first.ggml_type or part.shape[1:] != first.shape[1:]:
        raise ShapeError(f"cannot stack a {part.type_name} tensor of shape {part.shape} under a {first.type_name} "
                         f"tensor of shape {first.shape}: the types and trailing dims must match")
    if _on_host(first.device):   # stacked with numpy: no kernel per stack shape to compile at load
      blocks, scales = (Tensor(np.concatenate([getattr(part, name).numpy() for part in parts]), device=first.device)
                        for name in ("blocks", "scales"))
    else:
      blocks = Tensor.cat([part.blocks for part in parts], dim=0).contiguous()
      scales = Tensor.cat([part.scales for part in parts], dim=0).contiguous()
    Tensor.realize_all(blocks, scales)
    return PackedTensor(first.ggml_type, (sum(part.shape[0] for part in parts), *first.shape[1:]), blocks, scales)


def _load_tensor(path: pathlib.Path, header: GGUFHeader, info: GGUFTensorInfo, device: str | None,
                 packed: bool) -> Tensor | PackedTensor:
  kind = _SUPPORTED_TYPES[info.ggml_type]
  offset = header.data_start + info.begin
  if kind.dtype is not None and _HOST_LITTLE_ENDIAN:
    tensor = disk_tensor(path, kind.dtype, info.shape, offset)
    return tensor if device is None else tensor.to(device)
  # quantized blocks (or, on a big-endian host, plain values): the raw bytes go to a compute device and are
  # decoded there by tensor ops
  blocks = math.prod(info.shape) // kind.block_size
  raw = disk_tensor(path, dtypes.uint8, (blocks, kind.block_bytes), offset).to(device or Device.DEFAULT)
  if info.ggml_type in QUANTIZED_TYPES:
    if packed: return PackedTensor.from_blocks(info.ggml_type, raw, info.shape)
    values = dequantize_blocks(info.ggml_type, raw)
  else:
    assert kind.dtype is not None
    values = _plain_values(raw, kind.dtype)
  return values.reshape(info.shape)


def gguf_load(path: PathLike, device: str | None = None,
              packed: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
  """Load a GGUF file (v2 or v3): returns (tensors by name in file order, metadata by key).

  Metadata values are Python objects: ints, floats, bools, strs, and lists for arrays (nested for arrays of
  arrays), e.g. metadata["tokenizer.ggml.tokens"] is the vocabulary as a list of str. Tensor shapes are row-major
  (the reverse of the dims the file lists).

  F32/F16/BF16 tensors keep their dtype and are, without `device`, windows of the memory-mapped file on the
  `DISK:<path>` device, read only when used (move them with `.to(...)` before computing). Q8_0, Q4_0, Q4_1 and
  Q6_K tensors are dequantized to float32 lazily on `device` (default: the default device): the dequantization is
  a kernel run at the first realize. With `device`, every tensor is on `device`.

  `packed=True` keeps the quantized tensors in their stored precision: they come back as `PackedTensor`s (their
  bytes copied to the device now), whose `dequantize()` fuses into the kernel that reads it (a matrix-vector product
  reads the packed bytes; no float32 copy of the weight is made).

  The header is validated against the file first: CheckpointError names the file and the problem (not a GGUF
  file, unsupported version, truncated or corrupt header, unsupported tensor type, tensor data out of range,
  misaligned or overlapping)."""
  path = pathlib.Path(path)
  header = gguf_read_header(path)
  if device is not None: device = Device.canonicalize(device)
  tensors = {info.name: _load_tensor(path, header, info, device, packed) for info in header.tensors}
  return tensors, header.metadata
