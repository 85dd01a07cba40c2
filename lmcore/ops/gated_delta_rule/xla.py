"""Chunked gated delta rule in plain jnp (the WY / UT transform of FLA §1.7-1.8), runs anywhere.

Per head and chunk of C tokens, with b_i = sum_{s<=i} log a_s (fp32, chunk-local) and the state S
entering the chunk, MATH §4's recurrence unrolls to

    delta_t = beta_t (v_t - alpha_t S_{t-1}^T k_t)   (so that S_t = alpha_t S_{t-1} + k_t delta_t^T)
    (I + A) Delta = diag(beta) V - diag(beta e^b) K S,  A_ij = beta_i (k_i.k_j) e^{b_i - b_j}, j < i
    Delta = U - W S,  W = (I + A)^{-1} diag(beta e^b) K,  U = (I + A)^{-1} diag(beta) V
    O = scale [ (Q * e^b) S + (Q K^T * e^{b_i - b_j})_{j<=i} Delta ]
    S_next = e^{b_C} S + (K * e^{b_C - b})^T Delta.

W and U come from one triangular solve per chunk (all chunks in parallel); only Delta and the fp32
state run in the ``lax.scan`` over chunks. A segment reset is a zero decay at its first token, masked
to exp(-inf) = 0 before the exponential, so no exponent is positive and no inf reaches a gradient.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from lmcore.ops.common.segments import document_index
from lmcore.ops.common.backend import ChunkedBackend, ChunkTiles
from lmcore.ops.gated_delta_rule.base import Problem


def _dot(spec: str, *operands: jax.Array) -> jax.Array:
  """einsum with fp32 accumulation at full precision (TF32 would break fp32 equivalence)."""
  return jnp.einsum(spec, *operands, precision=jax.lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32)


def _masked_exp(x: jax.Array, mask: jax.Array) -> jax.Array:
  """exp(x) where mask, else exactly 0 — the mask goes in before exp so exp never overflows."""
  return jnp.exp(jnp.where(mask, x, -jnp.inf))


def _to_chunks(x_BxTx: jax.Array, chunk: int) -> jax.Array:
  """[B, T, *rest] -> [N, B, C, *rest] (T % C == 0)."""
  batch_size, length, *rest = x_BxTx.shape
  return jnp.moveaxis(x_BxTx.reshape(batch_size, length // chunk, chunk, *rest), 1, 0)


def _pad_tokens(x_BxTx: jax.Array, pad: int, mode: str = "constant") -> jax.Array:
  """Appends ``pad`` tokens on axis 1 (zeros: with beta = 0 and log alpha = 0 they are a no-op)."""
  return jnp.pad(x_BxTx, [(0, 0), (0, pad)] + [(0, 0)] * (x_BxTx.ndim - 2), mode=mode)


def _pair_log_decays(log_alpha_NxBxHxC: jax.Array) -> jax.Array:
  """[..., i, j] = sum_{j < s <= i} log a_s (0 for j >= i), summed directly: as b_i - b_j, fp32
  cancellation after a strong decay (b near -1e3) would cost accuracy in factors near 1."""
  chunk = log_alpha_NxBxHxC.shape[-1]
  strict_CxC = jnp.tril(jnp.ones((chunk, chunk), dtype=bool), k=-1)
  return jnp.cumsum(jnp.where(strict_CxC, log_alpha_NxBxHxC[..., :, None], 0.0), axis=-2)


def _decay_factors(log_alpha_NxBxHxC: jax.Array, doc_NxBxC: jax.Array, doc_prev_NxB: jax.Array):
  """The chunk's fp32 decay factors, each zero across a segment reset: (within_CxC = e^{b_i - b_j}
  for j <= i, to_end = e^{b_C - b_j}, from_start = e^{b_i}, whole = e^{b_C}); ``doc_prev`` is the
  state's document."""
  b_NxBxHxC = jnp.cumsum(log_alpha_NxBxHxC, axis=-1)
  doc_NxBx1xC = doc_NxBxC[:, :, None, :]
  chunk = b_NxBxHxC.shape[-1]
  causal_CxC = jnp.tril(jnp.ones((chunk, chunk), dtype=bool))
  same_NxBx1xCxC = (doc_NxBx1xC[..., :, None] == doc_NxBx1xC[..., None, :]) & causal_CxC
  within = _masked_exp(_pair_log_decays(log_alpha_NxBxHxC), same_NxBx1xCxC)
  starts_in_state_NxBx1xC = doc_NxBx1xC == doc_prev_NxB[:, :, None, None]
  from_start = _masked_exp(b_NxBxHxC, starts_in_state_NxBx1xC)
  whole = _masked_exp(b_NxBxHxC[..., -1:], starts_in_state_NxBx1xC[..., -1:])
  return within, within[..., -1, :], from_start, whole


