"""nn.Module and its containers against torch.nn.Module: names and order of parameters, buffers, children,
modules and state-dict keys for the same structure; load_state_dict from a torch model and the same outputs;
train()/eval() effects on BatchNorm and Dropout; to(device); zero_grad; optimizers over a model with buffers;
plain (non-Module) classes with get_parameters / get_state_dict.
"""
from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

from ourgrad import Tensor, dtypes
from ourgrad import nn
from ourgrad.nn.optim import SGD, Adam
from ourgrad.nn.state import StateDictError, get_parameters, get_state_dict, load_state_dict


@pytest.fixture(autouse=True)
def _global_mode() -> Any:
  Tensor.manual_seed(0)
  training = Tensor.training
  Tensor.training = False
  yield
  Tensor.training = training


def _random(shape: tuple[int, ...], seed: int) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


class OurNet(nn.Module):
  """A small model touching every container; `scale` is set last but, being the root's own parameter, comes first
  in named_parameters (PyTorch's order)."""

  def __init__(self) -> None:
    super().__init__()
    self.conv = nn.Conv2d(3, 4, 3, padding=1)
    self.bn = nn.BatchNorm2d(4)
    self.blocks = nn.ModuleList([nn.Linear(4, 6), nn.Linear(6, 5)])
    self.heads = nn.ModuleDict({"a": nn.Linear(5, 3), "b": nn.Linear(5, 3, bias=False)})
    self.seq = nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3), nn.Dropout(0.5))
    self.scale = nn.Parameter(Tensor.ones(3))

  def forward(self, x: Tensor) -> Tensor:
    x = self.bn(self.conv(x)).relu().mean((2, 3))
    for block in self.blocks: x = block(x).relu()
    return self.seq(self.heads["a"](x) + self.heads["b"](x)) * self.scale


class TorchNet(torch.nn.Module):
  def __init__(self) -> None:
    super().__init__()
    self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    self.bn = torch.nn.BatchNorm2d(4)
    self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 6), torch.nn.Linear(6, 5)])
    self.heads = torch.nn.ModuleDict({"a": torch.nn.Linear(5, 3), "b": torch.nn.Linear(5, 3, bias=False)})
    self.seq = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3), torch.nn.Dropout(0.5))
    self.scale = torch.nn.Parameter(torch.ones(3))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    x = self.bn(self.conv(x)).relu().mean((2, 3))
    for block in self.blocks: x = block(x).relu()
    return self.seq(self.heads["a"](x) + self.heads["b"](x)) * self.scale


def _torch_state(model: nn.Module) -> dict[str, torch.Tensor]:
  return {name: torch.tensor(tensor.numpy()) for name, tensor in model.state_dict().items()}


def test_names_and_order_match_torch() -> None:
  ours, theirs = OurNet(), TorchNet()
  assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
  assert [n for n, _ in ours.named_buffers()] == [n for n, _ in theirs.named_buffers()]
  assert list(ours.state_dict()) == list(theirs.state_dict())
  assert [n for n, _ in ours.named_children()] == [n for n, _ in theirs.named_children()]
  assert [n for n, _ in ours.named_modules()] == [n for n, _ in theirs.named_modules()]
  assert [type(m).__name__ for m in ours.modules()][1:] == [type(m).__name__ for m in theirs.modules()][1:]
  assert [n for n, _ in ours.named_parameters(prefix="net", recurse=False)] == ["net.scale"]
  for (name, ours_t), (_, theirs_t) in zip(ours.state_dict().items(), theirs.state_dict().items()):
    assert ours_t.shape == tuple(theirs_t.shape), name
  assert len(list(ours.parameters())) == len(list(theirs.parameters()))
  assert len(list(ours.children())) == 5 and len(list(ours.buffers())) == 3
  # the attribute walker and the module agree
  assert list(get_state_dict(ours)) == list(ours.state_dict())
  assert list(get_state_dict({"model": ours})) == [f"model.{name}" for name in ours.state_dict()]


