"""The token cache (``data.token_cache``): every document of a source tokenized once, then read by id.

Training reads document ``i`` of a source as ``tokenizer.encode(text_i) + [EOS]``. With the cache the same
ids come from a file instead: ``tokens.bin`` holds every document's ids (EOS appended) back to back, and
``offsets.npy`` (int64 [n + 1]) where each starts, so document ``i`` is ``tokens[offsets[i]:offsets[i+1]]``.
The order of documents, the shuffles, the held-out split and the packing are untouched: the batches are
the same arrays with or without the cache, and a data worker no longer tokenizes.

A cache is keyed by the source (its files' paths, sizes and modification times, or the embedded corpus's
fingerprint), the split and the tokenizer, and built by several processes, each tokenizing a range of
documents, into a temporary folder renamed into place when complete: an interrupted build leaves nothing
that a later run would read.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import tempfile
import time

import numpy as np

from lmcore.data import embedded
from lmcore.data.config import SourceConfig
from lmcore.data.processes import spawn_workers_light
from lmcore.data.sources import make_source, source_files
from lmcore.data.tokenizers import Tokenizer
from lmcore.errors import DataError

logger = logging.getLogger(__name__)

DOCUMENTS_PER_TASK = 256
PROGRESS_EVERY_S = 10.0
_SOURCES: dict[tuple[SourceConfig, str], object] = {}  # per builder process: sources opened once


def source_identity(cfg: SourceConfig, split: str) -> dict:
  """What the documents of ``cfg``'s ``split`` are made of: file paths, sizes and modification times (a
  changed file changes the key), or the embedded corpus's fingerprint."""
  if cfg.kind == "embedded":
    return {"kind": "embedded", "split": split, "corpus": embedded.fingerprint().as_dict()}
  if cfg.kind == "tfds":
    return {"kind": "tfds", "path": cfg.path, "split": split, "data_dir": cfg.data_dir, "text_key": cfg.text_key}
  files = [os.path.abspath(f) for f in source_files(cfg, split)]
  stats = [os.stat(f) for f in files]
  return {"kind": cfg.kind, "text_key": cfg.text_key,
          "files": [[f, s.st_size, s.st_mtime_ns] for f, s in zip(files, stats)]}


def cache_key(cfg: SourceConfig, split: str, tokenizer: Tokenizer) -> str:
  """sha256 (16 hex digits) of the source's identity and the tokenizer's name and EOS id."""
  identity = {"source": source_identity(cfg, split), "tokenizer": tokenizer.name, "eos_id": tokenizer.eos_id}
  return hashlib.sha256(json.dumps(identity, sort_keys=True).encode("utf-8")).hexdigest()[:16]


def token_dtype(tokenizer: Tokenizer) -> np.dtype:
  """uint16 where every id fits (half the bytes), else int32."""
  largest = max(tokenizer.vocab_size - 1, tokenizer.eos_id)
  return np.dtype(np.uint16) if largest <= np.iinfo(np.uint16).max else np.dtype(np.int32)


class CachedTokens:
  """A source whose document ``i`` is ``{"tokens": int32 [n_i + 1]}`` read from a built cache folder; it
  keeps the text source's length and document keys (the held-out split's hash). Pickles as its path."""

  def __init__(self, folder: str, text_source):
    self._folder = folder
    self._text_source = text_source
    meta = read_meta(folder)
    self._dtype = np.dtype(meta["dtype"])
    self._offsets = np.load(os.path.join(folder, "offsets.npy"))
    self._tokens = None

  def __getstate__(self):
    return {**self.__dict__, "_tokens": None}

  def document_keys(self) -> np.ndarray:
    return self._text_source.document_keys()

  def __len__(self) -> int:
    return len(self._offsets) - 1

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    if self._tokens is None:
      self._tokens = np.memmap(os.path.join(self._folder, "tokens.bin"), dtype=self._dtype, mode="r")
    start, stop = self._offsets[index], self._offsets[index + 1]
    return {"tokens": np.asarray(self._tokens[start:stop], dtype=np.int32)}

  def __repr__(self) -> str:
    return f"CachedTokens({len(self)} documents of {self._text_source!r})"


def read_meta(folder: str) -> dict:
  with open(os.path.join(folder, "meta.json")) as f:
    return json.load(f)


@dataclasses.dataclass(frozen=True)
class _Task:
  cfg: SourceConfig
  split: str
  tokenizer: Tokenizer
  dtype: str
  start: int
  stop: int


