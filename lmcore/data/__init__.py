"""The data layer (MATH §6.1–§6.4): sources, mixtures, tokenizers, packing, held-out sets and the
embedded corpus.

Typical use::

  tokenizer = load_tokenizer(cfg.tokenizer, cache_dir(cfg))
  check_vocab(tokenizer, model_cfg.vocab_size)
  train_iter = make_train_iterator(cfg, tokenizer, batch_size=32, seed=0,
                                   process_index=jax.process_index(), process_count=jax.process_count())
  heldout = load_or_build_heldout(cfg, tokenizer, f"{workdir}/heldout.npz")
"""

from lmcore.data.config import DataConfig, HeldoutConfig, SourceConfig, TokenizerConfig
from lmcore.data.heldout import load_or_build_heldout, unigram_baseline, unigram_entropy
from lmcore.data.pipeline import cache_dir, check_paths, fingerprint, make_train_iterator, take_batches
from lmcore.data.sources import make_source
from lmcore.data.tokenizers import Tokenizer, check_vocab, load_tokenizer

__all__ = [
    "DataConfig", "HeldoutConfig", "SourceConfig", "TokenizerConfig", "Tokenizer", "cache_dir", "check_paths",
    "check_vocab", "fingerprint", "load_or_build_heldout", "load_tokenizer", "make_source", "make_train_iterator",
    "take_batches", "unigram_baseline", "unigram_entropy",
]
