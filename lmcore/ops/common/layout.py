"""Array layouts the ops share: token positions and the heads-first, padded layout of the kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lmcore.ops.common.pallas_utils import pad_axis


def default_positions(batch_size: int, length: int, start_B: jax.Array | None = None) -> jax.Array:
  """Positions ``start + 0..T-1`` as int32 [B, T]."""
  pos_BxT = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch_size, length))
  if start_B is not None:
    pos_BxT = pos_BxT + start_B.astype(jnp.int32)[:, None]
  return pos_BxT


def check_shapes(op: str, expected: dict, q_shape, v_shape) -> None:
  """ValueError for the first ``name: (got, want)`` of ``expected`` whose shapes differ."""
  for name, (got, want) in expected.items():
    if tuple(got) != tuple(want):
      raise ValueError(f"{op}: {name} has shape {tuple(got)}, expected {tuple(want)} (q {tuple(q_shape)} is "
                       f"[B, T, H, K], v {tuple(v_shape)} is [B, T, H, V])")


def heads_first(x_BxTxHxF: jax.Array, Tp: int, Fp: int) -> jax.Array:
  """[B, T, H, F] -> [B·H, Tp, Fp], zero padded along time and features."""
  B, T, H, F = x_BxTxHxF.shape
  x = jnp.swapaxes(x_BxTxHxF, 1, 2).reshape(B * H, T, F)
  return pad_axis(pad_axis(x, 1, Tp), 2, Fp)