def test_load_torch_state_and_forward_in_both_modes() -> None:
  theirs, ours = TorchNet(), OurNet()
  with torch.no_grad():
    theirs.bn.running_mean.uniform_(-1, 1)
    theirs.bn.running_var.uniform_(0.5, 2)
  ours.load_state_dict({name: Tensor(value.numpy()) for name, value in theirs.state_dict().items()})
  x = _random((2, 3, 5, 5), 1)
  theirs.eval()
  ours.eval()
  assert not ours.training and not ours.bn.training and not theirs.bn.training
  np.testing.assert_allclose(ours(Tensor(x)).numpy(), theirs(torch.tensor(x)).detach().numpy(), atol=1e-5, rtol=1e-5)
  # training mode with dropout switched off in both: batch statistics, running statistics updated alike
  ours.seq[2].p = 0.0
  theirs.seq[2].p = 0.0
  ours.train()
  theirs.train()
  assert ours.training and ours.seq[1].training
  out, ref = ours(Tensor(x)), theirs(torch.tensor(x))
  np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(ours.bn.running_mean.numpy(), theirs.bn.running_mean.numpy(), atol=1e-6)
  np.testing.assert_allclose(ours.bn.running_var.numpy(), theirs.bn.running_var.numpy(), atol=1e-6)
  assert ours.bn.num_batches_tracked.item() == theirs.bn.num_batches_tracked.item()


def test_train_eval_against_global_flag() -> None:
  """Until train()/eval() is called a module follows Tensor.training; afterwards its own mode wins."""
  dropout, bn = nn.Dropout(0.5), nn.BatchNorm1d(3)
  x = Tensor.ones(64, 3)
  assert not dropout.training
  np.testing.assert_array_equal(dropout(x).numpy(), 1.0)
  with Tensor.train():
    assert dropout.training and bn.training
    assert (dropout(x).numpy() == 0).any()
    dropout.eval()
    np.testing.assert_array_equal(dropout(x).numpy(), 1.0)   # eval() wins over the global flag
  dropout.train()
  assert (dropout(x).numpy() == 0).any()                     # train() wins outside Tensor.train() too
  bn.train()
  values = _random((8, 3), 2) * 3 + 1
  ref = torch.nn.BatchNorm1d(3)
  np.testing.assert_allclose(bn(Tensor(values)).numpy(), ref(torch.tensor(values)).detach().numpy(), atol=1e-5)
  bn.eval()
  ref.eval()
  np.testing.assert_allclose(bn(Tensor(values)).numpy(), ref(torch.tensor(values)).detach().numpy(), atol=1e-5)
  with pytest.raises(TypeError): bn.train("yes")  # type: ignore[arg-type]


def test_load_state_dict_strict_lists_problems() -> None:
  model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
  state = dict(model.state_dict())
  del state["0.bias"]
  state["extra.weight"] = Tensor.ones(2)
  with pytest.raises(StateDictError) as info: model.load_state_dict(state)
  assert info.value.missing_keys == ["0.bias"] and info.value.unexpected_keys == ["extra.weight"]
  assert "0.bias" in str(info.value) and "extra.weight" in str(info.value)
  result = model.load_state_dict({"0.weight": Tensor.ones(2, 3)}, strict=False)
  assert "0.bias" in result.missing_keys and result.unexpected_keys == []
  np.testing.assert_array_equal(model[0].weight.numpy(), 1.0)
  with pytest.raises(StateDictError, match="shape"):
    model.load_state_dict({"0.weight": Tensor.ones(3, 3)}, strict=False)


def test_optimizer_step_matches_torch() -> None:
  """SGD with momentum over model.parameters() and over get_parameters(model) (which includes the BatchNorm
  buffers, skipped). (SGD rather than Adam: Adam's sign-like steps turn float noise in near-zero gradients into
  visible differences.)"""
  for make_params in (lambda m: m.parameters(), get_parameters):
    ours, theirs = OurNet(), TorchNet()
    theirs.load_state_dict(_torch_state(ours))
    ours.seq[2].p = theirs.seq[2].p = 0.0
    ours.train()
    theirs.train()
    opt = SGD(make_params(ours), lr=0.05, momentum=0.9)
    topt = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)
    assert len(opt.params) == len(list(theirs.parameters()))
    x = _random((2, 3, 5, 5), 3)
    for _ in range(2):
      opt.zero_grad()
      topt.zero_grad()
      ours(Tensor(x)).square().sum().backward()
      theirs(torch.tensor(x)).square().sum().backward()
      opt.step()
      topt.step()
    for (name, value), ref in zip(ours.state_dict().items(), theirs.state_dict().values()):
      np.testing.assert_allclose(value.numpy(), ref.numpy(), atol=1e-4, rtol=1e-4, err_msg=name)


