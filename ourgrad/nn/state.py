"""Model state: naming a model's tensors, loading them back, and reading/writing checkpoint files.

- `get_state_dict` / `get_parameters` walk an object tree (attributes, lists, tuples, dicts) and name every
  Tensor the way PyTorch does ("layers.0.weight").
- `load_state_dict` copies a name -> Tensor mapping into those tensors, reporting every missing, unexpected
  and wrongly shaped entry at once.
- `safe_save` / `safe_load` / `safe_load_metadata` write and read the safetensors format
  (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON header
  {name: {"dtype", "shape", "data_offsets"}, "__metadata__": {str: str}} padded with spaces to a multiple of 8
  bytes, then the raw little-endian tensor bytes. Saving is atomic (temporary file + rename) and loading
  validates the whole header against the file before any tensor is made. Loaded tensors are windows of the
  memory-mapped file on the `DISK:<path>` device (`disk_tensor`), read only when they are used.
- `torch_load` reads PyTorch's zip checkpoints (torch.save's default since 1.6) without importing torch, with
  an unpickler that only knows the handful of functions and classes a tensor checkpoint needs.

Every problem with a file raises `CheckpointError` naming the file; a state dict that does not fit a model
raises `StateDictError`. Both are ValueErrors.
"""
from __future__ import annotations

import io
import json
import math
import os
import pathlib
import pickle
import sys
import types
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from ourgrad.device import Device, write_atomic
from ourgrad.dtype import DType, dtypes
from ourgrad.errors import OurgradError
from ourgrad.lazy import LazyBuffer
from ourgrad.multi import MultiLazyBuffer, empty_like, is_assignable
from ourgrad.runtime.ops_disk import disk_buffer
from ourgrad.tensor import Tensor

PathLike = str | os.PathLike


class CheckpointError(OurgradError, ValueError):
  """A checkpoint file that cannot be read or written: truncated, corrupt, unsupported or unsafe."""


class StateDictError(OurgradError, ValueError):
  """A state dict that does not fit a model: missing keys, unexpected keys, or shapes that differ."""

  def __init__(self, message: str, missing_keys: list[str], unexpected_keys: list[str],
               shape_mismatches: list[tuple[str, tuple[int, ...], tuple[int, ...]]]):
    super().__init__(message)
    self.missing_keys, self.unexpected_keys, self.shape_mismatches = missing_keys, unexpected_keys, shape_mismatches


# ---------------------------------------------------------------- helpers shared by the file formats

def _little_endian(dt: DType) -> np.dtype:
  """The little-endian numpy dtype holding `dt`'s bytes (bfloat16 as its uint16 bit pattern)."""
  return np.dtype(np.uint16 if dt == dtypes.bfloat16 else dt.np).newbyteorder("<")


def _tensor_from_array(array: np.ndarray, dt: DType, device: str) -> Tensor:
  """A Tensor holding `array` (any byte order; bfloat16 as uint16 bits), copied into a new device buffer."""
  if array.size == 0:
    # nothing to copy; a realized empty buffer (LazyBuffer.from_numpy cannot take zero-size arrays)
    return Tensor(LazyBuffer.empty(tuple(array.shape), dt, device))
  if dt == dtypes.bool:
    array = array.view(np.uint8) != 0  # any nonzero byte is True; never hand numpy a bool byte other than 0/1
  elif array.dtype.byteorder == (">" if sys.byteorder == "little" else "<"):
    array = array.astype(array.dtype.newbyteorder("="))
  return Tensor(LazyBuffer.from_numpy(array, dt, device))


