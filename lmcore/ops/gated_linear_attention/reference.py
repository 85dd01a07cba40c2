"""Readable references for gated linear attention: a token-by-token scan and the T x T form.

Both compute in fp32, per head, with g the log forget gate (G = 1: one per head; G = K: per key)::

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_tᵀ,     o_t = scale * S_tᵀ q_t

with the backend contract of ``base`` (the state resets where ``doc_BxT`` changes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lmcore.ops.common import flops
from lmcore.ops.common.backend import Backend
from lmcore.ops.gated_linear_attention.base import Options, Problem

_HIGHEST = jax.lax.Precision.HIGHEST


def _f32(x: jax.Array) -> jax.Array:
  return x.astype(jnp.float32)


def recurrent(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxG, S0_BxHxKxV, *, scale: float, doc_BxT):
  """``lax.scan`` over tokens: decay, add k vᵀ, then read (token t sees itself). One token (decode) is
  one step without a scan."""
  starts_BxT = jnp.concatenate([jnp.zeros_like(doc_BxT[:, :1], bool),
                                doc_BxT[:, 1:] != doc_BxT[:, :-1]], axis=1)

  def step(S_BxHxKxV, inputs):
    # The read as products summed over K, not a dot: XLA fuses it with the update (one pass over S).
    q_BxHxK, k_BxHxK, v_BxHxV, g_BxHxG, start_B = inputs
    S_BxHxKxV = jnp.where(start_B[:, None, None, None], 0.0, S_BxHxKxV)
    S_BxHxKxV = (jnp.exp(g_BxHxG)[..., None] * S_BxHxKxV
                 + k_BxHxK[..., :, None] * v_BxHxV[..., None, :])
    o_BxHxV = scale * jnp.sum(q_BxHxK[..., :, None] * S_BxHxKxV, axis=-2)
    return S_BxHxKxV, o_BxHxV

  xs = (_f32(q_BxTxHxK), _f32(k_BxTxHxK), _f32(v_BxTxHxV), _f32(g_BxTxHxG), starts_BxT)
  if q_BxTxHxK.shape[1] == 1:
    S_BxHxKxV, o_BxHxV = step(_f32(S0_BxHxKxV), tuple(x[:, 0] for x in xs))
    return o_BxHxV[:, None], S_BxHxKxV
  time_major = lambda x: jnp.moveaxis(x, 1, 0)
  S_BxHxKxV, o_TxBxHxV = jax.lax.scan(step, _f32(S0_BxHxKxV), tuple(time_major(x) for x in xs))
  return jnp.moveaxis(o_TxBxHxV, 0, 1), S_BxHxKxV


def parallel(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxG, S0_BxHxKxV, *, scale: float, doc_BxT):
  """The materialised form (tests only: a [B, H, T, T, K] decay tensor). With b_t = sum_{s<=t} g_s,
  token i reads key j <= i of its document with weight exp(b_i - b_j) per key channel and the initial
  state (first document only) with exp(b_i); exponents are masked to -inf before ``exp``."""
  q, k, v, S0 = _f32(q_BxTxHxK), _f32(k_BxTxHxK), _f32(v_BxTxHxV), _f32(S0_BxHxKxV)
  T, K = q.shape[1], q.shape[-1]
  b_BxTxHxG = jnp.cumsum(_f32(g_BxTxHxG), axis=1)
  same_doc_BxTxT = doc_BxT[:, :, None] == doc_BxT[:, None, :]
  visible_Bx1xTxTx1 = (same_doc_BxTxT & jnp.tril(jnp.ones((T, T), bool)))[:, None, :, :, None]
  b_BxHxTxG = jnp.moveaxis(b_BxTxHxG, 2, 1)
  diff_BxHxTxTxG = b_BxHxTxG[:, :, :, None, :] - b_BxHxTxG[:, :, None, :, :]
  decay_BxHxTxTxG = jnp.exp(jnp.where(visible_Bx1xTxTx1, diff_BxHxTxTxG, -jnp.inf))
  decay_BxHxTxTxK = jnp.broadcast_to(decay_BxHxTxTxG, (*decay_BxHxTxTxG.shape[:4], K))
  scores_BxHxTxT = scale * jnp.einsum("bihk,bjhk,bhijk->bhij", q, k, decay_BxHxTxTxK,
                                      precision=_HIGHEST)
  first_doc_BxTx1x1 = (doc_BxT == 0)[:, :, None, None]
  q_from_state = jnp.where(first_doc_BxTx1x1, q * jnp.exp(b_BxTxHxG), 0.0)
  o = (jnp.einsum("bhij,bjhv->bihv", scores_BxHxTxT, v, precision=_HIGHEST)
       + scale * jnp.einsum("bthk,bhkv->bthv", q_from_state, S0, precision=_HIGHEST))
  return o, _final_state(k, v, b_BxTxHxG, S0, doc_BxT)


def _final_state(k_BxTxHxK, v_BxTxHxV, b_BxTxHxG, S0_BxHxKxV, doc_BxT):
  """S_T = [no reset] exp(b_T) S_0 + sum_{j in the last document} (k_j ⊙ exp(b_T - b_j)) v_jᵀ."""
  last_doc_Bx1 = doc_BxT[:, -1:]
  in_last_BxTx1x1 = (doc_BxT == last_doc_Bx1)[:, :, None, None]
  b_end_Bx1xHxG = b_BxTxHxG[:, -1:]
  to_end = jnp.where(in_last_BxTx1x1, b_end_Bx1xHxG - b_BxTxHxG, -jnp.inf)
  writes_BxHxKxV = jnp.einsum("bthk,bthv->bhkv", k_BxTxHxK * jnp.exp(to_end), v_BxTxHxV,
                              precision=_HIGHEST)
  keeps_Bx1x1x1 = (last_doc_Bx1 == 0)[:, :, None, None]
  decay_BxHxGx1 = jnp.where(keeps_Bx1x1x1, jnp.exp(b_end_Bx1xHxG[:, 0])[..., None], 0.0)
  return decay_BxHxGx1 * S0_BxHxKxV + writes_BxHxKxV


class Recurrent(Backend[None]):
  """``recurrent`` as a backend: any platform; the decode path."""

  def flops_per_head(self, problem: Problem, tiles=None) -> float:
    return flops.recurrent(problem.key_dim, problem.value_dim)

  def __call__(self, q, k, v, g, S0, *, scale: float, doc_BxT, tiles=None, options: Options = Options()):
    del tiles, options
    return recurrent(q, k, v, g, S0, scale=scale, doc_BxT=doc_BxT)


class Parallel(Backend[None]):
  """``parallel`` as a backend: any platform; the T x T form (tests)."""

  def flops_per_head(self, problem: Problem, tiles=None) -> float:
    return flops.quadratic(problem.key_dim, problem.value_dim, problem.length or 1)

  def __call__(self, q, k, v, g, S0, *, scale: float, doc_BxT, tiles=None, options: Options = Options()):
    del tiles, options
    return parallel(q, k, v, g, S0, scale=scale, doc_BxT=doc_BxT)
