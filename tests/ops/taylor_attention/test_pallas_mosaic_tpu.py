"""The Mosaic TPU Taylor kernels (pallas_mosaic_tpu.py, the backend ``pallas_tpu``) compute
taylor_linear_attention's function (MATH §2.1): the shared checks of ``test_base`` (rejecting the
decay ablation), and outputs, final state and gradients (q, k, v, initial S and z) equal the
materialised parallel form, for partial chunks, several value tiles, both state layouts and packed
documents; the in-kernel feature block is taylor.py's compact feature map; forward and backward pass
the Pallas TPU (Mosaic) lowering.

The kernels run interpreted on CPU (``interpret=True``, Pallas' generic interpreter: a scan over the
grid in order, scratch NaN-filled); one case runs the TPU simulator (``pltpu.InterpretParams``).
Tolerance: relative L2 error 1e-5 at fp32 (the forms differ only in summation order; observed below
3e-7).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from based_jax import TaylorState, taylor_features, taylor_linear_attention
from based_jax.ops.taylor_attention import pallas_mosaic_tpu as pallas_taylor_tpu
from based_jax.ops.taylor_attention.pallas_mosaic_tpu import MosaicTiles
from kernel_cases import CHUNK, assert_close, document_ids, normal, run_taylor, taylor_abstract_inputs
from lmcore.ops.common import pallas_utils

from .test_base import TaylorAttentionTestBase


class TestPallasMosaicTpu(TaylorAttentionTestBase):
  """The shared checks on ``implementation="pallas_tpu"`` (interpreted on CPU)."""

  implementation = "pallas_tpu"
  tiles = MosaicTiles(chunk=CHUNK)
  decay = False
  pieces = (33, 7, 1, 26)  # fewer interpreted compilations than the default


_parallel = functools.partial(taylor_linear_attention, implementation="parallel")


def _inputs(seed, T, feature, *, B=2, H=2, d=8, dv=5):
  """q, k, v, a state and random projections of o, S, z.

  The state sums phi(k) v^T over a random 9-token prefix; a full one also gets an antisymmetric
  quadratic part, which no query reads but the final state keeps.
  """
  arr = functools.partial(normal, np.random.default_rng(seed))
  q, k, v = arr(B, T, H, d), arr(B, T, H, d), arr(B, T, H, dv)
  phi = taylor_features(arr(B, 9, H, d), feature)
  S = jnp.einsum("bthf,bthv->bhfv", phi, arr(B, 9, H, dv))
  if feature == "full":
    noise = arr(B, H, d, d, dv)
    S = S.at[:, :, 1 + d:].add((noise - jnp.swapaxes(noise, 2, 3)).reshape(B, H, d * d, dv))
  state = TaylorState(S, phi.sum(1))
  projections = (arr(B, T, H, dv), arr(*S.shape), arr(*state.z.shape))
  return (q, k, v), state, projections


def _assert_same_as_parallel(T, feature, segments, interpret, H=2, **tuning):
  inputs, state, projections = _inputs(T, T, feature, H=H)
  # Row 0 one document; row 1 four: a boundary mid-chunk, one exactly at a chunk start (16) and a
  # one-token document.
  options = dict(feature=feature,
                 segment_ids=document_ids(2, T, (5, 16, 17)) if segments else None)
  kernels = functools.partial(pallas_taylor_tpu.taylor_linear_attention_tpu, interpret=interpret,
                              chunk_size=CHUNK, **tuning)
  got = run_taylor(kernels, inputs, state, projections, **options)
  want = run_taylor(_parallel, inputs, state, projections, **options)
  assert_close(got, want, f"T={T} {feature} segments={segments} {tuning}")


@pytest.mark.parametrize("T,feature,segments,tuning", [
    (37, "compact", True, {}),
    # dv + 1 = 6 columns in two value tiles of 4; the full layout's antisymmetric part kept
    (40, "full", False, {"block_v": 4}),
])
def test_tpu_kernels_equal_parallel_with_gradients_for_partial_chunks_and_documents(
    T, feature, segments, tuning):
  _assert_same_as_parallel(T, feature, segments, interpret=True, **tuning)


def test_tpu_simulator_runs_the_kernels_like_the_parallel_form():
  """TPU interpret mode: VMEM scratch and HBM simulated, uninitialised buffers NaN, reads out of
  bounds raise. Two chunks, one head, a full state dropped by a new document in row 1."""
  _assert_same_as_parallel(20, "full", True, interpret=pltpu.InterpretParams(), H=1)


def test_feature_block_is_the_compact_taylor_feature_map_and_full_maps_to_it():
  """(x̃ Ra) ⊙ (x̃ Rb) ⊙ w = taylor_features(x, "compact") zero-padded to Fp lanes, and
  M taylor_features(x, "full") = taylor_features(x, "compact")."""
  d, Kp, Fp = 6, 128, 128
  x = jnp.asarray(np.random.default_rng(1).normal(size=(5, d)), jnp.float32)
  maps = pallas_taylor_tpu.feature_maps(d, Kp, Fp, jnp.float32)
  block = jax.jit(lambda x: pallas_taylor_tpu.features(jnp.pad(x, ((0, 0), (0, Kp - d))), maps, d))
  compact, full = (np.asarray(jax.jit(taylor_features, static_argnums=1)(x, feature), np.float64)
                   for feature in ("compact", "full"))
  np.testing.assert_allclose(block(x), np.pad(compact, ((0, 0), (0, Fp - compact.shape[1]))),
                             rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(full @ pallas_taylor_tpu.full_to_compact(d).T, compact, rtol=1e-6,
                             atol=1e-7)


def _loss(implementation):
  def loss(q, k, v, segment_ids=None):
    o, new = taylor_linear_attention(q, k, v, implementation=implementation,
                                     segment_ids=segment_ids)
    return o.astype(jnp.float32).sum() + new.S.sum() + new.z.sum()
  return loss


def test_pallas_tpu_lowers_to_mosaic_for_a_tpu_with_bfloat16_inputs():
  """The backend's forward, dq and dk/dv kernels pass the Pallas TPU lowering ((8, 128) block shapes,
  supported primitives) for an abstract TPU. Mosaic's layout passes and compilation run in libtpu and
  are not checked here."""
  grad = jax.grad(_loss("pallas_tpu"), argnums=(0, 1, 2))
  lowered = pallas_utils.lower_for_tpu(grad, *taylor_abstract_inputs())
  assert lowered.as_text().count("tpu_custom_call") == 3


def test_auto_implementation_on_tpu_stays_xla():
  lowered = pallas_utils.lower_for_tpu(_loss("auto"), *taylor_abstract_inputs()[:3])
  assert lowered.as_text().count("tpu_custom_call") == 0


def test_compiling_off_tpu_and_bad_block_sizes_raise_clear_errors():
  (q, k, v), _, _ = _inputs(3, 9, "compact")
  tpu = pallas_taylor_tpu.taylor_linear_attention_tpu
  with pytest.raises(NotImplementedError, match="implementation='chunked'"):
    tpu(q, k, v, interpret=False)
  with pytest.raises(ValueError, match="chunk_size must be a power of two"):
    tpu(q, k, v, chunk_size=24, interpret=True)
  with pytest.raises(ValueError, match="chunk must be a power of two"):
    MosaicTiles(chunk=24)
  with pytest.raises(ValueError, match="kernel_precision='input'"):
    taylor_linear_attention(q, k, v, implementation="pallas_tpu", kernel_precision="float32")
  compiled = functools.partial(tpu, interpret=False, block_v=64)
  with pytest.raises(ValueError, match="multiple of 128"):
    pallas_utils.lower_for_tpu(compiled, q, k, v)
