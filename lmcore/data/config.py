"""Typed data configuration (SPEC §1.4, §6.1–§6.4): sources, tokenizer, held-out set, packing."""

from __future__ import annotations

import dataclasses

SOURCE_KINDS = ("embedded", "text", "jsonl", "parquet", "array_record", "tfds")
TOKENIZER_KINDS = ("embedded", "sentencepiece", "hf_json")


def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
  if value not in choices:
    raise ValueError(f"{what}: kind={value!r} is not supported; choose one of {', '.join(choices)}.")


@dataclasses.dataclass(frozen=True)
class SourceConfig:
  """One document source of the training mixture.

  Attributes:
    name: label used in errors, metadata and logs; unique within a mixture.
    kind: embedded | text (one document per file) | jsonl (one per line) | parquet | array_record | tfds.
    path: glob of files (``{split}`` is replaced by the split), or the TFDS dataset name for ``tfds``.
    split: training split (embedded: "train"; tfds: any split name).
    text_key: JSON key, parquet column or TFDS feature holding the text.
    weight: document sampling probability; normalised over the sources of the mixture.
    skip: documents skipped at the start of this source.
    heldout_split: split the held-out set is drawn from; "" = ``split`` ("heldout" for the embedded corpus).
    heldout_skip: documents skipped when drawing the held-out set ("deep in each stream", SPEC §1.4).
      When the held-out split equals the training split, training stops at this document, so
      the two never overlap.
    data_dir: TFDS data_dir ("" = TFDS default).
  """

  name: str = "embedded"
  kind: str = "embedded"
  path: str = ""
  split: str = "train"
  text_key: str = "text"
  weight: float = 1.0
  skip: int = 0
  heldout_split: str = ""
  heldout_skip: int = 0
  data_dir: str = ""

  def __post_init__(self):
    _check_choice(f"data.sources.{self.name}", self.kind, SOURCE_KINDS)
    if not self.weight > 0:
      raise ValueError(f"data.sources.{self.name}.weight must be > 0 (got {self.weight}); "
                       "remove the source from data.sources to leave it out.")
    if self.skip < 0 or self.heldout_skip < 0:
      raise ValueError(f"data.sources.{self.name}: skip and heldout_skip must be >= 0.")


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
  """Tokenizer: the embedded SentencePiece model, a SentencePiece ``.model`` or an HF ``tokenizer.json``.

  Attributes:
    kind: embedded | sentencepiece | hf_json.
    path: local file for sentencepiece / hf_json (nothing is fetched at run time).
    vocab_size: vocabulary of the embedded tokenizer when it is trained (ignored otherwise).
    eos_id: document separator id; -1 = the tokenizer's own EOS.
  """

  kind: str = "embedded"
  path: str = ""
  vocab_size: int = 8192
  eos_id: int = -1

  def __post_init__(self):
    _check_choice("data.tokenizer", self.kind, TOKENIZER_KINDS)
    if self.vocab_size < 64:
      raise ValueError(f"data.tokenizer.vocab_size must be >= 64 (got {self.vocab_size}).")


@dataclasses.dataclass(frozen=True)
class HeldoutConfig:
  """The fixed held-out evaluation set (SPEC §1.4, §6.3).

  Attributes:
    seed: shuffles the held-out documents of each source.
    num_sequences: windows of seq_len + 1 tokens.
    path: where the set is written once; "" = the caller's default (``<workdir>/heldout.npz``).
  """

  seed: int = 4321
  num_sequences: int = 256
  path: str = ""

  def __post_init__(self):
    if self.num_sequences < 1:
      raise ValueError(f"data.heldout.num_sequences must be >= 1 (got {self.num_sequences}).")


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Everything the data layer needs.

  Attributes:
    sources: the mixture; document sampling probabilities are the normalised weights.
    tokenizer: see ``TokenizerConfig``.
    heldout: see ``HeldoutConfig``.
    seq_len: T; windows hold T + 1 tokens (inputs and shifted targets).
    shuffle_seed: document order seed, combined with the run seed.
    segment_ids: SPEC §6.4 — positions restart at document boundaries (and mixers reset state);
      False reproduces the papers (one stream window, positions 0..T).
    worker_count: Grain worker processes (0 = in the training process).
    cache_dir: tokenizer cache; "" = $FSLM_CACHE or ~/.cache/fixed_state_lm.
  """

  sources: tuple[SourceConfig, ...] = (SourceConfig(),)
  tokenizer: TokenizerConfig = TokenizerConfig()
  heldout: HeldoutConfig = HeldoutConfig()
  seq_len: int = 128
  shuffle_seed: int = 0
  segment_ids: bool = False
  worker_count: int = 0
  cache_dir: str = ""

  def __post_init__(self):
    if not self.sources:
      raise ValueError("data.sources is empty; give at least one source (the default is the embedded "
                       "corpus).")
    names = [s.name for s in self.sources]
    if len(set(names)) != len(names):
      raise ValueError(f"data.sources names must be unique (got {names}).")
    if self.seq_len < 1:
      raise ValueError(f"data.seq_len must be >= 1 (got {self.seq_len}).")
    if self.worker_count < 0:
      raise ValueError(f"data.worker_count must be >= 0 (got {self.worker_count}).")
