"""Packed windows through the model (MATH §6.4): with ``data.segment_ids`` on, a window that packs
several documents trains exactly as the documents would one by one.

The windows come from the real pipeline (several short documents per row, one a single character,
documents continued from the previous window), the model has one layer of every registered mixer
kind, and the reference runs each document of a window alone (no segment ids, positions from 0),
its documents found from the text (EOS) rather than from the segment ids under test. Checked: the
inputs, targets, positions and segment ids the loss feeds the model line up; every block's output on
every document's tokens; every token's next-token loss. The mixers start with the weak decays of
initialisation, where a missed reset shows."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lmcore import config as cfg_lib
from lmcore.data import pipeline
from lmcore.data.config import DataConfig, SourceConfig
from lmcore.model import LanguageModel
from lmcore.numerics import relative_l2
from lmcore.registry import mixer_kinds
from lmcore import loss as loss_lib
from data_cases import CharTokenizer

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
SEQ = 24
# Small sizes for the kinds this repository registers, chunks of 8 so that documents cross chunk
# boundaries; a kind registered later runs with its defaults. Taylor's "auto" takes segment ids
# ("chunked" does not).
CHUNK = {"tiles": {"chunk": 8}}
SMALL = {"softmax": {"n_heads": 2}, "gla": {"n_heads": 2, **CHUNK},
         "cyfa": {"n_heads": 2, "head_dim": 8, "v_head_dim": 8, **CHUNK},
         "gdn": {"n_heads": 2, "head_dim": 8, **CHUNK},
         "linear_transformer": {"n_heads": 2, "head_dim": 8, **CHUNK},
         "performer": {"n_heads": 2, "head_dim": 8, "n_features": 8, **CHUNK},
         "cosformer": {"n_heads": 2, "head_dim": 8, "max_len": 64, **CHUNK},
         "sanatan": {"n_heads": 2, "head_dim": 8, "implementation": "chunked", **CHUNK},
         "taylor": {"n_heads": 2, "feature_dim": 4, "implementation": "auto"},
         "swa": {"n_heads": 2, "window": 4, "block_size": 8}}
TEXTS = ["abcdefg", "h", "ijklmnopqrstuvwxyzABCDEFGHIJKLM", "NO", "PQRSTUVWXY", "Z0123", "456789abcdefghij"]


@pytest.fixture(scope="module")
def windows(tmp_path_factory):
  """Two batches of 2 windows of SEQ + 1 tokens from the pipeline, segment ids on."""
  path = tmp_path_factory.mktemp("packing") / "docs.jsonl"
  path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
  cfg = DataConfig(sources=(SourceConfig(name="docs", kind="jsonl", path=str(path)),), seq_len=SEQ,
                   segment_ids=True)
  batches = pipeline.take_batches(pipeline.make_train_iterator(cfg, CharTokenizer(), batch_size=2,
                                                               seed=0), 2)
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


@pytest.fixture(scope="module")
def model():
  kinds = mixer_kinds()
  config = cfg_lib.model_config(dict(
      vocab_size=CharTokenizer.vocab_size, d_model=32, n_layers=len(kinds), mlp="none",
      pattern=",".join(f"{kind}*1" for kind in kinds), dtype="float32",
      mixers={kind: SMALL.get(kind, {}) for kind in kinds}))
  return kinds, LanguageModel(config, rngs=nnx.Rngs(0))


def documents(inputs_BxT):
  """(row, start, stop) of every document piece of the inputs, found from the text alone: a document
  starts at a window's first token and after every EOS."""
  docs = []
  for row, tokens in enumerate(np.asarray(inputs_BxT)):
    starts = np.flatnonzero(np.r_[True, tokens[:-1] == CharTokenizer.eos_id])
    docs += [(row, int(s), int(e)) for s, e in zip(starts, np.r_[starts[1:], len(tokens)])]
  return docs


def compiled(fn, *args):
  return jax.jit(fn).lower(*args).compile(compiler_options=FAST_COMPILE)(*args)


def block_outputs(graphdef, state, tokens_BxT, positions_BxT, segment_ids_BxT):
  """Every block's output [L, B, T, D] and the logits, in one forward pass."""
  model = nnx.merge(graphdef, state)
  h = model._embed(tokens_BxT, positions_BxT)
  outputs = []
  for block in model.blocks:
    h, _ = block(h, None, positions_BxT, segment_ids_BxT)
    outputs.append(h)
  return jnp.stack(outputs), model.logits(model.final_norm(h))


