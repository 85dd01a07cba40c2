"""Random-access document sources (MATH §6.1): ``len(source)`` documents, ``source[i]`` -> str.

Each is a Grain ``RandomAccessDataSource`` that pickles cheaply (handles are reopened per process).
ArrayRecord (``scripts/prepare_data.py``) reads in O(1) per document; jsonl scans line offsets at
start-up and parquet decodes a row group per miss. File sources key every document by its path
relative to the glob's folder and its index in the file (``document_keys``): the hashed held-out split
compares these keys with a threshold, so it does not depend on the machine or the folder's location.
"""

from __future__ import annotations

import collections
import glob
import hashlib
import json
import os
import pathlib
import re

import grain
import numpy as np
import pyarrow.parquet as pq
from array_record.python.array_record_module import ArrayRecordReader

from lmcore.data import embedded
from lmcore.data.config import SourceConfig
from lmcore.errors import ConfigError, DataError, MissingFileError, MissingKeyError

_GLOB_MAGIC = re.compile(r"[*?[]")
# splitmix64 (Steele et al. 2014): a 64-bit mixer with full avalanche, vectorised over numpy uint64.
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def resolve_files(pattern: str, *, source: str, key: str, hint: str = "") -> list[str]:
  """Sorted files matching ``pattern``; an error naming ``source`` and the config ``key`` when none do."""
  if not pattern:
    raise MissingFileError(f"{source} has no path: set {key} to a glob of local files.")
  expanded = os.path.expanduser(pattern)
  files = sorted(f for f in glob.glob(expanded, recursive=True) if os.path.isfile(f))
  if not files:
    raise MissingFileError(f"{source}: no files match {key}={pattern!r}. Fix the glob{hint}.")
  return files


def glob_root(pattern: str) -> str:
  """The folder a glob starts from: its leading path components without wildcards."""
  parts = pathlib.PurePath(os.path.expanduser(pattern)).parts
  literal = []
  for part in parts:
    if _GLOB_MAGIC.search(part):
      break
    literal.append(part)
  if len(literal) == len(parts):  # a plain file name
    literal = literal[:-1]
  return str(pathlib.PurePath(*literal)) if literal else "."


def document_keys(identity: str, count: int) -> np.ndarray:
  """Stable uint64 keys of documents ``0..count-1`` of the file (or dataset) named ``identity``:
  splitmix64 of sha256(identity)[:8] + index * golden ratio. Independent of machine and Python."""
  base = np.uint64(int.from_bytes(hashlib.sha256(identity.encode("utf-8")).digest()[:8], "little"))
  x = base + np.arange(count, dtype=np.uint64) * _GOLDEN
  x = (x ^ (x >> np.uint64(30))) * _MIX1
  x = (x ^ (x >> np.uint64(27))) * _MIX2
  return x ^ (x >> np.uint64(31))


def _file_keys(files: list[str], counts: list[int], root: str) -> np.ndarray:
  """Keys of every document of ``files`` in order (``counts`` documents each), by path under ``root``."""
  keys = [document_keys(pathlib.Path(os.path.relpath(f, root)).as_posix(), n) for f, n in zip(files, counts)]
  return np.concatenate(keys) if keys else np.zeros(0, np.uint64)


class EmbeddedSource:
  """One split of the embedded standard-library corpus; a document is a whole file."""

  def __init__(self, split: str):
    self._paths = embedded.corpus_files(split)

  def __len__(self) -> int:
    return len(self._paths)

  def __getitem__(self, index: int) -> str:
    return embedded.read_document(self._paths[index])

  def __repr__(self) -> str:
    return f"EmbeddedSource({len(self)} files)"


class TextFilesSource:
  """One document per file (utf-8; undecodable bytes replaced)."""

  def __init__(self, files: list[str], root: str = "."):
    self._files = list(files)
    self._root = root

  def document_keys(self) -> np.ndarray:
    return _file_keys(self._files, [1] * len(self._files), self._root)

  def __len__(self) -> int:
    return len(self._files)

  def __getitem__(self, index: int) -> str:
    return pathlib.Path(self._files[index]).read_bytes().decode("utf-8", errors="replace")

  def __repr__(self) -> str:
    return f"TextFilesSource({len(self)} files)"


def _line_offsets(path: str) -> np.ndarray:
  """Byte offsets of the non-blank lines of a file."""
  offsets, position = [], 0
  with open(path, "rb") as handle:
    for line in handle:
      if line.strip():
        offsets.append(position)
      position += len(line)
  return np.asarray(offsets, dtype=np.int64)


