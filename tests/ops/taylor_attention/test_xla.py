"""The chunked XLA form (xla.py) passes the shared checks of ``test_base`` against the recurrent
scan (packed documents included; tests/test_document_resets.py checks their gradients); its defaults
equal a zero state and unit rates; bf16 inputs give bf16 outputs and an fp32 state."""

import jax.numpy as jnp
import numpy as np

from lmcore.numerics import relative_l2
from lmcore.ops.common.backend import ChunkTiles

from .test_base import CHUNK, TaylorAttentionTestBase, attend


class TestChunked(TaylorAttentionTestBase):
  implementation = "chunked"
  tiles = ChunkTiles(CHUNK)

  def test_defaults_equal_zero_state_and_unit_rates(self):
    x = self.case(seed=11, length=7, with_state=False, with_decay=False)
    o, state = attend(x["q"], x["k"], x["v"], implementation="chunked", tiles=self.tiles)
    o_explicit, state_explicit = self.run_forward(x)
    np.testing.assert_allclose(o, o_explicit, rtol=1e-6)
    np.testing.assert_allclose(state.S, state_explicit.S, rtol=1e-6)

  def test_bf16_inputs_give_bf16_outputs_and_fp32_state(self):
    x = self.case(40, 7, with_state=True, with_decay=True)
    bf16 = {**x, **{n: x[n].astype(jnp.bfloat16) for n in "qkv"}}
    o, state = self.run_forward(bf16)
    ref, _ = self.run_forward(x)
    assert o.dtype == jnp.bfloat16 and state.S.dtype == state.z.dtype == jnp.float32
    assert relative_l2(o, ref) < 3e-2  # bf16 inputs: ~3 significant digits.
