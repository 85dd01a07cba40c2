"""Chunked gated linear attention in pure JAX (the algorithm of FLA's chunk_simple_gla / chunk_gla).

Per chunk n of C tokens, with b_i the fp32 sum of g over the chunk up to and including token i::

    o_i     = scale * [(q_i ⊙ exp(b_i)) S_n + sum_{j<=i} (sum_k q_ik k_jk exp(b_ik - b_jk)) v_j]
    S_{n+1} = diag(exp(b_C)) S_n + sum_j (k_j ⊙ exp(b_C - b_j)) v_jᵀ

Every exponent is a difference b_i - b_j with j <= i, so <= 0 for gates <= 0; pairs j > i are masked
to -inf before ``exp``: nothing overflows however strong the decay. A scalar gate makes the intra-chunk
scores one matmul times a decay matrix; a per-key-channel gate uses FLA's secondary chunking: blocks
below the diagonal as a matmul of q ⊙ exp(b - b_r) and k ⊙ exp(b_r - b) around the first row r of the
query sub-chunk (``SUB_CHUNK`` tokens), diagonal blocks elementwise in fp32.

Matmul operands stay in the input dtype (fp32 accumulation); gates, decays, scores and states are
fp32. Intra-chunk work runs for all chunks at once, head-major [B, H, N, C, ·]; ``lax.scan`` carries
only the state. The last chunk is padded with k = v = g = 0. Documents (``doc_BxT``): a token reads
the carried state only in the state's document, and a chunk hands on only its last document's writes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lmcore.ops.common.backend import ChunkedBackend, ChunkTiles, check_power_of_two
from lmcore.ops.gated_linear_attention.base import OP, Options, Problem, chunked_flops

SUB_CHUNK = 16


def _dot(spec: str, *operands):
  return jnp.einsum(spec, *operands, precision=jax.lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32)


class _DocumentMasks(NamedTuple):
  """Which pairs and tokens interact inside each chunk of packed documents."""

  same_doc_BxNxCxC: jax.Array  # query i and key j are in the same document
  reads_state_BxNxC: jax.Array  # token is in the document the incoming state belongs to
  writes_out_BxNxC: jax.Array  # token is in the chunk's last document (reaches the next state)
  keeps_state_BxN: jax.Array  # no document starts inside the chunk


def _document_masks(doc_BxNxC: jax.Array) -> _DocumentMasks:
  B, N, C = doc_BxNxC.shape
  flat_BxL = doc_BxNxC.reshape(B, N * C)
  previous_BxL = jnp.concatenate([flat_BxL[:, :1], flat_BxL[:, :-1]], axis=1)
  state_doc_BxN = previous_BxL.reshape(B, N, C)[:, :, 0]
  last_doc_BxN = doc_BxNxC[:, :, -1]
  return _DocumentMasks(
      same_doc_BxNxCxC=doc_BxNxC[..., :, None] == doc_BxNxC[..., None, :],
      reads_state_BxNxC=doc_BxNxC == state_doc_BxN[..., None],
      writes_out_BxNxC=doc_BxNxC == last_doc_BxN[..., None],
      keeps_state_BxN=last_doc_BxN == state_doc_BxN)


def _scores_scalar_gate(q_BxHxNxCxK, k_BxHxNxCxK, b_BxHxNxCx1, visible_BxNxCxC):
  """A_ij = (q_i · k_j) exp(b_i - b_j) for visible j <= i; one matmul and a decay matrix."""
  C = q_BxHxNxCxK.shape[3]
  qk_BxHxNxCxC = _dot("bhnik,bhnjk->bhnij", q_BxHxNxCxK, k_BxHxNxCxK)
  b_BxHxNxC = b_BxHxNxCx1[..., 0]
  diff_BxHxNxCxC = b_BxHxNxC[..., :, None] - b_BxHxNxC[..., None, :]
  visible_Bx1xNxCxC = (visible_BxNxCxC & jnp.tril(jnp.ones((C, C), bool)))[:, None]
  return qk_BxHxNxCxC * jnp.exp(jnp.where(visible_Bx1xNxCxC, diff_BxHxNxCxC, -jnp.inf))


def _scores_channel_gate(q_BxHxNxCxK, k_BxHxNxCxK, b_BxHxNxCxK, visible_BxNxCxC):
  """A_ij = sum_k q_ik k_jk exp(b_ik - b_jk) for visible j <= i, by secondary chunking."""
  B, H, N, C, K = q_BxHxNxCxK.shape
  c = min(SUB_CHUNK, C)
  M = C // c
  sub = lambda x: x.reshape(B, H, N, M, c, K)
  q_sub, k_sub, b_sub = sub(q_BxHxNxCxK), sub(k_BxHxNxCxK), sub(b_BxHxNxCxK)
  f32 = jnp.float32
  # Blocks below the diagonal: key sub-chunk before the query sub-chunk, split at its first row.
  b_ref_BxHxNxMxK = b_sub[..., 0, :]
  q_off = q_sub.astype(f32) * jnp.exp(b_sub - b_ref_BxHxNxMxK[..., None, :])
  before_MxC = jnp.arange(C)[None, :] < (jnp.arange(M) * c)[:, None]
  ref_minus_b_BxHxNxMxCxK = b_ref_BxHxNxMxK[..., None, :] - b_BxHxNxCxK[..., None, :, :]
  k_off = k_BxHxNxCxK[..., None, :, :].astype(f32) * jnp.exp(
      jnp.where(before_MxC[..., None], ref_minus_b_BxHxNxMxCxK, -jnp.inf))
  dtype = q_BxHxNxCxK.dtype
  A_off_BxHxNxMxcxC = _dot("bhnmik,bhnmjk->bhnmij", q_off.astype(dtype), k_off.astype(dtype))
  # Diagonal blocks, exactly and elementwise in fp32.
  diff_BxHxNxMxcxcxK = b_sub[..., :, None, :] - b_sub[..., None, :, :]
  causal_cxcx1 = jnp.tril(jnp.ones((c, c), bool))[..., None]
  decay = jnp.exp(jnp.where(causal_cxcx1, diff_BxHxNxMxcxcxK, -jnp.inf))
  pairs = q_sub[..., :, None, :].astype(f32) * k_sub[..., None, :, :].astype(f32) * decay
  A_diag_BxHxNxMxcxc = pairs.sum(-1)
  A_BxHxNxMxcxMxc = (A_off_BxHxNxMxcxC.reshape(B, H, N, M, c, M, c)
                     + A_diag_BxHxNxMxcxc[..., None, :] * jnp.eye(M)[:, None, :, None])
  A_BxHxNxCxC = A_BxHxNxMxcxMxc.reshape(B, H, N, C, C)
  return jnp.where(visible_BxNxCxC[:, None], A_BxHxNxCxC, 0.0)


def _chunk_states(k_BxHxNxCxK, v_BxHxNxCxV, b_BxHxNxCxG, S0_BxHxKxV, masks: _DocumentMasks):
  """States at the start of every chunk [B, H, N, K, V] and after the last one, by ``lax.scan``."""
  b_end_BxHxNxG = b_BxHxNxCxG[..., -1, :]
  to_end = jnp.where(masks.writes_out_BxNxC[:, None, :, :, None],
                     b_end_BxHxNxG[..., None, :] - b_BxHxNxCxG, -jnp.inf)
  k_end = (k_BxHxNxCxK.astype(jnp.float32) * jnp.exp(to_end)).astype(k_BxHxNxCxK.dtype)
  writes_BxHxNxKxV = _dot("bhnjk,bhnjv->bhnkv", k_end, v_BxHxNxCxV)
  decay_BxHxNxG = jnp.where(masks.keeps_state_BxN[:, None, :, None], jnp.exp(b_end_BxHxNxG), 0.0)

  def step(S_BxHxKxV, inputs):
    decay_BxHxG, writes = inputs
    return decay_BxHxG[..., None] * S_BxHxKxV + writes, S_BxHxKxV

  S_end, S_start_NxBxHxKxV = jax.lax.scan(
      step, S0_BxHxKxV, (jnp.moveaxis(decay_BxHxNxG, 2, 0), jnp.moveaxis(writes_BxHxNxKxV, 2, 0)))
  return jnp.moveaxis(S_start_NxBxHxKxV, 0, 2), S_end


def chunked(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxG, S0_BxHxKxV, *, scale: float, doc_BxT,
            chunk_size: int, remat: bool = True):
  """The backend contract of ``base``; ``chunk_size`` a power of two.

  ``remat``: the backward recomputes the forward from the inputs (``jax.checkpoint``), so only q, k, v,
  g, S0 and the document index wait for it, instead of the chunk states [B, H, N, K, V], the blocks
  [B, H, N, C, C], the decayed q and k and, per-channel, the diagonal terms [B, H, N, C/c, c, c, K];
  same outputs and gradients, one more forward pass of the op.
  """
  check_power_of_two(OP, chunk_size=chunk_size)
  core = functools.partial(_chunked_core, scale=scale, chunk_size=chunk_size)
  if remat:
    core = jax.checkpoint(core)
  return core(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxG, S0_BxHxKxV, doc_BxT)


def _chunked_core(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxHxG, S0_BxHxKxV, doc_BxT, *,
                  scale: float, chunk_size: int):
  """``chunked`` without the recomputation (what autodiff differentiates)."""
  B, T, H, _ = q_BxTxHxK.shape
  V = v_BxTxHxV.shape[-1]
  C = chunk_size
  N = -(-T // C)
  pad = N * C - T

  def chunks(x_BxTxHxF):
    x_BxTxHxF = jnp.pad(x_BxTxHxF, [(0, 0), (0, pad), (0, 0), (0, 0)])
    return jnp.moveaxis(x_BxTxHxF, 2, 1).reshape(B, H, N, C, x_BxTxHxF.shape[-1])

  q, k, v = chunks(q_BxTxHxK), chunks(k_BxTxHxK), chunks(v_BxTxHxV)
  b_BxHxNxCxG = jnp.cumsum(chunks(g_BxTxHxG.astype(jnp.float32)), axis=3)
  masks = _document_masks(jnp.pad(doc_BxT, [(0, 0), (0, pad)], mode="edge").reshape(B, N, C))
  scores = _scores_scalar_gate if b_BxHxNxCxG.shape[-1] == 1 else _scores_channel_gate
  A_BxHxNxCxC = scale * scores(q, k, b_BxHxNxCxG, masks.same_doc_BxNxCxC)
  o_intra = _dot("bhnij,bhnjv->bhniv", A_BxHxNxCxC.astype(v.dtype), v)
  S_start_BxHxNxKxV, S_end_BxHxKxV = _chunk_states(k, v, b_BxHxNxCxG, S0_BxHxKxV, masks)
  q_from_state = jnp.where(masks.reads_state_BxNxC[:, None, :, :, None],
                           q.astype(jnp.float32) * jnp.exp(b_BxHxNxCxG), 0.0)
  o_inter = scale * _dot("bhnik,bhnkv->bhniv", q_from_state.astype(q.dtype),
                         S_start_BxHxNxKxV.astype(q.dtype))
  o_BxHxTxV = (o_intra + o_inter).reshape(B, H, N * C, V)[:, :, :T]
  return jnp.moveaxis(o_BxHxTxV, 1, 2), S_end_BxHxKxV


class Chunked(ChunkedBackend):
  """``chunked`` as a backend (chunks of a power of two tokens)."""

  def flops_per_head(self, problem: Problem, tiles: ChunkTiles | None = None) -> float:
    return chunked_flops(problem, self.config(problem, tiles).chunk)

  def __call__(self, q, k, v, g, S0, *, scale: float, doc_BxT, tiles: ChunkTiles, options: Options):
    return chunked(q, k, v, g, S0, scale=scale, doc_BxT=doc_BxT, chunk_size=tiles.chunk,
                   remat=options.remat)