def _tensor_bytes(tensor: Tensor) -> bytes:
  """The tensor's values as contiguous little-endian bytes (bfloat16 as its exact uint16 bit patterns)."""
  values = tensor.numpy()
  if tensor.dtype == dtypes.bfloat16:
    # numpy() widens bfloat16 to float32 exactly (the bits are the top half), so the shift is lossless
    values = (np.ascontiguousarray(values, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
  return np.ascontiguousarray(values).astype(_little_endian(tensor.dtype), copy=False).tobytes()


def _join(prefix: str, name: str) -> str:
  return f"{prefix}.{name}" if prefix else name


# ---------------------------------------------------------------- naming a model's tensors

# objects whose attributes are code or type machinery, never model state
_OPAQUE_TYPES = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                 types.CodeType, types.FrameType, types.GeneratorType)


def named_items(obj: Any) -> list[tuple[str, Any]] | None:
  """(name, child) pairs of an object, list/tuple or dict, in order; None for leaves. An nn.Module names its own
  items (`_state_items`: PyTorch's state-dict order, non-persistent buffers left out)."""
  if callable(getattr(type(obj), "_state_items", None)) and not isinstance(obj, type): return obj._state_items()
  if isinstance(obj, dict): return [(str(key), value) for key, value in obj.items()]
  if isinstance(obj, (list, tuple)): return [(str(index), value) for index, value in enumerate(obj)]
  if isinstance(obj, (str, bytes, bytearray, int, float, complex, np.ndarray, np.generic) + _OPAQUE_TYPES):
    return None
  attributes: dict[str, Any] = {}
  instance_dict = getattr(obj, "__dict__", None)
  if isinstance(instance_dict, dict): attributes.update(instance_dict)
  for cls in type(obj).__mro__:  # objects with __slots__ keep their state outside __dict__
    slots = cls.__dict__.get("__slots__", ())
    for slot in (slots,) if isinstance(slots, str) else slots:
      if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot): attributes.setdefault(slot, getattr(obj, slot))
  return [(name, value) for name, value in attributes.items() if not name.startswith("_")]


def get_state_dict(obj: Any, prefix: str = "") -> dict[str, Tensor]:
  """Every Tensor reachable from `obj`, named by its path: attributes, list/tuple indices and dict keys, joined
  with dots like PyTorch ("layers.0.weight"). Private attributes (leading "_") are skipped.

  The walk uses an explicit stack (no recursion limit) and stops at reference cycles; a tensor or object that is
  reachable by several paths appears under each name, as in PyTorch (tied weights)."""
  state: dict[str, Tensor] = {}
  # (name, object, ids of the containers on the path to it): the path, not a global visited set, so that shared
  # sub-objects get every name while cycles still end
  stack: list[tuple[str, Any, frozenset[int]]] = [(prefix, obj, frozenset())]
  while stack:
    name, item, ancestors = stack.pop()
    if isinstance(item, Tensor):
      state[name] = item
      continue
    if id(item) in ancestors: continue
    children = named_items(item)
    if not children: continue
    path = ancestors | {id(item)}
    stack.extend((_join(name, child_name), child, path) for child_name, child in reversed(children))
  return state


def get_parameters(obj: Any) -> list[Tensor]:
  """The tensors of `get_state_dict(obj)`, each once (by identity), in state-dict order."""
  seen: set[int] = set()
  parameters: list[Tensor] = []
  for tensor in get_state_dict(obj).values():
    if id(tensor) not in seen:
      seen.add(id(tensor))
      parameters.append(tensor)
  return parameters


class LoadResult(NamedTuple):
  """What `load_state_dict(strict=False)` skipped."""
  missing_keys: list[str]
  unexpected_keys: list[str]


def _plural(count: int, word: str, plural: str = "") -> str:
  return f"{count} {word if count == 1 else plural or word + 's'}"


