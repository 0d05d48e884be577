"""PyTorch habits against PyTorch itself: modules start in training mode, no_grad results, printing, conversions,
`to()`, RuntimeError-compatible errors, the `ourgrad.*` namespace, save/load, parameter groups, lr schedulers,
gradient clipping, nn.init and the DataLoader; and test/pytorch_habit_script.py run unchanged (imports renamed)
with both libraries, its losses matching to 1e-5.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

import ourgrad
from ourgrad import Tensor, dtypes, nn
from ourgrad.errors import ShapeError
from ourgrad.nn.state import CheckpointError

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _random(shape: tuple[int, ...], seed: int) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------- the habit script, with both libraries

def _renamed_imports(source: str) -> str:
  """The script with `import torch` -> `import ourgrad as torch` (and torch.nn, torch.nn.functional likewise)."""
  renames = {"import torch": "import ourgrad as torch", "import torch.nn as nn": "import ourgrad.nn as nn",
             "import torch.nn.functional as F": "import ourgrad.nn.functional as F"}
  return "\n".join(renames.get(line, line) for line in source.splitlines()) + "\n"


def _run_script(path: pathlib.Path, out: pathlib.Path, init: pathlib.Path) -> dict:
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  subprocess.run([sys.executable, str(path), str(out), str(init)], check=True, env=env, cwd=path.parent,
                 capture_output=True, timeout=600)
  return json.loads(out.read_text())


@pytest.mark.slow  # two processes, each importing its library and compiling the step: 20-30 s
def test_pytorch_habit_script_matches_pytorch(tmp_path: pathlib.Path) -> None:
  source = (ROOT / "test" / "pytorch_habit_script.py").read_text()
  ours_source = _renamed_imports(source)
  changed = [(a, b) for a, b in zip(source.splitlines(), ours_source.splitlines()) if a != b]
  assert len(changed) == 3 and all(a.startswith("import torch") for a, _ in changed)  # only the imports differ
  (tmp_path / "theirs.py").write_text(source)
  (tmp_path / "ours.py").write_text(ours_source)
  init = tmp_path / "init.pt"  # PyTorch's initial weights, a pickled checkpoint, which the ourgrad run reads
  theirs = _run_script(tmp_path / "theirs.py", tmp_path / "theirs.json", init)
  ours = _run_script(tmp_path / "ours.py", tmp_path / "ours.json", init)
  assert len(ours["losses"]) == len(theirs["losses"]) == 20
  np.testing.assert_allclose(ours["losses"], theirs["losses"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ours["norms"], theirs["norms"], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(ours["lrs"], theirs["lrs"], rtol=1e-6)
  np.testing.assert_allclose(ours["running_mean"], theirs["running_mean"], rtol=1e-4, atol=1e-5)
  assert ours["accuracy"] == pytest.approx(theirs["accuracy"])
  assert ours["no_grad_flag"] is theirs["no_grad_flag"] is False
  # the reloaded model's logits are fused into the subtraction: another kernel than the one that computed `logits`,
  # so float sums may round differently (torch runs the same kernels twice: exactly 0)
  assert theirs["reloaded_max_diff"] == 0.0 and ours["reloaded_max_diff"] <= 1e-6
  assert ours["printed"] == theirs["printed"]


# ---------------------------------------------------------------- training mode by default

def test_modules_start_in_training_mode_like_pytorch() -> None:
  ours, theirs = nn.BatchNorm2d(3), torch.nn.BatchNorm2d(3)
  assert ours.training is theirs.training is True
  x = _random((4, 3, 5, 5), 0)
  ours(Tensor(x)), theirs(torch.tensor(x))
  np.testing.assert_allclose(ours.running_mean.numpy(), theirs.running_mean.numpy(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(ours.running_var.numpy(), theirs.running_var.numpy(), rtol=1e-5, atol=1e-6)
  dropout = nn.Dropout(0.5)
  assert dropout.training and (dropout(Tensor.ones(64, 64)).numpy() == 0).any()
  dropout.eval()
  assert (dropout(Tensor.ones(64, 64)).numpy() == 1).all()
  with Tensor.train(False):  # tinygrad's global flag still wins for a module never given train()/eval()
    assert not nn.Dropout(0.5).training


# ---------------------------------------------------------------- no_grad

def test_no_grad_results_do_not_require_grad_and_backward_raises_like_pytorch() -> None:
  ours, theirs = Tensor([1.0, 2.0], requires_grad=True), torch.tensor([1.0, 2.0], requires_grad=True)
  with ourgrad.no_grad(): ours_out = (ours * 2).sum()
  with torch.no_grad(): theirs_out = (theirs * 2).sum()
  assert ours_out.requires_grad is theirs_out.requires_grad is False
  with pytest.raises(RuntimeError, match="element 0 of tensors does not require grad") as theirs_error:
    theirs_out.backward()
  with pytest.raises(RuntimeError, match="element 0 of tensors does not require grad") as ours_error:
    ours_out.backward()
  assert str(ours_error.value).startswith(str(theirs_error.value)[:60])
  with ourgrad.inference_mode():
    with ourgrad.enable_grad(): assert (ours * 2).requires_grad
    assert not (ours * 2).requires_grad and not ourgrad.is_grad_enabled()
  with ourgrad.set_grad_enabled(False): assert not (ours * 2).requires_grad
  assert (ours * 2).requires_grad


# ---------------------------------------------------------------- printing

PRINTED = [[[1.0, 2.0], [3.0, 4.0]], [1.5, -2.0, 3.25], [1e-5, 1.0], [1.0, 2000.0], [1.0, 2e9], [float("nan"), 1.0],
           [float("inf"), -2.25], [[1, 2], [3, 4]], [True, False], 3.0, 3.25, -0.5,
           np.arange(2000, dtype=np.float32), _random((40, 50), 1), _random((3, 40, 50), 2), np.zeros((0,), np.float32)]


@pytest.mark.parametrize("values", PRINTED, ids=range(len(PRINTED)))
def test_repr_matches_pytorch(values) -> None:
  theirs = torch.tensor(values)  # integers: int64 there, int32 here; each library's default, printed without suffix
  assert repr(Tensor(values)) == repr(theirs)
  assert str(Tensor(values)) == str(theirs)


def test_repr_suffixes() -> None:
  x = Tensor([1.0, 2.0], requires_grad=True)
  assert repr(x) == repr(torch.tensor([1.0, 2.0], requires_grad=True))
  assert repr(x * 2).endswith("grad_fn=<MulBackward>)")
  assert repr(Tensor([1.0, 2.0], dtype=dtypes.float16)) == "tensor([1., 2.], dtype=dtypes.float16)"
  assert repr(Tensor.zeros(2, 0)) == repr(torch.zeros(2, 0))
  assert f"{Tensor(2.5):.3f}" == f"{torch.tensor(2.5):.3f}"


# ---------------------------------------------------------------- conversions and to()

def test_python_number_conversions_like_pytorch() -> None:
  for ours, theirs in [(Tensor([2.5]), torch.tensor([2.5])), (Tensor(3), torch.tensor(3)),
                       (Tensor([[0.0]]), torch.tensor([[0.0]]))]:
    assert float(ours) == float(theirs) and int(ours) == int(theirs) and bool(ours) == bool(theirs)
  assert [10, 11, 12][Tensor(2)] == [10, 11, 12][torch.tensor(2)]
  for convert in (float, int, bool):  # PyTorch raises ValueError for float/int and RuntimeError for bool: ours is both
    with pytest.raises((ValueError, RuntimeError)): convert(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="2 elements") as error: convert(Tensor([1.0, 2.0]))
    assert isinstance(error.value, RuntimeError)
  with pytest.raises(TypeError): [1, 2][torch.tensor(1.0)]
  with pytest.raises(TypeError, match="integer"): [1, 2][Tensor(1.0)]


def test_to_forms_and_type_cpu() -> None:
  x = Tensor([1.5, -2.5])
  assert x.to(dtypes.float16).dtype == dtypes.float16
  assert x.to("CPU", dtypes.int32).tolist() == torch.tensor([1.5, -2.5]).to("cpu", torch.int32).tolist()
  assert x.to(dtype=dtypes.int64).dtype == dtypes.int64
  assert x.to(device="CPU").device == "CLANG" and x.cpu().device == "CLANG"
  assert x.to(Tensor([1], dtype=dtypes.int16)).dtype == dtypes.int16
  assert x.to("CPU", non_blocking=True) is x  # nothing changes: the same tensor, as PyTorch
  assert x.type(dtypes.int32).tolist() == torch.tensor([1.5, -2.5]).type(torch.int32).tolist()
  assert x.type() == "float32"
  with pytest.raises(TypeError): x.to(3.5)


def test_shape_errors_are_runtime_errors_like_pytorch() -> None:
  with pytest.raises(RuntimeError): torch.ones(2, 3) + torch.ones(4, 3)
  with pytest.raises(RuntimeError): Tensor.ones(2, 3) + Tensor.ones(4, 3)
  with pytest.raises(RuntimeError): torch.ones(2, 3) @ torch.ones(4, 3)
  with pytest.raises(RuntimeError): Tensor.ones(2, 3) @ Tensor.ones(4, 3)
  with pytest.raises(ValueError): Tensor.ones(2, 3).reshape(5)  # the built-in base stays
  assert issubclass(ShapeError, RuntimeError) and issubclass(ShapeError, ValueError)


# ---------------------------------------------------------------- the namespace

def test_namespace_names_are_aliases_of_the_one_implementation() -> None:
  # (the constructors are classmethods: each lookup binds anew, so compare the functions bound)
  assert ourgrad.zeros.__func__ is Tensor.zeros.__func__ and ourgrad.cat is Tensor.cat
  assert ourgrad.manual_seed.__func__ is Tensor.manual_seed.__func__
  assert ourgrad.float32 is dtypes.float32 and ourgrad.long is dtypes.int64
  assert ourgrad.no_grad is ourgrad.tensor.no_grad  # ourgrad.tensor: callable, and still the submodule
  assert ourgrad.optim.AdamW is nn.optim.AdamW and ourgrad.nn.functional.relu is Tensor.relu
  pairs = [(ourgrad.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0, 2.0], [3.0, 4.0]]))]
  pairs += [(ourgrad.cat([ourgrad.ones(2), ourgrad.zeros(3)]), torch.cat([torch.ones(2), torch.zeros(3)])),
            (ourgrad.stack([ourgrad.arange(3), ourgrad.arange(3)], dim=1), torch.stack([torch.arange(3)] * 2, dim=1)),
            (ourgrad.argmax(ourgrad.tensor([[1, 5], [7, 2]]), dim=1), torch.argmax(torch.tensor([[1, 5], [7, 2]]), 1)),
            (ourgrad.flatten(ourgrad.ones(2, 3, 4), 1), torch.flatten(torch.ones(2, 3, 4), 1)),
            (ourgrad.where(ourgrad.tensor([True, False]), ourgrad.ones(2), ourgrad.zeros(2)),
             torch.where(torch.tensor([True, False]), torch.ones(2), torch.zeros(2))),
            (ourgrad.full((2, 2), 7.0), torch.full((2, 2), 7.0)), (ourgrad.zeros_like(ourgrad.ones(3)), torch.zeros(3)),
            (ourgrad.from_numpy(np.arange(4.0)), torch.from_numpy(np.arange(4.0)))]
  for ours, theirs in pairs:
    np.testing.assert_array_equal(ours.numpy(), theirs.numpy())
  assert ourgrad.empty_like(ourgrad.ones(2, 3)).shape == (2, 3)
  assert ourgrad.tensor([1.0], requires_grad=True).requires_grad and ourgrad.is_tensor(ourgrad.ones(1))


def test_cuda_namespace() -> None:
  from ourgrad.device import Device
  from ourgrad.errors import DeviceError
  try:
    Device["CUDA"]
    opens = True
  except (DeviceError, ImportError, OSError):
    opens = False
  assert ourgrad.cuda.is_available() is opens
  device = "cuda" if ourgrad.cuda.is_available() else "cpu"  # PyTorch's idiom
  assert Tensor([1.0]).to(device).device == ("CUDA" if opens else "CLANG")


def test_missing_pytorch_name_says_so_and_suggests() -> None:
  with pytest.raises(AttributeError, match="ourgrad does not provide PyTorch's torch.sigmoidd.*nearest.*sigmoid"):
    ourgrad.sigmoidd
  with pytest.raises(AttributeError, match="view_as_real"): ourgrad.view_as_real
  assert not hasattr(ourgrad, "__wrapped__")


def test_save_load_round_trip_and_torch_checkpoints(tmp_path: pathlib.Path) -> None:
  layer = nn.Linear(3, 2)
  ourgrad.save(layer.state_dict(), tmp_path / "layer.safetensors")
  loaded = ourgrad.load(tmp_path / "layer.safetensors")
  for name, tensor in layer.state_dict().items(): np.testing.assert_array_equal(loaded[name].numpy(), tensor.numpy())
  ourgrad.save(Tensor([1.0, 2.0]), tmp_path / "one")
  assert ourgrad.load(tmp_path / "one").tolist() == [1.0, 2.0]
  theirs = torch.nn.Linear(3, 2)
  torch.save(theirs.state_dict(), tmp_path / "theirs.pt")
  layer.load_state_dict(ourgrad.load(tmp_path / "theirs.pt", map_location="cpu"))
  np.testing.assert_array_equal(layer.weight.numpy(), theirs.weight.detach().numpy())
  with pytest.raises(TypeError, match="safetensors"): ourgrad.save({"a": [1, 2]}, tmp_path / "bad")
  (tmp_path / "junk").write_bytes(b"neither safetensors nor a zip archive")
  with pytest.raises(CheckpointError, match="not a PyTorch checkpoint"): ourgrad.load(tmp_path / "junk")


# ---------------------------------------------------------------- parameter groups

@pytest.mark.parametrize("name, kwargs, groups", [
  ("SGD", {"lr": 0.1, "momentum": 0.9}, [{"weight_decay": 0.1}, {"lr": 0.01, "nesterov": True}]),
  ("Adam", {"lr": 0.05}, [{"betas": (0.8, 0.99)}, {"lr": 0.01, "weight_decay": 0.1}]),
  ("AdamW", {"lr": 0.05, "weight_decay": 0.02}, [{"weight_decay": 0.0}, {"lr": 0.01, "eps": 1e-6}]),
])
def test_param_groups_step_like_pytorch(name: str, kwargs: dict, groups: list[dict]) -> None:
  values = [_random((3, 4), 1), _random((4,), 2), _random((5,), 3)]
  ours = [Tensor(value, requires_grad=True) for value in values]
  theirs = [torch.tensor(value, requires_grad=True) for value in values]
  ours_opt = getattr(ourgrad.optim, name)([{"params": ours[:2], **groups[0]}, {"params": ours[2:], **groups[1]}],
                                          **kwargs)
  theirs_opt = getattr(torch.optim, name)([{"params": theirs[:2], **groups[0]}, {"params": theirs[2:], **groups[1]}],
                                          **kwargs)
  for ours_group, theirs_group in zip(ours_opt.param_groups, theirs_opt.param_groups):
    for key, value in ours_group.items():
      if key != "params": assert value == theirs_group[key], key
  for step in range(4):
    for params, opt, lib in ((ours, ours_opt, None), (theirs, theirs_opt, torch)):
      opt.zero_grad()
      loss = sum(((param * param * param).sum() if lib is None else (param ** 3).sum()) for param in params)
      loss.backward()
      opt.step()
      opt.param_groups[1]["lr"] = 0.02 * (step + 1)  # a manual schedule on one group
  for ours_param, theirs_param in zip(ours, theirs):
    np.testing.assert_allclose(ours_param.numpy(), theirs_param.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_param_groups_errors() -> None:
  x = Tensor.ones(2, requires_grad=True)
  with pytest.raises(ValueError, match="more than one"): ourgrad.optim.SGD([{"params": [x]}, {"params": [x]}])
  with pytest.raises(TypeError, match="unknown options"): ourgrad.optim.SGD([{"params": [x], "betas": (0.9, 0.9)}])
  with pytest.raises(TypeError): ourgrad.optim.SGD([{"params": [x]}, x])
  import inspect
  assert list(inspect.signature(ourgrad.optim.AdamW).parameters)[:3] == ["params", "lr", "betas"]


# ---------------------------------------------------------------- lr schedulers

SCHEDULERS = [("StepLR", {"step_size": 3, "gamma": 0.5}), ("MultiStepLR", {"milestones": [2, 5]}),
              ("ExponentialLR", {"gamma": 0.9}), ("CosineAnnealingLR", {"T_max": 7, "eta_min": 0.01}),
              ("LinearLR", {"start_factor": 0.1, "total_iters": 4}), ("LambdaLR", {"lr_lambda": lambda e: 1 / (e + 1)}),
              ("OneCycleLR", {"max_lr": 2.0, "total_steps": 12}),
              ("OneCycleLR", {"max_lr": [2.0, 1.0], "total_steps": 12, "three_phase": True,
                              "anneal_strategy": "linear"})]


@pytest.mark.parametrize("name, kwargs", SCHEDULERS, ids=[f"{name}{i}" for i, (name, _) in enumerate(SCHEDULERS)])
def test_lr_schedulers_like_pytorch(name: str, kwargs: dict) -> None:
  ours_opt = ourgrad.optim.AdamW([{"params": [Tensor.zeros(2, requires_grad=True)]},
                                  {"params": [Tensor.zeros(2, requires_grad=True)], "lr": 0.5}], lr=1.0)
  theirs_opt = torch.optim.AdamW([{"params": [torch.zeros(2, requires_grad=True)]},
                                  {"params": [torch.zeros(2, requires_grad=True)], "lr": 0.5}], lr=1.0)
  ours = getattr(ourgrad.optim.lr_scheduler, name)(ours_opt, **kwargs)
  theirs = getattr(torch.optim.lr_scheduler, name)(theirs_opt, **kwargs)
  for _ in range(11):
    for ours_group, theirs_group in zip(ours_opt.param_groups, theirs_opt.param_groups):
      assert ours_group["lr"] == pytest.approx(theirs_group["lr"], rel=1e-12, abs=1e-15)
    assert ours_opt.param_groups[1]["lr"] == pytest.approx(ours_opt._group_optimizers[1].lr, rel=1e-6)  # the buffer
    theirs_opt.step()
    theirs.step()
    ours.step()
    assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), rel=1e-12, abs=1e-15)


def test_sequential_warmup_then_cosine_like_pytorch() -> None:
  def build(lib, params):
    opt = lib.optim.SGD(params, lr=1.0)
    warmup = lib.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=3)
    cosine = lib.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
    return opt, lib.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[3])
  ours_opt, ours = build(ourgrad, [Tensor.zeros(1, requires_grad=True)])
  theirs_opt, theirs = build(torch, [torch.zeros(1, requires_grad=True)])
  for _ in range(9):
    assert ours_opt.param_groups[0]["lr"] == pytest.approx(theirs_opt.param_groups[0]["lr"], abs=1e-12)
    theirs_opt.step()
    theirs.step()
    ours.step()


# ---------------------------------------------------------------- clip_grad_norm_

@pytest.mark.parametrize("norm_type, max_norm", [(2.0, 1.5), (1.0, 2.0), (float("inf"), 0.5), (2.0, 100.0)])
def test_clip_grad_norm_like_pytorch(norm_type: float, max_norm: float) -> None:
  grads = [_random((5, 3), 4) * 3, _random((4,), 5)]
  ours = [Tensor.zeros(*grad.shape, requires_grad=True) for grad in grads]
  theirs = [torch.zeros(grad.shape, requires_grad=True) for grad in grads]
  for ours_param, theirs_param, grad in zip(ours, theirs, grads):
    ours_param.grad, theirs_param.grad = Tensor(grad), torch.tensor(grad)
  ours_norm = nn.utils.clip_grad_norm_(ours, max_norm, norm_type)
  theirs_norm = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
  assert ours_norm.item() == pytest.approx(theirs_norm.item(), rel=1e-5)
  for ours_param, theirs_param in zip(ours, theirs):
    np.testing.assert_allclose(ours_param.grad.numpy(), theirs_param.grad.numpy(), rtol=1e-5, atol=1e-7)
  nn.utils.clip_grad_value_(ours, 0.1)
  torch.nn.utils.clip_grad_value_(theirs, 0.1)
  for ours_param, theirs_param in zip(ours, theirs):
    np.testing.assert_allclose(ours_param.grad.numpy(), theirs_param.grad.numpy(), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- nn.init

@pytest.mark.parametrize("shape", [(64, 32, 3, 3), (300, 200)])
def test_init_distributions_follow_pytorch(shape: tuple[int, ...]) -> None:
  ours = Tensor.zeros(*shape).contiguous().realize()
  theirs = torch.zeros(shape)
  assert nn.init._calculate_fan_in_and_fan_out(ours) == torch.nn.init._calculate_fan_in_and_fan_out(theirs)
  for nonlinearity, param in [("relu", None), ("leaky_relu", 0.2), ("tanh", None), ("linear", None)]:
    assert nn.init.calculate_gain(nonlinearity, param) == pytest.approx(torch.nn.init.calculate_gain(nonlinearity,
                                                                                                      param))
  checks = [("uniform_", {"a": -0.3, "b": 0.7}), ("normal_", {"mean": 0.5, "std": 0.2}),
            ("xavier_uniform_", {"gain": 2.0}), ("xavier_normal_", {}), ("kaiming_uniform_", {"a": math.sqrt(5)}),
            ("kaiming_normal_", {"mode": "fan_out", "nonlinearity": "relu"}),
            ("trunc_normal_", {"std": 0.5, "a": -0.6, "b": 0.6})]
  for name, kwargs in checks:
    assert getattr(nn.init, name)(ours, **kwargs) is ours  # in place: the same tensor
    getattr(torch.nn.init, name)(theirs, **kwargs)
    values, reference = ours.numpy(), theirs.numpy()
    assert values.shape == shape
    assert abs(values.mean() - reference.mean()) < 0.05 * max(reference.std(), 1e-3) + 0.01, name
    assert abs(values.std() - reference.std()) < 0.05 * reference.std(), name
    spread = 4 * reference.std()
    assert values.min() >= reference.min() - spread and values.max() <= reference.max() + spread
  for name, expected in [("zeros_", 0.0), ("ones_", 1.0)]:
    assert (getattr(nn.init, name)(ours).numpy() == expected).all()
  assert (nn.init.constant_(ours, 0.25).numpy() == 0.25).all()


def test_init_uniform_bounds_are_pytorchs() -> None:
  ours = Tensor.zeros(50, 40).contiguous().realize()
  nn.init.xavier_uniform_(ours, gain=1.5)
  bound = 1.5 * math.sqrt(6.0 / (50 + 40))
  assert np.abs(ours.numpy()).max() <= bound and np.abs(ours.numpy()).max() > 0.9 * bound
  nn.init.kaiming_uniform_(ours, a=math.sqrt(5))
  bound = torch.nn.init.calculate_gain("leaky_relu", math.sqrt(5)) * math.sqrt(3.0 / 40)
  assert np.abs(ours.numpy()).max() <= bound and np.abs(ours.numpy()).max() > 0.9 * bound


# ---------------------------------------------------------------- DataLoader

@pytest.mark.parametrize("batch_size, drop_last", [(4, False), (4, True), (3, False), (20, False)])
def test_dataloader_batches_like_pytorch(batch_size: int, drop_last: bool) -> None:
  x, y = _random((10, 3), 6), np.arange(10, dtype=np.int64)
  ours = ourgrad.utils.data.DataLoader(ourgrad.utils.data.TensorDataset(Tensor(x), Tensor(y)), batch_size=batch_size,
                                       drop_last=drop_last)
  theirs = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y)),
                                       batch_size=batch_size, drop_last=drop_last)
  assert len(ours) == len(theirs)
  ours_batches, theirs_batches = list(ours), list(theirs)
  assert len(ours_batches) == len(theirs_batches)
  for (ours_x, ours_y), (theirs_x, theirs_y) in zip(ours_batches, theirs_batches):
    np.testing.assert_array_equal(ours_x.numpy(), theirs_x.numpy())
    np.testing.assert_array_equal(ours_y.numpy(), theirs_y.numpy())
    assert ours_y.dtype == dtypes.int64


def test_dataloader_shuffle_and_generic_dataset() -> None:
  dataset = ourgrad.utils.data.TensorDataset(np.arange(12, dtype=np.float32))
  ourgrad.manual_seed(3)
  first = np.concatenate([batch.numpy() for (batch,) in ourgrad.utils.data.DataLoader(dataset, 5, shuffle=True)])
  second = np.concatenate([batch.numpy() for (batch,) in ourgrad.utils.data.DataLoader(dataset, 5, shuffle=True)])
  assert sorted(first) == list(range(12)) and not np.array_equal(first, second)

  class Squares(ourgrad.utils.data.Dataset):
    def __len__(self) -> int: return 5
    def __getitem__(self, index: int) -> tuple[np.ndarray, int]: return np.full(2, index, np.float32), index * index

  batches = list(ourgrad.utils.data.DataLoader(Squares(), batch_size=2))
  theirs = list(torch.utils.data.DataLoader(_TorchSquares(), batch_size=2))
  for (ours_x, ours_y), (theirs_x, theirs_y) in zip(batches, theirs):
    np.testing.assert_array_equal(ours_x.numpy(), theirs_x.numpy())
    np.testing.assert_array_equal(ours_y.numpy(), theirs_y.numpy())


class _TorchSquares(torch.utils.data.Dataset):
  def __len__(self) -> int: return 5
  def __getitem__(self, index: int) -> tuple[np.ndarray, int]: return np.full(2, index, np.float32), index * index


# ---------------------------------------------------------------- for tinygrad scripts, colours, the compile note

def test_randint_forms_like_pytorch_and_tinygrad() -> None:
  assert Tensor.randint(10, (3,)).shape == torch.randint(10, (3,)).shape
  assert Tensor.randint(3, 10, (2, 2)).shape == torch.randint(3, 10, (2, 2)).shape
  assert Tensor.randint(0, 5, size=(4,)).shape == torch.randint(0, 5, size=(4,)).shape
  values = Tensor.randint(64, high=7).numpy()  # tinygrad's randint(*shape, low=0, high=...)
  assert values.shape == (64,) and values.min() >= 0 and values.max() < 7
  values = Tensor.randint(8, 8, low=2, high=5).numpy()
  assert values.shape == (8, 8) and values.min() >= 2 and values.max() < 5


def test_sequential_and_getenv(monkeypatch: pytest.MonkeyPatch) -> None:
  from ourgrad.helpers import getenv
  x = _random((2, 3), 7)
  layers = [nn.Linear(3, 4), Tensor.relu, lambda t: t * 2]
  np.testing.assert_allclose(Tensor(x).sequential(layers).numpy(), layers[2](layers[1](layers[0](Tensor(x)))).numpy())
  monkeypatch.setenv("OURGRAD_TEST_STEPS", "12")
  assert getenv("OURGRAD_TEST_STEPS", 70) == 12 and getenv("OURGRAD_TEST_UNSET", 70) == 70


def test_colours_off_under_no_color_or_without_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
  from ourgrad import helpers

  class Terminal:
    def isatty(self) -> bool: return True
    def write(self, text: str) -> int: return len(text)
  monkeypatch.setattr(helpers.sys, "stdout", Terminal())
  monkeypatch.delenv("NO_COLOR", raising=False)
  assert helpers.colored("x", "red") == "\x1b[31mx\x1b[0m"
  monkeypatch.setenv("NO_COLOR", "1")
  assert helpers.colored("x", "red") == "x"
  monkeypatch.delenv("NO_COLOR")
  monkeypatch.setattr(Terminal, "isatty", lambda self: False)
  assert helpers.colored("x", "red") == "x"


def test_compile_note_counts_new_kernels(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
  from ourgrad.engine import realize
  monkeypatch.setenv("COMPILE_NOTE", "1")
  x = Tensor(_random((4, 5), 8))
  # ten reduces of distinct shapes: ten kernels this process has not compiled (a constant of each is in its AST)
  outs = [(x * (1000.5 + i)).exp().sum(1) for i in range(10)]
  Tensor.realize_all(*outs)
  assert "ourgrad: compiling 10 kernels" in capsys.readouterr().err
  Tensor.realize_all(*[(x * (1000.5 + i)).exp().sum(1) for i in range(10)])
  assert "compiling" not in capsys.readouterr().err  # compiled already: no note
  monkeypatch.setenv("COMPILE_NOTE", "0")
  Tensor.realize_all(*[(x * (2000.5 + i)).exp().sum(1) for i in range(10)])
  assert "compiling" not in capsys.readouterr().err
  assert realize.COMPILE_NOTE_MIN_KERNELS == 8
