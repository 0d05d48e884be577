"""Text -> token ids for the example models, in pure Python (no `tokenizers`/`transformers` dependency).

- `WordPieceTokenizer`: BERT's tokenizer from a `vocab.txt` (one token a line, the id is the line number): clean the
  text, lowercase and strip accents (NFD, drop combining marks), split on whitespace and around punctuation and CJK
  characters, then split each word greedily into the longest vocabulary pieces, continuation pieces prefixed "##";
  a word with no split, or longer than 100 characters, becomes [UNK]. `encode_batch` adds [CLS]/[SEP] and pads.
- `ByteBPETokenizer`: GPT-2-style byte-level BPE (the SmolLM2/LLaMA-3 family): the text is cut by the
  pre-tokenizer regex, each piece's UTF-8 bytes are mapped to printable characters (GPT-2's byte-to-unicode map),
  and merges are applied lowest rank first. Special tokens (ChatML's <|im_start|> ...) are matched whole first.
"""
from __future__ import annotations

import os
import re
import unicodedata
from functools import lru_cache
from typing import Sequence

# ---------------------------------------------------------------- WordPiece (BERT)


def _is_punctuation(char: str) -> bool:
  """BERT's punctuation: every non-alphanumeric ASCII printable character, and every Unicode P* category."""
  code = ord(char)
  if 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126: return True
  return unicodedata.category(char).startswith("P")


def _is_cjk(code: int) -> bool:
  return (0x4E00 <= code <= 0x9FFF or 0x3400 <= code <= 0x4DBF or 0x20000 <= code <= 0x2A6DF
          or 0x2A700 <= code <= 0x2B73F or 0x2B740 <= code <= 0x2B81F or 0x2B820 <= code <= 0x2CEAF
          or 0xF900 <= code <= 0xFAFF or 0x2F800 <= code <= 0x2FA1F)


def _clean(text: str) -> str:
  """Drop NUL, U+FFFD and control characters; every whitespace character becomes a space; CJK characters are
  surrounded by spaces so each is a word of its own."""
  out: list[str] = []
  for char in text:
    code = ord(char)
    if code == 0 or code == 0xFFFD: continue
    if char in " \t\n\r" or unicodedata.category(char) == "Zs": out.append(" ")
    elif unicodedata.category(char).startswith("C"): continue
    elif _is_cjk(code): out.append(f" {char} ")
    else: out.append(char)
  return "".join(out)


def _strip_accents(text: str) -> str:
  return "".join(char for char in unicodedata.normalize("NFD", text) if unicodedata.category(char) != "Mn")


def _split_punctuation(word: str) -> list[str]:
  """'hello,world!' -> ['hello', ',', 'world', '!']: each punctuation character is a word of its own."""
  pieces: list[str] = []
  current = ""
  for char in word:
    if _is_punctuation(char):
      if current: pieces.append(current)
      pieces.append(char)
      current = ""
    else: current += char
  if current: pieces.append(current)
  return pieces


class WordPieceTokenizer:
  """BERT's uncased WordPiece tokenizer over the vocabulary in `vocab_path` (vocab.txt)."""

  def __init__(self, vocab_path: str | os.PathLike, lowercase: bool = True, max_word_chars: int = 100):
    with open(vocab_path, encoding="utf-8") as file:
      tokens = [line.rstrip("\n") for line in file]
    self.vocab: dict[str, int] = {token: index for index, token in enumerate(tokens)}
    self.lowercase, self.max_word_chars = lowercase, max_word_chars
    self.cls_id, self.sep_id = self.vocab["[CLS]"], self.vocab["[SEP]"]
    self.pad_id, self.unk_id = self.vocab["[PAD]"], self.vocab["[UNK]"]

  def basic_tokenize(self, text: str) -> list[str]:
    """Clean, lowercase + strip accents, split on whitespace and punctuation: the words WordPiece splits further."""
    words: list[str] = []
    for word in _clean(text).split():
      if self.lowercase: word = _strip_accents(word.lower())
      words.extend(_split_punctuation(word))
    return words

  def wordpiece(self, word: str) -> list[str]:
    """Greedy longest-match-first split of one word into vocabulary pieces ("unaffable" -> un ##aff ##able)."""
    if len(word) > self.max_word_chars: return ["[UNK]"]
    pieces: list[str] = []
    start = 0
    while start < len(word):
      end = len(word)
      while end > start:
        piece = word[start:end] if start == 0 else "##" + word[start:end]
        if piece in self.vocab: break
        end -= 1
      if end == start: return ["[UNK]"]  # some position has no piece: the whole word is unknown
      pieces.append(piece)
      start = end
    return pieces

  def tokenize(self, text: str) -> list[str]:
    return [piece for word in self.basic_tokenize(text) for piece in self.wordpiece(word)]

  def encode(self, text: str, max_length: int = 512) -> list[int]:
    """[CLS] pieces [SEP] as ids, the pieces truncated so the whole fits in `max_length`."""
    ids = [self.vocab[piece] if piece in self.vocab else self.unk_id for piece in self.tokenize(text)]
    return [self.cls_id] + ids[:max_length - 2] + [self.sep_id]

  def encode_batch(self, texts: Sequence[str], max_length: int = 512) -> tuple[list[list[int]], list[list[int]]]:
    """(ids, attention mask) for several texts, padded with [PAD] (mask 0) to the longest."""
    encoded = [self.encode(text, max_length) for text in texts]
    width = max(len(ids) for ids in encoded)
    ids = [row + [self.pad_id] * (width - len(row)) for row in encoded]
    mask = [[1] * len(row) + [0] * (width - len(row)) for row in encoded]
    return ids, mask

  def decode(self, ids: Sequence[int]) -> str:
    tokens = {index: token for token, index in self.vocab.items()}
    return " ".join(tokens[i] for i in ids).replace(" ##", "")


