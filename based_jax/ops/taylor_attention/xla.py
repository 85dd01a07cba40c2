"""The chunked XLA form of Taylor linear attention (MATH §2.1): ``lax.scan`` over chunks, masked
intra-chunk scores plus the carried fp32 state. Takes the decay ablation, not packed documents.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from based_jax.ops.taylor_attention.base import (Options, Problem, TaylorState, as_state, decay_inputs, mm,
                                                 scores)
from based_jax.taylor import Feature, feature_width, taylor_features
from lmcore.ops.common import flops
from lmcore.ops.common.backend import Backend, ChunkTiles

CHUNK = 64  # tokens per chunk unless the tiles say otherwise


def chunked(q: jax.Array, k: jax.Array, v: jax.Array, *, state: TaylorState | None = None,
            eps: float = 1e-12, feature: Feature = "compact", chunk: int = CHUNK,
            decay: jax.Array | None = None, dt: jax.Array | None = None
            ) -> tuple[jax.Array, TaylorState]:
  """``lax.scan`` over chunks of ``chunk`` tokens (``taylor_linear_attention``'s arguments; no
  packed documents).

  The last chunk is zero-padded after the feature map, so padded keys have phi(k) = 0 and add
  nothing to the state; padded tokens also take no decay step (log gamma 0), so the state after
  the scan is the state after token T-1.
  """
  batch, length, heads, _ = q.shape
  state = as_state(state, q, v, feature)
  log_gamma_H, dt_BxTxH = decay_inputs(q, decay, dt)
  size = min(chunk, length)
  n_chunks = -(-length // size)
  valid_NC = jnp.arange(n_chunks * size) < length
  # Cumulative log-decay inside each chunk (inclusive), fp32: b_c = sum_{i<=c} log gamma.
  logdecay_NxCxH = jnp.cumsum(
      (valid_NC[:, None] * log_gamma_H).reshape(n_chunks, size, heads), axis=1)

  def to_chunks(x_BxTx_):
    pad = [(0, 0), (0, n_chunks * size - length)] + [(0, 0)] * (x_BxTx_.ndim - 2)
    x = jnp.pad(x_BxTx_, pad).reshape(batch, n_chunks, size, *x_BxTx_.shape[2:])
    return jnp.moveaxis(x, 1, 0)

  # Feature maps outside the scan: the loop body stays small (and compiles twice as fast).
  phi_q_BxTxHxF = taylor_features(q, feature)
  phi_k_BxTxHxF = taylor_features(k, feature).astype(jnp.float32)
  xs = tuple(map(to_chunks, (q, k, phi_q_BxTxHxF, phi_k_BxTxHxF, v, dt_BxTxH))) + (logdecay_NxCxH,)
  step = lambda carry, x: _chunk_step(carry, *x, eps=eps)
  state, o_NxBxCxHxV = jax.lax.scan(step, state, xs)
  o_BxTxHxV = jnp.moveaxis(o_NxBxCxHxV, 0, 1).reshape(batch, n_chunks * size, heads, -1)
  return o_BxTxHxV[:, :length].astype(v.dtype), state


def _chunk_step(state, q_BxCxHxK, k_BxCxHxK, phi_q_BxCxHxF, phi_k_BxCxHxF, v_BxCxHxV, dt_BxCxH,
                b_CxH, *, eps):
  """One chunk: output from the carried state and the causal in-chunk block, then the new state."""
  size = q_BxCxHxK.shape[1]
  causal_CxC = jnp.tril(jnp.ones((size, size), bool))
  A_BxHxCxC = jnp.where(causal_CxC, scores(q_BxCxHxK, k_BxCxHxK), 0.0)
  # gamma^(c-d) = exp(b_c - b_d); clamped at 0 so the masked (c < d) entries cannot overflow.
  decay_HxCxC = jnp.exp(jnp.minimum(b_CxH.T[:, :, None] - b_CxH.T[:, None, :], 0.0))
  num_BxCxHxV = (mm("bhcd,bdhv->bchv", A_BxHxCxC * decay_HxCxC, v_BxCxHxV)
                 + jnp.exp(b_CxH)[..., None] * mm("bchf,bhfv->bchv", phi_q_BxCxHxF, state.S))
  den_BxCxH = A_BxHxCxC.sum(-1).transpose(0, 2, 1) + mm("bchf,bhf->bch", phi_q_BxCxHxF, state.z)
  o_BxCxHxV = dt_BxCxH[..., None] * num_BxCxHxV / (den_BxCxH[..., None] + eps)

  age_decay_CxH = jnp.exp(b_CxH[-1] - b_CxH)
  S = (jnp.exp(b_CxH[-1])[:, None, None] * state.S
       + mm("bchf,bchv->bhfv", phi_k_BxCxHxF * age_decay_CxH[..., None], v_BxCxHxV))
  z = state.z + phi_k_BxCxHxF.sum(1)
  return TaylorState(S, z), o_BxCxHxV


class Chunked(Backend[ChunkTiles]):
  """``chunked`` as a backend: any platform, the decay ablation, chunks of ``ChunkTiles.chunk`` tokens;
  no packed documents."""

  tiles_type = ChunkTiles
  requirement = "no segment_ids"

  def supports(self, problem: Problem) -> bool:
    return not problem.segments

  def heuristic_config(self, problem: Problem) -> ChunkTiles:
    del problem
    return ChunkTiles(CHUNK)

  def flops_per_head(self, problem: Problem, tiles: ChunkTiles | None = None) -> float:
    chunk = self.config(problem, tiles).chunk
    return flops.chunked(feature_width(problem.key_dim, problem.feature), problem.value_dim + 1, chunk,
                         problem.length or chunk, score_width=problem.key_dim)

  def __call__(self, q, k, v, *, state, eps, feature, decay, dt, segment_ids, tiles: ChunkTiles,
               options: Options = Options()):
    del segment_ids, options  # supports() keeps segment ids away
    return chunked(q, k, v, state=state, eps=eps, feature=feature, chunk=tiles.chunk, decay=decay, dt=dt)
