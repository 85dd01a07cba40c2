"""The Pallas (Triton) gated linear attention kernels compute the op's function: the shared checks of
``test_base``, and outputs, final state and gradients (q, k, v, log forget gate, initial S and z)
equal the token-by-token scan for the kernels' tuning knobs (sub-chunks, value tiles, the XLA
chunk scan) and packed documents; forward and backward lower to Triton.

The kernels run in interpret mode on CPU. Tolerance: relative L2 error 1e-5 at fp32 (kernel and
recurrent form differ only in summation order; observed about 1e-6 here and on the H200 compiled
kernels).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_cases import (CHUNK, FAST_COMPILE, assert_close, document_ids, gated_abstract_inputs,
                          gated_bf16_gradient_errors, gated_inputs, normal, normals, run_gated)
from lmcore.ops.common import pallas_utils
from lmcore.ops.gated_linear_attention import LinearAttentionState, gated_linear_attention
from lmcore.ops.gated_linear_attention import pallas_triton as pallas
from lmcore.ops.gated_linear_attention.base import run_backend

from .test_base import GatedLinearAttentionTestBase


class TestPallasTriton(GatedLinearAttentionTestBase):
  """The shared checks on implementation "pallas_triton" (interpreted on CPU)."""

  implementation = "pallas_triton"
  compiler_options = FAST_COMPILE


def _kernel(**knobs):
  """``gated_linear_attention`` computed by ``pallas.chunked`` at chunks of ``CHUNK`` with ``knobs``
  (interpret mode and tuning knobs that the tiles do not hold)."""
  kernel = functools.partial(pallas.chunked, **{"chunk_size": CHUNK, **knobs})
  return functools.partial(run_backend, kernel)


def _inputs(seed, T, gate, normalize, *, B=2, H=2, K=8, V=5, with_state=True):
  """q, k, v, log_forget, state, segment ids, output/state projections.

  Row 0 of the segment ids is one document. Row 1 starts new documents at T // 3 and CHUNK + 4
  (mid-chunk: the document between them crosses a chunk boundary) and, if T allows, at 2 CHUNK (a
  chunk's first token: the state it receives is dropped whole).

  Decays are weak (log gates in [-0.3, -0.01]) so that what a chunk hands on still matters 16
  tokens later: strong decays would hide errors in the state carried across chunks.
  """
  rng = np.random.default_rng(seed)
  q, k, v, log_forget = gated_inputs(rng, T, gate, normalize, B=B, H=H, K=K, V=V)
  z = jnp.asarray(rng.uniform(0.5, 2.0, (B, H, K)), jnp.float32)
  z = z if normalize else jnp.zeros_like(z)
  state = LinearAttentionState(normal(rng, B, H, K, V), z) if with_state else None
  segment_ids = document_ids(B, T, (T // 3, CHUNK + 4, 2 * CHUNK))
  projections = normals(rng, (B, T, H, V), (B, H, K, V), (B, H, K))
  return (q, k, v, log_forget, state), segment_ids, projections


@functools.cache
def _recurrent(seed, T, gate, normalize, with_state=True, segments=False):
  """``run_gated`` of the token-by-token scan on ``_inputs(seed, T, ...)``, computed once."""
  inputs, segment_ids, projections = _inputs(seed, T, gate, normalize, with_state=with_state)
  return run_gated(functools.partial(gated_linear_attention, implementation="recurrent"), inputs,
                   projections, normalize=normalize, segment_ids=segment_ids if segments else None)


@pytest.mark.parametrize("T,gate,normalize,with_state,tuning", [
    (37, "head", False, True, {}),
    (37, "channel", False, True, {"sub_chunk": 8}),  # off-diagonal sub-chunk blocks
    (16, None, True, False, {"scan": "xla"}),  # phase 2 by XLA's associative scan
    (64, "channel", True, True, {"block_v": 4}),  # V = 5 + ones column -> two value tiles
])
def test_pallas_equals_recurrent_with_gradients_for_tuning_knobs_and_partial_chunks(T, gate, normalize, with_state,
                                                                   tuning):
  inputs, _, projections = _inputs(T, T, gate, normalize, with_state=with_state)
  got = run_gated(_kernel(**tuning), inputs, projections, normalize=normalize)
  want = _recurrent(T, T, gate, normalize, with_state)
  assert_close(got, want, f"T={T} gate={gate} normalize={normalize} {tuning}")


@pytest.mark.parametrize("gate", ["head", "channel"])
def test_pallas_resets_state_at_segment_boundaries_like_recurrent(gate):
  """Row 1 holds four documents (see ``_inputs``); row 0 one continuing the state."""
  inputs, segment_ids, projections = _inputs(7, 37, gate, True)
  got = run_gated(_kernel(sub_chunk=8), inputs, projections, normalize=True, segment_ids=segment_ids)
  assert_close(got, _recurrent(7, 37, gate, True, segments=True), f"segments, gate={gate}")


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
@pytest.mark.parametrize("gate_shape", ["head", "channel"])
def test_kernels_lower_to_triton_for_an_h200_with_bfloat16_inputs(gate_shape):
  """Forward and backward kernels, at the default chunk, warps and sub-chunk, pass the Pallas
  Triton lowering (power-of-two blocks, supported primitives) for an abstract H200, with head and
  value dims that need padding: three forward kernels (chunk writes, the state scan, outputs) and
  four backward ones (writes and the reads' gradient, two state scans, then dq/dk/dv)."""
  def loss(q, k, v, log_forget):
    o, new = gated_linear_attention(q, k, v, log_forget, implementation="pallas_triton")
    return o.astype(jnp.float32).sum() + new.S.sum()

  lowered = pallas_utils.lower_for_gpu(jax.grad(loss, argnums=(0, 1, 2, 3)),
                                       *gated_abstract_inputs(gate_shape, T=40)[:4])
  assert lowered.as_text().count("xla.gpu.triton") == 7


def test_compiling_off_gpu_and_bad_chunk_sizes_raise_clear_errors():
  (q, k, v, log_forget, _), _, _ = _inputs(3, 9, "head", False)
  with pytest.raises(NotImplementedError, match="implementation='chunked'"):
    _kernel(interpret=False)(q, k, v, log_forget)
  with pytest.raises(ValueError, match="power of two"):
    _kernel(chunk_size=24)(q, k, v, log_forget)


def test_bf16_state_dots_in_two_parts_keep_every_gradient_within_the_xla_paths_bf16_error():
  """``kernel_cases.gated_bf16_gradient_errors``: with the backward's state dots in two bf16 parts (the
  default) every gradient is within the XLA chunked path's own bf16 error; with one rounding
  (``split=False``) the gate gradient is not (H200, T = 1000: 5.7e-3 against XLA's 3.3e-3)."""
  kernel = functools.partial(gated_linear_attention, implementation="pallas_triton")
  errors = gated_bf16_gradient_errors(kernel, functools.partial(kernel, kernel_split_state=False))
  assert np.all(errors["split"] <= errors["xla"]), errors
  assert errors["one"][3] > errors["xla"][3] > errors["split"][3], errors