def _tokenize_range(task: _Task) -> tuple[bytes, np.ndarray]:
  """The ids (EOS appended) of documents [start, stop), as bytes of ``dtype``, and their lengths."""
  key = (task.cfg, task.split)
  if key not in _SOURCES:
    _SOURCES[key] = make_source(task.cfg, task.split)
  source = _SOURCES[key]
  pieces = [np.asarray([*task.tokenizer.encode(source[i]), task.tokenizer.eos_id], dtype=task.dtype)
            for i in range(task.start, task.stop)]
  lengths = np.asarray([len(p) for p in pieces], dtype=np.int64)
  return (np.concatenate(pieces).tobytes() if pieces else b""), lengths


def _results(tasks: list[_Task], processes: int):
  """Each task's result, in order: in this process, or in ``processes`` spawned ones."""
  if processes <= 1 or len(tasks) <= 1:
    yield from map(_tokenize_range, tasks)
    return
  spawn_workers_light()
  context = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(min(processes, len(tasks)), mp_context=context) as pool:
    yield from pool.map(_tokenize_range, tasks)


def build(folder: str, cfg: SourceConfig, split: str, tokenizer: Tokenizer, num_documents: int,
          processes: int) -> None:
  """Tokenizes the ``num_documents`` documents of ``cfg``'s ``split`` into ``folder`` (created whole by a
  rename; a folder already there, built by another process meanwhile, is kept)."""
  dtype = token_dtype(tokenizer)
  tasks = [_Task(cfg, split, tokenizer, dtype.str, a, min(a + DOCUMENTS_PER_TASK, num_documents))
           for a in range(0, num_documents, DOCUMENTS_PER_TASK)]
  parent = os.path.dirname(folder)
  os.makedirs(parent, exist_ok=True)
  scratch = tempfile.mkdtemp(prefix=".building-", dir=parent)
  try:
    lengths = _write_tokens(os.path.join(scratch, "tokens.bin"), tasks, processes, cfg.name)
    np.save(os.path.join(scratch, "offsets.npy"), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    with open(os.path.join(scratch, "meta.json"), "w") as f:
      json.dump({"source": cfg.name, "split": split, "tokenizer": tokenizer.name, "dtype": dtype.str,
                 "documents": num_documents, "tokens": int(lengths.sum())}, f)
    try:
      os.rename(scratch, folder)
    except OSError:
      if not os.path.isdir(folder):
        raise
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


def _write_tokens(path: str, tasks: list[_Task], processes: int, name: str) -> np.ndarray:
  """Streams the tasks' ids into ``path``; the documents' lengths, in order. Logs progress."""
  lengths, start, last = [], time.perf_counter(), time.perf_counter()
  total = tasks[-1].stop if tasks else 0
  with open(path, "wb") as f:
    for (data, task_lengths), task in zip(_results(tasks, processes), tasks):
      f.write(data)
      lengths.append(task_lengths)
      if time.perf_counter() - last >= PROGRESS_EVERY_S:
        last = time.perf_counter()
        rate = task.stop / (last - start)
        logger.info("token cache of data.sources.%s: %d/%d documents, %.0f documents/s, ETA %.0f s", name,
                    task.stop, total, rate, (total - task.stop) / rate)
  return np.concatenate(lengths) if lengths else np.zeros(0, np.int64)


def cached_tokens(cfg: SourceConfig, split: str, text_source, tokenizer: Tokenizer, root: str,
                  processes: int) -> CachedTokens:
  """``text_source`` (the documents of ``cfg``'s ``split``) tokenized: read from ``root``/tokens/<key>,
  built there first when missing."""
  folder = os.path.join(root, "tokens", f"{cfg.name}-{cache_key(cfg, split, tokenizer)}")
  if not os.path.isdir(folder):
    start = time.perf_counter()
    logger.info("Tokenizing the %d documents of data.sources.%s once into %s (%d processes)", len(text_source),
                cfg.name, folder, processes)
    build(folder, cfg, split, tokenizer, len(text_source), processes)
    meta = read_meta(folder)
    logger.info("Token cache of data.sources.%s: %d tokens in %.1f s", cfg.name, meta["tokens"],
                time.perf_counter() - start)
  documents = read_meta(folder)["documents"]
  if documents != len(text_source):
    raise DataError(f"The token cache {folder} holds {documents} documents, data.sources.{cfg.name} "
                    f"{len(text_source)}: delete that folder (it is rebuilt on the next run).")
  return CachedTokens(folder, text_source)