class JsonlSource:
  """One document per non-blank line: ``json.loads(line)[text_key]``."""

  def __init__(self, files: list[str], text_key: str, key: str, root: str = "."):
    """``key``: the setting that names ``text_key`` in error messages."""
    self._files = list(files)
    self._text_key = text_key
    self._key = key
    self._root = root
    offsets = [_line_offsets(f) for f in self._files]
    self._offsets = np.concatenate(offsets)
    self._file_of = np.repeat(np.arange(len(offsets)), [len(o) for o in offsets])

  def document_keys(self) -> np.ndarray:
    return _file_keys(self._files, np.bincount(self._file_of, minlength=len(self._files)).tolist(), self._root)

  def __len__(self) -> int:
    return len(self._offsets)

  def __getitem__(self, index: int) -> str:
    path = self._files[self._file_of[index]]
    with open(path, "rb") as handle:
      handle.seek(int(self._offsets[index]))
      record = json.loads(handle.readline())
    if self._text_key not in record:
      raise MissingKeyError(f"{path} at byte {self._offsets[index]}: no key {self._text_key!r} "
                            f"(keys: {sorted(record)}); set {self._key}.")
    return record[self._text_key]

  def __repr__(self) -> str:
    return f"JsonlSource({len(self._files)} files, {len(self)} documents)"


class ParquetSource:
  """One document per row of column ``text_key``; the last few decoded row groups are kept."""

  _CACHED_ROW_GROUPS = 4

  def __init__(self, files: list[str], text_key: str, key: str, root: str = "."):
    self._files = list(files)
    self._text_key = text_key
    self._root = root
    groups, starts, total = [], [], 0
    for file_index, path in enumerate(self._files):
      metadata = pq.ParquetFile(path).metadata
      if text_key not in metadata.schema.names:
        raise MissingKeyError(f"{path}: no column {text_key!r} (columns: {metadata.schema.names}); "
                              f"set {key}.")
      for group in range(metadata.num_row_groups):
        groups.append((file_index, group))
        starts.append(total)
        total += metadata.row_group(group).num_rows
    self._groups = groups
    self._starts = np.asarray(starts + [total], dtype=np.int64)
    self._cache = collections.OrderedDict()

  def __getstate__(self):
    return {**self.__dict__, "_cache": collections.OrderedDict()}

  def __len__(self) -> int:
    return int(self._starts[-1])

  def document_keys(self) -> np.ndarray:
    rows = np.diff(self._starts)
    file_of = np.asarray([f for f, _ in self._groups], dtype=np.int64)
    counts = np.bincount(file_of, weights=rows, minlength=len(self._files)).astype(np.int64)
    return _file_keys(self._files, counts.tolist(), self._root)

  def _row_group(self, group_index: int) -> list[str]:
    if group_index not in self._cache:
      file_index, group = self._groups[group_index]
      table = pq.ParquetFile(self._files[file_index]).read_row_group(group, columns=[self._text_key])
      self._cache[group_index] = table.column(0).to_pylist()
      if len(self._cache) > self._CACHED_ROW_GROUPS:
        self._cache.popitem(last=False)
    return self._cache[group_index]

  def __getitem__(self, index: int) -> str:
    group_index = int(np.searchsorted(self._starts, index, side="right")) - 1
    return self._row_group(group_index)[index - int(self._starts[group_index])]

  def __repr__(self) -> str:
    return f"ParquetSource({len(self._files)} files, {len(self)} documents)"


def shard_records(path: str, key: str = "path") -> int:
  """The number of records of ArrayRecord shard ``path``; a ``DataError`` naming the file when it is
  empty, truncated or not an ArrayRecord file (``key``: the setting whose glob matched it)."""
  try:
    reader = ArrayRecordReader(path)
    count = reader.num_records()
    reader.close()  # a truncated shard reports its failure here
  except RuntimeError as e:
    reason = str(e) or "its footer cannot be read"
    size = os.path.getsize(path)
    raise DataError(f"{path} ({size:,} bytes) is not a complete ArrayRecord shard ({reason}): an "
                    f"interrupted write or copy. Write it again (scripts/prepare_data.py) or move it out "
                    f"of {key}'s glob.") from None
  return count