def test_windows_pack_several_documents_per_row(windows):
  """The regime the tests below need: rows of three or more documents, one a single character, and
  documents cut by the window's end."""
  docs = documents(windows["tokens"][:, :-1])
  counts = [sum(1 for r, _, _ in docs if r == row) for row in range(len(windows["tokens"]))]
  assert sum(c >= 3 for c in counts) >= 2, counts
  assert any(stop - start == 2 for _, start, stop in docs)  # "h" + EOS
  assert (windows["tokens"][:, -1] != CharTokenizer.eos_id).any()  # a document goes on in the next window


def test_split_batch_aligns_inputs_targets_positions_and_segment_ids(windows):
  """What the model is fed: inputs are a window's first T tokens, each with its own position and
  segment id; targets the next tokens. A document starts right after an EOS, exactly where its
  segment id changes and its position is 0."""
  batch = {k: jnp.asarray(v) for k, v in windows.items()}
  inputs, targets, positions, segment_ids = map(np.asarray, loss_lib.split_batch(batch, True))
  tokens = windows["tokens"]
  np.testing.assert_array_equal(inputs, tokens[:, :-1])
  np.testing.assert_array_equal(targets, tokens[:, 1:])
  starts = np.concatenate([np.ones((len(inputs), 1), bool), inputs[:, :-1] == CharTokenizer.eos_id], 1)
  np.testing.assert_array_equal(positions == 0, starts)
  np.testing.assert_array_equal(segment_ids[:, 1:] != segment_ids[:, :-1], starts[:, 1:])
  assert (positions[:, 1:][~starts[:, 1:]] == positions[:, :-1][~starts[:, 1:]] + 1).all()
  unsegmented = loss_lib.split_batch(batch, False)
  assert unsegmented[2] is None and unsegmented[3] is None


def test_packed_windows_equal_their_documents_run_alone_in_every_layer(windows, model):
  """Every block's output on each document's tokens, and the next-token loss of every token of the
  window (targets included), equal those of the document run alone."""
  kinds, model = model
  graphdef, state = nnx.split(model)
  batch = {k: jnp.asarray(v) for k, v in windows.items()}
  inputs, targets, positions, segment_ids = loss_lib.split_batch(batch, use_segments=True)
  outputs, logits = compiled(lambda state, t, p, s: block_outputs(graphdef, state, t, p, s), state,
                             inputs, positions, segment_ids)

  # Each document alone: its tokens first in a row of the longest document's length (the tokens
  # after it, taken cyclically from its window, cannot change its outputs), no segment ids.
  docs = documents(inputs)
  L = max(stop - start for _, start, stop in docs)
  T = inputs.shape[1]
  rows = np.asarray([[row] * L for row, _, _ in docs])
  cols = np.asarray([(start + np.arange(L)) % T for _, start, _ in docs])
  alone_tokens = inputs[rows, cols]
  alone_positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), alone_tokens.shape)
  alone_outputs, alone_logits = compiled(
      lambda state, t, p: block_outputs(graphdef, state, t, p, None), state, alone_tokens,
      alone_positions)

  errors = {}
  nll = np.asarray(loss_lib.token_nll(logits, targets), np.float64)
  alone_nll = np.zeros_like(nll)
  for d, (row, start, stop) in enumerate(docs):
    n = stop - start
    for layer, kind in enumerate(kinds):
      e = relative_l2(outputs[layer, row, start:stop], alone_outputs[layer, d, :n])
      if e > 1e-5:
        errors.setdefault((layer, kind), []).append((row, start, stop, round(e, 6)))
    alone_nll[row, start:stop] = loss_lib.token_nll(alone_logits[d, :n], targets[row, start:stop])
  report = {f"layer {layer} ({kind})": pieces for (layer, kind), pieces in sorted(errors.items())}
  assert not report, ("packed windows differ from their documents run alone, per layer as (row, start, "
                      "stop, relative L2); the first layer listed holds the first mixer that lets "
                      f"documents interact: {report}")
  assert relative_l2(nll, alone_nll) < 1e-5
