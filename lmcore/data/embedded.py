"""The embedded default corpus (MATH §6.2): the running interpreter's Python standard library source.

Every Python installation carries it, so a fresh machine trains on real text without a download.
Documents are whole ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` outside test folders and
``site-packages``. A file is held out when the first 32 bits of ``sha256(relative path)`` mod 1000 are
below 30 (about 3 %): stable across machines and versions. The fingerprint (file list, sizes) changes
with the interpreter, and with it the cached tokenizer; runs record it and held-out sets refuse another.
The tokenizer (``spm_training``) is trained on first use and cached under ``<cache_dir>/embedded/``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import logging
import os
import pathlib
import sysconfig
import time

from lmcore.data import spm_training
from lmcore.data.spm_training import BOS_ID, EOS_ID, PAD_ID, UNK_ID  # noqa: F401  (the ids, by name)

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages"})
HELDOUT_PER_MILLE = 30
SPLITS = ("train", "heldout")
# SentencePiece's BPE trainer gives different models for different thread counts; one thread keeps the
# cached model identical on every machine.
_TRAIN_THREADS = 1

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CorpusFingerprint:
  """Identity of the embedded corpus: recorded with every run and in held-out metadata."""

  python: str
  num_files: int
  num_bytes: int
  sha256: str

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def stdlib_root() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> str:
  """"heldout" for ~3 % of files chosen by a hash of the relative path, else "train"."""
  digest = hashlib.sha256(relative_path.encode("utf-8")).hexdigest()
  return "heldout" if int(digest[:8], 16) % 1000 < HELDOUT_PER_MILLE else "train"


@functools.cache
def _all_files(root: pathlib.Path) -> tuple[tuple[str, int], ...]:
  """Sorted (relative posix path, size in bytes) of every corpus file under ``root``."""
  files = []
  for path in root.rglob("*.py"):
    relative = path.relative_to(root)
    if EXCLUDED_DIRS.isdisjoint(relative.parts[:-1]) and path.is_file():
      files.append((relative.as_posix(), path.stat().st_size))
  if not files:
    raise FileNotFoundError(f"No .py files under the standard library folder {root}; the embedded corpus "
                            "needs a CPython installation with its sources.")
  return tuple(sorted(files))


def corpus_files(split: str) -> list[pathlib.Path]:
  """Absolute paths of the files of one split, sorted."""
  if split not in SPLITS:
    raise ValueError(f"The embedded corpus has splits {SPLITS}, not {split!r}.")
  root = stdlib_root()
  return [root / rel for rel, _ in _all_files(root) if split_of(rel) == split]


def fingerprint() -> CorpusFingerprint:
  """sha256 over the sorted ``path\\tsize`` list of all corpus files."""
  root = stdlib_root()
  files = _all_files(root)
  listing = "\n".join(f"{rel}\t{size}" for rel, size in files)
  return CorpusFingerprint(python=sysconfig.get_python_version(), num_files=len(files),
                           num_bytes=sum(size for _, size in files),
                           sha256=hashlib.sha256(listing.encode("utf-8")).hexdigest())


def read_document(path: pathlib.Path) -> str:
  # A few stdlib files declare other encodings; replacement keeps reads total and deterministic.
  return path.read_bytes().decode("utf-8", errors="replace")


def resolve_cache_dir(cache_dir: str = "") -> pathlib.Path:
  """``cache_dir``, else $FSLM_CACHE, else ~/.cache/fixed_state_lm."""
  chosen = cache_dir or os.environ.get("FSLM_CACHE") or "~/.cache/fixed_state_lm"
  return pathlib.Path(chosen).expanduser()


def _train_model(vocab_size: int, output: pathlib.Path) -> None:
  start = time.perf_counter()
  lines = spm_training.document_lines(read_document(path) for path in corpus_files("train"))
  with open(output, "wb") as writer:
    spm_training.train_bpe(lines, vocab_size, writer, num_threads=_TRAIN_THREADS)
  logger.info("Trained the embedded SentencePiece model (vocab %d) in %.1f s: %s", vocab_size,
              time.perf_counter() - start, output)


@contextlib.contextmanager
def _file_lock(path: pathlib.Path):
  with open(path, "w") as handle:
    fcntl.flock(handle, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(handle, fcntl.LOCK_UN)


def tokenizer_model_path(vocab_size: int, cache_dir: str = "") -> pathlib.Path:
  """The cached SentencePiece model for this corpus and vocabulary, trained on first use (under a
  lock, written to a temporary file and renamed: a concurrent process waits and reads it)."""
  folder = resolve_cache_dir(cache_dir) / "embedded"
  folder.mkdir(parents=True, exist_ok=True)
  target = folder / f"stdlib_bpe{vocab_size}_{fingerprint().sha256[:16]}.model"
  if target.exists():
    return target
  with _file_lock(folder / f"{target.name}.lock"):
    if not target.exists():
      temporary = folder / f".{target.name}.{os.getpid()}.tmp"
      _train_model(vocab_size, temporary)
      os.replace(temporary, target)
  return target
