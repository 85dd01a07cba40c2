"""The chunked XLA form (xla.py) passes the shared checks of ``test_base`` against the recurrent
scan (packed documents included; tests/test_document_resets.py checks their gradients); its defaults
equal a zero state and unit rates; bf16 inputs give bf16 outputs and an fp32 state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from based_jax.ops.taylor_attention import TaylorState, default_decay_rates, taylor_linear_attention, xla
from kernel_cases import FAST_COMPILE
from lmcore.numerics import relative_l2
from lmcore.ops.common.backend import ChunkTiles

from .test_base import CHUNK, TOL, TaylorAttentionTestBase, attend, random_inputs, random_state


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


def _outputs_and_vjp(implementation, tiles, x, segment_ids, cotangents, remat=None):
  """(o, S, z) and their VJP with respect to q, k, v, the state, dt and the decay rates (``remat``: the
  chunked form called directly with that setting)."""
  def run(q, k, v, S0, z0, dt, decay):
    options = dict(state=None if S0 is None else TaylorState(S0, z0), decay=decay, dt=dt,
                   segment_ids=segment_ids)
    if remat is None:
      o, new = taylor_linear_attention(q, k, v, implementation=implementation, tiles=tiles, **options)
    else:
      o, new = xla.chunked(q, k, v, chunk=tiles.chunk, remat=remat, **options)
    return o, new.S, new.z

  state = x["state"] or TaylorState(None, None)
  out, vjp = jax.vjp(run, x["q"], x["k"], x["v"], state.S, state.z, x["dt"], x["decay"])
  return out, vjp(cotangents)


def _assert_close(got, want):
  (out, grads), (ref_out, ref_grads) = got, want
  for name, a, b in zip(("o", "S", "z"), out, ref_out):
    assert relative_l2(a, b) < TOL, name
  for name, a, b in zip(("q", "k", "v", "S0", "z0", "dt", "decay"), grads, ref_grads):
    assert (a is None) == (b is None) and (a is None or relative_l2(a, b, floor=0.1) < TOL), name


def _case(seed, with_state, with_decay):
  """Inputs of T = 67 (2 rows, 2 heads of 4 x 5) and cotangents of o, S and z; no state or decay
  inputs are None."""
  x = random_inputs(seed, length=67)
  rng = x.pop("rng")
  x["state"] = random_state(rng, 2, 2, 4, 5, "compact") if with_state else None
  x["decay"] = default_decay_rates(2) if with_decay else None
  x["dt"] = x["dt"] if with_decay else None
  shapes = ((2, 67, 2, 5), (2, 2, 15, 5), (2, 2, 15))
  return x, tuple(jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in shapes)


# Row 0: documents ending mid-chunk, at a chunk start (token 40), one token long; row 1: one document.
SEGMENTS = jnp.asarray([np.repeat(np.arange(6), (5, 12, 23, 1, 1, 25)), np.zeros(67, int)])


@pytest.mark.parametrize("with_decay", [False, True])
def test_many_chunks_equal_the_recurrent_scan_with_state_and_documents(with_decay):
  """Chunks of 2 tokens: 34 chunks, more than one block of ``chunk_prefix_sum`` (several levels, a
  padded last block and chunk), with packed documents, an incoming state and the decay ablation:
  outputs, final state and gradients."""
  x, cotangents = _case(50 + with_decay, with_state=True, with_decay=with_decay)
  run = jax.jit(_outputs_and_vjp, static_argnums=(0, 1), compiler_options=FAST_COMPILE)
  _assert_close(run("chunked", ChunkTiles(2), x, SEGMENTS, cotangents),
                run("recurrent", None, x, SEGMENTS, cotangents))


def test_without_state_and_decay_inputs_equals_the_recurrent_scan_in_gradients():
  """The training call (no state, no decay inputs: the form skips their terms) over several chunks with
  a partial last one, with and without packed documents."""
  x, cotangents = _case(53, with_state=False, with_decay=False)
  run = jax.jit(_outputs_and_vjp, static_argnums=(0, 1), compiler_options=FAST_COMPILE)
  for segment_ids in (None, SEGMENTS):
    _assert_close(run("chunked", ChunkTiles(CHUNK), x, segment_ids, cotangents),
                  run("recurrent", None, x, segment_ids, cotangents))


def test_recomputing_backward_equals_keeping_the_forward():
  """``remat`` changes what the backward pass keeps, not what it computes."""
  x, cotangents = _case(55, with_state=True, with_decay=True)
  run = jax.jit(_outputs_and_vjp, static_argnums=(0, 1, 5), compiler_options=FAST_COMPILE)
  got, want = (run("chunked", ChunkTiles(CHUNK), x, SEGMENTS, cotangents, remat) for remat in (True, False))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
