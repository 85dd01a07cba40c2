"""Sampling as ``Sampling`` defines it: every step draws with its own randomness, a seed reproduces a
sample, top-k keeps the k largest logits, top-p the smallest set whose probability reaches p (after the
temperature), and a temperature near 0 is greedy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lmcore import config as cfg_lib
from lmcore.eval.generate import Sampling, generate, sample_logits
from lmcore.model import LanguageModel

VOCAB = 61


PROMPTS = [[1, 2, 3], [4]]
TEMPERATURE_1 = Sampling(temperature=1.0)


@pytest.fixture(scope="module")
def uniform_model():
  """A one-layer softmax model whose untied head is zero: every logit is 0 after every prefix, so each
  step is one uniform draw over the vocabulary. Its other weights are random normals from numpy (no
  initialiser to compile)."""
  config = cfg_lib.model_config(dict(vocab_size=VOCAB, d_model=16, n_layers=1, pattern="softmax*1",
                                     mlp="none", dtype="float32", tie_embeddings=False,
                                     mixers={"softmax": {"n_heads": 2}}))
  graphdef, state = nnx.split(nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(0)
  state = jax.tree.map(lambda x: jnp.asarray(0.3 * rng.normal(size=x.shape), x.dtype), state)
  model = nnx.merge(graphdef, state)
  model.head.kernel.set_value(jnp.zeros_like(model.head.kernel[...]))
  return model


def test_every_step_draws_with_its_own_randomness(uniform_model):
  """Identical uniform logits at every step: 48 steps of 2 rows are 96 draws from 61 tokens. Independent
  draws give about 33 distinct tokens per row and a repeat of the previous token with probability 1/61;
  one key reused for every step would give a single token per row. The bounds hold for this seed with a
  wide margin (fewer than 20 distinct tokens in 48 independent draws has probability below 1e-6)."""
  rows = generate(uniform_model, PROMPTS, max_new_tokens=48, sampling=TEMPERATURE_1, seed=3)
  for row in rows:
    assert len(row) == 48
    assert len(set(row)) >= 20, row
    assert sum(a == b for a, b in zip(row, row[1:])) <= 6, row
  assert rows[0] != rows[1]  # rows draw independently too


def test_the_same_seed_gives_the_same_sample_and_another_seed_another(uniform_model):
  first = generate(uniform_model, PROMPTS, max_new_tokens=48, sampling=TEMPERATURE_1, seed=7)
  assert generate(uniform_model, PROMPTS, max_new_tokens=48, sampling=TEMPERATURE_1, seed=7) == first
  assert generate(uniform_model, PROMPTS, max_new_tokens=48, sampling=TEMPERATURE_1, seed=8) != first


def test_top_k_never_draws_outside_each_rows_k_largest_logits():
  """512 rows of different random logits, 3 draws each: every draw is among its own row's 5 largest
  logits, and every one of those 5 is drawn somewhere."""
  logits_BxV = jax.random.normal(jax.random.key(0), (512, 40)) * 3.0
  top5_Bx5 = np.argsort(-np.asarray(logits_BxV), axis=-1)[:, :5]
  ranks = []
  for seed in range(3):
    draws_B = np.asarray(sample_logits(logits_BxV, jax.random.key(seed), Sampling(top_k=5)))
    assert all(draw in top for draw, top in zip(draws_B, top5_Bx5))
    ranks += [int(np.flatnonzero(top == draw)[0]) for draw, top in zip(draws_B, top5_Bx5)]
  assert set(ranks) == set(range(5))


def _kept(logits_V, sampling, n=4000):
  logits_NxV = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (n, len(logits_V)))
  draws = np.asarray(sample_logits(logits_NxV, jax.random.key(0), sampling))
  return set(draws.tolist()), np.bincount(draws, minlength=len(logits_V)) / n


def test_top_p_keeps_the_smallest_set_reaching_p_of_the_tempered_probabilities():
  """By hand: logits log [0.1, 0.6, 0.25, 0.05] (unsorted). At temperature 1 the sorted probabilities are
  0.6, 0.25, 0.1, 0.05: top_p 0.55 keeps {1}, 0.8 keeps {1, 2}, 0.9 keeps {1, 2, 0}. At temperature 2
  they are proportional to their square roots (0.467, 0.301, 0.190, 0.042): top_p 0.55 keeps {1, 2}.
  The kept tokens are drawn in proportion to their (tempered) probabilities."""
  probs = np.array([0.1, 0.6, 0.25, 0.05])
  logits = np.log(probs)
  assert _kept(logits, Sampling(top_p=0.55))[0] == {1}
  assert _kept(logits, Sampling(top_p=0.8))[0] == {1, 2}
  kept, freq = _kept(logits, Sampling(top_p=0.9))
  assert kept == {0, 1, 2}
  np.testing.assert_allclose(freq[[1, 2, 0]], probs[[1, 2, 0]] / 0.95, atol=0.03)
  tempered = np.sqrt(probs) / np.sqrt(probs).sum()
  kept, freq = _kept(logits, Sampling(temperature=2.0, top_p=0.55))
  assert kept == {1, 2}
  np.testing.assert_allclose(freq[[1, 2]], tempered[[1, 2]] / tempered[[1, 2]].sum(), atol=0.03)


def test_a_temperature_near_zero_samples_greedily():
  """512 rows, each a random permutation of 40 logits 0.1 apart: at temperature 1e-3 the runner-up has
  probability below e^-100, so every draw is the argmax, as at temperature 0."""
  rng = np.random.default_rng(2)
  logits_BxV = np.stack([rng.permutation(np.linspace(0.0, 3.9, 40)) for _ in range(512)]).astype(np.float32)
  for temperature in (1e-3, 0.0):
    draws = sample_logits(jnp.asarray(logits_BxV), jax.random.key(2), Sampling(temperature=temperature))
    np.testing.assert_array_equal(np.asarray(draws), logits_BxV.argmax(-1), err_msg=f"T = {temperature}")
