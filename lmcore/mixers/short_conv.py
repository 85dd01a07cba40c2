"""Depthwise causal short convolution with a decode state (used by Gated DeltaNet, MATH §4).

    y_t = act( sum_{i=0}^{W-1} w_i * x_{t-W+1+i} )      per channel, W = kernel_size,

the W - 1 inputs before the call from the state: the last W - 1 inputs [B, W-1, F] in fp32 (zeros
at a sequence start). Taps are summed in fp32, the output in the input's dtype. ``kernel`` [W, F] is
initialised U(-1/sqrt(W), 1/sqrt(W)) like FLA's ShortConvolution; optional ``bias`` [F] zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from lmcore.mixers.base import float_bytes


class ShortConv(nnx.Module):
  """Depthwise causal convolution over tokens, ``(y [B, T, F], new window [B, W-1, F])``."""

  def __init__(self, features: int, kernel_size: int, *, rngs: nnx.Rngs,
               activation: Callable[[jax.Array], jax.Array] | None = None, use_bias: bool = False):
    if kernel_size < 1:
      raise ValueError(f"ShortConv: kernel_size must be >= 1, got {kernel_size}")
    self.features, self.kernel_size = features, kernel_size
    self.activation = activation
    bound = 1.0 / math.sqrt(kernel_size)
    self.kernel = nnx.Param(jax.random.uniform(rngs.params(), (kernel_size, features), jnp.float32,
                                               -bound, bound))
    self.bias = nnx.Param(jnp.zeros((features,), jnp.float32)) if use_bias else None

  def init_state(self, batch_size: int) -> jax.Array:
    """The zero window [B, W-1, F] fp32: nothing before the first token."""
    return jnp.zeros((batch_size, self.kernel_size - 1, self.features), jnp.float32)

  def state_bytes(self, batch_size: int) -> int:
    return float_bytes((batch_size, self.kernel_size - 1, self.features))

  def __call__(self, x_BxTxF: jax.Array, state: jax.Array | None = None,
               segment_ids_BxT: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise convolution within each document (the incoming window belongs to the first
    token's segment)."""
    batch_size, length, _ = x_BxTxF.shape
    state = self.init_state(batch_size) if state is None else state
    xp_BxLxF = jnp.concatenate([state, x_BxTxF.astype(jnp.float32)], axis=1)
    if segment_ids_BxT is not None:
      ids_BxL = jnp.concatenate(
          [jnp.repeat(segment_ids_BxT[:, :1], self.kernel_size - 1, axis=1), segment_ids_BxT],
          axis=1)
    y_BxTxF = jnp.zeros(x_BxTxF.shape, jnp.float32)
    for i in range(self.kernel_size):
      tap_BxTxF = xp_BxLxF[:, i:i + length]
      if segment_ids_BxT is not None:
        same_BxTx1 = (ids_BxL[:, i:i + length] == segment_ids_BxT)[..., None]
        tap_BxTxF = jnp.where(same_BxTx1, tap_BxTxF, 0.0)
      y_BxTxF = y_BxTxF + tap_BxTxF * self.kernel[i]
    if self.bias is not None:
      y_BxTxF = y_BxTxF + self.bias[...]
    if self.activation is not None:
      y_BxTxF = self.activation(y_BxTxF)
    return y_BxTxF.astype(x_BxTxF.dtype), xp_BxLxF[:, length:]
