"""Taylor feature maps (taylor.py, MATH §2.1): phi(q)·phi(k) is the second-order Taylor expansion of
exp(q·k / sqrt d') in both forms; the full form is the released layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from based_jax.taylor import feature_width, taylor_features

features = jax.jit(taylor_features, static_argnames="feature")


@pytest.mark.parametrize("feature,width", [("full", 273), ("compact", 153)])
def test_feature_dot_product_is_second_order_taylor_of_exp(feature, width):
  rng = np.random.default_rng(0)
  q, k = rng.normal(size=(2, 50, 16)).astype(np.float32)
  phi_q, phi_k = features(jnp.asarray(q), feature), features(jnp.asarray(k), feature)
  s = (q * k).sum(-1) / 4.0
  assert phi_q.shape == (50, width) == (50, feature_width(16, feature))
  np.testing.assert_allclose((phi_q * phi_k).sum(-1), 1 + s + s**2 / 2, rtol=1e-5)


def test_full_feature_is_the_released_layout():
  x = np.random.default_rng(1).normal(size=(3, 16)).astype(np.float32)
  expected = np.concatenate([np.ones((3, 1)), x / 2.0,
                             np.einsum("zm,zn->zmn", x, x).reshape(3, 256) / (np.sqrt(2) * 4)], -1)
  np.testing.assert_allclose(features(jnp.asarray(x), "full"), expected, rtol=1e-6)


def test_unknown_feature_form_is_rejected():
  with pytest.raises(ValueError, match="compact"):
    taylor_features(jnp.ones((2, 4)), "half")