def load_state_dict(obj: Any, state_dict: dict[str, Tensor], strict: bool = True) -> LoadResult:
  """Copy `state_dict`'s tensors into the tensors of `obj` (named as by `get_state_dict`), casting to each
  target's dtype and moving to its device; all copies run in one realize.

  With `strict`, keys of the model missing from `state_dict` and keys of `state_dict` the model lacks raise
  StateDictError; a shape mismatch always raises (as in PyTorch). The error lists every problem at once, and
  nothing is loaded when it is raised. Returns the missing and unexpected keys."""
  targets = get_state_dict(obj)
  missing = [name for name in targets if name not in state_dict]
  unexpected = [name for name in state_dict if name not in targets]
  mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
  values: dict[str, Tensor] = {}
  for name, value in state_dict.items():
    if name not in targets: continue
    if isinstance(value, np.ndarray): value = Tensor(value)
    if not isinstance(value, Tensor):
      raise StateDictError(f"load_state_dict: the value for {name!r} is a {type(value).__name__}, not a Tensor",
                           [], [], [])
    if value.shape != targets[name].shape: mismatched.append((name, targets[name].shape, value.shape))
    values[name] = value
  if mismatched or (strict and (missing or unexpected)):
    problems = []
    if strict and missing: problems.append(f"{_plural(len(missing), 'missing key')}: {', '.join(missing)}")
    if strict and unexpected:
      problems.append(f"{_plural(len(unexpected), 'unexpected key')}: {', '.join(unexpected)}")
    if mismatched:
      problems.append(f"{_plural(len(mismatched), 'shape mismatch', 'shape mismatches')}: " + ", ".join(
        f"{name} (model expects {expected}, state dict has {got})" for name, expected, got in mismatched))
    hint = "" if mismatched else " (pass strict=False to load the matching keys only)"
    raise StateDictError(f"load_state_dict into {type(obj).__name__}: {'; '.join(problems)}{hint}",
                         missing if strict else [], unexpected if strict else [], mismatched)
  assigned: dict[int, Tensor] = {}
  for name, value in values.items():
    target = targets[name]
    if id(target) in assigned: continue  # a tied tensor: the first name wins
    lazy = target.lazydata
    # a sharded target takes the value cut as it is cut (a replicated one, copied whole to each device)
    value = value.shard(target.device, lazy.axis) if isinstance(lazy, MultiLazyBuffer) else value.to(target.device)
    value = value.cast(target.dtype)
    # the same test Tensor.assign makes to decide between writing into the buffer and replacing lazydata
    if not is_assignable(lazy):
      # a target without its own buffer (a constant, a view, an unrealized graph) would simply take the value's
      # buffer and alias the state dict's tensor: give it fresh memory so the assign below copies
      target.lazydata = empty_like(lazy)
    if target.numel(): target.assign(value)
    assigned[id(target)] = target
  Tensor.realize_all(*assigned.values())
  return LoadResult(missing, unexpected)


# ---------------------------------------------------------------- safetensors

_SAFETENSORS_DTYPES: dict[str, DType] = {
  "F32": dtypes.float32, "F16": dtypes.float16, "BF16": dtypes.bfloat16, "F64": dtypes.float64,
  "I8": dtypes.int8, "U8": dtypes.uint8, "I16": dtypes.int16, "U16": dtypes.uint16, "I32": dtypes.int32,
  "U32": dtypes.uint32, "I64": dtypes.int64, "U64": dtypes.uint64, "BOOL": dtypes.bool,
}
_SAFETENSORS_NAMES: dict[DType, str] = {dt: name for name, dt in _SAFETENSORS_DTYPES.items()}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit; a larger "header" is corruption


@dataclass(frozen=True)
class _TensorEntry:
  name: str
  dtype: DType
  shape: tuple[int, ...]
  begin: int  # byte offsets into the data section
  end: int


@dataclass(frozen=True)
class _SafetensorsHeader:
  entries: list[_TensorEntry]  # in file order
  metadata: dict[str, str]
  data_start: int  # absolute file offset of the data section
  data_size: int


