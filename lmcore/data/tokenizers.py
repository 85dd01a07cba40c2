"""Tokenizers from local files (MATH §6.1): SentencePiece ``.model``, Hugging Face ``tokenizer.json``,
and the embedded SentencePiece model (MATH §6.2).

Every tokenizer is a small picklable object (Grain workers receive a copy): it holds the serialized
model and builds the backend lazily in each process.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Protocol

import sentencepiece as spm
import tokenizers as hf_tokenizers

from lmcore.data import embedded
from lmcore.data.config import TokenizerConfig
from lmcore.errors import DataError, MissingFileError

# Document separators tried, in order, when an HF tokenizer.json has no tokenizer_config.json beside it.
_HF_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")


class Tokenizer(Protocol):
  """What the data pipeline and the evaluators need from a tokenizer."""

  name: str
  vocab_size: int
  eos_id: int

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids) -> str: ...


class _Lazy:
  """Builds the backend from the serialized model on first use; pickles without it."""

  _backend = None

  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k != "_backend"}

  def __setstate__(self, state):
    self.__dict__.update(state)

  @property
  def backend(self):
    if self._backend is None:
      self._backend = self._build()
    return self._backend


class SentencePieceTokenizer(_Lazy):
  """A SentencePiece model given as its serialized bytes."""

  def __init__(self, model_proto: bytes, *, name: str, eos_id: int = -1):
    self._model_proto = model_proto
    self.name = name
    self.vocab_size = self.backend.get_piece_size()
    self.eos_id = eos_id if eos_id >= 0 else self.backend.eos_id()
    if self.eos_id < 0:
      raise DataError(f"SentencePiece model {name} defines no EOS piece; set data.tokenizer.eos_id "
                       "to the id that separates documents.")

  def _build(self):
    return spm.SentencePieceProcessor(model_proto=self._model_proto)

  def encode(self, text: str) -> list[int]:
    return self.backend.encode(text, out_type=int)

  def decode(self, ids) -> str:
    # Ids past the pieces (padding rows of a larger embedding table, which a model can still sample)
    # decode to nothing, as the Hugging Face decoder does.
    return self.backend.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])


class HuggingFaceTokenizer(_Lazy):
  """A Hugging Face ``tokenizers`` model given as its ``tokenizer.json`` text."""

  def __init__(self, tokenizer_json: str, *, name: str, eos_id: int = -1, eos_token: str | None = None):
    self._json = tokenizer_json
    self.name = name
    vocab = self.backend.get_vocab(with_added_tokens=True)
    self.vocab_size = max(self.backend.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1)
    self.eos_id = eos_id if eos_id >= 0 else self._find_eos(vocab, eos_token)

  def _build(self):
    return hf_tokenizers.Tokenizer.from_str(self._json)

  def _find_eos(self, vocab: dict[str, int], eos_token: str | None) -> int:
    for token in ((eos_token,) if eos_token else ()) + _HF_EOS_CANDIDATES:
      if token in vocab:
        return vocab[token]
    raise DataError(f"Tokenizer {self.name} has none of the EOS tokens {_HF_EOS_CANDIDATES}; set "
                     "data.tokenizer.eos_id to the id that separates documents.")

  def encode(self, text: str) -> list[int]:
    return self.backend.encode(text, add_special_tokens=False).ids

  def decode(self, ids) -> str:
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)


def _read_local(cfg: TokenizerConfig) -> tuple[pathlib.Path, bytes]:
  if not cfg.path:
    raise MissingFileError(f"data.tokenizer.kind={cfg.kind!r} needs a local file: set data.tokenizer.path "
                            "(or use data.tokenizer.kind='embedded'); nothing is downloaded at run time.")
  path = pathlib.Path(cfg.path).expanduser()
  if not path.is_file():
    wanted = "SentencePiece .model" if cfg.kind == "sentencepiece" else "tokenizer.json"
    raise MissingFileError(f"data.tokenizer.path={cfg.path!r} does not exist. Point data.tokenizer.path "
                            f"at a local {wanted} file (nothing is downloaded at run time), or use "
                            "data.tokenizer.kind='embedded'.")
  return path, path.read_bytes()


def _hf_config_eos(path: pathlib.Path) -> str | None:
  """The ``eos_token`` of a ``tokenizer_config.json`` next to ``tokenizer.json`` (HF convention)."""
  config_path = path.with_name("tokenizer_config.json")
  if not config_path.is_file():
    return None
  eos = json.loads(config_path.read_text()).get("eos_token")
  return eos.get("content") if isinstance(eos, dict) else eos


def load_tokenizer(cfg: TokenizerConfig, cache_dir: str = "") -> Tokenizer:
  """The tokenizer ``cfg`` names; the embedded one is trained on first use and cached in ``cache_dir``."""
  if cfg.kind == "embedded":
    data = embedded.tokenizer_model_path(cfg.vocab_size, cache_dir).read_bytes()
    name = f"embedded-stdlib-bpe{cfg.vocab_size}-{hashlib.sha256(data).hexdigest()[:12]}"
    return SentencePieceTokenizer(data, name=name, eos_id=cfg.eos_id)
  path, data = _read_local(cfg)
  name = f"{cfg.kind}:{path.name}-{hashlib.sha256(data).hexdigest()[:12]}"
  try:
    if cfg.kind == "sentencepiece":
      return SentencePieceTokenizer(data, name=name, eos_id=cfg.eos_id)
    return HuggingFaceTokenizer(data.decode("utf-8"), name=name, eos_id=cfg.eos_id,
                                eos_token=_hf_config_eos(path))
  except DataError:
    raise
  except Exception as e:  # the backends raise RuntimeError / Exception subclasses of their own
    wanted = "SentencePiece .model" if cfg.kind == "sentencepiece" else "tokenizer.json"
    raise DataError(f"data.tokenizer.path={cfg.path!r} is not a readable {wanted} ({type(e).__name__}: "
                    f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); check "
                    "data.tokenizer.kind and data.tokenizer.path.") from e


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
  """Raises ValueError when token ids (or the EOS id) would index past the model's embedding table."""
  largest = max(tokenizer.vocab_size, tokenizer.eos_id + 1)
  if largest > model_vocab_size:
    raise DataError(f"Tokenizer {tokenizer.name} produces ids up to {largest - 1} (vocab "
                     f"{tokenizer.vocab_size}, eos_id {tokenizer.eos_id}) but "
                     f"model.vocab_size={model_vocab_size}. Set model.vocab_size >= {largest} or choose a "
                     "smaller tokenizer under data.tokenizer.")
