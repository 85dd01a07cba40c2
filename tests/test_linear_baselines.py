"""Linear Transformer, Performer and cosFormer: their feature maps, the stabilised Performer, and
that chunked, recurrent and token-by-token decoding compute the same function.

Tolerances: relative L2 error 1e-5 at fp32 (the implementations differ only in summation order).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lmcore.registry import mixer_class
from lmcore.mixers.base import InitSpec
from lmcore.mixers.cyfa import CyFA
from lmcore.mixers.gla import GLA
from lmcore.mixers.linear_attention import CosFormer, LinearTransformer, Performer, RandomFeatures
from lmcore.numerics import relative_l2

RTOL = 1e-5
D = 16
INIT = InitSpec(std=0.3, out_std=0.3)


@nnx.jit
def _call(mixer, x_BxTxD, state, segment_ids_BxT):
  return mixer(x_BxTxD, state=state, segment_ids_BxT=segment_ids_BxT)


def _x(seed, B=2, T=37, scale=1.0):
  return jnp.asarray(scale * np.random.default_rng(seed).normal(size=(B, T, D)), jnp.float32)


def _mixer(cls, seed=0, **fields):
  tiles = {"chunk": 16} if fields.get("implementation", "chunked") == "chunked" else None
  config = cls.Config(n_heads=2, head_dim=8, tiles=tiles, **fields)
  return cls(config, d_model=D, init=INIT, rngs=nnx.Rngs(seed))


CASES = [(LinearTransformer, {}), (Performer, dict(n_features=12)),
         (Performer, dict(n_features=12, stabilize=False)), (CosFormer, dict(max_len=64))]


@pytest.mark.parametrize("cls,fields", CASES)
def test_chunked_equals_recurrent_and_decode_equals_full_forward(cls, fields):
  chunked = _mixer(cls, 1, **fields)
  recurrent = _mixer(cls, 1, implementation="recurrent", **fields)
  x = _x(1)
  y, state = _call(chunked, x, None, None)
  y_ref, state_ref = _call(recurrent, x, None, None)
  assert relative_l2(y, y_ref) < RTOL
  decode_state, ys = chunked.init_state(x.shape[0]), []
  for t in range(x.shape[1]):
    y_t, decode_state = _call(chunked, x[:, t:t + 1], decode_state, None)
    ys.append(y_t)
  assert relative_l2(jnp.concatenate(ys, axis=1), y) < RTOL
  leaves = (jax.tree.leaves(s) for s in (decode_state, state, state_ref))
  for got, want, ref in zip(*leaves):
    if np.isfinite(np.asarray(want, np.float64)).all():
      assert relative_l2(got, want) < RTOL and relative_l2(want, ref) < RTOL
    else:  # the unstabilised Performer never sets its key max (-inf)
      np.testing.assert_array_equal(got, want)


def test_performer_random_features_are_orthogonal_fixed_buffers_and_features_positive():
  performer = _mixer(Performer, 2, n_features=12)
  W = np.asarray(performer.features[...])  # [H, m, d]; rows 0..7 form one orthogonal block
  gram = W[:, :8] @ np.swapaxes(W[:, :8], 1, 2)
  off_diagonal = gram * (1 - np.eye(8))
  np.testing.assert_allclose(off_diagonal, 0.0, atol=1e-4)
  assert isinstance(performer.features, RandomFeatures)
  assert not isinstance(performer.features, nnx.Param)
  assert [x.shape for x in jax.tree.leaves(nnx.state(performer, RandomFeatures))] == [W.shape]
  params = jax.tree.leaves(nnx.state(performer, nnx.Param))
  assert sum(p.size for p in params) == 4 * D * 16  # the projections only: W gets no gradient
  q = performer.wq(_x(2)).reshape(2, 37, 2, 8)
  assert (np.exp(np.asarray(performer.log_features(q))) > 0).all()


def test_performer_features_estimate_the_softmax_kernel():
  """E[φ(q)·φ(k)] = exp(q·k / sqrt(d)); with m = 4096 features and |q|, |k| ≈ 1 the Monte-Carlo
  error is about 1 % (the estimator's spread grows like exp(|q + k|²) / sqrt(m))."""
  config = Performer.Config(n_heads=1, head_dim=8, n_features=4096)
  performer = Performer(config, d_model=D, init=INIT, rngs=nnx.Rngs(3))
  rng = np.random.default_rng(3)
  q, k = (jnp.asarray(0.35 * rng.normal(size=(1, 6, 1, 8)), jnp.float32) for _ in range(2))
  phi_q, phi_k = jnp.exp(performer.log_features(q)), jnp.exp(performer.log_features(k))
  estimate = jnp.einsum("bthm,bshm->ts", phi_q, phi_k)
  exact = jnp.exp(jnp.einsum("bthd,bshd->ts", q, k) / jnp.sqrt(8.0))
  assert relative_l2(estimate, exact) < 0.03


def test_stabilised_performer_equals_plain_performer_on_moderate_inputs():
  """The subtracted maxima cancel between numerator and normaliser (up to eps)."""
  x = _x(4)
  y_plain, _ = _call(_mixer(Performer, 4, n_features=12, stabilize=False), x, None, None)
  y_stable, _ = _call(_mixer(Performer, 4, n_features=12, stabilize=True), x, None, None)
  assert relative_l2(y_stable, y_plain) < 1e-4


def test_stabilised_performer_is_finite_for_inputs_of_magnitude_1e3():
  performer = _mixer(Performer, 5, n_features=12)
  x = _x(5, scale=1e3)
  y, state = _call(performer, x, None, None)
  assert all(np.isfinite(np.asarray(a)).all() for a in jax.tree.leaves((y, state)))
  assert np.abs(np.asarray(y)).max() > 0  # not everything underflowed to zero

  def loss(mixer):
    return jnp.sum(mixer(x)[0] ** 2)

  grads = nnx.jit(nnx.grad(loss))(performer)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_stabilised_performer_keeps_packed_documents_independent():
  """The running key max restarts with the state, so each document equals its own run exactly."""
  performer = _mixer(Performer, 6, n_features=12)
  x = _x(6, B=1, T=36)
  segment_ids = jnp.asarray(np.repeat([0, 1, 2], 12)[None], jnp.int32)
  y, _ = _call(performer, x, None, segment_ids)
  pieces = [_call(performer, x[:, a:a + 12], None, None)[0] for a in (0, 12, 24)]
  assert relative_l2(y, jnp.concatenate(pieces, axis=1)) < RTOL


def test_cosformer_equals_direct_cos_reweighted_attention():
  """o_i = sum_j w_ij v_j / (sum_j w_ij + eps), w_ij = relu(q_i)·relu(k_j) cos(π (i - j) / 2M)."""
  cosformer = _mixer(CosFormer, 7, max_len=64)
  x = _x(7)
  y, state = _call(cosformer, x, None, None)
  split = lambda a: np.asarray(a, np.float64).reshape(2, 37, 2, 8)
  q, k, v = (split(w(x)) for w in (cosformer.wq, cosformer.wk, cosformer.wv))
  i = np.arange(37)
  cos_TxT = np.cos(np.pi * (i[:, None] - i[None, :]) / 128) * (i[:, None] >= i[None, :])
  w = np.einsum("bihd,bjhd->bhij", np.maximum(q, 0), np.maximum(k, 0)) * cos_TxT
  o = np.einsum("bhij,bjhd->bihd", w, v) / (w.sum(-1).transpose(0, 2, 1)[..., None] + 1e-6)
  want = o.reshape(2, 37, 16) @ np.asarray(cosformer.wo.kernel[...], np.float64)
  assert relative_l2(y, want) < RTOL
  np.testing.assert_array_equal(state.position, [37, 37])


@pytest.mark.parametrize("cls,fields", CASES)
def test_state_bytes_match_the_state(cls, fields):
  mixer = _mixer(cls, **fields)
  assert mixer.state_bytes(3) == sum(a.nbytes for a in jax.tree.leaves(mixer.init_state(3)))


def test_registry_resolves_the_linear_attention_mixers():
  expected = {"gla": GLA, "cyfa": CyFA, "linear_transformer": LinearTransformer,
              "performer": Performer, "cosformer": CosFormer}
  assert {kind: mixer_class(kind) for kind in expected} == expected
