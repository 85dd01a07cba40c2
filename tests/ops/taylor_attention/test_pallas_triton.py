"""The BASED Taylor Pallas (Triton) kernels compute taylor_linear_attention's function (MATH §2.1):
the shared checks of ``test_base`` (rejecting the decay ablation), and outputs, final state and
gradients (q, k, v, initial S and z) equal the materialised parallel form, for
partial chunks, padded key dims, several value tiles, both state layouts and packed documents.

The kernels run in interpret mode on CPU. Tolerance: relative L2 error 1e-5 at fp32 (the forms
differ only in summation order; observed below 1e-6 here).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from based_jax import TaylorLinearAttention, TaylorState, taylor_features, taylor_linear_attention
from based_jax.ops.taylor_attention import zero_state
from based_jax.ops.taylor_attention.pallas_triton import taylor_linear_attention_pallas
from kernel_cases import (CHUNK, RTOL, assert_close, document_ids, normals, run_taylor,
                          taylor_abstract_inputs)
from lmcore.numerics import relative_l2
from lmcore.ops.common import pallas_utils

from .test_base import TaylorAttentionTestBase


class TestPallasTriton(TaylorAttentionTestBase):
  """The shared checks on ``implementation="pallas"`` (the Triton kernels, interpreted on CPU)."""

  implementation = "pallas"
  decay = False
  pieces = (33, 7, 1, 26)  # fewer interpreted compilations than the default

_parallel = functools.partial(taylor_linear_attention, implementation="parallel")


def _inputs(seed, T, *, B=2, H=2, d=8, dv=5):
  return normals(np.random.default_rng(seed), (B, T, H, d), (B, T, H, d), (B, T, H, dv))


def _prefix_state(seed, feature, *, B=2, H=2, d=8, dv=5):
  """A reachable state: sums of phi(k) v^T and phi(k) over a random 9-token prefix."""
  _, k, v = _inputs(seed, 9, B=B, H=H, d=d, dv=dv)
  phi = taylor_features(k, feature)
  return TaylorState(jnp.einsum("bthf,bthv->bhfv", phi, v), phi.sum(1))


def _run(fn, inputs, state, feature, segment_ids=None):
  """``run_taylor`` with random projections drawn from seed 99."""
  projections = normals(np.random.default_rng(99), inputs[2].shape, *(x.shape for x in state))
  return run_taylor(fn, inputs, state, projections, feature=feature, segment_ids=segment_ids)


@pytest.mark.parametrize("T,with_state,d,feature,tuning", [
    (16, False, 8, "compact", {}),
    # key dim padded 6 -> 8; dv + 1 = 6 columns in two value tiles of 4
    (37, True, 6, "full", {"block_v": 4}),
    (70, True, 8, "compact", {}),
    (64, True, 8, "compact", {}),  # four chunks: one unrolled step of the state walk
])
def test_pallas_equals_parallel_with_gradients_for_partial_chunks(T, with_state, d, feature,
                                                                  tuning):
  inputs = _inputs(T, T, d=d)
  state = (_prefix_state(100 + T, feature, d=d) if with_state
           else zero_state(2, 2, d, 5, feature))
  got = _run(functools.partial(taylor_linear_attention_pallas, **tuning), inputs, state, feature)
  want = _run(_parallel, inputs, state, feature)
  assert_close(got, want, f"T={T} state={with_state} d={d} {feature} {tuning}")


@pytest.mark.parametrize("T", [37, 64])
def test_pallas_honours_segment_ids(T):
  """Row 1 packs four documents: a boundary mid-chunk, one exactly at a chunk start (16) and a
  one-token document; the incoming state continues the first document of each row. T = 64: four
  chunks, walked in one unrolled step."""
  options = dict(segment_ids=document_ids(2, T, (5, 16, 17)))
  inputs, state = _inputs(7, T), _prefix_state(8, "compact")
  got = _run(taylor_linear_attention_pallas, inputs, state, "compact", **options)
  want = _run(_parallel, inputs, state, "compact", **options)
  assert_close(got, want, "segments")


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_kernels_lower_to_triton_for_an_h200_with_bfloat16_inputs():
  """Forward and backward kernels pass the Pallas Triton lowering (power-of-two blocks, supported
  primitives, the in-kernel feature groups) for an abstract H200, with a partial chunk and the
  BASED head shape (d' = 16, dv = 64, so dv + 1 = 65 columns in three value tiles)."""
  def loss(q, k, v):
    o, new = taylor_linear_attention_pallas(q, k, v, interpret=False)
    return o.astype(jnp.float32).sum() + new.S.sum() + new.z.sum()

  lowered = pallas_utils.lower_for_gpu(jax.grad(loss, argnums=(0, 1, 2)),
                                       *taylor_abstract_inputs(T=40)[:3])
  # Forward: states + outputs; backward: recomputed states, reverse states, gradients.
  assert lowered.as_text().count("xla.gpu.triton") == 5


def test_bad_options_raise_clear_errors():
  q, k, v = _inputs(3, 9)
  with pytest.raises(NotImplementedError, match="implementation='chunked'"):
    taylor_linear_attention_pallas(q, k, v, interpret=False)
  with pytest.raises(ValueError, match="power of two"):
    taylor_linear_attention_pallas(q, k, v, chunk_size=24)
  with pytest.raises(NotImplementedError, match="decay ablation"):
    taylor_linear_attention(q, k, v, implementation="pallas", decay=jnp.full((2,), 0.9))
  with pytest.raises(NotImplementedError, match="decay ablation"):
    taylor_linear_attention(q, k, v, implementation="pallas", dt=jnp.ones((2, 9, 2)))
  with pytest.raises(ValueError, match="pallas"):
    taylor_linear_attention(q, k, v, implementation="triton")


def test_mixer_config_implementation_pallas_runs_the_kernel():
  """``implementation="pallas"`` in the mixer config reaches the kernel; the default stays."""
  assert TaylorLinearAttention.Config().implementation == "chunked"
  build = lambda impl: TaylorLinearAttention(
      TaylorLinearAttention.Config(n_heads=2, feature_dim=4, chunk_size=CHUNK, implementation=impl),
      d_model=8, rngs=nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(5).normal(size=(2, 21, 8)), jnp.float32)
  call = nnx.jit(lambda mixer, x: mixer(x))
  y_kernel, state_kernel = call(build("pallas"), x)
  y_ref, state_ref = call(build("parallel"), x)
  assert relative_l2(y_kernel, y_ref) < RTOL and relative_l2(state_kernel.S, state_ref.S) < RTOL
