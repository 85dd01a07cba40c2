"""The training input pipeline (MATH §1.4, §6.1, §6.4) as one checkpointable Grain iterator.

Per source: documents ``[skip, stop)`` (or the complement of a hashed ``heldout_fraction``) -> a
seeded shuffle per epoch -> repeat. Sources are mixed by Grain's deterministic weighted interleave;
process ``p`` of ``n`` takes documents ``p::n``, tokenizes them with EOS appended (or reads the same ids
from the token cache, ``token_cache.py``), packs and batches.
``stop`` is ``heldout_skip`` when the held-out set shares the training split (``heldout.py``).

Packing (Grain's ``ConcatThenSplitIterDataset``) cuts the concatenated documents into consecutive
windows of T + 1 tokens, as in the papers: no padding, and a small state (a restore re-tokenizes one
document at most).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import sys
import threading
from typing import Any

import grain
import numpy as np

from lmcore.data import embedded, processes, token_cache
from lmcore.data.config import DataConfig, SourceConfig
from lmcore.data.sources import Subset, make_source, source_files
from lmcore.data.tokenizers import Tokenizer
from lmcore.errors import DataError

logger = logging.getLogger(__name__)

# Documents are read and tokenized ahead of the packer in threads (worker processes scale further).
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=64)
# Batches leave the workers pickled through their queues, not in shared memory: batches are small, and a
# segment in flight when a stopped run exits would be left to the resource tracker's warning.
WORKER_BATCHES_COPIED = grain.experimental.DatasetOptions(min_shm_size=sys.maxsize)


def derive_seed(*parts: int) -> int:
  """A 32-bit seed from several integers (Grain's shuffle takes seeds in [0, 2**32))."""
  return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def heldout_split(cfg: SourceConfig) -> str:
  """The split the held-out set reads from this source."""
  if cfg.heldout_split:
    return cfg.heldout_split
  return "heldout" if cfg.kind == "embedded" else cfg.split


def document_range(cfg: SourceConfig, num_documents: int, *, heldout: bool) -> tuple[int, int]:
  """[start, stop) of the documents that training (or the held-out set) may read from this source."""
  if heldout:
    start, stop = cfg.heldout_skip, num_documents
  else:
    shares_split = heldout_split(cfg) == cfg.split
    start = cfg.skip
    stop = min(cfg.heldout_skip, num_documents) if shares_split and cfg.heldout_skip > 0 else num_documents
  if start >= stop:
    role = "held-out set" if heldout else "training"
    raise DataError(f"Data source {cfg.name!r}: the {role} range [{start}, {stop}) of its {num_documents} "
                    "documents is empty; lower skip / heldout_skip.")
  return start, stop


def heldout_mask(source, fraction: float) -> np.ndarray:
  """bool [len(source)]: the documents a hashed split of ``fraction`` holds out (key < fraction * 2^64)."""
  threshold = np.uint64(min(int(fraction * 2.0 ** 64), 2 ** 64 - 1))
  return source.document_keys() < threshold


def _hashed_indices(cfg: SourceConfig, source, start: int, stop: int, *, heldout: bool) -> np.ndarray:
  """The document indices in [start, stop) on the requested side of the hashed split."""
  fraction = cfg.effective_heldout_fraction()
  held = heldout_mask(source, fraction)
  indices = start + np.flatnonzero(held[start:stop] if heldout else ~held[start:stop])
  if not heldout:
    logger.info("data.sources.%s: %d training and %d held-out documents (heldout_fraction %g, by a hash "
                "of file path and index)", cfg.name, len(indices), int(held.sum()), fraction)
  if not len(indices):
    side = "held-out" if heldout else "training"
    raise DataError(f"data.sources.{cfg.name}: heldout_fraction {fraction:g} of its {len(source)} documents "
                    f"leaves no {side} document; set data.sources.{cfg.name}.heldout_fraction to a share "
                    "that does (or add documents).")
  return indices


def source_documents(cfg: DataConfig, index: int, *, heldout: bool,
                     tokenizer: Tokenizer | None = None) -> grain.MapDataset:
  """The documents (str) of ``cfg.sources[index]`` that training or the held-out set reads, in order;
  given ``tokenizer``, the same documents as ``{"tokens": ids + [EOS]}`` from the token cache."""
  source_cfg = cfg.sources[index]
  split = heldout_split(source_cfg) if heldout else source_cfg.split
  source = make_source(source_cfg, split)
  if tokenizer is not None:
    source = token_cache.cached_tokens(source_cfg, split, source, tokenizer, cache_dir(cfg),
                                       cfg.token_cache_processes or processes.usable_cores())
  start, stop = document_range(source_cfg, len(source), heldout=heldout)
  if source_cfg.effective_heldout_fraction():
    return grain.MapDataset.source(Subset(source, _hashed_indices(source_cfg, source, start, stop,
                                                                  heldout=heldout)))
  return grain.MapDataset.source(source)[start:stop]


def check_paths(cfg: DataConfig) -> None:
  """Raises ``MissingFileError`` (naming the key) when a file source's glob matches nothing, for the
  training and the held-out split; cheap (globs only), so callers run it before creating anything."""
  for source_cfg in cfg.sources:
    if source_cfg.kind not in ("embedded", "tfds"):
      for split in dict.fromkeys((source_cfg.split, heldout_split(source_cfg))):
        source_files(source_cfg, split)


def mix(datasets: list[grain.MapDataset], cfg: DataConfig) -> grain.MapDataset:
  """Interleaves the per-source datasets in proportion to ``data.sources[*].weight``."""
  if len(datasets) == 1:
    return datasets[0]
  return grain.MapDataset.mix(datasets, [s.weight for s in cfg.sources])


def training_documents(cfg: DataConfig, *, seed: int, process_index: int = 0, process_count: int = 1,
                       tokenizer: Tokenizer | None = None) -> grain.MapDataset:
  """The endless mixed document stream (str; token ids given ``tokenizer``) of one process."""
  per_source = [
      source_documents(cfg, i, heldout=False, tokenizer=tokenizer)
      .shuffle(seed=derive_seed(seed, cfg.shuffle_seed, i)).repeat()
      for i in range(len(cfg.sources))]
  return mix(per_source, cfg)[process_index::process_count]


@dataclasses.dataclass(frozen=True)
class TokenizeDocument:
  """str -> {"tokens": int32 [n + 1]}: the document's ids followed by EOS."""

  tokenizer: Tokenizer

  def __call__(self, text: str) -> dict[str, np.ndarray]:
    return {"tokens": np.asarray([*self.tokenizer.encode(text), self.tokenizer.eos_id], dtype=np.int32)}


def pack(documents: grain.IterDataset, seq_len: int) -> grain.IterDataset:
  """Concatenate-then-split into windows of ``seq_len + 1`` tokens, with ``tokens_segment_ids`` (1-based
  document index within the window) and ``tokens_positions`` (0-based position within the document's
  piece in this window; a document continued from the previous window restarts at 0)."""
  return grain.experimental.ConcatThenSplitIterDataset(documents, length_struct={"tokens": seq_len + 1})


@dataclasses.dataclass(frozen=True)
class FinishWindows:
  """Packed windows (or batches of them) -> {tokens, segment_ids, positions}, all int32.

  ``positions`` follow documents when ``segment_ids`` is on (MATH §6.4), else count 0..T along the
  window (one stream, as in the papers). ``segment_ids`` always mark the documents.
  """

  segment_ids: bool

  def __call__(self, packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    tokens = packed["tokens"].astype(np.int32)
    positions = packed["tokens_positions"]
    if not self.segment_ids:
      positions = np.broadcast_to(np.arange(tokens.shape[-1], dtype=np.int32), tokens.shape)
    return {"tokens": tokens, "segment_ids": packed["tokens_segment_ids"].astype(np.int32),
            "positions": np.ascontiguousarray(positions, dtype=np.int32)}


def _slices_as_tuples(state: Any) -> Any:
  """Undoes JSON's tuple -> list conversion inside ConcatThenSplit states."""
  if isinstance(state, dict):
    return {k: ({f: tuple(v) for f, v in value.items()} if k == "remainder_slices"
                else _slices_as_tuples(value)) for k, value in state.items()}
  if isinstance(state, list):
    return [_slices_as_tuples(v) for v in state]
  return state


class JsonSafeIterator(grain.DatasetIterator):
  """A Grain iterator whose states may go through JSON (Orbax's Grain handler): the packer compares
  its "no partial document" mark (-1, -1) as a tuple, and a JSON list would drop a document."""

  def __init__(self, parent: grain.DatasetIterator):
    super().__init__(parent)
    self._closed = False

  def __next__(self):
    return next(self._parent)

  def get_state(self) -> dict[str, Any]:
    return self._parent.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(_slices_as_tuples(state))

  def close(self) -> None:
    """Stops the worker processes together, then the rest of the pipeline (``stop_workers``); once (Grain
    closes an iterator again when it is collected, maybe while the interpreter exits)."""
    if self._closed:
      return
    self._closed = True
    stop_workers(getattr(self._parent, "_iterators_in_use", None) or ())
    super().close()


def stop_workers(workers) -> None:
  """Closes Grain's per-worker iterators (``mp_prefetch``) in parallel, reading each worker's queue
  until its iterator is closed. A stopped worker exits only once the batch it was sending has left its
  pipe; Grain reads the queue once and then waits for the process until its kill timeout, one worker
  after another (docs/DECISIONS.md, Data). Nothing here when the iterators are not Grain's (or the interpreter is exiting)."""
  workers = [w for w in workers if w is not None]
  if len(workers) < 2:
    return
  try:
    with concurrent.futures.ThreadPoolExecutor(2 * len(workers)) as pool:
      closed = [threading.Event() for _ in workers]
      drains = [pool.submit(_drain, worker, event) for worker, event in zip(workers, closed)]
      list(pool.map(_close_then_set, workers, closed))
      for drain in drains:
        drain.result()
  except RuntimeError:  # no new threads while the interpreter exits: Grain closes them in turn
    pass


def _close_then_set(worker, closed: threading.Event) -> None:
  try:
    worker.close()
  finally:
    closed.set()


def _drain(worker, closed: threading.Event) -> None:
  """Reads and drops what the worker behind ``worker`` (Grain's thread prefetch over its process
  prefetch) still sends, until ``closed``."""
  worker_queue = getattr(getattr(worker, "_maybe_nonnative_parent", None), "_buffer", None)
  if worker_queue is None:
    return
  while not closed.is_set():
    try:
      worker_queue.get(timeout=0.05)
    except (queue.Empty, OSError, EOFError, ValueError):
      pass


def local_batch_size(batch_size: int, process_count: int) -> int:
  if batch_size % process_count:
    raise DataError(f"The global batch size {batch_size} is not divisible by the process count "
                     f"{process_count}; change train.batch_size.")
  return batch_size // process_count


def make_train_iterator(cfg: DataConfig, tokenizer: Tokenizer, *, batch_size: int, seed: int,
                        process_index: int = 0, process_count: int = 1) -> grain.DatasetIterator:
  """Endless batches ``{tokens, segment_ids, positions}``: int32 [batch_size / process_count, T + 1].

  Checkpointable (``get_state`` / ``set_state``): a state restores into an identically configured
  iterator in any process (a later stage continues the stream). ``close()`` stops its workers.
  """
  local = local_batch_size(batch_size, process_count)
  if cfg.token_cache:
    documents = training_documents(cfg, seed=seed, process_index=process_index, process_count=process_count,
                                   tokenizer=tokenizer)
  else:
    documents = training_documents(cfg, seed=seed, process_index=process_index,
                                   process_count=process_count).map(TokenizeDocument(tokenizer))
  tokens = documents.to_iter_dataset(READ_OPTIONS)
  batches = pack(tokens, cfg.seq_len).batch(local, drop_remainder=True).map(FinishWindows(cfg.segment_ids))
  return JsonSafeIterator(iter(in_workers(batches, cfg)))


def in_workers(batches: grain.IterDataset, cfg: DataConfig) -> grain.IterDataset:
  """``batches`` as ``cfg.worker_count`` shards (every ``worker_count``-th document of the shuffled
  order), each packed and batched on its own and read in turn: the same stream, and iterator states of
  the same form, whether the shards run in threads or in processes (``cfg.worker_threads``)."""
  if not cfg.worker_count:
    return batches
  if cfg.worker_threads:
    return grain.experimental.multithread_prefetch(batches, num_threads=cfg.worker_count, buffer_size=1)
  processes.spawn_workers_light()
  return grain.experimental.WithOptionsIterDataset(batches, WORKER_BATCHES_COPIED).mp_prefetch(
      grain.MultiprocessingOptions(num_workers=cfg.worker_count),
      worker_init_fn=processes.leave_signals_to_the_parent)


def take_batches(iterator, n: int) -> list[dict[str, np.ndarray]]:
  """The next ``n`` batches of ``iterator``."""
  return [next(iterator) for _ in range(n)]


def fingerprint(cfg: DataConfig) -> dict[str, Any]:
  """JSON-ready identity of the data for run records: sources, packing and, when used, the embedded
  corpus's fingerprint (the tokenizer has its own ``name``)."""
  uses_embedded = any(s.kind == "embedded" for s in cfg.sources)
  return {"sources": [dataclasses.asdict(s) for s in cfg.sources], "seq_len": cfg.seq_len,
          "segment_ids": cfg.segment_ids,
          "embedded_corpus": embedded.fingerprint().as_dict() if uses_embedded else None}


def cache_dir(cfg: DataConfig) -> str:
  """Where tokenizers and token caches live: ``data.cache_dir``, else $FSLM_CACHE, else ~/.cache/fixed_state_lm."""
  return str(embedded.resolve_cache_dir(cfg.cache_dir))
