"""The blocked (flash-style) BASED Taylor Pallas kernels compute the quadratic form's sums and, as
the backend ``pallas_blocked``, the op's function: the shared checks of ``test_base`` (rejecting the
decay ablation; equal blocks of 16), and outputs, final state and gradients (q, k, v, initial S and
z) equal the materialised parallel form, for partial blocks, unequal query and key blocks, padded
dims, packed documents and a prefix state in the full layout; the kernels lower to Triton for an
H200.

The kernels run in interpret mode on CPU. Tolerance: relative L2 error 1e-5 at fp32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from based_jax import TaylorState, taylor_features, taylor_linear_attention
from based_jax.ops.taylor_attention import pallas_triton_blocked as pallas_taylor_blocked
from based_jax.ops.taylor_attention.pallas_triton_blocked import BlockedTiles
from kernel_cases import FAST_COMPILE, RTOL, document_ids, normals, taylor_abstract_inputs
from lmcore.numerics import relative_l2
from lmcore.ops.common import pallas_utils
from lmcore.ops.common.segments import document_index

from .test_base import CHUNK, TaylorAttentionTestBase


class TestPallasTritonBlocked(TaylorAttentionTestBase):
  """The shared checks on ``implementation="pallas_blocked"`` (interpreted on CPU)."""

  implementation = "pallas_blocked"
  tiles = BlockedTiles(CHUNK, CHUNK)
  decay = False
  pieces = (33, 7, 1, 26)  # fewer interpreted compilations than the default


def _sums_reference(q, k, v, run):
  """N = A v and D = rowsum(A), A = 1 + s + s²/2 on visible pairs, materialised (fp32)."""
  T = q.shape[1]
  s_BxHxTxT = jnp.einsum("bthk,bshk->bhts", q, k, precision="highest") / np.sqrt(q.shape[-1])
  visible_Bx1xTxT = (jnp.tril(jnp.ones((T, T), bool))[None]
                     & (run[:, :, None] == run[:, None, :]))[:, None]
  A = jnp.where(visible_Bx1xTxT, 1.0 + s_BxHxTxT + 0.5 * s_BxHxTxT**2, 0.0)
  return (jnp.einsum("bhts,bshv->bthv", A, v, precision="highest"),
          jnp.sum(A, axis=-1).transpose(0, 2, 1))


def _sums_and_grads(fn, q, k, v, run, dN, dD):
  def loss(q, k, v):
    N, D = fn(q, k, v, run)
    return jnp.sum(N * dN) + jnp.sum(D * dD), (N, D)

  grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
  (_, (N, D)), grads = jax.jit(grad, compiler_options=FAST_COMPILE)(q, k, v)
  return (N, D, *grads)


@pytest.mark.parametrize("block_q,block_k", [(16, 32), (32, 16)])  # equal blocks: the shared checks
def test_sums_and_gradients_equal_the_materialised_form(block_q, block_k):
  rng = np.random.default_rng(0)
  B, T, H, d, dv = 2, 77, 2, 12, 5  # partial blocks; d' and dv padded
  q, k, v, dN = normals(rng, (B, T, H, d), (B, T, H, d), (B, T, H, dv), (B, T, H, dv))
  dD, = normals(rng, (B, T, H))
  q, k = 0.6 * q, 0.6 * k
  run = document_index(document_ids(B, T, (20, 33, 64)), B, T)  # row 1: runs ending mid-block
  kernel = lambda *a: pallas_taylor_blocked.taylor_sums_blocked(*a, interpret=True,
                                                                block_q=block_q, block_k=block_k)
  got = _sums_and_grads(kernel, q, k, v, run, dN, dD)
  want = _sums_and_grads(_sums_reference, q, k, v, run, dN, dD)
  errors = {name: relative_l2(a, b) for name, a, b in zip(("N", "D", "dq", "dk", "dv"), got, want)}
  assert max(errors.values()) < RTOL, errors


def test_normalised_output_and_gradients_equal_the_materialised_form():
  """o = N / (D + eps) divided in the forward kernel, and its gradients, for partial and unequal
  blocks, padded dims and documents."""
  rng = np.random.default_rng(4)
  B, T, H, d, dv = 2, 77, 2, 12, 5
  q, k, v, do = normals(rng, (B, T, H, d), (B, T, H, d), (B, T, H, dv), (B, T, H, dv))
  q, k = 0.6 * q, 0.6 * k
  run = document_index(document_ids(B, T, (20, 33, 64)), B, T)
  eps = 1e-3  # large enough to matter in D + eps

  def materialised(q, k, v):
    N, D = _sums_reference(q, k, v, run)
    return N / (D[..., None] + eps)

  kernel = lambda q, k, v: pallas_taylor_blocked.taylor_normalised_blocked(
      q, k, v, run, eps=eps, interpret=True, block_q=16, block_k=32)

  def outputs_and_grads(fn):
    loss = lambda q, k, v: (jnp.sum(fn(q, k, v) * do), fn(q, k, v))
    (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True),
                            compiler_options=FAST_COMPILE)(q, k, v)
    return (o, *grads)

  names = ("o", "dq", "dk", "dv")
  errors = {n: relative_l2(a, b) for n, a, b in zip(names, outputs_and_grads(kernel),
                                                     outputs_and_grads(materialised))}
  assert max(errors.values()) < RTOL, errors


def test_op_equals_parallel_with_documents_and_a_prefix_state():
  """The sums plus the state's read, divided in XLA, with gradients through the state (the full
  layout; the shared checks run the compact one)."""
  feature = "full"
  rng = np.random.default_rng(1)
  B, T, H, d, dv = 2, 45, 2, 8, 5
  q, k, v = normals(rng, (B, T, H, d), (B, T, H, d), (B, T, H, dv))
  _, k_prefix, v_prefix = normals(rng, (B, 9, H, d), (B, 9, H, d), (B, 9, H, dv))
  phi = taylor_features(k_prefix, feature)
  state = TaylorState(jnp.einsum("bthf,bthv->bhfv", phi, v_prefix), phi.sum(1))
  segment_ids = document_ids(B, T, (17, 30))
  do, dS, dz = normals(rng, (B, T, H, dv), state.S.shape, state.z.shape)

  def run(implementation, tiles=None):
    def loss(q, k, v, S, z):
      o, new = taylor_linear_attention(q, k, v, implementation=implementation, feature=feature,
                                       state=TaylorState(S, z), segment_ids=segment_ids, tiles=tiles)
      return jnp.sum(o * do) + jnp.sum(new.S * dS) + jnp.sum(new.z * dz), (o, new)

    grad = jax.value_and_grad(loss, argnums=tuple(range(5)), has_aux=True)
    (_, (o, new)), grads = jax.jit(grad, compiler_options=FAST_COMPILE)(q, k, v, *state)
    return (o, new.S, new.z, *grads)

  names = ("o", "S", "z", "dq", "dk", "dv", "dS0", "dz0")
  got = run("pallas_blocked", BlockedTiles(16, 32))
  errors = {n: relative_l2(a, b) for n, a, b in zip(names, got, run("parallel"))}
  assert max(errors.values()) < RTOL, errors


@pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
def test_kernels_lower_to_triton_for_an_h200_with_bfloat16_inputs():
  """Forward, dq and dk/dv kernels pass the Pallas Triton lowering for an abstract H200 at the
  BASED head shape with a partial block, for the sums and for o divided in the forward kernel."""
  def loss(q, k, v, run):
    N, D = pallas_taylor_blocked.taylor_sums_blocked(q, k, v, run, interpret=False)
    return N.sum() + D.sum()

  def normalised_loss(q, k, v, run):
    o = pallas_taylor_blocked.taylor_normalised_blocked(q, k, v, run, eps=1e-12, interpret=False)
    assert o.dtype == jnp.bfloat16
    return o.astype(jnp.float32).sum()

  for fn in (loss, normalised_loss):
    lowered = pallas_utils.lower_for_gpu(jax.grad(fn, argnums=(0, 1, 2)), *taylor_abstract_inputs(T=100))
    assert lowered.as_text().count("xla.gpu.triton") == 3


def test_precision_and_bad_options():
  q, k, v = normals(np.random.default_rng(2), (1, 20, 1, 4), (1, 20, 1, 4), (1, 20, 1, 3))
  o, _ = taylor_linear_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                                 v.astype(jnp.bfloat16), implementation="pallas_blocked",
                                 kernel_precision="float32")
  assert o.dtype == jnp.float32
  run = jnp.zeros((1, 20), jnp.int32)
  with pytest.raises(ValueError, match="block_q must be a power of two, got 24"):
    pallas_taylor_blocked.taylor_sums_blocked(q, k, v, run, block_q=24)
  with pytest.raises(ValueError, match="block_k must be a power of two, got 48"):
    BlockedTiles(block_k=48)
  wide = jnp.zeros((1, 20, 1, pallas_taylor_blocked.MAX_VALUE_DIM + 1))
  with pytest.raises(ValueError, match=r"'pallas_blocked' does not run heads of 4 x 257 .*value dims up to "
                                       r"256.*; use one of parallel, recurrent, chunked, pallas_fused"):
    taylor_linear_attention(q, k, wide, implementation="pallas_blocked")
