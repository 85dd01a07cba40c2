"""The chunked XLA form of Taylor linear attention (MATH §2.1): ``lax.scan`` over chunks, masked
intra-chunk scores plus the carried fp32 state. Takes the decay ablation and packed documents.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from based_jax.ops.taylor_attention.base import (Options, Problem, TaylorState, as_state, decay_inputs, mm,
                                                 scores)
from based_jax.taylor import Feature, feature_width, taylor_features
from lmcore.ops.common import flops
from lmcore.ops.common.backend import Backend, ChunkTiles
from lmcore.ops.common.segments import chunk_documents, document_index

CHUNK = 64  # tokens per chunk unless the tiles say otherwise


class ChunkDocs(NamedTuple):
  """A chunk's documents (bool [B, C]): ``same`` [B, C, C] pairs in one document; ``reads`` tokens in
  the document of the state entering the chunk; ``writes`` tokens in the document leaving it."""

  same: jax.Array
  reads: jax.Array
  writes: jax.Array


def chunked(q: jax.Array, k: jax.Array, v: jax.Array, *, state: TaylorState | None = None,
            eps: float = 1e-12, feature: Feature = "compact", chunk: int = CHUNK,
            decay: jax.Array | None = None, dt: jax.Array | None = None,
            segment_ids: jax.Array | None = None) -> tuple[jax.Array, TaylorState]:
  """``lax.scan`` over chunks of ``chunk`` tokens (``taylor_linear_attention``'s arguments).

  The last chunk is zero-padded after the feature map, so padded keys have phi(k) = 0 and add
  nothing to the state; padded tokens also take no decay step (log gamma 0) and stay in the last
  document, so the state after the scan is the state after token T-1. With ``segment_ids`` a chunk
  masks its scores to pairs in one document, its tokens read the carried state only in the document
  that state belongs to, and the state it passes on holds only the keys of its last document (the
  carried one too if no document starts in the chunk).
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
    pad = [(0, 0), (0, n_chunks * size - x_BxTx_.shape[1])] + [(0, 0)] * (x_BxTx_.ndim - 2)
    x = jnp.pad(x_BxTx_, pad).reshape(batch, n_chunks, size, *x_BxTx_.shape[2:])
    return jnp.moveaxis(x, 1, 0)

  # Feature maps outside the scan: the loop body stays small (and compiles twice as fast).
  phi_q_BxTxHxF = taylor_features(q, feature)
  phi_k_BxTxHxF = taylor_features(k, feature).astype(jnp.float32)
  xs = tuple(map(to_chunks, (q, k, phi_q_BxTxHxF, phi_k_BxTxHxF, v, dt_BxTxH))) + (logdecay_NxCxH,)
  if segment_ids is None:
    step = lambda carry, x: _chunk_step(carry, *x, None, eps=eps)
  else:
    # Edge-padded to whole chunks (``chunk_documents``), so padding stays in the last document.
    docs = chunk_documents(document_index(segment_ids, batch, length), n_chunks * size, size)
    doc_NxBxC, reads_NxBxC, writes_NxBxC = (to_chunks(a[..., 0]) for a in (docs.doc, docs.reads, docs.writes))
    xs += (ChunkDocs(doc_NxBxC[..., :, None] == doc_NxBxC[..., None, :], reads_NxBxC.astype(bool),
                     writes_NxBxC.astype(bool)),)
    step = lambda carry, x: _chunk_step(carry, *x, eps=eps)
  state, o_NxBxCxHxV = jax.lax.scan(step, state, xs)
  o_BxTxHxV = jnp.moveaxis(o_NxBxCxHxV, 0, 1).reshape(batch, n_chunks * size, heads, -1)
  return o_BxTxHxV[:, :length].astype(v.dtype), state


def _chunk_step(state, q_BxCxHxK, k_BxCxHxK, phi_q_BxCxHxF, phi_k_BxCxHxF, v_BxCxHxV, dt_BxCxH,
                b_CxH, docs: ChunkDocs | None, *, eps):
  """One chunk: output from the carried state and the causal in-chunk block (of one document each),
  then the new state."""
  size = q_BxCxHxK.shape[1]
  visible_Bx1xCxC = jnp.tril(jnp.ones((size, size), bool))[None, None]
  if docs is not None:
    visible_Bx1xCxC = visible_Bx1xCxC & docs.same[:, None]
  A_BxHxCxC = jnp.where(visible_Bx1xCxC, scores(q_BxCxHxK, k_BxCxHxK), 0.0)
  # gamma^(c-d) = exp(b_c - b_d) for c >= d, and 1 for the masked c < d (which could overflow). A
  # select, not a clamp at 0: at gamma = 1 every difference is 0, where a clamp would halve d/d gamma.
  lag_HxCxC = b_CxH.T[:, :, None] - b_CxH.T[:, None, :]
  decay_HxCxC = jnp.exp(jnp.where(jnp.tril(jnp.ones((size, size), bool)), lag_HxCxC, 0.0))
  read_S_BxCxHxV = jnp.exp(b_CxH)[..., None] * mm("bchf,bhfv->bchv", phi_q_BxCxHxF, state.S)
  read_z_BxCxH = mm("bchf,bhf->bch", phi_q_BxCxHxF, state.z)
  age_decay_CxH = jnp.exp(b_CxH[-1] - b_CxH)
  S, z = jnp.exp(b_CxH[-1])[:, None, None] * state.S, state.z
  if docs is not None:
    read_S_BxCxHxV = jnp.where(docs.reads[..., None, None], read_S_BxCxHxV, 0.0)
    read_z_BxCxH = jnp.where(docs.reads[..., None], read_z_BxCxH, 0.0)
    phi_k_BxCxHxF = jnp.where(docs.writes[..., None, None], phi_k_BxCxHxF, 0.0)
    keep_B = docs.reads[:, -1]  # no document starts in the chunk
    S, z = jnp.where(keep_B[:, None, None, None], S, 0.0), jnp.where(keep_B[:, None, None], z, 0.0)
  num_BxCxHxV = mm("bhcd,bdhv->bchv", A_BxHxCxC * decay_HxCxC, v_BxCxHxV) + read_S_BxCxHxV
  den_BxCxH = A_BxHxCxC.sum(-1).transpose(0, 2, 1) + read_z_BxCxH
  o_BxCxHxV = dt_BxCxH[..., None] * num_BxCxHxV / (den_BxCxH[..., None] + eps)
  S = S + mm("bchf,bchv->bhfv", phi_k_BxCxHxF * age_decay_CxH[..., None], v_BxCxHxV)
  return TaylorState(S, z + phi_k_BxCxHxF.sum(1)), o_BxCxHxV


class Chunked(Backend[ChunkTiles]):
  """``chunked`` as a backend: any platform, the decay ablation and packed documents, chunks of
  ``ChunkTiles.chunk`` tokens."""

  tiles_type = ChunkTiles

  def heuristic_config(self, problem: Problem) -> ChunkTiles:
    del problem
    return ChunkTiles(CHUNK)

  def flops_per_head(self, problem: Problem, tiles: ChunkTiles | None = None) -> float:
    chunk = self.config(problem, tiles).chunk
    return flops.chunked(feature_width(problem.key_dim, problem.feature), problem.value_dim + 1, chunk,
                         problem.length or chunk, score_width=problem.key_dim)

  def __call__(self, q, k, v, *, state, eps, feature, decay, dt, segment_ids, tiles: ChunkTiles,
               options: Options = Options()):
    del options
    return chunked(q, k, v, state=state, eps=eps, feature=feature, chunk=tiles.chunk, decay=decay, dt=dt,
                   segment_ids=segment_ids)
