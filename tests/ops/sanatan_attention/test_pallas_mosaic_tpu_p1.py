"""The Mosaic TPU SANATAN p = 1 kernels (pallas_mosaic_tpu_p1.py) compute sanatan_attention's
function (MATH §1.2): outputs, final state and gradients (q, k, v, omega, lam_raw, initial S and z)
equal the recurrent form for partial chunks, padded head dims, several value tiles, packed documents
with restarting positions, with and without an initial state and rotation; forward and backward pass
the Pallas TPU (Mosaic) lowering, and the op picks them on a TPU.

The kernels run in Pallas' generic interpreter on CPU (``interpret=True``: a scan over the grid in
order, scratch NaN-filled). Tolerance: relative L2 error 1e-5 at fp32 (the forms differ only in
summation order; observed about 2e-7).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (CHUNK, assert_close, normal, normals, packed_documents, run_sanatan,
                          sanatan_abstract_inputs)
from lmcore.ops.common import pallas_utils
from sanatan_jax import SanatanState, sanatan_attention
from sanatan_jax.ops.sanatan_attention import pallas_mosaic_tpu_p1 as pallas_p1_tpu


def _inputs(seed, T, *, with_state, B=2, H=2, d=8, dv=5):
  """(q, k, v, omega, lam_raw), a state (or None), segment ids and positions, and random
  projections of o, S, z. |u| spreads across both edges of the root saturation band; row 1 packs
  a second document from token 12 (mid-chunk), whose positions restart at 0."""
  rng = np.random.default_rng(seed)
  arr = functools.partial(normal, rng)
  spread = lambda *s: arr(*s) * np.exp(rng.uniform(np.log(0.01), np.log(50.0), size=s))
  inputs = (spread(B, T, H, d), spread(B, T, H, d), arr(B, T, H, dv),
            np.pi / 4 + 0.3 * arr(H, d), 2.0 * arr(H, d))
  F = 6 * d
  state = None
  if with_state:
    # Reachable magnitudes: S ~ sum Phi(k) v over a few tokens, z of it positive.
    state = SanatanState(3.0 * arr(B, H, F, dv), jnp.asarray(rng.uniform(1, 5, (B, H, F)),
                                                              jnp.float32),
                         jnp.full((B,), 5, jnp.int32))
  docs = packed_documents(B, T, (12,), first_position=5 if with_state else 0)
  return inputs, state, docs, normals(rng, (B, T, H, dv), (B, H, F, dv), (B, H, F))


@pytest.mark.parametrize("T,with_state,d,documents,rotate,tuning", [
    # Head dim 6 (lanes 2d = 12 of 128); dv = 5 plus the normaliser column in two value tiles.
    (37, True, 6, True, True, {"block_v": 4}),
    (37, False, 8, False, False, {}),  # the "no lambda" ablation, no state, one value tile
])
def test_tpu_kernels_equal_recurrent_with_gradients_for_partial_chunks_and_documents(
    T, with_state, d, documents, rotate, tuning):
  inputs, state, docs, projections = _inputs(T, T, with_state=with_state, d=d)
  options = dict(rotate=rotate, **(docs if documents else {}))
  kernel = functools.partial(pallas_p1_tpu.sanatan_p1_tpu, chunk_size=CHUNK, interpret=True,
                             **tuning)
  got = run_sanatan(kernel, inputs, state, projections, **options)
  want = run_sanatan(functools.partial(sanatan_attention, implementation="recurrent"), inputs,
                     state, projections, **options)
  assert_close(got, want,
               f"T={T} state={with_state} d={d} documents={documents} rotate={rotate} {tuning}")


def _loss(implementation):
  def loss(q, k, v, omega, lam_raw, segment_ids):
    o, new = sanatan_attention(q, k, v, omega, lam_raw, implementation=implementation,
                               segment_ids=segment_ids)
    return o.astype(jnp.float32).sum() + new.S.sum() + new.z.sum()
  return loss


def test_pallas_implementation_lowers_to_mosaic_for_a_tpu_with_bfloat16_inputs():
  """On a TPU, implementation='pallas' picks these kernels, and the forward, dq and dk/dv kernels
  (with the in-kernel feature map and its VJP) pass the Pallas TPU lowering ((8, 128) block
  shapes, supported primitives) for an abstract TPU. Mosaic's layout passes and compilation run
  in libtpu and are not checked here."""
  grad = jax.grad(_loss("pallas"), argnums=(0, 1, 2, 3, 4))
  lowered = pallas_utils.lower_for_tpu(grad, *sanatan_abstract_inputs())
  assert lowered.as_text().count("tpu_custom_call") == 3


def test_default_implementation_on_tpu_is_still_xla():
  lowered = pallas_utils.lower_for_tpu(_loss(None), *sanatan_abstract_inputs())
  assert lowered.as_text().count("tpu_custom_call") == 0


def test_compiling_off_tpu_bad_block_sizes_and_state_shapes_raise_clear_errors():
  (q, k, v, omega, lam_raw), _, _, _ = _inputs(3, 9, with_state=False)
  kernel = pallas_p1_tpu.sanatan_p1_tpu
  with pytest.raises(NotImplementedError, match="implementation='chunked'"):
    kernel(q, k, v, omega, lam_raw, interpret=False)
  with pytest.raises(ValueError, match="power of two"):
    kernel(q, k, v, omega, lam_raw, chunk_size=24, interpret=True)
  wrong = SanatanState(jnp.zeros((2, 2, 40, 5)), jnp.zeros((2, 2, 40)), jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="state.S has shape"):
    kernel(q, k, v, omega, lam_raw, state=wrong, interpret=True)
  compiled = functools.partial(kernel, interpret=False, block_v=64)
  with pytest.raises(ValueError, match="multiple of 128"):
    pallas_utils.lower_for_tpu(compiled, q, k, v, omega, lam_raw)
