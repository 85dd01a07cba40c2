"""Evaluation reads what training reads: for every data setting, the held-out windows of a corpus whose
held-out set shares its training documents are the training windows, with the same positions and
segment ids, and the evaluation's loss over them is the training loss under the same parameters.

Each source repeats one document, so the held-out stream (its own shuffle, read once) and the training
stream (shuffled per epoch, repeated) are the same sequence of documents and window i of one is window
i of the other; a mixture interleaves its sources in the same order in both. Settings: several documents
packed per window ("abc...", 21 tokens with EOS) or one document spanning windows (52 tokens with
EOS), alone or mixed, each with segment ids on and off."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from data_cases import CharTokenizer
from lmcore import config as cfg_lib
from lmcore import loss as loss_lib
from lmcore.data import heldout as heldout_lib
from lmcore.data import pipeline
from lmcore.data.config import DataConfig, HeldoutConfig, SourceConfig
from lmcore.eval import evaluate
from lmcore.model import LanguageModel

SEQ_LEN, WINDOWS, EVAL_BATCH = 32, 4, 3  # the last evaluation batch holds one window
DOCUMENTS = {"packed": "the quick brown fox!", "spanning": "0123456789" * 5 + "."}
SETTINGS = {"packed": {"packed": 1.0}, "spanning": {"spanning": 1.0},
            "mixture": {"packed": 2.0, "spanning": 1.0}}


def data_config(tmp_path, setting: str, segment_ids: bool) -> DataConfig:
  sources = []
  for name, weight in SETTINGS[setting].items():
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"text": DOCUMENTS[name]}) + "\n" for _ in range(12)))
    sources.append(SourceConfig(name=name, kind="jsonl", path=str(path), weight=weight, heldout_fraction=0.0))
  return DataConfig(sources=tuple(sources), seq_len=SEQ_LEN, segment_ids=segment_ids,
                    heldout=HeldoutConfig(num_sequences=WINDOWS), cache_dir=str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def model():
  """One softmax layer with rotary positions and an untied head, weights random normals from numpy (no
  initialiser to compile): its loss depends on positions and segment ids."""
  config = cfg_lib.model_config(dict(vocab_size=CharTokenizer.vocab_size, d_model=16, n_layers=1,
                                     pattern="softmax*1", mlp="none", dtype="float32",
                                     tie_embeddings=False, mixers={"softmax": {"n_heads": 2}}))
  graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0))),
                                     nnx.Param, ...)
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape), x.dtype), params)
  return graphdef, params, rest


@jax.jit
def _token_nll(graphdef, params, rest, tokens, positions, segment_ids):
  return loss_lib.token_nll(loss_lib.forward(graphdef, params, rest, tokens[:, :-1], positions, segment_ids),
                            tokens[:, 1:])


@pytest.mark.parametrize("segment_ids", [False, True], ids=["one_stream", "segment_ids"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_heldout_windows_equal_training_windows_and_their_loss(tmp_path, model, setting, segment_ids):
  cfg = data_config(tmp_path, setting, segment_ids)
  tokenizer = CharTokenizer()
  iterator = pipeline.make_train_iterator(cfg, tokenizer, batch_size=WINDOWS, seed=0)
  train = next(iterator)
  iterator.close()
  heldout = heldout_lib.load_or_build_heldout(cfg, tokenizer, tmp_path / "heldout.npz")
  assert set(heldout) == set(train) == {"tokens", "segment_ids", "positions"}
  for key in train:
    np.testing.assert_array_equal(heldout[key], train[key], err_msg=key)
  assert (train["segment_ids"] > 1).any()  # documents meet inside windows: segment ids matter

  graphdef, params, rest = model
  use = lambda view: loss_lib.split_batch(view, segment_ids)[2:]  # noqa: E731  (positions, segment ids)
  train_nll = _token_nll(graphdef, params, rest, train["tokens"], *use(train))
  heldout_nll = _token_nll(graphdef, params, rest, heldout["tokens"], *use(heldout))
  np.testing.assert_array_equal(heldout_nll, train_nll)
  # The evaluation's token mean over batches of 3 and 1 windows equals the training windows' token mean,
  # and over the first batch only (train.eval_batches) that batch's.
  result = evaluate.heldout_loss(graphdef, params, rest, heldout, batch_size=EVAL_BATCH,
                                 use_segments=segment_ids, loss_impl="materialized")
  assert result["tokens"] == WINDOWS * SEQ_LEN
  np.testing.assert_allclose(result["loss"], float(np.mean(train_nll)), rtol=1e-6)
  first = evaluate.heldout_loss(graphdef, params, rest, heldout, batch_size=EVAL_BATCH, max_batches=1,
                                use_segments=segment_ids, loss_impl="materialized")
  assert first["tokens"] == EVAL_BATCH * SEQ_LEN  # train.eval_batches = 1: the first batch only
  np.testing.assert_allclose(first["loss"], float(np.mean(train_nll[:EVAL_BATCH])), rtol=1e-6)
