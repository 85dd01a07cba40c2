"""The states entering the chunks of a chunked linear-attention form, as blocked masked matmuls (XLA).

Per batch row, chunk n adds x_n (its keys' part of the state, decayed to its end, of its last document
only) and the state entering chunk n is

    y_n = Σ_{m<n} [last_m = last_{n-1}] exp(Λ_{n-1} - Λ_m) x_m,    Λ_n = Σ_{j<=n} ℓ_j,

where ``last`` [B, N] is the (non-decreasing) document of the state leaving each chunk and ``ℓ``
[B, N, H] the log-decay of a state across chunk n (per head; 0 without decay). ``chunk_prefix_sum``
computes it in blocks of chunks by exact 0/1 (or decay-weighted) fp32 matmuls, linear in the number of
chunks; ``jnp.cumsum`` lowers on TPUs to a reduction window spanning every chunk (quadratic), and
``chunk_scan`` is the general recurrence with a factor per state row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
# Blocks of chunks, by platform: each level is a batched fp32 matmul by a block x block mask (2 * block
# FLOPs per state element). A TPU's MXU contracts 128 as fast as 16, and one level of 128 chunks needs
# no layout copies of the state stack; GPUs multiply fp32 at full precision without tensor cores, where
# the FLOPs count.
PREFIX_BLOCK = {"tpu": 128}
DEFAULT_PREFIX_BLOCK = 16


def prefix_block(platform: str) -> int:
  """The blocks of chunks ``chunk_prefix_sum`` takes on ``platform``."""
  return PREFIX_BLOCK.get(platform, DEFAULT_PREFIX_BLOCK)


def chunk_prefix_sum(x_BxNx: jax.Array, last_BxN: jax.Array | None = None,
                     block: int = DEFAULT_PREFIX_BLOCK,
                     log_decay_BxNxH: jax.Array | None = None) -> jax.Array:
  """The states entering the chunks (module docstring), fp32 [B, N, ...] like ``x`` along axis 1;
  ``last`` None: one document; ``log_decay`` None: no decay, else ℓ [B or 1, N, H] for the heads on
  axis 2 of ``x``.

  In blocks of at most ``block`` chunks, y_n = E_n + [last_{n-1} = last_{s-1}] exp(Λ_{n-1} - Λ_{s-1}) Y_b
  for chunk n of block b starting at chunk s: E_n sums the block's chunks before n (one batched matmul
  by a masked weight matrix), Y_b is this function of the blocks' totals.
  """
  B, N = x_BxNx.shape[:2]
  x_BxNx = x_BxNx.astype(F32)
  if last_BxN is None:
    last_BxN = jnp.zeros((B, N), jnp.int32)
  if log_decay_BxNxH is not None:
    log_decay_BxNxH = jnp.broadcast_to(log_decay_BxNxH.astype(F32), (B, N, x_BxNx.shape[2]))
  prev_BxN = jnp.concatenate([last_BxN[:, :1], last_BxN[:, :-1]], axis=1)  # last_{n-1}
  if N <= block:
    one = lambda a: None if a is None else a[:, None]
    return _masked_prefix(x_BxNx[:, None], last_BxN[:, None], prev_BxN[:, None], one(log_decay_BxNxH))[:, 0]
  n_blocks = -(-N // block)
  G = -(-N // n_blocks)
  pad = n_blocks * G - N  # zero chunks after the last one, in its document, without decay

  def blocks(a, mode="constant"):
    return jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), mode=mode).reshape(
        B, n_blocks, G, *a.shape[2:])

  x_BxJxGx, last_BxJxG, prev_BxJxG = blocks(x_BxNx), blocks(last_BxN, "edge"), blocks(prev_BxN, "edge")
  ell_BxJxGxH = None if log_decay_BxNxH is None else blocks(log_decay_BxNxH)
  E_BxJxGx = _masked_prefix(x_BxJxGx, last_BxJxG, prev_BxJxG, ell_BxJxGxH)
  last_BxJ = last_BxJxG[:, :, -1]
  # A block's total: the state leaving it, counting only its own chunks.
  keeps_BxJ = _expand(prev_BxJxG[:, :, -1] == last_BxJ, x_BxNx.ndim)
  carried_last_BxJx = E_BxJxGx[:, :, -1]
  if ell_BxJxGxH is not None:
    carried_last_BxJx = _expand(jnp.exp(ell_BxJxGxH[:, :, -1]), x_BxNx.ndim) * carried_last_BxJx
  total_BxJx = jnp.where(keeps_BxJ, carried_last_BxJx, 0.0) + x_BxJxGx[:, :, -1]
  block_decay_BxJxH = None if ell_BxJxGxH is None else ell_BxJxGxH.sum(2)
  Y_BxJx = chunk_prefix_sum(total_BxJx, last_BxJ, block, block_decay_BxJxH)
  entering_BxJ = jnp.concatenate([last_BxJ[:, :1], last_BxJ[:, :-1]], axis=1)  # last_{s-1}
  carried_BxJxG = _expand(prev_BxJxG == entering_BxJ[:, :, None], x_BxNx.ndim + 1)
  Y_BxJx1x = Y_BxJx[:, :, None]
  if ell_BxJxGxH is not None:  # exp(Λ_{n-1} - Λ_{s-1}): the decay over the block's chunks before n
    before_BxJxGxH = jnp.cumsum(ell_BxJxGxH, axis=2) - ell_BxJxGxH
    Y_BxJx1x = _expand(jnp.exp(before_BxJxGxH), x_BxNx.ndim + 1) * Y_BxJx1x
  y_BxJxGx = E_BxJxGx + jnp.where(carried_BxJxG, Y_BxJx1x, 0.0)
  return y_BxJxGx.reshape(B, n_blocks * G, *x_BxNx.shape[2:])[:, :N]


def _masked_prefix(x_BxJxGx, last_BxJxG, prev_BxJxG, ell_BxJxGxH) -> jax.Array:
  """E_g = Σ_{m<g} [last_m = prev_g] exp(Λ_{g-1} - Λ_m) x_m within each block (axis 2), as one batched
  matmul (Λ the block's cumulative ℓ; without ℓ, a 0/1 matmul)."""
  G = x_BxJxGx.shape[2]
  earlier_1x1xGxG = jnp.tril(jnp.ones((G, G), bool), -1)[None, None]
  mask_BxJxGxG = earlier_1x1xGxG & (prev_BxJxG[..., :, None] == last_BxJxG[..., None, :])
  if ell_BxJxGxH is None:
    return _dot("bjgm,bjm...->bjg...", mask_BxJxGxG.astype(F32), x_BxJxGx)
  Lambda_BxJxHxG = jnp.cumsum(ell_BxJxGxH, axis=2).transpose(0, 1, 3, 2)
  # Λ_{g-1} - Λ_m = (Λ_g - ℓ_g) - Λ_m; a select before exp, so masked entries cannot overflow.
  lag_BxJxHxGxG = (Lambda_BxJxHxG - ell_BxJxGxH.transpose(0, 1, 3, 2))[..., :, None] - Lambda_BxJxHxG[..., None, :]
  weight_BxJxHxGxG = jnp.where(mask_BxJxGxG[:, :, None], jnp.exp(jnp.where(mask_BxJxGxG[:, :, None],
                                                                           lag_BxJxHxGxG, 0.0)), 0.0)
  return _dot("bjhgm,bjmh...->bjgh...", weight_BxJxHxGxG, x_BxJxGx)


def _dot(spec: str, *operands: jax.Array) -> jax.Array:
  return jnp.einsum(spec, *operands, preferred_element_type=F32, precision=jax.lax.Precision.HIGHEST)


def _expand(a_BxJ, ndim: int) -> jax.Array:
  """``a`` with trailing unit axes up to ``ndim`` axes."""
  return a_BxJ.reshape(a_BxJ.shape + (1,) * (ndim - a_BxJ.ndim))
