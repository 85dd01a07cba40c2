"""Raw text / jsonl / parquet files -> ArrayRecord shards, one utf-8 document per record (MATH §6.1).

ArrayRecord gives O(1) random access per document, which global shuffling needs; the shards are read
back by the ``array_record`` source kind (``data.sources[i].kind='array_record'``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import time
from collections.abc import Iterator
from typing import TextIO

import numpy as np
import pyarrow.parquet as pq
from array_record.python.array_record_module import ArrayRecordWriter

from lmcore.data.sources import resolve_files

CONVERTIBLE_KINDS = ("text", "jsonl", "parquet")
# group_size:1 makes every record its own chunk: random reads decode one document, not a group.
# ArrayRecord compresses each chunk with zstd unless the options say "uncompressed".
DEFAULT_WRITER_OPTIONS = "group_size:1"


def _documents(kind: str, files: list[str], text_key: str) -> Iterator[str]:
  """Documents of ``files`` in order: a file, a non-blank line, or a row."""
  for path in files:
    if kind == "text":
      yield pathlib.Path(path).read_bytes().decode("utf-8", errors="replace")
    elif kind == "jsonl":
      with open(path, "rb") as handle:
        for line_number, line in enumerate(handle, 1):
          if line.strip():
            record = json.loads(line)
            if text_key not in record:
              raise KeyError(f"{path}:{line_number}: no key {text_key!r} (keys: {sorted(record)}); "
                             "pass --text_key.")
            yield record[text_key]
    else:
      for batch in pq.ParquetFile(path).iter_batches(columns=[text_key]):
        yield from batch.column(0).to_pylist()


def _count_documents(kind: str, files: list[str]) -> int | None:
  """Known without reading the data for text files and parquet; unknown (None) for jsonl."""
  if kind == "text":
    return len(files)
  if kind == "parquet":
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)
  return None


@dataclasses.dataclass
class Progress:
  """Plain-text progress on a stream: documents, MB, documents/s and the ETA when the total is known."""

  total: int | None
  stream: TextIO = dataclasses.field(default_factory=lambda: sys.stderr)
  interval_s: float = 1.0
  docs: int = 0
  num_bytes: int = 0
  _start: float = dataclasses.field(default_factory=time.perf_counter)
  _last: float = 0.0

  def update(self, num_bytes: int) -> None:
    self.docs += 1
    self.num_bytes += num_bytes
    if time.perf_counter() - self._last >= self.interval_s:
      self.report()

  def report(self) -> None:
    self._last = time.perf_counter()
    rate = self.docs / max(self._last - self._start, 1e-9)
    done = f"{self.docs:,}/{self.total:,} docs" if self.total else f"{self.docs:,} docs"
    line = f"{done}, {self.num_bytes / 1e6:,.1f} MB, {rate:,.0f} docs/s"
    if self.total:
      line += f", ETA {max(self.total - self.docs, 0) / max(rate, 1e-9):,.0f} s"
    print(line, file=self.stream, flush=True)


def convert_to_array_record(input_glob: str, output_dir: str, *, kind: str, text_key: str = "text",
                            docs_per_shard: int = 100_000, prefix: str = "docs",
                            shuffle_seed: int | None = None, writer_options: str = DEFAULT_WRITER_OPTIONS,
                            show_progress: bool = True) -> list[str]:
  """Writes ``<output_dir>/<prefix>-NNNNN.array_record`` shards; returns their paths in order.

  Files are read sorted, or shuffled with ``shuffle_seed`` (every shard then a uniform sample of the
  files). ``writer_options`` are ArrayRecord's; the records do not depend on them. Progress goes to
  stderr about once a second.
  """
  if kind not in CONVERTIBLE_KINDS:
    raise ValueError(f"--kind={kind!r} cannot be converted; choose one of {', '.join(CONVERTIBLE_KINDS)}.")
  if docs_per_shard < 1:
    raise ValueError(f"--docs_per_shard must be >= 1 (got {docs_per_shard}).")
  files = resolve_files(input_glob, source=f"Conversion of {kind} files", key="--input")
  if shuffle_seed is not None:
    files = [files[i] for i in np.random.default_rng(shuffle_seed).permutation(len(files))]
  output = pathlib.Path(output_dir).expanduser()
  output.mkdir(parents=True, exist_ok=True)
  progress = Progress(_count_documents(kind, files)) if show_progress else None
  shards, writer, in_shard = [], None, 0
  for document in _documents(kind, files, text_key):
    if writer is None or in_shard == docs_per_shard:
      if writer is not None:
        writer.close()
      shards.append(str(output / f"{prefix}-{len(shards):05d}.array_record"))
      writer, in_shard = ArrayRecordWriter(shards[-1], writer_options), 0
    record = document.encode("utf-8")
    writer.write(record)
    in_shard += 1
    if progress:
      progress.update(len(record))
  if writer is not None:
    writer.close()
  if progress:
    progress.report()
  return shards
