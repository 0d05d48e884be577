"""Indexed accumulate benchmark: an embedding's backward (M token gradients added into a (V, D) table), and
index_add / scatter_add of the same rows, ourgrad's indexed-accumulate kernel (codegen/index_accumulate.py) against
PyTorch's `embedding_dense_backward` (what torch.nn.functional.embedding's backward runs) on the same indices.

    python extra/bench/bench_scatter.py                     # GPT-2: 4096 tokens into 50304 x 768 float32, on CUDA
    python extra/bench/bench_scatter.py --device CLANG --tokens 512 --vocab 4096 --width 64   # a small CPU check

Method: the table, the indices (uniform over the vocabulary; `--zipf S` draws text-like repeats, probability
~ 1/rank^S, row r of rank r + 1, as a tokenizer numbers frequent tokens first: one row gets many of the tokens, and
its owner thread adds them one after another in its carry, codegen/index_accumulate.py) and
the upstream gradient are realized first. ourgrad: the gradient `weight[index].backward(upstream)` builds (one
kernel) is timed cold on CUDA (timing.cold_schedule_seconds: it moves more than twice the L2, so it runs on its own
realized buffers, replayed in one CUDA graph); '1-launch' is one launch between two CUDA events (DEBUG=2's figure),
median over --iters.
PyTorch: `torch.ops.aten.embedding_dense_backward` timed back to back (--iters calls between two synchronizations;
the host clock on the CPU). GB/s for both counts the table written once, the gradient rows and the indices read once.
Before timing, ourgrad's gradient is checked against itself (bitwise, run to run) and against PyTorch's, up to the
error bound of a float32 sum of each row's terms in another order (`summation_tolerance`: it grows with the row's
repeats and its terms' magnitudes).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # timing.py, beside this script
from ourgrad import Tensor  # noqa: E402
from timing import back_to_back_seconds, cold_schedule_seconds, ourgrad_kernel_seconds, torch_seconds  # noqa: E402

try:
  import torch
except ImportError:  # torch is optional: its rows are left out
  torch = None


def embedding_gradient(weight: Tensor, index: Tensor, upstream: Tensor) -> Tensor:
  """The table's gradient as training computes it: the lookup's backward (an indexed accumulate into zeros)."""
  weight.grad = None
  weight[index].backward(upstream)
  assert weight.grad is not None
  return weight.grad


def torch_backward(upstream: "torch.Tensor", index: "torch.Tensor", vocab: int) -> "torch.Tensor":
  return torch.ops.aten.embedding_dense_backward(upstream, index, vocab, -1, False)


def summation_tolerance(tokens: np.ndarray, upstream: np.ndarray, vocab: int) -> np.ndarray:
  """Per element of the (vocab, width) gradient, how far two float32 sums of its n terms in different orders may
  lie apart: each is within (n - 1) * u * sum|term| of the exact sum (recursive summation's bound, u = 2**-24), so
  two of them within twice that. A row summed 843 times (Zipf 1.2) differs in its last bits from PyTorch's order."""
  counts = np.bincount(tokens, minlength=vocab).astype(np.float64)[:, None]
  magnitude = np.zeros((vocab, upstream.shape[1]), np.float64)
  np.add.at(magnitude, tokens, np.abs(upstream.astype(np.float64)))
  unit_roundoff = np.finfo(np.float32).eps / 2
  return 2.0 * np.maximum(counts - 1, 0) * unit_roundoff * magnitude


def check_against_reference(ours: np.ndarray, reference: np.ndarray, tokens: np.ndarray, upstream: np.ndarray,
                            vocab: int) -> None:
  """ours == reference up to the summation-order bound (summation_tolerance), never tighter than 1e-5."""
  bound = np.maximum(summation_tolerance(tokens, upstream, vocab), 1e-5 + 1e-5 * np.abs(reference))
  excess = np.abs(ours.astype(np.float64) - reference) - bound
  worst = np.unravel_index(np.argmax(excess), excess.shape)
  assert excess[worst] <= 0, (f"gradient differs from PyTorch's at {worst}: {ours[worst]} vs {reference[worst]}, "
                              f"beyond the float32 summation bound {bound[worst]:.3g}")


def torch_time(function, iters: int, cuda: bool) -> float:
  if not cuda: return torch_seconds(function, iters, False)
  return back_to_back_seconds(function, torch.cuda.synchronize, launches=max(iters, 2))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--device", default="CUDA")
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--vocab", type=int, default=50304)
  parser.add_argument("--width", type=int, default=768)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--replays", type=int, default=10)
  parser.add_argument("--zipf", type=float, default=0.0,
                      help="draw tokens with probability ~ 1/rank^S (text-like repeats; the run prints how often the "
                           "most common token occurs) instead of uniformly")
  parser.add_argument("--shuffle-ranks", action="store_true",
                      help="with --zipf: the rows of each rank at random ids instead of rank order")
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  if args.zipf > 0:
    weights = 1.0 / np.arange(1, args.vocab + 1) ** args.zipf
    tokens_np = rng.choice(args.vocab, args.tokens, p=weights / weights.sum()).astype(np.int32)
    if args.shuffle_ranks: tokens_np = rng.permutation(args.vocab).astype(np.int32)[tokens_np]
  else:
    tokens_np = rng.integers(0, args.vocab, args.tokens).astype(np.int32)
  upstream_np = rng.standard_normal((args.tokens, args.width), dtype=np.float32)
  weight = Tensor(rng.standard_normal((args.vocab, args.width), dtype=np.float32), device=args.device,
                  requires_grad=True).realize()
  index = Tensor(tokens_np, device=args.device).realize()
  upstream = Tensor(upstream_np, device=args.device).realize()

  first = embedding_gradient(weight, index, upstream).numpy()
  again = embedding_gradient(weight, index, upstream).numpy()
  assert first.tobytes() == again.tobytes(), "the gradient differs between two runs"
  bytes_moved = (args.vocab * args.width + args.tokens * args.width + args.tokens) * 4
  repeats = int(np.bincount(tokens_np).max())
  print(f"embedding backward: {args.tokens} tokens into {args.vocab} x {args.width} float32 on {args.device} "
        f"({bytes_moved / 1e6:.1f} MB moved; the most common token {repeats} times); deterministic: yes")

  cuda = args.device.upper().startswith("CUDA")
  if cuda:
    ours, kernels = cold_schedule_seconds(args.device, embedding_gradient(weight, index, upstream), args.replays)
    names = ", ".join(name for name, _ in kernels)
  else:
    ours, count = ourgrad_kernel_seconds(args.device, lambda: embedding_gradient(weight, index, upstream), args.iters)
    names = f"{count} kernel(s)"
  one_launch, count = ourgrad_kernel_seconds(args.device, lambda: embedding_gradient(weight, index, upstream),
                                             args.iters)
  print(f"{'library':<28} {'ms':>9} {'GB/s':>9} {'/ torch':>8}  kernels")
  torch_s = None
  if torch is not None:
    torch_device = "cuda" if cuda else "cpu"
    upstream_t = torch.from_numpy(upstream_np).to(torch_device)
    index_t = torch.from_numpy(tokens_np.astype(np.int64)).to(torch_device)
    reference = torch_backward(upstream_t, index_t, args.vocab).cpu().numpy()
    check_against_reference(first, reference, tokens_np, upstream_np, args.vocab)
    torch_s = torch_time(lambda: torch_backward(upstream_t, index_t, args.vocab), args.iters, cuda)
  for label, seconds, kernel_text in (("ourgrad (cold, graph)" if cuda else "ourgrad", ours, names),
                                      ("ourgrad (1-launch events)", one_launch, f"{count} kernel(s)")):
    ratio = f"{seconds / torch_s:8.2f}" if torch_s else f"{'-':>8}"
    print(f"{label:<28} {seconds * 1e3:9.3f} {bytes_moved / seconds / 1e9:9.1f} {ratio}  {kernel_text}")
  if torch_s is not None:
    print(f"{'torch embedding_dense_backward':<28} {torch_s * 1e3:9.3f} {bytes_moved / torch_s / 1e9:9.1f} "
          f"{1.0:8.2f}")


if __name__ == "__main__":
  main()
