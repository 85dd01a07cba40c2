"""SANATAN feature maps (MATH §1.1) against direct numpy transcriptions of each formula."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sanatan_jax import features



@pytest.fixture(autouse=True)
def _no_implicit_rank_promotion():
  with jax.numpy_rank_promotion("raise"):
    yield

# fp32 evaluation of trig/tanh against float64 numpy: a few ulps of values of order 1-100.
RTOL, ATOL = 1e-5, 1e-5


def _np_roots(theta, omega, gamma=10.0):
  return np.tanh(gamma * (np.cos(theta + omega) - np.sin(theta + omega)))


def _np_phi(theta_rot, r, channels):
  """Phi_a stacked per dimension a, then concatenated over a (MATH §1.1 step 5)."""
  c, s = np.cos(theta_rot), np.sin(theta_rot)
  one = np.ones_like(theta_rot)
  blocks = {6: [one, c, s, r, r * c, r * s], 4: [one, r, r * c, r * s], 3: [one, c, s]}[channels]
  d = theta_rot.shape[-1]
  return np.concatenate([np.stack([b[..., a] for b in blocks], -1) for a in range(d)], axis=-1)


def _random_angles(rng, shape):
  u = rng.normal(size=shape) * np.exp(rng.uniform(np.log(0.01), np.log(50.0), size=shape))
  return np.pi * u / (1 + np.abs(u))


def test_angles_match_formula_and_stay_in_open_interval():
  rng = np.random.default_rng(0)
  u = rng.normal(size=1000) * np.exp(rng.uniform(-8, 8, size=1000))
  theta = np.asarray(features.angles(jnp.asarray(u, jnp.float32)))
  np.testing.assert_allclose(theta, np.pi * u / (1 + np.abs(u)), rtol=RTOL, atol=ATOL)
  assert np.all(np.abs(theta) <= np.pi)


def test_soft_roots_match_formula():
  rng = np.random.default_rng(1)
  theta = _random_angles(rng, (3, 5, 2, 4))
  omega = np.pi / 4 + 0.5 * rng.normal(size=(2, 4))
  r = features.soft_roots(jnp.asarray(theta, jnp.float32), jnp.asarray(omega, jnp.float32))
  np.testing.assert_allclose(np.asarray(r), _np_roots(theta, omega), rtol=RTOL, atol=ATOL)


def test_roots_saturate_exactly_between_0p0637_and_15p69_at_omega_pi_over_4():
  u = np.concatenate([np.geomspace(1e-4, 1e4, 4001), -np.geomspace(1e-4, 1e4, 4001)])
  # Leave out hairlines around the thresholds, where fp32 rounding decides the side.
  a = np.abs(u)
  u = u[(np.abs(a - 0.06375) > 2e-4) & (np.abs(a - 15.686) > 2e-2)]
  theta = features.angles(jnp.asarray(u, jnp.float32))
  r = np.asarray(features.soft_roots(theta, jnp.float32(math.pi / 4)))
  inside = (np.abs(u) > 0.0637) & (np.abs(u) < 15.69)
  np.testing.assert_array_equal(np.abs(r) > 0.99, inside)
  # At omega = pi/4 the root is -tanh(10 sqrt(2) sin theta), i.e. about -sign(u).
  np.testing.assert_array_equal(np.sign(r[inside]), -np.sign(u[inside]))


def test_rotate_matches_formula():
  rng = np.random.default_rng(2)
  theta = _random_angles(rng, (2, 7, 3, 4))
  positions = rng.integers(0, 2048, size=(2, 7))
  lam_raw = rng.normal(size=(3, 4))
  expected = theta + positions[:, :, None, None] * 0.01 * np.tanh(lam_raw)
  got = features.rotate(jnp.asarray(theta, jnp.float32), jnp.asarray(positions, jnp.int32),
                        jnp.asarray(lam_raw, jnp.float32))
  np.testing.assert_allclose(np.asarray(got), expected, rtol=RTOL, atol=1e-4)


@pytest.mark.parametrize("channels", [6, 4, 3])
def test_feature_map_concatenates_per_dimension_blocks(channels):
  rng = np.random.default_rng(3 + channels)
  theta_rot = _random_angles(rng, (2, 5, 2, 4))
  r = np.tanh(3 * rng.normal(size=theta_rot.shape))
  phi = features.feature_map(jnp.asarray(theta_rot, jnp.float32), jnp.asarray(r, jnp.float32),
                             channels)
  assert phi.shape == (2, 5, 2, channels * 4)
  np.testing.assert_allclose(np.asarray(phi), _np_phi(theta_rot, r, channels), rtol=RTOL, atol=ATOL)


def _kernel_inputs(seed, n=64, d=8):
  rng = np.random.default_rng(seed)
  th_q, th_k = _random_angles(rng, (n, d)), _random_angles(rng, (n, d))
  # Roots pushed to saturation so the +-1 gate extremes are exercised.
  r_q, r_k = np.tanh(5 * rng.normal(size=(n, d))), np.tanh(5 * rng.normal(size=(n, d)))
  return th_q, th_k, r_q, r_k


def _dots(th_q, th_k, r_q, r_k, channels):
  def f(th, r):
    r = None if r is None else jnp.asarray(r, jnp.float32)
    return np.asarray(features.feature_map(jnp.asarray(th, jnp.float32), r, channels))

  return np.sum(f(th_q, r_q) * f(th_k, r_k), axis=-1, dtype=np.float64)


def test_six_channel_dot_product_is_gated_angular_kernel_in_0_4d():
  th_q, th_k, r_q, r_k = _kernel_inputs(10)
  d = th_q.shape[-1]
  s = _dots(th_q, th_k, r_q, r_k, 6)
  expected = np.sum((1 + r_q * r_k) * (1 + np.cos(th_q - th_k)), axis=-1)
  np.testing.assert_allclose(s, expected, rtol=RTOL, atol=1e-4)
  assert np.all(s >= -1e-4) and np.all(s <= 4 * d + 1e-4)


def test_four_channel_dot_product_is_one_plus_gated_angle():
  th_q, th_k, r_q, r_k = _kernel_inputs(11)
  expected = np.sum(1 + r_q * r_k * (1 + np.cos(th_q - th_k)), axis=-1)
  np.testing.assert_allclose(_dots(th_q, th_k, r_q, r_k, 4), expected, rtol=RTOL, atol=1e-4)


def test_three_channel_dot_product_is_d_plus_cosines():
  th_q, th_k, r_q, r_k = _kernel_inputs(12)
  expected = th_q.shape[-1] + np.sum(np.cos(th_q - th_k), axis=-1)
  np.testing.assert_allclose(_dots(th_q, th_k, None, None, 3), expected, rtol=RTOL, atol=1e-4)


@pytest.mark.parametrize("channels,three_channel,scale,shift", [
    (6, "clean", 4 * 16 + 1e-6, 0.0),
    (4, "clean", 3 * 16 + 1e-6, 0.0),
    (3, "legacy", 3 * 16 + 1e-6, 16.0),
    (3, "clean", 2 * 16 + 1e-6, 0.0),
])
def test_score_constants_follow_spec(channels, three_channel, scale, shift):
  assert features.score_scale(channels, three_channel, 16) == scale
  assert features.score_shift(channels, three_channel, 16) == shift


def test_unit_scores_clip_four_channels_and_shift_legacy_three_channels():
  s = jnp.asarray([-5.0, 0.0, 7.0], jnp.float32)
  d = 4
  np.testing.assert_allclose(features.unit_scores(s, channels=4, three_channel="clean", d=d),
                             np.array([0.0, 0.0, 7.0]) / (3 * d + 1e-6), rtol=1e-6)
  np.testing.assert_allclose(features.unit_scores(s, channels=3, three_channel="legacy", d=d),
                             (np.array([-5.0, 0.0, 7.0]) + d) / (3 * d + 1e-6), rtol=1e-6)


def test_unknown_channel_options_raise():
  with pytest.raises(ValueError, match="channels must be one of"):
    features.score_scale(5, "clean", 4)
  with pytest.raises(ValueError, match="three_channel must be one of"):
    features.score_scale(3, "shifted", 4)