class ArrayRecordSource:
  """ArrayRecord shards of utf-8 documents, each checked on opening (``shard_records``), so that an
  empty or truncated file is named here and not in a data worker's first read."""

  def __init__(self, files: list[str], root: str = ".", key: str = "path"):
    self._files = list(files)
    self._root = root
    self._counts = [shard_records(path, key) for path in self._files]
    self._source = grain.sources.ArrayRecordDataSource(self._files)

  def document_keys(self) -> np.ndarray:
    return _file_keys(self._files, self._counts, self._root)

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> str:
    return self._source[index].decode("utf-8", errors="replace")

  def __repr__(self) -> str:
    return f"ArrayRecordSource({len(self._files)} files, {len(self)} documents)"


class TfdsSource:
  """A prepared TFDS dataset read through ``tfds.data_source`` (ArrayRecord; TensorFlow not needed)."""

  def __init__(self, source, text_key: str, key: str, identity: str = "tfds"):
    self._source = source
    self._text_key = text_key
    self._key = key
    self._identity = identity

  def __len__(self) -> int:
    return len(self._source)

  def document_keys(self) -> np.ndarray:
    return document_keys(self._identity, len(self))

  def __getitem__(self, index: int) -> str:
    record = self._source[index]
    if self._text_key not in record:
      raise MissingKeyError(f"TFDS record has no feature {self._text_key!r} (features: {sorted(record)}); "
                            f"set {self._key}.")
    text = record[self._text_key]
    return text.decode("utf-8", errors="replace") if isinstance(text, bytes) else str(text)

  def __repr__(self) -> str:
    return f"TfdsSource({self._source!r})"


def _open_tfds(cfg: SourceConfig, split: str, key: str):
  # Imported here: tensorflow_datasets is slow to import and only this source kind needs it.
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  if not cfg.path:
    raise ConfigError(f"Data source {cfg.name!r} (kind 'tfds'): set {key}.path to the TFDS dataset name.")
  try:
    return tfds.data_source(cfg.path, split=split, data_dir=cfg.data_dir or None, download=False)
  except Exception as error:  # TFDS raises several types for "not prepared here".
    raise MissingFileError(f"Data source {cfg.name!r}: TFDS dataset {cfg.path!r} split {split!r} is not "
                           f"available under {key}.data_dir={cfg.data_dir!r} ({error}). Prepare it with "
                           "`tfds build --file_format=array_record` first; nothing is downloaded at run "
                           "time.") from error


class Subset:
  """The documents ``indices`` of ``source``, in that order (a hashed held-out split or its complement)."""

  def __init__(self, source, indices: np.ndarray):
    self._source = source
    self._indices = np.asarray(indices, dtype=np.int64)

  def __len__(self) -> int:
    return len(self._indices)

  def __getitem__(self, index: int) -> str:
    return self._source[int(self._indices[index])]

  def __repr__(self) -> str:
    return f"Subset({len(self)} of {self._source!r})"


def source_files(cfg: SourceConfig, split: str) -> list[str]:
  """The files of a file-based source in ``split``; ``MissingFileError`` naming the key when none match."""
  key = f"data.sources.{cfg.name}"
  return resolve_files(cfg.path.replace("{split}", split), key=f"{key}.path",
                       source=f"Data source {cfg.name!r} (kind {cfg.kind!r}, split {split!r})",
                       hint=", or run scripts/prepare_data.py to produce ArrayRecord shards")


def make_source(cfg: SourceConfig, split: str):
  """The documents of source ``cfg`` in ``split``."""
  key = f"data.sources.{cfg.name}"
  if cfg.kind == "embedded":
    return EmbeddedSource(split)
  if cfg.kind == "tfds":
    return TfdsSource(_open_tfds(cfg, split, key), cfg.text_key, f"{key}.text_key",
                      identity=f"{cfg.path}/{split}")
  return file_source(cfg.kind, source_files(cfg, split), text_key=cfg.text_key, key=f"{key}.text_key",
                     root=glob_root(cfg.path.replace("{split}", split)), path_key=f"{key}.path")


def file_source(kind: str, files: list[str], *, text_key: str = "text", key: str = "text_key",
                root: str = ".", path_key: str = "path"):
  """A text / jsonl / parquet / array_record source over ``files``; ``key`` and ``path_key`` name the
  settings of ``text_key`` and of the files' glob in errors; document keys use paths relative to
  ``root``."""
  if kind == "text":
    return TextFilesSource(files, root)
  if kind == "jsonl":
    return JsonlSource(files, text_key, key, root)
  if kind == "parquet":
    return ParquetSource(files, text_key, key, root)
  if kind == "array_record":
    return ArrayRecordSource(files, root, path_key)
  raise ConfigError(f"kind={kind!r} is not a file source; choose text, jsonl, parquet or array_record.")