def test_zero_grad_and_requires_grad() -> None:
  model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
  model(Tensor.ones(4, 3)).sum().backward()
  assert all(p.grad is not None for p in model.parameters())
  model.zero_grad()
  assert all(p.grad is None for p in model.parameters())
  model[0].requires_grad_(False)
  assert [n for n, p in model.named_parameters() if p.requires_grad] == ["1.weight", "1.bias"]
  assert [id(p) for p in SGD(get_parameters(model)).params] == [id(model[1].weight), id(model[1].bias)]


def test_to_device() -> None:
  model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
  x = _random((4, 3), 4)
  before = model(Tensor(x)).numpy()
  weight = model[0].weight
  assert model.to("PYTHON") is model
  assert all(t.device == "PYTHON" for t in [*model.parameters(), *model.buffers()])
  assert model[0].weight is weight  # moved in place: optimizers holding the tensor still see it
  np.testing.assert_allclose(model(Tensor(x, device="PYTHON")).numpy(), before, atol=1e-6)


def test_to_dtype_half_float() -> None:
  model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
  weight = model[0].weight
  x = _random((4, 3), 4)
  before = model(Tensor(x)).numpy()
  assert model.half() is model and model[0].weight is weight
  assert {t.dtype for t in model.parameters()} == {dtypes.float16}
  assert model[1].running_mean.dtype == dtypes.float16 and model[1].num_batches_tracked.dtype == dtypes.int64
  np.testing.assert_allclose(model(Tensor(x).half()).float().numpy(), before, atol=1e-2, rtol=1e-2)
  model.to(dtypes.float32)
  assert {t.dtype for t in [*model.parameters(), *model.buffers()]} == {dtypes.float32, dtypes.int64}
  model.float()
  assert model[0].weight.dtype == dtypes.float32