def _wy_factors(k_NxBxHxCxK, v_NxBxHxCxV, beta_NxBxHxC, within_NxBxHxCxC, from_start_NxBxHxC):
  """W = (I + A)^{-1} diag(beta e^b) K and U = (I + A)^{-1} diag(beta) V by one triangular solve."""
  chunk = beta_NxBxHxC.shape[-1]
  strict_CxC = jnp.tril(jnp.ones((chunk, chunk), dtype=bool), k=-1)
  kk_NxBxHxCxC = _dot("nbhik,nbhjk->nbhij", k_NxBxHxCxK, k_NxBxHxCxK)
  A_NxBxHxCxC = jnp.where(strict_CxC, beta_NxBxHxC[..., None] * kk_NxBxHxCxC * within_NxBxHxCxC,
                          0.0)
  rhs_NxBxHxCx_KV = jnp.concatenate(
      [(beta_NxBxHxC * from_start_NxBxHxC)[..., None] * k_NxBxHxCxK.astype(jnp.float32),
       beta_NxBxHxC[..., None] * v_NxBxHxCxV.astype(jnp.float32)], axis=-1)
  unit_lower_NxBxHxCxC = A_NxBxHxCxC + jnp.eye(chunk, dtype=jnp.float32)
  WU = solve_triangular(unit_lower_NxBxHxCxC, rhs_NxBxHxCx_KV, lower=True, unit_diagonal=True)
  key_dim = k_NxBxHxCxK.shape[-1]
  return WU[..., :key_dim], WU[..., key_dim:]


def _scan_chunks(S0_BxHxKxV, W_NxBxHxCxK, U_NxBxHxCxV, k_end_NxBxHxCxK, whole_NxBxHx1):
  """Delta_n = U_n - W_n S_n, S_{n+1} = e^{b_C} S_n + (K e^{b_C-b})^T Delta_n, by ``lax.scan``.
  Returns (final S, the state entering every chunk [N, B, H, K, V], Delta [N, B, H, C, V])."""
  def step(S_BxHxKxV, xs):
    W_BxHxCxK, U_BxHxCxV, k_end_BxHxCxK, whole_BxHx1 = xs
    delta_BxHxCxV = U_BxHxCxV - _dot("bhck,bhkv->bhcv", W_BxHxCxK, S_BxHxKxV)
    S_next = (whole_BxHx1[..., None] * S_BxHxKxV
              + _dot("bhck,bhcv->bhkv", k_end_BxHxCxK, delta_BxHxCxV))
    return S_next, (S_BxHxKxV, delta_BxHxCxV)

  S_BxHxKxV, (S_in_NxBxHxKxV, delta_NxBxHxCxV) = jax.lax.scan(
      step, S0_BxHxKxV, (W_NxBxHxCxK, U_NxBxHxCxV, k_end_NxBxHxCxK, whole_NxBxHx1))
  return S_BxHxKxV, S_in_NxBxHxKxV, delta_NxBxHxCxV


