"""The Mosaic TPU gated linear attention kernels (pallas_mosaic_tpu.py) compute the op's function: the
shared checks of ``test_base``, and outputs, final state and gradients (q, k, v, log forget gate,
initial S and z) equal the token-by-token scan for scalar, per-key-channel and no gates, normalised
or not, partial chunks, several value tiles and packed documents; forward and backward pass the
Pallas TPU (Mosaic) lowering.

The kernels run interpreted on CPU: ``interpret=True`` is Pallas' generic interpreter (a scan over
the grid in order, scratch NaN-filled); one case runs the TPU simulator (``pltpu.InterpretParams``).
Tolerance: relative L2 error 1e-5 at fp32 (the forms differ only in summation order; observed
below 5e-7).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from kernel_cases import (CHUNK, assert_close, document_ids, gated_abstract_inputs,
                          gated_bf16_gradient_errors, gated_inputs, normal, normals, run_gated)
from lmcore.ops.common import pallas_utils
from lmcore.ops.gated_linear_attention import LinearAttentionState, gated_linear_attention
from lmcore.ops.gated_linear_attention import pallas_mosaic_tpu as pallas_tpu
from lmcore.ops.gated_linear_attention.base import run_backend

from .test_base import GatedLinearAttentionTestBase


class TestPallasMosaicTpu(GatedLinearAttentionTestBase):
  """The shared checks on implementation "pallas_tpu" (interpreted on CPU)."""

  implementation = "pallas_tpu"


def _kernel(**knobs):
  """``gated_linear_attention`` computed by ``pallas_tpu.chunked`` at chunks of ``CHUNK`` with ``knobs``
  (interpret modes and tuning knobs that the tiles do not hold)."""
  kernel = functools.partial(pallas_tpu.chunked, **{"chunk_size": CHUNK, **knobs})
  return functools.partial(run_backend, kernel)


def _inputs(seed, T, gate, normalize, *, with_state, B=2, H=2, K=8, V=5):
  """(q, k, v, log_forget, state), segment ids (row 1: a second document from T // 3, mid-chunk)
  and random projections of o, S, z."""
  rng = np.random.default_rng(seed)
  q, k, v, log_forget = gated_inputs(rng, T, gate, normalize, B=B, H=H, K=K, V=V)
  z = jnp.asarray(rng.uniform(0.5, 2.0, (B, H, K)) if normalize else np.zeros((B, H, K)), jnp.float32)
  state = LinearAttentionState(normal(rng, B, H, K, V), z) if with_state else None
  projections = normals(rng, (B, T, H, V), (B, H, K, V), (B, H, K))
  return (q, k, v, log_forget, state), document_ids(B, T, (T // 3,)), projections


def _assert_same_as_recurrent(seed, T, gate, normalize, with_state, scale=1.0, **tuning):
  inputs, segment_ids, projections = _inputs(seed, T, gate, normalize, with_state=with_state)
  options = dict(normalize=normalize, segment_ids=segment_ids, scale=scale)
  got = run_gated(_kernel(**tuning), inputs, projections, **options)
  want = run_gated(functools.partial(gated_linear_attention, implementation="recurrent"), inputs,
                   projections, **options)
  assert_close(got, want, f"T={T} gate={gate} normalize={normalize} {tuning}")


@pytest.mark.parametrize("T,gate,normalize,with_state,scale,tuning", [
    (37, "head", False, True, 1.0, {}),  # CyFA's forget="head"
    (37, "channel", False, True, 8**-0.5, {"sub_chunk": 8}),  # GLA; keys before the sub-chunk
    (40, "channel", True, False, 1.0, {"block_v": 4}),  # V = 5 + ones column -> two value tiles
])
def test_tpu_kernels_equal_recurrent_with_gradients_for_partial_chunks_and_documents(
    T, gate, normalize, with_state, scale, tuning):
  _assert_same_as_recurrent(T, T, gate, normalize, with_state, scale, interpret=True, **tuning)


def test_tpu_simulator_runs_the_kernels_like_the_recurrent_form():
  """TPU interpret mode: VMEM scratch and HBM simulated, uninitialised buffers NaN, reads out of
  bounds raise. No gate, normalised, two chunks."""
  _assert_same_as_recurrent(20, 20, None, True, True, interpret=pltpu.InterpretParams())


def _loss(implementation, **options):
  def loss(q, k, v, log_forget, segment_ids):
    o, new = gated_linear_attention(q, k, v, log_forget, implementation=implementation,
                                    segment_ids=segment_ids, **options)
    return o.astype(jnp.float32).sum() + new.S.sum()
  return loss


@pytest.mark.parametrize("gate_shape", ["head", "channel"])
def test_pallas_implementation_lowers_to_mosaic_for_a_tpu_with_bfloat16_inputs(gate_shape):
  """On a TPU, implementation='pallas_tpu' picks these kernels, and the forward, dq and dk/dv kernels
  pass the Pallas TPU lowering ((8, 128) block shapes, supported primitives) for an abstract TPU.
  Mosaic's layout passes and compilation run in libtpu and are not checked here."""
  grad = jax.grad(_loss("pallas_tpu"), argnums=(0, 1, 2, 3))
  lowered = pallas_utils.lower_for_tpu(grad, *gated_abstract_inputs(gate_shape))
  assert lowered.as_text().count("tpu_custom_call") == 3


def test_default_implementation_on_tpu_is_still_xla():
  lowered = pallas_utils.lower_for_tpu(_loss(None), *gated_abstract_inputs("head"))
  assert lowered.as_text().count("tpu_custom_call") == 0


def test_compiling_off_tpu_and_bad_block_sizes_raise_clear_errors():
  (q, k, v, log_forget, _), _, _ = _inputs(3, 9, "head", False, with_state=False)
  with pytest.raises(NotImplementedError, match="implementation='chunked'"):
    _kernel(interpret=False)(q, k, v, log_forget)
  with pytest.raises(ValueError, match="power of two"):
    _kernel(chunk_size=24, interpret=True)(q, k, v, log_forget)
  with pytest.raises(ValueError, match="multiple of 128"):
    pallas_utils.lower_for_tpu(_kernel(interpret=False, block_v=64), q, k, v, log_forget)


def test_bf16_state_dots_in_two_parts_keep_every_gradient_within_the_xla_paths_bf16_error():
  """``kernel_cases.gated_bf16_gradient_errors`` at chunk 16 (interpreted): as the Triton kernel, the
  backward's state dots in two bf16 parts (the default) keep every gradient within the XLA chunked
  path's own bf16 error; with one rounding (``split=False``) the gate gradient is not."""
  kernel = functools.partial(gated_linear_attention, implementation="pallas_tpu",
                             tiles=pallas_tpu.MosaicTiles(chunk=16))
  errors = gated_bf16_gradient_errors(kernel, functools.partial(kernel, kernel_split_state=False))
  assert np.all(errors["split"] <= errors["xla"]), errors
  assert errors["one"][3] > errors["xla"][3] > errors["split"][3], errors
