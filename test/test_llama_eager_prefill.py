"""An eager Llama prefill's inputs as views of what the model holds (extra/models/llama.py `Llama._eager_inputs`): the
rope rows of the decode steps' tables, the write marks a padded True constant, the cache rows placed by a pad at the
start. Against the host-made inputs a jitted prefill uploads (`_position_inputs`: numpy rope, an indexed placement),
bit for bit, in several cache rows and at a later start; and the upload count of an eager call."""
import numpy as np

import extra.models.llama as llama
from ourgrad import Tensor
from ourgrad.device import Buffer

CONFIG = llama.LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, vocab_size=40, norm_eps=1e-5,
                           rope_theta=10000.0, context_length=16)


def _weights(seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  dim, kv, hidden = CONFIG.dim, CONFIG.n_kv_heads * CONFIG.head_dim, CONFIG.hidden_dim
  shapes = {"token_embd.weight": (CONFIG.vocab_size, dim), "output_norm.weight": (dim,)}
  for n in range(CONFIG.n_layers):
    shapes.update({f"blk.{n}.attn_norm.weight": (dim,), f"blk.{n}.ffn_norm.weight": (dim,),
                   f"blk.{n}.attn_q.weight": (dim, dim), f"blk.{n}.attn_k.weight": (kv, dim),
                   f"blk.{n}.attn_v.weight": (kv, dim), f"blk.{n}.attn_output.weight": (dim, dim),
                   f"blk.{n}.ffn_gate.weight": (hidden, dim), f"blk.{n}.ffn_up.weight": (hidden, dim),
                   f"blk.{n}.ffn_down.weight": (dim, hidden)})
  return {name: (rng.standard_normal(shape) / 4).astype(np.float32) for name, shape in shapes.items()}


def _model(weights: dict[str, np.ndarray], host_made: bool) -> llama.Llama:
  """A two-sequence model; `host_made`: its eager calls take the uploaded inputs of a jitted call instead."""
  model = llama.Llama(CONFIG, {name: Tensor(value) for name, value in weights.items()}, max_context=16,
                      symbolic=False, sequences=2)
  if host_made:
    model._eager_inputs = lambda start, length, sequence: model._position_inputs(start, length, length, sequence)
  return model


def test_eager_prefill_views_match_host_made_inputs():
  """Two prompts in cache row 1 (the second at start 5) and one in row 0: logits and every cache bit for bit as with
  the host-made inputs (numpy rope rows, write marks and an indexed placement uploaded)."""
  weights = _weights(0)
  prompts = [(1, 0, [3, 1, 4, 1, 5]), (1, 5, [9, 2, 6]), (0, 0, [5, 8, 9, 7])]
  outcome = {}
  for host_made in (False, True):
    model = _model(weights, host_made)
    logits = [model(np.array([prompt], np.int32), start, sequence=row).numpy().tobytes()
              for row, start, prompt in prompts]
    outcome[host_made] = (logits, [block.cache.numpy().tobytes() for block in model.blocks])
  assert outcome[False] == outcome[True]


def test_eager_prefill_uploads_only_its_tokens(monkeypatch):
  """An eager call's one host input is its tokens (L int32): the rope rows, marks and positions are views."""
  model = _model(_weights(1), host_made=False)
  model(np.array([[1, 2, 3]], np.int32), 0).numpy()   # compiles, makes the model's buffers
  copies: list[int] = []
  original = Buffer.copyin
  monkeypatch.setattr(Buffer, "copyin", lambda self, data: (copies.append(len(data)), original(self, data))[1])
  model(np.array([[4, 5, 6, 7]], np.int32), 3, sequence=1).numpy()
  assert copies == [4 * 4], copies
