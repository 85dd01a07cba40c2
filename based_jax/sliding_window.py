"""Sliding-window softmax attention of BASED (MATH §2.2, based_zoology §3); rotary from lmcore.

Query i attends to keys i-window .. i of its own document (``window + 1`` keys), softmax in fp32
with scale head_dim^-1/2. ``window`` is the true look-back: the released PyTorch configs say
128 / 256 but pass ``window_size // 2`` to flash-attn, so those models looked back 64 / 128 tokens;
a config reproducing them sets ``window=64`` / ``128`` here.

Visibility is decided on absolute token indices (tokens seen since the start of the stream), so the
same rule serves the full-sequence forward, a prefill after a state, and one-token decode:
key p is visible to query i iff ``max(i - window, doc_start_i) <= p <= i``, where ``doc_start_i`` is
the index at which i's document began (0 without segment ids; a change of segment id starts one).

Decode state: a ring buffer of the last ``window + 1`` (rotated) keys and values; the key of token p
sits in slot ``p mod (window + 1)``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from lmcore.mixers.rotary import rotary  # noqa: F401  (re-exported: BASED's SWA uses it)
from lmcore.ops.common.segments import document_starts

IMPLEMENTATIONS: tuple[str, ...] = ("blocked", "full")
# Finite, so that a padded query row with no visible key gives a harmless uniform softmax, not NaN.
_MASKED = -1e30


class WindowState(NamedTuple):
  """Ring buffer of the last ``window + 1`` keys/values and the stream counters."""

  k: jax.Array  # [B, window + 1, H, K] rotated keys; token p in slot p mod (window + 1)
  v: jax.Array  # [B, window + 1, H, V]
  length: jax.Array  # [B] int32: tokens seen so far
  start: jax.Array  # [B] int32: index of the first token of the current document


def zero_window_state(batch_size: int, window: int, n_heads: int, key_dim: int, value_dim: int,
                      dtype=jnp.float32) -> WindowState:
  """The start-of-sequence state (empty ring buffer)."""
  slots = window + 1
  return WindowState(k=jnp.zeros((batch_size, slots, n_heads, key_dim), dtype),
                     v=jnp.zeros((batch_size, slots, n_heads, value_dim), dtype),
                     length=jnp.zeros((batch_size,), jnp.int32),
                     start=jnp.zeros((batch_size,), jnp.int32))


def sliding_window_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, window: int, state: WindowState | None = None,
    segment_ids: jax.Array | None = None, implementation: str = "blocked",
    block_size: int = 64) -> tuple[jax.Array, WindowState]:
  """Causal sliding-window softmax attention (module docstring) with an optional ring-buffer state.

  Args:
    q, k: rotated queries / keys [B, T, H, K]; v: values [B, T, H, V].
    window: true look-back; token i sees keys i-window .. i.
    state: the ring buffer after a prefix of this stream, or None for the start of a stream.
    segment_ids: packed-document ids [B, T]; an incoming state continues the first run of ids.
    implementation: ``full`` (scores against every key of the call, masked) or ``blocked``
      (query blocks of ``max(block_size, window)`` tokens against their own and the previous block:
      O(T · block) instead of O(T²)). Same function.

  Returns:
    ``(o, new_state)``: o [B, T, H, V] in v's dtype; the ring buffer after the last token.
  """
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"unknown implementation {implementation!r}; "
                     f"valid: {', '.join(IMPLEMENTATIONS)}")
  if window < 0:
    raise ValueError(f"window must be >= 0, got {window}")
  batch, length = q.shape[:2]
  init = state if state is not None else zero_window_state(batch, window, *k.shape[2:],
                                                           v.shape[-1], k.dtype)
  pos_BxT = init.length[:, None] + jnp.arange(length, dtype=jnp.int32)
  doc_start_BxT = _doc_starts(pos_BxT, init.start, segment_ids)
  # Without an incoming state the ring buffer is empty: skip its keys altogether.
  ring = None if state is None else (init.k, init.v, _ring_positions(init.length, window + 1))
  # One token (decoding) attends to the ring and itself directly: blocks would only add padding.
  attend = _attend_full if implementation == "full" or length == 1 else _attend_blocked
  o = attend(q, k, v, pos_BxT, doc_start_BxT, ring, window=window, block_size=block_size)
  return o, _advance(init, k, v, doc_start_BxT[:, -1])


def _doc_starts(pos_BxT, start_B, segment_ids_BxT):
  """Absolute index where each token's document began; run 0 continues the incoming ``start``."""
  if segment_ids_BxT is None:
    return jnp.broadcast_to(start_B[:, None], pos_BxT.shape)
  new_doc_BxT = document_starts(segment_ids_BxT, *pos_BxT.shape)
  return jax.lax.cummax(jnp.where(new_doc_BxT, pos_BxT, start_B[:, None]), axis=1)


def _ring_positions(length_B, slots):
  """Token index held by each slot: the latest p < length with p = slot (mod slots); < 0 if none."""
  slot_R = jnp.arange(slots, dtype=jnp.int32)
  return (length_B[:, None] - 1) - jnp.mod(length_B[:, None] - 1 - slot_R, slots)


