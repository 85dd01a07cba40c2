"""A SentencePiece BPE tokenizer trained on the user's own corpus (``scripts/train_tokenizer.py``).

Documents are sampled from the corpus (``spm_training.sample_documents``: a seeded random order, capped
in documents and characters, so a corpus of any size trains in bounded memory). The documents a
training run would hold out under the same glob and ``heldout_fraction`` are left out, so the
tokenizer never sees the held-out set; its tokens per character is measured on them.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import time

import numpy as np

from lmcore.data import spm_training
from lmcore.data.config import DEFAULT_HELDOUT_FRACTION
from lmcore.data.pipeline import heldout_mask
from lmcore.data.sources import file_source, glob_root, resolve_files
from lmcore.errors import ConfigError

KINDS = ("text", "jsonl", "parquet", "array_record")
# Characters of held-out (or otherwise unused) text on which tokens per character is measured.
_MEASURE_CHARS = 1_000_000


@dataclasses.dataclass(frozen=True)
class TokenizerReport:
  """What was trained and how well it compresses."""

  path: str
  vocab_size: int
  requested_vocab_size: int
  model_bytes: int
  documents: int
  chars: int
  seconds: float
  tokens_per_char: float
  measured_on: str  # "held-out" | "unused" | "training"
  measured_documents: int
  measured_chars: int

  def lines(self) -> list[str]:
    fewer = (f", fewer than --vocab_size={self.requested_vocab_size} (all this text supports)"
             if self.vocab_size < self.requested_vocab_size else "")
    return [
        f"Wrote {self.path}: {self.vocab_size:,} pieces{fewer}; ids <unk> 0, <s> 1, </s> 2 (EOS), <pad> 3, "
        f"'\\n' 4; byte fallback; {self.model_bytes / 1024:,.0f} KiB. Trained on {self.documents:,} documents "
        f"({self.chars:,} characters) in {self.seconds:.2f} s.",
        f"{self.tokens_per_char:.3f} tokens per character ({1 / max(self.tokens_per_char, 1e-9):.2f} "
        f"characters per token) on {self.measured_documents:,} {self.measured_on} documents "
        f"({self.measured_chars:,} characters).",
        f"Train with: --config.data.tokenizer.kind=sentencepiece --config.data.tokenizer.path={self.path} "
        f"(and --config.model.vocab_size >= {self.vocab_size})",
    ]


def _check_arguments(kind: str, vocab_size: int, max_documents: int, max_chars: int,
                     heldout_fraction: float) -> None:
  if kind not in KINDS:
    raise ConfigError(f"--kind={kind!r}; choose one of {', '.join(KINDS)}.")
  if vocab_size < 300:
    raise ConfigError(f"--vocab_size={vocab_size} is too small: the 256 byte pieces and 5 special pieces "
                      "come first; use at least 300 (typically 4096 to 65536).")
  if max_documents < 1 or max_chars < 1:
    raise ConfigError("--max_documents and --max_chars must be >= 1.")
  if not 0 <= heldout_fraction < 1:
    raise ConfigError(f"--heldout_fraction={heldout_fraction}; give the share the training config holds "
                      f"out (default {DEFAULT_HELDOUT_FRACTION}), or 0.")


def train_corpus_tokenizer(input_glob: str, output: str, *, kind: str, vocab_size: int,
                           text_key: str = "text", max_documents: int = 1_000_000,
                           max_chars: int = 20_000_000, heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
                           seed: int = 0, num_threads: int = 1) -> TokenizerReport:
  """Trains a BPE model on a sample of the corpus ``input_glob`` and writes it to ``output``."""
  _check_arguments(kind, vocab_size, max_documents, max_chars, heldout_fraction)
  files = resolve_files(input_glob, source=f"The {kind} corpus", key="--input")
  source = file_source(kind, files, text_key=text_key, key="--text_key", root=glob_root(input_glob),
                       path_key="--input")
  held = heldout_mask(source, heldout_fraction) if heldout_fraction else np.zeros(len(source), bool)
  start = time.perf_counter()
  sample = spm_training.sample_documents(source, np.flatnonzero(~held), max_documents=max_documents,
                                         max_chars=max_chars, seed=seed)
  if not sample.num_chars:
    raise ConfigError(f"--input={input_glob!r}: the sampled documents are empty; check --kind and --text_key.")
  target = pathlib.Path(output).expanduser()
  target.parent.mkdir(parents=True, exist_ok=True)
  temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
  try:
    with open(temporary, "wb") as writer:
      spm_training.train_bpe(spm_training.document_lines(sample.documents, split_long=True), vocab_size, writer,
                             num_threads=num_threads, at_most=True)
    os.replace(temporary, target)
  finally:
    temporary.unlink(missing_ok=True)
  seconds = time.perf_counter() - start
  measured_on, documents = _measurement_documents(source, held, sample, seed)
  model = target.read_bytes()
  ratio, _, chars = spm_training.tokens_per_char(model, documents)
  return TokenizerReport(str(target), spm_training.piece_count(model), vocab_size, len(model),
                         len(sample.documents), sample.num_chars, seconds, ratio, measured_on, len(documents), chars)


def _measurement_documents(source, held: np.ndarray, sample, seed: int) -> tuple[str, list[str]]:
  """Held-out documents when there are any, else documents the sample did not read, else the sample."""
  if held.any():
    return "held-out", spm_training.sample_documents(source, np.flatnonzero(held), max_documents=10_000,
                                                     max_chars=_MEASURE_CHARS, seed=seed).documents
  if len(sample.documents) < len(source):
    # The sample read a prefix of this same permutation; the rest of it are documents it did not read.
    order = np.random.default_rng(seed).permutation(np.flatnonzero(~held))[len(sample.documents):]
    unused = spm_training.sample_documents(source, order, max_documents=10_000, max_chars=_MEASURE_CHARS,
                                           seed=seed)
    return "unused", unused.documents
  return "training", sample.documents[:10_000]
