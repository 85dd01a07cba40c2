"""Readable references for gated linear attention: a token-by-token scan and the T x T form.

Both compute, per head and in fp32 (g the log forget gate, one scalar per head broadcast over the
key channels when G = 1, or one value per key channel when G = K)::

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_tᵀ,     o_t = scale * S_tᵀ q_t

and return (o [B, T, H, V] fp32, S_T [B, H, K, V] fp32). ``doc_BxT`` numbers the documents of a
packed row (0 at the first token, +1 at every segment change); the state is reset where it
changes. Normalisation is layered on top by ``base.run_backend`` (a ones column appended to v carries z).
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
  """``lax.scan`` over tokens: decay, add k vᵀ, then read, so token t sees itself. Also the decode
  path: one token is one step without a scan."""
  starts_BxT = jnp.concatenate([jnp.zeros_like(doc_BxT[:, :1], bool),
                                doc_BxT[:, 1:] != doc_BxT[:, :-1]], axis=1)

  def step(S_BxHxKxV, inputs):
    # The readout as products and a sum over K rather than a dot, so that XLA can compute the new
    # state and the readout in one pass over S (a decode step reads the state once, writes it once).
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
  """The materialised form (tests only: it holds a [B, H, T, T, K] decay tensor).

  With b_t = sum_{s<=t} g_s (fp32), token i reads key j <= i of its own document with weight
  exp(b_i - b_j) per key channel, and the initial state (first document only) with exp(b_i).
  Exponents are masked to -inf before ``exp``, so no positive difference is ever exponentiated.
  """
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
