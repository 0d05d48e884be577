"""einsum, interpolate and the pad modes against PyTorch on the CPU, forward and backward (a random upstream
gradient through both, every input's gradient compared)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from ourgrad import GlobalCounters, Tensor, dtypes
from ourgrad.errors import DTypeError, ShapeError
from ourgrad.nn import functional as F

ATOL, RTOL = 1e-5, 1e-5


def _random(shape: tuple[int, ...], seed: int) -> np.ndarray:
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _check(ours: Callable[..., Tensor], theirs: Callable[..., torch.Tensor], *arrays: np.ndarray,
           atol: float = ATOL, rtol: float = RTOL) -> None:
  og = [Tensor(a, requires_grad=True) for a in arrays]
  tg = [torch.tensor(a, requires_grad=True) for a in arrays]
  out, ref = ours(*og), theirs(*tg)
  assert out.shape == tuple(ref.shape), f"shape {out.shape} != torch {tuple(ref.shape)}"
  np.testing.assert_allclose(out.numpy(), ref.detach().numpy(), atol=atol, rtol=rtol)
  upstream = _random(tuple(ref.shape), seed=99)
  (out * Tensor(upstream)).sum().backward()
  (ref * torch.tensor(upstream)).sum().backward()
  for index, (o, t) in enumerate(zip(og, tg)):
    assert o.grad is not None, f"input {index} got no gradient"
    np.testing.assert_allclose(o.grad.numpy(), t.grad.numpy(), atol=atol, rtol=rtol, err_msg=f"grad of input {index}")


# ---------------------------------------------------------------- einsum

EINSUM_CASES = [
  ("ij,jk->ik", [(3, 4), (4, 5)]),
  ("bij,bjk->bik", [(2, 3, 4), (2, 4, 2)]),
  ("ij,jk", [(3, 4), (4, 2)]),                 # implicit output: "ik"
  ("ba", [(3, 4)]),                            # implicit output sorts the letters: a transpose
  ("ij->ji", [(3, 4)]),
  ("ii->i", [(4, 4)]),                         # diagonal
  ("ii", [(4, 4)]),                            # trace
  ("bii->bi", [(2, 3, 3)]),
  ("iij->j", [(3, 3, 2)]),
  ("i,j->ij", [(3,), (4,)]),                   # outer product
  ("i,i->", [(5,), (5,)]),                     # dot
  ("ij,ij->i", [(3, 4), (3, 4)]),
  ("...ij,...jk->...ik", [(2, 1, 3, 4), (5, 4, 2)]),   # broadcast batch dims
  ("...i->...", [(2, 3, 4)]),
  ("i...->...i", [(3, 2, 4)]),
  ("bhqd,bhkd->bhqk", [(1, 2, 3, 4), (1, 2, 5, 4)]),
  ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 2)]),
  ("ab,b", [(3, 1), (4,)]),                    # a size-1 dim broadcasts against its index
]


@pytest.mark.parametrize("formula,shapes", EINSUM_CASES)
def test_einsum(formula: str, shapes: list[tuple[int, ...]]) -> None:
  arrays = [_random(shape, seed) for seed, shape in enumerate(shapes)]
  if formula == "ab,b":  # torch refuses a size-1 dim against a larger one outside "..."; numpy is the reference
    result = Tensor.einsum(formula, *(Tensor(a) for a in arrays))
    np.testing.assert_allclose(result.numpy(), np.einsum("ab,b->a", np.broadcast_to(arrays[0], (3, 4)), arrays[1]),
                               atol=ATOL, rtol=RTOL)
    return
  _check(lambda *ts: Tensor.einsum(formula, *ts), lambda *ts: torch.einsum(formula, *ts), *arrays)


def test_einsum_kernel_counts() -> None:
  """A batched matmul is one fused reduce; a chain of three is contracted pairwise (two reduces), never as one
  four-index product."""
  a, b, c = (Tensor(_random(shape, seed)).realize() for seed, shape in enumerate([(2, 3, 4), (2, 4, 5), (5, 6)]))
  GlobalCounters.reset()
  Tensor.einsum("bij,bjk->bik", a, b).realize()
  assert GlobalCounters.kernel_count == 1
  GlobalCounters.reset()
  result = Tensor.einsum("bij,bjk,kl->bil", a, b, c).realize()
  assert GlobalCounters.kernel_count == 2
  np.testing.assert_allclose(result.numpy(), np.einsum("bij,bjk,kl->bil", a.numpy(), b.numpy(), c.numpy()),
                             atol=1e-5, rtol=1e-5)


def test_einsum_list_operands_and_errors() -> None:
  a, b = Tensor(_random((2, 3), 0)), Tensor(_random((3, 2), 1))
  np.testing.assert_allclose(Tensor.einsum("ij,jk->ik", [a, b]).numpy(), a.numpy() @ b.numpy(), atol=1e-5)
  with pytest.raises(ValueError, match="2 operand terms"): Tensor.einsum("ij,jk->ik", a)
  with pytest.raises(ShapeError, match="in another"): Tensor.einsum("ij,ij->i", a, b)
  with pytest.raises(ShapeError, match="names 3 dims"): Tensor.einsum("ijk->i", a)
  with pytest.raises(ValueError, match="repeats"): Tensor.einsum("ij->ii", a)
  with pytest.raises(ValueError, match="no operand"): Tensor.einsum("ij->k", a)
  with pytest.raises(ValueError, match="letters"): Tensor.einsum("i1->i", a)


# ---------------------------------------------------------------- interpolate

INTERP_CASES = [
  ((1, 2, 4, 5), dict(scale_factor=2, mode="nearest")),
  ((2, 1, 4, 5), dict(size=(7, 3), mode="nearest")),
  ((1, 2, 5, 4), dict(scale_factor=1.5, mode="nearest")),
  ((1, 2, 5, 4), dict(scale_factor=(0.5, 2.5), mode="nearest")),
  ((1, 2, 4, 5), dict(size=(7, 9), mode="nearest-exact")),
  ((1, 2, 4, 5), dict(scale_factor=2, mode="bilinear", align_corners=False)),
  ((1, 2, 4, 5), dict(scale_factor=2, mode="bilinear", align_corners=True)),
  ((2, 2, 5, 6), dict(size=(3, 8), mode="bilinear", align_corners=False)),
  ((2, 2, 5, 6), dict(size=(3, 8), mode="bilinear", align_corners=True)),
  ((1, 1, 4, 4), dict(size=(1, 5), mode="bilinear", align_corners=True)),
  ((1, 2, 5, 4), dict(scale_factor=1.7, mode="bilinear")),
  ((2, 3, 6), dict(size=11, mode="linear")),
  ((2, 3, 6), dict(scale_factor=0.5, mode="linear", align_corners=True)),
  ((2, 3, 7), dict(scale_factor=3, mode="nearest")),
  ((1, 2, 3, 4, 3), dict(size=(5, 2, 6), mode="trilinear", align_corners=False)),
  ((1, 2, 3, 4, 3), dict(scale_factor=2, mode="nearest")),
  ((1, 2, 8, 6), dict(scale_factor=0.5, mode="nearest")),              # strided-view downsampling
  ((1, 2, 8, 6), dict(scale_factor=0.5, mode="nearest-exact")),        # ... starting at 1
  ((1, 2, 5, 7), dict(size=(3, 3), mode="nearest-exact")),             # ... padded to whole steps
]


def test_interpolate_kernel_counts() -> None:
  """Nearest resizing by whole factors is a view (one copy kernel when made contiguous); bilinear is two matmuls."""
  x = Tensor(_random((1, 3, 16, 16), 0)).realize()
  for kwargs, kernels in ((dict(scale_factor=2), 1), (dict(scale_factor=0.5), 1), (dict(size=(5, 7)), 1),
                          (dict(scale_factor=2, mode="bilinear"), 2)):
    GlobalCounters.reset()
    x.interpolate(**kwargs).contiguous().realize()
    assert GlobalCounters.kernel_count == kernels, kwargs


@pytest.mark.parametrize("shape,kwargs", INTERP_CASES)
def test_interpolate(shape: tuple[int, ...], kwargs: dict[str, Any]) -> None:
  _check(lambda x: F.interpolate(x, **kwargs), lambda x: TF.interpolate(x, **kwargs), _random(shape, 3))


def test_interpolate_errors() -> None:
  x = Tensor.zeros(1, 1, 4, 4)
  with pytest.raises(ValueError, match="exactly one"): x.interpolate()
  with pytest.raises(ShapeError, match="needs 3 spatial"): x.interpolate(size=3, mode="trilinear")
  # "linear" over 2 spatial dims (tinygrad's meaning) is bilinear
  x = Tensor(_random((1, 1, 4, 4), 1))
  np.testing.assert_array_equal(x.interpolate(size=3, mode="linear").numpy(),
                                x.interpolate(size=3, mode="bilinear").numpy())
  with pytest.raises(ValueError, match="align_corners"): x.interpolate(size=3, align_corners=True)
  with pytest.raises(ValueError, match="mode"): x.interpolate(size=3, mode="bicubic")


# ---------------------------------------------------------------- pad modes

PAD_CASES = [
  ((2, 6), (2, 3)),
  ((2, 3, 5), (1, 4)),
  ((1, 2, 4, 5), (1, 2, 3, 0)),
  ((1, 2, 4, 5), (0, 4, 3, 3)),
  ((1, 1, 3, 4, 5), (1, 1, 2, 0, 2, 1)),
  ((1, 2, 4, 5), (2, -1, -1, 2)),             # negative amounts crop first
]


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular", "constant"])
@pytest.mark.parametrize("shape,pads", PAD_CASES)
def test_pad_modes(shape: tuple[int, ...], pads: tuple[int, ...], mode: str) -> None:
  if mode == "reflect" and pads == (0, 4, 3, 3): pads = (0, 3, 3, 3)  # reflect needs amounts < size
  extra = {"value": 1.5} if mode == "constant" else {}

  def reference(x: torch.Tensor) -> torch.Tensor:
    if mode == "constant": return TF.pad(x, pads, value=1.5)
    # PyTorch's border modes refuse negative amounts; ours crop first, then pad: the same in two torch steps
    cropped = TF.pad(x, tuple(min(p, 0) for p in pads))
    return TF.pad(cropped, tuple(max(p, 0) for p in pads), mode=mode)
  _check(lambda x: F.pad(x, pads, mode=mode, **extra), reference, _random(shape, 4))
  _check(lambda x: x.pad(pads, mode=mode, **extra), reference, _random(shape, 5))


def test_pad_mode_forms_and_errors() -> None:
  x = _random((1, 2, 4, 5), 6)
  ours = Tensor(x).pad(((0, 0), None, (1, 2), (3, 0)), "reflect")   # per-dim pairs; tinygrad's mode-second call
  np.testing.assert_allclose(ours.numpy(), TF.pad(torch.tensor(x), (3, 0, 1, 2), mode="reflect").numpy())
  cropped = Tensor(x).pad((-1, 2, 0, 0), mode="circular")   # crop the first column, then wrap the rest
  np.testing.assert_allclose(cropped.numpy(), TF.pad(torch.tensor(x[..., 1:]), (0, 2, 0, 0), mode="circular").numpy())
  with pytest.raises(ShapeError, match="smaller than its size"): Tensor(x).pad((5, 0), mode="reflect")
  with pytest.raises(ShapeError, match="at most its size"): Tensor(x).pad((6, 0), mode="circular")
  with pytest.raises(ValueError, match="pad mode"): Tensor(x).pad((1, 1), mode="symmetric")


# ---------------------------------------------------------------- torch.nn.functional spellings

@pytest.mark.parametrize("name,args,kwargs", [
  ("layer_norm", ((5,),), {}), ("normalize", (), {}), ("normalize", (), {"p": 1.0, "dim": -1}),
  ("gelu", (), {"approximate": "tanh"}), ("leaky_relu", (0.2,), {}), ("softmax", (1,), {}), ("log_softmax", (-1,), {}),
])
def test_functional_names(name: str, args: tuple, kwargs: dict[str, Any]) -> None:
  _check(lambda x: getattr(F, name)(x, *args, **kwargs), lambda x: getattr(TF, name)(x, *args, **kwargs),
         _random((3, 4, 5), 11))


def test_functional_layer_norm_affine() -> None:
  _check(lambda x, w, b: F.layer_norm(x, (4, 5), w, b), lambda x, w, b: TF.layer_norm(x, (4, 5), w, b),
         _random((3, 4, 5), 12), _random((4, 5), 13), _random((4, 5), 14))


def test_interpolate_nearest_integers() -> None:
  """Nearest resizing keeps an integer dtype and its values exactly (uint8 images), like PyTorch."""
  x = np.random.default_rng(15).integers(0, 256, size=(2, 3, 5, 4)).astype(np.uint8)
  for size in ((7, 3), (10, 8), (2, 2)):
    ours = Tensor(x).interpolate(size=size)
    assert ours.dtype == dtypes.uint8
    np.testing.assert_array_equal(ours.numpy(), TF.interpolate(torch.tensor(x), size=size).numpy())
  with pytest.raises(DTypeError): Tensor(x).interpolate(size=(3, 3), mode="bilinear")
