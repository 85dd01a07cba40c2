"""The tiled XLA forms of SANATAN attention (MATH §1.1 step 6, §1.2).

* ``blocked``: ``reference.parallel``'s sum tiled over query and key blocks; no T x T array is ever
  held, in the forward or (through rematerialisation of each query block) the backward pass.
  Scores lie in [0, 1] after division by c, so no running maximum is needed. Any p and channels.
* ``chunked`` (p = 1, 6ch): chunked linear attention, intra-chunk causal block + fp32 state.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sanatan_jax.ops.sanatan_attention import base
from sanatan_jax.ops.sanatan_attention.base import EPS, F32, Options, SanatanState, einsum


def _to_blocks(x_BxTx: jax.Array, size: int, pad_mode: str = "constant") -> jax.Array:
  """[B, T, ...] -> [N, B, size, ...], padding T up to N * size."""
  B, T = x_BxTx.shape[:2]
  n = -(-T // size)
  pad = [(0, 0), (0, n * size - T)] + [(0, 0)] * (x_BxTx.ndim - 2)
  x = jnp.pad(x_BxTx, pad, mode=pad_mode)
  return x.reshape(B, n, size, *x.shape[2:]).swapaxes(0, 1)


def _from_blocks(x_NxBxCx: jax.Array, length: int) -> jax.Array:
  """[N, B, C, ...] -> [B, length, ...]."""
  N, B, C = x_NxBxCx.shape[:3]
  return x_NxBxCx.swapaxes(0, 1).reshape(B, N * C, *x_NxBxCx.shape[3:])[:, :length]


def blocked(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array, lam_raw: jax.Array, *,
            positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
            state: SanatanState | None = None,
            options: Options = Options()) -> tuple[jax.Array, SanatanState | None]:
  """``reference.parallel`` in blocks of ``options.block_size``: memory O(T * block) (padded keys
  sit after every real query)."""
  x = base.prepare(q, k, omega, lam_raw, positions, segment_ids, state, options)
  T = q.shape[1]
  C = min(options.block_size, T)
  weights = functools.partial(base.power_weights, p=options.p, channels=options.channels,
                              three_channel=options.three_channel, d=q.shape[-1])
  q_NxBxCxHxF, k_NxBxCxHxF = _to_blocks(x.phi_q, C), _to_blocks(x.phi_k, C)
  v_NxBxCxHxV, doc_NxBxC = _to_blocks(v, C), _to_blocks(x.doc, C)
  n = q_NxBxCxHxF.shape[0]
  offsets_C = jnp.arange(C)

  def key_step(i, q_BxCxHxF, doc_q_BxC, carry, xs):
    j, k_BxCxHxF, v_BxCxHxV, doc_k_BxC = xs

    def accumulate(carry):
      num_BxCxHxV, den_BxHxC = carry
      s_BxHxCxC = einsum("bqhf,bkhf->bhqk", q_BxCxHxF, k_BxCxHxF)
      causal_CxC = (i * C + offsets_C)[:, None] >= (j * C + offsets_C)[None, :]
      mask_BxCxC = causal_CxC[None] & (doc_q_BxC[:, :, None] == doc_k_BxC[:, None, :])
      w_BxHxCxC = weights(s_BxHxCxC, mask_BxCxC[:, None])
      num_BxCxHxV += einsum("bhqk,bkhv->bqhv", w_BxHxCxC.astype(v_BxCxHxV.dtype), v_BxCxHxV)
      return num_BxCxHxV, den_BxHxC + jnp.sum(w_BxHxCxC, axis=-1)

    # Key blocks after the query block are fully masked: skip their work.
    return jax.lax.cond(j <= i, accumulate, lambda c: c, carry), None

  # Remat per query block: the backward pass recomputes one block row at a time, so its residuals
  # are O(T * block) instead of the T x T scores.
  @jax.checkpoint
  def query_block(i, q_BxCxHxF, doc_q_BxC, k_blocks, v_blocks, doc_blocks):
    B, _, H, _ = q_BxCxHxF.shape
    init = (jnp.zeros((B, C, H, v.shape[-1]), F32), jnp.zeros((B, H, C), F32))
    step = functools.partial(key_step, i, q_BxCxHxF, doc_q_BxC)
    (num, den), _ = jax.lax.scan(step, init, (jnp.arange(n), k_blocks, v_blocks, doc_blocks))
    return num, den.transpose(0, 2, 1)

  num_N, den_N = jax.lax.map(
      lambda xs: query_block(*xs, k_NxBxCxHxF, v_NxBxCxHxV, doc_NxBxC),
      (jnp.arange(n), q_NxBxCxHxF, doc_NxBxC))
  return base.power_output(_from_blocks(num_N, T), _from_blocks(den_N, T), v, x, state, options)


def chunked(q: jax.Array, k: jax.Array, v: jax.Array, omega: jax.Array, lam_raw: jax.Array, *,
            positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
            state: SanatanState | None = None,
            options: Options = Options()) -> tuple[jax.Array, SanatanState]:
  """The chunked p = 1 form in chunks of ``options.chunk_size``: o [B, T, H, dv] in v's dtype and
  the final state (MATH §1.2)."""
  x = base.prepare(q, k, omega, lam_raw, positions, segment_ids, state, options)
  B, T, H, _ = q.shape
  S_BxHxFxV, z_BxHxF = base.start_state(state, B, H, x.phi_q.shape[-1], v.shape[-1])
  C = min(options.chunk_size, T)
  # Edge-padding the document index keeps padded (zero-feature) tokens in the last document, so
  # they neither reset the state nor add to it.
  xs = (_to_blocks(x.phi_q, C), _to_blocks(x.phi_k, C), _to_blocks(v, C),
        _to_blocks(x.doc, C, pad_mode="edge"))
  causal_CxC = jnp.tril(jnp.ones((C, C), bool))
  c = x.c

  def step(carry, xs):
    S_BxHxFxV, z_BxHxF, doc_prev_B = carry
    q_BxCxHxF, k_BxCxHxF, v_BxCxHxV, doc_BxC = xs
    same_doc_BxCxC = doc_BxC[:, :, None] == doc_BxC[:, None, :]
    s_BxHxCxC = einsum("bqhf,bkhf->bhqk", q_BxCxHxF, k_BxCxHxF)
    s_BxHxCxC = jnp.where(causal_CxC[None, None] & same_doc_BxCxC[:, None], s_BxHxCxC, 0.0)
    reads_state_BxCx1 = (doc_BxC == doc_prev_B[:, None])[:, :, None]
    state_num_BxCxHxV = einsum("bqhf,bhfv->bqhv", q_BxCxHxF, S_BxHxFxV)
    num_BxCxHxV = (einsum("bhqk,bkhv->bqhv", s_BxHxCxC.astype(v_BxCxHxV.dtype), v_BxCxHxV)
                   + reads_state_BxCx1[..., None] * state_num_BxCxHxV)
    den_BxCxH = (jnp.sum(s_BxHxCxC, axis=-1).transpose(0, 2, 1)
                 + reads_state_BxCx1 * einsum("bqhf,bhf->bqh", q_BxCxHxF, z_BxHxF))
    o_BxCxHxV = num_BxCxHxV / (den_BxCxH[..., None] + c * EPS)
    doc_last_B = doc_BxC[:, -1]
    keep_B = doc_last_B == doc_prev_B
    k_last_BxCxHxF = jnp.where((doc_BxC == doc_last_B[:, None])[:, :, None, None], k_BxCxHxF, 0)
    S_BxHxFxV = (jnp.where(keep_B[:, None, None, None], S_BxHxFxV, 0.0)
                 + einsum("bkhf,bkhv->bhfv", k_last_BxCxHxF, v_BxCxHxV))
    z_BxHxF = (jnp.where(keep_B[:, None, None], z_BxHxF, 0.0)
               + jnp.sum(k_last_BxCxHxF.astype(F32), axis=1))
    return (S_BxHxFxV, z_BxHxF, doc_last_B), o_BxCxHxV

  init = (S_BxHxFxV, z_BxHxF, jnp.zeros((B,), jnp.int32))
  (S_BxHxFxV, z_BxHxF, _), o_NxBxCxHxV = jax.lax.scan(step, init, xs)
  new_state = SanatanState(S_BxHxFxV, z_BxHxF, base.next_position(x.positions))
  return _from_blocks(o_NxBxCxHxV, T).astype(v.dtype), new_state