def safe_save(state_dict: dict[str, Tensor], path: PathLike, metadata: dict[str, str] | None = None) -> None:
  """Write `state_dict` to `path` in the safetensors format, with optional string `metadata`.

  The file is written to a temporary file beside `path` and renamed over it, so `path` holds either the old
  checkpoint or the complete new one, never a partial write. Tensors are stored widest dtype first, so every
  tensor's data is aligned to its itemsize (the header is padded to 8 bytes)."""
  path = pathlib.Path(path)
  for name, tensor in state_dict.items():
    if not isinstance(name, str): raise CheckpointError(f"{path}: tensor names must be strings, got {name!r}")
    if name == "__metadata__": raise CheckpointError(f"{path}: '__metadata__' is reserved and cannot name a tensor")
    if not isinstance(tensor, Tensor):
      raise CheckpointError(f"{path}: {name!r} is a {type(tensor).__name__}, not a Tensor")
  if metadata is not None and not (isinstance(metadata, dict) and
                                   all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
    raise CheckpointError(f"{path}: safetensors metadata must be a dict of str to str, got {metadata!r}")
  # every value computed and made contiguous in one schedule, so the reads below only copy memory
  contiguous = {name: tensor.detach().contiguous() for name, tensor in state_dict.items()}
  Tensor.realize_all(*contiguous.values())
  header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
  chunks: list[bytes] = []
  offset = 0
  for name, tensor in sorted(contiguous.items(), key=lambda item: -item[1].dtype.itemsize):  # stable: keeps order
    data = _tensor_bytes(tensor)
    header[name] = {"dtype": _SAFETENSORS_NAMES[tensor.dtype], "shape": list(tensor.shape),
                    "data_offsets": [offset, offset + len(data)]}
    chunks.append(data)
    offset += len(data)
  header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
  header_bytes += b" " * (-len(header_bytes) % 8)
  write_atomic(path, b"".join([len(header_bytes).to_bytes(8, "little"), header_bytes, *chunks]))


def _parse_header_json(path: pathlib.Path, raw: bytes) -> dict[str, Any]:
  def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
      if key in result: raise CheckpointError(f"{path}: the safetensors header names {key!r} twice")
      result[key] = value
    return result
  try:
    header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
    raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({error}); the file is corrupt "
                          f"or not a safetensors file") from None
  if not isinstance(header, dict):
    raise CheckpointError(f"{path}: the safetensors header must be a JSON object, got {type(header).__name__}")
  return header


def _is_int(value: Any) -> bool: return isinstance(value, int) and not isinstance(value, bool)


def _parse_entry(path: pathlib.Path, name: str, info: Any, data_size: int) -> _TensorEntry:
  """One header entry, checked field by field against the data section."""
  where = f"{path}: tensor {name!r}"
  if not isinstance(info, dict): raise CheckpointError(f"{where}: header entry must be an object, got {info!r}")
  dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
  if dtype_name not in _SAFETENSORS_DTYPES:
    raise CheckpointError(f"{where}: unknown or unsupported dtype {dtype_name!r}; supported: "
                          f"{', '.join(_SAFETENSORS_DTYPES)}")
  if not isinstance(shape, list) or not all(_is_int(size) and size >= 0 for size in shape):
    raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
  if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(offset) for offset in offsets)):
    raise CheckpointError(f"{where}: data_offsets must be [begin, end] integers, got {offsets!r}")
  dt = _SAFETENSORS_DTYPES[dtype_name]
  begin, end = offsets
  if not 0 <= begin <= end <= data_size:
    raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] lie outside the data section of {data_size} "
                          f"bytes (truncated or corrupt file)")
  expected = math.prod(shape) * dt.itemsize
  if end - begin != expected:
    raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes but shape {shape} of "
                          f"{dtype_name} needs {expected}")
  return _TensorEntry(name, dt, tuple(shape), begin, end)


