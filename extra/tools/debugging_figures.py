"""Make the pictures of docs/debugging.md from real runs: the GRAPH=1 files of a small MLP's forward pass, and the
timeline of a PROFILE trace of one training step of a larger MLP (drawn by trace_to_svg.py).

    python extra/tools/debugging_figures.py            # writes docs/images/graph_mlp_*.svg, trace_mlp*.json/svg
"""
from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "extra" / "tools"))

import numpy as np  # noqa: E402

import ourgrad  # noqa: E402
from ourgrad import Tensor  # noqa: E402
from ourgrad.nn import Linear, optim  # noqa: E402
from trace_to_svg import load_events, render_svg  # noqa: E402

IMAGES = REPO_ROOT / "docs" / "images"


def graph_figures() -> None:
  """GRAPH=1 over `Linear(16, 32) -> relu -> Linear(32, 10) -> log_softmax` on a batch of 4."""
  rng = np.random.default_rng(0)
  x = Tensor(rng.standard_normal((4, 16)).astype(np.float32))
  first, second = Linear(16, 32), Linear(32, 10)
  Tensor.realize_all(first.weight, first.bias, second.weight, second.bias)
  folder = pathlib.Path(tempfile.mkdtemp(prefix="ourgrad_graph_"))
  os.environ.update(GRAPH="1", GRAPH_DIR=str(folder))
  second(first(x).relu()).log_softmax(-1).realize()
  del os.environ["GRAPH"]
  for kind in ("lazy", "schedule"):
    (svg,) = folder.glob(f"{kind}_*.svg")
    shutil.copy(svg, IMAGES / f"graph_mlp_{kind}.svg")
    print(f"wrote {IMAGES / f'graph_mlp_{kind}.svg'}")


def trace_figure() -> None:
  """ourgrad.profile() around the first and the second SGD step of a 784-256-10 MLP on a batch of 128."""
  rng = np.random.default_rng(0)
  images = Tensor(rng.standard_normal((128, 784)).astype(np.float32))
  labels = Tensor(rng.integers(0, 10, 128).astype(np.int32))
  first, second = Linear(784, 256), Linear(256, 10)
  optimizer = optim.SGD([first.weight, first.bias, second.weight, second.bias], lr=0.01)

  def step() -> None:
    optimizer.zero_grad()
    loss = second(first(images).relu()).sparse_categorical_crossentropy(labels)
    loss.backward()
    optimizer.step()

  with Tensor.train():
    # the first step generates and compiles every kernel; the second only launches them
    for name in ("trace_mlp_first_step", "trace_mlp"):
      with ourgrad.profile(IMAGES / f"{name}.json"):
        step()
      events, rows = load_events(IMAGES / f"{name}.json")
      (IMAGES / f"{name}.svg").write_text(render_svg(events, rows, width=1100))
      print(f"wrote {IMAGES / name}.json and .svg ({len(events)} events)")


if __name__ == "__main__":
  IMAGES.mkdir(parents=True, exist_ok=True)
  graph_figures()
  trace_figure()