def chunked(q_BxTxHxK: jax.Array, k_BxTxHxK: jax.Array, v_BxTxHxV: jax.Array,
            log_alpha_BxTxH: jax.Array, beta_BxTxH: jax.Array, S0_BxHxKxV: jax.Array, *,
            scale: float, segment_ids_BxT: jax.Array | None, chunk_size: int) -> tuple[jax.Array, jax.Array]:
  """``reference.recurrent`` in chunks of ``min(chunk_size, T)``: q.k and k.k in the inputs' dtype,
  the rest fp32. A partial last chunk is padded with beta = 0, log alpha = 0 and zero q, k, v."""
  batch_size, length = q_BxTxHxK.shape[:2]
  chunk = min(chunk_size, length)
  pad = math.ceil(length / chunk) * chunk - length
  # [B, T, H, ...] -> [N, B, H, C, ...]: chunks lead (the scan axis), heads before chunk tokens.
  chunks = lambda x: jnp.swapaxes(_to_chunks(_pad_tokens(x, pad), chunk), 2, 3)
  q, k, v = chunks(q_BxTxHxK), chunks(k_BxTxHxK), chunks(v_BxTxHxV)
  log_alpha_NxBxHxC = chunks(log_alpha_BxTxH.astype(jnp.float32))
  beta_NxBxHxC = chunks(beta_BxTxH.astype(jnp.float32))
  doc_BxT = document_index(segment_ids_BxT, batch_size, length)
  doc_NxBxC = _to_chunks(_pad_tokens(doc_BxT, pad, mode="edge"), chunk)
  doc_prev_NxB = jnp.concatenate([doc_NxBxC[:1, :, 0], doc_NxBxC[:-1, :, -1]], axis=0)

  within, to_end, from_start, whole = _decay_factors(log_alpha_NxBxHxC, doc_NxBxC, doc_prev_NxB)
  W, U = _wy_factors(k, v, beta_NxBxHxC, within, from_start)
  k_end_NxBxHxCxK = to_end[..., None] * k.astype(jnp.float32)
  S_BxHxKxV, S_in, delta = _scan_chunks(S0_BxHxKxV, W, U, k_end_NxBxHxCxK, whole)

  q_start_NxBxHxCxK = (scale * from_start)[..., None] * q.astype(jnp.float32)
  scores_NxBxHxCxC = scale * within * _dot("nbhik,nbhjk->nbhij", q, k)
  o_NxBxHxCxV = (_dot("nbhck,nbhkv->nbhcv", q_start_NxBxHxCxK, S_in)
                 + _dot("nbhij,nbhjv->nbhiv", scores_NxBxHxCxC, delta))
  o_BxNxCxHxV = jnp.moveaxis(jnp.swapaxes(o_NxBxHxCxV, 2, 3), 0, 1)
  o_BxTxHxV = o_BxNxCxHxV.reshape(batch_size, -1, *o_BxNxCxHxV.shape[3:])
  return o_BxTxHxV[:, :length], S_BxHxKxV


class Chunked(ChunkedBackend):
  """``chunked`` as a backend."""

  def flops_per_head(self, problem: Problem, tiles: ChunkTiles | None = None) -> float:
    """Per token, C' = min(C, T): K Kᵀ and Q Kᵀ 2 C' K each, the solve C' (K + V), scores · Δ 2 C' V,
    Δ = U - W S, the state update and the read 2 K V each: C' (5 K + 3 V) + 6 K V."""
    K, V = problem.key_dim, problem.value_dim
    chunk = self.config(problem, tiles).chunk
    if problem.length:
      chunk = min(chunk, problem.length)
    return chunk * (5.0 * K + 3.0 * V) + 6.0 * K * V

  def __call__(self, q, k, v, log_alpha, beta, S0, *, scale: float, segment_ids_BxT, tiles: ChunkTiles):
    return chunked(q, k, v, log_alpha, beta, S0, scale=scale, segment_ids_BxT=segment_ids_BxT,
                   chunk_size=tiles.chunk)
