"""The chunked XLA form of Taylor linear attention (MATH §2.1) on whole arrays: every chunk's masked
intra-chunk block and state increment as batched einsums, the fp32 states entering the chunks as a
(document-gated, decayed) prefix sum over chunks (``lmcore.ops.common.chunk_prefix``). Takes the decay
ablation and packed documents; by default its backward pass recomputes the form from its inputs.

Matmul operands stay in the inputs' dtype (bf16 in training) with fp32 accumulation; fp32 inputs
multiply at full fp32 precision. States and normalisers are fp32.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from based_jax.ops.taylor_attention.base import Options, Problem, TaylorState, as_state
from based_jax.taylor import Feature, feature_width, taylor_features, taylor_kernel
from lmcore.ops.common import flops, pallas_utils
from lmcore.ops.common.backend import Backend, ChunkTiles
from lmcore.ops.common.chunk_prefix import chunk_prefix_sum, prefix_block
from lmcore.ops.common.segments import chunk_documents, document_index

F32 = jnp.float32
# Tokens per chunk unless the tiles say otherwise: the state stacks [B, N, H, F, dv] shrink with the
# chunk and the blocks [B, N, H, C, C] grow with it (docs/DECISIONS.md, XLA forms).
CHUNK = 128
# The backward pass recomputes the form (``jax.checkpoint``) instead of keeping its features, blocks and
# state stacks for it, as SANATAN's chunked form does by default.
REMAT = True


class _Docs(NamedTuple):
  """Packed documents per chunk: ``same`` [B, N, 1, C, C] pairs in one document; ``reads`` [B, N, C]
  tokens in the document of the state entering their chunk; ``writes`` [B, N, C] tokens in the
  document leaving it; ``last`` [B, N] that document's index."""

  same: jax.Array
  reads: jax.Array
  writes: jax.Array
  last: jax.Array


dot = pallas_utils.einsum_f32  # float32 accumulation, full precision for float32 operands


def chunked(q: jax.Array, k: jax.Array, v: jax.Array, *, state: TaylorState | None = None,
            eps: float = 1e-12, feature: Feature = "compact", chunk: int = CHUNK,
            decay: jax.Array | None = None, dt: jax.Array | None = None,
            segment_ids: jax.Array | None = None, remat: bool = REMAT) -> tuple[jax.Array, TaylorState]:
  """All chunks of ``chunk`` tokens at once (``taylor_linear_attention``'s arguments): o [B, T, H, dv]
  in v's dtype and the fp32 state after token T-1 (``_chunked_core``).

  With ``remat`` the backward pass recomputes the form from the op's inputs (``jax.checkpoint``), so
  what waits for it is q, k, v, the state and the decay inputs; autodiff of the form itself keeps,
  per layer until its backward pass, the features phi(q), phi(k) [B, T, H, F], the blocks
  [B, N, H, C, C] and the state stacks [B, N, H, F, dv]. Outputs and gradients are the same either way.
  """
  core = functools.partial(_chunked_core, eps=eps, feature=feature, chunk=chunk)
  if remat:
    core = jax.checkpoint(core)
  return core(q, k, v, state, decay, dt, segment_ids)