def test_containers() -> None:
  layers = [nn.Linear(3, 4), nn.Linear(4, 2)]
  seq, tseq = nn.Sequential(*layers), torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
  tseq.load_state_dict(_torch_state(seq))
  x = _random((5, 3), 5)
  np.testing.assert_allclose(seq(Tensor(x)).numpy(), tseq(torch.tensor(x)).detach().numpy(), atol=1e-6)
  assert len(seq) == 2 and seq[1] is layers[1] and list(seq) == layers and len(seq[:1]) == 1
  named = nn.Sequential({"first": nn.Linear(3, 4), "act": nn.Module(), "second": nn.Linear(4, 2)})
  assert list(named.state_dict()) == ["first.weight", "first.bias", "second.weight", "second.bias"]
  mlist = nn.ModuleList()
  mlist.append(nn.Linear(2, 2)).extend([nn.Linear(2, 3)])
  mlist.insert(0, nn.LayerNorm(2))
  assert [type(m).__name__ for m in mlist] == ["LayerNorm", "Linear", "Linear"] and len(mlist[1:]) == 2
  assert list(mlist.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
  with pytest.raises(TypeError): mlist.append(Tensor.ones(2))  # type: ignore[arg-type]
  mdict = nn.ModuleDict([("x", nn.Linear(2, 2))])
  mdict["y"] = nn.Linear(2, 1)
  assert "y" in mdict and mdict.keys() == ["x", "y"] and list(mdict) == ["x", "y"] and len(mdict) == 2
  assert mdict.pop("x") is not None and list(mdict.state_dict()) == ["y.weight", "y.bias"]
  with pytest.raises(NotImplementedError): mlist(Tensor.ones(2))
  with pytest.raises(NotImplementedError): nn.Module()(Tensor.ones(2))


def test_buffers_and_plain_attributes() -> None:
  class WithBuffers(nn.Module):
    def __init__(self) -> None:
      self.layers = [nn.Linear(2, 2), nn.Linear(2, 2)]   # a plain list works like a ModuleList
      self.register_buffer("table", Tensor.arange(4).float())
      self.register_buffer("cache", Tensor.zeros(2), persistent=False)
      self.weights = {"w": Tensor.ones(2, requires_grad=True)}
      self._private = Tensor.ones(1)
      self.note = "not state"

  model = WithBuffers()
  assert [n for n, _ in model.named_buffers()] == ["table", "cache"]
  assert [n for n, _ in model.named_parameters()] == ["weights.w", "layers.0.weight", "layers.0.bias",
                                                      "layers.1.weight", "layers.1.bias"]
  assert list(model.state_dict()) == ["weights.w", "table", "layers.0.weight", "layers.0.bias", "layers.1.weight",
                                      "layers.1.bias"]
  assert [n for n, _ in model.named_children()] == ["layers.0", "layers.1"]
  assert not model.table.requires_grad


def test_shared_modules_and_tensors() -> None:
  shared = nn.Linear(2, 2)
  ours = nn.Sequential(shared, shared)
  theirs_layer = torch.nn.Linear(2, 2)
  theirs = torch.nn.Sequential(theirs_layer, theirs_layer)
  assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
  assert list(ours.state_dict()) == list(theirs.state_dict())
  assert [n for n, _ in ours.named_modules()] == [n for n, _ in theirs.named_modules()]
  assert len(list(ours.named_parameters(remove_duplicate=False))) == 4


def test_existing_layers_are_modules() -> None:
  for layer in (nn.Linear(2, 2), nn.Conv2d(1, 1, 1), nn.BatchNorm2d(1), nn.LayerNorm(2), nn.Embedding(2, 2),
                nn.Dropout(), nn.GroupNorm(1, 2), nn.RMSNorm(2), nn.InstanceNorm2d(2), nn.ConvTranspose2d(1, 1, 1)):
    assert isinstance(layer, nn.Module)
  assert list(nn.BatchNorm2d(2).state_dict()) == list(torch.nn.BatchNorm2d(2).state_dict())


def test_plain_classes_keep_working() -> None:
  class Plain:
    def __init__(self) -> None:
      self.l1, self.l2 = nn.Linear(3, 3), nn.BatchNorm1d(3)

    def __call__(self, x: Tensor) -> Tensor: return self.l2(self.l1(x))

  model = Plain()
  assert list(get_state_dict(model)) == ["l1.weight", "l1.bias", "l2.weight", "l2.bias", "l2.running_mean",
                                         "l2.running_var", "l2.num_batches_tracked"]
  opt = Adam(get_parameters(model), lr=0.1)
  assert len(opt.params) == 4
  load_state_dict(model, {name: t.detach() for name, t in get_state_dict(model).items()})
  with Tensor.train():
    model(Tensor(_random((4, 3), 6))).sum().backward()
    opt.step()


def test_plain_object_inside_module() -> None:
  """A tinygrad-style object held by a Module still has its tensors found (and trained)."""
  class Plain:
    def __init__(self) -> None: self.proj, self.gain = nn.Linear(2, 2), Tensor.ones(2, requires_grad=True)

  class Mixed(nn.Module):
    def __init__(self) -> None: self.plain, self.head, self.note = Plain(), nn.Linear(2, 1), "text"

  model = Mixed()
  names = ["plain.gain", "plain.proj.weight", "plain.proj.bias", "head.weight", "head.bias"]
  assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == names
  assert [n for n, _ in model.named_children()] == ["plain.proj", "head"]
  model.eval()
  assert not model.plain.proj.training


def test_back_references_end() -> None:
  """A helper object or child pointing back at its owner neither loops nor duplicates anything."""
  class Helper:
    def __init__(self, owner: nn.Module) -> None: self.owner = owner

  class Owner(nn.Module):
    def __init__(self) -> None:
      self.layer, self.helper = nn.Linear(2, 2), None
      self.helper = Helper(self)
      self.layer.parent = self   # a child holding its parent

  model = Owner()
  assert "(parent): Owner(...)" in repr(model)
  assert [n for n, _ in model.named_parameters()] == ["layer.weight", "layer.bias"]
  assert list(model.state_dict()) == ["layer.weight", "layer.bias"]
  assert [n for n, _ in model.named_modules()] == ["", "layer"]
  model.train()


def test_repr() -> None:
  def build(m: Any) -> Any:
    return m.Sequential(m.Linear(3, 2), m.BatchNorm2d(4), m.LayerNorm(3), m.Embedding(10, 4), m.Dropout(0.25),
                        m.ReLU(), m.Flatten())
  assert repr(build(nn)) == repr(build(torch.nn)).replace("Flatten(start_dim=1, end_dim=-1)", "Flatten()")
  text = repr(nn.Sequential(nn.Linear(2, 3), nn.ModuleList([nn.Dropout()])))
  assert text.splitlines()[0] == "Sequential(" and "(1): ModuleList(" in text and "(0): Dropout(" in text


def test_submodules_import_with_nn() -> None:
  code = "import ourgrad.nn as nn; nn.optim.Adam; nn.state.safe_save; nn.functional.conv2d; nn.losses.mse_loss"
  subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("make", [
  lambda m: m.ReLU(), lambda m: m.ReLU6(), lambda m: m.GELU(), lambda m: m.GELU("tanh"), lambda m: m.SiLU(),
  lambda m: m.Sigmoid(), lambda m: m.Tanh(), lambda m: m.LeakyReLU(0.2), lambda m: m.ELU(0.5),
  lambda m: m.Softplus(2.0), lambda m: m.Hardtanh(-0.5, 0.5), lambda m: m.Softmax(1), lambda m: m.LogSoftmax(-1),
  lambda m: m.Flatten(), lambda m: m.Identity(), lambda m: m.MaxPool2d(2), lambda m: m.AvgPool2d(3, 1, 1),
  lambda m: m.MaxPool1d(3, 2), lambda m: m.AvgPool3d(2), lambda m: m.Upsample(scale_factor=2),
  lambda m: m.Upsample(size=(5, 3), mode="bilinear", align_corners=True),
  lambda m: m.AdaptiveAvgPool2d(1), lambda m: m.AdaptiveAvgPool2d((3, None)), lambda m: m.AdaptiveAvgPool1d(3),
  lambda m: m.AdaptiveAvgPool3d((2, 3, 1)),
])
def test_parameter_free_layers(make: Any) -> None:
  ours, theirs = make(nn), make(torch.nn)
  shape = {"MaxPool1d": (2, 3, 8), "AvgPool3d": (1, 2, 4, 4, 4), "AdaptiveAvgPool1d": (2, 3, 7),
           "AdaptiveAvgPool3d": (1, 2, 5, 4, 3)}.get(type(ours).__name__, (2, 3, 4, 4))
  x = _random(shape, 7) * 3
  xo, xt = Tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
  out, ref = ours(xo), theirs(xt)
  np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), atol=1e-5, rtol=1e-5)
  upstream = _random(tuple(ref.shape), 8)
  (out * Tensor(upstream)).sum().backward()
  (ref * torch.tensor(upstream)).sum().backward()
  np.testing.assert_allclose(xo.grad.numpy(), xt.grad.numpy(), atol=1e-5, rtol=1e-5)
  assert list(ours.state_dict()) == [] and not list(ours.parameters())


