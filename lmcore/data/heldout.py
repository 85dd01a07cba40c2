"""The fixed held-out set (MATH §1.4, §6.3) and the unigram-entropy reference.

Per source: the documents ``[heldout_skip, end)`` of its held-out split (or those its hash holds out),
shuffled once with the held-out seed, mixed by weight and packed like training data. The first
``num_sequences`` windows are written once (atomically, npz + JSON) and reused; the data is never
repeated, so a smaller corpus gives a smaller set and a warning.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import warnings

import numpy as np

from lmcore.data import pipeline
from lmcore.data.config import DataConfig
from lmcore.data.tokenizers import Tokenizer
from lmcore.errors import DataError

logger = logging.getLogger(__name__)

_SOURCE_KEYS = ("name", "kind", "path", "text_key", "weight", "heldout_skip", "data_dir")


def metadata(cfg: DataConfig, tokenizer: Tokenizer) -> dict:
  """What identifies a held-out set: a stored set is reused only if this matches exactly."""
  sources = [{**{k: getattr(s, k) for k in _SOURCE_KEYS}, "heldout_split": pipeline.heldout_split(s)}
             for s in cfg.sources]
  for entry, s in zip(sources, cfg.sources):
    if s.effective_heldout_fraction():  # only then, so sets stored before the field existed still match
      entry["heldout_fraction"] = s.effective_heldout_fraction()
  return {
      "seed": cfg.heldout.seed, "num_sequences": cfg.heldout.num_sequences, "seq_len": cfg.seq_len,
      "sources": sources, "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
      "eos_id": tokenizer.eos_id, "embedded_corpus": pipeline.fingerprint(cfg)["embedded_corpus"],
  }


def _warn_if_overlapping(cfg: DataConfig) -> None:
  for s in cfg.sources:
    if pipeline.heldout_split(s) == s.split and s.heldout_skip == 0 and not s.effective_heldout_fraction():
      logger.warning("Held-out documents of data.sources.%s come from its training split %r without "
                     "data.sources.%s.heldout_skip or heldout_fraction, so training also reads them.", s.name,
                     s.split, s.name)


def build_heldout(cfg: DataConfig, tokenizer: Tokenizer) -> dict[str, np.ndarray]:
  """Packs up to ``num_sequences`` windows: tokens, segment_ids, document positions, int32 [N, T + 1]."""
  _warn_if_overlapping(cfg)
  per_source = [pipeline.source_documents(cfg, i, heldout=True).shuffle(
      seed=pipeline.derive_seed(cfg.heldout.seed, i)) for i in range(len(cfg.sources))]
  documents = pipeline.mix(per_source, cfg).map(pipeline.TokenizeDocument(tokenizer))
  windows = []
  for window in pipeline.pack(documents.to_iter_dataset(pipeline.READ_OPTIONS), cfg.seq_len):
    if (window["tokens_segment_ids"] == 0).any():  # the padded tail of the stream
      break
    windows.append(window)
    if len(windows) == cfg.heldout.num_sequences:
      break
  if not windows:
    raise DataError(f"The held-out documents hold fewer than seq_len + 1 = {cfg.seq_len + 1} tokens; lower "
                    "data.seq_len, lower data.sources.<name>.heldout_skip or raise its heldout_fraction.")
  if len(windows) < cfg.heldout.num_sequences:
    warnings.warn(f"The held-out split has only {len(windows)} windows of {cfg.seq_len + 1} tokens "
                  f"(data.heldout.num_sequences={cfg.heldout.num_sequences}); evaluating on those. "
                  "Held-out data is never repeated.", stacklevel=2)
  return {"tokens": np.stack([w["tokens"] for w in windows]).astype(np.int32),
          "segment_ids": np.stack([w["tokens_segment_ids"] for w in windows]).astype(np.int32),
          "document_positions": np.stack([w["tokens_positions"] for w in windows]).astype(np.int32)}


def _write_atomically(path: pathlib.Path, arrays: dict[str, np.ndarray], meta: dict) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  with open(temporary, "wb") as handle:
    np.savez(handle, metadata=np.asarray(json.dumps(meta, sort_keys=True)), **arrays)
  os.replace(temporary, path)


def _read(path: pathlib.Path, expected: dict) -> dict[str, np.ndarray]:
  with np.load(path, allow_pickle=False) as stored:
    meta = json.loads(str(stored["metadata"]))
    arrays = {k: stored[k] for k in stored.files if k != "metadata"}
  expected = json.loads(json.dumps(expected))  # tuples -> lists, as stored
  if meta != expected:
    differing = sorted(k for k in set(meta) | set(expected) if meta.get(k) != expected.get(k))
    details = "; ".join(f"{k}: stored {meta.get(k)!r}, config {expected.get(k)!r}" for k in differing)
    raise DataError(f"The held-out set {path} was built for another configuration ({details}). Delete it to "
                    "rebuild, or point data.heldout.path elsewhere.")
  return arrays


def load_or_build_heldout(cfg: DataConfig, tokenizer: Tokenizer,
                          path: str | os.PathLike) -> dict[str, np.ndarray]:
  """The held-out set at ``cfg.heldout.path`` (or ``path``), built on first use: ``tokens``,
  ``segment_ids`` and ``positions`` int32 [N, T + 1], as in training batches."""
  path = pathlib.Path(cfg.heldout.path or path).expanduser()
  expected = metadata(cfg, tokenizer)
  if path.exists():
    arrays = _read(path, expected)
  else:
    arrays = build_heldout(cfg, tokenizer)
    _write_atomically(path, arrays, expected)
    logger.info("Wrote the held-out set (%d x %d tokens) to %s", *arrays["tokens"].shape, path)
  return pipeline.FinishWindows(cfg.segment_ids)({"tokens": arrays["tokens"],
                                                  "tokens_segment_ids": arrays["segment_ids"],
                                                  "tokens_positions": arrays["document_positions"]})


def unigram_entropy(tokens: np.ndarray, vocab_size: int | None = None) -> float:
  """-sum_v p_v log p_v (nats) of the token frequencies: the loss of a context-free model.
  ``vocab_size``, when given, checks the ids."""
  tokens = np.asarray(tokens).reshape(-1)
  if vocab_size is not None and tokens.size and not 0 <= tokens.min() <= tokens.max() < vocab_size:
    raise ValueError(f"Token ids span [{tokens.min()}, {tokens.max()}], outside a vocabulary of "
                     f"{vocab_size}.")
  counts = np.bincount(tokens)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


_TRAIN_COUNTS: dict[str, tuple[np.ndarray, float]] = {}  # unigram counts of a stream, by its description


def _train_counts(cfg: DataConfig, tokenizer: Tokenizer, num_tokens: int) -> tuple[np.ndarray, float]:
  """Token counts [vocab] and unigram entropy of the first ``num_tokens`` tokens of a fresh training
  iterator of ``cfg`` (seed 0), computed once per process for each description of the stream (its files
  are taken to stay as they are while the process runs)."""
  cfg = dataclasses.replace(cfg, worker_count=0)
  key = f"{cfg!r}|{tokenizer.name}|{tokenizer.vocab_size}|{num_tokens}"
  if key not in _TRAIN_COUNTS:
    iterator = pipeline.make_train_iterator(cfg, tokenizer, batch_size=16, seed=0)
    windows, count = [], 0
    try:
      while count < num_tokens:
        window = next(iterator)["tokens"][:, 1:].reshape(-1)
        windows.append(window)
        count += window.size
    finally:
      iterator.close()
    train_tokens = np.concatenate(windows)
    _TRAIN_COUNTS[key] = (np.bincount(train_tokens, minlength=tokenizer.vocab_size),
                          unigram_entropy(train_tokens, tokenizer.vocab_size))
  return _TRAIN_COUNTS[key]


def unigram_baseline(cfg: DataConfig, tokenizer: Tokenizer, heldout_tokens: np.ndarray,
                     num_tokens: int = 500_000) -> dict[str, float]:
  """The yardstick for a held-out loss: ``unigram_entropy`` of the first ``num_tokens`` tokens of a
  fresh training iterator (in this process) and ``unigram_heldout_xent``, the held-out cross-entropy
  of that unigram model (add-½ smoothing)."""
  counts, entropy = _train_counts(cfg, tokenizer, num_tokens)
  log_p = np.log((counts + 0.5) / (counts.sum() + 0.5 * counts.size))
  heldout = np.asarray(heldout_tokens)[:, 1:].reshape(-1)
  return {"unigram_entropy": entropy, "unigram_heldout_xent": float(-log_p[heldout].mean())}
