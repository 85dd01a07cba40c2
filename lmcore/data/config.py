"""Typed data configuration (MATH §1.4, §6.1–§6.4): sources, tokenizer, held-out set, packing."""

from __future__ import annotations

import dataclasses

from lmcore.errors import ConfigError

SOURCE_KINDS = ("embedded", "text", "jsonl", "parquet", "array_record", "tfds")
TOKENIZER_KINDS = ("embedded", "sentencepiece", "hf_json")
# Kinds whose held-out set defaults to a hashed fraction of the training documents (heldout_fraction).
FRACTION_KINDS = ("text", "jsonl", "parquet", "array_record")
DEFAULT_HELDOUT_FRACTION = 0.01


def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ConfigError(f"{what}: kind={value!r} is not supported; choose one of {', '.join(choices)}.")


@dataclasses.dataclass(frozen=True)
class SourceConfig:
  """One document source of the training mixture. ``heldout_skip``: on the training split, training
  stops there, so the two never overlap. ``heldout_fraction``: documents held out by a stable hash of
  (path relative to the glob's folder, index in the file); -1: 0.01 for text / jsonl / parquet /
  array_record sources without a held-out split or skip, else 0 (off)."""

  name: str = "embedded"  # in errors, metadata and logs; unique within a mixture
  kind: str = "embedded"  # SOURCE_KINDS: text is one document per file, jsonl one per line
  path: str = ""  # glob of files (``{split}`` replaced by the split), or the TFDS dataset name
  split: str = "train"
  text_key: str = "text"  # JSON key, parquet column or TFDS feature holding the text
  weight: float = 1.0  # sampling weight, normalised over the mixture
  skip: int = 0  # documents skipped at the start
  heldout_split: str = ""  # "": ``split`` ("heldout" for the embedded corpus)
  heldout_skip: int = 0  # documents skipped before the held-out set ("deep in each stream", MATH §1.4)
  heldout_fraction: float = -1.0
  data_dir: str = ""  # TFDS data_dir ("": TFDS's default)

  def __post_init__(self):
    _check_choice(f"data.sources.{self.name}", self.kind, SOURCE_KINDS)
    key = f"data.sources.{self.name}"
    if not self.weight > 0:
      raise ConfigError(f"{key}.weight must be > 0 (got {self.weight}); "
                        "remove the source from data.sources to leave it out.")
    if self.skip < 0 or self.heldout_skip < 0:
      raise ConfigError(f"{key}: skip and heldout_skip must be >= 0.")
    if self.heldout_fraction == -1.0 or self.heldout_fraction == 0.0:
      return
    if not 0.0 < self.heldout_fraction < 1.0:
      raise ConfigError(f"{key}.heldout_fraction={self.heldout_fraction}: give a share in (0, 1), 0 for "
                        "none, or -1 for the default.")
    if self.kind == "embedded":
      raise ConfigError(f"{key}.heldout_fraction: the embedded corpus has its own held-out split; "
                        "leave heldout_fraction at -1.")
    if self.heldout_skip or self.heldout_split not in ("", self.split):
      raise ConfigError(f"{key}: heldout_fraction={self.heldout_fraction} and a held-out "
                        f"{'skip' if self.heldout_skip else 'split'} both choose the held-out documents; "
                        "keep one of them.")

  def effective_heldout_fraction(self) -> float:
    """The share of documents held out by hash (see ``heldout_fraction``); 0 when another rule applies."""
    if self.heldout_fraction >= 0:
      return self.heldout_fraction
    own_split = self.heldout_split in ("", self.split)
    if self.kind in FRACTION_KINDS and own_split and not self.heldout_skip:
      return DEFAULT_HELDOUT_FRACTION
    return 0.0


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
  """The embedded SentencePiece model, a SentencePiece ``.model`` or an HF ``tokenizer.json``."""

  kind: str = "embedded"  # TOKENIZER_KINDS
  path: str = ""  # the local file of sentencepiece / hf_json (nothing is fetched)
  vocab_size: int = 8192  # of the embedded tokenizer when it is trained
  eos_id: int = -1  # the document separator; -1: the tokenizer's own EOS

  def __post_init__(self):
    _check_choice("data.tokenizer", self.kind, TOKENIZER_KINDS)
    if self.vocab_size < 64:
      raise ConfigError(f"data.tokenizer.vocab_size must be >= 64 (got {self.vocab_size}).")


@dataclasses.dataclass(frozen=True)
class HeldoutConfig:
  """The fixed held-out evaluation set (MATH §1.4, §6.3)."""

  seed: int = 4321  # shuffles each source's held-out documents
  num_sequences: int = 256  # windows of seq_len + 1 tokens
  path: str = ""  # where it is written once; "": ``<workdir>/heldout.npz``

  def __post_init__(self):
    if self.num_sequences < 1:
      raise ConfigError(f"data.heldout.num_sequences must be >= 1 (got {self.num_sequences}).")


WORKER_KINDS = ("auto", "threads", "processes")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Everything the data layer needs. ``segment_ids`` (MATH §6.4): positions restart at document
  boundaries and mixers reset their state; False is the papers' one stream, positions 0..T."""

  sources: tuple[SourceConfig, ...] = (SourceConfig(),)
  tokenizer: TokenizerConfig = TokenizerConfig()
  heldout: HeldoutConfig = HeldoutConfig()
  seq_len: int = 128  # T: windows hold T + 1 tokens (inputs and shifted targets)
  shuffle_seed: int = 0  # combined with the run seed
  segment_ids: bool = False
  # worker_count: parallel shards of the pipeline, interleaved (0: one, in the training loop's thread); the
  # stream depends on it. worker_kind: what runs a shard, "threads" or "processes" (the same batches);
  # "auto": threads when token_cache is on (a shard only reads ids and packs), else processes (tokenizing
  # needs cores).
  worker_count: int = 0
  worker_kind: str = "auto"
  cache_dir: str = ""  # tokenizers and token caches; "": $FSLM_CACHE or ~/.cache/fixed_state_lm
  # Tokenize each source once into cache_dir and read ids from there (same batches, no tokenizing while
  # training; the first run pays the whole corpus once). token_cache_processes: its builders (0: one per core).
  token_cache: bool = False
  token_cache_processes: int = 0

  def __post_init__(self):
    if not self.sources:
      raise ConfigError("data.sources is empty; give at least one source (the default is the embedded "
                        "corpus).")
    names = [s.name for s in self.sources]
    if len(set(names)) != len(names):
      raise ConfigError(f"data.sources names must be unique (got {names}).")
    if self.seq_len < 1:
      raise ConfigError(f"data.seq_len must be >= 1 (got {self.seq_len}).")
    if self.worker_kind not in WORKER_KINDS:
      raise ConfigError(f"data.worker_kind={self.worker_kind!r}: give one of {', '.join(WORKER_KINDS)}.")
    if self.worker_count < 0 or self.token_cache_processes < 0:
      raise ConfigError(f"data.worker_count and data.token_cache_processes must be >= 0 (got "
                        f"{self.worker_count}, {self.token_cache_processes}).")

  @property
  def worker_threads(self) -> bool:
    """Whether the pipeline's ``worker_count`` shards run in threads of the training process."""
    return self.worker_kind == "threads" or (self.worker_kind == "auto" and self.token_cache)