def _advance(state, k_BxTxHxK, v_BxTxHxV, last_start_B):
  """Write the call's keys/values into the ring (the last ``window + 1`` of them win)."""
  length = k_BxTxHxK.shape[1]
  new_length_B = state.length + length
  if length == 1:  # decoding: write the one slot of each row in place, not the whole ring
    slot_B = jnp.mod(state.length, state.k.shape[1])
    write_slot = jax.vmap(lambda ring, new, slot: jax.lax.dynamic_update_slice_in_dim(
        ring, new.astype(ring.dtype), slot, axis=0))
    return WindowState(write_slot(state.k, k_BxTxHxK, slot_B), write_slot(state.v, v_BxTxHxV, slot_B),
                       new_length_B, last_start_B)
  held_BxR = _ring_positions(new_length_B, state.k.shape[1])
  fresh_BxR = held_BxR >= state.length[:, None]
  idx_BxRx1x1 = jnp.clip(held_BxR - state.length[:, None], 0, length - 1)[..., None, None]

  def write(ring, new):
    taken = jnp.take_along_axis(new, idx_BxRx1x1, axis=1).astype(ring.dtype)
    return jnp.where(fresh_BxR[..., None, None], taken, ring)

  return WindowState(write(state.k, k_BxTxHxK), write(state.v, v_BxTxHxV), new_length_B,
                     last_start_B)


def _softmax_attend(q_ZxTxHxK, k_ZxSxHxK, v_ZxSxHxV, visible_ZxTxS):
  """Masked softmax attention, scores and softmax in fp32, scale head_dim^-1/2."""
  scale = q_ZxTxHxK.shape[-1] ** -0.5
  s_ZxHxTxS = jnp.einsum("...thk,...shk->...hts", q_ZxTxHxK, k_ZxSxHxK,
                         precision=jax.lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32) * scale
  s_ZxHxTxS = jnp.where(visible_ZxTxS[..., None, :, :], s_ZxHxTxS, _MASKED)
  p_ZxHxTxS = jax.nn.softmax(s_ZxHxTxS, axis=-1)
  o = jnp.einsum("...hts,...shv->...thv", p_ZxHxTxS.astype(v_ZxSxHxV.dtype), v_ZxSxHxV,
                 precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return o.astype(v_ZxSxHxV.dtype)


def _visible(q_pos_ZxT, k_pos_ZxS, doc_start_ZxT, window):
  """Key p visible to query i iff max(i - window, doc_start_i) <= p <= i."""
  i, p = q_pos_ZxT[..., :, None], k_pos_ZxS[..., None, :]
  return (p <= i) & (p >= i - window) & (p >= doc_start_ZxT[..., :, None])


def _prepend(ring_BxRx_, x_Bx_):
  """Put ring-buffer entries before the key axis of x, which may carry block axes after B."""
  extra = x_Bx_.ndim - ring_BxRx_.ndim
  ring = jnp.expand_dims(ring_BxRx_, tuple(range(1, 1 + extra)))
  ring = jnp.broadcast_to(ring, x_Bx_.shape[:1 + extra] + ring_BxRx_.shape[1:])
  return jnp.concatenate([ring.astype(x_Bx_.dtype), x_Bx_], axis=1 + extra)


def _attend_full(q, k, v, pos_BxT, doc_start_BxT, ring, *, window, block_size):
  """Every query against every key of the call (and the ring), masked."""
  del block_size
  k_pos_BxS = pos_BxT
  if ring is not None:
    k, v, k_pos_BxS = (_prepend(r, x) for r, x in zip(ring, (k, v, pos_BxT)))
  return _softmax_attend(q, k, v, _visible(pos_BxT, k_pos_BxS, doc_start_BxT, window))


def _attend_blocked(q, k, v, pos_BxT, doc_start_BxT, ring, *, window, block_size):
  """Query blocks of C >= window tokens against the previous and the current block (and the ring).

  C >= window guarantees that keys i-window .. i all lie in those two blocks. The sequence is padded
  to whole blocks; padded keys come after every real query, so causality hides them.
  """
  batch, length = q.shape[:2]
  size = min(max(block_size, window), length)
  n_blocks = -(-length // size)
  pad = n_blocks * size - length

  def blocks(x_BxTx_, mode="constant"):
    x = jnp.pad(x_BxTx_, [(0, 0), (0, pad)] + [(0, 0)] * (x_BxTx_.ndim - 2), mode=mode)
    return x.reshape(batch, n_blocks, size, *x_BxTx_.shape[2:])

  def with_previous(x_BxNxCx_):
    previous = jnp.concatenate([jnp.zeros_like(x_BxNxCx_[:, :1]), x_BxNxCx_[:, :-1]], axis=1)
    return jnp.concatenate([previous, x_BxNxCx_], axis=2)

  pos_BxNxC = pos_BxT[:, :1, None] + jnp.arange(n_blocks * size, dtype=jnp.int32).reshape(
      n_blocks, size)
  # Block 0 has no previous block (earlier tokens come from the ring): position -1 is never visible.
  previous_pos_BxNxC = jnp.where(jnp.arange(n_blocks)[:, None] == 0, -1, pos_BxNxC - size)
  k_pos_BxNxS = jnp.concatenate([previous_pos_BxNxC, pos_BxNxC], axis=2)
  k_BxNxSxHxK, v_BxNxSxHxV = with_previous(blocks(k)), with_previous(blocks(v))
  if ring is not None:
    k_BxNxSxHxK, v_BxNxSxHxV, k_pos_BxNxS = (
        _prepend(r, x) for r, x in zip(ring, (k_BxNxSxHxK, v_BxNxSxHxV, k_pos_BxNxS)))
  visible_BxNxCxS = _visible(pos_BxNxC, k_pos_BxNxS, blocks(doc_start_BxT, mode="edge"), window)
  o_BxNxCxHxV = _softmax_attend(blocks(q), k_BxNxSxHxK, v_BxNxSxHxV, visible_BxNxCxS)
  return o_BxNxCxHxV.reshape(batch, n_blocks * size, *o_BxNxCxHxV.shape[3:])[:, :length]
