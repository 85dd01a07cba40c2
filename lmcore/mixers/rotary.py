"""Rotary position embedding, half-rotation (GPT-NeoX) layout, on the full head dimension."""

import jax
import jax.numpy as jnp


def rotary(x_BxTxHxd: jax.Array, positions_BxT: jax.Array, base: float = 10000.0) -> jax.Array:
  """Rotates pairs (x_i, x_{i+d/2}) by angle pos · base^(-2i/d); computed in fp32, returned in x's dtype."""
  d = x_BxTxHxd.shape[-1]
  if d % 2:
    raise ValueError(f"rotary needs an even head dim, got {d}")
  half = d // 2
  inv_freq_h = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / d)
  angle_BxTx1xh = positions_BxT.astype(jnp.float32)[:, :, None, None] * inv_freq_h[None, None, None, :]
  cos, sin = jnp.cos(angle_BxTx1xh), jnp.sin(angle_BxTx1xh)
  x = x_BxTxHxd.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x_BxTxHxd.dtype)
