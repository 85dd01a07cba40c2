"""Token-by-token gated delta rule in fp32 (MATH §4): the definition every other form must match.

S_t = alpha_t (I - beta_t k_t k_tᵀ) S_{t-1} + beta_t k_t v_tᵀ, o_t = scale * S_tᵀ q_t, computed as
delta_t = beta_t (v_t - alpha_t S_{t-1}ᵀ k_t), S_t = alpha_t S_{t-1} + k_t delta_tᵀ (one rank-1 update).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lmcore.ops.common.backend import Backend
from lmcore.ops.common.segments import document_starts
from lmcore.ops.gated_delta_rule.base import Problem

_HIGHEST = jax.lax.Precision.HIGHEST


def _step(S_BxHxKxV, inputs, *, scale: float):
  """One token: reset where a new segment starts, then the delta-rule update and the read-out."""
  q_BxHxK, k_BxHxK, v_BxHxV, log_alpha_BxH, beta_BxH, reset_B = inputs
  S_BxHxKxV = jnp.where(reset_B[:, None, None, None], 0.0, S_BxHxKxV)
  alpha_BxHx1 = jnp.exp(log_alpha_BxH)[..., None]
  kS_BxHxV = jnp.einsum("bhk,bhkv->bhv", k_BxHxK, S_BxHxKxV, precision=_HIGHEST)
  delta_BxHxV = beta_BxH[..., None] * (v_BxHxV - alpha_BxHx1 * kS_BxHxV)
  S_BxHxKxV = alpha_BxHx1[..., None] * S_BxHxKxV + k_BxHxK[..., None] * delta_BxHxV[..., None, :]
  o_BxHxV = scale * jnp.einsum("bhk,bhkv->bhv", q_BxHxK, S_BxHxKxV, precision=_HIGHEST)
  return S_BxHxKxV, o_BxHxV


def recurrent(q_BxTxHxK: jax.Array, k_BxTxHxK: jax.Array, v_BxTxHxV: jax.Array,
              log_alpha_BxTxH: jax.Array, beta_BxTxH: jax.Array, S0_BxHxKxV: jax.Array, *,
              scale: float, segment_ids_BxT: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """``lax.scan`` over tokens; returns (o [B, T, H, V], final S [B, H, K, V]), fp32. The state resets
  where ``segment_ids`` changes; one token (decoding) is one step without a scan."""
  batch_size, length = q_BxTxHxK.shape[:2]
  resets_BxT = document_starts(segment_ids_BxT, batch_size, length)
  if length == 1:
    inputs = tuple(x[:, 0].astype(jnp.float32) for x in (q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, log_alpha_BxTxH,
                                                          beta_BxTxH))
    S_BxHxKxV, o_BxHxV = _step(S0_BxHxKxV, (*inputs, resets_BxT[:, 0]), scale=scale)
    return o_BxHxV[:, None], S_BxHxKxV
  time_major = lambda x: jnp.moveaxis(x.astype(jnp.float32), 1, 0)
  xs = (time_major(q_BxTxHxK), time_major(k_BxTxHxK), time_major(v_BxTxHxV),
        time_major(log_alpha_BxTxH), time_major(beta_BxTxH), jnp.moveaxis(resets_BxT, 1, 0))
  S_BxHxKxV, o_TxBxHxV = jax.lax.scan(functools.partial(_step, scale=scale), S0_BxHxKxV, xs)
  return jnp.moveaxis(o_TxBxHxV, 0, 1), S_BxHxKxV


class Recurrent(Backend[None]):
  """``recurrent`` as a backend: any platform; the decode path."""

  def flops_per_head(self, problem: Problem, tiles=None) -> float:
    """kᵀ S, the rank-one write and the read Sᵀ q: 6 · K · V per token."""
    return 6.0 * problem.key_dim * problem.value_dim

  def __call__(self, q, k, v, log_alpha, beta, S0, *, scale: float, segment_ids_BxT, tiles=None):
    del tiles
    return recurrent(q, k, v, log_alpha, beta, S0, scale=scale, segment_ids_BxT=segment_ids_BxT)
