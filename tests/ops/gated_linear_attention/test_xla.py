"""The chunked XLA form (xla.py): the shared checks of ``test_base``, plus exactness under strong and
weak decay and bf16 inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lmcore.numerics import relative_l2
from lmcore.ops.common.backend import ChunkTiles
from lmcore.ops.gated_linear_attention import gated_linear_attention
from .test_base import (CHUNK, RTOL, GatedLinearAttentionTestBase, assert_same, gla_inputs, outputs_and_grads)

_op = jax.jit(gated_linear_attention, static_argnames=("implementation", "tiles", "normalize"))


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
    o, new = _op(bf16(q), bf16(k), bf16(v), log_forget, state=state, tiles=ChunkTiles(CHUNK),
                 normalize=True)
    o_ref, _ = _op(q, k, v, log_forget, state=state, implementation="recurrent", normalize=True)
    assert o.dtype == jnp.bfloat16 and new.S.dtype == jnp.float32 and new.z.dtype == jnp.float32
    assert relative_l2(o, o_ref) < 2e-2  # bf16 has an 8-bit mantissa (relative rounding 4e-3)

  def test_recomputing_backward_equals_keeping_the_forward(self):
    """``chunked_remat`` changes only what the backward pass keeps: outputs, state and gradients are
    those of plain autodiff of the same form (same operations; fp32 summation order at most)."""
    inputs = gla_inputs(13, 40, "channel", True)
    got, want = (outputs_and_grads(self.op(chunk_size=CHUNK, chunked_remat=remat), *inputs, True)
                 for remat in (True, False))
    assert_same(got, want, "chunked_remat", rtol=1e-6, gate_rtol=1e-6)


def _bytes(arrays) -> int:
  return sum(a.size * a.dtype.itemsize for a in arrays)


@pytest.mark.parametrize("gate", ["channel", "head"])
def test_chunked_backward_keeps_the_inputs_not_chunk_states_or_blocks(gate):
  """With ``chunked_remat`` (the default) the backward pass recomputes everything from the inputs, so
  what ``jax.vjp`` keeps for it (the leaves of its VJP function, traced only) is at most twice the
  inputs' bytes and no chunk-stacked (5-d or wider) array. Without it, autodiff keeps the chunk-start
  states [B, H, N, K, V], the [B, H, N, C, C] blocks and (per-channel gates) the diagonal sub-chunk
  terms: 7 (scalar gate) to 24 (per channel) times the inputs here, which these bounds catch."""
  q, k, v, log_forget, state = gla_inputs(5, 40, gate, True)  # 3 chunks of 16, the last one partial
  segment_ids = jnp.asarray([[0] * 21 + [1] * 19, [0] * 40])
  x = (q, k, v, log_forget, state)

  def kept(remat):
    def o_and_state(*args):
      return gated_linear_attention(*args[:4], state=args[4], tiles=ChunkTiles(CHUNK), normalize=True,
                                    segment_ids=segment_ids, chunked_remat=remat)
    return jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(o_and_state, *a)[1], *x))

  input_bytes = _bytes((*jax.tree.leaves(x), segment_ids))
  with_remat, without = kept(True), kept(False)
  assert _bytes(with_remat) <= 2 * input_bytes
  assert max(a.ndim for a in with_remat) <= 4
  assert _bytes(without) > 4 * input_bytes and max(a.ndim for a in without) >= 5