def test_torch_style_cnn_end_to_end() -> None:
  """A PyTorch-style CNN built from Sequential and the layer classes, loaded with torch's weights: same loss
  and gradients after one backward in training mode."""
  def build(m: Any) -> Any:
    return m.Sequential(m.Conv2d(1, 4, 3, padding=1), m.BatchNorm2d(4), m.ReLU(), m.MaxPool2d(2),
                        m.Conv2d(4, 6, 3), m.SiLU(), m.Flatten(), m.Linear(24, 10), m.LogSoftmax(-1))
  ours, theirs = build(nn), build(torch.nn)
  ours.load_state_dict({name: Tensor(value.numpy()) for name, value in theirs.state_dict().items()})
  ours.train()
  x, labels = _random((3, 1, 8, 8), 9), np.array([1, 7, 3])
  loss = ours(Tensor(x)).nll_loss(Tensor(labels))
  ref = torch.nn.functional.nll_loss(theirs(torch.tensor(x)), torch.tensor(labels))
  loss.backward()
  ref.backward()
  np.testing.assert_allclose(loss.numpy(), ref.detach().numpy(), atol=1e-5, rtol=1e-5)
  for (name, param), (_, tparam) in zip(ours.named_parameters(), theirs.named_parameters()):
    np.testing.assert_allclose(param.grad.numpy(), tparam.grad.numpy(), atol=1e-4, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("name,kwargs,target", [
  ("CrossEntropyLoss", {}, "index"), ("CrossEntropyLoss", {"label_smoothing": 0.1, "ignore_index": 2}, "index"),
  ("NLLLoss", {"reduction": "sum"}, "index"), ("MSELoss", {}, "float"), ("L1Loss", {"reduction": "none"}, "float"),
  ("BCELoss", {}, "prob"), ("BCEWithLogitsLoss", {}, "prob"),
])
def test_loss_modules(name: str, kwargs: dict[str, Any], target: str) -> None:
  x = _random((4, 5), 10)
  if name == "BCELoss": x = 1 / (1 + np.exp(-x))
  y = {"index": np.array([0, 2, 4, 1]), "float": _random((4, 5), 11),
       "prob": np.random.default_rng(12).uniform(size=(4, 5)).astype(np.float32)}[target]
  ours, theirs = getattr(nn, name)(**kwargs), getattr(torch.nn, name)(**kwargs)
  xo, xt = Tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
  out, ref = ours(xo, Tensor(y)), theirs(xt, torch.tensor(y))
  np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), atol=1e-5, rtol=1e-5)
  out.sum().backward()
  ref.sum().backward()
  np.testing.assert_allclose(xo.grad.numpy(), xt.grad.numpy(), atol=1e-5, rtol=1e-5)


