"""The chunked WY form (xla.py): the shared checks of ``test_base``, plus extreme decays and write
strengths, and bf16 inputs."""

import jax
import jax.numpy as jnp
import pytest

from lmcore.numerics import relative_l2
from lmcore.ops.gated_delta_rule import gated_delta_rule

from .test_base import ARG_NAMES, GatedDeltaRuleTestBase, assert_close, gdr_inputs, outputs_and_grads

_forward = jax.jit(gated_delta_rule, static_argnames=("implementation", "tiles"))


class TestChunked(GatedDeltaRuleTestBase):
  implementation = "chunked"

  @pytest.mark.parametrize("log_alpha_range", [(-20.0, -5.0), (-2e-3, -5e-4), (-20.0, -1e-3)],
                           ids=["strong", "weak", "mixed"])
  @pytest.mark.parametrize("beta_range", [(1e-4, 1e-2), (0.99, 0.9999)], ids=["beta~0", "beta~1"])
  def test_chunked_equals_recurrent_under_extreme_decay_and_beta(self, log_alpha_range,
                                                                 beta_range):
    seed = int(100 * -log_alpha_range[0] + 1000 * beta_range[0])
    inputs = gdr_inputs(seed, length=33, log_alpha_range=log_alpha_range, beta_range=beta_range)
    assert_close(outputs_and_grads(inputs, implementation="chunked"),
                 outputs_and_grads(inputs, implementation="recurrent"))

  def test_bf16_inputs_give_bf16_outputs_and_fp32_state_close_to_fp32(self):
    inputs = gdr_inputs(seed=6, length=33)
    args = [inputs[name] for name in ARG_NAMES[:3]]
    o32, state32 = _forward(*args, inputs["log_alpha"], inputs["beta"])
    o16, state16 = _forward(*(jnp.asarray(x, jnp.bfloat16) for x in args), inputs["log_alpha"],
                            inputs["beta"])
    assert o16.dtype == jnp.bfloat16 and state16.S.dtype == jnp.float32
    # bf16 rounding of q, k, v (8 mantissa bits, ~4e-3 relative) propagated through the recurrence.
    assert relative_l2(o16, o32) < 2e-2 and relative_l2(state16.S, state32.S) < 2e-2
