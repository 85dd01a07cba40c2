"""The public surface (api.py, base.py): the decay ablation's default rates, the zero state's
feature width, and the registry of implementation names."""

import jax.numpy as jnp
import numpy as np
import pytest

from based_jax.ops.taylor_attention import default_decay_rates, taylor_linear_attention, zero_state
from based_jax.ops.taylor_attention.api import IMPLEMENTATIONS


def test_default_decay_rates_follow_one_minus_two_to_minus_three_minus_h():
  np.testing.assert_allclose(default_decay_rates(16)[:3], [0.875, 0.9375, 0.96875])
  np.testing.assert_allclose(default_decay_rates(16)[-1], 1 - 2.0**-18, rtol=0, atol=1e-7)


def test_zero_state_has_feature_width():
  state = zero_state(3, 2, 16, 64)
  assert state.S.shape == (3, 2, 153, 64) and state.z.shape == (3, 2, 153)


def test_registry_holds_the_configured_names_and_unknown_names_list_them():
  assert set(IMPLEMENTATIONS) == {"parallel", "chunked", "recurrent", "pallas", "pallas_blocked",
                                  "pallas_fused"}
  x = jnp.ones((1, 3, 1, 2))
  with pytest.raises(ValueError, match="pallas_blocked"):
    taylor_linear_attention(x, x, x, implementation="reference")