def test_bce_with_logits_pos_weight_is_a_buffer() -> None:
  weight = np.array([1.0, 2.0, 0.5], dtype=np.float32)
  ours = nn.BCEWithLogitsLoss(pos_weight=Tensor(weight))
  theirs = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor(weight))
  assert list(ours.state_dict()) == list(theirs.state_dict()) == ["pos_weight"]
  x, y = _random((4, 3), 13), np.random.default_rng(14).uniform(size=(4, 3)).astype(np.float32)
  np.testing.assert_allclose(ours(Tensor(x), Tensor(y)).numpy(), theirs(torch.tensor(x), torch.tensor(y)).numpy(),
                             atol=1e-6)


@pytest.mark.parametrize("batch_first,masks,average", [
  (False, "none", True), (False, "causal+padding", True), (True, "float", False), (True, "unbatched", True),
  (False, "per-head", False),
])
def test_multihead_attention(batch_first: bool, masks: str, average: bool) -> None:
  embed, heads, length, source, batch = 8, 2, 4, 5, 3
  theirs = torch.nn.MultiheadAttention(embed, heads, batch_first=batch_first)
  ours = nn.MultiheadAttention(embed, heads, batch_first=batch_first)
  assert list(ours.state_dict()) == list(theirs.state_dict())
  ours.load_state_dict({name: Tensor(value.numpy()) for name, value in theirs.state_dict().items()})
  q_shape = (length, embed) if masks == "unbatched" else \
    (batch, length, embed) if batch_first else (length, batch, embed)
  kv_shape = (q_shape[0], source, embed) if batch_first and masks != "unbatched" else \
    (source, embed) if masks == "unbatched" else (source, batch, embed)
  q, k, v = _random(q_shape, 20), _random(kv_shape, 21), _random(kv_shape, 22)
  kwargs: dict[str, Any] = {"average_attn_weights": average}
  if masks == "causal+padding":
    kwargs["attn_mask"] = np.triu(np.ones((length, source), dtype=bool), 1)
    kwargs["key_padding_mask"] = np.array([[False] * 4 + [True], [False] * 5, [False, True] + [False] * 3])
  elif masks == "float": kwargs["attn_mask"] = _random((length, source), 23)
  elif masks == "per-head": kwargs["attn_mask"] = _random((batch * heads, length, source), 24)
  ours_kwargs = {key: Tensor(value) if isinstance(value, np.ndarray) else value for key, value in kwargs.items()}
  theirs_kwargs = {key: torch.tensor(v) if isinstance(v, np.ndarray) else v for key, v in kwargs.items()}
  qo, qt = Tensor(q, requires_grad=True), torch.tensor(q, requires_grad=True)
  out, weights = ours(qo, Tensor(k), Tensor(v), **ours_kwargs)
  ref, ref_weights = theirs(qt, torch.tensor(k), torch.tensor(v), **theirs_kwargs)
  np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(weights.numpy(), ref_weights.detach().numpy(), atol=1e-5, rtol=1e-5)
  (out * Tensor(_random(tuple(ref.shape), 25))).sum().backward()
  (ref * torch.tensor(_random(tuple(ref.shape), 25))).sum().backward()
  np.testing.assert_allclose(qo.grad.numpy(), qt.grad.numpy(), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(ours.in_proj_weight.grad.numpy(), theirs.in_proj_weight.grad.numpy(), atol=1e-5,
                             rtol=1e-5)
  assert ours(qo, Tensor(k), Tensor(v), need_weights=False)[1] is None
