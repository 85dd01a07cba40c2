"""The chunked XLA form (xla.py): the shared checks of ``test_base``, plus exactness under strong and
weak decay and bf16 inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmcore.numerics import relative_l2
from lmcore.ops.gated_linear_attention import gated_linear_attention
from .test_base import (CHUNK, RTOL, GatedLinearAttentionTestBase, assert_same, gla_inputs, outputs_and_grads)

_op = jax.jit(gated_linear_attention, static_argnames=("implementation", "chunk_size", "normalize"))


class TestChunked(GatedLinearAttentionTestBase):
  implementation = "chunked"

  @pytest.mark.parametrize("gate,decay,gate_rtol", [
      ("channel", (5.0, 20.0), 1e-3), ("head", (5.0, 20.0), 1e-3), ("channel", (1e-4, 2e-3), RTOL)])
  def test_chunked_is_stable_and_exact_under_strong_and_weak_decay(self, gate, decay, gate_rtol):
    """Strong decay: within a chunk of 16 the log-decay sums reach about -200, where exp(+200) of a
    factored form would overflow fp32; the masked form stays finite and exact. The gradient w.r.t.
    the gate gets 1e-3: it is built from differences of fp32 cumulative sums of that magnitude,
    whose absolute error ≈ 200 · 2^-24 ≈ 1e-5 (the token-by-token scan never forms them)."""
    inputs = gla_inputs(11, 33, gate, False, decay=decay)
    got = outputs_and_grads(self.op(chunk_size=CHUNK), *inputs, False)
    want = outputs_and_grads(functools.partial(gated_linear_attention, implementation="recurrent"),
                             *inputs, False)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(got))
    assert_same(got, want, f"decay {decay}", gate_rtol=gate_rtol)

  def test_bfloat16_inputs_give_bfloat16_outputs_close_to_fp32_and_fp32_state(self):
    q, k, v, log_forget, state = gla_inputs(41, 33, "channel", True)
    bf16 = lambda x: x.astype(jnp.bfloat16)
    o, new = _op(bf16(q), bf16(k), bf16(v), log_forget, state=state, chunk_size=CHUNK,
                 normalize=True)
    o_ref, _ = _op(q, k, v, log_forget, state=state, implementation="recurrent", normalize=True)
    assert o.dtype == jnp.bfloat16 and new.S.dtype == jnp.float32 and new.z.dtype == jnp.float32
    assert relative_l2(o, o_ref) < 2e-2  # bf16 has an 8-bit mantissa (relative rounding 4e-3)
