"""The Mosaic TPU SANATAN p = 1 kernels (``pallas_tpu``, pallas_mosaic_tpu_p1.py) compute
sanatan_attention's function (MATH §1.2): the shared checks of ``test_base`` (partial chunks, several
value tiles, packed documents, an incoming state, gradients of q, k, v, omega, lam_raw and the initial
S and z), and the same with a padded head dim and without rotation; forward and backward pass the
Pallas TPU (Mosaic) lowering, fed by XLA's factors, and "auto" keeps XLA on a TPU.

The kernels run in Pallas' generic interpreter on CPU (``interpret=True``: a scan over the grid in
order, scratch NaN-filled). Tolerance: relative L2 error 1e-5 at fp32 (the forms differ only in
summation order; observed about 2e-7).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import assert_close, normals, packed_documents, run_sanatan, sanatan_abstract_inputs
from kernel_cases import sanatan_inputs
from lmcore.ops.common import pallas_utils
from sanatan_jax import SanatanState, sanatan_attention
from sanatan_jax.ops.sanatan_attention.pallas_mosaic_tpu_p1 import MosaicTiles, sanatan_p1_tpu

from .test_base import SanatanAttentionTestBase


class TestPallasTpu(SanatanAttentionTestBase):
  """The shared checks through ``implementation="pallas_tpu"`` (interpreted here): chunks of 8, and
  dv = 5 plus the normaliser column in two value tiles of 4."""

  implementation = "pallas_tpu"
  tiles = MosaicTiles(chunk=8, block_v=4)


def test_padded_head_dim_without_rotation_equals_recurrent_with_gradients():
  """Head dim 6 (lanes 2d = 12 of 128), no rotation (the factors' positions unused), an incoming
  state and a document from token 12 (mid-chunk) whose positions restart."""
  T, d, dv = 21, 6, 5
  inputs = sanatan_inputs(T, T, d=d, dv=dv)
  rng = np.random.default_rng(T)
  # Reachable magnitudes: S ~ sum Phi(k) v over a few tokens, z of it positive.
  S0, z0 = 3.0 * rng.normal(size=(2, 2, 6 * d, dv)), rng.uniform(1, 5, (2, 2, 6 * d))
  state = SanatanState(jnp.asarray(S0, jnp.float32), jnp.asarray(z0, jnp.float32),
                       jnp.full((2,), 5, jnp.int32))
  projections = normals(rng, (2, T, 2, dv), (2, 2, 6 * d, dv), (2, 2, 6 * d))
  options = dict(rotate=False, **packed_documents(2, T, (12,)))
  got = run_sanatan(functools.partial(sanatan_p1_tpu, chunk_size=8, interpret=True), inputs, state,
                    projections, **options)
  want = run_sanatan(functools.partial(sanatan_attention, implementation="recurrent"), inputs, state,
                     projections, **options)
  assert_close(got, want, "d=6 without rotation")


def _loss(implementation):
  def loss(q, k, v, omega, lam_raw, segment_ids):
    o, new = sanatan_attention(q, k, v, omega, lam_raw, implementation=implementation,
                               segment_ids=segment_ids)
    return o.astype(jnp.float32).sum() + new.S.sum() + new.z.sum()
  return loss


def test_the_kernels_lower_to_mosaic_for_a_tpu_with_bfloat16_inputs():
  """implementation='pallas_tpu' runs these kernels on a TPU: the forward, dq and dk/dv kernels (with
  the channels from the factors and their VJP) pass the Pallas TPU lowering ((8, 128) block shapes,
  supported primitives) for an abstract TPU, and no transcendental is left in them (XLA computes the
  factors). Mosaic's layout passes and compilation run in libtpu (tests/scale/test_aot_compile.py)."""
  grad = jax.grad(_loss("pallas_tpu"), argnums=(0, 1, 2, 3, 4))
  text = pallas_utils.lower_for_tpu(grad, *sanatan_abstract_inputs()).as_text()
  assert text.count("tpu_custom_call") == 3


def test_auto_on_a_tpu_is_xla():
  lowered = pallas_utils.lower_for_tpu(_loss(None), *sanatan_abstract_inputs())
  assert lowered.as_text().count("tpu_custom_call") == 0


def test_compiling_off_tpu_bad_block_sizes_and_state_shapes_raise_clear_errors():
  q, k, v, omega, lam_raw = sanatan_inputs(3, 9)
  with pytest.raises(NotImplementedError, match="implementation='chunked'"):
    sanatan_p1_tpu(q, k, v, omega, lam_raw, interpret=False)
  with pytest.raises(ValueError, match="power of two"):
    sanatan_p1_tpu(q, k, v, omega, lam_raw, chunk_size=24, interpret=True)
  wrong = SanatanState(jnp.zeros((2, 2, 40, 5)), jnp.zeros((2, 2, 40)), jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="state.S has shape"):
    sanatan_p1_tpu(q, k, v, omega, lam_raw, state=wrong, interpret=True)
  compiled = functools.partial(sanatan_p1_tpu, interpret=False, block_v=64)
  with pytest.raises(ValueError, match="multiple of 128"):
    pallas_utils.lower_for_tpu(compiled, q, k, v, omega, lam_raw)
  with pytest.raises(ValueError, match="kernel_precision='float32' is for the GPU kernels"):
    sanatan_attention(q, k, v, omega, lam_raw, implementation="pallas_tpu", kernel_precision="float32")