def _read_safetensors_header(path: PathLike) -> _SafetensorsHeader:
  """Read and validate the header of a safetensors file against the file's size; CheckpointError otherwise."""
  path = pathlib.Path(path)
  file_size = path.stat().st_size
  with open(path, "rb") as file:
    if file_size < 8:
      raise CheckpointError(f"{path}: the file has {file_size} bytes, fewer than the 8-byte header length of a "
                            f"safetensors file (truncated or not a safetensors file)")
    header_size = int.from_bytes(file.read(8), "little")
    if header_size > file_size - 8 or header_size > _MAX_HEADER_BYTES:
      raise CheckpointError(f"{path}: the header length says {header_size} bytes but the file has only "
                            f"{file_size - 8} bytes after it (truncated or not a safetensors file)")
    raw = file.read(header_size)
  if len(raw) != header_size: raise CheckpointError(f"{path}: the file shrank while it was read")
  header = _parse_header_json(path, raw)
  data_size = file_size - 8 - header_size
  metadata = header.pop("__metadata__", None) or {}
  if not (isinstance(metadata, dict) and all(isinstance(value, str) for value in metadata.values())):
    raise CheckpointError(f"{path}: __metadata__ must be an object of strings, got {metadata!r}")
  entries = [_parse_entry(path, name, info, data_size) for name, info in header.items()]
  # the tensors must tile the data section exactly: no overlaps, no gaps, nothing missing or extra at the end
  position, previous = 0, None
  for entry in sorted(entries, key=lambda entry: (entry.begin, entry.end)):
    if entry.begin < position:
      raise CheckpointError(f"{path}: tensors {previous!r} and {entry.name!r} overlap in the data section "
                            f"(byte {entry.begin} < {position})")
    if entry.begin > position:
      raise CheckpointError(f"{path}: bytes {position}..{entry.begin} of the data section belong to no tensor "
                            f"(corrupt header)")
    position, previous = entry.end, entry.name
  if position != data_size:
    raise CheckpointError(f"{path}: the data section has {data_size} bytes but the tensors cover {position} "
                          f"(truncated file or trailing garbage)")
  return _SafetensorsHeader(entries, metadata, 8 + header_size, data_size)


def safe_load_metadata(path: PathLike) -> dict[str, str]:
  """The "__metadata__" strings of a safetensors file ({} when it has none); the header is fully validated."""
  return dict(_read_safetensors_header(path).metadata)


def disk_tensor(path: PathLike, dtype: DType | str, shape: tuple[int, ...], offset: int = 0) -> Tensor:
  """A tensor of `shape` and `dtype` whose values are the bytes of file `path` from byte `offset`, in place: a
  window of the memory-mapped file on the `DISK:<path>` device. Nothing is read until it is copied (`.to(device)`,
  `.numpy()`), and then only its bytes (or, for a view, the bytes under the view). DISK tensors run no kernels:
  move them with `.to(...)` before computing. DeviceError if the file is missing or shorter than the window."""
  dtype = dtypes.as_dtype(dtype)
  shape = tuple(int(size) for size in shape)
  buffer = disk_buffer(f"DISK:{path}", int(offset), math.prod(shape), dtype)
  return Tensor(LazyBuffer.from_buffer(buffer, shape))


def _checked_bool(tensor: Tensor, device: str | None) -> Tensor:
  """A bool DISK tensor as it is when its bytes are all 0 or 1. Other bytes (which the format does not allow but
  some writers produce) read as True, so such a tensor is returned normalized, in memory on `device` (default: the
  default device), instead of as a window of the file. Reads the tensor's bytes (bool tensors are small masks)."""
  raw = tensor.numpy().view(np.uint8)
  if raw.size == 0 or int(raw.max()) <= 1: return tensor
  return Tensor(raw != 0, dtype=dtypes.bool, device=device or Device.DEFAULT)


def safe_load(path: PathLike, device: str | None = None) -> dict[str, Tensor]:
  """Load every tensor of a safetensors file, in file order, as windows of the memory-mapped file on the
  `DISK:<path>` device, or, with `device`, as copies on `device`.

  The header is validated against the file first (CheckpointError names the file and the problem); nothing else
  is read here. A DISK tensor is read when it is used (`.to(device)`, `.numpy()`, `load_state_dict`), and only its
  bytes, straight from the mapping into the device buffer; it runs no kernels, so move it with `.to(...)` before
  computing with it. With `device`, each tensor is `.to(device)` of its DISK tensor: still lazy, the copies run on
  the first realize. Bool tensors are checked now (see `_checked_bool`). On a big-endian host the little-endian
  data cannot be used in place: there every tensor is byte-swapped into memory on `device` (or the default)."""
  path = pathlib.Path(path)
  header = _read_safetensors_header(path)
  if sys.byteorder != "little": return _safe_load_swapped(path, header, device)
  tensors: dict[str, Tensor] = {}
  for entry in header.entries:
    tensor = disk_tensor(path, entry.dtype, entry.shape, header.data_start + entry.begin)
    if entry.dtype == dtypes.bool: tensor = _checked_bool(tensor, device)
    tensors[entry.name] = tensor if device is None else tensor.to(device)
  return tensors


