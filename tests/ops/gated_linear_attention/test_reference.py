"""The plain forms (reference.py): the token-by-token scan equals a float64 transcription of the
recurrence and the materialised T x T form; both pass the shared checks of ``test_base``."""

import jax
import numpy as np
import pytest

from lmcore.numerics import relative_l2
from lmcore.ops.gated_linear_attention import gated_linear_attention
from .test_base import (RTOL, GatedLinearAttentionTestBase, gla_inputs, numpy_recurrence)

_op = jax.jit(gated_linear_attention, static_argnames=("implementation", "normalize", "scale"))


class TestRecurrent(GatedLinearAttentionTestBase):
  implementation = "recurrent"
  reference_implementation = "parallel"

  @pytest.mark.parametrize("gate,normalize", [("channel", False), ("head", True), (None, True)])
  def test_recurrent_matches_numpy_transcription(self, gate, normalize):
    q, k, v, log_forget, state = gla_inputs(0, 7, gate, normalize)
    o, new = _op(q, k, v, log_forget, state=state, implementation="recurrent", normalize=normalize,
                 scale=0.7)
    o_np, S_np, z_np = numpy_recurrence(q, k, v, log_forget, state, normalize, scale=0.7)
    assert relative_l2(o, o_np) < RTOL and relative_l2(new.S, S_np) < RTOL
    if normalize:
      assert relative_l2(new.z, z_np) < RTOL
    else:
      assert not np.any(np.asarray(new.z))


class TestParallel(GatedLinearAttentionTestBase):
  implementation = "parallel"
