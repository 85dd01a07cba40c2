"""The readable forms of Taylor linear attention (MATH §2.1): ``parallel`` materialises the T x T
scores, ``recurrent`` scans token by token (the decode path). Both take the decay ablation and
packed documents.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from based_jax.ops.taylor_attention.base import (Options, Problem, TaylorState, as_state, decay_inputs,
                                                 mm, parallel_final_state, scores, state_reads)
from based_jax.taylor import Feature, feature_width, taylor_features
from lmcore.ops.common import flops
from lmcore.ops.common.backend import Backend
from lmcore.ops.common.segments import document_index, document_starts


def parallel(q: jax.Array, k: jax.Array, v: jax.Array, *, state: TaylorState | None = None,
             eps: float = 1e-12, feature: Feature = "compact", decay: jax.Array | None = None,
             dt: jax.Array | None = None, segment_ids: jax.Array | None = None
             ) -> tuple[jax.Array, TaylorState]:
  """Materialised scores, masked by causality and by documents (``taylor_linear_attention``'s
  arguments)."""
  batch, length = q.shape[:2]
  state = as_state(state, q, v, feature)
  log_gamma_H, dt_BxTxH = decay_inputs(q, decay, dt)
  doc_BxT = document_index(segment_ids, batch, length)
  t_T = jnp.arange(length)
  lag_TxT = t_T[:, None] - t_T[None, :]
  visible_Bx1xTxT = ((lag_TxT >= 0)[None] & (doc_BxT[:, :, None] == doc_BxT[:, None, :]))[:, None]
  A_BxHxTxT = jnp.where(visible_Bx1xTxT, scores(q, k), 0.0)
  decay_HxTxT = jnp.exp(log_gamma_H[:, None, None] * jnp.maximum(lag_TxT, 0))
  num_BxTxHxV = mm("bhts,bshv->bthv", A_BxHxTxT * decay_HxTxT, v)
  den_BxTxH = A_BxHxTxT.sum(-1).transpose(0, 2, 1)

  # The incoming state is the prefix of document 0; it has decayed by gamma^(t+1) at token t.
  first_BxTx1, (read_S_BxTxHxV, read_z_BxTxH) = state_reads(q, state, doc_BxT, feature)
  prefix_BxTxH = first_BxTx1 * jnp.exp((t_T[:, None] + 1) * log_gamma_H)
  num_BxTxHxV += prefix_BxTxH[..., None] * read_S_BxTxHxV
  den_BxTxH += first_BxTx1 * read_z_BxTxH
  o_BxTxHxV = dt_BxTxH[..., None] * num_BxTxHxV / (den_BxTxH[..., None] + eps)
  return o_BxTxHxV.astype(v.dtype), parallel_final_state(k, v, state, log_gamma_H, doc_BxT,
                                                         feature=feature)


def recurrent(q: jax.Array, k: jax.Array, v: jax.Array, *, state: TaylorState | None = None,
              eps: float = 1e-12, feature: Feature = "compact", decay: jax.Array | None = None,
              dt: jax.Array | None = None, segment_ids: jax.Array | None = None
              ) -> tuple[jax.Array, TaylorState]:
  """``lax.scan`` over tokens: write, then read; the state resets where a document starts.

  ``S <- gamma S + phi(k) v^T``, ``z <- z + phi(k)``, ``o = dt phi(q)·S / (phi(q)·z + eps)``.
  One token (decoding) is one step without a scan.
  """
  batch, length = q.shape[:2]
  state = as_state(state, q, v, feature)
  log_gamma_H, dt_BxTxH = decay_inputs(q, decay, dt)
  gamma_H = jnp.exp(log_gamma_H)
  reset_BxT = document_starts(segment_ids, batch, length)

  def step(state, x):
    # Products and sums over F rather than dots, so that XLA can compute the new state and the
    # readout in one pass over S (a decode step reads the fp32 state once and writes it once).
    phi_q_BxHxF, phi_k_BxHxF, v_BxHxV, dt_BxH, reset_B = x
    phi_q_BxHxF = phi_q_BxHxF.astype(jnp.float32)
    keep_B = 1.0 - reset_B.astype(jnp.float32)
    S = (keep_B[:, None, None, None] * gamma_H[:, None, None] * state.S
         + phi_k_BxHxF[..., None] * v_BxHxV.astype(jnp.float32)[..., None, :])
    z = keep_B[:, None, None] * state.z + phi_k_BxHxF
    num_BxHxV = jnp.sum(phi_q_BxHxF[..., None] * S, axis=-2)
    den_BxH = jnp.sum(phi_q_BxHxF * z, axis=-1)
    return TaylorState(S, z), dt_BxH[..., None] * num_BxHxV / (den_BxH[..., None] + eps)

  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  xs = (taylor_features(q, feature), taylor_features(k, feature).astype(jnp.float32), v, dt_BxTxH,
        reset_BxT)
  if length == 1:
    state, o_BxHxV = step(state, jax.tree.map(lambda x: x[:, 0], xs))
    return o_BxHxV[:, None].astype(v.dtype), state
  state, o_TxBxHxV = jax.lax.scan(step, state, jax.tree.map(time_major, xs))
  return time_major(o_TxBxHxV).astype(v.dtype), state


class Parallel(Backend[None]):
  """``parallel`` as a backend: any platform, the decay ablation and packed documents; B H T² fp32
  scores."""

  def flops_per_head(self, problem: Problem, tiles=None) -> float:
    return flops.quadratic(problem.key_dim, problem.value_dim + 1, problem.length or 1)

  def __call__(self, q, k, v, *, state, eps, feature, decay, dt, segment_ids, tiles=None,
               options: Options = Options()):
    del tiles, options
    return parallel(q, k, v, state=state, eps=eps, feature=feature, decay=decay, dt=dt,
                    segment_ids=segment_ids)


class Recurrent(Backend[None]):
  """``recurrent`` as a backend: any platform, the decay ablation and packed documents; the decode
  path."""

  def flops_per_head(self, problem: Problem, tiles=None) -> float:
    return flops.recurrent(feature_width(problem.key_dim, problem.feature), problem.value_dim + 1)

  def __call__(self, q, k, v, *, state, eps, feature, decay, dt, segment_ids, tiles=None,
               options: Options = Options()):
    del tiles, options
    return recurrent(q, k, v, state=state, eps=eps, feature=feature, decay=decay, dt=dt,
                     segment_ids=segment_ids)