def _safe_load_swapped(path: pathlib.Path, header: _SafetensorsHeader, device: str | None) -> dict[str, Tensor]:
  """safe_load for big-endian hosts: each tensor's bytes read through np.memmap and converted to native order."""
  device = Device.canonicalize(device or Device.DEFAULT)
  data = np.memmap(path, dtype=np.uint8, mode="r", offset=header.data_start, shape=(header.data_size,)) \
    if header.data_size else np.zeros(0, dtype=np.uint8)  # mmap cannot map zero bytes
  try:
    return {entry.name: _tensor_from_array(data[entry.begin:entry.end].view(_little_endian(entry.dtype))
                                           .reshape(entry.shape), entry.dtype, device)
            for entry in header.entries}
  finally:
    del data  # unmap now; the tensors hold copies


# ---------------------------------------------------------------- PyTorch checkpoints

_TORCH_STORAGES: dict[str, DType] = {
  "FloatStorage": dtypes.float32, "DoubleStorage": dtypes.float64, "HalfStorage": dtypes.float16,
  "BFloat16Storage": dtypes.bfloat16, "LongStorage": dtypes.int64, "IntStorage": dtypes.int32,
  "ShortStorage": dtypes.int16, "CharStorage": dtypes.int8, "ByteStorage": dtypes.uint8, "BoolStorage": dtypes.bool,
}
_TORCH_DTYPES: dict[str, DType] = {
  "float32": dtypes.float32, "float": dtypes.float32, "float64": dtypes.float64, "double": dtypes.float64,
  "float16": dtypes.float16, "half": dtypes.float16, "bfloat16": dtypes.bfloat16, "int64": dtypes.int64,
  "long": dtypes.int64, "int32": dtypes.int32, "int": dtypes.int32, "int16": dtypes.int16, "short": dtypes.int16,
  "int8": dtypes.int8, "uint8": dtypes.uint8, "uint16": dtypes.uint16, "uint32": dtypes.uint32,
  "uint64": dtypes.uint64, "bool": dtypes.bool,
}


@dataclass(frozen=True)
class _StorageType:
  """What `torch.FloatStorage` (dtype float32) or `torch.storage.UntypedStorage` (dtype None: bytes) unpickle to.
  Not callable, so a pickle cannot use it as a constructor."""
  name: str
  dtype: DType | None


@dataclass(frozen=True)
class _TorchDType:
  """What `torch.float16` and friends unpickle to (the dtype argument of _rebuild_tensor_v3)."""
  dtype: DType


@dataclass
class _Storage:
  """A storage of the checkpoint: `numel` elements of `dtype` (None: bytes) in the archive's data/<key> file."""
  key: str
  dtype: DType | None
  numel: int
  data: bytes | None = None  # read on first use

  @property
  def nbytes(self) -> int: return self.numel * (self.dtype.itemsize if self.dtype is not None else 1)


