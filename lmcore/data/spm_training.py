"""Training SentencePiece BPE tokenizers: one recipe for the embedded tokenizer and for
``scripts/train_tokenizer.py`` (a tokenizer trained on the user's own corpus).

The recipe: BPE with byte fallback (any text encodes, nothing maps to <unk>), identity normalisation
and no added or removed whitespace (text round-trips exactly), digits split, and fixed special ids
``<unk>`` 0, ``<s>`` 1, ``</s>`` 2 (EOS, the document separator the data pipeline appends), ``<pad>`` 3,
with "\\n" as piece 4 (the trainer reads lines, so a newline is a piece of its own).

A corpus larger than memory is sampled, never loaded whole: ``sample_documents`` reads documents in
a seeded random order until a document or character cap is reached.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import numpy as np
import sentencepiece as spm

from lmcore.errors import DataError

UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
NEWLINE_PIECE = "\n"
MAX_LINE_BYTES = 4096


def document_lines(documents: Iterable[str], *, split_long: bool = False) -> Iterator[str]:
  """Non-blank lines of ``documents`` without their newline. Lines over ``MAX_LINE_BYTES`` are dropped,
  or with ``split_long`` cut at spaces into pieces that fit (prose paragraphs are often long lines)."""
  for text in documents:
    for line in text.splitlines():
      if not line.strip():
        continue
      if len(line.encode("utf-8")) <= MAX_LINE_BYTES:
        yield line
      elif split_long:
        yield from _cut(line)


def _cut(line: str) -> Iterator[str]:
  """Pieces of ``line`` of at most ``MAX_LINE_BYTES`` bytes, cut before a space where there is one."""
  limit = MAX_LINE_BYTES // 4  # characters: at most 4 bytes each in utf-8
  while line:
    piece = line[:limit]
    if len(piece) < len(line):
      space = piece.rfind(" ")
      piece = piece[:space] if space > 0 else piece
    if piece.strip():
      yield piece
    line = line[len(piece):]


def train_bpe(lines: Iterable[str], vocab_size: int, writer: BinaryIO, *, num_threads: int = 1,
              at_most: bool = False) -> None:
  """Trains the recipe's BPE model on ``lines`` (one thread: reproducible) into ``writer``. Text that
  cannot fill ``vocab_size`` pieces gets as many as it supports with ``at_most``, else ``DataError``."""
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=writer, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, character_coverage=0.9999, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=False, allow_whitespace_only_pieces=True,
        split_digits=True, user_defined_symbols=[NEWLINE_PIECE], unk_id=UNK_ID, bos_id=BOS_ID,
        eos_id=EOS_ID, pad_id=PAD_ID, max_sentence_length=MAX_LINE_BYTES, input_sentence_size=0,
        num_threads=num_threads, hard_vocab_limit=not at_most, minloglevel=2)
  except RuntimeError as e:
    least = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", str(e))
    if least:
      raise DataError(f"vocab_size={vocab_size} cannot hold the text's characters and the 256 byte and 5 "
                      f"special pieces; use at least {least.group(2)}.") from e
    most = re.search(r"value <= (\d+)", str(e))
    if most:
      raise DataError(f"the text holds enough for at most {most.group(1)} pieces, not vocab_size={vocab_size}; "
                      f"lower the vocabulary size to <= {most.group(1)} or give more text.") from e
    message = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    raise DataError(f"SentencePiece could not train a {vocab_size}-piece vocabulary on this text ({message}); "
                    "lower the vocabulary size or give more text.") from e


@dataclasses.dataclass
class Sample:
  """Documents read for training a tokenizer, and what they held."""

  documents: list[str]
  num_chars: int
  seconds: float


def sample_documents(source, indices: np.ndarray, *, max_documents: int, max_chars: int,
                     seed: int) -> Sample:
  """Reads documents ``indices`` of ``source`` in a seeded random order until ``max_documents``
  documents or ``max_chars`` characters are reached (the document that crosses the cap is kept)."""
  start = time.perf_counter()
  order = np.random.default_rng(seed).permutation(np.asarray(indices))
  documents, num_chars = [], 0
  for index in order[:max_documents]:
    text = source[int(index)]
    documents.append(text)
    num_chars += len(text)
    if num_chars >= max_chars:
      break
  return Sample(documents, num_chars, time.perf_counter() - start)


def tokens_per_char(model_proto: bytes, documents: list[str]) -> tuple[float, int, int]:
  """(tokens / character, tokens, characters) of ``documents`` under the serialized model."""
  processor = spm.SentencePieceProcessor(model_proto=model_proto)
  tokens = sum(len(ids) for ids in processor.encode(documents, out_type=int))
  chars = sum(len(d) for d in documents)
  return tokens / max(chars, 1), tokens, chars


def piece_count(model_proto: bytes) -> int:
  return spm.SentencePieceProcessor(model_proto=model_proto).get_piece_size()
