"""The learned absolute position table (``model.max_positions``) against the known-good recipe
(GPT-2 as nanoGPT and Hugging Face train it): initialised like the token embedding, N(0, init_std =
0.02); trained at the schedule's learning rate with no weight decay; positions 0..T-1 along each
window when documents are not marked, and restarting at each document when they are (MATH §6.4), so
that a document packed after another gets exactly the logits it gets alone."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lmcore import config as cfg_lib
from lmcore.model import LanguageModel
from lmcore.train.optim import make_optimizer, weight_decay_mask

VOCAB = 61


def table_model(**fields) -> LanguageModel:
  values = dict(vocab_size=VOCAB, d_model=32, n_layers=1, pattern="softmax*1", mlp_hidden=48, max_positions=32,
                dtype="float32", mixers={"softmax": {"n_heads": 4, "rope": False}})
  return LanguageModel(cfg_lib.model_config({**values, **fields}), rngs=nnx.Rngs(0))


def test_the_table_starts_like_the_token_embedding_at_init_std():
  model = table_model(max_positions=1024, d_model=64, init_std=0.02)
  table_PxD = np.asarray(model.pos_embed.embedding[...])
  # 65,536 draws: the sample std is within 1 % of 0.02 with overwhelming probability (its relative
  # standard error is 1 / sqrt(2 n) = 0.28 %).
  assert table_PxD.shape == (1024, 64)
  assert abs(table_PxD.std() / 0.02 - 1) < 0.01 and abs(table_PxD.mean()) < 0.02 * 0.02


def test_the_table_trains_at_the_learning_rate_without_weight_decay():
  """One AdamW step with zero gradients moves only what is decayed: the kernels shrink by lr · wd, the
  table (like the token embedding and the norms) stays; a gradient on the table moves it by about lr
  (Adam's first step is lr · sign(g))."""
  train = cfg_lib.TrainConfig(learning_rate=1e-2, warmup_steps=0, weight_decay=0.1, steps=10)
  _, params, _ = nnx.split(table_model(), nnx.Param, ...)
  params = nnx.to_pure_dict(params)
  mask = weight_decay_mask(params)
  assert mask["pos_embed"]["embedding"] is False and mask["embed"]["embedding"] is False
  tx = make_optimizer(train)
  step = jax.jit(lambda grads: tx.update(grads, tx.init(params), params)[0])
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates = step(zeros)
  assert np.abs(np.asarray(updates["pos_embed"]["embedding"])).max() == 0.0
  kernel = params["blocks"][0]["mixer"]["wq"]["kernel"]
  np.testing.assert_allclose(updates["blocks"][0]["mixer"]["wq"]["kernel"], -1e-2 * 0.1 * kernel, rtol=1e-5)
  grads = jax.tree.map(jnp.zeros_like, params)
  grads["pos_embed"]["embedding"] = jnp.ones_like(params["pos_embed"]["embedding"])
  updates = step(grads)
  np.testing.assert_allclose(updates["pos_embed"]["embedding"], -1e-2, rtol=1e-3)
  moved = optax.apply_updates(params, updates)
  assert not np.allclose(moved["pos_embed"]["embedding"], params["pos_embed"]["embedding"])


def test_a_packed_document_reads_the_table_from_its_own_start():
  """Row [A (5 tokens) | B (11 tokens)] with segment ids and per-document positions: B's logits equal
  those of B alone at positions 0..10; read at window positions 5..15 (no segment ids) they differ."""
  graphdef, state = nnx.split(table_model())
  forward = jax.jit(lambda tokens, **kw: nnx.merge(graphdef, state)(tokens, **kw)[0])
  rng = np.random.default_rng(0)
  a, b = rng.integers(1, VOCAB, 5), rng.integers(1, VOCAB, 11)
  row_1xT = jnp.asarray(np.concatenate([a, b])[None], jnp.int32)
  segment_ids_1xT = jnp.asarray(np.r_[np.ones(5), 2 * np.ones(11)][None], jnp.int32)
  positions_1xT = jnp.asarray(np.r_[np.arange(5), np.arange(11)][None], jnp.int32)
  packed = forward(row_1xT, positions_BxT=positions_1xT, segment_ids_BxT=segment_ids_1xT)
  alone = forward(jnp.asarray(b[None], jnp.int32))
  np.testing.assert_allclose(packed[0, 5:], alone[0], rtol=1e-5, atol=1e-5)
  stream = forward(row_1xT, segment_ids_BxT=segment_ids_1xT)  # positions 0..15 along the window
  assert np.abs(np.asarray(stream[0, 5:] - alone[0])).max() > 1e-3