class _TorchUnpickler(pickle.Unpickler):
  """An unpickler that knows only what a tensor checkpoint needs and refuses every other global."""

  def __init__(self, file: io.BytesIO, path: pathlib.Path, read_storage: Callable[[_Storage], bytes],
               big_endian: bool, device: str):
    super().__init__(file)
    self.path, self.read_storage, self.big_endian, self.device = path, read_storage, big_endian, device
    self.storages: dict[str, _Storage] = {}
    self.allowed: dict[tuple[str, str], Any] = {
      ("torch._utils", "_rebuild_tensor_v2"): self.rebuild_tensor_v2,
      ("torch._utils", "_rebuild_tensor_v3"): self.rebuild_tensor_v3,
      ("torch._utils", "_rebuild_parameter"): self.rebuild_parameter,
      ("torch._utils", "_rebuild_parameter_with_state"): self.rebuild_parameter,
      ("collections", "OrderedDict"): OrderedDict,
      ("torch.storage", "UntypedStorage"): _StorageType("UntypedStorage", None),
      ("torch", "UntypedStorage"): _StorageType("UntypedStorage", None),
      **{("torch", name): _StorageType(name, dt) for name, dt in _TORCH_STORAGES.items()},
      **{("torch", name): _TorchDType(dt) for name, dt in _TORCH_DTYPES.items()},
    }

  def error(self, message: str) -> CheckpointError: return CheckpointError(f"{self.path}: {message}")

  def find_class(self, module: str, name: str) -> Any:
    found = self.allowed.get((module, name))
    if found is None:
      raise self.error(f"the checkpoint references {module}.{name}, which a tensor checkpoint does not need; "
                       f"refusing to load it (pickles can run arbitrary code). Only state dicts of tensors are "
                       f"supported (save model.state_dict(), not the model)")
    return found

  def persistent_load(self, pid: Any) -> _Storage:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
      raise self.error(f"unsupported persistent id {str(pid)[:100]!r}")
    _, storage_type, key, _location, numel = pid
    if not isinstance(storage_type, _StorageType):
      raise self.error(f"persistent id names {storage_type!r}, not a storage class")
    if not isinstance(key, str) or not _is_int(numel) or numel < 0:
      raise self.error(f"malformed storage reference {str(pid)[:100]!r}")
    if key in self.storages:  # several tensors share this storage
      storage = self.storages[key]
      if (storage.dtype, storage.numel) != (storage_type.dtype, numel):
        raise self.error(f"storage {key!r} is referenced with two different types or sizes")
      return storage
    storage = self.storages[key] = _Storage(key, storage_type.dtype, numel)
    return storage

  def rebuild_tensor_v2(self, storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                        backward_hooks: Any = None, metadata: Any = None) -> Tensor:
    if not isinstance(storage, _Storage): raise self.error(f"_rebuild_tensor_v2 got {type(storage).__name__}")
    return self.make_tensor(storage, storage.dtype or dtypes.uint8, storage_offset, size, stride)

  def rebuild_tensor_v3(self, storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any,
                        backward_hooks: Any, dtype: Any, metadata: Any = None) -> Tensor:
    if not isinstance(storage, _Storage): raise self.error(f"_rebuild_tensor_v3 got {type(storage).__name__}")
    if not isinstance(dtype, _TorchDType): raise self.error(f"_rebuild_tensor_v3: unsupported dtype {dtype!r}")
    if storage.dtype is not None and storage.dtype != dtype.dtype:
      raise self.error(f"_rebuild_tensor_v3: a {storage.dtype} storage read as {dtype.dtype}")
    return self.make_tensor(storage, dtype.dtype, storage_offset, size, stride)

  def rebuild_parameter(self, data: Any, requires_grad: Any, backward_hooks: Any, state: Any = None) -> Tensor:
    if not isinstance(data, Tensor): raise self.error(f"_rebuild_parameter got {type(data).__name__}")
    return data

  def make_tensor(self, storage: _Storage, dt: DType, offset: Any, size: Any, stride: Any) -> Tensor:
    """A tensor viewing `storage` at element `offset` with `size`/`stride`, bounds-checked, then copied."""
    if not (_is_int(offset) and offset >= 0 and isinstance(size, tuple) and isinstance(stride, tuple)
            and len(size) == len(stride) and all(_is_int(x) and x >= 0 for x in size + stride)):
      raise self.error(f"tensor in storage {storage.key!r} has a malformed view: offset {offset!r}, size {size!r}, "
                       f"stride {stride!r}")
    element = _little_endian(dt).newbyteorder(">" if self.big_endian else "<")
    raw = self.read_storage(storage)
    if len(raw) % element.itemsize:
      raise self.error(f"storage {storage.key!r} has {len(raw)} bytes, not a whole number of {dt} elements")
    flat = np.frombuffer(raw, dtype=element)
    if math.prod(size) == 0: return _tensor_from_array(np.zeros(size, dtype=flat.dtype), dt, self.device)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if last >= flat.size:  # as_strided does not check bounds: this check keeps it inside the storage
      raise self.error(f"tensor in storage {storage.key!r} (offset {offset}, size {size}, stride {stride}) reaches "
                       f"element {last} but the storage has {flat.size}")
    view = np.lib.stride_tricks.as_strided(flat[offset:], shape=size, strides=[s * flat.itemsize for s in stride],
                                           writeable=False)
    return _tensor_from_array(view.copy(), dt, self.device)  # copy(), not ascontiguousarray: keeps 0-d