# ---------------------------------------------------------------- byte-level BPE (GPT-2, LLaMA-3, SmolLM2)

# GPT-2's pre-tokenizer: contractions, letter runs with an optional leading space, digits, other symbol runs,
# whitespace. Python's `re` has no \p{L}/\p{N}: [^\W\d_] is a letter and \d a decimal digit in Unicode mode.
_LETTERS, _DIGITS = r"[^\W\d_]", r"\d"
GPT2_PATTERN = (rf"'s|'t|'re|'ve|'m|'ll|'d| ?{_LETTERS}+| ?{_DIGITS}+| ?(?:(?!{_LETTERS}|{_DIGITS})[^\s])+"
                r"|\s+(?!\S)|\s+")
_DIGIT = re.compile(r"(\d)")


@lru_cache(maxsize=None)
def bytes_to_unicode() -> dict[int, str]:
  """GPT-2's map of the 256 byte values to printable characters: the printable Latin-1 bytes map to themselves,
  the rest (control characters, space, ...) to U+0100 upwards in order, so every byte string is visible text."""
  printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
  mapping: dict[int, str] = {}
  extra = 0
  for byte in range(256):
    if byte in printable: mapping[byte] = chr(byte)
    else:
      mapping[byte] = chr(256 + extra)
      extra += 1
  return mapping


class ByteBPETokenizer:
  """Byte-level BPE from a token list and a merge list (as stored in GGUF's tokenizer.ggml.tokens/merges)."""

  def __init__(self, tokens: Sequence[str], merges: Sequence[str], special_tokens: Sequence[str] = (),
               pattern: str = GPT2_PATTERN, split_digits: bool = False):
    self.tokens = list(tokens)
    self.vocab: dict[str, int] = {token: index for index, token in enumerate(self.tokens)}
    self.ranks: dict[tuple[str, str], int] = {}
    for rank, merge in enumerate(merges):
      left, right = merge.split(" ", 1)
      self.ranks[(left, right)] = rank
    self.byte_map = bytes_to_unicode()
    self.unicode_to_byte = {char: byte for byte, char in self.byte_map.items()}
    self.pattern = re.compile(pattern)
    self.split_digits = split_digits  # SmolLM2/StarCoder: every digit is a piece of its own before the regex
    self.special = {token: self.vocab[token] for token in special_tokens if token in self.vocab}
    self.special_pattern = (re.compile("(" + "|".join(re.escape(t) for t in sorted(self.special, key=len,
                                                                                       reverse=True)) + ")")
                            if self.special else None)
    self._cache: dict[str, list[int]] = {}

  def _merge(self, word: str) -> list[int]:
    """BPE of one pre-tokenized piece (already mapped to byte characters): repeatedly join the adjacent pair of
    lowest merge rank."""
    if word in self._cache: return self._cache[word]
    parts = list(word)
    while len(parts) > 1:
      best_rank, best_at = None, -1
      for at in range(len(parts) - 1):
        rank = self.ranks.get((parts[at], parts[at + 1]))
        if rank is not None and (best_rank is None or rank < best_rank): best_rank, best_at = rank, at
      if best_rank is None: break
      pair = (parts[best_at], parts[best_at + 1])
      merged: list[str] = []
      at = 0
      while at < len(parts):  # join every occurrence of the best pair, left to right
        if at < len(parts) - 1 and (parts[at], parts[at + 1]) == pair:
          merged.append(parts[at] + parts[at + 1])
          at += 2
        else:
          merged.append(parts[at])
          at += 1
      parts = merged
    ids = [self.vocab[part] for part in parts]
    self._cache[word] = ids
    return ids

  def _encode_ordinary(self, text: str) -> list[int]:
    ids: list[int] = []
    chunks = _DIGIT.split(text) if self.split_digits else [text]
    for chunk in chunks:
      for piece in self.pattern.findall(chunk):
        ids.extend(self._merge("".join(self.byte_map[byte] for byte in piece.encode("utf-8"))))
    return ids

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`; the special tokens given at construction are recognized whole."""
    if self.special_pattern is None: return self._encode_ordinary(text)
    ids: list[int] = []
    for chunk in self.special_pattern.split(text):
      if chunk in self.special: ids.append(self.special[chunk])
      elif chunk: ids.extend(self._encode_ordinary(chunk))
    return ids

  def decode_bytes(self, ids: Sequence[int]) -> bytes:
    """The bytes of the tokens `ids` (a token may end inside a multi-byte UTF-8 character: stream bytes, not str)."""
    out = bytearray()
    for index in ids:
      token = self.tokens[index]
      if token in self.special: out.extend(token.encode("utf-8"))
      else: out.extend(self.unicode_to_byte[char] for char in token)
    return bytes(out)

  def decode(self, ids: Sequence[int]) -> str:
    return self.decode_bytes(ids).decode("utf-8", errors="replace")