def _chunked_core(q, k, v, state, decay, dt, segment_ids, *, eps, feature, chunk):
  """``chunked`` without the recomputation (what autodiff differentiates).

  Per chunk n of C tokens (the last zero-padded after the feature map, so padded keys add nothing):
  the masked block A_n = Mask ⊙ (1 + s + s²/2), s = Q_n K_nᵀ / sqrt(d'), weighted by gamma^(c-d) in the
  numerator, and the increment ΔS_n = Σ_d gamma^(age_d) phi(k_d) v_dᵀ of its last document's keys
  (age: tokens to the chunk's last one); the state entering chunk n is the decayed, document-gated
  prefix sum of the increments, plus the incoming state while document 0 lasts. Token c of a chunk
  reads that state decayed by gamma^(c+1), if it is in its document.
  """
  B, T, H, K = q.shape
  C = min(chunk, T)
  N = -(-T // C)
  chunks = lambda a: pallas_utils.pad_axis(a, 1, N * C).reshape(B, N, C, *a.shape[2:])
  q_BxNxCxHxK, k_BxNxCxHxK, v_BxNxCxHxV = chunks(q), chunks(k), chunks(v)
  phi_q_BxNxCxHxF = chunks(taylor_features(q, feature))
  phi_k_BxNxCxHxF = chunks(taylor_features(k, feature))
  docs = None if segment_ids is None else _chunk_docs(segment_ids, B, T, N, C)
  log_gamma_H = None  # without the decay ablation the form skips every decay factor
  if decay is not None or dt is not None:
    log_gamma_H = jnp.zeros((H,), F32) if decay is None else jnp.log(decay.astype(F32))

  num_BxNxCxHxV, den_BxNxCxH = _intra_chunk(q_BxNxCxHxK, k_BxNxCxHxK, v_BxNxCxHxV, docs, log_gamma_H)

  increments, entering = _states_entering(phi_k_BxNxCxHxF, v_BxNxCxHxV, docs, log_gamma_H, T,
                                          None if state is None else as_state(state, q, v, feature))
  S_in_BxNxHxFxV, z_in_BxNxHxF = entering
  read_num_BxNxCxHxV = dot("bnchf,bnhfv->bnchv", phi_q_BxNxCxHxF, S_in_BxNxHxFxV.astype(phi_q_BxNxCxHxF.dtype))
  read_den_BxNxCxH = dot("bnchf,bnhf->bnch", phi_q_BxNxCxHxF, z_in_BxNxHxF)
  if log_gamma_H is not None:
    read_num_BxNxCxHxV *= jnp.exp((jnp.arange(C)[:, None] + 1) * log_gamma_H)[..., None]
  if docs is not None:
    read_num_BxNxCxHxV = jnp.where(docs.reads[..., None, None], read_num_BxNxCxHxV, 0.0)
    read_den_BxNxCxH = jnp.where(docs.reads[..., None], read_den_BxNxCxH, 0.0)
  num_BxTxHxV = (num_BxNxCxHxV + read_num_BxNxCxHxV).reshape(B, N * C, H, -1)[:, :T]
  den_BxTxH = (den_BxNxCxH + read_den_BxNxCxH).reshape(B, N * C, H)[:, :T]
  o_BxTxHxV = num_BxTxHxV / (den_BxTxH[..., None] + eps)
  if dt is not None:
    o_BxTxHxV = dt.astype(F32)[..., None] * o_BxTxHxV
  last_BxN = None if docs is None else docs.last
  S_BxHxFxV = _state_leaving(S_in_BxNxHxFxV, increments.S, last_BxN, increments.log_decay)
  z_BxHxF = _state_leaving(z_in_BxNxHxF, increments.z, last_BxN)
  return o_BxTxHxV.astype(v.dtype), TaylorState(S_BxHxFxV, z_BxHxF)


class _Increments(NamedTuple):
  """What each chunk adds to the state: ``S`` [B, N, H, F, dv] (decayed to the chunk's last token) and
  ``z`` [B, N, H, F] (fp32, its last document's keys), and the log-decay of a state across each chunk
  ``log_decay`` [1, N, H] (None without decay)."""

  S: jax.Array
  z: jax.Array
  log_decay: jax.Array | None


def _states_entering(phi_k_BxNxCxHxF, v_BxNxCxHxV, docs: _Docs | None, log_gamma_H, T: int,
                     state: TaylorState | None) -> tuple[_Increments, TaylorState]:
  """Each chunk's increments and the states entering the chunks (fp32): the decayed, document-gated
  prefix sum of the increments (``chunk_prefix_sum``), plus the incoming state while document 0 lasts."""
  N, C = phi_k_BxNxCxHxF.shape[1:3]
  k_state_BxNxCxHxF = phi_k_BxNxCxHxF
  if docs is not None:
    k_state_BxNxCxHxF = jnp.where(docs.writes[..., None, None], k_state_BxNxCxHxF, 0)
  dz_BxNxHxF = jnp.sum(k_state_BxNxCxHxF.astype(F32), axis=2)
  ell_1xNxH = None
  if log_gamma_H is not None:
    valid_N = jnp.minimum(T - C * jnp.arange(N), C)  # tokens of each chunk (the last may be partial)
    age_NxC = jnp.maximum(valid_N[:, None] - 1 - jnp.arange(C), 0)
    age_decay_1xNxCxHx1 = jnp.exp(age_NxC[..., None] * log_gamma_H)[None, ..., None]
    k_state_BxNxCxHxF = (k_state_BxNxCxHxF * age_decay_1xNxCxHx1).astype(phi_k_BxNxCxHxF.dtype)
    ell_1xNxH = (valid_N[:, None] * log_gamma_H)[None]
  dS_BxNxHxFxV = dot("bnchf,bnchv->bnhfv", k_state_BxNxCxHxF, v_BxNxCxHxV)
  block = prefix_block(pallas_utils.backend())
  last_BxN = None if docs is None else docs.last
  S_in_BxNxHxFxV = chunk_prefix_sum(dS_BxNxHxFxV, last_BxN, block, ell_1xNxH)
  z_in_BxNxHxF = chunk_prefix_sum(dz_BxNxHxF, last_BxN, block)
  if state is not None:
    S_in_BxNxHxFxV, z_in_BxNxHxF = _add_incoming(S_in_BxNxHxFxV, z_in_BxNxHxF, state, last_BxN, ell_1xNxH)
  return _Increments(dS_BxNxHxFxV, dz_BxNxHxF, ell_1xNxH), TaylorState(S_in_BxNxHxFxV, z_in_BxNxHxF)


def _chunk_docs(segment_ids, B, T, N, C) -> _Docs:
  """Each chunk's documents, edge-padded to whole chunks (``chunk_documents``), so that padding stays
  in the last document."""
  docs = chunk_documents(document_index(segment_ids, B, T), N * C, C)
  doc_BxNxC = docs.doc.reshape(B, N, C)
  return _Docs(same=(doc_BxNxC[..., :, None] == doc_BxNxC[..., None, :])[:, :, None],
               reads=docs.reads.reshape(B, N, C).astype(bool), writes=docs.writes.reshape(B, N, C).astype(bool),
               last=doc_BxNxC[:, :, -1])


def _intra_chunk(q_BxNxCxHxK, k_BxNxCxHxK, v_BxNxCxHxV, docs: _Docs | None, log_gamma_H):
  """The causal in-chunk part of every chunk (of one document each): the numerator
  Σ_{d<=c} gamma^(c-d) A_cd v_d [B, N, C, H, dv] and the undecayed denominator Σ_{d<=c} A_cd [B, N, C, H]."""
  C, K = q_BxNxCxHxK.shape[2], q_BxNxCxHxK.shape[-1]
  s_BxNxHxCxC = dot("bnchk,bndhk->bnhcd", q_BxNxCxHxK, k_BxNxCxHxK) / math.sqrt(K)
  causal_CxC = jnp.tril(jnp.ones((C, C), bool))
  visible = causal_CxC if docs is None else causal_CxC & docs.same
  A_BxNxHxCxC = jnp.where(visible, taylor_kernel(s_BxNxHxCxC), 0.0)
  den_BxNxCxH = jnp.sum(A_BxNxHxCxC, axis=-1).transpose(0, 1, 3, 2)
  weights_BxNxHxCxC = A_BxNxHxCxC
  if log_gamma_H is not None:
    # gamma^(c-d) as exp((c-d) log gamma), selected on c >= d (the masked c < d could overflow).
    lag_CxC = jnp.where(causal_CxC, jnp.arange(C)[:, None] - jnp.arange(C)[None, :], 0)
    weights_BxNxHxCxC = weights_BxNxHxCxC * jnp.exp(lag_CxC * log_gamma_H[:, None, None])
  num_BxNxCxHxV = dot("bnhcd,bndhv->bnchv", weights_BxNxHxCxC.astype(v_BxNxCxHxV.dtype), v_BxNxCxHxV)
  return num_BxNxCxHxV, den_BxNxCxH


def _add_incoming(S_in_BxNxHxFxV, z_in_BxNxHxF, state: TaylorState, last_BxN, ell_1xNxH):
  """The incoming state added to the states entering the chunks while its document (document 0)
  lasts, S decayed over the chunks before."""
  B, N = S_in_BxNxHxFxV.shape[:2]
  in_first_BxN = jnp.ones((B, N), bool)
  if last_BxN is not None:  # the state entering chunk n is in document last_{n-1}
    in_first_BxN = jnp.concatenate([in_first_BxN[:, :1], last_BxN[:, :-1] == 0], axis=1)
  weight_BxNxH = jnp.broadcast_to(in_first_BxN[..., None], (B, N, S_in_BxNxHxFxV.shape[2])).astype(F32)
  if ell_1xNxH is not None:
    weight_BxNxH = weight_BxNxH * jnp.exp(jnp.cumsum(ell_1xNxH, axis=1) - ell_1xNxH)
  S_in = S_in_BxNxHxFxV + weight_BxNxH[..., None, None] * state.S[:, None]
  z_in = z_in_BxNxHxF + in_first_BxN[..., None, None] * state.z[:, None]
  return S_in, z_in


def _state_leaving(y_in_BxNx, x_BxNx, last_BxN, ell_1xNxH=None) -> jax.Array:
  """The state leaving the last chunk: what entered it (decayed across it, if the chunk continues that
  document) plus its own increment."""
  entering = y_in_BxNx[:, -1]
  if ell_1xNxH is not None:
    entering = jnp.exp(ell_1xNxH[:, -1]).reshape(1, -1, *(1,) * (entering.ndim - 2)) * entering
  if last_BxN is not None:  # the state entering the last chunk is in document last_{N-2} (0 for N = 1)
    entering_doc_B = last_BxN[:, -2] if last_BxN.shape[1] > 1 else jnp.zeros_like(last_BxN[:, 0])
    keep_B = entering_doc_B == last_BxN[:, -1]
    entering = jnp.where(keep_B.reshape(-1, *(1,) * (entering.ndim - 1)), entering, 0.0)
  return entering + x_BxNx[:, -1]


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