def _find_data_pkl(path: pathlib.Path, names: list[str]) -> str:
  """The archive's data.pkl: "<folder>/data.pkl", where the folder is named after the saved file."""
  candidates = [name for name in names if name.endswith("/data.pkl") and name.count("/") == 1]
  if len(candidates) != 1:
    found = "none" if not candidates else ", ".join(candidates)
    raise CheckpointError(f"{path}: expected one <folder>/data.pkl in the zip archive, found {found}; "
                          f"not a torch.save checkpoint")
  return candidates[0]


def torch_load(path: PathLike, device: str | None = None) -> dict[str, Tensor]:
  """Load a PyTorch checkpoint (`torch.save`'s zip format) without importing torch.

  Tensors of nested dicts/lists are named with dots, like `get_state_dict` ({"model": {"w": t}} gives "model.w");
  other values (epoch numbers, ...) are dropped. Only the functions and classes a tensor checkpoint needs are
  unpickled: anything else (a pickled nn.Module, os.system, ...) raises CheckpointError without running.
  The legacy pre-1.6 (non-zip) format is not supported."""
  path = pathlib.Path(path)
  device = Device.canonicalize(device or Device.DEFAULT)
  if not zipfile.is_zipfile(path):
    with open(path, "rb") as file: start = file.read(2)
    if start[:1] == b"\x80":
      raise CheckpointError(f"{path}: legacy (pre-1.6, non-zip) torch.save format is not supported; re-save it with "
                            f"torch.save(torch.load(path), path) using a recent PyTorch")
    raise CheckpointError(f"{path}: not a PyTorch checkpoint (not a zip archive)")
  try:
    with zipfile.ZipFile(path) as archive:
      data_pkl = _find_data_pkl(path, archive.namelist())
      folder = data_pkl[:-len("data.pkl")]
      names = set(archive.namelist())
      byteorder = archive.read(folder + "byteorder").decode().strip() if folder + "byteorder" in names else "little"
      if byteorder not in ("little", "big"): raise CheckpointError(f"{path}: unknown byteorder {byteorder!r}")

      def read_storage(storage: _Storage) -> bytes:
        if storage.data is None:
          member = f"{folder}data/{storage.key}"
          if member not in names: raise CheckpointError(f"{path}: storage {member} is missing from the archive")
          storage.data = archive.read(member)
          if len(storage.data) != storage.nbytes:
            raise CheckpointError(f"{path}: storage {member} has {len(storage.data)} bytes, expected "
                                  f"{storage.nbytes} ({storage.numel} elements of {storage.dtype or 'bytes'})")
        return storage.data

      unpickler = _TorchUnpickler(io.BytesIO(archive.read(data_pkl)), path, read_storage, byteorder == "big", device)
      try:
        result = unpickler.load()
      except CheckpointError:
        raise
      except (pickle.UnpicklingError, EOFError, TypeError, ValueError, KeyError, IndexError, AttributeError,
              RecursionError) as error:
        raise CheckpointError(f"{path}: {data_pkl} is not a valid checkpoint pickle: "
                              f"{type(error).__name__}: {error}") from None
  except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError) as error:
    raise CheckpointError(f"{path}: corrupt zip archive: {error}") from None
  return get_state_dict(result)
